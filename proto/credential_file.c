#include "proto/credential_file.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int credential_file_read(const char *path, size_t max, bool trim, char **out, size_t *len, strata_error *err)
{
    *out = NULL;
    *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f)
        return strata_fail(err, STRATA_EIO, "%s", strerror(errno));
    char *buf = malloc(max + 1);
    if (!buf) {
        fclose(f);
        return strata_fail(err, STRATA_ENOMEM, "out of memory for %zu bytes", max + 1);
    }
    size_t n = fread(buf, 1, max, f);
    const int read_errno = ferror(f) ? (errno ? errno : EIO) : 0;   /* EISDIR for a folder */
    const bool more = !read_errno && fgetc(f) != EOF;
    fclose(f);
    if (read_errno || more) {
        explicit_bzero(buf, max + 1);   /* part of a secret */
        free(buf);
        return read_errno ? strata_fail(err, STRATA_EIO, "%s", strerror(read_errno))
                          : strata_fail(err, STRATA_EINVAL, "larger than %zu bytes", max);
    }
    while (trim && n && (buf[n - 1] == '\n' || buf[n - 1] == '\r'))
        n--;
    buf[n] = '\0';
    *out = buf;
    *len = n;
    return STRATA_OK;
}
