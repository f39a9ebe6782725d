/* STRATA_HD marks the small inline functions that CUDA kernels share with the C code (fp16
 * conversion, the quantizer's rounding, CRC32C arithmetic), so the GPU computes them with the
 * very same code as the CPU reference and writes the same bytes. Empty for the C compiler. */
#ifndef STRATA_KVSTORE_HD_H
#define STRATA_KVSTORE_HD_H

#ifdef __CUDACC__
#define STRATA_HD __host__ __device__
#else
#define STRATA_HD
#endif

#endif
