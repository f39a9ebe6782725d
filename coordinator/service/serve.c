/* The serving process (serve.h). */
#include "coordinator/service/serve.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "coordinator/config/config_file.h"
#include "coordinator/control/control_server.h"
#include "coordinator/metrics/http.h"
#include "coordinator/metrics/metrics.h"
#include "coordinator/sched/layer_split.h"
#include "coordinator/server/api_server.h"
#include "coordinator/service/coord.h"
#include "kvstore/clock.h"
#include "kvstore/numarg.h"
#include "kvstore/random.h"
#include "kvstore/sysmem.h"
#include "proto/credential_file.h"
#include "proto/tls_files.h"
#include "worker/model.h"

enum { EXIT_RUNTIME = 1, EXIT_USAGE = 2 };
#define SECRET_FILE_NAME "cluster.secret"   /* in the private folder serve makes for it */
#define MAX_LOCAL_WORKERS 64

typedef struct serve_opts {
    const char *config, *model, *listen, *control, *metrics, *secret_file, *kv, *kv_codecs, *tls_cert, *tls_key;
    const char *token_file, *stage_layers;
    const char *control_tls_cert, *control_tls_key, *control_tls_ca;
    const char *nvme_dir, *worker_bin;
    long replicas, stages, block_tokens, ctx, max_seqs, max_batch_tokens, steps_in_flight;
    double device_mib, host_mib, nvme_mib;   /* fractions allowed, as for strata generate */
    double prefix_mib;                       /* per replica; 0: no prefix caching */
    long drain_s, ready_timeout_s, step_timeout_s, max_recoveries, recovery_wait_s, threads;
    bool quiet;
    bool stages_set;   /* --stages given (a flag or the config) */
} serve_opts;

/* Every option: flag name = config key with '-' for '_'. */
enum {
    O_CONFIG = 256, O_MODEL, O_LISTEN, O_CONTROL, O_METRICS, O_SECRET, O_REPLICAS, O_STAGES, O_KV, O_KV_CODECS, O_BLOCK, O_CTX,
    O_MAX_SEQS, O_MAX_BATCH, O_DEVICE, O_HOST, O_NVME, O_NVME_DIR, O_TLS_CERT, O_TLS_KEY, O_TOKEN, O_DRAIN,
    O_READY, O_WORKER_BIN, O_THREADS, O_IN_FLIGHT, O_PREFIX, O_STAGE_LAYERS, O_STEP_TIMEOUT,
    O_MAX_RECOVERIES, O_RECOVERY_WAIT, O_CONTROL_TLS_CERT, O_CONTROL_TLS_KEY, O_CONTROL_TLS_CA,
};

static void usage(FILE *out, const char *prog, bool local)
{
    fprintf(out, "usage: %s [options]\n\n", prog);
    if (local)
        fprintf(out, "Starts a coordinator and its local CPU workers (replicas x stages processes of strata-worker)\n"
                     "and serves the public gRPC API (proto/strata.proto). Ctrl-C, SIGTERM or SIGHUP drains and stops.\n\n");
    else
        fprintf(out, "The coordinator: serves the public gRPC API and waits for replicas x stages workers to join\n"
                     "its control endpoint with the cluster secret. SIGTERM, SIGINT or SIGHUP drains and stops.\n\n");
    fprintf(out,
            "  --config FILE           JSON object whose keys are these options' names with '_' for '-'\n"
            "                          (\"max_seqs\": 16, \"quiet\": true), or the same as a YAML mapping\n"
            "                          when FILE ends in .yaml or .yml (max_seqs: 16); flags override it\n"
            "  -m, --model PATH        GGUF model (default: $STRATA_MODEL or %s)\n"
            "  --listen HOST:PORT      public API (default %s; port 0: any free port)\n"
            "  --control HOST:PORT     worker endpoint (default %s; no TLS: keep it on a private\n"
            "                          network)\n"
            "  --metrics HOST:PORT     Prometheus text metrics at http://HOST:PORT/metrics (default: off)\n"
            "  --secret-file FILE      cluster secret (16-256 bytes) workers must prove they hold (%s)\n"
            "  --replicas N            data-parallel replicas (default 1)\n"
            "  --stages N              pipeline stages (workers) per replica (default %s)\n"
            "  --stage-layers SPLIT    how the layers split among the stages: even (the default: the\n"
            "                          same KV per token on every stage), balanced (the same weights\n"
            "                          per decoded token, the last stage's output head counted: a\n"
            "                          faster pipeline, but its widest stage holds fewer tokens in\n"
            "                          --device-kv-mib), or layer counts first to last, e.g. 19,11\n"
            "                          (sets --stages when that is not given)\n"
            "  --kv SPEC               KV codec or plan of a request that names none (default kivi4):\n"
            "                          a codec name, tada, a range list such as 0-14:tada4,15-29:tada2,\n"
            "                          or a plan file (strata calibrate --out)\n"
            "  --kv-codecs LIST        other KV codecs or plans a request may choose (its kv_codec), e.g.\n"
            "                          fp16,kivi4 (';' between range lists or plan files); every KV slot\n"
            "                          is then sized for the largest of them, so the KV budgets hold\n"
            "                          fewer blocks (default: none; on GPU workers each plan keeps one\n"
            "                          fp16 window across its layers, as --kv must)\n"
            "  --block-tokens N        tokens per KV block (default 64)\n"
            "  --ctx N                 serving context, prompt + output tokens per request (default: the\n"
            "                          model's trained context, at most 8192)\n"
            "  --max-seqs N            running sequences per replica (default 32)\n"
            "  --max-batch-tokens N    tokens per step, decode tokens plus prompts (default 2048)\n"
            "  --steps-in-flight N     steps a replica has out at once, each stage running one while\n"
            "                          the next works on another, the running sequences shared among\n"
            "                          them (default: --stages; 1: the stages take turns)\n"
            "  --device-kv-mib N       device KV memory per worker in MiB, fractions allowed (default 256)\n"
            "  --host-kv-mib N         host KV tier per worker (default 0: none); with it, a request alone\n"
            "                          on its replica may outgrow the device: its layers stream through\n"
            "                          it, as in strata generate\n"
            "  --nvme-kv-mib N         NVMe KV tier per worker (default 0: none; needs a host tier%s)\n"
            "  --prefix-cache-mib N    prefix caching: host memory per replica (its workers together) for\n"
            "                          the compressed KV of finished requests' first tokens; a request\n"
            "                          whose prompt starts with the same tokens (same KV plan, not OTT)\n"
            "                          copies them and prefills only the rest (default 0: off; with a\n"
            "                          lossy codec its output may then differ slightly from an uncached\n"
            "                          run's, as with a prompt prefilled in chunks)\n",
            STRATA_DEFAULT_MODEL, API_SERVER_DEFAULT_ADDR, local ? "127.0.0.1:0" : CTL_SERVER_DEFAULT_ADDR,
            local ? "default: a fresh random one" : "required", local ? "2" : "1",
            local ? " and --nvme-dir" : "");
    if (local)
        fprintf(out,
                "  --nvme-dir DIR          spill directory of the local workers' NVMe tier (one folder each\n"
                "                          inside; DIR is made, mode 0700, if missing)\n"
                "  --worker-bin PATH       the strata-worker binary (default: beside this program)\n"
                "  --threads N             compute threads per worker (default: the CPU count / workers)\n");
    fprintf(out,
            "  --tls-cert FILE         TLS certificate chain (PEM) for the public API; with --tls-key\n"
            "  --tls-key FILE          its private key (PEM)\n"
            "  --token-file FILE       bearer token every API call must carry (authorization: Bearer ...)\n"
            "  --control-tls-cert FILE TLS on the control port, with --control-tls-key: certificate\n"
            "                          chain (PEM) naming the host the workers dial\n"
            "                          (%s); the data\n"
            "                          plane between workers is encrypted either way\n"
            "  --control-tls-key FILE  its private key (PEM)\n"
            "%s"
            "  --drain-seconds N       on SIGTERM (or SIGINT, SIGHUP), let running requests finish for up to\n"
            "                          N s (default 30)\n"
            "  --ready-timeout N       %s (default %s)\n"
            "  --step-timeout N        a worker that has not answered a step or a migration in N s is\n"
            "                          ended as lost (a hung device: its process alive, so keepalive\n"
            "                          cannot tell), as a lost worker: its replica is rebuilt (default\n"
            "                          600; 0: wait for ever; raise it for big models on CPU workers,\n"
            "                          whose prompt steps take minutes); a replica's stages wait as\n"
            "                          long for each other's rows\n"
            "  --max-recoveries N      times a request whose KV is lost (a worker of its replica lost,\n"
            "                          a KV block that could not be moved or read back) goes on from its\n"
            "                          prompt and the tokens streamed so far on a serving replica, its\n"
            "                          KV recomputed, before it ends with UNAVAILABLE (default 1; 0:\n"
            "                          never)\n"
            "  --recovery-wait N       with no replica serving (a lone replica lost a worker), its\n"
            "                          requests wait up to N s for one to be rebuilt (its workers\n"
            "                          restarted) and go on there; then they end with UNAVAILABLE\n"
            "                          (default 60; 0: at once; new requests meanwhile get\n"
            "                          UNAVAILABLE)\n"
            "  -q, --quiet             only errors and the ready line on stderr\n"
            "  -h, --help              this help\n",
            local ? "--control's host, 127.0.0.1 for a wildcard" : "their --coordinator host",
            local ? "  --control-tls-ca FILE   the CA (PEM) the local workers check that certificate with\n"
                    "                          (default: the certificate itself, as when self-signed)\n"
                  : "",
            local ? "give up when the workers are not ready after N s (or a worker exited twice before)" : "report progress while waiting for workers every N s",
            local ? "300" : "30");
}

static const struct option long_opts[] = {
    {"config", required_argument, NULL, O_CONFIG},       {"model", required_argument, NULL, 'm'},
    {"listen", required_argument, NULL, O_LISTEN},       {"control", required_argument, NULL, O_CONTROL},
    {"metrics", required_argument, NULL, O_METRICS},     {"secret-file", required_argument, NULL, O_SECRET},
    {"replicas", required_argument, NULL, O_REPLICAS},   {"stages", required_argument, NULL, O_STAGES},
    {"kv", required_argument, NULL, O_KV},               {"kv-codecs", required_argument, NULL, O_KV_CODECS},
    {"block-tokens", required_argument, NULL, O_BLOCK},
    {"ctx", required_argument, NULL, O_CTX},             {"max-seqs", required_argument, NULL, O_MAX_SEQS},
    {"max-batch-tokens", required_argument, NULL, O_MAX_BATCH}, {"steps-in-flight", required_argument, NULL, O_IN_FLIGHT},
    {"device-kv-mib", required_argument, NULL, O_DEVICE}, {"host-kv-mib", required_argument, NULL, O_HOST},
    {"nvme-kv-mib", required_argument, NULL, O_NVME},    {"nvme-dir", required_argument, NULL, O_NVME_DIR},
    {"tls-cert", required_argument, NULL, O_TLS_CERT},   {"tls-key", required_argument, NULL, O_TLS_KEY},
    {"token-file", required_argument, NULL, O_TOKEN},    {"drain-seconds", required_argument, NULL, O_DRAIN},
    {"ready-timeout", required_argument, NULL, O_READY}, {"worker-bin", required_argument, NULL, O_WORKER_BIN},
    {"threads", required_argument, NULL, O_THREADS},     {"quiet", no_argument, NULL, 'q'},
    {"prefix-cache-mib", required_argument, NULL, O_PREFIX}, {"stage-layers", required_argument, NULL, O_STAGE_LAYERS},
    {"step-timeout", required_argument, NULL, O_STEP_TIMEOUT},
    {"max-recoveries", required_argument, NULL, O_MAX_RECOVERIES},
    {"recovery-wait", required_argument, NULL, O_RECOVERY_WAIT},
    {"control-tls-cert", required_argument, NULL, O_CONTROL_TLS_CERT},
    {"control-tls-key", required_argument, NULL, O_CONTROL_TLS_KEY},
    {"control-tls-ca", required_argument, NULL, O_CONTROL_TLS_CA},
    {"help", no_argument, NULL, 'h'},                    {NULL, 0, NULL, 0},
};

static bool worker_control_addr(const char *listen, int port, char *out, size_t cap);

/* The address the control port listens on. */
static const char *control_listen_addr(const serve_opts *o, bool local)
{
    return o->control ? o->control : local ? "127.0.0.1:0" : CTL_SERVER_DEFAULT_ADDR;
}

/* The host a worker dials for the control port listening on control (as worker_control_addr
 * gives it, without brackets); *wildcard when control names no one address. False for a unix
 * socket or a name too long. */
static bool dial_host(const char *control, char *host, size_t cap, bool *wildcard)
{
    char addr[300];
    if (!worker_control_addr(control, 0, addr, sizeof addr) || !strncmp(addr, "unix:", 5))
        return false;
    *strrchr(addr, ':') = '\0';
    *wildcard = strncmp(control, addr, strlen(addr)) != 0;   /* addr holds 127.0.0.1 or [::1] for it */
    const size_t len = strlen(addr);
    const bool bracketed = addr[0] == '[' && len >= 2 && addr[len - 1] == ']';
    return (size_t)snprintf(host, cap, "%.*s", (int)(bracketed ? len - 2 : len), addr + bracketed) < cap;
}

/* Applies one option (from a flag or the config file); false after printing the problem. */
static bool apply(const char *prog, serve_opts *o, int id, const char *flag, const char *v, bool local)
{
    switch (id) {
    case 'm': o->model = v; return true;
    case O_LISTEN: o->listen = v; return strata_check_addr(prog, flag, v, true);
    case O_CONTROL: o->control = v; return strata_check_addr(prog, flag, v, true);
    case O_METRICS: o->metrics = v; return true;
    case O_SECRET: o->secret_file = v; return true;
    case O_KV: o->kv = v; return true;
    case O_KV_CODECS: o->kv_codecs = v; return true;
    case O_TLS_CERT: o->tls_cert = v; return true;
    case O_TLS_KEY: o->tls_key = v; return true;
    case O_TOKEN: o->token_file = v; return true;
    case O_CONTROL_TLS_CERT: o->control_tls_cert = v; return true;
    case O_CONTROL_TLS_KEY: o->control_tls_key = v; return true;
    case O_REPLICAS: return strata_parse_long(prog, flag, v, 1, 1024, &o->replicas);
    case O_STAGES:
        o->stages_set = true;
        return strata_parse_long(prog, flag, v, 1, LAYER_SPLIT_MAX_STAGES, &o->stages);
    case O_STAGE_LAYERS: {
        layer_split_spec spec;
        strata_error err = {0};
        if (layer_split_parse(v, &spec, &err) != STRATA_OK) {
            fprintf(stderr, "%s: %s: %s\n", prog, flag, err.msg);
            return false;
        }
        o->stage_layers = v;
        return true;
    }
    case O_BLOCK: return strata_parse_long(prog, flag, v, 1, 4096, &o->block_tokens);
    case O_CTX: return strata_parse_long(prog, flag, v, 2, 1 << 22, &o->ctx);
    case O_MAX_SEQS: return strata_parse_long(prog, flag, v, 1, 4096, &o->max_seqs);
    case O_MAX_BATCH: return strata_parse_long(prog, flag, v, 1, 1 << 22, &o->max_batch_tokens);
    case O_IN_FLIGHT: return strata_parse_long(prog, flag, v, 1, 64, &o->steps_in_flight);
    case O_DEVICE: return strata_parse_double(prog, flag, v, STRATA_KV_MIB_MIN, STRATA_KV_MIB_MAX, &o->device_mib);
    case O_HOST: return strata_parse_double(prog, flag, v, 0, STRATA_KV_MIB_MAX, &o->host_mib);
    case O_NVME: return strata_parse_double(prog, flag, v, 0, STRATA_KV_MIB_MAX, &o->nvme_mib);
    case O_PREFIX: return strata_parse_double(prog, flag, v, 0, STRATA_KV_MIB_MAX, &o->prefix_mib);
    case O_DRAIN: return strata_parse_long(prog, flag, v, 0, 3600, &o->drain_s);
    case O_READY: return strata_parse_long(prog, flag, v, 1, 86400, &o->ready_timeout_s);
    case O_STEP_TIMEOUT: return strata_parse_long(prog, flag, v, 0, 86400, &o->step_timeout_s);
    case O_MAX_RECOVERIES: return strata_parse_long(prog, flag, v, 0, 100, &o->max_recoveries);
    case O_RECOVERY_WAIT: return strata_parse_long(prog, flag, v, 0, 3600, &o->recovery_wait_s);
    default: break;
    }
    if (local) {
        switch (id) {
        case O_NVME_DIR: o->nvme_dir = v; return true;
        case O_WORKER_BIN: o->worker_bin = v; return true;
        case O_THREADS: return strata_parse_long(prog, flag, v, 1, 1024, &o->threads);
        case O_CONTROL_TLS_CA: o->control_tls_ca = v; return true;
        default: break;
        }
    }
    fprintf(stderr, "%s: %s is not an option of this command (try --help)\n", prog, flag);
    return false;
}

/* Reads the config (JSON or YAML, config_file.h): every key must name an option; values are
 * strings or numbers ("quiet": true or false). *root (kept alive by the caller) owns every string
 * the options point to: the document, and the numbers written out as strings. */
static bool load_config(const char *prog, const char *path, serve_opts *o, bool local, json_t **root)
{
    char why[300];
    json_t *doc = config_file_load(path, why, sizeof why);
    if (!doc) {
        fprintf(stderr, "%s: --config %s: %s\n", prog, path, why);
        return false;
    }
    *root = json_array();
    if (!*root || json_array_append_new(*root, doc) != 0) {
        json_decref(doc);
        fprintf(stderr, "%s: --config %s: out of memory\n", prog, path);
        return false;
    }
    if (!json_is_object(doc)) {
        fprintf(stderr, "%s: --config %s: the top level must be %s\n", prog, path,
                config_file_is_yaml(path) ? "a mapping of option names" : "a JSON object");
        return false;
    }
    const char *key;
    json_t *val;
    int seen[128];   /* option ids already set: "max_seqs" and "max-seqs" are one key */
    size_t n_seen = 0;
    json_object_foreach(doc, key, val) {
        char name[64];
        snprintf(name, sizeof name, "%s", key);
        for (char *p = name; *p; p++)
            if (*p == '_')
                *p = '-';
        int id = 0;
        for (const struct option *op = long_opts; op->name; op++)
            if (!strcmp(op->name, name) && op->val != O_CONFIG && op->val != 'h')
                id = op->val;
        char flag[80];
        snprintf(flag, sizeof flag, "%s: key '%s'", path, key);
        if (!id) {
            fprintf(stderr, "%s: --config %s: unknown key '%s'\n", prog, path, key);
            return false;
        }
        for (size_t i = 0; i < n_seen; i++)
            if (seen[i] == id) {
                fprintf(stderr, "%s: --config %s: key '%s' sets --%s a second time\n", prog, path, key, name);
                return false;
            }
        if (n_seen < sizeof seen / sizeof *seen)
            seen[n_seen++] = id;
        if (id == 'q') {
            if (!json_is_boolean(val)) {
                fprintf(stderr, "%s: --config %s: key '%s' must be true or false\n", prog, path, key);
                return false;
            }
            o->quiet = json_is_true(val);
            continue;
        }
        const char *v;
        if (json_is_string(val)) {
            v = json_string_value(val);
        } else if (json_is_number(val)) {
            char num[40];
            if (json_is_integer(val))
                snprintf(num, sizeof num, "%" JSON_INTEGER_FORMAT, json_integer_value(val));
            else
                snprintf(num, sizeof num, "%.17g", json_real_value(val));   /* the flag's parser decides */
            json_t *str = json_string(num);
            if (!str || json_array_append_new(*root, str) != 0) {
                fprintf(stderr, "%s: --config %s: out of memory\n", prog, path);
                return false;
            }
            v = json_string_value(str);
        } else {
            fprintf(stderr, "%s: --config %s: key '%s' must be a string or a number\n", prog, path, key);
            return false;
        }
        if (!apply(prog, o, id, flag, v, local))
            return false;
    }
    return true;
}

static int parse(int argc, char **argv, const char *prog, bool local, serve_opts *o, json_t **config)
{
    *o = (serve_opts){.replicas = 1, .stages = local ? 2 : 1, .block_tokens = 64, .max_seqs = 32,
                      .max_batch_tokens = 2048, .device_mib = 256, .drain_s = 30, .step_timeout_s = 600,
                      .max_recoveries = 1, .recovery_wait_s = 60,
                      .ready_timeout_s = local ? 300 : 30, .kv = "kivi4"};
    o->model = getenv("STRATA_MODEL") && *getenv("STRATA_MODEL") ? getenv("STRATA_MODEL") : STRATA_DEFAULT_MODEL;
    *config = NULL;
    const char *config_path = NULL;
    for (int i = 1; i < argc; i++) {   /* the config file first, so that flags override it */
        const char *path = NULL;
        if (!strcmp(argv[i], "--config") && i + 1 < argc)
            path = argv[i + 1];
        else if (!strncmp(argv[i], "--config=", 9))
            path = argv[i] + 9;
        if (path) {
            if (*config) {
                fprintf(stderr, "%s: --config given twice\n", prog);
                return EXIT_USAGE;
            }
            if (!load_config(prog, path, o, local, config))
                return EXIT_USAGE;
            config_path = path;
        }
    }
    optind = 1;
    int c, idx;
    while ((c = getopt_long(argc, argv, "m:qh", long_opts, &idx)) != -1) {
        if (c == 'h') {
            usage(stdout, prog, local);
            return -1;
        }
        if (c == 'q') {
            o->quiet = true;
            continue;
        }
        if (c == O_CONFIG) {
            /* getopt takes any unambiguous prefix (--conf); the file was read above only when
             * the option was spelled in full, and must not be dropped without a word. */
            if (optarg != config_path) {
                fprintf(stderr, "%s: spell --config in full (--config FILE or --config=FILE): the file is read "
                        "before the other options\n", prog);
                return EXIT_USAGE;
            }
            continue;
        }
        if (c == '?') {
            fprintf(stderr, "%s: try --help\n", prog);
            return EXIT_USAGE;
        }
        char flag[64];
        snprintf(flag, sizeof flag, "--%s", c == 'm' ? "model" : long_opts[idx].name);
        if (!apply(prog, o, c, flag, optarg, local))
            return EXIT_USAGE;
    }
    if (optind != argc) {
        fprintf(stderr, "%s: unexpected argument '%s' (try --help)\n", prog, argv[optind]);
        return EXIT_USAGE;
    }
    if (o->stage_layers) {   /* a list of counts names the stages */
        layer_split_spec spec;
        (void)layer_split_parse(o->stage_layers, &spec, NULL);   /* checked when applied */
        if (spec.mode == LAYER_SPLIT_LIST && !o->stages_set) {
            o->stages = spec.n_counts;
        } else if (spec.mode == LAYER_SPLIT_LIST && (long)spec.n_counts != o->stages) {
            fprintf(stderr, "%s: --stage-layers %s names %u stages, but --stages is %ld\n", prog, o->stage_layers,
                    spec.n_counts, o->stages);
            return EXIT_USAGE;
        }
    }
    if (!local && !o->secret_file) {
        fprintf(stderr, "%s: --secret-file is required (workers present the same secret)\n", prog);
        return EXIT_USAGE;
    }
    if (!o->tls_cert != !o->tls_key) {
        fprintf(stderr, "%s: --tls-cert and --tls-key go together\n", prog);
        return EXIT_USAGE;
    }
    if (!o->control_tls_cert != !o->control_tls_key) {
        fprintf(stderr, "%s: --control-tls-cert and --control-tls-key go together\n", prog);
        return EXIT_USAGE;
    }
    if (o->control_tls_ca && !o->control_tls_cert) {
        fprintf(stderr, "%s: --control-tls-ca needs --control-tls-cert (the control port has no TLS without it)\n",
                prog);
        return EXIT_USAGE;
    }
    /* Local workers dial the --control host (127.0.0.1 for a wildcard): a certificate without it
     * would turn every one of them away (each saying why, but serve would only see them go).
     * Remote workers may dial another name of
     * this host: only a warning then, for a --control that names one address. A file that
     * cannot be read is reported when the control port starts. */
    char host[300];
    bool wildcard, named;
    strata_error err = {0};
    if (o->control_tls_cert && dial_host(control_listen_addr(o, local), host, sizeof host, &wildcard) &&
        proto_tls_cert_names(o->control_tls_cert, host, &named, &err) == STRATA_OK && !named &&
        (local || !wildcard)) {
        const bool ip = strchr(host, ':') || strspn(host, "0123456789.") == strlen(host);
        fprintf(stderr, "%s: %s--control-tls-cert: the certificate %s does not name %s (a subjectAltName %s:%s is "
                "needed), %s\n", prog, local ? "" : "warning: ", o->control_tls_cert, host, ip ? "IP" : "DNS", host,
                local ? "the host its local workers dial" : "the --control address: workers must dial a name it holds");
        if (local)
            return EXIT_USAGE;
    }
    if (o->nvme_mib > 0 && o->host_mib == 0) {
        fprintf(stderr, "%s: --nvme-kv-mib needs --host-kv-mib (the NVMe tier sits below a host tier)\n", prog);
        return EXIT_USAGE;
    }
    if (local && (o->nvme_mib > 0) != (o->nvme_dir != NULL)) {
        fprintf(stderr, "%s: --nvme-kv-mib and --nvme-dir go together\n", prog);
        return EXIT_USAGE;
    }
    if (local && o->replicas * o->stages > MAX_LOCAL_WORKERS) {
        fprintf(stderr, "%s: %ld local workers; at most %d\n", prog, o->replicas * o->stages, MAX_LOCAL_WORKERS);
        return EXIT_USAGE;
    }
    if (local) {   /* CPU workers on this machine: their KV pools and host tiers share its memory */
        const long n = o->replicas * o->stages;
        char what[256];
        int at = snprintf(what, sizeof what, "the KV of %ld local workers (%ld x (%.10g + %.10g MiB of --device-kv-mib "
                          "and --host-kv-mib))", n, n, o->device_mib, o->host_mib);
        if (o->prefix_mib > 0 && at > 0 && (size_t)at < sizeof what)
            snprintf(what + at, sizeof what - (size_t)at, " and their prefix caches (%ld x %.10g MiB of "
                     "--prefix-cache-mib)", o->replicas, o->prefix_mib);
        strata_error merr = {0};
        if (strata_check_memory(what, strata_mib_bytes((o->device_mib + o->host_mib) * (double)n +
                                                       o->prefix_mib * (double)o->replicas), &merr) != STRATA_OK) {
            fprintf(stderr, "%s: %s\n", prog, merr.msg);
            return EXIT_USAGE;
        }
    }
    strata_error merr = {0};
    if (model_check_path(o->model, &merr) != STRATA_OK) {
        fprintf(stderr, "%s: %s%s\n", prog, merr.msg,
                !strcmp(o->model, STRATA_DEFAULT_MODEL)
                    ? " (run scripts/setup.sh to download the default model, or pass --model)"
                    : "");
        return EXIT_USAGE;
    }
    return 0;
}

/* Reads a secret or token file (proto/credential_file.h) into buf: at most cap - 1 bytes, a
 * trailing newline dropped. */
static bool read_small_file(const char *prog, const char *what, const char *path, char *buf, size_t cap, size_t *len)
{
    char *data = NULL;
    strata_error err = {0};
    if (credential_file_read(path, cap - 1, true, &data, len, &err) != STRATA_OK) {
        fprintf(stderr, "%s: %s %s: %s\n", prog, what, path, err.msg);
        return false;
    }
    memcpy(buf, data, *len + 1);
    explicit_bzero(data, *len);
    free(data);
    return true;
}

/* ---- local workers ---- */

typedef struct local_worker {
    pid_t pid;
    char name[32];
    double started;
    double restart_at;   /* 0: running */
    double backoff;
    int early_exits;     /* exits before the server was first ready */
    int last_status;     /* waitpid's status of the last exit */
} local_worker;

/* A worker that exits this often before the server is first ready fails the start: the cause
 * (a spill folder on a full disk, a model file the worker cannot read) is one a restart does not
 * mend, and waiting out the ready timeout only hides the worker's message under the restarts. */
#define EARLY_EXITS_LIMIT 2

typedef struct supervisor {
    const char *prog;
    char bin[PATH_MAX];
    char control[300], secret_path[PATH_MAX];
    /* The secret serve made (empty with --secret-file): written again when it was removed. */
    char secret_dir[PATH_MAX], secret[CTL_SECRET_MAX_BYTES + 1];
    size_t secret_len;
    const serve_opts *o;
    long threads;
    local_worker w[MAX_LOCAL_WORKERS];
    int n;
    pthread_mutex_t mu;
    bool stopping;
    bool served;         /* the server has been ready once */
    bool thread_started;
    pthread_t thread;
} supervisor;

/* Teardown (the servers' shutdown, the workers' exit) takes seconds; under resource exhaustion
 * (a process limit reached) gRPC's shutdown has been seen to block for ever. SIGALRM this long
 * after teardown starts ends the process, with a message and without the cluster secret. */
#define TEARDOWN_LIMIT_S 60
static char stuck_msg[160], stuck_secret_path[PATH_MAX], stuck_secret_dir[PATH_MAX];

static void teardown_stuck(int sig)
{
    (void)sig;   /* async-signal-safe calls only */
    ssize_t w = write(STDERR_FILENO, stuck_msg, strlen(stuck_msg));
    (void)w;
    if (*stuck_secret_path)
        unlink(stuck_secret_path);
    if (*stuck_secret_dir)
        rmdir(stuck_secret_dir);
    _exit(EXIT_RUNTIME);
}

static void arm_teardown_limit(const char *prog, const char *secret_path, const char *secret_dir)
{
    snprintf(stuck_msg, sizeof stuck_msg, "%s: shutdown did not finish within %d s; exiting now\n", prog,
             TEARDOWN_LIMIT_S);
    snprintf(stuck_secret_path, sizeof stuck_secret_path, "%s", secret_path);
    snprintf(stuck_secret_dir, sizeof stuck_secret_dir, "%s", secret_dir);
    struct sigaction sa = {.sa_handler = teardown_stuck};
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGALRM, &sa, NULL) == 0)
        alarm(TEARDOWN_LIMIT_S);
}

/* Whether environment entry e sets variable key (given with its '='). */
static bool env_sets(const char *e, const char *key)
{
    return strncmp(e, key, strlen(key)) == 0;
}

/* The workers' environment: this process's, with OPENBLAS_NUM_THREADS set to threads (each
 * worker computes on its share of the cores) and STRATA_SUPERVISOR_PID to this process (a
 * worker ends when serve does, strata-worker's end_with_supervisor). NULL when out of memory.
 * Free with free(). */
static char **worker_environment(const char *threads)
{
    static const char blas[] = "OPENBLAS_NUM_THREADS=", sup[] = "STRATA_SUPERVISOR_PID=";
    size_t n = 0;
    while (environ[n])
        n++;
    const size_t own_cap = sizeof blas + strlen(threads) + sizeof sup + 24;
    char **env = malloc((n + 3) * sizeof *env + own_cap);
    if (!env)
        return NULL;
    char *own = (char *)(env + n + 3);   /* the two strings this array adds, stored after it */
    int blas_len = snprintf(own, own_cap, "%s%s", blas, threads);
    snprintf(own + blas_len + 1, own_cap - (size_t)blas_len - 1, "%s%ld", sup, (long)getpid());
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (!env_sets(environ[i], blas) && !env_sets(environ[i], sup))
            env[k++] = environ[i];
    env[k++] = own;
    env[k++] = own + blas_len + 1;
    env[k] = NULL;
    return env;
}

/* Writes text and a newline as SECRET_FILE_NAME, a new 0600 file in the folder open as dir,
 * and removes it again when the write fails (a part of the secret would keep every worker out
 * for good). 0, or the errno of what failed. */
static int write_secret_file(int dir, const char *text, size_t len)
{
    char line[CTL_SECRET_MAX_BYTES + 2];
    if (len > CTL_SECRET_MAX_BYTES)
        return EINVAL;
    memcpy(line, text, len);
    line[len++] = '\n';
    int fd = openat(dir, SECRET_FILE_NAME, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0)
        return errno;
    ssize_t n = write(fd, line, len);
    int err = n < 0 ? errno : n != (ssize_t)len ? EIO : 0;
    if (close(fd) != 0 && !err)
        err = errno;
    explicit_bzero(line, sizeof line);
    if (err)
        unlinkat(dir, SECRET_FILE_NAME, 0);
    return err;
}

/* A cleanup of TMPDIR (systemd-tmpfiles, an operator) may remove the secret serve made while
 * it serves: a restarted worker could then never join. Writes the same bytes again, in a
 * folder made again with the same name; refuses a folder or file that someone else put there
 * (a link, another owner, other permissions). The folder's name was random, so only a
 * process that saw it could race for it. */
static void restore_secret(supervisor *sv)
{
    struct stat st;
    if (!*sv->secret_dir || lstat(sv->secret_path, &st) == 0 || errno != ENOENT)
        return;
    const char *why = NULL;
    int err = 0;
    if (mkdir(sv->secret_dir, 0700) != 0 && errno != EEXIST) {
        why = "its folder cannot be made again";
        err = errno;
    }
    /* The folder checked through the descriptor the file is then made in: no swap in between. */
    int dir = why ? -1 : open(sv->secret_dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (!why && (dir < 0 || fstat(dir, &st) != 0 || st.st_uid != geteuid() || (st.st_mode & 077))) {
        why = "its folder is not this user's private folder any more";
        err = dir < 0 ? errno : 0;
    }
    if (!why && (err = write_secret_file(dir, sv->secret, sv->secret_len)) != 0)
        why = "it cannot be written again";
    if (dir >= 0)
        close(dir);
    if (!why)
        fprintf(stderr, "%s: cluster secret %s was removed; written again\n", sv->prog, sv->secret_path);
    else
        fprintf(stderr, "%s: cluster secret %s was removed and %s%s%s\n", sv->prog, sv->secret_path, why,
                err ? ": " : "", err ? strerror(err) : "");
}

/* Starts worker w. posix_spawn, not fork + exec: between fork and exec a child of this
 * multithreaded process may only make async-signal-safe calls, and a setenv there (a malloc)
 * deadlocked the child for good when another thread held the allocator's lock at the fork (seen
 * under AddressSanitizer, whose allocator has no fork handlers): the worker never started and
 * never exited, so neither the restart nor the early-exit rule could act. When the start
 * fails, says so and counts it as an exit (status 127, the shell's "cannot run"), retried after
 * the backoff. */
static void spawn(supervisor *sv, local_worker *w)
{
    char dev[32], host[32], nvme[32], nvme_dir[PATH_MAX], threads[32];
    snprintf(dev, sizeof dev, "%.17g", sv->o->device_mib);
    snprintf(host, sizeof host, "%.17g", sv->o->host_mib);
    snprintf(nvme, sizeof nvme, "%.17g", sv->o->nvme_mib);
    snprintf(threads, sizeof threads, "%ld", sv->threads);
    if (sv->o->nvme_dir)
        snprintf(nvme_dir, sizeof nvme_dir, "%s/%s", sv->o->nvme_dir, w->name);
    /* Each worker makes its own folder inside the spill folder, which may have been removed
     * while serving (a cleanup of /tmp, an operator): a restarted worker would fail for ever. */
    if (sv->o->nvme_dir && mkdir(sv->o->nvme_dir, 0700) != 0 && errno != EEXIST)
        fprintf(stderr, "%s: --nvme-dir %s: cannot create it again: %s\n", sv->prog, sv->o->nvme_dir, strerror(errno));
    const char *argv[24];
    int a = 0;
    argv[a++] = sv->bin;
    argv[a++] = "--coordinator";
    argv[a++] = sv->control;
    argv[a++] = "--secret-file";
    argv[a++] = sv->secret_path;
    argv[a++] = "--name";
    argv[a++] = w->name;
    argv[a++] = "--device-kv-mib";
    argv[a++] = dev;
    argv[a++] = "--host-kv-mib";
    argv[a++] = host;
    if (sv->o->nvme_dir) {
        argv[a++] = "--nvme-dir";
        argv[a++] = nvme_dir;
        argv[a++] = "--nvme-kv-mib";
        argv[a++] = nvme;
    }
    argv[a++] = "--threads";
    argv[a++] = threads;
    if (sv->o->control_tls_cert) {   /* the workers check the control port's certificate */
        argv[a++] = "--coordinator-ca";
        argv[a++] = sv->o->control_tls_ca ? sv->o->control_tls_ca : sv->o->control_tls_cert;
    }
    if (sv->o->quiet)
        argv[a++] = "--quiet";
    argv[a] = NULL;

    restore_secret(sv);
    w->started = strata_mono_s();
    w->restart_at = 0;
    /* This process blocks SIGTERM, SIGINT and SIGHUP in its threads; the worker must not inherit that.
     * Each worker leads a process group of its own: a Ctrl-C at the terminal (SIGINT to the
     * foreground group) reaches serve alone, which drains and then stops the workers; a worker
     * killed then would fail the requests the drain is finishing. The group also holds what a
     * --worker-bin wrapper starts, so stopping the group stops it all. */
    sigset_t none;
    sigemptyset(&none);
    posix_spawnattr_t attr;
    posix_spawn_file_actions_t files;
    char **env = NULL;
    pid_t pid = -1;
    int rc = posix_spawnattr_init(&attr);
    if (rc == 0 && (rc = posix_spawn_file_actions_init(&files)) != 0)
        posix_spawnattr_destroy(&attr);
    if (rc == 0) {
        /* A background group reading the terminal would be stopped (SIGTTIN): workers read nothing. */
        if ((rc = posix_spawnattr_setsigmask(&attr, &none)) == 0 && (rc = posix_spawnattr_setpgroup(&attr, 0)) == 0 &&
            (rc = posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETPGROUP)) == 0 &&
            (rc = posix_spawn_file_actions_addopen(&files, STDIN_FILENO, "/dev/null", O_RDONLY, 0)) == 0)
            rc = (env = worker_environment(threads)) ? posix_spawn(&pid, sv->bin, &files, &attr, (char *const *)argv, env)
                                                     : ENOMEM;
        posix_spawn_file_actions_destroy(&files);
        posix_spawnattr_destroy(&attr);
    }
    free(env);
    if (rc != 0) {
        fprintf(stderr, "%s: cannot start worker %s (%s): %s; retrying in %.0f s\n", sv->prog, w->name, sv->bin,
                strerror(rc), w->backoff);
        w->pid = -1;
        w->restart_at = w->started + w->backoff;
        w->backoff = w->backoff * 2 > 30 ? 30 : w->backoff * 2;
        w->early_exits += !sv->served;
        w->last_status = 127 << 8;   /* as waitpid reports exit status 127 */
        return;
    }
    w->pid = pid;
}

/* Whether worker w's process, its group's leader, has exited; if so, SIGKILLs what is left in
 * its group (what a --worker-bin wrapper started and did not take with it: it would run on
 * beside the replacement, or after serve) and reaps the leader into *status. The leader is
 * reaped last because until then its zombie keeps the group's id from being reused. */
static bool reap_exited(local_worker *w, int *status)
{
    siginfo_t info;
    memset(&info, 0, sizeof info);
    if (waitid(P_PID, (id_t)w->pid, &info, WEXITED | WNOHANG | WNOWAIT) != 0) {
        *status = 0;
        return errno == ECHILD;   /* not ours any more: nothing to wait for */
    }
    if (info.si_pid != w->pid)
        return false;   /* still running */
    kill(-w->pid, SIGKILL);
    return waitpid(w->pid, status, 0) == w->pid || errno == ECHILD;
}

static void *supervise(void *arg)
{
    supervisor *sv = arg;
    for (;;) {
        pthread_mutex_lock(&sv->mu);
        bool stopping = sv->stopping;
        double t = strata_mono_s();
        for (int i = 0; i < sv->n && !stopping; i++) {
            local_worker *w = &sv->w[i];
            int status;
            if (w->restart_at == 0 && w->pid > 0 && reap_exited(w, &status)) {
                if (t - w->started > 60)
                    w->backoff = 1;   /* it ran a while: a fresh failure, not a crash loop */
                fprintf(stderr, "%s: worker %s exited (%s %d); restarting in %.0f s\n", sv->prog, w->name,
                        WIFEXITED(status) ? "status" : "signal",
                        WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status), w->backoff);
                w->pid = -1;
                w->restart_at = t + w->backoff;
                w->backoff = w->backoff * 2 > 30 ? 30 : w->backoff * 2;
                /* Status 0 is a worker the coordinator let go (its pipeline partner failed): only
                 * a failure of its own counts against it. */
                w->early_exits += !sv->served && !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
                w->last_status = status;
            }
            if (w->restart_at != 0 && t >= w->restart_at)
                spawn(sv, w);
        }
        pthread_mutex_unlock(&sv->mu);
        if (stopping)
            return NULL;
        struct timespec nap = {0, 200 * 1000000L};
        nanosleep(&nap, NULL);
    }
}

/* Whether a local worker exited EARLY_EXITS_LIMIT times before the server was first ready; says
 * which and how. */
static bool failed_to_start(supervisor *sv)
{
    pthread_mutex_lock(&sv->mu);
    const local_worker *bad = NULL;
    for (int i = 0; i < sv->n && !bad; i++)
        if (sv->w[i].early_exits >= EARLY_EXITS_LIMIT)
            bad = &sv->w[i];
    if (bad) {
        const int st = bad->last_status;
        fprintf(stderr, "%s: worker %s exited %d times before the server was ready (last: %s %d); giving up (see "
                "its messages above)\n", sv->prog, bad->name, bad->early_exits, WIFEXITED(st) ? "status" : "signal",
                WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
    }
    pthread_mutex_unlock(&sv->mu);
    return bad != NULL;
}

/* The address local workers dial for a control server listening on listen (HOST:PORT as given
 * to --control, or unix:PATH) on port: the same host, with a wildcard (0.0.0.0, [::], empty)
 * replaced by its loopback. False when it does not fit in cap. */
static bool worker_control_addr(const char *listen, int port, char *out, size_t cap)
{
    if (!strncmp(listen, "unix:", 5))
        return (size_t)snprintf(out, cap, "%s", listen) < cap;
    const char *colon = strrchr(listen, ':');
    int host_len = colon ? (int)(colon - listen) : 0;
    const char *host = listen;
    if (host_len == 0 || (host_len == 7 && !strncmp(listen, "0.0.0.0", 7))) {
        host = "127.0.0.1";
        host_len = 9;
    } else if ((host_len == 4 && !strncmp(listen, "[::]", 4)) || (host_len == 5 && !strncmp(listen, "[::0]", 5))) {
        host = "[::1]";
        host_len = 5;
    }
    return (size_t)snprintf(out, cap, "%.*s:%d", host_len, host, port) < cap;
}

static bool find_worker_bin(const char *prog, const serve_opts *o, char *out, size_t cap)
{
    if (o->worker_bin) {
        snprintf(out, cap, "%s", o->worker_bin);
    } else {
        char self[PATH_MAX];
        ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
        if (n <= 0) {
            fprintf(stderr, "%s: cannot find this program's folder (/proc/self/exe): pass --worker-bin\n", prog);
            return false;
        }
        self[n] = '\0';
        char *slash = strrchr(self, '/');
        if (slash)
            *slash = '\0';
        if ((size_t)snprintf(out, cap, "%.*s/strata-worker", (int)(cap - 16), self) >= cap) {
            fprintf(stderr, "%s: this program's path is too long: pass --worker-bin\n", prog);
            return false;
        }
    }
    struct stat st;
    if (access(out, X_OK) != 0 || stat(out, &st) != 0) {
        fprintf(stderr, "%s: worker binary %s: %s (build it, or pass --worker-bin)\n", prog, out, strerror(errno));
        return false;
    }
    if (!S_ISREG(st.st_mode)) {   /* a folder passes access(X_OK) */
        fprintf(stderr, "%s: worker binary %s is not a file (pass --worker-bin PATH/strata-worker)\n", prog, out);
        return false;
    }
    return true;
}

/* A fresh random cluster secret in a private folder. */
static bool make_secret(const char *prog, char *dir, size_t dir_cap, char *path, size_t path_cap)
{
    const char *tmp = getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(dir, dir_cap, "%s/strata-serve-XXXXXX", tmp);
    if (!mkdtemp(dir)) {
        fprintf(stderr, "%s: cannot create a private folder in %s: %s\n", prog, tmp, strerror(errno));
        return false;
    }
    unsigned char raw[32];
    strata_error err = {0};
    if (strata_random_bytes(raw, sizeof raw, &err) != STRATA_OK) {
        fprintf(stderr, "%s: %s\n", prog, err.msg);
        return false;
    }
    char hex[2 * sizeof raw + 1];
    for (size_t i = 0; i < sizeof raw; i++)
        snprintf(hex + 2 * i, 3, "%02x", raw[i]);
    explicit_bzero(raw, sizeof raw);
    snprintf(path, path_cap, "%s/" SECRET_FILE_NAME, dir);
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    int werr = fd < 0 ? errno : write_secret_file(fd, hex, 2 * sizeof raw);
    if (fd >= 0)
        close(fd);
    explicit_bzero(hex, sizeof hex);
    if (werr)
        fprintf(stderr, "%s: cannot write %s: %s\n", prog, path, strerror(werr));
    return werr == 0;
}

/* Sends sig to the process group worker w leads, while it is unreaped (its pid, so its group's
 * id, cannot have been taken by another process yet). */
static void signal_worker_group(const local_worker *w, int sig)
{
    if (w->pid > 0 && kill(-w->pid, sig) != 0 && errno == ESRCH)
        kill(w->pid, sig);   /* not a group leader (it left its group): the worker alone */
}

static void stop_workers(supervisor *sv)
{
    pthread_mutex_lock(&sv->mu);
    sv->stopping = true;
    pthread_mutex_unlock(&sv->mu);
    if (sv->thread_started)
        pthread_join(sv->thread, NULL);
    /* Joined workers were told to shut down and need a moment; one that never joined (still
     * reaching the coordinator, or a --worker-bin wrapper whose child hangs) was told nothing:
     * SIGTERM to its group after TERM_AFTER_S, SIGKILL after KILL_AFTER_S. Whatever is left in
     * a group whose leader exited gets SIGKILL then (reap_exited). */
    enum { TERM_AFTER_S = 2, KILL_AFTER_S = 10 };
    const double start = strata_mono_s();
    bool termed = false;
    for (;;) {
        const double t = strata_mono_s() - start;
        bool left = false;
        for (int i = 0; i < sv->n; i++) {
            local_worker *w = &sv->w[i];
            int status;
            if (w->pid > 0 && reap_exited(w, &status)) {
                w->pid = -1;
            } else if (w->pid > 0 && t > KILL_AFTER_S) {
                signal_worker_group(w, SIGKILL);
                waitpid(w->pid, &status, 0);
                w->pid = -1;
            } else if (w->pid > 0) {
                if (t > TERM_AFTER_S && !termed)
                    signal_worker_group(w, SIGTERM);
                left = true;
            }
        }
        termed = termed || t > TERM_AFTER_S;
        if (!left)
            return;
        struct timespec nap = {0, 50 * 1000000L};
        nanosleep(&nap, NULL);
    }
}

/* ---- stop signals ---- */

/* SIGTERM, SIGINT and SIGHUP (a terminal that goes away, as for strata-worker) start the drain.
 * They cannot be left blocked for sigwait alone: a library may start threads before main
 * (OpenBLAS's pool does, with nothing blocked), and a signal the kernel hands to such a thread
 * would kill the process, a second SIGTERM during the drain included. So a handler takes them
 * wherever they land: it records the first, counts them (a second one cuts the drain short) and
 * wakes the main thread through a pipe. Our own threads keep them blocked (the main thread opens
 * them only while it waits in wait_stop_signal), so no gRPC or worker thread is interrupted. */
static const int stop_sigs[] = {SIGTERM, SIGINT, SIGHUP};
#define N_STOP_SIGS (sizeof stop_sigs / sizeof stop_sigs[0])
static volatile sig_atomic_t stop_signal, stop_signals;
static int stop_pipe[2] = {-1, -1};

static void on_stop_signal(int sig)
{
    const int saved = errno;   /* async-signal-safe calls only */
    if (!stop_signal)
        stop_signal = sig;
    if (stop_signals < 1000)
        stop_signals++;
    ssize_t w = write(stop_pipe[1], "", 1);   /* non-blocking: a full pipe already wakes the reader */
    (void)w;
    errno = saved;
}

static int watch_stop_signals(const char *prog)
{
    if (pipe2(stop_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
        fprintf(stderr, "%s: cannot create a pipe for signals: %s\n", prog, strerror(errno));
        return -1;
    }
    sigset_t sigs;
    sigemptyset(&sigs);
    for (size_t i = 0; i < N_STOP_SIGS; i++)
        sigaddset(&sigs, stop_sigs[i]);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);   /* before any thread of ours starts: they inherit it */
    struct sigaction sa = {.sa_handler = on_stop_signal, .sa_flags = SA_RESTART};
    sigfillset(&sa.sa_mask);
    for (size_t i = 0; i < N_STOP_SIGS; i++) {
        struct sigaction old;
        if (sigaction(stop_sigs[i], NULL, &old) != 0 ||
            (old.sa_handler != SIG_IGN && sigaction(stop_sigs[i], &sa, NULL) != 0)) {
            fprintf(stderr, "%s: cannot handle %s: %s\n", prog, strsignal(stop_sigs[i]), strerror(errno));
            return -1;
        }   /* one it was started ignoring (nohup; SIGINT in a script's background job) stays ignored */
    }
    return 0;
}

/* Waits up to seconds (0: none) for SIGTERM, SIGINT or SIGHUP, the signals open on this thread
 * meanwhile, so that one pending here arrives even when no other thread could take it; returns
 * the first signal so far, or 0. */
static int wait_stop_signal(double seconds)
{
    sigset_t open;
    pthread_sigmask(SIG_BLOCK, NULL, &open);
    for (size_t i = 0; i < N_STOP_SIGS; i++)
        sigdelset(&open, stop_sigs[i]);
    struct pollfd pfd = {.fd = stop_pipe[0], .events = POLLIN};
    struct timespec t = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    (void)ppoll(&pfd, 1, &t, &open);   /* EINTR: the handler ran here */
    char drain[16];
    while (read(stop_pipe[0], drain, sizeof drain) > 0) {
    }
    return stop_signal;
}

/* ---- main ---- */

int serve_main(int argc, char **argv, const char *prog, bool local)
{
    serve_opts o;
    json_t *config = NULL;
    int rc = parse(argc, argv, prog, local, &o, &config);
    if (rc != 0) {
        json_decref(config);
        return rc < 0 ? 0 : rc;
    }
    signal(SIGPIPE, SIG_IGN);
    /* Started with SIGCHLD ignored (a parent's choice the kernel passes on through exec), the
     * workers' exits would be reaped unseen: none restarted, and waitpid failing as if none ran. */
    if (local)
        signal(SIGCHLD, SIG_DFL);
    if (watch_stop_signals(prog) != 0) {
        json_decref(config);
        return EXIT_RUNTIME;
    }

    int exit_code = EXIT_RUNTIME;
    char secret[4096], token[4096], secret_dir[PATH_MAX] = "", secret_path[PATH_MAX] = "";
    size_t secret_len = 0, token_len = 0;
    metrics_registry *reg = NULL;
    metrics_http *mhttp = NULL;
    coord *co = NULL;
    ctl_server *ctl = NULL;
    api_server *api = NULL;
    supervisor *sv = NULL;
    bool made_nvme_dir = false;
    strata_error err = {0};

    if (o.secret_file) {
        snprintf(secret_path, sizeof secret_path, "%s", o.secret_file);
    } else if (!make_secret(prog, secret_dir, sizeof secret_dir, secret_path, sizeof secret_path)) {
        goto out;
    }
    if (!read_small_file(prog, "--secret-file", secret_path, secret, sizeof secret, &secret_len)) {
        exit_code = o.secret_file ? EXIT_USAGE : exit_code;  /* the one we made: a runtime failure */
        goto out;
    }
    if (secret_len < CTL_SECRET_MIN_BYTES || secret_len > CTL_SECRET_MAX_BYTES) {
        fprintf(stderr, "%s: the cluster secret in %s has %zu bytes; it must have %d to %d (a trailing newline is "
                        "ignored)\n", prog, secret_path, secret_len, CTL_SECRET_MIN_BYTES, CTL_SECRET_MAX_BYTES);
        exit_code = EXIT_USAGE;
        goto out;
    }
    if (o.token_file && !read_small_file(prog, "--token-file", o.token_file, token, sizeof token, &token_len)) {
        exit_code = EXIT_USAGE;
        goto out;
    }
    if (o.token_file && token_len == 0) {
        fprintf(stderr, "%s: --token-file %s is empty\n", prog, o.token_file);
        exit_code = EXIT_USAGE;
        goto out;
    }
    /* Each worker makes and checks its own folder inside; DIR itself must exist for that. */
    if (o.nvme_dir) {
        struct stat st;
        if (mkdir(o.nvme_dir, 0700) == 0) {
            made_nvme_dir = true;
        } else if (errno != EEXIST) {
            fprintf(stderr, "%s: --nvme-dir %s: cannot create it: %s\n", prog, o.nvme_dir, strerror(errno));
            exit_code = EXIT_USAGE;
            goto out;
        } else if (stat(o.nvme_dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
            fprintf(stderr, "%s: --nvme-dir %s: not a folder\n", prog, o.nvme_dir);
            exit_code = EXIT_USAGE;
            goto out;
        }
    }
    if (o.metrics && !(reg = metrics_create())) {
        fprintf(stderr, "%s: out of memory\n", prog);
        goto out;
    }
    coord_config cc = {.model_path = o.model, .replicas = (uint32_t)o.replicas, .stages = (uint32_t)o.stages,
                       .stage_layers = o.stage_layers,
                       .kv = o.kv, .kv_codecs = o.kv_codecs, .block_tokens = (uint32_t)o.block_tokens, .ctx = (uint32_t)o.ctx,
                       .max_seqs = (uint32_t)o.max_seqs, .max_batch_tokens = (uint32_t)o.max_batch_tokens,
                       .steps_in_flight = (uint32_t)o.steps_in_flight, .device_kv_bytes = strata_mib_bytes(o.device_mib), .host_kv_bytes = strata_mib_bytes(o.host_mib),
                       .nvme_kv_bytes = strata_mib_bytes(o.nvme_mib), .prefix_cache_bytes = strata_mib_bytes(o.prefix_mib),
                       .step_timeout_ms = (uint32_t)(o.step_timeout_s * 1000),
                       .max_recoveries = (uint32_t)o.max_recoveries,
                       .recovery_wait_ms = (uint32_t)(o.recovery_wait_s * 1000), .metrics = reg, .quiet = o.quiet};
    if (!(co = coord_create(&cc, &err))) {
        fprintf(stderr, "%s: %s\n", prog, err.msg);
        exit_code = err.code == STRATA_EINVAL ? EXIT_USAGE : EXIT_RUNTIME;
        goto out;
    }
    if (reg && metrics_http_start(reg, o.metrics, &mhttp, &err) != STRATA_OK) {
        fprintf(stderr, "%s: --metrics %s: %s\n", prog, o.metrics, err.msg);
        exit_code = err.code == STRATA_EINVAL ? EXIT_USAGE : EXIT_RUNTIME;
        goto out;
    }
    ctl_server_options co_opts = ctl_server_options_default();
    co_opts.listen_addr = control_listen_addr(&o, local);
    co_opts.cluster_secret = secret;
    co_opts.cluster_secret_len = secret_len;
    co_opts.tls_cert_file = o.control_tls_cert;
    co_opts.tls_key_file = o.control_tls_key;
    ctl_handler h = coord_ctl_handler(co);
    if (ctl_server_start(&co_opts, &h, &ctl, &err) != STRATA_OK) {
        fprintf(stderr, "%s: --control %s: %s\n", prog, co_opts.listen_addr, err.msg);
        exit_code = err.code == STRATA_EINVAL ? EXIT_USAGE : EXIT_RUNTIME;   /* a bad TLS pair: the user's files */
        goto out;
    }
    api_server_options ao = api_server_options_default();
    ao.listen_addr = o.listen;
    ao.tls_cert_file = o.tls_cert;
    ao.tls_key_file = o.tls_key;
    ao.bearer_token = o.token_file ? token : NULL;
    ao.limits = coord_limits(co);
    api_backend b = coord_api_backend(co);
    if (api_server_start(&ao, &b, &api, &err) != STRATA_OK) {
        fprintf(stderr, "%s: --listen %s: %s\n", prog, o.listen ? o.listen : API_SERVER_DEFAULT_ADDR, err.msg);
        exit_code = err.code == STRATA_EINVAL ? EXIT_USAGE : EXIT_RUNTIME;   /* a bad TLS pair: the user's files */
        goto out;
    }
    if (local) {
        if (!(sv = calloc(1, sizeof *sv)))
            goto out;
        sv->prog = prog;
        sv->o = &o;
        pthread_mutex_init(&sv->mu, NULL);
        if (!find_worker_bin(prog, &o, sv->bin, sizeof sv->bin)) {
            free(sv);
            sv = NULL;
            exit_code = EXIT_USAGE;
            goto out;
        }
        if (!worker_control_addr(co_opts.listen_addr, ctl_server_port(ctl), sv->control, sizeof sv->control)) {
            fprintf(stderr, "%s: --control %s: too long\n", prog, co_opts.listen_addr);
            free(sv);
            sv = NULL;
            exit_code = EXIT_USAGE;
            goto out;
        }
        snprintf(sv->secret_path, sizeof sv->secret_path, "%s", secret_path);
        if (*secret_dir) {
            snprintf(sv->secret_dir, sizeof sv->secret_dir, "%s", secret_dir);
            memcpy(sv->secret, secret, secret_len);
            sv->secret_len = secret_len;
        }
        sv->n = (int)(o.replicas * o.stages);
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        sv->threads = o.threads ? o.threads : (cpus > sv->n ? cpus / sv->n : 1);
        for (int i = 0; i < sv->n; i++) {
            snprintf(sv->w[i].name, sizeof sv->w[i].name, "local-%d", i);
            sv->w[i].backoff = 1;
            spawn(sv, &sv->w[i]);
        }
        sv->thread_started = pthread_create(&sv->thread, NULL, supervise, sv) == 0;
        if (!sv->thread_started) {
            fprintf(stderr, "%s: cannot start the worker supervisor\n", prog);
            sv->stopping = true;
            for (int i = 0; i < sv->n; i++)   /* (pid -1 would signal every process we may) */
                signal_worker_group(&sv->w[i], SIGKILL);
            goto out;
        }
    }
    uint32_t ready, total;
    coord_worker_counts(co, &ready, &total);
    if (!o.quiet)
        fprintf(stderr, "%s: public API on %s port %d%s; waiting for %u workers (control port %d%s)\n", prog,
                o.listen ? o.listen : API_SERVER_DEFAULT_ADDR, api_server_port(api), o.tls_cert ? " (TLS)" : "", total,
                ctl_server_port(ctl), o.control_tls_cert ? ", TLS" : "");
    /* Wait for the workers, a signal, or (strata serve) the ready timeout. */
    double waited = 0;
    int sig = 0;
    bool is_ready = false;
    while (!sig) {
        if (!is_ready && coord_wait_ready(co, 0)) {
            is_ready = true;
            if (sv) {
                pthread_mutex_lock(&sv->mu);
                sv->served = true;
                pthread_mutex_unlock(&sv->mu);
            }
            if (mhttp)
                fprintf(stderr, "%s: ready: serving %s on port %d, metrics port %u\n", prog, o.model,
                        api_server_port(api), (unsigned)metrics_http_port(mhttp));
            else
                fprintf(stderr, "%s: ready: serving %s on port %d\n", prog, o.model, api_server_port(api));
        }
        const double before = strata_mono_s();
        sig = wait_stop_signal(1.0);
        waited += strata_mono_s() - before;
        if (!is_ready && !sig && sv && failed_to_start(sv))
            break;
        if (!is_ready && !sig && waited >= (double)o.ready_timeout_s) {
            coord_worker_counts(co, &ready, &total);
            if (local) {
                fprintf(stderr, "%s: only %u of %u workers ready after %ld s; giving up (see the workers' messages "
                        "above)\n", prog, ready, total, o.ready_timeout_s);
                break;
            }
            if (!o.quiet)
                fprintf(stderr, "%s: %u of %u workers ready; still waiting\n", prog, ready, total);
            waited = 0;
        }
    }
    if (sig) {
        if (!o.quiet)
            fprintf(stderr, "%s: %s: draining (up to %ld s)\n", prog,
                    sig == SIGINT ? "interrupted" : sig == SIGHUP ? "hangup" : "terminated", o.drain_s);
        /* In slices, so that a second signal (Ctrl-C again) ends the drain at once; the
         * zero-length wait lets a signal pending on this thread arrive. */
        const double until = strata_mono_s() + (double)o.drain_s;
        int left;
        bool cut = false;
        while ((left = coord_drain(co, 100)) > 0 && strata_mono_s() < until) {
            (void)wait_stop_signal(0.0);
            if ((cut = stop_signals > 1))
                break;
        }
        if (left && !o.quiet)
            fprintf(stderr, "%s: %d %s still running %s: %s with UNAVAILABLE\n", prog, left,
                    left == 1 ? "request" : "requests", cut ? "at a second signal" : "after the drain",
                    left == 1 ? "it ends" : "they end");
        exit_code = 0;
    }
out:
    arm_teardown_limit(prog, *secret_dir ? secret_path : "", secret_dir);
    /* After a drain every stream has ended; a moment lets their last messages leave. */
    api_server_shutdown(api, exit_code == 0 ? 2000 : 0);
    coord_stop(co);
    if (sv)
        stop_workers(sv);
    ctl_server_shutdown(ctl);
    metrics_http_stop(mhttp);
    coord_destroy(co);
    metrics_destroy(reg);
    if (sv) {
        /* A worker restarted after a crash finds its spill folder there and so does not remove
         * it: the folders serve made (inside the one it made) go here, when empty. */
        for (int i = 0; made_nvme_dir && i < sv->n; i++) {
            char dir[PATH_MAX];
            if (snprintf(dir, sizeof dir, "%s/%s", o.nvme_dir, sv->w[i].name) < (int)sizeof dir)
                rmdir(dir);
        }
        pthread_mutex_destroy(&sv->mu);
        explicit_bzero(sv->secret, sizeof sv->secret);
        free(sv);
    }
    if (*secret_dir) {
        unlink(secret_path);
        rmdir(secret_dir);
    }
    if (made_nvme_dir)
        rmdir(o.nvme_dir);  /* only when the workers left it empty */
    memset(secret, 0, sizeof secret);
    memset(token, 0, sizeof token);
    json_decref(config);
    alarm(0);
    return exit_code;
}
