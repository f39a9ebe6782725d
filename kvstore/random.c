/* Random bytes from the kernel (random.h). */
#include "kvstore/random.h"

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/random.h>

int strata_random_bytes(void *out, size_t n, strata_error *err)
{
    uint8_t *p = out;
    size_t got = 0;
    while (got < n) {
        ssize_t r = getrandom(p + got, n - got, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return strata_fail(err, STRATA_EIO, "getrandom: %s", strerror(errno));
        got += (size_t)r;
    }
    return STRATA_OK;
}
