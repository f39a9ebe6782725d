/* OTT corrections: a pooled (head, token) pair is attended with its fp16 key and value. The
 * backbone's placeholder score is overwritten (each token counts once) and its placeholder value
 * row dequantizes to exactly 0, so the value pass only adds p_j times the fp16 row. */
#include "kernels/cpu/kv_attention_impl.h"
#include "kvstore/bytes.h"
#include "kvstore/codec.h"

static const uint8_t *ott_section(const kv_block *b, strata_error *err)
{
    const uint8_t *sec = kv_block_section_data(b, KV_SEC_OTT_TOKENS, NULL);
    if (!sec) {
        strata_fail(err, STRATA_EFORMAT, "ott block without its OTT_TOKENS section");
        return NULL;
    }
    if (kv_ott_entries_check(b, sec, err) != STRATA_OK)
        return NULL;
    return sec;
}

int kv_attn_ott_scores(attn_ctx *a, const kv_block *b, size_t pos, strata_error *err)
{
    const size_t n = (size_t)b->desc.ott_tokens, D = a->D;
    if (n == 0)
        return STRATA_OK;
    const uint8_t *sec = ott_section(b, err);
    if (!sec)
        return STRATA_EFORMAT;
    const uint8_t *krows = sec + 4 * n;
    for (size_t i = 0; i < n; i++) {
        const size_t kvh = kv_ld16(sec + 4 * i), t = kv_ld16(sec + 4 * i + 2);
        a->halves(krows + 2 * i * D, D, a->row);
        for (size_t qi = 0; qi < a->qpk; qi++) {
            const size_t h = kvh * a->qpk + qi;
            a->scores[h * a->T + pos + t] = kv_attn_dot(a->q + h * D, a->row, D) * a->inv_sqrt_d;
        }
    }
    return STRATA_OK;
}

int kv_attn_ott_values(attn_ctx *a, const kv_block *b, size_t pos, strata_error *err)
{
    const size_t n = (size_t)b->desc.ott_tokens, D = a->D;
    if (n == 0)
        return STRATA_OK;
    const uint8_t *sec = ott_section(b, err);
    if (!sec)
        return STRATA_EFORMAT;
    const uint8_t *vrows = sec + 4 * n + 2 * D * n;
    for (size_t i = 0; i < n; i++) {
        const size_t kvh = kv_ld16(sec + 4 * i), t = kv_ld16(sec + 4 * i + 2);
        a->halves(vrows + 2 * i * D, D, a->row);
        for (size_t qi = 0; qi < a->qpk; qi++) {
            const size_t h = kvh * a->qpk + qi;
            const double p = a->scores[h * a->T + pos + t];
            for (size_t c = 0; c < D; c++)
                a->acc[h * D + c] += p * (double)a->row[c];
        }
    }
    return STRATA_OK;
}
