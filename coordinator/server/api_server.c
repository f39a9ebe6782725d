/* The public gRPC API server on the gRPC C core. See api_server.h (contract) and README.md.
 *
 * Structure. One completion queue (created for grpc_completion_queue_next) carries every event:
 * new calls (registered methods and a generic request for unknown methods), the one-batch
 * replies of unary calls and early errors, the send and close batches of Generate streams, and
 * the server's shutdown notification. `threads` threads block in grpc_completion_queue_next and
 * call the done function of the proto_tag at the start of every tag object. The plumbing both
 * gRPC servers share (tags, send queue, one-batch replies, the unknown-method request, start and
 * shutdown sequences) is proto/grpc_call.h.
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
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/byte_buffer.h>
#include <grpc/grpc.h>

#include "kvstore/clock.h"
#include "proto/credential_file.h"
#include "proto/grpc_call.h"
#include "proto/grpc_util.h"

/* Responses larger than this are refused when packed (gRPC clients refuse received messages
 * above 4 MiB by default). */
#define API_MAX_SEND_BYTES ((size_t)4 << 20)
/* Outstanding grpc_server_request_registered_call per method (new calls wait inside gRPC when
 * all are taken, until one is re-armed). */
#define API_REQUESTS_PER_METHOD 4

/* ------------------------------------------------------------------------------------------- */
/* Objects                                                                                     */

enum method { M_GENERATE, M_ABORT, M_HEALTH, M_MODEL_INFO, M_STATS, M_DRAIN, M_COUNT };

static const char *const method_paths[M_COUNT] = {
    "/strata.v1.Strata/Generate",     "/strata.v1.Strata/Abort",    "/strata.v1.Strata/Health",
    "/strata.v1.Strata/GetModelInfo", "/strata.v1.Strata/GetStats", "/strata.v1.Strata/DrainWorker",
};

enum backend_state {
    BK_NONE,        /* not handed to the backend (or refused by generate) */
    BK_IN_GENERATE, /* generate is running */
    BK_OWNED,       /* generate returned OK; the terminal call has not come */
    BK_RELEASED,    /* the backend made its terminal call */
};

struct api_stream {
    proto_tag send_tag;
    proto_tag close_tag;
    api_server *srv;
    grpc_call *call;
    Strata__V1__GenerateRequest *req;
    char id[PROTO_MAX_REQUEST_ID_BYTES + 1];
    atomic_uint refs;

    pthread_mutex_t mu;
    /* Under mu. */
    proto_sendq q;            /* q.dead: cancelled or closed, nothing more can be sent */
    bool chunk_queued;        /* a Chunk was ever queued: failures then go as Error messages */
    int backend;              /* enum backend_state */
    bool cancel_wanted;       /* the call died while generate was running */
    bool cancel_called;
    int cancelled;            /* RECV_CLOSE_ON_SERVER's output */
    int64_t released_ms;      /* when the backend made its terminal call (monotonic) */
    bool lingered;            /* cancelled for not taking its end within API_SERVER_LINGER_MS */

    /* Under srv->ps.mu. */
    api_stream *prev, *next; /* live list */
    api_stream *hnext;       /* request-id hash chain */
    bool in_hash;
    api_stream *snext;       /* shutdown's private list (it holds a reference) */
};

struct api_server {
    proto_server ps; /* ps.mu is the server mutex */
    api_backend be;
    void *methods[M_COUNT];
    uint32_t max_streams;
    size_t max_recv_bytes;
    uint32_t max_queued;
    char *token; /* NULL: no bearer token */
    bool auth_health;
    proto_generate_limits limits;

    /* Under ps.mu. */
    uint32_t live; /* streams not yet freed */
    api_stream *streams;
    api_stream **hash;
    size_t hash_mask;
    uint64_t next_id;
    uint64_t id_nonce;
};

static void stream_unref(api_stream *st);

/* ------------------------------------------------------------------------------------------- */
/* Small helpers                                                                               */

#define server_log(...) proto_log("api_server", __VA_ARGS__)

/* A one-batch answer: initial metadata, optional message, status, and RECV_CLOSE_ON_SERVER.
 * Takes ownership of call and msg. */
static void reply(api_server *s, grpc_call *call, grpc_byte_buffer *msg, grpc_status_code code, const char *message)
{
    proto_server_reply(&s->ps, call, msg, code, message);
}

static void reply_error(api_server *s, grpc_call *call, grpc_status_code code, const char *message)
{
    reply(s, call, NULL, code, message);
}

/* Packs msg and replies OK with it, or INTERNAL when it cannot be packed. */
static void reply_message(api_server *s, grpc_call *call, const ProtobufCMessage *msg)
{
    grpc_byte_buffer *bb;
    strata_error err = {0};
    if (proto_pack(msg, API_MAX_SEND_BYTES, &bb, &err)) {
        reply_error(s, call, GRPC_STATUS_INTERNAL, err.msg);
        return;
    }
    reply(s, call, bb, GRPC_STATUS_OK, NULL);
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
    reply_error(s, call, GRPC_STATUS_UNAUTHENTICATED, msg);
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

/* Under s->ps.mu. */
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

/* Under st->mu: starts the next send batch when none is in flight. The caller holds a
 * reference. */
static void stream_pump(api_stream *st)
{
    grpc_call_error e;
    proto_sendq_result r = proto_sendq_pump(&st->q, &e);
    if (r == PROTO_SENDQ_STARTED) {
        atomic_fetch_add(&st->refs, 1);
    } else if (r == PROTO_SENDQ_FAILED) {
        /* Give up on the call. */
        server_log("stream %s: cannot start a send batch: %s", st->id, grpc_call_error_to_string(e));
        grpc_call_cancel_with_status(st->call, GRPC_STATUS_INTERNAL, "server send failed", NULL);
    }
}

static void stream_free(api_stream *st)
{
    api_server *s = st->srv;
    pthread_mutex_lock(&s->ps.mu);
    if (st->prev)
        st->prev->next = st->next;
    else
        s->streams = st->next;
    if (st->next)
        st->next->prev = st->prev;
    hash_remove(s, st);
    pthread_mutex_unlock(&s->ps.mu);

    proto_sendq_clear(&st->q);
    grpc_call_unref(st->call);
    if (st->req)
        protobuf_c_message_free_unpacked(&st->req->base, NULL);
    pthread_mutex_destroy(&st->mu);
    free(st);

    /* Counted down last, after the call is gone: shutdown waits for live == 0 before it
     * destroys the completion queue and the server. Nothing touches s after the unlock. */
    pthread_mutex_lock(&s->ps.mu);
    s->live--;
    pthread_cond_broadcast(&s->ps.cond);
    pthread_mutex_unlock(&s->ps.mu);
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
    pthread_mutex_lock(&s->ps.mu);
    hash_remove(s, st); /* the id may be reused from now on */
    pthread_mutex_unlock(&s->ps.mu);
    stream_unref(st);
}

/* Under st->mu: the final status, sent after the queue drains (an OK status carries no
 * message). */
static void stream_set_status(api_stream *st, grpc_status_code code, const char *message)
{
    proto_sendq_set_status(&st->q, code, code == GRPC_STATUS_OK ? NULL : message ? message : "");
}

static int pack_response(api_stream *st, Strata__V1__GenerateResponse *resp, proto_msg **out, strata_error *err)
{
    resp->request_id = st->id;
    return proto_msg_pack(&resp->base, API_MAX_SEND_BYTES, out, err);
}

/* The Error message that ends a stream which already produced output. */
static int pack_error(api_stream *st, grpc_status_code code, const char *message, proto_msg **out)
{
    Strata__V1__Error e = STRATA__V1__ERROR__INIT;
    e.code = (uint32_t)code;
    e.message = (char *)message;
    Strata__V1__GenerateResponse resp = STRATA__V1__GENERATE_RESPONSE__INIT;
    resp.kind_case = STRATA__V1__GENERATE_RESPONSE__KIND_ERROR;
    resp.error = &e;
    return pack_response(st, &resp, out, NULL);
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
    proto_msg *m;
    int rc = pack_response(st, &resp, &m, NULL);
    if (t != small)
        free(t);
    if (rc)
        return rc == STRATA_EFULL ? STRATA_EINVAL : rc; /* one oversized chunk: the stream goes on */

    pthread_mutex_lock(&st->mu);
    if (st->q.dead || st->q.status_pending) {
        pthread_mutex_unlock(&st->mu);
        proto_msg_free(m);
        return STRATA_EIO;
    }
    if (st->q.queued >= st->srv->max_queued) {
        /* The client does not read: fail the stream rather than buffer without bound. The call
         * is cancelled with the status (gRPC sends it as trailers even when the stream's flow
         * control window is closed); RECV_CLOSE_ON_SERVER then reports cancelled and the backend
         * gets cancel from a server thread. */
        st->q.dead = true;
        proto_sendq_drop(&st->q);
        pthread_mutex_unlock(&st->mu);
        proto_msg_free(m);
        grpc_call_cancel_with_status(st->call, GRPC_STATUS_RESOURCE_EXHAUSTED, "client not reading", NULL);
        return STRATA_EFULL;
    }
    proto_sendq_push(&st->q, m);
    st->chunk_queued = true;
    stream_pump(st);
    pthread_mutex_unlock(&st->mu);
    return STRATA_OK;
}

/* Queues m (may be NULL) and the final status; marks the backend released. */
static void stream_terminal(api_stream *st, proto_msg *m, grpc_status_code code, const char *message)
{
    /* The id is free before the final status can reach the client: the completion-queue thread
     * may send it before this thread gets to stream_backend_release, and a client that reuses the
     * id as soon as its stream ended must not be told it is still running (seen in CI). */
    api_server *s = st->srv;
    pthread_mutex_lock(&s->ps.mu);
    hash_remove(s, st);
    pthread_mutex_unlock(&s->ps.mu);
    pthread_mutex_lock(&st->mu);
    if (st->backend == BK_RELEASED) {
        pthread_mutex_unlock(&st->mu);
        server_log("stream %s: a second terminal call from the backend (ignored)", st->id);
        proto_msg_free(m);
        return;
    }
    st->backend = BK_RELEASED;
    st->released_ms = strata_mono_ms();
    if (!st->q.dead && !st->q.status_pending) {
        if (m) {
            proto_sendq_push(&st->q, m);
            m = NULL;
        }
        stream_set_status(st, code, message);
        stream_pump(st);
    }
    pthread_mutex_unlock(&st->mu);
    proto_msg_free(m);
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
    proto_msg *m;
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
    char line[768];
    proto_status_line(line, sizeof line, message);

    pthread_mutex_lock(&st->mu);
    bool as_message = st->chunk_queued;
    pthread_mutex_unlock(&st->mu);
    if (!as_message) {
        stream_terminal(st, NULL, code, line);
        return;
    }
    proto_msg *m;
    if (pack_error(st, code, line, &m)) {
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
    bool expected = st->cancel_called || st->q.dead;
    pthread_mutex_unlock(&st->mu);
    if (!expected)
        server_log("stream %s: the backend ended it without a result", st->id);
    stream_terminal(st, NULL, GRPC_STATUS_INTERNAL, "backend ended the request without a result");
}

/* A send batch completed (server thread). */
static void stream_send_done(proto_tag *t, bool success)
{
    api_stream *st = PROTO_CONTAINER_OF(t, api_stream, send_tag);
    pthread_mutex_lock(&st->mu);
    proto_sendq_sent(&st->q, success);
    stream_pump(st);
    pthread_mutex_unlock(&st->mu);
    stream_unref(st);
}

/* Under st->mu, when the stream ended early: the backend is to be told. true when the caller
 * calls be.cancel (after unlocking); while generate runs, it is told when generate returns. */
static bool stream_cancel_backend(api_stream *st)
{
    if (st->backend == BK_IN_GENERATE)
        st->cancel_wanted = true;
    else if (st->backend == BK_OWNED && !st->cancel_called)
        return st->cancel_called = true;
    return false;
}

/* RECV_CLOSE_ON_SERVER completed (server thread): the call is over for the client. */
static void stream_close_done(proto_tag *t, bool success)
{
    (void)success;
    api_stream *st = PROTO_CONTAINER_OF(t, api_stream, close_tag);
    bool call_cancel = false;
    pthread_mutex_lock(&st->mu);
    if (st->cancelled) {
        st->q.dead = true;
        proto_sendq_drop(&st->q);
        call_cancel = stream_cancel_backend(st);
    }
    pthread_mutex_unlock(&st->mu);
    if (call_cancel)
        st->srv->be.cancel(st->srv->be.ctx, st);
    stream_unref(st);
}

/* Takes a reference unless the stream is already being freed (refs == 0; it is then unlinked
 * as soon as the caller releases s->ps.mu). */
static bool stream_ref_if_live(api_stream *st)
{
    unsigned r = atomic_load(&st->refs);
    while (r != 0)
        if (atomic_compare_exchange_weak(&st->refs, &r, r + 1))
            return true;
    return false;
}

/* Ends a stream from the server side (the drain ran out) and tells the backend. A stream whose
 * backend has already ended it (its status is set, its last message queued) is left to flush:
 * dropping its queue would send that status, OK, after a truncated stream with no final message;
 * a client too slow to take the rest meets the forced cancel after the grace period instead.
 * Otherwise queued messages are dropped; after the message in flight, if any, a stream that has
 * produced output gets an Error message and status OK (the Generate contract: a failure after
 * output is a message), one that has not gets the status itself. Either goes out as a normal batch, which reaches the
 * client reliably, also on a connection that is draining after GOAWAY, where cancelling the
 * call can close the connection before the status is written (gRPC 1.51). */
static void stream_server_end(api_stream *st, grpc_status_code code, const char *message)
{
    proto_msg *m;
    if (pack_error(st, code, message, &m))
        m = NULL; /* out of memory: the status alone still ends the call */

    bool call_cancel = false;
    pthread_mutex_lock(&st->mu);
    if (!st->q.dead && !st->q.status_pending) {
        proto_sendq_drop(&st->q);
        if (st->chunk_queued && m) {
            proto_sendq_push(&st->q, m);
            m = NULL;
            stream_set_status(st, GRPC_STATUS_OK, NULL);
        } else {
            stream_set_status(st, code, message);
        }
        stream_pump(st);
    }
    call_cancel = stream_cancel_backend(st);
    pthread_mutex_unlock(&st->mu);
    proto_msg_free(m);
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
        reply_error(s, call, GRPC_STATUS_INVALID_ARGUMENT, "no GenerateRequest message received");
        return;
    }
    ProtobufCMessage *msg;
    strata_error err = {0};
    if (proto_unpack(payload, &strata__v1__generate_request__descriptor, s->max_recv_bytes, &msg, &err)) {
        reply_error(s, call, proto_grpc_status(err.code), err.msg);
        return;
    }
    Strata__V1__GenerateRequest *req = (Strata__V1__GenerateRequest *)msg;
    if (proto_validate_generate(req, &s->limits, &err)) {
        protobuf_c_message_free_unpacked(msg, NULL);
        reply_error(s, call, proto_grpc_status(err.code), err.msg);
        return;
    }

    api_stream *st = calloc(1, sizeof *st);
    char *assigned = NULL;
    if (!st) {
        protobuf_c_message_free_unpacked(msg, NULL);
        reply_error(s, call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    st->send_tag.done = stream_send_done;
    st->close_tag.done = stream_close_done;
    st->srv = s;
    st->call = call;
    proto_sendq_init(&st->q, call, &st->send_tag);
    atomic_init(&st->refs, 1); /* ours, until the end of this function */
    pthread_mutex_init(&st->mu, NULL);

    grpc_status_code refuse = GRPC_STATUS_OK;
    char why[200] = "";
    pthread_mutex_lock(&s->ps.mu);
    if (s->ps.shutting_down) {
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
    pthread_mutex_unlock(&s->ps.mu);
    if (refuse != GRPC_STATUS_OK) {
        protobuf_c_message_free_unpacked(msg, NULL);
        free(assigned);
        proto_sendq_clear(&st->q);
        pthread_mutex_destroy(&st->mu);
        free(st);
        reply_error(s, call, refuse, why);
        return;
    }
    if (assigned) {
        /* The message was unpacked with malloc, and free_unpacked frees a string that is not
         * the field's default: the assigned id is owned by req from here. */
        if (req->request_id && req->request_id != (char *)protobuf_c_empty_string)
            free(req->request_id);   /* an empty id the client sent explicitly: unpacked as a copy */
        req->request_id = assigned;
    }
    st->req = req;

    /* Notice cancellation, disconnects and deadlines from now on. Every grpc_call_start_batch
     * on a stream's call happens under st->mu (gRPC wants batches on one call serialized; the
     * stream is already visible to shutdown through the live list). */
    atomic_fetch_add(&st->refs, 1);
    pthread_mutex_lock(&st->mu);
    grpc_call_error e = proto_call_recv_close(call, &st->cancelled, &st->close_tag);
    pthread_mutex_unlock(&st->mu);
    if (e != GRPC_CALL_OK) {
        server_log("stream %s: cannot start RECV_CLOSE_ON_SERVER: %s", st->id, grpc_call_error_to_string(e));
        atomic_fetch_sub(&st->refs, 1);
        pthread_mutex_lock(&st->mu);
        st->q.dead = true;
        pthread_mutex_unlock(&st->mu);
        grpc_call_cancel_with_status(call, GRPC_STATUS_INTERNAL, "server error", NULL);
        stream_backend_release(st); /* drops our reference and frees */
        return;
    }

    /* Shutdown or the client may have ended the stream already (it is in the live list): then
     * the backend never sees it. From BK_IN_GENERATE on, such an end becomes cancel_wanted. */
    pthread_mutex_lock(&st->mu);
    bool ended = st->q.dead || st->q.status_pending;
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
            if (!st->q.dead) {
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
        reply_error(s, call, proto_grpc_status(err.code), err.msg);
        return;
    }
    Strata__V1__AbortRequest *req = (Strata__V1__AbortRequest *)msg;
    if (proto_validate_request_id(req->request_id, false, &err)) {
        protobuf_c_message_free_unpacked(msg, NULL);
        reply_error(s, call, proto_grpc_status(err.code), err.msg);
        return;
    }
    Strata__V1__AbortResponse resp = STRATA__V1__ABORT_RESPONSE__INIT;
    resp.found = s->be.abort(s->be.ctx, req->request_id);
    protobuf_c_message_free_unpacked(msg, NULL);
    reply_message(s, call, &resp.base);
}

/* DrainWorker: always behind the bearer token (it changes what the server runs). */
static void handle_drain(api_server *s, grpc_call *call, grpc_metadata_array *md, grpc_byte_buffer *payload)
{
    if (!check_auth(s, call, md))
        return;
    ProtobufCMessage *msg = NULL;
    strata_error err = {0};
    int rc = payload ? proto_unpack(payload, &strata__v1__drain_worker_request__descriptor, s->max_recv_bytes, &msg,
                                    &err)
                     : proto_unpack_bytes(NULL, 0, &strata__v1__drain_worker_request__descriptor, 1, &msg, &err);
    if (rc) {
        reply_error(s, call, proto_grpc_status(err.code), err.msg);
        return;
    }
    const char *name = ((Strata__V1__DrainWorkerRequest *)msg)->worker_name;
    Strata__V1__DrainWorkerResponse resp = STRATA__V1__DRAIN_WORKER_RESPONSE__INIT;
    char message[API_DRAIN_MESSAGE_BYTES] = "";
    resp.message = message;
    if (!name || !proto_worker_name_valid(name))   /* the rule a worker's own name follows at Join */
        reply_error(s, call, GRPC_STATUS_INVALID_ARGUMENT,
                    "worker_name must be 1 to 128 bytes of UTF-8 without control characters");
    else if (!s->be.drain_worker)
        reply_error(s, call, GRPC_STATUS_UNIMPLEMENTED, "DrainWorker is not implemented by this server");
    else if ((rc = s->be.drain_worker(s->be.ctx, name, &resp, &err)))
        reply_error(s, call, proto_grpc_status(rc), err.msg[0] ? err.msg : strata_status_name(rc));
    else
        reply_message(s, call, &resp.base);
    protobuf_c_message_free_unpacked(msg, NULL);
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
            reply_error(s, call, proto_grpc_status(err.code), err.msg);
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
            reply_error(s, call, proto_grpc_status(rc), err.msg[0] ? err.msg : strata_status_name(rc));
        else
            reply_message(s, call, &h.base);
    } else if (method == M_MODEL_INFO) {
        Strata__V1__ModelInfo mi = STRATA__V1__MODEL_INFO__INIT;
        if (!s->be.model_info)
            reply_error(s, call, GRPC_STATUS_UNIMPLEMENTED, "GetModelInfo is not implemented by this server");
        else if ((rc = s->be.model_info(s->be.ctx, &mi, &err)))
            reply_error(s, call, proto_grpc_status(rc), err.msg[0] ? err.msg : strata_status_name(rc));
        else
            reply_message(s, call, &mi.base);
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
            reply_error(s, call, GRPC_STATUS_UNIMPLEMENTED, "GetStats is not implemented by this server");
        } else if ((rc = s->be.stats(s->be.ctx, &st, &err))) {
            reply_error(s, call, proto_grpc_status(rc), err.msg[0] ? err.msg : strata_status_name(rc));
        } else {
            if (st.n_tiers > API_STATS_MAX_TIERS)
                st.n_tiers = API_STATS_MAX_TIERS;
            st.tiers = tier_ptrs; /* whatever the backend did to the pointer */
            reply_message(s, call, &st.base);
        }
    }
}

/* ------------------------------------------------------------------------------------------- */
/* Requesting calls                                                                            */

/* A new call of a registered method, or the request withdrawn at shutdown (server thread). */
static void request_done(proto_tag *t, bool success)
{
    proto_request got;
    if (!proto_request_take((proto_request *)t, success, &got))
        return;
    api_server *s = PROTO_CONTAINER_OF(got.ps, api_server, ps);
    switch (got.index) {
    case M_GENERATE: handle_generate(s, got.call, &got.md, got.payload, got.deadline); break;
    case M_ABORT: handle_abort(s, got.call, &got.md, got.payload); break;
    case M_DRAIN: handle_drain(s, got.call, &got.md, got.payload); break;
    default: handle_info(s, got.index, got.call, &got.md, got.payload); break;
    }
    grpc_metadata_array_destroy(&got.md);
    if (got.payload)
        grpc_byte_buffer_destroy(got.payload);
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

/* Server tick: a stream the backend ended whose end the client has not taken within
 * API_SERVER_LINGER_MS (flow control holds it: the client stopped reading, or vanished) is
 * cancelled, which frees its slot; else one client could hold every slot with streams that
 * finished long ago. Streams in the list are valid under ps.mu (one is unlinked before it is
 * freed); the server lock comes before a stream's. */
static void sweep_lingering(void *ctx)
{
    api_server *s = ctx;
    const int64_t now = strata_mono_ms();
    unsigned n = 0;
    pthread_mutex_lock(&s->ps.mu);
    for (api_stream *st = s->streams; st; st = st->next) {
        pthread_mutex_lock(&st->mu);
        if (st->backend == BK_RELEASED && !st->q.dead && !st->lingered && now - st->released_ms > API_SERVER_LINGER_MS) {
            st->lingered = true;
            n++;
            grpc_call_cancel_with_status(st->call, GRPC_STATUS_UNAVAILABLE, "client not reading the end of its stream",
                                         NULL);
        }
        pthread_mutex_unlock(&st->mu);
    }
    pthread_mutex_unlock(&s->ps.mu);
    if (n)   /* one line per sweep: a client doing this on purpose does not flood the log */
        server_log("%u finished stream(s) cancelled: their clients did not take the end within %d s", n,
                   API_SERVER_LINGER_MS / 1000);
}

static void server_free(api_server *s)
{
    free(s->hash);
    free(s->token);
    proto_server_free(&s->ps);
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

    api_server *s = calloc(1, sizeof *s);
    if (s && proto_server_init(&s->ps, "api_server", opt.threads)) {
        free(s);
        s = NULL;
    }
    if (!s)
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    s->be = *b;
    s->max_streams = opt.max_streams;
    s->max_recv_bytes = opt.max_recv_bytes;
    s->max_queued = opt.max_queued_messages;
    s->auth_health = opt.auth_health;
    s->limits = opt.limits ? *opt.limits : proto_generate_limits_default(UINT32_MAX, 0);
    size_t buckets = 64;
    while (buckets < opt.max_streams && buckets < (1u << 16))
        buckets <<= 1;
    s->hash = calloc(buckets, sizeof *s->hash);
    s->hash_mask = buckets - 1;
    if (opt.bearer_token && *opt.bearer_token)
        s->token = strdup(opt.bearer_token);
    if (!s->hash || (opt.bearer_token && *opt.bearer_token && !s->token)) {
        server_free(s);
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    }
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    s->id_nonce = ((uint64_t)now.tv_sec << 20) ^ (uint64_t)now.tv_nsec ^ ((uint64_t)(uintptr_t)s << 7);

    grpc_arg args[] = {
        proto_int_arg(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, (int)opt.max_recv_bytes),
        /* gRPC sets SO_REUSEPORT by default, which lets a second server bind a port that is
         * taken; a bind conflict must be an error. */
        proto_int_arg(GRPC_ARG_ALLOW_REUSEPORT, 0),
        /* Identity only: gRPC inflates a compressed message whole before its receive limit
         * applies (a 3.5 MB request took 3.8 GB, before any token check). */
        proto_int_arg(GRPC_COMPRESSION_CHANNEL_ENABLED_ALGORITHMS_BITSET, 1),
        /* One connection may not take every Generate slot nor unbounded memory in stalled calls. */
        proto_int_arg(GRPC_ARG_MAX_CONCURRENT_STREAMS, API_SERVER_STREAMS_PER_CONNECTION),
        /* A vanished client's connection (and its calls) ends after an unanswered ping instead
         * of gRPC's two hours. */
        proto_int_arg(GRPC_ARG_KEEPALIVE_TIME_MS, API_SERVER_KEEPALIVE_MS),
        proto_int_arg(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20000),
        proto_int_arg(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0),
    };
    proto_server_create(&s->ps, args, sizeof args / sizeof *args);
    for (int m = 0; m < M_COUNT; m++) {
        s->methods[m] = grpc_server_register_method(s->ps.server, method_paths[m], NULL,
                                                    GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    }
    int rc = STRATA_OK;
    for (int m = 0; m < M_COUNT; m++)
        if (!s->methods[m])
            rc = strata_fail(err, STRATA_EINVAL, "cannot register %s", method_paths[m]);
    if (!rc)
        rc = proto_server_listen(&s->ps, opt.listen_addr, opt.tls_cert_file, opt.tls_key_file, err);
    if (rc) {
        proto_server_abandon(&s->ps);
        server_free(s);
        return rc;
    }
    proto_server_start(&s->ps);
    s->ps.tick = sweep_lingering;
    s->ps.tick_ctx = s;
    s->ps.tick_ms = 1000;
    /* Outstanding requests: several per registered method (and one for unknown methods). */
    for (int m = 0; m < M_COUNT; m++)
        proto_server_add_requests(&s->ps, s->methods[m], true, m, API_REQUESTS_PER_METHOD, request_done);
    if (proto_server_run(&s->ps)) {
        server_free(s);
        return strata_fail(err, STRATA_EIO, "cannot start the server threads");
    }
    *out = s;
    return STRATA_OK;
}

int api_server_port(const api_server *s)
{
    return s ? s->ps.port : 0;
}

void api_server_shutdown(api_server *s, int drain_ms)
{
    if (!s)
        return;
    if (drain_ms < 0)
        drain_ms = 0;
    /* No new calls or connections from here (clients get UNAVAILABLE); calls in flight go on. */
    proto_server_shutdown_begin(&s->ps);

    /* Drain: let the streams in flight finish on their own. */
    pthread_mutex_lock(&s->ps.mu);
    proto_server_wait(&s->ps, &s->live, drain_ms, NULL);
    /* Then end the rest with UNAVAILABLE "server shutting down" (a status batch after the send
     * in flight) and cancel them in the backend. Collect them under mu with a reference each,
     * then work without mu: the backend's cancel may take its own locks, and a backend thread
     * holding those may be releasing a stream (which needs mu). */
    api_stream *to_end = NULL;
    for (api_stream *st = s->streams; st; st = st->next)
        if (stream_ref_if_live(st)) {
            st->snext = to_end;
            to_end = st;
        }
    pthread_mutex_unlock(&s->ps.mu);
    while (to_end) {
        api_stream *st = to_end;
        to_end = st->snext;
        stream_server_end(st, GRPC_STATUS_UNAVAILABLE, "server shutting down");
        stream_unref(st);
    }
    pthread_mutex_lock(&s->ps.mu);
    /* A status cannot overtake a message that flow control holds (a client that does not
     * read): after a grace period, cancel what is left outright. Streams in the list are valid
     * here: one is unlinked (under mu) before its call is released. */
    proto_server_wait(&s->ps, &s->live, 1000, NULL);
    for (api_stream *st = s->streams; st; st = st->next)
        grpc_call_cancel_with_status(st->call, GRPC_STATUS_UNAVAILABLE, "server shutting down", NULL);
    /* Wait for the backend to release every stream (it must, after cancel). */
    proto_server_wait(&s->ps, &s->live, -1, "stream(s) to be released by the backend");
    pthread_mutex_unlock(&s->ps.mu);

    proto_server_shutdown_end(&s->ps);
    server_free(s);
}
