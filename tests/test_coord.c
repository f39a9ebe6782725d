/* The coordinator's core (coordinator/service/coord*.c) with everything real but the workers: the
 * real control server and public API server on loopback, a real gRPC client, the real model's
 * configuration and tokenizer; the workers are scripted control-plane peers in this process (a
 * ctl_client each) that answer step plans with a fixed token after a short delay and answer,
 * fail or hold migrations as a test asks. So the corners of migration and drain that a real
 * worker cannot be made to reach on demand are driven here: a migration that fails without
 * moving (the request stays, and is not retried), one whose destination could be filled meanwhile
 * (nothing new is routed there), a replica lost in its own drain (it serves again once rebuilt),
 * a destination lost mid-move (the source goes on at once), and a drained worker that comes back
 * under its name (a new drain). serve_e2e runs the same paths with real workers. */
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

#include "tests/test_time.h"
#include "coordinator/service/coord.h"
#include "kvstore/plan.h"
#include "tests/api_client.h"
#include "worker/control/control_client.h"
#include "worker/model.h"

static const char SECRET[] = "strata-test-cluster-secret-0123456789";
#define BLOCK_TOKENS 16
#define PROMPT_TOKENS 4
#define FAKE_TOKEN 282u /* an ordinary word piece of the model's vocabulary: never a stop token */
#define MAX_FAKES 4

/* ---- scripted workers ---- */

typedef enum { MIG_OK, MIG_FAIL, MIG_HOLD, MIG_WRONG_SEQ } mig_mode;

typedef struct fake {
    char name[32];
    int port;
    uint64_t device_kv_bytes, host_kv_bytes, nvme_kv_bytes;
    pthread_t thread;
    pthread_mutex_t mu;
    /* behaviour (set by the test) */
    int step_ms;
    mig_mode mig;
    bool release; /* a held MigrateDone may go */
    bool kill;    /* end the stream now, as a worker that dies */
    bool fail_preempt; /* answer every preemption with a failed spill */
    bool fail_prefix_copies; /* answer every work that starts from a prefix entry with a failure */
    uint32_t fail_steps;     /* nonzero: answer every work with this status, as a stage refusing it */
    uint32_t bad_token;      /* nonzero: sample this token (outside the vocabulary) instead */
    bool answer_twice;       /* send every StepResult twice, as a faulty worker */
    int32_t step_offset;     /* answer step N as step N + step_offset, as a worker out of step */
    bool silent;             /* answer no step (its stream alive), as a worker on a hung device */
    /* what it saw */
    bool assigned;
    uint32_t step_timeout_ms;   /* as its Assignment said */
    uint32_t replica;
    int plans;
    int preempts;
    int migrates_send, migrates_recv;
    int parks, prefix_copies;   /* PrefixPark entries and SeqWork.prefix_entry copies seen */
    /* the last chunk of a recovered sequence's prompt (SeqWork.sampled_before > 0 on its first
     * sampling work): where it starts and ends, its sampled_before, and whether it holds the
     * request's prompt (gen_main's ids) and then the tokens sampled, each at its position */
    int replay_prompt;   /* set by the test: the prompt's length (0: PROMPT_TOKENS) */
    int replay_pos0, replay_tokens, replay_sampled_before;
    bool replay_ok;
    bool shutdown, shutdown_drain;
    uint64_t seqs[64];
    int n_seqs;
    bool ended;
    bool connected;
    char error[600];
} fake;

static void fake_send(fake *f, ctl_client *cli, Strata__Internal__V1__WorkerMessage *m)
{
    strata_error err = {0};
    if (ctl_client_send(cli, m, &err) != STRATA_OK) {
        pthread_mutex_lock(&f->mu);
        snprintf(f->error, sizeof f->error, "send: %s", err.msg);
        pthread_mutex_unlock(&f->mu);
    }
}

static void fake_migrate_done(fake *f, ctl_client *cli, uint64_t seq, uint32_t status)
{
    Strata__Internal__V1__MigrateDone d = STRATA__INTERNAL__V1__MIGRATE_DONE__INIT;
    d.seq_id = seq;
    d.status = status;
    d.message = status ? (char *)"link refused by the scripted worker" : (char *)"";
    Strata__Internal__V1__WorkerMessage m = STRATA__INTERNAL__V1__WORKER_MESSAGE__INIT;
    m.kind_case = STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_MIGRATE_DONE;
    m.migrate_done = &d;
    fake_send(f, cli, &m);
}

/* Token `pos` of gen_main's prompts: four words, then ids 30000 + pos (a 3-byte varint each on
 * the wire). */
static uint32_t gen_prompt_id(uint32_t pos)
{
    static const uint32_t words[PROMPT_TOKENS] = {504, 1115, 314, 253};
    return pos < PROMPT_TOKENS ? words[pos] : 30000 + pos;
}

static void fake_step(fake *f, ctl_client *cli, const Strata__Internal__V1__StepPlan *p)
{
    pthread_mutex_lock(&f->mu);
    int delay = f->step_ms;
    bool fail_preempt = f->fail_preempt, fail_copies = f->fail_prefix_copies;
    uint32_t fail_status = f->fail_steps, token = f->bad_token ? f->bad_token : FAKE_TOKEN;
    bool twice = f->answer_twice;
    const uint64_t step_offset = (uint64_t)(int64_t)f->step_offset;   /* modulo 2^64: N - k for k < 0 */
    const bool silent = f->silent;
    f->plans++;
    f->preempts += (int)p->n_preempt_seqs;
    f->parks += (int)p->n_park_prefixes;
    const uint32_t n_prompt = f->replay_prompt ? (uint32_t)f->replay_prompt : PROMPT_TOKENS;
    for (size_t i = 0; i < p->n_seqs; i++) {
        const Strata__Internal__V1__SeqWork *w = p->seqs[i];
        f->prefix_copies += w->prefix_entry != 0;
        if (w->sampled_before > 0 && w->pos0 + w->n_tokens <= n_prompt + w->sampled_before) {   /* not a decode */
            f->replay_pos0 = (int)w->pos0;
            f->replay_tokens = (int)(w->pos0 + w->n_tokens);
            f->replay_sampled_before = (int)w->sampled_before;
            f->replay_ok = w->pos0 + w->n_tokens == n_prompt + w->sampled_before;
            for (size_t k = 0, pos = w->pos0; k < w->n_tokens; k++, pos++)
                f->replay_ok &= w->tokens[k] == (pos < n_prompt ? gen_prompt_id((uint32_t)pos) : FAKE_TOKEN);
        }
    }
    for (size_t i = 0; i < p->n_seqs; i++) {
        bool seen = false;
        for (int k = 0; k < f->n_seqs; k++)
            seen |= f->seqs[k] == p->seqs[i]->seq_id;
        if (!seen && f->n_seqs < 64)
            f->seqs[f->n_seqs++] = p->seqs[i]->seq_id;
    }
    pthread_mutex_unlock(&f->mu);
    if (silent)
        return;
    sleep_ms(delay);
    const size_t n = p->n_seqs + (fail_preempt ? p->n_preempt_seqs : 0);
    Strata__Internal__V1__SeqResult *rs = calloc(n ? n : 1, sizeof *rs);
    Strata__Internal__V1__SeqResult **rp = calloc(n ? n : 1, sizeof *rp);
    if (!rs || !rp) {   /* no cmocka assert off the test's thread: the worker goes silent instead */
        free(rs);
        free(rp);
        pthread_mutex_lock(&f->mu);
        snprintf(f->error, sizeof f->error, "out of memory");
        pthread_mutex_unlock(&f->mu);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        strata__internal__v1__seq_result__init(&rs[i]);
        rp[i] = &rs[i];
        if (i < p->n_seqs && fail_copies && p->seqs[i]->prefix_entry) {   /* as a stage whose park failed */
            rs[i].seq_id = p->seqs[i]->seq_id;
            rs[i].status = STRATA_EINVAL;
            rs[i].message = (char *)"prefix entry is not on this stage: scripted";
            rs[i].prefix_failed = true;
        } else if (i < p->n_seqs && fail_status) {
            rs[i].seq_id = p->seqs[i]->seq_id;
            rs[i].status = fail_status;
            rs[i].message = (char *)"step refused: scripted";
        } else if (i < p->n_seqs) {
            rs[i].seq_id = p->seqs[i]->seq_id;
            rs[i].token = p->seqs[i]->sample ? token : 0;
        } else {   /* as a stage whose kv_seq_spill failed */
            rs[i].seq_id = p->preempt_seqs[i - p->n_seqs];
            rs[i].status = STRATA_EIO;
            rs[i].message = (char *)"spilling to the host tier failed: scripted";
        }
    }
    Strata__Internal__V1__StepResult r = STRATA__INTERNAL__V1__STEP_RESULT__INIT;
    r.step = p->step + step_offset;
    r.n_results = n;
    r.results = rp;
    Strata__Internal__V1__WorkerMessage m = STRATA__INTERNAL__V1__WORKER_MESSAGE__INIT;
    m.kind_case = STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_STEP_RESULT;
    m.step_result = &r;
    fake_send(f, cli, &m);
    if (twice)
        fake_send(f, cli, &m);
    free(rs);
    free(rp);
}

static void *fake_main(void *arg)
{
    fake *f = arg;
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", f->port);
    Strata__Internal__V1__Join j = STRATA__INTERNAL__V1__JOIN__INIT;
    j.worker_name = f->name;
    j.device = (char *)"cpu";
    j.device_kv_bytes = f->device_kv_bytes;
    j.host_kv_bytes = f->host_kv_bytes;
    j.nvme_kv_bytes = f->nvme_kv_bytes;
    j.data_addr = (char *)"127.0.0.1:9"; /* never dialled: no block moves between scripted workers */
    ctl_client *cli = NULL;
    strata_error err = {0};
    if (ctl_client_connect(addr, SECRET, sizeof SECRET - 1, &j, 5000, &cli, &err) != STRATA_OK) {
        pthread_mutex_lock(&f->mu);
        snprintf(f->error, sizeof f->error, "connect: %s", err.msg);
        f->ended = true;
        pthread_mutex_unlock(&f->mu);
        return NULL;
    }
    pthread_mutex_lock(&f->mu);
    f->connected = true;
    pthread_mutex_unlock(&f->mu);
    bool held = false;
    uint64_t held_seq = 0;
    for (;;) {
        pthread_mutex_lock(&f->mu);
        bool kill = f->kill, go = held && (f->mig == MIG_OK || f->release);
        pthread_mutex_unlock(&f->mu);
        if (kill)
            break;
        if (go) {
            fake_migrate_done(f, cli, held_seq, 0);
            held = false;
        }
        Strata__Internal__V1__CoordinatorMessage *m = NULL;
        int rc = ctl_client_recv(cli, 20, &m, &err);
        if (rc == STRATA_EIO) {
            pthread_mutex_lock(&f->mu);
            snprintf(f->error, sizeof f->error, "recv: %s", err.msg);
            pthread_mutex_unlock(&f->mu);
            break;
        }
        if (!m)
            continue;
        bool stop = false;
        switch (m->kind_case) {
        case STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_ASSIGNMENT: {
            pthread_mutex_lock(&f->mu);
            f->assigned = true;
            f->replica = m->assignment->replica;
            f->step_timeout_ms = m->assignment->step_timeout_ms;
            pthread_mutex_unlock(&f->mu);
            Strata__Internal__V1__KvReport k = STRATA__INTERNAL__V1__KV_REPORT__INIT;
            Strata__Internal__V1__WorkerMessage w = STRATA__INTERNAL__V1__WORKER_MESSAGE__INIT;
            w.kind_case = STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_KV_REPORT;
            w.kv_report = &k;
            fake_send(f, cli, &w);
            break;
        }
        case STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_STEP_PLAN:
            fake_step(f, cli, m->step_plan);
            break;
        case STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_MIGRATE: {
            pthread_mutex_lock(&f->mu);
            mig_mode mode = f->mig;
            if (m->migrate->send)
                f->migrates_send++;
            else
                f->migrates_recv++;
            pthread_mutex_unlock(&f->mu);
            if (mode == MIG_HOLD) {
                held = true;
                held_seq = m->migrate->seq_id;
            } else {
                fake_migrate_done(f, cli, m->migrate->seq_id + (mode == MIG_WRONG_SEQ),
                                  mode == MIG_FAIL ? STRATA_EIO : 0);
            }
            break;
        }
        case STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_SHUTDOWN:
            pthread_mutex_lock(&f->mu);
            f->shutdown = true;
            f->shutdown_drain = m->shutdown->drain;
            pthread_mutex_unlock(&f->mu);
            stop = true;
            break;
        default:
            break;
        }
        protobuf_c_message_free_unpacked(&m->base, NULL);
        if (stop)
            break;
    }
    ctl_client_close(cli);
    pthread_mutex_lock(&f->mu);
    f->ended = true;
    pthread_mutex_unlock(&f->mu);
    return NULL;
}

/* ---- requests through the public API ---- */

typedef struct gen_job {
    grpc_channel *ch;
    uint32_t max_tokens;
    uint32_t prompt_tokens; /* 0: a short prompt of PROMPT_TOKENS */
    pthread_t thread;
    pthread_mutex_t mu;
    int tokens;
    int finish;      /* Complete's reason, 0 until then */
    uint32_t cached; /* Complete's cached_tokens */
    uint32_t error;  /* an Error message's code (after output), 0 if none */
    char error_message[256];
    grpc_status_code status;
    char details[256];
    bool done;
} gen_job;

static void on_generate_response(void *user, ProtobufCMessage *msg)
{
    gen_job *g = user;
    Strata__V1__GenerateResponse *r = (Strata__V1__GenerateResponse *)msg;
    pthread_mutex_lock(&g->mu);
    if (r->kind_case == STRATA__V1__GENERATE_RESPONSE__KIND_CHUNK)
        g->tokens += (int)r->chunk->n_token_ids;
    else if (r->kind_case == STRATA__V1__GENERATE_RESPONSE__KIND_COMPLETE)
    {
        g->finish = r->complete->finish_reason;
        g->cached = r->complete->cached_tokens;
    }
    else if (r->kind_case == STRATA__V1__GENERATE_RESPONSE__KIND_ERROR) {
        g->error = r->error->code;
        snprintf(g->error_message, sizeof g->error_message, "%s", r->error->message);
    }
    pthread_mutex_unlock(&g->mu);
    protobuf_c_message_free_unpacked(msg, NULL);
}

static void *gen_main(void *arg)
{
    gen_job *g = arg;
    uint32_t ids[400];
    uint32_t n = g->prompt_tokens ? g->prompt_tokens : PROMPT_TOKENS;   /* checked by gen_start_prompt */
    for (uint32_t i = 0; i < n; i++)
        ids[i] = gen_prompt_id(i);
    Strata__V1__TokenIds t = STRATA__V1__TOKEN_IDS__INIT;
    t.n_ids = n;
    t.ids = ids;
    Strata__V1__SamplingParams sp = STRATA__V1__SAMPLING_PARAMS__INIT;
    sp.max_tokens = g->max_tokens;
    Strata__V1__GenerateRequest req = STRATA__V1__GENERATE_REQUEST__INIT;
    req.input_case = STRATA__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS;
    req.token_ids = &t;
    req.sampling = &sp;
    grpc_status_code status;
    char details[256];
    api_client_call(g->ch, "/strata.v1.Strata/Generate", &req.base, 60000, &strata__v1__generate_response__descriptor,
                    on_generate_response, g, &status, details, sizeof details);
    pthread_mutex_lock(&g->mu);
    g->status = status;
    snprintf(g->details, sizeof g->details, "%s", details);
    g->done = true;
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

static void gen_start_prompt(gen_job *g, grpc_channel *ch, uint32_t prompt_tokens, uint32_t max_tokens)
{
    assert_true(prompt_tokens <= 400);   /* gen_main's array */
    memset(g, 0, sizeof *g);
    g->ch = ch;
    g->prompt_tokens = prompt_tokens;
    g->max_tokens = max_tokens;
    pthread_mutex_init(&g->mu, NULL);
    assert_int_equal(pthread_create(&g->thread, NULL, gen_main, g), 0);
}

static void gen_start(gen_job *g, grpc_channel *ch, uint32_t max_tokens)
{
    gen_start_prompt(g, ch, 0, max_tokens);
}

static int gen_tokens(gen_job *g)
{
    pthread_mutex_lock(&g->mu);
    int n = g->tokens;
    pthread_mutex_unlock(&g->mu);
    return n;
}

static void gen_join(gen_job *g)
{
    assert_int_equal(pthread_join(g->thread, NULL), 0);
    pthread_mutex_destroy(&g->mu);
}

/* The request ran to its length limit with every token. */
static void assert_complete(gen_job *g)
{
    if (g->status != GRPC_STATUS_OK || g->error || g->finish != STRATA__V1__FINISH_REASON__FINISH_REASON_LENGTH)
        fail_msg("request: status %d (%s), error %u (%s), finish %d", g->status, g->details, g->error, g->error_message,
                 g->finish);
    assert_int_equal(g->tokens, (int)g->max_tokens);
}

/* ---- the fixture: coordinator, control server, API server, scripted workers ---- */

typedef struct fixture {
    coord *co;
    ctl_server *ctl;
    api_server *api;
    grpc_channel *ch;
    uint64_t device_kv_bytes, host_kv_bytes, nvme_kv_bytes;
    fake fakes[MAX_FAKES];
    int n_fakes;
} fixture;

static const char *model_path(void)
{
    return getenv("STRATA_MODEL") ? getenv("STRATA_MODEL") : STRATA_DEFAULT_MODEL;
}

/* Bytes of `blocks` fp16 block rows of the whole model (one stage holds every layer). */
static uint64_t fp16_rows_bytes(size_t blocks)
{
    model_config mc;
    tokenizer *tok = NULL;
    strata_error err = {0};
    if (model_read_meta(model_path(), &mc, &tok, &err) != STRATA_OK)
        fail_msg("%s", err.msg);
    tokenizer_free(tok);
    kv_codec_params *plan = calloc((size_t)mc.n_layers, sizeof *plan);
    assert_non_null(plan);
    assert_int_equal(kv_plan_parse("fp16", mc.n_layers, plan, &err), STRATA_OK);
    kv_geometry g = {.n_layers = mc.n_layers, .n_kv_heads = mc.n_kv_heads, .head_dim = mc.head_dim,
                     .block_tokens = BLOCK_TOKENS};
    const kv_codec_params *plans[1] = {plan};
    size_t row = kv_plans_row_bytes(&g, plans, 1);
    free(plan);
    assert_true(row > 0);
    return (uint64_t)row * blocks;
}

/* A scripted worker offering the KV memory given ({0}: what the coordinator grants). */
static fake *fake_start_offering(fixture *fx, const char *name, mig_mode mig, const uint64_t offer[3])
{
    assert_true(fx->n_fakes < MAX_FAKES);
    fake *f = &fx->fakes[fx->n_fakes++];
    memset(f, 0, sizeof *f);
    snprintf(f->name, sizeof f->name, "%s", name);
    f->port = ctl_server_port(fx->ctl);
    const bool given = offer[0] || offer[1] || offer[2];
    f->device_kv_bytes = given ? offer[0] : fx->device_kv_bytes;
    f->host_kv_bytes = given ? offer[1] : fx->host_kv_bytes;
    f->nvme_kv_bytes = given ? offer[2] : fx->nvme_kv_bytes;
    f->step_ms = 10;
    f->mig = mig;
    pthread_mutex_init(&f->mu, NULL);
    assert_int_equal(pthread_create(&f->thread, NULL, fake_main, f), 0);
    return f;
}

static fake *fake_start(fixture *fx, const char *name, mig_mode mig)
{
    return fake_start_offering(fx, name, mig, (const uint64_t[3]){0, 0, 0});
}

/* What most tests leave at its default (0). */
typedef struct fixture_limits {
    uint32_t max_batch_tokens;   /* default 64 */
    size_t max_message_bytes;    /* of the control stream; default the server's */
    uint64_t prefix_cache_bytes; /* default 0: no prefix caching */
    uint32_t stages;             /* default 1 */
    uint32_t step_timeout_ms;    /* default 0: none */
    uint32_t max_recoveries;     /* default 0: a request whose KV is lost ends */
    uint32_t recovery_wait_ms;   /* default 0: with no replica serving, requests end at once */
    size_t nvme_blocks;          /* block rows of an NVMe tier below the host tier; default 0: none */
} fixture_limits;

/* host_blocks: block rows of a host tier (0: none). */
static void fixture_start_limits(fixture *fx, uint32_t replicas, size_t blocks_per_replica, size_t host_blocks,
                                 fixture_limits lim)
{
    memset(fx, 0, sizeof *fx);
    fx->device_kv_bytes = fp16_rows_bytes(blocks_per_replica);
    fx->host_kv_bytes = host_blocks ? fp16_rows_bytes(host_blocks) : 0;
    fx->nvme_kv_bytes = lim.nvme_blocks ? fp16_rows_bytes(lim.nvme_blocks) : 0;
    coord_config cc = {.model_path = model_path(), .replicas = replicas, .stages = lim.stages ? lim.stages : 1,
                       .kv = "fp16",
                       .block_tokens = BLOCK_TOKENS, .ctx = 512, .max_seqs = 4,
                       .max_batch_tokens = lim.max_batch_tokens ? lim.max_batch_tokens : 64,
                       .device_kv_bytes = fx->device_kv_bytes, .host_kv_bytes = fx->host_kv_bytes,
                       .nvme_kv_bytes = fx->nvme_kv_bytes, .quiet = true,
                       .prefix_cache_bytes = lim.prefix_cache_bytes, .step_timeout_ms = lim.step_timeout_ms,
                       .max_recoveries = lim.max_recoveries, .recovery_wait_ms = lim.recovery_wait_ms};
    strata_error err = {0};
    if (!(fx->co = coord_create(&cc, &err)))
        fail_msg("coord_create: %s", err.msg);
    ctl_server_options co = ctl_server_options_default();
    co.listen_addr = "127.0.0.1:0";
    co.cluster_secret = SECRET;
    co.cluster_secret_len = sizeof SECRET - 1;
    if (lim.max_message_bytes)
        co.max_message_bytes = lim.max_message_bytes;
    ctl_handler h = coord_ctl_handler(fx->co);
    if (ctl_server_start(&co, &h, &fx->ctl, &err) != STRATA_OK)
        fail_msg("ctl_server_start: %s", err.msg);
    api_server_options ao = api_server_options_default();
    ao.listen_addr = "127.0.0.1:0";
    ao.limits = coord_limits(fx->co);
    api_backend b = coord_api_backend(fx->co);
    if (api_server_start(&ao, &b, &fx->api, &err) != STRATA_OK)
        fail_msg("api_server_start: %s", err.msg);
    fx->ch = api_client_channel(api_server_port(fx->api));
}

static void fixture_start(fixture *fx, uint32_t replicas, size_t blocks_per_replica, size_t host_blocks)
{
    fixture_start_limits(fx, replicas, blocks_per_replica, host_blocks, (fixture_limits){0});
}

static void fixture_stop(fixture *fx)
{
    grpc_channel_destroy(fx->ch);
    api_server_shutdown(fx->api, 0);
    coord_stop(fx->co);   /* Shutdown to every worker still joined: the scripted ones end */
    for (int i = 0; i < fx->n_fakes; i++) {
        fake *f = &fx->fakes[i];
        pthread_mutex_lock(&f->mu);
        f->kill = true;
        pthread_mutex_unlock(&f->mu);
        assert_int_equal(pthread_join(f->thread, NULL), 0);
        pthread_mutex_destroy(&f->mu);
    }
    ctl_server_shutdown(fx->ctl);
    coord_destroy(fx->co);
}

/* Polls cond (an expression over the fixture's state, read under the fakes' locks by the
 * helpers below) every 10 ms for up to ms. */
#define WAIT_FOR(cond, ms)                                                                         \
    do {                                                                                           \
        int64_t until_ = now_ms() + (ms);                                                          \
        while (!(cond) && now_ms() < until_)                                                       \
            sleep_ms(10);                                                                          \
        if (!(cond))                                                                               \
            fail_msg("timed out after %d ms waiting for %s", (int)(ms), #cond);                    \
    } while (0)

/* The request ends within ms and its thread is joined; _COMPLETE: with every token. */
#define GEN_FINISH(g, ms)                                                                          \
    do {                                                                                           \
        WAIT_FOR(gen_done(g), ms);                                                                 \
        gen_join(g);                                                                               \
    } while (0)
#define GEN_COMPLETE(g, ms)                                                                        \
    do {                                                                                           \
        GEN_FINISH(g, ms);                                                                         \
        assert_complete(g);                                                                        \
    } while (0)

static int fake_int(fake *f, const int *field)
{
    pthread_mutex_lock(&f->mu);
    int v = *field;
    pthread_mutex_unlock(&f->mu);
    return v;
}

static bool fake_bool(fake *f, const bool *field)
{
    pthread_mutex_lock(&f->mu);
    bool v = *field;
    pthread_mutex_unlock(&f->mu);
    return v;
}


static void fake_set(fake *f, bool *field)
{
    pthread_mutex_lock(&f->mu);
    *field = true;
    pthread_mutex_unlock(&f->mu);
}

/* The request ended with UNAVAILABLE, as its status or as an Error message after output. */
static bool gen_unavailable(gen_job *g)
{
    return g->status == GRPC_STATUS_UNAVAILABLE || g->error == GRPC_STATUS_UNAVAILABLE;
}

static void fake_set_step_ms(fake *f, int ms)
{
    pthread_mutex_lock(&f->mu);
    f->step_ms = ms;
    pthread_mutex_unlock(&f->mu);
}

static bool gen_done(gen_job *g)
{
    pthread_mutex_lock(&g->mu);
    bool d = g->done;
    pthread_mutex_unlock(&g->mu);
    return d;
}

/* A request run to its end (at most 10 s). */
static void gen_run_prompt(gen_job *g, grpc_channel *ch, uint32_t prompt_tokens, uint32_t max_tokens)
{
    gen_start_prompt(g, ch, prompt_tokens, max_tokens);
    GEN_FINISH(g, 10000);
}

static void gen_run(gen_job *g, grpc_channel *ch, uint32_t max_tokens)
{
    gen_run_prompt(g, ch, 0, max_tokens);
}

static uint32_t workers_ready(fixture *fx)
{
    uint32_t ready, total;
    coord_worker_counts(fx->co, &ready, &total);
    return ready;
}

static void wait_ready(fixture *fx)
{
    if (!coord_wait_ready(fx->co, 10000))
        fail_msg("the replicas did not become ready (first fake: %s)", fx->fakes[0].error);
}

/* The scripted worker (of the first n) that has run a request. */
static fake *runner(fixture *fx, int n)
{
    for (int i = 0; i < n; i++)
        if (fake_int(&fx->fakes[i], &fx->fakes[i].n_seqs) > 0)
            return &fx->fakes[i];
    return NULL;
}

static coord_drain_report drain(fixture *fx, const char *worker)
{
    coord_drain_report rep;
    strata_error err = {0};
    if (coord_drain_worker(fx->co, worker, &rep, &err) != STRATA_OK)
        fail_msg("drain %s: %s", worker, err.msg);
    return rep;
}

static coord_drain_report drain_until_done(fixture *fx, const char *worker)
{
    coord_drain_report rep = drain(fx, worker);
    int64_t until = now_ms() + 10000;
    while (!rep.done && now_ms() < until) {
        sleep_ms(10);
        rep = drain(fx, worker);
    }
    if (!rep.done)
        fail_msg("the drain of %s did not finish: %u moved, %u remaining, %u failed", worker, rep.moved, rep.remaining,
                 rep.failed);
    return rep;
}

/* Two replicas of one scripted worker each (w0, w1, answering migrations as mig), each with
 * room for `blocks` block rows; request a (max_tokens) is running: *x is the worker that runs
 * it, *y the other. */
static void two_replicas_running(fixture *fx, size_t blocks, mig_mode mig, gen_job *a, uint32_t max_tokens, fake **x,
                                 fake **y)
{
    fixture_start(fx, 2, blocks, 0);
    fake_start(fx, "w0", mig);
    fake_start(fx, "w1", mig);
    wait_ready(fx);
    gen_start(a, fx->ch, max_tokens);
    WAIT_FOR(gen_tokens(a) >= 5, 10000);
    *x = runner(fx, 2);
    assert_non_null(*x);
    *y = *x == &fx->fakes[0] ? &fx->fakes[1] : &fx->fakes[0];
}

/* ---- tests ---- */

/* A running request moves to the other replica and finishes there with every token; the drained
 * worker is told to stop; once it joins again under its name, draining it is a new drain. */
static void test_drain_moves_then_drains_again(void **state)
{
    (void)state;
    fixture fx;
    gen_job a;
    fake *x, *y;
    two_replicas_running(&fx, 64, MIG_OK, &a, 80, &x, &y);
    coord_drain_report rep = drain(&fx, x->name);
    assert_false(rep.done);
    GEN_COMPLETE(&a, 20000);
    rep = drain_until_done(&fx, x->name);
    assert_int_equal(rep.moved, 1);
    assert_int_equal(rep.failed, 0);
    assert_int_equal(fake_int(x, &x->migrates_send), 1);
    assert_int_equal(fake_int(y, &y->migrates_recv), 1);
    assert_true(fake_int(y, &y->n_seqs) >= 1);   /* it went on there */
    WAIT_FOR(fake_bool(x, &x->ended), 5000);
    assert_true(x->shutdown && x->shutdown_drain);
    WAIT_FOR(workers_ready(&fx) == 1, 5000);   /* the coordinator saw it leave (its name is free) */

    /* The worker comes back under its name (a supervisor restarted it) and rebuilds its replica. */
    fake *x2 = fake_start(&fx, x->name, MIG_OK);
    WAIT_FOR(fake_bool(x2, &x2->assigned), 10000);
    wait_ready(&fx);
    rep = drain_until_done(&fx, x->name);
    assert_int_equal(rep.moved, 0);   /* not the old drain's report */
    WAIT_FOR(fake_bool(x2, &x2->ended), 5000);
    assert_true(x2->shutdown && x2->shutdown_drain);
    fixture_stop(&fx);
}

/* Both ends refuse the move (nothing left the source): the request stays and finishes where it
 * was, the drain waits for it, and the move is not tried again. */
static void test_failed_migration_stays(void **state)
{
    (void)state;
    fixture fx;
    gen_job a;
    fake *x, *y;
    two_replicas_running(&fx, 64, MIG_FAIL, &a, 60, &x, &y);
    drain(&fx, x->name);
    GEN_COMPLETE(&a, 20000);
    coord_drain_report rep = drain_until_done(&fx, x->name);
    assert_int_equal(rep.moved, 0);
    assert_int_equal(rep.failed, 1);
    assert_int_equal(fake_int(x, &x->migrates_send), 1);
    assert_int_equal(fake_int(y, &y->migrates_recv), 1);
    assert_int_equal(fake_int(y, &y->n_seqs), 0);
    fixture_stop(&fx);
}

/* Two replicas, request a running on *x; the drain of x moves it to *y, which answers the move
 * as `receiver` says; a ends with UNAVAILABLE after its output (an Error message, status OK). */
static void move_fails_after_output(fixture *fx, gen_job *a, fake **x, fake **y, mig_mode receiver)
{
    two_replicas_running(fx, 64, MIG_OK, a, 60, x, y);
    pthread_mutex_lock(&(*y)->mu);
    (*y)->mig = receiver;
    pthread_mutex_unlock(&(*y)->mu);
    drain(fx, (*x)->name);
    GEN_FINISH(a, 20000);
    assert_int_equal(a->status, GRPC_STATUS_OK);   /* output had started: the failure is a message */
    assert_int_equal(a->error, GRPC_STATUS_UNAVAILABLE);
}

/* The sender moved its blocks but the receiver failed: the request cannot go on anywhere and
 * ends with UNAVAILABLE after its output so far. */
static void test_half_moved_fails(void **state)
{
    (void)state;
    fixture fx;
    gen_job a;
    fake *x, *y;
    move_fails_after_output(&fx, &a, &x, &y, MIG_FAIL);
    assert_non_null(strstr(a.error_message, "migration failed half way"));
    assert_true(a.tokens < 60);
    coord_drain_report rep = drain_until_done(&fx, x->name);
    assert_int_equal(rep.failed, 1);
    fixture_stop(&fx);
}

/* The receiver answers the move under another sequence id: it is out of step (the answer it owes
 * would never come, and both replicas plan no step during a move), so its stream is ended; the
 * request, whose blocks are on both replicas now, ends with UNAVAILABLE saying why, and the
 * drain ends with its replica lost. */
static void test_migration_out_of_step(void **state)
{
    (void)state;
    fixture fx;
    gen_job a;
    fake *x, *y;
    move_fails_after_output(&fx, &a, &x, &y, MIG_WRONG_SEQ);
    if (!strstr(a.error_message, "out of step") || !strstr(a.error_message, "as sequence"))
        fail_msg("the request's error does not say the worker was out of step: '%s'", a.error_message);
    WAIT_FOR(fake_bool(y, &y->ended), 5000);
    fixture_stop(&fx);
}

/* Each replica has room for one request. While a request's blocks travel to the other replica,
 * a new request must not be routed there (the room the move counted on would be gone at the
 * commit); it waits, and both finish. */
static void test_destination_kept_free_during_move(void **state)
{
    (void)state;
    fixture fx;
    const size_t need = (PROMPT_TOKENS + 60 + BLOCK_TOKENS - 1) / BLOCK_TOKENS;
    gen_job a, n;
    fake *x, *y;
    two_replicas_running(&fx, need, MIG_HOLD, &a, 60, &x, &y);
    drain(&fx, x->name);
    WAIT_FOR(fake_int(y, &y->migrates_recv) == 1 && fake_int(x, &x->migrates_send) == 1, 10000);
    gen_start(&n, fx.ch, 60);
    sleep_ms(300);
    assert_int_equal(gen_tokens(&n), 0);
    assert_false(gen_done(&n));
    fake_set(x, &x->release);
    fake_set(y, &y->release);
    WAIT_FOR(gen_done(&a) && gen_done(&n), 30000);
    gen_join(&a);
    gen_join(&n);
    assert_complete(&a);
    assert_complete(&n);
    coord_drain_report rep = drain_until_done(&fx, x->name);
    assert_int_equal(rep.moved, 1);
    assert_int_equal(rep.failed, 0);
    fixture_stop(&fx);
}

/* The drained replica loses its worker mid-move: the moving request ends with UNAVAILABLE, the
 * drain ends, and the replica rebuilt by the next worker to join takes requests again. */
static void test_replica_lost_during_drain(void **state)
{
    (void)state;
    fixture fx;
    gen_job a;
    fake *x, *y;
    two_replicas_running(&fx, 64, MIG_HOLD, &a, 60, &x, &y);
    drain(&fx, x->name);
    WAIT_FOR(fake_int(y, &y->migrates_recv) == 1, 10000);
    fake_set(x, &x->kill);
    GEN_FINISH(&a, 10000);
    assert_true(gen_unavailable(&a));
    coord_drain_report rep = drain(&fx, x->name);
    assert_true(rep.done);
    assert_non_null(strstr(rep.message, "lost"));
    fake_set(y, &y->release);   /* its late answer belongs to no migration any more */

    fake *x2 = fake_start(&fx, "w2", MIG_OK);
    WAIT_FOR(fake_bool(x2, &x2->assigned), 10000);
    wait_ready(&fx);
    /* Two requests at once: least-loaded routing puts one on each replica. */
    gen_job b, c;
    gen_start(&b, fx.ch, 40);
    gen_start(&c, fx.ch, 40);
    WAIT_FOR(gen_done(&b) && gen_done(&c), 20000);
    gen_join(&b);
    gen_join(&c);
    assert_complete(&b);
    assert_complete(&c);
    assert_true(fake_int(x2, &x2->n_seqs) >= 1);
    fixture_stop(&fx);
}

/* The destination of a move is lost while both replicas wait for it: the source's other request
 * goes on at once (the step thread is woken), the drain finishes once it is done. */
static void test_destination_lost_source_goes_on(void **state)
{
    (void)state;
    fixture fx;
    fixture_start(&fx, 2, 64, 0);
    fake *x = fake_start(&fx, "w0", MIG_HOLD);
    /* Only one replica serves: both requests run on x. */
    WAIT_FOR(workers_ready(&fx) == 1, 10000);
    gen_job a, b;
    gen_start(&a, fx.ch, 60);
    gen_start(&b, fx.ch, 60);
    WAIT_FOR(gen_tokens(&a) >= 3 && gen_tokens(&b) >= 3, 10000);
    fake *y = fake_start(&fx, "w1", MIG_HOLD);
    wait_ready(&fx);
    drain(&fx, x->name);
    WAIT_FOR(fake_int(y, &y->migrates_recv) == 1, 10000);
    fake_set(y, &y->kill);
    /* One of the two was moving (it ends with UNAVAILABLE), the other finishes on x. */
    WAIT_FOR(gen_done(&a) && gen_done(&b), 10000);
    gen_join(&a);
    gen_join(&b);
    gen_job *moved = a.error || a.status ? &a : &b, *stayed = moved == &a ? &b : &a;
    assert_true(gen_unavailable(moved));
    assert_complete(stayed);
    coord_drain_report rep = drain_until_done(&fx, x->name);
    assert_true(rep.done);
    fixture_stop(&fx);
}

/* The device holds 8 block rows, a host tier many more: two requests that each grow to 7 rows
 * cannot both stay, so one is preempted. Its spill fails on the worker (a preempt-only sequence,
 * not in the step's work): that request ends with the worker's message, the other completes. */
static void test_failed_spill_ends_request(void **state)
{
    (void)state;
    fixture fx;
    fixture_start(&fx, 1, 8, 256);
    fake *w = fake_start(&fx, "w0", MIG_OK);
    fake_set(w, &w->fail_preempt);
    wait_ready(&fx);
    gen_job a, b;
    gen_start(&a, fx.ch, 100);
    gen_start(&b, fx.ch, 100);
    WAIT_FOR(gen_done(&a) && gen_done(&b), 30000);
    gen_join(&a);
    gen_join(&b);
    assert_true(fake_int(w, &w->preempts) >= 1);
    gen_job *failed = a.error || a.status ? &a : &b, *other = failed == &a ? &b : &a;
    if (!strstr(failed->error_message, "spilling to the host tier failed") && !strstr(failed->details, "spilling"))
        fail_msg("the preempted request: status %d (%s), error %u (%s), %d tokens", failed->status, failed->details,
                 failed->error, failed->error_message, failed->tokens);
    assert_complete(other);
    fixture_stop(&fx);
}

/* Admission counts the larger of the host and NVMe tiers, not their sum (a worker's room check
 * counts on no more: offload/kv_tiers.c), and blocks below the device in whole 4 KiB pages: 8
 * block rows on the device, 4 in host memory and 16 on NVMe (by bytes: fp16 blocks of 16 tokens,
 * 12,416 bytes, in 16 KiB below) hold 8 + 12 = 20 for one request; 21 are refused at once, where
 * the sum admitted 26 and counting bytes 22, to fail mid-stream; 20 run to the end. */
static void test_tiers_counted_by_the_larger(void **state)
{
    (void)state;
    fixture fx;
    fixture_start_limits(&fx, 1, 8, 4, (fixture_limits){.nvme_blocks = 16});
    fake_start(&fx, "w0", MIG_OK);
    wait_ready(&fx);
    gen_job a;
    gen_run_prompt(&a, fx.ch, 4, 21 * BLOCK_TOKENS - 4);
    if (a.status != GRPC_STATUS_RESOURCE_EXHAUSTED || !strstr(a.details, "at most 20 blocks"))
        fail_msg("21 blocks: status %d (%s), %d tokens", a.status, a.details, a.tokens);
    gen_start_prompt(&a, fx.ch, 4, 20 * BLOCK_TOKENS - 4);
    GEN_COMPLETE(&a, 30000);
    fixture_stop(&fx);
}

/* A step plan the control stream cannot carry (here: a prompt larger than its message limit)
 * must not leave the step out for ever, the request waiting and the replica stuck: the worker's
 * stream is ended and the request fails at once with the reason. */
static void test_unsendable_step_ends_request(void **state)
{
    (void)state;
    fixture fx;
    fixture_start_limits(&fx, 1, 64, 0, (fixture_limits){.max_batch_tokens = 512, .max_message_bytes = 700});
    fake *w = fake_start(&fx, "w0", MIG_OK);
    wait_ready(&fx);
    gen_job a;
    gen_run_prompt(&a, fx.ch, 300, 8);   /* about 900 bytes of token ids in one step */
    if (!gen_unavailable(&a))
        fail_msg("request: status %d (%s), error %u (%s), %d tokens", a.status, a.details, a.error, a.error_message,
                 a.tokens);
    if (!strstr(a.details, "above the limit") && !strstr(a.error_message, "above the limit"))
        fail_msg("the reason is missing: '%s' '%s'", a.details, a.error_message);
    assert_int_equal(a.tokens, 0);
    assert_int_equal(fake_int(w, &w->plans), 0);   /* the worker never saw the step */
    WAIT_FOR(fake_bool(w, &w->ended), 10000);
    fixture_stop(&fx);
}

/* A worker failing a sequence's step ends that request with a status that tells the client what
 * to do: a step the worker refused as invalid is the server's inconsistency (INTERNAL; the
 * coordinator checked the request), not the client's (INVALID_ARGUMENT would say "change your
 * request"); out of memory stays RESOURCE_EXHAUSTED and an I/O failure UNAVAILABLE. The worker's
 * message reaches the client. */
static void test_worker_failure_status(void **state)
{
    (void)state;
    static const struct {
        uint32_t worker;
        grpc_status_code client;
    } cases[] = {
        {STRATA_EINVAL, GRPC_STATUS_INTERNAL},
        {STRATA_ENOMEM, GRPC_STATUS_RESOURCE_EXHAUSTED},
        {STRATA_EIO, GRPC_STATUS_UNAVAILABLE},
        {STRATA_EUNSUPPORTED, GRPC_STATUS_UNIMPLEMENTED},
    };
    fixture fx;
    fixture_start(&fx, 1, 64, 0);
    fake *w = fake_start(&fx, "w0", MIG_OK);
    wait_ready(&fx);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        pthread_mutex_lock(&w->mu);
        w->fail_steps = cases[i].worker;
        pthread_mutex_unlock(&w->mu);
        gen_job a;
        gen_run(&a, fx.ch, 8);
        if (a.status != cases[i].client || a.tokens != 0)
            fail_msg("worker status %s: client status %d (%s), error %u (%s), %d tokens; expected status %d",
                     strata_status_name((int)cases[i].worker), a.status, a.details, a.error, a.error_message,
                     a.tokens, cases[i].client);
        if (!strstr(a.details, "step refused: scripted"))
            fail_msg("the worker's reason is missing: '%s'", a.details);
    }
    /* The coordinator keeps serving once the worker does. */
    pthread_mutex_lock(&w->mu);
    w->fail_steps = 0;
    pthread_mutex_unlock(&w->mu);
    gen_job ok;
    gen_run(&ok, fx.ch, 8);
    assert_complete(&ok);
    fixture_stop(&fx);
}

/* Worker w was ended by the coordinator: a new worker `name` joins, the replica serves again and
 * a request completes there. */
static void replacement_serves(fixture *fx, fake *w, const char *name)
{
    WAIT_FOR(fake_bool(w, &w->ended), 5000);
    fake_start(fx, name, MIG_OK);
    wait_ready(fx);
    gen_job a;
    gen_run(&a, fx->ch, 8);
    assert_complete(&a);
}

/* A worker that misbehaves does not make the coordinator misbehave: a sampled token outside the
 * vocabulary fails that request (INTERNAL, naming the worker and the token), never reaches the
 * client as text; a stage that answers a step twice does not end the step before the other
 * stage answered (the request completes with every token); a worker that answers a step it was
 * never sent, or a step older than the one it owes, is out of step: its stream is ended (the
 * step it owes would never come and its replica would stall), the request ends with UNAVAILABLE
 * saying so, and a worker that joins next serves again. */
static void test_worker_bad_answers(void **state)
{
    (void)state;
    fixture fx;
    fixture_start(&fx, 1, 64, 0);
    fake *w = fake_start(&fx, "w0", MIG_OK);
    wait_ready(&fx);
    pthread_mutex_lock(&w->mu);
    w->bad_token = 1u << 30;
    pthread_mutex_unlock(&w->mu);
    gen_job a;
    gen_run(&a, fx.ch, 8);
    if (a.status != GRPC_STATUS_INTERNAL || a.tokens != 0 || !strstr(a.details, "token 1073741824, outside the model's "
                                                                                "vocabulary of 49152"))
        fail_msg("a token outside the vocabulary: status %d (%s), %d tokens", a.status, a.details, a.tokens);
    if (!strstr(a.details, "worker w0"))
        fail_msg("the worker is not named: '%s'", a.details);
    pthread_mutex_lock(&w->mu);
    w->bad_token = 0;
    pthread_mutex_unlock(&w->mu);
    gen_run(&a, fx.ch, 8);
    assert_complete(&a);

    pthread_mutex_lock(&w->mu);
    w->step_offset = 1;
    pthread_mutex_unlock(&w->mu);
    gen_run(&a, fx.ch, 8);
    if (a.status != GRPC_STATUS_UNAVAILABLE || !strstr(a.details, "out of step") || !strstr(a.details, "which was never "
                                                                                                       "sent"))
        fail_msg("a worker answering a step never sent: status %d (%s), %d tokens", a.status, a.details, a.tokens);
    replacement_serves(&fx, w, "w1");
    /* The replacement answers each step under the number of the step before its last answer. */
    fake *w1 = &fx.fakes[1];
    pthread_mutex_lock(&w1->mu);
    w1->step_offset = -2;
    pthread_mutex_unlock(&w1->mu);
    gen_run(&a, fx.ch, 8);
    if (a.status != GRPC_STATUS_UNAVAILABLE || !strstr(a.details, "out of step") ||
        !strstr(a.details, "older than the step it owes"))
        fail_msg("a worker answering an older step: status %d (%s), %d tokens", a.status, a.details, a.tokens);
    replacement_serves(&fx, w1, "w2");
    fixture_stop(&fx);

    /* Two stages; the first to join (stage 0) answers fast and twice, the last stage slowly. */
    fixture_start_limits(&fx, 1, 64, 0, (fixture_limits){.stages = 2});
    fake *front = fake_start(&fx, "front", MIG_OK);
    WAIT_FOR(fake_bool(front, &front->connected), 5000);
    sleep_ms(200);   /* its Join is handled before the second worker's */
    fake *back = fake_start(&fx, "back", MIG_OK);
    fake_set(front, &front->answer_twice);
    fake_set_step_ms(back, 100);
    wait_ready(&fx);
    gen_start(&a, fx.ch, 6);
    GEN_COMPLETE(&a, 20000);
    fixture_stop(&fx);
}

/* A worker that stops answering while its process, and so its keepalive, lives on (a hung
 * device): after the step timeout its stream is ended, the request ends with UNAVAILABLE naming
 * the step, and a worker that joins next serves again. */
static void test_silent_worker_times_out(void **state)
{
    (void)state;
    fixture fx;
    fixture_start_limits(&fx, 1, 64, 0, (fixture_limits){.step_timeout_ms = 500});
    fake *w = fake_start(&fx, "w0", MIG_OK);
    wait_ready(&fx);
    pthread_mutex_lock(&w->mu);
    assert_int_equal(w->step_timeout_ms, 500);   /* its stages wait as long for each other's rows */
    w->silent = true;
    pthread_mutex_unlock(&w->mu);
    gen_job a;
    gen_run(&a, fx.ch, 8);
    if (a.status != GRPC_STATUS_UNAVAILABLE || !strstr(a.details, "no answer to step"))
        fail_msg("a silent worker: status %d (%s), %d tokens", a.status, a.details, a.tokens);
    replacement_serves(&fx, w, "w1");
    fixture_stop(&fx);
}

static void keep_stats(void *user, ProtobufCMessage *m)
{
    *(Strata__V1__Stats **)user = (Strata__V1__Stats *)m;
}

/* GetStats through the public API (free with protobuf_c_message_free_unpacked). */
static Strata__V1__Stats *get_stats(fixture *fx)
{
    Strata__V1__StatsRequest sr = STRATA__V1__STATS_REQUEST__INIT;
    Strata__V1__Stats *st = NULL;
    grpc_status_code status;
    char details[256];
    api_client_call(fx->ch, "/strata.v1.Strata/GetStats", &sr.base, 10000, &strata__v1__stats__descriptor, keep_stats,
                    &st, &status, details, sizeof details);
    assert_int_equal(status, GRPC_STATUS_OK);
    assert_non_null(st);
    return st;
}

/* A copy of a prefix entry that fails on a worker (the entry's park failed there, e.g. out of
 * host memory) is invisible to the client: the request starts over, prefilled whole, and
 * completes with every token and cached_tokens 0; the entry is gone, so the next request with
 * that prompt prefills whole without trying; only copies that succeeded count as hits. */
static void test_failed_prefix_copy_starts_over(void **state)
{
    (void)state;
    fixture fx;
    fixture_start_limits(&fx, 1, 64, 0, (fixture_limits){.prefix_cache_bytes = 64u << 20});
    fake *w = fake_start(&fx, "w0", MIG_OK);
    wait_ready(&fx);
    gen_job a;
    gen_run_prompt(&a, fx.ch, 40, 8);   /* 47 tokens fed: 2 blocks of 16 parked */
    assert_complete(&a);
    assert_int_equal(a.cached, 0);
    WAIT_FOR(fake_int(w, &w->parks) == 1, 5000);
    /* The same prompt copies the entry; a working copy is a hit of 32 tokens. */
    gen_run_prompt(&a, fx.ch, 40, 8);
    assert_complete(&a);
    assert_int_equal(a.cached, 32);
    assert_int_equal(fake_int(w, &w->prefix_copies), 1);
    /* Now the worker fails copies: the request still completes, from 0. */
    fake_set(w, &w->fail_prefix_copies);
    gen_run_prompt(&a, fx.ch, 40, 8);
    assert_complete(&a);
    assert_int_equal(a.cached, 0);
    assert_int_equal(fake_int(w, &w->prefix_copies), 2);
    Strata__V1__Stats *st = get_stats(&fx);
    assert_int_equal(st->prefix_cache_hits, 1);
    assert_int_equal(st->prefix_cache_hit_tokens, 32);
    assert_int_equal(st->prefix_cache_entries, 1);   /* the next turn's park; the failed one is gone */
    protobuf_c_message_free_unpacked(&st->base, NULL);
    fixture_stop(&fx);
}

/* A request waiting to start from a prefix entry (admitted while another request's copy of the
 * entry is out, the step full) when that copy fails: the entry is gone, and the waiting request
 * starts from 0 without trying it (one copy seen by the worker, not two); both complete. */
static void test_lost_prefix_frees_waiting_requests(void **state)
{
    (void)state;
    fixture fx;
    fixture_start_limits(&fx, 1, 64, 0, (fixture_limits){.prefix_cache_bytes = 64u << 20, .max_batch_tokens = 8});
    fake *w = fake_start(&fx, "w0", MIG_OK);
    wait_ready(&fx);
    gen_job a, b;
    gen_run_prompt(&a, fx.ch, 40, 4);
    assert_complete(&a);
    WAIT_FOR(fake_int(w, &w->parks) == 1, 5000);
    fake_set(w, &w->fail_prefix_copies);
    fake_set_step_ms(w, 400);   /* the copy's step stays out while the second request waits */
    gen_start_prompt(&a, fx.ch, 40, 4);
    WAIT_FOR(fake_int(w, &w->prefix_copies) == 1, 5000);
    gen_start_prompt(&b, fx.ch, 40, 4);   /* its 8 uncached tokens fill a step: it waits */
    sleep_ms(100);   /* admitted meanwhile, pinned to the entry (later, it would find none: no failure) */
    fake_set_step_ms(w, 10);
    GEN_FINISH(&a, 10000);
    GEN_FINISH(&b, 10000);
    assert_complete(&a);
    assert_complete(&b);
    assert_int_equal(a.cached, 0);
    assert_int_equal(b.cached, 0);
    assert_int_equal(fake_int(w, &w->prefix_copies), 1);
    fixture_stop(&fx);
}

/* A step that starts from a prefix entry and fails for a reason of its own (no room for the
 * copy: the worker does not set prefix_failed) ends that request with the worker's status, like
 * any request's failed step; the entry is not at fault and stays: the next request with that
 * prompt copies it. */
static void test_failed_step_keeps_prefix(void **state)
{
    (void)state;
    fixture fx;
    fixture_start_limits(&fx, 1, 64, 0, (fixture_limits){.prefix_cache_bytes = 64u << 20});
    fake *w = fake_start(&fx, "w0", MIG_OK);
    wait_ready(&fx);
    gen_job a;
    gen_run_prompt(&a, fx.ch, 40, 8);
    assert_complete(&a);
    WAIT_FOR(fake_int(w, &w->parks) == 1, 5000);
    pthread_mutex_lock(&w->mu);
    w->fail_steps = STRATA_EFULL;
    pthread_mutex_unlock(&w->mu);
    gen_run_prompt(&a, fx.ch, 40, 8);
    if (a.status != GRPC_STATUS_RESOURCE_EXHAUSTED || !strstr(a.details, "step refused: scripted"))
        fail_msg("a failed step from a prefix: status %d (%s)", a.status, a.details);
    pthread_mutex_lock(&w->mu);
    w->fail_steps = 0;
    pthread_mutex_unlock(&w->mu);
    gen_run_prompt(&a, fx.ch, 40, 8);
    assert_complete(&a);
    assert_int_equal(a.cached, 32);
    fixture_stop(&fx);
}

/* A worker lost while its replica runs a request: the request goes on on the other replica from
 * its tokens (one prompt chunk of its prompt and the tokens it streamed, the sampler told how
 * many were sampled) and completes with every token, its client seeing no error; GetStats counts
 * the recovery. With max_recoveries 1 it goes on once: lost again, on a replica that serves
 * beside a rebuilt one, it ends with UNAVAILABLE. */
static void test_lost_replica_recovers(void **state)
{
    (void)state;
    fixture fx;
    fixture_start_limits(&fx, 2, 64, 0, (fixture_limits){.max_recoveries = 1});
    fake_start(&fx, "w0", MIG_OK);
    fake_start(&fx, "w1", MIG_OK);
    wait_ready(&fx);
    gen_job a;
    gen_start(&a, fx.ch, 60);
    WAIT_FOR(gen_tokens(&a) >= 5, 10000);
    fake *x = runner(&fx, 2), *y = x == &fx.fakes[0] ? &fx.fakes[1] : &fx.fakes[0];
    assert_non_null(x);
    fake_set(x, &x->kill);
    GEN_COMPLETE(&a, 20000);
    if (!fake_bool(y, &y->replay_ok))
        fail_msg("the other replica's first chunk: %d tokens, sampled_before %d", fake_int(y, &y->replay_tokens),
                 fake_int(y, &y->replay_sampled_before));
    const int sampled = fake_int(y, &y->replay_sampled_before);
    assert_true(sampled >= 5 && sampled < 60);
    Strata__V1__Stats *st = get_stats(&fx);
    assert_int_equal(st->requests_recovered, 1);
    protobuf_c_message_free_unpacked(&st->base, NULL);

    /* A second request runs on y (the only replica serving) while x's replacement joins; then y
     * is lost: the request goes on on the replacement. */
    fake_set_step_ms(y, 40);
    gen_job b;
    gen_start(&b, fx.ch, 100);
    WAIT_FOR(gen_tokens(&b) >= 3, 10000);
    WAIT_FOR(fake_bool(x, &x->ended), 5000);
    fake *x2 = fake_start(&fx, "w0-again", MIG_OK);
    wait_ready(&fx);
    assert_false(gen_done(&b));
    fake_set(y, &y->kill);
    WAIT_FOR(fake_int(x2, &x2->replay_sampled_before) >= 3, 10000);
    /* b now runs on x2 after its one recovery; x2 is lost too, with y's replacement serving */
    fake_set_step_ms(x2, 40);
    WAIT_FOR(fake_bool(y, &y->ended), 5000);
    fake_start(&fx, "w1-again", MIG_OK);
    wait_ready(&fx);
    assert_false(gen_done(&b));
    fake_set(x2, &x2->kill);
    GEN_FINISH(&b, 10000);
    if (!gen_unavailable(&b) || b.tokens >= 100)
        fail_msg("lost twice: status %d (%s), error %u (%s), %d tokens", b.status, b.details, b.error, b.error_message,
                 b.tokens);
    st = get_stats(&fx);
    assert_int_equal(st->requests_recovered, 2);
    protobuf_c_message_free_unpacked(&st->base, NULL);
    fixture_stop(&fx);
}

/* test_failed_spill_ends_request with one recovery allowed: the request whose spill failed goes
 * on from its tokens (its KV recomputed on the same replica) and both complete. */
static void test_failed_spill_recovers(void **state)
{
    (void)state;
    fixture fx;
    fixture_start_limits(&fx, 1, 8, 256, (fixture_limits){.max_recoveries = 1});
    fake *w = fake_start(&fx, "w0", MIG_OK);
    wait_ready(&fx);
    fake_set(w, &w->fail_preempt);
    gen_job a, b;
    gen_start(&a, fx.ch, 100);
    gen_start(&b, fx.ch, 100);
    WAIT_FOR(fake_int(w, &w->preempts) >= 1, 30000);
    pthread_mutex_lock(&w->mu);
    w->fail_preempt = false;   /* the recovered one may be preempted again: that spill works */
    pthread_mutex_unlock(&w->mu);
    WAIT_FOR(gen_done(&a) && gen_done(&b), 30000);
    gen_join(&a);
    gen_join(&b);
    assert_complete(&a);
    assert_complete(&b);
    assert_true(fake_bool(w, &w->replay_ok) && fake_int(w, &w->replay_sampled_before) > 0);
    Strata__V1__Stats *st = get_stats(&fx);
    assert_int_equal(st->requests_recovered, 1);
    protobuf_c_message_free_unpacked(&st->base, NULL);
    fixture_stop(&fx);
}

/* Two requests with the same 40-token prompt at once, one per replica (w: their workers, one
 * stage each): each replica then holds an entry of its first 32 tokens. Steps take 20 ms after. */
static void entry_on_each_replica(fixture *fx, fake *w[2])
{
    for (int i = 0; i < 2; i++)
        fake_set_step_ms(w[i], 100);   /* the first request still runs when the second is routed */
    wait_ready(fx);
    gen_job p1, p2;
    gen_start_prompt(&p1, fx->ch, 40, 4);
    gen_start_prompt(&p2, fx->ch, 40, 4);
    WAIT_FOR(gen_done(&p1) && gen_done(&p2), 10000);
    gen_join(&p1);
    gen_join(&p2);
    assert_complete(&p1);
    assert_complete(&p2);
    WAIT_FOR(fake_int(w[0], &w[0]->parks) == 1 && fake_int(w[1], &w[1]->parks) == 1, 5000);   /* 43 fed: 32 kept */
    for (int i = 0; i < 2; i++)
        fake_set_step_ms(w[i], 20);
}

/* A recovered request starts from a cached prefix of its input on the replica it goes on on, as
 * a new request would: two requests at once leave an entry of the same 40-token prompt on each
 * replica; a third with that prompt starts from one replica's entry (cached 32), loses that
 * replica mid-stream, and goes on on the other from that one's entry: its first chunk there
 * starts at token 32 after a copy, holds the rest of the prompt and the streamed tokens, and it
 * completes with cached_tokens 32. */
static void test_recovery_starts_from_prefix(void **state)
{
    (void)state;
    fixture fx;
    fixture_start_limits(&fx, 2, 64, 0, (fixture_limits){.max_recoveries = 1, .prefix_cache_bytes = 64u << 20});
    fake *w[2] = {fake_start(&fx, "w0", MIG_OK), fake_start(&fx, "w1", MIG_OK)};
    for (int i = 0; i < 2; i++) {
        pthread_mutex_lock(&w[i]->mu);
        w[i]->replay_prompt = 40;
        pthread_mutex_unlock(&w[i]->mu);
    }
    entry_on_each_replica(&fx, w);
    gen_job b;
    gen_start_prompt(&b, fx.ch, 40, 60);
    WAIT_FOR(gen_tokens(&b) >= 5, 10000);
    const int x = fake_int(w[0], &w[0]->prefix_copies) == 1 ? 0 : 1, y = 1 - x;
    assert_int_equal(fake_int(w[x], &w[x]->prefix_copies), 1);
    assert_int_equal(fake_int(w[y], &w[y]->prefix_copies), 0);
    fake_set(w[x], &w[x]->kill);
    GEN_COMPLETE(&b, 20000);
    assert_int_equal(b.cached, 32);
    assert_int_equal(fake_int(w[y], &w[y]->prefix_copies), 1);
    if (!fake_bool(w[y], &w[y]->replay_ok) || fake_int(w[y], &w[y]->replay_pos0) != 32)
        fail_msg("the other replica's first chunk: tokens %d-%d, sampled_before %d", fake_int(w[y], &w[y]->replay_pos0),
                 fake_int(w[y], &w[y]->replay_tokens), fake_int(w[y], &w[y]->replay_sampled_before));
    Strata__V1__Stats *st = get_stats(&fx);
    assert_int_equal(st->requests_recovered, 1);
    assert_int_equal(st->prefix_cache_hits, 2);
    assert_int_equal(st->prefix_cache_hit_tokens, 64);
    protobuf_c_message_free_unpacked(&st->base, NULL);
    fixture_stop(&fx);
}

/* A replica being drained takes no new request, so its prefix entries are not offered: a request
 * whose prompt both replicas hold copies the other one's entry (before, the lookup could pick the
 * drained replica's, and the request then prefilled whole elsewhere). */
static void test_drained_replica_prefix_not_offered(void **state)
{
    (void)state;
    fixture fx;
    fixture_start_limits(&fx, 2, 64, 0, (fixture_limits){.prefix_cache_bytes = 64u << 20});
    fake *w[2] = {fake_start(&fx, "w0", MIG_FAIL), fake_start(&fx, "w1", MIG_FAIL)};
    entry_on_each_replica(&fx, w);
    gen_job b, longer, c;
    gen_run_prompt(&b, fx.ch, 40, 4);   /* the lookup's choice of the two entries */
    assert_complete(&b);
    assert_int_equal(b.cached, 32);
    const int x = fake_int(w[0], &w[0]->prefix_copies) == 1 ? 0 : 1, y = 1 - x;
    gen_start_prompt(&longer, fx.ch, 40, 200);   /* to x, which holds its prefix; its move will fail */
    WAIT_FOR(gen_tokens(&longer) >= 3, 10000);
    assert_int_equal(fake_int(w[x], &w[x]->prefix_copies), 2);
    coord_drain_report rep = drain(&fx, w[x]->name);
    assert_false(rep.done);
    WAIT_FOR(fake_int(w[x], &w[x]->migrates_send) >= 1, 10000);   /* refused: it stays, the drain waits */
    gen_run_prompt(&c, fx.ch, 40, 4);
    assert_complete(&c);
    assert_int_equal(c.cached, 32);
    assert_int_equal(fake_int(w[y], &w[y]->prefix_copies), 1);
    GEN_COMPLETE(&longer, 20000);
    fixture_stop(&fx);
}

/* A drained replica's prefix entries go with its workers: GetStats stops counting them when the
 * drain ends (they stayed in the index, and in prefix_cache_entries/bytes, until workers joined
 * the replica again), and the other replica's entry still serves. */
static void test_drained_replica_forgets_prefixes(void **state)
{
    (void)state;
    fixture fx;
    fixture_start_limits(&fx, 2, 64, 0, (fixture_limits){.prefix_cache_bytes = 64u << 20});
    fake *w[2] = {fake_start(&fx, "w0", MIG_OK), fake_start(&fx, "w1", MIG_OK)};
    entry_on_each_replica(&fx, w);
    Strata__V1__Stats *st = get_stats(&fx);
    assert_int_equal(st->prefix_cache_entries, 2);
    const uint64_t one_entry = st->prefix_cache_bytes / 2;
    protobuf_c_message_free_unpacked(&st->base, NULL);
    (void)drain_until_done(&fx, w[0]->name);
    WAIT_FOR(fake_bool(w[0], &w[0]->ended), 5000);
    st = get_stats(&fx);
    assert_int_equal(st->prefix_cache_entries, 1);
    assert_int_equal(st->prefix_cache_bytes, one_entry);
    protobuf_c_message_free_unpacked(&st->base, NULL);
    gen_job c;
    gen_run_prompt(&c, fx.ch, 40, 4);
    assert_complete(&c);
    assert_int_equal(c.cached, 32);
    assert_int_equal(fake_int(w[1], &w[1]->prefix_copies), 1);
    fixture_stop(&fx);
}

/* A drain whose destination is lost before the move went out (its step never answered): the
 * moving request stays whole on the drained replica, no recovery spent on it; the drain ends,
 * since no replica is left to move to, and the drained replica serves again, taking the lost
 * replica's request, which recovers there. Both complete. */
static void test_drain_target_lost_before_move(void **state)
{
    (void)state;
    fixture fx;
    fixture_start_limits(&fx, 2, 64, 0, (fixture_limits){.max_recoveries = 1});
    fake *x = fake_start(&fx, "w0", MIG_OK);
    WAIT_FOR(workers_ready(&fx) == 1, 10000);   /* only x serves: a runs there */
    gen_job a, b;
    gen_start(&a, fx.ch, 80);
    WAIT_FOR(gen_tokens(&a) >= 3, 10000);
    fake_set_step_ms(x, 30);
    fake *y = fake_start(&fx, "w1", MIG_OK);
    wait_ready(&fx);
    fake_set(y, &y->silent);
    gen_start(&b, fx.ch, 60);   /* to y, the replica with more room: its first step is never answered */
    WAIT_FOR(fake_int(y, &y->plans) >= 1, 10000);
    coord_drain_report rep = drain(&fx, x->name);   /* a's move waits for y's step */
    assert_false(rep.done);
    sleep_ms(200);
    assert_int_equal(fake_int(y, &y->migrates_recv), 0);
    fake_set(y, &y->kill);
    WAIT_FOR(gen_done(&a) && gen_done(&b), 20000);
    gen_join(&a);
    gen_join(&b);
    assert_complete(&a);
    assert_complete(&b);
    rep = drain(&fx, x->name);
    if (!rep.done || !strstr(rep.message, "was lost and no other replica serves"))
        fail_msg("drain: done %d, '%s'", rep.done, rep.message);
    assert_false(fake_bool(x, &x->shutdown));   /* the drained replica was not stopped */
    Strata__V1__Stats *st = get_stats(&fx);
    assert_int_equal(st->requests_recovered, 1);   /* b; a never lost its KV */
    protobuf_c_message_free_unpacked(&st->base, NULL);
    fixture_stop(&fx);
}

/* A replica lost while a request waits in the queue for room, and sits in the request table
 * before the lost replica's requests (a finished request's slot went to it): finishing those
 * frees the lost replica's room, which must not take the waiting request (it would wait there
 * for a rebuild that never comes); it runs on the other replica once that has room. Each replica
 * holds 8 block rows of 16 tokens; c (4 + 120 tokens) needs all 8 of one. */
static void test_lost_replica_takes_no_queued_request(void **state)
{
    (void)state;
    fixture fx;
    fixture_start_limits(&fx, 2, 8, 0, (fixture_limits){.max_recoveries = 1});
    fake_start(&fx, "w0", MIG_OK);
    fake_start(&fx, "w1", MIG_OK);
    wait_ready(&fx);
    pthread_mutex_lock(&fx.fakes[0].mu);
    fake *r0 = fx.fakes[0].replica == 0 ? &fx.fakes[0] : &fx.fakes[1];   /* the worker of replica 0 */
    pthread_mutex_unlock(&fx.fakes[0].mu);
    for (int i = 0; i < 2; i++)
        fake_set_step_ms(&fx.fakes[i], 40);
    gen_job x, b, a, c;
    gen_start(&x, fx.ch, 16);   /* replica 0 (a tie: the lowest index); runs ~700 ms */
    WAIT_FOR(fake_int(r0, &r0->n_seqs) >= 1, 5000);
    gen_start(&b, fx.ch, 60);   /* replica 1, which has more room */
    sleep_ms(100);
    gen_start(&a, fx.ch, 40);   /* replica 0 (a tie again) */
    sleep_ms(100);
    gen_start_prompt(&c, fx.ch, PROMPT_TOKENS, 120);   /* fits neither now: waits, last in the table */
    sleep_ms(100);
    assert_false(gen_done(&x));   /* c reached the table while x still held its slot */
    WAIT_FOR(gen_done(&x), 10000);   /* x's slot goes to c: c now sits before b and a */
    gen_join(&x);
    assert_complete(&x);
    WAIT_FOR(fake_int(r0, &r0->n_seqs) >= 2, 5000);
    assert_false(gen_done(&a));
    assert_int_equal(gen_tokens(&c), 0);
    fake_set(r0, &r0->kill);   /* a goes on on replica 1; c must follow it there, not stay on 0 */
    WAIT_FOR(gen_done(&a) && gen_done(&b) && gen_done(&c), 20000);
    gen_join(&b);
    gen_join(&a);
    gen_join(&c);
    assert_complete(&b);
    assert_complete(&a);
    assert_complete(&c);
    fixture_stop(&fx);
}

/* A lone replica loses its worker: its request waits (recovery_wait_ms) and goes on on the
 * rebuilt replica when a new worker joins. Lost again with its recovery used up, or with none
 * joining in time, a request ends with UNAVAILABLE saying why. */
static void test_lone_replica_waits_for_rebuild(void **state)
{
    (void)state;
    fixture fx;
    fixture_start_limits(&fx, 1, 64, 0, (fixture_limits){.max_recoveries = 1, .recovery_wait_ms = 1500});
    fake *w = fake_start(&fx, "w0", MIG_OK);
    wait_ready(&fx);
    gen_job a;
    gen_start(&a, fx.ch, 60);
    WAIT_FOR(gen_tokens(&a) >= 5, 10000);
    fake_set(w, &w->kill);
    WAIT_FOR(fake_bool(w, &w->ended), 5000);
    sleep_ms(300);   /* no replica serves for a while */
    assert_false(gen_done(&a));
    fake *w2 = fake_start(&fx, "w0-again", MIG_OK);
    GEN_COMPLETE(&a, 10000);
    assert_true(fake_bool(w2, &w2->replay_ok));
    /* No worker comes back: the request ends when the wait runs out. */
    gen_job b;
    gen_start(&b, fx.ch, 200);
    WAIT_FOR(gen_tokens(&b) >= 3, 10000);
    fake_set(w2, &w2->kill);
    const int64_t lost_at = now_ms();
    GEN_FINISH(&b, 10000);
    if (!gen_unavailable(&b) || !strstr(b.error_message, "none served again within 1.5 s"))
        fail_msg("no worker back: status %d (%s), error %u (%s)", b.status, b.details, b.error, b.error_message);
    assert_true(now_ms() - lost_at >= 1200);
    fixture_stop(&fx);
}

/* With no wait for a rebuild (recovery_wait_ms 0, the fixture's default) a lone replica that loses
 * its worker ends its running request (the worker lost) and its queued one (no replica serving)
 * at once with UNAVAILABLE, each saying why, instead of holding them for a worker that may never
 * come; a worker joining afterwards serves new requests. */
static void test_lone_replica_lost_without_wait(void **state)
{
    (void)state;
    fixture fx;
    fixture_start_limits(&fx, 1, 8, 0, (fixture_limits){.max_recoveries = 1});
    fake *w = fake_start(&fx, "w0", MIG_OK);
    wait_ready(&fx);
    fake_set_step_ms(w, 20);
    gen_job a, b;
    gen_start(&a, fx.ch, 60);
    WAIT_FOR(gen_tokens(&a) >= 3, 10000);
    gen_start_prompt(&b, fx.ch, PROMPT_TOKENS, 120);   /* does not fit beside a: waits */
    sleep_ms(100);
    assert_int_equal(gen_tokens(&b), 0);
    fake_set(w, &w->kill);
    const int64_t lost_at = now_ms();
    GEN_FINISH(&a, 10000);
    GEN_FINISH(&b, 10000);
    assert_true(now_ms() - lost_at < 5000);
    if (!gen_unavailable(&a) || !strstr(a.error_message, "worker w0 (replica 0, stage 0) lost"))
        fail_msg("running request: status %d (%s), error %u (%s)", a.status, a.details, a.error, a.error_message);
    if (!gen_unavailable(&b) || !strstr(b.details, "no replica is serving: every replica lost a worker"))
        fail_msg("queued request: status %d (%s), error %u (%s)", b.status, b.details, b.error, b.error_message);
    fake_start(&fx, "w0-again", MIG_OK);
    wait_ready(&fx);   /* the replica rebuilt */
    gen_job c;
    gen_start(&c, fx.ch, 8);
    GEN_COMPLETE(&c, 10000);
    fixture_stop(&fx);
}

/* A worker offering less KV memory of any tier than the coordinator grants every worker is
 * refused at its Join, the message naming the tier, both sizes and the flag; one offering
 * enough then joins and serves. */
static void test_join_refused_for_less_memory(void **state)
{
    (void)state;
    fixture fx;
    fixture_start_limits(&fx, 1, 8, 4, (fixture_limits){.nvme_blocks = 16});
    const uint64_t d = fx.device_kv_bytes, h = fx.host_kv_bytes, n = fx.nvme_kv_bytes;
    static const char *const want[3] = {"of device KV memory; the coordinator grants",
                                        "of host KV memory; the coordinator grants",
                                        "of NVMe KV space; the coordinator grants"};
    static const char *const flag[3] = {"--device-kv-mib", "--host-kv-mib", "--nvme-kv-mib"};
    const uint64_t offers[3][3] = {{d - 1, h, n}, {d, h - 1, n}, {d, h, n - 1}};
    for (int t = 0; t < 3; t++) {
        char name[16];
        snprintf(name, sizeof name, "short%d", t);
        fake *f = fake_start_offering(&fx, name, MIG_OK, offers[t]);
        WAIT_FOR(fake_bool(f, &f->ended), 10000);
        pthread_mutex_lock(&f->mu);
        bool ok = strstr(f->error, want[t]) && strstr(f->error, flag[t]);
        pthread_mutex_unlock(&f->mu);
        if (!ok)
            fail_msg("offer %d: \"%s\"", t, f->error);
    }
    fake_start(&fx, "enough", MIG_OK);
    wait_ready(&fx);
    gen_job a;
    gen_start(&a, fx.ch, 8);
    GEN_COMPLETE(&a, 10000);
    fixture_stop(&fx);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_drain_moves_then_drains_again),
        cmocka_unit_test(test_failed_migration_stays),
        cmocka_unit_test(test_half_moved_fails),
        cmocka_unit_test(test_migration_out_of_step),
        cmocka_unit_test(test_destination_kept_free_during_move),
        cmocka_unit_test(test_replica_lost_during_drain),
        cmocka_unit_test(test_destination_lost_source_goes_on),
        cmocka_unit_test(test_failed_spill_ends_request),
        cmocka_unit_test(test_unsendable_step_ends_request),
        cmocka_unit_test(test_tiers_counted_by_the_larger),
        cmocka_unit_test(test_failed_prefix_copy_starts_over),
        cmocka_unit_test(test_lost_prefix_frees_waiting_requests),
        cmocka_unit_test(test_failed_step_keeps_prefix),
        cmocka_unit_test(test_worker_failure_status),
        cmocka_unit_test(test_worker_bad_answers),
        cmocka_unit_test(test_silent_worker_times_out),
        cmocka_unit_test(test_lost_replica_recovers),
        cmocka_unit_test(test_failed_spill_recovers),
        cmocka_unit_test(test_recovery_starts_from_prefix),
        cmocka_unit_test(test_drained_replica_prefix_not_offered),
        cmocka_unit_test(test_drained_replica_forgets_prefixes),
        cmocka_unit_test(test_lost_replica_takes_no_queued_request),
        cmocka_unit_test(test_drain_target_lost_before_move),
        cmocka_unit_test(test_lone_replica_waits_for_rebuild),
        cmocka_unit_test(test_lone_replica_lost_without_wait),
        cmocka_unit_test(test_join_refused_for_less_memory),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
