/* Sampling on a CUDA device: one token per row of logits, the pick of worker/sampler.h's
 * sampler_pick (sorted order, top-k, temperature, top-p, then the token at the draw u), without
 * sorting and without copying the logits to the host. The PRNG stays on the host: each row
 * comes with its draw u (sampler_next_draw), so a sequence's sampler state is the same whether
 * its tokens were picked on the CPU or the GPU.
 *
 * How: one thread block per row. The sorted order is never built; every cut in it (the top-k
 * boundary, the top-p boundary, the draw) is found by a radix descent over the logits' bits
 * (an order-preserving 32-bit key, -0 equal to +0), counting tokens or summing weights per
 * digit, and ties in logit are resolved in ascending id, as the CPU's sort orders them.
 *
 * Agreement with sampler_pick: the same token, except when the draw u * (kept weight), or the
 * top-p target top_p * (top-k weight), lies within about 1e-6 of that weight from a boundary
 * between two tokens: the device's expf may differ from the host's by 2 ulp, its sums run in
 * another order (the order of its double atomics varies from run to run, so a pick that close to
 * a boundary may also vary between runs), and the CPU compares its running sum of p_i / sum with
 * top_p where the device compares the running weight with top_p * sum. The last matters only on
 * an exact tie with the target, e.g. m tokens of weight 1 and top_p 0.5 with m even.
 * tests/cuda/test_cuda_sample.c measures that distance for every token that differs.
 * Kernel body and design: kernels/cuda/sample_block.h (phases shared with the CPU emulation).
 * Status: compiled in every build with nvcc; see docs/benchmarks.md for whether it has run. */
#ifndef STRATA_KERNELS_CUDA_SAMPLE_H
#define STRATA_KERNELS_CUDA_SAMPLE_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/cuda_ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One row's parameters (sampler_params without the seed) and its draw in [0, 1). Greedy rows
 * (temperature 0 or top_k 1) take the argmax, lowest id on ties, and ignore u. */
typedef struct cuda_sample_row {
    double u;
    float temperature;
    float top_p;
    int32_t top_k;
    int32_t pad_;
} cuda_sample_row;

/* out[r] (device) = the token picked from row r of logits (fp32, n_rows x n_vocab, device), with
 * the parameters d_rows[r] (device). A row holding a NaN or +inf logit, or no finite logit, gets -1
 * (the CPU sampler's order or weights are undefined there); -inf logits are tokens of weight 0.
 * A row whose parameters sampler_params_validate would reject, or, unless greedy, whose u is
 * outside [0, 1), also gets -1. Asynchronous on the stream. Returns 0 (nothing launched when
 * n_rows <= 0), cudaErrorInvalidValue for n_vocab outside 1..2^24 (ids must fit 24 bits of the
 * kernel's sort key) or a NULL pointer, or the launch's cudaError_t. */
int cuda_sample_rows(const float *logits, int n_rows, int n_vocab, const cuda_sample_row *d_rows, int32_t *out,
                     strata_cuda_stream stream);

#ifdef __cplusplus
}
#endif

#endif
