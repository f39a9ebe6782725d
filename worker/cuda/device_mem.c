/* CUDA memory operations for the KV tiers (device_mem.h). */
#include "worker/cuda/device_mem.h"

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "worker/cuda/cuda_fail.h"

struct cuda_device_mem {
    int device;
    char name[32];
    cudaStream_t copy;
    cudaEvent_t compute_done;   /* recorded on the compute stream before each copy */
};

static void *alloc_arena(void *ctx, size_t bytes, strata_error *err)
{
    (void)ctx;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes);   /* 256-byte aligned */
    if (e != cudaSuccess) {
        cuda_fail(err, e, "allocating the KV block arena");
        return NULL;
    }
    return p;
}

static void free_arena(void *ctx, void *p)
{
    (void)ctx;
    cudaFree(p);
}

static void *alloc_staging(void *ctx, size_t bytes, strata_error *err)
{
    (void)ctx;
    void *p = NULL;
    cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
    if (e != cudaSuccess) {
        cuda_fail(err, e, "allocating pinned staging");
        return NULL;
    }
    return p;
}

static void free_staging(void *ctx, void *p)
{
    (void)ctx;
    cudaFreeHost(p);
}

/* The copy stream waits for the compute enqueued so far, copies, and the host waits for it. */
static int ordered_copy(cuda_device_mem *m, void *dst, const void *src, size_t n, enum cudaMemcpyKind kind,
                        strata_error *err)
{
    cudaError_t e = cudaEventRecord(m->compute_done, 0);
    if (e == cudaSuccess)
        e = cudaStreamWaitEvent(m->copy, m->compute_done, 0);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(dst, src, n, kind, m->copy);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(m->copy);
    return e == cudaSuccess ? STRATA_OK
                            : cuda_fail(err, e, kind == cudaMemcpyDeviceToHost ? "copying a block off the device"
                                                                               : "copying a block to the device");
}

static int copy_out(void *ctx, void *host, const void *src, size_t n, strata_error *err)
{
    return ordered_copy(ctx, host, src, n, cudaMemcpyDeviceToHost, err);
}

static int copy_in(void *ctx, void *dst, const void *host, size_t n, strata_error *err)
{
    return ordered_copy(ctx, dst, host, n, cudaMemcpyHostToDevice, err);
}

cuda_device_mem *cuda_device_mem_create(int device, device_pool_mem *ops, strata_error *err)
{
    if (!ops || device < 0) {
        strata_fail(err, STRATA_EINVAL, "cuda_device_mem_create: bad arguments");
        return NULL;
    }
    cuda_device_mem *m = calloc(1, sizeof *m);
    if (!m) {
        strata_fail(err, STRATA_ENOMEM, "out of memory");
        return NULL;
    }
    m->device = device;
    snprintf(m->name, sizeof m->name, "cuda:%d", device);
    cudaError_t e = cudaStreamCreateWithFlags(&m->copy, cudaStreamNonBlocking);
    if (e == cudaSuccess)
        e = cudaEventCreateWithFlags(&m->compute_done, cudaEventDisableTiming);
    if (e != cudaSuccess) {
        cuda_fail(err, e, "creating the KV copy stream");
        cuda_device_mem_free(m);
        return NULL;
    }
    *ops = (device_pool_mem){.name = m->name, .alloc_arena = alloc_arena, .free_arena = free_arena,
                             .alloc_staging = alloc_staging, .free_staging = free_staging, .copy_out = copy_out,
                             .copy_in = copy_in, .ctx = m};
    return m;
}

void cuda_device_mem_free(cuda_device_mem *m)
{
    if (!m)
        return;
    if (m->compute_done)
        cudaEventDestroy(m->compute_done);
    if (m->copy)
        cudaStreamDestroy(m->copy);
    free(m);
}

static void *pinned_alloc(size_t bytes, void *ctx, strata_error *err)
{
    void *p = alloc_staging(ctx, bytes, err);
    if (p && (uintptr_t)p % HOST_ARENA_PAGE) {   /* the arena's contract; cudaHostAlloc gives whole pages */
        free_staging(ctx, p);
        strata_fail(err, STRATA_EIO, "cudaHostAlloc returned memory not aligned to %u bytes", HOST_ARENA_PAGE);
        return NULL;
    }
    return p;
}

static void pinned_release(void *ptr, size_t bytes, void *ctx)
{
    (void)bytes;
    free_staging(ctx, ptr);
}

const host_arena_allocator *cuda_pinned_host_allocator(void)
{
    static const host_arena_allocator pinned = {.name = "pinned (cudaHostAlloc)", .alloc = pinned_alloc,
                                                .release = pinned_release, .ctx = NULL};
    return &pinned;
}
