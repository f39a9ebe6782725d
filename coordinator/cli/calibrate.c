/* strata calibrate: search a per-layer bit plan for a bytes-per-token budget.
 *
 * The search measures each layer's sensitivity: with every other layer at the most precise
 * candidate, layer l is set to each cheaper candidate in turn and the mean KL divergence of the
 * next-token distributions against the fp16 cache is measured (the same teacher-forced decode as
 * strata eval). Assuming the layers' damages add up, the plan minimizing the summed KL increase
 * under the budget is an exact multiple-choice knapsack over the block sizes, solved by dynamic
 * programming. The chosen plan is then run once more and its measured KL reported and written
 * into the plan file's comment. */
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "coordinator/cli/cli.h"
#include "coordinator/cli/kvopts.h"
#include "coordinator/cli/tiers.h"
#include "kernels/ops.h"
#include "kvstore/plan.h"
#include "worker/evaluate.h"
#include "worker/model.h"

#define MAX_CANDIDATES 8

static void usage(FILE *out)
{
    fprintf(out,
            "usage: strata calibrate --text FILE --budget BYTES --out PLAN [options]\n"
            "\n"
            "Searches which codec each layer should use so that the KV cache stores at most BYTES per\n"
            "token (block bytes, headers included, summed over layers; what strata eval reports as\n"
            "B/token) while staying as close as possible to the fp16 cache, scored by the mean KL\n"
            "divergence of the next-token distributions on FILE (teacher-forced decode, as in\n"
            "strata eval). Writes the plan to PLAN; use it with --kv-plan PLAN or --kv PLAN.\n"
            "Cost: one decode run of --tokens steps per layer and cheaper candidate, plus three.\n"
            "\n"
            "  -m, --model PATH        GGUF model (default: $STRATA_MODEL or\n"
            "                          %s),\n"
            "                          or synthetic:NAME[:seed=N] (random weights of a known shape:\n"
            "                          tiny, smollm2-135m, llama3.2-1b, llama2-7b, llama3-8b, llama3-70b)\n"
            "      --text FILE         calibration text (UTF-8; required)\n"
            "      --budget BYTES      bytes per token, summed over layers (required); strata eval\n"
            "                          prints each codec's B/token for reference\n"
            "      --out PLAN          the plan file to write (required)\n"
            "      --candidates LIST   codecs a layer may use, each once (default tada2,tada4,tada8)\n"
            "      --kv-group G        quantization group for every candidate (default: each codec's)\n"
            "      --kv-residual R     fp16 residual window for every candidate (default 128)\n"
            "      --block-tokens N    tokens per KV block (default 64)\n"
            "      --prefill N         tokens prefilled exactly (default 512); at least every\n"
            "                          candidate's window R plus one block, so each scored step sees one\n"
            "      --tokens T          decode steps scored per run (default 32)\n"
            "  -q, --quiet             no progress on stderr\n"
            "      --threads N         compute threads: matmul kernel and BLAS (default: the number\n"
            "                          OpenBLAS picks; keep it equal between runs you compare)\n"
            "  -h, --help              show this help\n",
            STRATA_DEFAULT_MODEL);
    cli_tier_usage(out);
    fprintf(out,
            "The tiers hold the KV cache of every run (the device budget is divided by the run's\n"
            "largest block size for its slot count); the exact prefill shared by the runs is\n"
            "computed without them. The plan found does not depend on the tiers.\n");
}

typedef struct cal_opts {
    const char *model_path, *text_path, *out_path, *candidates;
    double budget;
    cli_kv_opts kv;
    long prefill, tokens;
    bool quiet;
    int threads;
    cli_tier_opts tiers;
} cal_opts;

enum { OPT_TEXT = 1000, OPT_BUDGET, OPT_OUT, OPT_CANDIDATES,
       OPT_PREFILL, OPT_TOKENS, OPT_THREADS };

static int parse_opts(int argc, char **argv, cal_opts *o)
{
    static const struct option opts[] = {
        {"model", required_argument, NULL, 'm'},
        {"text", required_argument, NULL, OPT_TEXT},
        {"budget", required_argument, NULL, OPT_BUDGET},
        {"out", required_argument, NULL, OPT_OUT},
        {"candidates", required_argument, NULL, OPT_CANDIDATES},
        CLI_KV_SHAPE_OPTIONS,
        {"prefill", required_argument, NULL, OPT_PREFILL},
        {"tokens", required_argument, NULL, OPT_TOKENS},
        {"quiet", no_argument, NULL, 'q'},
        {"threads", required_argument, NULL, OPT_THREADS},
        {"help", no_argument, NULL, 'h'},
        CLI_TIER_OPTIONS,
        {NULL, 0, NULL, 0},
    };
    *o = (cal_opts){.model_path = cli_default_model(), .candidates = "tada2,tada4,tada8", .budget = -1,
                    .prefill = 512, .tokens = 32, .kv = {.group = -1, .residual = -1, .block_tokens = 64}};
    cli_tier_opts_init(&o->tiers);
    long v;
    float f;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:qh", opts, NULL)) != -1) {
        switch (c) {
        case 'm': o->model_path = optarg; break;
        case OPT_TEXT: o->text_path = optarg; break;
        case OPT_OUT: o->out_path = optarg; break;
        case OPT_CANDIDATES: o->candidates = optarg; break;
        case OPT_BUDGET:
            if (!cli_parse_float("--budget", optarg, 1.0, 1e9, &f)) return EXIT_USAGE;
            o->budget = f;
            break;
        case OPT_KV_GROUP: case OPT_KV_RESIDUAL: case OPT_BLOCK_TOKENS:
            if (!cli_kv_shape_flag(c, optarg, &o->kv)) return EXIT_USAGE;
            break;
        case OPT_PREFILL:
            if (!cli_parse_long("--prefill", optarg, 1, 1 << 20, &o->prefill)) return EXIT_USAGE;
            break;
        case OPT_TOKENS:
            if (!cli_parse_long("--tokens", optarg, 1, 1 << 20, &o->tokens)) return EXIT_USAGE;
            break;
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
        fprintf(stderr, "strata calibrate: unexpected argument '%s'\n", argv[optind]);
        return EXIT_USAGE;
    }
    if (!o->text_path || !o->out_path || o->budget < 0) {
        fprintf(stderr, "strata calibrate: --text, --budget and --out are required (try --help)\n");
        return EXIT_USAGE;
    }
    if (!cli_check_writable("calibrate", "--out", o->out_path, false))
        return EXIT_USAGE;
    return cli_tier_finish("calibrate", &o->tiers);
}

typedef struct candidate {
    char name[64];
    kv_codec_params codec;
    size_t block_bytes;   /* slot size: an upper bound for codecs whose blocks vary */
} candidate;

/* Parses the candidate list, sorted by block size (cheapest first). */
static int parse_candidates(const cal_opts *o, const kv_geometry *g, candidate *out, int *n)
{
    *n = 0;
    const char *p = o->candidates;
    while (*p) {
        size_t len = strcspn(p, ",");
        if (len == 0 || len >= sizeof out[0].name) {
            fprintf(stderr, "strata calibrate: --candidates: bad item in \"%s\"\n", o->candidates);
            return EXIT_USAGE;
        }
        if (*n == MAX_CANDIDATES) {
            fprintf(stderr, "strata calibrate: --candidates: at most %d\n", MAX_CANDIDATES);
            return EXIT_USAGE;
        }
        candidate *c = &out[*n];
        memcpy(c->name, p, len);
        c->name[len] = 0;
        strata_error err = {0};
        if (kv_codec_parse(c->name, &c->codec, &err) != STRATA_OK) {
            fprintf(stderr, "strata calibrate: --candidates: %s\n", err.msg);
            return EXIT_USAGE;
        }
        if (c->codec.codec != KV_CODEC_FP16) {
            if (o->kv.group >= 0)
                c->codec.group = (int)o->kv.group;
            if (o->kv.residual >= 0)
                c->codec.residual = (int)o->kv.residual;
        }
        if (kv_codec_validate(&c->codec, g, &err) != STRATA_OK) {
            fprintf(stderr, "strata calibrate: --candidates %s: %s\n", c->name, err.msg);
            return EXIT_USAGE;
        }
        c->block_bytes = kv_block_size(&c->codec, g);
        char mine[64], theirs[64];
        kv_codec_name(&c->codec, mine, sizeof mine);
        for (int i = 0; i < *n; i++) {
            kv_codec_name(&out[i].codec, theirs, sizeof theirs);
            if (strcmp(mine, theirs) == 0) {
                fprintf(stderr, "strata calibrate: --candidates: %s is the same codec as %s\n", c->name, out[i].name);
                return EXIT_USAGE;
            }
        }
        (*n)++;
        p += len + (p[len] ? 1 : 0);
    }
    if (*n < 2) {
        fprintf(stderr, "strata calibrate: --candidates needs at least two codecs to choose from\n");
        return EXIT_USAGE;
    }
    for (int i = 1; i < *n; i++)
        for (int j = i; j > 0 && out[j].block_bytes < out[j - 1].block_bytes; j--) {
            candidate t = out[j];
            out[j] = out[j - 1];
            out[j - 1] = t;
        }
    return 0;
}

typedef struct progress_state {
    bool tty, quiet;
    size_t run, runs;
    double t0;
    char label[1100];
} progress_state;

static int on_progress(void *user, size_t step, size_t steps)
{
    progress_state *ps = user;
    if (ps->quiet || step != steps)
        return 0;
    double el = cli_now_seconds() - ps->t0, eta = el / (double)(ps->run + 1) * (double)(ps->runs - ps->run - 1);
    if (ps->tty)
        fprintf(stderr, "\r  run %zu/%zu %-28.28s %.0f s elapsed, about %.0f s left   ", ps->run + 1, ps->runs,
                ps->label, el, eta);
    else if ((ps->run + 1) % 10 == 0 || ps->run + 1 == ps->runs)   /* a log, not a bar */
        fprintf(stderr, "  run %zu/%zu (%s) done, %.0f s elapsed, about %.0f s left\n", ps->run + 1, ps->runs,
                ps->label, el, eta);
    return 0;
}

/* Tier counters summed over the runs. */
typedef struct tier_totals {
    uint64_t evictions, fetches;
} tier_totals;

/* eval_run of plan with the run's device slots; adds its tier counters to tot. */
static int run_plan(model *m, const kv_codec_params *plan, const int32_t *ids, size_t n_ids, eval_setup *setup,
                    const cli_tier_opts *t, const kv_geometry *g, const eval_prefix *prefix, const eval_reference *ref,
                    eval_reference *keep, progress_state *ps, eval_result *r, tier_totals *tot, strata_error *err)
{
    setup->device_slots = cli_tier_device_slots(t, g, plan, setup->prefill + setup->tokens);
    int rc = eval_run(m, plan, ids, n_ids, setup, prefix, ref, keep, on_progress, ps, r, err);
    if (rc == STRATA_OK) {
        tot->evictions += r->evictions;
        tot->fetches += r->fetches;
    }
    return rc;
}

/* Exact multiple-choice knapsack: choice[l] minimizing sum cost[l][choice] with sum of block bytes
 * <= cap (in 64-byte units: every block size is a multiple of 64). Returns 0, or -1 if no plan fits. */
static int solve(int L, int C, const double *cost, const candidate *cand, size_t cap_bytes, int *choice)
{
    size_t cap = cap_bytes / 64, W = cap + 1;
    double *best = malloc((size_t)(L + 1) * W * sizeof *best);
    int *pick = malloc((size_t)L * W * sizeof *pick);
    if (!best || !pick) {
        free(best);
        free(pick);
        return -2;
    }
    for (size_t w = 0; w < W; w++)
        best[w] = 0.0;   /* no layers: nothing spent, no cost */
    for (int l = 0; l < L; l++)
        for (size_t w = 0; w < W; w++) {
            double b = INFINITY;
            int p = -1;
            for (int c = 0; c < C; c++) {
                size_t u = cand[c].block_bytes / 64;
                if (u > w)
                    continue;
                double v = best[(size_t)l * W + (w - u)] + cost[l * C + c];
                if (v < b) {
                    b = v;
                    p = c;
                }
            }
            best[(size_t)(l + 1) * W + w] = b;
            pick[(size_t)l * W + w] = p;
        }
    int rc = isinf(best[(size_t)L * W + cap]) ? -1 : 0;
    size_t w = cap;
    for (int l = L - 1; rc == 0 && l >= 0; l--) {
        choice[l] = pick[(size_t)l * W + w];
        w -= cand[choice[l]].block_bytes / 64;
    }
    free(best);
    free(pick);
    return rc;
}

int cmd_calibrate(int argc, char **argv)
{
    cal_opts o;
    int rc = parse_opts(argc, argv, &o);
    if (rc != 0) {
        cli_tier_opts_free(&o.tiers);
        return rc < 0 ? 0 : rc;
    }
    if (o.threads)
        kern_set_threads(o.threads);
    int exit_code = EXIT_RUNTIME;
    strata_error err = {0};
    char *text = NULL;
    int32_t *ids = NULL;
    size_t text_len = 0, n_ids = 0;
    model *m = NULL;
    eval_prefix prefix = {0};
    eval_reference ref = {0};
    kv_codec_params *plan = NULL;
    double *cost = NULL;
    int *choice = NULL;
    kv_tiers *tiers = NULL;
    kv_lower_tier lower;
    tier_totals tot = {0};

    if (cli_check_model("calibrate", o.model_path) != 0 || cli_read_text("calibrate", o.text_path, &text, &text_len) != 0) {
        cli_tier_opts_free(&o.tiers);
        return EXIT_USAGE;
    }
    if (!o.quiet)
        fprintf(stderr, "strata: loading %s\n", o.model_path);
    m = model_load(o.model_path, 0, -1, &err);
    if (!m) {
        fprintf(stderr, "strata calibrate: %s\n", err.msg);
        goto done;
    }
    const model_config *cfg = model_get_config(m);
    kv_geometry geo = model_kv_geometry(m, o.kv.block_tokens);
    const int L = geo.n_layers;
    candidate cand[MAX_CANDIDATES];
    int C = 0;
    if ((rc = parse_candidates(&o, &geo, cand, &C)) != 0) {
        exit_code = rc;
        goto done;
    }
    /* Budget per token summed over layers -> bytes per block row; a budget above the most precise
     * plan's is that plan's (the search table has a column per 64 bytes of it). */
    const double bt = o.kv.block_tokens;
    const double max_row = (double)cand[C - 1].block_bytes * L;
    size_t cap = o.budget * bt < max_row ? (size_t)floor(o.budget * bt) : (size_t)max_row;
    double min_bpt = (double)cand[0].block_bytes * L / bt, max_bpt = max_row / bt;
    if ((double)cand[0].block_bytes * L > (double)cap) {
        fprintf(stderr, "strata calibrate: --budget %.1f is below the cheapest plan (every layer %s: %.1f bytes/token)\n",
                o.budget, cand[0].name, min_bpt);
        exit_code = EXIT_USAGE;
        goto done;
    }

    /* Every scored step must see a block of every candidate: a step before the first block
     * forms scores 0 whatever the codec's damage, which dilutes the mean, and more so for a
     * candidate with a larger window (a run forming no block at all would look free). */
    for (int c = 0; c < C; c++) {
        long need = (long)cand[c].codec.residual + o.kv.block_tokens;
        if (o.prefill < need) {
            fprintf(stderr, "strata calibrate: --prefill %ld forms no block of %s before the scored steps (its fp16 "
                            "window of %d tokens plus one %ld-token block: %ld); use a longer --prefill\n",
                    o.prefill, cand[c].name, cand[c].codec.residual, (long)o.kv.block_tokens, need);
            exit_code = EXIT_USAGE;
            goto done;
        }
    }

    const tokenizer *tok = model_get_tokenizer(m);
    if (cli_tokenize_document(tok, text, text_len, &ids, &n_ids, &err) != STRATA_OK) {
        fprintf(stderr, "strata calibrate: tokenizing %s: %s\n", o.text_path, err.msg);
        goto done;
    }
    if (n_ids < (size_t)(o.prefill + o.tokens + 1) || o.prefill + o.tokens > cfg->n_ctx_train) {
        fprintf(stderr, "strata calibrate: %s has %zu tokens; --prefill %ld --tokens %ld needs %ld (within the "
                        "model's context of %d)\n",
                o.text_path, n_ids, o.prefill, o.tokens, o.prefill + o.tokens + 1, cfg->n_ctx_train);
        exit_code = EXIT_USAGE;
        goto done;
    }

    plan = malloc((size_t)L * sizeof *plan);
    cost = calloc((size_t)L * (size_t)C, sizeof *cost);
    choice = malloc((size_t)L * sizeof *choice);
    if (!plan || !cost || !choice) {
        fprintf(stderr, "strata calibrate: out of memory\n");
        goto done;
    }
    /* The largest slot of any run: the fp16 reference's or the most precise candidate's. */
    for (int pass = 0; pass < 2 && o.tiers.device_mib > 0; pass++) {
        for (int l = 0; l < L; l++)
            plan[l] = pass ? cand[C - 1].codec : (kv_codec_params){.codec = KV_CODEC_FP16, .bits = 16};
        if (cli_tier_device_slots(&o.tiers, &geo, plan, (size_t)(o.prefill + o.tokens)) == 0) {
            fprintf(stderr, "strata calibrate: --device-kv-mib %g holds no block of %zu bytes (%s)\n",
                    o.tiers.device_mib, kv_plan_largest_block(&geo, plan), pass ? cand[C - 1].name : "fp16");
            exit_code = EXIT_USAGE;
            goto done;
        }
    }
    if (cli_tier_create(&o.tiers, &tiers, &err) != STRATA_OK) {
        fprintf(stderr, "strata calibrate: %s\n", err.msg);
        goto done;
    }
    if (tiers) {
        lower = kv_tiers_lower(tiers);
        if (!o.quiet)
            fprintf(stderr, "strata: KV tiers: %s; device pool %s\n", kv_tiers_describe(tiers),
                    o.tiers.device_mib > 0 ? "per --device-kv-mib" : "with room for the whole context");
    }
    eval_setup setup = {.prefill = (size_t)o.prefill, .tokens = (size_t)o.tokens, .block_tokens = o.kv.block_tokens,
                        .lower = tiers ? &lower : NULL};
    progress_state ps = {.tty = isatty(fileno(stderr)), .quiet = o.quiet, .runs = (size_t)L * (size_t)(C - 1) + 3,
                         .t0 = cli_now_seconds()};
    if (!o.quiet)
        fprintf(stderr, "strata: calibrating %d layers over %d candidates (%s) for %.1f bytes/token "
                        "(range %.1f..%.1f): %zu runs of %ld steps\n",
                L, C, o.candidates, o.budget, min_bpt, max_bpt, ps.runs, o.tokens);
    if (eval_prefix_build(m, ids, (size_t)o.prefill, o.kv.block_tokens, &prefix, &err) != STRATA_OK) {
        fprintf(stderr, "strata calibrate: prefill: %s\n", err.msg);
        goto done;
    }
    eval_result r = {0};
    for (int l = 0; l < L; l++)
        plan[l] = (kv_codec_params){.codec = KV_CODEC_FP16, .bits = 16};
    snprintf(ps.label, sizeof ps.label, "fp16 reference");
    if (run_plan(m, plan, ids, n_ids, &setup, &o.tiers, &geo, &prefix, NULL, &ref, &ps, &r, &tot, &err) != STRATA_OK)
        goto run_failed;
    eval_result_free(&r);
    ps.run++;
    for (int l = 0; l < L; l++)
        plan[l] = cand[C - 1].codec;
    snprintf(ps.label, sizeof ps.label, "all %s", cand[C - 1].name);
    if (run_plan(m, plan, ids, n_ids, &setup, &o.tiers, &geo, &prefix, &ref, NULL, &ps, &r, &tot, &err) != STRATA_OK)
        goto run_failed;
    const double base_kl = r.kl;
    eval_result_free(&r);
    ps.run++;
    for (int l = 0; l < L; l++) {
        for (int c = 0; c < C - 1; c++) {
            plan[l] = cand[c].codec;
            snprintf(ps.label, sizeof ps.label, "layer %d %s", l, cand[c].name);
            if (run_plan(m, plan, ids, n_ids, &setup, &o.tiers, &geo, &prefix, &ref, NULL, &ps, &r, &tot, &err) !=
                STRATA_OK)
                goto run_failed;
            /* Noise can make a cheaper codec look better than the base: that is no damage. */
            cost[l * C + c] = r.kl > base_kl ? r.kl - base_kl : 0.0;
            eval_result_free(&r);
            ps.run++;
        }
        plan[l] = cand[C - 1].codec;
    }
    if (ps.tty && !o.quiet)
        fputc('\n', stderr);
    if ((rc = solve(L, C, cost, cand, cap, choice)) != 0) {
        fprintf(stderr, "strata calibrate: %s\n", rc == -2 ? "out of memory for the plan search" : "no plan fits the budget");
        goto done;
    }
    for (int l = 0; l < L; l++)
        plan[l] = cand[choice[l]].codec;
    snprintf(ps.label, sizeof ps.label, "chosen plan");
    if (run_plan(m, plan, ids, n_ids, &setup, &o.tiers, &geo, &prefix, &ref, NULL, &ps, &r, &tot, &err) != STRATA_OK)
        goto run_failed;
    if (ps.tty && !o.quiet)
        fputc('\n', stderr);
    if (!o.quiet && (tiers || o.tiers.device_mib > 0)) {
        kv_tiers_stats ts = {0};
        if (tiers)
            kv_tiers_get_stats(tiers, &ts);
        fprintf(stderr, "strata: KV tiers over %zu runs: %" PRIu64 " device evictions, %" PRIu64 " fetches; NVMe: %"
                        PRIu64 " spills, %" PRIu64 " restores\n", ps.runs, tot.evictions, tot.fetches, ts.spills,
                ts.restores);
    }
    double plan_bpt = 0;
    for (int l = 0; l < L; l++)
        plan_bpt += (double)cand[choice[l]].block_bytes / bt;
    char comment[4096];
    char *spec = kv_plan_name(plan, L);
    if (!spec) {
        fprintf(stderr, "strata calibrate: out of memory\n");
        goto done;
    }
    snprintf(comment, sizeof comment,
             "strata calibrate: model %s, text %s (prefill %ld, %ld decode steps)\n"
             "budget %.1f bytes/token; this plan %.1f bytes/token (all %s: %.1f, all %s: %.1f)\n"
             "measured mean KL vs fp16: %.6f (all %s: %.6f), perplexity %.4f, top-1 agreement %.1f%%",
             cfg->name[0] ? cfg->name : cfg->arch, o.text_path, o.prefill, o.tokens, o.budget, plan_bpt, cand[0].name,
             min_bpt, cand[C - 1].name, max_bpt, r.kl, cand[C - 1].name, base_kl, r.ppl, r.top1 * 100.0);
    eval_result_free(&r);
    if (kv_plan_save(o.out_path, plan, L, comment, &err) != STRATA_OK) {
        fprintf(stderr, "strata calibrate: %s\n", err.msg);
        free(spec);
        goto done;
    }
    printf("%s\n", spec);
    free(spec);
    for (const char *c = comment; *c;) {
        size_t n = strcspn(c, "\n");
        printf("# %.*s\n", (int)n, c);
        c += n + (c[n] ? 1 : 0);
    }
    printf("# plan written to %s\n", o.out_path);
    exit_code = 0;
    goto done;
run_failed:
    fprintf(stderr, "\nstrata calibrate: %s: %s\n", ps.label, err.msg);
    cli_tier_room_hint("calibrate", err.code, tiers != NULL);
done:
    free(plan);
    free(cost);
    free(choice);
    eval_reference_free(&ref);
    eval_prefix_free(&prefix);
    cli_tier_destroy(tiers);   /* after the runs: each destroyed its pool and sequence */
    free(ids);
    free(text);
    model_free(m);
    cli_tier_opts_free(&o.tiers);
    return exit_code;
}
