/* The CPU matmul and the weights it reads (kernels/ops.h). Rows decoded by kern_weights_rows
 * equal weight_values.h's scalar gguf_value element by element, and kern_matmul_w (kern_matmul
 * for fp32) equals, bit for bit, the documented summation over those values, for every format,
 * batch size, row offset and thread count, including a row length with a remainder after the
 * eight lanes and rows too long for a decoding panel: each row of a batch gets the bits it gets
 * alone, which is what keeps a sequence's logits independent of its batch. ctest runs it twice:
 * with the AVX2 paths and with STRATA_KERNELS_PORTABLE=1. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>
#include <cmocka.h>

#include "kernels/ops.h"
#include "kernels/weight_values.h"
#include "test_rng.h"

/* A finite fp16 of magnitude about 2^lo .. 2^hi (exponent field drawn in that range; 0 gives
 * subnormals), random sign. */
static uint16_t finite_half(uint64_t *s, int lo, int hi)
{
    const uint64_t r = rng_next(s);
    const int e = lo + (int)(r % (uint64_t)(hi - lo + 1));   /* biased exponent, 0..30 */
    return (uint16_t)((r >> 16 & 1) << 15 | (uint64_t)e << 10 | (r >> 20 & 0x3ff));
}

static void put16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

/* rows * in stored elements of type, as a model file could hold them (finite values only). */
static uint8_t *stored_matrix(uint32_t type, size_t rows, size_t in, uint64_t *s)
{
    const size_t bytes = rows * kern_weights_row_bytes(type, in);
    uint8_t *d = malloc(bytes);
    assert_non_null(d);
    if (type == GGUF_T_F32) {
        float *f = (float *)d;
        for (size_t i = 0; i < rows * in; i++)
            f[i] = (float)((double)(rng_next(s) >> 11) * 0x1p-53 - 0.5) * 0.2f;
        return d;
    }
    for (size_t i = 0; i < bytes; i++)
        d[i] = (uint8_t)rng_next(s);
    if (type == GGUF_T_F16)
        for (size_t i = 0; i < rows * in; i++)
            put16(d + 2 * i, finite_half(s, 0, 16));   /* subnormals up to 2 */
    else if (type == GGUF_T_BF16)
        for (size_t i = 0; i < rows * in; i++)
            put16(d + 2 * i, (uint16_t)((rng_next(s) & 0x807f) | (uint64_t)(100 + rng_next(s) % 40) << 7));
    else {
        uint64_t elems, block;
        assert_true(gguf_type_block(type, &elems, &block));
        for (size_t b = 0; b < bytes / block; b++) {
            put16(d + b * block, finite_half(s, 0, 12));   /* scales, some subnormal */
            if (type == GGUF_T_Q4_1)
                put16(d + b * block + 2, finite_half(s, 0, 14));
        }
    }
    return d;
}

static const uint32_t types[] = {GGUF_T_F32, GGUF_T_F16, GGUF_T_BF16, GGUF_T_Q8_0, GGUF_T_Q4_0, GGUF_T_Q4_1};

static float value_at(uint32_t type, const uint8_t *d, uint64_t i)
{
    return type == GGUF_T_F32 ? ((const float *)d)[i] : gguf_value(type, d, i);
}

static void test_rows_equal_scalar_values(void **state)
{
    (void)state;
    uint64_t s = 5;
    for (size_t t = 0; t < sizeof types / sizeof *types; t++) {
        const size_t in = 96, rows = 40;
        uint8_t *d = stored_matrix(types[t], rows, in, &s);
        float *out = malloc(rows * in * sizeof *out);
        assert_non_null(out);
        for (size_t first = 0; first < rows; first += 7) {
            const size_t count = rows - first < 9 ? rows - first : 9;
            memset(out, 0xff, rows * in * sizeof *out);   /* NaN: anything left unwritten fails */
            kern_weights_rows((kern_weights){types[t], d}, in, first, count, out);
            for (size_t i = 0; i < count * in; i++) {
                const float want = value_at(types[t], d, first * in + i);
                if (memcmp(&want, &out[i], sizeof want) != 0)
                    fail_msg("type %u row %zu element %zu: %a, want %a", types[t], first + i / in, i % in,
                             (double)out[i], (double)want);
            }
        }
        free(out);
        free(d);
    }
    assert_int_equal(kern_weights_row_bytes(GGUF_T_Q4_1, 64), 40);
    assert_int_equal(kern_weights_row_bytes(GGUF_T_Q8_0, 96), 102);
    assert_int_equal(kern_weights_row_bytes(GGUF_T_F16, 7), 14);
    assert_int_equal(kern_weights_row_bytes(GGUF_T_Q4_1, 33), 0);   /* not whole blocks */
    assert_int_equal(kern_weights_row_bytes(77, 64), 0);            /* a type strata does not read */
}

static float documented_dot(const float *x, uint32_t type, const uint8_t *w, size_t row, size_t in)
{
    float l[8] = {0};
    const size_t in8 = in / 8 * 8;
    const uint64_t base = (uint64_t)row * in;
    for (size_t i = 0; i < in8; i += 8)
        for (size_t j = 0; j < 8; j++)
            l[j] = fmaf(x[i + j], value_at(type, w, base + i + j), l[j]);
    float s = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
    for (size_t i = in8; i < in; i++)
        s = fmaf(x[i], value_at(type, w, base + i), s);
    return s;
}

static void test_matmul_stored_weights(void **state)
{
    (void)state;
    const int threads0 = openblas_get_num_threads();
    /* model shapes, an output count that is no multiple of a tile, and rows longer than a panel */
    static const size_t shapes[][2] = {{576, 1536}, {1536, 576}, {64, 3001}, {29, 13}, {32832, 5}};
    static const size_t ns[] = {1, 2, 3, 4, 5, 13, 64};
    const size_t max_n = 70;
    uint64_t s = 17;
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
        const size_t in = shapes[si][0], out = shapes[si][1];
        const size_t n_max = in > 10000 ? 3 : max_n;
        float *x = malloc(n_max * in * sizeof *x), *solo = malloc(n_max * out * sizeof *solo);
        float *y = malloc(n_max * out * sizeof *y);
        assert_non_null(x);
        assert_non_null(solo);
        assert_non_null(y);
        for (size_t i = 0; i < n_max * in; i++)
            x[i] = (float)((double)(rng_next(&s) >> 11) * 0x1p-53 - 0.5);
        for (size_t t = 0; t < sizeof types / sizeof *types; t++) {
            if (kern_weights_row_bytes(types[t], in) == 0)
                continue;   /* in = 29: not whole blocks of the quantized formats */
            uint8_t *d = stored_matrix(types[t], out, in, &s);
            const kern_weights w = {types[t], d};
            kern_set_threads(1);
            for (size_t r = 0; r < n_max; r++)
                kern_matmul_w(x + r * in, 1, in, w, out, solo + r * out);
            for (size_t r = 0; r < n_max; r += 9)
                for (size_t o = 0; o < out; o += in > 1000 ? 1 : 5) {
                    const float want = documented_dot(x + r * in, types[t], d, o, in);
                    if (memcmp(&want, &solo[r * out + o], sizeof want) != 0)
                        fail_msg("type %u [%zu x %zu] row %zu output %zu: %a, want %a", types[t], out, in, r, o,
                                 (double)solo[r * out + o], (double)want);
                }
            for (int th = 1; th <= 3; th++) {
                kern_set_threads(th);
                for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++)
                    for (size_t off = 0; off + ns[ni] <= n_max; off += 23) {
                        memset(y, 0xff, ns[ni] * out * sizeof *y);
                        kern_matmul_w(x + off * in, ns[ni], in, w, out, y);
                        assert_memory_equal(y, solo + off * out, ns[ni] * out * sizeof *y);
                    }
            }
            free(d);
        }
        free(x);
        free(solo);
        free(y);
    }
    kern_set_threads(threads0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rows_equal_scalar_values),
        cmocka_unit_test(test_matmul_stored_weights),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
