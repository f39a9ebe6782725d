/* The coordinator's core (coord.h). */
#include "coordinator/service/coord.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "coordinator/sched/kv_rows.h"
#include "coordinator/sched/layer_split.h"
#include "coordinator/sched/prefix_index.h"
#include "coordinator/sched/scheduler.h"
#include "kvstore/kv_cache.h"
#include "kvstore/plan.h"
#include "proto/grpc_util.h"
#include "proto/strata_internal.pb-c.h"
#include "worker/model.h"
#include "worker/textstream.h"
#include "worker/tokenizer.h"

#define TIER_DEVICE 0
#define TIER_HOST 1
#define TIER_NVME 2
#define N_TIERS 3
static const char *const tier_names[N_TIERS] = {"device", "host", "nvme"};

/* One Generate request, from accept to its terminal call. */
typedef struct creq {
    uint64_t id;                 /* sequence id (scheduler and workers) */
    api_stream *stream;
    const Strata__V1__GenerateRequest *req;   /* valid until the terminal call */
    int32_t *prompt;
    size_t n_prompt;
    size_t n_generated;
    /* Recovery: the tokens its sequence prefills (the prompt; after its KV was lost, the prompt
     * and the tokens sampled before, which the sequence then recomputes), how many of those were
     * sampled (the worker's sampler skips them), and how often it was recovered. */
    size_t n_input;
    size_t sampled_before;
    uint32_t recoveries;
    bool recovering;             /* lose_replica: its old sequence is finished, a new one follows */
    uint32_t last_token;
    text_stream ts;
    double t_accept, t_last;
    int plan;                    /* index in coord.plans: 0 the server's, else the request's kv_codec */
    bool stay;                   /* a migration of it failed without moving it: the drain waits for it */
    /* Prefix caching: the entry its input may start from (pinned until its first step goes out
     * or it ends), and the input tokens that step took from it (0: prefilled whole). */
    uint64_t prefix_entry;
    bool pinned, started;
    size_t cached;
    int32_t *generated;          /* the sampled ids: a recovery's input, the entry it may leave */
    size_t cap_generated;
} creq;

/* A (replica, stage) place for a worker. */
typedef struct slot {
    ctl_peer *peer;              /* referenced while set */
    char name[CTL_MAX_WORKER_NAME + 1];
    char data_addr[256];
    uint32_t worker_id;
    bool ready;                  /* sent its first KvReport after the assignment */
    uint64_t tier_blocks[N_TIERS], tier_bytes[N_TIERS], tier_capacity[N_TIERS];
    uint64_t spills, restores, crc_failures, spill_failures, restore_failures;
    uint32_t migrates_pending;   /* Migrate messages sent to it and not answered yet */
    uint64_t last_answered;      /* the step it answered last (0: none yet) */
} slot;

/* A step out: sent to every stage of its replica, waiting for their answers. */
typedef struct flight {
    uint64_t step;
    double t_sent;
    bool overdue;                /* its silent stages were ended (step_timeout_ms) */
    uint32_t answers;
    uint64_t answered;           /* bit s: stage s answered (at most 64 stages) */
    size_t n_work;
    /* Every array is allocated once (max_seqs entries, max_batch_tokens tokens: the scheduler's
     * limits, test_sched): a step once planned is out, and running out of memory while sending
     * or finishing it would leave the scheduler waiting for it. */
    Strata__Internal__V1__SeqWork *works;   /* the step's work as sent (seq_id, sample, ...) */
    Strata__Internal__V1__SeqWork **work_ptrs;
    uint32_t *plan_tokens;
    uint32_t *tokens;
    bool *sampled;
    int *status;
    bool *prefix_failed;         /* a stage could not start it from its prefix entry (SeqResult) */
    char (*message)[640];        /* a worker's message (up to 512 bytes) and where it came from */
    sched_outcome *outcomes;
} flight;

typedef struct creplica {
    slot *stages;
    uint32_t joined;
    bool assigned;               /* assignments went out: the slots are bound together */
    bool serving;                /* every stage ready */
    bool tearing_down;           /* lost a worker: waiting for the others to leave */
    /* Steps out: up to one per stage, so that every stage of the pipeline has one to run (each
     * stage runs its steps in order, the rows of one step following another's on the links). */
    flight *flights;             /* steps_in_flight entries, the first n_flights out */
    uint32_t n_flights;
    uint64_t last_step;          /* the newest step sent (a worker cannot answer a later one) */
    /* Prefix caching: parks for the replica's next step plan (finished sequences whose first
     * tokens its workers keep), and room for the plan's drops. */
    Strata__Internal__V1__PrefixPark *parks, **park_ptrs;
    size_t n_parks, cap_parks;
    uint64_t *drops;
    size_t cap_drops;
} creplica;

/* The one migration in progress: a request's sequence moving from replica `from` to `to`, every
 * stage i of `from` sending its blocks to stage i of `to`. Both replicas plan no step meanwhile. */
typedef struct migration {
    bool active, sent, overdue;
    double t_sent;
    uint64_t seq;
    uint32_t from, to;
    uint32_t answers;            /* MigrateDone received, of 2 * stages */
    bool *send_ok, *recv_ok;     /* per stage */
    char why[512];               /* the first failure */
} migration;

/* A drain of one replica (DrainWorker): move what can move, let the rest finish, stop it. */
typedef struct drain_state {
    bool active, done;
    uint32_t replica;
    uint32_t moved, failed;
    char worker[CTL_MAX_WORKER_NAME + 1];
    uint32_t worker_id;          /* the drained worker's join (a restarted one has a new id) */
    char message[512];
} drain_state;

#define COORD_MAX_PLANS 64   /* the server's plan and up to 63 that requests may choose (a stage's limit) */

typedef struct coord_metrics {
    metrics_counter *requests, *tokens, *spills, *restores, *crc, *spill_failures, *restore_failures;
    metrics_counter *finished[5];   /* stop, length, abort, error, cancelled */
    metrics_counter *prefix_hits, *prefix_hit_tokens, *recovered;
    metrics_gauge *prefix_entries, *prefix_bytes;
    metrics_histogram *ttft, *itl;
    metrics_gauge *queue, *running, *workers_ready;
    metrics_gauge *tier_blocks[N_TIERS], *tier_bytes[N_TIERS], *tier_capacity[N_TIERS];
} coord_metrics;
enum { FIN_STOP, FIN_LENGTH, FIN_ABORT, FIN_ERROR, FIN_CANCELLED };

struct coord {
    coord_config cfg;
    atomic_ulong workers_refused;   /* by the control server's Join checks (on_refused) */
    char model_path[4096];
    char *kv_canonical;          /* the server's own plan, canonical (kv_plan_name) */
    model_config mc;
    tokenizer *tok;
    kv_codec_params *codecs;     /* mc.n_layers: the server's plan, plans[0] */
    /* The plans a request may use: [0] the server's (codecs), then --kv-codecs; each mc.n_layers
     * codecs and its canonical form (what a request's kv_codec is compared with). */
    kv_codec_params **plans;
    char **plan_names;
    int n_plans;
    uint32_t *layer_begin;       /* stages + 1 entries */
    uint32_t *stage_layers;      /* stages entries: layer_begin's differences (ModelInfo) */
    proto_generate_limits limits;
    char model_name[128], arch[32];

    pthread_mutex_t mu;
    pthread_cond_t wake;         /* the step thread: something to plan */
    pthread_cond_t changed;      /* waiters: readiness or request count changed */
    pthread_t thread;
    bool thread_started, stopping, draining;

    scheduler *sched;
    creplica *reps;
    creq **reqs;
    size_t n_reqs, cap_reqs;
    uint64_t next_seq_id;
    uint32_t next_worker_id;
    uint64_t requests_total, tokens_total;
    uint64_t spills_total, restores_total, crc_total, spill_failures_total, restore_failures_total;

    coord_metrics m;
    bool have_metrics;
    migration mig;
    drain_state drain;
    sched_replica_config cap;    /* every replica's capacity */
    /* Prefix caching (NULL: off): the index, and per plan what one cached block row costs (0:
     * the plan cannot be cached: an OTT layer). */
    prefix_index *prefixes;
    uint64_t *prefix_row_bytes;
    bool *prefix_usable;         /* lookup scratch, one per replica */
    uint64_t prefix_hits, prefix_hit_tokens;
    uint64_t recovered_total;    /* recoveries of requests whose KV was lost */
    double orphaned_since;       /* every replica lost with requests left (0: not now): they wait
                                  * recovery_wait_ms for one to serve again */
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void logf_(const coord *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void logf_(const coord *c, const char *fmt, ...)
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

static creq *find_by_id(const coord *c, uint64_t id)
{
    for (size_t i = 0; i < c->n_reqs; i++)
        if (c->reqs[i]->id == id)
            return c->reqs[i];
    return NULL;
}

static creq *find_by_stream(const coord *c, const api_stream *st)
{
    for (size_t i = 0; i < c->n_reqs; i++)
        if (c->reqs[i]->stream == st)
            return c->reqs[i];
    return NULL;
}

static creq *find_by_request_id(const coord *c, const char *rid)
{
    for (size_t i = 0; i < c->n_reqs; i++)
        if (!strcmp(api_stream_request_id(c->reqs[i]->stream), rid))
            return c->reqs[i];
    return NULL;
}

/* Forgets q (its terminal call was made). */
static void drop_req(coord *c, creq *q)
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
static void offer_prefix(coord *c, creq *q, int r)
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
        logf_(c, "prefix cache: %s", err.msg);
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
static void lose_prefix(coord *c, uint64_t entry)
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
static void forget_prefixes(coord *c, uint32_t r)
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

static void count_finish(coord *c, int kind)
{
    if (c->have_metrics)
        metrics_counter_inc(c->m.finished[kind]);
}

/* Ends q with a failure whose sequence the scheduler has finished (or a step outcome finishes). */
static void end_failed(coord *c, creq *q, int code, const char *msg)
{
    api_stream_fail(q->stream, code, msg);
    count_finish(c, FIN_ERROR);
    drop_req(c, q);
}

/* Ends q with a failure, its sequence finished. */
static void fail_req(coord *c, creq *q, int code, const char *msg)
{
    sched_finish(c->sched, q->id);
    end_failed(c, q, code, msg);
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
        logf_(c, "layers per stage: %s (%s)", counts,
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

/* ---- workers ---- */

static void send_shutdown(ctl_peer *p, bool drain)
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
 * (a step it never runs, a migration it never answers), so that stream is ended: on_gone then
 * treats the worker as lost. STRATA_EIO and STRATA_EFULL mean the stream is already ending. */
static void send_or_end(coord *c, ctl_peer *p, const char *name,
                        const Strata__Internal__V1__CoordinatorMessage *m, const char *what)
{
    strata_error err = {0};
    int rc = ctl_peer_send(p, m, &err);
    if (rc == STRATA_OK)
        return;
    logf_(c, "%s to worker %s: %s", what, name, err.msg);
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
        send_or_end(c, rp->stages[s].peer, rp->stages[s].name, &m, "assignment");
    }
    rp->assigned = true;
    forget_prefixes(c, r);   /* fresh workers hold no entry */
    logf_(c, "replica %u: %u workers joined; assigned layers", r, c->cfg.stages);
}

static uint32_t ready_workers(const coord *c)
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
        logf_(c, "refused worker %s: %s", join->worker_name, err ? err->msg : "");
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
        logf_(c, "worker %s joined as replica %d stage %u (layers %u-%u)", sl->name, best, s, c->layer_begin[s],
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
        logf_(c, "refused a worker from %s: %s (%s; %lu refused so far)", peer, why,
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
        logf_(c, "worker %s: %" PRIu64 " more block(s) could not be spilled to NVMe (they stay in host memory)%s%s",
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
            logf_(c, "replica %u is serving", r);
            pthread_cond_broadcast(&c->changed);
            pthread_cond_signal(&c->wake);
        }
    }
}

static void finish_step(coord *c, uint32_t r, uint32_t k);
static void take_migrate_done(coord *c, uint32_t r, uint32_t s, const Strata__Internal__V1__MigrateDone *d);

/* "replica R stage S (worker NAME): what the worker said" (fallback when it said nothing). */
static void worker_message(const coord *c, uint32_t r, uint32_t s, const Strata__Internal__V1__SeqResult *sr,
                           const char *fallback, char *out, size_t cap)
{
    snprintf(out, cap, "replica %u stage %u (worker %s): %s", r, s, c->reps[r].stages[s].name,
             sr->message && *sr->message ? sr->message : fallback);
}

/* ---- admission ---- */

/* Of the first `cached` input tokens q's sequence took from a prefix entry, those of its prompt
 * (a recovered request's input goes on with its sampled tokens, which an entry may hold too). */
static size_t prompt_cached(const creq *q, size_t cached)
{
    return cached < q->n_prompt ? cached : q->n_prompt;
}

/* Hands q's sequence (q->id, its q->n_input tokens: the prompt, then after a recovery the tokens
 * sampled before) to the scheduler, to sample the tokens it may still sample. With prefix caching
 * it starts after the longest cached prefix of that input on a serving replica, the entry pinned
 * until its first step goes out (start_step) or it ends. */
static int submit_seq(coord *c, creq *q, strata_error *err)
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
    if (submit_seq(c, q, err) != STRATA_OK) {
        q->id = old;
        return false;
    }
    return true;
}

/* A request whose first step, a copy of its prefix entry, failed on a worker (the entry's park
 * failed there: out of host memory) starts over, prefilled whole. False (the caller fails the
 * request) when the scheduler refuses it. */
static bool restart_whole(coord *c, creq *q, const char *why)
{
    strata_error err = {0};
    if (!resubmit(c, q, &err)) {
        logf_(c, "request %s: its prefix copy failed (%s) and it cannot start over: %s",
              api_stream_request_id(q->stream), why, err.msg);
        return false;
    }
    logf_(c, "request %s: its prefix copy failed (%s); prefilling it whole", api_stream_request_id(q->stream), why);
    return true;
}

/* A worker's status for a sequence whose KV blocks could not be moved between tiers, read back
 * or verified (worker_failure_status's codes): its KV is damaged, its tokens are not. */
static bool kv_fault(int status)
{
    return status == STRATA_EIO || status == STRATA_ECRC;
}

/* Whether q, whose KV is lost (its replica, or a block a worker could not move or read back),
 * may go on from its tokens: it had none to lose yet, or it has recoveries left. */
static bool may_recover(const coord *c, const creq *q)
{
    return !q->started || q->recoveries < c->cfg.max_recoveries;
}

/* q's KV is lost (why): it goes on from its tokens (resubmit), its client seeing only a pause;
 * false (the caller fails it) when it cannot. Its old id must be finished (sched_finish, or the
 * step outcome that ends it). */
static bool recover(coord *c, creq *q, const char *why)
{
    const bool had_kv = q->started;
    const size_t tokens = q->n_prompt + q->n_generated;
    strata_error err = {0};
    if (!resubmit(c, q, &err)) {
        logf_(c, "request %s: %s; it cannot go on: %s", api_stream_request_id(q->stream), why, err.msg);
        return false;
    }
    if (!had_kv)
        return true;   /* only re-routed: nothing was computed, nothing is recomputed */
    q->recoveries++;
    c->recovered_total++;
    if (c->have_metrics)
        metrics_counter_inc(c->m.recovered);
    logf_(c, "request %s: %s; it goes on from its %zu tokens (%zu sampled), recomputing their KV (recovery %u of %u)",
          api_stream_request_id(q->stream), why, tokens, q->n_generated, q->recoveries, c->cfg.max_recoveries);
    return true;
}

/* ---- workers' answers, and their losses ---- */

/* The status a client sees for a worker's failure of its sequence. The coordinator checked the
 * request before admitting it, so a worker refusing the step as invalid (a plan or position it
 * disagrees with, a prefix entry it lacks) is our inconsistency, not the client's: EFORMAT,
 * whose gRPC status is INTERNAL, never INVALID_ARGUMENT telling the client to change its
 * request. Every other code keeps its meaning (ENOMEM/EFULL: out of room, EIO/ECRC: retry). */
static int worker_failure_status(uint32_t worker_status)
{
    return worker_status == STRATA_EINVAL ? STRATA_EFORMAT : (int)worker_status;
}

/* A worker whose answers no longer match what was asked of it (a step never sent, steps out of
 * order, a migration it was not asked for): whatever it sends next cannot be trusted, and the
 * step or migration it owes may never come, which would stall its replica for good. Its stream
 * is ended; on_gone then tears the replica down as for a lost worker (its requests end with
 * UNAVAILABLE and this reason) and the workers that join next rebuild it. */
static void end_worker(coord *c, uint32_t r, uint32_t s, const char *msg)
{
    logf_(c, "replica %u stage %u (worker %s): %s: ending its stream", r, s, c->reps[r].stages[s].name, msg);
    ctl_peer_close(c->reps[r].stages[s].peer, 13 /* GRPC_STATUS_INTERNAL */, msg);
}

static void out_of_step(coord *c, uint32_t r, uint32_t s, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void out_of_step(coord *c, uint32_t r, uint32_t s, const char *fmt, ...)
{
    char why[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    char msg[512];
    snprintf(msg, sizeof msg, "worker out of step with the coordinator: %s", why);
    end_worker(c, r, s, msg);
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
            out_of_step(c, r, s, "it answered step %" PRIu64 ", which was never sent (the last was %" PRIu64 ")",
                        res->step, rp->last_step);
        else if (res->step == last && last != 0)   /* its last answer again, that step over: a repeat */
            logf_(c, "replica %u stage %u (worker %s) answered step %" PRIu64 " again after it ended: ignored", r, s,
                  rp->stages[s].name, res->step);
        else   /* the step it owes is not this one, and may never come */
            out_of_step(c, r, s, "it answered step %" PRIu64 ", older than the step it owes (its last answer was to step "
                        "%" PRIu64 ")", res->step, last);
        return;
    }
    flight *f = &rp->flights[k];
    /* A stage's second answer to one step would end the step before the others answered. */
    if (f->answered >> s & 1) {
        logf_(c, "replica %u stage %u (worker %s) answered step %" PRIu64 " twice: the second answer is ignored", r,
              s, rp->stages[s].name, res->step);
        return;
    }
    /* A stage runs its steps in the order they were sent: an answer that skips one means the
     * skipped step's answer is lost or was sent under another number. */
    for (uint32_t j = 0; j < rp->n_flights; j++)
        if (rp->flights[j].step < res->step && !(rp->flights[j].answered >> s & 1)) {
            out_of_step(c, r, s, "it answered step %" PRIu64 " before step %" PRIu64, res->step, rp->flights[j].step);
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
                f->status[w] = worker_failure_status(sr->status);
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
        creq *q = !in_work && sr->status != 0 ? find_by_id(c, sr->seq_id) : NULL;
        if (q) {
            char msg[640];
            const int status = worker_failure_status(sr->status);
            worker_message(c, r, s, sr, "moving its KV blocks between tiers failed", msg, sizeof msg);
            if (kv_fault(status) && may_recover(c, q)) {
                sched_finish(c->sched, q->id);
                if (recover(c, q, msg))
                    continue;
                end_failed(c, q, status, msg);   /* its sequence is finished */
                continue;
            }
            logf_(c, "request %s failed: %s", api_stream_request_id(q->stream), msg);
            fail_req(c, q, status, msg);
        }
    }
    if (++f->answers == c->cfg.stages)
        finish_step(c, r, k);
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
            take_migrate_done(c, r, s, msg->migrate_done);
    }
    pthread_mutex_unlock(&c->mu);
}

/* lose_replica's choice for a request whose KV went with the replica: finish its sequence and
 * mark it to go on elsewhere (recover; true), or end it with UNAVAILABLE (false: q is gone). */
static bool recover_or_fail(coord *c, creq *q, bool elsewhere, const char *why)
{
    if (elsewhere && may_recover(c, q)) {
        sched_finish(c->sched, q->id);
        q->recovering = true;
        return true;
    }
    fail_req(c, q, STRATA_EIO, why);
    return false;
}

/* Takes replica r out of routing. Its requests go on on the other serving replicas from their
 * tokens (recover) while they have recoveries left; the others end with UNAVAILABLE. */
static void lose_replica(coord *c, uint32_t r, const char *why)
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
        creq *q = find_by_id(c, c->mig.seq);
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
     * rebuild it (drain_progress must not take the fresh replica for a drained one). */
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
            logf_(c, "%s", c->drain.message);
        }
    }
    forget_prefixes(c, r);
    sched_set_available(c->sched, (int)r, false);
    sched_set_accepting(c->sched, (int)r, true);   /* for its rebuild: whatever a drain or migration had set */
    rp->serving = false;
    rp->n_flights = 0;
    /* Now that r takes no request, the recovering ones go where the scheduler routes them. */
    for (size_t i = 0; i < c->n_reqs;) {
        creq *q = c->reqs[i];
        if (q->recovering) {
            q->recovering = false;
            if (!recover(c, q, why)) {
                end_failed(c, q, STRATA_EIO, why);   /* its old sequence is finished */
                continue;
            }
        }
        i++;
    }
    pthread_cond_broadcast(&c->wake);   /* the other replica of a migration may run again */
    /* With no replica left, queued requests would wait for workers that may never come: they
     * wait recovery_wait_ms at most (expire_orphans), or end now. */
    bool any = false;
    for (uint32_t k = 0; k < c->cfg.replicas; k++)
        any |= c->reps[k].serving;
    if (!any && c->n_reqs && may_wait) {
        if (!c->orphaned_since) {
            c->orphaned_since = now_s();
            logf_(c, "no replica is serving: %zu request(s) wait up to %.3g s for one to be rebuilt", c->n_reqs,
                  c->cfg.recovery_wait_ms / 1e3);
        }
        pthread_cond_signal(&c->wake);   /* the step thread times the wait */
    }
    while (!any && c->n_reqs && !c->orphaned_since)
        fail_req(c, c->reqs[0], STRATA_EIO, "no replica is serving: every replica lost a worker");
}

/* recovery_wait_ms: requests left with no replica serving end once no replica is back in time. */
static void expire_orphans(coord *c)
{
    if (!c->orphaned_since || now_s() - c->orphaned_since < c->cfg.recovery_wait_ms / 1e3)
        return;
    char msg[200];
    snprintf(msg, sizeof msg, "no replica is serving: every replica lost a worker, and none served again within %.3g s",
             c->cfg.recovery_wait_ms / 1e3);
    logf_(c, "%s: %zu request(s) end", msg, c->n_reqs);
    while (c->n_reqs)
        fail_req(c, c->reqs[0], STRATA_EIO, msg);
    c->orphaned_since = 0;
}

static void on_gone(void *ctx, ctl_peer *peer, int grpc_status, const char *why)
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
            logf_(c, "%s (gRPC status %d)", msg, grpc_status);
            if (rp->assigned && !rp->tearing_down) {
                rp->tearing_down = true;
                for (uint32_t k = 0; k < c->cfg.stages; k++)
                    rp->stages[k].ready = false;
                lose_replica(c, r, msg);
                for (uint32_t k = 0; k < c->cfg.stages; k++)
                    if (k != s && rp->stages[k].peer)
                        send_shutdown(rp->stages[k].peer, false);
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

/* ---- steps ---- */

static struct timespec realtime_after_ms(int ms);

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
    double t = now_s();
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
                fail_req(c, q, err.code, err.msg);
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
                        (uint32_t)prompt_cached(q, q->cached));
    count_finish(c, why == STRATA__V1__FINISH_REASON__FINISH_REASON_STOP ? FIN_STOP : FIN_LENGTH);
    if (q->generated)
        offer_prefix(c, q, sched_get_replica(c->sched, q->id));
    drop_req(c, q);
    return true;
}

/* Every stage answered replica r's step flights[k]: stream the tokens, fail the failed, tell the
 * scheduler, and take the step off the flights. */
static void finish_step(coord *c, uint32_t r, uint32_t k)
{
    creplica *rp = &c->reps[r];
    flight *f = &rp->flights[k];
    sched_outcome *out = f->outcomes;
    for (size_t w = 0; w < f->n_work; w++) {
        creq *q = find_by_id(c, f->works[w].seq_id);
        bool ended = true;
        if (f->status[w] != 0 && f->prefix_failed[w] && f->works[w].prefix_entry)
            lose_prefix(c, f->works[w].prefix_entry);   /* a worker lacks it: never again */
        if (f->status[w] == 0 && f->works[w].prefix_entry) {
            const size_t hit = q ? prompt_cached(q, f->works[w].pos0) : 0;
            c->prefix_hits++;
            c->prefix_hit_tokens += hit;
            if (c->have_metrics) {
                metrics_counter_inc(c->m.prefix_hits);
                metrics_counter_add(c->m.prefix_hit_tokens, hit);
            }
        }
        if (q && f->status[w] != 0 && f->prefix_failed[w] && f->works[w].prefix_entry &&
            restart_whole(c, q, f->message[w])) {
            /* The copy was an optimization: the request starts over as a new sequence, prefilled
             * whole, and the client never sees the failure. Its old sequence ends below. */
        } else if (q && f->status[w] != 0 && kv_fault(f->status[w]) && may_recover(c, q) &&
                   recover(c, q, f->message[w])) {
            /* Its KV is damaged: it goes on as a new sequence; the old one ends below. */
        } else if (q && f->status[w] != 0) {
            logf_(c, "request %s failed: %s", api_stream_request_id(q->stream), f->message[w]);
            end_failed(c, q, f->status[w], f->message[w]);   /* the step's outcome ends its sequence */
        } else if (q && !f->works[w].sample) {
            ended = false;   /* a prompt chunk ran; the next one (or the token) comes later */
        } else if (q && !f->sampled[w]) {
            end_failed(c, q, STRATA_EIO, "the last stage returned no token for this request");
        } else if (q) {
            ended = deliver(c, q, f->tokens[w]);
        }
        out[w] = (sched_outcome){.id = f->works[w].seq_id, .finished = ended};
    }
    strata_error err = {0};
    if (sched_step_done(c->sched, (int)r, f->step, out, f->n_work, &err) != STRATA_OK)
        logf_(c, "replica %u step %" PRIu64 ": %s", r, f->step, err.msg);
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
static bool start_step(coord *c, uint32_t r)
{
    creplica *rp = &c->reps[r];
    flight *f = &rp->flights[rp->n_flights];
    sched_plan plan;
    strata_error err = {0};
    if (sched_next_step(c->sched, (int)r, &plan, &err) != STRATA_OK) {
        logf_(c, "replica %u: %s", r, err.msg);
        return false;
    }
    if (plan.step == 0)
        return false;
    Strata__Internal__V1__SeqWork *works = f->works, **wp = f->work_ptrs;
    uint32_t *toks = f->plan_tokens;
    size_t at = 0;
    for (size_t i = 0; i < plan.n_work; i++) {
        const sched_work *sw = &plan.work[i];
        creq *q = find_by_id(c, sw->id);
        Strata__Internal__V1__SeqWork *w = &works[i];
        strata__internal__v1__seq_work__init(w);
        w->seq_id = sw->id;
        w->pos0 = (uint32_t)sw->pos0;
        w->tokens = toks + at;
        w->n_tokens = sw->n_tokens;
        if (!q->started) {   /* its first step: from its prefix entry when the scheduler kept it */
            q->started = true;
            q->cached = sw->pos0;
            if (sw->pos0 > 0)   /* counted as a hit once the copy succeeded (finish_step) */
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
    f->t_sent = now_s();
    f->overdue = false;
    rp->last_step = plan.step;
    f->n_work = plan.n_work;
    f->answers = 0;
    f->answered = 0;
    rp->n_flights++;
    char what[64];
    snprintf(what, sizeof what, "replica %u step %" PRIu64, r, plan.step);
    /* After a failed send on_gone tears the replica down, and its requests end with the reason. */
    for (uint32_t s = 0; s < c->cfg.stages; s++)
        send_or_end(c, rp->stages[s].peer, rp->stages[s].name, &m, what);
    /* The entries its new sequences copy went out with the plan (before any later drop). */
    for (size_t i = 0; i < plan.n_work; i++) {
        creq *q = find_by_id(c, plan.work[i].id);
        if (q && q->pinned) {
            prefix_index_unpin(c->prefixes, q->prefix_entry);
            q->pinned = false;
        }
    }
    return true;
}


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
    send_or_end(c, c->reps[r].stages[s].peer, c->reps[r].stages[s].name, &m, "migrate");
}

/* Sends the Migrate pairs once neither replica has a step out (receivers first: they wait). */
static void migration_kick(coord *c)
{
    migration *mg = &c->mig;
    if (!mg->active || mg->sent || c->reps[mg->from].n_flights || c->reps[mg->to].n_flights)
        return;
    for (uint32_t s = 0; s < c->cfg.stages; s++)
        send_migrate(c, mg->to, s, mg->from, false);
    for (uint32_t s = 0; s < c->cfg.stages; s++)
        send_migrate(c, mg->from, s, mg->to, true);
    mg->sent = true;
    mg->t_sent = now_s();
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
    migration_kick(c);
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
    creq *q = find_by_id(c, mg->seq);
    strata_error err = {0};
    if (all && q && sched_move(c->sched, mg->seq, (int)mg->to, &err) == STRATA_OK) {
        c->drain.moved += c->drain.active;
        logf_(c, "request %s moved from replica %u to %u", api_stream_request_id(q->stream), mg->from, mg->to);
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
            fail_req(c, q, STRATA_EIO, msg);
        } else if (q) {
            q->stay = true;
            logf_(c, "request %s stays on replica %u: migration failed: %s", api_stream_request_id(q->stream),
                  mg->from, mg->why);
        }
    }
    /* Only now: accepting again routes waiting requests at once, which must not take the room
     * the move was counted on (test_coord: test_destination_kept_free_during_move). */
    sched_set_accepting(c->sched, (int)mg->to, true);
    mg->active = false;
    pthread_cond_signal(&c->wake);
}

static void take_migrate_done(coord *c, uint32_t r, uint32_t s, const Strata__Internal__V1__MigrateDone *d)
{
    migration *mg = &c->mig;
    slot *sl = &c->reps[r].stages[s];
    if (sl->migrates_pending == 0) {
        out_of_step(c, r, s, "it finished a migration of sequence %" PRIu64 " that was not asked of it", d->seq_id);
        return;
    }
    /* A worker answers its Migrates in order: while older ones are pending (of migrations that
     * ended when the other replica was lost), this answer is to one of those. */
    if (--sl->migrates_pending > 0 || !mg->active || !mg->sent || (r != mg->from && r != mg->to))
        return;
    if (d->seq_id != mg->seq) {
        out_of_step(c, r, s, "it answered the migration of sequence %" PRIu64 " as sequence %" PRIu64, mg->seq,
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
static void drain_progress(coord *c)
{
    drain_state *d = &c->drain;
    if (!d->active || d->done || c->mig.active)
        return;
    creplica *rp = &c->reps[d->replica];
    if (!rp->serving) {   /* lost meanwhile (lose_replica ends the drain; kept for safety) */
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
        logf_(c, "%s", d->message);
        for (uint32_t s = 0; s < c->cfg.stages; s++)
            if (rp->stages[s].peer)
                send_shutdown(rp->stages[s].peer, true);
        rp->tearing_down = true;   /* on_gone rebuilds it from the workers that join next */
        rp->serving = false;
        forget_prefixes(c, d->replica);   /* they go with its workers (GetStats counted them until a rejoin) */
        sched_set_available(c->sched, (int)d->replica, false);
        sched_set_accepting(c->sched, (int)d->replica, true);
        (void)sched_set_steps_in_flight(c->sched, (int)d->replica, 0);
    }
}

/* step_timeout_ms: the workers that owe an answer to a step or a migration sent longer ago are
 * ended (each once); on_gone then tears their replicas down as for lost workers. Keepalive does
 * not notice a worker whose process is alive but stuck (a hung device, a deadlock). */
static void end_overdue(coord *c)
{
    const double limit = c->cfg.step_timeout_ms / 1e3, now = now_s();
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
                    end_worker(c, r, s, msg);
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
                    end_worker(c, both[i], s, msg);
                }
    }
}

static void *step_thread(void *arg)
{
    coord *c = arg;
    pthread_mutex_lock(&c->mu);
    while (!c->stopping) {
        bool started = false;
        migration_kick(c);
        drain_progress(c);
        for (uint32_t r = 0; r < c->cfg.replicas; r++)
            if (c->reps[r].serving && c->reps[r].n_flights < max_flights(c, r) &&
                !(c->mig.active && (r == c->mig.from || r == c->mig.to)))
                started |= start_step(c, r);
        if (c->cfg.step_timeout_ms)
            end_overdue(c);
        expire_orphans(c);
        if (started)
            continue;
        if (!c->cfg.step_timeout_ms && !c->orphaned_since) {
            pthread_cond_wait(&c->wake, &c->mu);
        } else {   /* looks again at least 4 times per timeout or wait, at most once per 10 ms */
            uint32_t tick = c->cfg.step_timeout_ms ? c->cfg.step_timeout_ms / 4 : 1000;
            if (c->orphaned_since && c->cfg.recovery_wait_ms / 4 < tick)
                tick = c->cfg.recovery_wait_ms / 4;
            const struct timespec until = realtime_after_ms(tick < 10 ? 10 : tick > 1000 ? 1000 : (int)tick);
            (void)pthread_cond_timedwait(&c->wake, &c->mu, &until);
        }
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
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

/* ---- the API backend ---- */

static uint32_t workers_total(const coord *c) { return c->cfg.replicas * c->cfg.stages; }
int coord_drain_worker(coord *c, const char *worker, coord_drain_report *out, strata_error *err);

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
    q->t_accept = now_s();
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
        rc = strata_fail(err, STRATA_EIO, "no replica is serving yet (%u of %u workers ready)", ready_workers(c),
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
        rc = submit_seq(c, q, err);
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
    creq *q = find_by_stream(c, stream);
    if (q) {   /* unknown: the request already ended */
        sched_finish(c->sched, q->id);
        api_stream_finish(stream);
        count_finish(c, FIN_CANCELLED);
        drop_req(c, q);
        pthread_cond_signal(&c->wake);
    }
    pthread_mutex_unlock(&c->mu);
}

static bool api_abort(void *ctx, const char *request_id)
{
    coord *c = ctx;
    pthread_mutex_lock(&c->mu);
    creq *q = find_by_request_id(c, request_id);
    if (q) {
        sched_finish(c->sched, q->id);
        api_stream_complete(q->stream, STRATA__V1__FINISH_REASON__FINISH_REASON_ABORT, (uint32_t)q->n_prompt,
                            (uint32_t)q->n_generated, 0);
        count_finish(c, FIN_ABORT);
        drop_req(c, q);
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
    out->workers_ready = ready_workers(c);
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

ctl_handler coord_ctl_handler(coord *c)
{
    return (ctl_handler){.ctx = c, .on_join = on_join, .on_message = on_message, .on_gone = on_gone,
                         .on_refused = on_refused};
}

const proto_generate_limits *coord_limits(const coord *c) { return &c->limits; }

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
        logf_(c, "draining replica %d (worker %s)", found, worker);
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
    metrics_gauge_set(c->m.workers_ready, (double)ready_workers(c));
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

static int register_metrics(coord *c, metrics_registry *reg, strata_error *err)
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
        rc = register_metrics(c, cfg->metrics, err);
    if (rc == STRATA_OK) {
        if (pthread_create(&c->thread, NULL, step_thread, c) != 0)
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
    logf_(c, "model %s: %d layers in %u stages x %u replicas, KV %s%s, context %u; KV blocks of %u tokens per replica: "
          "%zu on the device%s, %zu in all tiers", c->model_name, c->mc.n_layers, cfg->stages, cfg->replicas,
          c->kv_canonical, others, c->cfg.ctx, cfg->block_tokens, cap.device_blocks, streaming, cap.total_blocks);
    return c;
}

/* The CLOCK_REALTIME time ms from now (pthread_cond_timedwait's clock). */
static struct timespec realtime_after_ms(int ms)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    t.tv_sec += ms / 1000;
    t.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (t.tv_nsec >= 1000000000L) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000L;
    }
    return t;
}

bool coord_wait_ready(coord *c, int timeout_ms)
{
    const struct timespec until = realtime_after_ms(timeout_ms);
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
    *ready = ready_workers(c);
    *total = workers_total(c);
    pthread_mutex_unlock(&c->mu);
}

int coord_drain(coord *c, int drain_ms)
{
    const struct timespec until = realtime_after_ms(drain_ms);
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
                send_shutdown(c->reps[r].stages[s].peer, false);
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
