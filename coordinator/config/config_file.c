/* Config files, JSON or YAML, into one jansson document (config_file.h). */
#include "coordinator/config/config_file.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <yaml.h>

enum { MAX_DEPTH = 64, MAX_VALUES = 100000 };

bool config_file_is_yaml(const char *path)
{
    size_t n = strlen(path);
    return (n > 5 && !strcmp(path + n - 5, ".yaml")) || (n > 4 && !strcmp(path + n - 4, ".yml"));
}

typedef struct yaml_reader {
    yaml_document_t *doc;
    size_t values;
    char *why;
    size_t cap;
} yaml_reader;

__attribute__((format(printf, 3, 4)))
static json_t *refuse(yaml_reader *r, const yaml_node_t *n, const char *fmt, ...)
{
    char what[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    snprintf(r->why, r->cap, "line %zu: %s", n->start_mark.line + 1, what);
    return NULL;
}

static bool is_one_of(const char *s, const char *const *words)
{
    for (; *words; words++)
        if (!strcmp(s, *words))
            return true;
    return false;
}

/* A plain scalar as YAML 1.2's core schema resolves it (booleans, null, integers, reals), other
 * text a string; integers out of range and non-finite reals stay strings, for the option's own
 * parser to refuse with its range. */
static json_t *plain_scalar(const char *s)
{
    static const char *const trues[] = {"true", "True", "TRUE", NULL};
    static const char *const falses[] = {"false", "False", "FALSE", NULL};
    static const char *const nulls[] = {"", "~", "null", "Null", "NULL", NULL};
    if (is_one_of(s, trues))
        return json_true();
    if (is_one_of(s, falses))
        return json_false();
    if (is_one_of(s, nulls))
        return json_null();
    const char *digits = s + (*s == '-' || *s == '+');
    if (*digits && strspn(digits, "0123456789") == strlen(digits)) {
        errno = 0;
        long long v = strtoll(s, NULL, 10);
        if (errno == 0)
            return json_integer((json_int_t)v);
        return json_string(s);
    }
    if (strpbrk(s, "0123456789") && !strpbrk(s, "xXpP")) {   /* no hexadecimal floats */
        char *end;
        double v = strtod(s, &end);
        if (*end == '\0' && end != s && isfinite(v))
            return json_real(v);
    }
    return json_string(s);
}

static json_t *convert(yaml_reader *r, yaml_node_t *n, int depth)
{
    if (depth > MAX_DEPTH)
        return refuse(r, n, "nested more than %d deep", MAX_DEPTH);
    if (++r->values > MAX_VALUES)
        return refuse(r, n, "more than %d values (aliases counted each time they are used)", MAX_VALUES);
    switch (n->type) {
    case YAML_SCALAR_NODE: {
        const char *s = (const char *)n->data.scalar.value;
        if (strlen(s) != n->data.scalar.length)
            return refuse(r, n, "a value holds a NUL character");
        json_t *v = n->data.scalar.style == YAML_PLAIN_SCALAR_STYLE ? plain_scalar(s) : json_string(s);
        return v ? v : refuse(r, n, "a value that is no UTF-8 text, or out of memory");
    }
    case YAML_SEQUENCE_NODE: {
        json_t *a = json_array();
        if (!a)
            return refuse(r, n, "out of memory");
        for (yaml_node_item_t *it = n->data.sequence.items.start; it < n->data.sequence.items.top; it++) {
            json_t *v = convert(r, yaml_document_get_node(r->doc, *it), depth + 1);
            if (!v || json_array_append_new(a, v) != 0) {
                json_decref(a);
                return v ? refuse(r, n, "out of memory") : NULL;
            }
        }
        return a;
    }
    case YAML_MAPPING_NODE: {
        json_t *o = json_object();
        if (!o)
            return refuse(r, n, "out of memory");
        for (yaml_node_pair_t *p = n->data.mapping.pairs.start; p < n->data.mapping.pairs.top; p++) {
            yaml_node_t *k = yaml_document_get_node(r->doc, p->key);
            if (k->type != YAML_SCALAR_NODE) {
                json_decref(o);
                return refuse(r, k, "a key must be a plain name, not a list or a mapping");
            }
            const char *key = (const char *)k->data.scalar.value;
            if (strlen(key) != k->data.scalar.length) {   /* "stages\0x" would read as stages */
                json_decref(o);
                return refuse(r, k, "a key holds a NUL character");
            }
            if (json_object_get(o, key)) {
                json_decref(o);
                return refuse(r, k, "duplicate key '%s'", key);
            }
            json_t *v = convert(r, yaml_document_get_node(r->doc, p->value), depth + 1);
            if (!v || json_object_set_new(o, key, v) != 0) {
                json_decref(o);
                return v ? refuse(r, k, "key '%s' is no UTF-8 text, or out of memory", key) : NULL;
            }
        }
        return o;
    }
    default:
        return refuse(r, n, "an empty node");
    }
}

static json_t *load_yaml(const char *path, char *why, size_t cap)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(why, cap, "unable to open %s: %s", path, strerror(errno));
        return NULL;
    }
    yaml_parser_t parser;
    if (!yaml_parser_initialize(&parser)) {
        fclose(f);
        snprintf(why, cap, "out of memory");
        return NULL;
    }
    yaml_parser_set_input_file(&parser, f);
    json_t *out = NULL;
    yaml_document_t doc;
    if (!yaml_parser_load(&parser, &doc)) {
        snprintf(why, cap, "line %zu: %s%s%s", parser.problem_mark.line + 1, parser.problem ? parser.problem : "error",
                 parser.context ? " " : "", parser.context ? parser.context : "");
        goto out;
    }
    yaml_node_t *root = yaml_document_get_root_node(&doc);
    if (!root) {
        out = json_object();   /* nothing but comments: no option set */
        if (!out)
            snprintf(why, cap, "out of memory");
    } else {
        yaml_reader r = {.doc = &doc, .why = why, .cap = cap};
        out = convert(&r, root, 0);
    }
    yaml_document_delete(&doc);
    if (out) {   /* a second document would be ignored silently: refuse it */
        yaml_document_t next;
        if (!yaml_parser_load(&parser, &next)) {
            snprintf(why, cap, "line %zu: %s", parser.problem_mark.line + 1, parser.problem ? parser.problem : "error");
            json_decref(out);
            out = NULL;
        } else {
            yaml_node_t *second = yaml_document_get_root_node(&next);
            if (second) {
                snprintf(why, cap, "line %zu: a second YAML document; a config file holds one",
                         second->start_mark.line + 1);
                json_decref(out);
                out = NULL;
            }
            yaml_document_delete(&next);
        }
    }
out:
    yaml_parser_delete(&parser);
    fclose(f);
    return out;
}

json_t *config_file_load(const char *path, char *why, size_t cap)
{
    if (cap)
        why[0] = '\0';
    struct stat st;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {   /* jansson would read it as empty text */
        snprintf(why, cap, "is a directory, not a config file");
        return NULL;
    }
    if (config_file_is_yaml(path))
        return load_yaml(path, why, cap);
    json_error_t je;
    json_t *doc = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    if (!doc) {
        if (je.line > 0)
            snprintf(why, cap, "line %d: %s", je.line, je.text);
        else   /* not a parse error: the file could not be opened or read */
            snprintf(why, cap, "%s", je.text);
    }
    return doc;
}
