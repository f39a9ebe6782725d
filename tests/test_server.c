/* The API server layer (coordinator/server/api_server.h) in-process, with a gRPC C-core client
 * over loopback: the backend contract corners that the end-to-end Python test
 * (tests/server/test_api.py, through api_testserver) does not reach: a terminal call made
 * inside generate (before it returns) and inside cancel, api_stream_finish without a cancel,
 * a chunk with invalid UTF-8 refused without ending the stream, api_stream_fail with a
 * multi-line message and with STRATA_OK, the release of a cancelled stream (its concurrency
 * slot comes back), optional backend callbacks left NULL, shutdown while the backend holds a
 * stream (cancel then release), DrainWorker's message written into the server's buffer, and the
 * start errors (options, bind conflicts). */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>

#include "tests/test_time.h"
#include "coordinator/server/api_server.h"
#include "tests/api_client.h"
#include "proto/grpc_util.h"

/* ---- an in-process backend whose behaviour is chosen by the prompt text ---- */

typedef struct cbackend {
    pthread_mutex_t mu;
    api_stream *held; /* "hold": kept until cancel */
    int cancels;
    int generates;
    int chunk_rc; /* what send_chunk returned for the invalid UTF-8 chunk */
    int bad;      /* checks that failed on a server thread (cmocka asserts only on the test's) */
} cbackend;

#define BACKEND_CHECK(b, cond)                                                                    \
    do {                                                                                          \
        if (!(cond)) {                                                                            \
            pthread_mutex_lock(&(b)->mu);                                                         \
            (b)->bad++;                                                                           \
            pthread_mutex_unlock(&(b)->mu);                                                       \
            fprintf(stderr, "backend check failed: %s (line %d)\n", #cond, __LINE__);            \
        }                                                                                         \
    } while (0)

static int cb_generate(void *ctx, const Strata__V1__GenerateRequest *req, api_stream *st, gpr_timespec deadline,
                       strata_error *err)
{
    (void)deadline;
    cbackend *b = ctx;
    const char *t = req->text;
    pthread_mutex_lock(&b->mu);
    b->generates++;
    pthread_mutex_unlock(&b->mu);
    uint32_t id = 7;
    if (strcmp(t, "inline") == 0) {
        /* Everything, terminal call included, before generate returns. */
        BACKEND_CHECK(b, api_stream_send_chunk(st, &id, 1, "a", 1) == STRATA_OK);
        BACKEND_CHECK(b, api_stream_send_chunk(st, &id, 1, "b", 1) == STRATA_OK);
        api_stream_complete(st, STRATA__V1__FINISH_REASON__FINISH_REASON_STOP, 6, 2, 1);
    } else if (strcmp(t, "badutf8") == 0) {
        int rc = api_stream_send_chunk(st, &id, 1, "\xc3\x28", 2);
        pthread_mutex_lock(&b->mu);
        b->chunk_rc = rc;
        pthread_mutex_unlock(&b->mu);
        BACKEND_CHECK(b, api_stream_send_chunk(st, &id, 1, "ok", 2) == STRATA_OK);
        api_stream_complete(st, STRATA__V1__FINISH_REASON__FINISH_REASON_LENGTH, 7, 1, 0);
    } else if (strcmp(t, "finish") == 0) {
        api_stream_finish(st); /* without a cancel: a backend bug, reported as INTERNAL */
    } else if (strcmp(t, "failnl") == 0) {
        api_stream_fail(st, STRATA_EFULL, "line one\nline two");
    } else if (strcmp(t, "failok") == 0) {
        api_stream_fail(st, STRATA_OK, NULL);
    } else if (strcmp(t, "midfail") == 0) {
        BACKEND_CHECK(b, api_stream_send_chunk(st, &id, 1, "x", 1) == STRATA_OK);
        api_stream_fail(st, STRATA_ECRC, "kv block crc mismatch");
    } else if (strcmp(t, "refuse") == 0) {
        return strata_fail(err, STRATA_EUNSUPPORTED, "kv codec \"zzz\" is not supported");
    } else if (strcmp(t, "hold") == 0 || strcmp(t, "holdsilent") == 0) {
        pthread_mutex_lock(&b->mu);
        b->held = st;
        pthread_mutex_unlock(&b->mu);
        if (strcmp(t, "hold") == 0)
            BACKEND_CHECK(b, api_stream_send_chunk(st, &id, 1, "h", 1) == STRATA_OK);
    } else {
        return strata_fail(err, STRATA_EINVAL, "unknown test prompt");
    }
    return STRATA_OK;
}

static void cb_cancel(void *ctx, api_stream *st)
{
    cbackend *b = ctx;
    pthread_mutex_lock(&b->mu);
    b->cancels++;
    bool mine = b->held == st;
    if (mine)
        b->held = NULL;
    pthread_mutex_unlock(&b->mu);
    if (mine)
        api_stream_finish(st); /* the terminal call from inside cancel */
}

static bool cb_abort(void *ctx, const char *id)
{
    (void)ctx;
    (void)id;
    return false;
}

static int cb_stats(void *ctx, Strata__V1__Stats *out, strata_error *err)
{
    (void)ctx;
    (void)err;
    /* Claims more tiers than exist: the server clamps to API_STATS_MAX_TIERS. */
    out->n_tiers = API_STATS_MAX_TIERS + 5;
    for (size_t i = 0; i < API_STATS_MAX_TIERS; i++)
        out->tiers[i]->name = (char *)"device";
    out->requests_total = 42;
    return STRATA_OK;
}

/* Fills the whole message buffer the server provides; the server packs it after the return. */
static int cb_drain(void *ctx, const char *worker, Strata__V1__DrainWorkerResponse *out, strata_error *err)
{
    (void)ctx;
    (void)err;
    out->done = true;
    out->moved = 3;
    memset(out->message, 'm', API_DRAIN_MESSAGE_BYTES - 1);
    out->message[API_DRAIN_MESSAGE_BYTES - 1] = '\0';
    memcpy(out->message, worker, strlen(worker));
    return STRATA_OK;
}

static api_backend make_backend(cbackend *b)
{
    memset(b, 0, sizeof *b);
    pthread_mutex_init(&b->mu, NULL);
    api_backend be = {.ctx = b, .generate = cb_generate, .cancel = cb_cancel, .abort = cb_abort, .stats = cb_stats,
                      .drain_worker = cb_drain};
    return be;
}

/* ---- a minimal C-core client ---- */

typedef struct result {
    grpc_status_code status;
    char details[512];
    int n;                               /* responses received */
    Strata__V1__GenerateResponse *msg[16];
} result;

static void result_free(result *r)
{
    for (int i = 0; i < r->n; i++)
        protobuf_c_message_free_unpacked(&r->msg[i]->base, NULL);
    r->n = 0;
}

typedef struct call_sink {
    result *r;
    ProtobufCMessage **unary_out;
} call_sink;

static void keep_response(void *user, ProtobufCMessage *m)
{
    call_sink *k = user;
    if (k->unary_out) {
        *k->unary_out = m;
    } else {
        assert_true(k->r->n < 16);
        k->r->msg[k->r->n++] = (Strata__V1__GenerateResponse *)m;
    }
}

/* Calls method with the packed request msg (NULL: empty message); for Generate it reads every
 * response into r->msg; for unary methods the single response is unpacked with resp_desc. */
static void call(grpc_channel *ch, const char *method, const ProtobufCMessage *msg, int timeout_ms,
                 const ProtobufCMessageDescriptor *resp_desc, result *r, ProtobufCMessage **unary_out)
{
    memset(r, 0, sizeof *r);
    call_sink k = {r, unary_out};
    api_client_call(ch, method, msg, timeout_ms, resp_desc ? resp_desc : &strata__v1__generate_response__descriptor,
                    keep_response, &k, &r->status, r->details, sizeof r->details);
}

static void generate(grpc_channel *ch, const char *text, int timeout_ms, result *r)
{
    Strata__V1__SamplingParams sp = STRATA__V1__SAMPLING_PARAMS__INIT;
    sp.max_tokens = 4;
    Strata__V1__GenerateRequest req = STRATA__V1__GENERATE_REQUEST__INIT;
    req.input_case = STRATA__V1__GENERATE_REQUEST__INPUT_TEXT;
    req.text = (char *)text;
    req.sampling = &sp;
    call(ch, "/strata.v1.Strata/Generate", &req.base, timeout_ms, NULL, r, NULL);
}

typedef struct fixture {
    cbackend b;
    api_server *srv;
    grpc_channel *ch;
} fixture;

static void fixture_start(fixture *f, uint32_t max_streams)
{
    api_backend be = make_backend(&f->b);
    api_server_options o = api_server_options_default();
    o.listen_addr = "127.0.0.1:0";
    o.max_streams = max_streams;
    strata_error err = {0};
    assert_int_equal(api_server_start(&o, &be, &f->srv, &err), STRATA_OK);
    f->ch = api_client_channel(api_server_port(f->srv));
}

static void fixture_stop(fixture *f, int drain_ms)
{
    grpc_channel_destroy(f->ch);
    api_server_shutdown(f->srv, drain_ms);
    assert_int_equal(f->b.bad, 0);
    pthread_mutex_destroy(&f->b.mu);
}

/* ---- tests ---- */

static void test_terminal_inside_generate(void **state)
{
    (void)state;
    fixture f;
    fixture_start(&f, 0);
    result r;
    generate(f.ch, "inline", 5000, &r);
    assert_int_equal(r.status, GRPC_STATUS_OK);
    assert_int_equal(r.n, 3);
    assert_int_equal(r.msg[0]->kind_case, STRATA__V1__GENERATE_RESPONSE__KIND_CHUNK);
    assert_string_equal(r.msg[1]->chunk->text, "b");
    assert_int_equal(r.msg[2]->kind_case, STRATA__V1__GENERATE_RESPONSE__KIND_COMPLETE);
    assert_int_equal(r.msg[2]->complete->finish_reason, STRATA__V1__FINISH_REASON__FINISH_REASON_STOP);
    assert_int_equal(r.msg[2]->complete->prompt_tokens, 6);
    assert_int_equal(r.msg[2]->complete->cached_tokens, 1);
    assert_true(strncmp(r.msg[0]->request_id, "srv-", 4) == 0);
    assert_string_equal(r.msg[0]->request_id, r.msg[2]->request_id);
    result_free(&r);
    fixture_stop(&f, 0);
}

static void test_invalid_utf8_chunk_refused(void **state)
{
    (void)state;
    fixture f;
    fixture_start(&f, 0);
    result r;
    generate(f.ch, "badutf8", 5000, &r);
    assert_int_equal(f.b.chunk_rc, STRATA_EINVAL);
    assert_int_equal(r.status, GRPC_STATUS_OK);
    assert_int_equal(r.n, 2);
    assert_string_equal(r.msg[0]->chunk->text, "ok");
    result_free(&r);
    fixture_stop(&f, 0);
}

/* Bytes that are no request: INTERNAL naming the message type (what gRPC's own servers answer
 * to a request they cannot parse; coordinator/server/README.md), on every method, and the server
 * goes on serving. */
static void test_malformed_request(void **state)
{
    (void)state;
    fixture f;
    fixture_start(&f, 0);
    static const uint8_t junk[] = {0x0a, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80};
    static const struct {
        const char *method, *request;
        const ProtobufCMessageDescriptor *response;
    } calls[] = {
        {"/strata.v1.Strata/Generate", "strata.v1.GenerateRequest", &strata__v1__generate_response__descriptor},
        {"/strata.v1.Strata/Abort", "strata.v1.AbortRequest", &strata__v1__abort_response__descriptor},
        {"/strata.v1.Strata/Health", "strata.v1.HealthRequest", &strata__v1__health_response__descriptor},
        {"/strata.v1.Strata/GetStats", "strata.v1.StatsRequest", &strata__v1__stats__descriptor},
    };
    for (size_t i = 0; i < sizeof calls / sizeof *calls; i++) {
        result r;
        memset(&r, 0, sizeof r);
        ProtobufCMessage *unary = NULL;
        call_sink k = {&r, i ? &unary : NULL};
        api_client_call_raw(f.ch, calls[i].method, junk, sizeof junk, 5000, calls[i].response, keep_response, &k,
                            &r.status, r.details, sizeof r.details);
        char want[96];
        snprintf(want, sizeof want, "%s: malformed message", calls[i].request);
        if (r.status != GRPC_STATUS_INTERNAL || !strstr(r.details, want))
            fail_msg("%s: status %d '%s'", calls[i].method, r.status, r.details);
        if (unary)
            protobuf_c_message_free_unpacked(unary, NULL);
        assert_int_equal(r.n, 0);
        assert_null(unary);
        result_free(&r);
    }
    result r;
    generate(f.ch, "inline", 5000, &r);
    assert_int_equal(r.status, GRPC_STATUS_OK);
    result_free(&r);
    fixture_stop(&f, 0);
}

static void test_fail_forms(void **state)
{
    (void)state;
    fixture f;
    fixture_start(&f, 0);
    result r;
    generate(f.ch, "finish", 5000, &r);
    assert_int_equal(r.status, GRPC_STATUS_INTERNAL);
    assert_string_equal(r.details, "backend ended the request without a result");
    assert_int_equal(r.n, 0);
    result_free(&r);
    generate(f.ch, "failnl", 5000, &r);
    assert_int_equal(r.status, GRPC_STATUS_RESOURCE_EXHAUSTED);
    assert_string_equal(r.details, "line one line two");
    result_free(&r);
    generate(f.ch, "failok", 5000, &r);
    assert_int_equal(r.status, GRPC_STATUS_UNKNOWN);
    assert_true(r.details[0] != 0);
    result_free(&r);
    generate(f.ch, "refuse", 5000, &r);
    assert_int_equal(r.status, GRPC_STATUS_UNIMPLEMENTED);
    assert_string_equal(r.details, "kv codec \"zzz\" is not supported");
    result_free(&r);
    /* After a chunk, a failure is an Error message and status OK. */
    generate(f.ch, "midfail", 5000, &r);
    assert_int_equal(r.status, GRPC_STATUS_OK);
    assert_int_equal(r.n, 2);
    assert_int_equal(r.msg[1]->kind_case, STRATA__V1__GENERATE_RESPONSE__KIND_ERROR);
    assert_int_equal(r.msg[1]->error->code, GRPC_STATUS_UNAVAILABLE);
    assert_string_equal(r.msg[1]->error->message, "kv block crc mismatch");
    result_free(&r);
    fixture_stop(&f, 0);
}

static void test_cancel_releases_slot(void **state)
{
    (void)state;
    fixture f;
    fixture_start(&f, 1);
    result r;
    /* The deadline passes while the backend holds the stream: cancel, finish inside cancel. */
    generate(f.ch, "hold", 300, &r);
    assert_int_equal(r.status, GRPC_STATUS_DEADLINE_EXCEEDED);
    result_free(&r);
    int64_t t0 = now_ms();
    for (;;) {
        pthread_mutex_lock(&f.b.mu);
        int c = f.b.cancels;
        pthread_mutex_unlock(&f.b.mu);
        if (c == 1)
            break;
        assert_true(now_ms() - t0 < 5000);
        usleep(5000);
    }
    /* The only stream slot comes back once the stream is released. */
    t0 = now_ms();
    for (;;) {
        generate(f.ch, "inline", 5000, &r);
        result_free(&r);
        if (r.status == GRPC_STATUS_OK)
            break;
        assert_int_equal(r.status, GRPC_STATUS_RESOURCE_EXHAUSTED);
        assert_true(now_ms() - t0 < 5000);
        usleep(5000);
    }
    assert_null(f.b.held);
    fixture_stop(&f, 0);
}

/* DrainWorker's message is written by the backend into the server's buffer (nothing the backend
 * may change after the call is referenced), up to API_DRAIN_MESSAGE_BYTES - 1 bytes. */
static void test_drain_message(void **state)
{
    (void)state;
    fixture f;
    fixture_start(&f, 0);
    Strata__V1__DrainWorkerRequest req = STRATA__V1__DRAIN_WORKER_REQUEST__INIT;
    req.worker_name = (char *)"gpu-3";
    result r;
    ProtobufCMessage *m = NULL;
    call(f.ch, "/strata.v1.Strata/DrainWorker", &req.base, 5000, &strata__v1__drain_worker_response__descriptor, &r, &m);
    assert_int_equal(r.status, GRPC_STATUS_OK);
    assert_non_null(m);
    Strata__V1__DrainWorkerResponse *d = (Strata__V1__DrainWorkerResponse *)m;
    assert_true(d->done);
    assert_int_equal(d->moved, 3);
    assert_int_equal(strlen(d->message), API_DRAIN_MESSAGE_BYTES - 1);
    assert_memory_equal(d->message, "gpu-3mmm", 8);
    protobuf_c_message_free_unpacked(m, NULL);
    fixture_stop(&f, 0);
}

static void test_optional_callbacks(void **state)
{
    (void)state;
    fixture f;
    fixture_start(&f, 0);
    result r;
    ProtobufCMessage *m = NULL;
    call(f.ch, "/strata.v1.Strata/Health", NULL, 5000, &strata__v1__health_response__descriptor, &r, &m);
    assert_int_equal(r.status, GRPC_STATUS_OK);
    assert_non_null(m);
    assert_int_equal(((Strata__V1__HealthResponse *)m)->status, STRATA__V1__SERVING_STATUS__SERVING_STATUS_SERVING);
    protobuf_c_message_free_unpacked(m, NULL);
    m = NULL;
    call(f.ch, "/strata.v1.Strata/GetModelInfo", NULL, 5000, &strata__v1__model_info__descriptor, &r, &m);
    assert_int_equal(r.status, GRPC_STATUS_UNIMPLEMENTED);
    assert_null(m);
    call(f.ch, "/strata.v1.Strata/GetStats", NULL, 5000, &strata__v1__stats__descriptor, &r, &m);
    assert_int_equal(r.status, GRPC_STATUS_OK);
    assert_non_null(m);
    assert_int_equal(((Strata__V1__Stats *)m)->n_tiers, API_STATS_MAX_TIERS);
    assert_int_equal(((Strata__V1__Stats *)m)->requests_total, 42);
    protobuf_c_message_free_unpacked(m, NULL);
    fixture_stop(&f, 0);
}

typedef struct shutdown_arg {
    api_server *srv;
} shutdown_arg;

static void *shutdown_thread(void *p)
{
    shutdown_arg *a = p;
    api_server_shutdown(a->srv, 100);
    return NULL;
}

typedef struct hold_arg {
    grpc_channel *ch;
    const char *prompt;
} hold_arg;

static void *hold_client(void *p)
{
    hold_arg *a = p;
    result *r = malloc(sizeof *r);
    generate(a->ch, a->prompt, 20000, r);
    return r;
}

/* Shutdown while the backend holds a stream that has sent a chunk ("hold") or nothing
 * ("holdsilent"): the drain runs out, the stream ends as the Generate contract says for a
 * failure after / before output. */
static void shutdown_with_held_stream(const char *prompt)
{
    fixture f;
    fixture_start(&f, 0);
    pthread_t client;
    hold_arg ha = {f.ch, prompt};
    pthread_create(&client, NULL, hold_client, &ha);
    int64_t t0 = now_ms();
    for (;;) {
        pthread_mutex_lock(&f.b.mu);
        bool held = f.b.held != NULL;
        pthread_mutex_unlock(&f.b.mu);
        if (held)
            break;
        assert_true(now_ms() - t0 < 5000);
        usleep(2000);
    }
    /* Shutdown from another thread: drain 100 ms, then UNAVAILABLE and cancel (the backend
     * finishes inside cancel). */
    t0 = now_ms();
    shutdown_arg a = {f.srv};
    pthread_t sd;
    pthread_create(&sd, NULL, shutdown_thread, &a);
    result *r;
    pthread_join(client, (void **)&r);
    pthread_join(sd, NULL);
    assert_true(now_ms() - t0 < 3000);
    if (strcmp(prompt, "hold") == 0) {
        /* The chunk sent before, then an Error message and status OK: output had started. */
        assert_int_equal(r->status, GRPC_STATUS_OK);
        assert_int_equal(r->n, 2);
        assert_int_equal(r->msg[0]->kind_case, STRATA__V1__GENERATE_RESPONSE__KIND_CHUNK);
        assert_int_equal(r->msg[1]->kind_case, STRATA__V1__GENERATE_RESPONSE__KIND_ERROR);
        assert_int_equal(r->msg[1]->error->code, GRPC_STATUS_UNAVAILABLE);
        assert_string_equal(r->msg[1]->error->message, "server shutting down");
    } else {
        assert_int_equal(r->status, GRPC_STATUS_UNAVAILABLE);
        assert_string_equal(r->details, "server shutting down");
        assert_int_equal(r->n, 0);
    }
    assert_int_equal(f.b.cancels, 1);
    assert_int_equal(f.b.bad, 0);
    result_free(r);
    free(r);
    grpc_channel_destroy(f.ch);
    pthread_mutex_destroy(&f.b.mu);
}

static void test_shutdown_with_held_stream(void **state)
{
    (void)state;
    shutdown_with_held_stream("hold");
    shutdown_with_held_stream("holdsilent");
}

static void test_start_errors(void **state)
{
    (void)state;
    cbackend b;
    api_backend be = make_backend(&b);
    api_server *srv = (api_server *)1;
    strata_error err = {0};
    api_server_options o = api_server_options_default();
    assert_string_equal(o.listen_addr, API_SERVER_DEFAULT_ADDR);
    assert_int_equal(o.max_streams, API_SERVER_DEFAULT_MAX_STREAMS);
    assert_int_equal(o.max_recv_bytes, 2 << 20);

    o.listen_addr = "127.0.0.1:0";
    o.tls_cert_file = "/nonexistent.pem";
    assert_int_equal(api_server_start(&o, &be, &srv, &err), STRATA_EINVAL);
    assert_null(srv);
    assert_non_null(strstr(err.msg, "both"));
    o.tls_key_file = "/nonexistent-key.pem";   /* a file the user named: EINVAL, as a bad one */
    assert_int_equal(api_server_start(&o, &be, &srv, &err), STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "cannot read the TLS certificate /nonexistent.pem"));
    o.tls_cert_file = o.tls_key_file = NULL;

    o.bearer_token = "has space";
    assert_int_equal(api_server_start(&o, &be, &srv, &err), STRATA_EINVAL);
    o.bearer_token = NULL;
    o.threads = 1000;
    assert_int_equal(api_server_start(&o, &be, &srv, &err), STRATA_EINVAL);
    o.threads = 0;

    api_backend no_cancel = be;
    no_cancel.cancel = NULL;
    assert_int_equal(api_server_start(&o, &no_cancel, &srv, &err), STRATA_EINVAL);

    o.listen_addr = "not an address";
    assert_int_equal(api_server_start(&o, &be, &srv, &err), STRATA_EIO);
    /* (the resolver's words vary with the host: "Name or service not known" here) */
    assert_non_null(strstr(err.msg, "cannot listen on not an address: "));
    assert_null(strstr(err.msg, "gRPC gave no reason"));
    assert_null(strchr(err.msg, '{'));   /* the reason, not gRPC's whole error record */

    /* A taken port is an error (SO_REUSEPORT is off). */
    o.listen_addr = "127.0.0.1:0";
    api_server *first;
    assert_int_equal(api_server_start(&o, &be, &first, &err), STRATA_OK);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", api_server_port(first));
    o.listen_addr = addr;
    assert_int_equal(api_server_start(&o, &be, &srv, &err), STRATA_EIO);
    assert_null(srv);
    char want[160];   /* gRPC's reason, from its error record */
    snprintf(want, sizeof want, "cannot listen on %s: bind: Address already in use", addr);
    assert_string_equal(err.msg, want);
    int64_t t0 = now_ms();
    api_server_shutdown(first, 5000); /* nothing in flight: returns at once */
    assert_true(now_ms() - t0 < 2000);
    api_server_shutdown(NULL, 0);
    pthread_mutex_destroy(&b.mu);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_terminal_inside_generate),
        cmocka_unit_test(test_invalid_utf8_chunk_refused),
        cmocka_unit_test(test_fail_forms),
        cmocka_unit_test(test_malformed_request),
        cmocka_unit_test(test_cancel_releases_slot),
        cmocka_unit_test(test_drain_message),
        cmocka_unit_test(test_optional_callbacks),
        cmocka_unit_test(test_shutdown_with_held_stream),
        cmocka_unit_test(test_start_errors),
    };
    grpc_init();
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    grpc_shutdown();
    return rc;
}
