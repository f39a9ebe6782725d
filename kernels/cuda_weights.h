/* Weights built on the device from where they are stored (kernels/weight_values.h): GGUF blocks
 * copied to the device and decoded there, synthetic weights generated there. The values equal
 * the CPU loader's bit for bit (the same functions, no fused multiply-adds). Each returns 0 or a
 * cudaError_t value; kernels/cuda/weights.cu. */
#ifndef STRATA_KERNELS_CUDA_WEIGHTS_H
#define STRATA_KERNELS_CUDA_WEIGHTS_H

#include <stdbool.h>
#include <stdint.h>

#include "kernels/cuda_ops.h"   /* strata_cuda_stream */

#ifdef __cplusplus
extern "C" {
#endif

/* Decodes the n elements of GGUF data of a type gguf_type_block accepts, starting at d_data
 * (device memory, at a block boundary: a whole number of blocks, or a tensor's last ones), into
 * out: fp32, or fp16 rounded to nearest even when out_f16. An element whose value is not finite
 * (in fp16 when out_f16: beyond +-65504 too) lowers *d_first_bad (device memory, set to
 * UINT64_MAX by the caller) to first + its index: first is where d_data starts in the whole
 * tensor, so the caller can name the element. cudaErrorInvalidValue for any other type. */
int cuda_weights_from_gguf(uint32_t type, const void *d_data, uint64_t n, uint64_t first, void *out, bool out_f16,
                           unsigned long long *d_first_bad, strata_cuda_stream stream);

/* out[i] = synthetic_value(key, amp, first + i) for i < n (fp32, or fp16 when out_f16): a
 * synthetic matrix (worker/synthetic.h), or the part of it from element first. */
int cuda_weights_synthetic(uint64_t key, float amp, uint64_t first, uint64_t n, void *out, bool out_f16,
                           strata_cuda_stream stream);

#ifdef __cplusplus
}
#endif

#endif
