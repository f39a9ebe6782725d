/* The NVMe tier (offload/nvme_store.h): batched round trips of real blocks of varying size on
 * io_uring and on the pread/pwrite fallback (identical bytes, on disk and restored), read-back
 * verification, and every fault: injected EIO, ENOSPC and short reads/writes, a failed
 * fdatasync, a real ENOSPC on a 1 MiB tmpfs (skipped when mount is not permitted), corrupted
 * bytes on disk (ECRC naming the block), bad directories, a full budget, bad arguments. After
 * each failure the store keeps serving other blocks. And io_uring_enter refusing submissions for
 * good (a seccomp filter), after which the store fails what the kernel never took and refuses
 * new work. */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <pthread.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvstore/clock.h"
#include "offload/nvme_store.h"
#include "tests/offload_blocks.h"
#include "test_dir.h"

/* ---- helpers ---- */

typedef struct tmp {
    char base[64];   /* from mkdtemp */
    char dir[128];   /* base/spill: created by the store */
} tmp;

static void tmp_make(tmp *t)
{
    snprintf(t->base, sizeof t->base, "/tmp/strata-offload-XXXXXX");
    assert_non_null(mkdtemp(t->base));
    snprintf(t->dir, sizeof t->dir, "%s/spill", t->base);
}

static void tmp_clean(tmp *t) { test_dir_remove_tree(t->base); }

typedef struct blockset {
    unsigned n;
    uint8_t **b;
    size_t *size;
    nvme_loc *loc;
    uint8_t **back;
} blockset;

static void blocks_make(blockset *s, unsigned n, int large)
{
    s->n = n;
    s->b = calloc(n, sizeof *s->b);
    s->size = calloc(n, sizeof *s->size);
    s->loc = calloc(n, sizeof *s->loc);
    s->back = calloc(n, sizeof *s->back);
    assert_true(s->b && s->size && s->loc && s->back);
    for (unsigned i = 0; i < n; i++) {
        s->b[i] = ob_varied_block(i, large, &s->size[i]);
        assert_non_null(s->b[i]);
        s->back[i] = malloc(s->size[i]);
        assert_non_null(s->back[i]);
    }
}

static void blocks_free(blockset *s)
{
    for (unsigned i = 0; i < s->n; i++) {
        free(s->b[i]);
        free(s->back[i]);
    }
    free(s->b);
    free(s->size);
    free(s->loc);
    free(s->back);
}

/* Submits every block's write at once, then collects the completions with poll (and wait when
 * nothing is ready). Checks every status is OK and the completion's location. */
static void write_all(nvme_store *st, blockset *s)
{
    strata_error err = {0};
    uint64_t *tickets = calloc(s->n, sizeof *tickets);
    assert_non_null(tickets);
    for (unsigned i = 0; i < s->n; i++) {
        int rc = nvme_store_submit_write(st, s->b[i], s->size[i], 1000 + i, &tickets[i], &s->loc[i], &err);
        if (rc != STRATA_OK)
            fail_msg("submit_write %u: %s", i, err.msg);
    }
    unsigned got = 0;
    nvme_completion c[16];
    while (got < s->n) {
        size_t k = nvme_store_poll(st, c, 16);
        if (k == 0)
            k = nvme_store_wait(st, c, 16);
        assert_true(k > 0);
        for (size_t j = 0; j < k; j++) {
            if (c[j].status != STRATA_OK)
                fail_msg("write of tag %llu: %s", (unsigned long long)c[j].tag, c[j].err.msg);
            assert_int_equal(c[j].kind, NVME_OP_WRITE);
            unsigned i = (unsigned)(c[j].tag - 1000);
            assert_true(i < s->n);
            assert_true(c[j].ticket == tickets[i]);
            assert_memory_equal(&c[j].loc, &s->loc[i], sizeof(nvme_loc));
            got++;
        }
    }
    assert_int_equal(nvme_store_pending(st), 0);
    free(tickets);
}

static void read_all_check(nvme_store *st, blockset *s)
{
    strata_error err = {0};
    for (unsigned i = 0; i < s->n; i++) {
        memset(s->back[i], 0xee, s->size[i]);
        uint64_t t;
        if (nvme_store_submit_read(st, &s->loc[i], s->back[i], s->size[i], 1000 + i, &t, &err) != STRATA_OK)
            fail_msg("submit_read %u: %s", i, err.msg);
    }
    unsigned got = 0;
    nvme_completion c[16];
    while (got < s->n) {
        size_t k = nvme_store_wait(st, c, 16);
        assert_true(k > 0);
        for (size_t j = 0; j < k; j++) {
            if (c[j].status != STRATA_OK)
                fail_msg("read of tag %llu: %s", (unsigned long long)c[j].tag, c[j].err.msg);
            assert_int_equal(c[j].kind, NVME_OP_READ);
            got++;
        }
    }
    for (unsigned i = 0; i < s->n; i++)
        assert_memory_equal(s->back[i], s->b[i], s->size[i]);
}

static nvme_store *open_store(const char *dir, uint64_t budget, bool sync_io, nvme_store_options *extra)
{
    nvme_store_options o;
    if (extra)
        o = *extra;
    else
        nvme_store_options_init(&o, dir, budget);
    o.dir = dir;
    o.budget_bytes = budget;
    o.force_sync_io = sync_io;
    strata_error err = {0};
    nvme_store *st = nvme_store_create(&o, &err);
    if (!st)
        fail_msg("nvme_store_create: %s", err.msg);
    return st;
}

/* ---- fault injection: the nth completion of a kind gets a different result ---- */

enum { INJ_RESULT, INJ_SHORT_ALIGNED, INJ_SHORT_ODD, INJ_ONE_PAGE, INJ_FLIP };

typedef struct injector {
    nvme_op_kind kind;
    int readback;       /* -1 any, 0 only plain, 1 only read-back */
    uint64_t nth;       /* first victim, 1-based among ops of this kind */
    int times;          /* how many consecutive victims */
    int mode;
    int result;         /* INJ_RESULT: the result to return (-EIO, -ENOSPC) */
    uint64_t seen;
    int fired;
    uint64_t victim_tag;
} injector;

static int inject(void *ctx, const nvme_fault_op *op, int res)
{
    injector *in = ctx;
    if (op->kind != in->kind || (in->readback >= 0 && op->readback != (bool)in->readback))
        return res;
    if (++in->seen < in->nth || in->fired >= in->times || (res <= 0 && in->mode != INJ_RESULT))
        return res;
    in->fired++;
    in->victim_tag = op->tag;
    if (in->mode == INJ_RESULT)
        return in->result;
    if (in->mode == INJ_SHORT_ALIGNED)
        return res > 4096 ? (res / 2) & ~4095 : res;
    if (in->mode == INJ_ONE_PAGE)
        return res > 4096 ? 4096 : res;
    if (in->mode == INJ_FLIP) {   /* the device hands back other bytes, the count right */
        assert_non_null(op->data);
        op->data[(res - 1) / 2] ^= 0x5a;
        return res;
    }
    return res > 100 ? res - 100 : res;
}

/* ---- tests ---- */

static void round_trip(bool sync_io, bool readback, unsigned bufs, size_t buf_bytes)
{
    tmp t;
    tmp_make(&t);
    nvme_store_options o;
    nvme_store_options_init(&o, t.dir, 0);
    o.staging_bufs = bufs;
    o.staging_buf_bytes = buf_bytes;
    o.slab_bytes = 4u << 20;  /* several slabs */
    o.verify = readback ? NVME_VERIFY_READBACK : NVME_VERIFY_CRC;
    nvme_store *st = open_store(t.dir, 24u << 20, sync_io, &o);
    const char *d = nvme_store_describe(st);
    assert_non_null(strstr(d, sync_io ? "pread/pwrite" : "io_uring"));
    /* The directory is private. */
    struct stat sb;
    assert_int_equal(stat(t.dir, &sb), 0);
    assert_int_equal(sb.st_mode & 0777, 0700);
    char slab0[256];
    snprintf(slab0, sizeof slab0, "%s/slab-0000.kv", t.dir);
    assert_int_equal(stat(slab0, &sb), 0);
    assert_int_equal(sb.st_mode & 0777, 0600);

    blockset s;
    blocks_make(&s, 80, 1);
    write_all(st, &s);
    read_all_check(st, &s);
    nvme_store_stats ss;
    nvme_store_get_stats(st, &ss);
    uint64_t bytes = 0;
    for (unsigned i = 0; i < s.n; i++)
        bytes += s.size[i];
    assert_int_equal(ss.blocks_stored, s.n);
    assert_int_equal(ss.bytes_stored, bytes);
    assert_int_equal(ss.writes, s.n);
    assert_int_equal(ss.reads, s.n);
    assert_int_equal(ss.bytes_written, bytes);
    assert_int_equal(ss.bytes_read, bytes);
    assert_true(ss.fsyncs >= 1);
    assert_true(ss.fsyncs < s.n);  /* batched */
    assert_int_equal(ss.readbacks, readback ? s.n : 0);
    assert_int_equal(ss.crc_failures + ss.err_io + ss.err_other + ss.err_nospace + ss.requests_failed, 0);
    assert_int_equal(ss.io_uring, !sync_io);
    assert_true(ss.write_bytes_per_s > 0 && ss.read_bytes_per_s > 0);
    /* Free everything: the budget is whole again. */
    strata_error err = {0};
    for (unsigned i = 0; i < s.n; i++)
        assert_int_equal(nvme_store_free(st, &s.loc[i], &err), STRATA_OK);
    assert_int_equal(nvme_store_free(st, &s.loc[0], &err), STRATA_EINVAL);
    nvme_store_get_stats(st, &ss);
    assert_int_equal(ss.free_bytes, ss.capacity_bytes);
    assert_int_equal(ss.blocks_stored, 0);
    nvme_store_destroy(st);
    /* destroy removed the slab files and the directory it created */
    assert_int_equal(stat(t.dir, &sb), -1);
    blocks_free(&s);
    tmp_clean(&t);
}

static void test_round_trip_io_uring(void **state)
{
    (void)state;
    round_trip(false, false, 0, 0);
}

static void test_round_trip_sync_fallback(void **state)
{
    (void)state;
    round_trip(true, false, 0, 0);
}

/* Few small staging buffers: a 1 MiB block is 16 chunks and requests queue for buffers. */
static void test_round_trip_small_staging(void **state)
{
    (void)state;
    round_trip(false, false, 4, 64 * 1024);
    round_trip(true, false, 4, 64 * 1024);
}

static void test_round_trip_readback(void **state)
{
    (void)state;
    round_trip(false, true, 8, 128 * 1024);
    round_trip(true, true, 8, 128 * 1024);
}

static void test_round_trip_unregistered(void **state)
{
    (void)state;
    tmp t;
    tmp_make(&t);
    nvme_store_options o;
    nvme_store_options_init(&o, t.dir, 0);
    o.no_register = true;
    nvme_store *st = open_store(t.dir, 8u << 20, false, &o);
    assert_non_null(strstr(nvme_store_describe(st), "unregistered"));
    blockset s;
    blocks_make(&s, 20, 0);
    write_all(st, &s);
    read_all_check(st, &s);
    nvme_store_destroy(st);
    blocks_free(&s);
    tmp_clean(&t);
}

/* The same writes through io_uring and through pread/pwrite leave byte-identical slab files,
 * and each path restores what the other wrote (the environment variable forces the fallback). */
static void test_fallback_identical_bytes(void **state)
{
    (void)state;
    tmp t1, t2;
    tmp_make(&t1);
    tmp_make(&t2);
    nvme_store *a = open_store(t1.dir, 8u << 20, false, NULL);
    setenv("STRATA_NO_IO_URING", "1", 1);
    nvme_store *b = open_store(t2.dir, 8u << 20, false, NULL);
    unsetenv("STRATA_NO_IO_URING");
    assert_non_null(strstr(nvme_store_describe(a), "io_uring"));
    assert_non_null(strstr(nvme_store_describe(b), "STRATA_NO_IO_URING"));
    blockset s1, s2;
    blocks_make(&s1, 40, 1);
    blocks_make(&s2, 40, 1);
    write_all(a, &s1);
    write_all(b, &s2);
    for (unsigned i = 0; i < s1.n; i++)
        assert_memory_equal(&s1.loc[i], &s2.loc[i], sizeof(nvme_loc));
    char p1[256], p2[256];
    snprintf(p1, sizeof p1, "%s/slab-0000.kv", t1.dir);
    snprintf(p2, sizeof p2, "%s/slab-0000.kv", t2.dir);
    FILE *f1 = fopen(p1, "rb"), *f2 = fopen(p2, "rb");
    assert_non_null(f1);
    assert_non_null(f2);
    size_t n = 8u << 20;
    uint8_t *x = malloc(n), *y = malloc(n);
    assert_non_null(x);
    assert_non_null(y);
    assert_int_equal(fread(x, 1, n, f1), n);
    assert_int_equal(fread(y, 1, n, f2), n);
    assert_memory_equal(x, y, n);
    fclose(f1);
    fclose(f2);
    free(x);
    free(y);
    read_all_check(a, &s1);
    read_all_check(b, &s1);  /* the same layout: b holds s1's bytes too */
    nvme_store_destroy(a);
    nvme_store_destroy(b);
    blocks_free(&s1);
    blocks_free(&s2);
    tmp_clean(&t1);
    tmp_clean(&t2);
}

/* A page-aligned destination with room for the padded extent is read into directly (its slack
 * then holds the on-disk zeros, which shows no staging copy was made); both paths. */
static void test_zero_copy_read(void **state)
{
    (void)state;
    for (int sync_io = 0; sync_io <= 1; sync_io++) {
        tmp t;
        tmp_make(&t);
        nvme_store_options o;
        nvme_store_options_init(&o, t.dir, 0);
        o.staging_buf_bytes = 64 * 1024;  /* a 1 MiB block is 16 chunks into dst */
        nvme_store *st = open_store(t.dir, 8u << 20, sync_io, &o);
        blockset s;
        blocks_make(&s, 16, 1);
        write_all(st, &s);
        strata_error err = {0};
        for (unsigned i = 0; i < s.n; i++) {
            size_t padded = (s.size[i] + 4095) / 4096 * 4096;
            uint8_t *dst = aligned_alloc(4096, padded);
            assert_non_null(dst);
            memset(dst, 0xee, padded);
            assert_int_equal(nvme_store_read(st, &s.loc[i], dst, padded, i, &err), STRATA_OK);
            assert_memory_equal(dst, s.b[i], s.size[i]);
            for (size_t j = s.size[i]; j < padded; j++)
                assert_int_equal(dst[j], 0);
            free(dst);
        }
        nvme_store_destroy(st);
        blocks_free(&s);
        tmp_clean(&t);
    }
}

/* Out-of-order waiting on tickets; the blocking conveniences. */
static void test_tickets_and_blocking_api(void **state)
{
    (void)state;
    tmp t;
    tmp_make(&t);
    nvme_store *st = open_store(t.dir, 4u << 20, false, NULL);
    blockset s;
    blocks_make(&s, 6, 0);
    strata_error err = {0};
    uint64_t tk[6];
    for (unsigned i = 0; i < 6; i++)
        assert_int_equal(nvme_store_submit_write(st, s.b[i], s.size[i], i, &tk[i], &s.loc[i], &err), STRATA_OK);
    nvme_completion c;
    for (int i = 5; i >= 0; i--) {
        assert_int_equal(nvme_store_wait_ticket(st, tk[i], &c), STRATA_OK);
        assert_true(c.ticket == tk[i] && c.tag == (uint64_t)i);
    }
    assert_int_equal(nvme_store_wait_ticket(st, tk[0], &c), STRATA_EINVAL);
    assert_non_null(strstr(c.err.msg, "unknown ticket"));
    assert_int_equal(nvme_store_pending(st), 0);
    for (unsigned i = 0; i < 6; i++) {
        assert_int_equal(nvme_store_read(st, &s.loc[i], s.back[i], s.size[i], i, &err), STRATA_OK);
        assert_memory_equal(s.back[i], s.b[i], s.size[i]);
    }
    nvme_loc l;
    assert_int_equal(nvme_store_write(st, s.b[0], s.size[0], 77, &l, &err), STRATA_OK);
    assert_int_equal(nvme_store_poll(st, &c, 1), 0);
    assert_int_equal(nvme_store_wait(st, &c, 1), 0);  /* nothing pending: returns at once */
    nvme_store_destroy(st);
    blocks_free(&s);
    tmp_clean(&t);
}

static void fault_run(bool sync_io, nvme_op_kind kind, int readback, int mode, int result, int times,
                      int expect_status, const char *expect_msg)
{
    tmp t;
    tmp_make(&t);
    injector in = {.kind = kind, .readback = readback, .nth = kind == NVME_OP_FSYNC ? 1 : 3, .times = times,
                   .mode = mode, .result = result};
    bool on_write = kind != NVME_OP_READ || readback == 1;
    nvme_store_options o;
    nvme_store_options_init(&o, t.dir, 0);
    o.fault = inject;
    o.fault_ctx = &in;
    o.staging_bufs = 8;
    o.staging_buf_bytes = 64 * 1024;
    if (readback >= 0)
        o.verify = NVME_VERIFY_READBACK;
    nvme_store *st = open_store(t.dir, 16u << 20, sync_io, &o);
    blockset s;
    blocks_make(&s, 24, 1);
    strata_error err = {0};
    uint64_t tk[24];
    for (unsigned i = 0; i < s.n; i++)
        assert_int_equal(nvme_store_submit_write(st, s.b[i], s.size[i], 1000 + i, &tk[i], &s.loc[i], &err), STRATA_OK);
    int status[24] = {0};
    nvme_completion c[8];
    unsigned got = 0;
    while (got < s.n) {
        size_t k = nvme_store_wait(st, c, 8);
        assert_true(k > 0);
        for (size_t j = 0; j < k; j++) {
            status[c[j].tag - 1000] = c[j].status;
            if (c[j].status != STRATA_OK) {
                assert_int_equal(c[j].status, expect_status);
                assert_int_equal(c[j].err.code, expect_status);
                if (!strstr(c[j].err.msg, expect_msg))
                    fail_msg("expected '%s' in: %s", expect_msg, c[j].err.msg);
                char where[48];   /* the message names the block by where it is */
                snprintf(where, sizeof where, "offset %llu:", (unsigned long long)s.loc[c[j].tag - 1000].offset);
                if (!strstr(c[j].err.msg, where) || !strstr(c[j].err.msg, "slab-"))
                    fail_msg("expected 'slab-' and '%s' in: %s", where, c[j].err.msg);
                if (strstr(c[j].err.msg, sync_io ? "io_uring" : "pwrite") ||
                    strstr(c[j].err.msg, sync_io ? "io_uring" : "pread"))
                    fail_msg("sync_io %d: the message names the other I/O path: %s", sync_io, c[j].err.msg);
            }
            got++;
        }
    }
    int failed = 0;
    for (unsigned i = 0; i < s.n; i++)
        failed += status[i] != STRATA_OK;
    if (on_write) {
        assert_true(in.fired >= 1);
        if (expect_status == STRATA_OK)
            assert_int_equal(failed, 0);
        else
            assert_true(failed >= 1);
    }
    nvme_store_stats ss;
    nvme_store_get_stats(st, &ss);
    assert_int_equal(ss.blocks_stored, s.n - (unsigned)failed);
    /* Every block that was written reads back exactly; reads may meet the injector too. */
    int read_failed = 0;
    for (unsigned i = 0; i < s.n; i++) {
        if (status[i] != STRATA_OK)
            continue;
        memset(s.back[i], 0, s.size[i]);
        int rc = nvme_store_read(st, &s.loc[i], s.back[i], s.size[i], 1000 + i, &err);
        if (rc != STRATA_OK) {
            assert_false(on_write);
            assert_int_equal(rc, expect_status);
            assert_non_null(strstr(err.msg, expect_msg));
            read_failed++;
            /* The store stays usable: the same block reads fine once the fault has passed. */
            if (in.fired >= times) {
                assert_int_equal(nvme_store_read(st, &s.loc[i], s.back[i], s.size[i], 1000 + i, &err), STRATA_OK);
                assert_memory_equal(s.back[i], s.b[i], s.size[i]);
            }
            continue;
        }
        assert_memory_equal(s.back[i], s.b[i], s.size[i]);
    }
    if (!on_write)
        assert_int_equal(read_failed, expect_status == STRATA_OK ? 0 : 1);
    /* Failed writes gave their extents back: freeing the rest empties the tier. */
    for (unsigned i = 0; i < s.n; i++)
        if (status[i] == STRATA_OK)
            assert_int_equal(nvme_store_free(st, &s.loc[i], &err), STRATA_OK);
    nvme_store_get_stats(st, &ss);
    assert_int_equal(ss.free_bytes, ss.capacity_bytes);
    /* And, the fault gone, it writes again. */
    in.kind = 0;
    nvme_loc l;
    assert_int_equal(nvme_store_write(st, s.b[0], s.size[0], 1, &l, &err), STRATA_OK);
    nvme_store_destroy(st);
    blocks_free(&s);
    tmp_clean(&t);
}

static void test_fault_eio(void **state)
{
    (void)state;
    for (int sync_io = 0; sync_io <= 1; sync_io++) {
        fault_run(sync_io, NVME_OP_WRITE, -1, INJ_RESULT, -EIO, 1, STRATA_EIO, "Input/output error");
        fault_run(sync_io, NVME_OP_READ, -1, INJ_RESULT, -EIO, 1, STRATA_EIO, "Input/output error");
        fault_run(sync_io, NVME_OP_FSYNC, -1, INJ_RESULT, -EIO, 1, STRATA_EIO, "not durable");
        fault_run(sync_io, NVME_OP_READ, 1, INJ_RESULT, -EIO, 1, STRATA_EIO, "read-back");
    }
}

/* Bytes that come back other than they went (a device or cable corrupting them silently, the
 * count right): a write's read-back fails it with ECRC and the first byte that differs, so the
 * copy above is kept; a plain read fails the block's CRC check. Both leave the store usable. */
static void test_fault_silent_corruption(void **state)
{
    (void)state;
    for (int sync_io = 0; sync_io <= 1; sync_io++) {
        fault_run(sync_io, NVME_OP_READ, 1, INJ_FLIP, 0, 1, STRATA_ECRC, "read-back differs from the bytes written");
        fault_run(sync_io, NVME_OP_READ, 0, INJ_FLIP, 0, 1, STRATA_ECRC, "restored bytes fail verification");
    }
}

static void test_fault_enospc_injected(void **state)
{
    (void)state;
    for (int sync_io = 0; sync_io <= 1; sync_io++) {
        fault_run(sync_io, NVME_OP_WRITE, -1, INJ_RESULT, -ENOSPC, 2, STRATA_EFULL, "No space left on device");
        nvme_store_stats ss;
        (void)ss;
    }
}

static void test_fault_short_transfers(void **state)
{
    (void)state;
    for (int sync_io = 0; sync_io <= 1; sync_io++) {
        /* Short counts are resubmitted: every block still arrives intact. */
        fault_run(sync_io, NVME_OP_WRITE, -1, INJ_SHORT_ALIGNED, 0, 5, STRATA_OK, "");
        fault_run(sync_io, NVME_OP_WRITE, -1, INJ_SHORT_ODD, 0, 5, STRATA_OK, "");
        fault_run(sync_io, NVME_OP_READ, -1, INJ_SHORT_ALIGNED, 0, 5, STRATA_OK, "");
        fault_run(sync_io, NVME_OP_READ, -1, INJ_SHORT_ODD, 0, 5, STRATA_OK, "");
        /* A file system that moves a page at a time: 16 pieces per 64 KiB chunk, more than the
         * retry limit, each making progress (only resubmissions that move nothing count). */
        fault_run(sync_io, NVME_OP_WRITE, -1, INJ_ONE_PAGE, 0, 100000, STRATA_OK, "");
        fault_run(sync_io, NVME_OP_READ, -1, INJ_ONE_PAGE, 0, 100000, STRATA_OK, "");
        /* A transfer that stays short fails clearly instead of looping. */
        fault_run(sync_io, NVME_OP_WRITE, -1, INJ_SHORT_ODD, 0, 1000, STRATA_EIO, "still short");
        /* 0 bytes written is an error, not a retry. */
        fault_run(sync_io, NVME_OP_WRITE, -1, INJ_RESULT, 0, 1, STRATA_EIO, "no progress");
    }
}

static void test_fault_transient(void **state)
{
    (void)state;
    for (int sync_io = 0; sync_io <= 1; sync_io++) {
        /* Interrupted or refused for now: issued again, every block arrives intact. */
        fault_run(sync_io, NVME_OP_WRITE, -1, INJ_RESULT, -EINTR, 5, STRATA_OK, "");
        fault_run(sync_io, NVME_OP_READ, -1, INJ_RESULT, -EAGAIN, 5, STRATA_OK, "");
        fault_run(sync_io, NVME_OP_FSYNC, -1, INJ_RESULT, -EINTR, 3, STRATA_OK, "");
        /* Refused for good: a clear failure after the retries, not a loop. */
        fault_run(sync_io, NVME_OP_WRITE, -1, INJ_RESULT, -EAGAIN, 1000, STRATA_EIO, "Resource temporarily unavailable");
        fault_run(sync_io, NVME_OP_FSYNC, -1, INJ_RESULT, -EINTR, 1000, STRATA_EIO, "Interrupted system call");
    }
}

/* The first fdatasync fails. Every write whose data completed before that failure was reported
 * may have been written back by it and lost, and must fail: also those that completed while it
 * ran and were waiting for the next one (the kernel reports a writeback error once, so the next
 * fdatasync would have called them durable). */
typedef struct sync_watch {
    uint64_t data_done[24];   /* seq of each write's latest data completion */
    uint64_t failed_sync;     /* seq of the failed fdatasync */
} sync_watch;

static int fail_first_sync(void *ctx, const nvme_fault_op *op, int res)
{
    sync_watch *w = ctx;
    if (op->kind == NVME_OP_WRITE && op->tag >= 1000 && op->tag < 1024)
        w->data_done[op->tag - 1000] = op->seq;
    if (op->kind == NVME_OP_FSYNC && !w->failed_sync) {
        w->failed_sync = op->seq;
        return -EIO;
    }
    return res;
}

static void test_failed_sync_fails_what_it_may_have_flushed(void **state)
{
    (void)state;
    for (int sync_io = 0; sync_io <= 1; sync_io++) {
        tmp t;
        tmp_make(&t);
        sync_watch w = {0};
        nvme_store_options o;
        nvme_store_options_init(&o, t.dir, 0);
        o.fault = fail_first_sync;
        o.fault_ctx = &w;
        o.staging_bufs = 8;
        o.staging_buf_bytes = 64 * 1024;
        o.sync_batch = 2;   /* an fdatasync while writes are still in flight */
        nvme_store *st = open_store(t.dir, 16u << 20, sync_io, &o);
        blockset s;
        blocks_make(&s, 24, 1);
        strata_error err = {0};
        uint64_t tk;
        for (unsigned i = 0; i < s.n; i++)
            assert_int_equal(nvme_store_submit_write(st, s.b[i], s.size[i], 1000 + i, &tk, &s.loc[i], &err), STRATA_OK);
        int status[24];
        nvme_completion c[8];
        for (unsigned got = 0; got < s.n;) {
            size_t k = nvme_store_wait(st, c, 8);
            assert_true(k > 0);
            for (size_t j = 0; j < k; j++, got++)
                status[c[j].tag - 1000] = c[j].status;
        }
        assert_true(w.failed_sync > 0);
        unsigned before = 0;
        for (unsigned i = 0; i < s.n; i++) {
            if (w.data_done[i] >= w.failed_sync)
                continue;
            before++;
            if (status[i] != STRATA_EIO)
                fail_msg("sync_io %d: write %u completed its data before the failed fdatasync (seq %llu < %llu) "
                         "but ended with status %d", sync_io, i, (unsigned long long)w.data_done[i],
                         (unsigned long long)w.failed_sync, status[i]);
        }
        assert_true(before >= 1);
        /* The failed writes gave their extents back; the others read back. */
        nvme_store_stats ss;
        nvme_store_get_stats(st, &ss);
        unsigned ok = 0;
        for (unsigned i = 0; i < s.n; i++) {
            if (status[i] != STRATA_OK)
                continue;
            ok++;
            assert_int_equal(nvme_store_read(st, &s.loc[i], s.back[i], s.size[i], i, &err), STRATA_OK);
            assert_memory_equal(s.back[i], s.b[i], s.size[i]);
        }
        assert_int_equal(ss.blocks_stored, ok);
        nvme_store_destroy(st);
        blocks_free(&s);
        tmp_clean(&t);
    }
}

/* A counter of short transfers shows in the stats. */
static void test_short_counted(void **state)
{
    (void)state;
    tmp t;
    tmp_make(&t);
    injector in = {.kind = NVME_OP_WRITE, .readback = -1, .nth = 1, .times = 3, .mode = INJ_SHORT_ALIGNED};
    nvme_store_options o;
    nvme_store_options_init(&o, t.dir, 0);
    o.fault = inject;
    o.fault_ctx = &in;
    nvme_store *st = open_store(t.dir, 4u << 20, false, &o);
    blockset s;
    blocks_make(&s, 3, 0);
    strata_error err = {0};
    for (unsigned i = 0; i < 3; i++)
        assert_int_equal(nvme_store_write(st, s.b[2], s.size[2], i, &s.loc[i], &err), STRATA_OK);
    nvme_store_stats ss;
    nvme_store_get_stats(st, &ss);
    assert_int_equal(ss.short_transfers, 3);
    nvme_store_destroy(st);
    blocks_free(&s);
    tmp_clean(&t);
}

static void corrupt_on_disk(bool sync_io)
{
    tmp t;
    tmp_make(&t);
    nvme_store *st = open_store(t.dir, 8u << 20, sync_io, NULL);
    blockset s;
    blocks_make(&s, 8, 0);
    write_all(st, &s);
    char path[256];
    snprintf(path, sizeof path, "%s/slab-0000.kv", t.dir);
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    /* Block 2: one payload byte flipped. Block 5: its magic damaged. */
    uint8_t x;
    off_t at = (off_t)(s.loc[2].offset + s.loc[2].len - 100);
    assert_int_equal(pread(fd, &x, 1, at), 1);
    x ^= 0x10;
    assert_int_equal(pwrite(fd, &x, 1, at), 1);
    assert_int_equal(pwrite(fd, "X", 1, (off_t)s.loc[5].offset), 1);
    assert_int_equal(fsync(fd), 0);
    close(fd);
    strata_error err = {0};
    char where[8][48];   /* the messages name a block by where it is */
    for (unsigned i = 0; i < s.n; i++)
        snprintf(where[i], sizeof where[i], "offset %llu:", (unsigned long long)s.loc[i].offset);
    for (unsigned i = 0; i < s.n; i++) {
        int rc = nvme_store_read(st, &s.loc[i], s.back[i], s.size[i], 1000 + i, &err);
        if (i == 2) {
            assert_int_equal(rc, STRATA_ECRC);
            assert_int_equal(err.code, STRATA_ECRC);
            assert_non_null(strstr(err.msg, where[2]));
            assert_non_null(strstr(err.msg, "slab-0000.kv"));
            assert_non_null(strstr(err.msg, "CRC"));
        } else if (i == 5) {   /* a header that no longer parses is damage too: ECRC, retryable */
            assert_int_equal(rc, STRATA_ECRC);
            assert_non_null(strstr(err.msg, where[5]));
            assert_non_null(strstr(err.msg, "not a block"));
        } else {
            if (rc != STRATA_OK)
                fail_msg("block %u: %s", i, err.msg);
            assert_memory_equal(s.back[i], s.b[i], s.size[i]);
        }
    }
    nvme_store_stats ss;
    nvme_store_get_stats(st, &ss);
    assert_int_equal(ss.crc_failures, 2);
    assert_int_equal(ss.reads, s.n - 2);
    nvme_store_destroy(st);
    blocks_free(&s);
    tmp_clean(&t);
}

static void test_corrupted_on_disk(void **state)
{
    (void)state;
    corrupt_on_disk(false);
    corrupt_on_disk(true);
}

/* A damaged block is refused before anything is written. */
static void test_refuses_bad_block(void **state)
{
    (void)state;
    tmp t;
    tmp_make(&t);
    nvme_store *st = open_store(t.dir, 1u << 20, false, NULL);
    size_t size;
    uint8_t *b = ob_varied_block(0, 0, &size);
    assert_non_null(b);
    b[size - 1] ^= 1;
    strata_error err = {0};
    uint64_t tk;
    nvme_loc l;
    assert_int_equal(nvme_store_submit_write(st, b, size, 9, &tk, &l, &err), STRATA_ECRC);
    assert_non_null(strstr(err.msg, "refusing to write block 9"));
    b[size - 1] ^= 1;
    assert_int_equal(nvme_store_submit_write(st, b, size - 64, 9, &tk, &l, &err), STRATA_EFORMAT);
    assert_int_equal(nvme_store_pending(st), 0);
    nvme_store_stats ss;
    nvme_store_get_stats(st, &ss);
    assert_int_equal(ss.free_bytes, ss.capacity_bytes);
    /* Bad read arguments. */
    assert_int_equal(nvme_store_write(st, b, size, 9, &l, &err), STRATA_OK);
    uint8_t *dst = malloc(size);
    assert_non_null(dst);
    assert_int_equal(nvme_store_submit_read(st, &l, dst, size - 1, 9, &tk, &err), STRATA_EINVAL);
    nvme_loc bad = l;
    bad.slab = 7;
    assert_int_equal(nvme_store_submit_read(st, &bad, dst, size, 9, &tk, &err), STRATA_EINVAL);
    bad = l;
    bad.offset = 1u << 20;
    assert_int_equal(nvme_store_submit_read(st, &bad, dst, size, 9, &tk, &err), STRATA_EINVAL);
    bad = l;
    bad.offset = 100;
    assert_int_equal(nvme_store_submit_read(st, &bad, dst, size, 9, &tk, &err), STRATA_EINVAL);
    /* A location whose length is wrong reads bytes that are not that block: caught, and told as
     * any restored block that fails its check is (ECRC). */
    bad = l;
    bad.len = (uint32_t)size - 64;
    assert_int_equal(nvme_store_read(st, &bad, dst, size, 9, &err), STRATA_ECRC);
    free(dst);
    free(b);
    nvme_store_destroy(st);
    tmp_clean(&t);
}

/* A budget of many TiB (a big disk given whole) is a few hundred larger slab files, not
 * thousands of 1 GiB ones: each file is an open descriptor and a registered slot of the ring. */
static void test_large_budget(void **state)
{
    (void)state;
    tmp t;
    tmp_make(&t);
    nvme_store_options o;
    nvme_store_options_init(&o, t.dir, 5ull << 40);   /* 5 TiB, sparse */
    o.no_prealloc = true;
    strata_error err = {0};
    nvme_store *st = nvme_store_create(&o, &err);
    if (!st && (strstr(err.msg, "File too large") || strstr(err.msg, "Invalid argument"))) {
        fprintf(stderr, "skipping: this file system cannot size a 20 GiB sparse file: %s\n", err.msg);
        tmp_clean(&t);
        skip();
    }
    if (!st)
        fail_msg("%s", err.msg);
    nvme_store_stats ss;
    nvme_store_get_stats(st, &ss);
    assert_true(ss.capacity_bytes == 5ull << 40);
    char path[300];
    snprintf(path, sizeof path, "%s/slab-0255.kv", t.dir);
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    assert_true(sb.st_size == 20ll << 30);   /* 5 TiB / 256 */
    snprintf(path, sizeof path, "%s/slab-0256.kv", t.dir);
    assert_int_equal(stat(path, &sb), -1);
    size_t size;
    uint8_t *b = ob_varied_block(0, 0, &size), *back = malloc(size);
    assert_true(b && back);
    nvme_loc l;
    assert_int_equal(nvme_store_write(st, b, size, 1, &l, &err), STRATA_OK);
    assert_int_equal(nvme_store_read(st, &l, back, size, 1, &err), STRATA_OK);
    assert_memory_equal(back, b, size);
    free(b);
    free(back);
    nvme_store_destroy(st);
    /* An explicit slab size that needs more files than a store may have: refused, saying so. */
    nvme_store_options_init(&o, t.dir, 5ull << 40);
    o.no_prealloc = true;
    o.slab_bytes = 1ull << 30;
    assert_null(nvme_store_create(&o, &err));
    assert_int_equal(err.code, STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "5120 slab files"));
    tmp_clean(&t);
}

static void test_budget_full(void **state)
{
    (void)state;
    tmp t;
    tmp_make(&t);
    nvme_store *st = open_store(t.dir, 64 * 1024, false, NULL);  /* 16 pages */
    size_t size;
    uint8_t *b = ob_make_block(KV_CODEC_FP16, 16, 3, 64, 64, 0, 1, &size);  /* 49,280: 13 pages */
    assert_non_null(b);
    strata_error err = {0};
    nvme_loc l1, l2;
    assert_int_equal(nvme_store_write(st, b, size, 1, &l1, &err), STRATA_OK);
    uint64_t tk;
    assert_int_equal(nvme_store_submit_write(st, b, size, 2, &tk, &l2, &err), STRATA_EFULL);
    assert_non_null(strstr(err.msg, "nvme tier full"));
    assert_non_null(strstr(err.msg, "no free extent of 52 KiB"));
    assert_non_null(strstr(err.msg, "12 KiB free"));
    assert_int_equal(nvme_store_free(st, &l1, &err), STRATA_OK);
    assert_int_equal(nvme_store_write(st, b, size, 2, &l2, &err), STRATA_OK);
    free(b);
    nvme_store_destroy(st);
    tmp_clean(&t);
}

static void expect_create_fails(const char *dir, int code, const char *msg)
{
    nvme_store_options o;
    nvme_store_options_init(&o, dir, 1u << 20);
    strata_error err = {0};
    nvme_store *st = nvme_store_create(&o, &err);
    if (st)
        fail_msg("store created in %s", dir);
    assert_int_equal(err.code, code);
    if (!strstr(err.msg, msg))
        fail_msg("expected '%s' in: %s", msg, err.msg);
    assert_non_null(strstr(err.msg, dir));
}

static void test_bad_directories(void **state)
{
    (void)state;
    tmp t;
    tmp_make(&t);
    char path[256];
    /* A nonexistent parent (fails for root too). */
    snprintf(path, sizeof path, "%s/missing/spill", t.base);
    expect_create_fails(path, STRATA_EIO, "No such file or directory");
    /* A path under a regular file, and a regular file as the directory. */
    char file[200];
    snprintf(file, sizeof file, "%s/file", t.base);
    FILE *f = fopen(file, "w");
    assert_non_null(f);
    fclose(f);
    snprintf(path, sizeof path, "%s/spill", file);
    expect_create_fails(path, STRATA_EIO, "Not a directory");
    expect_create_fails(file, STRATA_EIO, "Not a directory");
    /* An unwritable directory: refused unless we are root (root bypasses the mode). */
    snprintf(path, sizeof path, "%s/ro", t.base);
    assert_int_equal(mkdir(path, 0500), 0);
    if (geteuid() != 0) {
        expect_create_fails(path, STRATA_EIO, "Permission denied");
    } else {
        nvme_store *st = open_store(path, 1u << 20, false, NULL);
        nvme_store_destroy(st);
    }
    /* A folder other users may write to, or another user's: refused. */
    snprintf(path, sizeof path, "%s/shared", t.base);
    assert_int_equal(mkdir(path, 0700), 0);
    assert_int_equal(chmod(path, 01777), 0);
    expect_create_fails(path, STRATA_EIO, "writable by other users (mode 1777)");
    assert_int_equal(chmod(path, 0770), 0);
    expect_create_fails(path, STRATA_EIO, "writable by other users (mode 0770)");
    if (geteuid() == 0) {   /* only root can give a folder away */
        assert_int_equal(chmod(path, 0700), 0);
        assert_int_equal(chown(path, 65534, 65534), 0);
        expect_create_fails(path, STRATA_EIO, "belongs to uid 65534");
        assert_int_equal(chown(path, 0, 0), 0);
    }
    /* Links planted where a slab file goes are never followed, truncated or deleted. */
    char victim[220], slab[300];
    snprintf(path, sizeof path, "%s/planted", t.base);
    assert_int_equal(mkdir(path, 0700), 0);
    snprintf(victim, sizeof victim, "%s/victim", t.base);
    f = fopen(victim, "w");
    assert_non_null(f);
    fputs("precious", f);
    fclose(f);
    snprintf(slab, sizeof slab, "%s/slab-0000.kv", path);
    assert_int_equal(symlink(victim, slab), 0);
    expect_create_fails(path, STRATA_EIO, "it is a symbolic link");
    assert_int_equal(unlink(slab), 0);
    assert_int_equal(link(victim, slab), 0);
    expect_create_fails(path, STRATA_EIO, "it has other hard links");
    struct stat vs;
    assert_int_equal(stat(victim, &vs), 0);
    assert_int_equal(vs.st_size, 8);
    assert_int_equal(vs.st_nlink, 2);   /* the planted link is still there: not ours to delete */
    assert_int_equal(unlink(slab), 0);
    /* A file with a slab's name that is not one (a user's) is never truncated or deleted. */
    f = fopen(slab, "w");
    assert_non_null(f);
    fputs("precious", f);
    fclose(f);
    expect_create_fails(path, STRATA_EIO, "does not look like a slab file (8 bytes");
    assert_int_equal(stat(slab, &vs), 0);
    assert_int_equal(vs.st_size, 8);
    /* A slab file a crashed store left behind is reused: empty, zeros (preallocated, never
     * written), or a block at its start. */
    static const size_t zero_len[] = {0, 3, 8192};
    for (size_t i = 0; i < sizeof zero_len / sizeof *zero_len; i++) {
        f = fopen(slab, "w");
        assert_non_null(f);
        for (size_t b = 0; b < zero_len[i]; b++)
            fputc(0, f);
        fclose(f);
        nvme_store *reused = open_store(path, 1u << 20, false, NULL);
        nvme_store_destroy(reused);
    }
    {
        nvme_store *crashed = open_store(path, 1u << 20, false, NULL);
        size_t blk_len;
        uint8_t *blk = ob_varied_block(0, 0, &blk_len);
        assert_non_null(blk);
        nvme_loc loc;
        assert_int_equal(nvme_store_write(crashed, blk, blk_len, 1, &loc, NULL), STRATA_OK);
        assert_int_equal(loc.offset, 0);
        int keep = open(slab, O_RDONLY);   /* destroy deletes the file: keep its bytes */
        assert_true(keep >= 0);
        uint8_t head[4096];
        assert_int_equal(pread(keep, head, sizeof head, 0), (ssize_t)sizeof head);
        close(keep);
        nvme_store_destroy(crashed);
        f = fopen(slab, "w");
        assert_non_null(f);
        assert_int_equal(fwrite(head, 1, sizeof head, f), sizeof head);
        fclose(f);
        nvme_store *reused = open_store(path, 1u << 20, false, NULL);
        nvme_store_destroy(reused);
        free(blk);
    }
    /* Two stores cannot share a directory. */
    nvme_store *a = open_store(t.dir, 1u << 20, false, NULL);
    expect_create_fails(t.dir, STRATA_EIO, "in use by another store");
    nvme_store_destroy(a);
    /* Bad options. */
    nvme_store_options o;
    nvme_store_options_init(&o, t.dir, 100);
    strata_error err = {0};
    assert_null(nvme_store_create(&o, &err));
    assert_int_equal(err.code, STRATA_EINVAL);
    nvme_store_options_init(&o, t.dir, 1u << 20);
    o.staging_buf_bytes = 5000;
    assert_null(nvme_store_create(&o, &err));
    assert_int_equal(err.code, STRATA_EINVAL);
    nvme_store_options_init(&o, NULL, 1u << 20);
    assert_null(nvme_store_create(&o, &err));
    assert_int_equal(err.code, STRATA_EINVAL);
    tmp_clean(&t);
}

/* io_uring's workers drop their references to a ring's files a little after the ring is closed,
 * so an unmount right after nvme_store_destroy can find the file system busy (seen once in CI):
 * retry for up to two seconds, then detach it lazily. Returns umount's result, with errno. */
static int unmount_when_released(const char *path)
{
    for (int i = 0; i < 100; i++) {
        if (umount(path) == 0)
            return 0;
        if (errno != EBUSY)
            return -1;
        usleep(20 * 1000);
    }
    fprintf(stderr, "%s still busy after 2 s: detaching it\n", path);
    return umount2(path, MNT_DETACH);
}

/* A real ENOSPC: a 1 MiB tmpfs. Needs mount permission (root); skipped otherwise. */
static void test_enospc_tmpfs(void **state)
{
    (void)state;
    tmp t;
    tmp_make(&t);
    if (mount("tmpfs", t.base, "tmpfs", 0, "size=1m,mode=0700") != 0) {
        int e = errno;
        tmp_clean(&t);
        fprintf(stderr, "skipping: cannot mount a 1 MiB tmpfs (%s); ENOSPC is covered by injection\n", strerror(e));
        skip();
    }
    /* Preallocating a 4 MiB budget fails at create, with the reason. */
    nvme_store_options o;
    nvme_store_options_init(&o, t.dir, 4u << 20);
    strata_error err = {0};
    assert_null(nvme_store_create(&o, &err));
    assert_int_equal(err.code, STRATA_EFULL);
    assert_non_null(strstr(err.msg, "No space left on device"));
    assert_non_null(strstr(err.msg, "preallocating"));
    /* Sparse slabs: the writes that do not fit fail with EFULL; the others are intact. Both paths. */
    for (int sync_io = 0; sync_io <= 1; sync_io++) {
        nvme_store_options_init(&o, t.dir, 4u << 20);
        o.no_prealloc = true;
        nvme_store *st = open_store(t.dir, 4u << 20, sync_io, &o);
        fprintf(stderr, "tmpfs store: %s\n", nvme_store_describe(st));
        blockset s;
        blocks_make(&s, 48, 0);
        uint64_t tk[48];
        for (unsigned i = 0; i < s.n; i++)
            assert_int_equal(nvme_store_submit_write(st, s.b[i], s.size[i], 1000 + i, &tk[i], &s.loc[i], &err),
                             STRATA_OK);
        int ok[48] = {0}, full = 0;
        for (unsigned i = 0; i < s.n; i++) {
            nvme_completion c;
            int rc = nvme_store_wait_ticket(st, tk[i], &c);
            ok[i] = rc == STRATA_OK;
            if (!ok[i]) {
                assert_int_equal(rc, STRATA_EFULL);
                assert_non_null(strstr(c.err.msg, "No space left on device"));
                full++;
            }
        }
        assert_true(full > 0);
        nvme_store_stats ss;
        nvme_store_get_stats(st, &ss);
        assert_true(ss.err_nospace > 0);
        for (unsigned i = 0; i < s.n; i++) {
            if (!ok[i])
                continue;
            assert_int_equal(nvme_store_read(st, &s.loc[i], s.back[i], s.size[i], i, &err), STRATA_OK);
            assert_memory_equal(s.back[i], s.b[i], s.size[i]);
        }
        nvme_store_destroy(st);
        blocks_free(&s);
    }
    if (unmount_when_released(t.base) != 0)
        fail_msg("umount %s: %s", t.base, strerror(errno));
    tmp_clean(&t);
}

/* Buffered I/O by option (and whatever tmpfs does about O_DIRECT) gives the same bytes. */
static void test_buffered(void **state)
{
    (void)state;
    tmp t;
    tmp_make(&t);
    nvme_store_options o;
    nvme_store_options_init(&o, t.dir, 0);
    o.force_buffered = true;
    nvme_store *st = open_store(t.dir, 8u << 20, false, &o);
    assert_non_null(strstr(nvme_store_describe(st), "buffered"));
    nvme_store_stats ss;
    nvme_store_get_stats(st, &ss);
    assert_false(ss.direct);
    blockset s;
    blocks_make(&s, 20, 1);
    write_all(st, &s);
    read_all_check(st, &s);
    nvme_store_destroy(st);
    blocks_free(&s);
    tmp_clean(&t);
}

/* ---- io_uring_enter refused for good ---- */

#if defined(__x86_64__)
#define TEST_AUDIT_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define TEST_AUDIT_ARCH AUDIT_ARCH_AARCH64
#endif

/* From now on, in the calling thread only, every io_uring_enter that submits (to_submit > 0)
 * fails with EINVAL, as the kernel's would for good; waits still run. A seccomp filter: the real
 * system call fails, nothing in the store is replaced. Returns false where filters are not
 * allowed or the architecture is not known here. */
static bool refuse_io_uring_submits(void)
{
#ifdef TEST_AUDIT_ARCH
    struct sock_filter code[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, TEST_AUDIT_ARCH, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_enter, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        /* to_submit is an unsigned int: the low half of the argument (little-endian) */
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args) + sizeof(uint64_t)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EINVAL & SECCOMP_RET_DATA)),
    };
    struct sock_fprog prog = {.len = sizeof code / sizeof code[0], .filter = code};
    return prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 && prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0;
#else
    return false;
#endif
}

typedef struct ring_refused_run {
    const char *dir;
    bool filtered;
    int filter_errno;            /* why not */
    char setup[600];             /* what failed before the filter, if anything */
    int write_status;            /* the write submitted after the filter */
    char write_msg[sizeof((strata_error){0}.msg)];
    int inflight_read_status;    /* the read the kernel took before the filter */
    bool inflight_read_equal;
    int next_submit_status;      /* a write asked for afterwards */
    char next_submit_msg[sizeof((strata_error){0}.msg)];
    size_t pending_after;
} ring_refused_run;

/* The store belongs to one thread, and the filter stays with the thread that installs it: the
 * whole run is this thread's, the checks the test's (a cmocka failure must not unwind here). */
static void *ring_refused_thread(void *arg)
{
    ring_refused_run *r = arg;
    nvme_store_options o;
    nvme_store_options_init(&o, r->dir, 8u << 20);
    o.staging_buf_bytes = 4096;   /* a block is several operations */
    strata_error err = {0};
    nvme_store *st = nvme_store_create(&o, &err);
    size_t a_size, b_size;
    uint8_t *a = ob_varied_block(2, 1, &a_size), *b = ob_varied_block(3, 1, &b_size);
    uint8_t *back = a ? malloc(a_size) : NULL;
    nvme_loc a_loc, b_loc;
    uint64_t read_ticket = 0, write_ticket = 0;
    nvme_completion c;
    if (!st || !b || !back) {
        snprintf(r->setup, sizeof r->setup, "setup: %s", st ? "out of memory" : err.msg);
        goto out;
    }
    if (nvme_store_write(st, a, a_size, 1, &a_loc, &err) != STRATA_OK ||
        nvme_store_submit_read(st, &a_loc, back, a_size, 2, &read_ticket, &err) != STRATA_OK) {
        snprintf(r->setup, sizeof r->setup, "before the filter: %s", err.msg);
        goto out;
    }
    nvme_store_poll(st, &c, 0);   /* the read's operations go to the kernel */
    r->filtered = refuse_io_uring_submits();
    r->filter_errno = errno;
    if (!r->filtered) {
        nvme_store_wait_ticket(st, read_ticket, &c);
        goto out;
    }
    if (nvme_store_submit_write(st, b, b_size, 3, &write_ticket, &b_loc, &err) != STRATA_OK) {
        snprintf(r->setup, sizeof r->setup, "the write was refused at once: %s", err.msg);
        nvme_store_wait_ticket(st, read_ticket, &c);
        goto out;
    }
    r->write_status = nvme_store_wait_ticket(st, write_ticket, &c);
    snprintf(r->write_msg, sizeof r->write_msg, "%s", c.err.msg);
    r->inflight_read_status = nvme_store_wait_ticket(st, read_ticket, &c);
    r->inflight_read_equal = memcmp(back, a, a_size) == 0;
    uint64_t t;
    r->next_submit_status = nvme_store_submit_write(st, b, b_size, 4, &t, &b_loc, &err);
    snprintf(r->next_submit_msg, sizeof r->next_submit_msg, "%s", err.msg);
    r->pending_after = nvme_store_pending(st);
out:
    if (st)
        nvme_store_destroy(st);
    free(a);
    free(b);
    free(back);
    return NULL;
}

/* io_uring_enter refusing submissions for good (the kernel's EINVAL, by a seccomp filter): the
 * operations prepared for the kernel are taken back and their write fails saying why, instead of
 * waiting forever for operations the kernel never took; a read the kernel took before completes
 * with the right bytes; the store refuses new work at once with the same reason; destroy ends
 * it cleanly. */
static void test_ring_refused_for_good(void **state)
{
    (void)state;
    tmp t;
    tmp_make(&t);
    ring_refused_run r = {.dir = t.dir};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, ring_refused_thread, &r), 0);
    const struct timespec deadline = strata_realtime_after_ms(60000);
    if (pthread_timedjoin_np(th, NULL, &deadline) != 0)
        fail_msg("the run did not end in 60 s (the store waits for operations the kernel never took?)");
    tmp_clean(&t);
    if (r.setup[0])
        fail_msg("%s", r.setup);
    if (!r.filtered) {
        print_message("skipped: a seccomp filter could not be installed here (%s)\n", strerror(r.filter_errno));
        skip();
    }
    assert_int_equal(r.write_status, STRATA_EIO);
    assert_non_null(strstr(r.write_msg, "io_uring_enter failed (Invalid argument); the store's ring is unusable"));
    assert_int_equal(r.inflight_read_status, STRATA_OK);
    assert_true(r.inflight_read_equal);
    assert_int_equal(r.next_submit_status, STRATA_EIO);
    assert_non_null(strstr(r.next_submit_msg, "refused: io_uring_enter failed"));
    assert_int_equal(r.pending_after, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip_io_uring),
        cmocka_unit_test(test_round_trip_sync_fallback),
        cmocka_unit_test(test_round_trip_small_staging),
        cmocka_unit_test(test_round_trip_readback),
        cmocka_unit_test(test_round_trip_unregistered),
        cmocka_unit_test(test_fallback_identical_bytes),
        cmocka_unit_test(test_zero_copy_read),
        cmocka_unit_test(test_tickets_and_blocking_api),
        cmocka_unit_test(test_fault_eio),
        cmocka_unit_test(test_fault_silent_corruption),
        cmocka_unit_test(test_fault_enospc_injected),
        cmocka_unit_test(test_fault_short_transfers),
        cmocka_unit_test(test_fault_transient),
        cmocka_unit_test(test_failed_sync_fails_what_it_may_have_flushed),
        cmocka_unit_test(test_short_counted),
        cmocka_unit_test(test_corrupted_on_disk),
        cmocka_unit_test(test_refuses_bad_block),
        cmocka_unit_test(test_budget_full),
        cmocka_unit_test(test_large_budget),
        cmocka_unit_test(test_bad_directories),
        cmocka_unit_test(test_enospc_tmpfs),
        cmocka_unit_test(test_buffered),
        cmocka_unit_test(test_ring_refused_for_good),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
