/* The control-plane server on the gRPC C core. See control_server.h (contract) and README.md.
 *
 * Structure (the patterns of coordinator/server/api_server.c). One completion queue created for
 * grpc_completion_queue_next carries every event: new Attach calls (several outstanding
 * registered requests, plus a generic request that answers unknown methods UNIMPLEMENTED), the
 * one-batch replies that refuse calls during shutdown, each peer's receive, send and close
 * batches, and the server's shutdown notification. `threads` threads block in
 * grpc_completion_queue_next and call the done function of the proto_tag at the start of every
 * tag object. The plumbing both gRPC servers share (tags, send queue, one-batch replies, the
 * unknown-method request, start and shutdown sequences) is proto/grpc_call.h.
 *
 * A peer has at most one batch of each kind in flight:
 *   - RECV_CLOSE_ON_SERVER, started at accept; it completes when the call is over, with
 *     cancelled=1 when it did not end by our status (worker died, keepalive, cancel);
 *   - RECV_MESSAGE, re-armed only after the previous message was handled (the callback
 *     returned): that is what keeps per-peer order with several server threads;
 *   - one send batch (SEND_MESSAGE, or the final SEND_STATUS_FROM_SERVER): gRPC allows one
 *     outstanding SEND_MESSAGE per call, so further messages wait in the peer's queue. Whoever
 *     adds work (a handler thread in ctl_peer_send, a server thread whose send completed)
 *     starts the next batch itself under the peer's mutex, so no thread has to wake the queue.
 * All grpc_call_start_batch calls on a peer's call happen under its mutex.
 *
 * Counters on a peer: `busy` counts batches in flight plus temporary holds by server code; the
 * gRPC call is released (unlinked from the server, grpc_call_unref) when it drops to 0, which
 * happens only after the call is over and on_gone was delivered (a completion always follows
 * the end of a stream, and every completion handler delivers a pending on_gone before dropping
 * its count). `refs` keeps the object's memory: one for the server until the call is released,
 * plus the handler's ctl_peer_ref. So references may outlive the server.
 *
 * Lock order: server mutex (s->ps.mu), then peer mutex; nothing takes the server mutex while
 * holding a peer's. No lock is held during a callback. */
#include "coordinator/control/control_server.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/byte_buffer.h>
#include <grpc/grpc.h>
#include <grpc/support/alloc.h>

#include "kvstore/clock.h"
#include "kvstore/random.h"
#include "proto/control_auth.h"
#include "proto/grpc_call.h"
#include "proto/grpc_util.h"
#include "proto/validate.h"

/* Outstanding grpc_server_request_registered_call for Attach (new calls wait inside gRPC when
 * all are taken, until one is re-armed). */
#define CTL_REQUESTS 4
/* How long shutdown lets final statuses pass before cancelling streams outright. */
#define CTL_SHUTDOWN_GRACE_MS 1000

/* ------------------------------------------------------------------------------------------- */
/* Objects                                                                                     */

enum peer_state {
    PEER_NEW,     /* waiting for the Join */
    PEER_JOINING, /* on_join is running */
    PEER_JOINED,  /* on_join accepted it: on_gone is owed */
    PEER_REFUSED, /* checks or on_join refused it */
};

struct ctl_peer {
    proto_tag recv_tag;
    proto_tag send_tag;
    proto_tag close_tag;
    ctl_server *srv; /* valid while the call is not released */
    grpc_call *call;
    atomic_uint refs; /* object memory: the server's (until release) + the handler's */
    size_t max_bytes;
    uint32_t max_queued;
    char name[CTL_MAX_WORKER_NAME + 1]; /* set before on_join, constant after */
    char addr[128];
    char host[128];                           /* addr without its port: the waiting cap's key */
    uint8_t nonce[PROTO_CONTROL_NONCE_BYTES]; /* this call's Challenge, constant */
    int64_t opened_ms;                        /* monotonic, constant: the Join is due by + join_timeout_ms */

    pthread_mutex_t mu;
    /* Under mu. */
    unsigned busy;             /* batches in flight + temporary holds */
    bool released;             /* the call was released; srv may be gone */
    int state;                 /* enum peer_state */
    bool in_cb;                /* a callback of this peer is running */
    bool ended;                /* the stream is over for the handler: no sends, no messages */
    bool gone_done;            /* on_gone was delivered */
    bool gone_provisional;     /* half-close seen: on_gone waits for RECV_CLOSE_ON_SERVER's verdict */
    int gone_status;
    char gone_why[256];
    void *user;
    proto_sendq q;             /* q.dead: the call cannot send any more (cancelled, failed) */
    grpc_byte_buffer *recv_bb; /* RECV_MESSAGE's output */
    int cancelled;             /* RECV_CLOSE_ON_SERVER's output */

    /* Under srv->ps.mu. */
    ctl_peer *prev, *next; /* live list (calls not yet released) */
    ctl_peer *snext;       /* shutdown's private list */
    ctl_peer *lnext;       /* end_late_joins' private list */
};

struct ctl_server {
    proto_server ps; /* ps.mu is the server mutex */
    ctl_handler h;
    void *method;
    unsigned char *secret;
    size_t secret_len;
    size_t max_bytes;
    uint32_t max_queued;
    int join_timeout_ms;
    uint32_t max_waiting_per_host;

    /* Under ps.mu. */
    uint32_t live; /* peers whose call is not yet released */
    ctl_peer *peers;
};

/* ------------------------------------------------------------------------------------------- */
/* Small helpers                                                                               */

#define server_log(...) proto_log("control_server", __VA_ARGS__)

/* A one-batch refusal: initial metadata, status, RECV_CLOSE_ON_SERVER. Takes the call. */
static void reply_error(ctl_server *s, grpc_call *call, grpc_status_code code, const char *message)
{
    proto_server_reply(&s->ps, call, NULL, code, message);
}

/* ------------------------------------------------------------------------------------------- */
/* Peers: queue, pump, end                                                                     */

/* Under p->mu: starts the next send batch when none is in flight. The caller holds a busy
 * count or knows one is held (the close batch is in flight until the call is over). */
static void peer_pump(ctl_peer *p)
{
    if (p->released)
        return;
    grpc_call_error e;
    proto_sendq_result r = proto_sendq_pump(&p->q, &e);
    if (r == PROTO_SENDQ_STARTED) {
        p->busy++;
    } else if (r == PROTO_SENDQ_FAILED) {
        /* Give up on the call. The close batch is still in flight, so busy cannot reach 0. */
        server_log("worker %s: cannot start a send batch: %s", p->name, grpc_call_error_to_string(e));
        grpc_call_cancel_with_status(p->call, GRPC_STATUS_INTERNAL, "coordinator send failed", NULL);
    }
}

/* Under p->mu: the stream is over for the handler, with this status for on_gone (delivered by
 * the next completion handler, or by the caller when it is one). When send_status, the status
 * goes to the worker after the queued messages (flush) or at once (queue dropped; a message in
 * flight that flow control may hold is overtaken by cancelling the call with the status, which
 * gRPC writes as trailers regardless of the stream window). Returns false when it was already
 * over. */
static bool peer_end(ctl_peer *p, grpc_status_code code, const char *why, bool send_status, bool flush)
{
    if (p->ended)
        return false;
    p->ended = true;
    p->gone_status = (int)code;
    proto_status_line(p->gone_why, sizeof p->gone_why, why);
    if (!send_status || p->q.dead || p->released)
        return true;
    if (!flush)
        proto_sendq_drop(&p->q);
    proto_sendq_set_status(&p->q, code, p->gone_why);
    if (!flush && p->q.in_flight) {
        p->q.dead = true;
        grpc_call_cancel_with_status(p->call, code, p->gone_why, NULL);
        return true;
    }
    peer_pump(p);
    return true;
}

static void peer_free(ctl_peer *p)
{
    pthread_mutex_destroy(&p->mu);
    free(p);
}

static void peer_obj_unref(ctl_peer *p)
{
    if (atomic_fetch_sub(&p->refs, 1) == 1)
        peer_free(p);
}

/* The call is over and nothing is in flight: release everything gRPC, unlink, let shutdown
 * go on. Runs on a server thread or the shutdown thread. */
static void peer_release(ctl_peer *p)
{
    ctl_server *s = p->srv;
    pthread_mutex_lock(&s->ps.mu);
    if (p->prev)
        p->prev->next = p->next;
    else
        s->peers = p->next;
    if (p->next)
        p->next->prev = p->prev;
    p->prev = p->next = NULL;
    pthread_mutex_unlock(&s->ps.mu);

    pthread_mutex_lock(&p->mu);
    proto_sendq_clear(&p->q);
    if (p->recv_bb) {
        grpc_byte_buffer_destroy(p->recv_bb);
        p->recv_bb = NULL;
    }
    grpc_call *call = p->call;
    p->call = p->q.call = NULL;
    p->srv = NULL;
    pthread_mutex_unlock(&p->mu);
    grpc_call_unref(call);

    /* Counted down last: shutdown waits for live == 0 before it destroys the queue and the
     * server. Nothing touches s after the unlock. */
    pthread_mutex_lock(&s->ps.mu);
    s->live--;
    pthread_cond_broadcast(&s->ps.cond);
    pthread_mutex_unlock(&s->ps.mu);
    peer_obj_unref(p); /* the server's reference */
}

/* Drops one busy count (a completed batch or a temporary hold). On a server thread (or the
 * shutdown thread) it first delivers a pending on_gone when no callback of the peer runs. */
static void peer_put(ctl_peer *p)
{
    pthread_mutex_lock(&p->mu);
    if (p->ended && p->state == PEER_JOINED && !p->gone_done && !p->in_cb && !p->gone_provisional) {
        p->gone_done = true;
        p->in_cb = true;
        int code = p->gone_status;
        char why[sizeof p->gone_why];
        memcpy(why, p->gone_why, sizeof why);
        ctl_server *s = p->srv; /* valid: this busy count is not yet dropped */
        pthread_mutex_unlock(&p->mu);
        s->h.on_gone(s->h.ctx, p, code, why);
        pthread_mutex_lock(&p->mu);
        p->in_cb = false;
    }
    bool last = --p->busy == 0;
    if (last)
        p->released = true;
    pthread_mutex_unlock(&p->mu);
    if (last)
        peer_release(p);
}

/* Under p->mu: arms the next RECV_MESSAGE. */
static void peer_arm_recv(ctl_peer *p)
{
    if (p->ended || p->q.dead)
        return;
    p->busy++;
    grpc_call_error e = proto_call_recv_message(p->call, &p->recv_bb, &p->recv_tag);
    if (e != GRPC_CALL_OK) {
        server_log("worker %s: cannot start a receive: %s", p->name, grpc_call_error_to_string(e));
        p->busy--;
        peer_end(p, GRPC_STATUS_INTERNAL, "coordinator receive failed", false, false);
        p->q.dead = true;
        grpc_call_cancel_with_status(p->call, GRPC_STATUS_INTERNAL, "coordinator receive failed", NULL);
    }
}

/* ------------------------------------------------------------------------------------------- */
/* Completions                                                                                 */

static const char *worker_kind_name(int kind)
{
    switch (kind) {
    case STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_JOIN: return "join";
    case STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_STEP_RESULT: return "step_result";
    case STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_KV_REPORT: return "kv_report";
    case STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_MIGRATE_DONE: return "migrate_done";
    default: return "nothing";
    }
}

/* The Join checks that do not need the handler. GRPC_STATUS_OK when they pass, with the
 * coordinator's proof for this worker in admit_proof. The version comes first: a worker of
 * another version cannot prove anything in this version's terms, and saying which versions
 * differ tells a stranger nothing it could use. */
static grpc_status_code check_join(ctl_server *s, const ctl_peer *p, const Strata__Internal__V1__WorkerMessage *m,
                                   uint8_t admit_proof[PROTO_CONTROL_PROOF_BYTES], char *why, size_t cap)
{
    if (m->kind_case != STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_JOIN || !m->join) {
        snprintf(why, cap, "the first message of the control stream must be a Join (got %s)",
                 worker_kind_name(m->kind_case));
        return GRPC_STATUS_INVALID_ARGUMENT;
    }
    const Strata__Internal__V1__Join *j = m->join;
    if (j->protocol_version != CTL_PROTOCOL_VERSION) {
        snprintf(why, cap, "control protocol version mismatch: worker speaks %" PRIu32 ", coordinator speaks %u",
                 j->protocol_version, CTL_PROTOCOL_VERSION);
        return GRPC_STATUS_FAILED_PRECONDITION;
    }
    if (!proto_worker_name_valid(j->worker_name)) {
        snprintf(why, cap, "Join.worker_name must be 1-%d bytes of UTF-8 without control characters",
                 CTL_MAX_WORKER_NAME);
        return GRPC_STATUS_INVALID_ARGUMENT;
    }
    if (j->worker_nonce.len != PROTO_CONTROL_NONCE_BYTES) {
        snprintf(why, cap, "Join.worker_nonce must be %d bytes (got %zu)", PROTO_CONTROL_NONCE_BYTES,
                 j->worker_nonce.len);
        return GRPC_STATUS_INVALID_ARGUMENT;
    }
    uint8_t expected[PROTO_CONTROL_PROOF_BYTES];
    strata_error err = {0};
    if (proto_control_proof(PROTO_PROOF_WORKER, s->secret, s->secret_len, p->nonce, j->worker_nonce.data,
                            j->worker_name, expected, &err) != STRATA_OK ||
        proto_control_proof(PROTO_PROOF_COORDINATOR, s->secret, s->secret_len, p->nonce, j->worker_nonce.data,
                            j->worker_name, admit_proof, &err) != STRATA_OK) {
        snprintf(why, cap, "coordinator error: %s", err.msg);
        return GRPC_STATUS_INTERNAL;
    }
    if (!proto_control_proof_equal(j->secret_proof.data, j->secret_proof.len, expected)) {
        snprintf(why, cap, "wrong cluster secret");
        return GRPC_STATUS_PERMISSION_DENIED;
    }
    return GRPC_STATUS_OK;
}

/* Under p->mu: queues m (taken) on the peer's stream. STRATA_EIO when the stream is over;
 * STRATA_EFULL when the worker does not read (the queue holds max_queued): the stream is ended
 * rather than buffered without bound, or a message dropped silently, which would desynchronize
 * the step protocol (on_gone follows from the cancelled batches' completions). */
static int peer_push(ctl_peer *p, proto_msg *m, strata_error *err)
{
    if (p->ended || p->q.dead || p->released) {
        proto_msg_free(m);
        return strata_fail(err, STRATA_EIO, "worker %s: the control stream has ended", p->name);
    }
    if (p->q.queued >= p->max_queued) {
        uint32_t q = p->q.queued;
        char why[160];
        snprintf(why, sizeof why, "worker not reading (%" PRIu32 " control messages queued)", q);
        peer_end(p, GRPC_STATUS_RESOURCE_EXHAUSTED, why, true, false);
        proto_msg_free(m);
        return strata_fail(err, STRATA_EFULL, "worker %s: send queue full (%" PRIu32 " messages); stream ended",
                           p->name, q);
    }
    proto_sendq_push(&p->q, m);
    peer_pump(p);
    return STRATA_OK;
}

/* Under p->mu: packs msg and queues it (peer_push). False when it cannot. */
static bool peer_queue(ctl_peer *p, const Strata__Internal__V1__CoordinatorMessage *msg)
{
    proto_msg *pm;
    strata_error err = {0};
    return proto_msg_pack(&msg->base, p->max_bytes, &pm, &err) == STRATA_OK && peer_push(p, pm, &err) == STRATA_OK;
}

/* RECV_MESSAGE completed (server thread). */
static void peer_recv_done(proto_tag *t, bool success)
{
    ctl_peer *p = PROTO_CONTAINER_OF(t, ctl_peer, recv_tag);
    ctl_server *s = p->srv;
    pthread_mutex_lock(&p->mu);
    grpc_byte_buffer *bb = p->recv_bb;
    p->recv_bb = NULL;
    if (p->ended || !success) {
        /* Over already, or the call failed: RECV_CLOSE_ON_SERVER reports it. */
        if (!success)
            p->q.dead = true;
        pthread_mutex_unlock(&p->mu);
        if (bb)
            grpc_byte_buffer_destroy(bb);
        peer_put(p);
        return;
    }
    if (!bb) {
        /* The worker half-closed, or so it seems: gRPC 1.51 also ends the message stream this
         * way when the connection breaks (a killed worker). Answer OK after the queued
         * messages; whether the end was clean is known when RECV_CLOSE_ON_SERVER completes
         * (cancelled or not), and on_gone waits for that. */
        if (p->state == PEER_JOINED) {
            if (peer_end(p, GRPC_STATUS_OK, "worker closed the control stream", true, true))
                p->gone_provisional = true;
        } else   /* (nothing it needs is queued: the Challenge is dropped, not flushed) */
            peer_end(p, GRPC_STATUS_INVALID_ARGUMENT, "control stream closed before a Join", true, false);
        pthread_mutex_unlock(&p->mu);
        peer_put(p);
        return;
    }
    int state = p->state;
    pthread_mutex_unlock(&p->mu);

    ProtobufCMessage *pm = NULL;
    strata_error err = {0};
    /* Before the Join is checked the peer is a stranger: a Join is well under a KiB, so a first
     * message is not decoded (copied twice) beyond CTL_MAX_JOIN_BYTES whatever the stream's limit. */
    const size_t limit = state == PEER_NEW && s->max_bytes > CTL_MAX_JOIN_BYTES ? CTL_MAX_JOIN_BYTES : s->max_bytes;
    int rc = proto_unpack(bb, &strata__internal__v1__worker_message__descriptor, limit, &pm, &err);
    grpc_byte_buffer_destroy(bb);
    Strata__Internal__V1__WorkerMessage *m = (Strata__Internal__V1__WorkerMessage *)pm;
    grpc_status_code refuse = GRPC_STATUS_OK;
    char why[600] = "";
    uint8_t admit_proof[PROTO_CONTROL_PROOF_BYTES];
    if (rc) {
        refuse = proto_grpc_status(rc);
        snprintf(why, sizeof why, "undecodable WorkerMessage: %s", err.msg);
    } else if (state == PEER_NEW) {
        refuse = check_join(s, p, m, admit_proof, why, sizeof why);
    } else if (m->kind_case == STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_JOIN) {
        refuse = GRPC_STATUS_INVALID_ARGUMENT;
        snprintf(why, sizeof why, "Join sent twice on one control stream");
    } else if (m->kind_case == STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND__NOT_SET) {
        refuse = GRPC_STATUS_INVALID_ARGUMENT;
        snprintf(why, sizeof why, "empty WorkerMessage (no kind set)");
    }

    pthread_mutex_lock(&p->mu);
    if (refuse != GRPC_STATUS_OK) {
        char *addr = NULL;
        if (state == PEER_NEW) {
            p->state = PEER_REFUSED;
            addr = s->h.on_refused && p->call ? grpc_call_get_peer(p->call) : NULL;
        }
        /* Not ended already (a late Join that end_late_joins refused has been reported). */
        const bool ended_now = peer_end(p, refuse, why, true, false);
        pthread_mutex_unlock(&p->mu);
        if (state == PEER_NEW && ended_now && s->h.on_refused)
            s->h.on_refused(s->h.ctx, addr ? addr : "?", (int)refuse, why);
        gpr_free(addr);
    } else if (p->ended) {
        /* ctl_peer_close or shutdown meanwhile: the message is not delivered. */
        pthread_mutex_unlock(&p->mu);
    } else if (state == PEER_NEW) {
        const Strata__Internal__V1__Join *j = m->join;
        snprintf(p->name, sizeof p->name, "%s", j->worker_name);
        /* The coordinator's proof goes out before anything on_join sends (the Assignment). */
        Strata__Internal__V1__Admitted adm = STRATA__INTERNAL__V1__ADMITTED__INIT;
        adm.secret_proof = (ProtobufCBinaryData){sizeof admit_proof, admit_proof};
        Strata__Internal__V1__CoordinatorMessage cm = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__INIT;
        cm.kind_case = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_ADMITTED;
        cm.admitted = &adm;
        (void)peer_queue(p, &cm);   /* when it cannot, the stream's end reaches on_join's sends too */
        p->state = PEER_JOINING;
        p->in_cb = true;
        pthread_mutex_unlock(&p->mu);
        strata_error jerr = {0};
        int jrc = s->h.on_join(s->h.ctx, p, j, &jerr);
        pthread_mutex_lock(&p->mu);
        p->in_cb = false;
        if (jrc == STRATA_OK) {
            p->state = PEER_JOINED;
            peer_arm_recv(p);
        } else {
            p->state = PEER_REFUSED;
            char msg[sizeof jerr.msg];
            snprintf(msg, sizeof msg, "%s", jerr.msg[0] ? jerr.msg : strata_status_name(jrc));
            peer_end(p, proto_grpc_status(jrc), msg, true, false);
        }
        pthread_mutex_unlock(&p->mu);
    } else {
        p->in_cb = true;
        pthread_mutex_unlock(&p->mu);
        s->h.on_message(s->h.ctx, p, m);
        pthread_mutex_lock(&p->mu);
        p->in_cb = false;
        peer_arm_recv(p);
        pthread_mutex_unlock(&p->mu);
    }
    if (m)
        protobuf_c_message_free_unpacked(&m->base, NULL);
    peer_put(p);
}

/* A send batch completed (server thread). */
static void peer_send_done(proto_tag *t, bool success)
{
    ctl_peer *p = PROTO_CONTAINER_OF(t, ctl_peer, send_tag);
    pthread_mutex_lock(&p->mu);
    proto_sendq_sent(&p->q, success);
    peer_pump(p);
    pthread_mutex_unlock(&p->mu);
    peer_put(p);
}

/* RECV_CLOSE_ON_SERVER completed (server thread): the call is over. */
static void peer_close_done(proto_tag *t, bool success)
{
    (void)success;
    ctl_peer *p = PROTO_CONTAINER_OF(t, ctl_peer, close_tag);
    pthread_mutex_lock(&p->mu);
    p->q.dead = true;
    proto_sendq_drop(&p->q);
    if (p->gone_provisional) {
        p->gone_provisional = false;
        if (p->cancelled) {
            p->gone_status = GRPC_STATUS_UNAVAILABLE;
            snprintf(p->gone_why, sizeof p->gone_why, "%s",
                     "worker connection lost after its half-close (process died, network failure or cancel)");
        }
    }
    /* Not ended by us: the worker cancelled, its connection broke or missed keepalive. */
    peer_end(p, GRPC_STATUS_UNAVAILABLE,
             "worker connection lost (process died, network failure, keepalive timeout or cancel)", false, false);
    pthread_mutex_unlock(&p->mu);
    peer_put(p);
}

/* The host part of a gRPC peer address ("ipv4:10.0.0.7:41234" -> "ipv4:10.0.0.7",
 * "ipv6:%5B::1%5D:5" -> "ipv6:%5B::1%5D", gRPC percent-encoding the brackets): the port differs
 * for every connection of one client. (kvstore/hostport.h's parser takes "[::1]:5", not this.) */
static void host_of(const char *addr, char *out, size_t cap)
{
    snprintf(out, cap, "%s", addr);
    char *colon = strrchr(out, ':');
    if (!colon || !colon[1])
        return;
    for (const char *d = colon + 1; *d; d++)
        if (*d < '0' || *d > '9')
            return;
    if (colon > out && colon[-1] != ':')   /* "ipv4:1.2.3.4:5", "ipv6:%5B::1%5D:5"; not "unix:" or "x::5" */
        *colon = '\0';
}

/* Under s->ps.mu: whether p is a stream still waiting for its Join whose call is going on, and
 * if so, when hold, takes a hold on it (busy) for refuse_waiting. */
static bool waiting_for_join(ctl_peer *p, bool hold)
{
    pthread_mutex_lock(&p->mu);
    const bool waiting = p->state == PEER_NEW && !p->ended && !p->released && p->busy > 0;
    if (waiting && hold)
        p->busy++;
    pthread_mutex_unlock(&p->mu);
    return waiting;
}

/* Ends a stream held by waiting_for_join with this status, unless its Join came meanwhile, reports
 * it to on_refused, and drops the hold. Without s->ps.mu (on_refused may take the handler's
 * locks). */
static void refuse_waiting(ctl_server *s, ctl_peer *p, grpc_status_code code, const char *why)
{
    pthread_mutex_lock(&p->mu);
    const bool ended_here = p->state == PEER_NEW && peer_end(p, code, why, true, false);
    if (ended_here)
        p->state = PEER_REFUSED;
    pthread_mutex_unlock(&p->mu);
    if (ended_here && s->h.on_refused)
        s->h.on_refused(s->h.ctx, p->addr[0] ? p->addr : "?", (int)code, why);
    peer_put(p);
}

/* Server tick: streams that sent no Join within join_timeout_ms end with DEADLINE_EXCEEDED.
 * Collected with a hold each under s->ps.mu, ended without it (on_refused may take the
 * handler's locks), as shutdown does. */
static void end_late_joins(void *ctx)
{
    ctl_server *s = ctx;
    const int64_t now = strata_mono_ms();
    ctl_peer *late = NULL;
    pthread_mutex_lock(&s->ps.mu);
    for (ctl_peer *p = s->peers; p; p = p->next)
        if (now - p->opened_ms >= s->join_timeout_ms && waiting_for_join(p, true)) {
            p->lnext = late;
            late = p;
        }
    pthread_mutex_unlock(&s->ps.mu);
    char why[96];
    snprintf(why, sizeof why, "no Join within %d ms of opening the control stream", s->join_timeout_ms);
    while (late) {
        ctl_peer *p = late;
        late = p->lnext;
        refuse_waiting(s, p, GRPC_STATUS_DEADLINE_EXCEEDED, why);
    }
}

/* A new Attach call (server thread). */
static void accept_call(ctl_server *s, grpc_call *call)
{
    ctl_peer *p = calloc(1, sizeof *p);
    if (!p) {
        reply_error(s, call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    p->recv_tag.done = peer_recv_done;
    p->send_tag.done = peer_send_done;
    p->close_tag.done = peer_close_done;
    p->srv = s;
    p->call = call;
    p->max_bytes = s->max_bytes;
    p->max_queued = s->max_queued;
    proto_sendq_init(&p->q, call, &p->send_tag);
    atomic_init(&p->refs, 1);
    pthread_mutex_init(&p->mu, NULL);
    /* A temporary hold while the first batches start (shutdown may see the peer already). */
    p->busy = 1;
    strata_error nerr = {0};
    if (strata_random_bytes(p->nonce, sizeof p->nonce, &nerr) != STRATA_OK) {
        server_log("no nonce for a new control stream: %s", nerr.msg);
        pthread_mutex_destroy(&p->mu);
        free(p);
        reply_error(s, call, GRPC_STATUS_INTERNAL, "coordinator error");
        return;
    }
    char *peer = grpc_call_get_peer(call);
    if (peer) {
        snprintf(p->addr, sizeof p->addr, "%s", peer);
        gpr_free(peer);
    }
    host_of(p->addr, p->host, sizeof p->host);

    p->opened_ms = strata_mono_ms();

    pthread_mutex_lock(&s->ps.mu);
    bool refuse = s->ps.shutting_down;
    ctl_peer *oldest = NULL;
    uint32_t waiting = 0;
    if (!refuse) {
        /* The list runs newest first: the last waiting stream of this host seen is its oldest. */
        for (ctl_peer *q = s->peers; q; q = q->next)
            if (!strcmp(q->host, p->host) && waiting_for_join(q, false)) {
                oldest = q;
                waiting++;
            }
        if (waiting < s->max_waiting_per_host || !waiting_for_join(oldest, true))
            oldest = NULL;
        p->next = s->peers;
        if (s->peers)
            s->peers->prev = p;
        s->peers = p;
        s->live++;
    }
    pthread_mutex_unlock(&s->ps.mu);
    if (refuse) {
        pthread_mutex_destroy(&p->mu);
        free(p);
        reply_error(s, call, GRPC_STATUS_UNAVAILABLE, "coordinator shutting down");
        return;
    }
    if (oldest) {
        char why[320];
        snprintf(why, sizeof why,
                 "%" PRIu32 " control streams from %s were waiting for their Join (the limit): the oldest gives way",
                 waiting, p->host);
        refuse_waiting(s, oldest, GRPC_STATUS_RESOURCE_EXHAUSTED, why);
    }

    pthread_mutex_lock(&p->mu);
    p->busy++;
    grpc_call_error e = proto_call_recv_close(call, &p->cancelled, &p->close_tag);
    if (e != GRPC_CALL_OK) {
        server_log("cannot start RECV_CLOSE_ON_SERVER: %s", grpc_call_error_to_string(e));
        p->busy--;
        p->q.dead = true;
        peer_end(p, GRPC_STATUS_INTERNAL, "coordinator error", false, false);
        grpc_call_cancel_with_status(call, GRPC_STATUS_INTERNAL, "coordinator error", NULL);
    } else {
        /* The worker proves the secret over this nonce (proto/control_auth.h). */
        Strata__Internal__V1__Challenge ch = STRATA__INTERNAL__V1__CHALLENGE__INIT;
        ch.nonce = (ProtobufCBinaryData){sizeof p->nonce, p->nonce};
        Strata__Internal__V1__CoordinatorMessage cm = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__INIT;
        cm.kind_case = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_CHALLENGE;
        cm.challenge = &ch;
        if (peer_queue(p, &cm))
            peer_arm_recv(p);
        else
            peer_end(p, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory", true, false);
    }
    pthread_mutex_unlock(&p->mu);
    peer_put(p);
}

/* ------------------------------------------------------------------------------------------- */
/* Requesting calls                                                                            */

/* A new Attach call, or the request withdrawn at shutdown (server thread). */
static void request_done(proto_tag *t, bool success)
{
    proto_request got;
    if (!proto_request_take((proto_request *)t, success, &got))
        return;
    grpc_metadata_array_destroy(&got.md);
    accept_call(PROTO_CONTAINER_OF(got.ps, ctl_server, ps), got.call);
}

/* ------------------------------------------------------------------------------------------- */
/* Peer API                                                                                    */

int ctl_peer_send(ctl_peer *p, const Strata__Internal__V1__CoordinatorMessage *msg, strata_error *err)
{
    if (!p || !msg)
        return strata_fail(err, STRATA_EINVAL, "ctl_peer_send: NULL argument");
    proto_msg *m;
    int rc = proto_msg_pack(&msg->base, p->max_bytes, &m, err);
    if (rc) {
        if (rc == STRATA_EFULL && err)
            err->code = rc = STRATA_EINVAL; /* one oversized message: the stream goes on */
        return rc;
    }
    pthread_mutex_lock(&p->mu);
    rc = peer_push(p, m, err);
    pthread_mutex_unlock(&p->mu);
    return rc;
}

void ctl_peer_close(ctl_peer *p, int grpc_status, const char *message)
{
    if (!p)
        return;
    if (grpc_status < 0 || grpc_status > 16)
        grpc_status = GRPC_STATUS_UNKNOWN;
    pthread_mutex_lock(&p->mu);
    if (!p->released)
        peer_end(p, (grpc_status_code)grpc_status, message, true, false);
    pthread_mutex_unlock(&p->mu);
}

void ctl_peer_ref(ctl_peer *p)
{
    if (p)
        atomic_fetch_add(&p->refs, 1);
}

void ctl_peer_unref(ctl_peer *p)
{
    if (p)
        peer_obj_unref(p);
}

const char *ctl_peer_name(const ctl_peer *p)
{
    return p ? p->name : "";
}

const char *ctl_peer_addr(const ctl_peer *p)
{
    return p ? p->addr : "";
}

void ctl_peer_set_user(ctl_peer *p, void *user)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    p->user = user;
    pthread_mutex_unlock(&p->mu);
}

void *ctl_peer_get_user(const ctl_peer *cp)
{
    if (!cp)
        return NULL;
    ctl_peer *p = (ctl_peer *)cp; /* the mutex is not part of the logical state */
    pthread_mutex_lock(&p->mu);
    void *u = p->user;
    pthread_mutex_unlock(&p->mu);
    return u;
}

/* ------------------------------------------------------------------------------------------- */
/* Start and shutdown                                                                          */

ctl_server_options ctl_server_options_default(void)
{
    ctl_server_options o;
    memset(&o, 0, sizeof o);
    o.listen_addr = CTL_SERVER_DEFAULT_ADDR;
    o.max_message_bytes = CTL_DEFAULT_MAX_MESSAGE_BYTES;
    o.max_queued_messages = CTL_SERVER_DEFAULT_MAX_QUEUED;
    o.threads = CTL_SERVER_DEFAULT_THREADS;
    o.keepalive_time_ms = CTL_DEFAULT_KEEPALIVE_TIME_MS;
    o.keepalive_timeout_ms = CTL_DEFAULT_KEEPALIVE_TIMEOUT_MS;
    o.min_recv_ping_interval_ms = CTL_SERVER_DEFAULT_MIN_RECV_PING_MS;
    o.join_timeout_ms = CTL_DEFAULT_JOIN_TIMEOUT_MS;
    o.max_waiting_per_host = CTL_DEFAULT_MAX_WAITING_PER_HOST;
    return o;
}

static void server_free(ctl_server *s)
{
    if (s->secret) {
        volatile unsigned char *v = s->secret;
        for (size_t i = 0; i < s->secret_len; i++)
            v[i] = 0;
        free(s->secret);
    }
    proto_server_free(&s->ps);
    free(s);
}

int ctl_server_start(const ctl_server_options *o, const ctl_handler *h, ctl_server **out, strata_error *err)
{
    if (out)
        *out = NULL;
    if (!o || !h || !out)
        return strata_fail(err, STRATA_EINVAL, "ctl_server_start: NULL options, handler or output");
    if (!h->on_join || !h->on_message || !h->on_gone)
        return strata_fail(err, STRATA_EINVAL, "ctl_server_start: the handler needs on_join, on_message and on_gone");
    ctl_server_options opt = ctl_server_options_default();
    if (o->listen_addr && *o->listen_addr)
        opt.listen_addr = o->listen_addr;
    opt.cluster_secret = o->cluster_secret;
    opt.cluster_secret_len = o->cluster_secret_len;
    if (o->max_message_bytes)
        opt.max_message_bytes = o->max_message_bytes;
    if (o->max_queued_messages)
        opt.max_queued_messages = o->max_queued_messages;
    if (o->threads)
        opt.threads = o->threads;
    if (o->keepalive_time_ms)
        opt.keepalive_time_ms = o->keepalive_time_ms;
    if (o->keepalive_timeout_ms)
        opt.keepalive_timeout_ms = o->keepalive_timeout_ms;
    if (o->min_recv_ping_interval_ms)
        opt.min_recv_ping_interval_ms = o->min_recv_ping_interval_ms;
    opt.tls_cert_file = o->tls_cert_file;
    opt.tls_key_file = o->tls_key_file;
    if (o->join_timeout_ms)
        opt.join_timeout_ms = o->join_timeout_ms;
    if (o->max_waiting_per_host)
        opt.max_waiting_per_host = o->max_waiting_per_host;
    if (opt.join_timeout_ms < 0)
        return strata_fail(err, STRATA_EINVAL, "join_timeout_ms must not be negative");
    if (!opt.tls_cert_file != !opt.tls_key_file)
        return strata_fail(err, STRATA_EINVAL, "TLS needs both a certificate file and a key file");
    if (!opt.cluster_secret || opt.cluster_secret_len < CTL_SECRET_MIN_BYTES ||
        opt.cluster_secret_len > CTL_SECRET_MAX_BYTES)
        return strata_fail(err, STRATA_EINVAL, "the cluster secret must be %d to %d bytes (got %zu)",
                           CTL_SECRET_MIN_BYTES, CTL_SECRET_MAX_BYTES, opt.cluster_secret ? opt.cluster_secret_len : 0);
    if (opt.max_message_bytes > INT32_MAX)
        return strata_fail(err, STRATA_EINVAL, "max_message_bytes %zu is above 2 GiB", opt.max_message_bytes);
    if (opt.threads > 64)
        return strata_fail(err, STRATA_EINVAL, "threads %" PRIu32 " is above 64", opt.threads);
    if (opt.keepalive_time_ms < 0 || opt.keepalive_timeout_ms < 0 || opt.min_recv_ping_interval_ms < 0)
        return strata_fail(err, STRATA_EINVAL, "keepalive times must not be negative");

    ctl_server *s = calloc(1, sizeof *s);
    if (!s)
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    if (proto_server_init(&s->ps, "control_server", opt.threads)) {
        free(s);
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    }
    s->h = *h;
    s->max_bytes = opt.max_message_bytes;
    s->max_queued = opt.max_queued_messages;
    s->join_timeout_ms = opt.join_timeout_ms;
    s->max_waiting_per_host = opt.max_waiting_per_host;
    s->secret = malloc(opt.cluster_secret_len);
    if (!s->secret) {
        server_free(s);
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    }
    memcpy(s->secret, opt.cluster_secret, opt.cluster_secret_len);
    s->secret_len = opt.cluster_secret_len;

    grpc_arg args[10] = {
        proto_int_arg(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, (int)opt.max_message_bytes),
        /* Identity only: gRPC inflates a compressed message whole before its receive limit
         * applies, and this port answers before the cluster secret is checked. */
        proto_int_arg(GRPC_COMPRESSION_CHANNEL_ENABLED_ALGORITHMS_BITSET, 1),
        proto_int_arg(GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, (int)opt.max_message_bytes),
        /* A bind conflict must be an error, not two servers sharing a port. */
        proto_int_arg(GRPC_ARG_ALLOW_REUSEPORT, 0),
        /* Death detection: ping every worker connection, also while its stream is idle. */
        proto_int_arg(GRPC_ARG_KEEPALIVE_TIME_MS, opt.keepalive_time_ms),
        proto_int_arg(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, opt.keepalive_timeout_ms),
        proto_int_arg(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1),
        /* gRPC stops pinging after 2 pings without data by default: an idle worker would then
         * go unwatched. */
        proto_int_arg(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0),
        /* The workers' own keepalive pings are welcome this often ... */
        proto_int_arg(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, opt.min_recv_ping_interval_ms),
        /* ... and a worker configured to ping faster is not cut off with GOAWAY
         * "too_many_pings" (workers are our own processes; a dropped control stream costs far
         * more than a ping). */
        proto_int_arg(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0),
    };
    proto_server_create(&s->ps, args, sizeof args / sizeof args[0]);
    s->method = grpc_server_register_method(s->ps.server, CTL_ATTACH_METHOD, NULL, GRPC_SRM_PAYLOAD_NONE, 0);
    int rc = STRATA_OK;
    if (!s->method)
        rc = strata_fail(err, STRATA_EINVAL, "cannot register %s", CTL_ATTACH_METHOD);
    else
        rc = proto_server_listen(&s->ps, opt.listen_addr, opt.tls_cert_file, opt.tls_key_file, err);
    if (rc) {
        proto_server_abandon(&s->ps);
        server_free(s);
        return rc;
    }
    proto_server_start(&s->ps);
    proto_server_add_requests(&s->ps, s->method, false, 0, CTL_REQUESTS, request_done);
    s->ps.tick = end_late_joins;
    s->ps.tick_ctx = s;
    s->ps.tick_ms = s->join_timeout_ms / 4 < 10 ? 10 : s->join_timeout_ms / 4 > 1000 ? 1000 : s->join_timeout_ms / 4;
    if (proto_server_run(&s->ps)) {
        server_free(s);
        return strata_fail(err, STRATA_EIO, "cannot start the control server threads");
    }
    *out = s;
    return STRATA_OK;
}

int ctl_server_port(const ctl_server *s)
{
    return s ? s->ps.port : 0;
}

/* Under s->ps.mu: a temporary hold on a peer whose call is not released (peers in the live
 * list are unlinked, under s->ps.mu, before their call is released, so they are valid here). */
static bool peer_hold_if_live(ctl_peer *p)
{
    pthread_mutex_lock(&p->mu);
    bool ok = !p->released && p->busy > 0;
    if (ok)
        p->busy++;
    pthread_mutex_unlock(&p->mu);
    return ok;
}

void ctl_server_shutdown(ctl_server *s)
{
    if (!s)
        return;
    /* No new connections or calls from here (workers get UNAVAILABLE); calls in flight go on. */
    proto_server_shutdown_begin(&s->ps);

    /* End every stream with a normal status batch after its queued messages (a Shutdown sent
     * just before still arrives). A status batch, not grpc_call_cancel_with_status: on a
     * connection draining after GOAWAY, gRPC 1.51 closes the connection as soon as the last
     * stream is cancelled, before the cancel's trailers are written (see
     * coordinator/server/README.md). Collect the peers under s->ps.mu with a hold each, then
     * work without it: on_gone may run here and take the handler's locks. */
    pthread_mutex_lock(&s->ps.mu);
    ctl_peer *to_end = NULL;
    for (ctl_peer *p = s->peers; p; p = p->next)
        if (peer_hold_if_live(p)) {
            p->snext = to_end;
            to_end = p;
        }
    pthread_mutex_unlock(&s->ps.mu);
    while (to_end) {
        ctl_peer *p = to_end;
        to_end = p->snext;
        pthread_mutex_lock(&p->mu);
        peer_end(p, GRPC_STATUS_UNAVAILABLE, "coordinator shutting down", true, true);
        pthread_mutex_unlock(&p->mu);
        peer_put(p);
    }

    /* A status cannot overtake a message that flow control holds (a worker that does not
     * read): after a grace period, cancel what is left outright. */
    pthread_mutex_lock(&s->ps.mu);
    proto_server_wait(&s->ps, &s->live, CTL_SHUTDOWN_GRACE_MS, NULL);
    for (ctl_peer *p = s->peers; p; p = p->next) {
        pthread_mutex_lock(&p->mu);
        if (!p->released)
            grpc_call_cancel_with_status(p->call, GRPC_STATUS_UNAVAILABLE, "coordinator shutting down", NULL);
        pthread_mutex_unlock(&p->mu);
    }
    proto_server_wait(&s->ps, &s->live, -1, "worker stream(s) to end");
    pthread_mutex_unlock(&s->ps.mu);

    proto_server_shutdown_end(&s->ps);
    server_free(s);
}
