/* strata-bench-attention: the CUDA decode-attention kernel (kernels/cuda_kv_attention.h) over
 * paged compressed blocks, against the device's own copy bandwidth, in one run.
 *
 * For each codec (fp16, kivi2, kivi4, gear2 by default), context and batch: every sequence holds context / block_tokens full blocks of
 * one layer (no fp16 tail, so that only block bytes are counted), laid out in one device arena
 * in a shuffled order (a block table is not contiguous in a real pool). Block payloads are a few
 * dozen distinct encoded blocks of random fp16 K/V repeated over the arena, each copy with its own
 * header position so that the kernel's header checks pass; every block is a distinct address, so
 * the L2 cache does not serve repeats. Timing: CUDA events around each launch after warm-up runs,
 * the median of --reps. Effective bandwidth = bytes the kernel must read (every block's bytes,
 * the queries, the block tables) plus the output it writes, over the median time. The copy
 * ceiling is a device-to-device cudaMemcpy of a large buffer, counting bytes read plus written.
 *
 * Prints one table row per configuration (and --csv FILE gets the same as CSV). A configuration
 * whose blocks do not fit --mem-fraction of the free device memory is reported as skipped. */
#include <cuda_runtime.h>
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda_kv_attention.h"
#include "kvstore/block.h"
#include "kvstore/half.h"
#include "kvstore/kv_cache.h"
#include "kvstore/numarg.h"

#define PROG "strata-bench-attention"
#define MAX_LIST 16
#define TEMPLATES 64

typedef struct options {
    char codecs[MAX_LIST][32];
    int n_codecs;
    long contexts[MAX_LIST];
    int n_contexts;
    long batches[MAX_LIST];
    int n_batches;
    int q_heads, kv_heads, head_dim, block_tokens, reps;
    double mem_fraction;
    const char *csv;
    int compare;   /* 0, or a cuda_kv_kernel also timed on the same data */
} options;

static void usage(FILE *out)
{
    fprintf(out,
            "usage: strata-bench-attention [options]\n"
            "Times the CUDA decode attention over compressed KV blocks against the device's copy bandwidth.\n"
            "  --codecs LIST        comma-separated KV codecs (default fp16,kivi2,kivi4,gear2)\n"
            "  --contexts LIST      tokens per sequence, multiples of --block-tokens\n"
            "                       (default 4096,8192,16384,32768,65536,131072)\n"
            "  --batches LIST       sequences per launch (default 1,8,32,64)\n"
            "  --q-heads N          query heads (default 32: Llama-3-8B)\n"
            "  --kv-heads N         KV heads (default 8)\n"
            "  --head-dim N         (default 128)\n"
            "  --block-tokens N     tokens per block (default 64)\n"
            "  --reps N             timed launches per configuration, median reported (default 20)\n"
            "  --mem-fraction F     use at most this share of free device memory (default 0.85)\n"
            "  --compare KERNEL     also time KERNEL on the same blocks and compare outputs: generic\n"
            "                       (the first kernel, every codec) or staged (fp32 arithmetic; what\n"
            "                       runs by default for fp16, while KIVI, TaDA, GEAR and OTT run on\n"
            "                       the tensor cores)\n"
            "  --csv FILE           also write the rows as CSV\n"
            "  --help               this text\n");
}

/* A comma-separated list of 1 to MAX_LIST positive integers. */
static bool parse_list(const char *arg, const char *flag, long *out, int *n)
{
    char buf[512];
    if (strlen(arg) >= sizeof buf) {
        fprintf(stderr, "%s: %s: list too long\n", PROG, flag);
        return false;
    }
    strcpy(buf, arg);
    *n = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (*n == MAX_LIST) {
            fprintf(stderr, "%s: %s: at most %d values\n", PROG, flag, MAX_LIST);
            return false;
        }
        if (!strata_parse_long(PROG, flag, tok, 1, 1L << 30, &out[*n]))
            return false;
        (*n)++;
    }
    if (*n == 0)
        fprintf(stderr, "%s: %s: no values\n", PROG, flag);
    return *n > 0;
}

static int parse_options(int argc, char **argv, options *o)
{
    *o = (options){.n_codecs = 4, .n_contexts = 6, .n_batches = 4, .q_heads = 32, .kv_heads = 8, .head_dim = 128,
                   .block_tokens = 64, .reps = 20, .mem_fraction = 0.85,
                   .contexts = {4096, 8192, 16384, 32768, 65536, 131072}, .batches = {1, 8, 32, 64}};
    strcpy(o->codecs[0], "fp16");
    strcpy(o->codecs[1], "kivi2");
    strcpy(o->codecs[2], "kivi4");
    strcpy(o->codecs[3], "gear2");
    static const struct option longopts[] = {
        {"codecs", required_argument, 0, 'c'},   {"contexts", required_argument, 0, 'x'},
        {"batches", required_argument, 0, 'b'},  {"q-heads", required_argument, 0, 'q'},
        {"kv-heads", required_argument, 0, 'k'}, {"head-dim", required_argument, 0, 'd'},
        {"block-tokens", required_argument, 0, 't'}, {"reps", required_argument, 0, 'r'},
        {"mem-fraction", required_argument, 0, 'm'}, {"csv", required_argument, 0, 'o'},
        {"compare", required_argument, 0, 'g'},
        {"help", no_argument, 0, 'h'},           {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        bool ok = true;
        switch (c) {
        case 'c': {
            char buf[512];
            snprintf(buf, sizeof buf, "%s", optarg);
            o->n_codecs = 0;
            for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok && o->n_codecs < MAX_LIST;
                 tok = strtok_r(NULL, ",", &save))
                snprintf(o->codecs[o->n_codecs++], sizeof o->codecs[0], "%s", tok);
            break;
        }
        case 'x': ok = parse_list(optarg, "--contexts", o->contexts, &o->n_contexts); break;
        case 'b': ok = parse_list(optarg, "--batches", o->batches, &o->n_batches); break;
        case 'q': ok = strata_parse_int(PROG, "--q-heads", optarg, 1, 1024, &o->q_heads); break;
        case 'k': ok = strata_parse_int(PROG, "--kv-heads", optarg, 1, 1024, &o->kv_heads); break;
        case 'd': ok = strata_parse_int(PROG, "--head-dim", optarg, 1, 256, &o->head_dim); break;
        case 't': ok = strata_parse_int(PROG, "--block-tokens", optarg, 1, 4096, &o->block_tokens); break;
        case 'r': ok = strata_parse_int(PROG, "--reps", optarg, 1, 100000, &o->reps); break;
        case 'm': ok = strata_parse_double(PROG, "--mem-fraction", optarg, 0.01, 0.95, &o->mem_fraction); break;
        case 'o': o->csv = optarg; break;
        case 'g':
            if (!strcmp(optarg, "generic"))
                o->compare = CUDA_KV_KERNEL_GENERIC;
            else if (!strcmp(optarg, "staged"))
                o->compare = CUDA_KV_KERNEL_STAGED;
            else {
                fprintf(stderr, "%s: --compare takes generic or staged, not '%s'\n", PROG, optarg);
                ok = false;
            }
            break;
        case 'h': usage(stdout); exit(0);
        default: usage(stderr); return -1;
        }
        if (!ok)
            return -1;
    }
    if (optind != argc) {
        fprintf(stderr, "strata-bench-attention: unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    for (int i = 0; i < o->n_contexts; i++)
        if (o->contexts[i] % o->block_tokens) {
            fprintf(stderr, "strata-bench-attention: context %ld is not a multiple of %d block tokens\n",
                    o->contexts[i], o->block_tokens);
            return -1;
        }
    return 0;
}

#define CHECK(call)                                                                                          \
    do {                                                                                                     \
        cudaError_t e_ = (call);                                                                             \
        if (e_ != cudaSuccess) {                                                                             \
            fprintf(stderr, "strata-bench-attention: %s: %s\n", #call, cudaGetErrorString(e_));             \
            exit(1);                                                                                         \
        }                                                                                                    \
    } while (0)

static uint64_t rng_state = 0x5eedULL;
static uint64_t rng_u64(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
/* Uniform in [-1, 1). */
static float rnd(void) { return (float)((double)(rng_u64() >> 11) * 0x1p-52 - 1.0); }

static int cmp_float(const void *a, const void *b)
{
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static float median(float *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_float);
    return n % 2 ? v[n / 2] : 0.5f * (v[n / 2 - 1] + v[n / 2]);
}

/* Device-to-device copy bandwidth, bytes read plus written per second. */
static double copy_bandwidth(size_t free_bytes)
{
    size_t bytes = (size_t)2 << 30;
    while (bytes > free_bytes / 3)
        bytes /= 2;
    void *a, *b;
    CHECK(cudaMalloc(&a, bytes));
    CHECK(cudaMalloc(&b, bytes));
    CHECK(cudaMemset(a, 1, bytes));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    float t[21];
    for (int i = 0; i < 24; i++) {
        CHECK(cudaEventRecord(e0, 0));
        CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0));
        CHECK(cudaEventRecord(e1, 0));
        CHECK(cudaEventSynchronize(e1));
        if (i >= 3)
            CHECK(cudaEventElapsedTime(&t[i - 3], e0, e1));
    }
    CHECK(cudaEventDestroy(e0));
    CHECK(cudaEventDestroy(e1));
    CHECK(cudaFree(a));
    CHECK(cudaFree(b));
    return 2.0 * (double)bytes / (median(t, 21) * 1e-3);
}

typedef struct result {
    int ok;            /* 0: skipped (memory) */
    double us, gbps, bytes;
    double other_us;     /* --compare: that kernel's median, else 0 */
    double diff;         /* --compare: |out - out_other| / |out_other| */
} result;

/* Median milliseconds of reps launches (after 3 warm-ups) with this plan; exits on an error or a
 * rejected block. */
static double time_kernel(const options *o, const cuda_kv_layout *layout, const cuda_kv_plan *plan,
                          const cuda_kv_seq *d_seqs, const float *d_q, float *d_out, void *d_ws, int *d_status)
{
    strata_error err;
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    float *times = malloc((size_t)o->reps * sizeof *times);
    if (!times)
        exit(1);
    for (int i = -3; i < o->reps; i++) {
        CHECK(cudaEventRecord(e0, 0));
        if (cuda_kv_attention(layout, plan, d_seqs, d_q, d_out, d_ws, d_status, NULL, &err) != STRATA_OK) {
            fprintf(stderr, "strata-bench-attention: %s\n", err.msg);
            exit(1);
        }
        CHECK(cudaEventRecord(e1, 0));
        CHECK(cudaEventSynchronize(e1));
        if (i >= 0)
            CHECK(cudaEventElapsedTime(&times[i], e0, e1));
    }
    int status = 0;
    CHECK(cudaMemcpy(&status, d_status, sizeof status, cudaMemcpyDeviceToHost));
    if (status) {
        fprintf(stderr, "strata-bench-attention: the kernel rejected blocks (status %d)\n", status);
        exit(1);
    }
    const double ms = median(times, o->reps);
    free(times);
    CHECK(cudaEventDestroy(e0));
    CHECK(cudaEventDestroy(e1));
    return ms;
}

/* Encodes TEMPLATES distinct blocks of the codec (random fp16 K/V). */
static uint8_t *make_templates(const kv_codec_params *p, const kv_geometry *g, size_t slot)
{
    const size_t rows = (size_t)g->block_tokens * g->n_kv_heads * g->head_dim;
    uint8_t *t = aligned_alloc(64, slot * TEMPLATES);
    float *k = malloc(rows * sizeof *k), *v = malloc(rows * sizeof *v);
    if (!t || !k || !v) {
        fprintf(stderr, "strata-bench-attention: out of host memory\n");
        exit(1);
    }
    memset(t, 0, slot * TEMPLATES);
    for (int b = 0; b < TEMPLATES; b++) {
        for (size_t i = 0; i < rows; i++) {
            k[i] = strata_round_half(2.0f * rnd() + 0.3f * (float)(i % 5));
            v[i] = strata_round_half(rnd());
        }
        kv_block_desc d;
        kv_block_desc_init(&d, p, g, 0, 0);
        strata_error err;
        if (kv_block_encode(&d, k, v, t + (size_t)b * slot, slot, NULL, &err) != STRATA_OK) {
            fprintf(stderr, "strata-bench-attention: encoding a block: %s\n", err.msg);
            exit(1);
        }
    }
    free(k);
    free(v);
    return t;
}

static void put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static result run_config(const options *o, long context, size_t block_bytes, long batch, int sms,
                         const uint8_t *templates, size_t slot, const cuda_kv_layout *layout)
{
    result r = {0};
    const long per_seq = context / o->block_tokens;
    const size_t total = (size_t)per_seq * (size_t)batch;
    size_t free_bytes, total_bytes;
    CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    const size_t qbytes = (size_t)batch * o->q_heads * o->head_dim * sizeof(float);
    cuda_kv_plan plan;
    strata_error err;
    if (cuda_kv_attention_plan(layout, (int)batch, o->q_heads, (int)per_seq, sms, &plan, &err) != STRATA_OK) {
        fprintf(stderr, "strata-bench-attention: %s\n", err.msg);
        exit(1);
    }
    const size_t ws = cuda_kv_attention_workspace(layout, &plan);
    const size_t need = total * slot + total * sizeof(void *) + 2 * qbytes + ws;
    if ((double)need > o->mem_fraction * (double)free_bytes)
        return r;

    uint8_t *arena;
    CHECK(cudaMalloc((void **)&arena, total * slot));
    /* Slot s of the arena holds block (seq, index) = order[s]: a shuffled placement. */
    size_t *order = malloc(total * sizeof *order);
    const uint8_t **table = malloc(total * sizeof *table);
    uint8_t *stage = NULL;
    const size_t chunk = 1024;
    CHECK(cudaMallocHost((void **)&stage, chunk * slot));
    if (!order || !table) {
        fprintf(stderr, "strata-bench-attention: out of host memory\n");
        exit(1);
    }
    for (size_t i = 0; i < total; i++)
        order[i] = i;
    for (size_t i = total; i > 1; i--) {
        size_t j = (size_t)(rng_u64() % i);
        size_t t = order[i - 1];
        order[i - 1] = order[j];
        order[j] = t;
    }
    for (size_t s0 = 0; s0 < total; s0 += chunk) {
        const size_t n = total - s0 < chunk ? total - s0 : chunk;
        for (size_t i = 0; i < n; i++) {
            const size_t blk = order[s0 + i], index = blk % (size_t)per_seq;
            uint8_t *dst = stage + i * slot;
            memcpy(dst, templates + (blk % TEMPLATES) * slot, slot);
            /* The kernel checks first_pos (not the CRCs, which the tiers check on the way in). */
            put_u64(dst + KV_HDR_FIRST_POS, (uint64_t)index * (uint64_t)o->block_tokens);
            table[blk] = arena + (s0 + i) * slot;
        }
        CHECK(cudaMemcpy(arena + s0 * slot, stage, n * slot, cudaMemcpyHostToDevice));
    }
    CHECK(cudaFreeHost(stage));

    const uint8_t **d_table;
    CHECK(cudaMalloc((void **)&d_table, total * sizeof *table));
    CHECK(cudaMemcpy(d_table, table, total * sizeof *table, cudaMemcpyHostToDevice));
    cuda_kv_seq *seqs = calloc((size_t)batch, sizeof *seqs);
    float *q = malloc(qbytes);
    if (!seqs || !q) {
        fprintf(stderr, "strata-bench-attention: out of host memory\n");
        exit(1);
    }
    for (long s = 0; s < batch; s++)
        seqs[s] = (cuda_kv_seq){.blocks = d_table + (size_t)s * (size_t)per_seq, .n_blocks = (int)per_seq};
    for (size_t i = 0; i < qbytes / sizeof(float); i++)
        q[i] = rnd();
    cuda_kv_seq *d_seqs;
    float *d_q, *d_out;
    void *d_ws;
    int *d_status;
    CHECK(cudaMalloc((void **)&d_seqs, (size_t)batch * sizeof *seqs));
    CHECK(cudaMemcpy(d_seqs, seqs, (size_t)batch * sizeof *seqs, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc((void **)&d_q, qbytes));
    CHECK(cudaMemcpy(d_q, q, qbytes, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc((void **)&d_out, qbytes));
    CHECK(cudaMalloc(&d_ws, ws));
    CHECK(cudaMalloc((void **)&d_status, sizeof(int)));
    CHECK(cudaMemset(d_status, 0, sizeof(int)));

    const double t = time_kernel(o, layout, &plan, d_seqs, d_q, d_out, d_ws, d_status) * 1e-3;
    r.ok = 1;
    r.bytes = (double)total * (double)block_bytes + (double)total * sizeof(void *) + 2.0 * (double)qbytes;
    r.us = t * 1e6;
    r.gbps = r.bytes / t / 1e9;
    if (o->compare) {
        const size_t nq = qbytes / sizeof(float);
        float *a = malloc(qbytes), *b = malloc(qbytes);
        if (!a || !b)
            exit(1);
        CHECK(cudaMemcpy(a, d_out, qbytes, cudaMemcpyDeviceToHost));
        cuda_kv_plan other = plan;
        other.kernel = o->compare;
        r.other_us = time_kernel(o, layout, &other, d_seqs, d_q, d_out, d_ws, d_status) * 1e3;
        CHECK(cudaMemcpy(b, d_out, qbytes, cudaMemcpyDeviceToHost));
        double num = 0.0, den = 0.0;
        for (size_t i = 0; i < nq; i++) {
            num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
            den += (double)b[i] * b[i];
        }
        r.diff = den > 0.0 ? sqrt(num / den) : sqrt(num);
        free(a);
        free(b);
    }

    CHECK(cudaFree(d_seqs));
    CHECK(cudaFree(d_q));
    CHECK(cudaFree(d_out));
    CHECK(cudaFree(d_ws));
    CHECK(cudaFree(d_status));
    CHECK(cudaFree(d_table));
    CHECK(cudaFree(arena));
    free(seqs);
    free(q);
    free(order);
    free(table);
    return r;
}

int main(int argc, char **argv)
{
    options o;
    if (parse_options(argc, argv, &o))
        return 2;
    int n_dev = 0;
    cudaError_t e = cudaGetDeviceCount(&n_dev);
    if (e != cudaSuccess || n_dev == 0) {
        fprintf(stderr, "strata-bench-attention: no CUDA device (%s)\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        return 1;
    }
    struct cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    size_t free_bytes, total_bytes;
    CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    const double copy = copy_bandwidth(free_bytes);
    printf("device: %s, %d multiprocessors, %.1f GiB, copy bandwidth %.0f GB/s (read + write)\n", prop.name,
           prop.multiProcessorCount, (double)total_bytes / (1 << 30), copy / 1e9);
    printf("shape: %d query heads, %d KV heads, head_dim %d, %d tokens per block, median of %d launches\n", o.q_heads,
           o.kv_heads, o.head_dim, o.block_tokens, o.reps);
    FILE *csv = NULL;
    if (o.csv && !(csv = fopen(o.csv, "w"))) {
        fprintf(stderr, "strata-bench-attention: %s: %s\n", o.csv, strerror(errno));
        return 1;
    }
    if (csv)
        fprintf(csv, "device,codec,context,batch,us,gbps,pct_copy,speedup_vs_fp16%s\n",
                o.compare ? (o.compare == CUDA_KV_KERNEL_GENERIC ? ",generic_us,speedup_vs_generic,rel_diff_vs_generic"
                                                                 : ",staged_us,speedup_vs_staged,rel_diff_vs_staged")
                          : "");
    printf("%-8s %8s %6s %12s %10s %8s %12s", "codec", "context", "batch", "time_us", "GB/s", "%copy", "vs_fp16");
    if (o.compare)
        printf(" %12s %10s %10s", o.compare == CUDA_KV_KERNEL_GENERIC ? "generic_us" : "staged_us",
               o.compare == CUDA_KV_KERNEL_GENERIC ? "vs_generic" : "vs_staged", "rel_diff");
    printf("\n");
    /* fp16 times by (context, batch), for the speedup column. */
    double fp16_us[MAX_LIST][MAX_LIST] = {{0}};
    for (int c = 0; c < o.n_codecs; c++) {
        kv_codec_params p;
        strata_error err;
        const kv_geometry g = {.n_layers = 1, .n_kv_heads = o.kv_heads, .head_dim = o.head_dim,
                               .block_tokens = o.block_tokens};
        if (kv_codec_parse(o.codecs[c], &p, &err) != STRATA_OK || kv_codec_validate(&p, &g, &err) != STRATA_OK) {
            fprintf(stderr, "strata-bench-attention: %s\n", err.msg);
            return 2;
        }
        const size_t slot = kv_block_size(&p, &g);
        uint8_t *templates = make_templates(&p, &g, slot);
        kv_block tb;
        cuda_kv_layout layout;
        if (kv_block_parse(templates, slot, &tb, &err) != STRATA_OK ||
            cuda_kv_layout_from_block(&tb, &layout, &err) != STRATA_OK) {
            fprintf(stderr, "strata-bench-attention: %s: %s\n", o.codecs[c], err.msg);
            return 2;
        }
        /* GEAR and OTT blocks vary in size: the kernel checks each against the slot. The bytes
         * counted are the template blocks' own (every block here is one of them). */
        layout.block_bytes = (uint32_t)slot;
        for (int x = 0; x < o.n_contexts; x++) {
            for (int b = 0; b < o.n_batches; b++) {
                result r = run_config(&o, o.contexts[x], tb.block_bytes, o.batches[b], prop.multiProcessorCount, templates, slot,
                                      &layout);
                if (!r.ok) {
                    printf("%-8s %8ld %6ld %12s (does not fit %.0f%% of free memory)\n", o.codecs[c], o.contexts[x],
                           o.batches[b], "skipped", o.mem_fraction * 100.0);
                    continue;
                }
                if (p.codec == KV_CODEC_FP16)
                    fp16_us[x][b] = r.us;
                char speed[32] = "-";
                if (fp16_us[x][b] > 0.0)
                    snprintf(speed, sizeof speed, "%.2fx", fp16_us[x][b] / r.us);
                printf("%-8s %8ld %6ld %12.1f %10.1f %7.1f%% %12s", o.codecs[c], o.contexts[x], o.batches[b], r.us,
                       r.gbps, 100.0 * r.gbps * 1e9 / copy, speed);
                if (o.compare)
                    printf(" %12.1f %9.2fx %10.1e", r.other_us, r.other_us / r.us, r.diff);
                printf("\n");
                if (csv) {
                    fprintf(csv, "\"%s\",%s,%ld,%ld,%.2f,%.2f,%.2f,%s", prop.name, o.codecs[c], o.contexts[x],
                            o.batches[b], r.us, r.gbps, 100.0 * r.gbps * 1e9 / copy,
                            fp16_us[x][b] > 0.0 ? speed : "");
                    if (o.compare)
                        fprintf(csv, ",%.2f,%.2fx,%.2e\n", r.other_us, r.other_us / r.us, r.diff);
                    else
                        fprintf(csv, "\n");
                }
                fflush(stdout);
            }
        }
        free(templates);
    }
    if (csv)
        fclose(csv);
    return 0;
}
