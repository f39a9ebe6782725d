/* Private to worker/transport: the link object shared by the backend-independent layer
 * (transport.c: validation, framing, pending-payload state, broken links) and the backends
 * (transport_tcp.c, transport_nccl.c), which only move bytes. */
#ifndef STRATA_WORKER_TRANSPORT_IMPL_H
#define STRATA_WORKER_TRANSPORT_IMPL_H

#include <pthread.h>
#include <stdint.h>

#include "worker/transport/transport.h"

/* Backend operations. Every err is non-NULL (the generic layer passes a local one). A backend
 * that leaves the byte stream in an unknown state calls dp_link_break(link, err) before
 * returning; one that returns an error without breaking promises the link is still in sync. */
typedef struct dp_ops {
    /* Sends the encoded header (the backend fills the payload CRC first, if it uses one) and
     * len payload bytes. */
    int (*send)(dp_link *link, const dp_msg_header *h, const void *payload, size_t len,
                strata_error *err);
    /* Receives the 64 header bytes of the next message; timeout_ms bounds the wait for its
     * first byte. */
    int (*recv_header)(dp_link *link, uint8_t hdr[DP_FRAME_HEADER_BYTES], int timeout_ms,
                       strata_error *err);
    /* Receives the pending payload (link->pending_h.payload_len bytes) into buf, or discards it
     * when buf is NULL; verifies it against link->pending_h where the backend has a CRC. */
    int (*recv_payload)(dp_link *link, void *buf, strata_error *err);
    /* Releases the backend state and closes the channel (not the dp_link itself). */
    void (*close)(dp_link *link);
} dp_ops;

struct dp_link {
    int backend;                /* DP_BACKEND_* */
    const dp_ops *ops;
    char desc[256];             /* dp_link_describe */
    pthread_mutex_t broken_lock; /* a sender and a receiver thread may both break the link */
    char broken[600];           /* "" while usable; written once, under broken_lock */
    uint64_t max_payload;       /* largest payload this side accepts */
    uint64_t peer_max_payload;  /* largest payload the peer accepts */
    int io_timeout_ms;          /* stall limit, < 0 none */
    int pending;                /* a header was received, its payload not yet */
    dp_msg_header pending_h;
    int fd;                     /* TCP socket, -1 otherwise */
    void *impl;                 /* backend state (TCP: keys and record buffers; NCCL) */
};

/* Fills a link's common fields from opts (NULL = defaults). */
void dp_link_init_common(dp_link *link, int backend, const dp_ops *ops, const dp_options *opts);

/* Marks the link broken with err's message (keeps the first reason). Returns err->code. */
int dp_link_break(dp_link *link, strata_error *err);

/* Monotonic milliseconds; deadline helpers (-1 = none). */
int64_t dp_now_ms(void);
int64_t dp_deadline(int timeout_ms);

/* Tests only, TCP links: writes bytes into the link's sealed stream as they are (no framing),
 * in records as dp_send would, so a test can forge frames that decrypt; and the keys of the
 * link's two directions (32 bytes each), so a test can decrypt what it recorded on the wire. */
int dp_tcp_write_sealed(dp_link *link, const void *bytes, size_t n, strata_error *err);
int dp_tcp_link_keys(const dp_link *link, uint8_t send_key[32], uint8_t recv_key[32]);

#endif
