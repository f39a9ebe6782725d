/* Bit plans (plan.h). */
#include "kvstore/plan.h"
#include "kvstore/replace_file.h"

#include <ctype.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define PLAN_FILE_MAX (64 * 1024)

static int uniform(const char *name, int n_layers, kv_codec_params *out, strata_error *err)
{
    if (strcmp(name, "tada") == 0) {
        kv_codec_params lo, hi;
        if (kv_codec_parse("tada4", &lo, err) || kv_codec_parse("tada2", &hi, err))
            return STRATA_EINVAL;
        for (int l = 0; l < n_layers; l++)
            out[l] = l < (n_layers + 1) / 2 ? lo : hi;
        return STRATA_OK;
    }
    kv_codec_params p;
    int rc = kv_codec_parse(name, &p, err);
    if (rc)
        return rc;
    for (int l = 0; l < n_layers; l++) {
        out[l] = p;
        if (p.codec == KV_CODEC_OTT && l < 2)
            out[l].pool_tokens = 0;
    }
    return STRATA_OK;
}

static bool has_range_syntax(const char *spec) { return strchr(spec, ':') != NULL; }

/* Trims spaces in place: returns the first non-space char and cuts trailing spaces. */
static char *trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    size_t n = strlen(s);
    while (n && isspace((unsigned char)s[n - 1]))
        s[--n] = 0;
    return s;
}

static int parse_layer(const char *s, long *out)
{
    if (!isdigit((unsigned char)*s))
        return -1;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < 0 || v > 1000000)
        return -1;
    *out = v;
    return 0;
}

/* One "A-B:codec" entry (already trimmed; empty is fine). */
static int parse_entry(char *entry, int line, int n_layers, unsigned char *seen, kv_codec_params *out,
                       strata_error *err)
{
    if (!*entry)
        return STRATA_OK;
    char *colon = strchr(entry, ':');
    long a = -1, b = -1;
    if (!colon)
        return strata_fail(err, STRATA_EINVAL, "kv plan line %d: \"%s\" is not LAYERS:CODEC (e.g. 0-9:tada4)", line,
                           entry);
    *colon = 0;
    char *range = trim(entry), *name = trim(colon + 1);
    char *dash = strchr(range, '-');
    if (dash) {
        *dash = 0;
        if (parse_layer(trim(range), &a) || parse_layer(trim(dash + 1), &b))
            a = -1;
    } else if (parse_layer(range, &a) == 0) {
        b = a;
    }
    if (a < 0 || b < a)
        return strata_fail(err, STRATA_EINVAL, "kv plan line %d: bad layer range before \"%s\" (use A-B or A)", line,
                           name);
    if (b >= n_layers)
        return strata_fail(err, STRATA_EINVAL, "kv plan line %d: layer %ld is out of range (the model has %d layers)",
                           line, b, n_layers);
    kv_codec_params c;
    strata_error why = {0};
    if (kv_codec_parse(name, &c, &why) != STRATA_OK)
        return strata_fail(err, STRATA_EINVAL, "kv plan line %d: %s", line, why.msg);
    for (long l = a; l <= b; l++) {
        if (seen[l])
            return strata_fail(err, STRATA_EINVAL, "kv plan line %d: layer %ld is given twice", line, l);
        seen[l] = 1;
        out[l] = c;
    }
    return STRATA_OK;
}

static int parse_ranges(char *text, int n_layers, kv_codec_params *out, strata_error *err)
{
    unsigned char *seen = calloc((size_t)n_layers, 1);
    if (!seen)
        return strata_fail(err, STRATA_ENOMEM, "kv plan: out of memory");
    int rc = STRATA_OK, line = 0;
    char *p = text;
    /* Line by line, comments cut first (they may hold commas), then the line's entries. */
    while (rc == STRATA_OK && *p) {
        line++;
        size_t line_len = strcspn(p, "\n");
        char *next = p + line_len + (p[line_len] ? 1 : 0);
        p[line_len] = 0;
        char *hash = strchr(p, '#');
        if (hash)
            *hash = 0;
        char *q = p;
        while (rc == STRATA_OK && *q) {
            size_t n = strcspn(q, ",");
            char *after = q + n + (q[n] ? 1 : 0);
            q[n] = 0;
            rc = parse_entry(trim(q), line, n_layers, seen, out, err);
            q = after;
        }
        p = next;
    }
    for (int l = 0; rc == STRATA_OK && l < n_layers; l++)
        if (!seen[l])
            rc = strata_fail(err, STRATA_EINVAL, "kv plan: layer %d has no codec (the model has %d layers)", l, n_layers);
    free(seen);
    return rc;
}

int kv_plan_parse(const char *spec, int n_layers, kv_codec_params *out, strata_error *err)
{
    if (!spec || !out)
        return strata_fail(err, STRATA_EINVAL, "kv plan: NULL argument");
    if (n_layers < 1)
        return strata_fail(err, STRATA_EINVAL, "kv plan: n_layers %d must be positive", n_layers);
    if (!has_range_syntax(spec))
        return uniform(spec, n_layers, out, err);
    char *copy = strdup(spec);
    if (!copy)
        return strata_fail(err, STRATA_ENOMEM, "kv plan: out of memory");
    int rc = parse_ranges(copy, n_layers, out, err);
    free(copy);
    return rc;
}

/* A byte a plan file may not hold: a control character other than tab and the line ends (NUL
 * and DEL included). A plan's entries are quoted back in error messages, so what reaches a
 * terminal from one must be text. */
static bool plan_control_byte(char ch)
{
    const unsigned char c = (unsigned char)ch;
    return c == 0x7f || (c < 0x20 && c != '\t' && c != '\n' && c != '\r');
}

/* The offset of the first byte a text file does not hold (plan_control_byte, or a CR that does
 * not end a CRLF), or n. */
static size_t first_control_byte(const char *buf, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (plan_control_byte(buf[i]) || (buf[i] == '\r' && !(i + 1 < n && buf[i + 1] == '\n')))
            return i;
    return n;
}

int kv_plan_load(const char *path, int n_layers, kv_codec_params *out, strata_error *err)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return strata_fail(err, STRATA_EIO, "kv plan %s: %s", path, strerror(errno));
    char *buf = malloc(PLAN_FILE_MAX + 1);
    if (!buf) {
        fclose(f);
        return strata_fail(err, STRATA_ENOMEM, "kv plan %s: out of memory", path);
    }
    size_t n = fread(buf, 1, PLAN_FILE_MAX + 1, f);
    int rd_err = ferror(f) ? (errno ? errno : EIO) : 0;  /* EISDIR for a folder */
    fclose(f);
    int rc;
    size_t bad;
    if (rd_err) {
        rc = strata_fail(err, STRATA_EIO, "kv plan %s: %s", path, strerror(rd_err));
    } else if (n > PLAN_FILE_MAX) {
        rc = strata_fail(err, STRATA_EINVAL, "kv plan %s: larger than %d bytes", path, PLAN_FILE_MAX);
    } else if ((bad = first_control_byte(buf, n)) < n) {
        rc = strata_fail(err, STRATA_EINVAL, "kv plan %s: not a text file (byte 0x%02x at offset %zu)", path,
                         (unsigned char)buf[bad], bad);
    } else {
        buf[n] = 0;
        /* Comments may hold anything (commas, colons): blank them before looking at the rest. */
        for (char *hash = strchr(buf, '#'); hash; hash = strchr(hash, '#')) {
            size_t end = strcspn(hash, "\n");
            memset(hash, ' ', end);
            hash += end;
        }
        const char *body = trim(buf);
        if (!*body)
            rc = strata_fail(err, STRATA_EINVAL, "holds no plan (only blank lines and comments)");
        else
            rc = has_range_syntax(buf) ? parse_ranges(buf, n_layers, out, err) : uniform(body, n_layers, out, err);
        if (rc && err)
            strata_error_prefix(err, "%s", path);
    }
    free(buf);
    return rc;
}

bool kv_plan_is_file(const char *spec)
{
    if (!spec || !*spec)
        return false;
    kv_codec_params p;
    if (strcmp(spec, "tada") == 0 || kv_codec_parse(spec, &p, NULL) == STRATA_OK)
        return false;
    struct stat st;
    return stat(spec, &st) == 0 && S_ISREG(st.st_mode);
}

void kv_plan_format(const kv_codec_params *layers, int n_layers, char *buf, size_t cap)
{
    if (!buf || cap == 0)
        return;
    buf[0] = 0;
    size_t at = 0;
    int start = 0;
    char name[64], next[64];
    for (int l = 0; l < n_layers; l++) {
        kv_codec_name(&layers[l], name, sizeof name);
        if (l + 1 < n_layers)
            kv_codec_name(&layers[l + 1], next, sizeof next);
        if (l + 1 < n_layers && strcmp(name, next) == 0)
            continue;
        /* Uniform: one name, unless parsing that name would change it (one OTT name leaves
         * layers 0 and 1 without a pool; a uniform plan with a pool there is written as a range). */
        if (start == 0 && l == n_layers - 1 && !(layers[0].codec == KV_CODEC_OTT && layers[0].pool_tokens > 0)) {
            snprintf(buf, cap, "%s", name);
            return;
        }
        int w = start == l ? snprintf(buf + at, cap - at, "%s%d:%s", at ? "," : "", l, name)
                           : snprintf(buf + at, cap - at, "%s%d-%d:%s", at ? "," : "", start, l, name);
        if (w < 0 || (size_t)w >= cap - at)
            return;   /* truncated */
        at += (size_t)w;
        start = l + 1;
    }
}

char *kv_plan_name(const kv_codec_params *layers, int n_layers)
{
    if (!layers || n_layers < 1)
        return NULL;
    /* a codec's canonical name is under 64 bytes; each range adds at most "ddddd-ddddd:," */
    const size_t cap = (size_t)n_layers * 96 + 1;
    char *buf = malloc(cap);
    if (buf)
        kv_plan_format(layers, n_layers, buf, cap);
    return buf;
}

typedef struct plan_text {
    const kv_codec_params *layers;
    int n_layers;
    const char *comment;
} plan_text;

static int write_plan(FILE *f, const char *path, void *ctx, strata_error *err)
{
    const plan_text *p = ctx;
    if (p->comment) {
        const char *c = p->comment;
        while (*c) {   /* control characters become '?': kv_plan_load reads only text */
            size_t n = strcspn(c, "\n");
            fputs("# ", f);
            for (size_t i = 0; i < n; i++)
                fputc(plan_control_byte(c[i]) || c[i] == '\r' ? '?' : c[i], f);
            fputc('\n', f);
            c += n + (c[n] ? 1 : 0);
        }
    }
    char name[64], next[64];
    int start = 0;
    for (int l = 0; l < p->n_layers; l++) {
        kv_codec_name(&p->layers[l], name, sizeof name);
        if (l + 1 < p->n_layers)
            kv_codec_name(&p->layers[l + 1], next, sizeof next);
        if (l + 1 < p->n_layers && strcmp(name, next) == 0)
            continue;
        if (start == l)
            fprintf(f, "%d:%s\n", l, name);
        else
            fprintf(f, "%d-%d:%s\n", start, l, name);
        start = l + 1;
    }
    if (ferror(f))
        return strata_fail(err, STRATA_EIO, "writing kv plan %s: %s", path, strerror(errno));
    return STRATA_OK;
}

int kv_plan_save(const char *path, const kv_codec_params *layers, int n_layers, const char *comment,
                 strata_error *err)
{
    plan_text p = {layers, n_layers, comment};
    /* A device or a pipe (--out /dev/stdout) is written to as it is; a file is replaced. */
    struct stat st;
    if (path && stat(path, &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode)) {
        FILE *f = fopen(path, "w");
        if (!f)
            return strata_fail(err, STRATA_EIO, "writing kv plan %s: %s", path, strerror(errno));
        int rc = write_plan(f, path, &p, err);
        if (fclose(f) != 0 && rc == STRATA_OK)
            rc = strata_fail(err, STRATA_EIO, "writing kv plan %s: %s", path, strerror(errno));
        return rc;
    }
    int rc = strata_replace_file(path, 0644, write_plan, &p, err);
    return rc == STRATA_OK ? rc : strata_error_prefix(err, "writing kv plan");
}

int kv_plan_check_one_window(const kv_codec_params *layers, int n_layers, strata_error *err)
{
    bool has_fp16 = false;
    for (int l = 0; l < n_layers; l++)
        has_fp16 |= layers[l].codec == KV_CODEC_FP16;
    for (int l = 1; l < n_layers; l++)
        if (layers[l].residual != layers[0].residual)
            return strata_fail(err, STRATA_EUNSUPPORTED,
                               "layer %d keeps an fp16 window of %d tokens and layer 0 one of %d: the GPU path takes "
                               "KV plans whose layers share it (%s)",
                               l, layers[l].residual, layers[0].residual,
                               has_fp16 ? "an fp16 layer keeps none, so its quantized layers need -r0, or the plan no "
                                          "fp16 layer"
                                        : "give every codec the same -rN");
    return STRATA_OK;
}

