/* OTT (outlier-token tracing): the codec (kvstore/codec_ott.c), the tracker (kvstore/ott.c) and
 * their attention terms, checked against KIVI and against fp64 computations written here:
 *  - N = 0 reproduces KIVI bit for bit (backbone sections and attention output);
 *  - the pool holds the N smallest-L1-key-norm tokens per head (recomputed here), pooled tokens
 *    decode exactly, and taking them out of their groups lowers the key error on keys whose
 *    outlier tokens stretch a large channel;
 *  - the fp16 rows held per head never exceed N + aux pool;
 *  - attention matches fp64 softmax attention over the decoded blocks;
 *  - a failed append (pool exhausted) leaves the tracker as it was;
 *  - malformed entries are format errors, never out-of-bounds reads. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/kv_attention.h"
#include "kvstore/block.h"
#include "kvstore/crc32c.h"
#include "kvstore/half.h"
#include "kvstore/kv_cache.h"
#include "test_rng.h"

enum { NQ = 9, NKV = 3, D = 64, BT = 64, ROW = NKV * D };

static const kv_geometry geom = {.n_layers = 1, .n_kv_heads = NKV, .head_dim = D, .block_tokens = BT};

static kv_codec_params codec_of(const char *name)
{
    kv_codec_params p;
    strata_error err = {0};
    if (kv_codec_parse(name, &p, &err) != STRATA_OK)
        fail_msg("%s", err.msg);
    return p;
}

/* Keys like RoPE'd model keys: a few large channels with a per-channel offset, and a few
 * "outlier tokens" whose keys are small everywhere (small L1 norm) and so sit far from the
 * offset of the large channels. */
static void make_rows(uint64_t seed, size_t n, float *k, float *v, const size_t *outliers, size_t n_out)
{
    uint64_t s = seed;
    for (size_t t = 0; t < n; t++)
        for (size_t h = 0; h < NKV; h++)
            for (size_t c = 0; c < D; c++) {
                double base = (c % 16 == 3) ? 12.0 + 0.5 * (double)h : 0.0;
                k[(t * NKV + h) * D + c] = (float)(base + rng_normal(&s));
                v[(t * NKV + h) * D + c] = (float)rng_normal(&s);
            }
    for (size_t i = 0; i < n_out; i++)
        for (size_t h = 0; h < NKV; h++)
            for (size_t c = 0; c < D; c++)
                k[(outliers[i] * NKV + h) * D + c] = (float)(0.01 * rng_normal(&s));
}

static kv_seq *fill(kv_pool **pool, const char *codec, const float *k, const float *v, size_t n, bool one_by_one)
{
    strata_error err = {0};
    kv_codec_params p = codec_of(codec);
    *pool = kv_pool_create(&geom, &p, 64, &err);
    assert_non_null(*pool);
    kv_seq *seq = kv_seq_create(*pool, 4096, &err);
    assert_non_null(seq);
    if (one_by_one) {
        for (size_t t = 0; t < n; t++)
            assert_int_equal(kv_seq_append(seq, 0, k + t * ROW, v + t * ROW, 1, &err), STRATA_OK);
    } else {
        assert_int_equal(kv_seq_append(seq, 0, k, v, n, &err), STRATA_OK);
    }
    return seq;
}

static void parse(const kv_layer_view *view, size_t i, kv_block *b)
{
    strata_error err = {0};
    if (kv_block_verify(view->blocks[i], view->block_bytes, b, &err) != STRATA_OK)
        fail_msg("block %zu: %s", i, err.msg);
}

static void attention(const kv_layer_view *view, const float *q, float *out)
{
    strata_error err = {0};
    size_t bytes = kern_kv_attention_scratch(view, NQ);
    void *scratch = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    assert_non_null(scratch);
    if (kern_kv_attention(view, q, NQ, out, scratch, &err) != STRATA_OK)
        fail_msg("attention: %s", err.msg);
    free(scratch);
}

static void test_n0_is_kivi_bit_for_bit(void **state)
{
    (void)state;
    const size_t n = 5 * BT + 37;
    float *k = malloc(n * ROW * sizeof(float)), *v = malloc(n * ROW * sizeof(float));
    size_t outl[] = {7, 70, 200};
    make_rows(11, n, k, v, outl, 3);
    kv_pool *pk, *po;
    kv_seq *sk = fill(&pk, "kivi2", k, v, n, true), *so = fill(&po, "ott2-n0", k, v, n, true);
    kv_layer_view vk, vo;
    kv_seq_layer_view(sk, 0, &vk);
    kv_seq_layer_view(so, 0, &vo);
    assert_int_equal(vk.n_blocks, vo.n_blocks);
    assert_true(vk.n_blocks >= 2);
    for (size_t i = 0; i < vk.n_blocks; i++) {
        kv_block a, b;
        parse(&vk, i, &a);
        parse(&vo, i, &b);
        assert_int_equal(b.desc.codec, KV_CODEC_OTT);
        assert_int_equal(b.desc.ott_tokens, 0);
        assert_int_equal(a.n_sections, 4);
        assert_int_equal(b.n_sections, 4);
        for (uint16_t id = KV_SEC_K_CODES; id <= KV_SEC_V_SCALES; id++) {
            uint32_t la, lb;
            const uint8_t *da = kv_block_section_data(&a, id, &la), *db = kv_block_section_data(&b, id, &lb);
            assert_int_equal(la, lb);
            assert_memory_equal(da, db, la);
        }
    }
    float q[NQ * D], oa[NQ * D], ob[NQ * D];
    uint64_t s = 5;
    for (size_t i = 0; i < NQ * D; i++)
        q[i] = (float)rng_normal(&s);
    attention(&vk, q, oa);
    attention(&vo, q, ob);
    assert_memory_equal(oa, ob, sizeof oa);
    kv_seq_destroy(sk);
    kv_seq_destroy(so);
    kv_pool_destroy(pk);
    kv_pool_destroy(po);
    free(k);
    free(v);
}

/* L1 norm of a head's key row, as the tracker ranks tokens. */
static double l1(const float *k, size_t t, size_t h)
{
    double s = 0;
    for (size_t c = 0; c < D; c++)
        s += fabs((double)strata_round_half(k[(t * NKV + h) * D + c]));
    return s;
}

static void test_pool_holds_smallest_norms_and_decodes_exactly(void **state)
{
    (void)state;
    const size_t n = 6 * BT + 128;   /* with R = 128: six blocks */
    float *k = malloc(n * ROW * sizeof(float)), *v = malloc(n * ROW * sizeof(float));
    size_t outl[] = {5, 90, 91, 300};
    make_rows(23, n, k, v, outl, 4);
    kv_pool *po, *pk;
    kv_seq *so = fill(&po, "ott2", k, v, n, false), *sk = fill(&pk, "kivi2", k, v, n, false);
    kv_layer_view vo, vk;
    kv_seq_layer_view(so, 0, &vo);
    kv_seq_layer_view(sk, 0, &vk);
    assert_int_equal(vo.n_blocks, 6);
    /* Which (head, position) pairs are pooled, and where. */
    bool pooled[6 * BT][NKV] = {{false}};
    size_t per_head[NKV] = {0};
    float *dk = malloc(BT * ROW * sizeof(float)), *dv = malloc(BT * ROW * sizeof(float));
    float *ck = malloc(BT * ROW * sizeof(float)), *cv = malloc(BT * ROW * sizeof(float));
    double err_ott = 0, err_kivi = 0;
    for (size_t i = 0; i < vo.n_blocks; i++) {
        kv_block b, bk;
        parse(&vo, i, &b);
        parse(&vk, i, &bk);
        uint32_t len;
        const uint8_t *sec = kv_block_section_data(&b, KV_SEC_OTT_TOKENS, &len);
        assert_int_equal(len, b.desc.ott_tokens ? (uint32_t)b.desc.ott_tokens * (4 + 4 * D) : 0);
        for (int e = 0; e < b.desc.ott_tokens; e++) {
            size_t h = (size_t)(sec[4 * e] | sec[4 * e + 1] << 8), t = (size_t)(sec[4 * e + 2] | sec[4 * e + 3] << 8);
            pooled[i * BT + t][h] = true;
            per_head[h]++;
        }
        assert_int_equal(kv_block_decode(&b, dk, dv, NULL), STRATA_OK);
        assert_int_equal(kv_block_decode(&bk, ck, cv, NULL), STRATA_OK);
        for (size_t t = 0; t < BT; t++)
            for (size_t h = 0; h < NKV; h++)
                for (size_t c = 0; c < D; c++) {
                    size_t at = (t * NKV + h) * D + c, src = ((i * BT + t) * NKV + h) * D + c;
                    double x = strata_round_half(k[src]);
                    if (pooled[i * BT + t][h]) {
                        assert_true(dk[at] == (float)x);                       /* exact */
                        assert_true(dv[at] == strata_round_half(v[src]));
                    }
                    err_ott += (dk[at] - x) * (dk[at] - x);
                    err_kivi += (ck[at] - x) * (ck[at] - x);
                }
    }
    /* The final pool of each head is the 3 smallest norms over all blocked tokens: each of them
     * must have been pooled by its block (it beat the pool of its time). */
    for (size_t h = 0; h < NKV; h++) {
        size_t order[6 * BT];
        for (size_t t = 0; t < 6 * BT; t++)
            order[t] = t;
        for (size_t a = 0; a < 3; a++)
            for (size_t b2 = a + 1; b2 < 6 * BT; b2++)
                if (l1(k, order[b2], h) < l1(k, order[a], h)) {
                    size_t tmp = order[a];
                    order[a] = order[b2];
                    order[b2] = tmp;
                }
        for (size_t a = 0; a < 3; a++)
            if (!pooled[order[a]][h])
                fail_msg("head %zu: token %zu (one of the 3 smallest key norms) was not pooled", h, order[a]);
        assert_true(per_head[h] <= 3 + 32);
    }
    print_message("      squared key error: ott2 %.4g, kivi2 %.4g\n", err_ott, err_kivi);
    if (!(err_ott < 0.9 * err_kivi))
        fail_msg("ott key error %.4g is not clearly below kivi's %.4g", err_ott, err_kivi);
    free(dk);
    free(dv);
    free(ck);
    free(cv);
    kv_seq_destroy(so);
    kv_seq_destroy(sk);
    kv_pool_destroy(po);
    kv_pool_destroy(pk);
    free(k);
    free(v);
}

static void test_aux_pool_bounds_fp16_rows(void **state)
{
    (void)state;
    /* Norms falling over time: every block beats the whole pool, so each block evicts N tokens. */
    const size_t n = 10 * BT;
    float *k = malloc(n * ROW * sizeof(float)), *v = malloc(n * ROW * sizeof(float));
    make_rows(31, n, k, v, NULL, 0);
    for (size_t t = 0; t < n; t++)
        for (size_t i = 0; i < ROW; i++)
            k[t * ROW + i] *= (float)(1.0 / (1.0 + (double)t));
    kv_pool *po;
    kv_seq *so = fill(&po, "ott2-n2-a4-r0", k, v, n, false);
    kv_layer_view vo;
    kv_seq_layer_view(so, 0, &vo);
    size_t per_head[NKV] = {0};
    for (size_t i = 0; i < vo.n_blocks; i++) {
        kv_block b;
        parse(&vo, i, &b);
        const uint8_t *sec = kv_block_section_data(&b, KV_SEC_OTT_TOKENS, NULL);
        for (int e = 0; e < b.desc.ott_tokens; e++)
            per_head[sec[4 * e] | sec[4 * e + 1] << 8]++;
    }
    for (size_t h = 0; h < NKV; h++) {
        if (per_head[h] > 2 + 4)
            fail_msg("head %zu holds %zu fp16 rows, more than pool 2 + aux 4", h, per_head[h]);
        assert_true(per_head[h] >= 2 + 4);   /* it did trace until the aux pool was full */
    }
    kv_seq_destroy(so);
    kv_pool_destroy(po);
    free(k);
    free(v);
}

/* fp64 attention over the decoded blocks and the tail: an independent reference. */
static void reference_attention(const kv_layer_view *view, const float *q, double *out)
{
    size_t T = view->n_blocks * BT + view->tail_tokens;
    double *K = malloc(T * ROW * sizeof(double)), *V = malloc(T * ROW * sizeof(double));
    float *bk = malloc(BT * ROW * sizeof(float)), *bv = malloc(BT * ROW * sizeof(float));
    for (size_t i = 0; i < view->n_blocks; i++) {
        kv_block b;
        parse(view, i, &b);
        assert_int_equal(kv_block_decode(&b, bk, bv, NULL), STRATA_OK);
        for (size_t j = 0; j < BT * ROW; j++) {
            K[i * BT * ROW + j] = bk[j];
            V[i * BT * ROW + j] = bv[j];
        }
    }
    for (size_t j = 0; j < view->tail_tokens * ROW; j++) {
        K[view->n_blocks * BT * ROW + j] = strata_half_to_float(view->tail_k[j]);
        V[view->n_blocks * BT * ROW + j] = strata_half_to_float(view->tail_v[j]);
    }
    double *p = malloc(T * sizeof(double));
    for (size_t h = 0; h < NQ; h++) {
        size_t kvh = h / (NQ / NKV);
        double m = -INFINITY, sum = 0;
        for (size_t t = 0; t < T; t++) {
            double s = 0;
            for (size_t c = 0; c < D; c++)
                s += (double)q[h * D + c] * K[(t * NKV + kvh) * D + c];
            p[t] = s / sqrt((double)D);
            m = p[t] > m ? p[t] : m;
        }
        for (size_t t = 0; t < T; t++)
            sum += (p[t] = exp(p[t] - m));
        for (size_t c = 0; c < D; c++) {
            double acc = 0;
            for (size_t t = 0; t < T; t++)
                acc += p[t] * V[(t * NKV + kvh) * D + c];
            out[h * D + c] = acc / sum;
        }
    }
    free(K);
    free(V);
    free(bk);
    free(bv);
    free(p);
}

static void test_attention_matches_reference(void **state)
{
    (void)state;
    const size_t n = 4 * BT + 150;
    float *k = malloc(n * ROW * sizeof(float)), *v = malloc(n * ROW * sizeof(float));
    size_t outl[] = {1, 2, 130, 260};
    make_rows(41, n, k, v, outl, 4);
    kv_pool *po;
    kv_seq *so = fill(&po, "ott2", k, v, n, true);
    kv_layer_view view;
    kv_seq_layer_view(so, 0, &view);
    size_t entries = 0;
    for (size_t i = 0; i < view.n_blocks; i++) {
        kv_block b;
        parse(&view, i, &b);
        entries += (size_t)b.desc.ott_tokens;
    }
    assert_true(entries > 0);
    float q[NQ * D], out[NQ * D];
    double ref[NQ * D];
    uint64_t s = 9;
    for (size_t i = 0; i < NQ * D; i++)
        q[i] = (float)(0.3 * rng_normal(&s));
    /* make the pooled tokens matter: a query aligned with an outlier token's key */
    for (size_t c = 0; c < D; c++)
        q[c] = 40.0f * k[(130 * NKV) * D + c];
    attention(&view, q, out);
    reference_attention(&view, q, ref);
    double maxd = 0, maxr = 0;
    for (size_t i = 0; i < NQ * D; i++) {
        maxd = fmax(maxd, fabs(out[i] - ref[i]));
        maxr = fmax(maxr, fabs(ref[i]));
    }
    if (maxd > 1e-5 * maxr)
        fail_msg("attention differs from the fp64 reference by %.3g (scale %.3g)", maxd, maxr);
    kv_seq_destroy(so);
    kv_pool_destroy(po);
    free(k);
    free(v);
}

static void test_failed_append_keeps_tracker(void **state)
{
    (void)state;
    const size_t n = 5 * BT;
    float *k = malloc(n * ROW * sizeof(float)), *v = malloc(n * ROW * sizeof(float));
    size_t outl[] = {3, 100, 200};
    make_rows(51, n, k, v, outl, 3);
    strata_error err = {0};
    kv_codec_params p = codec_of("ott2-r0");
    kv_pool *small = kv_pool_create(&geom, &p, 3, &err), *big = kv_pool_create(&geom, &p, 8, &err);
    kv_seq *a = kv_seq_create(small, n, &err), *b = kv_seq_create(big, n, &err);
    assert_int_equal(kv_seq_append(a, 0, k, v, 2 * BT, &err), STRATA_OK);
    assert_int_equal(kv_seq_append(b, 0, k, v, 2 * BT, &err), STRATA_OK);
    /* two more blocks do not fit the small pool: nothing of the call may be kept */
    assert_int_equal(kv_seq_append(a, 0, k + 2 * BT * ROW, v + 2 * BT * ROW, 2 * BT, &err), STRATA_EFULL);
    assert_non_null(strstr(err.msg, "exhausted"));
    assert_int_equal(kv_seq_length(a, 0), 2 * BT);
    /* one block does fit; its pool decision must be the one made without the failed call */
    assert_int_equal(kv_seq_append(a, 0, k + 2 * BT * ROW, v + 2 * BT * ROW, BT, &err), STRATA_OK);
    assert_int_equal(kv_seq_append(b, 0, k + 2 * BT * ROW, v + 2 * BT * ROW, BT, &err), STRATA_OK);
    kv_layer_view va, vb;
    kv_seq_layer_view(a, 0, &va);
    kv_seq_layer_view(b, 0, &vb);
    assert_int_equal(va.n_blocks, 3);
    for (size_t i = 0; i < 3; i++) {
        kv_block x, y;
        parse(&va, i, &x);
        parse(&vb, i, &y);
        assert_int_equal(x.block_bytes, y.block_bytes);
        assert_memory_equal(va.blocks[i], vb.blocks[i], x.block_bytes);
    }
    kv_seq_destroy(a);
    kv_seq_destroy(b);
    kv_pool_destroy(small);
    kv_pool_destroy(big);
    free(k);
    free(v);
}

static void restamp(uint8_t *b)
{
    uint32_t hb = (uint32_t)(b[6] | b[7] << 8), bb = (uint32_t)b[8] | (uint32_t)b[9] << 8 | (uint32_t)b[10] << 16 |
                                                     (uint32_t)b[11] << 24;
    uint32_t pc = kv_crc32c(0, b + hb, bb - hb);
    memcpy(b + 56, &pc, 4);
    memset(b + 60, 0, 4);
    uint32_t hc = kv_crc32c(0, b, hb);
    memcpy(b + 60, &hc, 4);
}

/* The CPU attention kernel refuses the one-block layer blk as malformed. */
static void attention_refuses(const uint8_t *blk, size_t written)
{
    kv_layer_view view = {.layer = 0, .n_kv_heads = NKV, .head_dim = D, .block_tokens = BT, .n_blocks = 1,
                          .blocks = (const uint8_t *const *)&blk, .block_bytes = written};
    float q[NQ * D] = {0}, out[NQ * D];
    void *scratch = aligned_alloc(64, (kern_kv_attention_scratch(&view, NQ) + 63) & ~(size_t)63);
    assert_non_null(scratch);
    strata_error err = {0};
    assert_int_equal(kern_kv_attention(&view, q, NQ, out, scratch, &err), STRATA_EFORMAT);
    free(scratch);
}

static void test_malformed_entries_rejected(void **state)
{
    (void)state;
    const size_t n = BT;
    float *k = malloc(n * ROW * sizeof(float)), *v = malloc(n * ROW * sizeof(float));
    size_t outl[] = {10};
    make_rows(61, n, k, v, outl, 1);
    kv_codec_params p = codec_of("ott2-r0");
    kv_block_desc d;
    kv_block_desc_init(&d, &p, &geom, 0, 0);
    kv_ott_entry e[2] = {{0, 10}, {2, 10}};
    d.ott_tokens = 2;
    kv_block_extra x = {e};
    size_t cap = kv_block_size(&p, &geom), written;
    uint8_t *blk = aligned_alloc(64, cap);
    strata_error err = {0};
    assert_int_equal(kv_block_encode_ex(&d, k, v, &x, blk, cap, &written, &err), STRATA_OK);
    /* entries out of order are refused at encode time */
    kv_ott_entry bad[2] = {{2, 10}, {0, 10}};
    x.ott = bad;
    assert_int_equal(kv_block_encode_ex(&d, k, v, &x, blk, cap, NULL, &err), STRATA_EINVAL);
    x.ott = e;
    assert_int_equal(kv_block_encode_ex(&d, k, v, &x, blk, cap, &written, &err), STRATA_OK);
    kv_block b;
    assert_int_equal(kv_block_verify(blk, written, &b, &err), STRATA_OK);
    uint8_t *sec = (uint8_t *)kv_block_section_data(&b, KV_SEC_OTT_TOKENS, NULL);
    float dk[BT * ROW], dv[BT * ROW];
    const struct { int field; uint16_t value; const char *why; } cases[] = {
        {0, 7, "head"}, {1, 64, "token"}, {3, 5, "order"}, {2, 0, "repeated"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint8_t saved[8];
        memcpy(saved, sec, 8);
        sec[2 * cases[i].field] = (uint8_t)cases[i].value;
        sec[2 * cases[i].field + 1] = (uint8_t)(cases[i].value >> 8);
        restamp(blk);
        assert_int_equal(kv_block_verify(blk, written, &b, &err), STRATA_OK);
        memset(&err, 0, sizeof err);
        if (kv_block_decode(&b, dk, dv, &err) != STRATA_EFORMAT)
            fail_msg("%s: decode accepted a bad entry", cases[i].why);
        attention_refuses(blk, written);
        memcpy(sec, saved, 8);
        restamp(blk);
    }
    /* A pooled row's backbone value must dequantize to 0 (attention adds the exact row on top of
     * it): a nonzero zero point in its value scales is refused by decode and attention alike. */
    uint8_t *vs = (uint8_t *)kv_block_section_data(&b, KV_SEC_V_SCALES, NULL);
    const size_t v_groups = (size_t)D / (size_t)b.desc.v_group;
    uint8_t *entry = vs + ((size_t)10 * NKV + 2) * v_groups * 4 + 4 * (v_groups - 1) + 2;   /* (head 2, token 10) */
    assert_int_equal(entry[0] | entry[1], 0);
    entry[1] = 0x3c;   /* zero point 1.0 */
    restamp(blk);
    assert_int_equal(kv_block_verify(blk, written, &b, &err), STRATA_OK);
    memset(&err, 0, sizeof err);
    assert_int_equal(kv_block_decode(&b, dk, dv, &err), STRATA_EFORMAT);
    assert_non_null(strstr(err.msg, "does not dequantize to 0"));
    attention_refuses(blk, written);
    free(blk);
    free(k);
    free(v);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_n0_is_kivi_bit_for_bit),
        cmocka_unit_test(test_pool_holds_smallest_norms_and_decodes_exactly),
        cmocka_unit_test(test_aux_pool_bounds_fp16_rows),
        cmocka_unit_test(test_attention_matches_reference),
        cmocka_unit_test(test_failed_append_keeps_tracker),
        cmocka_unit_test(test_malformed_entries_rejected),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
