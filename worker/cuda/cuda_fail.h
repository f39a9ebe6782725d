/* A failed CUDA runtime call as a strata error: out of memory as STRATA_ENOMEM (a caller may shed
 * load and retry), anything else as STRATA_EIO; the message names what was being done. */
#ifndef STRATA_WORKER_CUDA_CUDA_FAIL_H
#define STRATA_WORKER_CUDA_CUDA_FAIL_H

#include <cuda_runtime.h>

#include "kvstore/error.h"

static inline int cuda_fail(strata_error *err, cudaError_t e, const char *what)
{
    return strata_fail(err, e == cudaErrorMemoryAllocation ? STRATA_ENOMEM : STRATA_EIO, "CUDA %s: %s", what,
                       cudaGetErrorString(e));
}

#endif
