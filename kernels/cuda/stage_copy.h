// Asynchronous copies of global rows into shared memory (cp.async), for the staged attention
// kernels (kv_attention_fast.cu, kv_attention_mma.cu). Device code only.
#ifndef STRATA_KERNELS_CUDA_STAGE_COPY_H
#define STRATA_KERNELS_CUDA_STAGE_COPY_H

#include <stddef.h>
#include <stdint.h>

__device__ inline void stage_cp_async(void *dst, const void *src, int bytes)
{
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    if (bytes == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
    else if (bytes == 8)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(d), "l"(src));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src));
}

__device__ inline void stage_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ inline void stage_wait_prev() { asm volatile("cp.async.wait_group 1;\n" ::); }

// rows x row_bytes from src (rows `stride` bytes apart) to dst (packed), by threads tid of
// nthreads, in the widest pieces the addresses allow. Every size here is a multiple of 2; pieces
// of 4+ go through cp.async, a 2-aligned leftover (never seen from our own allocations) is
// copied directly.
__device__ inline void stage_rows(uint8_t *dst, const uint8_t *src, int rows, int row_bytes, size_t stride, int tid,
                                  int nthreads)
{
    const uintptr_t a = (uintptr_t)src | (uintptr_t)dst | (uintptr_t)stride | (uintptr_t)row_bytes;
    const int unit = (a & 15) == 0 ? 16 : (a & 7) == 0 ? 8 : (a & 3) == 0 ? 4 : 2;
    const int per_row = row_bytes / unit, total = rows * per_row;
    // Rows of a power-of-two number of pieces (every layout of ours) split a piece index by shifts.
    const bool pow2 = (per_row & (per_row - 1)) == 0;
    const int shift = __ffs(per_row) - 1;
    for (int x = tid; x < total; x += nthreads) {
        const int r = pow2 ? x >> shift : x / per_row, o = (x - r * per_row) * unit;
        if (unit >= 4)
            stage_cp_async(dst + (size_t)r * row_bytes + o, src + (size_t)r * stride + o, unit);
        else
            *(uint16_t *)(dst + (size_t)r * row_bytes + o) = *(const uint16_t *)(src + (size_t)r * stride + o);
    }
}

#endif
