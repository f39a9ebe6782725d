/* The body of the CUDA attention kernels (kernels/cuda/kv_attention.cu), phase by phase, as inline
 * functions that compile for the device and for the CPU (as kernels/cuda/kv_encode_block.h does
 * for the encoder). A kernel runs each phase on all its threads with a barrier between phases;
 * tests/cuda/test_cuda_attention.c runs the same phases with the threads taken one after another,
 * which is equivalent because within a phase no thread reads what another writes. Reductions go
 * through a small shared array (one partial per thread, then one thread per query head) rather
 * than warp shuffles, so that they too run the same on both.
 *
 * One thread block serves the qpk query heads that share a KV head. Its shared state (float
 * arrays, kv_att_shared_floats() of them): q [qpk][D] pre-scaled by 1/sqrt(D), acc [qpk][D],
 * p [qpk][chunk] scores then weights, red [qpk][nthreads] partials, m, l, alpha [qpk].
 * One chunk of up to `chunk` tokens goes through:
 *   1. kv_att_scores      thread per token: the qpk dot products
 *   2. kv_att_max_parts   per thread: its tokens' max, per head
 *   3. kv_att_max         thread per head: the new running max and the rescale alpha
 *   4. kv_att_exp_parts   per thread: weights exp(s - m) of its tokens and their sum, per head
 *   5. kv_att_norm        thread per head: the running normalizer
 *   6. kv_att_values      thread per channel: acc = alpha acc + sum_t p_t v_t */
#ifndef STRATA_KERNELS_CUDA_KV_ATTENTION_BLOCK_H
#define STRATA_KERNELS_CUDA_KV_ATTENTION_BLOCK_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/cuda_kv_attention.h"
#include "kvstore/half.h"
#include "kvstore/hd.h"
#include "kvstore/kv_cache.h"

#ifdef __CUDA_ARCH__
#define KV_ATT_EXP(x) __expf(x)
#else
#define KV_ATT_EXP(x) expf(x)
#endif

#define KV_ATT_MAX_QPK 16

/* Where a chunk's keys and values come from: a block of the layout's codec, or fp16 rows
 * [token][n_kv_heads][head_dim] (the tail, or a prompt's K/V). */
typedef struct kv_att_src {
    const uint8_t *block;          /* non-NULL: a block */
    const uint16_t *k_rows, *v_rows; /* else: rows, from the chunk's first token */
} kv_att_src;

typedef struct kv_att_shared {
    float *q, *acc, *p, *red, *m, *l, *alpha;
} kv_att_shared;

STRATA_HD static inline size_t kv_att_shared_floats(int qpk, int D, int chunk, int nthreads)
{
    return (size_t)qpk * (size_t)(2 * D + chunk + nthreads + 3);
}

STRATA_HD static inline kv_att_shared kv_att_shared_at(float *base, int qpk, int D, int chunk, int nthreads)
{
    kv_att_shared s;
    s.q = base;
    s.acc = s.q + qpk * D;
    s.p = s.acc + qpk * D;
    s.red = s.p + qpk * chunk;
    s.m = s.red + qpk * nthreads;
    s.l = s.m + qpk;
    s.alpha = s.l + qpk;
    return s;
}

STRATA_HD static inline uint32_t kv_att_ld32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

STRATA_HD static inline float kv_att_half_at(const uint8_t *p)
{
    return strata_half_to_float((uint16_t)(p[0] | (p[1] << 8)));
}

/* Code i of a packed row of B-bit codes (docs/format.md section 4, "Packing"). */
STRATA_HD static inline float kv_att_code(const uint8_t *row, int i, int bits)
{
    const int per_word = 32 / bits;
    const uint32_t w = kv_att_ld32(row + 4 * (i / per_word));
    return (float)((w >> ((i % per_word) * bits)) & ((1u << bits) - 1u));
}

STRATA_HD static inline float kv_att_key(const cuda_kv_layout *L, const kv_att_src *src, int h, int t, int c)
{
    const size_t H = (size_t)L->n_kv_heads, D = (size_t)L->head_dim;
    if (!src->block)
        return strata_half_to_float(src->k_rows[((size_t)t * H + (size_t)h) * D + (size_t)c]);
    const uint8_t *blk = src->block;
    if (L->codec == KV_CODEC_FP16)
        return kv_att_half_at(blk + L->off_k + 2 * (((size_t)t * H + (size_t)h) * D + (size_t)c));
    const size_t r = (size_t)h * D + (size_t)c;   /* channel-major row */
    const size_t row_bytes = (size_t)L->block_tokens * (size_t)L->k_bits / 8;
    const size_t n_groups = (size_t)(L->block_tokens / L->k_group);
    const uint8_t *pair = blk + L->off_k_scales + 4 * (r * n_groups + (size_t)(t / L->k_group));
    const float x = kv_att_code(blk + L->off_k + r * row_bytes, t, L->k_bits) * kv_att_half_at(pair) +
                    kv_att_half_at(pair + 2);
    /* TaDA: the backbone holds the deviation from the token's mean over the heads. */
    return L->codec == KV_CODEC_TADA ? x + kv_att_half_at(blk + L->off_k_mean + 2 * ((size_t)t * D + (size_t)c)) : x;
}

STRATA_HD static inline float kv_att_value(const cuda_kv_layout *L, const kv_att_src *src, int h, int t, int c)
{
    const size_t H = (size_t)L->n_kv_heads, D = (size_t)L->head_dim;
    if (!src->block)
        return strata_half_to_float(src->v_rows[((size_t)t * H + (size_t)h) * D + (size_t)c]);
    const uint8_t *blk = src->block;
    if (L->codec == KV_CODEC_FP16)
        return kv_att_half_at(blk + L->off_v + 2 * (((size_t)t * H + (size_t)h) * D + (size_t)c));
    const size_t r = (size_t)t * H + (size_t)h;   /* token-major row */
    const size_t row_bytes = D * (size_t)L->v_bits / 8;
    const size_t n_groups = D / (size_t)L->v_group;
    const uint8_t *pair = blk + L->off_v_scales + 4 * (r * n_groups + (size_t)(c / L->v_group));
    const float x = kv_att_code(blk + L->off_v + r * row_bytes, c, L->v_bits) * kv_att_half_at(pair) +
                    kv_att_half_at(pair + 2);
    return L->codec == KV_CODEC_TADA ? x + kv_att_half_at(blk + L->off_v_mean + 2 * ((size_t)t * D + (size_t)c)) : x;
}

/* 0 when the block at blk is the one the layout and table position expect; 2 for a NULL or
 * misaligned pointer, 1 for any header field that disagrees (magic, size, codec, bits, layer,
 * token count, first position). A wrong table entry is reported instead of attended. */
STRATA_HD static inline int kv_att_block_status(const cuda_kv_layout *L, const uint8_t *blk, int index)
{
    if (!blk || ((uintptr_t)blk & 15u))
        return 2;
    const uint64_t first_pos = (uint64_t)kv_att_ld32(blk + 24) | ((uint64_t)kv_att_ld32(blk + 28) << 32);
    const int ok = kv_att_ld32(blk + 0) == 0x42564b53u && kv_att_ld32(blk + 8) == L->block_bytes &&
                   blk[12] == (uint8_t)L->codec && blk[13] == (uint8_t)L->k_bits && blk[14] == (uint8_t)L->v_bits &&
                   kv_att_ld32(blk + 16) == L->layer && kv_att_ld32(blk + 20) == (uint32_t)L->block_tokens &&
                   first_pos == (uint64_t)index * (uint64_t)L->block_tokens;
    return ok ? 0 : 1;
}

/* Phase 0: the group's queries (q_heads: [qpk][D], the first query head of the group), scaled;
 * sums cleared. */
STRATA_HD static inline void kv_att_init(const kv_att_shared *s, const float *q_heads, int qpk, int D, unsigned tid,
                                         unsigned nthreads)
{
    const float inv_sqrt_d = 1.0f / sqrtf((float)D);
    for (unsigned x = tid; x < (unsigned)(qpk * D); x += nthreads) {
        s->q[x] = q_heads[x] * inv_sqrt_d;
        s->acc[x] = 0.0f;
    }
    for (unsigned i = tid; i < (unsigned)qpk; i += nthreads) {
        s->m[i] = -INFINITY;
        s->l[i] = 0.0f;
    }
}

STRATA_HD static inline void kv_att_scores(const kv_att_shared *s, const cuda_kv_layout *L, const kv_att_src *src, int h,
                                           int qpk, int chunk, int n, unsigned tid, unsigned nthreads)
{
    const int D = L->head_dim;
    for (int t = (int)tid; t < n; t += (int)nthreads) {
        float dot[KV_ATT_MAX_QPK];
        for (int i = 0; i < KV_ATT_MAX_QPK; i++)
            dot[i] = 0.0f;
        for (int c = 0; c < D; c++) {
            const float k = kv_att_key(L, src, h, t, c);
            for (int i = 0; i < KV_ATT_MAX_QPK; i++)
                if (i < qpk)
                    dot[i] = fmaf(s->q[i * D + c], k, dot[i]);
        }
        for (int i = 0; i < KV_ATT_MAX_QPK; i++)
            if (i < qpk)
                s->p[i * chunk + t] = dot[i];
    }
}

STRATA_HD static inline void kv_att_max_parts(const kv_att_shared *s, int qpk, int chunk, int n, unsigned tid,
                                              unsigned nthreads)
{
    for (int i = 0; i < qpk; i++) {
        float mx = -INFINITY;
        for (int t = (int)tid; t < n; t += (int)nthreads)
            mx = fmaxf(mx, s->p[i * chunk + t]);
        s->red[(unsigned)i * nthreads + tid] = mx;
    }
}

STRATA_HD static inline void kv_att_max(const kv_att_shared *s, int qpk, unsigned tid, unsigned nthreads)
{
    for (unsigned i = tid; i < (unsigned)qpk; i += nthreads) {
        float mx = -INFINITY;
        for (unsigned x = 0; x < nthreads; x++)
            mx = fmaxf(mx, s->red[i * nthreads + x]);
        const float m_old = s->m[i], m_new = fmaxf(m_old, mx);
        s->alpha[i] = m_old == -INFINITY ? 0.0f : KV_ATT_EXP(m_old - m_new);
        s->m[i] = m_new;
    }
}

STRATA_HD static inline void kv_att_exp_parts(const kv_att_shared *s, int qpk, int chunk, int n, unsigned tid,
                                              unsigned nthreads)
{
    for (int i = 0; i < qpk; i++) {
        float sum = 0.0f;
        for (int t = (int)tid; t < n; t += (int)nthreads) {
            const float e = KV_ATT_EXP(s->p[i * chunk + t] - s->m[i]);
            s->p[i * chunk + t] = e;
            sum += e;
        }
        s->red[(unsigned)i * nthreads + tid] = sum;
    }
}

STRATA_HD static inline void kv_att_norm(const kv_att_shared *s, int qpk, unsigned tid, unsigned nthreads)
{
    for (unsigned i = tid; i < (unsigned)qpk; i += nthreads) {
        float sum = 0.0f;
        for (unsigned x = 0; x < nthreads; x++)
            sum += s->red[i * nthreads + x];
        s->l[i] = s->l[i] * s->alpha[i] + sum;
    }
}

STRATA_HD static inline void kv_att_values(const kv_att_shared *s, const cuda_kv_layout *L, const kv_att_src *src, int h,
                                           int qpk, int chunk, int n, unsigned tid, unsigned nthreads)
{
    const int D = L->head_dim;
    for (int c = (int)tid; c < D; c += (int)nthreads) {
        float a[KV_ATT_MAX_QPK];
        for (int i = 0; i < KV_ATT_MAX_QPK; i++)
            a[i] = i < qpk ? s->acc[i * D + c] * s->alpha[i] : 0.0f;
        for (int t = 0; t < n; t++) {
            const float v = kv_att_value(L, src, h, t, c);
            for (int i = 0; i < KV_ATT_MAX_QPK; i++)
                if (i < qpk)
                    a[i] = fmaf(s->p[i * chunk + t], v, a[i]);
        }
        for (int i = 0; i < KV_ATT_MAX_QPK; i++)
            if (i < qpk)
                s->acc[i * D + c] = a[i];
    }
}

/* A split's result: acc [row][split][D] and (max, normalizer) [row][split][2] for the group's qpk
 * query rows starting at row0 (= seq * n_q_heads + first query head). */
STRATA_HD static inline void kv_att_write_partials(const kv_att_shared *s, int qpk, int D, size_t row0, int n_splits,
                                                   int split, float *ws_acc, float *ws_ml, unsigned tid,
                                                   unsigned nthreads)
{
    for (int i = 0; i < qpk; i++) {
        const size_t part = (row0 + (size_t)i) * (size_t)n_splits + (size_t)split;
        for (int c = (int)tid; c < D; c += (int)nthreads)
            ws_acc[part * (size_t)D + (size_t)c] = s->acc[i * D + c];
        if (tid == 0) {
            ws_ml[2 * part] = s->m[i];
            ws_ml[2 * part + 1] = s->l[i];
        }
    }
}

/* The prefill output of the group's rows: acc / l. out_heads: [qpk][D] of this token. */
STRATA_HD static inline void kv_att_write_normalized(const kv_att_shared *s, int qpk, int D, float *out_heads,
                                                     unsigned tid, unsigned nthreads)
{
    for (int i = 0; i < qpk; i++)
        for (int c = (int)tid; c < D; c += (int)nthreads)
            out_heads[i * D + c] = s->acc[i * D + c] / s->l[i];
}

/* One output row (a sequence's query head) from its splits: sum_s acc_s e^(m_s - M) / sum_s l_s
 * e^(m_s - M); zeros when no split saw a position. Each thread recomputes M and the normalizer
 * (n_splits values), so no barrier is needed. */
STRATA_HD static inline void kv_att_merge_row(int n_splits, int D, size_t row, const float *ws_acc, const float *ws_ml,
                                              float *out, unsigned tid, unsigned nthreads)
{
    const float *ml = ws_ml + 2 * row * (size_t)n_splits;
    float M = -INFINITY;
    for (int sp = 0; sp < n_splits; sp++)
        if (ml[2 * sp + 1] > 0.0f || isnan(ml[2 * sp + 1]))
            M = fmaxf(M, ml[2 * sp]);
    float Lsum = 0.0f;
    for (int sp = 0; sp < n_splits; sp++)
        if (ml[2 * sp + 1] != 0.0f)
            Lsum += ml[2 * sp + 1] * KV_ATT_EXP(ml[2 * sp] - M);
    for (int c = (int)tid; c < D; c += (int)nthreads) {
        float a = 0.0f;
        for (int sp = 0; sp < n_splits; sp++)
            if (ml[2 * sp + 1] != 0.0f)
                a += ws_acc[(row * (size_t)n_splits + (size_t)sp) * (size_t)D + (size_t)c] * KV_ATT_EXP(ml[2 * sp] - M);
        out[row * (size_t)D + (size_t)c] = Lsum != 0.0f ? a / Lsum : 0.0f;
    }
}

#endif
