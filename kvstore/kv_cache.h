/* The per-sequence compressed KV cache: a fixed-capacity block pool, per-sequence block tables
 * (one list of blocks per layer) and the fp16 tail (the codec's residual window).
 *
 * Tokens are appended per layer, after RoPE, as fp32 rows laid out [token][kv_head][head_dim].
 * The cache keeps the most recent tokens in the fp16 tail; whenever the tail holds
 * residual + block_tokens tokens, its oldest block_tokens tokens are compressed into one block
 * (see docs/format.md and docs/decisions.md). The fp16 codec has residual 0: its tail is only
 * the partial block.
 *
 * A lower tier (kv_lower_tier) lets the pool hold fewer blocks than the sequences have: blocks
 * move down when slots run short and come back for attention (kv_seq_acquire_layer).
 *
 * Thread-safety: a kv_pool and the sequences drawn from it are used from one thread. */
#ifndef STRATA_KVSTORE_KV_CACHE_H
#define STRATA_KVSTORE_KV_CACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvstore/error.h"

typedef enum kv_codec_id {
    KV_CODEC_FP16 = 1,  /* baseline: K and V as IEEE half */
    KV_CODEC_KIVI = 2,  /* KIVI: keys per channel, values per token, asymmetric B-bit */
    KV_CODEC_GEAR = 3,  /* GEAR: KIVI backbone + sparse outliers + per-head low-rank residual */
    KV_CODEC_OTT = 4,   /* outlier-token tracing: KIVI + a pool of fp16 low-key-norm tokens */
    KV_CODEC_TADA = 5,  /* TaDA: per-token mean across KV heads in fp16 + quantized deviations */
} kv_codec_id;

/* One layer's codec. Names (kv_codec_parse) and defaults:
 *   fp16                      bits 16, residual 0
 *   kivi2 kivi4               group 32, residual 128
 *   gear2 gear4               group 64, residual 128, sparse 2 %, ranks 4 (prompt) / 2 (decode),
 *                             3 power iterations; gearl2 gearl4: the same with sparse 0
 *   ott2 ott4                 group 32, residual 128, pool 3 tokens, auxiliary pool 32
 *   tada2 tada4 tada8         group 32, residual 128
 * Optional suffixes override: -g<group> -r<residual> (all but fp16), -p<prompt rank>
 * -d<decode rank> -s<sparse percent> -i<power iterations> (gear), -n<pool> -a<aux pool> (ott).
 * Unused fields are 0. */
typedef struct kv_codec_params {
    kv_codec_id codec;
    int bits;         /* 16 for fp16; 2 or 4 (kivi, gear, ott); 2, 4 or 8 (tada) */
    int group;        /* G: tokens per key group and channels per value group */
    int residual;     /* R: fp16 residual window in tokens (a multiple of G; fp16: 0) */
    int rank_prompt;  /* gear: low rank of blocks made while prefilling a prompt */
    int rank_decode;  /* gear: low rank of blocks made while decoding */
    int power_iters;  /* gear: power iterations of the low-rank fit */
    double sparse_pct;/* gear: percent of each vector kept exactly as outliers (0 for gearl) */
    int pool_tokens;  /* ott: N, outlier pool per KV head (0 reproduces KIVI) */
    int aux_tokens;   /* ott: auxiliary pool; when it is full, tracing stops */
} kv_codec_params;

/* Parses a codec name (table above) into params. Unknown names and malformed suffixes fail
 * with STRATA_EINVAL and a message listing the accepted names. Use kv_plan_parse (plan.h) for
 * per-layer plans and for "tada" without bits. */
int kv_codec_parse(const char *name, kv_codec_params *out, strata_error *err);

/* Writes the canonical name of p ("kivi2", "gear2-s1", ...) into buf; parsing it gives p. */
void kv_codec_name(const kv_codec_params *p, char *buf, size_t cap);

/* Outliers kept per vector of n values for a GEAR sparse percentage: an even number (half the
 * largest, half the smallest), at least 2 when pct > 0, 0 when pct == 0. */
int kv_gear_outliers(double pct, int n);

typedef struct kv_geometry {
    int n_layers;
    int n_kv_heads;
    int head_dim;
    int block_tokens;  /* tokens per block; a multiple of the codec group (default 64) */
} kv_geometry;

/* Checks that p is usable with g (bits supported, group divides head_dim and block_tokens,
 * residual a multiple of group, ...). Fails with STRATA_EINVAL naming the parameter. */
int kv_codec_validate(const kv_codec_params *p, const kv_geometry *g, strata_error *err);

/* Size in bytes of the largest block of this codec and geometry (header and sections): the
 * pool slot size. GEAR decode blocks (lower rank) and OTT blocks (fewer pooled tokens than the
 * maximum) are smaller; a block's own size is in its header. 0 if p does not validate. */
size_t kv_block_size(const kv_codec_params *p, const kv_geometry *g);

/* Tokens a layer of codec p keeps in its fp16 tail after n_tokens were appended to an empty
 * sequence (kv_seq_append's rule: a full block leaves when at least R tokens stay behind it). */
size_t kv_tail_tokens(const kv_codec_params *p, int block_tokens, size_t n_tokens);

typedef struct kv_pool kv_pool;
typedef struct kv_seq kv_seq;

/* A pool of n_slots fixed-size block slots, each kv_block_size(codec, geometry) bytes,
 * allocated once; every layer uses codec. */
kv_pool *kv_pool_create(const kv_geometry *g, const kv_codec_params *codec, size_t n_slots,
                        strata_error *err);
/* A pool for a bit plan: layer l uses codecs[l] (g->n_layers entries). Layers whose blocks have
 * the same slot size share slots; blocks_per_layer slots are provided for every layer. */
kv_pool *kv_pool_create_plan(const kv_geometry *g, const kv_codec_params *codecs, size_t blocks_per_layer,
                             strata_error *err);
/* Bytes of one block slot per layer summed over the layers of a plan (what one block of every
 * layer costs); 0 if a codec does not validate. Divide a memory budget by it for blocks_per_layer. */
size_t kv_plan_row_bytes(const kv_geometry *g, const kv_codec_params *codecs);
/* A pool of n_slots slots of the plan's largest block size, shared by every layer: what a pool
 * with a lower tier wants, since any layer's blocks may then need the whole pool at once for
 * attention (a plan's small slot class could not hold one layer). */
kv_pool *kv_pool_create_shared(const kv_geometry *g, const kv_codec_params *codecs, size_t n_slots,
                               strata_error *err);
/* The largest block size of a plan (the slot size of kv_pool_create_shared); 0 if a codec does
 * not validate. */
size_t kv_plan_largest_block(const kv_geometry *g, const kv_codec_params *codecs);
/* A pool whose sequences may use any of n_plans plans (kv_seq_create_plan); plans[0] is the
 * pool's own (kv_pool_codec, and a sequence's when it names none). The memory is slabs of the
 * largest block the plans make in a layer (kvstore/slab.h): a slab serves one block size at a
 * time and holds as many blocks of it as fit, so a plan with smaller blocks stores more of them
 * in the same memory. When a block size needs a slab and none is free, another size's sparsest
 * slab is emptied into that size's free slots (compaction, in memory), and only then, with a
 * lower tier, blocks are evicted. shared false: kv_pool_create_plan's layout, n = slabs per
 * layer; true: kv_pool_create_shared's, n = slabs of the largest block, shared by every layer. */
kv_pool *kv_pool_create_plans(const kv_geometry *g, const kv_codec_params *const *plans, int n_plans, size_t n,
                              bool shared, strata_error *err);
/* kv_plan_row_bytes and kv_plan_largest_block for such a pool: per layer the plans' largest block. */
size_t kv_plans_row_bytes(const kv_geometry *g, const kv_codec_params *const *plans, int n_plans);
size_t kv_plans_largest_block(const kv_geometry *g, const kv_codec_params *const *plans, int n_plans);
void kv_pool_destroy(kv_pool *pool);
/* Slots are counted in slabs (one block of the largest size each; with one plan, slot and slab
 * are the same). */
size_t kv_pool_capacity(const kv_pool *pool);   /* slabs */
size_t kv_pool_free(const kv_pool *pool);       /* slabs holding no block */
size_t kv_pool_slot_bytes(const kv_pool *pool); /* the largest slab */
size_t kv_pool_bytes(const kv_pool *pool);      /* all slabs */
const kv_geometry *kv_pool_geometry(const kv_pool *pool);
/* The pool's own plan: layer 0's codec (every layer's for a pool made by kv_pool_create). */
const kv_codec_params *kv_pool_codec(const kv_pool *pool);
const kv_codec_params *kv_pool_layer_codec(const kv_pool *pool, int layer);

/* A lower tier below the pool (host memory, NVMe): where blocks go when the pool's slots run
 * short. The pool calls it; offload/kv_tiers.h implements it over the host arena and the NVMe
 * store. Blocks cross it as their exact bytes (docs/format.md); handles are opaque and non-zero.
 *
 * With a lower tier, a block may leave its device slot: when a slot is needed and none is free
 * (nor freed by compaction), the least recently used unpinned block of the pool's region goes
 * down if it has that size, else its whole slab does (every block in it, none pinned); a block
 * is copied down first if it has no copy below yet (blocks never change, so a copy below stays
 * valid while the block lives).
 * Attention then needs kv_seq_acquire_layer, which brings a layer's blocks back. */
typedef struct kv_lower_tier {
    void *ctx;
    /* Stores a copy of a block (len = its own size) for sequence seq_id at pool clock `clock`. */
    int (*put)(void *ctx, const uint8_t *block, size_t len, uint64_t seq_id, uint64_t clock, uint64_t *handle,
               strata_error *err);
    /* Copies a block back into dst (cap bytes), waiting for I/O if needed, and verifies its CRCs. */
    int (*get)(void *ctx, uint64_t handle, uint8_t *dst, size_t cap, uint64_t clock, strata_error *err);
    /* Starts bringing a block closer without waiting (e.g. an NVMe read), as used at `clock` so
     * that it is not the next thing evicted; optional, best effort. */
    void (*prefetch)(void *ctx, uint64_t handle, uint64_t clock);
    /* Forgets a block's copy. */
    void (*release)(void *ctx, uint64_t handle);
    /* Marks a sequence's blocks as waiting/preempted (moved further down first); optional. */
    void (*set_waiting)(void *ctx, uint64_t seq_id, int waiting);
    /* The room a step can count on, in bytes of whole blocks of unit_bytes per free extent
     * (fragmented free space has holes no block fits); optional (NULL: not checked). Two
     * figures: *through_host, what can land in the tier's first level (host memory) with
     * nothing moving further down: puts and, with get_takes_room, fetches; *below, the puts it
     * can take once it moves blocks further down to make room (NVMe less what the blocks only
     * in host memory would take there; fetched blocks keep their copy below, so their host
     * copies leave without I/O); 0 without a further level or when it cannot take even the
     * host-only blocks. A step fits when puts + fetches <= *through_host, or 0 < puts <= *below
     * (with puts 0: *below > 0). kv_seq_check_room and device_room count each block as its
     * slot rounded up to whole 4 KiB pages (unit_bytes). */
    void (*room)(void *ctx, size_t unit_bytes, size_t *through_host, size_t *below);
    /* A get may first bring the block into the tier's own memory (NVMe to host), taking room
     * there as a put does: kv_seq_check_room counts fetches then. */
    bool get_takes_room;
} kv_lower_tier;

/* A block of block_bytes as the tiers below store it and as room checks count it: whole 4 KiB
 * pages (host arena extents, NVMe slab extents). 0 for 0. */
size_t kv_lower_unit_bytes(size_t block_bytes);

/* One room check's answer from a lower tier, asked at most once per check and block size (the
 * tier may walk its blocks to answer; nothing changes during a check). Zero-initialize. */
typedef struct kv_lower_room {
    bool asked;
    size_t unit, through_host, below;
} kv_lower_room;

/* Whether a step that may put `puts` bytes and fetch `fetches` bytes of blocks of unit bytes
 * fits the tier's room (kv_lower_tier.room's rule); true when the tier reports no room. The two
 * figures are left in *cache for the caller's message. Shared by the CPU pool's and the device
 * pool's checks. */
bool kv_lower_room_fits(const kv_lower_tier *lower, kv_lower_room *cache, size_t unit, size_t puts, size_t fetches);

/* Attaches a lower tier (copied; ctx must outlive the pool's sequences). Only while the pool has
 * no sequence. NULL detaches. */
int kv_pool_set_lower_tier(kv_pool *pool, const kv_lower_tier *lower, strata_error *err);

typedef struct kv_pool_stats {
    size_t slots, free_slots;  /* slabs (kv_pool_capacity, kv_pool_free) */
    uint64_t evictions;        /* blocks that left a slot for the lower tier */
    uint64_t writebacks;       /* of those, blocks first copied down (no copy below yet) */
    uint64_t writeback_bytes;
    uint64_t fetches;          /* blocks brought back into a slot */
    uint64_t fetch_bytes;
    uint64_t seq_spills, seq_resumes;  /* kv_seq_spill / kv_seq_resume */
    uint64_t compactions;      /* slabs emptied in memory for another block size (see below) */
    uint64_t compaction_bytes; /* block bytes those moves copied */
} kv_pool_stats;

void kv_pool_get_stats(const kv_pool *pool, kv_pool_stats *out);

/* A new, empty sequence whose blocks come from pool, with the pool's plan. max_tokens bounds the
 * sequence length (the tail buffers are sized from it). */
kv_seq *kv_seq_create(kv_pool *pool, size_t max_tokens, strata_error *err);
/* The same with the sequence's own plan (g->n_layers codecs; NULL: the pool's). STRATA_EINVAL
 * when a codec does not validate or makes blocks larger than the pool's slots of that layer
 * (see kv_pool_create_plans). */
kv_seq *kv_seq_create_plan(kv_pool *pool, const kv_codec_params *codecs, size_t max_tokens, strata_error *err);
/* The codec of a sequence's layer (its own plan's or the pool's); NULL for a bad layer. */
const kv_codec_params *kv_seq_codec(const kv_seq *seq, int layer);
/* Returns every block of the sequence to its pool. */
void kv_seq_destroy(kv_seq *seq);

/* A sequence's id for messages (EFULL names it): numbered by its pool from 1 on creation,
 * replaceable by the caller's own (e.g. the request id). */
uint64_t kv_seq_id(const kv_seq *seq);
/* The pool a sequence draws from (its geometry and codec). */
const kv_pool *kv_seq_pool(const kv_seq *seq);
void kv_seq_set_id(kv_seq *seq, uint64_t id);

/* Checks, before a step that appends n_tokens to every layer, that the step can complete:
 * max_tokens, free slots (or, with a lower tier, that one layer's blocks fit the pool at once and
 * the tier below has room for what must be evicted). STRATA_EFULL / STRATA_EINVAL with a message
 * naming the budget to raise; nothing changes. A step can still fail on an I/O error. */
int kv_seq_check_room(const kv_seq *seq, size_t n_tokens, strata_error *err);

/* The same check for a step of several sequences of one pool, which draw on the same slots and
 * the same tier below: kv_room_begin, kv_room_add for each (STRATA_EFULL / STRATA_EINVAL for one
 * that does not fit beside those added before it; it is then not counted, and the caller may
 * leave it out of the step and go on adding), kv_room_end. The blocks a step may have to move
 * down count the step's new blocks and the blocks it brings back for attention, and at most the
 * blocks with no copy below (the others leave without a write). */
typedef struct kv_room kv_room;
kv_room *kv_room_begin(const kv_pool *pool, strata_error *err);
int kv_room_add(kv_room *room, const kv_seq *seq, size_t n_tokens, strata_error *err);
void kv_room_end(kv_room *room);

/* Appends n_tokens tokens to one layer. k and v are fp32, [n_tokens][n_kv_heads][head_dim].
 * Compresses completed blocks. On STRATA_EFULL (pool exhausted) or STRATA_EINVAL (would exceed
 * max_tokens) nothing of this call is kept: the layer is left as before the call.
 * Tokens appended by a call of more than one token are prompt tokens: a block made only of
 * them uses the codec's prompt settings (GEAR's prompt rank); others its decode settings. */
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
    size_t block_bytes;            /* size of each block's slot (a block's own size is in its header) */
    size_t tail_tokens;
    const uint16_t *tail_k;        /* fp16 [tail_tokens][n_kv_heads][head_dim] */
    const uint16_t *tail_v;
} kv_layer_view;

/* The view of a layer whose blocks are all in pool slots (always true without a lower tier).
 * With a lower tier use kv_seq_acquire_layer; here a missing block shows as a NULL pointer. */
void kv_seq_layer_view(const kv_seq *seq, int layer, kv_layer_view *view);

/* Brings every block of a layer into pool slots (fetching from the lower tier, evicting other
 * unpinned blocks as needed), pins them, and fills view. Pins last until kv_seq_unpin; blocks
 * made by kv_seq_append are pinned the same way. STRATA_EFULL when the layer's blocks cannot all
 * be held at once; a fetch's I/O or CRC error is returned as is (the block stays below). */
int kv_seq_acquire_layer(kv_seq *seq, int layer, kv_layer_view *view, strata_error *err);

/* Starts fetching a layer's blocks that are not in slots (lower-tier prefetch), e.g. layer L+1
 * while layer L computes. No effect without a lower tier. */
void kv_seq_prefetch_layer(kv_seq *seq, int layer);

/* Ends the pins of a sequence (after the attention of a layer or of a step). */
void kv_seq_unpin(kv_seq *seq);

/* Preemption: moves every block of the sequence out of the pool (copying down those without a
 * copy below) and the fp16 tail of every layer down as an fp16-codec block, and frees the tail
 * buffers. The sequence then refuses appends and views until kv_seq_resume, which brings the
 * tails back bit for bit (blocks come back lazily, at acquire). Needs a lower tier. On failure
 * the sequence stays usable (not spilled). */
int kv_seq_spill(kv_seq *seq, strata_error *err);
int kv_seq_resume(kv_seq *seq, strata_error *err);
bool kv_seq_is_spilled(const kv_seq *seq);

/* Migration: the whole sequence as one byte image (docs/format.md, "Sequence image"): its plan,
 * then per layer its blocks as their exact stored bytes (each still self-describing and
 * CRC-protected), its fp16 tail, its prompt length and OTT's pool state, with a CRC32C over the
 * whole image. kv_seq_export reads blocks that sit below the device from the lower tier (checking
 * them) without moving them; *out is malloc'd. kv_seq_import rebuilds the sequence in a pool of
 * the same geometry, with the image's plan (which must fit the pool's slots, as for
 * kv_seq_create_plan), checking every block's CRCs, place and codec; the result is bit for bit
 * the exported sequence (appends and attention continue exactly as they would have; OTT's pool
 * state travels with its layer). A spilled sequence must be resumed first. */
int kv_seq_export(kv_seq *seq, uint8_t **out, size_t *len, strata_error *err);
kv_seq *kv_seq_import(kv_pool *pool, size_t max_tokens, const uint8_t *image, size_t len, strata_error *err);

typedef struct kv_seq_stats {
    size_t tokens;        /* summed over layers */
    size_t blocks;        /* summed over layers */
    size_t block_tokens;  /* tokens held in blocks, summed over layers */
    size_t block_bytes;   /* bytes of all blocks as stored (headers and every section) */
    size_t slot_bytes;    /* bytes of the pool slots holding them (>= block_bytes) */
    size_t tail_tokens;   /* tokens in the fp16 tail, summed over layers */
    size_t tail_bytes;    /* fp16 bytes held by the tail (K and V) */
    size_t resident_blocks;  /* blocks in pool slots */
    size_t lower_blocks;     /* blocks with a copy in the lower tier (a block may be in both) */
} kv_seq_stats;

void kv_seq_get_stats(const kv_seq *seq, kv_seq_stats *st);

/* Compression error of one layer's blocks, measured when each block is made (decoded right
 * after encoding and compared with the rows it was made from, in fp64). */
typedef struct kv_layer_error {
    size_t tokens;       /* tokens measured (those in blocks made while tracking was on) */
    double k_err2;       /* sum of squared errors of K */
    double k_ref2;       /* sum of squares of K */
    double v_err2;
    double v_ref2;
} kv_layer_error;

/* Turns the measurement on or off (off by default: it costs a decode per block). */
int kv_seq_track_error(kv_seq *seq, int on, strata_error *err);
void kv_seq_layer_error(const kv_seq *seq, int layer, kv_layer_error *out);

#endif
