/* The coordinator (coord_internal.h): workers joining, reporting, answering, and lost. */
#include "coordinator/service/coord_internal.h"

/* ---- workers ---- */

void coord_send_shutdown(ctl_peer *p, bool drain)
{
    Strata__Internal__V1__Shutdown sd = STRATA__INTERNAL__V1__SHUTDOWN__INIT;
    sd.drain = drain;
    Strata__Internal__V1__CoordinatorMessage m = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__INIT;
    m.kind_case = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_SHUTDOWN;
    m.shutdown = &sd;
    (void)ctl_peer_send(p, &m, NULL);   /* a peer that is already gone needs no shutdown */
}

/* Sends msg to a worker. A message that could not be queued while the stream goes on (too large
 * for the control stream, out of memory) would leave the worker out of step with the coordinator
 * (a step it never runs, a migration it never answers), so that stream is ended: coord_on_gone then
 * treats the worker as lost. STRATA_EIO and STRATA_EFULL mean the stream is already ending. */
void coord_send_or_end(coord *c, ctl_peer *p, const char *name,
                       const Strata__Internal__V1__CoordinatorMessage *m, const char *what)
{
    strata_error err = {0};
    int rc = ctl_peer_send(p, m, &err);
    if (rc == STRATA_OK)
        return;
    coord_logf(c, "%s to worker %s: %s", what, name, err.msg);
    if (rc != STRATA_EIO && rc != STRATA_EFULL)
        ctl_peer_close(p, 13 /* GRPC_STATUS_INTERNAL */, err.msg);
}

static void send_assignments(coord *c, uint32_t r)
{
    creplica *rp = &c->reps[r];
    char *addrs[64];
    for (uint32_t s = 0; s < c->cfg.stages; s++)
        addrs[s] = rp->stages[s].data_addr;
    for (uint32_t s = 0; s < c->cfg.stages; s++) {
        Strata__Internal__V1__Assignment a = STRATA__INTERNAL__V1__ASSIGNMENT__INIT;
        a.model_path = c->model_path;
        a.layer_begin = c->layer_begin[s];
        a.layer_end = c->layer_begin[s + 1];
        a.n_layers_total = (uint32_t)c->mc.n_layers;
        a.replica = r;
        a.stage = s;
        a.n_stages = c->cfg.stages;
        a.n_stage_data_addrs = c->cfg.stages;
        a.stage_data_addrs = addrs;
        a.kv_plan = c->kv_canonical;
        a.n_kv_plans = (size_t)c->n_plans - 1;
        a.kv_plans = c->plan_names + 1;
        a.block_tokens = c->cfg.block_tokens;
        a.max_seq_tokens = c->cfg.ctx;
        a.device_kv_bytes = c->cfg.device_kv_bytes;
        a.host_kv_bytes = c->cfg.host_kv_bytes;
        a.nvme_kv_bytes = c->cfg.nvme_kv_bytes;
        a.max_batch_seqs = c->cfg.max_seqs;
        a.max_batch_tokens = c->cfg.max_batch_tokens;
        a.step_timeout_ms = c->cfg.step_timeout_ms;
        a.worker_id = rp->stages[s].worker_id;
        Strata__Internal__V1__CoordinatorMessage m = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__INIT;
        m.kind_case = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_ASSIGNMENT;
        m.assignment = &a;
        coord_send_or_end(c, rp->stages[s].peer, rp->stages[s].name, &m, "assignment");
    }
    rp->assigned = true;
    coord_forget_prefixes(c, r);   /* fresh workers hold no entry */
    coord_logf(c, "replica %u: %u workers joined; assigned layers", r, c->cfg.stages);
}

uint32_t coord_ready_workers(const coord *c)
{
    uint32_t n = 0;
    for (uint32_t r = 0; r < c->cfg.replicas; r++)
        for (uint32_t s = 0; s < c->cfg.stages; s++)
            n += c->reps[r].stages[s].ready;
    return n;
}

static int on_join(void *ctx, ctl_peer *peer, const Strata__Internal__V1__Join *join, strata_error *err)
{
    coord *c = ctx;
    pthread_mutex_lock(&c->mu);
    int rc = STRATA_OK;
    if (c->stopping)
        rc = strata_fail(err, STRATA_EIO, "the coordinator is shutting down");
    for (uint32_t r = 0; rc == STRATA_OK && r < c->cfg.replicas; r++)
        for (uint32_t s = 0; s < c->cfg.stages; s++)
            if (c->reps[r].stages[s].peer && !strcmp(c->reps[r].stages[s].name, join->worker_name))
                rc = strata_fail(err, STRATA_EINVAL, "a worker named '%s' is already joined", join->worker_name);
    if (rc == STRATA_OK && join->device_kv_bytes < c->cfg.device_kv_bytes)
        rc = strata_fail(err, STRATA_EFULL, "worker offers %" PRIu64 " bytes of device KV memory; the coordinator grants "
                         "%" PRIu64 " (start the worker with a larger --device-kv-mib)", join->device_kv_bytes,
                         c->cfg.device_kv_bytes);
    if (rc == STRATA_OK && join->host_kv_bytes < c->cfg.host_kv_bytes)
        rc = strata_fail(err, STRATA_EFULL, "worker offers %" PRIu64 " bytes of host KV memory; the coordinator grants "
                         "%" PRIu64 " (--host-kv-mib)", join->host_kv_bytes, c->cfg.host_kv_bytes);
    if (rc == STRATA_OK && join->nvme_kv_bytes < c->cfg.nvme_kv_bytes)
        rc = strata_fail(err, STRATA_EFULL, "worker offers %" PRIu64 " bytes of NVMe KV space; the coordinator grants "
                         "%" PRIu64 " (--nvme-dir and --nvme-kv-mib)", join->nvme_kv_bytes, c->cfg.nvme_kv_bytes);
    if (rc == STRATA_OK && (!join->data_addr || !*join->data_addr || strlen(join->data_addr) >= sizeof c->reps[0].stages[0].data_addr))
        rc = strata_fail(err, STRATA_EINVAL, "worker '%s' sent no usable data-plane address", join->worker_name);
    /* The replica closest to complete that is not being torn down, then its lowest free stage. */
    int best = -1;
    for (uint32_t r = 0; rc == STRATA_OK && r < c->cfg.replicas; r++) {
        const creplica *rp = &c->reps[r];
        if (rp->tearing_down || rp->assigned || rp->joined == c->cfg.stages)
            continue;
        if (best < 0 || rp->joined > c->reps[best].joined)
            best = (int)r;
    }
    if (rc == STRATA_OK && best < 0)
        rc = strata_fail(err, STRATA_EFULL, "all %u worker slots are taken (%u replicas x %u stages)",
                         c->cfg.replicas * c->cfg.stages, c->cfg.replicas, c->cfg.stages);
    if (rc != STRATA_OK)
        coord_logf(c, "refused worker %s: %s", join->worker_name, err ? err->msg : "");
    if (rc == STRATA_OK) {
        creplica *rp = &c->reps[best];
        uint32_t s = 0;
        while (rp->stages[s].peer)
            s++;
        slot *sl = &rp->stages[s];
        memset(sl, 0, sizeof *sl);
        sl->peer = peer;
        ctl_peer_ref(peer);
        snprintf(sl->name, sizeof sl->name, "%s", join->worker_name);
        snprintf(sl->data_addr, sizeof sl->data_addr, "%s", join->data_addr);
        sl->worker_id = c->next_worker_id++;
        ctl_peer_set_user(peer, sl);
        rp->joined++;
        coord_logf(c, "worker %s joined as replica %d stage %u (layers %u-%u)", sl->name, best, s, c->layer_begin[s],
                   c->layer_begin[s + 1] - 1);
        if (rp->joined == c->cfg.stages)
            send_assignments(c, (uint32_t)best);
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

static void on_refused(void *ctx, const char *peer, int grpc_status, const char *why)
{
    /* Anyone who reaches the port can cause these: the first ten, then one in a hundred. */
    coord *c = ctx;
    unsigned long n = atomic_fetch_add(&c->workers_refused, 1) + 1;
    if (n <= 10 || n % 100 == 0)
        coord_logf(c, "refused a worker from %s: %s (%s; %lu refused so far)", peer, why,
                   proto_grpc_status_name(grpc_status), n);
}

static bool locate(const coord *c, const ctl_peer *peer, uint32_t *r_out, uint32_t *s_out)
{
    for (uint32_t r = 0; r < c->cfg.replicas; r++)
        for (uint32_t s = 0; s < c->cfg.stages; s++)
            if (c->reps[r].stages[s].peer == peer) {
                *r_out = r;
                *s_out = s;
                return true;
            }
    return false;
}

static void update_counter(metrics_counter *m, uint64_t *total, uint64_t *last, uint64_t now)
{
    uint64_t delta = now >= *last ? now - *last : now;   /* a restarted worker counts from 0 */
    *last = now;
    *total += delta;
    if (m)
        metrics_counter_add(m, delta);
}

static void take_report(coord *c, uint32_t r, uint32_t s, const Strata__Internal__V1__KvReport *k)
{
    slot *sl = &c->reps[r].stages[s];
    memset(sl->tier_blocks, 0, sizeof sl->tier_blocks);
    memset(sl->tier_bytes, 0, sizeof sl->tier_bytes);
    memset(sl->tier_capacity, 0, sizeof sl->tier_capacity);
    for (size_t i = 0; i < k->n_tiers; i++)
        for (int t = 0; t < N_TIERS; t++)
            if (k->tiers[i]->name && !strcmp(k->tiers[i]->name, tier_names[t])) {
                sl->tier_blocks[t] = k->tiers[i]->blocks;
                sl->tier_bytes[t] = k->tiers[i]->bytes;
                sl->tier_capacity[t] = k->tiers[i]->capacity_bytes;
            }
    update_counter(c->have_metrics ? c->m.spills : NULL, &c->spills_total, &sl->spills, k->spills);
    update_counter(c->have_metrics ? c->m.restores : NULL, &c->restores_total, &sl->restores, k->restores);
    update_counter(c->have_metrics ? c->m.crc : NULL, &c->crc_total, &sl->crc_failures, k->crc_failures);
    const uint64_t spill_failures_before = sl->spill_failures;
    update_counter(c->have_metrics ? c->m.spill_failures : NULL, &c->spill_failures_total, &sl->spill_failures,
                   k->spill_failures);
    update_counter(c->have_metrics ? c->m.restore_failures : NULL, &c->restore_failures_total, &sl->restore_failures,
                   k->restore_failures);
    /* A tier that stops taking blocks shows no other sign until the host tier fills: say so. */
    if (k->spill_failures > spill_failures_before)
        coord_logf(c, "worker %s: %" PRIu64 " more block(s) could not be spilled to NVMe (they stay in host memory)%s%s",
                   sl->name, k->spill_failures - spill_failures_before, k->spill_error && *k->spill_error ? ": " : "",
                   k->spill_error ? k->spill_error : "");
    if (!sl->ready && c->reps[r].assigned) {
        sl->ready = true;
        bool all = true;
        for (uint32_t i = 0; i < c->cfg.stages; i++)
            all &= c->reps[r].stages[i].ready;
        if (all) {
            c->reps[r].serving = true;
            sched_set_available(c->sched, (int)r, true);
            c->orphaned_since = 0;   /* requests that waited for a replica go on here */
            coord_logf(c, "replica %u is serving", r);
            pthread_cond_broadcast(&c->changed);
            pthread_cond_signal(&c->wake);
        }
    }
}

/* "replica R stage S (worker NAME): what the worker said" (fallback when it said nothing). */
static void worker_message(const coord *c, uint32_t r, uint32_t s, const Strata__Internal__V1__SeqResult *sr,
                           const char *fallback, char *out, size_t cap)
{
    snprintf(out, cap, "replica %u stage %u (worker %s): %s", r, s, c->reps[r].stages[s].name,
             sr->message && *sr->message ? sr->message : fallback);
}

/* ---- workers' answers, and their losses ---- */

/* The status a client sees for a worker's failure of its sequence. The coordinator checked the
 * request before admitting it, so a worker refusing the step as invalid (a plan or position it
 * disagrees with, a prefix entry it lacks) is our inconsistency, not the client's: EFORMAT,
 * whose gRPC status is INTERNAL, never INVALID_ARGUMENT telling the client to change its
 * request. Every other code keeps its meaning (ENOMEM/EFULL: out of room, EIO/ECRC: retry). */
int coord_worker_failure_status(uint32_t worker_status)
{
    return worker_status == STRATA_EINVAL ? STRATA_EFORMAT : (int)worker_status;
}

/* A worker whose answers no longer match what was asked of it (a step never sent, steps out of
 * order, a migration it was not asked for): whatever it sends next cannot be trusted, and the
 * step or migration it owes may never come, which would stall its replica for good. Its stream
 * is ended; coord_on_gone then tears the replica down as for a lost worker (its requests end with
 * UNAVAILABLE and this reason) and the workers that join next rebuild it. */
void coord_end_worker(coord *c, uint32_t r, uint32_t s, const char *msg)
{
    coord_logf(c, "replica %u stage %u (worker %s): %s: ending its stream", r, s, c->reps[r].stages[s].name, msg);
    ctl_peer_close(c->reps[r].stages[s].peer, 13 /* GRPC_STATUS_INTERNAL */, msg);
}

void coord_out_of_step(coord *c, uint32_t r, uint32_t s, const char *fmt, ...)
{
    char why[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    char msg[512];
    snprintf(msg, sizeof msg, "worker out of step with the coordinator: %s", why);
    coord_end_worker(c, r, s, msg);
}

static void take_result(coord *c, uint32_t r, uint32_t s, const Strata__Internal__V1__StepResult *res)
{
    creplica *rp = &c->reps[r];
    uint32_t k = 0;
    while (k < rp->n_flights && rp->flights[k].step != res->step)
        k++;
    if (k == rp->n_flights) {
        if (rp->tearing_down)
            return;   /* a result of a step abandoned when the replica was torn down */
        const uint64_t last = rp->stages[s].last_answered;
        if (res->step > rp->last_step)
            coord_out_of_step(c, r, s, "it answered step %" PRIu64 ", which was never sent (the last was %" PRIu64 ")",
                              res->step, rp->last_step);
        else if (res->step == last && last != 0)   /* its last answer again, that step over: a repeat */
            coord_logf(c, "replica %u stage %u (worker %s) answered step %" PRIu64 " again after it ended: ignored", r, s,
                       rp->stages[s].name, res->step);
        else   /* the step it owes is not this one, and may never come */
            coord_out_of_step(c, r, s, "it answered step %" PRIu64 ", older than the step it owes (its last answer was to step "
                              "%" PRIu64 ")", res->step, last);
        return;
    }
    flight *f = &rp->flights[k];
    /* A stage's second answer to one step would end the step before the others answered. */
    if (f->answered >> s & 1) {
        coord_logf(c, "replica %u stage %u (worker %s) answered step %" PRIu64 " twice: the second answer is ignored", r,
                   s, rp->stages[s].name, res->step);
        return;
    }
    /* A stage runs its steps in the order they were sent: an answer that skips one means the
     * skipped step's answer is lost or was sent under another number. */
    for (uint32_t j = 0; j < rp->n_flights; j++)
        if (rp->flights[j].step < res->step && !(rp->flights[j].answered >> s & 1)) {
            coord_out_of_step(c, r, s, "it answered step %" PRIu64 " before step %" PRIu64, res->step, rp->flights[j].step);
            return;
        }
    f->answered |= (uint64_t)1 << s;
    rp->stages[s].last_answered = res->step;
    for (size_t i = 0; i < res->n_results; i++) {
        const Strata__Internal__V1__SeqResult *sr = res->results[i];
        bool in_work = false;
        for (size_t w = 0; w < f->n_work; w++) {
            if (f->works[w].seq_id != sr->seq_id)
                continue;
            in_work = true;
            if (sr->status != 0 && sr->prefix_failed)
                f->prefix_failed[w] = true;   /* from any stage: the entry is of no use on this replica */
            if (sr->status != 0 && f->status[w] == 0) {
                f->status[w] = coord_worker_failure_status(sr->status);
                worker_message(c, r, s, sr, "failed", f->message[w], sizeof f->message[w]);
            } else if (sr->status == 0 && s == c->cfg.stages - 1 && sr->token >= (uint32_t)c->mc.n_vocab) {
                /* never handed to the client as if the model had said it */
                char why[128];
                snprintf(why, sizeof why, "returned token %u, outside the model's vocabulary of %d", sr->token,
                         c->mc.n_vocab);
                f->status[w] = STRATA_EFORMAT;
                snprintf(f->message[w], sizeof f->message[w], "replica %u stage %u (worker %s) %s", r, s,
                         rp->stages[s].name, why);
            } else if (sr->status == 0 && s == c->cfg.stages - 1) {
                f->sampled[w] = true;
                f->tokens[w] = sr->token;
            }
        }
        /* A sequence the step preempted (not in its work) whose spill failed on this stage: its
         * blocks are not where the scheduler now counts them (off the device), so it cannot go
         * on; end it now rather than when it next runs. */
        creq *q = !in_work && sr->status != 0 ? coord_find_by_id(c, sr->seq_id) : NULL;
        if (q) {
            char msg[640];
            const int status = coord_worker_failure_status(sr->status);
            worker_message(c, r, s, sr, "moving its KV blocks between tiers failed", msg, sizeof msg);
            if (coord_kv_fault(status) && coord_may_recover(c, q)) {
                sched_finish(c->sched, q->id);
                if (coord_recover(c, q, msg))
                    continue;
                coord_end_failed(c, q, status, msg);   /* its sequence is finished */
                continue;
            }
            coord_logf(c, "request %s failed: %s", api_stream_request_id(q->stream), msg);
            coord_fail_req(c, q, status, msg);
        }
    }
    if (++f->answers == c->cfg.stages)
        coord_finish_step(c, r, k);
}

static void on_message(void *ctx, ctl_peer *peer, const Strata__Internal__V1__WorkerMessage *msg)
{
    coord *c = ctx;
    pthread_mutex_lock(&c->mu);
    uint32_t r, s;
    if (locate(c, peer, &r, &s)) {
        if (msg->kind_case == STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_KV_REPORT)
            take_report(c, r, s, msg->kv_report);
        else if (msg->kind_case == STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_STEP_RESULT)
            take_result(c, r, s, msg->step_result);
        else if (msg->kind_case == STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_MIGRATE_DONE)
            coord_take_migrate_done(c, r, s, msg->migrate_done);
    }
    pthread_mutex_unlock(&c->mu);
}

/* coord_lose_replica's choice for a request whose KV went with the replica: finish its sequence and
 * mark it to go on elsewhere (coord_recover; true), or end it with UNAVAILABLE (false: q is gone). */
static bool recover_or_fail(coord *c, creq *q, bool elsewhere, const char *why)
{
    if (elsewhere && coord_may_recover(c, q)) {
        sched_finish(c->sched, q->id);
        q->recovering = true;
        return true;
    }
    coord_fail_req(c, q, STRATA_EIO, why);
    return false;
}

/* Takes replica r out of routing. Its requests go on on the other serving replicas from their
 * tokens (coord_recover) while they have recoveries left; the others end with UNAVAILABLE. */
void coord_lose_replica(coord *c, uint32_t r, const char *why)
{
    creplica *rp = &c->reps[r];
    /* Where its requests may go on: another serving replica, or this one or another once rebuilt
     * (recovery_wait_ms: a lone replica's workers restarted by their supervisor; not while the
     * server drains or stops, which ends what still runs anyway). */
    const bool may_wait = c->cfg.recovery_wait_ms && !c->stopping && !c->draining;
    /* Nothing may be routed to r from here on: each sched_finish below frees room there and
     * routes the queue, and a queued request routed to r now would wait for its rebuild. */
    sched_set_accepting(c->sched, (int)r, false);
    bool elsewhere = may_wait;
    for (uint32_t k = 0; k < c->cfg.replicas; k++)
        elsewhere |= k != r && c->reps[k].serving && !c->reps[k].tearing_down;
    for (size_t i = 0; i < c->n_reqs;) {
        creq *q = c->reqs[i];
        if (!q->recovering && sched_get_replica(c->sched, q->id) == (int)r &&
            !recover_or_fail(c, q, elsewhere, why))
            continue;   /* q was dropped: index i now holds another request */
        i++;
    }
    /* A migration touching r: the sequence may be split between the replicas now, unless r was
     * its destination and no Migrate went out yet (it is whole where it was, and stays). */
    if (c->mig.active && (r == c->mig.from || r == c->mig.to)) {
        creq *q = coord_find_by_id(c, c->mig.seq);
        const bool untouched = r == c->mig.to && !c->mig.sent;
        if (q && !q->recovering && !untouched)
            (void)recover_or_fail(c, q, elsewhere, why);
        if (r == c->mig.from)
            (void)sched_free_on(c->sched, (int)c->mig.to, c->mig.seq);
        if (c->mig.to != r)   /* r itself accepts again only once it is unavailable, below */
            sched_set_accepting(c->sched, (int)c->mig.to, true);
        c->mig.active = false;
    }
    /* A replica lost while being drained: the drain ends here, before workers that join next
     * rebuild it (coord_drain_progress must not take the fresh replica for a drained one). */
    if (c->drain.active && !c->drain.done && c->drain.replica == r) {
        c->drain.done = true;
        (void)sched_set_steps_in_flight(c->sched, (int)r, 0);
        snprintf(c->drain.message, sizeof c->drain.message, "replica %u was lost during the drain", r);
    }
    /* A drain of another replica with no replica left to move to: it ends, and the drained
     * replica, the only one serving, takes requests again (those of r among them); else they
     * would wait for the drain's end and then for a rebuild. */
    if (c->drain.active && !c->drain.done && c->drain.replica != r) {
        const uint32_t d = c->drain.replica;
        bool other = false;
        for (uint32_t k = 0; k < c->cfg.replicas; k++)
            other |= k != r && k != d && c->reps[k].serving && !c->reps[k].tearing_down;
        if (!other) {
            c->drain.done = true;
            (void)sched_set_steps_in_flight(c->sched, (int)d, 0);
            sched_set_accepting(c->sched, (int)d, true);
            snprintf(c->drain.message, sizeof c->drain.message, "the drain of replica %u ended: replica %u was lost and "
                     "no other replica serves beside it (%u moved, %u failed)", d, r, c->drain.moved, c->drain.failed);
            coord_logf(c, "%s", c->drain.message);
        }
    }
    coord_forget_prefixes(c, r);
    sched_set_available(c->sched, (int)r, false);
    sched_set_accepting(c->sched, (int)r, true);   /* for its rebuild: whatever a drain or migration had set */
    rp->serving = false;
    rp->n_flights = 0;
    /* Now that r takes no request, the recovering ones go where the scheduler routes them. */
    for (size_t i = 0; i < c->n_reqs;) {
        creq *q = c->reqs[i];
        if (q->recovering) {
            q->recovering = false;
            if (!coord_recover(c, q, why)) {
                coord_end_failed(c, q, STRATA_EIO, why);   /* its old sequence is finished */
                continue;
            }
        }
        i++;
    }
    pthread_cond_broadcast(&c->wake);   /* the other replica of a migration may run again */
    /* With no replica left, queued requests would wait for workers that may never come: they
     * wait recovery_wait_ms at most (coord_expire_orphans), or end now. */
    bool any = false;
    for (uint32_t k = 0; k < c->cfg.replicas; k++)
        any |= c->reps[k].serving;
    if (!any && c->n_reqs && may_wait) {
        if (!c->orphaned_since) {
            c->orphaned_since = strata_mono_s();
            coord_logf(c, "no replica is serving: %zu request(s) wait up to %.3g s for one to be rebuilt", c->n_reqs,
                       c->cfg.recovery_wait_ms / 1e3);
        }
        pthread_cond_signal(&c->wake);   /* the step thread times the wait */
    }
    while (!any && c->n_reqs && !c->orphaned_since)
        coord_fail_req(c, c->reqs[0], STRATA_EIO, "no replica is serving: every replica lost a worker");
}

/* recovery_wait_ms: requests left with no replica serving end once no replica is back in time. */
void coord_expire_orphans(coord *c)
{
    if (!c->orphaned_since || strata_mono_s() - c->orphaned_since < c->cfg.recovery_wait_ms / 1e3)
        return;
    char msg[200];
    snprintf(msg, sizeof msg, "no replica is serving: every replica lost a worker, and none served again within %.3g s",
             c->cfg.recovery_wait_ms / 1e3);
    coord_logf(c, "%s: %zu request(s) end", msg, c->n_reqs);
    while (c->n_reqs)
        coord_fail_req(c, c->reqs[0], STRATA_EIO, msg);
    c->orphaned_since = 0;
}

void coord_on_gone(void *ctx, ctl_peer *peer, int grpc_status, const char *why)
{
    coord *c = ctx;
    pthread_mutex_lock(&c->mu);
    uint32_t r, s;
    if (locate(c, peer, &r, &s)) {
        creplica *rp = &c->reps[r];
        slot *sl = &rp->stages[s];
        if (!c->stopping) {
            char msg[512];
            snprintf(msg, sizeof msg, "worker %s (replica %u, stage %u) lost: %s", sl->name, r, s,
                     why && *why ? why : "stream ended");
            coord_logf(c, "%s (gRPC status %d)", msg, grpc_status);
            if (rp->assigned && !rp->tearing_down) {
                rp->tearing_down = true;
                for (uint32_t k = 0; k < c->cfg.stages; k++)
                    rp->stages[k].ready = false;
                coord_lose_replica(c, r, msg);
                for (uint32_t k = 0; k < c->cfg.stages; k++)
                    if (k != s && rp->stages[k].peer)
                        coord_send_shutdown(rp->stages[k].peer, false);
            }
        }
        ctl_peer_set_user(peer, NULL);
        ctl_peer_unref(sl->peer);
        memset(sl, 0, sizeof *sl);
        rp->joined--;
        if (rp->joined == 0) {   /* a clean slate: the next workers to join rebuild it */
            rp->assigned = rp->tearing_down = rp->serving = false;
            rp->n_flights = 0;
        }
        pthread_cond_broadcast(&c->changed);
    }
    pthread_mutex_unlock(&c->mu);
}

ctl_handler coord_ctl_handler(coord *c)
{
    return (ctl_handler){.ctx = c, .on_join = on_join, .on_message = on_message, .on_gone = coord_on_gone,
                         .on_refused = on_refused};
}
