/* The body of cuda_prefill_softmax (kernels/cuda/prefill.cu), phase by phase, for the device and
 * for the CPU emulation (tests/fakecuda/kernels_emu.c runs the phases with the threads taken one
 * after another; within a phase no thread reads what another writes). One thread block per row:
 *   1. pf_max_part      per thread: the max of its strided share of the row's valid scores
 *   2. pf_exp_part      per thread: the row max from every partial, then e^(s - max) of its share
 *                       written back, and their sum
 *   3. pf_normalize     per thread: the normalizer from every partial, its share divided, the
 *                       masked tail of the row zeroed */
#ifndef STRATA_KERNELS_CUDA_PREFILL_SOFTMAX_BLOCK_H
#define STRATA_KERNELS_CUDA_PREFILL_SOFTMAX_BLOCK_H

#include <math.h>

#include "kvstore/hd.h"

#ifdef __CUDA_ARCH__
#define PF_EXP(x) __expf(x)
#else
#define PF_EXP(x) expf(x)
#endif

STRATA_HD static inline void pf_max_part(const float *row, int n_valid, float *red_max, unsigned tid, unsigned nt)
{
    float m = -INFINITY;
    for (int j = (int)tid; j < n_valid; j += (int)nt)
        m = fmaxf(m, row[j]);
    red_max[tid] = m;
}

STRATA_HD static inline void pf_exp_part(float *row, int n_valid, const float *red_max, float *red_sum, unsigned tid,
                                         unsigned nt)
{
    float m = -INFINITY;
    for (unsigned x = 0; x < nt; x++)
        m = fmaxf(m, red_max[x]);
    float sum = 0.0f;
    for (int j = (int)tid; j < n_valid; j += (int)nt) {
        const float e = PF_EXP(row[j] - m);
        row[j] = e;
        sum += e;
    }
    red_sum[tid] = sum;
}

STRATA_HD static inline void pf_normalize(float *row, int n_valid, int kn, const float *red_sum, unsigned tid,
                                          unsigned nt)
{
    float sum = 0.0f;
    for (unsigned x = 0; x < nt; x++)
        sum += red_sum[x];
    const float inv = 1.0f / sum;
    for (int j = (int)tid; j < kn; j += (int)nt)
        row[j] = j < n_valid ? row[j] * inv : 0.0f;
}

#endif
