/* A TLS handshake with a gRPC port made by hand (OpenSSL), to learn at once what gRPC's client
 * would only retry until its deadline: a certificate that does not name the host dialled (gRPC
 * says so at debug verbosity only), a CA that did not sign it, a port without TLS, or a port
 * with TLS dialled without. No gRPC: a connection, a handshake, a close. */
#ifndef STRATA_PROTO_TLS_PROBE_H
#define STRATA_PROTO_TLS_PROBE_H

#include <stddef.h>

enum {
    PROTO_TLS_PROBE_AGREES = 1,   /* the port answered as asked (see proto_tls_probe) */
    PROTO_TLS_PROBE_UNKNOWN = 0,  /* nothing learnt: no listener yet, a timeout, a closed
                                     connection, an address this cannot parse */
    PROTO_TLS_PROBE_DIFFERS = -1, /* the port answered, not as asked: why says how */
};

/* Connects to host_port ("host:port", "[v6]:port") and runs a TLS client handshake, all within
 * timeout_ms. With roots_pem (PEM trust roots): the certificate must chain to them and name the
 * host as dialled (an IP address against its IP subjectAltNames), as gRPC checks it; SNI and
 * ALPN "h2" as gRPC sends them. AGREES when it does; DIFFERS with why = OpenSSL's reason
 * ("certificate verify failed: hostname mismatch", "wrong version number", ...). Without
 * roots_pem it asks whether the port speaks TLS at all: AGREES when it does not (a plaintext
 * port answers a ClientHello with bytes that are no TLS), DIFFERS ("the port speaks TLS") when
 * a handshake completes. */
int proto_tls_probe(const char *host_port, const char *roots_pem, int timeout_ms, char *why, size_t cap);

#endif
