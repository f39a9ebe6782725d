/* The tensor-core decode attention for KIVI pools and the codecs on its backbone (TaDA, GEAR, OTT:
 * their terms in kv_attention_mma_codec.h) (kernels/cuda/kv_attention_mma.cu): what it shares
 * with its CPU emulation (kv_attention_mma_emu.h, run in CI without a GPU), namely the stage
 * layout, the per-lane fragment maps, the code-to-half decoding and the per-block scale
 * rearrangement. Private to kernels/cuda; the entry points are at the end.
 *
 * mma.sync m16n8k16 (fp16 inputs, fp32 accumulation); lane = 4 gid + tig. A 32-bit register holds
 * two halves, the lower index in the low half:
 *   A 16x16  a0 (row gid, cols 2tig, 2tig+1)  a1 (row gid+8, same)  a2 (row gid, cols 2tig+8, +9)
 *            a3 (row gid+8, cols 2tig+8, +9)
 *   B 16x8   b0 (rows 2tig, 2tig+1; col gid)  b1 (rows 2tig+8, 2tig+9; col gid)
 *   C 16x8   c0, c1 (row gid; cols 2tig, 2tig+1)  c2, c3 (row gid+8)
 * Scores S = Q K (A: query heads x channels, B: channels x 8 tokens) and values O = P V (A: query
 * heads x tokens, B: tokens x 8 channels). The query heads of a KV head are rows 0..7 and rows
 * 8..15 stay zero, so the scores' C fragment is the values' A fragment as it stands (no
 * transpose between the two products) at the price of half of each product.
 *
 * Codes to halves: a B register pairs two rows of the contraction (two channels of one token for
 * the keys, two tokens of one channel for the values), which the block format packs in different
 * rows (keys per channel along the tokens, values per token along the channels). kv_mma_codes
 * takes the two rows' 32-bit words holding the lane's code, brings the byte holding it to bits
 * 8..15 (low half) and 24..31 (high half) with one byte permute, shifts the code to the top of
 * the mantissa and ors in the exponent of 1.0: each half is then exactly 1 + code / 2^bits. Two
 * f16x2 multiply-adds give the code, then scale * code + zero rounded once to fp16. (One
 * multiply-add with zero' = zero - 2^bits scale folded in would save one instruction per pair,
 * but rounding zero' costs up to 4.7 x 2^-11 of the block's largest value; measured on the CPU
 * emulation it made the attention output's error four times larger, 1.6e-3 against 3.9e-4.) */
#ifndef STRATA_KERNELS_CUDA_KV_ATTENTION_MMA_H
#define STRATA_KERNELS_CUDA_KV_ATTENTION_MMA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cuda_kv_attention.h"
#include "kvstore/half.h"
#include "kvstore/hd.h"
#include "kvstore/kv_cache.h"

#define KV_MMA_WARPS 4      /* warps a thread block; each takes every fourth block of the split */
#define KV_MMA_MAX_QPK 8    /* query heads per KV head: the rows gid of the A fragments */
#define KV_MMA_TAIL_TILE 16 /* fp16 tail rows a step */

/* Where a block's four KIVI sections for one KV head go in a warp's stage buffer: key codes
 * [D][BT bits / 8], key scale pairs [D][k_groups], value codes [BT][D bits / 8], value scale
 * pairs [BT][v_groups] (each section packed, 16-byte aligned). */
typedef struct kv_mma_stage {
    int k_row_bytes, k_groups, v_row_bytes, v_groups;
    uint32_t off_kz, off_vc, off_vz, bytes;
} kv_mma_stage;

/* constexpr for the launch bounds (C++); plain inline functions in C */
#ifdef __cplusplus
#define KV_MMA_CONSTEXPR constexpr
#else
#define KV_MMA_CONSTEXPR
#endif

STRATA_HD static inline KV_MMA_CONSTEXPR uint32_t kv_mma_align16(uint32_t x) { return (x + 15u) & ~15u; }

/* The queries in shared memory: KV_MMA_MAX_QPK rows of fp16 [head_dim + 8] (the padding puts the
 * lanes' fragment loads in distinct banks). */
STRATA_HD static inline KV_MMA_CONSTEXPR size_t kv_mma_q16_bytes(int head_dim) { return (size_t)KV_MMA_MAX_QPK * (size_t)(head_dim + 8) * 2; }

STRATA_HD static inline kv_mma_stage kv_mma_stage_of(const cuda_kv_layout *L)
{
    kv_mma_stage s;
    const int D = L->head_dim, BT = L->block_tokens;
    s.k_row_bytes = BT * L->k_bits / 8;
    s.k_groups = BT / L->k_group;
    s.v_row_bytes = D * L->v_bits / 8;
    s.v_groups = D / L->v_group;
    s.off_kz = kv_mma_align16((uint32_t)(D * s.k_row_bytes));
    s.off_vc = s.off_kz + kv_mma_align16((uint32_t)(D * s.k_groups * 4));
    s.off_vz = s.off_vc + kv_mma_align16((uint32_t)(BT * s.v_row_bytes));
    s.bytes = s.off_vz + kv_mma_align16((uint32_t)(BT * s.v_groups * 4));
    return s;
}

/* Whether the tensor-core kernel takes the layout with qpk query heads per KV head: KIVI, or the
 * codecs built on its backbone (TaDA, GEAR, OTT; their terms in kv_attention_mma_codec.h), with 2-
 * or 4-bit keys and values (the same for both), head_dim 64 or 128, 64-token blocks (the default;
 * block and group sizes are compile-time constants of the kernel, so that group boundaries cost
 * nothing at run time), one group size for keys and values: 8 (4-bit only), 16, 32 or 64. */
STRATA_HD static inline bool kv_mma_eligible(const cuda_kv_layout *L, int qpk)
{
    const int D = L->head_dim, G = L->k_group;
    const bool backbone = L->codec == KV_CODEC_KIVI || L->codec == KV_CODEC_TADA || L->codec == KV_CODEC_GEAR ||
                          L->codec == KV_CODEC_OTT;
    return backbone && (D == 64 || D == 128) && qpk >= 1 && qpk <= KV_MMA_MAX_QPK &&
           L->block_tokens == 64 && (L->k_bits == 2 || L->k_bits == 4) && L->v_bits == L->k_bits &&
           L->v_group == G && (G == 16 || G == 32 || G == 64 || (G == 8 && L->k_bits == 4));
}

/* Bytes of one stage buffer (kv_mma_stage_of's total) for 64-token blocks, from the compile-time
 * shape alone. */
STRATA_HD static inline KV_MMA_CONSTEXPR uint32_t kv_mma_stage_bytes(int head_dim, int bits, int group)
{
    const uint32_t D = (uint32_t)head_dim, B = (uint32_t)bits, G = (uint32_t)group;
    return kv_mma_align16(D * (64u * B / 8u)) + kv_mma_align16(D * (64u / G) * 4u) +
           kv_mma_align16(64u * (D * B / 8u)) + kv_mma_align16(64u * (D / G) * 4u);
}

/* One warp's buffers for GEAR and OTT (kv_mma_scratch, kv_attention_mma_codec.h): [8][BT] and
 * [8][D] floats and a 16-byte mask. */
STRATA_HD static inline KV_MMA_CONSTEXPR uint32_t kv_mma_scratch_bytes(int head_dim, int block_tokens)
{
    return (uint32_t)(KV_MMA_MAX_QPK * (block_tokens + head_dim) * 4 + 16);
}

/* Shared memory a thread block asks for: the fp16 queries, each warp's two stage buffers and, for
 * GEAR and OTT, its scratch; the warps' merge at the end reuses the space. */
STRATA_HD static inline KV_MMA_CONSTEXPR size_t kv_mma_smem_for(int head_dim, int bits, int group, int codec)
{
    const int buffers = codec == KV_CODEC_GEAR || codec == KV_CODEC_OTT;
    const size_t staged = kv_mma_q16_bytes(head_dim) +
                          (size_t)KV_MMA_WARPS * (2 * (size_t)kv_mma_stage_bytes(head_dim, bits, group) +
                                                  (buffers ? kv_mma_scratch_bytes(head_dim, 64) : 0u));
    const size_t merged = (size_t)KV_MMA_WARPS * KV_MMA_MAX_QPK * (size_t)(2 + head_dim) * sizeof(float);
    return staged > merged ? staged : merged;
}

/* Shared memory a thread block asks for with this layout (kv_mma_smem_for). */
STRATA_HD static inline size_t kv_mma_smem_bytes(const cuda_kv_layout *L)
{
    return kv_mma_smem_for(L->head_dim, L->k_bits, L->k_group, L->codec);
}

/* Whether the tensor-core kernel runs the layout on a device that allows a thread block
 * smem_limit bytes of shared memory (cudaDevAttrMaxSharedMemoryPerBlockOptin, or a plan's cap):
 * kv_mma_eligible, and its shared memory fits. cuda_kv_attention and the fake device's emulation
 * choose with it. */
STRATA_HD static inline bool kv_mma_runs(const cuda_kv_layout *L, int qpk, size_t smem_limit)
{
    return kv_mma_eligible(L, qpk) && kv_mma_smem_bytes(L) <= smem_limit;
}

/* Thread blocks of the kernel that fit a multiprocessor of an H100 (its launch bounds use the
 * same number, and the split plan counts waves with it): as many as its shared memory allows
 * (228 KiB a multiprocessor, 1 KiB of it kept per thread block), and at most as many as the
 * registers its loops need allow: three (168 registers a thread), two for GEAR (at three its
 * low-rank and outlier steps spilled up to 300 bytes) and for OTT at head_dim 128 (180-204
 * registers). At three, some head_dim-128 versions still spill a little (read from the sm_90
 * cubin in session 25: TaDA 2-bit 24-104 bytes by group, KIVI 2-bit 16-56, KIVI/TaDA 4-bit
 * with 64-token groups 24/64); whether two thread blocks run them faster is for a GPU to say. */
STRATA_HD static inline KV_MMA_CONSTEXPR int kv_mma_ctas_per_sm(int head_dim, int bits, int group, int codec)
{
    const int by_regs = codec == KV_CODEC_GEAR || (codec == KV_CODEC_OTT && head_dim == 128) ? 2 : 3;
    const int by_smem = (int)((size_t)228 * 1024 / (kv_mma_smem_for(head_dim, bits, group, codec) + 1024));
    return by_smem < by_regs ? by_smem : by_regs;
}

/* ---- fp16 pairs as 32-bit words (the device's f16x2 instructions; the CPU rounds once). ---- */

STRATA_HD static inline uint32_t kv_mma_pack(uint16_t lo, uint16_t hi) { return (uint32_t)lo | (uint32_t)hi << 16; }

STRATA_HD static inline uint32_t kv_mma_fma2(uint32_t a, uint32_t b, uint32_t c)
{
#ifdef __CUDA_ARCH__
    uint32_t d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
#else
    uint16_t r[2];
    for (int i = 0; i < 2; i++) {
        const int sh = 16 * i;
        const double x = (double)strata_half_to_float((uint16_t)(a >> sh)) *
                             (double)strata_half_to_float((uint16_t)(b >> sh)) +
                         (double)strata_half_to_float((uint16_t)(c >> sh));
        r[i] = strata_double_to_half(x);
    }
    return kv_mma_pack(r[0], r[1]);
#endif
}

/* __byte_perm: result byte i is byte (sel >> 4i) & 7 of the pair (a low, b high). */
STRATA_HD static inline uint32_t kv_mma_prmt(uint32_t a, uint32_t b, uint32_t sel)
{
#ifdef __CUDA_ARCH__
    return __byte_perm(a, b, sel);
#else
    const uint64_t v = (uint64_t)b << 32 | a;
    uint32_t r = 0;
    for (int i = 0; i < 4; i++)
        r |= (uint32_t)((v >> (8 * ((sel >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
    return r;
#endif
}

/* 32-bit words at 4-byte aligned addresses (shared memory on the device). */
STRATA_HD static inline uint32_t kv_mma_ld(const uint8_t *p)
{
#ifdef __CUDA_ARCH__
    return *(const uint32_t *)p;
#else
    uint32_t w;
    memcpy(&w, p, 4);
    return w;
#endif
}

STRATA_HD static inline void kv_mma_st(uint8_t *p, uint32_t w)
{
#ifdef __CUDA_ARCH__
    *(uint32_t *)p = w;
#else
    memcpy(p, &w, 4);
#endif
}

/* ---- codes ---- */

/* A lane's byte selectors (by the parity of the 8-code tile: two tiles share a word at 2 bits)
 * and shift for codes gid, 8 + gid, 16 + gid, ... of a row of `bits`-bit codes. */
typedef struct kv_mma_lane {
    uint32_t sel[2];
    uint32_t shift;
} kv_mma_lane;

STRATA_HD static inline kv_mma_lane kv_mma_lane_of(int lane, int bits)
{
    kv_mma_lane c;
    const int gid = lane >> 2, tiles_per_word = 4 / bits;
    for (int p = 0; p < 2; p++) {
        const uint32_t pos = (uint32_t)((p % tiles_per_word) * 8 + gid) * (uint32_t)bits;   /* bit within the word */
        const uint32_t byte = pos >> 3;
        c.sel[p] = byte | byte << 4 | (4u + byte) << 8 | (4u + byte) << 12;
        c.shift = (pos & 7u) + (uint32_t)bits - 2u;
    }
    return c;
}

/* The word of a row holding code 8 tile + gid (tile: the 8-code tile within the row). */
STRATA_HD static inline int kv_mma_word_of(int tile, int bits) { return tile * bits / 4; }

/* The lane's code from words wa (low half) and wb (high half) as 1 + code / 2^bits. */
STRATA_HD static inline uint32_t kv_mma_codes(uint32_t wa, uint32_t wb, const kv_mma_lane *c, int tile, int bits)
{
    const uint32_t m = ((1u << bits) - 1u) << (10 - bits);
    const uint32_t x = kv_mma_prmt(wa, wb, c->sel[tile & 1]) >> c->shift;
    return (x & (m | m << 16)) | 0x3c003c00u;
}

/* 2^bits and -2^bits as fp16 pairs. */
STRATA_HD static inline uint32_t kv_mma_pow2(int bits) { return bits == 2 ? 0x44004400u : 0x4c004c00u; }
STRATA_HD static inline uint32_t kv_mma_neg_pow2(int bits) { return bits == 2 ? 0xc400c400u : 0xcc00cc00u; }

/* Dequantized pair from kv_mma_codes' output x and the pair's scales and zeros: the codes
 * (exactly), then scale * code + zero. */
STRATA_HD static inline uint32_t kv_mma_dequant(uint32_t x, uint32_t scale, uint32_t zero, int bits)
{
    return kv_mma_fma2(kv_mma_fma2(x, kv_mma_pow2(bits), kv_mma_neg_pow2(bits)), scale, zero);
}

/* ---- per-block scale rearrangement (in the stage buffer, in place) ----
 * A section of scale pairs [rows][groups] (4 bytes: scale in the low half, zero in the high) is
 * rewritten pair of rows by pair of rows: the 2 x groups words of rows 2r and 2r+1 become
 * `groups` words (scale_2r, scale_2r+1), then `groups` words (zero_2r, zero_2r+1), the halves a
 * B register's pair needs side by side. Each word is written after the words it replaces were
 * read, so one lane streams through its pair of rows. */
STRATA_HD static inline void kv_mma_section_prep(uint8_t *sec, int rows, int groups, int lane)
{
    for (int r = lane; 2 * r < rows; r += 32) {
        uint8_t *at = sec + (size_t)2 * r * groups * 4;
        for (int g = 0; g < groups; g++) {
            const uint32_t pa = kv_mma_ld(at + 4 * (size_t)g), pb = kv_mma_ld(at + 4 * ((size_t)groups + g));
            kv_mma_st(at + 4 * (size_t)g, kv_mma_prmt(pa, pb, 0x5410u));
            kv_mma_st(at + 4 * ((size_t)groups + g), kv_mma_prmt(pa, pb, 0x7632u));
        }
    }
}

/* The byte offsets, within the section, of group g's scale and zero words for the pair of rows
 * starting at row `row` (even). */
STRATA_HD static inline size_t kv_mma_scale_offset(int row, int groups, int g)
{
    return ((size_t)row * groups + (size_t)g) * 4;
}
STRATA_HD static inline size_t kv_mma_zero_offset(int row, int groups, int g)
{
    return ((size_t)row * groups + (size_t)groups + (size_t)g) * 4;
}

/* ---- the entry points (kernels/cuda/kv_attention_mma.cu) ---- */
#ifdef __cplusplus
extern "C" {
#endif

/* Launches the split kernel (grid n_kv_heads x n_splits x n_seqs, KV_MMA_WARPS warps a block),
 * writing the partials the generic merge reads (ws_acc [row][split][D], ws_ml [row][split][2]).
 * The caller checked kv_mma_eligible. STRATA_OK or STRATA_EIO. */
int kv_mma_launch(const cuda_kv_layout *layout, const cuda_kv_plan *plan, const cuda_kv_seq *d_seqs, const float *d_q,
                  float *ws_acc, float *ws_ml, int *d_status, void *stream, strata_error *err);

#ifdef __cplusplus
}
#endif

#endif
