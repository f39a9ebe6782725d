/* The device pool's room check of a step (device_room, offload/device_pool.h) against the step
 * itself: pools of a few slots over real lower tiers (a host arena, and NVMe for half the cases,
 * or none) small enough that steps must move blocks down and bring them back; batches of up to
 * four sequences, each pinning its blocks of a layer (a decode token or a later prompt chunk) or
 * not (a first prompt) and forming new ones. Every step the check admits runs in worker/cuda's
 * order (per layer: the decode items' blocks acquired, the chunks', the new blocks allocated and
 * written, everything unpinned) and must complete, and every block acquired must hold its bytes:
 * a step that fails part way leaves its sequences' layers uneven and the stage drops its whole
 * batch. A sequence the check refuses is left out of the step, as the stage does. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "offload/device_pool.h"
#include "offload/kv_tiers.h"
#include "tests/offload_blocks.h"
#include "test_dir.h"
#include "tests/fake_device_mem.h"
#include "test_rng.h"

enum { LAYERS = 3, MAX_BLOCKS = 24, N_SEQS = 4, PALETTE = 6 };

/* Real blocks of three sizes (9 KiB and 15 KiB KIVI, one under a page), written into new slots. */
typedef struct palette {
    uint8_t *bytes[PALETTE];
    size_t size[PALETTE], slot_bytes;
} palette;

/* kinds: three of ob_varied_block's mix (NULL: 9 KiB, 15 KiB and under a page). */
static void palette_make(palette *pl, const unsigned *kinds)
{
    static const unsigned mixed[3] = {0, 1, 3};
    kinds = kinds ? kinds : mixed;
    pl->slot_bytes = 0;
    for (unsigned i = 0; i < PALETTE; i++) {
        pl->bytes[i] = ob_varied_block(kinds[i % 3] + 8 * i, 0, &pl->size[i]);
        assert_non_null(pl->bytes[i]);
        pl->slot_bytes = pl->size[i] > pl->slot_bytes ? pl->size[i] : pl->slot_bytes;
    }
    pl->slot_bytes = (pl->slot_bytes + 63) / 64 * 64;
}

static void palette_free(palette *pl)
{
    for (unsigned i = 0; i < PALETTE; i++)
        free(pl->bytes[i]);
}

typedef struct setup {
    char base[64], dir[128];
    kv_tiers *tiers;
    fake_device dev;
    device_pool *pool;
} setup;

/* A pool of n_slots over a host tier of host_pages pages and an NVMe tier of nvme_pages (0:
 * none), or over nothing (host_pages 0). */
static void setup_make(setup *s, const palette *pl, size_t n_slots, size_t host_pages, size_t nvme_pages)
{
    memset(s, 0, sizeof *s);
    strata_error err = {0};
    kv_lower_tier lower;
    if (host_pages) {
        kv_tiers_options o = {.host_bytes = host_pages * 4096};
        if (nvme_pages) {
            snprintf(s->base, sizeof s->base, "/tmp/strata-devroom-XXXXXX");
            assert_non_null(mkdtemp(s->base));
            snprintf(s->dir, sizeof s->dir, "%s/spill", s->base);
            o.nvme_dir = s->dir;
            o.nvme_bytes = nvme_pages * 4096;
        }
        if (!(s->tiers = kv_tiers_create(&o, &err)))
            fail_msg("%s", err.msg);
        lower = kv_tiers_lower(s->tiers);
    }
    const device_pool_mem mem = fake_mem(&s->dev);
    s->pool = device_pool_create(pl->slot_bytes, n_slots, &mem, host_pages ? &lower : NULL, &err);
    if (!s->pool)
        fail_msg("%s", err.msg);
}

static void setup_free(setup *s)
{
    device_pool_destroy(s->pool);
    kv_tiers_destroy(s->tiers);
    if (s->base[0])
        test_dir_remove_tree(s->base);
}

/* A sequence's blocks, per layer (equal counts, as worker/cuda keeps them), and which palette
 * entry each holds. */
typedef struct seq {
    uint64_t owner;
    size_t n_blocks;
    device_block h[LAYERS][MAX_BLOCKS];
    unsigned what[LAYERS][MAX_BLOCKS];
} seq;

typedef struct item {
    seq *q;
    bool pins;      /* a decode token or a later chunk: attends the layer's blocks */
    size_t n_new;   /* blocks it forms in each layer */
} item;

static void seq_clear(setup *s, seq *q)
{
    for (size_t l = 0; l < LAYERS; l++)
        for (size_t b = 0; b < q->n_blocks; b++)
            device_pool_free(s->pool, q->h[l][b]);
    q->n_blocks = 0;
}

/* One step as worker/cuda runs it; the first failure's code, or STRATA_OK. */
static int run_step(setup *s, const palette *pl, item *items, size_t n, uint64_t *rng, strata_error *err)
{
    device_block blocks[N_SEQS * MAX_BLOCKS];
    void *addrs[N_SEQS * MAX_BLOCKS];
    for (size_t l = 0; l < LAYERS; l++) {
        size_t k = 0;   /* the decode items' blocks in one acquire */
        for (size_t j = 0; j < n; j++)
            if (items[j].pins && items[j].n_new <= 1)
                for (size_t b = 0; b < items[j].q->n_blocks; b++)
                    blocks[k++] = items[j].q->h[l][b];
        int rc = device_pool_acquire(s->pool, blocks, k, addrs, err);
        for (size_t j = 0; rc == STRATA_OK && j < n; j++)   /* then each chunk's */
            if (items[j].pins && items[j].n_new > 1)
                rc = device_pool_acquire(s->pool, items[j].q->h[l], items[j].q->n_blocks, addrs, err);
        for (size_t j = 0; rc == STRATA_OK && j < n; j++)   /* every pinned block resident, its bytes intact */
            for (size_t b = 0; items[j].pins && b < items[j].q->n_blocks; b++) {
                const unsigned w = items[j].q->what[l][b];
                const void *addr = device_pool_addr(s->pool, items[j].q->h[l][b]);
                assert_non_null(addr);
                assert_memory_equal(addr, pl->bytes[w], pl->size[w]);
            }
        for (size_t j = 0; rc == STRATA_OK && j < n; j++)
            for (size_t f = 0; rc == STRATA_OK && f < items[j].n_new; f++) {
                seq *q = items[j].q;
                void *addr = NULL;
                const size_t b = q->n_blocks + f;
                if ((rc = device_pool_alloc(s->pool, q->owner, &q->h[l][b], &addr, err)) == STRATA_OK) {
                    q->what[l][b] = (unsigned)(rng_next(rng) % PALETTE);
                    memcpy(addr, pl->bytes[q->what[l][b]], pl->size[q->what[l][b]]);
                }
            }
        device_pool_unpin_all(s->pool);
        if (rc != STRATA_OK)
            return rc;
    }
    for (size_t j = 0; j < n; j++)
        items[j].q->n_blocks += items[j].n_new;
    return STRATA_OK;
}

/* The items the check takes, in order, leaving out those it refuses; returns how many. */
static size_t admit(device_pool *p, const item *items, size_t n, item *run)
{
    strata_error err = {0};
    device_room *room = device_room_begin(p, &err);
    assert_non_null(room);
    size_t n_run = 0;
    for (size_t j = 0; j < n; j++) {
        const seq *q = items[j].q;
        const int rc = device_room_add(room, &q->h[0][0], MAX_BLOCKS, LAYERS, items[j].pins ? q->n_blocks : 0,
                                       items[j].n_new, &err);
        if (rc == STRATA_OK)
            run[n_run++] = items[j];
        else if (rc != STRATA_EFULL)
            fail_msg("room check: %d %s", rc, err.msg);
    }
    device_room_end(room);
    return n_run;
}

static void test_admitted_steps_complete(void **state)
{
    (void)state;
    palette pl;
    palette_make(&pl, NULL);
    uint64_t rng = 0xdef1ce500;
    size_t admitted = 0, refused = 0, steps = 0, no_tier = 0;
    const int rounds = getenv("ROOM_ROUNDS") ? atoi(getenv("ROOM_ROUNDS")) : 80;
    for (int round = 0; round < rounds; round++) {
        const bool below = rng_next(&rng) % 4 != 0, nvme = below && rng_next(&rng) % 2;
        const size_t slots = 3 + rng_next(&rng) % 14, host = below ? 4 + rng_next(&rng) % 40 : 0;
        setup s;
        setup_make(&s, &pl, slots, host, nvme ? 4 + rng_next(&rng) % 40 : 0);
        no_tier += !below;
        seq seqs[N_SEQS];
        memset(seqs, 0, sizeof seqs);
        for (size_t i = 0; i < N_SEQS; i++)
            seqs[i].owner = 1 + i;
        strata_error err = {0};
        for (int step = 0; step < 16; step++) {
            item items[N_SEQS], run[N_SEQS];
            size_t n = 0;
            for (size_t i = 0; i < N_SEQS; i++) {
                seq *q = &seqs[i];
                const unsigned r = (unsigned)(rng_next(&rng) % 10);
                if (r == 0 && q->n_blocks) {   /* finished: its blocks go */
                    seq_clear(&s, q);
                    continue;
                }
                if (r == 1) {   /* preempted or resumed: its blocks leave first */
                    device_pool_set_waiting(s.pool, q->owner, (int)(rng_next(&rng) % 2));
                    continue;
                }
                if (r == 2)
                    continue;   /* not in this step */
                const bool pins = q->n_blocks > 0;
                size_t n_new = !pins ? rng_next(&rng) % 4 : rng_next(&rng) % 3 ? rng_next(&rng) % 2 : 2 + rng_next(&rng) % 2;
                if (q->n_blocks + n_new > MAX_BLOCKS)
                    n_new = MAX_BLOCKS - q->n_blocks;
                items[n++] = (item){q, pins, n_new};
            }
            const size_t n_run = admit(s.pool, items, n, run);
            admitted += n_run;
            refused += n - n_run;
            if (!n_run)
                continue;
            steps++;
            if (run_step(&s, &pl, run, n_run, &rng, &err) != STRATA_OK)
                fail_msg("round %d step %d (%zu slots, host %zu pages, %s): an admitted step failed: %s", round, step,
                         slots, host, nvme ? "NVMe" : "no NVMe", err.msg);
            if (s.tiers)
                kv_tiers_poll(s.tiers);
        }
        for (size_t i = 0; i < N_SEQS; i++)
            seq_clear(&s, &seqs[i]);
        setup_free(&s);
    }
    palette_free(&pl);
    /* the cases reach both sides of the check */
    print_message("%zu steps: %zu sequences admitted, %zu refused (%zu pools without a tier)\n", steps, admitted,
                  refused, no_tier);
    assert_true(admitted > 200 && refused > 20 && no_tier > 0);
}

/* Steps the check must refuse, each with the budget to raise named; and one it must take. */
static void test_refusals_named(void **state)
{
    (void)state;
    palette pl;
    palette_make(&pl, NULL);
    strata_error err = {0};
    uint64_t rng = 5;
    setup s;
    /* No tier below: 4 slots, 3 blocks formed per layer do not fit. */
    setup_make(&s, &pl, 4, 0, 0);
    seq q = {.owner = 1};
    item it = {&q, false, 2}, run[1];
    device_room *room = device_room_begin(s.pool, &err);
    assert_int_equal(device_room_add(room, &q.h[0][0], MAX_BLOCKS, LAYERS, 0, 2, &err), STRATA_EFULL);
    if (!strstr(err.msg, "--device-kv-mib") || !strstr(err.msg, "--host-kv-mib"))
        fail_msg("%s", err.msg);
    assert_int_equal(device_room_add(room, &q.h[0][0], MAX_BLOCKS, LAYERS, 0, 1, &err), STRATA_OK);
    device_room_end(room);
    it.n_new = 1;
    assert_int_equal(admit(s.pool, &it, 1, run), 1);
    assert_int_equal(run_step(&s, &pl, run, 1, &rng, &err), STRATA_OK);
    seq_clear(&s, &q);
    setup_free(&s);

    /* A layer pinning more than the pool: 4 slots, 4 blocks of a layer plus the one forming. */
    setup_make(&s, &pl, 4, 64, 0);
    q = (seq){.owner = 1};
    it = (item){&q, false, 2};
    for (int k = 0; k < 2; k++) {
        assert_int_equal(admit(s.pool, &it, 1, run), 1);
        assert_int_equal(run_step(&s, &pl, run, 1, &rng, &err), STRATA_OK);
    }
    room = device_room_begin(s.pool, &err);
    assert_int_equal(device_room_add(room, &q.h[0][0], MAX_BLOCKS, LAYERS, q.n_blocks, 1, &err), STRATA_EFULL);
    if (!strstr(err.msg, "needs 5 at once") || !strstr(err.msg, "--device-kv-mib"))
        fail_msg("%s", err.msg);
    /* an unknown handle is the caller's error, not room */
    const device_block bogus[1] = {0x12345};
    assert_int_equal(device_room_add(room, bogus, 1, 1, 1, 0, &err), STRATA_EINVAL);
    device_room_end(room);
    seq_clear(&s, &q);
    setup_free(&s);

    /* Tiers too small for what must move: 4 slots over 4 pages (one 15 KiB block); 12 blocks
     * formed, 8 of them with no copy below must leave. */
    setup_make(&s, &pl, 4, 4, 0);
    q = (seq){.owner = 1};
    room = device_room_begin(s.pool, &err);
    assert_int_equal(device_room_add(room, &q.h[0][0], MAX_BLOCKS, LAYERS, 0, 4, &err), STRATA_EFULL);
    if (!strstr(err.msg, "KV tiers full") || !strstr(err.msg, "--host-kv-mib"))
        fail_msg("%s", err.msg);
    device_room_end(room);
    setup_free(&s);
    palette_free(&pl);
}

/* A sequence decoding alone over a pool of 12 slots, 2 blocks of host memory and 35 of NVMe:
 * its blocks move to NVMe as it grows, and each decode step brings a layer's blocks back through
 * host memory. Fetched blocks keep their NVMe copy (their host copies leave without I/O), so
 * fetches cost NVMe nothing: the check once counted them against it and refused this sequence
 * from 18 of the 49 blocks of room on, though each refused step ran. Every step is taken here,
 * to 10 blocks a layer (30 of 49), and runs. */
static void test_fetches_cost_nvme_nothing(void **state)
{
    (void)state;
    static const unsigned fifteen_kib[3] = {1, 1, 1};
    palette pl;
    palette_make(&pl, fifteen_kib);   /* every block 4 pages */
    strata_error err = {0};
    uint64_t rng = 7;
    setup s;
    setup_make(&s, &pl, 12, 8, 140);
    seq q = {.owner = 1};
    item run[1];
    for (int k = 0; k <= 10; k++) {   /* a block formed per step, then a step forming none */
        item it = {&q, q.n_blocks > 0, k < 10};
        if (admit(s.pool, &it, 1, run) != 1) {
            device_room *room = device_room_begin(s.pool, &err);
            (void)device_room_add(room, &q.h[0][0], MAX_BLOCKS, LAYERS, it.pins ? q.n_blocks : 0, it.n_new, &err);
            device_room_end(room);
            fail_msg("step %d (%zu blocks a layer) refused: %s", k, q.n_blocks, err.msg);
        }
        if (run_step(&s, &pl, &it, 1, &rng, &err) != STRATA_OK)
            fail_msg("step %d: %s", k, err.msg);
        kv_tiers_poll(s.tiers);
    }
    seq_clear(&s, &q);
    setup_free(&s);
    palette_free(&pl);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_admitted_steps_complete),
        cmocka_unit_test(test_refusals_named),
        cmocka_unit_test(test_fetches_cost_nvme_nothing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
