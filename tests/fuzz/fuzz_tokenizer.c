/* Fuzz target for the tokenizer, independent of any model file: vocabularies are GGUF images
 * built in memory.
 *
 * Input: one flags byte, then the payload.
 *   flags bit 1 clear: the payload is text for a fixed synthetic vocabulary (all 256 byte tokens,
 *     a few merges, control and user-defined tokens). It is encoded (bit 0: parse_special) and
 *     decoded; decode(encode(x)) must give x back byte for byte, or the target aborts.
 *   flags bit 1 set: the payload's lines are extra tokens (types from their lengths) and
 *     merges of a vocabulary built from them; loading may fail, but must not crash, and when
 *     it succeeds, encoding the payload and decoding the ids must not crash either. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker/gguf.h"
#include "worker/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

typedef struct gbuf {
    uint8_t *p;
    size_t n, cap;
    bool failed;
} gbuf;

static void put(gbuf *b, const void *d, size_t n)
{
    if (b->failed)
        return;
    if (b->n + n > b->cap) {
        size_t nc = b->cap ? b->cap : 1024;
        while (nc < b->n + n)
            nc *= 2;
        uint8_t *g = realloc(b->p, nc);
        if (!g) {
            b->failed = true;
            return;
        }
        b->p = g;
        b->cap = nc;
    }
    if (n)
        memcpy(b->p + b->n, d, n);
    b->n += n;
}

static void put_u32(gbuf *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(gbuf *b, uint64_t v) { put(b, &v, 8); }
static void put_str(gbuf *b, const char *s, size_t n) { put_u64(b, n); put(b, s, n); }
static void put_key(gbuf *b, const char *k, uint32_t type) { put_str(b, k, strlen(k)); put_u32(b, type); }

typedef struct span {
    const char *s;
    size_t n;
    int32_t type;
} span;

/* GPT-2 byte-to-unicode character of byte c, as UTF-8 */
static size_t byte_char(int c, char *out)
{
    bool keep = (c >= 33 && c <= 126) || (c >= 161 && c <= 172) || c >= 174;
    unsigned cp = (unsigned)c;
    if (!keep) {
        unsigned extra = 0;
        for (int i = 0; i < c; i++)
            if (!((i >= 33 && i <= 126) || (i >= 161 && i <= 172) || i >= 174))
                extra++;
        cp = 256 + extra;
    }
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    out[0] = (char)(0xc0 | (cp >> 6));
    out[1] = (char)(0x80 | (cp & 0x3f));
    return 2;
}

/* A GGUF image with the 256 byte tokens followed by extra tokens, and the given merges. */
static gguf_file *build(const span *extra, size_t n_extra, const span *merges, size_t n_merges)
{
    gbuf b = {0};
    put(&b, "GGUF", 4);
    put_u32(&b, 3);
    put_u64(&b, 0);
    put_u64(&b, 6);
    put_key(&b, "tokenizer.ggml.model", GGUF_STRING);
    put_str(&b, "gpt2", 4);
    put_key(&b, "tokenizer.ggml.pre", GGUF_STRING);
    put_str(&b, "smollm", 6);
    put_key(&b, "tokenizer.ggml.tokens", GGUF_ARRAY);
    put_u32(&b, GGUF_STRING);
    put_u64(&b, 256 + n_extra);
    for (int c = 0; c < 256; c++) {
        char ch[2];
        put_str(&b, ch, byte_char(c, ch));
    }
    for (size_t i = 0; i < n_extra; i++)
        put_str(&b, extra[i].s, extra[i].n);
    put_key(&b, "tokenizer.ggml.token_type", GGUF_ARRAY);
    put_u32(&b, GGUF_INT32);
    put_u64(&b, 256 + n_extra);
    for (int c = 0; c < 256; c++)
        put_u32(&b, 1);
    for (size_t i = 0; i < n_extra; i++)
        put_u32(&b, (uint32_t)extra[i].type);
    put_key(&b, "tokenizer.ggml.merges", GGUF_ARRAY);
    put_u32(&b, GGUF_STRING);
    put_u64(&b, n_merges);
    for (size_t i = 0; i < n_merges; i++)
        put_str(&b, merges[i].s, merges[i].n);
    put_key(&b, "tokenizer.chat_template", GGUF_STRING);
    put_str(&b, "<|im_start|>role content add_generation_prompt <|im_start|>assistant <|im_end|>", 80);
    static const uint8_t zeros[32] = {0};
    put(&b, zeros, (32 - b.n % 32) % 32);
    gguf_file *f = b.failed ? NULL : gguf_open_memory(b.p, b.n, NULL);
    free(b.p);
    return f;
}

#define S(x) {x, sizeof x - 1, 1}

static tokenizer *fixed_vocab(void)
{
    static const span extra[] = {
        S("he"), S("ll"), S("hell"), S("hello"), S("\xc4\xa0w"), S("\xc4\xa0wo"), S("or"),
        S("\xc4\xa0\xc4\xa0"), S("\xc4\xa0\xc4\xa0\xc4\xa0\xc4\xa0"), S("'s"), S("12"),
        S("\xc3\x83\xc2\xa9"), {"<|im_start|>", 12, 3}, {"<|im_end|>", 10, 3},
        {"<|im", 4, 3}, {"<user>", 6, 4}, {"<unk>", 5, 2},
    };
    static const span merges[] = {
        S("h e"), S("l l"), S("he ll"), S("hell o"), S("\xc4\xa0 w"), S("\xc4\xa0w o"), S("o r"),
        S("\xc4\xa0 \xc4\xa0"), S("\xc4\xa0\xc4\xa0 \xc4\xa0\xc4\xa0"), S("' s"), S("1 2"),
        S("\xc3\x83 \xc2\xa9"),
    };
    gguf_file *f = build(extra, sizeof extra / sizeof extra[0], merges, sizeof merges / sizeof merges[0]);
    if (!f)
        return NULL;
    tokenizer *t = tokenizer_from_gguf(f, NULL);
    gguf_close(f);
    return t;
}

static void fuzz_text(const uint8_t *text, size_t n, bool special)
{
    static tokenizer *t;   /* built once, read-only afterwards */
    if (!t && !(t = fixed_vocab())) {
        fprintf(stderr, "fuzz_tokenizer: cannot build the synthetic vocabulary\n");
        abort();
    }
    int32_t *ids;
    size_t nids;
    if (tokenizer_encode(t, (const char *)text, n, special, &ids, &nids, NULL) != STRATA_OK)
        return;   /* out of memory only */
    char *out;
    size_t out_len;
    if (tokenizer_decode(t, ids, nids, true, &out, &out_len, NULL) != STRATA_OK) {
        fprintf(stderr, "fuzz_tokenizer: encode produced an id that decode rejects\n");
        abort();
    }
    if (out_len != n || (n && memcmp(out, text, n) != 0)) {
        fprintf(stderr, "fuzz_tokenizer: decode(encode(x)) != x (%zu bytes in, %zu out)\n", n, out_len);
        abort();
    }
    free(out);
    free(ids);
}

static void fuzz_vocab(const uint8_t *data, size_t n, bool special)
{
    span lines[64];
    size_t nl = 0, start = 0;
    for (size_t i = 0; i <= n && nl < 64; i++) {
        if (i == n || data[i] == '\n') {
            lines[nl].s = (const char *)data + start;
            lines[nl].n = i - start;
            lines[nl].type = 1 + (int32_t)((i - start) % 4);
            nl++;
            start = i + 1;
        }
    }
    gguf_file *f = build(lines, nl, lines, nl);
    if (!f)
        return;
    tokenizer *t = tokenizer_from_gguf(f, NULL);
    gguf_close(f);
    if (!t)
        return;
    int32_t *ids;
    size_t nids;
    if (tokenizer_encode(t, (const char *)data, n, special, &ids, &nids, NULL) == STRATA_OK) {
        char *out;
        size_t out_len;
        if (tokenizer_decode(t, ids, nids, special, &out, &out_len, NULL) != STRATA_OK) {
            fprintf(stderr, "fuzz_tokenizer: encode produced an id that decode rejects\n");
            abort();
        }
        free(out);
        free(ids);
    }
    char *chat;
    if (tokenizer_apply_chat(t, special ? NULL : "s", "u", &chat, NULL) == STRATA_OK)
        free(chat);
    tokenizer_free(t);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0)
        return 0;
    bool special = data[0] & 1;
    if (data[0] & 2)
        fuzz_vocab(data + 1, size - 1, special);
    else
        fuzz_text(data + 1, size - 1, special);
    return 0;
}
