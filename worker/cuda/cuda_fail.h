/* A failed CUDA runtime call as a strata error: out of memory as STRATA_ENOMEM (a caller may shed
 * load and retry), anything else as STRATA_EIO; the message names what was being done. The
 * runtime also records the error for cudaGetLastError, which every kernel launch of ours reads
 * afterwards: it is taken here, so a failed allocation fails its own step and not the next
 * launch (an error that breaks the context, such as an illegal address, stays: the runtime
 * returns it from every later call). */
#ifndef STRATA_WORKER_CUDA_CUDA_FAIL_H
#define STRATA_WORKER_CUDA_CUDA_FAIL_H

#include <cuda_runtime.h>
#include <stdarg.h>
#include <stdio.h>

#include "kvstore/error.h"

static inline int cuda_fail(strata_error *err, cudaError_t e, const char *what)
{
    (void)cudaGetLastError();
    return strata_fail(err, e == cudaErrorMemoryAllocation ? STRATA_ENOMEM : STRATA_EIO, "CUDA %s: %s", what,
                       cudaGetErrorString(e));
}

/* cuda_fail with a printf-style description of what was being done. */
__attribute__((format(printf, 3, 4))) static inline int cuda_failf(strata_error *err, cudaError_t e,
                                                                    const char *fmt, ...)
{
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return cuda_fail(err, e, what);
}

#endif
