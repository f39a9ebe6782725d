/* kvstore/numarg.h and kvstore/hostport.h: what every program's numeric flags and TCP addresses
 * accept and refuse. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "kvstore/hostport.h"
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
    const char *bad[] = {"", "x", "12x", "1.5", " ", " 4", "\t4", "\n4", "101", "0", "99999999999999999999999"};
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
    const char *bad[] = {"-1", " -1", "\t-1", " 5", "", "18446744073709551616", "7q"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        if (strata_parse_u64("prog", "--seed", bad[i], &v))
            fail_msg("'%s' accepted", bad[i]);
}

static void test_addresses(void **state)
{
    (void)state;
    const char *good[] = {"127.0.0.1:50051", "localhost:1", "[::1]:9400", "0.0.0.0:65535", "unix:/run/s.sock"};
    for (size_t i = 0; i < sizeof good / sizeof *good; i++)
        if (!strata_check_addr("prog", "--server", good[i], false))
            fail_msg("'%s' refused", good[i]);
    assert_true(strata_check_addr("prog", "--listen", "127.0.0.1:0", true));   /* any free port */
    assert_false(strata_check_addr("prog", "--server", "127.0.0.1:0", false));
    const char *bad[] = {"", "127.0.0.1", "127.0.0.1:", "127.0.0.1:65536", "127.0.0.1:99999", ":50051",
                         "h:5005x", "h:-1", "h:+1", "h: 1", "h:000001", "unix:"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        if (strata_check_addr("prog", "--listen", bad[i], true))
            fail_msg("'%s' accepted", bad[i]);
}

static void test_split_host_port(void **state)
{
    (void)state;
    char host[16];
    int port = -1;
    assert_null(strata_split_host_port("10.0.0.2:7100", host, sizeof host, &port));
    assert_string_equal(host, "10.0.0.2");
    assert_int_equal(port, 7100);
    assert_null(strata_split_host_port("[::1]:0", host, sizeof host, &port));
    assert_string_equal(host, "::1");
    assert_int_equal(port, 0);
    assert_null(strata_split_host_port("localhost:65535", host, sizeof host, &port));
    assert_int_equal(port, 65535);
    assert_string_equal(strata_split_host_port("::1:4000", host, sizeof host, &port),
                        "expected host:port, IPv6 as [addr]:port");
    assert_string_equal(strata_split_host_port("[::1]4000", host, sizeof host, &port), "expected [v6addr]:port");
    const char *bad[] = {"localhost", "", ":80", "h:", "h:70000", "h:-1", "h:8x", "[]:80"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_non_null(strata_split_host_port(bad[i], host, sizeof host, &port));
    assert_non_null(strata_split_host_port(NULL, host, sizeof host, &port));
    assert_string_equal(strata_split_host_port("a-very-long-host-name:1", host, sizeof host, &port), "host name too long");
}

static void test_doubles(void **state)
{
    (void)state;
    double v = -1.0;
    assert_true(strata_parse_double("prog", "--f", "0.5", 0.01, 0.95, &v));
    assert_true(v == 0.5);
    assert_true(strata_parse_double("prog", "--f", "1e-2", 0.01, 0.95, &v));
    const char *bad[] = {"0", "0.96", "nan", "inf", "", "0.5x", "1e999", " 0.5", "\t0.5"};
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
        cmocka_unit_test(test_addresses),
        cmocka_unit_test(test_split_host_port),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
