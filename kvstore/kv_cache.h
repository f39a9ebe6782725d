/* The per-sequence compressed KV cache: a fixed-capacity block pool, per-sequence block tables
 * (one list of blocks per layer) and the fp16 tail (the codec's residual window).
 *
 * Tokens are appended per layer, after RoPE, as fp32 rows laid out [token][kv_head][head_dim].
 * The cache keeps the most recent tokens in the fp16 tail; whenever the tail holds
 * residual + block_tokens tokens, its oldest block_tokens tokens are compressed into one block
 * (see docs/format.md and docs/decisions.md). The fp16 codec has residual 0: its tail is only
 * the partial block.
 *
 * Thread-safety: a kv_pool and the sequences drawn from it are used from one thread. */
#ifndef STRATA_KVSTORE_KV_CACHE_H
#define STRATA_KVSTORE_KV_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "kvstore/error.h"

typedef enum kv_codec_id {
    KV_CODEC_FP16 = 1,  /* baseline: K and V as IEEE half */
    KV_CODEC_KIVI = 2,  /* KIVI: keys per channel, values per token, asymmetric B-bit */
} kv_codec_id;

typedef struct kv_codec_params {
    kv_codec_id codec;
    int bits;      /* 16 for fp16; 2 or 4 for kivi */
    int group;     /* G: tokens per key group and channels per value group (kivi; default 32) */
    int residual;  /* R: fp16 residual window in tokens (kivi default 128; fp16: 0) */
} kv_codec_params;

/* Parses a codec name ("fp16", "kivi2", "kivi4") into params with the defaults above.
 * Unknown names fail with STRATA_EINVAL and a message listing the accepted names. */
int kv_codec_parse(const char *name, kv_codec_params *out, strata_error *err);

/* Writes the canonical name of p ("kivi2", ...) into buf. */
void kv_codec_name(const kv_codec_params *p, char *buf, size_t cap);

typedef struct kv_geometry {
    int n_layers;
    int n_kv_heads;
    int head_dim;
    int block_tokens;  /* tokens per block; a multiple of the codec group (default 64) */
} kv_geometry;

/* Checks that p is usable with g (bits supported, group divides head_dim and block_tokens,
 * residual a multiple of group, ...). Fails with STRATA_EINVAL naming the parameter. */
int kv_codec_validate(const kv_codec_params *p, const kv_geometry *g, strata_error *err);

/* Exact size in bytes of one block of this codec and geometry (header and sections). */
size_t kv_block_size(const kv_codec_params *p, const kv_geometry *g);

typedef struct kv_pool kv_pool;
typedef struct kv_seq kv_seq;

/* A pool of n_slots fixed-size block slots, each kv_block_size(codec, geometry) bytes,
 * allocated once. */
kv_pool *kv_pool_create(const kv_geometry *g, const kv_codec_params *codec, size_t n_slots,
                        strata_error *err);
void kv_pool_destroy(kv_pool *pool);
size_t kv_pool_capacity(const kv_pool *pool);   /* slots */
size_t kv_pool_free(const kv_pool *pool);       /* free slots */
size_t kv_pool_slot_bytes(const kv_pool *pool);
const kv_geometry *kv_pool_geometry(const kv_pool *pool);
const kv_codec_params *kv_pool_codec(const kv_pool *pool);

/* A new, empty sequence whose blocks come from pool. max_tokens bounds the sequence length
 * (the tail buffers are sized from it). */
kv_seq *kv_seq_create(kv_pool *pool, size_t max_tokens, strata_error *err);
/* Returns every block of the sequence to its pool. */
void kv_seq_destroy(kv_seq *seq);

/* A sequence's id for messages (EFULL names it): numbered by its pool from 1 on creation,
 * replaceable by the caller's own (e.g. the request id). */
uint64_t kv_seq_id(const kv_seq *seq);
/* The pool a sequence draws from (its geometry and codec). */
const kv_pool *kv_seq_pool(const kv_seq *seq);
void kv_seq_set_id(kv_seq *seq, uint64_t id);

/* Appends n_tokens tokens to one layer. k and v are fp32, [n_tokens][n_kv_heads][head_dim].
 * Compresses completed blocks. On STRATA_EFULL (pool exhausted) or STRATA_EINVAL (would exceed
 * max_tokens) nothing of this call is kept: the layer is left as before the call. */
int kv_seq_append(kv_seq *seq, int layer, const float *k, const float *v, size_t n_tokens,
                  strata_error *err);

/* Number of tokens stored for a layer (blocks + tail). */
size_t kv_seq_length(const kv_seq *seq, int layer);

/* What attention reads for one layer, valid until the next append to that layer. */
typedef struct kv_layer_view {
    int layer;
    int n_kv_heads;
    int head_dim;
    int block_tokens;              /* tokens in each block; block i holds positions from i*block_tokens */
    size_t n_blocks;
    const uint8_t *const *blocks;  /* n_blocks complete blocks in position order */
    size_t block_bytes;            /* size of each block */
    size_t tail_tokens;
    const uint16_t *tail_k;        /* fp16 [tail_tokens][n_kv_heads][head_dim] */
    const uint16_t *tail_v;
} kv_layer_view;

void kv_seq_layer_view(const kv_seq *seq, int layer, kv_layer_view *view);

typedef struct kv_seq_stats {
    size_t tokens;        /* summed over layers */
    size_t blocks;        /* summed over layers */
    size_t block_tokens;  /* tokens held in blocks, summed over layers */
    size_t block_bytes;   /* bytes of all blocks (headers and every section) */
    size_t tail_tokens;   /* tokens in the fp16 tail, summed over layers */
    size_t tail_bytes;    /* fp16 bytes held by the tail (K and V) */
} kv_seq_stats;

void kv_seq_get_stats(const kv_seq *seq, kv_seq_stats *st);

#endif
