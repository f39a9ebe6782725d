/* What TaDA, GEAR and OTT blocks add to the KIVI backbone in the tensor-core decode attention
 * (kernels/cuda/kv_attention_mma.cu), lane by lane; the CPU emulation (kv_attention_mma_emu.h)
 * calls the same functions. docs/format.md 4b-4d define each reconstruction; here is how each
 * term enters the two products without K or V being written out:
 *
 *   TaDA  the token's fp16 mean is added (f16x2) to each dequantized pair before the product.
 *   GEAR  low rank: q . (A_h B_h^T)[t] = (q B_h) . A_h[t], so the scores take two more products,
 *         Q B_h (query heads x rank) and then that times A_h^T; the values likewise, P A_v and then
 *         that times B_v^T. Ranks go 16 at a time (zero past the block's rank). An outlier
 *         replaces its element, so it adds q[c] (v - x) to its token's score (x: the backbone plus
 *         the low-rank term there, in fp32) through the warp's score buffer, and a value outlier
 *         adds p[t] (v - x) to the warp's value buffer. Entries out of range or out of order make
 *         the block malformed (the status flag), as the format says a reader must.
 *   OTT   a pooled (head, token)'s exact score q . k (fp32 sums of the fp16 query and row) replaces
 *         the placeholder's through the score buffer and a token mask; p[t] times its exact value
 *         row enters the value buffer (its backbone row dequantizes to zero, format 4c).
 *
 * The warp's buffers (kv_mma_scratch, shared memory): scores, then weights [8][BT] floats (zero
 * between blocks), values [8][D] floats (zero between blocks), a 64-bit token mask. Private to
 * kernels/cuda. */
#ifndef STRATA_KERNELS_CUDA_KV_ATTENTION_MMA_CODEC_H
#define STRATA_KERNELS_CUDA_KV_ATTENTION_MMA_CODEC_H

#include "kernels/cuda/kv_attention_block.h"
#include "kernels/cuda/kv_attention_mma.h"

#ifdef __CUDA_ARCH__   /* the device pass (the host compiler does not know the pragma) */
#define KV_MMA_UNROLL _Pragma("unroll")
#else
#define KV_MMA_UNROLL
#endif

typedef struct kv_mma_scratch {
    float *buf;      /* [KV_MMA_MAX_QPK][block_tokens]: score terms, then the block's weights */
    float *vals;     /* [KV_MMA_MAX_QPK][head_dim]: value terms */
    uint32_t *mask;  /* [2]: tokens whose score the buffer replaces (OTT) */
} kv_mma_scratch;

STRATA_HD static inline kv_mma_scratch kv_mma_scratch_at(uint8_t *base, int head_dim, int block_tokens)
{
    kv_mma_scratch s;
    s.buf = (float *)base;
    s.vals = s.buf + KV_MMA_MAX_QPK * block_tokens;
    s.mask = (uint32_t *)(s.vals + KV_MMA_MAX_QPK * head_dim);
    return s;
}

/* ---- loads from the block itself (global memory on the device: read-only, cached) ---- */

STRATA_HD static inline uint32_t kv_mma_gld16(const uint8_t *p)
{
#ifdef __CUDA_ARCH__
    return (uint32_t)__ldg((const unsigned short *)p);
#else
    return (uint32_t)p[0] | (uint32_t)p[1] << 8;
#endif
}

STRATA_HD static inline uint32_t kv_mma_gld32(const uint8_t *p)
{
#ifdef __CUDA_ARCH__
    return __ldg((const unsigned int *)p);
#else
    return kv_att_ld32(p);
#endif
}

STRATA_HD static inline float kv_mma_h2f(uint32_t h) { return strata_half_to_float((uint16_t)h); }

STRATA_HD static inline void kv_mma_atomic_add(float *p, float x)
{
#ifdef __CUDA_ARCH__
    atomicAdd(p, x);
#else
    *p += x;
#endif
}

STRATA_HD static inline void kv_mma_atomic_or(uint32_t *p, uint32_t x)
{
#ifdef __CUDA_ARCH__
    atomicOr(p, x);
#else
    *p |= x;
#endif
}

/* a + b on fp16 pairs, rounded once. */
STRATA_HD static inline uint32_t kv_mma_add2(uint32_t a, uint32_t b)
{
#ifdef __CUDA_ARCH__
    uint32_t d;
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
#else
    uint16_t r[2];
    for (int i = 0; i < 2; i++)
        r[i] = strata_double_to_half((double)kv_mma_h2f(a >> (16 * i)) + (double)kv_mma_h2f(b >> (16 * i)));
    return kv_mma_pack(r[0], r[1]);
#endif
}

/* ---- TaDA: the means of a key pair (channels c, c + 1 of token t) and of a value pair (tokens t,
 * t + 1 of channel c), from the block's mean sections [T][D] ---- */

STRATA_HD static inline uint32_t kv_mma_mean_k(const uint8_t *mean, int D, int t, int c)
{
    return kv_mma_gld32(mean + 2 * ((size_t)t * D + (size_t)c));
}

STRATA_HD static inline uint32_t kv_mma_mean_v(const uint8_t *mean, int D, int t, int c)
{
    return kv_mma_gld16(mean + 2 * ((size_t)t * D + (size_t)c)) |
           kv_mma_gld16(mean + 2 * ((size_t)(t + 1) * D + (size_t)c)) << 16;
}

/* ---- GEAR low rank: B-fragment pairs of a factor m [rows][r] (fp16), zero past rank r ---- */

STRATA_HD static inline uint32_t kv_mma_lr_at(const uint8_t *m, int r, int row, int k)
{
    return k < r ? kv_mma_gld16(m + 2 * ((size_t)row * r + (size_t)k)) : 0u;
}

/* (m[row][k], m[row + 1][k]): two rows of the contraction, one column. */
STRATA_HD static inline uint32_t kv_mma_lr_col(const uint8_t *m, int r, int row, int k)
{
    return kv_mma_lr_at(m, r, row, k) | kv_mma_lr_at(m, r, row + 1, k) << 16;
}

/* (m[row][k], m[row][k + 1]): one row, two ranks of the contraction. */
STRATA_HD static inline uint32_t kv_mma_lr_row(const uint8_t *m, int r, int row, int k)
{
    return kv_mma_lr_at(m, r, row, k) | kv_mma_lr_at(m, r, row, k + 1) << 16;
}

/* ---- backbone elements of a staged, prepared block (kv_mma_section_prep ran), in fp32 ---- */

STRATA_HD static inline float kv_mma_stage_elem(const uint8_t *row, const uint8_t *scales, int groups, int r, int g,
                                                int i, int bits)
{
    const uint32_t w = kv_mma_ld(row + 4 * (size_t)(i * bits / 32));
    const float code = (float)((w >> ((i * bits) & 31)) & ((1u << bits) - 1u));
    const int pair = r & ~1, hi = 16 * (r & 1);
    const float s = kv_mma_h2f(kv_mma_ld(scales + kv_mma_scale_offset(pair, groups, g)) >> hi);
    const float z = kv_mma_h2f(kv_mma_ld(scales + kv_mma_zero_offset(pair, groups, g)) >> hi);
    return code * s + z;
}

/* Key of channel c, token t; value of token t, channel c. */
STRATA_HD static inline float kv_mma_stage_key(const kv_mma_stage *S, const uint8_t *st, int group, int bits, int c,
                                               int t)
{
    return kv_mma_stage_elem(st + (size_t)c * S->k_row_bytes, st + S->off_kz, S->k_groups, c, t / group, t, bits);
}

STRATA_HD static inline float kv_mma_stage_value(const kv_mma_stage *S, const uint8_t *st, int group, int bits, int t,
                                                 int c)
{
    return kv_mma_stage_elem(st + S->off_vc + (size_t)t * S->v_row_bytes, st + S->off_vz, S->v_groups, t, c / group,
                             c, bits);
}

/* What one block's corrections need: the block (device memory on the device), its parsed
 * sections, the KV head, the staged backbone and the fp16 queries (scaled as the products use
 * them; head i, channel c at q16[i * q_stride + c]). */
typedef struct kv_mma_block_ctx {
    const cuda_kv_layout *L;
    const kv_mma_stage *S;
    const uint8_t *blk, *st;
    kv_att_block_info info;
    int kvh, qpk, q_stride;
    const uint16_t *q16;
} kv_mma_block_ctx;

/* The head's low-rank factors of keys (value 0) or values (1): A_h, followed by B_h. */
STRATA_HD static inline const uint8_t *kv_mma_lowrank(const kv_mma_block_ctx *x, int value)
{
    const size_t T = (size_t)x->L->block_tokens, D = (size_t)x->L->head_dim, r = (size_t)x->info.rank;
    return x->blk + (value ? x->info.off_v_lowrank : x->info.off_k_lowrank) + (size_t)x->kvh * (T + D) * r * 2;
}

/* GEAR key outliers of the head into the score buffer (lane's share). Returns 1 when an entry is
 * out of range or out of order (nothing added for it), else 0. */
STRATA_HD static inline int kv_mma_key_outliers(const kv_mma_block_ctx *x, kv_mma_scratch sc, int lane)
{
    const int n = x->info.k_sparse, D = x->L->head_dim, T = x->L->block_tokens;
    if (!n)
        return 0;
    const uint8_t *ent = x->blk + x->info.off_k_sparse + (size_t)x->kvh * D * n * 4;
    const uint8_t *lr = x->info.rank ? kv_mma_lowrank(x, 0) : NULL;
    int bad = 0;
    for (int e = lane; e < D * n; e += 32) {
        const int c = e / n;
        const uint32_t w = kv_mma_gld32(ent + 4 * (size_t)e);
        const int t = (int)(w & 0xffffu);
        if (t >= T || (e % n && t <= (int)kv_mma_gld16(ent + 4 * (size_t)(e - 1)))) {
            bad = 1;
            continue;
        }
        float old = kv_mma_stage_key(x->S, x->st, x->L->k_group, x->L->k_bits, c, t);
        if (lr)
            old += kv_att_lowrank_at(lr, (size_t)x->info.rank, (size_t)T, (size_t)t, (size_t)c);
        const float d = kv_mma_h2f(w >> 16) - old;
        for (int i = 0; i < x->qpk; i++)
            kv_mma_atomic_add(&sc.buf[i * T + t], strata_half_to_float(x->q16[i * x->q_stride + c]) * d);
    }
    return bad;
}

/* GEAR value outliers into the value buffer, weighted by the block's weights (in the score
 * buffer by now). Returns 1 for a malformed entry, as above. */
STRATA_HD static inline int kv_mma_value_outliers(const kv_mma_block_ctx *x, kv_mma_scratch sc, int lane)
{
    const int n = x->info.v_sparse, D = x->L->head_dim, T = x->L->block_tokens, H = x->L->n_kv_heads;
    if (!n)
        return 0;
    const uint8_t *lr = x->info.rank ? kv_mma_lowrank(x, 1) : NULL;
    int bad = 0;
    for (int e = lane; e < T * n; e += 32) {
        const int t = e / n, j = e - t * n;
        const uint8_t *ent = x->blk + x->info.off_v_sparse + (((size_t)t * H + (size_t)x->kvh) * n + (size_t)j) * 4;
        const uint32_t w = kv_mma_gld32(ent);
        const int c = (int)(w & 0xffffu);
        if (c >= D || (j && c <= (int)kv_mma_gld16(ent - 4))) {
            bad = 1;
            continue;
        }
        float old = kv_mma_stage_value(x->S, x->st, x->L->v_group, x->L->v_bits, t, c);
        if (lr)
            old += kv_att_lowrank_at(lr, (size_t)x->info.rank, (size_t)T, (size_t)t, (size_t)c);
        const float d = kv_mma_h2f(w >> 16) - old;
        for (int i = 0; i < x->qpk; i++)
            kv_mma_atomic_add(&sc.vals[i * D + c], sc.buf[i * T + t] * d);
    }
    return bad;
}

/* OTT: the exact scores of the head's pooled tokens into the score buffer, their tokens into the
 * mask (entries were checked by kv_att_block_parse). */
STRATA_HD static inline void kv_mma_ott_scores(const kv_mma_block_ctx *x, kv_mma_scratch sc, int lane)
{
    const int n = x->info.n_ott, D = x->L->head_dim, T = x->L->block_tokens;
    const uint8_t *sec = x->blk + x->info.off_ott;
    for (int y = lane; y < n * x->qpk; y += 32) {
        const int e = y / x->qpk, i = y - e * x->qpk;
        const uint32_t ht = kv_mma_gld32(sec + 4 * (size_t)e);
        if ((int)(ht & 0xffffu) != x->kvh)
            continue;
        const int t = (int)(ht >> 16);
        const uint8_t *k = sec + 4 * (size_t)n + 2 * (size_t)e * D;
        const uint16_t *q = x->q16 + (size_t)i * x->q_stride;
        float dot = 0.0f;
        for (int c = 0; c < D; c += 2) {
            const uint32_t kw = kv_mma_gld32(k + 2 * (size_t)c);
            dot += strata_half_to_float(q[c]) * kv_mma_h2f(kw) + strata_half_to_float(q[c + 1]) * kv_mma_h2f(kw >> 16);
        }
        sc.buf[i * T + t] = dot;
        kv_mma_atomic_or(&sc.mask[t >> 5], 1u << (t & 31));
    }
}

/* OTT: p[t] times each pooled token's exact value row into the value buffer (lanes own channels). */
STRATA_HD static inline void kv_mma_ott_values(const kv_mma_block_ctx *x, kv_mma_scratch sc, int lane)
{
    const int n = x->info.n_ott, D = x->L->head_dim, T = x->L->block_tokens;
    const uint8_t *sec = x->blk + x->info.off_ott;
    for (int e = 0; e < n; e++) {
        const uint32_t ht = kv_mma_gld32(sec + 4 * (size_t)e);
        if ((int)(ht & 0xffffu) != x->kvh)
            continue;
        const int t = (int)(ht >> 16);
        const uint8_t *v = sec + 4 * (size_t)n + 2 * (size_t)D * n + 2 * (size_t)e * D;
        for (int c = lane; c < D; c += 32) {
            const float vc = kv_mma_h2f(kv_mma_gld16(v + 2 * (size_t)c));
            for (int i = 0; i < x->qpk; i++)
                sc.vals[i * D + c] += sc.buf[i * T + t] * vc;
        }
    }
}

/* The lane's scores s[n][j] (head gid, token 8n + 2tig + j) take the score buffer's terms: added
 * (GEAR), or put in place of the score where the mask holds the token (OTT). The lane's entries
 * are cleared. */
STRATA_HD static inline void kv_mma_take_scores(kv_mma_scratch sc, int T, float (*s)[2], int lane, int replace)
{
    const int gid = lane >> 2, tig = lane & 3;
    KV_MMA_UNROLL
    for (int n = 0; n < T / 8; n++)
        KV_MMA_UNROLL
        for (int j = 0; j < 2; j++) {
            const int t = 8 * n + 2 * tig + j;
            float *b = &sc.buf[gid * T + t];
            if (!replace)
                s[n][j] += *b;
            else if ((sc.mask[t >> 5] >> (t & 31)) & 1u)
                s[n][j] = *b;
            *b = 0.0f;
        }
}

/* The block's weights (the values' A fragments pa, head gid, tokens 8n + 2tig, +1) into the score
 * buffer as fp32, for the outliers and pooled rows. */
STRATA_HD static inline void kv_mma_put_weights(kv_mma_scratch sc, int T, const uint32_t *pa, int lane)
{
    const int gid = lane >> 2, tig = lane & 3;
    KV_MMA_UNROLL
    for (int n = 0; n < T / 8; n++) {
        sc.buf[gid * T + 8 * n + 2 * tig] = kv_mma_h2f(pa[n]);
        sc.buf[gid * T + 8 * n + 2 * tig + 1] = kv_mma_h2f(pa[n] >> 16);
    }
}

/* The lane's value sums o[m][j] (head gid, channel 8m + 2tig + j) take the value buffer's terms;
 * its entries and the lane's weights in the score buffer are cleared for the next block. */
STRATA_HD static inline void kv_mma_take_values(kv_mma_scratch sc, int T, int D, float (*o)[2], int lane)
{
    const int gid = lane >> 2, tig = lane & 3;
    KV_MMA_UNROLL
    for (int m = 0; m < D / 8; m++)
        KV_MMA_UNROLL
        for (int j = 0; j < 2; j++) {
            float *v = &sc.vals[gid * D + 8 * m + 2 * tig + j];
            o[m][j] += *v;
            *v = 0.0f;
        }
    KV_MMA_UNROLL
    for (int n = 0; n < T / 8; n++)
        sc.buf[gid * T + 8 * n + 2 * tig] = sc.buf[gid * T + 8 * n + 2 * tig + 1] = 0.0f;
}

#endif
