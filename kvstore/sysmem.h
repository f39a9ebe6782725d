/* How much memory this process can have: a memory budget larger than that is refused up front
 * with a message, instead of being granted by the kernel's overcommit and ending in the OOM
 * killer once the cache fills. */
#ifndef STRATA_KVSTORE_SYSMEM_H
#define STRATA_KVSTORE_SYSMEM_H

#include <stddef.h>

#include "kvstore/error.h"

/* The machine's physical memory, or less under a cgroup memory limit (v2 memory.max, v1
 * memory.limit_in_bytes, of this process's cgroup); SIZE_MAX when neither can be read. */
size_t strata_memory_limit(void);

/* STRATA_OK when `bytes` of memory for `what` (e.g. "the host KV tier") are within
 * strata_memory_limit(); else STRATA_EINVAL with a message giving both in MiB. */
int strata_check_memory(const char *what, size_t bytes, strata_error *err);

#endif
