/* The CUDA side of the KV tiers: the memory operations of a device block pool
 * (offload/device_pool.h) on one GPU, and a pinned allocator for the host arena
 * (offload/host_arena.h), so blocks move between the device, pinned host memory and NVMe.
 *
 * Copies run on a stream of their own; each first waits (cudaStreamWaitEvent) for everything
 * already enqueued on the compute stream (the legacy default stream, where the forward pass runs),
 * so a slot is never copied out or overwritten while a kernel enqueued before may still read it,
 * and the host waits for the copy, so the staging slot can be reused and the compute enqueued
 * afterwards sees the bytes. Version 1 is synchronous per block (no overlap of copies with compute).
 * Status: compiled in every build with nvcc; see docs/benchmarks.md for whether it has run. */
#ifndef STRATA_WORKER_CUDA_DEVICE_MEM_H
#define STRATA_WORKER_CUDA_DEVICE_MEM_H

#include "kvstore/error.h"
#include "offload/device_pool.h"
#include "offload/host_arena.h"

typedef struct cuda_device_mem cuda_device_mem;

/* Memory operations on CUDA device `device` (which must be the calling thread's current device
 * whenever the pool uses them). *ops refers to the returned object, which must outlive the pool. */
cuda_device_mem *cuda_device_mem_create(int device, device_pool_mem *ops, strata_error *err);
void cuda_device_mem_free(cuda_device_mem *m);

/* cudaHostAlloc'd (page-locked) memory for a host arena: DMA to and from the device without a
 * bounce buffer. The returned struct is a constant. */
const host_arena_allocator *cuda_pinned_host_allocator(void);

#endif
