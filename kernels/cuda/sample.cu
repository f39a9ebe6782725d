// Sampling on the device (see kernels/cuda_sample.h): one thread block per row, the phases of
// kernels/cuda/sample_block.h with a barrier after each, exactly where the CPU emulation in
// tests/cuda/test_cuda_sample.c puts its barriers.
//
// Expected cost (not measured yet, docs/gpu.md): about 13 passes over the row for a top-k + top-p
// draw (one for the maximum, four per cut), each reading n_vocab floats (from L2 after the first)
// and, in weight descents, one expf per token still in the running; a few microseconds per pass
// at 128256 tokens. What to measure first: the double atomicAdds on shared memory (Hopper has no
// native fp64 shared-memory add: a compare-and-swap loop), which the per-thread accumulators of
// smp_hist are there to keep few.
#include <cuda_runtime.h>

#include "kernels/cuda/sample_block.h"
#include "kernels/cuda_sample.h"

namespace {

constexpr int kThreads = 512;

__global__ void __launch_bounds__(kThreads) sample_rows(const float *logits, int n_vocab, const cuda_sample_row *rows,
                                                        int32_t *out)
{
    __shared__ smp_shared sh;
    const unsigned tid = threadIdx.x, nt = blockDim.x;
    const float *x = logits + (size_t)blockIdx.x * (size_t)n_vocab;
    smp_start(&sh, tid, nt);
    __syncthreads();
    smp_max_pass(&sh, x, n_vocab, tid, nt);
    __syncthreads();
    smp_plan(&sh, &rows[blockIdx.x], n_vocab, tid);
    __syncthreads();
    // sh.step is written only by thread 0 in smp_descend, two barriers before it is read here:
    // every thread sees the same value and takes the same path.
    while (sh.step != SMP_DONE) {
        smp_hist(&sh, x, n_vocab, tid, nt);
        __syncthreads();
        smp_groups(&sh, tid, nt);
        __syncthreads();
        smp_scan(&sh, tid, nt);
        __syncthreads();
        smp_descend(&sh, tid);
        __syncthreads();
        smp_clear(&sh, tid, nt);
        __syncthreads();
    }
    if (tid == 0)
        out[blockIdx.x] = sh.result;
}

}  // namespace

extern "C" int cuda_sample_rows(const float *logits, int n_rows, int n_vocab, const cuda_sample_row *d_rows,
                                int32_t *out, strata_cuda_stream stream)
{
    if (n_rows <= 0)
        return 0;
    if (n_vocab <= 0 || n_vocab > SMP_MAX_VOCAB || !logits || !d_rows || !out)
        return (int)cudaErrorInvalidValue;
    sample_rows<<<(unsigned)n_rows, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(logits, n_vocab, d_rows,
                                                                                         out);
    return (int)cudaGetLastError();
}
