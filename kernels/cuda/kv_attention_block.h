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

/* What varies from block to block in GEAR and OTT blocks (their sizes do): the counts in the
 * header and where the correction sections sit, read by kv_att_block_parse. Zero for the other
 * codecs. */
typedef struct kv_att_block_info {
    int rank, k_sparse, v_sparse, n_ott;
    uint32_t off_k_sparse, off_v_sparse, off_k_lowrank, off_v_lowrank, off_ott;
} kv_att_block_info;

/* Where a chunk's keys and values come from: a block of the layout's codec, or fp16 rows
 * [token][n_kv_heads][head_dim] (the tail). */
typedef struct kv_att_src {
    const uint8_t *block;            /* non-NULL: a block */
    const kv_att_block_info *info;   /* with a block: its parsed corrections */
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

STRATA_HD static inline uint32_t kv_att_ld16(const uint8_t *p) { return (uint32_t)p[0] | ((uint32_t)p[1] << 8); }

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

/* sum_k A[t][k] B[c][k] of one head's low-rank factors at a (docs/format.md 4b: A [T][r], then B
 * [D][r], fp16), in fp32. */
STRATA_HD static inline float kv_att_lowrank_at(const uint8_t *a, size_t r, size_t T, size_t t, size_t c)
{
    const uint8_t *b = a + T * r * 2;
    float lr = 0.0f;
    for (size_t k = 0; k < r; k++)
        lr += kv_att_half_at(a + 2 * (t * r + k)) * kv_att_half_at(b + 2 * (c * r + k));
    return lr;
}

/* GEAR and OTT on top of the backbone's x for element (h, t, c) of K (value 0) or V (1):
 *   GEAR: x + sum_k A_h[t][k] B_h[c][k], then an outlier of the element's vector replaces it;
 *   OTT:  a pooled (head, token) takes its fp16 row (the backbone's placeholder is dropped).
 * docs/format.md 4b and 4c. OTT indices were checked by kv_att_block_parse, GEAR's by
 * kv_att_gear_entries_bad; entries are scanned. */
STRATA_HD static inline float kv_att_correct(const cuda_kv_layout *L, const kv_att_block_info *info,
                                             const uint8_t *blk, int value, int h, int t, int c, float x)
{
    const size_t H = (size_t)L->n_kv_heads, D = (size_t)L->head_dim, T = (size_t)L->block_tokens;
    if (L->codec == KV_CODEC_GEAR) {
        const size_t r = (size_t)info->rank;
        if (r)
            x += kv_att_lowrank_at(blk + (value ? info->off_v_lowrank : info->off_k_lowrank) + (size_t)h * (T + D) * r * 2,
                                   r, T, (size_t)t, (size_t)c);
        const size_t n = (size_t)(value ? info->v_sparse : info->k_sparse);
        if (n) {
            /* A key vector is one channel over the tokens, a value vector one token over the channels. */
            const size_t vec = value ? (size_t)t * H + (size_t)h : (size_t)h * D + (size_t)c;
            const uint32_t want = value ? (uint32_t)c : (uint32_t)t;
            const uint8_t *e = blk + (value ? info->off_v_sparse : info->off_k_sparse) + vec * n * 4;
            for (size_t i = 0; i < n; i++)
                if (kv_att_ld16(e + 4 * i) == want)
                    x = kv_att_half_at(e + 4 * i + 2);
        }
        return x;
    }
    if (L->codec == KV_CODEC_OTT && info->n_ott) {
        const size_t n = (size_t)info->n_ott;
        const uint8_t *sec = blk + info->off_ott;
        for (size_t i = 0; i < n; i++)
            if (kv_att_ld16(sec + 4 * i) == (uint32_t)h && kv_att_ld16(sec + 4 * i + 2) == (uint32_t)t)
                return kv_att_half_at(sec + 4 * n + (value ? 2 * D * n : 0) + 2 * (i * D + (size_t)c));
    }
    return x;
}

/* The correction sections of a GEAR or OTT block, checked against its header and bytes: 0, or 1
 * when a count is out of range, a section the counts call for is missing, misplaced or of the
 * wrong length, or an index in it points outside the block (the status flag's "does not match").
 * The backbone must sit where the layout says. Other codecs: nothing to parse, 0. */
STRATA_HD static inline int kv_att_block_parse(const cuda_kv_layout *L, const uint8_t *blk, kv_att_block_info *info)
{
    info->rank = info->k_sparse = info->v_sparse = info->n_ott = 0;
    info->off_k_sparse = info->off_v_sparse = info->off_k_lowrank = info->off_v_lowrank = info->off_ott = 0;
    if (L->codec != KV_CODEC_GEAR && L->codec != KV_CODEC_OTT)
        return 0;
    const uint64_t H = (uint64_t)L->n_kv_heads, D = (uint64_t)L->head_dim, T = (uint64_t)L->block_tokens;
    const uint32_t bytes = kv_att_ld32(blk + 8);
    const int n_sections = blk[15];
    if (L->codec == KV_CODEC_GEAR) {
        info->rank = blk[44];
        info->k_sparse = (int)kv_att_ld16(blk + 46);
        info->v_sparse = (int)kv_att_ld16(blk + 48);
        if ((uint64_t)info->rank > (T < D ? T : D) || (uint64_t)info->k_sparse > T || (uint64_t)info->v_sparse > D)
            return 1;
    } else {
        info->n_ott = (int)kv_att_ld16(blk + 50);
        if ((uint64_t)info->n_ott > T * H)
            return 1;
    }
    unsigned backbone = 0;   /* bit id set for each backbone section found as the layout has it */
    for (int i = 0; i < n_sections && i < 16; i++) {
        const uint8_t *e = blk + 64 + 12 * i;
        const uint32_t id = kv_att_ld16(e), off = kv_att_ld32(e + 4), len = kv_att_ld32(e + 8);
        if ((uint64_t)off + len > bytes || off % 64 != 0)   /* sections start at multiples of 64 (2.2) */
            return 1;
        uint64_t want = 0;
        switch (id) {
        /* The backbone where the layout has it, and as long: the kernels read it from there. */
        case 1: backbone |= (off == L->off_k && len == L->len_k) << 1; continue;
        case 2: backbone |= (off == L->off_k_scales && len == L->len_k_scales) << 2; continue;
        case 3: backbone |= (off == L->off_v && len == L->len_v) << 3; continue;
        case 4: backbone |= (off == L->off_v_scales && len == L->len_v_scales) << 4; continue;
        case 16: info->off_k_sparse = off; want = H * D * (uint64_t)info->k_sparse * 4; break;
        case 17: info->off_v_sparse = off; want = T * H * (uint64_t)info->v_sparse * 4; break;
        case 18: info->off_k_lowrank = off; want = H * (T + D) * (uint64_t)info->rank * 2; break;
        case 19: info->off_v_lowrank = off; want = H * (T + D) * (uint64_t)info->rank * 2; break;
        case 20: info->off_ott = off; want = (uint64_t)info->n_ott * (4 + 4 * D); break;
        default: continue;
        }
        if (len != want)
            return 1;
    }
    if (backbone != 0x1eu || (info->k_sparse && !info->off_k_sparse) || (info->v_sparse && !info->off_v_sparse) ||
        (info->rank && (!info->off_k_lowrank || !info->off_v_lowrank)) || (info->n_ott && !info->off_ott))
        return 1;
    /* Indices the lookups compare against: in range, so a match means the element; and in
     * (token, head) order, each pair once (docs/format.md), so no two lanes write one score slot
     * and no pooled token's value is added twice. */
    uint32_t prev = 0;
    for (uint64_t i = 0; i < (uint64_t)info->n_ott; i++) {
        const uint32_t head = kv_att_ld16(blk + info->off_ott + 4 * i),
                       token = kv_att_ld16(blk + info->off_ott + 4 * i + 2), key = token << 16 | head;
        if (head >= H || token >= T || (i > 0 && key <= prev))
            return 1;
        prev = key;
    }
    return 0;
}

/* GEAR outlier entries of head h in a thread's share (tid of nt) of the head's key vectors
 * (channels) and value vectors (tokens): 1 when an index falls outside its vector or does not
 * ascend within it (docs/format.md 4b), else 0. kv_att_correct's lookup would skip such an entry
 * without a word; the caller raises the status flag (1), as the tensor-core kernel does. */
STRATA_HD static inline int kv_att_gear_entries_bad(const cuda_kv_layout *L, const kv_att_block_info *info,
                                                    const uint8_t *blk, int h, unsigned tid, unsigned nt)
{
    if (L->codec != KV_CODEC_GEAR)
        return 0;
    const uint32_t H = (uint32_t)L->n_kv_heads, D = (uint32_t)L->head_dim, T = (uint32_t)L->block_tokens;
    for (uint32_t x = tid; x < D + T; x += nt) {
        const int value = x >= D;
        const uint32_t n = (uint32_t)(value ? info->v_sparse : info->k_sparse), extent = value ? D : T;
        const size_t vec = value ? (size_t)(x - D) * H + (size_t)h : (size_t)h * D + x;
        const uint8_t *e = blk + (value ? info->off_v_sparse : info->off_k_sparse) + vec * n * 4;
        for (uint32_t i = 0; i < n; i++) {
            const uint32_t at = kv_att_ld16(e + 4 * i);
            if (at >= extent || (i && at <= kv_att_ld16(e + 4 * (i - 1))))
                return 1;
        }
    }
    return 0;
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
    if (L->codec == KV_CODEC_TADA)
        return x + kv_att_half_at(blk + L->off_k_mean + 2 * ((size_t)t * D + (size_t)c));
    return kv_att_correct(L, src->info, blk, 0, h, t, c, x);
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
    if (L->codec == KV_CODEC_TADA)
        return x + kv_att_half_at(blk + L->off_v_mean + 2 * ((size_t)t * D + (size_t)c));
    return kv_att_correct(L, src->info, blk, 1, h, t, c, x);
}

/* 0 when the block at blk is the one the layout and table position expect; 2 for a NULL or
 * misaligned pointer, 1 for any header field that disagrees (magic, size, codec, bits, layer,
 * token count, first position). A wrong table entry is reported instead of attended. */
STRATA_HD static inline int kv_att_block_status(const cuda_kv_layout *L, const uint8_t *blk, int index)
{
    if (!blk || ((uintptr_t)blk & 15u))
        return 2;
    const uint64_t first_pos = (uint64_t)kv_att_ld32(blk + 24) | ((uint64_t)kv_att_ld32(blk + 28) << 32);
    /* GEAR and OTT blocks vary in size: kv_att_block_parse checks their sections against their own. */
    const int varying = L->codec == KV_CODEC_GEAR || L->codec == KV_CODEC_OTT;
    const uint32_t bytes = kv_att_ld32(blk + 8);
    const int size_ok = varying ? bytes % 64 == 0 && bytes >= 128 && bytes <= L->block_bytes : bytes == L->block_bytes;
    const int ok = kv_att_ld32(blk + 0) == 0x42564b53u && size_ok &&
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
            mx = strata_fmaxf(mx, s->p[i * chunk + t]);
        s->red[(unsigned)i * nthreads + tid] = mx;
    }
}

STRATA_HD static inline void kv_att_max(const kv_att_shared *s, int qpk, unsigned tid, unsigned nthreads)
{
    for (unsigned i = tid; i < (unsigned)qpk; i += nthreads) {
        float mx = -INFINITY;
        for (unsigned x = 0; x < nthreads; x++)
            mx = strata_fmaxf(mx, s->red[i * nthreads + x]);
        const float m_old = s->m[i], m_new = strata_fmaxf(m_old, mx);
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
            M = strata_fmaxf(M, ml[2 * sp]);
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
