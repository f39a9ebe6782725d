/* A minimal gRPC C-core client for the tests of the public API (test_server, test_coord): one
 * call, its request sent and half-closed, every response handed to a callback, then the status.
 * Blocking, one completion queue per call. Callable from any thread: a failure of the transport
 * itself aborts the test binary with the condition, since a cmocka assert may only fail on the
 * test's own thread (it jumps back into the test function). */
#ifndef STRATA_TESTS_API_CLIENT_H
#define STRATA_TESTS_API_CLIENT_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>

#include "proto/grpc_util.h"

#define API_CLIENT_REQUIRE(cond)                                                                  \
    do {                                                                                          \
        if (!(cond)) {                                                                            \
            fprintf(stderr, "%s:%d: api_client: %s does not hold\n", __FILE__, __LINE__, #cond); \
            abort();                                                                              \
        }                                                                                         \
    } while (0)

/* Takes ownership of m (free it with protobuf_c_message_free_unpacked). */
typedef void (*api_client_on_response)(void *user, ProtobufCMessage *m);

static inline void api_client_pluck(grpc_completion_queue *cq, void *tag)
{
    grpc_event ev = grpc_completion_queue_pluck(cq, tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    API_CLIENT_REQUIRE(ev.type == GRPC_OP_COMPLETE);
}

/* Calls method with the packed request msg (NULL: an empty message) under a timeout_ms deadline;
 * each response is unpacked with resp_desc and given to on_response; the call's status and its
 * details come back in *status and details. */
static inline void api_client_call_bytes(grpc_channel *ch, const char *method, grpc_byte_buffer *send, int timeout_ms,
                                         const ProtobufCMessageDescriptor *resp_desc,
                                         api_client_on_response on_response, void *user, grpc_status_code *status,
                                         char *details, size_t details_cap);

static inline void api_client_call(grpc_channel *ch, const char *method, const ProtobufCMessage *msg, int timeout_ms,
                                   const ProtobufCMessageDescriptor *resp_desc, api_client_on_response on_response,
                                   void *user, grpc_status_code *status, char *details, size_t details_cap)
{
    grpc_byte_buffer *send = NULL;
    if (msg)
        API_CLIENT_REQUIRE(proto_pack(msg, 1 << 20, &send, NULL) == STRATA_OK);
    else
        send = grpc_raw_byte_buffer_create(NULL, 0);
    api_client_call_bytes(ch, method, send, timeout_ms, resp_desc, on_response, user, status, details, details_cap);
}

/* The same with the request's bytes as they are (a malformed message, say). */
static inline void api_client_call_raw(grpc_channel *ch, const char *method, const void *bytes, size_t len,
                                       int timeout_ms, const ProtobufCMessageDescriptor *resp_desc,
                                       api_client_on_response on_response, void *user, grpc_status_code *status,
                                       char *details, size_t details_cap)
{
    grpc_slice slice = grpc_slice_from_copied_buffer(bytes, len);
    grpc_byte_buffer *send = grpc_raw_byte_buffer_create(&slice, 1);
    grpc_slice_unref(slice);
    api_client_call_bytes(ch, method, send, timeout_ms, resp_desc, on_response, user, status, details, details_cap);
}

/* Sends send (and takes it). */
static inline void api_client_call_bytes(grpc_channel *ch, const char *method, grpc_byte_buffer *send, int timeout_ms,
                                         const ProtobufCMessageDescriptor *resp_desc,
                                         api_client_on_response on_response, void *user, grpc_status_code *status,
                                         char *details, size_t details_cap)
{
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    gpr_timespec deadline = gpr_time_add(gpr_now(GPR_CLOCK_REALTIME), gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
    grpc_call *c = grpc_channel_create_call(ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq, grpc_slice_from_static_string(method),
                                            NULL, deadline, NULL);
    API_CLIENT_REQUIRE(c != NULL);
    grpc_metadata_array md_in, trailing;
    grpc_metadata_array_init(&md_in);
    grpc_metadata_array_init(&trailing);
    grpc_op ops[4];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = send;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &md_in;
    API_CLIENT_REQUIRE(grpc_call_start_batch(c, ops, 4, (void *)1, NULL) == GRPC_CALL_OK);
    api_client_pluck(cq, (void *)1);
    for (;;) {
        grpc_byte_buffer *bb = NULL;
        grpc_op op;
        memset(&op, 0, sizeof op);
        op.op = GRPC_OP_RECV_MESSAGE;
        op.data.recv_message.recv_message = &bb;
        API_CLIENT_REQUIRE(grpc_call_start_batch(c, &op, 1, (void *)2, NULL) == GRPC_CALL_OK);
        api_client_pluck(cq, (void *)2);
        if (!bb)
            break;
        ProtobufCMessage *m = NULL;
        API_CLIENT_REQUIRE(proto_unpack(bb, resp_desc, 1 << 20, &m, NULL) == STRATA_OK);
        grpc_byte_buffer_destroy(bb);
        on_response(user, m);
    }
    grpc_slice slice;
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    op.data.recv_status_on_client.trailing_metadata = &trailing;
    op.data.recv_status_on_client.status = status;
    op.data.recv_status_on_client.status_details = &slice;
    API_CLIENT_REQUIRE(grpc_call_start_batch(c, &op, 1, (void *)3, NULL) == GRPC_CALL_OK);
    api_client_pluck(cq, (void *)3);
    snprintf(details, details_cap, "%.*s", (int)GRPC_SLICE_LENGTH(slice), (const char *)GRPC_SLICE_START_PTR(slice));
    grpc_slice_unref(slice);
    grpc_metadata_array_destroy(&md_in);
    grpc_metadata_array_destroy(&trailing);
    grpc_byte_buffer_destroy(send);
    grpc_call_unref(c);
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type != GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq);
}

/* An insecure channel to 127.0.0.1:port. */
static inline grpc_channel *api_client_channel(int port)
{
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", port);
    grpc_channel_credentials *creds = grpc_insecure_credentials_create();
    grpc_channel *ch = grpc_channel_create(target, creds, NULL);
    grpc_channel_credentials_release(creds);
    return ch;
}

#endif
