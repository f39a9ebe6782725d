/* The quality evaluation (worker/evaluate.c) on the default model and a real English text
 * (../shared/papers/ott.txt), at a size CI affords:
 *  - the fp16 cache scored against itself: KL exactly 0, top-1 100 %;
 *  - a run that starts from the shared prefill prefix equals a run that prefills itself
 *    (the prefix is an optimization, not an approximation);
 *  - the bytes per token are the block sizes of each codec; per-layer errors are 0 for fp16 and
 *    ordered kivi4 < kivi2 in every layer;
 *  - kivi4 is much closer to fp16 than kivi2 (KL), and a mixed plan runs. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kvstore/kv_cache.h"
#include "kvstore/plan.h"
#include "worker/evaluate.h"
#include "worker/model.h"

enum { PREFILL = 200, TOKENS = 12, BT = 64 };

static model *the_model;
static int32_t *ids;
static size_t n_ids;

static int setup(void **state)
{
    (void)state;
    const char *path = getenv("STRATA_MODEL") ? getenv("STRATA_MODEL") : STRATA_DEFAULT_MODEL;
    strata_error err = {0};
    the_model = model_load(path, 0, -1, &err);
    if (!the_model) {
        fprintf(stderr, "cannot load the default model: %s (run scripts/setup.sh)\n", err.msg);
        return -1;
    }
    const char *text_path = STRATA_SOURCE_DIR "/../shared/papers/ott.txt";
    FILE *f = fopen(text_path, "rb");
    if (!f) {
        fprintf(stderr, "cannot open %s (../shared must sit beside the repository)\n", text_path);
        return -1;
    }
    static char text[16384];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    /* cut at a line end so no UTF-8 sequence is split */
    char *nl = strrchr(text, '\n');
    if (nl)
        nl[1] = 0;
    const tokenizer *tok = model_get_tokenizer(the_model);
    int32_t *body;
    size_t n_body;
    if (tokenizer_encode(tok, text, strlen(text), false, &body, &n_body, &err) != STRATA_OK)
        return -1;
    ids = malloc((n_body + 1) * sizeof *ids);
    ids[0] = tokenizer_bos(tok);
    memcpy(ids + 1, body, n_body * sizeof *body);
    n_ids = n_body + 1;
    free(body);
    return n_ids > PREFILL + TOKENS + 1 ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    model_free(the_model);
    free(ids);
    return 0;
}

static void plan_of(const char *spec, kv_codec_params *plan)
{
    strata_error err = {0};
    if (kv_plan_parse(spec, model_get_config(the_model)->n_layers, plan, &err) != STRATA_OK)
        fail_msg("%s", err.msg);
}

static void run(const char *spec, const eval_prefix *prefix, const eval_reference *ref, eval_reference *keep,
                eval_result *r)
{
    kv_codec_params plan[64];
    plan_of(spec, plan);
    eval_setup setup = {.prefill = PREFILL, .tokens = TOKENS, .block_tokens = BT};
    strata_error err = {0};
    if (eval_run(the_model, plan, ids, n_ids, &setup, prefix, ref, keep, NULL, NULL, r, &err) != STRATA_OK)
        fail_msg("%s: %s", spec, err.msg);
}

static void test_evaluation(void **state)
{
    (void)state;
    const model_config *cfg = model_get_config(the_model);
    strata_error err = {0};
    eval_prefix prefix;
    assert_int_equal(eval_prefix_build(the_model, ids, PREFILL, BT, &prefix, &err), STRATA_OK);

    eval_reference ref;
    eval_result fp16, self, kivi2, kivi2_full, kivi4, mixed;
    run("fp16", &prefix, NULL, &ref, &fp16);
    run("fp16", &prefix, &ref, NULL, &self);
    assert_true(self.kl == 0.0);
    assert_true(self.top1 == 1.0);
    assert_true(self.nll == fp16.nll);

    run("kivi2", &prefix, &ref, NULL, &kivi2);
    run("kivi2", NULL, &ref, NULL, &kivi2_full);   /* prefills itself through model_forward */
    assert_true(kivi2.nll == kivi2_full.nll);
    assert_true(kivi2.kl == kivi2_full.kl);

    run("kivi4", &prefix, &ref, NULL, &kivi4);
    print_message("      KL vs fp16: kivi4 %.5f, kivi2 %.5f; ppl fp16 %.3f kivi4 %.3f kivi2 %.3f\n", kivi4.kl, kivi2.kl,
                  fp16.ppl, kivi4.ppl, kivi2.ppl);
    assert_true(kivi2.kl > 0.0);
    assert_true(kivi4.kl < 0.25 * kivi2.kl);

    /* bytes per token: block sizes summed over layers (fp16 49280, kivi4 15488, kivi2 9344 per 64 tokens) */
    assert_true(fabs(fp16.bytes_per_token - 49280.0 / BT * cfg->n_layers) < 1e-6);
    assert_true(fabs(kivi4.bytes_per_token - 15488.0 / BT * cfg->n_layers) < 1e-6);
    assert_true(fabs(kivi2.bytes_per_token - 9344.0 / BT * cfg->n_layers) < 1e-6);
    /* with R = 128 only the first (200 + 12 - 128) / 64 = 1 block per layer is compressed */
    assert_int_equal(kivi2.block_tokens, 64);
    for (int l = 0; l < cfg->n_layers; l++) {
        assert_true(fp16.layers[l].k_rel == 0.0 && fp16.layers[l].v_rel == 0.0);
        assert_true(kivi4.layers[l].k_rel > 0.0);
        if (!(kivi4.layers[l].k_rel < kivi2.layers[l].k_rel && kivi4.layers[l].v_rel < kivi2.layers[l].v_rel))
            fail_msg("layer %d: kivi4 error %.4f/%.4f not below kivi2 %.4f/%.4f", l, kivi4.layers[l].k_rel,
                     kivi4.layers[l].v_rel, kivi2.layers[l].k_rel, kivi2.layers[l].v_rel);
    }

    /* A window wider than the text: no block forms, and the run differs from fp16 by rounding
     * alone. Its KL is never negative all the same (the float log-probabilities' exp sums to 1
     * only to rounding: it was -2e-9 and printed as -0.000000). */
    eval_result window;
    run("kivi2-r512", &prefix, &ref, NULL, &window);
    print_message("      KL vs fp16, no block formed: %.3g\n", window.kl);
    assert_true(window.kl >= 0.0 && window.kl < 1e-6);
    /* The same made certain: a reference whose probabilities sum to 1 - 1e-6 (every
     * log-probability 1e-6 low) against the fp16 run itself estimates a KL of -1e-6. */
    const size_t n_lp = ref.tokens * (size_t)ref.n_vocab;
    float *exact = malloc(n_lp * sizeof *exact);
    assert_non_null(exact);
    memcpy(exact, ref.logprobs, n_lp * sizeof *exact);
    for (size_t i = 0; i < n_lp; i++)
        ref.logprobs[i] -= 1e-6f;
    eval_result low;
    run("fp16", &prefix, &ref, NULL, &low);
    assert_true(low.kl == 0.0);
    memcpy(ref.logprobs, exact, n_lp * sizeof *exact);
    free(exact);

    run("0-14:kivi4,15-29:kivi2-r64", &prefix, &ref, NULL, &mixed);
    assert_true(mixed.kl > 0.0);
    assert_true(mixed.layers[0].k_rel == kivi4.layers[0].k_rel);

    /* bad setups are refused with a reason */
    kv_codec_params plan[64];
    plan_of("kivi2", plan);
    eval_setup too_long = {.prefill = n_ids, .tokens = 4, .block_tokens = BT};
    eval_result r;
    assert_int_equal(eval_run(the_model, plan, ids, n_ids, &too_long, NULL, NULL, NULL, NULL, NULL, &r, &err),
                     STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "needs"));
    eval_setup other = {.prefill = PREFILL, .tokens = TOKENS + 1, .block_tokens = BT};
    assert_int_equal(eval_run(the_model, plan, ids, n_ids, &other, &prefix, &ref, NULL, NULL, NULL, &r, &err),
                     STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "reference"));

    eval_result *all[] = {&fp16, &self, &kivi2, &kivi2_full, &kivi4, &mixed, &window, &low};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        eval_result_free(all[i]);
    eval_reference_free(&ref);
    eval_prefix_free(&prefix);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_evaluation),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
