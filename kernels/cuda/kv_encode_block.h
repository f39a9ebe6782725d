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
 *                       kv_enc_means: TaDA's per-token means (a thread per token and channel)
 *   3. kv_enc_sections: fp16 copy, or KIVI key rows and value rows (a thread per row; TaDA's
 *                       rows are the deviations from the means written in phase 2)
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
#include "kvstore/hd.h"
#include "kvstore/kv_cache.h"
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

STRATA_HD static inline float kv_enc_half_at(const uint8_t *p) { return strata_half_to_float((uint16_t)(p[0] | (p[1] << 8))); }

/* Value j of a row: an fp16 value, minus the fp16 mean at mean[2 * j * mean_stride] when mean is
 * given (TaDA's deviation, in fp32 as the CPU writer computes it). */
STRATA_HD static inline float kv_enc_value(const uint16_t *src, size_t stride, const uint8_t *mean, size_t mean_stride,
                                           int j)
{
    const float x = strata_half_to_float(src[(size_t)j * stride]);
    return mean ? x - kv_enc_half_at(mean + 2 * (size_t)j * mean_stride) : x;
}

/* n values of a row (kv_enc_value) in groups of g at bits: (scale, zero) pairs at pairs, packed
 * codes at row. The reference writer's loop (kvstore/codec_kivi.c) on the same fp32 values, so
 * the bytes are the same. */
STRATA_HD static inline void kv_enc_quantize_row(const uint16_t *src, size_t stride, const uint8_t *mean,
                                                 size_t mean_stride, int n, int g, int bits, uint8_t *row,
                                                 uint8_t *pairs)
{
    const int per = 32 / bits;
    uint32_t word = 0;
    for (int gi = 0; gi < n / g; gi++) {
        float mn = kv_enc_value(src, stride, mean, mean_stride, gi * g), mx = mn;
        int finite = isfinite(mn) ? 1 : 0;
        for (int j = 1; j < g; j++) {
            const float v = kv_enc_value(src, stride, mean, mean_stride, gi * g + j);
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
            word |= kv_qgroup_code(kv_enc_value(src, stride, mean, mean_stride, i), &q, bits) << ((i % per) * bits);
            if (i % per == per - 1) {
                kv_enc_store32(row + 4 * (i / per), word);
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
    for (uint32_t w = tid; w < E->layout.block_bytes / 4; w += nthreads)
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

/* TaDA: each token's mean over the heads, per channel, summed in double and rounded once to fp16
 * (the CPU writer's center()). No-op for other codecs. */
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
        for (size_t h = 0; h < H; h++) {
            sk += strata_half_to_float(job->k[(t * H + h) * D + c]);
            sv += strata_half_to_float(job->v[(t * H + h) * D + c]);
        }
        kv_enc_store16(dst + L->off_k_mean + 2 * i, strata_double_to_half(sk / (double)H));
        kv_enc_store16(dst + L->off_v_mean + 2 * i, strata_double_to_half(sv / (double)H));
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
    for (size_t r = tid; r < H * D; r += nthreads)   /* key row r = head * D + channel, over tokens */
        kv_enc_quantize_row(job->k + r, H * D, tada ? dst + L->off_k_mean + 2 * (r % D) : NULL, D, (int)T,
                            L->k_group, L->k_bits, dst + L->off_k + r * k_row, dst + L->off_k_scales + r * k_groups * 4);
    for (size_t r = tid; r < T * H; r += nthreads)   /* value row r = token * H + head, over channels */
        kv_enc_quantize_row(job->v + r * D, 1, tada ? dst + L->off_v_mean + 2 * (r / H) * D : NULL, 1, (int)D,
                            L->v_group, L->v_bits, dst + L->off_v + r * v_row, dst + L->off_v_scales + r * v_groups * 4);
}

/* Bytes of payload piece p of nthreads (the last pieces may be short or empty). */
STRATA_HD static inline size_t kv_enc_piece(const cuda_kv_encoder *E, unsigned p, unsigned nthreads, size_t *at)
{
    const size_t n = E->layout.block_bytes - E->header_bytes, piece = (n + nthreads - 1) / nthreads;
    *at = (size_t)p * piece < n ? (size_t)p * piece : n;
    return n - *at < piece ? n - *at : piece;
}

STRATA_HD static inline uint32_t kv_enc_piece_crc(const cuda_kv_encoder *E, const uint32_t *table, const uint8_t *dst,
                                                  unsigned tid, unsigned nthreads)
{
    size_t at;
    const size_t len = kv_enc_piece(E, tid, nthreads, &at);
    return kv_enc_crc(table, dst + E->header_bytes + at, len);
}

STRATA_HD static inline void kv_enc_finish(const cuda_kv_encoder *E, const uint32_t *table, const uint32_t *piece_crc,
                                           uint8_t *dst, unsigned nthreads)
{
    size_t at;
    const size_t full = kv_enc_piece(E, 0, nthreads, &at);
    const uint32_t full_op = kv_crc32c_shift_op(full);
    uint32_t crc = piece_crc[0];
    for (unsigned p = 1; p < nthreads; p++) {
        const size_t len = kv_enc_piece(E, p, nthreads, &at);
        crc = kv_crc32c_combine_op(crc, piece_crc[p], len == full ? full_op : kv_crc32c_shift_op(len));
    }
    kv_enc_store32(dst + KV_HDR_PAYLOAD_CRC, crc);
    /* The header CRC field is still zero here, as its definition asks. */
    kv_enc_store32(dst + KV_HDR_HEADER_CRC, kv_enc_crc(table, dst, E->header_bytes));
}

#endif
