/* The tiers below the device block pool, assembled for one worker: a host arena and, when a
 * spill directory is given, an NVMe store under the tier policy (tier.h). kv_tiers_lower()
 * gives the kvstore's kv_lower_tier interface, so a kv_pool evicts its blocks here and fetches
 * them back for attention (kv_cache.h).
 *
 * Without NVMe the host arena alone is the lower tier: when it is full, eviction fails with
 * STRATA_EFULL (the request that needed room fails; nothing is dropped). With NVMe, blocks move
 * from host to NVMe by the tier's watermarks and LRU, and come back through io_uring.
 *
 * Every block that moves up (NVMe -> host, host -> device) is CRC-checked; a damaged block is
 * STRATA_ECRC naming it and fails only the sequence that needed it.
 *
 * Thread-safety: none; one kv_tiers per worker thread, with its pool. */
#ifndef STRATA_OFFLOAD_KV_TIERS_H
#define STRATA_OFFLOAD_KV_TIERS_H

#include <stddef.h>
#include <stdint.h>

#include "kvstore/error.h"
#include "kvstore/kv_cache.h"
#include "offload/host_arena.h"
#include "offload/nvme_store.h"
#include "offload/tier.h"

typedef struct kv_tiers kv_tiers;

typedef struct kv_tiers_options {
    size_t host_bytes;                       /* host arena budget (>= one 4 KiB page) */
    const char *nvme_dir;                    /* NULL or "": no NVMe tier */
    uint64_t nvme_bytes;                     /* NVMe budget (required with nvme_dir) */
    tier_options watermarks;                 /* host watermarks; zeros: 90 % / 75 % */
    const host_arena_allocator *allocator;   /* NULL: aligned host memory */
    const nvme_store_options *nvme_options;  /* full store options (tests: fault hook); overrides
                                              * nvme_dir and nvme_bytes when non-NULL */
} kv_tiers_options;

kv_tiers *kv_tiers_create(const kv_tiers_options *o, strata_error *err);
/* Waits for I/O in flight and frees both tiers (slab files are deleted). The pool whose lower
 * tier this is must have no sequence left. */
void kv_tiers_destroy(kv_tiers *t);

/* The interface to pass to kv_pool_set_lower_tier. */
kv_lower_tier kv_tiers_lower(kv_tiers *t);

/* Reaps finished I/O and applies the watermarks without blocking: call once per step. */
void kv_tiers_poll(kv_tiers *t);

typedef struct kv_tiers_stats {
    size_t host_blocks, host_used_bytes, host_capacity_bytes;
    size_t nvme_blocks;
    uint64_t nvme_stored_bytes, nvme_capacity_bytes;
    uint64_t puts, gets;                 /* blocks received from / returned to the pool */
    uint64_t spills, spill_failures;     /* host -> NVMe moves (durable and verified) */
    strata_error spill_error;            /* why the last spill attempt failed; code 0 when it succeeded */
    uint64_t restores, restore_failures; /* NVMe -> host moves */
    uint64_t crc_failures;               /* blocks that failed verification moving up */
    uint64_t bytes_written, bytes_read;  /* NVMe */
    double write_bytes_per_s, read_bytes_per_s;  /* NVMe bytes over the time I/O was in flight */
} kv_tiers_stats;

void kv_tiers_get_stats(const kv_tiers *t, kv_tiers_stats *out);

/* The NVMe store under the host tier (NULL: host only), for nvme_store_owned_paths. */
const nvme_store *kv_tiers_nvme(const kv_tiers *t);

/* One line: the host arena's size and memory kind, and the NVMe path in use (or none). */
const char *kv_tiers_describe(const kv_tiers *t);

#endif
