/* The min-max quantizer and code packing, checked against fp64 arithmetic done here.
 *
 * The bound tested for every element x of a group with stored fp16 scale s and zero z:
 *     |x - (q s + z)| <= s/2 * (1 + 1e-12)      (s > 0),   x == z exactly (s == 0),
 * where the 1e-12 covers only the double evaluation of (x - z)/s inside the quantizer. Because
 * z is rounded down and s up, the stored grid covers the group: z <= min, z + (2^B-1) s >= max
 * (unless the top code would then reconstruct above +65504: the scale stays below that, a few
 * fp16 steps short of the maximum), and the rounding costs at most one fp16 step: min - z <= ulp16(min), and
 * s <= (max - z)/(2^B-1) * (1 + 2^-10) + 2^-24. Against the ideal fp32 parameters this gives
 *     |x - x'| <= (max-min)/(2^B-1)/2 * (1 + 2^-10) + ulp16(min)/2 + 2^-25,
 * which is also checked. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "kvstore/quant.h"
#include "ref_bytes.h"
#include "test_rng.h"

/* fp16 decoding written from the IEEE definition, independent of kvstore/half.h. */

/* Spacing of fp16 numbers around x (normal range), at least the subnormal step. */
static double ulp16(double x)
{
    double a = fabs(x);
    if (a < 0x1p-14)
        return 0x1p-24;
    int e;
    frexp(a, &e);             /* a = f * 2^e, f in [0.5, 1) */
    return ldexp(1.0, e - 11);
}

typedef struct qstats {
    double worst_ratio;       /* max |x - x'| / (s/2) */
    long groups, elements;
} qstats;

static void check_group(const float *x, size_t n, int bits, qstats *st)
{
    uint32_t codes[256];
    kv_qgroup g;
    kv_quant_group(x, n, 1, bits, &g, codes);
    const double qmax = (double)((1 << bits) - 1);
    double z = ref_half(g.zero_h), s = ref_half(g.scale_h);
    assert_true((double)g.zero == z && (double)g.scale == s);
    double mn = x[0], mx = x[0];
    for (size_t i = 1; i < n; i++) {
        mn = fmin(mn, x[i]);
        mx = fmax(mx, x[i]);
    }
    assert_true(z <= mn);
    /* The grid covers the maximum, except where that would take the top code past +65504: then
     * one more fp16 step of the scale would cross it. */
    assert_true(z + qmax * s >= mx || z + qmax * (s + ulp16(s)) > 65504.0);
    assert_true(mn - z <= ulp16(mn));
    assert_true(s <= (mx - z) / qmax * (1.0 + 0x1p-10) + 0x1p-24);
    double ideal = (mx - mn) / qmax;
    for (size_t i = 0; i < n; i++) {
        assert_true(codes[i] <= (uint32_t)qmax);
        double xr = codes[i] * s + z;
        double e = fabs((double)x[i] - xr);
        if (s == 0.0) {
            assert_true(codes[i] == 0 && e == 0.0);
        } else {
            assert_true(e <= s / 2 * (1.0 + 1e-12));
            if (e / (s / 2) > st->worst_ratio)
                st->worst_ratio = e / (s / 2);
        }
        assert_true(e <= ideal / 2 * (1.0 + 0x1p-10) + ulp16(mn) / 2 + 0x1p-25);
        st->elements++;
    }
    st->groups++;
}

static void test_round_trip_distributions(void **state)
{
    (void)state;
    uint64_t rs = 7;
    float x[256];
    for (int bits = 2; bits <= 4; bits += 2) {
        qstats st = {0};
        for (int kind = 0; kind < 7; kind++)
            for (int rep = 0; rep < 400; rep++) {
                size_t n = (rep % 3 == 0) ? 64 : 32;
                double scale = pow(10.0, (double)(rep % 9) - 4.0);   /* 1e-4 .. 1e4 */
                for (size_t i = 0; i < n; i++) {
                    double v;
                    switch (kind) {
                    case 0: v = rng_normal(&rs) * scale; break;
                    case 1: v = (rng_uniform(&rs) * 2 - 1) * scale; break;
                    case 2: v = rng_normal(&rs) * scale * (rng_next(&rs) % 16 == 0 ? 60.0 : 1.0); break;
                    case 3: v = 1.0 + rng_uniform(&rs) * 1e-6;  break;  /* range below one fp16 step */
                    case 4: v = (rng_uniform(&rs) * 2 - 1) * 65000.0; break;  /* near the fp16 limit */
                    case 5: v = -3.0 + (double)(rng_next(&rs) % 8) * 0.25; break;  /* on the grid */
                    default: v = rng_normal(&rs) * 1e-6; break;         /* subnormal fp16 range */
                    }
                    /* the cache only quantizes fp16 numbers; beyond +-65504 they are inf */
                    x[i] = (float)fmax(-65000.0, fmin(65000.0, v));
                }
                check_group(x, n, bits, &st);
            }
        printf("  %d-bit: %ld groups, %ld elements, worst |x - x'| = %.9f * s/2\n", bits, st.groups, st.elements,
               st.worst_ratio);
        assert_true(st.worst_ratio > 0.9);   /* the bound is attained, i.e. tight, not vacuous */
    }
}

/* Groups reaching the fp16 limits: every code's reconstruction z + code * s stays within
 * +-65504, so a reader computing in fp16 (the tensor-core kernel) gets no inf, and the half-step
 * bound still holds (check_group). */
static void test_fp16_limits_reconstruct_finite(void **state)
{
    (void)state;
    static const float ends[][2] = {{-65504.0f, 65504.0f}, {0.0f, 65504.0f}, {-65504.0f, 0.0f},
                                    {-1.0f, 65504.0f}, {65000.0f, 65504.0f}, {-3.0f, 65472.0f}};
    float x[32];
    for (int bits = 2; bits <= 8; bits *= 2)
        for (size_t k = 0; k < sizeof ends / sizeof ends[0]; k++) {
            for (int i = 0; i < 32; i++)
                x[i] = ends[k][0] + (ends[k][1] - ends[k][0]) * (float)(i % 17) / 16.0f;
            uint32_t codes[32];
            kv_qgroup g;
            kv_quant_group(x, 32, 1, bits, &g, codes);
            const double top = ref_half(g.zero_h) + (double)((1u << bits) - 1u) * ref_half(g.scale_h);
            if (!(top <= 65504.0))
                fail_msg("%d bits, [%g, %g]: the top code reconstructs to %.1f", bits, ends[k][0], ends[k][1], top);
            if (bits <= 4) {
                qstats st = {0};
                check_group(x, 32, bits, &st);
            }
        }
}

static void test_constant_groups_exact(void **state)
{
    (void)state;
    /* all fp16 numbers, so the stored zero can equal them */
    const double values[] = {0.0, -0.0, 1.0, -2.5, 1024.0, 0x1p-24, -0x1p-20, 65504.0, -65504.0, 3.140625};
    float x[32];
    for (int bits = 2; bits <= 4; bits += 2)
        for (size_t k = 0; k < sizeof values / sizeof values[0]; k++) {
            for (int i = 0; i < 32; i++)
                x[i] = (float)values[k];
            uint32_t codes[32];
            kv_qgroup g;
            kv_quant_group(x, 32, 1, bits, &g, codes);
            assert_int_equal(g.scale_h & 0x7fff, 0);
            assert_true(ref_half(g.zero_h) == values[k]);
            for (int i = 0; i < 32; i++)
                assert_int_equal(codes[i], 0);
            qstats st = {0};
            check_group(x, 32, bits, &st);
        }
}

static void test_strided_fit(void **state)
{
    (void)state;
    /* a channel of a [token][channel] matrix: stride 8 */
    float m[32 * 8];
    for (int t = 0; t < 32; t++)
        for (int c = 0; c < 8; c++)
            m[t * 8 + c] = (c == 3) ? (float)t : 1000.0f;
    kv_qgroup g;
    uint32_t codes[32];
    kv_quant_group(m + 3, 32, 8, 2, &g, codes);
    assert_true(ref_half(g.zero_h) == 0.0);
    assert_true(ref_half(g.scale_h) >= 31.0 / 3.0);
    assert_int_equal(codes[0], 0);
    assert_int_equal(codes[31], 3);
}

static void test_non_finite_inputs(void **state)
{
    (void)state;
    float x[32];
    for (int i = 0; i < 32; i++)
        x[i] = (float)i;
    x[5] = NAN;
    uint32_t codes[32];
    kv_qgroup g;
    kv_quant_group(x, 32, 1, 2, &g, codes);
    assert_true(isnan(g.scale) && isnan(g.zero));
    for (int i = 0; i < 32; i++)
        assert_int_equal(codes[i], 0);
    x[5] = INFINITY;
    kv_quant_group(x, 32, 1, 4, &g, codes);
    assert_true(isnan(g.scale));
    x[5] = 1e30f;   /* finite in fp32, beyond fp16: parameters overflow, codes stay in range */
    kv_quant_group(x, 32, 1, 4, &g, codes);
    for (int i = 0; i < 32; i++)
        assert_true(codes[i] <= 15);
}

/* Hand-derived words: code i at bit (i % (32/B)) * B of word i / (32/B), LSB first. */
static void test_packing_golden(void **state)
{
    (void)state;
    uint32_t c2[32], c4[16];
    for (int i = 0; i < 32; i++)
        c2[i] = (uint32_t)(i % 4);        /* 0,1,2,3 -> bits 00 01 10 11 from the bottom: 0xE4 per byte */
    c2[16] = 3;                           /* word 1, bits 0-1 */
    c2[31] = 1;                           /* word 1, bits 30-31 */
    for (int i = 0; i < 16; i++)
        c4[i] = (uint32_t)(i < 8 ? i : 15 - (i - 8));
    uint8_t p2[8], p4[8];
    kv_pack_codes(c2, 32, 2, p2);
    kv_pack_codes(c4, 16, 4, p4);
    const uint8_t want2[8] = {0xe4, 0xe4, 0xe4, 0xe4, 0xe7, 0xe4, 0xe4, 0x64};
    const uint8_t want4[8] = {0x10, 0x32, 0x54, 0x76, 0xef, 0xcd, 0xab, 0x89};
    assert_memory_equal(p2, want2, 8);
    assert_memory_equal(p4, want4, 8);
    float f[32];
    kv_unpack_codes_f32(p2, 32, 2, f);
    for (int i = 0; i < 32; i++) {
        assert_int_equal(kv_packed_code(p2, (size_t)i, 2), c2[i]);
        assert_true(f[i] == (float)c2[i]);
    }
    kv_unpack_codes_f32(p4, 16, 4, f);
    for (int i = 0; i < 16; i++) {
        assert_int_equal(kv_packed_code(p4, (size_t)i, 4), c4[i]);
        assert_true(f[i] == (float)c4[i]);
    }
}

static void test_half_steps(void **state)
{
    (void)state;
    assert_int_equal(kv_half_next_up(0x0000), 0x0001);
    assert_int_equal(kv_half_next_up(0x8000), 0x0001);
    assert_int_equal(kv_half_next_down(0x0000), 0x8001);
    assert_int_equal(kv_half_next_up(0x3c00), 0x3c01);     /* 1.0 -> 1.0009765625 */
    assert_int_equal(kv_half_next_down(0x3c00), 0x3bff);
    assert_int_equal(kv_half_next_up(0xbc00), 0xbbff);     /* -1.0 -> -0.99951171875 */
    assert_int_equal(kv_half_next_down(0xbc00), 0xbc01);
    assert_int_equal(kv_half_next_up(0x8001), 0x8000);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip_distributions),
        cmocka_unit_test(test_fp16_limits_reconstruct_finite),
        cmocka_unit_test(test_constant_groups_exact),
        cmocka_unit_test(test_strided_fit),
        cmocka_unit_test(test_non_finite_inputs),
        cmocka_unit_test(test_packing_golden),
        cmocka_unit_test(test_half_steps),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
