/* Where a forward step's time goes, by phase (projections, attention, block formation, ...),
 * measured with CUDA events on the stream the step runs on. Off by default (a mark is then one
 * branch); the decode benchmark turns it on (strata-bench-decode-gpu --phases) because Nsight
 * Systems does not run on the lent machines and a whole-step time cannot say what to change.
 *
 * A step is a series of marks; each mark records an event and starts a phase that lasts until the
 * next mark. At the end of the step the host waits for the last event and adds, per phase, the
 * device time between consecutive events (the work enqueued in the phase plus any time the device
 * sat waiting for the host to enqueue it) and the host time between the marks (building tables,
 * tier copies, launch overhead, synchronous copies waiting for the device). Device time far below
 * host time in a phase means the host is what limits it. */
#ifndef STRATA_WORKER_CUDA_PHASE_TIMER_H
#define STRATA_WORKER_CUDA_PHASE_TIMER_H

#include <stdint.h>

#include "kvstore/error.h"

typedef enum cuda_phase {
    CUDA_PHASE_INPUT,          /* step set-up: item checks, decode jobs and tables, embedding rows up */
    CUDA_PHASE_QKV,            /* RMSNorm, Q/K/V projections, RoPE, K/V to fp16 */
    CUDA_PHASE_KV_FETCH,       /* shared pool: the layer's blocks brought back and pinned, tables up */
    CUDA_PHASE_KV_APPEND,      /* decode items: K/V into the tails, blocks that fill encoded, tails moved */
    CUDA_PHASE_DECODE_ATTN,    /* attention over the compressed caches of the decode items */
    CUDA_PHASE_PREFILL_ATTN,   /* a prompt's causal attention over its own rows (cuBLAS) */
    CUDA_PHASE_CHUNK_ATTN,     /* a prompt chunk's attention over the cache and its own rows */
    CUDA_PHASE_PROMPT_BLOCKS,  /* prompts and chunks: their blocks encoded, tails written */
    CUDA_PHASE_MLP,            /* output projection, residuals, RMSNorm, gate/up/down, SwiGLU */
    CUDA_PHASE_HEAD,           /* the step's end: kernel status read back (waits for the device),
                                * the output head and sampling, or a stage's rows handed on */
    CUDA_PHASE_COUNT
} cuda_phase;

/* Totals since timing was turned on (milliseconds). */
typedef struct cuda_phase_times {
    double device_ms[CUDA_PHASE_COUNT];
    double host_ms[CUDA_PHASE_COUNT];
    uint64_t marks[CUDA_PHASE_COUNT];   /* how many times each phase began */
    uint64_t steps;                     /* steps timed to the end */
    uint64_t dropped_steps;             /* steps that ran but whose times were lost (an event failed) */
} cuda_phase_times;

/* "input", "qkv", "kv_fetch", ...: short names for tables and JSON keys; "?" out of range. */
const char *cuda_phase_name(cuda_phase p);

typedef struct cuda_phase_timer cuda_phase_timer;

/* A timer with zeroed totals, or NULL (STRATA_ENOMEM). Events are created as marks need them. */
cuda_phase_timer *cuda_phase_timer_create(strata_error *err);
void cuda_phase_timer_free(cuda_phase_timer *t);
/* Phase p begins now, on the legacy default stream. A NULL timer does nothing. */
void cuda_phase_mark(cuda_phase_timer *t, cuda_phase p);
/* Forgets the marks of a step that did not finish (no totals added). */
void cuda_phase_timer_discard(cuda_phase_timer *t);
/* Ends the step: waits for the device to reach this point and adds the step's phases to the
 * totals. STRATA_EIO with the CUDA error if an event failed (the step's times are dropped and
 * counted in dropped_steps).
 * Nothing to do (STRATA_OK) for a NULL timer or a step without marks. */
int cuda_phase_timer_end_step(cuda_phase_timer *t, strata_error *err);
void cuda_phase_timer_totals(const cuda_phase_timer *t, cuda_phase_times *out);

#endif
