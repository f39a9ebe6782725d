// Batched tail maintenance (see kernels/cuda_kv_tail.h): one thread block per job.
#include <cuda_runtime.h>

#include "kernels/cuda/kv_tail_block.h"
#include "kernels/cuda_kv_tail.h"

namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) append_rows(const cuda_kv_append_job *jobs, const uint16_t *k16,
                                                        const uint16_t *v16, size_t row_elems)
{
    const cuda_kv_append_job job = jobs[blockIdx.x];
    kv_tail_append(&job, k16, v16, row_elems, threadIdx.x, blockDim.x);
}

// Rows move down by `shift` in steps of `shift` rows, oldest first, with a barrier between steps
// (kv_tail_shift_step says why that is safe).
__global__ void __launch_bounds__(kThreads) shift_tails(const cuda_kv_shift_job *jobs, int shift, int keep,
                                                        size_t row_elems)
{
    const cuda_kv_shift_job job = jobs[blockIdx.x];
    for (int r0 = 0; r0 < keep; r0 += shift) {
        kv_tail_shift_step(&job, shift, keep, r0, row_elems, threadIdx.x, blockDim.x);
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
