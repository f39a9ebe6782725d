/* The block pool over real lower tiers (offload/kv_tiers.h): a pool far smaller than the
 * sequences' KV evicts blocks to the host arena and the NVMe store and fetches them back for
 * attention with every byte unchanged (checked against an unconstrained pool fed the same rows),
 * for each codec; preemption spills a sequence (tail as an fp16 block) and resumes it bit for
 * bit; room is checked before a step; I/O errors and damaged copies fail only the sequence that
 * needs the block. */
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

#include "kvstore/block.h"
#include "kvstore/kv_cache.h"
#include "kvstore/plan.h"
#include "offload/kv_tiers.h"
#include "tests/offload_blocks.h"
#include "test_dir.h"

#define LAYERS 4
#define HEADS 2
#define DIM 32
#define BT 32
#define ROW (HEADS * DIM)

static uint64_t rng(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void rows(uint64_t *seed, float *k, float *v, size_t n)
{
    for (size_t i = 0; i < n * ROW; i++) {
        k[i] = (float)((int)(rng(seed) % 2001) - 1000) / 250.0f;
        v[i] = (float)((int)(rng(seed) % 2001) - 1000) / 500.0f;
    }
}

typedef struct fixture {
    char base[64], dir[128];
    kv_tiers *tiers;
    int fail_reads;   /* injected: this many NVMe read completions fail with EIO */
} fixture;

static int inject(void *ctx, const nvme_fault_op *op, int res)
{
    fixture *f = ctx;
    if (op->kind == NVME_OP_READ && f->fail_reads > 0) {
        f->fail_reads--;
        return -EIO;
    }
    return res;
}

/* A clean fixture with a fresh temporary folder for the spill directory f->dir. */
static void fixture_with_spill_dir(fixture *f)
{
    memset(f, 0, sizeof *f);
    snprintf(f->base, sizeof f->base, "/tmp/strata-kvtier-XXXXXX");
    assert_non_null(mkdtemp(f->base));
    snprintf(f->dir, sizeof f->dir, "%s/spill", f->base);
}

/* Host arena of host_kib; with nvme, an NVMe store of 16 MiB below it. */
static void tiers_up(fixture *f, size_t host_kib, bool nvme)
{
    memset(f, 0, sizeof *f);
    strata_error err = {0};
    nvme_store_options no;
    kv_tiers_options o = {.host_bytes = host_kib * 1024};
    if (nvme) {
        fixture_with_spill_dir(f);
        nvme_store_options_init(&no, f->dir, 16u << 20);
        no.fault = inject;
        no.fault_ctx = f;
        no.staging_bufs = 8;
        o.nvme_options = &no;
    }
    f->tiers = kv_tiers_create(&o, &err);
    if (!f->tiers)
        fail_msg("%s", err.msg);
}

static void tiers_down(fixture *f)
{
    kv_tiers_destroy(f->tiers);
    if (f->base[0])
        test_dir_remove_tree(f->base);
}

static kv_pool *make_pool(const char *codec, size_t blocks_per_layer, kv_tiers *tiers)
{
    kv_geometry g = {.n_layers = LAYERS, .n_kv_heads = HEADS, .head_dim = DIM, .block_tokens = BT};
    kv_codec_params plan[LAYERS];
    strata_error err = {0};
    if (kv_plan_parse(codec, LAYERS, plan, &err) != STRATA_OK)
        fail_msg("%s", err.msg);
    kv_pool *p = kv_pool_create_plan(&g, plan, blocks_per_layer, &err);
    if (!p)
        fail_msg("%s", err.msg);
    if (tiers) {
        kv_lower_tier lower = kv_tiers_lower(tiers);
        assert_int_equal(kv_pool_set_lower_tier(p, &lower, &err), STRATA_OK);
    }
    return p;
}

/* Appends n tokens (one call: a prompt chunk when n > 1) to every layer of both sequences. */
static void append_both(kv_seq *a, kv_seq *b, uint64_t *seed, size_t n)
{
    float *k = malloc(n * ROW * sizeof *k), *v = malloc(n * ROW * sizeof *v);
    assert_non_null(k);
    assert_non_null(v);
    strata_error err = {0};
    for (int l = 0; l < LAYERS; l++) {
        rows(seed, k, v, n);
        if (kv_seq_append(a, l, k, v, n, &err) != STRATA_OK)
            fail_msg("append a: %s", err.msg);
        if (b && kv_seq_append(b, l, k, v, n, &err) != STRATA_OK)
            fail_msg("append b: %s", err.msg);
        kv_seq_unpin(a);
        if (b)
            kv_seq_unpin(b);
    }
    free(k);
    free(v);
}

/* Every layer of seq, acquired through its tiers, equals ref's byte for byte. */
static void assert_same(kv_seq *seq, const kv_seq *ref)
{
    strata_error err = {0};
    for (int l = 0; l < LAYERS; l++) {
        kv_layer_view v, r;
        if (kv_seq_acquire_layer(seq, l, &v, &err) != STRATA_OK)
            fail_msg("acquire layer %d: %s", l, err.msg);
        kv_seq_layer_view(ref, l, &r);
        assert_int_equal(v.n_blocks, r.n_blocks);
        for (size_t b = 0; b < v.n_blocks; b++) {
            assert_non_null(v.blocks[b]);
            uint32_t len = (uint32_t)r.blocks[b][KV_HDR_BLOCK_BYTES] | (uint32_t)r.blocks[b][KV_HDR_BLOCK_BYTES + 1] << 8 |
                           (uint32_t)r.blocks[b][KV_HDR_BLOCK_BYTES + 2] << 16;
            assert_memory_equal(v.blocks[b], r.blocks[b], len);
        }
        assert_int_equal(v.tail_tokens, r.tail_tokens);
        if (r.tail_tokens) {
            assert_memory_equal(v.tail_k, r.tail_k, r.tail_tokens * ROW * sizeof(uint16_t));
            assert_memory_equal(v.tail_v, r.tail_v, r.tail_tokens * ROW * sizeof(uint16_t));
        }
        kv_seq_unpin(seq);
    }
}

static void run_identical(const char *codec, bool nvme)
{
    fixture f;
    tiers_up(&f, nvme ? 48 : 4096, nvme);
    /* 12 blocks per layer over the run; the small pool holds 3 per layer (12 slots in all: one
     * layer's worth). Plans with two slot sizes (a range list; ott, whose layers 0-1 keep no
     * pool) get 6 per layer: 12 per size. */
    size_t small = strchr(codec, ':') || !strncmp(codec, "ott", 3) ? 6 : 3;
    kv_pool *ref_pool = make_pool(codec, 16, NULL), *pool = make_pool(codec, small, f.tiers);
    strata_error err = {0};
    kv_seq *ref = kv_seq_create(ref_pool, 16 * BT, &err), *seq = kv_seq_create(pool, 16 * BT, &err);
    assert_non_null(ref);
    assert_non_null(seq);
    uint64_t seed = 42;
    append_both(seq, ref, &seed, 100);   /* a prompt */
    for (int step = 0; step < 12 * BT - 100; step++) {
        append_both(seq, ref, &seed, 1);
        if (step % 29 == 0)
            assert_same(seq, ref);
    }
    assert_same(seq, ref);
    kv_pool_stats ps;
    kv_pool_get_stats(pool, &ps);
    assert_true(ps.evictions > 0);
    assert_true(ps.fetches > 0);
    kv_tiers_stats ts;
    kv_tiers_get_stats(f.tiers, &ts);
    if (nvme) {
        assert_true(ts.spills > 0);
        assert_true(ts.restores > 0);
    }
    assert_int_equal(ts.crc_failures, 0);
    kv_seq_stats st;
    kv_seq_get_stats(seq, &st);
    assert_true(st.resident_blocks <= kv_pool_capacity(pool));
    assert_true(st.lower_blocks > 0);
    kv_seq_destroy(seq);
    kv_seq_destroy(ref);
    kv_pool_destroy(pool);
    kv_pool_destroy(ref_pool);
    kv_tiers_get_stats(f.tiers, &ts);
    assert_int_equal(ts.host_blocks, 0);   /* destroying the sequence released its copies */
    tiers_down(&f);
}

static void test_identical_host_only(void **state)
{
    (void)state;
    const char *codecs[] = {"fp16", "kivi2-r32", "kivi4", "gear2-g32-r32", "ott2-r32", "tada2-r32", "0-1:kivi4-r32,2-3:tada2-r32"};
    for (size_t i = 0; i < sizeof codecs / sizeof *codecs; i++)
        run_identical(codecs[i], false);
}

static void test_identical_nvme(void **state)
{
    (void)state;
    const char *codecs[] = {"fp16", "kivi2-r32", "gear2-g32-r32", "ott2-r32", "tada4-r32"};
    for (size_t i = 0; i < sizeof codecs / sizeof *codecs; i++)
        run_identical(codecs[i], true);
}

/* Preemption: A is spilled (blocks and tail) while B takes the whole pool, then resumes and goes
 * on exactly as an unconstrained copy of it. */
static void test_spill_resume(void **state)
{
    (void)state;
    fixture f;
    tiers_up(&f, 64, true);
    kv_pool *ref_pool = make_pool("kivi2-r32", 16, NULL), *pool = make_pool("kivi2-r32", 4, f.tiers);
    strata_error err = {0};
    kv_seq *ref = kv_seq_create(ref_pool, 16 * BT, &err), *a = kv_seq_create(pool, 16 * BT, &err),
           *b = kv_seq_create(pool, 16 * BT, &err);
    assert_non_null(ref);
    assert_non_null(a);
    assert_non_null(b);
    uint64_t seed = 7, seed_b = 99;
    append_both(a, ref, &seed, 70);
    for (int i = 0; i < 45; i++)
        append_both(a, ref, &seed, 1);   /* 115 tokens: 2 blocks + a 51-token tail per layer */
    assert_same(a, ref);

    if (kv_seq_spill(a, &err) != STRATA_OK)
        fail_msg("spill: %s", err.msg);
    assert_true(kv_seq_is_spilled(a));
    kv_seq_stats st;
    kv_seq_get_stats(a, &st);
    assert_int_equal(st.resident_blocks, 0);
    float k[ROW], v[ROW];
    rows(&seed_b, k, v, 1);
    assert_int_equal(kv_seq_append(a, 0, k, v, 1, &err), STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "spilled"));
    kv_layer_view view;
    assert_int_equal(kv_seq_acquire_layer(a, 0, &view, &err), STRATA_EINVAL);
    assert_int_equal(kv_seq_check_room(a, 1, &err), STRATA_EINVAL);

    /* B fills the pool several times over while A waits below. */
    append_both(b, NULL, &seed_b, 64);
    for (int i = 0; i < 200; i++)
        append_both(b, NULL, &seed_b, 1);
    for (int l = 0; l < LAYERS; l++) {
        assert_int_equal(kv_seq_acquire_layer(b, l, &view, &err), STRATA_OK);
        kv_seq_unpin(b);
    }

    assert_int_equal(kv_seq_resume(a, &err), STRATA_OK);
    assert_false(kv_seq_is_spilled(a));
    assert_same(a, ref);   /* tails bit for bit, blocks byte for byte */
    for (int i = 0; i < 80; i++)
        append_both(a, ref, &seed, 1);
    assert_same(a, ref);
    kv_pool_stats ps;
    kv_pool_get_stats(pool, &ps);
    assert_int_equal(ps.seq_spills, 1);
    assert_int_equal(ps.seq_resumes, 1);
    kv_seq_destroy(a);
    kv_seq_destroy(b);
    kv_seq_destroy(ref);
    kv_pool_destroy(pool);
    kv_pool_destroy(ref_pool);
    tiers_down(&f);
}

/* Room is checked before a step; nothing changes when it fails. */
static void test_check_room(void **state)
{
    (void)state;
    strata_error err = {0};
    /* Without a lower tier: 2 blocks per layer = 8 slots. */
    kv_pool *p = make_pool("kivi2-r32", 2, NULL);
    kv_seq *s = kv_seq_create(p, 16 * BT, &err);
    uint64_t seed = 1;
    assert_int_equal(kv_seq_check_room(s, 96, &err), STRATA_OK);   /* 2 blocks per layer */
    assert_int_equal(kv_seq_check_room(s, 160, &err), STRATA_EFULL);
    assert_non_null(strstr(err.msg, "exhausted"));
    assert_int_equal(kv_seq_check_room(s, 16 * BT + 1, &err), STRATA_EINVAL);
    append_both(s, NULL, &seed, 96);
    assert_int_equal(kv_seq_check_room(s, 32, &err), STRATA_EFULL);
    assert_int_equal(kv_seq_length(s, 0), 96);
    kv_seq_destroy(s);
    kv_pool_destroy(p);

    /* With a lower tier the pool must still hold one layer's blocks at once. */
    fixture f;
    tiers_up(&f, 1024, false);
    p = make_pool("kivi2-r32", 1, f.tiers);   /* 4 slots */
    s = kv_seq_create(p, 16 * BT, &err);
    assert_int_equal(kv_seq_check_room(s, 4 * BT + 32, &err), STRATA_OK);   /* prefill: 4 new blocks per layer */
    append_both(s, NULL, &seed, 4 * BT + 32);
    assert_int_equal(kv_seq_check_room(s, 1, &err), STRATA_OK);
    assert_int_equal(kv_seq_check_room(s, 32, &err), STRATA_EFULL);   /* 5 blocks at once for attention */
    assert_non_null(strstr(err.msg, "raise the device KV budget"));
    kv_seq_destroy(s);
    kv_pool_destroy(p);
    tiers_down(&f);
}

/* A host tier too small: the step that needs room fails with EFULL, the layer unchanged. */
static void test_lower_full(void **state)
{
    (void)state;
    fixture f;
    tiers_up(&f, 12, false);   /* three 4 KiB pages: one fp16 block of 2 x 32 x 32 (8320 bytes) */
    kv_pool *p = make_pool("fp16", 1, f.tiers);   /* 4 slots */
    strata_error err = {0};
    kv_seq *s = kv_seq_create(p, 16 * BT, &err);
    uint64_t seed = 3;
    append_both(s, NULL, &seed, BT);   /* one block per layer: the pool is full */
    float k[BT * ROW], v[BT * ROW];
    rows(&seed, k, v, BT);
    assert_int_equal(kv_seq_check_room(s, BT, &err), STRATA_EFULL);   /* 4 evictions, room for 1 */
    assert_non_null(strstr(err.msg, "tiers full"));
    assert_int_equal(kv_seq_append(s, 0, k, v, BT, &err), STRATA_OK);   /* evicts one block */
    kv_seq_unpin(s);
    assert_int_equal(kv_seq_append(s, 1, k, v, BT, &err), STRATA_EFULL);
    assert_non_null(strstr(err.msg, "host arena full"));
    assert_int_equal(kv_seq_length(s, 1), BT);
    assert_int_equal(kv_seq_length(s, 0), 2 * BT);
    kv_seq_destroy(s);
    kv_pool_destroy(p);
    tiers_down(&f);
}

/* An NVMe read error or a damaged copy on disk fails the acquire of the sequence that needs the
 * block, with a message; another sequence keeps working, and the failed one can try again. */
static void test_faults_fail_one_sequence(void **state)
{
    (void)state;
    fixture f;
    tiers_up(&f, 32, true);
    kv_pool *p = make_pool("kivi2-r32", 3, f.tiers);
    kv_pool *ref_pool = make_pool("kivi2-r32", 16, NULL);
    strata_error err = {0};
    kv_seq *a = kv_seq_create(p, 16 * BT, &err), *b = kv_seq_create(p, 16 * BT, &err);
    kv_seq *ref = kv_seq_create(ref_pool, 16 * BT, &err);
    uint64_t seed = 5, seed_b = 6;
    append_both(a, ref, &seed, 300);
    append_both(b, NULL, &seed_b, 300);
    kv_tiers_stats ts;
    kv_tiers_get_stats(f.tiers, &ts);
    assert_true(ts.nvme_blocks > 0);
    /* EIO on the reads of A's first layer. */
    kv_layer_view view;
    int rc = STRATA_OK;
    f.fail_reads = 1000;
    for (int l = 0; l < LAYERS && rc == STRATA_OK; l++) {
        rc = kv_seq_acquire_layer(a, l, &view, &err);
        kv_seq_unpin(a);
    }
    f.fail_reads = 0;
    assert_int_equal(rc, STRATA_EIO);
    assert_non_null(strstr(err.msg, "sequence"));
    for (int l = 0; l < LAYERS; l++) {
        assert_int_equal(kv_seq_acquire_layer(b, l, &view, &err), STRATA_OK);
        kv_seq_unpin(b);
    }
    assert_same(a, ref);   /* nothing was lost: the retry reads the same bytes */

    /* Damage every slab byte range that holds data: A's blocks below fail with ECRC. */
    kv_seq_spill(a, &err);
    for (int l = 0; l < LAYERS; l++) {
        assert_int_equal(kv_seq_acquire_layer(b, l, &view, &err), STRATA_OK);   /* push A down */
        kv_seq_unpin(b);
    }
    char slab[256];
    snprintf(slab, sizeof slab, "%s/slab-0000.kv", f.dir);
    int fd = open(slab, O_RDWR);
    assert_true(fd >= 0);
    struct stat sb;
    assert_int_equal(fstat(fd, &sb), 0);
    for (off_t off = 200; off < sb.st_size; off += 4096) {
        uint8_t byte;
        if (pread(fd, &byte, 1, off) != 1)
            break;
        byte ^= 0x5a;
        assert_int_equal(pwrite(fd, &byte, 1, off), 1);
    }
    fsync(fd);
    close(fd);
    rc = kv_seq_resume(a, &err);
    for (int l = 0; l < LAYERS && rc == STRATA_OK; l++) {
        rc = kv_seq_acquire_layer(a, l, &view, &err);
        kv_seq_unpin(a);
    }
    assert_int_equal(rc, STRATA_ECRC);   /* whichever byte the flips hit: damage to a cached copy */
    kv_tiers_get_stats(f.tiers, &ts);
    assert_true(ts.crc_failures > 0);
    kv_seq_destroy(a);
    kv_seq_destroy(b);
    kv_seq_destroy(ref);
    kv_pool_destroy(p);
    kv_pool_destroy(ref_pool);
    tiers_down(&f);
}

/* The room check counts blocks as the tiers store them, in whole 4 KiB pages: a host tier of two
 * pages takes two 1.6 KiB kivi2 blocks, not four. A step the check passes then runs; before, the
 * check counted raw bytes, passed, and the step failed half way (layers of unequal length). */
static void test_room_in_pages(void **state)
{
    (void)state;
    strata_error err = {0};
    kv_tiers_options o = {.host_bytes = 2 * 4096};
    kv_tiers *t = kv_tiers_create(&o, &err);
    assert_non_null(t);
    const kv_geometry g = {.n_layers = LAYERS, .n_kv_heads = HEADS, .head_dim = DIM, .block_tokens = BT};
    kv_codec_params plan[LAYERS];
    assert_int_equal(kv_plan_parse("kivi2-r32", LAYERS, plan, &err), STRATA_OK);
    kv_pool *p = kv_pool_create_plan(&g, plan, 1, &err);   /* one slot per layer */
    assert_non_null(p);
    assert_true(kv_pool_slot_bytes(p) < 4096 / 2);
    kv_lower_tier lower = kv_tiers_lower(t);
    assert_int_equal(kv_pool_set_lower_tier(p, &lower, &err), STRATA_OK);
    kv_seq *s = kv_seq_create(p, 16 * BT, &err);
    assert_non_null(s);
    float rows[64 * HEADS * DIM];
    for (size_t i = 0; i < sizeof rows / sizeof *rows; i++)
        rows[i] = (float)((int)(i * 37 % 2001) - 1000) / 250.0f;
    for (int l = 0; l < LAYERS; l++) {   /* one block per layer: the pool is full */
        assert_int_equal(kv_seq_append(s, l, rows, rows, 64, &err), STRATA_OK);
        kv_seq_unpin(s);
    }
    /* The next block row must move four blocks down: four pages, the tier has two. */
    assert_int_equal(kv_seq_check_room(s, BT, &err), STRATA_EFULL);
    assert_non_null(strstr(err.msg, "KV tiers full"));
    kv_seq_destroy(s);
    kv_pool_destroy(p);
    kv_tiers_destroy(t);
}

/* The tiers' two room figures (kv_lower_tier.room): through host memory, and below it. */
static void assert_room(const kv_lower_tier *lower, size_t unit, size_t through_host, size_t below)
{
    size_t h = 1, b = 1;
    lower->room(lower->ctx, unit, &h, &b);
    if (h != through_host || b != below)
        fail_msg("room for blocks of %zu bytes: %zu through host memory and %zu below, want %zu and %zu", unit, h, b,
                 through_host, below);
}

/* The room the tiers report counts NVMe free space as whole blocks per hole: with every other
 * one-page block freed, the NVMe tier has eight free pages but no two together, so it has room
 * for eight one-page blocks and for no two-page one (the room check must not count bytes that
 * no block can use: the step would pass the check and then fail half way); less one for the
 * block only in host memory, which making room may move there first. Host and NVMe room do not
 * add up: a step fits one or the other. */
static void test_room_fragmented(void **state)
{
    (void)state;
    fixture f;
    fixture_with_spill_dir(&f);
    nvme_store_options no;
    nvme_store_options_init(&no, f.dir, 16 * 4096);
    no.staging_bufs = 4;
    kv_tiers_options o = {.host_bytes = 4096, .nvme_options = &no};
    strata_error err = {0};
    f.tiers = kv_tiers_create(&o, &err);
    if (!f.tiers)
        fail_msg("%s", err.msg);
    kv_lower_tier lower = kv_tiers_lower(f.tiers);
    enum { N = 17 };   /* 16 on NVMe (its whole budget), the last in host memory */
    uint64_t h[N];
    for (unsigned i = 0; i < N; i++) {
        size_t size;
        uint8_t *b = ob_make_block(KV_CODEC_KIVI, 2, 1, 64, 32, i, i + 1, &size);
        assert_non_null(b);
        assert_true(size <= 4096);
        if (lower.put(lower.ctx, b, size, 1, i, &h[i], &err) != STRATA_OK)
            fail_msg("put %u: %s", i, err.msg);
        free(b);
    }
    kv_tiers_stats st;
    for (int k = 0; k < 1000; k++) {
        kv_tiers_poll(f.tiers);
        kv_tiers_get_stats(f.tiers, &st);
        if (st.nvme_blocks == N - 1)
            break;
        usleep(1000);
    }
    assert_int_equal(st.nvme_blocks, N - 1);
    for (unsigned i = 0; i < N - 1; i += 2)
        lower.release(lower.ctx, h[i]);
    kv_tiers_get_stats(f.tiers, &st);
    const size_t host_free = st.host_capacity_bytes - st.host_used_bytes;
    assert_int_equal(host_free, 0);
    assert_int_equal(st.host_blocks, 1);   /* the last block, only there: NVMe was full */
    assert_int_equal(st.nvme_blocks, (N - 1) / 2);
    assert_room(&lower, 4096, 0, 7 * 4096);
    assert_room(&lower, 8192, 0, 0);   /* a 2-page block cannot pass through 1 page of host */
    assert_room(&lower, 100, 0, 7 * 4096);   /* a block takes a whole page */
    for (unsigned i = 1; i < N; i += 2)
        lower.release(lower.ctx, h[i]);
    lower.release(lower.ctx, h[N - 1]);
    assert_room(&lower, 4096, 4096, 16 * 4096);   /* all free, one hole again */
    assert_room(&lower, 8192, 0, 0);
    tiers_down(&f);
}

/* Making room moves host blocks to NVMe in LRU order, and a move need not open an extent the
 * new block fits in: here the host holds a one-page block X (older) and a four-page block Y,
 * NVMe one free four-page hole. A four-page put moves X (the hole is now three pages, no four
 * fit) and then cannot move Y: it fails with the tiers full. The room the tiers report must say
 * so beforehand (host room plus NVMe room, 16 KiB, admitted this put before; now neither host
 * memory nor NVMe, less the two host-only blocks, has room). */
static void test_room_moves_on_the_way(void **state)
{
    (void)state;
    fixture f;
    fixture_with_spill_dir(&f);
    nvme_store_options no;
    nvme_store_options_init(&no, f.dir, 4 * 4096);
    kv_tiers_options o = {.host_bytes = 5 * 4096, .nvme_options = &no,
                          .watermarks = {.high_bytes = 5 * 4096, .low_bytes = 5 * 4096}};   /* no moves but for room */
    strata_error err = {0};
    if (!(f.tiers = kv_tiers_create(&o, &err)))
        fail_msg("%s", err.msg);
    kv_lower_tier lower = kv_tiers_lower(f.tiers);
    size_t small_len, big_len;
    uint8_t *small = ob_make_block(KV_CODEC_KIVI, 2, 1, 64, 32, 0, 1, &small_len);
    uint8_t *big = ob_make_block(KV_CODEC_KIVI, 4, 3, 64, 64, 0, 2, &big_len);
    assert_non_null(small);
    assert_non_null(big);
    assert_true(small_len <= 4096 && big_len > 3 * 4096 && big_len <= 4 * 4096);
    uint64_t x, y, z;
    assert_int_equal(lower.put(lower.ctx, small, small_len, 1, 0, &x, &err), STRATA_OK);
    assert_int_equal(lower.put(lower.ctx, big, big_len, 1, 1, &y, &err), STRATA_OK);
    assert_room(&lower, big_len, 0, 0);
    const int rc = lower.put(lower.ctx, big, big_len, 1, 2, &z, &err);
    if (rc != STRATA_EFULL)
        fail_msg("the put the room refused: rc %d, %s", rc, err.msg);
    free(small);
    free(big);
    tiers_down(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_identical_host_only),
        cmocka_unit_test(test_room_in_pages),
        cmocka_unit_test(test_room_fragmented),
        cmocka_unit_test(test_room_moves_on_the_way),
        cmocka_unit_test(test_identical_nvme),
        cmocka_unit_test(test_spill_resume),
        cmocka_unit_test(test_check_room),
        cmocka_unit_test(test_lower_full),
        cmocka_unit_test(test_faults_fail_one_sequence),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
