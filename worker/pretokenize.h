/* Pre-tokenizer of the byte-level BPE tokenizer: splits text into the pieces that BPE merges
 * never cross, over code points, the way llama.cpp's unicode_regex_split does for
 *   [ "\p{N}" ]  (optional: every number code point its own piece), then
 *   "'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
 * Letters/numbers are Unicode general categories L* / N* (libutf8proc); \s is the Unicode
 * White_Space property. Bytes that do not decode (llama.cpp's lenient decoder) count as U+FFFD.
 * Internal to worker/: used by tokenizer.c. */
#ifndef STRATA_WORKER_PRETOKENIZE_H
#define STRATA_WORKER_PRETOKENIZE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Character classes (bit set). */
enum {
    PRETOK_LETTER = 1,
    PRETOK_NUMBER = 2,
    PRETOK_SPACE = 4,
};

/* Scratch buffers reused across calls (owned by the caller; zero-initialize, then
 * pretok_buf_free). */
typedef struct pretok_buf {
    uint8_t *cls;  /* class bits per code point */
    uint8_t *chr;  /* the code point when < 128, else 0x80 */
    size_t *off;   /* byte offset of each code point, plus one past the end */
    size_t cap;    /* code points the arrays hold */
} pretok_buf;

void pretok_buf_free(pretok_buf *b);

/* Decodes one code point at s[0..n) (n >= 1) the way llama.cpp does: a lead byte followed by
 * the right number of continuation bytes (no overlong or surrogate checks; values past U+10FFFF,
 * which llama.cpp fails on, are invalid here). Returns the bytes consumed (1 for an invalid
 * byte, whose *cp is then 0xFFFD). */
size_t pretok_decode_utf8(const uint8_t *s, size_t n, uint32_t *cp);

/* Class bits of a code point. */
uint8_t pretok_class(uint32_t cp);

/* Called for each piece text[start..end), in order. A nonzero return stops the split and is
 * returned by pretokenize. */
typedef int (*pretok_emit_fn)(void *ctx, size_t start, size_t end);

/* Splits text[0..len) into pieces. digit_split selects the leading \p{N} pass. Returns 0
 * (STRATA_OK), STRATA_ENOMEM when the scratch buffers cannot be grown, or the first nonzero
 * value returned by emit. */
int pretokenize(const char *text, size_t len, bool digit_split, pretok_buf *buf,
                pretok_emit_fn emit, void *ctx);

#endif
