/* The coordinator (coord_internal.h): migration between replicas, and drains. */
#include "coordinator/service/coord_internal.h"

/* ---- migration and drain ---- */

static void send_migrate(coord *c, uint32_t r, uint32_t s, uint32_t peer_r, bool send)
{
    Strata__Internal__V1__Migrate mg = STRATA__INTERNAL__V1__MIGRATE__INIT;
    mg.seq_id = c->mig.seq;
    mg.peer_data_addr = c->reps[peer_r].stages[s].data_addr;
    mg.send = send;
    Strata__Internal__V1__CoordinatorMessage m = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__INIT;
    m.kind_case = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_MIGRATE;
    m.migrate = &mg;
    c->reps[r].stages[s].migrates_pending++;
    coord_send_or_end(c, c->reps[r].stages[s].peer, c->reps[r].stages[s].name, &m, "migrate");
}

/* Sends the Migrate pairs once neither replica has a step out (receivers first: they wait). */
void coord_migration_kick(coord *c)
{
    migration *mg = &c->mig;
    if (!mg->active || mg->sent || c->reps[mg->from].n_flights || c->reps[mg->to].n_flights)
        return;
    for (uint32_t s = 0; s < c->cfg.stages; s++)
        send_migrate(c, mg->to, s, mg->from, false);
    for (uint32_t s = 0; s < c->cfg.stages; s++)
        send_migrate(c, mg->from, s, mg->to, true);
    mg->sent = true;
    mg->t_sent = strata_mono_s();
    mg->overdue = false;
}

static void migration_start(coord *c, uint64_t seq, uint32_t from, uint32_t to)
{
    migration *mg = &c->mig;
    mg->active = true;
    mg->sent = false;
    mg->seq = seq;
    mg->from = from;
    mg->to = to;
    mg->answers = 0;
    mg->why[0] = '\0';
    memset(mg->send_ok, 0, c->cfg.stages * sizeof *mg->send_ok);
    memset(mg->recv_ok, 0, c->cfg.stages * sizeof *mg->recv_ok);
    /* Nothing new is routed to `to` while the blocks travel: its room, checked by move_target,
     * must still be there at the commit (it runs no step meanwhile anyway). */
    sched_set_accepting(c->sched, (int)to, false);
    coord_migration_kick(c);
}

/* Every MigrateDone is in: commit the move, or undo what can be undone. */
static void migration_finish(coord *c)
{
    migration *mg = &c->mig;
    bool all = true, any_moved = false;
    for (uint32_t s = 0; s < c->cfg.stages; s++) {
        all &= mg->send_ok[s] && mg->recv_ok[s];
        any_moved |= mg->send_ok[s];
    }
    creq *q = coord_find_by_id(c, mg->seq);
    strata_error err = {0};
    if (all && q && sched_move(c->sched, mg->seq, (int)mg->to, &err) == STRATA_OK) {
        c->drain.moved += c->drain.active;
        coord_logf(c, "request %s moved from replica %u to %u", api_stream_request_id(q->stream), mg->from, mg->to);
    } else {
        if (all && q)
            snprintf(mg->why, sizeof mg->why, "%s", err.msg);
        /* Copies the receivers hold are freed there; the senders kept theirs unless they moved. */
        for (uint32_t s = 0; s < c->cfg.stages; s++)
            if (mg->recv_ok[s]) {
                (void)sched_free_on(c->sched, (int)mg->to, mg->seq);
                break;
            }
        c->drain.failed += c->drain.active && q;
        if (q && any_moved) {   /* part of its layers left: it cannot go on anywhere */
            char msg[700];
            snprintf(msg, sizeof msg, "migration failed half way: %s", mg->why);
            coord_fail_req(c, q, STRATA_EIO, msg);
        } else if (q) {
            q->stay = true;
            coord_logf(c, "request %s stays on replica %u: migration failed: %s", api_stream_request_id(q->stream),
                       mg->from, mg->why);
        }
    }
    /* Only now: accepting again routes waiting requests at once, which must not take the room
     * the move was counted on (test_coord: test_destination_kept_free_during_move). */
    sched_set_accepting(c->sched, (int)mg->to, true);
    mg->active = false;
    pthread_cond_signal(&c->wake);
}

void coord_take_migrate_done(coord *c, uint32_t r, uint32_t s, const Strata__Internal__V1__MigrateDone *d)
{
    migration *mg = &c->mig;
    slot *sl = &c->reps[r].stages[s];
    if (sl->migrates_pending == 0) {
        coord_out_of_step(c, r, s, "it finished a migration of sequence %" PRIu64 " that was not asked of it", d->seq_id);
        return;
    }
    /* A worker answers its Migrates in order: while older ones are pending (of migrations that
     * ended when the other replica was lost), this answer is to one of those. */
    if (--sl->migrates_pending > 0 || !mg->active || !mg->sent || (r != mg->from && r != mg->to))
        return;
    if (d->seq_id != mg->seq) {
        coord_out_of_step(c, r, s, "it answered the migration of sequence %" PRIu64 " as sequence %" PRIu64, mg->seq,
                          d->seq_id);
        return;
    }
    bool ok = d->status == 0;
    if (r == mg->from)
        mg->send_ok[s] = ok;
    else
        mg->recv_ok[s] = ok;
    if (!ok && !mg->why[0])
        snprintf(mg->why, sizeof mg->why, "replica %u stage %u (worker %s): %s", r, s, c->reps[r].stages[s].name,
                 d->message && *d->message ? d->message : "failed");
    if (++mg->answers == 2 * c->cfg.stages)
        migration_finish(c);
}

/* The serving, accepting replica other than `not` with the most unreserved blocks that fit
 * `need`; -1 when none. */
static int move_target(coord *c, uint32_t not, size_t need)
{
    int best = -1;
    size_t best_free = 0;
    for (uint32_t r = 0; r < c->cfg.replicas; r++) {
        if (r == not || !c->reps[r].serving || c->reps[r].tearing_down ||
            (c->drain.active && !c->drain.done && r == c->drain.replica))
            continue;
        sched_stats st;
        sched_get_stats(c->sched, (int)r, &st);
        size_t free_blocks = c->cap.total_blocks > st.reserved_blocks ? c->cap.total_blocks - st.reserved_blocks : 0;
        if (free_blocks >= need && (best < 0 || free_blocks > best_free)) {
            best = (int)r;
            best_free = free_blocks;
        }
    }
    return best;
}

static size_t blocks_of(const coord *c, const creq *q)
{
    size_t tokens = q->n_prompt + q->req->sampling->max_tokens;
    return (tokens + c->cfg.block_tokens - 1) / c->cfg.block_tokens;
}

/* One move of the drain per call (from the step thread); finishes the drain when its replica
 * holds nothing. */
void coord_drain_progress(coord *c)
{
    drain_state *d = &c->drain;
    if (!d->active || d->done || c->mig.active)
        return;
    creplica *rp = &c->reps[d->replica];
    if (!rp->serving) {   /* lost meanwhile (coord_lose_replica ends the drain; kept for safety) */
        d->done = true;
        (void)sched_set_steps_in_flight(c->sched, (int)d->replica, 0);
        sched_set_accepting(c->sched, (int)d->replica, true);
        snprintf(d->message, sizeof d->message, "replica %u was lost during the drain", d->replica);
        return;
    }
    size_t left = 0;
    for (size_t i = 0; i < c->n_reqs; i++) {
        creq *q = c->reqs[i];
        if (sched_get_replica(c->sched, q->id) != (int)d->replica)
            continue;
        left++;
        sched_state st = sched_get_state(c->sched, q->id);
        /* A prompt still prefilling moves once it decodes; one whose migration failed (a cause
         * that would fail again: an image over the data plane's limit, links that do not
         * connect) finishes here, the drain waiting for it, instead of being retried at once
         * with both replicas paused. */
        if (q->stay || sched_is_prefilling(c->sched, q->id))
            continue;
        int to = move_target(c, d->replica, blocks_of(c, q));
        if (to < 0 || rp->n_flights)
            continue;
        strata_error err = {0};
        if (st == SCHED_WAITING) {   /* no KV yet: only the reservation moves */
            if (sched_move(c->sched, q->id, to, &err) == STRATA_OK) {
                d->moved++;
                return;
            }
        } else if (st == SCHED_RUNNING) {
            migration_start(c, q->id, d->replica, (uint32_t)to);
            return;
        }
    }
    if (left == 0) {
        d->done = true;
        snprintf(d->message, sizeof d->message, "replica %u drained: %u moved, %u failed; its workers are stopping",
                 d->replica, d->moved, d->failed);
        coord_logf(c, "%s", d->message);
        for (uint32_t s = 0; s < c->cfg.stages; s++)
            if (rp->stages[s].peer)
                coord_send_shutdown(rp->stages[s].peer, true);
        rp->tearing_down = true;   /* coord_on_gone rebuilds it from the workers that join next */
        rp->serving = false;
        coord_forget_prefixes(c, d->replica);   /* they go with its workers (GetStats counted them until a rejoin) */
        sched_set_available(c->sched, (int)d->replica, false);
        sched_set_accepting(c->sched, (int)d->replica, true);
        (void)sched_set_steps_in_flight(c->sched, (int)d->replica, 0);
    }
}

int coord_drain_worker(coord *c, const char *worker, coord_drain_report *out, strata_error *err)
{
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&c->mu);
    drain_state *d = &c->drain;
    int rc = STRATA_OK;
    int found = -1;
    uint32_t found_id = 0;
    for (uint32_t r = 0; r < c->cfg.replicas && found < 0; r++)
        for (uint32_t s = 0; s < c->cfg.stages; s++)
            if (c->reps[r].stages[s].peer && !strcmp(c->reps[r].stages[s].name, worker)) {
                found = (int)r;
                found_id = c->reps[r].stages[s].worker_id;
            }
    /* The drain asked for before, unless the worker of that name is a new one (restarted after
     * the drain, joined again with a fresh id): draining that is a new drain. */
    bool same = d->active && !strcmp(d->worker, worker) && (found < 0 || found_id == d->worker_id);
    if (same) {
        /* progress of the drain asked for before */
    } else if (found < 0) {
        rc = strata_fail(err, STRATA_EINVAL, "no worker named '%s' is joined", worker);
    } else if (d->active && !d->done) {
        rc = strata_fail(err, STRATA_EFULL, "a drain of replica %u (worker %s) is in progress; one at a time", d->replica,
                         d->worker);
    } else if (!c->reps[found].serving) {
        rc = strata_fail(err, STRATA_EIO, "replica %d of worker '%s' is not serving", found, worker);
    } else {
        bool other = false;
        for (uint32_t r = 0; r < c->cfg.replicas; r++)
            other |= r != (uint32_t)found && c->reps[r].serving;
        if (!other)
            rc = strata_fail(err, STRATA_EFULL, "no other replica is serving: the requests of replica %d have nowhere "
                             "to go", found);
    }
    if (rc == STRATA_OK && !same) {
        memset(d, 0, sizeof *d);
        d->active = true;
        d->replica = (uint32_t)found;
        d->worker_id = found_id;
        snprintf(d->worker, sizeof d->worker, "%s", worker);
        sched_set_accepting(c->sched, found, false);
        (void)sched_set_steps_in_flight(c->sched, found, 1);
        coord_logf(c, "draining replica %d (worker %s)", found, worker);
        pthread_cond_signal(&c->wake);
    }
    if (rc == STRATA_OK) {
        out->done = d->done;
        out->replica = d->replica;
        out->moved = d->moved;
        out->failed = d->failed;
        for (size_t i = 0; i < c->n_reqs; i++)
            out->remaining += !d->done && sched_get_replica(c->sched, c->reqs[i]->id) == (int)d->replica;
        snprintf(out->message, sizeof out->message, "%s", d->message);
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}
