#include "offload/tier.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

typedef struct tier_block {
    uint64_t seq, step;
    host_handle host;   /* 0: no host copy (or reserved for a restore in flight) */
    nvme_loc loc;
    bool on_nvme;
    bool waiting, spill_failed, freed, live;
    tier_where where;
    uint32_t len;
    uint32_t gen;
    uint32_t next_free;  /* index + 1 */
    uint64_t failed_at;  /* the tier's nvme_frees when its spill failed (spill_failed) */
    uint64_t ticket;     /* the I/O in flight */
} tier_block;

struct tier {
    host_arena *host;
    nvme_store *nvme;
    size_t high, low;
    tier_block *b;
    uint32_t n, cap, free_slot;
    tier_event *ev;
    size_t ev_head, ev_n, ev_cap;
    size_t spilling_bytes;  /* host bytes whose spill is in flight */
    size_t inflight;
    uint64_t nvme_frees;    /* NVMe copies released so far: room a failed spill may find now */
    tier_stats st;
    /* The failure of the last spill attempt (code 0: it succeeded): when the host tier fills
     * because NVMe refuses writes (ENOSPC, EIO), that is the reason to report. */
    strata_error spill_err;
};

static void note_spill(tier *t, int status, const strata_error *err)
{
    memset(&t->spill_err, 0, sizeof t->spill_err);
    if (status != STRATA_OK)
        strata_fail(&t->spill_err, status, "%s", err && err->msg[0] ? err->msg : "failed");
}

static size_t host_bytes(uint32_t len) { return ((size_t)len + HOST_ARENA_PAGE - 1) / HOST_ARENA_PAGE * HOST_ARENA_PAGE; }

static tier_id id_of(const tier *t, const tier_block *b)
{
    return ((uint64_t)b->gen << 32) | (uint64_t)(b - t->b + 1);
}

/* The block of an id, freed-but-in-flight ones included. */
static tier_block *find(const tier *t, tier_id id)
{
    uint32_t idx = (uint32_t)id, gen = (uint32_t)(id >> 32);
    if (idx == 0 || idx > t->n)
        return NULL;
    tier_block *b = &t->b[idx - 1];
    return b->live && b->gen == gen ? b : NULL;
}

static tier_block *find_live(const tier *t, tier_id id)
{
    tier_block *b = find(t, id);
    return b && !b->freed ? b : NULL;
}

static void push_event(tier *t, tier_id id, tier_event_kind kind, int status, const strata_error *err)
{
    if (t->ev_head > 0 && t->ev_head == t->ev_n)
        t->ev_head = t->ev_n = 0;
    if (t->ev_n == t->ev_cap) {
        size_t cap = t->ev_cap ? t->ev_cap * 2 : 64;
        tier_event *v = realloc(t->ev, cap * sizeof *v);
        if (!v)
            return;  /* the outcome is still applied and counted; only its notice is lost */
        t->ev = v;
        t->ev_cap = cap;
    }
    tier_event *e = &t->ev[t->ev_n++];
    memset(e, 0, sizeof *e);
    e->id = id;
    e->kind = kind;
    e->status = status;
    if (err && status != STRATA_OK)
        e->err = *err;
}

static void release(tier *t, tier_block *b)
{
    if (b->host)
        host_arena_free(t->host, b->host, NULL);
    if (b->on_nvme) {
        nvme_store_free(t->nvme, &b->loc, NULL);
        t->nvme_frees++;
    }
    b->live = false;
    b->gen = b->gen == UINT32_MAX ? 1 : b->gen + 1;
    b->next_free = t->free_slot;
    t->free_slot = (uint32_t)(b - t->b) + 1;
}

/* A block whose spill failed stays in host memory and is not tried again (each try would fail
 * the same way) until NVMe copies were released since (ENOSPC may then pass), the block is used
 * (tier_touch), or the host tier is full (make_room's last try: the disk may have recovered). */
static void mark_spill_failed(tier *t, tier_block *b)
{
    b->spill_failed = true;
    b->failed_at = t->nvme_frees;
}

static bool may_spill(const tier *t, const tier_block *b)
{
    return !b->spill_failed || b->failed_at != t->nvme_frees;
}

/* Applies one finished NVMe request. */
static void handle(tier *t, const nvme_completion *c)
{
    tier_block *b = find(t, c->tag);
    if (!b || b->ticket != c->ticket)
        return;  /* not ours: the store is the tier's alone, so this does not happen */
    t->inflight--;
    b->ticket = 0;
    tier_id id = c->tag;
    if (c->kind == NVME_OP_WRITE) {
        t->spilling_bytes -= host_bytes(b->len);
        if (c->status == STRATA_OK) {
            /* Written, durable and verified: only now may the host copy go. */
            b->loc = c->loc;
            b->on_nvme = true;
            t->st.spills++;
            note_spill(t, STRATA_OK, NULL);
            if (b->freed) {
                release(t, b);
                return;
            }
            host_arena_free(t->host, b->host, NULL);
            b->host = 0;
            b->where = TIER_NVME;
            push_event(t, id, TIER_EV_SPILLED, STRATA_OK, NULL);
        } else {
            t->st.spill_failures++;
            note_spill(t, c->status, &c->err);
            if (b->freed) {
                release(t, b);
                return;
            }
            b->where = TIER_HOST;
            mark_spill_failed(t, b);
            push_event(t, id, TIER_EV_SPILL_FAILED, c->status, &c->err);
        }
        return;
    }
    if (c->status == STRATA_OK) {
        t->st.restores++;
        if (b->freed) {
            release(t, b);
            return;
        }
        b->where = TIER_BOTH;
        push_event(t, id, TIER_EV_RESTORED, STRATA_OK, NULL);
    } else {
        t->st.restore_failures++;
        host_arena_free(t->host, b->host, NULL);
        b->host = 0;
        if (b->freed) {
            release(t, b);
            return;
        }
        b->where = TIER_NVME;
        push_event(t, id, TIER_EV_RESTORE_FAILED, c->status, &c->err);
    }
}

static void reap(tier *t)
{
    nvme_completion c[16];
    size_t k;
    while ((k = nvme_store_poll(t->nvme, c, 16)) > 0)
        for (size_t i = 0; i < k; i++)
            handle(t, &c[i]);
}

static bool wait_one(tier *t)
{
    nvme_completion c;
    if (nvme_store_wait(t->nvme, &c, 1) == 0)
        return false;
    handle(t, &c);
    return true;
}

typedef struct cand {
    uint32_t idx;
    uint32_t waiting;
    uint64_t step;
} cand;

static int cand_cmp(const void *pa, const void *pb)
{
    const cand *a = pa, *b = pb;
    if (a->waiting != b->waiting)
        return a->waiting ? -1 : 1;  /* waiting/preempted sequences first */
    if (a->step != b->step)
        return a->step < b->step ? -1 : 1;  /* then least recently used */
    return a->idx < b->idx ? -1 : a->idx > b->idx;
}

/* Evicts host copies until target bytes are on their way out (spills in flight count) or no
 * candidate is left. Clean blocks are dropped at once; others start a spill. */
static size_t evict_core(tier *t, size_t target)
{
    if (t->spilling_bytes >= target)
        return 0;
    cand *c = malloc((size_t)(t->n ? t->n : 1) * sizeof *c);
    if (!c)
        return 0;
    size_t nc = 0;
    for (uint32_t i = 0; i < t->n; i++) {
        tier_block *b = &t->b[i];
        if (b->live && !b->freed && may_spill(t, b) && (b->where == TIER_HOST || b->where == TIER_BOTH))
            c[nc++] = (cand){i, b->waiting, b->step};
    }
    qsort(c, nc, sizeof *c, cand_cmp);
    size_t going = t->spilling_bytes, started = 0;
    for (size_t k = 0; k < nc && going < target; k++) {
        tier_block *b = &t->b[c[k].idx];
        size_t bytes = host_bytes(b->len);
        if (b->where == TIER_BOTH) {
            host_arena_free(t->host, b->host, NULL);
            b->host = 0;
            b->where = TIER_NVME;
            t->st.clean_evictions++;
            going += bytes;
            started++;
            continue;
        }
        size_t len;
        const uint8_t *p = host_arena_get(t->host, b->host, &len);
        strata_error err = {0};
        uint64_t ticket;
        int rc = nvme_store_submit_write(t->nvme, p, len, id_of(t, b), &ticket, NULL, &err);
        if (rc != STRATA_OK) {
            /* E.g. the NVMe tier is full: the block stays in host memory. */
            t->st.spill_failures++;
            note_spill(t, rc, &err);
            mark_spill_failed(t, b);
            push_event(t, id_of(t, b), TIER_EV_SPILL_FAILED, rc, &err);
            continue;
        }
        b->ticket = ticket;
        b->where = TIER_SPILLING;
        t->spilling_bytes += bytes;
        t->inflight++;
        going += bytes;
        started++;
    }
    free(c);
    return started;
}

size_t tier_evict(tier *t)
{
    size_t used = host_arena_used_bytes(t->host);
    if (used <= t->high)
        return 0;
    return evict_core(t, used - t->low);
}

/* Host blocks left out of eviction because their spill failed (may_spill). */
static tier_block *first_blocked(tier *t, size_t *count)
{
    tier_block *first = NULL;
    *count = 0;
    for (uint32_t i = 0; i < t->n; i++) {
        tier_block *b = &t->b[i];
        if (b->live && !b->freed && b->where == TIER_HOST && !may_spill(t, b)) {
            first = first ? first : b;
            (*count)++;
        }
    }
    return first;
}

/* Reserves len host bytes, evicting (and waiting for spills) as long as that can help. When only
 * blocks whose spill failed are left, one of them is tried again as a probe (the disk may have
 * recovered): one failing write per call while the disk stays broken, not one per block; once
 * a spill succeeds again, every such block is a candidate again. */
static int make_room(tier *t, size_t len, host_handle *h, uint8_t **p, strata_error *err)
{
    bool probed = false;
    for (;;) {
        int rc = host_arena_reserve(t->host, len, h, p, err);
        if (rc != STRATA_EFULL)
            return rc;
        size_t started = evict_core(t, t->spilling_bytes + host_bytes((uint32_t)len));
        if (t->inflight > 0) {
            if (!wait_one(t))
                return strata_error_prefix(err, "tier: waiting for spills");
            continue;
        }
        if (started > 0)
            continue;
        size_t blocked;
        tier_block *probe = first_blocked(t, &blocked);
        if (!probe)   /* the budget is too small for what is pinned or reserved, not a disk fault */
            return strata_error_prefix(err, "tier: nothing left to evict");
        if (t->spill_err.code == STRATA_OK) {   /* a spill succeeded since these failed: the disk is back */
            for (uint32_t i = 0; i < t->n; i++)
                t->b[i].spill_failed = false;
            continue;
        }
        if (!probed) {
            probe->spill_failed = false;
            probed = true;
            continue;
        }
        /* Both tiers' budgets full is a lack of room (EFULL: the request fails for capacity), not
         * damage; a disk that fails its writes with budget left (ENOSPC of a full file system
         * included) is EIO, naming the disk. */
        size_t probe_len = 0;
        (void)host_arena_get(t->host, probe->host, &probe_len);
        if (nvme_store_fit_bytes(t->nvme, probe_len) == 0)
            return strata_fail(err, STRATA_EFULL, "tier: the host and NVMe tiers are full (%zu block(s) could not be "
                               "spilled): %s", blocked, t->spill_err.msg);
        return strata_fail(err, STRATA_EIO, "tier: the host tier is full and the NVMe tier refuses writes (%zu block(s) "
                           "could not be spilled): %s", blocked, t->spill_err.msg);
    }
}

size_t tier_host_only_bytes(const tier *t, size_t block_bytes)
{
    const size_t unit = host_bytes((uint32_t)block_bytes);
    size_t n = 0;
    for (uint32_t i = 0; t && unit && i < t->n; i++) {
        const tier_block *b = &t->b[i];
        if (b->live && !b->freed && b->where == TIER_HOST)
            n += (host_bytes(b->len) + unit - 1) / unit;
    }
    return n * unit;
}

tier *tier_create(host_arena *host, nvme_store *nvme, const tier_options *o, strata_error *err)
{
    if (!host || !nvme) {
        strata_fail(err, STRATA_EINVAL, "tier: needs a host arena and an NVMe store");
        return NULL;
    }
    size_t cap = host_arena_capacity(host);
    size_t high = o && o->high_bytes ? o->high_bytes : cap / 10 * 9;
    size_t low = o && o->low_bytes ? o->low_bytes : cap / 4 * 3;
    if (low > high || high > cap) {
        strata_fail(err, STRATA_EINVAL, "tier: watermarks low %zu <= high %zu <= capacity %zu do not hold", low, high,
                    cap);
        return NULL;
    }
    tier *t = calloc(1, sizeof *t);
    if (!t) {
        strata_fail(err, STRATA_ENOMEM, "tier: out of memory");
        return NULL;
    }
    t->host = host;
    t->nvme = nvme;
    t->high = high;
    t->low = low;
    return t;
}

void tier_drain(tier *t)
{
    reap(t);
    while (t->inflight > 0 && wait_one(t)) {
    }
}

void tier_destroy(tier *t)
{
    if (!t)
        return;
    tier_drain(t);
    for (uint32_t i = 0; i < t->n; i++)
        if (t->b[i].live)
            release(t, &t->b[i]);
    free(t->b);
    free(t->ev);
    free(t);
}

int tier_put(tier *t, const void *bytes, size_t len, uint64_t seq, uint64_t step, tier_id *out, strata_error *err)
{
    if (!t || !bytes || !out || len == 0 || len > UINT32_MAX)
        return strata_fail(err, STRATA_EINVAL, "tier: bad put");
    if (!t->free_slot) {
        if (t->n == UINT32_MAX - 1)
            return strata_fail(err, STRATA_EFULL, "tier: too many blocks");
        if (t->n == t->cap) {
            uint32_t cap = t->cap ? t->cap * 2 : 256;
            tier_block *v = realloc(t->b, (size_t)cap * sizeof *v);
            if (!v)
                return strata_fail(err, STRATA_ENOMEM, "tier: out of memory for the block table");
            t->b = v;
            t->cap = cap;
        }
        t->b[t->n] = (tier_block){.gen = 1};
        t->n++;
        t->free_slot = t->n;
    }
    host_handle h;
    uint8_t *p;
    int rc = make_room(t, len, &h, &p, err);
    if (rc != STRATA_OK)
        return rc;
    memcpy(p, bytes, len);
    uint32_t idx = t->free_slot - 1;
    tier_block *b = &t->b[idx];
    t->free_slot = b->next_free;
    uint32_t gen = b->gen;
    *b = (tier_block){.seq = seq, .step = step, .host = h, .live = true, .where = TIER_HOST, .len = (uint32_t)len,
                      .gen = gen};
    *out = id_of(t, b);
    tier_evict(t);
    return STRATA_OK;
}

const uint8_t *tier_get(const tier *t, tier_id id, size_t *len)
{
    const tier_block *b = find_live(t, id);
    if (len)
        *len = 0;
    if (!b || !(b->where == TIER_HOST || b->where == TIER_SPILLING || b->where == TIER_BOTH))
        return NULL;
    return host_arena_get(t->host, b->host, len);
}

tier_where tier_location(const tier *t, tier_id id)
{
    const tier_block *b = find_live(t, id);
    return b ? b->where : TIER_NONE;
}

int tier_touch(tier *t, tier_id id, uint64_t step, strata_error *err)
{
    tier_block *b = find_live(t, id);
    if (!b)
        return strata_fail(err, STRATA_EINVAL, "tier: unknown block %#" PRIx64, id);
    b->step = step;
    b->spill_failed = false;
    return STRATA_OK;
}

void tier_set_waiting(tier *t, uint64_t seq, bool waiting)
{
    for (uint32_t i = 0; i < t->n; i++)
        if (t->b[i].live && t->b[i].seq == seq)
            t->b[i].waiting = waiting;
}

int tier_prefetch(tier *t, tier_id id, strata_error *err)
{
    tier_block *b = find_live(t, id);
    if (!b)
        return strata_fail(err, STRATA_EINVAL, "tier: unknown block %#" PRIx64, id);
    if (b->where != TIER_NVME)
        return STRATA_OK;
    host_handle h;
    uint8_t *p;
    int rc = make_room(t, b->len, &h, &p, err);
    if (rc != STRATA_OK)
        return strata_error_prefix(err, "tier: restoring block %#" PRIx64, id);
    /* make_room may have waited for other blocks' I/O; this block, on NVMe only, was not
     * touched by that (it is no eviction candidate and has no I/O of its own). */
    uint64_t ticket;
    /* the extent is whole pages: with room for the padded read, it goes straight into it */
    rc = nvme_store_submit_read(t->nvme, &b->loc, p, host_bytes(b->len), id, &ticket, err);
    if (rc != STRATA_OK) {
        host_arena_free(t->host, h, NULL);
        return rc;
    }
    b->host = h;
    b->ticket = ticket;
    b->where = TIER_RESTORING;
    t->inflight++;
    return STRATA_OK;
}

int tier_restore(tier *t, tier_id id, strata_error *err)
{
    int rc = tier_prefetch(t, id, err);
    if (rc != STRATA_OK)
        return rc;
    tier_block *b = find_live(t, id);
    if (b->where != TIER_RESTORING)
        return STRATA_OK;
    nvme_completion c;
    rc = nvme_store_wait_ticket(t->nvme, b->ticket, &c);
    handle(t, &c);
    if (rc != STRATA_OK && err)
        *err = c.err;
    return rc;
}

int tier_free(tier *t, tier_id id, strata_error *err)
{
    tier_block *b = find_live(t, id);
    if (!b)
        return strata_fail(err, STRATA_EINVAL, "tier: free of unknown block %#" PRIx64, id);
    if (b->where == TIER_SPILLING || b->where == TIER_RESTORING)
        b->freed = true;  /* released when its I/O completes */
    else
        release(t, b);
    return STRATA_OK;
}

size_t tier_poll(tier *t, tier_event *out, size_t max)
{
    reap(t);
    tier_evict(t);
    size_t n = 0;
    while (n < max && t->ev_head < t->ev_n)
        out[n++] = t->ev[t->ev_head++];
    return n;
}

void tier_get_stats(const tier *t, tier_stats *out)
{
    *out = t->st;
    out->spill_error = t->spill_err;
    out->blocks = out->host_blocks = out->nvme_blocks = 0;
    for (uint32_t i = 0; i < t->n; i++) {
        const tier_block *b = &t->b[i];
        if (!b->live || b->freed)
            continue;
        out->blocks++;
        out->host_blocks += b->where == TIER_HOST || b->where == TIER_SPILLING || b->where == TIER_BOTH;
        out->nvme_blocks += b->where == TIER_NVME || b->where == TIER_RESTORING || b->where == TIER_BOTH;
    }
    out->host_used_bytes = host_arena_used_bytes(t->host);
}
