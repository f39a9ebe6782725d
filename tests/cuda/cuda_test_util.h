/* Shared by the CUDA tests: the device check that turns a missing GPU into a skip, random
 * inputs, and the relative-error measure. Header-only; each test is one executable. */
#ifndef STRATA_TESTS_CUDA_TEST_UTIL_H
#define STRATA_TESTS_CUDA_TEST_UTIL_H

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <cuda_runtime.h>

/* ctest's SKIP_RETURN_CODE for these tests. */
#define CUDA_TEST_SKIP 77

/* True when a CUDA device can run kernels; otherwise prints why the GPU checks are skipped. */
static inline bool cuda_test_have_device(const char *test)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        printf("SKIP %s: no CUDA device (%s); the GPU-vs-CPU comparisons need a GPU\n", test,
               e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        return false;
    }
    struct cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, 0) == cudaSuccess)
        printf("%s: running on %s (compute %d.%d, %d multiprocessors)\n", test, p.name, p.major, p.minor,
               p.multiProcessorCount);
    return true;
}

static inline uint64_t cuda_test_rng(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1). */
static inline float cuda_test_uniform(uint64_t *s)
{
    return (float)((double)(cuda_test_rng(s) >> 11) * 0x1p-52 - 1.0);
}

/* ||got - ref|| / ||ref|| over n values; +inf when got holds a NaN or inf (never passes). */
static inline double cuda_test_rel_error(const float *got, const double *ref, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(got[i]))
            return INFINITY;
        const double d = (double)got[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

/* fp64 attention of one query row (q: head_dim floats) over n keys and values whose rows are
 * stride floats apart (k, v at the KV head's first element): out, head_dim doubles; w, n doubles of
 * scratch. No keys give zeros. The attention tests' independent reference. */
static inline void cuda_test_attend_fp64(const float *q, const float *k, const float *v, size_t n, size_t stride,
                                         int head_dim, double *w, double *out)
{
    double mx = -INFINITY, sum = 0.0;
    for (size_t t = 0; t < n; t++) {
        double dot = 0.0;
        for (int c = 0; c < head_dim; c++)
            dot += (double)q[c] * (double)k[t * stride + (size_t)c];
        w[t] = dot / sqrt((double)head_dim);
        mx = w[t] > mx ? w[t] : mx;
    }
    for (size_t t = 0; t < n; t++)
        sum += (w[t] = exp(w[t] - mx));
    for (int c = 0; c < head_dim; c++) {
        double a = 0.0;
        for (size_t t = 0; t < n; t++)
            a += w[t] * (double)v[t * stride + (size_t)c];
        out[c] = n ? a / sum : 0.0;
    }
}

#define CUDA_CHECK(call)                                                                            \
    do {                                                                                            \
        cudaError_t e_ = (call);                                                                    \
        if (e_ != cudaSuccess)                                                                      \
            fail_msg("%s: %s", #call, cudaGetErrorString(e_));                                      \
    } while (0)

#endif
