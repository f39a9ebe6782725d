/* A forward step's time by phase, from CUDA events (phase_timer.h). */
#include "worker/cuda/phase_timer.h"
#include "kvstore/clock.h"
#include "worker/cuda/cuda_fail.h"

#include <cuda_runtime.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct cuda_phase_timer {
    cudaEvent_t *events;   /* events[0 .. created) exist; kept across steps */
    cuda_phase *phase;     /* phase[i]: the phase that begins at events[i] */
    double *host_s;        /* the host clock at each mark */
    size_t n, cap, created;
    cudaError_t failed;    /* the first failure of this step's marks, or cudaSuccess */
    cuda_phase_times totals;
};

static const char *const phase_names[CUDA_PHASE_COUNT] = {
    [CUDA_PHASE_INPUT] = "input",
    [CUDA_PHASE_QKV] = "qkv",
    [CUDA_PHASE_KV_FETCH] = "kv_fetch",
    [CUDA_PHASE_KV_APPEND] = "kv_append",
    [CUDA_PHASE_DECODE_ATTN] = "decode_attn",
    [CUDA_PHASE_PREFILL_ATTN] = "prefill_attn",
    [CUDA_PHASE_CHUNK_ATTN] = "chunk_attn",
    [CUDA_PHASE_PROMPT_BLOCKS] = "prompt_blocks",
    [CUDA_PHASE_MLP] = "mlp",
    [CUDA_PHASE_HEAD] = "head",
};

const char *cuda_phase_name(cuda_phase p)
{
    return (unsigned)p < CUDA_PHASE_COUNT ? phase_names[p] : "?";
}

cuda_phase_timer *cuda_phase_timer_create(strata_error *err)
{
    cuda_phase_timer *t = calloc(1, sizeof *t);
    if (!t)
        strata_fail(err, STRATA_ENOMEM, "out of memory for the phase timer");
    return t;
}

void cuda_phase_timer_free(cuda_phase_timer *t)
{
    if (!t)
        return;
    for (size_t i = 0; i < t->created; i++)
        cudaEventDestroy(t->events[i]);
    free(t->events);
    free(t->phase);
    free(t->host_s);
    free(t);
}

/* Room for one more mark and its event. */
static cudaError_t reserve(cuda_phase_timer *t)
{
    if (t->n == t->cap) {
        const size_t cap = t->cap ? 2 * t->cap : 64;
        cudaEvent_t *e = realloc(t->events, cap * sizeof *e);
        if (e)
            t->events = e;
        cuda_phase *p = e ? realloc(t->phase, cap * sizeof *p) : NULL;
        if (p)
            t->phase = p;
        double *h = p ? realloc(t->host_s, cap * sizeof *h) : NULL;
        if (!h)
            return cudaErrorMemoryAllocation;
        t->host_s = h;
        t->cap = cap;
    }
    if (t->n == t->created) {
        cudaError_t e = cudaEventCreateWithFlags(&t->events[t->n], 0);   /* timing on */
        if (e != cudaSuccess)
            return e;
        t->created++;
    }
    return cudaSuccess;
}

static void record(cuda_phase_timer *t, cuda_phase p)
{
    if (t->failed != cudaSuccess)
        return;
    cudaError_t e = reserve(t);
    if (e == cudaSuccess)
        e = cudaEventRecord(t->events[t->n], 0);
    if (e != cudaSuccess) {
        t->failed = e;
        return;
    }
    t->phase[t->n] = p;
    t->host_s[t->n] = strata_mono_s();
    t->n++;
}

void cuda_phase_mark(cuda_phase_timer *t, cuda_phase p)
{
    if (t && (unsigned)p < CUDA_PHASE_COUNT)
        record(t, p);
}

void cuda_phase_timer_discard(cuda_phase_timer *t)
{
    if (t) {
        t->n = 0;
        t->failed = cudaSuccess;
    }
}

int cuda_phase_timer_end_step(cuda_phase_timer *t, strata_error *err)
{
    if (!t || (t->n == 0 && t->failed == cudaSuccess))
        return STRATA_OK;
    const size_t marks = t->n;
    record(t, CUDA_PHASE_COUNT);   /* the end of the last phase */
    cudaError_t e = t->failed;
    if (e == cudaSuccess)
        e = cudaEventSynchronize(t->events[marks]);
    double device[CUDA_PHASE_COUNT] = {0}, host[CUDA_PHASE_COUNT] = {0};
    for (size_t i = 0; e == cudaSuccess && i < marks; i++) {
        float between = 0.0f;
        e = cudaEventElapsedTime(&between, t->events[i], t->events[i + 1]);
        device[t->phase[i]] += between;
        host[t->phase[i]] += (t->host_s[i + 1] - t->host_s[i]) * 1e3;
    }
    cuda_phase_timer_discard(t);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();   /* not to be read as the next launch's failure */
        t->totals.dropped_steps++;
        return cuda_fail(err, e, "phase timer");
    }
    for (size_t i = 0; i < marks; i++)
        t->totals.marks[t->phase[i]]++;
    for (int p = 0; p < CUDA_PHASE_COUNT; p++) {
        t->totals.device_ms[p] += device[p];
        t->totals.host_ms[p] += host[p];
    }
    t->totals.steps++;
    return STRATA_OK;
}

void cuda_phase_timer_totals(const cuda_phase_timer *t, cuda_phase_times *out)
{
    if (t)
        *out = t->totals;
    else
        memset(out, 0, sizeof *out);
}
