/* Tokenizer tests: token ids against llama.cpp's (tests/golden/tokenizer_ids.txt, written by
 * tests/golden/make_tokenizer_golden.py), encode/decode round trips over golden, random valid
 * and invalid UTF-8 text, the ChatML rendering, and malformed vocabularies built in memory.
 *
 * The model comes from $STRATA_MODEL or the build's default path; when it is missing the
 * model tests fail (run scripts/setup.sh). $STRATA_TOKENIZER_GOLDEN may name another golden
 * file in the same format (for larger one-off differential runs). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "worker/gguf.h"
#include "worker/tokenizer.h"

/* ---------------------------------------------------------------------------------------- */
/* Fixture: the model's tokenizer, loaded once. */

typedef struct fixture {
    gguf_file *f;
    tokenizer *t;
    char why[700];
} fixture;

static const char *model_path(void)
{
    const char *p = getenv("STRATA_MODEL");
    return p && *p ? p : STRATA_DEFAULT_MODEL;
}

static int group_setup(void **state)
{
    fixture *fx = calloc(1, sizeof *fx);
    if (!fx)
        return -1;
    *state = fx;
    const char *path = model_path();
    FILE *probe = fopen(path, "rb");
    if (!probe) {
        snprintf(fx->why, sizeof fx->why,
                 "model file %s not found: run scripts/setup.sh to download it", path);
        return 0;
    }
    fclose(probe);
    strata_error err = {0};
    fx->f = gguf_open(path, &err);
    if (!fx->f) {
        snprintf(fx->why, sizeof fx->why, "gguf_open(%s): %s", path, err.msg);
        return 0;
    }
    fx->t = tokenizer_from_gguf(fx->f, &err);
    if (!fx->t)
        snprintf(fx->why, sizeof fx->why, "tokenizer_from_gguf(%s): %s", path, err.msg);
    /* the tokenizer copies what it needs: close the file right away to prove it */
    gguf_close(fx->f);
    fx->f = NULL;
    return 0;
}

static int group_teardown(void **state)
{
    fixture *fx = *state;
    if (fx) {
        tokenizer_free(fx->t);
        gguf_close(fx->f);
        free(fx);
    }
    return 0;
}

static const tokenizer *need_model(void **state)
{
    fixture *fx = *state;
    if (!fx->t)
        fail_msg("%s", fx->why);
    return fx->t;
}

/* ---------------------------------------------------------------------------------------- */
/* Helpers */

static void encode_ok(const tokenizer *t, const char *s, size_t n, bool special, int32_t **ids,
                      size_t *nids)
{
    strata_error err = {0};
    int rc = tokenizer_encode(t, s, n, special, ids, nids, &err);
    if (rc != STRATA_OK)
        fail_msg("tokenizer_encode failed: %s", err.msg);
    assert_non_null(*ids);
}

/* encode then decode (control tokens included) must give the input back */
static void check_roundtrip(const tokenizer *t, const char *s, size_t n, bool special)
{
    int32_t *ids;
    size_t nids;
    encode_ok(t, s, n, special, &ids, &nids);
    int nv = tokenizer_n_vocab(t);
    for (size_t i = 0; i < nids; i++) {
        if (ids[i] < 0 || ids[i] >= nv)
            fail_msg("id %d out of range", (int)ids[i]);
        if (!special && tokenizer_is_control(t, ids[i]))
            fail_msg("control token %d produced with parse_special=false", (int)ids[i]);
    }
    char *out;
    size_t out_len;
    strata_error err = {0};
    if (tokenizer_decode(t, ids, nids, true, &out, &out_len, &err) != STRATA_OK)
        fail_msg("tokenizer_decode failed: %s", err.msg);
    if (out_len != n || memcmp(out, s, n) != 0) {
        fprintf(stderr, "round trip failed (special=%d) for %zu bytes:", (int)special, n);
        for (size_t i = 0; i < n; i++)
            fprintf(stderr, " %02x", (unsigned char)s[i]);
        fprintf(stderr, "\n got %zu bytes:", out_len);
        for (size_t i = 0; i < out_len; i++)
            fprintf(stderr, " %02x", (unsigned char)out[i]);
        fprintf(stderr, "\n");
        fail_msg("decode(encode(s)) != s");
    }
    assert_int_equal(out[out_len], '\0');
    free(out);
    free(ids);
}

static uint64_t rng_next(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

static size_t utf8_put(uint32_t cp, char *out)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xc0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xe0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (char)(0xf0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
    out[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* Strict UTF-8 validity (no overlongs, surrogates or code points past U+10FFFF). */
static bool utf8_valid(const unsigned char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        size_t k;
        uint32_t cp, min;
        if (c < 0x80) { i++; continue; }
        else if ((c & 0xe0) == 0xc0) { k = 1; cp = c & 0x1f; min = 0x80; }
        else if ((c & 0xf0) == 0xe0) { k = 2; cp = c & 0x0f; min = 0x800; }
        else if ((c & 0xf8) == 0xf0) { k = 3; cp = c & 0x07; min = 0x10000; }
        else return false;
        if (n - i <= k)   /* truncated */
            return false;
        for (size_t j = 1; j <= k; j++) {
            if ((s[i + j] & 0xc0) != 0x80)
                return false;
            cp = cp << 6 | (s[i + j] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            return false;
        i += k + 1;
    }
    return true;
}

/* What llama.cpp tokenizes for arbitrary bytes: its lenient decoder (lead byte + continuation
 * bytes, no overlong/surrogate checks) re-encoded, each undecodable byte as U+FFFD. */
static size_t llama_normalize(const unsigned char *s, size_t n, char *out)
{
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        unsigned c = s[i];
        size_t k = c < 0x80 ? 0 : (c & 0xe0) == 0xc0 ? 1 : (c & 0xf0) == 0xe0 ? 2
                 : (c & 0xf8) == 0xf0 ? 3 : 99;
        bool ok = c < 0x80 || (k != 99 && (c & 0xc0) == 0xc0 && n - i > k);
        uint32_t cp = k == 1 ? (c & 0x1f) : k == 2 ? (c & 0x0f) : k == 3 ? (c & 0x07) : c;
        for (size_t j = 1; ok && j <= k; j++) {
            if ((s[i + j] & 0xc0) != 0x80)
                ok = false;
            else
                cp = cp << 6 | (s[i + j] & 0x3f);
        }
        if (!ok) {
            o += utf8_put(0xfffd, out + o);
            i++;
        } else {
            o += utf8_put(cp, out + o);
            i += k + 1;
        }
    }
    return o;
}

/* ---------------------------------------------------------------------------------------- */
/* Golden file */

typedef struct golden_case {
    bool special;
    char *text;
    size_t len;
    int32_t *ids;
    size_t n_ids;
} golden_case;

typedef struct golden {
    golden_case *c;
    size_t n;
    char header[512];
} golden;

static int hexval(int c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
         : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

static void golden_free(golden *g)
{
    for (size_t i = 0; i < g->n; i++) {
        free(g->c[i].text);
        free(g->c[i].ids);
    }
    free(g->c);
}

static const char *golden_path(void)
{
    const char *p = getenv("STRATA_TOKENIZER_GOLDEN");
    return p && *p ? p : STRATA_SOURCE_DIR "/tests/golden/tokenizer_ids.txt";
}

static void golden_load(golden *g)
{
    memset(g, 0, sizeof *g);
    const char *path = golden_path();
    FILE *f = fopen(path, "rb");
    if (!f)
        fail_msg("cannot open golden file %s (run tests/golden/make_tokenizer_golden.py)", path);
    char *line = NULL;
    size_t cap = 0;
    ssize_t got;
    size_t lineno = 0;
    while ((got = getline(&line, &cap, f)) >= 0) {
        lineno++;
        size_t n = (size_t)got;
        while (n && (line[n - 1] == '\n' || line[n - 1] == '\r'))
            line[--n] = '\0';
        if (n == 0)
            continue;
        if (line[0] == '#') {
            if (strstr(line, "reference:") && strlen(line) < sizeof g->header)
                strcpy(g->header, line);
            continue;
        }
        char *tab1 = strchr(line, '\t');
        char *tab2 = tab1 ? strchr(tab1 + 1, '\t') : NULL;
        if (!tab1 || !tab2 || tab1 != line + 1 || (line[0] != '0' && line[0] != '1'))
            fail_msg("%s:%zu: malformed line", path, lineno);
        golden_case gc = {0};
        gc.special = line[0] == '1';
        size_t hexlen = (size_t)(tab2 - tab1 - 1);
        if (hexlen % 2)
            fail_msg("%s:%zu: odd hex length", path, lineno);
        gc.len = hexlen / 2;
        gc.text = malloc(gc.len + 1);
        assert_non_null(gc.text);
        for (size_t i = 0; i < gc.len; i++) {
            int hi = hexval(tab1[1 + 2 * i]), lo = hexval(tab1[2 + 2 * i]);
            if (hi < 0 || lo < 0)
                fail_msg("%s:%zu: bad hex", path, lineno);
            gc.text[i] = (char)(hi * 16 + lo);
        }
        gc.text[gc.len] = '\0';
        size_t idcap = 16;
        gc.ids = malloc(idcap * sizeof *gc.ids);
        assert_non_null(gc.ids);
        char *p = tab2 + 1;
        while (*p) {
            char *end;
            long v = strtol(p, &end, 10);
            if (end == p || v < 0 || v > INT32_MAX)
                fail_msg("%s:%zu: bad id list", path, lineno);
            if (gc.n_ids == idcap) {
                idcap *= 2;
                int32_t *grown = realloc(gc.ids, idcap * sizeof *grown);
                assert_non_null(grown);
                gc.ids = grown;
            }
            gc.ids[gc.n_ids++] = (int32_t)v;
            p = end;
            while (*p == ' ')
                p++;
        }
        golden_case *grown = realloc(g->c, (g->n + 1) * sizeof *grown);
        assert_non_null(grown);
        g->c = grown;
        g->c[g->n++] = gc;
    }
    free(line);
    fclose(f);
}

static void print_ids(const char *label, const int32_t *ids, size_t n)
{
    fprintf(stderr, "  %s (%zu):", label, n);
    for (size_t i = 0; i < n; i++)
        fprintf(stderr, " %d", (int)ids[i]);
    fprintf(stderr, "\n");
}

static void byte_token_table(const tokenizer *t, bool has[256]);
static void check_lossy_roundtrip(const tokenizer *t, const bool has[256], const char *s, size_t n);

static void test_golden_ids(void **state)
{
    const tokenizer *t = need_model(state);
    golden g;
    golden_load(&g);
    /* a truncated or empty golden file must not pass vacuously */
    if (g.n < 20)
        fail_msg("golden file %s has only %zu cases (expected >= 20)", golden_path(), g.n);
    size_t bad = 0, invalid_utf8 = 0;
    for (size_t i = 0; i < g.n; i++) {
        const golden_case *gc = &g.c[i];
        const char *text = gc->text;
        size_t len = gc->len;
        char *norm = NULL;
        if (!utf8_valid((const unsigned char *)text, len)) {
            /* llama.cpp encodes U+FFFD for invalid bytes; we keep the bytes (lossless round
             * trip) but must split the text the same way: compare on llama's rendering */
            invalid_utf8++;
            norm = malloc(len * 3 + 1);
            assert_non_null(norm);
            len = llama_normalize((const unsigned char *)text, len, norm);
            text = norm;
        }
        int32_t *ids;
        size_t n;
        encode_ok(t, text, len, gc->special, &ids, &n);
        if (n != gc->n_ids || memcmp(ids, gc->ids, n * sizeof *ids) != 0) {
            bad++;
            fprintf(stderr, "golden case %zu (special=%d) differs: \"%.*s\"\n", i, (int)gc->special,
                    (int)(gc->len > 200 ? 200 : gc->len), gc->text);
            print_ids("llama.cpp", gc->ids, gc->n_ids);
            print_ids("strata   ", ids, n);
        }
        free(ids);
        free(norm);
    }
    printf("golden: %zu cases (%zu invalid UTF-8), %zu differ; %s\n", g.n, invalid_utf8, bad, g.header);
    golden_free(&g);
    assert_int_equal(bad, 0);
}

static void test_golden_roundtrip(void **state)
{
    const tokenizer *t = need_model(state);
    golden g;
    golden_load(&g);
    assert_true(g.n >= 20);
    bool has[256];
    byte_token_table(t, has);
    for (size_t i = 0; i < g.n; i++) {
        bool all = true;
        for (size_t k = 0; k < g.c[i].len; k++)
            all = all && has[(unsigned char)g.c[i].text[k]];
        if (all)
            check_roundtrip(t, g.c[i].text, g.c[i].len, g.c[i].special);
        else
            check_lossy_roundtrip(t, has, g.c[i].text, g.c[i].len);
    }
    golden_free(&g);
}

/* ---------------------------------------------------------------------------------------- */
/* Random text */

static uint32_t random_cp(uint64_t *rng)
{
    static const uint32_t spaces[] = {' ', ' ', ' ', '\t', '\n', '\r', 0x0b, 0x0c, 0x85, 0xa0,
                                      0x1680, 0x2003, 0x2028, 0x2029, 0x202f, 0x3000};
    static const char punct[] = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~''''";
    uint64_t r = rng_next(rng);
    switch (r % 20) {
    case 0: case 1: case 2: case 3: case 4:
        return (uint32_t)((r >> 8) % 2 ? 'a' + (r >> 16) % 26 : 'A' + (r >> 16) % 26);
    case 5: case 6:
        return (uint32_t)('0' + (r >> 8) % 10);
    case 7: case 8: case 9:
        return spaces[(r >> 8) % (sizeof spaces / sizeof spaces[0])];
    case 10: case 11:
        return (uint32_t)punct[(r >> 8) % (sizeof punct - 1)];
    case 12: case 13:
        return 0x80 + (uint32_t)((r >> 8) % (0x800 - 0x80));
    case 14: case 15: {
        uint32_t cp = 0x800 + (uint32_t)((r >> 8) % (0x10000 - 0x800));
        return cp >= 0xd800 && cp <= 0xdfff ? cp - 0x1000 : cp;
    }
    case 16: case 17: {   /* planes 1-3 and 12-16 (the vocabulary has no token for the lead
                           * bytes F1/F2 of the unassigned planes 4-11) */
        uint32_t cp = 0x10000 + (uint32_t)((r >> 8) % (0x40000 - 0x10000 + 0x110000 - 0xc0000));
        return cp < 0x40000 ? cp : cp - 0x40000 + 0xc0000;
    }
    case 18:   /* a few scripts and digits that are common in real text */
        switch ((r >> 8) % 6) {
        case 0: return 0x4e00 + (uint32_t)((r >> 16) % 0x5000);   /* CJK */
        case 1: return 0x0400 + (uint32_t)((r >> 16) % 0x100);    /* Cyrillic */
        case 2: return 0x0660 + (uint32_t)((r >> 16) % 10);       /* Arabic-Indic digits */
        case 3: return 0x1f600 + (uint32_t)((r >> 16) % 0x50);    /* emoji */
        case 4: return 0x0300 + (uint32_t)((r >> 16) % 0x70);     /* combining marks */
        default: return 0x200d;                                   /* ZWJ */
        }
    default:
        return 0x00e0 + (uint32_t)((r >> 8) % 0x20);              /* accented Latin */
    }
}

static void test_random_utf8_roundtrip(void **state)
{
    const tokenizer *t = need_model(state);
    static const char *const inserts[] = {"'s", "'ll", "'re", "<|im_start|>", "<|im_end|>",
                                          "<|endoftext|>", "   ", "\n\n", "123", " the"};
    uint64_t rng = 0x2545f4914f6cdd1dull;
    char buf[1024];
    for (int iter = 0; iter < 4000; iter++) {
        size_t n = 0;
        size_t cps = (size_t)(rng_next(&rng) % 96);
        for (size_t k = 0; k < cps; k++) {
            if (rng_next(&rng) % 16 == 0) {
                const char *s = inserts[rng_next(&rng) % (sizeof inserts / sizeof inserts[0])];
                size_t l = strlen(s);
                memcpy(buf + n, s, l);
                n += l;
            } else {
                n += utf8_put(random_cp(&rng), buf + n);
            }
        }
        assert_true(n < sizeof buf);
        assert_true(utf8_valid((const unsigned char *)buf, n));
        check_roundtrip(t, buf, n, false);
        check_roundtrip(t, buf, n, true);
    }
}

/* Bytes that have a byte-level token in the model's vocabulary (SmolLM2 has none for 21 of
 * them: a few ASCII controls, C0, C1, F1, F2 and F5..FF). */
static void byte_token_table(const tokenizer *t, bool has[256])
{
    for (int c = 0; c < 256; c++) {
        int32_t *ids;
        size_t n, len;
        char s = (char)c;
        encode_ok(t, &s, 1, false, &ids, &n);
        const char *b = n == 1 ? tokenizer_token_bytes(t, ids[0], &len) : NULL;
        has[c] = b && len == 1 && (unsigned char)b[0] == c;
        free(ids);
    }
}

/* encode + decode of s, where bytes that lack a token are dropped when they are part of valid
 * UTF-8 (as llama.cpp does) and become U+FFFD when they are not (which is what llama.cpp encodes
 * for invalid bytes) */
static void check_lossy_roundtrip(const tokenizer *t, const bool has[256], const char *s, size_t n)
{
    char *want = malloc(n * 3 + 1);
    assert_non_null(want);
    size_t w = 0;
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        /* length of the strictly valid sequence at i, 1 for an invalid byte */
        size_t k = 1;
        bool valid = u[i] < 0x80;
        for (size_t len = 2; !valid && len <= 4 && len <= n - i; len++)
            if (utf8_valid(u + i, len)) {
                k = len;
                valid = true;
            }
        for (size_t j = 0; j < k; j++) {
            unsigned char c = u[i + j];
            if (has[c])
                want[w++] = (char)c;
            else if (!valid)
                w += utf8_put(0xfffd, want + w);
        }
        i += k;
    }
    for (int special = 0; special < 2; special++) {
        int32_t *ids;
        size_t nids;
        encode_ok(t, s, n, special, &ids, &nids);
        char *out;
        size_t out_len;
        assert_int_equal(tokenizer_decode(t, ids, nids, true, &out, &out_len, NULL), STRATA_OK);
        if (out_len != w || memcmp(out, want, w) != 0)
            fail_msg("lossy round trip of a %zu-byte input gave %zu bytes, want %zu", n, out_len, w);
        free(out);
        free(ids);
    }
    free(want);
}

#define BYTES(lit) {lit, sizeof lit - 1}

static void test_invalid_utf8(void **state)
{
    const tokenizer *t = need_model(state);
    bool has[256];
    byte_token_table(t, has);
    size_t n_has = 0;
    for (int c = 0; c < 256; c++)
        n_has += has[c];
    assert_int_equal(n_has, 235);
    /* invalid UTF-8 made of bytes that have tokens: kept byte for byte */
    static const struct { const char *s; size_t n; } exact[] = {
        BYTES("\x80"), BYTES("\xc3"), BYTES("\xe2\x82"), BYTES("\xf0\x9f\x98"), BYTES("\xed\xa0\x80"),
        BYTES("\xf4\x90\x80\x80"), BYTES("a\xc3" "b!"), BYTES(" \xbf\xbe 's \x80\x80\x80 12\xc3"),
        BYTES("<|im_start|>\xe2<|im_end|>"), BYTES("\0\0\0"), BYTES("\xc3\xc3\xa9\xa9"),
    };
    for (size_t i = 0; i < sizeof exact / sizeof exact[0]; i++) {
        check_roundtrip(t, exact[i].s, exact[i].n, false);
        check_roundtrip(t, exact[i].s, exact[i].n, true);
    }
    /* bytes without a token: dropped (ASCII) or U+FFFD (invalid UTF-8), like llama.cpp */
    static const struct { const char *s; size_t n; } lossy[] = {
        BYTES("\xff"), BYTES("a\xff" "b!"), BYTES("\xfe\xff"), BYTES("x\x1dy"), BYTES("\xf8\x88\x80\x80\x80"),
        BYTES("\xf7\xbf\xbf\xbf"), BYTES("  \xf5\xf5  \xff"), BYTES("\xf1"), BYTES("\xf2\x80"),
    };
    for (size_t i = 0; i < sizeof lossy / sizeof lossy[0]; i++)
        check_lossy_roundtrip(t, has, lossy[i].s, lossy[i].n);
    int32_t *ids;
    size_t n;
    encode_ok(t, "\xff", 1, false, &ids, &n);
    int32_t fffd = tokenizer_find_token(t, "\xc3\xaf\xc2\xbf\xc2\xbd", 6);   /* "ï¿½" */
    assert_true(fffd >= 0);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], fffd);
    free(ids);

    /* random bytes: exact round trip when every byte has a token; never a crash otherwise */
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    char buf[300];
    for (int iter = 0; iter < 4000; iter++) {
        size_t len = (size_t)(rng_next(&rng) % sizeof buf);
        bool all = iter % 4 != 0;
        for (size_t k = 0; k < len; k++) {
            uint64_t r = rng_next(&rng);
            /* bias towards bytes that make (broken) multi-byte sequences and spaces */
            if (r % 4 == 0)
                buf[k] = (char)(0x80 + (r >> 8) % 0x80);
            else if (r % 4 == 1)
                buf[k] = " a1'"[(r >> 8) % 4];
            else
                buf[k] = (char)((r >> 8) & 0xff);
            if (all && !has[(unsigned char)buf[k]])
                k--;
        }
        if (all) {
            check_roundtrip(t, buf, len, iter % 2 == 0);
        } else {
            int32_t *rids;
            size_t rn;
            encode_ok(t, buf, len, iter % 8 == 0, &rids, &rn);
            for (size_t k = 0; k < rn; k++)
                assert_true(rids[k] >= 0 && rids[k] < tokenizer_n_vocab(t));
            free(rids);
        }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Model facts, special tokens, decode */

static void test_model_facts(void **state)
{
    const tokenizer *t = need_model(state);
    assert_int_equal(tokenizer_n_vocab(t), 49152);
    assert_int_equal(tokenizer_bos(t), 1);
    assert_int_equal(tokenizer_eos(t), 2);
    assert_false(tokenizer_add_bos(t));
    assert_true(tokenizer_is_control(t, 0));
    assert_true(tokenizer_is_control(t, 1));
    assert_true(tokenizer_is_control(t, 2));
    assert_false(tokenizer_is_control(t, 17));
    assert_false(tokenizer_is_control(t, -1));
    assert_false(tokenizer_is_control(t, 49152));
    assert_int_equal(tokenizer_token_type(t, 1), TOKENIZER_TYPE_CONTROL);
    assert_int_equal(tokenizer_token_type(t, 100), TOKENIZER_TYPE_NORMAL);
    assert_int_equal(tokenizer_token_type(t, 49152), -1);

    size_t len = 99;
    assert_null(tokenizer_token_bytes(t, -1, &len));
    assert_int_equal(len, 0);
    len = 99;
    assert_null(tokenizer_token_bytes(t, 49152, &len));
    assert_int_equal(len, 0);
    const char *b = tokenizer_token_bytes(t, 1, &len);
    assert_int_equal(len, 12);
    assert_memory_equal(b, "<|im_start|>", 12);

    /* "Ġthe" is stored byte-encoded; its bytes are " the" */
    int32_t id = tokenizer_find_token(t, "\xc4\xa0the", 5);
    assert_true(id > 0);
    b = tokenizer_token_bytes(t, id, &len);
    assert_int_equal(len, 4);
    assert_memory_equal(b, " the", 4);
    assert_int_equal(tokenizer_find_token(t, "no such token text at all", 25), -1);

    /* every byte that has a byte-level token encodes alone to it */
    bool has[256];
    byte_token_table(t, has);
    for (int c = 0; c < 256; c++) {
        int32_t *ids;
        size_t n;
        char s = (char)c;
        encode_ok(t, &s, 1, false, &ids, &n);
        if (has[c])
            assert_int_equal(n, 1);
        else if (c < 0x80)
            assert_int_equal(n, 0);   /* e.g. 0x1d: dropped, as llama.cpp does */
        free(ids);
    }
}

static void test_special_tokens(void **state)
{
    const tokenizer *t = need_model(state);
    const char *s = "<|im_start|>user\nhi<|im_end|>";
    int32_t *ids;
    size_t n;
    encode_ok(t, s, strlen(s), true, &ids, &n);
    assert_true(n >= 3);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[n - 1], 2);
    for (size_t i = 1; i + 1 < n; i++)
        assert_false(tokenizer_is_control(t, ids[i]));

    /* decode skips control tokens unless asked */
    char *out;
    size_t out_len;
    assert_int_equal(tokenizer_decode(t, ids, n, false, &out, &out_len, NULL), STRATA_OK);
    assert_string_equal(out, "user\nhi");
    assert_int_equal(out_len, 7);
    free(out);
    assert_int_equal(tokenizer_decode(t, ids, n, true, &out, &out_len, NULL), STRATA_OK);
    assert_string_equal(out, s);
    free(out);
    free(ids);

    encode_ok(t, s, strlen(s), false, &ids, &n);
    assert_true(n > 3);
    for (size_t i = 0; i < n; i++)
        assert_false(tokenizer_is_control(t, ids[i]));
    free(ids);

    /* empty input */
    encode_ok(t, "", 0, true, &ids, &n);
    assert_int_equal(n, 0);
    free(ids);
    encode_ok(t, NULL, 0, false, &ids, &n);
    assert_int_equal(n, 0);
    free(ids);
    assert_int_equal(tokenizer_decode(t, NULL, 0, true, &out, &out_len, NULL), STRATA_OK);
    assert_int_equal(out_len, 0);
    assert_string_equal(out, "");
    free(out);
}

static void test_bad_arguments(void **state)
{
    const tokenizer *t = need_model(state);
    strata_error err = {0};
    int32_t *ids = (int32_t *)&err;
    size_t n = 7;
    assert_int_equal(tokenizer_encode(t, NULL, 3, false, &ids, &n, &err), STRATA_EINVAL);
    assert_null(ids);
    assert_int_equal(n, 0);
    assert_true(err.msg[0] != '\0');
    assert_int_equal(tokenizer_encode(NULL, "a", 1, false, &ids, &n, NULL), STRATA_EINVAL);

    int32_t bad[] = {5, 49152};
    char *out = (char *)&err;
    size_t out_len = 3;
    err.msg[0] = '\0';
    assert_int_equal(tokenizer_decode(t, bad, 2, true, &out, &out_len, &err), STRATA_EINVAL);
    assert_null(out);
    assert_non_null(strstr(err.msg, "49152"));
    int32_t neg[] = {-1};
    assert_int_equal(tokenizer_decode(t, neg, 1, false, &out, &out_len, NULL), STRATA_EINVAL);
    assert_null(tokenizer_from_gguf(NULL, &err));
    assert_int_equal(err.code, STRATA_EINVAL);
    tokenizer_free(NULL);
}

/* ---------------------------------------------------------------------------------------- */
/* Chat template */

static void test_chat_template(void **state)
{
    const tokenizer *t = need_model(state);
    char *out;
    strata_error err = {0};
    assert_int_equal(tokenizer_apply_chat(t, NULL, "What is 2+2?", &out, &err), STRATA_OK);
    assert_string_equal(out,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n");
    free(out);
    assert_int_equal(tokenizer_apply_chat(t, "Be terse.", "Hi", &out, &err), STRATA_OK);
    assert_string_equal(out, "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                             "<|im_start|>assistant\n");
    free(out);
    assert_int_equal(tokenizer_apply_chat(t, "", "", &out, &err), STRATA_OK);
    assert_string_equal(out, "<|im_start|>system\n<|im_end|>\n<|im_start|>user\n<|im_end|>\n"
                             "<|im_start|>assistant\n");
    free(out);
    assert_int_equal(tokenizer_apply_chat(t, NULL, NULL, &out, &err), STRATA_EINVAL);

    /* the rendered prompt tokenizes with its control tokens */
    assert_int_equal(tokenizer_apply_chat(t, NULL, "Hi", &out, &err), STRATA_OK);
    int32_t *ids;
    size_t n;
    encode_ok(t, out, strlen(out), true, &ids, &n);
    size_t starts = 0, ends = 0;
    for (size_t i = 0; i < n; i++) {
        starts += ids[i] == 1;
        ends += ids[i] == 2;
    }
    assert_int_equal(starts, 3);
    assert_int_equal(ends, 2);
    free(ids);
    free(out);
}

/* ---------------------------------------------------------------------------------------- */
/* Synthetic vocabularies: a GGUF image built in memory */

typedef struct gbuf {
    uint8_t *p;
    size_t n, cap;
} gbuf;

static void gb_put(gbuf *b, const void *d, size_t n)
{
    if (b->n + n > b->cap) {
        size_t nc = b->cap ? b->cap : 256;
        while (nc < b->n + n)
            nc *= 2;
        uint8_t *g = realloc(b->p, nc);
        assert_non_null(g);
        b->p = g;
        b->cap = nc;
    }
    if (n)
        memcpy(b->p + b->n, d, n);
    b->n += n;
}

static void gb_u32(gbuf *b, uint32_t v) { gb_put(b, &v, 4); }   /* the tests run little-endian */
static void gb_u64(gbuf *b, uint64_t v) { gb_put(b, &v, 8); }
static void gb_strn(gbuf *b, const char *s, size_t n) { gb_u64(b, n); gb_put(b, s, n); }
static void gb_str(gbuf *b, const char *s) { gb_strn(b, s, strlen(s)); }

static void kv_str(gbuf *b, const char *key, const char *v)
{
    gb_str(b, key);
    gb_u32(b, GGUF_STRING);
    gb_str(b, v);
}

static void kv_u32(gbuf *b, const char *key, uint32_t v)
{
    gb_str(b, key);
    gb_u32(b, GGUF_UINT32);
    gb_u32(b, v);
}

static void kv_bool(gbuf *b, const char *key, bool v)
{
    gb_str(b, key);
    gb_u32(b, GGUF_BOOL);
    uint8_t x = v;
    gb_put(b, &x, 1);
}

typedef struct strlist {
    char **s;
    size_t *len;
    size_t n;
} strlist;

static void sl_add(strlist *l, const char *s, size_t n)
{
    l->s = realloc(l->s, (l->n + 1) * sizeof *l->s);
    l->len = realloc(l->len, (l->n + 1) * sizeof *l->len);
    assert_non_null(l->s);
    assert_non_null(l->len);
    l->s[l->n] = malloc(n + 1);
    assert_non_null(l->s[l->n]);
    memcpy(l->s[l->n], s, n);
    l->s[l->n][n] = '\0';
    l->len[l->n++] = n;
}

static void sl_free(strlist *l)
{
    for (size_t i = 0; i < l->n; i++)
        free(l->s[i]);
    free(l->s);
    free(l->len);
}

static void kv_str_array(gbuf *b, const char *key, const strlist *l)
{
    gb_str(b, key);
    gb_u32(b, GGUF_ARRAY);
    gb_u32(b, GGUF_STRING);
    gb_u64(b, l->n);
    for (size_t i = 0; i < l->n; i++)
        gb_strn(b, l->s[i], l->len[i]);
}

static void kv_i32_array(gbuf *b, const char *key, const int32_t *v, size_t n)
{
    gb_str(b, key);
    gb_u32(b, GGUF_ARRAY);
    gb_u32(b, GGUF_INT32);
    gb_u64(b, n);
    gb_put(b, v, n * 4);
}

/* What to break in the synthetic vocabulary. */
typedef struct mini_opts {
    bool no_tokens, tokens_as_ints, no_merges, unknown_merge, merge_without_space, short_types,
        types_as_strings, bos_out_of_range, bos_as_string, no_pre, merge_without_result;
    const char *model, *pre, *chat_template;
} mini_opts;

enum { MINI_SPECIALS = 3, MINI_BYTES = 256 };
static const char *const mini_extra[] = {"he", "ll", "hell", "hello", "\xc4\xa0w", "\xc4\xa0wo"};
static const char *const mini_merges[] = {"h e", "l l", "he ll", "hell o", "\xc4\xa0 w", "\xc4\xa0w o"};

/* the GPT-2 byte-to-unicode character of byte b, as UTF-8 */
static size_t byte_char(int b, char *out)
{
    bool keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    uint32_t cp = (uint32_t)b;
    if (!keep) {
        uint32_t extra = 0;
        for (int i = 0; i < b; i++)
            if (!((i >= 33 && i <= 126) || (i >= 161 && i <= 172) || i >= 174))
                extra++;
        cp = 256 + extra;
    }
    return utf8_put(cp, out);
}

/* Token ids: 0..2 specials, 3 + b for byte b, then mini_extra. */
static int32_t mini_id_byte(int b) { return MINI_SPECIALS + b; }
static int32_t mini_id_extra(int i) { return MINI_SPECIALS + MINI_BYTES + i; }

static gguf_file *mini_gguf(const mini_opts *o)
{
    strlist toks = {0}, merges = {0};
    sl_add(&toks, "<|endoftext|>", 13);
    sl_add(&toks, "<|im_start|>", 12);
    sl_add(&toks, "<|im_end|>", 10);
    for (int b = 0; b < 256; b++) {
        char c[4];
        sl_add(&toks, c, byte_char(b, c));
    }
    for (size_t i = 0; i < sizeof mini_extra / sizeof mini_extra[0]; i++)
        sl_add(&toks, mini_extra[i], strlen(mini_extra[i]));
    for (size_t i = 0; i < sizeof mini_merges / sizeof mini_merges[0]; i++)
        sl_add(&merges, mini_merges[i], strlen(mini_merges[i]));
    if (o->unknown_merge)
        sl_add(&merges, "h zz", 4);
    if (o->merge_without_space)
        sl_add(&merges, "hl", 2);
    if (o->merge_without_result)   /* "xy" is not a token */
        sl_add(&merges, "x y", 3);
    int32_t *types = malloc(toks.n * sizeof *types);
    assert_non_null(types);
    for (size_t i = 0; i < toks.n; i++)
        types[i] = i < MINI_SPECIALS ? 3 : 1;

    size_t n_kv = 0;
    gbuf kv = {0};
    kv_str(&kv, "general.architecture", "llama"), n_kv++;
    kv_str(&kv, "tokenizer.ggml.model", o->model ? o->model : "gpt2"), n_kv++;
    if (!o->no_pre)
        kv_str(&kv, "tokenizer.ggml.pre", o->pre ? o->pre : "smollm"), n_kv++;
    if (o->tokens_as_ints) {
        kv_i32_array(&kv, "tokenizer.ggml.tokens", types, toks.n), n_kv++;
    } else if (!o->no_tokens) {
        kv_str_array(&kv, "tokenizer.ggml.tokens", &toks), n_kv++;
    }
    if (o->types_as_strings)
        kv_str_array(&kv, "tokenizer.ggml.token_type", &toks), n_kv++;
    else
        kv_i32_array(&kv, "tokenizer.ggml.token_type", types, toks.n - (o->short_types ? 1 : 0)), n_kv++;
    if (!o->no_merges)
        kv_str_array(&kv, "tokenizer.ggml.merges", &merges), n_kv++;
    if (o->bos_as_string)
        kv_str(&kv, "tokenizer.ggml.bos_token_id", "1"), n_kv++;
    else
        kv_u32(&kv, "tokenizer.ggml.bos_token_id", o->bos_out_of_range ? 100000 : 1), n_kv++;
    kv_u32(&kv, "tokenizer.ggml.eos_token_id", 2), n_kv++;
    kv_bool(&kv, "tokenizer.ggml.add_bos_token", true), n_kv++;
    if (o->chat_template)
        kv_str(&kv, "tokenizer.chat_template", o->chat_template), n_kv++;

    gbuf img = {0};
    gb_put(&img, "GGUF", 4);
    gb_u32(&img, 3);
    gb_u64(&img, 0);
    gb_u64(&img, n_kv);
    gb_put(&img, kv.p, kv.n);
    static const uint8_t zeros[32] = {0};
    gb_put(&img, zeros, (32 - img.n % 32) % 32);

    strata_error err = {0};
    gguf_file *f = gguf_open_memory(img.p, img.n, &err);
    if (!f)
        fail_msg("gguf_open_memory of the synthetic vocabulary: %s", err.msg);
    free(img.p);
    free(kv.p);
    free(types);
    sl_free(&toks);
    sl_free(&merges);
    return f;
}

static tokenizer *mini_tokenizer(const mini_opts *o, strata_error *err)
{
    gguf_file *f = mini_gguf(o);
    tokenizer *t = tokenizer_from_gguf(f, err);
    gguf_close(f);
    return t;
}

static void expect_load_error(const mini_opts *o, int code, const char *needle)
{
    strata_error err = {0};
    tokenizer *t = mini_tokenizer(o, &err);
    if (t)
        fail_msg("a malformed vocabulary loaded (expected %s)", strata_status_name(code));
    if (err.code != code)
        fail_msg("expected %s, got %s: %s", strata_status_name(code), strata_status_name(err.code), err.msg);
    if (!strstr(err.msg, needle))
        fail_msg("message \"%s\" does not mention \"%s\"", err.msg, needle);
}

static void expect_ids(const tokenizer *t, const char *s, bool special, const int32_t *want, size_t n_want)
{
    int32_t *ids;
    size_t n;
    encode_ok(t, s, strlen(s), special, &ids, &n);
    if (n != n_want || memcmp(ids, want, n * sizeof *ids) != 0) {
        fprintf(stderr, "encoding \"%s\":\n", s);
        print_ids("want", want, n_want);
        print_ids("got ", ids, n);
        fail_msg("unexpected ids");
    }
    free(ids);
    check_roundtrip(t, s, strlen(s), special);
}

static void test_synthetic_vocab(void **state)
{
    (void)state;
    mini_opts o = {0};
    strata_error err = {0};
    tokenizer *t = mini_tokenizer(&o, &err);
    if (!t)
        fail_msg("synthetic vocabulary: %s", err.msg);
    assert_int_equal(tokenizer_n_vocab(t), MINI_SPECIALS + MINI_BYTES + 6);
    assert_true(tokenizer_add_bos(t));

    /* "hello": h e l l o -> he l l o -> he ll o -> hell o -> hello */
    const int32_t hello[] = {mini_id_extra(3)};
    expect_ids(t, "hello", false, hello, 1);
    /* " wo": Ġ w o -> Ġw o -> Ġwo ; " world": Ġwo r l d */
    const int32_t world[] = {mini_id_extra(3), mini_id_extra(5), mini_id_byte('r'), mini_id_byte('l'),
                             mini_id_byte('d')};
    expect_ids(t, "hello world", false, world, 5);
    /* equal ranks merge leftmost first: l l l -> ll l */
    const int32_t lll[] = {mini_id_extra(1), mini_id_byte('l')};
    expect_ids(t, "lll", false, lll, 2);
    /* digits are split one by one, specials only when asked */
    const int32_t num[] = {mini_id_byte('1'), mini_id_byte('2'), mini_id_byte('3')};
    expect_ids(t, "123", false, num, 3);
    const int32_t sp[] = {1, mini_id_extra(3), 2};
    expect_ids(t, "<|im_start|>hello<|im_end|>", true, sp, 3);
    char *out;
    assert_int_equal(tokenizer_apply_chat(t, NULL, "x", &out, &err), STRATA_EUNSUPPORTED);
    assert_non_null(strstr(err.msg, "chat_template"));
    tokenizer_free(t);

    /* a merge whose result is not a token: the symbol falls back to its bytes' tokens */
    o.merge_without_result = true;
    t = mini_tokenizer(&o, &err);
    assert_non_null(t);
    const int32_t xyz[] = {mini_id_byte('x'), mini_id_byte('y'), mini_id_byte('z')};
    expect_ids(t, "xyz", false, xyz, 3);
    tokenizer_free(t);
    o.merge_without_result = false;

    /* "gpt2" pre-tokenizer: no digit split */
    o.pre = "gpt2";
    t = mini_tokenizer(&o, &err);
    assert_non_null(t);
    int32_t *ids;
    size_t n;
    encode_ok(t, "123 4", 5, false, &ids, &n);
    assert_int_equal(n, 5);   /* "123" and " 4" pieces, no merges: bytes */
    free(ids);
    tokenizer_free(t);
}

/* User-defined tokens (GGUF type 4: added words, runs of spaces that a converter stores as added
 * tokens) are text: decoding and streaming print them, as llama.cpp and HF do (they were hidden
 * with the control tokens: "if x:\n    return 1" came back without its indentation). And a vocabulary
 * that asks for a BOS it does not name is refused at load (every prompt failed on token -1). */
static void test_user_defined_tokens_are_text(void **state)
{
    (void)state;
    tokenizer_str toks[261];
    char store[256][4];
    for (int b = 0; b < 256; b++)
        toks[b] = (tokenizer_str){store[b], tokenizer_byte_text((uint8_t)b, store[b])};
    toks[256] = (tokenizer_str){"<think>", 7};
    toks[257] = (tokenizer_str){"    ", 4};
    toks[258] = (tokenizer_str){"<|end|>", 7};
    toks[259] = (tokenizer_str){"<unk>", 5};
    toks[260] = (tokenizer_str){"<|unused_0|>", 12};
    uint8_t types[261];
    memset(types, TOKENIZER_TYPE_NORMAL, sizeof types);
    types[256] = types[257] = TOKENIZER_TYPE_USER_DEFINED;
    types[258] = TOKENIZER_TYPE_CONTROL;
    types[259] = TOKENIZER_TYPE_UNKNOWN;
    types[260] = TOKENIZER_TYPE_UNUSED;
    tokenizer_vocab v = {.pre = {"gpt2", 4}, .tokens = toks, .n_tokens = 261, .types = types, .bos = -1, .eos = -1};
    strata_error err = {0};
    tokenizer *t = tokenizer_from_vocab(&v, &err);
    if (!t)
        fail_msg("%s", err.msg);
    const char *in = "<think>if x:\n    return 1<|end|>";
    int32_t *ids;
    size_t n;
    encode_ok(t, in, strlen(in), true, &ids, &n);
    bool saw_spaces = false;
    for (size_t i = 0; i < n; i++)
        saw_spaces |= ids[i] == 257;
    assert_true(saw_spaces);
    assert_false(tokenizer_is_control(t, 256));
    assert_false(tokenizer_is_control(t, 257));
    assert_true(tokenizer_is_control(t, 258));
    char *out;
    size_t len;
    assert_int_equal(tokenizer_decode(t, ids, n, false, &out, &len, &err), STRATA_OK);
    assert_string_equal(out, "<think>if x:\n    return 1");
    free(out);
    assert_int_equal(tokenizer_decode(t, ids, n, true, &out, &len, &err), STRATA_OK);
    assert_string_equal(out, in);
    free(out);
    assert_true(tokenizer_is_eog(t, 258));
    free(ids);
    /* Unknown and unused tokens are not text either (a model that samples one printed
     * "<|unused_0|>" into its answer): llama.cpp renders them as nothing without "special". */
    assert_true(tokenizer_is_text(t, 256) && tokenizer_is_text(t, 257) && tokenizer_is_text(t, 'h'));
    assert_false(tokenizer_is_text(t, 258) || tokenizer_is_text(t, 259) || tokenizer_is_text(t, 260));
    assert_false(tokenizer_is_text(t, -1) || tokenizer_is_text(t, 261));
    const int32_t mixed[] = {'h', 259, 'i', 260, 258};
    assert_int_equal(tokenizer_decode(t, mixed, 5, false, &out, &len, &err), STRATA_OK);
    assert_string_equal(out, "hi");
    free(out);
    assert_int_equal(tokenizer_decode(t, mixed, 5, true, &out, &len, &err), STRATA_OK);
    assert_string_equal(out, "h<unk>i<|unused_0|><|end|>");
    free(out);
    tokenizer_free(t);

    v.add_bos = true;
    assert_null(tokenizer_from_vocab(&v, &err));
    assert_int_equal(err.code, STRATA_EFORMAT);
    assert_non_null(strstr(err.msg, "add_bos_token is true but the model names no BOS token"));
}

static void test_malformed_vocab(void **state)
{
    (void)state;
    mini_opts o;
    o = (mini_opts){.no_tokens = true};
    expect_load_error(&o, STRATA_EFORMAT, "tokenizer.ggml.tokens");
    o = (mini_opts){.tokens_as_ints = true};
    expect_load_error(&o, STRATA_EFORMAT, "tokenizer.ggml.tokens");
    o = (mini_opts){.no_merges = true};
    expect_load_error(&o, STRATA_EFORMAT, "tokenizer.ggml.merges");
    o = (mini_opts){.unknown_merge = true};
    expect_load_error(&o, STRATA_EFORMAT, "unknown token 'zz'");
    o = (mini_opts){.merge_without_space = true};
    expect_load_error(&o, STRATA_EFORMAT, "no space");
    o = (mini_opts){.short_types = true};
    expect_load_error(&o, STRATA_EFORMAT, "token_type");
    o = (mini_opts){.types_as_strings = true};
    expect_load_error(&o, STRATA_EFORMAT, "token_type");
    o = (mini_opts){.bos_out_of_range = true};
    expect_load_error(&o, STRATA_EFORMAT, "bos_token_id");
    o = (mini_opts){.bos_as_string = true};
    expect_load_error(&o, STRATA_EFORMAT, "bos_token_id");
    o = (mini_opts){.model = "llama"};
    expect_load_error(&o, STRATA_EUNSUPPORTED, "llama");
    o = (mini_opts){.pre = "qwen2"};
    expect_load_error(&o, STRATA_EUNSUPPORTED, "qwen2");
    o = (mini_opts){.no_pre = true};
    expect_load_error(&o, STRATA_EUNSUPPORTED, "tokenizer.ggml.pre");
}

static void test_chat_template_variants(void **state)
{
    (void)state;
    strata_error err = {0};
    char *out;
    /* Llama-2 style: not ChatML */
    mini_opts o = {.chat_template = "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"};
    tokenizer *t = mini_tokenizer(&o, &err);
    assert_non_null(t);
    assert_int_equal(tokenizer_apply_chat(t, NULL, "x", &out, &err), STRATA_EUNSUPPORTED);
    assert_null(out);
    assert_non_null(strstr(err.msg, "ChatML"));
    tokenizer_free(t);

    /* plain ChatML without a default system prompt; escaped newlines in the literals */
    o.chat_template = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
                      "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
                      "{{ '<|im_start|>assistant\\n' }}{% endif %}";
    t = mini_tokenizer(&o, &err);
    assert_non_null(t);
    assert_int_equal(tokenizer_apply_chat(t, NULL, "hey", &out, &err), STRATA_OK);
    assert_string_equal(out, "<|im_start|>user\nhey<|im_end|>\n<|im_start|>assistant\n");
    free(out);
    assert_int_equal(tokenizer_apply_chat(t, "S", "hey", &out, &err), STRATA_OK);
    assert_string_equal(out, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhey<|im_end|>\n"
                             "<|im_start|>assistant\n");
    free(out);
    tokenizer_free(t);

    /* Qwen-style default system prompt in a double-quoted literal with escapes; a
     * '<|im_start|>system\n' + message['content'] literal before it is not a default */
    o.chat_template = "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + "
                      "messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- \"<|im_start|>system\\n"
                      "You are \\\"Q\\\".<|im_end|>\\n\" }}{%- endif %}{%- for message in messages %}"
                      "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
                      "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";
    t = mini_tokenizer(&o, &err);
    assert_non_null(t);
    assert_int_equal(tokenizer_apply_chat(t, NULL, "u", &out, &err), STRATA_OK);
    assert_string_equal(out, "<|im_start|>system\nYou are \"Q\".<|im_end|>\n<|im_start|>user\nu<|im_end|>\n"
                             "<|im_start|>assistant\n");
    free(out);
    tokenizer_free(t);
}

/* ---------------------------------------------------------------------------------------- */
/* Speed: linear-ish on large and pathological inputs */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void time_encode(const tokenizer *t, const char *label, const char *s, size_t n)
{
    double t0 = now_s();
    int32_t *ids;
    size_t nids;
    encode_ok(t, s, n, true, &ids, &nids);
    double dt = now_s() - t0;
    printf("encode %-22s %8zu bytes -> %7zu tokens in %7.1f ms (%.1f MB/s)\n", label, n, nids,
           dt * 1e3, (double)n / 1e6 / (dt > 0 ? dt : 1e-9));
    /* a quadratic algorithm takes minutes here; even sanitized builds finish in seconds */
    if (dt > 60.0)
        fail_msg("encoding %s took %.1f s", label, dt);
    free(ids);
}

static void test_speed(void **state)
{
    const tokenizer *t = need_model(state);
    golden g;
    golden_load(&g);
    size_t cap = 1u << 20, n = 0;
    char *buf = malloc(cap + 4096);
    assert_non_null(buf);
    for (size_t i = 0; n < cap; i = (i + 1) % g.n) {
        if (g.c[i].len > 4096)
            continue;
        memcpy(buf + n, g.c[i].text, g.c[i].len);
        n += g.c[i].len;
    }
    golden_free(&g);
    time_encode(t, "mixed golden text", buf, n);
    memset(buf, 'a', cap);
    time_encode(t, "one long word", buf, cap);
    memset(buf, ' ', cap);
    time_encode(t, "spaces", buf, cap);
    memset(buf, '7', cap);
    time_encode(t, "digits", buf, cap);
    for (size_t i = 0; i < cap; i++)
        buf[i] = "ab"[i % 2];
    time_encode(t, "abab...", buf, cap);
    for (size_t i = 0; i + 12 <= cap; i += 12)
        memcpy(buf + i, "<|im_start|>", 12);
    time_encode(t, "special tokens", buf, cap / 12 * 12);
    free(buf);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_golden_ids),
        cmocka_unit_test(test_golden_roundtrip),
        cmocka_unit_test(test_random_utf8_roundtrip),
        cmocka_unit_test(test_invalid_utf8),
        cmocka_unit_test(test_model_facts),
        cmocka_unit_test(test_special_tokens),
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_chat_template),
        cmocka_unit_test(test_synthetic_vocab),
        cmocka_unit_test(test_user_defined_tokens_are_text),
        cmocka_unit_test(test_malformed_vocab),
        cmocka_unit_test(test_chat_template_variants),
        cmocka_unit_test(test_speed),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
