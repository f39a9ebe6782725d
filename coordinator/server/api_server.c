/* The public gRPC API server on the gRPC C core. See api_server.h (contract) and README.md.
 *
 * Structure. One completion queue (created for grpc_completion_queue_next) carries every event:
 * new calls (registered methods and a generic request for unknown methods), the one-batch
 * replies of unary calls and early errors, the send and close batches of Generate streams, and
 * the server's shutdown notification. `threads` threads block in grpc_completion_queue_next and
 * dispatch on a small tag header at the start of every tag object.
 *
 * A Generate stream has at most one send batch in flight (gRPC allows one outstanding
 * SEND_MESSAGE per call); further messages wait in the stream's queue. Whoever adds work (a
 * backend thread queueing a chunk, or a server thread whose send batch just completed) starts
 * the next batch itself under the stream's mutex when none is in flight, so a backend thread
 * never needs to wake the completion queue. A RECV_CLOSE_ON_SERVER batch is started when the
 * stream is accepted; it completes with cancelled=1 when the client cancels, goes away, the
 * deadline passes or the server cancels the call (backpressure, shutdown), which is when the
 * backend gets cancel.
 *
 * References on a stream: one per batch in flight (send, close), one for the backend (from
 * generate until its terminal call) and a temporary one in the accept path. The last release
 * unlinks the stream from the server, unrefs the grpc_call and frees it. */
#include "coordinator/server/api_server.h"

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

/* Responses larger than this are refused when packed (gRPC clients refuse received messages
 * above 4 MiB by default). */
#define API_MAX_SEND_BYTES ((size_t)4 << 20)
/* Outstanding grpc_server_request_registered_call per method (new calls wait inside gRPC when
 * all are taken, until one is re-armed). */
#define API_REQUESTS_PER_METHOD 4
#define API_TLS_FILE_MAX ((size_t)1 << 20)

/* ------------------------------------------------------------------------------------------- */
/* Tags                                                                                        */

typedef enum tag_kind {
    TAG_REQUEST,      /* srv_request: a registered method's new call */
    TAG_GENERIC,      /* srv_generic: a call to an unknown method */
    TAG_REPLY,        /* srv_reply: one batch answering a unary call or refusing a stream */
    TAG_STREAM_SEND,  /* api_stream.send_tag */
    TAG_STREAM_CLOSE, /* api_stream.close_tag */
    TAG_SHUTDOWN,     /* api_server.shutdown_tag */
} tag_kind;

typedef struct srv_tag {
    tag_kind kind;
} srv_tag;

enum method { M_GENERATE, M_ABORT, M_HEALTH, M_MODEL_INFO, M_STATS, M_COUNT };

static const char *const method_paths[M_COUNT] = {
    "/strata.v1.Strata/Generate",     "/strata.v1.Strata/Abort",    "/strata.v1.Strata/Health",
    "/strata.v1.Strata/GetModelInfo", "/strata.v1.Strata/GetStats",
};

typedef struct srv_request {
    srv_tag tag;
    api_server *srv;
    int method;
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_byte_buffer *payload;
} srv_request;

typedef struct srv_generic {
    srv_tag tag;
    api_server *srv;
    grpc_call *call;
    grpc_call_details details;
    grpc_metadata_array md;
} srv_generic;

typedef struct srv_reply {
    srv_tag tag;
    grpc_call *call;
    grpc_byte_buffer *msg; /* NULL: status only */
    grpc_slice details;
    int cancelled;
} srv_reply;

typedef struct msg_node {
    struct msg_node *next;
    grpc_byte_buffer *bb;
} msg_node;

enum backend_state {
    BK_NONE,        /* not handed to the backend (or refused by generate) */
    BK_IN_GENERATE, /* generate is running */
    BK_OWNED,       /* generate returned OK; the terminal call has not come */
    BK_RELEASED,    /* the backend made its terminal call */
};

struct api_stream {
    srv_tag send_tag;
    srv_tag close_tag;
    api_server *srv;
    grpc_call *call;
    Strata__V1__GenerateRequest *req;
    char id[PROTO_MAX_REQUEST_ID_BYTES + 1];
    atomic_uint refs;

    pthread_mutex_t mu;
    /* Under mu. */
    msg_node *head, *tail;
    uint32_t queued;          /* messages in the queue (not counting the one in flight) */
    bool send_in_flight;      /* a send batch (message or status) is started and not complete */
    bool md_sent;             /* SEND_INITIAL_METADATA was in a started batch */
    bool chunk_queued;        /* a Chunk was ever queued: failures then go as Error messages */
    bool status_pending;      /* the final status goes out once the queue is empty */
    bool status_started;
    grpc_status_code status;
    grpc_slice status_details;
    bool dead;                /* cancelled or closed: nothing more can be sent */
    int backend;              /* enum backend_state */
    bool cancel_wanted;       /* the call died while generate was running */
    bool cancel_called;
    grpc_byte_buffer *send_bb; /* the message of the send batch in flight */
    int cancelled;             /* RECV_CLOSE_ON_SERVER's output */

    /* Under srv->mu. */
    api_stream *prev, *next; /* live list */
    api_stream *hnext;       /* request-id hash chain */
    bool in_hash;
    api_stream *snext;       /* shutdown's private list (it holds a reference) */
};

struct api_server {
    api_backend be;
    grpc_server *server;
    grpc_completion_queue *cq;
    void *methods[M_COUNT];
    int port;
    uint32_t max_streams;
    size_t max_recv_bytes;
    uint32_t max_queued;
    char *token; /* NULL: no bearer token */
    bool auth_health;
    proto_generate_limits limits;

    pthread_t *threads;
    uint32_t n_threads;
    srv_tag shutdown_tag;

    pthread_mutex_t mu;
    pthread_cond_t cond;
    /* Under mu. */
    bool shutting_down;
    bool shutdown_done; /* the shutdown tag arrived */
    uint32_t live;      /* streams not yet freed */
    api_stream *streams;
    api_stream **hash;
    size_t hash_mask;
    uint64_t next_id;
    uint64_t id_nonce;
};

static void stream_unref(api_stream *st);

/* ------------------------------------------------------------------------------------------- */
/* Small helpers                                                                               */

static void server_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void server_log(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("strata api_server: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

/* A one-batch answer: initial metadata, optional message, status, and RECV_CLOSE_ON_SERVER.
 * Takes ownership of call and msg. */
static void reply(grpc_call *call, grpc_byte_buffer *msg, grpc_status_code code, const char *message)
{
    srv_reply *r = calloc(1, sizeof *r);
    if (!r) {
        /* Cannot answer properly: cancel with the status instead. */
        grpc_call_cancel_with_status(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory", NULL);
        if (msg)
            grpc_byte_buffer_destroy(msg);
        grpc_call_unref(call);
        return;
    }
    r->tag.kind = TAG_REPLY;
    r->call = call;
    r->msg = msg;
    r->details = grpc_slice_from_copied_string(message ? message : "");
    grpc_op ops[4];
    memset(ops, 0, sizeof ops);
    size_t n = 0;
    ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
    n++;
    if (msg) {
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n].data.send_message.send_message = msg;
        n++;
    }
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = code;
    ops[n].data.send_status_from_server.status_details = code == GRPC_STATUS_OK ? NULL : &r->details;
    n++;
    ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[n].data.recv_close_on_server.cancelled = &r->cancelled;
    n++;
    grpc_call_error e = grpc_call_start_batch(call, ops, n, &r->tag, NULL);
    if (e != GRPC_CALL_OK) {
        server_log("cannot start a reply batch: %s", grpc_call_error_to_string(e));
        grpc_call_cancel_with_status(call, code == GRPC_STATUS_OK ? GRPC_STATUS_INTERNAL : code, message, NULL);
        if (msg)
            grpc_byte_buffer_destroy(msg);
        grpc_slice_unref(r->details);
        grpc_call_unref(call);
        free(r);
    }
}

static void reply_done(srv_reply *r)
{
    if (r->msg)
        grpc_byte_buffer_destroy(r->msg);
    grpc_slice_unref(r->details);
    grpc_call_unref(r->call);
    free(r);
}

static void reply_error(grpc_call *call, grpc_status_code code, const char *message)
{
    reply(call, NULL, code, message);
}

/* Packs msg and replies OK with it, or INTERNAL when it cannot be packed. */
static void reply_message(grpc_call *call, const ProtobufCMessage *msg)
{
    grpc_byte_buffer *bb;
    strata_error err = {0};
    if (proto_pack(msg, API_MAX_SEND_BYTES, &bb, &err)) {
        reply_error(call, GRPC_STATUS_INTERNAL, err.msg);
        return;
    }
    reply(call, bb, GRPC_STATUS_OK, NULL);
}

/* true when the call may proceed; otherwise it has been answered UNAUTHENTICATED. */
static bool check_auth(api_server *s, grpc_call *call, const grpc_metadata_array *md)
{
    if (!s->token)
        return true;
    const char *why = NULL;
    if (proto_bearer_ok(md, s->token, &why))
        return true;
    char msg[256];
    snprintf(msg, sizeof msg, "bearer token required: %s", why ? why : "authorization refused");
    reply_error(call, GRPC_STATUS_UNAUTHENTICATED, msg);
    return false;
}

static uint64_t fnv1a(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 1099511628211ull;
    }
    return h;
}

/* Under s->mu. */
static api_stream *hash_find(api_server *s, const char *id)
{
    for (api_stream *st = s->hash[fnv1a(id) & s->hash_mask]; st; st = st->hnext)
        if (strcmp(st->id, id) == 0)
            return st;
    return NULL;
}

static void hash_insert(api_server *s, api_stream *st)
{
    api_stream **b = &s->hash[fnv1a(st->id) & s->hash_mask];
    st->hnext = *b;
    *b = st;
    st->in_hash = true;
}

static void hash_remove(api_server *s, api_stream *st)
{
    if (!st->in_hash)
        return;
    for (api_stream **p = &s->hash[fnv1a(st->id) & s->hash_mask]; *p; p = &(*p)->hnext)
        if (*p == st) {
            *p = st->hnext;
            break;
        }
    st->hnext = NULL;
    st->in_hash = false;
}

/* ------------------------------------------------------------------------------------------- */
/* Streams                                                                                     */

/* Under st->mu. */
static void stream_drop_queue(api_stream *st)
{
    while (st->head) {
        msg_node *n = st->head;
        st->head = n->next;
        grpc_byte_buffer_destroy(n->bb);
        free(n);
    }
    st->tail = NULL;
    st->queued = 0;
}

/* Under st->mu: starts the next send batch when none is in flight. */
static void stream_pump(api_stream *st)
{
    if (st->send_in_flight)
        return;
    if (st->dead) {
        stream_drop_queue(st);
        return;
    }
    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    size_t n = 0;
    if (!st->md_sent && (st->head || (st->status_pending && !st->status_started))) {
        ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
        n++;
    }
    if (st->head) {
        msg_node *m = st->head;
        st->head = m->next;
        if (!st->head)
            st->tail = NULL;
        st->queued--;
        st->send_bb = m->bb;
        free(m);
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n].data.send_message.send_message = st->send_bb;
        n++;
    } else if (st->status_pending && !st->status_started) {
        st->status_started = true;
        ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
        ops[n].data.send_status_from_server.status = st->status;
        ops[n].data.send_status_from_server.status_details =
            st->status == GRPC_STATUS_OK ? NULL : &st->status_details;
        n++;
    } else {
        return;
    }
    st->md_sent = true;
    st->send_in_flight = true;
    atomic_fetch_add(&st->refs, 1);
    grpc_call_error e = grpc_call_start_batch(st->call, ops, n, &st->send_tag, NULL);
    if (e != GRPC_CALL_OK) {
        /* Not expected (one send at a time is exactly what gRPC allows); give up on the call. */
        server_log("stream %s: cannot start a send batch: %s", st->id, grpc_call_error_to_string(e));
        st->send_in_flight = false;
        if (st->send_bb) {
            grpc_byte_buffer_destroy(st->send_bb);
            st->send_bb = NULL;
        }
        st->dead = true;
        stream_drop_queue(st);
        atomic_fetch_sub(&st->refs, 1); /* the caller holds another reference */
        grpc_call_cancel_with_status(st->call, GRPC_STATUS_INTERNAL, "server send failed", NULL);
    }
}

static void stream_free(api_stream *st)
{
    api_server *s = st->srv;
    pthread_mutex_lock(&s->mu);
    if (st->prev)
        st->prev->next = st->next;
    else
        s->streams = st->next;
    if (st->next)
        st->next->prev = st->prev;
    hash_remove(s, st);
    pthread_mutex_unlock(&s->mu);

    stream_drop_queue(st);
    if (st->send_bb)
        grpc_byte_buffer_destroy(st->send_bb);
    grpc_slice_unref(st->status_details);
    grpc_call_unref(st->call);
    if (st->req)
        protobuf_c_message_free_unpacked(&st->req->base, NULL);
    pthread_mutex_destroy(&st->mu);
    free(st);

    /* Counted down last, after the call is gone: shutdown waits for live == 0 before it
     * destroys the completion queue and the server. Nothing touches s after the unlock. */
    pthread_mutex_lock(&s->mu);
    s->live--;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->mu);
}

static void stream_unref(api_stream *st)
{
    if (atomic_fetch_sub(&st->refs, 1) == 1)
        stream_free(st);
}

/* The backend's terminal call: releases its reference after the caller queued what it wants. */
static void stream_backend_release(api_stream *st)
{
    api_server *s = st->srv;
    pthread_mutex_lock(&s->mu);
    hash_remove(s, st); /* the id may be reused from now on */
    pthread_mutex_unlock(&s->mu);
    stream_unref(st);
}

/* Under st->mu: the final status, sent after the queue drains. */
static void stream_set_status(api_stream *st, grpc_status_code code, const char *message)
{
    if (st->status_pending)
        return;
    st->status_pending = true;
    st->status = code;
    grpc_slice_unref(st->status_details);
    st->status_details = grpc_slice_from_copied_string(message ? message : "");
}

/* Under st->mu. */
static void stream_enqueue(api_stream *st, msg_node *m)
{
    m->next = NULL;
    if (st->tail)
        st->tail->next = m;
    else
        st->head = m;
    st->tail = m;
    st->queued++;
}

static int pack_response(api_stream *st, Strata__V1__GenerateResponse *resp, msg_node **out, strata_error *err)
{
    *out = NULL;
    resp->request_id = st->id;
    msg_node *m = malloc(sizeof *m);
    if (!m)
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    int rc = proto_pack(&resp->base, API_MAX_SEND_BYTES, &m->bb, err);
    if (rc) {
        free(m);
        return rc;
    }
    *out = m;
    return STRATA_OK;
}

const char *api_stream_request_id(const api_stream *st)
{
    return st->id;
}

int api_stream_send_chunk(api_stream *st, const uint32_t *ids, size_t n, const char *text, size_t len)
{
    if (!st || (n && !ids) || (len && !text))
        return STRATA_EINVAL;
    if (len && (memchr(text, 0, len) || !proto_utf8_valid(text, len)))
        return STRATA_EINVAL;
    char small[256];
    char *t = len < sizeof small ? small : malloc(len + 1);
    if (!t)
        return STRATA_ENOMEM;
    if (len)
        memcpy(t, text, len);
    t[len] = 0;
    Strata__V1__Chunk chunk = STRATA__V1__CHUNK__INIT;
    chunk.n_token_ids = n;
    chunk.token_ids = (uint32_t *)ids;
    chunk.text = t;
    Strata__V1__GenerateResponse resp = STRATA__V1__GENERATE_RESPONSE__INIT;
    resp.kind_case = STRATA__V1__GENERATE_RESPONSE__KIND_CHUNK;
    resp.chunk = &chunk;
    msg_node *m;
    int rc = pack_response(st, &resp, &m, NULL);
    if (t != small)
        free(t);
    if (rc)
        return rc == STRATA_EFULL ? STRATA_EINVAL : rc; /* one oversized chunk: the stream goes on */

    pthread_mutex_lock(&st->mu);
    if (st->dead || st->status_pending) {
        pthread_mutex_unlock(&st->mu);
        grpc_byte_buffer_destroy(m->bb);
        free(m);
        return STRATA_EIO;
    }
    if (st->queued >= st->srv->max_queued) {
        /* The client does not read: fail the stream rather than buffer without bound. The call
         * is cancelled with the status (gRPC sends it as trailers even when the stream's flow
         * control window is closed); RECV_CLOSE_ON_SERVER then reports cancelled and the backend
         * gets cancel from a server thread. */
        st->dead = true;
        stream_drop_queue(st);
        pthread_mutex_unlock(&st->mu);
        grpc_byte_buffer_destroy(m->bb);
        free(m);
        grpc_call_cancel_with_status(st->call, GRPC_STATUS_RESOURCE_EXHAUSTED, "client not reading", NULL);
        return STRATA_EFULL;
    }
    stream_enqueue(st, m);
    st->chunk_queued = true;
    stream_pump(st);
    pthread_mutex_unlock(&st->mu);
    return STRATA_OK;
}

/* Queues m (may be NULL) and the final status; marks the backend released. */
static void stream_terminal(api_stream *st, msg_node *m, grpc_status_code code, const char *message)
{
    pthread_mutex_lock(&st->mu);
    if (st->backend == BK_RELEASED) {
        pthread_mutex_unlock(&st->mu);
        server_log("stream %s: a second terminal call from the backend (ignored)", st->id);
        if (m) {
            grpc_byte_buffer_destroy(m->bb);
            free(m);
        }
        return;
    }
    st->backend = BK_RELEASED;
    if (!st->dead && !st->status_pending) {
        if (m) {
            stream_enqueue(st, m);
            m = NULL;
        }
        stream_set_status(st, code, message);
        stream_pump(st);
    }
    pthread_mutex_unlock(&st->mu);
    if (m) {
        grpc_byte_buffer_destroy(m->bb);
        free(m);
    }
    stream_backend_release(st);
}

void api_stream_complete(api_stream *st, Strata__V1__FinishReason finish_reason, uint32_t prompt_tokens,
                         uint32_t completion_tokens, uint32_t cached_tokens)
{
    if (!st)
        return;
    Strata__V1__Complete c = STRATA__V1__COMPLETE__INIT;
    c.finish_reason = finish_reason;
    c.prompt_tokens = prompt_tokens;
    c.completion_tokens = completion_tokens;
    c.cached_tokens = cached_tokens;
    Strata__V1__GenerateResponse resp = STRATA__V1__GENERATE_RESPONSE__INIT;
    resp.kind_case = STRATA__V1__GENERATE_RESPONSE__KIND_COMPLETE;
    resp.complete = &c;
    msg_node *m;
    strata_error err = {0};
    if (pack_response(st, &resp, &m, &err)) {
        stream_terminal(st, NULL, GRPC_STATUS_INTERNAL, err.msg);
        return;
    }
    stream_terminal(st, m, GRPC_STATUS_OK, NULL);
}

void api_stream_fail(api_stream *st, int status, const char *message)
{
    if (!st)
        return;
    /* STRATA_OK here is a bug in the caller: it maps to UNKNOWN. */
    grpc_status_code code = status == STRATA_OK ? GRPC_STATUS_UNKNOWN : proto_grpc_status(status);
    if (!message || !*message)
        message = strata_status_name(status);
    /* One line, valid UTF-8 and short: it becomes a status message or a proto string. */
    char line[512];
    size_t n = strlen(message);
    if (n >= sizeof line)
        n = sizeof line - 1;
    n = proto_utf8_check(message, n); /* cut at the first bad byte */
    memcpy(line, message, n);
    line[n] = 0;
    for (char *p = line; *p; p++)
        if (*p == '\n' || *p == '\r')
            *p = ' ';

    pthread_mutex_lock(&st->mu);
    bool as_message = st->chunk_queued;
    pthread_mutex_unlock(&st->mu);
    if (!as_message) {
        stream_terminal(st, NULL, code, line);
        return;
    }
    Strata__V1__Error e = STRATA__V1__ERROR__INIT;
    e.code = (uint32_t)code;
    e.message = line;
    Strata__V1__GenerateResponse resp = STRATA__V1__GENERATE_RESPONSE__INIT;
    resp.kind_case = STRATA__V1__GENERATE_RESPONSE__KIND_ERROR;
    resp.error = &e;
    msg_node *m;
    if (pack_response(st, &resp, &m, NULL)) {
        stream_terminal(st, NULL, code, line);
        return;
    }
    stream_terminal(st, m, GRPC_STATUS_OK, NULL);
}

void api_stream_finish(api_stream *st)
{
    if (!st)
        return;
    pthread_mutex_lock(&st->mu);
    bool expected = st->cancel_called || st->dead;
    pthread_mutex_unlock(&st->mu);
    if (!expected)
        server_log("stream %s: the backend ended it without a result", st->id);
    stream_terminal(st, NULL, GRPC_STATUS_INTERNAL, "backend ended the request without a result");
}

/* A send batch completed (server thread). */
static void stream_send_done(api_stream *st, bool success)
{
    pthread_mutex_lock(&st->mu);
    st->send_in_flight = false;
    if (st->send_bb) {
        grpc_byte_buffer_destroy(st->send_bb);
        st->send_bb = NULL;
    }
    if (!success)
        st->dead = true; /* the call is gone; RECV_CLOSE_ON_SERVER says so too */
    stream_pump(st);
    pthread_mutex_unlock(&st->mu);
    stream_unref(st);
}

/* RECV_CLOSE_ON_SERVER completed (server thread): the call is over for the client. */
static void stream_close_done(api_stream *st)
{
    bool call_cancel = false;
    pthread_mutex_lock(&st->mu);
    if (st->cancelled) {
        st->dead = true;
        stream_drop_queue(st);
        if (st->backend == BK_IN_GENERATE)
            st->cancel_wanted = true;
        else if (st->backend == BK_OWNED && !st->cancel_called)
            call_cancel = st->cancel_called = true;
    }
    pthread_mutex_unlock(&st->mu);
    if (call_cancel)
        st->srv->be.cancel(st->srv->be.ctx, st);
    stream_unref(st);
}

/* Takes a reference unless the stream is already being freed (refs == 0; it is then unlinked
 * as soon as the caller releases s->mu). */
static bool stream_ref_if_live(api_stream *st)
{
    unsigned r = atomic_load(&st->refs);
    while (r != 0)
        if (atomic_compare_exchange_weak(&st->refs, &r, r + 1))
            return true;
    return false;
}

/* Ends a stream from the server side with a normal status batch (after the message in flight,
 * if any; queued messages are dropped) and tells the backend. A status sent this way reaches
 * the client reliably, also on a connection that is draining after GOAWAY, where cancelling
 * the call can close the connection before the status is written (gRPC 1.51). */
static void stream_server_end(api_stream *st, grpc_status_code code, const char *message)
{
    bool call_cancel = false;
    pthread_mutex_lock(&st->mu);
    stream_drop_queue(st);
    if (!st->dead && !st->status_pending) {
        stream_set_status(st, code, message);
        stream_pump(st);
    }
    if (st->backend == BK_IN_GENERATE)
        st->cancel_wanted = true;
    else if (st->backend == BK_OWNED && !st->cancel_called)
        call_cancel = st->cancel_called = true;
    pthread_mutex_unlock(&st->mu);
    if (call_cancel)
        st->srv->be.cancel(st->srv->be.ctx, st);
}

/* ------------------------------------------------------------------------------------------- */
/* Calls                                                                                       */

static void handle_generate(api_server *s, grpc_call *call, grpc_metadata_array *md, grpc_byte_buffer *payload,
                            gpr_timespec deadline)
{
    if (!check_auth(s, call, md))
        return;
    if (!payload) {
        reply_error(call, GRPC_STATUS_INVALID_ARGUMENT, "no GenerateRequest message received");
        return;
    }
    ProtobufCMessage *msg;
    strata_error err = {0};
    if (proto_unpack(payload, &strata__v1__generate_request__descriptor, s->max_recv_bytes, &msg, &err)) {
        reply_error(call, proto_grpc_status(err.code), err.msg);
        return;
    }
    Strata__V1__GenerateRequest *req = (Strata__V1__GenerateRequest *)msg;
    if (proto_validate_generate(req, &s->limits, &err)) {
        protobuf_c_message_free_unpacked(msg, NULL);
        reply_error(call, proto_grpc_status(err.code), err.msg);
        return;
    }

    api_stream *st = calloc(1, sizeof *st);
    char *assigned = NULL;
    if (!st) {
        protobuf_c_message_free_unpacked(msg, NULL);
        reply_error(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    st->send_tag.kind = TAG_STREAM_SEND;
    st->close_tag.kind = TAG_STREAM_CLOSE;
    st->srv = s;
    st->status_details = grpc_empty_slice();
    st->call = call;
    atomic_init(&st->refs, 1); /* ours, until the end of this function */
    pthread_mutex_init(&st->mu, NULL);

    grpc_status_code refuse = GRPC_STATUS_OK;
    char why[200] = "";
    pthread_mutex_lock(&s->mu);
    if (s->shutting_down) {
        refuse = GRPC_STATUS_UNAVAILABLE;
        snprintf(why, sizeof why, "server shutting down");
    } else if (s->live >= s->max_streams) {
        refuse = GRPC_STATUS_RESOURCE_EXHAUSTED;
        snprintf(why, sizeof why, "too many concurrent Generate streams (limit %" PRIu32 ")", s->max_streams);
    } else if (req->request_id[0]) {
        if (hash_find(s, req->request_id)) {
            refuse = GRPC_STATUS_ALREADY_EXISTS;
            snprintf(why, sizeof why, "request_id \"%s\" is already running", req->request_id);
        } else {
            snprintf(st->id, sizeof st->id, "%s", req->request_id);
        }
    } else {
        do
            snprintf(st->id, sizeof st->id, "srv-%016" PRIx64 "-%" PRIu64, s->id_nonce, s->next_id++);
        while (hash_find(s, st->id));
        assigned = strdup(st->id);
        if (!assigned) {
            refuse = GRPC_STATUS_RESOURCE_EXHAUSTED;
            snprintf(why, sizeof why, "out of memory");
        }
    }
    if (refuse == GRPC_STATUS_OK) {
        st->next = s->streams;
        if (s->streams)
            s->streams->prev = st;
        s->streams = st;
        hash_insert(s, st);
        s->live++;
    }
    pthread_mutex_unlock(&s->mu);
    if (refuse != GRPC_STATUS_OK) {
        protobuf_c_message_free_unpacked(msg, NULL);
        free(assigned);
        grpc_slice_unref(st->status_details);
        pthread_mutex_destroy(&st->mu);
        free(st);
        reply_error(call, refuse, why);
        return;
    }
    if (assigned) {
        /* The message was unpacked with malloc, and free_unpacked frees a string that is not
         * the field's default: the assigned id is owned by req from here. */
        req->request_id = assigned;
    }
    st->req = req;

    /* Notice cancellation, disconnects and deadlines from now on. Every grpc_call_start_batch
     * on a stream's call happens under st->mu (gRPC wants batches on one call serialized; the
     * stream is already visible to shutdown through the live list). */
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &st->cancelled;
    atomic_fetch_add(&st->refs, 1);
    pthread_mutex_lock(&st->mu);
    grpc_call_error e = grpc_call_start_batch(call, &op, 1, &st->close_tag, NULL);
    pthread_mutex_unlock(&st->mu);
    if (e != GRPC_CALL_OK) {
        server_log("stream %s: cannot start RECV_CLOSE_ON_SERVER: %s", st->id, grpc_call_error_to_string(e));
        atomic_fetch_sub(&st->refs, 1);
        pthread_mutex_lock(&st->mu);
        st->dead = true;
        pthread_mutex_unlock(&st->mu);
        grpc_call_cancel_with_status(call, GRPC_STATUS_INTERNAL, "server error", NULL);
        stream_backend_release(st); /* drops our reference and frees */
        return;
    }

    /* Shutdown or the client may have ended the stream already (it is in the live list): then
     * the backend never sees it. From BK_IN_GENERATE on, such an end becomes cancel_wanted. */
    pthread_mutex_lock(&st->mu);
    bool ended = st->dead || st->status_pending;
    if (!ended)
        st->backend = BK_IN_GENERATE;
    pthread_mutex_unlock(&st->mu);
    if (ended) {
        stream_unref(st);
        return;
    }
    atomic_fetch_add(&st->refs, 1); /* the backend's */
    err.code = 0;
    err.msg[0] = 0;
    int rc = s->be.generate(s->be.ctx, req, st, deadline, &err);
    bool call_cancel = false;
    pthread_mutex_lock(&st->mu);
    if (rc != STRATA_OK) {
        if (st->backend != BK_IN_GENERATE) {
            /* Contract violation: the backend refused the stream but also made a terminal call. */
            server_log("stream %s: generate refused the stream after using it", st->id);
            pthread_mutex_unlock(&st->mu);
        } else {
            st->backend = BK_NONE;
            if (!st->dead) {
                stream_set_status(st, proto_grpc_status(rc), err.msg[0] ? err.msg : strata_status_name(rc));
                stream_pump(st);
            }
            pthread_mutex_unlock(&st->mu);
            stream_backend_release(st);
        }
    } else {
        if (st->backend == BK_IN_GENERATE)
            st->backend = BK_OWNED;
        if (st->cancel_wanted && st->backend == BK_OWNED && !st->cancel_called)
            call_cancel = st->cancel_called = true;
        pthread_mutex_unlock(&st->mu);
        if (call_cancel)
            s->be.cancel(s->be.ctx, st);
    }
    stream_unref(st);
}

static void handle_abort(api_server *s, grpc_call *call, grpc_metadata_array *md, grpc_byte_buffer *payload)
{
    if (!check_auth(s, call, md))
        return;
    ProtobufCMessage *msg = NULL;
    strata_error err = {0};
    int rc = payload ? proto_unpack(payload, &strata__v1__abort_request__descriptor, s->max_recv_bytes, &msg, &err)
                     : proto_unpack_bytes(NULL, 0, &strata__v1__abort_request__descriptor, 1, &msg, &err);
    if (rc) {
        reply_error(call, proto_grpc_status(err.code), err.msg);
        return;
    }
    Strata__V1__AbortRequest *req = (Strata__V1__AbortRequest *)msg;
    if (proto_validate_request_id(req->request_id, false, &err)) {
        protobuf_c_message_free_unpacked(msg, NULL);
        reply_error(call, proto_grpc_status(err.code), err.msg);
        return;
    }
    Strata__V1__AbortResponse resp = STRATA__V1__ABORT_RESPONSE__INIT;
    resp.found = s->be.abort(s->be.ctx, req->request_id);
    protobuf_c_message_free_unpacked(msg, NULL);
    reply_message(call, &resp.base);
}

/* Health, GetModelInfo, GetStats: empty requests, the backend fills the answer. */
static void handle_info(api_server *s, int method, grpc_call *call, grpc_metadata_array *md,
                        grpc_byte_buffer *payload)
{
    if ((method != M_HEALTH || s->auth_health) && !check_auth(s, call, md))
        return;
    static const ProtobufCMessageDescriptor *const req_desc[M_COUNT] = {
        [M_HEALTH] = &strata__v1__health_request__descriptor,
        [M_MODEL_INFO] = &strata__v1__model_info_request__descriptor,
        [M_STATS] = &strata__v1__stats_request__descriptor,
    };
    strata_error err = {0};
    if (payload) {
        ProtobufCMessage *msg;
        if (proto_unpack(payload, req_desc[method], s->max_recv_bytes, &msg, &err)) {
            reply_error(call, proto_grpc_status(err.code), err.msg);
            return;
        }
        protobuf_c_message_free_unpacked(msg, NULL);
    }
    int rc = STRATA_OK;
    if (method == M_HEALTH) {
        Strata__V1__HealthResponse h = STRATA__V1__HEALTH_RESPONSE__INIT;
        if (s->be.health)
            rc = s->be.health(s->be.ctx, &h, &err);
        else
            h.status = STRATA__V1__SERVING_STATUS__SERVING_STATUS_SERVING;
        if (rc)
            reply_error(call, proto_grpc_status(rc), err.msg[0] ? err.msg : strata_status_name(rc));
        else
            reply_message(call, &h.base);
    } else if (method == M_MODEL_INFO) {
        Strata__V1__ModelInfo mi = STRATA__V1__MODEL_INFO__INIT;
        if (!s->be.model_info)
            reply_error(call, GRPC_STATUS_UNIMPLEMENTED, "GetModelInfo is not implemented by this server");
        else if ((rc = s->be.model_info(s->be.ctx, &mi, &err)))
            reply_error(call, proto_grpc_status(rc), err.msg[0] ? err.msg : strata_status_name(rc));
        else
            reply_message(call, &mi.base);
    } else {
        Strata__V1__Stats st = STRATA__V1__STATS__INIT;
        Strata__V1__TierStats tiers[API_STATS_MAX_TIERS];
        Strata__V1__TierStats *tier_ptrs[API_STATS_MAX_TIERS];
        for (size_t i = 0; i < API_STATS_MAX_TIERS; i++) {
            strata__v1__tier_stats__init(&tiers[i]);
            tier_ptrs[i] = &tiers[i];
        }
        st.tiers = tier_ptrs;
        st.n_tiers = 0;
        if (!s->be.stats) {
            reply_error(call, GRPC_STATUS_UNIMPLEMENTED, "GetStats is not implemented by this server");
        } else if ((rc = s->be.stats(s->be.ctx, &st, &err))) {
            reply_error(call, proto_grpc_status(rc), err.msg[0] ? err.msg : strata_status_name(rc));
        } else {
            if (st.n_tiers > API_STATS_MAX_TIERS)
                st.n_tiers = API_STATS_MAX_TIERS;
            st.tiers = tier_ptrs; /* whatever the backend did to the pointer */
            reply_message(call, &st.base);
        }
    }
}

/* ------------------------------------------------------------------------------------------- */
/* Requesting calls                                                                            */

/* Both arm functions run under s->mu and do nothing once shutdown began: a request made after
 * grpc_server_shutdown_and_notify could otherwise reach a completion queue that is already
 * shut down. false: not armed (the caller frees the object). */
static bool arm_request(api_server *s, srv_request *r)
{
    r->call = NULL;
    r->payload = NULL;
    pthread_mutex_lock(&s->mu);
    bool ok = false;
    if (!s->shutting_down) {
        grpc_metadata_array_init(&r->md);
        ok = grpc_server_request_registered_call(s->server, s->methods[r->method], &r->call, &r->deadline, &r->md,
                                                 &r->payload, s->cq, s->cq, &r->tag) == GRPC_CALL_OK;
        if (!ok)
            grpc_metadata_array_destroy(&r->md);
    }
    pthread_mutex_unlock(&s->mu);
    return ok;
}

static bool arm_generic(api_server *s, srv_generic *g)
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
    api_server *s = r->srv;
    if (!success) {
        /* Only when the server shuts down: the request is withdrawn. */
        grpc_metadata_array_destroy(&r->md);
        if (r->payload)
            grpc_byte_buffer_destroy(r->payload);
        if (r->call)
            grpc_call_unref(r->call);
        free(r);
        return;
    }
    grpc_call *call = r->call;
    grpc_metadata_array md = r->md;
    grpc_byte_buffer *payload = r->payload;
    gpr_timespec deadline = r->deadline;
    int method = r->method;
    /* Re-arm first so the next call of this method does not wait behind this one. */
    if (!arm_request(s, r))
        free(r);

    switch (method) {
    case M_GENERATE: handle_generate(s, call, &md, payload, deadline); break;
    case M_ABORT: handle_abort(s, call, &md, payload); break;
    default: handle_info(s, method, call, &md, payload); break;
    }
    grpc_metadata_array_destroy(&md);
    if (payload)
        grpc_byte_buffer_destroy(payload);
}

static void generic_done(srv_generic *g, bool success)
{
    api_server *s = g->srv;
    if (success && g->call) {
        grpc_call *call = g->call;
        char msg[160];
        size_t n = GRPC_SLICE_LENGTH(g->details.method);
        const char *p = (const char *)GRPC_SLICE_START_PTR(g->details.method);
        /* Echo the method name when it is short plain ASCII, else just say "unknown method". */
        bool plain = n > 0 && n <= 100;
        for (size_t i = 0; plain && i < n; i++)
            plain = p[i] > 0x20 && p[i] < 0x7f;
        if (plain)
            snprintf(msg, sizeof msg, "unknown method %.*s", (int)n, p);
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

static void *cq_thread(void *arg)
{
    api_server *s = arg;
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            break;
        if (ev.type != GRPC_OP_COMPLETE)
            continue;
        srv_tag *t = ev.tag;
        switch (t->kind) {
        case TAG_REQUEST: request_done((srv_request *)t, ev.success); break;
        case TAG_GENERIC: generic_done((srv_generic *)t, ev.success); break;
        case TAG_REPLY: reply_done((srv_reply *)t); break;
        case TAG_STREAM_SEND:
            stream_send_done((api_stream *)((char *)t - offsetof(api_stream, send_tag)), ev.success);
            break;
        case TAG_STREAM_CLOSE:
            stream_close_done((api_stream *)((char *)t - offsetof(api_stream, close_tag)));
            break;
        case TAG_SHUTDOWN:
            pthread_mutex_lock(&s->mu);
            s->shutdown_done = true;
            pthread_cond_broadcast(&s->cond);
            pthread_mutex_unlock(&s->mu);
            break;
        }
    }
    return NULL;
}

/* ------------------------------------------------------------------------------------------- */
/* Start and shutdown                                                                          */

api_server_options api_server_options_default(void)
{
    api_server_options o;
    memset(&o, 0, sizeof o);
    o.listen_addr = API_SERVER_DEFAULT_ADDR;
    o.max_streams = API_SERVER_DEFAULT_MAX_STREAMS;
    o.max_recv_bytes = API_SERVER_DEFAULT_MAX_RECV_BYTES;
    o.max_queued_messages = API_SERVER_DEFAULT_MAX_QUEUED;
    o.threads = API_SERVER_DEFAULT_THREADS;
    return o;
}

static int read_pem(const char *path, const char *what, char **out, strata_error *err)
{
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f)
        return strata_fail(err, STRATA_EIO, "cannot read the TLS %s %s: %s", what, path, strerror(errno));
    char *buf = malloc(API_TLS_FILE_MAX + 1);
    if (!buf) {
        fclose(f);
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    }
    size_t n = fread(buf, 1, API_TLS_FILE_MAX + 1, f);
    bool bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        return strata_fail(err, STRATA_EIO, "cannot read the TLS %s %s", what, path);
    }
    if (n > API_TLS_FILE_MAX) {
        free(buf);
        return strata_fail(err, STRATA_EINVAL, "the TLS %s %s is larger than 1 MiB", what, path);
    }
    buf[n] = 0;
    if (!strstr(buf, "-----BEGIN ")) {
        free(buf);
        return strata_fail(err, STRATA_EINVAL, "the TLS %s %s is not a PEM file", what, path);
    }
    *out = buf;
    return STRATA_OK;
}

static void server_free(api_server *s)
{
    free(s->threads);
    free(s->hash);
    free(s->token);
    pthread_cond_destroy(&s->cond);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

int api_server_start(const api_server_options *o, const api_backend *b, api_server **out, strata_error *err)
{
    if (out)
        *out = NULL;
    if (!b || !out)
        return strata_fail(err, STRATA_EINVAL, "api_server_start: NULL backend or output");
    if (!b->generate || !b->cancel || !b->abort)
        return strata_fail(err, STRATA_EINVAL, "api_server_start: the backend needs generate, cancel and abort");
    api_server_options opt = api_server_options_default();
    if (o) {
        if (o->listen_addr && *o->listen_addr)
            opt.listen_addr = o->listen_addr;
        if (o->max_streams)
            opt.max_streams = o->max_streams;
        if (o->max_recv_bytes)
            opt.max_recv_bytes = o->max_recv_bytes;
        if (o->max_queued_messages)
            opt.max_queued_messages = o->max_queued_messages;
        if (o->threads)
            opt.threads = o->threads;
        opt.tls_cert_file = o->tls_cert_file;
        opt.tls_key_file = o->tls_key_file;
        opt.bearer_token = o->bearer_token;
        opt.auth_health = o->auth_health;
        opt.limits = o->limits;
    }
    if (!!opt.tls_cert_file != !!opt.tls_key_file)
        return strata_fail(err, STRATA_EINVAL, "TLS needs both a certificate file and a key file");
    if (opt.max_recv_bytes > INT32_MAX)
        return strata_fail(err, STRATA_EINVAL, "max_recv_bytes %zu is above 2 GiB", opt.max_recv_bytes);
    if (opt.threads > 64)
        return strata_fail(err, STRATA_EINVAL, "threads %" PRIu32 " is above 64", opt.threads);
    if (opt.max_streams > (1u << 20))
        return strata_fail(err, STRATA_EINVAL, "max_streams %" PRIu32 " is above 1048576", opt.max_streams);
    if (opt.bearer_token && *opt.bearer_token) {
        for (const char *p = opt.bearer_token; *p; p++)
            if (*p < 0x21 || *p > 0x7e)
                return strata_fail(err, STRATA_EINVAL, "the bearer token must be visible ASCII");
    }

    char *cert = NULL, *key = NULL;
    if (opt.tls_cert_file) {
        int rc = read_pem(opt.tls_cert_file, "certificate", &cert, err);
        if (!rc)
            rc = read_pem(opt.tls_key_file, "key", &key, err);
        if (rc) {
            free(cert);
            return rc;
        }
    }

    api_server *s = calloc(1, sizeof *s);
    if (!s) {
        free(cert);
        free(key);
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    }
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cond, NULL);
    s->be = *b;
    s->max_streams = opt.max_streams;
    s->max_recv_bytes = opt.max_recv_bytes;
    s->max_queued = opt.max_queued_messages;
    s->auth_health = opt.auth_health;
    s->limits = opt.limits ? *opt.limits : proto_generate_limits_default(UINT32_MAX, 0);
    s->shutdown_tag.kind = TAG_SHUTDOWN;
    size_t buckets = 64;
    while (buckets < opt.max_streams && buckets < (1u << 16))
        buckets <<= 1;
    s->hash = calloc(buckets, sizeof *s->hash);
    s->hash_mask = buckets - 1;
    s->threads = calloc(opt.threads, sizeof *s->threads);
    if (opt.bearer_token && *opt.bearer_token)
        s->token = strdup(opt.bearer_token);
    if (!s->hash || !s->threads || (opt.bearer_token && *opt.bearer_token && !s->token)) {
        free(cert);
        free(key);
        server_free(s);
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    }
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    s->id_nonce = ((uint64_t)now.tv_sec << 20) ^ (uint64_t)now.tv_nsec ^ ((uint64_t)(uintptr_t)s << 7);

    grpc_init();
    grpc_arg args[2];
    memset(args, 0, sizeof args);
    args[0].type = GRPC_ARG_INTEGER;
    args[0].key = (char *)GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[0].value.integer = (int)opt.max_recv_bytes;
    /* gRPC sets SO_REUSEPORT by default, which lets a second server bind a port that is taken;
     * a bind conflict must be an error. */
    args[1].type = GRPC_ARG_INTEGER;
    args[1].key = (char *)GRPC_ARG_ALLOW_REUSEPORT;
    args[1].value.integer = 0;
    grpc_channel_args chargs = {2, args};
    s->server = grpc_server_create(&chargs, NULL);
    s->cq = grpc_completion_queue_create_for_next(NULL);
    grpc_server_register_completion_queue(s->server, s->cq, NULL);
    for (int m = 0; m < M_COUNT; m++) {
        s->methods[m] = grpc_server_register_method(s->server, method_paths[m], NULL,
                                                    GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    }
    grpc_server_credentials *creds;
    if (cert) {
        grpc_ssl_pem_key_cert_pair pair = {key, cert};
        creds = grpc_ssl_server_credentials_create(NULL, &pair, 1, 0, NULL);
    } else {
        creds = grpc_insecure_server_credentials_create();
    }
    s->port = grpc_server_add_http2_port(s->server, opt.listen_addr, creds);
    grpc_server_credentials_release(creds);
    free(cert);
    if (key) {
        memset(key, 0, strlen(key)); /* do not leave the private key lying around in the heap */
        free(key);
    }
    int rc = STRATA_OK;
    for (int m = 0; m < M_COUNT; m++)
        if (!s->methods[m])
            rc = strata_fail(err, STRATA_EINVAL, "cannot register %s", method_paths[m]);
    if (!rc && s->port <= 0)
        rc = strata_fail(err, STRATA_EIO,
                         "cannot listen on %s (address malformed or in use%s; gRPC logs the reason)",
                         opt.listen_addr, opt.tls_cert_file ? ", or the TLS certificate/key is invalid" : "");
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

    /* Outstanding requests: several per registered method, one for unknown methods. */
    for (int m = 0; m < M_COUNT; m++) {
        for (int i = 0; i < API_REQUESTS_PER_METHOD; i++) {
            srv_request *r = calloc(1, sizeof *r);
            if (!r)
                break;
            r->tag.kind = TAG_REQUEST;
            r->srv = s;
            r->method = m;
            if (!arm_request(s, r))
                free(r);
        }
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
        /* Without a thread nobody drives the queue: run the shutdown inline. */
        s->n_threads = 0;
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
        return strata_fail(err, STRATA_EIO, "cannot start the server threads");
    }
    *out = s;
    return STRATA_OK;
}

int api_server_port(const api_server *s)
{
    return s ? s->port : 0;
}

/* Waits on s->cond (s->mu held) until pred or the absolute CLOCK_REALTIME deadline. */
static int cond_wait_until(api_server *s, const struct timespec *until)
{
    return pthread_cond_timedwait(&s->cond, &s->mu, until);
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

void api_server_shutdown(api_server *s, int drain_ms)
{
    if (!s)
        return;
    if (drain_ms < 0)
        drain_ms = 0;
    pthread_mutex_lock(&s->mu);
    s->shutting_down = true;
    pthread_mutex_unlock(&s->mu);
    /* No new calls or connections from here (clients get UNAVAILABLE); calls in flight go on. */
    grpc_server_shutdown_and_notify(s->server, s->cq, &s->shutdown_tag);

    /* Drain: let the streams in flight finish on their own. */
    pthread_mutex_lock(&s->mu);
    struct timespec until = deadline_in_ms(drain_ms);
    while (s->live > 0 && cond_wait_until(s, &until) != ETIMEDOUT) {
    }
    /* Then end the rest with UNAVAILABLE "server shutting down" (a status batch after the send
     * in flight) and cancel them in the backend. Collect them under mu with a reference each,
     * then work without mu: the backend's cancel may take its own locks, and a backend thread
     * holding those may be releasing a stream (which needs mu). */
    api_stream *todo = NULL;
    for (api_stream *st = s->streams; st; st = st->next)
        if (stream_ref_if_live(st)) {
            st->snext = todo;
            todo = st;
        }
    pthread_mutex_unlock(&s->mu);
    while (todo) {
        api_stream *st = todo;
        todo = st->snext;
        stream_server_end(st, GRPC_STATUS_UNAVAILABLE, "server shutting down");
        stream_unref(st);
    }
    pthread_mutex_lock(&s->mu);
    /* A status cannot overtake a message that flow control holds (a client that does not
     * read): after a grace period, cancel what is left outright. Streams in the list are valid
     * here: one is unlinked (under mu) before its call is released. */
    until = deadline_in_ms(1000);
    while (s->live > 0 && cond_wait_until(s, &until) != ETIMEDOUT) {
    }
    for (api_stream *st = s->streams; st; st = st->next)
        grpc_call_cancel_with_status(st->call, GRPC_STATUS_UNAVAILABLE, "server shutting down", NULL);
    /* Wait for the backend to release every stream (it must, after cancel). */
    int waited_s = 0;
    while (s->live > 0) {
        until = deadline_in_ms(5000);
        if (cond_wait_until(s, &until) == ETIMEDOUT && s->live > 0) {
            waited_s += 5;
            server_log("shutdown: still waiting for %" PRIu32 " stream(s) to be released by the backend (%d s)",
                       s->live, waited_s);
        }
    }
    /* The shutdown notification follows once every call is gone; unary calls are quick, but
     * a stuck client must not hold shutdown: cancel whatever is left after a grace period. */
    until = deadline_in_ms(1000);
    while (!s->shutdown_done && cond_wait_until(s, &until) != ETIMEDOUT) {
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
