/* Sampler: greedy is argmax, a seed reproduces its tokens, and sampled frequencies follow the
 * top-k / temperature / top-p distribution computed here in double precision. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "worker/sampler.h"

enum { V = 12 };
static const float logits[V] = {1.0f, 3.0f, 0.5f, 2.5f, -1.0f, 2.9f, 0.0f, -3.0f, 1.5f, 2.0f, -0.5f, 0.2f};

static sampler *make(float temp, int top_k, float top_p, uint64_t seed)
{
    sampler_params p = {.temperature = temp, .top_k = top_k, .top_p = top_p, .seed = seed};
    strata_error err = {0};
    sampler *s = sampler_create(&p, V, &err);
    assert_non_null(s);
    return s;
}

static void test_greedy_is_argmax(void **state)
{
    (void)state;
    sampler *s = make(0.0f, 0, 1.0f, 1);
    for (int i = 0; i < 10; i++)
        assert_int_equal(sampler_sample(s, logits), 1);
    sampler_free(s);
    s = make(5.0f, 1, 1.0f, 1); /* top-k 1 is greedy at any temperature */
    assert_int_equal(sampler_sample(s, logits), 1);
    sampler_free(s);
}

static void test_same_seed_same_tokens(void **state)
{
    (void)state;
    sampler *a = make(1.0f, 0, 1.0f, 1234), *b = make(1.0f, 0, 1.0f, 1234), *c = make(1.0f, 0, 1.0f, 99);
    int same_ab = 0, same_ac = 0;
    for (int i = 0; i < 200; i++) {
        int32_t x = sampler_sample(a, logits), y = sampler_sample(b, logits), z = sampler_sample(c, logits);
        same_ab += x == y;
        same_ac += x == z;
    }
    assert_int_equal(same_ab, 200);
    assert_true(same_ac < 200); /* a different seed gives a different stream */
    sampler_free(a);
    sampler_free(b);
    sampler_free(c);
}

/* Expected probabilities: keep the top_k largest logits, softmax at temperature, then keep the
 * smallest prefix (by probability) reaching top_p, renormalized. */
static void expected_distribution(float temp, int top_k, float top_p, double *p)
{
    int order[V];
    for (int i = 0; i < V; i++)
        order[i] = i;
    for (int i = 0; i < V; i++)
        for (int j = i + 1; j < V; j++)
            if (logits[order[j]] > logits[order[i]]) {
                int t = order[i];
                order[i] = order[j];
                order[j] = t;
            }
    int n = top_k > 0 && top_k < V ? top_k : V;
    double sum = 0;
    for (int i = 0; i < V; i++)
        p[i] = 0;
    for (int i = 0; i < n; i++)
        sum += p[order[i]] = exp((double)logits[order[i]] / temp);
    double cum = 0;
    int keep = n;
    for (int i = 0; i < n; i++) {
        cum += p[order[i]] / sum;
        if (cum >= top_p) {
            keep = i + 1;
            break;
        }
    }
    double kept = 0;
    for (int i = 0; i < V; i++) {
        int rank = 0;
        while (order[rank] != i)
            rank++;
        if (rank >= keep)
            p[i] = 0;
        kept += p[i];
    }
    for (int i = 0; i < V; i++)
        p[i] /= kept;
}

static void check_frequencies(float temp, int top_k, float top_p)
{
    enum { DRAWS = 200000 };
    double want[V];
    expected_distribution(temp, top_k, top_p, want);
    sampler *s = make(temp, top_k, top_p, 7);
    long count[V] = {0};
    for (int i = 0; i < DRAWS; i++)
        count[sampler_sample(s, logits)]++;
    sampler_free(s);
    for (int i = 0; i < V; i++) {
        double got = (double)count[i] / DRAWS;
        /* 5 standard deviations of a binomial proportion, plus a hair */
        double tol = 5.0 * sqrt(want[i] * (1.0 - want[i]) / DRAWS) + 1e-4;
        if (fabs(got - want[i]) > tol)
            fail_msg("T=%g k=%d p=%g: token %d drawn %.5f of the time, expected %.5f (tol %.5f)",
                     (double)temp, top_k, (double)top_p, i, got, want[i], tol);
        if (want[i] == 0.0 && count[i] != 0)
            fail_msg("token %d is outside top-k/top-p but was drawn %ld times", i, count[i]);
    }
}

static void test_distributions(void **state)
{
    (void)state;
    check_frequencies(1.0f, 0, 1.0f);
    check_frequencies(0.5f, 0, 1.0f);
    check_frequencies(2.0f, 4, 1.0f);
    check_frequencies(1.0f, 0, 0.6f);
    check_frequencies(0.8f, 6, 0.9f);
}

/* sampler_sample is sampler_pick with the PRNG's next draw, drawn only when not greedy; and the
 * pick walks the sorted order: a draw just below a token's cumulative boundary picks it, just
 * above picks the next (ties in logit go to the lower id). */
static void test_pick_is_sample_with_draw(void **state)
{
    (void)state;
    sampler_params ps[] = {{1.0f, 0, 1.0f, 7}, {0.7f, 5, 1.0f, 8}, {1.3f, 0, 0.8f, 9}, {0.0f, 0, 1.0f, 10}};
    void *scratch = malloc(SAMPLER_SCRATCH_BYTES(V));
    assert_non_null(scratch);
    for (size_t k = 0; k < sizeof ps / sizeof ps[0]; k++) {
        strata_error err = {0};
        sampler *a = sampler_create(&ps[k], V, &err), *b = sampler_create(&ps[k], V, &err);
        assert_non_null(a);
        assert_non_null(b);
        assert_int_equal(sampler_params_greedy(sampler_get_params(a)), ps[k].temperature == 0.0f);
        for (int i = 0; i < 100; i++) {
            double u = sampler_params_greedy(&ps[k]) ? 0.5 : sampler_next_draw(b);
            assert_int_equal(sampler_sample(a, logits), sampler_pick(&ps[k], logits, V, u, scratch));
        }
        sampler_free(a);
        sampler_free(b);
    }
    /* Two tied logits (ids 2 and 5) and weights 1 (ids 2, 5) and e^-1 elsewhere at T = 1. */
    float tied[V];
    for (int i = 0; i < V; i++)
        tied[i] = i == 2 || i == 5 ? 1.0f : 0.0f;
    sampler_params p = {1.0f, 0, 1.0f, 0};
    double w = exp(-1.0), sum = 2.0 + (V - 2) * (double)expf(-1.0f);
    assert_int_equal(sampler_pick(&p, tied, V, 0.0, scratch), 2);
    assert_int_equal(sampler_pick(&p, tied, V, 0.999 / sum, scratch), 2);
    assert_int_equal(sampler_pick(&p, tied, V, 1.001 / sum, scratch), 5);
    assert_int_equal(sampler_pick(&p, tied, V, 2.001 / sum, scratch), 0);
    assert_int_equal(sampler_pick(&p, tied, V, (2.0 + w + 0.001) / sum, scratch), 1);
    assert_int_equal(sampler_pick(&p, tied, V, 0.999999999, scratch), V - 1);
    free(scratch);
}

/* A sampler skipped past n sampled tokens picks what one that sampled them picks next; greedy
 * parameters take no draw, so skipping changes nothing for them. */
static void test_skip_sampled(void **state)
{
    (void)state;
    sampler_params ps[] = {{0.9f, 0, 1.0f, 11}, {0.6f, 8, 0.95f, 12}, {0.0f, 0, 1.0f, 13}};
    for (size_t k = 0; k < sizeof ps / sizeof ps[0]; k++) {
        for (uint64_t n = 0; n < 40; n += 13) {
            strata_error err = {0};
            sampler *ran = sampler_create(&ps[k], V, &err), *skipped = sampler_create(&ps[k], V, &err);
            assert_non_null(ran);
            assert_non_null(skipped);
            for (uint64_t i = 0; i < n; i++)
                (void)sampler_sample(ran, logits);
            sampler_skip_sampled(skipped, n);
            for (int i = 0; i < 20; i++)
                assert_int_equal(sampler_sample(skipped, logits), sampler_sample(ran, logits));
            uint8_t a[SAMPLER_STATE_BYTES], b[SAMPLER_STATE_BYTES];
            sampler_save(ran, a);
            sampler_save(skipped, b);
            assert_memory_equal(a, b, sizeof a);
            sampler_free(ran);
            sampler_free(skipped);
        }
    }
}

static void test_rejects_bad_params(void **state)
{
    (void)state;
    strata_error err = {0};
    sampler_params bad[] = {
        {.temperature = -0.1f, .top_p = 1.0f},
        {.temperature = NAN, .top_p = 1.0f},
        {.temperature = 1.0f, .top_k = -1, .top_p = 1.0f},
        {.temperature = 1.0f, .top_p = 0.0f},
        {.temperature = 1.0f, .top_p = 1.5f},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_null(sampler_create(&bad[i], V, &err));
        assert_int_equal(err.code, STRATA_EINVAL);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_is_argmax),
        cmocka_unit_test(test_same_seed_same_tokens),
        cmocka_unit_test(test_distributions),
        cmocka_unit_test(test_pick_is_sample_with_draw),
        cmocka_unit_test(test_skip_sampled),
        cmocka_unit_test(test_rejects_bad_params),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
