/* The prefix-cache index (coordinator/sched/prefix_index.h): lookup picks the longest usable
 * prefix cut to whole blocks and to all but the prompt's last token, ties to the most recently
 * used; insert refuses bad arguments and duplicates, answers keep = false when covered, when
 * caching is off or when pinned entries leave no room (evicting nothing then), evicts the
 * entries an extension makes redundant and then the least recently used; remove, drop queues,
 * forget_replica and the stats; and a randomized run checked after every operation against an
 * independent model (budget, pinned entries never evicted, every dropped id was kept and is
 * gone). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "coordinator/sched/prefix_index.h"
#include "test_rng.h"

#define BT 4   /* block_tokens of the hand-written tests */

static prefix_index *make(int n_replicas, size_t bt, uint64_t budget)
{
    prefix_index_config c = {.n_replicas = n_replicas, .block_tokens = bt, .budget_bytes = budget};
    strata_error err = {0};
    prefix_index *x = prefix_index_create(&c, &err);
    if (!x)
        fail_msg("%s", err.msg);
    return x;
}

/* tokens base, base + 1, ... (n of them) */
static void seq(int32_t *t, size_t n, int32_t base)
{
    for (size_t i = 0; i < n; i++)
        t[i] = base + (int32_t)i;
}

/* Inserts and answers keep; the call itself must succeed. */
static bool ins(prefix_index *x, uint64_t id, int r, int plan, const int32_t *t, size_t n, uint64_t bytes)
{
    strata_error err = {0};
    bool keep = true;
    int rc = prefix_index_insert(x, id, r, plan, t, n, bytes, &keep, &err);
    if (rc != STRATA_OK)
        fail_msg("insert %llu: %s", (unsigned long long)id, err.msg);
    return keep;
}

static prefix_hit look(const prefix_index *x, int plan, const int32_t *p, size_t n, const bool *usable)
{
    prefix_hit h;
    memset(&h, 0xab, sizeof h);
    bool found = prefix_index_lookup(x, plan, p, n, usable, &h);
    assert_int_equal(found, h.entry != 0);
    if (!found) {
        assert_int_equal(h.n_tokens, 0);
    }
    return h;
}

static void test_create_errors(void **state)
{
    (void)state;
    strata_error err = {0};
    assert_null(prefix_index_create(NULL, &err));
    assert_int_equal(err.code, STRATA_EINVAL);
    prefix_index_config c = {.n_replicas = 0, .block_tokens = 4, .budget_bytes = 10};
    assert_null(prefix_index_create(&c, &err));
    c.n_replicas = 1;
    c.block_tokens = 0;
    assert_null(prefix_index_create(&c, &err));
    assert_non_null(strstr(err.msg, "block_tokens"));
    c.block_tokens = 4;
    prefix_index *x = prefix_index_create(&c, &err);
    assert_non_null(x);
    prefix_index_destroy(x);
    prefix_index_destroy(NULL);
}

/* The longest shared run wins across replicas; usable[] hides a replica; another plan misses. */
static void test_lookup_longest_and_usable(void **state)
{
    (void)state;
    prefix_index *x = make(2, BT, 1000);
    int32_t t[32], p[32];
    seq(t, 32, 100);
    seq(p, 32, 100);
    assert_true(ins(x, 1, 0, 7, t, 8, 10));
    assert_true(ins(x, 2, 1, 7, t, 16, 10));
    prefix_hit h = look(x, 7, p, 32, NULL);
    assert_int_equal(h.entry, 2);
    assert_int_equal(h.replica, 1);
    assert_int_equal(h.n_tokens, 16);
    bool only0[2] = {true, false};
    h = look(x, 7, p, 32, only0);
    assert_int_equal(h.entry, 1);
    assert_int_equal(h.replica, 0);
    assert_int_equal(h.n_tokens, 8);
    bool none[2] = {false, false};
    assert_int_equal(look(x, 7, p, 32, none).entry, 0);
    assert_int_equal(look(x, 8, p, 32, NULL).entry, 0);   /* another KV plan */
    p[0] = 1;   /* differs at the first token */
    assert_int_equal(look(x, 7, p, 32, NULL).entry, 0);
    /* a lookup changes nothing */
    prefix_index_stats st;
    prefix_index_get_stats(x, -1, &st);
    assert_int_equal(st.hits, 0);
    assert_int_equal(st.entries, 2);
    prefix_index_destroy(x);
}

/* Whole blocks only, and never the prompt's last token. */
static void test_lookup_cuts(void **state)
{
    (void)state;
    prefix_index *x = make(1, BT, 1000);
    int32_t t[8], p[16];
    seq(t, 8, 1);
    seq(p, 16, 1);
    assert_true(ins(x, 5, 0, 0, t, 8, 10));
    prefix_hit h = look(x, 0, p, 8, NULL);   /* the entry's own ids: its last token must run */
    assert_int_equal(h.entry, 5);
    assert_int_equal(h.n_tokens, 4);
    h = look(x, 0, p, 9, NULL);   /* 2 blocks + 1 */
    assert_int_equal(h.n_tokens, 8);
    h = look(x, 0, p, 16, NULL);   /* capped at the entry's length */
    assert_int_equal(h.n_tokens, 8);
    h = look(x, 0, p, 5, NULL);
    assert_int_equal(h.n_tokens, 4);
    assert_int_equal(look(x, 0, p, 4, NULL).entry, 0);   /* 3 tokens usable: not a block */
    assert_int_equal(look(x, 0, p, 1, NULL).entry, 0);
    assert_int_equal(look(x, 0, p, 0, NULL).entry, 0);
    assert_false(prefix_index_lookup(x, 0, NULL, 9, NULL, &h));
    p[6] = -1;   /* shares 6 tokens: one block */
    h = look(x, 0, p, 16, NULL);
    assert_int_equal(h.n_tokens, 4);
    p[2] = -1;   /* shares 2 tokens: nothing */
    assert_int_equal(look(x, 0, p, 16, NULL).entry, 0);
    prefix_index_destroy(x);
}

/* Equal lengths: the most recently used (inserted or pinned) entry. */
static void test_lookup_ties(void **state)
{
    (void)state;
    prefix_index *x = make(3, BT, 1000);
    int32_t t[12];
    seq(t, 12, 40);
    assert_true(ins(x, 1, 0, 0, t, 8, 10));
    assert_true(ins(x, 2, 1, 0, t, 8, 10));
    assert_true(ins(x, 3, 2, 0, t, 8, 10));
    assert_int_equal(look(x, 0, t, 12, NULL).entry, 3);
    assert_true(prefix_index_pin(x, 1, 8));
    assert_int_equal(look(x, 0, t, 12, NULL).entry, 1);
    prefix_index_unpin(x, 1);   /* unpinning is no use */
    assert_int_equal(look(x, 0, t, 12, NULL).entry, 1);
    assert_true(prefix_index_pin(x, 2, 8));
    prefix_index_unpin(x, 2);
    prefix_hit h = look(x, 0, t, 12, NULL);
    assert_int_equal(h.entry, 2);
    assert_int_equal(h.replica, 1);
    bool not1[3] = {true, false, true};
    assert_int_equal(look(x, 0, t, 12, not1).entry, 1);
    prefix_index_destroy(x);
}

static void test_insert_errors(void **state)
{
    (void)state;
    prefix_index *x = make(2, BT, 1000);
    int32_t t[8];
    seq(t, 8, 1);
    strata_error err = {0};
    bool keep = true;
    assert_int_equal(prefix_index_insert(x, 1, 0, 0, NULL, 8, 10, &keep, &err), STRATA_EINVAL);
    assert_false(keep);
    assert_int_equal(prefix_index_insert(x, 1, 0, 0, t, 0, 10, &keep, &err), STRATA_EINVAL);
    assert_int_equal(prefix_index_insert(x, 1, 0, 0, t, 6, 10, &keep, &err), STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "block_tokens"));
    assert_int_equal(prefix_index_insert(x, 1, -1, 0, t, 8, 10, &keep, &err), STRATA_EINVAL);
    assert_int_equal(prefix_index_insert(x, 1, 2, 0, t, 8, 10, &keep, &err), STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "replica 2"));
    assert_int_equal(prefix_index_insert(x, 0, 0, 0, t, 8, 10, &keep, &err), STRATA_EINVAL);
    assert_int_equal(prefix_index_insert(x, 1, 0, 0, t, 8, 10, NULL, &err), STRATA_EINVAL);
    assert_int_equal(prefix_index_insert(NULL, 1, 0, 0, t, 8, 10, &keep, &err), STRATA_EINVAL);
    assert_int_equal(prefix_index_insert(x, 1, 0, 0, t, 8, 10, &keep, NULL), STRATA_OK);
    assert_true(keep);
    int32_t u[4] = {9, 9, 9, 9};
    /* the id again, even with other ids on another replica */
    assert_int_equal(prefix_index_insert(x, 1, 1, 3, u, 4, 10, &keep, &err), STRATA_EINVAL);
    assert_false(keep);
    assert_non_null(strstr(err.msg, "entry 1 already"));
    prefix_index_stats st;
    prefix_index_get_stats(x, -1, &st);
    assert_int_equal(st.entries, 1);
    assert_int_equal(st.inserts, 1);
    assert_int_equal(prefix_index_replica(x, 1), 0);
    prefix_index_destroy(x);
}

/* An entry of the same replica and plan already holding the ids: nothing to keep. */
static void test_insert_covered(void **state)
{
    (void)state;
    prefix_index *x = make(2, BT, 1000);
    int32_t t[16];
    seq(t, 16, 1);
    assert_true(ins(x, 1, 0, 0, t, 16, 10));
    assert_false(ins(x, 2, 0, 0, t, 8, 10));    /* shorter */
    assert_false(ins(x, 3, 0, 0, t, 16, 10));   /* same length */
    assert_int_equal(prefix_index_replica(x, 2), -1);
    assert_true(ins(x, 4, 1, 0, t, 8, 10));     /* another replica */
    assert_true(ins(x, 5, 0, 1, t, 8, 10));     /* another plan */
    int32_t u[8];
    seq(u, 8, 1);
    u[7] = -5;   /* differs in its last token */
    assert_true(ins(x, 6, 0, 0, u, 8, 10));
    prefix_index_stats st;
    prefix_index_get_stats(x, 0, &st);
    assert_int_equal(st.inserts, 3);
    assert_int_equal(st.entries, 3);
    assert_int_equal(st.evictions, 0);
    assert_int_equal(prefix_index_pending_drops(x, 0), 0);
    prefix_index_destroy(x);
}

/* A longer entry makes the shorter ones it extends redundant: they go (unless pinned); an entry
 * that only shares part of them, or of another plan, stays. */
static void test_insert_extension(void **state)
{
    (void)state;
    prefix_index *x = make(1, BT, 1000);
    int32_t t[24], u[8];
    seq(t, 24, 1);
    seq(u, 8, 1);
    u[5] = 0;
    assert_true(ins(x, 1, 0, 0, t, 4, 10));
    assert_true(ins(x, 2, 0, 0, t, 8, 10));   /* extends 1 */
    uint64_t d[4];
    assert_int_equal(prefix_index_take_drops(x, 0, d, 4), 1);
    assert_int_equal(d[0], 1);
    assert_true(ins(x, 3, 0, 0, u, 8, 10));   /* shares one block only */
    assert_true(ins(x, 4, 0, 1, t, 8, 10));   /* other plan */
    assert_true(prefix_index_pin(x, 2, 8));
    assert_true(ins(x, 5, 0, 0, t, 16, 10));   /* 2 is redundant but pinned */
    assert_int_equal(prefix_index_pending_drops(x, 0), 0);
    assert_int_equal(prefix_index_replica(x, 2), 0);
    prefix_index_unpin(x, 2);
    assert_true(ins(x, 6, 0, 0, t, 24, 10));   /* 2 and 5 go, oldest use first */
    assert_int_equal(prefix_index_take_drops(x, 0, d, 4), 2);
    assert_int_equal(d[0], 2);   /* pinned (its last use) before 5 was inserted */
    assert_int_equal(d[1], 5);
    assert_int_equal(prefix_index_replica(x, 3), 0);
    assert_int_equal(prefix_index_replica(x, 4), 0);
    prefix_hit h = look(x, 0, t, 24, NULL);
    assert_int_equal(h.entry, 6);
    assert_int_equal(h.n_tokens, 20);
    prefix_index_stats st;
    prefix_index_get_stats(x, 0, &st);
    assert_int_equal(st.evictions, 3);
    assert_int_equal(st.entries, 3);
    assert_int_equal(st.bytes, 30);
    prefix_index_destroy(x);
}

/* Under the budget the least recently used unpinned entries go; a pin protects an entry and
 * makes it the newest. */
static void test_lru_eviction(void **state)
{
    (void)state;
    prefix_index *x = make(2, BT, 300);
    int32_t t[6][4];
    for (int i = 0; i < 6; i++)
        seq(t[i], 4, 100 * (i + 1));
    assert_true(ins(x, 1, 0, 0, t[0], 4, 100));
    assert_true(ins(x, 2, 0, 0, t[1], 4, 100));
    assert_true(ins(x, 3, 0, 0, t[2], 4, 100));
    assert_true(ins(x, 9, 1, 0, t[3], 4, 300));   /* another replica's budget is its own */
    assert_true(prefix_index_pin(x, 1, 4));
    prefix_index_unpin(x, 1);   /* 1 is now the newest */
    assert_true(ins(x, 4, 0, 0, t[3], 4, 100));   /* evicts 2 */
    assert_int_equal(prefix_index_replica(x, 2), -1);
    assert_true(ins(x, 5, 0, 0, t[4], 4, 150));   /* evicts 3 and 1 */
    uint64_t d[8];
    assert_int_equal(prefix_index_take_drops(x, 0, d, 8), 3);
    assert_int_equal(d[0], 2);
    assert_int_equal(d[1], 3);
    assert_int_equal(d[2], 1);
    assert_true(prefix_index_pin(x, 4, 4));   /* pinned: the older 4 stays, 5 goes */
    assert_true(ins(x, 6, 0, 0, t[5], 4, 200));
    assert_int_equal(prefix_index_take_drops(x, 0, d, 8), 1);
    assert_int_equal(d[0], 5);
    assert_int_equal(prefix_index_replica(x, 4), 0);
    prefix_index_stats st;
    prefix_index_get_stats(x, 0, &st);
    assert_int_equal(st.bytes, 300);
    assert_int_equal(st.evictions, 4);
    assert_int_equal(prefix_index_pending_drops(x, 1), 0);
    prefix_index_destroy(x);
}

/* Pinned entries leave no room: keep = false and nothing evicted (not even the unpinned). */
static void test_no_room_evicts_nothing(void **state)
{
    (void)state;
    prefix_index *x = make(1, BT, 300);
    int32_t a[4] = {1, 2, 3, 4}, b[4] = {5, 6, 7, 8}, c[4] = {9, 10, 11, 12}, e[8];
    seq(e, 8, 1);   /* extends a */
    assert_true(ins(x, 1, 0, 0, a, 4, 100));
    assert_true(ins(x, 2, 0, 0, b, 4, 150));
    assert_true(ins(x, 3, 0, 0, c, 4, 50));
    assert_true(prefix_index_pin(x, 1, 4));
    assert_true(prefix_index_pin(x, 2, 4));
    assert_false(ins(x, 4, 0, 0, e, 8, 100));   /* 250 pinned + 100 > 300 */
    assert_int_equal(prefix_index_pending_drops(x, 0), 0);
    assert_int_equal(prefix_index_replica(x, 3), 0);
    assert_int_equal(prefix_index_replica(x, 4), -1);
    assert_true(ins(x, 4, 0, 0, e, 8, 50));   /* 250 + 50 fits after evicting 3 (1 is pinned) */
    uint64_t d[4];
    assert_int_equal(prefix_index_take_drops(x, 0, d, 4), 1);
    assert_int_equal(d[0], 3);
    assert_int_equal(prefix_index_replica(x, 1), 0);
    prefix_index_stats st;
    prefix_index_get_stats(x, 0, &st);
    assert_int_equal(st.bytes, 300);
    assert_int_equal(st.inserts, 4);
    assert_int_equal(st.evictions, 1);
    prefix_index_destroy(x);
}

static void test_too_large_and_caching_off(void **state)
{
    (void)state;
    prefix_index *x = make(1, BT, 100);
    int32_t a[4] = {1, 2, 3, 4}, b[4] = {5, 6, 7, 8};
    assert_true(ins(x, 1, 0, 0, a, 4, 60));
    assert_false(ins(x, 2, 0, 0, b, 4, 101));   /* never fits */
    assert_int_equal(prefix_index_replica(x, 1), 0);
    assert_true(ins(x, 3, 0, 0, b, 4, 100));   /* exactly the budget: 1 goes */
    assert_int_equal(prefix_index_pending_drops(x, 0), 1);
    prefix_index_destroy(x);

    x = make(2, BT, 0);
    assert_false(ins(x, 1, 0, 0, a, 4, 0));
    assert_false(ins(x, 2, 1, 0, b, 4, 1));
    prefix_index_stats st;
    prefix_index_get_stats(x, -1, &st);
    assert_int_equal(st.entries, 0);
    assert_int_equal(st.inserts, 0);
    int32_t p[5] = {1, 2, 3, 4, 5};
    assert_int_equal(look(x, 0, p, 5, NULL).entry, 0);
    /* still validates */
    strata_error err = {0};
    bool keep = true;
    assert_int_equal(prefix_index_insert(x, 3, 0, 0, a, 3, 1, &keep, &err), STRATA_EINVAL);
    prefix_index_destroy(x);
}

static void test_pin_unpin(void **state)
{
    (void)state;
    prefix_index *x = make(1, BT, 100);
    int32_t a[4] = {1, 2, 3, 4}, b[4] = {5, 6, 7, 8};
    assert_false(prefix_index_pin(x, 1, 4));   /* unknown */
    prefix_index_unpin(x, 1);
    assert_true(ins(x, 1, 0, 0, a, 4, 100));
    assert_true(prefix_index_pin(x, 1, 4));
    assert_true(prefix_index_pin(x, 1, 4));   /* pins nest */
    prefix_index_unpin(x, 1);
    assert_false(ins(x, 2, 0, 0, b, 4, 100));   /* still pinned once */
    prefix_index_unpin(x, 1);
    prefix_index_unpin(x, 1);   /* not pinned: no-op */
    assert_true(ins(x, 2, 0, 0, b, 4, 100));
    assert_int_equal(prefix_index_replica(x, 1), -1);
    prefix_index_destroy(x);
}

/* remove queues the id (pinned or not); drops come out oldest first, partial takes keep the
 * rest. */
static void test_remove_and_take_drops(void **state)
{
    (void)state;
    prefix_index *x = make(2, BT, 1000);
    int32_t t[5][4];
    for (int i = 0; i < 5; i++)
        seq(t[i], 4, 10 * (i + 1));
    for (uint64_t id = 1; id <= 4; id++)
        assert_true(ins(x, id, 0, 0, t[id - 1], 4, 10));
    assert_true(ins(x, 5, 1, 0, t[4], 4, 10));
    assert_true(prefix_index_pin(x, 3, 4));
    prefix_index_remove(x, 2);
    prefix_index_remove(x, 3);   /* pinned: gone all the same, its pins with it */
    prefix_index_remove(x, 1);
    prefix_index_remove(x, 99);   /* unknown */
    prefix_index_unpin(x, 3);
    assert_int_equal(prefix_index_replica(x, 3), -1);
    int32_t p[5] = {30, 31, 32, 33, 34};   /* 3's ids and one more */
    assert_int_equal(look(x, 0, p, 5, NULL).entry, 0);
    assert_int_equal(prefix_index_pending_drops(x, 0), 3);
    assert_int_equal(prefix_index_pending_drops(x, 1), 0);
    uint64_t d[4] = {0};
    assert_int_equal(prefix_index_take_drops(x, 0, d, 0), 0);
    assert_int_equal(prefix_index_take_drops(x, 0, d, 1), 1);
    assert_int_equal(d[0], 2);
    assert_int_equal(prefix_index_pending_drops(x, 0), 2);
    prefix_index_remove(x, 5);
    assert_int_equal(prefix_index_pending_drops(x, 1), 1);
    assert_int_equal(prefix_index_take_drops(x, 0, d, 4), 2);
    assert_int_equal(d[0], 3);
    assert_int_equal(d[1], 1);
    assert_int_equal(prefix_index_take_drops(x, 0, d, 4), 0);
    assert_int_equal(prefix_index_take_drops(x, 7, d, 4), 0);
    assert_int_equal(prefix_index_pending_drops(x, -1), 0);
    prefix_index_stats st;
    prefix_index_get_stats(x, 0, &st);
    assert_int_equal(st.evictions, 3);
    assert_int_equal(st.entries, 1);
    assert_int_equal(st.bytes, 10);
    prefix_index_destroy(x);
}

/* A replica's workers restarted: its entries and queued drops are forgotten, its counters stay,
 * the other replica is untouched. */
static void test_forget_replica(void **state)
{
    (void)state;
    prefix_index *x = make(2, BT, 1000);
    int32_t t[8], u[4] = {7, 7, 7, 7};
    seq(t, 8, 1);
    assert_true(ins(x, 1, 0, 0, t, 8, 10));
    assert_true(ins(x, 2, 0, 0, u, 4, 10));
    assert_true(ins(x, 3, 1, 0, t, 4, 10));
    assert_true(ins(x, 4, 0, 1, t, 4, 10));
    assert_true(prefix_index_pin(x, 1, 8));
    prefix_index_remove(x, 2);
    prefix_index_forget_replica(x, 0);
    prefix_index_forget_replica(x, 5);   /* out of range: no-op */
    assert_int_equal(prefix_index_pending_drops(x, 0), 0);
    assert_int_equal(prefix_index_replica(x, 1), -1);
    assert_int_equal(prefix_index_replica(x, 4), -1);
    assert_int_equal(prefix_index_replica(x, 3), 1);
    bool only0[2] = {true, false};
    assert_int_equal(look(x, 0, t, 8, only0).entry, 0);
    prefix_hit h = look(x, 0, t, 8, NULL);
    assert_int_equal(h.entry, 3);
    prefix_index_stats st;
    prefix_index_get_stats(x, 0, &st);
    assert_int_equal(st.entries, 0);
    assert_int_equal(st.bytes, 0);
    assert_int_equal(st.inserts, 3);
    assert_int_equal(st.hits, 1);
    assert_int_equal(st.evictions, 1);
    assert_true(ins(x, 6, 0, 0, t, 8, 1000));   /* the whole budget is free again */
    assert_int_equal(prefix_index_pending_drops(x, 0), 0);
    prefix_index_destroy(x);
}

static void test_stats(void **state)
{
    (void)state;
    prefix_index *x = make(3, BT, 1000);
    int32_t t[8], u[8];
    seq(t, 8, 1);
    seq(u, 8, 50);
    assert_true(ins(x, 1, 0, 0, t, 8, 100));
    assert_true(ins(x, 2, 1, 0, t, 8, 200));
    assert_true(ins(x, 3, 1, 0, u, 8, 300));
    assert_true(prefix_index_pin(x, 1, 8));
    assert_true(prefix_index_pin(x, 2, 4));
    assert_true(prefix_index_pin(x, 2, 8));
    prefix_index_remove(x, 3);
    prefix_index_stats s0, s1, s2, all;
    prefix_index_get_stats(x, 0, &s0);
    prefix_index_get_stats(x, 1, &s1);
    prefix_index_get_stats(x, 2, &s2);
    prefix_index_get_stats(x, -1, &all);
    assert_int_equal(s0.entries, 1);
    assert_int_equal(s0.bytes, 100);
    assert_int_equal(s0.hits, 1);
    assert_int_equal(s0.hit_tokens, 8);
    assert_int_equal(s0.inserts, 1);
    assert_int_equal(s0.evictions, 0);
    assert_int_equal(s1.entries, 1);
    assert_int_equal(s1.bytes, 200);
    assert_int_equal(s1.hits, 2);
    assert_int_equal(s1.hit_tokens, 12);
    assert_int_equal(s1.inserts, 2);
    assert_int_equal(s1.evictions, 1);
    assert_int_equal(s2.entries, 0);
    assert_int_equal(s2.inserts, 0);
    assert_int_equal(all.entries, 2);
    assert_int_equal(all.bytes, 300);
    assert_int_equal(all.hits, 3);
    assert_int_equal(all.hit_tokens, 20);
    assert_int_equal(all.inserts, 3);
    assert_int_equal(all.evictions, 1);
    prefix_index_destroy(x);
}

/* ---- randomized run against a model ---- */

#define SIM_REPLICAS 2
#define SIM_BT 4
#define SIM_MAX_TOKENS 32
#define SIM_MAX_ENTRIES 4000
#define SIM_BUDGET 1000

enum { M_NONE, M_ALIVE, M_QUEUED, M_GONE };   /* M_NONE: offered, not kept */

typedef struct model_entry {
    int state;
    int replica, plan;
    int32_t tokens[SIM_MAX_TOKENS];
    size_t n;
    uint64_t bytes;
    unsigned pins;
} model_entry;

typedef struct model {
    model_entry e[SIM_MAX_ENTRIES + 1];   /* by id; id 0 unused */
    uint64_t next_id;
} model;

static uint64_t pick(uint64_t *rng, uint64_t n) { return rng_next(rng) % n; }

/* A random entry id in state want (0 when none), uniform over the candidates. */
static uint64_t random_in(const model *m, uint64_t *rng, int want, bool pinned_only)
{
    uint64_t chosen = 0, seen = 0;
    for (uint64_t id = 1; id < m->next_id; id++) {
        const model_entry *e = &m->e[id];
        if (e->state != want || (pinned_only && e->pins == 0))
            continue;
        if (pick(rng, ++seen) == 0)
            chosen = id;
    }
    return chosen;
}

/* Ids drawn from a few base sequences so that prefixes are shared, extended and diverge. */
static size_t random_tokens(uint64_t *rng, int32_t *t)
{
    size_t n = SIM_BT * (1 + (size_t)pick(rng, SIM_MAX_TOKENS / SIM_BT));
    int32_t base = (int32_t)pick(rng, 3) * 1000;
    size_t diverge = (size_t)pick(rng, 2 * n);   /* past n: never */
    for (size_t i = 0; i < n; i++)
        t[i] = base + (int32_t)i + (i >= diverge ? 500 : 0);
    return n;
}

/* After every operation: whatever vanished from the index was alive and unpinned (or removed
 * on purpose), is now queued, and is no longer found; what is alive is found on its replica;
 * bytes match and stay within the budget; queued counts match; drained ids were queued. */
static void check(prefix_index *x, model *m, uint64_t removed, uint64_t *rng)
{
    uint64_t bytes[SIM_REPLICAS] = {0};
    size_t entries[SIM_REPLICAS] = {0}, queued[SIM_REPLICAS] = {0};
    for (uint64_t id = 1; id < m->next_id; id++) {
        model_entry *e = &m->e[id];
        int r = prefix_index_replica(x, id);
        if (e->state == M_ALIVE && r < 0) {
            if (id != removed && e->pins != 0)
                fail_msg("pinned entry %llu was evicted", (unsigned long long)id);
            e->state = M_QUEUED;
            e->pins = 0;
        }
        if (e->state == M_ALIVE) {
            assert_int_equal(r, e->replica);
            bytes[r] += e->bytes;
            entries[r]++;
        } else {
            assert_int_equal(r, -1);
        }
        if (e->state == M_QUEUED)
            queued[e->replica]++;
    }
    for (int r = 0; r < SIM_REPLICAS; r++) {
        prefix_index_stats st;
        prefix_index_get_stats(x, r, &st);
        assert_true(st.bytes <= SIM_BUDGET);
        assert_int_equal(st.bytes, bytes[r]);
        assert_int_equal(st.entries, entries[r]);
        assert_int_equal(prefix_index_pending_drops(x, r), queued[r]);
        /* drain some of the queue now and then, the rest later */
        if (pick(rng, 3) != 0)
            continue;
        uint64_t d[8];
        size_t n = prefix_index_take_drops(x, r, d, (size_t)pick(rng, 6));
        for (size_t i = 0; i < n; i++) {
            assert_true(d[i] > 0 && d[i] < m->next_id);
            model_entry *e = &m->e[d[i]];
            if (e->state != M_QUEUED || e->replica != r)
                fail_msg("dropped id %llu was not evicted from replica %d", (unsigned long long)d[i], r);
            e->state = M_GONE;
            int32_t p[SIM_MAX_TOKENS + 1];
            memcpy(p, e->tokens, e->n * sizeof *p);
            p[e->n] = -1;
            prefix_hit h;
            prefix_index_lookup(x, e->plan, p, e->n + 1, NULL, &h);
            assert_true(h.entry != d[i]);
        }
    }
}

static void test_randomized(void **state)
{
    (void)state;
    model *m = calloc(1, sizeof *m);
    assert_non_null(m);
    m->next_id = 1;
    uint64_t rng = 0x5eed1234ull;
    prefix_index *x = make(SIM_REPLICAS, SIM_BT, SIM_BUDGET);
    size_t kept = 0, refused = 0, hits = 0;
    for (int step = 0; step < 6000 && m->next_id <= SIM_MAX_ENTRIES; step++) {
        uint64_t removed = 0;
        int op = (int)pick(&rng, 100);
        if (op < 40) {   /* offer a finished sequence's prefix */
            uint64_t id = m->next_id++;
            model_entry *e = &m->e[id];
            e->replica = (int)pick(&rng, SIM_REPLICAS);
            e->plan = (int)pick(&rng, 2);
            e->n = random_tokens(&rng, e->tokens);
            e->bytes = 20 * e->n + pick(&rng, 200);
            uint64_t pinned = 0;
            bool covered = false;
            for (uint64_t j = 1; j < id; j++) {
                const model_entry *o = &m->e[j];
                if (o->state != M_ALIVE || o->replica != e->replica)
                    continue;
                if (o->pins)
                    pinned += o->bytes;
                if (o->plan == e->plan && o->n >= e->n && !memcmp(o->tokens, e->tokens, e->n * sizeof *e->tokens))
                    covered = true;
            }
            size_t alive_before = 0;
            for (uint64_t j = 1; j < id; j++)
                alive_before += m->e[j].state == M_ALIVE;
            bool keep = ins(x, id, e->replica, e->plan, e->tokens, e->n, e->bytes);
            /* kept exactly when not covered and the pinned entries leave room */
            assert_int_equal(keep, !covered && pinned + e->bytes <= SIM_BUDGET);
            if (keep) {
                e->state = M_ALIVE;
                kept++;
            } else {
                /* refused: nothing was evicted for it */
                size_t alive_after = 0;
                for (uint64_t j = 1; j < id; j++)
                    alive_after += m->e[j].state == M_ALIVE && prefix_index_replica(x, j) >= 0;
                assert_int_equal(alive_after, alive_before);
                refused++;
            }
        } else if (op < 65) {   /* a request looks up a prompt and starts from the hit */
            int32_t p[SIM_MAX_TOKENS + 8];
            size_t n0 = random_tokens(&rng, p), n = n0 + (size_t)pick(&rng, 8);
            for (size_t i = n0; i < n; i++)
                p[i] = -2;
            bool usable[SIM_REPLICAS] = {true, pick(&rng, 4) != 0};
            prefix_hit h;
            int plan = (int)pick(&rng, 2);
            if (prefix_index_lookup(x, plan, p, n, usable, &h)) {
                model_entry *e = &m->e[h.entry];
                assert_int_equal(e->state, M_ALIVE);
                assert_int_equal(e->plan, plan);
                assert_true(usable[h.replica]);
                assert_true(h.n_tokens % SIM_BT == 0 && h.n_tokens < n && h.n_tokens <= e->n);
                assert_memory_equal(e->tokens, p, h.n_tokens * sizeof *p);
                assert_true(prefix_index_pin(x, h.entry, h.n_tokens));
                e->pins++;
                hits++;
            }
        } else if (op < 90) {   /* a request that started from an entry ends */
            uint64_t id = random_in(m, &rng, M_ALIVE, true);
            if (id) {
                prefix_index_unpin(x, id);
                m->e[id].pins--;
            }
        } else if (op < 97) {   /* a copy failed on a worker */
            uint64_t id = random_in(m, &rng, M_ALIVE, false);
            if (id) {
                prefix_index_remove(x, id);
                removed = id;
            }
        } else {   /* a replica's workers restart */
            int r = (int)pick(&rng, SIM_REPLICAS);
            prefix_index_forget_replica(x, r);
            for (uint64_t id = 1; id < m->next_id; id++)
                if (m->e[id].replica == r && (m->e[id].state == M_ALIVE || m->e[id].state == M_QUEUED)) {
                    m->e[id].state = M_GONE;
                    m->e[id].pins = 0;
                }
        }
        check(x, m, removed, &rng);
    }
    /* the run exercised every path */
    prefix_index_stats st;
    prefix_index_get_stats(x, -1, &st);
    assert_true(kept > 100 && refused > 20 && hits > 100);
    assert_true(st.evictions > 50);
    assert_int_equal(st.inserts, kept);
    assert_int_equal(st.hits, hits);
    prefix_index_destroy(x);
    free(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_create_errors),
        cmocka_unit_test(test_lookup_longest_and_usable),
        cmocka_unit_test(test_lookup_cuts),
        cmocka_unit_test(test_lookup_ties),
        cmocka_unit_test(test_insert_errors),
        cmocka_unit_test(test_insert_covered),
        cmocka_unit_test(test_insert_extension),
        cmocka_unit_test(test_lru_eviction),
        cmocka_unit_test(test_no_room_evicts_nothing),
        cmocka_unit_test(test_too_large_and_caching_off),
        cmocka_unit_test(test_pin_unpin),
        cmocka_unit_test(test_remove_and_take_drops),
        cmocka_unit_test(test_forget_replica),
        cmocka_unit_test(test_stats),
        cmocka_unit_test(test_randomized),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
