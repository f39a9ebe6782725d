/* Host side of the cuBLAS prefill attention (kernels/cuda_prefill.h): tiling and the GEMMs. Plain
 * C, so the fake device (tests/fakecuda) runs it in CI with its BLAS-backed cuBLAS. */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>

#include "kernels/cuda_prefill.h"

/* The score tile of one KV head (its query heads x tile rows x keys, fp32): the workspace
 * cuda_prefill_workspace asks for keeps it within SCORE_TILE_BYTES; a workspace must hold at
 * least MIN_TILE_ROWS rows (or the whole prompt, when shorter). */
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
    return strata_fail(err, STRATA_EIO, "cuda_attention_prefill_gemm: cuBLAS %s failed (status %d)", what, (int)st);
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
    const int ldq = n_q_heads * D, ldk = n_kv_heads * D;
    const float scale = 1.0f / sqrtf((float)D), one = 1.0f, zero = 0.0f;
    float *s = (float *)d_ws;
    /* Column-major terms: a row-major [tokens][ld] matrix is a D x tokens matrix with leading
     * dimension ld. Per KV head kh and its g query heads h (batch stride D):
     *   S_h (keys x queries, ld kn) = K_kh^T Q_h, that is S[i][j] = q_i . k_j, row-major per query;
     *   O_h (D x queries, ld ldq)   = V_kh P_h. */
    for (int i0 = 0; i0 < n; i0 += rows) {
        const int tq = n - i0 < rows ? n - i0 : rows, kn = n_past + i0 + tq;
        const long long s_stride = (long long)tq * kn;
        for (int kh = 0; kh < n_kv_heads; kh++) {
            const size_t q_at = (size_t)i0 * (size_t)ldq + (size_t)kh * (size_t)g * (size_t)D;
            st = cublasGemmStridedBatchedEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, kn, tq, D, &scale, d_k + (size_t)kh * D,
                                            CUDA_R_32F, ldk, 0, d_q + q_at, CUDA_R_32F, ldq, D, &zero, s, CUDA_R_32F,
                                            kn, s_stride, g, CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT);
            if (st != CUBLAS_STATUS_SUCCESS)
                return blas_failed(st, "scores GEMM", err);
            const int e =
                cuda_prefill_softmax(s, tq, kn, n_past + i0, g, (size_t)s_stride, (strata_cuda_stream)stream);
            if (e != 0)
                return strata_fail(err, STRATA_EIO, "cuda_attention_prefill_gemm: softmax launch: %s",
                                   cudaGetErrorString((cudaError_t)e));
            st = cublasGemmStridedBatchedEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, D, tq, kn, &one, d_v + (size_t)kh * D,
                                            CUDA_R_32F, ldk, 0, s, CUDA_R_32F, kn, s_stride, &zero, d_out + q_at,
                                            CUDA_R_32F, ldq, D, g, CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT);
            if (st != CUBLAS_STATUS_SUCCESS)
                return blas_failed(st, "values GEMM", err);
        }
    }
    return STRATA_OK;
}
