/* Byte-level BPE tokenizer: see tokenizer.h. */
#include "worker/tokenizer.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker/pretokenize.h"

/* One merge rule in the (left id, right id) -> (rank, result id) table. */
typedef struct merge_slot {
    uint64_t key;    /* left << 32 | right; MERGE_EMPTY when unused */
    int32_t rank;
    int32_t result;  /* id of left+right, -1 when that text is not a token */
} merge_slot;

#define MERGE_EMPTY UINT64_MAX

struct tokenizer {
    int32_t n_vocab;
    char *text;              /* every token's stored text, concatenated */
    size_t *text_off;        /* n_vocab + 1 offsets into text */
    char *bytes;             /* every token's raw bytes (byte mapping undone), concatenated */
    size_t *bytes_off;       /* n_vocab + 1 offsets into bytes */
    uint8_t *type;           /* token type per id */

    int32_t *tok_slots;      /* open-addressing text -> id table; -1 empty */
    size_t tok_mask;
    merge_slot *merge_slots; /* open-addressing merge table */
    size_t merge_mask;

    int32_t byte_tok[256];   /* token of each raw byte's byte-encoded character, or -1 */
    uint8_t byte_enc[256][2];/* UTF-8 of the byte-encoded character of each byte */
    uint8_t byte_enc_len[256];
    int16_t cp_to_byte[324]; /* inverse mapping, -1 for code points outside it */

    int32_t fffd[4];         /* encoding of U+FFFD, for invalid bytes that have no byte token */
    size_t n_fffd;

    int32_t *special;        /* matchable special tokens (types 2, 3, 4), longest text first */
    size_t n_special;

    int32_t bos, eos;
    bool add_bos;
    bool digit_split;
    char *chat_template;     /* NUL-terminated copy, NULL when the model has none */
    size_t chat_template_len;
};

/* ---------------------------------------------------------------------------------------- */
/* Hashing */

static uint64_t hash_bytes(const char *s, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;   /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= (uint8_t)s[i];
        h *= 0x100000001b3ull;
    }
    return h ^ (h >> 29);
}

static uint64_t hash_u64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

static size_t table_size_for(size_t n)
{
    size_t cap = 16;
    while (cap < n * 2)
        cap *= 2;
    return cap;
}

static const char *tok_text(const tokenizer *t, int32_t id, size_t *len)
{
    *len = t->text_off[id + 1] - t->text_off[id];
    return t->text + t->text_off[id];
}

int32_t tokenizer_find_token(const tokenizer *t, const char *s, size_t len)
{
    if (!t || (!s && len))
        return -1;
    size_t i = (size_t)hash_bytes(s, len) & t->tok_mask;
    for (;;) {
        int32_t id = t->tok_slots[i];
        if (id < 0)
            return -1;
        size_t n;
        const char *p = tok_text(t, id, &n);
        if (n == len && memcmp(p, s, len) == 0)
            return id;
        i = (i + 1) & t->tok_mask;
    }
}

/* Inserts id under its text; a later token with the same text replaces the earlier one (as
 * llama.cpp's token_to_id map does). */
static void tok_insert(tokenizer *t, int32_t id)
{
    size_t len;
    const char *s = tok_text(t, id, &len);
    size_t i = (size_t)hash_bytes(s, len) & t->tok_mask;
    for (;;) {
        int32_t cur = t->tok_slots[i];
        if (cur < 0) {
            t->tok_slots[i] = id;
            return;
        }
        size_t n;
        const char *p = tok_text(t, cur, &n);
        if (n == len && memcmp(p, s, len) == 0) {
            t->tok_slots[i] = id;
            return;
        }
        i = (i + 1) & t->tok_mask;
    }
}

static const merge_slot *merge_find(const tokenizer *t, int32_t left, int32_t right)
{
    uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    size_t i = (size_t)hash_u64(key) & t->merge_mask;
    for (;;) {
        const merge_slot *m = &t->merge_slots[i];
        if (m->key == key)
            return m;
        if (m->key == MERGE_EMPTY)
            return NULL;
        i = (i + 1) & t->merge_mask;
    }
}

/* Adds a merge unless the pair is already there (the first, lowest rank, wins). */
static void merge_insert(tokenizer *t, int32_t left, int32_t right, int32_t rank, int32_t result)
{
    uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    size_t i = (size_t)hash_u64(key) & t->merge_mask;
    for (;;) {
        merge_slot *m = &t->merge_slots[i];
        if (m->key == key)
            return;
        if (m->key == MERGE_EMPTY) {
            m->key = key;
            m->rank = rank;
            m->result = result;
            return;
        }
        i = (i + 1) & t->merge_mask;
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Loading */

static size_t put_utf8(uint32_t cp, uint8_t *out)
{
    if (cp < 0x80) {
        out[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (uint8_t)(0xc0 | (cp >> 6));
        out[1] = (uint8_t)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xe0 | (cp >> 12));
        out[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3f));
        out[2] = (uint8_t)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (uint8_t)(0xf0 | (cp >> 18));
    out[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3f));
    out[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3f));
    out[3] = (uint8_t)(0x80 | (cp & 0x3f));
    return 4;
}

/* GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the other 68 bytes to
 * U+0100.. in byte order. */
static bool byte_is_printable(uint32_t b)
{
    return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
}

static uint32_t byte_cp(uint32_t b)
{
    if (byte_is_printable(b))
        return b;
    uint32_t before = 0;   /* non-printable bytes below b */
    for (uint32_t i = 0; i < b; i++)
        before += !byte_is_printable(i);
    return 256 + before;
}

static void build_byte_map(tokenizer *t)
{
    for (int i = 0; i < 324; i++)
        t->cp_to_byte[i] = -1;
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t cp = byte_cp(b);
        t->byte_enc_len[b] = (uint8_t)put_utf8(cp, t->byte_enc[b]);
        t->cp_to_byte[cp] = (int16_t)b;
    }
}

/* Parses "<0xHH>" (byte tokens of sentencepiece-style vocabularies). */
static int parse_byte_token(const char *s, size_t n)
{
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>')
        return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0'
              : c >= 'A' && c <= 'F' ? c - 'A' + 10
              : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0)
            return -1;
        v = v * 16 + d;
    }
    return v;
}

/* Raw bytes of a token's stored text into out (at most n bytes); returns their count. */
static size_t token_raw_bytes(const tokenizer *t, uint8_t type, const char *s, size_t n, char *out)
{
    if (type == TOKENIZER_TYPE_CONTROL || type == TOKENIZER_TYPE_USER_DEFINED ||
        type == TOKENIZER_TYPE_UNKNOWN) {
        memcpy(out, s, n);
        return n;
    }
    if (type == TOKENIZER_TYPE_BYTE) {
        int b = parse_byte_token(s, n);
        if (b >= 0) {
            out[0] = (char)b;
            return 1;
        }
    }
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t k = pretok_decode_utf8((const uint8_t *)s + i, n - i, &cp);
        if (k > 1 || (uint8_t)s[i] < 0x80) {
            if (cp < 324 && t->cp_to_byte[cp] >= 0) {
                out[o++] = (char)t->cp_to_byte[cp];
                i += k;
                continue;
            }
        }
        /* not a byte-encoded character: keep it as it is */
        memcpy(out + o, s + i, k);
        o += k;
        i += k;
    }
    return o;
}

typedef struct special_key {
    size_t len;
    int32_t id;
} special_key;

static int special_key_cmp(const void *a, const void *b)
{
    const special_key *x = a, *y = b;
    if (x->len != y->len)
        return x->len > y->len ? -1 : 1;   /* longest text first */
    return x->id < y->id ? -1 : x->id > y->id;
}

static int sort_specials(tokenizer *t)
{
    special_key *k = malloc((t->n_special ? t->n_special : 1) * sizeof *k);
    if (!k)
        return STRATA_ENOMEM;
    for (size_t i = 0; i < t->n_special; i++) {
        k[i].id = t->special[i];
        k[i].len = t->text_off[k[i].id + 1] - t->text_off[k[i].id];
    }
    qsort(k, t->n_special, sizeof *k, special_key_cmp);
    for (size_t i = 0; i < t->n_special; i++)
        t->special[i] = k[i].id;
    free(k);
    return STRATA_OK;
}

static int clamp_len(size_t n)
{
    return n > 64 ? 64 : (int)n;
}

static bool text_eq(tokenizer_str s, const char *lit)
{
    size_t n = strlen(lit);
    return s.len == n && (n == 0 || (s.ptr && memcmp(s.ptr, lit, n) == 0));
}

static int encode_fffd(tokenizer *t);

/* ---- The builder: one path from a tokenizer_vocab, whatever it was read from ---------------- */

static int build_pre(tokenizer *t, const tokenizer_vocab *v, strata_error *err)
{
    if (text_eq(v->pre, "smollm") || text_eq(v->pre, "starcoder"))
        t->digit_split = true;
    else if (text_eq(v->pre, "gpt2"))
        t->digit_split = false;
    else
        return strata_fail(err, STRATA_EUNSUPPORTED,
                           "tokenizer: pre-tokenizer '%.*s' is not supported (smollm, starcoder, gpt2)",
                           clamp_len(v->pre.len), v->pre.ptr ? v->pre.ptr : "");
    return STRATA_OK;
}

static int build_types(tokenizer *t, const tokenizer_vocab *v, strata_error *err)
{
    const int32_t n = v->n_tokens;
    t->type = malloc((size_t)n);
    if (!t->type)
        return strata_fail(err, STRATA_ENOMEM, "tokenizer: out of memory");
    memset(t->type, TOKENIZER_TYPE_NORMAL, (size_t)n);
    for (int32_t i = 0; v->types && i < n; i++) {
        if (v->types[i] > TOKENIZER_TYPE_BYTE)
            return strata_fail(err, STRATA_EFORMAT, "tokenizer: token %d has invalid type %d", (int)i,
                               (int)v->types[i]);
        t->type[i] = v->types[i];
    }
    return STRATA_OK;
}

/* Token texts, the text -> id table, the byte mapping and every token's raw bytes. */
static int build_texts(tokenizer *t, const tokenizer_vocab *v, strata_error *err)
{
    const int32_t n = v->n_tokens;
    size_t total = 0;
    for (int32_t i = 0; i < n; i++) {
        if (v->tokens[i].len && !v->tokens[i].ptr)
            return strata_fail(err, STRATA_EFORMAT, "tokenizer: token %d has no text", (int)i);
        if (v->tokens[i].len > SIZE_MAX - total - 1)
            return strata_fail(err, STRATA_EFORMAT, "tokenizer: token texts too large");
        total += v->tokens[i].len;
    }
    t->text = malloc(total + 1);
    t->text_off = malloc(((size_t)n + 1) * sizeof *t->text_off);
    t->bytes = malloc(total + 1);
    t->bytes_off = malloc(((size_t)n + 1) * sizeof *t->bytes_off);
    if (!t->text || !t->text_off || !t->bytes || !t->bytes_off)
        return strata_fail(err, STRATA_ENOMEM, "tokenizer: out of memory for %zu bytes of token text", total);
    size_t o = 0;
    for (int32_t i = 0; i < n; i++) {
        t->text_off[i] = o;
        if (v->tokens[i].len)
            memcpy(t->text + o, v->tokens[i].ptr, v->tokens[i].len);
        o += v->tokens[i].len;
    }
    t->text_off[n] = o;

    size_t cap = table_size_for((size_t)n);
    t->tok_slots = malloc(cap * sizeof *t->tok_slots);
    if (!t->tok_slots)
        return strata_fail(err, STRATA_ENOMEM, "tokenizer: out of memory");
    memset(t->tok_slots, 0xff, cap * sizeof *t->tok_slots);
    t->tok_mask = cap - 1;
    for (int32_t i = 0; i < n; i++)
        if (t->text_off[i + 1] > t->text_off[i])   /* empty texts can never be produced */
            tok_insert(t, i);

    build_byte_map(t);
    for (int b = 0; b < 256; b++)
        t->byte_tok[b] = tokenizer_find_token(t, (const char *)t->byte_enc[b], t->byte_enc_len[b]);
    o = 0;
    for (int32_t i = 0; i < n; i++) {
        size_t len;
        const char *s = tok_text(t, i, &len);
        t->bytes_off[i] = o;
        o += token_raw_bytes(t, t->type[i], s, len, t->bytes + o);
    }
    t->bytes_off[n] = o;
    return STRATA_OK;
}

/* One "left right" rule of rank `rank`; *joined (of *joined_cap bytes) is scratch for left+right. */
static int build_merge(tokenizer *t, tokenizer_str m, size_t rank, char **joined, size_t *joined_cap,
                       strata_error *err)
{
    if (m.len && !m.ptr)
        return strata_fail(err, STRATA_EFORMAT, "tokenizer: merge %zu has no text", rank);
    /* split at the first space after the first byte, as llama.cpp does */
    const char *sp = m.len > 1 ? memchr(m.ptr + 1, ' ', m.len - 1) : NULL;
    if (!sp)
        return strata_fail(err, STRATA_EFORMAT, "tokenizer: merge %zu ('%.*s') has no space", rank,
                           clamp_len(m.len), m.len ? m.ptr : "");
    size_t ll = (size_t)(sp - m.ptr), rl = m.len - ll - 1;
    int32_t left = tokenizer_find_token(t, m.ptr, ll);
    int32_t right = tokenizer_find_token(t, sp + 1, rl);
    if (left < 0 || right < 0)
        return strata_fail(err, STRATA_EFORMAT, "tokenizer: merge %zu names unknown token '%.*s'", rank,
                           clamp_len(left < 0 ? ll : rl), left < 0 ? m.ptr : sp + 1);
    if (ll + rl > *joined_cap) {
        size_t nc = (ll + rl) * 2;
        char *g = realloc(*joined, nc);
        if (!g)
            return strata_fail(err, STRATA_ENOMEM, "tokenizer: out of memory");
        *joined = g;
        *joined_cap = nc;
    }
    memcpy(*joined, m.ptr, ll);
    memcpy(*joined + ll, sp + 1, rl);
    merge_insert(t, left, right, (int32_t)rank, tokenizer_find_token(t, *joined, ll + rl));
    return STRATA_OK;
}

static int build_merges(tokenizer *t, const tokenizer_vocab *v, strata_error *err)
{
    if (v->n_merges > (size_t)INT32_MAX / 2)
        return strata_fail(err, STRATA_EFORMAT, "tokenizer: %zu merges", v->n_merges);
    if (v->n_merges && !v->merges)
        return strata_fail(err, STRATA_EINVAL, "tokenizer: %zu merges but no merge array", v->n_merges);
    size_t cap = table_size_for(v->n_merges);
    t->merge_slots = malloc(cap * sizeof *t->merge_slots);
    if (!t->merge_slots)
        return strata_fail(err, STRATA_ENOMEM, "tokenizer: out of memory");
    for (size_t i = 0; i < cap; i++)
        t->merge_slots[i].key = MERGE_EMPTY;
    t->merge_mask = cap - 1;
    char *joined = NULL;
    size_t joined_cap = 0;
    int rc = STRATA_OK;
    for (size_t i = 0; i < v->n_merges && rc == STRATA_OK; i++)
        rc = build_merge(t, v->merges[i], i, &joined, &joined_cap, err);
    free(joined);
    return rc;
}

static bool is_matchable_special(const tokenizer *t, int32_t id)
{
    uint8_t ty = t->type[id];
    return (ty == TOKENIZER_TYPE_CONTROL || ty == TOKENIZER_TYPE_USER_DEFINED || ty == TOKENIZER_TYPE_UNKNOWN) &&
           t->text_off[id + 1] > t->text_off[id];
}

/* The special tokens that the input can name, longest first. */
static int build_specials(tokenizer *t, strata_error *err)
{
    size_t ns = 0;
    for (int32_t i = 0; i < t->n_vocab; i++)
        ns += is_matchable_special(t, i);
    t->special = malloc((ns ? ns : 1) * sizeof *t->special);
    if (!t->special)
        return strata_fail(err, STRATA_ENOMEM, "tokenizer: out of memory");
    for (int32_t i = 0; i < t->n_vocab; i++)
        if (is_matchable_special(t, i))
            t->special[t->n_special++] = i;
    if (sort_specials(t) != STRATA_OK)
        return strata_fail(err, STRATA_ENOMEM, "tokenizer: out of memory");
    return STRATA_OK;
}

static int build_extras(tokenizer *t, const tokenizer_vocab *v, strata_error *err)
{
    if (v->bos < -1 || v->bos >= t->n_vocab || v->eos < -1 || v->eos >= t->n_vocab)
        return strata_fail(err, STRATA_EFORMAT, "tokenizer: bos %d or eos %d is out of range (vocabulary of %d)",
                           (int)v->bos, (int)v->eos, (int)t->n_vocab);
    if (v->add_bos && v->bos < 0)
        return strata_fail(err, STRATA_EFORMAT, "tokenizer: tokenizer.ggml.add_bos_token is true but the model names "
                           "no BOS token (tokenizer.ggml.bos_token_id)");
    t->bos = v->bos;
    t->eos = v->eos;
    t->add_bos = v->add_bos;
    if (!v->chat_template.ptr)
        return STRATA_OK;
    if (v->chat_template.len == SIZE_MAX)
        return strata_fail(err, STRATA_EFORMAT, "tokenizer: chat template too large");
    t->chat_template = malloc(v->chat_template.len + 1);
    if (!t->chat_template)
        return strata_fail(err, STRATA_ENOMEM, "tokenizer: out of memory");
    if (v->chat_template.len)
        memcpy(t->chat_template, v->chat_template.ptr, v->chat_template.len);
    t->chat_template[v->chat_template.len] = '\0';
    t->chat_template_len = v->chat_template.len;
    return STRATA_OK;
}

static int build(tokenizer *t, const tokenizer_vocab *v, strata_error *err)
{
    if (v->n_tokens <= 0 || v->n_tokens > INT32_MAX / 2 || !v->tokens)
        return strata_fail(err, STRATA_EFORMAT, "tokenizer: a vocabulary of %d tokens", (int)v->n_tokens);
    t->n_vocab = v->n_tokens;
    int rc;
    if ((rc = build_pre(t, v, err)) || (rc = build_types(t, v, err)) || (rc = build_texts(t, v, err)) ||
        (rc = build_merges(t, v, err)))
        return rc;
    if (encode_fffd(t) != STRATA_OK)
        return strata_fail(err, STRATA_ENOMEM, "tokenizer: out of memory");
    if ((rc = build_specials(t, err)) || (rc = build_extras(t, v, err)))
        return rc;
    return STRATA_OK;
}

tokenizer *tokenizer_from_vocab(const tokenizer_vocab *v, strata_error *err)
{
    if (!v) {
        strata_fail(err, STRATA_EINVAL, "tokenizer: no vocabulary");
        return NULL;
    }
    tokenizer *t = calloc(1, sizeof *t);
    if (!t) {
        strata_fail(err, STRATA_ENOMEM, "tokenizer: out of memory");
        return NULL;
    }
    t->bos = t->eos = -1;
    if (build(t, v, err) != STRATA_OK) {
        tokenizer_free(t);
        return NULL;
    }
    return t;
}

size_t tokenizer_byte_text(uint8_t b, char *out)
{
    uint8_t u[4];
    size_t n = put_utf8(byte_cp(b), u);
    memcpy(out, u, n);
    return n;
}

/* ---- GGUF: the tokenizer.* keys read into a tokenizer_vocab --------------------------------- */

/* The arrays a tokenizer_vocab points to while it is built from a GGUF. */
typedef struct gguf_vocab {
    tokenizer_vocab v;
    tokenizer_str *tokens, *merges;
    uint8_t *types;
} gguf_vocab;

static tokenizer_str from_gguf_str(gguf_str s)
{
    return (tokenizer_str){s.ptr, s.len};
}

static int get_optional_id(const gguf_file *f, const char *key, int32_t n_vocab, int32_t *out,
                           strata_error *err)
{
    *out = -1;
    if (!gguf_has_key(f, key))
        return STRATA_OK;
    uint32_t v;
    strata_error e = {0};
    if (gguf_get_u32(f, key, &v, &e) != STRATA_OK)
        return strata_fail(err, STRATA_EFORMAT, "tokenizer: %s: %s", key, e.msg);
    if (v >= (uint32_t)n_vocab)
        return strata_fail(err, STRATA_EFORMAT, "tokenizer: %s = %u is out of range (vocabulary of %d)",
                           key, v, (int)n_vocab);
    *out = (int32_t)v;
    return STRATA_OK;
}

/* Required keys, the tokenizer model and the pre-tokenizer's name. */
static int gguf_read_kind(const gguf_file *f, gguf_vocab *g, strata_error *err)
{
    strata_error e = {0};   /* the reader's own messages; ours replace them */
    static const char *const required[] = {"tokenizer.ggml.model", "tokenizer.ggml.tokens",
                                           "tokenizer.ggml.merges"};
    for (size_t i = 0; i < sizeof required / sizeof required[0]; i++)
        if (!gguf_has_key(f, required[i]))
            return strata_fail(err, STRATA_EFORMAT, "tokenizer: missing key %s", required[i]);
    gguf_str model;
    if (gguf_get_str(f, "tokenizer.ggml.model", &model, &e) != STRATA_OK)
        return strata_fail(err, STRATA_EFORMAT, "tokenizer: tokenizer.ggml.model is not a string");
    if (!text_eq(from_gguf_str(model), "gpt2"))
        return strata_fail(err, STRATA_EUNSUPPORTED,
                           "tokenizer: tokenizer.ggml.model '%.*s' is not supported (only byte-level BPE, 'gpt2')",
                           clamp_len(model.len), model.ptr);
    if (!gguf_has_key(f, "tokenizer.ggml.pre"))
        return strata_fail(err, STRATA_EUNSUPPORTED,
                           "tokenizer: no tokenizer.ggml.pre key; cannot choose a pre-tokenizer");
    gguf_str pre;
    if (gguf_get_str(f, "tokenizer.ggml.pre", &pre, &e) != STRATA_OK)
        return strata_fail(err, STRATA_EFORMAT, "tokenizer: tokenizer.ggml.pre is not a string");
    g->v.pre = from_gguf_str(pre);
    return STRATA_OK;
}

static int gguf_read_tokens(const gguf_file *f, gguf_vocab *g, strata_error *err)
{
    strata_error e = {0};
    gguf_array toks;
    if (gguf_get_array(f, "tokenizer.ggml.tokens", &toks, &e) != STRATA_OK)
        return strata_fail(err, STRATA_EFORMAT, "tokenizer: tokenizer.ggml.tokens is not an array");
    if (toks.elem_type != GGUF_STRING)
        return strata_fail(err, STRATA_EFORMAT,
                           "tokenizer: tokenizer.ggml.tokens is an array of type %d, not of strings",
                           (int)toks.elem_type);
    if (toks.n == 0 || toks.n > (uint64_t)INT32_MAX / 2)
        return strata_fail(err, STRATA_EFORMAT, "tokenizer: tokenizer.ggml.tokens has %llu entries",
                           (unsigned long long)toks.n);
    g->tokens = malloc((size_t)toks.n * sizeof *g->tokens);
    if (!g->tokens)
        return strata_fail(err, STRATA_ENOMEM, "tokenizer: out of memory");
    for (uint64_t i = 0; i < toks.n; i++)
        g->tokens[i] = from_gguf_str(gguf_array_str(&toks, i));
    g->v.tokens = g->tokens;
    g->v.n_tokens = (int32_t)toks.n;
    return STRATA_OK;
}

/* Token types are optional: all normal when absent. */
static int gguf_read_types(const gguf_file *f, gguf_vocab *g, strata_error *err)
{
    if (!gguf_has_key(f, "tokenizer.ggml.token_type"))
        return STRATA_OK;
    strata_error e = {0};
    gguf_array types;
    if (gguf_get_array(f, "tokenizer.ggml.token_type", &types, &e) != STRATA_OK)
        return strata_fail(err, STRATA_EFORMAT, "tokenizer: tokenizer.ggml.token_type is not an array");
    switch (types.elem_type) {
    case GGUF_UINT8: case GGUF_INT8: case GGUF_UINT16: case GGUF_INT16: case GGUF_UINT32:
    case GGUF_INT32: case GGUF_UINT64: case GGUF_INT64:
        break;
    default:
        return strata_fail(err, STRATA_EFORMAT,
                           "tokenizer: tokenizer.ggml.token_type is an array of type %d, not of integers",
                           (int)types.elem_type);
    }
    if (types.n != (uint64_t)g->v.n_tokens)
        return strata_fail(err, STRATA_EFORMAT,
                           "tokenizer: tokenizer.ggml.token_type has %llu entries for %d tokens",
                           (unsigned long long)types.n, (int)g->v.n_tokens);
    g->types = malloc((size_t)types.n);
    if (!g->types)
        return strata_fail(err, STRATA_ENOMEM, "tokenizer: out of memory");
    for (int32_t i = 0; i < g->v.n_tokens; i++) {
        int64_t v = gguf_array_int(&types, (uint64_t)i);
        if (v < 0 || v > TOKENIZER_TYPE_BYTE)
            return strata_fail(err, STRATA_EFORMAT, "tokenizer: token %d has invalid type %lld", (int)i,
                               (long long)v);
        g->types[i] = (uint8_t)v;
    }
    g->v.types = g->types;
    return STRATA_OK;
}

static int gguf_read_merges(const gguf_file *f, gguf_vocab *g, strata_error *err)
{
    strata_error e = {0};
    gguf_array merges;
    if (gguf_get_array(f, "tokenizer.ggml.merges", &merges, &e) != STRATA_OK)
        return strata_fail(err, STRATA_EFORMAT, "tokenizer: tokenizer.ggml.merges is not an array");
    if (merges.elem_type != GGUF_STRING)
        return strata_fail(err, STRATA_EFORMAT,
                           "tokenizer: tokenizer.ggml.merges is an array of type %d, not of strings",
                           (int)merges.elem_type);
    if (merges.n > (uint64_t)INT32_MAX / 2)
        return strata_fail(err, STRATA_EFORMAT, "tokenizer: tokenizer.ggml.merges has %llu entries",
                           (unsigned long long)merges.n);
    g->merges = malloc((merges.n ? (size_t)merges.n : 1) * sizeof *g->merges);
    if (!g->merges)
        return strata_fail(err, STRATA_ENOMEM, "tokenizer: out of memory");
    for (uint64_t i = 0; i < merges.n; i++)
        g->merges[i] = from_gguf_str(gguf_array_str(&merges, i));
    g->v.merges = g->merges;
    g->v.n_merges = (size_t)merges.n;
    return STRATA_OK;
}

/* BOS, EOS, add_bos and the chat template, all optional. */
static int gguf_read_extras(const gguf_file *f, gguf_vocab *g, strata_error *err)
{
    strata_error e = {0};
    int rc;
    if ((rc = get_optional_id(f, "tokenizer.ggml.bos_token_id", g->v.n_tokens, &g->v.bos, err)) != STRATA_OK ||
        (rc = get_optional_id(f, "tokenizer.ggml.eos_token_id", g->v.n_tokens, &g->v.eos, err)) != STRATA_OK)
        return rc;
    if (gguf_has_key(f, "tokenizer.ggml.add_bos_token") &&
        gguf_get_bool(f, "tokenizer.ggml.add_bos_token", &g->v.add_bos, &e) != STRATA_OK)
        return strata_fail(err, STRATA_EFORMAT, "tokenizer: tokenizer.ggml.add_bos_token is not a bool");
    if (gguf_has_key(f, "tokenizer.chat_template")) {
        gguf_str tpl;
        if (gguf_get_str(f, "tokenizer.chat_template", &tpl, &e) != STRATA_OK)
            return strata_fail(err, STRATA_EFORMAT, "tokenizer: tokenizer.chat_template is not a string");
        /* an empty template is still a template: keep a non-NULL pointer */
        g->v.chat_template = (tokenizer_str){tpl.len ? tpl.ptr : "", tpl.len};
    }
    return STRATA_OK;
}

tokenizer *tokenizer_from_gguf(const gguf_file *f, strata_error *err)
{
    if (!f) {
        strata_fail(err, STRATA_EINVAL, "tokenizer: no GGUF file");
        return NULL;
    }
    gguf_vocab g = {.v = {.bos = -1, .eos = -1}};
    int rc;
    tokenizer *t = NULL;
    if (!(rc = gguf_read_kind(f, &g, err)) && !(rc = gguf_read_tokens(f, &g, err)) &&
        !(rc = gguf_read_types(f, &g, err)) && !(rc = gguf_read_merges(f, &g, err)) &&
        !(rc = gguf_read_extras(f, &g, err)))
        t = tokenizer_from_vocab(&g.v, err);
    free(g.tokens);
    free(g.types);
    free(g.merges);
    return t;
}

void tokenizer_free(tokenizer *t)
{
    if (!t)
        return;
    free(t->text);
    free(t->text_off);
    free(t->bytes);
    free(t->bytes_off);
    free(t->type);
    free(t->tok_slots);
    free(t->merge_slots);
    free(t->special);
    free(t->chat_template);
    free(t);
}

int tokenizer_n_vocab(const tokenizer *t) { return t ? (int)t->n_vocab : 0; }
int32_t tokenizer_bos(const tokenizer *t) { return t ? t->bos : -1; }
int32_t tokenizer_eos(const tokenizer *t) { return t ? t->eos : -1; }
bool tokenizer_add_bos(const tokenizer *t) { return t && t->add_bos; }

int tokenizer_token_type(const tokenizer *t, int32_t id)
{
    if (!t || id < 0 || id >= t->n_vocab)
        return -1;
    return t->type[id];
}

bool tokenizer_is_control(const tokenizer *t, int32_t id)
{
    return tokenizer_token_type(t, id) == TOKENIZER_TYPE_CONTROL;
}

bool tokenizer_is_text(const tokenizer *t, int32_t id)
{
    const int ty = tokenizer_token_type(t, id);
    return ty >= 0 && ty != TOKENIZER_TYPE_CONTROL && ty != TOKENIZER_TYPE_UNKNOWN && ty != TOKENIZER_TYPE_UNUSED;
}

const char *tokenizer_token_bytes(const tokenizer *t, int32_t id, size_t *len)
{
    if (!t || id < 0 || id >= t->n_vocab) {
        if (len)
            *len = 0;
        return NULL;
    }
    if (len)
        *len = t->bytes_off[id + 1] - t->bytes_off[id];
    return t->bytes + t->bytes_off[id];
}

/* ---------------------------------------------------------------------------------------- */
/* Encoding */

typedef struct ids_vec {
    int32_t *v;
    size_t n, cap;
} ids_vec;

static int ids_push(ids_vec *a, int32_t id)
{
    if (a->n == a->cap) {
        size_t nc = a->cap ? a->cap * 2 : 64;
        if (nc > SIZE_MAX / sizeof *a->v)
            return STRATA_ENOMEM;
        int32_t *g = realloc(a->v, nc * sizeof *g);
        if (!g)
            return STRATA_ENOMEM;
        a->v = g;
        a->cap = nc;
    }
    a->v[a->n++] = id;
    return STRATA_OK;
}

typedef struct bpe_sym {
    int32_t id;       /* token of the symbol's text, -1 when it is not a token */
    int32_t prev, next;
    uint32_t n;       /* bytes; 0 once merged into its left neighbour */
    size_t start;     /* byte offset in the piece */
} bpe_sym;

typedef struct bpe_pair {
    int32_t rank;
    int32_t left, right;
    uint32_t left_n, right_n;   /* symbol lengths when queued: a changed length means stale */
    int32_t result;
} bpe_pair;

/* Scratch state of one encode call. */
typedef struct enc_state {
    const tokenizer *t;
    const char *text;         /* base of the fragment being split */
    pretok_buf pre;
    bpe_sym *sym;
    size_t sym_cap;
    bpe_pair *heap;
    size_t heap_n, heap_cap;
    uint8_t *bad;             /* per byte of the piece: 1 when it does not decode as UTF-8 */
    size_t bad_cap;
    ids_vec out;
} enc_state;

static bool pair_less(const bpe_pair *a, const bpe_pair *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static int heap_push(enc_state *s, const bpe_pair *p)
{
    if (s->heap_n == s->heap_cap) {
        size_t nc = s->heap_cap ? s->heap_cap * 2 : 64;
        if (nc > SIZE_MAX / sizeof *s->heap)
            return STRATA_ENOMEM;
        bpe_pair *g = realloc(s->heap, nc * sizeof *g);
        if (!g)
            return STRATA_ENOMEM;
        s->heap = g;
        s->heap_cap = nc;
    }
    size_t i = s->heap_n++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!pair_less(p, &s->heap[parent]))
            break;
        s->heap[i] = s->heap[parent];
        i = parent;
    }
    s->heap[i] = *p;
    return STRATA_OK;
}

static bpe_pair heap_pop(enc_state *s)
{
    bpe_pair top = s->heap[0];
    bpe_pair last = s->heap[--s->heap_n];
    size_t n = s->heap_n, i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && pair_less(&s->heap[c + 1], &s->heap[c]))
            c++;
        if (!pair_less(&s->heap[c], &last))
            break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    if (n)
        s->heap[i] = last;
    return top;
}

/* Queues the merge of symbols l and r when the vocabulary has one. */
static int queue_pair(enc_state *s, int32_t l, int32_t r)
{
    if (l < 0 || r < 0)
        return STRATA_OK;
    const bpe_sym *a = &s->sym[l], *b = &s->sym[r];
    if (a->id < 0 || b->id < 0)
        return STRATA_OK;
    const merge_slot *m = merge_find(s->t, a->id, b->id);
    if (!m)
        return STRATA_OK;
    bpe_pair p = {m->rank, l, r, a->n, b->n, m->result};
    return heap_push(s, &p);
}

/* Marks the bytes of a piece that are not part of well-formed UTF-8 (strictly: overlong forms
 * such as C0 AF count as invalid too). Pieces start on a code point. */
static int mark_bad_bytes(enc_state *s, const uint8_t *p, size_t n)
{
    if (n > s->bad_cap) {
        uint8_t *g = realloc(s->bad, n);
        if (!g)
            return STRATA_ENOMEM;
        s->bad = g;
        s->bad_cap = n;
    }
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t k = pretok_decode_utf8(p + i, n - i, &cp);
        if ((k == 2 && cp < 0x80) || (k == 3 && (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff))) ||
            (k == 4 && cp < 0x10000))
            k = 1;   /* overlong or surrogate: the lead byte is invalid on its own */
        s->bad[i] = k == 1 && p[i] >= 0x80;
        for (size_t j = 1; j < k; j++)
            s->bad[i + j] = 0;
        i += k;
    }
    return STRATA_OK;
}

/* BPE over one piece text[start..end) (end > start): symbols are its bytes (each one GPT-2
 * byte-encoded character), merged lowest rank first, leftmost first on ties. */
static int bpe_piece(void *ctx, size_t start, size_t end)
{
    enc_state *s = ctx;
    const tokenizer *t = s->t;
    const uint8_t *p = (const uint8_t *)s->text + start;
    size_t n = end - start;
    int rc;

    if (n == 1) {   /* fast path: a single byte cannot merge */
        int32_t id = t->byte_tok[p[0]];
        if (id >= 0)
            return ids_push(&s->out, id);
        /* no byte token: a lone byte >= 0x80 is invalid UTF-8 and becomes U+FFFD (see below) */
        for (size_t j = 0; p[0] >= 0x80 && j < t->n_fffd; j++)
            if ((rc = ids_push(&s->out, t->fffd[j])) != STRATA_OK)
                return rc;
        return STRATA_OK;
    }
    if (n > (size_t)INT32_MAX)
        return STRATA_ENOMEM;
    if (n > s->sym_cap) {
        size_t nc = s->sym_cap ? s->sym_cap : 64;
        while (nc < n)
            nc *= 2;
        bpe_sym *g = realloc(s->sym, nc * sizeof *g);
        if (!g)
            return STRATA_ENOMEM;
        s->sym = g;
        s->sym_cap = nc;
    }
    for (size_t i = 0; i < n; i++) {
        s->sym[i].id = t->byte_tok[p[i]];
        s->sym[i].prev = (int32_t)i - 1;
        s->sym[i].next = i + 1 < n ? (int32_t)i + 1 : -1;
        s->sym[i].n = 1;
        s->sym[i].start = i;
    }
    s->heap_n = 0;
    for (size_t i = 1; i < n; i++)
        if ((rc = queue_pair(s, (int32_t)i - 1, (int32_t)i)) != STRATA_OK)
            return rc;
    while (s->heap_n) {
        bpe_pair q = heap_pop(s);
        bpe_sym *l = &s->sym[q.left], *r = &s->sym[q.right];
        if (l->n != q.left_n || r->n != q.right_n)
            continue;   /* one side changed since this pair was queued */
        l->n += r->n;
        l->id = q.result;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0)
            s->sym[r->next].prev = q.left;
        if ((rc = queue_pair(s, l->prev, q.left)) != STRATA_OK ||
            (rc = queue_pair(s, q.left, l->next)) != STRATA_OK)
            return rc;
    }
    bool have_bad = false;
    for (int32_t i = 0; i >= 0; i = s->sym[i].next) {
        const bpe_sym *y = &s->sym[i];
        if (y->id >= 0) {
            if ((rc = ids_push(&s->out, y->id)) != STRATA_OK)
                return rc;
            continue;
        }
        /* Not a token: a merge produced text outside the vocabulary (malformed vocabulary), or
         * a byte without a byte token. Emit the bytes' own tokens; a byte that has none is
         * dropped as llama.cpp does, except that an invalid UTF-8 byte becomes U+FFFD (which
         * is what llama.cpp encodes for it). */
        for (size_t k = 0; k < y->n; k++) {
            uint8_t b = p[y->start + k];
            int32_t id = t->byte_tok[b];
            if (id >= 0) {
                if ((rc = ids_push(&s->out, id)) != STRATA_OK)
                    return rc;
                continue;
            }
            if (b < 0x80)
                continue;
            if (!have_bad) {
                if ((rc = mark_bad_bytes(s, p, n)) != STRATA_OK)
                    return rc;
                have_bad = true;
            }
            if (!s->bad[y->start + k])
                continue;
            for (size_t j = 0; j < t->n_fffd; j++)
                if ((rc = ids_push(&s->out, t->fffd[j])) != STRATA_OK)
                    return rc;
        }
    }
    return STRATA_OK;
}

/* The tokens of U+FFFD (as one pre-tokenizer piece), used for invalid bytes without a token. */
static int encode_fffd(tokenizer *t)
{
    static const char fffd[] = "\xef\xbf\xbd";
    enc_state s = {0};
    s.t = t;
    s.text = fffd;
    t->n_fffd = 0;
    int rc = bpe_piece(&s, 0, 3);
    if (rc == STRATA_OK) {
        for (size_t i = 0; i < s.out.n && i < 4; i++)
            t->fffd[i] = s.out.v[i];
        t->n_fffd = s.out.n < 4 ? s.out.n : 4;
    }
    free(s.sym);
    free(s.heap);
    free(s.bad);
    free(s.out.v);
    return rc;
}

/* A stretch of the input: raw text (id < 0) or one special token. */
typedef struct fragment {
    size_t off, len;
    int32_t id;
} fragment;

typedef struct frag_vec {
    fragment *v;
    size_t n, cap;
} frag_vec;

static int frag_push(frag_vec *a, size_t off, size_t len, int32_t id)
{
    if (a->n == a->cap) {
        size_t nc = a->cap ? a->cap * 2 : 16;
        if (nc > SIZE_MAX / sizeof *a->v)
            return STRATA_ENOMEM;
        fragment *g = realloc(a->v, nc * sizeof *g);
        if (!g)
            return STRATA_ENOMEM;
        a->v = g;
        a->cap = nc;
    }
    a->v[a->n].off = off;
    a->v[a->n].len = len;
    a->v[a->n].id = id;
    a->n++;
    return STRATA_OK;
}

/* Splits the raw fragments around the special tokens, longest token first, leftmost
 * occurrences first (llama.cpp's tokenizer_st_partition). */
static int partition_special(const tokenizer *t, const char *text, size_t len, bool parse_special,
                             frag_vec *cur)
{
    frag_vec next = {0};
    int rc = frag_push(cur, 0, len, -1);
    for (size_t k = 0; rc == STRATA_OK && k < t->n_special; k++) {
        int32_t sid = t->special[k];
        if (!parse_special && t->type[sid] != TOKENIZER_TYPE_USER_DEFINED)
            continue;
        size_t sl;
        const char *st = tok_text(t, sid, &sl);
        next.n = 0;
        for (size_t i = 0; rc == STRATA_OK && i < cur->n; i++) {
            fragment fr = cur->v[i];
            if (fr.id >= 0 || fr.len < sl) {
                rc = frag_push(&next, fr.off, fr.len, fr.id);
                continue;
            }
            size_t pos = fr.off, end = fr.off + fr.len;
            while (rc == STRATA_OK && pos < end) {
                const char *hit = end - pos >= sl ? memmem(text + pos, end - pos, st, sl) : NULL;
                if (!hit) {
                    rc = frag_push(&next, pos, end - pos, -1);
                    break;
                }
                size_t at = (size_t)(hit - text);
                if (at > pos)
                    rc = frag_push(&next, pos, at - pos, -1);
                if (rc == STRATA_OK)
                    rc = frag_push(&next, at, sl, sid);
                pos = at + sl;
            }
        }
        frag_vec tmp = *cur;
        *cur = next;
        next = tmp;
    }
    free(next.v);
    return rc;
}

int tokenizer_encode(const tokenizer *t, const char *text, size_t len, bool parse_special,
                     int32_t **ids_out, size_t *n_out, strata_error *err)
{
    if (ids_out)
        *ids_out = NULL;
    if (n_out)
        *n_out = 0;
    if (!t || !ids_out || !n_out || (!text && len))
        return strata_fail(err, STRATA_EINVAL, "tokenizer_encode: NULL argument");

    enc_state s = {0};
    s.t = t;
    s.text = text;
    frag_vec frags = {0};
    int rc = partition_special(t, text, len, parse_special, &frags);
    for (size_t i = 0; rc == STRATA_OK && i < frags.n; i++) {
        const fragment *fr = &frags.v[i];
        if (fr->id >= 0) {
            rc = ids_push(&s.out, fr->id);
        } else {
            s.text = text ? text + fr->off : text;   /* empty input may come as NULL; NULL + 0 is UB */
            rc = pretokenize(s.text, fr->len, t->digit_split, &s.pre, bpe_piece, &s);
        }
    }
    if (rc == STRATA_OK && !s.out.v && !(s.out.v = malloc(sizeof *s.out.v)))
        rc = STRATA_ENOMEM;
    free(frags.v);
    pretok_buf_free(&s.pre);
    free(s.sym);
    free(s.heap);
    free(s.bad);
    if (rc != STRATA_OK) {
        free(s.out.v);
        return strata_fail(err, rc, "tokenizer_encode: out of memory encoding %zu bytes", len);
    }
    *ids_out = s.out.v;
    *n_out = s.out.n;
    return STRATA_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* Decoding */

int tokenizer_decode(const tokenizer *t, const int32_t *ids, size_t n, bool include_control,
                     char **out, size_t *out_len, strata_error *err)
{
    if (out)
        *out = NULL;
    if (out_len)
        *out_len = 0;
    if (!t || !out || !out_len || (!ids && n))
        return strata_fail(err, STRATA_EINVAL, "tokenizer_decode: NULL argument");
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= t->n_vocab)
            return strata_fail(err, STRATA_EINVAL, "tokenizer_decode: token id %d at %zu is out of range (vocabulary of %d)",
                               (int)id, i, (int)t->n_vocab);
        if (!include_control && !tokenizer_is_text(t, id))
            continue;
        total += t->bytes_off[id + 1] - t->bytes_off[id];   /* bounded by n * max token length */
    }
    char *buf = malloc(total + 1);
    if (!buf)
        return strata_fail(err, STRATA_ENOMEM, "tokenizer_decode: out of memory for %zu bytes", total);
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (!include_control && !tokenizer_is_text(t, id))
            continue;
        size_t k = t->bytes_off[id + 1] - t->bytes_off[id];
        memcpy(buf + o, t->bytes + t->bytes_off[id], k);
        o += k;
    }
    buf[o] = '\0';
    *out = buf;
    *out_len = o;
    return STRATA_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* Chat template */

static const char *find_str(const char *hay, size_t n, const char *needle)
{
    return memmem(hay, n, needle, strlen(needle));
}

/* Looks for a string literal of the template that starts with "<|im_start|>system" + newline
 * and holds a whole system turn: '<|im_start|>system\n...<|im_end|>...'. On success *sys is the
 * malloc'd, unescaped system text (NULL when the template has no default system prompt). */
static int chatml_default_system(const char *tpl, size_t n, char **sys, strata_error *err)
{
    static const char head[] = "<|im_start|>system";
    static const char tail[] = "<|im_end|>";
    *sys = NULL;
    const char *p = tpl, *end = tpl + n;
    while ((p = find_str(p, (size_t)(end - p), head)) != NULL) {
        const char *lit = p;
        p += sizeof head - 1;
        if (lit == tpl || (lit[-1] != '\'' && lit[-1] != '"'))
            continue;
        char quote = lit[-1];
        const char *q = p;
        if (q < end && *q == '\n')
            q++;
        else if (end - q >= 2 && q[0] == '\\' && q[1] == 'n')
            q += 2;
        else
            continue;
        /* unescape up to <|im_end|>, failing at the literal's closing quote */
        char *buf = malloc((size_t)(end - q) + 1);
        if (!buf)
            return strata_fail(err, STRATA_ENOMEM, "tokenizer: out of memory");
        size_t o = 0;
        bool found = false;
        while (q < end) {
            if ((size_t)(end - q) >= sizeof tail - 1 && memcmp(q, tail, sizeof tail - 1) == 0) {
                found = true;
                break;
            }
            if (*q == quote)
                break;
            if (*q == '\\' && q + 1 < end) {
                char c = q[1];
                buf[o++] = c == 'n' ? '\n' : c == 't' ? '\t' : c == 'r' ? '\r' : c;
                q += 2;
                continue;
            }
            buf[o++] = *q++;
        }
        if (!found) {
            free(buf);
            continue;
        }
        buf[o] = '\0';
        *sys = buf;
        return STRATA_OK;
    }
    return STRATA_OK;
}

static int check_chatml(const char *tpl, size_t n, strata_error *err)
{
    static const char *const needed[] = {"<|im_start|>", "<|im_end|>", "role", "content",
                                         "add_generation_prompt", "<|im_start|>assistant"};
    for (size_t i = 0; i < sizeof needed / sizeof needed[0]; i++)
        if (!find_str(tpl, n, needed[i]))
            return strata_fail(err, STRATA_EUNSUPPORTED,
                               "tokenizer: the chat template is not ChatML-style (no '%s'); only ChatML "
                               "templates (<|im_start|>role ... <|im_end|>) are supported",
                               needed[i]);
    return STRATA_OK;
}

static void append(char *buf, size_t *o, const char *s)
{
    size_t k = strlen(s);
    memcpy(buf + *o, s, k);
    *o += k;
}

int tokenizer_apply_chat(const tokenizer *t, const char *system, const char *user, char **out,
                         strata_error *err)
{
    if (out)
        *out = NULL;
    if (!t || !user || !out)
        return strata_fail(err, STRATA_EINVAL, "tokenizer_apply_chat: NULL argument");
    if (!t->chat_template)
        return strata_fail(err, STRATA_EUNSUPPORTED,
                           "tokenizer: the model has no tokenizer.chat_template; cannot render a chat");
    int rc = check_chatml(t->chat_template, t->chat_template_len, err);
    if (rc)
        return rc;
    char *def = NULL;
    if (!system) {
        if ((rc = chatml_default_system(t->chat_template, t->chat_template_len, &def, err)) != STRATA_OK)
            return rc;
        system = def;
    }
    static const char sys_head[] = "<|im_start|>system\n";
    static const char user_head[] = "<|im_start|>user\n";
    static const char end_turn[] = "<|im_end|>\n";
    static const char gen[] = "<|im_start|>assistant\n";
    size_t ls = system ? strlen(system) : 0, lu = strlen(user);
    size_t need = sizeof sys_head + ls + sizeof end_turn + sizeof user_head + lu + sizeof end_turn +
                  sizeof gen + 1;
    if (ls > SIZE_MAX / 4 || lu > SIZE_MAX / 4) {
        free(def);
        return strata_fail(err, STRATA_EINVAL, "tokenizer_apply_chat: message too long");
    }
    char *buf = malloc(need);
    if (!buf) {
        free(def);
        return strata_fail(err, STRATA_ENOMEM, "tokenizer_apply_chat: out of memory");
    }
    size_t o = 0;
    if (system) {
        append(buf, &o, sys_head);
        append(buf, &o, system);
        append(buf, &o, end_turn);
    }
    append(buf, &o, user_head);
    append(buf, &o, user);
    append(buf, &o, end_turn);
    append(buf, &o, gen);
    buf[o] = '\0';
    free(def);
    *out = buf;
    return STRATA_OK;
}

bool tokenizer_is_eog(const tokenizer *t, int32_t id)
{
    if (id == tokenizer_eos(t))
        return true;
    const int ty = tokenizer_token_type(t, id);
    if (ty != TOKENIZER_TYPE_CONTROL && ty != TOKENIZER_TYPE_USER_DEFINED)
        return false;
    size_t len;
    const char *s = tokenizer_token_bytes(t, id, &len);
    static const char *const eog[] = {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "</s>", "<|end|>"};
    for (size_t i = 0; i < sizeof eog / sizeof eog[0]; i++)
        if (s && len == strlen(eog[i]) && memcmp(s, eog[i], len) == 0)
            return true;
    return false;
}
