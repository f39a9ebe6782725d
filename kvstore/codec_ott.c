/* OTT (outlier-token tracing): a KIVI block whose pooled (head, token) pairs are kept in fp16.
 * The tracker (ott.h) decides which pairs of a block enter the pool; here they are taken out of
 * the quantized groups so they no longer stretch them: a pooled key row is replaced by the mean
 * of the other tokens of its key group (per channel) and a pooled value row by zeros, which
 * dequantizes to exactly 0. The OTT_TOKENS section then holds, for the block's ott_tokens
 * entries: (u16 head, u16 token) pairs sorted by token then head, the fp16 key rows, the fp16
 * value rows. With no entries the block is a KIVI block under another codec id, bit for bit. */
#include <stdlib.h>
#include <string.h>

#include "kvstore/bytes.h"
#include "kvstore/codec.h"
#include "kvstore/half.h"

static int ott_check(const kv_block_desc *d, strata_error *err)
{
    int rc = kv_kivi_check_backbone(d, (1u << 2) | (1u << 4), "ott", err);
    if (rc)
        return rc;
    if (d->rank || d->k_sparse || d->v_sparse)
        return strata_fail(err, STRATA_EFORMAT, "ott block with gear fields set (rank %d, outliers %d/%d)", d->rank,
                           d->k_sparse, d->v_sparse);
    if ((uint64_t)d->ott_tokens > (uint64_t)d->n_tokens * (uint64_t)d->n_kv_heads)
        return strata_fail(err, STRATA_EFORMAT, "ott block with %d entries for %u tokens x %d heads", d->ott_tokens,
                           (unsigned)d->n_tokens, d->n_kv_heads);
    return STRATA_OK;
}

static uint64_t ott_section_bytes(const kv_block_desc *d)
{
    return (uint64_t)d->ott_tokens * (4u + 4u * (uint64_t)d->head_dim);
}

static int ott_sections(const kv_block_desc *d, kv_section_spec *out)
{
    int n = kv_kivi_sections(d, out);
    if (d->ott_tokens > 0)
        out[n++] = (kv_section_spec){KV_SEC_OTT_TOKENS, ott_section_bytes(d)};
    return n;
}


/* Entries must name a real (head, token), in (token, head) order, each once. */
static int entries_valid(const kv_block_desc *d, const kv_ott_entry *e, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (e[i].head >= d->n_kv_heads || e[i].token >= d->n_tokens)
            return 0;
        if (i && (e[i].token < e[i - 1].token || (e[i].token == e[i - 1].token && e[i].head <= e[i - 1].head)))
            return 0;
    }
    return 1;
}

static int ott_encode(const kv_block_desc *d, const float *k, const float *v, const kv_block_extra *extra,
                      uint8_t *const *sec, strata_error *err)
{
    const size_t n = (size_t)d->ott_tokens;
    if (n == 0) {
        kv_kivi_encode_sections(d, k, v, sec);
        return STRATA_OK;
    }
    if (!extra || !extra->ott || !entries_valid(d, extra->ott, n))
        return strata_fail(err, STRATA_EINVAL, "ott block: %zu entries missing, out of range or not in (token, head) order", n);
    const size_t T = d->n_tokens, H = (size_t)d->n_kv_heads, D = (size_t)d->head_dim, G = (size_t)d->k_group;
    const size_t elems = T * H * D;
    float *kk = malloc(elems * sizeof(float));
    float *vv = malloc(elems * sizeof(float));
    unsigned char *pooled = calloc(T * H, 1);
    if (!kk || !vv || !pooled) {
        free(kk);
        free(vv);
        free(pooled);
        return strata_fail(err, STRATA_ENOMEM, "ott block: out of memory for %zu staging values", 2 * elems);
    }
    memcpy(kk, k, elems * sizeof(float));
    memcpy(vv, v, elems * sizeof(float));
    for (size_t i = 0; i < n; i++)
        pooled[(size_t)extra->ott[i].token * H + extra->ott[i].head] = 1;
    for (size_t g0 = 0; g0 < T; g0 += G)
        for (size_t h = 0; h < H; h++) {
            size_t kept = 0;
            for (size_t t = g0; t < g0 + G; t++)
                kept += !pooled[t * H + h];
            if (kept == G)
                continue;
            for (size_t c = 0; c < D; c++) {
                double sum = 0.0;
                for (size_t t = g0; t < g0 + G; t++)
                    if (!pooled[t * H + h])
                        sum += k[(t * H + h) * D + c];
                float mean = kept ? (float)(sum / (double)kept) : 0.0f;
                for (size_t t = g0; t < g0 + G; t++)
                    if (pooled[t * H + h])
                        kk[(t * H + h) * D + c] = mean;
            }
            for (size_t t = g0; t < g0 + G; t++)
                if (pooled[t * H + h])
                    memset(vv + (t * H + h) * D, 0, D * sizeof(float));
        }
    kv_kivi_encode_sections(d, kk, vv, sec);
    uint8_t *ids = sec[4], *krows = ids + 4 * n, *vrows = krows + 2 * D * n;
    for (size_t i = 0; i < n; i++) {
        const size_t h = extra->ott[i].head, t = extra->ott[i].token;
        kv_st16(ids + 4 * i, (uint16_t)h);
        kv_st16(ids + 4 * i + 2, (uint16_t)t);
        for (size_t c = 0; c < D; c++) {
            kv_st16(krows + 2 * (i * D + c), strata_float_to_half(k[(t * H + h) * D + c]));
            kv_st16(vrows + 2 * (i * D + c), strata_float_to_half(v[(t * H + h) * D + c]));
        }
    }
    free(kk);
    free(vv);
    free(pooled);
    return STRATA_OK;
}

int kv_ott_entries_check(const kv_block *b, const uint8_t *sec, strata_error *err)
{
    const kv_block_desc *d = &b->desc;
    /* The value pass of attention adds a pooled row on top of its backbone row, which only
     * counts it once if that row dequantizes to exactly 0: every (scale, zero) of it is +-0. */
    const uint8_t *vs = kv_block_section_data(b, KV_SEC_V_SCALES, NULL);
    const size_t v_groups = d->v_group > 0 ? (size_t)d->head_dim / (size_t)d->v_group : 0;
    if (d->ott_tokens > 0 && !vs)
        return strata_fail(err, STRATA_EFORMAT, "ott block without its V_SCALES section");
    for (int i = 0; i < d->ott_tokens; i++) {
        unsigned h = kv_ld16(sec + 4 * (size_t)i), t = kv_ld16(sec + 4 * (size_t)i + 2);
        if (h >= (unsigned)d->n_kv_heads || t >= d->n_tokens)
            return strata_fail(err, STRATA_EFORMAT, "ott entry %d names head %u token %u of a %d-head %u-token block",
                               i, h, t, d->n_kv_heads, (unsigned)d->n_tokens);
        if (i) {
            unsigned ph = kv_ld16(sec + 4 * (size_t)(i - 1)), pt = kv_ld16(sec + 4 * (size_t)(i - 1) + 2);
            if (t < pt || (t == pt && h <= ph))
                return strata_fail(err, STRATA_EFORMAT, "ott entry %d (head %u token %u) is out of order or repeated",
                                   i, h, t);
        }
        const uint8_t *row = vs + ((size_t)t * (size_t)d->n_kv_heads + h) * v_groups * 4;
        for (size_t g = 0; g < 2 * v_groups; g++)
            if (kv_ld16(row + 2 * g) & 0x7fffu)
                return strata_fail(err, STRATA_EFORMAT, "ott entry %d (head %u token %u): its backbone value row does "
                                   "not dequantize to 0 (group %zu's %s is not zero)", i, h, t, g / 2,
                                   g % 2 ? "zero point" : "scale");
    }
    return STRATA_OK;
}

static int ott_decode(const kv_block *b, float *k, float *v, strata_error *err)
{
    int rc = kv_kivi_decode_sections(b, k, v, err);
    if (rc || b->desc.ott_tokens == 0)
        return rc;
    const kv_block_desc *d = &b->desc;
    const uint8_t *sec = kv_block_section_data(b, KV_SEC_OTT_TOKENS, NULL);
    if (!sec)
        return strata_fail(err, STRATA_EFORMAT, "ott block without its OTT_TOKENS section");
    if ((rc = kv_ott_entries_check(b, sec, err)))
        return rc;
    const size_t n = (size_t)d->ott_tokens, H = (size_t)d->n_kv_heads, D = (size_t)d->head_dim;
    const uint8_t *krows = sec + 4 * n, *vrows = krows + 2 * D * n;
    for (size_t i = 0; i < n; i++) {
        size_t h = kv_ld16(sec + 4 * i), t = kv_ld16(sec + 4 * i + 2);
        for (size_t c = 0; c < D; c++) {
            k[(t * H + h) * D + c] = strata_half_to_float(kv_ld16(krows + 2 * (i * D + c)));
            v[(t * H + h) * D + c] = strata_half_to_float(kv_ld16(vrows + 2 * (i * D + c)));
        }
    }
    return STRATA_OK;
}

const kv_codec_ops kv_codec_ott = {
    .id = KV_CODEC_OTT,
    .name = "ott",
    .check = ott_check,
    .sections = ott_sections,
    .encode = ott_encode,
    .decode = ott_decode,
};
