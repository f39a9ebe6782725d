/* kvstore/numarg.h: what every program's numeric flags accept and refuse. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <cmocka.h>

#include "kvstore/numarg.h"

static void test_integers(void **state)
{
    (void)state;
    long v = -7;
    assert_true(strata_parse_long("prog", "--n", "42", 1, 100, &v));
    assert_int_equal(v, 42);
    assert_true(strata_parse_long("prog", "--n", "-3", -5, 5, &v));
    assert_int_equal(v, -3);
    assert_true(strata_parse_long("prog", "--n", "100", 1, 100, &v));   /* bounds included */
    const char *bad[] = {"", "x", "12x", "1.5", " ", "101", "0", "99999999999999999999999"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        v = -7;
        if (strata_parse_long("prog", "--n", bad[i], 1, 100, &v))
            fail_msg("'%s' accepted", bad[i]);
        assert_int_equal(v, -7);   /* untouched on failure */
    }
    int n = 0;
    assert_true(strata_parse_int("prog", "--n", "65535", 1, 65535, &n));
    assert_int_equal(n, 65535);
    assert_false(strata_parse_int("prog", "--n", "65536", 1, 65535, &n));
    assert_int_equal(n, 65535);
}

static void test_u64(void **state)
{
    (void)state;
    uint64_t v = 1;
    assert_true(strata_parse_u64("prog", "--seed", "18446744073709551615", &v));
    assert_true(v == UINT64_MAX);
    assert_true(strata_parse_u64("prog", "--seed", "0", &v));
    assert_true(v == 0);
    const char *bad[] = {"-1", "", "18446744073709551616", "7q"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        if (strata_parse_u64("prog", "--seed", bad[i], &v))
            fail_msg("'%s' accepted", bad[i]);
}

static void test_doubles(void **state)
{
    (void)state;
    double v = -1.0;
    assert_true(strata_parse_double("prog", "--f", "0.5", 0.01, 0.95, &v));
    assert_true(v == 0.5);
    assert_true(strata_parse_double("prog", "--f", "1e-2", 0.01, 0.95, &v));
    const char *bad[] = {"0", "0.96", "nan", "inf", "", "0.5x", "1e999"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        v = -1.0;
        if (strata_parse_double("prog", "--f", bad[i], 0.01, 0.95, &v))
            fail_msg("'%s' accepted", bad[i]);
        assert_true(v == -1.0);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_integers),
        cmocka_unit_test(test_u64),
        cmocka_unit_test(test_doubles),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
