// Elementwise CUDA kernels mirroring kernels/cpu/ops.c (the reference they will be tested
// against once a GPU runs them).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cuda_ops.h"

namespace {

constexpr int kBlock = 256;

// One block per row: a block-wide sum of squares in shared memory, then the scaled write.
__global__ void rmsnorm_kernel(const float *x, const float *weight, size_t dim, float eps, float *out)
{
    __shared__ float partial[kBlock];
    const float *row = x + blockIdx.x * dim;
    float *orow = out + blockIdx.x * dim;
    float acc = 0.0f;
    for (size_t i = threadIdx.x; i < dim; i += blockDim.x)
        acc += row[i] * row[i];
    partial[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s)
            partial[threadIdx.x] += partial[threadIdx.x + s];
        __syncthreads();
    }
    const float scale = rsqrtf(partial[0] / (float)dim + eps);
    for (size_t i = threadIdx.x; i < dim; i += blockDim.x)
        orow[i] = row[i] * scale * weight[i];
}

// One thread per rotated pair; the angle is computed in double as on the CPU.
__global__ void rope_kernel(float *x, size_t n_tokens, size_t n_heads, size_t head_dim, size_t pos0, float theta)
{
    const size_t half = head_dim / 2;
    const size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (idx >= n_tokens * n_heads * half)
        return;
    const size_t i = idx % half, h = (idx / half) % n_heads, t = idx / (half * n_heads);
    const double angle = (double)(pos0 + t) * pow((double)theta, -2.0 * (double)i / (double)head_dim);
    const float c = (float)cos(angle), s = (float)sin(angle);
    float *p = x + (t * n_heads + h) * head_dim + 2 * i;
    const float a = p[0], b = p[1];
    p[0] = a * c - b * s;
    p[1] = a * s + b * c;
}

// The same rotation with each row's own position.
__global__ void rope_rows_kernel(float *x, size_t n_rows, size_t n_heads, size_t head_dim, const int32_t *pos,
                                 float theta)
{
    const size_t half = head_dim / 2;
    const size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (idx >= n_rows * n_heads * half)
        return;
    const size_t i = idx % half, h = (idx / half) % n_heads, t = idx / (half * n_heads);
    const double angle = (double)pos[t] * pow((double)theta, -2.0 * (double)i / (double)head_dim);
    const float c = (float)cos(angle), s = (float)sin(angle);
    float *p = x + (t * n_heads + h) * head_dim + 2 * i;
    const float a = p[0], b = p[1];
    p[0] = a * c - b * s;
    p[1] = a * s + b * c;
}

__global__ void swiglu_kernel(const float *gate, const float *up, size_t n, float *out)
{
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

__global__ void add_kernel(float *y, const float *x, size_t n)
{
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n)
        y[i] += x[i];
}

__global__ void f32_to_f16_kernel(const float *src, uint16_t *dst, size_t n)
{
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n)
        dst[i] = __half_as_ushort(__float2half_rn(src[i]));
}

// (value, column) pairs: the larger value wins, the lower column on ties, a number over NaN.
__device__ __forceinline__ bool beats(float v, int i, float bv, int bi)
{
    if (isnan(v))
        return false;
    return isnan(bv) || v > bv || (v == bv && i < bi);
}

__global__ void argmax_kernel(const float *x, size_t n_cols, int32_t *out)
{
    __shared__ float best_v[kBlock];
    __shared__ int best_i[kBlock];
    const float *row = x + blockIdx.x * n_cols;
    float bv = NAN;
    int bi = 0x7fffffff;
    for (size_t c = threadIdx.x; c < n_cols; c += blockDim.x)
        if (beats(row[c], (int)c, bv, bi)) {
            bv = row[c];
            bi = (int)c;
        }
    best_v[threadIdx.x] = bv;
    best_i[threadIdx.x] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s && beats(best_v[threadIdx.x + s], best_i[threadIdx.x + s], best_v[threadIdx.x],
                                     best_i[threadIdx.x])) {
            best_v[threadIdx.x] = best_v[threadIdx.x + s];
            best_i[threadIdx.x] = best_i[threadIdx.x + s];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0)
        out[blockIdx.x] = best_i[0] == 0x7fffffff ? 0 : best_i[0];
}

// One block per row: each thread's first non-finite column (its columns ascend), then the least.
__global__ void first_nonfinite_kernel(const float *x, size_t n_cols, int32_t *out)
{
    __shared__ int first[kBlock];
    const float *row = x + blockIdx.x * n_cols;
    int f = 0x7fffffff;
    for (size_t c = threadIdx.x; c < n_cols; c += blockDim.x)
        if (!isfinite(row[c])) {
            f = (int)c;
            break;
        }
    first[threadIdx.x] = f;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s && first[threadIdx.x + s] < first[threadIdx.x])
            first[threadIdx.x] = first[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        out[blockIdx.x] = first[0] == 0x7fffffff ? -1 : first[0];
}

unsigned grid_for(size_t n) { return (unsigned)((n + kBlock - 1) / kBlock); }

}  // namespace

extern "C" int cuda_rmsnorm(const float *x, const float *weight, size_t n_rows, size_t dim, float eps, float *out,
                            strata_cuda_stream stream)
{
    if (n_rows == 0)
        return 0;
    rmsnorm_kernel<<<(unsigned)n_rows, kBlock, 0, (cudaStream_t)stream>>>(x, weight, dim, eps, out);
    return (int)cudaGetLastError();
}

extern "C" int cuda_rope(float *x, size_t n_tokens, size_t n_heads, size_t head_dim, size_t pos0, float theta,
                         strata_cuda_stream stream)
{
    const size_t pairs = n_tokens * n_heads * (head_dim / 2);
    if (pairs == 0)
        return 0;
    rope_kernel<<<grid_for(pairs), kBlock, 0, (cudaStream_t)stream>>>(x, n_tokens, n_heads, head_dim, pos0, theta);
    return (int)cudaGetLastError();
}

extern "C" int cuda_swiglu(const float *gate, const float *up, size_t n, float *out, strata_cuda_stream stream)
{
    if (n == 0)
        return 0;
    swiglu_kernel<<<grid_for(n), kBlock, 0, (cudaStream_t)stream>>>(gate, up, n, out);
    return (int)cudaGetLastError();
}

extern "C" int cuda_add(float *y, const float *x, size_t n, strata_cuda_stream stream)
{
    if (n == 0)
        return 0;
    add_kernel<<<grid_for(n), kBlock, 0, (cudaStream_t)stream>>>(y, x, n);
    return (int)cudaGetLastError();
}

extern "C" int cuda_f32_to_f16(const float *src, uint16_t *dst, size_t n, strata_cuda_stream stream)
{
    if (n == 0)
        return 0;
    f32_to_f16_kernel<<<grid_for(n), kBlock, 0, (cudaStream_t)stream>>>(src, dst, n);
    return (int)cudaGetLastError();
}

extern "C" int cuda_rope_rows(float *x, size_t n_rows, size_t n_heads, size_t head_dim, const int32_t *d_pos,
                              float theta, strata_cuda_stream stream)
{
    const size_t pairs = n_rows * n_heads * (head_dim / 2);
    if (pairs == 0)
        return 0;
    rope_rows_kernel<<<grid_for(pairs), kBlock, 0, (cudaStream_t)stream>>>(x, n_rows, n_heads, head_dim, d_pos, theta);
    return (int)cudaGetLastError();
}

extern "C" int cuda_argmax_rows(const float *x, size_t n_rows, size_t n_cols, int32_t *out, strata_cuda_stream stream)
{
    if (n_rows == 0)
        return 0;
    argmax_kernel<<<(unsigned)n_rows, kBlock, 0, (cudaStream_t)stream>>>(x, n_cols, out);
    return (int)cudaGetLastError();
}

extern "C" int cuda_first_nonfinite_rows(const float *x, size_t n_rows, size_t n_cols, int32_t *out,
                                         strata_cuda_stream stream)
{
    if (n_rows == 0)
        return 0;
    if (!x || !out || n_cols == 0 || n_cols > 0x7fffffff || n_rows > 0x7fffffff)
        return (int)cudaErrorInvalidValue;
    first_nonfinite_kernel<<<(unsigned)n_rows, kBlock, 0, (cudaStream_t)stream>>>(x, n_cols, out);
    return (int)cudaGetLastError();
}
