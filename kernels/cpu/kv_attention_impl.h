/* Internal to the CPU attention kernel: the state shared by the driver (kv_attention.c) and
 * the per-codec correction terms (kv_attention_<codec>.c). Not a public header.
 *
 * Protocol per block: the score pass writes scores[h][pos + j] = (q_h . k_j) / sqrt(D) for the
 * block's tokens (the KIVI backbone first, then the codec's correction adds to or overwrites
 * these entries, already scaled); after the softmax scores[h][pos + j] holds the unnormalized
 * weight p_j, and the value pass adds sum_j p_j v_j into acc[h] (fp64), again backbone first
 * and then the codec's correction. Corrections may use part, groups and row as scratch (nothing
 * is kept there between calls). */
#ifndef STRATA_KERNELS_CPU_KV_ATTENTION_IMPL_H
#define STRATA_KERNELS_CPU_KV_ATTENTION_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/kv_attention.h"
#include "kvstore/block.h"

typedef struct attn_ctx {
    const kv_layer_view *view;
    const float *q;             /* [nq][D] */
    size_t nq, nkv, qpk, D, T;  /* qpk: query heads per KV head; T: all positions */
    float inv_sqrt_d;
    float *scores;              /* [nq][T] */
    double *acc;                /* [nq][D] */
    double *sums;               /* [nq] softmax normalizers */
    float *part;                /* [qpk][max(bt, D)] scratch */
    float *groups;              /* [qpk][max(bt, D)] scratch */
    float *row;                 /* [max(bt, D)] scratch: one unpacked or converted row */
    void (*halves)(const uint8_t *src, size_t n, float *dst);
    bool native_is_le_halves;   /* the tail's uint16 array may go through halves() */
} attn_ctx;

/* The inner loops run in fixed chunks of 8 so the compiler vectorizes them at -O2 without
 * -ffast-math; the dot product keeps 8 partial sums for the same reason. */
static inline void kv_attn_axpy(float *restrict y, float a, const float *restrict x, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (size_t u = 0; u < 8; u++)
            y[i + u] += a * x[i + u];
    for (; i < n; i++)
        y[i] += a * x[i];
}

static inline float kv_attn_dot(const float *restrict a, const float *restrict b, size_t n)
{
    float part[8] = {0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (size_t u = 0; u < 8; u++)
            part[u] += a[i + u] * b[i + u];
    float s = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}

/* The argument checks both kernels make: NULLs, scratch alignment, head shapes, the block table
 * and tail buffers the view claims. STRATA_EINVAL with a message. */
int kv_attn_check_args(const kv_layer_view *view, const float *q, int n_q_heads, const float *out,
                       const void *scratch, strata_error *err);

/* Scratch arithmetic that saturates at SIZE_MAX, so that an absurd view asks for an impossible
 * allocation instead of wrapping. */
static inline size_t kv_attn_align64(size_t x) { return x > SIZE_MAX - 63 ? SIZE_MAX : (x + 63) & ~(size_t)63; }
static inline size_t kv_attn_mul_sat(size_t a, size_t b)
{
    size_t r;
    return __builtin_mul_overflow(a, b, &r) ? SIZE_MAX : r;
}
static inline size_t kv_attn_add_sat(size_t a, size_t b) { return a > SIZE_MAX - b ? SIZE_MAX : a + b; }

/* Parses block i of a view and checks it belongs there (layer, positions, shape): STRATA_EFORMAT
 * with the block named otherwise. */
int kv_attn_parse_block(const kv_layer_view *v, size_t i, kv_block *b, strata_error *err);

/* n fp16 numbers (native uint16) to fp32, with F16C where the CPU has it. */
void kv_attn_halves_to_f32(const uint16_t *src, size_t n, float *dst);

/* The KIVI backbone (K_CODES..V_SCALES) of a block whose first token sits at position pos. */
void kv_attn_kivi_scores(attn_ctx *a, const kv_block *b, size_t pos);
void kv_attn_kivi_values(attn_ctx *a, const kv_block *b, size_t pos);

/* Codec corrections, run after the backbone of the same pass. They fail (STRATA_EFORMAT) only
 * on sections that are inconsistent with the header (e.g. an index out of range). */
int kv_attn_gear_scores(attn_ctx *a, const kv_block *b, size_t pos, strata_error *err);
int kv_attn_gear_values(attn_ctx *a, const kv_block *b, size_t pos, strata_error *err);
int kv_attn_ott_scores(attn_ctx *a, const kv_block *b, size_t pos, strata_error *err);
int kv_attn_ott_values(attn_ctx *a, const kv_block *b, size_t pos, strata_error *err);
int kv_attn_tada_scores(attn_ctx *a, const kv_block *b, size_t pos, strata_error *err);
int kv_attn_tada_values(attn_ctx *a, const kv_block *b, size_t pos, strata_error *err);

#endif
