/* The TCP backend of the data plane: non-blocking sockets driven by poll() with deadlines,
 * TCP_NODELAY, MSG_NOSIGNAL, CRC32C of every payload, a mutual HMAC-SHA256 challenge-response
 * on the cluster secret before the first frame, and every byte after it in AES-256-GCM records
 * under keys from an ephemeral X25519 agreement (transport_seal.h; README.md). */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "kvstore/bytes.h"
#include "kvstore/crc32c.h"
#include "kvstore/hostport.h"
#include "kvstore/random.h"
#include "worker/transport/transport.h"
#include "worker/transport/transport_impl.h"
#include "worker/transport/transport_seal.h"

struct dp_listener {
    int fd;
    uint16_t port;
    char addr[96];
};

/* ---- addresses ---- */

static int resolve(const char *hp, int passive, struct addrinfo **res, strata_error *err)
{
    char host[256], port[16];
    int port_number = 0;
    const char *bad = strata_split_host_port(hp, host, sizeof host, &port_number);
    if (bad)
        return strata_fail(err, STRATA_EINVAL, "data plane: bad address '%s' (%s)", hp ? hp : "", bad);
    snprintf(port, sizeof port, "%d", port_number);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = passive ? AI_PASSIVE : 0};
    int g = getaddrinfo(host, port, &hints, res);
    if (g != 0)
        return strata_fail(err, STRATA_EIO, "data plane: cannot resolve '%s': %s", hp,
                           g == EAI_SYSTEM ? strerror(errno) : gai_strerror(g));
    return STRATA_OK;
}

/* "1.2.3.4:5" or "[::1]:5" */
static void format_addr(const struct sockaddr *sa, socklen_t len, char *out, size_t cap)
{
    char host[NI_MAXHOST], serv[NI_MAXSERV];
    if (getnameinfo(sa, len, host, sizeof host, serv, sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
        snprintf(out, cap, "?");
        return;
    }
    snprintf(out, cap, sa->sa_family == AF_INET6 ? "[%s]:%s" : "%s:%s", host, serv);
}

static void sock_name(int fd, int peer, char *out, size_t cap)
{
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    int r = peer ? getpeername(fd, (struct sockaddr *)&ss, &len) : getsockname(fd, (struct sockaddr *)&ss, &len);
    if (r != 0)
        snprintf(out, cap, "?");
    else
        format_addr((struct sockaddr *)&ss, len, out, cap);
}

static void close_fd(int fd)
{
    if (fd >= 0)
        close(fd); /* Linux releases the descriptor even when close reports EINTR: never retry */
}

/* ---- byte moving with deadlines ---- */

enum { IO_OK = 0, IO_EOF = 1, IO_TIMEOUT = 2, IO_ERRNO = 3, IO_BAD_RECORD = 4, IO_FORGED = 5,
       IO_SEAL_FAILED = 6 /* err says why */ };

/* Waits for events on fd until deadline (-1 none). 1 ready, 0 timeout, -1 error (errno). */
static int wait_fd(int fd, short events, int64_t deadline)
{
    for (;;) {
        int t = -1;
        if (deadline >= 0) {
            int64_t left = deadline - dp_now_ms();
            t = left <= 0 ? 0 : left > INT_MAX ? INT_MAX : (int)left;
        }
        struct pollfd p = {.fd = fd, .events = events};
        int r = poll(&p, 1, t);
        if (r > 0)
            return 1; /* readable/writable, or POLLERR/POLLHUP: the next call reports it */
        if (r == 0) {
            if (t == 0 || (deadline >= 0 && dp_now_ms() >= deadline))
                return 0;
            continue;
        }
        if (errno != EINTR)
            return -1;
    }
}

/* The deadline of the next wait: first_deadline while nothing moved, then stall_ms after the
 * last progress; never past hard_deadline. */
static int64_t next_deadline(size_t done, int64_t first_deadline, int64_t last_progress, int stall_ms,
                             int64_t hard_deadline)
{
    int64_t d = done == 0 ? first_deadline : stall_ms < 0 ? -1 : last_progress + stall_ms;
    if (hard_deadline >= 0 && (d < 0 || d > hard_deadline))
        d = hard_deadline;
    return d;
}

/* Reads n bytes into buf, continuing *done; updates *crc over what arrives when crc != NULL.
 * Returns IO_* (IO_ERRNO with errno set). */
static int read_full(int fd, uint8_t *buf, size_t n, size_t *done, int64_t first_deadline, int stall_ms,
                     int64_t hard_deadline, uint32_t *crc)
{
    int64_t last = dp_now_ms();
    while (*done < n) {
        ssize_t r = recv(fd, buf + *done, n - *done, 0);
        if (r > 0) {
            if (crc)
                *crc = kv_crc32c(*crc, buf + *done, (size_t)r);
            *done += (size_t)r;
            last = dp_now_ms();
            continue;
        }
        if (r == 0)
            return IO_EOF;
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return IO_ERRNO;
        int w = wait_fd(fd, POLLIN, next_deadline(*done, first_deadline, last, stall_ms, hard_deadline));
        if (w == 0)
            return IO_TIMEOUT;
        if (w < 0)
            return IO_ERRNO;
    }
    return IO_OK;
}

static int write_full(int fd, const uint8_t *buf, size_t n, int more, size_t *done, int stall_ms,
                      int64_t hard_deadline)
{
    int64_t last = dp_now_ms();
    while (*done < n) {
        ssize_t r = send(fd, buf + *done, n - *done, MSG_NOSIGNAL | (more ? MSG_MORE : 0));
        if (r > 0) {
            *done += (size_t)r;
            last = dp_now_ms();
            continue;
        }
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
            return IO_ERRNO;
        /* r == 0 cannot happen for n > 0 on a stream socket; treat it as "try again" */
        int w = wait_fd(fd, POLLOUT, next_deadline(1, -1, last, stall_ms, hard_deadline));
        if (w == 0)
            return IO_TIMEOUT;
        if (w < 0)
            return IO_ERRNO;
    }
    return IO_OK;
}

/* ---- the sealed byte stream ---- */

/* A TCP link's state (link->impl): the keys, and one record buffer for each direction (the
 * sending thread uses only out, the receiving thread only in). */
typedef struct tcp_state {
    dp_seal *seal;
    uint8_t *out;        /* the record being sent */
    uint8_t *in;         /* the record being received, then its plaintext at in + DP_RECORD_HEAD */
    size_t in_have;      /* bytes of the record read so far (0 between records) */
    size_t in_off;       /* plaintext handed out, from in + DP_RECORD_HEAD */
    size_t in_avail;     /* plaintext not yet handed out */
    uint32_t bad_length; /* the length a refused record head announced */
} tcp_state;

static void tcp_state_free(tcp_state *t)
{
    if (!t)
        return;
    dp_seal_free(t->seal);
    if (t->in)
        OPENSSL_cleanse(t->in, DP_RECORD_MAX + DP_RECORD_OVERHEAD);
    free(t->in);
    free(t->out);
    free(t);
}

/* Reads the peer's next record and opens it: into t->in (its plaintext then handed out from
 * there), or, when it fits the room left in the caller's buffer, its ciphertext straight into
 * direct (decrypted there: one copy fewer for large payloads; *direct_len says how much). A
 * record is read to its end or the link breaks (a timeout inside one is a stall), so nothing of
 * a partial record needs to survive a call. */
static int read_record(int fd, tcp_state *t, int64_t first_deadline, int stall_ms, uint8_t *direct, size_t room,
                       size_t *direct_len)
{
    *direct_len = 0;
    int io = read_full(fd, t->in, DP_RECORD_HEAD, &t->in_have, first_deadline, stall_ms, -1, NULL);
    if (io != IO_OK)
        return io;
    const uint32_t n = dp_record_length(t->in);
    if (n == 0 || n > DP_RECORD_MAX) {
        t->bad_length = n;
        return IO_BAD_RECORD;
    }
    if (direct && n <= room) {
        /* Begun: the stall limit applies from here (read_full counts from 0 in each buffer). */
        const int64_t stall_deadline = stall_ms < 0 ? -1 : dp_now_ms() + stall_ms;
        size_t ct_done = 0, tag_done = 0;
        io = read_full(fd, direct, n, &ct_done, stall_deadline, stall_ms, -1, NULL);
        if (io == IO_OK)
            io = read_full(fd, t->in + DP_RECORD_HEAD, DP_RECORD_TAG, &tag_done, stall_deadline, stall_ms, -1,
                           NULL);
        if (io != IO_OK)
            return io;
        if (dp_seal_open(t->seal, t->in, direct, t->in + DP_RECORD_HEAD) != 0)
            return IO_FORGED;
        t->in_have = 0;
        *direct_len = n;
        return IO_OK;
    }
    io = read_full(fd, t->in, n + DP_RECORD_OVERHEAD, &t->in_have, first_deadline, stall_ms, -1, NULL);
    if (io != IO_OK)
        return io;
    if (dp_seal_open(t->seal, t->in, t->in + DP_RECORD_HEAD, t->in + DP_RECORD_HEAD + n) != 0)
        return IO_FORGED;
    t->in_have = 0;
    t->in_off = 0;
    t->in_avail = n;
    return IO_OK;
}

/* read_full over the sealed stream: n plaintext bytes into buf, continuing *done. A record
 * begun counts as progress: once its first byte arrived the stall limit applies. */
static int sealed_read(dp_link *link, uint8_t *buf, size_t n, size_t *done, int64_t first_deadline,
                       uint32_t *crc)
{
    tcp_state *t = link->impl;
    while (*done < n) {
        size_t take = 0;
        if (t->in_avail > 0) {
            take = n - *done < t->in_avail ? n - *done : t->in_avail;
            memcpy(buf + *done, t->in + DP_RECORD_HEAD + t->in_off, take);
            t->in_off += take;
            t->in_avail -= take;
        } else {
            const int stall = link->io_timeout_ms;
            int64_t first = *done == 0 ? first_deadline : stall < 0 ? -1 : dp_now_ms() + stall;
            int io = read_record(link->fd, t, first, stall, buf + *done, n - *done, &take);
            if (io != IO_OK)
                return io;
        }
        if (crc)
            *crc = kv_crc32c(*crc, buf + *done, take);
        *done += take;
    }
    return IO_OK;
}

/* Whether anything of the next message has arrived: plaintext, or part of a record. */
static bool sealed_begun(const dp_link *link, size_t done)
{
    const tcp_state *t = link->impl;
    return done > 0 || t->in_have > 0;
}

/* Sends the concatenation of a (na bytes) and b (nb bytes) as records. *sent: plaintext bytes
 * whose records left whole; *any: whether any byte reached the socket. A record that could not
 * start is taken back, so a send that times out before its first byte leaves the stream in
 * sync. */
static int sealed_write(dp_link *link, const uint8_t *a, size_t na, const uint8_t *b, size_t nb, size_t *sent,
                        bool *any, strata_error *err)
{
    tcp_state *t = link->impl;
    const size_t total = na + nb;
    *sent = 0;
    *any = false;
    while (*sent < total) {
        size_t n = total - *sent < DP_RECORD_MAX ? total - *sent : DP_RECORD_MAX;
        size_t from_a = *sent < na ? (na - *sent < n ? na - *sent : n) : 0;
        const uint8_t *pa = from_a ? a + *sent : NULL;
        const uint8_t *pb = n > from_a ? b + (*sent + from_a - na) : NULL;
        if (dp_seal_record(t->seal, pa, from_a, pb, n - from_a, t->out, err) != STRATA_OK)
            return IO_SEAL_FAILED;
        size_t wdone = 0;
        int io = write_full(link->fd, t->out, n + DP_RECORD_OVERHEAD, *sent + n < total, &wdone,
                            link->io_timeout_ms, -1);
        if (wdone > 0)
            *any = true;
        if (io != IO_OK) {
            if (wdone == 0)
                dp_seal_unsend(t->seal);
            return io;
        }
        *sent += n;
    }
    return IO_OK;
}

/* The message of a receive that failed with io (not IO_OK), done of n bytes of what ("header",
 * "payload") read. */
static int recv_fail(dp_link *link, int io, const char *what, size_t done, uint64_t n, strata_error *err)
{
    const tcp_state *t = link->impl;
    if (io == IO_FORGED)
        return strata_fail(err, STRATA_ECRC,
                           "data plane (%s): a record failed authentication after %zu of %" PRIu64
                           " %s bytes: the bytes were altered in transit or were not sealed by the peer",
                           link->desc, done, n, what);
    if (io == IO_BAD_RECORD)
        return strata_fail(err, STRATA_EFORMAT,
                           "data plane (%s): a record announces %" PRIu32 " bytes (1..%d) after %zu of %" PRIu64
                           " %s bytes: not a sealed strata stream",
                           link->desc, t->bad_length, DP_RECORD_MAX, done, n, what);
    if (io == IO_TIMEOUT)
        return strata_fail(err, STRATA_EIO, "data plane (%s): timed out: peer stalled for %d ms after %zu of %" PRIu64
                                            " %s bytes%s",
                           link->desc, link->io_timeout_ms, done, n, what, t->in_have ? " (in a record)" : "");
    if (io == IO_EOF)
        return strata_fail(err, STRATA_EIO, "data plane (%s): peer closed after %zu of %" PRIu64 " %s bytes%s",
                           link->desc, done, n, what, t->in_have ? " (in a record)" : "");
    return strata_fail(err, STRATA_EIO, "data plane (%s): receive failed after %zu of %" PRIu64 " %s bytes: %s",
                       link->desc, done, n, what, strerror(errno));
}

/* ---- the link's backend operations ---- */

static int tcp_send(dp_link *link, const dp_msg_header *h, const void *payload, size_t len,
                    strata_error *err)
{
    uint32_t crc = len ? kv_crc32c(0, payload, len) : 0;
    uint8_t hdr[DP_FRAME_HEADER_BYTES];
    int rc = dp_frame_encode(h, len, crc, DP_FLAG_PAYLOAD_CRC, hdr, err);
    if (rc != STRATA_OK)
        return rc;
    size_t sent = 0;
    bool any = false;
    int io = sealed_write(link, hdr, sizeof hdr, payload, len, &sent, &any, err);
    if (io == IO_OK)
        return STRATA_OK;
    if (io == IO_SEAL_FAILED)
        return any ? dp_link_break(link, err) : err->code;
    int saved = errno;
    size_t total = sizeof hdr + len;
    if (io == IO_TIMEOUT) {
        strata_fail(err, STRATA_EIO,
                    "data plane (%s): send of a %s message timed out: peer read nothing for %d ms "
                    "(%zu of %zu bytes sent)",
                    link->desc, dp_kind_name(h->kind), link->io_timeout_ms, sent, total);
        /* Nothing of the frame left: the stream is still in sync. */
        return any ? dp_link_break(link, err) : err->code;
    }
    strata_fail(err, STRATA_EIO, "data plane (%s): send of a %s message failed after %zu of %zu bytes: %s",
                link->desc, dp_kind_name(h->kind), sent, total, strerror(saved));
    return dp_link_break(link, err);
}

static int tcp_recv_header(dp_link *link, uint8_t hdr[DP_FRAME_HEADER_BYTES], int timeout_ms,
                           strata_error *err)
{
    size_t done = 0;
    int io = sealed_read(link, hdr, DP_FRAME_HEADER_BYTES, &done, dp_deadline(timeout_ms), NULL);
    if (io == IO_OK)
        return STRATA_OK;
    if (io == IO_TIMEOUT && !sealed_begun(link, done))
        /* A plain timeout: nothing of the next frame was read, the link stays usable. */
        return strata_fail(err, STRATA_EIO, "data plane (%s): timed out after %d ms waiting for a message",
                           link->desc, timeout_ms);
    if (io == IO_EOF && !sealed_begun(link, done))
        strata_fail(err, STRATA_EIO, "data plane (%s): peer closed the connection", link->desc);
    else
        recv_fail(link, io, "header", done, DP_FRAME_HEADER_BYTES, err);
    return dp_link_break(link, err);
}

static int tcp_recv_payload(dp_link *link, void *buf, strata_error *err)
{
    const dp_msg_header *h = &link->pending_h;
    uint64_t n = h->payload_len;
    uint32_t crc = 0;
    size_t done = 0;
    int io = IO_OK;
    if (buf) {
        io = sealed_read(link, buf, (size_t)n, &done, dp_deadline(link->io_timeout_ms), &crc);
    } else {
        uint8_t scratch[16384];
        while (io == IO_OK && done < n) {
            size_t chunk = n - done < sizeof scratch ? (size_t)(n - done) : sizeof scratch, got = 0;
            io = sealed_read(link, scratch, chunk, &got, dp_deadline(link->io_timeout_ms), &crc);
            done += got;
        }
    }
    if (io == IO_OK) {
        if (crc == h->payload_crc)
            return STRATA_OK;
        strata_fail(err, STRATA_ECRC,
                    "data plane (%s): CRC32C mismatch in the %" PRIu64 "-byte payload of a %s message "
                    "(step %" PRIu64 ", seq %" PRIu64 ", layer %u): frame says %08x, bytes give %08x",
                    link->desc, n, dp_kind_name(h->kind), h->step, h->seq, (unsigned)h->layer,
                    h->payload_crc, crc);
    } else if (io == IO_EOF) {
        strata_fail(err, STRATA_EIO,
                    "data plane (%s): peer closed after %zu of %" PRIu64 " payload bytes of a %s message",
                    link->desc, done, n, dp_kind_name(h->kind));
    } else {
        recv_fail(link, io, "payload", done, n, err);
    }
    return dp_link_break(link, err);
}

static void tcp_close(dp_link *link)
{
    close_fd(link->fd);
    link->fd = -1;
    tcp_state_free(link->impl);
    link->impl = NULL;
}

static const dp_ops tcp_ops = {
    .send = tcp_send,
    .recv_header = tcp_recv_header,
    .recv_payload = tcp_recv_payload,
    .close = tcp_close,
};

/* ---- handshake ---- */

/* Hello (80 bytes, little-endian): "SDPH", u16 version, u8 role, u8 purpose (DP_PURPOSE_*),
 * u64 max_payload, 32-byte nonce, 32-byte X25519 public key. Then each side sends
 * HMAC-SHA256(secret, label || prover role || hello of the connector || hello of the acceptor)
 * and checks the peer's; both derive the link's keys from the X25519 agreement (transport_seal.h).
 * The first 48 bytes kept their place since version 1 (48-byte hellos, no encryption), so a
 * peer of either version reads the other's version before waiting for bytes that never come. */
enum { HELLO_BYTES = 48 + DP_KX_PUBLIC_BYTES, HELLO_V1_BYTES = 48, NONCE_BYTES = 32, MAC_BYTES = 32 };
enum { HELLO_VERSION = 2 };
enum { ROLE_CONNECTOR = 0, ROLE_ACCEPTOR = 1 };
static const uint8_t hello_magic[4] = {'S', 'D', 'P', 'H'};
static const char auth_label[] = "strata data plane auth v2";

static int check_auth(const dp_auth *auth, strata_error *err)
{
    if (!auth || !auth->secret || auth->len == 0)
        return strata_fail(err, STRATA_EINVAL, "data plane: TCP links need the cluster secret (dp_auth)");
    if (auth->len < DP_AUTH_MIN_SECRET || auth->len > INT_MAX)
        return strata_fail(err, STRATA_EINVAL, "data plane: cluster secret of %zu bytes (at least %d needed)",
                           auth->len, DP_AUTH_MIN_SECRET);
    return STRATA_OK;
}

static int proof(const dp_auth *auth, int role, const uint8_t *hello_c, const uint8_t *hello_a,
                 uint8_t mac[MAC_BYTES], strata_error *err)
{
    uint8_t msg[sizeof auth_label + 1 + 2 * HELLO_BYTES];
    memcpy(msg, auth_label, sizeof auth_label); /* with its NUL, as a separator */
    msg[sizeof auth_label] = (uint8_t)role;
    memcpy(msg + sizeof auth_label + 1, hello_c, HELLO_BYTES);
    memcpy(msg + sizeof auth_label + 1 + HELLO_BYTES, hello_a, HELLO_BYTES);
    unsigned int mlen = 0;
    if (!HMAC(EVP_sha256(), auth->secret, (int)auth->len, msg, sizeof msg, mac, &mlen) || mlen != MAC_BYTES)
        return strata_fail(err, STRATA_EIO, "data plane: HMAC-SHA256 failed (OpenSSL)");
    return STRATA_OK;
}

static int hs_io_fail(int io, const char *what, const char *peer, size_t done, size_t n, strata_error *err)
{
    if (io == IO_TIMEOUT)
        return strata_fail(err, STRATA_EIO, "data plane: handshake with %s timed out %s (%zu of %zu bytes)",
                           peer, what, done, n);
    if (io == IO_EOF)
        return strata_fail(err, STRATA_EIO,
                           "data plane: peer %s closed the connection during the handshake, %s (%zu of %zu bytes)",
                           peer, what, done, n);
    return strata_fail(err, STRATA_EIO, "data plane: handshake with %s failed %s: %s", peer, what,
                       strerror(errno));
}

static const char *purpose_name(unsigned p)
{
    return p == DP_PURPOSE_ROWS ? "a pipeline link" : p == DP_PURPOSE_MIGRATION ? "a migration" : "anything";
}

static int handshake(int fd, int role, const dp_auth *auth, uint64_t my_max, uint8_t purpose, int64_t deadline,
                     const char *peer, uint64_t *peer_max, dp_seal **seal, strata_error *err)
{
    uint8_t mine[HELLO_BYTES] = {0}, theirs[HELLO_BYTES];
    memcpy(mine, hello_magic, 4);
    kv_st16(mine + 4, HELLO_VERSION);
    mine[6] = (uint8_t)role;
    mine[7] = purpose;
    kv_st64(mine + 8, my_max);
    dp_kx *kx = NULL;
    int rc = strata_random_bytes(mine + 16, NONCE_BYTES, err);
    if (rc != STRATA_OK)
        strata_error_prefix(err, "data plane");
    else
        rc = dp_kx_new(&kx, mine + 16 + NONCE_BYTES, err);
    if (rc != STRATA_OK)
        return rc;
    size_t done = 0;
    int io = write_full(fd, mine, sizeof mine, 0, &done, -1, deadline);
    if (io != IO_OK) {
        rc = hs_io_fail(io, "sending hello", peer, done, sizeof mine, err);
        goto out;
    }
    done = 0;
    io = read_full(fd, theirs, HELLO_V1_BYTES, &done, deadline, -1, deadline, NULL);
    if (io != IO_OK) {
        rc = hs_io_fail(io, "reading hello", peer, done, sizeof theirs, err);
        goto out;
    }
    rc = STRATA_EFORMAT;
    if (memcmp(theirs, hello_magic, 4) != 0) {
        strata_fail(err, rc, "data plane: peer %s is not a strata data-plane endpoint (hello starts %02x %02x %02x %02x)",
                    peer, theirs[0], theirs[1], theirs[2], theirs[3]);
        goto out;
    }
    if (kv_ld16(theirs + 4) != HELLO_VERSION) {
        strata_fail(err, rc, "data plane: peer %s speaks data-plane version %u, this build %u", peer,
                    (unsigned)kv_ld16(theirs + 4), (unsigned)HELLO_VERSION);
        goto out;
    }
    io = read_full(fd, theirs, sizeof theirs, &done, deadline, -1, deadline, NULL);
    if (io != IO_OK) {
        rc = hs_io_fail(io, "reading hello", peer, done, sizeof theirs, err);
        goto out;
    }
    if (theirs[6] != 1 - role || theirs[7] > DP_PURPOSE_MIGRATION) {
        strata_fail(err, rc, "data plane: peer %s sent a bad hello (role %u, purpose %u)", peer, theirs[6],
                    theirs[7]);
        goto out;
    }
    if (memcmp(theirs + 16, mine + 16, NONCE_BYTES) == 0) {
        rc = strata_fail(err, STRATA_EINVAL, "data plane: peer %s echoed our nonce (reflection)", peer);
        goto out;
    }
    const uint64_t pmax = kv_ld64(theirs + 8);
    if (pmax == 0) {
        strata_fail(err, rc, "data plane: peer %s accepts no payload (max 0)", peer);
        goto out;
    }

    uint8_t transcript[2 * HELLO_BYTES]; /* the connector's hello, then the acceptor's */
    memcpy(transcript, role == ROLE_CONNECTOR ? mine : theirs, HELLO_BYTES);
    memcpy(transcript + HELLO_BYTES, role == ROLE_CONNECTOR ? theirs : mine, HELLO_BYTES);
    const uint8_t *hello_c = transcript, *hello_a = transcript + HELLO_BYTES;
    uint8_t my_mac[MAC_BYTES], want[MAC_BYTES], got[MAC_BYTES];
    rc = proof(auth, role, hello_c, hello_a, my_mac, err);
    if (rc == STRATA_OK)
        rc = proof(auth, 1 - role, hello_c, hello_a, want, err);
    if (rc != STRATA_OK)
        goto out;
    done = 0;
    io = write_full(fd, my_mac, sizeof my_mac, 0, &done, -1, deadline);
    if (io == IO_OK) {
        done = 0;
        io = read_full(fd, got, sizeof got, &done, deadline, -1, deadline, NULL);
        if (io != IO_OK)
            rc = hs_io_fail(io, "reading the peer's proof", peer, done, sizeof got, err);
    } else {
        rc = hs_io_fail(io, "sending our proof", peer, done, sizeof my_mac, err);
    }
    if (rc == STRATA_OK && CRYPTO_memcmp(got, want, MAC_BYTES) != 0)
        rc = strata_fail(err, STRATA_EINVAL,
                         "data plane: peer %s failed authentication (wrong cluster secret?)", peer);
    OPENSSL_cleanse(my_mac, sizeof my_mac);
    OPENSSL_cleanse(want, sizeof want);
    /* After the proofs: only a peer holding the secret learns what this side waits for. */
    if (rc == STRATA_OK && purpose != DP_PURPOSE_ANY && theirs[7] != DP_PURPOSE_ANY && theirs[7] != purpose)
        rc = strata_fail(err, STRATA_EINVAL, "data plane: peer %s connected for %s, this side %s %s", peer,
                         purpose_name(theirs[7]), role == ROLE_ACCEPTOR ? "waits for" : "asked for",
                         purpose_name(purpose));
    if (rc == STRATA_OK)
        rc = dp_seal_new(kx, theirs + 16 + NONCE_BYTES, auth->secret, auth->len, transcript, sizeof transcript,
                         role == ROLE_CONNECTOR, seal, err);
    if (rc == STRATA_OK)
        *peer_max = pmax;
out:
    dp_kx_free(kx);
    return rc;
}

/* Wraps an authenticated socket in a link (takes fd). */
static int make_link(int fd, int role, const dp_auth *auth, const dp_options *opts, int64_t deadline,
                     dp_link **out, strata_error *err)
{
    int one = 1;
    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0) {
        int e = errno;
        close_fd(fd);
        return strata_fail(err, STRATA_EIO, "data plane: setting TCP_NODELAY failed: %s", strerror(e));
    }
    dp_link *link = malloc(sizeof *link);
    tcp_state *t = calloc(1, sizeof *t);
    if (t) {
        t->in = malloc(DP_RECORD_MAX + DP_RECORD_OVERHEAD);
        t->out = malloc(DP_RECORD_MAX + DP_RECORD_OVERHEAD);
    }
    if (!link || !t || !t->in || !t->out) {
        free(link);
        tcp_state_free(t);
        close_fd(fd);
        return strata_fail(err, STRATA_ENOMEM, "data plane: out of memory for a link");
    }
    dp_link_init_common(link, DP_BACKEND_TCP, &tcp_ops, opts);
    link->fd = fd;
    link->impl = t;
    char local[96], peer[96];
    sock_name(fd, 0, local, sizeof local);
    sock_name(fd, 1, peer, sizeof peer);
    snprintf(link->desc, sizeof link->desc, "tcp %s <-> %s", local, peer);
    int rc = handshake(fd, role, auth, link->max_payload, opts ? opts->purpose : DP_PURPOSE_ANY, deadline, peer,
                       &link->peer_max_payload, &t->seal, err);
    if (rc != STRATA_OK) {
        dp_link_close(link);
        return rc;
    }
    *out = link;
    return STRATA_OK;
}

/* ---- tests only (transport_impl.h) ---- */

int dp_tcp_write_sealed(dp_link *link, const void *bytes, size_t n, strata_error *err)
{
    if (!link || link->backend != DP_BACKEND_TCP || !link->impl)
        return strata_fail(err, STRATA_EINVAL, "data plane: not a TCP link");
    size_t sent = 0;
    bool any = false;
    int io = sealed_write(link, bytes, n, NULL, 0, &sent, &any, err);
    if (io == IO_OK || io == IO_SEAL_FAILED)
        return io == IO_OK ? STRATA_OK : err->code;
    return strata_fail(err, STRATA_EIO, "data plane: raw sealed write failed after %zu of %zu bytes", sent, n);
}

int dp_tcp_link_keys(const dp_link *link, uint8_t send_key[32], uint8_t recv_key[32])
{
    if (!link || link->backend != DP_BACKEND_TCP || !link->impl)
        return STRATA_EINVAL;
    dp_seal_keys(((const tcp_state *)link->impl)->seal, send_key, recv_key);
    return STRATA_OK;
}

/* ---- public: listen, accept, connect ---- */

int dp_tcp_listen(const char *host_port, dp_listener **out, strata_error *err)
{
    if (!out)
        return strata_fail(err, STRATA_EINVAL, "data plane: NULL listener output");
    *out = NULL;
    struct addrinfo *res = NULL;
    int rc = resolve(host_port, 1, &res, err);
    if (rc != STRATA_OK)
        return rc;
    int fd = -1, last_errno = 0;
    const char *last_op = "bind";
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            last_errno = errno;
            last_op = "socket";
            continue;
        }
        int one = 1;
        if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0) {
            last_errno = errno;
            last_op = "setsockopt(SO_REUSEADDR)";
        } else if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
            last_errno = errno;
            last_op = "bind";
        } else if (listen(fd, 64) != 0) {
            last_errno = errno;
            last_op = "listen";
        } else {
            break;
        }
        close_fd(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0)
        return strata_fail(err, STRATA_EIO, "data plane: cannot listen on %s: %s failed: %s", host_port, last_op,
                           strerror(last_errno));
    dp_listener *l = malloc(sizeof *l);
    if (!l) {
        close_fd(fd);
        return strata_fail(err, STRATA_ENOMEM, "data plane: out of memory for a listener");
    }
    l->fd = fd;
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0) {
        int e = errno;
        dp_listener_close(l);
        return strata_fail(err, STRATA_EIO, "data plane: getsockname on %s failed: %s", host_port, strerror(e));
    }
    l->port = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                       : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    format_addr((struct sockaddr *)&ss, len, l->addr, sizeof l->addr);
    *out = l;
    return STRATA_OK;
}

uint16_t dp_listener_port(const dp_listener *l) { return l ? l->port : 0; }
int dp_listener_fd(const dp_listener *l) { return l ? l->fd : -1; }

void dp_listener_close(dp_listener *l)
{
    if (!l)
        return;
    close_fd(l->fd);
    free(l);
}

/* One accepted connection's handshake, run on its own thread so that a peer that stays silent
 * (or trickles its hello) does not hold the listener: a stranger without the secret could
 * otherwise keep the real peer waiting in the backlog, 3 s per connection. */
typedef struct hs_job {
    pthread_t thread;
    int fd;
    const dp_auth *auth;
    const dp_options *opts;
    int64_t deadline;
    dp_link *link;
    int rc;
    strata_error err;
    atomic_bool done;
} hs_job;

static void *run_handshake(void *arg)
{
    hs_job *j = arg;
    j->rc = make_link(j->fd, ROLE_ACCEPTOR, j->auth, j->opts, j->deadline, &j->link, &j->err);
    atomic_store(&j->done, true);
    return NULL;
}

/* Starts j's handshake on a thread with every signal blocked (signals stay with the caller's
 * thread, whose waits they must interrupt). Runs it here when no thread can be had. */
static void start_handshake(hs_job *j)
{
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    const bool started = pthread_create(&j->thread, NULL, run_handshake, j) == 0;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (!started) {
        run_handshake(j);
        j->thread = pthread_self();
    }
}

static void finish_handshake(hs_job *j)
{
    if (!pthread_equal(j->thread, pthread_self()))
        pthread_join(j->thread, NULL);
}

int dp_tcp_accept(dp_listener *l, const dp_auth *auth, const dp_options *opts, int timeout_ms,
                  dp_link **out, strata_error *err)
{
    if (!l || !out)
        return strata_fail(err, STRATA_EINVAL, "data plane: NULL listener or output");
    *out = NULL;
    int rc = check_auth(auth, err);
    if (rc != STRATA_OK)
        return rc;
    const int64_t deadline = dp_deadline(timeout_ms);
    /* Slots stay put while their threads run (a thread writes its result into its slot). */
    hs_job jobs[DP_ACCEPT_HANDSHAKES];
    bool busy[DP_ACCEPT_HANDSHAKES] = {false};
    size_t n_jobs = 0;
    dp_link *won = NULL;
    int failed = STRATA_OK;   /* the last failed handshake's code, its message in err */
    for (bool first = true;; first = false) {
        /* Collect finished handshakes: the first authenticated one is the link. */
        for (size_t k = 0; k < DP_ACCEPT_HANDSHAKES; k++) {
            if (!busy[k] || !atomic_load(&jobs[k].done))
                continue;
            finish_handshake(&jobs[k]);
            busy[k] = false;
            n_jobs--;
            if (jobs[k].rc == STRATA_OK && !won) {
                won = jobs[k].link;
            } else if (jobs[k].rc == STRATA_OK) {
                dp_link_close(jobs[k].link);
            } else {
                failed = jobs[k].rc;
                if (err)
                    *err = jobs[k].err;
            }
        }
        if (won) {
            /* The others fail at once: their sockets see the end of the stream. */
            for (size_t k = 0; k < DP_ACCEPT_HANDSHAKES; k++)
                if (busy[k])
                    shutdown(jobs[k].fd, SHUT_RDWR);
            for (size_t k = 0; k < DP_ACCEPT_HANDSHAKES; k++) {
                if (!busy[k])
                    continue;
                finish_handshake(&jobs[k]);
                if (jobs[k].rc == STRATA_OK)
                    dp_link_close(jobs[k].link);
            }
            *out = won;
            return STRATA_OK;
        }
        if (failed != STRATA_OK && n_jobs == 0)
            return failed;   /* the caller decides whether to accept again */
        /* The first pass takes what is pending even with no time left (timeout 0). */
        const bool open = first || deadline < 0 || dp_now_ms() < deadline;
        if (!open && n_jobs == 0)
            return strata_fail(err, STRATA_EIO, "data plane: accept on %s timed out after %d ms", l->addr,
                               timeout_ms);
        /* Wait a little for a new connection (or for a handshake to end). */
        struct pollfd pfd = {.fd = l->fd, .events = POLLIN};
        const bool take = open && n_jobs < DP_ACCEPT_HANDSHAKES;
        int wait_ms = n_jobs ? 10 : 100;
        if (take && deadline >= 0 && deadline - dp_now_ms() < wait_ms)
            wait_ms = (int)(deadline - dp_now_ms() > 0 ? deadline - dp_now_ms() : 0);
        int w = take ? poll(&pfd, 1, wait_ms) : (poll(NULL, 0, wait_ms), 0);
        if (w < 0 && errno != EINTR && n_jobs == 0)
            return strata_fail(err, STRATA_EIO, "data plane: poll on %s failed: %s", l->addr, strerror(errno));
        /* Every connection pending now, each handshake with its own deadline whatever the
         * caller's window: timeout_ms bounds the wait for connections, not a handshake. */
        for (size_t k = 0; w > 0 && take && k < DP_ACCEPT_HANDSHAKES; k++) {
            if (busy[k])
                continue;
            int fd = accept4(l->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (fd < 0 && (errno == EINTR || errno == ECONNABORTED)) {
                k--;   /* this slot is still free: try again */
                continue;
            }
            if (fd < 0) {
                if (errno != EAGAIN && errno != EWOULDBLOCK && n_jobs == 0)
                    return strata_fail(err, STRATA_EIO, "data plane: accept on %s failed: %s", l->addr,
                                       strerror(errno));
                break;
            }
            jobs[k] = (hs_job){.fd = fd, .auth = auth, .opts = opts, .deadline = dp_deadline(DP_HANDSHAKE_TIMEOUT_MS)};
            atomic_init(&jobs[k].done, false);
            busy[k] = true;
            n_jobs++;
            start_handshake(&jobs[k]);
        }
    }
}

/* Non-blocking connect to one address within deadline. Returns the socket or -1 with *e set. */
static int connect_one(const struct addrinfo *ai, int64_t deadline, int *e, int *timed_out)
{
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
        *e = errno;
        return -1;
    }
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0)
        return fd;
    if (errno != EINPROGRESS && errno != EINTR) {
        *e = errno;
        close_fd(fd);
        return -1;
    }
    /* EINTR: the connection continues asynchronously, like EINPROGRESS. */
    int w = wait_fd(fd, POLLOUT, deadline);
    if (w <= 0) {
        *e = w == 0 ? ETIMEDOUT : errno;
        *timed_out = w == 0;
        close_fd(fd);
        return -1;
    }
    int soerr = 0;
    socklen_t len = sizeof soerr;
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len) != 0)
        soerr = errno;
    if (soerr != 0) {
        *e = soerr;
        close_fd(fd);
        return -1;
    }
    return fd;
}

int dp_tcp_connect(const char *host_port, const dp_auth *auth, const dp_options *opts, int timeout_ms,
                   dp_link **out, strata_error *err)
{
    if (!out)
        return strata_fail(err, STRATA_EINVAL, "data plane: NULL link output");
    *out = NULL;
    int rc = check_auth(auth, err);
    if (rc != STRATA_OK)
        return rc;
    struct addrinfo *res = NULL;
    rc = resolve(host_port, 0, &res, err);
    if (rc != STRATA_OK)
        return rc;
    int64_t deadline = dp_deadline(timeout_ms);
    int fd = -1, e = 0, timed_out = 0;
    char tried[96] = "?";
    for (const struct addrinfo *ai = res; ai && fd < 0 && !timed_out; ai = ai->ai_next) {
        format_addr(ai->ai_addr, ai->ai_addrlen, tried, sizeof tried);
        fd = connect_one(ai, deadline, &e, &timed_out);
    }
    freeaddrinfo(res);
    if (fd < 0) {
        if (timed_out)
            return strata_fail(err, STRATA_EIO, "data plane: connect to %s (%s) timed out after %d ms", host_port,
                               tried, timeout_ms);
        return strata_fail(err, STRATA_EIO, "data plane: connect to %s (%s) failed: %s", host_port, tried,
                           strerror(e));
    }
    return make_link(fd, ROLE_CONNECTOR, auth, opts, deadline, out, err);
}
