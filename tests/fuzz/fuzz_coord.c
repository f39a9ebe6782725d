/* Fuzz target for the coordinator's core (coordinator/service/coord*.c): what it does with what
 * its workers say and its clients ask, in any order. Workers are trusted (they hold the cluster
 * secret) but may be faulty, of another build, or die at any moment; whatever they send, the
 * coordinator must not crash, must end every accepted request exactly once with counts that
 * match what it streamed, must stream only tokens of the vocabulary, and must keep serving:
 * once the faulty part of a run is over and well-behaved workers fill every slot, every request
 * still open must finish (a request left hanging fails the input).
 *
 * The coordinator is the real one (its step thread, scheduler, prefix index, migration and
 * drain) on the synthetic "tiny" model, 2 replicas x 2 stages. The gRPC servers around it are
 * replaced by this file: ctl_peer_* and api_stream_* record what the coordinator sends and
 * check the api_stream contract (coordinator/server/api_server.h: one terminal call, nothing
 * after it, api_stream_finish only after a cancel); the input then calls the handler and
 * backend callbacks as the two servers would.
 *
 * Input: the first byte picks the configuration (host tier, prefix cache, steps in flight, a
 * step timeout of 300 ms, with which a worker may also never answer a step or a migration);
 * then operations, one byte each and their arguments (see the OP_ names): a worker joins, one
 * handles its oldest message correctly or wrongly (a step answered with a failure, a token
 * outside the vocabulary, a sequence left out or unknown, the wrong step, twice, never; a
 * migration answered wrongly, twice or never), sends a KvReport of any numbers or a raw WorkerMessage decoded
 * from the input, or is lost; a client submits a request (valid or not), cancels, aborts; an
 * operator drains a worker or asks for stats; the step thread gets a moment to run. The step
 * thread makes runs slightly timing dependent; every check holds for any timing.
 * FUZZ_COORD_VERBOSE=1 prints the operations and the coordinator's log.
 * Seeds: tests/fuzz/corpus/fuzz_coord (made by tests/fuzz/make_coord_seeds.py). */
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "coordinator/service/coord.h"
#include "proto/strata.pb-c.h"
#include "proto/strata_internal.pb-c.h"
#include "proto/validate.h"
#include "tests/fuzz/byte_reader.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define REPLICAS 2
#define STAGES 2
#define MAX_PEERS 24      /* joins in one input, the well-behaved ones of the end included */
#define MAX_STREAMS 24
#define MAX_PROMPT 48
#define BLOCK_TOKENS 32
#define CTX 256
#define LIVENESS_MS 5000  /* the well-behaved end: every request must be over by then */

enum {
    OP_JOIN,      /* a worker joins: [offer byte] */
    OP_HANDLE,    /* a worker handles its oldest message correctly: [peer] */
    OP_MISHANDLE, /* ... wrongly: [peer][fault][arg] */
    OP_REPORT,    /* a KvReport of fuzzed numbers: [peer][6 bytes] */
    OP_GENERATE,  /* a client request: [shape][len][ids...][max_tokens][codec] */
    OP_CANCEL,    /* the client goes away: [stream] */
    OP_ABORT,     /* Abort by request id: [stream] */
    OP_GONE,      /* a worker's stream ends: [peer] */
    OP_DRAIN,     /* DrainWorker: [peer] */
    OP_STATS,     /* GetStats, Health, GetModelInfo */
    OP_RAW,       /* a raw WorkerMessage: [peer][len][bytes...] */
    OP_WAIT,      /* the step thread gets a moment */
    N_OPS
};

typedef struct queued {
    Strata__Internal__V1__CoordinatorMessage *m;
    struct queued *next;
} queued;

struct ctl_peer {
    int idx;
    char name[16];
    int refs;         /* the coordinator's references */
    void *user;
    bool joined;      /* on_join accepted it and on_gone has not come yet */
    bool closing;     /* ctl_peer_close, or it left: on_gone is owed */
    int close_status;
    queued *head, *tail;
};

struct api_stream {
    char rid[24];
    bool accepted, cancelled;
    int terminal;             /* terminal calls made */
    uint32_t n_ids;           /* token ids streamed */
    uint32_t n_prompt, max_tokens;
    Strata__V1__GenerateRequest req;
    Strata__V1__SamplingParams sp;
    Strata__V1__TokenIds ids;
    uint32_t id_buf[MAX_PROMPT];
    uint32_t stop_ids[2];
};

static struct {
    pthread_mutex_t mu;
    pthread_cond_t sent;
    ctl_peer peers[MAX_PEERS];
    int n_peers;
    api_stream streams[MAX_STREAMS];
    int n_streams;
    uint32_t n_vocab;
    bool verbose;
} H = {.mu = PTHREAD_MUTEX_INITIALIZER, .sent = PTHREAD_COND_INITIALIZER};

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...)
{
    if (!H.verbose)
        return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

/* A broken contract: the replay driver keeps the input (fuzz-failure.bin). */
static void violation(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void violation(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("fuzz_coord: ", stderr);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    abort();
}

/* ---- the control server's side, as the coordinator sees it ---- */

int ctl_peer_send(ctl_peer *peer, const Strata__Internal__V1__CoordinatorMessage *msg, strata_error *err)
{
    /* Through the wire format, so that what a worker reads is what the coordinator packed. */
    const size_t n = strata__internal__v1__coordinator_message__get_packed_size(msg);
    uint8_t *buf = malloc(n ? n : 1);
    queued *q = malloc(sizeof *q);
    Strata__Internal__V1__CoordinatorMessage *copy = NULL;
    if (buf && q) {
        strata__internal__v1__coordinator_message__pack(msg, buf);
        copy = strata__internal__v1__coordinator_message__unpack(NULL, n, buf);
    }
    free(buf);
    if (!copy) {
        free(q);
        return strata_fail(err, STRATA_ENOMEM, "fuzz: cannot queue a message");
    }
    pthread_mutex_lock(&H.mu);
    if (!peer->joined || peer->closing) {
        pthread_mutex_unlock(&H.mu);
        strata__internal__v1__coordinator_message__free_unpacked(copy, NULL);
        free(q);
        return strata_fail(err, STRATA_EIO, "worker stream ended");
    }
    q->m = copy;
    q->next = NULL;
    if (peer->tail)
        peer->tail->next = q;
    else
        peer->head = q;
    peer->tail = q;
    pthread_cond_broadcast(&H.sent);
    pthread_mutex_unlock(&H.mu);
    return STRATA_OK;
}

void ctl_peer_close(ctl_peer *peer, int grpc_status, const char *message)
{
    (void)message;
    pthread_mutex_lock(&H.mu);
    if (peer->joined && !peer->closing) {
        peer->closing = true;
        peer->close_status = grpc_status;
    }
    pthread_mutex_unlock(&H.mu);
}

void ctl_peer_ref(ctl_peer *peer)
{
    pthread_mutex_lock(&H.mu);
    peer->refs++;
    pthread_mutex_unlock(&H.mu);
}

void ctl_peer_unref(ctl_peer *peer)
{
    if (!peer)
        return;
    pthread_mutex_lock(&H.mu);
    if (--peer->refs < 0)
        violation("peer %s: more unrefs than refs", peer->name);
    pthread_mutex_unlock(&H.mu);
}

const char *ctl_peer_name(const ctl_peer *peer) { return peer->name; }
const char *ctl_peer_addr(const ctl_peer *peer) { return peer->name; }
void ctl_peer_set_user(ctl_peer *peer, void *user) { peer->user = user; }
void *ctl_peer_get_user(const ctl_peer *peer) { return peer->user; }

/* ---- the API server's side ---- */

const char *api_stream_request_id(const api_stream *st) { return st->rid; }

static void check_open(const api_stream *st, const char *call)
{
    if (!st->accepted)
        violation("%s on request %s, which generate did not take", call, st->rid);
    if (st->terminal)
        violation("%s on request %s after its terminal call", call, st->rid);
}

int api_stream_send_chunk(api_stream *st, const uint32_t *ids, size_t n, const char *text, size_t len)
{
    pthread_mutex_lock(&H.mu);
    check_open(st, "send_chunk");
    for (size_t i = 0; i < n; i++)
        if (ids[i] >= H.n_vocab)
            violation("request %s: streamed token %u, outside the vocabulary of %u", st->rid, ids[i], H.n_vocab);
    if (len && (!text || memchr(text, 0, len)))
        violation("request %s: a chunk's text holds U+0000", st->rid);
    st->n_ids += (uint32_t)n;
    const bool gone = st->cancelled;
    pthread_mutex_unlock(&H.mu);
    return gone ? STRATA_EIO : STRATA_OK;
}

void api_stream_complete(api_stream *st, Strata__V1__FinishReason why, uint32_t prompt_tokens,
                         uint32_t completion_tokens, uint32_t cached_tokens)
{
    pthread_mutex_lock(&H.mu);
    check_open(st, "complete");
    st->terminal++;
    if (completion_tokens != st->n_ids)
        violation("request %s: Complete says %u tokens, %u were streamed", st->rid, completion_tokens, st->n_ids);
    if (prompt_tokens != st->n_prompt)
        violation("request %s: Complete says %u prompt tokens, it had %u", st->rid, prompt_tokens, st->n_prompt);
    if (cached_tokens > prompt_tokens)
        violation("request %s: %u cached tokens of a %u-token prompt", st->rid, cached_tokens, prompt_tokens);
    if (completion_tokens > st->max_tokens)
        violation("request %s: %u tokens, max_tokens %u", st->rid, completion_tokens, st->max_tokens);
    if (why == STRATA__V1__FINISH_REASON__FINISH_REASON_LENGTH && completion_tokens != st->max_tokens &&
        prompt_tokens + completion_tokens != CTX)
        violation("request %s: finished for length after %u of %u tokens", st->rid, completion_tokens,
                  st->max_tokens);
    pthread_mutex_unlock(&H.mu);
}

void api_stream_fail(api_stream *st, int status, const char *message)
{
    pthread_mutex_lock(&H.mu);
    check_open(st, "fail");
    st->terminal++;
    if (status == STRATA_OK)
        violation("request %s: failed with status OK (%s)", st->rid, message ? message : "");
    if (status == STRATA_EINVAL)   /* the client's request was checked at admission */
        violation("request %s: a worker's fault reported as the client's (INVALID_ARGUMENT): %s", st->rid,
                  message ? message : "");
    pthread_mutex_unlock(&H.mu);
}

void api_stream_finish(api_stream *st)
{
    pthread_mutex_lock(&H.mu);
    check_open(st, "finish");
    st->terminal++;
    if (!st->cancelled)
        violation("request %s: ended with nothing to report, without a cancel", st->rid);
    pthread_mutex_unlock(&H.mu);
}

/* ---- the run ---- */

typedef struct run {
    coord *c;
    api_backend api;
    ctl_handler ctl;
    coord_config cfg;
} run;

static ctl_peer *pick_peer(uint8_t b)
{
    return H.n_peers ? &H.peers[b % H.n_peers] : NULL;
}

static queued *take_message(ctl_peer *p)
{
    pthread_mutex_lock(&H.mu);
    queued *q = p->head;
    if (q && !(p->head = q->next))
        p->tail = NULL;
    pthread_mutex_unlock(&H.mu);
    return q;
}

static void free_queued(queued *q)
{
    strata__internal__v1__coordinator_message__free_unpacked(q->m, NULL);
    free(q);
}

/* The control server's on_gone for every peer whose stream ended (closed by the coordinator,
 * left after a Shutdown, or lost), never inside a ctl_peer_* call. */
static void deliver_gone(run *R)
{
    for (int i = 0; i < H.n_peers; i++) {
        ctl_peer *p = &H.peers[i];
        pthread_mutex_lock(&H.mu);
        const bool owed = p->joined && p->closing;
        pthread_mutex_unlock(&H.mu);
        if (!owed)
            continue;
        say("  on_gone %s (status %d)", p->name, p->close_status);
        R->ctl.on_gone(R->ctl.ctx, p, p->close_status, "stream ended");
        pthread_mutex_lock(&H.mu);
        p->joined = false;
        pthread_mutex_unlock(&H.mu);
    }
}

static void lose(ctl_peer *p, int status)
{
    pthread_mutex_lock(&H.mu);
    if (p->joined && !p->closing) {
        p->closing = true;
        p->close_status = status;
    }
    pthread_mutex_unlock(&H.mu);
}

/* A worker joins; the input's joins leave room for the well-behaved ones of the end. */
static void join(run *R, uint8_t offer, bool settling)
{
    if (H.n_peers >= (settling ? MAX_PEERS : MAX_PEERS - REPLICAS * STAGES))
        return;
    ctl_peer *p = &H.peers[H.n_peers++];
    memset(p, 0, sizeof *p);
    p->idx = H.n_peers - 1;
    snprintf(p->name, sizeof p->name, "w%d", p->idx);
    /* A name already joined is refused by the coordinator; offers below the grant too. */
    char name[16], addr[32];
    snprintf(name, sizeof name, "w%d", (offer >> 4) == 15 && p->idx ? p->idx - 1 : p->idx);
    snprintf(addr, sizeof addr, "10.0.0.%d:7000", p->idx);
    Strata__Internal__V1__Join j = STRATA__INTERNAL__V1__JOIN__INIT;
    j.worker_name = name;
    j.device = (char *)"cpu";
    j.device_kv_bytes = R->cfg.device_kv_bytes - ((offer & 3) == 3);
    j.host_kv_bytes = R->cfg.host_kv_bytes;
    j.nvme_kv_bytes = R->cfg.nvme_kv_bytes;
    j.data_addr = (offer & 12) == 12 ? (char *)"" : addr;
    pthread_mutex_lock(&H.mu);
    p->joined = true;   /* sends from inside on_join are allowed */
    pthread_mutex_unlock(&H.mu);
    strata_error err = {0};
    const int rc = R->ctl.on_join(R->ctl.ctx, p, &j, &err);
    say("  join %s as '%s': %s", p->name, name, rc == STRATA_OK ? "joined" : err.msg);
    if (rc != STRATA_OK) {
        pthread_mutex_lock(&H.mu);
        p->joined = false;
        if (p->refs)
            violation("a refused worker is still referenced");
        queued *q = p->head;
        p->head = p->tail = NULL;
        pthread_mutex_unlock(&H.mu);
        while (q) {
            queued *next = q->next;
            free_queued(q);
            q = next;
        }
        H.n_peers--;   /* the coordinator keeps nothing of a refused worker: the place is free */
    }
}

static void send_worker_message(run *R, ctl_peer *p, const Strata__Internal__V1__WorkerMessage *m)
{
    pthread_mutex_lock(&H.mu);
    const bool live = p->joined && !p->closing;
    pthread_mutex_unlock(&H.mu);
    if (live)
        R->ctl.on_message(R->ctl.ctx, p, m);
}

static void send_report(run *R, ctl_peer *p, const uint8_t v[6])
{
    Strata__Internal__V1__TierUsage t[2] = {STRATA__INTERNAL__V1__TIER_USAGE__INIT,
                                            STRATA__INTERNAL__V1__TIER_USAGE__INIT};
    Strata__Internal__V1__TierUsage *tp[2] = {&t[0], &t[1]};
    t[0].name = (char *)"device";
    t[0].blocks = v[0];
    t[0].bytes = (uint64_t)v[1] << 40;
    t[0].capacity_bytes = R->cfg.device_kv_bytes;
    t[1].name = v[2] & 1 ? (char *)"host" : (char *)"disk";
    t[1].blocks = v[2];
    Strata__Internal__V1__KvReport k = STRATA__INTERNAL__V1__KV_REPORT__INIT;
    k.n_tiers = v[3] % 3;
    k.tiers = tp;
    k.spills = v[3];
    k.restores = (uint64_t)v[4] << 56;
    k.spill_failures = v[5] & 7;
    k.restore_failures = v[5] >> 3;
    k.spill_error = v[5] & 1 ? (char *)"No space left on device" : (char *)"";
    Strata__Internal__V1__WorkerMessage m = STRATA__INTERNAL__V1__WORKER_MESSAGE__INIT;
    m.kind_case = STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_KV_REPORT;
    m.kv_report = &k;
    send_worker_message(R, p, &m);
}

/* Faults of a step answer (OP_MISHANDLE's fault byte). */
enum { F_FAIL_ONE, F_BAD_TOKEN, F_LEAVE_OUT, F_UNKNOWN_SEQ, F_WRONG_STEP, F_TWICE, F_FAIL_ALL, F_EMPTY, F_SILENT, N_FAULTS };

static void answer_step(run *R, ctl_peer *p, const Strata__Internal__V1__StepPlan *plan, int fault, uint8_t arg)
{
    if (fault == F_SILENT && R->cfg.step_timeout_ms)
        return;   /* never answered, as a hung worker: the step timeout must end it */
    const size_t n = plan->n_seqs;
    Strata__Internal__V1__SeqResult *rs = calloc(n + 1, sizeof *rs);
    Strata__Internal__V1__SeqResult **rp = calloc(n + 1, sizeof *rp);
    if (!rs || !rp)
        violation("out of memory");
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        const Strata__Internal__V1__SeqWork *w = plan->seqs[i];
        if (fault == F_LEAVE_OUT && i == arg % n)
            continue;
        strata__internal__v1__seq_result__init(&rs[k]);
        rs[k].seq_id = w->seq_id;
        /* Any word piece; ids near the top of the vocabulary are rare in prompts. */
        rs[k].token = (uint32_t)((w->seq_id * 31 + plan->step * 7 + arg) % H.n_vocab);
        if ((fault == F_FAIL_ONE && i == arg % n) || fault == F_FAIL_ALL) {
            static const uint32_t codes[] = {STRATA_EINVAL, STRATA_ENOMEM, STRATA_EIO, STRATA_EFULL, STRATA_ECRC, 999};
            rs[k].status = codes[arg % (sizeof codes / sizeof codes[0])];
            rs[k].message = (char *)"scripted failure";
            rs[k].prefix_failed = arg >> 6 & 1;   /* as a stage that could not copy the sequence's prefix entry */
        }
        if (fault == F_BAD_TOKEN && i == arg % n)
            rs[k].token = H.n_vocab + arg;
        rp[k] = &rs[k];
        k++;
    }
    if (fault == F_UNKNOWN_SEQ) {   /* a sequence this step does not hold: any id, even a live one */
        strata__internal__v1__seq_result__init(&rs[k]);
        rs[k].seq_id = arg % 16;
        rs[k].status = STRATA_EIO;
        rs[k].message = (char *)"spill failed";
        rp[k] = &rs[k];
        k++;
    }
    Strata__Internal__V1__StepResult res = STRATA__INTERNAL__V1__STEP_RESULT__INIT;
    res.step = fault == F_WRONG_STEP ? plan->step + 1 + arg % 3 : plan->step;
    res.n_results = fault == F_EMPTY ? 0 : k;
    res.results = rp;
    Strata__Internal__V1__WorkerMessage m = STRATA__INTERNAL__V1__WORKER_MESSAGE__INIT;
    m.kind_case = STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_STEP_RESULT;
    m.step_result = &res;
    send_worker_message(R, p, &m);
    if (fault == F_TWICE)
        send_worker_message(R, p, &m);
    free(rs);
    free(rp);
}

static void answer_migrate(run *R, ctl_peer *p, const Strata__Internal__V1__Migrate *mg, int fault, uint8_t arg)
{
    if (fault == 4 && R->cfg.step_timeout_ms)
        return;
    Strata__Internal__V1__MigrateDone d = STRATA__INTERNAL__V1__MIGRATE_DONE__INIT;
    d.seq_id = fault == 2 ? mg->seq_id + 1 : mg->seq_id;
    d.status = fault == 1 ? STRATA_EIO : 0;
    d.message = d.status ? (char *)"link refused" : (char *)"";
    Strata__Internal__V1__WorkerMessage m = STRATA__INTERNAL__V1__WORKER_MESSAGE__INIT;
    m.kind_case = STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_MIGRATE_DONE;
    m.migrate_done = &d;
    send_worker_message(R, p, &m);
    if (fault == 3 || (fault && arg & 1))
        send_worker_message(R, p, &m);
}

/* A worker handles its oldest message: fault -1 as a correct worker does, else wrongly. Returns
 * false when it had none. */
static bool handle(run *R, ctl_peer *p, int fault, uint8_t arg)
{
    queued *q = take_message(p);
    if (!q)
        return false;
    const Strata__Internal__V1__CoordinatorMessage *m = q->m;
    switch (m->kind_case) {
    case STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_ASSIGNMENT: {
        const uint8_t v[6] = {0, 0, 1, 2, 0, 0};   /* ready: its first report */
        say("  %s: assignment (replica %u stage %u)", p->name, m->assignment->replica, m->assignment->stage);
        send_report(R, p, v);
        break;
    }
    case STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_STEP_PLAN:
        say("  %s: step %" PRIu64 " (%zu seqs)%s", p->name, m->step_plan->step, m->step_plan->n_seqs,
            fault >= 0 ? " answered wrongly" : "");
        for (size_t i = 0; i < m->step_plan->n_seqs; i++)
            say("    seq %" PRIu64 " pos %u, %zu tokens%s%s", m->step_plan->seqs[i]->seq_id, m->step_plan->seqs[i]->pos0,
                m->step_plan->seqs[i]->n_tokens, m->step_plan->seqs[i]->sample ? ", sample" : "",
                m->step_plan->seqs[i]->prefix_entry ? ", from a prefix entry" : "");
        answer_step(R, p, m->step_plan, fault < 0 ? -1 : fault % N_FAULTS, arg);
        break;
    case STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_MIGRATE:
        say("  %s: migrate %" PRIu64 "%s", p->name, m->migrate->seq_id, fault >= 0 ? " answered wrongly" : "");
        answer_migrate(R, p, m->migrate, fault < 0 ? 0 : fault % 5, arg);
        break;
    case STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_SHUTDOWN:
        say("  %s: shutdown", p->name);
        lose(p, 0);
        break;
    default:
        break;
    }
    free_queued(q);
    return true;
}

static void generate(run *R, reader *in)
{
    if (H.n_streams == MAX_STREAMS)
        return;
    api_stream *st = &H.streams[H.n_streams];
    memset(st, 0, sizeof *st);
    snprintf(st->rid, sizeof st->rid, "r%d", H.n_streams);
    const uint8_t shape = next_byte(in);
    const size_t n = 1 + next_byte(in) % MAX_PROMPT;
    /* Prompts from a few shared openings, so that prefix caching finds entries. */
    for (size_t i = 0; i < n; i++) {
        const uint8_t b = next_byte(in);
        st->id_buf[i] = i < 20 && (shape & 1) ? (uint32_t)(100 + i) : b * 3u + (shape >> 7);
    }
    strata__v1__generate_request__init(&st->req);
    strata__v1__sampling_params__init(&st->sp);
    strata__v1__token_ids__init(&st->ids);
    st->ids.n_ids = n;
    st->ids.ids = st->id_buf;
    st->req.input_case = STRATA__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS;
    st->req.token_ids = &st->ids;
    st->req.request_id = st->rid;
    st->req.sampling = &st->sp;
    const uint8_t mt = next_byte(in);
    st->sp.max_tokens = mt == 255 ? CTX : 1 + mt % 12u;
    st->sp.ignore_eos = shape & 2;
    if (shape & 4) {
        st->stop_ids[0] = (uint32_t)((shape * 5u) % H.n_vocab);
        st->sp.stop_token_ids = st->stop_ids;
        st->sp.n_stop_token_ids = 1;
    }
    static const char *const codecs[] = {"", "", "fp16", "kivi2", "gear2", "nonesuch"};
    st->req.kv_codec = (char *)codecs[next_byte(in) % (sizeof codecs / sizeof codecs[0])];
    st->n_prompt = (uint32_t)n;
    st->max_tokens = st->sp.max_tokens;
    H.n_streams++;
    strata_error err = {0};
    int rc = proto_validate_generate(&st->req, coord_limits(R->c), &err);
    if (rc == STRATA_OK) {
        pthread_mutex_lock(&H.mu);
        st->accepted = true;   /* the coordinator may make its terminal call before generate returns */
        pthread_mutex_unlock(&H.mu);
        gpr_timespec never = {.tv_sec = INT64_MAX, .tv_nsec = 0, .clock_type = GPR_CLOCK_MONOTONIC};
        rc = R->api.generate(R->api.ctx, &st->req, st, never, &err);
        if (rc != STRATA_OK) {
            pthread_mutex_lock(&H.mu);
            if (st->terminal || st->n_ids)
                violation("request %s: refused (%s) after the coordinator used its stream", st->rid, err.msg);
            st->accepted = false;
            pthread_mutex_unlock(&H.mu);
        }
    }
    say("  generate %s: %zu tokens, max %u, codec '%s': %s", st->rid, n, st->sp.max_tokens, st->req.kv_codec,
        rc == STRATA_OK ? "accepted" : err.msg);
}

static bool stream_open(const api_stream *st)
{
    pthread_mutex_lock(&H.mu);
    const bool open = st->accepted && !st->terminal;
    pthread_mutex_unlock(&H.mu);
    return open;
}

static void cancel(run *R, api_stream *st)
{
    pthread_mutex_lock(&H.mu);
    const bool call = st->accepted && !st->cancelled && !st->terminal;
    st->cancelled |= call;
    pthread_mutex_unlock(&H.mu);
    if (call) {
        say("  cancel %s", st->rid);
        R->api.cancel(R->api.ctx, st);
    }
}

static void stats(run *R)
{
    strata_error err = {0};
    Strata__V1__Stats s = STRATA__V1__STATS__INIT;
    Strata__V1__TierStats tiers[API_STATS_MAX_TIERS], *tp[API_STATS_MAX_TIERS];
    for (size_t i = 0; i < API_STATS_MAX_TIERS; i++) {
        strata__v1__tier_stats__init(&tiers[i]);
        tp[i] = &tiers[i];
    }
    s.tiers = tp;
    if (R->api.stats(R->api.ctx, &s, &err) == STRATA_OK && s.n_tiers > API_STATS_MAX_TIERS)
        violation("stats: %zu tiers", s.n_tiers);
    Strata__V1__HealthResponse h = STRATA__V1__HEALTH_RESPONSE__INIT;
    (void)R->api.health(R->api.ctx, &h, &err);
    Strata__V1__ModelInfo mi = STRATA__V1__MODEL_INFO__INIT;
    (void)R->api.model_info(R->api.ctx, &mi, &err);
}

static void wait_sent(int ms)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_nsec += (long)ms * 1000000L;
    until.tv_sec += until.tv_nsec / 1000000000L;
    until.tv_nsec %= 1000000000L;
    pthread_mutex_lock(&H.mu);
    (void)pthread_cond_timedwait(&H.sent, &H.mu, &until);
    pthread_mutex_unlock(&H.mu);
}

static void raw_message(run *R, reader *in)
{
    ctl_peer *p = pick_peer(next_byte(in));
    size_t n = next_byte(in);
    if (n > in->left)
        n = in->left;
    Strata__Internal__V1__WorkerMessage *m = strata__internal__v1__worker_message__unpack(NULL, n, in->p);
    in->p += n;
    in->left -= n;
    if (!m)
        return;
    /* The control server ends the stream on an empty message or a second Join instead. */
    if (p && m->kind_case != STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND__NOT_SET &&
        m->kind_case != STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_JOIN) {
        say("  %s: raw message (kind %d)", p->name, (int)m->kind_case);
        send_worker_message(R, p, m);
    }
    strata__internal__v1__worker_message__free_unpacked(m, NULL);
}

static void run_op(run *R, reader *in)
{
    const int op = next_byte(in) % N_OPS;
    ctl_peer *p;
    switch (op) {
    case OP_JOIN:
        join(R, next_byte(in), false);
        break;
    case OP_HANDLE:
        if ((p = pick_peer(next_byte(in))))
            (void)handle(R, p, -1, 0);
        break;
    case OP_MISHANDLE: {
        p = pick_peer(next_byte(in));
        const uint8_t fault = next_byte(in), arg = next_byte(in);
        if (p)
            (void)handle(R, p, fault, arg);
        break;
    }
    case OP_REPORT: {
        p = pick_peer(next_byte(in));
        uint8_t v[6];
        for (int i = 0; i < 6; i++)
            v[i] = next_byte(in);
        if (p)
            send_report(R, p, v);
        break;
    }
    case OP_GENERATE:
        generate(R, in);
        break;
    case OP_CANCEL: {
        const uint8_t b = next_byte(in);
        if (H.n_streams)
            cancel(R, &H.streams[b % H.n_streams]);
        break;
    }
    case OP_ABORT: {
        const uint8_t b = next_byte(in);
        if (!H.n_streams)
            break;
        api_stream *st = &H.streams[b % H.n_streams];
        const bool was_open = stream_open(st);
        const bool found = R->api.abort(R->api.ctx, st->rid);
        say("  abort %s: %s", st->rid, found ? "found" : "unknown");
        if (found && !was_open)
            violation("abort found request %s, which had ended", st->rid);
        break;
    }
    case OP_GONE:
        if ((p = pick_peer(next_byte(in)))) {
            say("  %s lost", p->name);
            lose(p, 14 /* UNAVAILABLE */);
        }
        break;
    case OP_DRAIN:
        if ((p = pick_peer(next_byte(in)))) {
            coord_drain_report rep;
            strata_error err = {0};
            const int rc = coord_drain_worker(R->c, p->name, &rep, &err);
            say("  drain %s: %s", p->name, rc == STRATA_OK ? rep.message : err.msg);
        }
        break;
    case OP_STATS:
        stats(R);
        break;
    case OP_RAW:
        raw_message(R, in);
        break;
    case OP_WAIT:
        wait_sent(1 + next_byte(in) % 4);
        break;
    }
    deliver_gone(R);
}

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static int open_requests(void)
{
    int n = 0;
    for (int i = 0; i < H.n_streams; i++)
        n += stream_open(&H.streams[i]);
    return n;
}

static int live_workers(void)
{
    int n = 0;
    pthread_mutex_lock(&H.mu);
    for (int i = 0; i < H.n_peers; i++)
        n += H.peers[i].joined && !H.peers[i].closing;
    pthread_mutex_unlock(&H.mu);
    return n;
}

/* The well-behaved end: workers fill the free slots and answer everything correctly until no
 * request is open. */
static void settle(run *R)
{
    const double until = now_ms() + LIVENESS_MS;
    while (open_requests() && now_ms() < until) {
        bool any = false;
        deliver_gone(R);
        if (live_workers() < REPLICAS * STAGES && H.n_peers < MAX_PEERS)
            join(R, 0, true);
        for (int i = 0; i < H.n_peers; i++)
            while (handle(R, &H.peers[i], -1, 0))
                any = true;
        if (!any)
            wait_sent(2);
    }
    deliver_gone(R);
    if (open_requests()) {
        for (int i = 0; i < H.n_streams; i++)
            if (stream_open(&H.streams[i]))
                fprintf(stderr, "fuzz_coord: request %s still open (%u tokens streamed)\n", H.streams[i].rid,
                        H.streams[i].n_ids);
        for (int i = 0; i < H.n_peers; i++)
            fprintf(stderr, "fuzz_coord: worker %s joined=%d closing=%d queued=%d\n", H.peers[i].name,
                    H.peers[i].joined, H.peers[i].closing, H.peers[i].head != NULL);
        violation("%d request(s) never ended although every worker answered correctly for %d ms", open_requests(),
                  LIVENESS_MS);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    H.verbose = getenv("FUZZ_COORD_VERBOSE") != NULL;
    H.n_peers = H.n_streams = 0;
    reader in = {data, size};
    const uint8_t conf = next_byte(&in);
    run R;
    memset(&R, 0, sizeof R);
    R.cfg.model_path = "synthetic:tiny:seed=1";
    R.cfg.replicas = REPLICAS;
    R.cfg.stages = STAGES;
    R.cfg.kv = "kivi4";
    R.cfg.kv_codecs = "fp16;kivi2";
    R.cfg.block_tokens = BLOCK_TOKENS;
    R.cfg.ctx = CTX;
    R.cfg.max_seqs = 4;
    R.cfg.max_batch_tokens = 64;
    R.cfg.steps_in_flight = conf & 1 ? 1 : 0;
    R.cfg.device_kv_bytes = (conf & 2 ? 48u : 160u) << 10;   /* a few blocks, or room for all */
    R.cfg.host_kv_bytes = conf & 4 ? 1u << 20 : 0;
    R.cfg.prefix_cache_bytes = conf & 8 && R.cfg.host_kv_bytes ? 256u << 10 : 0;
    R.cfg.step_timeout_ms = conf & 16 ? 300 : 0;   /* with it, workers may also never answer */
    R.cfg.max_recoveries = conf & 32 ? 2 : 0;      /* requests that lose their KV go on from their tokens, */
    R.cfg.recovery_wait_ms = conf & 32 ? 300 : 0;  /* waiting for a replica when none serves */
    R.cfg.quiet = !H.verbose;
    strata_error err = {0};
    if (!(R.c = coord_create(&R.cfg, &err))) {
        fprintf(stderr, "fuzz_coord: coord_create: %s\n", err.msg);
        abort();
    }
    R.api = coord_api_backend(R.c);
    R.ctl = coord_ctl_handler(R.c);
    H.n_vocab = coord_limits(R.c)->n_vocab;
    for (int ops = 0; in.left && ops < 400; ops++)
        run_op(&R, &in);
    settle(&R);
    /* Teardown as serve does it: the API server's shutdown cancels what is left (nothing, after
     * settle), coord_stop, then the control server ends every stream. */
    coord_stop(R.c);
    for (int i = 0; i < H.n_peers; i++)
        lose(&H.peers[i], 14);
    deliver_gone(&R);
    coord_destroy(R.c);
    for (int i = 0; i < H.n_peers; i++) {
        ctl_peer *p = &H.peers[i];
        if (p->refs)
            violation("worker %s: %d reference(s) left after coord_destroy", p->name, p->refs);
        for (queued *q = p->head, *next; q; q = next) {
            next = q->next;
            free_queued(q);
        }
        p->head = p->tail = NULL;
    }
    for (int i = 0; i < H.n_streams; i++)
        if (H.streams[i].accepted && H.streams[i].terminal != 1)
            violation("request %s: %d terminal calls", H.streams[i].rid, H.streams[i].terminal);
    return 0;
}
