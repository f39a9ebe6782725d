/* The NVMe store when io_uring_submit refuses for a while (EAGAIN: the kernel could not allocate
 * a request): the requests stay in the ring and must still be submitted and complete. This test
 * interposes io_uring_submit (liburing is a shared library; dlsym(RTLD_NEXT) reaches the real
 * one) to refuse its next calls. Before the fix, a write whose submits were refused twice waited
 * for a completion of requests never submitted, for ever. Skips without io_uring. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <liburing.h>

#include "offload/nvme_store.h"
#include "offload_blocks.h"

static int refuse_next;

int io_uring_submit(struct io_uring *ring)
{
    static int (*real)(struct io_uring *);
    if (!real)
        real = (int (*)(struct io_uring *))dlsym(RTLD_NEXT, "io_uring_submit");
    if (refuse_next > 0) {
        refuse_next--;
        return -EAGAIN;
    }
    return real(ring);
}

static void test_submit_refused(void **state)
{
    (void)state;
    char base[] = "/tmp/strata-submit-XXXXXX";
    assert_non_null(mkdtemp(base));
    char dir[64];
    snprintf(dir, sizeof dir, "%s/s", base);
    nvme_store_options o;
    nvme_store_options_init(&o, dir, 8 << 20);
    strata_error err = {0};
    nvme_store *s = nvme_store_create(&o, &err);
    if (!s)
        fail_msg("%s", err.msg);
    if (!strstr(nvme_store_describe(s), "io_uring")) {
        nvme_store_destroy(s);
        rmdir(base);
        skip();   /* the pread/pwrite fallback submits nothing */
    }
    size_t len;
    uint8_t *block = ob_make_block(KV_CODEC_KIVI, 2, 3, 64, 64, 0, 5, &len);
    assert_non_null(block);
    for (int refusals = 1; refusals <= 4; refusals++) {
        refuse_next = refusals;
        nvme_loc loc;
        if (nvme_store_write(s, block, len, (uint64_t)refusals, &loc, &err) != STRATA_OK)
            fail_msg("write after %d refused submits: %s", refusals, err.msg);
        uint8_t *back = malloc(len);
        assert_non_null(back);
        refuse_next = refusals;
        if (nvme_store_read(s, &loc, back, len, (uint64_t)refusals, &err) != STRATA_OK)
            fail_msg("read after %d refused submits: %s", refusals, err.msg);
        assert_memory_equal(back, block, len);
        free(back);
    }
    nvme_store_destroy(s);
    free(block);
    rmdir(base);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_submit_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
