/* The public gRPC API server of the coordinator (design section 6): service strata.v1.Strata on
 * the gRPC C core, independent of the scheduler, which plugs in through api_backend.
 *
 * The server owns the network side: listening (TLS optional), the bearer token, decoding and
 * validating requests (proto_validate_generate), request ids (assigning one when empty,
 * refusing a duplicate with ALREADY_EXISTS), the concurrency limit, per-stream send queues with
 * backpressure, client cancellation and deadlines, and shutdown with drain. The backend owns
 * everything about generation. coordinator/server/README.md has the full story; this header is
 * the contract.
 *
 * Threads. The server runs `threads` completion-queue threads. Every backend callback runs on
 * one of them (or, for cancel during shutdown, on the thread calling api_server_shutdown),
 * never inside an api_stream_* call and never with a server lock held, so the backend may hold
 * its own locks while calling api_stream_* functions, and may make its terminal call from
 * inside cancel. Callbacks may run concurrently with each other (several
 * server threads) and must be quick: generate should queue the request and return, not run it.
 * The api_stream_* functions may be called from any thread.
 *
 * Ownership of an api_stream (one Generate call):
 *   1. The server creates the stream and calls generate(ctx, req, stream, deadline, err).
 *      - non-OK return: the backend must not have used the stream and must not keep it; the
 *        call ends with proto_grpc_status(code) and err->msg (INVALID_ARGUMENT,
 *        RESOURCE_EXHAUSTED, ...).
 *      - STRATA_OK: the backend now holds a reference and must end it with exactly one
 *        *terminal* call, from any thread, at any later time (even before generate returns):
 *        api_stream_complete, api_stream_fail or api_stream_finish. After the terminal call
 *        the backend must not touch the stream again.
 *   2. Before its terminal call the backend may call api_stream_send_chunk any number of times.
 *   3. cancel(ctx, stream) tells the backend that nobody is listening any more: the client
 *      cancelled or went away, the deadline passed, the stream was failed by the server
 *      (backpressure), or the server is shutting down. It is called at most once per stream,
 *      only after generate returned STRATA_OK, and only if the server had not yet seen the
 *      backend's terminal call; it may still race with a terminal call the backend is making
 *      on another thread, so a backend that no longer knows the stream ignores it. The stream
 *      stays valid during the callback. On cancel the backend stops working on the request
 *      and makes its terminal call (normally api_stream_finish; complete and fail are
 *      accepted too and send nothing). The server waits for that terminal call: shutdown does
 *      not finish until every stream was released.
 *   The stream object itself lives until both the server and the backend released it.
 *
 * What the client sees:
 *   - chunks, then the Complete of api_stream_complete, then status OK;
 *   - api_stream_fail before any chunk was sent: the gRPC status proto_grpc_status(code) with
 *     the message; after a chunk: a GenerateResponse{error{code, message}} then status OK (as
 *     strata.proto says);
 *   - api_stream_finish without a cancel: status INTERNAL "backend ended the request without
 *     a result" (a backend bug, reported rather than hung);
 *   - client cancel: CANCELLED (client side); deadline: DEADLINE_EXCEEDED; backpressure:
 *     RESOURCE_EXHAUSTED "client not reading"; shutdown after the drain time: UNAVAILABLE
 *     "server shutting down".
 *
 * Backpressure. Each stream queues at most max_queued_messages encoded messages that gRPC has
 * not yet accepted (one GRPC_OP_SEND_MESSAGE is in flight at a time; gRPC allows no more, and
 * HTTP/2 flow control holds it while the client does not read). When a send_chunk would exceed
 * the bound, the queue is dropped, the call ends with RESOURCE_EXHAUSTED "client not reading",
 * send_chunk returns STRATA_EFULL and the backend gets cancel. The Complete/Error message of a
 * terminal call is never refused, but a stream the backend has ended whose last messages and
 * status the client has not taken within API_SERVER_LINGER_MS is cancelled, so that its slot in
 * max_streams frees (a client that stops reading, or vanished, would hold it for good).
 *
 * Connections (abuse by clients that can reach the port): compressed messages are refused
 * (gRPC inflates one whole before its size limit applies); fields the schema does not know are
 * dropped at decoding; a connection carries at most API_SERVER_STREAMS_PER_CONNECTION calls at
 * once (a client opens more as earlier ones end); idle connections are pinged every
 * API_SERVER_KEEPALIVE_MS and closed when a ping goes unanswered, ending their calls.
 */
#ifndef STRATA_COORDINATOR_SERVER_API_SERVER_H
#define STRATA_COORDINATOR_SERVER_API_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <grpc/support/time.h>

#include "kvstore/error.h"
#include "proto/strata.pb-c.h"
#include "proto/validate.h"

/* Defaults of api_server_options (a zero field means the default). */
#define API_SERVER_DEFAULT_ADDR "127.0.0.1:50051"
#define API_SERVER_DEFAULT_MAX_STREAMS 1024
/* A valid request needs at most ~1.3 MiB (1 MiB of text, or 262144 token ids of up to 5 bytes). */
#define API_SERVER_DEFAULT_MAX_RECV_BYTES ((size_t)2 << 20)
#define API_SERVER_LINGER_MS 10000
#define API_SERVER_STREAMS_PER_CONNECTION 256
#define API_SERVER_KEEPALIVE_MS 60000
#define API_SERVER_DEFAULT_MAX_QUEUED 1024
#define API_SERVER_DEFAULT_THREADS 2
/* Most tiers a backend can report in GetStats (device, host, nvme; some room). */
#define API_STATS_MAX_TIERS 8
/* Room for DrainWorkerResponse.message (see drain_worker). */
#define API_DRAIN_MESSAGE_BYTES 512

typedef struct api_server api_server;
typedef struct api_stream api_stream;

typedef struct api_server_options {
    /* HOST:PORT for grpc_server_add_http2_port; NULL or "": API_SERVER_DEFAULT_ADDR (loopback
     * only, design section 7). Port 0 picks a free port: see api_server_port. */
    const char *listen_addr;
    /* Generate streams alive at once (accepted and not yet fully closed); one more is refused
     * with RESOURCE_EXHAUSTED. 0: API_SERVER_DEFAULT_MAX_STREAMS. */
    uint32_t max_streams;
    /* Largest request message gRPC accepts (GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH); larger ones
     * are refused by gRPC with RESOURCE_EXHAUSTED before we see them. 0: 2 MiB. */
    size_t max_recv_bytes;
    /* Per-stream send queue bound (see Backpressure above). 0: API_SERVER_DEFAULT_MAX_QUEUED. */
    uint32_t max_queued_messages;
    /* Completion-queue threads. 0: API_SERVER_DEFAULT_THREADS. */
    uint32_t threads;
    /* TLS: both or neither. PEM files of the certificate chain and its private key, read once
     * at start. NULL: plaintext (insecure credentials). */
    const char *tls_cert_file;
    const char *tls_key_file;
    /* Bearer token: when non-NULL and non-empty every call must carry "authorization: Bearer
     * <token>", else UNAUTHENTICATED. Health is exempt unless auth_health (so that probes need
     * no secret; it reveals only the serving status and worker counts). Without TLS the token
     * travels in clear text: use it so only on loopback. The string is copied. */
    const char *bearer_token;
    bool auth_health;
    /* Validation limits for Generate; NULL: proto_generate_limits_default(UINT32_MAX, 0) (the
     * backend then checks max_tokens against its context and ids against its vocabulary). */
    const proto_generate_limits *limits;
} api_server_options;

typedef struct api_backend {
    void *ctx;
    /* A validated Generate request. req stays valid (unchanged) until the stream is released
     * by both sides, i.e. at least until the backend's terminal call; req->request_id is the
     * effective id (the server fills in an assigned one), the same as
     * api_stream_request_id(stream). deadline is the call's (gpr_inf_future when none; the
     * server cancels the stream when it passes, so honouring it is optional). Return STRATA_OK
     * to take the stream (see the ownership protocol above) or a strata code with a message in
     * err to refuse it (the message becomes the gRPC status message). Required. */
    int (*generate)(void *ctx, const Strata__V1__GenerateRequest *req, api_stream *stream, gpr_timespec deadline,
                    strata_error *err);
    /* Nobody listens to stream any more: stop and make the terminal call. Required. */
    void (*cancel)(void *ctx, api_stream *stream);
    /* Abort by request id (validated, non-empty): true when the request was running or queued
     * (its stream must then end with Complete{FINISH_REASON_ABORT}); false when unknown.
     * Required. */
    bool (*abort)(void *ctx, const char *request_id);
    /* Fill *out (already initialized). Strings placed in it must stay valid while the server
     * runs (constants or backend-owned storage that does not change). Non-OK: the call ends
     * with proto_grpc_status(code) and err->msg. NULL: health answers SERVING with 0/0
     * workers; model_info and stats answer UNIMPLEMENTED. */
    int (*health)(void *ctx, Strata__V1__HealthResponse *out, strata_error *err);
    int (*model_info)(void *ctx, Strata__V1__ModelInfo *out, strata_error *err);
    /* out->tiers points at API_STATS_MAX_TIERS initialized TierStats and out->n_tiers is 0:
     * set n_tiers (at most API_STATS_MAX_TIERS) and fill out->tiers[0..n_tiers). */
    int (*stats)(void *ctx, Strata__V1__Stats *out, strata_error *err);
    /* DrainWorker (worker_name checked: 1-128 bytes, no control characters). out->message
     * points at API_DRAIN_MESSAGE_BYTES bytes holding "": write the message there (the server
     * packs the answer after the call returns, so nothing the backend may change meanwhile is
     * referenced). NULL: UNIMPLEMENTED. Always needs the bearer token when the server has one. */
    int (*drain_worker)(void *ctx, const char *worker_name, Strata__V1__DrainWorkerResponse *out, strata_error *err);
} api_backend;

/* Options with every field at its default. */
api_server_options api_server_options_default(void);

/* Starts the server: binds, registers the six methods, starts the threads. The backend (the
 * struct is copied; ctx must outlive the server) must be ready to take calls. Fails with
 * STRATA_EINVAL (bad options, missing callbacks, TLS with only one file), STRATA_EIO (a TLS file
 * cannot be read, or the address cannot be bound: "cannot listen on ADDR"). *out is NULL on
 * failure. Calls grpc_init (undone by api_server_shutdown). */
int api_server_start(const api_server_options *o, const api_backend *b, api_server **out, strata_error *err);

/* The bound port (the real one when the address asked for port 0). */
int api_server_port(const api_server *s);

/* Stops the server and frees it: stops accepting (new calls get UNAVAILABLE from gRPC), lets
 * streams in flight run for up to drain_ms (< 0: 0), then ends the remaining ones with
 * UNAVAILABLE "server shutting down" (the backend gets cancel), waits for the backend to
 * release every stream, joins the threads, destroys everything. Call once, from any thread that
 * is not a server thread and not a signal handler (e.g. a thread that sigwait()s SIGTERM);
 * NULL is a no-op. */
void api_server_shutdown(api_server *s, int drain_ms);

/* ---- api_stream: callable from any thread while the caller holds a reference ---- */

/* The request id of the stream (the client's, or "srv-..." assigned by the server). */
const char *api_stream_request_id(const api_stream *st);

/* Queues a Chunk of n token ids and len bytes of UTF-8 text (text may be NULL when len is 0;
 * it must not contain U+0000). Returns STRATA_OK when queued; STRATA_EINVAL for text that is not
 * valid UTF-8 (nothing queued, the stream goes on); STRATA_EFULL when the queue bound was hit
 * (the stream is now failed with RESOURCE_EXHAUSTED and cancel follows); STRATA_EIO when nobody
 * listens any more (client gone, deadline, shutdown: cancel follows or came). The backend may
 * treat any non-OK as "stop producing"; it still owes its terminal call. */
int api_stream_send_chunk(api_stream *st, const uint32_t *ids, size_t n, const char *text, size_t len);

/* Terminal: queues Complete{finish_reason, counts} and then status OK. */
void api_stream_complete(api_stream *st, Strata__V1__FinishReason finish_reason, uint32_t prompt_tokens,
                         uint32_t completion_tokens, uint32_t cached_tokens);

/* Terminal: the request failed with strata code `status` (not STRATA_OK) and a one-line
 * message (NULL: the code's name). Before any chunk: gRPC status proto_grpc_status(status) with
 * the message; after one: GenerateResponse{error{code, message}} then status OK. */
void api_stream_fail(api_stream *st, int status, const char *message);

/* Terminal with nothing to report: the answer to cancel. Without a cancel it ends the call with
 * INTERNAL (see above). */
void api_stream_finish(api_stream *st);

#endif
