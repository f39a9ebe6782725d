/* A tiny HTTP/1.1 server for Prometheus scrapes, on its own thread.
 *
 * Routes: GET (or HEAD) /metrics answers 200 with metrics_render() of the registry
 * (Content-Type METRICS_CONTENT_TYPE); GET /healthz answers 200 "ok". Any other path is 404;
 * another method on one of those two paths is 405 (with "Allow: GET, HEAD"). A query string is
 * ignored. A malformed request (bad request line or header line, bare CR, NUL, obsolete line
 * folding, HTTP/1.1 without exactly one Host) is 400; a version other than HTTP/1.0 or 1.1 is
 * 505; a request head longer than max_head bytes is 431; a client that has not sent its whole
 * head within timeout_ms gets 408. Every response has Content-Length and "Connection: close":
 * one request per connection, which is what Prometheus handles fine and keeps this simple.
 *
 * Up to METRICS_HTTP_MAX_CONNS connections are served at once, by one thread polling all of
 * them, so an idle or slow client never delays another's scrape; further clients wait in the
 * listen backlog until a slot frees. A client has timeout_ms to send its head (then 408, or a
 * plain close when it sent nothing) and timeout_ms again to read the response, then a short
 * drain of what it is still sending. Sockets are non-blocking and the poll also watches a
 * self-pipe, so metrics_http_stop is prompt even in the middle of requests. Sends use
 * MSG_NOSIGNAL: a client that hangs up never raises SIGPIPE in the process. The server thread
 * blocks all signals, so the process' handlers run on its other threads.
 *
 * The registry must outlive the server; its collect hook (metrics_set_collect) runs on the
 * server thread before each /metrics response. */
#ifndef STRATA_COORDINATOR_METRICS_HTTP_H
#define STRATA_COORDINATOR_METRICS_HTTP_H

#include <stddef.h>
#include <stdint.h>

#include "coordinator/metrics/metrics.h"
#include "kvstore/error.h"

typedef struct metrics_http metrics_http;

typedef struct metrics_http_options {
    int timeout_ms;   /* deadline for reading a request head, and again for writing the
                         response; 0 = METRICS_HTTP_TIMEOUT_MS */
    size_t max_head;  /* most bytes of request line + headers; 0 = METRICS_HTTP_MAX_HEAD */
} metrics_http_options;

#define METRICS_HTTP_TIMEOUT_MS 5000
#define METRICS_HTTP_MAX_HEAD 8192
#define METRICS_HTTP_MAX_CONNS 64
#define METRICS_HTTP_DEFAULT_ADDR "127.0.0.1:9400"

/* Binds addr and starts serving r. addr is "HOST:PORT" where HOST is a numeric IPv4 address,
 * "localhost" (127.0.0.1) or a bracketed numeric IPv6 address ("[::1]:9400"); PORT is 0..65535,
 * 0 picking a free port (see metrics_http_port). The socket has SO_REUSEADDR, so a restarted
 * coordinator can rebind while old connections sit in TIME_WAIT. Errors: STRATA_EINVAL for a
 * malformed address (the message says what is wrong), STRATA_EIO when it cannot be bound (the
 * message says "already in use", "not an address of this host", "permission denied", ...) or a
 * thread cannot be started, STRATA_ENOMEM. On success *out owns a running server. */
int metrics_http_start(metrics_registry *r, const char *addr, metrics_http **out,
                       strata_error *err);
/* Same with options (NULL = defaults); timeout_ms must be >= 1 and max_head >= 64 when given. */
int metrics_http_start_opts(metrics_registry *r, const char *addr,
                            const metrics_http_options *opts, metrics_http **out,
                            strata_error *err);

/* The port actually bound (the ephemeral one when addr asked for port 0). */
uint16_t metrics_http_port(const metrics_http *s);

/* Wakes the server thread, abandons any connection in progress, joins the thread, closes the
 * sockets and frees s. Returns within milliseconds. NULL is ignored. */
void metrics_http_stop(metrics_http *s);

#endif
