/* strata-bench-device-pool: the device tier's bookkeeping cost per block moved, as the pool
 * grows (offload/device_pool.h). A pool of --slots slots over a host tier, "device" memory that
 * is host memory reached through memcpy (so the copies cost what a memcpy of the block costs,
 * the same at every size): every slot filled with a real fp16 block, then --moves steps each
 * bringing back one block that left (evicting the least recently used). Prints the time per
 * step; with the books kept in lists it should not grow with --slots. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvstore/clock.h"
#include "kvstore/numarg.h"
#include "offload/device_pool.h"
#include "offload/host_arena.h"
#include "offload/kv_tiers.h"
#include "tests/offload_blocks.h"

#define PROG "strata-bench-device-pool"

static void *mem_alloc(void *ctx, size_t bytes, strata_error *err)
{
    (void)ctx;
    void *p = aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (!p)
        strata_fail(err, STRATA_ENOMEM, "out of memory for %zu bytes", bytes);
    return p;
}

static void mem_free(void *ctx, void *p)
{
    (void)ctx;
    free(p);
}

static int mem_copy(void *ctx, void *dst, const void *src, size_t n, strata_error *err)
{
    (void)ctx, (void)err;
    memcpy(dst, src, n);
    return STRATA_OK;
}

int main(int argc, char **argv)
{
    long slots = 100000, moves = 20000;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--slots") == 0 && i + 1 < argc) {
            if (!strata_parse_long(PROG, "--slots", argv[++i], 2, 10000000, &slots))
                return 2;
        } else if (strcmp(argv[i], "--moves") == 0 && i + 1 < argc) {
            if (!strata_parse_long(PROG, "--moves", argv[++i], 1, 100000000, &moves))
                return 2;
        } else {
            fprintf(stderr, "usage: %s [--slots N (default 100000)] [--moves N (default 20000)]\n", PROG);
            return strcmp(argv[i], "--help") == 0 ? 0 : 2;
        }
    }
    strata_error err = {0};
    size_t block_bytes = 0;   /* a small real block: fp16, 4 tokens of one 64-wide head */
    uint8_t *block = ob_make_block(KV_CODEC_FP16, 16, 1, 64, 4, 0, 1, &block_bytes);
    if (!block) {
        fprintf(stderr, "%s: could not encode a block\n", PROG);
        return 1;
    }
    const size_t slot = (block_bytes + 63) / 64 * 64;
    const size_t n = (size_t)slots + (size_t)slots / 4;   /* a quarter more blocks than slots */
    const size_t page = HOST_ARENA_PAGE;   /* the host arena's unit */
    kv_tiers_options to = {.host_bytes = (n + 16) * ((block_bytes + page - 1) / page * page)};   /* every copy */
    kv_tiers *tiers = kv_tiers_create(&to, &err);
    device_pool_mem mem = {.name = "host memcpy", .alloc_arena = mem_alloc, .free_arena = mem_free,
                           .alloc_staging = mem_alloc, .free_staging = mem_free, .copy_out = mem_copy,
                           .copy_in = mem_copy};
    const kv_lower_tier lower = tiers ? kv_tiers_lower(tiers) : (kv_lower_tier){0};
    device_pool *p = tiers ? device_pool_create(slot, (size_t)slots, &mem, &lower, &err) : NULL;
    device_block *h = malloc(n * sizeof *h);
    if (!p || !h) {
        fprintf(stderr, "%s: %s\n", PROG, p ? "out of memory" : err.msg);
        return 1;
    }
    const double t0 = strata_mono_s();
    for (size_t i = 0; i < n; i++) {
        void *addr;
        if (device_pool_alloc(p, 1 + i % 64, &h[i], &addr, &err) != STRATA_OK) {
            fprintf(stderr, "%s: block %zu: %s\n", PROG, i, err.msg);
            return 1;
        }
        memcpy(addr, block, block_bytes);
        device_pool_unpin_all(p);
    }
    const double t1 = strata_mono_s();
    /* The oldest blocks left; bring them back one a step, oldest first: every step evicts. */
    for (long m = 0; m < moves; m++) {
        void *addr;
        if (device_pool_acquire(p, &h[(size_t)m % n], 1, &addr, &err) != STRATA_OK) {
            fprintf(stderr, "%s: move %ld: %s\n", PROG, m, err.msg);
            return 1;
        }
        device_pool_unpin_all(p);
    }
    const double t2 = strata_mono_s();
    device_pool_stats st;
    device_pool_get_stats(p, &st);
    printf("slots=%ld blocks=%zu block_bytes=%zu fill_us_per_block=%.3f move_us_per_step=%.3f evictions=%llu "
           "fetches=%llu\n",
           slots, n, block_bytes, (t1 - t0) * 1e6 / (double)n, (t2 - t1) * 1e6 / (double)moves,
           (unsigned long long)st.evictions, (unsigned long long)st.fetches);
    device_pool_destroy(p);
    kv_tiers_destroy(tiers);
    free(h);
    free(block);
    return 0;
}
