/* TaDA (codec 5): per-token mean across the KV heads kept in fp16, and the heads' deviations
 * from it quantized on the KIVI backbone.
 *
 * Header: k_bits = v_bits = b in {2, 4, 8} (the writer sets both; the reader accepts each of K
 * and V in {2, 4, 8}, as KIVI does for its two widths); k_group = v_group = G; the KIVI
 * constraints hold (G divides n_tokens and head_dim, n_tokens a multiple of 32 / k_bits,
 * head_dim a multiple of 32 / v_bits, residual a multiple of k_group); rank, k_sparse,
 * v_sparse and ott_tokens are 0.
 *
 * Sections, in this order (T = n_tokens, H = n_kv_heads, D = head_dim):
 *   K_CODES, K_SCALES, V_CODES, V_SCALES   the KIVI sections (lengths and layouts exactly as
 *                                          for codec 2) holding the quantized DEVIATIONS
 *   TADA_K_MEAN (21)  T * D * 2 bytes      f16 m_t[c] at byte 2 * (t * D + c): token-major,
 *                                          one D-vector per token, shared by all H heads
 *   TADA_V_MEAN (22)  T * D * 2 bytes      the same for values
 * 8-bit codes pack 4 per 32-bit little-endian word, least significant byte first (the generic
 * KIVI packing at B = 8: code i is byte i of the row).
 *
 * Encoding: m_t[c] is the mean over the H heads of K[t][h][c] (summed in double), rounded once
 * to the nearest fp16 (ties to even); the deviation dev[t][h][c] = K[t][h][c] - m_t[c] (fp32,
 * against the fp16-ROUNDED mean, so the reconstruction error is the deviation's quantization
 * error alone) is quantized as KIVI quantizes keys: per channel in groups of k_group tokens.
 * Values likewise with their own mean, deviations quantized per token in groups of v_group
 * channels.
 *
 * Decoding: K'[t][h][c] = m_t[c] + deq(dev)[t][h][c], deq being KIVI's q * s + z of the
 * deviation's group (computed in at least fp32); the same for V. When all heads of a token
 * agree (or H = 1) and the values are fp16 numbers, the deviations are exactly 0 and the
 * reconstruction is exact. */
#include <math.h>
#include <stdlib.h>

#include "kvstore/bytes.h"
#include "kvstore/codec.h"
#include "kvstore/half.h"
#include "kvstore/quant_math.h"

static int tada_check(const kv_block_desc *d, strata_error *err)
{
    int rc = kv_kivi_check_backbone(d, (1u << 2) | (1u << 4) | (1u << 8), "tada", err);
    return rc ? rc : kv_check_no_extras(d, "tada", err);
}

static uint64_t mean_bytes(const kv_block_desc *d)
{
    return (uint64_t)d->n_tokens * (uint64_t)d->head_dim * 2u;
}

static int tada_sections(const kv_block_desc *d, kv_section_spec *out)
{
    int n = kv_kivi_sections(d, out);
    out[n++] = (kv_section_spec){KV_SEC_TADA_K_MEAN, mean_bytes(d)};
    out[n++] = (kv_section_spec){KV_SEC_TADA_V_MEAN, mean_bytes(d)};
    return n;
}

/* Splits rows x [T][H][D] into the fp16 per-token mean (stored at sec: kv_tada_mean_half) and the
 * deviations dev. */
static void center(const float *x, size_t T, size_t H, size_t D, uint8_t *sec, float *dev)
{
    for (size_t t = 0; t < T; t++)
        for (size_t c = 0; c < D; c++) {
            double sum = 0.0;
            float lo = x[t * H * D + c], hi = lo;
            for (size_t h = 0; h < H; h++) {
                const float xh = x[(t * H + h) * D + c];
                sum += xh;
                lo = xh < lo ? xh : lo;
                hi = xh > hi ? xh : hi;
            }
            const uint16_t mh = kv_tada_mean_half(sum, lo, hi, (int)H);
            const float m = strata_half_to_float(mh);
            kv_st16(sec + 2 * (t * D + c), mh);
            for (size_t h = 0; h < H; h++)
                dev[(t * H + h) * D + c] = x[(t * H + h) * D + c] - m;
        }
}

static int tada_encode(const kv_block_desc *d, const float *k, const float *v, const kv_block_extra *extra,
                       uint8_t *const *sec, strata_error *err)
{
    (void)extra;
    const size_t T = d->n_tokens, H = (size_t)d->n_kv_heads, D = (size_t)d->head_dim;
    const size_t elems = T * H * D;
    float *dk = malloc(elems * sizeof(float));
    float *dv = malloc(elems * sizeof(float));
    if (!dk || !dv) {
        free(dk);
        free(dv);
        return strata_fail(err, STRATA_ENOMEM, "tada block: out of memory for %zu staging values", 2 * elems);
    }
    center(k, T, H, D, sec[4], dk);
    center(v, T, H, D, sec[5], dv);
    kv_kivi_encode_sections(d, dk, dv, sec);
    free(dk);
    free(dv);
    return STRATA_OK;
}

static void add_mean(const uint8_t *sec, size_t T, size_t H, size_t D, float *x)
{
    for (size_t t = 0; t < T; t++)
        for (size_t c = 0; c < D; c++) {
            const float m = strata_half_to_float(kv_ld16(sec + 2 * (t * D + c)));
            for (size_t h = 0; h < H; h++)
                x[(t * H + h) * D + c] += m;
        }
}

static int tada_decode(const kv_block *b, float *k, float *v, strata_error *err)
{
    const kv_block_desc *d = &b->desc;
    const uint8_t *km = kv_block_section_data(b, KV_SEC_TADA_K_MEAN, NULL);
    const uint8_t *vm = kv_block_section_data(b, KV_SEC_TADA_V_MEAN, NULL);
    if (!km || !vm)
        return strata_fail(err, STRATA_EFORMAT, "tada block without its TADA_K_MEAN / TADA_V_MEAN sections");
    int rc = kv_kivi_decode_sections(b, k, v, err);
    if (rc)
        return rc;
    const size_t T = d->n_tokens, H = (size_t)d->n_kv_heads, D = (size_t)d->head_dim;
    add_mean(km, T, H, D, k);
    add_mean(vm, T, H, D, v);
    return STRATA_OK;
}

const kv_codec_ops kv_codec_tada = {
    .id = KV_CODEC_TADA,
    .name = "tada",
    .check = tada_check,
    .sections = tada_sections,
    .encode = tada_encode,
    .decode = tada_decode,
};
