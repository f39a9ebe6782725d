/* Outlier-token tracing: the per-head pool update (ott.h). */
#include "kvstore/ott.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kvstore/bytes.h"
#include "kvstore/ott_math.h"

typedef kv_ott_member ott_member;
typedef kv_ott_head ott_head;

struct kv_ott_tracker {
    int n_kv_heads, pool, aux;
    ott_head *heads;       /* [n_kv_heads] */
    ott_member *members;   /* [n_kv_heads][pool] */
};

kv_ott_tracker *kv_ott_tracker_create(int n_kv_heads, int pool_tokens, int aux_tokens)
{
    if (n_kv_heads < 1 || pool_tokens < 0 || pool_tokens > KV_OTT_MAX_POOL || aux_tokens < 0)
        return NULL;   /* 64: the bound kv_codec_validate enforces, and kv_ott_select's buffer */
    kv_ott_tracker *t = calloc(1, sizeof *t);
    if (!t)
        return NULL;
    t->n_kv_heads = n_kv_heads;
    t->pool = pool_tokens;
    t->aux = aux_tokens;
    t->heads = calloc((size_t)n_kv_heads, sizeof *t->heads);
    t->members = calloc((size_t)n_kv_heads * (size_t)(pool_tokens ? pool_tokens : 1), sizeof *t->members);
    if (!t->heads || !t->members) {
        kv_ott_tracker_destroy(t);
        return NULL;
    }
    return t;
}

void kv_ott_tracker_destroy(kv_ott_tracker *t)
{
    if (!t)
        return;
    free(t->heads);
    free(t->members);
    free(t);
}

void kv_ott_tracker_copy(kv_ott_tracker *dst, const kv_ott_tracker *src)
{
    memcpy(dst->heads, src->heads, (size_t)src->n_kv_heads * sizeof *src->heads);
    memcpy(dst->members, src->members,
           (size_t)src->n_kv_heads * (size_t)(src->pool ? src->pool : 1) * sizeof *src->members);
}

static size_t pool_slots(const kv_ott_tracker *t) { return (size_t)(t->pool ? t->pool : 1); }

size_t kv_ott_state_bytes(size_t n_kv_heads, size_t pool_tokens)
{
    return n_kv_heads * (12 + (pool_tokens ? pool_tokens : 1) * 16);
}

void kv_ott_state_save(const kv_ott_head *heads, const kv_ott_member *members, size_t n_kv_heads, size_t pool_tokens,
                       size_t stride, uint8_t *out)
{
    for (size_t h = 0; h < n_kv_heads; h++) {
        const kv_ott_head *hd = &heads[h];
        kv_st32(out, hd->n);
        kv_st32(out + 4, hd->aux_used);
        kv_st32(out + 8, hd->stopped ? 1u : 0u);
        out += 12;
        for (size_t i = 0; i < (pool_tokens ? pool_tokens : 1); i++) {
            const kv_ott_member m = i < pool_tokens ? members[h * stride + i] : (kv_ott_member){0, 0.0};
            uint64_t bits;
            memcpy(&bits, &m.norm, sizeof bits);
            kv_st64(out, m.pos);
            kv_st64(out + 8, bits);
            out += 16;
        }
    }
}

bool kv_ott_state_load(kv_ott_head *heads, kv_ott_member *members, size_t n_kv_heads, size_t pool_tokens,
                       size_t stride, const uint8_t *in, size_t len)
{
    if (len != kv_ott_state_bytes(n_kv_heads, pool_tokens))
        return false;
    for (size_t h = 0; h < n_kv_heads; h++)   /* check everything before changing anything */
        if (kv_ld32(in + h * (len / n_kv_heads)) > pool_tokens || kv_ld32(in + h * (len / n_kv_heads) + 8) > 1)
            return false;
    for (size_t h = 0; h < n_kv_heads; h++) {
        kv_ott_head *hd = &heads[h];
        hd->n = kv_ld32(in);
        hd->aux_used = kv_ld32(in + 4);
        hd->stopped = kv_ld32(in + 8);
        in += 12;
        for (size_t i = 0; i < (pool_tokens ? pool_tokens : 1); i++, in += 16) {
            if (i >= pool_tokens)
                continue;
            kv_ott_member *m = &members[h * stride + i];
            const uint64_t bits = kv_ld64(in + 8);
            m->pos = kv_ld64(in);
            memcpy(&m->norm, &bits, sizeof bits);
        }
    }
    return true;
}

size_t kv_ott_tracker_state_bytes(const kv_ott_tracker *t)
{
    return kv_ott_state_bytes((size_t)t->n_kv_heads, (size_t)t->pool);
}

void kv_ott_tracker_save(const kv_ott_tracker *t, uint8_t *out)
{
    kv_ott_state_save(t->heads, t->members, (size_t)t->n_kv_heads, (size_t)t->pool, pool_slots(t), out);
}

bool kv_ott_tracker_load(kv_ott_tracker *t, const uint8_t *in, size_t len)
{
    return kv_ott_state_load(t->heads, t->members, (size_t)t->n_kv_heads, (size_t)t->pool, pool_slots(t), in, len);
}

size_t kv_ott_select(kv_ott_tracker *t, const float *k, size_t n_tokens, int head_dim, uint64_t first_pos,
                     kv_ott_entry *out)
{
    const size_t H = (size_t)t->n_kv_heads, D = (size_t)head_dim, N = (size_t)t->pool;
    if (N == 0 || n_tokens == 0)
        return 0;
    ott_member chosen[KV_OTT_MAX_POOL];
    uint16_t entered[KV_OTT_MAX_POOL];
    size_t n_out = 0;
    for (size_t h = 0; h < H; h++) {
        const size_t n = kv_ott_update_head(&t->heads[h], t->members + h * N, N, (size_t)t->aux, k, NULL, n_tokens,
                                            H, D, h, first_pos, chosen, entered);
        for (size_t u = 0; u < n; u++)
            out[n_out++] = (kv_ott_entry){(uint16_t)h, entered[u]};
    }
    /* (token, head) order, as the block format requires. */
    for (size_t i = 1; i < n_out; i++) {
        kv_ott_entry e = out[i];
        size_t at = i;
        while (at > 0 && (out[at - 1].token > e.token || (out[at - 1].token == e.token && out[at - 1].head > e.head))) {
            out[at] = out[at - 1];
            at--;
        }
        out[at] = e;
    }
    return n_out;
}
