/* Dense numeric ops of the forward pass (CPU reference backend). Row-major fp32 throughout.
 * Weights follow GGUF's layout: a [out][in] matrix with the input dimension contiguous. */
#ifndef STRATA_KERNELS_OPS_H
#define STRATA_KERNELS_OPS_H

#include <stddef.h>
#include <stdint.h>

/* y[n][out] = x[n][in] * W^T, W [out][in].
 * Batch-invariant: row r of y depends only on row r of x and on W, bit for bit, whatever n, the
 * row's place in x and the thread count (each element is summed in one fixed order, see ops.c:
 * eight interleaved fma lanes, a fixed pairwise reduction, then the remainder). This is what
 * makes a sequence's logits the same alone and inside any batch. Not BLAS: OpenBLAS's sgemm rows
 * change with the number of rows and sgemv differs from sgemm. Splits the outputs over the
 * threads set by kern_set_threads when the product is large enough. */
void kern_matmul(const float *x, size_t n, size_t in, const float *w, size_t out, float *y);

/* A weight matrix [out][in] as the model file stores it: type is a gguf_tensor_type of
 * kernels/weight_values.h (F32: floats in host order; F16, BF16, Q8_0, Q4_0, Q4_1: GGUF's
 * little-endian blocks, each row a whole number of them), data the rows back to back. */
typedef struct kern_weights {
    uint32_t type;
    const void *data;
} kern_weights;

/* Bytes of one row of in elements; 0 for an unknown type or an in the type's block does not
 * divide. */
size_t kern_weights_row_bytes(uint32_t type, size_t in);

/* Rows [first, first + count) of w as fp32: the values weight_values.h's gguf_value gives, bit
 * for bit (for finite values; the model loader refuses others). */
void kern_weights_rows(kern_weights w, size_t in, size_t first, size_t count, float *out);

/* kern_matmul with W in any kern_weights format: the same bits as kern_matmul over
 * kern_weights_rows(W) (the rows are decoded a panel at a time, in the thread that uses them,
 * and summed in kern_matmul's order), while reading the stored bytes: a quarter to an eighth of
 * fp32's for the 4- and 8-bit formats, which is what limits a decode step. */
void kern_matmul_w(const float *x, size_t n, size_t in, kern_weights w, size_t out, float *y);

/* out = x / sqrt(mean(x^2) + eps) * weight, for each of n rows of dim elements. out may be x. */
void kern_rmsnorm(const float *x, const float *weight, size_t n, size_t dim, float eps, float *out);

/* Rotary embedding in place on n_heads vectors of head_dim at position pos: adjacent pairs
 * (x[2i], x[2i+1]) rotate by pos * theta^(-2i/head_dim) (GGUF's llama layout). */
void kern_rope(float *x, size_t n_heads, size_t head_dim, size_t pos, float theta);

/* out[i] = silu(gate[i]) * up[i]. out may alias gate. */
void kern_swiglu(const float *gate, const float *up, size_t n, float *out);

/* y[i] += x[i] */
void kern_add(float *y, const float *x, size_t n);

/* Exact causal attention for a whole prompt (prefill): q [n][n_q_heads][head_dim],
 * k and v [n][n_kv_heads][head_dim], out [n][n_q_heads][head_dim]. Query i attends to keys
 * 0..i. Goes through BLAS in tiles of query rows. scratch: kern_attention_causal_scratch(n)
 * floats. The same inputs give the same bits at a given BLAS thread count, but OpenBLAS's sgemm
 * sums differently with another thread count (measured: prompts of 130 tokens and more change
 * between 1 and 2 threads). */
void kern_attention_causal(const float *q, const float *k, const float *v, size_t n,
                           size_t n_q_heads, size_t n_kv_heads, size_t head_dim, float *out,
                           float *scratch);

/* Floats of scratch kern_attention_causal needs for n tokens (one tile of query rows times n
 * keys; at least 1). */
size_t kern_attention_causal_scratch(size_t n);

/* Number of threads BLAS and kern_matmul may use (0: leave the default, OpenBLAS's thread
 * count). */
void kern_set_threads(int n);

#endif
