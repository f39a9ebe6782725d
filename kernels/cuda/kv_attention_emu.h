/* The CUDA attention kernels' loops (kernels/cuda/kv_attention.cu) on the CPU: each thread block
 * in turn, each phase of kernels/cuda/kv_attention_block.h for every thread before the next phase
 * (what the kernels' barriers guarantee). Host code only, for the emulated tests
 * (tests/cuda/test_cuda_attention.c) and the fake device (tests/fakecuda); the kernels themselves
 * do not use it. Pointers are host pointers; the caller checks shapes. */
#ifndef STRATA_KERNELS_CUDA_KV_ATTENTION_EMU_H
#define STRATA_KERNELS_CUDA_KV_ATTENTION_EMU_H

#include <stdlib.h>

#include "kernels/cuda/kv_attention_block.h"

#define KV_ATT_EMU_THREADS 128u   /* the kernels' kThreads */

/* attend_chunk: one chunk through the six phases. */
static inline void kv_att_emu_chunk(const kv_att_shared *s, const cuda_kv_layout *L, const kv_att_src *src, int h,
                                    int qpk, int chunk, int n)
{
    const unsigned nt = KV_ATT_EMU_THREADS;
    for (unsigned t = 0; t < nt; t++)
        kv_att_scores(s, L, src, h, qpk, chunk, n, t, nt);
    for (unsigned t = 0; t < nt; t++)
        kv_att_max_parts(s, qpk, chunk, n, t, nt);
    for (unsigned t = 0; t < nt; t++)
        kv_att_max(s, qpk, t, nt);
    for (unsigned t = 0; t < nt; t++)
        kv_att_exp_parts(s, qpk, chunk, n, t, nt);
    for (unsigned t = 0; t < nt; t++)
        kv_att_norm(s, qpk, t, nt);
    for (unsigned t = 0; t < nt; t++)
        kv_att_values(s, L, src, h, qpk, chunk, n, t, nt);
}

/* attend_block: block u checked and parsed, then attended; a mismatch sets *status instead. */
static inline void kv_att_emu_block(const kv_att_shared *s, const cuda_kv_layout *L, const uint8_t *blk, int u,
                                    int kvh, int qpk, int *status)
{
    kv_att_block_info info;
    int bad = kv_att_block_status(L, blk, u);
    if (!bad)
        bad = kv_att_block_parse(L, blk, &info);
    if (bad) {
        *status = bad;
        return;
    }
    for (unsigned t = 0; t < KV_ATT_EMU_THREADS; t++)
        if (kv_att_gear_entries_bad(L, &info, blk, kvh, t, KV_ATT_EMU_THREADS))
            *status = 1;
    const kv_att_src src = {blk, &info, NULL, NULL};
    kv_att_emu_chunk(s, L, &src, kvh, qpk, L->block_tokens, L->block_tokens);
}

/* attend_rows: fp16 rows [0, n) of k and v, `chunk` at a time. */
static inline void kv_att_emu_rows(const kv_att_shared *s, const cuda_kv_layout *L, const uint16_t *k,
                                   const uint16_t *v, int n, int kvh, int qpk, int chunk)
{
    const size_t row = (size_t)L->n_kv_heads * (size_t)L->head_dim;
    for (int t0 = 0; t0 < n; t0 += chunk) {
        const kv_att_src src = {NULL, NULL, k + t0 * row, v + t0 * row};
        kv_att_emu_chunk(s, L, &src, kvh, qpk, chunk, n - t0 < chunk ? n - t0 : chunk);
    }
}

/* attend_split then merge_splits over a batch of views; returns the status the kernel would set
 * (0, or 1 / 2 for a rejected block); -1 when out of memory. ws: the launch's workspace
 * (cuda_kv_attention_workspace bytes). */
static inline int kv_att_emu_attention(const cuda_kv_layout *L, const cuda_kv_plan *P, const cuda_kv_seq *seqs,
                                       const float *q, float *out, float *ws)
{
    const int D = L->head_dim, BT = L->block_tokens, qpk = P->n_q_heads / L->n_kv_heads;
    const unsigned nt = KV_ATT_EMU_THREADS;
    float *smem = malloc(kv_att_shared_floats(qpk, D, BT, (int)nt) * sizeof(float));
    if (!smem)
        return -1;
    float *ws_acc = ws, *ws_ml = ws + (size_t)P->n_seqs * P->n_q_heads * P->n_splits * D;
    int status = 0;
    for (int si = 0; si < P->n_seqs; si++)
        for (int split = 0; split < P->n_splits; split++)
            for (int kvh = 0; kvh < L->n_kv_heads; kvh++) {
                const cuda_kv_seq *seq = &seqs[si];
                const kv_att_shared sh = kv_att_shared_at(smem, qpk, D, BT, (int)nt);
                const size_t row0 = (size_t)si * P->n_q_heads + (size_t)kvh * qpk;
                for (unsigned t = 0; t < nt; t++)
                    kv_att_init(&sh, q + row0 * D, qpk, D, t, nt);
                const int first = split * P->blocks_per_split;
                const int last = first + P->blocks_per_split < seq->n_blocks + 1 ? first + P->blocks_per_split
                                                                                   : seq->n_blocks + 1;
                for (int u = first; u < last; u++) {
                    if (u < seq->n_blocks)
                        kv_att_emu_block(&sh, L, seq->blocks[u], u, kvh, qpk, &status);
                    else
                        kv_att_emu_rows(&sh, L, seq->tail_k, seq->tail_v, seq->tail_tokens, kvh, qpk, BT);
                }
                for (unsigned t = 0; t < nt; t++)
                    kv_att_write_partials(&sh, qpk, D, row0, P->n_splits, split, ws_acc, ws_ml, t, nt);
            }
    for (size_t row = 0; row < (size_t)P->n_seqs * P->n_q_heads; row++)
        for (unsigned t = 0; t < nt; t++)
            kv_att_merge_row(P->n_splits, D, row, ws_acc, ws_ml, out, t, nt);
    free(smem);
    return status;
}

#endif
