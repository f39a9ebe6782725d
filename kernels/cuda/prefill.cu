// The small kernels of the cuBLAS prefill (kernels/cuda_prefill.h): the causal softmax over
// score rows, and fp16 to fp32 widening.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/prefill_softmax_block.h"
#include "kernels/cuda_prefill.h"

namespace {

constexpr int kThreads = 128;

// grid (rows, n_heads): one score row each.
__global__ void __launch_bounds__(kThreads) softmax_rows(float *s, int kn, int i0, size_t head_stride)
{
    __shared__ float red_max[kThreads], red_sum[kThreads];
    float *row = s + blockIdx.y * head_stride + (size_t)blockIdx.x * kn;
    const int n_valid = min(kn, i0 + (int)blockIdx.x + 1);
    pf_max_part(row, n_valid, red_max, threadIdx.x, blockDim.x);
    __syncthreads();
    pf_exp_part(row, n_valid, red_max, red_sum, threadIdx.x, blockDim.x);
    __syncthreads();
    pf_normalize(row, n_valid, kn, red_sum, threadIdx.x, blockDim.x);
}

__global__ void widen(const uint16_t *src, float *dst, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __half2float(__ushort_as_half(src[i]));
}

}  // namespace

extern "C" int cuda_prefill_softmax(float *d_s, int rows, int kn, int i0, int n_heads, size_t head_stride,
                                    strata_cuda_stream stream)
{
    if (rows <= 0 || n_heads <= 0)
        return 0;
    softmax_rows<<<dim3((unsigned)rows, (unsigned)n_heads), kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
        d_s, kn, i0, head_stride);
    return (int)cudaGetLastError();
}

extern "C" int cuda_f16_to_f32(const uint16_t *src, float *dst, size_t n, strata_cuda_stream stream)
{
    if (n == 0)
        return 0;
    const size_t blocks = (n + 255) / 256;
    widen<<<(unsigned)(blocks < 65535 ? blocks : 65535), 256, 0, reinterpret_cast<cudaStream_t>(stream)>>>(src, dst, n);
    return (int)cudaGetLastError();
}
