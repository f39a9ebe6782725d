/* Error reporting shared by every strata module.
 *
 * Functions that can fail return an int status: STRATA_OK (0) on success, or one of the
 * positive codes below. When the caller passes a non-NULL strata_error, the failing function
 * also writes a one-line human-readable message naming the problem. Nothing aborts. */
#ifndef STRATA_KVSTORE_ERROR_H
#define STRATA_KVSTORE_ERROR_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {  /* the CUDA sources (C++) report errors through these too */
#endif

enum strata_status {
    STRATA_OK = 0,
    STRATA_EINVAL,       /* bad argument or bad user input */
    STRATA_ENOMEM,       /* allocation failed */
    STRATA_EIO,          /* a syscall or file operation failed */
    STRATA_EFORMAT,      /* malformed, truncated or inconsistent bytes (file, block, message) */
    STRATA_ECRC,         /* checksum mismatch */
    STRATA_EFULL,        /* a fixed-capacity resource (block pool, context) is exhausted */
    STRATA_EUNSUPPORTED, /* valid but not supported by this build (type, template, codec) */
};

typedef struct strata_error {
    int code;
    char msg[512];
} strata_error;

/* Records code and a printf-style message in err (if non-NULL); returns code. */
int strata_fail(strata_error *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Prefixes err->msg with context ("loading model: ..."), keeping the code. Returns err->code. */
int strata_error_prefix(strata_error *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Short name of a status code, e.g. "EFORMAT". */
const char *strata_status_name(int code);

#ifdef __cplusplus
}
#endif

#endif
