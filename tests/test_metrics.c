/* The coordinator's Prometheus metrics (coordinator/metrics/): counter, gauge and histogram
 * values; the exact text exposition of a small registry (help and label escaping, NaN/Inf,
 * float formatting, histogram buckets); bucket edges; name and label validation; family
 * rules; concurrent updates from several threads while rendering; the collect hook; and the
 * HTTP server over a real loopback socket (routes, errors, oversized and silent clients, a
 * client that hangs up mid-response, bind errors, prompt stop). */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "tests/test_time.h"
#include "coordinator/metrics/http.h"
#include "coordinator/metrics/metrics.h"

static char *render(metrics_registry *r, size_t *len)
{
    char *out = NULL;
    size_t n = 0;
    strata_error err = {0};
    assert_int_equal(metrics_render(r, &out, &n, &err), STRATA_OK);
    assert_non_null(out);
    assert_int_equal(strlen(out), n);
    if (len)
        *len = n;
    return out;
}

/* ---- registry ---- */

static void test_counter_gauge_values(void **state)
{
    (void)state;
    metrics_registry *r = metrics_create();
    assert_non_null(r);
    strata_error err = {0};
    metrics_counter *c;
    metrics_gauge *g;
    assert_int_equal(metrics_counter_new(r, "c_total", "a counter", NULL, 0, &c, &err), STRATA_OK);
    assert_int_equal(metrics_gauge_new(r, "g", "a gauge", NULL, 0, &g, &err), STRATA_OK);
    assert_int_equal(metrics_counter_value(c), 0);
    metrics_counter_inc(c);
    metrics_counter_add(c, 41);
    assert_int_equal(metrics_counter_value(c), 42);
    assert_true(metrics_gauge_value(g) == 0.0);
    metrics_gauge_set(g, 2.5);
    metrics_gauge_add(g, -4.0);
    assert_true(metrics_gauge_value(g) == -1.5);
    metrics_gauge_set(g, NAN);
    assert_true(isnan(metrics_gauge_value(g)));

    /* An empty registry renders as an empty string. */
    metrics_registry *empty = metrics_create();
    size_t n = 99;
    char *txt = render(empty, &n);
    assert_int_equal(n, 0);
    assert_string_equal(txt, "");
    free(txt);
    metrics_destroy(empty);
    metrics_destroy(r);
    metrics_destroy(NULL);
}

static void test_render_full_text(void **state)
{
    (void)state;
    metrics_registry *r = metrics_create();
    assert_non_null(r);
    strata_error err = {0};
    metrics_counter *req;
    assert_int_equal(metrics_counter_new(r, "strata_requests_total", "Requests received.", NULL, 0,
                                         &req, &err),
                     STRATA_OK);
    metrics_counter_add(req, 3);

    static const char *const tiers[] = {"device", "host", "nvme"};
    metrics_gauge *kv[3];
    assert_int_equal(metrics_gauge_family(r, "strata_kv_blocks", "KV blocks per tier.", "tier",
                                          tiers, 3, kv, &err),
                     STRATA_OK);
    metrics_gauge_set(kv[0], 10);
    metrics_gauge_set(kv[1], 2.5);

    const double bounds[] = {0.125, 0.5, 1};
    metrics_histogram *ttft;
    assert_int_equal(metrics_histogram_new(r, "strata_ttft_seconds", "Time to first token.", NULL,
                                           0, bounds, 3, &ttft, &err),
                     STRATA_OK);
    const double obs[] = {0.125, 0.25, 0.5, 0.75, 3};  /* two land exactly on a bound */
    for (size_t i = 0; i < 5; i++)
        metrics_histogram_observe(ttft, obs[i]);

    const double one[] = {1};
    metrics_histogram *itl;
    const metrics_label model = {"model", "m1"};
    assert_int_equal(metrics_histogram_new(r, "strata_itl_seconds", "Inter-token latency.", &model,
                                           1, one, 1, &itl, &err),
                     STRATA_OK);
    metrics_histogram_observe(itl, 2);

    /* No help: no HELP line. Label values escaped; NaN and infinities spelled as the format
     * wants. */
    metrics_gauge *odd[3];
    const metrics_label l0 = {"path", "a\"b\\c\nd"}, l1 = {"path", "x"}, l2 = {"path", "y"};
    assert_int_equal(metrics_gauge_new(r, "odd_values", NULL, &l0, 1, &odd[0], &err), STRATA_OK);
    assert_int_equal(metrics_gauge_new(r, "odd_values", NULL, &l1, 1, &odd[1], &err), STRATA_OK);
    assert_int_equal(metrics_gauge_new(r, "odd_values", NULL, &l2, 1, &odd[2], &err), STRATA_OK);
    metrics_gauge_set(odd[0], NAN);
    metrics_gauge_set(odd[1], INFINITY);
    metrics_gauge_set(odd[2], -INFINITY);

    /* Floats: shortest text that reads back exactly. */
    static const char *const fv[] = {"a", "b", "c", "d"};
    metrics_gauge *fmt[4];
    assert_int_equal(metrics_gauge_family(r, "fmt_values", "Formatting.", "v", fv, 4, fmt, &err),
                     STRATA_OK);
    metrics_gauge_set(fmt[0], 1e-5);
    metrics_gauge_set(fmt[1], 123456789.125);
    metrics_gauge_set(fmt[2], 0.1 + 0.2);
    metrics_gauge_set(fmt[3], 1e20);

    /* Help escapes backslash and newline only. Two labels keep their registration order. */
    metrics_counter *esc;
    const metrics_label two[] = {{"b", "1"}, {"a", "2"}};
    assert_int_equal(metrics_counter_new(r, "escaped_total", "line1\nback\\slash \"q\"", two, 2,
                                         &esc, &err),
                     STRATA_OK);

    const char *want =
        "# HELP strata_requests_total Requests received.\n"
        "# TYPE strata_requests_total counter\n"
        "strata_requests_total 3\n"
        "# HELP strata_kv_blocks KV blocks per tier.\n"
        "# TYPE strata_kv_blocks gauge\n"
        "strata_kv_blocks{tier=\"device\"} 10\n"
        "strata_kv_blocks{tier=\"host\"} 2.5\n"
        "strata_kv_blocks{tier=\"nvme\"} 0\n"
        "# HELP strata_ttft_seconds Time to first token.\n"
        "# TYPE strata_ttft_seconds histogram\n"
        "strata_ttft_seconds_bucket{le=\"0.125\"} 1\n"
        "strata_ttft_seconds_bucket{le=\"0.5\"} 3\n"
        "strata_ttft_seconds_bucket{le=\"1\"} 4\n"
        "strata_ttft_seconds_bucket{le=\"+Inf\"} 5\n"
        "strata_ttft_seconds_sum 4.625\n"
        "strata_ttft_seconds_count 5\n"
        "# HELP strata_itl_seconds Inter-token latency.\n"
        "# TYPE strata_itl_seconds histogram\n"
        "strata_itl_seconds_bucket{model=\"m1\",le=\"1\"} 0\n"
        "strata_itl_seconds_bucket{model=\"m1\",le=\"+Inf\"} 1\n"
        "strata_itl_seconds_sum{model=\"m1\"} 2\n"
        "strata_itl_seconds_count{model=\"m1\"} 1\n"
        "# TYPE odd_values gauge\n"
        "odd_values{path=\"a\\\"b\\\\c\\nd\"} NaN\n"
        "odd_values{path=\"x\"} +Inf\n"
        "odd_values{path=\"y\"} -Inf\n"
        "# HELP fmt_values Formatting.\n"
        "# TYPE fmt_values gauge\n"
        "fmt_values{v=\"a\"} 1e-05\n"
        "fmt_values{v=\"b\"} 123456789.125\n"
        "fmt_values{v=\"c\"} 0.30000000000000004\n"
        "fmt_values{v=\"d\"} 1e+20\n"
        "# HELP escaped_total line1\\nback\\\\slash \"q\"\n"
        "# TYPE escaped_total counter\n"
        "escaped_total{b=\"1\",a=\"2\"} 0\n";
    char *txt = render(r, NULL);
    assert_string_equal(txt, want);
    free(txt);
    metrics_destroy(r);
}

static void test_histogram_edges(void **state)
{
    (void)state;
    metrics_registry *r = metrics_create();
    strata_error err = {0};
    const double b[] = {-1, 0, 1, 10};
    metrics_histogram *h;
    assert_int_equal(metrics_histogram_new(r, "h", "x", NULL, 0, b, 4, &h, &err), STRATA_OK);
    metrics_histogram_observe(h, -1);        /* == first bound: bucket le=-1 */
    metrics_histogram_observe(h, -5);        /* below every bound: first bucket */
    metrics_histogram_observe(h, -INFINITY); /* first bucket too */
    metrics_histogram_observe(h, 0);         /* le=0 */
    metrics_histogram_observe(h, -0.0);      /* -0 == 0: le=0 */
    metrics_histogram_observe(h, 1e-300);    /* just above 0: le=1 */
    metrics_histogram_observe(h, 10);        /* == last bound: le=10, not +Inf */
    metrics_histogram_observe(h, nextafter(10, 11)); /* +Inf */
    metrics_histogram_observe(h, NAN);       /* dropped */
    uint64_t cum[5], count;
    double sum;
    assert_int_equal(metrics_histogram_read(h, cum, &sum, &count), 4);
    assert_int_equal(cum[0], 3);
    assert_int_equal(cum[1], 5);
    assert_int_equal(cum[2], 6);
    assert_int_equal(cum[3], 7);
    assert_int_equal(cum[4], 8);
    assert_int_equal(count, 8);
    assert_true(isinf(sum) && sum < 0);  /* the -Inf observation */

    /* +Inf observations: +Inf bucket, sum +Inf. A trailing +Inf bound is dropped, not doubled. */
    const double b2[] = {1, INFINITY};
    metrics_histogram *h2;
    assert_int_equal(metrics_histogram_new(r, "h2", "x", NULL, 0, b2, 2, &h2, &err), STRATA_OK);
    metrics_histogram_observe(h2, INFINITY);
    assert_int_equal(metrics_histogram_read(h2, cum, &sum, &count), 1);
    assert_int_equal(cum[0], 0);
    assert_int_equal(cum[1], 1);
    assert_true(isinf(sum) && sum > 0);

    /* No bounds at all: only +Inf. */
    metrics_histogram *h3;
    assert_int_equal(metrics_histogram_new(r, "h3", NULL, NULL, 0, NULL, 0, &h3, &err), STRATA_OK);
    metrics_histogram_observe(h3, 0.5);
    char *txt = render(r, NULL);
    assert_non_null(strstr(txt, "h2_bucket{le=\"1\"} 0\nh2_bucket{le=\"+Inf\"} 1\nh2_sum +Inf\n"
                                "h2_count 1\n"));
    assert_non_null(strstr(txt, "# TYPE h3 histogram\nh3_bucket{le=\"+Inf\"} 1\nh3_sum 0.5\n"
                                "h3_count 1\n"));
    assert_null(strstr(txt, "h2_bucket{le=\"+Inf\"} 1\nh2_bucket{le=\"+Inf\"}"));
    free(txt);
    metrics_destroy(r);
}

static void test_buckets(void **state)
{
    (void)state;
    strata_error err = {0};
    double b[METRICS_LATENCY_BUCKETS];
    metrics_latency_buckets(b);
    assert_true(b[0] == 0.001);
    assert_true(b[METRICS_LATENCY_BUCKETS - 1] == 65.536);
    for (int i = 1; i < METRICS_LATENCY_BUCKETS; i++)
        assert_true(b[i] == 2 * b[i - 1]);
    double e[4];
    assert_int_equal(metrics_buckets_exponential(0.5, 4, 4, e, &err), STRATA_OK);
    assert_true(e[0] == 0.5 && e[1] == 2 && e[2] == 8 && e[3] == 32);
    assert_int_equal(metrics_buckets_exponential(0, 2, 4, e, &err), STRATA_EINVAL);
    assert_int_equal(metrics_buckets_exponential(1, 1, 4, e, &err), STRATA_EINVAL);
    assert_int_equal(metrics_buckets_exponential(1, 2, 0, e, &err), STRATA_EINVAL);
    assert_int_equal(metrics_buckets_exponential(NAN, 2, 4, e, &err), STRATA_EINVAL);
    double big[METRICS_MAX_BUCKETS];
    assert_int_equal(metrics_buckets_exponential(1e300, 1e10, 3, big, &err), STRATA_EINVAL);
    assert_int_equal(metrics_buckets_exponential(1, 2, METRICS_MAX_BUCKETS + 1, big, &err),
                     STRATA_EINVAL);

    /* The latency buckets render as the short decimals people expect. */
    metrics_registry *r = metrics_create();
    metrics_histogram *h;
    assert_int_equal(metrics_histogram_new(r, "strata_ttft_seconds", "TTFT.", NULL, 0, b,
                                           METRICS_LATENCY_BUCKETS, &h, &err),
                     STRATA_OK);
    char *txt = render(r, NULL);
    const char *les[] = {"0.001", "0.002", "0.004", "0.008", "0.016", "0.032",
                         "0.064", "0.128", "0.256", "0.512", "1.024", "2.048",
                         "4.096", "8.192", "16.384", "32.768", "65.536"};
    for (size_t i = 0; i < sizeof les / sizeof *les; i++) {
        char want[64];
        snprintf(want, sizeof want, "strata_ttft_seconds_bucket{le=\"%s\"} 0\n", les[i]);
        assert_non_null(strstr(txt, want));
    }
    free(txt);
    metrics_destroy(r);
}

static void test_invalid_names_and_families(void **state)
{
    (void)state;
    metrics_registry *r = metrics_create();
    strata_error err = {0};
    metrics_counter *c = (metrics_counter *)&err;  /* must be reset to NULL on failure */
    metrics_gauge *g;
    metrics_histogram *h;
    const char *bad_names[] = {"", "1abc", "a-b", "a b", "a.b", "é", "a{b}"};
    for (size_t i = 0; i < sizeof bad_names / sizeof *bad_names; i++) {
        err = (strata_error){0};
        assert_int_equal(metrics_counter_new(r, bad_names[i], "x", NULL, 0, &c, &err),
                         STRATA_EINVAL);
        assert_null(c);
        assert_non_null(strstr(err.msg, "invalid"));
    }
    assert_int_equal(metrics_counter_new(r, NULL, "x", NULL, 0, &c, &err), STRATA_EINVAL);
    /* Colons and underscores anywhere, digits after the first character, are fine. */
    assert_int_equal(metrics_counter_new(r, "_a:b_9:", "x", NULL, 0, &c, &err), STRATA_OK);
    assert_int_equal(metrics_counter_new(r, ":x", "x", NULL, 0, &c, &err), STRATA_OK);

    /* Label names: grammar, reserved __ prefix, duplicates, le on histograms. */
    const metrics_label bad_labels[][2] = {
        {{"1a", "v"}, {"b", "v"}}, {{"a-b", "v"}, {"b", "v"}}, {{"a:b", "v"}, {"b", "v"}},
        {{"__name__", "v"}, {"b", "v"}}, {{"a", "v"}, {"a", "w"}}, {{"a", NULL}, {"b", "v"}},
        {{"a", "\xff"}, {"b", "v"}}, {{"a", "\xc0\xaf"}, {"b", "v"}}, {{"", "v"}, {"b", "v"}},
    };
    for (size_t i = 0; i < sizeof bad_labels / sizeof *bad_labels; i++)
        assert_int_equal(metrics_gauge_new(r, "lab", "x", bad_labels[i], 2, &g, &err),
                         STRATA_EINVAL);
    const metrics_label utf8 = {"a", "caf\xc3\xa9 \xe2\x82\xac"};
    assert_int_equal(metrics_gauge_new(r, "lab", "x", &utf8, 1, &g, &err), STRATA_OK);
    assert_int_equal(metrics_gauge_new(r, "badhelp", "\xe2\x82", NULL, 0, &g, &err),
                     STRATA_EINVAL);
    const metrics_label le = {"le", "1"};
    const double bounds[] = {1, 2};
    assert_int_equal(metrics_histogram_new(r, "hl", "x", &le, 1, bounds, 2, &h, &err),
                     STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "le"));
    assert_int_equal(metrics_gauge_new(r, "gle", "x", &le, 1, &g, &err), STRATA_OK);

    /* Bounds: increasing, finite. */
    const double dec[] = {1, 1}, nan_b[] = {1, NAN}, ninf[] = {-INFINITY, 1};
    assert_int_equal(metrics_histogram_new(r, "hb", "x", NULL, 0, dec, 2, &h, &err),
                     STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "increasing"));
    assert_int_equal(metrics_histogram_new(r, "hb", "x", NULL, 0, nan_b, 2, &h, &err),
                     STRATA_EINVAL);
    assert_int_equal(metrics_histogram_new(r, "hb", "x", NULL, 0, ninf, 2, &h, &err),
                     STRATA_EINVAL);
    assert_int_equal(metrics_histogram_new(r, "hb", "x", NULL, 0, NULL, 2, &h, &err),
                     STRATA_EINVAL);

    /* Families: duplicate series, other type, other help, other label names, other buckets. */
    const metrics_label dev = {"tier", "device"}, host = {"tier", "host"}, other = {"kind", "x"};
    assert_int_equal(metrics_gauge_new(r, "fam", "help", &dev, 1, &g, &err), STRATA_OK);
    assert_int_equal(metrics_gauge_new(r, "fam", "help", &dev, 1, &g, &err), STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "already registered"));
    assert_int_equal(metrics_counter_new(r, "fam", "help", &host, 1, &c, &err), STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "gauge"));
    assert_int_equal(metrics_gauge_new(r, "fam", "other help", &host, 1, &g, &err),
                     STRATA_EINVAL);
    assert_int_equal(metrics_gauge_new(r, "fam", "help", &other, 1, &g, &err), STRATA_EINVAL);
    assert_int_equal(metrics_gauge_new(r, "fam", "help", NULL, 0, &g, &err), STRATA_EINVAL);
    assert_int_equal(metrics_gauge_new(r, "fam", "help", &host, 1, &g, &err), STRATA_OK);
    assert_int_equal(metrics_histogram_new(r, "hf", "x", &dev, 1, bounds, 2, &h, &err), STRATA_OK);
    assert_int_equal(metrics_histogram_new(r, "hf", "x", &host, 1, bounds, 1, &h, &err),
                     STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "buckets"));

    /* Sample-name clashes with a histogram's _bucket/_sum/_count, in both orders. */
    assert_int_equal(metrics_histogram_new(r, "lat", "x", NULL, 0, bounds, 2, &h, &err),
                     STRATA_OK);
    assert_int_equal(metrics_counter_new(r, "lat_count", "x", NULL, 0, &c, &err), STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "clashes"));
    assert_int_equal(metrics_gauge_new(r, "lat_bucket", "x", NULL, 0, &g, &err), STRATA_EINVAL);
    assert_int_equal(metrics_counter_new(r, "lat_counts", "x", NULL, 0, &c, &err), STRATA_OK);
    assert_int_equal(metrics_gauge_new(r, "dur_sum", "x", NULL, 0, &g, &err), STRATA_OK);
    assert_int_equal(metrics_histogram_new(r, "dur", "x", NULL, 0, bounds, 2, &h, &err),
                     STRATA_EINVAL);
    /* Two histograms never clash with each other. */
    assert_int_equal(metrics_histogram_new(r, "lat_sum", "x", NULL, 0, bounds, 2, &h, &err),
                     STRATA_OK);

    /* A family helper that fails part way registers nothing. */
    char *before = render(r, NULL);
    static const char *const dup[] = {"a", "b", "a"};
    metrics_gauge *gs[3];
    assert_int_equal(metrics_gauge_family(r, "fresh", "x", "k", dup, 3, gs, &err), STRATA_EINVAL);
    assert_null(gs[0]);
    assert_null(gs[1]);
    static const char *const more[] = {"device", "nvme"};  /* device already exists in fam */
    assert_int_equal(metrics_gauge_family(r, "fam", "help", "tier", more, 2, gs, &err),
                     STRATA_EINVAL);
    assert_int_equal(metrics_gauge_family(r, "fam2", "x", "__k", more, 2, gs, &err),
                     STRATA_EINVAL);
    assert_int_equal(metrics_gauge_family(r, "fam3", "x", "k", more, 0, gs, &err), STRATA_EINVAL);
    char *after = render(r, NULL);
    assert_string_equal(before, after);
    free(before);
    free(after);
    metrics_destroy(r);
}

/* ---- threads ---- */

typedef struct worker_arg {
    metrics_counter *c;
    metrics_gauge *g;
    metrics_histogram *h;
    int iters;
} worker_arg;

static void *worker(void *p)
{
    worker_arg *a = p;
    for (int i = 0; i < a->iters; i++) {
        metrics_counter_inc(a->c);
        metrics_gauge_add(a->g, 1.0);
        metrics_histogram_observe(a->h, (i % 4) * 0.5);  /* 0, 0.5, 1, 1.5 */
    }
    return NULL;
}

typedef struct renderer_arg {
    metrics_registry *r;
    _Atomic int stop;
    int renders;
} renderer_arg;

static void *renderer(void *p)
{
    renderer_arg *a = p;
    while (!a->stop) {
        char *txt = NULL;
        if (metrics_render(a->r, &txt, NULL, NULL) != STRATA_OK)
            return (void *)1;
        /* Every snapshot of the histogram is consistent: +Inf bucket == count. */
        const char *inf = strstr(txt, "h_bucket{le=\"+Inf\"} ");
        const char *cnt = strstr(txt, "h_count ");
        if (!inf || !cnt ||
            strtoull(inf + strlen("h_bucket{le=\"+Inf\"} "), NULL, 10) !=
                strtoull(cnt + strlen("h_count "), NULL, 10)) {
            free(txt);
            return (void *)1;
        }
        free(txt);
        a->renders++;
    }
    return NULL;
}

static void test_concurrent_updates(void **state)
{
    (void)state;
    metrics_registry *r = metrics_create();
    strata_error err = {0};
    worker_arg wa = {.iters = 100000};
    const double b[] = {0, 1};
    assert_int_equal(metrics_counter_new(r, "c_total", "x", NULL, 0, &wa.c, &err), STRATA_OK);
    assert_int_equal(metrics_gauge_new(r, "g", "x", NULL, 0, &wa.g, &err), STRATA_OK);
    assert_int_equal(metrics_histogram_new(r, "h", "x", NULL, 0, b, 2, &wa.h, &err), STRATA_OK);
    renderer_arg ra = {.r = r};
    pthread_t t[4], rt;
    assert_int_equal(pthread_create(&rt, NULL, renderer, &ra), 0);
    for (int i = 0; i < 4; i++)
        assert_int_equal(pthread_create(&t[i], NULL, worker, &wa), 0);
    /* Registration while others update and render. */
    for (int i = 0; i < 50; i++) {
        char name[32];
        snprintf(name, sizeof name, "late_%d", i);
        metrics_gauge *g;
        assert_int_equal(metrics_gauge_new(r, name, "x", NULL, 0, &g, &err), STRATA_OK);
    }
    for (int i = 0; i < 4; i++)
        assert_int_equal(pthread_join(t[i], NULL), 0);
    ra.stop = 1;
    void *rres;
    assert_int_equal(pthread_join(rt, &rres), 0);
    assert_null(rres);
    assert_int_equal(metrics_counter_value(wa.c), 400000);
    assert_true(metrics_gauge_value(wa.g) == 400000.0);
    uint64_t cum[3], count;
    double sum;
    metrics_histogram_read(wa.h, cum, &sum, &count);
    assert_int_equal(cum[0], 100000);  /* 0 */
    assert_int_equal(cum[1], 300000);  /* 0.5, 1 */
    assert_int_equal(cum[2], 400000);
    assert_int_equal(count, 400000);
    assert_true(sum == 100000 * (0 + 0.5 + 1 + 1.5));
    metrics_destroy(r);
}

typedef struct collect_state {
    metrics_gauge *depth;
    int calls;
} collect_state;

static void collect(metrics_registry *r, void *user)
{
    collect_state *cs = user;
    cs->calls++;
    metrics_gauge_set(cs->depth, cs->calls * 10);
    if (cs->calls == 1) {  /* registering from the hook must not deadlock */
        metrics_counter *c;
        metrics_counter_new(r, "from_hook_total", "x", NULL, 0, &c, NULL);
    }
}

static void test_collect_hook(void **state)
{
    (void)state;
    metrics_registry *r = metrics_create();
    strata_error err = {0};
    collect_state cs = {0};
    assert_int_equal(metrics_gauge_new(r, "strata_queue_depth", "Queued.", NULL, 0, &cs.depth,
                                       &err),
                     STRATA_OK);
    metrics_set_collect(r, collect, &cs);
    char *txt = render(r, NULL);
    assert_string_equal(txt, "# HELP strata_queue_depth Queued.\n# TYPE strata_queue_depth gauge\n"
                             "strata_queue_depth 10\n# HELP from_hook_total x\n"
                             "# TYPE from_hook_total counter\nfrom_hook_total 0\n");
    free(txt);
    txt = render(r, NULL);
    assert_non_null(strstr(txt, "strata_queue_depth 20\n"));
    free(txt);
    metrics_set_collect(r, NULL, NULL);
    txt = render(r, NULL);
    assert_non_null(strstr(txt, "strata_queue_depth 20\n"));
    assert_int_equal(cs.calls, 2);
    free(txt);
    metrics_destroy(r);
}

/* ---- HTTP ---- */

/* rcvbuf > 0 shrinks the receive buffer before connecting (the window is fixed at the
 * handshake), so a large response cannot be absorbed by socket buffers. */
static int connect_buf(int family, uint16_t port, int rcvbuf)
{
    int fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(fd >= 0);
    if (rcvbuf > 0)
        assert_int_equal(setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf), 0);
    /* Never let a test hang on a broken server. */
    struct timeval tv = {.tv_sec = 10};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    int rc;
    if (family == AF_INET) {
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        rc = connect(fd, (struct sockaddr *)&a, sizeof a);
    } else {
        struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_port = htons(port)};
        a.sin6_addr = in6addr_loopback;
        rc = connect(fd, (struct sockaddr *)&a, sizeof a);
    }
    assert_int_equal(rc, 0);
    return fd;
}

static int connect_to(int family, uint16_t port) { return connect_buf(family, port, 0); }

static void send_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        assert_true(w > 0);
        p += w;
        n -= (size_t)w;
    }
}

/* Reads until EOF; returns a malloc'd NUL-terminated buffer. */
static char *read_all(int fd, size_t *len)
{
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    assert_non_null(buf);
    for (;;) {
        if (n + 1 == cap) {
            cap *= 2;
            buf = realloc(buf, cap);
            assert_non_null(buf);
        }
        ssize_t r = recv(fd, buf + n, cap - n - 1, 0);
        if (r < 0 && errno == EINTR)
            continue;
        assert_true(r >= 0);  /* a timeout here means the server never closed */
        if (r == 0)
            break;
        n += (size_t)r;
    }
    buf[n] = '\0';
    *len = n;
    return buf;
}

typedef struct response {
    int status;
    char *raw;      /* whole response */
    char *headers;  /* points into raw: from the status line to the blank line */
    char *body;     /* points into raw */
    size_t body_len;
} response;

/* Header value (case-insensitive name), copied into out; false if absent. */
static bool header(const response *resp, const char *name, char *out, size_t cap)
{
    size_t nl = strlen(name);
    for (const char *l = strstr(resp->headers, "\r\n"); l && l[2] != '\r'; l = strstr(l + 2, "\r\n")) {
        const char *h = l + 2;
        if (!strncasecmp(h, name, nl) && h[nl] == ':') {
            const char *v = h + nl + 1;
            while (*v == ' ')
                v++;
            const char *e = strstr(v, "\r\n");
            size_t vn = (size_t)(e - v);
            if (vn >= cap)
                vn = cap - 1;
            memcpy(out, v, vn);
            out[vn] = '\0';
            return true;
        }
    }
    return false;
}

/* Sends raw bytes as a request on a fresh connection and parses the whole response. */
static response http_raw(int family, uint16_t port, const char *req, size_t reqlen)
{
    int fd = connect_to(family, port);
    send_all(fd, req, reqlen);
    response resp = {0};
    size_t n;
    resp.raw = read_all(fd, &n);
    close(fd);
    assert_true(n > 12);
    assert_memory_equal(resp.raw, "HTTP/1.1 ", 9);
    resp.status = atoi(resp.raw + 9);
    char *end = strstr(resp.raw, "\r\n\r\n");
    assert_non_null(end);
    end[2] = '\0';  /* headers end with their last CRLF */
    resp.headers = resp.raw;
    resp.body = end + 4;
    resp.body_len = n - (size_t)(resp.body - resp.raw);
    char cl[32];
    assert_true(header(&resp, "Content-Length", cl, sizeof cl));
    if (strncmp(req, "HEAD ", 5))
        assert_int_equal(strtoull(cl, NULL, 10), resp.body_len);
    char conn[32];
    assert_true(header(&resp, "Connection", conn, sizeof conn));
    assert_string_equal(conn, "close");
    return resp;
}

static response http_req(uint16_t port, const char *req)
{
    return http_raw(AF_INET, port, req, strlen(req));
}

static metrics_registry *sample_registry(void)
{
    metrics_registry *r = metrics_create();
    assert_non_null(r);
    strata_error err = {0};
    metrics_counter *c;
    metrics_gauge *g[3];
    metrics_histogram *h;
    assert_int_equal(metrics_counter_new(r, "strata_requests_total", "Requests.", NULL, 0, &c,
                                         &err),
                     STRATA_OK);
    metrics_counter_add(c, 7);
    static const char *const tiers[] = {"device", "host", "nvme"};
    assert_int_equal(metrics_gauge_family(r, "strata_kv_blocks", "KV blocks.", "tier", tiers, 3,
                                          g, &err),
                     STRATA_OK);
    metrics_gauge_set(g[2], 12);
    double b[METRICS_LATENCY_BUCKETS];
    metrics_latency_buckets(b);
    assert_int_equal(metrics_histogram_new(r, "strata_ttft_seconds", "TTFT.", NULL, 0, b,
                                           METRICS_LATENCY_BUCKETS, &h, &err),
                     STRATA_OK);
    metrics_histogram_observe(h, 0.2);
    return r;
}

static void test_http_routes(void **state)
{
    (void)state;
    metrics_registry *r = sample_registry();
    strata_error err = {0};
    metrics_http *srv = NULL;
    assert_int_equal(metrics_http_start(r, "127.0.0.1:0", &srv, &err), STRATA_OK);
    uint16_t port = metrics_http_port(srv);
    assert_true(port != 0);

    size_t want_len;
    char *want = render(r, &want_len);
    char v[128];

    response resp = http_req(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_int_equal(resp.status, 200);
    assert_true(header(&resp, "Content-Type", v, sizeof v));
    assert_string_equal(v, "text/plain; version=0.0.4; charset=utf-8");
    assert_int_equal(resp.body_len, want_len);
    assert_memory_equal(resp.body, want, want_len);
    free(resp.raw);

    /* Typical Prometheus request, with a query string and bare-LF lines from a lax client. */
    resp = http_req(port, "GET /metrics?x=1 HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: "
                          "Prometheus/2.51\r\nAccept: text/plain;version=0.0.4\r\n"
                          "Accept-Encoding: gzip\r\nX-Prometheus-Scrape-Timeout-Seconds: 10\r\n\r\n");
    assert_int_equal(resp.status, 200);
    assert_string_equal(resp.body, want);
    free(resp.raw);
    resp = http_req(port, "GET /metrics HTTP/1.0\n\n");  /* 1.0 needs no Host */
    assert_int_equal(resp.status, 200);
    assert_string_equal(resp.body, want);
    free(resp.raw);
    resp = http_req(port, "GET http://127.0.0.1/metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    assert_int_equal(resp.status, 200);
    free(resp.raw);

    resp = http_req(port, "HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_int_equal(resp.status, 200);
    assert_int_equal(resp.body_len, 0);
    assert_true(header(&resp, "Content-Length", v, sizeof v));
    assert_int_equal(strtoull(v, NULL, 10), want_len);
    free(resp.raw);

    resp = http_req(port, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_int_equal(resp.status, 200);
    assert_string_equal(resp.body, "ok");
    free(resp.raw);

    resp = http_req(port, "GET /nope HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_int_equal(resp.status, 404);
    free(resp.raw);
    resp = http_req(port, "GET /metricsx HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_int_equal(resp.status, 404);
    free(resp.raw);

    resp = http_req(port, "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello");
    assert_int_equal(resp.status, 405);
    assert_true(header(&resp, "Allow", v, sizeof v));
    assert_string_equal(v, "GET, HEAD");
    free(resp.raw);
    resp = http_req(port, "DELETE /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_int_equal(resp.status, 405);
    free(resp.raw);

    free(want);
    metrics_http_stop(srv);
    metrics_destroy(r);
}

static void test_http_malformed(void **state)
{
    (void)state;
    metrics_registry *r = sample_registry();
    strata_error err = {0};
    metrics_http *srv = NULL;
    assert_int_equal(metrics_http_start(r, "127.0.0.1:0", &srv, &err), STRATA_OK);
    uint16_t port = metrics_http_port(srv);
    const char *bad[] = {
        "GARBAGE\r\n\r\n",
        "GET\r\n\r\n",
        "GET /metrics\r\n\r\n",
        "GET  /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
        "GET /metrics HTTP/1.1 \r\nHost: x\r\n\r\n",
        "GET /metrics HTTX/1.1\r\nHost: x\r\n\r\n",
        "GET /metrics HTTP/1.1\r\n\r\n",                         /* 1.1 without Host */
        "GET /metrics HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",   /* two Hosts */
        "GET /metrics HTTP/1.1\r\nHost: x\r\nNoColon\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nHost: x\r\nBad Name: v\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nHost : x\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nHost: x\r\nA: b\r\n folded\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nHost: x\r\nA: b\rc\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nHost: x\r\nA: \x01\r\n\r\n",
        "GET /met\x7frics HTTP/1.1\r\nHost: x\r\n\r\n",
        "\r\n\r\n",
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        response resp = http_req(port, bad[i]);
        if (resp.status != 400)
            fail_msg("request %zu: status %d, want 400", i, resp.status);
        free(resp.raw);
    }
    /* A NUL byte in the head. */
    static const char nul[] = "GET /metrics HTTP/1.1\r\nHost: x\0y\r\n\r\n";
    response resp = http_raw(AF_INET, port, nul, sizeof nul - 1);
    assert_int_equal(resp.status, 400);
    free(resp.raw);
    /* A well-formed but unsupported version. */
    resp = http_req(port, "GET /metrics HTTP/2.0\r\nHost: x\r\n\r\n");
    assert_int_equal(resp.status, 505);
    free(resp.raw);

    /* An oversized head (16 KiB of headers) gets 431, and the server keeps serving. */
    size_t big = 16 * 1024;
    char *req = malloc(big + 64);
    assert_non_null(req);
    int off = snprintf(req, 64, "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: ");
    memset(req + off, 'a', big);
    memcpy(req + off + big, "\r\n\r\n", 4);
    resp = http_raw(AF_INET, port, req, (size_t)off + big + 4);
    assert_int_equal(resp.status, 431);
    free(resp.raw);
    free(req);
    resp = http_req(port, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_int_equal(resp.status, 200);
    free(resp.raw);

    metrics_http_stop(srv);
    metrics_destroy(r);
}

static void test_http_slow_clients(void **state)
{
    (void)state;
    metrics_registry *r = sample_registry();
    strata_error err = {0};
    metrics_http *srv = NULL;
    const metrics_http_options opts = {.timeout_ms = 300};
    assert_int_equal(metrics_http_start_opts(r, "127.0.0.1:0", &opts, &srv, &err), STRATA_OK);
    uint16_t port = metrics_http_port(srv);

    /* A client that connects and sends nothing does not delay anyone else; at its deadline
     * it is just closed, with no answer. */
    int silent = connect_to(AF_INET, port);
    usleep(20 * 1000);  /* let the server accept it first */
    int64_t t0 = now_ms();
    response resp = http_req(port, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_int_equal(resp.status, 200);
    free(resp.raw);
    assert_true(now_ms() - t0 < 200);
    size_t n;
    char *got = read_all(silent, &n);
    assert_int_equal(n, 0);
    assert_true(now_ms() - t0 >= 200);  /* closed at its own deadline, not before */
    free(got);
    close(silent);

    /* A client that sends part of a head and stalls gets 408. */
    int slow = connect_to(AF_INET, port);
    send_all(slow, "GET /metrics HTTP/1.1\r\n", 23);
    got = read_all(slow, &n);
    assert_true(n > 12);
    assert_memory_equal(got, "HTTP/1.1 408 ", 13);
    free(got);
    close(slow);

    /* A client that closes mid-head gets 400 on its way out; the server does not mind. */
    int half = connect_to(AF_INET, port);
    send_all(half, "GET /metr", 9);
    shutdown(half, SHUT_WR);
    got = read_all(half, &n);
    assert_memory_equal(got, "HTTP/1.1 400 ", 13);
    free(got);
    close(half);

    resp = http_req(port, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_int_equal(resp.status, 200);
    free(resp.raw);
    metrics_http_stop(srv);
    metrics_destroy(r);
}

/* Prometheus scrapes every few seconds with a 10 s timeout: idle connections (any number of
 * them), clients stalled mid-head and a client that does not read its (large) response must not
 * delay a scrape; only a table full of connections mid-request makes newcomers wait for a slot. */
static void test_http_concurrent_clients(void **state)
{
    (void)state;
    metrics_registry *r = sample_registry();
    strata_error err = {0};
    metrics_http *srv = NULL;
    assert_int_equal(metrics_http_start(r, "127.0.0.1:0", &srv, &err), STRATA_OK);  /* 5 s */
    uint16_t port = metrics_http_port(srv);

    enum { IDLE = 8 };
    int idle[IDLE];
    for (int i = 0; i < IDLE; i++) {
        idle[i] = connect_to(AF_INET, port);
        if (i % 2)
            send_all(idle[i], "GET /metrics HTTP/1.1\r\nHo", 25);
    }
    usleep(50 * 1000);
    for (int k = 0; k < 5; k++) {
        int64_t t0 = now_ms();
        response resp = http_req(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_int_equal(resp.status, 200);
        assert_non_null(strstr(resp.body, "strata_requests_total 7\n"));
        free(resp.raw);
        assert_true(now_ms() - t0 < 1000);
    }
    /* Those stalled mid-head still finish their requests. */
    for (int i = 1; i < IDLE; i += 2) {
        send_all(idle[i], "st: x\r\n\r\n", 9);
        size_t n;
        char *got = read_all(idle[i], &n);
        assert_memory_equal(got, "HTTP/1.1 200 ", 13);
        assert_non_null(strstr(got, "strata_requests_total 7\n"));
        free(got);
    }
    for (int i = 0; i < IDLE; i++)
        close(idle[i]);
    metrics_http_stop(srv);

    /* A table full of silent connections, three times over (an attacker reopening them as they
     * close): a scrape is answered at once, the oldest silent connection giving up its slot.
     * A table full of connections mid-request makes a newcomer wait until one times out. */
    const metrics_http_options opts = {.timeout_ms = 2500};
    assert_int_equal(metrics_http_start_opts(r, "127.0.0.1:0", &opts, &srv, &err), STRATA_OK);
    port = metrics_http_port(srv);
    enum { SILENT = 3 * METRICS_HTTP_MAX_CONNS };
    int many[SILENT];
    for (int i = 0; i < SILENT; i++)
        many[i] = connect_to(AF_INET, port);
    usleep(100 * 1000);
    int64_t t0 = now_ms();
    response resp = http_req(port, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_int_equal(resp.status, 200);
    free(resp.raw);
    assert_true(now_ms() - t0 < 1000);
    for (int i = 0; i < SILENT; i++)
        close(many[i]);
    metrics_http_stop(srv);

    assert_int_equal(metrics_http_start_opts(r, "127.0.0.1:0", &opts, &srv, &err), STRATA_OK);
    port = metrics_http_port(srv);
    int64_t fill0 = now_ms();
    for (int i = 0; i < METRICS_HTTP_MAX_CONNS; i++) {
        many[i] = connect_to(AF_INET, port);
        send_all(many[i], "GET /metrics HTTP/1.1\r\nHo", 25);   /* a request begun, never ended */
    }
    usleep(100 * 1000);
    int64_t filled = now_ms() - fill0;
    t0 = now_ms();
    resp = http_req(port, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
    int64_t waited = now_ms() - t0;
    assert_int_equal(resp.status, 200);
    free(resp.raw);
    if (filled < 1500)  /* otherwise the machine was too slow to tell */
        assert_true(waited >= 2500 - filled - 200);
    assert_true(waited < 5000);
    for (int i = 0; i < METRICS_HTTP_MAX_CONNS; i++)
        close(many[i]);
    metrics_http_stop(srv);
    metrics_destroy(r);
}

static void test_http_client_hangs_up(void **state)
{
    (void)state;
    /* A big exposition (10 MB, more than the kernel's largest TCP send buffer, 4 MiB by
     * default) so the server is still sending when the client hangs up without reading: its
     * send then fails with EPIPE or ECONNRESET, which with MSG_NOSIGNAL is an error return, not
     * a SIGPIPE that would kill this test process. */
    metrics_registry *r = metrics_create();
    strata_error err = {0};
    char *v = malloc(2048);
    assert_non_null(v);
    for (int i = 0; i < 5000; i++) {
        int k = snprintf(v, 2048, "%d-", i);
        memset(v + k, 'w', 2000);
        v[k + 2000] = '\0';
        const metrics_label l = {"worker", v};
        metrics_gauge *g;
        assert_int_equal(metrics_gauge_new(r, "strata_worker_info", "Workers.", &l, 1, &g, &err),
                         STRATA_OK);
    }
    free(v);
    size_t total;
    free(render(r, &total));
    assert_true(total > 10000000);
    metrics_http *srv = NULL;
    assert_int_equal(metrics_http_start(r, "127.0.0.1:0", &srv, &err), STRATA_OK);
    uint16_t port = metrics_http_port(srv);
    for (int k = 0; k < 3; k++) {
        /* A tiny receive window and an abortive close (RST) make the server's send fail. */
        int fd = connect_buf(AF_INET, port, 1024);
        send_all(fd, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 35);
        char tmp[100];
        assert_true(recv(fd, tmp, sizeof tmp, 0) > 0);  /* the response has started */
        struct linger lg = {.l_onoff = 1, .l_linger = 0};
        setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
        close(fd);
    }
    /* Still alive and serving the whole thing, while another client sits on its response
     * without reading it. */
    int stuck = connect_buf(AF_INET, port, 1024);
    send_all(stuck, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 35);
    char tmp[100];
    assert_true(recv(stuck, tmp, sizeof tmp, 0) > 0);
    int64_t t0 = now_ms();
    response resp = http_req(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_int_equal(resp.status, 200);
    assert_int_equal(resp.body_len, total);
    free(resp.raw);
    assert_true(now_ms() - t0 < 4000);  /* not after the stuck one's 5 s write deadline */
    close(stuck);
    metrics_http_stop(srv);
    metrics_destroy(r);
}

static void test_http_addresses(void **state)
{
    (void)state;
    metrics_registry *r = sample_registry();
    strata_error err = {0};
    metrics_http *srv = NULL, *srv2 = (metrics_http *)&err;
    const char *bad[] = {"", "127.0.0.1", "127.0.0.1:", "127.0.0.1:70000", "127.0.0.1:-1",
                         "127.0.0.1:80x", "127.0.0.1:123456", "::1:80", "[::1]80", "[::1]",
                         "[]:80", "[nope]:80", "example.com:80", ":9400", "1.2.3:80",
                         "256.1.1.1:80"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        err = (strata_error){0};
        int rc = metrics_http_start(r, bad[i], &srv2, &err);
        if (rc != STRATA_EINVAL)
            fail_msg("address '%s': rc %d, want EINVAL", bad[i], rc);
        assert_null(srv2);
        assert_true(err.msg[0] != '\0');
    }
    assert_int_equal(metrics_http_start(r, NULL, &srv2, &err), STRATA_EINVAL);
    const metrics_http_options badopt = {.timeout_ms = -1};
    assert_int_equal(metrics_http_start_opts(r, "127.0.0.1:0", &badopt, &srv2, &err),
                     STRATA_EINVAL);

    /* The same port twice: a clear "in use" error. */
    assert_int_equal(metrics_http_start(r, "localhost:0", &srv, &err), STRATA_OK);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%u", metrics_http_port(srv));
    err = (strata_error){0};
    assert_int_equal(metrics_http_start(r, addr, &srv2, &err), STRATA_EIO);
    assert_non_null(strstr(err.msg, "in use"));
    /* Not an address of this host. */
    err = (strata_error){0};
    assert_int_equal(metrics_http_start(r, "192.0.2.1:0", &srv2, &err), STRATA_EIO);
    assert_non_null(strstr(err.msg, "not an address of this host"));
    metrics_http_stop(srv);
    metrics_http_stop(NULL);

    /* IPv6 loopback, when this machine has it. */
    err = (strata_error){0};
    int rc = metrics_http_start(r, "[::1]:0", &srv, &err);
    if (rc == STRATA_OK) {
        response resp = http_raw(AF_INET6, metrics_http_port(srv),
                                 "GET /healthz HTTP/1.1\r\nHost: [::1]\r\n\r\n", 38);
        assert_int_equal(resp.status, 200);
        assert_string_equal(resp.body, "ok");
        free(resp.raw);
        metrics_http_stop(srv);
    } else {
        print_message("IPv6 loopback unavailable, skipped: %s\n", err.msg);
        assert_int_equal(rc, STRATA_EIO);
    }
    metrics_destroy(r);
}

static void test_http_stop_is_prompt(void **state)
{
    (void)state;
    metrics_registry *r = sample_registry();
    strata_error err = {0};
    metrics_http *srv = NULL;
    /* Idle. */
    assert_int_equal(metrics_http_start(r, "127.0.0.1:0", &srv, &err), STRATA_OK);
    usleep(20 * 1000);
    int64_t t0 = now_ms();
    metrics_http_stop(srv);
    assert_true(now_ms() - t0 < 500);

    /* In the middle of waiting on a silent client, with the default 5 s timeout. */
    assert_int_equal(metrics_http_start(r, "127.0.0.1:0", &srv, &err), STRATA_OK);
    int fd = connect_to(AF_INET, metrics_http_port(srv));
    send_all(fd, "GET /met", 8);
    usleep(50 * 1000);
    t0 = now_ms();
    metrics_http_stop(srv);
    assert_true(now_ms() - t0 < 500);
    close(fd);
    metrics_destroy(r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_counter_gauge_values),
        cmocka_unit_test(test_render_full_text),
        cmocka_unit_test(test_histogram_edges),
        cmocka_unit_test(test_buckets),
        cmocka_unit_test(test_invalid_names_and_families),
        cmocka_unit_test(test_concurrent_updates),
        cmocka_unit_test(test_collect_hook),
        cmocka_unit_test(test_http_routes),
        cmocka_unit_test(test_http_malformed),
        cmocka_unit_test(test_http_slow_clients),
        cmocka_unit_test(test_http_concurrent_clients),
        cmocka_unit_test(test_http_client_hangs_up),
        cmocka_unit_test(test_http_addresses),
        cmocka_unit_test(test_http_stop_is_prompt),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
