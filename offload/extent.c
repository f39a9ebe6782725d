#include "offload/extent.h"

#include <stdlib.h>
#include <string.h>

int off_extents_init(off_extents *x, uint64_t total, strata_error *err)
{
    memset(x, 0, sizeof *x);
    if (total == 0)
        return strata_fail(err, STRATA_EINVAL, "extent allocator: empty range");
    x->cap = 16;
    x->v = malloc(x->cap * sizeof *x->v);
    if (!x->v)
        return strata_fail(err, STRATA_ENOMEM, "extent allocator: out of memory");
    x->v[0] = (off_extent){0, total};
    x->n = 1;
    x->total = total;
    x->free_units = total;
    return STRATA_OK;
}

void off_extents_fini(off_extents *x)
{
    free(x->v);
    memset(x, 0, sizeof *x);
}

int off_extents_alloc(off_extents *x, uint64_t len, uint64_t *start)
{
    if (len == 0 || len > x->free_units)
        return STRATA_EFULL;
    /* Reserve the entry a later free of this allocation may need (see the header). */
    size_t need = (size_t)x->live + 2;
    if (need > x->cap) {
        size_t cap = x->cap * 2 > need ? x->cap * 2 : need;
        off_extent *v = realloc(x->v, cap * sizeof *v);
        if (!v)
            return STRATA_ENOMEM;
        x->v = v;
        x->cap = cap;
    }
    for (size_t i = 0; i < x->n; i++) {
        if (x->v[i].len < len)
            continue;
        *start = x->v[i].start;
        x->v[i].start += len;
        x->v[i].len -= len;
        if (x->v[i].len == 0) {
            memmove(&x->v[i], &x->v[i + 1], (x->n - i - 1) * sizeof *x->v);
            x->n--;
        }
        x->free_units -= len;
        x->live++;
        return STRATA_OK;
    }
    return STRATA_EFULL;
}

int off_extents_free(off_extents *x, uint64_t start, uint64_t len)
{
    if (len == 0 || start >= x->total || len > x->total - start || x->live == 0)
        return STRATA_EINVAL;
    uint64_t end = start + len;
    /* i: the first free extent starting after start. */
    size_t lo = 0, hi = x->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (x->v[mid].start <= start)
            lo = mid + 1;
        else
            hi = mid;
    }
    size_t i = lo;
    int merge_prev = i > 0 && x->v[i - 1].start + x->v[i - 1].len == start;
    int merge_next = i < x->n && x->v[i].start == end;
    if ((i > 0 && x->v[i - 1].start + x->v[i - 1].len > start) || (i < x->n && x->v[i].start < end))
        return STRATA_EINVAL;  /* overlaps free space: double free or a wrong range */
    if (merge_prev && merge_next) {
        x->v[i - 1].len += len + x->v[i].len;
        memmove(&x->v[i], &x->v[i + 1], (x->n - i - 1) * sizeof *x->v);
        x->n--;
    } else if (merge_prev) {
        x->v[i - 1].len += len;
    } else if (merge_next) {
        x->v[i].start = start;
        x->v[i].len += len;
    } else {
        /* alloc reserved room for this entry; the check is defence against misuse. */
        if (x->n >= x->cap)
            return STRATA_EINVAL;
        memmove(&x->v[i + 1], &x->v[i], (x->n - i) * sizeof *x->v);
        x->v[i] = (off_extent){start, len};
        x->n++;
    }
    x->free_units += len;
    x->live--;
    return STRATA_OK;
}

uint64_t off_extents_fit(const off_extents *x, uint64_t len)
{
    uint64_t n = 0;
    for (size_t i = 0; len && i < x->n; i++)
        n += x->v[i].len / len;
    return n;
}

uint64_t off_extents_largest(const off_extents *x)
{
    uint64_t best = 0;
    for (size_t i = 0; i < x->n; i++)
        if (x->v[i].len > best)
            best = x->v[i].len;
    return best;
}
