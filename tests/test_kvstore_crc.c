/* CRC32C: published check values, chaining, and the hardware path against a bit-at-a-time
 * reference written here from the definition. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kvstore/crc32c.h"
#include "kvstore/crc32c_math.h"
#include "test_rng.h"

/* Straight from the definition: reflected register, polynomial 0x82F63B78, init/xorout ~0. */
static uint32_t crc_bitwise(const uint8_t *p, size_t n)
{
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int b = 0; b < 8; b++)
            c = (c & 1u) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
    }
    return ~c;
}

static void test_check_value(void **state)
{
    (void)state;
    const char *s = "123456789";
    assert_int_equal(kv_crc32c(0, s, 9), 0xe3069283u);
    assert_int_equal(kv_crc32c_sw(0, s, 9), 0xe3069283u);
    assert_int_equal(crc_bitwise((const uint8_t *)s, 9), 0xe3069283u);
    assert_int_equal(kv_crc32c(0, s, 0), 0u);
}

/* RFC 3720 (iSCSI) appendix B.4 test vectors. */
static void test_rfc3720_vectors(void **state)
{
    (void)state;
    uint8_t buf[32];
    memset(buf, 0, sizeof buf);
    assert_int_equal(kv_crc32c(0, buf, 32), 0x8a9136aau);
    memset(buf, 0xff, sizeof buf);
    assert_int_equal(kv_crc32c(0, buf, 32), 0x62a8ab43u);
    for (int i = 0; i < 32; i++)
        buf[i] = (uint8_t)i;
    assert_int_equal(kv_crc32c(0, buf, 32), 0x46dd794eu);
    assert_int_equal(kv_crc32c_sw(0, buf, 32), 0x46dd794eu);
    for (int i = 0; i < 32; i++)
        buf[i] = (uint8_t)(31 - i);
    assert_int_equal(kv_crc32c(0, buf, 32), 0x113fdb5cu);
}

static void test_paths_agree_and_chain(void **state)
{
    (void)state;
    uint8_t buf[1100];
    uint64_t s = 42;
    for (size_t i = 0; i < sizeof buf; i++)
        buf[i] = (uint8_t)rng_next(&s);
    for (size_t off = 0; off < 9; off++)
        for (size_t n = 0; n + off <= sizeof buf; n += 1 + n / 16) {
            uint32_t want = crc_bitwise(buf + off, n);
            assert_int_equal(kv_crc32c(0, buf + off, n), want);
            assert_int_equal(kv_crc32c_sw(0, buf + off, n), want);
            size_t cut = n ? (size_t)(rng_next(&s) % (n + 1)) : 0;
            assert_int_equal(kv_crc32c(kv_crc32c(0, buf + off, cut), buf + off + cut, n - cut), want);
            assert_int_equal(kv_crc32c_sw(kv_crc32c(0, buf + off, cut), buf + off + cut, n - cut), want);
        }
}

/* A 100000-byte random buffer (plus 15 bytes of slack for the alignments), freed by the caller. */
#define BIG_N 100000u
static uint8_t *big_buffer(uint64_t seed)
{
    uint8_t *buf = malloc(BIG_N + 16);
    assert_non_null(buf);
    for (size_t i = 0; i < BIG_N + 16; i++)
        buf[i] = (uint8_t)rng_next(&seed);
    return buf;
}

/* The fast path (three interleaved streams of 8192 or 256 bytes for long inputs, then a single
 * stream) against the table and the bitwise reference: random lengths 0..100000 at every
 * alignment 0..15, plus lengths at and around the block sizes 768 and 24576 and their multiples. */
static void test_fast_path_random_lengths(void **state)
{
    (void)state;
    uint8_t *buf = big_buffer(7);
    uint64_t s = 1234;
    size_t lens[160];
    size_t nlens = 0;
    const size_t edges[] = {0, 1, 7, 8, 9, 767, 768, 769, 774, 775, 776, 1536, 1543, 1544,
                            24575, 24576, 24577, 24583, 24584, 25344, 25351, 49152, 49159,
                            49920, 73727, 73728, 73735, 98304, 99840, 99999, 100000};
    for (size_t i = 0; i < sizeof edges / sizeof edges[0]; i++)
        lens[nlens++] = edges[i];
    while (nlens < sizeof lens / sizeof lens[0])
        lens[nlens++] = (size_t)(rng_next(&s) % (BIG_N + 1));
    for (size_t i = 0; i < nlens; i++) {
        size_t n = lens[i];
        for (size_t off = 0; off < 16; off++) {
            uint32_t want = kv_crc32c_sw(0, buf + off, n);
            /* the bitwise reference is slow: use it for the edges and a share of the rest */
            if (i < sizeof edges / sizeof edges[0] || (i + off) % 8 == 0)
                assert_int_equal(crc_bitwise(buf + off, n), want);
            assert_int_equal(kv_crc32c(0, buf + off, n), want);
        }
    }
    free(buf);
}

/* Chaining through the fast path: split at random points into two and into several pieces,
 * starting from every alignment, and continue from a nonzero CRC. */
static void test_fast_path_chained(void **state)
{
    (void)state;
    uint8_t *buf = big_buffer(99);
    uint64_t s = 5678;
    for (int iter = 0; iter < 200; iter++) {
        size_t off = (size_t)iter % 16;
        size_t n = (size_t)(rng_next(&s) % (BIG_N + 1));
        uint32_t want = kv_crc32c_sw(0, buf + off, n);
        size_t cut = (size_t)(rng_next(&s) % (n + 1));
        assert_int_equal(kv_crc32c(kv_crc32c(0, buf + off, cut), buf + off + cut, n - cut), want);
        uint32_t c = 0;
        size_t done = 0;
        while (done < n) {
            size_t left = n - done;
            size_t piece = (size_t)(rng_next(&s) % (left + 1));
            if (iter % 2 && piece > 2000)   /* half the runs: many short pieces */
                piece = piece % 2000;
            c = kv_crc32c(c, buf + off + done, piece);
            done += piece;
        }
        assert_int_equal(c, want);
        assert_int_equal(kv_crc32c_sw(kv_crc32c(0, buf + off, cut), buf + off + cut, n - cut), want);
    }
    /* a long run after a nonzero CRC: "123456789" then 100000 bytes */
    uint8_t *cat = malloc(9 + BIG_N);
    assert_non_null(cat);
    memcpy(cat, "123456789", 9);
    memcpy(cat + 9, buf, BIG_N);
    uint32_t c9 = kv_crc32c(0, "123456789", 9);
    assert_int_equal(c9, 0xe3069283u);
    assert_int_equal(kv_crc32c(c9, buf, BIG_N), crc_bitwise(cat, 9 + BIG_N));
    assert_int_equal(kv_crc32c(0, cat, 9 + BIG_N), crc_bitwise(cat, 9 + BIG_N));
    free(cat);
    free(buf);
}

/* Long constant buffers (all zero, all 0xff) through the fast path. */
static void test_fast_path_constant_buffers(void **state)
{
    (void)state;
    uint8_t *buf = malloc(BIG_N);
    assert_non_null(buf);
    for (int v = 0; v < 2; v++) {
        memset(buf, v ? 0xff : 0x00, BIG_N);
        for (size_t n = 760; n <= BIG_N; n = n * 3 / 2 + 1)
            assert_int_equal(kv_crc32c(0, buf, n), crc_bitwise(buf, n));
    }
    free(buf);
}

/* Joining CRCs of pieces (what the CUDA encoder does with one piece per thread) equals the CRC of
 * the whole, for random splits including empty pieces, and the table entries computed from the
 * polynomial equal the ones the CPU path uses (checked through whole-buffer CRCs). */
static void test_combine_pieces(void **state)
{
    (void)state;
    uint8_t *buf = big_buffer(99);
    uint64_t seed = 7;
    for (int trial = 0; trial < 300; trial++) {
        const size_t n = (size_t)(rng_next(&seed) % 70000);
        const size_t cut = n ? (size_t)(rng_next(&seed) % (n + 1)) : 0;
        const uint32_t whole = kv_crc32c(0, buf, n);
        const uint32_t a = kv_crc32c(0, buf, cut), b = kv_crc32c(0, buf + cut, n - cut);
        assert_int_equal(kv_crc32c_combine(a, b, n - cut), whole);
        assert_int_equal(crc_bitwise(buf, n), whole);
        /* Equal pieces joined with one shift operator, as the GPU does. */
        const size_t pieces = 1 + (size_t)(rng_next(&seed) % 200), len = (n + pieces - 1) / pieces;
        uint32_t joined = 0;
        for (size_t p = 0, at = 0; p < pieces; p++, at += len) {
            const size_t this_len = at >= n ? 0 : (n - at < len ? n - at : len);
            const uint32_t c = kv_crc32c(0, buf + (at < n ? at : n), this_len);
            joined = p == 0 ? c : kv_crc32c_combine_op(joined, c, kv_crc32c_shift_op(this_len));
        }
        assert_int_equal(joined, whole);
    }
    for (uint32_t byte = 0; byte < 256; byte++) {
        uint8_t one = (uint8_t)byte;
        /* crc of one byte from the register ~0: ~(T[(~0 ^ byte) & 0xff] ^ (~0 >> 8)) */
        const uint32_t via_entry = ~(kv_crc32c_table_entry((0xffffffffu ^ byte) & 0xffu) ^ 0x00ffffffu);
        assert_int_equal(via_entry, kv_crc32c_sw(0, &one, 1));
    }
    free(buf);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_check_value),
        cmocka_unit_test(test_rfc3720_vectors),
        cmocka_unit_test(test_paths_agree_and_chain),
        cmocka_unit_test(test_fast_path_random_lengths),
        cmocka_unit_test(test_fast_path_chained),
        cmocka_unit_test(test_fast_path_constant_buffers),
        cmocka_unit_test(test_combine_pieces),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
