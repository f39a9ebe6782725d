/* The control plane (coordinator/control/control_server.h + worker/control/control_client.h)
 * over real gRPC on loopback, server and clients in this process, plus child processes (this
 * executable re-run with --control-child) for workers that die or hang: the Join checks (secret,
 * version, first message, name, refusal by on_join), ordering of 2000 messages each way on two
 * peers at once, 1 MiB messages both ways, oversized messages, on_gone exactly once for every
 * way a stream ends (worker close, kill, _exit, SIGSTOP + keepalive, ctl_peer_close, full send
 * queue, protocol error, server shutdown), peers used after on_gone through a reference, recv
 * timeouts, close while another thread is blocked in recv, and start errors. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>

#include "tests/test_time.h"
#include "coordinator/control/control_server.h"
#include "proto/grpc_util.h"
#include "proto/control_auth.h"
#include "worker/control/control_client.h"

extern char **environ;

static const char SECRET[] = "strata-test-cluster-secret-0123456789";
#define SECRET_LEN (sizeof SECRET - 1)

/* ---- the handler: records everything, checks order and callback overlap per peer ---- */

#define MAX_RECS 16

typedef struct peer_rec {
    ctl_peer *peer; /* referenced from on_join until the test drops it */
    char name[CTL_MAX_WORKER_NAME + 1];
    char device[32];
    int in_cb;
    int gone;
    int gone_status;
    char gone_why[256];
    int64_t gone_ms;
    uint64_t next_step; /* expected StepResult.step */
    int results;        /* StepResults received */
    int kv_reports;
    int big_ok;         /* 1 MiB StepResults that checked out */
} peer_rec;

typedef struct hstate {
    pthread_mutex_t mu;
    pthread_cond_t cond;
    int joins;
    int gones;
    int messages;
    int bad; /* checks that failed on a server thread (cmocka asserts only on the test's) */
    int join_rc; /* what on_join returns */
    int refused; /* on_refused calls */
    char refused_peer[128], refused_why[160];
    peer_rec recs[MAX_RECS];
    int n_recs;
} hstate;

#define H_CHECK(h, cond)                                                                          \
    do {                                                                                          \
        if (!(cond)) {                                                                            \
            (h)->bad++;                                                                           \
            fprintf(stderr, "handler check failed: %s (line %d)\n", #cond, __LINE__);            \
        }                                                                                         \
    } while (0)

static int on_join(void *ctx, ctl_peer *peer, const Strata__Internal__V1__Join *join, strata_error *err)
{
    hstate *h = ctx;
    pthread_mutex_lock(&h->mu);
    h->joins++;
    if (h->join_rc != STRATA_OK) {
        pthread_cond_broadcast(&h->cond);
        pthread_mutex_unlock(&h->mu);
        return strata_fail(err, h->join_rc, "no free worker slot for %s", join->worker_name);
    }
    H_CHECK(h, h->n_recs < MAX_RECS);
    peer_rec *r = &h->recs[h->n_recs % MAX_RECS];
    memset(r, 0, sizeof *r);
    int id = h->n_recs++;
    snprintf(r->name, sizeof r->name, "%s", join->worker_name);
    snprintf(r->device, sizeof r->device, "%s", join->device);
    r->peer = peer;
    ctl_peer_ref(peer);
    ctl_peer_set_user(peer, r);
    H_CHECK(h, strcmp(ctl_peer_name(peer), join->worker_name) == 0);
    H_CHECK(h, join->protocol_version == CTL_PROTOCOL_VERSION);
    /* The Assignment, sent from inside on_join while holding our own lock (allowed). */
    Strata__Internal__V1__Assignment a = STRATA__INTERNAL__V1__ASSIGNMENT__INIT;
    a.model_path = (char *)"models/test.gguf";
    a.worker_id = (uint32_t)id;
    a.layer_begin = 0;
    a.layer_end = 30;
    a.n_layers_total = 30;
    a.block_tokens = 64;
    Strata__Internal__V1__CoordinatorMessage m = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__INIT;
    m.kind_case = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_ASSIGNMENT;
    m.assignment = &a;
    H_CHECK(h, ctl_peer_send(peer, &m, NULL) == STRATA_OK);
    pthread_cond_broadcast(&h->cond);
    pthread_mutex_unlock(&h->mu);
    return STRATA_OK;
}

static void on_refused(void *ctx, const char *peer, int grpc_status, const char *why)
{
    hstate *h = ctx;
    pthread_mutex_lock(&h->mu);
    H_CHECK(h, grpc_status != GRPC_STATUS_OK);
    h->refused++;
    snprintf(h->refused_peer, sizeof h->refused_peer, "%s", peer);
    snprintf(h->refused_why, sizeof h->refused_why, "%s", why);
    pthread_cond_broadcast(&h->cond);
    pthread_mutex_unlock(&h->mu);
}

static void on_message(void *ctx, ctl_peer *peer, const Strata__Internal__V1__WorkerMessage *msg)
{
    hstate *h = ctx;
    peer_rec *r = ctl_peer_get_user(peer);
    pthread_mutex_lock(&h->mu);
    H_CHECK(h, r != NULL);
    if (!r) {
        pthread_mutex_unlock(&h->mu);
        return;
    }
    H_CHECK(h, r->in_cb == 0);
    H_CHECK(h, r->gone == 0);
    r->in_cb++;
    h->messages++;
    bool close_me = false;
    if (msg->kind_case == STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_STEP_RESULT) {
        const Strata__Internal__V1__StepResult *sr = msg->step_result;
        if (sr->n_results >= 10000) {
            /* The 1 MiB result: seq_id i, token 3i, message "seq <i> ...". */
            bool ok = true;
            for (size_t i = 0; ok && i < sr->n_results; i++) {
                char want[64];
                snprintf(want, sizeof want, "seq %zu failed with a long enough message", i);
                ok = sr->results[i]->seq_id == i && sr->results[i]->token == 3 * i &&
                     strcmp(sr->results[i]->message, want) == 0;
            }
            H_CHECK(h, ok);
            r->big_ok += ok;
        } else {
            H_CHECK(h, sr->step == r->next_step);
            r->next_step = sr->step + 1;
        }
        r->results++;
    } else if (msg->kind_case == STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_KV_REPORT) {
        r->kv_reports++;
        close_me = msg->kv_report->spills == 999;
    }
    r->in_cb--;
    pthread_cond_broadcast(&h->cond);
    pthread_mutex_unlock(&h->mu);
    if (close_me) /* closing from inside the callback: on_gone comes after it returns */
        ctl_peer_close(peer, GRPC_STATUS_ABORTED, "closed from on_message");
}

static void on_gone(void *ctx, ctl_peer *peer, int grpc_status, const char *why)
{
    hstate *h = ctx;
    peer_rec *r = ctl_peer_get_user(peer);
    pthread_mutex_lock(&h->mu);
    H_CHECK(h, r != NULL);
    if (r) {
        H_CHECK(h, r->in_cb == 0);
        r->gone++;
        r->gone_status = grpc_status;
        snprintf(r->gone_why, sizeof r->gone_why, "%s", why);
        r->gone_ms = now_ms();
        /* The peer is still usable here, and sends fail. */
        Strata__Internal__V1__Shutdown sd = STRATA__INTERNAL__V1__SHUTDOWN__INIT;
        Strata__Internal__V1__CoordinatorMessage m = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__INIT;
        m.kind_case = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_SHUTDOWN;
        m.shutdown = &sd;
        H_CHECK(h, ctl_peer_send(peer, &m, NULL) == STRATA_EIO);
    }
    h->gones++;
    pthread_cond_broadcast(&h->cond);
    pthread_mutex_unlock(&h->mu);
}

static void h_init(hstate *h)
{
    memset(h, 0, sizeof *h);
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->cond, NULL);
}

/* Drops the references on_join took; checks no handler check failed. */
static void h_finish(hstate *h)
{
    for (int i = 0; i < h->n_recs && i < MAX_RECS; i++)
        ctl_peer_unref(h->recs[i].peer);
    assert_int_equal(h->bad, 0);
    pthread_cond_destroy(&h->cond);
    pthread_mutex_destroy(&h->mu);
}

/* Waits (h->mu held) until cond holds or ms pass; evaluates to cond. */
#define WAIT_UNTIL(hs_, pred_, ms_)                                                                   \
    ({                                                                                            \
        int64_t until_ = now_ms() + (ms_);                                                         \
        while (!(pred_) && now_ms() < until_) {                                                    \
            struct timespec ts_;                                                                  \
            clock_gettime(CLOCK_REALTIME, &ts_);                                                  \
            ts_.tv_nsec += 20 * 1000000L;                                                         \
            if (ts_.tv_nsec >= 1000000000L) {                                                     \
                ts_.tv_sec++;                                                                     \
                ts_.tv_nsec -= 1000000000L;                                                       \
            }                                                                                     \
            pthread_cond_timedwait(&(hs_)->cond, &(hs_)->mu, &ts_);                                   \
        }                                                                                         \
        (pred_);                                                                                   \
    })

static peer_rec *rec_by_name(hstate *h, const char *name)
{
    for (int i = 0; i < h->n_recs && i < MAX_RECS; i++)
        if (strcmp(h->recs[i].name, name) == 0)
            return &h->recs[i];
    return NULL;
}

typedef struct srv_cfg {
    int keepalive_time_ms, keepalive_timeout_ms;
    uint32_t max_queued;
    size_t max_bytes;
    int join_timeout_ms;
    uint32_t max_waiting_per_host;
    const char *listen_addr;   /* NULL: 127.0.0.1:0 */
} srv_cfg;

static ctl_server *start_server(hstate *h, const srv_cfg *cfg)
{
    ctl_server_options o = ctl_server_options_default();
    o.listen_addr = "127.0.0.1:0";
    o.cluster_secret = SECRET;
    o.cluster_secret_len = SECRET_LEN;
    o.min_recv_ping_interval_ms = 100;
    if (cfg) {
        o.keepalive_time_ms = cfg->keepalive_time_ms;
        o.keepalive_timeout_ms = cfg->keepalive_timeout_ms;
        o.max_queued_messages = cfg->max_queued;
        o.max_message_bytes = cfg->max_bytes;
        o.join_timeout_ms = cfg->join_timeout_ms;
        o.max_waiting_per_host = cfg->max_waiting_per_host;
        if (cfg->listen_addr)
            o.listen_addr = cfg->listen_addr;
    }
    ctl_handler hd = {.ctx = h, .on_join = on_join, .on_message = on_message, .on_gone = on_gone,
                      .on_refused = on_refused};
    ctl_server *s = NULL;
    strata_error err = {0};
    int rc = ctl_server_start(&o, &hd, &s, &err);
    if (rc)
        fprintf(stderr, "ctl_server_start: %s\n", err.msg);
    assert_int_equal(rc, STRATA_OK);
    assert_true(ctl_server_port(s) > 0);
    return s;
}

static Strata__Internal__V1__Join make_join(const char *name, uint32_t version)
{
    Strata__Internal__V1__Join j = STRATA__INTERNAL__V1__JOIN__INIT;
    j.worker_name = (char *)name;
    j.device = (char *)"cuda:1";
    j.device_kv_bytes = 1u << 30;
    j.data_addr = (char *)"127.0.0.1:7000";
    j.protocol_version = version;
    return j;
}

static int connect_worker(int port, const char *name, const char *secret, uint32_t version, ctl_client **c,
                          strata_error *err)
{
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    Strata__Internal__V1__Join j = make_join(name, version);
    return ctl_client_connect(addr, secret, strlen(secret), &j, 5000, c, err);
}

/* Receives one message (waiting up to 5 s); fails the test on anything else. */
static Strata__Internal__V1__CoordinatorMessage *recv_one(ctl_client *c)
{
    Strata__Internal__V1__CoordinatorMessage *m = NULL;
    strata_error err = {0};
    int rc = ctl_client_recv(c, 5000, &m, &err);
    if (rc)
        fprintf(stderr, "ctl_client_recv: %s\n", err.msg);
    assert_int_equal(rc, STRATA_OK);
    assert_non_null(m);
    return m;
}

/* Receives until the stream ends (dropping messages); returns the EIO message. */
static void recv_end(ctl_client *c, char *msg, size_t cap)
{
    for (int i = 0; i < 100000; i++) {
        Strata__Internal__V1__CoordinatorMessage *m = NULL;
        strata_error err = {0};
        int rc = ctl_client_recv(c, 5000, &m, &err);
        if (m) {
            protobuf_c_message_free_unpacked(&m->base, NULL);
            continue;
        }
        assert_int_equal(rc, STRATA_EIO);
        snprintf(msg, cap, "%s", err.msg);
        return;
    }
    fail_msg("the stream did not end");
}

static int send_step_result(ctl_client *c, uint64_t step, strata_error *err)
{
    Strata__Internal__V1__StepResult sr = STRATA__INTERNAL__V1__STEP_RESULT__INIT;
    sr.step = step;
    Strata__Internal__V1__WorkerMessage m = STRATA__INTERNAL__V1__WORKER_MESSAGE__INIT;
    m.kind_case = STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_STEP_RESULT;
    m.step_result = &sr;
    return ctl_client_send(c, &m, err);
}

static int send_kv_report(ctl_client *c, uint64_t spills)
{
    Strata__Internal__V1__KvReport kr = STRATA__INTERNAL__V1__KV_REPORT__INIT;
    kr.spills = spills;
    Strata__Internal__V1__WorkerMessage m = STRATA__INTERNAL__V1__WORKER_MESSAGE__INIT;
    m.kind_case = STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_KV_REPORT;
    m.kv_report = &kr;
    return ctl_client_send(c, &m, NULL);
}

static int send_plan(ctl_peer *p, uint64_t step, strata_error *err)
{
    Strata__Internal__V1__StepPlan sp = STRATA__INTERNAL__V1__STEP_PLAN__INIT;
    sp.step = step;
    Strata__Internal__V1__CoordinatorMessage m = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__INIT;
    m.kind_case = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_STEP_PLAN;
    m.step_plan = &sp;
    return ctl_peer_send(p, &m, err);
}

/* ---- a raw C-core client for what ctl_client never sends ---- */

typedef struct raw_result {
    grpc_status_code status;
    char details[512];
} raw_result;

static grpc_byte_buffer *raw_recv(grpc_call *c, grpc_completion_queue *cq, bool first)
{
    grpc_metadata_array md;
    grpc_metadata_array_init(&md);
    grpc_byte_buffer *bb = NULL;
    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    size_t n = 0;
    if (first) {
        ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
        ops[n++].data.recv_initial_metadata.recv_initial_metadata = &md;
    }
    ops[n].op = GRPC_OP_RECV_MESSAGE;
    ops[n++].data.recv_message.recv_message = &bb;
    assert_int_equal(grpc_call_start_batch(c, ops, n, (void *)5, NULL), GRPC_CALL_OK);
    grpc_completion_queue_pluck(cq, (void *)5, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    grpc_metadata_array_destroy(&md);
    return bb;
}

/* A call of method on the server at port, its initial metadata sent (5 s deadline). */
typedef struct raw_conn {
    grpc_channel *ch;
    grpc_completion_queue *cq;
    grpc_call *c;
} raw_conn;

/* A call to method at host:port (host "127.0.0.1", "[::1]"), its initial metadata sent. */
static raw_conn raw_open_at(const char *host, int port, const char *method)
{
    char addr[64];
    snprintf(addr, sizeof addr, "%s:%d", host, port);
    raw_conn k;
    grpc_channel_credentials *creds = grpc_insecure_credentials_create();
    /* A connection of its own (gRPC would otherwise share one among channels to one address):
     * strangers' streams then come from many client ports, as a stranger's would. */
    grpc_arg own = {.type = GRPC_ARG_INTEGER, .key = (char *)GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, .value.integer = 1};
    grpc_channel_args args = {1, &own};
    k.ch = grpc_channel_create(addr, creds, &args);
    grpc_channel_credentials_release(creds);
    k.cq = grpc_completion_queue_create_for_pluck(NULL);
    gpr_timespec deadline = gpr_time_add(gpr_now(GPR_CLOCK_REALTIME), gpr_time_from_millis(5000, GPR_TIMESPAN));
    k.c = grpc_channel_create_call(k.ch, NULL, GRPC_PROPAGATE_DEFAULTS, k.cq, grpc_slice_from_static_string(method),
                                   NULL, deadline, NULL);
    assert_non_null(k.c);
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_SEND_INITIAL_METADATA;
    assert_int_equal(grpc_call_start_batch(k.c, &op, 1, (void *)1, NULL), GRPC_CALL_OK);
    grpc_completion_queue_pluck(k.cq, (void *)1, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    return k;
}

static raw_conn raw_open(int port, const char *method)
{
    return raw_open_at("127.0.0.1", port, method);
}

/* Sends bb (taken) as one message. */
static void raw_send(raw_conn *k, grpc_byte_buffer *bb)
{
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_SEND_MESSAGE;
    op.data.send_message.send_message = bb;
    assert_int_equal(grpc_call_start_batch(k->c, &op, 1, (void *)2, NULL), GRPC_CALL_OK);
    grpc_completion_queue_pluck(k->cq, (void *)2, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    grpc_byte_buffer_destroy(bb);
}

/* Half-closes, reads (and drops) what the server still sends, then its status into r, and frees
 * the call. md_received: the initial metadata was read already (with a first message). */
static void raw_finish(raw_conn *k, bool md_received, raw_result *r)
{
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    assert_int_equal(grpc_call_start_batch(k->c, &op, 1, (void *)3, NULL), GRPC_CALL_OK);
    grpc_completion_queue_pluck(k->cq, (void *)3, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    /* The status comes once the messages before it were read (the Challenge, at least). */
    grpc_byte_buffer *in;
    for (bool first = !md_received; (in = raw_recv(k->c, k->cq, first)); first = false)
        grpc_byte_buffer_destroy(in);
    grpc_metadata_array trailing;
    grpc_metadata_array_init(&trailing);
    grpc_slice details;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    op.data.recv_status_on_client.trailing_metadata = &trailing;
    op.data.recv_status_on_client.status = &r->status;
    op.data.recv_status_on_client.status_details = &details;
    assert_int_equal(grpc_call_start_batch(k->c, &op, 1, (void *)4, NULL), GRPC_CALL_OK);
    grpc_completion_queue_pluck(k->cq, (void *)4, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    snprintf(r->details, sizeof r->details, "%.*s", (int)GRPC_SLICE_LENGTH(details),
             (const char *)GRPC_SLICE_START_PTR(details));
    grpc_slice_unref(details);
    grpc_metadata_array_destroy(&trailing);
    grpc_call_unref(k->c);
    grpc_completion_queue_shutdown(k->cq);
    while (grpc_completion_queue_pluck(k->cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(k->cq);
    grpc_channel_destroy(k->ch);
}

/* Calls method with the given raw messages (then garbage bytes, when not NULL), half-closes and
 * reads the status. */
static void raw_call(int port, const char *method, const ProtobufCMessage *const *msgs, size_t n_msgs,
                     const char *garbage, raw_result *r)
{
    raw_conn k = raw_open(port, method);
    for (size_t i = 0; i < n_msgs; i++) {
        grpc_byte_buffer *bb = NULL;
        assert_int_equal(proto_pack(msgs[i], 1 << 20, &bb, NULL), STRATA_OK);
        raw_send(&k, bb);
    }
    if (garbage) {
        grpc_slice sl = grpc_slice_from_copied_string(garbage);
        raw_send(&k, grpc_raw_byte_buffer_create(&sl, 1));
        grpc_slice_unref(sl);
    }
    raw_finish(&k, false, r);
}

static Strata__Internal__V1__CoordinatorMessage *raw_unpack(grpc_byte_buffer *bb)
{
    ProtobufCMessage *m = NULL;
    assert_int_equal(proto_unpack(bb, &strata__internal__v1__coordinator_message__descriptor, 1 << 20, &m, NULL),
                     STRATA_OK);
    grpc_byte_buffer_destroy(bb);
    return (Strata__Internal__V1__CoordinatorMessage *)m;
}

/* A raw Attach that answers the Challenge with a Join of its own making: proof NULL computes the
 * right proof for this call's nonce (proto_control_proof, SECRET) and the name proof_for (NULL:
 * the Join's name), otherwise proof_len bytes of proof are sent as they are (a replay, a short
 * one). Reports this call's nonce and the proof sent (when it is 32 bytes), whether an Admitted
 * came and whether it held the coordinator's right proof, and the final status. */
typedef struct raw_attach_result {
    raw_result st;
    uint8_t nonce[PROTO_CONTROL_NONCE_BYTES];
    uint8_t proof_sent[PROTO_CONTROL_PROOF_BYTES];
    bool admitted, admitted_proof_ok;
} raw_attach_result;

static void raw_attach(int port, const char *name, const char *proof_for, const uint8_t *proof, size_t proof_len,
                       size_t worker_nonce_len, raw_attach_result *r)
{
    memset(r, 0, sizeof *r);
    raw_conn k = raw_open(port, CTL_ATTACH_METHOD);
    grpc_byte_buffer *bb = raw_recv(k.c, k.cq, true);
    assert_non_null(bb);
    Strata__Internal__V1__CoordinatorMessage *m = raw_unpack(bb);
    assert_int_equal(m->kind_case, STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_CHALLENGE);
    assert_int_equal(m->challenge->nonce.len, PROTO_CONTROL_NONCE_BYTES);
    memcpy(r->nonce, m->challenge->nonce.data, PROTO_CONTROL_NONCE_BYTES);
    protobuf_c_message_free_unpacked(&m->base, NULL);

    uint8_t worker_nonce[PROTO_CONTROL_NONCE_BYTES] = {7, 7, 7};   /* fixed: a replay reuses it */
    uint8_t own[PROTO_CONTROL_PROOF_BYTES];
    if (!proof) {
        assert_int_equal(proto_control_proof(PROTO_PROOF_WORKER, SECRET, SECRET_LEN, r->nonce, worker_nonce,
                                             proof_for ? proof_for : name, own, NULL), STRATA_OK);
        proof = own;
        proof_len = sizeof own;
    }
    if (proof_len == PROTO_CONTROL_PROOF_BYTES)
        memcpy(r->proof_sent, proof, proof_len);
    Strata__Internal__V1__Join j = make_join(name, CTL_PROTOCOL_VERSION);
    j.secret_proof = (ProtobufCBinaryData){proof_len, (uint8_t *)proof};
    j.worker_nonce = (ProtobufCBinaryData){worker_nonce_len, worker_nonce};
    Strata__Internal__V1__WorkerMessage wm = STRATA__INTERNAL__V1__WORKER_MESSAGE__INIT;
    wm.kind_case = STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_JOIN;
    wm.join = &j;
    assert_int_equal(proto_pack(&wm.base, 1 << 20, &bb, NULL), STRATA_OK);
    raw_send(&k, bb);

    /* The answer: Admitted (then the Assignment), or the end of the stream. */
    if ((bb = raw_recv(k.c, k.cq, false))) {
        m = raw_unpack(bb);
        r->admitted = m->kind_case == STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_ADMITTED;
        if (r->admitted) {
            uint8_t want[PROTO_CONTROL_PROOF_BYTES];
            assert_int_equal(proto_control_proof(PROTO_PROOF_COORDINATOR, SECRET, SECRET_LEN, r->nonce, worker_nonce,
                                                 name, want, NULL), STRATA_OK);
            r->admitted_proof_ok = proto_control_proof_equal(m->admitted->secret_proof.data,
                                                             m->admitted->secret_proof.len, want);
        }
        protobuf_c_message_free_unpacked(&m->base, NULL);
    }
    raw_finish(&k, true, &r->st);
}

/* ---- tests ---- */

static void test_join_accepted(void **state)
{
    (void)state;
    assert_int_equal(CTL_PROTOCOL_VERSION, CTL_CLIENT_PROTOCOL_VERSION);
    hstate h;
    h_init(&h);
    ctl_server *s = start_server(&h, NULL);
    ctl_client *c;
    strata_error err = {0};
    /* protocol_version 0: the client fills in its own. */
    assert_int_equal(connect_worker(ctl_server_port(s), "node0-gpu1", SECRET, 0, &c, &err), STRATA_OK);

    Strata__Internal__V1__CoordinatorMessage *m = recv_one(c);
    assert_int_equal(m->kind_case, STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_ASSIGNMENT);
    assert_string_equal(m->assignment->model_path, "models/test.gguf");
    assert_int_equal(m->assignment->layer_end, 30);
    protobuf_c_message_free_unpacked(&m->base, NULL);

    pthread_mutex_lock(&h.mu);
    assert_int_equal(h.joins, 1);
    peer_rec *r = rec_by_name(&h, "node0-gpu1");
    assert_non_null(r);
    assert_string_equal(r->device, "cuda:1");
    ctl_peer *p = r->peer;
    pthread_mutex_unlock(&h.mu);
    assert_string_equal(ctl_peer_name(p), "node0-gpu1");
    assert_true(strstr(ctl_peer_addr(p), "127.0.0.1") != NULL);
    assert_ptr_equal(ctl_peer_get_user(p), r);

    /* Nothing to receive: a timeout is STRATA_OK with no message, and the stream goes on. */
    int64_t t0 = now_ms();
    m = (void *)1;
    assert_int_equal(ctl_client_recv(c, 100, &m, &err), STRATA_OK);
    assert_null(m);
    assert_true(now_ms() - t0 >= 90);
    assert_int_equal(ctl_client_recv(c, 0, &m, &err), STRATA_OK);
    assert_null(m);
    assert_int_equal(ctl_client_status(c, NULL, 0), -1);
    /* The receive that timed out is still in flight; the next call picks the plan up. */
    assert_int_equal(send_plan(p, 7, &err), STRATA_OK);
    m = recv_one(c);
    assert_int_equal(m->kind_case, STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_STEP_PLAN);
    assert_int_equal(m->step_plan->step, 7);
    protobuf_c_message_free_unpacked(&m->base, NULL);

    assert_int_equal(send_kv_report(c, 1), STRATA_OK);
    assert_int_equal(send_step_result(c, 0, &err), STRATA_OK);
    pthread_mutex_lock(&h.mu);
    assert_true(WAIT_UNTIL(&h, r->results == 1 && r->kv_reports == 1, 5000));
    assert_int_equal(r->gone, 0);
    pthread_mutex_unlock(&h.mu);

    /* A clean close: on_gone once, with OK. */
    ctl_client_close(c);
    pthread_mutex_lock(&h.mu);
    assert_true(WAIT_UNTIL(&h, r->gone == 1, 5000));
    assert_int_equal(r->gone_status, GRPC_STATUS_OK);
    assert_true(strstr(r->gone_why, "closed") != NULL);
    pthread_mutex_unlock(&h.mu);
    sleep_ms(200);
    assert_int_equal(r->gone, 1);
    ctl_server_shutdown(s);
    assert_int_equal(h.gones, 1);
    h_finish(&h);
}

/* Connects and expects the stream to end with code and a message containing want (the refusal
 * can reach the client before or after connect returns). */
static void expect_refused(int port, const char *name, const char *secret, uint32_t version, grpc_status_code code,
                           const char *want)
{
    ctl_client *c = NULL;
    strata_error err = {0};
    int rc = connect_worker(port, name, secret, version, &c, &err);
    char msg[600];
    if (rc == STRATA_OK) {
        recv_end(c, msg, sizeof msg);
        char details[256];
        assert_int_equal(ctl_client_status(c, details, sizeof details), code);
        /* Sends fail too, with the same story. */
        strata_error e2 = {0};
        assert_int_equal(send_step_result(c, 1, &e2), STRATA_EIO);
        assert_true(strstr(e2.msg, proto_grpc_status_name(code)) != NULL);
        ctl_client_close(c);
    } else {
        assert_int_equal(rc, STRATA_EIO);
        snprintf(msg, sizeof msg, "%s", err.msg);
    }
    char full[600];
    snprintf(full, sizeof full, "%s: %s", proto_grpc_status_name(code), want);
    if (!strstr(msg, full))
        fail_msg("got \"%s\", want \"%s\"", msg, full);
}

/* The secret is proved over each call's nonces, never sent: a proof seen on one call does not
 * open another (the nonce differs), a proof of the wrong length or a worker nonce of the wrong
 * length is refused, and the coordinator's Admitted holds its own proof, before the Assignment.
 * (tests/control/test_worker_auth.py checks both formulas against Python's hmac.) */
static void test_secret_proofs(void **state)
{
    (void)state;
    hstate h;
    h_init(&h);
    ctl_server *s = start_server(&h, NULL);
    const int port = ctl_server_port(s);
    raw_attach_result a, b;
    raw_attach(port, "prover", NULL, NULL, 0, PROTO_CONTROL_NONCE_BYTES, &a);
    assert_int_equal(a.st.status, GRPC_STATUS_OK);
    assert_true(a.admitted);
    assert_true(a.admitted_proof_ok);
    /* The same proof and worker nonce on a new call: its Challenge differs, so the proof fails. */
    raw_attach(port, "prover-again", NULL, a.proof_sent, PROTO_CONTROL_PROOF_BYTES, PROTO_CONTROL_NONCE_BYTES, &b);
    assert_int_equal(b.st.status, GRPC_STATUS_PERMISSION_DENIED);
    assert_string_equal(b.st.details, "wrong cluster secret");
    assert_false(b.admitted);
    assert_memory_not_equal(a.nonce, b.nonce, PROTO_CONTROL_NONCE_BYTES);
    /* A right proof for another name: the name is part of what is proved. */
    raw_attach(port, "intruder", "prover", NULL, 0, PROTO_CONTROL_NONCE_BYTES, &b);
    assert_int_equal(b.st.status, GRPC_STATUS_PERMISSION_DENIED);
    assert_false(b.admitted);
    /* A proof one byte short, a worker nonce one byte short. */
    raw_attach(port, "prover", NULL, a.proof_sent, PROTO_CONTROL_PROOF_BYTES - 1, PROTO_CONTROL_NONCE_BYTES, &b);
    assert_int_equal(b.st.status, GRPC_STATUS_PERMISSION_DENIED);
    assert_false(b.admitted);
    raw_attach(port, "prover", NULL, NULL, 0, PROTO_CONTROL_NONCE_BYTES - 1, &b);
    assert_int_equal(b.st.status, GRPC_STATUS_INVALID_ARGUMENT);
    assert_string_equal(b.st.details, "Join.worker_nonce must be 32 bytes (got 31)");
    assert_false(b.admitted);
    pthread_mutex_lock(&h.mu);
    assert_int_equal(h.joins, 1);   /* on_join saw the one that proved the secret only */
    pthread_mutex_unlock(&h.mu);
    ctl_server_shutdown(s);
    h_finish(&h);
}

static void test_join_refusals(void **state)
{
    (void)state;
    hstate h;
    h_init(&h);
    ctl_server *s = start_server(&h, NULL);
    int port = ctl_server_port(s);

    expect_refused(port, "w", "not-the-cluster-secret-at-all-00000", CTL_PROTOCOL_VERSION, GRPC_STATUS_PERMISSION_DENIED,
                   "wrong cluster secret");
    /* A prefix of the secret is not the secret. */
    char prefix[SECRET_LEN];
    memcpy(prefix, SECRET, SECRET_LEN - 1);
    prefix[SECRET_LEN - 1] = 0;
    expect_refused(port, "w", prefix, CTL_PROTOCOL_VERSION, GRPC_STATUS_PERMISSION_DENIED, "wrong cluster secret");
    /* The version is checked first: a worker of another build cannot prove the secret in this
     * version's terms, and "wrong cluster secret" would send its operator the wrong way. */
    expect_refused(port, "w", "wrong-secret-and-wrong-version-0000", 2, GRPC_STATUS_FAILED_PRECONDITION,
                   "control protocol version mismatch: worker speaks 2, coordinator speaks 3");
    expect_refused(port, "w", SECRET, CTL_PROTOCOL_VERSION + 1, GRPC_STATUS_FAILED_PRECONDITION,
                   "control protocol version mismatch: worker speaks 4, coordinator speaks 3");
    expect_refused(port, "", SECRET, CTL_PROTOCOL_VERSION, GRPC_STATUS_INVALID_ARGUMENT, "Join.worker_name must be");
    expect_refused(port, "bad\nname", SECRET, CTL_PROTOCOL_VERSION, GRPC_STATUS_INVALID_ARGUMENT, "Join.worker_name must be");
    /* A first message above CTL_MAX_JOIN_BYTES is not decoded: a stranger's 64 MiB costs nothing
     * beyond gRPC's own buffer. */
    char *huge = malloc(CTL_MAX_JOIN_BYTES + 1);
    assert_non_null(huge);
    memset(huge, 'n', CTL_MAX_JOIN_BYTES);
    huge[CTL_MAX_JOIN_BYTES] = 0;
    expect_refused(port, huge, "not-the-cluster-secret-at-all-00000", CTL_PROTOCOL_VERSION, GRPC_STATUS_RESOURCE_EXHAUSTED,
                   "undecodable WorkerMessage: strata.internal.v1.WorkerMessage: message of 65644 bytes is above "
                   "the limit of 65536");
    free(huge);
    /* The handler heard of each (for the coordinator's log): the client may see its status
     * before the callback ran, so wait for the count. */
    pthread_mutex_lock(&h.mu);
    assert_int_equal(h.joins, 0);
    for (int i = 0; i < 500 && h.refused < 7; i++) {
        pthread_mutex_unlock(&h.mu);
        sleep_ms(10);
        pthread_mutex_lock(&h.mu);
    }
    assert_int_equal(h.refused, 7);
    assert_non_null(strstr(h.refused_why, "undecodable WorkerMessage"));
    assert_non_null(strstr(h.refused_peer, "127.0.0.1"));
    pthread_mutex_unlock(&h.mu);

    /* on_join refuses: its code and message become the status; no on_gone for it. */
    pthread_mutex_lock(&h.mu);
    h.join_rc = STRATA_EFULL;
    pthread_mutex_unlock(&h.mu);
    expect_refused(port, "late", SECRET, CTL_PROTOCOL_VERSION, GRPC_STATUS_RESOURCE_EXHAUSTED, "no free worker slot for late");
    pthread_mutex_lock(&h.mu);
    assert_int_equal(h.joins, 1);
    assert_int_equal(h.refused, 7);   /* on_join's own refusal is not reported back to it */
    h.join_rc = STRATA_OK;
    pthread_mutex_unlock(&h.mu);

    /* First message not a Join; a stream closed before any message; undecodable bytes; an
     * unknown method. */
    Strata__Internal__V1__StepResult sr = STRATA__INTERNAL__V1__STEP_RESULT__INIT;
    Strata__Internal__V1__WorkerMessage wm = STRATA__INTERNAL__V1__WORKER_MESSAGE__INIT;
    wm.kind_case = STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_STEP_RESULT;
    wm.step_result = &sr;
    const ProtobufCMessage *msgs[1] = {&wm.base};
    raw_result rr;
    raw_call(port, CTL_ATTACH_METHOD, msgs, 1, NULL, &rr);
    assert_int_equal(rr.status, GRPC_STATUS_INVALID_ARGUMENT);
    assert_string_equal(rr.details, "the first message of the control stream must be a Join (got step_result)");
    Strata__Internal__V1__WorkerMessage empty = STRATA__INTERNAL__V1__WORKER_MESSAGE__INIT;
    msgs[0] = &empty.base;
    raw_call(port, CTL_ATTACH_METHOD, msgs, 1, NULL, &rr);
    assert_int_equal(rr.status, GRPC_STATUS_INVALID_ARGUMENT);
    assert_true(strstr(rr.details, "must be a Join (got nothing)") != NULL);
    raw_call(port, CTL_ATTACH_METHOD, NULL, 0, NULL, &rr);
    assert_int_equal(rr.status, GRPC_STATUS_INVALID_ARGUMENT);
    assert_string_equal(rr.details, "control stream closed before a Join");
    raw_call(port, CTL_ATTACH_METHOD, NULL, 0, "\xff\xff\xff garbage", &rr);
    assert_int_equal(rr.status, GRPC_STATUS_INTERNAL);
    assert_true(strstr(rr.details, "undecodable WorkerMessage") != NULL);
    raw_call(port, "/strata.internal.v1.WorkerControl/Nope", NULL, 0, NULL, &rr);
    assert_int_equal(rr.status, GRPC_STATUS_UNIMPLEMENTED);
    assert_string_equal(rr.details, "unknown method /strata.internal.v1.WorkerControl/Nope");

    /* A protocol error after the Join (a second Join) ends a joined stream: on_gone once. */
    ctl_client *c;
    strata_error err = {0};
    assert_int_equal(connect_worker(port, "twice", SECRET, CTL_PROTOCOL_VERSION, &c, &err), STRATA_OK);
    Strata__Internal__V1__CoordinatorMessage *m = recv_one(c);
    protobuf_c_message_free_unpacked(&m->base, NULL);
    Strata__Internal__V1__Join j = make_join("twice", CTL_PROTOCOL_VERSION);
    Strata__Internal__V1__WorkerMessage jm = STRATA__INTERNAL__V1__WORKER_MESSAGE__INIT;
    jm.kind_case = STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_JOIN;
    jm.join = &j;
    assert_int_equal(ctl_client_send(c, &jm, &err), STRATA_OK);
    char msg[600];
    recv_end(c, msg, sizeof msg);
    assert_true(strstr(msg, "INVALID_ARGUMENT: Join sent twice") != NULL);
    ctl_client_close(c);
    pthread_mutex_lock(&h.mu);
    peer_rec *r = rec_by_name(&h, "twice");
    assert_non_null(r);
    assert_true(WAIT_UNTIL(&h, r->gone == 1, 5000));
    assert_int_equal(r->gone_status, GRPC_STATUS_INVALID_ARGUMENT);
    pthread_mutex_unlock(&h.mu);

    ctl_server_shutdown(s);
    assert_int_equal(h.gones, 1); /* only the joined one */
    h_finish(&h);
}

/* Strangers that open the stream and say nothing end with DEADLINE_EXCEEDED after the Join
 * timeout (each reported to on_refused); a worker joins beside them and is not timed out. */
static void test_join_deadline(void **state)
{
    (void)state;
    hstate h;
    h_init(&h);
    const srv_cfg cfg = {.join_timeout_ms = 1000};
    ctl_server *s = start_server(&h, &cfg);
    int port = ctl_server_port(s);

    raw_conn quiet[2];
    for (int i = 0; i < 2; i++) {
        quiet[i] = raw_open(port, CTL_ATTACH_METHOD);
        grpc_byte_buffer *challenge = raw_recv(quiet[i].c, quiet[i].cq, true);
        assert_non_null(challenge);
        grpc_byte_buffer_destroy(challenge);
    }
    ctl_client *c;
    strata_error err = {0};
    assert_int_equal(connect_worker(port, "prompt", SECRET, CTL_PROTOCOL_VERSION, &c, &err), STRATA_OK);

    /* Both reported (after the timeout and a tick), then their streams' ends read. */
    pthread_mutex_lock(&h.mu);
    assert_true(WAIT_UNTIL(&h, h.refused == 2, 10000));
    pthread_mutex_unlock(&h.mu);
    for (int i = 0; i < 2; i++) {
        raw_result late;
        raw_finish(&quiet[i], true, &late);
        assert_int_equal(late.status, GRPC_STATUS_DEADLINE_EXCEEDED);
        assert_string_equal(late.details, "no Join within 1000 ms of opening the control stream");
    }
    pthread_mutex_lock(&h.mu);
    assert_string_equal(h.refused_why, "no Join within 1000 ms of opening the control stream");
    assert_non_null(strstr(h.refused_peer, "127.0.0.1"));
    assert_int_equal(h.joins, 1);
    pthread_mutex_unlock(&h.mu);
    /* The joined worker was not timed out. */
    Strata__Internal__V1__CoordinatorMessage *m = recv_one(c);   /* its Assignment */
    assert_int_equal(m->kind_case, STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_ASSIGNMENT);
    protobuf_c_message_free_unpacked(&m->base, NULL);
    pthread_mutex_lock(&h.mu);
    assert_int_equal(h.gones, 0);
    pthread_mutex_unlock(&h.mu);
    ctl_client_close(c);
    ctl_server_shutdown(s);
    h_finish(&h);
}

/* A raw Attach at host:port that reads the Challenge and then says nothing. */
static raw_conn quiet_stream(const char *host, int port)
{
    raw_conn k = raw_open_at(host, port, CTL_ATTACH_METHOD);
    grpc_byte_buffer *challenge = raw_recv(k.c, k.cq, true);
    assert_non_null(challenge);
    grpc_byte_buffer_destroy(challenge);
    return k;
}

static bool ipv6_loopback(void)
{
    int fd = socket(AF_INET6, SOCK_STREAM, 0);
    if (fd < 0)
        return false;
    struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT};
    bool ok = bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
    close(fd);
    return ok;
}

/* At most 3 streams of one host wait for their Join, each stream on a connection of its own (the
 * key is the host, not the client port): a fourth ends that host's oldest with RESOURCE_EXHAUSTED
 * (reported), a worker still joins past strangers that fill the cap, and the streams of another
 * host (IPv6 loopback, when there is one, whose address gRPC writes "ipv6:%5B::1%5D:PORT") are
 * left alone, and capped the same way among themselves. */
static void test_waiting_cap(void **state)
{
    (void)state;
    const bool v6 = ipv6_loopback();
    if (!v6)
        fprintf(stderr, "test_waiting_cap: no IPv6 loopback here: the other host's streams are not checked\n");
    hstate h;
    h_init(&h);
    /* Two hosts need one port on both loopbacks: "[::]" (dual stack; every interface, for the
     * length of this test). The Join deadline stays out of the way. */
    const srv_cfg cfg = {.join_timeout_ms = 60000, .max_waiting_per_host = 3,
                         .listen_addr = v6 ? "[::]:0" : "127.0.0.1:0"};
    ctl_server *s = start_server(&h, &cfg);
    int port = ctl_server_port(s);

    raw_conn other[4];
    for (int i = 0; v6 && i < 4; i++)
        other[i] = quiet_stream("[::1]", port);
    raw_result r;
    if (v6) {   /* the fourth of ::1 pushed out the first of ::1 */
        raw_finish(&other[0], true, &r);
        assert_int_equal(r.status, GRPC_STATUS_RESOURCE_EXHAUSTED);
        assert_non_null(strstr(r.details, "3 control streams from ipv6:"));
        pthread_mutex_lock(&h.mu);
        assert_true(WAIT_UNTIL(&h, h.refused == 1, 5000));
        h.refused = 0;
        pthread_mutex_unlock(&h.mu);
    }
    raw_conn quiet[4];
    for (int i = 0; i < 4; i++)
        quiet[i] = quiet_stream("127.0.0.1", port);
    raw_finish(&quiet[0], true, &r);
    assert_int_equal(r.status, GRPC_STATUS_RESOURCE_EXHAUSTED);
    assert_string_equal(r.details, "3 control streams from ipv4:127.0.0.1 were waiting for their Join (the limit): "
                                   "the oldest gives way");
    pthread_mutex_lock(&h.mu);
    assert_true(WAIT_UNTIL(&h, h.refused == 1, 5000));
    assert_non_null(strstr(h.refused_peer, "127.0.0.1"));
    pthread_mutex_unlock(&h.mu);

    /* A worker of the same host joins: its stream pushes out the oldest stranger, not itself. */
    ctl_client *c;
    strata_error err = {0};
    assert_int_equal(connect_worker(port, "past-strangers", SECRET, CTL_PROTOCOL_VERSION, &c, &err), STRATA_OK);
    Strata__Internal__V1__CoordinatorMessage *m = recv_one(c);   /* its Assignment */
    assert_int_equal(m->kind_case, STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_ASSIGNMENT);
    protobuf_c_message_free_unpacked(&m->base, NULL);
    raw_finish(&quiet[1], true, &r);
    assert_int_equal(r.status, GRPC_STATUS_RESOURCE_EXHAUSTED);

    /* The rest were still waiting: half-closing them now is the "closed before a Join" refusal. */
    for (int i = 2; i < 4; i++) {
        raw_finish(&quiet[i], true, &r);
        assert_int_equal(r.status, GRPC_STATUS_INVALID_ARGUMENT);
        assert_string_equal(r.details, "control stream closed before a Join");
    }
    for (int i = 1; v6 && i < 4; i++) {
        raw_finish(&other[i], true, &r);
        assert_int_equal(r.status, GRPC_STATUS_INVALID_ARGUMENT);
        assert_string_equal(r.details, "control stream closed before a Join");
    }
    pthread_mutex_lock(&h.mu);
    assert_int_equal(h.joins, 1);
    assert_int_equal(h.refused, 2);   /* the two that gave way (a half-close is not reported) */
    pthread_mutex_unlock(&h.mu);
    ctl_client_close(c);
    ctl_server_shutdown(s);
    h_finish(&h);
}

/* A server on the control method that is no coordinator of ours: it answers the first Attach
 * with initial metadata and one message of the given bytes; with `then`, it reads one message
 * of the client's (its Join) and sends those bytes next; then it waits for the client to end the
 * call. */
typedef struct strange_coord {
    grpc_server *srv;
    grpc_completion_queue *cq;
    int port;
    const uint8_t *first, *then;
    size_t first_len, then_len;
    pthread_t thread;
} strange_coord;

/* One message of n bytes on call (a batch of its own, waited for). */
static void strange_send(strange_coord *sc, grpc_call *call, const uint8_t *bytes, size_t n)
{
    grpc_slice sl = grpc_slice_from_copied_buffer((const char *)bytes, n);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&sl, 1);
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_SEND_MESSAGE;
    op.data.send_message.send_message = bb;
    if (grpc_call_start_batch(call, &op, 1, (void *)4, NULL) == GRPC_CALL_OK)
        grpc_completion_queue_next(sc->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    grpc_byte_buffer_destroy(bb);
    grpc_slice_unref(sl);
}

static void *strange_main(void *arg)
{
    strange_coord *sc = arg;
    grpc_call *call = NULL;
    grpc_call_details details;
    grpc_metadata_array md;
    grpc_call_details_init(&details);
    grpc_metadata_array_init(&md);
    if (grpc_server_request_call(sc->srv, &call, &details, &md, sc->cq, sc->cq, (void *)1) == GRPC_CALL_OK &&
        grpc_completion_queue_next(sc->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).success) {
        grpc_op op;
        memset(&op, 0, sizeof op);
        op.op = GRPC_OP_SEND_INITIAL_METADATA;
        if (grpc_call_start_batch(call, &op, 1, (void *)2, NULL) == GRPC_CALL_OK)
            grpc_completion_queue_next(sc->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        strange_send(sc, call, sc->first, sc->first_len);
        if (sc->then) {
            grpc_byte_buffer *join = NULL;
            memset(&op, 0, sizeof op);
            op.op = GRPC_OP_RECV_MESSAGE;
            op.data.recv_message.recv_message = &join;
            if (grpc_call_start_batch(call, &op, 1, (void *)5, NULL) == GRPC_CALL_OK)
                grpc_completion_queue_next(sc->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
            if (join)
                grpc_byte_buffer_destroy(join);
            strange_send(sc, call, sc->then, sc->then_len);
        }
        int cancelled = 0;
        memset(&op, 0, sizeof op);
        op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
        op.data.recv_close_on_server.cancelled = &cancelled;
        if (grpc_call_start_batch(call, &op, 1, (void *)3, NULL) == GRPC_CALL_OK)
            grpc_completion_queue_next(sc->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);   /* the client ended it */
        grpc_call_unref(call);
    }
    grpc_call_details_destroy(&details);
    grpc_metadata_array_destroy(&md);
    return NULL;
}

static void strange_start(strange_coord *sc, const uint8_t *first, size_t first_len, const uint8_t *then,
                          size_t then_len)
{
    memset(sc, 0, sizeof *sc);
    sc->first = first;
    sc->first_len = first_len;
    sc->then = then;
    sc->then_len = then_len;
    grpc_init();   /* held until strange_stop: no server of ours holds gRPC meanwhile */
    sc->cq = grpc_completion_queue_create_for_next(NULL);
    sc->srv = grpc_server_create(NULL, NULL);
    grpc_server_register_completion_queue(sc->srv, sc->cq, NULL);
    grpc_server_credentials *creds = grpc_insecure_server_credentials_create();
    sc->port = grpc_server_add_http2_port(sc->srv, "127.0.0.1:0", creds);
    grpc_server_credentials_release(creds);
    assert_true(sc->port > 0);
    grpc_server_start(sc->srv);
    assert_int_equal(pthread_create(&sc->thread, NULL, strange_main, sc), 0);
}

static void strange_stop(strange_coord *sc)
{
    assert_int_equal(pthread_join(sc->thread, NULL), 0);
    grpc_server_shutdown_and_notify(sc->srv, sc->cq, (void *)3);
    grpc_server_cancel_all_calls(sc->srv);
    grpc_completion_queue_shutdown(sc->cq);
    while (grpc_completion_queue_next(sc->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type != GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_server_destroy(sc->srv);
    grpc_completion_queue_destroy(sc->cq);
    grpc_shutdown();
}

/* A worker meets something other than a coordinator of its protocol at the control port: a
 * first message that is no Challenge (an Admitted, as an older or foreign server might send),
 * or bytes that are no CoordinatorMessage. It refuses at once, saying which, and never sends
 * its Join. */
static void test_client_refuses_a_strange_coordinator(void **state)
{
    (void)state;
    Strata__Internal__V1__Admitted adm = STRATA__INTERNAL__V1__ADMITTED__INIT;
    Strata__Internal__V1__CoordinatorMessage cm = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__INIT;
    cm.kind_case = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_ADMITTED;
    cm.admitted = &adm;
    uint8_t packed[64];
    const size_t n = strata__internal__v1__coordinator_message__get_packed_size(&cm);
    assert_true(n <= sizeof packed);
    strata__internal__v1__coordinator_message__pack(&cm, packed);
    static const uint8_t garbage[] = {0xff, 0xff, 0xff, 0x01, 0x02};
    const struct {
        const uint8_t *bytes;
        size_t len;
        const char *want;
    } cases[] = {{packed, n, "did not open the stream with a Challenge"},
                 {garbage, sizeof garbage, "undecodable CoordinatorMessage"}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        strange_coord sc;
        strange_start(&sc, cases[i].bytes, cases[i].len, NULL, 0);
        ctl_client *c = NULL;
        strata_error err = {0};
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        assert_int_equal(connect_worker(sc.port, "careful", SECRET, CTL_PROTOCOL_VERSION, &c, &err), STRATA_EIO);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        assert_null(c);
        if (!strstr(err.msg, cases[i].want))
            fail_msg("case %zu: %s", i, err.msg);
        assert_true(t1.tv_sec - t0.tv_sec < 4);   /* at once, not after the 5 s connect timeout */
        strange_stop(&sc);
    }

    /* A server that sends a Challenge, takes the Join, then bytes that are no message where the
     * coordinator's proof (Admitted) is due: not trusted, the first receive says so. */
    uint8_t nonce[PROTO_CONTROL_NONCE_BYTES] = {9};
    Strata__Internal__V1__Challenge ch = STRATA__INTERNAL__V1__CHALLENGE__INIT;
    ch.nonce = (ProtobufCBinaryData){sizeof nonce, nonce};
    cm = (Strata__Internal__V1__CoordinatorMessage)STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__INIT;
    cm.kind_case = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_CHALLENGE;
    cm.challenge = &ch;
    const size_t nc = strata__internal__v1__coordinator_message__get_packed_size(&cm);
    assert_true(nc <= sizeof packed);
    strata__internal__v1__coordinator_message__pack(&cm, packed);
    strange_coord sc;
    strange_start(&sc, packed, nc, garbage, sizeof garbage);
    ctl_client *c = NULL;
    strata_error err = {0};
    assert_int_equal(connect_worker(sc.port, "careful", SECRET, CTL_PROTOCOL_VERSION, &c, &err), STRATA_OK);
    Strata__Internal__V1__CoordinatorMessage *m = NULL;
    assert_int_equal(ctl_client_recv(c, 5000, &m, &err), STRATA_EIO);
    assert_null(m);
    if (!strstr(err.msg, "did not prove that it holds the cluster secret (no Admitted message before others)"))
        fail_msg("%s", err.msg);
    ctl_client_close(c);
    strange_stop(&sc);
}

/* ---- 2000 messages each way, two peers at once ---- */

#define N_ORDER 2000

typedef struct wctx {
    ctl_client *c;
    int bad;
    int received;
} wctx;

static void *worker_sender(void *arg)
{
    wctx *w = arg;
    for (uint64_t i = 0; i < N_ORDER; i++) {
        strata_error err = {0};
        if (send_step_result(w->c, i, &err) != STRATA_OK) {
            fprintf(stderr, "send %" PRIu64 ": %s\n", i, err.msg);
            w->bad++;
            break;
        }
    }
    return NULL;
}

static void *worker_receiver(void *arg)
{
    wctx *w = arg;
    for (uint64_t i = 0; i < N_ORDER; i++) {
        Strata__Internal__V1__CoordinatorMessage *m = NULL;
        strata_error err = {0};
        int rc = ctl_client_recv(w->c, 10000, &m, &err);
        if (rc || !m || m->kind_case != STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_STEP_PLAN ||
            m->step_plan->step != i) {
            fprintf(stderr, "recv %" PRIu64 ": rc %d %s\n", i, rc, err.msg);
            w->bad++;
            if (m)
                protobuf_c_message_free_unpacked(&m->base, NULL);
            break;
        }
        w->received++;
        protobuf_c_message_free_unpacked(&m->base, NULL);
    }
    return NULL;
}

typedef struct cctx {
    ctl_peer *p;
    int bad;
} cctx;

static void *coord_sender(void *arg)
{
    cctx *cc = arg;
    for (uint64_t i = 0; i < N_ORDER; i++) {
        strata_error err = {0};
        if (send_plan(cc->p, i, &err) != STRATA_OK) {
            fprintf(stderr, "ctl_peer_send %" PRIu64 ": %s\n", i, err.msg);
            cc->bad++;
            break;
        }
    }
    return NULL;
}

static void test_order_two_peers(void **state)
{
    (void)state;
    hstate h;
    h_init(&h);
    ctl_server *s = start_server(&h, NULL);
    ctl_client *c[2];
    strata_error err = {0};
    const char *names[2] = {"a", "b"};
    wctx w[2];
    memset(w, 0, sizeof w);
    cctx cc[2];
    memset(cc, 0, sizeof cc);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(connect_worker(ctl_server_port(s), names[i], SECRET, CTL_PROTOCOL_VERSION, &c[i], &err), STRATA_OK);
        Strata__Internal__V1__CoordinatorMessage *m = recv_one(c[i]);
        assert_int_equal(m->kind_case, STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_ASSIGNMENT);
        protobuf_c_message_free_unpacked(&m->base, NULL);
        w[i].c = c[i];
        pthread_mutex_lock(&h.mu);
        cc[i].p = rec_by_name(&h, names[i])->peer;
        pthread_mutex_unlock(&h.mu);
    }
    pthread_t ts[6];
    int64_t t0 = now_ms();
    for (int i = 0; i < 2; i++) {
        assert_int_equal(pthread_create(&ts[3 * i], NULL, worker_sender, &w[i]), 0);
        assert_int_equal(pthread_create(&ts[3 * i + 1], NULL, worker_receiver, &w[i]), 0);
        assert_int_equal(pthread_create(&ts[3 * i + 2], NULL, coord_sender, &cc[i]), 0);
    }
    for (int i = 0; i < 6; i++)
        pthread_join(ts[i], NULL);
    pthread_mutex_lock(&h.mu);
    peer_rec *ra = rec_by_name(&h, "a"), *rb = rec_by_name(&h, "b");
    assert_true(WAIT_UNTIL(&h, ra->results == N_ORDER && rb->results == N_ORDER, 10000));
    assert_int_equal(ra->next_step, N_ORDER);
    assert_int_equal(rb->next_step, N_ORDER);
    pthread_mutex_unlock(&h.mu);
    fprintf(stderr, "    2 x %d messages each way in %" PRId64 " ms\n", N_ORDER, now_ms() - t0);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(w[i].bad, 0);
        assert_int_equal(cc[i].bad, 0);
        assert_int_equal(w[i].received, N_ORDER);
        ctl_client_close(c[i]);
    }
    pthread_mutex_lock(&h.mu);
    assert_true(WAIT_UNTIL(&h, ra->gone == 1 && rb->gone == 1, 5000));
    pthread_mutex_unlock(&h.mu);
    ctl_server_shutdown(s);
    assert_int_equal(ra->gone, 1);
    assert_int_equal(rb->gone, 1);
    h_finish(&h);
}

/* ---- large messages ---- */

#define BIG_SEQS 5000
#define BIG_TOKENS 64
#define BIG_RESULTS 24000

static void test_big_messages(void **state)
{
    (void)state;
    hstate h;
    h_init(&h);
    srv_cfg cfg = {.max_bytes = (size_t)4 << 20};
    ctl_server *s = start_server(&h, &cfg);
    ctl_client *c;
    strata_error err = {0};
    assert_int_equal(connect_worker(ctl_server_port(s), "big", SECRET, CTL_PROTOCOL_VERSION, &c, &err), STRATA_OK);
    Strata__Internal__V1__CoordinatorMessage *m = recv_one(c);
    protobuf_c_message_free_unpacked(&m->base, NULL);
    pthread_mutex_lock(&h.mu);
    peer_rec *r = rec_by_name(&h, "big");
    ctl_peer *p = r->peer;
    pthread_mutex_unlock(&h.mu);

    /* Coordinator -> worker: a StepPlan of 5000 sequences x 64 tokens (> 1 MiB). */
    Strata__Internal__V1__SeqWork *works = calloc(BIG_SEQS, sizeof *works);
    Strata__Internal__V1__SeqWork **wp = calloc(BIG_SEQS, sizeof *wp);
    uint32_t *toks = calloc((size_t)BIG_SEQS * BIG_TOKENS, sizeof *toks);
    assert_true(works && wp && toks);
    for (size_t i = 0; i < BIG_SEQS; i++) {
        strata__internal__v1__seq_work__init(&works[i]);
        works[i].seq_id = i + 1000;
        works[i].pos0 = (uint32_t)i;
        works[i].tokens = &toks[i * BIG_TOKENS];
        works[i].n_tokens = BIG_TOKENS;
        works[i].temperature = 0.5f;
        works[i].sample = i % 2;
        for (size_t k = 0; k < BIG_TOKENS; k++)
            toks[i * BIG_TOKENS + k] = (uint32_t)((i * 7919 + k * 104729) % 49152) + 16384;
        wp[i] = &works[i];
    }
    Strata__Internal__V1__StepPlan sp = STRATA__INTERNAL__V1__STEP_PLAN__INIT;
    sp.step = 42;
    sp.seqs = wp;
    sp.n_seqs = BIG_SEQS;
    Strata__Internal__V1__CoordinatorMessage cm = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__INIT;
    cm.kind_case = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_STEP_PLAN;
    cm.step_plan = &sp;
    size_t plan_bytes = protobuf_c_message_get_packed_size(&cm.base);
    assert_true(plan_bytes > ((size_t)1 << 20));
    assert_int_equal(ctl_peer_send(p, &cm, &err), STRATA_OK);
    m = recv_one(c);
    assert_int_equal(m->kind_case, STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_STEP_PLAN);
    assert_int_equal(m->step_plan->n_seqs, BIG_SEQS);
    for (size_t i = 0; i < BIG_SEQS; i++) {
        const Strata__Internal__V1__SeqWork *w = m->step_plan->seqs[i];
        assert_int_equal(w->seq_id, i + 1000);
        assert_int_equal(w->n_tokens, BIG_TOKENS);
        assert_memory_equal(w->tokens, &toks[i * BIG_TOKENS], BIG_TOKENS * sizeof(uint32_t));
        assert_int_equal(w->sample, i % 2);
    }
    protobuf_c_message_free_unpacked(&m->base, NULL);

    /* Worker -> coordinator: a StepResult of 24000 failed sequences (> 1 MiB). */
    Strata__Internal__V1__SeqResult *res = calloc(BIG_RESULTS, sizeof *res);
    Strata__Internal__V1__SeqResult **rp = calloc(BIG_RESULTS, sizeof *rp);
    char (*texts)[64] = calloc(BIG_RESULTS, 64);
    assert_true(res && rp && texts);
    for (size_t i = 0; i < BIG_RESULTS; i++) {
        strata__internal__v1__seq_result__init(&res[i]);
        res[i].seq_id = i;
        res[i].token = (uint32_t)(3 * i);
        res[i].status = 3;
        snprintf(texts[i], 64, "seq %zu failed with a long enough message", i);
        res[i].message = texts[i];
        rp[i] = &res[i];
    }
    Strata__Internal__V1__StepResult sr = STRATA__INTERNAL__V1__STEP_RESULT__INIT;
    sr.results = rp;
    sr.n_results = BIG_RESULTS;
    Strata__Internal__V1__WorkerMessage wm = STRATA__INTERNAL__V1__WORKER_MESSAGE__INIT;
    wm.kind_case = STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_STEP_RESULT;
    wm.step_result = &sr;
    size_t result_bytes = protobuf_c_message_get_packed_size(&wm.base);
    assert_true(result_bytes > ((size_t)1 << 20));
    fprintf(stderr, "    StepPlan of %zu bytes and StepResult of %zu bytes round-tripped\n", plan_bytes, result_bytes);
    assert_int_equal(ctl_client_send(c, &wm, &err), STRATA_OK);
    pthread_mutex_lock(&h.mu);
    assert_true(WAIT_UNTIL(&h, r->big_ok == 1, 10000));
    pthread_mutex_unlock(&h.mu);

    /* Above the server's limit (4 MiB here): ctl_peer_send refuses it and the stream goes on. */
    Strata__Internal__V1__SeqWork *big_works = calloc(4 * BIG_SEQS, sizeof *big_works);
    Strata__Internal__V1__SeqWork **big_wp = calloc(4 * BIG_SEQS, sizeof *big_wp);
    assert_true(big_works && big_wp);
    for (size_t i = 0; i < 4 * BIG_SEQS; i++) {
        big_works[i] = works[i % BIG_SEQS];
        big_wp[i] = &big_works[i];
    }
    sp.seqs = big_wp;
    sp.n_seqs = 4 * BIG_SEQS;
    size_t too_big = protobuf_c_message_get_packed_size(&cm.base);
    assert_true(too_big > ((size_t)4 << 20));
    fprintf(stderr, "    a StepPlan of %zu bytes above the 4 MiB limit is refused\n", too_big);
    assert_int_equal(ctl_peer_send(p, &cm, &err), STRATA_EINVAL);
    assert_int_equal(send_plan(p, 43, &err), STRATA_OK);
    m = recv_one(c);
    assert_int_equal(m->step_plan->step, 43);
    protobuf_c_message_free_unpacked(&m->base, NULL);

    /* A worker message above the server's limit: gRPC refuses it and the stream ends. */
    Strata__Internal__V1__SeqResult *res4 = calloc(4 * BIG_RESULTS, sizeof *res4);
    Strata__Internal__V1__SeqResult **rp4 = calloc(4 * BIG_RESULTS, sizeof *rp4);
    assert_true(res4 && rp4);
    for (size_t i = 0; i < 4 * BIG_RESULTS; i++) {
        res4[i] = res[i % BIG_RESULTS];
        rp4[i] = &res4[i];
    }
    sr.results = rp4;
    sr.n_results = 4 * BIG_RESULTS;
    assert_true(protobuf_c_message_get_packed_size(&wm.base) > ((size_t)4 << 20));
    ctl_client_send(c, &wm, &err); /* gRPC may take it before the server refuses it */
    char msg[600];
    recv_end(c, msg, sizeof msg);
    assert_true(strstr(msg, "RESOURCE_EXHAUSTED") != NULL);
    pthread_mutex_lock(&h.mu);
    assert_true(WAIT_UNTIL(&h, r->gone == 1, 5000));
    pthread_mutex_unlock(&h.mu);
    ctl_client_close(c);

    free(res4);
    free(rp4);
    free(big_works);
    free(big_wp);
    free(res);
    free(rp);
    free(texts);
    free(works);
    free(wp);
    free(toks);
    ctl_server_shutdown(s);
    assert_int_equal(r->gone, 1);
    h_finish(&h);
}

/* ---- workers that die or hang (child processes) ---- */

static int child_main(const char *addr, const char *mode)
{
    Strata__Internal__V1__Join j = make_join(mode, CTL_PROTOCOL_VERSION);
    ctl_client *c;
    strata_error err = {0};
    if (ctl_client_connect(addr, SECRET, SECRET_LEN, &j, 5000, &c, &err)) {
        fprintf(stderr, "child: %s\n", err.msg);
        return 2;
    }
    Strata__Internal__V1__CoordinatorMessage *m = NULL;
    if (ctl_client_recv(c, 5000, &m, &err) || !m) {
        fprintf(stderr, "child: no assignment: %s\n", err.msg);
        return 3;
    }
    protobuf_c_message_free_unpacked(&m->base, NULL);
    if (strcmp(mode, "kill") == 0)
        raise(SIGKILL);
    else if (strcmp(mode, "stop") == 0)
        raise(SIGSTOP); /* hung: the process is alive, its socket open, nothing answers */
    _exit(0);           /* "exit": gone without closing the stream */
}

static pid_t spawn_child(int port, const char *mode)
{
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    assert_true(n > 0);
    exe[n] = 0;
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    char *argv[] = {exe, (char *)"--control-child", addr, (char *)mode, NULL};
    pid_t pid;
    assert_int_equal(posix_spawn(&pid, exe, NULL, NULL, argv, environ), 0);
    return pid;
}

static void check_child(hstate *h, int port, const char *mode)
{
    pid_t pid = spawn_child(port, mode);
    pthread_mutex_lock(&h->mu);
    assert_true(WAIT_UNTIL(h, rec_by_name(h, mode) != NULL, 10000));
    peer_rec *r = rec_by_name(h, mode);
    pthread_mutex_unlock(&h->mu);
    int st;
    if (strcmp(mode, "stop") == 0) {
        assert_int_equal(waitpid(pid, &st, WUNTRACED), pid);
        assert_true(WIFSTOPPED(st));
    } else {
        assert_int_equal(waitpid(pid, &st, 0), pid);
        if (strcmp(mode, "kill") == 0)
            assert_true(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
        else
            assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    int64_t t0 = now_ms();
    pthread_mutex_lock(&h->mu);
    bool gone = WAIT_UNTIL(h, r->gone == 1, 5000);
    int64_t dt = r->gone_ms - t0;
    int status = r->gone_status;
    pthread_mutex_unlock(&h->mu);
    if (strcmp(mode, "stop") == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &st, 0);
    }
    assert_true(gone);
    fprintf(stderr, "    worker \"%s\": on_gone %s after %" PRId64 " ms\n", mode, proto_grpc_status_name(status), dt);
    assert_int_equal(status, GRPC_STATUS_UNAVAILABLE);
    assert_true(dt < 3000);
}

static void test_worker_dies(void **state)
{
    (void)state;
    hstate h;
    h_init(&h);
    srv_cfg cfg = {.keepalive_time_ms = 500, .keepalive_timeout_ms = 1000};
    ctl_server *s = start_server(&h, &cfg);
    check_child(&h, ctl_server_port(s), "kill");
    check_child(&h, ctl_server_port(s), "exit");
    check_child(&h, ctl_server_port(s), "stop");
    ctl_server_shutdown(s);
    assert_int_equal(h.gones, 3);
    for (int i = 0; i < h.n_recs; i++)
        assert_int_equal(h.recs[i].gone, 1);
    h_finish(&h);
}

/* ---- a coordinator that dies or hangs (child process): the worker's keepalive ---- */

static int coord_child_main(void)
{
    hstate h;
    h_init(&h);
    ctl_server_options o = ctl_server_options_default();
    o.listen_addr = "127.0.0.1:0";
    o.cluster_secret = SECRET;
    o.cluster_secret_len = SECRET_LEN;
    o.min_recv_ping_interval_ms = 100;
    ctl_handler hd = {.ctx = &h, .on_join = on_join, .on_message = on_message, .on_gone = on_gone};
    ctl_server *s;
    strata_error err = {0};
    if (ctl_server_start(&o, &hd, &s, &err)) {
        fprintf(stderr, "coordinator child: %s\n", err.msg);
        return 2;
    }
    printf("%d\n", ctl_server_port(s));
    fflush(stdout);
    for (;;)
        pause(); /* until killed */
}

static pid_t spawn_coordinator(int *port)
{
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    assert_true(n > 0);
    exe[n] = 0;
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
    posix_spawn_file_actions_addclose(&fa, fds[0]);
    posix_spawn_file_actions_addclose(&fa, fds[1]);
    char *argv[] = {exe, (char *)"--control-coordinator", NULL};
    pid_t pid;
    assert_int_equal(posix_spawn(&pid, exe, &fa, NULL, argv, environ), 0);
    posix_spawn_file_actions_destroy(&fa);
    close(fds[1]);
    FILE *f = fdopen(fds[0], "r");
    assert_non_null(f);
    assert_int_equal(fscanf(f, "%d", port), 1);
    fclose(f);
    return pid;
}

static void check_coordinator_lost(bool hang)
{
    int port;
    pid_t pid = spawn_coordinator(&port);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    Strata__Internal__V1__Join j = make_join("orphan", CTL_PROTOCOL_VERSION);
    ctl_client_options co = {.keepalive_time_ms = 500, .keepalive_timeout_ms = 1000};
    ctl_client *c;
    strata_error err = {0};
    assert_int_equal(ctl_client_connect_opts(addr, SECRET, SECRET_LEN, &j, 5000, &co, &c, &err), STRATA_OK);
    Strata__Internal__V1__CoordinatorMessage *m = recv_one(c);
    protobuf_c_message_free_unpacked(&m->base, NULL);
    int st;
    if (hang) {
        kill(pid, SIGSTOP);
        assert_int_equal(waitpid(pid, &st, WUNTRACED), pid);
    } else {
        kill(pid, SIGKILL);
        assert_int_equal(waitpid(pid, &st, 0), pid);
    }
    int64_t t0 = now_ms();
    m = NULL;
    int rc = ctl_client_recv(c, 10000, &m, &err);
    int64_t dt = now_ms() - t0;
    if (hang) {
        kill(pid, SIGKILL);
        waitpid(pid, &st, 0);
    }
    fprintf(stderr, "    coordinator %s: worker recv ended after %" PRId64 " ms: %s\n", hang ? "hung" : "killed", dt,
            err.msg);
    assert_int_equal(rc, STRATA_EIO);
    assert_null(m);
    assert_int_equal(ctl_client_status(c, NULL, 0), GRPC_STATUS_UNAVAILABLE);
    assert_true(dt < 3000);
    assert_int_equal(send_kv_report(c, 1), STRATA_EIO);
    ctl_client_close(c);
}

static void test_coordinator_lost(void **state)
{
    (void)state;
    check_coordinator_lost(false);
    check_coordinator_lost(true);
}

/* ---- server shutdown, close, send after gone ---- */

static void test_server_shutdown(void **state)
{
    (void)state;
    hstate h;
    h_init(&h);
    ctl_server *s = start_server(&h, NULL);
    ctl_client *c[3];
    strata_error err = {0};
    const char *names[3] = {"s0", "s1", "s2"};
    for (int i = 0; i < 3; i++) {
        assert_int_equal(connect_worker(ctl_server_port(s), names[i], SECRET, CTL_PROTOCOL_VERSION, &c[i], &err), STRATA_OK);
        Strata__Internal__V1__CoordinatorMessage *m = recv_one(c[i]);
        protobuf_c_message_free_unpacked(&m->base, NULL);
    }
    /* A Shutdown queued just before the server stops still arrives, before the status. */
    Strata__Internal__V1__Shutdown sd = STRATA__INTERNAL__V1__SHUTDOWN__INIT;
    sd.drain = true;
    Strata__Internal__V1__CoordinatorMessage sm = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__INIT;
    sm.kind_case = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_SHUTDOWN;
    sm.shutdown = &sd;
    pthread_mutex_lock(&h.mu);
    for (int i = 0; i < 3; i++)
        assert_int_equal(ctl_peer_send(rec_by_name(&h, names[i])->peer, &sm, &err), STRATA_OK);
    pthread_mutex_unlock(&h.mu);
    int64_t t0 = now_ms();
    ctl_server_shutdown(s);
    fprintf(stderr, "    shutdown with 3 workers took %" PRId64 " ms\n", now_ms() - t0);
    /* on_gone for every peer, before shutdown returned. */
    assert_int_equal(h.gones, 3);
    for (int i = 0; i < 3; i++) {
        peer_rec *r = rec_by_name(&h, names[i]);
        assert_int_equal(r->gone, 1);
        assert_int_equal(r->gone_status, GRPC_STATUS_UNAVAILABLE);
        assert_string_equal(r->gone_why, "coordinator shutting down");
        /* The referenced peer outlives the server: sends fail cleanly. */
        assert_int_equal(send_plan(r->peer, 1, &err), STRATA_EIO);
        ctl_peer_close(r->peer, GRPC_STATUS_INTERNAL, "ignored");
        assert_string_equal(ctl_peer_name(r->peer), names[i]);
    }
    for (int i = 0; i < 3; i++) {
        Strata__Internal__V1__CoordinatorMessage *m = recv_one(c[i]);
        assert_int_equal(m->kind_case, STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_SHUTDOWN);
        assert_true(m->shutdown->drain);
        protobuf_c_message_free_unpacked(&m->base, NULL);
        m = NULL;
        assert_int_equal(ctl_client_recv(c[i], 5000, &m, &err), STRATA_EIO);
        assert_null(m);
        assert_string_equal(err.msg, "coordinator ended the control stream: UNAVAILABLE: coordinator shutting down");
        assert_int_equal(ctl_client_status(c[i], NULL, 0), GRPC_STATUS_UNAVAILABLE);
        /* Again: the same answer. */
        assert_int_equal(ctl_client_recv(c[i], 0, &m, &err), STRATA_EIO);
        assert_int_equal(send_step_result(c[i], 1, &err), STRATA_EIO);
        ctl_client_close(c[i]);
    }
    h_finish(&h);
}

static void test_peer_close_and_send_after_gone(void **state)
{
    (void)state;
    hstate h;
    h_init(&h);
    ctl_server *s = start_server(&h, NULL);
    int port = ctl_server_port(s);
    ctl_client *c;
    strata_error err = {0};

    /* ctl_peer_close from a coordinator thread: the worker sees the status and message. */
    assert_int_equal(connect_worker(port, "closed", SECRET, CTL_PROTOCOL_VERSION, &c, &err), STRATA_OK);
    Strata__Internal__V1__CoordinatorMessage *m = recv_one(c);
    protobuf_c_message_free_unpacked(&m->base, NULL);
    pthread_mutex_lock(&h.mu);
    peer_rec *r = rec_by_name(&h, "closed");
    pthread_mutex_unlock(&h.mu);
    ctl_peer_close(r->peer, GRPC_STATUS_FAILED_PRECONDITION, "layer range revoked\nsecond line");
    ctl_peer_close(r->peer, GRPC_STATUS_INTERNAL, "a second close is a no-op");
    char msg[600];
    recv_end(c, msg, sizeof msg);
    assert_string_equal(msg, "coordinator ended the control stream: FAILED_PRECONDITION: layer range revoked second line");
    pthread_mutex_lock(&h.mu);
    assert_true(WAIT_UNTIL(&h, r->gone == 1, 5000));
    assert_int_equal(r->gone_status, GRPC_STATUS_FAILED_PRECONDITION);
    assert_string_equal(r->gone_why, "layer range revoked second line");
    pthread_mutex_unlock(&h.mu);
    /* After on_gone, through the reference: sends fail, nothing crashes. */
    assert_int_equal(send_plan(r->peer, 5, &err), STRATA_EIO);
    assert_true(strstr(err.msg, "closed") != NULL);
    ctl_peer_close(r->peer, GRPC_STATUS_OK, NULL);
    assert_ptr_equal(ctl_peer_get_user(r->peer), r);
    ctl_client_close(c);

    /* ctl_peer_close from inside on_message. */
    assert_int_equal(connect_worker(port, "self", SECRET, CTL_PROTOCOL_VERSION, &c, &err), STRATA_OK);
    m = recv_one(c);
    protobuf_c_message_free_unpacked(&m->base, NULL);
    assert_int_equal(send_kv_report(c, 999), STRATA_OK);
    recv_end(c, msg, sizeof msg);
    assert_string_equal(msg, "coordinator ended the control stream: ABORTED: closed from on_message");
    pthread_mutex_lock(&h.mu);
    r = rec_by_name(&h, "self");
    assert_true(WAIT_UNTIL(&h, r->gone == 1, 5000));
    assert_int_equal(r->gone_status, GRPC_STATUS_ABORTED);
    pthread_mutex_unlock(&h.mu);
    /* Sends after the stream ended fail on the worker side too. */
    assert_int_equal(send_kv_report(c, 1), STRATA_EIO);
    ctl_client_close(c);

    /* A worker that closes while the coordinator is sending: sends end with EIO, on_gone once. */
    assert_int_equal(connect_worker(port, "quits", SECRET, CTL_PROTOCOL_VERSION, &c, &err), STRATA_OK);
    pthread_mutex_lock(&h.mu);
    assert_true(WAIT_UNTIL(&h, rec_by_name(&h, "quits") != NULL, 5000));
    r = rec_by_name(&h, "quits");
    pthread_mutex_unlock(&h.mu);
    ctl_client_close(c);
    int rc = STRATA_OK;
    for (int i = 0; i < 100000 && rc == STRATA_OK; i++)
        rc = send_plan(r->peer, (uint64_t)i, &err);
    assert_int_equal(rc, STRATA_EIO);
    pthread_mutex_lock(&h.mu);
    assert_true(WAIT_UNTIL(&h, r->gone == 1, 5000));
    pthread_mutex_unlock(&h.mu);

    ctl_server_shutdown(s);
    assert_int_equal(h.gones, 3);
    h_finish(&h);
}

static void test_queue_full(void **state)
{
    (void)state;
    hstate h;
    h_init(&h);
    srv_cfg cfg = {.max_queued = 8};
    ctl_server *s = start_server(&h, &cfg);
    ctl_client *c;
    strata_error err = {0};
    assert_int_equal(connect_worker(ctl_server_port(s), "slow", SECRET, CTL_PROTOCOL_VERSION, &c, &err), STRATA_OK);
    pthread_mutex_lock(&h.mu);
    assert_true(WAIT_UNTIL(&h, rec_by_name(&h, "slow") != NULL, 5000));
    peer_rec *r = rec_by_name(&h, "slow");
    pthread_mutex_unlock(&h.mu);

    /* The worker does not read: 64 KiB plans fill gRPC's window, then the queue. */
    static uint64_t free_ids[8192];
    for (size_t i = 0; i < 8192; i++)
        free_ids[i] = i;
    Strata__Internal__V1__StepPlan sp = STRATA__INTERNAL__V1__STEP_PLAN__INIT;
    sp.free_seqs = free_ids;
    sp.n_free_seqs = 8192;
    Strata__Internal__V1__CoordinatorMessage cm = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__INIT;
    cm.kind_case = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_STEP_PLAN;
    cm.step_plan = &sp;
    int rc = STRATA_OK, sent = 0;
    for (int i = 0; i < 20000 && rc == STRATA_OK; i++) {
        sp.step = (uint64_t)i;
        rc = ctl_peer_send(r->peer, &cm, &err);
        if (rc == STRATA_OK)
            sent++;
        else if (i % 16 == 0)
            sleep_ms(1);
    }
    assert_int_equal(rc, STRATA_EFULL);
    fprintf(stderr, "    queue full after %d messages: %s\n", sent, err.msg);
    pthread_mutex_lock(&h.mu);
    assert_true(WAIT_UNTIL(&h, r->gone == 1, 5000));
    assert_int_equal(r->gone_status, GRPC_STATUS_RESOURCE_EXHAUSTED);
    assert_true(strstr(r->gone_why, "worker not reading") != NULL);
    pthread_mutex_unlock(&h.mu);
    assert_int_equal(send_plan(r->peer, 1, &err), STRATA_EIO);
    char msg[600];
    recv_end(c, msg, sizeof msg);
    assert_true(strstr(msg, "RESOURCE_EXHAUSTED: worker not reading") != NULL);
    ctl_client_close(c);
    ctl_server_shutdown(s);
    assert_int_equal(h.gones, 1);
    h_finish(&h);
}

/* ---- the client alone ---- */

typedef struct blocked {
    ctl_client *c;
    int rc;
    char msg[512];
} blocked;

static void *blocked_recv(void *arg)
{
    blocked *b = arg;
    Strata__Internal__V1__CoordinatorMessage *m = NULL;
    strata_error err = {0};
    b->rc = ctl_client_recv(b->c, -1, &m, &err); /* the Assignment */
    if (m)
        protobuf_c_message_free_unpacked(&m->base, NULL);
    if (b->rc == STRATA_OK)
        b->rc = ctl_client_recv(b->c, -1, &m, &err); /* blocks until close */
    snprintf(b->msg, sizeof b->msg, "%s", err.msg);
    return NULL;
}

static void test_client_close_while_blocked(void **state)
{
    (void)state;
    hstate h;
    h_init(&h);
    ctl_server *s = start_server(&h, NULL);
    ctl_client *c;
    strata_error err = {0};
    assert_int_equal(connect_worker(ctl_server_port(s), "blocked", SECRET, CTL_PROTOCOL_VERSION, &c, &err), STRATA_OK);
    blocked b = {.c = c};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, blocked_recv, &b), 0);
    pthread_mutex_lock(&h.mu);
    assert_true(WAIT_UNTIL(&h, h.joins == 1, 5000));
    pthread_mutex_unlock(&h.mu);
    sleep_ms(200);
    int64_t t0 = now_ms();
    ctl_client_close(c); /* the blocked recv returns EIO before close returns */
    int64_t dt = now_ms() - t0;
    pthread_join(t, NULL);
    assert_int_equal(b.rc, STRATA_EIO);
    assert_true(dt < 3000);
    pthread_mutex_lock(&h.mu);
    assert_true(WAIT_UNTIL(&h, h.gones == 1, 5000));
    pthread_mutex_unlock(&h.mu);
    ctl_server_shutdown(s);
    h_finish(&h);
}

static void test_start_errors(void **state)
{
    (void)state;
    hstate h;
    h_init(&h);
    ctl_handler hd = {.ctx = &h, .on_join = on_join, .on_message = on_message, .on_gone = on_gone};
    ctl_server_options o = ctl_server_options_default();
    assert_string_equal(o.listen_addr, "127.0.0.1:50052");
    assert_int_equal(o.max_message_bytes, (size_t)64 << 20);
    assert_int_equal(o.max_queued_messages, 4096);
    o.listen_addr = "127.0.0.1:0";
    ctl_server *s = (ctl_server *)1;
    strata_error err = {0};
    /* No secret, a short one, a long one. */
    assert_int_equal(ctl_server_start(&o, &hd, &s, &err), STRATA_EINVAL);
    assert_null(s);
    o.cluster_secret = "short";
    o.cluster_secret_len = 5;
    assert_int_equal(ctl_server_start(&o, &hd, &s, &err), STRATA_EINVAL);
    assert_true(strstr(err.msg, "16 to 256 bytes") != NULL);
    static char long_secret[300];
    memset(long_secret, 'x', sizeof long_secret);
    o.cluster_secret = long_secret;
    o.cluster_secret_len = sizeof long_secret;
    assert_int_equal(ctl_server_start(&o, &hd, &s, &err), STRATA_EINVAL);
    o.cluster_secret = SECRET;
    o.cluster_secret_len = SECRET_LEN;
    /* Missing callbacks, NULL arguments, too many threads. */
    ctl_handler bad = hd;
    bad.on_gone = NULL;
    assert_int_equal(ctl_server_start(&o, &bad, &s, &err), STRATA_EINVAL);
    assert_int_equal(ctl_server_start(NULL, &hd, &s, &err), STRATA_EINVAL);
    o.threads = 65;
    assert_int_equal(ctl_server_start(&o, &hd, &s, &err), STRATA_EINVAL);
    o.threads = 0;
    /* Options out of range, each named. */
    struct {
        ctl_server_options o;
        const char *want;
    } bad_opts[] = {{o, "join_timeout_ms must not be negative"},
                    {o, "TLS needs both a certificate file and a key file"},
                    {o, "max_message_bytes 2147483648 is above 2 GiB"},
                    {o, "keepalive times must not be negative"},
                    {o, "keepalive times must not be negative"}};
    bad_opts[0].o.join_timeout_ms = -1;
    bad_opts[1].o.tls_cert_file = "cert.pem";
    bad_opts[2].o.max_message_bytes = (size_t)1 << 31;
    bad_opts[3].o.keepalive_time_ms = -5;
    bad_opts[4].o.min_recv_ping_interval_ms = -1;
    for (size_t i = 0; i < sizeof bad_opts / sizeof *bad_opts; i++) {
        s = (ctl_server *)1;
        assert_int_equal(ctl_server_start(&bad_opts[i].o, &hd, &s, &err), STRATA_EINVAL);
        assert_null(s);
        assert_string_equal(err.msg, bad_opts[i].want);
    }
    /* Port in use. */
    assert_int_equal(ctl_server_start(&o, &hd, &s, &err), STRATA_OK);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", ctl_server_port(s));
    ctl_server_options o2 = o;
    o2.listen_addr = addr;
    ctl_server *s2 = NULL;
    assert_int_equal(ctl_server_start(&o2, &hd, &s2, &err), STRATA_EIO);
    assert_null(s2);
    char want[160];
    snprintf(want, sizeof want, "cannot listen on %s: bind: Address already in use", addr);
    assert_string_equal(err.msg, want);
    ctl_server_shutdown(s);
    ctl_server_shutdown(NULL);

    /* The client: nobody listening (the port of the server just stopped), NULL arguments. */
    ctl_client *c = (ctl_client *)1;
    Strata__Internal__V1__Join j = make_join("x", CTL_PROTOCOL_VERSION);
    int64_t t0 = now_ms();
    assert_int_equal(ctl_client_connect(addr, SECRET, SECRET_LEN, &j, 300, &c, &err), STRATA_EIO);
    assert_null(c);
    assert_true(now_ms() - t0 < 3000);
    assert_true(strstr(err.msg, "cannot reach the coordinator at") != NULL);
    assert_int_equal(ctl_client_connect(NULL, SECRET, SECRET_LEN, &j, 300, &c, &err), STRATA_EINVAL);
    assert_int_equal(ctl_client_connect(addr, SECRET, SECRET_LEN, NULL, 300, &c, &err), STRATA_EINVAL);
    assert_int_equal(ctl_client_connect(addr, NULL, SECRET_LEN, &j, 300, &c, &err), STRATA_EINVAL);
    /* A secret no coordinator takes is refused before anything is sent. */
    assert_int_equal(ctl_client_connect(addr, "short", 5, &j, 300, &c, &err), STRATA_EINVAL);
    assert_true(strstr(err.msg, "cluster secret of 5 bytes (16 to 256 needed)") != NULL);
    ctl_client_close(NULL);
    assert_int_equal(ctl_client_send(NULL, NULL, &err), STRATA_EINVAL);
    Strata__Internal__V1__CoordinatorMessage *m;
    assert_int_equal(ctl_client_recv(NULL, 0, &m, &err), STRATA_EINVAL);
    assert_int_equal(ctl_peer_send(NULL, NULL, &err), STRATA_EINVAL);
    ctl_peer_close(NULL, 0, NULL);
    ctl_peer_unref(NULL);
    assert_int_equal(h.joins, 0);
    h_finish(&h);
}

/* A child dies with the test: a failed assertion jumps past the kill that ends it, and a child
 * left alive (paused or stopped) keeps the test's stderr open, so ctest would wait on it for
 * ever. */
static void die_with_parent(pid_t parent)
{
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent)
        _exit(9);
}

int main(int argc, char **argv)
{
    if (argc >= 2 && (!strcmp(argv[1], "--control-child") || !strcmp(argv[1], "--control-coordinator"))) {
        const char *parent = getenv("STRATA_TEST_PARENT");
        die_with_parent(parent ? (pid_t)atol(parent) : getppid());
    }
    if (argc >= 4 && strcmp(argv[1], "--control-child") == 0)
        return child_main(argv[2], argv[3]);
    if (argc >= 2 && strcmp(argv[1], "--control-coordinator") == 0)
        return coord_child_main();
    char self[32];
    snprintf(self, sizeof self, "%ld", (long)getpid());
    if (setenv("STRATA_TEST_PARENT", self, 1) != 0)
        return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_join_accepted),
        cmocka_unit_test(test_join_refusals),
        cmocka_unit_test(test_join_deadline),
        cmocka_unit_test(test_waiting_cap),
        cmocka_unit_test(test_client_refuses_a_strange_coordinator),
        cmocka_unit_test(test_secret_proofs),
        cmocka_unit_test(test_order_two_peers),
        cmocka_unit_test(test_big_messages),
        cmocka_unit_test(test_worker_dies),
        cmocka_unit_test(test_coordinator_lost),
        cmocka_unit_test(test_server_shutdown),
        cmocka_unit_test(test_peer_close_and_send_after_gone),
        cmocka_unit_test(test_queue_full),
        cmocka_unit_test(test_client_close_while_blocked),
        cmocka_unit_test(test_start_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
