/* The NCCL backend of the data plane (compiled only when CMake found the CUDA toolkit and
 * libnccl; STRATA_HAVE_NCCL). Plain C over the CUDA runtime and NCCL C APIs.
 *
 * Each link owns one communicator, one non-blocking CUDA stream, a 64-byte device buffer and a
 * pinned host buffer for the frame header. A message is two NCCL point-to-point
 * transfers to/from the peer rank on that stream: the 64-byte header (encoded on the host,
 * copied to the device), then the payload straight from/to the caller's device buffer. Every
 * call waits for its stream, polling cudaStreamQuery and ncclCommGetAsyncError against a
 * deadline: a timeout or an asynchronous NCCL error breaks the link, and closing a broken link
 * aborts its communicator (ncclCommAbort) instead of destroying it, since an enqueued
 * send/recv cannot be cancelled.
 *
 * Loopback links (nranks 1, rank 0, peer 0) exist only so that this whole path (communicator
 * init, ncclSend/ncclRecv of header and payload on the link's stream, pointer checks, waits,
 * async-error polling, close/abort) can be tested on a machine with one GPU: NCCL refuses two
 * ranks of one communicator on one device, and a real pipeline link needs two GPUs. Serving never
 * creates one. Because dp_send waits for its send to complete, and on one rank only the same
 * thread could post the matching receive, a loopback dp_send posts each send (header, then
 * payload) together with its receive into a device staging buffer owned by the link, the pair in
 * one NCCL group (the way NCCL lets a rank send to itself), waits, and queues the result in a
 * small FIFO (DP_NCCL_LOOPBACK_QUEUE messages; EFULL beyond it); the receive calls then
 * take the oldest queued message (its header as the bytes NCCL delivered, decoded by the same
 * dp_frame_decode as the two-rank path; its payload copied device-to-device into the caller's
 * buffer on the link's stream).
 *
 * No payload CRC: the bytes never leave device memory and the interconnect (NVLink, PCIe) has
 * its own link-level CRC/ECC; a CRC would need an extra kernel pass over every activation. The
 * header still carries its own CRC32C (computed on the host). */
#include <errno.h>
#include <inttypes.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "worker/transport/transport.h"
#include "worker/transport/transport_impl.h"

_Static_assert(sizeof(ncclUniqueId) == DP_NCCL_ID_BYTES, "DP_NCCL_ID_BYTES must match NCCL_UNIQUE_ID_BYTES");

/* One message a loopback dp_send delivered and no receive has consumed yet. */
typedef struct lb_msg {
    uint8_t hdr[DP_FRAME_HEADER_BYTES]; /* the header bytes as NCCL delivered them */
    uint8_t *stage;                     /* cudaMalloc'd: the payload at 0, the received header after */
    size_t len;                         /* payload bytes at stage */
} lb_msg;

typedef struct nccl_state {
    ncclComm_t comm;
    cudaStream_t stream;
    cudaEvent_t caller_work; /* recorded on the legacy default stream; the link's stream waits for it */
    uint8_t *dev_hdr;  /* DP_FRAME_HEADER_BYTES on the device */
    uint8_t *host_hdr; /* 2 * DP_FRAME_HEADER_BYTES pinned: the header sent, then the one received
                        * (apart, so a loopback send's two copies never share bytes) */
    int rank, nranks, peer, device;
    /* The loopback FIFO (nranks 1 only: such a link has nccl_loopback_ops), a ring of lb_count
     * messages from lb_head. lb_head_taken: the head's header was handed out and its payload is
     * the generic layer's pending payload. */
    lb_msg lb[DP_NCCL_LOOPBACK_QUEUE];
    unsigned lb_head, lb_count;
    int lb_head_taken;
} nccl_state;

static int cuda_fail(strata_error *err, cudaError_t e, const char *what, const char *ctx)
{
    return strata_fail(err, STRATA_EIO, "data plane (%s): %s failed: %s (%s)", ctx, what, cudaGetErrorString(e),
                       cudaGetErrorName(e));
}

static int nccl_fail(strata_error *err, ncclResult_t r, ncclComm_t comm, const char *what, const char *ctx)
{
    const char *last = ncclGetLastError(comm);
    int code = (r == ncclInvalidArgument || r == ncclInvalidUsage) ? STRATA_EINVAL : STRATA_EIO;
    return strata_fail(err, code, "data plane (%s): %s failed: %s%s%s%s", ctx, what, ncclGetErrorString(r),
                       last && *last ? " (" : "", last && *last ? last : "", last && *last ? ")" : "");
}

/* Waits for the link's stream until deadline (-1 none). Breaks the link on timeout or error. */
static int nccl_wait(dp_link *link, int64_t deadline, const char *what, strata_error *err)
{
    nccl_state *s = link->impl;
    unsigned spins = 0;
    for (;;) {
        cudaError_t e = cudaStreamQuery(s->stream);
        if (e == cudaSuccess)
            return STRATA_OK;
        if (e != cudaErrorNotReady) {
            cuda_fail(err, e, what, link->desc);
            return dp_link_break(link, err);
        }
        ncclResult_t async = ncclSuccess;
        ncclResult_t r = ncclCommGetAsyncError(s->comm, &async);
        if (r != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
            nccl_fail(err, r != ncclSuccess ? r : async, s->comm, what, link->desc);
            return dp_link_break(link, err);
        }
        if (deadline >= 0 && dp_now_ms() >= deadline) {
            strata_fail(err, STRATA_EIO, "data plane (%s): %s timed out (NCCL operation still in flight; "
                        "the link is closed)", link->desc, what);
            return dp_link_break(link, err);
        }
        /* Spin briefly (pipeline hand-offs are latency bound), then sleep 50 us per poll. */
        if (++spins < 2000) {
            sched_yield();
        } else {
            struct timespec ts = {0, 50000};
            while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
            }
        }
    }
}

static int check_device_ptr(const dp_link *link, const void *p, const char *what, strata_error *err)
{
    const nccl_state *s = link->impl;
    struct cudaPointerAttributes a;
    cudaError_t e = cudaPointerGetAttributes(&a, p);
    if (e != cudaSuccess) {
        (void)cudaGetLastError(); /* clear the (non-sticky) error this call recorded */
        return strata_fail(err, STRATA_EINVAL, "data plane (%s): %s %p is not a CUDA pointer: %s", link->desc, what,
                           p, cudaGetErrorString(e));
    }
    if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
        return strata_fail(err, STRATA_EINVAL,
                           "data plane (%s): %s %p is host memory; NCCL links take device pointers", link->desc,
                           what, p);
    if (a.type == cudaMemoryTypeDevice && a.device != s->device)
        return strata_fail(err, STRATA_EINVAL, "data plane (%s): %s %p is on cuda:%d, the link on cuda:%d",
                           link->desc, what, p, a.device, s->device);
    return STRATA_OK;
}

static int set_device(dp_link *link, strata_error *err)
{
    nccl_state *s = link->impl;
    cudaError_t e = cudaSetDevice(s->device);
    return e == cudaSuccess ? STRATA_OK : cuda_fail(err, e, "cudaSetDevice", link->desc);
}

/* The link's stream is non-blocking, so it does not wait for the caller's work on the legacy
 * default stream by itself: a payload a kernel or copy there is still writing would be sent
 * early, and a buffer it still reads could be overwritten by a receive. Every transfer of a
 * caller's buffer is queued behind the work queued there so far. Nothing is enqueued on the
 * link's stream when this fails. */
static int after_caller_work(dp_link *link, strata_error *err)
{
    nccl_state *s = link->impl;
    cudaError_t e = cudaEventRecord(s->caller_work, 0);
    if (e == cudaSuccess)
        e = cudaStreamWaitEvent(s->stream, s->caller_work, 0);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return cuda_fail(err, e, "ordering after the caller's device work", link->desc);
    }
    return STRATA_OK;
}

/* What both kinds of send do before enqueueing anything: the link's device, a device payload, the
 * frame header in the pinned host buffer, the link's stream behind the payload's writers. A
 * failure here leaves the link in sync. */
static int prepare_send(dp_link *link, const dp_msg_header *h, const void *payload, size_t len, strata_error *err)
{
    nccl_state *s = link->impl;
    int rc = set_device(link, err);
    if (rc == STRATA_OK && len > 0)
        rc = check_device_ptr(link, payload, "payload", err);
    if (rc == STRATA_OK)
        rc = dp_frame_encode(h, len, 0, 0, s->host_hdr, err);
    if (rc == STRATA_OK && len > 0)
        rc = after_caller_work(link, err);
    return rc;
}

static int nccl_send(dp_link *link, const dp_msg_header *h, const void *payload, size_t len, strata_error *err)
{
    nccl_state *s = link->impl;
    int rc = prepare_send(link, h, payload, len, err);
    if (rc != STRATA_OK)
        return rc; /* nothing enqueued: the link is still in sync */
    cudaError_t e = cudaMemcpyAsync(s->dev_hdr, s->host_hdr, DP_FRAME_HEADER_BYTES, cudaMemcpyHostToDevice,
                                    s->stream);
    if (e != cudaSuccess) {
        cuda_fail(err, e, "cudaMemcpyAsync of the header", link->desc);
        return dp_link_break(link, err);
    }
    ncclResult_t r = ncclSend(s->dev_hdr, DP_FRAME_HEADER_BYTES, ncclUint8, s->peer, s->comm, s->stream);
    if (r == ncclSuccess && len > 0)
        r = ncclSend(payload, len, ncclUint8, s->peer, s->comm, s->stream);
    if (r != ncclSuccess) {
        nccl_fail(err, r, s->comm, "ncclSend", link->desc);
        return dp_link_break(link, err);
    }
    return nccl_wait(link, dp_deadline(link->io_timeout_ms), "sending a message", err);
}

static int nccl_recv_header(dp_link *link, uint8_t hdr[DP_FRAME_HEADER_BYTES], int timeout_ms, strata_error *err)
{
    nccl_state *s = link->impl;
    int rc = set_device(link, err);
    if (rc != STRATA_OK)
        return rc;
    ncclResult_t r = ncclRecv(s->dev_hdr, DP_FRAME_HEADER_BYTES, ncclUint8, s->peer, s->comm, s->stream);
    if (r != ncclSuccess) {
        nccl_fail(err, r, s->comm, "ncclRecv of a header", link->desc);
        return dp_link_break(link, err);
    }
    cudaError_t e = cudaMemcpyAsync(s->host_hdr, s->dev_hdr, DP_FRAME_HEADER_BYTES, cudaMemcpyDeviceToHost,
                                    s->stream);
    if (e != cudaSuccess) {
        cuda_fail(err, e, "cudaMemcpyAsync of the header", link->desc);
        return dp_link_break(link, err);
    }
    rc = nccl_wait(link, dp_deadline(timeout_ms), "waiting for a message", err);
    if (rc != STRATA_OK)
        return rc;
    memcpy(hdr, s->host_hdr, DP_FRAME_HEADER_BYTES);
    return STRATA_OK;
}

static int nccl_recv_payload(dp_link *link, void *buf, strata_error *err)
{
    nccl_state *s = link->impl;
    size_t n = (size_t)link->pending_h.payload_len;
    int rc = set_device(link, err);
    if (rc == STRATA_OK && buf)
        rc = check_device_ptr(link, buf, "payload buffer", err);
    if (rc == STRATA_OK && buf)
        rc = after_caller_work(link, err);
    if (rc != STRATA_OK)
        return rc; /* still pending, nothing enqueued */
    void *dst = buf, *scratch = NULL;
    if (!dst) {
        cudaError_t e = cudaMalloc(&scratch, n);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            return strata_fail(err, STRATA_ENOMEM, "data plane (%s): no device memory to discard a %zu-byte payload: %s",
                               link->desc, n, cudaGetErrorString(e));
        }
        dst = scratch;
    }
    ncclResult_t r = ncclRecv(dst, n, ncclUint8, s->peer, s->comm, s->stream);
    if (r != ncclSuccess) {
        nccl_fail(err, r, s->comm, "ncclRecv of a payload", link->desc);
        rc = dp_link_break(link, err);
    } else {
        rc = nccl_wait(link, dp_deadline(link->io_timeout_ms), "receiving a payload", err);
    }
    if (scratch && rc == STRATA_OK)
        cudaFree(scratch); /* a broken link may still write into it: leak rather than race */
    return rc;
}

/* ---- loopback (nranks 1): see the top of this file ---- */

/* Where a staged message's received header lies: after the payload, rounded up to 256 bytes (the
 * alignment cudaMalloc gives the payload) so that both NCCL buffers start aligned. */
static size_t lb_hdr_offset(size_t len) { return (len + 255) & ~(size_t)255; }

/* Posts a send of n bytes from src to this same rank and the matching receive into dst. On one
 * rank a send only completes once its receive is posted, and a group is how NCCL lets a single
 * caller post both. One group per pair rather than one for the whole message, so that matching
 * never depends on how NCCL orders several transfers to the same peer within a group. Once
 * ncclGroupStart succeeded something may be enqueued, so every failure breaks the link. */
static int lb_sendrecv(dp_link *link, const void *src, void *dst, size_t n, const char *what, strata_error *err)
{
    nccl_state *s = link->impl;
    const char *call = "ncclGroupStart";
    ncclResult_t r = ncclGroupStart();
    if (r == ncclSuccess) {
        call = "ncclSend";
        r = ncclSend(src, n, ncclUint8, s->rank, s->comm, s->stream);
        if (r == ncclSuccess) {
            call = "ncclRecv";
            r = ncclRecv(dst, n, ncclUint8, s->rank, s->comm, s->stream);
        }
        /* Close the group even after a failure: a group left open would swallow every later NCCL
         * call of this thread, on every communicator. */
        ncclResult_t end = ncclGroupEnd();
        if (r == ncclSuccess) {
            call = "ncclGroupEnd";
            r = end;
        }
    }
    if (r != ncclSuccess) {
        char ctx[96];
        snprintf(ctx, sizeof ctx, "%s of %s to self", call, what);
        nccl_fail(err, r, s->comm, ctx, link->desc);
        return dp_link_break(link, err);
    }
    return STRATA_OK;
}

/* Drops the head of the loopback queue and frees its staging buffer. */
static int lb_pop(dp_link *link, strata_error *err)
{
    nccl_state *s = link->impl;
    lb_msg *m = &s->lb[s->lb_head];
    uint8_t *stage = m->stage;
    *m = (lb_msg){.stage = NULL};
    s->lb_head = (s->lb_head + 1) % DP_NCCL_LOOPBACK_QUEUE;
    s->lb_count--;
    s->lb_head_taken = 0;
    cudaError_t e = stage ? cudaFree(stage) : cudaSuccess;
    if (e != cudaSuccess) {
        /* The message itself was delivered, but a failing cudaFree means the device context is
         * in trouble: nothing later on this link can be trusted. */
        cuda_fail(err, e, "cudaFree of a loopback staging buffer", link->desc);
        return dp_link_break(link, err);
    }
    return STRATA_OK;
}

static int lb_send(dp_link *link, const dp_msg_header *h, const void *payload, size_t len, strata_error *err)
{
    nccl_state *s = link->impl;
    if (len > SIZE_MAX - 256 - DP_FRAME_HEADER_BYTES)
        return strata_fail(err, STRATA_EINVAL, "data plane (%s): a %zu-byte payload is too large to stage",
                           link->desc, len);
    int rc = prepare_send(link, h, payload, len, err);
    if (rc != STRATA_OK)
        return rc; /* nothing enqueued: the link is still in sync */
    /* Bounded so that a sender that never receives fails loudly instead of filling the device
     * (each queued message holds up to max_payload bytes of staging). */
    if (s->lb_count == DP_NCCL_LOOPBACK_QUEUE)
        return strata_fail(err, STRATA_EFULL,
                           "data plane (%s): loopback queue full: %d messages sent and not yet received "
                           "(receive one first)",
                           link->desc, DP_NCCL_LOOPBACK_QUEUE);
    size_t off = lb_hdr_offset(len);
    uint8_t *stage = NULL;
    cudaError_t e = cudaMalloc((void **)&stage, off + DP_FRAME_HEADER_BYTES);
    if (e != cudaSuccess) {
        (void)cudaGetLastError(); /* out of memory is not sticky: clear it, the link stays usable */
        return strata_fail(err, STRATA_ENOMEM,
                           "data plane (%s): no device memory to stage a %zu-byte loopback message: %s",
                           link->desc, len, cudaGetErrorString(e));
    }
    e = cudaMemcpyAsync(s->dev_hdr, s->host_hdr, DP_FRAME_HEADER_BYTES, cudaMemcpyHostToDevice, s->stream);
    if (e != cudaSuccess) {
        cuda_fail(err, e, "cudaMemcpyAsync of the header", link->desc);
        (void)cudaFree(stage); /* nothing enqueued uses it; the copy's error is the one to report */
        return dp_link_break(link, err);
    }
    rc = lb_sendrecv(link, s->dev_hdr, stage + off, DP_FRAME_HEADER_BYTES, "the header", err);
    if (rc == STRATA_OK && len > 0)
        rc = lb_sendrecv(link, payload, stage, len, "the payload", err);
    if (rc == STRATA_OK) {
        e = cudaMemcpyAsync(s->host_hdr + DP_FRAME_HEADER_BYTES, stage + off, DP_FRAME_HEADER_BYTES,
                            cudaMemcpyDeviceToHost, s->stream);
        if (e != cudaSuccess) {
            cuda_fail(err, e, "cudaMemcpyAsync of the received header", link->desc);
            rc = dp_link_break(link, err);
        }
    }
    if (rc == STRATA_OK)
        rc = nccl_wait(link, dp_deadline(link->io_timeout_ms), "sending a loopback message", err);
    if (rc != STRATA_OK)
        return rc; /* broken, and NCCL may still write into stage: leak it rather than race */
    lb_msg *m = &s->lb[(s->lb_head + s->lb_count) % DP_NCCL_LOOPBACK_QUEUE];
    memcpy(m->hdr, s->host_hdr + DP_FRAME_HEADER_BYTES, DP_FRAME_HEADER_BYTES);
    m->stage = stage;
    m->len = len;
    s->lb_count++;
    return STRATA_OK;
}

static int lb_recv_header(dp_link *link, uint8_t hdr[DP_FRAME_HEADER_BYTES], int timeout_ms, strata_error *err)
{
    nccl_state *s = link->impl;
    /* Only this link's own dp_send fills the queue, and a loopback link is used from one thread,
     * so waiting could never help (and timeout_ms < 0 would hang): an empty queue times out at
     * once, whatever timeout_ms. Nothing was enqueued, so unlike a two-rank timeout the link
     * stays usable. */
    (void)timeout_ms;
    if (s->lb_count == 0)
        return strata_fail(err, STRATA_EIO,
                           "data plane (%s): timed out waiting for a message: none is queued (a loopback "
                           "link receives only what its own dp_send queued, so it does not wait)",
                           link->desc);
    lb_msg *m = &s->lb[s->lb_head];
    memcpy(hdr, m->hdr, DP_FRAME_HEADER_BYTES);
    if (m->len > 0) {
        s->lb_head_taken = 1; /* the payload stays staged until recv_payload */
        return STRATA_OK;
    }
    int rc = set_device(link, err);
    return rc == STRATA_OK ? lb_pop(link, err) : rc;
}

static int lb_recv_payload(dp_link *link, void *buf, strata_error *err)
{
    nccl_state *s = link->impl;
    size_t n = (size_t)link->pending_h.payload_len;
    lb_msg *m = &s->lb[s->lb_head];
    /* The header passed its CRC, so this only guards against a bug in the queue bookkeeping. */
    if (!s->lb_head_taken || s->lb_count == 0 || m->len != n) {
        strata_fail(err, STRATA_EFORMAT,
                    "data plane (%s): the pending header announces %zu payload bytes, the loopback queue "
                    "holds %zu",
                    link->desc, n, s->lb_head_taken && s->lb_count ? m->len : (size_t)0);
        return dp_link_break(link, err);
    }
    int rc = set_device(link, err);
    if (rc == STRATA_OK && buf)
        rc = check_device_ptr(link, buf, "payload buffer", err);
    if (rc == STRATA_OK && buf)
        rc = after_caller_work(link, err);
    if (rc != STRATA_OK)
        return rc; /* still pending, nothing enqueued */
    if (buf) {
        /* cudaMemcpyDefault rather than DeviceToDevice: buf may be managed memory, and with unified
         * addressing the runtime infers the direction from the pointers. */
        cudaError_t e = cudaMemcpyAsync(buf, m->stage, n, cudaMemcpyDefault, s->stream);
        if (e != cudaSuccess) {
            cuda_fail(err, e, "cudaMemcpyAsync of a loopback payload", link->desc);
            rc = dp_link_break(link, err);
        } else {
            rc = nccl_wait(link, dp_deadline(link->io_timeout_ms), "receiving a payload", err);
        }
        if (rc != STRATA_OK) {
            m->stage = NULL; /* the copy may still read it on a broken link: leak rather than race */
            return rc;
        }
    }
    return lb_pop(link, err); /* discarding (buf NULL) only frees the staging */
}

static void nccl_close(dp_link *link)
{
    nccl_state *s = link->impl;
    if (!s)
        return;
    (void)cudaSetDevice(s->device);
    if (s->comm) {
        if (link->broken[0])
            (void)ncclCommAbort(s->comm);
        else
            (void)ncclCommDestroy(s->comm);
    }
    if (s->caller_work)
        (void)cudaEventDestroy(s->caller_work);
    if (s->stream)
        (void)cudaStreamDestroy(s->stream);
    if (s->dev_hdr)
        (void)cudaFree(s->dev_hdr);
    if (s->host_hdr)
        (void)cudaFreeHost(s->host_hdr);
    /* Queued loopback messages are complete transfers (a failed one was never queued). */
    for (unsigned i = 0; i < s->lb_count; i++) {
        lb_msg *m = &s->lb[(s->lb_head + i) % DP_NCCL_LOOPBACK_QUEUE];
        if (m->stage)
            (void)cudaFree(m->stage);
    }
    free(s);
    link->impl = NULL;
}

static const dp_ops nccl_ops = {
    .send = nccl_send,
    .recv_header = nccl_recv_header,
    .recv_payload = nccl_recv_payload,
    .close = nccl_close,
};

static const dp_ops nccl_loopback_ops = {
    .send = lb_send,
    .recv_header = lb_recv_header,
    .recv_payload = lb_recv_payload,
    .close = nccl_close,
};

int dp_nccl_unique_id(void *out, size_t *len, strata_error *err)
{
    if (!out || !len)
        return strata_fail(err, STRATA_EINVAL, "data plane: NULL unique id output");
    if (*len < sizeof(ncclUniqueId))
        return strata_fail(err, STRATA_EINVAL, "data plane: NCCL unique id needs %zu bytes, buffer has %zu",
                           sizeof(ncclUniqueId), *len);
    ncclUniqueId id;
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess)
        return nccl_fail(err, r, NULL, "ncclGetUniqueId", "nccl");
    memcpy(out, &id, sizeof id);
    *len = sizeof id;
    return STRATA_OK;
}

int dp_nccl_create(const void *unique_id, size_t id_len, int rank, int nranks, int peer, int cuda_device,
                   const dp_options *opts, dp_link **out, strata_error *err)
{
    if (!out)
        return strata_fail(err, STRATA_EINVAL, "data plane: NULL link output");
    *out = NULL;
    if (!unique_id || id_len != sizeof(ncclUniqueId))
        return strata_fail(err, STRATA_EINVAL, "data plane: NCCL unique id of %zu bytes (expected %zu)", id_len,
                           sizeof(ncclUniqueId));
    /* Checked before looking for a device, so that bad arguments are reported the same everywhere. */
    int loopback = nranks == 1;
    int ranks_ok = loopback ? rank == 0 && peer == 0
                            : nranks >= 2 && rank >= 0 && rank < nranks && peer >= 0 && peer < nranks && peer != rank;
    if (!ranks_ok || cuda_device < 0)
        return strata_fail(err, STRATA_EINVAL,
                           "data plane: bad NCCL link rank %d -> peer %d of %d ranks on cuda:%d (a link joins "
                           "two distinct ranks of 2 or more, or is the loopback rank 0 -> 0 of 1)",
                           rank, peer, nranks, cuda_device);
    char ctx[64];
    if (loopback)
        snprintf(ctx, sizeof ctx, "nccl loopback rank 0 on cuda:%d", cuda_device);
    else
        snprintf(ctx, sizeof ctx, "nccl rank %d -> %d on cuda:%d", rank, peer, cuda_device);
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
        (void)cudaGetLastError();
        return strata_fail(err, STRATA_EIO, "data plane (%s): no CUDA device (cudaGetDeviceCount: %s)", ctx,
                           e == cudaSuccess ? "0 devices" : cudaGetErrorString(e));
    }
    if (cuda_device >= count)
        return strata_fail(err, STRATA_EINVAL, "data plane (%s): this host has %d CUDA device(s)", ctx, count);

    dp_link *link = malloc(sizeof *link);
    nccl_state *s = calloc(1, sizeof *s);
    if (!link || !s) {
        free(link);
        free(s);
        return strata_fail(err, STRATA_ENOMEM, "data plane: out of memory for a link");
    }
    dp_link_init_common(link, DP_BACKEND_NCCL, loopback ? &nccl_loopback_ops : &nccl_ops, opts);
    snprintf(link->desc, sizeof link->desc, "%s", ctx);
    link->impl = s;
    s->rank = rank;
    s->nranks = nranks;
    s->peer = peer;
    s->device = cuda_device;

    int rc = STRATA_OK;
    if ((e = cudaSetDevice(cuda_device)) != cudaSuccess)
        rc = cuda_fail(err, e, "cudaSetDevice", ctx);
    else if ((e = cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking)) != cudaSuccess)
        rc = cuda_fail(err, e, "cudaStreamCreateWithFlags", ctx);
    else if ((e = cudaEventCreateWithFlags(&s->caller_work, cudaEventDisableTiming)) != cudaSuccess)
        rc = cuda_fail(err, e, "cudaEventCreateWithFlags", ctx);
    else if ((e = cudaMalloc((void **)&s->dev_hdr, DP_FRAME_HEADER_BYTES)) != cudaSuccess)
        rc = cuda_fail(err, e, "cudaMalloc of the header buffer", ctx);
    else if ((e = cudaMallocHost((void **)&s->host_hdr, 2 * DP_FRAME_HEADER_BYTES)) != cudaSuccess)
        rc = cuda_fail(err, e, "cudaMallocHost of the header buffer", ctx);
    if (rc == STRATA_OK) {
        ncclUniqueId id;
        memcpy(&id, unique_id, sizeof id);
        ncclResult_t r = ncclCommInitRank(&s->comm, nranks, id, rank);
        if (r != ncclSuccess) {
            s->comm = NULL;
            rc = nccl_fail(err, r, NULL, "ncclCommInitRank", ctx);
        }
    }
    if (rc != STRATA_OK) {
        (void)cudaGetLastError();
        dp_link_close(link);
        return rc;
    }
    *out = link;
    return STRATA_OK;
}
