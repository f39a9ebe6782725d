/* Codec registry and the codec-level entry points of kv_cache.h. */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvstore/codec.h"
#include "kvstore/kv_cache.h"

/* Defaults of the codec names (kv_cache.h). */
#define DEFAULT_GROUP 32
#define GEAR_DEFAULT_GROUP 64   /* GEAR's 2-bit backbone uses g = 64 */
#define DEFAULT_RESIDUAL 128
#define GEAR_DEFAULT_SPARSE_PCT 2.0
#define GEAR_DEFAULT_RANK_PROMPT 4
#define GEAR_DEFAULT_RANK_DECODE 2
#define GEAR_DEFAULT_ITERS 3
#define OTT_DEFAULT_POOL 3
#define OTT_DEFAULT_AUX 32
#define OTT_MAX_POOL 64
#define OTT_MAX_AUX 4096

const kv_codec_ops *kv_codec_ops_for(unsigned id)
{
    switch (id) {
    case KV_CODEC_FP16: return &kv_codec_fp16;
    case KV_CODEC_KIVI: return &kv_codec_kivi;
    case KV_CODEC_GEAR: return &kv_codec_gear;
    case KV_CODEC_OTT: return &kv_codec_ott;
    case KV_CODEC_TADA: return &kv_codec_tada;
    default: return NULL;
    }
}

static const char accepted_names[] =
    "fp16, kivi2, kivi4, gear2, gear4, gearl2, gearl4, ott2, ott4, tada2, tada4, tada8 "
    "(optional suffixes: -g<group> -r<residual>; gear: -p<prompt rank> -d<decode rank> -s<sparse %> "
    "-i<iterations>; ott: -n<pool> -a<aux pool>; e.g. kivi2-g32-r128, gear2-s1-d4)";

int kv_gear_outliers(double pct, int n)
{
    if (!(pct > 0.0) || n < 1)
        return 0;
    double per_side = pct / 200.0 * (double)n;
    long k = lround(per_side);
    if (k < 1)
        k = 1;
    if (k > n / 2)
        k = n / 2;
    return (int)(2 * k);
}

/* Parses the suffixes of a codec name into p; the letters a codec does not take are errors. */
static int parse_suffixes(const char *name, const char *s, const char *letters, kv_codec_params *p,
                          strata_error *err)
{
    char seen[16] = "";
    while (*s) {
        if (s[0] != '-' || !s[1] || !strchr(letters, s[1]))
            return strata_fail(err, STRATA_EINVAL, "kv codec \"%s\": unexpected \"%s\" (this codec takes suffixes %s)",
                               name, s, letters[0] ? letters : "none");
        char opt = s[1];
        if (strchr(seen, opt))   /* which of two values was meant is not ours to guess */
            return strata_fail(err, STRATA_EINVAL, "kv codec \"%s\": -%c given twice", name, opt);
        size_t n_seen = strlen(seen);
        if (n_seen + 1 < sizeof seen) {
            seen[n_seen] = opt;
            seen[n_seen + 1] = '\0';
        }
        char *end;
        errno = 0;
        if (opt == 's') {
            double x = strtod(s + 2, &end);
            if (end == s + 2 || errno || !(x >= 0.0) || x > 50.0)
                return strata_fail(err, STRATA_EINVAL, "kv codec \"%s\": sparse percent -s must be in 0..50", name);
            p->sparse_pct = x;
        } else {
            if (s[2] < '0' || s[2] > '9')
                return strata_fail(err, STRATA_EINVAL, "kv codec \"%s\": -%c needs a number", name, opt);
            long n = strtol(s + 2, &end, 10);
            if (errno || n > 65535)
                return strata_fail(err, STRATA_EINVAL, "kv codec \"%s\": -%c value out of range 0..65535", name, opt);
            switch (opt) {
            case 'g': p->group = (int)n; break;
            case 'r': p->residual = (int)n; break;
            case 'p': p->rank_prompt = (int)n; break;
            case 'd': p->rank_decode = (int)n; break;
            case 'i': p->power_iters = (int)n; break;
            case 'n': p->pool_tokens = (int)n; break;
            case 'a': p->aux_tokens = (int)n; break;
            default: break;
            }
        }
        s = end;
    }
    return STRATA_OK;
}

int kv_codec_parse(const char *name, kv_codec_params *out, strata_error *err)
{
    if (!name || !out)
        return strata_fail(err, STRATA_EINVAL, "kv codec: NULL name");
    kv_codec_params p = {0};
    const char *rest = NULL, *letters = "";
    if (strcmp(name, "fp16") == 0) {
        p = (kv_codec_params){.codec = KV_CODEC_FP16, .bits = 16};
        rest = name + 4;
    } else if (strncmp(name, "kivi", 4) == 0 && (name[4] == '2' || name[4] == '4')) {
        p = (kv_codec_params){.codec = KV_CODEC_KIVI, .bits = name[4] - '0', .group = DEFAULT_GROUP,
                              .residual = DEFAULT_RESIDUAL};
        rest = name + 5;
        letters = "gr";
    } else if (strncmp(name, "gear", 4) == 0) {
        bool lite = name[4] == 'l';
        const char *b = name + 4 + (lite ? 1 : 0);
        if (*b == '2' || *b == '4') {
            p = (kv_codec_params){.codec = KV_CODEC_GEAR, .bits = *b - '0', .group = GEAR_DEFAULT_GROUP,
                                  .residual = DEFAULT_RESIDUAL, .rank_prompt = GEAR_DEFAULT_RANK_PROMPT,
                                  .rank_decode = GEAR_DEFAULT_RANK_DECODE, .power_iters = GEAR_DEFAULT_ITERS,
                                  .sparse_pct = lite ? 0.0 : GEAR_DEFAULT_SPARSE_PCT};
            rest = b + 1;
            letters = lite ? "grpdi" : "grpdis";
        }
    } else if (strncmp(name, "ott", 3) == 0 && (name[3] == '2' || name[3] == '4')) {
        p = (kv_codec_params){.codec = KV_CODEC_OTT, .bits = name[3] - '0', .group = DEFAULT_GROUP,
                              .residual = DEFAULT_RESIDUAL, .pool_tokens = OTT_DEFAULT_POOL,
                              .aux_tokens = OTT_DEFAULT_AUX};
        rest = name + 4;
        letters = "grna";
    } else if (strncmp(name, "tada", 4) == 0 && (name[4] == '2' || name[4] == '4' || name[4] == '8')) {
        p = (kv_codec_params){.codec = KV_CODEC_TADA, .bits = name[4] - '0', .group = DEFAULT_GROUP,
                              .residual = DEFAULT_RESIDUAL};
        rest = name + 5;
        letters = "gr";
    }
    if (!rest)
        return strata_fail(err, STRATA_EINVAL, "unknown kv codec \"%s\"; accepted: %s", name, accepted_names);
    strata_error why = {0};
    if (parse_suffixes(name, rest, letters, &p, &why) != STRATA_OK)
        return strata_fail(err, STRATA_EINVAL, "%s; accepted: %s", why.msg, accepted_names);
    *out = p;
    return STRATA_OK;
}

/* Appends prefix and value ("-g" 64) to the name being built. */
static void append(char *buf, size_t cap, size_t *at, const char *prefix, int value)
{
    if (*at >= cap)
        return;
    int n = snprintf(buf + *at, cap - *at, "%s%d", prefix, value);
    if (n > 0)
        *at += (size_t)n;
}

void kv_codec_name(const kv_codec_params *p, char *buf, size_t cap)
{
    if (!buf || cap == 0)
        return;
    buf[0] = 0;
    size_t at = 0;
    if (!p) {
        snprintf(buf, cap, "none");
        return;
    }
    switch (p->codec) {
    case KV_CODEC_FP16: snprintf(buf, cap, "fp16"); return;
    case KV_CODEC_KIVI: append(buf, cap, &at, "kivi", p->bits); break;
    case KV_CODEC_GEAR: append(buf, cap, &at, p->sparse_pct > 0.0 ? "gear" : "gearl", p->bits); break;
    case KV_CODEC_OTT: append(buf, cap, &at, "ott", p->bits); break;
    case KV_CODEC_TADA: append(buf, cap, &at, "tada", p->bits); break;
    default: snprintf(buf, cap, "unknown(%d)", (int)p->codec); return;
    }
    int group = p->codec == KV_CODEC_GEAR ? GEAR_DEFAULT_GROUP : DEFAULT_GROUP;
    if (p->group != group)
        append(buf, cap, &at, "-g", p->group);
    if (p->residual != DEFAULT_RESIDUAL)
        append(buf, cap, &at, "-r", p->residual);
    if (p->codec == KV_CODEC_GEAR) {
        if (p->rank_prompt != GEAR_DEFAULT_RANK_PROMPT)
            append(buf, cap, &at, "-p", p->rank_prompt);
        if (p->rank_decode != GEAR_DEFAULT_RANK_DECODE)
            append(buf, cap, &at, "-d", p->rank_decode);
        if (p->power_iters != GEAR_DEFAULT_ITERS)
            append(buf, cap, &at, "-i", p->power_iters);
        if (p->sparse_pct > 0.0 && p->sparse_pct != GEAR_DEFAULT_SPARSE_PCT && at < cap)
            at += (size_t)snprintf(buf + at, cap - at, "-s%g", p->sparse_pct);
    }
    if (p->codec == KV_CODEC_OTT) {
        if (p->pool_tokens != OTT_DEFAULT_POOL)
            append(buf, cap, &at, "-n", p->pool_tokens);
        if (p->aux_tokens != OTT_DEFAULT_AUX)
            append(buf, cap, &at, "-a", p->aux_tokens);
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
    } else if (p->codec == KV_CODEC_KIVI || p->codec == KV_CODEC_GEAR || p->codec == KV_CODEC_OTT ||
               p->codec == KV_CODEC_TADA) {
        char name[64];
        kv_codec_name(p, name, sizeof name);
        bool bits_ok = p->codec == KV_CODEC_TADA ? (p->bits == 2 || p->bits == 4 || p->bits == 8)
                                                 : (p->bits == 2 || p->bits == 4);
        if (!bits_ok)
            return strata_fail(err, STRATA_EINVAL, "%s codec: bits %d not supported (%s)", name, p->bits,
                               p->codec == KV_CODEC_TADA ? "2, 4 or 8" : "2 or 4");
        if (p->group < 1 || p->group > 65535)
            return strata_fail(err, STRATA_EINVAL, "%s codec: group G=%d must be in 1..65535", name, p->group);
        int per_word = 32 / p->bits;
        if (p->group % per_word)
            return strata_fail(err, STRATA_EINVAL,
                               "%s codec: group G=%d must be a multiple of %d (codes per 32-bit word at %d bits)",
                               name, p->group, per_word, p->bits);
        if (g->head_dim % p->group)
            return strata_fail(err, STRATA_EINVAL, "%s codec: group G=%d does not divide head_dim %d", name,
                               p->group, g->head_dim);
        if (g->block_tokens % p->group)
            return strata_fail(err, STRATA_EINVAL, "%s codec: group G=%d does not divide block_tokens %d", name,
                               p->group, g->block_tokens);
        if (p->residual < 0 || p->residual > 65535 || p->residual % p->group)
            return strata_fail(err, STRATA_EINVAL,
                               "%s codec: residual R=%d must be a multiple of group G=%d in 0..65535", name,
                               p->residual, p->group);
        if (p->codec == KV_CODEC_GEAR) {
            int max_rank = g->head_dim < g->block_tokens ? g->head_dim : g->block_tokens;
            if (p->rank_prompt < 0 || p->rank_prompt > max_rank || p->rank_prompt > 255)
                return strata_fail(err, STRATA_EINVAL,
                                   "%s codec: prompt rank %d must be in 0..%d (head_dim %d, block_tokens %d)", name,
                                   p->rank_prompt, max_rank < 255 ? max_rank : 255, g->head_dim, g->block_tokens);
            if (p->rank_decode < 0 || p->rank_decode > max_rank || p->rank_decode > 255)
                return strata_fail(err, STRATA_EINVAL,
                                   "%s codec: decode rank %d must be in 0..%d (head_dim %d, block_tokens %d)", name,
                                   p->rank_decode, max_rank < 255 ? max_rank : 255, g->head_dim, g->block_tokens);
            if ((p->rank_prompt || p->rank_decode) && (p->power_iters < 1 || p->power_iters > 100))
                return strata_fail(err, STRATA_EINVAL, "%s codec: power iterations %d must be in 1..100", name,
                                   p->power_iters);
            if (!(p->sparse_pct >= 0.0) || p->sparse_pct > 50.0)
                return strata_fail(err, STRATA_EINVAL, "%s codec: sparse percent %g must be in 0..50", name,
                                   p->sparse_pct);
        } else if (p->rank_prompt || p->rank_decode || p->power_iters || p->sparse_pct != 0.0) {
            return strata_fail(err, STRATA_EINVAL, "%s codec: rank, iterations and sparse percent are gear parameters",
                               name);
        }
        if (p->codec == KV_CODEC_OTT) {
            if (p->pool_tokens < 0 || p->pool_tokens > OTT_MAX_POOL)
                return strata_fail(err, STRATA_EINVAL, "%s codec: pool N=%d must be in 0..%d", name, p->pool_tokens,
                                   OTT_MAX_POOL);
            if (p->aux_tokens < 0 || p->aux_tokens > OTT_MAX_AUX)
                return strata_fail(err, STRATA_EINVAL, "%s codec: auxiliary pool %d must be in 0..%d", name,
                                   p->aux_tokens, OTT_MAX_AUX);
            if ((size_t)p->pool_tokens * (size_t)g->n_kv_heads > 65535)
                return strata_fail(err, STRATA_EINVAL, "%s codec: pool N=%d x %d kv heads exceeds 65535 entries",
                                   name, p->pool_tokens, g->n_kv_heads);
        } else if (p->pool_tokens || p->aux_tokens) {
            return strata_fail(err, STRATA_EINVAL, "%s codec: pool sizes are ott parameters", name);
        }
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
    if (p->codec == KV_CODEC_GEAR && p->rank_prompt > d.rank)
        d.rank = p->rank_prompt;
    if (p->codec == KV_CODEC_OTT)
        d.ott_tokens = p->pool_tokens * g->n_kv_heads;
    return kv_block_bytes(&d);
}
