/* The device tier's books and moves (device_pool.h). */
#include "offload/device_pool.h"

#include <inttypes.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kvstore/block.h"

#define NO_SLOT SIZE_MAX
#define NO_ENTRY SIZE_MAX

/* The resident blocks no step has pinned wait in one of two lists in the order they were last
 * used, oldest first: a waiting (preempted) sequence's, and everyone else's. The next victim is
 * the head of the first non-empty one, so an eviction costs the same whatever the pool's size
 * (it scanned every block before: a pool of 800,000 slots, 40 GiB of 48 KiB kivi2 blocks,
 * streaming a long context, evicts thousands of blocks a layer). */
enum { LIST_NONE = 0, LIST_WAITING = 1, LIST_LRU = 2, N_LISTS = 3 };

typedef struct entry {
    size_t slot;          /* NO_SLOT when not resident */
    uint64_t lower;       /* lower-tier handle, 0 when none */
    uint64_t owner;
    uint64_t last_use;    /* pool clock of the last alloc or acquire */
    size_t prev, next;    /* neighbours in its list */
    uint32_t gen;         /* handle generation: a freed handle is not a newer block */
    uint32_t bytes;       /* the block's own size, once known (it has moved down) */
    uint8_t list;         /* LIST_*: resident and unpinned, or LIST_NONE */
    bool live, waiting;
} entry;

/* A pin of this step: which entry, at which use (a later pin of the same entry supersedes it). */
typedef struct pin_note {
    size_t entry;
    uint64_t use;
} pin_note;

struct device_pool {
    device_pool_mem mem;
    kv_lower_tier lower;     /* put == NULL: none */
    size_t slot_bytes, n_slots;
    uint8_t *arena;
    uint8_t *staging;
    size_t *free_slots;      /* stack of free slot indices */
    size_t n_free;
    entry *entries;
    size_t n_entries, cap_entries;
    size_t *free_entries;    /* indices of dead entries for reuse */
    size_t n_free_entries;
    size_t head[N_LISTS], tail[N_LISTS];   /* the evictable lists (index LIST_NONE unused) */
    pin_note *pinned;        /* the pins since the last unpin, in order (some superseded or freed) */
    size_t n_pinned, cap_pinned;
    uint64_t clock;
    device_pool_stats stats;
};

static void list_remove(device_pool *p, size_t i)
{
    entry *e = &p->entries[i];
    if (e->list == LIST_NONE)
        return;
    if (e->prev != NO_ENTRY)
        p->entries[e->prev].next = e->next;
    else
        p->head[e->list] = e->next;
    if (e->next != NO_ENTRY)
        p->entries[e->next].prev = e->prev;
    else
        p->tail[e->list] = e->prev;
    e->list = LIST_NONE;
}

static void list_append(device_pool *p, size_t i, uint8_t list)
{
    entry *e = &p->entries[i];
    e->list = list;
    e->next = NO_ENTRY;
    e->prev = p->tail[list];
    if (e->prev != NO_ENTRY)
        p->entries[e->prev].next = i;
    else
        p->head[list] = i;
    p->tail[list] = i;
}

static uint8_t list_for(const entry *e) { return e->waiting ? LIST_WAITING : LIST_LRU; }

/* Room for n more pins in this step. */
static int reserve_pins(device_pool *p, size_t n, strata_error *err)
{
    if (n <= p->cap_pinned - p->n_pinned)
        return STRATA_OK;
    size_t cap = p->cap_pinned ? p->cap_pinned : 64;
    while (cap - p->n_pinned < n)
        cap *= 2;
    pin_note *grown = realloc(p->pinned, cap * sizeof *grown);
    if (!grown)
        return strata_fail(err, STRATA_ENOMEM, "out of memory for the device pool's pins");
    p->pinned = grown;
    p->cap_pinned = cap;
    return STRATA_OK;
}

/* Entry i is in use by this step until device_pool_unpin_all: out of the evictable lists, newest.
 * Needs a reserved pin. */
static void pin(device_pool *p, size_t i)
{
    entry *e = &p->entries[i];
    list_remove(p, i);
    e->last_use = ++p->clock;
    p->pinned[p->n_pinned++] = (pin_note){i, e->last_use};
}

/* A sorted chain of entries linked through prev/next while the lists are rebuilt. */
typedef struct chain {
    size_t head, tail;
} chain;

static void chain_push(device_pool *p, chain *c, size_t i)
{
    p->entries[i].prev = c->tail;
    p->entries[i].next = NO_ENTRY;
    if (c->tail != NO_ENTRY)
        p->entries[c->tail].next = i;
    else
        c->head = i;
    c->tail = i;
}

/* Appends two chains, each oldest first, to list `list` in last-use order. */
static void merge_into(device_pool *p, chain a, chain b, uint8_t list)
{
    while (a.head != NO_ENTRY || b.head != NO_ENTRY) {
        chain *from = b.head == NO_ENTRY || (a.head != NO_ENTRY &&
                                             p->entries[a.head].last_use < p->entries[b.head].last_use) ? &a : &b;
        const size_t i = from->head;
        from->head = p->entries[i].next;
        list_append(p, i, list);
    }
}

/* After waiting flags changed: each evictable entry into the list its flag names, both lists
 * still oldest first (two sorted lists split and merged, no allocation). */
static void relist(device_pool *p)
{
    chain stay[N_LISTS], move[N_LISTS];
    for (int l = LIST_WAITING; l < N_LISTS; l++) {
        stay[l] = move[l] = (chain){NO_ENTRY, NO_ENTRY};
        for (size_t i = p->head[l], next; i != NO_ENTRY; i = next) {
            next = p->entries[i].next;
            chain_push(p, list_for(&p->entries[i]) == l ? &stay[l] : &move[l], i);
        }
        p->head[l] = p->tail[l] = NO_ENTRY;
    }
    merge_into(p, stay[LIST_WAITING], move[LIST_LRU], LIST_WAITING);
    merge_into(p, stay[LIST_LRU], move[LIST_WAITING], LIST_LRU);
}

static bool has_lower(const device_pool *p) { return p->lower.put != NULL; }

static device_block handle_of(const device_pool *p, size_t i)
{
    return ((uint64_t)p->entries[i].gen << 32) | (uint64_t)(i + 1);
}

static entry *lookup(const device_pool *p, device_block b)
{
    const uint64_t idx = b & 0xffffffffu;
    if (idx == 0 || idx > p->n_entries)
        return NULL;
    entry *e = &p->entries[idx - 1];
    return e->live && e->gen == (uint32_t)(b >> 32) ? e : NULL;
}

device_pool *device_pool_create(size_t slot_bytes, size_t n_slots, const device_pool_mem *mem,
                                const kv_lower_tier *lower, strata_error *err)
{
    if (!mem || !mem->alloc_arena || !mem->free_arena || !mem->alloc_staging || !mem->free_staging ||
        !mem->copy_out || !mem->copy_in) {
        strata_fail(err, STRATA_EINVAL, "device pool: incomplete memory operations");
        return NULL;
    }
    if (slot_bytes == 0 || slot_bytes % KV_BLOCK_ALIGN || slot_bytes > UINT32_MAX || n_slots == 0 ||
        n_slots > SIZE_MAX / slot_bytes) {
        strata_fail(err, STRATA_EINVAL, "device pool: %zu slots of %zu bytes (want at least one slot of a positive "
                    "multiple of %u bytes)", n_slots, slot_bytes, KV_BLOCK_ALIGN);
        return NULL;
    }
    if (lower && (!lower->put || !lower->get || !lower->release)) {
        strata_fail(err, STRATA_EINVAL, "device pool: a lower tier needs put, get and release");
        return NULL;
    }
    device_pool *p = calloc(1, sizeof *p);
    if (!p || !(p->free_slots = malloc(n_slots * sizeof *p->free_slots))) {
        free(p);
        strata_fail(err, STRATA_ENOMEM, "out of memory for a device pool of %zu slots", n_slots);
        return NULL;
    }
    p->mem = *mem;
    if (lower)
        p->lower = *lower;
    p->slot_bytes = slot_bytes;
    p->n_slots = n_slots;
    for (size_t i = 0; i < n_slots; i++)   /* slot 0 on top: blocks fill the arena from its start */
        p->free_slots[i] = n_slots - 1 - i;
    p->n_free = n_slots;
    for (int l = 0; l < N_LISTS; l++)
        p->head[l] = p->tail[l] = NO_ENTRY;
    if (!(p->arena = mem->alloc_arena(mem->ctx, slot_bytes * n_slots, err)) ||
        !(p->staging = mem->alloc_staging(mem->ctx, slot_bytes, err))) {
        strata_error_prefix(err, "device pool of %zu x %zu bytes on %s", n_slots, slot_bytes,
                            mem->name ? mem->name : "?");
        device_pool_destroy(p);
        return NULL;
    }
    return p;
}

void device_pool_destroy(device_pool *p)
{
    if (!p)
        return;
    for (size_t i = 0; i < p->n_entries; i++)
        if (p->entries[i].live && p->entries[i].lower)
            p->lower.release(p->lower.ctx, p->entries[i].lower);
    if (p->arena)
        p->mem.free_arena(p->mem.ctx, p->arena);
    if (p->staging)
        p->mem.free_staging(p->mem.ctx, p->staging);
    free(p->free_slots);
    free(p->entries);
    free(p->free_entries);
    free(p->pinned);
    free(p);
}

static uint8_t *slot_addr(const device_pool *p, size_t slot) { return p->arena + slot * p->slot_bytes; }

/* The resident, unpinned block to evict: a waiting sequence's first, then the least recently used. */
static entry *pick_victim(device_pool *p)
{
    const size_t i = p->head[LIST_WAITING] != NO_ENTRY ? p->head[LIST_WAITING] : p->head[LIST_LRU];
    return i != NO_ENTRY ? &p->entries[i] : NULL;
}

static int evict_one(device_pool *p, strata_error *err)
{
    entry *v = pick_victim(p);
    if (!v)
        return strata_fail(err, STRATA_EFULL, "device KV pool too small: all %zu slots of %zu bytes hold blocks in "
                           "use by this step; raise the device KV budget", p->n_slots, p->slot_bytes);
    if (!v->lower) {
        if (!has_lower(p))
            return strata_fail(err, STRATA_EFULL, "device KV pool full: all %zu slots of %zu bytes are in use (no "
                               "host/NVMe tier to evict to)", p->n_slots, p->slot_bytes);
        int rc = p->mem.copy_out(p->mem.ctx, p->staging, slot_addr(p, v->slot), p->slot_bytes, err);
        kv_block blk;
        if (rc == STRATA_OK && (rc = kv_block_parse(p->staging, p->slot_bytes, &blk, err)) == STRATA_OK)
            v->bytes = (uint32_t)blk.block_bytes;
        if (rc == STRATA_OK)
            rc = p->lower.put(p->lower.ctx, p->staging, v->bytes, v->owner, p->clock, &v->lower, err);
        if (rc != STRATA_OK)
            return strata_error_prefix(err, "moving a block of sequence %" PRIu64 " off the device (%s)", v->owner,
                                       p->mem.name ? p->mem.name : "?");
        p->stats.writebacks++;
        p->stats.writeback_bytes += v->bytes;
    }
    list_remove(p, (size_t)(v - p->entries));   /* only now: a failed move leaves it the next victim */
    p->free_slots[p->n_free++] = v->slot;
    v->slot = NO_SLOT;
    p->stats.evictions++;
    return STRATA_OK;
}

static int take_slot(device_pool *p, size_t *slot, strata_error *err)
{
    if (p->n_free == 0) {
        int rc = evict_one(p, err);
        if (rc != STRATA_OK)
            return rc;
    }
    *slot = p->free_slots[--p->n_free];
    return STRATA_OK;
}

static int new_entry(device_pool *p, size_t *out, strata_error *err)
{
    if (p->n_free_entries) {
        *out = p->free_entries[--p->n_free_entries];
        return STRATA_OK;
    }
    if (p->n_entries == p->cap_entries) {
        size_t cap = p->cap_entries ? 2 * p->cap_entries : 64;
        if (cap > UINT32_MAX)
            return strata_fail(err, STRATA_EFULL, "device pool: too many blocks");
        entry *e = realloc(p->entries, cap * sizeof *e);
        if (!e)
            return strata_fail(err, STRATA_ENOMEM, "out of memory for the device pool's block list");
        p->entries = e;
        size_t *f = realloc(p->free_entries, cap * sizeof *f);
        if (!f)
            return strata_fail(err, STRATA_ENOMEM, "out of memory for the device pool's block list");
        p->free_entries = f;
        p->cap_entries = cap;
    }
    p->entries[p->n_entries] = (entry){.gen = 0};
    *out = p->n_entries++;
    return STRATA_OK;
}

int device_pool_alloc(device_pool *p, uint64_t owner, device_block *out, void **addr, strata_error *err)
{
    if (!p || !out || !addr)
        return strata_fail(err, STRATA_EINVAL, "device pool: NULL argument");
    size_t i = 0, slot = 0;
    int rc = reserve_pins(p, 1, err);
    if (rc == STRATA_OK)
        rc = new_entry(p, &i, err);
    if (rc != STRATA_OK)
        return rc;
    if ((rc = take_slot(p, &slot, err)) != STRATA_OK) {
        p->free_entries[p->n_free_entries++] = i;
        return rc;
    }
    entry *e = &p->entries[i];
    const uint32_t gen = e->gen + 1;
    *e = (entry){.slot = slot, .owner = owner, .gen = gen, .live = true};
    pin(p, i);
    *out = handle_of(p, i);
    *addr = slot_addr(p, slot);
    return STRATA_OK;
}

int device_pool_acquire(device_pool *p, const device_block *blocks, size_t n, void **addrs, strata_error *err)
{
    if (!p || (n && (!blocks || !addrs)))
        return strata_fail(err, STRATA_EINVAL, "device pool: NULL argument");
    if (n > p->n_slots) {
        /* Duplicates would make this an overestimate; callers name each block once. */
        return strata_fail(err, STRATA_EFULL, "the device KV pool holds %zu blocks of %zu bytes, but this step needs "
                           "%zu at once; raise the device KV budget", p->n_slots, p->slot_bytes, n);
    }
    int rc = reserve_pins(p, n, err);
    if (rc != STRATA_OK)
        return rc;
    for (size_t i = 0; i < n; i++)
        if (!lookup(p, blocks[i]))
            return strata_fail(err, STRATA_EINVAL, "device pool: unknown block %#" PRIx64, blocks[i]);
    /* Pin them all first, so that bringing one back never evicts another of the same step. */
    for (size_t i = 0; i < n; i++)
        pin(p, (size_t)(lookup(p, blocks[i]) - p->entries));
    device_pool_prefetch(p, blocks, n);
    for (size_t i = 0; i < n; i++) {
        entry *e = lookup(p, blocks[i]);
        if (e->slot == NO_SLOT) {
            size_t slot;
            rc = take_slot(p, &slot, err);
            if (rc == STRATA_OK) {
                rc = p->lower.get(p->lower.ctx, e->lower, p->staging, p->slot_bytes, p->clock, err);
                if (rc == STRATA_OK)
                    rc = p->mem.copy_in(p->mem.ctx, slot_addr(p, slot), p->staging, e->bytes, err);
                if (rc != STRATA_OK)
                    p->free_slots[p->n_free++] = slot;
            }
            if (rc != STRATA_OK)
                return strata_error_prefix(err, "bringing back a block of sequence %" PRIu64, e->owner);
            e->slot = slot;
            p->stats.fetches++;
            p->stats.fetch_bytes += e->bytes;
        }
        addrs[i] = slot_addr(p, e->slot);
    }
    return STRATA_OK;
}

void device_pool_prefetch(device_pool *p, const device_block *blocks, size_t n)
{
    if (!p || !blocks || !p->lower.prefetch)
        return;
    for (size_t i = 0; i < n; i++) {
        const entry *e = lookup(p, blocks[i]);
        if (e && e->slot == NO_SLOT && e->lower)
            p->lower.prefetch(p->lower.ctx, e->lower, p->clock);
    }
}

void device_pool_unpin_all(device_pool *p)
{
    if (!p)
        return;
    /* The step's pins in order: the newest pin of each resident block joins its list's young end. */
    for (size_t k = 0; k < p->n_pinned; k++) {
        const size_t i = p->pinned[k].entry;
        entry *e = &p->entries[i];
        if (e->live && e->slot != NO_SLOT && e->last_use == p->pinned[k].use && e->list == LIST_NONE)
            list_append(p, i, list_for(e));
    }
    p->n_pinned = 0;
}

void device_pool_free(device_pool *p, device_block b)
{
    entry *e = p ? lookup(p, b) : NULL;
    if (!e)
        return;
    list_remove(p, (size_t)(e - p->entries));
    if (e->slot != NO_SLOT)
        p->free_slots[p->n_free++] = e->slot;
    if (e->lower)
        p->lower.release(p->lower.ctx, e->lower);
    e->live = false;
    e->slot = NO_SLOT;
    e->lower = 0;
    p->free_entries[p->n_free_entries++] = (size_t)(e - p->entries);
}

void device_pool_set_waiting(device_pool *p, uint64_t owner, int waiting)
{
    if (!p)
        return;
    bool changed = false;
    for (size_t i = 0; i < p->n_entries; i++)
        if (p->entries[i].live && p->entries[i].owner == owner && p->entries[i].waiting != (waiting != 0)) {
            p->entries[i].waiting = waiting != 0;
            changed = true;
        }
    if (changed)
        relist(p);
    if (p->lower.set_waiting)
        p->lower.set_waiting(p->lower.ctx, owner, waiting);
}

/* A step's demand, summed over the sequences added (device_pool.h). */
struct device_room {
    const device_pool *pool;
    size_t at_once;   /* blocks one phase pins: every phase alike (sequences pin the same in each) */
    size_t touch;     /* existing blocks the step pins */
    size_t fetch;     /* of those, not resident now */
    size_t made;      /* blocks the step forms */
    size_t dirty;     /* resident blocks with no copy below; SIZE_MAX: not counted yet */
    size_t n_seqs;
    kv_lower_room below;   /* the tier's room, asked once per check */
};

device_room *device_room_begin(const device_pool *p, strata_error *err)
{
    if (!p) {
        strata_fail(err, STRATA_EINVAL, "device room: NULL pool");
        return NULL;
    }
    device_room *r = calloc(1, sizeof *r);
    if (!r) {
        strata_fail(err, STRATA_ENOMEM, "device room: out of memory");
        return NULL;
    }
    r->pool = p;
    r->dirty = SIZE_MAX;
    return r;
}

void device_room_end(device_room *r) { free(r); }

static size_t dirty_blocks(device_room *r)
{
    if (r->dirty == SIZE_MAX) {
        size_t n = 0;
        for (size_t i = 0; i < r->pool->n_entries; i++) {
            const entry *e = &r->pool->entries[i];
            n += e->live && e->slot != NO_SLOT && e->lower == 0;
        }
        r->dirty = n;
    }
    return r->dirty;
}

/* The most bytes the step may move below: *puts, blocks written down, and *fetches, blocks
 * brought back through the tier's memory; in units of a slot rounded up to whole pages. */
static void below_bytes(device_room *r, size_t touch, size_t fetch, size_t made, size_t *puts, size_t *fetches,
                        size_t *unit_out)
{
    const device_pool *p = r->pool;
    const size_t unit = kv_lower_unit_bytes(p->slot_bytes), fetch_cost = p->lower.get_takes_room ? 1 : 0;
    *unit_out = unit;
    if (fetch + made <= p->n_free) {
        *puts = 0;
        *fetches = fetch * fetch_cost * unit;
        return;
    }
    const size_t evicted = touch + made - p->n_free, dirty = dirty_blocks(r) + made;
    *puts = (evicted < dirty ? evicted : dirty) * unit;
    *fetches = touch * fetch_cost * unit;
}

int device_room_add(device_room *r, const device_block *blocks, size_t stride, size_t n_phases, size_t n_pinned,
                    size_t n_new, strata_error *err)
{
    if (!r || (n_pinned && !blocks) || (n_phases > 1 && n_pinned > stride))
        return strata_fail(err, STRATA_EINVAL, "device room: bad arguments");
    const device_pool *p = r->pool;
    size_t fetch = 0;
    for (size_t ph = 0; ph < n_phases; ph++)
        for (size_t b = 0; b < n_pinned; b++) {
            const entry *e = lookup(p, blocks[ph * stride + b]);
            if (!e)
                return strata_fail(err, STRATA_EINVAL, "device room: unknown block %#" PRIx64, blocks[ph * stride + b]);
            fetch += e->slot == NO_SLOT;
        }
    const size_t at_once = r->at_once + n_pinned + n_new, touch = r->touch + n_phases * n_pinned;
    const size_t made = r->made + n_phases * n_new;
    fetch += r->fetch;
    const char *beside = r->n_seqs ? " beside this step's other sequences" : "";
    if (at_once > p->n_slots)
        return strata_fail(err, STRATA_EFULL, "the device KV pool holds %zu blocks of %zu bytes, but a layer of this "
                           "step needs %zu at once%s; raise the device KV budget (--device-kv-mib)",
                           p->n_slots, p->slot_bytes, at_once, beside);
    if (!has_lower(p) && made > p->n_free)
        return strata_fail(err, STRATA_EFULL, "device KV pool full: this step forms %zu blocks, %zu of the pool's %zu "
                           "slots are free%s and no host/NVMe tier is below to evict to; raise the device KV budget "
                           "(--device-kv-mib) or grant a host tier (--host-kv-mib)", made, p->n_free, p->n_slots, beside);
    if (has_lower(p)) {
        size_t unit, puts, fetches;
        below_bytes(r, touch, fetch, made, &puts, &fetches, &unit);
        if (!kv_lower_room_fits(&p->lower, &r->below, unit, puts, fetches))
            return strata_fail(err, STRATA_EFULL, "KV tiers full: this step may move %zu bytes of blocks down from the "
                               "device pool and bring %zu back%s, but host memory has room for %zu and NVMe for %zu; "
                               "raise --host-kv-mib or --nvme-kv-mib", puts, fetches, beside, r->below.through_host,
                               r->below.below);
    }
    r->at_once = at_once;
    r->touch = touch;
    r->fetch = fetch;
    r->made = made;
    r->n_seqs++;
    return STRATA_OK;
}

void *device_pool_addr(const device_pool *p, device_block b)
{
    const entry *e = p ? lookup(p, b) : NULL;
    return e && e->slot != NO_SLOT ? slot_addr(p, e->slot) : NULL;
}

void device_pool_get_stats(const device_pool *p, device_pool_stats *out)
{
    memset(out, 0, sizeof *out);
    if (!p)
        return;
    *out = p->stats;
    out->slots = p->n_slots;
    out->free_slots = p->n_free;
    out->blocks = p->n_entries - p->n_free_entries;
    out->resident_blocks = p->n_slots - p->n_free;   /* a slot not free holds a live block */
}
