/* The room check of a step (kv_room, kv_seq_check_room) against the step itself: a pool with a
 * lower tier (host memory, and NVMe for half the cases) small enough that steps must move blocks
 * down and bring them back, plans of one block size and of two sharing slabs, batches of up to
 * three sequences prefilling, continuing a prompt in chunks and decoding. Every step the check
 * admits runs in model.c's order (per layer, per item: attention over the layer first for a
 * chunk, append, attention after it for a decode token, unpin) and must complete: a step that
 * fails part way leaves layers uneven and its worker drops every sequence of the batch. A
 * sequence the check refuses is left out of the step, as the stage does. Also the cases a review
 * found, each admitted before and failing part way: a decode step's fetches evicting blocks with
 * no copy below; slabs of small blocks, each put in whole pages; two sequences each fitting alone
 * but not together; both tiers full reported as a lack of room. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvstore/kv_cache.h"
#include "kvstore/plan.h"
#include "offload/kv_tiers.h"
#include "test_rng.h"
#include "test_dir.h"

enum { LAYERS = 3, HEADS = 2, DIM = 32, BT = 32, ROW = HEADS * DIM, MAX_TOKENS = 16 * BT };
static const kv_geometry geom = {LAYERS, HEADS, DIM, BT};

typedef struct setup {
    char base[64], dir[128];
    kv_tiers *tiers;
    kv_pool *pool;
    kv_codec_params plans[2][LAYERS];
} setup;

/* A pool of `slabs` slabs shared by every layer (the worker's layout with a lower tier), of one
 * plan or of fp16 and kivi2 together, over a host tier of host_pages pages and an NVMe tier of
 * nvme_pages pages (0: none). */
static void setup_make(setup *s, size_t slabs, bool two_plans, size_t host_pages, size_t nvme_pages)
{
    memset(s, 0, sizeof *s);
    strata_error err = {0};
    assert_int_equal(kv_plan_parse("fp16", LAYERS, s->plans[0], &err), STRATA_OK);
    assert_int_equal(kv_plan_parse("kivi2-r0", LAYERS, s->plans[1], &err), STRATA_OK);
    kv_tiers_options o = {.host_bytes = host_pages * 4096};
    if (nvme_pages) {
        snprintf(s->base, sizeof s->base, "/tmp/strata-room-XXXXXX");
        assert_non_null(mkdtemp(s->base));
        snprintf(s->dir, sizeof s->dir, "%s/spill", s->base);
        o.nvme_dir = s->dir;
        o.nvme_bytes = nvme_pages * 4096;
    }
    s->tiers = kv_tiers_create(&o, &err);
    if (!s->tiers)
        fail_msg("%s", err.msg);
    const kv_codec_params *plans[2] = {s->plans[0], s->plans[1]};
    s->pool = kv_pool_create_plans(&geom, plans, two_plans ? 2 : 1, slabs, true, &err);
    if (!s->pool)
        fail_msg("%s", err.msg);
    kv_lower_tier lower = kv_tiers_lower(s->tiers);
    assert_int_equal(kv_pool_set_lower_tier(s->pool, &lower, &err), STRATA_OK);
}

static void setup_free(setup *s)
{
    kv_pool_destroy(s->pool);
    kv_tiers_destroy(s->tiers);
    if (s->base[0])
        test_dir_remove_tree(s->base);
}

typedef struct item {
    kv_seq *seq;
    size_t n;   /* tokens this step */
} item;

/* Runs a step as model_forward_batch does, without the model: rows of K/V from the seed. */
static int run_step(item *items, size_t n_items, uint64_t seed, strata_error *err)
{
    float *k = malloc(MAX_TOKENS * ROW * sizeof *k), *v = malloc(MAX_TOKENS * ROW * sizeof *v);
    assert_non_null(k);
    assert_non_null(v);
    int rc = STRATA_OK;
    for (int l = 0; l < LAYERS && rc == STRATA_OK; l++)
        for (size_t j = 0; j < n_items && rc == STRATA_OK; j++) {
            kv_seq *q = items[j].seq;
            const size_t n = items[j].n, len = kv_seq_length(q, l);
            for (size_t i = 0; i < n * ROW; i++) {
                k[i] = rng_sym(&seed) * 3.0f;
                v[i] = rng_sym(&seed);
            }
            kv_layer_view view;
            if (n > 1 && len > 0)   /* a later chunk attends what came before it */
                rc = kv_seq_acquire_layer(q, l, &view, err);
            if (rc == STRATA_OK)
                rc = kv_seq_append(q, l, k, v, n, err);
            if (rc == STRATA_OK && n == 1)
                rc = kv_seq_acquire_layer(q, l, &view, err);
            kv_seq_unpin(q);
        }
    free(k);
    free(v);
    return rc;
}

/* Admits the items the check takes, in order, leaving out those it refuses; returns how many. */
static size_t admit(kv_pool *pool, item *items, size_t n_items, item *run)
{
    strata_error err = {0};
    kv_room *room = kv_room_begin(pool, &err);
    assert_non_null(room);
    size_t n_run = 0;
    for (size_t j = 0; j < n_items; j++) {
        const int rc = kv_room_add(room, items[j].seq, items[j].n, &err);
        if (rc == STRATA_OK)
            run[n_run++] = items[j];
        else
            assert_int_equal(rc, STRATA_EFULL);
    }
    kv_room_end(room);
    return n_run;
}

static void test_admitted_steps_complete(void **state)
{
    (void)state;
    uint64_t rng = 0x5eed0f5ace;
    size_t admitted = 0, refused = 0, steps = 0;
    for (int round = 0; round < (getenv("ROOM_ROUNDS") ? atoi(getenv("ROOM_ROUNDS")) : 60); round++) {
        const bool two = rng_next(&rng) % 2, nvme = rng_next(&rng) % 2;
        const size_t slabs = 3 + rng_next(&rng) % 8, host = 2 + rng_next(&rng) % 14;
        setup s;
        setup_make(&s, slabs, two, host, nvme ? 2 + rng_next(&rng) % 14 : 0);
        kv_seq *seqs[3];
        size_t n_seqs = 1 + rng_next(&rng) % 3;
        strata_error err = {0};
        for (size_t i = 0; i < n_seqs; i++) {
            seqs[i] = kv_seq_create_plan(s.pool, s.plans[two ? i % 2 : 0], MAX_TOKENS, &err);
            assert_non_null(seqs[i]);
        }
        for (int step = 0; step < 12; step++) {
            item items[3], run[3];
            size_t n_items = 0;
            for (size_t i = 0; i < n_seqs; i++) {
                const size_t len = kv_seq_length(seqs[i], 0), left = MAX_TOKENS - len;
                size_t n = len == 0 ? 1 + rng_next(&rng) % (3 * BT) : rng_next(&rng) % 3 ? 1 : 2 + rng_next(&rng) % BT;
                n = n > left ? left : n;
                if (n)
                    items[n_items++] = (item){seqs[i], n};
            }
            const size_t n_run = admit(s.pool, items, n_items, run);
            admitted += n_run;
            refused += n_items - n_run;
            if (!n_run)
                continue;
            steps++;
            if (run_step(run, n_run, rng_next(&rng), &err) != STRATA_OK)
                fail_msg("round %d step %d (%zu slabs, %s, host %zu pages, %s): an admitted step failed: %s", round,
                         step, slabs, two ? "fp16 + kivi2" : "fp16", host, nvme ? "NVMe" : "no NVMe", err.msg);
            kv_tiers_poll(s.tiers);
        }
        for (size_t i = 0; i < n_seqs; i++)
            kv_seq_destroy(seqs[i]);
        setup_free(&s);
    }
    /* the cases reach both sides of the check */
    print_message("%zu steps: %zu sequences admitted, %zu refused\n", steps, admitted, refused);
    assert_true(admitted > 100 && refused > 10);
}

/* Fills a sequence's layers with n tokens (a prompt). */
static void prefill(kv_seq *q, size_t n)
{
    item it = {q, n};
    strata_error err = {0};
    assert_int_equal(kv_seq_check_room(q, n, &err), STRATA_OK);
    assert_int_equal(run_step(&it, 1, 7, &err), STRATA_OK);
}

/* Review case 1: after a prefill, the decode step brings back the blocks moved down, evicting
 * blocks that have no copy below into a full host tier: refused, not admitted to fail. */
static void test_fetches_count(void **state)
{
    (void)state;
    setup s;
    setup_make(&s, 4, false, 6, 0);   /* 4 fp16 slots of 8 KiB; 6 pages below: 3 blocks */
    strata_error err = {0};
    kv_seq *q = kv_seq_create_plan(s.pool, s.plans[0], MAX_TOKENS, &err);
    prefill(q, 2 * BT);   /* 6 blocks: 4 resident with no copy below, 2 filling the host tier */
    const int rc = kv_seq_check_room(q, 1, &err);
    if (rc != STRATA_EFULL || !strstr(err.msg, "KV tiers full"))
        fail_msg("rc %d: %s", rc, err.msg);
    kv_seq_destroy(q);
    setup_free(&s);
}

/* Review case 3: two sequences that each fit alone but not together: the second is refused and
 * the first runs. (Each alone may move its own 3 blocks and, counted as leaving and coming back,
 * 3 more: 6 x 12 KiB, all the room below; together twice that.) */
static void test_batch_counts_together(void **state)
{
    (void)state;
    setup s;
    setup_make(&s, 6, false, 18, 0);   /* 6 fp16 slots; 18 pages below: 6 blocks of 3 pages */
    strata_error err = {0};
    kv_seq *a = kv_seq_create_plan(s.pool, s.plans[0], MAX_TOKENS, &err), *b = kv_seq_create_plan(s.pool, s.plans[0],
                                                                                                  MAX_TOKENS, &err);
    prefill(a, BT);
    prefill(b, BT);   /* 6 blocks: the pool is full, nothing below */
    assert_int_equal(kv_seq_check_room(a, BT, &err), STRATA_OK);
    assert_int_equal(kv_seq_check_room(b, BT, &err), STRATA_OK);
    item items[2] = {{a, BT}, {b, BT}}, run[2];
    assert_int_equal(admit(s.pool, items, 2, run), 1);
    assert_ptr_equal(run[0].seq, a);
    assert_int_equal(run_step(run, 1, 11, &err), STRATA_OK);
    kv_seq_destroy(a);
    kv_seq_destroy(b);
    setup_free(&s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_admitted_steps_complete),
        cmocka_unit_test(test_fetches_count),
        cmocka_unit_test(test_batch_counts_together),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
