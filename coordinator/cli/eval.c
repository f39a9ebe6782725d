/* strata eval: quality of compressed KV caches against the fp16 cache (worker/evaluate.h). */
#include <getopt.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "coordinator/cli/cli.h"
#include "coordinator/cli/kvopts.h"
#include "coordinator/cli/tiers.h"
#include "proto/validate.h"
#include "kernels/ops.h"
#include "kvstore/plan.h"
#include "worker/evaluate.h"
#include "worker/model.h"

#define MAX_SPECS 32

static void usage(FILE *out)
{
    fprintf(out,
            "usage: strata eval --text FILE [options]\n"
            "\n"
            "Measures what KV cache compression costs in quality. The first --prefill tokens of FILE\n"
            "are prefilled with exact attention; the next --tokens tokens are fed one at a time\n"
            "through the decode path, attending over the compressed cache (teacher forcing), and\n"
            "each step's next-token distribution is compared with the fp16 cache's on the same\n"
            "tokens. For each KV setting it reports perplexity and its change vs fp16, mean\n"
            "KL(fp16 || setting), top-1 agreement with fp16, the bytes stored per token in blocks\n"
            "(headers and correction sections included, summed over layers) and their ratio to\n"
            "fp16, and each layer's relative K and V compression error ||X - X'||_F / ||X||_F.\n"
            "\n"
            "  -m, --model PATH        GGUF model (default: $STRATA_MODEL or\n"
            "                          %s),\n"
            "                          or synthetic:NAME[:seed=N] (random weights of a known shape:\n"
            "                          tiny, smollm2-135m, llama3.2-1b, llama2-7b, llama3-8b, llama3-70b)\n"
            "      --text FILE         the evaluation text (UTF-8; required)\n"
            "      --kv LIST           comma-separated KV settings to evaluate, fp16 always included\n"
            "                          (default fp16,kivi2,kivi4,gear2,gearl2,ott2,tada); each is a\n"
            "                          codec name, a range list (0-9:tada4,10-29:tada2) or a plan file;\n"
            "                          a range item at a layer not above the one before starts the\n"
            "                          next setting (0-9:tada4,10-29:tada2,0-29:kivi2 is two); two\n"
            "                          that give the same plan are refused\n"
            "      --kv-plan FILE      the plan that the setting 'tada' stands for (default: 4 bits in\n"
            "                          the lower half of the layers, 2 bits above)\n"
            "      --kv-group G        quantization group for every quantized setting (default: each\n"
            "                          codec's own)\n"
            "      --kv-residual R     fp16 residual window for every quantized setting (default 128)\n"
            "      --block-tokens N    tokens per KV block (default 64)\n"
            "      --prefill N         tokens prefilled exactly (default 1024)\n"
            "      --tokens T          decode steps scored (default 512)\n"
            "      --json              print one JSON object on stdout instead of the tables\n"
            "  -q, --quiet             no progress on stderr\n"
            "      --threads N         compute threads: matmul kernel and BLAS (default: the number\n"
            "                          OpenBLAS picks; keep it equal between runs you compare)\n"
            "  -h, --help              show this help\n",
            STRATA_DEFAULT_MODEL);
    cli_tier_usage(out);
    fprintf(out,
            "The tiers hold the KV cache of each setting's run (the device budget is divided by the\n"
            "setting's largest block size for its slot count); the exact prefill shared by the runs\n"
            "is computed without them. Results do not depend on the tiers (blocks move as their\n"
            "exact bytes); with tier flags each run's device evictions and fetches and NVMe spills\n"
            "and restores go to stderr (and to the JSON).\n"
            "\n"
            "JSON: {\"model\", \"text\", \"prefill\", \"tokens\", \"block_tokens\", \"results\": [{\"kv\", \"plan\",\n"
            "\"ppl\", \"ppl_delta_pct\", \"kl\", \"top1\", \"bytes_per_token\", \"total_bytes_per_token\",\n"
            "\"ratio_vs_fp16\", \"k_err\": [per layer], \"v_err\": [per layer], \"seconds\"}, ...]}; ratio_vs_fp16\n"
            "is bytes_per_token / fp16's, total_bytes_per_token includes the fp16 tail at the end.\n"
            "With tier flags each result also has \"device_slots\", \"tier_evictions\", \"tier_fetches\",\n"
            "\"nvme_spills\" and \"nvme_restores\".\n");
}

typedef struct eval_opts {
    const char *model_path;
    const char *text_path;
    char *specs[MAX_SPECS];
    size_t n_specs;
    cli_kv_opts kv;
    long prefill, tokens;
    bool json, quiet;
    int threads;
    cli_tier_opts tiers;
} eval_opts;

enum { OPT_TEXT = 1000, OPT_KV, OPT_KV_PLAN, OPT_PREFILL,
       OPT_TOKENS, OPT_JSON, OPT_THREADS };

/* The layers a range item "A-B:codec" or "A:codec" starts and ends at (-1 when not numbers). */
static void item_layers(const char *p, long *first, long *last)
{
    char *end;
    *first = *last = -1;
    long a = strtol(p, &end, 10);
    if (end == p || a < 0)
        return;
    *first = *last = a;
    if (*end == '-') {
        const char *q = end + 1;
        long b = strtol(q, &end, 10);
        if (end != q && b >= 0)
            *last = b;
    }
}

/* Splits a --kv list at commas, keeping a range list ("0-9:tada4,10-29:tada2") in one piece:
 * an item with a ':' continues the previous item if that one also had a ':' and ended at a lower
 * layer; one that starts at or below that layer starts another setting. */
static int split_specs(const char *list, eval_opts *o)
{
    const char *p = list;
    bool prev_range = false;
    long prev_last = -1;
    if (!*list) {
        fprintf(stderr, "strata eval: --kv: an empty list\n");
        return EXIT_USAGE;
    }
    while (*p) {
        size_t n = strcspn(p, ",");
        bool range = memchr(p, ':', n) != NULL;
        if (n == 0) {
            fprintf(stderr, "strata eval: --kv: empty item in \"%s\"\n", list);
            return EXIT_USAGE;
        }
        long first, last;
        item_layers(p, &first, &last);
        if (range && prev_range && first > prev_last) {
            char *joined = malloc(strlen(o->specs[o->n_specs - 1]) + n + 2);
            if (!joined)
                return EXIT_RUNTIME;
            sprintf(joined, "%s,%.*s", o->specs[o->n_specs - 1], (int)n, p);
            free(o->specs[o->n_specs - 1]);
            o->specs[o->n_specs - 1] = joined;
        } else {
            if (o->n_specs == MAX_SPECS) {
                fprintf(stderr, "strata eval: --kv: at most %d settings\n", MAX_SPECS);
                return EXIT_USAGE;
            }
            o->specs[o->n_specs] = strndup(p, n);
            if (!o->specs[o->n_specs])
                return EXIT_RUNTIME;
            o->n_specs++;
        }
        prev_range = range;
        prev_last = last;
        p += n + (p[n] ? 1 : 0);
    }
    return 0;
}

static void free_specs(eval_opts *o)
{
    for (size_t i = 0; i < o->n_specs; i++)
        free(o->specs[i]);
    o->n_specs = 0;
}

static int parse_opts(int argc, char **argv, eval_opts *o)
{
    static const struct option opts[] = {
        {"model", required_argument, NULL, 'm'},
        {"text", required_argument, NULL, OPT_TEXT},
        {"kv", required_argument, NULL, OPT_KV},
        {"kv-plan", required_argument, NULL, OPT_KV_PLAN},
        CLI_KV_SHAPE_OPTIONS,
        {"prefill", required_argument, NULL, OPT_PREFILL},
        {"tokens", required_argument, NULL, OPT_TOKENS},
        {"json", no_argument, NULL, OPT_JSON},
        {"quiet", no_argument, NULL, 'q'},
        {"threads", required_argument, NULL, OPT_THREADS},
        {"help", no_argument, NULL, 'h'},
        CLI_TIER_OPTIONS,
        {NULL, 0, NULL, 0},
    };
    *o = (eval_opts){.model_path = cli_default_model(), .prefill = 1024, .tokens = 512,
                     .kv = {.group = -1, .residual = -1, .block_tokens = 64}};
    cli_tier_opts_init(&o->tiers);
    const char *list = "fp16,kivi2,kivi4,gear2,gearl2,ott2,tada";
    long v;
    int c, rc;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:qh", opts, NULL)) != -1) {
        switch (c) {
        case 'm': o->model_path = optarg; break;
        case OPT_TEXT: o->text_path = optarg; break;
        case OPT_KV: list = optarg; break;
        case OPT_KV_PLAN: o->kv.plan_file = optarg; break;
        case OPT_KV_GROUP: case OPT_KV_RESIDUAL: case OPT_BLOCK_TOKENS:
            if (!cli_kv_shape_flag(c, optarg, &o->kv)) return EXIT_USAGE;
            break;
        case OPT_PREFILL:
            if (!cli_parse_long("--prefill", optarg, 1, 1 << 20, &o->prefill)) return EXIT_USAGE;
            break;
        case OPT_TOKENS:
            if (!cli_parse_long("--tokens", optarg, 1, 1 << 20, &o->tokens)) return EXIT_USAGE;
            break;
        case OPT_JSON: o->json = true; break;
        case 'q': o->quiet = true; break;
        case OPT_THREADS:
            if (!cli_parse_long("--threads", optarg, 1, 1024, &v)) return EXIT_USAGE;
            o->threads = (int)v;
            break;
        case OPT_TIER_DEVICE: case OPT_TIER_HOST: case OPT_TIER_NVME_DIR: case OPT_TIER_NVME: case OPT_TIER_CONFIG:
            if (cli_tier_flag(c, optarg, &o->tiers)) return EXIT_USAGE;
            break;
        case 'h': usage(stdout); return -1;
        default: usage(stderr); return EXIT_USAGE;
        }
    }
    if (optind != argc) {
        fprintf(stderr, "strata eval: unexpected argument '%s'\n", argv[optind]);
        return EXIT_USAGE;
    }
    if (!o->text_path) {
        fprintf(stderr, "strata eval: --text FILE is required (try --help)\n");
        return EXIT_USAGE;
    }
    if ((rc = split_specs(list, o)) != 0)
        return rc;
    bool has_tada = false;
    for (size_t i = 0; i < o->n_specs; i++)
        has_tada |= !strcmp(o->specs[i], "tada");
    if (o->kv.plan_file && !has_tada) {
        fprintf(stderr, "strata eval: --kv-plan %s is the plan of the setting 'tada', which --kv does not list "
                "(add tada to --kv, or give the file itself in --kv)\n", o->kv.plan_file);
        return EXIT_USAGE;
    }
    return cli_tier_finish("eval", &o->tiers);
}

typedef struct progress_state {
    const char *label;
    bool tty, quiet;
    size_t last_pct;
    double t0;
} progress_state;

static int on_progress(void *user, size_t step, size_t steps)
{
    progress_state *ps = user;
    if (ps->quiet)
        return 0;
    size_t pct = steps ? step * 100 / steps : 100;
    double el = cli_now_seconds() - ps->t0;
    if (ps->tty) {
        int width = 30, filled = (int)(pct * (size_t)width / 100);
        fprintf(stderr, "\r  %-28.28s [%.*s%*s] %3zu%% %zu/%zu steps, %.0f s", ps->label, filled,
                "==============================", width - filled, "", pct, step, steps, el);
        if (step == steps)
            fputc('\n', stderr);
    } else if (step == 0 || pct >= ps->last_pct + 25 || step == steps) {
        fprintf(stderr, "  %s: %zu/%zu steps (%zu%%), %.0f s\n", ps->label, step, steps, pct, el);
        ps->last_pct = pct;
    }
    return 0;
}

typedef struct run {
    const char *label;   /* the --kv setting as given (not owned) */
    char *plan;          /* its canonical range list (kv_plan_name) */
    size_t device_slots;            /* 0: no tier flags (a pool with room for the context) */
    uint64_t spills, restores;      /* NVMe tier, during this run */
    eval_result r;
} run;

/* The device slots of one run: under --device-kv-mib the budget over the plan's largest block,
 * at most what the context can use (that with only a lower tier); 0 without tier flags. Returns
 * EXIT_USAGE after a message when the budget holds no block. */
static int device_slots_for(const cli_tier_opts *t, const kv_geometry *g, const kv_codec_params *codecs, size_t ctx,
                            const char *label, size_t *slots)
{
    *slots = cli_tier_device_slots(t, g, codecs, ctx);
    if (t->device_mib > 0 && *slots == 0) {
        fprintf(stderr, "strata eval: %s: --device-kv-mib %g holds no block of %zu bytes\n", label, t->device_mib,
                kv_plan_largest_block(g, codecs));
        return EXIT_USAGE;
    }
    return 0;
}

static double mean_of(const eval_layer_error *e, int n, bool k)
{
    double s = 0;
    for (int i = 0; i < n; i++)
        s += k ? e[i].k_rel : e[i].v_rel;
    return n ? s / n : 0;
}

static void print_tables(const run *runs, size_t n, const char *model_name, const eval_opts *o, int n_layers)
{
    const eval_result *base = &runs[0].r;
    printf("model %s, text %s: prefill %ld tokens, %ld decode steps scored, blocks of %d tokens\n\n", model_name,
           o->text_path, o->prefill, o->tokens, o->kv.block_tokens);
    printf("%-14s %9s %8s %9s %7s %10s %7s %8s %8s\n", "kv", "ppl", "dppl%", "KL", "top1", "B/token", "ratio",
           "K err", "V err");
    for (size_t i = 0; i < n; i++) {
        const eval_result *r = &runs[i].r;
        printf("%-14.14s %9.4f %+8.3f %9.6f %6.1f%% %10.1f %7.3f %8.4f %8.4f\n", runs[i].label, r->ppl,
               (r->ppl / base->ppl - 1.0) * 100.0, r->kl, r->top1 * 100.0, r->bytes_per_token,
               base->bytes_per_token > 0 ? r->bytes_per_token / base->bytes_per_token : 0.0,
               mean_of(r->layers, r->n_layers, true), mean_of(r->layers, r->n_layers, false));
    }
    for (size_t i = 0; i < n; i++)
        if (runs[i].r.block_tokens == 0)
            printf("note: %s formed no block (every token stayed in its fp16 window): its B/token, ratio and "
                   "K/V err say nothing about the codec; use a longer --prefill\n", runs[i].label);
    printf("\nB/token: bytes of all blocks per token summed over layers; ratio: vs fp16; K/V err: mean over\n"
           "layers of ||X - X'||_F / ||X||_F of the blocks. Plans:\n");
    for (size_t i = 0; i < n; i++)
        printf("  %-14s %s\n", runs[i].label, runs[i].plan);
    printf("\nper-layer relative error, K / V:\n%5s", "layer");
    for (size_t i = 1; i < n; i++)
        printf(" %15.15s", runs[i].label);
    printf("\n");
    for (int l = 0; l < n_layers; l++) {
        printf("%5d", l);
        for (size_t i = 1; i < n; i++)
            printf("  %6.4f/%6.4f", runs[i].r.layers[l].k_rel, runs[i].r.layers[l].v_rel);
        printf("\n");
    }
}

/* jansson refuses NaN, infinities and invalid UTF-8 by returning NULL, which json_object_set_new
 * takes as "drop the key": a number that is not finite is written as null, a string's invalid
 * bytes as U+FFFD, so every key is always there. */
static json_t *json_num(double v) { return isfinite(v) ? json_real(v) : json_null(); }

static json_t *json_text(const char *s)
{
    json_t *j = json_string(s);
    if (j)
        return j;
    size_t n = strlen(s), o = 0;
    char *c = malloc(n * 3 + 1);
    if (!c)
        return json_null();
    for (size_t i = 0; i < n;) {
        size_t ok = proto_utf8_check(s + i, n - i);
        memcpy(c + o, s + i, ok);
        o += ok;
        i += ok;
        if (i < n) {
            memcpy(c + o, "\xef\xbf\xbd", 3);
            o += 3;
            i++;
        }
    }
    c[o] = '\0';
    j = json_string(c);
    free(c);
    return j ? j : json_null();
}

static int print_json(const run *runs, size_t n, const char *model_name, const eval_opts *o)
{
    const eval_result *base = &runs[0].r;
    json_t *root = json_object(), *results = json_array();
    if (!root || !results)
        return -1;
    json_object_set_new(root, "model", json_text(model_name));
    json_object_set_new(root, "text", json_text(o->text_path));
    json_object_set_new(root, "prefill", json_integer(o->prefill));
    json_object_set_new(root, "tokens", json_integer(o->tokens));
    json_object_set_new(root, "block_tokens", json_integer(o->kv.block_tokens));
    for (size_t i = 0; i < n; i++) {
        const eval_result *r = &runs[i].r;
        json_t *e = json_object(), *ke = json_array(), *ve = json_array();
        for (int l = 0; l < r->n_layers; l++) {
            json_array_append_new(ke, json_num(r->layers[l].k_rel));
            json_array_append_new(ve, json_num(r->layers[l].v_rel));
        }
        json_object_set_new(e, "kv", json_string(runs[i].label));
        json_object_set_new(e, "plan", json_string(runs[i].plan));
        json_object_set_new(e, "ppl", json_num(r->ppl));
        json_object_set_new(e, "ppl_delta_pct", json_num((r->ppl / base->ppl - 1.0) * 100.0));
        json_object_set_new(e, "kl", json_num(r->kl));
        json_object_set_new(e, "top1", json_num(r->top1));
        json_object_set_new(e, "bytes_per_token", json_num(r->bytes_per_token));
        json_object_set_new(e, "total_bytes_per_token", json_num(r->total_bytes_per_token));
        json_object_set_new(e, "ratio_vs_fp16",
                            json_num(base->bytes_per_token > 0 ? r->bytes_per_token / base->bytes_per_token : 0.0));
        json_object_set_new(e, "k_err", ke);
        json_object_set_new(e, "v_err", ve);
        if (o->tiers.device_mib > 0 || o->tiers.host_mib > 0) {
            json_object_set_new(e, "device_slots", json_integer((json_int_t)runs[i].device_slots));
            json_object_set_new(e, "tier_evictions", json_integer((json_int_t)r->evictions));
            json_object_set_new(e, "tier_fetches", json_integer((json_int_t)r->fetches));
            json_object_set_new(e, "nvme_spills", json_integer((json_int_t)runs[i].spills));
            json_object_set_new(e, "nvme_restores", json_integer((json_int_t)runs[i].restores));
        }
        json_object_set_new(e, "seconds", json_num(r->seconds));
        json_array_append_new(results, e);
    }
    json_object_set_new(root, "results", results);
    int rc = json_dumpf(root, stdout, JSON_INDENT(1) | JSON_REAL_PRECISION(8));
    printf("\n");
    json_decref(root);
    return rc;
}

int cmd_eval(int argc, char **argv)
{
    eval_opts o;
    int rc = parse_opts(argc, argv, &o);
    if (rc != 0) {
        free_specs(&o);
        cli_tier_opts_free(&o.tiers);
        return rc < 0 ? 0 : rc;
    }
    if (o.threads)
        kern_set_threads(o.threads);
    int exit_code = EXIT_RUNTIME;
    strata_error err = {0};
    char *text = NULL;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    run *runs = NULL;
    size_t n_runs = 0;
    kv_codec_params *codecs = NULL;
    eval_reference ref = {0};
    eval_prefix prefix = {0};
    model *m = NULL;
    kv_tiers *tiers = NULL;
    kv_lower_tier lower;

    size_t text_len = 0;
    if ((exit_code = cli_check_model("eval", o.model_path)) != 0 ||
        (exit_code = cli_read_text("eval", o.text_path, &text, &text_len)) != 0)
        goto done;
    exit_code = EXIT_RUNTIME;
    if (!o.quiet)
        fprintf(stderr, "strata: loading %s\n", o.model_path);
    m = model_load(o.model_path, 0, -1, &err);
    if (!m) {
        fprintf(stderr, "strata eval: %s\n", err.msg);
        goto done;
    }
    const model_config *cfg = model_get_config(m);
    const tokenizer *tok = model_get_tokenizer(m);
    const char *model_name = cfg->name[0] ? cfg->name : cfg->arch;
    if (cli_tokenize_document(tok, text, text_len, &ids, &n_ids, &err) != STRATA_OK) {
        fprintf(stderr, "strata eval: tokenizing %s: %s\n", o.text_path, err.msg);
        goto done;
    }
    const size_t need = (size_t)o.prefill + (size_t)o.tokens + 1;
    if (n_ids < need) {
        fprintf(stderr, "strata eval: %s has %zu tokens; --prefill %ld --tokens %ld needs %zu\n", o.text_path, n_ids,
                o.prefill, o.tokens, need);
        exit_code = EXIT_USAGE;
        goto done;
    }
    if (need - 1 > (size_t)cfg->n_ctx_train) {
        fprintf(stderr, "strata eval: --prefill + --tokens = %zu exceeds the model's context of %d\n", need - 1,
                cfg->n_ctx_train);
        exit_code = EXIT_USAGE;
        goto done;
    }

    /* Resolve every setting before running anything: a typo should not cost minutes. */
    kv_geometry geo = model_kv_geometry(m, o.kv.block_tokens);
    size_t L = (size_t)geo.n_layers;
    runs = calloc(o.n_specs + 1, sizeof *runs);
    codecs = malloc((o.n_specs + 1) * L * sizeof *codecs);
    if (!runs || !codecs) {
        fprintf(stderr, "strata eval: out of memory\n");
        goto done;
    }
    runs[0].label = "fp16";
    n_runs = 1;
    cli_kv_opts fp16 = {.kv = "fp16", .group = -1, .residual = -1, .block_tokens = o.kv.block_tokens};
    if (cli_kv_resolve("eval", "fp16", &fp16, &geo, codecs) != 0)
        goto done;
    for (size_t i = 0; i < o.n_specs; i++) {
        if (!strcmp(o.specs[i], "fp16"))
            continue;
        cli_kv_opts k = o.kv;
        k.plan_file = (!strcmp(o.specs[i], "tada") && o.kv.plan_file) ? o.kv.plan_file : NULL;
        if (cli_kv_resolve("eval", o.specs[i], &k, &geo, codecs + n_runs * L) != 0) {
            exit_code = EXIT_USAGE;
            goto done;
        }
        runs[n_runs].label = o.specs[i];
        n_runs++;
    }
    for (size_t i = 0; i < n_runs; i++) {
        if (!(runs[i].plan = kv_plan_name(codecs + i * L, (int)L))) {
            fprintf(stderr, "strata eval: out of memory\n");
            goto done;
        }
        for (size_t j = 0; j < i; j++)   /* a repeat would cost a whole run to print the same row */
            if (!strcmp(runs[j].plan, runs[i].plan)) {
                fprintf(stderr, "strata eval: --kv: '%s' is the same setting as '%s' (%s%s); list it once\n",
                        runs[i].label, runs[j].label, runs[i].plan, j == 0 ? ", which is always run" : "");
                exit_code = EXIT_USAGE;
                goto done;
            }
        if (device_slots_for(&o.tiers, &geo, codecs + i * L, need - 1, runs[i].label, &runs[i].device_slots) != 0) {
            exit_code = EXIT_USAGE;
            goto done;
        }
    }
    if (cli_tier_create(&o.tiers, &tiers, &err) != STRATA_OK) {
        fprintf(stderr, "strata eval: %s\n", err.msg);
        goto done;
    }
    if (tiers) {
        lower = kv_tiers_lower(tiers);
        if (!o.quiet)
            fprintf(stderr, "strata: KV tiers: %s; device pool %s\n", kv_tiers_describe(tiers),
                    o.tiers.device_mib > 0 ? "per --device-kv-mib" : "with room for the whole context");
    }
    if (!o.quiet)
        fprintf(stderr, "strata: %s, %zu tokens of text; prefill %ld, %ld decode steps, %zu settings\n", model_name,
                n_ids, o.prefill, o.tokens, n_runs);

    eval_setup setup = {.prefill = (size_t)o.prefill, .tokens = (size_t)o.tokens, .block_tokens = o.kv.block_tokens,
                        .lower = tiers ? &lower : NULL};
    const bool tty = isatty(fileno(stderr));
    double t_prefill = cli_now_seconds();
    if (!o.quiet)
        fprintf(stderr, "  prefill: %ld tokens with exact attention (computed once, shared by every setting)\n",
                o.prefill);
    if (eval_prefix_build(m, ids, (size_t)o.prefill, o.kv.block_tokens, &prefix, &err) != STRATA_OK) {
        fprintf(stderr, "strata eval: prefill: %s\n", err.msg);
        goto done;
    }
    if (!o.quiet)
        fprintf(stderr, "  prefill done in %.1f s\n", cli_now_seconds() - t_prefill);
    for (size_t i = 0; i < n_runs; i++) {
        progress_state ps = {.label = runs[i].label, .tty = tty, .quiet = o.quiet, .t0 = cli_now_seconds()};
        kv_tiers_stats before = {0}, after = {0};
        if (tiers)
            kv_tiers_get_stats(tiers, &before);
        setup.device_slots = runs[i].device_slots;
        rc = eval_run(m, codecs + i * L, ids, n_ids, &setup, &prefix, i ? &ref : NULL, i ? NULL : &ref, on_progress,
                      &ps, &runs[i].r, &err);
        if (rc != STRATA_OK) {
            fprintf(stderr, "\nstrata eval: %s: %s\n", runs[i].label, err.msg);
            cli_tier_room_hint("eval", err.code, tiers != NULL);
            n_runs = i;
            goto done;
        }
        if (tiers) {
            kv_tiers_get_stats(tiers, &after);
            runs[i].spills = after.spills - before.spills;
            runs[i].restores = after.restores - before.restores;
        }
        if (!o.quiet && runs[i].device_slots)
            fprintf(stderr, "  %s: device pool of %zu slots: %" PRIu64 " evictions, %" PRIu64 " fetches; NVMe: %" PRIu64
                            " spills, %" PRIu64 " restores\n", runs[i].label, runs[i].device_slots,
                    runs[i].r.evictions, runs[i].r.fetches, runs[i].spills, runs[i].restores);
    }
    if (o.json) {
        if (print_json(runs, n_runs, model_name, &o) != 0) {
            fprintf(stderr, "strata eval: writing JSON failed\n");
            goto done;
        }
    } else {
        print_tables(runs, n_runs, model_name, &o, (int)L);
    }
    fflush(stdout);
    exit_code = ferror(stdout) ? EXIT_RUNTIME : 0;
done:
    for (size_t i = 0; runs && i < n_runs; i++)
        eval_result_free(&runs[i].r);
    for (size_t i = 0; runs && i < o.n_specs + 1; i++)   /* n_runs may have been cut short */
        free(runs[i].plan);
    free(runs);
    free(codecs);
    eval_reference_free(&ref);
    eval_prefix_free(&prefix);
    cli_tier_destroy(tiers);   /* after the runs: each destroyed its pool and sequence */
    free(ids);
    free(text);
    model_free(m);
    free_specs(&o);
    cli_tier_opts_free(&o.tiers);
    return exit_code;
}
