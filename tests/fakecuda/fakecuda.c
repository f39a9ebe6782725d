/* The fake CUDA runtime and cuBLAS of tests/fakecuda (see README.md there). Device memory is
 * malloc'd host memory in a registry, so that every copy can be checked against its kind (a host
 * pointer passed where the device was meant fails here as it would on a GPU) and the sanitizers
 * see every device buffer's bounds. Streams exist only as names, events as the host clock when
 * they were recorded: everything runs in program order, at once, except the copies a GPU would run behind the host (cudaMemcpyAsync with
 * pinned host memory on one side, or device to device): those wait in a queue until the next
 * point where the device must have run them (a kernel or cuBLAS call, a synchronous copy or
 * memset, a synchronize, a free). A host that overwrites a pinned source before then, or reads a
 * pinned destination, gets what a GPU running behind would give it. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cblas.h>

#include "cublas_v2.h"
#include "cuda_runtime.h"
#include "kvstore/half.h"

typedef struct allocation {
    uintptr_t base;
    size_t bytes;
} allocation;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static allocation *allocs;
static size_t n_allocs, cap_allocs;
static allocation *pinned;   /* cudaHostAlloc'd blocks */
static size_t n_pinned, cap_pinned;
static cudaError_t last_error;
static size_t live_device, live_pinned;     /* bytes allocated now */
static size_t limit_device, limit_pinned;   /* fakecuda_limit_memory; 0: the device's 4 GiB, pinned none */
#define FAKE_DEVICE_BYTES ((size_t)4 << 30)     /* what cudaMemGetInfo and the properties report */
static cudaError_t sticky_error;            /* fakecuda_set_sticky_error */

typedef struct pending_copy {
    void *dst;
    const void *src;
    size_t bytes;
} pending_copy;
static pending_copy *pending;   /* asynchronous copies not run yet, in order */
static size_t n_pending, cap_pending;

static cudaError_t fail(cudaError_t e, const char *what)
{
    fprintf(stderr, "fakecuda: %s\n", what);
    last_error = e;
    return e;
}

/* Index of the block of arr[0..n) holding [p, p + bytes), or n. Called with the lock held. */
static size_t find_in(const allocation *arr, size_t n, const void *p, size_t bytes)
{
    const uintptr_t a = (uintptr_t)p;
    for (size_t i = 0; i < n; i++)
        if (a >= arr[i].base && a - arr[i].base <= arr[i].bytes && bytes <= arr[i].bytes - (a - arr[i].base))
            return i;
    return n;
}

/* The device allocation holding [p, p + bytes), or n_allocs. */
static size_t find(const void *p, size_t bytes) { return find_in(allocs, n_allocs, p, bytes); }

/* Appends to a registry array of blocks (allocs or pinned). Called with the lock held. */
static int registry_add(allocation **arr, size_t *n, size_t *cap, const void *p, size_t bytes)
{
    if (*n == *cap) {
        const size_t grown_cap = *cap ? 2 * *cap : 256;
        allocation *grown = realloc(*arr, grown_cap * sizeof *grown);
        if (!grown)
            return -1;
        *arr = grown;
        *cap = grown_cap;
    }
    (*arr)[(*n)++] = (allocation){(uintptr_t)p, bytes};
    return 0;
}

static int is_pinned(const void *p, size_t bytes) { return find_in(pinned, n_pinned, p, bytes) < n_pinned; }

/* Runs the queued asynchronous copies: the device catching up. */
static void run_pending(void)
{
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < n_pending; i++)
        memmove(pending[i].dst, pending[i].src, pending[i].bytes);
    n_pending = 0;
    pthread_mutex_unlock(&lock);
}

cudaError_t fakecuda_launch(void)
{
    run_pending();
    pthread_mutex_lock(&lock);
    const cudaError_t e = sticky_error != cudaSuccess ? sticky_error : last_error;
    last_error = cudaSuccess;
    pthread_mutex_unlock(&lock);
    return e;
}

void fakecuda_set_sticky_error(cudaError_t e)
{
    pthread_mutex_lock(&lock);
    sticky_error = e;
    pthread_mutex_unlock(&lock);
}

int fakecuda_is_device(const void *p, size_t bytes)
{
    pthread_mutex_lock(&lock);
    const int yes = p && find(p, bytes) < n_allocs;
    pthread_mutex_unlock(&lock);
    return yes;
}

/* ---- the fp16 weights' fp32 copies for the GEMM, dropped when their memory is freed ---- */

typedef struct converted {
    const void *src;
    size_t elems;
    float *f32;
} converted;
static converted *conv;
static size_t n_conv, cap_conv;

static void drop_converted(uintptr_t base, size_t bytes)
{
    for (size_t i = 0; i < n_conv;) {
        if ((uintptr_t)conv[i].src >= base && (uintptr_t)conv[i].src < base + bytes) {
            free(conv[i].f32);
            conv[i] = conv[--n_conv];
        } else {
            i++;
        }
    }
}

void fakecuda_limit_memory(size_t bytes, size_t pinned_bytes)
{
    pthread_mutex_lock(&lock);
    limit_device = bytes;
    limit_pinned = pinned_bytes;
    pthread_mutex_unlock(&lock);
}

/* Whether bytes more fit under the device's limit (pinned: the pinned memory's, 0 meaning none); read
 * with the lock held, as keep() adds to the count. */
static bool under_limit(bool pinned_memory, size_t bytes)
{
    pthread_mutex_lock(&lock);
    const size_t live = pinned_memory ? live_pinned : live_device;
    const size_t limit = pinned_memory ? limit_pinned : limit_device ? limit_device : FAKE_DEVICE_BYTES;
    const bool ok = !limit || (live <= limit && bytes <= limit - live);
    pthread_mutex_unlock(&lock);
    return ok;
}

/* A new block p in a registry, handed out through *ptr; freed again if the registry cannot grow. */
static cudaError_t keep(allocation **arr, size_t *n, size_t *cap, void *p, size_t bytes, void **ptr, const char *oom)
{
    pthread_mutex_lock(&lock);
    const int added = registry_add(arr, n, cap, p, bytes);
    if (added == 0)
        *(arr == &allocs ? &live_device : &live_pinned) += bytes;
    pthread_mutex_unlock(&lock);
    if (added != 0) {
        free(p);
        return fail(cudaErrorMemoryAllocation, oom);
    }
    *ptr = p;
    return cudaSuccess;
}

cudaError_t cudaMalloc(void **ptr, size_t bytes)
{
    if (!ptr)
        return fail(cudaErrorInvalidValue, "cudaMalloc: NULL");
    *ptr = NULL;
    if (!under_limit(false, bytes))
        return fail(cudaErrorMemoryAllocation, "cudaMalloc: out of memory (the fake device's 4 GiB, or the test's limit)");
    void *p = malloc(bytes ? bytes : 1);
    if (!p)
        return fail(cudaErrorMemoryAllocation, "cudaMalloc: out of memory");
    memset(p, 0xa5, bytes);   /* device memory starts as garbage: never read before written */
    return keep(&allocs, &n_allocs, &cap_allocs, p, bytes, ptr, "cudaMalloc: out of memory for the registry");
}

cudaError_t cudaFree(void *ptr)
{
    if (!ptr)
        return cudaSuccess;
    run_pending();   /* cudaFree waits for the device */
    pthread_mutex_lock(&lock);
    size_t i = 0;
    while (i < n_allocs && allocs[i].base != (uintptr_t)ptr)
        i++;
    if (i == n_allocs) {
        pthread_mutex_unlock(&lock);
        return fail(cudaErrorInvalidDevicePointer, "cudaFree: not the start of a device allocation");
    }
    drop_converted(allocs[i].base, allocs[i].bytes);
    live_device -= allocs[i].bytes;
    allocs[i] = allocs[--n_allocs];
    pthread_mutex_unlock(&lock);
    free(ptr);
    return cudaSuccess;
}

cudaError_t cudaHostAlloc(void **ptr, size_t bytes, unsigned flags)
{
    (void)flags;
    if (!ptr)
        return fail(cudaErrorInvalidValue, "cudaHostAlloc: NULL");
    /* pinned memory comes in whole pages, as the real allocator's does */
    const size_t rounded = (bytes + 4095) / 4096 * 4096 + (bytes ? 0 : 4096);
    if (!under_limit(true, rounded))
        return fail(cudaErrorMemoryAllocation, "cudaHostAlloc: out of memory (the test's limit)");
    void *p = aligned_alloc(4096, rounded);
    if (!p)
        return fail(cudaErrorMemoryAllocation, "cudaHostAlloc: out of memory");
    return keep(&pinned, &n_pinned, &cap_pinned, p, rounded, ptr, "cudaHostAlloc: out of memory for the registry");
}

cudaError_t cudaFreeHost(void *ptr)
{
    if (!ptr)
        return cudaSuccess;
    run_pending();   /* cudaFreeHost waits for the device */
    pthread_mutex_lock(&lock);
    size_t i = 0;
    while (i < n_pinned && pinned[i].base != (uintptr_t)ptr)
        i++;
    const int found = i < n_pinned;
    if (found) {
        live_pinned -= pinned[i].bytes;
        pinned[i] = pinned[--n_pinned];
    }
    pthread_mutex_unlock(&lock);
    if (!found)
        return fail(cudaErrorInvalidValue, "cudaFreeHost: not the start of a cudaHostAlloc block");
    free(ptr);
    return cudaSuccess;
}

/* A copy's pointers against its kind: cudaSuccess, or the failure reported. */
static cudaError_t check_copy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind)
{
    if (!dst || !src)
        return fail(cudaErrorInvalidValue, "cudaMemcpy: NULL pointer");
    pthread_mutex_lock(&lock);
    const int dst_dev = find(dst, bytes) < n_allocs, src_dev = find(src, bytes) < n_allocs;
    pthread_mutex_unlock(&lock);
    const int want_dst = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
    const int want_src = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
    if (kind != cudaMemcpyDefault && (dst_dev != want_dst || src_dev != want_src)) {
        char msg[160];
        snprintf(msg, sizeof msg, "cudaMemcpy of %zu bytes, kind %d: the destination is %s and the source %s", bytes,
                 (int)kind, dst_dev ? "device memory" : "host memory (or out of bounds)",
                 src_dev ? "device memory" : "host memory (or out of bounds)");
        return fail(cudaErrorInvalidValue, msg);
    }
    /* The runtime does not promise memmove: overlapping ranges give undefined results there
     * (a forward copy here would hide it). */
    const uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
    if (d < s + bytes && s < d + bytes)
        return fail(cudaErrorInvalidValue, "cudaMemcpy: the source and destination overlap");
    return cudaSuccess;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind)
{
    if (bytes == 0)
        return cudaSuccess;
    const cudaError_t e = check_copy(dst, src, bytes, kind);
    if (e != cudaSuccess)
        return e;
    run_pending();   /* after everything enqueued before it */
    memmove(dst, src, bytes);
    return cudaSuccess;
}

/* Queued when the device would run it behind the host: pinned host memory on one side, or device
 * to device. From or to pageable memory the runtime copies through its own staging before it
 * returns, so the copy happens now (after the queue). */
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream)
{
    (void)stream;
    if (bytes == 0)
        return cudaSuccess;
    const cudaError_t e = check_copy(dst, src, bytes, kind);
    if (e != cudaSuccess)
        return e;
    pthread_mutex_lock(&lock);
    const int behind = kind == cudaMemcpyDeviceToDevice || (kind == cudaMemcpyHostToDevice && is_pinned(src, bytes)) ||
                       (kind == cudaMemcpyDeviceToHost && is_pinned(dst, bytes));
    if (behind && n_pending == cap_pending) {
        const size_t cap = cap_pending ? 2 * cap_pending : 64;
        pending_copy *grown = realloc(pending, cap * sizeof *grown);
        if (grown) {
            pending = grown;
            cap_pending = cap;
        }
    }
    if (behind && n_pending < cap_pending) {
        pending[n_pending++] = (pending_copy){dst, src, bytes};
        pthread_mutex_unlock(&lock);
        return cudaSuccess;
    }
    pthread_mutex_unlock(&lock);
    run_pending();
    memmove(dst, src, bytes);
    return cudaSuccess;
}

cudaError_t cudaMemset(void *ptr, int value, size_t bytes)
{
    if (bytes == 0)
        return cudaSuccess;
    if (!fakecuda_is_device(ptr, bytes))
        return fail(cudaErrorInvalidValue, "cudaMemset: not device memory");
    run_pending();
    memset(ptr, value, bytes);
    return cudaSuccess;
}

/* Device work in stream order: done at once, after the copies queued before it. */
cudaError_t cudaMemsetAsync(void *ptr, int value, size_t bytes, cudaStream_t stream)
{
    (void)stream;
    return cudaMemset(ptr, value, bytes);
}

const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "no error (fake device)";
    case cudaErrorInvalidValue: return "invalid argument (fake device)";
    case cudaErrorMemoryAllocation: return "out of memory (fake device)";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer (fake device)";
    case cudaErrorInsufficientDriver: return "driver version insufficient (fake device)";
    case cudaErrorInvalidDevice: return "invalid device ordinal (fake device)";
    case cudaErrorNoDevice: return "no CUDA-capable device (fake device)";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle (fake device)";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered (fake device)";
    }
    return "unknown error (fake device)";
}

cudaError_t cudaGetLastError(void)
{
    const cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}

/* One fake device, number 0. */
cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : fail(cudaErrorInvalidDevice, "cudaSetDevice: only device 0"); }
cudaError_t cudaGetDevice(int *device)
{
    *device = 0;
    return cudaSuccess;
}
cudaError_t cudaGetDeviceCount(int *count)
{
    *count = 1;
    return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device)
{
    if (device != 0)
        return fail(cudaErrorInvalidDevice, "cudaGetDeviceProperties: only device 0");
    memset(prop, 0, sizeof *prop);
    snprintf(prop->name, sizeof prop->name, "fake device (tests/fakecuda: host memory, emulated kernels)");
    prop->major = 9;
    prop->multiProcessorCount = 4;
    prop->totalGlobalMem = FAKE_DEVICE_BYTES;
    return cudaSuccess;
}
/* Free is the 4 GiB the properties report less what the registry holds. */
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes)
{
    if (!free_bytes || !total_bytes)
        return fail(cudaErrorInvalidValue, "cudaMemGetInfo: NULL argument");
    const size_t total = FAKE_DEVICE_BYTES;
    size_t used = 0;
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < n_allocs; i++)
        used += allocs[i].bytes;
    pthread_mutex_unlock(&lock);
    *total_bytes = total;
    *free_bytes = used < total ? total - used : 0;
    return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device)
{
    if (device != 0 || (attr != cudaDevAttrMultiProcessorCount && attr != cudaDevAttrMaxSharedMemoryPerBlockOptin))
        return fail(cudaErrorInvalidValue,
                    "cudaDeviceGetAttribute: only the multiprocessor count and shared memory of device 0");
    *value = attr == cudaDevAttrMultiProcessorCount ? 4 : 232448;   /* an H100's 227 KiB a block */
    return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void)
{
    run_pending();
    pthread_mutex_lock(&lock);
    const cudaError_t e = sticky_error;
    pthread_mutex_unlock(&lock);
    return e;
}

struct CUstream_st { int unused; };
/* An event keeps the host clock at its last record: everything enqueued before it has run by
 * then (the pending copies run first), so differences are the fake's "device time". */
struct CUevent_st {
    unsigned flags;
    int recorded;
    double ms;
};

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned flags)
{
    (void)flags;
    *stream = calloc(1, sizeof **stream);
    return *stream ? cudaSuccess : fail(cudaErrorMemoryAllocation, "cudaStreamCreateWithFlags");
}
cudaError_t cudaStreamDestroy(cudaStream_t stream)
{
    free(stream);
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream)
{
    (void)stream;
    run_pending();   /* one queue for every stream: waiting for one runs all */
    return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned flags)
{
    (void)stream, (void)flags;
    return event ? cudaSuccess : fail(cudaErrorInvalidValue, "cudaStreamWaitEvent: NULL event");
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned flags)
{
    *event = calloc(1, sizeof **event);
    if (!*event)
        return fail(cudaErrorMemoryAllocation, "cudaEventCreateWithFlags");
    (*event)->flags = flags;
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream)
{
    (void)stream;
    if (!event)
        return fail(cudaErrorInvalidValue, "cudaEventRecord: NULL event");
    run_pending();
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    event->ms = (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
    event->recorded = 1;
    return cudaSuccess;
}
static cudaError_t next_event_sync_error;

void fakecuda_fail_next_event_sync(cudaError_t e)
{
    pthread_mutex_lock(&lock);
    next_event_sync_error = e;
    pthread_mutex_unlock(&lock);
}

cudaError_t cudaEventSynchronize(cudaEvent_t event)
{
    if (!event)
        return fail(cudaErrorInvalidValue, "cudaEventSynchronize: NULL event");
    run_pending();
    pthread_mutex_lock(&lock);
    const cudaError_t e = next_event_sync_error;
    next_event_sync_error = cudaSuccess;
    pthread_mutex_unlock(&lock);
    return e == cudaSuccess ? cudaSuccess : fail(e, "cudaEventSynchronize: the failure the test asked for");
}
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end)
{
    if (!ms || !start || !end)
        return fail(cudaErrorInvalidValue, "cudaEventElapsedTime: NULL argument");
    if ((start->flags | end->flags) & cudaEventDisableTiming)
        return fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: an event created with cudaEventDisableTiming");
    if (!start->recorded || !end->recorded)
        return fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: an event never recorded");
    *ms = (float)(end->ms - start->ms);
    return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event)
{
    free(event);
    return cudaSuccess;
}

/* ---- cuBLAS ---- */

struct cublasContext { int unused; };

cublasStatus_t cublasCreate(cublasHandle_t *handle)
{
    *handle = calloc(1, sizeof **handle);
    return *handle ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_ALLOC_FAILED;
}

cublasStatus_t cublasDestroy(cublasHandle_t handle)
{
    free(handle);
    return CUBLAS_STATUS_SUCCESS;
}

/* An fp32 view of an operand: itself, or fp16 converted (cached when `keep`: the weights). */
static const float *as_f32(const void *p, cudaDataType_t t, size_t elems, int keep, float **tmp)
{
    *tmp = NULL;
    if (t == CUDA_R_32F)
        return p;
    pthread_mutex_lock(&lock);
    for (size_t i = 0; keep && i < n_conv; i++)
        if (conv[i].src == p && conv[i].elems == elems) {
            const float *f = conv[i].f32;
            pthread_mutex_unlock(&lock);
            return f;
        }
    pthread_mutex_unlock(&lock);
    float *f = malloc(elems * sizeof *f);
    if (!f)
        return NULL;
    for (size_t i = 0; i < elems; i++)
        f[i] = strata_half_to_float(((const uint16_t *)p)[i]);
    if (!keep) {
        *tmp = f;
        return f;
    }
    pthread_mutex_lock(&lock);
    if (n_conv == cap_conv) {
        const size_t cap = cap_conv ? 2 * cap_conv : 64;
        converted *grown = realloc(conv, cap * sizeof *grown);
        if (!grown) {
            pthread_mutex_unlock(&lock);
            *tmp = f;
            return f;
        }
        conv = grown;
        cap_conv = cap;
    }
    conv[n_conv++] = (converted){p, elems, f};
    pthread_mutex_unlock(&lock);
    return f;
}

/* Elements a column-major operand spans: (cols - 1) * ld + rows, where op(X) is rows x cols as
 * stored (transposed operands are stored the other way round). */
static size_t span(cublasOperation_t op, int op_rows, int op_cols, int ld)
{
    const size_t rows = (size_t)(op == CUBLAS_OP_N ? op_rows : op_cols);
    const size_t cols = (size_t)(op == CUBLAS_OP_N ? op_cols : op_rows);
    return rows == 0 || cols == 0 ? 0 : (cols - 1) * (size_t)ld + rows;
}

/* One GEMM: C = alpha op(A) op(B) + beta C, column-major; keep_a: cache A's fp32 view (weights). */
static cublasStatus_t gemm_one(cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k, float alpha,
                               const void *A, cudaDataType_t Atype, int lda, const void *B, cudaDataType_t Btype,
                               int ldb, float beta, float *C, int ldc, int keep_a, const char *fn)
{
    const size_t a_elems = span(transa, m, k, lda), b_elems = span(transb, k, n, ldb);
    const size_t esz = Atype == CUDA_R_16F ? 2 : 4;
    if (!fakecuda_is_device(A, a_elems * esz) || !fakecuda_is_device(B, b_elems * esz) ||
        !fakecuda_is_device(C, span(CUBLAS_OP_N, m, n, ldc) * 4)) {
        fprintf(stderr, "fakecuda: %s: an operand is not (wholly) in device memory\n", fn);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    float *ta = NULL, *tb = NULL;
    const float *a = as_f32(A, Atype, a_elems, keep_a, &ta), *b = as_f32(B, Btype, b_elems, 0, &tb);
    if (!a || !b) {
        free(ta);
        free(tb);
        return CUBLAS_STATUS_ALLOC_FAILED;
    }
    cblas_sgemm(CblasColMajor, transa == CUBLAS_OP_N ? CblasNoTrans : CblasTrans,
                transb == CUBLAS_OP_N ? CblasNoTrans : CblasTrans, m, n, k, alpha, a, lda, b, ldb, beta, C, ldc);
    free(ta);
    free(tb);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void *alpha, const void *A, cudaDataType_t Atype, int lda, const void *B,
                            cudaDataType_t Btype, int ldb, const void *beta, void *C, cudaDataType_t Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t algo)
{
    (void)computeType, (void)algo;
    if (!handle || m < 0 || n < 0 || k < 0 || Ctype != CUDA_R_32F || Atype != Btype)
        return CUBLAS_STATUS_INVALID_VALUE;
    run_pending();   /* cuBLAS does not report the runtime's recorded error */
    return gemm_one(transa, transb, m, n, k, *(const float *)alpha, A, Atype, lda, B, Btype, ldb,
                    *(const float *)beta, C, ldc, 1, "cublasGemmEx");
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                          int m, int n, int k, const void *alpha, const void *A, cudaDataType_t Atype,
                                          int lda, long long strideA, const void *B, cudaDataType_t Btype, int ldb,
                                          long long strideB, const void *beta, void *C, cudaDataType_t Ctype, int ldc,
                                          long long strideC, int batchCount, cublasComputeType_t computeType,
                                          cublasGemmAlgo_t algo)
{
    (void)computeType, (void)algo;
    if (!handle || m < 0 || n < 0 || k < 0 || batchCount < 0 || Ctype != CUDA_R_32F || Atype != Btype)
        return CUBLAS_STATUS_INVALID_VALUE;
    run_pending();
    const size_t esz = Atype == CUDA_R_16F ? 2 : 4;
    for (int b = 0; b < batchCount; b++) {
        const cublasStatus_t st = gemm_one(
            transa, transb, m, n, k, *(const float *)alpha, (const char *)A + (size_t)(strideA * b) * esz, Atype, lda,
            (const char *)B + (size_t)(strideB * b) * esz, Btype, ldb, *(const float *)beta,
            (float *)C + (size_t)(strideC * b), ldc, 0, "cublasGemmStridedBatchedEx");
        if (st != CUBLAS_STATUS_SUCCESS)
            return st;
    }
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream(cublasHandle_t handle, cudaStream_t *stream)
{
    if (!handle || !stream)
        return CUBLAS_STATUS_INVALID_VALUE;
    *stream = NULL;   /* the fake runs everything in order */
    return CUBLAS_STATUS_SUCCESS;
}
