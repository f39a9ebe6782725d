/* worker/cuda/uploads.h: a step's uploads through pinned staging. The bytes that land on the
 * device are the sources' at the time of the call, even when the sources are overwritten while
 * the copies wait behind other work (a large memset enqueued first; on a GPU the copies are then
 * still in flight when the host overwrites); an upload that does not fit goes synchronously and
 * the next step's buffer holds what this one wanted. Runs on a GPU and on the fake device (whose
 * asynchronous copies from pinned memory wait for the next device operation, so reusing the
 * staging within a step fails there too). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tests/cuda/cuda_test_util.h"
#include "worker/cuda/uploads.h"


enum { N_COPIES = 40, MAX_BYTES = 5000 };

#ifdef STRATA_FAKE_CUDA
static const size_t delay_bytes = (size_t)8 << 20;
#else
static const size_t delay_bytes = (size_t)1 << 30;   /* ~0.5 ms of memset on an H100 */
#endif

/* Byte sizes of copy i: odd ones and one byte among them, so the staging's alignment matters. */
static size_t copy_bytes(int i) { return i == 7 ? 1 : (size_t)(97 * i * i + 13 * i + 3) % MAX_BYTES + 1; }

static uint64_t seed = 0x5eed;

/* One step of N_COPIES uploads of fresh random bytes behind a large memset; each source is
 * overwritten right after its call. Returns the synchronous copies the step made. */
static size_t run_step(cuda_uploads *u, uint8_t *d_dst, uint8_t *d_delay)
{
    strata_error err = {0};
    assert_int_equal(cuda_uploads_begin(u, &err), STRATA_OK);
    const size_t sync_before = u->sync_copies;
    uint8_t *want = malloc((size_t)N_COPIES * MAX_BYTES), *src = malloc(MAX_BYTES), *got = malloc(MAX_BYTES);
    assert_true(want && src && got);
    CUDA_CHECK(cudaMemset(d_delay, 0x5a, delay_bytes));
    for (int i = 0; i < N_COPIES; i++) {
        for (size_t b = 0; b < copy_bytes(i); b++)
            src[b] = want[(size_t)i * MAX_BYTES + b] = (uint8_t)cuda_test_rng(&seed);
        assert_int_equal(cuda_uploads_copy(u, d_dst + (size_t)i * MAX_BYTES, src, copy_bytes(i), "test rows", &err),
                         STRATA_OK);
        memset(src, 0xee, MAX_BYTES);   /* the caller may reuse its buffer at once */
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    for (int i = 0; i < N_COPIES; i++) {
        CUDA_CHECK(cudaMemcpy(got, d_dst + (size_t)i * MAX_BYTES, copy_bytes(i), cudaMemcpyDeviceToHost));
        if (memcmp(got, want + (size_t)i * MAX_BYTES, copy_bytes(i)) != 0)
            fail_msg("upload %d (%zu bytes) landed wrong", i, copy_bytes(i));
    }
    free(want);
    free(src);
    free(got);
    return u->sync_copies - sync_before;
}

static void test_steps(void **state)
{
    (void)state;
    uint8_t *d_dst, *d_delay;
    CUDA_CHECK(cudaMalloc((void **)&d_dst, (size_t)N_COPIES * MAX_BYTES));
    CUDA_CHECK(cudaMalloc((void **)&d_delay, delay_bytes));
    cuda_uploads u = {0};
    /* No buffer yet: every upload of the first step is synchronous. */
    assert_int_equal(run_step(&u, d_dst, d_delay), N_COPIES);
    /* Sized by what the first step wanted: every upload fits, and again the step after. */
    assert_int_equal(run_step(&u, d_dst, d_delay), 0);
    assert_true(u.cap >= u.used && u.used > 0);
    assert_int_equal(run_step(&u, d_dst, d_delay), 0);
    /* An upload bigger than the buffer goes synchronously, then fits the step after. */
    strata_error err = {0};
    const size_t big = u.cap + 1;
    uint8_t *src = malloc(big), *got = malloc(big), *d_big;
    assert_true(src && got);
    CUDA_CHECK(cudaMalloc((void **)&d_big, big));
    for (int round = 0; round < 2; round++) {
        assert_int_equal(cuda_uploads_begin(&u, &err), STRATA_OK);
        const size_t sync_before = u.sync_copies;
        for (size_t b = 0; b < big; b++)
            src[b] = (uint8_t)(b * 31u + (size_t)round);
        assert_int_equal(cuda_uploads_copy(&u, d_big, src, big, "big", &err), STRATA_OK);
        CUDA_CHECK(cudaDeviceSynchronize());
        CUDA_CHECK(cudaMemcpy(got, d_big, big, cudaMemcpyDeviceToHost));
        assert_memory_equal(got, src, big);
        assert_int_equal(u.sync_copies - sync_before, round == 0 ? 1 : 0);
    }
    assert_int_equal(cuda_uploads_copy(&u, d_big, src, 0, "nothing", &err), STRATA_OK);
    cuda_uploads_free(&u);
    assert_null(u.pinned);
    cuda_uploads_free(&u);   /* freeing twice is harmless */
    free(src);
    free(got);
    CUDA_CHECK(cudaFree(d_big));
    CUDA_CHECK(cudaFree(d_dst));
    CUDA_CHECK(cudaFree(d_delay));
}

int main(void)
{
    if (!cuda_test_have_device("test_cuda_uploads"))
        return CUDA_TEST_SKIP;
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_steps)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
