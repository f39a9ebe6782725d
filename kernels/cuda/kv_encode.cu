// Quantize-on-append (see kernels/cuda_kv_encode.h): one thread block writes one block, through
// the phases of kernels/cuda/kv_encode_block.h with a barrier between them. Built with
// --fmad=false (kernels/CMakeLists.txt): GEAR's fp64 fit must round each product and sum as the
// CPU does, with no fused multiply-adds, for the bytes to match.
#include <cuda_runtime.h>

#include "kernels/cuda/kv_encode_block.h"
#include "kernels/cuda_kv_encode.h"

namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) encode_blocks(cuda_kv_encoder E, const cuda_kv_encode_job *jobs)
{
    __shared__ uint32_t table[256];
    __shared__ uint32_t piece_crc[kThreads];
    const cuda_kv_encode_job job = jobs[blockIdx.x];
    uint8_t *dst = job.dst;
    const unsigned tid = threadIdx.x, n = blockDim.x;

    for (unsigned i = tid; i < 256; i += n)
        table[i] = kv_crc32c_table_entry(i);
    kv_enc_zero(&E, dst, tid, n);
    __syncthreads();
    kv_enc_header(&E, &job, dst, tid, n);
    kv_enc_means(&E, &job, dst, tid, n);        // disjoint from the header: no barrier between them
    kv_enc_gear_select(&E, &job, tid, n);       // job scratch only
    kv_enc_ott_select(&E, &job, tid, n);        // job scratch and its head of the tracker
    __syncthreads();
    kv_enc_ott_fill(&E, &job, dst, tid, n);     // reads the pooled marks; completes the header
    __syncthreads();                            // the sections read TaDA's means, GEAR's and OTT's copies
    kv_enc_sections(&E, &job, dst, tid, n);
    kv_enc_gear_sparse(&E, &job, dst, tid, n);  // its own sections
    kv_enc_ott_rows(&E, &job, dst, tid, n);     // its own section
    __syncthreads();
    kv_enc_gear_residual(&E, &job, dst, tid, n);  // reads the backbone just written
    __syncthreads();
    kv_enc_gear_fit(&E, &job, dst, tid, n);
    __syncthreads();
    piece_crc[tid] = kv_enc_piece_crc(&E, table, dst, tid, n);
    __syncthreads();
    if (tid == 0)
        kv_enc_finish(&E, table, piece_crc, dst, n);
}

}  // namespace

extern "C" int cuda_kv_encode_blocks(const cuda_kv_encoder *enc, const cuda_kv_encode_job *d_jobs, int n_jobs,
                                     strata_cuda_stream stream, strata_error *err)
{
    if (!enc || (n_jobs > 0 && !d_jobs) || n_jobs < 0)
        return strata_fail(err, STRATA_EINVAL, "cuda_kv_encode_blocks: bad arguments");
    const cuda_kv_layout &L = enc->layout;
    if (L.codec < KV_CODEC_FP16 || L.codec > KV_CODEC_TADA || L.block_bytes % 64 != 0 || enc->slot_bytes % 64 != 0 ||
        enc->header_bytes > CUDA_KV_MAX_HEADER || enc->header_bytes >= L.block_bytes)
        return strata_fail(err, STRATA_EINVAL, "cuda_kv_encode_blocks: encoder not from cuda_kv_encoder_init");
    if (n_jobs == 0)
        return STRATA_OK;
    encode_blocks<<<(unsigned)n_jobs, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(*enc, d_jobs);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return strata_fail(err, STRATA_EIO, "CUDA encoder launch: %s", cudaGetErrorString(e));
    return STRATA_OK;
}
