/* The CUDA compute of a pipeline stage (internal to worker/stage): the stage's layers on one GPU
 * (worker/cuda/model_cuda.h), its sequences' KV in a device block pool shared by them, over
 * pinned host memory and NVMe when the assignment grants those tiers. stage.c keeps the step
 * plans, the data-plane frames (rows cross in host memory: TCP) and the samplers; this file only
 * runs a step's items and keeps the device sequences.
 *
 * Differences from the CPU stage: each KV plan's layers must share the fp16 window R; a preempted
 * sequence keeps its device tail and has its blocks marked to leave the device first (they move
 * to the host tier when room is needed) instead of being spilled whole. Sequences migrate as
 * sequence images (stage_gpu_seq_export / _import), the CPU stage's format.
 * In a build without CUDA every call fails with STRATA_EUNSUPPORTED.
 * Status: test_stage's GPU cases (two stages, migration) passed on an H100 in session 8; the
 * strata-worker program on a GPU has not run (docs/gpu.md). */
#ifndef STRATA_WORKER_STAGE_GPU_H
#define STRATA_WORKER_STAGE_GPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvstore/error.h"
#include "kernels/cuda_sample.h"
#include "kvstore/kv_cache.h"
#include "offload/kv_tiers.h"
#include "worker/model.h"
#include "worker/stage/stage.h"

typedef struct stage_gpu stage_gpu;
typedef struct stage_gpu_seq stage_gpu_seq;

typedef struct stage_gpu_config {
    int device;                    /* CUDA device index */
    /* The KV plans the stage's sequences may use, each the stage's layers (copied): plans[0] the
     * assignment's own, then those requests may name (per-request KV codecs). Every plan keeps
     * one fp16 window across its layers; the device pool's slots fit the largest block of any. */
    const kv_codec_params *const *plans;
    int n_plans;
    int block_tokens;
    size_t max_seq_tokens, max_batch_seqs;
    size_t max_batch_tokens;       /* a step's rows: their device buffers are allocated at creation; 0: on need */
    uint64_t device_kv_bytes;      /* 0: room for max_batch_seqs sequences of max_seq_tokens */
    const kv_tiers_options *tiers; /* host (pinned here) and NVMe tiers below the pool, or NULL */
} stage_gpu_config;

/* Makes `device` current and checks it exists: STRATA_EIO "no CUDA device", STRATA_EINVAL for
 * an index the machine lacks, STRATA_EUNSUPPORTED in a build without CUDA. */
int stage_gpu_probe(int device, strata_error *err);

/* m holds the stage's layers and must outlive the result. */
int stage_gpu_create(model *m, const stage_gpu_config *c, stage_gpu **out, strata_error *err);
void stage_gpu_destroy(stage_gpu *g);

/* A new, empty sequence on the config's plans[plan]. */
stage_gpu_seq *stage_gpu_seq_create(stage_gpu *g, int plan, strata_error *err);
void stage_gpu_seq_free(stage_gpu_seq *q);
size_t stage_gpu_seq_length(const stage_gpu_seq *q);
/* Preempted (true) or running again (false): see the top of this file. */
void stage_gpu_seq_set_waiting(stage_gpu_seq *q, bool waiting);

/* Migration: a sequence as a sequence image (cuda_seq_export: the bytes a CPU stage's
 * kv_seq_export writes), and a sequence of this stage made from one (cuda_seq_import) on the
 * image's plan, which must be one of the stage's (STRATA_EUNSUPPORTED otherwise). */
int stage_gpu_seq_export(stage_gpu *g, stage_gpu_seq *q, uint8_t **img, size_t *len, strata_error *err);
stage_gpu_seq *stage_gpu_seq_import(stage_gpu *g, const uint8_t *img, size_t len, strata_error *err);

typedef struct stage_gpu_item {
    stage_gpu_seq *seq;
    const int32_t *tokens;   /* n_tokens ids (the first stage embeds them) */
    size_t n_tokens;
} stage_gpu_item;

/* The checks a step makes before anything runs (cuda_model_batch_check: each item, and the
 * items' room in the device pool together), as model_batch_check: on failure *bad_item is the
 * item at fault (n_items: none), which the caller may leave out and check the rest again. */
int stage_gpu_batch_check(stage_gpu *g, const stage_gpu_item *items, size_t n_items, size_t *bad_item,
                          strata_error *err);

/* One step of the items, as model_forward_batch: hidden_in / hidden_out are the rows in the
 * items' order (every stage but the first / the last), in host memory, or in device memory when
 * the matching *_on_device is set (rows that cross on NCCL: stage_gpu_device_rows); logits the
 * last token of each item (last stage, host). A prompt chunk continuing a sequence runs whole, as
 * on the CPU (cuda_model_forward_batch). On a failure the items' sequences are inconsistent: the caller drops
 * them. */
int stage_gpu_forward(stage_gpu *g, const stage_gpu_item *items, size_t n_items, const float *hidden_in,
                      bool in_on_device, float *hidden_out, bool out_on_device, float *logits, strata_error *err);

/* The last stage's step with each item's next token picked on the device (kernels/
 * cuda_sample.h) from its last token's logits with sample[i] (a greedy row for items that do not
 * sample; only the ids cross to the host), into next[i]. */
int stage_gpu_forward_sample(stage_gpu *g, const stage_gpu_item *items, size_t n_items, const float *hidden_in,
                             bool in_on_device, const cuda_sample_row *sample, int32_t *next, strata_error *err);

/* Device buffers of a step's rows for NCCL links: which 0, the entering rows (received into it);
 * 1, the leaving rows (sent from it); room for `rows` rows (grown; earlier contents kept). NULL
 * with err set when device memory runs out. */
float *stage_gpu_device_rows(stage_gpu *g, int which, size_t rows, strata_error *err);

/* Moves n entering rows from row src to row dst < src (dropping the rows of sequences that
 * cannot run here) in device memory, in pieces whose source and destination do not overlap. */
int stage_gpu_compact_rows(stage_gpu *g, size_t dst, size_t src, size_t n, strata_error *err);

/* After a failed step: whether the stage's device context is lost (cuda_model_context_lost), so
 * that every later step would fail too; true with the reason in err. */
bool stage_gpu_context_lost(stage_gpu *g, strata_error *err);

/* The device pool and tiers, for the worker's KV report. */
void stage_gpu_usage(const stage_gpu *g, stage_kv_usage *out);

/* The host and NVMe tiers' part of a KV report (either kind of stage): their blocks, bytes and
 * capacities, and their moves and CRC failures added to out's. */
void stage_usage_add_tiers(const kv_tiers *t, stage_kv_usage *out);

#endif
