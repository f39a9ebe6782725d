/* The worker's side of the control plane (design section 1): one WorkerControl.Attach stream to
 * the coordinator, on the gRPC C core, insecure channel with keepalive. The protocol and the
 * coordinator's side are described in coordinator/control/README.md.
 *
 * Threading. The client has no thread of its own: it uses one completion queue created for
 * grpc_completion_queue_pluck, and every operation is a batch that the calling thread plucks
 * itself. ctl_client_send and ctl_client_recv may be called concurrently from different threads
 * (a step-executing thread sending results, a control thread receiving plans); sends are
 * serialized among themselves (one SEND_MESSAGE in flight, as gRPC allows), as are receives.
 * ctl_client_close may be called from any thread at any time, also while other threads are
 * blocked in send or recv: they return STRATA_EIO before close returns. After close returns the
 * client is freed; calling anything on it then is a use after free.
 *
 * Flow control. ctl_client_send returns once gRPC has taken the message (written it to the
 * transport or its buffers); it blocks while HTTP/2 flow control holds the previous one, i.e.
 * while the coordinator does not read. The coordinator reads continuously, so this is brief.
 *
 * Errors: STRATA_EIO when the stream has ended, with the message "coordinator ended the
 * control stream: <STATUS_NAME>: <details>" (e.g. "...: PERMISSION_DENIED: wrong cluster
 * secret", "...: UNAVAILABLE: coordinator shutting down"); the same message comes again on
 * every later call. ctl_client_status gives the code itself.
 */
#ifndef STRATA_WORKER_CONTROL_CONTROL_CLIENT_H
#define STRATA_WORKER_CONTROL_CONTROL_CLIENT_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>

#include "kvstore/error.h"
#include "proto/control_protocol.h"
#include "proto/strata_internal.pb-c.h"

/* The version of proto/strata_internal.proto this build speaks, defined once in
 * proto/control_protocol.h for both ends. */
#define CTL_CLIENT_PROTOCOL_VERSION PROTO_CONTROL_PROTOCOL_VERSION

/* Defaults of ctl_client_options (a zero field means the default). */
#define CTL_CLIENT_DEFAULT_MAX_MESSAGE_BYTES ((size_t)64 << 20)
#define CTL_CLIENT_DEFAULT_KEEPALIVE_TIME_MS 2000
#define CTL_CLIENT_DEFAULT_KEEPALIVE_TIMEOUT_MS 2000
#define CTL_CLIENT_DEFAULT_CONNECT_TIMEOUT_MS 10000
/* The longest a handshake made by hand with the control port may take: before gRPC's wait, and
 * after it when it timed out (see ctl_client_connect). */
#define CTL_CLIENT_PROBE_MS 2000
#define CTL_CLIENT_CANCEL_POLL_MS 100
/* ctl_client_close waits this long for the coordinator's status after half-closing. */
#define CTL_CLIENT_CLOSE_GRACE_MS 1000

typedef struct ctl_client ctl_client;

typedef struct ctl_client_options {
    /* Largest message in either direction. 0: 64 MiB (at most 2 GiB - 1). */
    size_t max_message_bytes;
    /* Keepalive pings on the connection (also while idle): no ack within the timeout ends the
     * stream with UNAVAILABLE. Keep keepalive_time_ms at least the coordinator's
     * min_recv_ping_interval_ms. 0: 2000 / 2000. */
    int keepalive_time_ms;
    int keepalive_timeout_ms;
    /* While connecting, checked every CTL_CLIENT_CANCEL_POLL_MS: once *cancel is non-zero (a
     * signal handler's flag) the connect gives up with STRATA_EIO ("stopped while ..."), so a
     * stop request is not held up by connect_timeout_ms. NULL: never. */
    const volatile sig_atomic_t *cancel;
    /* TLS to a coordinator whose control port has it: the PEM trust roots (the CA that signed
     * its certificate, or the certificate itself when self-signed; proto_tls_read_roots reads
     * them), checked against the host name of coordinator_addr. NULL: plaintext. */
    const char *tls_roots_pem;
} ctl_client_options;

/* Connects to the coordinator at coordinator_addr ("host:port"), opens the Attach call, waits
 * for the coordinator's Challenge and sends join as its answer, with Join.secret_proof and
 * Join.worker_nonce filled in from secret (secret_len bytes, PROTO_SECRET_MIN_BYTES to
 * PROTO_SECRET_MAX_BYTES; the secret itself is never sent: proto/control_auth.h); a
 * join->protocol_version of 0 is sent as CTL_CLIENT_PROTOCOL_VERSION (join itself is not
 * modified). Waits up to timeout_ms (< 0: no limit; 0: CTL_CLIENT_DEFAULT_CONNECT_TIMEOUT_MS) for
 * the coordinator to be reachable and to send its Challenge (a coordinator that is not up yet is
 * retried with gRPC's backoff meanwhile). Returning STRATA_OK does not mean the coordinator
 * accepted the worker: its answer (Assignment, or the end of the stream with PERMISSION_DENIED,
 * FAILED_PRECONDITION, ...) comes through ctl_client_recv, which first checks the coordinator's
 * own proof (Admitted) and, when it is wrong or missing, cancels the call and fails every later
 * call with STRATA_EIO ("... did not prove that it holds the cluster secret ..."). Fails with
 * STRATA_EINVAL (NULL arguments, a secret of the wrong length, join rejected by protobuf-c or too
 * large), STRATA_EIO ("cannot reach the coordinator at ADDR within N ms", no Challenge first, or
 * the stream ended during connect). Before gRPC's wait (and after it, when it ran out), one TLS
 * handshake made by hand (proto/tls_probe.h, up to CTL_CLIENT_PROBE_MS) fails the connect at once
 * with the reason when the port answers otherwise than gRPC would need: a certificate the roots
 * do not accept or that does not name the host dialled, a port without TLS for a TLS client, a
 * TLS port for a plaintext one (gRPC itself would retry these until the deadline). Calls
 * grpc_init (undone by ctl_client_close). */
int ctl_client_connect(const char *coordinator_addr, const void *secret, size_t secret_len,
                       const Strata__Internal__V1__Join *join, int timeout_ms, ctl_client **out, strata_error *err);

/* ctl_client_connect with options (NULL: defaults). */
int ctl_client_connect_opts(const char *coordinator_addr, const void *secret, size_t secret_len,
                            const Strata__Internal__V1__Join *join, int timeout_ms, const ctl_client_options *o,
                            ctl_client **out, strata_error *err);

/* Sends msg (thread-safe; see Flow control). STRATA_OK once gRPC has taken it; STRATA_EINVAL for
 * NULL arguments or a message that cannot be packed or exceeds max_message_bytes (nothing sent,
 * the stream goes on); STRATA_EIO when the stream has ended or the client is closing. */
int ctl_client_send(ctl_client *c, const Strata__Internal__V1__WorkerMessage *msg, strata_error *err);

/* Waits up to timeout_ms (< 0: no limit; 0: just poll) for the coordinator's next message.
 * The coordinator's Challenge and Admitted never come out here (connect and the first receive
 * take them).
 *   STRATA_OK, *msg != NULL: a message; free it with protobuf_c_message_free_unpacked(&(*msg)->base, NULL).
 *   STRATA_OK, *msg == NULL: nothing arrived within timeout_ms (the stream goes on).
 *   STRATA_EIO: the stream ended (message above); *msg is NULL.
 *   STRATA_EFORMAT: the coordinator sent bytes that do not decode as a CoordinatorMessage; the
 *     message is skipped, the stream goes on. A message above max_message_bytes ends the stream
 *     (gRPC's own receive limit: STRATA_EIO, RESOURCE_EXHAUSTED in ctl_client_status).
 *   STRATA_EINVAL: NULL arguments. */
int ctl_client_recv(ctl_client *c, int timeout_ms, Strata__Internal__V1__CoordinatorMessage **msg, strata_error *err);

/* The gRPC status of the ended stream (a grpc_status_code) and, when details is non-NULL, its
 * message; -1 while the stream has not been seen to end by send or recv. */
int ctl_client_status(ctl_client *c, char *details, size_t cap);

/* Ends the stream and frees the client: half-closes (the coordinator sees a clean end: on_gone
 * with GRPC_STATUS_OK), waits up to CTL_CLIENT_CLOSE_GRACE_MS for the coordinator's status, then
 * cancels whatever is left, waits for other threads inside send/recv to return, and destroys the
 * call, queue and channel. Safe in any state of the stream; NULL is a no-op. */
void ctl_client_close(ctl_client *c);

#endif
