// A sequence's cached K/V for one layer written out as fp32 rows (kernels/cuda_prefill.h,
// cuda_kv_dequantize_view): the blocks through the attention kernels' own accessors (so every
// codec and its corrections dequantize exactly as the attention reads them), then the fp16 tail.
#include <cuda_runtime.h>

#include "kernels/cuda/kv_attention_block.h"
#include "kernels/cuda_prefill.h"

namespace {

constexpr int kThreads = 256;

// grid (n_blocks + tail pieces of block_tokens rows, n_kv_heads): one block's (or tail piece's)
// rows of one KV head. A block that does not match the layout sets the status and gives zeros.
__global__ void __launch_bounds__(kThreads) dequantize(cuda_kv_layout L, cuda_kv_seq seq, float *k, float *v,
                                                       int *status)
{
    __shared__ int ok;
    __shared__ kv_att_block_info info;
    const int u = blockIdx.x, h = blockIdx.y, H = L.n_kv_heads, D = L.head_dim, BT = L.block_tokens;
    if (u < seq.n_blocks) {
        const uint8_t *blk = seq.blocks[u];
        if (threadIdx.x == 0) {
            int bad = kv_att_block_status(&L, blk, u);
            if (!bad)
                bad = kv_att_block_parse(&L, blk, &info);
            if (bad)
                atomicExch(status, bad);
            ok = !bad;
        }
        __syncthreads();
        const kv_att_src src = {blk, &info, nullptr, nullptr};
        for (int x = threadIdx.x; x < BT * D; x += blockDim.x) {
            const int t = x / D, c = x - t * D;
            const size_t at = (((size_t)u * BT + t) * H + h) * D + c;
            k[at] = ok ? kv_att_key(&L, &src, h, t, c) : 0.0f;
            v[at] = ok ? kv_att_value(&L, &src, h, t, c) : 0.0f;
        }
        return;
    }
    const int t0 = (u - seq.n_blocks) * BT, n = min(BT, seq.tail_tokens - t0);
    const size_t base = (size_t)seq.n_blocks * BT + t0;
    for (int x = threadIdx.x; x < n * D; x += blockDim.x) {
        const int t = x / D, c = x - t * D;
        const size_t from = ((size_t)(t0 + t) * H + h) * D + c, to = ((base + t) * H + h) * D + c;
        k[to] = strata_half_to_float(seq.tail_k[from]);
        v[to] = strata_half_to_float(seq.tail_v[from]);
    }
}

}  // namespace

extern "C" int cuda_kv_dequantize_view(const cuda_kv_layout *layout, const cuda_kv_seq *seq, float *d_k, float *d_v,
                                       int *d_status, strata_cuda_stream stream, strata_error *err)
{
    if (!layout || !seq || !d_k || !d_v || !d_status || layout->n_kv_heads < 1 || layout->head_dim < 1 ||
        layout->block_tokens < 1 || seq->n_blocks < 0 || seq->tail_tokens < 0 || (seq->n_blocks && !seq->blocks) ||
        (seq->tail_tokens && (!seq->tail_k || !seq->tail_v)))
        return strata_fail(err, STRATA_EINVAL, "cuda_kv_dequantize_view: bad arguments");
    const long pieces = (long)seq->n_blocks + (seq->tail_tokens + layout->block_tokens - 1) / layout->block_tokens;
    if (pieces == 0)
        return STRATA_OK;
    if (pieces > 0x7fffffffL || layout->n_kv_heads > 65535)
        return strata_fail(err, STRATA_EINVAL, "cuda_kv_dequantize_view: %ld pieces of %d KV heads", pieces,
                           layout->n_kv_heads);
    dequantize<<<dim3((unsigned)pieces, (unsigned)layout->n_kv_heads), kThreads, 0,
                 reinterpret_cast<cudaStream_t>(stream)>>>(*layout, *seq, d_k, d_v, d_status);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return strata_fail(err, STRATA_EIO, "cuda_kv_dequantize_view: launch: %s", cudaGetErrorString(e));
    return STRATA_OK;
}
