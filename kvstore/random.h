/* Random bytes from the kernel (getrandom), for secrets and nonces: the one place that loops over
 * short reads and EINTR. */
#ifndef STRATA_KVSTORE_RANDOM_H
#define STRATA_KVSTORE_RANDOM_H

#include <stddef.h>

#include "kvstore/error.h"

/* Fills out with n random bytes. STRATA_EIO ("getrandom: ...") when the kernel refuses. */
int strata_random_bytes(void *out, size_t n, strata_error *err);

#endif
