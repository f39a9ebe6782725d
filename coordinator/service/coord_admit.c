/* The coordinator (coord_internal.h): a request's sequence handed to the scheduler, and recovery. */
#include "coordinator/service/coord_internal.h"

/* ---- admission ---- */

/* Of the first `cached` input tokens q's sequence took from a prefix entry, those of its prompt
 * (a recovered request's input goes on with its sampled tokens, which an entry may hold too). */
size_t coord_prompt_cached(const creq *q, size_t cached)
{
    return cached < q->n_prompt ? cached : q->n_prompt;
}

/* Hands q's sequence (q->id, its q->n_input tokens: the prompt, then after a recovery the tokens
 * sampled before) to the scheduler, to sample the tokens it may still sample. With prefix caching
 * it starts after the longest cached prefix of that input on a serving replica, the entry pinned
 * until its first step goes out (coord_start_step) or it ends. */
int coord_submit_seq(coord *c, creq *q, strata_error *err)
{
    const size_t max_tokens = q->req->sampling->max_tokens - q->n_generated;
    prefix_hit hit = {0};
    q->pinned = false;
    q->prefix_entry = 0;
    if (c->prefixes && c->prefix_row_bytes[q->plan]) {
        /* Out of memory for the joined ids, only the prompt is looked up: a shorter hit, if any. */
        int32_t *joined = q->n_input > q->n_prompt ? malloc(q->n_input * sizeof *joined) : NULL;
        if (joined) {
            memcpy(joined, q->prompt, q->n_prompt * sizeof *joined);
            memcpy(joined + q->n_prompt, q->generated, (q->n_input - q->n_prompt) * sizeof *joined);
        }
        for (uint32_t r = 0; r < c->cfg.replicas; r++)
            c->prefix_usable[r] = c->reps[r].serving && !c->reps[r].tearing_down &&
                                  sched_is_accepting(c->sched, (int)r);   /* not one being drained */
        if (prefix_index_lookup(c->prefixes, q->plan, joined ? joined : q->prompt, joined ? q->n_input : q->n_prompt,
                                c->prefix_usable, &hit))
            q->pinned = prefix_index_pin(c->prefixes, hit.entry, hit.n_tokens);
        free(joined);
        q->prefix_entry = q->pinned ? hit.entry : 0;
    }
    int rc = q->pinned ? sched_submit_prefix(c->sched, q->id, q->n_input, max_tokens, hit.replica, hit.n_tokens, NULL, err)
                       : sched_submit(c->sched, q->id, q->n_input, max_tokens, NULL, err);
    if (rc != STRATA_OK && q->pinned) {
        prefix_index_unpin(c->prefixes, q->prefix_entry);
        q->pinned = false;
        q->prefix_entry = 0;
    }
    return rc;
}

/* ---- recovery ---- */

/* q goes back to the scheduler under a new sequence id, its prompt and every token it sampled
 * so far to be prefilled (after a cached prefix of them, when one is on a serving replica), to sample the rest of its tokens; the caller has
 * finished (or finishes) its old id, so that the workers free what they made of it. The stream
 * and what it sent stay. False, with the reason in err, when the scheduler refuses it. */
static bool resubmit(coord *c, creq *q, strata_error *err)
{
    if (q->n_generated && !q->generated)
        return strata_fail(err, STRATA_ENOMEM, "out of memory for its sampled tokens"), false;
    const uint64_t old = q->id;
    if (q->pinned) {
        prefix_index_unpin(c->prefixes, q->prefix_entry);
        q->pinned = false;
    }
    q->id = ++c->next_seq_id;
    q->started = false;
    q->cached = 0;
    q->n_input = q->n_prompt + q->n_generated;
    q->sampled_before = q->n_generated;
    if (coord_submit_seq(c, q, err) != STRATA_OK) {
        q->id = old;
        return false;
    }
    return true;
}

/* A request whose first step, a copy of its prefix entry, failed on a worker (the entry's park
 * failed there: out of host memory) starts over, prefilled whole. False (the caller fails the
 * request) when the scheduler refuses it. */
bool coord_restart_whole(coord *c, creq *q, const char *why)
{
    strata_error err = {0};
    if (!resubmit(c, q, &err)) {
        coord_logf(c, "request %s: its prefix copy failed (%s) and it cannot start over: %s",
                   api_stream_request_id(q->stream), why, err.msg);
        return false;
    }
    coord_logf(c, "request %s: its prefix copy failed (%s); prefilling it whole", api_stream_request_id(q->stream), why);
    return true;
}

/* A worker's status for a sequence whose KV blocks could not be moved between tiers, read back
 * or verified (coord_worker_failure_status's codes): its KV is damaged, its tokens are not. */
bool coord_kv_fault(int status)
{
    return status == STRATA_EIO || status == STRATA_ECRC;
}

/* Whether q, whose KV is lost (its replica, or a block a worker could not move or read back),
 * may go on from its tokens: it had none to lose yet, or it has recoveries left. */
bool coord_may_recover(const coord *c, const creq *q)
{
    return !q->started || q->recoveries < c->cfg.max_recoveries;
}

/* q's KV is lost (why): it goes on from its tokens (resubmit), its client seeing only a pause;
 * false (the caller fails it) when it cannot. Its old id must be finished (sched_finish, or the
 * step outcome that ends it). */
bool coord_recover(coord *c, creq *q, const char *why)
{
    const bool had_kv = q->started;
    const size_t tokens = q->n_prompt + q->n_generated;
    strata_error err = {0};
    if (!resubmit(c, q, &err)) {
        coord_logf(c, "request %s: %s; it cannot go on: %s", api_stream_request_id(q->stream), why, err.msg);
        return false;
    }
    if (!had_kv)
        return true;   /* only re-routed: nothing was computed, nothing is recomputed */
    q->recoveries++;
    c->recovered_total++;
    if (c->have_metrics)
        metrics_counter_inc(c->m.recovered);
    coord_logf(c, "request %s: %s; it goes on from its %zu tokens (%zu sampled), recomputing their KV (recovery %u of %u)",
               api_stream_request_id(q->stream), why, tokens, q->n_generated, q->recoveries, c->cfg.max_recoveries);
    return true;
}
