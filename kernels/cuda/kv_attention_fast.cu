// Staged decode attention over paged blocks: fp16 and KIVI (2 or 4 bits) pools, head_dim 64 or
// 128, up to 8 query heads per KV head (kernels/cuda/kv_attention_fast.h).
//
// Why a second kernel: the generic one (kv_attention.cu) reached 3-4 % of the H100's copy
// bandwidth (docs/benchmarks.md, session 8): it reads every element with byte loads, converts
// halves in software and pays six barriers per block with most threads idle. This one:
//   - copies each block's slices for its KV head into shared memory with 16-byte cp.async,
//     double-buffered, so the next block's bytes are in flight while this one is computed;
//   - checks the headers of up to 128 blocks at once (one per thread) before any of their
//     bytes are staged, so a wrong table entry is still reported and never read past its header;
//   - keeps the thread's slice of the queries and of the value sums in registers for the whole
//     split (thread = channel slice x token part), reduces scores through padded shared memory
//     and does the online softmax a warp per query head with shuffles;
//   - takes KIVI's scale and zero out of the inner loops: per channel the queries are scaled once
//     (q * scale) and the zero term summed once per group, so a code costs a shift, a mask, an
//     exact int-to-float (exponent trick) and one FMA per query head; values likewise fold the
//     token's scale into its weight;
//   - for KIVI, stages the fp16 tail 16 rows at a time and caps registers at 128 (up to 4 query
//     heads per KV head), so four thread blocks fit a multiprocessor: that path is bound by
//     instructions and latency, not bytes (docs/gpu.md, "Kernel notes", has the measurements).
// Arithmetic is fp32 throughout, as in the CPU kernel; only the order of the sums differs. No CPU
// emulation (shuffles, cp.async): test_cuda_attention checks it on a GPU against fp64 and the CPU
// kernel, and strata-bench-attention --generic against the generic kernel.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>

#include "kernels/cuda/kv_attention_block.h"
#include "kernels/cuda/kv_attention_fast.h"
#include "kernels/cuda/split_launch.h"
#include "kernels/cuda/stage_copy.h"
#include "kvstore/kv_cache.h"

namespace {

constexpr int kThreads = 128;
constexpr int kSlices = 16;                  // channel slices: thread % kSlices
constexpr int kParts = kThreads / kSlices;   // token parts: thread / kSlices (octets for scores)
constexpr int kMaxTokens = 64;               // tokens per block the stage holds
constexpr int kWindow = kThreads;            // blocks whose headers are checked at once

__host__ __device__ constexpr size_t align16(size_t x) { return (x + 15) & ~(size_t)15; }

// fp16 rows a step holds: a whole block in an fp16 pool; in a KIVI pool (where only the tail is
// fp16) 16, so that the stage is sized for the KIVI block (6-10 KiB) rather than for 64 fp16 rows
// (32 KiB), and more thread blocks fit a multiprocessor.
__host__ __device__ constexpr int fp16_rows(bool kivi, int block_tokens) { return kivi && block_tokens > 16 ? 16 : block_tokens; }

// Where a KIVI block's four backbone sections go in a stage buffer (the fp16 layout is
// K rows [BT][D] then V rows [BT][D]).
struct KiviStage {
    int k_row_bytes, k_groups, v_row_bytes, v_groups;   // per channel row / per token row
    size_t off_kz, off_vc, off_vz, bytes;
};

__host__ __device__ inline KiviStage kivi_stage(const cuda_kv_layout &L)
{
    KiviStage s;
    const int D = L.head_dim, BT = L.block_tokens;
    s.k_row_bytes = BT * L.k_bits / 8;
    s.k_groups = L.k_group > 0 ? BT / L.k_group : 1;
    s.v_row_bytes = D * L.v_bits / 8;
    s.v_groups = L.v_group > 0 ? D / L.v_group : 1;
    s.off_kz = align16((size_t)D * s.k_row_bytes);
    s.off_vc = s.off_kz + align16((size_t)D * s.k_groups * 4);
    s.off_vz = s.off_vc + align16((size_t)BT * s.v_row_bytes);
    s.bytes = s.off_vz + align16((size_t)BT * s.v_groups * 4);
    return s;
}

__host__ __device__ inline size_t stage_bytes(const cuda_kv_layout &L)
{
    const bool is_kivi = L.codec == KV_CODEC_KIVI;
    const size_t fp16 = 2 * (size_t)fp16_rows(is_kivi, L.block_tokens) * L.head_dim * 2;   // the tail's rows
    const size_t kivi = is_kivi ? kivi_stage(L).bytes : 0;
    return align16(fp16 > kivi ? fp16 : kivi);
}

// Floats of the reduction area: score partials [slice][GT][BT (+4 padding per slice)], later the
// value partials [part][GT][D].
__host__ __device__ inline size_t red_floats(int D, int BT, int GT)
{
    const size_t scores = (size_t)kSlices * (GT * BT + 4), values = (size_t)kParts * GT * D;
    return scores > values ? scores : values;
}

__host__ __device__ inline size_t smem_bytes(const cuda_kv_layout &L, int GT)
{
    return 2 * stage_bytes(L) + (red_floats(L.head_dim, L.block_tokens, GT) + (size_t)kMaxTokens * GT + 3 * GT) * 4 +
           kWindow * sizeof(int);
}

// One step of a split: a block of the pool's codec, or up to BT fp16 rows of the tail.
struct Step {
    const uint8_t *blk;      // a block, or NULL
    const uint8_t *k, *v;    // else: fp16 rows [t][H][D] from the step's first token
    int n;                   // tokens; 0: nothing to do (a rejected block)
};

// Starts the copies of a step's bytes for KV head h into stage buffer dst.
template <bool KIVI>
__device__ void stage_step(const cuda_kv_layout &L, const Step &st, int h, uint8_t *dst)
{
    if (st.n <= 0)
        return;
    const int D = L.head_dim, BT = L.block_tokens, H = L.n_kv_heads;
    if (KIVI && st.blk) {
        const KiviStage ks = kivi_stage(L);
        const int t = threadIdx.x;
        stage_rows(dst, st.blk + L.off_k + (size_t)h * D * ks.k_row_bytes, 1, D * ks.k_row_bytes, 0, t, kThreads);
        stage_rows(dst + ks.off_kz, st.blk + L.off_k_scales + (size_t)h * D * ks.k_groups * 4, 1, D * ks.k_groups * 4,
                   0, t, kThreads);
        stage_rows(dst + ks.off_vc, st.blk + L.off_v + (size_t)h * ks.v_row_bytes, BT, ks.v_row_bytes,
                   (size_t)H * ks.v_row_bytes, t, kThreads);
        stage_rows(dst + ks.off_vz, st.blk + L.off_v_scales + (size_t)h * ks.v_groups * 4, BT, ks.v_groups * 4,
                   (size_t)H * ks.v_groups * 4, t, kThreads);
        return;
    }
    const uint8_t *k = st.blk ? st.blk + L.off_k : st.k, *v = st.blk ? st.blk + L.off_v : st.v;
    const size_t stride = (size_t)H * D * 2, at = (size_t)h * D * 2;
    stage_rows(dst, k + at, st.n, D * 2, stride, threadIdx.x, kThreads);
    stage_rows(dst + (size_t)fp16_rows(KIVI, BT) * D * 2, v + at, st.n, D * 2, stride, threadIdx.x, kThreads);
}

// N consecutive halves (N = 4 or 8, 8- or 16-byte aligned in shared memory) as floats.
template <int N>
__device__ inline void load_halves(const __half *p, float *out)
{
    if (N == 8) {
        const uint4 w = *reinterpret_cast<const uint4 *>(p);
        const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&u[i]));
            out[2 * i] = f.x;
            out[2 * i + 1] = f.y;
        }
    } else {
        const uint2 w = *reinterpret_cast<const uint2 *>(p);
        const uint32_t u[2] = {w.x, w.y};
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&u[i]));
            out[2 * i] = f.x;
            out[2 * i + 1] = f.y;
        }
    }
}

// A packed code (at most 4 bits, already shifted to bit 0) as a float, exactly: the code becomes
// the low mantissa bits of 2^23, then 2^23 is subtracted (cheaper than an int-to-float convert).
__device__ inline float code_float(uint32_t w, uint32_t mask)
{
    return __uint_as_float((w & mask) | 0x4B000000u) - 8388608.0f;
}

// (scale, zero) pair as floats.
__device__ inline float2 pair_floats(const uint8_t *p)
{
    return __half22float2(*reinterpret_cast<const __half2 *>(p));
}

// Scores of this thread's token octet over its channel slice, into red [slice][GT][BT + pad].
template <int D, int GT, bool KIVI>
__device__ void scores_phase(const cuda_kv_layout &L, const Step &st, const uint8_t *stage, const float (&qr)[GT][D / kSlices],
                             float *red)
{
    constexpr int CW = D / kSlices;
    const int BT = L.block_tokens, cs = threadIdx.x % kSlices, part = threadIdx.x / kSlices;
    if (part * 8 >= st.n)
        return;
    float s[8][GT];
#pragma unroll
    for (int t = 0; t < 8; t++)
#pragma unroll
        for (int i = 0; i < GT; i++)
            s[t][i] = 0.0f;
    if (!(KIVI && st.blk)) {
        const __half *ks = reinterpret_cast<const __half *>(stage);
#pragma unroll
        for (int t = 0; t < 8; t++) {
            float k[CW];
            load_halves<CW>(ks + (size_t)(part * 8 + t) * D + cs * CW, k);
#pragma unroll
            for (int i = 0; i < GT; i++)
#pragma unroll
                for (int j = 0; j < CW; j++)
                    s[t][i] = fmaf(qr[i][j], k[j], s[t][i]);
        }
    } else {
        const KiviStage ksg = kivi_stage(L);
        const int bits = L.k_bits, g = part * 8 / L.k_group, bit0 = part * 8 * bits;
        const uint32_t mask = (1u << bits) - 1u;
        float zero_term[GT];
#pragma unroll
        for (int i = 0; i < GT; i++)
            zero_term[i] = 0.0f;
#pragma unroll
        for (int j = 0; j < CW; j++) {
            const int c = cs * CW + j;
            const uint32_t w =
                reinterpret_cast<const uint32_t *>(stage + (size_t)c * ksg.k_row_bytes)[bit0 >> 5] >> (bit0 & 31);
            const float2 sz = pair_floats(stage + ksg.off_kz + ((size_t)c * ksg.k_groups + g) * 4);
            float qs[GT];
#pragma unroll
            for (int i = 0; i < GT; i++) {
                qs[i] = qr[i][j] * sz.x;
                zero_term[i] = fmaf(qr[i][j], sz.y, zero_term[i]);
            }
#pragma unroll
            for (int t = 0; t < 8; t++) {
                const float code = code_float(w >> (t * bits), mask);
#pragma unroll
                for (int i = 0; i < GT; i++)
                    s[t][i] = fmaf(qs[i], code, s[t][i]);
            }
        }
#pragma unroll
        for (int t = 0; t < 8; t++)
#pragma unroll
            for (int i = 0; i < GT; i++)
                s[t][i] += zero_term[i];
    }
    float *mine = red + (size_t)cs * (GT * BT + 4);
#pragma unroll
    for (int i = 0; i < GT; i++) {
        float4 *dst = reinterpret_cast<float4 *>(mine + i * BT + part * 8);
        dst[0] = make_float4(s[0][i], s[1][i], s[2][i], s[3][i]);
        dst[1] = make_float4(s[4][i], s[5][i], s[6][i], s[7][i]);
    }
}

// The online-softmax update of the step: a warp per query head, a lane per two tokens. Weights
// go to pw [token][GT], the rescale of the old sums to alpha.
template <int GT>
__device__ void softmax_phase(int BT, int n, int qpk, const float *red, float *pw, float *m, float *l, float *alpha)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int i = warp; i < GT; i += kThreads / 32) {
        const int t0 = lane, t1 = lane + 32;
        if (i >= qpk) {   // a padding head: weights 0
            if (t0 < BT)
                pw[t0 * GT + i] = 0.0f;
            if (t1 < BT)
                pw[t1 * GT + i] = 0.0f;
            if (lane == 0)
                alpha[i] = 0.0f;
            continue;
        }
        float s0 = -CUDART_INF_F, s1 = -CUDART_INF_F;
        if (t0 < n) {
            s0 = 0.0f;
#pragma unroll
            for (int cs = 0; cs < kSlices; cs++)
                s0 += red[(size_t)cs * (GT * BT + 4) + i * BT + t0];
        }
        if (t1 < n) {
            s1 = 0.0f;
#pragma unroll
            for (int cs = 0; cs < kSlices; cs++)
                s1 += red[(size_t)cs * (GT * BT + 4) + i * BT + t1];
        }
        float mx = fmaxf(s0, s1);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float m_old = m[i], m_new = fmaxf(m_old, mx);
        const float a = m_old == -CUDART_INF_F ? 0.0f : __expf(m_old - m_new);
        const float e0 = t0 < n ? __expf(s0 - m_new) : 0.0f, e1 = t1 < n ? __expf(s1 - m_new) : 0.0f;
        float sum = e0 + e1;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (t0 < BT)
            pw[t0 * GT + i] = e0;
        if (t1 < BT)
            pw[t1 * GT + i] = e1;
        __syncwarp();   // every lane has read m[i] and l[i] before lane 0 replaces them
        if (lane == 0) {
            m[i] = m_new;
            l[i] = l[i] * a + sum;
            alpha[i] = a;
        }
    }
}

// acc = alpha acc + the weighted values of this thread's token part over its channel slice.
template <int D, int GT, bool KIVI>
__device__ void values_phase(const cuda_kv_layout &L, const Step &st, const uint8_t *stage, const float *pw,
                             const float *alpha, float (&acc)[GT][D / kSlices])
{
    constexpr int CW = D / kSlices;
    const int BT = L.block_tokens, cs = threadIdx.x % kSlices, part = threadIdx.x / kSlices;
    const int rows = KIVI && st.blk ? BT : fp16_rows(KIVI, BT);
    const int per_part = rows / kParts, t_first = part * per_part;
#pragma unroll
    for (int i = 0; i < GT; i++) {
        const float a = alpha[i];
#pragma unroll
        for (int j = 0; j < CW; j++)
            acc[i][j] *= a;
    }
    if (!(KIVI && st.blk)) {
        const __half *vs = reinterpret_cast<const __half *>(stage) + (size_t)rows * D;
#pragma unroll 4
        for (int t = t_first; t < t_first + per_part && t < st.n; t++) {
            float v[CW], p[GT];
            load_halves<CW>(vs + (size_t)t * D + cs * CW, v);
#pragma unroll
            for (int i = 0; i < GT; i++)
                p[i] = pw[t * GT + i];
#pragma unroll
            for (int i = 0; i < GT; i++)
#pragma unroll
                for (int j = 0; j < CW; j++)
                    acc[i][j] = fmaf(p[i], v[j], acc[i][j]);
        }
        return;
    }
    const KiviStage ksg = kivi_stage(L);
    const int bits = L.v_bits, g = cs * CW / L.v_group, bit0 = cs * CW * bits;
    const uint32_t mask = (1u << bits) - 1u;
    float zero_term[GT];
#pragma unroll
    for (int i = 0; i < GT; i++)
        zero_term[i] = 0.0f;
#pragma unroll 4
    for (int t = t_first; t < t_first + per_part && t < st.n; t++) {
        const uint32_t w =
            reinterpret_cast<const uint32_t *>(stage + ksg.off_vc + (size_t)t * ksg.v_row_bytes)[bit0 >> 5] >> (bit0 & 31);
        const float2 sz = pair_floats(stage + ksg.off_vz + ((size_t)t * ksg.v_groups + g) * 4);
        float ps[GT];
#pragma unroll
        for (int i = 0; i < GT; i++) {
            const float p = pw[t * GT + i];
            ps[i] = p * sz.x;
            zero_term[i] = fmaf(p, sz.y, zero_term[i]);
        }
#pragma unroll
        for (int j = 0; j < CW; j++) {
            const float code = code_float(w >> (j * bits), mask);
#pragma unroll
            for (int i = 0; i < GT; i++)
                acc[i][j] = fmaf(ps[i], code, acc[i][j]);
        }
    }
#pragma unroll
    for (int i = 0; i < GT; i++)
#pragma unroll
        for (int j = 0; j < CW; j++)
            acc[i][j] += zero_term[i];
}

// grid (n_kv_heads, n_splits, n_seqs), kThreads threads: the split's blocks (then the tail, when
// the split holds the last unit) for the query heads of one KV head. GT: query heads per KV head
// rounded up to a compiled count (the extra heads are zero and never written).
// Four thread blocks a multiprocessor for KIVI with up to 4 query heads per KV head (it is bound
// by latency, not bytes: more warps hide it), two otherwise (fp16 is bound by bytes already; 8
// heads would spill).
template <int D, int GT, bool KIVI>
__global__ void __launch_bounds__(kThreads, (KIVI && GT <= 4) ? 4 : 2)
    attend_staged(cuda_kv_layout L, cuda_kv_plan P, const cuda_kv_seq *seqs, const float *q, float *ws_acc, float *ws_ml,
                  int *status)
{
    constexpr int CW = D / kSlices;
    extern __shared__ __align__(16) uint8_t smem[];
    const int BT = L.block_tokens, H = L.n_kv_heads, qpk = P.n_q_heads / H;
    const int kvh = blockIdx.x, split = blockIdx.y, si = blockIdx.z;
    const int tid = threadIdx.x, cs = tid % kSlices, part = tid / kSlices;
    const cuda_kv_seq seq = seqs[si];
    const size_t row0 = (size_t)si * P.n_q_heads + (size_t)kvh * qpk;

    const size_t sb = stage_bytes(L);
    uint8_t *stage = smem;   // two buffers of sb bytes
    float *red = reinterpret_cast<float *>(smem + 2 * sb);
    float *pw = red + red_floats(D, BT, GT);
    float *m = pw + kMaxTokens * GT, *l = m + GT, *alpha = l + GT;
    int *flags = reinterpret_cast<int *>(alpha + GT);

    float qr[GT][CW], acc[GT][CW];
    const float inv_sqrt_d = 1.0f / sqrtf((float)D);
#pragma unroll
    for (int i = 0; i < GT; i++)
#pragma unroll
        for (int j = 0; j < CW; j++) {
            qr[i][j] = i < qpk ? q[(row0 + i) * D + cs * CW + j] * inv_sqrt_d : 0.0f;
            acc[i][j] = 0.0f;
        }
    if (tid < GT) {
        m[tid] = -CUDART_INF_F;
        l[tid] = 0.0f;
    }

    const int first = split * P.blocks_per_split;
    const int last = min(first + P.blocks_per_split, seq.n_blocks + 1);   // the tail is the last unit
    for (int w0 = first; w0 < last; w0 += kWindow) {
        const int w_end = min(last, w0 + kWindow);
        __syncthreads();   // the previous window's flags are no longer read
        {
            const int u = w0 + tid;
            int bad = 0;
            if (u < w_end && u < seq.n_blocks) {
                bad = kv_att_block_status(&L, seq.blocks[u], u);
                if (bad)
                    atomicExch(status, bad);
            }
            flags[tid] = bad;
        }
        __syncthreads();
        const int n_block_steps = max(0, min(w_end, seq.n_blocks) - w0);
        const int tail_rows = fp16_rows(KIVI, BT);
        const int tail_steps = w_end > seq.n_blocks ? (seq.tail_tokens + tail_rows - 1) / tail_rows : 0;
        const int n_steps = n_block_steps + tail_steps;
        auto step_at = [&](int s) {
            Step st;
            if (s < n_block_steps) {
                st.blk = seq.blocks[w0 + s];
                st.k = st.v = nullptr;
                st.n = flags[s] ? 0 : BT;
            } else {
                const int t0 = (s - n_block_steps) * tail_rows;
                const size_t at = (size_t)t0 * H * D;
                st.blk = nullptr;
                st.k = reinterpret_cast<const uint8_t *>(seq.tail_k + at);
                st.v = reinterpret_cast<const uint8_t *>(seq.tail_v + at);
                st.n = min(tail_rows, seq.tail_tokens - t0);
            }
            return st;
        };
        if (n_steps > 0)
            stage_step<KIVI>(L, step_at(0), kvh, stage);
        stage_commit();
        for (int s = 0; s < n_steps; s++) {
            if (s + 1 < n_steps)
                stage_step<KIVI>(L, step_at(s + 1), kvh, stage + ((s + 1) & 1) * sb);
            stage_commit();
            stage_wait_prev();
            __syncthreads();   // step s's bytes are in the stage for every thread
            const Step st = step_at(s);
            if (st.n > 0) {
                const uint8_t *buf = stage + (s & 1) * sb;
                scores_phase<D, GT, KIVI>(L, st, buf, qr, red);
                __syncthreads();
                softmax_phase<GT>(BT, st.n, qpk, red, pw, m, l, alpha);
                __syncthreads();
                values_phase<D, GT, KIVI>(L, st, buf, pw, alpha, acc);
            }
            __syncthreads();   // the buffer and the partials may be reused
        }
    }

    // Value sums of the token parts added up: [part][GT][D] in the reduction area.
    __syncthreads();
#pragma unroll
    for (int i = 0; i < GT; i++)
#pragma unroll
        for (int j = 0; j < CW; j++)
            red[((size_t)part * GT + i) * D + cs * CW + j] = acc[i][j];
    __syncthreads();
    for (int x = tid; x < qpk * D; x += kThreads) {
        const int i = x / D, c = x - i * D;
        float sum = 0.0f;
#pragma unroll
        for (int p = 0; p < kParts; p++)
            sum += red[((size_t)p * GT + i) * D + c];
        ws_acc[((row0 + i) * P.n_splits + split) * D + c] = sum;
    }
    if (tid < qpk) {
        const size_t at = (row0 + tid) * P.n_splits + split;
        ws_ml[2 * at] = m[tid];
        ws_ml[2 * at + 1] = l[tid];
    }
}

template <int D, int GT, bool KIVI>
int launch(const cuda_kv_layout &L, const cuda_kv_plan &P, const cuda_kv_seq *seqs, const float *q, float *ws_acc,
           float *ws_ml, int *status, cudaStream_t st, strata_error *err)
{
    return launch_split(attend_staged<D, GT, KIVI>, "attend_staged", kThreads, smem_bytes(L, GT), L, P, seqs, q, ws_acc,
                        ws_ml, status, st, err);
}

template <int D, bool KIVI>
int launch_g(const cuda_kv_layout &L, const cuda_kv_plan &P, const cuda_kv_seq *seqs, const float *q, float *ws_acc,
             float *ws_ml, int *status, cudaStream_t st, strata_error *err)
{
    switch (P.n_q_heads / L.n_kv_heads) {
    case 1: return launch<D, 1, KIVI>(L, P, seqs, q, ws_acc, ws_ml, status, st, err);
    case 2: return launch<D, 2, KIVI>(L, P, seqs, q, ws_acc, ws_ml, status, st, err);
    case 3: return launch<D, 3, KIVI>(L, P, seqs, q, ws_acc, ws_ml, status, st, err);
    case 4: return launch<D, 4, KIVI>(L, P, seqs, q, ws_acc, ws_ml, status, st, err);
    default: return launch<D, 8, KIVI>(L, P, seqs, q, ws_acc, ws_ml, status, st, err);
    }
}

}  // namespace

bool kv_att_fast_eligible(const cuda_kv_layout *L, int qpk)
{
    const int D = L->head_dim, BT = L->block_tokens;
    if ((D != 64 && D != 128) || qpk < 1 || qpk > 8 || (BT != 16 && BT != 32 && BT != 64))
        return false;
    if (L->codec == KV_CODEC_FP16)
        return true;
    if (L->codec != KV_CODEC_KIVI)
        return false;
    const int cw = D / kSlices;
    // A token octet within one key group and a channel slice within one value group; code rows
    // whole 32-bit words.
    return (L->k_bits == 2 || L->k_bits == 4) && (L->v_bits == 2 || L->v_bits == 4) && L->k_group >= 8 &&
           L->k_group % 8 == 0 && BT % L->k_group == 0 && L->v_group >= cw && L->v_group % cw == 0 &&
           D % L->v_group == 0 && BT * L->k_bits % 32 == 0 && D * L->v_bits % 32 == 0;
}

size_t kv_att_fast_smem(const cuda_kv_layout *L, int qpk)
{
    return smem_bytes(*L, qpk <= 4 ? qpk : 8);   // the query-head tile launch_g picks
}

int kv_att_fast_launch(const cuda_kv_layout *L, const cuda_kv_plan *P, const cuda_kv_seq *seqs,
                       const float *q, float *ws_acc, float *ws_ml, int *status, void *stream,
                       strata_error *err)
{
    const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    const bool kivi = L->codec == KV_CODEC_KIVI;
    if (L->head_dim == 64)
        return kivi ? launch_g<64, true>(*L, *P, seqs, q, ws_acc, ws_ml, status, st, err)
                    : launch_g<64, false>(*L, *P, seqs, q, ws_acc, ws_ml, status, st, err);
    return kivi ? launch_g<128, true>(*L, *P, seqs, q, ws_acc, ws_ml, status, st, err)
                : launch_g<128, false>(*L, *P, seqs, q, ws_acc, ws_ml, status, st, err);
}
