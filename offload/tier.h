/* The tier policy: tracks KV blocks across the host arena and the NVMe store, moves cold blocks
 * down when the host tier passes its high watermark, and brings them back on demand.
 *
 * A block is an immutable byte string (docs/format.md) known by an opaque 64-bit tier_id (never
 * 0; ids are not reused while the tier lives). For each block the tier keeps: where it is (host,
 * NVMe, or both), its last-used step, the owning sequence id, and whether that sequence is
 * waiting or preempted.
 *
 * Eviction. When the host arena's used bytes exceed high_bytes, blocks are spilled to NVMe until
 * the used bytes would fall to low_bytes: blocks of waiting/preempted sequences first, then the
 * least recently used (smallest last step; ties by id). A block's host copy is freed only when
 * its NVMe write completed fully, durably and verified (nvme_store.h); until then it stays
 * readable in host memory. Blocks never change, so a restored block keeps its NVMe copy: evicting
 * it again frees the host copy without any I/O ("clean" block).
 *
 * Restore. tier_prefetch() starts reading a block back into a fresh host extent (making room by
 * eviction if needed); tier_poll() finishes it; tier_restore() does both and waits. A block whose
 * CRC check fails on restore stays on NVMe and the failure is returned (STRATA_ECRC naming it).
 *
 * Events. Asynchronous outcomes (spilled, spill failed, restored, restore failed) are returned by
 * tier_poll() in order; a failed spill leaves the block in host memory (nothing is lost) and marks
 * it so that eviction skips it until it is touched again.
 *
 * Ownership: the tier borrows the arena and the store (the caller creates and destroys them, and
 * must not put or free blocks in them behind the tier's back); tier_destroy waits for I/O in
 * flight and frees every extent the tier holds in both.
 *
 * Integration (see offload/README.md): kv_seq's block table would hold tier_ids for blocks that
 * left the device pool; the scheduler calls tier_touch per step, tier_set_waiting on preemption
 * and resumption, tier_prefetch for the blocks of the next step (or layer), and tier_poll once per
 * step. Thread-safety: none; one tier per worker thread. */
#ifndef STRATA_OFFLOAD_TIER_H
#define STRATA_OFFLOAD_TIER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvstore/error.h"
#include "offload/host_arena.h"
#include "offload/nvme_store.h"

typedef struct tier tier;
typedef uint64_t tier_id;

typedef struct tier_options {
    size_t high_bytes;  /* start evicting above this many used host bytes; 0: 90 % of capacity */
    size_t low_bytes;   /* evict down to this; 0: 75 % of capacity. Must be <= high_bytes */
} tier_options;

typedef enum tier_where {
    TIER_NONE = 0,      /* unknown id */
    TIER_HOST,          /* host only */
    TIER_SPILLING,      /* host, NVMe write in flight */
    TIER_NVME,          /* NVMe only */
    TIER_RESTORING,     /* NVMe, read into host in flight */
    TIER_BOTH,          /* host and NVMe (restored, clean) */
} tier_where;

typedef enum tier_event_kind {
    TIER_EV_SPILLED = 1,
    TIER_EV_SPILL_FAILED,
    TIER_EV_RESTORED,
    TIER_EV_RESTORE_FAILED,
} tier_event_kind;

typedef struct tier_event {
    tier_id id;
    tier_event_kind kind;
    int status;
    strata_error err;  /* for the failures */
} tier_event;

tier *tier_create(host_arena *host, nvme_store *nvme, const tier_options *o, strata_error *err);
void tier_destroy(tier *t);

/* Stores a block in the host tier, owned by sequence seq at step. If the arena has no room,
 * evicts synchronously (spills and waits) until it fits; STRATA_EFULL if it still does not. */
int tier_put(tier *t, const void *bytes, size_t len, uint64_t seq, uint64_t step, tier_id *out,
             strata_error *err);

/* The host bytes of a block, or NULL when it is not in host memory (TIER_NVME, TIER_RESTORING)
 * or unknown. The pointer stays valid until the block is evicted: hold it only within a step. */
const uint8_t *tier_get(const tier *t, tier_id id, size_t *len);

tier_where tier_location(const tier *t, tier_id id);

/* Marks a block used at step (for LRU); clears a previous spill failure mark. A block whose spill
 * failed is otherwise tried again once NVMe copies were freed since, or when the host tier is
 * full: the put that finds no room tries one such block as a probe before it reports the disk,
 * and all of them once a spill has succeeded since. */
int tier_touch(tier *t, tier_id id, uint64_t step, strata_error *err);

/* Marks every block of sequence seq as waiting/preempted (evicted first) or not. */
void tier_set_waiting(tier *t, uint64_t seq, bool waiting);

/* Starts bringing a block back to host memory (no-op if it is there or on its way). */
int tier_prefetch(tier *t, tier_id id, strata_error *err);

/* Brings a block back and waits: STRATA_OK when it is in host memory, else the read's status
 * (STRATA_ECRC for a damaged copy). */
int tier_restore(tier *t, tier_id id, strata_error *err);

/* NVMe bytes, in whole blocks of block_bytes, that the blocks only in host memory would take if
 * making room moved every one of them there (each at least one block's worth). */
size_t tier_host_only_bytes(const tier *t, size_t block_bytes);

/* Forgets a block, freeing its copies (at completion if I/O is in flight). */
int tier_free(tier *t, tier_id id, strata_error *err);

/* Starts eviction if the host tier is above its high watermark; returns the spills started. */
size_t tier_evict(tier *t);

/* Reaps I/O, applies its outcomes, evicts if needed, and returns up to max events. Never blocks. */
size_t tier_poll(tier *t, tier_event *out, size_t max);

/* Blocks until no I/O is in flight (every spill and restore finished); events stay queued. */
void tier_drain(tier *t);

typedef struct tier_stats {
    size_t blocks, host_blocks, nvme_blocks;  /* a clean block counts in both */
    size_t host_used_bytes;
    uint64_t spills, spill_failures, restores, restore_failures, clean_evictions;
    strata_error spill_error;   /* why the last spill attempt failed; code 0 when it succeeded */
} tier_stats;

void tier_get_stats(const tier *t, tier_stats *out);

#endif
