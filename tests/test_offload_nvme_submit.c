/* The NVMe store when io_uring_submit refuses for a while (EAGAIN: the kernel could not allocate
 * a request): the requests stay in the ring and must still be submitted and complete. This test
 * interposes io_uring_submit (liburing is a shared library; dlsym(RTLD_NEXT) reaches the real
 * one) to refuse its next calls. Before the fix, a write whose submits were refused twice waited
 * for a completion of requests never submitted, for ever. And when it refuses for good (any
 * error but EAGAIN, EBUSY and EINTR): the request fails naming the error, later ones are refused,
 * nothing waits for ever (before, a wait retried such a refusal without end). The real kernel's
 * permanent refusal is met too: a ring created with IORING_SETUP_SINGLE_ISSUER answers EEXIST to
 * any other task, here a forked child. Skips without io_uring. */
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
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <liburing.h>

#include "offload/nvme_store.h"
#include "offload_blocks.h"

static int refuse_next;
static int refuse_for_good;   /* -errno every call answers, 0: none */

int io_uring_submit(struct io_uring *ring)
{
    static int (*real)(struct io_uring *);
    if (!real)
        real = (int (*)(struct io_uring *))dlsym(RTLD_NEXT, "io_uring_submit");
    if (refuse_for_good)
        return refuse_for_good;
    if (refuse_next > 0) {
        refuse_next--;
        return -EAGAIN;
    }
    return real(ring);
}

/* A store in base/s, or NULL (after skip) where the store runs without io_uring. */
static nvme_store *open_uring_store(char *base)
{
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
    return s;
}

static void test_submit_refused(void **state)
{
    (void)state;
    char base[] = "/tmp/strata-submit-XXXXXX";
    nvme_store *s = open_uring_store(base);
    strata_error err = {0};
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

static void test_submit_refused_for_good(void **state)
{
    (void)state;
    char base[] = "/tmp/strata-submit-XXXXXX";
    nvme_store *s = open_uring_store(base);
    size_t len;
    uint8_t *block = ob_make_block(KV_CODEC_KIVI, 2, 3, 64, 64, 0, 5, &len);
    assert_non_null(block);
    strata_error err = {0};
    nvme_loc kept;
    assert_int_equal(nvme_store_write(s, block, len, 1, &kept, &err), STRATA_OK);
    refuse_for_good = -EBADF;
    nvme_loc loc;
    assert_int_equal(nvme_store_write(s, block, len, 2, &loc, &err), STRATA_EIO);
    if (!strstr(err.msg, "io_uring_enter failed (Bad file descriptor)"))
        fail_msg("the failed write's message: %s", err.msg);
    refuse_for_good = 0;
    /* The ring is not trusted again: later requests are refused at once, naming why. */
    uint8_t *back = malloc(len);
    assert_non_null(back);
    assert_int_equal(nvme_store_read(s, &kept, back, len, 1, &err), STRATA_EIO);
    if (!strstr(err.msg, "refused: io_uring_enter failed"))
        fail_msg("a read after the failure: %s", err.msg);
    nvme_completion c;
    assert_int_equal(nvme_store_wait(s, &c, 1), 0);
    nvme_store_stats st;
    nvme_store_get_stats(s, &st);
    assert_int_equal(st.blocks_stored, 1);
    assert_int_equal(st.free_bytes + ((len + NVME_PAGE - 1) / NVME_PAGE) * NVME_PAGE, st.capacity_bytes);
    nvme_store_destroy(s);
    free(back);
    free(block);
    rmdir(base);
}

/* A forked child submits on the parent's ring: the kernel answers EEXIST when the ring is single
 * issuer. The child must see its write fail (not hang: alarm) and exits; the parent's store is
 * left alone (its ring state in the child's memory is the child's copy). */
static void test_other_task_refused_by_the_kernel(void **state)
{
    (void)state;
    char base[] = "/tmp/strata-submit-XXXXXX";
    nvme_store *s = open_uring_store(base);
    size_t len;
    uint8_t *block = ob_make_block(KV_CODEC_KIVI, 2, 3, 64, 64, 0, 6, &len);
    assert_non_null(block);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        alarm(30);
        strata_error err = {0};
        nvme_loc loc;
        int rc = nvme_store_write(s, block, len, 3, &loc, &err);
        if (rc == STRATA_OK)
            _exit(3);   /* the kernel took it: no single-issuer ring here */
        if (rc == STRATA_EIO && strstr(err.msg, "io_uring_enter failed (File exists)"))
            _exit(0);
        fprintf(stderr, "child: rc %d: %s\n", rc, err.msg);
        _exit(1);
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    if (WIFSIGNALED(status))
        fail_msg("the child's write did not return (signal %d)", WTERMSIG(status));
    assert_true(WIFEXITED(status));
    nvme_store_destroy(s);
    free(block);
    rmdir(base);
    if (WEXITSTATUS(status) == 3)
        skip();
    assert_int_equal(WEXITSTATUS(status), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_submit_refused),
        cmocka_unit_test(test_submit_refused_for_good),
        cmocka_unit_test(test_other_task_refused_by_the_kernel),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
