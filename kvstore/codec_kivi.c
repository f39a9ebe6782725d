/* KIVI: keys quantized per channel (a group is k_group consecutive tokens of one channel),
 * values per token (a group is v_group consecutive channels of one token), asymmetric min-max
 * at k_bits / v_bits. Section layouts (docs/format.md):
 *   K_CODES  [head][channel] rows of n_tokens codes      K_SCALES [head][channel][token group]
 *   V_CODES  [token][head]   rows of head_dim codes      V_SCALES [token][head][channel group]
 * each (scale, zero) entry being two fp16 numbers, scale first. GEAR, OTT and TaDA reuse these
 * four sections as their backbone (the kv_kivi_* functions of codec.h). */
#include "kvstore/bytes.h"
#include "kvstore/codec.h"
#include "kvstore/half.h"
#include "kvstore/quant.h"

int kv_check_no_extras(const kv_block_desc *d, const char *name, strata_error *err)
{
    if (d->rank || d->k_sparse || d->v_sparse || d->ott_tokens)
        return strata_fail(err, STRATA_EFORMAT,
                           "%s block with gear/ott fields set (rank %d, outliers %d/%d, ott entries %d; must be 0)",
                           name, d->rank, d->k_sparse, d->v_sparse, d->ott_tokens);
    return STRATA_OK;
}

int kv_kivi_check_backbone(const kv_block_desc *d, unsigned allowed_bits, const char *name, strata_error *err)
{
    bool k_ok = d->k_bits >= 1 && d->k_bits <= 8 && (allowed_bits >> d->k_bits & 1u);
    bool v_ok = d->v_bits >= 1 && d->v_bits <= 8 && (allowed_bits >> d->v_bits & 1u);
    if (!k_ok || !v_ok)
        return strata_fail(err, STRATA_EFORMAT, "%s block with K/V bits %d/%d (not supported by %s)", name,
                           d->k_bits, d->v_bits, name);
    if (d->k_group < 1 || d->n_tokens % (uint32_t)d->k_group)
        return strata_fail(err, STRATA_EFORMAT, "%s key group %d does not divide the %u tokens", name,
                           d->k_group, (unsigned)d->n_tokens);
    if (d->v_group < 1 || d->head_dim % d->v_group)
        return strata_fail(err, STRATA_EFORMAT, "%s value group %d does not divide head_dim %d", name,
                           d->v_group, d->head_dim);
    if (d->n_tokens % (32u / (unsigned)d->k_bits))
        return strata_fail(err, STRATA_EFORMAT, "%s key rows of %u tokens do not fill whole 32-bit words", name,
                           (unsigned)d->n_tokens);
    if (d->head_dim % (32 / d->v_bits))
        return strata_fail(err, STRATA_EFORMAT, "%s value rows of %d channels do not fill whole 32-bit words", name,
                           d->head_dim);
    if (d->residual % d->k_group)
        return strata_fail(err, STRATA_EFORMAT, "%s residual %d is not a multiple of the key group %d", name,
                           d->residual, d->k_group);
    return STRATA_OK;
}

static int kivi_check(const kv_block_desc *d, strata_error *err)
{
    int rc = kv_kivi_check_backbone(d, (1u << 2) | (1u << 4), "kivi", err);
    return rc ? rc : kv_check_no_extras(d, "kivi", err);
}

typedef struct kivi_dims {
    size_t H, D, T;
    size_t k_row, k_groups;  /* bytes of one key row; key groups per row */
    size_t v_row, v_groups;
} kivi_dims;

static kivi_dims dims_of(const kv_block_desc *d)
{
    kivi_dims m;
    m.H = (size_t)d->n_kv_heads;
    m.D = (size_t)d->head_dim;
    m.T = d->n_tokens;
    m.k_row = m.T * (size_t)d->k_bits / 8;
    m.k_groups = m.T / (size_t)d->k_group;
    m.v_row = m.D * (size_t)d->v_bits / 8;
    m.v_groups = m.D / (size_t)d->v_group;
    return m;
}

int kv_kivi_sections(const kv_block_desc *d, kv_section_spec *out)
{
    kivi_dims m = dims_of(d);
    out[0] = (kv_section_spec){KV_SEC_K_CODES, (uint64_t)m.H * m.D * m.k_row};
    out[1] = (kv_section_spec){KV_SEC_K_SCALES, (uint64_t)m.H * m.D * m.k_groups * 4u};
    out[2] = (kv_section_spec){KV_SEC_V_CODES, (uint64_t)m.T * m.H * m.v_row};
    out[3] = (kv_section_spec){KV_SEC_V_SCALES, (uint64_t)m.T * m.H * m.v_groups * 4u};
    return 4;
}

/* Quantizes n values x[i*stride] in groups of g, writing the (scale, zero) pairs at pairs and the
 * packed codes at row. Codes go straight into words: groups need not align with words. */
static void quantize_row(const float *x, size_t n, size_t stride, size_t g, int bits, uint8_t *row,
                         uint8_t *pairs)
{
    const size_t per = 32u / (unsigned)bits;
    uint32_t word = 0;
    for (size_t gi = 0; gi < n / g; gi++) {
        kv_qgroup q;
        kv_quant_fit(x + gi * g * stride, g, stride, bits, &q);
        kv_st16(pairs + 4 * gi, q.scale_h);
        kv_st16(pairs + 4 * gi + 2, q.zero_h);
        for (size_t j = 0; j < g; j++) {
            size_t i = gi * g + j;
            word |= kv_quant_code(x[i * stride], &q, bits) << ((i % per) * (size_t)bits);
            if (i % per == per - 1) {
                kv_st32(row + 4 * (i / per), word);
                word = 0;
            }
        }
    }
}

void kv_kivi_encode_sections(const kv_block_desc *d, const float *k, const float *v, uint8_t *const *sec)
{
    kivi_dims m = dims_of(d);
    for (size_t h = 0; h < m.H; h++)
        for (size_t c = 0; c < m.D; c++) {
            size_t r = h * m.D + c;
            quantize_row(k + h * m.D + c, m.T, m.H * m.D, (size_t)d->k_group, d->k_bits,
                         sec[0] + r * m.k_row, sec[1] + r * m.k_groups * 4);
        }
    for (size_t t = 0; t < m.T; t++)
        for (size_t h = 0; h < m.H; h++) {
            size_t r = t * m.H + h;
            quantize_row(v + r * m.D, m.D, 1, (size_t)d->v_group, d->v_bits, sec[2] + r * m.v_row,
                         sec[3] + r * m.v_groups * 4);
        }
}

int kv_kivi_decode_sections(const kv_block *b, float *k, float *v, strata_error *err)
{
    const kv_block_desc *d = &b->desc;
    const uint8_t *kc = kv_block_section_data(b, KV_SEC_K_CODES, NULL);
    const uint8_t *ks = kv_block_section_data(b, KV_SEC_K_SCALES, NULL);
    const uint8_t *vc = kv_block_section_data(b, KV_SEC_V_CODES, NULL);
    const uint8_t *vs = kv_block_section_data(b, KV_SEC_V_SCALES, NULL);
    if (!kc || !ks || !vc || !vs)
        return strata_fail(err, STRATA_EFORMAT, "%s block without its four quantized sections",
                           kv_codec_id_name((unsigned)d->codec));
    kivi_dims m = dims_of(d);
    size_t kg = (size_t)d->k_group, vg = (size_t)d->v_group;
    for (size_t h = 0; h < m.H; h++)
        for (size_t c = 0; c < m.D; c++) {
            size_t r = h * m.D + c;
            for (size_t t = 0; t < m.T; t++) {
                const uint8_t *pair = ks + (r * m.k_groups + t / kg) * 4;
                float s = strata_half_to_float(kv_ld16(pair)), z = strata_half_to_float(kv_ld16(pair + 2));
                k[(t * m.H + h) * m.D + c] = (float)kv_packed_code(kc + r * m.k_row, t, d->k_bits) * s + z;
            }
        }
    for (size_t t = 0; t < m.T; t++)
        for (size_t h = 0; h < m.H; h++) {
            size_t r = t * m.H + h;
            for (size_t c = 0; c < m.D; c++) {
                const uint8_t *pair = vs + (r * m.v_groups + c / vg) * 4;
                float s = strata_half_to_float(kv_ld16(pair)), z = strata_half_to_float(kv_ld16(pair + 2));
                v[r * m.D + c] = (float)kv_packed_code(vc + r * m.v_row, c, d->v_bits) * s + z;
            }
        }
    return STRATA_OK;
}

static int kivi_encode(const kv_block_desc *d, const float *k, const float *v, const kv_block_extra *extra,
                       uint8_t *const *sec, strata_error *err)
{
    (void)err;
    (void)extra;
    kv_kivi_encode_sections(d, k, v, sec);
    return STRATA_OK;
}

const kv_codec_ops kv_codec_kivi = {
    .id = KV_CODEC_KIVI,
    .name = "kivi",
    .check = kivi_check,
    .sections = kv_kivi_sections,
    .encode = kivi_encode,
    .decode = kv_kivi_decode_sections,
};
