// Decode attention over paged compressed blocks (see kernels/cuda_kv_attention.h).
//
// First version, written to be right before it is fast: one thread block per (KV head, split,
// sequence); per block of the table it (1) writes the scores of the block's tokens for every
// query head of the group into shared memory, a thread per token, (2) updates the running max
// and normalizer of the online softmax, a warp per query head, (3) adds the weighted values, a
// thread per channel. Codes are unpacked and dequantized in registers as they are read. Known
// costs that the GPU session should measure before tuning (docs/gpu.md): at 2 bits the
// fp32 FMAs per code (one per query head of the group) rather than the bytes bound the kernel,
// and the key reads are word broadcasts within a warp, not 16-byte loads.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>

#include "kernels/cuda_kv_attention.h"
#include "kvstore/kv_cache.h"

namespace {

constexpr int kThreads = 128;
constexpr int kMaxQpk = 16;     // query heads per KV head (cuda_kv_attention_plan checks)
constexpr int kWarps = kThreads / 32;

enum Status { kStatusMismatch = 1, kStatusNullBlock = 2 };

__device__ __forceinline__ uint32_t load_u32(const uint8_t *p) { return *reinterpret_cast<const uint32_t *>(p); }

__device__ __forceinline__ float half_at(const uint8_t *p) { return __half2float(*reinterpret_cast<const __half *>(p)); }

// A (scale, zero) pair: f16 scale in the low half of the little-endian word, zero in the high.
__device__ __forceinline__ float2 scale_zero(const uint8_t *p)
{
    const uint32_t w = load_u32(p);
    return make_float2(__half2float(__ushort_as_half((unsigned short)(w & 0xffffu))),
                       __half2float(__ushort_as_half((unsigned short)(w >> 16))));
}

// Code i of a packed row of B-bit codes (docs/format.md section 4, "Packing").
__device__ __forceinline__ float code_at(const uint8_t *row, int i, int bits)
{
    const int per_word = 32 / bits;
    const uint32_t w = load_u32(row + 4 * (i / per_word));
    return (float)((w >> ((i % per_word) * bits)) & ((1u << bits) - 1u));
}

// Key of token t, KV head h, channel c in a block of the layout's codec.
template <int CODEC>
__device__ __forceinline__ float block_key(const cuda_kv_layout &L, const uint8_t *blk, int h, int t, int c)
{
    if constexpr (CODEC == KV_CODEC_FP16) {
        return half_at(blk + L.off_k + 2 * (((size_t)t * L.n_kv_heads + h) * L.head_dim + c));
    } else {
        const size_t r = (size_t)h * L.head_dim + c;  // channel-major row
        const size_t row_bytes = (size_t)L.block_tokens * L.k_bits / 8;
        const int n_groups = L.block_tokens / L.k_group;
        const float2 sz = scale_zero(blk + L.off_k_scales + 4 * (r * n_groups + t / L.k_group));
        return code_at(blk + L.off_k + r * row_bytes, t, L.k_bits) * sz.x + sz.y;
    }
}

template <int CODEC>
__device__ __forceinline__ float block_value(const cuda_kv_layout &L, const uint8_t *blk, int h, int t, int c)
{
    if constexpr (CODEC == KV_CODEC_FP16) {
        return half_at(blk + L.off_v + 2 * (((size_t)t * L.n_kv_heads + h) * L.head_dim + c));
    } else {
        const size_t r = (size_t)t * L.n_kv_heads + h;  // token-major row
        const size_t row_bytes = (size_t)L.head_dim * L.v_bits / 8;
        const int n_groups = L.head_dim / L.v_group;
        const float2 sz = scale_zero(blk + L.off_v_scales + 4 * (r * n_groups + c / L.v_group));
        return code_at(blk + L.off_v + r * row_bytes, c, L.v_bits) * sz.x + sz.y;
    }
}

// The block's header against the layout: a wrong table entry (another layer, another position,
// a freed slot reused) shows up here instead of as silently wrong attention.
__device__ bool block_matches(const cuda_kv_layout &L, const uint8_t *blk, int index)
{
    const uint64_t first_pos = (uint64_t)load_u32(blk + 24) | ((uint64_t)load_u32(blk + 28) << 32);
    return load_u32(blk + 0) == 0x42564b53u && load_u32(blk + 8) == L.block_bytes && blk[12] == (uint8_t)L.codec &&
           blk[13] == (uint8_t)L.k_bits && blk[14] == (uint8_t)L.v_bits && load_u32(blk + 16) == L.layer &&
           load_u32(blk + 20) == (uint32_t)L.block_tokens &&
           first_pos == (uint64_t)index * (uint64_t)L.block_tokens;
}

struct Shared {
    float *q;      // [qpk][D], pre-scaled by 1/sqrt(D)
    float *acc;    // [qpk][D]
    float *p;      // [qpk][block_tokens]: scores, then softmax weights
    float *m;      // [qpk] running max
    float *l;      // [qpk] running normalizer
    float *alpha;  // [qpk] rescale of the previous sums for this chunk
};

// One chunk of n tokens (a block, or up to block_tokens tokens of the tail) through the three
// phases. KEY(t, c) and VALUE(t, c) read the chunk's token t.
template <typename Key, typename Value>
__device__ void attend_chunk(const Shared &s, int qpk, int D, int stride_p, int n, Key key, Value value)
{
    for (int t = threadIdx.x; t < n; t += blockDim.x) {
        float dot[kMaxQpk];
#pragma unroll
        for (int i = 0; i < kMaxQpk; i++)
            dot[i] = 0.0f;
        for (int c = 0; c < D; c++) {
            const float k = key(t, c);
#pragma unroll
            for (int i = 0; i < kMaxQpk; i++)
                if (i < qpk)
                    dot[i] = fmaf(s.q[i * D + c], k, dot[i]);
        }
#pragma unroll
        for (int i = 0; i < kMaxQpk; i++)
            if (i < qpk)
                s.p[i * stride_p + t] = dot[i];
    }
    __syncthreads();

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int i = warp; i < qpk; i += kWarps) {
        float *p = s.p + i * stride_p;
        float mx = -CUDART_INF_F;
        for (int t = lane; t < n; t += 32)
            mx = fmaxf(mx, p[t]);
        for (int o = 16; o > 0; o >>= 1)
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float m_old = s.m[i];
        const float m_new = fmaxf(m_old, mx);
        float sum = 0.0f;
        for (int t = lane; t < n; t += 32) {
            const float e = __expf(p[t] - m_new);
            p[t] = e;
            sum += e;
        }
        for (int o = 16; o > 0; o >>= 1)
            sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (lane == 0) {
            const float alpha = m_old == -CUDART_INF_F ? 0.0f : __expf(m_old - m_new);
            s.alpha[i] = alpha;
            s.l[i] = s.l[i] * alpha + sum;
            s.m[i] = m_new;
        }
    }
    __syncthreads();

    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        float a[kMaxQpk];
#pragma unroll
        for (int i = 0; i < kMaxQpk; i++)
            a[i] = i < qpk ? s.acc[i * D + c] * s.alpha[i] : 0.0f;
        for (int t = 0; t < n; t++) {
            const float v = value(t, c);
#pragma unroll
            for (int i = 0; i < kMaxQpk; i++)
                if (i < qpk)
                    a[i] = fmaf(s.p[i * stride_p + t], v, a[i]);
        }
#pragma unroll
        for (int i = 0; i < kMaxQpk; i++)
            if (i < qpk)
                s.acc[i * D + c] = a[i];
    }
    __syncthreads();
}

// grid (n_kv_heads, n_splits, n_seqs). Writes the split's partial sums: acc [seq][q head][split][D]
// then (max, normalizer) pairs [seq][q head][split][2].
template <int CODEC>
__global__ void __launch_bounds__(kThreads) attend_split(cuda_kv_layout L, cuda_kv_plan P, const cuda_kv_seq *seqs,
                                                         const float *q, float *ws_acc, float *ws_ml, int *status)
{
    extern __shared__ float smem[];
    const int D = L.head_dim, BT = L.block_tokens, H = L.n_kv_heads;
    const int qpk = P.n_q_heads / H;
    const int kvh = blockIdx.x, split = blockIdx.y, si = blockIdx.z;
    const cuda_kv_seq seq = seqs[si];

    Shared s;
    s.q = smem;
    s.acc = s.q + qpk * D;
    s.p = s.acc + qpk * D;
    s.m = s.p + qpk * BT;
    s.l = s.m + qpk;
    s.alpha = s.l + qpk;
    __shared__ int block_ok;

    const float inv_sqrt_d = rsqrtf((float)D);
    const float *qs = q + ((size_t)si * P.n_q_heads + (size_t)kvh * qpk) * D;
    for (int x = threadIdx.x; x < qpk * D; x += blockDim.x) {
        s.q[x] = qs[x] * inv_sqrt_d;
        s.acc[x] = 0.0f;
    }
    for (int i = threadIdx.x; i < qpk; i += blockDim.x) {
        s.m[i] = -CUDART_INF_F;
        s.l[i] = 0.0f;
    }
    __syncthreads();

    const int first = split * P.blocks_per_split;
    const int units = seq.n_blocks + 1;  // the tail is the last unit
    const int last = min(first + P.blocks_per_split, units);
    for (int u = first; u < last; u++) {
        if (u < seq.n_blocks) {
            const uint8_t *blk = seq.blocks[u];
            if (threadIdx.x == 0) {
                int bad = 0;
                if (!blk || ((uintptr_t)blk & 15u))
                    bad = kStatusNullBlock;
                else if (!block_matches(L, blk, u))
                    bad = kStatusMismatch;
                if (bad)
                    atomicExch(status, bad);
                block_ok = !bad;
            }
            __syncthreads();
            if (!block_ok)
                continue;
            attend_chunk(
                s, qpk, D, BT, BT, [&](int t, int c) { return block_key<CODEC>(L, blk, kvh, t, c); },
                [&](int t, int c) { return block_value<CODEC>(L, blk, kvh, t, c); });
        } else {
            for (int t0 = 0; t0 < seq.tail_tokens; t0 += BT) {
                const int n = min(BT, seq.tail_tokens - t0);
                const uint16_t *tk = seq.tail_k, *tv = seq.tail_v;
                attend_chunk(
                    s, qpk, D, BT, n,
                    [&](int t, int c) {
                        return __half2float(__ushort_as_half(tk[((size_t)(t0 + t) * H + kvh) * D + c]));
                    },
                    [&](int t, int c) {
                        return __half2float(__ushort_as_half(tv[((size_t)(t0 + t) * H + kvh) * D + c]));
                    });
            }
        }
    }

    for (int i = 0; i < qpk; i++) {
        const size_t part = ((size_t)si * P.n_q_heads + (size_t)kvh * qpk + i) * P.n_splits + split;
        for (int c = threadIdx.x; c < D; c += blockDim.x)
            ws_acc[part * D + c] = s.acc[i * D + c];
        if (threadIdx.x == 0) {
            ws_ml[2 * part] = s.m[i];
            ws_ml[2 * part + 1] = s.l[i];
        }
    }
}

// grid (n_q_heads, n_seqs): out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M).
__global__ void __launch_bounds__(kThreads) merge_splits(cuda_kv_plan P, int D, const float *ws_acc, const float *ws_ml,
                                                         float *out)
{
    const size_t row = (size_t)blockIdx.y * P.n_q_heads + blockIdx.x;
    const float *ml = ws_ml + 2 * row * P.n_splits;
    float M = -CUDART_INF_F;
    for (int sp = 0; sp < P.n_splits; sp++)
        if (ml[2 * sp + 1] > 0.0f || isnan(ml[2 * sp + 1]))
            M = fmaxf(M, ml[2 * sp]);
    float L = 0.0f;
    for (int sp = 0; sp < P.n_splits; sp++)
        if (ml[2 * sp + 1] != 0.0f)
            L += ml[2 * sp + 1] * __expf(ml[2 * sp] - M);
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        float a = 0.0f;
        for (int sp = 0; sp < P.n_splits; sp++)
            if (ml[2 * sp + 1] != 0.0f)
                a += ws_acc[(row * P.n_splits + sp) * D + c] * __expf(ml[2 * sp] - M);
        out[row * D + c] = L != 0.0f ? a / L : 0.0f;
    }
}

constexpr int kPrefillChunk = 64;

// grid (n_kv_heads, n): query token i of the group kvh over keys 0..i in chunks, the same
// online softmax as decode. Reads every earlier key once per query token: a first version,
// quadratic in bytes (docs/gpu.md).
__global__ void __launch_bounds__(kThreads) prefill_causal(const float *q, const uint16_t *k, const uint16_t *v,
                                                           int nq, int nkv, int D, float *out)
{
    extern __shared__ float smem[];
    const int qpk = nq / nkv, kvh = blockIdx.x, i = blockIdx.y;
    Shared s;
    s.q = smem;
    s.acc = s.q + qpk * D;
    s.p = s.acc + qpk * D;
    s.m = s.p + qpk * kPrefillChunk;
    s.l = s.m + qpk;
    s.alpha = s.l + qpk;
    const float inv_sqrt_d = rsqrtf((float)D);
    const float *qs = q + ((size_t)i * nq + (size_t)kvh * qpk) * D;
    for (int x = threadIdx.x; x < qpk * D; x += blockDim.x) {
        s.q[x] = qs[x] * inv_sqrt_d;
        s.acc[x] = 0.0f;
    }
    for (int h = threadIdx.x; h < qpk; h += blockDim.x) {
        s.m[h] = -CUDART_INF_F;
        s.l[h] = 0.0f;
    }
    __syncthreads();
    for (int t0 = 0; t0 <= i; t0 += kPrefillChunk) {
        const int n = min(kPrefillChunk, i + 1 - t0);
        attend_chunk(
            s, qpk, D, kPrefillChunk, n,
            [&](int t, int c) { return __half2float(__ushort_as_half(k[((size_t)(t0 + t) * nkv + kvh) * D + c])); },
            [&](int t, int c) { return __half2float(__ushort_as_half(v[((size_t)(t0 + t) * nkv + kvh) * D + c])); });
    }
    for (int h = 0; h < qpk; h++) {
        float *o = out + ((size_t)i * nq + (size_t)kvh * qpk + h) * D;
        for (int c = threadIdx.x; c < D; c += blockDim.x)
            o[c] = s.acc[h * D + c] / s.l[h];
    }
}

int launch_failed(strata_error *err, const char *what)
{
    const cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess)
        return STRATA_OK;
    return strata_fail(err, STRATA_EIO, "CUDA attention: %s: %s", what, cudaGetErrorString(e));
}

template <int CODEC>
int launch_split(const cuda_kv_layout *L, const cuda_kv_plan *P, const cuda_kv_seq *seqs, const float *q,
                 float *ws_acc, float *ws_ml, int *status, size_t smem, cudaStream_t stream, strata_error *err)
{
    if (smem > 48 * 1024 &&
        cudaFuncSetAttribute(attend_split<CODEC>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) != cudaSuccess)
        return launch_failed(err, "raising the shared-memory limit");
    const dim3 grid((unsigned)L->n_kv_heads, (unsigned)P->n_splits, (unsigned)P->n_seqs);
    attend_split<CODEC><<<grid, kThreads, smem, stream>>>(*L, *P, seqs, q, ws_acc, ws_ml, status);
    return launch_failed(err, "attend_split");
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
    if (layout->codec == KV_CODEC_KIVI &&
        (layout->k_group < 1 || layout->v_group < 1 || layout->block_tokens % layout->k_group != 0 ||
         D % layout->v_group != 0 || (layout->k_bits != 2 && layout->k_bits != 4) ||
         (layout->v_bits != 2 && layout->v_bits != 4)))
        return strata_fail(err, STRATA_EINVAL, "cuda_kv_attention: inconsistent KIVI layout");
    const int qpk = plan->n_q_heads / H;
    const size_t smem = (size_t)(2 * qpk * D + qpk * layout->block_tokens + 3 * qpk) * sizeof(float);
    float *ws_acc = static_cast<float *>(d_workspace);
    float *ws_ml = ws_acc + (size_t)plan->n_seqs * plan->n_q_heads * plan->n_splits * D;
    const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    int rc;
    switch (layout->codec) {
    case KV_CODEC_FP16:
        rc = launch_split<KV_CODEC_FP16>(layout, plan, d_seqs, d_q, ws_acc, ws_ml, d_status, smem, st, err);
        break;
    case KV_CODEC_KIVI:
        rc = launch_split<KV_CODEC_KIVI>(layout, plan, d_seqs, d_q, ws_acc, ws_ml, d_status, smem, st, err);
        break;
    default:
        return strata_fail(err, STRATA_EUNSUPPORTED, "cuda_kv_attention: codec %d", layout->codec);
    }
    if (rc != STRATA_OK)
        return rc;
    merge_splits<<<dim3((unsigned)plan->n_q_heads, (unsigned)plan->n_seqs), kThreads, 0, st>>>(*plan, D, ws_acc, ws_ml,
                                                                                              d_out);
    return launch_failed(err, "merge_splits");
}

extern "C" int cuda_attention_prefill(const float *d_q, const uint16_t *d_k, const uint16_t *d_v, int n, int n_q_heads,
                                      int n_kv_heads, int head_dim, float *d_out, strata_cuda_stream stream,
                                      strata_error *err)
{
    if (!d_q || !d_k || !d_v || !d_out || n < 1 || n > 65535 || n_kv_heads < 1 || n_q_heads % n_kv_heads != 0 ||
        n_q_heads / n_kv_heads > kMaxQpk || head_dim < 1 || head_dim > 256)
        return strata_fail(err, STRATA_EINVAL,
                           "cuda_attention_prefill: %d tokens (1..65535), %d query / %d KV heads, head_dim %d", n,
                           n_q_heads, n_kv_heads, head_dim);
    const int qpk = n_q_heads / n_kv_heads;
    const size_t smem = (size_t)(2 * qpk * head_dim + qpk * kPrefillChunk + 3 * qpk) * sizeof(float);
    if (smem > 48 * 1024 &&
        cudaFuncSetAttribute(prefill_causal, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) != cudaSuccess)
        return launch_failed(err, "raising the shared-memory limit");
    prefill_causal<<<dim3((unsigned)n_kv_heads, (unsigned)n), kThreads, smem, reinterpret_cast<cudaStream_t>(stream)>>>(
        d_q, d_k, d_v, n_q_heads, n_kv_heads, head_dim, d_out);
    return launch_failed(err, "prefill_causal");
}
