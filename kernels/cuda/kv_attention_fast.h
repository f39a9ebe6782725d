/* The staged decode-attention kernel (kernels/cuda/kv_attention_fast.cu): private to
 * kernels/cuda/kv_attention.cu, which sends it the launches it can take and keeps the generic
 * kernel for the rest (TaDA, GEAR, OTT, head_dim other than 64 and 128, more than 8 query heads
 * per KV head). Same inputs, workspace format and status flag as the generic kernel; the splits
 * are merged by the same merge kernel. */
#ifndef STRATA_KERNELS_CUDA_KV_ATTENTION_FAST_H
#define STRATA_KERNELS_CUDA_KV_ATTENTION_FAST_H

#include <stdbool.h>

#include "kernels/cuda_kv_attention.h"

/* Whether the staged kernel handles this layout with qpk query heads per KV head. */
bool kv_att_fast_eligible(const cuda_kv_layout *layout, int qpk);

/* Bytes of shared memory a thread block of it asks for (the caller checked eligibility). */
size_t kv_att_fast_smem(const cuda_kv_layout *layout, int qpk);

/* Launches the split kernel (grid n_kv_heads x n_splits x n_seqs), writing the partials the
 * generic merge reads: ws_acc [row][split][D], ws_ml [row][split][2]. STRATA_OK or STRATA_EIO. */
int kv_att_fast_launch(const cuda_kv_layout *layout, const cuda_kv_plan *plan, const cuda_kv_seq *d_seqs,
                       const float *d_q, float *ws_acc, float *ws_ml, int *d_status, void *stream,
                       strata_error *err);

#endif
