/* gRPC C-core helpers: message <-> byte buffer, status mapping, metadata. See grpc_util.h. */
#include "proto/grpc_util.h"

#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer_reader.h>
#include <grpc/slice.h>

int proto_pack(const ProtobufCMessage *msg, size_t max_bytes, grpc_byte_buffer **out, strata_error *err)
{
    if (out)
        *out = NULL;
    if (!msg || !out || !msg->descriptor)
        return strata_fail(err, STRATA_EINVAL, "proto_pack: NULL message or output");
    /* protobuf-c's packer reads repeated-field arrays (and required/optional strings) without
     * checking them for NULL; refuse a message it would crash on rather than crash the server. */
    if (!protobuf_c_message_check(msg))
        return strata_fail(err, STRATA_EINVAL, "%s: inconsistent message (a repeated field with a count but no "
                           "array, or a NULL string or sub-message where one is required)",
                           msg->descriptor->name);
    size_t n = protobuf_c_message_get_packed_size(msg);
    if (n > max_bytes)
        return strata_fail(err, STRATA_EFULL, "%s: encoded message is %zu bytes, above the limit of %zu",
                           msg->descriptor->name, n, max_bytes);
    /* Pack straight into a gRPC-owned slice: no intermediate copy. gpr's allocator aborts on
     * out-of-memory, so there is no NULL to check. */
    grpc_slice slice = grpc_slice_malloc(n);
    size_t packed = n ? protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(slice)) : 0;
    if (packed != n) {
        grpc_slice_unref(slice);
        return strata_fail(err, STRATA_EINVAL, "%s: packed %zu bytes, expected %zu", msg->descriptor->name,
                           packed, n);
    }
    /* The buffer takes its own reference to the slice; drop ours. */
    *out = grpc_raw_byte_buffer_create(&slice, 1);
    grpc_slice_unref(slice);
    return STRATA_OK;
}

/* protobuf-c's default allocator cannot tell "out of memory" from "malformed input" (unpack returns
 * NULL for both). This one remembers a failed allocation so proto_unpack can report ENOMEM. It
 * uses malloc/free, so messages it built are freed with the default allocator (NULL). */
typedef struct unpack_alloc_state {
    bool failed;
} unpack_alloc_state;

static void *unpack_alloc(void *data, size_t size)
{
    void *p = malloc(size ? size : 1);
    if (!p)
        ((unpack_alloc_state *)data)->failed = true;
    return p;
}

static void unpack_free(void *data, void *p)
{
    (void)data;
    free(p);
}

/* Frees the fields m's schema does not know, in m and every message it holds. protobuf-c keeps
 * each one (a record and a copy of its bytes): a 4 MiB request of two-byte unknown fields took
 * about 120 MiB for as long as the request lived. No strata message re-sends a message it
 * decoded, so none needs them. */
static void drop_unknown_fields(ProtobufCMessage *m)
{
    if (!m)
        return;
    for (unsigned i = 0; i < m->n_unknown_fields; i++)
        free(m->unknown_fields[i].data);
    free(m->unknown_fields);
    m->unknown_fields = NULL;
    m->n_unknown_fields = 0;
    const ProtobufCMessageDescriptor *d = m->descriptor;
    uint8_t *base = (uint8_t *)m;
    for (unsigned f = 0; f < d->n_fields; f++) {
        const ProtobufCFieldDescriptor *fd = &d->fields[f];
        if (fd->type != PROTOBUF_C_TYPE_MESSAGE)
            continue;
        if (fd->label == PROTOBUF_C_LABEL_REPEATED) {
            const size_t n = *(const size_t *)(base + fd->quantifier_offset);
            ProtobufCMessage **each = *(ProtobufCMessage ***)(base + fd->offset);
            for (size_t k = 0; k < n; k++)
                drop_unknown_fields(each[k]);
        } else if (!(fd->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) ||
                   *(const uint32_t *)(base + fd->quantifier_offset) == fd->id) {   /* a oneof's member in use */
            drop_unknown_fields(*(ProtobufCMessage **)(base + fd->offset));
        }
    }
}

/* Reads a varint at *at (below end); false when it runs past end or beyond 10 bytes. */
static bool wire_varint(const uint8_t **at, const uint8_t *end, uint64_t *v)
{
    *v = 0;
    for (unsigned shift = 0; shift < 70 && *at < end; shift += 7) {
        const uint8_t b = *(*at)++;
        *v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80))
            return true;
    }
    return false;
}

/* Finds a string field of desc (or of a message it holds) whose bytes on the wire hold a NUL.
 * protobuf-c hands strings over NUL-terminated, so such a string would be cut silently where the
 * NUL is: refused instead. Returns the field's name, or NULL when there is none (or the bytes
 * do not parse: protobuf-c has accepted them before this runs). depth bounds the recursion. */
static const char *string_with_nul(const ProtobufCMessageDescriptor *desc, const uint8_t *at, const uint8_t *end,
                                   int depth)
{
    while (at < end && depth < 64) {
        uint64_t key, n;
        if (!wire_varint(&at, end, &key))
            return NULL;
        switch (key & 7) {
        case 0:
            if (!wire_varint(&at, end, &n))
                return NULL;
            break;
        case 1:
        case 5: {
            const size_t width = (key & 7) == 1 ? 8 : 4;
            if ((size_t)(end - at) < width)
                return NULL;
            at += width;
            break;
        }
        case 2: {
            if (!wire_varint(&at, end, &n) || n > (uint64_t)(end - at))
                return NULL;
            const ProtobufCFieldDescriptor *fd =
                key >> 3 <= UINT32_MAX ? protobuf_c_message_descriptor_get_field(desc, (unsigned)(key >> 3)) : NULL;
            if (fd && fd->type == PROTOBUF_C_TYPE_STRING && memchr(at, 0, (size_t)n))
                return fd->name;
            if (fd && fd->type == PROTOBUF_C_TYPE_MESSAGE) {
                const char *found = string_with_nul(fd->descriptor, at, at + n, depth + 1);
                if (found)
                    return found;
            }
            at += n;
            break;
        }
        default:
            return NULL;
        }
    }
    return NULL;
}

int proto_unpack_bytes(const void *data, size_t len, const ProtobufCMessageDescriptor *desc, size_t max_bytes,
                       ProtobufCMessage **out, strata_error *err)
{
    if (out)
        *out = NULL;
    if (!desc || !out || (!data && len))
        return strata_fail(err, STRATA_EINVAL, "proto_unpack: NULL descriptor, output or data");
    if (len > max_bytes)
        return strata_fail(err, STRATA_EFULL, "%s: message of %zu bytes is above the limit of %zu", desc->name,
                           len, max_bytes);
    unpack_alloc_state st = {false};
    ProtobufCAllocator alloc = {unpack_alloc, unpack_free, &st};
    /* protobuf-c reads at most len bytes and never writes them; an empty encoding is valid. */
    static const uint8_t empty[1] = {0};
    ProtobufCMessage *m = protobuf_c_message_unpack(desc, &alloc, len, len ? (const uint8_t *)data : empty);
    if (!m) {
        if (st.failed)
            return strata_fail(err, STRATA_ENOMEM, "%s: out of memory decoding %zu bytes", desc->name, len);
        return strata_fail(err, STRATA_EFORMAT, "%s: malformed message (%zu bytes)", desc->name, len);
    }
    const char *nul = len ? string_with_nul(desc, data, (const uint8_t *)data + len, 0) : NULL;
    if (nul) {
        protobuf_c_message_free_unpacked(m, &alloc);
        return strata_fail(err, STRATA_EINVAL, "%s: field %s contains a NUL byte (U+0000), which no text field "
                           "accepts", desc->name, nul);
    }
    drop_unknown_fields(m);
    *out = m;
    return STRATA_OK;
}

int proto_unpack(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *desc, size_t max_bytes,
                 ProtobufCMessage **out, strata_error *err)
{
    if (out)
        *out = NULL;
    if (!bb || !desc || !out)
        return strata_fail(err, STRATA_EINVAL, "proto_unpack: NULL byte buffer, descriptor or output");
    /* Reject early on the wire size, before copying anything (a compressed buffer is checked
     * again after decompression below). */
    size_t wire = grpc_byte_buffer_length(bb);
    if (wire > max_bytes)
        return strata_fail(err, STRATA_EFULL, "%s: message of %zu bytes is above the limit of %zu", desc->name,
                           wire, max_bytes);
    grpc_byte_buffer_reader reader;
    if (!grpc_byte_buffer_reader_init(&reader, bb))
        return strata_fail(err, STRATA_EFORMAT, "%s: cannot read the message (bad compression)", desc->name);
    /* One contiguous copy: protobuf-c parses from a flat array. Our servers accept no compressed
     * message (gRPC inflates one whole before its receive limit applies: a 3.5 MB request became
     * 3.8 GB); were one to come, the check inside proto_unpack_bytes repeats ours on the real
     * length. */
    grpc_slice all = grpc_byte_buffer_reader_readall(&reader);
    grpc_byte_buffer_reader_destroy(&reader);
    int rc = proto_unpack_bytes(GRPC_SLICE_START_PTR(all), GRPC_SLICE_LENGTH(all), desc, max_bytes, out, err);
    grpc_slice_unref(all);
    return rc;
}

grpc_status_code proto_grpc_status(int strata_status)
{
    switch (strata_status) {
    case STRATA_OK: return GRPC_STATUS_OK;
    case STRATA_EINVAL: return GRPC_STATUS_INVALID_ARGUMENT;
    case STRATA_ENOMEM: return GRPC_STATUS_RESOURCE_EXHAUSTED;
    case STRATA_EFULL: return GRPC_STATUS_RESOURCE_EXHAUSTED;
    /* Storage, network and worker failures are not the request's fault and the service may well
     * succeed on a retry (another worker, a recomputed KV): UNAVAILABLE, the code gRPC clients
     * retry. A CRC failure is corruption of *our* copy of the KV, not lost user data, so it is
     * not DATA_LOSS either. */
    case STRATA_EIO: return GRPC_STATUS_UNAVAILABLE;
    case STRATA_ECRC: return GRPC_STATUS_UNAVAILABLE;
    case STRATA_EFORMAT: return GRPC_STATUS_INTERNAL;
    case STRATA_EUNSUPPORTED: return GRPC_STATUS_UNIMPLEMENTED;
    default: return GRPC_STATUS_UNKNOWN;
    }
}

const char *proto_grpc_status_name(int code)
{
    static const char *const names[] = {
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    };
    if (code < 0 || (size_t)code >= sizeof names / sizeof names[0])
        return "UNKNOWN_STATUS_CODE";
    return names[code];
}

static int ascii_lower(int c)
{
    return c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c;
}

/* ASCII case-insensitive comparison of a (not NUL-terminated) with the C string b. */
static bool ascii_ieq(const char *a, size_t alen, const char *b)
{
    size_t blen = strlen(b);
    if (alen != blen)
        return false;
    for (size_t i = 0; i < alen; i++)
        if (ascii_lower((unsigned char)a[i]) != ascii_lower((unsigned char)b[i]))
            return false;
    return true;
}

size_t proto_metadata_find(const grpc_metadata_array *md, const char *key, const char **value, size_t *len)
{
    if (value)
        *value = NULL;
    if (len)
        *len = 0;
    if (!md || !key)
        return 0;
    size_t found = 0;
    for (size_t i = 0; i < md->count; i++) {
        const grpc_slice *k = &md->metadata[i].key;
        if (!ascii_ieq((const char *)GRPC_SLICE_START_PTR(*k), GRPC_SLICE_LENGTH(*k), key))
            continue;
        if (found++ == 0) {
            const grpc_slice *v = &md->metadata[i].value;
            if (value)
                *value = (const char *)GRPC_SLICE_START_PTR(*v);
            if (len)
                *len = GRPC_SLICE_LENGTH(*v);
        }
    }
    return found;
}

bool proto_secret_equal(const void *got, size_t got_len, const void *expected, size_t expected_len)
{
    const unsigned char *g = got, *e = expected;
    if (!g)
        got_len = 0;
    /* Accumulate every difference instead of returning at the first: the loop always runs
     * expected_len times, so timing reveals neither where a guess went wrong nor got's length.
     * volatile keeps the compiler from turning it back into an early exit. */
    volatile unsigned char diff = 0;
    for (size_t i = 0; i < expected_len; i++) {
        unsigned char gi = i < got_len ? g[i] : 0;
        diff |= (unsigned char)(gi ^ e[i]);
    }
    return diff == 0 && got_len == expected_len;
}

bool proto_bearer_ok(const grpc_metadata_array *md, const char *token, const char **why)
{
    const char *dummy;
    if (!why)
        why = &dummy;
    if (!token || !*token) {
        *why = "no bearer token is configured";
        return false;
    }
    const char *v;
    size_t n;
    size_t count = proto_metadata_find(md, "authorization", &v, &n);
    if (count == 0) {
        *why = "missing authorization metadata (expected \"Bearer <token>\")";
        return false;
    }
    if (count > 1) {
        *why = "more than one authorization metadata entry";
        return false;
    }
    static const char scheme[] = "bearer ";
    const size_t slen = sizeof scheme - 1;
    if (n < slen || !ascii_ieq(v, slen, scheme)) {
        *why = "authorization metadata is not \"Bearer <token>\"";
        return false;
    }
    if (!proto_secret_equal(v + slen, n - slen, token, strlen(token))) {
        *why = "bearer token does not match";
        return false;
    }
    *why = NULL;
    return true;
}
