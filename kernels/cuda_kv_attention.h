/* Decode attention over paged compressed KV blocks on a CUDA device (the GPU counterpart of
 * kernels/kv_attention.h, and tested against the same math).
 *
 * The blocks are the exact bytes of docs/format.md, read in place from device memory through a
 * block table (one device pointer per block); codes are dequantized in registers and never
 * written back as fp16/fp32 K or V. Grouped-query: one thread block serves all the query heads
 * that share a KV head, so each code is read once per KV head. Long contexts are split across
 * thread blocks (split-K over the block table); each split keeps an online softmax (running max,
 * normalizer, weighted value sum) and a second kernel merges the splits. The fp16 tail (the
 * residual window) is read by the split that holds the sequence's last positions.
 *
 * Codecs: fp16, KIVI (k and v bits 2 or 4), TaDA (the KIVI backbone over the deviations, bits 2,
 * 4 or 8, plus each token's fp16 mean), GEAR (the backbone plus a low-rank term and outliers) and
 * OTT (the backbone with pooled tokens' fp16 rows). GEAR and OTT blocks vary in size; each block's
 * correction sections are read from its own section table and checked.
 *
 * Status: compiled in every build with nvcc; see docs/benchmarks.md for whether it has run on a
 * GPU. All pointers named d_* are device pointers. Calls are asynchronous on the given stream. */
#ifndef STRATA_KERNELS_CUDA_KV_ATTENTION_H
#define STRATA_KERNELS_CUDA_KV_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/cuda_ops.h"
#include "kvstore/error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where the sections of every full block of one pool sit. The pool's codec and geometry are
 * fixed and the canonical layout (docs/format.md 2.2) places sections at offsets that depend on
 * nothing else, so the kernel needs no per-block parsing; it still checks each block's magic,
 * codec, layer, token count and first position against this and reports a mismatch. */
typedef struct cuda_kv_layout {
    int codec;             /* KV_CODEC_FP16, KV_CODEC_KIVI or KV_CODEC_TADA */
    int k_bits, v_bits;    /* 16 for fp16; 2, 4 (KIVI, TaDA) or 8 (TaDA) */
    int k_group, v_group;  /* KIVI: tokens per key group, channels per value group */
    int block_tokens;      /* tokens of every block of the table */
    int n_kv_heads, head_dim;
    uint32_t layer;        /* the layer the blocks must belong to */
    uint32_t off_k, off_k_scales, off_v, off_v_scales;  /* section offsets (scales: KIVI, TaDA) */
    uint32_t len_k, len_k_scales, len_v, len_v_scales;  /* and their lengths: GEAR and OTT blocks'
                                                         * own tables must give the same */
    uint32_t off_k_mean, off_v_mean;                    /* TaDA: the per-token means */
    uint32_t block_bytes;  /* every block's size; GEAR and OTT: the largest (the pool's slot size,
                            * kv_block_size), which the caller sets after cuda_kv_layout_from_block */
} cuda_kv_layout;

/* Fills *out from one parsed full block (host memory) of the pool: the template every other
 * block of the table must match (for GEAR and OTT: the backbone's place; see block_bytes).
 * STRATA_EINVAL for shapes the kernel does not handle (head_dim > 256; more than 16 query heads
 * per KV head is checked at launch). */
struct kv_block;
int cuda_kv_layout_from_block(const struct kv_block *b, cuda_kv_layout *out, strata_error *err);

/* One sequence's view of a layer, in device memory: what the kernel reads. */
typedef struct cuda_kv_seq {
    const uint8_t *const *blocks;  /* device array of n_blocks device pointers, position order */
    const uint16_t *tail_k;        /* fp16 [tail_tokens][n_kv_heads][head_dim], device; may be
                                    * NULL when tail_tokens is 0 */
    const uint16_t *tail_v;
    int n_blocks;
    int tail_tokens;
} cuda_kv_seq;

/* How a launch splits the block tables: blocks_per_split blocks per thread block (the tail
 * counts as one more block after the last). cuda_kv_attention_plan picks it so that the grid
 * fills the device (about two thread blocks per multiprocessor) for the longest sequence. */
typedef struct cuda_kv_plan {
    int n_seqs;
    int n_q_heads;
    int max_blocks;        /* the most blocks any sequence of the batch has */
    int blocks_per_split;
    int n_splits;
    int kernel;            /* which kernel runs (cuda_kv_kernel); cuda_kv_attention_plan sets AUTO */
    int smem_limit;        /* 0 (cuda_kv_attention_plan's): a thread block may have the shared memory
                            * the device allows (cudaDevAttrMaxSharedMemoryPerBlockOptin); else at
                            * most this many bytes, as on a smaller GPU (tests and benchmarks) */
} cuda_kv_plan;

/* AUTO: KIVI, TaDA, GEAR and OTT (2- or 4-bit codes, head_dim 64 or 128, 64-token blocks, at most
 * 8 query heads per KV head) on the tensor cores (fp16 operands, fp32 sums); fp16 and the KIVI
 * layouts the tensor-core kernel does not take on the staged kernel (fp32 arithmetic); the rest
 * (8-bit TaDA, other shapes) on the generic one. STAGED: KIVI and fp16 on the staged kernel, the
 * others on the generic one. GENERIC: always the generic kernel. Benchmarks and tests compare
 * them. A kernel whose shared memory the device (or plan->smem_limit) does not allow passes the
 * launch to the next: tensor cores, staged, generic (an H100's 227 KiB take every layout; a GPU
 * with 99 KiB, sm_86/89/120, not the 4-bit tensor-core versions with small groups); the generic
 * kernel needing more than allowed fails the launch with STRATA_EUNSUPPORTED naming both sizes. */
typedef enum cuda_kv_kernel { CUDA_KV_KERNEL_AUTO = 0, CUDA_KV_KERNEL_GENERIC = 1, CUDA_KV_KERNEL_STAGED = 2 } cuda_kv_kernel;

/* sm_count: the device's multiprocessor count (cudaDevAttrMultiProcessorCount). */
int cuda_kv_attention_plan(const cuda_kv_layout *layout, int n_seqs, int n_q_heads, int max_blocks,
                           int sm_count, cuda_kv_plan *plan, strata_error *err);

/* Bytes of device workspace a launch with this plan needs (the splits' partial results). */
size_t cuda_kv_attention_workspace(const cuda_kv_layout *layout, const cuda_kv_plan *plan);

/* out[s][h][:] = softmax(q[s][h] . K_s / sqrt(head_dim)) V_s for every sequence s of the batch
 * and query head h (query head h reads KV head h / (n_q_heads / n_kv_heads)).
 *   d_seqs: device array of plan->n_seqs cuda_kv_seq, each with at most plan->max_blocks blocks.
 *   d_q, d_out: fp32 [n_seqs][n_q_heads][head_dim], device (q already RoPE'd).
 *   d_workspace: cuda_kv_attention_workspace() bytes, device, 16-byte aligned.
 *   d_status: device int the kernel sets to nonzero (1: a block does not match the layout, 2: a
 *     NULL block pointer) and leaves alone otherwise; the caller zeroes it and reads it after the
 *     stream has run. A rejected block adds nothing, so a nonzero status means the output is wrong.
 * A sequence with no positions gets zeros. Returns STRATA_OK or STRATA_EINVAL (bad plan or
 * shapes) / STRATA_EIO (a launch failed, the CUDA error is in the message). */
int cuda_kv_attention(const cuda_kv_layout *layout, const cuda_kv_plan *plan, const cuda_kv_seq *d_seqs,
                      const float *d_q, float *d_out, void *d_workspace, int *d_status,
                      strata_cuda_stream stream, strata_error *err);

#ifdef __cplusplus
}
#endif

#endif
