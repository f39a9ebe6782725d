/* Causal prefill attention through cuBLAS (the counterpart of kern_attention_causal and, with
 * keys already cached before the queries, of kern_kv_attention_rows, at GEMM speed): for each KV
 * head, S = Q K^T / sqrt(head_dim) for its query heads in one strided-batched fp32 GEMM, a causal
 * softmax over each row of S (cuda_prefill_softmax), then O = P V in a second GEMM. Query rows go
 * in tiles so that the score matrix stays within the workspace; a tile's rows see the keys up to
 * its last row, so the GEMMs skip the tile's upper-right triangle only in part. fp32 operands with
 * pedantic fp32 compute (no TF32), as the CPU computes. A prompt chunk continuing a sequence
 * goes through cuda_attention_chunk_gemm: its cache written out as fp32 rows a tile of keys at a
 * time (cuda_kv_dequantize_rows), each tile's scores merged into an online softmax, so the
 * memory it needs does not grow with the sequence.
 * All d_* pointers are device pointers; calls are asynchronous on the cuBLAS handle's stream.
 * Status: see docs/benchmarks.md, "GPU results", for whether it has run on a GPU. */
#ifndef STRATA_KERNELS_CUDA_PREFILL_H
#define STRATA_KERNELS_CUDA_PREFILL_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/cuda_kv_attention.h"
#include "kernels/cuda_ops.h"
#include "kvstore/error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bytes of device workspace to give cuda_attention_prefill_gemm for n query rows after n_past
 * cached keys: score tiles of up to 32 MiB (more rows per tile, fewer GEMMs). It takes less, down
 * to 16 query rows' worth (n_q_heads / n_kv_heads * 16 * (n_past + n) floats), in more tiles.
 * 0 for bad shapes. */
size_t cuda_prefill_workspace(int n_past, int n, int n_q_heads, int n_kv_heads);

/* out[i][h] = softmax_j<=n_past+i(q[i][h] . k[j][h/g] / sqrt(head_dim)) v[j][h/g], g = n_q_heads /
 * n_kv_heads: query row i stands at position n_past + i. d_q, d_out: fp32 [n][n_q_heads][head_dim];
 * d_k, d_v: fp32 [n_past + n][n_kv_heads][head_dim] (the caller rounds them to fp16 values first
 * to match the CPU, whose cache holds fp16). n at most 65535, n_past + n below 2^24.
 * cublas_handle: a cublasHandle_t. d_ws: ws_bytes of workspace (cuda_prefill_workspace; at
 * least 16 query rows' worth). STRATA_EINVAL for bad shapes or a workspace under that, STRATA_EIO when cuBLAS or a
 * launch fails (the message says which). */
int cuda_attention_prefill_gemm(void *cublas_handle, const float *d_q, const float *d_k, const float *d_v, int n_past,
                                int n, int n_q_heads, int n_kv_heads, int head_dim, float *d_out, void *d_ws, size_t ws_bytes,
                                strata_error *err);

/* The past of a prompt chunk as fp32 rows, a range at a time: keys and values [k0, k0 + nk) of
 * the positions cached before the chunk into d_k, d_v ([nk][n_kv_heads][head_dim], device).
 * Work it queues goes on `stream`, the one the GEMMs that read the rows run on (the cuBLAS
 * handle's), so a tile is written only after the previous tile's products are done with it.
 * Returns a strata status (its message in err). */
typedef int (*cuda_past_rows_fn)(void *ctx, int k0, int nk, float *d_k, float *d_v, strata_cuda_stream stream,
                                 strata_error *err);

/* Bytes of device workspace cuda_attention_chunk_gemm needs for n rows after n_past positions with
 * key tiles of tile_keys: two tiles of fp32 K/V rows, the rows' softmax state, and score tiles of
 * up to 32 MiB (it runs with less, down to 16 query rows' worth, in more tiles). 0 for bad shapes. */
size_t cuda_chunk_workspace(int n_past, int n, int n_q_heads, int n_kv_heads, int head_dim, int tile_keys);

/* What cuda_attention_prefill_gemm computes for a prompt chunk (query row i at position
 * n_past + i attends every cached position and the chunk's rows 0..i), with the cached positions
 * fetched tile_keys at a time through past(past_ctx, ...) instead of all at once: per key tile,
 * S = K^T Q (per KV head, one strided-batched GEMM), the rows' online softmax over it
 * (cuda_chunk_softmax_tile, which also rescales what the output rows hold), O += V P; after the
 * past, the chunk's own rows (d_k, d_v: fp32 [n][n_kv_heads][head_dim]) as the last tile,
 * causal; then every output row divided by its sum (cuda_chunk_normalize). n_past >= 1,
 * tile_keys >= 1, other shapes as for cuda_attention_prefill_gemm; d_ws: ws_bytes, at least what
 * cuda_chunk_workspace gives with its smallest score tile (the message says how much).
 * STRATA_EINVAL for bad arguments, STRATA_EIO when cuBLAS or a launch fails, or past's status. */
int cuda_attention_chunk_gemm(void *cublas_handle, const float *d_q, int n_past, cuda_past_rows_fn past,
                              void *past_ctx, const float *d_k, const float *d_v, int n, int n_q_heads,
                              int n_kv_heads, int head_dim, int tile_keys, float *d_out, void *d_ws, size_t ws_bytes,
                              strata_error *err);

/* One key tile of cuda_attention_chunk_gemm's online softmax (kernels/cuda/prefill_softmax_block.h):
 * for head hh < n_heads and row r < rows of the score tile at s + hh * head_stride (rows of kn
 * floats), query row i0 + r of the chunk and query head q_head0 + hh keep the tile's first
 * kn keys (causal: its first min(kn, i0 + r + 1)), which become e^(s - m) with m the row's new
 * running max; the rest of the row 0. The state m, l ([chunk rows][n_q_heads], device) carries
 * the max and the sum across tiles; the output row (out: [chunk rows][n_q_heads][head_dim]) is
 * scaled by e^(m_old - m_new) unless first (the first tile: the values GEMM writes it afresh). */
typedef struct cuda_chunk_tile {
    float *s;
    int rows, kn, i0, causal, n_heads;
    size_t head_stride;
    int q_head0, n_q_heads, head_dim, first;
    float *m, *l, *out;
} cuda_chunk_tile;
/* Returns a cudaError_t as int (0: launched). */
int cuda_chunk_softmax_tile(const cuda_chunk_tile *tile, strata_cuda_stream stream);
/* out[r][:] /= l[r] for the n_rows rows (chunk rows x query heads) of head_dim floats. */
int cuda_chunk_normalize(float *d_out, const float *d_l, int n_rows, int head_dim, strata_cuda_stream stream);

/* The softmax step: for head h < n_heads and row r < rows of the tile at d_s + h * head_stride
 * (rows of kn floats), query i0 + r keeps keys 0..i0 + r: those become the softmax of their
 * scores, the rest of the row 0. Returns a cudaError_t as int (0: launched). */
int cuda_prefill_softmax(float *d_s, int rows, int kn, int i0, int n_heads, size_t head_stride,
                         strata_cuda_stream stream);

/* The layer's cache of one sequence as fp32 rows [t][n_kv_heads][head_dim], t < n_blocks *
 * block_tokens + tail_tokens: the blocks (checked as the attention checks them: one that does not
 * match sets *d_status and gives zeros) dequantized as the attention reads them, then the tail.
 * seq: host struct with device pointers. STRATA_OK, STRATA_EINVAL or STRATA_EIO (launch). */
int cuda_kv_dequantize_view(const cuda_kv_layout *layout, const cuda_kv_seq *seq, float *d_k, float *d_v,
                            int *d_status, strata_cuda_stream stream, strata_error *err);
/* Rows [k0, k0 + nk) of the same (k0 a multiple of block_tokens, and k0 + nk too unless it is the
 * view's end), written from d_k, d_v's first row: a tile of a long cache without the rest. */
int cuda_kv_dequantize_rows(const cuda_kv_layout *layout, const cuda_kv_seq *seq, int k0, int nk, float *d_k,
                            float *d_v, int *d_status, strata_cuda_stream stream, strata_error *err);

/* dst[i] = src[i] widened from fp16 (exact). Returns a cudaError_t as int. */
int cuda_f16_to_f32(const uint16_t *src, float *dst, size_t n, strata_cuda_stream stream);

#ifdef __cplusplus
}
#endif

#endif
