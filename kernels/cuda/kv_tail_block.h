/* The bodies of the batched tail kernels (kernels/cuda/kv_tail.cu) as inline functions that
 * compile for the device and the CPU, so that tests/cuda/test_cuda_plan.c runs them in CI thread
 * after thread (as the encoder's and attention's phases are run). One thread block per job. */
#ifndef STRATA_KERNELS_CUDA_KV_TAIL_BLOCK_H
#define STRATA_KERNELS_CUDA_KV_TAIL_BLOCK_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/cuda_kv_tail.h"
#include "kvstore/hd.h"

/* The job's rows of the step's K/V into its tail. */
STRATA_HD static inline void kv_tail_append(const cuda_kv_append_job *job, const uint16_t *k16, const uint16_t *v16,
                                            size_t row_elems, unsigned tid, unsigned nthreads)
{
    const size_t n = (size_t)job->n_rows * row_elems, from = (size_t)job->src_row * row_elems;
    for (size_t i = tid; i < n; i += nthreads) {
        job->dst_k[i] = k16[from + i];
        job->dst_v[i] = v16[from + i];
    }
}

/* Step r0 (0, shift, 2 shift, ... below keep) of moving rows [shift, shift + keep) to [0, keep):
 * rows [r0 + shift, r0 + shift + rows) to [r0, r0 + rows). The steps run in order with a barrier
 * between them: within a step source and destination do not overlap, and a step only overwrites
 * rows an earlier step has already moved away. */
STRATA_HD static inline void kv_tail_shift_step(const cuda_kv_shift_job *job, int shift, int keep, int r0,
                                                size_t row_elems, unsigned tid, unsigned nthreads)
{
    const int rows = keep - r0 < shift ? keep - r0 : shift;
    const size_t n = (size_t)rows * row_elems, dst = (size_t)r0 * row_elems, src = dst + (size_t)shift * row_elems;
    for (size_t i = tid; i < n; i += nthreads) {
        job->k[dst + i] = job->k[src + i];
        job->v[dst + i] = job->v[src + i];
    }
}

#endif
