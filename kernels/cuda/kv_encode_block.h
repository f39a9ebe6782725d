/* The body of the CUDA block encoder (kernels/cuda/kv_encode.cu), phase by phase, as inline
 * functions that compile for the device and for the CPU. The kernel runs each phase on all its
 * threads with a barrier between phases; tests/cuda/test_cuda_encode.c runs the same phases with
 * the threads taken one after another on the CPU, which is equivalent because within a phase no
 * thread reads what another writes. So the arithmetic, the offsets and the CRC assembly are
 * checked in CI without a GPU, and the GPU run checks the rest (launch, memory, races).
 *
 * Phases, for thread tid of nthreads (one thread block per block):
 *   1. kv_enc_zero:     zero the slot (32-bit words)
 *   2. kv_enc_header:   copy the shared header, with this block's layer and first position;
 *                       kv_enc_means: TaDA's per-token means (a thread per token and channel);
 *                       kv_enc_gear_select: GEAR's outliers; kv_enc_ott_select: OTT's pool
 *                       update (a thread per head)
 *   2b. kv_enc_ott_fill: OTT's inputs with the pooled tokens taken out, the entries' order, and
 *                       the header completed for this block's number of entries
 *   3. kv_enc_sections: fp16 copy, or KIVI key rows and value rows (a thread per row; TaDA's
 *                       rows are the deviations from the means written in phase 2); GEAR's
 *                       sparse entries; OTT's entries
 *   (GEAR's residual and low-rank fit, two more phases)
 *   4. kv_enc_piece_crc: the CRC32C of this thread's piece of the payload
 *   5. kv_enc_finish:   thread 0 joins the pieces, stores the payload CRC, then the header CRC */
#ifndef STRATA_KERNELS_CUDA_KV_ENCODE_BLOCK_H
#define STRATA_KERNELS_CUDA_KV_ENCODE_BLOCK_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/cuda_kv_encode.h"
#include "kvstore/block.h"
#include "kvstore/crc32c_math.h"
#include "kvstore/gear_math.h"
#include "kvstore/hd.h"
#include "kvstore/kv_cache.h"
#include "kvstore/ott_math.h"
#include "kvstore/quant_math.h"

STRATA_HD static inline void kv_enc_store16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

STRATA_HD static inline void kv_enc_store32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

STRATA_HD static inline uint32_t kv_enc_ld32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

STRATA_HD static inline float kv_enc_half_at(const uint8_t *p) { return strata_half_to_float((uint16_t)(p[0] | (p[1] << 8))); }

/* Where the values of one row come from: fp16 values (minus TaDA's fp16 means when mean is set),
 * or fp32 values (GEAR's input with its outliers filled), element j at index j * stride. */
typedef struct kv_enc_row {
    const uint16_t *h;     /* fp16 source, or NULL */
    const float *f;        /* fp32 source when h is NULL */
    size_t stride;
    const uint8_t *mean;   /* TaDA: fp16 means, element j at byte 2 * j * mean_stride */
    size_t mean_stride;
} kv_enc_row;

/* Value j of a row, in fp32 as the CPU writer computes it (TaDA: value - mean). */
STRATA_HD static inline float kv_enc_value(const kv_enc_row *row, int j)
{
    if (!row->h)
        return row->f[(size_t)j * row->stride];
    const float x = strata_half_to_float(row->h[(size_t)j * row->stride]);
    return row->mean ? x - kv_enc_half_at(row->mean + 2 * (size_t)j * row->mean_stride) : x;
}

/* n values of a row (kv_enc_value) in groups of g at bits: (scale, zero) pairs at pairs, packed
 * codes at out. The reference writer's loop (kvstore/codec_kivi.c) on the same fp32 values, so
 * the bytes are the same. */
STRATA_HD static inline void kv_enc_quantize_row(const kv_enc_row *row, int n, int g, int bits, uint8_t *out,
                                                 uint8_t *pairs)
{
    const int per = 32 / bits;
    uint32_t word = 0;
    for (int gi = 0; gi < n / g; gi++) {
        float mn = kv_enc_value(row, gi * g), mx = mn;
        int finite = isfinite(mn) ? 1 : 0;
        for (int j = 1; j < g; j++) {
            const float v = kv_enc_value(row, gi * g + j);
            finite &= isfinite(v) ? 1 : 0;
            if (v < mn)
                mn = v;
            if (v > mx)
                mx = v;
        }
        kv_qgroup q;
        kv_qgroup_from_range(mn, mx, finite, bits, &q);
        kv_enc_store16(pairs + 4 * gi, q.scale_h);
        kv_enc_store16(pairs + 4 * gi + 2, q.zero_h);
        for (int j = 0; j < g; j++) {
            const int i = gi * g + j;
            word |= kv_qgroup_code(kv_enc_value(row, i), &q, bits) << ((i % per) * bits);
            if (i % per == per - 1) {
                kv_enc_store32(out + 4 * (i / per), word);
                word = 0;
            }
        }
    }
}

STRATA_HD static inline uint32_t kv_enc_crc(const uint32_t *table, const uint8_t *p, size_t n)
{
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++)
        c = table[(c ^ p[i]) & 0xffu] ^ (c >> 8);
    return ~c;
}

STRATA_HD static inline void kv_enc_zero(const cuda_kv_encoder *E, uint8_t *dst, unsigned tid, unsigned nthreads)
{
    const uint32_t bytes = E->slot_bytes > E->layout.block_bytes ? E->slot_bytes : E->layout.block_bytes;
    for (uint32_t w = tid; w < bytes / 4; w += nthreads)
        kv_enc_store32(dst + 4 * (size_t)w, 0);
}

STRATA_HD static inline void kv_enc_header(const cuda_kv_encoder *E, const cuda_kv_encode_job *job, uint8_t *dst,
                                           unsigned tid, unsigned nthreads)
{
    for (uint32_t i = tid; i < E->header_bytes; i += nthreads) {
        if (i >= KV_HDR_LAYER && i < KV_HDR_LAYER + 4)
            dst[i] = (uint8_t)(job->layer >> (8 * (i - KV_HDR_LAYER)));
        else if (i >= KV_HDR_FIRST_POS && i < KV_HDR_FIRST_POS + 8)
            dst[i] = (uint8_t)(job->first_pos >> (8 * (i - KV_HDR_FIRST_POS)));
        else
            dst[i] = E->header[i];
    }
}

/* ---- GEAR ----
 * A job's scratch (cuda_kv_encode_job.work): the fp32 copies of K and V whose outliers are filled
 * (what the backbone quantizes), the outlier masks, and one low-rank fit workspace per (K/V, head). */
typedef struct kv_enc_gear_work {
    float *kk, *vv;            /* [T][H][D] */
    uint8_t *kmask, *vmask;    /* [T][H][D] */
    double *fit;               /* 2H x gear_lr_doubles, (K heads, then V heads) */
    uint8_t *small;            /* 2H x fit_small bytes */
} kv_enc_gear_work;

STRATA_HD static inline size_t kv_enc_gear_small(size_t T, size_t D, size_t r)
{
    return (gear_lr_small_bytes(T, D, r) + 7) & ~(size_t)7;
}

STRATA_HD static inline uint64_t kv_enc_gear_work_bytes(const cuda_kv_encoder *E)
{
    const size_t T = (size_t)E->layout.block_tokens, H = (size_t)E->layout.n_kv_heads, D = (size_t)E->layout.head_dim;
    const size_t r = (size_t)E->rank, n = T * H * D;
    const size_t floats = (2 * n * sizeof(float) + 7) & ~(size_t)7;
    return floats + 2 * H * gear_lr_doubles(T, D, r) * sizeof(double) + 2 * n + 2 * H * kv_enc_gear_small(T, D, r);
}

STRATA_HD static inline kv_enc_gear_work kv_enc_gear_work_at(const cuda_kv_encoder *E, void *work)
{
    kv_enc_gear_work w = {NULL, NULL, NULL, NULL, NULL, NULL};
    if (!E->gear || !work)
        return w;
    const size_t T = (size_t)E->layout.block_tokens, H = (size_t)E->layout.n_kv_heads, D = (size_t)E->layout.head_dim;
    const size_t r = (size_t)E->rank, n = T * H * D;
    uint8_t *base = (uint8_t *)work;
    w.kk = (float *)(void *)base;
    w.vv = w.kk + n;
    w.fit = (double *)(void *)(base + ((2 * n * sizeof(float) + 7) & ~(size_t)7));
    w.kmask = (uint8_t *)(w.fit + 2 * H * gear_lr_doubles(T, D, r));
    w.vmask = w.kmask + n;
    w.small = w.vmask + n;
    return w;
}

/* The fit workspace of head h of K (kv = 0) or V (1). */
STRATA_HD static inline gear_lr_work kv_enc_gear_fit_work(const kv_enc_gear_work *w, size_t T, size_t D, size_t r,
                                                          size_t index)
{
    gear_lr_work f;
    f.R = w->fit + index * gear_lr_doubles(T, D, r);
    f.At = f.R + T * D;
    f.Bt = f.At + r * T;
    f.L = f.Bt + r * D;
    f.y = f.L + r * r;
    uint8_t *small = w->small + index * kv_enc_gear_small(T, D, r);
    f.Ah = (uint16_t *)(void *)small;
    f.Bh = f.Ah + T * r;
    f.on = (uint8_t *)(f.Bh + D * r);
    return f;
}

/* Phase 2 (GEAR): a thread per key vector (a channel over the tokens) and per value vector (a
 * token over the channels): the fp32 copy, its outliers (gear_select_outliers), each quantization
 * group's outliers replaced by the mean of the rest (gear_fill_group), as codec_gear.c does. */
STRATA_HD static inline void kv_enc_gear_select(const cuda_kv_encoder *E, const cuda_kv_encode_job *job, unsigned tid,
                                                unsigned nthreads)
{
    if (!E->gear)
        return;
    const kv_enc_gear_work w = kv_enc_gear_work_at(E, job->work);
    const size_t T = (size_t)E->layout.block_tokens, H = (size_t)E->layout.n_kv_heads, D = (size_t)E->layout.head_dim;
    const size_t G = (size_t)E->layout.k_group, ks = (size_t)E->k_sparse, vs = (size_t)E->v_sparse;
    for (size_t i = tid; i < H * D + T * H; i += nthreads) {
        if (i < H * D) {   /* key vector h * D + c: elements (t * H + h) * D + c */
            const size_t first = i, stride = H * D;
            for (size_t t = 0; t < T; t++) {
                w.kk[first + t * stride] = strata_half_to_float(job->k[first + t * stride]);
                w.kmask[first + t * stride] = 0;
            }
            if (ks) {
                gear_select_outliers(w.kk + first, T, stride, ks, w.kmask + first);
                for (size_t t0 = 0; t0 < T; t0 += G)
                    gear_fill_group(w.kk + first + t0 * stride, w.kmask + first + t0 * stride, G, stride);
            }
        } else {           /* value vector t * H + h: elements [first, first + D) */
            const size_t first = (i - H * D) * D;
            for (size_t c = 0; c < D; c++) {
                w.vv[first + c] = strata_half_to_float(job->v[first + c]);
                w.vmask[first + c] = 0;
            }
            if (vs) {
                gear_select_outliers(w.vv + first, D, 1, vs, w.vmask + first);
                for (size_t c0 = 0; c0 < D; c0 += G)
                    gear_fill_group(w.vv + first + c0, w.vmask + first + c0, G, 1);
            }
        }
    }
}

/* Phase 3 (GEAR, beside the backbone): each vector's outliers, index ascending, as their exact
 * fp16 inputs (gear_write_sparse). */
STRATA_HD static inline void kv_enc_gear_sparse(const cuda_kv_encoder *E, const cuda_kv_encode_job *job, uint8_t *dst,
                                                unsigned tid, unsigned nthreads)
{
    if (!E->gear)
        return;
    const kv_enc_gear_work w = kv_enc_gear_work_at(E, job->work);
    const size_t T = (size_t)E->layout.block_tokens, H = (size_t)E->layout.n_kv_heads, D = (size_t)E->layout.head_dim;
    const size_t ks = (size_t)E->k_sparse, vs = (size_t)E->v_sparse;
    for (size_t i = tid; i < H * D + T * H; i += nthreads) {
        const int key = i < H * D;
        const size_t k = key ? ks : vs, vec = key ? i : i - H * D;
        if (!k)
            continue;
        const size_t n = key ? T : D, stride = key ? H * D : 1, first = key ? vec : vec * D;
        const uint16_t *x = key ? job->k : job->v;
        const uint8_t *mask = key ? w.kmask : w.vmask;
        uint8_t *e = dst + (key ? E->off_k_sparse : E->off_v_sparse) + vec * k * 4;
        gear_write_sparse(e, k, NULL, x, mask, first, n, stride);
    }
}

/* Phase 4 (GEAR with a rank): the residual of every head, input minus the backbone as a reader
 * dequantizes it (fp32), zero at the outliers, into each fit's R [T][D] (fp64). */
STRATA_HD static inline void kv_enc_gear_residual(const cuda_kv_encoder *E, const cuda_kv_encode_job *job,
                                                  const uint8_t *dst, unsigned tid, unsigned nthreads)
{
    if (!E->gear || !E->rank)
        return;
    const kv_enc_gear_work w = kv_enc_gear_work_at(E, job->work);
    const cuda_kv_layout *L = &E->layout;
    const size_t T = (size_t)L->block_tokens, H = (size_t)L->n_kv_heads, D = (size_t)L->head_dim, r = (size_t)E->rank;
    const size_t G = (size_t)L->k_group, k_row = T * (size_t)L->k_bits / 8, v_row = D * (size_t)L->v_bits / 8;
    for (size_t i = tid; i < 2 * H * T * D; i += nthreads) {
        const size_t kv = i / (H * T * D), rem = i % (H * T * D), h = rem / (T * D), t = rem % (T * D) / D, c = rem % D;
        const size_t o = (t * H + h) * D + c;
        float dq;
        if (kv == 0) {
            const size_t row = h * D + c;
            const uint8_t *pair = dst + L->off_k_scales + (row * (T / G) + t / G) * 4;
            const uint32_t word = kv_enc_ld32(dst + L->off_k + row * k_row + 4 * (t / (32 / (size_t)L->k_bits)));
            const uint32_t code = (word >> ((t % (32 / (size_t)L->k_bits)) * (size_t)L->k_bits)) & ((1u << L->k_bits) - 1u);
            dq = (float)code * kv_enc_half_at(pair) + kv_enc_half_at(pair + 2);
        } else {
            const size_t row = t * H + h;
            const uint8_t *pair = dst + L->off_v_scales + (row * (D / G) + c / G) * 4;
            const uint32_t word = kv_enc_ld32(dst + L->off_v + row * v_row + 4 * (c / (32 / (size_t)L->v_bits)));
            const uint32_t code = (word >> ((c % (32 / (size_t)L->v_bits)) * (size_t)L->v_bits)) & ((1u << L->v_bits) - 1u);
            dq = (float)code * kv_enc_half_at(pair) + kv_enc_half_at(pair + 2);
        }
        const float x = strata_half_to_float(kv ? job->v[o] : job->k[o]);
        const uint8_t masked = kv ? w.vmask[o] : w.kmask[o];
        const gear_lr_work f = kv_enc_gear_fit_work(&w, T, D, r, kv * H + h);
        f.R[t * D + c] = masked ? 0.0 : (double)x - (double)dq;
    }
}

/* Phase 5 (GEAR with a rank): a thread per (K/V, head) runs that head's fit (gear_lowrank_fit)
 * and writes its factors. */
STRATA_HD static inline void kv_enc_gear_fit(const cuda_kv_encoder *E, const cuda_kv_encode_job *job, uint8_t *dst,
                                             unsigned tid, unsigned nthreads)
{
    if (!E->gear || !E->rank)
        return;
    const kv_enc_gear_work w = kv_enc_gear_work_at(E, job->work);
    const size_t T = (size_t)E->layout.block_tokens, H = (size_t)E->layout.n_kv_heads, D = (size_t)E->layout.head_dim;
    const size_t r = (size_t)E->rank;
    for (size_t i = tid; i < 2 * H; i += nthreads) {
        const int kv = (int)(i / H);
        const size_t h = i % H;
        const gear_lr_work f = kv_enc_gear_fit_work(&w, T, D, r, i);
        gear_lowrank_fit(&f, T, D, r, E->power_iters, gear_fit_seed(job->layer, job->first_pos, h, kv),
                         dst + (kv ? E->off_v_lowrank : E->off_k_lowrank) + h * (T + D) * r * 2);
    }
}

/* ---- OTT ----
 * A job's scratch: the fp32 copies of K and V with the pooled tokens taken out (what the backbone
 * quantizes), per head the tracker's chosen list and the tokens that entered, and per (token,
 * head) whether it is pooled and its entry's index. The tracker state (job->ott_state): the heads'
 * counters, then each head's pool of ott_pool members. */
typedef struct kv_enc_ott_work {
    float *kk, *vv;          /* [T][H][D] */
    kv_ott_member *chosen;   /* [H][N] */
    uint16_t *entered;       /* [H][N] */
    uint16_t *index;         /* [T][H] */
    uint8_t *pooled;         /* [T][H] */
} kv_enc_ott_work;

STRATA_HD static inline uint64_t kv_enc_ott_work_bytes(const cuda_kv_encoder *E)
{
    const size_t T = (size_t)E->layout.block_tokens, H = (size_t)E->layout.n_kv_heads, D = (size_t)E->layout.head_dim;
    const size_t N = (size_t)E->ott_pool;
    return (2 * T * H * D * sizeof(float) + H * N * (sizeof(kv_ott_member) + 2) + T * H * 3 + 7) & ~(uint64_t)7;
}

STRATA_HD static inline uint64_t kv_enc_ott_state_bytes(const cuda_kv_encoder *E)
{
    const size_t H = (size_t)E->layout.n_kv_heads;
    return H * sizeof(kv_ott_head) + H * (size_t)E->ott_pool * sizeof(kv_ott_member);
}

STRATA_HD static inline kv_enc_ott_work kv_enc_ott_work_at(const cuda_kv_encoder *E, void *work)
{
    kv_enc_ott_work w = {NULL, NULL, NULL, NULL, NULL, NULL};
    if (!E->ott || !work)
        return w;
    const size_t T = (size_t)E->layout.block_tokens, H = (size_t)E->layout.n_kv_heads, D = (size_t)E->layout.head_dim;
    const size_t N = (size_t)E->ott_pool, n = T * H * D;
    uint8_t *base = (uint8_t *)work;
    w.kk = (float *)(void *)base;
    w.vv = w.kk + n;
    w.chosen = (kv_ott_member *)(void *)(w.vv + n);   /* 8 n bytes in: 8-byte aligned */
    w.entered = (uint16_t *)(void *)(w.chosen + H * N);
    w.index = w.entered + H * N;
    w.pooled = (uint8_t *)(w.index + T * H);
    return w;
}

/* Phase 2 (OTT): a thread per head runs the tracker's update on this block's keys and marks the
 * tokens that entered the pool. */
STRATA_HD static inline void kv_enc_ott_select(const cuda_kv_encoder *E, const cuda_kv_encode_job *job, unsigned tid,
                                               unsigned nthreads)
{
    if (!E->ott)
        return;
    const kv_enc_ott_work w = kv_enc_ott_work_at(E, job->work);
    const size_t T = (size_t)E->layout.block_tokens, H = (size_t)E->layout.n_kv_heads, D = (size_t)E->layout.head_dim;
    const size_t N = (size_t)E->ott_pool;
    kv_ott_head *heads = (kv_ott_head *)job->ott_state;
    kv_ott_member *members = (kv_ott_member *)(void *)(heads + H);
    for (size_t h = tid; h < H; h += nthreads) {
        for (size_t t = 0; t < T; t++)
            w.pooled[t * H + h] = 0;
        const size_t n = kv_ott_update_head(&heads[h], members + h * N, N, (size_t)E->ott_aux, NULL, job->k, T, H, D,
                                            h, job->first_pos, w.chosen + h * N, w.entered + h * N);
        for (size_t u = 0; u < n; u++)
            w.pooled[(size_t)w.entered[h * N + u] * H + h] = 1;
    }
}

/* The header of an OTT block with n entries, from the encoder's (made for none): one more
 * section, its table entry, the block's size and the count. The same function checks the
 * template against the CPU writer at cuda_kv_encoder_init. */
STRATA_HD static inline void kv_enc_ott_patch_header(const cuda_kv_encoder *E, uint8_t *hdr, uint32_t n)
{
    if (n == 0)
        return;
    const uint32_t len = n * (4u + 4u * (uint32_t)E->layout.head_dim);
    hdr[KV_HDR_N_SECTIONS] = (uint8_t)(E->header[KV_HDR_N_SECTIONS] + 1);
    uint8_t *e = hdr + E->ott_entry_at;
    kv_enc_store16(e, KV_SEC_OTT_TOKENS);
    kv_enc_store16(e + 2, 0);
    kv_enc_store32(e + 4, E->off_ott);
    kv_enc_store32(e + 8, len);
    kv_enc_store32(hdr + KV_HDR_BLOCK_BYTES, (E->off_ott + len + (KV_BLOCK_ALIGN - 1)) & ~(KV_BLOCK_ALIGN - 1));
    kv_enc_store16(hdr + KV_HDR_OTT_TOKENS, (uint16_t)n);
}

/* Phase 2b (OTT): a thread per key row (head, channel) and per value row (token, head) writes the
 * fp32 input with the pooled tokens taken out, as codec_ott.c does: a pooled key takes the mean
 * (summed in double, token order) of the other keys of its group, a pooled value row is zero.
 * Thread 0 also numbers the entries in (token, head) order and completes the header. */
STRATA_HD static inline void kv_enc_ott_fill(const cuda_kv_encoder *E, const cuda_kv_encode_job *job, uint8_t *dst,
                                             unsigned tid, unsigned nthreads)
{
    if (!E->ott)
        return;
    const kv_enc_ott_work w = kv_enc_ott_work_at(E, job->work);
    const size_t T = (size_t)E->layout.block_tokens, H = (size_t)E->layout.n_kv_heads, D = (size_t)E->layout.head_dim;
    const size_t G = (size_t)E->layout.k_group;
    for (size_t i = tid; i < H * D + T * H; i += nthreads) {
        if (i < H * D) {   /* key row h * D + c, over the tokens */
            const size_t h = i / D, c = i % D;
            for (size_t g0 = 0; g0 < T; g0 += G) {
                size_t kept = 0;
                double sum = 0.0;
                for (size_t t = g0; t < g0 + G; t++) {
                    const size_t o = (t * H + h) * D + c;
                    w.kk[o] = strata_half_to_float(job->k[o]);
                    if (!w.pooled[t * H + h]) {
                        kept++;
                        sum += w.kk[o];
                    }
                }
                if (kept == G)
                    continue;
                const float mean = kept ? (float)(sum / (double)kept) : 0.0f;
                for (size_t t = g0; t < g0 + G; t++)
                    if (w.pooled[t * H + h])
                        w.kk[(t * H + h) * D + c] = mean;
            }
        } else {           /* value row t * H + h */
            const size_t r = i - H * D;
            for (size_t c = 0; c < D; c++)
                w.vv[r * D + c] = w.pooled[r] ? 0.0f : strata_half_to_float(job->v[r * D + c]);
        }
    }
    if (tid == 0) {
        uint32_t n = 0;
        for (size_t i = 0; i < T * H; i++)
            if (w.pooled[i])
                w.index[i] = (uint16_t)n++;
        kv_enc_ott_patch_header(E, dst, n);
    }
}

/* Phase 3 (OTT): each entry, (head, token) then its exact fp16 key and value rows. */
STRATA_HD static inline void kv_enc_ott_rows(const cuda_kv_encoder *E, const cuda_kv_encode_job *job, uint8_t *dst,
                                             unsigned tid, unsigned nthreads)
{
    if (!E->ott)
        return;
    const kv_enc_ott_work w = kv_enc_ott_work_at(E, job->work);
    const size_t T = (size_t)E->layout.block_tokens, H = (size_t)E->layout.n_kv_heads, D = (size_t)E->layout.head_dim;
    const size_t n = (size_t)(dst[KV_HDR_OTT_TOKENS] | (dst[KV_HDR_OTT_TOKENS + 1] << 8));
    uint8_t *ids = dst + E->off_ott, *krows = ids + 4 * n, *vrows = krows + 2 * D * n;
    for (size_t i = tid; i < T * H; i += nthreads) {
        if (!w.pooled[i])
            continue;
        const size_t e = w.index[i], t = i / H, h = i % H;
        kv_enc_store16(ids + 4 * e, (uint16_t)h);
        kv_enc_store16(ids + 4 * e + 2, (uint16_t)t);
        for (size_t c = 0; c < D; c++) {
            kv_enc_store16(krows + 2 * (e * D + c), strata_float_to_half(strata_half_to_float(job->k[i * D + c])));
            kv_enc_store16(vrows + 2 * (e * D + c), strata_float_to_half(strata_half_to_float(job->v[i * D + c])));
        }
    }
}

/* TaDA: each token's mean over the heads, per channel, summed in double and rounded once to fp16
 * (kv_tada_mean_half, as the CPU writer's center()). No-op for other codecs. */
STRATA_HD static inline void kv_enc_means(const cuda_kv_encoder *E, const cuda_kv_encode_job *job, uint8_t *dst,
                                          unsigned tid, unsigned nthreads)
{
    const cuda_kv_layout *L = &E->layout;
    if (L->codec != KV_CODEC_TADA)
        return;
    const size_t H = (size_t)L->n_kv_heads, D = (size_t)L->head_dim, T = (size_t)L->block_tokens;
    for (size_t i = tid; i < T * D; i += nthreads) {
        const size_t t = i / D, c = i % D;
        double sk = 0.0, sv = 0.0;
        float klo = strata_half_to_float(job->k[t * H * D + c]), khi = klo;
        float vlo = strata_half_to_float(job->v[t * H * D + c]), vhi = vlo;
        for (size_t h = 0; h < H; h++) {
            const float kx = strata_half_to_float(job->k[(t * H + h) * D + c]);
            const float vx = strata_half_to_float(job->v[(t * H + h) * D + c]);
            sk += kx;
            sv += vx;
            klo = kx < klo ? kx : klo, khi = kx > khi ? kx : khi;
            vlo = vx < vlo ? vx : vlo, vhi = vx > vhi ? vx : vhi;
        }
        kv_enc_store16(dst + L->off_k_mean + 2 * i, kv_tada_mean_half(sk, klo, khi, (int)H));
        kv_enc_store16(dst + L->off_v_mean + 2 * i, kv_tada_mean_half(sv, vlo, vhi, (int)H));
    }
}

STRATA_HD static inline void kv_enc_sections(const cuda_kv_encoder *E, const cuda_kv_encode_job *job, uint8_t *dst,
                                             unsigned tid, unsigned nthreads)
{
    const cuda_kv_layout *L = &E->layout;
    const size_t H = (size_t)L->n_kv_heads, D = (size_t)L->head_dim, T = (size_t)L->block_tokens;
    if (L->codec == KV_CODEC_FP16) {
        /* The sections' [token][head][channel] order is the tail's: a straight copy. */
        for (size_t i = tid; i < T * H * D; i += nthreads) {
            kv_enc_store16(dst + L->off_k + 2 * i, job->k[i]);
            kv_enc_store16(dst + L->off_v + 2 * i, job->v[i]);
        }
        return;
    }
    const size_t k_row = T * (size_t)L->k_bits / 8, k_groups = T / (size_t)L->k_group;
    const size_t v_row = D * (size_t)L->v_bits / 8, v_groups = D / (size_t)L->v_group;
    const int tada = L->codec == KV_CODEC_TADA;
    /* GEAR and OTT quantize fp32 copies of their input (outliers filled, pooled tokens out). */
    const kv_enc_gear_work gw = kv_enc_gear_work_at(E, job->work);
    const kv_enc_ott_work ow = kv_enc_ott_work_at(E, job->work);
    const float *fk = E->gear ? gw.kk : E->ott ? ow.kk : NULL, *fv = E->gear ? gw.vv : E->ott ? ow.vv : NULL;
    for (size_t r = tid; r < H * D; r += nthreads) {   /* key row r = head * D + channel, over tokens */
        const kv_enc_row row = {fk ? NULL : job->k + r, fk ? fk + r : NULL, H * D,
                                tada ? dst + L->off_k_mean + 2 * (r % D) : NULL, D};
        kv_enc_quantize_row(&row, (int)T, L->k_group, L->k_bits, dst + L->off_k + r * k_row,
                            dst + L->off_k_scales + r * k_groups * 4);
    }
    for (size_t r = tid; r < T * H; r += nthreads) {   /* value row r = token * H + head, over channels */
        const kv_enc_row row = {fv ? NULL : job->v + r * D, fv ? fv + r * D : NULL, 1,
                                tada ? dst + L->off_v_mean + 2 * (r / H) * D : NULL, 1};
        kv_enc_quantize_row(&row, (int)D, L->v_group, L->v_bits, dst + L->off_v + r * v_row,
                            dst + L->off_v_scales + r * v_groups * 4);
    }
}

/* Bytes of payload piece p of nthreads (the last pieces may be short or empty), in the block at
 * dst whose header is complete (an OTT block's size depends on its entries). */
STRATA_HD static inline size_t kv_enc_piece(const cuda_kv_encoder *E, const uint8_t *dst, unsigned p,
                                            unsigned nthreads, size_t *at)
{
    const size_t n = kv_enc_ld32(dst + KV_HDR_BLOCK_BYTES) - E->header_bytes, piece = (n + nthreads - 1) / nthreads;
    *at = (size_t)p * piece < n ? (size_t)p * piece : n;
    return n - *at < piece ? n - *at : piece;
}

STRATA_HD static inline uint32_t kv_enc_piece_crc(const cuda_kv_encoder *E, const uint32_t *table, const uint8_t *dst,
                                                  unsigned tid, unsigned nthreads)
{
    size_t at;
    const size_t len = kv_enc_piece(E, dst, tid, nthreads, &at);
    return kv_enc_crc(table, dst + E->header_bytes + at, len);
}

STRATA_HD static inline void kv_enc_finish(const cuda_kv_encoder *E, const uint32_t *table, const uint32_t *piece_crc,
                                           uint8_t *dst, unsigned nthreads)
{
    size_t at;
    const size_t full = kv_enc_piece(E, dst, 0, nthreads, &at);
    const uint32_t full_op = kv_crc32c_shift_op(full);
    uint32_t crc = piece_crc[0];
    for (unsigned p = 1; p < nthreads; p++) {
        const size_t len = kv_enc_piece(E, dst, p, nthreads, &at);
        crc = kv_crc32c_combine_op(crc, piece_crc[p], len == full ? full_op : kv_crc32c_shift_op(len));
    }
    kv_enc_store32(dst + KV_HDR_PAYLOAD_CRC, crc);
    /* The header CRC field is still zero here, as its definition asks. */
    kv_enc_store32(dst + KV_HDR_HEADER_CRC, kv_enc_crc(table, dst, E->header_bytes));
}

#endif
