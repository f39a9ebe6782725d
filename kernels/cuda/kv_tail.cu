// Batched tail maintenance (see kernels/cuda_kv_tail.h): one thread block per job.
#include <cuda_runtime.h>

#include "kernels/cuda_kv_tail.h"

namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) append_rows(const cuda_kv_append_job *jobs, const uint16_t *k16,
                                                        const uint16_t *v16, size_t row_elems)
{
    const cuda_kv_append_job job = jobs[blockIdx.x];
    const size_t n = (size_t)job.n_rows * row_elems, from = (size_t)job.src_row * row_elems;
    for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
        job.dst_k[i] = k16[from + i];
        job.dst_v[i] = v16[from + i];
    }
}

// Rows move down by `shift` in steps of `shift` rows, oldest first, with a barrier between steps:
// within a step the source and destination ranges do not overlap, and a step reads only rows that
// the earlier steps have already moved away from.
__global__ void __launch_bounds__(kThreads) shift_tails(const cuda_kv_shift_job *jobs, int shift, int keep,
                                                        size_t row_elems)
{
    const cuda_kv_shift_job job = jobs[blockIdx.x];
    for (int r0 = 0; r0 < keep; r0 += shift) {
        const int rows = min(shift, keep - r0);
        const size_t n = (size_t)rows * row_elems, dst = (size_t)r0 * row_elems, src = dst + (size_t)shift * row_elems;
        for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
            job.k[dst + i] = job.k[src + i];
            job.v[dst + i] = job.v[src + i];
        }
        __syncthreads();
    }
}

}  // namespace

extern "C" int cuda_kv_append_rows(const cuda_kv_append_job *d_jobs, int n_jobs, const uint16_t *k16,
                                   const uint16_t *v16, size_t row_elems, strata_cuda_stream stream)
{
    if (n_jobs <= 0)
        return 0;
    append_rows<<<(unsigned)n_jobs, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(d_jobs, k16, v16, row_elems);
    return (int)cudaGetLastError();
}

extern "C" int cuda_kv_shift_tails(const cuda_kv_shift_job *d_jobs, int n_jobs, int shift, int keep, size_t row_elems,
                                   strata_cuda_stream stream)
{
    if (n_jobs <= 0 || keep <= 0)
        return 0;
    if (shift <= 0)
        return (int)cudaErrorInvalidValue;
    shift_tails<<<(unsigned)n_jobs, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(d_jobs, shift, keep,
                                                                                        row_elems);
    return (int)cudaGetLastError();
}
