/* strata: command-line entry point. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coordinator/cli/cli.h"
#include "coordinator/service/serve.h"
#include "kvstore/numarg.h"

static void usage(FILE *out)
{
    fprintf(out,
            "strata %s: LLM inference with a compressed (2-4 bit) KV cache\n"
            "\n"
            "usage: strata <command> [options]\n"
            "\n"
            "commands:\n"
            "  generate   generate text from a prompt with the default or a given GGUF model (CPU)\n"
            "  eval       measure the quality of compressed KV caches against fp16 on a text\n"
            "  calibrate  search a per-layer bit plan for a bytes-per-token budget\n"
            "  inspect    print and verify the KV blocks in a block file (see generate --save-kv)\n"
            "  serve      serve the gRPC API with a coordinator and local CPU workers\n"
            "  drain      move the requests of a worker's replica elsewhere and stop it (on a server)\n"
            "\n"
            "options:\n"
            "  -h, --help     show this help (each command has its own: strata generate --help,\n"
            "                 or strata help generate)\n"
            "  --version      print the version\n"
            "\n"
            "default model: %s\n",
            STRATA_VERSION, cli_default_model());
}

const char *cli_default_model(void)
{
    const char *env = getenv("STRATA_MODEL");
    return env && *env ? env : STRATA_DEFAULT_MODEL;
}

bool cli_parse_long(const char *flag, const char *s, long min, long max, long *out)
{
    return strata_parse_long("strata", flag, s, min, max, out);
}

bool cli_parse_u64(const char *flag, const char *s, uint64_t *out) { return strata_parse_u64("strata", flag, s, out); }

bool cli_parse_double(const char *flag, const char *s, double min, double max, double *out)
{
    return strata_parse_double("strata", flag, s, min, max, out);
}

bool cli_parse_float(const char *flag, const char *s, double min, double max, float *out)
{
    double v;
    if (!cli_parse_double(flag, s, min, max, &v))
        return false;
    *out = (float)v;
    return true;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return EXIT_USAGE;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "help") && argc == 3) {
        /* "strata help generate" is "strata generate --help". */
        cmd = argv[2];
        argv[1] = argv[2];
        argv[2] = "--help";
    } else if (!strcmp(cmd, "-h") || !strcmp(cmd, "--help") || !strcmp(cmd, "help")) {
        if (argc > 2 && !strcmp(cmd, "help")) {
            fprintf(stderr, "strata: usage: strata help [COMMAND]\n");
            return EXIT_USAGE;
        }
        usage(stdout);
        return 0;
    }
    if (!strcmp(cmd, "--version")) {
        printf("strata %s\n", STRATA_VERSION);
        return 0;
    }
    if (!strcmp(cmd, "generate"))
        return cmd_generate(argc - 1, argv + 1);
    if (!strcmp(cmd, "eval"))
        return cmd_eval(argc - 1, argv + 1);
    if (!strcmp(cmd, "calibrate"))
        return cmd_calibrate(argc - 1, argv + 1);
    if (!strcmp(cmd, "serve"))
        return serve_main(argc - 1, argv + 1, "strata serve", true);
    if (!strcmp(cmd, "drain"))
        return cmd_drain(argc - 1, argv + 1);
    if (!strcmp(cmd, "inspect"))
        return cmd_inspect(argc - 1, argv + 1);
    fprintf(stderr, "strata: unknown command '%s' (try strata --help)\n", cmd);
    return EXIT_USAGE;
}
