/* The device tier: compressed KV blocks in fixed-size slots of one arena of memory the host
 * cannot address (a cudaMalloc arena), shared by every sequence of a worker, with the least
 * recently used blocks moving down to a lower tier (kv_tiers: pinned host memory, then NVMe) and
 * coming back when a step needs them.
 *
 * The pool only keeps the books and moves bytes through the copy operations it is given
 * (device_pool_mem): cudaMemcpyAsync on a copy stream of its own for a GPU
 * (worker/cuda/model_cuda.c), plain memcpy in tests, so every decision here (which block goes,
 * what comes back, which slot a block lands in, what the lower tier is told) runs in CI.
 *
 * A block moves as its exact bytes (docs/format.md): a slot is copied to host staging, its
 * header gives the block's own size (GEAR blocks vary), and those bytes go to the lower tier;
 * coming back, the lower tier returns them CRC-verified (kv_tiers) and they are copied into a
 * free slot. The device address of a block changes when it comes back: callers re-read
 * addresses after device_pool_acquire and rebuild their block tables.
 *
 * Pinning: device_pool_alloc and device_pool_acquire pin the blocks they return until
 * device_pool_unpin_all (once per step, after the step's kernels were enqueued): a pinned block
 * is never evicted, so the addresses a step's kernels read stay its blocks. Copies out of the
 * arena are ordered after the compute already enqueued (see device_pool_mem), so evicting a
 * block whose kernels ran in an earlier step is safe without waiting for the device.
 *
 * Errors: STRATA_EFULL when a step needs more blocks at once than the pool has slots, or no
 * lower tier takes an evicted block; the lower tier's codes (STRATA_ECRC for a damaged copy)
 * come back naming the block. Thread-safety: none; one pool per worker thread. */
#ifndef STRATA_OFFLOAD_DEVICE_POOL_H
#define STRATA_OFFLOAD_DEVICE_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "kvstore/error.h"
#include "kvstore/kv_cache.h"

/* How the pool reaches its memory. Every function returns STRATA_OK or an error with a message. */
typedef struct device_pool_mem {
    const char *name;  /* "cuda:0", "host" */
    /* The slot arena (bytes, 256-byte aligned) and one host staging buffer of one slot (pinned
     * for a GPU so that copies are DMA). */
    void *(*alloc_arena)(void *ctx, size_t bytes, strata_error *err);
    void (*free_arena)(void *ctx, void *arena);
    void *(*alloc_staging)(void *ctx, size_t bytes, strata_error *err);
    void (*free_staging)(void *ctx, void *staging);
    /* Arena -> host, after everything already enqueued on the compute stream; complete on return
     * (the host reads the bytes next). */
    int (*copy_out)(void *ctx, void *host, const void *arena_src, size_t n, strata_error *err);
    /* Host -> arena; complete on return as far as the host buffer is concerned, and ordered
     * before compute enqueued after it. */
    int (*copy_in)(void *ctx, void *arena_dst, const void *host, size_t n, strata_error *err);
    void *ctx;
} device_pool_mem;

typedef struct device_pool device_pool;
typedef uint64_t device_block;   /* a block's handle; 0 is never one */

/* A pool of n_slots slots of slot_bytes (a multiple of 64, at least one block of the codec in
 * use: kv_block_size). lower may be NULL (then a full pool is STRATA_EFULL); its functions are
 * copied and its ctx must outlive the pool. */
device_pool *device_pool_create(size_t slot_bytes, size_t n_slots, const device_pool_mem *mem,
                                const kv_lower_tier *lower, strata_error *err);
/* Frees the arena, the staging buffer and every copy the pool still has in the lower tier. */
void device_pool_destroy(device_pool *p);

/* A new block for sequence owner, pinned: *addr is its slot, for the encoder to write into. A
 * block that was never written (or written wrongly) fails when it first has to move down. */
int device_pool_alloc(device_pool *p, uint64_t owner, device_block *out, void **addr, strata_error *err);

/* Makes blocks[0..n) resident and pinned, bringing back those that moved down (evicting others
 * that are not pinned), and writes their addresses to addrs. n must not exceed the slots. */
int device_pool_acquire(device_pool *p, const device_block *blocks, size_t n, void **addrs, strata_error *err);

/* Starts bringing blocks closer (lower tier prefetch: an NVMe read) without waiting. */
void device_pool_prefetch(device_pool *p, const device_block *blocks, size_t n);

/* Ends a step: every block becomes evictable again (least recently acquired first). */
void device_pool_unpin_all(device_pool *p);

/* Forgets a block: its slot and its lower-tier copy are freed. Unknown handles are ignored. */
void device_pool_free(device_pool *p, device_block b);

/* Marks the blocks a sequence has now as waiting (preempted): they are evicted before any other.
 * Passed on to the lower tier's set_waiting. */
void device_pool_set_waiting(device_pool *p, uint64_t owner, int waiting);

/* Room for a step, checked before it runs: a step that fails part way leaves its sequences'
 * layers uneven, so its caller must drop them all, while a sequence refused here is only left out.
 * A step is what worker/cuda runs: n_phases phases (layers), each pinning blocks of its sequences
 * and forming new ones, everything unpinned when the phase ends. device_room_add adds one
 * sequence's part: in each phase p it pins blocks[p * stride .. p * stride + n_pinned) and forms
 * n_new blocks. It refuses with STRATA_EFULL, counting nothing, a sequence that does not fit beside
 * those added before it: one phase pinning more than the pool's slots; without a lower tier, more
 * new blocks than free slots; with one, more bytes that may move below than the tier's room (each
 * block as its slot in whole 4 KiB pages; a tier whose fetches pass through its own memory,
 * get_takes_room, counts the blocks brought back too). When the step's fetches and new blocks fit
 * the free slots nothing is evicted; else any block the step uses may leave before its phase and
 * come back, and only blocks with no copy below cost a write: a bound, not an exact count.
 * STRATA_EINVAL for a handle the pool does not know. A step can still fail on an I/O error. */
typedef struct device_room device_room;
device_room *device_room_begin(const device_pool *p, strata_error *err);
int device_room_add(device_room *r, const device_block *blocks, size_t stride, size_t n_phases, size_t n_pinned,
                    size_t n_new, strata_error *err);
void device_room_end(device_room *r);

/* The block's address when resident, else NULL. */
void *device_pool_addr(const device_pool *p, device_block b);

typedef struct device_pool_stats {
    size_t slots, free_slots, blocks, resident_blocks;
    uint64_t evictions;        /* blocks that left a slot */
    uint64_t writebacks;       /* of those, blocks copied down (the others had a copy below) */
    uint64_t writeback_bytes;
    uint64_t fetches, fetch_bytes;
} device_pool_stats;

void device_pool_get_stats(const device_pool *p, device_pool_stats *out);

#endif
