/* Numeric command-line values (numarg.h). */
#include "kvstore/numarg.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

bool strata_parse_long(const char *prog, const char *flag, const char *s, long min, long max, long *out)
{
    char *end;
    errno = 0;
    const long v = strtol(s, &end, 10);
    if (errno || end == s || *end != '\0' || v < min || v > max) {
        fprintf(stderr, "%s: %s: '%s' is not an integer in [%ld, %ld]\n", prog, flag, s, min, max);
        return false;
    }
    *out = v;
    return true;
}

bool strata_parse_int(const char *prog, const char *flag, const char *s, int min, int max, int *out)
{
    long v;
    if (!strata_parse_long(prog, flag, s, min, max, &v))
        return false;
    *out = (int)v;
    return true;
}

bool strata_parse_u64(const char *prog, const char *flag, const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    const unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end != '\0' || s[0] == '-') {
        fprintf(stderr, "%s: %s: '%s' is not a non-negative integer\n", prog, flag, s);
        return false;
    }
    *out = (uint64_t)v;
    return true;
}

bool strata_parse_double(const char *prog, const char *flag, const char *s, double min, double max, double *out)
{
    char *end;
    errno = 0;
    const double v = strtod(s, &end);
    if (errno || end == s || *end != '\0' || !isfinite(v) || v < min || v > max) {
        fprintf(stderr, "%s: %s: '%s' is not a number in [%g, %g]\n", prog, flag, s, min, max);
        return false;
    }
    *out = v;
    return true;
}
