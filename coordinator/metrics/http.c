/* The scrape server of coordinator/metrics/http.h: one thread, one poll() over the listening
 * socket, the stop pipe and every open connection, each connection a small state machine
 * (reading its head, writing the answer, draining what the client still sends). */
#include "coordinator/metrics/http.h"
#include "kvstore/clock.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* After answering, how long and how much we keep reading what a client still sends (see
 * start_drain). */
#define DRAIN_MS 500
#define DRAIN_BYTES (1u << 20)

typedef enum { CONN_READ, CONN_WRITE, CONN_DRAIN } conn_phase;

typedef struct conn {
    int fd;
    conn_phase phase;
    int64_t deadline;    /* the current phase ends (408 / give up / close) at this time */
    char *buf;           /* max_head bytes for the request head */
    size_t n, searched;  /* bytes of head received; bytes already searched for its end */
    char head[512];      /* the response's status line and headers */
    size_t head_len;
    const char *body;    /* the response body: a literal, or owned_body */
    char *owned_body;    /* a rendered exposition, freed with the connection */
    size_t body_len, sent;  /* sent counts head bytes, then body bytes */
    size_t drained;
} conn;

struct metrics_http {
    metrics_registry *reg;
    int lfd;               /* listening socket, non-blocking */
    int wake_r, wake_w;    /* self-pipe: stop writes a byte, every poll watches wake_r */
    pthread_t thread;
    uint16_t port;
    int timeout_ms;
    size_t max_head;
    conn conns[METRICS_HTTP_MAX_CONNS];
    int nconns;            /* conns[0, nconns) are open */
};

/* ---- responses ---- */

/* RFC 9110 wants a Date header from a server with a clock; built by hand because strftime's
 * %a/%b follow the process locale and HTTP needs the English names. */
static void http_date(char out[40])
{
    static const char *const days[] = {"Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"};
    static const char *const months[] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun",
                                         "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
    time_t t = time(NULL);
    struct tm tm;
    if (t == (time_t)-1 || !gmtime_r(&t, &tm)) {
        out[0] = '\0';
        return;
    }
    snprintf(out, 40, "Date: %s, %02d %s %04d %02d:%02d:%02d GMT\r\n", days[tm.tm_wday % 7],
             tm.tm_mday, months[tm.tm_mon % 12], tm.tm_year + 1900, tm.tm_hour, tm.tm_min,
             tm.tm_sec);
}

/* Closes c and moves the last open connection into its slot; the caller must not use c after. */
static void conn_close(metrics_http *s, conn *c)
{
    close(c->fd);
    free(c->buf);
    free(c->owned_body);
    conn *last = &s->conns[s->nconns - 1];
    if (c != last)
        *c = *last;
    s->nconns--;
}

/* Puts the response in c and switches it to writing. body is a literal or, when owned, a
 * malloc'd buffer the connection frees. */
static void respond(metrics_http *s, conn *c, int status, const char *reason, const char *ctype,
                    const char *extra, const char *body, size_t blen, bool owned, bool head_only)
{
    char date[40];
    http_date(date);
    int n = snprintf(c->head, sizeof c->head,
                     "HTTP/1.1 %d %s\r\n"
                     "Content-Type: %s\r\n"
                     "Content-Length: %zu\r\n"
                     "%s%s"
                     "Cache-Control: no-store\r\n"
                     "Connection: close\r\n"
                     "\r\n",
                     status, reason, ctype, blen, date, extra ? extra : "");
    /* Cannot be cut with our fixed strings; if it were, send nothing rather than a cut header. */
    c->head_len = (n < 0 || (size_t)n >= sizeof c->head) ? 0 : (size_t)n;
    c->body = head_only ? "" : body;
    c->body_len = head_only ? 0 : blen;
    if (owned)
        c->owned_body = (char *)body;
    c->sent = 0;
    c->phase = CONN_WRITE;
    c->deadline = strata_mono_ms() + s->timeout_ms;
}

static void respond_text(metrics_http *s, conn *c, int status, const char *reason,
                         const char *extra, const char *text, bool head_only)
{
    respond(s, c, status, reason, "text/plain; charset=utf-8", extra, text, strlen(text), false,
            head_only);
}

/* Closing a socket with unread input makes the kernel send RST, and a client that receives RST
 * before reading our answer loses it (the 431 for a long head, or a request with a body). So
 * after the answer we half-close and read until the client closes, for a short while: a
 * well-behaved client closes as soon as it has read the response, so this normally ends at
 * once. */
static void start_drain(metrics_http *s, conn *c)
{
    if (shutdown(c->fd, SHUT_WR) != 0) {
        conn_close(s, c);
        return;
    }
    c->phase = CONN_DRAIN;
    c->drained = 0;
    c->deadline = strata_mono_ms() + (s->timeout_ms < DRAIN_MS ? s->timeout_ms : DRAIN_MS);
}

/* ---- request parsing ---- */

static bool is_tchar(unsigned char c)
{
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'))
        return true;
    return c && strchr("!#$%&'*+-.^_`|~", c) != NULL;
}

typedef struct request {
    char method[16];
    char path[256];  /* path only: query dropped; longer paths cannot be ours and are 404 */
    bool path_too_long;
    int status;      /* 0 when well formed, else the error status to answer */
} request;

/* End of the request head in buf[0, n): the index just past the empty line, or 0 if not yet
 * complete. Lines may end in CRLF or a bare LF (RFC 9112 lets recipients accept LF). */
static size_t head_end(const char *buf, size_t n, size_t from)
{
    /* The shortest end marker ("\n\r\n") is 3 bytes, so bytes before from - 2 were already
     * searched; rescanning only the new bytes keeps a client trickling its head byte by byte
     * from costing quadratic time. */
    for (size_t i = from >= 2 ? from - 2 : 0; i < n; i++) {
        if (buf[i] != '\n')
            continue;
        if (i + 1 < n && buf[i + 1] == '\n')
            return i + 2;
        if (i + 2 < n && buf[i + 1] == '\r' && buf[i + 2] == '\n')
            return i + 3;
    }
    return 0;
}

static bool ieq_prefix(const char *s, size_t n, const char *lit)
{
    size_t k = strlen(lit);
    if (n < k)
        return false;
    for (size_t i = 0; i < k; i++) {
        char a = s[i], b = lit[i];
        if (a >= 'A' && a <= 'Z')
            a = (char)(a - 'A' + 'a');
        if (a != b)
            return false;
    }
    return true;
}

/* Parses the request line "METHOD SP target SP HTTP/x.y". */
static void parse_request_line(const char *l, size_t n, request *q)
{
    size_t i = 0;
    while (i < n && is_tchar((unsigned char)l[i]))
        i++;
    if (i == 0 || i >= sizeof q->method || i == n || l[i] != ' ') {
        q->status = 400;
        return;
    }
    memcpy(q->method, l, i);
    q->method[i] = '\0';
    size_t t0 = ++i;
    while (i < n && l[i] != ' ')
        i++;
    size_t t1 = i;
    if (t1 == t0 || i == n) {
        q->status = 400;
        return;
    }
    for (size_t k = t0; k < t1; k++)
        if ((unsigned char)l[k] <= 0x20 || (unsigned char)l[k] == 0x7f) {
            q->status = 400;
            return;
        }
    const char *v = l + i + 1;
    size_t vn = n - i - 1;
    if (vn != 8 || memcmp(v, "HTTP/", 5) || v[5] < '0' || v[5] > '9' || v[6] != '.' ||
        v[7] < '0' || v[7] > '9') {
        q->status = 400;
        return;
    }
    if (v[5] != '1' || (v[7] != '0' && v[7] != '1')) {
        q->status = 505;
        return;
    }
    /* The target: origin-form "/path?query", or absolute-form "http://host/path?query" that
     * RFC 9112 says servers must accept; "*" (OPTIONS) and anything else match no route. */
    const char *t = l + t0;
    size_t tn = t1 - t0;
    if (ieq_prefix(t, tn, "http://") || ieq_prefix(t, tn, "https://")) {
        size_t k = (t[4] == ':') ? 7 : 8;
        while (k < tn && t[k] != '/')
            k++;
        t += k;
        tn -= k;
        if (!tn) {
            t = "/";
            tn = 1;
        }
    }
    size_t pn = 0;
    while (pn < tn && t[pn] != '?' && t[pn] != '#')
        pn++;
    if (pn >= sizeof q->path) {
        q->path_too_long = true;
        pn = 0;
    }
    memcpy(q->path, t, pn);
    q->path[pn] = '\0';
    q->status = (v[7] == '1') ? -1 : 0;  /* -1: HTTP/1.1, a Host header is still required */
}

/* Parses the head buf[0, n) (which ends with the empty line) into q. */
static void parse_request(const char *buf, size_t n, request *q)
{
    memset(q, 0, sizeof *q);
    if (memchr(buf, '\0', n)) {
        q->status = 400;
        return;
    }
    bool first = true, need_host = false;
    int hosts = 0;
    size_t pos = 0;
    while (pos < n) {
        const char *nl = memchr(buf + pos, '\n', n - pos);
        size_t end = (size_t)(nl - buf);  /* the head ends in '\n', so nl is never NULL */
        size_t len = end - pos;
        if (len && buf[end - 1] == '\r')
            len--;
        const char *l = buf + pos;
        pos = end + 1;
        if (memchr(l, '\r', len)) {  /* a bare CR inside a line: request smuggling territory */
            q->status = 400;
            return;
        }
        if (first) {
            first = false;
            parse_request_line(l, len, q);
            if (q->status > 0)
                return;
            need_host = q->status == -1;
            q->status = 0;
            continue;
        }
        if (len == 0)
            break;  /* the empty line ending the head */
        /* field-name ":" OWS value OWS; no whitespace before the colon, no line folding. */
        size_t k = 0;
        while (k < len && is_tchar((unsigned char)l[k]))
            k++;
        if (k == 0 || k == len || l[k] != ':') {
            q->status = 400;
            return;
        }
        for (size_t j = k + 1; j < len; j++) {
            unsigned char c = (unsigned char)l[j];
            if ((c < 0x20 && c != '\t') || c == 0x7f) {
                q->status = 400;
                return;
            }
        }
        if (k == 4 && ieq_prefix(l, 4, "host"))
            hosts++;
    }
    if ((need_host && hosts != 1) || hosts > 1)
        q->status = 400;
}


/* ---- connections ---- */

/* The head buf[0, end) is complete: parse it and queue the answer. */
static void answer(metrics_http *s, conn *c, size_t end)
{
    request q;
    parse_request(c->buf, end, &q);
    if (q.status == 400) {
        respond_text(s, c, 400, "Bad Request", NULL, "malformed request\n", false);
        return;
    }
    if (q.status == 505) {
        respond_text(s, c, 505, "HTTP Version Not Supported", NULL, "use HTTP/1.1\n", false);
        return;
    }
    bool metrics = !q.path_too_long && !strcmp(q.path, "/metrics");
    bool health = !q.path_too_long && !strcmp(q.path, "/healthz");
    bool get = !strcmp(q.method, "GET"), head = !strcmp(q.method, "HEAD");
    if (!metrics && !health) {
        respond_text(s, c, 404, "Not Found", NULL, "not found\n", head);
    } else if (!get && !head) {
        respond_text(s, c, 405, "Method Not Allowed", "Allow: GET, HEAD\r\n",
                     "method not allowed\n", head);
    } else if (health) {
        respond(s, c, 200, "OK", "text/plain; charset=utf-8", NULL, "ok", 2, false, head);
    } else {
        char *body = NULL;
        size_t blen = 0;
        if (metrics_render(s->reg, &body, &blen, NULL) == STRATA_OK) {
            respond(s, c, 200, "OK", METRICS_CONTENT_TYPE, NULL, body, blen, true, head);
        } else {
            free(body);
            respond_text(s, c, 500, "Internal Server Error", NULL, "cannot render metrics\n",
                         head);
        }
    }
}

/* Reads what the client sent; answers once the head is complete. */
static void on_readable(metrics_http *s, conn *c)
{
    for (;;) {
        if (c->n == s->max_head) {
            respond_text(s, c, 431, "Request Header Fields Too Large", NULL,
                         "request head too large\n", false);
            return;
        }
        ssize_t r = recv(c->fd, c->buf + c->n, s->max_head - c->n, 0);
        if (r > 0) {
            c->n += (size_t)r;
            size_t end = head_end(c->buf, c->n, c->searched);
            c->searched = c->n;
            if (end) {
                answer(s, c, end);
                return;
            }
            continue;
        }
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        if (r == 0 && c->n) {  /* closed its sending side mid-head: still tell it why */
            respond_text(s, c, 400, "Bad Request", NULL, "incomplete request\n", false);
            return;
        }
        conn_close(s, c);
        return;
    }
}

/* Sends what the socket takes; half-closes and drains once everything is out. */
static void on_writable(metrics_http *s, conn *c)
{
    for (;;) {
        struct iovec iov[2];
        int cnt = 0;
        if (c->sent < c->head_len)
            iov[cnt++] = (struct iovec){c->head + c->sent, c->head_len - c->sent};
        size_t body_sent = c->sent > c->head_len ? c->sent - c->head_len : 0;
        if (body_sent < c->body_len)
            iov[cnt++] = (struct iovec){(char *)c->body + body_sent, c->body_len - body_sent};
        if (!cnt) {
            start_drain(s, c);
            return;
        }
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)cnt};
        ssize_t w = sendmsg(c->fd, &m, MSG_NOSIGNAL);
        if (w >= 0) {
            c->sent += (size_t)w;
            continue;
        }
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            conn_close(s, c);  /* the client is gone (EPIPE, ECONNRESET) */
        return;
    }
}

static void on_drainable(metrics_http *s, conn *c)
{
    char sink[4096];
    for (;;) {
        ssize_t r = recv(c->fd, sink, sizeof sink, 0);
        if (r > 0) {
            c->drained += (size_t)r;
            if (c->drained >= DRAIN_BYTES)
                break;
            continue;
        }
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        break;  /* the client closed, or the socket failed */
    }
    conn_close(s, c);
}

/* A connection whose phase ran out of time: a slow head gets 408 (a silent connection, a port
 * probe, gets nothing), a slow reader or drain is closed. */
static void on_deadline(metrics_http *s, conn *c)
{
    if (c->phase == CONN_READ && c->n)
        respond_text(s, c, 408, "Request Timeout", NULL, "request timeout\n", false);
    else
        conn_close(s, c);
}

/* The connection that has sent nothing for longest (a port probe, an idle keep-open), or NULL
 * when every connection has sent something. */
static conn *oldest_silent(metrics_http *s)
{
    conn *best = NULL;
    for (int i = 0; i < s->nconns; i++) {
        conn *c = &s->conns[i];
        if (c->phase == CONN_READ && c->n == 0 && (!best || c->deadline < best->deadline))
            best = c;
    }
    return best;
}

/* Accepts what the table has room for, a full table making room by closing the connection
 * that has been silent longest: otherwise ~200 connections that send nothing, reopened as
 * they time out, kept every scrape waiting in the listen backlog (a review timed them out at
 * 10 s). Connections mid-request keep their slots; with all of them so, newcomers wait.
 * True when out of a resource (descriptors, memory), which persists while the listening
 * socket stays readable, so the caller backs off. */
static bool accept_new(metrics_http *s)
{
    for (;;) {
        conn *victim = NULL;
        if (s->nconns == METRICS_HTTP_MAX_CONNS && !(victim = oldest_silent(s)))
            return false;
        int fd = accept4(s->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            /* EAGAIN: none left; ECONNABORTED and the like: that client left. */
            return errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM;
        }
        if (victim)
            conn_close(s, victim);
        conn *c = &s->conns[s->nconns];
        *c = (conn){.fd = fd, .phase = CONN_READ, .deadline = strata_mono_ms() + s->timeout_ms};
        c->buf = malloc(s->max_head);
        if (!c->buf) {
            close(fd);
            return true;
        }
        s->nconns++;
    }
}

/* Waits up to ms for stop only: used to back off when accept keeps failing (out of file
 * descriptors), so the loop does not spin on a listening socket that stays readable. */
static bool sleep_or_stop(metrics_http *s, int ms)
{
    struct pollfd p = {.fd = s->wake_r, .events = POLLIN};
    return poll(&p, 1, ms) > 0;
}

static void *serve_thread(void *arg)
{
    metrics_http *s = arg;
    struct pollfd p[2 + METRICS_HTTP_MAX_CONNS];
    for (;;) {
        int64_t now = strata_mono_ms(), next = now + 60000;
        p[0] = (struct pollfd){.fd = s->wake_r, .events = POLLIN};
        /* A full table of connections mid-request leaves new clients in the listen backlog
         * until a slot frees; a silent one gives its slot up (accept_new). */
        p[1] = (struct pollfd){.fd = s->nconns < METRICS_HTTP_MAX_CONNS || oldest_silent(s) ? s->lfd : -1,
                               .events = POLLIN};
        for (int i = 0; i < s->nconns; i++) {
            conn *c = &s->conns[i];
            p[2 + i] = (struct pollfd){.fd = c->fd,
                                       .events = c->phase == CONN_WRITE ? POLLOUT : POLLIN};
            if (c->deadline < next)
                next = c->deadline;
        }
        int nfds = 2 + s->nconns;
        int n = poll(p, (nfds_t)nfds, next > now ? (int)(next - now) : 0);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (sleep_or_stop(s, 100))
                break;
            continue;
        }
        if (p[0].revents)
            break;
        /* Walk backwards: closing a connection moves the last one into its slot, which was
         * already handled (or is handled on the next round). */
        now = strata_mono_ms();
        for (int i = nfds - 3; i >= 0; i--) {
            conn *c = &s->conns[i];
            short ev = p[2 + i].revents;
            if (ev) {
                if (c->phase == CONN_READ)
                    on_readable(s, c);
                else if (c->phase == CONN_WRITE)
                    on_writable(s, c);
                else
                    on_drainable(s, c);
            } else if (c->deadline <= now) {
                on_deadline(s, c);
            }
        }
        if (p[1].revents && accept_new(s) && sleep_or_stop(s, 100))
            break;
    }
    while (s->nconns)
        conn_close(s, &s->conns[s->nconns - 1]);
    return NULL;
}

/* ---- address parsing and start/stop ---- */

static int parse_port(const char *p, const char *addr, uint16_t *port, strata_error *err)
{
    if (!*p)
        return strata_fail(err, STRATA_EINVAL, "metrics address '%s': missing port", addr);
    unsigned long v = 0;
    for (const char *c = p; *c; c++) {
        if (*c < '0' || *c > '9' || c - p >= 5)
            return strata_fail(err, STRATA_EINVAL,
                               "metrics address '%s': port '%s' is not a number 0..65535", addr,
                               p);
        v = v * 10 + (unsigned long)(*c - '0');
    }
    if (v > 65535)
        return strata_fail(err, STRATA_EINVAL,
                           "metrics address '%s': port %lu is not in 0..65535", addr, v);
    *port = (uint16_t)v;
    return STRATA_OK;
}

static int parse_addr(const char *addr, struct sockaddr_storage *ss, socklen_t *sslen,
                      strata_error *err)
{
    if (!addr || !*addr)
        return strata_fail(err, STRATA_EINVAL, "metrics address is empty (expected HOST:PORT)");
    memset(ss, 0, sizeof *ss);
    char host[64];
    const char *portstr;
    bool v6 = addr[0] == '[';
    if (v6) {
        const char *rb = strchr(addr, ']');
        if (!rb || rb[1] != ':')
            return strata_fail(err, STRATA_EINVAL,
                               "metrics address '%s': expected [IPV6]:PORT", addr);
        size_t hn = (size_t)(rb - addr - 1);
        if (hn == 0 || hn >= sizeof host)
            return strata_fail(err, STRATA_EINVAL, "metrics address '%s': bad IPv6 host", addr);
        memcpy(host, addr + 1, hn);
        host[hn] = '\0';
        portstr = rb + 2;
    } else {
        const char *colon = strrchr(addr, ':');
        if (!colon)
            return strata_fail(err, STRATA_EINVAL,
                               "metrics address '%s': expected HOST:PORT, e.g. %s", addr,
                               METRICS_HTTP_DEFAULT_ADDR);
        if (memchr(addr, ':', (size_t)(colon - addr)))
            return strata_fail(err, STRATA_EINVAL,
                               "metrics address '%s': an IPv6 host needs brackets, e.g. "
                               "[::1]:9400",
                               addr);
        size_t hn = (size_t)(colon - addr);
        if (hn == 0)
            return strata_fail(err, STRATA_EINVAL,
                               "metrics address '%s': missing host (127.0.0.1 for this machine "
                               "only, 0.0.0.0 for every interface)",
                               addr);
        if (hn >= sizeof host)
            return strata_fail(err, STRATA_EINVAL, "metrics address '%s': host too long", addr);
        memcpy(host, addr, hn);
        host[hn] = '\0';
        portstr = colon + 1;
    }
    uint16_t port;
    int rc = parse_port(portstr, addr, &port, err);
    if (rc)
        return rc;
    if (v6) {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)ss;
        a->sin6_family = AF_INET6;
        a->sin6_port = htons(port);
        if (inet_pton(AF_INET6, host, &a->sin6_addr) != 1)
            return strata_fail(err, STRATA_EINVAL,
                               "metrics address '%s': '%s' is not a numeric IPv6 address", addr,
                               host);
        *sslen = sizeof *a;
    } else {
        struct sockaddr_in *a = (struct sockaddr_in *)ss;
        a->sin_family = AF_INET;
        a->sin_port = htons(port);
        /* Only "localhost" by name: resolving names here would make the bind depend on DNS and
         * /etc/hosts ordering (IPv4 or IPv6 first). */
        const char *h = strcmp(host, "localhost") ? host : "127.0.0.1";
        if (inet_pton(AF_INET, h, &a->sin_addr) != 1)
            return strata_fail(err, STRATA_EINVAL,
                               "metrics address '%s': '%s' is not a numeric IPv4 address (or "
                               "localhost, or [IPv6])",
                               addr, host);
        *sslen = sizeof *a;
    }
    return STRATA_OK;
}

static void free_server(metrics_http *s)
{
    if (s->lfd >= 0)
        close(s->lfd);
    if (s->wake_r >= 0)
        close(s->wake_r);
    if (s->wake_w >= 0)
        close(s->wake_w);
    free(s);
}

int metrics_http_start_opts(metrics_registry *r, const char *addr,
                            const metrics_http_options *opts, metrics_http **out,
                            strata_error *err)
{
    if (!r || !out)
        return strata_fail(err, STRATA_EINVAL, "metrics_http_start: NULL argument");
    *out = NULL;
    int timeout_ms = METRICS_HTTP_TIMEOUT_MS;
    size_t max_head = METRICS_HTTP_MAX_HEAD;
    if (opts) {
        if (opts->timeout_ms < 0 || (opts->max_head && opts->max_head < 64))
            return strata_fail(err, STRATA_EINVAL,
                               "metrics server: timeout_ms must be >= 0 and max_head >= 64");
        if (opts->timeout_ms)
            timeout_ms = opts->timeout_ms;
        if (opts->max_head)
            max_head = opts->max_head;
    }
    struct sockaddr_storage ss;
    socklen_t sslen = 0;
    int rc = parse_addr(addr, &ss, &sslen, err);
    if (rc)
        return rc;

    metrics_http *s = calloc(1, sizeof *s);
    if (!s)
        return strata_fail(err, STRATA_ENOMEM, "metrics server: out of memory");
    s->lfd = s->wake_r = s->wake_w = -1;
    s->reg = r;
    s->timeout_ms = timeout_ms;
    s->max_head = max_head;
    int pfd[2];
    if (pipe2(pfd, O_CLOEXEC | O_NONBLOCK) != 0) {
        rc = strata_fail(err, STRATA_EIO, "metrics server: pipe: %s", strerror(errno));
        free_server(s);
        return rc;
    }
    s->wake_r = pfd[0];
    s->wake_w = pfd[1];

    s->lfd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (s->lfd < 0) {
        rc = strata_fail(err, STRATA_EIO, "metrics server: socket: %s", strerror(errno));
        free_server(s);
        return rc;
    }
    int one = 1;
    if (setsockopt(s->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0) {
        rc = strata_fail(err, STRATA_EIO, "metrics server: SO_REUSEADDR: %s", strerror(errno));
        free_server(s);
        return rc;
    }
    if (bind(s->lfd, (struct sockaddr *)&ss, sslen) != 0) {
        int e = errno;
        const char *why = e == EADDRINUSE      ? "the address is already in use"
                          : e == EADDRNOTAVAIL ? "not an address of this host"
                          : e == EACCES        ? "permission denied (ports below 1024 need "
                                                 "privileges)"
                                               : strerror(e);
        rc = strata_fail(err, STRATA_EIO, "metrics server: cannot bind %s: %s", addr, why);
        free_server(s);
        return rc;
    }
    if (listen(s->lfd, METRICS_HTTP_MAX_CONNS) != 0) {
        int e = errno;
        rc = strata_fail(err, STRATA_EIO, "metrics server: cannot listen on %s: %s", addr,
                         e == EADDRINUSE ? "the address is already in use" : strerror(e));
        free_server(s);
        return rc;
    }
    struct sockaddr_storage bound;
    socklen_t blen = sizeof bound;
    if (getsockname(s->lfd, (struct sockaddr *)&bound, &blen) != 0) {
        rc = strata_fail(err, STRATA_EIO, "metrics server: getsockname: %s", strerror(errno));
        free_server(s);
        return rc;
    }
    s->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                : ((struct sockaddr_in *)&bound)->sin_port);

    /* The thread inherits the signal mask: block everything so SIGINT/SIGTERM handlers run on
     * the coordinator's own threads, never in the middle of a scrape. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int e = pthread_create(&s->thread, NULL, serve_thread, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (e != 0) {
        rc = strata_fail(err, STRATA_EIO, "metrics server: cannot start thread: %s", strerror(e));
        free_server(s);
        return rc;
    }
    *out = s;
    return STRATA_OK;
}

int metrics_http_start(metrics_registry *r, const char *addr, metrics_http **out,
                       strata_error *err)
{
    return metrics_http_start_opts(r, addr, NULL, out, err);
}

uint16_t metrics_http_port(const metrics_http *s) { return s ? s->port : 0; }

void metrics_http_stop(metrics_http *s)
{
    if (!s)
        return;
    /* The pipe stays readable once written, so every later poll in the thread sees it; a full
     * pipe (EAGAIN) already holds a wakeup. */
    ssize_t w;
    do {
        w = write(s->wake_w, "x", 1);
    } while (w < 0 && errno == EINTR);
    pthread_join(s->thread, NULL);
    free_server(s);
}
