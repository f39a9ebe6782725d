/* The scrape server of coordinator/metrics/http.h. */
#include "coordinator/metrics/http.h"

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
 * linger_close). */
#define DRAIN_MS 500
#define DRAIN_BYTES (1u << 20)

struct metrics_http {
    metrics_registry *reg;
    int lfd;               /* listening socket, non-blocking */
    int wake_r, wake_w;    /* self-pipe: stop writes a byte, every poll watches wake_r */
    pthread_t thread;
    uint16_t port;
    int timeout_ms;
    size_t max_head;
    char *buf;             /* max_head bytes for the request head, reused per connection */
};

/* ---- time and waiting ---- */

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

enum { WAIT_STOP = -1, WAIT_TIMEOUT = 0, WAIT_READY = 1 };

/* Waits until fd has `events` (or an error/hangup, which the following recv/send reports), the
 * deadline passes, or stop is requested. */
static int wait_fd(metrics_http *s, int fd, short events, int64_t deadline)
{
    for (;;) {
        int64_t left = deadline - now_ms();
        if (left <= 0)
            return WAIT_TIMEOUT;
        struct pollfd p[2] = {{.fd = fd, .events = events}, {.fd = s->wake_r, .events = POLLIN}};
        int n = poll(p, 2, left > 60000 ? 60000 : (int)left);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN)
                continue;
            return WAIT_STOP;  /* poll itself failing (EINVAL, ENOMEM): give the client up */
        }
        if (p[1].revents)
            return WAIT_STOP;
        if (p[0].revents)
            return WAIT_READY;
    }
}

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

/* Sends every byte of iov before the deadline; false when the client is gone, too slow, or stop
 * was requested. */
static bool send_all(metrics_http *s, int fd, struct iovec *iov, int iovcnt, int64_t deadline)
{
    while (iovcnt > 0) {
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)iovcnt};
        ssize_t w = sendmsg(fd, &m, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                if (wait_fd(s, fd, POLLOUT, deadline) != WAIT_READY)
                    return false;
                continue;
            }
            return false;
        }
        size_t done = (size_t)w;
        while (iovcnt > 0 && done >= iov->iov_len) {
            done -= iov->iov_len;
            iov++;
            iovcnt--;
        }
        if (iovcnt > 0) {
            iov->iov_base = (char *)iov->iov_base + done;
            iov->iov_len -= done;
        }
    }
    return true;
}

static bool respond(metrics_http *s, int fd, int status, const char *reason, const char *ctype,
                    const char *extra, const char *body, size_t blen, bool head_only)
{
    char date[40], head[512];
    http_date(date);
    int n = snprintf(head, sizeof head,
                     "HTTP/1.1 %d %s\r\n"
                     "Content-Type: %s\r\n"
                     "Content-Length: %zu\r\n"
                     "%s%s"
                     "Cache-Control: no-store\r\n"
                     "Connection: close\r\n"
                     "\r\n",
                     status, reason, ctype, blen, date, extra ? extra : "");
    if (n < 0 || (size_t)n >= sizeof head)
        return false;  /* cannot happen with our fixed strings; never send a cut header */
    struct iovec iov[2] = {{head, (size_t)n}, {(void *)body, head_only ? 0 : blen}};
    return send_all(s, fd, iov, head_only || !blen ? 1 : 2, now_ms() + s->timeout_ms);
}

static bool respond_text(metrics_http *s, int fd, int status, const char *reason,
                         const char *extra, const char *text, bool head_only)
{
    return respond(s, fd, status, reason, "text/plain; charset=utf-8", extra, text, strlen(text),
                   head_only);
}

/* Closing a socket with unread input makes the kernel send RST, and a client that receives RST
 * before reading our answer loses it (the 431 for a long head, or a request with a body). So we
 * half-close and read until the client closes, for a short while: a well-behaved client closes
 * as soon as it has read the response, so this normally ends at once. */
static void linger_close(metrics_http *s, int fd)
{
    if (shutdown(fd, SHUT_WR) == 0) {
        int64_t deadline = now_ms() + (s->timeout_ms < DRAIN_MS ? s->timeout_ms : DRAIN_MS);
        size_t drained = 0;
        char sink[4096];
        while (drained < DRAIN_BYTES) {
            ssize_t r = recv(fd, sink, sizeof sink, 0);
            if (r > 0) {
                drained += (size_t)r;
                continue;
            }
            if (r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
                break;
            if (errno == EINTR)
                continue;
            if (wait_fd(s, fd, POLLIN, deadline) != WAIT_READY)
                break;
        }
    }
    close(fd);
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

/* ---- one connection ---- */

static void serve_connection(metrics_http *s, int fd)
{
    int64_t deadline = now_ms() + s->timeout_ms;
    size_t n = 0, end = 0, searched = 0;
    for (;;) {
        end = head_end(s->buf, n, searched);
        searched = n;
        if (end)
            break;
        if (n == s->max_head) {
            respond_text(s, fd, 431, "Request Header Fields Too Large", NULL,
                         "request head too large\n", false);
            linger_close(s, fd);
            return;
        }
        int w = wait_fd(s, fd, POLLIN, deadline);
        if (w == WAIT_STOP) {
            close(fd);
            return;
        }
        if (w == WAIT_TIMEOUT) {
            if (n)  /* a silent connection (a port probe) gets nothing; a slow one an answer */
                respond_text(s, fd, 408, "Request Timeout", NULL, "request timeout\n", false);
            linger_close(s, fd);
            return;
        }
        ssize_t r = recv(fd, s->buf + n, s->max_head - n, 0);
        if (r > 0) {
            n += (size_t)r;
            continue;
        }
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
            continue;
        if (r == 0 && n)  /* closed its sending side mid-head: still tell it why */
            respond_text(s, fd, 400, "Bad Request", NULL, "incomplete request\n", false);
        close(fd);
        return;
    }

    request q;
    parse_request(s->buf, end, &q);
    if (q.status == 400) {
        respond_text(s, fd, 400, "Bad Request", NULL, "malformed request\n", false);
    } else if (q.status == 505) {
        respond_text(s, fd, 505, "HTTP Version Not Supported", NULL, "use HTTP/1.1\n", false);
    } else {
        bool metrics = !q.path_too_long && !strcmp(q.path, "/metrics");
        bool health = !q.path_too_long && !strcmp(q.path, "/healthz");
        bool get = !strcmp(q.method, "GET"), head = !strcmp(q.method, "HEAD");
        if (!metrics && !health) {
            respond_text(s, fd, 404, "Not Found", NULL, "not found\n", head);
        } else if (!get && !head) {
            respond_text(s, fd, 405, "Method Not Allowed", "Allow: GET, HEAD\r\n",
                         "method not allowed\n", head);
        } else if (health) {
            respond(s, fd, 200, "OK", "text/plain; charset=utf-8", NULL, "ok", 2, head);
        } else {
            char *body = NULL;
            size_t blen = 0;
            if (metrics_render(s->reg, &body, &blen, NULL) == STRATA_OK)
                respond(s, fd, 200, "OK", METRICS_CONTENT_TYPE, NULL, body, blen, head);
            else
                respond_text(s, fd, 500, "Internal Server Error", NULL,
                             "cannot render metrics\n", head);
            free(body);
        }
    }
    linger_close(s, fd);
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
    for (;;) {
        struct pollfd p[2] = {{.fd = s->lfd, .events = POLLIN}, {.fd = s->wake_r, .events = POLLIN}};
        int n = poll(p, 2, -1);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (sleep_or_stop(s, 100))
                break;
            continue;
        }
        if (p[1].revents)
            break;
        if (!p[0].revents)
            continue;
        int c = accept4(s->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (c < 0) {
            /* EAGAIN: another wakeup took it; ECONNABORTED etc.: the client left. Resource
             * errors (EMFILE, ENFILE, ENOBUFS, ENOMEM) persist, so back off. */
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                if (sleep_or_stop(s, 100))
                    break;
            }
            continue;
        }
        serve_connection(s, c);
    }
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
    free(s->buf);
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
    s->buf = malloc(max_head);
    if (!s->buf) {
        free_server(s);
        return strata_fail(err, STRATA_ENOMEM, "metrics server: out of memory");
    }
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
    if (listen(s->lfd, 16) != 0) {
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
