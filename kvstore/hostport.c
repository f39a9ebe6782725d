#include "kvstore/hostport.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

const char *strata_split_host_port(const char *hp, char *host, size_t hcap, int *port)
{
    if (!hp || !*hp)
        return "expected host:port";
    const char *h = hp, *colon;
    size_t hlen;
    if (hp[0] == '[') {
        const char *close = strchr(hp, ']');
        if (!close || close[1] != ':')
            return "expected [v6addr]:port";
        h = hp + 1;
        hlen = (size_t)(close - h);
        colon = close + 1;
    } else {
        colon = strrchr(hp, ':');
        if (!colon || strchr(hp, ':') != colon)
            return "expected host:port, IPv6 as [addr]:port";
        hlen = (size_t)(colon - hp);
    }
    const char *p = colon + 1;
    char *end = NULL;
    errno = 0;
    long v = strtol(p, &end, 10);
    if (hlen == 0 || !*p || *end || errno || v < 0 || v > 65535)
        return "host and port 0-65535 needed";
    if (hlen >= hcap)
        return "host name too long";
    memcpy(host, h, hlen);
    host[hlen] = '\0';
    *port = (int)v;
    return NULL;
}
