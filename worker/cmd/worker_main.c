/* strata-worker: one process per device. Joins the coordinator over the control plane, receives
 * its assignment (model file, layer range, replica, stage, KV plan and budgets), loads only its
 * layers, connects the data plane to its pipeline neighbours, and executes step plans until the
 * coordinator ends it. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/pidfd.h>
#include <sys/prctl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels/ops.h"
#include "kvstore/bytes.h"
#include "kvstore/clock.h"
#include "kvstore/error.h"
#include "kvstore/numarg.h"
#include "kvstore/seq_image.h"
#include "proto/credential_file.h"
#include "proto/strata_internal.pb-c.h"
#include "proto/tls_files.h"
#include "proto/validate.h"
#include "worker/control/control_client.h"
#include "worker/model.h"
#include "worker/stage/stage.h"
#include "worker/stage/stage_gpu.h"
#include "worker/transport/transport.h"

enum { EXIT_RUNTIME = 1, EXIT_USAGE = 2 };

static void usage(FILE *out)
{
    fprintf(out,
            "usage: strata-worker --coordinator HOST:PORT --secret-file FILE [options]\n"
            "\n"
            "A strata worker: joins the coordinator, loads the layers it is assigned and runs their\n"
            "steps (on the CPU, or a GPU with --device). Usually started by `strata serve` or deploy/\n"
            "units, not by hand.\n"
            "\n"
            "  --coordinator HOST:PORT  the coordinator's worker endpoint (required)\n"
            "  --secret-file FILE       file holding the cluster secret, 16-256 bytes (required;\n"
            "                           a trailing newline is ignored)\n"
            "  --coordinator-ca FILE    TLS to a coordinator whose control port has it: the CA\n"
            "                           (PEM) that signed its certificate, or that certificate\n"
            "                           when self-signed; it must name the --coordinator host\n"
            "  --name NAME              worker name in logs and for DrainWorker (default: worker-<pid>)\n"
            "  --data HOST:PORT         data-plane listen address for pipeline neighbours\n"
            "                           (default 127.0.0.1:0, an ephemeral port)\n"
            "  --device cpu|cuda[:N]    where the layers and the KV run (default cpu); cuda: GPU N's\n"
            "                           fp16 weights and compressed KV (the codecs the coordinator\n"
            "                           offers; rows to a GPU neighbour over NCCL, to a CPU one over\n"
            "                           TCP; this program has not run on a GPU yet: docs/gpu.md)\n"
            "  --device-kv-mib N        device KV memory offered in MiB, fractions allowed (default 256)\n"
            "  --host-kv-mib N          host tier offered (default 0: none; 64 with --nvme-dir)\n"
            "  --nvme-dir DIR           spill directory of the NVMe tier (default: none)\n"
            "  --nvme-kv-mib N          NVMe tier offered (default 1024 with --nvme-dir)\n"
            "  --connect-timeout-ms N   give up reaching the coordinator after N ms (default 30000)\n"
            "  --exit-timeout N         once the coordinator ended the link or told this worker to\n"
            "                           stop, or a stop signal came, exit within N s even when a\n"
            "                           step is still running (a hung device), so that a supervisor\n"
            "                           can start a replacement; 0: wait for the step (default 60)\n"
            "  --threads N              compute threads (default: the number OpenBLAS picks; results\n"
            "                           of long prompts depend on it, so keep it equal across runs\n"
            "                           you compare)\n"
            "  -q, --quiet              only errors on stderr\n"
            "  -h, --help               this help\n");
}

typedef struct worker_opts {
    const char *coordinator, *secret_file, *name, *data, *nvme_dir, *coordinator_ca;
    double device_mib, host_mib, nvme_mib;   /* MiB, fractions allowed; nvme_mib < 0: unset */
    long connect_timeout_ms, exit_timeout_s, threads;
    long cuda_device;   /* -1: the CPU */
    bool quiet;
} worker_opts;

static int parse(int argc, char **argv, worker_opts *o)
{
    static const struct option opts[] = {
        {"coordinator", required_argument, NULL, 'c'}, {"secret-file", required_argument, NULL, 's'},
        {"name", required_argument, NULL, 'n'},        {"data", required_argument, NULL, 'd'},
        {"device-kv-mib", required_argument, NULL, 'D'}, {"host-kv-mib", required_argument, NULL, 'H'},
        {"nvme-dir", required_argument, NULL, 'N'},    {"nvme-kv-mib", required_argument, NULL, 'M'},
        {"connect-timeout-ms", required_argument, NULL, 'T'}, {"quiet", no_argument, NULL, 'q'},
        {"exit-timeout", required_argument, NULL, 'X'}, {"coordinator-ca", required_argument, NULL, 'C'},
        {"threads", required_argument, NULL, 'P'},     {"device", required_argument, NULL, 'G'},
        {"help", no_argument, NULL, 'h'},              {NULL, 0, NULL, 0},
    };
    *o = (worker_opts){.data = "127.0.0.1:0", .device_mib = 256, .nvme_mib = -1, .connect_timeout_ms = 30000,
                       .exit_timeout_s = 60, .cuda_device = -1};
    int c;
    while ((c = getopt_long(argc, argv, "qh", opts, NULL)) != -1) {
        switch (c) {
        case 'c':
            o->coordinator = optarg;
            if (!strata_check_addr("strata-worker", "--coordinator", optarg, false))
                return EXIT_USAGE;
            break;
        case 's': o->secret_file = optarg; break;
        case 'C': o->coordinator_ca = optarg; break;
        case 'n': o->name = optarg; break;
        case 'd': o->data = optarg; break;
        case 'N': o->nvme_dir = optarg; break;
        case 'D': if (!strata_parse_double("strata-worker", "--device-kv-mib", optarg, STRATA_KV_MIB_MIN, STRATA_KV_MIB_MAX, &o->device_mib)) return EXIT_USAGE; break;
        case 'H': if (!strata_parse_double("strata-worker", "--host-kv-mib", optarg, 0, STRATA_KV_MIB_MAX, &o->host_mib)) return EXIT_USAGE; break;
        case 'M': if (!strata_parse_double("strata-worker", "--nvme-kv-mib", optarg, STRATA_KV_MIB_MIN, STRATA_KV_MIB_MAX, &o->nvme_mib)) return EXIT_USAGE; break;
        case 'T': if (!strata_parse_long("strata-worker", "--connect-timeout-ms", optarg, 1, 3600000, &o->connect_timeout_ms)) return EXIT_USAGE; break;
        case 'X': if (!strata_parse_long("strata-worker", "--exit-timeout", optarg, 0, 86400, &o->exit_timeout_s)) return EXIT_USAGE; break;
        case 'P': if (!strata_parse_long("strata-worker", "--threads", optarg, 1, 1024, &o->threads)) return EXIT_USAGE; break;
        case 'G':
            if (!strcmp(optarg, "cpu")) {
                o->cuda_device = -1;
            } else if (!strcmp(optarg, "cuda")) {
                o->cuda_device = 0;
            } else if (!strncmp(optarg, "cuda:", 5)) {
                if (!strata_parse_long("strata-worker", "--device cuda:N", optarg + 5, 0, 1023, &o->cuda_device)) return EXIT_USAGE;
            } else {
                fprintf(stderr, "strata-worker: --device takes cpu, cuda or cuda:N (got '%s')\n", optarg);
                return EXIT_USAGE;
            }
            break;
        case 'q': o->quiet = true; break;
        case 'h': usage(stdout); return -1;
        default: usage(stderr); return EXIT_USAGE;
        }
    }
    if (optind != argc) {
        fprintf(stderr, "strata-worker: unexpected argument '%s' (try --help)\n", argv[optind]);
        return EXIT_USAGE;
    }
    if (!o->coordinator || !o->secret_file) {
        fprintf(stderr, "strata-worker: --coordinator and --secret-file are required (try --help)\n");
        return EXIT_USAGE;
    }
    if (o->name && !proto_worker_name_valid(o->name)) {
        fprintf(stderr, "strata-worker: --name must be 1-%d bytes of UTF-8 without control characters\n",
                PROTO_MAX_WORKER_NAME);
        return EXIT_USAGE;
    }
    if (o->nvme_mib >= 0 && !o->nvme_dir) {
        fprintf(stderr, "strata-worker: --nvme-kv-mib needs --nvme-dir\n");
        return EXIT_USAGE;
    }
    struct stat st;   /* told now rather than after joining, when the stage first opens it */
    if (o->nvme_dir && stat(o->nvme_dir, &st) == 0 && !S_ISDIR(st.st_mode)) {
        fprintf(stderr, "strata-worker: --nvme-dir %s: not a folder\n", o->nvme_dir);
        return EXIT_USAGE;
    }
    if (o->nvme_dir && o->nvme_mib < 0)
        o->nvme_mib = 1024;
    if (o->nvme_dir && o->host_mib == 0)
        o->host_mib = 64;   /* the NVMe tier sits below a host tier */
    return 0;
}

/* A secret file longer than this is refused before its length is checked (it is no secret). */
#define WORKER_SECRET_FILE_MAX 4096

/* Reads the cluster secret (proto/credential_file.h): 16 to max bytes once a trailing newline
 * (LF or CRLF) is dropped, the coordinator's rule. buf holds max bytes. */
static int read_secret(const char *path, uint8_t *buf, size_t max, size_t *len)
{
    char *data = NULL;
    strata_error err = {0};
    if (credential_file_read(path, WORKER_SECRET_FILE_MAX, true, &data, len, &err) != STRATA_OK) {
        if (err.code == STRATA_EINVAL)
            fprintf(stderr, "strata-worker: --secret-file %s: %s; a secret has at most %zu bytes\n", path, err.msg, max);
        else
            fprintf(stderr, "strata-worker: --secret-file %s: %s\n", path, err.msg);
        return EXIT_USAGE;
    }
    const bool ok = *len >= PROTO_SECRET_MIN_BYTES && *len <= max;
    if (ok)
        memcpy(buf, data, *len);
    else   /* as the coordinator reads it */
        fprintf(stderr, "strata-worker: --secret-file %s: the secret must be %d to %zu bytes (a trailing newline "
                        "is ignored); it has %zu\n", path, PROTO_SECRET_MIN_BYTES, max, *len);
    explicit_bzero(data, *len);
    free(data);
    return ok ? 0 : EXIT_USAGE;
}

static int send_step_result(ctl_client *cc, const stage_result *r, strata_error *err)
{
    Strata__Internal__V1__StepResult sr = STRATA__INTERNAL__V1__STEP_RESULT__INIT;
    Strata__Internal__V1__SeqResult *items = calloc(r->n_seqs ? r->n_seqs : 1, sizeof *items);
    Strata__Internal__V1__SeqResult **ptrs = calloc(r->n_seqs ? r->n_seqs : 1, sizeof *ptrs);
    if (!items || !ptrs) {
        free(items);
        free(ptrs);
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < r->n_seqs; i++) {
        strata__internal__v1__seq_result__init(&items[i]);
        items[i].seq_id = r->seqs[i].seq_id;
        items[i].token = r->seqs[i].token;
        items[i].status = (uint32_t)r->seqs[i].status;
        items[i].message = (char *)r->seqs[i].message;
        items[i].prefix_failed = r->seqs[i].prefix_failed;
        ptrs[i] = &items[i];
    }
    sr.step = r->step;
    sr.n_results = r->n_seqs;
    sr.results = ptrs;
    Strata__Internal__V1__WorkerMessage m = STRATA__INTERNAL__V1__WORKER_MESSAGE__INIT;
    m.kind_case = STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_STEP_RESULT;
    m.step_result = &sr;
    int rc = ctl_client_send(cc, &m, err);
    free(items);
    free(ptrs);
    return rc;
}

static int send_kv_report(ctl_client *cc, const stage *st, strata_error *err)
{
    stage_kv_usage u;
    stage_get_kv_usage(st, &u);
    Strata__Internal__V1__TierUsage t[3];
    Strata__Internal__V1__TierUsage *tp[3];
    size_t n = 0;
    const char *names[3] = {"device", "host", "nvme"};
    uint64_t blocks[3] = {u.device_blocks, u.host_blocks, u.nvme_blocks};
    uint64_t bytes[3] = {u.device_bytes, u.host_bytes, u.nvme_bytes};
    uint64_t cap[3] = {u.device_capacity_bytes, u.host_capacity_bytes, u.nvme_capacity_bytes};
    for (int i = 0; i < 3; i++) {
        if (i > 0 && cap[i] == 0)
            continue;
        strata__internal__v1__tier_usage__init(&t[n]);
        t[n].name = (char *)names[i];
        t[n].blocks = blocks[i];
        t[n].bytes = bytes[i];
        t[n].capacity_bytes = cap[i];
        tp[n] = &t[n];
        n++;
    }
    Strata__Internal__V1__KvReport kr = STRATA__INTERNAL__V1__KV_REPORT__INIT;
    kr.n_tiers = n;
    kr.tiers = tp;
    kr.spills = u.spills;
    kr.restores = u.restores;
    kr.crc_failures = u.crc_failures;
    kr.spill_failures = u.spill_failures;
    kr.restore_failures = u.restore_failures;
    kr.spill_error = u.spill_error.msg;   /* "" when the last spill succeeded */
    Strata__Internal__V1__WorkerMessage m = STRATA__INTERNAL__V1__WORKER_MESSAGE__INIT;
    m.kind_case = STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_KV_REPORT;
    m.kv_report = &kr;
    return ctl_client_send(cc, &m, err);
}

/* Set by SIGTERM/SIGINT/SIGHUP: the worker stops, also in the middle of a wait. */
static volatile sig_atomic_t stop_requested;

/* Accepts `who` (the peer expected) on l within timeout_ms. A connection that fails the
 * handshake (a port scanner, a probe, a stale peer) is logged and dropped, and the wait goes on:
 * a stranger must not cost an assignment or a migration. The wait is in slices, so that a stop
 * request ends it within a fraction of a second (it held a stopping worker for up to 60 s). */
static int accept_peer(dp_listener *l, const dp_auth *auth, const dp_options *opts, int timeout_ms, const char *who,
                       dp_link **out, strata_error *err)
{
    const double deadline = strata_mono_s() + timeout_ms / 1000.0;
    for (;;) {
        if (stop_requested)
            return strata_fail(err, STRATA_EIO, "data plane: stopped by a signal while waiting for %s", who);
        const int left_ms = (int)((deadline - strata_mono_s()) * 1000.0);
        if (left_ms <= 0)
            return strata_fail(err, STRATA_EIO, "data plane: %s did not connect within %d s", who, timeout_ms / 1000);
        struct pollfd pending = {.fd = dp_listener_fd(l), .events = POLLIN};
        if (poll(&pending, 1, left_ms < 200 ? left_ms : 200) <= 0)
            continue;   /* nothing yet, or a signal: look at the stop request again */
        /* Every connection pending now, their handshakes side by side (each within 3 s). */
        const int rc = dp_tcp_accept(l, auth, opts, 0, out, err);
        if (rc == STRATA_OK)
            return rc;
        fprintf(stderr, "strata-worker: data plane: ignored a connection while waiting for %s: %s\n", who, err->msg);
        /* An accept that fails at once (out of descriptors) must not spin for the whole window. */
        const struct timespec pause = {0, 50 * 1000 * 1000};
        nanosleep(&pause, NULL);
    }
}

/* The data plane's limits for this assignment (caps: a frame's memory is taken as it comes). A
 * pipeline frame may be as large as a step's rows (f32, max_batch_tokens of them), a migration
 * frame as a sequence's image within this stage's KV budgets (kv_image_max_bytes); neither less
 * than the transport's default. A pipeline link waits as long as the coordinator waits for a
 * step (Assignment.step_timeout_ms; none: no limit): a stage may be busy with an earlier step
 * that long before it reads the next one's rows. */
typedef struct data_limits {
    dp_options pipeline, migration;
    int rows_wait_ms;   /* stage_options.link_timeout_ms */
} data_limits;

static data_limits data_limits_for(const Strata__Internal__V1__Assignment *a, const model *m)
{
    const model_config *c = model_get_config(m);
    const kv_geometry g = model_stage_kv_geometry(m, (int)a->block_tokens);
    const uint64_t image = kv_image_max_bytes(&g, a->max_seq_tokens, a->device_kv_bytes + a->host_kv_bytes + a->nvme_kv_bytes);
    const uint64_t rows = (uint64_t)a->max_batch_tokens * (uint64_t)c->n_embd * sizeof(float) + (1u << 20);
    const int wait = !a->step_timeout_ms ? -1 : a->step_timeout_ms > INT_MAX ? INT_MAX : (int)a->step_timeout_ms;
    return (data_limits){.pipeline = {.max_payload = rows > DP_DEFAULT_MAX_PAYLOAD ? rows : DP_DEFAULT_MAX_PAYLOAD,
                                      .io_timeout_ms = wait, .purpose = DP_PURPOSE_ROWS},
                         .migration = {.max_payload = image > DP_DEFAULT_MAX_PAYLOAD ? image : DP_DEFAULT_MAX_PAYLOAD,
                                       .purpose = DP_PURPOSE_MIGRATION},
                         .rows_wait_ms = wait};
}

/* Data-plane links of this stage: to the next stage (connect) and from the previous (accept).
 * Connecting first, from the last stage backwards, cannot deadlock: the last stage only accepts. */
static int connect_links(const Strata__Internal__V1__Assignment *a, dp_listener *l, const dp_auth *auth,
                         const dp_options *opts, dp_link **prev, dp_link **next, strata_error *err)
{
    *prev = *next = NULL;
    if (a->n_stages == 0 || a->stage >= a->n_stages || a->n_stage_data_addrs != a->n_stages)
        return strata_fail(err, STRATA_EINVAL, "assignment: stage %u of %u with %zu data addresses", a->stage,
                           a->n_stages, a->n_stage_data_addrs);
    int rc = STRATA_OK;
    if (a->stage + 1 < a->n_stages)
        rc = dp_tcp_connect(a->stage_data_addrs[a->stage + 1], auth, opts, 60000, next, err);
    if (rc == STRATA_OK && a->stage > 0) {
        char who[64];
        snprintf(who, sizeof who, "stage %u", a->stage - 1);
        rc = accept_peer(l, auth, opts, 60000, who, prev, err);
    }
    return rc;
}

/* NCCL links beside the TCP ones where both neighbours compute on a GPU (dp_nccl_upgrade): the
 * link from the previous stage first, then the one to the next, so a chain settles from stage 0
 * on. A CPU worker takes part too (it declines). */
static int nccl_links(int cuda_device, const dp_options *opts, dp_link *prev, dp_link *next, dp_link **rows_prev,
                      dp_link **rows_next, strata_error *err)
{
    int rc = prev ? dp_nccl_upgrade(prev, false, cuda_device, opts, rows_prev, err) : STRATA_OK;
    if (rc == STRATA_OK && next)
        rc = dp_nccl_upgrade(next, true, cuda_device, opts, rows_next, err);
    return rc;
}

/* Migration over the data plane: the sender connects to the peer (the same stage of another
 * replica), sends the sequence's image (its blocks as their exact bytes) in one CONTROL message
 * and frees the sequence only when the receiver answered that it holds it; the receiver answers
 * with a status and a message. So on any failure the sequence is still where it was. */
#define MIGRATE_TIMEOUT_MS 60000

static int migrate_send(stage *st, const dp_auth *auth, const dp_options *opts, const char *peer, uint64_t id,
                        strata_error *err)
{
    uint8_t *img = NULL;
    size_t len = 0;
    int rc = stage_export_seq(st, id, &img, &len, err);
    dp_link *link = NULL;
    if (rc == STRATA_OK)
        rc = dp_tcp_connect(peer, auth, opts, MIGRATE_TIMEOUT_MS, &link, err);
    dp_msg_header h = {.kind = DP_MSG_CONTROL, .dtype = DP_DTYPE_BYTES, .seq = id};
    if (rc == STRATA_OK)
        rc = dp_send(link, &h, img, len, err);
    free(img);
    uint8_t reply[600];
    size_t got = 0;
    if (rc == STRATA_OK)
        rc = dp_recv(link, &h, reply, sizeof reply - 1, &got, MIGRATE_TIMEOUT_MS, err);
    if (rc == STRATA_OK && (h.kind != DP_MSG_CONTROL || h.seq != id || got < 4))
        rc = strata_fail(err, STRATA_EFORMAT, "migration: an unexpected answer from %s", peer);
    if (rc == STRATA_OK && kv_ld32(reply) != STRATA_OK) {
        reply[got] = '\0';
        rc = strata_fail(err, (int)kv_ld32(reply), "the receiver %s refused it: %s", peer, (const char *)reply + 4);
    }
    dp_link_close(link);
    if (rc == STRATA_OK)
        stage_drop_seq(st, id);
    return rc;
}

static int migrate_receive(stage *st, dp_listener *l, const dp_auth *auth, const dp_options *opts, uint64_t id,
                           strata_error *err)
{
    dp_link *link = NULL;
    int rc = accept_peer(l, auth, opts, MIGRATE_TIMEOUT_MS, "the migration's sender", &link, err);
    if (rc != STRATA_OK)
        return rc;
    dp_msg_header h;
    uint8_t *img = NULL;
    rc = dp_recv_header(link, &h, MIGRATE_TIMEOUT_MS, err);
    if (rc == STRATA_OK && (h.kind != DP_MSG_CONTROL || h.seq != id))
        rc = strata_fail(err, STRATA_EFORMAT, "migration: expected sequence %" PRIu64 ", got a %s message for %" PRIu64,
                         id, dp_kind_name(h.kind), h.seq);
    if (rc == STRATA_OK && !(img = malloc(h.payload_len ? h.payload_len : 1)))
        rc = strata_fail(err, STRATA_ENOMEM, "migration: out of memory for %" PRIu64 " bytes", h.payload_len);
    if (rc == STRATA_OK)
        rc = dp_recv_payload(link, img, h.payload_len, err);
    if (rc == STRATA_OK)
        rc = stage_import_seq(st, id, img, h.payload_len, err);
    free(img);
    uint8_t reply[600];
    kv_st32(reply, (uint32_t)rc);
    size_t n = rc == STRATA_OK ? 0 : (size_t)snprintf((char *)reply + 4, sizeof reply - 4, "%s", err->msg);
    if (n > sizeof reply - 5)
        n = sizeof reply - 5;
    dp_msg_header rh = {.kind = DP_MSG_CONTROL, .dtype = DP_DTYPE_BYTES, .seq = id};
    strata_error e2 = {0};
    if (dp_send(link, &rh, reply, 4 + n, &e2) != STRATA_OK && rc == STRATA_OK) {
        stage_drop_seq(st, id);   /* the sender cannot know we hold it: it keeps its copy */
        rc = strata_fail(err, e2.code, "migration: answering the sender: %s", e2.msg);
    }
    dp_link_close(link);
    return rc;
}

/* The control stream is received on its own thread: gRPC's C core makes progress on a
 * connection (keepalive acks included) only while some thread polls it, and a step can take far
 * longer than the keepalive timeout (a long prefill on a CPU). The main thread executes what
 * this thread queues. The queue holds more than the coordinator ever has outstanding on one worker
 * (at most 64 steps in flight, a Migrate and a Shutdown), so the receiver does not stop polling:
 * it waits for room only if a coordinator broke that bound. A power of two: the counters wrap. */
#define INBOX_SLOTS 128
typedef struct inbox {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    Strata__Internal__V1__CoordinatorMessage *q[INBOX_SLOTS];
    size_t head, tail;
    bool ended, closing;
    strata_error why;
    ctl_client *cc;
} inbox;

/* --exit-timeout: once nobody waits for this worker's answers (the coordinator ended its link or
 * told it to stop, or a stop signal came), the process ends within that time even when the main
 * thread is still in a step (a hung GPU kernel, a CPU prompt step of minutes): its supervisor
 * can start a replacement only once it exited. */
static unsigned exit_timeout_s;
static volatile sig_atomic_t exit_armed;
static char overdue_msg[256];
static size_t overdue_len;

static void exit_overdue(int sig)
{
    (void)sig;
    ssize_t written = write(STDERR_FILENO, overdue_msg, overdue_len);
    (void)written;
    _exit(EXIT_RUNTIME);
}

/* Async-signal-safe (the stop signals' handler calls it); the first call starts the clock. */
static void arm_exit_timeout(void)
{
    if (exit_timeout_s && !exit_armed) {
        exit_armed = 1;
        alarm(exit_timeout_s);
    }
}

static void *receive_loop(void *arg)
{
    inbox *in = arg;
    for (;;) {
        pthread_mutex_lock(&in->mu);
        bool closing = in->closing;
        bool full = in->tail - in->head == INBOX_SLOTS;
        pthread_mutex_unlock(&in->mu);
        if (closing)
            return NULL;
        if (full) {   /* the main thread is behind: it frees a slot before we take more */
            pthread_mutex_lock(&in->mu);
            while (in->tail - in->head == INBOX_SLOTS && !in->closing)
                pthread_cond_wait(&in->cv, &in->mu);
            pthread_mutex_unlock(&in->mu);
            continue;
        }
        Strata__Internal__V1__CoordinatorMessage *msg = NULL;
        strata_error e = {0};
        int rc = ctl_client_recv(in->cc, 500, &msg, &e);
        if (rc == STRATA_EFORMAT || rc == STRATA_EFULL) {
            fprintf(stderr, "strata-worker: skipped a bad control message: %s\n", e.msg);
            continue;
        }
        if (rc != STRATA_OK ||
            (msg && msg->kind_case == STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_SHUTDOWN))
            arm_exit_timeout();   /* the main thread may be stuck in a step: it must not stay for ever */
        pthread_mutex_lock(&in->mu);
        if (rc != STRATA_OK) {
            in->ended = true;
            in->why = e;
        } else if (msg) {
            in->q[in->tail++ % INBOX_SLOTS] = msg;
        }
        pthread_cond_broadcast(&in->cv);
        pthread_mutex_unlock(&in->mu);
        if (rc != STRATA_OK)
            return NULL;
    }
}

/* The next message (STRATA_OK, *msg NULL after timeout_ms), or STRATA_EIO once the stream ended. */
static int inbox_pop(inbox *in, int timeout_ms, Strata__Internal__V1__CoordinatorMessage **msg, strata_error *err)
{
    const struct timespec until = strata_realtime_after_ms(timeout_ms);
    *msg = NULL;
    pthread_mutex_lock(&in->mu);
    while (in->head == in->tail && !in->ended)
        if (pthread_cond_timedwait(&in->cv, &in->mu, &until) != 0)
            break;
    int rc = STRATA_OK;
    if (in->head != in->tail) {
        *msg = in->q[in->head++ % INBOX_SLOTS];
        pthread_cond_broadcast(&in->cv);
    } else if (in->ended) {
        if (err)
            *err = in->why;
        rc = STRATA_EIO;
    }
    pthread_mutex_unlock(&in->mu);
    return rc;
}

static void on_signal(int sig)
{
    (void)sig;
    stop_requested = 1;
    arm_exit_timeout();
}

/* Whether `want` is this process's parent or an ancestor a few levels up (through --worker-bin
 * wrappers): a process whose parent dies is handed to init or a subreaper, so once serve is gone
 * it is no ancestor, even while it is still a zombie. */
static bool has_ancestor(pid_t want)
{
    pid_t p = getppid();
    for (int depth = 0; depth < 16 && p > 1; depth++) {
        if (p == want)
            return true;
        char path[64], buf[512];
        snprintf(path, sizeof path, "/proc/%ld/stat", (long)p);
        FILE *f = fopen(path, "re");
        size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
        if (f)
            fclose(f);
        buf[n] = '\0';
        const char *paren = strrchr(buf, ')');   /* after the command name, which may hold anything */
        int ppid;
        char state;
        if (!paren || sscanf(paren + 1, " %c %d", &state, &ppid) != 2)
            return true;   /* cannot tell: assume it lives, as before this check existed */
        p = (pid_t)ppid;
    }
    return false;
}

/* Under a --worker-bin wrapper serve is a grandparent, which no death signal covers: a thread
 * waits on a pidfd of serve and sends the worker the signal PR_SET_PDEATHSIG would have. */
typedef struct {
    int pidfd;
    int sig;
} supervisor_watch;

static void *watch_supervisor(void *arg)
{
    supervisor_watch w = *(supervisor_watch *)arg;
    free(arg);
    struct pollfd p = {.fd = w.pidfd, .events = POLLIN};
    while (poll(&p, 1, -1) < 0 && errno == EINTR)
        ;
    kill(getpid(), w.sig);   /* readable (serve ended) or poll failed: either way, no supervisor to wait on */
    return NULL;
}

/* Returns 0, or the errno of why no watch could be set up (the worker then runs without one). */
static int watch_supervisor_start(pid_t pid, int sig)
{
    supervisor_watch *w = malloc(sizeof *w);
    if (!w)
        return ENOMEM;
    w->sig = sig;
    w->pidfd = pidfd_open(pid, 0);
    int rc = w->pidfd < 0 ? errno : 0;
    pthread_attr_t attr;
    if (!rc && !(rc = pthread_attr_init(&attr))) {
        pthread_t t;
        if (!(rc = pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED)))
            rc = pthread_create(&t, &attr, watch_supervisor, w);
        pthread_attr_destroy(&attr);
    }
    if (rc) {
        if (w->pidfd >= 0)
            close(w->pidfd);
        free(w);
    }
    return rc;
}

/* Started by `strata serve` (STRATA_SUPERVISOR_PID names it): the worker ends when serve does,
 * SIGKILLed or not. Serve's workers lead their own process groups, so nothing else would reach
 * one that has not joined yet (it would wait out its connect timeout) or is stuck in a wait.
 * The signal is SIGTERM (a clean stop) unless the worker was started ignoring it. Serve as the
 * parent: a death signal; further up (a --worker-bin wrapper between them): a pidfd watch.
 * Returns false when serve has ended already (before the worker got this far). */
static bool end_with_supervisor(const char *name, bool term_handled)
{
    const char *sup = getenv("STRATA_SUPERVISOR_PID");
    char *end;
    long pid = sup ? strtol(sup, &end, 10) : 0;
    if (!sup || *end || pid <= 1 || pid > INT_MAX)
        return true;
    const int sig = term_handled ? SIGTERM : SIGKILL;
    const bool parent = getppid() == (pid_t)pid;
    int watch_rc = 0;
    if (parent)
        (void)prctl(PR_SET_PDEATHSIG, sig);
    else   /* the pid is checked as an ancestor below, after the pidfd holds it (no reuse between) */
        watch_rc = watch_supervisor_start((pid_t)pid, sig);
    /* Its own process group is in the background of serve's terminal: with `stty tostop` its
     * first message there would stop it (SIGTTOU) for good. Ignored, the write goes through. */
    signal(SIGTTOU, SIG_IGN);
    if (has_ancestor((pid_t)pid)) {   /* after the prctl: serve may have died just before it */
        if (watch_rc)
            fprintf(stderr, "strata-worker %s: warning: cannot watch strata serve (pid %ld) from under its wrapper "
                    "(%s); this worker will not end by itself if serve is killed\n", name, pid, strerror(watch_rc));
        return true;
    }
    fprintf(stderr, "strata-worker %s: strata serve (pid %ld) has ended; stopping\n", name, pid);
    return false;
}

int main(int argc, char **argv)
{
    worker_opts o;
    int rc = parse(argc, argv, &o);
    if (rc)
        return rc < 0 ? 0 : rc;
    if (o.threads > 0)
        kern_set_threads((int)o.threads);
    uint8_t secret[PROTO_SECRET_MAX_BYTES];
    size_t secret_len = 0;
    if ((rc = read_secret(o.secret_file, secret, PROTO_SECRET_MAX_BYTES, &secret_len)))
        return rc;
    static char *coordinator_ca;   /* kept until exit (static: still reachable then) */
    if (o.coordinator_ca) {
        strata_error ca_err = {0};
        if (proto_tls_read_roots(o.coordinator_ca, &coordinator_ca, &ca_err) != STRATA_OK) {
            fprintf(stderr, "strata-worker: --coordinator-ca %s\n", ca_err.msg);
            return ca_err.code == STRATA_ENOMEM ? EXIT_RUNTIME : EXIT_USAGE;
        }
    }
    char name[64];
    snprintf(name, sizeof name, "worker-%ld", (long)getpid());
    if (!o.name)
        o.name = name;
    signal(SIGPIPE, SIG_IGN);
    exit_timeout_s = (unsigned)o.exit_timeout_s;
    int n = snprintf(overdue_msg, sizeof overdue_msg, "strata-worker %s: still busy %u s after it was let go (a step "
                     "stuck on its device?): exiting now\n", o.name, exit_timeout_s);
    overdue_len = n > 0 && (size_t)n < sizeof overdue_msg ? (size_t)n : 0;
    struct sigaction alarm_sa = {.sa_handler = exit_overdue};
    sigemptyset(&alarm_sa.sa_mask);
    if (exit_timeout_s && sigaction(SIGALRM, &alarm_sa, NULL) != 0)
        exit_timeout_s = 0;   /* without the handler the alarm would kill it silently */
    /* A terminal that goes away (SIGHUP) stops it as SIGTERM does; a signal it was started
     * ignoring (nohup; SIGINT in a script's background job) stays ignored. */
    static const int stop_sigs[] = {SIGTERM, SIGINT, SIGHUP};
    bool term_handled = false;
    for (size_t i = 0; i < sizeof stop_sigs / sizeof stop_sigs[0]; i++) {
        struct sigaction sa = {.sa_handler = on_signal}, old;
        if (sigaction(stop_sigs[i], NULL, &old) == 0 && old.sa_handler != SIG_IGN &&
            sigaction(stop_sigs[i], &sa, NULL) == 0 && stop_sigs[i] == SIGTERM)
            term_handled = true;
    }
    if (!end_with_supervisor(o.name, term_handled))
        return EXIT_RUNTIME;

    strata_error err = {0};
    char device[32] = "cpu";
    if (o.cuda_device >= 0) {   /* before joining: a worker that cannot compute must not take layers */
        snprintf(device, sizeof device, "cuda:%ld", o.cuda_device);
        if (stage_gpu_probe((int)o.cuda_device, &err) != STRATA_OK) {
            fprintf(stderr, "strata-worker %s: --device %s: %s\n", o.name, device, err.msg);
            return EXIT_RUNTIME;
        }
    }
    dp_listener *listener = NULL;
    if (dp_tcp_listen(o.data, &listener, &err) != STRATA_OK) {
        fprintf(stderr, "strata-worker %s: --data %s: %s\n", o.name, o.data, err.msg);   /* err names the data plane */
        return err.code == STRATA_EINVAL ? EXIT_USAGE : EXIT_RUNTIME;
    }
    char data_addr[128];
    const char *colon = strrchr(o.data, ':');
    snprintf(data_addr, sizeof data_addr, "%.*s:%d", colon ? (int)(colon - o.data) : 9, colon ? o.data : "127.0.0.1",
             dp_listener_port(listener));

    Strata__Internal__V1__Join join = STRATA__INTERNAL__V1__JOIN__INIT;
    join.worker_name = (char *)o.name;
    join.device = device;
    join.device_kv_bytes = strata_mib_bytes(o.device_mib);
    join.host_kv_bytes = strata_mib_bytes(o.host_mib);
    join.nvme_kv_bytes = o.nvme_dir ? strata_mib_bytes(o.nvme_mib) : 0;
    join.data_addr = data_addr;
    ctl_client *cc = NULL;
    /* A stop request ends the wait for the coordinator at once, not after --connect-timeout-ms
     * (a launcher or systemd stopping a worker whose coordinator is gone would wait for it). */
    const ctl_client_options copts = {.cancel = &stop_requested, .tls_roots_pem = coordinator_ca};
    if (ctl_client_connect_opts(o.coordinator, secret, secret_len, &join, (int)o.connect_timeout_ms, &copts, &cc, &err) != STRATA_OK) {
        if (stop_requested)
            fprintf(stderr, "strata-worker %s: stopped by a signal while reaching the coordinator\n", o.name);
        else
            fprintf(stderr, "strata-worker %s: %s\n", o.name, err.msg);
        dp_listener_close(listener);
        return EXIT_RUNTIME;
    }
    if (!o.quiet)
        fprintf(stderr, "strata-worker %s: asked %s to join (data plane %s)\n", o.name, o.coordinator, data_addr);

    inbox in = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .cc = cc};
    pthread_t receiver;
    if (pthread_create(&receiver, NULL, receive_loop, &in) != 0) {
        fprintf(stderr, "strata-worker %s: cannot start the control thread\n", o.name);
        ctl_client_close(cc);
        dp_listener_close(listener);
        return EXIT_RUNTIME;
    }
    int exit_code = EXIT_RUNTIME;
    model *m = NULL;
    stage *st = NULL;
    double last_report = 0;
    data_limits limits = {{0}, {0}, 0};
    dp_link *prev = NULL, *next = NULL, *rows_prev = NULL, *rows_next = NULL;   /* rows_*: NCCL, GPU neighbours */
    dp_auth auth = {secret, secret_len};
    for (;;) {
        if (stop_requested) {   /* checked between messages too: a busy worker gets no idle timeout */
            fprintf(stderr, "strata-worker %s: stopped by a signal\n", o.name);
            break;
        }
        Strata__Internal__V1__CoordinatorMessage *msg = NULL;
        rc = inbox_pop(&in, 500, &msg, &err);
        if (rc != STRATA_OK) {
            fprintf(stderr, "strata-worker %s: %s\n", o.name, err.msg);
            break;
        }
        if (!msg)
            continue;
        bool done = false;
        switch (msg->kind_case) {
        case STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_ASSIGNMENT: {
            const Strata__Internal__V1__Assignment *a = msg->assignment;
            if (st) {
                fprintf(stderr, "strata-worker %s: a second assignment: leaving\n", o.name);
                done = true;
                break;
            }
            if (!o.quiet) {
                char where[32] = "the CPU";
                if (o.cuda_device >= 0)
                    snprintf(where, sizeof where, "cuda:%ld", o.cuda_device);
                fprintf(stderr, "strata-worker %s: replica %u stage %u/%u: layers [%u, %u) of %s on %s\n", o.name,
                        a->replica, a->stage, a->n_stages, a->layer_begin, a->layer_end, a->model_path, where);
            }
            int le = (int)a->layer_end;
            /* A GPU stage builds its layers on the device from the file: the host reads the embedding only. */
            m = o.cuda_device >= 0 ? model_load_for_device(a->model_path, (int)a->layer_begin, le, &err)
                                   : model_load(a->model_path, (int)a->layer_begin, le, &err);
            if (m)
                limits = data_limits_for(a, m);
            if (!m ||
                connect_links(a, listener, &auth, &limits.pipeline, &prev, &next, &err) != STRATA_OK ||
                nccl_links((int)o.cuda_device, &limits.pipeline, prev, next, &rows_prev, &rows_next, &err) != STRATA_OK ||
                !(st = stage_create(a, m,
                                    &(stage_options){.nvme_dir = o.nvme_dir, .cuda = o.cuda_device >= 0,
                                                     .cuda_device = (int)(o.cuda_device >= 0 ? o.cuda_device : 0),
                                                     .rows_prev = rows_prev, .rows_next = rows_next,
                                                     .link_timeout_ms = limits.rows_wait_ms},
                                    prev, next, &err)) ||
                send_kv_report(cc, st, &err) != STRATA_OK) {
                fprintf(stderr, "strata-worker %s: %s\n", o.name, err.msg);
                done = true;
            }
            break;
        }
        case STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_STEP_PLAN: {
            stage_result r;
            if (!st) {
                fprintf(stderr, "strata-worker %s: a step plan before the assignment: leaving\n", o.name);
                done = true;
            } else if (stage_step(st, msg->step_plan, &r, &err) != STRATA_OK || send_step_result(cc, &r, &err) != STRATA_OK) {
                fprintf(stderr, "strata-worker %s: step %" PRIu64 ": %s\n", o.name, msg->step_plan->step, err.msg);
                done = true;
            } else {
                /* KV usage for the coordinator's stats: when sequences left or moved, else at most
                 * twice a second. */
                const Strata__Internal__V1__StepPlan *p = msg->step_plan;
                double t = strata_mono_s();
                if (p->n_free_seqs || p->n_preempt_seqs || p->n_resume_seqs || t - last_report >= 0.5) {
                    if (send_kv_report(cc, st, &err) != STRATA_OK) {
                        fprintf(stderr, "strata-worker %s: %s\n", o.name, err.msg);
                        done = true;
                    }
                    last_report = t;
                }
            }
            break;
        }
        case STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_MIGRATE: {
            const Strata__Internal__V1__Migrate *mg = msg->migrate;
            strata_error me = {0};
            int mrc = !st ? strata_fail(&me, STRATA_EINVAL, "a migration before the assignment")
                      : mg->send ? migrate_send(st, &auth, &limits.migration, mg->peer_data_addr, mg->seq_id, &me)
                                 : migrate_receive(st, listener, &auth, &limits.migration, mg->seq_id, &me);
            if (mrc != STRATA_OK)
                fprintf(stderr, "strata-worker %s: migrating sequence %" PRIu64 " (%s): %s\n", o.name, mg->seq_id,
                        mg->send ? "send" : "receive", me.msg);
            Strata__Internal__V1__MigrateDone md = STRATA__INTERNAL__V1__MIGRATE_DONE__INIT;
            md.seq_id = mg->seq_id;
            md.status = (uint32_t)mrc;
            md.message = mrc == STRATA_OK ? (char *)"" : me.msg;
            Strata__Internal__V1__WorkerMessage wm = STRATA__INTERNAL__V1__WORKER_MESSAGE__INIT;
            wm.kind_case = STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_MIGRATE_DONE;
            wm.migrate_done = &md;
            done = ctl_client_send(cc, &wm, &err) != STRATA_OK || send_kv_report(cc, st, &err) != STRATA_OK;
            break;
        }
        case STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_SHUTDOWN:
            if (!o.quiet)
                fprintf(stderr, "strata-worker %s: shutdown requested\n", o.name);
            exit_code = 0;
            done = true;
            break;
        default:
            fprintf(stderr, "strata-worker %s: ignoring an unknown control message\n", o.name);
            break;
        }
        protobuf_c_message_free_unpacked(&msg->base, NULL);
        if (done)
            break;
    }
    arm_exit_timeout();   /* the teardown below is bounded too (a device that hangs in a free) */
    pthread_mutex_lock(&in.mu);
    in.closing = true;
    pthread_cond_broadcast(&in.cv);
    pthread_mutex_unlock(&in.mu);
    pthread_join(receiver, NULL);   /* its receive times out within 500 ms */
    ctl_client_close(cc);
    while (in.head != in.tail)
        protobuf_c_message_free_unpacked(&in.q[in.head++ % INBOX_SLOTS]->base, NULL);
    stage_destroy(st);
    dp_link_close(rows_prev);
    dp_link_close(rows_next);
    dp_link_close(prev);
    dp_link_close(next);
    dp_listener_close(listener);
    model_free(m);
    return exit_code;
}
