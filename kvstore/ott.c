/* Outlier-token tracing: the per-head pool update (ott.h). */
#include "kvstore/ott.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kvstore/bytes.h"

typedef struct ott_member {
    uint64_t pos;
    double norm;
} ott_member;

typedef struct ott_head {
    size_t n;          /* pool members */
    size_t aux_used;   /* tokens pushed out of the pool so far */
    bool stopped;      /* the auxiliary pool is full: no more tracing */
} ott_head;

struct kv_ott_tracker {
    int n_kv_heads, pool, aux;
    ott_head *heads;       /* [n_kv_heads] */
    ott_member *members;   /* [n_kv_heads][pool] */
};

kv_ott_tracker *kv_ott_tracker_create(int n_kv_heads, int pool_tokens, int aux_tokens)
{
    if (n_kv_heads < 1 || pool_tokens < 0 || pool_tokens > 64 || aux_tokens < 0)
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

size_t kv_ott_tracker_state_bytes(const kv_ott_tracker *t)
{
    return (size_t)t->n_kv_heads * (12 + pool_slots(t) * 16);
}

void kv_ott_tracker_save(const kv_ott_tracker *t, uint8_t *out)
{
    for (int h = 0; h < t->n_kv_heads; h++) {
        const ott_head *hd = &t->heads[h];
        kv_st32(out, (uint32_t)hd->n);
        kv_st32(out + 4, (uint32_t)hd->aux_used);
        kv_st32(out + 8, hd->stopped ? 1u : 0u);
        out += 12;
        for (size_t i = 0; i < pool_slots(t); i++) {
            const ott_member *m = &t->members[(size_t)h * pool_slots(t) + i];
            uint64_t bits;
            memcpy(&bits, &m->norm, sizeof bits);
            kv_st64(out, m->pos);
            kv_st64(out + 8, bits);
            out += 16;
        }
    }
}

bool kv_ott_tracker_load(kv_ott_tracker *t, const uint8_t *in, size_t len)
{
    if (len != kv_ott_tracker_state_bytes(t))
        return false;
    for (int h = 0; h < t->n_kv_heads; h++) {
        ott_head *hd = &t->heads[h];
        uint32_t n = kv_ld32(in), stopped = kv_ld32(in + 8);
        if (n > (uint32_t)t->pool || stopped > 1)
            return false;
        hd->n = n;
        hd->aux_used = kv_ld32(in + 4);
        hd->stopped = stopped != 0;
        in += 12;
        for (size_t i = 0; i < pool_slots(t); i++) {
            ott_member *m = &t->members[(size_t)h * pool_slots(t) + i];
            uint64_t bits = kv_ld64(in + 8);
            m->pos = kv_ld64(in);
            memcpy(&m->norm, &bits, sizeof bits);
            in += 16;
        }
    }
    return true;
}

/* Smaller norm first; equal norms keep the earlier position (deterministic). */
static bool before(const ott_member *a, const ott_member *b)
{
    return a->norm < b->norm || (a->norm == b->norm && a->pos < b->pos);
}

size_t kv_ott_select(kv_ott_tracker *t, const float *k, size_t n_tokens, int head_dim, uint64_t first_pos,
                     kv_ott_entry *out)
{
    const size_t H = (size_t)t->n_kv_heads, D = (size_t)head_dim, N = (size_t)t->pool;
    if (N == 0 || n_tokens == 0)
        return 0;
    /* chosen[h * N + i]: the new pool of head h, at most N members. */
    ott_member chosen[64];
    size_t n_out = 0;
    for (size_t h = 0; h < H; h++) {
        ott_head *hd = &t->heads[h];
        if (hd->stopped)
            continue;
        ott_member *pool = t->members + h * N;
        size_t n = hd->n;
        memcpy(chosen, pool, n * sizeof *pool);
        /* Insertion into a sorted list of at most N: the pool is tiny (N <= 64). */
        for (size_t j = 0; j < n_tokens; j++) {
            const float *row = k + (j * H + h) * D;
            double norm = 0.0;
            for (size_t c = 0; c < D; c++)
                norm += fabs((double)row[c]);
            ott_member m = {first_pos + j, norm};
            if (isnan(norm))
                continue;   /* a NaN key cannot be ranked; it stays in its quantized group */
            if (n == N && !before(&m, &chosen[n - 1]))
                continue;
            size_t at = n < N ? n++ : N - 1;
            while (at > 0 && before(&m, &chosen[at - 1])) {
                chosen[at] = chosen[at - 1];
                at--;
            }
            chosen[at] = m;
        }
        /* Old members that fell out go to the auxiliary pool. */
        size_t evicted = 0;
        for (size_t i = 0; i < hd->n; i++) {
            bool kept = false;
            for (size_t u = 0; u < n && !kept; u++)
                kept = chosen[u].pos == pool[i].pos;
            evicted += !kept;
        }
        if (hd->aux_used + evicted > (size_t)t->aux) {
            hd->stopped = true;
            continue;
        }
        hd->aux_used += evicted;
        memcpy(pool, chosen, n * sizeof *pool);
        hd->n = n;
        for (size_t u = 0; u < n; u++)
            if (chosen[u].pos >= first_pos)
                out[n_out++] = (kv_ott_entry){(uint16_t)h, (uint16_t)(chosen[u].pos - first_pos)};
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
