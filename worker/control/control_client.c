/* The worker's control stream on the gRPC C core. See control_client.h (contract) and
 * coordinator/control/README.md.
 *
 * Structure. No thread of our own: one completion queue created for
 * grpc_completion_queue_pluck, and each operation is a batch that the calling thread plucks by
 * its tag. Four tags, one per kind of batch, each with at most one batch in flight:
 *   tag_status  RECV_STATUS_ON_CLIENT, started at connect; plucked by whoever first needs the
 *               status (status_plucking makes the others wait on cond);
 *   tag_send    SEND_INITIAL_METADATA at connect, then SEND_MESSAGE (the Join, once the
 *               Challenge came, and every later message), under send_mu;
 *   tag_recv    RECV_MESSAGE (+ RECV_INITIAL_METADATA the first time), under recv_mu; a
 *               receive that timed out stays in flight and the next ctl_client_recv plucks it;
 *   tag_half    SEND_CLOSE_FROM_CLIENT in ctl_client_close, under send_mu.
 * gRPC wants batches on one call serialized, but allows send-only and receive-only batches to be
 * serialized independently: send_mu and recv_mu are exactly that. At most 4 plucks run at once
 * (GRPC_MAX_COMPLETION_QUEUE_PLUCKERS is 6). grpc_call_cancel is thread-safe and makes every
 * batch in flight complete, which is how close unblocks the other threads. */
#include "worker/control/control_client.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/byte_buffer.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/time.h>

#include "kvstore/random.h"
#include "proto/control_auth.h"
#include "proto/grpc_call.h"
#include "proto/grpc_log.h"
#include "proto/grpc_util.h"
#include "proto/tls_probe.h"
#include "proto/validate.h"

#define CTL_CLIENT_ATTACH_METHOD "/strata.internal.v1.WorkerControl/Attach"

struct ctl_client {
    grpc_channel *ch;
    bool tls;                /* the channel has TLS credentials */
    uint64_t tls_failures;   /* proto_grpc_tls_failures when the connect began */
    grpc_completion_queue *cq;
    grpc_call *call;
    size_t max_bytes;
    char addr[256];
    /* Tags: the addresses of these bytes. */
    char tag_status, tag_send, tag_recv, tag_half;

    pthread_mutex_t mu;
    pthread_cond_t cond;
    /* Under mu. */
    int users;            /* threads inside send / recv */
    bool closing;
    bool status_started;  /* RECV_STATUS_ON_CLIENT is in flight or done */
    bool status_plucking; /* a thread is plucking tag_status */
    bool status_have;
    int status;
    char details[400];
    char auth_error[400]; /* set when the coordinator failed its proof: every later call says so */

    pthread_mutex_t send_mu;
    /* Under send_mu. */
    bool send_failed;
    bool half_outstanding;

    pthread_mutex_t recv_mu;
    /* Under recv_mu. */
    bool join_sent;       /* the Join is out: the next message must prove the secret (Admitted) */
    bool admitted;        /* it did */
    uint8_t admit_proof[PROTO_CONTROL_PROOF_BYTES];
    bool recv_outstanding;
    bool recv_ended;
    bool md_requested;
    grpc_byte_buffer *recv_bb;
    grpc_metadata_array md_in;

    /* RECV_STATUS_ON_CLIENT's outputs (read after its completion, under mu). */
    grpc_metadata_array trailing;
    grpc_status_code st_code;
    grpc_slice st_details;
};

static gpr_timespec deadline_ms(int timeout_ms)
{
    /* Monotonic: a wall-clock step must not stretch or cut a wait. (Deadlines are compared with
     * one another: one clock for all of them.) */
    if (timeout_ms < 0)
        return gpr_inf_future(GPR_CLOCK_MONOTONIC);
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
}

static bool is_inf(gpr_timespec t)
{
    return gpr_time_cmp(t, gpr_inf_future(t.clock_type)) == 0;
}

static grpc_event pluck(ctl_client *c, void *tag, gpr_timespec deadline)
{
    return grpc_completion_queue_pluck(c->cq, tag, deadline, NULL);
}

/* The stream's status, plucking it (until deadline) unless another thread does or did. true
 * when the status is known. */
static bool fetch_status(ctl_client *c, gpr_timespec deadline)
{
    pthread_mutex_lock(&c->mu);
    for (;;) {
        if (c->status_have || !c->status_started) {
            bool have = c->status_have;
            pthread_mutex_unlock(&c->mu);
            return have;
        }
        if (!c->status_plucking)
            break;
        if (is_inf(deadline)) {
            pthread_cond_wait(&c->cond, &c->mu);
        } else {
            gpr_timespec rt = gpr_convert_clock_type(deadline, GPR_CLOCK_REALTIME);
            struct timespec ts = {.tv_sec = (time_t)rt.tv_sec, .tv_nsec = rt.tv_nsec};
            if (pthread_cond_timedwait(&c->cond, &c->mu, &ts) == ETIMEDOUT && !c->status_have) {
                pthread_mutex_unlock(&c->mu);
                return false;
            }
        }
    }
    c->status_plucking = true;
    pthread_mutex_unlock(&c->mu);
    grpc_event ev = pluck(c, &c->tag_status, deadline);
    pthread_mutex_lock(&c->mu);
    c->status_plucking = false;
    if (ev.type == GRPC_OP_COMPLETE) {
        c->status_have = true;
        c->status = (int)c->st_code;
        size_t n = GRPC_SLICE_LENGTH(c->st_details);
        if (n >= sizeof c->details)
            n = sizeof c->details - 1;
        memcpy(c->details, GRPC_SLICE_START_PTR(c->st_details), n);
        c->details[n] = 0;
        c->details[proto_utf8_check(c->details, n)] = 0;
        for (char *p = c->details; *p; p++)
            if (*p == '\n' || *p == '\r')
                *p = ' ';
        grpc_slice_unref(c->st_details);
        c->st_details = grpc_empty_slice();
    }
    bool have = c->status_have;
    pthread_cond_broadcast(&c->cond);
    pthread_mutex_unlock(&c->mu);
    return have;
}

/* STRATA_EIO with the stream's status (waits for it: the call is over, so it comes). */
static int ended_error(ctl_client *c, strata_error *err)
{
    fetch_status(c, gpr_inf_future(GPR_CLOCK_REALTIME));
    pthread_mutex_lock(&c->mu);
    int rc;
    if (c->auth_error[0])
        rc = strata_fail(err, STRATA_EIO, "%s", c->auth_error);
    else if (!c->status_have)
        rc = strata_fail(err, STRATA_EIO, "the control stream to the coordinator ended");
    else if (c->details[0])
        rc = strata_fail(err, STRATA_EIO, "coordinator ended the control stream: %s: %s",
                         proto_grpc_status_name(c->status), c->details);
    else
        rc = strata_fail(err, STRATA_EIO, "coordinator ended the control stream: %s", proto_grpc_status_name(c->status));
    pthread_mutex_unlock(&c->mu);
    return rc;
}

static bool enter(ctl_client *c)
{
    pthread_mutex_lock(&c->mu);
    bool ok = !c->closing;
    if (ok)
        c->users++;
    pthread_mutex_unlock(&c->mu);
    return ok;
}

static void leave(ctl_client *c)
{
    pthread_mutex_lock(&c->mu);
    if (--c->users == 0)
        pthread_cond_broadcast(&c->cond);
    pthread_mutex_unlock(&c->mu);
}

/* Cancels the call, completes every batch still in flight and frees everything. No other thread
 * may be inside the client. */
static void client_teardown(ctl_client *c)
{
    gpr_timespec inf = gpr_inf_future(GPR_CLOCK_REALTIME);
    if (c->call) {
        grpc_call_cancel(c->call, NULL);
        if (c->half_outstanding)
            pluck(c, &c->tag_half, inf);
        if (c->recv_outstanding) {
            pluck(c, &c->tag_recv, inf);
            c->recv_outstanding = false;
        }
        if (c->recv_bb)
            grpc_byte_buffer_destroy(c->recv_bb);
        fetch_status(c, inf);
        grpc_call_unref(c->call);
    }
    grpc_metadata_array_destroy(&c->md_in);
    grpc_metadata_array_destroy(&c->trailing);
    grpc_slice_unref(c->st_details);
    if (c->cq) {
        grpc_completion_queue_shutdown(c->cq);
        while (grpc_completion_queue_pluck(c->cq, NULL, inf, NULL).type != GRPC_QUEUE_SHUTDOWN) {
        }
        grpc_completion_queue_destroy(c->cq);
    }
    if (c->ch)
        grpc_channel_destroy(c->ch);
    pthread_cond_destroy(&c->cond);
    pthread_mutex_destroy(&c->mu);
    pthread_mutex_destroy(&c->send_mu);
    pthread_mutex_destroy(&c->recv_mu);
    free(c);
    grpc_shutdown();
}

static int recv_one(ctl_client *c, gpr_timespec deadline, Strata__Internal__V1__CoordinatorMessage **msg,
                    strata_error *err);

int ctl_client_connect(const char *coordinator_addr, const void *secret, size_t secret_len,
                       const Strata__Internal__V1__Join *join, int timeout_ms, ctl_client **out, strata_error *err)
{
    return ctl_client_connect_opts(coordinator_addr, secret, secret_len, join, timeout_ms, NULL, out, err);
}

/* The end of the next wait towards deadline: a slice of CTL_CLIENT_CANCEL_POLL_MS when there is
 * a stop flag, or over TLS a handshake's failure (tls_failed), to look at in between. */
static gpr_timespec wait_slice(const ctl_client *c, gpr_timespec deadline, const volatile sig_atomic_t *cancel)
{
    if (!cancel && !c->tls)
        return deadline;
    const gpr_timespec slice = deadline_ms(CTL_CLIENT_CANCEL_POLL_MS);
    return gpr_time_cmp(slice, deadline) < 0 ? slice : deadline;
}

/* Whether gRPC logged a TLS handshake failing for good since the connect began (gRPC would
 * retry it until the deadline). */
static bool tls_failed(const ctl_client *c)
{
    return c->tls && proto_grpc_tls_failures(NULL, 0) > c->tls_failures;
}

/* Plucks tag until deadline in slices of CTL_CLIENT_CANCEL_POLL_MS while *cancel stays 0 and no
 * TLS handshake failed. *cancelled says whether a stop request ended the wait. */
static grpc_event pluck_cancellable(ctl_client *c, void *tag, gpr_timespec deadline, const volatile sig_atomic_t *cancel,
                                    bool *cancelled)
{
    *cancelled = false;
    for (;;) {
        const gpr_timespec until = wait_slice(c, deadline, cancel);
        grpc_event ev = pluck(c, tag, until);
        if (ev.type != GRPC_QUEUE_TIMEOUT || gpr_time_cmp(until, deadline) == 0 || tls_failed(c))
            return ev;
        if ((*cancelled = cancel && *cancel != 0))
            return ev;
    }
}

/* The first message of the stream, the coordinator's Challenge, waited for until deadline (in
 * slices while *cancel stays 0). STRATA_OK with *msg NULL when the time ran out or a stop was
 * requested (*cancelled). */
static int recv_challenge(ctl_client *c, gpr_timespec deadline, const volatile sig_atomic_t *cancel, bool *cancelled,
                          Strata__Internal__V1__CoordinatorMessage **msg, strata_error *err)
{
    *cancelled = false;
    for (;;) {
        const gpr_timespec until = wait_slice(c, deadline, cancel);
        int rc = recv_one(c, until, msg, err);
        if (rc == STRATA_EFORMAT)   /* not even a CoordinatorMessage: no strata coordinator */
            return rc;
        if (rc != STRATA_OK || *msg || gpr_time_cmp(until, deadline) == 0)
            return rc;
        if ((*cancelled = cancel && *cancel != 0))
            return STRATA_OK;
    }
}

/* A handshake made by hand before (and after) gRPC's wait, which would retry until the deadline
 * what cannot get better: STRATA_EIO naming the reason when the control port answers otherwise
 * than this client expects (TLS against no TLS, the other way round, a certificate the roots do
 * not accept), STRATA_OK when it agrees or nothing was learnt (nobody listening yet). */
/* A TLS handshake with the control port failed for good, why being OpenSSL's reason (from our
 * own handshake or from gRPC's log line): the message, with what it likely means. */
static int handshake_failed(const char *addr, const char *why, strata_error *err)
{
    return strata_fail(err, STRATA_EIO, "the TLS handshake with the coordinator at %s failed: %s%s", addr, why,
                       strstr(why, "hostname mismatch") || strstr(why, "IP address mismatch")
                           ? " (its certificate does not name the host dialled)"
                       : strstr(why, "certificate verify failed")
                           ? " (the CA given did not sign the certificate of its control port)"
                           : " (its control port has no TLS?)");
}

static int probe_control_port(const char *addr, const char *roots_pem, int ms, strata_error *err)
{
    char why[256];
    if (proto_tls_probe(addr, roots_pem, ms, why, sizeof why) != PROTO_TLS_PROBE_DIFFERS)
        return STRATA_OK;
    if (!roots_pem)
        return strata_fail(err, STRATA_EIO, "the control port of the coordinator at %s speaks TLS: this worker "
                           "needs the CA of its certificate (strata-worker --coordinator-ca FILE)", addr);
    return handshake_failed(addr, why, err);
}

int ctl_client_connect_opts(const char *coordinator_addr, const void *secret, size_t secret_len,
                            const Strata__Internal__V1__Join *join, int timeout_ms, const ctl_client_options *o,
                            ctl_client **out, strata_error *err)
{
    if (out)
        *out = NULL;
    if (!coordinator_addr || !*coordinator_addr || !join || !out || !secret)
        return strata_fail(err, STRATA_EINVAL, "ctl_client_connect: NULL or empty argument");
    if (secret_len < PROTO_SECRET_MIN_BYTES || secret_len > PROTO_SECRET_MAX_BYTES)
        return strata_fail(err, STRATA_EINVAL, "cluster secret of %zu bytes (%d to %d needed)", secret_len,
                           PROTO_SECRET_MIN_BYTES, PROTO_SECRET_MAX_BYTES);
    const char *name = join->worker_name ? join->worker_name : "";
    size_t max_bytes = o && o->max_message_bytes ? o->max_message_bytes : CTL_CLIENT_DEFAULT_MAX_MESSAGE_BYTES;
    int ka_time = o && o->keepalive_time_ms ? o->keepalive_time_ms : CTL_CLIENT_DEFAULT_KEEPALIVE_TIME_MS;
    int ka_timeout = o && o->keepalive_timeout_ms ? o->keepalive_timeout_ms : CTL_CLIENT_DEFAULT_KEEPALIVE_TIMEOUT_MS;
    if (max_bytes > INT32_MAX)
        return strata_fail(err, STRATA_EINVAL, "max_message_bytes %zu is above 2 GiB", max_bytes);
    if (ka_time < 0 || ka_timeout < 0)
        return strata_fail(err, STRATA_EINVAL, "keepalive times must not be negative");
    if (timeout_ms == 0)
        timeout_ms = CTL_CLIENT_DEFAULT_CONNECT_TIMEOUT_MS;

    const gpr_timespec deadline = deadline_ms(timeout_ms);
    const char *roots = o ? o->tls_roots_pem : NULL;
    int rc = probe_control_port(coordinator_addr, roots,
                                timeout_ms > 0 && timeout_ms < CTL_CLIENT_PROBE_MS ? timeout_ms : CTL_CLIENT_PROBE_MS, err);
    if (rc != STRATA_OK)
        return rc;

    proto_grpc_init();
    ctl_client *c = calloc(1, sizeof *c);
    if (!c) {
        grpc_shutdown();
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    }
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cond, NULL);
    pthread_mutex_init(&c->send_mu, NULL);
    pthread_mutex_init(&c->recv_mu, NULL);
    grpc_metadata_array_init(&c->md_in);
    grpc_metadata_array_init(&c->trailing);
    c->st_details = grpc_empty_slice();
    c->status = -1;
    c->max_bytes = max_bytes;
    snprintf(c->addr, sizeof c->addr, "%s", coordinator_addr);

    grpc_arg args[6] = {
        proto_int_arg(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, (int)max_bytes),
        proto_int_arg(GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, (int)max_bytes),
        proto_int_arg(GRPC_ARG_KEEPALIVE_TIME_MS, ka_time),
        proto_int_arg(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ka_timeout),
        proto_int_arg(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1),
        /* Keep pinging an idle stream (gRPC stops after 2 pings without data by default). */
        proto_int_arg(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0),
    };
    grpc_channel_args chargs = {sizeof args / sizeof args[0], args};
    const bool tls = o && o->tls_roots_pem;
    c->tls = tls;
    c->tls_failures = proto_grpc_tls_failures(NULL, 0);
    grpc_channel_credentials *creds = tls ? grpc_ssl_credentials_create(o->tls_roots_pem, NULL, NULL, NULL)
                                          : grpc_insecure_credentials_create();
    c->ch = grpc_channel_create(coordinator_addr, creds, &chargs);
    grpc_channel_credentials_release(creds);
    c->cq = grpc_completion_queue_create_for_pluck(NULL);
    c->call = grpc_channel_create_call(c->ch, NULL, GRPC_PROPAGATE_DEFAULTS, c->cq,
                                       grpc_slice_from_static_string(CTL_CLIENT_ATTACH_METHOD), NULL,
                                       gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (!c->call) {
        client_teardown(c);
        return strata_fail(err, STRATA_EIO, "cannot create a call to the coordinator at %s", coordinator_addr);
    }

    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    op.data.recv_status_on_client.trailing_metadata = &c->trailing;
    op.data.recv_status_on_client.status = &c->st_code;
    op.data.recv_status_on_client.status_details = &c->st_details;
    grpc_call_error e = grpc_call_start_batch(c->call, &op, 1, &c->tag_status, NULL);
    if (e == GRPC_CALL_OK)
        c->status_started = true;

    /* Wait for the coordinator to be reachable (up to timeout_ms) instead of failing at once. */
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_SEND_INITIAL_METADATA;
    op.flags = GRPC_INITIAL_METADATA_WAIT_FOR_READY;
    if (e == GRPC_CALL_OK)
        e = grpc_call_start_batch(c->call, &op, 1, &c->tag_send, NULL);
    if (e != GRPC_CALL_OK) {
        client_teardown(c);
        return strata_fail(err, STRATA_EIO, "cannot start the control call: %s", grpc_call_error_to_string(e));
    }
    const volatile sig_atomic_t *cancel = o ? o->cancel : NULL;
    bool cancelled;
    grpc_event ev = pluck_cancellable(c, &c->tag_send, deadline, cancel, &cancelled);
    Strata__Internal__V1__CoordinatorMessage *challenge = NULL;
    if (ev.type == GRPC_OP_COMPLETE && ev.success)
        rc = recv_challenge(c, deadline, cancel, &cancelled, &challenge, err);
    if (ev.type == GRPC_QUEUE_TIMEOUT || (rc == STRATA_OK && ev.success && !challenge)) {
        const bool reached = ev.type != GRPC_QUEUE_TIMEOUT;   /* the call went out on a connection */
        char why[256] = "";
        const bool handshake = !reached && tls_failed(c) && proto_grpc_tls_failures(why, sizeof why);
        if (!reached) {
            grpc_call_cancel(c->call, NULL);
            pluck(c, &c->tag_send, gpr_inf_future(GPR_CLOCK_REALTIME));
        }
        client_teardown(c);
        if (cancelled)
            return strata_fail(err, STRATA_EIO, "stopped while reaching the coordinator at %s", coordinator_addr);
        if (handshake)
            return handshake_failed(coordinator_addr, why, err);
        /* A coordinator that came up during the wait, answering otherwise than expected. */
        if (!reached && probe_control_port(coordinator_addr, roots, CTL_CLIENT_PROBE_MS, err) != STRATA_OK)
            return STRATA_EIO;
        if (reached)
            return strata_fail(err, STRATA_EIO, "the coordinator at %s sent no Challenge within %d ms (a "
                               "coordinator of control protocol version 2 or older sends none; this worker "
                               "speaks %u)", coordinator_addr, timeout_ms, CTL_CLIENT_PROTOCOL_VERSION);
        return strata_fail(err, STRATA_EIO, "cannot reach the coordinator at %s within %d ms (nothing listening "
                           "there, or no answer)", coordinator_addr, timeout_ms);
    }
    if (!ev.success || rc != STRATA_OK) {
        if (!ev.success)
            ended_error(c, err);
        strata_error_prefix(err, "cannot attach to the coordinator at %s", coordinator_addr);
        client_teardown(c);
        return STRATA_EIO;
    }

    /* The coordinator opened with its nonce: answer with the proof, never the secret. */
    uint8_t worker_nonce[PROTO_CONTROL_NONCE_BYTES], proof[PROTO_CONTROL_PROOF_BYTES];
    const bool is_challenge = challenge->kind_case == STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_CHALLENGE &&
                              challenge->challenge && challenge->challenge->nonce.len == PROTO_CONTROL_NONCE_BYTES;
    if (!is_challenge)
        rc = strata_fail(err, STRATA_EIO, "the coordinator at %s did not open the stream with a Challenge (a "
                         "coordinator of another control protocol version than %u?)", coordinator_addr,
                         CTL_CLIENT_PROTOCOL_VERSION);
    if (rc == STRATA_OK)
        rc = strata_random_bytes(worker_nonce, sizeof worker_nonce, err);
    if (rc == STRATA_OK)
        rc = proto_control_proof(PROTO_PROOF_WORKER, secret, secret_len, challenge->challenge->nonce.data,
                                 worker_nonce, name, proof, err);
    if (rc == STRATA_OK)
        rc = proto_control_proof(PROTO_PROOF_COORDINATOR, secret, secret_len, challenge->challenge->nonce.data,
                                 worker_nonce, name, c->admit_proof, err);
    protobuf_c_message_free_unpacked(&challenge->base, NULL);
    Strata__Internal__V1__Join j = *join;
    if (!j.protocol_version)
        j.protocol_version = CTL_CLIENT_PROTOCOL_VERSION;
    j.secret_proof = (ProtobufCBinaryData){sizeof proof, proof};
    j.worker_nonce = (ProtobufCBinaryData){sizeof worker_nonce, worker_nonce};
    Strata__Internal__V1__WorkerMessage wm = STRATA__INTERNAL__V1__WORKER_MESSAGE__INIT;
    wm.kind_case = STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_JOIN;
    wm.join = &j;
    grpc_byte_buffer *bb = NULL;
    if (rc == STRATA_OK && proto_pack(&wm.base, max_bytes, &bb, err) != STRATA_OK) {
        if (err)
            err->code = STRATA_EINVAL;
        rc = STRATA_EINVAL;
    }
    explicit_bzero(proof, sizeof proof);
    if (rc != STRATA_OK) {
        client_teardown(c);
        return rc;
    }
    c->join_sent = true;   /* no other thread knows c yet */
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_SEND_MESSAGE;
    op.data.send_message.send_message = bb;
    e = grpc_call_start_batch(c->call, &op, 1, &c->tag_send, NULL);
    if (e == GRPC_CALL_OK)
        ev = pluck(c, &c->tag_send, gpr_inf_future(GPR_CLOCK_REALTIME));   /* the stream is up: brief */
    grpc_byte_buffer_destroy(bb);
    if (e != GRPC_CALL_OK || !ev.success) {
        if (e == GRPC_CALL_OK)
            ended_error(c, err);
        else
            strata_fail(err, STRATA_EIO, "cannot send the Join: %s", grpc_call_error_to_string(e));
        strata_error_prefix(err, "cannot attach to the coordinator at %s", coordinator_addr);
        client_teardown(c);
        return STRATA_EIO;
    }
    *out = c;
    return STRATA_OK;
}

int ctl_client_send(ctl_client *c, const Strata__Internal__V1__WorkerMessage *msg, strata_error *err)
{
    if (!c || !msg)
        return strata_fail(err, STRATA_EINVAL, "ctl_client_send: NULL argument");
    grpc_byte_buffer *bb;
    int rc = proto_pack(&msg->base, c->max_bytes, &bb, err);
    if (rc) {
        if (err)
            err->code = STRATA_EINVAL;
        return STRATA_EINVAL;
    }
    if (!enter(c)) {
        grpc_byte_buffer_destroy(bb);
        return strata_fail(err, STRATA_EIO, "the control client is closing");
    }
    pthread_mutex_lock(&c->send_mu);
    bool failed = c->send_failed;
    if (!failed) {
        grpc_op op;
        memset(&op, 0, sizeof op);
        op.op = GRPC_OP_SEND_MESSAGE;
        op.data.send_message.send_message = bb;
        if (grpc_call_start_batch(c->call, &op, 1, &c->tag_send, NULL) != GRPC_CALL_OK) {
            failed = true;
        } else {
            grpc_event ev = pluck(c, &c->tag_send, gpr_inf_future(GPR_CLOCK_REALTIME));
            failed = !ev.success;
        }
        c->send_failed = failed;
    }
    pthread_mutex_unlock(&c->send_mu);
    grpc_byte_buffer_destroy(bb);
    rc = failed ? ended_error(c, err) : STRATA_OK;
    leave(c);
    return rc;
}

/* Under recv_mu, the first message after the Join: the coordinator's proof of the secret. On
 * a wrong one the call is cancelled and every later call fails with the reason. */
static int check_admitted(ctl_client *c, const Strata__Internal__V1__CoordinatorMessage *m, strata_error *err)
{
    const bool ok = m->kind_case == STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_ADMITTED && m->admitted &&
                    proto_control_proof_equal(m->admitted->secret_proof.data, m->admitted->secret_proof.len,
                                              c->admit_proof);
    if (ok) {
        c->admitted = true;
        return STRATA_OK;
    }
    c->recv_ended = true;
    pthread_mutex_lock(&c->mu);
    snprintf(c->auth_error, sizeof c->auth_error,
             "the coordinator at %s did not prove that it holds the cluster secret (%s): not trusting it",
             c->addr, m->kind_case == STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_ADMITTED
                          ? "wrong proof: a different secret"
                          : "no Admitted message before others");
    pthread_mutex_unlock(&c->mu);
    grpc_call_cancel_with_status(c->call, GRPC_STATUS_PERMISSION_DENIED, "coordinator failed authentication", NULL);
    return strata_fail(err, STRATA_EIO, "%s", c->auth_error);
}

/* Starts the next receive (the coordinator's initial metadata with the first one), under
 * recv_mu with none outstanding. False when the call takes no more batches. */
static bool start_recv(ctl_client *c)
{
    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    size_t n = 0;
    if (!c->md_requested) {
        ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
        ops[n].data.recv_initial_metadata.recv_initial_metadata = &c->md_in;
        n++;
    }
    ops[n].op = GRPC_OP_RECV_MESSAGE;
    ops[n].data.recv_message.recv_message = &c->recv_bb;
    n++;
    if (grpc_call_start_batch(c->call, ops, n, &c->tag_recv, NULL) != GRPC_CALL_OK)
        return false;
    c->md_requested = true;
    c->recv_outstanding = true;
    return true;
}

/* One message, waiting until deadline (the caller has entered). The contract of ctl_client_recv,
 * except that the coordinator's proof (Admitted), due first after the Join, is checked here and
 * not passed on. */
static int recv_one(ctl_client *c, gpr_timespec deadline, Strata__Internal__V1__CoordinatorMessage **msg,
                    strata_error *err)
{
    pthread_mutex_lock(&c->recv_mu);
    if (!c->recv_ended && !c->recv_outstanding && !start_recv(c))
        c->recv_ended = true;
    if (c->recv_ended) {
        pthread_mutex_unlock(&c->recv_mu);
        return ended_error(c, err);
    }
    grpc_event ev = pluck(c, &c->tag_recv, deadline);
    if (ev.type != GRPC_OP_COMPLETE) {
        pthread_mutex_unlock(&c->recv_mu); /* still in flight: the next call plucks it */
        return STRATA_OK;
    }
    c->recv_outstanding = false;
    grpc_byte_buffer *bb = c->recv_bb;
    c->recv_bb = NULL;
    if (!ev.success || !bb) {
        c->recv_ended = true;
        pthread_mutex_unlock(&c->recv_mu);
        if (bb)
            grpc_byte_buffer_destroy(bb);
        return ended_error(c, err);
    }
    const bool proof_due = c->join_sent && !c->admitted;
    if (!proof_due)
        pthread_mutex_unlock(&c->recv_mu);
    ProtobufCMessage *m = NULL;
    int rc = proto_unpack(bb, &strata__internal__v1__coordinator_message__descriptor, c->max_bytes, &m, err);
    grpc_byte_buffer_destroy(bb);
    if (rc != STRATA_OK) {
        strata_error_prefix(err, "undecodable CoordinatorMessage");
        if (proof_due) {   /* what stands where the proof must: no trust either */
            Strata__Internal__V1__CoordinatorMessage none = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__INIT;
            rc = check_admitted(c, &none, err);
            pthread_mutex_unlock(&c->recv_mu);
        }
        return rc;
    }
    *msg = (Strata__Internal__V1__CoordinatorMessage *)m;
    if (proof_due) {
        rc = check_admitted(c, *msg, err);
        pthread_mutex_unlock(&c->recv_mu);
        protobuf_c_message_free_unpacked(m, NULL);
        *msg = NULL;
        if (rc != STRATA_OK)
            return rc;
        return recv_one(c, deadline, msg, err);   /* the proof is not the caller's: the next one */
    }
    return STRATA_OK;
}

int ctl_client_recv(ctl_client *c, int timeout_ms, Strata__Internal__V1__CoordinatorMessage **msg, strata_error *err)
{
    if (msg)
        *msg = NULL;
    if (!c || !msg)
        return strata_fail(err, STRATA_EINVAL, "ctl_client_recv: NULL argument");
    if (!enter(c))
        return strata_fail(err, STRATA_EIO, "the control client is closing");
    int rc = recv_one(c, deadline_ms(timeout_ms), msg, err);
    leave(c);
    return rc;
}

int ctl_client_status(ctl_client *c, char *details, size_t cap)
{
    if (!c)
        return -1;
    pthread_mutex_lock(&c->mu);
    int st = c->status_have ? c->status : -1;
    if (details && cap)
        snprintf(details, cap, "%s", c->status_have ? c->details : "");
    pthread_mutex_unlock(&c->mu);
    return st;
}

void ctl_client_close(ctl_client *c)
{
    if (!c)
        return;
    pthread_mutex_lock(&c->mu);
    c->closing = true;
    pthread_mutex_unlock(&c->mu);

    /* Graceful end when no other thread is in the middle of a send: half-close, read (and
     * drop) what the coordinator still sends until its status arrives, so that it sees a clean
     * close (on_gone OK) rather than a cancellation. Bounded by CTL_CLIENT_CLOSE_GRACE_MS. */
    gpr_timespec grace = deadline_ms(CTL_CLIENT_CLOSE_GRACE_MS);
    if (pthread_mutex_trylock(&c->send_mu) == 0) {
        bool half = false;
        if (!c->send_failed) {
            grpc_op op;
            memset(&op, 0, sizeof op);
            op.op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
            if (grpc_call_start_batch(c->call, &op, 1, &c->tag_half, NULL) == GRPC_CALL_OK) {
                c->half_outstanding = true;
                if (pluck(c, &c->tag_half, grace).type == GRPC_OP_COMPLETE) {
                    c->half_outstanding = false;
                    half = true;
                }
            }
        }
        pthread_mutex_unlock(&c->send_mu);
        if (half && pthread_mutex_trylock(&c->recv_mu) == 0) {
            while (!c->recv_ended) {
                if (!c->recv_outstanding && !start_recv(c))
                    break;
                grpc_event ev = pluck(c, &c->tag_recv, grace);
                if (ev.type != GRPC_OP_COMPLETE)
                    break;
                c->recv_outstanding = false;
                if (!ev.success || !c->recv_bb)
                    c->recv_ended = true;
                if (c->recv_bb) {
                    grpc_byte_buffer_destroy(c->recv_bb);
                    c->recv_bb = NULL;
                }
            }
            pthread_mutex_unlock(&c->recv_mu);
        }
        if (half)
            fetch_status(c, grace);
    }

    grpc_call_cancel(c->call, NULL);
    pthread_mutex_lock(&c->mu);
    while (c->users > 0)
        pthread_cond_wait(&c->cond, &c->mu);
    pthread_mutex_unlock(&c->mu);
    client_teardown(c);
}
