/* The coordinator's prefix-cache index (prefix_index.h). Entries live in one array searched
 * linearly: a replica's host budget holds a few hundred prefixes at most, and a lookup or an
 * insert touches each once (an insert that evicts also sorts the replica's unpinned entries
 * once, however many it evicts). Order in the array means
 * nothing; recency is the use stamp, so removal swaps the last entry in. */
#include "coordinator/sched/prefix_index.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

typedef struct entry {
    uint64_t id;
    int replica;
    int plan;
    int32_t *tokens;     /* the index's own copy */
    size_t n_tokens;
    uint64_t bytes;
    uint64_t used;       /* use stamp: larger is more recent (insert and pin) */
    unsigned pins;
    bool doomed;         /* chosen for eviction by the insert under way */
} entry;

typedef struct replica {
    uint64_t bytes;
    size_t n_entries;
    /* Ids evicted but not yet sent to the workers, oldest first. Its capacity always covers
     * every id already queued plus every entry of the replica (insert reserves it), so evicting
     * or removing never allocates and cannot fail halfway. */
    uint64_t *drops;
    size_t n_drops, cap_drops;
    uint64_t hits, hit_tokens, inserts, evictions;
} replica;

struct prefix_index {
    prefix_index_config cfg;
    replica *reps;
    entry *ents;
    size_t n_ents, cap_ents;
    uint64_t clock;      /* the last use stamp handed out */
};

prefix_index *prefix_index_create(const prefix_index_config *c, strata_error *err)
{
    if (!c || c->n_replicas < 1 || c->block_tokens == 0) {
        strata_fail(err, STRATA_EINVAL, "prefix index: n_replicas must be >= 1 and block_tokens > 0");
        return NULL;
    }
    prefix_index *x = calloc(1, sizeof *x);
    if (!x || !(x->reps = calloc((size_t)c->n_replicas, sizeof *x->reps))) {
        free(x);
        strata_fail(err, STRATA_ENOMEM, "prefix index: out of memory");
        return NULL;
    }
    x->cfg = *c;
    return x;
}

void prefix_index_destroy(prefix_index *x)
{
    if (!x)
        return;
    for (size_t i = 0; i < x->n_ents; i++)
        free(x->ents[i].tokens);
    for (int r = 0; r < x->cfg.n_replicas; r++)
        free(x->reps[r].drops);
    free(x->ents);
    free(x->reps);
    free(x);
}

static bool replica_ok(const prefix_index *x, int r)
{
    return r >= 0 && r < x->cfg.n_replicas;
}

static entry *find(const prefix_index *x, uint64_t id)
{
    for (size_t i = 0; i < x->n_ents; i++)
        if (x->ents[i].id == id)
            return &x->ents[i];
    return NULL;
}

static size_t common_prefix(const int32_t *a, const int32_t *b, size_t n)
{
    size_t i = 0;
    while (i < n && a[i] == b[i])
        i++;
    return i;
}

/* Drops entry e from the array (its bytes and count leave its replica); queue says whether its
 * workers must be told (not when they are gone: forget_replica). */
static void drop_entry(prefix_index *x, entry *e, bool queue)
{
    replica *p = &x->reps[e->replica];
    if (queue)
        p->drops[p->n_drops++] = e->id;   /* room reserved by insert */
    p->bytes -= e->bytes;
    p->n_entries--;
    free(e->tokens);
    *e = x->ents[--x->n_ents];
}

/* Whether e is made redundant by a new entry of plan `plan` and ids tokens[0, n): its ids are a
 * prefix of those. */
static bool redundant_under(const entry *e, int plan, const int32_t *tokens, size_t n)
{
    return e->plan == plan && e->n_tokens <= n && common_prefix(e->tokens, tokens, e->n_tokens) == e->n_tokens;
}

static int by_use(const void *a, const void *b)
{
    const entry *x = *(const entry *const *)a, *y = *(const entry *const *)b;
    return x->used < y->used ? -1 : x->used > y->used;
}

bool prefix_index_lookup(const prefix_index *x, int plan, const int32_t *prompt, size_t n_prompt, const bool *usable,
                         prefix_hit *hit)
{
    prefix_hit best = {0};
    uint64_t best_used = 0;
    /* The prompt's last token must run to give logits, so at most n_prompt - 1 can come from
     * the cache: a prompt of 0 or 1 tokens never hits. */
    if (x && prompt && n_prompt >= 2) {
        size_t limit = n_prompt - 1;
        for (size_t i = 0; i < x->n_ents; i++) {
            const entry *e = &x->ents[i];
            if (e->plan != plan || (usable && !usable[e->replica]))
                continue;
            size_t n = common_prefix(e->tokens, prompt, e->n_tokens < limit ? e->n_tokens : limit);
            n -= n % x->cfg.block_tokens;
            if (n == 0)
                continue;
            if (n > best.n_tokens || (n == best.n_tokens && e->used > best_used)) {
                best = (prefix_hit){.entry = e->id, .replica = e->replica, .n_tokens = n};
                best_used = e->used;
            }
        }
    }
    if (hit)
        *hit = best;
    return best.entry != 0;
}

bool prefix_index_pin(prefix_index *x, uint64_t entry_id, size_t n_tokens)
{
    entry *e = x ? find(x, entry_id) : NULL;
    if (!e)
        return false;
    e->used = ++x->clock;
    e->pins++;
    x->reps[e->replica].hits++;
    x->reps[e->replica].hit_tokens += n_tokens;
    return true;
}

void prefix_index_unpin(prefix_index *x, uint64_t entry_id)
{
    entry *e = x ? find(x, entry_id) : NULL;
    if (e && e->pins > 0)
        e->pins--;
}

/* Whether an entry of r and plan already holds tokens[0, n) (same ids, at least as many). */
static bool covered(const prefix_index *x, int r, int plan, const int32_t *tokens, size_t n)
{
    for (size_t i = 0; i < x->n_ents; i++) {
        const entry *e = &x->ents[i];
        if (e->replica == r && e->plan == plan && e->n_tokens >= n && common_prefix(e->tokens, tokens, n) == n)
            return true;
    }
    return false;
}

static uint64_t pinned_bytes(const prefix_index *x, int r)
{
    uint64_t sum = 0;
    for (size_t i = 0; i < x->n_ents; i++)
        if (x->ents[i].replica == r && x->ents[i].pins > 0)
            sum += x->ents[i].bytes;
    return sum;
}

/* Makes room for one more entry on r before anything changes, so an insert either happens
 * whole or not at all: the entry slot, and drop-queue room for every entry of r (with the new
 * one) on top of what is queued. */
static int reserve(prefix_index *x, int r, strata_error *err)
{
    if (x->n_ents == x->cap_ents) {
        size_t cap = x->cap_ents ? 2 * x->cap_ents : 16;
        entry *ents = realloc(x->ents, cap * sizeof *ents);
        if (!ents)
            return strata_fail(err, STRATA_ENOMEM, "prefix index: out of memory");
        x->ents = ents;
        x->cap_ents = cap;
    }
    replica *p = &x->reps[r];
    size_t need = p->n_drops + p->n_entries + 1;
    if (need > p->cap_drops) {
        size_t cap = p->cap_drops ? 2 * p->cap_drops : 16;
        if (cap < need)
            cap = need;
        uint64_t *drops = realloc(p->drops, cap * sizeof *drops);
        if (!drops)
            return strata_fail(err, STRATA_ENOMEM, "prefix index: out of memory");
        p->drops = drops;
        p->cap_drops = cap;
    }
    return STRATA_OK;
}

int prefix_index_insert(prefix_index *x, uint64_t entry_id, int r, int plan, const int32_t *tokens, size_t n_tokens,
                        uint64_t bytes, bool *keep, strata_error *err)
{
    if (keep)
        *keep = false;
    if (!x || !tokens || !keep || n_tokens == 0 || entry_id == 0)
        return strata_fail(err, STRATA_EINVAL, "prefix index: insert needs an entry id, tokens and keep");
    if (n_tokens % x->cfg.block_tokens != 0)
        return strata_fail(err, STRATA_EINVAL, "prefix index: %zu tokens is not a multiple of block_tokens %zu",
                           n_tokens, x->cfg.block_tokens);
    if (!replica_ok(x, r))
        return strata_fail(err, STRATA_EINVAL, "prefix index: replica %d out of range", r);
    if (find(x, entry_id))
        return strata_fail(err, STRATA_EINVAL, "prefix index: entry %" PRIu64 " already exists", entry_id);
    uint64_t budget = x->cfg.budget_bytes;
    if (budget == 0 || bytes > budget || covered(x, r, plan, tokens, n_tokens))
        return STRATA_OK;
    /* Pinned entries stay whatever happens; if they leave no room, evicting the others would
     * only lose them for nothing. */
    if (pinned_bytes(x, r) > budget - bytes)
        return STRATA_OK;
    int rc = reserve(x, r, err);
    if (rc != STRATA_OK)
        return rc;
    replica *p = &x->reps[r];
    int32_t *copy = malloc(n_tokens * sizeof *copy);
    entry **lru = malloc((p->n_entries ? p->n_entries : 1) * sizeof *lru);
    if (!copy || !lru) {
        free(copy);
        free(lru);
        return strata_fail(err, STRATA_ENOMEM, "prefix index: out of memory");
    }
    memcpy(copy, tokens, n_tokens * sizeof *copy);

    /* The entries the new one makes redundant go first, then the oldest others until it fits
     * (evicting every unpinned entry fits: checked above), each group least recently used
     * first. One sort, not a scan per evicted entry: an insert that evicted tens of thousands of
     * small entries took seconds under the coordinator's lock. */
    uint64_t kept_bytes = p->bytes;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1 && kept_bytes <= budget - bytes)
            break;
        size_t n_lru = 0;
        for (size_t i = 0; i < x->n_ents; i++) {
            entry *e = &x->ents[i];
            if (e->replica == r && e->pins == 0 && !e->doomed &&
                (pass == 1 || redundant_under(e, plan, tokens, n_tokens)))
                lru[n_lru++] = e;
        }
        qsort(lru, n_lru, sizeof *lru, by_use);
        for (size_t k = 0; k < n_lru && (pass == 0 || kept_bytes > budget - bytes); k++) {
            lru[k]->doomed = true;
            kept_bytes -= lru[k]->bytes;
            p->drops[p->n_drops++] = lru[k]->id;   /* room reserved by reserve() */
        }
    }
    free(lru);
    for (size_t i = 0; i < x->n_ents;) {
        if (x->ents[i].doomed) {
            drop_entry(x, &x->ents[i], false);   /* queued above; swaps another entry into i */
            p->evictions++;
        } else {
            i++;
        }
    }
    x->ents[x->n_ents++] = (entry){.id = entry_id, .replica = r, .plan = plan, .tokens = copy,
                                   .n_tokens = n_tokens, .bytes = bytes, .used = ++x->clock};
    p->bytes += bytes;
    p->n_entries++;
    p->inserts++;
    *keep = true;
    return STRATA_OK;
}

void prefix_index_remove(prefix_index *x, uint64_t entry_id)
{
    entry *e = x ? find(x, entry_id) : NULL;
    if (!e)
        return;
    x->reps[e->replica].evictions++;
    drop_entry(x, e, true);
}

size_t prefix_index_take_drops(prefix_index *x, int r, uint64_t *out, size_t cap)
{
    if (!x || !replica_ok(x, r) || !out)
        return 0;
    replica *p = &x->reps[r];
    size_t n = p->n_drops < cap ? p->n_drops : cap;
    if (n == 0)
        return 0;   /* the queue may never have been allocated: no memcpy from NULL */
    memcpy(out, p->drops, n * sizeof *out);
    memmove(p->drops, p->drops + n, (p->n_drops - n) * sizeof *p->drops);
    p->n_drops -= n;
    return n;
}

size_t prefix_index_pending_drops(const prefix_index *x, int r)
{
    return x && replica_ok(x, r) ? x->reps[r].n_drops : 0;
}

void prefix_index_forget_replica(prefix_index *x, int r)
{
    if (!x || !replica_ok(x, r))
        return;
    for (size_t i = 0; i < x->n_ents;) {
        if (x->ents[i].replica == r)
            drop_entry(x, &x->ents[i], false);   /* swaps another entry into i: look at i again */
        else
            i++;
    }
    x->reps[r].n_drops = 0;
    x->reps[r].bytes = 0;
}

int prefix_index_replica(const prefix_index *x, uint64_t entry_id)
{
    const entry *e = x ? find(x, entry_id) : NULL;
    return e ? e->replica : -1;
}

static void add_stats(const replica *p, prefix_index_stats *out)
{
    out->entries += p->n_entries;
    out->bytes += p->bytes;
    out->hits += p->hits;
    out->hit_tokens += p->hit_tokens;
    out->inserts += p->inserts;
    out->evictions += p->evictions;
}

void prefix_index_get_stats(const prefix_index *x, int r, prefix_index_stats *out)
{
    if (!out)
        return;
    *out = (prefix_index_stats){0};
    if (!x)
        return;
    for (int i = 0; i < x->cfg.n_replicas; i++)
        if (r == -1 || r == i)
            add_stats(&x->reps[i], out);
}
