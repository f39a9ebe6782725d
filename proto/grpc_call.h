/* Server-side gRPC C-core plumbing shared by the public API server (coordinator/server/) and the
 * control-plane server (coordinator/control/): what is the same in both, nothing of what either
 * decides. Each server keeps its own objects, locks, ownership rules and callbacks.
 *
 *  - proto_tag: every tag handed to gRPC starts with one; its done function runs on the
 *    completion-queue thread that took the event.
 *  - proto_sendq: a call's outgoing messages, one SEND_MESSAGE batch in flight at a time (what
 *    gRPC allows per call), then the final status batch after the last message.
 *  - proto_server: a grpc_server with one completion queue for grpc_completion_queue_next, its
 *    threads, a request for unknown methods (answered UNIMPLEMENTED), one-batch replies, and the
 *    start and shutdown sequences (including the gRPC 1.51 detail that a status batch, not
 *    grpc_call_cancel_with_status, must end a stream on a connection draining after GOAWAY).
 *
 * No global state. Allocation failures are reported (STRATA_ENOMEM) or, where there is nobody
 * to report to (a reply), handled by cancelling the call with its status. */
#ifndef STRATA_PROTO_GRPC_CALL_H
#define STRATA_PROTO_GRPC_CALL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <grpc/grpc.h>
#include <grpc/status.h>
#include <protobuf-c/protobuf-c.h>

#include "kvstore/error.h"

/* ---- tags and small helpers ---------------------------------------------------------------- */

/* The header of every tag object. done(tag, success) gets the event's success flag. */
typedef struct proto_tag proto_tag;
struct proto_tag {
    void (*done)(proto_tag *tag, bool success);
};

/* The object that holds member at ptr (for objects with several tags). */
#define PROTO_CONTAINER_OF(ptr, type, member) ((type *)(void *)((char *)(ptr) - offsetof(type, member)))

/* One line "strata WHO: ..." on stderr. */
void proto_log(const char *who, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* src (NULL: "") as one line of at most cap-1 bytes of valid UTF-8, fit for a status message
 * or a proto string: cut at the first invalid byte, CR and LF become spaces. cap >= 1. */
void proto_status_line(char *dst, size_t cap, const char *src);

/* An integer channel argument (GRPC_ARG_*). */
grpc_arg proto_int_arg(const char *key, int value);

/* One-op batches: RECV_CLOSE_ON_SERVER (*cancelled is 1 when the call did not end by the
 * server's status) and RECV_MESSAGE (*bb is NULL at the end of the client's messages). */
grpc_call_error proto_call_recv_close(grpc_call *call, int *cancelled, proto_tag *tag);
grpc_call_error proto_call_recv_message(grpc_call *call, grpc_byte_buffer **bb, proto_tag *tag);

/* ---- proto_sendq: one message in flight, then the status ----------------------------------- */

/* A packed message waiting in a send queue. */
typedef struct proto_msg {
    struct proto_msg *next;
    grpc_byte_buffer *bb;
} proto_msg;

/* Packs msg (proto_pack, max_bytes) into a new queue entry. STRATA_ENOMEM, or proto_pack's
 * codes (STRATA_EINVAL, STRATA_EFULL for a message above max_bytes). *out NULL on failure. */
int proto_msg_pack(const ProtobufCMessage *msg, size_t max_bytes, proto_msg **out, strata_error *err);
void proto_msg_free(proto_msg *m); /* NULL: no-op */

/* Every field is read and written under the owner's lock; every function below is called with
 * it held. Batches go out in order: SEND_INITIAL_METADATA with the first, each queued message,
 * then SEND_STATUS_FROM_SERVER once the queue is empty and a status is set. */
typedef struct proto_sendq {
    grpc_call *call;
    proto_tag *tag;              /* the owner's send tag: its done calls proto_sendq_sent */
    proto_msg *head, *tail;
    uint32_t queued;             /* entries waiting (not counting the one in flight) */
    bool in_flight;              /* a send batch is started and not complete */
    bool md_sent;                /* SEND_INITIAL_METADATA was in a started batch */
    bool dead;                   /* the call cannot send any more: nothing more is started */
    bool status_pending;         /* a final status is set */
    bool status_started;         /* ... and in a started batch */
    bool status_has_details;
    grpc_status_code status;
    grpc_slice status_details;
    grpc_byte_buffer *send_bb;   /* the message of the batch in flight */
} proto_sendq;

typedef enum proto_sendq_result {
    PROTO_SENDQ_IDLE,    /* nothing started: one in flight, nothing to send, or dead */
    PROTO_SENDQ_STARTED, /* one batch started: its completion comes to q->tag */
    PROTO_SENDQ_FAILED,  /* grpc_call_start_batch refused it: q is now dead and empty */
} proto_sendq_result;

void proto_sendq_init(proto_sendq *q, grpc_call *call, proto_tag *send_tag);
/* Appends m (taken). */
void proto_sendq_push(proto_sendq *q, proto_msg *m);
/* Frees the waiting entries (not the one in flight). */
void proto_sendq_drop(proto_sendq *q);
/* Sets the final status once (false, and nothing changes, when one is set already). details
 * NULL: the status carries no message. Does not start a batch: call proto_sendq_pump. */
bool proto_sendq_set_status(proto_sendq *q, grpc_status_code code, const char *details);
/* Starts the next batch when none is in flight; a dead queue drops its entries instead. On
 * PROTO_SENDQ_STARTED the owner counts the batch (before it releases the lock: the completion
 * handler must take the same lock before it drops the count); on PROTO_SENDQ_FAILED *e says why
 * (the owner logs it and cancels the call). */
proto_sendq_result proto_sendq_pump(proto_sendq *q, grpc_call_error *e);
/* A send batch completed: frees its message; !success marks the queue dead. Then pump again. */
void proto_sendq_sent(proto_sendq *q, bool success);
/* Frees everything the queue holds (not the call). */
void proto_sendq_clear(proto_sendq *q);

/* ---- proto_server: one completion queue, its threads, start and shutdown ------------------ */

typedef struct proto_server {
    const char *name;            /* log lines: "strata NAME: ..." (a string that outlives it) */
    grpc_server *server;
    grpc_completion_queue *cq;   /* every tag on it is a proto_tag */
    int port;                    /* the port proto_server_listen bound */
    /* The server lock, which the owner uses for its own shared state too; cond is broadcast
     * when shutdown_done changes (the owner broadcasts its own changes). */
    pthread_mutex_t mu;
    pthread_cond_t cond;
    bool shutting_down;          /* under mu: no request is armed any more */
    bool shutdown_done;          /* under mu: the shutdown notification came */
    proto_tag shutdown_tag;
    proto_tag *unknown;          /* the request for unknown methods (internal) */
    pthread_t *threads;
    uint32_t max_threads, n_threads;
    /* Optional, set before proto_server_run: called on a server thread about every tick_ms
     * (while the queue is busy and while it is idle), on one thread at a time, until the queue
     * shuts down; for the owner's timeouts. */
    void (*tick)(void *ctx);
    void *tick_ctx;
    int tick_ms;
    _Atomic int64_t next_tick_ms;   /* internal */
    atomic_flag ticking;            /* internal */
} proto_server;

/* A call requested for a registered method (proto_server_add_requests makes them). Its tag's
 * done function is the owner's, and starts with proto_request_take. */
typedef struct proto_request {
    proto_tag tag;
    proto_server *ps;
    void *method;        /* grpc_server_register_method's handle */
    bool read_payload;   /* registered with GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER */
    int index;           /* the owner's (which method) */
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_byte_buffer *payload;
} proto_request;

/* Life of a server:
 *   proto_server_init, then the owner's own allocations (on failure: proto_server_free);
 *   proto_server_create (proto_grpc_init, server, queue), register methods on ps->server,
 *   proto_server_listen; on failure proto_server_abandon then proto_server_free;
 *   proto_server_start, proto_server_add_requests per method, proto_server_run (on failure the
 *   server is torn down: proto_server_free is left);
 *   ... serving ...
 *   proto_server_shutdown_begin, the owner ends its streams (proto_server_wait),
 *   proto_server_shutdown_end, proto_server_free. */

/* Lock, condition and room for threads (at least 1). STRATA_ENOMEM when that fails (nothing to
 * free then). */
int proto_server_init(proto_server *ps, const char *name, uint32_t threads);
/* Frees what proto_server_init made (no gRPC). */
void proto_server_free(proto_server *ps);

/* proto_grpc_init, the server with these channel arguments, and its completion queue. */
void proto_server_create(proto_server *ps, const grpc_arg *args, size_t n_args);
/* Binds addr (ps->port: the port): TLS with the PEM certificate chain and private key in these
 * files when cert_file is set (proto_tls_read_pair checks them; key_file is then required),
 * otherwise plaintext. STRATA_EINVAL for bad TLS files, STRATA_EIO "cannot listen on ADDR:
 * REASON" with gRPC's reason (its own error line is not printed then), STRATA_ENOMEM. */
int proto_server_listen(proto_server *ps, const char *addr, const char *cert_file, const char *key_file,
                        strata_error *err);
/* A server that was created but never started: destroys it and its queue, grpc_shutdown. */
void proto_server_abandon(proto_server *ps);

/* grpc_server_start, and a standing request that answers calls to unknown methods
 * UNIMPLEMENTED "unknown method NAME". */
void proto_server_start(proto_server *ps);
/* count requests for method, each armed (proto_request_arm), with done as their tag's done
 * function and index as their index (as many as memory allows). */
void proto_server_add_requests(proto_server *ps, void *method, bool read_payload, int index, int count,
                               void (*done)(proto_tag *tag, bool success));
/* Requests the next call for r; false (not armed: the caller frees r) once shutdown began. */
bool proto_request_arm(proto_request *r);
/* For the request's done function. success false (the request was withdrawn at shutdown):
 * releases and frees r, returns false. Otherwise *got receives the call (call, deadline, md,
 * payload, index: the caller's now; it destroys md and payload when done), r is armed again
 * for the next call (or freed once shutdown began), and it returns true. */
bool proto_request_take(proto_request *r, bool success, proto_request *got);
/* Starts the threads (each runs grpc_completion_queue_next and calls tag->done). STRATA_OK
 * when at least one started; STRATA_EIO when none did: the server was then shut down inline,
 * destroyed and grpc_shutdown called. */
int proto_server_run(proto_server *ps);

/* A one-batch answer (initial metadata, message when msg is set, status, RECV_CLOSE_ON_SERVER),
 * freed on completion. Takes call and msg. An OK status carries no message. When the batch
 * cannot be started (logged) or its object not allocated, the call is cancelled with the status
 * instead (an OK answer: INTERNAL, or RESOURCE_EXHAUSTED "out of memory"). */
void proto_server_reply(proto_server *ps, grpc_call *call, grpc_byte_buffer *msg, grpc_status_code code,
                        const char *message);

/* No new connections, calls or requests from here (clients get UNAVAILABLE); calls in flight go
 * on. The owner then ends its streams: with proto_sendq_set_status + pump (a status batch after
 * the message in flight, which reaches the client also on a connection draining after GOAWAY,
 * where gRPC 1.51 closes the connection on grpc_call_cancel_with_status before writing the
 * trailers), then, after a grace, grpc_call_cancel_with_status for streams whose client does
 * not read (a status cannot overtake a message that flow control holds). */
void proto_server_shutdown_begin(proto_server *ps);
/* With mu held: waits until *count is 0 (the owner broadcasts cond when it changes) for up to
 * ms milliseconds; ms < 0: no limit, logging "shutdown: still waiting for N WHAT (S s)" every
 * 5 s (what is used only then). */
void proto_server_wait(proto_server *ps, const uint32_t *count, long ms, const char *what);
/* Without mu, after the owner's streams are gone: waits for the shutdown notification (after a
 * 1 s grace, cancels the calls left, e.g. a unary call of a stuck client), shuts the queue
 * down, joins the threads, destroys server and queue, grpc_shutdown. */
void proto_server_shutdown_end(proto_server *ps);

#endif
