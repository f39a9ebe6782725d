/* Prometheus metrics for the coordinator: a registry of counters, gauges and histograms rendered
 * in the text exposition format, version 0.0.4 (what Prometheus scrapes from /metrics; see
 * coordinator/metrics/http.h for the server and coordinator/metrics/README.md for the names we
 * use).
 *
 * Model. A registry holds families; a family has a metric name, a help text, a type and the
 * names of its labels; each family holds one or more series, each with its own constant label
 * values (e.g. the family strata_kv_blocks with label tier, series tier="device", "host",
 * "nvme"). Registering a series whose family does not exist yet creates the family; a later
 * series of the same name must agree on type, help, label names (same names, same order) and,
 * for histograms, buckets. Series are never removed; handles stay valid until
 * metrics_destroy.
 *
 * Names. Metric names must match [a-zA-Z_:][a-zA-Z0-9_:]*, label names [a-zA-Z_][a-zA-Z0-9_]*
 * and must not start with "__" (reserved by Prometheus); a histogram may not have a label "le".
 * A histogram named X also owns X_bucket, X_sum and X_count: registering a family that would
 * produce a clashing sample name is refused. Label values and help texts are any valid UTF-8;
 * they are escaped when rendered (label values: backslash, double quote, newline; help:
 * backslash, newline).
 *
 * Threads. Updates (counter_add, gauge_set/add, histogram_observe) may come from any number of
 * threads at once and never block on rendering or registration: counters and gauges are C11
 * atomics, a histogram has its own mutex so that its buckets, sum and count are rendered as one
 * consistent snapshot. Registration and rendering may also happen from any thread (a registry
 * mutex protects the family list). Nothing here is global: two registries are independent.
 *
 * Errors: functions return STRATA_OK or STRATA_EINVAL / STRATA_ENOMEM with a message in the
 * optional err (kvstore/error.h). Update functions cannot fail. */
#ifndef STRATA_COORDINATOR_METRICS_H
#define STRATA_COORDINATOR_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "kvstore/error.h"

typedef struct metrics_registry metrics_registry;
typedef struct metrics_counter metrics_counter;
typedef struct metrics_gauge metrics_gauge;
typedef struct metrics_histogram metrics_histogram;

/* One constant label of a series. Both strings are copied at registration. */
typedef struct metrics_label {
    const char *name;
    const char *value;
} metrics_label;

/* Most labels one series may carry; our families use one or two. */
#define METRICS_MAX_LABELS 8
/* Most bucket bounds one histogram may have (not counting the implicit +Inf). */
#define METRICS_MAX_BUCKETS 64
/* Number of bounds metrics_latency_buckets() writes. */
#define METRICS_LATENCY_BUCKETS 17

/* An empty registry, or NULL when out of memory. */
metrics_registry *metrics_create(void);
/* Frees the registry and every series in it; all handles become invalid. NULL is ignored. The
 * caller must have stopped anything still updating or rendering (e.g. metrics_http_stop). */
void metrics_destroy(metrics_registry *r);

/* Registers a series and returns its handle in *out. help may be NULL (no HELP line); labels
 * may be NULL when nlabels is 0. STRATA_EINVAL for a bad name, label, help text, a series with
 * the same label values already present, or a mismatch with the existing family. */
int metrics_counter_new(metrics_registry *r, const char *name, const char *help,
                        const metrics_label *labels, size_t nlabels, metrics_counter **out,
                        strata_error *err);
int metrics_gauge_new(metrics_registry *r, const char *name, const char *help,
                      const metrics_label *labels, size_t nlabels, metrics_gauge **out,
                      strata_error *err);
/* bounds: nbounds strictly increasing finite upper bounds (a trailing +Inf is accepted and
 * dropped: the +Inf bucket always exists). nbounds may be 0 (only +Inf). Copied. */
int metrics_histogram_new(metrics_registry *r, const char *name, const char *help,
                          const metrics_label *labels, size_t nlabels, const double *bounds,
                          size_t nbounds, metrics_histogram **out, strata_error *err);

/* A labelled family over one label: registers one series per value, in order, out[i] for
 * values[i] (e.g. label "tier", values {"device", "host", "nvme"}). On failure nothing is
 * registered. */
int metrics_counter_family(metrics_registry *r, const char *name, const char *help,
                           const char *label, const char *const *values, size_t nvalues,
                           metrics_counter **out, strata_error *err);
int metrics_gauge_family(metrics_registry *r, const char *name, const char *help,
                         const char *label, const char *const *values, size_t nvalues,
                         metrics_gauge **out, strata_error *err);

/* Counters: monotonic uint64 (wraps only after 2^64 increments). */
void metrics_counter_inc(metrics_counter *c);
void metrics_counter_add(metrics_counter *c, uint64_t n);
uint64_t metrics_counter_value(const metrics_counter *c);

/* Gauges: a double that can go up and down. NaN and infinities are stored and rendered as
 * NaN, +Inf, -Inf. */
void metrics_gauge_set(metrics_gauge *g, double v);
void metrics_gauge_add(metrics_gauge *g, double delta);
double metrics_gauge_value(const metrics_gauge *g);

/* Histograms: v lands in the first bucket whose bound is >= v (a value equal to a bound is in
 * that bucket, as Prometheus' "le" says), else in +Inf; sum and count grow. A NaN observation
 * is dropped: it would turn _sum into NaN for the life of the process. */
void metrics_histogram_observe(metrics_histogram *h, double v);
/* A consistent snapshot. cumulative (may be NULL) gets nbounds + 1 cumulative counts, the last
 * being the +Inf bucket (== *count). sum and count may be NULL. Returns nbounds. */
size_t metrics_histogram_read(metrics_histogram *h, uint64_t *cumulative, double *sum,
                              uint64_t *count);

/* Writes n bounds start, start*factor, start*factor^2, ... into out. STRATA_EINVAL unless
 * start > 0, factor > 1, 1 <= n <= METRICS_MAX_BUCKETS and every bound is finite. */
int metrics_buckets_exponential(double start, double factor, size_t n, double *out,
                                strata_error *err);
/* The standard latency buckets in seconds: 1 ms doubling up to 65.536 s
 * (METRICS_LATENCY_BUCKETS bounds), for TTFT, inter-token latency and request duration. */
void metrics_latency_buckets(double out[METRICS_LATENCY_BUCKETS]);

/* A hook run at the start of every metrics_render, so the owner can refresh gauges that mirror
 * state it owns (queue depth, KV blocks per tier) right before a scrape instead of on every
 * change. It runs on the rendering thread (the HTTP server's, for scrapes), one call at a time;
 * it may update and register metrics but must not call metrics_render or metrics_set_collect
 * (deadlock). fn NULL removes the hook. metrics_set_collect waits for a render in progress, so
 * when it returns the previous hook is not running and will not run again (its user data may
 * be freed). */
typedef void (*metrics_collect_fn)(metrics_registry *r, void *user);
void metrics_set_collect(metrics_registry *r, metrics_collect_fn fn, void *user);

/* Renders every family, in registration order, in the text exposition format 0.0.4: per
 * family "# HELP" (when it has help) and "# TYPE" lines, then its samples (histograms: the
 * cumulative _bucket series with le ending in "+Inf", then _sum and _count). *out is a
 * malloc'd, NUL-terminated buffer of *len bytes (not counting the NUL) that the caller frees;
 * an empty registry renders as "". STRATA_ENOMEM when the buffer cannot be allocated. */
int metrics_render(metrics_registry *r, char **out, size_t *len, strata_error *err);

/* Content-Type of metrics_render's output, for HTTP responses. */
#define METRICS_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

#endif
