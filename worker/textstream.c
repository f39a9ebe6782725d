/* Incremental output text with stop strings and UTF-8 boundaries (textstream.h). */
#include "worker/textstream.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static const char replacement[3] = {(char)0xEF, (char)0xBF, (char)0xBD};   /* U+FFFD */

void text_stream_init(text_stream *ts, const char *const *stop, size_t n_stop, bool utf8)
{
    memset(ts, 0, sizeof *ts);
    ts->stop = stop;
    ts->n_stop = stop ? n_stop : 0;
    ts->utf8 = utf8;
}

void text_stream_free(text_stream *ts)
{
    free(ts->buf);
    memset(ts, 0, sizeof *ts);
}

static int append(text_stream *ts, const char *s, size_t n, strata_error *err)
{
    if (ts->len + n + 1 > ts->cap) {
        size_t cap = ts->cap ? ts->cap * 2 : 256;
        while (cap < ts->len + n + 1)
            cap *= 2;
        char *grown = realloc(ts->buf, cap);
        if (!grown)
            return strata_fail(err, STRATA_ENOMEM, "out of memory for generated text");
        ts->buf = grown;
        ts->cap = cap;
    }
    memcpy(ts->buf + ts->len, s, n);
    ts->len += n;
    ts->buf[ts->len] = '\0';
    return STRATA_OK;
}

/* Length of the character a lead byte starts (0: not a lead byte). */
static size_t utf8_length(unsigned char c)
{
    if (c < 0x80)
        return 1;
    if (c >= 0xC2 && c <= 0xDF)
        return 2;
    if (c >= 0xE0 && c <= 0xEF)
        return 3;
    if (c >= 0xF0 && c <= 0xF4)
        return 4;
    return 0;
}

/* Whether byte c may follow the bytes in p[0..n) (n >= 1) of a character (the second byte's
 * range excludes overlongs, surrogates and code points above U+10FFFF). */
static bool utf8_continues(const unsigned char *p, size_t n, unsigned char c)
{
    if ((c & 0xC0) != 0x80)
        return false;
    if (n != 1)
        return true;
    switch (p[0]) {
    case 0xE0: return c >= 0xA0;
    case 0xED: return c <= 0x9F;
    case 0xF0: return c >= 0x90;
    case 0xF4: return c <= 0x8F;
    default: return true;
    }
}

static int push_utf8(text_stream *ts, const unsigned char *s, size_t n, strata_error *err)
{
    int rc = STRATA_OK;
    for (size_t i = 0; i < n && rc == STRATA_OK; i++) {
        unsigned char c = s[i];
        if (ts->n_pending) {
            if (utf8_continues(ts->pending, ts->n_pending, c)) {
                ts->pending[ts->n_pending++] = c;
                if (ts->n_pending == utf8_length(ts->pending[0])) {
                    rc = append(ts, (const char *)ts->pending, ts->n_pending, err);
                    ts->n_pending = 0;
                }
                continue;
            }
            /* The character broke off: it becomes U+FFFD and c starts afresh. */
            rc = append(ts, replacement, sizeof replacement, err);
            ts->n_pending = 0;
            if (rc != STRATA_OK)
                break;
        }
        size_t want = utf8_length(c);
        if (want == 1)
            rc = append(ts, (const char *)&c, 1, err);
        else if (want == 0)
            rc = append(ts, replacement, sizeof replacement, err);
        else
            ts->pending[ts->n_pending++] = c;
    }
    return rc;
}

/* The earliest match of a stop string at or after `emitted`, or SIZE_MAX. (Text before emitted
 * cannot start a match: a possible start is always held back.) */
static size_t find_stop(const text_stream *ts)
{
    size_t best = SIZE_MAX;
    for (size_t i = 0; i < ts->n_stop; i++) {
        size_t sl = strlen(ts->stop[i]);
        if (sl == 0 || sl > ts->len)
            continue;
        for (size_t at = ts->emitted; at + sl <= ts->len && at < best; at++)
            if (memcmp(ts->buf + at, ts->stop[i], sl) == 0) {
                best = at;
                break;
            }
    }
    return best;
}

/* Bytes at the end that could begin a stop string and so must wait. */
static size_t holdback(const text_stream *ts)
{
    size_t hold = 0;
    for (size_t i = 0; i < ts->n_stop; i++) {
        size_t sl = strlen(ts->stop[i]);
        for (size_t k = sl > 0 ? sl - 1 : 0; k > hold; k--)
            if (k <= ts->len - ts->emitted && memcmp(ts->buf + ts->len - k, ts->stop[i], k) == 0) {
                hold = k;
                break;
            }
    }
    return hold;
}

int text_stream_push(text_stream *ts, const char *bytes, size_t n, strata_error *err)
{
    if (ts->stopped || n == 0)
        return STRATA_OK;
    int rc = ts->utf8 ? push_utf8(ts, (const unsigned char *)bytes, n, err) : append(ts, bytes, n, err);
    if (rc != STRATA_OK)
        return rc;
    size_t at = find_stop(ts);
    if (at != SIZE_MAX) {
        ts->stopped = true;
        ts->stop_at = at;
    }
    return STRATA_OK;
}

void text_stream_take(text_stream *ts, const char **text, size_t *len, bool *stopped)
{
    size_t upto = ts->stopped ? ts->stop_at : ts->len - holdback(ts);
    if (upto < ts->emitted)
        upto = ts->emitted;
    *text = ts->buf ? ts->buf + ts->emitted : "";
    *len = upto - ts->emitted;
    ts->emitted = upto;
    if (stopped)
        *stopped = ts->stopped;
}

void text_stream_finish(text_stream *ts, const char **text, size_t *len)
{
    if (!ts->stopped && ts->n_pending) {
        ts->n_pending = 0;
        (void)append(ts, replacement, sizeof replacement, NULL);   /* out of memory: the character is dropped */
    }
    size_t upto = ts->stopped ? ts->stop_at : ts->len;
    *text = ts->buf ? ts->buf + ts->emitted : "";
    *len = upto > ts->emitted ? upto - ts->emitted : 0;
    ts->emitted = upto > ts->emitted ? upto : ts->emitted;
}
