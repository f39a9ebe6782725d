/* GEAR: a KIVI block plus, per vector, a few outliers kept exactly (sparse) and, per head, a
 * low-rank approximation of what the quantizer missed (the residual).
 *
 * Header (docs/format.md 2.1): k_bits = v_bits = B in {2, 4}; k_group = v_group = G (the KIVI
 * backbone rules: G divides n_tokens and head_dim, whole 32-bit code words); rank r at byte 44,
 * 0 <= r <= min(n_tokens, head_dim) (and <= 255); k_sparse (byte 46) = outliers per key vector,
 * even, <= n_tokens, and n_tokens <= 65536 when k_sparse > 0 (token indices are u16); v_sparse
 * (byte 48) = outliers per value vector, even, <= head_dim; ott_tokens (byte 50) = 0.
 * Let T = n_tokens, H = n_kv_heads, D = head_dim. A key vector is one channel c of one head h
 * over the block's T tokens (K[t][h][c], t = 0..T-1); a value vector is one token t of one
 * head h over the D channels (V[t][h][c], c = 0..D-1).
 *
 * Sections, in this order:
 *   K_CODES, K_SCALES, V_CODES, V_SCALES   the KIVI backbone (section 4), always
 *   GEAR_K_SPARSE (16)   if k_sparse > 0, H * D * k_sparse * 4 bytes: for each key vector
 *                        h * D + c in order, k_sparse entries (u16 token index, f16 value)
 *   GEAR_V_SPARSE (17)   if v_sparse > 0, T * H * v_sparse * 4 bytes: for each value vector
 *                        t * H + h in order, v_sparse entries (u16 channel index, f16 value)
 *   GEAR_K_LOWRANK (18)  if r > 0, H * (T + D) * r * 2 bytes: for each head h in order,
 *                        A_h [T][r] f16 row-major, then B_h [D][r] f16 row-major
 *   GEAR_V_LOWRANK (19)  if r > 0, same layout for the values
 * Within a vector the sparse entries are sorted by index, strictly ascending (so distinct), and
 * every index is < T (keys) or < D (values); a reader rejects anything else (malformed block).
 *
 * Decoding: X'[t][h][c] = backbone(t, h, c) + sum_k A_h[t][k] B_h[c][k], then every outlier
 * position is overwritten with its stored f16 value (outliers are reproduced exactly). A reader
 * computes in at least fp32.
 *
 * How the reference writer encodes (informative; a reader does not depend on it):
 *  1. The outliers of a vector of n values with k outliers are its k/2 largest values, then the
 *     k/2 smallest of the remaining ones (ties: lower index first; NaN counts as largest).
 *  2. The backbone quantizes the input with every outlier entry replaced by the mean of the
 *     non-outlier entries of its quantization group (keys: the G tokens of that channel's group;
 *     values: the G channels of that token's group; 0 if there is none), so outliers do not
 *     stretch the groups.
 *  3. D = the backbone dequantized as a reader does it (stored f16 scale and zero, fp32).
 *  4. Residual R = X - D, with R = 0 at outlier positions; per head a T x D matrix R_h.
 *  5. Per head (keys and values separately), subspace (power) iteration in fp64 with L = 3
 *     iterations from a pseudo-random start B0 (D x r row-major, each entry (u >> 11) * 2^-52 - 1
 *     for successive splitmix64 outputs u; the state is s = 0x4745415200000000 ("GEAR") then
 *     s = next(s) ^ layer, s = next(s) ^ first_pos, s = next(s) ^ (2 h + (0 keys, 1 values)),
 *     next() advancing s and returning the output; so encoding is reproducible):
 *        for l in 0..L-1 { A = R_h B; orthonormalize the columns of A (modified Gram-Schmidt,
 *                          two passes; a column whose norm collapses becomes zero); B = R_h^T A }
 *     A is rounded to f16 (A^; fp64 -> fp32 -> f16, as is B), then B is recomputed as the
 *     least-squares factor for the stored A^ (B = R_h^T A^ (A^^T A^)^-1 over A^'s non-zero
 *     columns, a Cholesky solve of the r x r Gram matrix), then rounded to f16. L is a writer
 *     choice and not needed by a reader, so the header does not carry it (the codec parameters'
 *     power_iters is ignored: the writer always uses 3). If any stored A or B value of a head
 *     would be non-finite (e.g. a residual beyond the f16 range), both factors of that head are
 *     stored as zeros: the head then decodes to backbone + outliers.
 *  6. The sparse entries hold the exact inputs, as f16 (inputs are fp16 numbers in the cache). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvstore/bytes.h"
#include "kvstore/codec.h"
#include "kvstore/half.h"
#include "kvstore/quant.h"

#define GEAR_POWER_ITERS 3

typedef struct gear_dims {
    size_t T, H, D, G, r, ks, vs;
    size_t k_row, v_row, nk, nv;  /* KIVI: bytes per key / value code row, groups per row */
} gear_dims;

static gear_dims dims_of(const kv_block_desc *d)
{
    gear_dims m;
    m.T = d->n_tokens;
    m.H = (size_t)d->n_kv_heads;
    m.D = (size_t)d->head_dim;
    m.G = (size_t)d->k_group;
    m.r = (size_t)d->rank;
    m.ks = (size_t)d->k_sparse;
    m.vs = (size_t)d->v_sparse;
    m.k_row = m.T * (size_t)d->k_bits / 8;
    m.v_row = m.D * (size_t)d->v_bits / 8;
    m.nk = m.T / (size_t)d->k_group;
    m.nv = m.D / (size_t)d->v_group;
    return m;
}

static int gear_check(const kv_block_desc *d, strata_error *err)
{
    int rc = kv_kivi_check_backbone(d, (1u << 2) | (1u << 4), "gear", err);
    if (rc)
        return rc;
    if (d->k_bits != d->v_bits)
        return strata_fail(err, STRATA_EFORMAT, "gear block with K/V bits %d/%d (k_bits and v_bits must be equal)",
                           d->k_bits, d->v_bits);
    if (d->k_group != d->v_group)
        return strata_fail(err, STRATA_EFORMAT, "gear block with key group %d and value group %d (must be equal)",
                           d->k_group, d->v_group);
    uint64_t max_rank = d->n_tokens < (uint32_t)d->head_dim ? d->n_tokens : (uint64_t)d->head_dim;
    if (d->rank < 0 || d->rank > 255 || (uint64_t)d->rank > max_rank)
        return strata_fail(err, STRATA_EFORMAT, "gear rank %d out of range 0..%llu (min of %u tokens and head_dim %d)",
                           d->rank, (unsigned long long)(max_rank < 255 ? max_rank : 255), (unsigned)d->n_tokens,
                           d->head_dim);
    if (d->k_sparse < 0 || d->k_sparse % 2 || (uint64_t)d->k_sparse > d->n_tokens)
        return strata_fail(err, STRATA_EFORMAT,
                           "gear k_sparse (outliers per key vector) %d must be even and at most the %u tokens",
                           d->k_sparse, (unsigned)d->n_tokens);
    if (d->k_sparse > 0 && d->n_tokens > 65536u)
        return strata_fail(err, STRATA_EFORMAT,
                           "gear k_sparse %d with %u tokens: token indices must fit 16 bits (at most 65536 tokens)",
                           d->k_sparse, (unsigned)d->n_tokens);
    if (d->v_sparse < 0 || d->v_sparse % 2 || d->v_sparse > d->head_dim)
        return strata_fail(err, STRATA_EFORMAT,
                           "gear v_sparse (outliers per value vector) %d must be even and at most head_dim %d",
                           d->v_sparse, d->head_dim);
    if (d->ott_tokens)
        return strata_fail(err, STRATA_EFORMAT, "gear block with ott_tokens %d (must be 0)", d->ott_tokens);
    return STRATA_OK;
}

static int gear_sections(const kv_block_desc *d, kv_section_spec *out)
{
    const uint64_t T = d->n_tokens, H = (uint64_t)d->n_kv_heads, D = (uint64_t)d->head_dim;
    const uint64_t r = (uint64_t)d->rank;
    int n = kv_kivi_sections(d, out);
    if (d->k_sparse > 0)
        out[n++] = (kv_section_spec){KV_SEC_GEAR_K_SPARSE, H * D * (uint64_t)d->k_sparse * 4u};
    if (d->v_sparse > 0)
        out[n++] = (kv_section_spec){KV_SEC_GEAR_V_SPARSE, T * H * (uint64_t)d->v_sparse * 4u};
    if (r > 0) {
        out[n++] = (kv_section_spec){KV_SEC_GEAR_K_LOWRANK, H * (T + D) * r * 2u};
        out[n++] = (kv_section_spec){KV_SEC_GEAR_V_LOWRANK, H * (T + D) * r * 2u};
    }
    return n;
}

/* ---- encoding ---- */

typedef struct sel_entry {
    float x;
    uint32_t i;
} sel_entry;

/* A total order on floats: NaN above everything (all NaNs equal), -0 == +0. */
static int order(float a, float b)
{
    int an = isnan(a) != 0, bn = isnan(b) != 0;
    if (an || bn)
        return an - bn;
    return (a > b) - (a < b);
}

static int cmp_largest_first(const void *pa, const void *pb)
{
    const sel_entry *a = pa, *b = pb;
    int o = order(b->x, a->x);
    return o ? o : (a->i > b->i) - (a->i < b->i);
}

static int cmp_smallest_first(const void *pa, const void *pb)
{
    const sel_entry *a = pa, *b = pb;
    int o = order(a->x, b->x);
    return o ? o : (a->i > b->i) - (a->i < b->i);
}

/* Marks the k outliers of the n values x[i * stride] in mask[i * stride] (k even, <= n). A few
 * are found by scanning (a strictly larger / smaller value replaces the candidate, so the lower
 * index wins ties), many by sorting with the same order. */
static void select_outliers(const float *x, size_t n, size_t stride, size_t k, sel_entry *tmp, uint8_t *mask)
{
    if (k == 0)
        return;
    if (k <= 16) {
        for (int side = 0; side < 2; side++)
            for (size_t m = 0; m < k / 2; m++) {
                size_t best = n;
                for (size_t i = 0; i < n; i++) {
                    if (mask[i * stride])
                        continue;
                    if (best == n || order(x[i * stride], x[best * stride]) == (side ? -1 : 1))
                        best = i;
                }
                mask[best * stride] = 1;
            }
        return;
    }
    for (size_t i = 0; i < n; i++)
        tmp[i] = (sel_entry){x[i * stride], (uint32_t)i};
    qsort(tmp, n, sizeof *tmp, cmp_largest_first);
    for (size_t i = 0; i < k / 2; i++)
        mask[tmp[i].i * stride] = 1;
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (!mask[i * stride])
            tmp[m++] = (sel_entry){x[i * stride], (uint32_t)i};
    qsort(tmp, m, sizeof *tmp, cmp_smallest_first);
    for (size_t i = 0; i < k / 2; i++)
        mask[tmp[i].i * stride] = 1;
}

/* Replaces the marked entries of the group x[i * stride], i < n, by the mean of the others. */
static void fill_group(float *x, const uint8_t *mask, size_t n, size_t stride)
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
    float mean = kept ? (float)(sum / (double)kept) : 0.0f;
    for (size_t i = 0; i < n; i++)
        if (mask[i * stride])
            x[i * stride] = mean;
}

/* The four backbone sections dequantized exactly as kv_kivi_decode_sections does it. */
static void backbone_dequant(const kv_block_desc *d, const gear_dims *m, uint8_t *const *sec, float *k, float *v)
{
    for (size_t h = 0; h < m->H; h++)
        for (size_t c = 0; c < m->D; c++) {
            const size_t r = h * m->D + c;
            for (size_t t = 0; t < m->T; t++) {
                const uint8_t *pair = sec[1] + (r * m->nk + t / m->G) * 4;
                float s = strata_half_to_float(kv_ld16(pair)), z = strata_half_to_float(kv_ld16(pair + 2));
                k[(t * m->H + h) * m->D + c] = (float)kv_packed_code(sec[0] + r * m->k_row, t, d->k_bits) * s + z;
            }
        }
    for (size_t t = 0; t < m->T; t++)
        for (size_t h = 0; h < m->H; h++) {
            const size_t r = t * m->H + h;
            for (size_t c = 0; c < m->D; c++) {
                const uint8_t *pair = sec[3] + (r * m->nv + c / m->G) * 4;
                float s = strata_half_to_float(kv_ld16(pair)), z = strata_half_to_float(kv_ld16(pair + 2));
                v[r * m->D + c] = (float)kv_packed_code(sec[2] + r * m->v_row, c, d->v_bits) * s + z;
            }
        }
}

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Workspace of one head's low-rank fit (fp64). The factors are kept transposed (one row per
 * rank component) so that every inner loop runs over contiguous memory. */
typedef struct lr_work {
    double *R;    /* [T][D] residual */
    double *At;   /* [r][T]: column k of A is row k */
    double *Bt;   /* [r][D] */
    double *L;    /* [r][r] Gram matrix of the rounded A, then its Cholesky factor */
    double *y;    /* [r] */
    uint8_t *on;  /* [r] column in use */
    uint16_t *Ah; /* [T][r] stored halves */
    uint16_t *Bh; /* [D][r] */
} lr_work;

/* Four partial sums: the adds are independent, so this is not bound by their latency. */
static double dot64(const double *restrict a, const double *restrict b, size_t n)
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
static void axpy64(double *restrict y, double a, const double *restrict x, size_t n)
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
static void orthonormalize(double *At, size_t n, size_t r, uint8_t *on)
{
    for (size_t k = 0; k < r; k++) {
        double *a = At + k * n;
        const double n0 = sqrt(dot64(a, a, n));
        for (int pass = 0; pass < 2; pass++)
            for (size_t j = 0; j < k; j++)
                if (on[j])
                    axpy64(a, -dot64(At + j * n, a, n), At + j * n, n);
        const double nk = sqrt(dot64(a, a, n));
        on[k] = n0 > 0.0 && nk > 1e-9 * n0 && isfinite(nk);
        const double inv = on[k] ? 1.0 / nk : 0.0;
        for (size_t t = 0; t < n; t++)
            a[t] = on[k] ? a[t] * inv : 0.0;
    }
}

static int half_finite(uint16_t h) { return (h & 0x7c00u) != 0x7c00u; }

/* Fits R (w->R, T x D) ~= A B^T at rank r and writes A_h then B_h as f16 at out. */
static void lowrank_fit(lr_work *w, size_t T, size_t D, size_t r, uint64_t seed, uint8_t *out)
{
    const double *R = w->R;
    double *At = w->At, *Bt = w->Bt, *L = w->L, *y = w->y;
    for (size_t c = 0; c < D; c++)   /* B0 [D][r] row-major */
        for (size_t k = 0; k < r; k++)
            Bt[k * D + c] = (double)(splitmix64(&seed) >> 11) * 0x1p-52 - 1.0;
    for (int l = 0; l < GEAR_POWER_ITERS; l++) {
        for (size_t k = 0; k < r; k++)   /* A = R B */
            for (size_t t = 0; t < T; t++)
                At[k * T + t] = dot64(R + t * D, Bt + k * D, D);
        orthonormalize(At, T, r, w->on);
        if (l + 1 == GEAR_POWER_ITERS)
            break;   /* the last B is computed below from the rounded A */
        memset(Bt, 0, r * D * sizeof(double));   /* B = R^T A */
        for (size_t k = 0; k < r; k++)
            for (size_t t = 0; t < T; t++)
                axpy64(Bt + k * D, At[k * T + t], R + t * D, D);
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
            L[i * r + j] = dot64(At + i * T, At + j * T, T);
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
    memset(Bt, 0, r * D * sizeof(double));   /* R^T A^ */
    for (size_t k = 0; k < r; k++)
        if (w->on[k])
            for (size_t t = 0; t < T; t++)
                axpy64(Bt + k * D, At[k * T + t], R + t * D, D);
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
        finite &= half_finite(w->Ah[i]);
    for (size_t i = 0; i < D * r; i++)
        finite &= half_finite(w->Bh[i]);
    uint8_t *bo = out + 2 * T * r;
    for (size_t i = 0; i < T * r; i++)
        kv_st16(out + 2 * i, finite ? w->Ah[i] : 0);
    for (size_t i = 0; i < D * r; i++)
        kv_st16(bo + 2 * i, finite ? w->Bh[i] : 0);
}

/* The low-rank sections of one of K (kv = 0) or V (kv = 1): x the input rows, dq the dequantized
 * backbone, mask the outlier positions. */
static void lowrank_section(const kv_block_desc *d, const gear_dims *m, const float *x, const float *dq,
                            const uint8_t *mask, int kv, lr_work *w, uint8_t *sec)
{
    for (size_t h = 0; h < m->H; h++) {
        for (size_t t = 0; t < m->T; t++)
            for (size_t c = 0; c < m->D; c++) {
                const size_t o = (t * m->H + h) * m->D + c;
                w->R[t * m->D + c] = mask[o] ? 0.0 : (double)x[o] - (double)dq[o];
            }
        uint64_t seed = 0x4745415200000000ull;  /* "GEAR" */
        uint64_t mix = splitmix64(&seed);
        seed = mix ^ d->layer;
        mix = splitmix64(&seed);
        seed = mix ^ d->first_pos;
        mix = splitmix64(&seed);
        seed = mix ^ ((uint64_t)h << 1 | (uint64_t)kv);
        lowrank_fit(w, m->T, m->D, m->r, seed, sec + h * (m->T + m->D) * m->r * 2);
    }
}

/* Writes the k sparse entries of vector vec (index ascending): its element i is x[first + i * stride]. */
static void write_sparse(uint8_t *sec, size_t vec, size_t k, const float *x, const uint8_t *mask, size_t first,
                         size_t n, size_t stride)
{
    uint8_t *e = sec + vec * k * 4;
    size_t at = 0;
    for (size_t i = 0; i < n && at < k; i++) {
        const size_t o = first + i * stride;
        if (!mask[o])
            continue;
        kv_st16(e + 4 * at, (uint16_t)i);
        kv_st16(e + 4 * at + 2, strata_float_to_half(x[o]));
        at++;
    }
}

static int gear_encode(const kv_block_desc *d, const float *k, const float *v, const kv_block_extra *extra,
                       uint8_t *const *sec, strata_error *err)
{
    (void)extra;
    const gear_dims m = dims_of(d);
    if (m.ks == 0 && m.vs == 0 && m.r == 0) {
        kv_kivi_encode_sections(d, k, v, sec);
        return STRATA_OK;
    }
    const size_t elems = m.T * m.H * m.D, wide = m.T > m.D ? m.T : m.D;
    float *kk = malloc(elems * sizeof(float));
    float *vv = malloc(elems * sizeof(float));
    uint8_t *kmask = calloc(elems, 1);
    uint8_t *vmask = calloc(elems, 1);
    sel_entry *tmp = malloc(wide * sizeof(sel_entry));
    lr_work w = {0};
    if (m.r) {
        w.R = malloc(m.T * m.D * sizeof(double));
        w.At = malloc(m.T * m.r * sizeof(double));
        w.Bt = malloc(m.D * m.r * sizeof(double));
        w.L = malloc(m.r * m.r * sizeof(double));
        w.y = malloc(m.r * sizeof(double));
        w.on = malloc(m.r);
        w.Ah = malloc(m.T * m.r * sizeof(uint16_t));
        w.Bh = malloc(m.D * m.r * sizeof(uint16_t));
    }
    int rc = STRATA_OK;
    if (!kk || !vv || !kmask || !vmask || !tmp ||
        (m.r && (!w.R || !w.At || !w.Bt || !w.L || !w.y || !w.on || !w.Ah || !w.Bh))) {
        rc = strata_fail(err, STRATA_ENOMEM, "gear block: out of memory for %zu staging values", 2 * elems);
        goto out;
    }
    memcpy(kk, k, elems * sizeof(float));
    memcpy(vv, v, elems * sizeof(float));
    /* 1. outliers; 2. backbone input with outliers replaced by their group's mean */
    for (size_t h = 0; h < m.H; h++)
        for (size_t c = 0; c < m.D; c++) {
            const size_t first = h * m.D + c, stride = m.H * m.D;
            select_outliers(k + first, m.T, stride, m.ks, tmp, kmask + first);
            if (m.ks)
                for (size_t t0 = 0; t0 < m.T; t0 += m.G)
                    fill_group(kk + first + t0 * stride, kmask + first + t0 * stride, m.G, stride);
        }
    for (size_t t = 0; t < m.T; t++)
        for (size_t h = 0; h < m.H; h++) {
            const size_t first = (t * m.H + h) * m.D;
            select_outliers(v + first, m.D, 1, m.vs, tmp, vmask + first);
            if (m.vs)
                for (size_t c0 = 0; c0 < m.D; c0 += m.G)
                    fill_group(vv + first + c0, vmask + first + c0, m.G, 1);
        }
    kv_kivi_encode_sections(d, kk, vv, sec);
    int n = 4;
    /* 6. sparse sections: the exact inputs */
    if (m.ks) {
        for (size_t h = 0; h < m.H; h++)
            for (size_t c = 0; c < m.D; c++)
                write_sparse(sec[n], h * m.D + c, m.ks, k, kmask, h * m.D + c, m.T, m.H * m.D);
        n++;
    }
    if (m.vs) {
        for (size_t t = 0; t < m.T; t++)
            for (size_t h = 0; h < m.H; h++)
                write_sparse(sec[n], t * m.H + h, m.vs, v, vmask, (t * m.H + h) * m.D, m.D, 1);
        n++;
    }
    /* 3.-5. residual of the dequantized backbone, per-head low rank */
    if (m.r) {
        backbone_dequant(d, &m, sec, kk, vv);
        lowrank_section(d, &m, k, kk, kmask, 0, &w, sec[n]);
        lowrank_section(d, &m, v, vv, vmask, 1, &w, sec[n + 1]);
    }
out:
    free(kk);
    free(vv);
    free(kmask);
    free(vmask);
    free(tmp);
    free(w.R);
    free(w.At);
    free(w.Bt);
    free(w.L);
    free(w.y);
    free(w.on);
    free(w.Ah);
    free(w.Bh);
    return rc;
}

/* ---- decoding ---- */

/* Adds A_h B_h^T to every head of rows x [T][H][D]; fac is one LOWRANK section, f a
 * (T + D) * r float buffer. */
static void add_lowrank(const gear_dims *m, const uint8_t *sec, float *f, float *x)
{
    const size_t T = m->T, D = m->D, H = m->H, r = m->r;
    for (size_t h = 0; h < H; h++) {
        const uint8_t *src = sec + h * (T + D) * r * 2;
        for (size_t i = 0; i < (T + D) * r; i++)
            f[i] = strata_half_to_float(kv_ld16(src + 2 * i));
        const float *A = f, *B = f + T * r;
        for (size_t t = 0; t < T; t++)
            for (size_t c = 0; c < D; c++) {
                float s = 0.0f;
                for (size_t k = 0; k < r; k++)
                    s += A[t * r + k] * B[c * r + k];
                x[(t * H + h) * D + c] += s;
            }
    }
}

/* Overwrites the outlier positions of n_vec vectors (entries of k per vector, indices < n). The
 * element i of vector vec is x[first(vec) + i * stride]; keys (is_key): vec = h * D + c, first =
 * h * D + c, stride H * D; values: vec = t * H + h, first = vec * D, stride 1. */
static int apply_sparse(const gear_dims *m, const uint8_t *sec, int is_key, float *x, strata_error *err)
{
    const size_t k = is_key ? m->ks : m->vs, n = is_key ? m->T : m->D;
    const size_t n_vec = is_key ? m->H * m->D : m->T * m->H, stride = is_key ? m->H * m->D : 1;
    for (size_t vec = 0; vec < n_vec; vec++) {
        const uint8_t *e = sec + vec * k * 4;
        const size_t first = is_key ? vec : vec * m->D;
        for (size_t i = 0; i < k; i++) {
            const size_t idx = kv_ld16(e + 4 * i);
            if (idx >= n || (i && idx <= kv_ld16(e + 4 * (i - 1))))
                return strata_fail(err, STRATA_EFORMAT,
                                   "gear %s outlier %zu of vector %zu: index %zu out of range (< %zu) or not ascending",
                                   is_key ? "key" : "value", i, vec, idx, n);
            x[first + idx * stride] = strata_half_to_float(kv_ld16(e + 4 * i + 2));
        }
    }
    return STRATA_OK;
}

static int gear_decode(const kv_block *b, float *k, float *v, strata_error *err)
{
    int rc = kv_kivi_decode_sections(b, k, v, err);
    if (rc)
        return rc;
    const gear_dims m = dims_of(&b->desc);
    const uint8_t *ksp = kv_block_section_data(b, KV_SEC_GEAR_K_SPARSE, NULL);
    const uint8_t *vsp = kv_block_section_data(b, KV_SEC_GEAR_V_SPARSE, NULL);
    const uint8_t *klr = kv_block_section_data(b, KV_SEC_GEAR_K_LOWRANK, NULL);
    const uint8_t *vlr = kv_block_section_data(b, KV_SEC_GEAR_V_LOWRANK, NULL);
    if ((m.ks && !ksp) || (m.vs && !vsp) || (m.r && (!klr || !vlr)))
        return strata_fail(err, STRATA_EFORMAT, "gear block without its sparse or low-rank sections");
    if (m.r) {
        float *f = malloc((m.T + m.D) * m.r * sizeof(float));
        if (!f)
            return strata_fail(err, STRATA_ENOMEM, "gear decode: out of memory");
        add_lowrank(&m, klr, f, k);
        add_lowrank(&m, vlr, f, v);
        free(f);
    }
    if (m.ks && (rc = apply_sparse(&m, ksp, 1, k, err)))
        return rc;
    if (m.vs && (rc = apply_sparse(&m, vsp, 0, v, err)))
        return rc;
    return STRATA_OK;
}

const kv_codec_ops kv_codec_gear = {
    .id = KV_CODEC_GEAR,
    .name = "gear",
    .check = gear_check,
    .sections = gear_sections,
    .encode = gear_encode,
    .decode = gear_decode,
};
