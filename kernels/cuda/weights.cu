// Weights decoded and generated on the device (kernels/cuda_weights.h). Compiled with
// --fmad=false (kernels/CMakeLists.txt): Q4_1's d * q + m must round twice, as on the CPU.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cuda_weights.h"
#include "kernels/weight_values.h"

namespace {

constexpr int kBlock = 256;
constexpr uint64_t kMaxGrid = 1u << 20;   // a grid-stride loop covers the rest

unsigned grid_for(uint64_t n)
{
    const uint64_t g = (n + kBlock - 1) / kBlock;
    return (unsigned)(g < kMaxGrid ? g : kMaxGrid);
}

// Stores v as the output type; true when the stored value is finite.
__device__ __forceinline__ bool store(void *out, bool out_f16, uint64_t i, float v)
{
    if (!out_f16) {
        static_cast<float *>(out)[i] = v;
        return isfinite(v);
    }
    const unsigned short h = __half_as_ushort(__float2half_rn(v));
    static_cast<unsigned short *>(out)[i] = h;
    return (h & 0x7c00u) != 0x7c00u;
}

__global__ void gguf_kernel(uint32_t type, const uint8_t *data, uint64_t n, uint64_t first, void *out, bool out_f16,
                            unsigned long long *first_bad)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        if (!store(out, out_f16, i, gguf_value(type, data, i)))
            atomicMin(first_bad, (unsigned long long)(first + i));
}

__global__ void synthetic_kernel(uint64_t key, float amp, uint64_t first, uint64_t n, void *out, bool out_f16)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        store(out, out_f16, i, synthetic_value(key, amp, first + i));
}

}  // namespace

extern "C" int cuda_weights_from_gguf(uint32_t type, const void *d_data, uint64_t n, uint64_t first, void *out,
                                      bool out_f16, unsigned long long *d_first_bad, strata_cuda_stream stream)
{
    uint64_t block_elems, block_bytes;
    if (!gguf_type_block(type, &block_elems, &block_bytes) || !d_data || !out || !d_first_bad)
        return (int)cudaErrorInvalidValue;
    if (n == 0)
        return 0;
    gguf_kernel<<<grid_for(n), kBlock, 0, (cudaStream_t)stream>>>(type, static_cast<const uint8_t *>(d_data), n,
                                                                 first, out, out_f16, d_first_bad);
    return (int)cudaGetLastError();
}

extern "C" int cuda_weights_synthetic(uint64_t key, float amp, uint64_t first, uint64_t n, void *out, bool out_f16,
                                      strata_cuda_stream stream)
{
    if (!out)
        return (int)cudaErrorInvalidValue;
    if (n == 0)
        return 0;
    synthetic_kernel<<<grid_for(n), kBlock, 0, (cudaStream_t)stream>>>(key, amp, first, n, out, out_f16);
    return (int)cudaGetLastError();
}
