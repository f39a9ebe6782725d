// Decode attention over paged compressed blocks (see kernels/cuda_kv_attention.h): the entry
// points, and the generic kernels.
//
// The generic decode kernel was written to be right before it is fast: one thread block per (KV
// head, split, sequence); each block of the table goes through the phases of kv_attention_block.h
// (scores a thread per token, the online-softmax update through per-thread partials, values a
// thread per channel), which the CPU tests also run, emulated. It handles every codec's
// corrections (TaDA, GEAR, OTT). Measured on an H100 (docs/benchmarks.md) at 3-5 % of the copy
// bandwidth, so cuda_kv_attention sends the launches the staged kernel takes (fp16 and KIVI,
// kernels/cuda/kv_attention_fast.cu) there and keeps this one for the rest. Prefill and prompt
// chunks do not come here: they go through cuBLAS (cuda_attention_prefill_gemm,
// kernels/cuda_prefill.h), a chunk over its cache written out as fp32 rows first
// (cuda_kv_dequantize_view, kernels/cuda/kv_dequant.cu).
#include <atomic>

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>

#include "kernels/cuda/kv_attention_block.h"
#include "kernels/cuda/kv_attention_fast.h"
#include "kernels/cuda/kv_attention_mma.h"
#include "kernels/cuda_kv_attention.h"
#include "kvstore/kv_cache.h"

namespace {

constexpr int kThreads = 128;
constexpr int kMaxQpk = KV_ATT_MAX_QPK;   // query heads per KV head (cuda_kv_attention_plan checks)

// One chunk through the six phases of kv_attention_block.h, a barrier after each.
__device__ void attend_chunk(const kv_att_shared &s, const cuda_kv_layout &L, const kv_att_src &src, int h, int qpk,
                             int chunk, int n)
{
    const unsigned tid = threadIdx.x, nt = blockDim.x;
    kv_att_scores(&s, &L, &src, h, qpk, chunk, n, tid, nt);
    __syncthreads();
    kv_att_max_parts(&s, qpk, chunk, n, tid, nt);
    __syncthreads();
    kv_att_max(&s, qpk, tid, nt);
    __syncthreads();
    kv_att_exp_parts(&s, qpk, chunk, n, tid, nt);
    __syncthreads();
    kv_att_norm(&s, qpk, tid, nt);
    __syncthreads();
    kv_att_values(&s, &L, &src, h, qpk, chunk, n, tid, nt);
    __syncthreads();
}

// Block u of a table through the phases, checked and parsed by thread 0 first: a block that does
// not match sets the status and adds nothing (GEAR's outlier indices, checked by every thread
// for its share, set it too). ok and info are the kernel's shared slots for them.
// The skip ends with a barrier too: otherwise thread 0 could overwrite *ok for the next block
// before a slower thread has read it for this one, and the threads would part ways at a barrier.
__device__ void attend_block(const kv_att_shared &s, const cuda_kv_layout &L, const uint8_t *blk, int u, int kvh,
                             int qpk, int *ok, kv_att_block_info *info, int *status)
{
    if (threadIdx.x == 0) {
        int bad = kv_att_block_status(&L, blk, u);
        if (!bad)
            bad = kv_att_block_parse(&L, blk, info);
        if (bad)
            atomicExch(status, bad);
        *ok = !bad;
    }
    __syncthreads();
    if (!*ok) {
        __syncthreads();
        return;
    }
    if (kv_att_gear_entries_bad(&L, info, blk, kvh, threadIdx.x, blockDim.x))
        atomicExch(status, 1);
    const kv_att_src src = {blk, info, nullptr, nullptr};
    attend_chunk(s, L, src, kvh, qpk, L.block_tokens, L.block_tokens);
}

// fp16 rows [0, n) of k and v ([token][n_kv_heads][head_dim]) through the phases, `chunk` at a time.
__device__ void attend_rows(const kv_att_shared &s, const cuda_kv_layout &L, const uint16_t *k, const uint16_t *v,
                            int n, int kvh, int qpk, int chunk)
{
    const size_t row = (size_t)L.n_kv_heads * L.head_dim;
    for (int t0 = 0; t0 < n; t0 += chunk) {
        const kv_att_src src = {nullptr, nullptr, k + t0 * row, v + t0 * row};
        attend_chunk(s, L, src, kvh, qpk, chunk, min(chunk, n - t0));
    }
}

// grid (n_kv_heads, n_splits, n_seqs): the split's blocks (and the tail, when the split holds the
// last unit) of one sequence for one group of query heads.
__global__ void __launch_bounds__(kThreads) attend_split(cuda_kv_layout L, cuda_kv_plan P, const cuda_kv_seq *seqs,
                                                         const float *q, float *ws_acc, float *ws_ml, int *status)
{
    extern __shared__ float smem[];
    __shared__ int block_ok;
    __shared__ kv_att_block_info info;
    const int D = L.head_dim, BT = L.block_tokens;
    const int qpk = P.n_q_heads / L.n_kv_heads;
    const int kvh = blockIdx.x, split = blockIdx.y, si = blockIdx.z;
    const cuda_kv_seq seq = seqs[si];
    const kv_att_shared s = kv_att_shared_at(smem, qpk, D, BT, blockDim.x);
    const size_t row0 = (size_t)si * P.n_q_heads + (size_t)kvh * qpk;

    kv_att_init(&s, q + row0 * D, qpk, D, threadIdx.x, blockDim.x);
    __syncthreads();
    const int first = split * P.blocks_per_split;
    const int last = min(first + P.blocks_per_split, seq.n_blocks + 1);  // the tail is the last unit
    for (int u = first; u < last; u++) {
        if (u < seq.n_blocks)
            attend_block(s, L, seq.blocks[u], u, kvh, qpk, &block_ok, &info, status);
        else
            attend_rows(s, L, seq.tail_k, seq.tail_v, seq.tail_tokens, kvh, qpk, BT);
    }
    kv_att_write_partials(&s, qpk, D, row0, P.n_splits, split, ws_acc, ws_ml, threadIdx.x, blockDim.x);
}

// grid (n_q_heads, n_seqs)
__global__ void __launch_bounds__(kThreads) merge_splits(cuda_kv_plan P, int D, const float *ws_acc, const float *ws_ml,
                                                         float *out)
{
    const size_t row = (size_t)blockIdx.y * P.n_q_heads + blockIdx.x;
    kv_att_merge_row(P.n_splits, D, row, ws_acc, ws_ml, out, threadIdx.x, blockDim.x);
}

int launch_failed(strata_error *err, const char *what)
{
    const cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess)
        return STRATA_OK;
    return strata_fail(err, STRATA_EIO, "CUDA attention: %s: %s", what, cudaGetErrorString(e));
}

// Kernels whose shared memory exceeds the default 48 KiB must ask for it first.
template <typename Kernel>
int allow_smem(Kernel kernel, size_t smem, strata_error *err)
{
    if (smem > 48 * 1024 &&
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) != cudaSuccess)
        return launch_failed(err, "raising the shared-memory limit");
    return STRATA_OK;
}

// The shared memory a thread block may have: what the current device allows a block that opts in
// (an H100 227 KiB, an A100 163 KiB, sm_86/89/120 99 KiB), capped by plan->smem_limit when set.
// Asked once per device (0: not yet); every launch of every layer needs it.
constexpr int kCachedDevices = 64;
std::atomic<int> optin_of_device[kCachedDevices];

int smem_allowed(const cuda_kv_plan *plan, size_t *out, strata_error *err)
{
    int dev = 0, optin = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess && dev >= 0 && dev < kCachedDevices)
        optin = optin_of_device[dev].load(std::memory_order_relaxed);
    if (e == cudaSuccess && optin == 0) {
        e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
        if (e == cudaSuccess && dev >= 0 && dev < kCachedDevices)
            optin_of_device[dev].store(optin, std::memory_order_relaxed);
    }
    if (e != cudaSuccess)
        return strata_fail(err, STRATA_EIO, "CUDA attention: the device's shared memory per block: %s",
                           cudaGetErrorString(e));
    *out = (size_t)optin;
    if (plan->smem_limit > 0 && (size_t)plan->smem_limit < *out)
        *out = (size_t)plan->smem_limit;
    return STRATA_OK;
}

// The codecs and quantized shapes the decode kernels handle.
int check_codec(const cuda_kv_layout *layout, const char *fn, strata_error *err)
{
    if (layout->codec < KV_CODEC_FP16 || layout->codec > KV_CODEC_TADA)
        return strata_fail(err, STRATA_EUNSUPPORTED, "%s: codec %d", fn, layout->codec);
    const int max_bits = layout->codec == KV_CODEC_TADA ? 8 : 4;
    const bool bits_ok = (layout->k_bits == 2 || layout->k_bits == 4 || layout->k_bits == max_bits) &&
                         (layout->v_bits == 2 || layout->v_bits == 4 || layout->v_bits == max_bits);
    if (layout->codec != KV_CODEC_FP16 &&
        (layout->k_group < 1 || layout->v_group < 1 || layout->block_tokens % layout->k_group != 0 ||
         layout->head_dim % layout->v_group != 0 || !bits_ok))
        return strata_fail(err, STRATA_EINVAL, "%s: inconsistent quantized layout", fn);
    return STRATA_OK;
}

}  // namespace

extern "C" int cuda_kv_attention(const cuda_kv_layout *layout, const cuda_kv_plan *plan, const cuda_kv_seq *d_seqs,
                                 const float *d_q, float *d_out, void *d_workspace, int *d_status,
                                 strata_cuda_stream stream, strata_error *err)
{
    if (!layout || !plan || !d_seqs || !d_q || !d_out || !d_workspace || !d_status)
        return strata_fail(err, STRATA_EINVAL, "cuda_kv_attention: NULL argument");
    const int H = layout->n_kv_heads, D = layout->head_dim;
    if (H < 1 || D < 1 || layout->block_tokens < 1 || plan->n_seqs < 1 || plan->n_splits < 1 ||
        plan->blocks_per_split < 1 || plan->n_q_heads % H != 0 || plan->n_q_heads / H > kMaxQpk)
        return strata_fail(err, STRATA_EINVAL, "cuda_kv_attention: bad layout or plan (use cuda_kv_attention_plan)");
    if ((long)plan->n_splits * plan->blocks_per_split < (long)plan->max_blocks + 1)
        return strata_fail(err, STRATA_EINVAL, "cuda_kv_attention: the plan's splits do not cover %d blocks",
                           plan->max_blocks);
    const int rc0 = check_codec(layout, "cuda_kv_attention", err);
    if (rc0 != STRATA_OK)
        return rc0;
    const int qpk = plan->n_q_heads / H;
    const size_t smem = kv_att_shared_floats(qpk, D, layout->block_tokens, kThreads) * sizeof(float);
    float *ws_acc = static_cast<float *>(d_workspace);
    float *ws_ml = ws_acc + (size_t)plan->n_seqs * plan->n_q_heads * plan->n_splits * D;
    const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    size_t allowed = 0;
    int rc = smem_allowed(plan, &allowed, err);
    if (rc != STRATA_OK)
        return rc;
    // Each kernel only where its shared memory fits (kernels/cuda_kv_attention.h), else the next.
    const bool mma = plan->kernel == CUDA_KV_KERNEL_AUTO && kv_mma_runs(layout, qpk, allowed);
    const bool staged = !mma && plan->kernel != CUDA_KV_KERNEL_GENERIC && kv_att_fast_eligible(layout, qpk) &&
                        kv_att_fast_smem(layout, qpk) <= allowed;
    if (mma || staged) {
        rc = mma ? kv_mma_launch(layout, plan, d_seqs, d_q, ws_acc, ws_ml, d_status, stream, err)
                 : kv_att_fast_launch(layout, plan, d_seqs, d_q, ws_acc, ws_ml, d_status, stream, err);
        if (rc != STRATA_OK)
            return rc;
        merge_splits<<<dim3((unsigned)plan->n_q_heads, (unsigned)plan->n_seqs), kThreads, 0, st>>>(*plan, D, ws_acc,
                                                                                                  ws_ml, d_out);
        return launch_failed(err, "merge_splits");
    }
    if (smem > allowed)
        return strata_fail(err, STRATA_EUNSUPPORTED,
                           "cuda_kv_attention: %d query heads per KV head at head_dim %d with %d-token blocks need "
                           "%zu bytes of shared memory a thread block; this GPU allows %zu",
                           qpk, D, layout->block_tokens, smem, allowed);
    if ((rc = allow_smem(attend_split, smem, err)) != STRATA_OK)
        return rc;
    const dim3 grid((unsigned)H, (unsigned)plan->n_splits, (unsigned)plan->n_seqs);
    attend_split<<<grid, kThreads, smem, st>>>(*layout, *plan, d_seqs, d_q, ws_acc, ws_ml, d_status);
    if ((rc = launch_failed(err, "attend_split")) != STRATA_OK)
        return rc;
    merge_splits<<<dim3((unsigned)plan->n_q_heads, (unsigned)plan->n_seqs), kThreads, 0, st>>>(*plan, D, ws_acc, ws_ml,
                                                                                              d_out);
    return launch_failed(err, "merge_splits");
}
