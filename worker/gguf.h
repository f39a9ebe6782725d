/* GGUF (v2/v3) reader: header, metadata key/values, tensor table, and dequantization of the
 * tensor types strata loads (F32, F16, BF16, Q8_0, Q4_0, Q4_1) to fp32.
 *
 * The file is memory-mapped read-only. Every count, length and offset is bounds-checked
 * against the file size at open time; a malformed, truncated or inconsistent file fails with
 * STRATA_EFORMAT and a message naming what is wrong (never a crash). */
#ifndef STRATA_WORKER_GGUF_H
#define STRATA_WORKER_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/weight_values.h"   /* gguf_tensor_type and the block formats */
#include "kvstore/error.h"

typedef enum gguf_value_type {
    GGUF_UINT8 = 0, GGUF_INT8 = 1, GGUF_UINT16 = 2, GGUF_INT16 = 3, GGUF_UINT32 = 4,
    GGUF_INT32 = 5, GGUF_FLOAT32 = 6, GGUF_BOOL = 7, GGUF_STRING = 8, GGUF_ARRAY = 9,
    GGUF_UINT64 = 10, GGUF_INT64 = 11, GGUF_FLOAT64 = 12,
} gguf_value_type;


typedef struct gguf_file gguf_file;

/* A string inside the file: not NUL-terminated. */
typedef struct gguf_str {
    const char *ptr;
    size_t len;
} gguf_str;

typedef struct gguf_array {
    gguf_value_type elem_type;
    uint64_t n;
    const uint8_t *data;   /* raw little-endian elements (not for strings: use gguf_array_str) */
    const void *priv;      /* reader bookkeeping */
} gguf_array;

typedef struct gguf_tensor {
    const char *name;      /* NUL-terminated copy */
    int n_dims;
    uint64_t ne[4];        /* ne[0] is the innermost (contiguous) dimension */
    uint32_t type;         /* gguf_tensor_type */
    uint64_t n_elements;
    const void *data;      /* into the mapping */
    size_t nbytes;
} gguf_tensor;

gguf_file *gguf_open(const char *path, strata_error *err);
/* Parses an in-memory image (copied; used by the fuzz target and tests). */
gguf_file *gguf_open_memory(const void *data, size_t size, strata_error *err);
void gguf_close(gguf_file *f);

uint32_t gguf_version(const gguf_file *f);
size_t gguf_n_tensors(const gguf_file *f);
const gguf_tensor *gguf_tensor_at(const gguf_file *f, size_t i);
const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name);
size_t gguf_n_kv(const gguf_file *f);
/* Key of the i-th metadata entry and its type. */
gguf_str gguf_kv_key(const gguf_file *f, size_t i);
gguf_value_type gguf_kv_type(const gguf_file *f, size_t i);

bool gguf_has_key(const gguf_file *f, const char *key);
/* Typed getters: fail with STRATA_EINVAL ("missing key ...") or STRATA_EFORMAT (wrong type or
 * out of range). Integer getters accept any integer type whose value fits. */
int gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out, strata_error *err);
int gguf_get_f32(const gguf_file *f, const char *key, float *out, strata_error *err);
int gguf_get_bool(const gguf_file *f, const char *key, bool *out, strata_error *err);
int gguf_get_str(const gguf_file *f, const char *key, gguf_str *out, strata_error *err);
int gguf_get_array(const gguf_file *f, const char *key, gguf_array *out, strata_error *err);
/* i-th string of a string array (bounds-checked: returns an empty string past the end). */
gguf_str gguf_array_str(const gguf_array *a, uint64_t i);
/* i-th element of an integer array as int64 (0 past the end or for non-integer arrays). */
int64_t gguf_array_int(const gguf_array *a, uint64_t i);

const char *gguf_tensor_type_name(uint32_t type);
/* Dequantizes the whole tensor into out (n_elements floats). STRATA_EUNSUPPORTED for types
 * outside the supported set. */
int gguf_tensor_to_f32(const gguf_tensor *t, float *out, strata_error *err);

#endif
