/* Sequences with their own plan (kv_seq_create_plan) in a pool made for several plans
 * (kv_pool_create_plans): each sequence's blocks and tail are bit for bit those of the same rows
 * appended in a pool made for its plan alone, whatever the other sequences of the pool use; a
 * plan whose blocks do not fit the pool's slots is refused; the plan travels in the migration
 * image and a pool without room for it refuses the image. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kvstore/block.h"
#include "kvstore/kv_cache.h"
#include "kvstore/plan.h"
#include "kv_seq_same.h"
#include "test_rng.h"

enum { LAYERS = 3, HEADS = 2, DIM = 64, BT = 64, ROW = HEADS * DIM };
static const kv_geometry geom = {LAYERS, HEADS, DIM, BT};

/* The server's own plan first, then what requests may name instead. */
static const char *const specs[] = {"kivi2", "fp16", "kivi4", "0:tada4,1-2:gear2", "ott2"};
enum { N_PLANS = sizeof specs / sizeof specs[0] };

typedef struct plans {
    kv_codec_params p[N_PLANS][LAYERS];
    const kv_codec_params *ptr[N_PLANS];
} plans;

static void parse_plans(plans *ps)
{
    strata_error err = {0};
    for (int i = 0; i < N_PLANS; i++) {
        assert_int_equal(kv_plan_parse(specs[i], LAYERS, ps->p[i], &err), STRATA_OK);
        ps->ptr[i] = ps->p[i];
    }
}

static float *rows(size_t n, uint64_t seed)
{
    float *x = malloc(n * ROW * sizeof *x);
    assert_non_null(x);
    for (size_t i = 0; i < n * ROW; i++)
        x[i] = (float)((double)(rng_next(&seed) >> 11) * 0x1p-52 * 6.0 - 3.0);
    return x;
}

/* The same n rows, as a prompt call or token by token, to every layer of each sequence. */
static void feed(kv_seq *const *seqs, int n_seqs, size_t n, bool prompt, uint64_t seed)
{
    float *k = rows(n, seed), *v = rows(n, seed + 1);
    strata_error err = {0};
    for (int s = 0; s < n_seqs; s++)
        for (int l = 0; l < LAYERS; l++) {
            if (prompt) {
                if (kv_seq_append(seqs[s], l, k, v, n, &err) != STRATA_OK)
                    fail_msg("sequence %d layer %d: %s", s, l, err.msg);
            } else {
                for (size_t t = 0; t < n; t++)
                    if (kv_seq_append(seqs[s], l, k + t * ROW, v + t * ROW, 1, &err) != STRATA_OK)
                        fail_msg("sequence %d layer %d token %zu: %s", s, l, t, err.msg);
            }
        }
    free(k);
    free(v);
}

static size_t largest_at(const plans *ps, int layer)
{
    size_t m = 0;
    for (int i = 0; i < N_PLANS; i++) {
        size_t b = kv_block_size(&ps->p[i][layer], &geom);
        m = b > m ? b : m;
    }
    return m;
}

/* Slot sizes: each layer's largest block over the plans (per layer, or one size when shared). */
static void test_sizing(void **state)
{
    (void)state;
    plans ps;
    parse_plans(&ps);
    size_t row = 0, largest = 0;
    for (int l = 0; l < LAYERS; l++) {
        row += largest_at(&ps, l);
        largest = largest_at(&ps, l) > largest ? largest_at(&ps, l) : largest;
    }
    assert_int_equal(kv_plans_row_bytes(&geom, ps.ptr, N_PLANS), row);
    assert_int_equal(kv_plans_largest_block(&geom, ps.ptr, N_PLANS), largest);
    assert_int_equal(kv_plans_row_bytes(&geom, ps.ptr, 1), kv_plan_row_bytes(&geom, ps.p[0]));
    strata_error err = {0};
    kv_pool *rows_pool = kv_pool_create_plans(&geom, ps.ptr, N_PLANS, 5, false, &err);
    kv_pool *shared = kv_pool_create_plans(&geom, ps.ptr, N_PLANS, 7, true, &err);
    assert_non_null(rows_pool);
    assert_non_null(shared);
    assert_int_equal(kv_pool_bytes(rows_pool), 5 * row);
    assert_int_equal(kv_pool_capacity(rows_pool), 5 * LAYERS);
    assert_int_equal(kv_pool_bytes(shared), 7 * largest);
    assert_int_equal(kv_pool_codec(rows_pool)->codec, KV_CODEC_KIVI);   /* plans[0] is the pool's own */
    kv_pool_destroy(rows_pool);
    kv_pool_destroy(shared);
    /* A plan that does not validate is named. */
    kv_codec_params bad[LAYERS];
    memcpy(bad, ps.p[1], sizeof bad);
    bad[2].bits = 3;
    const kv_codec_params *with_bad[] = {ps.p[0], bad};
    assert_null(kv_pool_create_plans(&geom, with_bad, 2, 5, false, &err));
    assert_int_equal(err.code, STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "layer 2"));
    assert_null(kv_pool_create_plans(&geom, ps.ptr, 0, 5, false, &err));
    assert_int_equal(err.code, STRATA_EINVAL);
}

/* Every plan side by side in one pool, interleaved, against a pool of its own. */
static void check_side_by_side(bool shared)
{
    plans ps;
    parse_plans(&ps);
    strata_error err = {0};
    kv_pool *mixed = kv_pool_create_plans(&geom, ps.ptr, N_PLANS, shared ? 3 * 40 : 40, shared, &err);
    assert_non_null(mixed);
    kv_pool *own[N_PLANS];
    kv_seq *in_mixed[N_PLANS], *alone[N_PLANS];
    for (int i = 0; i < N_PLANS; i++) {
        own[i] = kv_pool_create_plan(&geom, ps.p[i], 20, &err);
        assert_non_null(own[i]);
        /* plan 0 through the default path, the others named */
        in_mixed[i] = i == 0 ? kv_seq_create(mixed, 2048, &err) : kv_seq_create_plan(mixed, ps.p[i], 2048, &err);
        if (!in_mixed[i])
            fail_msg("%s: %s", specs[i], err.msg);
        alone[i] = kv_seq_create(own[i], 2048, &err);
        assert_non_null(alone[i]);
        for (int l = 0; l < LAYERS; l++) {
            assert_int_equal(kv_seq_codec(in_mixed[i], l)->codec, ps.p[i][l].codec);
            assert_int_equal(kv_seq_codec(in_mixed[i], l)->bits, ps.p[i][l].bits);
            assert_int_equal(kv_seq_codec(in_mixed[i], l)->pool_tokens, ps.p[i][l].pool_tokens);
        }
    }
    assert_null(kv_seq_codec(in_mixed[0], LAYERS));
    /* Interleaved: a prompt, then decode steps, each call going to every sequence in turn. */
    feed(in_mixed, N_PLANS, 300, true, 41);
    feed(alone, N_PLANS, 300, true, 41);
    feed(in_mixed, N_PLANS, 140, false, 42);
    feed(alone, N_PLANS, 140, false, 42);
    for (int i = 0; i < N_PLANS; i++) {
        assert_seqs_same(in_mixed[i], alone[i]);
        kv_seq_stats st;
        kv_seq_get_stats(in_mixed[i], &st);
        assert_int_equal(st.tokens, 440 * LAYERS);
        kv_seq_destroy(in_mixed[i]);
        kv_seq_destroy(alone[i]);
        kv_pool_destroy(own[i]);
    }
    assert_int_equal(kv_pool_free(mixed), kv_pool_capacity(mixed));
    kv_pool_destroy(mixed);
}

static void test_side_by_side(void **state)
{
    (void)state;
    check_side_by_side(false);
    check_side_by_side(true);
}

/* A pool made for the default plan alone has no room for larger blocks: refused, named. */
static void test_plan_must_fit(void **state)
{
    (void)state;
    plans ps;
    parse_plans(&ps);
    strata_error err = {0};
    kv_pool *p = kv_pool_create_plan(&geom, ps.p[0], 8, &err);
    assert_non_null(p);
    assert_null(kv_seq_create_plan(p, ps.p[1], 512, &err));   /* fp16 blocks in kivi2 slots */
    assert_int_equal(err.code, STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "layer 0's codec fp16"));
    assert_non_null(strstr(err.msg, "slots there hold"));
    kv_codec_params odd[LAYERS];
    memcpy(odd, ps.p[0], sizeof odd);
    odd[1].group = 48;   /* does not divide the 64-token block */
    assert_null(kv_seq_create_plan(p, odd, 512, &err));
    assert_int_equal(err.code, STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "layer 1"));
    /* Smaller blocks than the slots are fine: kivi2 blocks fit a kivi4 pool. */
    kv_pool *p4 = kv_pool_create_plan(&geom, ps.p[2], 8, &err);
    kv_seq *s = kv_seq_create_plan(p4, ps.p[0], 512, &err);
    assert_non_null(s);
    kv_seq_destroy(s);
    kv_pool_destroy(p4);
    assert_int_equal(kv_pool_free(p), kv_pool_capacity(p));
    kv_pool_destroy(p);
}

/* The image carries the plan: a sequence of a named plan moves to another mixed pool and goes
 * on exactly as the unmoved one; a pool that cannot hold the plan's blocks refuses the image. */
static void test_plan_travels(void **state)
{
    (void)state;
    plans ps;
    parse_plans(&ps);
    strata_error err = {0};
    kv_pool *a = kv_pool_create_plans(&geom, ps.ptr, N_PLANS, 20, false, &err);
    kv_pool *b = kv_pool_create_plans(&geom, ps.ptr, N_PLANS, 20, true, &err);   /* another layout */
    kv_pool *only_default = kv_pool_create_plan(&geom, ps.p[0], 20, &err);
    assert_non_null(a);
    assert_non_null(b);
    assert_non_null(only_default);
    for (int i = 1; i < N_PLANS; i++) {
        kv_seq *s = kv_seq_create_plan(a, ps.p[i], 1024, &err);
        assert_non_null(s);
        feed(&s, 1, 200, true, 7);
        feed(&s, 1, 30, false, 8);
        uint8_t *img = NULL;
        size_t len = 0;
        assert_int_equal(kv_seq_export(s, &img, &len, &err), STRATA_OK);
        kv_seq *moved = kv_seq_import(b, 1024, img, len, &err);
        if (!moved)
            fail_msg("%s: %s", specs[i], err.msg);
        for (int l = 0; l < LAYERS; l++)
            assert_int_equal(kv_seq_codec(moved, l)->codec, ps.p[i][l].codec);
        assert_seqs_same(s, moved);
        kv_seq *both[] = {s, moved};
        feed(both, 2, 90, false, 9);
        assert_seqs_same(s, moved);
        /* every named plan here makes larger blocks than kivi2 in some layer */
        assert_null(kv_seq_import(only_default, 1024, img, len, &err));
        assert_int_equal(err.code, STRATA_EINVAL);
        assert_non_null(strstr(err.msg, "slots there hold"));
        free(img);
        kv_seq_destroy(s);
        kv_seq_destroy(moved);
    }
    assert_int_equal(kv_pool_free(only_default), kv_pool_capacity(only_default));
    assert_int_equal(kv_pool_free(a), kv_pool_capacity(a));
    assert_int_equal(kv_pool_free(b), kv_pool_capacity(b));
    kv_pool_destroy(a);
    kv_pool_destroy(b);
    kv_pool_destroy(only_default);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sizing),
        cmocka_unit_test(test_side_by_side),
        cmocka_unit_test(test_plan_must_fit),
        cmocka_unit_test(test_plan_travels),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
