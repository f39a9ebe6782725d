/* strata-bench-prefill: how long a prompt takes to prefill on the CPU when it is longer than one
 * step's token budget, side by side in one run on one model and one prompt:
 *   whole      the prompt in one pass (exact causal attention over its fp16 K/V)
 *   chunked    a first chunk of --chunk tokens, then chunks of --chunk tokens that each attend
 *              the compressed cache plus themselves in one pass (what the server does)
 *   one-by-one a first chunk, then every later token through the decode path on its own (what
 *              the server did for later chunks before session 7; --no-one-by-one skips it)
 * Prints one line per mode (seconds, prompt tokens per second, the ratio to whole) and how far
 * the last token's logits are from the whole prefill's (max |diff| / max |logit|, and whether
 * the greedy pick is the same). Prompt ids are pseudo-random (fixed seed): the timing does not
 * depend on the text. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/ops.h"
#include "kvstore/clock.h"
#include "kvstore/kv_cache.h"
#include "kvstore/numarg.h"
#include "worker/model.h"

#ifndef STRATA_DEFAULT_MODEL
#define STRATA_DEFAULT_MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#endif

enum { BLOCK_TOKENS = 64 };

static void usage(FILE *f)
{
    fprintf(f,
            "usage: strata-bench-prefill [--model PATH] [--prompt-tokens N] [--chunk N] [--kv CODEC]\n"
            "                            [--threads N] [--no-one-by-one]\n"
            "\n"
            "Prefills one prompt of --prompt-tokens (default 1024) pseudo-random token ids three ways on\n"
            "the CPU: whole, in chunks of --chunk (default 256) that each attend the compressed cache in\n"
            "one pass, and a first chunk followed by one token at a time (the decode path). Prints the\n"
            "seconds and tokens/s of each, the ratio to whole, and how close each one's last logits are\n"
            "to the whole prefill's.\n"
            "  --model PATH     GGUF model (default: $STRATA_MODEL, else %s)\n"
            "  --kv CODEC       KV codec of every layer (default kivi2), as strata generate --kv\n"
            "  --threads N      BLAS threads (default: OpenBLAS's)\n"
            "  --no-one-by-one  skip the one-token-at-a-time mode (the slow one)\n",
            STRATA_DEFAULT_MODEL);
}

static bool parse_size(const char *flag, const char *s, long lo, long hi, size_t *out)
{
    long v;
    if (!strata_parse_long("strata-bench-prefill", flag, s, lo, hi, &v))
        return false;
    *out = (size_t)v;
    return true;
}

typedef struct mode_result {
    double seconds;
    float *last;   /* the last token's logits */
} mode_result;

/* chunk 0: whole; one_by_one: tokens after the first chunk go one at a time. */
static int run_mode(model *m, kv_pool *pool, const int32_t *ids, size_t n, size_t chunk, bool one_by_one,
                    mode_result *r, strata_error *err)
{
    kv_seq *s = kv_seq_create(pool, n, err);
    if (!s)
        return err->code;
    const double t0 = strata_mono_s();
    int rc = STRATA_OK;
    for (size_t at = 0; at < n && rc == STRATA_OK;) {
        size_t len = chunk == 0 ? n : (at > 0 && one_by_one ? 1 : (n - at < chunk ? n - at : chunk));
        rc = model_forward(m, s, ids + at, len, at, at + len == n ? r->last : NULL, false, err);
        at += len;
    }
    r->seconds = strata_mono_s() - t0;
    kv_seq_destroy(s);
    return rc;
}

int main(int argc, char **argv)
{
    const char *path = getenv("STRATA_MODEL") ? getenv("STRATA_MODEL") : STRATA_DEFAULT_MODEL;
    const char *codec_name = "kivi2";
    size_t n = 1024, chunk = 256, threads = 0;
    bool one_by_one = true;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--no-one-by-one")) {
            one_by_one = false;
        } else if (!v) {
            fprintf(stderr, "strata-bench-prefill: unknown option or missing value: %s\n", a);
            usage(stderr);
            return 2;
        } else if (!strcmp(a, "--model")) {
            path = v, i++;
        } else if (!strcmp(a, "--kv")) {
            codec_name = v, i++;
        } else if (!strcmp(a, "--prompt-tokens") || !strcmp(a, "--chunk") || !strcmp(a, "--threads")) {
            const bool ok = a[2] == 'p'   ? parse_size(a, v, 2, 1L << 20, &n)
                            : a[2] == 'c' ? parse_size(a, v, 1, 1L << 20, &chunk)
                                          : parse_size(a, v, 1, 1024, &threads);
            if (!ok)
                return 2;
            i++;
        } else {
            fprintf(stderr, "strata-bench-prefill: bad option or value: %s %s\n", a, v);
            usage(stderr);
            return 2;
        }
    }
    if (chunk >= n) {
        fprintf(stderr, "strata-bench-prefill: --chunk (%zu) must be below --prompt-tokens (%zu)\n", chunk, n);
        return 2;
    }
    if (threads)
        kern_set_threads((int)threads);

    strata_error err = {0};
    model *m = model_load(path, 0, -1, &err);
    if (!m) {
        fprintf(stderr, "strata-bench-prefill: %s\n", err.msg);
        return 1;
    }
    const model_config *c = model_get_config(m);
    if (n > (size_t)c->n_ctx_train) {
        fprintf(stderr, "strata-bench-prefill: --prompt-tokens %zu is over the model's context (%d)\n", n, c->n_ctx_train);
        model_free(m);
        return 2;
    }
    kv_codec_params codec;
    const kv_geometry g = model_kv_geometry(m, BLOCK_TOKENS);
    if (kv_codec_parse(codec_name, &codec, &err) != STRATA_OK || kv_codec_validate(&codec, &g, &err) != STRATA_OK) {
        fprintf(stderr, "strata-bench-prefill: --kv %s: %s\n", codec_name, err.msg);
        model_free(m);
        return 2;
    }
    kv_pool *pool = kv_pool_create(&g, &codec, (size_t)g.n_layers * (n / BLOCK_TOKENS + 2), &err);
    const size_t nv = (size_t)c->n_vocab;
    int32_t *ids = malloc(n * sizeof *ids);
    mode_result res[3] = {{0, malloc(nv * sizeof(float))}, {0, malloc(nv * sizeof(float))},
                          {0, malloc(nv * sizeof(float))}};
    int rc = pool && ids && res[0].last && res[1].last && res[2].last ? STRATA_OK : STRATA_ENOMEM;
    if (rc != STRATA_OK && pool)
        strata_fail(&err, rc, "out of memory");
    uint32_t x = 12345u;
    for (size_t i = 0; ids && i < n; i++) {
        x = x * 1664525u + 1013904223u;
        ids[i] = (int32_t)(200 + (x >> 8) % (uint32_t)(c->n_vocab - 200));
    }
    const char *names[3] = {"whole", "chunked", "one-by-one"};
    printf("model %s, %zu prompt tokens, kv %s, chunks of %zu\n", path, n, codec_name, chunk);
    for (int k = 0; k < 3 && rc == STRATA_OK; k++) {
        if (k == 2 && !one_by_one)
            break;
        fprintf(stderr, "running %s...\n", names[k]);
        rc = run_mode(m, pool, ids, n, k == 0 ? 0 : chunk, k == 2, &res[k], &err);
        if (rc != STRATA_OK)
            break;
        double diff = 0, mag = 0;
        size_t pick = 0, want = 0;
        for (size_t i = 0; i < nv; i++) {
            diff = fmax(diff, fabs((double)res[k].last[i] - res[0].last[i]));
            mag = fmax(mag, fabs((double)res[0].last[i]));
            pick = res[k].last[i] > res[k].last[pick] ? i : pick;
            want = res[0].last[i] > res[0].last[want] ? i : want;
        }
        printf("%-10s %8.2f s  %8.1f tokens/s  %6.2fx whole's time  last logits vs whole: %.2e, greedy pick %s\n",
               names[k], res[k].seconds, (double)n / res[k].seconds, res[k].seconds / res[0].seconds,
               mag > 0 ? diff / mag : 0.0, pick == want ? "equal" : "differs");
    }
    if (rc != STRATA_OK)
        fprintf(stderr, "strata-bench-prefill: %s\n", err.msg);
    for (int k = 0; k < 3; k++)
        free(res[k].last);
    free(ids);
    kv_pool_destroy(pool);
    model_free(m);
    return rc == STRATA_OK ? 0 : 1;
}
