/* `strata generate --server` (remote.h): one Generate call on the gRPC C core, driven
 * synchronously on a pluck completion queue: start the call, then read messages one batch at a
 * time until the stream ends, then read the status. */
#include "coordinator/cli/remote.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/string_util.h>
#include <grpc/support/time.h>

#include "kvstore/clock.h"
#include "proto/credential_file.h"
#include "proto/grpc_call.h"
#include "proto/grpc_log.h"
#include "proto/grpc_util.h"
#include "proto/tls_files.h"
#include "proto/tls_probe.h"
#include "proto/validate.h"
#include "proto/strata.pb-c.h"

enum { EXIT_RUNTIME = 1, EXIT_USAGE = 2 };
#define MAX_RESPONSE_BYTES ((size_t)4 << 20)
#define MAX_TOKEN_BYTES ((size_t)1 << 20)

/* A whole small file (a token), NUL-terminated, trailing newlines dropped; NULL after a message
 * that starts with cmd ("strata generate"). */
static char *read_file(const char *cmd, const char *flag, const char *path)
{
    char *buf = NULL;
    size_t n = 0;
    strata_error err = {0};
    if (credential_file_read(path, MAX_TOKEN_BYTES, true, &buf, &n, &err) != STRATA_OK) {
        fprintf(stderr, "%s: %s %s: %s\n", cmd, flag, path, err.msg);
        return NULL;
    }
    if (!n) {
        fprintf(stderr, "%s: %s %s is empty\n", cmd, flag, path);
        free(buf);
        return NULL;
    }
    return buf;
}

static bool run_batch(grpc_call *call, grpc_completion_queue *cq, const grpc_op *ops, size_t n, void *tag)
{
    if (grpc_call_start_batch(call, ops, n, tag, NULL) != GRPC_CALL_OK)
        return false;
    grpc_event ev = grpc_completion_queue_pluck(cq, tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    return ev.type == GRPC_OP_COMPLETE && ev.success;
}

static const char *finish_name(Strata__V1__FinishReason r)
{
    switch (r) {
    case STRATA__V1__FINISH_REASON__FINISH_REASON_STOP: return "stop";
    case STRATA__V1__FINISH_REASON__FINISH_REASON_LENGTH: return "length";
    case STRATA__V1__FINISH_REASON__FINISH_REASON_ABORT: return "abort";
    default: return "unspecified";
    }
}

/* A connection to a server for one command: the channel (TLS when a CA file is given), a pluck
 * queue, and the bearer-token metadata every call sends. */
typedef struct remote_conn {
    grpc_channel *ch;
    grpc_completion_queue *cq;
    char *token;
    grpc_metadata md;   /* authorization: Bearer <token>, when a token was given */
    size_t n_md;
} remote_conn;

/* Reads the token and CA files and opens the channel; false (EXIT_USAGE) after a message. */
static bool conn_open(remote_conn *c, const char *cmd, const char *server, const char *token_file,
                      const char *tls_ca)
{
    memset(c, 0, sizeof *c);
    char *pem = NULL;
    if (token_file && !(c->token = read_file(cmd, "--token-file", token_file)))
        return false;
    /* gRPC takes anything here and then fails every connection ("empty address list", the
     * reason only in its own log lines): the certificates are read as its TLS stack will. */
    strata_error err = {0};
    if (tls_ca && proto_tls_read_roots(tls_ca, &pem, &err) != STRATA_OK) {
        fprintf(stderr, "%s: --tls-ca %s\n", cmd, err.msg);
        free(c->token);
        return false;
    }
    proto_grpc_init();
    proto_grpc_log_quiet_tls(true);   /* a failed call's status carries the handshake's reason */
    grpc_channel_credentials *creds = pem ? grpc_ssl_credentials_create(pem, NULL, NULL, NULL)
                                          : grpc_insecure_credentials_create();
    grpc_arg arg = proto_int_arg(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, (int)MAX_RESPONSE_BYTES);
    grpc_channel_args args = {1, &arg};
    c->ch = grpc_channel_create(server, creds, &args);
    grpc_channel_credentials_release(creds);
    free(pem);
    c->cq = grpc_completion_queue_create_for_pluck(NULL);
    if (c->token) {
        char auth[1100];
        snprintf(auth, sizeof auth, "Bearer %.1024s", c->token);
        c->md.key = grpc_slice_from_static_string("authorization");
        c->md.value = grpc_slice_from_copied_string(auth);
        c->n_md = 1;
    }
    return true;
}

/* What to add to an UNAVAILABLE status when the cause is TLS on one side only: gRPC says only
 * "Socket closed" for a plaintext client at a TLS port (a handshake of our own tells), and
 * OpenSSL's "wrong version number" for a TLS client at a plaintext one. */
static const char *tls_hint(const char *server, const char *tls_ca, grpc_status_code status, const char *details)
{
    if (status != GRPC_STATUS_UNAVAILABLE)
        return "";
    if (tls_ca)
        return details && strstr(details, "wrong version number") ? " (the server has no TLS? then without --tls-ca)"
                                                                  : "";
    char why[64];
    return proto_tls_probe(server, NULL, 2000, why, sizeof why) == PROTO_TLS_PROBE_DIFFERS
               ? " (the server speaks TLS: give --tls-ca with the CA of its certificate)"
               : "";
}

static void conn_close(remote_conn *c)
{
    if (c->n_md)
        grpc_slice_unref(c->md.value);
    grpc_completion_queue_shutdown(c->cq);
    while (grpc_completion_queue_pluck(c->cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(c->cq);
    grpc_channel_destroy(c->ch);
    grpc_shutdown();
    if (c->token)
        memset(c->token, 0, strlen(c->token));
    free(c->token);
}

int cli_remote_generate(const remote_request *r)
{
    Strata__V1__SamplingParams sp = STRATA__V1__SAMPLING_PARAMS__INIT;
    sp.temperature = r->sampling.temperature;
    sp.top_p = r->sampling.top_p;
    sp.top_k = (uint32_t)r->sampling.top_k;
    sp.seed = r->sampling.seed;
    sp.max_tokens = (uint32_t)r->max_tokens;
    sp.n_stop = r->n_stop;
    sp.stop = (char **)r->stop;
    sp.ignore_eos = r->ignore_eos;
    Strata__V1__GenerateRequest req = STRATA__V1__GENERATE_REQUEST__INIT;
    req.input_case = STRATA__V1__GENERATE_REQUEST__INPUT_TEXT;
    req.text = (char *)r->prompt;
    req.sampling = &sp;
    req.kv_codec = (char *)(r->kv ? r->kv : "");
    grpc_byte_buffer *send_bb = NULL;
    strata_error err = {0};
    /* The limits strata.proto documents (a server may have tighter ones): a prompt over them is
     * told here in the field's terms, not as an oversized message. */
    proto_generate_limits lim = proto_generate_limits_default(UINT32_MAX, 0);
    if (proto_validate_generate(&req, &lim, &err) != STRATA_OK) {
        fprintf(stderr, "strata generate: the request: %s\n", err.msg);
        return EXIT_USAGE;
    }
    if (proto_pack(&req.base, MAX_RESPONSE_BYTES, &send_bb, &err) != STRATA_OK) {
        fprintf(stderr, "strata generate: the request: %s\n", err.msg);
        return EXIT_USAGE;
    }
    remote_conn conn;
    if (!conn_open(&conn, "strata generate", r->server, r->token_file, r->tls_ca)) {
        grpc_byte_buffer_destroy(send_bb);
        return EXIT_USAGE;
    }
    grpc_completion_queue *cq = conn.cq;
    grpc_call *call = grpc_channel_create_call(conn.ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                               grpc_slice_from_static_string("/strata.v1.Strata/Generate"), NULL,
                                               gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    grpc_metadata_array md_in, trailing;
    grpc_metadata_array_init(&md_in);
    grpc_metadata_array_init(&trailing);
    grpc_status_code status = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    int tag_start, tag_msg, tag_status;

    grpc_op ops[4];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = conn.n_md;
    ops[0].data.send_initial_metadata.metadata = conn.n_md ? &conn.md : NULL;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = send_bb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &md_in;
    double t0 = strata_mono_s(), t_first = 0;
    bool started = call && run_batch(call, cq, ops, 4, &tag_start);
    grpc_byte_buffer_destroy(send_bb);

    int exit_code = EXIT_RUNTIME;
    bool got_end = false, echoed = false;
    size_t n_tokens = 0;
    while (started) {
        grpc_byte_buffer *bb = NULL;
        grpc_op op;
        memset(&op, 0, sizeof op);
        op.op = GRPC_OP_RECV_MESSAGE;
        op.data.recv_message.recv_message = &bb;
        if (!run_batch(call, cq, &op, 1, &tag_msg) || !bb)
            break;   /* the stream is over: the status says how */
        Strata__V1__GenerateResponse *resp = NULL;
        int rc = proto_unpack(bb, &strata__v1__generate_response__descriptor, MAX_RESPONSE_BYTES,
                              (ProtobufCMessage **)&resp, &err);
        grpc_byte_buffer_destroy(bb);
        if (rc != STRATA_OK) {
            fprintf(stderr, "strata generate: a malformed response from %s: %s\n", r->server, err.msg);
            grpc_call_cancel(call, NULL);
            break;
        }
        if (r->echo && !echoed) {   /* once the server answered: no prompt before an error */
            fputs(r->prompt, stdout);
            echoed = true;
        }
        if (resp->kind_case == STRATA__V1__GENERATE_RESPONSE__KIND_CHUNK) {
            if (!t_first && resp->chunk->n_token_ids)
                t_first = strata_mono_s();
            n_tokens += resp->chunk->n_token_ids;
            fputs(resp->chunk->text ? resp->chunk->text : "", stdout);
            fflush(stdout);
        } else if (resp->kind_case == STRATA__V1__GENERATE_RESPONSE__KIND_COMPLETE) {
            const Strata__V1__Complete *c = resp->complete;
            got_end = true;
            exit_code = 0;
            if (r->stats) {
                double t = strata_mono_s();
                fprintf(stderr, "\nrequest %s: %u prompt tokens (%u from the prefix cache), %u generated, finish: %s\n",
                        resp->request_id, c->prompt_tokens, c->cached_tokens, c->completion_tokens,
                        finish_name(c->finish_reason));
                fprintf(stderr, "time to first token: %.3f s; %.2f tokens/s after it (%.3f s in all)\n",
                        t_first ? t_first - t0 : 0.0,
                        n_tokens > 1 && t_first ? (double)(n_tokens - 1) / (t - t_first) : 0.0, t - t0);
            }
        } else if (resp->kind_case == STRATA__V1__GENERATE_RESPONSE__KIND_ERROR) {
            got_end = true;
            fprintf(stderr, "\nstrata generate: the server failed the request after %zu tokens: %s: %s\n", n_tokens,
                    proto_grpc_status_name((int)resp->error->code), resp->error->message);
        }
        protobuf_c_message_free_unpacked(&resp->base, NULL);
    }
    if (call) {
        grpc_op op;
        memset(&op, 0, sizeof op);
        op.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
        op.data.recv_status_on_client.trailing_metadata = &trailing;
        op.data.recv_status_on_client.status = &status;
        op.data.recv_status_on_client.status_details = &details;
        if (run_batch(call, cq, &op, 1, &tag_status) && status != GRPC_STATUS_OK) {
            char *msg = grpc_slice_to_c_string(details);
            fprintf(stderr, "%sstrata generate: %s: %s: %s%s\n", n_tokens ? "\n" : "", r->server,
                    proto_grpc_status_name((int)status), msg && *msg ? msg : "(no message)",
                    tls_hint(r->server, r->tls_ca, status, msg));
            gpr_free(msg);
            exit_code = EXIT_RUNTIME;
        } else if (status == GRPC_STATUS_OK && !got_end) {
            fprintf(stderr, "strata generate: %s ended the stream without a result\n", r->server);
        }
    } else {
        fprintf(stderr, "strata generate: cannot create a call to %s\n", r->server);
    }
    if (exit_code == 0)
        fputc('\n', stdout);

    if (call)
        grpc_call_unref(call);
    grpc_slice_unref(details);
    grpc_metadata_array_destroy(&md_in);
    grpc_metadata_array_destroy(&trailing);
    conn_close(&conn);
    return exit_code;
}

/* One unary call on an open channel; *resp is unpacked (free with
 * protobuf_c_message_free_unpacked) when the status is OK. Returns the gRPC status; *details is
 * the status message (gpr_free it). */
static grpc_status_code unary(const remote_conn *c, const char *method, const ProtobufCMessage *req, const ProtobufCMessageDescriptor *resp_desc,
                              ProtobufCMessage **resp, char **details_out)
{
    *resp = NULL;
    *details_out = NULL;
    grpc_byte_buffer *send_bb = NULL, *recv_bb = NULL;
    strata_error err = {0};
    if (proto_pack(req, MAX_RESPONSE_BYTES, &send_bb, &err) != STRATA_OK) {
        *details_out = gpr_strdup(err.msg);
        return GRPC_STATUS_INVALID_ARGUMENT;
    }
    gpr_timespec deadline = gpr_time_add(gpr_now(GPR_CLOCK_REALTIME), gpr_time_from_seconds(30, GPR_TIMESPAN));
    grpc_call *call = grpc_channel_create_call(c->ch, NULL, GRPC_PROPAGATE_DEFAULTS, c->cq,
                                               grpc_slice_from_static_string(method), NULL, deadline, NULL);
    grpc_metadata_array md_in, trailing;
    grpc_metadata_array_init(&md_in);
    grpc_metadata_array_init(&trailing);
    grpc_status_code status = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    grpc_op ops[6];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = c->n_md;
    ops[0].data.send_initial_metadata.metadata = c->n_md ? (grpc_metadata *)&c->md : NULL;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = send_bb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &md_in;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &recv_bb;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &trailing;
    ops[5].data.recv_status_on_client.status = &status;
    ops[5].data.recv_status_on_client.status_details = &details;
    int tag;
    if (!call || !run_batch(call, c->cq, ops, 6, &tag)) {
        status = GRPC_STATUS_UNAVAILABLE;
        details = grpc_slice_from_static_string("the call could not be made");
    }
    if (status == GRPC_STATUS_OK && (!recv_bb || proto_unpack(recv_bb, resp_desc, MAX_RESPONSE_BYTES, resp, &err) !=
                                                     STRATA_OK)) {
        status = GRPC_STATUS_INTERNAL;
        grpc_slice_unref(details);
        details = grpc_slice_from_copied_string(recv_bb ? err.msg : "no response message");
    }
    *details_out = grpc_slice_to_c_string(details);
    grpc_slice_unref(details);
    grpc_byte_buffer_destroy(send_bb);
    grpc_byte_buffer_destroy(recv_bb);
    grpc_metadata_array_destroy(&md_in);
    grpc_metadata_array_destroy(&trailing);
    if (call)
        grpc_call_unref(call);
    return status;
}

int cli_remote_drain(const remote_drain *r)
{
    remote_conn conn;
    if (!conn_open(&conn, "strata drain", r->server, r->token_file, r->tls_ca))
        return EXIT_USAGE;
    Strata__V1__DrainWorkerRequest req = STRATA__V1__DRAIN_WORKER_REQUEST__INIT;
    req.worker_name = (char *)r->worker;
    int exit_code = EXIT_RUNTIME;
    double t0 = strata_mono_s();
    uint32_t last_moved = UINT32_MAX, last_remaining = UINT32_MAX;
    for (;;) {
        Strata__V1__DrainWorkerResponse *resp = NULL;
        char *details = NULL;
        grpc_status_code st = unary(&conn, "/strata.v1.Strata/DrainWorker", &req.base,
                                    &strata__v1__drain_worker_response__descriptor, (ProtobufCMessage **)&resp, &details);
        if (st != GRPC_STATUS_OK) {
            fprintf(stderr, "strata drain: %s: %s: %s%s\n", r->server, proto_grpc_status_name((int)st),
                    details && *details ? details : "(no message)", tls_hint(r->server, r->tls_ca, st, details));
            gpr_free(details);
            break;
        }
        gpr_free(details);
        if (!r->quiet && (resp->moved != last_moved || resp->remaining != last_remaining || resp->done))
            fprintf(stderr, "strata drain: replica %u: %u moved, %u remaining, %u failed\n", resp->replica, resp->moved,
                    resp->remaining, resp->failed);
        last_moved = resp->moved;
        last_remaining = resp->remaining;
        bool done = resp->done;
        if (done) {
            printf("%s\n", resp->message && *resp->message ? resp->message : "drained");
            exit_code = resp->failed ? EXIT_RUNTIME : 0;
        }
        protobuf_c_message_free_unpacked(&resp->base, NULL);
        if (done)
            break;
        if (strata_mono_s() - t0 > r->timeout_s) {
            fprintf(stderr, "strata drain: not done after %d s (the drain goes on in the server; run again to follow "
                    "it)\n", r->timeout_s);
            break;
        }
        struct timespec nap = {0, 200 * 1000000L};
        nanosleep(&nap, NULL);
    }
    conn_close(&conn);
    return exit_code;
}
