/* Numeric command-line values (numarg.h). */
#include "kvstore/numarg.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool strata_parse_long(const char *prog, const char *flag, const char *s, long min, long max, long *out)
{
    char *end;
    errno = 0;
    const long v = strtol(s, &end, 10);
    /* strtol skips leading blanks: " 4" would pass for a number a script quoted by mistake */
    if (errno || end == s || *end != '\0' || isspace((unsigned char)s[0]) || v < min || v > max) {
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
    /* strtoull skips blanks and wraps a minus sign around: " -1" would be 2^64 - 1 */
    if (errno || end == s || *end != '\0' || s[0] == '-' || isspace((unsigned char)s[0])) {
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
    if (errno || end == s || *end != '\0' || isspace((unsigned char)s[0]) || !isfinite(v) || v < min || v > max) {
        fprintf(stderr, "%s: %s: '%s' is not a number in [%.10g, %.10g]\n", prog, flag, s, min, max);
        return false;
    }
    *out = v;
    return true;
}

uint64_t strata_mib_bytes(double mib)
{
    return mib > 0 ? (uint64_t)(mib * 1048576.0) : 0;
}

bool strata_check_addr(const char *prog, const char *flag, const char *s, bool listen)
{
    if (!strncmp(s, "unix:", 5) && s[5])
        return true;
    const char *colon = strrchr(s, ':');
    const char *port = colon ? colon + 1 : "";
    size_t digits = strspn(port, "0123456789");
    const long min = listen ? 0 : 1;
    long v = digits && digits <= 5 && !port[digits] ? strtol(port, NULL, 10) : -1;
    if (!colon || colon == s || v < min || v > 65535) {
        fprintf(stderr, "%s: %s: '%s' is not HOST:PORT with a port in %ld..65535 (e.g. 127.0.0.1:50051%s)\n", prog,
                flag, s, min, listen ? "; port 0: any free port" : "");
        return false;
    }
    return true;
}
