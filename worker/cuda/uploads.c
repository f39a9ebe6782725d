/* Pinned staging for a step's uploads (uploads.h). */
#include "worker/cuda/uploads.h"

#include <cuda_runtime.h>
#include <string.h>

#include "worker/cuda/cuda_fail.h"

enum { UPLOAD_ALIGN = 16 };

int cuda_uploads_begin(cuda_uploads *u, strata_error *err)
{
    cudaError_t e;
    /* A step that failed midway may have left copies from the buffer enqueued. */
    if (u->used && (e = cudaStreamSynchronize(0)) != cudaSuccess)
        return cuda_fail(err, e, "waiting for the last step's uploads");
    if (u->wanted > u->cap && u->wanted > u->refused) {   /* a size refused is not asked for every step */
        const size_t cap = u->wanted + u->wanted / 2;   /* room for the tables to grow a while */
        void *p = NULL;
        if ((e = cudaHostAlloc(&p, cap, cudaHostAllocDefault)) == cudaSuccess) {
            cudaFreeHost(u->pinned);
            u->pinned = p;
            u->cap = cap;
        } else {
            /* Not a reason to fail the step (pinned memory may be short: a host tier, a low
             * memlock limit): what does not fit the buffer kept is copied synchronously. */
            (void)cudaGetLastError();
            u->failed_grows++;
            u->refused = cap;
        }
    }
    u->used = 0;
    u->wanted = 0;
    return STRATA_OK;
}

int cuda_uploads_copy(cuda_uploads *u, void *dst, const void *src, size_t n, const char *what, strata_error *err)
{
    if (n == 0)
        return STRATA_OK;
    const size_t at = (u->used + UPLOAD_ALIGN - 1) / UPLOAD_ALIGN * UPLOAD_ALIGN;
    u->wanted += (n + UPLOAD_ALIGN - 1) / UPLOAD_ALIGN * UPLOAD_ALIGN;
    cudaError_t e;
    if (u->pinned && at <= u->cap && n <= u->cap - at) {
        memcpy(u->pinned + at, src, n);
        u->used = at + n;
        e = cudaMemcpyAsync(dst, u->pinned + at, n, cudaMemcpyHostToDevice, 0);
    } else {
        u->sync_copies++;
        e = cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice);
    }
    return e == cudaSuccess ? STRATA_OK : cuda_fail(err, e, what);
}

void cuda_uploads_free(cuda_uploads *u)
{
    if (u->used)
        cudaStreamSynchronize(0);   /* no copy may read the buffer after it is freed */
    cudaFreeHost(u->pinned);
    memset(u, 0, sizeof *u);
}
