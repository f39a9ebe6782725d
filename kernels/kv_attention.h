/* Decode attention over one layer's compressed KV cache: the packed blocks are read directly
 * (dequantized inside the inner loop, never into a copy of the cache), then the fp16 tail,
 * with one softmax over all positions and grouped-query mapping q_head -> q_head / (n_q / n_kv).
 */
#ifndef STRATA_KERNELS_KV_ATTENTION_H
#define STRATA_KERNELS_KV_ATTENTION_H

#include <stddef.h>

#include "kvstore/error.h"
#include "kvstore/kv_cache.h"

/* Bytes of scratch kern_kv_attention needs for a view of n_tokens positions. */
size_t kern_kv_attention_scratch(const kv_layer_view *view, int n_q_heads);

/* q: fp32 [n_q_heads][head_dim], already RoPE'd. out: fp32 [n_q_heads][head_dim].
 * Scores are scaled by 1/sqrt(head_dim). n_q_heads must be a multiple of view->n_kv_heads.
 * scratch: at least kern_kv_attention_scratch() bytes, 64-byte aligned.
 * Fails with STRATA_EFORMAT if a block does not parse, STRATA_EINVAL on bad shapes. */
int kern_kv_attention(const kv_layer_view *view, const float *q, int n_q_heads, float *out,
                      void *scratch, strata_error *err);

/* Attention of n_rows consecutive tokens at once (a prompt chunk whose own K/V are the view's
 * last positions, at the end of its fp16 tail), causal: row t sees the view's first
 * visible0 + t positions. Needs 1 <= visible0 and visible0 + n_rows - 1 <= the view's
 * positions. q, out: fp32 [n_rows][n_q_heads][head_dim]. Unlike the decode kernel this one
 * dequantizes: a span of blocks at a time into fp32 (kv_block_decode), each position then
 * serving every row through BLAS, with an online softmax across spans; scratch stays one span
 * and one tile of scores whatever the context (kernels/cpu/kv_attention_rows.c). Results agree
 * with kern_kv_attention row by row up to fp32 rounding; one row that sees every position is
 * kern_kv_attention itself. Like kern_attention_causal, the bits depend on BLAS's thread count. */
size_t kern_kv_attention_rows_scratch(const kv_layer_view *view, int n_q_heads, size_t n_rows);
int kern_kv_attention_rows(const kv_layer_view *view, const float *q, size_t n_rows, int n_q_heads,
                           size_t visible0, float *out, void *scratch, strata_error *err);

#endif
