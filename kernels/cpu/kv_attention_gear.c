/* GEAR corrections (kvstore/codec_gear.c has the format), run after the KIVI backbone pass of
 * the same block. A block decodes to X' = backbone + A_h B_h^T with the outliers overwriting
 * their positions; attention uses that without materializing X':
 *   scores: for each query head of KV head h, t = B_h^T q (r values) and score_j += (A_h[j] . t)
 *           / sqrt(D); then per key outlier (h, c, token j, value x): score_j += q_c (x - recon_jc)
 *           / sqrt(D), recon_jc = backbone(j, c) + A_h[j] . B_h[c] being what the first two
 *           terms contributed for that element.
 *   values: u = A_h^T p (r values), acc[c] += B_h[c] . u; per value outlier (token j, h, channel
 *           c, value x): acc[c] += p_j (x - recon_jc).
 * Scratch: part holds t or u ([qpk][r], r <= min(bt, D)), row one converted factor row (r). */
#include "kernels/cpu/kv_attention_impl.h"
#include "kvstore/bytes.h"
#include "kvstore/codec.h"
#include "kvstore/half.h"
#include "kvstore/quant.h"

typedef struct gear_view {
    size_t T, H, D, r, ks, vs;
    const uint8_t *kc, *kq, *vc, *vq;  /* backbone codes and (scale, zero) pairs */
    const uint8_t *ksp, *vsp, *klr, *vlr;
} gear_view;

static int gear_view_of(const kv_block *b, gear_view *g, strata_error *err)
{
    const kv_block_desc *d = &b->desc;
    g->T = d->n_tokens;
    g->H = (size_t)d->n_kv_heads;
    g->D = (size_t)d->head_dim;
    g->r = (size_t)d->rank;
    g->ks = (size_t)d->k_sparse;
    g->vs = (size_t)d->v_sparse;
    g->kc = kv_block_section_data(b, KV_SEC_K_CODES, NULL);
    g->kq = kv_block_section_data(b, KV_SEC_K_SCALES, NULL);
    g->vc = kv_block_section_data(b, KV_SEC_V_CODES, NULL);
    g->vq = kv_block_section_data(b, KV_SEC_V_SCALES, NULL);
    g->ksp = kv_block_section_data(b, KV_SEC_GEAR_K_SPARSE, NULL);
    g->vsp = kv_block_section_data(b, KV_SEC_GEAR_V_SPARSE, NULL);
    g->klr = kv_block_section_data(b, KV_SEC_GEAR_K_LOWRANK, NULL);
    g->vlr = kv_block_section_data(b, KV_SEC_GEAR_V_LOWRANK, NULL);
    if (!g->kc || !g->kq || !g->vc || !g->vq || (g->ks && !g->ksp) || (g->vs && !g->vsp) ||
        (g->r && (!g->klr || !g->vlr)))
        return strata_fail(err, STRATA_EFORMAT, "gear block without its quantized, sparse or low-rank sections");
    return STRATA_OK;
}

/* A_h[t] . B_h[c] from the f16 factors of one LOWRANK section. */
static float lowrank_at(const gear_view *g, const uint8_t *lr, size_t h, size_t t, size_t c)
{
    if (!g->r)
        return 0.0f;
    const uint8_t *A = lr + h * (g->T + g->D) * g->r * 2, *B = A + g->T * g->r * 2;
    float s = 0.0f;
    for (size_t k = 0; k < g->r; k++)
        s += strata_half_to_float(kv_ld16(A + 2 * (t * g->r + k))) * strata_half_to_float(kv_ld16(B + 2 * (c * g->r + k)));
    return s;
}

/* Checks entry i of a sparse vector (index < n, above the previous one); returns the index. */
static int sparse_index(const uint8_t *e, size_t i, size_t n, const char *what, size_t vec, size_t *idx,
                        strata_error *err)
{
    *idx = kv_ld16(e + 4 * i);
    if (*idx >= n || (i && *idx <= kv_ld16(e + 4 * (i - 1))))
        return strata_fail(err, STRATA_EFORMAT,
                           "gear %s outlier %zu of vector %zu: index %zu out of range (< %zu) or not ascending", what,
                           i, vec, *idx, n);
    return STRATA_OK;
}

int kv_attn_gear_scores(attn_ctx *a, const kv_block *b, size_t pos, strata_error *err)
{
    gear_view g;
    int rc = gear_view_of(b, &g, err);
    if (rc)
        return rc;
    const size_t T = g.T, D = a->D, r = g.r, qpk = a->qpk;
    if (r) {
        for (size_t kvh = 0; kvh < a->nkv; kvh++) {
            const size_t h0 = kvh * qpk;
            const uint8_t *A = g.klr + kvh * (T + D) * r * 2, *B = A + T * r * 2;
            for (size_t i = 0; i < qpk * r; i++)
                a->part[i] = 0.0f;
            for (size_t c = 0; c < D; c++) {  /* t_i = B^T q_i */
                a->halves(B + 2 * c * r, r, a->row);
                for (size_t i = 0; i < qpk; i++)
                    kv_attn_axpy(a->part + i * r, a->q[(h0 + i) * D + c], a->row, r);
            }
            for (size_t j = 0; j < T; j++) {
                a->halves(A + 2 * j * r, r, a->row);
                for (size_t i = 0; i < qpk; i++)
                    a->scores[(h0 + i) * a->T + pos + j] += kv_attn_dot(a->row, a->part + i * r, r) * a->inv_sqrt_d;
            }
        }
    }
    if (g.ks) {
        const int bits = b->desc.k_bits;
        const size_t kg = (size_t)b->desc.k_group, nk = T / kg, row_bytes = T * (size_t)bits / 8;
        for (size_t kvh = 0; kvh < a->nkv; kvh++)
            for (size_t c = 0; c < D; c++) {
                const size_t vec = kvh * D + c;
                const uint8_t *e = g.ksp + vec * g.ks * 4;
                for (size_t n = 0; n < g.ks; n++) {
                    size_t j;
                    if ((rc = sparse_index(e, n, T, "key", vec, &j, err)))
                        return rc;
                    const uint8_t *pair = g.kq + (vec * nk + j / kg) * 4;
                    const float s = strata_half_to_float(kv_ld16(pair)), z = strata_half_to_float(kv_ld16(pair + 2));
                    const float base = (float)kv_packed_code(g.kc + vec * row_bytes, j, bits) * s + z;
                    const float recon = base + lowrank_at(&g, g.klr, kvh, j, c);
                    const float delta = strata_half_to_float(kv_ld16(e + 4 * n + 2)) - recon;
                    for (size_t i = 0; i < qpk; i++) {
                        const size_t h = kvh * qpk + i;
                        a->scores[h * a->T + pos + j] += a->q[h * D + c] * delta * a->inv_sqrt_d;
                    }
                }
            }
    }
    return STRATA_OK;
}

int kv_attn_gear_values(attn_ctx *a, const kv_block *b, size_t pos, strata_error *err)
{
    gear_view g;
    int rc = gear_view_of(b, &g, err);
    if (rc)
        return rc;
    const size_t T = g.T, D = a->D, r = g.r, qpk = a->qpk;
    if (r) {
        for (size_t kvh = 0; kvh < a->nkv; kvh++) {
            const size_t h0 = kvh * qpk;
            const uint8_t *A = g.vlr + kvh * (T + D) * r * 2, *B = A + T * r * 2;
            for (size_t i = 0; i < qpk * r; i++)
                a->part[i] = 0.0f;
            for (size_t j = 0; j < T; j++) {  /* u_i = A^T p_i */
                a->halves(A + 2 * j * r, r, a->row);
                for (size_t i = 0; i < qpk; i++)
                    kv_attn_axpy(a->part + i * r, a->scores[(h0 + i) * a->T + pos + j], a->row, r);
            }
            for (size_t c = 0; c < D; c++) {
                a->halves(B + 2 * c * r, r, a->row);
                for (size_t i = 0; i < qpk; i++)
                    a->acc[(h0 + i) * D + c] += (double)kv_attn_dot(a->row, a->part + i * r, r);
            }
        }
    }
    if (g.vs) {
        const int bits = b->desc.v_bits;
        const size_t vg = (size_t)b->desc.v_group, nv = D / vg, row_bytes = D * (size_t)bits / 8;
        for (size_t j = 0; j < T; j++)
            for (size_t kvh = 0; kvh < a->nkv; kvh++) {
                const size_t vec = j * a->nkv + kvh;
                const uint8_t *e = g.vsp + vec * g.vs * 4;
                for (size_t n = 0; n < g.vs; n++) {
                    size_t c;
                    if ((rc = sparse_index(e, n, D, "value", vec, &c, err)))
                        return rc;
                    const uint8_t *pair = g.vq + (vec * nv + c / vg) * 4;
                    const float s = strata_half_to_float(kv_ld16(pair)), z = strata_half_to_float(kv_ld16(pair + 2));
                    const float base = (float)kv_packed_code(g.vc + vec * row_bytes, c, bits) * s + z;
                    const float recon = base + lowrank_at(&g, g.vlr, kvh, j, c);
                    const double delta = (double)(strata_half_to_float(kv_ld16(e + 4 * n + 2)) - recon);
                    for (size_t i = 0; i < qpk; i++) {
                        const size_t h = kvh * qpk + i;
                        a->acc[h * D + c] += (double)a->scores[h * a->T + pos + j] * delta;
                    }
                }
            }
    }
    return STRATA_OK;
}
