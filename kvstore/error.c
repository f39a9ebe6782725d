#include "kvstore/error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

int strata_fail(strata_error *err, int code, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
        err->code = code;
    }
    return code;
}

int strata_error_prefix(strata_error *err, const char *fmt, ...)
{
    if (!err)
        return STRATA_EINVAL;
    char prefix[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    /* Shift the old message right and put "prefix: " in front, truncating at the end. */
    size_t plen = strlen(prefix), olen = strnlen(err->msg, sizeof err->msg - 1);
    if (plen + 2 >= sizeof err->msg)
        plen = sizeof err->msg - 3;
    size_t keep = olen < sizeof err->msg - plen - 3 ? olen : sizeof err->msg - plen - 3;
    memmove(err->msg + plen + 2, err->msg, keep);
    memcpy(err->msg, prefix, plen);
    err->msg[plen] = ':';
    err->msg[plen + 1] = ' ';
    err->msg[plen + 2 + keep] = '\0';
    return err->code;
}

const char *strata_status_name(int code)
{
    switch (code) {
    case STRATA_OK: return "OK";
    case STRATA_EINVAL: return "EINVAL";
    case STRATA_ENOMEM: return "ENOMEM";
    case STRATA_EIO: return "EIO";
    case STRATA_EFORMAT: return "EFORMAT";
    case STRATA_ECRC: return "ECRC";
    case STRATA_EFULL: return "EFULL";
    case STRATA_EUNSUPPORTED: return "EUNSUPPORTED";
    default: return "UNKNOWN";
    }
}
