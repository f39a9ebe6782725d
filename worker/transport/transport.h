/* The worker data plane: one point-to-point interface over two backends.
 *
 * A dp_link is a connected, bidirectional channel between two pipeline stages (stage s sends the
 * hidden states of a step to stage s+1) or between two workers (compressed KV blocks move for
 * migration). The same calls (dp_send, dp_recv, ...) work on both backends:
 *
 *   TCP  (CPU-only hosts, or any host without NCCL): a stream socket with fixed 64-byte
 *        little-endian frame headers (format below and in worker/transport/README.md), a CRC32C
 *        of every header and payload, a mutual HMAC-SHA256 challenge-response on the cluster
 *        secret before any frame is accepted, and every byte after it encrypted and
 *        authenticated (AES-256-GCM records, keys from an X25519 agreement made for the link:
 *        a record altered in transit is STRATA_ECRC). Payload pointers are host memory.
 *   NCCL (GPUs): ncclSend/ncclRecv on a dedicated CUDA stream of the link; the same 64-byte
 *        header travels as its own NCCL message before the payload. Payload pointers are DEVICE
 *        memory (cudaMalloc'd on the link's device, or managed memory); host pointers are
 *        refused with STRATA_EINVAL. A transfer is queued behind the caller's work on the legacy
 *        default stream (a payload still being written there is sent once written; a buffer
 *        still read there is received into afterwards), and every call synchronises its stream
 *        before returning.
 *        A one-rank "loopback" NCCL link (dp_nccl_create with nranks 1) sends to itself; it
 *        exists only to test the NCCL path on a machine with one GPU (see dp_nccl_create).
 *
 * Messages: a header (dp_msg_header) and a payload of 0..max_payload bytes. Kinds: HIDDEN (the
 * activation rows of one pipeline step: n_rows rows of row_bytes bytes, dtype f32/f16/bf16),
 * KV_BLOCK (one compressed KV block, docs/format.md bytes, for migration), KV_TAIL (a sequence's
 * fp16 tail, also as a block), CONTROL (small opaque control payloads between peers) and END (the
 * sender will send nothing more on this link).
 *
 * Errors (kvstore/error.h): STRATA_EIO for socket/CUDA/NCCL failures, timeouts and a peer that
 * closed; STRATA_EFORMAT for a malformed frame (bad magic, version, kind, reserved bits, length
 * over the link's maximum); STRATA_ECRC for a header or payload checksum mismatch; STRATA_EINVAL
 * for bad arguments and failed authentication; STRATA_EFULL when a message does not fit the
 * caller's buffer; STRATA_EUNSUPPORTED for the NCCL backend in a build without NCCL.
 *
 * Broken links: after any framing, checksum or I/O error (and after a timeout in the middle of a
 * frame) the link's byte stream position is unknown, so the link is marked broken: every later
 * call fails with STRATA_EIO naming the original error, and the only thing left to do is
 * dp_link_close. A recv that times out before the first byte of a message arrived is NOT an
 * error of the link (TCP): it returns STRATA_EIO with "timed out" in the message,
 * dp_link_broken() stays NULL, and the next recv picks up the next message normally. On NCCL an
 * enqueued ncclRecv cannot be cancelled, so every timeout breaks an NCCL link (except a receive
 * on an NCCL loopback link with nothing queued, which enqueues nothing: see dp_nccl_create).
 *
 * Timeouts: timeout_ms < 0 waits forever, 0 polls once, > 0 is a bound in milliseconds.
 * dp_recv's timeout bounds the wait for a message to BEGIN; once its first byte arrived the rest
 * must keep flowing: a stall of io_timeout_ms (dp_options, default 30 s) with no progress, while
 * sending or in the middle of receiving a frame, breaks the link.
 *
 * Thread-safety: a link may be used by two threads at once only as one sender and one receiver
 * (TCP). NCCL operations of a link are serialised by NCCL itself; use an NCCL link in one
 * direction at a time, and an NCCL loopback link from one thread. Listeners and links hold no
 * global state. */
#ifndef STRATA_WORKER_TRANSPORT_H
#define STRATA_WORKER_TRANSPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvstore/error.h"

typedef struct dp_link dp_link;
typedef struct dp_listener dp_listener;

enum dp_backend { DP_BACKEND_TCP = 1, DP_BACKEND_NCCL = 2 };

enum dp_kind {
    DP_MSG_HIDDEN = 1,   /* activation rows of one step (pipeline stage s -> s+1) */
    DP_MSG_KV_BLOCK = 2, /* one compressed KV block (migration) */
    DP_MSG_KV_TAIL = 3,  /* a sequence's fp16 tail as a block (migration) */
    DP_MSG_CONTROL = 4,  /* opaque control bytes between the two peers */
    DP_MSG_END = 5,      /* the sender is done with this link */
};
#define DP_MSG_KIND_MAX 5

enum dp_dtype {
    DP_DTYPE_BYTES = 0, /* opaque bytes (blocks, control) */
    DP_DTYPE_F32 = 1,
    DP_DTYPE_F16 = 2,
    DP_DTYPE_BF16 = 3,
};
#define DP_DTYPE_MAX 3

/* One message's header. On send: the caller fills kind, dtype, layer, step, seq, n_rows and
 * row_bytes; payload_len, payload_crc and flags are ignored (computed from the payload). On recv
 * all fields are filled; payload_crc is the CRC32C the sender computed (TCP, verified before
 * dp_recv returns the payload) or 0 (NCCL).
 * Rules (checked on send, STRATA_EINVAL; and on receive, STRATA_EFORMAT): kind is a dp_kind,
 * dtype a dp_dtype; when row_bytes != 0, n_rows * row_bytes == payload length; HIDDEN needs a
 * float dtype and row_bytes a nonzero multiple of its element size. */
typedef struct dp_msg_header {
    uint16_t kind;
    uint16_t dtype;
    uint32_t layer;
    uint64_t step;
    uint64_t seq;
    uint32_t n_rows;
    uint32_t row_bytes;
    uint64_t payload_len;
    uint32_t payload_crc;
    uint16_t flags; /* DP_FLAG_* */
} dp_msg_header;

#define DP_FLAG_PAYLOAD_CRC 0x0001u /* payload_crc is the CRC32C of the payload (always on TCP) */

/* The cluster secret shared by every worker of a deployment (required for TCP). It is never sent:
 * each side proves knowledge with HMAC-SHA256 over both sides' random nonces, and it salts the
 * derivation of the link's keys. At least
 * DP_AUTH_MIN_SECRET bytes; use 32 random bytes. */
typedef struct dp_auth {
    const uint8_t *secret;
    size_t len;
} dp_auth;
#define DP_AUTH_MIN_SECRET 16

/* What a TCP link is for, sent in the hello (which the proofs cover). Two sides that both name
 * one and name different ones fail the handshake with STRATA_EINVAL (dp_tcp_accept drops that
 * connection and stays usable): a worker waiting for its pipeline neighbour does not take a
 * migration's sender for it, nor the other way round. */
enum { DP_PURPOSE_ANY = 0, DP_PURPOSE_ROWS = 1, DP_PURPOSE_MIGRATION = 2 };

/* Per-link limits. A zeroed struct (or NULL) means the defaults. */
typedef struct dp_options {
    uint64_t max_payload; /* largest payload this side accepts; 0 = DP_DEFAULT_MAX_PAYLOAD */
    int io_timeout_ms;    /* stall limit while sending or mid-frame; 0 = default, < 0 = none */
    uint8_t purpose;      /* DP_PURPOSE_*; 0: any (TCP only) */
} dp_options;
#define DP_DEFAULT_MAX_PAYLOAD (256ull << 20)
#define DP_DEFAULT_IO_TIMEOUT_MS 30000
#define DP_HANDSHAKE_TIMEOUT_MS 3000
#define DP_ACCEPT_HANDSHAKES 16   /* handshakes one dp_tcp_accept runs at once */

/* ---- TCP ---- */

/* Listens on "host:port" (IPv4 "127.0.0.1:4000", IPv6 "[::1]:4000", or a name). Port 0 picks an
 * ephemeral port (dp_listener_port tells which). Binds only where asked: give 127.0.0.1 for a
 * single node. */
int dp_tcp_listen(const char *host_port, dp_listener **out, strata_error *err);
uint16_t dp_listener_port(const dp_listener *l);
/* The listening socket, for an event loop to poll for readability (a pending connection). */
int dp_listener_fd(const dp_listener *l);
void dp_listener_close(dp_listener *l);

/* Accepts connections arriving within timeout_ms (< 0: no limit; 0: those already pending) and
 * runs their handshakes (hello, then mutual HMAC proof) concurrently, up to
 * DP_ACCEPT_HANDSHAKES at a time, each within DP_HANDSHAKE_TIMEOUT_MS of its accept (also past
 * timeout_ms): silent or slow strangers cannot keep the real peer waiting behind them. Returns
 * the first connection that authenticates (the others are dropped). When the handshakes under
 * way have all failed and none succeeded, the last failure: a peer with the wrong secret is
 * STRATA_EINVAL "data plane: peer ... failed authentication"; the listener stays usable (call
 * again). No connection within the timeout: STRATA_EIO "... timed out". */
int dp_tcp_accept(dp_listener *l, const dp_auth *auth, const dp_options *opts, int timeout_ms,
                  dp_link **out, strata_error *err);

/* Connects to "host:port" (every address the name resolves to, in order) and runs the
 * handshake, all within timeout_ms. Refused/unreachable: STRATA_EIO naming the address. */
int dp_tcp_connect(const char *host_port, const dp_auth *auth, const dp_options *opts,
                   int timeout_ms, dp_link **out, strata_error *err);

/* ---- NCCL ---- */

#define DP_NCCL_ID_BYTES 128 /* NCCL_UNIQUE_ID_BYTES */

/* Creates an NCCL unique id (on the coordinator, or on rank 0) to hand to every rank of one
 * link's communicator. *len: in, the capacity of out; out, DP_NCCL_ID_BYTES. */
int dp_nccl_unique_id(void *out, size_t *len, strata_error *err);

/* Joins the NCCL communicator named by unique_id as rank of nranks, on CUDA device cuda_device,
 * and returns a link to rank peer of that communicator. Each link owns its communicator: for a
 * pipeline, one per adjacent pair of stages (nranks 2), its id made by the upstream stage and
 * handed over their TCP link (dp_nccl_upgrade). Blocks
 * until every rank joined (ncclCommInitRank has no timeout). rank and peer must be distinct ranks
 * of nranks >= 2, or rank 0, peer 0 of nranks 1 (below); anything else is STRATA_EINVAL, checked
 * before looking for a device. In a build without NCCL: STRATA_EUNSUPPORTED.
 *
 * Loopback (nranks 1, rank 0, peer 0; "nccl loopback rank 0 on cuda:N"): a link to itself, so
 * that the whole NCCL path runs on a machine with ONE GPU, where NCCL refuses the two ranks of a
 * two-rank link. It is a test vehicle only: a real pipeline needs >= 2 GPUs, and serving never
 * creates one. dp_send sends the header and payload to this same rank, posting each send with its
 * receive (the pair in one NCCL group) into a device staging buffer owned by the link, waits as
 * usual, and queues the message; the receive calls take the oldest queued message (payload copied
 * device-to-device into the caller's buffer on the link's stream), with every usual rule
 * (EFULL keeping the payload pending, dp_recv_skip, device pointers only). At most
 * DP_NCCL_LOOPBACK_QUEUE messages wait in the queue: one more send fails with STRATA_EFULL and
 * the link stays usable. A receive with nothing queued returns STRATA_EIO "timed out" AT ONCE,
 * whatever timeout_ms (nothing else can fill the queue), and the link stays usable. Use a loopback
 * link from one thread. */
int dp_nccl_create(const void *unique_id, size_t id_len, int rank, int nranks, int peer,
                   int cuda_device, const dp_options *opts, dp_link **out, strata_error *err);

/* Messages an NCCL loopback link holds between dp_send and their receive. */
#define DP_NCCL_LOOPBACK_QUEUE 8

/* Over an established TCP link between two pipeline neighbours, agrees on an NCCL link beside it
 * for the payloads that live on the GPUs (activation rows), while the TCP link keeps carrying the
 * rest. The upstream side (the stage that sends rows on this link) offers, in one CONTROL
 * message, whether it can (cuda_device >= 0 and a build with NCCL) and then a fresh unique id;
 * the downstream side answers whether it takes it (it can too). When both can, each joins the
 * two-rank communicator (upstream rank 0, downstream rank 1) on its device and *nccl is the new
 * link; otherwise *nccl is NULL and STRATA_OK (the rows go over TCP). Both sides must call it,
 * before any other message on the link: a worker calls it for its link from the previous stage
 * first, then for its link to the next, so a chain of stages settles from the first stage on.
 * Errors: the TCP link's, STRATA_EFORMAT for a malformed offer or answer, and dp_nccl_create's
 * (the link is then unusable: the workers give up the assignment). */
int dp_nccl_upgrade(dp_link *tcp, bool upstream, int cuda_device, const dp_options *opts, dp_link **nccl,
                    strata_error *err);

/* ---- both backends ---- */

/* Sends one message: the header, then len payload bytes (host memory on TCP, device memory on
 * NCCL; NULL allowed when len is 0). Returns when the bytes are handed to the kernel (TCP) or the
 * NCCL send completed (loopback: received into the link's staging and queued). A payload over
 * the peer's max_payload (learnt in the handshake, TCP) is refused with STRATA_EINVAL and the
 * link stays usable. */
int dp_send(dp_link *link, const dp_msg_header *h, const void *payload, size_t len,
            strata_error *err);

/* Receives one message into buf (capacity cap). On success *h is the header and *len the
 * payload length. When the payload is larger than cap: STRATA_EFULL, *h and *len (the needed
 * size) are filled and the payload stays pending: receive it with dp_recv_payload (a larger
 * buffer) or drop it with dp_recv_skip before the next message. */
int dp_recv(dp_link *link, dp_msg_header *h, void *buf, size_t cap, size_t *len, int timeout_ms,
            strata_error *err);

/* Two-step receive: the header only (then the payload is pending when payload_len > 0)... */
int dp_recv_header(dp_link *link, dp_msg_header *h, int timeout_ms, strata_error *err);
/* ... and the pending payload into buf (cap >= payload_len, else STRATA_EFULL, still pending).
 * Verifies the payload CRC (TCP). Without a pending payload: STRATA_EINVAL. */
int dp_recv_payload(dp_link *link, void *buf, size_t cap, strata_error *err);
/* Reads and discards the pending payload (still verified); no-op without one. */
int dp_recv_skip(dp_link *link, strata_error *err);

/* Closes the link (and frees it); NULL is a no-op. A broken NCCL link aborts its communicator. */
void dp_link_close(dp_link *link);

/* "tcp 127.0.0.1:4000 <-> 127.0.0.1:53122", "nccl rank 0 -> 1 on cuda:0",
 * "nccl loopback rank 0 on cuda:0". */
const char *dp_link_describe(const dp_link *link);
int dp_link_backend(const dp_link *link);
/* NULL while the link is usable, else why it broke. */
const char *dp_link_broken(const dp_link *link);
/* The connected socket (TCP; -1 on NCCL), for an event loop to poll for readability (a strata
 * peer never puts two messages in one record: once a message was received whole, nothing of
 * the next waits decrypted while the socket is quiet). Reading or writing it directly breaks the link: its bytes are sealed records. */
int dp_link_fd(const dp_link *link);
/* The largest payload the peer accepts (TCP: from its hello; NCCL: this side's max). */
uint64_t dp_link_peer_max_payload(const dp_link *link);

/* ---- the frame header on the wire (exposed for tests and fuzzing) ---- */

#define DP_FRAME_HEADER_BYTES 64
#define DP_FRAME_VERSION 1

/* Writes the 64-byte header of a message with payload_len bytes whose CRC32C is payload_crc
 * (flags: DP_FLAG_*). Validates h as dp_send does (STRATA_EINVAL). */
int dp_frame_encode(const dp_msg_header *h, uint64_t payload_len, uint32_t payload_crc,
                    uint16_t flags, uint8_t out[DP_FRAME_HEADER_BYTES], strata_error *err);
/* Parses and checks a header: magic, version, header CRC (STRATA_ECRC), reserved bytes, kind,
 * dtype, row geometry, payload_len <= max_payload (STRATA_EFORMAT). Never trusts the bytes. */
int dp_frame_decode(const uint8_t in[DP_FRAME_HEADER_BYTES], uint64_t max_payload,
                    dp_msg_header *out, strata_error *err);

/* "HIDDEN", "KV_BLOCK", ... or "kind?" */
const char *dp_kind_name(unsigned kind);

#endif
