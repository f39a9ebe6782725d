/* Admission's block rows (coordinator/sched/kv_rows.h) against the tiers a worker really builds:
 * the rows a stage admits beyond its device must fit the room a real host arena and NVMe store
 * report for blocks of the stage's largest size (offload/kv_tiers.c's room, which the workers'
 * checks use), and not by much less. Plans of one block size, of sizes that are not whole pages
 * (kivi2: 9,344 bytes in 3 pages, where counting bytes admitted a quarter too many rows), and of
 * several sizes; budgets where host memory or NVMe is the larger, NVMe in one slab file and in
 * two. Also the slab arithmetic against a real store. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "coordinator/sched/kv_rows.h"
#include "kvstore/plan.h"
#include "offload/kv_tiers.h"
#include "test_dir.h"

#define MIB ((uint64_t)1 << 20)
enum { LAYERS = 30 };   /* SmolLM2-135M's shape: 3 KV heads of 64, blocks of 64 tokens */
static const kv_geometry geom = {LAYERS, 3, 64, 64};

typedef struct tmp_dir {
    char base[64], spill[128];
} tmp_dir;

static void tmp_dir_make(tmp_dir *d)
{
    snprintf(d->base, sizeof d->base, "/tmp/strata-kvrows-XXXXXX");
    assert_non_null(mkdtemp(d->base));
    snprintf(d->spill, sizeof d->spill, "%s/spill", d->base);
}

/* The real store's fit for blocks of unit bytes, with sparse slab files (no_prealloc). */
static uint64_t store_blocks(uint64_t budget, uint64_t unit)
{
    tmp_dir d;
    tmp_dir_make(&d);
    nvme_store_options o = {.dir = d.spill, .budget_bytes = budget, .no_prealloc = true};
    strata_error err = {0};
    nvme_store *s = nvme_store_create(&o, &err);
    if (!s)
        fail_msg("nvme_store_create: %s", err.msg);
    uint64_t n = nvme_store_fit_bytes(s, unit) / unit;
    nvme_store_destroy(s);
    test_dir_remove_tree(d.base);
    return n;
}

static void test_nvme_blocks_match_the_store(void **state)
{
    (void)state;
    const uint64_t units[] = {4096, 12288, 53248};
    const uint64_t budgets[] = {4096, 3 * 4096 - 1, 10 * MIB + 4096 * 5, 1024 * MIB + 100 * 4096 + 7};
    for (size_t i = 0; i < sizeof budgets / sizeof *budgets; i++)
        for (size_t u = 0; u < sizeof units / sizeof *units; u++) {
            const uint64_t want = store_blocks(budgets[i], units[u]), got = kv_nvme_blocks(budgets[i], units[u]);
            if (got != want)
                fail_msg("budget %llu, unit %llu: %llu blocks, the store holds %llu", (unsigned long long)budgets[i],
                         (unsigned long long)units[u], (unsigned long long)got, (unsigned long long)want);
        }
    /* Two slab files of 1 GiB and 100 pages: the second's tail holds no whole 13-page block, so
     * the budget divided by the block would count one too many. */
    const uint64_t two = 1024 * MIB + 100 * 4096;
    assert_true(kv_nvme_blocks(two, 53248) < two / 53248);
}

/* The rows a stage with these plans admits beyond its device fit the real tiers' room. */
static void check_rows(const char *const *names, int n_plans, uint64_t host, uint64_t nvme)
{
    kv_codec_params plans[4][LAYERS];
    const kv_codec_params *ptrs[4];
    strata_error err = {0};
    for (int i = 0; i < n_plans; i++) {
        if (kv_plan_parse(names[i], LAYERS, plans[i], &err) != STRATA_OK)
            fail_msg("%s: %s", names[i], err.msg);
        ptrs[i] = plans[i];
    }
    const kv_stage_budget budget = {.device_bytes = 8 * MIB, .host_bytes = host, .nvme_bytes = nvme};
    sched_replica_config rows;
    if (kv_stage_rows(&geom, ptrs, n_plans, &budget, &rows, &err) != STRATA_OK)
        fail_msg("kv_stage_rows: %s", err.msg);
    assert_true(rows.device_blocks > 0 && rows.total_blocks >= rows.device_blocks);

    tmp_dir d;
    tmp_dir_make(&d);
    kv_tiers_options o = {.host_bytes = (size_t)host, .nvme_dir = nvme ? d.spill : NULL, .nvme_bytes = nvme};
    kv_tiers *t = kv_tiers_create(&o, &err);
    if (!t)
        fail_msg("kv_tiers_create: %s", err.msg);
    kv_lower_tier lower = kv_tiers_lower(t);
    const size_t unit = kv_lower_unit_bytes(kv_plans_largest_block(&geom, ptrs, n_plans));
    size_t through_host, below;
    lower.room(lower.ctx, unit, &through_host, &below);
    const size_t room_blocks = (through_host > below ? through_host : below) / unit;
    const size_t admitted = (rows.total_blocks - rows.device_blocks) * LAYERS;
    if (admitted > room_blocks || admitted + LAYERS <= room_blocks)
        fail_msg("plans %s%s, host %llu, nvme %llu: %zu blocks admitted below the device, the tiers hold %zu of %zu "
                 "bytes", names[0], n_plans > 1 ? " and others" : "", (unsigned long long)host,
                 (unsigned long long)nvme, admitted, room_blocks, unit);
    kv_tiers_destroy(t);
    test_dir_remove_tree(d.base);
}

static void test_rows_fit_the_tiers(void **state)
{
    (void)state;
    const char *fp16[] = {"fp16"}, *kivi2[] = {"kivi2"}, *kivi4[] = {"kivi4"}, *gear2[] = {"gear2"};
    const char *mixed[] = {"kivi4", "kivi2", "fp16"};
    const struct {
        uint64_t host, nvme;
    } budgets[] = {{4 * MIB, 0}, {4 * MIB, 24 * MIB}, {24 * MIB, 4 * MIB}, {3 * MIB + 5 * 4096, 17 * MIB + 4096}};
    for (size_t i = 0; i < sizeof budgets / sizeof *budgets; i++) {
        check_rows(fp16, 1, budgets[i].host, budgets[i].nvme);
        check_rows(kivi2, 1, budgets[i].host, budgets[i].nvme);
        check_rows(kivi4, 1, budgets[i].host, budgets[i].nvme);
        check_rows(gear2, 1, budgets[i].host, budgets[i].nvme);
        check_rows(mixed, 3, budgets[i].host, budgets[i].nvme);
    }
}

static void test_device_rows(void **state)
{
    (void)state;
    kv_codec_params fp16[LAYERS], kivi2[LAYERS];
    strata_error err = {0};
    assert_int_equal(kv_plan_parse("fp16", LAYERS, fp16, &err), STRATA_OK);
    assert_int_equal(kv_plan_parse("kivi2", LAYERS, kivi2, &err), STRATA_OK);
    const kv_codec_params *both[2] = {kivi2, fp16};
    const size_t fp16_block = kv_plan_largest_block(&geom, fp16);
    sched_replica_config rows;
    /* No tier below: the device alone, per layer the largest block of the plans. */
    kv_stage_budget b = {.device_bytes = 10 * LAYERS * fp16_block + 5};
    assert_int_equal(kv_stage_rows(&geom, both, 2, &b, &rows, &err), STRATA_OK);
    assert_int_equal(rows.device_blocks, 10);
    assert_int_equal(rows.total_blocks, 10);
    assert_int_equal(rows.stream_blocks, 10);
    /* With a host tier: shared slots, and one layer alone may take every slot but one. */
    b.host_bytes = MIB;
    assert_int_equal(kv_stage_rows(&geom, both, 2, &b, &rows, &err), STRATA_OK);
    assert_int_equal(rows.device_blocks, 10);
    assert_int_equal(rows.stream_blocks, 10 * LAYERS - 1);
    /* A budget that holds no row is refused, naming the row's size. */
    b.device_bytes = LAYERS * fp16_block - 1;
    assert_int_equal(kv_stage_rows(&geom, both, 2, &b, &rows, &err), STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "holds no block row"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_nvme_blocks_match_the_store),
        cmocka_unit_test(test_rows_fit_the_tiers),
        cmocka_unit_test(test_device_rows),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
