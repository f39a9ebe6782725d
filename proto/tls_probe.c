/* proto_tls_probe: one TCP connection and one OpenSSL client handshake, non-blocking, bounded
 * by a deadline (tls_probe.h). */
#include "proto/tls_probe.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include "kvstore/clock.h"
#include "kvstore/hostport.h"

/* Waits for events on fd until deadline: 1 ready, 0 timed out or failed. */
static int wait_until(int fd, short events, int64_t deadline)
{
    for (;;) {
        int64_t left = deadline - strata_mono_ms();
        if (left <= 0)
            return 0;
        struct pollfd p = {.fd = fd, .events = events};
        int r = poll(&p, 1, (int)(left > 60000 ? 60000 : left));
        if (r > 0)
            return 1;
        if (r < 0 && errno != EINTR)
            return 0;
    }
}

/* A connected non-blocking socket to host:port within deadline, or -1. */
static int connect_by(const char *host, const char *port, int64_t deadline)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    if (getaddrinfo(host, port, &hints, &res) != 0)
        return -1;
    int fd = -1;
    for (struct addrinfo *ai = res; ai && fd < 0; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0)
            continue;
        int soerr = 0;
        socklen_t len = sizeof soerr;
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0)
            break;
        if ((errno == EINPROGRESS || errno == EINTR) && wait_until(fd, POLLOUT, deadline) &&
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len) == 0 && soerr == 0)
            break;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    return fd;
}

static bool is_ip(const char *host)
{
    unsigned char buf[16];
    return inet_pton(AF_INET, host, buf) == 1 || inet_pton(AF_INET6, host, buf) == 1;
}

/* The context: TLS 1.2 or later, ALPN h2, and the roots (verification on) when given. */
static SSL_CTX *make_ctx(const char *roots_pem)
{
    SSL_CTX *ctx = SSL_CTX_new(TLS_client_method());
    if (!ctx)
        return NULL;
    static const unsigned char alpn[] = {2, 'h', '2'};
    bool ok = SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION) == 1 &&
              SSL_CTX_set_alpn_protos(ctx, alpn, sizeof alpn) == 0;
    if (ok && roots_pem) {
        X509_STORE *store = SSL_CTX_get_cert_store(ctx);
        BIO *bio = BIO_new_mem_buf(roots_pem, -1);
        X509 *x;
        int n = 0;
        while (bio && (x = PEM_read_bio_X509(bio, NULL, NULL, NULL))) {
            n += X509_STORE_add_cert(store, x) == 1;
            X509_free(x);
        }
        BIO_free(bio);
        ERR_clear_error(); /* the end of the PEM text reads as an error */
        ok = n > 0;
        SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
    } else {
        SSL_CTX_set_verify(ctx, SSL_VERIFY_NONE, NULL);
    }
    if (!ok) {
        SSL_CTX_free(ctx);
        return NULL;
    }
    return ctx;
}

static int probe(const char *host_port, const char *roots_pem, int timeout_ms, char *why, size_t cap);

/* OpenSSL writes with write(): a peer that closed first would raise SIGPIPE, which kills a
 * program that did not ignore it. Blocked here for this thread, and one it raised is taken. */
int proto_tls_probe(const char *host_port, const char *roots_pem, int timeout_ms, char *why, size_t cap)
{
    sigset_t pipe_only, old, pending;
    sigemptyset(&pipe_only);
    sigaddset(&pipe_only, SIGPIPE);
    sigemptyset(&pending);
    const bool was_pending = sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1;
    const bool masked = pthread_sigmask(SIG_BLOCK, &pipe_only, &old) == 0;
    int result = probe(host_port, roots_pem, timeout_ms, why, cap);
    if (masked) {
        if (!was_pending && sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1) {
            const struct timespec now = {0, 0};
            sigtimedwait(&pipe_only, NULL, &now);
        }
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    return result;
}

static int probe(const char *host_port, const char *roots_pem, int timeout_ms, char *why, size_t cap)
{
    if (cap)
        why[0] = '\0';
    char host[256], port[16];
    int port_number = 0;
    if (strata_split_host_port(host_port, host, sizeof host, &port_number))
        return PROTO_TLS_PROBE_UNKNOWN;
    snprintf(port, sizeof port, "%d", port_number);
    const int64_t deadline = strata_mono_ms() + (timeout_ms > 0 ? timeout_ms : 1);
    int fd = connect_by(host, port, deadline);
    if (fd < 0)
        return PROTO_TLS_PROBE_UNKNOWN;
    ERR_clear_error();
    SSL_CTX *ctx = make_ctx(roots_pem);
    SSL *ssl = ctx ? SSL_new(ctx) : NULL;
    int result = PROTO_TLS_PROBE_UNKNOWN;
    if (!ssl || SSL_set_fd(ssl, fd) != 1)
        goto out;
    if (!is_ip(host))
        SSL_set_tlsext_host_name(ssl, host);
    if (roots_pem) {
        X509_VERIFY_PARAM *param = SSL_get0_param(ssl);
        if ((is_ip(host) ? X509_VERIFY_PARAM_set1_ip_asc(param, host) : X509_VERIFY_PARAM_set1_host(param, host, 0)) != 1)
            goto out;
    }
    for (;;) {
        int r = SSL_connect(ssl);
        if (r == 1) {
            result = roots_pem ? PROTO_TLS_PROBE_AGREES : PROTO_TLS_PROBE_DIFFERS;
            if (!roots_pem)
                snprintf(why, cap, "the port speaks TLS");
            SSL_shutdown(ssl); /* one close_notify, not waited for */
            break;
        }
        int e = SSL_get_error(ssl, r);
        if ((e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) &&
            wait_until(fd, e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, deadline))
            continue;
        if (e == SSL_ERROR_SSL) {
            /* The peer answered, and not as asked. */
            long v = SSL_get_verify_result(ssl);
            if (!roots_pem) {
                result = PROTO_TLS_PROBE_AGREES; /* bytes that are no TLS: a plaintext port */
            } else if (v != X509_V_OK) {
                result = PROTO_TLS_PROBE_DIFFERS;
                snprintf(why, cap, "certificate verify failed: %s", X509_verify_cert_error_string(v));
            } else {
                result = PROTO_TLS_PROBE_DIFFERS;
                const char *reason = ERR_reason_error_string(ERR_peek_error());
                snprintf(why, cap, "%s", reason ? reason : "handshake failed");
            }
        }
        break; /* a timeout, a closed connection, a reset: nothing learnt */
    }
out:
    ERR_clear_error();
    SSL_free(ssl);
    SSL_CTX_free(ctx);
    close(fd);
    return result;
}
