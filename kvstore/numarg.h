/* One numeric command-line value, shared by every program (strata, strata-worker, the
 * coordinator's serve, the benchmarks): the whole string must be the number, in range; otherwise
 * a one-line message on stderr naming the program, the flag and the accepted range, and false. */
#ifndef STRATA_KVSTORE_NUMARG_H
#define STRATA_KVSTORE_NUMARG_H

#include <stdbool.h>
#include <stdint.h>

bool strata_parse_long(const char *prog, const char *flag, const char *s, long min, long max, long *out);
bool strata_parse_int(const char *prog, const char *flag, const char *s, int min, int max, int *out);
bool strata_parse_u64(const char *prog, const char *flag, const char *s, uint64_t *out);
/* Finite and in [min, max]. */
bool strata_parse_double(const char *prog, const char *flag, const char *s, double min, double max, double *out);
/* KV memory budgets in MiB, fractions allowed, as every program takes them (--device-kv-mib and
 * the like): from one 4 KiB page to 16 TiB (larger is a typo). */
#define STRATA_KV_MIB_MIN (4.0 / 1024)
#define STRATA_KV_MIB_MAX 16777216.0
/* mib MiB in bytes, rounded down; 0 for mib <= 0. */
uint64_t strata_mib_bytes(double mib);
/* A gRPC address: HOST:PORT (a bracketed IPv6 host included) with a port in 0..65535 for a
 * listener (0: any free port), 1..65535 to connect to; or unix:PATH. */
bool strata_check_addr(const char *prog, const char *flag, const char *s, bool listen);

#endif
