/* A fake CUDA runtime for CI (tests/fakecuda/README.md): the subset of cuda_runtime.h that the
 * GPU host code (worker/cuda, the stage) and its tests call, implemented on the host so that
 * code runs, under the sanitizers too, on a machine without a GPU. "Device" memory is host memory
 * the fake keeps a registry of: copies check that their kind matches where the pointers live. */
#ifndef STRATA_FAKECUDA_CUDA_RUNTIME_H
#define STRATA_FAKECUDA_CUDA_RUNTIME_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidDevicePointer = 17,
    cudaErrorInsufficientDriver = 35,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorIllegalAddress = 700,
    cudaErrorNoDevice = 100,
} cudaError_t;

typedef enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
} cudaMemcpyKind;

enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16, cudaDevAttrMaxSharedMemoryPerBlockOptin = 97 };

typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;

#define cudaStreamNonBlocking 0x01u
#define cudaEventDisableTiming 0x02u
#define cudaHostAllocDefault 0x00u

struct cudaDeviceProp {
    char name[256];
    int major, minor;
    int multiProcessorCount;
    size_t totalGlobalMem;
};

cudaError_t cudaMalloc(void **ptr, size_t bytes);
cudaError_t cudaFree(void *ptr);
cudaError_t cudaHostAlloc(void **ptr, size_t bytes, unsigned flags);
cudaError_t cudaFreeHost(void *ptr);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream);
cudaError_t cudaMemset(void *ptr, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void *ptr, int value, size_t bytes, cudaStream_t stream);
const char *cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetLastError(void);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device);
cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device);
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned flags);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned flags);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);
cudaError_t cudaEventDestroy(cudaEvent_t event);

/* For the emulated kernels (tests/fakecuda/kernels_emu.c): whether [p, p + bytes) lies inside
 * one fake device allocation. */
int fakecuda_is_device(const void *p, size_t bytes);

/* Every emulated kernel and cuBLAS call first runs the asynchronous copies queued before it
 * (fakecuda.c), as the device would have. An emulated kernel then reports what the real launch
 * wrapper's cudaGetLastError would: the error an earlier failed runtime call recorded and nobody
 * took (taking it), or cudaSuccess; on an error the kernel does not run. */
cudaError_t fakecuda_launch(void);

/* Test control, fake device only: cudaMalloc fails with cudaErrorMemoryAllocation (recording
 * it, as the runtime does) once the live device allocations would pass `bytes`; 0: the 4 GiB
 * the device reports (cudaMemGetInfo). cudaHostAlloc likewise with pinned_bytes (0: no limit). */
void fakecuda_limit_memory(size_t bytes, size_t pinned_bytes);

/* Test control, fake device only: an error the device met (cudaErrorIllegalAddress, say), which
 * cudaDeviceSynchronize and every launch then report without clearing, as a lost context does;
 * cudaSuccess restores the device. */
void fakecuda_set_sticky_error(cudaError_t e);
/* Test control, fake device only: the next cudaEventSynchronize fails with e (once), as an event
 * the driver lost would; the device goes on. */
void fakecuda_fail_next_event_sync(cudaError_t e);

#ifdef __cplusplus
}
#endif

#endif
