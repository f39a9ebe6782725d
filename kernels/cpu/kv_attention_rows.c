/* Attention of many query rows over a compressed layer at once (a prompt chunk continuing a
 * sequence; CPU path).
 *
 * Unlike decode, where one query row makes dequantizing a block cost as much as using it (so the
 * decode kernel never dequantizes more than a row), here every dequantized position serves
 * every row of the chunk. So the view is decoded span by span (SPAN_BLOCKS blocks, or a piece of
 * the fp16 tail) into fp32 K/V buffers of one span, and each span goes through BLAS: scores
 * S = scale * Q K^T and the update O += P V per query head and tile of rows, with an online
 * softmax across spans (running max and sum per row and head, fp32 accumulators rescaled when
 * the max grows, the sums in fp64). Memory stays one span and one score tile whatever the
 * context. Positions past a row's sight get weight 0; positions no row sees are not read. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <cblas.h>

#include "kernels/cpu/kv_attention_impl.h"
#include "kernels/kv_attention.h"
#include "kvstore/block.h"

enum {
    SPAN_BLOCKS = 16,   /* blocks decoded at once: 1024 positions at the default block size */
    ROW_TILE = 128,     /* query rows per score tile */
};

typedef struct rows_plan {
    size_t span;                              /* positions per span */
    size_t k, v, scores, max, sum, blocks;    /* byte offsets */
    size_t total;
} rows_plan;


static void plan_rows(const kv_layer_view *v, int n_q_heads, size_t n_rows, rows_plan *p)
{
    const size_t nq = n_q_heads > 0 ? (size_t)n_q_heads : 1;
    const size_t kvd = kv_attn_mul_sat(v->n_kv_heads > 0 ? (size_t)v->n_kv_heads : 1, v->head_dim > 0 ? (size_t)v->head_dim : 1);
    const size_t bt = v->block_tokens > 0 ? (size_t)v->block_tokens : 1;
    const size_t rows = n_rows ? n_rows : 1, tile = rows < ROW_TILE ? rows : ROW_TILE;
    p->span = kv_attn_mul_sat(SPAN_BLOCKS, bt);
    p->k = 0;
    p->v = kv_attn_align64(kv_attn_mul_sat(kv_attn_mul_sat(p->span, kvd), sizeof(float)));
    p->scores = kv_attn_add_sat(p->v, p->v);
    p->max = kv_attn_add_sat(p->scores, kv_attn_align64(kv_attn_mul_sat(kv_attn_mul_sat(tile, p->span), sizeof(float))));
    p->sum = kv_attn_add_sat(p->max, kv_attn_align64(kv_attn_mul_sat(kv_attn_mul_sat(rows, nq), sizeof(float))));
    p->blocks = kv_attn_add_sat(p->sum, kv_attn_align64(kv_attn_mul_sat(kv_attn_mul_sat(rows, nq), sizeof(double))));
    p->total = kv_attn_add_sat(p->blocks, kv_attn_align64(kv_attn_mul_sat(v->n_blocks, sizeof(kv_block))));
    if (p->v == SIZE_MAX || p->total >= SIZE_MAX - 64)
        p->total = SIZE_MAX;
}

size_t kern_kv_attention_rows_scratch(const kv_layer_view *view, int n_q_heads, size_t n_rows)
{
    if (!view)
        return 0;
    rows_plan p;
    plan_rows(view, n_q_heads, n_rows, &p);
    if (n_rows > 1)
        return p.total;
    /* one row that sees every position is the decode kernel's case (kern_kv_attention) */
    const size_t one = kern_kv_attention_scratch(view, n_q_heads);
    return one > p.total ? one : p.total;
}

typedef struct rows_job {
    const float *q;
    float *out;
    size_t n_rows, nq, qpk, D, kvd, visible0;
    float scale;
    float *k, *v, *scores, *max;   /* span K/V [span][kvd]; score tile; running max [row][head] */
    double *sum;                   /* running softmax sum [row][head] */
} rows_job;

/* Positions of the span starting at p0 (len of them) that row r sees. */
static size_t seen_in_span(const rows_job *j, size_t r, size_t p0, size_t len)
{
    const size_t sees = j->visible0 + r;
    return sees <= p0 ? 0 : (sees - p0 < len ? sees - p0 : len);
}

/* Folds one decoded span (positions p0..p0+len) into every row's running softmax. */
static void fold_span(rows_job *j, size_t p0, size_t len)
{
    const size_t qs = j->nq * j->D;
    for (size_t h = 0; h < j->nq; h++) {
        const size_t kvh_off = (h / j->qpk) * j->D;
        for (size_t r0 = 0; r0 < j->n_rows; r0 += ROW_TILE) {
            const size_t rows = j->n_rows - r0 < ROW_TILE ? j->n_rows - r0 : ROW_TILE;
            const size_t width = seen_in_span(j, r0 + rows - 1, p0, len);   /* the tile's widest row */
            if (width == 0)
                continue;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)rows, (int)width, (int)j->D, j->scale,
                        j->q + r0 * qs + h * j->D, (int)qs, j->k + kvh_off, (int)j->kvd, 0.0f, j->scores, (int)width);
            for (size_t t = 0; t < rows; t++) {
                float *s = j->scores + t * width;
                const size_t c = seen_in_span(j, r0 + t, p0, len), at = (r0 + t) * j->nq + h;
                if (c == 0) {
                    memset(s, 0, width * sizeof *s);
                    continue;
                }
                float m = j->max[at];
                for (size_t i = 0; i < c; i++)
                    m = s[i] > m ? s[i] : m;
                double add = 0.0;
                for (size_t i = 0; i < c; i++) {
                    s[i] = expf(s[i] - m);
                    add += s[i];
                }
                memset(s + c, 0, (width - c) * sizeof *s);
                /* the first span a row sees: its max was -inf and its accumulator 0 */
                const float rescale = j->max[at] == -INFINITY ? 0.0f : expf(j->max[at] - m);
                if (rescale != 1.0f) {
                    float *o = j->out + at * j->D;
                    for (size_t d = 0; d < j->D; d++)
                        o[d] *= rescale;
                }
                j->sum[at] = j->sum[at] * (double)rescale + add;
                j->max[at] = m;
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, (int)j->D, (int)width, 1.0f, j->scores,
                        (int)width, j->v + kvh_off, (int)j->kvd, 1.0f, j->out + r0 * qs + h * j->D, (int)qs);
        }
    }
}

int kern_kv_attention_rows(const kv_layer_view *view, const float *q, size_t n_rows, int n_q_heads,
                           size_t visible0, float *out, void *scratch, strata_error *err)
{
    int rc = kv_attn_check_args(view, q, n_q_heads, out, scratch, err);
    if (rc)
        return rc;
    rows_plan plan;
    plan_rows(view, n_q_heads, n_rows, &plan);
    const size_t bt = view->block_tokens > 0 ? (size_t)view->block_tokens : 0;
    const size_t tail_pos = view->n_blocks * bt, positions = tail_pos + view->tail_tokens;
    if (plan.total == SIZE_MAX || (bt && tail_pos / bt != view->n_blocks) || positions < tail_pos ||
        n_rows > SIZE_MAX / (size_t)n_q_heads)
        return strata_fail(err, STRATA_EINVAL, "attention: view too large");
    if (positions == 0)
        return strata_fail(err, STRATA_EINVAL, "attention: layer %d holds no tokens", view->layer);
    if (n_rows == 0 || visible0 == 0 || visible0 > positions || n_rows - 1 > positions - visible0)
        return strata_fail(err, STRATA_EINVAL,
                           "attention: %zu rows seeing %zu positions and more do not fit layer %d's %zu positions",
                           n_rows, visible0, view->layer, positions);
    if (n_rows == 1 && visible0 == positions)
        return kern_kv_attention(view, q, n_q_heads, out, scratch, err);

    uint8_t *base = scratch;
    rows_job j = {
        .q = q,
        .out = out,
        .n_rows = n_rows,
        .nq = (size_t)n_q_heads,
        .qpk = (size_t)(n_q_heads / view->n_kv_heads),
        .D = (size_t)view->head_dim,
        .kvd = (size_t)view->n_kv_heads * (size_t)view->head_dim,
        .visible0 = visible0,
        .scale = (float)(1.0 / sqrt((double)view->head_dim)),
        .k = (float *)(void *)(base + plan.k),
        .v = (float *)(void *)(base + plan.v),
        .scores = (float *)(void *)(base + plan.scores),
        .max = (float *)(void *)(base + plan.max),
        .sum = (double *)(void *)(base + plan.sum),
    };
    kv_block *blocks = (kv_block *)(void *)(base + plan.blocks);
    for (size_t i = 0; i < view->n_blocks; i++) {
        rc = kv_attn_parse_block(view, i, &blocks[i], err);
        if (rc)
            return rc;
    }
    const size_t cells = n_rows * j.nq;
    memset(out, 0, cells * j.D * sizeof *out);
    memset(j.sum, 0, cells * sizeof *j.sum);
    for (size_t i = 0; i < cells; i++)
        j.max[i] = -INFINITY;

    const size_t limit = visible0 + n_rows - 1;   /* positions the last row sees */
    for (size_t p0 = 0; p0 < limit;) {
        size_t len;
        if (p0 < tail_pos) {
            const size_t first = p0 / bt, nb = view->n_blocks - first < SPAN_BLOCKS ? view->n_blocks - first : SPAN_BLOCKS;
            len = nb * bt;
            for (size_t b = 0; b < nb && b * bt < limit - p0; b++) {
                rc = kv_block_decode(&blocks[first + b], j.k + b * bt * j.kvd, j.v + b * bt * j.kvd, err);
                if (rc) {
                    if (err)
                        strata_error_prefix(err, "attention: layer %d block %zu", view->layer, first + b);
                    return rc;
                }
            }
        } else {
            const size_t at = p0 - tail_pos, left = view->tail_tokens - at;
            len = left < plan.span ? left : plan.span;
            const size_t used = len < limit - p0 ? len : limit - p0;
            kv_attn_halves_to_f32(view->tail_k + at * j.kvd, used * j.kvd, j.k);
            kv_attn_halves_to_f32(view->tail_v + at * j.kvd, used * j.kvd, j.v);
        }
        fold_span(&j, p0, len);
        p0 += len;
    }
    for (size_t i = 0; i < cells; i++) {
        const float inv = (float)(1.0 / j.sum[i]);
        for (size_t d = 0; d < j.D; d++)
            out[i * j.D + d] *= inv;
    }
    return STRATA_OK;
}
