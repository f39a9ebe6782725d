/* strata: command-line entry point. */
#include <errno.h>
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
            "  generate   generate text from a prompt with the default or a given GGUF model (CPU, or a\n"
            "             GPU with --device)\n"
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

/* A command's output that did not reach stdout (a full disk, /dev/full, an I/O error) is a
 * failure with a message, whatever the command thought; a reader that left (`| head`) is not. */
static int stdout_checked(const char *cmd, int rc)
{
    errno = 0;
    const int flushed = fflush(stdout);
    const int e = errno;
    if (flushed == 0 && !ferror(stdout))
        return rc;
    if (e == EPIPE)
        return rc;
    fprintf(stderr, "strata %s: writing to standard output failed%s%s\n", cmd, e ? ": " : "", e ? strerror(e) : "");
    return rc == 0 ? EXIT_RUNTIME : rc;
}

static int run_command(const char *cmd, int argc, char **argv)
{
    if (!strcmp(cmd, "generate"))
        return cmd_generate(argc, argv);
    if (!strcmp(cmd, "eval"))
        return cmd_eval(argc, argv);
    if (!strcmp(cmd, "calibrate"))
        return cmd_calibrate(argc, argv);
    if (!strcmp(cmd, "serve"))
        return serve_main(argc, argv, "strata serve", true);
    if (!strcmp(cmd, "drain"))
        return cmd_drain(argc, argv);
    if (!strcmp(cmd, "inspect"))
        return cmd_inspect(argc, argv);
    fprintf(stderr, "strata: unknown command '%s' (try strata --help)\n", cmd);
    return EXIT_USAGE;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return EXIT_USAGE;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "help") && argc == 3 && strcmp(argv[2], "help") && strcmp(argv[2], "-h") &&
        strcmp(argv[2], "--help")) {
        /* "strata help generate" is "strata generate --help". */
        cmd = argv[2];
        argv[1] = argv[2];
        argv[2] = "--help";
    } else if (!strcmp(cmd, "-h") || !strcmp(cmd, "--help") || !strcmp(cmd, "help")) {
        if (argc > 3 && !strcmp(cmd, "help")) {
            fprintf(stderr, "strata: usage: strata help [COMMAND]\n");
            return EXIT_USAGE;
        }
        usage(stdout);
        return stdout_checked("help", 0);
    }
    if (!strcmp(cmd, "--version")) {
        printf("strata %s\n", STRATA_VERSION);
        return stdout_checked("--version", 0);
    }
    return stdout_checked(cmd, run_command(cmd, argc - 1, argv + 1));
}
