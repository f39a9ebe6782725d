/* A first-fit extent allocator over a range of equal units (4 KiB pages in both tiers).
 *
 * The free space is a sorted array of disjoint, non-adjacent free extents. alloc takes the
 * lowest extent that is large enough (first fit: it keeps live data packed at low offsets, which
 * keeps the slab files' written region small); free inserts the extent back and merges it with
 * its neighbours. Fragmentation is reported, never hidden: alloc fails when no single free extent
 * is large enough, even if the total free space would be, and off_extents_largest() says how big
 * the largest hole is.
 *
 * Memory: the array never needs more entries than live allocations + 1, so alloc reserves that
 * room up front and free never allocates (it cannot fail for lack of memory). */
#ifndef STRATA_OFFLOAD_EXTENT_H
#define STRATA_OFFLOAD_EXTENT_H

#include <stddef.h>
#include <stdint.h>

#include "kvstore/error.h"

typedef struct off_extent {
    uint64_t start, len;  /* units */
} off_extent;

typedef struct off_extents {
    off_extent *v;        /* free extents, sorted by start, never adjacent */
    size_t n, cap;
    uint64_t total;       /* units managed */
    uint64_t free_units;
    uint64_t live;        /* allocations not yet freed */
} off_extents;

/* Starts with the whole range [0, total) free. */
int off_extents_init(off_extents *x, uint64_t total, strata_error *err);
void off_extents_fini(off_extents *x);

/* Allocates len (>= 1) contiguous units. Returns STRATA_OK and *start, STRATA_EFULL when no free
 * extent is large enough (no message: the caller knows what it was allocating for), or
 * STRATA_ENOMEM when bookkeeping could not grow. */
int off_extents_alloc(off_extents *x, uint64_t len, uint64_t *start);

/* Returns [start, start + len) to the free space. STRATA_EINVAL (nothing changed) if the range
 * is outside the managed range or overlaps free space (a double free). */
int off_extents_free(off_extents *x, uint64_t start, uint64_t len);

/* Units in the largest free extent (0 when full). */
uint64_t off_extents_largest(const off_extents *x);

/* How many allocations of len (>= 1) units the free space holds as it is now (each hole counts
 * whole allocations only: what fragmentation leaves usable). */
uint64_t off_extents_fit(const off_extents *x, uint64_t len);

#endif
