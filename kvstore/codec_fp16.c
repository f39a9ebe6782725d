/* The fp16 codec: K and V as IEEE half, token-major like the tail, so that a tail written out as
 * a block (preemption) is a plain conversion and attention reads both the same way. */
#include <string.h>

#include "kvstore/bytes.h"
#include "kvstore/codec.h"
#include "kvstore/half.h"

static int fp16_check(const kv_block_desc *d, strata_error *err)
{
    if (d->k_bits != 16 || d->v_bits != 16)
        return strata_fail(err, STRATA_EFORMAT, "fp16 block with K/V bits %d/%d (must be 16/16)",
                           d->k_bits, d->v_bits);
    if (d->k_group != 0 || d->v_group != 0 || d->residual != 0)
        return strata_fail(err, STRATA_EFORMAT, "fp16 block with groups %d/%d and residual %d (must be 0)",
                           d->k_group, d->v_group, d->residual);
    return kv_check_no_extras(d, "fp16", err);
}

static int fp16_sections(const kv_block_desc *d, kv_section_spec *out)
{
    uint64_t bytes = (uint64_t)d->n_tokens * (uint64_t)d->n_kv_heads * (uint64_t)d->head_dim * 2u;
    out[0] = (kv_section_spec){KV_SEC_K_FP16, bytes};
    out[1] = (kv_section_spec){KV_SEC_V_FP16, bytes};
    return 2;
}

static int fp16_encode(const kv_block_desc *d, const float *k, const float *v, const kv_block_extra *extra,
                       uint8_t *const *sec, strata_error *err)
{
    (void)err;
    (void)extra;
    size_t n = (size_t)d->n_tokens * (size_t)d->n_kv_heads * (size_t)d->head_dim;
    for (size_t i = 0; i < n; i++) {
        kv_st16(sec[0] + 2 * i, strata_float_to_half(k[i]));
        kv_st16(sec[1] + 2 * i, strata_float_to_half(v[i]));
    }
    return STRATA_OK;
}

static int fp16_decode(const kv_block *b, float *k, float *v, strata_error *err)
{
    const uint8_t *ks = kv_block_section_data(b, KV_SEC_K_FP16, NULL);
    const uint8_t *vs = kv_block_section_data(b, KV_SEC_V_FP16, NULL);
    if (!ks || !vs)
        return strata_fail(err, STRATA_EFORMAT, "fp16 block without its K/V sections");
    size_t n = (size_t)b->desc.n_tokens * (size_t)b->desc.n_kv_heads * (size_t)b->desc.head_dim;
    for (size_t i = 0; i < n; i++) {
        k[i] = strata_half_to_float(kv_ld16(ks + 2 * i));
        v[i] = strata_half_to_float(kv_ld16(vs + 2 * i));
    }
    return STRATA_OK;
}

const kv_codec_ops kv_codec_fp16 = {
    .id = KV_CODEC_FP16,
    .name = "fp16",
    .check = fp16_check,
    .sections = fp16_sections,
    .encode = fp16_encode,
    .decode = fp16_decode,
};
