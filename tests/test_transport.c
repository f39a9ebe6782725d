/* The worker data plane (worker/transport/transport.h) over loopback TCP: messages of every kind
 * and size (0 B, 1 B, 10 MiB; 300 MiB with max_payload raised) with their contents checked,
 * two-step receives and buffers too small, authentication (wrong secret on both sides, a
 * non-strata peer, a version 1 peer, links made for another purpose), encryption (a relay
 * records the wire: no plaintext on it, and it decrypts with the link's keys by the README's
 * description; a bit flipped on the way is refused), forged frames sealed into the stream
 * (peer closing mid-header and mid-payload, a corrupted payload byte, a bad header CRC, garbage
 * magic, a length over the maximum), timeouts (a plain timeout keeps the
 * link usable, a stall mid-frame breaks it), refused connects and sends to a closed peer. The NCCL
 * path runs when the build has NCCL and the host has CUDA devices; otherwise it is skipped with
 * the reason printed: the two-rank test needs two GPUs (NCCL refuses two ranks of one communicator
 * on one device), the loopback test (a one-rank link sending to itself) needs one. */
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <inttypes.h>
#include <openssl/evp.h>

#include "kvstore/crc32c.h"
#include "worker/transport/transport.h"
#include "worker/transport/transport_impl.h"

#ifdef STRATA_HAVE_NCCL
#include <cuda_runtime_api.h>
#endif

static const uint8_t secret_a[32] = "0123456789abcdef0123456789abcde";
static const uint8_t secret_b[32] = "0123456789abcdef0123456789abcdX";
static const dp_auth auth_a = {secret_a, sizeof secret_a};
static const dp_auth auth_b = {secret_b, sizeof secret_b};

#define TIMEOUT 10000

static void fill(uint8_t *buf, size_t n, uint64_t seed)
{
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        buf[i] = (uint8_t)(x >> 24);
    }
}

static uint8_t *pattern(size_t n, uint64_t seed)
{
    uint8_t *p = malloc(n ? n : 1);
    assert_non_null(p);
    fill(p, n, seed);
    return p;
}

/* ---- pairs of links over loopback ---- */

typedef struct accept_job {
    dp_listener *l;
    const dp_auth *auth;
    const dp_options *opts;
    int timeout_ms;
    dp_link *link;
    int rc;
    strata_error err;
} accept_job;

static void *accept_main(void *p)
{
    accept_job *j = p;
    j->rc = dp_tcp_accept(j->l, j->auth, j->opts, j->timeout_ms, &j->link, &j->err);
    return NULL;
}

static void listen_local(dp_listener **l, char *addr, size_t cap)
{
    strata_error err = {0};
    int rc = dp_tcp_listen("127.0.0.1:0", l, &err);
    if (rc != STRATA_OK)
        fail_msg("listen: %s", err.msg);
    assert_true(dp_listener_port(*l) != 0);
    snprintf(addr, cap, "127.0.0.1:%u", (unsigned)dp_listener_port(*l));
}

/* Accepts in a thread while connecting here. Returns both status codes. */
static void try_pair(dp_listener *l, const char *addr, const dp_auth *sauth, const dp_options *sopts,
                     const dp_auth *cauth, const dp_options *copts, accept_job *server, int *crc_code,
                     dp_link **client, strata_error *cerr)
{
    *server = (accept_job){.l = l, .auth = sauth, .opts = sopts, .timeout_ms = TIMEOUT};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, accept_main, server), 0);
    *crc_code = dp_tcp_connect(addr, cauth, copts, TIMEOUT, client, cerr);
    assert_int_equal(pthread_join(t, NULL), 0);
}

static void pair(const dp_options *sopts, dp_link **server, dp_link **client)
{
    dp_listener *l;
    char addr[64];
    listen_local(&l, addr, sizeof addr);
    accept_job s;
    strata_error cerr = {0};
    int crc;
    try_pair(l, addr, &auth_a, sopts, &auth_a, NULL, &s, &crc, client, &cerr);
    if (s.rc != STRATA_OK || crc != STRATA_OK)
        fail_msg("pair: accept %s (%s), connect %s (%s)", strata_status_name(s.rc), s.err.msg,
                 strata_status_name(crc), cerr.msg);
    *server = s.link;
    dp_listener_close(l);
}

/* Writes bytes into a link's sealed stream as they are: a forged frame that decrypts. */
static void sealed_write(dp_link *link, const void *buf, size_t n)
{
    strata_error err = {0};
    if (dp_tcp_write_sealed(link, buf, n, &err) != STRATA_OK)
        fail_msg("sealed write: %s", err.msg);
}

/* Writes raw bytes on a link's socket (non-blocking, small writes), under the encryption. */
static void raw_write(dp_link *link, const void *buf, size_t n)
{
    int fd = dp_link_fd(link);
    assert_true(fd >= 0);
    const uint8_t *p = buf;
    while (n > 0) {
        ssize_t r = send(fd, p, n, MSG_NOSIGNAL);
        assert_true(r > 0);
        p += r;
        n -= (size_t)r;
    }
}

static dp_msg_header hdr(unsigned kind, uint64_t step, uint64_t seq, uint32_t layer)
{
    return (dp_msg_header){.kind = (uint16_t)kind, .step = step, .seq = seq, .layer = layer};
}

static void assert_contains(const char *haystack, const char *needle)
{
    if (!strstr(haystack, needle))
        fail_msg("expected \"%s\" in: %s", needle, haystack);
}

/* ---- a sender thread ---- */

typedef struct send_job {
    dp_link *link;
    const dp_msg_header *h;
    uint8_t *const *payloads;
    const size_t *lens;
    int n;
    int rc;
    strata_error err;
} send_job;

static void *send_main(void *p)
{
    send_job *j = p;
    j->rc = STRATA_OK;
    for (int i = 0; i < j->n && j->rc == STRATA_OK; i++)
        j->rc = dp_send(j->link, &j->h[i], j->payloads[i], j->lens[i], &j->err);
    return NULL;
}

/* ---- tests ---- */

static void test_round_trip_kinds_and_sizes(void **state)
{
    (void)state;
    dp_link *server, *client;
    pair(NULL, &server, &client);
    assert_int_equal(dp_link_backend(client), DP_BACKEND_TCP);
    assert_contains(dp_link_describe(client), "tcp 127.0.0.1:");
    assert_contains(dp_link_describe(client), " <-> 127.0.0.1:");
    assert_null(dp_link_broken(client));
    assert_int_equal(dp_link_peer_max_payload(client), DP_DEFAULT_MAX_PAYLOAD);

    enum { N = 8 };
    dp_msg_header h[N] = {
        {.kind = DP_MSG_HIDDEN, .dtype = DP_DTYPE_F32, .step = 7, .seq = 3, .layer = 0, .n_rows = 4,
         .row_bytes = 1024},
        hdr(DP_MSG_KV_BLOCK, 0, 11, 5),
        hdr(DP_MSG_CONTROL, 1, 0, 0),
        hdr(DP_MSG_KV_BLOCK, 2, 12, 29),
        {.kind = DP_MSG_HIDDEN, .dtype = DP_DTYPE_F16, .step = 8, .seq = 3, .n_rows = 1, .row_bytes = 2},
        hdr(DP_MSG_KV_TAIL, 3, 12, 29),
        {.kind = DP_MSG_HIDDEN, .dtype = DP_DTYPE_BF16, .step = UINT64_MAX, .seq = UINT64_MAX - 1,
         .layer = UINT32_MAX, .n_rows = 3, .row_bytes = 1152},
        hdr(DP_MSG_END, 4, 0, 0),
    };
    size_t lens[N] = {4096, 1, 0, 10u << 20, 2, 777, 3 * 1152, 0};
    uint8_t *payloads[N];
    for (int i = 0; i < N; i++)
        payloads[i] = pattern(lens[i], (uint64_t)i + 100);

    send_job job = {.link = client, .h = h, .payloads = payloads, .lens = lens, .n = N};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, send_main, &job), 0);
    size_t cap = 10u << 20;
    uint8_t *buf = malloc(cap);
    assert_non_null(buf);
    strata_error err = {0};
    for (int i = 0; i < N; i++) {
        dp_msg_header got;
        size_t len = 12345;
        memset(buf, 0xEE, lens[i] + 1 < cap ? lens[i] + 1 : cap);
        int rc = dp_recv(server, &got, buf, cap, &len, TIMEOUT, &err);
        if (rc != STRATA_OK)
            fail_msg("message %d: %s %s", i, strata_status_name(rc), err.msg);
        assert_int_equal(len, lens[i]);
        assert_int_equal(got.kind, h[i].kind);
        assert_int_equal(got.dtype, h[i].dtype);
        assert_true(got.step == h[i].step);
        assert_true(got.seq == h[i].seq);
        assert_int_equal(got.layer, h[i].layer);
        assert_int_equal(got.n_rows, h[i].n_rows);
        assert_int_equal(got.row_bytes, h[i].row_bytes);
        assert_int_equal(got.payload_len, lens[i]);
        assert_int_equal(got.flags, DP_FLAG_PAYLOAD_CRC);
        assert_int_equal(got.payload_crc, lens[i] ? kv_crc32c(0, payloads[i], lens[i]) : 0);
        if (lens[i])
            assert_memory_equal(buf, payloads[i], lens[i]);
    }
    assert_int_equal(pthread_join(t, NULL), 0);
    assert_int_equal(job.rc, STRATA_OK);

    /* The other direction on the same link. */
    uint8_t reply[3] = {1, 2, 3}, back[3] = {0};
    dp_msg_header rh = hdr(DP_MSG_CONTROL, 9, 9, 0), got;
    size_t len = 0;
    assert_int_equal(dp_send(server, &rh, reply, sizeof reply, &err), STRATA_OK);
    assert_int_equal(dp_recv(client, &got, back, sizeof back, &len, TIMEOUT, &err), STRATA_OK);
    assert_int_equal(len, 3);
    assert_memory_equal(back, reply, 3);

    for (int i = 0; i < N; i++)
        free(payloads[i]);
    free(buf);
    dp_link_close(client);
    dp_link_close(server);
}

static void test_two_step_and_small_buffers(void **state)
{
    (void)state;
    dp_link *server, *client;
    pair(NULL, &server, &client);
    strata_error err = {0};
    uint8_t *p5000 = pattern(5000, 1), *p3000 = pattern(3000, 2), *p10 = pattern(10, 3), *p64 = pattern(64, 4);
    dp_msg_header h = hdr(DP_MSG_KV_BLOCK, 1, 2, 3);
    assert_int_equal(dp_send(client, &h, p5000, 5000, &err), STRATA_OK);
    assert_int_equal(dp_send(client, &h, p3000, 3000, &err), STRATA_OK);
    dp_msg_header hc = hdr(DP_MSG_CONTROL, 0, 0, 0);
    assert_int_equal(dp_send(client, &hc, p10, 10, &err), STRATA_OK);
    assert_int_equal(dp_send(client, &hc, p64, 64, &err), STRATA_OK);

    uint8_t small[100], big[5000];
    dp_msg_header got;
    size_t len = 0;
    /* Too small: EFULL, header and needed size reported, payload pending. */
    assert_int_equal(dp_recv(server, &got, small, sizeof small, &len, TIMEOUT, &err), STRATA_EFULL);
    assert_int_equal(err.code, STRATA_EFULL);
    assert_contains(err.msg, "5000 bytes does not fit a 100-byte buffer");
    assert_int_equal(len, 5000);
    assert_int_equal(got.kind, DP_MSG_KV_BLOCK);
    assert_int_equal(got.payload_len, 5000);
    /* A new message cannot start while a payload is pending. */
    assert_int_equal(dp_recv(server, &got, small, sizeof small, &len, TIMEOUT, &err), STRATA_EINVAL);
    assert_contains(err.msg, "pending");
    assert_int_equal(dp_recv_payload(server, small, sizeof small, &err), STRATA_EFULL);
    assert_int_equal(dp_recv_payload(server, big, sizeof big, &err), STRATA_OK);
    assert_memory_equal(big, p5000, 5000);
    /* Too small again, then dropped. */
    assert_int_equal(dp_recv(server, &got, small, sizeof small, &len, TIMEOUT, &err), STRATA_EFULL);
    assert_int_equal(len, 3000);
    assert_int_equal(dp_recv_skip(server, &err), STRATA_OK);
    assert_int_equal(dp_recv_skip(server, &err), STRATA_OK); /* nothing pending: no-op */
    /* A size query with no buffer at all. */
    assert_int_equal(dp_recv(server, &got, NULL, 0, &len, TIMEOUT, &err), STRATA_EFULL);
    assert_int_equal(len, 10);
    assert_int_equal(dp_recv_payload(server, small, sizeof small, &err), STRATA_OK);
    assert_memory_equal(small, p10, 10);
    assert_int_equal(dp_recv_payload(server, small, sizeof small, &err), STRATA_EINVAL);
    assert_contains(err.msg, "no payload is pending");
    /* Explicit two-step. */
    assert_int_equal(dp_recv_header(server, &got, TIMEOUT, &err), STRATA_OK);
    assert_int_equal(got.payload_len, 64);
    assert_int_equal(dp_recv_payload(server, small, 64, &err), STRATA_OK);
    assert_memory_equal(small, p64, 64);
    assert_null(dp_link_broken(server));
    free(p5000);
    free(p3000);
    free(p10);
    free(p64);
    dp_link_close(client);
    dp_link_close(server);
}

/* Both ends of a try_pair refused the link with STRATA_EINVAL, each with its message. */
static void refused_both(const accept_job *server, int client_rc, const dp_link *client, const strata_error *cerr,
                         const char *server_msg, const char *client_msg)
{
    assert_int_equal(server->rc, STRATA_EINVAL);
    assert_int_equal(client_rc, STRATA_EINVAL);
    assert_null(server->link);
    assert_null(client);
    assert_contains(server->err.msg, server_msg);
    assert_contains(cerr->msg, client_msg);
}

/* One connection to l that sends n bytes (or, when reflect, the acceptor's own 80-byte hello
 * with the role byte turned to a connector's); the accept ends with rc and a message with want. */
static void raw_refused(dp_listener *l, const void *bytes, size_t n, bool reflect, int rc, const char *want)
{
    accept_job s = {.l = l, .auth = &auth_a, .timeout_ms = TIMEOUT};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, accept_main, &s), 0);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(dp_listener_port(l)),
                             .sin_addr.s_addr = htonl(0x7f000001)};
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    uint8_t hello[80];
    if (reflect) {
        size_t got = 0;
        while (got < sizeof hello) {
            ssize_t r = recv(fd, hello + got, sizeof hello - got, 0);
            assert_true(r > 0);
            got += (size_t)r;
        }
        hello[6] = 0;
        bytes = hello;
        n = sizeof hello;
    }
    assert_int_equal(send(fd, bytes, n, MSG_NOSIGNAL), (ssize_t)n);
    assert_int_equal(pthread_join(t, NULL), 0);
    if (s.rc != rc || !strstr(s.err.msg, want))
        fail_msg("expected %d \"%s\", got %d \"%s\"", rc, want, s.rc, s.err.msg);
    close(fd);
}

static void test_authentication(void **state)
{
    (void)state;
    dp_listener *l;
    char addr[64];
    listen_local(&l, addr, sizeof addr);
    accept_job s;
    dp_link *client = NULL;
    strata_error cerr = {0};
    int crc;
    /* Wrong secret: both sides refuse. */
    try_pair(l, addr, &auth_a, NULL, &auth_b, NULL, &s, &crc, &client, &cerr);
    refused_both(&s, crc, client, &cerr, "failed authentication", "failed authentication");
    assert_contains(cerr.msg, "127.0.0.1:");
    /* The listener is still usable: the right secret gets through. */
    try_pair(l, addr, &auth_a, NULL, &auth_a, NULL, &s, &crc, &client, &cerr);
    assert_int_equal(s.rc, STRATA_OK);
    assert_int_equal(crc, STRATA_OK);
    dp_link_close(client);
    dp_link_close(s.link);

    /* Purposes: a migration's sender at a wait for a pipeline link is refused on both sides
     * after the proofs, and the listener goes on; the same purpose, or one side naming none,
     * connects. */
    const dp_options rows = {.purpose = DP_PURPOSE_ROWS}, migration = {.purpose = DP_PURPOSE_MIGRATION};
    try_pair(l, addr, &auth_a, &rows, &auth_a, &migration, &s, &crc, &client, &cerr);
    refused_both(&s, crc, client, &cerr, "connected for a migration, this side waits for a pipeline link",
                 "connected for a pipeline link, this side asked for a migration");
    const dp_options *fits[][2] = {{&rows, &rows}, {&migration, &migration}, {&rows, NULL}, {NULL, &migration}};
    for (size_t i = 0; i < sizeof fits / sizeof fits[0]; i++) {
        try_pair(l, addr, &auth_a, fits[i][0], &auth_a, fits[i][1], &s, &crc, &client, &cerr);
        if (s.rc != STRATA_OK || crc != STRATA_OK)
            fail_msg("purposes %zu: accept %s (%s), connect %s (%s)", i, strata_status_name(s.rc), s.err.msg,
                     strata_status_name(crc), cerr.msg);
        dp_link_close(client);
        dp_link_close(s.link);
    }

    /* No secret, or a short one, is refused before any I/O. */
    strata_error err = {0};
    dp_link *link = NULL;
    assert_int_equal(dp_tcp_connect(addr, NULL, NULL, TIMEOUT, &link, &err), STRATA_EINVAL);
    assert_contains(err.msg, "secret");
    dp_auth shorty = {secret_a, 8};
    assert_int_equal(dp_tcp_connect(addr, &shorty, NULL, TIMEOUT, &link, &err), STRATA_EINVAL);
    assert_int_equal(dp_tcp_accept(l, &shorty, NULL, 10, &link, &err), STRATA_EINVAL);
    assert_null(link);

    /* A peer that is not a strata endpoint. */
    char junk[48];
    memset(junk, 'x', sizeof junk);
    memcpy(junk, "GET / HTTP/1.1\r\n", 16);
    raw_refused(l, junk, sizeof junk, false, STRATA_EFORMAT, "not a strata data-plane endpoint");

    /* A version 1 peer (48-byte hello, no encryption): refused, both versions named, without
     * waiting for the 32 bytes of a key it never sends. */
    const uint8_t v1[48] = {'S', 'D', 'P', 'H', 1, 0, 0, 0, 0, 0, 0, 1};
    raw_refused(l, v1, sizeof v1, false, STRATA_EFORMAT, "speaks data-plane version 1, this build 2");

    /* Hellos of the right version that the acceptor refuses before any proof: another acceptor's
     * role, a purpose it does not know, room for no payload, and its own hello sent back with
     * the role turned (a reflection: the nonce is its own). */
    uint8_t hello[80] = {'S', 'D', 'P', 'H', 2, 0, 1, 0, 0, 0, 1};
    raw_refused(l, hello, sizeof hello, false, STRATA_EFORMAT, "sent a bad hello (role 1, purpose 0)");
    hello[6] = 0;
    hello[7] = DP_PURPOSE_MIGRATION + 1;
    raw_refused(l, hello, sizeof hello, false, STRATA_EFORMAT, "sent a bad hello (role 0, purpose 3)");
    hello[7] = DP_PURPOSE_ROWS;
    hello[10] = 0;
    raw_refused(l, hello, sizeof hello, false, STRATA_EFORMAT, "accepts no payload (max 0)");
    raw_refused(l, NULL, 0, true, STRATA_EINVAL, "echoed our nonce (reflection)");
    dp_listener_close(l);
}

typedef struct connect_job {
    const char *addr;
    dp_link *link;
    int rc;
    strata_error err;
} connect_job;

static void *connect_main(void *p)
{
    connect_job *j = p;
    j->rc = dp_tcp_connect(j->addr, &auth_a, NULL, TIMEOUT, &j->link, &j->err);
    return NULL;
}

/* Connections that send nothing (or trickle), accepted before the real peer, do not hold the
 * acceptor: handshakes run side by side, so the real peer links at once on the first call,
 * whatever the accept's window (a window, none (-1), or 0: what is pending now; before, -1 let a
 * silent connection hold the listener for good, 0 failed every handshake while the connector
 * believed it had a link, and each silent connection cost the real peer 3 s). */
static void silent_then_real(int n_silent, int timeout_ms)
{
    dp_listener *l;
    char addr[64];
    listen_local(&l, addr, sizeof addr);
    int fds[8];
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(dp_listener_port(l)),
                             .sin_addr.s_addr = htonl(0x7f000001)};
    for (int k = 0; k < n_silent; k++) {
        fds[k] = socket(AF_INET, SOCK_STREAM, 0);
        assert_true(fds[k] >= 0);
        assert_int_equal(connect(fds[k], (struct sockaddr *)&sa, sizeof sa), 0);
        if (k % 2)   /* a hello's first bytes, then nothing */
            assert_int_equal(write(fds[k], "SDPH", 4), 4);
    }
    connect_job j = {.addr = addr};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, connect_main, &j), 0);
    if (timeout_ms == 0) {   /* an event loop's pattern: wait until the listener is readable */
        struct pollfd pfd = {.fd = dp_listener_fd(l), .events = POLLIN};
        assert_int_equal(poll(&pfd, 1, 5000), 1);
        usleep(100 * 1000);   /* the real peer's connection is pending too */
    }
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    dp_link *link = NULL;
    strata_error err = {0};
    int rc = dp_tcp_accept(l, &auth_a, NULL, timeout_ms, &link, &err);
    clock_gettime(CLOCK_MONOTONIC, &b);
    assert_int_equal(pthread_join(t, NULL), 0);
    if (rc != STRATA_OK || j.rc != STRATA_OK)
        fail_msg("%d silent, timeout %d: accept: %s; connect: %s", n_silent, timeout_ms, err.msg, j.err.msg);
    const long ms = (b.tv_sec - a.tv_sec) * 1000 + (b.tv_nsec - a.tv_nsec) / 1000000;
    if (ms >= DP_HANDSHAKE_TIMEOUT_MS)
        fail_msg("%d silent, timeout %d: the real peer waited %ld ms", n_silent, timeout_ms, ms);
    /* The link works both ways. */
    uint8_t byte = 7;
    dp_msg_header h = hdr(DP_MSG_KV_BLOCK, 1, 2, 3);
    assert_int_equal(dp_send(j.link, &h, &byte, 1, &err), STRATA_OK);
    dp_msg_header got;
    uint8_t back = 0;
    size_t len = 0;
    assert_int_equal(dp_recv(link, &got, &back, 1, &len, TIMEOUT, &err), STRATA_OK);
    assert_int_equal(back, 7);
    dp_link_close(link);
    dp_link_close(j.link);
    for (int k = 0; k < n_silent; k++)
        close(fds[k]);
    dp_listener_close(l);
}

static void test_silent_connection_first(void **state)
{
    (void)state;
    silent_then_real(1, TIMEOUT);
    silent_then_real(5, TIMEOUT);
    silent_then_real(2, -1);
    silent_then_real(2, 0);
}

static void test_peer_closes_mid_payload(void **state)
{
    (void)state;
    dp_link *server, *client;
    pair(NULL, &server, &client);
    strata_error err = {0};
    uint8_t *p = pattern(1000, 9);
    uint8_t frame[DP_FRAME_HEADER_BYTES];
    dp_msg_header h = hdr(DP_MSG_KV_BLOCK, 5, 6, 7);
    assert_int_equal(dp_frame_encode(&h, 1000, kv_crc32c(0, p, 1000), DP_FLAG_PAYLOAD_CRC, frame, &err), STRATA_OK);
    sealed_write(client, frame, sizeof frame);
    sealed_write(client, p, 100);
    dp_link_close(client);
    uint8_t buf[1000];
    dp_msg_header got;
    size_t len;
    assert_int_equal(dp_recv(server, &got, buf, sizeof buf, &len, TIMEOUT, &err), STRATA_EIO);
    assert_contains(err.msg, "peer closed after 100 of 1000 payload bytes");
    assert_non_null(dp_link_broken(server));
    /* Refused from now on, naming the first error. */
    assert_int_equal(dp_recv(server, &got, buf, sizeof buf, &len, TIMEOUT, &err), STRATA_EIO);
    assert_contains(err.msg, "unusable after an earlier error");
    assert_contains(err.msg, "peer closed after 100 of 1000");
    assert_int_equal(dp_send(server, &h, p, 10, &err), STRATA_EIO);
    assert_contains(err.msg, "unusable");
    dp_link_close(server);

    /* Mid-header, and between messages. */
    pair(NULL, &server, &client);
    sealed_write(client, frame, 10);
    dp_link_close(client);
    assert_int_equal(dp_recv(server, &got, buf, sizeof buf, &len, TIMEOUT, &err), STRATA_EIO);
    assert_contains(err.msg, "peer closed after 10 of 64 header bytes");
    dp_link_close(server);
    pair(NULL, &server, &client);
    dp_link_close(client);
    assert_int_equal(dp_recv(server, &got, buf, sizeof buf, &len, TIMEOUT, &err), STRATA_EIO);
    assert_contains(err.msg, "peer closed the connection");
    dp_link_close(server);
    free(p);
}

static void test_corrupted_frames(void **state)
{
    (void)state;
    strata_error err = {0};
    uint8_t *p = pattern(256, 10);
    uint8_t frame[DP_FRAME_HEADER_BYTES], buf[256];
    dp_msg_header h = hdr(DP_MSG_KV_BLOCK, 1, 2, 3), got;
    size_t len;
    dp_link *server, *client;

    /* A payload byte flipped after the CRC was computed. */
    pair(NULL, &server, &client);
    assert_int_equal(dp_frame_encode(&h, 256, kv_crc32c(0, p, 256), DP_FLAG_PAYLOAD_CRC, frame, &err), STRATA_OK);
    p[77] ^= 0x10;
    sealed_write(client, frame, sizeof frame);
    sealed_write(client, p, 256);
    assert_int_equal(dp_recv(server, &got, buf, sizeof buf, &len, TIMEOUT, &err), STRATA_ECRC);
    assert_contains(err.msg, "CRC32C mismatch in the 256-byte payload of a KV_BLOCK message");
    assert_non_null(dp_link_broken(server));
    assert_int_equal(dp_recv(server, &got, buf, sizeof buf, &len, TIMEOUT, &err), STRATA_EIO);
    assert_contains(err.msg, "unusable");
    dp_link_close(server);
    dp_link_close(client);

    /* A header byte flipped: the header CRC catches it. */
    pair(NULL, &server, &client);
    assert_int_equal(dp_frame_encode(&h, 0, 0, DP_FLAG_PAYLOAD_CRC, frame, &err), STRATA_OK);
    frame[20] ^= 1;
    sealed_write(client, frame, sizeof frame);
    assert_int_equal(dp_recv(server, &got, buf, sizeof buf, &len, TIMEOUT, &err), STRATA_ECRC);
    assert_contains(err.msg, "header CRC32C mismatch");
    dp_link_close(server);
    dp_link_close(client);

    /* Garbage. */
    pair(NULL, &server, &client);
    memset(frame, 'Z', sizeof frame);
    sealed_write(client, frame, sizeof frame);
    assert_int_equal(dp_recv(server, &got, buf, sizeof buf, &len, TIMEOUT, &err), STRATA_EFORMAT);
    assert_contains(err.msg, "bad frame magic 5a 5a 5a 5a");
    assert_non_null(dp_link_broken(server));
    dp_link_close(server);
    dp_link_close(client);

    /* A frame without the payload CRC flag is not a TCP frame. */
    pair(NULL, &server, &client);
    assert_int_equal(dp_frame_encode(&h, 0, 0, 0, frame, &err), STRATA_OK);
    sealed_write(client, frame, sizeof frame);
    assert_int_equal(dp_recv(server, &got, buf, sizeof buf, &len, TIMEOUT, &err), STRATA_EFORMAT);
    assert_contains(err.msg, "without a payload CRC");
    dp_link_close(server);
    dp_link_close(client);
    free(p);
}

/* ---- encryption: a relay between the two ends records (and may alter) the wire ---- */

typedef struct relay {
    int listen_fd;
    int target_port;
    uint8_t *seen;       /* the client-to-server bytes, up to cap */
    size_t cap, n_seen;
    long flip_at;        /* index in the client-to-server stream to flip one bit of, -1 none */
} relay;

static void *relay_main(void *p)
{
    relay *r = p;
    int a = accept(r->listen_fd, NULL, NULL);
    assert_true(a >= 0);
    int b = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(b >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)r->target_port),
                             .sin_addr.s_addr = htonl(0x7f000001)};
    assert_int_equal(connect(b, (struct sockaddr *)&sa, sizeof sa), 0);
    uint8_t buf[65536];
    for (;;) {
        struct pollfd pf[2] = {{.fd = a, .events = POLLIN}, {.fd = b, .events = POLLIN}};
        if (poll(pf, 2, 20000) <= 0)
            break;
        int from = pf[0].revents ? 0 : 1;
        ssize_t n = read(from == 0 ? a : b, buf, sizeof buf);
        if (n <= 0)
            break;
        if (from == 0) {
            for (ssize_t i = 0; i < n; i++) {
                if ((long)(r->n_seen + (size_t)i) == r->flip_at)
                    buf[i] ^= 0x04;
            }
            size_t keep = r->cap - r->n_seen < (size_t)n ? r->cap - r->n_seen : (size_t)n;
            memcpy(r->seen + r->n_seen, buf, keep);
            r->n_seen += keep;
        }
        for (ssize_t off = 0; off < n;) {
            ssize_t w = send(from == 0 ? b : a, buf + off, (size_t)(n - off), MSG_NOSIGNAL);
            if (w <= 0)
                goto done;
            off += w;
        }
    }
done:
    close(a);
    close(b);
    return NULL;
}

/* A pair whose client reaches the server through a relay. */
static void relayed_pair(relay *r, pthread_t *rt, dp_link **server, dp_link **client)
{
    dp_listener *l;
    char addr[64];
    listen_local(&l, addr, sizeof addr);
    r->target_port = dp_listener_port(l);
    r->listen_fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(r->listen_fd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(0x7f000001)};
    socklen_t slen = sizeof sa;
    assert_int_equal(bind(r->listen_fd, (struct sockaddr *)&sa, sizeof sa), 0);
    assert_int_equal(listen(r->listen_fd, 1), 0);
    assert_int_equal(getsockname(r->listen_fd, (struct sockaddr *)&sa, &slen), 0);
    char raddr[64];
    snprintf(raddr, sizeof raddr, "127.0.0.1:%u", (unsigned)ntohs(sa.sin_port));
    assert_int_equal(pthread_create(rt, NULL, relay_main, r), 0);
    accept_job s;
    strata_error cerr = {0};
    int crc;
    try_pair(l, raddr, &auth_a, NULL, &auth_a, NULL, &s, &crc, client, &cerr);
    if (s.rc != STRATA_OK || crc != STRATA_OK)
        fail_msg("relayed pair: accept %s, connect %s", s.err.msg, cerr.msg);
    *server = s.link;
    dp_listener_close(l);
    close(r->listen_fd);
}

/* Decrypts the client-to-server records of a recorded stream as README.md describes them (an
 * 80-byte hello, a 32-byte proof, then u32 length || AES-256-GCM ciphertext || tag, the length
 * as additional data, nonce 4 zero bytes || u64 record number), independently of the link's
 * code. Returns the plaintext length. */
static size_t decrypt_recorded(const uint8_t *wire, size_t n, const uint8_t key[32], uint8_t *out, size_t cap)
{
    size_t at = 80 + 32, plain = 0;
    assert_memory_equal(wire, "SDPH\x02\x00", 6);
    EVP_CIPHER_CTX *ctx = EVP_CIPHER_CTX_new();
    assert_non_null(ctx);
    for (uint64_t rec = 0; at < n; rec++) {
        assert_true(n - at >= 4);
        uint32_t len = (uint32_t)wire[at] | (uint32_t)wire[at + 1] << 8 | (uint32_t)wire[at + 2] << 16 |
                       (uint32_t)wire[at + 3] << 24;
        assert_true(len >= 1 && len <= 65536 && n - at >= 4 + (size_t)len + 16 && plain + len <= cap);
        uint8_t nonce[12] = {0};
        for (int i = 0; i < 8; i++)
            nonce[4 + i] = (uint8_t)(rec >> (8 * i));
        int outl = 0;
        assert_true(EVP_DecryptInit_ex(ctx, EVP_aes_256_gcm(), NULL, key, nonce) > 0);
        assert_true(EVP_DecryptUpdate(ctx, NULL, &outl, wire + at, 4) > 0);
        assert_true(EVP_DecryptUpdate(ctx, out + plain, &outl, wire + at + 4, (int)len) > 0);
        assert_true(EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_TAG, 16, (void *)(wire + at + 4 + len)) > 0);
        if (EVP_DecryptFinal_ex(ctx, out + plain + len, &outl) <= 0)
            fail_msg("record %" PRIu64 " at wire offset %zu does not verify", rec, at);
        plain += len;
        at += 4 + (size_t)len + 16;
    }
    EVP_CIPHER_CTX_free(ctx);
    return plain;
}

static void test_encryption(void **state)
{
    (void)state;
    const size_t n = 300000; /* several records */
    uint8_t *p = pattern(n, 31);
    dp_msg_header h = hdr(DP_MSG_HIDDEN, 9, 8, 7), got;
    h.dtype = DP_DTYPE_F32;
    h.n_rows = 75;
    h.row_bytes = 4000;
    strata_error err = {0};
    size_t len = 0;
    uint8_t *buf = malloc(n);
    assert_non_null(buf);

    /* What crosses the wire is not the message, and decrypts to it with the link's key. */
    relay r = {.cap = 1u << 20, .flip_at = -1};
    r.seen = malloc(r.cap);
    assert_non_null(r.seen);
    pthread_t rt;
    dp_link *server, *client;
    relayed_pair(&r, &rt, &server, &client);
    assert_int_equal(dp_send(client, &h, p, n, &err), STRATA_OK);
    assert_int_equal(dp_recv(server, &got, buf, n, &len, TIMEOUT, &err), STRATA_OK);
    assert_true(len == n && memcmp(buf, p, n) == 0);
    uint8_t ck_send[32], ck_recv[32], sk_send[32], sk_recv[32];
    assert_int_equal(dp_tcp_link_keys(client, ck_send, ck_recv), STRATA_OK);
    assert_int_equal(dp_tcp_link_keys(server, sk_send, sk_recv), STRATA_OK);
    assert_memory_equal(ck_send, sk_recv, 32);
    assert_memory_equal(ck_recv, sk_send, 32);
    assert_memory_not_equal(ck_send, ck_recv, 32);
    dp_link_close(client);
    dp_link_close(server);
    assert_int_equal(pthread_join(rt, NULL), 0);
    assert_true(r.n_seen > n);
    for (size_t at = 0; at + 16 <= n; at += 4093)
        assert_null(memmem(r.seen, r.n_seen, p + at, 16));
    assert_null(memmem(r.seen, r.n_seen, "SDP1", 4)); /* no frame header in clear */
    uint8_t *plain = malloc(n + 1024);
    assert_non_null(plain);
    size_t plain_len = decrypt_recorded(r.seen, r.n_seen, ck_send, plain, n + 1024);
    assert_int_equal(plain_len, DP_FRAME_HEADER_BYTES + n);
    dp_msg_header decoded;
    assert_int_equal(dp_frame_decode(plain, UINT64_MAX, &decoded, &err), STRATA_OK);
    assert_true(decoded.kind == DP_MSG_HIDDEN && decoded.step == 9 && decoded.seq == 8 && decoded.layer == 7 &&
                decoded.payload_len == n);
    assert_memory_equal(plain + DP_FRAME_HEADER_BYTES, p, n);

    /* Every link has its own keys. */
    dp_link *server2, *client2;
    pair(NULL, &server2, &client2);
    uint8_t k2[32], k2r[32];
    assert_int_equal(dp_tcp_link_keys(client2, k2, k2r), STRATA_OK);
    assert_memory_not_equal(k2, ck_send, 32);
    dp_link_close(client2);
    dp_link_close(server2);

    /* One bit altered in transit, in the payload's ciphertext: refused, the link breaks. */
    relay t = {.cap = 1u << 20, .flip_at = 80 + 32 + 4 + 70000};
    t.seen = r.seen;
    relayed_pair(&t, &rt, &server, &client);
    assert_int_equal(dp_send(client, &h, p, n, &err), STRATA_OK);
    assert_int_equal(dp_recv(server, &got, buf, n, &len, TIMEOUT, &err), STRATA_ECRC);
    assert_contains(err.msg, "failed authentication after 65472 of 300000 payload bytes");
    assert_non_null(dp_link_broken(server));
    dp_link_close(client);
    dp_link_close(server);
    assert_int_equal(pthread_join(rt, NULL), 0);

    /* Bytes that are no sealed record: an absurd length, then a record that is not sealed. */
    pair(NULL, &server, &client);
    raw_write(client, "\xff\xff\xff\x7f", 4);
    assert_int_equal(dp_recv(server, &got, buf, n, &len, TIMEOUT, &err), STRATA_EFORMAT);
    assert_contains(err.msg, "a record announces 2147483647 bytes (1..65536) after 0 of 64 header bytes");
    dp_link_close(client);
    dp_link_close(server);
    pair(NULL, &server, &client);
    uint8_t fake[4 + 64 + 16] = {64};
    raw_write(client, fake, sizeof fake);
    assert_int_equal(dp_recv(server, &got, buf, n, &len, TIMEOUT, &err), STRATA_ECRC);
    assert_contains(err.msg, "failed authentication after 0 of 64 header bytes");
    dp_link_close(client);
    dp_link_close(server);

    free(plain);
    free(r.seen);
    free(buf);
    free(p);
}

static void test_max_payload(void **state)
{
    (void)state;
    dp_options sopts = {.max_payload = 1u << 20};
    dp_link *server, *client;
    pair(&sopts, &server, &client);
    assert_int_equal(dp_link_peer_max_payload(client), 1u << 20);
    strata_error err = {0};
    uint8_t *p = pattern((1u << 20) + 1, 11);
    dp_msg_header h = hdr(DP_MSG_KV_BLOCK, 0, 0, 0), got;
    /* The sender knows the peer's limit: refused locally, the link stays usable. */
    assert_int_equal(dp_send(client, &h, p, (1u << 20) + 1, &err), STRATA_EINVAL);
    assert_contains(err.msg, "over the peer's maximum of 1048576");
    assert_null(dp_link_broken(client));
    assert_int_equal(dp_send(client, &h, p, 100, &err), STRATA_OK);
    size_t len;
    uint8_t small[100];
    assert_int_equal(dp_recv(server, &got, small, sizeof small, &len, TIMEOUT, &err), STRATA_OK);
    assert_memory_equal(small, p, 100);
    /* A forged frame over the receiver's limit breaks the link. */
    uint8_t frame[DP_FRAME_HEADER_BYTES];
    assert_int_equal(dp_frame_encode(&h, 2u << 20, 0, DP_FLAG_PAYLOAD_CRC, frame, &err), STRATA_OK);
    sealed_write(client, frame, sizeof frame);
    assert_int_equal(dp_recv(server, &got, small, sizeof small, &len, TIMEOUT, &err), STRATA_EFORMAT);
    assert_contains(err.msg, "payload of 2097152 bytes, over this link's maximum of 1048576");
    assert_non_null(dp_link_broken(server));
    free(p);
    dp_link_close(server);
    dp_link_close(client);
}

/* A frame above DP_DEFAULT_MAX_PAYLOAD, as a long sequence's migration image is (the worker raises
 * max_payload to its image bound): 300 MiB crosses whole, its CRC checked, its bytes equal. */
static void test_frame_above_default_limit(void **state)
{
    (void)state;
    const size_t big = (size_t)300 << 20;
    dp_options sopts = {.max_payload = (uint64_t)512 << 20};
    dp_link *server, *client;
    pair(&sopts, &server, &client);
    assert_true(dp_link_peer_max_payload(client) == sopts.max_payload);
    uint8_t *p = pattern(big, 21);
    dp_msg_header h = hdr(DP_MSG_CONTROL, 0, 77, 0);
    size_t len = big;
    send_job job = {.link = client, .h = &h, .payloads = &p, .lens = &len, .n = 1};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, send_main, &job), 0);
    uint8_t *buf = malloc(big);
    assert_non_null(buf);
    strata_error err = {0};
    dp_msg_header got;
    size_t got_len = 0;
    int rc = dp_recv(server, &got, buf, big, &got_len, 120000, &err);
    assert_int_equal(pthread_join(t, NULL), 0);
    if (rc != STRATA_OK || job.rc != STRATA_OK)
        fail_msg("300 MiB frame: receive %s (%s), send %s (%s)", strata_status_name(rc), err.msg,
                 strata_status_name(job.rc), job.err.msg);
    assert_true(got_len == big && got.payload_len == big && got.seq == 77);
    assert_true(memcmp(buf, p, big) == 0);
    free(buf);
    free(p);
    dp_link_close(server);
    dp_link_close(client);
}

static void test_timeouts(void **state)
{
    (void)state;
    dp_options sopts = {.io_timeout_ms = 100};
    dp_link *server, *client;
    pair(&sopts, &server, &client);
    strata_error err = {0};
    dp_msg_header got;
    uint8_t buf[64];
    size_t len;
    /* A plain timeout: nothing arrived, the link stays usable. */
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    assert_int_equal(dp_recv(server, &got, buf, sizeof buf, &len, 50, &err), STRATA_EIO);
    clock_gettime(CLOCK_MONOTONIC, &b);
    long ms = (b.tv_sec - a.tv_sec) * 1000 + (b.tv_nsec - a.tv_nsec) / 1000000;
    assert_true(ms >= 45);
    assert_contains(err.msg, "timed out after 50 ms waiting for a message");
    assert_null(dp_link_broken(server));
    assert_int_equal(dp_recv(server, &got, buf, sizeof buf, &len, 0, &err), STRATA_EIO);
    assert_contains(err.msg, "timed out");
    dp_msg_header h = hdr(DP_MSG_CONTROL, 1, 1, 1);
    assert_int_equal(dp_send(client, &h, "hello", 5, &err), STRATA_OK);
    assert_int_equal(dp_recv(server, &got, buf, sizeof buf, &len, TIMEOUT, &err), STRATA_OK);
    assert_int_equal(len, 5);
    assert_memory_equal(buf, "hello", 5);
    /* A stall in the middle of a frame breaks the link after io_timeout_ms. */
    uint8_t frame[DP_FRAME_HEADER_BYTES];
    assert_int_equal(dp_frame_encode(&h, 0, 0, DP_FLAG_PAYLOAD_CRC, frame, &err), STRATA_OK);
    sealed_write(client, frame, 10);
    assert_int_equal(dp_recv(server, &got, buf, sizeof buf, &len, TIMEOUT, &err), STRATA_EIO);
    assert_contains(err.msg, "stalled for 100 ms after 10 of 64 header bytes");
    assert_non_null(dp_link_broken(server));
    dp_link_close(server);
    dp_link_close(client);

    /* accept with nobody connecting */
    dp_listener *l;
    char addr[64];
    listen_local(&l, addr, sizeof addr);
    dp_link *link = NULL;
    assert_int_equal(dp_tcp_accept(l, &auth_a, NULL, 30, &link, &err), STRATA_EIO);
    assert_contains(err.msg, "timed out");
    assert_null(link);
    dp_listener_close(l);
}

static void test_connect_errors(void **state)
{
    (void)state;
    dp_listener *l;
    char addr[64];
    listen_local(&l, addr, sizeof addr);
    dp_listener_close(l); /* nobody listens there now */
    strata_error err = {0};
    dp_link *link = NULL;
    assert_int_equal(dp_tcp_connect(addr, &auth_a, NULL, TIMEOUT, &link, &err), STRATA_EIO);
    assert_contains(err.msg, addr);
    assert_contains(err.msg, "Connection refused");
    assert_null(link);
    assert_int_equal(dp_tcp_connect("localhost", &auth_a, NULL, TIMEOUT, &link, &err), STRATA_EINVAL);
    assert_int_equal(dp_tcp_connect("127.0.0.1:70000", &auth_a, NULL, TIMEOUT, &link, &err), STRATA_EINVAL);
    assert_int_equal(dp_tcp_connect("::1:4000", &auth_a, NULL, TIMEOUT, &link, &err), STRATA_EINVAL);
    assert_int_equal(dp_tcp_listen("127.0.0.1:", &l, &err), STRATA_EINVAL);
}

static void test_send_to_closed_peer(void **state)
{
    (void)state;
    dp_link *server, *client;
    pair(NULL, &server, &client);
    dp_link_close(server);
    strata_error err = {0};
    uint8_t *p = pattern(65536, 12);
    dp_msg_header h = hdr(DP_MSG_KV_BLOCK, 0, 0, 0);
    int rc = STRATA_OK;
    for (int i = 0; i < 1000 && rc == STRATA_OK; i++) /* the first sends may still be buffered */
        rc = dp_send(client, &h, p, 65536, &err);
    assert_int_equal(rc, STRATA_EIO); /* and no SIGPIPE killed us */
    assert_contains(err.msg, "send of a KV_BLOCK message failed");
    assert_non_null(dp_link_broken(client));
    free(p);
    dp_link_close(client);
}

static void test_frame_codec(void **state)
{
    (void)state;
    strata_error err = {0};
    uint8_t f[DP_FRAME_HEADER_BYTES];
    dp_msg_header h = {.kind = DP_MSG_HIDDEN, .dtype = DP_DTYPE_F16, .layer = 0x01020304, .step = 0x1122334455667788ull,
                       .seq = 42, .n_rows = 3, .row_bytes = 8}, got;
    assert_int_equal(dp_frame_encode(&h, 24, 0xdeadbeef, DP_FLAG_PAYLOAD_CRC, f, &err), STRATA_OK);
    assert_memory_equal(f, "SDP1", 4);
    assert_int_equal(f[4], 1);                                 /* version, little-endian */
    assert_int_equal(f[12], 0x04);                             /* layer LSB first */
    assert_int_equal(f[16], 0x88);                             /* step LSB first */
    assert_int_equal(f[40], 24);                               /* payload length */
    assert_int_equal(f[48], 0xef);                             /* payload crc */
    assert_int_equal(dp_frame_decode(f, 1000, &got, &err), STRATA_OK);
    assert_int_equal(got.kind, h.kind);
    assert_int_equal(got.layer, h.layer);
    assert_true(got.step == h.step);
    assert_int_equal(got.payload_len, 24);
    assert_int_equal(got.payload_crc, 0xdeadbeef);
    assert_int_equal(dp_frame_decode(f, 23, &got, &err), STRATA_EFORMAT);

    /* Send-side rules. */
    dp_msg_header bad = h;
    bad.kind = 9;
    assert_int_equal(dp_frame_encode(&bad, 24, 0, 0, f, &err), STRATA_EINVAL);
    assert_contains(err.msg, "unknown message kind 9");
    bad = h;
    assert_int_equal(dp_frame_encode(&bad, 25, 0, 0, f, &err), STRATA_EINVAL);
    assert_contains(err.msg, "does not hold 3 rows of 8 bytes");
    bad.dtype = DP_DTYPE_BYTES;
    assert_int_equal(dp_frame_encode(&bad, 24, 0, 0, f, &err), STRATA_EINVAL);
    bad = h;
    bad.dtype = DP_DTYPE_F32;
    bad.row_bytes = 6;
    bad.n_rows = 4;
    assert_int_equal(dp_frame_encode(&bad, 24, 0, 0, f, &err), STRATA_EINVAL);
    assert_contains(err.msg, "not a whole number of 4-byte elements");
    assert_int_equal(dp_frame_encode(&h, 24, 0, 0x8000, f, &err), STRATA_EINVAL);

    /* Receive-side: a reserved byte set (with a valid header CRC) and an unknown kind. */
    assert_int_equal(dp_frame_encode(&h, 24, 0, DP_FLAG_PAYLOAD_CRC, f, &err), STRATA_OK);
    f[55] = 1;
    uint32_t c = kv_crc32c(0, f, 60);
    f[60] = (uint8_t)c, f[61] = (uint8_t)(c >> 8), f[62] = (uint8_t)(c >> 16), f[63] = (uint8_t)(c >> 24);
    assert_int_equal(dp_frame_decode(f, 1000, &got, &err), STRATA_EFORMAT);
    assert_contains(err.msg, "reserved");
    f[55] = 0;
    f[6] = 0; /* kind 0 */
    c = kv_crc32c(0, f, 60);
    f[60] = (uint8_t)c, f[61] = (uint8_t)(c >> 8), f[62] = (uint8_t)(c >> 16), f[63] = (uint8_t)(c >> 24);
    assert_int_equal(dp_frame_decode(f, 1000, &got, &err), STRATA_EFORMAT);
    assert_contains(err.msg, "unknown message kind 0");
    f[4] = 2;
    assert_int_equal(dp_frame_decode(f, 1000, &got, &err), STRATA_EFORMAT);
    assert_contains(err.msg, "version 2");

    /* A bad header on a live link is refused locally and the link stays usable. */
    dp_link *server, *client;
    pair(NULL, &server, &client);
    bad = h;
    bad.kind = 0;
    assert_int_equal(dp_send(client, &bad, "x", 1, &err), STRATA_EINVAL);
    assert_int_equal(dp_send(client, &h, NULL, 24, &err), STRATA_EINVAL);
    assert_null(dp_link_broken(client));
    uint8_t rows[24];
    fill(rows, sizeof rows, 5);
    assert_int_equal(dp_send(client, &h, rows, sizeof rows, &err), STRATA_OK);
    uint8_t back[24];
    size_t len;
    assert_int_equal(dp_recv(server, &got, back, sizeof back, &len, TIMEOUT, &err), STRATA_OK);
    assert_memory_equal(back, rows, 24);
    dp_link_close(server);
    dp_link_close(client);
    assert_string_equal(dp_kind_name(DP_MSG_KV_TAIL), "KV_TAIL");
}

/* ---- agreeing on NCCL beside a TCP link ---- */

typedef struct upgrade_job {
    dp_link *tcp;
    bool upstream;
    int device;
    dp_link *nccl;
    int rc;
    strata_error err;
} upgrade_job;

static void *upgrade_main(void *p)
{
    upgrade_job *j = p;
    j->rc = dp_nccl_upgrade(j->tcp, j->upstream, j->device, NULL, &j->nccl, &j->err);
    return NULL;
}

/* Where either side has no GPU (or the build no NCCL) the two sides agree on none, quickly, and
 * the TCP link carries on with the next message; a peer that sends something else than the
 * offer or the answer is refused. (Agreeing on a link needs two GPUs: not exercised here.) */
static void test_nccl_upgrade(void **state)
{
    (void)state;
    const int devices[][2] = {{-1, -1}, {0, -1}, {-1, 0}};
    for (size_t k = 0; k < sizeof devices / sizeof devices[0]; k++) {
        dp_link *server, *client;
        pair(NULL, &server, &client);
        upgrade_job up = {.tcp = client, .upstream = true, .device = devices[k][0]};
        upgrade_job down = {.tcp = server, .upstream = false, .device = devices[k][1]};
        pthread_t t;
        assert_int_equal(pthread_create(&t, NULL, upgrade_main, &down), 0);
        upgrade_main(&up);
        assert_int_equal(pthread_join(t, NULL), 0);
        if (up.rc != STRATA_OK || down.rc != STRATA_OK)
            fail_msg("case %zu: %s / %s", k, up.err.msg, down.err.msg);
        assert_null(up.nccl);
        assert_null(down.nccl);
        /* The link goes on: the next message is the caller's. */
        strata_error err = {0};
        uint8_t in[4] = {1, 2, 3, 4}, out[4] = {0};
        dp_msg_header h = hdr(DP_MSG_CONTROL, 7, 0, 0), got;
        size_t len = 0;
        assert_int_equal(dp_send(client, &h, in, sizeof in, &err), STRATA_OK);
        assert_int_equal(dp_recv(server, &got, out, sizeof out, &len, TIMEOUT, &err), STRATA_OK);
        assert_int_equal(got.step, 7);
        assert_memory_equal(in, out, sizeof in);
        dp_link_close(server);
        dp_link_close(client);
    }
    /* Something else than the offer. */
    dp_link *server, *client;
    pair(NULL, &server, &client);
    strata_error err = {0};
    float row[4] = {0};
    dp_msg_header h = hdr(DP_MSG_HIDDEN, 1, 0, 0);
    h.dtype = DP_DTYPE_F32;
    h.n_rows = 1;
    h.row_bytes = sizeof row;
    assert_int_equal(dp_send(client, &h, row, sizeof row, &err), STRATA_OK);
    dp_link *nccl = NULL;
    assert_int_equal(dp_nccl_upgrade(server, false, -1, NULL, &nccl, &err), STRATA_EFORMAT);
    assert_contains(err.msg, "NCCL offer");
    assert_null(nccl);
    dp_link_close(server);
    dp_link_close(client);
}

/* ---- NCCL ---- */

#ifdef STRATA_HAVE_NCCL
typedef struct nccl_job {
    const uint8_t *id;
    int rank, device;
    dp_link *link;
    int rc;
    strata_error err;
} nccl_job;

static void *nccl_create_main(void *p)
{
    nccl_job *j = p;
    j->rc = dp_nccl_create(j->id, DP_NCCL_ID_BYTES, j->rank, 2, 1 - j->rank, j->device, NULL, &j->link, &j->err);
    return NULL;
}

enum { NCCL_MSGS = 4 };
static const size_t nccl_lens[NCCL_MSGS] = {8 * 4096, 3u << 20, 0, 5000};

typedef struct nccl_recv_job {
    dp_link *link;
    int device;
    int rc;
    strata_error err;
    int efull_seen;
    uint8_t *got[NCCL_MSGS];
    dp_msg_header h[NCCL_MSGS];
} nccl_recv_job;

static void *nccl_recv_main(void *p)
{
    nccl_recv_job *j = p;
    cudaSetDevice(j->device);
    void *dev = NULL, *small = NULL;
    j->rc = cudaMalloc(&dev, 3u << 20) == cudaSuccess && cudaMalloc(&small, 1024) == cudaSuccess ? STRATA_OK : STRATA_ENOMEM;
    for (int i = 0; i < NCCL_MSGS && j->rc == STRATA_OK; i++) {
        size_t len = 0;
        /* The last message is received into a buffer too small first. */
        int rc = dp_recv(j->link, &j->h[i], i == 3 ? small : dev, i == 3 ? 1024 : 3u << 20, &len, TIMEOUT, &j->err);
        if (rc == STRATA_EFULL && i == 3) {
            j->efull_seen = 1;
            rc = dp_recv_payload(j->link, dev, 3u << 20, &j->err);
        }
        j->rc = rc;
        if (rc == STRATA_OK) {
            j->got[i] = malloc(len ? len : 1);
            if (len && cudaMemcpy(j->got[i], dev, len, cudaMemcpyDeviceToHost) != cudaSuccess)
                j->rc = STRATA_EIO;
        }
    }
    cudaFree(dev);
    cudaFree(small);
    return NULL;
}
#endif

static void test_nccl(void **state)
{
    (void)state;
    strata_error err = {0};
    dp_link *link = NULL;
    uint8_t id[DP_NCCL_ID_BYTES] = {0};
#ifndef STRATA_HAVE_NCCL
    size_t idlen = sizeof id;
    assert_int_equal(dp_nccl_unique_id(id, &idlen, &err), STRATA_EUNSUPPORTED);
    assert_int_equal(dp_nccl_create(id, sizeof id, 0, 2, 1, 0, NULL, &link, &err), STRATA_EUNSUPPORTED);
    assert_contains(err.msg, "no NCCL");
    assert_null(link);
    print_message("built without NCCL: NCCL transport not exercised\n");
    skip();
#else
    /* Argument checks need no device. */
    assert_int_equal(dp_nccl_create(id, sizeof id, 0, 2, 0, 0, NULL, &link, &err), STRATA_EINVAL);
    assert_int_equal(dp_nccl_create(id, 5, 0, 2, 1, 0, NULL, &link, &err), STRATA_EINVAL);
    int count = 0;
    cudaError_t ce = cudaGetDeviceCount(&count);
    if (ce != cudaSuccess || count == 0) {
        (void)cudaGetLastError();
        /* Creating a link reports the missing device cleanly. */
        assert_int_equal(dp_nccl_create(id, sizeof id, 0, 2, 1, 0, NULL, &link, &err), STRATA_EIO);
        assert_contains(err.msg, "no CUDA device");
        assert_null(link);
        print_message("no CUDA device: NCCL transport not exercised (cudaGetDeviceCount: %s)\n",
                      ce == cudaSuccess ? "0 devices" : cudaGetErrorString(ce));
        skip();
        return;
    }
    size_t idlen = sizeof id;
    assert_int_equal(dp_nccl_unique_id(id, &idlen, &err), STRATA_OK);
    assert_int_equal(idlen, DP_NCCL_ID_BYTES);
    /* Two ranks in two threads: on two devices when there are two (NCCL refuses two ranks of one
     * communicator on the same GPU; with one device that refusal is reported and the test skips). */
    nccl_job r0 = {.id = id, .rank = 0, .device = 0}, r1 = {.id = id, .rank = 1, .device = count > 1 ? 1 : 0};
    pthread_t t0, t1;
    assert_int_equal(pthread_create(&t0, NULL, nccl_create_main, &r0), 0);
    assert_int_equal(pthread_create(&t1, NULL, nccl_create_main, &r1), 0);
    assert_int_equal(pthread_join(t0, NULL), 0);
    assert_int_equal(pthread_join(t1, NULL), 0);
    if ((r0.rc != STRATA_OK || r1.rc != STRATA_OK) && count == 1) {
        dp_link_close(r0.link);
        dp_link_close(r1.link);
        print_message("one CUDA device and NCCL refused two ranks on it: NCCL transport not exercised (%s)\n",
                      r0.rc != STRATA_OK ? r0.err.msg : r1.err.msg);
        skip();
        return;
    }
    if (r0.rc != STRATA_OK || r1.rc != STRATA_OK)
        fail_msg("dp_nccl_create: %s / %s", r0.err.msg, r1.err.msg);
    assert_contains(dp_link_describe(r0.link), "nccl rank 0 -> 1 on cuda:0");
    assert_int_equal(dp_link_backend(r0.link), DP_BACKEND_NCCL);
    assert_int_equal(dp_link_fd(r0.link), -1);

    /* Host memory is refused, the link stays usable. */
    uint8_t host[16] = {0};
    dp_msg_header hh = hdr(DP_MSG_CONTROL, 0, 0, 0);
    assert_int_equal(dp_send(r0.link, &hh, host, sizeof host, &err), STRATA_EINVAL);
    assert_contains(err.msg, "host memory");
    assert_null(dp_link_broken(r0.link));

    dp_msg_header h[NCCL_MSGS] = {
        {.kind = DP_MSG_HIDDEN, .dtype = DP_DTYPE_F16, .step = 3, .seq = 1, .n_rows = 8, .row_bytes = 4096},
        hdr(DP_MSG_KV_BLOCK, 4, 2, 17),
        hdr(DP_MSG_END, 5, 0, 0),
        hdr(DP_MSG_KV_TAIL, 6, 2, 17),
    };
    uint8_t *want[NCCL_MSGS];
    void *dev[NCCL_MSGS] = {0};
    assert_int_equal(cudaSetDevice(0), cudaSuccess);
    for (int i = 0; i < NCCL_MSGS; i++) {
        want[i] = pattern(nccl_lens[i], (uint64_t)i + 500);
        if (nccl_lens[i]) {
            assert_int_equal(cudaMalloc(&dev[i], nccl_lens[i]), cudaSuccess);
            assert_int_equal(cudaMemcpy(dev[i], want[i], nccl_lens[i], cudaMemcpyHostToDevice), cudaSuccess);
        }
    }
    nccl_recv_job rj = {.link = r1.link, .device = r1.device};
    pthread_t tr;
    assert_int_equal(pthread_create(&tr, NULL, nccl_recv_main, &rj), 0);
    int src = STRATA_OK;
    for (int i = 0; i < NCCL_MSGS && src == STRATA_OK; i++)
        src = dp_send(r0.link, &h[i], dev[i], nccl_lens[i], &err);
    assert_int_equal(pthread_join(tr, NULL), 0);
    if (src != STRATA_OK || rj.rc != STRATA_OK)
        fail_msg("NCCL transfer: send %s (%s), recv %s (%s)", strata_status_name(src), err.msg,
                 strata_status_name(rj.rc), rj.err.msg);
    assert_true(rj.efull_seen);
    for (int i = 0; i < NCCL_MSGS; i++) {
        assert_int_equal(rj.h[i].kind, h[i].kind);
        assert_true(rj.h[i].step == h[i].step);
        assert_int_equal(rj.h[i].payload_len, nccl_lens[i]);
        assert_int_equal(rj.h[i].payload_crc, 0);
        if (nccl_lens[i])
            assert_memory_equal(rj.got[i], want[i], nccl_lens[i]);
        free(rj.got[i]);
        free(want[i]);
        cudaFree(dev[i]);
    }
    print_message("NCCL transport exercised on %d device(s)\n", count > 1 ? 2 : 1);
    dp_link_close(r0.link);
    dp_link_close(r1.link);
#endif
}

/* ---- NCCL loopback: the NCCL path on one GPU ---- */

#ifdef STRATA_HAVE_NCCL
/* A device copy of n host bytes (NULL for 0 bytes). */
static void *to_device(const uint8_t *host, size_t n)
{
    void *d = NULL;
    if (n == 0)
        return NULL;
    assert_int_equal(cudaMalloc(&d, n), cudaSuccess);
    assert_int_equal(cudaMemcpy(d, host, n, cudaMemcpyHostToDevice), cudaSuccess);
    return d;
}

static void assert_device_bytes(const void *dev, const uint8_t *want, size_t n)
{
    uint8_t *back = malloc(n ? n : 1);
    assert_non_null(back);
    assert_int_equal(cudaMemcpy(back, dev, n, cudaMemcpyDeviceToHost), cudaSuccess);
    assert_memory_equal(back, want, n);
    free(back);
}

static void assert_same_header(const dp_msg_header *got, const dp_msg_header *sent, size_t len)
{
    assert_int_equal(got->kind, sent->kind);
    assert_int_equal(got->dtype, sent->dtype);
    assert_int_equal(got->layer, sent->layer);
    assert_true(got->step == sent->step);
    assert_true(got->seq == sent->seq);
    assert_int_equal(got->n_rows, sent->n_rows);
    assert_int_equal(got->row_bytes, sent->row_bytes);
    assert_true(got->payload_len == len);
    assert_int_equal(got->payload_crc, 0); /* NCCL carries no payload CRC */
    assert_int_equal(got->flags, 0);
}
#endif

static void test_nccl_loopback(void **state)
{
    (void)state;
    strata_error err = {0};
    dp_link *link = NULL;
    uint8_t id[DP_NCCL_ID_BYTES] = {0};
#ifndef STRATA_HAVE_NCCL
    assert_int_equal(dp_nccl_create(id, sizeof id, 0, 1, 0, 0, NULL, &link, &err), STRATA_EUNSUPPORTED);
    assert_contains(err.msg, "no NCCL");
    assert_null(link);
    print_message("built without NCCL: NCCL loopback link not exercised\n");
    skip();
#else
    /* Which (rank, nranks, peer) make a link is decided before looking for a device: a 1-rank
     * link is only rank 0 -> 0, a 2+-rank link never targets itself. */
    static const int bad[][3] = {
        {1, 1, 0}, {0, 1, 1}, {1, 1, 1}, {-1, 1, 0}, {0, 1, -1}, {0, 0, 0},
        {0, -1, 0}, {0, 2, 0}, {1, 2, 1}, {0, 2, 2}, {2, 2, 0}, {0, 3, 3},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        link = NULL;
        assert_int_equal(dp_nccl_create(id, sizeof id, bad[i][0], bad[i][1], bad[i][2], 0, NULL, &link, &err),
                         STRATA_EINVAL);
        assert_contains(err.msg, "bad NCCL link");
        assert_null(link);
    }
    assert_int_equal(dp_nccl_create(id, sizeof id, 0, 1, 0, -1, NULL, &link, &err), STRATA_EINVAL);
    assert_int_equal(dp_nccl_create(id, 5, 0, 1, 0, 0, NULL, &link, &err), STRATA_EINVAL);
    assert_null(link);
    int count = 0;
    cudaError_t ce = cudaGetDeviceCount(&count);
    if (ce != cudaSuccess || count == 0) {
        (void)cudaGetLastError();
        /* The loopback combination passes the argument checks: the missing device stops it. */
        assert_int_equal(dp_nccl_create(id, sizeof id, 0, 1, 0, 0, NULL, &link, &err), STRATA_EIO);
        assert_contains(err.msg, "nccl loopback rank 0 on cuda:0");
        assert_contains(err.msg, "no CUDA device");
        assert_null(link);
        print_message("no CUDA device: NCCL loopback link not exercised (cudaGetDeviceCount: %s)\n",
                      ce == cudaSuccess ? "0 devices" : cudaGetErrorString(ce));
        skip();
        return;
    }
    size_t idlen = sizeof id;
    assert_int_equal(dp_nccl_unique_id(id, &idlen, &err), STRATA_OK);
    const dp_options opts = {.io_timeout_ms = TIMEOUT};
    if (dp_nccl_create(id, idlen, 0, 1, 0, 0, &opts, &link, &err) != STRATA_OK)
        fail_msg("NCCL loopback link on cuda:0: %s", err.msg);
    assert_string_equal(dp_link_describe(link), "nccl loopback rank 0 on cuda:0");
    assert_int_equal(dp_link_backend(link), DP_BACKEND_NCCL);
    assert_int_equal(dp_link_fd(link), -1);
    assert_true(dp_link_peer_max_payload(link) == DP_DEFAULT_MAX_PAYLOAD);

    enum { BIG = 3u << 20, SMALL = 1024 };
    void *dbuf = NULL, *dsmall = NULL;
    assert_int_equal(cudaSetDevice(0), cudaSuccess);
    assert_int_equal(cudaMalloc(&dbuf, BIG), cudaSuccess);
    assert_int_equal(cudaMalloc(&dsmall, SMALL), cudaSuccess);
    uint8_t *hbuf = malloc(BIG);
    assert_non_null(hbuf);

    /* Nothing queued: a timeout at once, even when asked to wait forever; the link stays usable. */
    dp_msg_header got;
    size_t len = 7;
    assert_int_equal(dp_recv(link, &got, dbuf, BIG, &len, -1, &err), STRATA_EIO);
    assert_contains(err.msg, "timed out");
    assert_int_equal(len, 0);
    assert_null(dp_link_broken(link));
    assert_int_equal(dp_recv_header(link, &got, 0, &err), STRATA_EIO);
    assert_null(dp_link_broken(link));

    /* Host memory is refused on send, the link stays usable. */
    dp_msg_header hh = hdr(DP_MSG_CONTROL, 0, 0, 0);
    assert_int_equal(dp_send(link, &hh, hbuf, 16, &err), STRATA_EINVAL);
    assert_contains(err.msg, "host memory");
    assert_null(dp_link_broken(link));

    /* Four messages of different sizes and contents, all sent before the first receive. */
    enum { LB_MSGS = 4 };
    static const size_t lens[LB_MSGS] = {0, 5000, 3u << 20, 8 * 4096};
    const dp_msg_header h[LB_MSGS] = {
        hdr(DP_MSG_END, 10, 1, 0),
        hdr(DP_MSG_CONTROL, 11, 2, 3),
        hdr(DP_MSG_KV_BLOCK, 12, 3, 17),
        {.kind = DP_MSG_HIDDEN, .dtype = DP_DTYPE_BF16, .layer = 9, .step = 13, .seq = 4, .n_rows = 8,
         .row_bytes = 4096},
    };
    uint8_t *want[LB_MSGS];
    void *src[LB_MSGS];
    for (int i = 0; i < LB_MSGS; i++) {
        want[i] = pattern(lens[i], (uint64_t)i + 900);
        src[i] = to_device(want[i], lens[i]);
        if (dp_send(link, &h[i], src[i], lens[i], &err) != STRATA_OK)
            fail_msg("loopback send %d (%zu bytes): %s", i, lens[i], err.msg);
        /* Clobber the source: what is received must come from the link's staging. */
        if (lens[i])
            assert_int_equal(cudaMemset(src[i], 0, lens[i]), cudaSuccess);
    }
    /* 0: an empty END. */
    assert_int_equal(dp_recv(link, &got, dbuf, BIG, &len, 0, &err), STRATA_OK);
    assert_int_equal(len, 0);
    assert_same_header(&got, &h[0], 0);
    /* 1: too small a buffer first (header filled, payload pending), then a host buffer (refused,
     * still pending), a new receive (refused while pending), then a large enough device buffer. */
    assert_int_equal(dp_recv(link, &got, dsmall, SMALL, &len, 0, &err), STRATA_EFULL);
    assert_int_equal(len, 5000);
    assert_contains(err.msg, "5000 bytes does not fit a 1024-byte buffer");
    assert_same_header(&got, &h[1], 5000);
    assert_int_equal(dp_recv_payload(link, hbuf, BIG, &err), STRATA_EINVAL);
    assert_contains(err.msg, "host memory");
    assert_int_equal(dp_recv_header(link, &got, 0, &err), STRATA_EINVAL);
    assert_contains(err.msg, "pending");
    assert_null(dp_link_broken(link));
    assert_int_equal(dp_recv_payload(link, dbuf, BIG, &err), STRATA_OK);
    assert_device_bytes(dbuf, want[1], 5000);
    /* 2: two-step, 3 MiB. */
    assert_int_equal(dp_recv_header(link, &got, 0, &err), STRATA_OK);
    assert_same_header(&got, &h[2], lens[2]);
    assert_int_equal(dp_recv_payload(link, dbuf, BIG, &err), STRATA_OK);
    assert_device_bytes(dbuf, want[2], lens[2]);
    /* 3: HIDDEN rows straight into dp_recv. */
    assert_int_equal(dp_recv(link, &got, dbuf, BIG, &len, 0, &err), STRATA_OK);
    assert_int_equal(len, lens[3]);
    assert_same_header(&got, &h[3], lens[3]);
    assert_device_bytes(dbuf, want[3], lens[3]);
    assert_int_equal(dp_recv(link, &got, dbuf, BIG, &len, 0, &err), STRATA_EIO);
    assert_contains(err.msg, "timed out");
    assert_null(dp_link_broken(link));
    for (int i = 0; i < LB_MSGS; i++) {
        free(want[i]);
        cudaFree(src[i]);
    }

    /* The queue bound: DP_NCCL_LOOPBACK_QUEUE messages wait, one more is refused with EFULL and
     * the link stays usable; once one is received (here: skipped) the refused one goes through
     * and comes out last, in order. */
    enum { Q = DP_NCCL_LOOPBACK_QUEUE, QLEN = 256 };
    uint8_t *qwant = pattern((Q + 1) * QLEN, 77);
    uint8_t *qsrc = to_device(qwant, (Q + 1) * QLEN);
    for (int i = 0; i < Q; i++) {
        dp_msg_header qh = hdr(DP_MSG_CONTROL, 100 + (uint64_t)i, (uint64_t)i, 0);
        if (dp_send(link, &qh, qsrc + (size_t)i * QLEN, QLEN, &err) != STRATA_OK)
            fail_msg("loopback send %d of %d: %s", i, Q, err.msg);
    }
    dp_msg_header over = hdr(DP_MSG_CONTROL, 100 + Q, Q, 0);
    assert_int_equal(dp_send(link, &over, qsrc + (size_t)Q * QLEN, QLEN, &err), STRATA_EFULL);
    assert_contains(err.msg, "queue full");
    assert_null(dp_link_broken(link));
    assert_int_equal(dp_recv_header(link, &got, 0, &err), STRATA_OK);
    assert_true(got.step == 100);
    assert_int_equal(dp_recv_skip(link, &err), STRATA_OK);
    assert_int_equal(dp_send(link, &over, qsrc + (size_t)Q * QLEN, QLEN, &err), STRATA_OK);
    for (int i = 1; i <= Q; i++) {
        assert_int_equal(dp_recv(link, &got, dsmall, SMALL, &len, 0, &err), STRATA_OK);
        assert_true(got.step == 100 + (uint64_t)i);
        assert_int_equal(len, QLEN);
        assert_device_bytes(dsmall, qwant + (size_t)i * QLEN, QLEN);
    }
    assert_int_equal(dp_recv(link, &got, dsmall, SMALL, &len, 0, &err), STRATA_EIO);
    assert_null(dp_link_broken(link));

    /* Closing with a message still queued frees its staging with the link. */
    assert_int_equal(dp_send(link, &over, qsrc, QLEN, &err), STRATA_OK);
    dp_link_close(link);
    free(qwant);
    cudaFree(qsrc);
    cudaFree(dbuf);
    cudaFree(dsmall);
    free(hbuf);
    print_message("NCCL loopback link exercised on cuda:0\n");
#endif
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip_kinds_and_sizes),
        cmocka_unit_test(test_two_step_and_small_buffers),
        cmocka_unit_test(test_authentication),
        cmocka_unit_test(test_silent_connection_first),
        cmocka_unit_test(test_peer_closes_mid_payload),
        cmocka_unit_test(test_corrupted_frames),
        cmocka_unit_test(test_encryption),
        cmocka_unit_test(test_max_payload),
        cmocka_unit_test(test_frame_above_default_limit),
        cmocka_unit_test(test_timeouts),
        cmocka_unit_test(test_connect_errors),
        cmocka_unit_test(test_send_to_closed_peer),
        cmocka_unit_test(test_frame_codec),
        cmocka_unit_test(test_nccl_upgrade),
        cmocka_unit_test(test_nccl),
        cmocka_unit_test(test_nccl_loopback),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
