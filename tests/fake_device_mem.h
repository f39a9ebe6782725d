/* A "device" for the device pool's tests (offload/device_pool.h): an arena of host memory written
 * with a poison byte and reached only through the pool's copy operations, which count what they
 * move and can be made to fail once. Header-only (static inline) so each test takes it. */
#ifndef STRATA_TESTS_FAKE_DEVICE_MEM_H
#define STRATA_TESTS_FAKE_DEVICE_MEM_H

#include <stdlib.h>
#include <string.h>

#include "offload/device_pool.h"

/* The "device": its arena is written with a poison byte and reached only by copies, counted. */
typedef struct fake_device {
    size_t copies_out, copies_in, bytes_out, bytes_in;
    int fail_copy_out;   /* injected: the next copy out fails */
} fake_device;

static inline void *dev_alloc(void *ctx, size_t bytes, strata_error *err)
{
    (void)ctx;
    void *p = aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (!p)
        strata_fail(err, STRATA_ENOMEM, "no memory");
    else
        memset(p, 0xA5, bytes);
    return p;
}

static inline void dev_free(void *ctx, void *p)
{
    (void)ctx;
    free(p);
}

static inline int dev_copy_out(void *ctx, void *host, const void *src, size_t n, strata_error *err)
{
    fake_device *d = ctx;
    if (d->fail_copy_out) {
        d->fail_copy_out = 0;
        return strata_fail(err, STRATA_EIO, "injected copy failure");
    }
    memcpy(host, src, n);
    d->copies_out++;
    d->bytes_out += n;
    return STRATA_OK;
}

static inline int dev_copy_in(void *ctx, void *dst, const void *host, size_t n, strata_error *err)
{
    (void)err;
    fake_device *d = ctx;
    memcpy(dst, host, n);
    d->copies_in++;
    d->bytes_in += n;
    return STRATA_OK;
}

static inline device_pool_mem fake_mem(fake_device *d)
{
    return (device_pool_mem){.name = "fake device", .alloc_arena = dev_alloc, .free_arena = dev_free,
                             .alloc_staging = dev_alloc, .free_staging = dev_free, .copy_out = dev_copy_out,
                             .copy_in = dev_copy_in, .ctx = d};
}

#endif
