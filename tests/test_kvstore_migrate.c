/* Migration images (kv_seq_export / kv_seq_import): for every codec, a sequence rebuilt in
 * another pool holds the same block bytes and the same fp16 tail, and stays equal when both are continued with the same rows (OTT's pool state travels
 * too); damaged, truncated or mismatched images are refused. Prefix images (kv_image_prefix,
 * prefix caching): a sequence started from a prefix and fed the rest of the same rows ends up
 * block for block and tail for tail the sequence that was fed all of them. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kvstore/block.h"
#include "kvstore/crc32c.h"
#include "kvstore/kv_cache.h"
#include "kvstore/plan.h"
#include "kvstore/seq_image.h"
#include "kv_seq_same.h"
#include "test_rng.h"

enum { LAYERS = 3, HEADS = 3, DIM = 64, BT = 64 };
static const kv_geometry geom = {LAYERS, HEADS, DIM, BT};

static float *rows(size_t n, uint64_t seed)
{
    float *x = malloc(n * HEADS * DIM * sizeof *x);
    assert_non_null(x);
    for (size_t i = 0; i < n * HEADS * DIM; i++)
        x[i] = (float)((double)(rng_next(&seed) >> 11) * 0x1p-52 * 4.0 - 2.0);
    return x;
}

/* Appends n tokens (as one prompt call, or token by token) to every layer. */
static void feed(kv_seq *s, size_t n, bool prompt, uint64_t seed)
{
    float *k = rows(n, seed), *v = rows(n, seed + 1);
    strata_error err = {0};
    for (int l = 0; l < LAYERS; l++) {
        if (prompt) {
            assert_int_equal(kv_seq_append(s, l, k, v, n, &err), STRATA_OK);
        } else {
            for (size_t t = 0; t < n; t++)
                assert_int_equal(kv_seq_append(s, l, k + t * HEADS * DIM, v + t * HEADS * DIM, 1, &err), STRATA_OK);
        }
    }
    free(k);
    free(v);
}

/* The image CRC (the last four bytes) recomputed after a deliberate change. */
static void recrc(uint8_t *img, size_t len)
{
    const uint32_t c = kv_crc32c(0, img, len - 4);
    for (int i = 0; i < 4; i++)
        img[len - 4 + (size_t)i] = (uint8_t)(c >> (8 * i));
}

static size_t ld32(const uint8_t *p) { return (size_t)p[0] | (size_t)p[1] << 8 | (size_t)p[2] << 16 | (size_t)p[3] << 24; }

static const char *spec_canon(const kv_codec_params *plan)
{
    static char buf[512];
    kv_plan_format(plan, LAYERS, buf, sizeof buf);
    return buf;
}

static void round_trip(const char *spec)
{
    kv_codec_params plan[LAYERS];
    strata_error err = {0};
    assert_int_equal(kv_plan_parse(spec, LAYERS, plan, &err), STRATA_OK);
    kv_pool *pa = kv_pool_create_plan(&geom, plan, 16, &err), *pb = kv_pool_create_plan(&geom, plan, 16, &err);
    assert_non_null(pa);
    assert_non_null(pb);
    kv_seq *a = kv_seq_create(pa, 1024, &err);
    assert_non_null(a);
    feed(a, 150, true, 11);    /* prompt blocks (GEAR's prompt rank) */
    feed(a, 75, false, 12);    /* decode blocks and a partly filled tail */
    uint8_t *img = NULL;
    size_t len = 0;
    assert_int_equal(kv_seq_export(a, &img, &len, &err), STRATA_OK);
    /* within the cap a receiver sets from its budget (a migration link's largest frame) */
    if (len > kv_image_max_bytes(&geom, 225, kv_pool_bytes(pa)))
        fail_msg("%s: a %zu-byte image over its bound of %llu", spec, len,
                 (unsigned long long)kv_image_max_bytes(&geom, 225, kv_pool_bytes(pa)));
    kv_seq *b = kv_seq_import(pb, 1024, img, len, &err);
    if (!b)
        fail_msg("%s: %s", spec, err.msg);
    assert_int_equal(kv_seq_length(b, 0), 225);
    assert_seqs_same(a, b);
    /* Both continue identically: the next blocks are made from the same tails. */
    feed(a, 90, false, 13);
    feed(b, 90, false, 13);
    assert_seqs_same(a, b);

    /* Damage anywhere is caught: the image CRC, then each block's own CRCs. */
    for (size_t at = 0; at < len; at += len / 7 + 1) {
        img[at] ^= 0x10;
        assert_null(kv_seq_import(pb, 1024, img, len, &err));
        img[at] ^= 0x10;
    }
    assert_null(kv_seq_import(pb, 1024, img, len - 5, &err));
    assert_null(kv_seq_import(pb, 100, img, len, &err));   /* more tokens than max_tokens */
    assert_non_null(strstr(err.msg, "at most"));
    /* Past the image CRC (recomputed after each change): a damaged block's own CRC, and a layer
     * record that does not make a sequence. */
    uint8_t *bad = malloc(len);
    assert_non_null(bad);
    memcpy(bad, img, len);
    bad[len - 40] ^= 0x01;   /* inside the last layer's tail: only the image CRC guards it */
    recrc(bad, len);
    kv_seq *c = kv_seq_import(pb, 1024, bad, len, &err);
    assert_non_null(c);
    kv_seq_destroy(c);
    memcpy(bad, img, len);
    const size_t layer0 = 24 + 4 + ld32(img + 24);   /* the head, then the plan's length and text */
    assert_memory_equal(img + 28, spec_canon(plan), ld32(img + 24));
    const size_t ott0 = ld32(img + layer0 + 16);
    bad[layer0 + 20 + ott0 + 4 + 200] ^= 0x01;   /* layer 0's first block, in its payload */
    recrc(bad, len);
    assert_null(kv_seq_import(pb, 1024, bad, len, &err));
    assert_int_equal(err.code, STRATA_ECRC);
    memcpy(bad, img, len);
    bad[7] = 0x80;           /* a flag this reader does not know */
    recrc(bad, len);
    assert_null(kv_seq_import(pb, 1024, bad, len, &err));
    assert_int_equal(err.code, STRATA_EFORMAT);
    memcpy(bad, img, len);
    bad[layer0 + 8] = 0xff;  /* layer 0's prompt_end beyond its tokens */
    recrc(bad, len);
    assert_null(kv_seq_import(pb, 1024, bad, len, &err));
    assert_int_equal(err.code, STRATA_EINVAL);
    free(bad);
    /* A block damaged in the pool does not travel: the export checks every block. */
    kv_layer_view view;
    kv_seq_layer_view(a, 1, &view);
    uint8_t *victim = (uint8_t *)(uintptr_t)view.blocks[0];
    victim[200] ^= 0x01;
    uint8_t *img2 = NULL;
    size_t len2 = 0;
    assert_int_equal(kv_seq_export(a, &img2, &len2, &err), STRATA_ECRC);
    assert_null(img2);
    assert_non_null(strstr(err.msg, "layer 1 block 0"));
    victim[200] ^= 0x01;
    kv_seq_destroy(a);
    kv_seq_destroy(b);
    /* A pool of another geometry refuses the image. */
    kv_geometry other = geom;
    other.block_tokens = 32;
    kv_pool *pc = kv_pool_create_plan(&other, plan, 16, &err);
    if (pc) {
        assert_null(kv_seq_import(pc, 1024, img, len, &err));
        assert_int_equal(err.code, STRATA_EINVAL);
        kv_pool_destroy(pc);
    }
    free(img);
    assert_int_equal(kv_pool_free(pa), kv_pool_capacity(pa));   /* nothing leaked in the pools */
    assert_int_equal(kv_pool_free(pb), kv_pool_capacity(pb));
    kv_pool_destroy(pa);
    kv_pool_destroy(pb);
}

static void test_codecs(void **state)
{
    (void)state;
    const char *specs[] = {"fp16", "kivi2", "kivi4", "gear2", "gearl2", "tada2", "0:tada4,1-2:kivi2", "ott2-n0"};
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        strata_error err = {0};
        kv_codec_params plan[LAYERS];
        if (kv_plan_parse(specs[i], LAYERS, plan, &err) != STRATA_OK)
            continue;   /* a spelling this build does not take: the others still run */
        round_trip(specs[i]);
    }
}

/* OTT's pool state travels with the image: the continued blocks (whose fp16 entries the pool
 * decides) are bit for bit those of the unmoved sequence. A pool of another codec refuses it. */
static void test_ott_pool_travels(void **state)
{
    (void)state;
    round_trip("ott2");   /* layers 1-2 have a pool */
    round_trip("ott4");
    kv_codec_params ott[LAYERS], kivi[LAYERS];
    strata_error err = {0};
    assert_int_equal(kv_plan_parse("ott2", LAYERS, ott, &err), STRATA_OK);
    assert_int_equal(kv_plan_parse("kivi2", LAYERS, kivi, &err), STRATA_OK);
    kv_pool *po = kv_pool_create_plan(&geom, ott, 16, &err), *pk = kv_pool_create_plan(&geom, kivi, 16, &err);
    kv_seq *s = kv_seq_create(po, 512, &err);
    feed(s, 100, true, 5);
    uint8_t *img = NULL;
    size_t len = 0;
    assert_int_equal(kv_seq_export(s, &img, &len, &err), STRATA_OK);
    assert_null(kv_seq_import(pk, 512, img, len, &err));
    free(img);
    kv_seq_destroy(s);
    kv_pool_destroy(po);
    kv_pool_destroy(pk);
}

static void test_full_pool(void **state)
{
    (void)state;
    kv_codec_params plan[LAYERS];
    strata_error err = {0};
    assert_int_equal(kv_plan_parse("kivi2", LAYERS, plan, &err), STRATA_OK);
    kv_pool *big = kv_pool_create_plan(&geom, plan, 8, &err), *small = kv_pool_create_plan(&geom, plan, 1, &err);
    kv_seq *s = kv_seq_create(big, 1024, &err);
    feed(s, 400, true, 7);   /* 4 blocks per layer */
    uint8_t *img = NULL;
    size_t len = 0;
    assert_int_equal(kv_seq_export(s, &img, &len, &err), STRATA_OK);
    assert_null(kv_seq_import(small, 1024, img, len, &err));
    assert_int_equal(err.code, STRATA_EFULL);
    assert_int_equal(kv_pool_free(small), kv_pool_capacity(small));   /* what was placed went back */
    free(img);
    kv_seq_destroy(s);
    kv_pool_destroy(big);
    kv_pool_destroy(small);
}

/* Appends rows [from, from + n) of k and v (rows of all heads) to every layer, as one call or
 * token by token. */
static void feed_rows(kv_seq *s, const float *k, const float *v, size_t from, size_t n, bool prompt)
{
    const size_t row = (size_t)HEADS * DIM;
    strata_error err = {0};
    for (int l = 0; l < LAYERS; l++)
        for (size_t t = 0; t < n; t += prompt ? n : 1)
            if (kv_seq_append(s, l, k + (from + t) * row, v + (from + t) * row, prompt ? n : 1, &err) != STRATA_OK)
                fail_msg("append at %zu: %s", from + t, err.msg);
}

/* A sequence cut to a prefix and continued with the rest of the same rows holds exactly what the
 * whole sequence holds: the prefix's blocks are the stored bytes, and the blocks made after the
 * cut are the ones the uncut sequence made from the same rows. */
static void prefix_continues(const char *spec)
{
    kv_codec_params plan[LAYERS];
    strata_error err = {0};
    assert_int_equal(kv_plan_parse(spec, LAYERS, plan, &err), STRATA_OK);
    kv_pool *pa = kv_pool_create_plan(&geom, plan, 16, &err), *pb = kv_pool_create_plan(&geom, plan, 16, &err);
    assert_non_null(pa);
    assert_non_null(pb);
    enum { PROMPT = 400, DECODE = 60, CUT = 3 * BT };
    float *k = rows(PROMPT + DECODE, 21), *v = rows(PROMPT + DECODE, 22);
    kv_seq *a = kv_seq_create(pa, 1024, &err);
    assert_non_null(a);
    feed_rows(a, k, v, 0, PROMPT, true);
    feed_rows(a, k, v, PROMPT, DECODE, false);
    uint8_t *img = NULL, *cut = NULL;
    size_t len = 0, cut_len = 0;
    assert_int_equal(kv_seq_export(a, &img, &len, &err), STRATA_OK);
    if (kv_image_prefix(&geom, img, len, CUT, &cut, &cut_len, &err) != STRATA_OK)
        fail_msg("%s: %s", spec, err.msg);
    assert_true(cut_len < len);
    kv_seq *b = kv_seq_import(pb, 1024, cut, cut_len, &err);
    if (!b)
        fail_msg("%s: %s", spec, err.msg);
    assert_int_equal(kv_seq_length(b, 0), CUT);
    for (int l = 0; l < LAYERS; l++) {
        kv_layer_view va, vb;
        kv_seq_layer_view(a, l, &va);
        kv_seq_layer_view(b, l, &vb);
        assert_int_equal(vb.n_blocks, CUT / BT);
        assert_int_equal(vb.tail_tokens, 0);
        for (size_t i = 0; i < vb.n_blocks; i++) {
            kv_block blk;
            assert_int_equal(kv_block_parse(va.blocks[i], va.block_bytes, &blk, &err), STRATA_OK);
            assert_memory_equal(va.blocks[i], vb.blocks[i], blk.block_bytes);
        }
    }
    /* The rest of the prompt as one chunk, then the same decode tokens. */
    feed_rows(b, k, v, CUT, PROMPT - CUT, true);
    feed_rows(b, k, v, PROMPT, DECODE, false);
    assert_seqs_same(a, b);
    kv_seq_destroy(a);
    kv_seq_destroy(b);
    free(img);
    free(cut);
    free(k);
    free(v);
    kv_pool_destroy(pa);
    kv_pool_destroy(pb);
}

static void test_prefix_images(void **state)
{
    (void)state;
    const char *specs[] = {"fp16", "kivi2", "kivi4", "gear2", "gearl2", "tada2", "0:tada4,1-2:kivi2"};
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++)
        prefix_continues(specs[i]);
}

/* What a prefix cannot be: not whole blocks, more blocks than a layer holds, an OTT layer's (its
 * pool state at the cut is unknown), from a damaged image. */
static void test_prefix_refusals(void **state)
{
    (void)state;
    strata_error err = {0};
    kv_codec_params plan[LAYERS];
    assert_int_equal(kv_plan_parse("kivi2", LAYERS, plan, &err), STRATA_OK);
    kv_pool *pool = kv_pool_create_plan(&geom, plan, 16, &err);
    kv_seq *s = kv_seq_create(pool, 1024, &err);
    feed(s, 400, true, 31);   /* 4 blocks per layer and a 144-token tail */
    uint8_t *img = NULL, *cut = NULL;
    size_t len = 0, cut_len = 0;
    assert_int_equal(kv_seq_export(s, &img, &len, &err), STRATA_OK);
    assert_int_equal(kv_image_prefix(&geom, img, len, 0, &cut, &cut_len, &err), STRATA_EINVAL);
    assert_int_equal(kv_image_prefix(&geom, img, len, BT + 1, &cut, &cut_len, &err), STRATA_EINVAL);
    assert_int_equal(kv_image_prefix(&geom, img, len, 5 * BT, &cut, &cut_len, &err), STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "holds 4 blocks"));
    assert_null(cut);
    assert_int_equal(kv_image_prefix(&geom, img, len, 4 * BT, &cut, &cut_len, &err), STRATA_OK);
    free(cut);
    cut = NULL;
    img[len / 2] ^= 0x04;
    assert_int_equal(kv_image_prefix(&geom, img, len, BT, &cut, &cut_len, &err), STRATA_ECRC);
    assert_null(cut);
    free(img);
    kv_seq_destroy(s);
    kv_pool_destroy(pool);

    assert_int_equal(kv_plan_parse("ott2", LAYERS, plan, &err), STRATA_OK);
    pool = kv_pool_create_plan(&geom, plan, 16, &err);
    s = kv_seq_create(pool, 1024, &err);
    feed(s, 400, true, 32);
    assert_int_equal(kv_seq_export(s, &img, &len, &err), STRATA_OK);
    assert_int_equal(kv_image_prefix(&geom, img, len, BT, &cut, &cut_len, &err), STRATA_EUNSUPPORTED);
    assert_non_null(strstr(err.msg, "OTT"));
    assert_null(cut);
    free(img);
    kv_seq_destroy(s);
    kv_pool_destroy(pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_codecs),
        cmocka_unit_test(test_ott_pool_travels),
        cmocka_unit_test(test_full_pool),
        cmocka_unit_test(test_prefix_images),
        cmocka_unit_test(test_prefix_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
