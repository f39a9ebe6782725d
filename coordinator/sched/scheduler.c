/* Continuous-batching scheduler (scheduler.h). Requests live in one array searched linearly:
 * the coordinator holds at most a few thousand live requests, and a step touches each once. */
#include "coordinator/sched/scheduler.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

typedef struct request {
    uint64_t id;
    uint64_t order;        /* admission order: FIFO and "most recently admitted" */
    size_t prompt, max_tokens;
    size_t len;            /* tokens in the KV cache */
    size_t generated;
    size_t reserved;       /* block rows reserved on its replica (0 while unrouted) */
    sched_state state;
    int replica;           /* -1 while unrouted */
    uint64_t in_step;      /* the outstanding step of its replica it is part of; 0: none */
    size_t step_tokens;
    bool step_sample;      /* that step samples a token for it (decode, or the last prompt chunk) */
    int prefer;            /* the replica holding its cached prefix (-1: none) */
    size_t cached;         /* prompt tokens that prefix covers: its prefill starts there on `prefer` */
} request;

typedef struct replica {
    sched_replica_config cfg;
    size_t reserved;
    uint64_t step;
    uint64_t *pending_free;   /* finished sequences whose blocks the workers still hold */
    size_t n_pending_free, cap_pending_free;
    /* the last plan's arrays */
    sched_work *work;
    uint64_t *preempt, *resume, *freed;
    size_t cap_plan;
    uint64_t preemptions, resumptions;
    uint64_t out_steps[SCHED_MAX_STEPS_IN_FLIGHT];   /* planned steps without results yet */
    size_t outstanding;
    size_t depth;             /* steps it may have out (sched_set_steps_in_flight) */
    bool unavailable;
    bool not_accepting;
    bool held;             /* route_pending's scratch: an older waiting request may run here */
} replica;

struct scheduler {
    sched_config cfg;
    replica *reps;
    request *reqs;
    size_t n_reqs, cap_reqs;
    uint64_t next_order;
    uint64_t admitted, rejected, finished;
};

static size_t blocks_for(const scheduler *s, size_t tokens)
{
    return (tokens + s->cfg.block_tokens - 1) / s->cfg.block_tokens;
}

/* The most blocks one sequence can ever hold on a replica: all of them must fit the tiers, and
 * one layer of them the device at once (streaming). */
static size_t one_sequence_blocks(const sched_replica_config *c)
{
    return c->total_blocks < c->stream_blocks ? c->total_blocks : c->stream_blocks;
}

/* The blocks a running sequence holds on the device for the step being planned: with its next
 * token, or, while a step is out with it, with that step's tokens and the next one. */
static size_t held_blocks(const scheduler *s, const request *q)
{
    /* A prompt being prefilled counts all of it from its first chunk on: it is never preempted,
     * so the device keeps room for the rest (two half-prefilled prompts must never fill the
     * device between them, where neither could go on nor be spilled). */
    size_t tokens = q->len + (q->in_step ? q->step_tokens : 0);
    return blocks_for(s, (tokens > q->prompt ? tokens : q->prompt) + 1);
}

/* What a step may hold on the device: a sequence alone on its replica (nothing else running
 * beside it) may stream past the device pools' block rows. */
static size_t device_room(const replica *p, bool alone)
{
    return alone ? p->cfg.stream_blocks : p->cfg.device_blocks;
}

scheduler *sched_create(const sched_config *c, strata_error *err)
{
    if (!c || c->block_tokens == 0 || c->max_batch_tokens == 0 || c->max_seqs == 0 || c->n_replicas < 1 ||
        !c->replicas) {
        strata_fail(err, STRATA_EINVAL, "scheduler: block_tokens, max_batch_tokens, max_seqs and replicas must be set");
        return NULL;
    }
    if (c->max_steps_in_flight > SCHED_MAX_STEPS_IN_FLIGHT) {
        strata_fail(err, STRATA_EINVAL, "scheduler: max_steps_in_flight %zu is more than %d", c->max_steps_in_flight,
                    SCHED_MAX_STEPS_IN_FLIGHT);
        return NULL;
    }
    if (c->max_seqs > c->max_batch_tokens) {
        strata_fail(err, STRATA_EINVAL, "scheduler: max_seqs %zu exceeds max_batch_tokens %zu (every running sequence "
                    "decodes one token per step)", c->max_seqs, c->max_batch_tokens);
        return NULL;
    }
    for (int r = 0; r < c->n_replicas; r++) {
        const sched_replica_config *rc = &c->replicas[r];
        if (rc->device_blocks == 0 || rc->total_blocks < rc->device_blocks) {
            strata_fail(err, STRATA_EINVAL, "scheduler: replica %d: device_blocks %zu must be > 0 and <= total_blocks %zu",
                        r, rc->device_blocks, rc->total_blocks);
            return NULL;
        }
        if (rc->stream_blocks != 0 && rc->stream_blocks < rc->device_blocks) {
            strata_fail(err, STRATA_EINVAL, "scheduler: replica %d: stream_blocks %zu must be 0 or >= device_blocks %zu",
                        r, rc->stream_blocks, rc->device_blocks);
            return NULL;
        }
    }
    scheduler *s = calloc(1, sizeof *s);
    if (!s || !(s->reps = calloc((size_t)c->n_replicas, sizeof *s->reps))) {
        free(s);
        strata_fail(err, STRATA_ENOMEM, "scheduler: out of memory");
        return NULL;
    }
    s->cfg = *c;
    s->cfg.replicas = NULL;
    if (s->cfg.max_steps_in_flight == 0)
        s->cfg.max_steps_in_flight = 1;
    for (int r = 0; r < c->n_replicas; r++) {
        s->reps[r].cfg = c->replicas[r];
        if (s->reps[r].cfg.stream_blocks == 0)
            s->reps[r].cfg.stream_blocks = s->reps[r].cfg.device_blocks;
        s->reps[r].depth = s->cfg.max_steps_in_flight;
    }
    return s;
}

void sched_destroy(scheduler *s)
{
    if (!s)
        return;
    for (int r = 0; r < s->cfg.n_replicas; r++) {
        replica *p = &s->reps[r];
        free(p->pending_free);
        free(p->work);
        free(p->preempt);
        free(p->resume);
        free(p->freed);
    }
    free(s->reps);
    free(s->reqs);
    free(s);
}

static request *find(const scheduler *s, uint64_t id)
{
    for (size_t i = 0; i < s->n_reqs; i++)
        if (s->reqs[i].id == id)
            return &s->reqs[i];
    return NULL;
}

/* The replica with the most unreserved block rows that can take `need` (ties: lowest index),
 * among those no older waiting request holds (replica.held). */
static int best_replica(const scheduler *s, size_t need)
{
    int best = -1;
    size_t best_free = 0;
    for (int r = 0; r < s->cfg.n_replicas; r++) {
        const replica *p = &s->reps[r];
        size_t free_blocks = p->cfg.total_blocks - p->reserved;
        if (p->unavailable || p->not_accepting || p->held || need > one_sequence_blocks(&p->cfg))
            continue;
        if (need <= free_blocks && (best < 0 || free_blocks > best_free)) {
            best = r;
            best_free = free_blocks;
        }
    }
    return best;
}

/* Whether replica r can take a request of `need` block rows now. */
static bool replica_takes(const scheduler *s, int r, size_t need)
{
    const replica *p = r >= 0 && r < s->cfg.n_replicas ? &s->reps[r] : NULL;
    return p && !p->unavailable && !p->not_accepting && need <= one_sequence_blocks(&p->cfg) &&
           need <= p->cfg.total_blocks - p->reserved;
}

/* Routes unrouted requests, oldest first. A request that cannot be routed yet holds back the
 * younger ones on every replica it could ever run on (its worst case within the replica's limit
 * for one sequence): they take no room there before it, so requests that compete for a replica
 * keep their order. A replica it could never run on (a smaller one) is not held: a request that
 * fits there goes on there instead of waiting behind it. A request with a cached prefix goes to
 * the replica holding it when that one has room and is not held, else where the others would
 * go, without its prefix. A pass ends once every replica that takes requests is held. */
static void route_pending(scheduler *s)
{
    for (int r = 0; r < s->cfg.n_replicas; r++)
        s->reps[r].held = false;
    const request *prev = NULL;
    for (;;) {
        request *next = NULL;   /* the oldest unrouted request younger than prev */
        for (size_t i = 0; i < s->n_reqs; i++) {
            request *q = &s->reqs[i];
            if (q->replica < 0 && (!prev || q->order > prev->order) && (!next || q->order < next->order))
                next = q;
        }
        if (!next)
            return;
        prev = next;
        size_t need = blocks_for(s, next->prompt + next->max_tokens);
        int r = replica_takes(s, next->prefer, need) && !s->reps[next->prefer].held ? next->prefer
                                                                                     : best_replica(s, need);
        if (r >= 0) {
            if (r != next->prefer)
                next->cached = 0;
            next->replica = r;
            next->reserved = need;
            s->reps[r].reserved += need;
            continue;
        }
        bool open = false;   /* a replica a younger request might still take */
        for (int q = 0; q < s->cfg.n_replicas; q++) {
            replica *p = &s->reps[q];
            p->held |= need <= one_sequence_blocks(&p->cfg);
            open |= !p->held && !p->unavailable && !p->not_accepting;
        }
        if (!open)
            return;
    }
}

int sched_submit(scheduler *s, uint64_t id, size_t prompt_tokens, size_t max_tokens, int *replica_out,
                 strata_error *err)
{
    return sched_submit_prefix(s, id, prompt_tokens, max_tokens, -1, 0, replica_out, err);
}

int sched_submit_prefix(scheduler *s, uint64_t id, size_t prompt_tokens, size_t max_tokens, int prefer, size_t cached,
                        int *replica_out, strata_error *err)
{
    if (!s || prompt_tokens == 0 || max_tokens == 0)
        return strata_fail(err, STRATA_EINVAL, "scheduler: a request needs at least one prompt token and max_tokens >= 1");
    if (cached && (prefer < 0 || prefer >= s->cfg.n_replicas || cached >= prompt_tokens ||
                   cached % s->cfg.block_tokens))
        return strata_fail(err, STRATA_EINVAL, "scheduler: a cached prefix of %zu tokens on replica %d does not fit a "
                           "%zu-token prompt in %zu-token blocks", cached, prefer, prompt_tokens, s->cfg.block_tokens);
    if (find(s, id))
        return strata_fail(err, STRATA_EINVAL, "scheduler: request %" PRIu64 " already exists", id);
    if (max_tokens > SIZE_MAX / 2 - prompt_tokens || prompt_tokens > SIZE_MAX / 2)
        return strata_fail(err, STRATA_EINVAL, "scheduler: %zu prompt tokens + %zu max_tokens overflow", prompt_tokens,
                           max_tokens);
    size_t need = blocks_for(s, prompt_tokens + max_tokens);
    bool fits = false;
    size_t largest = 0;
    for (int r = 0; r < s->cfg.n_replicas; r++) {
        const sched_replica_config *c = &s->reps[r].cfg;
        size_t cap = one_sequence_blocks(c);
        fits |= need <= cap;
        largest = cap > largest ? cap : largest;
    }
    if (!fits) {
        s->rejected++;
        return strata_fail(err, STRATA_EFULL,
                           "the request needs up to %zu tokens of KV (%zu prompt + %zu max_tokens = %zu blocks of %zu "
                           "tokens) but a replica holds at most %zu blocks for one sequence",
                           prompt_tokens + max_tokens, prompt_tokens, max_tokens, need, s->cfg.block_tokens, largest);
    }
    if (s->n_reqs == s->cap_reqs) {
        size_t cap = s->cap_reqs ? s->cap_reqs * 2 : 64;
        request *grown = realloc(s->reqs, cap * sizeof *grown);
        if (!grown)
            return strata_fail(err, STRATA_ENOMEM, "scheduler: out of memory");
        s->reqs = grown;
        s->cap_reqs = cap;
    }
    s->reqs[s->n_reqs++] = (request){.id = id, .order = s->next_order++, .prompt = prompt_tokens,
                                     .max_tokens = max_tokens, .state = SCHED_WAITING, .replica = -1,
                                     .prefer = cached ? prefer : -1, .cached = cached};
    s->admitted++;
    route_pending(s);
    if (replica_out)
        *replica_out = find(s, id)->replica;
    return STRATA_OK;
}

static int push_free(replica *p, uint64_t id)
{
    if (p->n_pending_free == p->cap_pending_free) {
        size_t cap = p->cap_pending_free ? p->cap_pending_free * 2 : 16;
        uint64_t *grown = realloc(p->pending_free, cap * sizeof *grown);
        if (!grown)
            return STRATA_ENOMEM;
        p->pending_free = grown;
        p->cap_pending_free = cap;
    }
    p->pending_free[p->n_pending_free++] = id;
    return STRATA_OK;
}

/* Releases a request's reservation; sequences that reached a worker get freed there. */
static void release(scheduler *s, request *q)
{
    if (q->replica >= 0) {
        replica *p = &s->reps[q->replica];
        p->reserved -= q->reserved;
        q->reserved = 0;
        if (q->state == SCHED_RUNNING || q->state == SCHED_PREEMPTED)
            (void)push_free(p, q->id);   /* on ENOMEM the workers free it with the replica's next drain */
    }
    q->state = SCHED_FINISHED;
    s->finished++;
}

bool sched_finish(scheduler *s, uint64_t id)
{
    request *q = s ? find(s, id) : NULL;
    if (!q || q->state == SCHED_FINISHED)
        return false;
    bool routed = q->replica >= 0;
    release(s, q);
    if (!routed || !q->in_step) {
        /* Never planned into a step that is still out: forget it now. */
        *q = s->reqs[--s->n_reqs];
    }
    route_pending(s);
    return true;
}

static int plan_room(replica *p, size_t n)
{
    if (n <= p->cap_plan)
        return STRATA_OK;
    size_t cap = n * 2;
    sched_work *w = realloc(p->work, cap * sizeof *w);
    if (w)
        p->work = w;
    uint64_t *a = realloc(p->preempt, cap * sizeof *a);
    if (a)
        p->preempt = a;
    uint64_t *b = realloc(p->resume, cap * sizeof *b);
    if (b)
        p->resume = b;
    uint64_t *c = realloc(p->freed, cap * sizeof *c);
    if (c)
        p->freed = c;
    if (!w || !a || !b || !c)
        return STRATA_ENOMEM;
    p->cap_plan = cap;
    return STRATA_OK;
}

/* Requests of replica r in a state, in admission order (indices into s->reqs). */
static size_t collect(const scheduler *s, int r, sched_state st, size_t *idx)
{
    size_t n = 0;
    for (size_t i = 0; i < s->n_reqs; i++)
        if (s->reqs[i].replica == r && s->reqs[i].state == st)
            idx[n++] = i;
    for (size_t a = 1; a < n; a++)   /* insertion sort by order: n is small */
        for (size_t b = a; b > 0 && s->reqs[idx[b]].order < s->reqs[idx[b - 1]].order; b--) {
            size_t t = idx[b];
            idx[b] = idx[b - 1];
            idx[b - 1] = t;
        }
    return n;
}

/* Whether q's replica cannot start it now, as its new-prompt rule says: a sequence of its own
 * preempted (they come back first), max_seqs running, or no device room beside its running
 * sequences. */
static bool blocked_there(const scheduler *s, const request *q)
{
    const replica *p = &s->reps[q->replica];
    size_t working = 0, live = 0;
    for (size_t i = 0; i < s->n_reqs; i++) {
        const request *k = &s->reqs[i];
        if (k->replica != q->replica)
            continue;
        if (k->state == SCHED_PREEMPTED)
            return true;
        if (k->state == SCHED_RUNNING) {
            working += held_blocks(s, k);
            live++;
        }
    }
    return live + 1 > s->cfg.max_seqs || working + blocks_for(s, q->prompt + 1) > device_room(p, working == 0);
}

int sched_next_step(scheduler *s, int r, sched_plan *plan, strata_error *err)
{
    if (!s || !plan || r < 0 || r >= s->cfg.n_replicas)
        return strata_fail(err, STRATA_EINVAL, "scheduler: bad replica %d", r);
    memset(plan, 0, sizeof *plan);
    replica *p = &s->reps[r];
    if (p->unavailable)
        return STRATA_OK;   /* no workers to run it: an empty plan */
    if (p->outstanding >= p->depth)
        return strata_fail(err, STRATA_EINVAL, "scheduler: replica %d's step %" PRIu64 " has no results yet (%zu "
                           "step(s) out, at most %zu)", r, p->step, p->outstanding, p->depth);
    /* Forget what finished, unless a step still out holds it. */
    for (size_t i = 0; i < s->n_reqs;)
        if (s->reqs[i].state == SCHED_FINISHED && s->reqs[i].replica == r && !s->reqs[i].in_step)
            s->reqs[i] = s->reqs[--s->n_reqs];
        else
            i++;
    size_t *idx = malloc((s->n_reqs + 1) * sizeof *idx);
    if (!idx || plan_room(p, s->n_reqs + p->n_pending_free + 1) != STRATA_OK) {
        free(idx);
        return strata_fail(err, STRATA_ENOMEM, "scheduler: out of memory");
    }
    if (p->n_pending_free)
        memcpy(p->freed, p->pending_free, p->n_pending_free * sizeof *p->freed);
    plan->n_free = p->n_pending_free;
    p->n_pending_free = 0;

    /* Running sequences: those past their prompt decode one token each; those still prefilling
     * (chunked prefill) take their next chunk below. The device must hold the blocks of every
     * running sequence at once (those in steps still out included: the stages hold them too),
     * unless one sequence runs alone (streaming). */
    size_t n_run = collect(s, r, SCHED_RUNNING, idx), working = 0;
    for (size_t i = 0; i < n_run; i++)
        working += held_blocks(s, &s->reqs[idx[i]]);
    /* Preempt decoders, most recently admitted first (a prefilling sequence is never preempted:
     * its next work is a chunk, not a token; nor is one in a step still out), keeping at least one
     * sequence running, until the working set fits the device and the running count max_seqs (a
     * sequence moved here by a migration can take a replica past it). */
    for (size_t i = n_run; i-- > 0 && (working > p->cfg.device_blocks || n_run - plan->n_preempt > s->cfg.max_seqs);) {
        request *victim = &s->reqs[idx[i]];
        if (victim->len < victim->prompt || victim->in_step || n_run - plan->n_preempt <= 1)
            continue;
        working -= held_blocks(s, victim);
        victim->state = SCHED_PREEMPTED;
        p->preempt[plan->n_preempt++] = victim->id;
        p->preemptions++;
    }
    /* Sequences in steps still out grew meanwhile and cannot be preempted now: when they keep the
     * working set past the device, this step adds nothing (the next one preempts them). */
    size_t live = n_run - plan->n_preempt;
    const bool over = working > device_room(p, live == 1);
    /* With several steps out at once (pipeline stages each running one), the decoders are shared
     * among them so that every stage has a step to run. */
    const size_t depth = p->depth;
    size_t share = (live + depth - 1) / depth;
    share = share < s->cfg.max_seqs ? share : s->cfg.max_seqs;
    size_t n_work = 0, tokens = 0;
    for (size_t i = 0; i < n_run && !over; i++) {
        request *q = &s->reqs[idx[i]];
        if (q->state == SCHED_RUNNING && !q->in_step && q->len >= q->prompt && n_work < share) {
            p->work[n_work++] = (sched_work){.id = q->id, .pos0 = q->len, .n_tokens = 1, .sample = true};
            tokens++;
        }
    }
    /* Prompts already started continue, oldest first, with as large a chunk as the step's token
     * budget and the device allow. */
    for (size_t i = 0; i < n_run && !over; i++) {
        request *q = &s->reqs[idx[i]];
        if (q->state != SCHED_RUNNING || q->in_step || q->len >= q->prompt || n_work >= s->cfg.max_seqs)
            continue;
        size_t chunk = q->prompt - q->len, left = s->cfg.max_batch_tokens > tokens ? s->cfg.max_batch_tokens - tokens : 0;
        chunk = chunk < left ? chunk : left;
        const size_t others = working - held_blocks(s, q), room = device_room(p, others == 0);
        while (chunk > 0 && others + blocks_for(s, q->len + chunk + (q->len + chunk == q->prompt)) > room)
            chunk--;
        if (chunk == 0)
            continue;   /* it waits a step; its blocks stay counted */
        p->work[n_work++] = (sched_work){.id = q->id, .pos0 = q->len, .n_tokens = chunk,
                                         .sample = q->len + chunk == q->prompt};
        tokens += chunk;
    }
    /* Preempted sequences come back, oldest first, before any new prompt. */
    size_t n_pre = collect(s, r, SCHED_PREEMPTED, idx);
    bool blocked = over;
    for (size_t i = 0; i < n_pre && !blocked; i++) {
        request *q = &s->reqs[idx[i]];
        bool just_preempted = false;
        for (size_t k = 0; k < plan->n_preempt; k++)
            just_preempted |= p->preempt[k] == q->id;
        size_t need = blocks_for(s, q->len + 1);
        if (just_preempted || working + need > device_room(p, working == 0) || live + 1 > s->cfg.max_seqs ||
            tokens + 1 > s->cfg.max_batch_tokens) {
            blocked = true;
            break;
        }
        q->state = SCHED_RUNNING;
        p->resume[plan->n_resume++] = q->id;
        p->resumptions++;
        p->work[n_work++] = (sched_work){.id = q->id, .pos0 = q->len, .n_tokens = 1, .sample = true};
        working += need;
        tokens++;
        live++;
    }
    /* New prompts, FIFO. A prompt starts when the step can give it a first chunk of at least
     * min(prompt, max_batch_tokens / 2) tokens (the first chunk is the exact prefill; later ones
     * continue it); the rest follows in later steps. A prompt with a cached prefix starts after
     * it (its first chunk copies the prefix, then runs as a later chunk would). */
    size_t n_wait = blocked ? 0 : collect(s, r, SCHED_WAITING, idx);
    /* Routing is by reserved blocks, not by load: a replica with nothing of its own waiting takes
     * the oldest request waiting on another (available) replica that cannot start it now and that
     * it can start in this very step (a reservation move). One with a cached prefix there moves
     * too and starts from 0: the prefix saves a part of its prefill, while waiting for the other
     * replica's long sequences to end has no bound, and this one idles. */
    if (!blocked && n_wait == 0 && !p->not_accepting && !p->unavailable) {
        request *oldest = NULL;
        for (size_t i = 0; i < s->n_reqs; i++) {
            request *q = &s->reqs[i];
            if (q->state == SCHED_WAITING && q->replica >= 0 && q->replica != r && !q->in_step &&
                !s->reps[q->replica].unavailable && (!oldest || q->order < oldest->order))
                oldest = q;
        }
        if (oldest && !blocked_there(s, oldest))
            oldest = NULL;   /* its replica starts it itself: routing stays least-loaded */
        if (oldest) {
            const size_t rest = oldest->prompt, left = s->cfg.max_batch_tokens > tokens ? s->cfg.max_batch_tokens - tokens : 0;
            size_t least = s->cfg.max_batch_tokens / 2 ? s->cfg.max_batch_tokens / 2 : 1;
            least = rest < least ? rest : least;
            const size_t need = blocks_for(s, oldest->prompt + 1);
            if ((rest < left ? rest : left) >= least && live + 1 <= s->cfg.max_seqs &&
                working + need <= device_room(p, working == 0) && oldest->reserved <= one_sequence_blocks(&p->cfg) &&
                oldest->reserved <= p->cfg.total_blocks - p->reserved) {
                s->reps[oldest->replica].reserved -= oldest->reserved;
                p->reserved += oldest->reserved;
                oldest->replica = r;
                oldest->cached = 0;
                n_wait = collect(s, r, SCHED_WAITING, idx);
            }
        }
    }
    for (size_t i = 0; i < n_wait; i++) {
        request *q = &s->reqs[idx[i]];
        const size_t start = q->replica == q->prefer ? q->cached : 0, rest = q->prompt - start;
        size_t left = s->cfg.max_batch_tokens > tokens ? s->cfg.max_batch_tokens - tokens : 0;
        size_t chunk = rest < left ? rest : left;
        size_t least = s->cfg.max_batch_tokens / 2 ? s->cfg.max_batch_tokens / 2 : 1;
        least = rest < least ? rest : least;
        size_t need = blocks_for(s, q->prompt + 1);   /* the whole prompt (held_blocks) */
        if (chunk < least || live + 1 > s->cfg.max_seqs || working + need > device_room(p, working == 0))
            break;
        q->state = SCHED_RUNNING;
        q->len = start;
        p->work[n_work++] = (sched_work){.id = q->id, .pos0 = start, .n_tokens = chunk,
                                         .sample = start + chunk == q->prompt};
        working += need;
        tokens += chunk;
        live++;
    }
    free(idx);
    if (n_work || plan->n_preempt || plan->n_free) {
        plan->step = ++p->step;
        p->out_steps[p->outstanding++] = plan->step;
    }
    for (size_t i = 0; i < n_work; i++) {
        request *q = find(s, p->work[i].id);
        q->in_step = plan->step;
        q->step_tokens = p->work[i].n_tokens;
        q->step_sample = p->work[i].sample;
    }
    plan->work = p->work;
    plan->n_work = n_work;
    plan->n_tokens = tokens;
    plan->preempt_ids = p->preempt;
    plan->resume_ids = p->resume;
    plan->free_ids = p->freed;
    return STRATA_OK;
}

int sched_step_done(scheduler *s, int r, uint64_t step, const sched_outcome *out, size_t n, strata_error *err)
{
    if (!s || r < 0 || r >= s->cfg.n_replicas || (n && !out))
        return strata_fail(err, STRATA_EINVAL, "scheduler: bad step results");
    if (step == 0 && n == 0)
        return STRATA_OK;   /* an empty plan: nothing went out */
    replica *p = &s->reps[r];
    size_t k = 0;
    while (k < p->outstanding && p->out_steps[k] != step)
        k++;
    if (k == p->outstanding)
        return strata_fail(err, STRATA_EINVAL, "scheduler: replica %d has no step %" PRIu64 " out", r, step);
    p->out_steps[k] = p->out_steps[--p->outstanding];
    int rc = STRATA_OK;
    for (size_t i = 0; i < n; i++) {
        request *q = find(s, out[i].id);
        if (!q || q->replica != r)
            continue;   /* finished and forgotten meanwhile */
        if (q->in_step != step) {
            if (q->state != SCHED_FINISHED)
                rc = strata_fail(err, STRATA_EINVAL, "scheduler: request %" PRIu64 " was not in replica %d's step %" PRIu64,
                                 q->id, r, step);
            continue;
        }
        q->in_step = 0;
        if (q->state == SCHED_FINISHED)
            continue;
        q->len += q->step_tokens;
        q->generated += q->step_sample;
        if (out[i].finished || q->generated >= q->max_tokens)
            release(s, q);
    }
    for (size_t i = 0; i < s->n_reqs; i++)
        if (s->reqs[i].replica == r && s->reqs[i].in_step == step) {
            s->reqs[i].in_step = 0;   /* missing from the results: treat as failed */
            if (s->reqs[i].state != SCHED_FINISHED)
                release(s, &s->reqs[i]);
            if (rc == STRATA_OK)
                rc = strata_fail(err, STRATA_EINVAL, "scheduler: no result for request %" PRIu64 " of replica %d",
                                 s->reqs[i].id, r);
        }
    route_pending(s);
    return rc;
}

void sched_get_stats(const scheduler *s, int r, sched_stats *out)
{
    memset(out, 0, sizeof *out);
    if (!s)
        return;
    for (size_t i = 0; i < s->n_reqs; i++) {
        const request *q = &s->reqs[i];
        if (r >= 0 && q->replica != r)
            continue;
        out->waiting += q->state == SCHED_WAITING;
        out->running += q->state == SCHED_RUNNING;
        out->preempted += q->state == SCHED_PREEMPTED;
    }
    for (int k = 0; k < s->cfg.n_replicas; k++)
        if (r < 0 || k == r) {
            out->reserved_blocks += s->reps[k].reserved;
            out->preemptions += s->reps[k].preemptions;
            out->resumptions += s->reps[k].resumptions;
        }
    out->admitted = s->admitted;
    out->rejected = s->rejected;
    out->finished = s->finished;
}

bool sched_is_prefilling(const scheduler *s, uint64_t id)
{
    const request *q = s ? find(s, id) : NULL;
    return q && q->state == SCHED_RUNNING && q->len < q->prompt;
}

sched_state sched_get_state(const scheduler *s, uint64_t id)
{
    const request *q = s ? find(s, id) : NULL;
    return q ? q->state : (sched_state)0;
}

void sched_set_available(scheduler *s, int r, bool available)
{
    if (!s || r < 0 || r >= s->cfg.n_replicas)
        return;
    replica *p = &s->reps[r];
    p->unavailable = !available;
    if (!available) {
        p->n_pending_free = 0;
        p->outstanding = 0;
        for (size_t i = 0; i < s->n_reqs;) {
            request *q = &s->reqs[i];
            if (q->replica == r)
                q->in_step = 0;
            if (q->replica == r && q->state == SCHED_FINISHED)
                *q = s->reqs[--s->n_reqs];
            else
                i++;
        }
    }
    route_pending(s);
}

bool sched_is_available(const scheduler *s, int r)
{
    return s && r >= 0 && r < s->cfg.n_replicas && !s->reps[r].unavailable;
}

bool sched_is_accepting(const scheduler *s, int r)
{
    return sched_is_available(s, r) && !s->reps[r].not_accepting;
}

int sched_get_replica(const scheduler *s, uint64_t id)
{
    const request *q = s ? find(s, id) : NULL;
    return q ? q->replica : -1;
}

int sched_set_steps_in_flight(scheduler *s, int r, size_t depth)
{
    if (!s || r < 0 || r >= s->cfg.n_replicas || depth > s->cfg.max_steps_in_flight)
        return STRATA_EINVAL;
    s->reps[r].depth = depth ? depth : s->cfg.max_steps_in_flight;
    return STRATA_OK;
}

size_t sched_steps_in_flight(const scheduler *s, int r)
{
    return s && r >= 0 && r < s->cfg.n_replicas ? s->reps[r].depth : 0;
}

void sched_set_accepting(scheduler *s, int r, bool accepting)
{
    if (!s || r < 0 || r >= s->cfg.n_replicas)
        return;
    s->reps[r].not_accepting = !accepting;
    route_pending(s);
}

int sched_move(scheduler *s, uint64_t id, int to, strata_error *err)
{
    request *q = s ? find(s, id) : NULL;
    if (!q || to < 0 || to >= s->cfg.n_replicas)
        return strata_fail(err, STRATA_EINVAL, "scheduler: no request %" PRIu64 " or no replica %d", id, to);
    if (q->replica < 0 || q->in_step || (q->state != SCHED_WAITING && q->state != SCHED_RUNNING) ||
        (q->state == SCHED_RUNNING && q->len < q->prompt))
        return strata_fail(err, STRATA_EINVAL, "scheduler: request %" PRIu64 " cannot move now (%s)", id,
                           q->in_step ? "in a step" : q->replica < 0 ? "not routed"
                           : q->state == SCHED_RUNNING ? "its prompt is still being prefilled" : "preempted or finished");
    if (q->replica == to)
        return STRATA_OK;
    replica *dst = &s->reps[to];
    if (dst->unavailable)
        return strata_fail(err, STRATA_EINVAL, "scheduler: replica %d is unavailable (its workers are gone)", to);
    if (q->reserved > one_sequence_blocks(&dst->cfg))
        return strata_fail(err, STRATA_EFULL, "scheduler: replica %d holds at most %zu blocks for one sequence; request %" PRIu64
                           " needs %zu", to, one_sequence_blocks(&dst->cfg), id, q->reserved);
    if (dst->cfg.total_blocks - dst->reserved < q->reserved)
        return strata_fail(err, STRATA_EFULL, "scheduler: replica %d has %zu free blocks; request %" PRIu64 " needs %zu",
                           to, dst->cfg.total_blocks - dst->reserved, id, q->reserved);
    if (q->prefer != to)
        q->cached = 0;   /* its prefix stays behind (a refused move keeps it) */
    s->reps[q->replica].reserved -= q->reserved;
    dst->reserved += q->reserved;
    q->replica = to;
    route_pending(s);
    return STRATA_OK;
}

bool sched_drop_prefix(scheduler *s, uint64_t id)
{
    request *q = s ? find(s, id) : NULL;
    if (!q || q->state != SCHED_WAITING || !q->cached)
        return false;
    q->cached = 0;
    q->prefer = -1;
    return true;
}

int sched_free_on(scheduler *s, int r, uint64_t id)
{
    if (!s || r < 0 || r >= s->cfg.n_replicas)
        return STRATA_EINVAL;
    return push_free(&s->reps[r], id);
}
