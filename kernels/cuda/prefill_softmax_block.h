/* The body of cuda_prefill_softmax (kernels/cuda/prefill.cu), phase by phase, for the device and
 * for the CPU emulation (tests/fakecuda/kernels_emu.c runs the phases with the threads taken one
 * after another; within a phase no thread reads what another writes). One thread block per row:
 *   1. pf_max_part      per thread: the max of its strided share of the row's valid scores
 *   2. pf_combine_max   thread 0: the row max from every partial, into st[0]
 *   3. pf_exp_share     per thread: e^(s - max) of its share written back, and their sum
 *   4. pf_combine_sum   thread 0: the normalizer from every partial, into st[1]
 *   5. pf_normalize     per thread: its share divided, the masked tail of the row zeroed
 * Thread 0 combines the partials once: with every thread reading all of them (the first
 * version) a row cost nt^2 shared-memory reads, more than the row itself for rows under 16K
 * keys (and 40 % of the fake device's time in the CPU emulation).
 * And of cuda_chunk_softmax_tile, the online softmax over a prompt chunk's key tiles: a row's
 * running max m and sum l (kept per query row and head from one tile to the next) and its output
 * row, rescaled when the max grows, then divided by l at the end (cuda_chunk_normalize):
 *   1. pf_online_max_part  per thread: the max of its share; thread 0 reads the state into st
 *                          (-inf and 0 on the first tile)
 *   2. pf_combine_max      thread 0: the new max from the state's and every partial, into st[2]
 *   3. pf_exp_share        per thread: e^(s - st[2]) of its share in place, and their sum
 *   4. pf_online_finish    per thread: the masked tail zeroed, its share of the output row scaled
 *                          by e^(m_old - m_new) (not on the first tile, whose values GEMM writes
 *                          the row afresh); thread 0 sums the partials and writes the new state
 *   pf_divide_row          per thread: its share of an output row divided by the row's l */
#ifndef STRATA_KERNELS_CUDA_PREFILL_SOFTMAX_BLOCK_H
#define STRATA_KERNELS_CUDA_PREFILL_SOFTMAX_BLOCK_H

#include <math.h>

#include "kvstore/hd.h"

/* The device's fast exponential (ex2.approx: a few ulp, subnormal results flushed), the C
 * library's in the emulation: prefill results on a GPU differ from the CPU's by ~1e-6 relative
 * here, on top of the GEMMs' order, which the GPU tests' bounds allow for. */
#ifdef __CUDA_ARCH__
#define PF_EXP(x) __expf(x)
#else
#define PF_EXP(x) expf(x)
#endif

STRATA_HD static inline void pf_max_part(const float *row, int n_valid, float *red_max, unsigned tid, unsigned nt)
{
    float m = -INFINITY;
    for (int j = (int)tid; j < n_valid; j += (int)nt)
        m = strata_fmaxf(m, row[j]);
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

/* Thread 0 only: the max of init and every thread's partial. */
STRATA_HD static inline void pf_combine_max(const float *red_max, float init, float *out, unsigned tid, unsigned nt)
{
    if (tid != 0)
        return;
    float m = init;
    for (unsigned x = 0; x < nt; x++)
        m = strata_fmaxf(m, red_max[x]);
    *out = m;
}

STRATA_HD static inline float pf_partials_sum(const float *red_sum, unsigned nt)
{
    float sum = 0.0f;
    for (unsigned x = 0; x < nt; x++)
        sum += red_sum[x];
    return sum;
}

/* Thread 0 only: the sum of every thread's partial. */
STRATA_HD static inline void pf_combine_sum(const float *red_sum, float *out, unsigned tid, unsigned nt)
{
    if (tid == 0)
        *out = pf_partials_sum(red_sum, nt);
}

STRATA_HD static inline void pf_normalize(float *row, int n_valid, int kn, float sum, unsigned tid, unsigned nt)
{
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

/* st: the old max, the old sum and the new max (pf_combine_max). */
STRATA_HD static inline void pf_online_finish(float *row, int n_valid, int kn, const float *red_sum, const float *st,
                                              int first, float *out, int dim, float *m, float *l, unsigned tid,
                                              unsigned nt)
{
    const float m_new = st[2];
    const float alpha = first ? 0.0f : PF_EXP(st[0] - m_new);
    for (int j = n_valid + (int)tid; j < kn; j += (int)nt)
        row[j] = 0.0f;
    if (!first)
        for (int d = (int)tid; d < dim; d += (int)nt)
            out[d] *= alpha;
    if (tid == 0) {
        *m = m_new;
        *l = st[1] * alpha + pf_partials_sum(red_sum, nt);
    }
}

STRATA_HD static inline void pf_divide_row(float *out, int dim, const float *l, unsigned tid, unsigned nt)
{
    const float inv = 1.0f / *l;
    for (int d = (int)tid; d < dim; d += (int)nt)
        out[d] *= inv;
}


#endif
