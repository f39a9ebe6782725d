/* The host tier (offload/host_arena.h): round trips of real blocks of varying size, page
 * accounting, fragmentation reported as EFULL with its picture, stale and double frees, the
 * allocator seam, and a randomized put/free run checked against a model. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kvstore/sysmem.h"
#include "offload/extent.h"
#include "offload/host_arena.h"
#include "tests/offload_blocks.h"

static size_t pages_of(size_t len) { return (len + HOST_ARENA_PAGE - 1) / HOST_ARENA_PAGE; }

static void test_round_trip_varied_blocks(void **state)
{
    (void)state;
    strata_error err = {0};
    host_arena *a = host_arena_create(8u << 20, NULL, &err);
    assert_non_null(a);
    assert_int_equal(host_arena_capacity(a), 8u << 20);
    assert_true((uintptr_t)host_arena_base(a) % HOST_ARENA_PAGE == 0);
    enum { N = 48 };
    uint8_t *blocks[N];
    size_t sizes[N];
    host_handle h[N];
    size_t used = 0, stored = 0;
    for (unsigned i = 0; i < N; i++) {
        blocks[i] = ob_varied_block(i, i == 31, &sizes[i]);
        assert_non_null(blocks[i]);
        assert_int_equal(host_arena_put(a, blocks[i], sizes[i], &h[i], &err), STRATA_OK);
        assert_true(h[i] != 0);
        used += pages_of(sizes[i]) * HOST_ARENA_PAGE;
        stored += sizes[i];
    }
    assert_int_equal(host_arena_used_bytes(a), used);
    assert_int_equal(host_arena_free_bytes(a), (8u << 20) - used);
    assert_int_equal(host_arena_stored_bytes(a), stored);
    assert_int_equal(host_arena_count(a), N);
    for (unsigned i = 0; i < N; i++) {
        size_t len = 0;
        uint8_t *p = host_arena_get(a, h[i], &len);
        assert_non_null(p);
        assert_true((uintptr_t)p % HOST_ARENA_PAGE == 0);
        assert_int_equal(len, sizes[i]);
        assert_memory_equal(p, blocks[i], sizes[i]);
        assert_int_equal(kv_block_verify(p, len, NULL, &err), STRATA_OK);
        /* The slack of the last page is zero. */
        for (size_t j = len; j < pages_of(len) * HOST_ARENA_PAGE; j++)
            assert_int_equal(p[j], 0);
    }
    for (unsigned i = 0; i < N; i += 2)
        assert_int_equal(host_arena_free(a, h[i], &err), STRATA_OK);
    for (unsigned i = 1; i < N; i += 2) {
        size_t len;
        uint8_t *p = host_arena_get(a, h[i], &len);
        assert_memory_equal(p, blocks[i], sizes[i]);
    }
    for (unsigned i = 1; i < N; i += 2)
        assert_int_equal(host_arena_free(a, h[i], &err), STRATA_OK);
    assert_int_equal(host_arena_used_bytes(a), 0);
    assert_int_equal(host_arena_count(a), 0);
    assert_int_equal(host_arena_largest_free(a), 8u << 20);
    for (unsigned i = 0; i < N; i++)
        free(blocks[i]);
    host_arena_destroy(a);
}

static void test_full_and_fragmented(void **state)
{
    (void)state;
    strata_error err = {0};
    /* 16 pages; the budget is rounded down to whole pages. */
    host_arena *a = host_arena_create(16 * HOST_ARENA_PAGE + 100, NULL, &err);
    assert_non_null(a);
    assert_int_equal(host_arena_capacity(a), 16 * HOST_ARENA_PAGE);
    size_t size;
    uint8_t *b = ob_make_block(KV_CODEC_KIVI, 2, 3, 64, 64, 0, 1, &size);  /* 9,344 bytes: 3 pages */
    assert_non_null(b);
    assert_int_equal(pages_of(size), 3);
    host_handle h[5];
    for (int i = 0; i < 5; i++)
        assert_int_equal(host_arena_put(a, b, size, &h[i], &err), STRATA_OK);
    /* 15 pages used, 1 free: a sixth block does not fit. */
    host_handle hx;
    assert_int_equal(host_arena_put(a, b, size, &hx, &err), STRATA_EFULL);
    assert_non_null(strstr(err.msg, "host arena full"));
    /* Free blocks 1 and 3: 7 pages free, but in holes of 3, 3 and 1 pages. */
    assert_int_equal(host_arena_free(a, h[1], &err), STRATA_OK);
    assert_int_equal(host_arena_free(a, h[3], &err), STRATA_OK);
    assert_int_equal(host_arena_free_bytes(a), 7 * HOST_ARENA_PAGE);
    assert_int_equal(host_arena_largest_free(a), 3 * HOST_ARENA_PAGE);
    size_t big;
    uint8_t *b2 = ob_make_block(KV_CODEC_KIVI, 4, 3, 64, 64, 0, 2, &big);  /* 15,488 bytes: 4 pages */
    assert_non_null(b2);
    assert_int_equal(pages_of(big), 4);
    host_handle hb;
    memset(&err, 0, sizeof err);
    assert_int_equal(host_arena_put(a, b2, big, &hb, &err), STRATA_EFULL);
    assert_int_equal(err.code, STRATA_EFULL);
    /* The message tells the whole picture: request, free space, holes, largest. */
    assert_non_null(strstr(err.msg, "no free extent of 16 KiB"));
    assert_non_null(strstr(err.msg, "28 KiB free"));
    assert_non_null(strstr(err.msg, "3 holes"));
    assert_non_null(strstr(err.msg, "largest 12 KiB"));
    /* Nothing changed by the failure; the arena keeps working. */
    assert_int_equal(host_arena_count(a), 3);
    host_handle h2;
    assert_int_equal(host_arena_put(a, b, size, &h2, &err), STRATA_OK);
    /* Freeing neighbours merges holes: then the large block fits. */
    assert_int_equal(host_arena_free(a, h[2], &err), STRATA_OK);
    assert_int_equal(host_arena_put(a, b2, big, &hb, &err), STRATA_OK);
    size_t len;
    assert_memory_equal(host_arena_get(a, hb, &len), b2, big);
    assert_memory_equal(host_arena_get(a, h2, &len), b, size);
    free(b);
    free(b2);
    host_arena_destroy(a);
}

static void test_bad_handles(void **state)
{
    (void)state;
    strata_error err = {0};
    host_arena *a = host_arena_create(1u << 20, NULL, &err);
    assert_non_null(a);
    uint8_t x[100] = {1, 2, 3};
    host_handle h, h2;
    assert_int_equal(host_arena_put(a, x, sizeof x, &h, &err), STRATA_OK);
    assert_int_equal(host_arena_free(a, h, &err), STRATA_OK);
    /* Double free and use after free are rejected, even once the slot is reused. */
    assert_int_equal(host_arena_free(a, h, &err), STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "invalid or already freed"));
    assert_null(host_arena_get(a, h, NULL));
    assert_int_equal(host_arena_put(a, x, sizeof x, &h2, &err), STRATA_OK);
    assert_true(h2 != h);
    assert_null(host_arena_get(a, h, NULL));
    assert_int_equal(host_arena_free(a, h, &err), STRATA_EINVAL);
    assert_non_null(host_arena_get(a, h2, NULL));
    assert_int_equal(host_arena_free(a, 0, &err), STRATA_EINVAL);
    assert_int_equal(host_arena_free(a, 12345, &err), STRATA_EINVAL);
    assert_int_equal(host_arena_put(a, x, 0, &h, &err), STRATA_EINVAL);
    assert_int_equal(host_arena_put(a, NULL, 10, &h, &err), STRATA_EINVAL);
    /* A block larger than the arena. */
    assert_int_equal(host_arena_put(a, x, (2u << 20), &h, &err), STRATA_EFULL);
    host_arena_destroy(a);
    assert_null(host_arena_create(4095, NULL, &err));
    assert_int_equal(err.code, STRATA_EINVAL);
    /* More than the machine has is refused before anything is allocated (overcommit would grant
     * it, and the OOM killer end the process once the tier fills). */
    const size_t limit = strata_memory_limit();
    assert_true(limit > (64u << 20) && limit < SIZE_MAX / 2);
    assert_null(host_arena_create(limit + 2 * HOST_ARENA_PAGE, NULL, &err));
    assert_int_equal(err.code, STRATA_EINVAL);
    if (!strstr(err.msg, "host arena") || !strstr(err.msg, "MiB is more than this machine lets the process have"))
        fail_msg("%s", err.msg);
    a = host_arena_create(64u << 20, NULL, &err);   /* within it: fine */
    assert_non_null(a);
    host_arena_destroy(a);
}

typedef struct counting_alloc {
    int allocs, releases;
    size_t bytes;
    int misalign;
} counting_alloc;

static void *count_alloc(size_t bytes, void *ctx, strata_error *err)
{
    counting_alloc *c = ctx;
    (void)err;
    c->allocs++;
    c->bytes = bytes;
    uint8_t *p = aligned_alloc(HOST_ARENA_PAGE, bytes + HOST_ARENA_PAGE);
    return p && c->misalign ? p + 64 : p;
}

static void count_release(void *ptr, size_t bytes, void *ctx)
{
    counting_alloc *c = ctx;
    assert_int_equal(bytes, c->bytes);
    c->releases++;
    free(c->misalign ? (uint8_t *)ptr - 64 : ptr);
}

static void test_allocator_seam(void **state)
{
    (void)state;
    strata_error err = {0};
    counting_alloc c = {0};
    host_arena_allocator al = {"test pinned", count_alloc, count_release, &c};
    host_arena *a = host_arena_create(64 * 1024, &al, &err);
    assert_non_null(a);
    assert_string_equal(host_arena_describe(a), "test pinned");
    assert_int_equal(c.allocs, 1);
    assert_int_equal(c.bytes, 64 * 1024);
    uint8_t x[5000];
    memset(x, 7, sizeof x);
    host_handle h;
    uint8_t *p;
    assert_int_equal(host_arena_reserve(a, sizeof x, &h, &p, &err), STRATA_OK);
    memcpy(p, x, sizeof x);
    size_t len;
    assert_memory_equal(host_arena_get(a, h, &len), x, sizeof x);
    host_arena_destroy(a);
    assert_int_equal(c.releases, 1);
    /* An allocator that returns unaligned memory is refused, and its memory given back. */
    c = (counting_alloc){.misalign = 1};
    assert_null(host_arena_create(64 * 1024, &al, &err));
    assert_int_equal(err.code, STRATA_EINVAL);
    assert_int_equal(c.releases, 1);
}

/* Random puts and frees against a model; every live block keeps its bytes; page accounting is
 * exact at every step. */
static void test_random_against_model(void **state)
{
    (void)state;
    strata_error err = {0};
    host_arena *a = host_arena_create(2u << 20, NULL, &err);
    assert_non_null(a);
    enum { NB = 16, LIVE = 128 };
    uint8_t *blk[NB];
    size_t bsz[NB];
    for (unsigned i = 0; i < NB; i++) {
        blk[i] = ob_varied_block(i, 0, &bsz[i]);
        assert_non_null(blk[i]);
    }
    host_handle live[LIVE];
    unsigned which[LIVE], n = 0;
    size_t pages = 0;
    uint64_t seed = 99;
    int fulls = 0;
    for (int it = 0; it < 4000; it++) {
        if (n < LIVE && (n == 0 || rng_next(&seed) % 3 != 0)) {
            unsigned w = (unsigned)(rng_next(&seed) % NB);
            host_handle h;
            int rc = host_arena_put(a, blk[w], bsz[w], &h, &err);
            if (rc == STRATA_EFULL) {
                fulls++;
                /* Honest: EFULL only if no hole is large enough. */
                assert_true(host_arena_largest_free(a) < pages_of(bsz[w]) * HOST_ARENA_PAGE);
            } else {
                assert_int_equal(rc, STRATA_OK);
                live[n] = h;
                which[n++] = w;
                pages += pages_of(bsz[w]);
            }
        } else {
            unsigned k = (unsigned)(rng_next(&seed) % n);
            size_t len;
            uint8_t *p = host_arena_get(a, live[k], &len);
            assert_non_null(p);
            assert_int_equal(len, bsz[which[k]]);
            assert_memory_equal(p, blk[which[k]], len);
            assert_int_equal(host_arena_free(a, live[k], &err), STRATA_OK);
            pages -= pages_of(len);
            live[k] = live[--n];
            which[k] = which[n];
        }
        assert_int_equal(host_arena_used_bytes(a), pages * HOST_ARENA_PAGE);
        assert_int_equal(host_arena_count(a), n);
    }
    assert_true(fulls > 0);  /* the run did exercise a full arena */
    for (unsigned k = 0; k < n; k++) {
        size_t len;
        assert_memory_equal(host_arena_get(a, live[k], &len), blk[which[k]], bsz[which[k]]);
    }
    for (unsigned i = 0; i < NB; i++)
        free(blk[i]);
    host_arena_destroy(a);
}

/* The extent allocator on its own: first fit, merging, double-free detection, what fits. */
static void test_extents(void **state)
{
    (void)state;
    off_extents x;
    assert_int_equal(off_extents_init(&x, 10, NULL), STRATA_OK);
    uint64_t a, b, c, d;
    assert_int_equal(off_extents_alloc(&x, 3, &a), STRATA_OK);
    assert_int_equal(off_extents_alloc(&x, 3, &b), STRATA_OK);
    assert_int_equal(off_extents_alloc(&x, 3, &c), STRATA_OK);
    assert_true(a == 0 && b == 3 && c == 6);
    assert_int_equal(off_extents_alloc(&x, 2, &d), STRATA_EFULL);
    assert_int_equal(off_extents_free(&x, b, 3), STRATA_OK);
    assert_int_equal(off_extents_free(&x, b, 3), STRATA_EINVAL);     /* double free */
    assert_int_equal(off_extents_free(&x, 2, 2), STRATA_EINVAL);     /* overlaps the hole */
    assert_int_equal(off_extents_free(&x, 9, 5), STRATA_EINVAL);     /* out of range */
    assert_int_equal(off_extents_largest(&x), 3);
    /* holes [3,6) and [9,10): what fits counts whole allocations per hole */
    assert_int_equal(off_extents_fit(&x, 1), 4);
    assert_int_equal(off_extents_fit(&x, 2), 1);
    assert_int_equal(off_extents_fit(&x, 3), 1);
    assert_int_equal(off_extents_fit(&x, 4), 0);
    assert_int_equal(off_extents_free(&x, a, 3), STRATA_OK);         /* merges with b's hole */
    assert_int_equal(off_extents_largest(&x), 6);
    assert_int_equal(off_extents_fit(&x, 2), 3);
    assert_int_equal(off_extents_free(&x, c, 3), STRATA_OK);         /* everything merges */
    assert_int_equal(x.n, 1);
    assert_int_equal(off_extents_largest(&x), 10);
    assert_int_equal(off_extents_alloc(&x, 10, &d), STRATA_OK);
    assert_int_equal(x.free_units, 0);
    off_extents_fini(&x);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip_varied_blocks),
        cmocka_unit_test(test_full_and_fragmented),
        cmocka_unit_test(test_bad_handles),
        cmocka_unit_test(test_allocator_seam),
        cmocka_unit_test(test_random_against_model),
        cmocka_unit_test(test_extents),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
