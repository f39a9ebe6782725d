/* The sequence image's writer and reader (seq_image.h; layout in docs/format.md section 10). */
#include "kvstore/seq_image.h"

#include <stdlib.h>
#include <string.h>

#include "kvstore/bytes.h"
#include "kvstore/crc32c.h"
#include "kvstore/plan.h"

#define SEQ_IMAGE_MAGIC 0x49564b53u   /* "SKVI" */
#define SEQ_IMAGE_VERSION 2u          /* 2: the plan follows the head (sequences may have their own) */
#define SEQ_IMAGE_HEAD 24u            /* magic, version, flags, n_layers, heads, head_dim, block_tokens */
#define SEQ_IMAGE_PLAN_MAX 65536u     /* a plan's range list never comes near it */
#define SEQ_IMAGE_LAYER_HEAD 16u      /* n_blocks, tail_len, prompt_end */

typedef struct image_writer {
    uint8_t *buf;
    size_t len, cap;
} image_writer;

static int image_room(image_writer *w, size_t more, strata_error *err)
{
    if (more <= w->cap - w->len)
        return STRATA_OK;
    size_t cap = w->cap ? w->cap : 4096;
    while (cap - w->len < more) {
        if (cap > SIZE_MAX / 2)
            return strata_fail(err, STRATA_ENOMEM, "kv export: image too large");
        cap *= 2;
    }
    uint8_t *grown = realloc(w->buf, cap);
    if (!grown)
        return strata_fail(err, STRATA_ENOMEM, "kv export: out of memory for a %zu-byte image", cap);
    w->buf = grown;
    w->cap = cap;
    return STRATA_OK;
}

static int write_layer(const kv_geometry *g, const kv_image_source *src, int l, image_writer *w, uint16_t **rows,
                       size_t *rows_cap, strata_error *err)
{
    const size_t row = (size_t)g->n_kv_heads * (size_t)g->head_dim;
    kv_image_layer L;
    int rc = src->layer(src->ctx, l, &L, err);
    if (rc != STRATA_OK)
        return rc;
    if (L.n_blocks > UINT32_MAX || L.tail_len > UINT32_MAX || L.ott_bytes > UINT32_MAX)
        return strata_fail(err, STRATA_EINVAL, "kv export: layer %d is too large for the image", l);
    if ((rc = image_room(w, SEQ_IMAGE_LAYER_HEAD + 4 + L.ott_bytes, err)) != STRATA_OK)
        return rc;
    kv_st32(w->buf + w->len, (uint32_t)L.n_blocks);
    kv_st32(w->buf + w->len + 4, (uint32_t)L.tail_len);
    kv_st64(w->buf + w->len + 8, (uint64_t)L.prompt_end);
    kv_st32(w->buf + w->len + 16, (uint32_t)L.ott_bytes);
    w->len += SEQ_IMAGE_LAYER_HEAD + 4;
    /* OTT's pool state decides which tokens of future blocks stay fp16: it travels too. */
    if (L.ott_bytes && (rc = src->ott_state(src->ctx, l, w->buf + w->len, err)) != STRATA_OK)
        return rc;
    w->len += L.ott_bytes;
    for (size_t b = 0; b < L.n_blocks; b++) {
        uint32_t bytes = 0;
        if ((rc = src->block_bytes(src->ctx, l, b, &bytes, err)) != STRATA_OK ||
            (rc = image_room(w, 4 + (size_t)bytes, err)) != STRATA_OK)
            return rc;
        kv_st32(w->buf + w->len, bytes);
        if ((rc = src->block(src->ctx, l, b, w->buf + w->len + 4, err)) == STRATA_OK)
            rc = kv_block_verify(w->buf + w->len + 4, bytes, NULL, err);
        if (rc != STRATA_OK)
            return strata_error_prefix(err, "kv export: layer %d block %zu", l, b);
        w->len += 4 + (size_t)bytes;
    }
    const size_t n = L.tail_len * row;
    if (2 * n > *rows_cap) {
        uint16_t *grown = realloc(*rows, 2 * n * sizeof *grown);
        if (!grown)
            return strata_fail(err, STRATA_ENOMEM, "kv export: out of memory for a tail of %zu rows", L.tail_len);
        *rows = grown;
        *rows_cap = 2 * n;
    }
    if (n && (rc = src->tail(src->ctx, l, *rows, *rows + n, err)) != STRATA_OK)
        return rc;
    if ((rc = image_room(w, 2 * n * sizeof(uint16_t), err)) != STRATA_OK)
        return rc;
    for (size_t i = 0; i < 2 * n; i++)   /* K rows then V rows, each value little-endian */
        kv_st16(w->buf + w->len + 2 * i, (*rows)[i]);
    w->len += 2 * n * sizeof(uint16_t);
    return STRATA_OK;
}

int kv_image_write(const kv_geometry *g, const kv_image_source *src, uint8_t **out, size_t *out_len,
                   strata_error *err)
{
    *out = NULL;
    *out_len = 0;
    if (!g || !src)
        return strata_fail(err, STRATA_EINVAL, "kv export: NULL argument");
    if (!src->codecs || g->n_layers < 1)
        return strata_fail(err, STRATA_EINVAL, "kv export: the sequence's plan is missing");
    char *plan = kv_plan_name(src->codecs, g->n_layers);
    if (!plan)
        return strata_fail(err, STRATA_ENOMEM, "kv export: out of memory");
    const size_t plan_len = strlen(plan);
    image_writer w = {0};
    uint16_t *rows = NULL;
    size_t rows_cap = 0;
    int rc = plan_len == 0 || plan_len > SEQ_IMAGE_PLAN_MAX
                 ? strata_fail(err, STRATA_EINVAL, "kv export: the sequence's plan does not format")
                 : image_room(&w, SEQ_IMAGE_HEAD + 4 + plan_len, err);
    if (rc == STRATA_OK) {
        kv_st32(w.buf, SEQ_IMAGE_MAGIC);
        kv_st16(w.buf + 4, SEQ_IMAGE_VERSION);
        kv_st16(w.buf + 6, 0);
        kv_st32(w.buf + 8, (uint32_t)g->n_layers);
        kv_st32(w.buf + 12, (uint32_t)g->n_kv_heads);
        kv_st32(w.buf + 16, (uint32_t)g->head_dim);
        kv_st32(w.buf + 20, (uint32_t)g->block_tokens);
        kv_st32(w.buf + SEQ_IMAGE_HEAD, (uint32_t)plan_len);
        memcpy(w.buf + SEQ_IMAGE_HEAD + 4, plan, plan_len);
        w.len = SEQ_IMAGE_HEAD + 4 + plan_len;
    }
    free(plan);
    for (int l = 0; rc == STRATA_OK && l < g->n_layers; l++)
        rc = write_layer(g, src, l, &w, &rows, &rows_cap, err);
    if (rc == STRATA_OK && (rc = image_room(&w, 4, err)) == STRATA_OK) {
        kv_st32(w.buf + w.len, kv_crc32c(0, w.buf, w.len));
        w.len += 4;
    }
    free(rows);
    if (rc != STRATA_OK) {
        free(w.buf);
        return rc;
    }
    *out = w.buf;
    *out_len = w.len;
    return STRATA_OK;
}

uint64_t kv_image_max_bytes(const kv_geometry *g, uint64_t max_tokens, uint64_t block_bytes)
{
    if (!g || g->n_layers < 1 || g->block_tokens < 1)
        return 0;
    const uint64_t heads = (uint64_t)g->n_kv_heads, row = heads * (uint64_t)g->head_dim;
    /* OTT: pool_tokens * n_kv_heads <= 65535 (kv_codec_validate), one entry per head at least */
    const uint64_t ott = heads * 12 + 16 * (heads > 65535 ? heads : 65535);
    const uint64_t blocks = (max_tokens + (uint64_t)g->block_tokens - 1) / (uint64_t)g->block_tokens;
    const uint64_t layer = SEQ_IMAGE_LAYER_HEAD + 4 + ott + 4 * blocks + 2 * max_tokens * row * sizeof(uint16_t);
    return SEQ_IMAGE_HEAD + 4 + SEQ_IMAGE_PLAN_MAX + (uint64_t)g->n_layers * layer + block_bytes + 4;
}

/* Reads n bytes at *at of an image body of len bytes; NULL when it runs past the end. */
static const uint8_t *image_take(const uint8_t *img, size_t len, size_t *at, size_t n)
{
    if (n > len - *at)
        return NULL;
    const uint8_t *p = img + *at;
    *at += n;
    return p;
}

static int read_layer(const kv_geometry *g, const uint8_t *img, size_t body, size_t *at, int l,
                      const kv_image_sink *sink, size_t *tokens, strata_error *err)
{
    const size_t row = (size_t)g->n_kv_heads * (size_t)g->head_dim, bt = (size_t)g->block_tokens;
    const uint8_t *h = image_take(img, body, at, SEQ_IMAGE_LAYER_HEAD + 4);
    if (!h)
        return strata_fail(err, STRATA_EFORMAT, "kv import: the image ends in layer %d", l);
    kv_image_layer L = {.n_blocks = kv_ld32(h), .tail_len = kv_ld32(h + 4), .ott_bytes = kv_ld32(h + 16)};
    const uint64_t prompt_end = kv_ld64(h + 8);
    *tokens = L.n_blocks * bt + L.tail_len;   /* both < 2^32: no overflow in a 64-bit size_t */
    if (L.n_blocks > SIZE_MAX / bt / 2 || prompt_end > *tokens)
        return strata_fail(err, STRATA_EINVAL, "kv import: layer %d: %zu blocks, %zu tail tokens and a prompt of %llu "
                           "do not make a sequence", l, L.n_blocks, L.tail_len, (unsigned long long)prompt_end);
    L.prompt_end = (size_t)prompt_end;
    const uint8_t *ott = L.ott_bytes ? image_take(img, body, at, L.ott_bytes) : NULL;
    if (L.ott_bytes && !ott)
        return strata_fail(err, STRATA_EFORMAT, "kv import: the image ends in layer %d's OTT state", l);
    int rc = sink->layer(sink->ctx, l, &L, ott, err);
    for (size_t b = 0; rc == STRATA_OK && b < L.n_blocks; b++) {
        const uint8_t *szp = image_take(img, body, at, 4);
        const size_t bytes = szp ? kv_ld32(szp) : 0;
        const uint8_t *data = szp ? image_take(img, body, at, bytes) : NULL;
        kv_block blk;
        if (!data) {
            rc = strata_fail(err, STRATA_EFORMAT, "kv import: the image ends in layer %d block %zu", l, b);
        } else if ((rc = kv_block_verify(data, bytes, &blk, err)) != STRATA_OK) {
            strata_error_prefix(err, "kv import: layer %d block %zu", l, b);
        } else if (blk.block_bytes != bytes || blk.desc.layer != (uint32_t)l || blk.desc.first_pos != b * bt ||
                   blk.desc.n_tokens != bt) {
            rc = strata_fail(err, STRATA_EINVAL, "kv import: layer %d block %zu holds layer %u from position %llu, "
                             "%u tokens in %zu bytes: not block %zu of layer %d", l, b, blk.desc.layer,
                             (unsigned long long)blk.desc.first_pos, blk.desc.n_tokens, bytes, b, l);
        } else {
            rc = sink->block(sink->ctx, l, b, &blk, err);
        }
    }
    const uint8_t *tk = rc == STRATA_OK ? image_take(img, body, at, L.tail_len * row * 2) : NULL;
    const uint8_t *tv = tk ? image_take(img, body, at, L.tail_len * row * 2) : NULL;
    if (rc == STRATA_OK && !tv)
        rc = strata_fail(err, STRATA_EFORMAT, "kv import: the image ends in layer %d's tail", l);
    if (rc == STRATA_OK)
        rc = sink->tail(sink->ctx, l, tk, tv, L.tail_len, err);
    return rc;
}

/* The plan after the head: u32 length, then its range list (printable ASCII, no terminator). */
static int read_plan(const kv_geometry *g, const uint8_t *img, size_t body, size_t *at, const kv_image_sink *sink,
                     strata_error *err)
{
    const uint8_t *lp = image_take(img, body, at, 4);
    const size_t plan_len = lp ? kv_ld32(lp) : 0;
    if (!lp || plan_len == 0 || plan_len > SEQ_IMAGE_PLAN_MAX)
        return strata_fail(err, STRATA_EFORMAT, "kv import: the image's plan is missing or %zu bytes long", plan_len);
    const uint8_t *text = image_take(img, body, at, plan_len);
    if (!text)
        return strata_fail(err, STRATA_EFORMAT, "kv import: the image ends in its plan");
    for (size_t i = 0; i < plan_len; i++)
        if (text[i] < 0x20 || text[i] > 0x7e)
            return strata_fail(err, STRATA_EFORMAT, "kv import: the image's plan holds byte 0x%02x", text[i]);
    char *spec = malloc(plan_len + 1);
    kv_codec_params *codecs = calloc((size_t)g->n_layers, sizeof *codecs);
    int rc = STRATA_OK;
    if (!spec || !codecs) {
        rc = strata_fail(err, STRATA_ENOMEM, "kv import: out of memory");
    } else {
        memcpy(spec, text, plan_len);
        spec[plan_len] = 0;
        if ((rc = kv_plan_parse(spec, g->n_layers, codecs, err)) != STRATA_OK)
            strata_error_prefix(err, "kv import: the image's plan");
        for (int l = 0; rc == STRATA_OK && l < g->n_layers; l++)
            if ((rc = kv_codec_validate(&codecs[l], g, err)) != STRATA_OK)
                strata_error_prefix(err, "kv import: the image's plan at layer %d", l);
        if (rc == STRATA_OK)
            rc = sink->plan(sink->ctx, codecs, err);
    }
    free(spec);
    free(codecs);
    return rc;
}

int kv_image_read(const kv_geometry *g, const uint8_t *img, size_t len, const kv_image_sink *sink,
                  strata_error *err)
{
    if (!g || !img || !sink || !sink->plan || g->n_layers < 1)
        return strata_fail(err, STRATA_EINVAL, "kv import: NULL argument");
    if (len < SEQ_IMAGE_HEAD + 4 || kv_ld32(img) != SEQ_IMAGE_MAGIC)
        return strata_fail(err, STRATA_EFORMAT, "kv import: not a sequence image (%zu bytes)", len);
    if (kv_crc32c(0, img, len - 4) != kv_ld32(img + len - 4))
        return strata_fail(err, STRATA_ECRC, "kv import: the image's CRC32C does not match");
    if (kv_ld16(img + 6) != 0)
        return strata_fail(err, STRATA_EFORMAT, "kv import: the image has flags 0x%04x this reader does not know",
                           kv_ld16(img + 6));
    if (kv_ld16(img + 4) != SEQ_IMAGE_VERSION || kv_ld32(img + 8) != (uint32_t)g->n_layers ||
        kv_ld32(img + 12) != (uint32_t)g->n_kv_heads || kv_ld32(img + 16) != (uint32_t)g->head_dim ||
        kv_ld32(img + 20) != (uint32_t)g->block_tokens)
        return strata_fail(err, STRATA_EINVAL, "kv import: the image (version %u, %u layers, %u x %u heads, %u-token "
                           "blocks) does not fit this pool (%d layers, %d x %d, %d)", kv_ld16(img + 4),
                           kv_ld32(img + 8), kv_ld32(img + 12), kv_ld32(img + 16), kv_ld32(img + 20), g->n_layers,
                           g->n_kv_heads, g->head_dim, g->block_tokens);
    const size_t body = len - 4;
    size_t at = SEQ_IMAGE_HEAD, first = 0;
    int rc = read_plan(g, img, body, &at, sink, err);
    if (rc != STRATA_OK)
        return rc;
    for (int l = 0; l < g->n_layers; l++) {
        size_t tokens = 0;
        rc = read_layer(g, img, body, &at, l, sink, &tokens, err);
        if (rc != STRATA_OK)
            return rc;
        if (l == 0)
            first = tokens;
        else if (tokens != first)
            return strata_fail(err, STRATA_EINVAL, "kv import: layer %d holds %zu tokens, layer 0 %zu", l, tokens,
                               first);
    }
    if (at != body)
        return strata_fail(err, STRATA_EFORMAT, "kv import: %zu bytes after the last layer", body - at);
    return STRATA_OK;
}

/* ---- prefixes (prefix caching) ---- */

/* What kv_image_prefix keeps of an image while reading it: pointers into the image, no copies. */
typedef struct prefix_cut {
    const kv_geometry *g;
    size_t keep;                  /* blocks per layer */
    kv_codec_params *codecs;      /* the image's plan */
    size_t *prompt_end;           /* per layer, cut to the prefix */
    const uint8_t **block;        /* [l * keep + b] */
    uint32_t *block_len;
} prefix_cut;

static int cut_plan(void *ctx, const kv_codec_params *codecs, strata_error *err)
{
    prefix_cut *c = ctx;
    for (int l = 0; l < c->g->n_layers; l++)
        if (codecs[l].codec == KV_CODEC_OTT)
            /* OTT's pool state at the cut is not in the image (only the whole sequence's is). */
            return strata_fail(err, STRATA_EUNSUPPORTED, "kv prefix: layer %d uses OTT, whose pool state cannot be "
                               "cut to a prefix", l);
    memcpy(c->codecs, codecs, (size_t)c->g->n_layers * sizeof *codecs);
    return STRATA_OK;
}

static int cut_layer(void *ctx, int l, const kv_image_layer *info, const uint8_t *ott_state, strata_error *err)
{
    prefix_cut *c = ctx;
    (void)ott_state;
    if (info->n_blocks < c->keep)
        return strata_fail(err, STRATA_EINVAL, "kv prefix: layer %d holds %zu blocks, fewer than the %zu asked for", l,
                           info->n_blocks, c->keep);
    const size_t end = c->keep * (size_t)c->g->block_tokens;
    c->prompt_end[l] = info->prompt_end < end ? info->prompt_end : end;
    return STRATA_OK;
}

static int cut_block(void *ctx, int l, size_t b, const kv_block *parsed, strata_error *err)
{
    prefix_cut *c = ctx;
    (void)err;
    if (b < c->keep) {
        c->block[(size_t)l * c->keep + b] = parsed->bytes;
        c->block_len[(size_t)l * c->keep + b] = parsed->block_bytes;
    }
    return STRATA_OK;
}

static int cut_tail(void *ctx, int l, const uint8_t *k, const uint8_t *v, size_t tail_len, strata_error *err)
{
    (void)ctx, (void)l, (void)k, (void)v, (void)tail_len, (void)err;
    return STRATA_OK;
}

static int cut_src_layer(void *ctx, int l, kv_image_layer *out, strata_error *err)
{
    const prefix_cut *c = ctx;
    (void)err;
    *out = (kv_image_layer){.n_blocks = c->keep, .tail_len = 0, .prompt_end = c->prompt_end[l], .ott_bytes = 0};
    return STRATA_OK;
}

static int cut_src_bytes(void *ctx, int l, size_t b, uint32_t *bytes, strata_error *err)
{
    const prefix_cut *c = ctx;
    (void)err;
    *bytes = c->block_len[(size_t)l * c->keep + b];
    return STRATA_OK;
}

static int cut_src_block(void *ctx, int l, size_t b, uint8_t *dst, strata_error *err)
{
    const prefix_cut *c = ctx;
    (void)err;
    memcpy(dst, c->block[(size_t)l * c->keep + b], c->block_len[(size_t)l * c->keep + b]);
    return STRATA_OK;
}

int kv_image_prefix(const kv_geometry *g, const uint8_t *img, size_t len, size_t n_tokens, uint8_t **out,
                    size_t *out_len, strata_error *err)
{
    *out = NULL;
    *out_len = 0;
    if (!g || !img || g->n_layers < 1 || g->block_tokens < 1)
        return strata_fail(err, STRATA_EINVAL, "kv prefix: NULL argument");
    if (n_tokens == 0 || n_tokens % (size_t)g->block_tokens)
        return strata_fail(err, STRATA_EINVAL, "kv prefix: %zu tokens is not a positive multiple of the %d-token block",
                           n_tokens, g->block_tokens);
    const size_t L = (size_t)g->n_layers, keep = n_tokens / (size_t)g->block_tokens;
    prefix_cut c = {.g = g, .keep = keep, .codecs = calloc(L, sizeof *c.codecs),
                    .prompt_end = calloc(L, sizeof *c.prompt_end),
                    .block = keep <= SIZE_MAX / L / sizeof *c.block ? calloc(L * keep, sizeof *c.block) : NULL,
                    .block_len = keep <= SIZE_MAX / L / sizeof *c.block_len ? calloc(L * keep, sizeof *c.block_len) : NULL};
    int rc = !c.codecs || !c.prompt_end || !c.block || !c.block_len ? strata_fail(err, STRATA_ENOMEM, "kv prefix: out of memory")
                                                                     : STRATA_OK;
    const kv_image_sink sink = {.ctx = &c, .plan = cut_plan, .layer = cut_layer, .block = cut_block, .tail = cut_tail};
    if (rc == STRATA_OK)
        rc = kv_image_read(g, img, len, &sink, err);
    const kv_image_source src = {.ctx = &c, .layer = cut_src_layer, .block_bytes = cut_src_bytes, .block = cut_src_block,
                                 .codecs = c.codecs};
    if (rc == STRATA_OK)
        rc = kv_image_write(g, &src, out, out_len, err);
    free(c.codecs);
    free(c.prompt_end);
    free(c.block);
    free(c.block_len);
    return rc;
}
