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

/* The same n rows, as a prompt call or token by token, to every layer of each sequence; each
 * sequence is unpinned after its appends, as the forward pass does after a layer (pinned blocks
 * are never moved by compaction). */
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
            kv_seq_unpin(seqs[s]);
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

/* The fp16 and kivi2 plans and a pool for both (slabs per layer, without a tier); *per: kivi2
 * blocks in one slab. */
static kv_pool *fp16_kivi2_pool(kv_codec_params *p16, kv_codec_params *p2, size_t slabs, size_t *per)
{
    strata_error err = {0};
    assert_int_equal(kv_plan_parse("fp16", LAYERS, p16, &err), STRATA_OK);
    assert_int_equal(kv_plan_parse("kivi2", LAYERS, p2, &err), STRATA_OK);
    const kv_codec_params *both[] = {p16, p2};
    kv_pool *pool = kv_pool_create_plans(&geom, both, 2, slabs, false, &err);
    assert_non_null(pool);
    *per = kv_block_size(&p16[0], &geom) / kv_block_size(&p2[0], &geom);
    return pool;
}

/* Slabs: in a pool sized for fp16 blocks, a kivi2 sequence stores as many kivi2 blocks as fit a
 * slab, not one per fp16 slot; once they are gone the same memory holds fp16 blocks. */
static void test_slabs_hold_smaller_blocks(void **state)
{
    (void)state;
    enum { SLABS = 4 };   /* per layer */
    kv_codec_params p16[LAYERS], p2[LAYERS];
    strata_error err = {0};
    size_t per;
    kv_pool *pool = fp16_kivi2_pool(p16, p2, SLABS, &per);
    assert_true(per >= 4);
    kv_seq *s = kv_seq_create_plan(pool, p2, 8192, &err);
    assert_non_null(s);
    const size_t blocks = SLABS * per, tokens = (size_t)p2[0].residual + BT * blocks;
    assert_int_equal(kv_seq_check_room(s, tokens, &err), STRATA_OK);
    feed(&s, 1, tokens, true, 5);
    kv_seq_stats st;
    kv_seq_get_stats(s, &st);
    assert_int_equal(st.blocks, blocks * LAYERS);   /* SLABS per layer if a block took a slot */
    assert_int_equal(kv_pool_free(pool), 0);
    assert_int_equal(kv_seq_check_room(s, BT, &err), STRATA_EFULL);
    kv_seq *f = kv_seq_create_plan(pool, p16, 8192, &err);
    assert_non_null(f);
    assert_int_equal(kv_seq_check_room(f, BT, &err), STRATA_EFULL);
    kv_seq_destroy(s);
    assert_int_equal(kv_pool_free(pool), kv_pool_capacity(pool));
    assert_int_equal(kv_seq_check_room(f, BT * SLABS, &err), STRATA_OK);
    feed(&f, 1, BT * SLABS, true, 6);
    assert_int_equal(kv_pool_free(pool), 0);
    kv_seq_destroy(f);
    kv_pool_destroy(pool);
}

/* Compaction: kivi2 blocks left scattered over every slab by finished sequences are moved
 * together so that fp16 blocks get whole slabs; the moved sequences keep their bytes. */
static void test_slabs_compact(void **state)
{
    (void)state;
    enum { SLABS = 4, MAX_SEQS = 64 };
    kv_codec_params p16[LAYERS], p2[LAYERS];
    strata_error err = {0};
    size_t per;
    kv_pool *pool = fp16_kivi2_pool(p16, p2, SLABS, &per);
    kv_pool *ref_pool = kv_pool_create_plan(&geom, p2, MAX_SEQS, &err);
    assert_non_null(ref_pool);
    const size_t n_seqs = SLABS * per, tokens = (size_t)p2[0].residual + BT;   /* one block per layer each */
    assert_true(n_seqs <= MAX_SEQS);
    kv_seq *seqs[MAX_SEQS], *refs[MAX_SEQS];
    for (size_t i = 0; i < n_seqs; i++) {
        seqs[i] = kv_seq_create_plan(pool, p2, 1024, &err);
        refs[i] = kv_seq_create(ref_pool, 1024, &err);
        assert_non_null(seqs[i]);
        assert_non_null(refs[i]);
        feed(&seqs[i], 1, tokens, true, 100 + i);
        feed(&refs[i], 1, tokens, true, 100 + i);
    }
    assert_int_equal(kv_pool_free(pool), 0);   /* every slab full of kivi2 blocks */
    for (size_t i = 0; i < n_seqs; i++)
        if (i % 4 != 0) {
            kv_seq_destroy(seqs[i]);
            seqs[i] = NULL;
        }
    /* The survivors' blocks sit in (nearly) every slab: without compaction no fp16 block fits. */
    const size_t survivors = (n_seqs + 3) / 4, kivi_slabs = (survivors * LAYERS + per - 1) / per;
    const size_t fp16_blocks = (SLABS * LAYERS - kivi_slabs) / LAYERS;
    assert_true(fp16_blocks >= 2);
    assert_true(kv_pool_free(pool) < fp16_blocks * LAYERS);
    kv_seq *f = kv_seq_create_plan(pool, p16, 1024, &err);
    assert_non_null(f);
    if (kv_seq_check_room(f, BT * fp16_blocks, &err) != STRATA_OK)
        fail_msg("%s", err.msg);
    feed(&f, 1, BT * fp16_blocks, true, 7);
    kv_pool_stats ps;
    kv_pool_get_stats(pool, &ps);
    assert_true(ps.compactions > 0);
    assert_true(ps.compaction_bytes > 0);
    for (size_t i = 0; i < n_seqs; i += 4)
        assert_seqs_same(seqs[i], refs[i]);   /* moved, unchanged */
    /* and they go on growing exactly as their references do */
    for (size_t i = 0; i < n_seqs; i += 4) {
        feed(&seqs[i], 1, 3, false, 200 + i);
        feed(&refs[i], 1, 3, false, 200 + i);
        assert_seqs_same(seqs[i], refs[i]);
    }
    for (size_t i = 0; i < n_seqs; i++) {
        kv_seq_destroy(seqs[i]);
        kv_seq_destroy(refs[i]);
    }
    kv_seq_destroy(f);
    assert_int_equal(kv_pool_free(pool), kv_pool_capacity(pool));
    kv_pool_destroy(pool);
    kv_pool_destroy(ref_pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sizing),
        cmocka_unit_test(test_side_by_side),
        cmocka_unit_test(test_plan_must_fit),
        cmocka_unit_test(test_plan_travels),
        cmocka_unit_test(test_slabs_hold_smaller_blocks),
        cmocka_unit_test(test_slabs_compact),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
