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
    char old[sizeof err->msg];
    memcpy(old, err->msg, sizeof old);
    snprintf(err->msg, sizeof err->msg, "%s: %s", prefix, old);
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
