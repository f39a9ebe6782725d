// The small kernels of the cuBLAS prefill (kernels/cuda_prefill.h): the causal softmax over
// score rows, a prompt chunk's online softmax over key tiles and its final division, and fp16 to
// fp32 widening.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/prefill_softmax_block.h"
#include "kernels/cuda_prefill.h"

namespace {

constexpr int kThreads = 128;

// grid (rows, n_heads): one score row each.
__global__ void __launch_bounds__(kThreads) softmax_rows(float *s, int kn, int i0, size_t head_stride)
{
    __shared__ float red_max[kThreads], red_sum[kThreads], st[2];
    float *row = s + blockIdx.y * head_stride + (size_t)blockIdx.x * kn;
    const int n_valid = min(kn, i0 + (int)blockIdx.x + 1);
    const unsigned tid = threadIdx.x, nt = blockDim.x;
    pf_max_part(row, n_valid, red_max, tid, nt);
    __syncthreads();
    pf_combine_max(red_max, -INFINITY, &st[0], tid, nt);
    __syncthreads();
    pf_exp_share(row, n_valid, st[0], red_sum, tid, nt);
    __syncthreads();
    pf_combine_sum(red_sum, &st[1], tid, nt);
    __syncthreads();
    pf_normalize(row, n_valid, kn, st[1], tid, nt);
}

// grid (rows, n_heads): one score row of a key tile each, with its state and output row.
__global__ void __launch_bounds__(kThreads) online_softmax_rows(cuda_chunk_tile t)
{
    __shared__ float red_max[kThreads], red_sum[kThreads], st[3];
    const int r = blockIdx.x, hh = blockIdx.y;
    const unsigned tid = threadIdx.x, nt = blockDim.x;
    float *row = t.s + hh * t.head_stride + (size_t)r * t.kn;
    const int n_valid = t.causal ? min(t.kn, t.i0 + r + 1) : t.kn;
    const size_t at = (size_t)(t.i0 + r) * t.n_q_heads + t.q_head0 + hh;
    pf_online_max_part(row, n_valid, t.m + at, t.l + at, t.first, red_max, st, tid, nt);
    __syncthreads();
    pf_combine_max(red_max, st[0], &st[2], tid, nt);
    __syncthreads();
    pf_exp_share(row, n_valid, st[2], red_sum, tid, nt);
    __syncthreads();
    pf_online_finish(row, n_valid, t.kn, red_sum, st, t.first, t.out + at * t.head_dim, t.head_dim, t.m + at,
                     t.l + at, tid, nt);
}

// grid (rows): one output row (of one query head) each.
__global__ void __launch_bounds__(kThreads) divide_rows(float *out, const float *l, int dim)
{
    pf_divide_row(out + (size_t)blockIdx.x * dim, dim, l + blockIdx.x, threadIdx.x, blockDim.x);
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

extern "C" int cuda_chunk_softmax_tile(const cuda_chunk_tile *tile, strata_cuda_stream stream)
{
    if (tile->rows <= 0 || tile->n_heads <= 0)
        return 0;
    online_softmax_rows<<<dim3((unsigned)tile->rows, (unsigned)tile->n_heads), kThreads, 0,
                          reinterpret_cast<cudaStream_t>(stream)>>>(*tile);
    return (int)cudaGetLastError();
}

extern "C" int cuda_chunk_normalize(float *d_out, const float *d_l, int n_rows, int head_dim, strata_cuda_stream stream)
{
    if (n_rows <= 0)
        return 0;
    divide_rows<<<(unsigned)n_rows, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(d_out, d_l, head_dim);
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
