/* The backend-independent half of the data plane: header rules, the 64-byte frame header codec,
 * the pending-payload state of two-step receives, and broken links. The backends
 * (transport_tcp.c, transport_nccl.c) only move bytes. */
#include "worker/transport/transport.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvstore/bytes.h"
#include "kvstore/crc32c.h"
#include "worker/transport/transport_impl.h"

/* Frame header layout (little-endian), see README.md. */
enum {
    F_MAGIC = 0,        /* "SDP1" */
    F_VERSION = 4,      /* u16 */
    F_KIND = 6,         /* u16 */
    F_DTYPE = 8,        /* u16 */
    F_FLAGS = 10,       /* u16 */
    F_LAYER = 12,       /* u32 */
    F_STEP = 16,        /* u64 */
    F_SEQ = 24,         /* u64 */
    F_NROWS = 32,       /* u32 */
    F_ROWBYTES = 36,    /* u32 */
    F_PAYLOAD_LEN = 40, /* u64 */
    F_PAYLOAD_CRC = 48, /* u32 */
    F_RESERVED = 52,    /* 8 bytes, zero */
    F_HEADER_CRC = 60,  /* u32: CRC32C of bytes 0..59 */
};
static const uint8_t frame_magic[4] = {'S', 'D', 'P', '1'};
#define KNOWN_FLAGS DP_FLAG_PAYLOAD_CRC

const char *dp_kind_name(unsigned kind)
{
    switch (kind) {
    case DP_MSG_HIDDEN: return "HIDDEN";
    case DP_MSG_KV_BLOCK: return "KV_BLOCK";
    case DP_MSG_KV_TAIL: return "KV_TAIL";
    case DP_MSG_CONTROL: return "CONTROL";
    case DP_MSG_END: return "END";
    default: return "kind?";
    }
}

static unsigned dtype_size(unsigned dtype)
{
    switch (dtype) {
    case DP_DTYPE_F32: return 4;
    case DP_DTYPE_F16: return 2;
    case DP_DTYPE_BF16: return 2;
    default: return 1;
    }
}

/* The rules of dp_msg_header; code is EINVAL on send, EFORMAT on receive. */
static int check_header(const dp_msg_header *h, uint64_t payload_len, int code, strata_error *err)
{
    if (h->kind < 1 || h->kind > DP_MSG_KIND_MAX)
        return strata_fail(err, code, "data plane: unknown message kind %u", (unsigned)h->kind);
    if (h->dtype > DP_DTYPE_MAX)
        return strata_fail(err, code, "data plane: unknown dtype %u in a %s message",
                           (unsigned)h->dtype, dp_kind_name(h->kind));
    if (h->row_bytes != 0 && (uint64_t)h->n_rows * h->row_bytes != payload_len)
        return strata_fail(err, code,
                           "data plane: %s message of %" PRIu64 " bytes does not hold %u rows of %u bytes",
                           dp_kind_name(h->kind), payload_len, (unsigned)h->n_rows,
                           (unsigned)h->row_bytes);
    if (h->kind == DP_MSG_HIDDEN) {
        if (h->dtype == DP_DTYPE_BYTES)
            return strata_fail(err, code, "data plane: HIDDEN message needs a float dtype (f32, f16, bf16)");
        if (h->row_bytes == 0 || h->row_bytes % dtype_size(h->dtype) != 0)
            return strata_fail(err, code,
                               "data plane: HIDDEN row of %u bytes is not a whole number of %u-byte elements",
                               (unsigned)h->row_bytes, dtype_size(h->dtype));
    }
    return STRATA_OK;
}

int dp_frame_encode(const dp_msg_header *h, uint64_t payload_len, uint32_t payload_crc,
                    uint16_t flags, uint8_t out[DP_FRAME_HEADER_BYTES], strata_error *err)
{
    if (!h || !out)
        return strata_fail(err, STRATA_EINVAL, "data plane: NULL header");
    if (flags & ~KNOWN_FLAGS)
        return strata_fail(err, STRATA_EINVAL, "data plane: unknown frame flags 0x%x", (unsigned)flags);
    int rc = check_header(h, payload_len, STRATA_EINVAL, err);
    if (rc != STRATA_OK)
        return rc;
    memset(out, 0, DP_FRAME_HEADER_BYTES);
    memcpy(out + F_MAGIC, frame_magic, 4);
    kv_st16(out + F_VERSION, DP_FRAME_VERSION);
    kv_st16(out + F_KIND, h->kind);
    kv_st16(out + F_DTYPE, h->dtype);
    kv_st16(out + F_FLAGS, flags);
    kv_st32(out + F_LAYER, h->layer);
    kv_st64(out + F_STEP, h->step);
    kv_st64(out + F_SEQ, h->seq);
    kv_st32(out + F_NROWS, h->n_rows);
    kv_st32(out + F_ROWBYTES, h->row_bytes);
    kv_st64(out + F_PAYLOAD_LEN, payload_len);
    kv_st32(out + F_PAYLOAD_CRC, payload_crc);
    kv_st32(out + F_HEADER_CRC, kv_crc32c(0, out, F_HEADER_CRC));
    return STRATA_OK;
}

int dp_frame_decode(const uint8_t in[DP_FRAME_HEADER_BYTES], uint64_t max_payload,
                    dp_msg_header *out, strata_error *err)
{
    if (!in || !out)
        return strata_fail(err, STRATA_EINVAL, "data plane: NULL frame header");
    if (memcmp(in + F_MAGIC, frame_magic, 4) != 0)
        return strata_fail(err, STRATA_EFORMAT,
                           "data plane: bad frame magic %02x %02x %02x %02x (expected \"SDP1\")",
                           in[0], in[1], in[2], in[3]);
    uint16_t version = kv_ld16(in + F_VERSION);
    if (version != DP_FRAME_VERSION)
        return strata_fail(err, STRATA_EFORMAT, "data plane: frame version %u, this build speaks %u",
                           (unsigned)version, DP_FRAME_VERSION);
    uint32_t want = kv_ld32(in + F_HEADER_CRC), got = kv_crc32c(0, in, F_HEADER_CRC);
    if (want != got)
        return strata_fail(err, STRATA_ECRC,
                           "data plane: frame header CRC32C mismatch (header says %08x, bytes give %08x)",
                           want, got);
    for (int i = F_RESERVED; i < F_HEADER_CRC; i++)
        if (in[i] != 0)
            return strata_fail(err, STRATA_EFORMAT, "data plane: reserved frame header byte %d is %u, not 0",
                               i, in[i]);
    dp_msg_header h = {
        .kind = kv_ld16(in + F_KIND),
        .dtype = kv_ld16(in + F_DTYPE),
        .flags = kv_ld16(in + F_FLAGS),
        .layer = kv_ld32(in + F_LAYER),
        .step = kv_ld64(in + F_STEP),
        .seq = kv_ld64(in + F_SEQ),
        .n_rows = kv_ld32(in + F_NROWS),
        .row_bytes = kv_ld32(in + F_ROWBYTES),
        .payload_len = kv_ld64(in + F_PAYLOAD_LEN),
        .payload_crc = kv_ld32(in + F_PAYLOAD_CRC),
    };
    if (h.flags & ~KNOWN_FLAGS)
        return strata_fail(err, STRATA_EFORMAT, "data plane: unknown frame flags 0x%x", (unsigned)h.flags);
    if (h.payload_len > max_payload)
        return strata_fail(err, STRATA_EFORMAT,
                           "data plane: %s frame announces a payload of %" PRIu64
                           " bytes, over this link's maximum of %" PRIu64,
                           dp_kind_name(h.kind), h.payload_len, max_payload);
    int rc = check_header(&h, h.payload_len, STRATA_EFORMAT, err);
    if (rc != STRATA_OK)
        return rc;
    *out = h;
    return STRATA_OK;
}

/* ---- links ---- */

int64_t dp_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* cannot fail for CLOCK_MONOTONIC */
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int64_t dp_deadline(int timeout_ms) { return timeout_ms < 0 ? -1 : dp_now_ms() + timeout_ms; }

void dp_link_init_common(dp_link *link, int backend, const dp_ops *ops, const dp_options *opts)
{
    memset(link, 0, sizeof *link);
    link->backend = backend;
    link->ops = ops;
    link->fd = -1;
    link->max_payload = opts && opts->max_payload ? opts->max_payload : DP_DEFAULT_MAX_PAYLOAD;
    link->peer_max_payload = link->max_payload;
    link->io_timeout_ms = opts && opts->io_timeout_ms ? opts->io_timeout_ms : DP_DEFAULT_IO_TIMEOUT_MS;
    pthread_mutex_init(&link->broken_lock, NULL); /* default attributes: cannot fail on Linux */
}

int dp_link_break(dp_link *link, strata_error *err)
{
    pthread_mutex_lock(&link->broken_lock);
    if (link->broken[0] == '\0')
        snprintf(link->broken, sizeof link->broken, "%s", err->msg);
    pthread_mutex_unlock(&link->broken_lock);
    return err->code; /* pending is left as is: a broken link refuses every call anyway */
}

/* Copies the reason the link broke into out (empty while usable). */
static void broken_reason(dp_link *link, char *out, size_t cap)
{
    pthread_mutex_lock(&link->broken_lock);
    snprintf(out, cap, "%s", link->broken);
    pthread_mutex_unlock(&link->broken_lock);
}

/* Runs a backend call with a local error so that the message survives a NULL err. */
static int finish(strata_error *local, strata_error *err, int rc)
{
    if (rc != STRATA_OK && err)
        *err = *local;
    return rc;
}

static int check_usable(dp_link *link, strata_error *err)
{
    if (!link)
        return strata_fail(err, STRATA_EINVAL, "data plane: NULL link");
    char why[sizeof link->broken];
    broken_reason(link, why, sizeof why);
    if (why[0])
        return strata_fail(err, STRATA_EIO, "data plane (%s): link unusable after an earlier error: %s",
                           link->desc, why);
    return STRATA_OK;
}

int dp_send(dp_link *link, const dp_msg_header *h, const void *payload, size_t len, strata_error *err)
{
    int rc = check_usable(link, err);
    if (rc != STRATA_OK)
        return rc;
    if (!h)
        return strata_fail(err, STRATA_EINVAL, "data plane: NULL header");
    if (len > 0 && !payload)
        return strata_fail(err, STRATA_EINVAL, "data plane: NULL payload of %zu bytes", len);
    if ((uint64_t)len > link->peer_max_payload)
        return strata_fail(err, STRATA_EINVAL,
                           "data plane (%s): %s payload of %zu bytes is over the peer's maximum of %" PRIu64,
                           link->desc, dp_kind_name(h->kind), len, link->peer_max_payload);
    rc = check_header(h, len, STRATA_EINVAL, err);
    if (rc != STRATA_OK)
        return rc;
    strata_error local = {0};
    return finish(&local, err, link->ops->send(link, h, payload, len, &local));
}

int dp_recv_header(dp_link *link, dp_msg_header *h, int timeout_ms, strata_error *err)
{
    int rc = check_usable(link, err);
    if (rc != STRATA_OK)
        return rc;
    if (!h)
        return strata_fail(err, STRATA_EINVAL, "data plane: NULL header");
    if (link->pending)
        return strata_fail(err, STRATA_EINVAL,
                           "data plane (%s): the %" PRIu64 "-byte payload of the previous %s message is "
                           "pending (dp_recv_payload or dp_recv_skip first)",
                           link->desc, link->pending_h.payload_len, dp_kind_name(link->pending_h.kind));
    strata_error local = {0};
    uint8_t bytes[DP_FRAME_HEADER_BYTES];
    rc = link->ops->recv_header(link, bytes, timeout_ms, &local);
    if (rc != STRATA_OK)
        return finish(&local, err, rc);
    dp_msg_header got;
    rc = dp_frame_decode(bytes, link->max_payload, &got, &local);
    if (rc == STRATA_OK && link->backend == DP_BACKEND_TCP && !(got.flags & DP_FLAG_PAYLOAD_CRC))
        rc = strata_fail(&local, STRATA_EFORMAT, "data plane: TCP frame without a payload CRC");
    if (rc != STRATA_OK) {
        strata_error_prefix(&local, "data plane (%s)", link->desc);
        return finish(&local, err, dp_link_break(link, &local));
    }
    *h = got;
    link->pending_h = got;
    link->pending = got.payload_len > 0;
    return STRATA_OK;
}

static int too_small(const dp_link *link, size_t cap, strata_error *err)
{
    return strata_fail(err, STRATA_EFULL,
                       "data plane (%s): %s payload of %" PRIu64 " bytes does not fit a %zu-byte buffer "
                       "(still pending: dp_recv_payload with a larger buffer, or dp_recv_skip)",
                       link->desc, dp_kind_name(link->pending_h.kind), link->pending_h.payload_len, cap);
}

static int recv_pending(dp_link *link, void *buf, size_t cap, strata_error *err)
{
    int rc = check_usable(link, err);
    if (rc != STRATA_OK)
        return rc;
    if (!link->pending)
        return buf ? strata_fail(err, STRATA_EINVAL, "data plane (%s): no payload is pending", link->desc)
                   : STRATA_OK;
    if (buf && link->pending_h.payload_len > (uint64_t)cap)
        return too_small(link, cap, err);
    strata_error local = {0};
    rc = link->ops->recv_payload(link, buf, &local);
    if (rc == STRATA_OK)
        link->pending = 0;
    return finish(&local, err, rc);
}

int dp_recv_payload(dp_link *link, void *buf, size_t cap, strata_error *err)
{
    if (!buf)
        return strata_fail(err, STRATA_EINVAL, "data plane: NULL payload buffer");
    return recv_pending(link, buf, cap, err);
}

int dp_recv_skip(dp_link *link, strata_error *err) { return recv_pending(link, NULL, 0, err); }

int dp_recv(dp_link *link, dp_msg_header *h, void *buf, size_t cap, size_t *len, int timeout_ms,
            strata_error *err)
{
    if (!len)
        return strata_fail(err, STRATA_EINVAL, "data plane: NULL length");
    *len = 0;
    int rc = dp_recv_header(link, h, timeout_ms, err);
    if (rc != STRATA_OK)
        return rc;
    *len = (size_t)h->payload_len;
    if (h->payload_len == 0)
        return STRATA_OK;
    if (h->payload_len > (uint64_t)cap)
        return too_small(link, cap, err); /* the payload stays pending */
    if (!buf)
        return strata_fail(err, STRATA_EINVAL, "data plane: NULL payload buffer");
    return recv_pending(link, buf, cap, err);
}

void dp_link_close(dp_link *link)
{
    if (!link)
        return;
    link->ops->close(link);
    pthread_mutex_destroy(&link->broken_lock);
    free(link);
}

const char *dp_link_describe(const dp_link *link) { return link ? link->desc : "(null link)"; }
int dp_link_backend(const dp_link *link) { return link ? link->backend : 0; }
const char *dp_link_broken(const dp_link *link)
{
    if (!link)
        return NULL;
    /* Written once: after the lock, the text no longer changes. */
    pthread_mutex_lock((pthread_mutex_t *)&link->broken_lock);
    int set = link->broken[0] != '\0';
    pthread_mutex_unlock((pthread_mutex_t *)&link->broken_lock);
    return set ? link->broken : NULL;
}
int dp_link_fd(const dp_link *link) { return link ? link->fd : -1; }
uint64_t dp_link_peer_max_payload(const dp_link *link) { return link ? link->peer_max_payload : 0; }

/* The upgrade's two CONTROL messages on the TCP link: the offer (u32 magic, u32 1 when the
 * upstream side can, then the unique id when it can) and the answer (u32 magic, u32 1 to take). */
#define UPGRADE_OFFER 0x4f4c434eu  /* "NCLO" */
#define UPGRADE_ANSWER 0x414c434eu /* "NCLA" */
#define UPGRADE_TIMEOUT_MS 60000

static int upgrade_recv(dp_link *tcp, uint32_t magic, uint8_t *buf, size_t cap, size_t *len, strata_error *err)
{
    dp_msg_header h;
    int rc = dp_recv(tcp, &h, buf, cap, len, UPGRADE_TIMEOUT_MS, err);
    if (rc == STRATA_EFULL)
        return strata_fail(err, STRATA_EFORMAT, "data plane (%s): an NCCL %s of %zu bytes (at most %zu)", tcp->desc,
                           magic == UPGRADE_OFFER ? "offer" : "answer", *len, cap);
    if (rc != STRATA_OK)
        return strata_error_prefix(err, "data plane: agreeing on NCCL");
    if (h.kind != DP_MSG_CONTROL || *len < 8 || kv_ld32(buf) != magic || kv_ld32(buf + 4) > 1)
        return strata_fail(err, STRATA_EFORMAT, "data plane (%s): expected the peer's NCCL %s, got a %s message",
                           tcp->desc, magic == UPGRADE_OFFER ? "offer" : "answer", dp_kind_name(h.kind));
    return STRATA_OK;
}

int dp_nccl_upgrade(dp_link *tcp, bool upstream, int cuda_device, const dp_options *opts, dp_link **nccl,
                    strata_error *err)
{
    if (!tcp || !nccl)
        return strata_fail(err, STRATA_EINVAL, "dp_nccl_upgrade: NULL argument");
    *nccl = NULL;
    uint8_t msg[8 + DP_NCCL_ID_BYTES];
    size_t len = 0;
    const dp_msg_header ctl = {.kind = DP_MSG_CONTROL, .dtype = DP_DTYPE_BYTES};
    int rc;
    if (upstream) {
        size_t id_len = DP_NCCL_ID_BYTES;
        /* No device, or no NCCL in this build: offer nothing (the rows go over TCP). */
        const bool can = cuda_device >= 0 && dp_nccl_unique_id(msg + 8, &id_len, NULL) == STRATA_OK;
        kv_st32(msg, UPGRADE_OFFER);
        kv_st32(msg + 4, can ? 1u : 0u);
        uint8_t answer[8];
        if ((rc = dp_send(tcp, &ctl, msg, can ? sizeof msg : 8, err)) != STRATA_OK ||
            (rc = upgrade_recv(tcp, UPGRADE_ANSWER, answer, sizeof answer, &len, err)) != STRATA_OK)
            return rc;
        if (!can || kv_ld32(answer + 4) != 1)
            return STRATA_OK;
        return dp_nccl_create(msg + 8, DP_NCCL_ID_BYTES, 0, 2, 1, cuda_device, opts, nccl, err);
    }
    if ((rc = upgrade_recv(tcp, UPGRADE_OFFER, msg, sizeof msg, &len, err)) != STRATA_OK)
        return rc;
    const bool offered = kv_ld32(msg + 4) == 1;
    if (offered && len != sizeof msg)
        return strata_fail(err, STRATA_EFORMAT, "data plane (%s): an NCCL offer of %zu bytes", tcp->desc, len);
    uint8_t probe[DP_NCCL_ID_BYTES];
    size_t probe_len = sizeof probe;
    /* This side can when it has a device and the build has NCCL (making an id is the probe). */
    const bool take = offered && cuda_device >= 0 && dp_nccl_unique_id(probe, &probe_len, NULL) == STRATA_OK;
    uint8_t answer[8];
    kv_st32(answer, UPGRADE_ANSWER);
    kv_st32(answer + 4, take ? 1u : 0u);
    if ((rc = dp_send(tcp, &ctl, answer, sizeof answer, err)) != STRATA_OK || !take)
        return rc;
    return dp_nccl_create(msg + 8, DP_NCCL_ID_BYTES, 1, 2, 0, cuda_device, opts, nccl, err);
}

#ifndef STRATA_HAVE_NCCL
/* Built without NCCL (no CUDA toolkit or libnccl at configure time). */
int dp_nccl_unique_id(void *out, size_t *len, strata_error *err)
{
    (void)out;
    (void)len;
    return strata_fail(err, STRATA_EUNSUPPORTED,
                       "data plane: this build has no NCCL backend (CUDA toolkit and libnccl were not "
                       "found at configure time); use the TCP transport");
}

int dp_nccl_create(const void *unique_id, size_t id_len, int rank, int nranks, int peer,
                   int cuda_device, const dp_options *opts, dp_link **out, strata_error *err)
{
    (void)unique_id;
    (void)id_len;
    (void)rank;
    (void)nranks;
    (void)peer;
    (void)cuda_device;
    (void)opts;
    if (out)
        *out = NULL;
    return dp_nccl_unique_id(NULL, NULL, err);
}
#endif
