/* The cache layer: codec names and validation, the block schedule of append, atomicity of a
 * failed append (pool exhausted, max_tokens), slot accounting and the statistics. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kvstore/block.h"
#include "kvstore/half.h"
#include "kvstore/kv_cache.h"
#include "kvstore/sysmem.h"
#include "test_rng.h"

static float *random_rows(size_t n_tokens, size_t row, uint64_t seed, float scale)
{
    float *x = malloc(n_tokens * row * sizeof(float));
    assert_non_null(x);
    for (size_t i = 0; i < n_tokens * row; i++)
        x[i] = rng_sym(&seed) * scale;
    return x;
}

static const kv_geometry default_geom = {2, 3, 64, 64};

static kv_codec_params codec_of(const char *name)
{
    kv_codec_params p;
    strata_error err = {0};
    assert_int_equal(kv_codec_parse(name, &p, &err), STRATA_OK);
    return p;
}

static void test_codec_names(void **state)
{
    (void)state;
    kv_codec_params p;
    strata_error err = {0};
    assert_int_equal(kv_codec_parse("fp16", &p, &err), STRATA_OK);
    assert_true(p.codec == KV_CODEC_FP16 && p.bits == 16 && p.residual == 0);
    assert_int_equal(kv_codec_parse("kivi2", &p, &err), STRATA_OK);
    assert_true(p.codec == KV_CODEC_KIVI && p.bits == 2 && p.group == 32 && p.residual == 128);
    assert_int_equal(kv_codec_parse("kivi4", &p, &err), STRATA_OK);
    assert_true(p.codec == KV_CODEC_KIVI && p.bits == 4 && p.group == 32 && p.residual == 128);
    assert_int_equal(kv_codec_parse("kivi2-g64-r32", &p, &err), STRATA_OK);
    assert_true(p.bits == 2 && p.group == 64 && p.residual == 32);
    const char *bad[] = {"kivi3", "KIVI2", "kivi2-x", "kivi2-g", "kivi", "", "fp32", "kivi4-g99999999999"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        memset(&err, 0, sizeof err);
        assert_int_equal(kv_codec_parse(bad[i], &p, &err), STRATA_EINVAL);
        assert_int_equal(err.code, STRATA_EINVAL);
        assert_non_null(strstr(err.msg, "fp16, kivi2, kivi4"));
    }
    /* A suffix given twice: which value was meant is unknown. */
    assert_int_equal(kv_codec_parse("kivi2-g64-r32-g32", &p, &err), STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "-g given twice"));
    const char *names[] = {"fp16", "kivi2", "kivi4", "kivi2-g64", "kivi4-r32", "kivi2-g64-r64"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char buf[32];
        p = codec_of(names[i]);
        kv_codec_name(&p, buf, sizeof buf);
        assert_string_equal(buf, names[i]);
    }
}

static void expect_invalid(kv_codec_params p, kv_geometry g, const char *word)
{
    strata_error err = {0};
    assert_int_equal(kv_codec_validate(&p, &g, &err), STRATA_EINVAL);
    if (!strstr(err.msg, word))
        fail_msg("message \"%s\" does not name \"%s\"", err.msg, word);
    assert_int_equal(kv_block_size(&p, &g), 0);
    assert_null(kv_pool_create(&g, &p, 4, &err));
}

static void test_codec_validate(void **state)
{
    (void)state;
    kv_geometry g = default_geom;
    kv_codec_params k2 = codec_of("kivi2"), f = codec_of("fp16");
    assert_int_equal(kv_codec_validate(&k2, &g, NULL), STRATA_OK);
    assert_int_equal(kv_codec_validate(&f, &g, NULL), STRATA_OK);
    kv_codec_params p = k2;
    p.bits = 3;
    expect_invalid(p, g, "bits");
    p = k2;
    p.bits = 8;
    expect_invalid(p, g, "bits");
    p = k2;
    p.group = 24;
    expect_invalid(p, g, "group");
    p = k2;
    p.group = 48;
    expect_invalid(p, g, "head_dim");
    p = k2;
    p.group = 0;
    expect_invalid(p, g, "group");
    kv_geometry g2 = g;
    g2.block_tokens = 48;
    expect_invalid(k2, g2, "block_tokens");
    p = k2;
    p.residual = 100;
    expect_invalid(p, g, "residual");
    p = k2;
    p.residual = -32;
    expect_invalid(p, g, "residual");
    g2 = g;
    g2.head_dim = 0;
    expect_invalid(k2, g2, "head_dim");
    g2 = g;
    g2.n_kv_heads = 0;
    expect_invalid(k2, g2, "n_kv_heads");
    g2 = g;
    g2.n_layers = 0;
    expect_invalid(k2, g2, "n_layers");
    g2 = g;
    g2.block_tokens = 0;
    expect_invalid(f, g2, "block_tokens");
    p = f;
    p.residual = 64;
    expect_invalid(p, g, "residual");
    p = f;
    p.bits = 8;
    expect_invalid(p, g, "bits");
    p = k2;
    p.codec = (kv_codec_id)7;
    expect_invalid(p, g, "codec");
    g2 = g;
    g2.block_tokens = 65536 + 64;
    expect_invalid(f, g2, "block_tokens");
    /* a G that is not the default is fine when it divides everything */
    p = codec_of("kivi4-g16-r32");
    assert_int_equal(kv_codec_validate(&p, &g, NULL), STRATA_OK);
}

static void test_block_sizes(void **state)
{
    (void)state;
    kv_geometry g = {30, 3, 64, 64};
    kv_codec_params f = codec_of("fp16"), k2 = codec_of("kivi2"), k4 = codec_of("kivi4");
    strata_error err = {0};
    kv_pool *pf = kv_pool_create(&g, &f, 2, &err), *p2 = kv_pool_create(&g, &k2, 2, &err),
            *p4 = kv_pool_create(&g, &k4, 2, &err);
    assert_non_null(pf);
    assert_non_null(p2);
    assert_non_null(p4);
    assert_int_equal(kv_pool_slot_bytes(pf), 49280);
    assert_int_equal(kv_pool_slot_bytes(p2), 9344);
    assert_int_equal(kv_pool_slot_bytes(p4), 15488);
    assert_true((double)kv_pool_slot_bytes(p2) <= 0.2 * (double)kv_pool_slot_bytes(pf));
    assert_int_equal(kv_pool_capacity(p2), 2);
    assert_int_equal(kv_pool_free(p2), 2);
    assert_int_equal(kv_pool_geometry(p2)->head_dim, 64);
    assert_int_equal(kv_pool_codec(p4)->bits, 4);
    kv_pool_destroy(pf);
    kv_pool_destroy(p2);
    kv_pool_destroy(p4);
    assert_null(kv_pool_create(&g, &k2, 0, &err));
    assert_int_equal(err.code, STRATA_EINVAL);
}

typedef struct layer_snapshot {
    size_t length, n_blocks, tail;
    const uint8_t *first_block;
    uint16_t *tail_k, *tail_v;
} layer_snapshot;

static void snap(const kv_seq *s, int layer, layer_snapshot *out)
{
    kv_layer_view v;
    kv_seq_layer_view(s, layer, &v);
    size_t row = (size_t)v.n_kv_heads * (size_t)v.head_dim;
    out->length = kv_seq_length(s, layer);
    out->n_blocks = v.n_blocks;
    out->tail = v.tail_tokens;
    out->first_block = v.n_blocks ? v.blocks[0] : NULL;
    out->tail_k = malloc((v.tail_tokens * row + 1) * 2);
    out->tail_v = malloc((v.tail_tokens * row + 1) * 2);
    assert_non_null(out->tail_k);
    assert_non_null(out->tail_v);
    memcpy(out->tail_k, v.tail_k, v.tail_tokens * row * 2);
    memcpy(out->tail_v, v.tail_v, v.tail_tokens * row * 2);
}

static void assert_unchanged(const kv_seq *s, int layer, layer_snapshot *before)
{
    layer_snapshot now;
    snap(s, layer, &now);
    assert_int_equal(now.length, before->length);
    assert_int_equal(now.n_blocks, before->n_blocks);
    assert_int_equal(now.tail, before->tail);
    assert_ptr_equal(now.first_block, before->first_block);
    size_t row = (size_t)default_geom.n_kv_heads * (size_t)default_geom.head_dim;
    assert_memory_equal(now.tail_k, before->tail_k, now.tail * row * 2);
    assert_memory_equal(now.tail_v, before->tail_v, now.tail * row * 2);
    free(now.tail_k);
    free(now.tail_v);
    free(before->tail_k);
    free(before->tail_v);
}

static void test_block_schedule(void **state)
{
    (void)state;
    const size_t row = 3 * 64;
    strata_error err = {0};
    struct { const char *codec; size_t at; size_t blocks, tail; } steps[] = {
        {"kivi2", 191, 0, 191}, {"kivi2", 192, 1, 128}, {"kivi2", 255, 1, 191}, {"kivi2", 256, 2, 128},
        {"kivi4", 1000, 13, 168}, {"fp16", 63, 0, 63}, {"fp16", 64, 1, 0}, {"fp16", 1000, 15, 40},
        {"kivi2-r0", 64, 1, 0}, {"kivi2-r0", 100, 1, 36},
    };
    for (size_t i = 0; i < sizeof steps / sizeof steps[0]; i++) {
        kv_codec_params p = codec_of(steps[i].codec);
        kv_pool *pool = kv_pool_create(&default_geom, &p, 64, &err);
        assert_non_null(pool);
        kv_seq *s = kv_seq_create(pool, 4096, &err);
        assert_non_null(s);
        float *k = random_rows(steps[i].at, row, i, 3.0f), *v = random_rows(steps[i].at, row, 99 + i, 1.0f);
        assert_int_equal(kv_seq_append(s, 1, k, v, steps[i].at, &err), STRATA_OK);
        kv_layer_view view;
        kv_seq_layer_view(s, 1, &view);
        assert_int_equal(view.n_blocks, steps[i].blocks);
        assert_int_equal(view.tail_tokens, steps[i].tail);
        assert_int_equal(view.layer, 1);
        assert_int_equal(view.block_tokens, 64);
        assert_int_equal(kv_seq_length(s, 1), steps[i].at);
        assert_int_equal(kv_seq_length(s, 0), 0);
        assert_int_equal(kv_pool_free(pool), 64 - steps[i].blocks);
        /* the tail holds the newest tokens, as fp16 */
        for (size_t t = 0; t < view.tail_tokens; t++)
            for (size_t c = 0; c < row; c++) {
                size_t src = (steps[i].at - view.tail_tokens + t) * row + c;
                assert_int_equal(view.tail_k[t * row + c], strata_float_to_half(k[src]));
                assert_int_equal(view.tail_v[t * row + c], strata_float_to_half(v[src]));
            }
        /* each block holds its positions, verifies, and decodes near the fp16-rounded input */
        float dk[64 * 3 * 64], dv[64 * 3 * 64];
        for (size_t b = 0; b < view.n_blocks; b++) {
            kv_block pb;
            assert_int_equal(kv_block_verify(view.blocks[b], view.block_bytes, &pb, &err), STRATA_OK);
            assert_int_equal(pb.desc.layer, 1);
            assert_true(pb.desc.first_pos == b * 64);
            assert_int_equal(pb.desc.n_tokens, 64);
            assert_int_equal(pb.desc.residual, p.residual);
            assert_int_equal(kv_block_decode(&pb, dk, dv, &err), STRATA_OK);
            double tol_k = p.codec == KV_CODEC_FP16 ? 0 : 6.0 / ((1 << p.bits) - 1) / 2 * 1.01;
            double tol_v = p.codec == KV_CODEC_FP16 ? 0 : 2.0 / ((1 << p.bits) - 1) / 2 * 1.01;
            for (size_t j = 0; j < 64 * row; j++) {
                size_t src = b * 64 * row + j;
                assert_true(fabs(dk[j] - strata_round_half(k[src])) <= tol_k);
                assert_true(fabs(dv[j] - strata_round_half(v[src])) <= tol_v);
            }
        }
        free(k);
        free(v);
        kv_seq_destroy(s);
        assert_int_equal(kv_pool_free(pool), 64);
        kv_pool_destroy(pool);
    }
}

/* However the tokens are split into calls, the blocks and the tail come out byte-identical. */
static void test_append_chunking_invariant(void **state)
{
    (void)state;
    const size_t row = 3 * 64, n = 700;
    const char *codecs[] = {"kivi2", "kivi4", "fp16"};
    for (int ci = 0; ci < 3; ci++) {
        kv_codec_params p = codec_of(codecs[ci]);
        strata_error err = {0};
        kv_pool *pool = kv_pool_create(&default_geom, &p, 64, &err);
        assert_non_null(pool);
        kv_seq *a = kv_seq_create(pool, n, &err), *b = kv_seq_create(pool, n, &err);
        assert_non_null(a);
        assert_non_null(b);
        float *k = random_rows(n, row, 5, 2.0f), *v = random_rows(n, row, 6, 2.0f);
        for (size_t t = 0; t < n; t++) {
            assert_int_equal(kv_seq_append(a, 0, k + t * row, v + t * row, 1, &err), STRATA_OK);
            kv_layer_view tv;   /* the tail rule the coordinator's statistics use */
            kv_seq_layer_view(a, 0, &tv);
            assert_int_equal(tv.tail_tokens, kv_tail_tokens(&p, default_geom.block_tokens, t + 1));
        }
        const size_t chunks[] = {1, 37, 200, 62, 0, 129, 271};
        size_t at = 0;
        for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
            assert_int_equal(kv_seq_append(b, 0, k + at * row, v + at * row, chunks[c], &err), STRATA_OK);
            at += chunks[c];
        }
        assert_int_equal(at, n);
        kv_layer_view va, vb;
        kv_seq_layer_view(a, 0, &va);
        kv_seq_layer_view(b, 0, &vb);
        assert_int_equal(va.n_blocks, vb.n_blocks);
        assert_int_equal(va.tail_tokens, vb.tail_tokens);
        for (size_t i = 0; i < va.n_blocks; i++)
            assert_memory_equal(va.blocks[i], vb.blocks[i], va.block_bytes);
        assert_memory_equal(va.tail_k, vb.tail_k, va.tail_tokens * row * 2);
        assert_memory_equal(va.tail_v, vb.tail_v, va.tail_tokens * row * 2);
        /* at max_tokens, one more token is refused */
        layer_snapshot before;
        snap(a, 0, &before);
        assert_int_equal(kv_seq_append(a, 0, k, v, 1, &err), STRATA_EINVAL);
        assert_non_null(strstr(err.msg, "max_tokens"));
        assert_unchanged(a, 0, &before);
        free(k);
        free(v);
        kv_seq_destroy(a);
        kv_seq_destroy(b);
        assert_int_equal(kv_pool_free(pool), 64);
        kv_pool_destroy(pool);
    }
}

static void test_pool_exhaustion(void **state)
{
    (void)state;
    const size_t row = 3 * 64;
    kv_codec_params p = codec_of("kivi2");
    strata_error err = {0};
    kv_pool *pool = kv_pool_create(&default_geom, &p, 5, &err);
    assert_non_null(pool);
    kv_seq *s1 = kv_seq_create(pool, 10000, &err), *s2 = kv_seq_create(pool, 10000, &err);
    assert_non_null(s1);
    assert_non_null(s2);
    assert_true(kv_seq_id(s1) != kv_seq_id(s2));
    kv_seq_set_id(s2, 4242);
    float *k = random_rows(2000, row, 1, 1.0f), *v = random_rows(2000, row, 2, 1.0f);

    /* s1 takes 3 blocks (128 + 3*64 + 10 tokens) */
    assert_int_equal(kv_seq_append(s1, 0, k, v, 330, &err), STRATA_OK);
    assert_int_equal(kv_pool_free(pool), 2);
    /* s2 layer 1 wants 3 blocks at once: refused whole, nothing kept */
    assert_int_equal(kv_seq_append(s2, 1, k, v, 100, &err), STRATA_OK);
    layer_snapshot before;
    snap(s2, 1, &before);
    memset(&err, 0, sizeof err);
    assert_int_equal(kv_seq_append(s2, 1, k + 100 * row, v + 100 * row, 220, &err), STRATA_EFULL);
    assert_int_equal(err.code, STRATA_EFULL);
    printf("  EFULL message: %s\n", err.msg);
    assert_non_null(strstr(err.msg, "exhausted"));
    assert_non_null(strstr(err.msg, "sequence 4242"));
    assert_non_null(strstr(err.msg, "layer 1"));
    assert_non_null(strstr(err.msg, "needs 3"));
    assert_non_null(strstr(err.msg, "2 of its 5 slots"));
    assert_unchanged(s2, 1, &before);
    assert_int_equal(kv_pool_free(pool), 2);
    /* a fitting append still works afterwards and continues the same stream */
    assert_int_equal(kv_seq_append(s2, 1, k + 100 * row, v + 100 * row, 156, &err), STRATA_OK);
    assert_int_equal(kv_seq_length(s2, 1), 256);
    assert_int_equal(kv_pool_free(pool), 0);
    /* token by token until the pool is exhausted: the token that needs a block is refused */
    size_t len = kv_seq_length(s1, 0);
    int rc = STRATA_OK;
    while (rc == STRATA_OK && len < 2000) {
        snap(s1, 0, &before);
        rc = kv_seq_append(s1, 0, k + len * row, v + len * row, 1, &err);
        if (rc == STRATA_OK) {
            len++;
            free(before.tail_k);
            free(before.tail_v);
        }
    }
    assert_int_equal(rc, STRATA_EFULL);
    assert_int_equal(len, 128 + 3 * 64 + 63);
    assert_unchanged(s1, 0, &before);
    kv_seq_destroy(s2);
    assert_int_equal(kv_pool_free(pool), 2);
    kv_seq_destroy(s1);
    assert_int_equal(kv_pool_free(pool), 5);
    kv_pool_destroy(pool);
    free(k);
    free(v);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    kv_codec_params p = codec_of("kivi4");
    strata_error err = {0};
    kv_pool *pool = kv_pool_create(&default_geom, &p, 4, &err);
    assert_non_null(pool);
    assert_null(kv_seq_create(pool, 0, &err));
    assert_null(kv_seq_create(NULL, 10, &err));
    kv_seq *s = kv_seq_create(pool, 10, &err);   /* shorter than R + block: the tail is 10 tokens */
    assert_non_null(s);
    float row[3 * 64] = {0};
    assert_int_equal(kv_seq_append(s, 2, row, row, 1, &err), STRATA_EINVAL);
    assert_int_equal(kv_seq_append(s, -1, row, row, 1, &err), STRATA_EINVAL);
    assert_int_equal(kv_seq_append(s, 0, NULL, row, 1, &err), STRATA_EINVAL);
    assert_int_equal(kv_seq_append(s, 0, row, row, 0, &err), STRATA_OK);
    for (int i = 0; i < 10; i++)
        assert_int_equal(kv_seq_append(s, 0, row, row, 1, &err), STRATA_OK);
    assert_int_equal(kv_seq_append(s, 0, row, row, 1, &err), STRATA_EINVAL);
    assert_int_equal(kv_seq_length(s, 0), 10);
    assert_int_equal(kv_seq_length(s, 5), 0);
    kv_layer_view v;
    kv_seq_layer_view(s, 9, &v);
    assert_int_equal(v.n_blocks + v.tail_tokens, 0);
    kv_seq_destroy(s);
    kv_seq_destroy(NULL);
    kv_pool_destroy(pool);
    kv_pool_destroy(NULL);
    /* A pool larger than the machine's memory is refused up front. */
    size_t slot = kv_block_size(&p, &default_geom);
    assert_null(kv_pool_create(&default_geom, &p, strata_memory_limit() / slot + 1, &err));
    assert_int_equal(err.code, STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "kv pool"));
    assert_non_null(strstr(err.msg, "more than this machine lets the process have"));
}

static void test_stats(void **state)
{
    (void)state;
    const size_t row = 3 * 64;
    const char *codecs[] = {"kivi2", "kivi4", "fp16"};
    const size_t slot[] = {9344, 15488, 49280};
    for (int ci = 0; ci < 3; ci++) {
        kv_codec_params p = codec_of(codecs[ci]);
        strata_error err = {0};
        kv_pool *pool = kv_pool_create(&default_geom, &p, 100, &err);
        kv_seq *s = kv_seq_create(pool, 5000, &err);
        assert_non_null(s);
        float *k = random_rows(1000, row, 3, 1.0f);
        assert_int_equal(kv_seq_append(s, 0, k, k, 1000, &err), STRATA_OK);
        assert_int_equal(kv_seq_append(s, 1, k, k, 300, &err), STRATA_OK);
        kv_seq_stats st;
        kv_seq_get_stats(s, &st);
        /* kivi: layer 0 (1000-128)/64 = 13 blocks + 168 tail, layer 1 (300-128)/64 = 2 + 172;
         * fp16: 15 + 40 and 4 + 44 */
        size_t b0 = p.residual ? 13 : 15, b1 = p.residual ? 2 : 4;
        assert_int_equal(st.tokens, 1300);
        assert_int_equal(st.blocks, b0 + b1);
        assert_int_equal(st.block_tokens, (b0 + b1) * 64);
        assert_int_equal(st.tail_tokens, 1300 - (b0 + b1) * 64);
        assert_int_equal(st.block_bytes, (b0 + b1) * slot[ci]);
        assert_int_equal(st.tail_bytes, st.tail_tokens * row * 2 * 2);
        double per_token = (double)(st.block_bytes + st.tail_bytes) / (double)st.tokens;
        double block_per_token = (double)st.block_bytes / (double)st.block_tokens;
        printf("  %s: %.1f bytes/token overall, %.1f bytes/token in blocks (fp16 would be %d)\n", codecs[ci],
               per_token, block_per_token, 3 * 64 * 2 * 2);
        assert_true(fabs(block_per_token - (double)slot[ci] / 64) < 1e-9);
        free(k);
        kv_seq_destroy(s);
        kv_pool_destroy(pool);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_codec_names),
        cmocka_unit_test(test_codec_validate),
        cmocka_unit_test(test_block_sizes),
        cmocka_unit_test(test_block_schedule),
        cmocka_unit_test(test_append_chunking_invariant),
        cmocka_unit_test(test_pool_exhaustion),
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_stats),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
