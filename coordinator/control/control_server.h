/* The coordinator's side of the control plane (design section 1): service
 * strata.internal.v1.WorkerControl from proto/strata_internal.proto, one bidirectional Attach
 * stream per worker, on the gRPC C core. coordinator/control/README.md has the protocol, the
 * timings and the status table; this header is the contract.
 *
 * The server owns the network side: listening, keepalive (a hung or vanished worker is noticed
 * within keepalive_time_ms + keepalive_timeout_ms), the Join checks (first message is a Join,
 * cluster secret in constant time, protocol version, worker name), decoding, per-peer send
 * queues, and shutdown. The coordinator (the "handler") owns everything else: which workers it
 * accepts, what it sends them, what their messages mean.
 *
 * Callbacks. on_join, on_message and on_gone run on the server's completion-queue threads (and
 * on_gone also on the thread calling ctl_server_shutdown), never with a server lock held and
 * never inside a ctl_peer_* call. So the handler may hold its own locks while calling ctl_peer_*
 * functions, and may call them (ctl_peer_send, ctl_peer_close, ...) from inside a callback. The
 * handler must not hold, while calling ctl_server_shutdown, a lock that its on_gone takes.
 * Callbacks of one peer never overlap and come in order: on_join, then on_message for every
 * later message in the order the worker sent them, then on_gone. Callbacks of different peers
 * run concurrently on different threads. Callbacks should be quick: the next message of that
 * peer is not read until on_message returns (which is also how per-peer order is kept).
 *
 * Life of a peer (one Attach call):
 *   1. The server opens the stream with a Challenge (a fresh 32-byte nonce). The worker's first
 *      message must be a Join. The server checks, in order: it is a Join (else
 *      INVALID_ARGUMENT), protocol_version == CTL_PROTOCOL_VERSION (else FAILED_PRECONDITION
 *      naming both versions), worker_name is 1-128 bytes of UTF-8 without control characters
 *      and worker_nonce 32 bytes (else INVALID_ARGUMENT), secret_proof proves the cluster secret
 *      over both nonces and the name (proto/control_auth.h, compared in constant time; else
 *      PERMISSION_DENIED "wrong cluster secret"); on_join is not called for a refused Join.
 *      Then the server queues Admitted, its own proof, and calls on_join(ctx, peer, join, err).
 *   2. on_join returns STRATA_OK: the peer is joined. It may send (typically the Assignment)
 *      already inside on_join. Any other code refuses the worker: the call ends with
 *      proto_grpc_status(code) and err->msg, on_gone is NOT called for it, and the handler must
 *      not keep the peer.
 *   3. Every later message goes to on_message(ctx, peer, msg) (msg valid during the call only).
 *      A malformed message, a second Join or an empty WorkerMessage ends the stream (INTERNAL /
 *      RESOURCE_EXHAUSTED for undecodable or oversized bytes, INVALID_ARGUMENT otherwise).
 *   4. on_gone(ctx, peer, grpc_status, why) comes exactly once per joined peer, when its stream
 *      ends for any reason: the worker closed it (GRPC_STATUS_OK), it died or stopped answering
 *      keepalive pings (UNAVAILABLE), a protocol error, ctl_peer_close, a full send queue
 *      (RESOURCE_EXHAUSTED), server shutdown (UNAVAILABLE "coordinator shutting down"). `why` is
 *      valid during the call only. After on_gone returns, the peer must not be used any more,
 *      except through a reference the handler took (ctl_peer_ref): then ctl_peer_* calls stay
 *      safe (sends fail with STRATA_EIO) until the matching ctl_peer_unref.
 *
 * The peer pointer is valid from on_join until on_gone returns (until on_join returns, for a
 * refused worker). A handler that hands it to other threads (a scheduler thread sending step
 * plans) takes a reference with ctl_peer_ref, and drops it with ctl_peer_unref when it no
 * longer needs it (typically after on_gone removed the peer from its tables). A reference
 * keeps only the object alive; the gRPC call is released as soon as the stream is over and
 * on_gone returned, so references may outlive ctl_server_shutdown.
 */
#ifndef STRATA_COORDINATOR_CONTROL_CONTROL_SERVER_H
#define STRATA_COORDINATOR_CONTROL_CONTROL_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvstore/error.h"
#include "proto/control_protocol.h"
#include "proto/validate.h"
#include "proto/strata_internal.pb-c.h"

/* The version of proto/strata_internal.proto this build speaks (Join.protocol_version), defined
 * once in proto/control_protocol.h for both ends. */
#define CTL_PROTOCOL_VERSION PROTO_CONTROL_PROTOCOL_VERSION

/* The full method name of the control stream. */
#define CTL_ATTACH_METHOD "/strata.internal.v1.WorkerControl/Attach"

/* Defaults of ctl_server_options (a zero field means the default). */
#define CTL_SERVER_DEFAULT_ADDR "127.0.0.1:50052"
#define CTL_DEFAULT_MAX_MESSAGE_BYTES ((size_t)64 << 20)
/* A stream's first message (a Join, under a KiB) is decoded only up to this: until its secret is
 * checked the peer is a stranger. */
#define CTL_MAX_JOIN_BYTES ((size_t)64 << 10)
#define CTL_SERVER_DEFAULT_MAX_QUEUED 4096
#define CTL_SERVER_DEFAULT_THREADS 2
#define CTL_DEFAULT_KEEPALIVE_TIME_MS 2000
#define CTL_DEFAULT_KEEPALIVE_TIMEOUT_MS 2000
#define CTL_SERVER_DEFAULT_MIN_RECV_PING_MS 1000
#define CTL_DEFAULT_JOIN_TIMEOUT_MS 10000
#define CTL_DEFAULT_MAX_WAITING_PER_HOST 32
/* Bounds of the cluster secret (as strata_internal.proto says). */
#define CTL_SECRET_MIN_BYTES PROTO_SECRET_MIN_BYTES
#define CTL_SECRET_MAX_BYTES PROTO_SECRET_MAX_BYTES
/* Longest Join.worker_name accepted. */
#define CTL_MAX_WORKER_NAME PROTO_MAX_WORKER_NAME

typedef struct ctl_server ctl_server;
typedef struct ctl_peer ctl_peer;

typedef struct ctl_server_options {
    /* HOST:PORT to listen on; NULL or "": CTL_SERVER_DEFAULT_ADDR (loopback only, design
     * section 7). Port 0 picks a free port: see ctl_server_port. */
    const char *listen_addr;
    /* The deployment's cluster secret, CTL_SECRET_MIN_BYTES to CTL_SECRET_MAX_BYTES bytes
     * (required). Copied; the copy is wiped when the server is freed. */
    const void *cluster_secret;
    size_t cluster_secret_len;
    /* Largest message in either direction (GRPC_ARG_MAX_{RECEIVE,SEND}_MESSAGE_LENGTH; gRPC
     * refuses a larger received one with RESOURCE_EXHAUSTED). 0: 64 MiB. At most 2 GiB - 1. */
    size_t max_message_bytes;
    /* Per-peer bound on messages queued and not yet taken by gRPC (one is in flight at a time).
     * 0: CTL_SERVER_DEFAULT_MAX_QUEUED. */
    uint32_t max_queued_messages;
    /* Completion-queue threads (they also run the callbacks). 0: 2. At most 64. */
    uint32_t threads;
    /* Keepalive: a ping every keepalive_time_ms on each worker connection; no ack within
     * keepalive_timeout_ms closes the connection and every stream on it (on_gone UNAVAILABLE).
     * 0: CTL_DEFAULT_KEEPALIVE_TIME_MS / CTL_DEFAULT_KEEPALIVE_TIMEOUT_MS. */
    int keepalive_time_ms;
    int keepalive_timeout_ms;
    /* Workers may ping (their own keepalive) this often without data in between
     * (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS); keep it at most the workers'
     * keepalive time. 0: CTL_SERVER_DEFAULT_MIN_RECV_PING_MS. */
    int min_recv_ping_interval_ms;
    /* TLS on the control port: a PEM certificate chain and its private key (both or neither;
     * proto_tls_read_pair checks them). Workers then need the CA that signed it
     * (ctl_client_options.tls_roots_pem). NULL: plaintext. */
    const char *tls_cert_file;
    const char *tls_key_file;
    /* A stream must send its Join within join_timeout_ms of opening, else it ends with
     * DEADLINE_EXCEEDED "no Join within N ms of opening the control stream" (reported to
     * on_refused): a client without the secret cannot hold a peer for long by opening a stream
     * and saying nothing. A worker sends its Join as soon as it reads the Challenge.
     * 0: CTL_DEFAULT_JOIN_TIMEOUT_MS. */
    int join_timeout_ms;
    /* At most this many streams from one host (the peer address without its port) wait for
     * their Join at a time. One more ends the one of that host that has waited longest with
     * RESOURCE_EXHAUSTED (reported to on_refused) rather than refusing the newcomer: a worker
     * sends its Join within a round trip, so a stranger who keeps streams open cannot keep it
     * out, and streams from other hosts are not touched. 0: CTL_DEFAULT_MAX_WAITING_PER_HOST. */
    uint32_t max_waiting_per_host;
} ctl_server_options;

typedef struct ctl_handler {
    void *ctx;
    /* A worker passed the server's checks (see above). Return STRATA_OK to accept it, or a
     * strata code with a one-line message in err to refuse it (e.g. STRATA_EFULL: no free slot,
     * RESOURCE_EXHAUSTED; STRATA_EINVAL: duplicate name, INVALID_ARGUMENT). join is valid during
     * the call only. Required. */
    int (*on_join)(void *ctx, ctl_peer *peer, const Strata__Internal__V1__Join *join, strata_error *err);
    /* Every later message of a joined peer, in order. kind_case is STEP_RESULT, KV_REPORT or
     * MIGRATE_DONE (the server ends the stream on anything else). msg is valid during the call
     * only. Required. */
    void (*on_message)(void *ctx, ctl_peer *peer, const Strata__Internal__V1__WorkerMessage *msg);
    /* The stream of a joined peer ended; exactly once per joined peer. grpc_status is a
     * grpc_status_code (GRPC_STATUS_OK when the worker closed its side cleanly). Required. */
    void (*on_gone)(void *ctx, ctl_peer *peer, int grpc_status, const char *why);
    /* Optional: a worker failed the server's own Join checks (wrong secret, protocol version,
     * name, an undecodable first message), so the handler never saw it; peer is its address as
     * gRPC names it. For a log line: an operator otherwise learns of it only on the worker. */
    void (*on_refused)(void *ctx, const char *peer, int grpc_status, const char *why);
} ctl_handler;

/* Options with every field at its default (cluster_secret NULL: must be set). */
ctl_server_options ctl_server_options_default(void);

/* Starts the server: binds, registers Attach, starts the threads. The handler struct is copied;
 * ctx must outlive the server. Fails with STRATA_EINVAL (bad options, missing callbacks, secret
 * length), STRATA_EIO (cannot listen: malformed address or port in use), STRATA_ENOMEM. *out is
 * NULL on failure. Calls grpc_init (undone by ctl_server_shutdown). */
int ctl_server_start(const ctl_server_options *o, const ctl_handler *h, ctl_server **out, strata_error *err);

/* The bound port (the real one when the address asked for port 0); 0 for NULL. */
int ctl_server_port(const ctl_server *s);

/* Stops the server and frees it: no new connections or calls; every open stream gets, after the
 * messages already queued for it, the status UNAVAILABLE "coordinator shutting down" (streams
 * whose worker does not read are cancelled after a 1 s grace); on_gone is delivered for every
 * joined peer (possibly on this thread); then the threads are joined and everything gRPC is
 * released. Peers the handler still references stay valid objects (sends fail with STRATA_EIO).
 * Call once, from a thread that is not a server thread, not inside a callback and not in a
 * signal handler. NULL is a no-op. */
void ctl_server_shutdown(ctl_server *s);

/* ---- ctl_peer: callable from any thread while the peer is valid (see above) ---- */

/* Queues msg (packed on the calling thread) for the worker. Returns STRATA_OK when queued;
 * STRATA_EINVAL for NULL arguments, a message protobuf-c rejects, or one larger than
 * max_message_bytes (nothing is sent, the stream goes on); STRATA_EIO when the stream is over
 * (on_gone came or is coming); STRATA_EFULL when max_queued_messages are already waiting: the
 * worker does not read, so the stream is ended with RESOURCE_EXHAUSTED "worker not reading" and
 * on_gone follows (from a server thread, never from inside this call). Messages of one peer are
 * sent in the order of their ctl_peer_send calls (calls that return before another starts). */
int ctl_peer_send(ctl_peer *peer, const Strata__Internal__V1__CoordinatorMessage *msg, strata_error *err);

/* Ends the peer's stream now with grpc_status (a grpc_status_code; OK is allowed) and message
 * (one line; NULL: none): messages not yet handed to gRPC are dropped, the status is written
 * even when flow control holds a message, and on_gone(grpc_status, message) follows from a
 * server thread (after the running callback of this peer returns, when called from one). A
 * no-op when the stream is already over. To end a worker gracefully, send it a Shutdown and let
 * it close the stream (on_gone GRPC_STATUS_OK). */
void ctl_peer_close(ctl_peer *peer, int grpc_status, const char *message);

/* References (see the contract above). ctl_peer_unref(NULL) is a no-op. */
void ctl_peer_ref(ctl_peer *peer);
void ctl_peer_unref(ctl_peer *peer);

/* The Join's worker_name ("" before the Join was read). Valid as long as the peer is. */
const char *ctl_peer_name(const ctl_peer *peer);

/* The worker's network address as gRPC reports it ("ipv4:127.0.0.1:40312"). */
const char *ctl_peer_addr(const ctl_peer *peer);

/* One pointer for the handler (NULL until set), e.g. its worker record. */
void ctl_peer_set_user(ctl_peer *peer, void *user);
void *ctl_peer_get_user(const ctl_peer *peer);

#endif
