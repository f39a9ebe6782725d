/* The forward pass on a CUDA device: a loaded model's layers with their weights on the GPU
 * (fp16, or fp32 for validation), projections through cuBLAS, the elementwise kernels of
 * kernels/cuda_ops.h, and the KV cache on the device as real compressed blocks (written by
 * kernels/cuda_kv_encode.h, attended by kernels/cuda_kv_attention.h) behind an fp16 tail, with
 * the CPU pool's rule for when a block forms. It computes what model_forward computes on the CPU;
 * tests/cuda/test_cuda_model.c compares the logits.
 *
 * First version: batches of sequences over the whole model or a pipeline stage of it on one
 * device (cuda_model_stage_step), caches of every codec, each sequence with its own device arena
 * sized for its max_tokens or a block pool shared by the sequences with tiers below the device
 * (cuda_model_create_kv_pool); the embedding lookup stays on the host (a row copy per token).
 * strata generate --device cuda and strata-worker --device cuda (worker/stage/stage_gpu.c) run it.
 * Status: compiled in every build with nvcc; see docs/benchmarks.md for whether it has run. */
#ifndef STRATA_WORKER_CUDA_MODEL_CUDA_H
#define STRATA_WORKER_CUDA_MODEL_CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvstore/error.h"
#include "kernels/cuda_sample.h"
#include "kvstore/kv_cache.h"
#include "offload/device_pool.h"
#include "worker/cuda/phase_timer.h"
#include "worker/model.h"

typedef struct cuda_model cuda_model;
typedef struct cuda_seq cuda_seq;

typedef enum cuda_weight_dtype {
    CUDA_WEIGHTS_F16 = 0,   /* what serving uses: half the bytes, fp32 accumulation */
    CUDA_WEIGHTS_F32 = 1,   /* the CPU's own weights, fp32 GEMMs without TF32: for validation */
} cuda_weight_dtype;

/* Makes CUDA device `device` the calling thread's (cudaSetDevice): STRATA_EIO when there is no
 * device, STRATA_EINVAL naming the valid range for a device that does not exist. */
int cuda_select_device(int device, strata_error *err);

/* Builds the weights of m on the current device: a whole model, or a pipeline stage holding
 * layers [layer_begin, layer_end), whose sequences hold only those layers, numbered from 0 as on
 * the CPU. m comes from model_load_for_device: GGUF blocks are copied to the device as they are in
 * the file and decoded there (kernels/cuda_weights.h), synthetic weights are generated there; the
 * values equal the CPU loader's (fp32), rounded once to fp16 for CUDA_WEIGHTS_F16. m must outlive
 * the result (the first stage reads its embedding table from host memory). STRATA_EINVAL for a
 * model loaded otherwise or a first stage without the embedding; STRATA_EIO with the CUDA error
 * when there is no device or memory runs out (naming the tensor); STRATA_EFORMAT naming the
 * tensor and element when a value is not finite (or, for fp16 weights, beyond fp16's range). */
cuda_model *cuda_model_create(const model *m, cuda_weight_dtype dtype, strata_error *err);
void cuda_model_free(cuda_model *cm);
/* Device bytes of the weights. */
size_t cuda_model_weight_bytes(const cuda_model *cm);

/* How many cached positions a prompt chunk continuing a sequence reads at a time: its fp32 copy
 * of the past is that many rows of K and V (rounded down to whole blocks, at least one) whatever
 * the sequence's length, merged tile by tile into an online softmax. Default
 * CUDA_CHUNK_TILE_KEYS; smaller saves device memory, larger launches fewer GEMMs. STRATA_EINVAL
 * below 1. */
#define CUDA_CHUNK_TILE_KEYS 4096
int cuda_model_set_chunk_tile(cuda_model *cm, int keys, strata_error *err);

/* Makes every sequence created afterwards keep its blocks in one pool of n_blocks slots shared
 * by the model's sequences (offload/device_pool.h, on the current device, sized for codec and
 * block_tokens), instead of an arena of its own sized for its max_tokens. Residency is per layer:
 * before a layer's attention its blocks of the step's decoding sequences are brought back, and
 * after the layer they may leave again, so the pool needs to hold one layer's blocks of a step
 * (plus the blocks forming), not the whole cache. With a lower tier (kv_tiers: pinned host memory
 * via cuda_pinned_host_allocator, then NVMe) blocks move down when the pool is full; without one,
 * a full pool fails the step with STRATA_EFULL, as does a layer asking for more blocks than the
 * pool holds. Call before creating any sequence. The _plan form takes a KV plan (one codec per
 * layer the model holds); its slots fit the plan's largest block. The _plans form takes every
 * plan the sequences may use (per-request KV codecs): its slots fit the largest block of any. */
int cuda_model_create_kv_pool(cuda_model *cm, const kv_codec_params *codec, int block_tokens, size_t n_blocks,
                              const kv_lower_tier *lower, strata_error *err);
int cuda_model_create_kv_pool_plan(cuda_model *cm, const kv_codec_params *codecs, int block_tokens, size_t n_blocks,
                                   const kv_lower_tier *lower, strata_error *err);
int cuda_model_create_kv_pool_plans(cuda_model *cm, const kv_codec_params *const *plans, int n_plans, int block_tokens,
                                    size_t n_blocks, const kv_lower_tier *lower, strata_error *err);
/* Allocates now the device buffers of a step of up to `rows` tokens over `items` sequences (the
 * activations, the items' logits and job tables), which steps otherwise grow on first need: a
 * server settles its largest step's memory when it starts. STRATA_EIO naming the buffer when the
 * device has no room. */
int cuda_model_reserve_step(cuda_model *cm, size_t rows, size_t items, strata_error *err);

/* Sizing a shared pool, on the host (no device needed): slots of slot_bytes (the largest block of
 * any of the n_plans plans, each g->n_layers codecs, for geometry g) that budget_bytes holds (0:
 * room for n_seqs sequences of max_tokens), and the fewest a step of one sequence of max_tokens
 * needs: one layer's blocks and the one forming with a tier below, every block of every layer
 * without. STRATA_EINVAL when a plan has no blocks for g. */
typedef struct cuda_kv_pool_size {
    size_t slot_bytes, slots, need;
    size_t seq_blocks;   /* every block of one sequence of max_tokens, all layers */
} cuda_kv_pool_size;
int cuda_kv_pool_sizing(const kv_codec_params *const *plans, int n_plans, const kv_geometry *g, size_t max_tokens,
                        size_t n_seqs, uint64_t budget_bytes, bool tier_below, cuda_kv_pool_size *out,
                        strata_error *err);

/* Where the steps' time goes (worker/cuda/phase_timer.h): on, every later step records a CUDA
 * event at each phase boundary and the host waits for the step's last one (the steps no longer
 * overlap the next step's host work); the totals start from zero. Off (the default) frees the
 * events. cuda_model_phase_times: the totals so far (zeros when off). */
int cuda_model_time_phases(cuda_model *cm, bool on, strata_error *err);
void cuda_model_phase_times(const cuda_model *cm, cuda_phase_times *out);

/* The shared pool's statistics (zeros without one). */
void cuda_model_kv_pool_stats(const cuda_model *cm, device_pool_stats *out);

/* STRATA_OK when the forward pass can keep a cache of this codec: every codec of this version
 * (fp16, KIVI, TaDA, GEAR with its prompt-rank blocks, OTT with its tracker on the device). Needs
 * no device. cuda_seq_check_plan: every layer's codec, and one fp16 window (residual R) for all
 * layers, which the batched decode relies on (blocks form in every layer at the same step);
 * STRATA_EUNSUPPORTED naming the layer otherwise. */
int cuda_seq_check_codec(const kv_codec_params *codec, strata_error *err);
int cuda_seq_check_plan(const kv_codec_params *codecs, int n_layers, strata_error *err);

/* A sequence's KV cache on the device for up to max_tokens positions, block_tokens per block:
 * every layer in one codec, or (_plan) layer l of the model's layers in codecs[l]. */
cuda_seq *cuda_seq_create(cuda_model *cm, const kv_codec_params *codec, int block_tokens, size_t max_tokens,
                          strata_error *err);
cuda_seq *cuda_seq_create_plan(cuda_model *cm, const kv_codec_params *codecs, int block_tokens, size_t max_tokens,
                               strata_error *err);
/* Device bytes this sequence took (its arena, tails, tables and scratch). */
size_t cuda_seq_bytes(const cuda_seq *s);
void cuda_seq_free(cuda_seq *s);
size_t cuda_seq_length(const cuda_seq *s);
/* Shared pool: marks a preempted sequence's blocks to leave the device first (or no longer). */
void cuda_seq_set_waiting(cuda_seq *s, bool waiting);

/* Migration: the sequence as a sequence image (kvstore/seq_image.h, docs/format.md section 10),
 * the same bytes kv_seq_export writes for a CPU sequence, so images move between GPU and CPU
 * stages: its blocks as their exact bytes (with the shared pool, a block below the device is
 * brought back for the copy), its fp16 tails, its prompt length and OTT's tracker state. *img is
 * malloc'd. Call between steps. cuda_seq_import makes a new sequence of the given size from an
 * image whose plan is one of plans[0 .. n_plans) (each one codec per layer the model holds;
 * compared in canonical form), on that plan, checking it as kv_seq_import does (STRATA_EUNSUPPORTED
 * for another plan, STRATA_EINVAL for an image that does not fit, STRATA_EFORMAT / STRATA_ECRC
 * for a malformed or damaged one). */
int cuda_seq_export(cuda_seq *s, uint8_t **img, size_t *len, strata_error *err);
cuda_seq *cuda_seq_import(cuda_model *cm, const kv_codec_params *const *plans, int n_plans, int block_tokens,
                          size_t max_tokens, const uint8_t *img, size_t len, strata_error *err);

/* Runs n tokens at the sequence's next positions, like model_forward: a prompt on an empty
 * sequence (n > 1) goes through exact causal attention over its fp16 K/V, one token on a
 * non-empty sequence through attention over the compressed cache, n > 1 tokens on a non-empty
 * sequence as a prompt chunk (cuda_model_forward_batch). logits: n_vocab floats (host) for the
 * last token, or NULL. STRATA_EINVAL for a bad token or too many tokens; STRATA_EIO for a CUDA or
 * cuBLAS failure; STRATA_EFORMAT if the attention kernel rejected a block of the cache. */
int cuda_model_forward(cuda_model *cm, cuda_seq *s, const int32_t *tokens, size_t n, float *logits,
                       strata_error *err);

/* One item of a batched step. */
typedef struct cuda_batch_item {
    cuda_seq *seq;          /* at most once per step */
    const int32_t *tokens;
    size_t n_tokens;        /* >= 1: a prompt on an empty sequence, a prompt chunk or one token on a
                             * non-empty one; at most 65535 */
} cuda_batch_item;

/* One step of continuous batching: the projections and FFN run once over every item's rows, the
 * decoding items' K/V go into their tails in one launch per layer (blocks forming where a tail
 * fills) and their attention is one launch per layer over all their caches; each prompt gets
 * causal prefill attention; each prompt chunk continuing a sequence attends its cache as it was
 * before the chunk plus its own fp16 K/V, causal (the cache written out as fp32 rows, then the
 * cuBLAS prefill: the CPU's kern_kv_attention_rows semantics); then the prompts and chunks join
 * their caches, the blocks they form encoded in a few launches per layer. Decoding sequences of
 * one step may use different plans (per-request KV codecs): their decode items run in one group
 * per plan (per layer and group: its encoder launches, a tail move and an attention launch).
 * logits: n_items rows of n_vocab floats (host), the last token of each item in the items'
 * order, or NULL. A logit that is not finite (NaN, +inf or -inf: weights or metadata that overflow
 * fp32) fails the step with STRATA_EFORMAT naming it, as the CPU head does, whichever way the
 * tokens are picked. On failure after the checks the sequences of the step are left inconsistent:
 * the caller discards them (as with model_forward_batch); a step the pool has no room for fails
 * before, with STRATA_EFULL, nothing changed (cuda_model_batch_check). */
int cuda_model_forward_batch(cuda_model *cm, const cuda_batch_item *items, size_t n_items, float *logits,
                             strata_error *err);

/* The checks cuda_model_forward_batch and cuda_model_stage_step make before anything runs,
 * without running anything: every item (sequence, tokens, length, no sequence twice) and, with
 * the shared pool, the items' room together (offload/device_pool.h's device_room: a layer's
 * blocks of the step within the slots; what the step may move within the tiers below), each item
 * beside those before it. On failure *bad_item (if non-NULL) is the index of the item at fault
 * (n_items for a fault that is no item's): a caller can leave it out and check the rest again.
 * STRATA_OK leaves *bad_item = n_items. Touches no device memory. */
int cuda_model_batch_check(cuda_model *cm, const cuda_batch_item *items, size_t n_items, size_t *bad_item,
                           strata_error *err);

/* The same step with greedy sampling on the device: next[i] is the argmax of item i's logits
 * (only the ids cross to the host). */
int cuda_model_forward_batch_greedy(cuda_model *cm, const cuda_batch_item *items, size_t n_items, int32_t *next,
                                    strata_error *err);

/* The same step with sampling on the device (kernels/cuda_sample.h): next[i] is what
 * sampler_pick would choose from item i's logits with sample[i]'s parameters and draw (the host
 * keeps the PRNG: sampler_next_draw). Greedy rows take the argmax. STRATA_EINVAL for parameters
 * sampler_params_validate would refuse or a draw outside [0, 1). */
int cuda_model_forward_batch_sample(cuda_model *cm, const cuda_batch_item *items, size_t n_items,
                                    const cuda_sample_row *sample, int32_t *next, strata_error *err);

/* A pipeline stage's rows: device memory, [rows][n_embd] fp32, the items' rows one item after
 * another in the caller's order (each item all its tokens). */
typedef struct cuda_stage_io {
    const float *hidden_in;   /* the rows entering the stage's first layer (every stage but the first) */
    float *hidden_out;        /* the rows leaving its last layer (every stage but the last) */
} cuda_stage_io;

/* One step of a pipeline stage (or of a whole model, with zero io): cuda_model_forward_batch over
 * the layers the stage holds, taking its rows from io->hidden_in instead of embedding tokens
 * (items' tokens may then be NULL) and handing them on in io->hidden_out; logits only on the last
 * stage. The stages of one model, run in order on the same items, compute what the whole model
 * computes (the same kernels on the same rows); between two GPUs the rows cross by NCCL
 * (worker/transport). STRATA_EINVAL when a stage misses its input or output. */
int cuda_model_stage_step(cuda_model *cm, const cuda_batch_item *items, size_t n_items, const cuda_stage_io *io,
                          float *logits, strata_error *err);
/* The last stage's step with the tokens picked on the device (cuda_model_forward_batch_sample's
 * rules) instead of the logits. */
int cuda_model_stage_step_sample(cuda_model *cm, const cuda_batch_item *items, size_t n_items, const cuda_stage_io *io,
                                 const cuda_sample_row *sample, int32_t *next, strata_error *err);

/* After a failed step: whether the device context is lost (a kernel met an illegal address, a
 * launch failed on the device, ...). Such an error stays for every later CUDA call of the
 * process, so each step would fail; a long-lived caller should leave and be restarted with a
 * new context. true with the reason in err; false when the device still runs work. */
bool cuda_model_context_lost(cuda_model *cm, strata_error *err);

/* Device bytes cuda_seq_create(cm, codec, block_tokens, max_tokens) takes: what a memory budget
 * divides by to size a batch. */
int cuda_seq_device_bytes(const cuda_model *cm, const kv_codec_params *codec, int block_tokens, size_t max_tokens,
                          size_t *bytes, strata_error *err);

#endif
