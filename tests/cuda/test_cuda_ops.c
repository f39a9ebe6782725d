/* The elementwise CUDA ops (kernels/cuda/ops.cu) against the CPU reference ops (kernels/ops.h)
 * on fresh random inputs, outputs poisoned with NaN before each launch. Bounds (relative
 * ||gpu - cpu|| / ||cpu||): RMSNorm 1e-6 (block-tree vs sequential sum of squares), RoPE 1e-6
 * (both take the angle in double), SwiGLU 1e-6 (expf on either side), add exact, fp32 -> fp16 bit
 * for bit (NaNs as NaNs). Skipped (exit 77) when no
 * CUDA device is present. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "cuda_test_util.h"
#include "kernels/cuda_ops.h"
#include "kernels/ops.h"
#include "kvstore/half.h"

static uint64_t seed = 0xc0ffee;

static float *random_floats(size_t n, float scale)
{
    float *x = malloc(n * sizeof *x);
    assert_non_null(x);
    for (size_t i = 0; i < n; i++)
        x[i] = scale * cuda_test_uniform(&seed);
    return x;
}

static float *to_device(const float *x, size_t n)
{
    float *d = NULL;
    CUDA_CHECK(cudaMalloc((void **)&d, n * sizeof *d));
    CUDA_CHECK(cudaMemcpy(d, x, n * sizeof *d, cudaMemcpyHostToDevice));
    return d;
}

static float *poisoned(size_t n)
{
    float *d = NULL;
    CUDA_CHECK(cudaMalloc((void **)&d, n * sizeof *d));
    CUDA_CHECK(cudaMemset(d, 0xff, n * sizeof *d));
    return d;
}

static void expect_close(const float *d_got, const float *want, size_t n, double bound, const char *what)
{
    float *got = malloc(n * sizeof *got);
    double *ref = malloc(n * sizeof *ref);
    assert_true(got && ref);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(got, d_got, n * sizeof *got, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++)
        ref[i] = want[i];
    const double e = cuda_test_rel_error(got, ref, n);
    printf("  %s: rel error %.2e over %zu values\n", what, e, n);
    if (!(e <= bound))
        fail_msg("%s: %.3e > %.0e", what, e, bound);
    free(got);
    free(ref);
}

static void test_rmsnorm(void **state)
{
    (void)state;
    const size_t shapes[][2] = {{1, 576}, {7, 576}, {3, 4096}, {5, 100}};
    for (size_t s = 0; s < 4; s++) {
        const size_t rows = shapes[s][0], dim = shapes[s][1], n = rows * dim;
        float *x = random_floats(n, 3.0f), *w = random_floats(dim, 1.5f), *want = malloc(n * sizeof *want);
        assert_non_null(want);
        kern_rmsnorm(x, w, rows, dim, 1e-5f, want);
        float *dx = to_device(x, n), *dw = to_device(w, dim), *dout = poisoned(n);
        assert_int_equal(cuda_rmsnorm(dx, dw, rows, dim, 1e-5f, dout, NULL), 0);
        expect_close(dout, want, n, 1e-6, "rmsnorm");
        cudaFree(dx);
        cudaFree(dw);
        cudaFree(dout);
        free(x);
        free(w);
        free(want);
    }
}

static void test_rope(void **state)
{
    (void)state;
    const struct { size_t tokens, heads, dim, pos0; float theta; } shapes[] = {
        {1, 9, 64, 0, 100000.0f}, {5, 9, 64, 1000, 100000.0f}, {3, 32, 128, 70000, 500000.0f}};
    for (size_t s = 0; s < 3; s++) {
        const size_t n = shapes[s].tokens * shapes[s].heads * shapes[s].dim;
        float *x = random_floats(n, 2.0f), *want = malloc(n * sizeof *want);
        assert_non_null(want);
        for (size_t i = 0; i < n; i++)
            want[i] = x[i];
        for (size_t t = 0; t < shapes[s].tokens; t++)
            kern_rope(want + t * shapes[s].heads * shapes[s].dim, shapes[s].heads, shapes[s].dim, shapes[s].pos0 + t,
                      shapes[s].theta);
        float *dx = to_device(x, n);
        assert_int_equal(cuda_rope(dx, shapes[s].tokens, shapes[s].heads, shapes[s].dim, shapes[s].pos0,
                                   shapes[s].theta, NULL),
                         0);
        expect_close(dx, want, n, 1e-6, "rope");
        cudaFree(dx);
        free(x);
        free(want);
    }
}

static void test_swiglu(void **state)
{
    (void)state;
    const size_t sizes[] = {1, 1536, 14336 * 3 + 5};
    for (size_t s = 0; s < 3; s++) {
        const size_t n = sizes[s];
        float *g = random_floats(n, 6.0f), *u = random_floats(n, 2.0f), *want = malloc(n * sizeof *want);
        assert_non_null(want);
        kern_swiglu(g, u, n, want);
        float *dg = to_device(g, n), *du = to_device(u, n), *dout = poisoned(n);
        assert_int_equal(cuda_swiglu(dg, du, n, dout, NULL), 0);
        expect_close(dout, want, n, 1e-6, "swiglu");
        cudaFree(dg);
        cudaFree(du);
        cudaFree(dout);
        free(g);
        free(u);
        free(want);
    }
}

static void test_add(void **state)
{
    (void)state;
    const size_t n = 100003;
    float *y = random_floats(n, 3.0f), *x = random_floats(n, 3.0f), *want = malloc(n * sizeof *want);
    assert_non_null(want);
    for (size_t i = 0; i < n; i++)
        want[i] = y[i];
    kern_add(want, x, n);
    float *dy = to_device(y, n), *dx = to_device(x, n);
    assert_int_equal(cuda_add(dy, dx, n, NULL), 0);
    expect_close(dy, want, n, 0.0, "add (exact)");
    cudaFree(dy);
    cudaFree(dx);
    free(y);
    free(x);
    free(want);
}

/* Round to nearest even, bit for bit as the CPU's strata_float_to_half, on random values of every
 * magnitude plus the edges: subnormals, the largest half, overflow to inf, NaN, signed zero. */
static void test_f32_to_f16(void **state)
{
    (void)state;
    const size_t n = 1 << 20;
    float *x = malloc(n * sizeof *x);
    uint16_t *want = malloc(n * sizeof *want), *got = malloc(n * sizeof *got);
    assert_true(x && want && got);
    for (size_t i = 0; i < n; i++) {
        const uint32_t bits = (uint32_t)cuda_test_rng(&seed);
        float f;
        memcpy(&f, &bits, sizeof f);
        x[i] = (i % 4 == 0) ? f : cuda_test_uniform(&seed) * ldexpf(1.0f, (int)(cuda_test_rng(&seed) % 50) - 30);
    }
    const float edges[] = {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, 1e9f, -1e9f, 5.96e-8f, 2.98e-8f, 2.99e-8f,
                           6.1e-5f, INFINITY, -INFINITY, NAN};
    memcpy(x, edges, sizeof edges);
    for (size_t i = 0; i < n; i++)
        want[i] = strata_float_to_half(x[i]);
    float *dx = to_device(x, n);
    uint16_t *dh = NULL;
    CUDA_CHECK(cudaMalloc((void **)&dh, n * sizeof *dh));
    CUDA_CHECK(cudaMemset(dh, 0xff, n * sizeof *dh));
    assert_int_equal(cuda_f32_to_f16(dx, dh, n, NULL), 0);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(got, dh, n * sizeof *got, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++) {
        const int both_nan = (want[i] & 0x7c00u) == 0x7c00u && (want[i] & 0x3ffu) && (got[i] & 0x7c00u) == 0x7c00u &&
                             (got[i] & 0x3ffu);
        if (got[i] != want[i] && !both_nan)
            fail_msg("f32_to_f16(%a): gpu 0x%04x, cpu 0x%04x", (double)x[i], got[i], want[i]);
    }
    printf("  f32_to_f16: %zu values bit-identical to the CPU conversion\n", n);
    cudaFree(dx);
    cudaFree(dh);
    free(x);
    free(want);
    free(got);
}

/* A row-reducing kernel (one int32 per row) run on x's rows on the device, its answers in got,
 * the output poisoned before the run. */
typedef int (*row_kernel)(const float *, size_t, size_t, int32_t *, strata_cuda_stream);
static void run_row_kernel(row_kernel kernel, const float *x, size_t rows, size_t cols, int32_t *got)
{
    float *dx = to_device(x, rows * cols);
    int32_t *dout = NULL;
    CUDA_CHECK(cudaMalloc((void **)&dout, rows * sizeof *got));
    CUDA_CHECK(cudaMemset(dout, 0x5a, rows * sizeof *got));
    assert_int_equal(kernel(dx, rows, cols, dout, NULL), 0);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(got, dout, rows * sizeof *got, cudaMemcpyDeviceToHost));
    cudaFree(dx);
    cudaFree(dout);
}

/* Greedy choice per row against a CPU scan (same tie and NaN rules). */
static void test_argmax(void **state)
{
    (void)state;
    const size_t rows = 37, cols = 128256;
    float *x = random_floats(rows * cols, 10.0f);
    x[3 * cols + 5] = x[3 * cols + 9] = 1e6f;      /* a tie: the lower column */
    x[4 * cols + 0] = NAN;                         /* NaN never wins */
    x[4 * cols + 77] = 1e6f;
    for (size_t c = 0; c < cols; c++)
        x[5 * cols + c] = -1.0f;                   /* all equal: column 0 */
    int32_t want[37], got[37];
    for (size_t r = 0; r < rows; r++) {
        size_t best = (size_t)-1;
        for (size_t c = 0; c < cols; c++) {
            const float v = x[r * cols + c];
            if (!isnan(v) && (best == (size_t)-1 || v > x[r * cols + best]))
                best = c;
        }
        want[r] = (int32_t)best;
    }
    run_row_kernel(cuda_argmax_rows, x, rows, cols, got);
    for (size_t r = 0; r < rows; r++)
        if (got[r] != want[r])
            fail_msg("argmax row %zu: gpu %d, cpu %d", r, got[r], want[r]);
    assert_int_equal(got[3], 5);
    assert_int_equal(got[4], 77);
    assert_int_equal(got[5], 0);
    free(x);
}

/* The first non-finite column per row against a CPU scan: NaN, +inf and -inf each count, the
 * lowest column wins wherever the threads' strides put it, a finite row gives -1. */
static void test_first_nonfinite(void **state)
{
    (void)state;
    const size_t rows = 9, cols = 49152;
    float *x = random_floats(rows * cols, 10.0f);
    x[1 * cols + 7] = NAN;
    x[2 * cols + cols - 1] = INFINITY;
    x[3 * cols + 300] = -INFINITY;
    x[4 * cols + 513] = NAN;                        /* two threads' finds: the lower column */
    x[4 * cols + 258] = INFINITY;
    x[5 * cols + 0] = -INFINITY;
    x[6 * cols + 40000] = NAN;
    x[7 * cols + 12] = 3e38f;                      /* large but finite */
    for (size_t c = 0; c < cols; c += 3)
        x[8 * cols + c] = INFINITY;
    int32_t want[9], got[9];
    for (size_t r = 0; r < rows; r++) {
        want[r] = -1;
        for (size_t c = 0; c < cols && want[r] < 0; c++)
            if (!isfinite(x[r * cols + c]))
                want[r] = (int32_t)c;
    }
    run_row_kernel(cuda_first_nonfinite_rows, x, rows, cols, got);
    for (size_t r = 0; r < rows; r++)
        if (got[r] != want[r])
            fail_msg("first non-finite, row %zu: gpu %d, cpu %d", r, got[r], want[r]);
    assert_int_equal(got[0], -1);
    assert_int_equal(got[4], 258);
    assert_int_equal(got[7], -1);
    assert_int_equal(got[8], 0);
    /* refused before anything runs */
    assert_int_equal(cuda_first_nonfinite_rows(x, rows, 0, got, NULL), (int)cudaErrorInvalidValue);
    assert_int_equal(cuda_first_nonfinite_rows(NULL, rows, cols, got, NULL), (int)cudaErrorInvalidValue);
    free(x);
}

int main(void)
{
    if (!cuda_test_have_device("test_cuda_ops"))
        return CUDA_TEST_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_rope),
        cmocka_unit_test(test_swiglu),
        cmocka_unit_test(test_add),
        cmocka_unit_test(test_f32_to_f16),
        cmocka_unit_test(test_argmax),
        cmocka_unit_test(test_first_nonfinite),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
