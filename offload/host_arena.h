/* The host memory tier: one allocation of a fixed byte budget holding compressed KV blocks of
 * varying size (docs/format.md), each in its own extent of whole 4 KiB pages.
 *
 * Memory: the arena is one region, 4096-byte aligned, obtained once at create through an
 * allocator. Only the plain aligned-memory allocator exists today (host_arena_allocator NULL
 * means aligned_alloc); with CUDA the same arena will be pinned (cudaHostAlloc, or
 * cudaHostRegister of this region) by passing an allocator whose alloc/free call those. That is
 * the one seam for pinned memory: nothing else here depends on how the region was obtained.
 * host_arena_base()/host_arena_capacity() expose the region so it can also be registered with
 * io_uring or a NIC later.
 *
 * Allocation: first fit over 4 KiB pages (offload/extent.h). A block of len bytes takes
 * ceil(len / 4096) pages; the slack at the end of its last page is zeroed. When no free extent
 * is large enough (the arena is full or fragmented) put fails with STRATA_EFULL and a message
 * giving the request, the free bytes, the number of holes and the largest hole. Nothing is ever
 * moved or compacted behind the caller's back: a pointer from host_arena_get stays valid until
 * that handle is freed.
 *
 * Bytes are stored exactly as given; the arena does not parse or verify blocks (the tier above
 * or below verifies when a block crosses a tier).
 *
 * Handles are opaque, never 0, and carry a generation: a handle that was freed (or never
 * existed) is rejected with STRATA_EINVAL, not confused with a newer block in the same slot.
 *
 * Thread-safety: none; one thread (the worker's offload loop) owns an arena. */
#ifndef STRATA_OFFLOAD_HOST_ARENA_H
#define STRATA_OFFLOAD_HOST_ARENA_H

#include <stddef.h>
#include <stdint.h>

#include "kvstore/error.h"

#define HOST_ARENA_PAGE 4096u

typedef struct host_arena host_arena;
typedef uint64_t host_handle;  /* 0 is never a valid handle */

/* How the arena's region is obtained and released. alloc must return memory aligned to
 * HOST_ARENA_PAGE or NULL (with a message in err). name appears in host_arena_describe(). */
typedef struct host_arena_allocator {
    const char *name;
    void *(*alloc)(size_t bytes, void *ctx, strata_error *err);
    void (*release)(void *ptr, size_t bytes, void *ctx);
    void *ctx;
} host_arena_allocator;

/* An arena of budget bytes (rounded down to whole pages; at least one page). alloc NULL uses
 * aligned host memory. The region is not touched at create, so pages are committed by the OS as
 * blocks arrive. */
host_arena *host_arena_create(size_t budget, const host_arena_allocator *alloc, strata_error *err);
void host_arena_destroy(host_arena *a);

/* Copies len bytes (1 <= len) into a fresh extent; *out gets its handle.
 * STRATA_EFULL (with the fragmentation picture in the message) when no extent fits. */
int host_arena_put(host_arena *a, const void *bytes, size_t len, host_handle *out, strata_error *err);

/* Reserves an extent for len bytes without copying (the caller fills it, e.g. a restore from
 * NVMe or a device-to-host copy); *ptr gets the writable address. Same errors as put. */
int host_arena_reserve(host_arena *a, size_t len, host_handle *out, uint8_t **ptr, strata_error *err);

/* The bytes of a live handle (and their length), or NULL for an invalid or freed handle. */
uint8_t *host_arena_get(const host_arena *a, host_handle h, size_t *len);

/* Frees a live handle's extent. STRATA_EINVAL for an invalid or already freed handle. */
int host_arena_free(host_arena *a, host_handle h, strata_error *err);

size_t host_arena_capacity(const host_arena *a);      /* bytes (whole pages) */
size_t host_arena_used_bytes(const host_arena *a);    /* bytes in allocated pages */
size_t host_arena_free_bytes(const host_arena *a);
size_t host_arena_stored_bytes(const host_arena *a);  /* sum of the live blocks' lengths */
size_t host_arena_largest_free(const host_arena *a);  /* bytes in the largest free extent */
/* Bytes of free space usable by blocks of block_bytes each: whole blocks per free extent
 * (page-rounded), so fragmentation shows. */
size_t host_arena_fit_bytes(const host_arena *a, size_t block_bytes);
size_t host_arena_count(const host_arena *a);         /* live blocks */
uint8_t *host_arena_base(const host_arena *a);
const char *host_arena_describe(const host_arena *a); /* the allocator's name */

#endif
