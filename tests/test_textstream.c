/* Incremental output text (worker/textstream.h): stop strings split across tokens, held-back
 * prefixes released at the end, the earliest of several stops, and UTF-8 mode: characters split
 * across tokens come out whole, invalid bytes as U+FFFD, and every output is valid UTF-8
 * (checked by an independent decoder over random byte tokens). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "worker/textstream.h"

/* Pushes tokens, collecting everything taken; returns whether a stop matched. */
static bool run(text_stream *ts, const char *const *tokens, size_t n, char *out, size_t cap)
{
    size_t used = 0;
    bool stopped = false;
    for (size_t i = 0; i < n && !stopped; i++) {
        assert_int_equal(text_stream_push(ts, tokens[i], strlen(tokens[i]), NULL), STRATA_OK);
        const char *t;
        size_t len;
        text_stream_take(ts, &t, &len, &stopped);
        assert_true(used + len < cap);
        memcpy(out + used, t, len);
        used += len;
    }
    if (!stopped) {
        const char *t;
        size_t len;
        text_stream_finish(ts, &t, &len);
        memcpy(out + used, t, len);
        used += len;
    }
    out[used] = '\0';
    return stopped;
}

static void test_stop_split_across_tokens(void **state)
{
    (void)state;
    const char *stop[] = {"END"};
    const char *tokens[] = {"Hello E", "N", "D world"};
    text_stream ts;
    text_stream_init(&ts, stop, 1, false);
    char out[64];
    assert_true(run(&ts, tokens, 3, out, sizeof out));
    assert_string_equal(out, "Hello ");
    text_stream_free(&ts);
}

static void test_held_prefix_released(void **state)
{
    (void)state;
    const char *stop[] = {"STOP"};
    const char *tokens[] = {"a ST", "x", " b S"};
    text_stream ts;
    text_stream_init(&ts, stop, 1, false);
    char out[64];
    /* "ST" waits until "x" shows it is not STOP; the final "S" is released by finish */
    const char *t;
    size_t len;
    bool stopped;
    assert_int_equal(text_stream_push(&ts, tokens[0], strlen(tokens[0]), NULL), STRATA_OK);
    text_stream_take(&ts, &t, &len, &stopped);
    assert_int_equal(len, 2);
    assert_memory_equal(t, "a ", 2);
    text_stream_free(&ts);
    text_stream_init(&ts, stop, 1, false);
    assert_false(run(&ts, tokens, 3, out, sizeof out));
    assert_string_equal(out, "a STx b S");
    text_stream_free(&ts);
}

static void test_earliest_of_several_stops(void **state)
{
    (void)state;
    const char *stop[] = {"world", "lo w", "\n\n"};
    const char *tokens[] = {"hel", "lo wor", "ld\n\n"};
    text_stream ts;
    text_stream_init(&ts, stop, 3, false);
    char out[64];
    assert_true(run(&ts, tokens, 3, out, sizeof out));
    assert_string_equal(out, "hel");
    text_stream_free(&ts);
}

static void test_utf8_split_and_invalid(void **state)
{
    (void)state;
    text_stream ts;
    char out[64];
    /* "é" (C3 A9) split across tokens, then "€" (E2 82 AC) split in three */
    const char *split[] = {"caf\xC3", "\xA9 \xE2", "\x82", "\xAC!"};
    text_stream_init(&ts, NULL, 0, true);
    const char *t;
    size_t len;
    bool stopped;
    assert_int_equal(text_stream_push(&ts, split[0], strlen(split[0]), NULL), STRATA_OK);
    text_stream_take(&ts, &t, &len, &stopped);
    assert_int_equal(len, 3);   /* "caf": the lead byte waits */
    text_stream_free(&ts);
    text_stream_init(&ts, NULL, 0, true);
    assert_false(run(&ts, split, 4, out, sizeof out));
    assert_string_equal(out, "caf\xC3\xA9 \xE2\x82\xAC!");
    text_stream_free(&ts);
    /* a stray continuation byte, an overlong lead, a surrogate, a broken character, a lead at the end */
    const char *bad[] = {"a\x80", "b\xC0\xAF", "\xED\xA0\x80", "\xE2\x82\x63" /* then c */, "\xF0"};
    text_stream_init(&ts, NULL, 0, true);
    assert_false(run(&ts, bad, 5, out, sizeof out));
    assert_string_equal(out, "a\xEF\xBF\xBD" "b\xEF\xBF\xBD\xEF\xBF\xBD" "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"
                             "\xEF\xBF\xBD" "c" "\xEF\xBF\xBD");
    text_stream_free(&ts);
    /* byte mode passes bytes through */
    text_stream_init(&ts, NULL, 0, false);
    assert_false(run(&ts, bad, 5, out, sizeof out));
    assert_string_equal(out, "a\x80" "b\xC0\xAF\xED\xA0\x80\xE2\x82" "c\xF0");
    text_stream_free(&ts);
}

/* An independent strict UTF-8 check (RFC 3629 table). */
static bool valid_utf8(const unsigned char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        size_t k;
        uint32_t cp, min;
        if (c < 0x80) { i++; continue; }
        else if ((c & 0xE0) == 0xC0) { k = 1; cp = c & 0x1F; min = 0x80; }
        else if ((c & 0xF0) == 0xE0) { k = 2; cp = c & 0x0F; min = 0x800; }
        else if ((c & 0xF8) == 0xF0) { k = 3; cp = c & 0x07; min = 0x10000; }
        else return false;
        for (size_t j = 1; j <= k; j++) {
            if (i + j >= n || (s[i + j] & 0xC0) != 0x80)
                return false;
            cp = cp << 6 | (s[i + j] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return false;
        i += k + 1;
    }
    return true;
}

static void test_random_tokens_always_valid(void **state)
{
    (void)state;
    uint64_t x = 99;
    const char *stop[] = {"\xC3\xA9z", "qq"};
    for (int trial = 0; trial < 2000; trial++) {
        text_stream ts;
        text_stream_init(&ts, stop, 2, true);
        char all[4096];
        size_t used = 0;
        bool stopped = false;
        for (int tok = 0; tok < 20 && !stopped; tok++) {
            char b[4];
            size_t n = 1 + (x >> 60) % 4;
            for (size_t i = 0; i < n; i++) {
                x = x * 6364136223846793005ull + 1442695040888963407ull;
                static const unsigned char pool[] = {'a', 'q', 'z', 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98,
                                                     0x80, 0xED, 0xA0, 0xC0, 0xFF, 0xF4, 0x90};
                b[i] = (char)pool[(x >> 33) % sizeof pool];
            }
            assert_int_equal(text_stream_push(&ts, b, n, NULL), STRATA_OK);
            const char *t;
            size_t len;
            text_stream_take(&ts, &t, &len, &stopped);
            memcpy(all + used, t, len);
            used += len;
        }
        if (!stopped) {
            const char *t;
            size_t len;
            text_stream_finish(&ts, &t, &len);
            memcpy(all + used, t, len);
            used += len;
        }
        if (!valid_utf8((const unsigned char *)all, used))
            fail_msg("trial %d: output is not valid UTF-8", trial);
        all[used] = '\0';
        if (stopped)
            assert_null(strstr(all, "qq"));
        text_stream_free(&ts);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stop_split_across_tokens),
        cmocka_unit_test(test_held_prefix_released),
        cmocka_unit_test(test_earliest_of_several_stops),
        cmocka_unit_test(test_utf8_split_and_invalid),
        cmocka_unit_test(test_random_tokens_always_valid),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
