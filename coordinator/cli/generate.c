/* strata generate: load a model, tokenize a prompt, generate through the compressed KV cache. */
#include <getopt.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <time.h>

#include "coordinator/cli/cli.h"
#include "kernels/ops.h"
#include "coordinator/cli/generate_cuda.h"
#include "coordinator/cli/kvopts.h"
#include "coordinator/cli/remote.h"
#include "coordinator/cli/tiers.h"
#include "kvstore/blockfile.h"
#include "kvstore/clock.h"
#include "kvstore/kv_cache.h"
#include "kvstore/numarg.h"
#include "kvstore/plan.h"
#include "proto/validate.h"
#include "worker/generate.h"
#include "worker/model.h"

#define MAX_STOP 16

static void usage(FILE *out)
{
    fprintf(out,
            "usage: strata generate --prompt TEXT [options]\n"
            "\n"
            "Generates a continuation of TEXT on the CPU (or a CUDA GPU: --device), streaming it to\n"
            "stdout as it is produced.\n"
            "The KV cache is kept compressed in blocks (fp16, KIVI, GEAR, OTT or TaDA, per layer).\n"
            "\n"
            "input:\n"
            "  -m, --model PATH        GGUF model (default: $STRATA_MODEL or\n"
            "                          %s),\n"
            "                          or synthetic:NAME[:seed=N] (random weights of a known shape:\n"
            "                          tiny, smollm2-135m, llama3.2-1b, llama2-7b, llama3-8b, llama3-70b)\n"
            "  -p, --prompt TEXT       the prompt (required; '-' reads it from stdin, up to 64 MiB)\n"
            "      --chat              wrap the prompt in the model's chat template as a user turn\n"
            "      --system TEXT       system message for --chat (default: the template's own)\n"
            "sampling:\n"
            "  -n, --max-tokens N      tokens to generate at most (default 128)\n"
            "  -t, --temperature T     0 = greedy (default 0)\n"
            "      --top-k K           keep the K most likely tokens, 0 = off (default 0)\n"
            "      --top-p P           nucleus sampling threshold in (0, 1] (default 1)\n"
            "  -s, --seed S            random seed for sampling (default 42)\n"
            "      --stop STR          stop before STR (repeatable, up to %d)\n"
            "      --ignore-eos        do not stop at end-of-generation tokens\n"
            "KV cache:\n",
            STRATA_DEFAULT_MODEL, MAX_STOP);
    cli_kv_usage(out, "kivi4");
    fprintf(out,
            "      --ctx N             context length: prompt + generated tokens (default: the\n"
            "                          model's training context, at most 8192; beyond the training\n"
            "                          context: a warning)\n"
            "      --save-kv FILE      after generating, write the sequence's KV blocks to FILE\n"
            "                          (read it with strata inspect)\n");
    cli_tier_usage(out);
    fprintf(out,
            "output:\n"
            "      --stats             print timing (prefill and decode tokens/s), KV bytes per token\n"
            "                          and the blocks, bytes, evictions, spills, restores and CRC\n"
            "                          failures of each KV tier to stderr\n"
            "      --no-echo           print only the generated text (plain prompts are echoed\n"
            "                          first by default; --chat prompts never are)\n"
            "  -q, --quiet             no progress messages on stderr\n"
            "      --threads N         compute threads: matmul kernel and BLAS (default: the number\n"
            "                          OpenBLAS picks; keep it equal between runs you compare)\n"
            "      --device cpu|cuda[:N]  where the forward pass runs (default cpu). cuda: fp16 weights\n"
            "                          and the compressed KV cache on GPU N (default 0); every codec,\n"
            "                          and plans whose layers share one fp16 window (an fp16 layer\n"
            "                          keeps none: give the others -r0); the tier options make a\n"
            "                          device pool over pinned host memory and NVMe that holds one\n"
            "                          layer's blocks at a time; no --save-kv (docs/gpu.md)\n"
            "remote (send the request to `strata serve` or strata-coordinator instead):\n"
            "      --server HOST:PORT  the server's public API; the server's model, KV codec and\n"
            "                          context apply (--kv is sent as the request's kv_codec)\n"
            "      --token-file FILE   bearer token for a server started with --token-file\n"
            "      --tls-ca FILE       PEM certificate(s) to verify a TLS server with (enables TLS)\n"
            "  -h, --help              show this help\n");
}

typedef struct gen_opts {
    const char *model_path;
    const char *prompt;
    const char *system;
    bool chat;
    int max_tokens;
    sampler_params sampling;
    const char *stop[MAX_STOP];
    size_t n_stop;
    bool ignore_eos;
    cli_kv_opts kv;
    long ctx;                     /* 0: model default */
    cli_tier_opts tiers;
    const char *save_kv;
    bool stats, quiet, no_echo;
    int threads;
    const char *server, *token_file, *tls_ca;   /* --server: send the request to a strata server */
    int cuda_device;              /* --device cuda:N; -1: the CPU */
    const char *local_only;   /* the first flag given that only applies without --server */
    bool kv_given;
} gen_opts;

enum {
    OPT_CHAT = 1000, OPT_SYSTEM, OPT_TOP_K, OPT_TOP_P, OPT_STOP, OPT_IGNORE_EOS, OPT_KV, OPT_KV_PLAN, OPT_CTX, OPT_SAVE_KV, OPT_STATS, OPT_THREADS, OPT_NO_ECHO,
    OPT_SERVER, OPT_TOKEN_FILE, OPT_TLS_CA, OPT_DEVICE,
};

static int parse_opts(int argc, char **argv, gen_opts *o)
{
    static const struct option opts[] = {
        {"model", required_argument, NULL, 'm'},
        {"prompt", required_argument, NULL, 'p'},
        {"chat", no_argument, NULL, OPT_CHAT},
        {"system", required_argument, NULL, OPT_SYSTEM},
        {"max-tokens", required_argument, NULL, 'n'},
        {"temperature", required_argument, NULL, 't'},
        {"top-k", required_argument, NULL, OPT_TOP_K},
        {"top-p", required_argument, NULL, OPT_TOP_P},
        {"seed", required_argument, NULL, 's'},
        {"stop", required_argument, NULL, OPT_STOP},
        {"ignore-eos", no_argument, NULL, OPT_IGNORE_EOS},
        {"kv", required_argument, NULL, OPT_KV},
        {"kv-group", required_argument, NULL, OPT_KV_GROUP},
        {"kv-residual", required_argument, NULL, OPT_KV_RESIDUAL},
        {"kv-plan", required_argument, NULL, OPT_KV_PLAN},
        {"block-tokens", required_argument, NULL, OPT_BLOCK_TOKENS},
        {"ctx", required_argument, NULL, OPT_CTX},
        CLI_TIER_OPTIONS,
        {"save-kv", required_argument, NULL, OPT_SAVE_KV},
        {"stats", no_argument, NULL, OPT_STATS},
        {"quiet", no_argument, NULL, 'q'},
        {"no-echo", no_argument, NULL, OPT_NO_ECHO},
        {"threads", required_argument, NULL, OPT_THREADS},
        {"device", required_argument, NULL, OPT_DEVICE},
        {"server", required_argument, NULL, OPT_SERVER},
        {"token-file", required_argument, NULL, OPT_TOKEN_FILE},
        {"tls-ca", required_argument, NULL, OPT_TLS_CA},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    *o = (gen_opts){.model_path = cli_default_model(), .max_tokens = 128,
                    .sampling = {.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .seed = 42},
                    .kv = {.kv = "kivi4", .group = -1, .residual = -1, .block_tokens = 64}, .cuda_device = -1};
    cli_tier_opts_init(&o->tiers);
    long v;
    int c;
    optind = 1;
    int idx = -1;
    while ((c = getopt_long(argc, argv, "m:p:n:t:s:qh", opts, &idx)) != -1) {
        switch (c) {   /* flags that need the model in this process */
        case 'm': case OPT_CHAT: case OPT_SYSTEM: case OPT_KV_GROUP: case OPT_KV_RESIDUAL: case OPT_KV_PLAN:
        case OPT_BLOCK_TOKENS: case OPT_CTX: case OPT_SAVE_KV: case OPT_THREADS: case OPT_DEVICE: case OPT_TIER_DEVICE:
        case OPT_TIER_HOST: case OPT_TIER_NVME_DIR: case OPT_TIER_NVME: case OPT_TIER_CONFIG:
            if (!o->local_only)
                o->local_only = c == 'm' ? "--model" : idx >= 0 ? opts[idx].name : "?";
            break;
        default: break;
        }
        idx = -1;
        switch (c) {
        case OPT_SERVER:
            o->server = optarg;
            if (!strata_check_addr("strata generate", "--server", optarg, false))
                return EXIT_USAGE;
            break;
        case OPT_TOKEN_FILE: o->token_file = optarg; break;
        case OPT_TLS_CA: o->tls_ca = optarg; break;
        case 'm': o->model_path = optarg; break;
        case 'p': o->prompt = optarg; break;
        case OPT_CHAT: o->chat = true; break;
        case OPT_SYSTEM: o->system = optarg; break;
        case 'n':
            if (!cli_parse_long("--max-tokens", optarg, 1, 1 << 20, &v)) return EXIT_USAGE;
            o->max_tokens = (int)v;
            break;
        case 't':
            if (!cli_parse_float("--temperature", optarg, 0.0, 100.0, &o->sampling.temperature)) return EXIT_USAGE;
            break;
        case OPT_TOP_K:
            if (!cli_parse_long("--top-k", optarg, 0, 1 << 24, &v)) return EXIT_USAGE;
            o->sampling.top_k = (int)v;
            break;
        case OPT_TOP_P:
        {   /* the interval is open at 0: one message for every value outside it */
            char *end;
            errno = 0;
            const double p = strtod(optarg, &end);
            if (errno || end == optarg || *end || !(p > 0.0 && p <= 1.0) || !((float)p > 0.0f)) {
                fprintf(stderr, "strata: --top-p: '%s' is not a number in (0, 1]\n", optarg);
                return EXIT_USAGE;
            }
            o->sampling.top_p = (float)p;
            break;
        }
        case 's':
            if (!cli_parse_u64("--seed", optarg, &o->sampling.seed)) return EXIT_USAGE;
            break;
        case OPT_STOP:
            if (o->n_stop == MAX_STOP) {
                fprintf(stderr, "strata: at most %d --stop strings\n", MAX_STOP);
                return EXIT_USAGE;
            }
            if (!*optarg) {
                fprintf(stderr, "strata: --stop needs a non-empty string\n");
                return EXIT_USAGE;
            }
            o->stop[o->n_stop++] = optarg;
            break;
        case OPT_IGNORE_EOS: o->ignore_eos = true; break;
        case OPT_KV: o->kv.kv = optarg; o->kv_given = true; break;
        case OPT_KV_PLAN: o->kv.plan_file = optarg; break;
        case OPT_KV_GROUP: case OPT_KV_RESIDUAL: case OPT_BLOCK_TOKENS:
            if (!cli_kv_shape_flag(c, optarg, &o->kv)) return EXIT_USAGE;
            break;
        case OPT_CTX:
            if (!cli_parse_long("--ctx", optarg, 2, 1 << 22, &o->ctx)) return EXIT_USAGE;
            break;
        case OPT_TIER_DEVICE: case OPT_TIER_HOST: case OPT_TIER_NVME_DIR: case OPT_TIER_NVME: case OPT_TIER_CONFIG:
            if (cli_tier_flag(c, optarg, &o->tiers)) return EXIT_USAGE;
            break;
        case OPT_SAVE_KV: o->save_kv = optarg; break;
        case OPT_STATS: o->stats = true; break;
        case 'q': o->quiet = true; break;
        case OPT_NO_ECHO: o->no_echo = true; break;
        case OPT_THREADS:
            if (!cli_parse_long("--threads", optarg, 1, 1024, &v)) return EXIT_USAGE;
            o->threads = (int)v;
            break;
        case OPT_DEVICE:
            if (!strcmp(optarg, "cpu")) {
                o->cuda_device = -1;
            } else if (!strcmp(optarg, "cuda")) {
                o->cuda_device = 0;
            } else if (!strncmp(optarg, "cuda:", 5) && optarg[5]) {
                if (!cli_parse_long("--device cuda:N", optarg + 5, 0, 1023, &v)) return EXIT_USAGE;
                o->cuda_device = (int)v;
            } else {
                fprintf(stderr, "strata generate: --device takes cpu, cuda or cuda:N (got '%s')\n", optarg);
                return EXIT_USAGE;
            }
            break;
        case 'h': usage(stdout); return -1;
        default: usage(stderr); return EXIT_USAGE;
        }
    }
    if (optind != argc) {
        fprintf(stderr, "strata generate: unexpected argument '%s' (the prompt goes after --prompt)\n", argv[optind]);
        return EXIT_USAGE;
    }
    if (!o->prompt) {
        fprintf(stderr, "strata generate: --prompt is required (try --help)\n");
        return EXIT_USAGE;
    }
    if (o->server && o->chat) {
        fprintf(stderr, "strata generate: --chat does not apply with --server (the server takes the prompt as "
                        "text; write the chat template into it)\n");
        return EXIT_USAGE;
    }
    if (o->server && o->local_only) {
        fprintf(stderr, "strata generate: %s%s does not apply with --server (the server's configuration decides)\n",
                o->local_only[0] == '-' ? "" : "--", o->local_only);
        return EXIT_USAGE;
    }
    if (!o->server && (o->token_file || o->tls_ca)) {
        fprintf(stderr, "strata generate: --token-file and --tls-ca go with --server\n");
        return EXIT_USAGE;
    }
    if (!*o->prompt) {
        fprintf(stderr, "strata generate: the prompt is empty\n");
        return EXIT_USAGE;
    }
    if (o->system && !o->chat) {
        fprintf(stderr, "strata generate: --system only applies with --chat\n");
        return EXIT_USAGE;
    }
    if (o->kv_given && o->kv.plan_file) {
        fprintf(stderr, "strata generate: --kv and --kv-plan both set the KV codecs; give one\n");
        return EXIT_USAGE;
    }
    if (o->save_kv && !cli_check_writable("generate", "--save-kv", o->save_kv, true))
        return EXIT_USAGE;
    int rc = cli_tier_finish("generate", &o->tiers);
    if (rc == 0 && o->cuda_device >= 0 && o->save_kv) {
        fprintf(stderr, "strata generate: --save-kv does not apply with --device cuda yet (the blocks stay on the "
                        "device)\n");
        rc = EXIT_USAGE;
    }
    return rc;
}

/* A prompt read from stdin longer than this is refused: it is far beyond any model's context
 * (a 1M-token context is about 4 MiB of English), and reading on would only fill memory
 * (`strata generate -p - < /dev/zero`). */
#define STDIN_PROMPT_MAX_BYTES ((size_t)64 << 20)

/* All of stdin; NULL with *read_errno 0 when out of memory, EFBIG past STDIN_PROMPT_MAX_BYTES,
 * else with the read's errno (EISDIR when stdin is a folder). */
static char *read_stdin(size_t *out_len, int *read_errno)
{
    *read_errno = 0;
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    while (buf) {
        size_t got = fread(buf + len, 1, cap - len - 1, stdin);
        len += got;
        if (got == 0)
            break;
        if (len > STDIN_PROMPT_MAX_BYTES) {
            free(buf);
            *read_errno = EFBIG;
            return NULL;
        }
        if (len + 1 == cap) {
            char *grown = realloc(buf, cap * 2);
            if (!grown) {
                free(buf);
                return NULL;
            }
            buf = grown;
            cap *= 2;
        }
    }
    if (buf && ferror(stdin)) {
        *read_errno = errno ? errno : EIO;
        free(buf);
        buf = NULL;
    }
    if (buf)
        buf[len] = '\0';
    *out_len = len;
    return buf;
}

/* Progress of a long prefill (minutes on a CPU): a line rewritten per layer on a terminal, else
 * one at each quarter. */
typedef struct prefill_progress {
    bool tty;
    double t0;
    int last_quarter;
} prefill_progress;

static void show_prefill_progress(void *ctx, int done, int n_layers, size_t n_tokens)
{
    prefill_progress *p = ctx;
    const double el = cli_now_seconds() - p->t0;
    if (p->tty) {
        fprintf(stderr, "\rstrata: prefill of %zu tokens: layer %d of %d, %.0f s", n_tokens, done, n_layers, el);
        if (done == n_layers)
            fputc('\n', stderr);
        return;
    }
    const int quarter = done * 4 / n_layers;
    if (quarter > p->last_quarter) {
        p->last_quarter = quarter;
        fprintf(stderr, "strata: prefill of %zu tokens: %d%% (%d of %d layers), %.0f s\n", n_tokens, quarter * 25, done,
                n_layers, el);
    }
}

static int print_text(void *user, const char *text, size_t len)
{
    (void)user;
    fwrite(text, 1, len, stdout);
    fflush(stdout);
    return ferror(stdout) ? 1 : 0;   /* a closed pipe ends generation */
}

static void print_stats(const model *m, const kv_seq *seq, const cli_kv_memory *mem, const generate_result *r)
{
    const kv_pool *pool = mem->pool;
    const model_config *cfg = model_get_config(m);
    kv_seq_stats st;
    kv_seq_get_stats(seq, &st);
    char one_codec[64];
    char *codec = NULL;   /* the whole plan, however long (a fixed buffer cut it mid-name) */
    kv_codec_params *codecs = malloc((size_t)cfg->n_layers * sizeof *codecs);
    if (codecs) {
        for (int l = 0; l < cfg->n_layers; l++)
            codecs[l] = *kv_pool_layer_codec(pool, l);
        codec = kv_plan_name(codecs, cfg->n_layers);
        free(codecs);
    }
    if (!codec)
        kv_codec_name(kv_pool_codec(pool), one_codec, sizeof one_codec);
    const double per_layer_tokens = st.tokens ? (double)st.tokens / cfg->n_layers : 0.0;
    const double block_tokens = st.block_tokens ? (double)st.block_tokens / cfg->n_layers : 0.0;
    const double fp16_per_token = 2.0 * 2.0 * cfg->n_kv_heads * cfg->head_dim * cfg->n_layers;
    fprintf(stderr, "\n--- stats ---\n");
    fprintf(stderr, "prefill: %zu tokens in %.3f s (%.1f tokens/s)\n", r->prompt_tokens, r->prefill_seconds,
            r->prefill_seconds > 0 ? (double)r->prompt_tokens / r->prefill_seconds : 0.0);
    fprintf(stderr, "decode:  %zu tokens in %.3f s (%.2f tokens/s)\n", r->decode_steps, r->decode_seconds,
            r->decode_seconds > 0 ? (double)r->decode_steps / r->decode_seconds : 0.0);
    fprintf(stderr, "finish:  %s after %zu tokens\n", finish_reason_name(r->finish), r->completion_tokens);
    fprintf(stderr, "kv cache (%s, %d layers): %.0f tokens, %zu blocks holding %.0f tokens/layer, "
                    "fp16 tail %.0f tokens/layer\n",
            codec ? codec : one_codec, cfg->n_layers, per_layer_tokens, st.blocks, block_tokens,
            per_layer_tokens - block_tokens);
    free(codec);
    if (block_tokens > 0)
        fprintf(stderr, "kv bytes/token in blocks: %.1f (fp16 would be %.0f: %.3fx, %.2fx smaller)\n",
                (double)st.block_bytes / block_tokens, fp16_per_token,
                (double)st.block_bytes / block_tokens / fp16_per_token,
                fp16_per_token / ((double)st.block_bytes / block_tokens));
    else
        fprintf(stderr, "kv bytes/token in blocks: n/a (the sequence is shorter than the residual window + one block)\n");
    if (per_layer_tokens > 0)
        fprintf(stderr, "kv bytes/token incl. fp16 tail: %.1f (total %.2f MiB; pool %zu of %zu slots free)\n",
                (double)(st.block_bytes + st.tail_bytes) / per_layer_tokens,
                (double)(st.block_bytes + st.tail_bytes) / 1048576.0, kv_pool_free(pool), kv_pool_capacity(pool));
    cli_kv_memory_print_stats(mem, stderr);
}

int cmd_generate(int argc, char **argv)
{
    gen_opts o;
    int rc = parse_opts(argc, argv, &o);
    if (rc != 0) {
        cli_tier_opts_free(&o.tiers);
        return rc < 0 ? 0 : rc;
    }
    if (o.threads)
        kern_set_threads(o.threads);

    strata_error err = {0};

    char *stdin_prompt = NULL;
    size_t prompt_len = strlen(o.prompt);
    if (!strcmp(o.prompt, "-")) {
        int read_errno;
        stdin_prompt = read_stdin(&prompt_len, &read_errno);
        if (!stdin_prompt) {
            if (read_errno == EFBIG) {
                fprintf(stderr, "strata generate: the prompt read from stdin is over %zu MiB, beyond any model's "
                        "context\n", STDIN_PROMPT_MAX_BYTES >> 20);
                return EXIT_USAGE;
            }
            if (read_errno) {   /* a folder is the user's mistake; an I/O error is not */
                fprintf(stderr, "strata generate: reading the prompt from stdin: %s\n", strerror(read_errno));
                return read_errno == EISDIR ? EXIT_USAGE : EXIT_RUNTIME;
            }
            fprintf(stderr, "strata generate: out of memory reading the prompt from stdin\n");
            return EXIT_RUNTIME;
        }
        o.prompt = stdin_prompt;
        const char *why = !prompt_len                           ? "is empty"
                          : memchr(o.prompt, 0, prompt_len)      ? "contains a NUL byte"
                                                                : NULL;
        if (why) {
            fprintf(stderr, "strata generate: the prompt read from stdin %s\n", why);
            free(stdin_prompt);
            return EXIT_USAGE;
        }
    }
    /* The server refuses such a prompt; the tokenizer would take its bytes as they come. */
    if (!proto_utf8_valid(o.prompt, prompt_len)) {
        fprintf(stderr, "strata generate: the prompt is not valid UTF-8\n");
        free(stdin_prompt);
        return EXIT_USAGE;
    }

    if (o.server) {
        remote_request rr = {.server = o.server, .token_file = o.token_file, .tls_ca = o.tls_ca, .prompt = o.prompt,
                             .max_tokens = o.max_tokens, .sampling = o.sampling, .stop = o.stop, .n_stop = o.n_stop,
                             .ignore_eos = o.ignore_eos, .kv = o.kv_given ? o.kv.kv : NULL, .echo = !o.no_echo,
                             .stats = o.stats, .quiet = o.quiet};
        rc = cli_remote_generate(&rr);
        cli_tier_opts_free(&o.tiers);
        free(stdin_prompt);
        return rc;
    }

    if ((rc = cli_check_model("generate", o.model_path)) != 0) {
        cli_tier_opts_free(&o.tiers);
        free(stdin_prompt);
        return rc;
    }
    double t0 = strata_mono_s();
    if (!o.quiet)
        fprintf(stderr, "strata: loading %s\n", o.model_path);
    /* For a GPU only the embedding is read on the host; the device builds the rest from the file. */
    model *m = o.cuda_device >= 0 ? model_load_for_device(o.model_path, 0, -1, &err) : model_load(o.model_path, 0, -1, &err);
    if (!m) {
        fprintf(stderr, "strata generate: %s\n", err.msg);   /* a missing file: cli_check_model said so */
        free(stdin_prompt);
        return EXIT_RUNTIME;
    }
    const model_config *cfg = model_get_config(m);
    const tokenizer *tok = model_get_tokenizer(m);
    if (!o.quiet)
        fprintf(stderr, "strata: %s, %d layers, %d heads (%d KV), %.0f MiB of weights%s, loaded in %.2f s\n",
                cfg->name[0] ? cfg->name : cfg->arch, cfg->n_layers, cfg->n_heads, cfg->n_kv_heads,
                (double)model_weight_bytes(m) / 1048576.0,
                model_is_for_device(m) ? " on the host (the embedding; the device builds the rest)" : "",
                strata_mono_s() - t0);

    int exit_code = EXIT_RUNTIME;
    kv_codec_params *codecs = NULL;
    cli_kv_memory mem = {0};
    kv_seq *seq = NULL;
    char *chat_text = NULL;
    int32_t *ids = NULL, *prompt = NULL;
    size_t n_ids = 0;
    generate_result result = {0};
    char *plan_name = NULL;

    kv_geometry geo = model_kv_geometry(m, o.kv.block_tokens);
    codecs = malloc((size_t)geo.n_layers * sizeof *codecs);
    if (!codecs) {
        fprintf(stderr, "strata generate: out of memory\n");
        goto done;
    }
    if (cli_kv_resolve("generate", o.kv.kv, &o.kv, &geo, codecs) != 0) {
        exit_code = EXIT_USAGE;
        goto done;
    }
    plan_name = kv_plan_name(codecs, geo.n_layers);
    if (!plan_name) {
        fprintf(stderr, "strata generate: out of memory\n");
        goto done;
    }
    const char *text = o.prompt;
    if (o.chat) {
        if (tokenizer_apply_chat(tok, o.system, o.prompt, &chat_text, &err) != STRATA_OK) {
            fprintf(stderr, "strata generate: --chat: %s\n", err.msg);
            goto done;
        }
        text = chat_text;
    }
    if (tokenizer_encode(tok, text, strlen(text), o.chat, &ids, &n_ids, &err) != STRATA_OK) {
        fprintf(stderr, "strata generate: tokenizing the prompt: %s\n", err.msg);
        goto done;
    }
    const bool bos = tokenizer_add_bos(tok);
    size_t n_prompt = n_ids + (bos ? 1 : 0);
    prompt = malloc((n_prompt ? n_prompt : 1) * sizeof *prompt);
    if (!prompt) {
        fprintf(stderr, "strata generate: out of memory\n");
        goto done;
    }
    if (bos)
        prompt[0] = tokenizer_bos(tok);
    if (n_ids)
        memcpy(prompt + (bos ? 1 : 0), ids, n_ids * sizeof *ids);
    if (n_prompt == 0) {
        fprintf(stderr, "strata generate: the prompt is empty\n");
        exit_code = EXIT_USAGE;
        goto done;
    }

    size_t ctx = o.ctx ? (size_t)o.ctx : (size_t)(cfg->n_ctx_train < 8192 ? cfg->n_ctx_train : 8192);
    if (ctx > (size_t)cfg->n_ctx_train)   /* allowed here (strata serve refuses it), but said */
        fprintf(stderr, "strata generate: warning: --ctx %zu is beyond the model's trained context of %d: positions "
                        "past it were never trained, text there is unreliable\n", ctx, cfg->n_ctx_train);
    if (n_prompt >= ctx) {
        fprintf(stderr, "strata generate: the prompt has %zu tokens but the context holds %zu (raise --ctx)\n",
                n_prompt, ctx);
        exit_code = EXIT_USAGE;
        goto done;
    }
    if (o.cuda_device >= 0) {
        strata_error perr = {0};
        if (kv_plan_check_one_window(codecs, geo.n_layers, &perr) != STRATA_OK) {
            fprintf(stderr, "strata generate: --device cuda with the plan %s: %s\n", plan_name, perr.msg);
            exit_code = EXIT_USAGE;
            goto done;
        }
        generate_params gpc = {.sampling = o.sampling, .max_tokens = o.max_tokens, .stop = o.stop,
                               .n_stop = o.n_stop, .ignore_eos = o.ignore_eos};
        exit_code = cli_generate_cuda(m, o.cuda_device, codecs, o.kv.block_tokens, ctx, &o.tiers, prompt, n_prompt, &gpc,
                                      !o.chat && !o.no_echo ? o.prompt : NULL, print_text, o.stats, o.quiet);
        goto done;
    }
    if ((rc = cli_kv_memory_create("generate", &o.tiers, &geo, codecs, ctx, o.quiet, &mem)) != 0) {
        exit_code = rc;
        goto done;
    }
    if (!(seq = kv_seq_create(mem.pool, ctx, &err))) {
        fprintf(stderr, "strata generate: %s\n", err.msg);
        goto done;
    }
    if (!o.quiet)
        fprintf(stderr, "strata: prompt %zu tokens, context %zu, KV %s in %zu blocks (%.1f MiB pool)\n", n_prompt,
                ctx, plan_name, kv_pool_capacity(mem.pool), (double)kv_pool_bytes(mem.pool) / 1048576.0);

    generate_params gp = {.sampling = o.sampling, .max_tokens = o.max_tokens, .stop = o.stop,
                          .n_stop = o.n_stop, .ignore_eos = o.ignore_eos};
    if (!o.chat && !o.no_echo)
        print_text(NULL, o.prompt, strlen(o.prompt));
    prefill_progress pp = {.tty = isatty(fileno(stderr)), .t0 = cli_now_seconds()};
    if (!o.quiet)
        model_set_progress(m, show_prefill_progress, &pp, 512);
    rc = generate_run(m, seq, ctx, prompt, n_prompt, &gp, print_text, NULL, &result, &err);
    model_set_progress(m, NULL, NULL, 0);
    printf("\n");
    fflush(stdout);
    if (rc != STRATA_OK) {
        fprintf(stderr, "strata generate: %s\n", err.msg);
        fprintf(stderr, "strata generate: stopped with %zu tokens in the KV cache (prompt %zu, generated %zu)\n",
                kv_seq_length(seq, 0), result.prompt_tokens, result.completion_tokens);
        cli_tier_room_hint("generate", err.code, mem.tiers != NULL);
        goto done;
    }
    if (o.stats)
        print_stats(m, seq, &mem, &result);
    if (o.save_kv) {
        if (kv_blockfile_save(seq, o.save_kv, &err) != STRATA_OK) {
            fprintf(stderr, "strata generate: --save-kv: %s\n", err.msg);
            goto done;
        }
        if (!o.quiet)
            fprintf(stderr, "strata: KV blocks written to %s\n", o.save_kv);
    }
    exit_code = 0;
done:
    free(plan_name);
    generate_result_free(&result);
    free(prompt);
    free(ids);
    free(chat_text);
    kv_seq_destroy(seq);
    cli_kv_memory_free(&mem);
    cli_tier_opts_free(&o.tiers);
    free(codecs);
    model_free(m);
    free(stdin_prompt);
    return exit_code;
}
