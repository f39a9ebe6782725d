/* strata-bench-decode-gpu: end-to-end decode throughput on a GPU at a fixed KV memory budget.
 *
 * For each KV codec: the batch is the largest number of sequences (prompt + generated tokens each)
 * whose device KV caches fit --kv-budget-gib (cuda_seq_device_bytes), capped by --max-batch. The
 * prompts (random ordinary tokens) are prefilled --prefill-batch at a time, then every sequence
 * decodes --gen tokens greedily in batched steps (cuda_model_forward_batch_greedy: only token ids
 * cross to the host). Decode throughput = batch x gen / decode wall time (the greedy ids are read
 * back every step, so the host clock measures finished work). Also: device memory in use at the
 * end of decoding (cudaMemGetInfo), and the longest context one sequence can hold in the budget.
 * The model is any model path (default synthetic:llama3-8b: real shapes, random weights). The
 * same workload through Hugging Face transformers is bench/gpu/hf_decode.py; scripts/gpu-run.sh
 * --decode runs both in one call. Prints a table; --json FILE gets one object per codec. --phases
 * adds where the time went, phase by phase (cuda_model_time_phases: CUDA events at the phase
 * boundaries), for the prefill and for one decode step. */
#include <cuda_runtime.h>
#include <errno.h>
#include <getopt.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvstore/clock.h"
#include "kvstore/kv_cache.h"
#include "kvstore/numarg.h"
#include "worker/cuda/model_cuda.h"
#include "worker/model.h"

#define PROG "strata-bench-decode-gpu"

typedef struct options {
    const char *model;
    char codecs[256];
    double budget_gib;
    int prompt, gen, max_batch, prefill_batch;
    cuda_weight_dtype dtype;
    const char *json;
    bool phases;
} options;

static void usage(FILE *out)
{
    fprintf(out,
            "usage: strata-bench-decode-gpu [options]\n"
            "Decode throughput at a fixed KV memory budget, one row per KV codec (needs a CUDA GPU).\n"
            "  --model PATH          GGUF or synthetic:NAME (default synthetic:llama3-8b)\n"
            "  --codecs LIST         comma-separated (default fp16,kivi4,kivi2,gear2)\n"
            "  --kv-budget-gib G     device memory for KV caches (default 40)\n"
            "  --prompt N            prompt tokens per sequence (default 512)\n"
            "  --gen N               generated tokens per sequence (default 128)\n"
            "  --max-batch N         at most N sequences (default 1024)\n"
            "  --prefill-batch N     prompts per prefill step (default 8)\n"
            "  --weights f16|f32     weights on the device (default f16)\n"
            "  --json FILE           also write the results as JSON lines\n"
            "  --phases              also time each phase of the steps (projections, attention,\n"
            "                        block formation, ...) with CUDA events: device and host ms\n"
            "                        for the whole prefill and per decode step\n"
            "  --help                this text\n");
}

static int parse_options(int argc, char **argv, options *o)
{
    *o = (options){.model = "synthetic:llama3-8b", .budget_gib = 40.0, .prompt = 512, .gen = 128,
                   .max_batch = 1024, .prefill_batch = 8, .dtype = CUDA_WEIGHTS_F16};
    strcpy(o->codecs, "fp16,kivi4,kivi2,gear2");
    static const struct option longopts[] = {
        {"model", required_argument, 0, 'm'},      {"codecs", required_argument, 0, 'c'},
        {"kv-budget-gib", required_argument, 0, 'b'}, {"prompt", required_argument, 0, 'p'},
        {"gen", required_argument, 0, 'g'},        {"max-batch", required_argument, 0, 'x'},
        {"prefill-batch", required_argument, 0, 'f'}, {"weights", required_argument, 0, 'w'},
        {"json", required_argument, 0, 'j'},       {"phases", no_argument, 0, 't'},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        bool ok = true;
        switch (c) {
        case 'm': o->model = optarg; break;
        case 'c':
            if (strlen(optarg) >= sizeof o->codecs) {
                fprintf(stderr, "%s: --codecs too long\n", PROG);
                return -1;
            }
            strcpy(o->codecs, optarg);
            break;
        case 'b': ok = strata_parse_double(PROG, "--kv-budget-gib", optarg, 1.0 / 1024, 4096.0, &o->budget_gib); break;
        case 'p': ok = strata_parse_int(PROG, "--prompt", optarg, 1, 65535, &o->prompt); break;
        case 'g': ok = strata_parse_int(PROG, "--gen", optarg, 1, 1 << 20, &o->gen); break;
        case 'x': ok = strata_parse_int(PROG, "--max-batch", optarg, 1, 65535, &o->max_batch); break;
        case 'f': ok = strata_parse_int(PROG, "--prefill-batch", optarg, 1, 1024, &o->prefill_batch); break;
        case 'w':
            if (strcmp(optarg, "f16") == 0)
                o->dtype = CUDA_WEIGHTS_F16;
            else if (strcmp(optarg, "f32") == 0)
                o->dtype = CUDA_WEIGHTS_F32;
            else {
                fprintf(stderr, "%s: --weights is f16 or f32\n", PROG);
                ok = false;
            }
            break;
        case 'j': o->json = optarg; break;
        case 't': o->phases = true; break;
        case 'h': usage(stdout); exit(0);
        default: usage(stderr); return -1;
        }
        if (!ok)
            return -1;
    }
    if (optind != argc) {
        fprintf(stderr, "strata-bench-decode-gpu: unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    return 0;
}

static size_t used_bytes(void)
{
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess)
        return 0;
    return total_b - free_b;
}

/* The longest max_tokens (a multiple of 64) whose cache fits the budget. */
static size_t longest_context(const cuda_model *cm, const kv_codec_params *p, size_t budget)
{
    size_t lo = 0, hi = (size_t)1 << 24;
    while (lo < hi) {
        const size_t mid = (lo + hi + 1) / 2, tokens = mid * 64;
        size_t bytes;
        if (cuda_seq_device_bytes(cm, p, 64, tokens, &bytes, NULL) == STRATA_OK && bytes <= budget)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo * 64;
}

typedef struct result {
    int batch;
    double decode_tok_s, prefill_s, decode_s, used_gib;
    size_t longest;
    cuda_phase_times prefill_phases, decode_phases;   /* with --phases */
} result;

/* Turns phase timing on (zeroed) when asked; 0 or 1 (the error printed). */
static int start_phases(const options *o, cuda_model *cm, const char *codec_name)
{
    strata_error err = {0};
    if (o->phases && cuda_model_time_phases(cm, true, &err) != STRATA_OK) {
        fprintf(stderr, "%s: %s: %s\n", PROG, codec_name, err.msg);
        return 1;
    }
    return 0;
}

static int run_codec(const options *o, cuda_model *cm, const model_config *cfg, const char *codec_name, result *r)
{
    strata_error err = {0};
    kv_codec_params p;
    if (kv_codec_parse(codec_name, &p, &err) != STRATA_OK) {
        fprintf(stderr, "strata-bench-decode-gpu: %s\n", err.msg);
        return 2;
    }
    const size_t per_seq_tokens = (size_t)o->prompt + (size_t)o->gen;
    const size_t budget = (size_t)(o->budget_gib * 1073741824.0);
    size_t per_seq;
    if (cuda_seq_device_bytes(cm, &p, 64, per_seq_tokens, &per_seq, &err) != STRATA_OK) {
        fprintf(stderr, "strata-bench-decode-gpu: %s: %s\n", codec_name, err.msg);
        return 2;
    }
    *r = (result){0};
    r->longest = longest_context(cm, &p, budget);
    size_t b = budget / per_seq;
    if (b > (size_t)o->max_batch)
        b = (size_t)o->max_batch;
    r->batch = (int)b;
    if (b == 0) {
        fprintf(stderr, "%s: one sequence of %zu tokens needs %zu bytes, more than the budget\n", codec_name,
                per_seq_tokens, per_seq);
        return 0;
    }
    cuda_seq **seqs = calloc(b, sizeof *seqs);
    cuda_batch_item *items = calloc(b, sizeof *items);
    int32_t *prompts = malloc(b * (size_t)o->prompt * sizeof *prompts), *next = malloc(b * sizeof *next);
    if (!seqs || !items || !prompts || !next) {
        fprintf(stderr, "strata-bench-decode-gpu: out of memory\n");
        return 1;
    }
    int rc = 0;
    uint64_t state = 0x5eed;
    for (size_t i = 0; i < b * (size_t)o->prompt; i++) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        prompts[i] = (int32_t)(32 + (state >> 33) % (uint64_t)(cfg->n_vocab > 1000 ? 900 : cfg->n_vocab - 32));
    }
    for (size_t i = 0; i < b && !rc; i++)
        if (!(seqs[i] = cuda_seq_create(cm, &p, 64, per_seq_tokens, &err))) {
            fprintf(stderr, "strata-bench-decode-gpu: %s: sequence %zu of %zu: %s\n", codec_name, i, b, err.msg);
            rc = 1;
        }
    fprintf(stderr, "%s: %zu sequences of %zu tokens (%.1f MiB each), prefilling...\n", codec_name, b, per_seq_tokens,
            (double)per_seq / 1048576.0);
    if (!rc)
        rc = start_phases(o, cm, codec_name);
    const double t0 = strata_mono_s();
    for (size_t i = 0; i < b && !rc; i += (size_t)o->prefill_batch) {
        const size_t n = b - i < (size_t)o->prefill_batch ? b - i : (size_t)o->prefill_batch;
        for (size_t k = 0; k < n; k++)
            items[k] = (cuda_batch_item){seqs[i + k], prompts + (i + k) * (size_t)o->prompt, (size_t)o->prompt};
        if (cuda_model_forward_batch_greedy(cm, items, n, next + i, &err) != STRATA_OK) {
            fprintf(stderr, "strata-bench-decode-gpu: %s: prefill: %s\n", codec_name, err.msg);
            rc = 1;
        }
    }
    const double t1 = strata_mono_s();
    cuda_model_phase_times(cm, &r->prefill_phases);
    if (!rc)
        rc = start_phases(o, cm, codec_name);
    fprintf(stderr, "%s: prefill %.1f s; decoding %d steps of %zu sequences...\n", codec_name, t1 - t0, o->gen, b);
    for (int step = 0; step < o->gen && !rc; step++) {
        for (size_t i = 0; i < b; i++)
            items[i] = (cuda_batch_item){seqs[i], next + i, 1};
        /* next[i] is read as this step's token and overwritten with the following one: the batch
         * call copies every item's token to the device before it writes any result. */
        if (cuda_model_forward_batch_greedy(cm, items, b, next, &err) != STRATA_OK) {
            fprintf(stderr, "strata-bench-decode-gpu: %s: decode step %d: %s\n", codec_name, step, err.msg);
            rc = 1;
        }
    }
    const double t2 = strata_mono_s();
    cuda_model_phase_times(cm, &r->decode_phases);
    cuda_model_time_phases(cm, false, NULL);
    r->used_gib = (double)used_bytes() / 1073741824.0;
    r->prefill_s = t1 - t0;
    r->decode_s = t2 - t1;
    r->decode_tok_s = rc ? 0.0 : (double)b * o->gen / (t2 - t1);
    for (size_t i = 0; i < b; i++)
        cuda_seq_free(seqs[i]);
    free(seqs);
    free(items);
    free(prompts);
    free(next);
    return rc;
}

/* Phase table of one codec: the prefill's totals and the decode's per step. */
static void print_phases(const char *codec_name, const result *r)
{
    const cuda_phase_times *pf = &r->prefill_phases, *dc = &r->decode_phases;
    const double steps = dc->steps ? (double)dc->steps : 1.0;
    printf("  %s phases: prefill (%llu steps, total ms) | decode (per step of %d sequences, ms)\n", codec_name,
           (unsigned long long)pf->steps, r->batch);
    printf("  %-14s %12s %12s | %10s %10s\n", "phase", "device", "host", "device", "host");
    for (int p = 0; p < CUDA_PHASE_COUNT; p++)
        if (pf->marks[p] || dc->marks[p])
            printf("  %-14s %12.2f %12.2f | %10.3f %10.3f\n", cuda_phase_name((cuda_phase)p), pf->device_ms[p],
                   pf->host_ms[p], dc->device_ms[p] / steps, dc->host_ms[p] / steps);
    if (pf->dropped_steps || dc->dropped_steps)
        printf("  (times of %llu prefill and %llu decode steps were lost to a failed CUDA event: not counted)\n",
               (unsigned long long)pf->dropped_steps, (unsigned long long)dc->dropped_steps);
}

/* ,"NAME":{"phase":[device_ms,host_ms,marks],...} */
static void json_phases(FILE *f, const char *name, const cuda_phase_times *t)
{
    fprintf(f, ",\"%s\":{\"steps\":%llu,\"dropped_steps\":%llu", name, (unsigned long long)t->steps,
            (unsigned long long)t->dropped_steps);
    for (int p = 0; p < CUDA_PHASE_COUNT; p++)
        fprintf(f, ",\"%s\":[%.4f,%.4f,%llu]", cuda_phase_name((cuda_phase)p), t->device_ms[p], t->host_ms[p],
                (unsigned long long)t->marks[p]);
    fputc('}', f);
}

int main(int argc, char **argv)
{
    options o;
    if (parse_options(argc, argv, &o))
        return 2;
    strata_error err = {0};
    fprintf(stderr, "loading %s...\n", o.model);
    const double t0 = strata_mono_s();
    model *m = model_load_for_device(o.model, 0, -1, &err);
    if (!m) {
        fprintf(stderr, "strata-bench-decode-gpu: %s\n", err.msg);
        return 1;
    }
    const size_t base = used_bytes();
    cuda_model *cm = cuda_model_create(m, o.dtype, &err);
    if (!cm) {
        fprintf(stderr, "strata-bench-decode-gpu: %s\n", err.msg);
        model_free(m);
        return 1;
    }
    const model_config *cfg = model_get_config(m);
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess)
        strcpy(prop.name, "unknown device");
    printf("device: %s; model %s (%d layers, %d/%d heads, head_dim %d), %s weights %.2f GiB on the device, loaded in "
           "%.0f s\n",
           prop.name, cfg->name, cfg->n_layers, cfg->n_heads, cfg->n_kv_heads, cfg->head_dim,
           o.dtype == CUDA_WEIGHTS_F16 ? "fp16" : "fp32", (double)cuda_model_weight_bytes(cm) / 1073741824.0,
           strata_mono_s() - t0);
    printf("workload: prompt %d + %d generated tokens per sequence, KV budget %.1f GiB, greedy decoding\n", o.prompt,
           o.gen, o.budget_gib);
    printf("%-8s %6s %12s %10s %10s %12s %14s %8s\n", "codec", "batch", "decode_tok/s", "prefill_s", "decode_s",
           "used_GiB", "longest_ctx", "vs_fp16");
    FILE *json = o.json ? fopen(o.json, "w") : NULL;
    if (o.json && !json) {
        fprintf(stderr, "strata-bench-decode-gpu: %s: %s\n", o.json, strerror(errno));
        return 1;
    }
    double fp16_rate = 0.0;
    int status = 0;
    char list[256];
    strcpy(list, o.codecs);
    for (char *save = NULL, *name = strtok_r(list, ",", &save); name; name = strtok_r(NULL, ",", &save)) {
        result r;
        const int rc = run_codec(&o, cm, cfg, name, &r);
        if (rc) {
            status = rc;
            continue;
        }
        if (strcmp(name, "fp16") == 0)
            fp16_rate = r.decode_tok_s;
        char ratio[32] = "-";
        if (fp16_rate > 0.0 && r.decode_tok_s > 0.0)
            snprintf(ratio, sizeof ratio, "%.2fx", r.decode_tok_s / fp16_rate);
        printf("%-8s %6d %12.1f %10.2f %10.2f %12.2f %14zu %8s\n", name, r.batch, r.decode_tok_s, r.prefill_s,
               r.decode_s, r.used_gib, r.longest, ratio);
        if (o.phases && r.batch > 0)
            print_phases(name, &r);
        fflush(stdout);
        if (json) {
            fprintf(json,
                    "{\"device\":\"%s\",\"model\":\"%s\",\"codec\":\"%s\",\"batch\":%d,\"prompt\":%d,\"gen\":%d,"
                    "\"kv_budget_gib\":%.2f,\"decode_tok_s\":%.2f,\"prefill_s\":%.3f,\"decode_s\":%.3f,"
                    "\"used_gib\":%.3f,\"base_gib\":%.3f,\"longest_context\":%zu",
                    prop.name, cfg->name, name, r.batch, o.prompt, o.gen, o.budget_gib, r.decode_tok_s, r.prefill_s,
                    r.decode_s, r.used_gib, (double)base / 1073741824.0, r.longest);
            if (o.phases && r.batch > 0) {
                json_phases(json, "prefill_phases", &r.prefill_phases);
                json_phases(json, "decode_phases", &r.decode_phases);
            }
            fputs("}\n", json);
        }
    }
    if (json)
        fclose(json);
    cuda_model_free(cm);
    model_free(m);
    return status;
}
