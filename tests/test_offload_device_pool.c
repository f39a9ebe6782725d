/* The device tier's books (offload/device_pool.h) over real lower tiers (kv_tiers: a host arena,
 * and an NVMe store below it), with "device" memory that is a separate host region reached only
 * through the pool's copy operations, as cudaMemcpyAsync reaches a GPU's: blocks of varying size
 * and codec come back byte for byte wherever they went; eviction takes waiting sequences' blocks
 * first, then the least recently used, never a pinned one; a step larger than the pool, a full
 * pool without a lower tier, a block damaged on the device, an unwritten slot, a failing copy and
 * stale handles all fail with a message and leave the pool usable; over thousands of random
 * operations the pool evicts exactly the blocks a plain scan by the rule would. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cmocka.h>

#include "offload/device_pool.h"
#include "offload/kv_tiers.h"
#include "tests/offload_blocks.h"
#include "test_dir.h"
#include "tests/fake_device_mem.h"

typedef struct fixture {
    char base[64], dir[128];
    kv_tiers *tiers;
    kv_lower_tier lower;
    fake_device dev;
    device_pool_mem mem;
} fixture;

/* A host arena of host_kib, and with nvme an NVMe store of 16 MiB below it. */
static void up(fixture *f, size_t host_kib, bool nvme)
{
    memset(f, 0, sizeof *f);
    strata_error err = {0};
    nvme_store_options no;
    kv_tiers_options o = {.host_bytes = host_kib * 1024};
    if (nvme) {
        snprintf(f->base, sizeof f->base, "/tmp/strata-devpool-XXXXXX");
        assert_non_null(mkdtemp(f->base));
        snprintf(f->dir, sizeof f->dir, "%s/spill", f->base);
        nvme_store_options_init(&no, f->dir, 16u << 20);
        o.nvme_options = &no;
    }
    if (!(f->tiers = kv_tiers_create(&o, &err)))
        fail_msg("%s", err.msg);
    f->lower = kv_tiers_lower(f->tiers);
    f->mem = fake_mem(&f->dev);
}

static void down(fixture *f)
{
    kv_tiers_destroy(f->tiers);
    if (f->base[0])
        test_dir_remove_tree(f->base);
}

/* A slot holds the largest block of offload_blocks.h's small mix (fp16 and KIVI, 2.3 KiB up). */
static size_t slot_bytes(void)
{
    size_t most = 0;
    for (unsigned i = 0; i < 8; i++) {
        size_t n = 0;
        free(ob_varied_block(i, 0, &n));
        assert_true(n > 0);
        most = n > most ? n : most;
    }
    return (most + 63) / 64 * 64;
}
#define SLOT_BYTES slot_bytes()

typedef struct blk {
    uint8_t *bytes;
    size_t size;
    device_block h;
    uint64_t owner;
} blk;

static void make_blocks(device_pool *p, blk *b, size_t n)
{
    strata_error err = {0};
    for (size_t i = 0; i < n; i++) {
        b[i].bytes = ob_varied_block((unsigned)i, 0, &b[i].size);
        assert_non_null(b[i].bytes);
        assert_true(b[i].size <= SLOT_BYTES);
        b[i].owner = 1 + i % 3;
        void *addr = NULL;
        if (device_pool_alloc(p, b[i].owner, &b[i].h, &addr, &err) != STRATA_OK)
            fail_msg("alloc %zu: %s", i, err.msg);
        memcpy(addr, b[i].bytes, b[i].size);   /* what the encoder does on a GPU */
        device_pool_unpin_all(p);
    }
}

static void free_blocks(blk *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(b[i].bytes);
}

static void assert_block_at(const blk *b, const void *addr)
{
    assert_non_null(addr);
    assert_memory_equal(addr, b->bytes, b->size);
}

/* Steps over random subsets of 40 blocks through a pool of 6 slots: every block a step names is
 * resident at the address returned, byte for byte, however often it moved. With nvme, the host
 * arena holds about 4 blocks, so blocks also go down to NVMe and come back through io_uring. */
static void roundtrip(bool nvme)
{
    enum { N = 40, SLOTS = 6 };
    fixture f;
    up(&f, nvme ? 256 : 8192, nvme);
    strata_error err = {0};
    device_pool *p = device_pool_create(SLOT_BYTES, SLOTS, &f.mem, &f.lower, &err);
    if (!p)
        fail_msg("%s", err.msg);
    blk b[N];
    make_blocks(p, b, N);
    device_pool_stats st;
    device_pool_get_stats(p, &st);
    assert_int_equal(st.blocks, N);
    assert_int_equal(st.resident_blocks, SLOTS);
    assert_int_equal(st.evictions, N - SLOTS);
    assert_int_equal(st.writebacks, N - SLOTS);

    uint64_t seed = 42;
    for (int step = 0; step < 200; step++) {
        device_block want[SLOTS];
        size_t idx[SLOTS], n = 1 + rng_next(&seed) % SLOTS;
        for (size_t i = 0; i < n; i++) {
            bool dup;
            do {   /* distinct blocks in one step */
                idx[i] = rng_next(&seed) % N;
                dup = false;
                for (size_t j = 0; j < i; j++)
                    dup |= idx[j] == idx[i];
            } while (dup);
            want[i] = b[idx[i]].h;
        }
        void *addrs[SLOTS];
        if (device_pool_acquire(p, want, n, addrs, &err) != STRATA_OK)
            fail_msg("step %d: %s", step, err.msg);
        for (size_t i = 0; i < n; i++) {
            assert_block_at(&b[idx[i]], addrs[i]);
            assert_ptr_equal(device_pool_addr(p, want[i]), addrs[i]);
        }
        device_pool_unpin_all(p);
        kv_tiers_poll(f.tiers);
    }
    device_pool_get_stats(p, &st);
    assert_true(st.fetches > 100);
    assert_true(st.resident_blocks <= SLOTS);
    /* A block that came back keeps its copy below: moving it out again costs no copy. */
    assert_true(st.writebacks < st.evictions);
    assert_int_equal(f.dev.copies_out, st.writebacks);
    assert_int_equal(f.dev.copies_in, st.fetches);
    kv_tiers_stats ts;
    kv_tiers_get_stats(f.tiers, &ts);
    assert_int_equal(ts.puts, st.writebacks);
    assert_int_equal(ts.gets, st.fetches);
    if (nvme)
        assert_true(ts.spills > 0 && ts.restores > 0);
    /* Freeing every block frees its copies below too. */
    for (size_t i = 0; i < N; i++)
        device_pool_free(p, b[i].h);
    device_pool_get_stats(p, &st);
    assert_int_equal(st.blocks, 0);
    assert_int_equal(st.free_slots, SLOTS);
    kv_tiers_poll(f.tiers);
    kv_tiers_get_stats(f.tiers, &ts);
    assert_int_equal(ts.host_blocks, 0);
    device_pool_destroy(p);
    free_blocks(b, N);
    down(&f);
}

static void test_roundtrip_host(void **state)
{
    (void)state;
    roundtrip(false);
}

static void test_roundtrip_nvme(void **state)
{
    (void)state;
    roundtrip(true);
}

/* Least recently used first, a waiting sequence's blocks before any, pinned blocks never. */
static void test_eviction_order(void **state)
{
    (void)state;
    fixture f;
    up(&f, 8192, false);
    strata_error err = {0};
    device_pool *p = device_pool_create(SLOT_BYTES, 3, &f.mem, &f.lower, &err);
    assert_non_null(p);
    blk b[3];
    make_blocks(p, b, 3);   /* owners 1, 2, 3; used in that order */
    void *addr;
    assert_int_equal(device_pool_acquire(p, &b[0].h, 1, &addr, &err), STRATA_OK);   /* 0 is now the newest */
    device_pool_unpin_all(p);
    device_block extra;
    assert_int_equal(device_pool_alloc(p, 9, &extra, &addr, &err), STRATA_OK);
    assert_null(device_pool_addr(p, b[1].h));   /* block 1 was the least recently used */
    assert_non_null(device_pool_addr(p, b[0].h));
    assert_non_null(device_pool_addr(p, b[2].h));
    memcpy(addr, b[2].bytes, b[2].size);
    device_pool_unpin_all(p);

    device_pool_set_waiting(p, 1, 1);   /* owner 1 (block 0) is preempted: it goes first */
    device_block extra2;
    assert_int_equal(device_pool_alloc(p, 9, &extra2, &addr, &err), STRATA_OK);
    assert_null(device_pool_addr(p, b[0].h));
    assert_non_null(device_pool_addr(p, b[2].h));
    memcpy(addr, b[2].bytes, b[2].size);

    /* Pinned in this step: extra2; the next two allocations take block 2 and extra, then fail. */
    device_block more[3];
    assert_int_equal(device_pool_alloc(p, 9, &more[0], &addr, &err), STRATA_OK);
    memcpy(addr, b[2].bytes, b[2].size);
    assert_int_equal(device_pool_alloc(p, 9, &more[1], &addr, &err), STRATA_OK);
    memcpy(addr, b[2].bytes, b[2].size);
    assert_int_equal(device_pool_alloc(p, 9, &more[2], &addr, &err), STRATA_EFULL);
    assert_non_null(strstr(err.msg, "in use by this step"));
    device_pool_unpin_all(p);
    /* Every block is still there, wherever it is. */
    device_block all[3] = {b[0].h, b[1].h, b[2].h};
    void *addrs[3];
    assert_int_equal(device_pool_acquire(p, all, 3, addrs, &err), STRATA_OK);
    for (int i = 0; i < 3; i++)
        assert_block_at(&b[i], addrs[i]);
    device_pool_destroy(p);
    free_blocks(b, 3);
    down(&f);
}

/* The victim rule of device_pool.h, written out as a scan over every block (what the pool did
 * before its evictable lists): resident, not pinned by this step, a waiting sequence's first,
 * then the least recently pinned. */
typedef struct ref_block {
    bool live, resident, waiting;
    uint64_t owner, last_use, pin_step;
    device_block h;
    unsigned kind;   /* which of offload_blocks.h's blocks it holds */
} ref_block;

typedef struct ref_pool {
    ref_block b[48];
    size_t free_slots;
    uint64_t clock, step;
} ref_pool;

/* Frees a slot for a block of this step, as the pool must: false when every slot is pinned. */
static bool ref_take_slot(ref_pool *r)
{
    if (r->free_slots > 0) {
        r->free_slots--;
        return true;
    }
    ref_block *v = NULL;
    for (size_t i = 0; i < sizeof r->b / sizeof *r->b; i++) {
        ref_block *c = &r->b[i];
        if (!c->live || !c->resident || c->pin_step == r->step)
            continue;
        if (!v || (c->waiting && !v->waiting) || (c->waiting == v->waiting && c->last_use < v->last_use))
            v = c;
    }
    if (v)
        v->resident = false;
    return v != NULL;
}

/* Random allocations, acquisitions, unpins, frees and waiting flags on a pool of 8 slots: after
 * every operation the pool's resident blocks are the reference's, its failures (every slot
 * pinned) the reference's, and every block acquired holds its bytes. */
static void test_victims_against_reference(void **state)
{
    (void)state;
    enum { SLOTS = 8, OPS = 4000 };
    fixture f;
    up(&f, 16384, false);
    strata_error err = {0};
    device_pool *p = device_pool_create(SLOT_BYTES, SLOTS, &f.mem, &f.lower, &err);
    assert_non_null(p);
    uint8_t *bytes[8];
    size_t sizes[8];
    for (unsigned k = 0; k < 8; k++)
        assert_non_null(bytes[k] = ob_varied_block(k, 0, &sizes[k]));
    static ref_pool r;
    memset(&r, 0, sizeof r);
    r.free_slots = SLOTS;
    r.step = 1;
    const size_t nb = sizeof r.b / sizeof *r.b;
    uint64_t seed = 7;
    size_t fulls = 0, fetches = 0, waits = 0;
    for (int op = 0; op < OPS; op++) {
        const unsigned what = (unsigned)(rng_next(&seed) % 20);
        size_t live[48], n_live = 0;
        for (size_t i = 0; i < nb; i++)
            if (r.b[i].live)
                live[n_live++] = i;
        if (what < 5) {   /* a new block */
            size_t i = 0;
            while (i < nb && r.b[i].live)
                i++;
            if (i == nb)
                continue;
            const uint64_t owner = 1 + rng_next(&seed) % 4;
            const bool ok = ref_take_slot(&r);
            void *addr = NULL;
            device_block h = 0;
            const int rc = device_pool_alloc(p, owner, &h, &addr, &err);
            if (rc != (ok ? STRATA_OK : STRATA_EFULL))
                fail_msg("op %d: alloc returned %d (%s), the reference %s", op, rc, err.msg, ok ? "a slot" : "full");
            fulls += !ok;
            if (ok) {
                const unsigned kind = (unsigned)(rng_next(&seed) % 8);
                memcpy(addr, bytes[kind], sizes[kind]);
                r.b[i] = (ref_block){.live = true, .resident = true, .owner = owner, .last_use = ++r.clock,
                                     .pin_step = r.step, .h = h, .kind = kind};
            }
        } else if (what < 10 && n_live > 0) {   /* a step acquires distinct blocks */
            const size_t n = 1 + rng_next(&seed) % (n_live < SLOTS ? n_live : SLOTS);
            device_block want[SLOTS];
            size_t idx[SLOTS];
            for (size_t j = 0; j < n; j++) {   /* a partial shuffle of the live blocks */
                const size_t k = j + rng_next(&seed) % (n_live - j), t = live[j];
                live[j] = live[k];
                live[k] = t;
                idx[j] = live[j];
                want[j] = r.b[idx[j]].h;
            }
            for (size_t j = 0; j < n; j++) {
                r.b[idx[j]].last_use = ++r.clock;
                r.b[idx[j]].pin_step = r.step;
            }
            bool ok = true;
            for (size_t j = 0; j < n && ok; j++)
                if (!r.b[idx[j]].resident) {
                    ok = ref_take_slot(&r);
                    r.b[idx[j]].resident = ok;
                    fetches++;
                }
            void *addrs[SLOTS];
            const int rc = device_pool_acquire(p, want, n, addrs, &err);
            if (rc != (ok ? STRATA_OK : STRATA_EFULL))
                fail_msg("op %d: acquire returned %d (%s), the reference %s", op, rc, err.msg, ok ? "ok" : "full");
            fulls += !ok;
            for (size_t j = 0; ok && j < n; j++)
                assert_memory_equal(addrs[j], bytes[r.b[idx[j]].kind], sizes[r.b[idx[j]].kind]);
        } else if (what < 15) {   /* the step ends */
            device_pool_unpin_all(p);
            r.step++;
        } else if (what < 17 && n_live > 0) {   /* a block is freed */
            ref_block *b = &r.b[live[rng_next(&seed) % n_live]];
            device_pool_free(p, b->h);
            r.free_slots += b->resident;
            b->live = false;
        } else {   /* a sequence is preempted or resumed */
            const uint64_t owner = 1 + rng_next(&seed) % 4;
            const bool waiting = rng_next(&seed) % 2;
            device_pool_set_waiting(p, owner, waiting);
            for (size_t i = 0; i < nb; i++)
                if (r.b[i].live && r.b[i].owner == owner)
                    r.b[i].waiting = waiting;
            waits += waiting;
        }
        size_t resident = 0;
        for (size_t i = 0; i < nb; i++)
            if (r.b[i].live) {
                if ((device_pool_addr(p, r.b[i].h) != NULL) != r.b[i].resident)
                    fail_msg("op %d: block %zu is %sresident in the pool, %sin the reference", op, i,
                             r.b[i].resident ? "not " : "", r.b[i].resident ? "" : "not ");
                resident += r.b[i].resident;
            }
        device_pool_stats st;
        device_pool_get_stats(p, &st);
        assert_int_equal(st.resident_blocks, resident);
        assert_int_equal(st.free_slots, r.free_slots);
    }
    printf("  %d operations: %zu fetches, %zu refused (every slot pinned), %zu waiting flags set\n", OPS, fetches,
           fulls, waits);
    assert_true(fetches > 500 && fulls > 10 && waits > 50);
    device_pool_destroy(p);
    for (unsigned k = 0; k < 8; k++)
        free(bytes[k]);
    down(&f);
}

static void test_limits_and_errors(void **state)
{
    (void)state;
    fixture f;
    up(&f, 8192, false);
    strata_error err = {0};
    /* Bad shapes and memory operations. */
    assert_null(device_pool_create(100, 4, &f.mem, &f.lower, &err));
    assert_int_equal(err.code, STRATA_EINVAL);
    assert_null(device_pool_create(SLOT_BYTES, 0, &f.mem, &f.lower, &err));
    device_pool_mem broken = f.mem;
    broken.copy_in = NULL;
    assert_null(device_pool_create(SLOT_BYTES, 4, &broken, &f.lower, &err));
    assert_non_null(strstr(err.msg, "memory operations"));

    /* No lower tier: a full pool says so. */
    device_pool *p = device_pool_create(SLOT_BYTES, 2, &f.mem, NULL, &err);
    assert_non_null(p);
    blk b[2];
    make_blocks(p, b, 2);
    device_block h;
    void *addr;
    assert_int_equal(device_pool_alloc(p, 1, &h, &addr, &err), STRATA_EFULL);
    assert_non_null(strstr(err.msg, "no host/NVMe tier"));
    device_pool_destroy(p);
    free_blocks(b, 2);

    /* A step naming more blocks than the pool has slots. */
    p = device_pool_create(SLOT_BYTES, 2, &f.mem, &f.lower, &err);
    blk c[3];
    make_blocks(p, c, 3);
    device_block three[3] = {c[0].h, c[1].h, c[2].h};
    void *addrs[3];
    assert_int_equal(device_pool_acquire(p, three, 3, addrs, &err), STRATA_EFULL);
    assert_non_null(strstr(err.msg, "needs 3 at once"));
    /* Stale and unknown handles. */
    device_pool_free(p, c[2].h);
    assert_int_equal(device_pool_acquire(p, &c[2].h, 1, addrs, &err), STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "unknown block"));
    device_block zero = 0;
    assert_int_equal(device_pool_acquire(p, &zero, 1, addrs, &err), STRATA_EINVAL);
    assert_null(device_pool_addr(p, c[2].h));
    device_pool_free(p, c[2].h);   /* twice: ignored */
    /* A new block reusing the freed entry gets a new handle; the old one stays dead. */
    device_block again;
    assert_int_equal(device_pool_alloc(p, 4, &again, &addr, &err), STRATA_OK);
    assert_true(again != c[2].h);
    assert_null(device_pool_addr(p, c[2].h));

    /* The new block was never written (the slot holds whatever was there): moving it down
     * fails naming its sequence, and the pool keeps working. */
    memset(addr, 0xA5, SLOT_BYTES);
    device_pool_unpin_all(p);
    assert_int_equal(device_pool_acquire(p, &c[0].h, 1, addrs, &err), STRATA_OK);
    device_block other;
    int rc = device_pool_alloc(p, 5, &other, &addr, &err);   /* victim: the unwritten block */
    assert_int_not_equal(rc, STRATA_OK);
    assert_non_null(strstr(err.msg, "sequence 4"));
    device_pool_free(p, again);
    assert_int_equal(device_pool_alloc(p, 5, &other, &addr, &err), STRATA_OK);
    memcpy(addr, c[1].bytes, c[1].size);
    device_pool_unpin_all(p);

    /* A failing copy off the device fails that move; the block stays resident and intact. */
    f.dev.fail_copy_out = 1;
    assert_int_equal(device_pool_acquire(p, &c[0].h, 1, addrs, &err), STRATA_OK);
    device_block third;
    assert_int_equal(device_pool_alloc(p, 6, &third, &addr, &err), STRATA_EIO);
    assert_non_null(strstr(err.msg, "injected copy failure"));
    device_pool_unpin_all(p);
    assert_int_equal(device_pool_acquire(p, &other, 1, addrs, &err), STRATA_OK);
    assert_block_at(&c[1], addrs[0]);
    device_pool_destroy(p);
    free_blocks(c, 3);
    down(&f);
}

/* A block damaged while on the device is caught by its CRC when it comes back up, naming its
 * sequence; the others are unaffected. */
static void test_damaged_block(void **state)
{
    (void)state;
    fixture f;
    up(&f, 8192, false);
    strata_error err = {0};
    device_pool *p = device_pool_create(SLOT_BYTES, 2, &f.mem, &f.lower, &err);
    assert_non_null(p);
    blk b[3];
    b[0].bytes = ob_varied_block(0, 0, &b[0].size);
    assert_non_null(b[0].bytes);
    void *addr;
    assert_int_equal(device_pool_alloc(p, 7, &b[0].h, &addr, &err), STRATA_OK);
    memcpy(addr, b[0].bytes, b[0].size);
    ((uint8_t *)addr)[b[0].size - 1] ^= 0x40;   /* a flipped bit in the payload */
    device_pool_unpin_all(p);
    for (int i = 1; i < 3; i++) {   /* push it down */
        b[i].bytes = ob_varied_block((unsigned)i, 0, &b[i].size);
        assert_non_null(b[i].bytes);
        assert_int_equal(device_pool_alloc(p, 8, &b[i].h, &addr, &err), STRATA_OK);
        memcpy(addr, b[i].bytes, b[i].size);
        device_pool_unpin_all(p);
    }
    assert_null(device_pool_addr(p, b[0].h));
    void *addrs[1];
    assert_int_equal(device_pool_acquire(p, &b[0].h, 1, addrs, &err), STRATA_ECRC);
    assert_non_null(strstr(err.msg, "sequence 7"));
    device_pool_unpin_all(p);
    assert_int_equal(device_pool_acquire(p, &b[1].h, 1, addrs, &err), STRATA_OK);
    assert_block_at(&b[1], addrs[0]);
    device_pool_destroy(p);
    free_blocks(b, 3);
    down(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip_host),
        cmocka_unit_test(test_roundtrip_nvme),
        cmocka_unit_test(test_eviction_order),
        cmocka_unit_test(test_victims_against_reference),
        cmocka_unit_test(test_limits_and_errors),
        cmocka_unit_test(test_damaged_block),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
