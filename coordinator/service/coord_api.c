/* The coordinator (coord_internal.h): the public API backend, and the metrics. */
#include "coordinator/service/coord_internal.h"

/* ---- the API backend ---- */

/* Which of the server's plans a request's kv_codec names (*plan: 0 when empty). */
static int check_kv(const coord *c, const char *spec, int *plan, strata_error *err)
{
    *plan = 0;
    if (!spec || !*spec)
        return STRATA_OK;
    kv_codec_params *p = calloc((size_t)c->mc.n_layers, sizeof *p);
    if (!p)
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    char *canon = NULL;
    int rc = kv_plan_parse(spec, c->mc.n_layers, p, err);
    if (rc == STRATA_OK && !(canon = kv_plan_name(p, c->mc.n_layers)))
        rc = strata_fail(err, STRATA_ENOMEM, "out of memory");
    if (rc == STRATA_OK) {
        *plan = -1;
        for (int i = 0; i < c->n_plans && *plan < 0; i++)
            if (strcmp(canon, c->plan_names[i]) == 0)
                *plan = i;
        if (*plan < 0) {
            char offered[1024] = "";
            for (int i = 1; i < c->n_plans; i++)
                snprintf(offered + strlen(offered), sizeof offered - strlen(offered), "%s'%s'", i > 1 ? ", " : "",
                         c->plan_names[i]);
            rc = strata_fail(err, STRATA_EUNSUPPORTED, "kv_codec '%s' is not offered by this server: it runs '%s' "
                             "(ModelInfo.default_kv_codec)%s%s%s", spec, c->kv_canonical,
                             c->n_plans > 1 ? " and, when a request names one, " : "", offered,
                             c->n_plans > 1 ? " (ModelInfo.kv_codecs)" : "; strata serve --kv-codecs offers others");
            *plan = 0;
        }
    } else {
        strata_error_prefix(err, "kv_codec");
    }
    free(p);
    free(canon);
    return rc;
}

static int api_generate(void *ctx, const Strata__V1__GenerateRequest *req, api_stream *stream, gpr_timespec deadline,
                        strata_error *err)
{
    (void)deadline;   /* the server cancels the stream when it passes */
    coord *c = ctx;
    int plan = 0;
    int rc = check_kv(c, req->kv_codec, &plan, err);
    if (rc != STRATA_OK)
        return rc;
    creq *q = calloc(1, sizeof *q);
    if (!q)
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    q->req = req;
    q->plan = plan;
    q->stream = stream;
    q->t_accept = strata_mono_s();
    if (req->input_case == STRATA__V1__GENERATE_REQUEST__INPUT_TEXT) {
        int32_t *ids = NULL;
        size_t n = 0;
        /* Templated text is expected (no template is applied): control tokens in it count. */
        rc = tokenizer_encode(c->tok, req->text, strlen(req->text), true, &ids, &n, err);
        const bool bos = tokenizer_add_bos(c->tok);
        if (rc == STRATA_OK && !(q->prompt = malloc((n + 1) * sizeof *q->prompt)))
            rc = strata_fail(err, STRATA_ENOMEM, "out of memory");
        if (rc == STRATA_OK) {
            if (bos)
                q->prompt[q->n_prompt++] = tokenizer_bos(c->tok);
            memcpy(q->prompt + q->n_prompt, ids, n * sizeof *ids);
            q->n_prompt += n;
        }
        free(ids);
    } else {
        const Strata__V1__TokenIds *t = req->token_ids;
        if (!(q->prompt = malloc((t->n_ids ? t->n_ids : 1) * sizeof *q->prompt)))
            rc = strata_fail(err, STRATA_ENOMEM, "out of memory");
        for (size_t i = 0; rc == STRATA_OK && i < t->n_ids; i++)
            q->prompt[q->n_prompt++] = (int32_t)t->ids[i];
    }
    const uint32_t max_tokens = req->sampling->max_tokens;
    q->n_input = q->n_prompt;
    if (rc == STRATA_OK && q->n_prompt == 0)
        rc = strata_fail(err, STRATA_EINVAL, "the prompt is empty after tokenization");
    if (rc == STRATA_OK && q->n_prompt + max_tokens > c->cfg.ctx)
        rc = strata_fail(err, STRATA_EFULL, "prompt (%zu tokens) + max_tokens (%u) exceeds the serving context of %u "
                         "tokens", q->n_prompt, max_tokens, c->cfg.ctx);
    bool ts_ready = rc == STRATA_OK;
    if (ts_ready)
        text_stream_init(&q->ts, (const char *const *)req->sampling->stop, req->sampling->n_stop, true);
    pthread_mutex_lock(&c->mu);
    bool any = false;
    for (uint32_t r = 0; r < c->cfg.replicas; r++)
        any |= c->reps[r].serving;
    if (rc == STRATA_OK && (c->draining || c->stopping))
        rc = strata_fail(err, STRATA_EIO, "the server is draining");
    else if (rc == STRATA_OK && !any)
        rc = strata_fail(err, STRATA_EIO, "no replica is serving yet (%u of %u workers ready)", coord_ready_workers(c),
                         workers_total(c));
    if (rc == STRATA_OK && c->n_reqs == c->cap_reqs) {
        size_t cap = c->cap_reqs ? c->cap_reqs * 2 : 64;
        creq **grown = realloc(c->reqs, cap * sizeof *grown);
        if (!grown)
            rc = strata_fail(err, STRATA_ENOMEM, "out of memory");
        else {
            c->reqs = grown;
            c->cap_reqs = cap;
        }
    }
    if (rc == STRATA_OK) {
        q->id = ++c->next_seq_id;
        rc = coord_submit_seq(c, q, err);
    }
    if (rc == STRATA_OK) {
        c->reqs[c->n_reqs++] = q;
        c->requests_total++;
        if (c->have_metrics)
            metrics_counter_inc(c->m.requests);
        pthread_cond_signal(&c->wake);
    }
    pthread_mutex_unlock(&c->mu);
    if (rc != STRATA_OK) {
        if (ts_ready)
            text_stream_free(&q->ts);
        free(q->prompt);
        free(q);
    }
    return rc;
}

static void api_cancel(void *ctx, api_stream *stream)
{
    coord *c = ctx;
    pthread_mutex_lock(&c->mu);
    creq *q = coord_find_by_stream(c, stream);
    if (q) {   /* unknown: the request already ended */
        sched_finish(c->sched, q->id);
        api_stream_finish(stream);
        coord_count_finish(c, FIN_CANCELLED);
        coord_drop_req(c, q);
        pthread_cond_signal(&c->wake);
    }
    pthread_mutex_unlock(&c->mu);
}

static bool api_abort(void *ctx, const char *request_id)
{
    coord *c = ctx;
    pthread_mutex_lock(&c->mu);
    creq *q = coord_find_by_request_id(c, request_id);
    if (q) {
        sched_finish(c->sched, q->id);
        api_stream_complete(q->stream, STRATA__V1__FINISH_REASON__FINISH_REASON_ABORT, (uint32_t)q->n_prompt,
                            (uint32_t)q->n_generated, 0);
        coord_count_finish(c, FIN_ABORT);
        coord_drop_req(c, q);
        pthread_cond_signal(&c->wake);
    }
    pthread_mutex_unlock(&c->mu);
    return q != NULL;
}

static int api_health(void *ctx, Strata__V1__HealthResponse *out, strata_error *err)
{
    (void)err;
    coord *c = ctx;
    pthread_mutex_lock(&c->mu);
    bool all = !c->draining && !c->stopping;
    for (uint32_t r = 0; r < c->cfg.replicas; r++)
        all &= c->reps[r].serving;
    out->status = all ? STRATA__V1__SERVING_STATUS__SERVING_STATUS_SERVING
                      : STRATA__V1__SERVING_STATUS__SERVING_STATUS_NOT_SERVING;
    out->workers_ready = coord_ready_workers(c);
    out->workers_total = workers_total(c);
    pthread_mutex_unlock(&c->mu);
    return STRATA_OK;
}

static int api_model_info(void *ctx, Strata__V1__ModelInfo *out, strata_error *err)
{
    (void)err;
    coord *c = ctx;
    out->name = c->model_name;
    out->arch = c->arch;
    out->n_layers = (uint32_t)c->mc.n_layers;
    out->n_embd = (uint32_t)c->mc.n_embd;
    out->n_heads = (uint32_t)c->mc.n_heads;
    out->n_kv_heads = (uint32_t)c->mc.n_kv_heads;
    out->head_dim = (uint32_t)c->mc.head_dim;
    out->n_vocab = (uint32_t)c->mc.n_vocab;
    out->n_ctx = c->cfg.ctx;
    out->default_kv_codec = c->kv_canonical;
    out->n_kv_codecs = (size_t)c->n_plans - 1;
    out->kv_codecs = c->plan_names + 1;
    out->replicas = c->cfg.replicas;
    out->stages_per_replica = c->cfg.stages;
    out->n_stage_layers = c->cfg.stages;
    out->stage_layers = c->stage_layers;
    out->block_tokens = c->cfg.block_tokens;
    return STRATA_OK;
}

static int api_stats(void *ctx, Strata__V1__Stats *out, strata_error *err)
{
    (void)err;
    coord *c = ctx;
    pthread_mutex_lock(&c->mu);
    uint64_t blocks[N_TIERS] = {0}, bytes[N_TIERS] = {0}, cap[N_TIERS] = {0};
    for (uint32_t r = 0; r < c->cfg.replicas; r++)
        for (uint32_t s = 0; s < c->cfg.stages; s++)
            for (int t = 0; t < N_TIERS; t++) {
                const slot *sl = &c->reps[r].stages[s];
                blocks[t] += sl->tier_blocks[t];
                bytes[t] += sl->tier_bytes[t];
                cap[t] += sl->tier_capacity[t];
            }
    int n_tiers = 1 + (c->cfg.host_kv_bytes > 0) + (c->cfg.nvme_kv_bytes > 0);
    for (int t = 0; t < n_tiers; t++) {
        out->tiers[t]->name = (char *)tier_names[t];
        out->tiers[t]->blocks = blocks[t];
        out->tiers[t]->bytes = bytes[t];
        out->tiers[t]->capacity_bytes = cap[t];
    }
    out->n_tiers = (size_t)n_tiers;
    /* The blocks every tier holds, plus the fp16 tails of the running sequences (workers report
     * blocks only; a tail follows from the length and each layer's window). A preempted
     * sequence's tails are blocks in a lower tier. */
    uint64_t cached = 0, kv_bytes = bytes[0] + bytes[1] + bytes[2];
    const uint64_t tail_row_bytes = 2u * 2u * (uint64_t)c->mc.n_kv_heads * (uint64_t)c->mc.head_dim;   /* K, V */
    for (size_t i = 0; i < c->n_reqs; i++) {
        sched_state st = sched_get_state(c->sched, c->reqs[i]->id);
        if (st != SCHED_RUNNING && st != SCHED_PREEMPTED)
            continue;
        const size_t n = c->reqs[i]->n_prompt + c->reqs[i]->n_generated;
        cached += n;
        for (int l = 0; st == SCHED_RUNNING && l < c->mc.n_layers; l++)
            kv_bytes += tail_row_bytes * kv_tail_tokens(&c->plans[c->reqs[i]->plan][l], (int)c->cfg.block_tokens, n);
    }
    out->kv_bytes_per_token = cached ? (double)kv_bytes / (double)cached : 0.0;
    sched_stats st;
    sched_get_stats(c->sched, -1, &st);
    out->queue_depth = (uint32_t)st.waiting;
    out->running = (uint32_t)(st.running + st.preempted);
    out->spills = c->spills_total;
    out->restores = c->restores_total;
    out->crc_failures = c->crc_total;
    out->spill_failures = c->spill_failures_total;
    out->restore_failures = c->restore_failures_total;
    out->requests_total = c->requests_total;
    out->tokens_generated = c->tokens_total;
    prefix_index_stats ps;
    prefix_index_get_stats(c->prefixes, -1, &ps);
    out->prefix_cache_entries = ps.entries;
    out->prefix_cache_bytes = ps.bytes;
    out->prefix_cache_hits = c->prefix_hits;
    out->prefix_cache_hit_tokens = c->prefix_hit_tokens;
    out->requests_recovered = c->recovered_total;
    pthread_mutex_unlock(&c->mu);
    return STRATA_OK;
}

static int api_drain_worker(void *ctx, const char *worker, Strata__V1__DrainWorkerResponse *out, strata_error *err)
{
    coord *c = ctx;
    coord_drain_report rep;
    int rc = coord_drain_worker(c, worker, &rep, err);
    if (rc != STRATA_OK)
        return rc;
    out->done = rep.done;
    out->replica = rep.replica;
    out->moved = rep.moved;
    out->remaining = rep.remaining;
    out->failed = rep.failed;
    snprintf(out->message, API_DRAIN_MESSAGE_BYTES, "%s", rep.message);
    return STRATA_OK;
}

api_backend coord_api_backend(coord *c)
{
    return (api_backend){.ctx = c, .generate = api_generate, .cancel = api_cancel, .abort = api_abort,
                         .health = api_health, .model_info = api_model_info, .stats = api_stats,
                         .drain_worker = api_drain_worker};
}

const proto_generate_limits *coord_limits(const coord *c) { return &c->limits; }

/* ---- metrics ---- */

static void collect(metrics_registry *r, void *user)
{
    (void)r;
    coord *c = user;
    pthread_mutex_lock(&c->mu);
    for (int t = 0; t < N_TIERS; t++) {
        uint64_t blocks = 0, bytes = 0, cap = 0;
        for (uint32_t i = 0; i < c->cfg.replicas; i++)
            for (uint32_t s = 0; s < c->cfg.stages; s++) {
                blocks += c->reps[i].stages[s].tier_blocks[t];
                bytes += c->reps[i].stages[s].tier_bytes[t];
                cap += c->reps[i].stages[s].tier_capacity[t];
            }
        metrics_gauge_set(c->m.tier_blocks[t], (double)blocks);
        metrics_gauge_set(c->m.tier_bytes[t], (double)bytes);
        metrics_gauge_set(c->m.tier_capacity[t], (double)cap);
    }
    metrics_gauge_set(c->m.workers_ready, (double)coord_ready_workers(c));
    sched_stats st;
    sched_get_stats(c->sched, -1, &st);
    metrics_gauge_set(c->m.queue, (double)st.waiting);
    metrics_gauge_set(c->m.running, (double)(st.running + st.preempted));
    prefix_index_stats ps;
    prefix_index_get_stats(c->prefixes, -1, &ps);
    metrics_gauge_set(c->m.prefix_entries, (double)ps.entries);
    metrics_gauge_set(c->m.prefix_bytes, (double)ps.bytes);
    pthread_mutex_unlock(&c->mu);
}

int coord_register_metrics(coord *c, metrics_registry *reg, strata_error *err)
{
    static const char *const reasons[] = {"stop", "length", "abort", "error", "cancelled"};
    double lat[METRICS_LATENCY_BUCKETS];
    metrics_latency_buckets(lat);
    coord_metrics *m = &c->m;
    int rc;
    if ((rc = metrics_counter_new(reg, "strata_requests_total", "Generate calls accepted", NULL, 0, &m->requests, err)) ||
        (rc = metrics_counter_family(reg, "strata_requests_finished_total", "Requests ended, by how", "reason", reasons,
                                     5, m->finished, err)) ||
        (rc = metrics_counter_new(reg, "strata_tokens_generated_total", "Tokens sampled (rate() gives tokens/s)", NULL,
                                  0, &m->tokens, err)) ||
        (rc = metrics_histogram_new(reg, "strata_time_to_first_token_seconds", "From accepting a request to its first "
                                    "token", NULL, 0, lat, METRICS_LATENCY_BUCKETS, &m->ttft, err)) ||
        (rc = metrics_histogram_new(reg, "strata_inter_token_seconds", "Between consecutive tokens of a request", NULL,
                                    0, lat, METRICS_LATENCY_BUCKETS, &m->itl, err)) ||
        (rc = metrics_gauge_new(reg, "strata_queue_depth", "Requests admitted and waiting for their first step", NULL,
                                0, &m->queue, err)) ||
        (rc = metrics_gauge_new(reg, "strata_running_requests", "Requests being prefilled or decoded (or preempted)",
                                NULL, 0, &m->running, err)) ||
        (rc = metrics_gauge_new(reg, "strata_workers_ready", "Workers joined, loaded and ready", NULL, 0,
                                &m->workers_ready, err)) ||
        (rc = metrics_gauge_family(reg, "strata_kv_blocks", "Compressed KV blocks resident, by tier", "tier", tier_names,
                                   N_TIERS, m->tier_blocks, err)) ||
        (rc = metrics_gauge_family(reg, "strata_kv_bytes", "Bytes of KV blocks resident, by tier", "tier", tier_names,
                                   N_TIERS, m->tier_bytes, err)) ||
        (rc = metrics_gauge_family(reg, "strata_kv_capacity_bytes", "KV budget, by tier", "tier", tier_names, N_TIERS,
                                   m->tier_capacity, err)) ||
        (rc = metrics_counter_new(reg, "strata_kv_spills_total", "KV blocks moved down a tier", NULL, 0, &m->spills,
                                  err)) ||
        (rc = metrics_counter_new(reg, "strata_kv_restores_total", "KV blocks brought back up a tier", NULL, 0,
                                  &m->restores, err)) ||
        (rc = metrics_counter_new(reg, "strata_kv_crc_failures_total", "KV blocks whose checksum failed", NULL, 0,
                                  &m->crc, err)) ||
        (rc = metrics_counter_new(reg, "strata_kv_spill_failures_total",
                                  "KV blocks that could not be written to the NVMe tier", NULL, 0, &m->spill_failures,
                                  err)) ||
        (rc = metrics_counter_new(reg, "strata_kv_restore_failures_total",
                                  "KV blocks that could not be read back from the NVMe tier", NULL, 0,
                                  &m->restore_failures, err)) ||
        (rc = metrics_counter_new(reg, "strata_prefix_cache_hits_total",
                                  "Requests whose prompt started from a cached prefix", NULL, 0, &m->prefix_hits, err)) ||
        (rc = metrics_counter_new(reg, "strata_prefix_cache_hit_tokens_total",
                                  "Prompt tokens taken from cached prefixes instead of prefilled", NULL, 0,
                                  &m->prefix_hit_tokens, err)) ||
        (rc = metrics_gauge_new(reg, "strata_prefix_cache_entries", "Cached prefixes held by the workers", NULL, 0,
                                &m->prefix_entries, err)) ||
        (rc = metrics_gauge_new(reg, "strata_prefix_cache_bytes",
                                "Bytes of cached prefixes (host memory of the workers, all stages)", NULL, 0,
                                &m->prefix_bytes, err)) ||
        (rc = metrics_counter_new(reg, "strata_requests_recovered_total",
                                  "Requests that lost their KV (a lost worker, a damaged block) and went on from their "
                                  "tokens", NULL, 0, &m->recovered, err)))
        return rc;
    metrics_set_collect(reg, collect, c);
    c->have_metrics = true;
    return STRATA_OK;
}
