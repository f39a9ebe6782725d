/* The arithmetic of the GEAR writer (kvstore/codec_gear.c), inline so that the CUDA encoder runs
 * the same code as the CPU one and writes the same bytes: the choice of outliers, the group fill
 * that keeps them out of the quantizer's range, the sparse entries that keep them exactly, and the
 * per-head low-rank fit of the residual (fp64 subspace iteration from a seeded start, modified
 * Gram-Schmidt, f16 rounding of A, the least-squares B for the rounded A by a Cholesky solve).
 * docs/format.md 4b describes the algorithm; the comments here say why the code is shaped as it
 * is. */
#ifndef STRATA_KVSTORE_GEAR_MATH_H
#define STRATA_KVSTORE_GEAR_MATH_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kvstore/half.h"
#include "kvstore/hd.h"

#define GEAR_POWER_ITERS 3

/* A total order on floats: NaN above everything (all NaNs equal), -0 == +0. */
STRATA_HD static inline int gear_order(float a, float b)
{
    const int an = isnan(a) ? 1 : 0, bn = isnan(b) ? 1 : 0;
    if (an || bn)
        return an - bn;
    return (a > b) - (a < b);
}

/* Marks the k outliers of the n values x[i * stride] in mask[i * stride] (k even, <= n; mask
 * cleared by the caller): the k/2 largest, then the k/2 smallest of the rest, each found by a scan
 * in which only a strictly larger (smaller) value replaces the candidate, so the lower index wins
 * ties. O(k n), and the same set a sort by (value, index) would give. */
STRATA_HD static inline void gear_select_outliers(const float *x, size_t n, size_t stride, size_t k, uint8_t *mask)
{
    for (int side = 0; side < 2; side++)
        for (size_t m = 0; m < k / 2; m++) {
            size_t best = n;
            for (size_t i = 0; i < n; i++) {
                if (mask[i * stride])
                    continue;
                if (best == n || gear_order(x[i * stride], x[best * stride]) == (side ? -1 : 1))
                    best = i;
            }
            if (best < n)
                mask[best * stride] = 1;
        }
}

/* Replaces the marked entries of the group x[i * stride], i < n, by the mean of the others. */
STRATA_HD static inline void gear_fill_group(float *x, const uint8_t *mask, size_t n, size_t stride)
{
    double sum = 0.0;
    size_t kept = 0, marked = 0;
    for (size_t i = 0; i < n; i++) {
        if (mask[i * stride])
            marked++;
        else {
            sum += x[i * stride];
            kept++;
        }
    }
    if (!marked)
        return;
    const float mean = kept ? (float)(sum / (double)kept) : 0.0f;
    for (size_t i = 0; i < n; i++)
        if (mask[i * stride])
            x[i * stride] = mean;
}

STRATA_HD static inline uint64_t gear_splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The start of head h's fit of K (kv = 0) or V (kv = 1) in the block at (layer, first_pos). */
STRATA_HD static inline uint64_t gear_fit_seed(uint32_t layer, uint64_t first_pos, size_t h, int kv)
{
    uint64_t seed = 0x4745415200000000ull;  /* "GEAR" */
    uint64_t mix = gear_splitmix64(&seed);
    seed = mix ^ layer;
    mix = gear_splitmix64(&seed);
    seed = mix ^ first_pos;
    mix = gear_splitmix64(&seed);
    return mix ^ ((uint64_t)h << 1 | (uint64_t)kv);
}

/* Four partial sums: the adds are independent, so this is not bound by their latency. */
STRATA_HD static inline double gear_dot64(const double *a, const double *b, size_t n)
{
    double s[4] = {0.0, 0.0, 0.0, 0.0};
    size_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (size_t u = 0; u < 4; u++)
            s[u] += a[i + u] * b[i + u];
    for (; i < n; i++)
        s[0] += a[i] * b[i];
    return (s[0] + s[2]) + (s[1] + s[3]);
}

/* In fixed chunks so that -O2 vectorizes it (as kv_attn_axpy). */
STRATA_HD static inline void gear_axpy64(double *y, double a, const double *x, size_t n)
{
    size_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (size_t u = 0; u < 4; u++)
            y[i + u] += a * x[i + u];
    for (; i < n; i++)
        y[i] += a * x[i];
}

/* Orthonormalizes the rows of At [r][n] in place: modified Gram-Schmidt, each row projected
 * twice against the previous rows in use; a row that loses (nearly) all its norm is zeroed. */
STRATA_HD static inline void gear_orthonormalize(double *At, size_t n, size_t r, uint8_t *on)
{
    for (size_t k = 0; k < r; k++) {
        double *a = At + k * n;
        const double n0 = sqrt(gear_dot64(a, a, n));
        for (int pass = 0; pass < 2; pass++)
            for (size_t j = 0; j < k; j++)
                if (on[j])
                    gear_axpy64(a, -gear_dot64(At + j * n, a, n), At + j * n, n);
        const double nk = sqrt(gear_dot64(a, a, n));
        on[k] = n0 > 0.0 && nk > 1e-9 * n0 && isfinite(nk);
        const double inv = on[k] ? 1.0 / nk : 0.0;
        for (size_t t = 0; t < n; t++)
            a[t] = on[k] ? a[t] * inv : 0.0;
    }
}

/* Workspace of one head's low-rank fit (fp64), the caller's memory. The factors are kept
 * transposed (one row per rank component) so that every inner loop runs over contiguous memory. */
typedef struct gear_lr_work {
    double *R;    /* [T][D] residual */
    double *At;   /* [r][T]: column k of A is row k */
    double *Bt;   /* [r][D] */
    double *L;    /* [r][r] Gram matrix of the rounded A, then its Cholesky factor */
    double *y;    /* [r] */
    uint8_t *on;  /* [r] column in use */
    uint16_t *Ah; /* [T][r] stored halves */
    uint16_t *Bh; /* [D][r] */
} gear_lr_work;

/* Doubles of one fit's workspace (R, At, Bt, L, y) and bytes of its small arrays (on, Ah, Bh). */
STRATA_HD static inline size_t gear_lr_doubles(size_t T, size_t D, size_t r) { return T * D + r * T + r * D + r * r + r; }
STRATA_HD static inline size_t gear_lr_small_bytes(size_t T, size_t D, size_t r) { return r + 2 * T * r + 2 * D * r; }

STRATA_HD static inline void gear_store16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

/* Writes one vector's k sparse entries at e, index ascending: its element i is at first + i * stride
 * of the input and of mask. The CPU writer's input is fp32, the GPU's fp16, so the input is xf or,
 * when xf is NULL, xh (a typed pair, as kv_enc_row: no function pointer on the device). An fp16
 * input goes through fp32 as any other value would, which also gives every NaN the one quiet
 * pattern strata_float_to_half stores. */
STRATA_HD static inline void gear_write_sparse(uint8_t *e, size_t k, const float *xf, const uint16_t *xh,
                                               const uint8_t *mask, size_t first, size_t n, size_t stride)
{
    size_t at = 0;
    for (size_t i = 0; i < n && at < k; i++) {
        const size_t o = first + i * stride;
        if (!mask[o])
            continue;
        const float x = xf ? xf[o] : strata_half_to_float(xh[o]);
        gear_store16(e + 4 * at, (uint16_t)i);
        gear_store16(e + 4 * at + 2, strata_float_to_half(x));
        at++;
    }
}

/* Fits R (w->R, T x D) ~= A B^T at rank r with `iters` power iterations (0: GEAR_POWER_ITERS)
 * and writes A_h then B_h as f16 at out. */
STRATA_HD static inline void gear_lowrank_fit(const gear_lr_work *w, size_t T, size_t D, size_t r, int iters,
                                              uint64_t seed, uint8_t *out)
{
    const int n_iters = iters > 0 ? iters : GEAR_POWER_ITERS;
    const double *R = w->R;
    double *At = w->At, *Bt = w->Bt, *L = w->L, *y = w->y;
    for (size_t c = 0; c < D; c++)   /* B0 [D][r] row-major */
        for (size_t k = 0; k < r; k++)
            Bt[k * D + c] = (double)(gear_splitmix64(&seed) >> 11) * 0x1p-52 - 1.0;
    for (int l = 0; l < n_iters; l++) {
        for (size_t k = 0; k < r; k++)   /* A = R B */
            for (size_t t = 0; t < T; t++)
                At[k * T + t] = gear_dot64(R + t * D, Bt + k * D, D);
        gear_orthonormalize(At, T, r, w->on);
        if (l + 1 == n_iters)
            break;   /* the last B is computed below from the rounded A */
        for (size_t i = 0; i < r * D; i++)   /* B = R^T A */
            Bt[i] = 0.0;
        for (size_t k = 0; k < r; k++)
            for (size_t t = 0; t < T; t++)
                gear_axpy64(Bt + k * D, At[k * T + t], R + t * D, D);
    }
    /* Round A; then B = R^T A^ (A^^T A^)^-1 over the columns in use (Cholesky of the r x r Gram
     * matrix; A^ is orthonormal up to f16 rounding, so the pivots are ~1; a column whose pivot is
     * not clearly positive is dropped). */
    for (size_t k = 0; k < r; k++)
        for (size_t t = 0; t < T; t++) {
            const uint16_t h = strata_float_to_half((float)At[k * T + t]);
            w->Ah[t * r + k] = h;
            At[k * T + t] = strata_half_to_float(h);
        }
    for (size_t i = 0; i < r; i++)
        for (size_t j = 0; j <= i; j++)
            L[i * r + j] = gear_dot64(At + i * T, At + j * T, T);
    for (size_t i = 0; i < r; i++) {
        for (size_t j = 0; j <= i && w->on[i]; j++) {
            if (!w->on[j])
                continue;
            double s = L[i * r + j];
            for (size_t k = 0; k < j; k++)
                if (w->on[k])
                    s -= L[i * r + k] * L[j * r + k];
            if (j < i)
                L[i * r + j] = s / L[j * r + j];
            else if (s > 0.25 && isfinite(s))
                L[i * r + i] = sqrt(s);
            else
                w->on[i] = 0;
        }
    }
    for (size_t i = 0; i < r * D; i++)   /* R^T A^ */
        Bt[i] = 0.0;
    for (size_t k = 0; k < r; k++)
        if (w->on[k])
            for (size_t t = 0; t < T; t++)
                gear_axpy64(Bt + k * D, At[k * T + t], R + t * D, D);
    for (size_t c = 0; c < D; c++) {
        for (size_t i = 0; i < r; i++) {   /* L y = (R^T A^)[c] */
            if (!w->on[i]) {
                y[i] = 0.0;
                continue;
            }
            double s = Bt[i * D + c];
            for (size_t k = 0; k < i; k++)
                if (w->on[k])
                    s -= L[i * r + k] * y[k];
            y[i] = s / L[i * r + i];
        }
        for (size_t i = r; i-- > 0;) {   /* L^T x = y */
            if (!w->on[i])
                continue;
            double s = y[i];
            for (size_t k = i + 1; k < r; k++)
                if (w->on[k])
                    s -= L[k * r + i] * y[k];
            y[i] = s / L[i * r + i];
        }
        for (size_t i = 0; i < r; i++)
            w->Bh[c * r + i] = strata_float_to_half((float)y[i]);
    }
    int finite = 1;
    for (size_t i = 0; i < T * r; i++)
        finite &= (w->Ah[i] & 0x7c00u) != 0x7c00u;
    for (size_t i = 0; i < D * r; i++)
        finite &= (w->Bh[i] & 0x7c00u) != 0x7c00u;
    uint8_t *bo = out + 2 * T * r;
    for (size_t i = 0; i < T * r; i++)
        gear_store16(out + 2 * i, finite ? w->Ah[i] : 0);
    for (size_t i = 0; i < D * r; i++)
        gear_store16(bo + 2 * i, finite ? w->Bh[i] : 0);
}

#endif
