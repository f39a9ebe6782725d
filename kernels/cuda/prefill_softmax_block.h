/* The body of cuda_prefill_softmax (kernels/cuda/prefill.cu), phase by phase, for the device and
 * for the CPU emulation (tests/fakecuda/kernels_emu.c runs the phases with the threads taken one
 * after another; within a phase no thread reads what another writes). One thread block per row:
 *   1. pf_max_part      per thread: the max of its strided share of the row's valid scores
 *   2. pf_exp_part      per thread: the row max from every partial, then e^(s - max) of its share
 *                       written back, and their sum
 *   3. pf_normalize     per thread: the normalizer from every partial, its share divided, the
 *                       masked tail of the row zeroed
 * and of cuda_chunk_softmax_tile, the online softmax over a prompt chunk's key tiles: a row's
 * running max m and sum l (kept per query row and head from one tile to the next) and its output
 * row, rescaled when the max grows, then divided by l at the end (cuda_chunk_normalize):
 *   1. pf_online_max_part  per thread: the max of its share; thread 0 reads the state into st
 *                          (-inf and 0 on the first tile)
 *   2. pf_online_exp_part  per thread: the new max from st and every partial, e^(s - max) of its
 *                          share in place, and their sum
 *   3. pf_online_finish    per thread: the masked tail zeroed, its share of the output row scaled
 *                          by e^(m_old - m_new) (not on the first tile, whose values GEMM writes
 *                          the row afresh); thread 0 writes the new state
 *   pf_divide_row          per thread: its share of an output row divided by the row's l */
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

/* e^(s - m) of a thread's share of the row, in place; their sum into red_sum[tid]. */
STRATA_HD static inline void pf_exp_share(float *row, int n_valid, float m, float *red_sum, unsigned tid, unsigned nt)
{
    float sum = 0.0f;
    for (int j = (int)tid; j < n_valid; j += (int)nt) {
        const float e = PF_EXP(row[j] - m);
        row[j] = e;
        sum += e;
    }
    red_sum[tid] = sum;
}

STRATA_HD static inline void pf_exp_part(float *row, int n_valid, const float *red_max, float *red_sum, unsigned tid,
                                         unsigned nt)
{
    float m = -INFINITY;
    for (unsigned x = 0; x < nt; x++)
        m = fmaxf(m, red_max[x]);
    pf_exp_share(row, n_valid, m, red_sum, tid, nt);
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

STRATA_HD static inline void pf_online_max_part(const float *row, int n_valid, const float *m, const float *l,
                                                int first, float *red_max, float *st, unsigned tid, unsigned nt)
{
    pf_max_part(row, n_valid, red_max, tid, nt);
    if (tid == 0) {
        st[0] = first ? -INFINITY : *m;
        st[1] = first ? 0.0f : *l;
    }
}

/* The row's max over the state and this tile: every thread computes it alike. */
STRATA_HD static inline float pf_online_new_max(const float *red_max, const float *st, unsigned nt)
{
    float m = st[0];
    for (unsigned x = 0; x < nt; x++)
        m = fmaxf(m, red_max[x]);
    return m;
}

STRATA_HD static inline void pf_online_exp_part(float *row, int n_valid, const float *red_max, const float *st,
                                                float *red_sum, unsigned tid, unsigned nt)
{
    pf_exp_share(row, n_valid, pf_online_new_max(red_max, st, nt), red_sum, tid, nt);
}

STRATA_HD static inline void pf_online_finish(float *row, int n_valid, int kn, const float *red_max,
                                              const float *red_sum, const float *st, int first, float *out, int dim,
                                              float *m, float *l, unsigned tid, unsigned nt)
{
    const float m_new = pf_online_new_max(red_max, st, nt);
    const float alpha = first ? 0.0f : PF_EXP(st[0] - m_new);
    for (int j = n_valid + (int)tid; j < kn; j += (int)nt)
        row[j] = 0.0f;
    if (!first)
        for (int d = (int)tid; d < dim; d += (int)nt)
            out[d] *= alpha;
    if (tid == 0) {
        float sum = 0.0f;
        for (unsigned x = 0; x < nt; x++)
            sum += red_sum[x];
        *m = m_new;
        *l = st[1] * alpha + sum;
    }
}

STRATA_HD static inline void pf_divide_row(float *out, int dim, const float *l, unsigned tid, unsigned nt)
{
    const float inv = 1.0f / *l;
    for (int d = (int)tid; d < dim; d += (int)nt)
        out[d] *= inv;
}


#endif
