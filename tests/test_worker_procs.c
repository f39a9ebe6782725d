/* Two real strata-worker processes as one 2-stage replica of the default model, driven through
 * the real control plane (this test plays the coordinator's part with ctl_server) and joined by
 * the real TCP data plane: the greedy tokens of three sequences batched together equal each one
 * run alone through model_forward in this process. Then a worker is killed mid-generation: the
 * coordinator side sees it gone (UNAVAILABLE) within seconds and the other worker's next step
 * fails cleanly instead of hanging. Also: a worker with the wrong cluster secret is refused, and
 * a worker let go in the middle of a long step exits within --exit-timeout, and a worker given its
 * messages out of order answers or leaves, as each calls for. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "coordinator/control/control_server.h"
#include "kvstore/clock.h"
#include "kvstore/plan.h"
#include "worker/model.h"

#define SECRET "the cluster secret of this test"
#define N_SEQ 3
#define STEPS 8

static const char *model_path(void) { return getenv("STRATA_MODEL") ? getenv("STRATA_MODEL") : STRATA_DEFAULT_MODEL; }

/* What the control server's threads hand to the test thread. */
typedef struct event {
    int kind;            /* 1 join, 2 step result, 3 kv report, 4 gone, 5 migrate done */
    ctl_peer *peer;
    uint64_t step;
    size_t n;
    uint64_t ids[8];
    uint32_t tokens[8], status[8];
    char data_addr[128], why[256];
    int grpc_status;
} event;

typedef struct hub {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    event ev[256];
    size_t head, tail;
} hub;

static void post(hub *h, const event *e)
{
    pthread_mutex_lock(&h->mu);
    h->ev[h->tail++ % 256] = *e;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
}

/* The next event of a kind (others before it are dropped), or false after timeout_s. */
static bool wait_event(hub *h, int kind, int timeout_s, event *out)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += timeout_s;
    pthread_mutex_lock(&h->mu);
    for (;;) {
        while (h->head < h->tail) {
            event e = h->ev[h->head++ % 256];
            if (e.kind == kind) {
                *out = e;
                pthread_mutex_unlock(&h->mu);
                return true;
            }
        }
        if (pthread_cond_timedwait(&h->cv, &h->mu, &until) == ETIMEDOUT) {
            pthread_mutex_unlock(&h->mu);
            return false;
        }
    }
}

static int on_join(void *ctx, ctl_peer *peer, const Strata__Internal__V1__Join *join, strata_error *err)
{
    (void)err;
    event e = {.kind = 1, .peer = peer};
    snprintf(e.data_addr, sizeof e.data_addr, "%s", join->data_addr);
    ctl_peer_ref(peer);
    post(ctx, &e);
    return STRATA_OK;
}

static void on_message(void *ctx, ctl_peer *peer, const Strata__Internal__V1__WorkerMessage *msg)
{
    event e = {.peer = peer};
    if (msg->kind_case == STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_STEP_RESULT) {
        e.kind = 2;
        e.step = msg->step_result->step;
        for (size_t i = 0; i < msg->step_result->n_results && i < 8; i++) {
            e.ids[i] = msg->step_result->results[i]->seq_id;
            e.tokens[i] = msg->step_result->results[i]->token;
            e.status[i] = msg->step_result->results[i]->status;
            e.n++;
        }
    } else if (msg->kind_case == STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_KV_REPORT) {
        e.kind = 3;
    } else if (msg->kind_case == STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_MIGRATE_DONE) {
        e.kind = 5;
        e.ids[0] = msg->migrate_done->seq_id;
        e.status[0] = msg->migrate_done->status;
        snprintf(e.why, sizeof e.why, "%s", msg->migrate_done->message ? msg->migrate_done->message : "");
    } else {
        return;
    }
    post(ctx, &e);
}

static void on_gone(void *ctx, ctl_peer *peer, int grpc_status, const char *why)
{
    event e = {.kind = 4, .peer = peer, .grpc_status = grpc_status};
    snprintf(e.why, sizeof e.why, "%s", why ? why : "");
    post(ctx, &e);
}

/* Connects to host:port, writes a few bytes that are no handshake, and hangs up. */
static void knock(const char *host_port)
{
    char host[64];
    const char *colon = strrchr(host_port, ':');
    assert_non_null(colon);
    snprintf(host, sizeof host, "%.*s", (int)(colon - host_port), host_port);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(colon + 1))};
    assert_int_equal(inet_pton(AF_INET, host, &sa.sin_addr), 1);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    assert_int_equal(write(fd, "GET / HTTP/1.0\r\n\r\n", 18), 18);
    close(fd);
}

/* A strata-worker process; extra, extra2: more arguments (NULL: none, then extra2 NULL too). */
static pid_t spawn_worker_with(const char *addr, const char *secret_file, const char *name, const char *extra,
                               const char *extra2)
{
    pid_t pid = fork();
    if (pid == 0) {
        execl(STRATA_WORKER_BIN, STRATA_WORKER_BIN, "--coordinator", addr, "--secret-file", secret_file, "--name", name,
              "--quiet", extra, extra2, (char *)NULL);
        _exit(127);
    }
    return pid;
}

static pid_t spawn_worker(const char *addr, const char *secret_file, const char *name)
{
    return spawn_worker_with(addr, secret_file, name, NULL, NULL);
}

static int32_t argmax(const float *x, int n)
{
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return best;
}

/* Stage `stage` of n_stages (addrs: their data addresses) over layers [layer_begin, layer_end),
 * for sequences of up to max_tokens tokens, a step of up to that many; the coordinator's step
 * timeout step_timeout_ms (0: none). */
static void send_assignment_timed(ctl_peer *p, uint32_t stage, uint32_t n_stages, uint32_t layer_begin,
                                  uint32_t layer_end, char **addrs, uint32_t max_tokens, uint32_t step_timeout_ms)
{
    Strata__Internal__V1__Assignment a = STRATA__INTERNAL__V1__ASSIGNMENT__INIT;
    a.model_path = (char *)model_path();
    a.layer_begin = layer_begin;
    a.layer_end = layer_end;
    a.n_layers_total = 30;
    a.stage = stage;
    a.n_stages = n_stages;
    a.n_stage_data_addrs = n_stages;
    a.stage_data_addrs = addrs;
    a.kv_plan = (char *)"kivi4";
    a.block_tokens = 64;
    a.max_seq_tokens = max_tokens;
    a.device_kv_bytes = 128u << 20;
    a.max_batch_seqs = 8;
    a.max_batch_tokens = max_tokens;
    a.step_timeout_ms = step_timeout_ms;
    Strata__Internal__V1__CoordinatorMessage m = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__INIT;
    m.kind_case = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_ASSIGNMENT;
    m.assignment = &a;
    strata_error err = {0};
    if (ctl_peer_send(p, &m, &err) != STRATA_OK)
        fail_msg("assignment: %s", err.msg);
}

static void send_assignment_of(ctl_peer *p, uint32_t stage, uint32_t n_stages, uint32_t layer_begin,
                               uint32_t layer_end, char **addrs, uint32_t max_tokens)
{
    send_assignment_timed(p, stage, n_stages, layer_begin, layer_end, addrs, max_tokens, 600000);
}

static void send_assignment(ctl_peer *p, uint32_t stage, uint32_t layer_begin, uint32_t layer_end, char **addrs)
{
    send_assignment_of(p, stage, 2, layer_begin, layer_end, addrs, 2048);
}

typedef struct seq_state {
    uint64_t id;
    int32_t prompt[200];
    size_t n_prompt, len, n_got;
    int32_t want[STEPS], got[STEPS];
} seq_state;

static int send_plan(ctl_peer *const *peers, uint64_t step, seq_state *seqs, size_t n)
{
    Strata__Internal__V1__SeqWork w[N_SEQ], *wp[N_SEQ];
    uint32_t toks[N_SEQ][200];
    Strata__Internal__V1__StepPlan plan = STRATA__INTERNAL__V1__STEP_PLAN__INIT;
    plan.step = step;
    plan.seqs = wp;
    for (size_t i = 0; i < n; i++) {
        strata__internal__v1__seq_work__init(&w[i]);
        w[i].seq_id = seqs[i].id;
        w[i].sample = true;
        if (seqs[i].len == 0) {
            for (size_t k = 0; k < seqs[i].n_prompt; k++)
                toks[i][k] = (uint32_t)seqs[i].prompt[k];
            w[i].n_tokens = seqs[i].n_prompt;
            w[i].last_chunk_of_prompt = true;
        } else {
            toks[i][0] = (uint32_t)seqs[i].got[seqs[i].n_got - 1];
            w[i].n_tokens = 1;
        }
        w[i].tokens = toks[i];
        w[i].pos0 = (uint32_t)seqs[i].len;
        wp[plan.n_seqs++] = &w[i];
    }
    Strata__Internal__V1__CoordinatorMessage m = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__INIT;
    m.kind_case = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_STEP_PLAN;
    m.step_plan = &plan;
    strata_error err = {0};
    int rc = STRATA_OK;
    for (int i = 0; i < 2 && rc == STRATA_OK; i++)
        if (peers[i])
            rc = ctl_peer_send(peers[i], &m, &err);
    return rc;
}

/* The coordinator's side of this test: a control server on an ephemeral port (its address in
 * addr) whose events go to h, and the cluster secret in a new file (its path in secret_file, a
 * mkstemp template). */
static ctl_server *start_control(hub *h, char addr[64], char *secret_file)
{
    ctl_server_options o = ctl_server_options_default();
    o.listen_addr = "127.0.0.1:0";
    o.cluster_secret = SECRET;
    o.cluster_secret_len = strlen(SECRET);
    o.keepalive_time_ms = 1000;
    o.keepalive_timeout_ms = 1000;
    o.min_recv_ping_interval_ms = 500;
    ctl_handler handler = {.ctx = h, .on_join = on_join, .on_message = on_message, .on_gone = on_gone};
    ctl_server *srv = NULL;
    strata_error err = {0};
    if (ctl_server_start(&o, &handler, &srv, &err) != STRATA_OK)
        fail_msg("%s", err.msg);
    snprintf(addr, 64, "127.0.0.1:%d", ctl_server_port(srv));
    int fd = mkstemp(secret_file);
    assert_true(fd >= 0 && write(fd, SECRET "\n", strlen(SECRET) + 1) == (ssize_t)strlen(SECRET) + 1);
    close(fd);
    return srv;
}

static void test_two_worker_processes(void **state)
{
    (void)state;
    hub h = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    char addr[64], secret_file[] = "/tmp/strata-secret-XXXXXX", bad_file[] = "/tmp/strata-badsecret-XXXXXX";
    ctl_server *srv = start_control(&h, addr, secret_file);
    strata_error err = {0};
    int fd = mkstemp(bad_file);
    assert_true(fd >= 0 && write(fd, "not the cluster secret!!", 24) == 24);
    close(fd);

    /* A wrong secret is refused: the process exits with an error, no join is seen. */
    pid_t intruder = spawn_worker(addr, bad_file, "intruder");
    int status = 0;
    assert_int_equal(waitpid(intruder, &status, 0), intruder);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 1);

    pid_t pids[2] = {spawn_worker(addr, secret_file, "w0"), spawn_worker(addr, secret_file, "w1")};
    event j0, j1;
    assert_true(wait_event(&h, 1, 30, &j0));
    assert_true(wait_event(&h, 1, 30, &j1));
    if (!strcmp(ctl_peer_name(j0.peer), "w1")) {   /* joins arrive in any order: stage by name */
        event t = j0;
        j0 = j1;
        j1 = t;
    }
    assert_string_equal(ctl_peer_name(j0.peer), "w0");
    ctl_peer *peers[2] = {j0.peer, j1.peer};
    char *addrs[2] = {j0.data_addr, j1.data_addr};
    /* A stranger knocks on stage 1's data port first (a port scanner, a TCP probe): the worker
     * must ignore it and still link up with stage 0. */
    knock(j1.data_addr);
    send_assignment(peers[0], 0, 0, 15, addrs);
    send_assignment(peers[1], 1, 15, 30, addrs);
    event ev;
    assert_true(wait_event(&h, 3, 60, &ev));   /* both report their KV once ready */
    assert_true(wait_event(&h, 3, 60, &ev));

    /* References: each sequence alone on the whole model. */
    model *full = model_load(model_path(), 0, -1, &err);
    assert_non_null(full);
    seq_state seqs[N_SEQ] = {{.id = 7, .n_prompt = 12}, {.id = 8, .n_prompt = 90}, {.id = 9, .n_prompt = 170}};
    kv_geometry g = model_kv_geometry(full, 64);
    kv_codec_params plan[30];
    assert_int_equal(kv_plan_parse("kivi4", 30, plan, &err), STRATA_OK);
    float *logits = malloc(49152 * sizeof *logits);
    for (size_t i = 0; i < N_SEQ; i++) {
        for (size_t k = 0; k < seqs[i].n_prompt; k++)
            seqs[i].prompt[k] = (int32_t)(1 + (k * 2654435761u + i * 97) % 40000);
        kv_pool *pool = kv_pool_create_plan(&g, plan, 8, &err);
        kv_seq *seq = kv_seq_create(pool, 1024, &err);
        assert_int_equal(model_forward(full, seq, seqs[i].prompt, seqs[i].n_prompt, 0, logits, false, &err), STRATA_OK);
        seqs[i].want[0] = argmax(logits, model_get_config(full)->n_vocab);
        for (int t = 1; t < STEPS; t++) {
            assert_int_equal(model_forward(full, seq, &seqs[i].want[t - 1], 1, seqs[i].n_prompt + (size_t)t - 1, logits,
                                           false, &err), STRATA_OK);
            seqs[i].want[t] = argmax(logits, model_get_config(full)->n_vocab);
        }
        kv_seq_destroy(seq);
        kv_pool_destroy(pool);
    }
    free(logits);
    model_free(full);

    for (uint64_t step = 1; step <= STEPS; step++) {
        assert_int_equal(send_plan(peers, step, seqs, N_SEQ), STRATA_OK);
        bool from_last = false, from_first = false;
        while (!from_last || !from_first) {
            if (!wait_event(&h, 2, 60, &ev))
                fail_msg("no step result for step %llu", (unsigned long long)step);
            assert_int_equal(ev.step, step);
            if (ev.peer == peers[0]) {
                assert_int_equal(ev.n, 0);   /* nothing failed on the first stage */
                from_first = true;
                continue;
            }
            from_last = true;
            assert_int_equal(ev.n, N_SEQ);
            for (size_t r = 0; r < ev.n; r++) {
                assert_int_equal(ev.status[r], 0);
                for (size_t i = 0; i < N_SEQ; i++)
                    if (seqs[i].id == ev.ids[r]) {
                        seqs[i].len += seqs[i].len ? 1 : seqs[i].n_prompt;
                        seqs[i].got[seqs[i].n_got++] = (int32_t)ev.tokens[r];
                    }
            }
        }
    }
    for (size_t i = 0; i < N_SEQ; i++)
        for (int t = 0; t < STEPS; t++)
            if (seqs[i].got[t] != seqs[i].want[t])
                fail_msg("sequence %llu token %d: %d from the workers, %d alone", (unsigned long long)seqs[i].id, t,
                         seqs[i].got[t], seqs[i].want[t]);

    /* Kill the last stage mid-generation: it is seen gone, and the first stage's next step
     * fails (its link to the dead stage broke) instead of hanging. */
    kill(pids[1], SIGKILL);
    waitpid(pids[1], &status, 0);
    assert_true(wait_event(&h, 4, 10, &ev));
    assert_ptr_equal(ev.peer, peers[1]);
    assert_int_equal(ev.grpc_status, 14);   /* UNAVAILABLE */
    peers[1] = NULL;
    assert_int_equal(send_plan(peers, STEPS + 1, seqs, N_SEQ), STRATA_OK);
    assert_true(wait_event(&h, 4, 30, &ev));   /* the first worker leaves: its data link is broken */
    assert_ptr_equal(ev.peer, peers[0]);
    assert_int_equal(waitpid(pids[0], &status, 0), pids[0]);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 1);

    ctl_peer_unref(j0.peer);
    ctl_peer_unref(j1.peer);
    ctl_server_shutdown(srv);
    unlink(secret_file);
    unlink(bad_file);
}

/* Waits up to timeout_s for pid to exit; its wait status, or -1 (then it is killed). */
static int exit_status_within(pid_t pid, double timeout_s)
{
    const double t0 = strata_mono_s();
    int status = 0;
    pid_t got;
    while ((got = waitpid(pid, &status, WNOHANG)) == 0 && strata_mono_s() - t0 < timeout_s)
        usleep(50 * 1000);
    if (got == pid)
        return status;
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    return -1;
}

/* A worker whose coordinator lets it go while it is deep in a step (as when --step-timeout ends a
 * worker on a hung GPU) exits within --exit-timeout instead of when the step returns, so that
 * its supervisor can start a replacement: one stage of the whole model on one thread is sent a
 * prompt of 8,000 tokens (about a minute on this CPU), and its link is closed a second later. */
static void test_let_go_mid_step_exits(void **state)
{
    (void)state;
    hub h = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    char addr[64], secret_file[] = "/tmp/strata-secret-XXXXXX";
    ctl_server *srv = start_control(&h, addr, secret_file);
    /* one compute thread: the step must outlast the check on a machine of many cores too */
    pid_t pid = spawn_worker_with(addr, secret_file, "busy", "--exit-timeout=1", "--threads=1");
    event ev;
    assert_true(wait_event(&h, 1, 30, &ev));
    ctl_peer *peer = ev.peer;
    char data_addr[128];
    snprintf(data_addr, sizeof data_addr, "%s", ev.data_addr);
    char *addrs[1] = {data_addr};
    enum { LONG_PROMPT = 8000 };
    send_assignment_of(peer, 0, 1, 0, 30, addrs, LONG_PROMPT + 64);
    assert_true(wait_event(&h, 3, 60, &ev));   /* ready */
    uint32_t *toks = malloc(LONG_PROMPT * sizeof *toks);
    assert_non_null(toks);
    for (uint32_t k = 0; k < LONG_PROMPT; k++)
        toks[k] = 1 + (k * 2654435761u) % 40000;
    Strata__Internal__V1__SeqWork w = STRATA__INTERNAL__V1__SEQ_WORK__INIT, *wp = &w;
    w.seq_id = 1;
    w.tokens = toks;
    w.n_tokens = LONG_PROMPT;
    w.last_chunk_of_prompt = true;
    w.sample = true;
    Strata__Internal__V1__StepPlan plan = STRATA__INTERNAL__V1__STEP_PLAN__INIT;
    plan.step = 1;
    plan.n_seqs = 1;
    plan.seqs = &wp;
    Strata__Internal__V1__CoordinatorMessage m = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__INIT;
    m.kind_case = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_STEP_PLAN;
    m.step_plan = &plan;
    strata_error err = {0};
    assert_int_equal(ctl_peer_send(peer, &m, &err), STRATA_OK);
    free(toks);
    sleep(1);   /* the step is under way */
    ctl_peer_close(peer, 14, "step timeout of this test");
    const double closed = strata_mono_s();
    const int status = exit_status_within(pid, 15);
    const double took = strata_mono_s() - closed;
    if (status == -1)
        fail_msg("the worker was still running %.1f s after its link was closed", took);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 1);
    assert_true(took < 10);
    ctl_peer_unref(peer);
    ctl_server_shutdown(srv);
    unlink(secret_file);
}

/* A stage waits for the previous stage's rows as long as the coordinator waits for a step
 * (Assignment.step_timeout_ms), not a fixed time: with 2 s, a last stage whose first stage never
 * got the plan gives up and leaves within seconds (it waited 120 s before whatever the step
 * timeout). */
static void test_rows_wait_follows_step_timeout(void **state)
{
    (void)state;
    hub h = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    char addr[64], secret_file[] = "/tmp/strata-secret-XXXXXX";
    ctl_server *srv = start_control(&h, addr, secret_file);
    pid_t pids[2] = {spawn_worker(addr, secret_file, "w0"), spawn_worker(addr, secret_file, "w1")};
    event j0, j1, ev;
    assert_true(wait_event(&h, 1, 30, &j0));
    assert_true(wait_event(&h, 1, 30, &j1));
    if (!strcmp(ctl_peer_name(j0.peer), "w1")) {
        event t = j0;
        j0 = j1;
        j1 = t;
    }
    ctl_peer *peers[2] = {j0.peer, j1.peer};
    char *addrs[2] = {j0.data_addr, j1.data_addr};
    send_assignment_timed(peers[0], 0, 2, 0, 15, addrs, 2048, 2000);
    send_assignment_timed(peers[1], 1, 2, 15, 30, addrs, 2048, 2000);
    assert_true(wait_event(&h, 3, 60, &ev));
    assert_true(wait_event(&h, 3, 60, &ev));
    seq_state one = {.id = 1, .n_prompt = 5, .prompt = {1, 2, 3, 4, 5}};
    ctl_peer *last_only[2] = {NULL, peers[1]};
    const double sent = strata_mono_s();
    assert_int_equal(send_plan(last_only, 1, &one, 1), STRATA_OK);
    assert_true(wait_event(&h, 4, 30, &ev));   /* the last stage leaves: no rows came */
    const double took = strata_mono_s() - sent;
    assert_ptr_equal(ev.peer, peers[1]);
    if (took < 1.5 || took > 10)
        fail_msg("the last stage left %.1f s after the step (its wait: 2 s)", took);
    int status = 0;
    assert_int_equal(waitpid(pids[1], &status, 0), pids[1]);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 1);
    kill(pids[0], SIGTERM);
    waitpid(pids[0], &status, 0);
    ctl_peer_unref(j0.peer);
    ctl_peer_unref(j1.peer);
    ctl_server_shutdown(srv);
    unlink(secret_file);
}

static void send_bare(ctl_peer *p, Strata__Internal__V1__CoordinatorMessage *m)
{
    strata_error err = {0};
    if (ctl_peer_send(p, m, &err) != STRATA_OK)
        fail_msg("send: %s", err.msg);
}

/* A coordinator that sends its messages out of order (a bug, or a coordinator of another build):
 * a migration before the assignment is answered with its error and the worker stays; a second
 * assignment, or a step plan before the first, makes the worker leave (exit status 1) rather
 * than run a step on no layers or on layers it was not given. */
static void test_messages_out_of_order(void **state)
{
    (void)state;
    hub h = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    char addr[64], secret_file[] = "/tmp/strata-secret-XXXXXX";
    ctl_server *srv = start_control(&h, addr, secret_file);
    event ev;

    pid_t pid = spawn_worker(addr, secret_file, "twice");
    assert_true(wait_event(&h, 1, 30, &ev));
    ctl_peer *peer = ev.peer;
    char data_addr[128];
    snprintf(data_addr, sizeof data_addr, "%s", ev.data_addr);
    char *addrs[1] = {data_addr};
    Strata__Internal__V1__Migrate mg = STRATA__INTERNAL__V1__MIGRATE__INIT;
    mg.seq_id = 7;
    Strata__Internal__V1__CoordinatorMessage m = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__INIT;
    m.kind_case = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_MIGRATE;
    m.migrate = &mg;
    send_bare(peer, &m);
    assert_true(wait_event(&h, 5, 30, &ev));
    assert_int_equal(ev.ids[0], 7);
    assert_int_equal(ev.status[0], STRATA_EINVAL);
    assert_string_equal(ev.why, "a migration before the assignment");
    send_assignment_of(peer, 0, 1, 0, 30, addrs, 256);
    assert_true(wait_event(&h, 3, 60, &ev));   /* ready: the migration left it serving */
    send_assignment_of(peer, 0, 1, 0, 30, addrs, 256);
    assert_true(wait_event(&h, 4, 30, &ev));
    int status = exit_status_within(pid, 15);
    assert_true(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 1);
    ctl_peer_unref(peer);

    pid = spawn_worker(addr, secret_file, "early");
    assert_true(wait_event(&h, 1, 30, &ev));
    peer = ev.peer;
    seq_state one = {.id = 1, .n_prompt = 3, .prompt = {1, 2, 3}};
    ctl_peer *alone[2] = {peer, NULL};
    assert_int_equal(send_plan(alone, 1, &one, 1), STRATA_OK);
    assert_true(wait_event(&h, 4, 30, &ev));
    assert_false(wait_event(&h, 2, 0, &ev));   /* no step result */
    status = exit_status_within(pid, 15);
    assert_true(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 1);
    ctl_peer_unref(peer);
    ctl_server_shutdown(srv);
    unlink(secret_file);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_two_worker_processes),
        cmocka_unit_test(test_let_go_mid_step_exits),
        cmocka_unit_test(test_rows_wait_follows_step_timeout),
        cmocka_unit_test(test_messages_out_of_order),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
