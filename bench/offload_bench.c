/* strata-offload-bench: spill and restore throughput of the NVMe tier (offload/nvme_store.h).
 *
 * Spill: writes --total-mib of real KV blocks of exactly --block-bytes each (fp16 blocks whose
 * geometry is chosen so that the block is that size) and counts a block only when its write is
 * complete, durable (batched fdatasync) and verified, keeping 4 x --qd requests outstanding so
 * that the store always has --qd operations in the kernel. Restore: reads every block back into a
 * ring of 4 x --qd host buffers, each verified with kv_block_verify (both CRC32Cs). Prints one line:
 *   spill_gbps=... restore_gbps=... blocks=... block_bytes=... fsyncs=... path="..."
 * GB/s are 10^9 bytes per second of block bytes. bench/offload.sh runs it beside fio. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvstore/block.h"
#include "kvstore/clock.h"
#include "kvstore/numarg.h"
#include "offload/nvme_store.h"

#define PROG "strata-offload-bench"

/* An fp16 block of exactly bytes bytes (a multiple of 128, >= 256): header 128 bytes, K and V
 * sections of (bytes - 128) / 2 each = 32 tokens x 1 head x dim x 2 bytes. */
static uint8_t *make_block(size_t bytes, uint64_t seed, strata_error *err)
{
    if (bytes < 256 || bytes % 128 != 0 || (bytes - 128) / 128 > 65535) {
        strata_fail(err, STRATA_EINVAL, "--block-bytes must be a multiple of 128 between 256 and %d", 65535 * 128 + 128);
        return NULL;
    }
    kv_block_desc d = {0};
    d.codec = KV_CODEC_FP16;
    d.k_bits = d.v_bits = 16;
    d.n_tokens = 32;
    d.n_kv_heads = 1;
    d.head_dim = (int)((bytes - 128) / 128);
    d.first_pos = seed * 32;
    if (kv_block_bytes(&d) != bytes) {
        strata_fail(err, STRATA_EINVAL, "cannot make a %zu-byte block (got %zu)", bytes, kv_block_bytes(&d));
        return NULL;
    }
    size_t n = (size_t)d.n_tokens * (size_t)d.head_dim;
    float *k = malloc(n * sizeof *k), *v = malloc(n * sizeof *v);
    uint8_t *b = malloc(bytes);
    if (!k || !v || !b) {
        free(k);
        free(v);
        free(b);
        strata_fail(err, STRATA_ENOMEM, "out of memory");
        return NULL;
    }
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        k[i] = (float)((int)(x % 2048) - 1024) / 128.0f;
        v[i] = (float)((int)((x >> 20) % 2048) - 1024) / 256.0f;
    }
    int rc = kv_block_encode(&d, k, v, b, bytes, NULL, err);
    free(k);
    free(v);
    if (rc != STRATA_OK) {
        free(b);
        return NULL;
    }
    return b;
}

#define MAX_BLOCK_BYTES (65535L * 128 + 128)

static void usage(FILE *out)
{
    fprintf(out,
            "usage: strata-offload-bench --dir DIR [--block-bytes N] [--qd N] [--total-mib N]\n"
            "                            [--sync-io] [--buffered] [--readback]\n"
            "\n"
            "Spill and restore throughput of the NVMe tier: writes --total-mib of real KV blocks to a\n"
            "slab file in DIR through io_uring, then reads them all back and verifies each. Prints\n"
            "one line: spill_gbps=... restore_gbps=... blocks=... (bench/offload.sh runs it beside fio).\n"
            "\n"
            "  --dir DIR          folder for the slab file (yours, not group/other-writable; made if missing)\n"
            "  --block-bytes N    bytes per block, a multiple of 128 in 256..%ld (default 65536)\n"
            "  --qd N             operations in the kernel at once, 1..1024 (default 32)\n"
            "  --total-mib N      MiB of blocks to write (default 1024)\n"
            "  --sync-io          pwrite/pread instead of io_uring\n"
            "  --buffered         through the page cache instead of O_DIRECT\n"
            "  --readback         verify each write by reading it back (default: CRC on restore)\n"
            "  -h, --help         this help\n",
            MAX_BLOCK_BYTES);
}

int main(int argc, char **argv)
{
    const char *dir = NULL;
    long block_arg = 65536, qd_arg = 32, mib_arg = 1024;
    bool sync_io = false, buffered = false, readback = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        bool ok = true;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--dir") && val) dir = argv[++i];
        else if (!strcmp(a, "--block-bytes") && val)
            ok = strata_parse_long(PROG, a, argv[++i], 256, MAX_BLOCK_BYTES, &block_arg);
        else if (!strcmp(a, "--qd") && val) ok = strata_parse_long(PROG, a, argv[++i], 1, 1024, &qd_arg);
        else if (!strcmp(a, "--total-mib") && val) ok = strata_parse_long(PROG, a, argv[++i], 1, 1L << 24, &mib_arg);
        else if (!strcmp(a, "--sync-io")) sync_io = true;
        else if (!strcmp(a, "--buffered")) buffered = true;
        else if (!strcmp(a, "--readback")) readback = true;
        else {
            bool takes_value = !strcmp(a, "--dir") || !strcmp(a, "--block-bytes") || !strcmp(a, "--qd") ||
                               !strcmp(a, "--total-mib");
            fprintf(stderr, "%s: %s '%s' (try --help)\n", PROG, takes_value ? "missing value for" : "unknown option", a);
            return 2;
        }
        if (!ok)
            return 2;  /* strata_parse_long said why */
    }
    if (!dir) {
        fprintf(stderr, "%s: --dir is required (try --help)\n", PROG);
        return 2;
    }
    if (block_arg % 128) {
        fprintf(stderr, "%s: --block-bytes must be a multiple of 128 (got %ld)\n", PROG, block_arg);
        return 2;
    }
    const size_t block_bytes = (size_t)block_arg;
    const unsigned qd = (unsigned)qd_arg;
    const uint64_t total_mib = (uint64_t)mib_arg;
    strata_error err = {0};
    enum { DISTINCT = 64 };
    uint8_t *blocks[DISTINCT];
    for (unsigned i = 0; i < DISTINCT; i++) {
        if (!(blocks[i] = make_block(block_bytes, i + 1, &err))) {
            fprintf(stderr, "offload-bench: %s\n", err.msg);
            return 1;
        }
    }
    size_t extent = (block_bytes + NVME_PAGE - 1) / NVME_PAGE * NVME_PAGE;
    uint64_t n_blocks = (total_mib << 20) / extent;
    if (n_blocks == 0) {
        fprintf(stderr, "offload-bench: --total-mib smaller than one block\n");
        return 2;
    }
    nvme_store_options o;
    nvme_store_options_init(&o, dir, n_blocks * extent);
    o.staging_bufs = qd;
    o.staging_buf_bytes = extent;  /* one operation per block, as fio's bs */
    o.sync_batch = qd;
    o.force_sync_io = sync_io;
    o.force_buffered = buffered;
    o.verify = readback ? NVME_VERIFY_READBACK : NVME_VERIFY_CRC;
    nvme_store *st = nvme_store_create(&o, &err);
    if (!st) {
        fprintf(stderr, "offload-bench: %s\n", err.msg);
        return 1;
    }
    nvme_loc *loc = malloc(n_blocks * sizeof *loc);
    unsigned window = 4 * qd;  /* requests outstanding: the store keeps qd of them in the kernel */
    uint8_t *ring = aligned_alloc(4096, (size_t)window * extent);
    uint64_t *slot_ticket = calloc(window, sizeof *slot_ticket);
    nvme_completion *c = malloc(window * sizeof *c);
    if (!loc || !ring || !slot_ticket || !c) {
        fprintf(stderr, "offload-bench: out of memory\n");
        return 1;
    }
    /* Fault the destination ring in before timing, as a long-lived host arena would be. */
    memset(ring, 0, (size_t)window * extent);
    int status = 0;

    /* Spill. */
    double t0 = strata_mono_s();
    uint64_t next = 0, done = 0;
    while (done < n_blocks) {
        while (next < n_blocks && next - done < window) {
            uint64_t t;
            if (nvme_store_submit_write(st, blocks[next % DISTINCT], block_bytes, next, &t, &loc[next], &err) != STRATA_OK) {
                fprintf(stderr, "offload-bench: %s\n", err.msg);
                return 1;
            }
            next++;
        }
        size_t k = nvme_store_poll(st, c, window);
        if (k == 0)
            k = nvme_store_wait(st, c, window);
        for (size_t j = 0; j < k; j++) {
            if (c[j].status != STRATA_OK) {
                fprintf(stderr, "offload-bench: %s\n", c[j].err.msg);
                status = 1;
            }
            done++;
        }
    }
    double spill_s = strata_mono_s() - t0;

    /* Restore, into a ring of window host buffers. */
    t0 = strata_mono_s();
    next = done = 0;
    unsigned free_slots = window;
    unsigned *slots = malloc(window * sizeof *slots);
    if (!slots) {
        fprintf(stderr, "offload-bench: out of memory\n");
        return 1;
    }
    for (unsigned i = 0; i < window; i++)
        slots[i] = i;
    while (done < n_blocks) {
        while (next < n_blocks && free_slots > 0) {
            unsigned sl = slots[--free_slots];
            uint64_t t;
            if (nvme_store_submit_read(st, &loc[next], ring + (size_t)sl * extent, extent, sl, &t, &err) != STRATA_OK) {
                fprintf(stderr, "offload-bench: %s\n", err.msg);
                return 1;
            }
            next++;
        }
        size_t k = nvme_store_poll(st, c, window);
        if (k == 0)
            k = nvme_store_wait(st, c, window);
        for (size_t j = 0; j < k; j++) {
            if (c[j].status != STRATA_OK) {
                fprintf(stderr, "offload-bench: %s\n", c[j].err.msg);
                status = 1;
            }
            slots[free_slots++] = (unsigned)c[j].tag;
            done++;
        }
    }
    double restore_s = strata_mono_s() - t0;
    nvme_store_stats ss;
    nvme_store_get_stats(st, &ss);
    double bytes = (double)n_blocks * (double)block_bytes;
    printf("spill_gbps=%.3f restore_gbps=%.3f blocks=%" PRIu64 " block_bytes=%zu qd=%u fsyncs=%" PRIu64
           " failed=%" PRIu64 " path=\"%s\"\n",
           bytes / spill_s * 1e-9, bytes / restore_s * 1e-9, n_blocks, block_bytes, qd, ss.fsyncs,
           ss.requests_failed, nvme_store_describe(st));
    nvme_store_destroy(st);
    for (unsigned i = 0; i < DISTINCT; i++)
        free(blocks[i]);
    free(loc);
    free(ring);
    free(slot_ticket);
    free(c);
    free(slots);
    return status;
}
