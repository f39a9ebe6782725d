/* The coordinator's core (coord.h): requests, prefix caching, capacity, the plans, life. */
#include "coordinator/service/coord_internal.h"

void coord_logf(const coord *c, const char *fmt, ...)
{
    if (c->cfg.quiet)
        return;
    va_list ap;
    va_start(ap, fmt);
    fputs("strata-coordinator: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

/* ---- requests ---- */

creq *coord_find_by_id(const coord *c, uint64_t id)
{
    for (size_t i = 0; i < c->n_reqs; i++)
        if (c->reqs[i]->id == id)
            return c->reqs[i];
    return NULL;
}

creq *coord_find_by_stream(const coord *c, const api_stream *st)
{
    for (size_t i = 0; i < c->n_reqs; i++)
        if (c->reqs[i]->stream == st)
            return c->reqs[i];
    return NULL;
}

creq *coord_find_by_request_id(const coord *c, const char *rid)
{
    for (size_t i = 0; i < c->n_reqs; i++)
        if (!strcmp(api_stream_request_id(c->reqs[i]->stream), rid))
            return c->reqs[i];
    return NULL;
}

/* Forgets q (its terminal call was made). */
void coord_drop_req(coord *c, creq *q)
{
    for (size_t i = 0; i < c->n_reqs; i++)
        if (c->reqs[i] == q) {
            c->reqs[i] = c->reqs[--c->n_reqs];
            break;
        }
    if (q->pinned)
        prefix_index_unpin(c->prefixes, q->prefix_entry);
    text_stream_free(&q->ts);
    free(q->prompt);
    free(q->generated);
    free(q);
    pthread_cond_broadcast(&c->changed);
}

/* ---- prefix caching ---- */

/* Tokens of a finished request whose KV sits in blocks on its workers: its prompt and sampled
 * tokens but the last (never fed back), less each layer's fp16 tail. A request started from an
 * entry of `cached` tokens had an empty tail there: its tail follows from what came after. */
static size_t blocked_tokens(const coord *c, const creq *q)
{
    const size_t bt = c->cfg.block_tokens, fed = q->n_prompt + q->n_generated - 1;
    size_t blocks = SIZE_MAX;
    for (int l = 0; l < c->mc.n_layers; l++) {
        const size_t stream = fed - q->cached;
        const size_t in_blocks = q->cached + stream - kv_tail_tokens(&c->plans[q->plan][l], (int)bt, stream);
        blocks = in_blocks / bt < blocks ? in_blocks / bt : blocks;
    }
    return blocks * bt;
}

/* q finished on replica r (stop or length): offers its blocked prefix to the index, and when the
 * index keeps it, has the replica's workers park it with the plan that frees the sequence. */
void coord_offer_prefix(coord *c, creq *q, int r)
{
    if (!c->prefixes || r < 0 || !c->prefix_row_bytes[q->plan] || q->n_generated == 0)
        return;
    const size_t n = blocked_tokens(c, q);
    creplica *rp = &c->reps[r];
    int32_t *ids = n ? malloc(n * sizeof *ids) : NULL;
    if (!ids)
        return;
    const size_t from_prompt = n < q->n_prompt ? n : q->n_prompt;
    memcpy(ids, q->prompt, from_prompt * sizeof *ids);
    memcpy(ids + from_prompt, q->generated, (n - from_prompt) * sizeof *ids);
    if (rp->n_parks == rp->cap_parks) {   /* room first: a kept entry must reach the workers */
        size_t cap = rp->cap_parks ? rp->cap_parks * 2 : 8;
        Strata__Internal__V1__PrefixPark *grown = realloc(rp->parks, cap * sizeof *grown);
        if (grown)
            rp->parks = grown;
        Strata__Internal__V1__PrefixPark **ptrs = realloc(rp->park_ptrs, cap * sizeof *ptrs);
        if (ptrs)
            rp->park_ptrs = ptrs;
        if (!grown || !ptrs) {
            free(ids);
            return;
        }
        rp->cap_parks = cap;
    }
    bool keep = false;
    strata_error err = {0};
    const uint64_t bytes = (uint64_t)(n / c->cfg.block_tokens) * c->prefix_row_bytes[q->plan];
    if (prefix_index_insert(c->prefixes, q->id, r, q->plan, ids, n, bytes, &keep, &err) != STRATA_OK)
        coord_logf(c, "prefix cache: %s", err.msg);
    free(ids);
    if (!keep)
        return;
    Strata__Internal__V1__PrefixPark *pk = &rp->parks[rp->n_parks++];
    strata__internal__v1__prefix_park__init(pk);
    pk->seq_id = q->id;
    pk->n_tokens = (uint32_t)n;
}

/* A copy of entry failed on a worker (its park failed there): out of the index, and the requests
 * that waited to start from it start from position 0 instead. */
void coord_lose_prefix(coord *c, uint64_t entry)
{
    for (size_t i = 0; i < c->n_reqs; i++) {
        creq *q = c->reqs[i];
        if (q->pinned && q->prefix_entry == entry) {
            (void)sched_drop_prefix(c->sched, q->id);
            prefix_index_unpin(c->prefixes, entry);
            q->pinned = false;
        }
    }
    prefix_index_remove(c->prefixes, entry);
}

/* The replica's workers hold no entry (lost, or assigned afresh): forget them, and start the
 * requests that waited for one from position 0. */
void coord_forget_prefixes(coord *c, uint32_t r)
{
    if (!c->prefixes)
        return;
    for (size_t i = 0; i < c->n_reqs; i++) {
        creq *q = c->reqs[i];
        if (q->pinned && prefix_index_replica(c->prefixes, q->prefix_entry) == (int)r) {
            (void)sched_drop_prefix(c->sched, q->id);
            prefix_index_unpin(c->prefixes, q->prefix_entry);
            q->pinned = false;
        }
    }
    prefix_index_forget_replica(c->prefixes, (int)r);
    c->reps[r].n_parks = 0;
}

void coord_count_finish(coord *c, int kind)
{
    if (c->have_metrics)
        metrics_counter_inc(c->m.finished[kind]);
}

/* Ends q with a failure whose sequence the scheduler has finished (or a step outcome finishes). */
void coord_end_failed(coord *c, creq *q, int code, const char *msg)
{
    api_stream_fail(q->stream, code, msg);
    coord_count_finish(c, FIN_ERROR);
    coord_drop_req(c, q);
}

/* Ends q with a failure, its sequence finished. */
void coord_fail_req(coord *c, creq *q, int code, const char *msg)
{
    sched_finish(c->sched, q->id);
    coord_end_failed(c, q, code, msg);
}

/* ---- capacity ---- */

/* Divides the layers among a replica's stages as cfg.stage_layers says (layer_split.h). The
 * balanced split counts the matrices each decoded token multiplies: a layer's attention and FFN
 * projections, and the output head on the last stage. */
static int split_layers(coord *c, strata_error *err)
{
    const model_config *m = &c->mc;
    const double e = m->n_embd, q = (double)m->n_heads * m->head_dim, kv = (double)m->n_kv_heads * m->head_dim;
    const layer_split_costs costs = {.layer_cost = 2 * e * q + 2 * e * kv + 3 * e * m->n_ff,
                                     .head_cost = (double)m->n_vocab * e};
    layer_split_spec spec;
    int rc = layer_split_parse(c->cfg.stage_layers, &spec, err);
    if (rc == STRATA_OK)
        rc = layer_split_plan(&spec, (uint32_t)m->n_layers, c->cfg.stages, &costs, c->layer_begin, err);
    if (rc != STRATA_OK)
        return strata_error_prefix(err, "coordinator: --stage-layers");
    for (uint32_t s = 0; s < c->cfg.stages; s++)
        c->stage_layers[s] = c->layer_begin[s + 1] - c->layer_begin[s];
    if (c->cfg.stages > 1) {
        char counts[LAYER_SPLIT_MAX_STAGES * 11];
        layer_split_format(c->layer_begin, c->cfg.stages, counts, sizeof counts);
        coord_logf(c, "layers per stage: %s (%s)", counts,
                   spec.mode == LAYER_SPLIT_EVEN ? "even" : spec.mode == LAYER_SPLIT_BALANCED ? "balanced" : "as listed");
    }
    return STRATA_OK;
}

/* Block rows replica stages hold on the device and in all tiers: the smallest over the stages,
 * by the workers' rules (kv_rows.h). */
static int replica_capacity(const coord *c, sched_replica_config *out, strata_error *err)
{
    const kv_stage_budget budget = {.device_bytes = c->cfg.device_kv_bytes, .host_bytes = c->cfg.host_kv_bytes,
                                    .nvme_bytes = c->cfg.nvme_kv_bytes};
    *out = (sched_replica_config){.device_blocks = SIZE_MAX, .stream_blocks = SIZE_MAX, .total_blocks = SIZE_MAX};
    for (uint32_t s = 0; s < c->cfg.stages; s++) {
        uint32_t b = c->layer_begin[s], e = c->layer_begin[s + 1];
        kv_geometry g = {.n_layers = (int)(e - b), .n_kv_heads = c->mc.n_kv_heads, .head_dim = c->mc.head_dim,
                         .block_tokens = (int)c->cfg.block_tokens};
        const kv_codec_params *stage_plans[COORD_MAX_PLANS];   /* each plan's layers of this stage */
        for (int i = 0; i < c->n_plans; i++)
            stage_plans[i] = c->plans[i] + b;
        sched_replica_config stage;
        int rc = kv_stage_rows(&g, stage_plans, c->n_plans, &budget, &stage, err);
        if (rc != STRATA_OK) {
            strata_error_prefix(err, "stage %u (layers %u-%u)", s, b, e - 1);
            return rc;
        }
        out->device_blocks = stage.device_blocks < out->device_blocks ? stage.device_blocks : out->device_blocks;
        out->stream_blocks = stage.stream_blocks < out->stream_blocks ? stage.stream_blocks : out->stream_blocks;
        out->total_blocks = stage.total_blocks < out->total_blocks ? stage.total_blocks : out->total_blocks;
    }
    return STRATA_OK;
}

/* ---- the plans a request may choose ---- */

/* Adds a plan unless it is one already there (the same canonical form). */
static int add_plan(coord *c, const char *entry, const kv_geometry *g, strata_error *err)
{
    kv_codec_params *p = calloc((size_t)c->mc.n_layers, sizeof *p);
    char *name = NULL;
    int rc = !p ? strata_fail(err, STRATA_ENOMEM, "out of memory")
             : kv_plan_is_file(entry) ? kv_plan_load(entry, c->mc.n_layers, p, err)
                                      : kv_plan_parse(entry, c->mc.n_layers, p, err);
    for (int l = 0; rc == STRATA_OK && l < c->mc.n_layers; l++)
        if ((rc = kv_codec_validate(&p[l], g, err)) != STRATA_OK)
            strata_error_prefix(err, "layer %d", l);
    bool known = false;
    if (rc == STRATA_OK && !(name = kv_plan_name(p, c->mc.n_layers)))
        rc = strata_fail(err, STRATA_ENOMEM, "out of memory");
    if (rc == STRATA_OK) {
        for (int i = 0; i < c->n_plans && !known; i++)
            known = strcmp(name, c->plan_names[i]) == 0;
        if (!known && c->n_plans == COORD_MAX_PLANS)
            rc = strata_fail(err, STRATA_EINVAL, "more than %d plans", COORD_MAX_PLANS - 1);
        if (!known && strlen(name) > c->limits.max_kv_codec_bytes)
            rc = strata_fail(err, STRATA_EINVAL, "its range list '%s' is longer than a request's kv_codec may be (%zu "
                             "bytes)", name, c->limits.max_kv_codec_bytes);
    }
    if (rc != STRATA_OK || known) {
        free(p);
        free(name);
        return rc == STRATA_OK ? STRATA_OK : strata_error_prefix(err, "coordinator: --kv-codecs '%s'", entry);
    }
    c->plans[c->n_plans] = p;
    c->plan_names[c->n_plans++] = name;
    return STRATA_OK;
}

/* The server's plan, then the --kv-codecs list: entries separated by ';', where an entry that
 * is not a plan file or a range list (no ':') may hold several codec names separated by ','. */
static int load_plans(coord *c, const char *list, const kv_geometry *g, strata_error *err)
{
    c->plans = calloc(COORD_MAX_PLANS, sizeof *c->plans);
    c->plan_names = calloc(COORD_MAX_PLANS, sizeof *c->plan_names);
    char *copy = strdup(list ? list : "");
    if (!c->plans || !c->plan_names || !copy || !(c->plan_names[0] = strdup(c->kv_canonical))) {
        free(copy);
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    }
    c->plans[0] = c->codecs;
    c->n_plans = 1;
    int rc = STRATA_OK;
    char *save = NULL;
    for (char *entry = strtok_r(copy, ";", &save); entry && rc == STRATA_OK; entry = strtok_r(NULL, ";", &save)) {
        entry += strspn(entry, " \t");
        size_t n = strlen(entry);
        while (n && (entry[n - 1] == ' ' || entry[n - 1] == '\t'))
            entry[--n] = 0;
        if (!*entry)
            continue;
        if (kv_plan_is_file(entry) || strchr(entry, ':')) {
            rc = add_plan(c, entry, g, err);
            continue;
        }
        char *save2 = NULL;
        for (char *name = strtok_r(entry, ", ", &save2); name && rc == STRATA_OK; name = strtok_r(NULL, ", ", &save2))
            rc = add_plan(c, name, g, err);
    }
    free(copy);
    return rc;
}

/* ---- life ---- */

/* The prefix index and what a cached block row of each plan costs the workers (their slot sizes
 * summed over every layer). A plan with an OTT layer is not cached (its pool state cannot be cut
 * to a prefix: kv_image_prefix). */
static int prefix_cache_setup(coord *c, strata_error *err)
{
    const kv_geometry g = {.n_layers = c->mc.n_layers, .n_kv_heads = c->mc.n_kv_heads, .head_dim = c->mc.head_dim,
                           .block_tokens = (int)c->cfg.block_tokens};
    prefix_index_config pc = {.n_replicas = (int)c->cfg.replicas, .block_tokens = c->cfg.block_tokens,
                              .budget_bytes = c->cfg.prefix_cache_bytes};
    if (!(c->prefix_row_bytes = calloc((size_t)c->n_plans, sizeof *c->prefix_row_bytes)) ||
        !(c->prefix_usable = calloc(c->cfg.replicas, sizeof *c->prefix_usable)))
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    for (int p = 0; p < c->n_plans; p++) {
        bool ott = false;
        for (int l = 0; l < c->mc.n_layers; l++)
            ott |= c->plans[p][l].codec == KV_CODEC_OTT;
        c->prefix_row_bytes[p] = ott ? 0 : kv_plan_row_bytes(&g, c->plans[p]);
    }
    if (!(c->prefixes = prefix_index_create(&pc, err)))
        return err ? err->code : STRATA_ENOMEM;
    return STRATA_OK;
}

coord *coord_create(const coord_config *cfg, strata_error *err)
{
    if (!cfg || !cfg->model_path || cfg->replicas < 1 || cfg->stages < 1 || cfg->block_tokens < 1 ||
        cfg->max_seqs < 1 || cfg->max_batch_tokens < 1 || cfg->device_kv_bytes == 0) {
        strata_fail(err, STRATA_EINVAL, "coordinator: model, replicas, stages, block tokens, batch limits and the "
                    "device KV budget must be set");
        return NULL;
    }
    if (cfg->stages > 64 || cfg->replicas > 1024 || cfg->steps_in_flight > SCHED_MAX_STEPS_IN_FLIGHT) {
        strata_fail(err, STRATA_EINVAL, "coordinator: at most 64 stages, 1024 replicas and %d steps in flight (got %u, "
                    "%u and %u)", SCHED_MAX_STEPS_IN_FLIGHT, cfg->stages, cfg->replicas, cfg->steps_in_flight);
        return NULL;
    }
    if (cfg->nvme_kv_bytes && !cfg->host_kv_bytes) {
        strata_fail(err, STRATA_EINVAL, "coordinator: an NVMe tier needs a host tier above it (set the host KV budget)");
        return NULL;
    }
    if (strlen(cfg->model_path) >= sizeof ((coord *)0)->model_path) {
        strata_fail(err, STRATA_EINVAL, "coordinator: model path too long");
        return NULL;
    }
    coord *c = calloc(1, sizeof *c);
    if (!c) {
        strata_fail(err, STRATA_ENOMEM, "out of memory");
        return NULL;
    }
    c->cfg = *cfg;
    if (c->cfg.steps_in_flight == 0)
        c->cfg.steps_in_flight = c->cfg.stages;   /* one step per stage of the pipeline */
    snprintf(c->model_path, sizeof c->model_path, "%s", cfg->model_path);
    c->cfg.model_path = c->model_path;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->wake, NULL);
    pthread_cond_init(&c->changed, NULL);
    int rc = model_read_meta(c->model_path, &c->mc, &c->tok, err);
    if (rc == STRATA_OK) {
        snprintf(c->model_name, sizeof c->model_name, "%.127s", *c->mc.name ? c->mc.name : c->model_path);
        snprintf(c->arch, sizeof c->arch, "%s", c->mc.arch);
        if (c->cfg.ctx == 0)
            c->cfg.ctx = (uint32_t)(c->mc.n_ctx_train < 8192 ? c->mc.n_ctx_train : 8192);
        if (c->cfg.ctx < 2 || c->cfg.ctx > (uint32_t)c->mc.n_ctx_train)
            rc = strata_fail(err, STRATA_EINVAL, "coordinator: context %u must be in [2, %d] (the model's trained "
                             "context)", c->cfg.ctx, c->mc.n_ctx_train);
        else if (cfg->stages > (uint32_t)c->mc.n_layers)
            rc = strata_fail(err, STRATA_EINVAL, "coordinator: %u stages for a model of %d layers", cfg->stages,
                             c->mc.n_layers);
        else if (cfg->max_seqs > cfg->max_batch_tokens)
            rc = strata_fail(err, STRATA_EINVAL, "coordinator: max sequences %u exceeds max batch tokens %u (each "
                             "running sequence decodes one token per step)", cfg->max_seqs, cfg->max_batch_tokens);
    }
    if (rc == STRATA_OK) {
        c->codecs = calloc((size_t)c->mc.n_layers, sizeof *c->codecs);
        c->layer_begin = calloc(cfg->stages + 1, sizeof *c->layer_begin);
        c->stage_layers = calloc(cfg->stages, sizeof *c->stage_layers);
        c->reps = calloc(cfg->replicas, sizeof *c->reps);
        if (!c->codecs || !c->layer_begin || !c->stage_layers || !c->reps)
            rc = strata_fail(err, STRATA_ENOMEM, "out of memory");
    }
    if (rc == STRATA_OK) {   /* a codec, a range list, or a plan file from `strata calibrate` */
        const char *spec = cfg->kv && *cfg->kv ? cfg->kv : "kivi4";
        rc = kv_plan_is_file(spec) ? kv_plan_load(spec, c->mc.n_layers, c->codecs, err)
                                   : kv_plan_parse(spec, c->mc.n_layers, c->codecs, err);
        if (rc != STRATA_OK)
            strata_error_prefix(err, "coordinator: KV plan");
    }
    if (rc == STRATA_OK) {
        kv_geometry g = {.n_layers = c->mc.n_layers, .n_kv_heads = c->mc.n_kv_heads, .head_dim = c->mc.head_dim,
                         .block_tokens = (int)cfg->block_tokens};
        for (int l = 0; rc == STRATA_OK && l < c->mc.n_layers; l++)
            if ((rc = kv_codec_validate(&c->codecs[l], &g, err)) != STRATA_OK)
                strata_error_prefix(err, "coordinator: KV plan, layer %d", l);
        if (rc == STRATA_OK && !(c->kv_canonical = kv_plan_name(c->codecs, c->mc.n_layers)))
            rc = strata_fail(err, STRATA_ENOMEM, "coordinator: out of memory");
        c->limits = proto_generate_limits_default(c->cfg.ctx, (uint32_t)c->mc.n_vocab);
        if (rc == STRATA_OK)
            rc = load_plans(c, cfg->kv_codecs, &g, err);
    }
    if (rc == STRATA_OK)
        rc = split_layers(c, err);
    sched_replica_config cap = {0};
    if (rc == STRATA_OK)
        rc = replica_capacity(c, &cap, err);
    sched_replica_config *caps = rc == STRATA_OK ? calloc(cfg->replicas, sizeof *caps) : NULL;
    if (rc == STRATA_OK && !caps)
        rc = strata_fail(err, STRATA_ENOMEM, "out of memory");
    if (rc == STRATA_OK) {
        for (uint32_t r = 0; r < cfg->replicas; r++)
            caps[r] = cap;
        sched_config sc = {.block_tokens = cfg->block_tokens, .max_batch_tokens = cfg->max_batch_tokens,
                           .max_seqs = cfg->max_seqs, .max_steps_in_flight = c->cfg.steps_in_flight,
                           .n_replicas = (int)cfg->replicas, .replicas = caps};
        if (!(c->sched = sched_create(&sc, err)))
            rc = err ? err->code : STRATA_ENOMEM;
        for (uint32_t r = 0; c->sched && r < cfg->replicas; r++)
            sched_set_available(c->sched, (int)r, false);   /* until its workers are ready */
    }
    free(caps);
    if (rc == STRATA_OK && cfg->prefix_cache_bytes)
        rc = prefix_cache_setup(c, err);
    for (uint32_t r = 0; rc == STRATA_OK && r < cfg->replicas; r++) {
        creplica *rp = &c->reps[r];
        size_t n = cfg->max_seqs;
        rp->stages = calloc(cfg->stages, sizeof *rp->stages);
        rp->flights = calloc(c->cfg.steps_in_flight, sizeof *rp->flights);
        if (!rp->stages || !rp->flights) {
            rc = strata_fail(err, STRATA_ENOMEM, "out of memory");
            break;
        }
        for (uint32_t k = 0; k < c->cfg.steps_in_flight; k++) {
            flight *f = &rp->flights[k];
            f->tokens = calloc(n, sizeof *f->tokens);
            f->sampled = calloc(n, sizeof *f->sampled);
            f->status = calloc(n, sizeof *f->status);
            f->prefix_failed = calloc(n, sizeof *f->prefix_failed);
            f->message = calloc(n, sizeof *f->message);
            f->works = calloc(n, sizeof *f->works);
            f->work_ptrs = calloc(n, sizeof *f->work_ptrs);
            f->plan_tokens = calloc(cfg->max_batch_tokens, sizeof *f->plan_tokens);
            f->outcomes = calloc(n, sizeof *f->outcomes);
            if (!f->tokens || !f->sampled || !f->status || !f->prefix_failed || !f->message || !f->works || !f->work_ptrs ||
                !f->plan_tokens || !f->outcomes)
                rc = strata_fail(err, STRATA_ENOMEM, "out of memory");
        }
    }
    c->cap = cap;
    if (rc == STRATA_OK && (!(c->mig.send_ok = calloc(cfg->stages, sizeof *c->mig.send_ok)) ||
                            !(c->mig.recv_ok = calloc(cfg->stages, sizeof *c->mig.recv_ok))))
        rc = strata_fail(err, STRATA_ENOMEM, "out of memory");
    if (rc == STRATA_OK && cfg->metrics)
        rc = coord_register_metrics(c, cfg->metrics, err);
    if (rc == STRATA_OK) {
        if (pthread_create(&c->thread, NULL, coord_step_thread, c) != 0)
            rc = strata_fail(err, STRATA_ENOMEM, "coordinator: cannot start the step thread");
        else
            c->thread_started = true;
    }
    if (rc != STRATA_OK) {
        coord_destroy(c);
        return NULL;
    }
    char streaming[96] = "";
    /* stream_blocks counts one layer's blocks, the others rows of every layer: what one sequence
     * alone may reach is the smaller of it and what the tiers hold. */
    size_t alone = cap.stream_blocks < cap.total_blocks ? cap.stream_blocks : cap.total_blocks;
    if (alone > cap.device_blocks)
        snprintf(streaming, sizeof streaming, ", up to %zu for a sequence alone (streaming its layers)", alone);
    char others[512] = "";
    for (int i = 1; i < c->n_plans; i++)
        snprintf(others + strlen(others), sizeof others - strlen(others), "%s%s", i > 1 ? ", " : " (requests may name ",
                 c->plan_names[i]);
    if (c->n_plans > 1)
        snprintf(others + strlen(others), sizeof others - strlen(others), ")");
    coord_logf(c, "model %s: %d layers in %u stages x %u replicas, KV %s%s, context %u; KV blocks of %u tokens per replica: "
               "%zu on the device%s, %zu in all tiers", c->model_name, c->mc.n_layers, cfg->stages, cfg->replicas,
               c->kv_canonical, others, c->cfg.ctx, cfg->block_tokens, cap.device_blocks, streaming, cap.total_blocks);
    return c;
}

bool coord_wait_ready(coord *c, int timeout_ms)
{
    const struct timespec until = strata_realtime_after_ms(timeout_ms);
    pthread_mutex_lock(&c->mu);
    for (;;) {
        bool all = true;
        for (uint32_t r = 0; r < c->cfg.replicas; r++)
            all &= c->reps[r].serving;
        if (all || c->stopping || pthread_cond_timedwait(&c->changed, &c->mu, &until) == ETIMEDOUT) {
            pthread_mutex_unlock(&c->mu);
            return all;
        }
    }
}

void coord_worker_counts(coord *c, uint32_t *ready, uint32_t *total)
{
    pthread_mutex_lock(&c->mu);
    *ready = coord_ready_workers(c);
    *total = workers_total(c);
    pthread_mutex_unlock(&c->mu);
}

int coord_drain(coord *c, int drain_ms)
{
    const struct timespec until = strata_realtime_after_ms(drain_ms);
    pthread_mutex_lock(&c->mu);
    c->draining = true;
    while (c->n_reqs && pthread_cond_timedwait(&c->changed, &c->mu, &until) != ETIMEDOUT) {
    }
    int left = (int)c->n_reqs;
    pthread_mutex_unlock(&c->mu);
    return left;
}

void coord_stop(coord *c)
{
    if (!c)
        return;
    pthread_mutex_lock(&c->mu);
    c->stopping = true;
    for (uint32_t r = 0; c->reps && r < c->cfg.replicas; r++)   /* a failed coord_create stops early */
        for (uint32_t s = 0; c->reps[r].stages && s < c->cfg.stages; s++)
            if (c->reps[r].stages[s].peer)
                coord_send_shutdown(c->reps[r].stages[s].peer, false);
    pthread_cond_broadcast(&c->wake);
    pthread_cond_broadcast(&c->changed);
    pthread_mutex_unlock(&c->mu);
    if (c->thread_started) {
        pthread_join(c->thread, NULL);
        c->thread_started = false;
    }
}

void coord_destroy(coord *c)
{
    if (!c)
        return;
    coord_stop(c);
    for (size_t i = 0; i < c->n_reqs; i++) {   /* none after api_server_shutdown; be safe */
        text_stream_free(&c->reqs[i]->ts);
        free(c->reqs[i]->prompt);
        free(c->reqs[i]->generated);
        free(c->reqs[i]);
    }
    free(c->reqs);
    for (uint32_t r = 0; c->reps && r < c->cfg.replicas; r++) {
        creplica *rp = &c->reps[r];
        for (uint32_t s = 0; rp->stages && s < c->cfg.stages; s++)
            ctl_peer_unref(rp->stages[s].peer);
        free(rp->stages);
        for (uint32_t k = 0; rp->flights && k < c->cfg.steps_in_flight; k++) {
            flight *f = &rp->flights[k];
            free(f->tokens);
            free(f->sampled);
            free(f->status);
            free(f->prefix_failed);
            free(f->message);
            free(f->works);
            free(f->work_ptrs);
            free(f->plan_tokens);
            free(f->outcomes);
        }
        free(rp->flights);
    }
    for (uint32_t r = 0; c->reps && r < c->cfg.replicas; r++) {
        free(c->reps[r].parks);
        free(c->reps[r].park_ptrs);
        free(c->reps[r].drops);
    }
    free(c->reps);
    prefix_index_destroy(c->prefixes);
    free(c->prefix_row_bytes);
    free(c->prefix_usable);
    free(c->mig.send_ok);
    free(c->mig.recv_ok);
    sched_destroy(c->sched);
    for (int i = 0; c->plans && i < c->n_plans; i++) {
        if (i > 0)
            free(c->plans[i]);   /* plans[0] is codecs */
        free(c->plan_names[i]);
    }
    free(c->plans);
    free(c->plan_names);
    free(c->kv_canonical);
    free(c->codecs);
    free(c->layer_begin);
    free(c->stage_layers);
    tokenizer_free(c->tok);
    pthread_cond_destroy(&c->wake);
    pthread_cond_destroy(&c->changed);
    pthread_mutex_destroy(&c->mu);
    free(c);
}
