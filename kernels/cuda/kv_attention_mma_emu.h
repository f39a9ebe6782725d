/* The tensor-core attention kernel (kernels/cuda/kv_attention_mma.cu) on the CPU, lane by lane:
 * its stage layout, scale preparation, fragment maps and code decoding are the shared functions
 * of kv_attention_mma.h; the warp's collective steps (mma.sync, the shuffles) are done here over
 * the 32 lanes' values. Products of fp16 values are exact in fp32 and sums are fp32, as on the
 * tensor cores; the device differs in the order of the tensor cores' sums, in the FMAs nvcc forms
 * (dequantization, low-rank and OTT dot products) and in its approximate exponential (ex2.approx,
 * flushing tiny weights to zero): about 1e-6 relative, far inside the tests' 2e-3. Host code only, for the
 * emulated tests (tests/cuda/test_cuda_attention.c) and the fake device (tests/fakecuda). */
#ifndef STRATA_KERNELS_CUDA_KV_ATTENTION_MMA_EMU_H
#define STRATA_KERNELS_CUDA_KV_ATTENTION_MMA_EMU_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/kv_attention_block.h"
#include "kernels/cuda/kv_attention_mma.h"
#include "kernels/cuda/kv_attention_mma_codec.h"

#define KV_MMA_EMU_MAX_VT 16   /* 8-channel tiles at head_dim 128 */

typedef struct kv_mma_emu_warp {
    float o[32][KV_MMA_EMU_MAX_VT][2];   /* lane's value sums: head gid, channels 8m + 2tig + j */
    float m_run[32], l_run[32];
} kv_mma_emu_warp;

static inline float kv_mma_emu_lo(uint32_t w) { return strata_half_to_float((uint16_t)w); }
static inline float kv_mma_emu_hi(uint32_t w) { return strata_half_to_float((uint16_t)(w >> 16)); }

/* d += A B for one m16n8k16 product, A rows 0..7 (a0, a2; rows 8..15 zero): lane's two outputs at
 * d + lane * stride (a tile of the lanes' score or value-sum arrays). */
static inline void kv_mma_emu_mma(float *d, size_t stride, const uint32_t *a0, const uint32_t *a2, const uint32_t *b0,
                                  const uint32_t *b1)
{
    float A[8][16], B[16][8];
    for (int lane = 0; lane < 32; lane++) {
        const int r = lane >> 2, t = lane & 3;
        A[r][2 * t] = kv_mma_emu_lo(a0[lane]);
        A[r][2 * t + 1] = kv_mma_emu_hi(a0[lane]);
        A[r][2 * t + 8] = kv_mma_emu_lo(a2[lane]);
        A[r][2 * t + 9] = kv_mma_emu_hi(a2[lane]);
        B[2 * t][r] = kv_mma_emu_lo(b0[lane]);
        B[2 * t + 1][r] = kv_mma_emu_hi(b0[lane]);
        B[2 * t + 8][r] = kv_mma_emu_lo(b1[lane]);
        B[2 * t + 9][r] = kv_mma_emu_hi(b1[lane]);
    }
    for (int lane = 0; lane < 32; lane++) {
        const int r = lane >> 2, t = lane & 3;
        for (int j = 0; j < 2; j++) {
            float acc = d[lane * stride + j];
            for (int k = 0; k < 16; k++)
                acc += A[r][k] * B[k][2 * t + j];
            d[lane * stride + j] = acc;
        }
    }
}

/* The softmax step over nt 8-token tiles s[lane][n][j] (tokens from n_valid on masked): the
 * kernel's softmax_step, the shuffles as maxima over each head's four lanes. */
static inline void kv_mma_emu_softmax(kv_mma_emu_warp *w, float s[32][8][2], int nt, int n_valid, int vt,
                                      uint32_t pa[32][8])
{
    float mx[32];
    for (int lane = 0; lane < 32; lane++) {
        mx[lane] = -INFINITY;
        for (int n = 0; n < nt; n++)
            for (int j = 0; j < 2; j++) {
                if (8 * n + 2 * (lane & 3) + j >= n_valid)
                    s[lane][n][j] = -INFINITY;
                mx[lane] = strata_fmaxf(mx[lane], s[lane][n][j]);
            }
    }
    for (int lane = 0; lane < 32; lane++) {
        const int g0 = lane & ~3;
        const float m = strata_fmaxf(strata_fmaxf(mx[g0], mx[g0 + 1]), strata_fmaxf(mx[g0 + 2], mx[g0 + 3]));
        const float m_new = strata_fmaxf(w->m_run[lane], m);
        const float alpha = exp2f(w->m_run[lane] - m_new);
        float sum = 0.0f;
        for (int n = 0; n < nt; n++) {
            const float p0 = exp2f(s[lane][n][0] - m_new), p1 = exp2f(s[lane][n][1] - m_new);
            sum += p0 + p1;
            pa[lane][n] = kv_mma_pack(strata_float_to_half(p0), strata_float_to_half(p1));
        }
        w->l_run[lane] = w->l_run[lane] * alpha + sum;
        for (int m2 = 0; m2 < vt; m2++) {
            w->o[lane][m2][0] *= alpha;
            w->o[lane][m2][1] *= alpha;
        }
        w->m_run[lane] = m_new;
    }
}

/* The queries' fp16 pair (channels c, c + 1) of head i. */
static inline uint32_t kv_mma_emu_q(const uint16_t *q16, int D, int i, int c)
{
    return kv_mma_pack(q16[i * D + c], q16[i * D + c + 1]);
}

/* Block blk's sections for KV head kvh into the stage buffer st (stage_block). */
static inline void kv_mma_emu_stage(const cuda_kv_layout *L, const kv_mma_stage *S, const uint8_t *blk, int kvh,
                                    uint8_t *st)
{
    const int D = L->head_dim, H = L->n_kv_heads;
    memcpy(st, blk + L->off_k + (size_t)kvh * D * S->k_row_bytes, (size_t)D * S->k_row_bytes);
    memcpy(st + S->off_kz, blk + L->off_k_scales + (size_t)kvh * D * S->k_groups * 4, (size_t)D * S->k_groups * 4);
    for (int t = 0; t < L->block_tokens; t++) {
        memcpy(st + S->off_vc + (size_t)t * S->v_row_bytes, blk + L->off_v + ((size_t)t * H + kvh) * S->v_row_bytes,
               (size_t)S->v_row_bytes);
        memcpy(st + S->off_vz + (size_t)t * S->v_groups * 4,
               blk + L->off_v_scales + ((size_t)t * H + kvh) * S->v_groups * 4, (size_t)S->v_groups * 4);
    }
}

/* A lane's B registers b0, b1 of a staged block's keys or values: contraction rows r0, r0 + 1
 * (b0) and r0 + 8, r0 + 9 (b1), column gid of 8-wide tile `tile` (codes: the section's rows of
 * row_bytes; sec: its rearranged scales, `groups` a row; g: the tile's group). mean: TaDA's mean
 * section of keys (value 0: rows are channels, columns tokens) or values (rows are tokens), else
 * NULL. */
static inline void kv_mma_emu_b(const uint8_t *codes, int row_bytes, const uint8_t *sec, int groups, int g, int r0,
                                int tile, int lane, int bits, const uint8_t *mean, int value, int D, uint32_t *b0,
                                uint32_t *b1)
{
    const kv_mma_lane cl = kv_mma_lane_of(lane, bits);
    const uint8_t *rows = codes + 4 * (size_t)kv_mma_word_of(tile, bits);
    for (int half = 0; half < 2; half++) {
        const int r = r0 + 8 * half;
        const uint32_t x = kv_mma_codes(kv_mma_ld(rows + (size_t)r * row_bytes),
                                        kv_mma_ld(rows + (size_t)(r + 1) * row_bytes), &cl, tile, bits);
        uint32_t b = kv_mma_dequant(x, kv_mma_ld(sec + kv_mma_scale_offset(r, groups, g)),
                                    kv_mma_ld(sec + kv_mma_zero_offset(r, groups, g)), bits);
        const int col = 8 * tile + (lane >> 2);
        if (mean)
            b = kv_mma_add2(b, value ? kv_mma_mean_v(mean, D, r, col) : kv_mma_mean_k(mean, D, col, r));
        *(half ? b1 : b0) = b;
    }
}

/* GEAR's low-rank products (lowrank_scores / lowrank_values of the kernel): the scores s[lane][n]
 * (value 0) or the value sums w->o (value 1) take (Q B_h) A_h^T or (P A_v) B_v^T. */
static inline void kv_mma_emu_lowrank(const kv_mma_block_ctx *x, int value, float s[32][8][2], uint32_t pa[32][8],
                                      kv_mma_emu_warp *w)
{
    const int D = x->L->head_dim, BT = x->L->block_tokens, r = x->info.rank;
    const uint8_t *a = kv_mma_lowrank(x, value), *b = a + (size_t)BT * r * 2;
    uint32_t a0[32], a2[32], b0[32], b1[32], f0[32], f2[32];
    for (int k0 = 0; k0 < r; k0 += 16) {
        float lo[32][2], hi[32][2];
        memset(lo, 0, sizeof lo);
        memset(hi, 0, sizeof hi);
        /* First product: Q B_h over the channels (keys) or P A_v over the tokens (values). */
        for (int kk = 0; kk < (value ? BT : D) / 16; kk++)
            for (int part = 0; part < 2; part++) {
                for (int lane = 0; lane < 32; lane++) {
                    const int gid = lane >> 2, r0 = 16 * kk + 2 * (lane & 3), k = k0 + 8 * part + gid;
                    if (value) {
                        a0[lane] = pa[lane][2 * kk];
                        a2[lane] = pa[lane][2 * kk + 1];
                    } else {
                        a0[lane] = kv_mma_emu_q(x->q16, D, gid, r0);
                        a2[lane] = kv_mma_emu_q(x->q16, D, gid, r0 + 8);
                    }
                    const uint8_t *m = value ? a : b;
                    b0[lane] = kv_mma_lr_col(m, r, r0, k);
                    b1[lane] = kv_mma_lr_col(m, r, r0 + 8, k);
                }
                kv_mma_emu_mma(part ? &hi[0][0] : &lo[0][0], 2, a0, a2, b0, b1);
            }
        for (int lane = 0; lane < 32; lane++) {
            f0[lane] = kv_mma_pack(strata_float_to_half(lo[lane][0]), strata_float_to_half(lo[lane][1]));
            f2[lane] = kv_mma_pack(strata_float_to_half(hi[lane][0]), strata_float_to_half(hi[lane][1]));
        }
        /* Second product: times A_h^T (8-token tiles) or B_v^T (8-channel tiles). */
        for (int n = 0; n < (value ? D : BT) / 8; n++) {
            for (int lane = 0; lane < 32; lane++) {
                const int row = 8 * n + (lane >> 2), k = k0 + 2 * (lane & 3);
                const uint8_t *m = value ? b : a;
                b0[lane] = kv_mma_lr_row(m, r, row, k);
                b1[lane] = kv_mma_lr_row(m, r, row, k + 8);
            }
            if (value)
                kv_mma_emu_mma(&w->o[0][n][0], KV_MMA_EMU_MAX_VT * 2, f0, f2, b0, b1);
            else
                kv_mma_emu_mma(&s[0][n][0], 8 * 2, f0, f2, b0, b1);
        }
    }
}

/* One staged block through the scale rearrangement, the codec's terms, scores, softmax and values
 * (attend_block). x: the block, its parsed sections, the KV head, the queries; sc: the warp's
 * buffers (GEAR, OTT). Returns 1 when a GEAR outlier entry is malformed, else 0. */
static inline int kv_mma_emu_block(const kv_mma_block_ctx *x, uint8_t *st, kv_mma_scratch sc, kv_mma_emu_warp *w)
{
    const cuda_kv_layout *L = x->L;
    const kv_mma_stage *S = x->S;
    const int D = L->head_dim, BT = L->block_tokens, B = L->k_bits, nt = BT / 8, vt = D / 8;
    const int kshift = __builtin_ctz((unsigned)L->k_group), vshift = __builtin_ctz((unsigned)L->v_group);
    const int gear = L->codec == KV_CODEC_GEAR, ott = L->codec == KV_CODEC_OTT;
    const uint8_t *k_mean = L->codec == KV_CODEC_TADA ? x->blk + L->off_k_mean : NULL;
    const uint8_t *v_mean = L->codec == KV_CODEC_TADA ? x->blk + L->off_v_mean : NULL;
    int bad = 0;
    for (int lane = 0; lane < 32; lane++) {
        kv_mma_section_prep(st + S->off_kz, D, S->k_groups, lane);
        kv_mma_section_prep(st + S->off_vz, BT, S->v_groups, lane);
    }
    for (int lane = 0; lane < 32; lane++) {
        if (gear)
            bad |= kv_mma_key_outliers(x, sc, lane);
        if (ott)
            kv_mma_ott_scores(x, sc, lane);
    }
    float s[32][8][2];
    memset(s, 0, sizeof s);
    uint32_t a0[32], a2[32], b0[32], b1[32];
    for (int kk = 0; kk < D / 16; kk++)
        for (int n = 0; n < nt; n++) {
            for (int lane = 0; lane < 32; lane++) {
                const int gid = lane >> 2, c0 = 16 * kk + 2 * (lane & 3);
                a0[lane] = kv_mma_emu_q(x->q16, D, gid, c0);
                a2[lane] = kv_mma_emu_q(x->q16, D, gid, c0 + 8);
                kv_mma_emu_b(st, S->k_row_bytes, st + S->off_kz, S->k_groups, (8 * n) >> kshift, c0, n, lane, B,
                             k_mean, 0, D, &b0[lane], &b1[lane]);
            }
            kv_mma_emu_mma(&s[0][n][0], 8 * 2, a0, a2, b0, b1);
        }
    uint32_t pa[32][8];
    if (gear && x->info.rank)
        kv_mma_emu_lowrank(x, 0, s, pa, w);
    if (gear || ott)
        for (int lane = 0; lane < 32; lane++)
            kv_mma_take_scores(sc, BT, s[lane], lane, ott);
    kv_mma_emu_softmax(w, s, nt, BT, vt, pa);
    if (gear || ott) {
        for (int lane = 0; lane < 32; lane++)
            kv_mma_put_weights(sc, BT, pa[lane], lane);
        sc.mask[0] = sc.mask[1] = 0;
        for (int lane = 0; lane < 32; lane++) {
            if (gear)
                bad |= kv_mma_value_outliers(x, sc, lane);
            else
                kv_mma_ott_values(x, sc, lane);
        }
    }
    for (int kv = 0; kv < BT / 16; kv++)
        for (int m = 0; m < vt; m++) {
            for (int lane = 0; lane < 32; lane++) {
                a0[lane] = pa[lane][2 * kv];
                a2[lane] = pa[lane][2 * kv + 1];
                kv_mma_emu_b(st + S->off_vc, S->v_row_bytes, st + S->off_vz, S->v_groups, (8 * m) >> vshift,
                             16 * kv + 2 * (lane & 3), m, lane, B, v_mean, 1, D, &b0[lane], &b1[lane]);
            }
            kv_mma_emu_mma(&w->o[0][m][0], KV_MMA_EMU_MAX_VT * 2, a0, a2, b0, b1);
        }
    if (gear && x->info.rank)
        kv_mma_emu_lowrank(x, 1, s, pa, w);
    if (gear || ott)
        for (int lane = 0; lane < 32; lane++)
            kv_mma_take_values(sc, BT, D, w->o[lane], lane);
    return bad;
}

/* One tile of up to 16 tail rows from t0 (attend_tail_tile). */
static inline void kv_mma_emu_tail(const cuda_kv_layout *L, const cuda_kv_seq *seq, int kvh, int t0,
                                   const uint16_t *q16, kv_mma_emu_warp *w)
{
    const int D = L->head_dim, vt = D / 8;
    const int n_valid = seq->tail_tokens - t0 < KV_MMA_TAIL_TILE ? seq->tail_tokens - t0 : KV_MMA_TAIL_TILE;
    const size_t row = (size_t)L->n_kv_heads * D;
    const uint16_t *K = seq->tail_k + (size_t)t0 * row + (size_t)kvh * D;
    const uint16_t *V = seq->tail_v + (size_t)t0 * row + (size_t)kvh * D;
    float s[32][8][2];
    memset(s, 0, sizeof s);
    uint32_t a0[32], a2[32], b0[32], b1[32];
    for (int kk = 0; kk < D / 16; kk++)
        for (int n = 0; n < 2; n++) {
            for (int lane = 0; lane < 32; lane++) {
                const int gid = lane >> 2, c0 = 16 * kk + 2 * (lane & 3), t = 8 * n + gid;
                a0[lane] = kv_mma_emu_q(q16, D, gid, c0);
                a2[lane] = kv_mma_emu_q(q16, D, gid, c0 + 8);
                b0[lane] = t < n_valid ? kv_mma_pack(K[t * row + c0], K[t * row + c0 + 1]) : 0u;
                b1[lane] = t < n_valid ? kv_mma_pack(K[t * row + c0 + 8], K[t * row + c0 + 9]) : 0u;
            }
            kv_mma_emu_mma(&s[0][n][0], 8 * 2, a0, a2, b0, b1);
        }
    uint32_t pa[32][8];
    kv_mma_emu_softmax(w, s, 2, n_valid, vt, pa);
    for (int m = 0; m < vt; m++) {
        for (int lane = 0; lane < 32; lane++) {
            const int c = 8 * m + (lane >> 2), t = 2 * (lane & 3);
            uint16_t v[4];
            for (int i = 0; i < 4; i++) {
                const int ti = t + (i & 1) + 8 * (i >> 1);
                v[i] = ti < n_valid ? V[ti * row + c] : 0;
            }
            a0[lane] = pa[lane][0];
            a2[lane] = pa[lane][1];
            b0[lane] = kv_mma_pack(v[0], v[1]);
            b1[lane] = kv_mma_pack(v[2], v[3]);
        }
        kv_mma_emu_mma(&w->o[0][m][0], KV_MMA_EMU_MAX_VT * 2, a0, a2, b0, b1);
    }
}

/* attend_mma then merge_splits over a batch of views (host pointers); returns the status the
 * kernel would set (0, or 1 / 2 for a rejected block), -1 when out of memory. ws: the launch's
 * workspace (cuda_kv_attention_workspace bytes). The caller checked kv_mma_eligible. */
static inline int kv_mma_emu_attention(const cuda_kv_layout *L, const cuda_kv_plan *P, const cuda_kv_seq *seqs,
                                       const float *q, float *out, float *ws)
{
    const int D = L->head_dim, H = L->n_kv_heads, qpk = P->n_q_heads / H;
    const kv_mma_stage S = kv_mma_stage_of(L);
    uint8_t *st = malloc(S.bytes);
    kv_mma_emu_warp *warps = malloc(KV_MMA_WARPS * sizeof *warps);
    uint16_t *q16 = malloc((size_t)KV_MMA_MAX_QPK * D * sizeof *q16);
    uint8_t *scratch = calloc(1, kv_mma_scratch_bytes(D, L->block_tokens));   /* cleared between blocks */
    if (!st || !warps || !q16 || !scratch) {
        free(st);
        free(warps);
        free(q16);
        free(scratch);
        return -1;
    }
    const kv_mma_scratch sc = kv_mma_scratch_at(scratch, D, L->block_tokens);
    kv_mma_block_ctx x = {.L = L, .S = &S, .st = st, .qpk = qpk, .q_stride = D, .q16 = q16};
    float *ws_acc = ws, *ws_ml = ws + (size_t)P->n_seqs * P->n_q_heads * P->n_splits * D;
    const float qscale = 1.44269504088896341f / sqrtf((float)D);
    int status = 0;
    for (int si = 0; si < P->n_seqs; si++)
        for (int split = 0; split < P->n_splits; split++)
            for (int kvh = 0; kvh < H; kvh++) {
                const cuda_kv_seq *seq = &seqs[si];
                const size_t row0 = (size_t)si * P->n_q_heads + (size_t)kvh * qpk;
                for (int i = 0; i < KV_MMA_MAX_QPK; i++)
                    for (int c = 0; c < D; c++)
                        q16[i * D + c] = i < qpk ? strata_float_to_half(q[(row0 + i) * D + c] * qscale) : 0;
                const int first = split * P->blocks_per_split;
                const int end = first + P->blocks_per_split < seq->n_blocks + 1 ? first + P->blocks_per_split
                                                                                 : seq->n_blocks + 1;
                const int block_end = end < seq->n_blocks ? end : seq->n_blocks;
                for (int wi = 0; wi < KV_MMA_WARPS; wi++) {
                    kv_mma_emu_warp *w = &warps[wi];
                    memset(w->o, 0, sizeof w->o);
                    for (int lane = 0; lane < 32; lane++) {
                        w->m_run[lane] = -INFINITY;
                        w->l_run[lane] = 0.0f;
                    }
                    for (int u = first + wi; u < block_end; u += KV_MMA_WARPS) {
                        const uint8_t *blk = seq->blocks[u];
                        int bad = kv_att_block_status(L, blk, u);
                        if (!bad)
                            bad = kv_att_block_parse(L, blk, &x.info);
                        if (bad) {
                            status = bad;
                            continue;
                        }
                        x.blk = blk;
                        x.kvh = kvh;
                        kv_mma_emu_stage(L, &S, blk, kvh, st);
                        if (kv_mma_emu_block(&x, st, sc, w))
                            status = 1;
                    }
                    if (first <= seq->n_blocks && end > seq->n_blocks)
                        for (int t0 = KV_MMA_TAIL_TILE * wi; t0 < seq->tail_tokens;
                             t0 += KV_MMA_TAIL_TILE * KV_MMA_WARPS)
                            kv_mma_emu_tail(L, seq, kvh, t0, q16, w);
                    for (int lane = 0; lane < 32; lane += 4)   /* the four lanes of a head add up */
                        w->l_run[lane] += w->l_run[lane + 1] + w->l_run[lane + 2] + w->l_run[lane + 3];
                }
                for (int i = 0; i < qpk; i++) {
                    float M = -INFINITY;
                    for (int wi = 0; wi < KV_MMA_WARPS; wi++)
                        M = strata_fmaxf(M, warps[wi].m_run[4 * i]);
                    const size_t at = (row0 + i) * P->n_splits + split;
                    float l = 0.0f;
                    for (int wi = 0; wi < KV_MMA_WARPS; wi++)
                        if (warps[wi].m_run[4 * i] != -INFINITY)
                            l += exp2f(warps[wi].m_run[4 * i] - M) * warps[wi].l_run[4 * i];
                    for (int c = 0; c < D; c++) {
                        float a = 0.0f;
                        for (int wi = 0; wi < KV_MMA_WARPS; wi++) {
                            const float mw = warps[wi].m_run[4 * i];
                            if (mw != -INFINITY)   /* lane of head i holding channel c */
                                a += exp2f(mw - M) * warps[wi].o[4 * i + (c % 8) / 2][c / 8][c % 2];
                        }
                        ws_acc[at * D + c] = a;
                    }
                    ws_ml[2 * at] = M == -INFINITY ? M : M * 0.69314718055994531f;
                    ws_ml[2 * at + 1] = l;
                }
            }
    for (size_t row = 0; row < (size_t)P->n_seqs * P->n_q_heads; row++)
        kv_att_merge_row(P->n_splits, D, row, ws_acc, ws_ml, out, 0, 1);
    free(st);
    free(warps);
    free(q16);
    free(scratch);
    return status;
}

#endif
