/* Codec registry and the codec-level entry points of kv_cache.h. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvstore/codec.h"
#include "kvstore/kv_cache.h"

#define KIVI_DEFAULT_GROUP 32
#define KIVI_DEFAULT_RESIDUAL 128

const kv_codec_ops *kv_codec_ops_for(unsigned id)
{
    switch (id) {
    case KV_CODEC_FP16: return &kv_codec_fp16;
    case KV_CODEC_KIVI: return &kv_codec_kivi;
    default: return NULL;
    }
}

static const char accepted_names[] =
    "fp16, kivi2, kivi4 (kivi names take optional -g<group> and -r<residual>, e.g. kivi2-g32-r128)";

/* Parses "-g<N>" / "-r<N>" suffixes; returns 0 on success. */
static int parse_suffixes(const char *s, kv_codec_params *p)
{
    while (*s) {
        if (s[0] != '-' || (s[1] != 'g' && s[1] != 'r') || s[2] < '0' || s[2] > '9')
            return -1;
        char *end;
        errno = 0;
        long n = strtol(s + 2, &end, 10);
        if (errno || n < 0 || n > 65535)
            return -1;
        if (s[1] == 'g')
            p->group = (int)n;
        else
            p->residual = (int)n;
        s = end;
    }
    return 0;
}

int kv_codec_parse(const char *name, kv_codec_params *out, strata_error *err)
{
    if (!name || !out)
        return strata_fail(err, STRATA_EINVAL, "kv codec: NULL name");
    kv_codec_params p = {0};
    if (strcmp(name, "fp16") == 0) {
        p = (kv_codec_params){KV_CODEC_FP16, 16, 0, 0};
    } else if (strncmp(name, "kivi", 4) == 0 && (name[4] == '2' || name[4] == '4')) {
        p = (kv_codec_params){KV_CODEC_KIVI, name[4] - '0', KIVI_DEFAULT_GROUP, KIVI_DEFAULT_RESIDUAL};
        if (parse_suffixes(name + 5, &p) != 0)
            return strata_fail(err, STRATA_EINVAL, "unknown kv codec \"%s\"; accepted: %s", name, accepted_names);
    } else {
        return strata_fail(err, STRATA_EINVAL, "unknown kv codec \"%s\"; accepted: %s", name, accepted_names);
    }
    *out = p;
    return STRATA_OK;
}

void kv_codec_name(const kv_codec_params *p, char *buf, size_t cap)
{
    if (!buf || cap == 0)
        return;
    if (!p) {
        snprintf(buf, cap, "none");
    } else if (p->codec == KV_CODEC_FP16) {
        snprintf(buf, cap, "fp16");
    } else if (p->codec == KV_CODEC_KIVI) {
        char g[16] = "", r[16] = "";
        if (p->group != KIVI_DEFAULT_GROUP)
            snprintf(g, sizeof g, "-g%d", p->group);
        if (p->residual != KIVI_DEFAULT_RESIDUAL)
            snprintf(r, sizeof r, "-r%d", p->residual);
        snprintf(buf, cap, "kivi%d%s%s", p->bits, g, r);
    } else {
        snprintf(buf, cap, "unknown(%d)", (int)p->codec);
    }
}

int kv_codec_validate(const kv_codec_params *p, const kv_geometry *g, strata_error *err)
{
    if (!p || !g)
        return strata_fail(err, STRATA_EINVAL, "kv codec: NULL parameters");
    if (g->n_layers < 1)
        return strata_fail(err, STRATA_EINVAL, "kv geometry: n_layers %d must be positive", g->n_layers);
    if (g->n_kv_heads < 1 || g->n_kv_heads > 65535)
        return strata_fail(err, STRATA_EINVAL, "kv geometry: n_kv_heads %d must be in 1..65535", g->n_kv_heads);
    if (g->head_dim < 1 || g->head_dim > 65535)
        return strata_fail(err, STRATA_EINVAL, "kv geometry: head_dim %d must be in 1..65535", g->head_dim);
    if (g->block_tokens < 1 || g->block_tokens > 65535)
        return strata_fail(err, STRATA_EINVAL, "kv geometry: block_tokens %d must be in 1..65535", g->block_tokens);
    if (p->codec == KV_CODEC_FP16) {
        if (p->bits != 16)
            return strata_fail(err, STRATA_EINVAL, "fp16 codec: bits %d must be 16", p->bits);
        if (p->residual != 0)
            return strata_fail(err, STRATA_EINVAL, "fp16 codec: residual %d must be 0", p->residual);
    } else if (p->codec == KV_CODEC_KIVI) {
        if (p->bits != 2 && p->bits != 4)
            return strata_fail(err, STRATA_EINVAL, "kivi codec: bits %d not supported (2 or 4)", p->bits);
        if (p->group < 1 || p->group > 65535)
            return strata_fail(err, STRATA_EINVAL, "kivi codec: group %d must be in 1..65535", p->group);
        int per_word = 32 / p->bits;
        if (p->group % per_word)
            return strata_fail(err, STRATA_EINVAL,
                               "kivi codec: group %d must be a multiple of %d (codes per 32-bit word at %d bits)",
                               p->group, per_word, p->bits);
        if (g->head_dim % p->group)
            return strata_fail(err, STRATA_EINVAL, "kivi codec: group %d does not divide head_dim %d",
                               p->group, g->head_dim);
        if (g->block_tokens % p->group)
            return strata_fail(err, STRATA_EINVAL, "kivi codec: group %d does not divide block_tokens %d",
                               p->group, g->block_tokens);
        if (p->residual < 0 || p->residual > 65535 || p->residual % p->group)
            return strata_fail(err, STRATA_EINVAL,
                               "kivi codec: residual %d must be a multiple of group %d in 0..65535",
                               p->residual, p->group);
    } else {
        return strata_fail(err, STRATA_EINVAL, "kv codec: unknown codec id %d", (int)p->codec);
    }
    kv_block_desc d;
    kv_block_desc_init(&d, p, g, 0, 0);
    if (kv_block_desc_check(&d, err) != STRATA_OK) {
        if (err) {
            strata_error_prefix(err, "kv geometry");
            err->code = STRATA_EINVAL;
        }
        return STRATA_EINVAL;
    }
    return STRATA_OK;
}

size_t kv_block_size(const kv_codec_params *p, const kv_geometry *g)
{
    if (kv_codec_validate(p, g, NULL) != STRATA_OK)
        return 0;
    kv_block_desc d;
    kv_block_desc_init(&d, p, g, 0, 0);
    return kv_block_bytes(&d);
}
