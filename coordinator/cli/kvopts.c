/* KV cache options shared by the commands that run the model. */
#include "coordinator/cli/kvopts.h"

#include <string.h>

#include "coordinator/cli/cli.h"
#include "kvstore/plan.h"

void cli_kv_usage(FILE *out, const char *default_kv)
{
    fprintf(out,
            "      --kv SPEC           KV codec for every layer, or a bit plan (default %s):\n"
            "                          fp16 kivi2 kivi4 gear2 gear4 gearl2 gearl4 ott2 ott4 tada2 tada4\n"
            "                          tada8, tada (4 bits in the lower half of the layers, 2 above),\n"
            "                          a range list such as 0-9:tada4,10-29:tada2, or a plan file\n"
            "      --kv-plan FILE      read the bit plan from FILE (as written by strata calibrate)\n"
            "      --kv-group G        quantization group G for every quantized layer (default 32;\n"
            "                          gear 64)\n"
            "      --kv-residual R     fp16 residual window in tokens for every quantized layer\n"
            "                          (default 128)\n"
            "      --block-tokens N    tokens per KV block (default 64)\n",
            default_kv);
}

int cli_kv_resolve(const char *cmd, const char *kv, const cli_kv_opts *o, const kv_geometry *g,
                   kv_codec_params *out)
{
    strata_error err = {0};
    const char *what = o->plan_file ? "--kv-plan" : "--kv";
    int rc;
    if (o->plan_file)
        rc = kv_plan_load(o->plan_file, g->n_layers, out, &err);
    else if (kv_plan_is_file(kv))
        rc = kv_plan_load(kv, g->n_layers, out, &err);
    else
        rc = kv_plan_parse(kv, g->n_layers, out, &err);
    if (rc) {
        /* A name that looks like a path (a slash, or a plan file's extension) is a plan file that
         * is not there, not an unknown codec. */
        const size_t n = strlen(kv);
        const bool path_like = strchr(kv, '/') || (n > 4 && !strcmp(kv + n - 4, ".txt")) ||
                               (n > 5 && !strcmp(kv + n - 5, ".plan"));
        if (!o->plan_file && path_like)
            fprintf(stderr, "strata %s: --kv %s: no such plan file (or not a regular file)\n", cmd, kv);
        else
            fprintf(stderr, "strata %s: %s: %s\n", cmd, what, err.msg);
        return EXIT_USAGE;
    }
    /* Whether the plan is one codec, decided before the flags below change it (naming "layer 0"
     * of a uniform plan would point at the wrong thing). */
    char first[64], last[64];
    kv_codec_name(&out[0], first, sizeof first);
    kv_codec_name(&out[g->n_layers - 1], last, sizeof last);
    const bool uniform = !strcmp(first, last);
    /* The shape flags given, which are usually what a failing check is about. */
    char flags[96] = "";
    int at = 0;
    if (o->group >= 0)
        at += snprintf(flags + at, sizeof flags - (size_t)at, " --kv-group %ld", o->group);
    if (o->residual >= 0)
        at += snprintf(flags + at, sizeof flags - (size_t)at, " --kv-residual %ld", o->residual);
    if (g->block_tokens != 64)
        snprintf(flags + at, sizeof flags - (size_t)at, " --block-tokens %d", g->block_tokens);
    for (int l = 0; l < g->n_layers; l++) {
        if (out[l].codec == KV_CODEC_FP16)
            continue;
        if (o->group >= 0)
            out[l].group = (int)o->group;
        if (o->residual >= 0)
            out[l].residual = (int)o->residual;
        if (kv_codec_validate(&out[l], g, &err) != STRATA_OK) {
            char layer[32] = "";
            if (!uniform)
                snprintf(layer, sizeof layer, "layer %d: ", l);
            fprintf(stderr, "strata %s: %s %s%s%s: %s%s\n", cmd, what, o->plan_file ? o->plan_file : kv,
                    flags[0] ? " with" : "", flags, layer, err.msg);
            return EXIT_USAGE;
        }
    }
    return 0;
}

bool cli_kv_shape_flag(int opt, const char *arg, cli_kv_opts *o)
{
    long v;
    switch (opt) {
    case OPT_KV_GROUP: return cli_parse_long("--kv-group", arg, 1, 4096, &o->group);
    case OPT_KV_RESIDUAL: return cli_parse_long("--kv-residual", arg, 0, 65535, &o->residual);
    case OPT_BLOCK_TOKENS:
        if (!cli_parse_long("--block-tokens", arg, 1, 4096, &v))
            return false;
        o->block_tokens = (int)v;
        return true;
    default: return false;
    }
}
