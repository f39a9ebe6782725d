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
 *     power_iters, `-i<L>`, default 3, reaches the writers through kv_block_desc). If any stored A or B value of a head
 *     would be non-finite (e.g. a residual beyond the f16 range), both factors of that head are
 *     stored as zeros: the head then decodes to backbone + outliers.
 *  6. The sparse entries hold the exact inputs, as f16 (inputs are fp16 numbers in the cache). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvstore/bytes.h"
#include "kvstore/codec.h"
#include "kvstore/gear_math.h"
#include "kvstore/half.h"
#include "kvstore/quant.h"


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

/* The low-rank sections of one of K (kv = 0) or V (kv = 1): x the input rows, dq the dequantized
 * backbone, mask the outlier positions. */
static void lowrank_section(const kv_block_desc *d, const gear_dims *m, const float *x, const float *dq,
                            const uint8_t *mask, int kv, const gear_lr_work *w, uint8_t *sec)
{
    for (size_t h = 0; h < m->H; h++) {
        for (size_t t = 0; t < m->T; t++)
            for (size_t c = 0; c < m->D; c++) {
                const size_t o = (t * m->H + h) * m->D + c;
                w->R[t * m->D + c] = mask[o] ? 0.0 : (double)x[o] - (double)dq[o];
            }
        gear_lowrank_fit(w, m->T, m->D, m->r, d->power_iters, gear_fit_seed(d->layer, d->first_pos, h, kv),
                         sec + h * (m->T + m->D) * m->r * 2);
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
    const size_t elems = m.T * m.H * m.D;
    float *kk = malloc(elems * sizeof(float));
    float *vv = malloc(elems * sizeof(float));
    uint8_t *kmask = calloc(elems, 1);
    uint8_t *vmask = calloc(elems, 1);
    gear_lr_work w = {0};
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
    if (!kk || !vv || !kmask || !vmask ||
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
            gear_select_outliers(k + first, m.T, stride, m.ks, kmask + first);
            if (m.ks)
                for (size_t t0 = 0; t0 < m.T; t0 += m.G)
                    gear_fill_group(kk + first + t0 * stride, kmask + first + t0 * stride, m.G, stride);
        }
    for (size_t t = 0; t < m.T; t++)
        for (size_t h = 0; h < m.H; h++) {
            const size_t first = (t * m.H + h) * m.D;
            gear_select_outliers(v + first, m.D, 1, m.vs, vmask + first);
            if (m.vs)
                for (size_t c0 = 0; c0 < m.D; c0 += m.G)
                    gear_fill_group(vv + first + c0, vmask + first + c0, m.G, 1);
        }
    kv_kivi_encode_sections(d, kk, vv, sec);
    int n = 4;
    /* 6. sparse sections: the exact inputs */
    if (m.ks) {
        for (size_t h = 0; h < m.H; h++)
            for (size_t c = 0; c < m.D; c++)
                gear_write_sparse(sec[n] + (h * m.D + c) * m.ks * 4, m.ks, k, NULL, kmask, h * m.D + c, m.T,
                                  m.H * m.D);
        n++;
    }
    if (m.vs) {
        for (size_t t = 0; t < m.T; t++)
            for (size_t h = 0; h < m.H; h++)
                gear_write_sparse(sec[n] + (t * m.H + h) * m.vs * 4, m.vs, v, NULL, vmask, (t * m.H + h) * m.D,
                                  m.D, 1);
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
