/* Batched maintenance of the fp16 tails of sequences' KV caches on a CUDA device: appending the
 * new rows of a step, and moving the residual rows to the front once the oldest block_tokens rows
 * have been encoded into a block (kernels/cuda_kv_encode.h). One launch serves a whole batch, so a
 * decode step costs a few launches per layer whatever the batch size.
 * Status: compiled in every build with nvcc; see docs/benchmarks.md for whether it has run. */
#ifndef STRATA_KERNELS_CUDA_KV_TAIL_H
#define STRATA_KERNELS_CUDA_KV_TAIL_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/cuda_ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Rows src_row .. src_row + n_rows - 1 of the step's K/V (fp16 [rows][row_elems]) to a tail,
 * at dst (the tail's row tail_len). */
typedef struct cuda_kv_append_job {
    uint16_t *dst_k, *dst_v;
    int src_row, n_rows;
} cuda_kv_append_job;

/* A tail whose rows [shift, shift + keep) move to [0, keep) (shift = block_tokens, keep = the
 * residual window). The ranges may overlap: rows move in steps of shift rows, oldest first. */
typedef struct cuda_kv_shift_job {
    uint16_t *k, *v;
} cuda_kv_shift_job;

/* d_jobs: device arrays. Each returns 0 or a cudaError_t value. */
int cuda_kv_append_rows(const cuda_kv_append_job *d_jobs, int n_jobs, const uint16_t *k16, const uint16_t *v16,
                        size_t row_elems, strata_cuda_stream stream);
int cuda_kv_shift_tails(const cuda_kv_shift_job *d_jobs, int n_jobs, int shift, int keep, size_t row_elems,
                        strata_cuda_stream stream);

#ifdef __cplusplus
}
#endif

#endif
