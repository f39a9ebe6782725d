/* The coordinator's core (design section 1): it joins the public API server (api_backend), the
 * control plane (ctl_handler) and the scheduler. It tokenizes requests, admits and routes them,
 * assigns joining workers to (replica, stage) slots with their layer ranges, drives one step in
 * flight per replica from a thread of its own, turns the sampled tokens into streamed text, and
 * ends every request exactly once: complete, abort, cancel, or failure (a worker lost mid-step
 * ends its replica's requests with UNAVAILABLE; the replica's other workers are told to stop and
 * the replica is rebuilt from the workers that join next).
 *
 * It never touches tensors: hidden states travel worker to worker over the data plane.
 *
 * Locking: one mutex guards all state; the API and control callbacks take it briefly, the step
 * thread takes it to plan. api_stream_* and ctl_peer_* calls are made with it held, as both
 * servers allow. */
#ifndef STRATA_COORDINATOR_SERVICE_COORD_H
#define STRATA_COORDINATOR_SERVICE_COORD_H

#include <stdbool.h>
#include <stdint.h>

#include "coordinator/control/control_server.h"
#include "coordinator/metrics/metrics.h"
#include "coordinator/server/api_server.h"
#include "kvstore/error.h"

typedef struct coord_config {
    const char *model_path;      /* GGUF; workers load the same path */
    uint32_t replicas;           /* data-parallel replicas, >= 1 */
    uint32_t stages;             /* workers per replica, 1..n_layers */
    const char *stage_layers;    /* how the layers split among the stages (layer_split.h): "even"
                                  * (NULL or ""), "balanced", or counts such as "19,11" */
    const char *kv;              /* default KV plan: codec name, "tada", range list, or a plan file */
    const char *kv_codecs;       /* other plans a request may name (kv_codec), ';'-separated (an entry
                                  * without ':' may list codec names with ','); NULL or "": none */
    uint32_t block_tokens;       /* tokens per KV block */
    uint32_t ctx;                /* serving context (prompt + output); 0: min(trained, 8192) */
    uint32_t max_seqs;           /* running sequences per replica */
    uint32_t max_batch_tokens;   /* tokens per step */
    uint32_t steps_in_flight;    /* steps a replica has out at once (0: stages; at most 64) */
    uint64_t device_kv_bytes;    /* granted to each worker; a worker must offer at least this */
    uint64_t host_kv_bytes;      /* 0: no host tier */
    uint64_t nvme_kv_bytes;      /* 0: no NVMe tier (needs a host tier) */
    uint64_t prefix_cache_bytes; /* per replica, over its workers' host memory; 0: no prefix caching */
    uint32_t step_timeout_ms;    /* a worker that has not answered a step or a migration this long is
                                  * ended as lost (a hung device); 0: wait for ever */
    uint32_t max_recoveries;     /* times a request whose KV was lost (its replica lost, a block that
                                  * could not be moved or read back) goes on from its tokens, its
                                  * KV recomputed, before it ends with the failure; 0: never */
    uint32_t recovery_wait_ms;   /* with no replica serving (a lone replica lost a worker), how long
                                  * its requests wait for one to be rebuilt before they end with
                                  * UNAVAILABLE; 0: they end at once */
    metrics_registry *metrics;   /* optional: the coordinator registers its series here */
    bool quiet;                  /* only errors on stderr */
} coord_config;

typedef struct coord coord;

/* Reads the model's configuration and tokenizer (no weights), checks the configuration against
 * it (layers per stage, the KV plan, budgets that hold at least one block) and starts the step
 * thread. Errors name the offending setting. */
coord *coord_create(const coord_config *c, strata_error *err);

/* The callbacks to plug into api_server_start and ctl_server_start. */
api_backend coord_api_backend(coord *c);
ctl_handler coord_ctl_handler(coord *c);

/* Limits for api_server_options.limits: max_tokens up to the serving context, token ids below
 * the vocabulary. Valid while c lives. */
const proto_generate_limits *coord_limits(const coord *c);

/* Drains the replica of a worker: no new requests go there; its running requests move to the
 * other replicas one by one (migration: each stage's KV blocks travel worker to worker over the
 * data plane, as their exact bytes), requests not started yet are re-routed, preempted ones
 * move once they resume there; then its workers are told to shut down (a supervisor restarts them and they
 * join as a fresh replica). Starts the drain and returns at once; calling again with the same
 * worker reports the progress (a worker of that name that joined again after the drain, with a
 * fresh worker id, is drained anew). STRATA_EINVAL: no such worker; STRATA_EFULL: no other replica to
 * move to, or another drain is running. */
typedef struct coord_drain_report {
    bool done;
    uint32_t replica, moved, remaining, failed;
    char message[512];
} coord_drain_report;
int coord_drain_worker(coord *c, const char *worker, coord_drain_report *out, strata_error *err);

/* Waits until every replica serves (true) or timeout_ms passes (false). */
bool coord_wait_ready(coord *c, int timeout_ms);

/* Workers joined and ready / the configuration's total. */
void coord_worker_counts(coord *c, uint32_t *ready, uint32_t *total);

/* Stops admitting (new Generate calls get UNAVAILABLE "server is draining") and waits up to
 * drain_ms for the requests in flight to end. Returns the number still running. */
int coord_drain(coord *c, int drain_ms);

/* Sends every worker Shutdown(drain=false) and stops the step thread; call after
 * api_server_shutdown and before ctl_server_shutdown. */
void coord_stop(coord *c);

/* Frees everything; after both servers are shut down. NULL is a no-op. */
void coord_destroy(coord *c);

#endif
