/* GGUF reader. The layout (little-endian):
 *   "GGUF" u32 version u64 n_tensors u64 n_kv
 *   n_kv x { string key, u32 type, value }          string = u64 len + bytes (no NUL)
 *   n_tensors x { string name, u32 n_dims, u64 ne[n_dims], u32 type, u64 offset }
 *   padding to general.alignment (default 32), then the tensor data (offsets relative to it).
 * Everything is parsed once at open time with a cursor that refuses to step past the end, so
 * later accessors never re-validate. */
#include "worker/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvstore/half.h"

#define GGUF_MAGIC 0x46554747u /* "GGUF" little-endian */
#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_DIMS 4
#define GGUF_MAX_ARRAY_DEPTH 4

typedef struct kv_entry {
    gguf_str key;
    gguf_value_type type;
    const uint8_t *value;    /* scalar value, string record, or first array element */
    gguf_value_type elem_type;
    uint64_t n;              /* array length */
    uint64_t *str_offsets;   /* string arrays: offset of each element's record from value */
} kv_entry;

struct gguf_file {
    const uint8_t *base;
    size_t size;
    bool mapped;
    uint32_t version;
    kv_entry *kv;
    size_t n_kv;
    gguf_tensor *tensors;
    size_t n_tensors;
};

typedef struct cursor {
    const uint8_t *base;
    size_t size;
    size_t pos;
    strata_error *err;
} cursor;

static int truncated(cursor *c, const char *what)
{
    return strata_fail(c->err, STRATA_EFORMAT, "GGUF truncated: %s at byte %zu exceeds file size %zu",
                       what, c->pos, c->size);
}

static int take(cursor *c, size_t n, const uint8_t **out, const char *what)
{
    if (n > c->size - c->pos)
        return truncated(c, what);
    *out = c->base + c->pos;
    c->pos += n;
    return STRATA_OK;
}

static int read_u32(cursor *c, uint32_t *v, const char *what)
{
    const uint8_t *p = NULL;
    int rc = take(c, 4, &p, what);
    if (rc == STRATA_OK)
        memcpy(v, p, 4);
    return rc;
}

static int read_u64(cursor *c, uint64_t *v, const char *what)
{
    const uint8_t *p = NULL;
    int rc = take(c, 8, &p, what);
    if (rc == STRATA_OK)
        memcpy(v, p, 8);
    return rc;
}

static int read_str(cursor *c, gguf_str *s, const char *what)
{
    uint64_t len;
    int rc = read_u64(c, &len, what);
    if (rc != STRATA_OK)
        return rc;
    if (len > c->size - c->pos)
        return strata_fail(c->err, STRATA_EFORMAT,
                           "GGUF malformed: %s claims %llu bytes at byte %zu, only %zu remain", what,
                           (unsigned long long)len, c->pos, c->size - c->pos);
    const uint8_t *p = NULL;
    take(c, (size_t)len, &p, what);
    s->ptr = (const char *)p;
    s->len = (size_t)len;
    return STRATA_OK;
}

static size_t scalar_size(gguf_value_type t)
{
    switch (t) {
    case GGUF_UINT8: case GGUF_INT8: case GGUF_BOOL: return 1;
    case GGUF_UINT16: case GGUF_INT16: return 2;
    case GGUF_UINT32: case GGUF_INT32: case GGUF_FLOAT32: return 4;
    case GGUF_UINT64: case GGUF_INT64: case GGUF_FLOAT64: return 8;
    default: return 0;
    }
}

static int skip_value(cursor *c, uint32_t type, int depth, const char *key);

static int skip_array(cursor *c, int depth, const char *key, uint32_t *elem_type, uint64_t *n)
{
    if (depth > GGUF_MAX_ARRAY_DEPTH)
        return strata_fail(c->err, STRATA_EFORMAT, "GGUF malformed: arrays nested deeper than %d in '%s'",
                           GGUF_MAX_ARRAY_DEPTH, key);
    int rc = read_u32(c, elem_type, "array type");
    if (rc == STRATA_OK)
        rc = read_u64(c, n, "array length");
    if (rc != STRATA_OK)
        return rc;
    size_t sz = scalar_size((gguf_value_type)*elem_type);
    if (sz) {
        if (*n > (c->size - c->pos) / sz)
            return strata_fail(c->err, STRATA_EFORMAT,
                               "GGUF malformed: array '%s' of %llu elements runs past the end of the file",
                               key, (unsigned long long)*n);
        c->pos += (size_t)*n * sz;
        return STRATA_OK;
    }
    /* Each string or nested array takes at least 8 bytes: bounds the loop on garbage lengths. */
    if (*n > (c->size - c->pos) / 8)
        return strata_fail(c->err, STRATA_EFORMAT,
                           "GGUF malformed: array '%s' of %llu elements runs past the end of the file", key,
                           (unsigned long long)*n);
    for (uint64_t i = 0; i < *n; i++) {
        rc = skip_value(c, *elem_type, depth + 1, key);
        if (rc != STRATA_OK)
            return rc;
    }
    return STRATA_OK;
}

static int skip_value(cursor *c, uint32_t type, int depth, const char *key)
{
    if (type == GGUF_STRING) {
        gguf_str s;
        return read_str(c, &s, "string value");
    }
    if (type == GGUF_ARRAY) {
        uint32_t et;
        uint64_t n;
        return skip_array(c, depth, key, &et, &n);
    }
    size_t sz = scalar_size((gguf_value_type)type);
    if (!sz)
        return strata_fail(c->err, STRATA_EFORMAT, "GGUF malformed: unknown value type %u for key '%s'",
                           type, key);
    const uint8_t *p = NULL;
    return take(c, sz, &p, "scalar value");
}

const char *gguf_tensor_type_name(uint32_t type)
{
    static const char *const names[] = {
        [0] = "F32", [1] = "F16", [2] = "Q4_0", [3] = "Q4_1", [6] = "Q5_0", [7] = "Q5_1",
        [8] = "Q8_0", [9] = "Q8_1", [10] = "Q2_K", [11] = "Q3_K", [12] = "Q4_K", [13] = "Q5_K",
        [14] = "Q6_K", [15] = "Q8_K", [24] = "I8", [25] = "I16", [26] = "I32", [27] = "I64",
        [28] = "F64", [30] = "BF16",
    };
    if (type < sizeof names / sizeof names[0] && names[type])
        return names[type];
    return "unknown";
}

static bool key_equals(gguf_str k, const char *s)
{
    size_t n = strlen(s);
    return k.len == n && memcmp(k.ptr, s, n) == 0;
}

static int parse_kv(gguf_file *f, cursor *c)
{
    for (size_t i = 0; i < f->n_kv; i++) {
        kv_entry *e = &f->kv[i];
        uint32_t type;
        int rc = read_str(c, &e->key, "metadata key");
        if (rc == STRATA_OK)
            rc = read_u32(c, &type, "metadata type");
        if (rc != STRATA_OK)
            return strata_error_prefix(c->err, "metadata entry %zu", i);
        char keyname[96];
        snprintf(keyname, sizeof keyname, "%.*s", (int)(e->key.len < 80 ? e->key.len : 80), e->key.ptr);
        e->type = (gguf_value_type)type;
        e->value = c->base + c->pos;
        if (type == GGUF_ARRAY) {
            uint32_t et;
            uint64_t n;
            rc = skip_array(c, 0, keyname, &et, &n);
            if (rc != STRATA_OK)
                return rc;
            e->elem_type = (gguf_value_type)et;
            e->n = n;
            e->value += 12; /* past elem type and count */
            if (et == GGUF_STRING && n > 0) {
                e->str_offsets = malloc((size_t)n * sizeof *e->str_offsets);
                if (!e->str_offsets)
                    return strata_fail(c->err, STRATA_ENOMEM, "out of memory indexing '%s'", keyname);
                uint64_t off = 0;
                for (uint64_t j = 0; j < n; j++) {
                    uint64_t len;
                    e->str_offsets[j] = off;
                    memcpy(&len, e->value + off, 8); /* in bounds: skip_array walked these */
                    off += 8 + len;
                }
            }
        } else {
            rc = skip_value(c, type, 0, keyname);
            if (rc != STRATA_OK)
                return rc;
        }
    }
    return STRATA_OK;
}

static int parse_tensors(gguf_file *f, cursor *c, uint64_t *max_end)
{
    *max_end = 0;
    for (size_t i = 0; i < f->n_tensors; i++) {
        gguf_tensor *t = &f->tensors[i];
        gguf_str name;
        uint32_t n_dims, type;
        uint64_t offset;
        int rc = read_str(c, &name, "tensor name");
        if (rc == STRATA_OK)
            rc = read_u32(c, &n_dims, "tensor dims");
        if (rc != STRATA_OK)
            return strata_error_prefix(c->err, "tensor %zu", i);
        char *copy = malloc(name.len + 1);
        if (!copy)
            return strata_fail(c->err, STRATA_ENOMEM, "out of memory reading tensor names");
        memcpy(copy, name.ptr, name.len);
        copy[name.len] = '\0';
        t->name = copy;
        if (n_dims == 0 || n_dims > GGUF_MAX_DIMS)
            return strata_fail(c->err, STRATA_EFORMAT, "GGUF malformed: tensor '%s' has %u dimensions (1-%d allowed)",
                               copy, n_dims, GGUF_MAX_DIMS);
        t->n_dims = (int)n_dims;
        uint64_t n_el = 1;
        for (int d = 0; d < GGUF_MAX_DIMS; d++)
            t->ne[d] = 1;
        for (uint32_t d = 0; d < n_dims; d++) {
            rc = read_u64(c, &t->ne[d], "tensor shape");
            if (rc != STRATA_OK)
                return strata_error_prefix(c->err, "tensor '%s'", copy);
            if (t->ne[d] == 0 || t->ne[d] > (1ull << 40) || n_el > (1ull << 40) / t->ne[d])
                return strata_fail(c->err, STRATA_EFORMAT, "GGUF malformed: tensor '%s' has an invalid shape (dimension %u = %llu)",
                                   copy, d, (unsigned long long)t->ne[d]);
            n_el *= t->ne[d];
        }
        rc = read_u32(c, &type, "tensor type");
        if (rc == STRATA_OK)
            rc = read_u64(c, &offset, "tensor offset");
        if (rc != STRATA_OK)
            return strata_error_prefix(c->err, "tensor '%s'", copy);
        t->type = type;
        t->n_elements = n_el;
        uint64_t be, bb;
        gguf_type_block(type, &be, &bb);
        if (be == 0) {
            /* Unknown types are kept (size 0) so metadata tools still work; loading them fails. */
            t->nbytes = 0;
        } else {
            if (t->ne[0] % be != 0)
                return strata_fail(c->err, STRATA_EFORMAT,
                                   "GGUF malformed: tensor '%s' row of %llu elements is not a multiple of the %s block (%llu)",
                                   copy, (unsigned long long)t->ne[0], gguf_tensor_type_name(type), (unsigned long long)be);
            t->nbytes = (size_t)(n_el / be * bb);
        }
        if (offset > UINT64_MAX - t->nbytes)
            return strata_fail(c->err, STRATA_EFORMAT, "GGUF malformed: tensor '%s' offset overflows", copy);
        t->data = (const void *)(uintptr_t)offset; /* relative for now; fixed up by the caller */
        if (offset + t->nbytes > *max_end)
            *max_end = offset + t->nbytes;
    }
    return STRATA_OK;
}

static int cmp_kv_key(const void *a, const void *b)
{
    const gguf_str *x = &(*(const kv_entry *const *)a)->key, *y = &(*(const kv_entry *const *)b)->key;
    int c = memcmp(x->ptr, y->ptr, x->len < y->len ? x->len : y->len);
    return c ? c : (x->len > y->len) - (x->len < y->len);
}

static int cmp_tensor_name(const void *a, const void *b)
{
    return strcmp((*(const gguf_tensor *const *)a)->name, (*(const gguf_tensor *const *)b)->name);
}

static int cmp_tensor_data(const void *a, const void *b)
{
    const uint8_t *x = (*(const gguf_tensor *const *)a)->data, *y = (*(const gguf_tensor *const *)b)->data;
    return (x > y) - (x < y);
}

/* A key or tensor name given twice, or two tensors sharing bytes, is a damaged or hand-made file
 * that readers would each resolve their own way: refuse it (sorting, so a huge table stays
 * cheap). */
static int check_unique(gguf_file *f, strata_error *err)
{
    size_t n = f->n_kv > f->n_tensors ? f->n_kv : f->n_tensors;
    void **order = malloc((n ? n : 1) * sizeof *order);
    if (!order)
        return strata_fail(err, STRATA_ENOMEM, "out of memory for the GGUF tables");
    int rc = STRATA_OK;
    for (size_t i = 0; i < f->n_kv; i++)
        order[i] = &f->kv[i];
    qsort(order, f->n_kv, sizeof *order, cmp_kv_key);
    for (size_t i = 1; i < f->n_kv && !rc; i++)
        if (!cmp_kv_key(&order[i - 1], &order[i])) {
            const gguf_str *k = &((const kv_entry *)order[i])->key;
            rc = strata_fail(err, STRATA_EFORMAT, "GGUF malformed: metadata key '%.*s' appears twice",
                             (int)(k->len < 96 ? k->len : 96), k->ptr);
        }
    for (size_t i = 0; i < f->n_tensors && !rc; i++)
        order[i] = &f->tensors[i];
    if (!rc)
        qsort(order, f->n_tensors, sizeof *order, cmp_tensor_name);
    for (size_t i = 1; i < f->n_tensors && !rc; i++)
        if (!cmp_tensor_name(&order[i - 1], &order[i]))
            rc = strata_fail(err, STRATA_EFORMAT, "GGUF malformed: tensor '%.96s' appears twice",
                             ((const gguf_tensor *)order[i])->name);
    if (!rc)
        qsort(order, f->n_tensors, sizeof *order, cmp_tensor_data);
    for (size_t i = 1; i < f->n_tensors && !rc; i++) {
        const gguf_tensor *a = order[i - 1], *b = order[i];
        if ((const uint8_t *)a->data + a->nbytes > (const uint8_t *)b->data)
            rc = strata_fail(err, STRATA_EFORMAT, "GGUF malformed: tensors '%.96s' and '%.96s' overlap", a->name,
                             b->name);
    }
    free(order);
    return rc;
}

static int parse(gguf_file *f, strata_error *err)
{
    cursor c = {.base = f->base, .size = f->size, .pos = 0, .err = err};
    uint32_t magic;
    uint64_t n_tensors, n_kv;
    int rc = read_u32(&c, &magic, "magic");
    if (rc != STRATA_OK)
        return rc;
    if (magic != GGUF_MAGIC)
        return strata_fail(err, STRATA_EFORMAT, "not a GGUF file (magic %08x, expected 'GGUF')", magic);
    rc = read_u32(&c, &f->version, "version");
    if (rc != STRATA_OK)
        return rc;
    if (f->version < 2 || f->version > 3)
        return strata_fail(err, STRATA_EUNSUPPORTED, "GGUF version %u is not supported (2 and 3 are)", f->version);
    if ((rc = read_u64(&c, &n_tensors, "tensor count")) != STRATA_OK ||
        (rc = read_u64(&c, &n_kv, "metadata count")) != STRATA_OK)
        return rc;
    /* Every metadata entry needs >= 13 bytes and every tensor info >= 24: reject absurd counts
     * before allocating for them. */
    if (n_kv > f->size / 13 || n_tensors > f->size / 24)
        return strata_fail(err, STRATA_EFORMAT, "GGUF malformed: %llu tensors / %llu metadata entries cannot fit in %zu bytes",
                           (unsigned long long)n_tensors, (unsigned long long)n_kv, f->size);
    f->n_kv = (size_t)n_kv;
    f->n_tensors = (size_t)n_tensors;
    f->kv = calloc(f->n_kv ? f->n_kv : 1, sizeof *f->kv);
    f->tensors = calloc(f->n_tensors ? f->n_tensors : 1, sizeof *f->tensors);
    if (!f->kv || !f->tensors)
        return strata_fail(err, STRATA_ENOMEM, "out of memory for the GGUF tables");
    if ((rc = parse_kv(f, &c)) != STRATA_OK)
        return rc;

    uint64_t alignment = GGUF_DEFAULT_ALIGNMENT;
    for (size_t i = 0; i < f->n_kv; i++) {
        if (key_equals(f->kv[i].key, "general.alignment")) {
            uint32_t a;
            if (f->kv[i].type != GGUF_UINT32)
                return strata_fail(err, STRATA_EFORMAT, "GGUF malformed: general.alignment is not a u32");
            memcpy(&a, f->kv[i].value, 4);
            if (a == 0 || (a & (a - 1)) != 0)
                return strata_fail(err, STRATA_EFORMAT, "GGUF malformed: general.alignment %u is not a power of two", a);
            alignment = a;
        }
    }
    uint64_t max_end;
    if ((rc = parse_tensors(f, &c, &max_end)) != STRATA_OK)
        return rc;
    uint64_t data_start = (c.pos + alignment - 1) / alignment * alignment;
    if (data_start > f->size || max_end > f->size - data_start)
        return strata_fail(err, STRATA_EFORMAT,
                           "GGUF truncated: tensor data needs %llu bytes after offset %llu, the file has %zu bytes",
                           (unsigned long long)max_end, (unsigned long long)data_start, f->size);
    for (size_t i = 0; i < f->n_tensors; i++) {
        gguf_tensor *t = &f->tensors[i];
        uint64_t off = (uint64_t)(uintptr_t)t->data;
        if (off % alignment != 0)
            return strata_fail(err, STRATA_EFORMAT, "GGUF malformed: tensor '%s' offset %llu is not %llu-aligned",
                               t->name, (unsigned long long)off, (unsigned long long)alignment);
        t->data = f->base + data_start + off;
    }
    return check_unique(f, err);
}

static gguf_file *finish_open(gguf_file *f, strata_error *err)
{
    if (parse(f, err) != STRATA_OK) {
        gguf_close(f);
        return NULL;
    }
    return f;
}

gguf_file *gguf_open(const char *path, strata_error *err)
{
    /* O_NONBLOCK: opening a FIFO must not wait for a writer before fstat refuses it. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        strata_fail(err, STRATA_EIO, "cannot open model '%s': %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        strata_fail(err, STRATA_EIO, "cannot stat '%s': %s", path, strerror(errno));
        close(fd);
        return NULL;
    }
    if (!S_ISREG(st.st_mode) || st.st_size < 24) {
        strata_fail(err, STRATA_EFORMAT, "'%s' is not a GGUF file (%s)", path,
                    S_ISREG(st.st_mode) ? "too small" : "not a regular file");
        close(fd);
        return NULL;
    }
    void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int saved = errno;
    close(fd);
    if (map == MAP_FAILED) {
        strata_fail(err, STRATA_EIO, "cannot map '%s': %s", path, strerror(saved));
        return NULL;
    }
    gguf_file *f = calloc(1, sizeof *f);
    if (!f) {
        munmap(map, (size_t)st.st_size);
        strata_fail(err, STRATA_ENOMEM, "out of memory");
        return NULL;
    }
    f->base = map;
    f->size = (size_t)st.st_size;
    f->mapped = true;
    f = finish_open(f, err);
    if (!f)
        strata_error_prefix(err, "model '%s'", path);  /* the parse errors name no file */
    return f;
}

gguf_file *gguf_open_memory(const void *data, size_t size, strata_error *err)
{
    gguf_file *f = calloc(1, sizeof *f);
    uint8_t *copy = malloc(size ? size : 1);
    if (!f || !copy) {
        free(f);
        free(copy);
        strata_fail(err, STRATA_ENOMEM, "out of memory");
        return NULL;
    }
    if (size)
        memcpy(copy, data, size);
    f->base = copy;
    f->size = size;
    return finish_open(f, err);
}

void gguf_close(gguf_file *f)
{
    if (!f)
        return;
    if (f->kv)
        for (size_t i = 0; i < f->n_kv; i++)
            free(f->kv[i].str_offsets);
    if (f->tensors)
        for (size_t i = 0; i < f->n_tensors; i++)
            free((void *)f->tensors[i].name);
    free(f->kv);
    free(f->tensors);
    if (f->mapped)
        munmap((void *)f->base, f->size);
    else
        free((void *)f->base);
    free(f);
}

uint32_t gguf_version(const gguf_file *f) { return f->version; }
size_t gguf_n_tensors(const gguf_file *f) { return f->n_tensors; }
size_t gguf_n_kv(const gguf_file *f) { return f->n_kv; }
gguf_str gguf_kv_key(const gguf_file *f, size_t i) { return i < f->n_kv ? f->kv[i].key : (gguf_str){"", 0}; }
gguf_value_type gguf_kv_type(const gguf_file *f, size_t i) { return i < f->n_kv ? f->kv[i].type : GGUF_UINT8; }

const gguf_tensor *gguf_tensor_at(const gguf_file *f, size_t i)
{
    return i < f->n_tensors ? &f->tensors[i] : NULL;
}

const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name)
{
    for (size_t i = 0; i < f->n_tensors; i++)
        if (strcmp(f->tensors[i].name, name) == 0)
            return &f->tensors[i];
    return NULL;
}

static const kv_entry *find_kv(const gguf_file *f, const char *key)
{
    for (size_t i = 0; i < f->n_kv; i++)
        if (key_equals(f->kv[i].key, key))
            return &f->kv[i];
    return NULL;
}

bool gguf_has_key(const gguf_file *f, const char *key) { return find_kv(f, key) != NULL; }

static const kv_entry *need_kv(const gguf_file *f, const char *key, strata_error *err)
{
    const kv_entry *e = find_kv(f, key);
    if (!e)
        strata_fail(err, STRATA_EINVAL, "GGUF metadata key '%s' is missing", key);
    return e;
}

static bool scalar_as_i64(gguf_value_type t, const uint8_t *p, int64_t *v, bool *is_unsigned_big)
{
    *is_unsigned_big = false;
    switch (t) {
    case GGUF_UINT8: *v = p[0]; return true;
    case GGUF_INT8: *v = (int8_t)p[0]; return true;
    case GGUF_UINT16: { uint16_t x; memcpy(&x, p, 2); *v = x; return true; }
    case GGUF_INT16: { int16_t x; memcpy(&x, p, 2); *v = x; return true; }
    case GGUF_UINT32: { uint32_t x; memcpy(&x, p, 4); *v = x; return true; }
    case GGUF_INT32: { int32_t x; memcpy(&x, p, 4); *v = x; return true; }
    case GGUF_UINT64: {
        uint64_t x;
        memcpy(&x, p, 8);
        if (x > INT64_MAX) { *is_unsigned_big = true; return false; }
        *v = (int64_t)x;
        return true;
    }
    case GGUF_INT64: { int64_t x; memcpy(&x, p, 8); *v = x; return true; }
    default: return false;
    }
}

int gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out, strata_error *err)
{
    const kv_entry *e = need_kv(f, key, err);
    if (!e)
        return STRATA_EINVAL;
    int64_t v;
    bool big;
    if (!scalar_as_i64(e->type, e->value, &v, &big) || v < 0 || v > UINT32_MAX)
        return strata_fail(err, STRATA_EFORMAT, "GGUF metadata '%s' is not an integer in 0..2^32-1", key);
    *out = (uint32_t)v;
    return STRATA_OK;
}

int gguf_get_f32(const gguf_file *f, const char *key, float *out, strata_error *err)
{
    const kv_entry *e = need_kv(f, key, err);
    if (!e)
        return STRATA_EINVAL;
    if (e->type == GGUF_FLOAT32) {
        memcpy(out, e->value, 4);
    } else if (e->type == GGUF_FLOAT64) {
        double d;
        memcpy(&d, e->value, 8);
        *out = (float)d;
    } else {
        return strata_fail(err, STRATA_EFORMAT, "GGUF metadata '%s' is not a float", key);
    }
    return STRATA_OK;
}

int gguf_get_bool(const gguf_file *f, const char *key, bool *out, strata_error *err)
{
    const kv_entry *e = need_kv(f, key, err);
    if (!e)
        return STRATA_EINVAL;
    if (e->type != GGUF_BOOL)
        return strata_fail(err, STRATA_EFORMAT, "GGUF metadata '%s' is not a bool", key);
    *out = e->value[0] != 0;
    return STRATA_OK;
}

int gguf_get_str(const gguf_file *f, const char *key, gguf_str *out, strata_error *err)
{
    const kv_entry *e = need_kv(f, key, err);
    if (!e)
        return STRATA_EINVAL;
    if (e->type != GGUF_STRING)
        return strata_fail(err, STRATA_EFORMAT, "GGUF metadata '%s' is not a string", key);
    uint64_t len;
    memcpy(&len, e->value, 8);
    out->ptr = (const char *)e->value + 8;
    out->len = (size_t)len;
    return STRATA_OK;
}

int gguf_get_array(const gguf_file *f, const char *key, gguf_array *out, strata_error *err)
{
    const kv_entry *e = need_kv(f, key, err);
    if (!e)
        return STRATA_EINVAL;
    if (e->type != GGUF_ARRAY)
        return strata_fail(err, STRATA_EFORMAT, "GGUF metadata '%s' is not an array", key);
    out->elem_type = e->elem_type;
    out->n = e->n;
    out->data = e->value;
    out->priv = e;
    return STRATA_OK;
}

gguf_str gguf_array_str(const gguf_array *a, uint64_t i)
{
    const kv_entry *e = a->priv;
    if (a->elem_type != GGUF_STRING || !e || i >= a->n)
        return (gguf_str){"", 0};
    const uint8_t *rec = a->data + e->str_offsets[i];
    uint64_t len;
    memcpy(&len, rec, 8);
    return (gguf_str){(const char *)rec + 8, (size_t)len};
}

int64_t gguf_array_int(const gguf_array *a, uint64_t i)
{
    size_t sz = scalar_size(a->elem_type);
    int64_t v;
    bool big;
    if (i >= a->n || sz == 0 || a->elem_type == GGUF_FLOAT32 || a->elem_type == GGUF_FLOAT64 ||
        a->elem_type == GGUF_BOOL)
        return 0;
    if (!scalar_as_i64(a->elem_type, a->data + i * sz, &v, &big))
        return 0;
    return v;
}

/* One loop per format over the shared functions (kernels/weight_values.h); the quantized ones
 * read a block's scales once. */
int gguf_tensor_to_f32(const gguf_tensor *t, float *out, strata_error *err)
{
    const uint8_t *p = t->data;
    const uint64_t n = t->n_elements;
    switch (t->type) {
    case GGUF_T_F32:
        memcpy(out, p, (size_t)n * 4);
        return STRATA_OK;
    case GGUF_T_F16:
        for (uint64_t i = 0; i < n; i++)
            out[i] = gguf_f16_value(p, i);
        return STRATA_OK;
    case GGUF_T_BF16:
        for (uint64_t i = 0; i < n; i++)
            out[i] = gguf_bf16_value(p, i);
        return STRATA_OK;
    case GGUF_T_Q8_0:
        for (uint64_t b = 0; b < n / 32; b++, p += 34, out += 32) {
            const float d = gguf_half_at(p);
            for (unsigned j = 0; j < 32; j++)
                out[j] = gguf_q8_0_at(p, d, j);
        }
        return STRATA_OK;
    case GGUF_T_Q4_0:
        for (uint64_t b = 0; b < n / 32; b++, p += 18, out += 32) {
            const float d = gguf_half_at(p);
            for (unsigned j = 0; j < 32; j++)
                out[j] = gguf_q4_0_at(p, d, j);
        }
        return STRATA_OK;
    case GGUF_T_Q4_1:
        for (uint64_t b = 0; b < n / 32; b++, p += 20, out += 32) {
            const float d = gguf_half_at(p), m = gguf_half_at(p + 2);
            for (unsigned j = 0; j < 32; j++)
                out[j] = gguf_q4_1_at(p, d, m, j);
        }
        return STRATA_OK;
    default:
        return strata_fail(err, STRATA_EUNSUPPORTED,
                           "tensor '%s' has type %s (%u); strata loads F32, F16, BF16, Q8_0, Q4_0 and Q4_1",
                           t->name, gguf_tensor_type_name(t->type), t->type);
    }
}
