/* CUDA versions of the elementwise ops of kernels/ops.h, on device pointers, on a stream.
 * Compiled whenever nvcc is present (strata_kernels_cuda); not yet called by the model and
 * never yet run on a GPU (see docs/benchmarks.md). Each returns 0 or a cudaError_t value. */
#ifndef STRATA_KERNELS_CUDA_OPS_H
#define STRATA_KERNELS_CUDA_OPS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct CUstream_st *strata_cuda_stream;

int cuda_rmsnorm(const float *x, const float *weight, size_t n_rows, size_t dim, float eps, float *out,
                 strata_cuda_stream stream);
int cuda_rope(float *x, size_t n_tokens, size_t n_heads, size_t head_dim, size_t pos0, float theta,
              strata_cuda_stream stream);
int cuda_swiglu(const float *gate, const float *up, size_t n, float *out, strata_cuda_stream stream);

#ifdef __cplusplus
}
#endif

#endif
