/* CRC32C: published check values, chaining, and the hardware path against a bit-at-a-time
 * reference written here from the definition. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "kvstore/crc32c.h"

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

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_check_value),
        cmocka_unit_test(test_rfc3720_vectors),
        cmocka_unit_test(test_paths_agree_and_chain),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
