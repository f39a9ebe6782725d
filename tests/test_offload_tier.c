/* The tier policy (offload/tier.h) over a real host arena and NVMe store: watermark eviction in
 * LRU order with waiting/preempted sequences first, host copies kept until the spill completed,
 * restore of every block byte-exact, clean re-eviction without I/O, synchronous eviction when the
 * arena is full, spill and restore failures (injected EIO, damaged bytes on disk) reported as
 * events and statuses with nothing lost, and frees during I/O. */
#include <errno.h>
#include <fcntl.h>
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

#include "offload/tier.h"
#include "tests/offload_blocks.h"
#include "test_dir.h"

typedef struct fixture {
    char base[64], dir[128];
    host_arena *host;
    nvme_store *nvme;
    tier *t;
    int fail_writes;  /* injected: this many write completions fail, with write_errno (EIO when 0) */
    int write_errno;
    int write_attempts;  /* write completions seen */
} fixture;

static int inject(void *ctx, const nvme_fault_op *op, int res)
{
    fixture *f = ctx;
    f->write_attempts += op->kind == NVME_OP_WRITE;
    if (op->kind == NVME_OP_WRITE && f->fail_writes > 0) {
        f->fail_writes--;
        return f->write_errno ? -f->write_errno : -EIO;
    }
    return res;
}

/* Arena of 256 KiB (64 pages): high 192 KiB, low 128 KiB; an NVMe budget of nvme_bytes. */
static void setup_fixture_nvme(fixture *f, bool sync_io, uint64_t nvme_bytes)
{
    memset(f, 0, sizeof *f);
    snprintf(f->base, sizeof f->base, "/tmp/strata-tier-XXXXXX");
    assert_non_null(mkdtemp(f->base));
    snprintf(f->dir, sizeof f->dir, "%s/spill", f->base);
    strata_error err = {0};
    f->host = host_arena_create(256 * 1024, NULL, &err);
    assert_non_null(f->host);
    nvme_store_options o;
    nvme_store_options_init(&o, f->dir, nvme_bytes);
    o.force_sync_io = sync_io;
    o.fault = inject;
    o.fault_ctx = f;
    o.staging_bufs = 8;
    f->nvme = nvme_store_create(&o, &err);
    if (!f->nvme)
        fail_msg("%s", err.msg);
    tier_options to = {.high_bytes = 192 * 1024, .low_bytes = 128 * 1024};
    f->t = tier_create(f->host, f->nvme, &to, &err);
    assert_non_null(f->t);
}

static void setup_fixture(fixture *f, bool sync_io) { setup_fixture_nvme(f, sync_io, 8u << 20); }

static void teardown_fixture(fixture *f)
{
    tier_destroy(f->t);
    /* The tier gave back every extent it held. */
    assert_int_equal(host_arena_count(f->host), 0);
    nvme_store_stats ss;
    nvme_store_get_stats(f->nvme, &ss);
    assert_int_equal(ss.blocks_stored, 0);
    nvme_store_destroy(f->nvme);
    host_arena_destroy(f->host);
    test_dir_remove_tree(f->base);
}

/* kivi4 3x64x64: 15,488 bytes = 4 pages (16 KiB); each block differs (seed). */
static uint8_t *block(unsigned i, size_t *size) { return ob_make_block(KV_CODEC_KIVI, 4, 3, 64, 64, i % 30, i + 1, size); }

static void drain_events(fixture *f, int *spilled, int *failed)
{
    tier_event ev[32];
    size_t k;
    tier_drain(f->t);
    while ((k = tier_poll(f->t, ev, 32)) > 0) {
        for (size_t i = 0; i < k; i++) {
            if (ev[i].kind == TIER_EV_SPILLED && spilled)
                (*spilled)++;
            if ((ev[i].kind == TIER_EV_SPILL_FAILED || ev[i].kind == TIER_EV_RESTORE_FAILED) && failed)
                (*failed)++;
        }
        tier_drain(f->t);
    }
}

static void lru_and_restore(bool sync_io)
{
    fixture f;
    setup_fixture(&f, sync_io);
    strata_error err = {0};
    enum { N = 12 };
    uint8_t *b[N];
    size_t sz[N];
    tier_id id[N];
    /* 12 x 16 KiB = 192 KiB: at the high watermark, not above it. */
    for (unsigned i = 0; i < N; i++) {
        b[i] = block(i, &sz[i]);
        assert_non_null(b[i]);
        assert_int_equal(tier_put(f.t, b[i], sz[i], i % 3, 100 + i, &id[i], &err), STRATA_OK);
    }
    int spilled = 0;
    drain_events(&f, &spilled, NULL);
    assert_int_equal(spilled, 0);
    /* Sequence 1 is preempted; block 0 is touched (recent now). */
    tier_set_waiting(f.t, 1, true);
    assert_int_equal(tier_touch(f.t, id[0], 1000, &err), STRATA_OK);
    /* One more block passes the high watermark: evict down to 128 KiB, i.e. 5 blocks of 16 KiB
     * (13 -> 8): first sequence 1's four (1, 4, 7, 10), then the least recent: block 2. */
    uint8_t *x;
    size_t xs;
    tier_id xid;
    x = block(99, &xs);
    assert_int_equal(tier_put(f.t, x, xs, 0, 200, &xid, &err), STRATA_OK);
    /* Spills in flight keep their host copies readable. */
    for (unsigned i = 0; i < N; i++) {
        tier_where w = tier_location(f.t, id[i]);
        assert_true(w == TIER_HOST || w == TIER_SPILLING || w == TIER_NVME);
        if (w != TIER_NVME) {
            size_t len;
            const uint8_t *p = tier_get(f.t, id[i], &len);
            assert_non_null(p);
            assert_memory_equal(p, b[i], sz[i]);
        }
    }
    drain_events(&f, &spilled, NULL);
    assert_int_equal(spilled, 5);
    unsigned expect_out[5] = {1, 4, 7, 10, 2};
    for (unsigned i = 0; i < N; i++) {
        bool out = false;
        for (int k = 0; k < 5; k++)
            out |= expect_out[k] == i;
        assert_int_equal(tier_location(f.t, id[i]), out ? TIER_NVME : TIER_HOST);
        if (out)
            assert_null(tier_get(f.t, id[i], NULL));
    }
    assert_int_equal(host_arena_used_bytes(f.host), 8 * 16 * 1024);
    /* Restore every spilled block: byte-exact; restoring makes room by evicting again. */
    tier_set_waiting(f.t, 1, false);
    nvme_store_stats ns0;
    nvme_store_get_stats(f.nvme, &ns0);
    for (int k = 0; k < 5; k++) {
        unsigned i = expect_out[k];
        assert_int_equal(tier_restore(f.t, id[i], &err), STRATA_OK);
        assert_int_equal(tier_location(f.t, id[i]), TIER_BOTH);
        size_t len;
        const uint8_t *p = tier_get(f.t, id[i], &len);
        assert_non_null(p);
        assert_int_equal(len, sz[i]);
        assert_memory_equal(p, b[i], sz[i]);
        assert_int_equal(tier_touch(f.t, id[i], 2000 + (uint64_t)k, &err), STRATA_OK);
    }
    /* Each restore read straight into its host extent (page-aligned, padded): no staging copy. */
    nvme_store_stats ns1;
    nvme_store_get_stats(f.nvme, &ns1);
    assert_int_equal(ns1.reads - ns0.reads, 5);
    assert_int_equal(ns1.zero_copy_reads - ns0.zero_copy_reads, 5);
    /* 13 blocks in 192 KiB: above nothing yet; one more put evicts; restored (clean) blocks are
     * the most recent, so the others go first. Then push them out too: clean evictions, no I/O. */
    tier_stats st;
    tier_get_stats(f.t, &st);
    assert_int_equal(st.blocks, N + 1);
    for (unsigned i = 0; i < N; i++)
        assert_int_equal(tier_touch(f.t, id[i], 3000 + i, &err), STRATA_OK);
    /* Sequence 1's blocks are clean (restored) now: mark them waiting and force eviction with puts. */
    tier_set_waiting(f.t, 1, true);
    tier_id more[4];
    for (int k = 0; k < 4; k++) {
        size_t ms;
        uint8_t *m = block(200 + (unsigned)k, &ms);
        assert_int_equal(tier_put(f.t, m, ms, 5, 4000, &more[k], &err), STRATA_OK);
        free(m);
    }
    drain_events(&f, NULL, NULL);
    tier_get_stats(f.t, &st);
    assert_true(st.clean_evictions >= 4);
    assert_int_equal(tier_location(f.t, id[1]), TIER_NVME);
    /* Everything still restores exactly. */
    for (unsigned i = 0; i < N; i++) {
        assert_int_equal(tier_restore(f.t, id[i], &err), STRATA_OK);
        size_t len;
        const uint8_t *p = tier_get(f.t, id[i], &len);
        assert_non_null(p);
        assert_memory_equal(p, b[i], sz[i]);
    }
    for (unsigned i = 0; i < N; i++) {
        assert_int_equal(tier_free(f.t, id[i], &err), STRATA_OK);
        free(b[i]);
    }
    assert_int_equal(tier_free(f.t, id[0], &err), STRATA_EINVAL);
    free(x);
    teardown_fixture(&f);
}

static void test_lru_and_restore_io_uring(void **state)
{
    (void)state;
    lru_and_restore(false);
}

static void test_lru_and_restore_sync(void **state)
{
    (void)state;
    lru_and_restore(true);
}

/* Many more blocks than the arena holds, put one after another: synchronous eviction makes
 * room; every block comes back exact. */
static void test_overflow_many(void **state)
{
    (void)state;
    fixture f;
    setup_fixture(&f, false);
    strata_error err = {0};
    enum { N = 120 };
    tier_id id[N];
    size_t sz[N];
    uint8_t *b[N];
    for (unsigned i = 0; i < N; i++) {
        b[i] = ob_varied_block(i, 0, &sz[i]);
        assert_non_null(b[i]);
        if (tier_put(f.t, b[i], sz[i], i % 7, i, &id[i], &err) != STRATA_OK)
            fail_msg("put %u: %s", i, err.msg);
        assert_true(host_arena_used_bytes(f.host) <= host_arena_capacity(f.host));
    }
    drain_events(&f, NULL, NULL);
    assert_true(host_arena_used_bytes(f.host) <= 192 * 1024);
    for (unsigned i = 0; i < N; i++) {
        if (tier_restore(f.t, id[i], &err) != STRATA_OK)
            fail_msg("restore %u: %s", i, err.msg);
        size_t len;
        const uint8_t *p = tier_get(f.t, id[i], &len);
        assert_non_null(p);
        assert_int_equal(len, sz[i]);
        assert_memory_equal(p, b[i], sz[i]);
        assert_int_equal(tier_touch(f.t, id[i], 1000 + i, &err), STRATA_OK);
    }
    /* Free half while I/O may be in flight. */
    for (unsigned i = 0; i < N; i += 2)
        assert_int_equal(tier_free(f.t, id[i], &err), STRATA_OK);
    for (unsigned i = 0; i < N; i++)
        free(b[i]);
    teardown_fixture(&f);
}

static void test_spill_failure_keeps_block(void **state)
{
    (void)state;
    fixture f;
    setup_fixture(&f, false);
    strata_error err = {0};
    f.fail_writes = 1;
    enum { N = 13 };
    tier_id id[N];
    uint8_t *b[N];
    size_t sz[N];
    for (unsigned i = 0; i < N; i++) {
        b[i] = block(i, &sz[i]);
        assert_int_equal(tier_put(f.t, b[i], sz[i], 0, i, &id[i], &err), STRATA_OK);
    }
    tier_drain(f.t);
    tier_event ev[32];
    size_t k = tier_poll(f.t, ev, 32);
    int failed = 0;
    for (size_t i = 0; i < k; i++) {
        if (ev[i].kind != TIER_EV_SPILL_FAILED)
            continue;
        failed++;
        assert_int_equal(ev[i].status, STRATA_EIO);
        assert_non_null(strstr(ev[i].err.msg, "Input/output error"));
        /* Nothing lost: the block is still in host memory, intact. */
        assert_int_equal(tier_location(f.t, ev[i].id), TIER_HOST);
        size_t len;
        const uint8_t *p = tier_get(f.t, ev[i].id, &len);
        assert_non_null(p);
        assert_int_equal(kv_block_verify(p, len, NULL, NULL), STRATA_OK);
    }
    assert_int_equal(failed, 1);
    tier_stats st;
    tier_get_stats(f.t, &st);
    assert_int_equal(st.spill_failures, 1);
    for (unsigned i = 0; i < N; i++) {
        assert_int_equal(tier_restore(f.t, id[i], &err), STRATA_OK);
        assert_memory_equal(tier_get(f.t, id[i], NULL), b[i], sz[i]);
        free(b[i]);
    }
    teardown_fixture(&f);
}

/* Puts blocks 0, 1, ... (made into b and sz) until a put fails or n are in; returns the last
 * put's status, *stored the blocks in (b[*stored] is made but not in when a put failed). */
static int put_until_refused(fixture *f, unsigned n, uint8_t **b, size_t *sz, tier_id *id, unsigned *stored,
                             strata_error *err)
{
    int rc = STRATA_OK;
    for (*stored = 0; *stored < n; (*stored)++) {
        b[*stored] = block(*stored, &sz[*stored]);
        if ((rc = tier_put(f->t, b[*stored], sz[*stored], 0, *stored, &id[*stored], err)) != STRATA_OK)
            break;
    }
    return rc;
}

/* A disk that refuses every write (ENOSPC): the host tier fills, and the put that finds no room
 * says the NVMe tier is the cause, with the system's reason, as an I/O error (not "give the cache
 * more room"). Every block put before it is intact in host memory. */
static void test_full_host_names_the_disk(void **state)
{
    (void)state;
    for (int sync_io = 0; sync_io < 2; sync_io++) {
        fixture f;
        setup_fixture(&f, sync_io);
        f.fail_writes = 1000000;
        f.write_errno = ENOSPC;
        strata_error err = {0};
        enum { N = 64 };
        tier_id id[N];
        uint8_t *b[N];
        size_t sz[N];
        unsigned stored;
        int rc = put_until_refused(&f, N, b, sz, id, &stored, &err);
        assert_true(stored > 0 && stored < N);
        if (rc != STRATA_EIO || !strstr(err.msg, "NVMe tier refuses writes") ||
            !strstr(err.msg, "No space left on device"))
            fail_msg("sync_io %d: rc %d, '%s'", sync_io, rc, err.msg);
        /* While the disk stays broken, each put that finds the host tier full tries one block
         * again (a probe), not every block that failed before. */
        for (int k = 0; k < 3; k++) {
            const int before = f.write_attempts;
            tier_id none;
            assert_int_equal(tier_put(f.t, b[stored], sz[stored], 0, stored, &none, &err), STRATA_EIO);
            assert_non_null(strstr(err.msg, "NVMe tier refuses writes"));
            if (f.write_attempts - before > 1)
                fail_msg("sync_io %d: a refused put tried %d writes", sync_io, f.write_attempts - before);
        }
        free(b[stored]);
        tier_stats st;   /* what a worker reports to the coordinator */
        tier_get_stats(f.t, &st);
        assert_true(st.spill_failures > 0);
        assert_int_equal(st.spill_error.code, STRATA_EFULL);
        assert_non_null(strstr(st.spill_error.msg, "No space left on device"));
        for (unsigned i = 0; i < stored; i++) {
            assert_int_equal(tier_location(f.t, id[i]), TIER_HOST);
            assert_memory_equal(tier_get(f.t, id[i], NULL), b[i], sz[i]);
            free(b[i]);
        }
        drain_events(&f, NULL, NULL);
        teardown_fixture(&f);
    }
}

/* Spills that failed are tried again: after a disk fault clears, the put that finds the host tier
 * full spills the blocks that failed before and succeeds; after an NVMe tier that was full frees
 * copies, background eviction takes them again. Nothing is lost either way. */
/* Both tiers full with a sound disk: a lack of room (EFULL, so the request fails or waits for
 * capacity), not an I/O error (which would send its request down the damaged-KV path), and the
 * message says both are full. */
static void test_both_tiers_full(void **state)
{
    (void)state;
    for (int sync_io = 0; sync_io < 2; sync_io++) {
        fixture f;
        setup_fixture_nvme(&f, sync_io, 256 * 1024);
        strata_error err = {0};
        enum { N = 64 };
        tier_id id[N];
        uint8_t *b[N];
        size_t sz[N];
        unsigned stored;
        int rc = put_until_refused(&f, N, b, sz, id, &stored, &err);
        assert_true(stored >= 16 && stored < N);   /* the 16 blocks the host tier holds, then NVMe's */
        if (rc != STRATA_EFULL || !strstr(err.msg, "host and NVMe tiers are full"))
            fail_msg("sync_io %d: rc %d after %u blocks, '%s'", sync_io, rc, stored, err.msg);
        for (unsigned i = 0; i <= stored; i++)
            free(b[i]);
        for (unsigned i = 0; i < stored; i++)
            assert_int_equal(tier_free(f.t, id[i], &err), STRATA_OK);
        teardown_fixture(&f);
    }
}

static void test_failed_spills_retried(void **state)
{
    (void)state;
    for (int sync_io = 0; sync_io < 2; sync_io++) {
        fixture f;
        setup_fixture(&f, sync_io);
        f.fail_writes = 1000000;   /* the disk refuses every write... */
        strata_error err = {0};
        enum { N = 40 };
        tier_id id[N];
        uint8_t *b[N];
        size_t sz[N];
        unsigned stored;
        int rc = put_until_refused(&f, N, b, sz, id, &stored, &err);
        assert_int_equal(rc, STRATA_EIO);
        assert_true(stored > 0 && stored < N);
        f.fail_writes = 0;   /* ...until it recovers */
        for (unsigned i = stored; i < N; i++) {
            if (i > stored)
                b[i] = block(i, &sz[i]);
            if ((rc = tier_put(f.t, b[i], sz[i], 0, i, &id[i], &err)) != STRATA_OK)
                fail_msg("sync_io %d: put %u after the disk recovered: %s", sync_io, i, err.msg);
        }
        drain_events(&f, NULL, NULL);
        tier_stats st;
        tier_get_stats(f.t, &st);
        assert_true(st.spills > 0);
        assert_int_equal(st.spill_error.code, 0);   /* the last attempt succeeded */
        assert_true(st.nvme_blocks >= N - 16);   /* 256 KiB of host arena holds 16 blocks */
        for (unsigned i = 0; i < N; i++) {
            assert_int_equal(tier_restore(f.t, id[i], &err), STRATA_OK);
            assert_memory_equal(tier_get(f.t, id[i], NULL), b[i], sz[i]);
        }
        /* A failed spill is tried again after NVMe copies were freed: with every write failing,
         * fill the host tier past its high watermark (every spill fails); the disk recovers, but
         * nothing is tried again until a copy on NVMe is freed. */
        for (unsigned i = 0; i < N; i++)
            assert_int_equal(tier_free(f.t, id[i], &err), STRATA_OK);
        drain_events(&f, NULL, NULL);
        enum { M = 14 };   /* 224 KiB: past the 192 KiB watermark, within the 256 KiB arena */
        f.fail_writes = 1000000;
        for (unsigned i = 0; i < M; i++)
            assert_int_equal(tier_put(f.t, b[i], sz[i], 1, i, &id[i], &err), STRATA_OK);
        int failed = 0, spilled = 0;
        drain_events(&f, &spilled, &failed);
        assert_true(failed > 0);
        assert_int_equal(spilled, 0);
        f.fail_writes = 0;
        drain_events(&f, &spilled, &failed);
        assert_int_equal(spilled, 0);   /* nothing freed on NVMe, nothing used: no new try */
        tier_get_stats(f.t, &st);
        assert_int_equal(st.host_blocks, M);
        tier_id extra;
        assert_int_equal(tier_put(f.t, b[M], sz[M], 2, 100, &extra, &err), STRATA_OK);
        drain_events(&f, &spilled, &failed);
        assert_int_equal(spilled, 1);   /* the one block not marked went to NVMe */
        assert_int_equal(tier_location(f.t, extra), TIER_NVME);
        assert_int_equal(tier_free(f.t, extra, &err), STRATA_OK);
        assert_true(tier_evict(f.t) > 0);   /* the freed copy made the failed ones candidates again */
        spilled = 0;
        drain_events(&f, &spilled, &failed);
        assert_true(spilled > 0);
        tier_get_stats(f.t, &st);
        assert_true(st.host_blocks < M);
        for (unsigned i = 0; i < M; i++) {
            assert_int_equal(tier_restore(f.t, id[i], &err), STRATA_OK);
            assert_memory_equal(tier_get(f.t, id[i], NULL), b[i], sz[i]);
            assert_int_equal(tier_free(f.t, id[i], &err), STRATA_OK);
        }
        for (unsigned i = 0; i < N; i++)
            free(b[i]);
        drain_events(&f, NULL, NULL);
        teardown_fixture(&f);
    }
}

static void test_restore_of_damaged_block(void **state)
{
    (void)state;
    fixture f;
    setup_fixture(&f, true);
    strata_error err = {0};
    enum { N = 13 };
    tier_id id[N];
    uint8_t *b[N];
    size_t sz[N];
    for (unsigned i = 0; i < N; i++) {
        b[i] = block(i, &sz[i]);
        assert_int_equal(tier_put(f.t, b[i], sz[i], 0, i, &id[i], &err), STRATA_OK);
    }
    drain_events(&f, NULL, NULL);
    assert_int_equal(tier_location(f.t, id[0]), TIER_NVME);
    /* Damage every spilled block's last bytes on disk: the first slab holds them all. */
    char path[256];
    snprintf(path, sizeof path, "%s/slab-0000.kv", f.dir);
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    struct stat sb;
    assert_int_equal(fstat(fd, &sb), 0);
    /* Blocks spilled first sit at offsets 0, 16 KiB, ...: flip a byte inside block 0's payload. */
    uint8_t x;
    assert_int_equal(pread(fd, &x, 1, 8000), 1);
    x ^= 0xff;
    assert_int_equal(pwrite(fd, &x, 1, 8000), 1);
    close(fd);
    int rc = tier_restore(f.t, id[0], &err);
    assert_int_equal(rc, STRATA_ECRC);
    assert_non_null(strstr(err.msg, "CRC"));
    assert_int_equal(tier_location(f.t, id[0]), TIER_NVME);
    assert_null(tier_get(f.t, id[0], NULL));
    tier_event ev[32];
    size_t k = tier_poll(f.t, ev, 32);
    int failed = 0;
    for (size_t i = 0; i < k; i++)
        if (ev[i].kind == TIER_EV_RESTORE_FAILED) {
            failed++;
            assert_true(ev[i].id == id[0]);
            assert_int_equal(ev[i].status, STRATA_ECRC);
        }
    assert_int_equal(failed, 1);
    /* The others restore fine. */
    for (unsigned i = 1; i < N; i++) {
        assert_int_equal(tier_restore(f.t, id[i], &err), STRATA_OK);
        assert_memory_equal(tier_get(f.t, id[i], NULL), b[i], sz[i]);
    }
    for (unsigned i = 0; i < N; i++)
        free(b[i]);
    teardown_fixture(&f);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    fixture f;
    setup_fixture(&f, false);
    strata_error err = {0};
    tier_options bad = {.high_bytes = 100 * 1024, .low_bytes = 200 * 1024};
    assert_null(tier_create(f.host, f.nvme, &bad, &err));
    assert_int_equal(err.code, STRATA_EINVAL);
    assert_null(tier_create(NULL, f.nvme, NULL, &err));
    assert_int_equal(tier_touch(f.t, 12345, 1, &err), STRATA_EINVAL);
    assert_int_equal(tier_prefetch(f.t, 12345, &err), STRATA_EINVAL);
    assert_int_equal(tier_location(f.t, 12345), TIER_NONE);
    /* A block bigger than the whole arena. */
    uint8_t *big = calloc(1, 300 * 1024);
    tier_id id;
    assert_int_equal(tier_put(f.t, big, 300 * 1024, 0, 0, &id, &err), STRATA_EFULL);
    free(big);
    teardown_fixture(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lru_and_restore_io_uring),
        cmocka_unit_test(test_lru_and_restore_sync),
        cmocka_unit_test(test_overflow_many),
        cmocka_unit_test(test_spill_failure_keeps_block),
        cmocka_unit_test(test_both_tiers_full),
        cmocka_unit_test(test_failed_spills_retried),
        cmocka_unit_test(test_full_host_names_the_disk),
        cmocka_unit_test(test_restore_of_damaged_block),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
