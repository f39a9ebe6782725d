/* Pre-tokenizer: see pretokenize.h. Hand-written over code points, no regex engine. */
#include "worker/pretokenize.h"

#include <stdlib.h>

#include <utf8proc.h>

#include "kvstore/error.h"

void pretok_buf_free(pretok_buf *b)
{
    if (!b)
        return;
    free(b->cls);
    free(b->chr);
    free(b->off);
    b->cls = NULL;
    b->chr = NULL;
    b->off = NULL;
    b->cap = 0;
}

static int pretok_buf_reserve(pretok_buf *b, size_t n)
{
    if (n <= b->cap && b->cls)
        return STRATA_OK;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < n) {
        if (cap > SIZE_MAX / 2 / sizeof(size_t))
            return STRATA_ENOMEM;
        cap *= 2;
    }
    uint8_t *cls = realloc(b->cls, cap);
    if (!cls)
        return STRATA_ENOMEM;
    b->cls = cls;
    uint8_t *chr = realloc(b->chr, cap);
    if (!chr)
        return STRATA_ENOMEM;
    b->chr = chr;
    size_t *off = realloc(b->off, (cap + 1) * sizeof *off);
    if (!off)
        return STRATA_ENOMEM;
    b->off = off;
    b->cap = cap;
    return STRATA_OK;
}

size_t pretok_decode_utf8(const uint8_t *s, size_t n, uint32_t *cp)
{
    uint8_t b0 = s[0];
    if (b0 < 0x80) {
        *cp = b0;
        return 1;
    }
    size_t need;
    uint32_t v;
    if (!(b0 & 0x40)) {          /* a lone continuation byte */
        need = 0;
        v = 0;
    } else if (!(b0 & 0x20)) {
        need = 1;
        v = b0 & 0x1fu;
    } else if (!(b0 & 0x10)) {
        need = 2;
        v = b0 & 0x0fu;
    } else if (!(b0 & 0x08)) {
        need = 3;
        v = b0 & 0x07u;
    } else {
        need = 0;
        v = 0;
    }
    if (need == 0 || n < need + 1) {
        *cp = 0xFFFD;
        return 1;
    }
    for (size_t i = 1; i <= need; i++) {
        if ((s[i] & 0xc0) != 0x80) {
            *cp = 0xFFFD;
            return 1;
        }
        v = (v << 6) | (s[i] & 0x3fu);
    }
    if (v > 0x10ffff) {          /* F4 90.. - F7: llama.cpp cannot re-encode these either */
        *cp = 0xFFFD;
        return 1;
    }
    *cp = v;
    return need + 1;
}

/* Unicode White_Space property. */
static bool is_white_space(uint32_t cp)
{
    if (cp < 0x80)
        return (cp >= 0x09 && cp <= 0x0d) || cp == 0x20;
    switch (cp) {
    case 0x85: case 0xa0: case 0x1680: case 0x2028: case 0x2029: case 0x202f: case 0x205f:
    case 0x3000:
        return true;
    default:
        return cp >= 0x2000 && cp <= 0x200a;
    }
}

uint8_t pretok_class(uint32_t cp)
{
    if (cp < 0x80) {
        if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z'))
            return PRETOK_LETTER;
        if (cp >= '0' && cp <= '9')
            return PRETOK_NUMBER;
        return is_white_space(cp) ? PRETOK_SPACE : 0;
    }
    if (is_white_space(cp))
        return PRETOK_SPACE;
    if (cp > 0x10ffff)
        return 0;
    utf8proc_category_t cat = utf8proc_category((utf8proc_int32_t)cp);
    if (cat == UTF8PROC_CATEGORY_CN) {
        /* Letters assigned after the Unicode version of older libutf8proc releases (2.6 has
         * Unicode 13) that llama.cpp's tables already know: CJK Unified Ideographs Extension I
         * (Unicode 15.1). */
        if (cp >= 0x2ebf0 && cp <= 0x2ee5d)
            return PRETOK_LETTER;
        return 0;
    }
    switch (cat) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO:
        return PRETOK_LETTER;
    case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_NO:
        return PRETOK_NUMBER;
    default:
        return 0;
    }
}

/* State of one split: code points [0, n) with classes, emitting byte ranges. */
typedef struct split_ctx {
    const pretok_buf *b;
    pretok_emit_fn emit;
    void *ctx;
} split_ctx;

/* The GPT-2 pattern over code points [a, e). Mirrors the order of the alternatives: the first
 * alternative that matches at a position wins, each one greedy. */
static int split_gpt2(const split_ctx *s, size_t a, size_t e)
{
    const uint8_t *cls = s->b->cls;
    const uint8_t *chr = s->b->chr;
    const size_t *off = s->b->off;
    const uint8_t other = PRETOK_LETTER | PRETOK_NUMBER | PRETOK_SPACE;
    size_t pos = a;
    while (pos < e) {
        size_t start = pos;
        uint8_t c = chr[pos];
        /* 's|'t|'re|'ve|'m|'ll|'d */
        if (c == '\'' && pos + 1 < e) {
            uint8_t c1 = chr[pos + 1];
            if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
                pos += 2;
                goto piece;
            }
            if (pos + 2 < e) {
                uint8_t c2 = chr[pos + 2];
                if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) {
                    pos += 3;
                    goto piece;
                }
            }
        }
        {
            /* class of the code point after an optional leading ASCII space; -1: none */
            int k = c == ' ' ? (pos + 1 < e ? cls[pos + 1] : -1) : cls[pos];
            if (k >= 0) {
                uint8_t want = 0;
                if (k & PRETOK_LETTER)        /*  ?\p{L}+ */
                    want = PRETOK_LETTER;
                else if (k & PRETOK_NUMBER)   /*  ?\p{N}+ */
                    want = PRETOK_NUMBER;
                if (want) {
                    pos += c == ' ';
                    while (pos < e && (cls[pos] & want))
                        pos++;
                    goto piece;
                }
                if (!(k & other)) {           /*  ?[^\s\p{L}\p{N}]+ */
                    pos += c == ' ';
                    while (pos < e && !(cls[pos] & other))
                        pos++;
                    goto piece;
                }
            }
        }
        {
            size_t nws = 0;
            while (pos + nws < e && (cls[pos + nws] & PRETOK_SPACE))
                nws++;
            if (nws > 1 && pos + nws < e) {   /* \s+(?!\S): leave the last one to the next piece */
                pos += nws - 1;
                goto piece;
            }
            if (nws > 0) {                    /* \s+ */
                pos += nws;
                goto piece;
            }
            pos++;                            /* no alternative matched: one code point */
        }
    piece:;
        int rc = s->emit(s->ctx, off[start], off[pos]);
        if (rc)
            return rc;
    }
    return 0;
}

int pretokenize(const char *text, size_t len, bool digit_split, pretok_buf *buf,
                pretok_emit_fn emit, void *ctx)
{
    if (len == 0)
        return STRATA_OK;
    int rc = pretok_buf_reserve(buf, len);   /* at most one code point per byte */
    if (rc)
        return rc;
    const uint8_t *p = (const uint8_t *)text;
    size_t n = 0;
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        size_t k = pretok_decode_utf8(p + i, len - i, &cp);
        buf->off[n] = i;
        buf->chr[n] = cp < 0x80 ? (uint8_t)cp : 0x80;
        buf->cls[n] = pretok_class(cp);
        n++;
        i += k;
    }
    buf->off[n] = len;

    split_ctx s = {buf, emit, ctx};
    if (!digit_split)
        return split_gpt2(&s, 0, n);
    /* \p{N}: each number code point alone; the GPT-2 pattern runs inside the stretches between */
    size_t a = 0;
    for (size_t i = 0; i < n; i++) {
        if (buf->cls[i] & PRETOK_NUMBER) {
            if (i > a && (rc = split_gpt2(&s, a, i)) != 0)
                return rc;
            if ((rc = split_gpt2(&s, i, i + 1)) != 0)
                return rc;
            a = i + 1;
        }
    }
    return a < n ? split_gpt2(&s, a, n) : 0;
}
