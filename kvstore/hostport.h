/* "host:port" and "[v6addr]:port", the way every TCP address strata takes is written (the data
 * plane's listen and connect addresses, the TLS probe of a gRPC port). */
#ifndef STRATA_KVSTORE_HOSTPORT_H
#define STRATA_KVSTORE_HOSTPORT_H

#include <stddef.h>

/* Splits hp into host (brackets removed, NUL-terminated, at most hcap - 1 bytes) and *port
 * (0..65535). Returns NULL, or what is wrong with hp, for a message: "expected host:port, IPv6
 * as [addr]:port", "expected [v6addr]:port", "host and port 0-65535 needed", "host name too
 * long". */
const char *strata_split_host_port(const char *hp, char *host, size_t hcap, int *port);

#endif
