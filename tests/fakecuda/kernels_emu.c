/* The CUDA kernels' entry points (kernels/cuda_*.h) for the fake device: each launch runs the
 * kernel's thread blocks one after another and, inside a block, each phase for every thread
 * before the next phase (what the barriers guarantee), through the same phase functions the .cu
 * kernels call (the kernels/cuda *_block.h headers). The elementwise ops (kernels/cuda/ops.cu) are short
 * enough to be written out again here. Pointer arguments that the real kernels read as device
 * memory are checked to be fake device memory, so a host buffer handed to a kernel fails. */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_runtime.h"
#include "kernels/cuda/kv_attention_emu.h"
#include "kernels/cuda/kv_attention_mma_emu.h"
#include "kernels/cuda/kv_encode_block.h"
#include "kernels/cuda/kv_tail_block.h"
#include "kernels/cuda/prefill_softmax_block.h"
#include "kernels/cuda/sample_block.h"
#include "kernels/cuda_kv_attention.h"
#include "kernels/cuda_kv_encode.h"
#include "kernels/cuda_kv_tail.h"
#include "kernels/cuda_ops.h"
#include "kernels/cuda_prefill.h"
#include "kernels/cuda_sample.h"
#include "kernels/cuda_weights.h"
#include "kernels/weight_values.h"
#include "kvstore/crc32c_math.h"
#include "kvstore/half.h"

/* What the real launch wrappers' cudaGetLastError reports (fakecuda_launch): an error an earlier
 * runtime call recorded and nobody took fails this launch, the kernel not run. */
#define FAKE_LAUNCH_OR_RETURN()                                                                            \
    do {                                                                                                   \
        const cudaError_t launch_e_ = fakecuda_launch();                                                   \
        if (launch_e_ != cudaSuccess)                                                                      \
            return (int)launch_e_;                                                                         \
    } while (0)
#define FAKE_LAUNCH_OR_FAIL(err, kernel)                                                                   \
    do {                                                                                                   \
        const cudaError_t launch_e_ = fakecuda_launch();                                                   \
        if (launch_e_ != cudaSuccess)                                                                      \
            return strata_fail((err), STRATA_EIO, "CUDA %s launch: %s", (kernel),                          \
                               cudaGetErrorString(launch_e_));                                             \
    } while (0)

/* A launch's argument that must be device memory; reports and fails the launch otherwise. */
static bool dev(const void *p, size_t bytes, const char *kernel, const char *arg)
{
    if (bytes == 0 || fakecuda_is_device(p, bytes))
        return true;
    fprintf(stderr, "fakecuda: %s: %s (%zu bytes) is not device memory\n", kernel, arg, bytes);
    return false;
}

/* ---- kernels/cuda/ops.cu ---- */

int cuda_rmsnorm(const float *x, const float *weight, size_t n_rows, size_t dim, float eps, float *out,
                 strata_cuda_stream stream)
{
    FAKE_LAUNCH_OR_RETURN();
    (void)stream;
    const size_t n = n_rows * dim * sizeof(float);
    if (!dev(x, n, "rmsnorm", "x") || !dev(weight, dim * sizeof(float), "rmsnorm", "weight") ||
        !dev(out, n, "rmsnorm", "out"))
        return (int)cudaErrorInvalidValue;
    for (size_t r = 0; r < n_rows; r++) {
        const float *row = x + r * dim;
        float acc = 0.0f;
        for (size_t i = 0; i < dim; i++)
            acc += row[i] * row[i];
        const float scale = 1.0f / sqrtf(acc / (float)dim + eps);
        for (size_t i = 0; i < dim; i++)
            out[r * dim + i] = row[i] * scale * weight[i];
    }
    return 0;
}

static void rotate(float *x, size_t n_rows, size_t n_heads, size_t head_dim, const int32_t *pos, size_t pos0,
                   float theta)
{
    const size_t half = head_dim / 2;
    for (size_t t = 0; t < n_rows; t++)
        for (size_t h = 0; h < n_heads; h++)
            for (size_t i = 0; i < half; i++) {
                const double p = pos ? (double)pos[t] : (double)(pos0 + t);
                const double angle = p * pow((double)theta, -2.0 * (double)i / (double)head_dim);
                const float c = (float)cos(angle), s = (float)sin(angle);
                float *q = x + (t * n_heads + h) * head_dim + 2 * i;
                const float a = q[0], b = q[1];
                q[0] = a * c - b * s;
                q[1] = a * s + b * c;
            }
}

int cuda_rope(float *x, size_t n_tokens, size_t n_heads, size_t head_dim, size_t pos0, float theta,
              strata_cuda_stream stream)
{
    FAKE_LAUNCH_OR_RETURN();
    (void)stream;
    if (!dev(x, n_tokens * n_heads * head_dim * sizeof(float), "rope", "x"))
        return (int)cudaErrorInvalidValue;
    rotate(x, n_tokens, n_heads, head_dim, NULL, pos0, theta);
    return 0;
}

int cuda_rope_rows(float *x, size_t n_rows, size_t n_heads, size_t head_dim, const int32_t *d_pos, float theta,
                   strata_cuda_stream stream)
{
    FAKE_LAUNCH_OR_RETURN();
    (void)stream;
    if (!dev(x, n_rows * n_heads * head_dim * sizeof(float), "rope_rows", "x") ||
        !dev(d_pos, n_rows * sizeof(int32_t), "rope_rows", "positions"))
        return (int)cudaErrorInvalidValue;
    rotate(x, n_rows, n_heads, head_dim, d_pos, 0, theta);
    return 0;
}

int cuda_swiglu(const float *gate, const float *up, size_t n, float *out, strata_cuda_stream stream)
{
    FAKE_LAUNCH_OR_RETURN();
    (void)stream;
    if (!dev(gate, n * 4, "swiglu", "gate") || !dev(up, n * 4, "swiglu", "up") || !dev(out, n * 4, "swiglu", "out"))
        return (int)cudaErrorInvalidValue;
    for (size_t i = 0; i < n; i++) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
    return 0;
}

int cuda_add(float *y, const float *x, size_t n, strata_cuda_stream stream)
{
    FAKE_LAUNCH_OR_RETURN();
    (void)stream;
    if (!dev(y, n * 4, "add", "y") || !dev(x, n * 4, "add", "x"))
        return (int)cudaErrorInvalidValue;
    for (size_t i = 0; i < n; i++)
        y[i] += x[i];
    return 0;
}

int cuda_f32_to_f16(const float *src, uint16_t *dst, size_t n, strata_cuda_stream stream)
{
    FAKE_LAUNCH_OR_RETURN();
    (void)stream;
    if (!dev(src, n * 4, "f32_to_f16", "src") || !dev(dst, n * 2, "f32_to_f16", "dst"))
        return (int)cudaErrorInvalidValue;
    for (size_t i = 0; i < n; i++)
        dst[i] = strata_float_to_half(src[i]);
    return 0;
}

/* ---- kernels/cuda/weights.cu ---- */

/* The kernels' store: fp32, or fp16; true when the stored value is finite. */
static bool weights_store(void *out, bool out_f16, uint64_t i, float v)
{
    if (!out_f16) {
        ((float *)out)[i] = v;
        return isfinite(v);
    }
    const uint16_t h = strata_float_to_half(v);
    ((uint16_t *)out)[i] = h;
    return (h & 0x7c00u) != 0x7c00u;
}

int cuda_weights_from_gguf(uint32_t type, const void *d_data, uint64_t n, uint64_t first, void *out, bool out_f16,
                           unsigned long long *d_first_bad, strata_cuda_stream stream)
{
    FAKE_LAUNCH_OR_RETURN();
    (void)stream;
    uint64_t block_elems, block_bytes;
    if (!gguf_type_block(type, &block_elems, &block_bytes) || !d_data || !out || !d_first_bad)
        return (int)cudaErrorInvalidValue;
    const size_t in_bytes = (size_t)((n + block_elems - 1) / block_elems * block_bytes);
    if (!dev(d_data, in_bytes, "weights_from_gguf", "data") ||
        !dev(out, (size_t)n * (out_f16 ? 2 : 4), "weights_from_gguf", "out") ||
        !dev(d_first_bad, sizeof *d_first_bad, "weights_from_gguf", "first_bad"))
        return (int)cudaErrorInvalidValue;
    for (uint64_t i = 0; i < n; i++)
        if (!weights_store(out, out_f16, i, gguf_value(type, d_data, i)) && first + i < *d_first_bad)
            *d_first_bad = first + i;
    return 0;
}

int cuda_weights_synthetic(uint64_t key, float amp, uint64_t first, uint64_t n, void *out, bool out_f16,
                           strata_cuda_stream stream)
{
    FAKE_LAUNCH_OR_RETURN();
    (void)stream;
    if (!out || !dev(out, (size_t)n * (out_f16 ? 2 : 4), "weights_synthetic", "out"))
        return (int)cudaErrorInvalidValue;
    for (uint64_t i = 0; i < n; i++)
        weights_store(out, out_f16, i, synthetic_value(key, amp, first + i));
    return 0;
}

/* ---- kernels/cuda/prefill.cu ---- */

int cuda_f16_to_f32(const uint16_t *src, float *dst, size_t n, strata_cuda_stream stream)
{
    FAKE_LAUNCH_OR_RETURN();
    (void)stream;
    if (!dev(src, n * 2, "f16_to_f32", "src") || !dev(dst, n * 4, "f16_to_f32", "dst"))
        return (int)cudaErrorInvalidValue;
    for (size_t i = 0; i < n; i++)
        dst[i] = strata_half_to_float(src[i]);
    return 0;
}

int cuda_prefill_softmax(float *d_s, int rows, int kn, int i0, int n_heads, size_t head_stride,
                         strata_cuda_stream stream)
{
    FAKE_LAUNCH_OR_RETURN();
    (void)stream;
    enum { THREADS = 128 };
    if (rows <= 0 || n_heads <= 0)
        return 0;
    if (!dev(d_s, ((size_t)(n_heads - 1) * head_stride + (size_t)rows * (size_t)kn) * 4, "prefill_softmax", "s"))
        return (int)cudaErrorInvalidValue;
    float red_max[THREADS], red_sum[THREADS], st[2] = {0.0f, 0.0f};   /* thread 0 fills it */
    for (int h = 0; h < n_heads; h++)
        for (int r = 0; r < rows; r++) {
            float *row = d_s + (size_t)h * head_stride + (size_t)r * (size_t)kn;
            const int n_valid = i0 + r + 1 < kn ? i0 + r + 1 : kn;
            for (unsigned t = 0; t < THREADS; t++)
                pf_max_part(row, n_valid, red_max, t, THREADS);
            for (unsigned t = 0; t < THREADS; t++)
                pf_combine_max(red_max, -INFINITY, &st[0], t, THREADS);
            for (unsigned t = 0; t < THREADS; t++)
                pf_exp_share(row, n_valid, st[0], red_sum, t, THREADS);
            for (unsigned t = 0; t < THREADS; t++)
                pf_combine_sum(red_sum, &st[1], t, THREADS);
            for (unsigned t = 0; t < THREADS; t++)
                pf_normalize(row, n_valid, kn, st[1], t, THREADS);
        }
    return 0;
}

int cuda_chunk_softmax_tile(const cuda_chunk_tile *t, strata_cuda_stream stream)
{
    FAKE_LAUNCH_OR_RETURN();
    (void)stream;
    enum { THREADS = 128 };
    if (t->rows <= 0 || t->n_heads <= 0)
        return 0;
    const size_t rows_total = (size_t)(t->i0 + t->rows) * (size_t)t->n_q_heads;
    if (!dev(t->s, ((size_t)(t->n_heads - 1) * t->head_stride + (size_t)t->rows * (size_t)t->kn) * 4, "chunk_softmax",
             "s") ||
        !dev(t->m, rows_total * 4, "chunk_softmax", "m") || !dev(t->l, rows_total * 4, "chunk_softmax", "l") ||
        !dev(t->out, rows_total * (size_t)t->head_dim * 4, "chunk_softmax", "out"))
        return (int)cudaErrorInvalidValue;
    float red_max[THREADS], red_sum[THREADS], st[3] = {0.0f, 0.0f, 0.0f};   /* thread 0 fills it */
    for (int hh = 0; hh < t->n_heads; hh++)
        for (int r = 0; r < t->rows; r++) {
            float *row = t->s + (size_t)hh * t->head_stride + (size_t)r * (size_t)t->kn;
            const int n_valid = t->causal && t->i0 + r + 1 < t->kn ? t->i0 + r + 1 : t->kn;
            const size_t at = (size_t)(t->i0 + r) * (size_t)t->n_q_heads + (size_t)(t->q_head0 + hh);
            for (unsigned x = 0; x < THREADS; x++)
                pf_online_max_part(row, n_valid, t->m + at, t->l + at, t->first, red_max, st, x, THREADS);
            for (unsigned x = 0; x < THREADS; x++)
                pf_combine_max(red_max, st[0], &st[2], x, THREADS);
            for (unsigned x = 0; x < THREADS; x++)
                pf_exp_share(row, n_valid, st[2], red_sum, x, THREADS);
            for (unsigned x = 0; x < THREADS; x++)
                pf_online_finish(row, n_valid, t->kn, red_sum, st, t->first, t->out + at * t->head_dim, t->head_dim,
                                 t->m + at, t->l + at, x, THREADS);
        }
    return 0;
}

int cuda_chunk_normalize(float *d_out, const float *d_l, int n_rows, int head_dim, strata_cuda_stream stream)
{
    FAKE_LAUNCH_OR_RETURN();
    (void)stream;
    enum { THREADS = 128 };
    if (n_rows <= 0)
        return 0;
    if (!dev(d_out, (size_t)n_rows * (size_t)head_dim * 4, "chunk_normalize", "out") ||
        !dev(d_l, (size_t)n_rows * 4, "chunk_normalize", "l"))
        return (int)cudaErrorInvalidValue;
    for (int r = 0; r < n_rows; r++)
        for (unsigned x = 0; x < THREADS; x++)
            pf_divide_row(d_out + (size_t)r * (size_t)head_dim, head_dim, d_l + r, x, THREADS);
    return 0;
}

int cuda_argmax_rows(const float *x, size_t n_rows, size_t n_cols, int32_t *out, strata_cuda_stream stream)
{
    FAKE_LAUNCH_OR_RETURN();
    (void)stream;
    if (!dev(x, n_rows * n_cols * 4, "argmax", "x") || !dev(out, n_rows * 4, "argmax", "out"))
        return (int)cudaErrorInvalidValue;
    for (size_t r = 0; r < n_rows; r++) {   /* the larger value, the lower column on ties, a number over NaN */
        const float *row = x + r * n_cols;
        float bv = NAN;
        int bi = 0x7fffffff;
        for (size_t c = 0; c < n_cols; c++)
            if (!isnan(row[c]) && (isnan(bv) || row[c] > bv)) {
                bv = row[c];
                bi = (int)c;
            }
        out[r] = bi == 0x7fffffff ? 0 : bi;
    }
    return 0;
}

int cuda_first_nonfinite_rows(const float *x, size_t n_rows, size_t n_cols, int32_t *out, strata_cuda_stream stream)
{
    FAKE_LAUNCH_OR_RETURN();
    (void)stream;
    if (n_rows == 0)
        return 0;
    if (n_cols == 0 || n_cols > 0x7fffffff || !dev(x, n_rows * n_cols * 4, "first_nonfinite", "x") ||
        !dev(out, n_rows * 4, "first_nonfinite", "out"))
        return (int)cudaErrorInvalidValue;
    for (size_t r = 0; r < n_rows; r++) {
        out[r] = -1;
        for (size_t c = 0; c < n_cols; c++)
            if (!isfinite(x[r * n_cols + c])) {
                out[r] = (int32_t)c;
                break;
            }
    }
    return 0;
}

/* ---- kernels/cuda/kv_tail.cu ---- */

#define TAIL_THREADS 256u

int cuda_kv_append_rows(const cuda_kv_append_job *d_jobs, int n_jobs, const uint16_t *k16, const uint16_t *v16,
                        size_t row_elems, strata_cuda_stream stream)
{
    FAKE_LAUNCH_OR_RETURN();
    (void)stream;
    if (n_jobs <= 0)
        return 0;
    if (!dev(d_jobs, (size_t)n_jobs * sizeof *d_jobs, "append_rows", "jobs"))
        return (int)cudaErrorInvalidValue;
    for (int b = 0; b < n_jobs; b++) {
        const cuda_kv_append_job job = d_jobs[b];
        const size_t bytes = (size_t)job.n_rows * row_elems * 2;
        if (!dev(job.dst_k, bytes, "append_rows", "dst_k") || !dev(job.dst_v, bytes, "append_rows", "dst_v") ||
            !dev(k16 + (size_t)job.src_row * row_elems, bytes, "append_rows", "k16"))
            return (int)cudaErrorInvalidValue;
        for (unsigned t = 0; t < TAIL_THREADS; t++)
            kv_tail_append(&job, k16, v16, row_elems, t, TAIL_THREADS);
    }
    return 0;
}

int cuda_kv_shift_tails(const cuda_kv_shift_job *d_jobs, int n_jobs, int shift, int keep, size_t row_elems,
                        strata_cuda_stream stream)
{
    FAKE_LAUNCH_OR_RETURN();
    (void)stream;
    if (n_jobs <= 0 || keep <= 0)
        return 0;
    if (shift <= 0)
        return (int)cudaErrorInvalidValue;
    if (!dev(d_jobs, (size_t)n_jobs * sizeof *d_jobs, "shift_tails", "jobs"))
        return (int)cudaErrorInvalidValue;
    for (int b = 0; b < n_jobs; b++) {
        const cuda_kv_shift_job job = d_jobs[b];
        const size_t bytes = (size_t)(shift + keep) * row_elems * 2;
        if (!dev(job.k, bytes, "shift_tails", "k") || !dev(job.v, bytes, "shift_tails", "v"))
            return (int)cudaErrorInvalidValue;
        for (int r0 = 0; r0 < keep; r0 += shift)
            for (unsigned t = 0; t < TAIL_THREADS; t++)
                kv_tail_shift_step(&job, shift, keep, r0, row_elems, t, TAIL_THREADS);
    }
    return 0;
}

/* ---- kernels/cuda/kv_encode.cu ---- */

#define ENC_THREADS 256u

int cuda_kv_encode_blocks(const cuda_kv_encoder *enc, const cuda_kv_encode_job *d_jobs, int n_jobs,
                          strata_cuda_stream stream, strata_error *err)
{
    FAKE_LAUNCH_OR_FAIL(err, "cuda_kv_encode_blocks");
    (void)stream;
    if (!enc || (n_jobs > 0 && !d_jobs) || n_jobs < 0)
        return strata_fail(err, STRATA_EINVAL, "cuda_kv_encode_blocks: bad arguments");
    const cuda_kv_layout *L = &enc->layout;
    if (L->codec < KV_CODEC_FP16 || L->codec > KV_CODEC_TADA || L->block_bytes % 64 != 0 || enc->slot_bytes % 64 != 0 ||
        enc->header_bytes > CUDA_KV_MAX_HEADER || enc->header_bytes >= L->block_bytes)
        return strata_fail(err, STRATA_EINVAL, "cuda_kv_encode_blocks: encoder not from cuda_kv_encoder_init");
    if (n_jobs == 0)
        return STRATA_OK;
    if (!dev(d_jobs, (size_t)n_jobs * sizeof *d_jobs, "encode_blocks", "jobs"))
        return strata_fail(err, STRATA_EIO, "fake CUDA encoder launch: the jobs are not in device memory");
    const cuda_kv_encoder E = *enc;
    uint32_t table[256], piece_crc[ENC_THREADS];
    const unsigned n = ENC_THREADS;
    for (int b = 0; b < n_jobs; b++) {
        const cuda_kv_encode_job job = d_jobs[b];
        uint8_t *dst = job.dst;
        const size_t rows = (size_t)L->block_tokens * (size_t)L->n_kv_heads * (size_t)L->head_dim * 2;
        if (!dev(dst, enc->slot_bytes, "encode_blocks", "dst") || !dev(job.k, rows, "encode_blocks", "k") ||
            !dev(job.v, rows, "encode_blocks", "v") ||
            (E.work_bytes && !dev(job.work, E.work_bytes, "encode_blocks", "work")) ||
            (E.ott && !dev(job.ott_state, E.ott_state_bytes, "encode_blocks", "ott_state")))
            return strata_fail(err, STRATA_EIO, "fake CUDA encoder launch: job %d names memory off the device", b);
        for (unsigned i = 0; i < 256; i++)
            table[i] = kv_crc32c_table_entry(i);
        for (unsigned t = 0; t < n; t++)
            kv_enc_zero(&E, dst, t, n);
        for (unsigned t = 0; t < n; t++) {
            kv_enc_header(&E, &job, dst, t, n);
            kv_enc_means(&E, &job, dst, t, n);
            kv_enc_gear_select(&E, &job, t, n);
            kv_enc_ott_select(&E, &job, t, n);
        }
        for (unsigned t = 0; t < n; t++)
            kv_enc_ott_fill(&E, &job, dst, t, n);
        for (unsigned t = 0; t < n; t++) {
            kv_enc_sections(&E, &job, dst, t, n);
            kv_enc_gear_sparse(&E, &job, dst, t, n);
            kv_enc_ott_rows(&E, &job, dst, t, n);
        }
        for (unsigned t = 0; t < n; t++)
            kv_enc_gear_residual(&E, &job, dst, t, n);
        for (unsigned t = 0; t < n; t++)
            kv_enc_gear_fit(&E, &job, dst, t, n);
        for (unsigned t = 0; t < n; t++)
            piece_crc[t] = kv_enc_piece_crc(&E, table, dst, t, n);
        kv_enc_finish(&E, table, piece_crc, dst, n);
    }
    return STRATA_OK;
}

/* ---- kernels/cuda/kv_attention.cu ---- */

/* Every block of every view must be fake device memory, as the kernel reads them there. */
static bool view_on_device(const cuda_kv_layout *L, const cuda_kv_seq *seq, const char *kernel)
{
    const size_t tail = (size_t)seq->tail_tokens * (size_t)L->n_kv_heads * (size_t)L->head_dim * 2;
    if (!dev(seq->blocks, (size_t)seq->n_blocks * sizeof *seq->blocks, kernel, "block table") ||
        !dev(seq->tail_k, tail, kernel, "tail_k") || !dev(seq->tail_v, tail, kernel, "tail_v"))
        return false;
    for (int u = 0; u < seq->n_blocks; u++)
        if (seq->blocks[u] && !dev(seq->blocks[u], 128, kernel, "a block of the table"))
            return false;
    return true;
}

int cuda_kv_attention(const cuda_kv_layout *layout, const cuda_kv_plan *plan, const cuda_kv_seq *d_seqs,
                      const float *d_q, float *d_out, void *d_workspace, int *d_status, strata_cuda_stream stream,
                      strata_error *err)
{
    FAKE_LAUNCH_OR_FAIL(err, "cuda_kv_attention");
    (void)stream;
    if (!layout || !plan || !d_seqs || !d_q || !d_out || !d_workspace || !d_status)
        return strata_fail(err, STRATA_EINVAL, "cuda_kv_attention: NULL argument");
    const int H = layout->n_kv_heads, D = layout->head_dim, BT = layout->block_tokens;
    if (H < 1 || D < 1 || BT < 1 || plan->n_seqs < 1 || plan->n_splits < 1 || plan->blocks_per_split < 1 ||
        plan->n_q_heads % H != 0 || plan->n_q_heads / H > KV_ATT_MAX_QPK ||
        (long)plan->n_splits * plan->blocks_per_split < (long)plan->max_blocks + 1)
        return strata_fail(err, STRATA_EINVAL, "cuda_kv_attention: bad layout or plan");
    const size_t rows = (size_t)plan->n_seqs * (size_t)plan->n_q_heads * (size_t)D * 4;
    if (!dev(d_seqs, (size_t)plan->n_seqs * sizeof *d_seqs, "attention", "views") || !dev(d_q, rows, "attention", "q") ||
        !dev(d_out, rows, "attention", "out") ||
        !dev(d_workspace, cuda_kv_attention_workspace(layout, plan), "attention", "workspace") ||
        !dev(d_status, sizeof(int), "attention", "status"))
        return strata_fail(err, STRATA_EIO, "fake CUDA attention launch: an argument is off the device");
    for (int si = 0; si < plan->n_seqs; si++)
        if (d_seqs[si].n_blocks > plan->max_blocks || !view_on_device(layout, &d_seqs[si], "attention"))
            return strata_fail(err, STRATA_EIO, "fake CUDA attention: view %d is off the device or over the plan", si);
    /* The same choice of kernel as kernels/cuda/kv_attention.cu, with the shared memory the device
     * allows a block; the staged kernel computes what the generic one does (fp32), so the generic
     * emulation stands for both. */
    int optin = 0;
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0) != cudaSuccess)
        return strata_fail(err, STRATA_EIO, "fake CUDA attention: the device's shared memory per block");
    const size_t allowed = plan->smem_limit > 0 && plan->smem_limit < optin ? (size_t)plan->smem_limit : (size_t)optin;
    const int qpk = plan->n_q_heads / H;
    const bool mma = plan->kernel == CUDA_KV_KERNEL_AUTO && kv_mma_runs(layout, qpk, allowed);
    const size_t generic_smem = kv_att_shared_floats(qpk, D, BT, 128) * sizeof(float);
    if (!mma && generic_smem > allowed)   /* the staged kernel falls back to the generic one, which must fit */
        return strata_fail(err, STRATA_EUNSUPPORTED,
                           "cuda_kv_attention: %d query heads per KV head at head_dim %d with %d-token blocks need "
                           "%zu bytes of shared memory a thread block; this GPU allows %zu",
                           qpk, D, BT, generic_smem, allowed);
    const int status = mma
                           ? kv_mma_emu_attention(layout, plan, d_seqs, d_q, d_out, d_workspace)
                           : kv_att_emu_attention(layout, plan, d_seqs, d_q, d_out, d_workspace);
    if (status < 0)
        return strata_fail(err, STRATA_ENOMEM, "fake CUDA attention: out of memory");
    if (status)
        *d_status = status;
    return STRATA_OK;
}

/* ---- kernels/cuda/kv_dequant.cu ---- */

int cuda_kv_dequantize_rows(const cuda_kv_layout *layout, const cuda_kv_seq *seq, int k0, int nk, float *d_k,
                            float *d_v, int *d_status, strata_cuda_stream stream, strata_error *err)
{
    FAKE_LAUNCH_OR_FAIL(err, "cuda_kv_dequantize_rows");
    (void)stream;
    if (!layout || !seq || !d_k || !d_v || !d_status || layout->n_kv_heads < 1 || layout->head_dim < 1 ||
        layout->block_tokens < 1 || seq->n_blocks < 0 || seq->tail_tokens < 0 || (seq->n_blocks && !seq->blocks) ||
        (seq->tail_tokens && (!seq->tail_k || !seq->tail_v)))
        return strata_fail(err, STRATA_EINVAL, "cuda_kv_dequantize_rows: bad arguments");
    const int H = layout->n_kv_heads, D = layout->head_dim, BT = layout->block_tokens;
    const long total = (long)seq->n_blocks * BT + seq->tail_tokens;
    if (k0 < 0 || nk < 1 || k0 + (long)nk > total || k0 % BT || ((k0 + nk) % BT && k0 + (long)nk != total))
        return strata_fail(err, STRATA_EINVAL, "cuda_kv_dequantize_rows: rows [%d, %ld) of a view of %ld, in pieces of %d",
                           k0, k0 + (long)nk, total, BT);
    const size_t bytes = (size_t)nk * H * D * 4;
    if (!dev(d_k, bytes, "dequantize", "k") || !dev(d_v, bytes, "dequantize", "v") ||
        !dev(d_status, sizeof(int), "dequantize", "status") || !view_on_device(layout, seq, "dequantize"))
        return strata_fail(err, STRATA_EIO, "fake CUDA dequantize launch: an argument is off the device");
    /* The kernel's thread blocks one after another, from piece k0 / BT: thread 0's check, then
     * every element. */
    const int u0 = k0 / BT, u1 = u0 + (nk + BT - 1) / BT;
    const size_t row0 = (size_t)k0;
    for (int u = u0; u < u1 && u < seq->n_blocks; u++) {
        const uint8_t *blk = seq->blocks[u];
        kv_att_block_info info;
        int bad = kv_att_block_status(layout, blk, u);
        if (!bad)
            bad = kv_att_block_parse(layout, blk, &info);
        if (bad)
            *d_status = bad;
        for (int h = 0; h < H && !bad; h++)
            if (kv_att_gear_entries_bad(layout, &info, blk, h, 0, 1))   /* every thread's share at once */
                *d_status = 1;
        const kv_att_src src = {blk, &info, NULL, NULL};
        for (int h = 0; h < H; h++)
            for (int t = 0; t < BT; t++)
                for (int c = 0; c < D; c++) {
                    const size_t at = (((size_t)u * BT + t - row0) * H + h) * D + c;
                    d_k[at] = bad ? 0.0f : kv_att_key(layout, &src, h, t, c);
                    d_v[at] = bad ? 0.0f : kv_att_value(layout, &src, h, t, c);
                }
    }
    const size_t tail_from = (size_t)(k0 > seq->n_blocks * BT ? k0 - seq->n_blocks * BT : 0);
    const size_t tail_to = (size_t)(k0 + nk - (long)seq->n_blocks * BT > 0 ? k0 + nk - (long)seq->n_blocks * BT : 0);
    const size_t base = (size_t)seq->n_blocks * BT + tail_from - row0;
    for (size_t x = 0; tail_to > tail_from && x < (tail_to - tail_from) * H * D; x++) {
        d_k[base * H * D + x] = strata_half_to_float(seq->tail_k[tail_from * H * D + x]);
        d_v[base * H * D + x] = strata_half_to_float(seq->tail_v[tail_from * H * D + x]);
    }
    return STRATA_OK;
}

int cuda_kv_dequantize_view(const cuda_kv_layout *layout, const cuda_kv_seq *seq, float *d_k, float *d_v,
                            int *d_status, strata_cuda_stream stream, strata_error *err)
{
    FAKE_LAUNCH_OR_FAIL(err, "cuda_kv_dequantize_view");
    if (!layout || !seq)
        return strata_fail(err, STRATA_EINVAL, "cuda_kv_dequantize_view: bad arguments");
    const long total = (long)seq->n_blocks * layout->block_tokens + seq->tail_tokens;
    if (total == 0 && seq->n_blocks >= 0 && seq->tail_tokens >= 0)
        return STRATA_OK;
    return cuda_kv_dequantize_rows(layout, seq, 0, (int)total, d_k, d_v, d_status, stream, err);
}

/* ---- kernels/cuda/sample.cu ---- */

#define SMP_THREADS 512u

int cuda_sample_rows(const float *logits, int n_rows, int n_vocab, const cuda_sample_row *d_rows, int32_t *out,
                     strata_cuda_stream stream)
{
    FAKE_LAUNCH_OR_RETURN();
    (void)stream;
    if (n_rows <= 0)
        return 0;
    if (n_vocab <= 0 || n_vocab > SMP_MAX_VOCAB || !logits || !d_rows || !out ||
        !dev(logits, (size_t)n_rows * (size_t)n_vocab * 4, "sample", "logits") ||
        !dev(d_rows, (size_t)n_rows * sizeof *d_rows, "sample", "rows") || !dev(out, (size_t)n_rows * 4, "sample", "out"))
        return (int)cudaErrorInvalidValue;
    smp_shared *sh = malloc(sizeof *sh);
    if (!sh)
        return (int)cudaErrorMemoryAllocation;
    const unsigned nt = SMP_THREADS;
    for (int r = 0; r < n_rows; r++) {
        const float *x = logits + (size_t)r * (size_t)n_vocab;
        for (unsigned t = 0; t < nt; t++)
            smp_start(sh, t, nt);
        for (unsigned t = 0; t < nt; t++)
            smp_max_pass(sh, x, n_vocab, t, nt);
        for (unsigned t = 0; t < nt; t++)
            smp_plan(sh, &d_rows[r], n_vocab, t);
        while (sh->step != SMP_DONE) {
            for (unsigned t = 0; t < nt; t++)
                smp_hist(sh, x, n_vocab, t, nt);
            for (unsigned t = 0; t < nt; t++)
                smp_groups(sh, t, nt);
            for (unsigned t = 0; t < nt; t++)
                smp_scan(sh, t, nt);
            for (unsigned t = 0; t < nt; t++)
                smp_descend(sh, t);
            for (unsigned t = 0; t < nt; t++)
                smp_clear(sh, t, nt);
        }
        out[r] = sh->result;
    }
    free(sh);
    return 0;
}
