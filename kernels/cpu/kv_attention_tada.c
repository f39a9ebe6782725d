/* TaDA corrections: the backbone pass has attended the quantized deviations, so what is left is
 * the per-token fp16 mean, shared by all KV heads (and so by every query head):
 *   scores  q_h . k'_j = q_h . deq(dev)_j + q_h . m_j     (the second term added here, scaled)
 *   values  sum_j p_j v'_j = sum_j p_j deq(dev)_j + sum_j p_j m_j
 * Each mean row is converted once and used by all query heads; nothing bigger than a row is
 * dequantized. The value term is accumulated straight into the fp64 accumulator. */
#include "kernels/cpu/kv_attention_impl.h"
#include "kvstore/codec.h"

static const uint8_t *mean_section(const kv_block *b, uint16_t id, strata_error *err)
{
    uint32_t len = 0;
    const uint8_t *sec = kv_block_section_data(b, id, &len);
    if (!sec || (uint64_t)len != (uint64_t)b->desc.n_tokens * (uint64_t)b->desc.head_dim * 2u) {
        strata_fail(err, STRATA_EFORMAT, "tada block without a whole %s section", kv_section_name(id));
        return NULL;
    }
    return sec;
}

int kv_attn_tada_scores(attn_ctx *a, const kv_block *b, size_t pos, strata_error *err)
{
    const uint8_t *sec = mean_section(b, KV_SEC_TADA_K_MEAN, err);
    if (!sec)
        return STRATA_EFORMAT;
    const size_t T = b->desc.n_tokens, D = a->D;
    for (size_t j = 0; j < T; j++) {
        a->halves(sec + 2 * j * D, D, a->row);
        float *s = a->scores + pos + j;
        for (size_t h = 0; h < a->nq; h++)
            s[h * a->T] += kv_attn_dot(a->q + h * D, a->row, D) * a->inv_sqrt_d;
    }
    return STRATA_OK;
}

int kv_attn_tada_values(attn_ctx *a, const kv_block *b, size_t pos, strata_error *err)
{
    const uint8_t *sec = mean_section(b, KV_SEC_TADA_V_MEAN, err);
    if (!sec)
        return STRATA_EFORMAT;
    const size_t T = b->desc.n_tokens, D = a->D;
    for (size_t j = 0; j < T; j++) {
        a->halves(sec + 2 * j * D, D, a->row);
        for (size_t h = 0; h < a->nq; h++) {
            const double p = a->scores[h * a->T + pos + j];
            double *acc = a->acc + h * D;
            for (size_t c = 0; c < D; c++)
                acc[c] += p * (double)a->row[c];
        }
    }
    return STRATA_OK;
}
