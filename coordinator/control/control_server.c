/* The control-plane server on the gRPC C core. See control_server.h (contract) and README.md.
 *
 * Structure (the patterns of coordinator/server/api_server.c). One completion queue created for
 * grpc_completion_queue_next carries every event: new Attach calls (several outstanding
 * registered requests, plus a generic request that answers unknown methods UNIMPLEMENTED), the
 * one-batch replies that refuse calls during shutdown, each peer's receive, send and close
 * batches, and the server's shutdown notification. `threads` threads block in
 * grpc_completion_queue_next and dispatch on a small tag header at the start of every tag
 * object.
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
 * Lock order: server mutex, then peer mutex; nothing takes the server mutex while holding a
 * peer's. No lock is held during a callback. */
#include "coordinator/control/control_server.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/byte_buffer.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>

#include "proto/grpc_util.h"
#include "proto/validate.h"

/* Outstanding grpc_server_request_registered_call for Attach (new calls wait inside gRPC when
 * all are taken, until one is re-armed). */
#define CTL_REQUESTS 4
/* How long shutdown lets final statuses pass before cancelling streams outright. */
#define CTL_SHUTDOWN_GRACE_MS 1000

/* ------------------------------------------------------------------------------------------- */
/* Tags                                                                                        */

typedef enum tag_kind {
    TAG_REQUEST,    /* srv_request: a new Attach call */
    TAG_GENERIC,    /* srv_generic: a call to an unknown method */
    TAG_REPLY,      /* srv_reply: one batch refusing a call */
    TAG_PEER_RECV,  /* ctl_peer.recv_tag */
    TAG_PEER_SEND,  /* ctl_peer.send_tag */
    TAG_PEER_CLOSE, /* ctl_peer.close_tag */
    TAG_SHUTDOWN,   /* ctl_server.shutdown_tag */
} tag_kind;

typedef struct srv_tag {
    tag_kind kind;
} srv_tag;

typedef struct srv_request {
    srv_tag tag;
    ctl_server *srv;
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
} srv_request;

typedef struct srv_generic {
    srv_tag tag;
    ctl_server *srv;
    grpc_call *call;
    grpc_call_details details;
    grpc_metadata_array md;
} srv_generic;

typedef struct srv_reply {
    srv_tag tag;
    grpc_call *call;
    grpc_slice details;
    int cancelled;
} srv_reply;

typedef struct msg_node {
    struct msg_node *next;
    grpc_byte_buffer *bb;
} msg_node;

enum peer_state {
    PEER_NEW,     /* waiting for the Join */
    PEER_JOINING, /* on_join is running */
    PEER_JOINED,  /* on_join accepted it: on_gone is owed */
    PEER_REFUSED, /* checks or on_join refused it */
};

struct ctl_peer {
    srv_tag recv_tag;
    srv_tag send_tag;
    srv_tag close_tag;
    ctl_server *srv; /* valid while the call is not released */
    grpc_call *call;
    atomic_uint refs; /* object memory: the server's (until release) + the handler's */
    size_t max_bytes;
    uint32_t max_queued;
    char name[CTL_MAX_WORKER_NAME + 1]; /* set before on_join, constant after */
    char addr[128];

    pthread_mutex_t mu;
    /* Under mu. */
    unsigned busy;             /* batches in flight + temporary holds */
    bool released;             /* the call was released; srv may be gone */
    int state;                 /* enum peer_state */
    bool in_cb;                /* a callback of this peer is running */
    bool ended;                /* the stream is over for the handler: no sends, no messages */
    bool dead;                 /* the call cannot send any more (cancelled, failed) */
    bool gone_done;            /* on_gone was delivered */
    bool gone_provisional;     /* half-close seen: on_gone waits for RECV_CLOSE_ON_SERVER's verdict */
    int gone_status;
    char gone_why[256];
    void *user;
    msg_node *head, *tail;
    uint32_t queued;           /* messages in the queue (not counting the one in flight) */
    bool send_in_flight;
    bool md_sent;
    bool status_pending;       /* the final status goes out once the queue is empty */
    bool status_started;
    grpc_status_code status;
    grpc_slice status_details;
    grpc_byte_buffer *send_bb; /* the message of the send batch in flight */
    grpc_byte_buffer *recv_bb; /* RECV_MESSAGE's output */
    int cancelled;             /* RECV_CLOSE_ON_SERVER's output */

    /* Under srv->mu. */
    ctl_peer *prev, *next; /* live list (calls not yet released) */
    ctl_peer *snext;       /* shutdown's private list */
};

struct ctl_server {
    ctl_handler h;
    grpc_server *server;
    grpc_completion_queue *cq;
    void *method;
    int port;
    unsigned char *secret;
    size_t secret_len;
    size_t max_bytes;
    uint32_t max_queued;

    pthread_t *threads;
    uint32_t n_threads;
    srv_tag shutdown_tag;

    pthread_mutex_t mu;
    pthread_cond_t cond;
    /* Under mu. */
    bool shutting_down;
    bool shutdown_done; /* the shutdown tag arrived */
    uint32_t live;      /* peers whose call is not yet released */
    ctl_peer *peers;
};

static bool arm_request(ctl_server *s, srv_request *r);
static bool arm_generic(ctl_server *s, srv_generic *g);

/* ------------------------------------------------------------------------------------------- */
/* Small helpers                                                                               */

static void server_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void server_log(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("strata control_server: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

/* One line of at most cap-1 bytes of valid UTF-8 (cut at the first bad byte; CR/LF -> space). */
static void one_line(char *dst, size_t cap, const char *src)
{
    if (!src)
        src = "";
    size_t n = strlen(src);
    if (n >= cap)
        n = cap - 1;
    n = proto_utf8_check(src, n);
    memcpy(dst, src, n);
    dst[n] = 0;
    for (char *p = dst; *p; p++)
        if (*p == '\n' || *p == '\r')
            *p = ' ';
}

/* A one-batch refusal: initial metadata, status, RECV_CLOSE_ON_SERVER. Takes the call. */
static void reply_error(grpc_call *call, grpc_status_code code, const char *message)
{
    srv_reply *r = calloc(1, sizeof *r);
    if (!r) {
        grpc_call_cancel_with_status(call, code, message, NULL);
        grpc_call_unref(call);
        return;
    }
    r->tag.kind = TAG_REPLY;
    r->call = call;
    r->details = grpc_slice_from_copied_string(message ? message : "");
    grpc_op ops[3];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[1].data.send_status_from_server.status = code;
    ops[1].data.send_status_from_server.status_details = &r->details;
    ops[2].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[2].data.recv_close_on_server.cancelled = &r->cancelled;
    grpc_call_error e = grpc_call_start_batch(call, ops, 3, &r->tag, NULL);
    if (e != GRPC_CALL_OK) {
        server_log("cannot start a reply batch: %s", grpc_call_error_to_string(e));
        grpc_call_cancel_with_status(call, code, message, NULL);
        grpc_slice_unref(r->details);
        grpc_call_unref(call);
        free(r);
    }
}

static void reply_done(srv_reply *r)
{
    grpc_slice_unref(r->details);
    grpc_call_unref(r->call);
    free(r);
}

/* ------------------------------------------------------------------------------------------- */
/* Peers: queue, pump, end                                                                     */

/* Under p->mu. */
static void peer_drop_queue(ctl_peer *p)
{
    while (p->head) {
        msg_node *n = p->head;
        p->head = n->next;
        grpc_byte_buffer_destroy(n->bb);
        free(n);
    }
    p->tail = NULL;
    p->queued = 0;
}

/* Under p->mu: starts the next send batch when none is in flight. The caller holds a busy
 * count or knows one is held (the close batch is in flight until the call is over). */
static void peer_pump(ctl_peer *p)
{
    if (p->send_in_flight || p->released)
        return;
    if (p->dead) {
        peer_drop_queue(p);
        return;
    }
    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    size_t n = 0;
    if (!p->md_sent && (p->head || (p->status_pending && !p->status_started))) {
        ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
        n++;
    }
    if (p->head) {
        msg_node *m = p->head;
        p->head = m->next;
        if (!p->head)
            p->tail = NULL;
        p->queued--;
        p->send_bb = m->bb;
        free(m);
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n].data.send_message.send_message = p->send_bb;
        n++;
    } else if (p->status_pending && !p->status_started) {
        p->status_started = true;
        ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
        ops[n].data.send_status_from_server.status = p->status;
        ops[n].data.send_status_from_server.status_details = &p->status_details;
        n++;
    } else {
        return;
    }
    p->md_sent = true;
    p->send_in_flight = true;
    p->busy++;
    grpc_call_error e = grpc_call_start_batch(p->call, ops, n, &p->send_tag, NULL);
    if (e != GRPC_CALL_OK) {
        /* Not expected (one send at a time is exactly what gRPC allows); give up on the call.
         * The close batch is still in flight, so busy cannot reach 0 here. */
        server_log("worker %s: cannot start a send batch: %s", p->name, grpc_call_error_to_string(e));
        p->send_in_flight = false;
        p->busy--;
        if (p->send_bb) {
            grpc_byte_buffer_destroy(p->send_bb);
            p->send_bb = NULL;
        }
        p->dead = true;
        peer_drop_queue(p);
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
    one_line(p->gone_why, sizeof p->gone_why, why);
    if (!send_status || p->dead || p->released)
        return true;
    if (!flush)
        peer_drop_queue(p);
    p->status_pending = true;
    p->status = code;
    grpc_slice_unref(p->status_details);
    p->status_details = grpc_slice_from_copied_string(p->gone_why);
    if (!flush && p->send_in_flight) {
        p->dead = true;
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
    pthread_mutex_lock(&s->mu);
    if (p->prev)
        p->prev->next = p->next;
    else
        s->peers = p->next;
    if (p->next)
        p->next->prev = p->prev;
    p->prev = p->next = NULL;
    pthread_mutex_unlock(&s->mu);

    pthread_mutex_lock(&p->mu);
    peer_drop_queue(p);
    if (p->send_bb) {
        grpc_byte_buffer_destroy(p->send_bb);
        p->send_bb = NULL;
    }
    if (p->recv_bb) {
        grpc_byte_buffer_destroy(p->recv_bb);
        p->recv_bb = NULL;
    }
    grpc_slice_unref(p->status_details);
    p->status_details = grpc_empty_slice();
    grpc_call *call = p->call;
    p->call = NULL;
    p->srv = NULL;
    pthread_mutex_unlock(&p->mu);
    grpc_call_unref(call);

    /* Counted down last: shutdown waits for live == 0 before it destroys the queue and the
     * server. Nothing touches s after the unlock. */
    pthread_mutex_lock(&s->mu);
    s->live--;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->mu);
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
    if (p->ended || p->dead)
        return;
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &p->recv_bb;
    p->busy++;
    grpc_call_error e = grpc_call_start_batch(p->call, &op, 1, &p->recv_tag, NULL);
    if (e != GRPC_CALL_OK) {
        server_log("worker %s: cannot start a receive: %s", p->name, grpc_call_error_to_string(e));
        p->busy--;
        peer_end(p, GRPC_STATUS_INTERNAL, "coordinator receive failed", false, false);
        p->dead = true;
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

/* The Join checks that do not need the handler. GRPC_STATUS_OK when they pass. */
static grpc_status_code check_join(ctl_server *s, const Strata__Internal__V1__WorkerMessage *m, char *why,
                                   size_t cap)
{
    if (m->kind_case != STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_JOIN || !m->join) {
        snprintf(why, cap, "the first message of the control stream must be a Join (got %s)",
                 worker_kind_name(m->kind_case));
        return GRPC_STATUS_INVALID_ARGUMENT;
    }
    const Strata__Internal__V1__Join *j = m->join;
    if (!proto_secret_equal(j->cluster_secret.data, j->cluster_secret.len, s->secret, s->secret_len)) {
        snprintf(why, cap, "wrong cluster secret");
        return GRPC_STATUS_PERMISSION_DENIED;
    }
    if (j->protocol_version != CTL_PROTOCOL_VERSION) {
        snprintf(why, cap, "control protocol version mismatch: worker speaks %" PRIu32 ", coordinator speaks %u",
                 j->protocol_version, CTL_PROTOCOL_VERSION);
        return GRPC_STATUS_FAILED_PRECONDITION;
    }
    const char *name = j->worker_name ? j->worker_name : "";
    size_t n = strlen(name);
    bool ok = n >= 1 && n <= CTL_MAX_WORKER_NAME && proto_utf8_valid(name, n);
    for (size_t i = 0; ok && i < n; i++)
        ok = (unsigned char)name[i] >= 0x20 && name[i] != 0x7f;
    if (!ok) {
        snprintf(why, cap, "Join.worker_name must be 1-%d bytes of UTF-8 without control characters",
                 CTL_MAX_WORKER_NAME);
        return GRPC_STATUS_INVALID_ARGUMENT;
    }
    return GRPC_STATUS_OK;
}

/* RECV_MESSAGE completed (server thread). */
static void peer_recv_done(ctl_peer *p, bool success)
{
    ctl_server *s = p->srv;
    pthread_mutex_lock(&p->mu);
    grpc_byte_buffer *bb = p->recv_bb;
    p->recv_bb = NULL;
    if (p->ended || !success) {
        /* Over already, or the call failed: RECV_CLOSE_ON_SERVER reports it. */
        if (!success)
            p->dead = true;
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
        } else
            peer_end(p, GRPC_STATUS_INVALID_ARGUMENT, "control stream closed before a Join", true, true);
        pthread_mutex_unlock(&p->mu);
        peer_put(p);
        return;
    }
    int state = p->state;
    pthread_mutex_unlock(&p->mu);

    ProtobufCMessage *pm = NULL;
    strata_error err = {0};
    int rc = proto_unpack(bb, &strata__internal__v1__worker_message__descriptor, s->max_bytes, &pm, &err);
    grpc_byte_buffer_destroy(bb);
    Strata__Internal__V1__WorkerMessage *m = (Strata__Internal__V1__WorkerMessage *)pm;
    grpc_status_code refuse = GRPC_STATUS_OK;
    char why[600] = "";
    if (rc) {
        refuse = proto_grpc_status(rc);
        snprintf(why, sizeof why, "undecodable WorkerMessage: %s", err.msg);
    } else if (state == PEER_NEW) {
        refuse = check_join(s, m, why, sizeof why);
    } else if (m->kind_case == STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_JOIN) {
        refuse = GRPC_STATUS_INVALID_ARGUMENT;
        snprintf(why, sizeof why, "Join sent twice on one control stream");
    } else if (m->kind_case == STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND__NOT_SET) {
        refuse = GRPC_STATUS_INVALID_ARGUMENT;
        snprintf(why, sizeof why, "empty WorkerMessage (no kind set)");
    }

    pthread_mutex_lock(&p->mu);
    if (refuse != GRPC_STATUS_OK) {
        if (state == PEER_NEW)
            p->state = PEER_REFUSED;
        peer_end(p, refuse, why, true, false);
        pthread_mutex_unlock(&p->mu);
    } else if (p->ended) {
        /* ctl_peer_close or shutdown meanwhile: the message is not delivered. */
        pthread_mutex_unlock(&p->mu);
    } else if (state == PEER_NEW) {
        const Strata__Internal__V1__Join *j = m->join;
        snprintf(p->name, sizeof p->name, "%s", j->worker_name);
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
static void peer_send_done(ctl_peer *p, bool success)
{
    pthread_mutex_lock(&p->mu);
    p->send_in_flight = false;
    if (p->send_bb) {
        grpc_byte_buffer_destroy(p->send_bb);
        p->send_bb = NULL;
    }
    if (!success)
        p->dead = true; /* the call is gone; RECV_CLOSE_ON_SERVER says so too */
    peer_pump(p);
    pthread_mutex_unlock(&p->mu);
    peer_put(p);
}

/* RECV_CLOSE_ON_SERVER completed (server thread): the call is over. */
static void peer_close_done(ctl_peer *p)
{
    pthread_mutex_lock(&p->mu);
    p->dead = true;
    peer_drop_queue(p);
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

/* A new Attach call (server thread). */
static void accept_call(ctl_server *s, grpc_call *call)
{
    ctl_peer *p = calloc(1, sizeof *p);
    if (!p) {
        reply_error(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    p->recv_tag.kind = TAG_PEER_RECV;
    p->send_tag.kind = TAG_PEER_SEND;
    p->close_tag.kind = TAG_PEER_CLOSE;
    p->srv = s;
    p->call = call;
    p->max_bytes = s->max_bytes;
    p->max_queued = s->max_queued;
    p->status_details = grpc_empty_slice();
    atomic_init(&p->refs, 1);
    pthread_mutex_init(&p->mu, NULL);
    /* A temporary hold while the first batches start (shutdown may see the peer already). */
    p->busy = 1;
    char *peer = grpc_call_get_peer(call);
    if (peer) {
        snprintf(p->addr, sizeof p->addr, "%s", peer);
        gpr_free(peer);
    }

    pthread_mutex_lock(&s->mu);
    bool refuse = s->shutting_down;
    if (!refuse) {
        p->next = s->peers;
        if (s->peers)
            s->peers->prev = p;
        s->peers = p;
        s->live++;
    }
    pthread_mutex_unlock(&s->mu);
    if (refuse) {
        pthread_mutex_destroy(&p->mu);
        free(p);
        reply_error(call, GRPC_STATUS_UNAVAILABLE, "coordinator shutting down");
        return;
    }

    pthread_mutex_lock(&p->mu);
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &p->cancelled;
    p->busy++;
    grpc_call_error e = grpc_call_start_batch(call, &op, 1, &p->close_tag, NULL);
    if (e != GRPC_CALL_OK) {
        server_log("cannot start RECV_CLOSE_ON_SERVER: %s", grpc_call_error_to_string(e));
        p->busy--;
        p->dead = true;
        peer_end(p, GRPC_STATUS_INTERNAL, "coordinator error", false, false);
        grpc_call_cancel_with_status(call, GRPC_STATUS_INTERNAL, "coordinator error", NULL);
    } else {
        peer_arm_recv(p);
    }
    pthread_mutex_unlock(&p->mu);
    peer_put(p);
}

/* ------------------------------------------------------------------------------------------- */
/* Requesting calls                                                                            */

/* Both arm functions run under s->mu and do nothing once shutdown began (a request made after
 * grpc_server_shutdown_and_notify could reach a queue that is already shut down). false: not
 * armed (the caller frees the object). */
static bool arm_request(ctl_server *s, srv_request *r)
{
    r->call = NULL;
    pthread_mutex_lock(&s->mu);
    bool ok = false;
    if (!s->shutting_down) {
        grpc_metadata_array_init(&r->md);
        ok = grpc_server_request_registered_call(s->server, s->method, &r->call, &r->deadline, &r->md, NULL, s->cq,
                                                 s->cq, &r->tag) == GRPC_CALL_OK;
        if (!ok)
            grpc_metadata_array_destroy(&r->md);
    }
    pthread_mutex_unlock(&s->mu);
    return ok;
}

static bool arm_generic(ctl_server *s, srv_generic *g)
{
    g->call = NULL;
    pthread_mutex_lock(&s->mu);
    bool ok = false;
    if (!s->shutting_down) {
        grpc_call_details_init(&g->details);
        grpc_metadata_array_init(&g->md);
        ok = grpc_server_request_call(s->server, &g->call, &g->details, &g->md, s->cq, s->cq, &g->tag) ==
             GRPC_CALL_OK;
        if (!ok) {
            grpc_call_details_destroy(&g->details);
            grpc_metadata_array_destroy(&g->md);
        }
    }
    pthread_mutex_unlock(&s->mu);
    return ok;
}

static void request_done(srv_request *r, bool success)
{
    ctl_server *s = r->srv;
    grpc_metadata_array_destroy(&r->md);
    if (!success) {
        /* Only when the server shuts down: the request is withdrawn. */
        if (r->call)
            grpc_call_unref(r->call);
        free(r);
        return;
    }
    grpc_call *call = r->call;
    /* Re-arm first so the next worker does not wait behind this one. */
    if (!arm_request(s, r))
        free(r);
    accept_call(s, call);
}

static void generic_done(srv_generic *g, bool success)
{
    ctl_server *s = g->srv;
    if (success && g->call) {
        grpc_call *call = g->call;
        char msg[160];
        size_t n = GRPC_SLICE_LENGTH(g->details.method);
        const char *m = (const char *)GRPC_SLICE_START_PTR(g->details.method);
        bool plain = n > 0 && n <= 100;
        for (size_t i = 0; plain && i < n; i++)
            plain = m[i] > 0x20 && m[i] < 0x7f;
        if (plain)
            snprintf(msg, sizeof msg, "unknown method %.*s", (int)n, m);
        else
            snprintf(msg, sizeof msg, "unknown method");
        grpc_call_details_destroy(&g->details);
        grpc_metadata_array_destroy(&g->md);
        if (!arm_generic(s, g))
            free(g);
        reply_error(call, GRPC_STATUS_UNIMPLEMENTED, msg);
        return;
    }
    grpc_call_details_destroy(&g->details);
    grpc_metadata_array_destroy(&g->md);
    if (g->call)
        grpc_call_unref(g->call);
    free(g);
}

static void dispatch(ctl_server *s, grpc_event ev)
{
    srv_tag *t = ev.tag;
    switch (t->kind) {
    case TAG_REQUEST: request_done((srv_request *)t, ev.success); break;
    case TAG_GENERIC: generic_done((srv_generic *)t, ev.success); break;
    case TAG_REPLY: reply_done((srv_reply *)t); break;
    case TAG_PEER_RECV:
        peer_recv_done((ctl_peer *)((char *)t - offsetof(ctl_peer, recv_tag)), ev.success);
        break;
    case TAG_PEER_SEND:
        peer_send_done((ctl_peer *)((char *)t - offsetof(ctl_peer, send_tag)), ev.success);
        break;
    case TAG_PEER_CLOSE: peer_close_done((ctl_peer *)((char *)t - offsetof(ctl_peer, close_tag))); break;
    case TAG_SHUTDOWN:
        pthread_mutex_lock(&s->mu);
        s->shutdown_done = true;
        pthread_cond_broadcast(&s->cond);
        pthread_mutex_unlock(&s->mu);
        break;
    }
}

static void *cq_thread(void *arg)
{
    ctl_server *s = arg;
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            break;
        if (ev.type == GRPC_OP_COMPLETE)
            dispatch(s, ev);
    }
    return NULL;
}

/* ------------------------------------------------------------------------------------------- */
/* Peer API                                                                                    */

int ctl_peer_send(ctl_peer *p, const Strata__Internal__V1__CoordinatorMessage *msg, strata_error *err)
{
    if (!p || !msg)
        return strata_fail(err, STRATA_EINVAL, "ctl_peer_send: NULL argument");
    msg_node *m = malloc(sizeof *m);
    if (!m)
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    int rc = proto_pack(&msg->base, p->max_bytes, &m->bb, err);
    if (rc) {
        free(m);
        if (rc == STRATA_EFULL && err)
            err->code = rc = STRATA_EINVAL; /* one oversized message: the stream goes on */
        return rc;
    }
    m->next = NULL;
    pthread_mutex_lock(&p->mu);
    if (p->ended || p->dead || p->released) {
        pthread_mutex_unlock(&p->mu);
        grpc_byte_buffer_destroy(m->bb);
        free(m);
        return strata_fail(err, STRATA_EIO, "worker %s: the control stream has ended", p->name);
    }
    if (p->queued >= p->max_queued) {
        /* The worker does not read: end the stream rather than buffer without bound (or drop a
         * message silently, which would desynchronize the step protocol). on_gone follows from
         * the completion of the cancelled batches, on a server thread. */
        uint32_t q = p->queued;
        char why[160];
        snprintf(why, sizeof why, "worker not reading (%" PRIu32 " control messages queued)", q);
        peer_end(p, GRPC_STATUS_RESOURCE_EXHAUSTED, why, true, false);
        pthread_mutex_unlock(&p->mu);
        grpc_byte_buffer_destroy(m->bb);
        free(m);
        return strata_fail(err, STRATA_EFULL, "worker %s: send queue full (%" PRIu32 " messages); stream ended",
                           p->name, q);
    }
    if (p->tail)
        p->tail->next = m;
    else
        p->head = m;
    p->tail = m;
    p->queued++;
    peer_pump(p);
    pthread_mutex_unlock(&p->mu);
    return STRATA_OK;
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
    free(s->threads);
    pthread_cond_destroy(&s->cond);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

static grpc_arg int_arg(const char *key, int value)
{
    grpc_arg a;
    memset(&a, 0, sizeof a);
    a.type = GRPC_ARG_INTEGER;
    a.key = (char *)key;
    a.value.integer = value;
    return a;
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
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cond, NULL);
    s->h = *h;
    s->max_bytes = opt.max_message_bytes;
    s->max_queued = opt.max_queued_messages;
    s->shutdown_tag.kind = TAG_SHUTDOWN;
    s->secret = malloc(opt.cluster_secret_len);
    s->threads = calloc(opt.threads, sizeof *s->threads);
    if (!s->secret || !s->threads) {
        server_free(s);
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    }
    memcpy(s->secret, opt.cluster_secret, opt.cluster_secret_len);
    s->secret_len = opt.cluster_secret_len;

    grpc_init();
    grpc_arg args[9] = {
        int_arg(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, (int)opt.max_message_bytes),
        int_arg(GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, (int)opt.max_message_bytes),
        /* A bind conflict must be an error, not two servers sharing a port. */
        int_arg(GRPC_ARG_ALLOW_REUSEPORT, 0),
        /* Death detection: ping every worker connection, also while its stream is idle. */
        int_arg(GRPC_ARG_KEEPALIVE_TIME_MS, opt.keepalive_time_ms),
        int_arg(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, opt.keepalive_timeout_ms),
        int_arg(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1),
        /* gRPC stops pinging after 2 pings without data by default: an idle worker would then
         * go unwatched. */
        int_arg(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0),
        /* The workers' own keepalive pings are welcome this often ... */
        int_arg(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, opt.min_recv_ping_interval_ms),
        /* ... and a worker configured to ping faster is not cut off with GOAWAY
         * "too_many_pings" (workers are our own processes; a dropped control stream costs far
         * more than a ping). */
        int_arg(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0),
    };
    grpc_channel_args chargs = {sizeof args / sizeof args[0], args};
    s->server = grpc_server_create(&chargs, NULL);
    s->cq = grpc_completion_queue_create_for_next(NULL);
    grpc_server_register_completion_queue(s->server, s->cq, NULL);
    s->method = grpc_server_register_method(s->server, CTL_ATTACH_METHOD, NULL, GRPC_SRM_PAYLOAD_NONE, 0);
    grpc_server_credentials *creds = grpc_insecure_server_credentials_create();
    s->port = grpc_server_add_http2_port(s->server, opt.listen_addr, creds);
    grpc_server_credentials_release(creds);
    int rc = STRATA_OK;
    if (!s->method)
        rc = strata_fail(err, STRATA_EINVAL, "cannot register %s", CTL_ATTACH_METHOD);
    else if (s->port <= 0)
        rc = strata_fail(err, STRATA_EIO, "cannot listen on %s (address malformed or in use; gRPC logs the reason)",
                         opt.listen_addr);
    if (rc) {
        /* Never started: a server that was not started can be destroyed directly. */
        grpc_server_destroy(s->server);
        grpc_completion_queue_shutdown(s->cq);
        while (grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
               GRPC_QUEUE_SHUTDOWN) {
        }
        grpc_completion_queue_destroy(s->cq);
        server_free(s);
        grpc_shutdown();
        return rc;
    }
    grpc_server_start(s->server);

    for (int i = 0; i < CTL_REQUESTS; i++) {
        srv_request *r = calloc(1, sizeof *r);
        if (!r)
            break;
        r->tag.kind = TAG_REQUEST;
        r->srv = s;
        if (!arm_request(s, r))
            free(r);
    }
    srv_generic *g = calloc(1, sizeof *g);
    if (g) {
        g->tag.kind = TAG_GENERIC;
        g->srv = s;
        if (!arm_generic(s, g))
            free(g);
    }

    for (uint32_t i = 0; i < opt.threads; i++) {
        if (pthread_create(&s->threads[i], NULL, cq_thread, s) != 0) {
            server_log("cannot start thread %" PRIu32 "; running with %" PRIu32, i, i);
            break;
        }
        s->n_threads = i + 1;
    }
    if (s->n_threads == 0) {
        /* Without a thread nobody drives the queue: undo inline. */
        pthread_mutex_lock(&s->mu);
        s->shutting_down = true;
        pthread_mutex_unlock(&s->mu);
        grpc_server_shutdown_and_notify(s->server, s->cq, &s->shutdown_tag);
        grpc_server_cancel_all_calls(s->server);
        grpc_completion_queue_shutdown(s->cq);
        for (;;) {
            grpc_event ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
            if (ev.type == GRPC_QUEUE_SHUTDOWN)
                break;
            srv_tag *t = ev.tag;
            if (t->kind == TAG_REQUEST)
                request_done((srv_request *)t, false);
            else if (t->kind == TAG_GENERIC)
                generic_done((srv_generic *)t, false);
        }
        grpc_server_destroy(s->server);
        grpc_completion_queue_destroy(s->cq);
        server_free(s);
        grpc_shutdown();
        return strata_fail(err, STRATA_EIO, "cannot start the control server threads");
    }
    *out = s;
    return STRATA_OK;
}

int ctl_server_port(const ctl_server *s)
{
    return s ? s->port : 0;
}

static struct timespec deadline_in_ms(long ms)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    t.tv_sec += ms / 1000;
    t.tv_nsec += (ms % 1000) * 1000000L;
    if (t.tv_nsec >= 1000000000L) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000L;
    }
    return t;
}

/* Under s->mu: a temporary hold on a peer whose call is not released (peers in the live list
 * are unlinked, under s->mu, before their call is released, so they are valid here). */
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
    pthread_mutex_lock(&s->mu);
    s->shutting_down = true;
    pthread_mutex_unlock(&s->mu);
    /* No new connections or calls from here (workers get UNAVAILABLE); calls in flight go on. */
    grpc_server_shutdown_and_notify(s->server, s->cq, &s->shutdown_tag);

    /* End every stream with a normal status batch after its queued messages (a Shutdown sent
     * just before still arrives). A status batch, not grpc_call_cancel_with_status: on a
     * connection draining after GOAWAY, gRPC 1.51 closes the connection as soon as the last
     * stream is cancelled, before the cancel's trailers are written (see
     * coordinator/server/README.md). Collect the peers under s->mu with a hold each, then work
     * without it: on_gone may run here and take the handler's locks. */
    pthread_mutex_lock(&s->mu);
    ctl_peer *todo = NULL;
    for (ctl_peer *p = s->peers; p; p = p->next)
        if (peer_hold_if_live(p)) {
            p->snext = todo;
            todo = p;
        }
    pthread_mutex_unlock(&s->mu);
    while (todo) {
        ctl_peer *p = todo;
        todo = p->snext;
        pthread_mutex_lock(&p->mu);
        peer_end(p, GRPC_STATUS_UNAVAILABLE, "coordinator shutting down", true, true);
        pthread_mutex_unlock(&p->mu);
        peer_put(p);
    }

    /* A status cannot overtake a message that flow control holds (a worker that does not
     * read): after a grace period, cancel what is left outright. */
    pthread_mutex_lock(&s->mu);
    struct timespec until = deadline_in_ms(CTL_SHUTDOWN_GRACE_MS);
    while (s->live > 0 && pthread_cond_timedwait(&s->cond, &s->mu, &until) != ETIMEDOUT) {
    }
    for (ctl_peer *p = s->peers; p; p = p->next) {
        pthread_mutex_lock(&p->mu);
        if (!p->released)
            grpc_call_cancel_with_status(p->call, GRPC_STATUS_UNAVAILABLE, "coordinator shutting down", NULL);
        pthread_mutex_unlock(&p->mu);
    }
    int waited_s = 0;
    while (s->live > 0) {
        until = deadline_in_ms(5000);
        if (pthread_cond_timedwait(&s->cond, &s->mu, &until) == ETIMEDOUT && s->live > 0) {
            waited_s += 5;
            server_log("shutdown: still waiting for %" PRIu32 " worker stream(s) to end (%d s)", s->live, waited_s);
        }
    }
    /* The shutdown notification follows once every call is gone. */
    until = deadline_in_ms(CTL_SHUTDOWN_GRACE_MS);
    while (!s->shutdown_done && pthread_cond_timedwait(&s->cond, &s->mu, &until) != ETIMEDOUT) {
    }
    if (!s->shutdown_done) {
        pthread_mutex_unlock(&s->mu);
        grpc_server_cancel_all_calls(s->server);
        pthread_mutex_lock(&s->mu);
        while (!s->shutdown_done)
            pthread_cond_wait(&s->cond, &s->mu);
    }
    pthread_mutex_unlock(&s->mu);

    grpc_completion_queue_shutdown(s->cq);
    for (uint32_t i = 0; i < s->n_threads; i++)
        pthread_join(s->threads[i], NULL);
    grpc_server_destroy(s->server);
    grpc_completion_queue_destroy(s->cq);
    server_free(s);
    grpc_shutdown();
}
