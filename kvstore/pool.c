/* The block pool, per-sequence block tables and the fp16 tail (kv_cache.h). */
#include <inttypes.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kvstore/block.h"
#include "kvstore/half.h"
#include "kvstore/kv_cache.h"

struct kv_pool {
    kv_geometry geom;
    kv_codec_params codec;
    size_t slot_bytes;
    size_t n_slots;
    size_t n_free;
    uint8_t *mem;          /* n_slots * slot_bytes, 64-byte aligned */
    size_t *free_stack;    /* slot indices; the top is free_stack[n_free - 1] */
    float *stage_k;        /* one block of fp32 rows handed to the encoder */
    float *stage_v;
    uint64_t next_seq_id;
};

typedef struct kv_layer {
    uint8_t **blocks;      /* max_blocks entries; the first n_blocks are in use */
    size_t n_blocks;
    uint16_t *tail_k;      /* tail_cap rows of n_kv_heads * head_dim halves */
    uint16_t *tail_v;
    size_t tail_len;
} kv_layer;

struct kv_seq {
    kv_pool *pool;
    uint64_t id;
    size_t max_tokens;
    size_t max_blocks;
    size_t tail_cap;
    kv_layer *layers;
};

static bool mul_ok(size_t a, size_t b, size_t *out) { return !__builtin_mul_overflow(a, b, out); }

kv_pool *kv_pool_create(const kv_geometry *g, const kv_codec_params *codec, size_t n_slots,
                        strata_error *err)
{
    if (kv_codec_validate(codec, g, err) != STRATA_OK)
        return NULL;
    if (n_slots < 1) {
        strata_fail(err, STRATA_EINVAL, "kv pool: n_slots must be at least 1");
        return NULL;
    }
    size_t slot = kv_block_size(codec, g), total;
    if (!mul_ok(slot, n_slots, &total)) {
        strata_fail(err, STRATA_EINVAL, "kv pool: %zu slots of %zu bytes overflow the address space", n_slots, slot);
        return NULL;
    }
    kv_pool *p = calloc(1, sizeof *p);
    size_t stage = (size_t)g->block_tokens * (size_t)g->n_kv_heads * (size_t)g->head_dim;
    if (p) {
        p->mem = aligned_alloc(64, total);   /* slot sizes are multiples of 64 */
        p->free_stack = malloc(n_slots * sizeof *p->free_stack);
        p->stage_k = malloc(stage * sizeof(float));
        p->stage_v = malloc(stage * sizeof(float));
    }
    if (!p || !p->mem || !p->free_stack || !p->stage_k || !p->stage_v) {
        strata_fail(err, STRATA_ENOMEM, "kv pool: cannot allocate %zu slots of %zu bytes (%zu MiB)", n_slots,
                    slot, total >> 20);
        kv_pool_destroy(p);
        return NULL;
    }
    p->geom = *g;
    p->codec = *codec;
    p->slot_bytes = slot;
    p->n_slots = n_slots;
    p->n_free = n_slots;
    for (size_t i = 0; i < n_slots; i++)
        p->free_stack[i] = n_slots - 1 - i;   /* slot 0 is handed out first */
    p->next_seq_id = 1;
    return p;
}

void kv_pool_destroy(kv_pool *pool)
{
    if (!pool)
        return;
    free(pool->mem);
    free(pool->free_stack);
    free(pool->stage_k);
    free(pool->stage_v);
    free(pool);
}

size_t kv_pool_capacity(const kv_pool *pool) { return pool->n_slots; }
size_t kv_pool_free(const kv_pool *pool) { return pool->n_free; }
size_t kv_pool_slot_bytes(const kv_pool *pool) { return pool->slot_bytes; }
const kv_geometry *kv_pool_geometry(const kv_pool *pool) { return &pool->geom; }
const kv_codec_params *kv_pool_codec(const kv_pool *pool) { return &pool->codec; }

static uint8_t *pool_take(kv_pool *p) { return p->mem + p->free_stack[--p->n_free] * p->slot_bytes; }

static void pool_give(kv_pool *p, uint8_t *slot)
{
    p->free_stack[p->n_free++] = (size_t)(slot - p->mem) / p->slot_bytes;
}

kv_seq *kv_seq_create(kv_pool *pool, size_t max_tokens, strata_error *err)
{
    if (!pool) {
        strata_fail(err, STRATA_EINVAL, "kv sequence: NULL pool");
        return NULL;
    }
    if (max_tokens < 1) {
        strata_fail(err, STRATA_EINVAL, "kv sequence: max_tokens must be at least 1");
        return NULL;
    }
    const kv_geometry *g = &pool->geom;
    size_t bt = (size_t)g->block_tokens;
    size_t window = (size_t)pool->codec.residual + bt;
    size_t tail_cap = max_tokens < window ? max_tokens : window;
    size_t row = (size_t)g->n_kv_heads * (size_t)g->head_dim, tail_elems;
    if (!mul_ok(tail_cap, row, &tail_elems) || tail_elems > SIZE_MAX / sizeof(uint16_t)) {
        strata_fail(err, STRATA_EINVAL, "kv sequence: tail of %zu tokens is too large", tail_cap);
        return NULL;
    }
    kv_seq *s = calloc(1, sizeof *s);
    if (!s) {
        strata_fail(err, STRATA_ENOMEM, "kv sequence: out of memory");
        return NULL;
    }
    s->pool = pool;
    s->id = pool->next_seq_id++;
    s->max_tokens = max_tokens;
    s->max_blocks = max_tokens / bt;
    s->tail_cap = tail_cap;
    s->layers = calloc((size_t)g->n_layers, sizeof *s->layers);
    if (!s->layers) {
        free(s);
        strata_fail(err, STRATA_ENOMEM, "kv sequence: out of memory for %d layers", g->n_layers);
        return NULL;
    }
    for (int l = 0; l < g->n_layers; l++) {
        kv_layer *L = &s->layers[l];
        /* Block tables are sized for max_tokens up front so that append never allocates. */
        L->blocks = s->max_blocks ? malloc(s->max_blocks * sizeof *L->blocks) : NULL;
        L->tail_k = malloc(tail_elems * sizeof(uint16_t));
        L->tail_v = malloc(tail_elems * sizeof(uint16_t));
        if ((s->max_blocks && !L->blocks) || !L->tail_k || !L->tail_v) {
            strata_fail(err, STRATA_ENOMEM, "kv sequence: out of memory for the block table and tail of layer %d "
                        "(%zu tokens max)", l, max_tokens);
            kv_seq_destroy(s);
            return NULL;
        }
    }
    return s;
}

void kv_seq_destroy(kv_seq *seq)
{
    if (!seq)
        return;
    for (int l = 0; l < seq->pool->geom.n_layers; l++) {
        kv_layer *L = &seq->layers[l];
        for (size_t b = 0; b < L->n_blocks; b++)
            pool_give(seq->pool, L->blocks[b]);
        free(L->blocks);
        free(L->tail_k);
        free(L->tail_v);
    }
    free(seq->layers);
    free(seq);
}

const kv_pool *kv_seq_pool(const kv_seq *seq) { return seq->pool; }
uint64_t kv_seq_id(const kv_seq *seq) { return seq->id; }
void kv_seq_set_id(kv_seq *seq, uint64_t id) { seq->id = id; }

static void half_row_to_f32(const uint16_t *src, float *dst, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = strata_half_to_float(src[i]);
}

/* The tail holds fp16, so rows entering a block directly from the caller are rounded the same
 * way: a token quantizes identically whether it passed through the tail or not. */
static void f32_row_rounded(const float *src, float *dst, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = strata_round_half(src[i]);
}

static void f32_row_to_half(const float *src, uint16_t *dst, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = strata_float_to_half(src[i]);
}

int kv_seq_append(kv_seq *seq, int layer, const float *k, const float *v, size_t n_tokens,
                  strata_error *err)
{
    if (!seq)
        return strata_fail(err, STRATA_EINVAL, "kv append: NULL sequence");
    kv_pool *p = seq->pool;
    const kv_geometry *g = &p->geom;
    if (layer < 0 || layer >= g->n_layers)
        return strata_fail(err, STRATA_EINVAL, "kv append: layer %d out of range 0..%d", layer, g->n_layers - 1);
    if (n_tokens == 0)
        return STRATA_OK;
    if (!k || !v)
        return strata_fail(err, STRATA_EINVAL, "kv append: NULL rows");
    kv_layer *L = &seq->layers[layer];
    const size_t bt = (size_t)g->block_tokens, R = (size_t)p->codec.residual;
    const size_t row = (size_t)g->n_kv_heads * (size_t)g->head_dim;
    size_t len = L->n_blocks * bt + L->tail_len;
    if (n_tokens > seq->max_tokens - len)
        return strata_fail(err, STRATA_EINVAL,
                           "kv append: sequence %" PRIu64 " layer %d holds %zu tokens; %zu more exceed its max_tokens %zu",
                           seq->id, layer, len, n_tokens, seq->max_tokens);
    /* The tail followed by the new rows is one stream; every full block that leaves at least R
     * tokens behind it is compressed, oldest first. */
    size_t stream = L->tail_len + n_tokens;
    size_t n_new = stream >= R + bt ? (stream - R) / bt : 0;
    if (n_new > p->n_free)
        return strata_fail(err, STRATA_EFULL,
                           "KV block pool exhausted: sequence %" PRIu64 " layer %d needs %zu new block(s) of %zu bytes, "
                           "%zu of the pool's %zu slots are free",
                           seq->id, layer, n_new, p->slot_bytes, p->n_free, p->n_slots);
    for (size_t b = 0; b < n_new; b++) {
        for (size_t r = 0; r < bt; r++) {
            size_t i = b * bt + r;
            if (i < L->tail_len) {
                half_row_to_f32(L->tail_k + i * row, p->stage_k + r * row, row);
                half_row_to_f32(L->tail_v + i * row, p->stage_v + r * row, row);
            } else {
                f32_row_rounded(k + (i - L->tail_len) * row, p->stage_k + r * row, row);
                f32_row_rounded(v + (i - L->tail_len) * row, p->stage_v + r * row, row);
            }
        }
        kv_block_desc d;
        kv_block_desc_init(&d, &p->codec, g, (uint32_t)layer, (uint64_t)(L->n_blocks + b) * bt);
        uint8_t *slot = pool_take(p);
        L->blocks[L->n_blocks + b] = slot;   /* not visible until n_blocks moves */
        int rc = kv_block_encode(&d, p->stage_k, p->stage_v, slot, p->slot_bytes, NULL, err);
        if (rc) {
            for (size_t u = 0; u <= b; u++)
                pool_give(p, L->blocks[L->n_blocks + u]);
            return rc;
        }
    }
    size_t consumed = n_new * bt;
    size_t new_tail = stream - consumed;
    if (consumed < L->tail_len) {
        size_t keep = L->tail_len - consumed;
        memmove(L->tail_k, L->tail_k + consumed * row, keep * row * sizeof(uint16_t));
        memmove(L->tail_v, L->tail_v + consumed * row, keep * row * sizeof(uint16_t));
        f32_row_to_half(k, L->tail_k + keep * row, n_tokens * row);
        f32_row_to_half(v, L->tail_v + keep * row, n_tokens * row);
    } else {
        size_t skip = consumed - L->tail_len;
        f32_row_to_half(k + skip * row, L->tail_k, new_tail * row);
        f32_row_to_half(v + skip * row, L->tail_v, new_tail * row);
    }
    L->n_blocks += n_new;
    L->tail_len = new_tail;
    return STRATA_OK;
}

size_t kv_seq_length(const kv_seq *seq, int layer)
{
    if (!seq || layer < 0 || layer >= seq->pool->geom.n_layers)
        return 0;
    const kv_layer *L = &seq->layers[layer];
    return L->n_blocks * (size_t)seq->pool->geom.block_tokens + L->tail_len;
}

void kv_seq_layer_view(const kv_seq *seq, int layer, kv_layer_view *view)
{
    memset(view, 0, sizeof *view);
    if (!seq || layer < 0 || layer >= seq->pool->geom.n_layers)
        return;
    const kv_geometry *g = &seq->pool->geom;
    const kv_layer *L = &seq->layers[layer];
    view->layer = layer;
    view->n_kv_heads = g->n_kv_heads;
    view->head_dim = g->head_dim;
    view->block_tokens = g->block_tokens;
    view->n_blocks = L->n_blocks;
    view->blocks = (const uint8_t *const *)L->blocks;
    view->block_bytes = seq->pool->slot_bytes;
    view->tail_tokens = L->tail_len;
    view->tail_k = L->tail_k;
    view->tail_v = L->tail_v;
}

void kv_seq_get_stats(const kv_seq *seq, kv_seq_stats *st)
{
    memset(st, 0, sizeof *st);
    if (!seq)
        return;
    const kv_geometry *g = &seq->pool->geom;
    size_t row_bytes = (size_t)g->n_kv_heads * (size_t)g->head_dim * sizeof(uint16_t) * 2;
    for (int l = 0; l < g->n_layers; l++) {
        const kv_layer *L = &seq->layers[l];
        st->blocks += L->n_blocks;
        st->block_tokens += L->n_blocks * (size_t)g->block_tokens;
        st->block_bytes += L->n_blocks * seq->pool->slot_bytes;
        st->tail_tokens += L->tail_len;
        st->tail_bytes += L->tail_len * row_bytes;
    }
    st->tokens = st->block_tokens + st->tail_tokens;
}
