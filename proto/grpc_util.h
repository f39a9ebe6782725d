/* Small helpers between protobuf-c messages and the gRPC C core.
 *
 *  - proto_pack / proto_unpack: a protobuf-c message <-> a grpc_byte_buffer (what a
 *    GRPC_OP_SEND_MESSAGE / GRPC_OP_RECV_MESSAGE batch carries), with a size limit on both
 *    sides and errors instead of crashes on malformed bytes.
 *  - proto_grpc_status: the gRPC status code for a strata status code (table in proto/README.md).
 *  - proto_metadata_find / proto_bearer_ok: read a call's request metadata and check an
 *    "authorization: Bearer <token>" header in constant time.
 *
 * Generated message types are included as "proto/strata.pb-c.h" and
 * "proto/strata_internal.pb-c.h" (generated into the build tree, see proto/CMakeLists.txt).
 * No global state; every function is safe to call from any thread. The byte-buffer functions
 * allocate through gRPC (which aborts on out-of-memory, its own policy) and protobuf-c. */
#ifndef STRATA_PROTO_GRPC_UTIL_H
#define STRATA_PROTO_GRPC_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <grpc/byte_buffer.h>
#include <grpc/grpc.h>
#include <grpc/status.h>
#include <protobuf-c/protobuf-c.h>

#include "kvstore/error.h"

/* gRPC's default limit on a received message (4 MiB); a sensible max_bytes for public calls. */
#define PROTO_DEFAULT_MAX_MESSAGE_BYTES ((size_t)4 << 20)

/* Serializes msg into a new byte buffer (*out; release it with grpc_byte_buffer_destroy, or hand
 * it to a send-message op and destroy it after the batch completes). Fails with STRATA_EINVAL
 * for a NULL argument or a message that protobuf_c_message_check rejects (e.g. a repeated
 * field with a count but a NULL array; proto3 strings may be NULL, they pack as empty), STRATA_EFULL when the encoding would exceed
 * max_bytes. *out is NULL on failure. */
int proto_pack(const ProtobufCMessage *msg, size_t max_bytes, grpc_byte_buffer **out, strata_error *err);

/* Parses the bytes of bb (decompressing them if gRPC left them compressed) as a message of type
 * desc, e.g. &strata__v1__generate_request__descriptor. *out receives the message; free it with
 * protobuf_c_message_free_unpacked(*out, NULL). Fails with STRATA_EFULL when the message is larger
 * than max_bytes, STRATA_EFORMAT for bytes that are not a valid encoding (truncated, bad wire
 * type, bad length, bad varint), STRATA_ENOMEM when allocation fails, STRATA_EINVAL for NULL
 * arguments or a string field (at any depth) holding a NUL byte (the decoded string would end
 * there). *out is NULL on failure. bb is not modified or freed. Fields the schema does not know
 * are dropped (protobuf-c would keep a copy of each). */
int proto_unpack(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *desc, size_t max_bytes,
                 ProtobufCMessage **out, strata_error *err);

/* proto_unpack over plain bytes (files, tests, non-gRPC transports). data may be NULL when len
 * is 0 (the empty encoding: every field at its default). */
int proto_unpack_bytes(const void *data, size_t len, const ProtobufCMessageDescriptor *desc, size_t max_bytes,
                       ProtobufCMessage **out, strata_error *err);

/* The gRPC status for a strata status code:
 *   STRATA_OK           GRPC_STATUS_OK
 *   STRATA_EINVAL       GRPC_STATUS_INVALID_ARGUMENT      the caller's input is wrong
 *   STRATA_ENOMEM       GRPC_STATUS_RESOURCE_EXHAUSTED    out of memory (retry later)
 *   STRATA_EFULL        GRPC_STATUS_RESOURCE_EXHAUSTED    a fixed capacity is used up
 *   STRATA_EIO          GRPC_STATUS_UNAVAILABLE           a disk, socket or worker failed: the
 *   STRATA_ECRC         GRPC_STATUS_UNAVAILABLE           request is fine and a retry can succeed
 *   STRATA_EFORMAT      GRPC_STATUS_INTERNAL              malformed bytes (as gRPC itself reports
 *                                                         an unparsable message)
 *   STRATA_EUNSUPPORTED GRPC_STATUS_UNIMPLEMENTED         valid but not supported by this build
 *   anything else       GRPC_STATUS_UNKNOWN */
grpc_status_code proto_grpc_status(int strata_status);

/* Upper-case name of a gRPC status code ("INVALID_ARGUMENT"); "UNKNOWN_STATUS_CODE" outside 0..16. */
const char *proto_grpc_status_name(int code);

/* Looks up key (ASCII case-insensitive; gRPC delivers keys in lower case) in md. Returns how many
 * entries have that key; when at least one does and value/len are non-NULL, they receive the
 * first entry's value (not NUL-terminated, owned by md). */
size_t proto_metadata_find(const grpc_metadata_array *md, const char *key, const char **value, size_t *len);

/* true when md holds exactly one "authorization" entry whose value is "Bearer <token>" (scheme
 * case-insensitive, one space, token compared in time independent of where it differs). An empty
 * or NULL token never matches: "no token configured" is the caller's decision. On false, *why
 * (when non-NULL) receives a static reason for the UNAUTHENTICATED status message; it never
 * contains the token. */
bool proto_bearer_ok(const grpc_metadata_array *md, const char *token, const char **why);

/* Constant-time equality of two byte strings: the time depends on expected_len only, not on
 * got's contents or length. Used for bearer tokens and the cluster secret. expected must be
 * non-NULL when expected_len > 0; got may be NULL (compared as empty). */
bool proto_secret_equal(const void *got, size_t got_len, const void *expected, size_t expected_len);

#endif
