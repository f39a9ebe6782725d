/* Host side of the cuBLAS prefill attention (kernels/cuda_prefill.h): tiling and the GEMMs. Plain
 * C, so the fake device (tests/fakecuda) runs it in CI with its BLAS-backed cuBLAS. */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdbool.h>

#include "kernels/cuda_prefill.h"

/* The score tile of one KV head (its query heads x tile rows x keys, fp32): the workspace
 * cuda_prefill_workspace asks for keeps it within SCORE_TILE_BYTES; a workspace must hold at
 * least MIN_TILE_ROWS rows (or the whole prompt, when shorter). MAX_TOKENS is the forward pass's
 * own limit on one item's rows in a step (worker/cuda/model_cuda.c, check_items; a longer prompt
 * goes in chunks), not a launch limit: query rows are the softmax grid's x dimension. */
enum { SCORE_TILE_BYTES = 32 << 20, MIN_TILE_ROWS = 16, MAX_TOKENS = 65535, MAX_KEYS = 1 << 24, MAX_HEAD_DIM = 256 };

static size_t row_bytes(int n, int g) { return (size_t)g * (size_t)n * sizeof(float); }

static int min_rows(int n) { return n < MIN_TILE_ROWS ? n : MIN_TILE_ROWS; }

static int shapes_ok(int n_past, int n, int n_q_heads, int n_kv_heads)
{
    return n >= 1 && n <= MAX_TOKENS && n_past >= 0 && n_past <= MAX_KEYS - n && n_kv_heads >= 1 &&
           n_q_heads >= n_kv_heads && n_q_heads % n_kv_heads == 0;
}

size_t cuda_prefill_workspace(int n_past, int n, int n_q_heads, int n_kv_heads)
{
    if (!shapes_ok(n_past, n, n_q_heads, n_kv_heads))
        return 0;
    const int g = n_q_heads / n_kv_heads;
    size_t rows = SCORE_TILE_BYTES / row_bytes(n_past + n, g);
    if (rows < (size_t)min_rows(n))
        rows = (size_t)min_rows(n);
    if (rows > (size_t)n)
        rows = (size_t)n;
    return rows * row_bytes(n_past + n, g);
}

static int blas_failed(cublasStatus_t st, const char *what, strata_error *err)
{
    return strata_fail(err, STRATA_EIO, "prefill attention: cuBLAS %s failed (status %d)", what, (int)st);
}

/* The shapes the GEMMs of one KV head share. Column-major terms: a row-major [tokens][ld] matrix
 * is a head_dim x tokens matrix with leading dimension ld. For the g query heads h of a KV head
 * (batch stride head_dim):
 *   S_h (keys x queries, ld kn) = K^T Q_h / sqrt(head_dim), that is S[i][j] = q_i . k_j / sqrt(d);
 *   O_h (head_dim x queries, ld ldq) = V P_h (+ beta O_h). */
typedef struct gemm_shape {
    int head_dim, g, ldq, ldk;
} gemm_shape;

static int scores_gemm(cublasHandle_t blas, const gemm_shape *t, const float *k, const float *q, int kn, int tq,
                       float *s, strata_error *err)
{
    const float scale = 1.0f / sqrtf((float)t->head_dim), zero = 0.0f;
    const cublasStatus_t st = cublasGemmStridedBatchedEx(
        blas, CUBLAS_OP_T, CUBLAS_OP_N, kn, tq, t->head_dim, &scale, k, CUDA_R_32F, t->ldk, 0, q, CUDA_R_32F, t->ldq,
        t->head_dim, &zero, s, CUDA_R_32F, kn, (long long)tq * kn, t->g, CUBLAS_COMPUTE_32F_PEDANTIC,
        CUBLAS_GEMM_DEFAULT);
    return st == CUBLAS_STATUS_SUCCESS ? STRATA_OK : blas_failed(st, "scores GEMM", err);
}

static int values_gemm(cublasHandle_t blas, const gemm_shape *t, const float *v, const float *p, int kn, int tq,
                       float beta, float *out, strata_error *err)
{
    const float one = 1.0f;
    const cublasStatus_t st = cublasGemmStridedBatchedEx(
        blas, CUBLAS_OP_N, CUBLAS_OP_N, t->head_dim, tq, kn, &one, v, CUDA_R_32F, t->ldk, 0, p, CUDA_R_32F, kn,
        (long long)tq * kn, &beta, out, CUDA_R_32F, t->ldq, t->head_dim, t->g, CUBLAS_COMPUTE_32F_PEDANTIC,
        CUBLAS_GEMM_DEFAULT);
    return st == CUBLAS_STATUS_SUCCESS ? STRATA_OK : blas_failed(st, "values GEMM", err);
}

int cuda_attention_prefill_gemm(void *cublas_handle, const float *d_q, const float *d_k, const float *d_v, int n_past,
                                int n, int n_q_heads, int n_kv_heads, int head_dim, float *d_out, void *d_ws,
                                size_t ws_bytes, strata_error *err)
{
    if (!cublas_handle || !d_q || !d_k || !d_v || !d_out || !d_ws || !shapes_ok(n_past, n, n_q_heads, n_kv_heads) ||
        head_dim < 1 || head_dim > MAX_HEAD_DIM)
        return strata_fail(err, STRATA_EINVAL,
                           "cuda_attention_prefill_gemm: %d tokens (1..%d) after %d, %d query / %d KV heads, "
                           "head_dim %d (1..%d), or a NULL pointer",
                           n, MAX_TOKENS, n_past, n_q_heads, n_kv_heads, head_dim, MAX_HEAD_DIM);
    const int g = n_q_heads / n_kv_heads;
    size_t tile = ws_bytes / row_bytes(n_past + n, g);   /* query rows a score tile holds */
    if (tile < (size_t)min_rows(n))
        return strata_fail(err, STRATA_EINVAL, "cuda_attention_prefill_gemm: workspace of %zu bytes, at least %zu needed",
                           ws_bytes, (size_t)min_rows(n) * row_bytes(n_past + n, g));
    if (tile > (size_t)n)
        tile = (size_t)n;
    cublasHandle_t blas = (cublasHandle_t)cublas_handle;
    cudaStream_t stream;
    cublasStatus_t st = cublasGetStream(blas, &stream);
    if (st != CUBLAS_STATUS_SUCCESS)
        return blas_failed(st, "cublasGetStream", err);
    const int rows = (int)tile, D = head_dim;
    const gemm_shape tg = {.head_dim = D, .g = g, .ldq = n_q_heads * D, .ldk = n_kv_heads * D};
    float *s = (float *)d_ws;
    for (int i0 = 0; i0 < n; i0 += rows) {
        const int tq = n - i0 < rows ? n - i0 : rows, kn = n_past + i0 + tq;
        for (int kh = 0; kh < n_kv_heads; kh++) {
            const size_t q_at = (size_t)i0 * (size_t)tg.ldq + (size_t)kh * (size_t)g * (size_t)D;
            int rc = scores_gemm(blas, &tg, d_k + (size_t)kh * D, d_q + q_at, kn, tq, s, err);
            if (rc != STRATA_OK)
                return rc;
            const int e = cuda_prefill_softmax(s, tq, kn, n_past + i0, g, (size_t)tq * (size_t)kn,
                                               (strata_cuda_stream)stream);
            if (e != 0)
                return strata_fail(err, STRATA_EIO, "cuda_attention_prefill_gemm: softmax launch: %s",
                                   cudaGetErrorString((cudaError_t)e));
            if ((rc = values_gemm(blas, &tg, d_v + (size_t)kh * D, s, kn, tq, 0.0f, d_out + q_at, err)) != STRATA_OK)
                return rc;
        }
    }
    return STRATA_OK;
}

/* cuda_attention_chunk_gemm's workspace: the K and V rows of one past tile, the state (m, l per
 * chunk row and query head), then the score tiles of `rows` query rows. */
typedef struct chunk_layout {
    size_t tile_elems;   /* floats of one of K or V for a tile of the past */
    size_t state_elems;  /* floats of one of m or l */
    size_t widest;       /* keys of the longest score row: a past tile or the chunk itself */
} chunk_layout;

static chunk_layout chunk_layout_of(int n_past, int n, int n_q_heads, int n_kv_heads, int head_dim, int tile_keys)
{
    const int tile = tile_keys < n_past ? tile_keys : n_past;
    return (chunk_layout){.tile_elems = (size_t)tile * (size_t)n_kv_heads * (size_t)head_dim,
                          /* rounded to 16 bytes so that the score tiles after m and l start aligned
                           * for cuBLAS's vectorized kernels whatever n * n_q_heads is */
                          .state_elems = ((size_t)n * (size_t)n_q_heads + 3) / 4 * 4,
                          .widest = (size_t)(tile > n ? tile : n)};
}

static size_t chunk_fixed_bytes(const chunk_layout *c) { return (2 * c->tile_elems + 2 * c->state_elems) * sizeof(float); }

size_t cuda_chunk_workspace(int n_past, int n, int n_q_heads, int n_kv_heads, int head_dim, int tile_keys)
{
    if (n_past < 1 || tile_keys < 1 || head_dim < 1 || head_dim > MAX_HEAD_DIM || !shapes_ok(n_past, n, n_q_heads, n_kv_heads))
        return 0;
    const int g = n_q_heads / n_kv_heads;
    const chunk_layout c = chunk_layout_of(n_past, n, n_q_heads, n_kv_heads, head_dim, tile_keys);
    size_t rows = SCORE_TILE_BYTES / ((size_t)g * c.widest * sizeof(float));
    if (rows < (size_t)min_rows(n))
        rows = (size_t)min_rows(n);
    if (rows > (size_t)n)
        rows = (size_t)n;
    return chunk_fixed_bytes(&c) + rows * (size_t)g * c.widest * sizeof(float);
}

int cuda_attention_chunk_gemm(void *cublas_handle, const float *d_q, int n_past, cuda_past_rows_fn past,
                              void *past_ctx, const float *d_k, const float *d_v, int n, int n_q_heads,
                              int n_kv_heads, int head_dim, int tile_keys, float *d_out, void *d_ws, size_t ws_bytes,
                              strata_error *err)
{
    if (!cublas_handle || !d_q || !past || !d_k || !d_v || !d_out || !d_ws || n_past < 1 || tile_keys < 1 ||
        !shapes_ok(n_past, n, n_q_heads, n_kv_heads) || head_dim < 1 || head_dim > MAX_HEAD_DIM)
        return strata_fail(err, STRATA_EINVAL,
                           "cuda_attention_chunk_gemm: %d tokens (1..%d) after %d (at least 1), %d query / %d KV "
                           "heads, head_dim %d (1..%d), tiles of %d keys, or a NULL pointer",
                           n, MAX_TOKENS, n_past, n_q_heads, n_kv_heads, head_dim, MAX_HEAD_DIM, tile_keys);
    const int g = n_q_heads / n_kv_heads, D = head_dim;
    const chunk_layout c = chunk_layout_of(n_past, n, n_q_heads, n_kv_heads, head_dim, tile_keys);
    const size_t fixed = chunk_fixed_bytes(&c), row_floats = (size_t)g * c.widest;
    if (ws_bytes < fixed + (size_t)min_rows(n) * row_floats * sizeof(float))
        return strata_fail(err, STRATA_EINVAL, "cuda_attention_chunk_gemm: workspace of %zu bytes, at least %zu needed",
                           ws_bytes, fixed + (size_t)min_rows(n) * row_floats * sizeof(float));
    size_t rows_fit = (ws_bytes - fixed) / (row_floats * sizeof(float));
    const int rows = (int)(rows_fit > (size_t)n ? (size_t)n : rows_fit);
    cublasHandle_t blas = (cublasHandle_t)cublas_handle;
    cudaStream_t stream;
    cublasStatus_t st = cublasGetStream(blas, &stream);
    if (st != CUBLAS_STATUS_SUCCESS)
        return blas_failed(st, "cublasGetStream", err);
    float *tile_k = (float *)d_ws, *tile_v = tile_k + c.tile_elems, *m = tile_v + c.tile_elems;
    float *l = m + c.state_elems, *s = l + c.state_elems;
    const gemm_shape tg = {.head_dim = D, .g = g, .ldq = n_q_heads * D, .ldk = n_kv_heads * D};
    const int tile = tile_keys < n_past ? tile_keys : n_past, n_past_tiles = (n_past + tile - 1) / tile;
    /* Key tiles: the past's, fetched once each, then the chunk's own rows (causal). */
    for (int t = 0; t <= n_past_tiles; t++) {
        const bool own = t == n_past_tiles;
        const int k0 = t * tile, nk = own ? n : (n_past - k0 < tile ? n_past - k0 : tile);
        int rc = own ? STRATA_OK : past(past_ctx, k0, nk, tile_k, tile_v, (strata_cuda_stream)stream, err);
        if (rc != STRATA_OK)
            return rc;
        const float *keys = own ? d_k : tile_k, *values = own ? d_v : tile_v;
        for (int i0 = 0; i0 < n; i0 += rows) {
            const int tq = n - i0 < rows ? n - i0 : rows, kn = own ? i0 + tq : nk;
            for (int kh = 0; kh < n_kv_heads; kh++) {
                const size_t q_at = (size_t)i0 * (size_t)tg.ldq + (size_t)kh * (size_t)g * (size_t)D;
                if ((rc = scores_gemm(blas, &tg, keys + (size_t)kh * D, d_q + q_at, kn, tq, s, err)) != STRATA_OK)
                    return rc;
                const cuda_chunk_tile ct = {.s = s, .rows = tq, .kn = kn, .i0 = i0, .causal = own, .n_heads = g,
                                            .head_stride = (size_t)tq * (size_t)kn, .q_head0 = kh * g,
                                            .n_q_heads = n_q_heads, .head_dim = D, .first = t == 0, .m = m, .l = l,
                                            .out = d_out};
                const int e = cuda_chunk_softmax_tile(&ct, (strata_cuda_stream)stream);
                if (e != 0)
                    return strata_fail(err, STRATA_EIO, "cuda_attention_chunk_gemm: softmax launch: %s",
                                       cudaGetErrorString((cudaError_t)e));
                if ((rc = values_gemm(blas, &tg, values + (size_t)kh * D, s, kn, tq, t == 0 ? 0.0f : 1.0f,
                                      d_out + q_at, err)) != STRATA_OK)
                    return rc;
            }
        }
    }
    const int e = cuda_chunk_normalize(d_out, l, n * n_q_heads, D, (strata_cuda_stream)stream);
    if (e != 0)
        return strata_fail(err, STRATA_EIO, "cuda_attention_chunk_gemm: normalize launch: %s",
                           cudaGetErrorString((cudaError_t)e));
    return STRATA_OK;
}
