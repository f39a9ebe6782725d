/* STRATA_HD marks the small inline functions that CUDA kernels share with the C code (fp16
 * conversion, the quantizer's rounding, CRC32C arithmetic), so the GPU computes them with the
 * very same code as the CPU reference and writes the same bytes. Empty for the C compiler. */
#ifndef STRATA_KVSTORE_HD_H
#define STRATA_KVSTORE_HD_H

#include <math.h>

#ifdef __CUDACC__
#define STRATA_HD __host__ __device__
#else
#define STRATA_HD
#endif

/* fmaxf's NaN rule (a NaN operand loses) inline: without -ffinite-math-only the C compiler calls
 * glibc's fmaxf out of line, which was 30 % of the CPU emulations' time in the softmax maxima.
 * On the device it is fmaxf itself. */
static inline STRATA_HD float strata_fmaxf(float a, float b)
{
#ifdef __CUDA_ARCH__
    return fmaxf(a, b);
#else
    return (b > a || a != a) ? b : a;
#endif
}

#endif
