/* The NVMe store against calls its contract forbids: each must be refused with STRATA_EINVAL and
 * leave every stored block intact, never corrupt another block or hang.
 *  - freeing a range that is not exactly one stored block (a page inside one, a shorter or longer
 *    length, two blocks at once) or a block whose write has not completed;
 *  - reading a location that holds no stored block (never written, being written, freed);
 *  - a block longer than a location can describe;
 *  - a call from a thread other than the store's creator (the ring takes submissions from that
 *    thread only: before the check, such a call waited for ever);
 * and destroy deleting only the slab files it created. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
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

#include "offload/nvme_store.h"
#include "tests/offload_blocks.h"
#include "test_dir.h"

typedef struct fixture {
    char base[64];
    char dir[96];
    nvme_store *st;
} fixture;

static void open_fixture(fixture *f, bool sync_io)
{
    snprintf(f->base, sizeof f->base, "/tmp/strata-misuse-XXXXXX");
    assert_non_null(mkdtemp(f->base));
    snprintf(f->dir, sizeof f->dir, "%s/spill", f->base);
    nvme_store_options o;
    nvme_store_options_init(&o, f->dir, 8u << 20);
    o.force_sync_io = sync_io;
    strata_error err = {0};
    f->st = nvme_store_create(&o, &err);
    if (!f->st)
        fail_msg("nvme_store_create: %s", err.msg);
}

static void close_fixture(fixture *f)
{
    nvme_store_destroy(f->st);
    test_dir_remove_tree(f->base);
}

static void expect_refused(int rc, const strata_error *err, int code, const char *words)
{
    assert_int_equal(rc, code);
    if (!strstr(err->msg, words))
        fail_msg("expected '%s' in: %s", words, err->msg);
}

/* A block of exactly pages pages' worth of data or less (seed varies the bytes). */
static uint8_t *block_of(int tokens, uint64_t seed, size_t *len)
{
    uint8_t *b = ob_make_block(KV_CODEC_FP16, 16, 2, 64, tokens, 0, seed, len);
    assert_non_null(b);
    return b;
}

static void assert_reads_back(nvme_store *st, const nvme_loc *loc, const uint8_t *want, size_t len)
{
    uint8_t *back = malloc(len);
    assert_non_null(back);
    strata_error err = {0};
    if (nvme_store_read(st, loc, back, len, 1, &err) != STRATA_OK)
        fail_msg("read: %s", err.msg);
    assert_memory_equal(back, want, len);
    free(back);
}

static void test_free_needs_an_exact_stored_block(void **state)
{
    (void)state;
    for (int sync_io = 0; sync_io <= 1; sync_io++) {
        fixture f;
        open_fixture(&f, sync_io);
        size_t la, lb;
        uint8_t *a = block_of(64, 1, &la);
        uint8_t *b = block_of(16, 2, &lb);
        const uint64_t pages_a = (la + NVME_PAGE - 1) / NVME_PAGE, pages_b = (lb + NVME_PAGE - 1) / NVME_PAGE;
        assert_true(pages_a >= 3 && pages_b >= 1);
        strata_error err = {0};
        nvme_loc A, B;
        assert_int_equal(nvme_store_write(f.st, a, la, 1, &A, &err), STRATA_OK);
        assert_int_equal(nvme_store_write(f.st, b, lb, 2, &B, &err), STRATA_OK);
        assert_int_equal(B.offset, A.offset + pages_a * NVME_PAGE);   /* first fit: packed */

        nvme_loc inside = {.slab = A.slab, .len = NVME_PAGE, .offset = A.offset + NVME_PAGE};
        expect_refused(nvme_store_free(f.st, &inside, &err), &err, STRATA_EINVAL, "not a stored block");
        nvme_loc shorter = A;
        shorter.len = 2 * NVME_PAGE;
        expect_refused(nvme_store_free(f.st, &shorter, &err), &err, STRATA_EINVAL, "not a stored block");
        nvme_loc both = {.slab = A.slab, .len = (uint32_t)(pages_a * NVME_PAGE + lb), .offset = A.offset};
        expect_refused(nvme_store_free(f.st, &both, &err), &err, STRATA_EINVAL, "not a stored block");
        nvme_loc past = {.slab = A.slab, .len = 1, .offset = UINT64_MAX - NVME_PAGE + 1};
        expect_refused(nvme_store_free(f.st, &past, &err), &err, STRATA_EINVAL, "not a stored block");
        nvme_store_stats ss;
        nvme_store_get_stats(f.st, &ss);
        assert_int_equal(ss.blocks_stored, 2);

        /* The refused frees left both blocks where they were: a new block does not land in A. */
        nvme_loc C;
        size_t lc;
        uint8_t *c = block_of(16, 3, &lc);
        assert_int_equal(nvme_store_write(f.st, c, lc, 3, &C, &err), STRATA_OK);
        assert_true(C.offset >= B.offset + pages_b * NVME_PAGE);
        assert_reads_back(f.st, &A, a, la);
        assert_reads_back(f.st, &B, b, lb);

        /* Reading where no block is stored is refused too, as is reading a freed block. */
        uint8_t *back = malloc(la);
        assert_non_null(back);
        uint64_t t;
        expect_refused(nvme_store_submit_read(f.st, &inside, back, la, 9, &t, &err), &err, STRATA_EINVAL,
                       "holds no stored block");
        assert_int_equal(nvme_store_free(f.st, &A, &err), STRATA_OK);
        expect_refused(nvme_store_free(f.st, &A, &err), &err, STRATA_EINVAL, "not a stored block");
        expect_refused(nvme_store_submit_read(f.st, &A, back, la, 9, &t, &err), &err, STRATA_EINVAL,
                       "holds no stored block");
        assert_int_equal(nvme_store_free(f.st, &B, &err), STRATA_OK);
        assert_int_equal(nvme_store_free(f.st, &C, &err), STRATA_OK);
        nvme_store_get_stats(f.st, &ss);
        assert_int_equal(ss.blocks_stored, 0);
        assert_int_equal(ss.free_bytes, ss.capacity_bytes);
        free(back);
        free(a);
        free(b);
        free(c);
        close_fixture(&f);
    }
}

/* A write's location is known at submit; freeing it before the completion used to hand its
 * extent to the next block while the write still ran, and a later failure of that write freed
 * the new block's extent (the store then returned another block's bytes with STRATA_OK). The
 * check is the same on both paths. */
static void test_free_of_a_write_in_flight_refused(void **state)
{
    (void)state;
    {   /* The pread/pwrite path writes in poll or wait: the write is surely still to complete. */
        fixture f;
        open_fixture(&f, true);
        size_t la;
        uint8_t *a = block_of(64, 4, &la);
        strata_error err = {0};
        uint64_t t;
        nvme_loc A;
        assert_int_equal(nvme_store_submit_write(f.st, a, la, 1, &t, &A, &err), STRATA_OK);
        expect_refused(nvme_store_free(f.st, &A, &err), &err, STRATA_EINVAL, "write has not completed");
        uint8_t *back = malloc(la);
        assert_non_null(back);
        uint64_t t2;
        expect_refused(nvme_store_submit_read(f.st, &A, back, la, 1, &t2, &err), &err, STRATA_EINVAL,
                       "holds no stored block");
        nvme_completion c;
        assert_int_equal(nvme_store_wait_ticket(f.st, t, &c), STRATA_OK);
        assert_reads_back(f.st, &A, a, la);
        assert_int_equal(nvme_store_free(f.st, &A, &err), STRATA_OK);
        free(back);
        free(a);
        close_fixture(&f);
    }
}

static void test_block_too_long_for_a_location(void **state)
{
    (void)state;
    fixture f;
    open_fixture(&f, false);
    uint8_t small[64] = {0};
    strata_error err = {0};
    uint64_t t;
    /* Refused on the length alone, before a byte is read. */
    expect_refused(nvme_store_submit_write(f.st, small, (size_t)UINT32_MAX - 100, 1, &t, NULL, &err), &err,
                   STRATA_EINVAL, "more than a location holds");
    close_fixture(&f);
}

typedef struct foreign_call {
    nvme_store *st;
    const uint8_t *block;
    size_t len;
    nvme_loc loc;
    int write_rc, read_rc, free_rc;
    size_t polled, waited;
    strata_error err;
} foreign_call;

static void *call_from_another_thread(void *arg)
{
    foreign_call *c = arg;
    c->write_rc = nvme_store_write(c->st, c->block, c->len, 7, NULL, &c->err);
    uint8_t back[64];
    uint64_t t;
    strata_error e = {0};
    c->read_rc = nvme_store_submit_read(c->st, &c->loc, back, sizeof back, 7, &t, &e);
    c->free_rc = nvme_store_free(c->st, &c->loc, &e);
    nvme_completion done;
    c->polled = nvme_store_poll(c->st, &done, 1);
    c->waited = nvme_store_wait(c->st, &done, 1);
    return NULL;
}

static void test_other_thread_refused(void **state)
{
    (void)state;
    for (int sync_io = 0; sync_io <= 1; sync_io++) {
        fixture f;
        open_fixture(&f, sync_io);
        size_t len;
        uint8_t *b = block_of(32, 5, &len);
        strata_error err = {0};
        nvme_loc L;
        assert_int_equal(nvme_store_write(f.st, b, len, 1, &L, &err), STRATA_OK);
        /* One request pending on the creator's side: the other thread must not take it. */
        uint64_t t;
        nvme_loc L2;
        assert_int_equal(nvme_store_submit_write(f.st, b, len, 2, &t, &L2, &err), STRATA_OK);
        foreign_call c = {.st = f.st, .block = b, .len = len, .loc = L};
        pthread_t th;
        assert_int_equal(pthread_create(&th, NULL, call_from_another_thread, &c), 0);
        assert_int_equal(pthread_join(th, NULL), 0);
        expect_refused(c.write_rc, &c.err, STRATA_EINVAL, "thread other than the one that created it");
        assert_int_equal(c.read_rc, STRATA_EINVAL);
        assert_int_equal(c.free_rc, STRATA_EINVAL);
        assert_int_equal(c.polled + c.waited, 0);
        nvme_completion done;
        assert_int_equal(nvme_store_wait_ticket(f.st, t, &done), STRATA_OK);
        assert_reads_back(f.st, &L, b, len);
        assert_reads_back(f.st, &L2, b, len);
        free(b);
        close_fixture(&f);
    }
}

/* destroy deletes the files it created, not a file put under a slab's name since. */
static void test_destroy_keeps_a_replaced_file(void **state)
{
    (void)state;
    fixture f;
    open_fixture(&f, false);
    char slab[160];
    snprintf(slab, sizeof slab, "%s/slab-0000.kv", f.dir);
    assert_int_equal(unlink(slab), 0);
    int fd = open(slab, O_CREAT | O_WRONLY | O_EXCL, 0600);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, "user data\n", 10), 10);
    close(fd);
    nvme_store_destroy(f.st);
    struct stat sb;
    assert_int_equal(stat(slab, &sb), 0);
    assert_int_equal(sb.st_size, 10);
    test_dir_remove_tree(f.base);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_free_needs_an_exact_stored_block),
        cmocka_unit_test(test_free_of_a_write_in_flight_refused),
        cmocka_unit_test(test_block_too_long_for_a_location),
        cmocka_unit_test(test_other_thread_refused),
        cmocka_unit_test(test_destroy_keeps_a_replaced_file),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
