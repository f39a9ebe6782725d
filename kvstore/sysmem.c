/* strata_memory_limit (sysmem.h). */
#include "kvstore/sysmem.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* A cgroup limit file's value: a byte count, or "max" / absent for none (SIZE_MAX). */
static size_t read_limit(const char *path)
{
    FILE *f = fopen(path, "re");
    if (!f)
        return SIZE_MAX;
    char line[64];
    size_t v = SIZE_MAX;
    if (fgets(line, sizeof line, f)) {
        char *end;
        unsigned long long n = strtoull(line, &end, 10);
        if (end != line && (*end == '\n' || *end == '\0') && n > 0 && n < SIZE_MAX)
            v = (size_t)n;
    }
    fclose(f);
    return v;
}

/* The limit of this process's own cgroup: /proc/self/cgroup names it ("0::/path" in v2,
 * "N:...memory...:/path" in v1); a container usually sees its own cgroup as "/". */
static size_t cgroup_limit(void)
{
    FILE *f = fopen("/proc/self/cgroup", "re");
    if (!f)
        return SIZE_MAX;
    size_t best = SIZE_MAX;
    char line[4096], path[4200];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2)
            continue;
        const char *ctrl = c1 + 1, *where = c2 + 1;
        size_t ctrl_len = (size_t)(c2 - ctrl), v = SIZE_MAX;
        if (ctrl_len == 0) {
            snprintf(path, sizeof path, "/sys/fs/cgroup%s/memory.max", strcmp(where, "/") ? where : "");
            v = read_limit(path);
        } else if (memmem(ctrl, ctrl_len, "memory", 6)) {
            snprintf(path, sizeof path, "/sys/fs/cgroup/memory%s/memory.limit_in_bytes", strcmp(where, "/") ? where : "");
            v = read_limit(path);
        }
        best = v < best ? v : best;
    }
    fclose(f);
    return best;
}

static size_t physical_memory(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 && (unsigned long)pages <= SIZE_MAX / (unsigned long)page
               ? (size_t)pages * (size_t)page
               : SIZE_MAX;
}

size_t strata_memory_limit(void)
{
    size_t phys = physical_memory(), cg = cgroup_limit();
    return cg < phys ? cg : phys;
}

int strata_check_memory(const char *what, size_t bytes, strata_error *err)
{
    size_t phys = physical_memory(), cg = cgroup_limit(), limit = cg < phys ? cg : phys;
    if (bytes <= limit)
        return STRATA_OK;
    return strata_fail(err, STRATA_EINVAL, "%s: %.1f MiB is more than this machine lets the process have (%.1f MiB%s)",
                       what, (double)bytes / 1048576.0, (double)limit / 1048576.0,
                       cg < phys ? ", its cgroup's memory limit" : " of physical memory");
}
