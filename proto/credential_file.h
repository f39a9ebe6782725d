/* Small credential files read whole, one way for every program: the cluster secret (coordinator
 * and workers), the public API's bearer token (server and clients) and TLS PEM files. */
#ifndef STRATA_PROTO_CREDENTIAL_FILE_H
#define STRATA_PROTO_CREDENTIAL_FILE_H

#include <stdbool.h>
#include <stddef.h>

#include "kvstore/error.h"

/* Reads path whole: at most max bytes (a longer file is an error, never cut); with trim, trailing
 * CR and LF bytes are dropped (a secret written by `echo` and one written by printf are the same
 * secret). *out is malloc'd and NUL-terminated, *len the bytes before the NUL (may be 0: callers
 * decide whether empty is allowed). The path is opened as given, so a FIFO from process
 * substitution works. Errors: STRATA_EIO with the system's reason ("No such file or directory",
 * "Is a directory"), STRATA_EINVAL "larger than N bytes", STRATA_ENOMEM. The message leaves the
 * path out: callers name the option and the path. A buffer given up on is wiped first; callers
 * wipe theirs when done with the secret. */
int credential_file_read(const char *path, size_t max, bool trim, char **out, size_t *len, strata_error *err);

#endif
