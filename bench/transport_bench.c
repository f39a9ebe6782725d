/* The TCP data plane over loopback: one-way throughput of messages of several sizes (a thread
 * sends, this one receives into one buffer) and the round trip of a decode step's rows (a
 * message there and back, the median of many). It uses only the public transport.h API, so
 * bench/transport.sh can build it against an older revision's library too and run both side by
 * side (the encrypted stream against the plaintext one before it).
 *
 * usage: strata-bench-transport [--total-mib N] [--rtt-iters N] [--rtt-bytes N] [--label TEXT]
 * Prints one line per measurement: LABEL  what  value  unit. */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvstore/clock.h"
#include "worker/transport/transport.h"

static const uint8_t secret[32] = "strata transport benchmark key!";
static const dp_auth auth = {secret, sizeof secret};

static void die(const char *what, const strata_error *err)
{
    fprintf(stderr, "strata-bench-transport: %s: %s\n", what, err->msg);
    exit(1);
}

typedef struct accept_job {
    dp_listener *l;
    dp_options opts;
    dp_link *link;
    int rc;
    strata_error err;
} accept_job;

static void *accept_main(void *p)
{
    accept_job *j = p;
    j->rc = dp_tcp_accept(j->l, &auth, &j->opts, 10000, &j->link, &j->err);
    return NULL;
}

static void make_pair(dp_link **server, dp_link **client)
{
    strata_error err = {0};
    dp_listener *l;
    if (dp_tcp_listen("127.0.0.1:0", &l, &err) != STRATA_OK)
        die("listen", &err);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%u", (unsigned)dp_listener_port(l));
    accept_job j = {.l = l, .opts = {.max_payload = (uint64_t)1 << 30}};
    pthread_t t;
    if (pthread_create(&t, NULL, accept_main, &j) != 0) {
        fprintf(stderr, "strata-bench-transport: pthread_create failed\n");
        exit(1);
    }
    int rc = dp_tcp_connect(addr, &auth, NULL, 10000, client, &err);
    pthread_join(t, NULL);
    if (rc != STRATA_OK)
        die("connect", &err);
    if (j.rc != STRATA_OK)
        die("accept", &j.err);
    *server = j.link;
    dp_listener_close(l);
}

typedef struct send_job {
    dp_link *link;
    const uint8_t *payload;
    size_t len;
    int count;
    int rc;
    strata_error err;
} send_job;

static void *send_main(void *p)
{
    send_job *j = p;
    dp_msg_header h = {.kind = DP_MSG_KV_BLOCK};
    j->rc = STRATA_OK;
    for (int i = 0; i < j->count && j->rc == STRATA_OK; i++) {
        h.step = (uint64_t)i;
        j->rc = dp_send(j->link, &h, j->payload, j->len, &j->err);
    }
    return NULL;
}

/* GB/s (10^9 bytes) of payload moved one way in count messages of len bytes. */
static double throughput(dp_link *server, dp_link *client, uint8_t *src, uint8_t *dst, size_t len, int count)
{
    send_job j = {.link = client, .payload = src, .len = len, .count = count};
    pthread_t t;
    double t0 = strata_mono_s();
    if (pthread_create(&t, NULL, send_main, &j) != 0) {
        fprintf(stderr, "strata-bench-transport: pthread_create failed\n");
        exit(1);
    }
    strata_error err = {0};
    for (int i = 0; i < count; i++) {
        dp_msg_header h;
        size_t got = 0;
        if (dp_recv(server, &h, dst, len, &got, 60000, &err) != STRATA_OK)
            die("receive", &err);
        if (got != len || h.step != (uint64_t)i) {
            fprintf(stderr, "strata-bench-transport: message %d: %zu bytes, step %llu\n", i, got,
                    (unsigned long long)h.step);
            exit(1);
        }
    }
    pthread_join(t, NULL);
    double dt = strata_mono_s() - t0;
    if (j.rc != STRATA_OK)
        die("send", &j.err);
    if (memcmp(src, dst, len) != 0) {
        fprintf(stderr, "strata-bench-transport: payload differs after the round\n");
        exit(1);
    }
    return (double)len * count / dt / 1e9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static long parse_long(const char *s, const char *flag)
{
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || !*s || *end || v <= 0) {
        fprintf(stderr, "strata-bench-transport: %s needs a positive integer, got '%s'\n", flag, s);
        exit(2);
    }
    return v;
}

int main(int argc, char **argv)
{
    long total_mib = 512, rtt_iters = 2000, rtt_bytes = 4608; /* 2 rows of SmolLM2's 576 f32 */
    const char *label = "strata";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: strata-bench-transport [--total-mib N] [--rtt-iters N] [--rtt-bytes N] [--label TEXT]\n"
                   "  one-way throughput over loopback TCP links (N MiB per message size, default 512),\n"
                   "  and the median round trip of an N-byte message (default 4608 bytes, 2000 times)\n");
            return 0;
        }
        if (strcmp(argv[i], "--total-mib") && strcmp(argv[i], "--rtt-iters") && strcmp(argv[i], "--rtt-bytes") &&
            strcmp(argv[i], "--label")) {
            fprintf(stderr, "strata-bench-transport: unknown option %s (--help)\n", argv[i]);
            return 2;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "strata-bench-transport: %s needs a value (--help)\n", argv[i]);
            return 2;
        }
        if (!strcmp(argv[i], "--total-mib"))
            total_mib = parse_long(argv[++i], "--total-mib");
        else if (!strcmp(argv[i], "--rtt-iters"))
            rtt_iters = parse_long(argv[++i], "--rtt-iters");
        else if (!strcmp(argv[i], "--rtt-bytes"))
            rtt_bytes = parse_long(argv[++i], "--rtt-bytes");
        else
            label = argv[++i];
    }
    const size_t sizes[] = {4608, 65536, 1 << 20, 64 << 20};
    const size_t biggest = sizes[sizeof sizes / sizeof sizes[0] - 1];
    if ((size_t)rtt_bytes > biggest) {
        fprintf(stderr, "strata-bench-transport: --rtt-bytes at most %zu\n", biggest);
        return 2;
    }
    uint8_t *src = malloc(biggest), *dst = malloc(biggest);
    if (!src || !dst) {
        fprintf(stderr, "strata-bench-transport: out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < biggest; i++)
        src[i] = (uint8_t)(i * 2654435761u >> 13);
    dp_link *server, *client;
    make_pair(&server, &client);
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        size_t total = (size_t)total_mib << 20;
        int count = (int)(total / sizes[k] > 0 ? total / sizes[k] : 1);
        throughput(server, client, src, dst, sizes[k], count > 8 ? count / 8 : 1); /* warm up */
        double gbps = throughput(server, client, src, dst, sizes[k], count);
        printf("%s\tthroughput_%zuB\t%.3f\tGB/s\n", label, sizes[k], gbps);
        fflush(stdout);
    }

    /* Round trips: the client sends, the server answers with the same bytes. */
    double *rtt = malloc(sizeof *rtt * (size_t)rtt_iters);
    if (!rtt) {
        fprintf(stderr, "strata-bench-transport: out of memory\n");
        return 1;
    }
    strata_error err = {0};
    dp_msg_header h = {.kind = DP_MSG_CONTROL}, got;
    size_t len;
    for (long i = 0; i < rtt_iters; i++) {
        double t0 = strata_mono_s();
        if (dp_send(client, &h, src, (size_t)rtt_bytes, &err) != STRATA_OK ||
            dp_recv(server, &got, dst, biggest, &len, 10000, &err) != STRATA_OK ||
            dp_send(server, &h, dst, len, &err) != STRATA_OK ||
            dp_recv(client, &got, dst, biggest, &len, 10000, &err) != STRATA_OK)
            die("round trip", &err);
        rtt[i] = strata_mono_s() - t0;
    }
    qsort(rtt, (size_t)rtt_iters, sizeof *rtt, cmp_double);
    printf("%s\tround_trip_%ldB_median\t%.1f\tus\n", label, rtt_bytes, rtt[rtt_iters / 2] * 1e6);
    printf("%s\tround_trip_%ldB_p99\t%.1f\tus\n", label, rtt_bytes, rtt[(size_t)(rtt_iters * 99 / 100)] * 1e6);
    free(rtt);
    dp_link_close(client);
    dp_link_close(server);
    free(src);
    free(dst);
    return 0;
}
