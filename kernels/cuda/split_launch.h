// The launch of a split decode-attention kernel (kv_attention_fast.cu, kv_attention_mma.cu): one
// thread block per (KV head, split, sequence), the arguments every split kernel takes, the shared
// memory it asks for allowed first. Device-side code only (a CUDA header).
#ifndef STRATA_KERNELS_CUDA_SPLIT_LAUNCH_H
#define STRATA_KERNELS_CUDA_SPLIT_LAUNCH_H

#include <cuda_runtime.h>

#include "kernels/cuda_kv_attention.h"

using split_kernel = void (*)(cuda_kv_layout, cuda_kv_plan, const cuda_kv_seq *, const float *, float *, float *, int *);

inline int launch_split(split_kernel kernel, const char *name, int threads, size_t smem, const cuda_kv_layout &L,
                        const cuda_kv_plan &P, const cuda_kv_seq *seqs, const float *q, float *ws_acc, float *ws_ml,
                        int *status, cudaStream_t st, strata_error *err)
{
    if (smem > 48 * 1024 &&
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) != cudaSuccess)
        return strata_fail(err, STRATA_EIO, "CUDA attention: %s: %zu bytes of shared memory: %s", name, smem,
                           cudaGetErrorString(cudaGetLastError()));
    const dim3 grid((unsigned)L.n_kv_heads, (unsigned)P.n_splits, (unsigned)P.n_seqs);
    kernel<<<grid, threads, smem, st>>>(L, P, seqs, q, ws_acc, ws_ml, status);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return strata_fail(err, STRATA_EIO, "CUDA attention: %s: %s", name, cudaGetErrorString(e));
    return STRATA_OK;
}

#endif
