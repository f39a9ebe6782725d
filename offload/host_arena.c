#include "offload/host_arena.h"

#include <stdlib.h>
#include <string.h>

#include "kvstore/sysmem.h"
#include "offload/extent.h"

typedef struct arena_slot {
    uint64_t page;     /* first page of the extent */
    uint64_t pages;
    size_t len;        /* bytes of the block */
    uint32_t gen;      /* bumped at every free, so stale handles are recognised */
    uint32_t live;
    uint32_t next_free;  /* free-slot list, index + 1 (0 ends it) */
} arena_slot;

struct host_arena {
    uint8_t *base;
    size_t capacity;
    host_arena_allocator alloc;
    off_extents pages;
    arena_slot *slots;
    uint32_t n_slots, cap_slots;
    uint32_t free_slot;  /* index + 1 */
    size_t count, stored;
};

static void *aligned_alloc_cb(size_t bytes, void *ctx, strata_error *err)
{
    (void)ctx;
    void *p = aligned_alloc(HOST_ARENA_PAGE, bytes);
    if (!p)
        strata_fail(err, STRATA_ENOMEM, "host arena: cannot allocate %zu bytes of host memory", bytes);
    return p;
}

static void aligned_release_cb(void *ptr, size_t bytes, void *ctx)
{
    (void)bytes;
    (void)ctx;
    free(ptr);
}

static const host_arena_allocator aligned_allocator = {
    "aligned host memory (not pinned)", aligned_alloc_cb, aligned_release_cb, NULL,
};

host_arena *host_arena_create(size_t budget, const host_arena_allocator *alloc, strata_error *err)
{
    size_t capacity = budget / HOST_ARENA_PAGE * HOST_ARENA_PAGE;
    if (capacity == 0) {
        strata_fail(err, STRATA_EINVAL, "host arena: budget %zu bytes is less than one %u-byte page",
                    budget, HOST_ARENA_PAGE);
        return NULL;
    }
    if (strata_check_memory("host arena", capacity, err) != STRATA_OK)
        return NULL;
    if (alloc && (!alloc->alloc || !alloc->release)) {
        strata_fail(err, STRATA_EINVAL, "host arena: allocator without alloc/release");
        return NULL;
    }
    host_arena *a = calloc(1, sizeof *a);
    if (!a) {
        strata_fail(err, STRATA_ENOMEM, "host arena: out of memory");
        return NULL;
    }
    a->alloc = alloc ? *alloc : aligned_allocator;
    if (!a->alloc.name)
        a->alloc.name = "custom allocator";
    a->capacity = capacity;
    if (off_extents_init(&a->pages, capacity / HOST_ARENA_PAGE, err) != STRATA_OK) {
        free(a);
        return NULL;
    }
    a->base = a->alloc.alloc(capacity, a->alloc.ctx, err);
    if (!a->base) {
        off_extents_fini(&a->pages);
        free(a);
        return NULL;
    }
    if ((uintptr_t)a->base % HOST_ARENA_PAGE != 0) {
        strata_fail(err, STRATA_EINVAL, "host arena: allocator '%s' returned memory not aligned to %u",
                    a->alloc.name, HOST_ARENA_PAGE);
        a->alloc.release(a->base, capacity, a->alloc.ctx);
        off_extents_fini(&a->pages);
        free(a);
        return NULL;
    }
    return a;
}

void host_arena_destroy(host_arena *a)
{
    if (!a)
        return;
    a->alloc.release(a->base, a->capacity, a->alloc.ctx);
    off_extents_fini(&a->pages);
    free(a->slots);
    free(a);
}

static arena_slot *slot_of(const host_arena *a, host_handle h)
{
    uint32_t idx = (uint32_t)h, gen = (uint32_t)(h >> 32);
    if (idx == 0 || idx > a->n_slots)
        return NULL;
    arena_slot *s = &a->slots[idx - 1];
    return s->live && s->gen == gen ? s : NULL;
}

int host_arena_reserve(host_arena *a, size_t len, host_handle *out, uint8_t **ptr, strata_error *err)
{
    if (!a || !out || len == 0)
        return strata_fail(err, STRATA_EINVAL, "host arena: put of an empty block");
    uint64_t pages = (len + HOST_ARENA_PAGE - 1) / HOST_ARENA_PAGE;
    /* A free slot first, so that a failure below leaves nothing half-done. */
    if (!a->free_slot) {
        if (a->n_slots == UINT32_MAX - 1)
            return strata_fail(err, STRATA_EFULL, "host arena: too many blocks");
        if (a->n_slots == a->cap_slots) {
            uint32_t cap = a->cap_slots ? a->cap_slots * 2 : 64;
            arena_slot *s = realloc(a->slots, (size_t)cap * sizeof *s);
            if (!s)
                return strata_fail(err, STRATA_ENOMEM, "host arena: out of memory for the block table");
            a->slots = s;
            a->cap_slots = cap;
        }
        a->slots[a->n_slots] = (arena_slot){0};
        a->slots[a->n_slots].gen = 1;
        a->n_slots++;
        a->free_slot = a->n_slots;
        a->slots[a->n_slots - 1].next_free = 0;
    }
    uint64_t page;
    int rc = off_extents_alloc(&a->pages, pages, &page);
    if (rc == STRATA_ENOMEM)
        return strata_fail(err, rc, "host arena: out of memory for the free list");
    if (rc != STRATA_OK)
        return strata_fail(err, STRATA_EFULL,
                           "host arena full: no free extent of %llu KiB for a %zu-byte block "
                           "(%llu KiB free of %zu KiB in %zu holes, largest %llu KiB; %zu blocks)",
                           (unsigned long long)pages * 4, len,
                           (unsigned long long)a->pages.free_units * 4, a->capacity / 1024,
                           a->pages.n, (unsigned long long)off_extents_largest(&a->pages) * 4,
                           a->count);
    uint32_t idx = a->free_slot - 1;
    arena_slot *s = &a->slots[idx];
    a->free_slot = s->next_free;
    s->page = page;
    s->pages = pages;
    s->len = len;
    s->live = 1;
    s->next_free = 0;
    a->count++;
    a->stored += len;
    uint8_t *p = a->base + page * HOST_ARENA_PAGE;
    /* Zero the slack so that the page is deterministic (it may be written to disk whole). */
    memset(p + len, 0, pages * HOST_ARENA_PAGE - len);
    *out = ((uint64_t)s->gen << 32) | (idx + 1);
    if (ptr)
        *ptr = p;
    return STRATA_OK;
}

int host_arena_put(host_arena *a, const void *bytes, size_t len, host_handle *out, strata_error *err)
{
    if (!bytes)
        return strata_fail(err, STRATA_EINVAL, "host arena: put of NULL bytes");
    uint8_t *p = NULL;
    int rc = host_arena_reserve(a, len, out, &p, err);
    if (rc == STRATA_OK)
        memcpy(p, bytes, len);
    return rc;
}

uint8_t *host_arena_get(const host_arena *a, host_handle h, size_t *len)
{
    const arena_slot *s = a ? slot_of(a, h) : NULL;
    if (len)
        *len = s ? s->len : 0;
    return s ? a->base + s->page * HOST_ARENA_PAGE : NULL;
}

int host_arena_free(host_arena *a, host_handle h, strata_error *err)
{
    arena_slot *s = a ? slot_of(a, h) : NULL;
    if (!s)
        return strata_fail(err, STRATA_EINVAL, "host arena: free of an invalid or already freed handle %#llx",
                           (unsigned long long)h);
    if (off_extents_free(&a->pages, s->page, s->pages) != STRATA_OK)
        return strata_fail(err, STRATA_EINVAL, "host arena: internal error: extent of handle %#llx not allocated",
                           (unsigned long long)h);
    a->count--;
    a->stored -= s->len;
    s->live = 0;
    s->gen = s->gen == UINT32_MAX ? 1 : s->gen + 1;
    s->next_free = a->free_slot;
    a->free_slot = (uint32_t)(s - a->slots) + 1;
    return STRATA_OK;
}

size_t host_arena_capacity(const host_arena *a) { return a->capacity; }
size_t host_arena_free_bytes(const host_arena *a) { return (size_t)a->pages.free_units * HOST_ARENA_PAGE; }

size_t host_arena_fit_bytes(const host_arena *a, size_t block_bytes)
{
    const uint64_t pages = ((uint64_t)block_bytes + HOST_ARENA_PAGE - 1) / HOST_ARENA_PAGE;
    return pages ? (size_t)(off_extents_fit(&a->pages, pages) * pages * HOST_ARENA_PAGE) : 0;
}
size_t host_arena_used_bytes(const host_arena *a) { return a->capacity - host_arena_free_bytes(a); }
size_t host_arena_stored_bytes(const host_arena *a) { return a->stored; }
size_t host_arena_largest_free(const host_arena *a) { return (size_t)off_extents_largest(&a->pages) * HOST_ARENA_PAGE; }
size_t host_arena_count(const host_arena *a) { return a->count; }
uint8_t *host_arena_base(const host_arena *a) { return a->base; }
const char *host_arena_describe(const host_arena *a) { return a->alloc.name; }
