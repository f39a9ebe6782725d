/* CUDA versions of the elementwise ops of kernels/ops.h, on device pointers, on a stream, and
 * the conversions the GPU forward pass needs. Compiled whenever nvcc is present
 * (strata_kernels_cuda); never yet run on a GPU (see docs/benchmarks.md). Each returns 0 or a
 * cudaError_t value. */
#ifndef STRATA_KERNELS_CUDA_OPS_H
#define STRATA_KERNELS_CUDA_OPS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct CUstream_st *strata_cuda_stream;

int cuda_rmsnorm(const float *x, const float *weight, size_t n_rows, size_t dim, float eps, float *out,
                 strata_cuda_stream stream);
int cuda_rope(float *x, size_t n_tokens, size_t n_heads, size_t head_dim, size_t pos0, float theta,
              strata_cuda_stream stream);
int cuda_swiglu(const float *gate, const float *up, size_t n, float *out, strata_cuda_stream stream);

/* Rotary embedding of n_rows rows of n_heads vectors, row r at position d_pos[r] (device array):
 * a batch's rows each at its own sequence's position. */
int cuda_rope_rows(float *x, size_t n_rows, size_t n_heads, size_t head_dim, const int32_t *d_pos, float theta,
                   strata_cuda_stream stream);

/* out[r] = the column of the largest value of row r (the lowest such column on ties; NaN never
 * wins over a number): greedy sampling on the device, so only n_rows ids cross to the host. */
int cuda_argmax_rows(const float *x, size_t n_rows, size_t n_cols, int32_t *out, strata_cuda_stream stream);

/* out[r] = the lowest column of row r holding NaN, +inf or -inf, or -1 when the row is all finite:
 * the device's check that a forward pass's logits are numbers before anything is picked from them.
 * Returns cudaErrorInvalidValue for n_cols 0 or beyond 2^31 - 1 or a NULL pointer. */
int cuda_first_nonfinite_rows(const float *x, size_t n_rows, size_t n_cols, int32_t *out,
                              strata_cuda_stream stream);

/* y[i] += x[i] */
int cuda_add(float *y, const float *x, size_t n, strata_cuda_stream stream);

/* dst[i] = fp16 of src[i], round to nearest even (the cache's and the fp16 GEMMs' precision). */
int cuda_f32_to_f16(const float *src, uint16_t *dst, size_t n, strata_cuda_stream stream);

#ifdef __cplusplus
}
#endif

#endif
