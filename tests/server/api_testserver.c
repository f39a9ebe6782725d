/* api_testserver: the API server layer (coordinator/server) over a deterministic TEST BACKEND.
 *
 * This is a test double, not the product: it exists so that tests/server/test_api.py can drive
 * the real gRPC server (network, validation, streaming, backpressure, cancellation, auth, TLS,
 * shutdown) with a real client without a model or a scheduler. It "generates" on its own thread,
 * one token per active request every --tick-ms milliseconds:
 *
 *   token i   = (h + i) % 1000, where h is the 32-bit FNV-1a hash of the prompt (the text's
 *               bytes, or the token ids as 4-byte little-endian words)
 *   text      = "t<token> "
 *   prompt_tokens = bytes of text, or the number of token ids
 *   stop      = when a token is in sampling.stop_token_ids (that token included: STOP), or after
 *               sampling.max_tokens tokens (LENGTH); Abort ends the stream with ABORT.
 *
 * Prompts starting with these words select test behaviours:
 *   "reject"     generate refuses the request: STRATA_EFULL -> RESOURCE_EXHAUSTED
 *   "earlyfail"  fails with STRATA_EIO before any chunk -> gRPC status UNAVAILABLE
 *   "midfail"    fails with STRATA_EIO after 3 chunks -> Error{14} message, then status OK
 *   "flood"      sends 64 chunks of 1 KiB text per tick (to overflow a client that does not read)
 *
 * GetStats reports the backend's counters; test-only mapping of fields the test server has no
 * use for: `spills` = cancel callbacks received, `restores` = aborts that found their request.
 * `requests_total` = accepted Generate calls, `running` = requests held, `tokens_generated`.
 *
 * Usage: api_testserver [--listen ADDR] [--tls-cert PEM --tls-key PEM] [--token T]
 *                       [--auth-health] [--max-streams N] [--max-queue N] [--threads N]
 *                       [--tick-ms N] [--drain-ms N]
 * Prints "port N" on stdout once serving; on SIGTERM or SIGINT shuts down with
 * api_server_shutdown(server, drain-ms) and exits 0. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "coordinator/server/api_server.h"

typedef enum { MODE_NORMAL, MODE_MIDFAIL, MODE_EARLYFAIL, MODE_FLOOD } req_mode;

typedef struct treq {
    struct treq *next;
    api_stream *stream;
    uint32_t hash;
    uint32_t max_tokens, produced, prompt_tokens;
    uint32_t *stop_ids;
    size_t n_stop;
    char id[PROTO_MAX_REQUEST_ID_BYTES + 1];
    req_mode mode;
    bool abort, cancel;
} treq;

typedef struct tbackend {
    pthread_mutex_t mu;
    pthread_cond_t cond;
    treq *head;
    bool stop;
    int tick_ms;
    pthread_t thread;
    uint64_t requests_total, tokens, cancels, aborts;
    uint32_t running;
} tbackend;

static uint32_t fnv1a32(const void *p, size_t n, uint32_t h)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 16777619u;
    }
    return h;
}

static bool has_prefix(const char *s, const char *p)
{
    return strncmp(s, p, strlen(p)) == 0;
}

static int tb_generate(void *ctx, const Strata__V1__GenerateRequest *req, api_stream *stream, gpr_timespec deadline,
                       strata_error *err)
{
    (void)deadline; /* the server cancels the stream when it passes */
    tbackend *b = ctx;
    const char *text = req->input_case == STRATA__V1__GENERATE_REQUEST__INPUT_TEXT ? req->text : NULL;
    if (text && has_prefix(text, "reject"))
        return strata_fail(err, STRATA_EFULL, "test backend: queue full (reject requested)");
    treq *r = calloc(1, sizeof *r);
    if (!r)
        return strata_fail(err, STRATA_ENOMEM, "test backend: out of memory");
    r->stream = stream;
    r->hash = 2166136261u;
    if (text) {
        r->hash = fnv1a32(text, strlen(text), r->hash);
        r->prompt_tokens = (uint32_t)strlen(text);
        if (has_prefix(text, "midfail"))
            r->mode = MODE_MIDFAIL;
        else if (has_prefix(text, "earlyfail"))
            r->mode = MODE_EARLYFAIL;
        else if (has_prefix(text, "flood"))
            r->mode = MODE_FLOOD;
    } else {
        for (size_t i = 0; i < req->token_ids->n_ids; i++) {
            uint32_t v = req->token_ids->ids[i];
            unsigned char le[4] = {(unsigned char)v, (unsigned char)(v >> 8), (unsigned char)(v >> 16),
                                   (unsigned char)(v >> 24)};
            r->hash = fnv1a32(le, 4, r->hash);
        }
        r->prompt_tokens = (uint32_t)req->token_ids->n_ids;
    }
    r->max_tokens = req->sampling->max_tokens;
    r->n_stop = req->sampling->n_stop_token_ids;
    if (r->n_stop) {
        r->stop_ids = malloc(r->n_stop * sizeof *r->stop_ids);
        if (!r->stop_ids) {
            free(r);
            return strata_fail(err, STRATA_ENOMEM, "test backend: out of memory");
        }
        memcpy(r->stop_ids, req->sampling->stop_token_ids, r->n_stop * sizeof *r->stop_ids);
    }
    snprintf(r->id, sizeof r->id, "%s", api_stream_request_id(stream));
    pthread_mutex_lock(&b->mu);
    r->next = b->head;
    b->head = r;
    b->requests_total++;
    b->running++;
    pthread_mutex_unlock(&b->mu);
    return STRATA_OK;
}

static void tb_cancel(void *ctx, api_stream *stream)
{
    tbackend *b = ctx;
    pthread_mutex_lock(&b->mu);
    b->cancels++;
    for (treq *r = b->head; r; r = r->next)
        if (r->stream == stream)
            r->cancel = true; /* the generation thread finishes it on its next tick */
    pthread_mutex_unlock(&b->mu);
}

static bool tb_abort(void *ctx, const char *request_id)
{
    tbackend *b = ctx;
    bool found = false;
    pthread_mutex_lock(&b->mu);
    for (treq *r = b->head; r; r = r->next)
        if (!r->abort && !r->cancel && strcmp(r->id, request_id) == 0) {
            r->abort = true;
            found = true;
        }
    if (found)
        b->aborts++;
    pthread_mutex_unlock(&b->mu);
    return found;
}

static int tb_health(void *ctx, Strata__V1__HealthResponse *out, strata_error *err)
{
    (void)ctx;
    (void)err;
    out->status = STRATA__V1__SERVING_STATUS__SERVING_STATUS_SERVING;
    out->workers_ready = 1;
    out->workers_total = 1;
    return STRATA_OK;
}

static int tb_model_info(void *ctx, Strata__V1__ModelInfo *out, strata_error *err)
{
    (void)ctx;
    (void)err;
    out->name = (char *)"api-testserver";
    out->arch = (char *)"test";
    out->n_layers = 2;
    out->n_embd = 64;
    out->n_heads = 4;
    out->n_kv_heads = 2;
    out->head_dim = 16;
    out->n_vocab = 1000;
    out->n_ctx = 4096;
    out->default_kv_codec = (char *)"fp16";
    out->replicas = 1;
    out->stages_per_replica = 1;
    out->block_tokens = 64;
    return STRATA_OK;
}

static int tb_stats(void *ctx, Strata__V1__Stats *out, strata_error *err)
{
    (void)err;
    tbackend *b = ctx;
    pthread_mutex_lock(&b->mu);
    out->requests_total = b->requests_total;
    out->tokens_generated = b->tokens;
    out->running = b->running;
    out->spills = b->cancels;  /* test mapping, see the file comment */
    out->restores = b->aborts; /* test mapping */
    out->n_tiers = 1;
    out->tiers[0]->name = (char *)"device";
    out->tiers[0]->blocks = b->running;
    out->tiers[0]->bytes = 0;
    out->tiers[0]->capacity_bytes = 1u << 20;
    pthread_mutex_unlock(&b->mu);
    return STRATA_OK;
}

/* Under b->mu. true when r is finished (its terminal call made). */
static bool tb_step(tbackend *b, treq *r)
{
    if (r->cancel) {
        api_stream_finish(r->stream);
        return true;
    }
    if (r->abort) {
        api_stream_complete(r->stream, STRATA__V1__FINISH_REASON__FINISH_REASON_ABORT, r->prompt_tokens, r->produced,
                            0);
        return true;
    }
    if (r->mode == MODE_EARLYFAIL) {
        api_stream_fail(r->stream, STRATA_EIO, "test backend: worker lost before the first token");
        return true;
    }
    if (r->mode == MODE_MIDFAIL && r->produced == 3) {
        api_stream_fail(r->stream, STRATA_EIO, "test backend: worker lost");
        return true;
    }
    int per_tick = r->mode == MODE_FLOOD ? 64 : 1;
    for (int k = 0; k < per_tick; k++) {
        uint32_t tok = (r->hash + r->produced) % 1000;
        char text[1100];
        int len = snprintf(text, sizeof text, "t%" PRIu32 " ", tok);
        if (r->mode == MODE_FLOOD) {
            memset(text + len, 'x', 1024);
            len += 1024;
        }
        int rc = api_stream_send_chunk(r->stream, &tok, 1, text, (size_t)len);
        if (rc != STRATA_OK) {
            /* Nobody listens any more (cancel follows): stop producing, wait for it. */
            return false;
        }
        r->produced++;
        b->tokens++;
        for (size_t i = 0; i < r->n_stop; i++)
            if (r->stop_ids[i] == tok) {
                api_stream_complete(r->stream, STRATA__V1__FINISH_REASON__FINISH_REASON_STOP, r->prompt_tokens,
                                    r->produced, 0);
                return true;
            }
        if (r->produced >= r->max_tokens) {
            api_stream_complete(r->stream, STRATA__V1__FINISH_REASON__FINISH_REASON_LENGTH, r->prompt_tokens,
                                r->produced, 0);
            return true;
        }
    }
    return false;
}

static void *tb_thread(void *arg)
{
    tbackend *b = arg;
    pthread_mutex_lock(&b->mu);
    while (!b->stop) {
        for (treq **p = &b->head; *p;) {
            treq *r = *p;
            if (tb_step(b, r)) {
                *p = r->next;
                b->running--;
                free(r->stop_ids);
                free(r);
            } else {
                p = &r->next;
            }
        }
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        t.tv_nsec += (long)b->tick_ms * 1000000L;
        while (t.tv_nsec >= 1000000000L) {
            t.tv_sec++;
            t.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&b->cond, &b->mu, &t);
    }
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

static void usage(void)
{
    fprintf(stderr, "usage: api_testserver [--listen ADDR] [--tls-cert PEM --tls-key PEM] [--token T] "
                    "[--auth-health] [--max-streams N] [--max-queue N] [--threads N] [--tick-ms N] "
                    "[--drain-ms N]\n");
    exit(2);
}

static long num_arg(const char *s)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < 0 || v > 1000000000L)
        usage();
    return v;
}

int main(int argc, char **argv)
{
    api_server_options o = api_server_options_default();
    o.listen_addr = "127.0.0.1:0";
    int tick_ms = 5, drain_ms = 2000;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--auth-health") == 0) {
            o.auth_health = true;
            continue;
        }
        if (i + 1 >= argc)
            usage();
        const char *v = argv[++i];
        if (strcmp(a, "--listen") == 0)
            o.listen_addr = v;
        else if (strcmp(a, "--tls-cert") == 0)
            o.tls_cert_file = v;
        else if (strcmp(a, "--tls-key") == 0)
            o.tls_key_file = v;
        else if (strcmp(a, "--token") == 0)
            o.bearer_token = v;
        else if (strcmp(a, "--max-streams") == 0)
            o.max_streams = (uint32_t)num_arg(v);
        else if (strcmp(a, "--max-queue") == 0)
            o.max_queued_messages = (uint32_t)num_arg(v);
        else if (strcmp(a, "--threads") == 0)
            o.threads = (uint32_t)num_arg(v);
        else if (strcmp(a, "--tick-ms") == 0)
            tick_ms = (int)num_arg(v);
        else if (strcmp(a, "--drain-ms") == 0)
            drain_ms = (int)num_arg(v);
        else
            usage();
    }
    proto_generate_limits lim = proto_generate_limits_default(100000, 1000);
    o.limits = &lim;

    /* Block the stop signals in every thread (gRPC's threads inherit the mask) and take them
     * with sigwait below: shutdown runs on an ordinary thread, not in a signal handler. */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);

    tbackend tb;
    memset(&tb, 0, sizeof tb);
    pthread_mutex_init(&tb.mu, NULL);
    pthread_cond_init(&tb.cond, NULL);
    tb.tick_ms = tick_ms > 0 ? tick_ms : 1;
    if (pthread_create(&tb.thread, NULL, tb_thread, &tb) != 0) {
        fprintf(stderr, "api_testserver: cannot start the backend thread\n");
        return 1;
    }
    api_backend be = {
        .ctx = &tb,
        .generate = tb_generate,
        .cancel = tb_cancel,
        .abort = tb_abort,
        .health = tb_health,
        .model_info = tb_model_info,
        .stats = tb_stats,
    };
    api_server *srv;
    strata_error err = {0};
    int rc = api_server_start(&o, &be, &srv, &err);
    if (rc) {
        fprintf(stderr, "api_testserver: %s\n", err.msg);
        pthread_mutex_lock(&tb.mu);
        tb.stop = true;
        pthread_cond_signal(&tb.cond);
        pthread_mutex_unlock(&tb.mu);
        pthread_join(tb.thread, NULL);
        return 1;
    }
    printf("port %d\n", api_server_port(srv));
    fflush(stdout);

    int sig = 0;
    sigwait(&set, &sig);
    fprintf(stderr, "api_testserver: signal %d, shutting down (drain %d ms)\n", sig, drain_ms);
    api_server_shutdown(srv, drain_ms);

    /* Every stream was released before api_server_shutdown returned: nothing is left. */
    pthread_mutex_lock(&tb.mu);
    tb.stop = true;
    pthread_cond_signal(&tb.cond);
    pthread_mutex_unlock(&tb.mu);
    pthread_join(tb.thread, NULL);
    int left = 0;
    while (tb.head) {
        treq *r = tb.head;
        tb.head = r->next;
        free(r->stop_ids);
        free(r);
        left++;
    }
    pthread_cond_destroy(&tb.cond);
    pthread_mutex_destroy(&tb.mu);
    if (left) {
        fprintf(stderr, "api_testserver: %d request(s) still held after shutdown\n", left);
        return 1;
    }
    fprintf(stderr, "api_testserver: stopped\n");
    return 0;
}
