/* KV cache options shared by the commands that run the model (generate, eval, calibrate). */
#ifndef STRATA_CLI_KVOPTS_H
#define STRATA_CLI_KVOPTS_H

#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>

#include "kvstore/kv_cache.h"

typedef struct cli_kv_opts {
    const char *kv;          /* codec name, range list or plan file */
    const char *plan_file;   /* --kv-plan FILE (overrides kv) */
    long group, residual;    /* -1: each codec's default */
    int block_tokens;
} cli_kv_opts;

/* getopt values of the block-shape flags every command that builds a KV pool takes; a command
 * adds CLI_KV_SHAPE_OPTIONS to its option table and hands these values to cli_kv_shape_flag. */
enum { OPT_KV_GROUP = 3100, OPT_KV_RESIDUAL, OPT_BLOCK_TOKENS };
#define CLI_KV_SHAPE_OPTIONS                                         \
    {"kv-group", required_argument, NULL, OPT_KV_GROUP},             \
    {"kv-residual", required_argument, NULL, OPT_KV_RESIDUAL},       \
    {"block-tokens", required_argument, NULL, OPT_BLOCK_TOKENS}

/* Applies one of CLI_KV_SHAPE_OPTIONS to o; false after printing why (exit with EXIT_USAGE). */
bool cli_kv_shape_flag(int opt, const char *arg, cli_kv_opts *o);

/* The help lines of these options, for a usage text. */
void cli_kv_usage(FILE *out, const char *default_kv);

/* Resolves the options into one codec per layer of g (g->n_layers entries in out), validated
 * against g. On failure prints "strata CMD: ..." and returns EXIT_USAGE. */
int cli_kv_resolve(const char *cmd, const char *kv, const cli_kv_opts *o, const kv_geometry *g,
                   kv_codec_params *out);

#endif
