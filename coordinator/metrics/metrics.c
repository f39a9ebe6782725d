/* Registry, series and text exposition (format 0.0.4) for coordinator/metrics/metrics.h. */
#include "coordinator/metrics/metrics.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum metric_type { MT_COUNTER, MT_GAUGE, MT_HISTOGRAM };

static const char *const type_names[] = {"counter", "gauge", "histogram"};

struct metrics_counter {
    _Atomic uint64_t v;
};

/* A double stored as its bit pattern: C11 has no atomic add for floating types, so add is a
 * compare-and-swap loop over the bits, and set/load are plain atomic stores/loads. */
struct metrics_gauge {
    _Atomic uint64_t bits;
};

struct metrics_histogram {
    pthread_mutex_t mu;  /* buckets, sum and count change together; render needs all three */
    size_t nbounds;
    double *bounds;      /* nbounds, strictly increasing */
    uint64_t *counts;    /* nbounds + 1, per bucket (not cumulative); the last is +Inf */
    double sum;
    uint64_t count;
};

typedef struct series {
    char *labels;  /* rendered and escaped: k1="v1",k2="v2"; "" without labels */
    void *metric;  /* metrics_counter / metrics_gauge / metrics_histogram per the family type */
} series;

typedef struct family {
    char *name;
    char *help;    /* NULL: no HELP line */
    enum metric_type type;
    size_t nlabels;
    char **label_names;
    size_t nbounds;  /* histograms: the bounds every series of the family shares */
    double *bounds;
    char **le;       /* bounds rendered once, for the le label */
    series *series;
    size_t nseries, cap;
} family;

struct metrics_registry {
    /* mu guards the family list and the collect hook. render_mu serializes renders so the collect
     * hook runs one call at a time; it is taken first and the hook runs without mu, so the hook
     * may register metrics. Updates take neither. */
    pthread_mutex_t mu;
    pthread_mutex_t render_mu;
    family **fams;
    size_t nfams, cap;
    metrics_collect_fn collect;
    void *collect_user;
};

/* ---- validation ---- */

static bool valid_metric_name(const char *s)
{
    if (!s || !*s)
        return false;
    for (size_t i = 0; s[i]; i++) {
        char c = s[i];
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' ||
                  (i > 0 && c >= '0' && c <= '9');
        if (!ok)
            return false;
    }
    return true;
}

static bool valid_label_name(const char *s)
{
    if (!s || !*s)
        return false;
    for (size_t i = 0; s[i]; i++) {
        char c = s[i];
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
                  (i > 0 && c >= '0' && c <= '9');
        if (!ok)
            return false;
    }
    return true;
}

/* Prometheus rejects a whole scrape whose text is not UTF-8, so one bad label value would hide
 * every metric: refuse it at registration instead. Rejects overlong forms, surrogates and code
 * points above U+10FFFF. */
static bool valid_utf8(const char *str)
{
    const unsigned char *s = (const unsigned char *)str;
    while (*s) {
        unsigned c = *s;
        size_t n;
        uint32_t cp, min;
        if (c < 0x80) {
            s++;
            continue;
        } else if ((c & 0xE0) == 0xC0) {
            n = 1, cp = c & 0x1F, min = 0x80;
        } else if ((c & 0xF0) == 0xE0) {
            n = 2, cp = c & 0x0F, min = 0x800;
        } else if ((c & 0xF8) == 0xF0) {
            n = 3, cp = c & 0x07, min = 0x10000;
        } else {
            return false;
        }
        for (size_t i = 1; i <= n; i++) {
            if ((s[i] & 0xC0) != 0x80)  /* also stops at the NUL */
                return false;
            cp = (cp << 6) | (s[i] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return false;
        s += n + 1;
    }
    return true;
}

/* ---- string building ---- */

typedef struct sbuf {
    char *p;
    size_t len, cap;
    bool oom;  /* sticky: later appends are no-ops and the caller reports ENOMEM once */
} sbuf;

static void sb_reserve(sbuf *b, size_t extra)
{
    if (b->oom)
        return;
    if (extra > SIZE_MAX - b->len - 1) {
        b->oom = true;
        return;
    }
    size_t need = b->len + extra + 1;
    if (need <= b->cap)
        return;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < need)
        cap = cap > SIZE_MAX / 2 ? need : cap * 2;
    char *p = realloc(b->p, cap);
    if (!p) {
        b->oom = true;
        return;
    }
    b->p = p;
    b->cap = cap;
}

/* Starts a buffer that is a valid empty string even if nothing is appended. */
static void sb_init(sbuf *b, size_t cap)
{
    *b = (sbuf){0};
    sb_reserve(b, cap);
    if (!b->oom)
        b->p[0] = '\0';
}

static void sb_putn(sbuf *b, const char *s, size_t n)
{
    sb_reserve(b, n);
    if (b->oom)
        return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void sb_puts(sbuf *b, const char *s) { sb_putn(b, s, strlen(s)); }

static void sb_putc(sbuf *b, char c) { sb_putn(b, &c, 1); }

static void sb_put_u64(sbuf *b, uint64_t v)
{
    char tmp[24];
    int n = snprintf(tmp, sizeof tmp, "%llu", (unsigned long long)v);
    sb_putn(b, tmp, (size_t)n);
}

/* Label values escape backslash, double quote and newline; help texts escape backslash and
 * newline only (format 0.0.4). */
static void sb_escaped(sbuf *b, const char *s, bool quote)
{
    for (; *s; s++) {
        if (*s == '\\')
            sb_putn(b, "\\\\", 2);
        else if (*s == '\n')
            sb_putn(b, "\\n", 2);
        else if (quote && *s == '"')
            sb_putn(b, "\\\"", 2);
        else
            sb_putc(b, *s);
    }
}

/* The shortest of %.15g/%.16g/%.17g that reads back as the same double, so bounds like 0.001
 * print as "0.001" rather than 0.0010000000000000000208, and every value still round-trips.
 * Go's ParseFloat (Prometheus) reads all of these forms, including "1e-05"; NaN and the
 * infinities use the spellings the format defines. */
static void format_double(double v, char out[32])
{
    if (isnan(v)) {
        strcpy(out, "NaN");
        return;
    }
    if (isinf(v)) {
        strcpy(out, v > 0 ? "+Inf" : "-Inf");
        return;
    }
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(out, 32, "%.*g", prec, v);
        if (strtod(out, NULL) == v)
            return;
    }
}

static void sb_put_double(sbuf *b, double v)
{
    char tmp[32];
    format_double(v, tmp);
    sb_puts(b, tmp);
}

/* ---- registry ---- */

metrics_registry *metrics_create(void)
{
    metrics_registry *r = calloc(1, sizeof *r);
    if (!r)
        return NULL;
    if (pthread_mutex_init(&r->mu, NULL) != 0) {
        free(r);
        return NULL;
    }
    if (pthread_mutex_init(&r->render_mu, NULL) != 0) {
        pthread_mutex_destroy(&r->mu);
        free(r);
        return NULL;
    }
    return r;
}

static void metric_free(enum metric_type type, void *m)
{
    if (!m)
        return;
    if (type == MT_HISTOGRAM) {
        metrics_histogram *h = m;
        pthread_mutex_destroy(&h->mu);
        free(h->bounds);
        free(h->counts);
    }
    free(m);
}

static void family_free(family *f)
{
    if (!f)
        return;
    for (size_t i = 0; i < f->nseries; i++) {
        free(f->series[i].labels);
        metric_free(f->type, f->series[i].metric);
    }
    free(f->series);
    for (size_t i = 0; i < f->nlabels; i++)
        free(f->label_names[i]);
    free(f->label_names);
    if (f->le)
        for (size_t i = 0; i < f->nbounds; i++)
            free(f->le[i]);
    free(f->le);
    free(f->bounds);
    free(f->name);
    free(f->help);
    free(f);
}

void metrics_destroy(metrics_registry *r)
{
    if (!r)
        return;
    for (size_t i = 0; i < r->nfams; i++)
        family_free(r->fams[i]);
    free(r->fams);
    pthread_mutex_destroy(&r->render_mu);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

void metrics_set_collect(metrics_registry *r, metrics_collect_fn fn, void *user)
{
    if (!r)
        return;
    /* Taking render_mu too waits out a render in progress, so once this returns the old hook
     * is not running and never will again: its owner may free `user`. */
    pthread_mutex_lock(&r->render_mu);
    pthread_mutex_lock(&r->mu);
    r->collect = fn;
    r->collect_user = user;
    pthread_mutex_unlock(&r->mu);
    pthread_mutex_unlock(&r->render_mu);
}

/* ---- registration ---- */

static const char *help_or_empty(const char *h) { return h ? h : ""; }

/* True when s is base_bucket, base_sum or base_count: the sample names a histogram owns. */
static bool is_histogram_sample(const char *base, const char *s)
{
    size_t n = strlen(base);
    if (strncmp(s, base, n) != 0)
        return false;
    s += n;
    return !strcmp(s, "_bucket") || !strcmp(s, "_sum") || !strcmp(s, "_count");
}

static int check_bounds(const char *name, const double *bounds, size_t *nbounds,
                        strata_error *err)
{
    size_t n = *nbounds;
    if (n && !bounds)
        return strata_fail(err, STRATA_EINVAL, "histogram '%s': bounds is NULL", name);
    /* A trailing +Inf is what some callers write out of habit; it is implicit here. */
    if (n && isinf(bounds[n - 1]) && bounds[n - 1] > 0)
        n--;
    if (n > METRICS_MAX_BUCKETS)
        return strata_fail(err, STRATA_EINVAL, "histogram '%s': %zu buckets, at most %d", name,
                           n, METRICS_MAX_BUCKETS);
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(bounds[i]))
            return strata_fail(err, STRATA_EINVAL,
                               "histogram '%s': bucket bound %zu is not finite", name, i);
        if (i && !(bounds[i] > bounds[i - 1]))
            return strata_fail(err, STRATA_EINVAL,
                               "histogram '%s': bucket bounds must be strictly increasing "
                               "(bound %zu = %g after %g)",
                               name, i, bounds[i], bounds[i - 1]);
    }
    *nbounds = n;
    return STRATA_OK;
}

/* Checks the labels of one series and renders them (escaped) into *out. */
static int render_labels(const char *name, enum metric_type type, const metrics_label *labels,
                         size_t nlabels, char **out, strata_error *err)
{
    if (nlabels > METRICS_MAX_LABELS)
        return strata_fail(err, STRATA_EINVAL, "metric '%s': %zu labels, at most %d", name,
                           nlabels, METRICS_MAX_LABELS);
    if (nlabels && !labels)
        return strata_fail(err, STRATA_EINVAL, "metric '%s': labels is NULL", name);
    for (size_t i = 0; i < nlabels; i++) {
        const char *ln = labels[i].name;
        if (!valid_label_name(ln))
            return strata_fail(err, STRATA_EINVAL,
                               "metric '%s': label name '%s' is invalid: must match "
                               "[a-zA-Z_][a-zA-Z0-9_]*",
                               name, ln ? ln : "(null)");
        if (!strncmp(ln, "__", 2))
            return strata_fail(err, STRATA_EINVAL,
                               "metric '%s': label name '%s' is reserved (starts with __)", name,
                               ln);
        if (type == MT_HISTOGRAM && !strcmp(ln, "le"))
            return strata_fail(err, STRATA_EINVAL,
                               "histogram '%s': label 'le' is reserved for buckets", name);
        for (size_t j = 0; j < i; j++)
            if (!strcmp(labels[j].name, ln))
                return strata_fail(err, STRATA_EINVAL, "metric '%s': label '%s' given twice",
                                   name, ln);
        if (!labels[i].value)
            return strata_fail(err, STRATA_EINVAL, "metric '%s': label '%s' has a NULL value",
                               name, ln);
        if (!valid_utf8(labels[i].value))
            return strata_fail(err, STRATA_EINVAL,
                               "metric '%s': value of label '%s' is not valid UTF-8", name, ln);
    }
    sbuf b;
    sb_init(&b, 0);  /* "" without labels is still an allocated string */
    for (size_t i = 0; i < nlabels; i++) {
        if (i)
            sb_putc(&b, ',');
        sb_puts(&b, labels[i].name);
        sb_putn(&b, "=\"", 2);
        sb_escaped(&b, labels[i].value, true);
        sb_putc(&b, '"');
    }
    if (b.oom || !b.p) {
        free(b.p);
        return strata_fail(err, STRATA_ENOMEM, "metric '%s': out of memory for labels", name);
    }
    *out = b.p;
    return STRATA_OK;
}

static void *metric_alloc(enum metric_type type, const double *bounds, size_t nbounds)
{
    if (type == MT_COUNTER) {
        metrics_counter *c = malloc(sizeof *c);
        if (c)
            atomic_init(&c->v, 0);
        return c;
    }
    if (type == MT_GAUGE) {
        metrics_gauge *g = malloc(sizeof *g);
        if (g)
            atomic_init(&g->bits, 0);  /* all-zero bits are +0.0 */
        return g;
    }
    metrics_histogram *h = calloc(1, sizeof *h);
    if (!h)
        return NULL;
    h->nbounds = nbounds;
    h->bounds = malloc((nbounds ? nbounds : 1) * sizeof *h->bounds);
    h->counts = calloc(nbounds + 1, sizeof *h->counts);
    if (!h->bounds || !h->counts || pthread_mutex_init(&h->mu, NULL) != 0) {
        free(h->bounds);
        free(h->counts);
        free(h);
        return NULL;
    }
    if (nbounds)
        memcpy(h->bounds, bounds, nbounds * sizeof *bounds);
    return h;
}

/* A new family with everything but its series; NULL when out of memory. */
static family *family_alloc(const char *name, const char *help, enum metric_type type,
                            const metrics_label *labels, size_t nlabels, const double *bounds,
                            size_t nbounds)
{
    family *f = calloc(1, sizeof *f);
    if (!f)
        return NULL;
    f->type = type;
    f->name = strdup(name);
    f->help = help ? strdup(help) : NULL;
    bool ok = f->name && (!help || f->help);
    if (ok && nlabels) {
        f->label_names = calloc(nlabels, sizeof *f->label_names);
        ok = f->label_names != NULL;
        for (size_t i = 0; ok && i < nlabels; i++) {
            f->label_names[i] = strdup(labels[i].name);
            ok = f->label_names[i] != NULL;
            f->nlabels = i + 1;  /* so family_free frees exactly what was made */
        }
    }
    if (ok && nbounds) {
        f->bounds = malloc(nbounds * sizeof *f->bounds);
        f->le = calloc(nbounds, sizeof *f->le);
        ok = f->bounds && f->le;
        if (ok)
            memcpy(f->bounds, bounds, nbounds * sizeof *bounds);
        f->nbounds = nbounds;
        for (size_t i = 0; ok && i < nbounds; i++) {
            char tmp[32];
            format_double(bounds[i], tmp);
            f->le[i] = strdup(tmp);
            ok = f->le[i] != NULL;
        }
    }
    if (!ok) {
        family_free(f);
        return NULL;
    }
    return f;
}

/* The family a new series of `name` joins must agree with it on everything but label values. */
static int check_same_family(const family *f, const char *help, enum metric_type type,
                             const metrics_label *labels, size_t nlabels, const double *bounds,
                             size_t nbounds, strata_error *err)
{
    if (f->type != type)
        return strata_fail(err, STRATA_EINVAL, "metric '%s' is already registered as a %s",
                           f->name, type_names[f->type]);
    if (strcmp(help_or_empty(f->help), help_or_empty(help)))
        return strata_fail(err, STRATA_EINVAL,
                           "metric '%s' is already registered with a different help text",
                           f->name);
    bool same = f->nlabels == nlabels;
    for (size_t i = 0; same && i < nlabels; i++)
        same = !strcmp(f->label_names[i], labels[i].name);
    if (!same)
        return strata_fail(err, STRATA_EINVAL,
                           "metric '%s' is already registered with different label names "
                           "(every series of a family has the same labels, in the same order)",
                           f->name);
    same = f->nbounds == nbounds;
    for (size_t i = 0; same && i < nbounds; i++)
        same = f->bounds[i] == bounds[i];
    if (!same)
        return strata_fail(err, STRATA_EINVAL,
                           "histogram '%s' is already registered with different buckets", f->name);
    return STRATA_OK;
}

/* Registers one series; the caller holds r->mu (so a family of several series can be added or
 * rolled back as one step). */
static int register_locked(metrics_registry *r, enum metric_type type, const char *name,
                           const char *help, const metrics_label *labels, size_t nlabels,
                           const double *bounds, size_t nbounds, void **out, strata_error *err)
{
    *out = NULL;
    if (!valid_metric_name(name))
        return strata_fail(err, STRATA_EINVAL,
                           "metric name '%s' is invalid: must match [a-zA-Z_:][a-zA-Z0-9_:]*",
                           name ? name : "(null)");
    if (help && !valid_utf8(help))
        return strata_fail(err, STRATA_EINVAL, "metric '%s': help text is not valid UTF-8",
                           name);
    if (type == MT_HISTOGRAM) {
        int rc = check_bounds(name, bounds, &nbounds, err);
        if (rc)
            return rc;
    }
    char *lab = NULL;
    int rc = render_labels(name, type, labels, nlabels, &lab, err);
    if (rc)
        return rc;
    /* Everything that can fail happens before the list changes; the two array growths only
     * add capacity, so a failure leaves the registry as it was. */
    void *m = metric_alloc(type, bounds, nbounds);
    if (!m) {
        free(lab);
        return strata_fail(err, STRATA_ENOMEM, "metric '%s': out of memory", name);
    }

    family *f = NULL;
    for (size_t i = 0; i < r->nfams; i++) {
        family *g = r->fams[i];
        if (!strcmp(g->name, name)) {
            f = g;
            break;
        }
        /* A histogram X renders X_bucket, X_sum and X_count; two families must never produce
         * the same sample name, or Prometheus would merge or reject them. (Two histograms with
         * different names cannot clash: their suffixes end differently.) */
        if ((g->type == MT_HISTOGRAM && type != MT_HISTOGRAM && is_histogram_sample(g->name, name)) ||
            (type == MT_HISTOGRAM && g->type != MT_HISTOGRAM && is_histogram_sample(name, g->name))) {
            rc = strata_fail(err, STRATA_EINVAL,
                             "metric '%s' clashes with the samples of %s '%s'", name,
                             type_names[g->type], g->name);
            goto fail;
        }
    }
    bool fresh = f == NULL;
    if (f) {
        rc = check_same_family(f, help, type, labels, nlabels, bounds, nbounds, err);
        if (rc)
            goto fail;
        for (size_t i = 0; i < f->nseries; i++)
            if (!strcmp(f->series[i].labels, lab)) {
                rc = strata_fail(err, STRATA_EINVAL, "metric '%s{%s}' is already registered",
                                 name, lab);
                goto fail;
            }
    } else {
        f = family_alloc(name, help, type, labels, nlabels, bounds, nbounds);
        if (!f) {
            rc = strata_fail(err, STRATA_ENOMEM, "metric '%s': out of memory", name);
            goto fail;
        }
    }
    if (f->nseries == f->cap) {
        size_t cap = f->cap ? f->cap * 2 : 4;
        series *s = realloc(f->series, cap * sizeof *s);
        if (!s) {
            rc = strata_fail(err, STRATA_ENOMEM, "metric '%s': out of memory", name);
            goto fail_family;
        }
        f->series = s;
        f->cap = cap;
    }
    if (fresh && r->nfams == r->cap) {
        size_t cap = r->cap ? r->cap * 2 : 16;
        family **fs = realloc(r->fams, cap * sizeof *fs);
        if (!fs) {
            rc = strata_fail(err, STRATA_ENOMEM, "metric '%s': out of memory", name);
            goto fail_family;
        }
        r->fams = fs;
        r->cap = cap;
    }
    f->series[f->nseries++] = (series){.labels = lab, .metric = m};
    if (fresh)
        r->fams[r->nfams++] = f;
    *out = m;
    return STRATA_OK;

fail_family:
    if (fresh)
        family_free(f);
fail:
    metric_free(type, m);
    free(lab);
    return rc;
}

static int register_series(metrics_registry *r, enum metric_type type, const char *name,
                           const char *help, const metrics_label *labels, size_t nlabels,
                           const double *bounds, size_t nbounds, void **out, strata_error *err)
{
    if (!r || !out)
        return strata_fail(err, STRATA_EINVAL, "metrics: registry or output handle is NULL");
    pthread_mutex_lock(&r->mu);
    int rc = register_locked(r, type, name, help, labels, nlabels, bounds, nbounds, out, err);
    pthread_mutex_unlock(&r->mu);
    return rc;
}

int metrics_counter_new(metrics_registry *r, const char *name, const char *help,
                        const metrics_label *labels, size_t nlabels, metrics_counter **out,
                        strata_error *err)
{
    void *m = NULL;
    int rc = register_series(r, MT_COUNTER, name, help, labels, nlabels, NULL, 0, &m, err);
    if (out)
        *out = m;
    return rc;
}

int metrics_gauge_new(metrics_registry *r, const char *name, const char *help,
                      const metrics_label *labels, size_t nlabels, metrics_gauge **out,
                      strata_error *err)
{
    void *m = NULL;
    int rc = register_series(r, MT_GAUGE, name, help, labels, nlabels, NULL, 0, &m, err);
    if (out)
        *out = m;
    return rc;
}

int metrics_histogram_new(metrics_registry *r, const char *name, const char *help,
                          const metrics_label *labels, size_t nlabels, const double *bounds,
                          size_t nbounds, metrics_histogram **out, strata_error *err)
{
    void *m = NULL;
    int rc = register_series(r, MT_HISTOGRAM, name, help, labels, nlabels, bounds, nbounds, &m,
                             err);
    if (out)
        *out = m;
    return rc;
}

/* Removes the last n series of family `name` again (family registration is all or nothing);
 * drops the family if it became empty. Caller holds r->mu. */
static void unregister_last_locked(metrics_registry *r, const char *name, size_t n)
{
    for (size_t i = 0; i < r->nfams; i++) {
        family *f = r->fams[i];
        if (strcmp(f->name, name))
            continue;
        for (size_t k = 0; k < n && f->nseries; k++) {
            series *s = &f->series[--f->nseries];
            free(s->labels);
            metric_free(f->type, s->metric);
        }
        if (!f->nseries) {
            family_free(f);
            memmove(&r->fams[i], &r->fams[i + 1], (r->nfams - i - 1) * sizeof *r->fams);
            r->nfams--;
        }
        return;
    }
}

static int register_family(metrics_registry *r, enum metric_type type, const char *name,
                           const char *help, const char *label, const char *const *values,
                           size_t nvalues, void **out, strata_error *err)
{
    if (!r || !out || !values)
        return strata_fail(err, STRATA_EINVAL, "metric family '%s': NULL argument",
                           name ? name : "(null)");
    if (!nvalues)
        return strata_fail(err, STRATA_EINVAL, "metric family '%s': no label values",
                           name ? name : "(null)");
    /* One lock hold for the whole family, so a failure part way can take back exactly the
     * series added here, and a concurrent render never sees half a family. */
    pthread_mutex_lock(&r->mu);
    for (size_t i = 0; i < nvalues; i++) {
        metrics_label l = {label, values[i]};
        int rc = register_locked(r, type, name, help, &l, 1, NULL, 0, &out[i], err);
        if (rc) {
            if (i)  /* then name was valid, and the i series just added are the family's last */
                unregister_last_locked(r, name, i);
            for (size_t k = 0; k < i; k++)
                out[k] = NULL;
            pthread_mutex_unlock(&r->mu);
            return rc;
        }
    }
    pthread_mutex_unlock(&r->mu);
    return STRATA_OK;
}

int metrics_counter_family(metrics_registry *r, const char *name, const char *help,
                           const char *label, const char *const *values, size_t nvalues,
                           metrics_counter **out, strata_error *err)
{
    return register_family(r, MT_COUNTER, name, help, label, values, nvalues, (void **)out, err);
}

int metrics_gauge_family(metrics_registry *r, const char *name, const char *help,
                         const char *label, const char *const *values, size_t nvalues,
                         metrics_gauge **out, strata_error *err)
{
    return register_family(r, MT_GAUGE, name, help, label, values, nvalues, (void **)out, err);
}

/* ---- updates ---- */

/* Relaxed ordering throughout: a metric is a statistic, never used to publish other memory, and
 * the scrape only needs each value to be untorn. */

void metrics_counter_inc(metrics_counter *c) { atomic_fetch_add_explicit(&c->v, 1, memory_order_relaxed); }

void metrics_counter_add(metrics_counter *c, uint64_t n)
{
    atomic_fetch_add_explicit(&c->v, n, memory_order_relaxed);
}

uint64_t metrics_counter_value(const metrics_counter *c)
{
    return atomic_load_explicit((_Atomic uint64_t *)&c->v, memory_order_relaxed);
}

static uint64_t double_bits(double d)
{
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    return u;
}

static double bits_double(uint64_t u)
{
    double d;
    memcpy(&d, &u, sizeof d);
    return d;
}

void metrics_gauge_set(metrics_gauge *g, double v)
{
    atomic_store_explicit(&g->bits, double_bits(v), memory_order_relaxed);
}

void metrics_gauge_add(metrics_gauge *g, double delta)
{
    uint64_t old = atomic_load_explicit(&g->bits, memory_order_relaxed);
    /* On failure the exchange reloads old, so the sum is recomputed from the latest value. */
    while (!atomic_compare_exchange_weak_explicit(&g->bits, &old,
                                                  double_bits(bits_double(old) + delta),
                                                  memory_order_relaxed, memory_order_relaxed)) {
    }
}

double metrics_gauge_value(const metrics_gauge *g)
{
    return bits_double(atomic_load_explicit((_Atomic uint64_t *)&g->bits, memory_order_relaxed));
}

void metrics_histogram_observe(metrics_histogram *h, double v)
{
    if (isnan(v))
        return;
    /* First bound >= v: "le" is inclusive. */
    size_t lo = 0, hi = h->nbounds;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (h->bounds[mid] >= v)
            hi = mid;
        else
            lo = mid + 1;
    }
    pthread_mutex_lock(&h->mu);
    h->counts[lo]++;
    h->sum += v;
    h->count++;
    pthread_mutex_unlock(&h->mu);
}

size_t metrics_histogram_read(metrics_histogram *h, uint64_t *cumulative, double *sum,
                              uint64_t *count)
{
    pthread_mutex_lock(&h->mu);
    uint64_t acc = 0;
    for (size_t i = 0; i <= h->nbounds; i++) {
        acc += h->counts[i];
        if (cumulative)
            cumulative[i] = acc;
    }
    if (sum)
        *sum = h->sum;
    if (count)
        *count = h->count;
    pthread_mutex_unlock(&h->mu);
    return h->nbounds;
}

/* ---- buckets ---- */

int metrics_buckets_exponential(double start, double factor, size_t n, double *out,
                                strata_error *err)
{
    if (!out || !(start > 0) || !isfinite(start) || !(factor > 1) || !isfinite(factor) || n < 1 ||
        n > METRICS_MAX_BUCKETS)
        return strata_fail(err, STRATA_EINVAL,
                           "exponential buckets need start > 0, factor > 1 and 1..%d buckets "
                           "(got start %g, factor %g, %zu)",
                           METRICS_MAX_BUCKETS, start, factor, n);
    double b = start;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(b))
            return strata_fail(err, STRATA_EINVAL, "exponential buckets overflow at bucket %zu",
                               i);
        out[i] = b;
        b *= factor;
    }
    return STRATA_OK;
}

void metrics_latency_buckets(double out[METRICS_LATENCY_BUCKETS])
{
    /* Doubling from 1 ms: covers a fast decode step (a few ms) up to a minute-long prefill or
     * queue wait with 17 series per histogram. Each bound is an exact power-of-two multiple of
     * the double nearest 0.001, so it prints as 0.001, 0.002, ..., 65.536. */
    double b = 0.001;
    for (int i = 0; i < METRICS_LATENCY_BUCKETS; i++, b *= 2)
        out[i] = b;
}

/* ---- rendering ---- */

static void render_sample(sbuf *b, const char *name, const char *suffix, const char *labels,
                          const char *le)
{
    sb_puts(b, name);
    sb_puts(b, suffix);
    if (*labels || le) {
        sb_putc(b, '{');
        sb_puts(b, labels);
        if (le) {
            if (*labels)
                sb_putc(b, ',');
            sb_puts(b, "le=\"");
            sb_puts(b, le);
            sb_putc(b, '"');
        }
        sb_putc(b, '}');
    }
    sb_putc(b, ' ');
}

static void render_family(sbuf *b, const family *f)
{
    if (f->help) {
        sb_puts(b, "# HELP ");
        sb_puts(b, f->name);
        sb_putc(b, ' ');
        sb_escaped(b, f->help, false);
        sb_putc(b, '\n');
    }
    sb_puts(b, "# TYPE ");
    sb_puts(b, f->name);
    sb_putc(b, ' ');
    sb_puts(b, type_names[f->type]);
    sb_putc(b, '\n');
    for (size_t i = 0; i < f->nseries; i++) {
        const series *s = &f->series[i];
        if (f->type == MT_COUNTER) {
            render_sample(b, f->name, "", s->labels, NULL);
            sb_put_u64(b, metrics_counter_value(s->metric));
        } else if (f->type == MT_GAUGE) {
            render_sample(b, f->name, "", s->labels, NULL);
            sb_put_double(b, metrics_gauge_value(s->metric));
        } else {
            metrics_histogram *h = s->metric;
            uint64_t cum[METRICS_MAX_BUCKETS + 1];
            double sum;
            uint64_t count;
            metrics_histogram_read(h, cum, &sum, &count);
            for (size_t k = 0; k < f->nbounds; k++) {
                render_sample(b, f->name, "_bucket", s->labels, f->le[k]);
                sb_put_u64(b, cum[k]);
                sb_putc(b, '\n');
            }
            render_sample(b, f->name, "_bucket", s->labels, "+Inf");
            sb_put_u64(b, cum[f->nbounds]);
            sb_putc(b, '\n');
            render_sample(b, f->name, "_sum", s->labels, NULL);
            sb_put_double(b, sum);
            sb_putc(b, '\n');
            render_sample(b, f->name, "_count", s->labels, NULL);
            sb_put_u64(b, count);
        }
        sb_putc(b, '\n');
    }
}

int metrics_render(metrics_registry *r, char **out, size_t *len, strata_error *err)
{
    if (!r || !out)
        return strata_fail(err, STRATA_EINVAL, "metrics_render: NULL argument");
    *out = NULL;
    if (len)
        *len = 0;
    pthread_mutex_lock(&r->render_mu);
    pthread_mutex_lock(&r->mu);
    metrics_collect_fn fn = r->collect;
    void *user = r->collect_user;
    pthread_mutex_unlock(&r->mu);
    if (fn)
        fn(r, user);

    sbuf b;
    sb_init(&b, 4096);
    pthread_mutex_lock(&r->mu);
    for (size_t i = 0; i < r->nfams; i++)
        render_family(&b, r->fams[i]);
    pthread_mutex_unlock(&r->mu);
    pthread_mutex_unlock(&r->render_mu);
    if (b.oom) {
        free(b.p);
        return strata_fail(err, STRATA_ENOMEM, "metrics_render: out of memory");
    }
    *out = b.p;
    if (len)
        *len = b.len;
    return STRATA_OK;
}
