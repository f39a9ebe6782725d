// A sequence's cached K/V for one layer written out as fp32 rows (kernels/cuda_prefill.h,
// cuda_kv_dequantize_view): the blocks through the attention kernels' own accessors (so every
// codec and its corrections dequantize exactly as the attention reads them), then the fp16 tail.
#include <cuda_runtime.h>

#include "kernels/cuda/kv_attention_block.h"
#include "kernels/cuda_prefill.h"

namespace {

constexpr int kThreads = 256;

// grid (pieces of block_tokens rows from piece0: blocks, then the tail's pieces; n_kv_heads): one
// block's (or tail piece's) rows of one KV head, written from row piece0 * block_tokens on. A
// block that does not match the layout sets the status and gives zeros.
__global__ void __launch_bounds__(kThreads) dequantize(cuda_kv_layout L, cuda_kv_seq seq, int piece0, float *k,
                                                       float *v, int *status)
{
    __shared__ int ok;
    __shared__ kv_att_block_info info;
    const int u = piece0 + (int)blockIdx.x, h = blockIdx.y, H = L.n_kv_heads, D = L.head_dim, BT = L.block_tokens;
    const size_t row0 = (size_t)piece0 * BT;
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
        if (ok && kv_att_gear_entries_bad(&L, &info, blk, h, threadIdx.x, blockDim.x))
            atomicExch(status, 1);
        const kv_att_src src = {blk, &info, nullptr, nullptr};
        for (int x = threadIdx.x; x < BT * D; x += blockDim.x) {
            const int t = x / D, c = x - t * D;
            const size_t at = (((size_t)u * BT + t - row0) * H + h) * D + c;
            k[at] = ok ? kv_att_key(&L, &src, h, t, c) : 0.0f;
            v[at] = ok ? kv_att_value(&L, &src, h, t, c) : 0.0f;
        }
        return;
    }
    const int t0 = (u - seq.n_blocks) * BT, n = min(BT, seq.tail_tokens - t0);
    const size_t base = (size_t)seq.n_blocks * BT + t0 - row0;
    for (int x = threadIdx.x; x < n * D; x += blockDim.x) {
        const int t = x / D, c = x - t * D;
        const size_t from = ((size_t)(t0 + t) * H + h) * D + c, to = ((base + t) * H + h) * D + c;
        k[to] = strata_half_to_float(seq.tail_k[from]);
        v[to] = strata_half_to_float(seq.tail_v[from]);
    }
}

}  // namespace

extern "C" int cuda_kv_dequantize_rows(const cuda_kv_layout *layout, const cuda_kv_seq *seq, int k0, int nk,
                                       float *d_k, float *d_v, int *d_status, strata_cuda_stream stream,
                                       strata_error *err)
{
    if (!layout || !seq || !d_k || !d_v || !d_status || layout->n_kv_heads < 1 || layout->head_dim < 1 ||
        layout->block_tokens < 1 || seq->n_blocks < 0 || seq->tail_tokens < 0 || (seq->n_blocks && !seq->blocks) ||
        (seq->tail_tokens && (!seq->tail_k || !seq->tail_v)))
        return strata_fail(err, STRATA_EINVAL, "cuda_kv_dequantize_rows: bad arguments");
    const int BT = layout->block_tokens;
    const long total = (long)seq->n_blocks * BT + seq->tail_tokens;
    if (k0 < 0 || nk < 1 || k0 + (long)nk > total || k0 % BT || ((k0 + nk) % BT && k0 + (long)nk != total))
        return strata_fail(err, STRATA_EINVAL, "cuda_kv_dequantize_rows: rows [%d, %ld) of a view of %ld, in pieces of %d",
                           k0, k0 + (long)nk, total, BT);
    if (layout->n_kv_heads > 65535)
        return strata_fail(err, STRATA_EINVAL, "cuda_kv_dequantize_rows: %d KV heads", layout->n_kv_heads);
    const int pieces = (nk + BT - 1) / BT;
    dequantize<<<dim3((unsigned)pieces, (unsigned)layout->n_kv_heads), kThreads, 0,
                 reinterpret_cast<cudaStream_t>(stream)>>>(*layout, *seq, k0 / BT, d_k, d_v, d_status);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return strata_fail(err, STRATA_EIO, "cuda_kv_dequantize_rows: launch: %s", cudaGetErrorString(e));
    return STRATA_OK;
}

extern "C" int cuda_kv_dequantize_view(const cuda_kv_layout *layout, const cuda_kv_seq *seq, float *d_k, float *d_v,
                                       int *d_status, strata_cuda_stream stream, strata_error *err)
{
    if (!seq)
        return strata_fail(err, STRATA_EINVAL, "cuda_kv_dequantize_view: bad arguments");
    const long total = layout ? (long)seq->n_blocks * layout->block_tokens + seq->tail_tokens : 0;
    if (total > 0x7fffffffL)
        return strata_fail(err, STRATA_EINVAL, "cuda_kv_dequantize_view: %ld positions", total);
    if (layout && total == 0)
        return STRATA_OK;
    return cuda_kv_dequantize_rows(layout, seq, 0, (int)total, d_k, d_v, d_status, stream, err);
}
