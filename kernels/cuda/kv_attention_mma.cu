// Tensor-core decode attention over KIVI blocks and the codecs built on the KIVI backbone (TaDA,
// GEAR, OTT; a template parameter each) (fragment maps, code decoding and scale rearrangement in
// kernels/cuda/kv_attention_mma.h, the codecs' terms in kv_attention_mma_codec.h, both shared with
// the CPU emulation that CI runs).
//
// Why a third kernel: the staged kernel's KIVI path (kv_attention_fast.cu) spends about seven
// instructions a code (unpacking, then one fp32 FMA per query head) and reached 14.5 % of the
// H100's copy bandwidth, 1.06x fp16 (docs/gpu.md, "Kernel notes"). Here two codes cost a byte
// permute, a shift, a mask and two f16x2 multiply-adds, and the products run on the tensor cores
// (mma.sync m16n8k16, fp32 accumulation).
//
// Precision: the query (scaled by log2(e) / sqrt(D), so that the softmax runs on exp2), the
// dequantized keys and values (scale * code + zero, rounded once) and the softmax weights are
// rounded to fp16 (unit roundoff 2^-11); products and sums are fp32. The staged kernel (plan
// kernel CUDA_KV_KERNEL_STAGED) keeps fp32 arithmetic throughout, for comparison.
//
// Shapes: 64-token blocks; block, group and head sizes are template parameters, so group
// boundaries and row sizes cost nothing at run time (kv_mma_eligible).
//
// Work: a thread block per (KV head, split, sequence), four warps. Warp w takes blocks first + w,
// first + w + 4, ... of the split with its own online softmax and its own double-buffered stage
// (cp.async), so the loop has no block-wide barrier; headers of 32 of its blocks are checked at
// once (a lane each) before any of their bytes are staged. The fp16 tail goes in 16-row tiles,
// round robin over the warps, read straight from global memory. At the end the four warps'
// states merge through shared memory into the split's partials, which the generic merge kernel
// then combines across splits.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>

#include "kernels/cuda/kv_attention_block.h"
#include "kernels/cuda/kv_attention_mma.h"
#include "kernels/cuda/kv_attention_mma_codec.h"
#include "kernels/cuda/split_launch.h"
#include "kernels/cuda/stage_copy.h"

namespace {

constexpr int kWarps = KV_MMA_WARPS;
constexpr int BT = 64;   // tokens a block (kv_mma_eligible)
constexpr int kThreads = 32 * kWarps;
constexpr float kLn2 = 0.69314718055994531f;

// D += A B for rows 0..7 of A (a0, a2; rows 8..15 are zero) into this lane's two outputs.
__device__ inline void mma_rows8(float (&d)[2], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1)
{
    float d2 = 0.0f, d3 = 0.0f;
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d2), "+f"(d3)
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}

__device__ inline uint32_t pack_half2(float lo, float hi)
{
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t *>(&h);
}

__device__ inline float fast_exp2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// N 32-bit words from 4N-byte aligned shared memory.
template <int N>
__device__ inline void load_words(const uint8_t *p, uint32_t (&w)[N])
{
    if constexpr (N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N; i += 4) {
            const uint4 x = reinterpret_cast<const uint4 *>(p)[i / 4];
            w[i] = x.x;
            w[i + 1] = x.y;
            w[i + 2] = x.z;
            w[i + 3] = x.w;
        }
    } else if constexpr (N == 2) {
        const uint2 x = *reinterpret_cast<const uint2 *>(p);
        w[0] = x.x;
        w[1] = x.y;
    } else {
        w[0] = *reinterpret_cast<const uint32_t *>(p);
    }
}

// Starts the copies of block blk's four sections for KV head h into dst (the warp's lanes).
template <int D, int B, int G>
__device__ void stage_block(const cuda_kv_layout &L, const kv_mma_stage &S, const uint8_t *blk, int h, uint8_t *dst,
                            int lane)
{
    constexpr int KROW = BT * B / 8, KZ = D * (BT / G) * 4, VROW = D * B / 8, VZ = (D / G) * 4;
    const size_t H = (size_t)L.n_kv_heads;
    stage_rows(dst, blk + L.off_k + (size_t)h * D * KROW, 1, D * KROW, 0, lane, 32);
    stage_rows(dst + S.off_kz, blk + L.off_k_scales + (size_t)h * KZ, 1, KZ, 0, lane, 32);
    stage_rows(dst + S.off_vc, blk + L.off_v + (size_t)h * VROW, BT, VROW, H * VROW, lane, 32);
    stage_rows(dst + S.off_vz, blk + L.off_v_scales + (size_t)h * VZ, BT, VZ, H * VZ, lane, 32);
}

// The (scale, zero) words of group g for the pair of rows from `row` of a prepared section.
__device__ inline uint2 scale_zero(const uint8_t *sec, int row, int groups, int g)
{
    return make_uint2(*reinterpret_cast<const uint32_t *>(sec + kv_mma_scale_offset(row, groups, g)),
                      *reinterpret_cast<const uint32_t *>(sec + kv_mma_zero_offset(row, groups, g)));
}

// Scores s[n] (head gid; tokens 8n + 2tig, +1) of a staged block, in log2 units. G: tokens a key
// group (and channels a value group).
template <int D, int B, int G, int C>
__device__ void block_scores(const kv_mma_stage &S, const uint8_t *st, const uint8_t *mean, const uint32_t *qrow,
                             const kv_mma_lane &kl, int lane, float (&s)[BT / 8][2])
{
    constexpr int KG = BT / G;   // key groups a channel row
    constexpr int NT = BT / 8, RW = BT * B / 32;   // 8-token tiles; code words a channel row
    const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int n = 0; n < NT; n++)
        s[n][0] = s[n][1] = 0.0f;
#pragma unroll 1
    for (int kk = 0; kk < D / 16; kk++) {
        const int c0 = 16 * kk + 2 * tig;   // b0: channels c0, c0+1; b1: c0+8, c0+9
        const uint32_t qa0 = qrow[c0 / 2], qa2 = qrow[c0 / 2 + 4];
        uint32_t w0[RW], w1[RW], w8[RW], w9[RW];
        load_words<RW>(st + (size_t)c0 * S.k_row_bytes, w0);
        load_words<RW>(st + (size_t)(c0 + 1) * S.k_row_bytes, w1);
        load_words<RW>(st + (size_t)(c0 + 8) * S.k_row_bytes, w8);
        load_words<RW>(st + (size_t)(c0 + 9) * S.k_row_bytes, w9);
        uint2 sz0 = make_uint2(0, 0), sz8 = make_uint2(0, 0);
#pragma unroll
        for (int n = 0; n < NT; n++) {
            if ((8 * n) % G == 0) {   // a group starts: known at compile time
                sz0 = scale_zero(st + S.off_kz, c0, KG, 8 * n / G);
                sz8 = scale_zero(st + S.off_kz, c0 + 8, KG, 8 * n / G);
            }
            const int wi = kv_mma_word_of(n, B);
            uint32_t b0 = kv_mma_dequant(kv_mma_codes(w0[wi], w1[wi], &kl, n, B), sz0.x, sz0.y, B);
            uint32_t b1 = kv_mma_dequant(kv_mma_codes(w8[wi], w9[wi], &kl, n, B), sz8.x, sz8.y, B);
            if constexpr (C == KV_CODEC_TADA) {   // the token's mean under the deviations
                b0 = kv_mma_add2(b0, kv_mma_mean_k(mean, D, 8 * n + gid, c0));
                b1 = kv_mma_add2(b1, kv_mma_mean_k(mean, D, 8 * n + gid, c0 + 8));
            }
            mma_rows8(s[n], qa0, qa2, b0, b1);
        }
    }
}

// o[m] (head gid; channels 8m + 2tig, +1) += P V over a staged block's values.
template <int D, int B, int G, int C>
__device__ void block_values(const kv_mma_stage &S, const uint8_t *st, const uint8_t *mean, const uint32_t (&pa)[BT / 8],
                             const kv_mma_lane &vl, int lane, float (&o)[D / 8][2])
{
    constexpr int VG = D / G;   // value groups a token row
    constexpr int VT = D / 8, RW = D * B / 32;   // 8-channel tiles; code words a token row (4..16)
    const int gid = lane >> 2, tig = lane & 3;
    const uint8_t *codes = st + S.off_vc;
#pragma unroll 1
    for (int kv = 0; kv < BT / 16; kv++) {
        const int t0 = 16 * kv + 2 * tig;   // b0: tokens t0, t0+1; b1: t0+8, t0+9
        uint32_t a0 = pa[0], a2 = pa[1];   // the weights of tokens 16 kv.. (selected, not indexed:
#pragma unroll                             // pa stays in registers)
        for (int k = 1; k < BT / 16; k++)
            if (kv == k) {
                a0 = pa[2 * k];
                a2 = pa[2 * k + 1];
            }
        uint2 sz0 = make_uint2(0, 0), sz8 = make_uint2(0, 0);
#pragma unroll
        for (int c4 = 0; c4 < RW; c4 += 4) {   // 16 bytes of each of the four rows at a time
            uint32_t w0[4], w1[4], w8[4], w9[4];
            load_words<4>(codes + (size_t)t0 * S.v_row_bytes + 4 * c4, w0);
            load_words<4>(codes + (size_t)(t0 + 1) * S.v_row_bytes + 4 * c4, w1);
            load_words<4>(codes + (size_t)(t0 + 8) * S.v_row_bytes + 4 * c4, w8);
            load_words<4>(codes + (size_t)(t0 + 9) * S.v_row_bytes + 4 * c4, w9);
#pragma unroll
            for (int m = 0; m < VT; m++) {
                const int wi = kv_mma_word_of(m, B) - c4;
                if (wi < 0 || wi >= 4)
                    continue;
                if ((8 * m) % G == 0) {   // a group starts: known at compile time
                    sz0 = scale_zero(st + S.off_vz, t0, VG, 8 * m / G);
                    sz8 = scale_zero(st + S.off_vz, t0 + 8, VG, 8 * m / G);
                }
                uint32_t b0 = kv_mma_dequant(kv_mma_codes(w0[wi], w1[wi], &vl, m, B), sz0.x, sz0.y, B);
                uint32_t b1 = kv_mma_dequant(kv_mma_codes(w8[wi], w9[wi], &vl, m, B), sz8.x, sz8.y, B);
                if constexpr (C == KV_CODEC_TADA) {
                    b0 = kv_mma_add2(b0, kv_mma_mean_v(mean, D, t0, 8 * m + gid));
                    b1 = kv_mma_add2(b1, kv_mma_mean_v(mean, D, t0 + 8, 8 * m + gid));
                }
                mma_rows8(o[m], a0, a2, b0, b1);
            }
        }
    }
}

// The online-softmax step over NT 8-token tiles of scores (tokens from n_valid on are masked):
// running max and normalizer updated (the normalizer per lane: the four lanes of a head sum
// theirs at the end), the value sums rescaled, the weights packed as the values' A fragments.
template <int NT, int VT>
__device__ void softmax_step(float (&s)[NT][2], int n_valid, float &m_run, float &l_run, float (&o)[VT][2],
                             uint32_t (&pa)[NT], int lane)
{
    const int tig = lane & 3;
    float mx = -CUDART_INF_F;
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            if (8 * n + 2 * tig + j >= n_valid)
                s[n][j] = -CUDART_INF_F;
            mx = fmaxf(mx, s[n][j]);
        }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run, mx);
    const float alpha = fast_exp2(m_run - m_new);   // 0 on the first step (m_run = -inf)
    float sum = 0.0f;
#pragma unroll
    for (int n = 0; n < NT; n++) {
        const float p0 = fast_exp2(s[n][0] - m_new), p1 = fast_exp2(s[n][1] - m_new);
        sum += p0 + p1;
        pa[n] = pack_half2(p0, p1);
    }
    l_run = l_run * alpha + sum;
#pragma unroll
    for (int m = 0; m < VT; m++) {
        o[m][0] *= alpha;
        o[m][1] *= alpha;
    }
    m_run = m_new;
}

// GEAR's low-rank term of the scores: (Q B_h) A_h^T, ranks 16 at a time (a: A_h [BT][r], then B_h).
template <int D>
__device__ void lowrank_scores(const uint8_t *a, int r, const uint32_t *qrow, int lane, float (&s)[BT / 8][2])
{
    const uint8_t *b = a + (size_t)BT * r * 2;
    const int gid = lane >> 2, tig = lane & 3;
#pragma unroll 1
    for (int k0 = 0; k0 < r; k0 += 16) {
        float lo[2] = {0.0f, 0.0f}, hi[2] = {0.0f, 0.0f};   // Q B_h: ranks k0 + 2tig, +1 and 8 more
#pragma unroll 1
        for (int kk = 0; kk < D / 16; kk++) {
            const int c0 = 16 * kk + 2 * tig;
            const uint32_t qa0 = qrow[c0 / 2], qa2 = qrow[c0 / 2 + 4];
            mma_rows8(lo, qa0, qa2, kv_mma_lr_col(b, r, c0, k0 + gid), kv_mma_lr_col(b, r, c0 + 8, k0 + gid));
            mma_rows8(hi, qa0, qa2, kv_mma_lr_col(b, r, c0, k0 + 8 + gid), kv_mma_lr_col(b, r, c0 + 8, k0 + 8 + gid));
        }
        const uint32_t qb0 = pack_half2(lo[0], lo[1]), qb2 = pack_half2(hi[0], hi[1]);
#pragma unroll
        for (int n = 0; n < BT / 8; n++)
            mma_rows8(s[n], qb0, qb2, kv_mma_lr_row(a, r, 8 * n + gid, k0 + 2 * tig),
                      kv_mma_lr_row(a, r, 8 * n + gid, k0 + 8 + 2 * tig));
    }
}

// GEAR's low-rank term of the values: (P A_v) B_v^T (a: A_v [BT][r], then B_v [D][r]).
template <int D>
__device__ void lowrank_values(const uint8_t *a, int r, const uint32_t (&pa)[BT / 8], int lane, float (&o)[D / 8][2])
{
    const uint8_t *b = a + (size_t)BT * r * 2;
    const int gid = lane >> 2, tig = lane & 3;
#pragma unroll 1
    for (int k0 = 0; k0 < r; k0 += 16) {
        float lo[2] = {0.0f, 0.0f}, hi[2] = {0.0f, 0.0f};   // P A_v: ranks k0 + 2tig, +1 and 8 more
#pragma unroll
        for (int kv = 0; kv < BT / 16; kv++) {
            const int t0 = 16 * kv + 2 * tig;
            mma_rows8(lo, pa[2 * kv], pa[2 * kv + 1], kv_mma_lr_col(a, r, t0, k0 + gid),
                      kv_mma_lr_col(a, r, t0 + 8, k0 + gid));
            mma_rows8(hi, pa[2 * kv], pa[2 * kv + 1], kv_mma_lr_col(a, r, t0, k0 + 8 + gid),
                      kv_mma_lr_col(a, r, t0 + 8, k0 + 8 + gid));
        }
        const uint32_t pb0 = pack_half2(lo[0], lo[1]), pb2 = pack_half2(hi[0], hi[1]);
#pragma unroll
        for (int m = 0; m < D / 8; m++)
            mma_rows8(o[m], pb0, pb2, kv_mma_lr_row(b, r, 8 * m + gid, k0 + 2 * tig),
                      kv_mma_lr_row(b, r, 8 * m + gid, k0 + 8 + 2 * tig));
    }
}

// One staged block. C: the codec (KIVI, TaDA, GEAR, OTT); x: the block and its parsed sections
// (GEAR, OTT), sc: the warp's buffers (GEAR, OTT). Returns nonzero when a GEAR outlier entry is
// malformed (the status flag).
template <int D, int B, int G, int C>
__device__ int attend_block(const kv_mma_stage &S, uint8_t *st, const kv_mma_block_ctx &x, kv_mma_scratch sc,
                            const uint32_t *qrow, const kv_mma_lane &kl, const kv_mma_lane &vl, float (&o)[D / 8][2],
                            float &m_run, float &l_run, int lane)
{
    constexpr bool kBuffers = C == KV_CODEC_GEAR || C == KV_CODEC_OTT;
    int bad = 0;
    kv_mma_section_prep(st + S.off_kz, D, BT / G, lane);
    kv_mma_section_prep(st + S.off_vz, BT, D / G, lane);
    __syncwarp();
    if constexpr (C == KV_CODEC_GEAR)
        bad |= kv_mma_key_outliers(&x, sc, lane);
    if constexpr (C == KV_CODEC_OTT)
        kv_mma_ott_scores(&x, sc, lane);
    const uint8_t *k_mean = C == KV_CODEC_TADA ? x.blk + x.L->off_k_mean : nullptr;
    const uint8_t *v_mean = C == KV_CODEC_TADA ? x.blk + x.L->off_v_mean : nullptr;
    float s[BT / 8][2];
    block_scores<D, B, G, C>(S, st, k_mean, qrow, kl, lane, s);
    if constexpr (C == KV_CODEC_GEAR)
        if (x.info.rank)
            lowrank_scores<D>(kv_mma_lowrank(&x, 0), x.info.rank, qrow, lane, s);
    if constexpr (kBuffers) {
        __syncwarp();
        kv_mma_take_scores(sc, BT, s, lane, C == KV_CODEC_OTT);
    }
    uint32_t pa[BT / 8];
    softmax_step<BT / 8, D / 8>(s, BT, m_run, l_run, o, pa, lane);
    if constexpr (kBuffers) {
        kv_mma_put_weights(sc, BT, pa, lane);
        __syncwarp();
        if (C == KV_CODEC_OTT && lane < 2)
            sc.mask[lane] = 0;
        if constexpr (C == KV_CODEC_GEAR)
            bad |= kv_mma_value_outliers(&x, sc, lane);
        else
            kv_mma_ott_values(&x, sc, lane);
    }
    block_values<D, B, G, C>(S, st, v_mean, pa, vl, lane, o);
    if constexpr (C == KV_CODEC_GEAR)
        if (x.info.rank)
            lowrank_values<D>(kv_mma_lowrank(&x, 1), x.info.rank, pa, lane, o);
    if constexpr (kBuffers) {
        __syncwarp();
        kv_mma_take_values(sc, BT, D, o, lane);
    }
    return bad;
}

// A block's parsed sections from the lane that parsed it.
__device__ inline kv_att_block_info shfl_info(const kv_att_block_info &in, int src)
{
    kv_att_block_info o;
    o.rank = __shfl_sync(0xffffffffu, in.rank, src);
    o.k_sparse = __shfl_sync(0xffffffffu, in.k_sparse, src);
    o.v_sparse = __shfl_sync(0xffffffffu, in.v_sparse, src);
    o.n_ott = __shfl_sync(0xffffffffu, in.n_ott, src);
    o.off_k_sparse = __shfl_sync(0xffffffffu, in.off_k_sparse, src);
    o.off_v_sparse = __shfl_sync(0xffffffffu, in.off_v_sparse, src);
    o.off_k_lowrank = __shfl_sync(0xffffffffu, in.off_k_lowrank, src);
    o.off_v_lowrank = __shfl_sync(0xffffffffu, in.off_v_lowrank, src);
    o.off_ott = __shfl_sync(0xffffffffu, in.off_ott, src);
    return o;
}

// One tile of up to 16 fp16 tail rows from row t0, read from global memory.
template <int D>
__device__ void attend_tail_tile(const cuda_kv_seq &seq, int H, int kvh, int t0, const uint32_t *qrow,
                                 float (&o)[D / 8][2], float &m_run, float &l_run, int lane)
{
    const int gid = lane >> 2, tig = lane & 3;
    const int n_valid = min(KV_MMA_TAIL_TILE, seq.tail_tokens - t0);
    const size_t row = (size_t)H * D;
    const uint16_t *K = seq.tail_k + (size_t)t0 * row + (size_t)kvh * D;
    const uint16_t *V = seq.tail_v + (size_t)t0 * row + (size_t)kvh * D;
    float s[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
#pragma unroll 1
    for (int kk = 0; kk < D / 16; kk++) {
        const int c0 = 16 * kk + 2 * tig;
        const uint32_t qa0 = qrow[c0 / 2], qa2 = qrow[c0 / 2 + 4];
#pragma unroll
        for (int n = 0; n < 2; n++) {
            const int t = 8 * n + gid;
            uint32_t b0 = 0, b1 = 0;
            if (t < n_valid) {
                b0 = __ldg(reinterpret_cast<const unsigned int *>(K + (size_t)t * row + c0));
                b1 = __ldg(reinterpret_cast<const unsigned int *>(K + (size_t)t * row + c0 + 8));
            }
            mma_rows8(s[n], qa0, qa2, b0, b1);
        }
    }
    uint32_t pa[2];
    softmax_step<2, D / 8>(s, n_valid, m_run, l_run, o, pa, lane);
    auto v_at = [&](int t, int c) -> uint32_t { return t < n_valid ? (uint32_t)__ldg(V + (size_t)t * row + c) : 0u; };
#pragma unroll
    for (int m = 0; m < D / 8; m++) {
        const int c = 8 * m + gid, t = 2 * tig;
        const uint32_t b0 = v_at(t, c) | v_at(t + 1, c) << 16, b1 = v_at(t + 8, c) | v_at(t + 9, c) << 16;
        mma_rows8(o[m], pa[0], pa[1], b0, b1);
    }
}

// Registers capped so that kv_mma_ctas_per_sm thread blocks fit a multiprocessor (the split plan
// counts waves with the same number).
template <int D, int B, int G, int C>
__global__ void __launch_bounds__(kThreads, kv_mma_ctas_per_sm(D, B, G, C))
    attend_mma(cuda_kv_layout L, cuda_kv_plan P, const cuda_kv_seq *seqs, const float *q, float *ws_acc, float *ws_ml,
               int *status)
{
    constexpr int VT = D / 8;
    constexpr bool kBuffers = C == KV_CODEC_GEAR || C == KV_CODEC_OTT;
    extern __shared__ __align__(16) uint8_t smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gid = lane >> 2, tig = lane & 3;
    const int H = L.n_kv_heads, qpk = P.n_q_heads / H;
    const int kvh = blockIdx.x, split = blockIdx.y, si = blockIdx.z;
    const cuda_kv_seq seq = seqs[si];
    const size_t row0 = (size_t)si * P.n_q_heads + (size_t)kvh * qpk;
    const kv_mma_stage S = kv_mma_stage_of(&L);
    // The queries as fp16 [head][D + 8] (rows padded so that the lanes' fragment loads hit distinct
    // banks), scaled so that the scores come out in log2 units; heads past qpk are zero.
    uint32_t *q16 = reinterpret_cast<uint32_t *>(smem);
    uint8_t *stage = smem + kv_mma_q16_bytes(D) + (size_t)warp * 2 * S.bytes;
    const float qscale = 1.44269504088896341f / sqrtf((float)D);
    for (int x = threadIdx.x; x < KV_MMA_MAX_QPK * D / 2; x += kThreads) {
        const int i = x / (D / 2), c = 2 * (x - i * (D / 2));
        const float *qr = q + (row0 + i) * D + c;
        q16[i * (D + 8) / 2 + c / 2] = i < qpk ? pack_half2(qr[0] * qscale, qr[1] * qscale) : 0u;
    }
    __syncthreads();
    const uint32_t *qrow = q16 + gid * (D + 8) / 2;
    kv_mma_scratch sc = {};
    if constexpr (kBuffers) {   // the warp's buffers start cleared
        uint8_t *base =
            smem + kv_mma_q16_bytes(D) + (size_t)kWarps * 2 * S.bytes + (size_t)warp * kv_mma_scratch_bytes(D, BT);
        for (uint32_t i = 4 * lane; i < kv_mma_scratch_bytes(D, BT); i += 4 * 32)
            *reinterpret_cast<uint32_t *>(base + i) = 0u;
        sc = kv_mma_scratch_at(base, D, BT);
        __syncwarp();
    }
    kv_mma_block_ctx x = {};
    x.L = &L;
    x.S = &S;
    x.kvh = kvh;
    x.qpk = qpk;
    x.q_stride = D + 8;
    x.q16 = reinterpret_cast<const uint16_t *>(q16);
    float o[VT][2];
#pragma unroll
    for (int m = 0; m < VT; m++)
        o[m][0] = o[m][1] = 0.0f;
    float m_run = -CUDART_INF_F, l_run = 0.0f;
    const kv_mma_lane kl = kv_mma_lane_of(lane, B), vl = kv_mma_lane_of(lane, B);

    const int first = split * P.blocks_per_split;
    const int end = min(first + P.blocks_per_split, seq.n_blocks + 1);   // the tail is unit n_blocks
    const int block_end = min(end, seq.n_blocks);
    for (int w0 = first + warp; w0 < block_end; w0 += kWarps * 32) {
        const int mine = min(32, (block_end - w0 + kWarps - 1) / kWarps);   // this warp's blocks here
        int bad = 0;
        kv_att_block_info info = {};   // lane j: the sections of the warp's j-th block here (GEAR, OTT)
        if (lane < mine) {
            const int u = w0 + kWarps * lane;
            bad = kv_att_block_status(&L, seq.blocks[u], u);
            if (!bad && kBuffers)
                bad = kv_att_block_parse(&L, seq.blocks[u], &info);
            if (bad)
                atomicExch(status, bad);
        }
        const unsigned rejected = __ballot_sync(0xffffffffu, bad != 0);
        if (!(rejected & 1u))
            stage_block<D, B, G>(L, S, seq.blocks[w0], kvh, stage, lane);
        stage_commit();
        for (int j = 0; j < mine; j++) {
            if (j + 1 < mine && !((rejected >> (j + 1)) & 1u))
                stage_block<D, B, G>(L, S, seq.blocks[w0 + kWarps * (j + 1)], kvh, stage + ((j + 1) & 1) * S.bytes,
                                     lane);
            stage_commit();
            stage_wait_prev();
            __syncwarp();
            if (!((rejected >> j) & 1u)) {
                x.blk = seq.blocks[w0 + kWarps * j];
                x.st = stage + (j & 1) * S.bytes;
                if constexpr (kBuffers)
                    x.info = shfl_info(info, j);
                if (attend_block<D, B, G, C>(S, stage + (j & 1) * S.bytes, x, sc, qrow, kl, vl, o, m_run, l_run, lane))
                    atomicExch(status, 1);
            }
            __syncwarp();   // the buffer is free for the copy after next
        }
    }
    if (first <= seq.n_blocks && end > seq.n_blocks)   // the split holds the tail (unit n_blocks)
        for (int t0 = KV_MMA_TAIL_TILE * warp; t0 < seq.tail_tokens; t0 += KV_MMA_TAIL_TILE * kWarps)
            attend_tail_tile<D>(seq, H, kvh, t0, qrow, o, m_run, l_run, lane);

    // The warps' states merged: [warp][head] max and normalizer, [warp][head][D] value sums.
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
    __syncthreads();   // every warp is done with its stage
    float *wm = reinterpret_cast<float *>(smem), *wl = wm + kWarps * KV_MMA_MAX_QPK;
    float *wacc = wl + kWarps * KV_MMA_MAX_QPK;
    const int slot = warp * KV_MMA_MAX_QPK + gid;
    if (tig == 0) {
        wm[slot] = m_run;
        wl[slot] = l_run;
    }
#pragma unroll
    for (int m = 0; m < VT; m++) {
        wacc[(size_t)slot * D + 8 * m + 2 * tig] = o[m][0];
        wacc[(size_t)slot * D + 8 * m + 2 * tig + 1] = o[m][1];
    }
    __syncthreads();
    for (int x = threadIdx.x; x < qpk * D; x += kThreads) {
        const int i = x / D, c = x - i * D;
        float M = -CUDART_INF_F;
#pragma unroll
        for (int w = 0; w < kWarps; w++)
            M = fmaxf(M, wm[w * KV_MMA_MAX_QPK + i]);
        float a = 0.0f, l = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; w++) {
            const float mw = wm[w * KV_MMA_MAX_QPK + i];
            if (mw != -CUDART_INF_F) {
                const float f = fast_exp2(mw - M);
                a += f * wacc[((size_t)w * KV_MMA_MAX_QPK + i) * D + c];
                l += f * wl[w * KV_MMA_MAX_QPK + i];
            }
        }
        const size_t at = (row0 + i) * P.n_splits + split;
        ws_acc[at * D + c] = a;
        if (c == 0) {
            ws_ml[2 * at] = M == -CUDART_INF_F ? M : M * kLn2;   // natural-log units, as the merge reads
            ws_ml[2 * at + 1] = l;
        }
    }
}

template <int D, int B, int G, int C>
int launch(const cuda_kv_layout &L, const cuda_kv_plan &P, const cuda_kv_seq *seqs, const float *q, float *ws_acc,
           float *ws_ml, int *status, cudaStream_t st, strata_error *err)
{
    return launch_split(attend_mma<D, B, G, C>, "attend_mma", kThreads, kv_mma_smem_bytes(&L), L, P, seqs, q, ws_acc,
                        ws_ml, status, st, err);
}

template <int D, int B, int C>
int launch_g(const cuda_kv_layout &L, const cuda_kv_plan &P, const cuda_kv_seq *seqs, const float *q, float *ws_acc,
             float *ws_ml, int *status, cudaStream_t st, strata_error *err)
{
    switch (L.k_group) {
    case 16: return launch<D, B, 16, C>(L, P, seqs, q, ws_acc, ws_ml, status, st, err);
    case 32: return launch<D, B, 32, C>(L, P, seqs, q, ws_acc, ws_ml, status, st, err);
    case 64: return launch<D, B, 64, C>(L, P, seqs, q, ws_acc, ws_ml, status, st, err);
    default:   // 8: 4-bit only (kv_mma_eligible)
        if constexpr (B == 4)
            return launch<D, B, 8, C>(L, P, seqs, q, ws_acc, ws_ml, status, st, err);
        return strata_fail(err, STRATA_EINVAL, "CUDA attention: group %d at %d bits", L.k_group, B);
    }
}

template <int D, int B>
int launch_c(const cuda_kv_layout &L, const cuda_kv_plan &P, const cuda_kv_seq *seqs, const float *q, float *ws_acc,
             float *ws_ml, int *status, cudaStream_t st, strata_error *err)
{
    switch (L.codec) {
    case KV_CODEC_KIVI: return launch_g<D, B, KV_CODEC_KIVI>(L, P, seqs, q, ws_acc, ws_ml, status, st, err);
    case KV_CODEC_TADA: return launch_g<D, B, KV_CODEC_TADA>(L, P, seqs, q, ws_acc, ws_ml, status, st, err);
    case KV_CODEC_GEAR: return launch_g<D, B, KV_CODEC_GEAR>(L, P, seqs, q, ws_acc, ws_ml, status, st, err);
    case KV_CODEC_OTT: return launch_g<D, B, KV_CODEC_OTT>(L, P, seqs, q, ws_acc, ws_ml, status, st, err);
    default: return strata_fail(err, STRATA_EINVAL, "CUDA attention: codec %d on the tensor cores", L.codec);
    }
}

}  // namespace

extern "C" int kv_mma_launch(const cuda_kv_layout *L, const cuda_kv_plan *P, const cuda_kv_seq *seqs, const float *q,
                             float *ws_acc, float *ws_ml, int *status, void *stream, strata_error *err)
{
    const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    if (L->head_dim == 64)
        return L->k_bits == 2 ? launch_c<64, 2>(*L, *P, seqs, q, ws_acc, ws_ml, status, st, err)
                              : launch_c<64, 4>(*L, *P, seqs, q, ws_acc, ws_ml, status, st, err);
    return L->k_bits == 2 ? launch_c<128, 2>(*L, *P, seqs, q, ws_acc, ws_ml, status, st, err)
                          : launch_c<128, 4>(*L, *P, seqs, q, ws_acc, ws_ml, status, st, err);
}
