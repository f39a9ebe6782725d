/* A worker's pipeline stage: executes the coordinator's step plans (strata_internal.proto) on
 * the layers it holds. It owns the stage's KV block pool (and the host/NVMe tiers below it), one
 * KV sequence and one sampler per live sequence, and the data-plane links to the neighbouring
 * stages.
 *
 * A step: park the listed prefixes (prefix caching: the first tokens of a finished sequence
 * kept as an image in host memory, from which later sequences start as copies) and drop the
 * listed ones; free, preempt (spill) and resume the listed sequences; then run the plan's
 * sequences through model_forward_batch. Stage 0 embeds the tokens; each later stage receives, from the
 * stage before it, one HIDDEN frame per step that has work: a table of the sequences that stage
 * ran (id, token count) followed by their activation rows. A stage runs exactly the sequences of
 * that table that are also fine locally, and forwards its own table, so a sequence that failed on
 * one stage (an I/O error restoring its blocks, say) drops out of the step everywhere below it
 * while the others go on. The last stage samples (one seeded sampler per sequence) and returns
 * the tokens. Every stage reports its per-sequence failures; the coordinator fails those
 * requests and frees the sequences everywhere.
 *
 * Thread-safety: one thread drives a stage. */
#ifndef STRATA_WORKER_STAGE_H
#define STRATA_WORKER_STAGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvstore/error.h"
#include "proto/strata_internal.pb-c.h"
#include "worker/model.h"
#include "worker/transport/transport.h"

typedef struct stage stage;

typedef struct stage_options {
    const char *nvme_dir;   /* the worker's spill directory (local configuration); NULL: none */
    int link_timeout_ms;    /* waiting for the previous stage's rows; 0: 120000, < 0: no limit */
    bool cuda;              /* compute on CUDA device cuda_device (stage_gpu.h) instead of the CPU */
    int cuda_device;
    /* GPU stages: NCCL links beside prev / next (dp_nccl_upgrade) on which the activation rows
     * cross in device memory; the tables stay on prev / next. NULL: rows on prev / next too. */
    dp_link *rows_prev, *rows_next;
} stage_options;

/* m holds the assignment's layers [layer_begin, layer_end) (the stage keeps the pointer; the
 * caller frees m after stage_destroy). With o->cuda the layers and the KV run on that GPU
 * (stage_gpu.h: each KV plan's layers share one fp16 window; preemption marks a sequence's blocks
 * to leave the device first; migration images are the CPU stage's bytes, so sequences move
 * between GPU and CPU stages), else on the CPU. prev: the link from stage - 1 (NULL on stage 0);
 * next: the link to stage + 1 (NULL on the last stage); both stay the caller's.
 * The largest step's memory is settled here, not at the first step that large: a CPU stage is
 * refused (STRATA_EINVAL naming --max-batch-tokens) when its weights, KV budgets and the
 * activations of max_batch_tokens rows exceed what the machine lets the process have; a GPU stage
 * allocates that step's device buffers here (a device too small fails, naming the flag). */
stage *stage_create(const Strata__Internal__V1__Assignment *a, model *m, const stage_options *o, dp_link *prev,
                    dp_link *next, strata_error *err);
void stage_destroy(stage *s);

/* The outcome of one sequence in a step. */
typedef struct stage_seq_result {
    uint64_t seq_id;
    bool sampled;        /* the last stage sampled `token` */
    uint32_t token;
    int status;          /* STRATA_OK, or why this sequence failed on this stage */
    char message[512];   /* a strata_error message */
    bool prefix_failed;  /* it failed because its prefix entry could not be copied (SeqResult) */
} stage_seq_result;

typedef struct stage_result {
    uint64_t step;
    stage_seq_result *seqs;   /* owned by the stage, valid until the next step */
    size_t n_seqs;
} stage_result;

/* Runs one step plan. Per-sequence failures are in out; the return value is not OK only when the
 * stage itself cannot go on (a broken data-plane link, out of memory): the worker then leaves. */
int stage_step(stage *s, const Strata__Internal__V1__StepPlan *plan, stage_result *out, strata_error *err);

/* Migration (strata_internal.proto Migrate): one sequence as a byte image: its KV (kv_seq_export:
 * the blocks as their exact bytes) and, on the last stage, its sampler state. The sequence stays
 * on this stage until stage_drop_seq. Errors: STRATA_EINVAL for an unknown or preempted sequence,
 * what kv_seq_export returns otherwise. *img is malloc'd. */
int stage_export_seq(stage *s, uint64_t id, uint8_t **img, size_t *len, strata_error *err);
/* Adds a sequence from an image made by the same stage of another replica; it continues exactly
 * where it was (same tokens). STRATA_EINVAL for an id already here or an image of another stage. */
int stage_import_seq(stage *s, uint64_t id, const uint8_t *img, size_t len, strata_error *err);
/* Frees a sequence (no-op for an unknown id). */
void stage_drop_seq(stage *s, uint64_t id);

typedef struct stage_kv_usage {
    size_t device_blocks, device_capacity_blocks;
    size_t device_bytes, device_capacity_bytes;
    size_t host_blocks, host_bytes, host_capacity_bytes;
    size_t nvme_blocks;
    uint64_t nvme_bytes, nvme_capacity_bytes;
    uint64_t spills, restores, crc_failures;
    uint64_t spill_failures, restore_failures;   /* moves to/from NVMe that failed (blocks stay above) */
    strata_error spill_error;                    /* why the last spill failed; code 0 when it succeeded */
    size_t sequences;
    size_t prefix_entries, prefix_bytes;         /* prefix entries kept (host memory, outside the tiers) */
} stage_kv_usage;

void stage_get_kv_usage(const stage *s, stage_kv_usage *out);

#endif
