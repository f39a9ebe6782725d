/* Decode attention over a compressed layer (CPU reference path).
 *
 * Pass 1 writes every position's score, block by block then the tail, into one row per query
 * head; pass 2 is one max-subtracted softmax per row; pass 3 accumulates the values. Packed codes
 * are unpacked one row at a time (a key channel or a value token) into a small buffer and used by
 * all query heads that share the KV head, so nothing bigger than a row is ever dequantized.
 *
 * KIVI keys use the fused form: for a key group g (k_group tokens) of channel c with stored
 * (s, z), q.k_j = sum_c (q_c s_gc) code_jc + sum_c q_c z_gc, the second term once per group.
 * Values fold p_j into the token's group parameters: p_j v_jc = (p_j s) code_jc + p_j z, and the
 * p_j z terms are summed per channel group before being added to each channel of the group.
 * Per-block partial sums are fp32; sums across blocks and the softmax normalizer are fp64. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cpu/kv_attention_impl.h"
#include "kernels/kv_attention.h"
#include "kvstore/block.h"
#include "kvstore/bytes.h"
#include "kvstore/half.h"
#include "kvstore/quant.h"

/* GCC's __builtin_cpu_supports knows "f16c"; older clang does not, and gets the portable path. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define KV_ATTN_HAVE_F16C 1
#endif

typedef struct scratch_plan {
    size_t positions;
    size_t scores, acc, sums, part, groups, row, blocks;  /* byte offsets */
    size_t total;
} scratch_plan;


/* n little-endian fp16 numbers at src (any alignment) to fp32. */
static void halves_sw(const uint8_t *src, size_t n, float *dst)
{
    for (size_t c = 0; c < n; c++)
        dst[c] = strata_half_to_float(kv_ld16(src + 2 * c));
}

#ifdef KV_ATTN_HAVE_F16C
/* x86 is little-endian, so block bytes are already fp16 in memory order; the conversion is
 * exact either way, this path is only faster. */
__attribute__((target("avx,f16c"))) static void halves_f16c(const uint8_t *src, size_t n, float *dst)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(src + 2 * i))));
    halves_sw(src + 2 * i, n - i, dst + i);
}
#endif

void kv_attn_halves_to_f32(const uint16_t *src, size_t n, float *dst)
{
#ifdef KV_ATTN_HAVE_F16C
    if (__builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c")) {
        halves_f16c((const uint8_t *)src, n, dst);   /* x86: uint16 arrays are little-endian in memory */
        return;
    }
#endif
    for (size_t i = 0; i < n; i++)
        dst[i] = strata_half_to_float(src[i]);
}


static void plan_scratch(const kv_layer_view *v, int n_q_heads, scratch_plan *p)
{
    size_t nq = n_q_heads > 0 ? (size_t)n_q_heads : 1;
    size_t nkv = v->n_kv_heads > 0 ? (size_t)v->n_kv_heads : 1;
    size_t qpk = nq / nkv ? nq / nkv : 1;
    size_t D = v->head_dim > 0 ? (size_t)v->head_dim : 1;
    size_t bt = v->block_tokens > 0 ? (size_t)v->block_tokens : 1;
    size_t wide = bt > D ? bt : D;
    p->positions = kv_attn_add_sat(kv_attn_mul_sat(v->n_blocks, bt), v->tail_tokens);
    p->scores = 0;
    p->acc = kv_attn_align64(kv_attn_mul_sat(kv_attn_mul_sat(nq, p->positions), sizeof(float)));
    p->sums = kv_attn_add_sat(p->acc, kv_attn_align64(kv_attn_mul_sat(kv_attn_mul_sat(nq, D), sizeof(double))));
    p->part = kv_attn_add_sat(p->sums, kv_attn_align64(kv_attn_mul_sat(nq, sizeof(double))));
    p->groups = kv_attn_add_sat(p->part, kv_attn_align64(kv_attn_mul_sat(kv_attn_mul_sat(qpk, wide), sizeof(float))));
    p->row = kv_attn_add_sat(p->groups, kv_attn_align64(kv_attn_mul_sat(kv_attn_mul_sat(qpk, wide), sizeof(float))));
    p->blocks = kv_attn_add_sat(p->row, kv_attn_align64(kv_attn_mul_sat(wide, sizeof(float))));
    p->total = kv_attn_add_sat(p->blocks, kv_attn_align64(kv_attn_mul_sat(v->n_blocks, sizeof(kv_block))));
    if (p->acc == SIZE_MAX || p->total >= SIZE_MAX - 64)
        p->total = SIZE_MAX;
}

size_t kern_kv_attention_scratch(const kv_layer_view *view, int n_q_heads)
{
    if (!view)
        return 0;
    scratch_plan p;
    plan_scratch(view, n_q_heads, &p);
    return p.total;
}

void kv_attn_kivi_scores(attn_ctx *a, const kv_block *b, size_t pos)
{
    const kv_block_desc *d = &b->desc;
    const uint8_t *kc = kv_block_section_data(b, KV_SEC_K_CODES, NULL);
    const uint8_t *ks = kv_block_section_data(b, KV_SEC_K_SCALES, NULL);
    const size_t T = d->n_tokens, D = a->D, kg = (size_t)d->k_group, ng = T / kg;
    const size_t row_bytes = T * (size_t)d->k_bits / 8;
    for (size_t kvh = 0; kvh < a->nkv; kvh++) {
        const size_t h0 = kvh * a->qpk;
        for (size_t i = 0; i < a->qpk; i++) {
            memset(a->scores + (h0 + i) * a->T + pos, 0, T * sizeof(float));
            memset(a->groups + i * ng, 0, ng * sizeof(float));
        }
        for (size_t c = 0; c < D; c++) {
            const size_t r = kvh * D + c;
            kv_unpack_codes_f32(kc + r * row_bytes, T, d->k_bits, a->row);
            const uint8_t *pairs = ks + r * ng * 4;
            for (size_t g = 0; g < ng; g++) {
                const float s = strata_half_to_float(kv_ld16(pairs + 4 * g));
                const float z = strata_half_to_float(kv_ld16(pairs + 4 * g + 2));
                for (size_t i = 0; i < a->qpk; i++) {
                    const float qc = a->q[(h0 + i) * D + c];
                    const float qs = qc * s;
                    float *sr = a->scores + (h0 + i) * a->T + pos + g * kg;
                    const float *code = a->row + g * kg;
                    a->groups[i * ng + g] += qc * z;
                    kv_attn_axpy(sr, qs, code, kg);
                }
            }
        }
        for (size_t i = 0; i < a->qpk; i++) {
            float *sr = a->scores + (h0 + i) * a->T + pos;
            for (size_t j = 0; j < T; j++)
                sr[j] = (sr[j] + a->groups[i * ng + j / kg]) * a->inv_sqrt_d;
        }
    }
}

void kv_attn_kivi_values(attn_ctx *a, const kv_block *b, size_t pos)
{
    const kv_block_desc *d = &b->desc;
    const uint8_t *vc = kv_block_section_data(b, KV_SEC_V_CODES, NULL);
    const uint8_t *vs = kv_block_section_data(b, KV_SEC_V_SCALES, NULL);
    const size_t T = d->n_tokens, D = a->D, vg = (size_t)d->v_group, ng = D / vg;
    const size_t row_bytes = D * (size_t)d->v_bits / 8;
    for (size_t kvh = 0; kvh < a->nkv; kvh++) {
        const size_t h0 = kvh * a->qpk;
        memset(a->part, 0, a->qpk * D * sizeof(float));
        memset(a->groups, 0, a->qpk * ng * sizeof(float));
        for (size_t j = 0; j < T; j++) {
            const size_t r = j * a->nkv + kvh;
            kv_unpack_codes_f32(vc + r * row_bytes, D, d->v_bits, a->row);
            const uint8_t *pairs = vs + r * ng * 4;
            for (size_t g = 0; g < ng; g++) {
                const float s = strata_half_to_float(kv_ld16(pairs + 4 * g));
                const float z = strata_half_to_float(kv_ld16(pairs + 4 * g + 2));
                for (size_t i = 0; i < a->qpk; i++) {
                    const float p = a->scores[(h0 + i) * a->T + pos + j];
                    const float ps = p * s;
                    float *acc = a->part + i * D + g * vg;
                    const float *code = a->row + g * vg;
                    a->groups[i * ng + g] += p * z;
                    kv_attn_axpy(acc, ps, code, vg);
                }
            }
        }
        for (size_t i = 0; i < a->qpk; i++)
            for (size_t c = 0; c < D; c++)
                a->acc[(h0 + i) * D + c] += (double)a->part[i * D + c] + (double)a->groups[i * ng + c / vg];
    }
}

/* fp16 rows [token][kv_head][dim], either block bytes (little-endian) or the in-memory tail. */
typedef struct half_rows {
    const uint8_t *bytes;
    const uint16_t *native;
} half_rows;

static void load_half_row(const attn_ctx *a, const half_rows *src, size_t at, size_t n, float *dst)
{
    if (src->bytes) {
        a->halves(src->bytes + 2 * at, n, dst);
    } else if (a->native_is_le_halves) {
        a->halves((const uint8_t *)(src->native + at), n, dst);
    } else {
        for (size_t c = 0; c < n; c++)
            dst[c] = strata_half_to_float(src->native[at + c]);
    }
}

static void half_scores(attn_ctx *a, const half_rows *k, size_t n_tokens, size_t pos)
{
    for (size_t j = 0; j < n_tokens; j++)
        for (size_t kvh = 0; kvh < a->nkv; kvh++) {
            load_half_row(a, k, (j * a->nkv + kvh) * a->D, a->D, a->row);
            for (size_t i = 0; i < a->qpk; i++) {
                const size_t h = kvh * a->qpk + i;
                a->scores[h * a->T + pos + j] = kv_attn_dot(a->q + h * a->D, a->row, a->D) * a->inv_sqrt_d;
            }
        }
}

static void half_values(attn_ctx *a, const half_rows *v, size_t n_tokens, size_t pos)
{
    for (size_t kvh = 0; kvh < a->nkv; kvh++) {
        memset(a->part, 0, a->qpk * a->D * sizeof(float));
        for (size_t j = 0; j < n_tokens; j++) {
            load_half_row(a, v, (j * a->nkv + kvh) * a->D, a->D, a->row);
            for (size_t i = 0; i < a->qpk; i++)
                kv_attn_axpy(a->part + i * a->D, a->scores[(kvh * a->qpk + i) * a->T + pos + j], a->row, a->D);
        }
        for (size_t i = 0; i < a->qpk; i++)
            for (size_t c = 0; c < a->D; c++)
                a->acc[(kvh * a->qpk + i) * a->D + c] += (double)a->part[i * a->D + c];
    }
}

int kv_attn_parse_block(const kv_layer_view *v, size_t i, kv_block *b, strata_error *err)
{
    int rc = kv_block_parse(v->blocks[i], v->block_bytes, b, err);
    if (rc) {
        if (err) {
            strata_error_prefix(err, "attention: layer %d block %zu", v->layer, i);
            err->code = STRATA_EFORMAT;
        }
        return STRATA_EFORMAT;
    }
    const kv_block_desc *d = &b->desc;
    if (d->n_kv_heads != v->n_kv_heads || d->head_dim != v->head_dim || d->n_tokens != (uint32_t)v->block_tokens ||
        d->layer != (uint32_t)v->layer || d->first_pos != (uint64_t)i * (uint64_t)v->block_tokens)
        return strata_fail(err, STRATA_EFORMAT,
                           "attention: layer %d block %zu holds layer %u positions from %llu, %u tokens of %d x %d; "
                           "expected layer %d from %llu, %d tokens of %d x %d",
                           v->layer, i, (unsigned)d->layer, (unsigned long long)d->first_pos, (unsigned)d->n_tokens,
                           d->n_kv_heads, d->head_dim, v->layer,
                           (unsigned long long)i * (unsigned long long)v->block_tokens, v->block_tokens,
                           v->n_kv_heads, v->head_dim);
    return STRATA_OK;
}

/* One block's share of the score pass (values == false) or the value pass. */
static int block_pass(attn_ctx *a, const kv_block *b, size_t pos, bool values, strata_error *err)
{
    int rc = STRATA_OK;
    switch (b->desc.codec) {
    case KV_CODEC_FP16: {
        half_rows rows = {kv_block_section_data(b, values ? KV_SEC_V_FP16 : KV_SEC_K_FP16, NULL), NULL};
        if (values)
            half_values(a, &rows, b->desc.n_tokens, pos);
        else
            half_scores(a, &rows, b->desc.n_tokens, pos);
        return STRATA_OK;
    }
    case KV_CODEC_KIVI:
    case KV_CODEC_GEAR:
    case KV_CODEC_OTT:
    case KV_CODEC_TADA:
        if (values)
            kv_attn_kivi_values(a, b, pos);
        else
            kv_attn_kivi_scores(a, b, pos);
        break;
    default:
        return strata_fail(err, STRATA_EFORMAT, "attention: layer %d: block at position %zu has codec %u",
                           a->view->layer, pos, (unsigned)b->desc.codec);
    }
    if (b->desc.codec == KV_CODEC_GEAR)
        rc = values ? kv_attn_gear_values(a, b, pos, err) : kv_attn_gear_scores(a, b, pos, err);
    else if (b->desc.codec == KV_CODEC_OTT)
        rc = values ? kv_attn_ott_values(a, b, pos, err) : kv_attn_ott_scores(a, b, pos, err);
    else if (b->desc.codec == KV_CODEC_TADA)
        rc = values ? kv_attn_tada_values(a, b, pos, err) : kv_attn_tada_scores(a, b, pos, err);
    if (rc && err)
        strata_error_prefix(err, "attention: layer %d block at position %zu", a->view->layer, pos);
    return rc;
}

int kv_attn_check_args(const kv_layer_view *view, const float *q, int n_q_heads, const float *out,
                       const void *scratch, strata_error *err)
{
    if (!view || !q || !out || !scratch)
        return strata_fail(err, STRATA_EINVAL, "attention: NULL argument");
    if (((uintptr_t)scratch & 63u) != 0)
        return strata_fail(err, STRATA_EINVAL, "attention: scratch is not 64-byte aligned");
    if (view->n_kv_heads < 1 || view->head_dim < 1 || n_q_heads < 1 || n_q_heads % view->n_kv_heads)
        return strata_fail(err, STRATA_EINVAL, "attention: %d query heads over %d kv heads of dim %d",
                           n_q_heads, view->n_kv_heads, view->head_dim);
    if (view->n_blocks && (!view->blocks || view->block_tokens < 1))
        return strata_fail(err, STRATA_EINVAL, "attention: %zu blocks without a block table or block size",
                           view->n_blocks);
    if (view->tail_tokens && (!view->tail_k || !view->tail_v))
        return strata_fail(err, STRATA_EINVAL, "attention: %zu tail tokens without tail buffers", view->tail_tokens);
    return STRATA_OK;
}

int kern_kv_attention(const kv_layer_view *view, const float *q, int n_q_heads, float *out,
                      void *scratch, strata_error *err)
{
    int rc = kv_attn_check_args(view, q, n_q_heads, out, scratch, err);
    if (rc)
        return rc;
    scratch_plan plan;
    plan_scratch(view, n_q_heads, &plan);
    if (plan.total == SIZE_MAX)
        return strata_fail(err, STRATA_EINVAL, "attention: view too large");
    if (plan.positions == 0)
        return strata_fail(err, STRATA_EINVAL, "attention: layer %d holds no tokens", view->layer);

    uint8_t *base = scratch;
    attn_ctx a = {
        .view = view,
        .q = q,
        .nq = (size_t)n_q_heads,
        .nkv = (size_t)view->n_kv_heads,
        .qpk = (size_t)(n_q_heads / view->n_kv_heads),
        .D = (size_t)view->head_dim,
        .T = plan.positions,
        .inv_sqrt_d = (float)(1.0 / sqrt((double)view->head_dim)),
        .scores = (float *)(void *)(base + plan.scores),
        .acc = (double *)(void *)(base + plan.acc),
        .sums = (double *)(void *)(base + plan.sums),
        .part = (float *)(void *)(base + plan.part),
        .groups = (float *)(void *)(base + plan.groups),
        .row = (float *)(void *)(base + plan.row),
        .halves = halves_sw,
    };
#ifdef KV_ATTN_HAVE_F16C
    if (__builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c")) {
        a.halves = halves_f16c;
        a.native_is_le_halves = true;   /* x86: uint16 arrays are little-endian in memory */
    }
#endif
    const size_t bt = (size_t)view->block_tokens;

    /* Each header is parsed once; both passes read the parsed table. */
    kv_block *blocks = (kv_block *)(void *)(base + plan.blocks);
    for (size_t i = 0; i < view->n_blocks; i++) {
        rc = kv_attn_parse_block(view, i, &blocks[i], err);
        if (rc)
            return rc;
        rc = block_pass(&a, &blocks[i], i * bt, false, err);
        if (rc)
            return rc;
    }
    const size_t tail_pos = view->n_blocks * bt;
    half_rows tk = {NULL, view->tail_k}, tv = {NULL, view->tail_v};
    half_scores(&a, &tk, view->tail_tokens, tail_pos);

    memset(a.acc, 0, a.nq * a.D * sizeof(double));
    for (size_t h = 0; h < a.nq; h++) {
        float *s = a.scores + h * a.T;
        float m = -INFINITY;
        for (size_t j = 0; j < a.T; j++)
            if (s[j] > m)
                m = s[j];
        double sum = 0.0;
        for (size_t j = 0; j < a.T; j++) {
            s[j] = expf(s[j] - m);
            sum += s[j];
        }
        a.sums[h] = sum;
    }

    for (size_t i = 0; i < view->n_blocks; i++) {
        rc = block_pass(&a, &blocks[i], i * bt, true, err);
        if (rc)
            return rc;
    }
    half_values(&a, &tv, view->tail_tokens, tail_pos);

    for (size_t h = 0; h < a.nq; h++) {
        const double inv = 1.0 / a.sums[h];
        for (size_t c = 0; c < a.D; c++)
            out[h * a.D + c] = (float)(a.acc[h * a.D + c] * inv);
    }
    return STRATA_OK;
}
