/* Causal prefill attention (kern_attention_causal in kernels/cpu/ops.c) against a
 * straightforward fp64 implementation written here: random q/k/v, several prompt lengths
 * around the kernel's tile boundaries, GQA and plain multi-head shapes. The two may differ only
 * by fp32 rounding and summation order: max |out - ref| / max |ref| <= 1e-4. Scratch is
 * allocated at exactly kern_attention_causal_scratch(n) floats so that the sanitizer build
 * catches an overrun, and out starts as NaN so that an unwritten entry fails. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/ops.h"
#include "test_rng.h"

/* out[n][nq][d] in fp64: query i of head h attends to keys 0..i of kv head h / (nq / nkv). */
static void ref_attention(const float *q, const float *k, const float *v, size_t n, size_t nq,
                          size_t nkv, size_t d, double *out)
{
    double *s = malloc(n * sizeof *s);
    assert_non_null(s);
    const size_t group = nq / nkv;
    for (size_t i = 0; i < n; i++) {
        for (size_t h = 0; h < nq; h++) {
            const float *qi = q + (i * nq + h) * d;
            const size_t kh = h / group;
            double mx = -INFINITY;
            for (size_t j = 0; j <= i; j++) {
                const float *kj = k + (j * nkv + kh) * d;
                double dot = 0.0;
                for (size_t c = 0; c < d; c++)
                    dot += (double)qi[c] * (double)kj[c];
                s[j] = dot / sqrt((double)d);
                if (s[j] > mx)
                    mx = s[j];
            }
            double sum = 0.0;
            for (size_t j = 0; j <= i; j++) {
                s[j] = exp(s[j] - mx);
                sum += s[j];
            }
            double *o = out + (i * nq + h) * d;
            for (size_t c = 0; c < d; c++)
                o[c] = 0.0;
            for (size_t j = 0; j <= i; j++) {
                const float *vj = v + (j * nkv + kh) * d;
                for (size_t c = 0; c < d; c++)
                    o[c] += s[j] / sum * (double)vj[c];
            }
        }
    }
    free(s);
}

/* Runs one shape; q and k entries ~ N(0, amp^2), so scores have a spread of about amp^2. */
static void check_shape(size_t n, size_t nq, size_t nkv, size_t d, double amp, uint64_t seed)
{
    const size_t qn = n * nq * d, kvn = n * nkv * d;
    float *q = malloc(qn * sizeof *q), *k = malloc(kvn * sizeof *k), *v = malloc(kvn * sizeof *v);
    float *out = malloc(qn * sizeof *out);
    double *ref = malloc(qn * sizeof *ref);
    const size_t ns = kern_attention_causal_scratch(n);
    assert_true(ns >= n);
    float *scratch = malloc(ns * sizeof *scratch);
    assert_true(q && k && v && out && ref && scratch);

    uint64_t rng = seed;
    for (size_t i = 0; i < qn; i++)
        q[i] = (float)(amp * rng_normal(&rng));
    for (size_t i = 0; i < kvn; i++) {
        k[i] = (float)(amp * rng_normal(&rng));
        v[i] = (float)rng_normal(&rng);
    }
    for (size_t i = 0; i < qn; i++)
        out[i] = NAN;

    kern_attention_causal(q, k, v, n, nq, nkv, d, out, scratch);
    ref_attention(q, k, v, n, nq, nkv, d, ref);

    double max_err = 0.0, max_ref = 0.0;
    for (size_t i = 0; i < qn; i++) {
        if (!isfinite(out[i]))
            fail_msg("n=%zu nq=%zu nkv=%zu d=%zu: out[%zu] = %g is not finite", n, nq, nkv, d, i,
                     (double)out[i]);
        double e = fabs((double)out[i] - ref[i]);
        if (e > max_err)
            max_err = e;
        if (fabs(ref[i]) > max_ref)
            max_ref = fabs(ref[i]);
    }
    const double rel = max_err / max_ref;
    if (!(rel <= 1e-4))
        fail_msg("n=%zu nq=%zu nkv=%zu d=%zu amp=%g: max |out - ref| / max |ref| = %.3g > 1e-4", n,
                 nq, nkv, d, amp, rel);
    /* Row 0 sees only key 0: its output is v[0] of its kv head exactly up to rounding. */
    for (size_t h = 0; h < nq; h++)
        for (size_t c = 0; c < d; c++)
            assert_true(fabs(out[h * d + c] - v[(h / (nq / nkv)) * d + c]) <= 1e-6);

    free(q);
    free(k);
    free(v);
    free(out);
    free(ref);
    free(scratch);
}

static const size_t lengths[] = {1, 2, 63, 64, 65, 127, 128, 129, 257, 600};
enum { N_LENGTHS = sizeof lengths / sizeof lengths[0] };

static void test_gqa_9_3_d64(void **state)
{
    (void)state;
    for (size_t i = 0; i < N_LENGTHS; i++)
        check_shape(lengths[i], 9, 3, 64, 1.5, 0x1234 + i);
}

static void test_mha_4_4_d32(void **state)
{
    (void)state;
    for (size_t i = 0; i < N_LENGTHS; i++)
        check_shape(lengths[i], 4, 4, 32, 1.5, 0xabcd + i);
}

/* Sharp scores (spread ~ amp^2 = 16 and 36): exp would overflow without the max subtraction. */
static void test_sharp_scores(void **state)
{
    (void)state;
    check_shape(257, 9, 3, 64, 4.0, 77);
    check_shape(65, 4, 4, 32, 6.0, 78);
}

static void test_scratch_size(void **state)
{
    (void)state;
    assert_true(kern_attention_causal_scratch(0) >= 1);
    for (size_t n = 1; n < 5000; n = n * 3 + 1) {
        const size_t ns = kern_attention_causal_scratch(n);
        assert_true(ns >= n);
        assert_true(ns <= n * n);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scratch_size),
        cmocka_unit_test(test_gqa_9_3_d64),
        cmocka_unit_test(test_mha_4_4_d32),
        cmocka_unit_test(test_sharp_scores),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
