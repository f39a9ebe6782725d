/* Inside the coordinator's core (coord.h): the state every part of it shares, and the functions
 * one part calls in another. Not a contract for anything outside coordinator/service; each part
 * is one file:
 *   coord.c           requests, prefix caching, capacity, the plans a request may choose, life
 *   coord_admit.c     a request's sequence handed to the scheduler, first and after a recovery
 *   coord_workers.c   workers joining, reporting, answering, lost; the control handler
 *   coord_steps.c     steps planned, sent and finished; the step thread
 *   coord_migrate.c   a sequence moved between replicas; drains
 *   coord_api.c       the public API backend; the metrics
 * The functions expect coord.mu held, except the pure ones and those that take it themselves
 * (coord_on_gone, a control callback; coord_step_thread). */
#ifndef STRATA_COORDINATOR_SERVICE_COORD_INTERNAL_H
#define STRATA_COORDINATOR_SERVICE_COORD_INTERNAL_H

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
#include "kvstore/clock.h"
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
    bool recovering;             /* coord_lose_replica: its old sequence is finished, a new one follows */
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

static inline uint32_t workers_total(const coord *c) { return c->cfg.replicas * c->cfg.stages; }

/* One line on stderr, "strata-coordinator: ..." (nothing when cfg.quiet). */
void coord_logf(const coord *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* coord.c: requests, prefix caching, capacity, the plans, life. */
creq *coord_find_by_id(const coord *c, uint64_t id);
creq *coord_find_by_stream(const coord *c, const api_stream *st);
creq *coord_find_by_request_id(const coord *c, const char *rid);
void coord_drop_req(coord *c, creq *q);
void coord_offer_prefix(coord *c, creq *q, int r);
void coord_lose_prefix(coord *c, uint64_t entry);
void coord_forget_prefixes(coord *c, uint32_t r);
void coord_count_finish(coord *c, int kind);
void coord_end_failed(coord *c, creq *q, int code, const char *msg);
void coord_fail_req(coord *c, creq *q, int code, const char *msg);

/* coord_admit.c: a request's sequence handed to the scheduler, first and after its KV was lost. */
size_t coord_prompt_cached(const creq *q, size_t cached);
int coord_submit_seq(coord *c, creq *q, strata_error *err);
bool coord_restart_whole(coord *c, creq *q, const char *why);
bool coord_kv_fault(int status);
bool coord_may_recover(const coord *c, const creq *q);
bool coord_recover(coord *c, creq *q, const char *why);

/* coord_workers.c: workers joining, reporting, answering and lost. */
void coord_send_shutdown(ctl_peer *p, bool drain);
void coord_send_or_end(coord *c, ctl_peer *p, const char *name, const Strata__Internal__V1__CoordinatorMessage *m,
                       const char *what);
uint32_t coord_ready_workers(const coord *c);
int coord_worker_failure_status(uint32_t worker_status);
void coord_end_worker(coord *c, uint32_t r, uint32_t s, const char *msg);
void coord_out_of_step(coord *c, uint32_t r, uint32_t s, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
void coord_lose_replica(coord *c, uint32_t r, const char *why);
void coord_expire_orphans(coord *c);
void coord_on_gone(void *ctx, ctl_peer *peer, int grpc_status, const char *why);

/* coord_steps.c: steps: planning, sending, finishing; the step thread. */
void coord_finish_step(coord *c, uint32_t r, uint32_t k);
bool coord_start_step(coord *c, uint32_t r);
void *coord_step_thread(void *arg);

/* coord_migrate.c: migration of a sequence between replicas, and drains. */
void coord_migration_kick(coord *c);
void coord_take_migrate_done(coord *c, uint32_t r, uint32_t s, const Strata__Internal__V1__MigrateDone *d);
void coord_drain_progress(coord *c);

/* coord_api.c: the public API backend and the metrics. */
int coord_register_metrics(coord *c, metrics_registry *reg, strata_error *err);

#endif
