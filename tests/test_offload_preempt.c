/* Preemption by spill on the real model: sequence A runs in a device pool far smaller than its
 * KV, is spilled (blocks and fp16 tail to the host arena and NVMe) while sequence B runs in the
 * same pool, then resumes; its greedy tokens equal those of A run alone with an unconstrained
 * pool, token for token, for fp16, kivi2, gear2 and the tada plan. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvstore/plan.h"
#include "offload/kv_tiers.h"
#include "worker/model.h"
#include "test_dir.h"

static model *the_model;

static int32_t argmax(const float *x, int n)
{
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return best;
}

/* Runs the prompt (when the sequence is empty) or continues, n greedy tokens into out[]. */
static void decode(kv_seq *seq, const int32_t *prompt, size_t n_prompt, int32_t *out, size_t first, size_t n)
{
    const model_config *c = model_get_config(the_model);
    float *logits = malloc((size_t)c->n_vocab * sizeof *logits);
    assert_non_null(logits);
    strata_error err = {0};
    size_t pos = kv_seq_length(seq, 0);
    if (pos == 0) {
        if (model_forward(the_model, seq, prompt, n_prompt, 0, logits, false, &err) != STRATA_OK)
            fail_msg("prefill: %s", err.msg);
        out[first] = argmax(logits, c->n_vocab);
        pos = n_prompt;
        first++;
        n--;
    }
    for (size_t i = 0; i < n; i++) {
        int32_t t = out[first + i - 1];
        if (model_forward(the_model, seq, &t, 1, pos++, logits, false, &err) != STRATA_OK)
            fail_msg("decode: %s", err.msg);
        out[first + i] = argmax(logits, c->n_vocab);
    }
    free(logits);
}

static kv_pool *pool_for(const char *spec, size_t blocks_per_layer)
{
    kv_geometry g = model_kv_geometry(the_model, 64);
    kv_codec_params *plan = malloc((size_t)g.n_layers * sizeof *plan);
    strata_error err = {0};
    assert_non_null(plan);
    assert_int_equal(kv_plan_parse(spec, g.n_layers, plan, &err), STRATA_OK);
    kv_pool *p = kv_pool_create_plan(&g, plan, blocks_per_layer, &err);
    free(plan);
    if (!p)
        fail_msg("%s", err.msg);
    return p;
}

#define TOTAL 16
#define BEFORE 6

static void run_codec(const char *spec)
{
    /* A prompt long enough for several blocks per layer (kivi: residual 128 + 64-token blocks). */
    int32_t prompt_a[260], prompt_b[150];
    for (size_t i = 0; i < 260; i++)
        prompt_a[i] = (int32_t)(1 + (i * 7919) % 40000);
    for (size_t i = 0; i < 150; i++)
        prompt_b[i] = (int32_t)(1 + (i * 104729) % 40000);
    strata_error err = {0};

    int32_t want[TOTAL], got[TOTAL], b_out[16];
    kv_pool *big = pool_for(spec, 8);
    kv_seq *alone = kv_seq_create(big, 512, &err);
    decode(alone, prompt_a, 260, want, 0, TOTAL);
    kv_seq_destroy(alone);
    kv_pool_destroy(big);

    char base[64], dir[128];
    snprintf(base, sizeof base, "/tmp/strata-preempt-XXXXXX");
    assert_non_null(mkdtemp(base));
    snprintf(dir, sizeof dir, "%s/spill", base);
    kv_tiers_options to = {.host_bytes = 1024 * 1024, .nvme_dir = dir, .nvme_bytes = 64u << 20};
    kv_tiers *tiers = kv_tiers_create(&to, &err);
    if (!tiers)
        fail_msg("%s", err.msg);
    kv_pool *small = pool_for(spec, 2);   /* 60 slots for ~5 blocks x 30 layers per sequence */
    kv_lower_tier lower = kv_tiers_lower(tiers);
    assert_int_equal(kv_pool_set_lower_tier(small, &lower, &err), STRATA_OK);
    kv_seq *a = kv_seq_create(small, 512, &err), *b = kv_seq_create(small, 512, &err);
    assert_non_null(a);
    assert_non_null(b);
    decode(a, prompt_a, 260, got, 0, BEFORE);
    if (kv_seq_spill(a, &err) != STRATA_OK)
        fail_msg("spill: %s", err.msg);
    decode(b, prompt_b, 150, b_out, 0, 16);
    if (kv_seq_resume(a, &err) != STRATA_OK)
        fail_msg("resume: %s", err.msg);
    decode(a, prompt_a, 260, got, BEFORE, TOTAL - BEFORE);
    for (int i = 0; i < TOTAL; i++)
        if (got[i] != want[i])
            fail_msg("%s: token %d: %d after spill/resume, %d alone", spec, i, got[i], want[i]);

    kv_pool_stats ps;
    kv_pool_get_stats(small, &ps);
    kv_tiers_stats ts;
    kv_tiers_get_stats(tiers, &ts);
    print_message("%-6s: %d tokens equal; pool %zu slots, %llu evictions, %llu fetches; nvme %llu spills, "
                  "%llu restores\n", spec, TOTAL, ps.slots, (unsigned long long)ps.evictions,
                  (unsigned long long)ps.fetches, (unsigned long long)ts.spills, (unsigned long long)ts.restores);
    assert_int_equal(ps.seq_spills, 1);
    assert_true(ps.evictions > 0 && ps.fetches > 0);
    assert_true(ts.spills > 0 && ts.restores > 0);
    assert_int_equal(ts.crc_failures, 0);
    kv_seq_destroy(a);
    kv_seq_destroy(b);
    kv_pool_destroy(small);
    kv_tiers_destroy(tiers);
    test_dir_remove_tree(base);
}

static void test_preempt_each_codec(void **state)
{
    (void)state;
    /* fp16 (no residual window), a KIVI backbone, and the codecs with extra sections; the tiers
     * move every codec's bytes alike (test_offload_kvtier covers each codec's blocks). */
    const char *specs[] = {"fp16", "kivi2", "gear2", "tada"};
    /* Under the sanitizers (STRATA_SANITIZED=1, about 10x slower) two of them: the spill and
     * resume paths are the same for every codec; the per-codec equality is the normal build's. */
    const char *sanitized = getenv("STRATA_SANITIZED");
    size_t n = sanitized && !strcmp(sanitized, "1") ? 2 : sizeof specs / sizeof *specs;
    for (size_t i = 0; i < n; i++)
        run_codec(specs[i + (n == 2 ? 1 : 0)]);   /* kivi2 and gear2 */
}

static int setup(void **state)
{
    (void)state;
    strata_error err = {0};
    const char *path = getenv("STRATA_MODEL") ? getenv("STRATA_MODEL") : STRATA_DEFAULT_MODEL;
    the_model = model_load(path, 0, -1, &err);
    if (!the_model) {
        print_error("cannot load %s: %s (run scripts/setup.sh)\n", path, err.msg);
        return -1;
    }
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    model_free(the_model);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_preempt_each_codec),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
