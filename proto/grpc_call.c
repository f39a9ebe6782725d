/* Server-side gRPC C-core plumbing: tags, send queues, server start and shutdown. See
 * grpc_call.h. */
#include "proto/grpc_call.h"
#include "kvstore/clock.h"
#include "proto/grpc_log.h"
#include "proto/tls_files.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/byte_buffer.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>

#include "proto/grpc_util.h"
#include "proto/validate.h"

/* How long shutdown waits for gRPC's notification before it cancels the calls left. */
#define PROTO_SHUTDOWN_GRACE_MS 1000

/* ------------------------------------------------------------------------------------------- */
/* Small helpers                                                                               */

void proto_log(const char *who, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "strata %s: ", who);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

void proto_status_line(char *dst, size_t cap, const char *src)
{
    if (!src)
        src = "";
    size_t n = strlen(src);
    if (n >= cap)
        n = cap - 1;
    n = proto_utf8_check(src, n); /* cut at the first bad byte */
    memcpy(dst, src, n);
    dst[n] = 0;
    for (char *p = dst; *p; p++)
        if (*p == '\n' || *p == '\r')
            *p = ' ';
}

grpc_arg proto_int_arg(const char *key, int value)
{
    grpc_arg a;
    memset(&a, 0, sizeof a);
    a.type = GRPC_ARG_INTEGER;
    a.key = (char *)key;
    a.value.integer = value;
    return a;
}

grpc_call_error proto_call_recv_close(grpc_call *call, int *cancelled, proto_tag *tag)
{
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = cancelled;
    return grpc_call_start_batch(call, &op, 1, tag, NULL);
}

grpc_call_error proto_call_recv_message(grpc_call *call, grpc_byte_buffer **bb, proto_tag *tag)
{
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = bb;
    return grpc_call_start_batch(call, &op, 1, tag, NULL);
}

/* ------------------------------------------------------------------------------------------- */
/* Send queue                                                                                  */

int proto_msg_pack(const ProtobufCMessage *msg, size_t max_bytes, proto_msg **out, strata_error *err)
{
    *out = NULL;
    proto_msg *m = malloc(sizeof *m);
    if (!m)
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    m->next = NULL;
    int rc = proto_pack(msg, max_bytes, &m->bb, err);
    if (rc) {
        free(m);
        return rc;
    }
    *out = m;
    return STRATA_OK;
}

void proto_msg_free(proto_msg *m)
{
    if (!m)
        return;
    grpc_byte_buffer_destroy(m->bb);
    free(m);
}

void proto_sendq_init(proto_sendq *q, grpc_call *call, proto_tag *send_tag)
{
    memset(q, 0, sizeof *q);
    q->call = call;
    q->tag = send_tag;
    q->status_details = grpc_empty_slice();
}

void proto_sendq_push(proto_sendq *q, proto_msg *m)
{
    m->next = NULL;
    if (q->tail)
        q->tail->next = m;
    else
        q->head = m;
    q->tail = m;
    q->queued++;
}

void proto_sendq_drop(proto_sendq *q)
{
    while (q->head) {
        proto_msg *m = q->head;
        q->head = m->next;
        proto_msg_free(m);
    }
    q->tail = NULL;
    q->queued = 0;
}

bool proto_sendq_set_status(proto_sendq *q, grpc_status_code code, const char *details)
{
    if (q->status_pending)
        return false;
    q->status_pending = true;
    q->status = code;
    q->status_has_details = details != NULL;
    grpc_slice_unref(q->status_details);
    q->status_details = details ? grpc_slice_from_copied_string(details) : grpc_empty_slice();
    return true;
}

proto_sendq_result proto_sendq_pump(proto_sendq *q, grpc_call_error *e)
{
    *e = GRPC_CALL_OK;
    if (q->in_flight)
        return PROTO_SENDQ_IDLE;
    if (q->dead) {
        proto_sendq_drop(q);
        return PROTO_SENDQ_IDLE;
    }
    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    size_t n = 0;
    bool status_now = q->status_pending && !q->status_started;
    if (!q->md_sent && (q->head || status_now)) {
        ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
        n++;
    }
    if (q->head) {
        proto_msg *m = q->head;
        q->head = m->next;
        if (!q->head)
            q->tail = NULL;
        q->queued--;
        q->send_bb = m->bb;
        free(m);
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n].data.send_message.send_message = q->send_bb;
        n++;
    } else if (status_now) {
        q->status_started = true;
        ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
        ops[n].data.send_status_from_server.status = q->status;
        ops[n].data.send_status_from_server.status_details = q->status_has_details ? &q->status_details : NULL;
        n++;
    } else {
        return PROTO_SENDQ_IDLE;
    }
    q->md_sent = true;
    q->in_flight = true;
    *e = grpc_call_start_batch(q->call, ops, n, q->tag, NULL);
    if (*e == GRPC_CALL_OK)
        return PROTO_SENDQ_STARTED;
    /* Not expected (one send at a time is exactly what gRPC allows): the owner gives up on the
     * call. */
    q->in_flight = false;
    if (q->send_bb) {
        grpc_byte_buffer_destroy(q->send_bb);
        q->send_bb = NULL;
    }
    q->dead = true;
    proto_sendq_drop(q);
    return PROTO_SENDQ_FAILED;
}

void proto_sendq_sent(proto_sendq *q, bool success)
{
    q->in_flight = false;
    if (q->send_bb) {
        grpc_byte_buffer_destroy(q->send_bb);
        q->send_bb = NULL;
    }
    if (!success)
        q->dead = true; /* the call is gone (RECV_CLOSE_ON_SERVER says so too) */
}

void proto_sendq_clear(proto_sendq *q)
{
    proto_sendq_drop(q);
    if (q->send_bb) {
        grpc_byte_buffer_destroy(q->send_bb);
        q->send_bb = NULL;
    }
    grpc_slice_unref(q->status_details);
    q->status_details = grpc_empty_slice();
}

/* ------------------------------------------------------------------------------------------- */
/* One-batch replies                                                                           */

typedef struct reply_batch {
    proto_tag tag;
    grpc_call *call;
    grpc_byte_buffer *msg; /* NULL: status only */
    grpc_slice details;
    int cancelled;
} reply_batch;

static void reply_done(proto_tag *t, bool success)
{
    (void)success;
    reply_batch *r = (reply_batch *)t;
    if (r->msg)
        grpc_byte_buffer_destroy(r->msg);
    grpc_slice_unref(r->details);
    grpc_call_unref(r->call);
    free(r);
}

void proto_server_reply(proto_server *ps, grpc_call *call, grpc_byte_buffer *msg, grpc_status_code code,
                        const char *message)
{
    grpc_status_code fail_code = code == GRPC_STATUS_OK ? GRPC_STATUS_INTERNAL : code;
    reply_batch *r = calloc(1, sizeof *r);
    if (!r) {
        /* Cannot answer properly: cancel with the status instead. */
        if (code == GRPC_STATUS_OK)
            grpc_call_cancel_with_status(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory", NULL);
        else
            grpc_call_cancel_with_status(call, code, message, NULL);
        if (msg)
            grpc_byte_buffer_destroy(msg);
        grpc_call_unref(call);
        return;
    }
    r->tag.done = reply_done;
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
        proto_log(ps->name, "cannot start a reply batch: %s", grpc_call_error_to_string(e));
        grpc_call_cancel_with_status(call, fail_code, message, NULL);
        if (msg)
            grpc_byte_buffer_destroy(msg);
        grpc_slice_unref(r->details);
        grpc_call_unref(call);
        free(r);
    }
}

/* ------------------------------------------------------------------------------------------- */
/* Requesting calls                                                                            */

/* Arming runs under ps->mu and does nothing once shutdown began: a request made after
 * grpc_server_shutdown_and_notify could otherwise reach a completion queue that is already shut
 * down. */
bool proto_request_arm(proto_request *r)
{
    proto_server *ps = r->ps;
    r->call = NULL;
    r->payload = NULL;
    pthread_mutex_lock(&ps->mu);
    bool ok = false;
    if (!ps->shutting_down) {
        grpc_metadata_array_init(&r->md);
        ok = grpc_server_request_registered_call(ps->server, r->method, &r->call, &r->deadline, &r->md,
                                                 r->read_payload ? &r->payload : NULL, ps->cq, ps->cq,
                                                 &r->tag) == GRPC_CALL_OK;
        if (!ok)
            grpc_metadata_array_destroy(&r->md);
    }
    pthread_mutex_unlock(&ps->mu);
    return ok;
}

bool proto_request_take(proto_request *r, bool success, proto_request *got)
{
    if (!success) {
        /* Only when the server shuts down: the request is withdrawn. */
        grpc_metadata_array_destroy(&r->md);
        if (r->payload)
            grpc_byte_buffer_destroy(r->payload);
        if (r->call)
            grpc_call_unref(r->call);
        free(r);
        return false;
    }
    *got = *r;
    /* Re-arm first so the next call of this method does not wait behind this one. */
    if (!proto_request_arm(r))
        free(r);
    return true;
}

void proto_server_add_requests(proto_server *ps, void *method, bool read_payload, int index, int count,
                               void (*done)(proto_tag *tag, bool success))
{
    for (int i = 0; i < count; i++) {
        proto_request *r = calloc(1, sizeof *r);
        if (!r)
            break;
        r->tag.done = done;
        r->ps = ps;
        r->method = method;
        r->read_payload = read_payload;
        r->index = index;
        if (!proto_request_arm(r))
            free(r);
    }
}

/* The standing request for calls to methods nobody registered. */
typedef struct unknown_request {
    proto_tag tag;
    proto_server *ps;
    grpc_call *call;
    grpc_call_details details;
    grpc_metadata_array md;
} unknown_request;

static bool unknown_arm(unknown_request *g)
{
    proto_server *ps = g->ps;
    g->call = NULL;
    pthread_mutex_lock(&ps->mu);
    bool ok = false;
    if (!ps->shutting_down) {
        grpc_call_details_init(&g->details);
        grpc_metadata_array_init(&g->md);
        ok = grpc_server_request_call(ps->server, &g->call, &g->details, &g->md, ps->cq, ps->cq, &g->tag) ==
             GRPC_CALL_OK;
        if (!ok) {
            grpc_call_details_destroy(&g->details);
            grpc_metadata_array_destroy(&g->md);
        }
    }
    pthread_mutex_unlock(&ps->mu);
    return ok;
}

static void unknown_done(proto_tag *t, bool success)
{
    unknown_request *g = (unknown_request *)t;
    proto_server *ps = g->ps;
    if (success && g->call) {
        grpc_call *call = g->call;
        char msg[160];
        size_t n = GRPC_SLICE_LENGTH(g->details.method);
        const char *m = (const char *)GRPC_SLICE_START_PTR(g->details.method);
        /* Echo the method name when it is short plain ASCII, else just say "unknown method". */
        bool plain = n > 0 && n <= 100;
        for (size_t i = 0; plain && i < n; i++)
            plain = m[i] > 0x20 && m[i] < 0x7f;
        if (plain)
            snprintf(msg, sizeof msg, "unknown method %.*s", (int)n, m);
        else
            snprintf(msg, sizeof msg, "unknown method");
        grpc_call_details_destroy(&g->details);
        grpc_metadata_array_destroy(&g->md);
        if (!unknown_arm(g))
            free(g);
        proto_server_reply(ps, call, NULL, GRPC_STATUS_UNIMPLEMENTED, msg);
        return;
    }
    grpc_call_details_destroy(&g->details);
    grpc_metadata_array_destroy(&g->md);
    if (g->call)
        grpc_call_unref(g->call);
    free(g);
}

/* ------------------------------------------------------------------------------------------- */
/* Start and shutdown                                                                          */

static void shutdown_done(proto_tag *t, bool success)
{
    (void)success;
    proto_server *ps = PROTO_CONTAINER_OF(t, proto_server, shutdown_tag);
    pthread_mutex_lock(&ps->mu);
    ps->shutdown_done = true;
    pthread_cond_broadcast(&ps->cond);
    pthread_mutex_unlock(&ps->mu);
}

/* The owner's tick when it is due, on one thread at a time. */
static void maybe_tick(proto_server *ps)
{
    const int64_t now = strata_mono_ms();
    if (now < atomic_load(&ps->next_tick_ms) || atomic_flag_test_and_set(&ps->ticking))
        return;
    atomic_store(&ps->next_tick_ms, now + ps->tick_ms);
    ps->tick(ps->tick_ctx);
    atomic_flag_clear(&ps->ticking);
}

/* Takes events until the queue is shut down and drained; failed: report every completion as
 * failed (the inline shutdown of a server that has no thread). */
static void cq_drive(proto_server *ps, bool failed)
{
    const bool ticks = ps->tick && ps->tick_ms > 0 && !failed;
    for (;;) {
        const gpr_timespec until = ticks ? gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                                        gpr_time_from_millis(ps->tick_ms, GPR_TIMESPAN))
                                         : gpr_inf_future(GPR_CLOCK_REALTIME);
        grpc_event ev = grpc_completion_queue_next(ps->cq, until, NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            break;
        if (ev.type == GRPC_OP_COMPLETE) {
            proto_tag *t = ev.tag;
            t->done(t, ev.success && !failed);
        }
        if (ticks)
            maybe_tick(ps);
    }
}

static void *cq_thread(void *arg)
{
    cq_drive(arg, false);
    return NULL;
}

int proto_server_init(proto_server *ps, const char *name, uint32_t threads)
{
    memset(ps, 0, sizeof *ps);
    atomic_init(&ps->next_tick_ms, 0);
    atomic_flag_clear(&ps->ticking);
    ps->name = name;
    ps->max_threads = threads ? threads : 1;
    ps->threads = calloc(ps->max_threads, sizeof *ps->threads);
    if (!ps->threads)
        return STRATA_ENOMEM;
    pthread_mutex_init(&ps->mu, NULL);
    pthread_cond_init(&ps->cond, NULL);
    ps->shutdown_tag.done = shutdown_done;
    return STRATA_OK;
}

void proto_server_free(proto_server *ps)
{
    free(ps->threads);
    ps->threads = NULL;
    pthread_cond_destroy(&ps->cond);
    pthread_mutex_destroy(&ps->mu);
}

void proto_server_create(proto_server *ps, const grpc_arg *args, size_t n_args)
{
    proto_grpc_init();
    grpc_channel_args chargs = {n_args, (grpc_arg *)args};
    ps->server = grpc_server_create(&chargs, NULL);
    ps->cq = grpc_completion_queue_create_for_next(NULL);
    grpc_server_register_completion_queue(ps->server, ps->cq, NULL);
}

int proto_server_listen(proto_server *ps, const char *addr, const char *cert_file, const char *key_file,
                        strata_error *err)
{
    ps->port = 0;
    grpc_server_credentials *creds;
    if (cert_file) {
        char *cert, *key;
        int rc = proto_tls_read_pair(cert_file, key_file, &cert, &key, err);
        if (rc)
            return rc;
        grpc_ssl_pem_key_cert_pair pair = {key, cert};
        creds = grpc_ssl_server_credentials_create(NULL, &pair, 1, 0, NULL);   /* copies them */
        free(cert);
        proto_tls_free_key(key);   /* the private key does not stay in this heap */
    } else {
        creds = grpc_insecure_server_credentials_create();
    }
    char why[256];
    proto_grpc_log_capture_begin();
    ps->port = grpc_server_add_http2_port(ps->server, addr, creds);
    proto_grpc_log_capture_end(why, sizeof why);
    grpc_server_credentials_release(creds);
    if (ps->port <= 0)
        return strata_fail(err, STRATA_EIO, "cannot listen on %s: %s", addr, why[0] ? why : "gRPC gave no reason");
    return STRATA_OK;
}

void proto_server_abandon(proto_server *ps)
{
    /* Never started: a server that was not started can be destroyed directly. */
    grpc_server_destroy(ps->server);
    grpc_completion_queue_shutdown(ps->cq);
    while (grpc_completion_queue_next(ps->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type != GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(ps->cq);
    ps->server = NULL;
    ps->cq = NULL;
    grpc_shutdown();
}

void proto_server_start(proto_server *ps)
{
    grpc_server_start(ps->server);
    unknown_request *g = calloc(1, sizeof *g);
    if (g) {
        g->tag.done = unknown_done;
        g->ps = ps;
        if (!unknown_arm(g))
            free(g);
    }
}

int proto_server_run(proto_server *ps)
{
    for (uint32_t i = 0; i < ps->max_threads; i++) {
        if (pthread_create(&ps->threads[i], NULL, cq_thread, ps) != 0) {
            proto_log(ps->name, "cannot start thread %" PRIu32 "; running with %" PRIu32, i, i);
            break;
        }
        ps->n_threads = i + 1;
    }
    if (ps->n_threads > 0)
        return STRATA_OK;
    /* Without a thread nobody drives the queue: shut down inline. Only requests are
     * outstanding; their done functions free them. */
    pthread_mutex_lock(&ps->mu);
    ps->shutting_down = true;
    pthread_mutex_unlock(&ps->mu);
    grpc_server_shutdown_and_notify(ps->server, ps->cq, &ps->shutdown_tag);
    grpc_server_cancel_all_calls(ps->server);
    grpc_completion_queue_shutdown(ps->cq);
    cq_drive(ps, true);
    grpc_server_destroy(ps->server);
    grpc_completion_queue_destroy(ps->cq);
    ps->server = NULL;
    ps->cq = NULL;
    grpc_shutdown();
    return STRATA_EIO;
}

void proto_server_shutdown_begin(proto_server *ps)
{
    pthread_mutex_lock(&ps->mu);
    ps->shutting_down = true;
    pthread_mutex_unlock(&ps->mu);
    grpc_server_shutdown_and_notify(ps->server, ps->cq, &ps->shutdown_tag);
}

void proto_server_wait(proto_server *ps, const uint32_t *count, long ms, const char *what)
{
    if (ms >= 0) {
        struct timespec until = strata_realtime_after_ms(ms);
        while (*count > 0 && pthread_cond_timedwait(&ps->cond, &ps->mu, &until) != ETIMEDOUT) {
        }
        return;
    }
    int waited_s = 0;
    while (*count > 0) {
        struct timespec until = strata_realtime_after_ms(5000);
        if (pthread_cond_timedwait(&ps->cond, &ps->mu, &until) == ETIMEDOUT && *count > 0) {
            waited_s += 5;
            proto_log(ps->name, "shutdown: still waiting for %" PRIu32 " %s (%d s)", *count, what, waited_s);
        }
    }
}

void proto_server_shutdown_end(proto_server *ps)
{
    /* The notification follows once every call is gone; unary calls are quick, but a stuck
     * client must not hold shutdown: cancel whatever is left after a grace period. */
    pthread_mutex_lock(&ps->mu);
    struct timespec until = strata_realtime_after_ms(PROTO_SHUTDOWN_GRACE_MS);
    while (!ps->shutdown_done && pthread_cond_timedwait(&ps->cond, &ps->mu, &until) != ETIMEDOUT) {
    }
    if (!ps->shutdown_done) {
        pthread_mutex_unlock(&ps->mu);
        grpc_server_cancel_all_calls(ps->server);
        pthread_mutex_lock(&ps->mu);
        while (!ps->shutdown_done)
            pthread_cond_wait(&ps->cond, &ps->mu);
    }
    pthread_mutex_unlock(&ps->mu);

    grpc_completion_queue_shutdown(ps->cq);
    for (uint32_t i = 0; i < ps->n_threads; i++)
        pthread_join(ps->threads[i], NULL);
    grpc_server_destroy(ps->server);
    grpc_completion_queue_destroy(ps->cq);
    ps->server = NULL;
    ps->cq = NULL;
    grpc_shutdown();
}
