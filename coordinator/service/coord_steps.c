/* The coordinator (coord_internal.h): steps planned, sent and finished; the step thread. */
#include "coordinator/service/coord_internal.h"

/* ---- steps ---- */

static bool is_stop_id(const Strata__V1__SamplingParams *sp, uint32_t tok)
{
    for (size_t i = 0; sp && i < sp->n_stop_token_ids; i++)
        if (sp->stop_token_ids[i] == tok)
            return true;
    return false;
}

/* One sampled token of q: stream it; returns true when q ended (the terminal call was made). */
static bool deliver(coord *c, creq *q, uint32_t tok)
{
    const Strata__V1__SamplingParams *sp = q->req->sampling;
    double t = strata_mono_s();
    if (c->have_metrics)
        metrics_histogram_observe(q->n_generated == 0 ? c->m.ttft : c->m.itl,
                                  q->n_generated == 0 ? t - q->t_accept : t - q->t_last);
    q->t_last = t;
    /* The sampled ids, for a recovery and a prefix entry; out of memory, the request just cannot
     * be recovered and leaves no entry. */
    if ((q->generated || q->n_generated == 0) && q->n_generated == q->cap_generated) {
        size_t cap = q->cap_generated ? q->cap_generated * 2 : 64;
        int32_t *grown = realloc(q->generated, cap * sizeof *grown);
        if (!grown)
            free(q->generated);
        q->generated = grown;
        q->cap_generated = grown ? cap : 0;
    }
    if (q->generated)
        q->generated[q->n_generated] = (int32_t)tok;
    q->n_generated++;
    q->last_token = tok;
    c->tokens_total++;
    if (c->have_metrics)
        metrics_counter_inc(c->m.tokens);
    bool eog = !(sp && sp->ignore_eos) && tokenizer_is_eog(c->tok, (int32_t)tok);
    bool stop_id = is_stop_id(sp, tok);
    strata_error err = {0};
    if (tokenizer_is_text(c->tok, (int32_t)tok)) {
        size_t len;
        const char *bytes = tokenizer_token_bytes(c->tok, (int32_t)tok, &len);
        /* U+0000 is left out of the text: the chunk's string would end at it (protobuf-c strings
         * are NUL-terminated) and lose what follows; token_ids still carry the token. */
        for (size_t at = 0, end; bytes && at < len; at = end + 1) {
            const char *nul = memchr(bytes + at, 0, len - at);
            end = nul ? (size_t)(nul - bytes) : len;
            if (end > at && text_stream_push(&q->ts, bytes + at, end - at, &err) != STRATA_OK) {
                coord_fail_req(c, q, err.code, err.msg);
                return true;
            }
        }
    }
    const char *text;
    size_t len;
    bool stopped = false;
    text_stream_take(&q->ts, &text, &len, &stopped);
    (void)api_stream_send_chunk(q->stream, &tok, 1, text, len);   /* a failed send brings cancel */
    Strata__V1__FinishReason why = STRATA__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED;
    if (stopped || eog || stop_id)
        why = STRATA__V1__FINISH_REASON__FINISH_REASON_STOP;
    else if (q->n_generated >= sp->max_tokens || q->n_prompt + q->n_generated >= c->cfg.ctx)
        why = STRATA__V1__FINISH_REASON__FINISH_REASON_LENGTH;
    if (why == STRATA__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED)
        return false;
    if (!stopped) {
        text_stream_finish(&q->ts, &text, &len);   /* held-back text that never became a stop */
        if (len)
            (void)api_stream_send_chunk(q->stream, NULL, 0, text, len);
    }
    api_stream_complete(q->stream, why, (uint32_t)q->n_prompt, (uint32_t)q->n_generated,
                        (uint32_t)coord_prompt_cached(q, q->cached));
    coord_count_finish(c, why == STRATA__V1__FINISH_REASON__FINISH_REASON_STOP ? FIN_STOP : FIN_LENGTH);
    if (q->generated)
        coord_offer_prefix(c, q, sched_get_replica(c->sched, q->id));
    coord_drop_req(c, q);
    return true;
}

/* Every stage answered replica r's step flights[k]: stream the tokens, fail the failed, tell the
 * scheduler, and take the step off the flights. */
void coord_finish_step(coord *c, uint32_t r, uint32_t k)
{
    creplica *rp = &c->reps[r];
    flight *f = &rp->flights[k];
    sched_outcome *out = f->outcomes;
    for (size_t w = 0; w < f->n_work; w++) {
        creq *q = coord_find_by_id(c, f->works[w].seq_id);
        bool ended = true;
        if (f->status[w] != 0 && f->prefix_failed[w] && f->works[w].prefix_entry)
            coord_lose_prefix(c, f->works[w].prefix_entry);   /* a worker lacks it: never again */
        if (f->status[w] == 0 && f->works[w].prefix_entry) {
            const size_t hit = q ? coord_prompt_cached(q, f->works[w].pos0) : 0;
            c->prefix_hits++;
            c->prefix_hit_tokens += hit;
            if (c->have_metrics) {
                metrics_counter_inc(c->m.prefix_hits);
                metrics_counter_add(c->m.prefix_hit_tokens, hit);
            }
        }
        if (q && f->status[w] != 0 && f->prefix_failed[w] && f->works[w].prefix_entry &&
            coord_restart_whole(c, q, f->message[w])) {
            /* The copy was an optimization: the request starts over as a new sequence, prefilled
             * whole, and the client never sees the failure. Its old sequence ends below. */
        } else if (q && f->status[w] != 0 && coord_kv_fault(f->status[w]) && coord_may_recover(c, q) &&
                   coord_recover(c, q, f->message[w])) {
            /* Its KV is damaged: it goes on as a new sequence; the old one ends below. */
        } else if (q && f->status[w] != 0) {
            coord_logf(c, "request %s failed: %s", api_stream_request_id(q->stream), f->message[w]);
            coord_end_failed(c, q, f->status[w], f->message[w]);   /* the step's outcome ends its sequence */
        } else if (q && !f->works[w].sample) {
            ended = false;   /* a prompt chunk ran; the next one (or the token) comes later */
        } else if (q && !f->sampled[w]) {
            coord_end_failed(c, q, STRATA_EIO, "the last stage returned no token for this request");
        } else if (q) {
            ended = deliver(c, q, f->tokens[w]);
        }
        out[w] = (sched_outcome){.id = f->works[w].seq_id, .finished = ended};
    }
    strata_error err = {0};
    if (sched_step_done(c->sched, (int)r, f->step, out, f->n_work, &err) != STRATA_OK)
        coord_logf(c, "replica %u step %" PRIu64 ": %s", r, f->step, err.msg);
    /* The last flight takes this one's place (their arrays are swapped, not copied). */
    flight done = *f;
    *f = rp->flights[--rp->n_flights];
    rp->flights[rp->n_flights] = done;
    pthread_cond_signal(&c->wake);
}

/* How many steps replica r may have out: one per stage, but one while it is being drained (set
 * by the drain), so that it has moments with none out in which a running sequence can migrate. */
static uint32_t max_flights(const coord *c, uint32_t r)
{
    return (uint32_t)sched_steps_in_flight(c->sched, (int)r);
}

/* Plans and sends replica r's next step (it has fewer than max_flights out); false when there
 * was nothing to do. */
bool coord_start_step(coord *c, uint32_t r)
{
    creplica *rp = &c->reps[r];
    flight *f = &rp->flights[rp->n_flights];
    sched_plan plan;
    strata_error err = {0};
    if (sched_next_step(c->sched, (int)r, &plan, &err) != STRATA_OK) {
        coord_logf(c, "replica %u: %s", r, err.msg);
        return false;
    }
    if (plan.step == 0)
        return false;
    Strata__Internal__V1__SeqWork *works = f->works, **wp = f->work_ptrs;
    uint32_t *toks = f->plan_tokens;
    size_t at = 0;
    for (size_t i = 0; i < plan.n_work; i++) {
        const sched_work *sw = &plan.work[i];
        creq *q = coord_find_by_id(c, sw->id);
        Strata__Internal__V1__SeqWork *w = &works[i];
        strata__internal__v1__seq_work__init(w);
        w->seq_id = sw->id;
        w->pos0 = (uint32_t)sw->pos0;
        w->tokens = toks + at;
        w->n_tokens = sw->n_tokens;
        if (!q->started) {   /* its first step: from its prefix entry when the scheduler kept it */
            q->started = true;
            q->cached = sw->pos0;
            if (sw->pos0 > 0)   /* counted as a hit once the copy succeeded (coord_finish_step) */
                w->prefix_entry = q->prefix_entry;
        }
        if (sw->pos0 < q->n_input) {   /* a prompt chunk (the whole prompt when it fits a step) */
            for (size_t k = 0, pos = sw->pos0; k < sw->n_tokens; k++, pos++)
                toks[at + k] = (uint32_t)(pos < q->n_prompt ? q->prompt[pos] : q->generated[pos - q->n_prompt]);
            w->last_chunk_of_prompt = sw->pos0 + sw->n_tokens == q->n_input;
            if (sw->pos0 == 0 && q->plan > 0)
                w->kv_plan = c->plan_names[q->plan];
        } else {
            toks[at] = q->last_token;
        }
        w->sample = sw->sample;
        const Strata__V1__SamplingParams *sp = q->req->sampling;
        w->temperature = sp->temperature;
        w->top_p = sp->top_p;
        w->top_k = sp->top_k;
        w->seed = sp->seed;
        w->sampled_before = sw->sample ? q->sampled_before : 0;
        at += sw->n_tokens;
        wp[i] = w;
        f->status[i] = 0;
        f->prefix_failed[i] = false;
        f->sampled[i] = false;
        f->message[i][0] = '\0';
    }
    Strata__Internal__V1__StepPlan sp = STRATA__INTERNAL__V1__STEP_PLAN__INIT;
    sp.step = plan.step;
    sp.n_seqs = plan.n_work;
    sp.seqs = wp;
    sp.n_free_seqs = plan.n_free;
    sp.free_seqs = (uint64_t *)plan.free_ids;
    sp.n_preempt_seqs = plan.n_preempt;
    sp.preempt_seqs = (uint64_t *)plan.preempt_ids;
    sp.n_resume_seqs = plan.n_resume;
    sp.resume_seqs = (uint64_t *)plan.resume_ids;
    for (size_t i = 0; i < rp->n_parks; i++)
        rp->park_ptrs[i] = &rp->parks[i];
    sp.n_park_prefixes = rp->n_parks;
    sp.park_prefixes = rp->park_ptrs;
    rp->n_parks = 0;
    if (c->prefixes) {
        size_t want = prefix_index_pending_drops(c->prefixes, (int)r);
        if (want > rp->cap_drops) {
            uint64_t *grown = realloc(rp->drops, want * sizeof *grown);
            if (grown) {
                rp->drops = grown;
                rp->cap_drops = want;
            }
        }
        sp.n_drop_prefixes = prefix_index_take_drops(c->prefixes, (int)r, rp->drops, rp->cap_drops);   /* the rest later */
        sp.drop_prefixes = rp->drops;
    }
    Strata__Internal__V1__CoordinatorMessage m = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__INIT;
    m.kind_case = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_STEP_PLAN;
    m.step_plan = &sp;
    f->step = plan.step;
    f->t_sent = strata_mono_s();
    f->overdue = false;
    rp->last_step = plan.step;
    f->n_work = plan.n_work;
    f->answers = 0;
    f->answered = 0;
    rp->n_flights++;
    char what[64];
    snprintf(what, sizeof what, "replica %u step %" PRIu64, r, plan.step);
    /* After a failed send coord_on_gone tears the replica down, and its requests end with the reason. */
    for (uint32_t s = 0; s < c->cfg.stages; s++)
        coord_send_or_end(c, rp->stages[s].peer, rp->stages[s].name, &m, what);
    /* The entries its new sequences copy went out with the plan (before any later drop). */
    for (size_t i = 0; i < plan.n_work; i++) {
        creq *q = coord_find_by_id(c, plan.work[i].id);
        if (q && q->pinned) {
            prefix_index_unpin(c->prefixes, q->prefix_entry);
            q->pinned = false;
        }
    }
    return true;
}

/* step_timeout_ms: the workers that owe an answer to a step or a migration sent longer ago are
 * ended (each once); coord_on_gone then tears their replicas down as for lost workers. Keepalive does
 * not notice a worker whose process is alive but stuck (a hung device, a deadlock). */
static void end_overdue(coord *c)
{
    const double limit = c->cfg.step_timeout_ms / 1e3, now = strata_mono_s();
    char msg[512];
    for (uint32_t r = 0; r < c->cfg.replicas; r++) {
        creplica *rp = &c->reps[r];
        for (uint32_t k = 0; !rp->tearing_down && k < rp->n_flights; k++) {
            flight *f = &rp->flights[k];
            if (f->overdue || now - f->t_sent < limit)
                continue;
            f->overdue = true;
            for (uint32_t s = 0; s < c->cfg.stages; s++)
                if (!(f->answered >> s & 1) && rp->stages[s].peer) {
                    snprintf(msg, sizeof msg, "no answer to step %" PRIu64 " in %.3g s (a hung worker, or a step "
                             "longer than the step timeout)", f->step, limit);
                    coord_end_worker(c, r, s, msg);
                }
        }
    }
    migration *mg = &c->mig;
    if (mg->active && mg->sent && !mg->overdue && now - mg->t_sent >= limit) {
        mg->overdue = true;
        const uint32_t both[2] = {mg->from, mg->to};
        for (int i = 0; i < 2; i++)
            for (uint32_t s = 0; s < c->cfg.stages; s++)
                if (c->reps[both[i]].stages[s].migrates_pending && c->reps[both[i]].stages[s].peer) {
                    snprintf(msg, sizeof msg, "no answer to the migration of sequence %" PRIu64 " in %.3g s", mg->seq,
                             limit);
                    coord_end_worker(c, both[i], s, msg);
                }
    }
}

void *coord_step_thread(void *arg)
{
    coord *c = arg;
    pthread_mutex_lock(&c->mu);
    while (!c->stopping) {
        bool started = false;
        coord_migration_kick(c);
        coord_drain_progress(c);
        for (uint32_t r = 0; r < c->cfg.replicas; r++)
            if (c->reps[r].serving && c->reps[r].n_flights < max_flights(c, r) &&
                !(c->mig.active && (r == c->mig.from || r == c->mig.to)))
                started |= coord_start_step(c, r);
        if (c->cfg.step_timeout_ms)
            end_overdue(c);
        coord_expire_orphans(c);
        if (started)
            continue;
        if (!c->cfg.step_timeout_ms && !c->orphaned_since) {
            pthread_cond_wait(&c->wake, &c->mu);
        } else {   /* looks again at least 4 times per timeout or wait, at most once per 10 ms */
            uint32_t tick = c->cfg.step_timeout_ms ? c->cfg.step_timeout_ms / 4 : 1000;
            if (c->orphaned_since && c->cfg.recovery_wait_ms / 4 < tick)
                tick = c->cfg.recovery_wait_ms / 4;
            const struct timespec until = strata_realtime_after_ms(tick < 10 ? 10 : tick > 1000 ? 1000 : (int)tick);
            (void)pthread_cond_timedwait(&c->wake, &c->mu, &until);
        }
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}
