/* strata inspect: print and verify a block file. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "coordinator/cli/cli.h"
#include "kvstore/blockfile.h"

static void usage(FILE *out)
{
    fprintf(out,
            "usage: strata inspect [--verbose] BLOCKFILE\n"
            "\n"
            "Prints every KV block of a block file (written by strata generate --save-kv): header\n"
            "fields, section table and CRC32C status. A corrupted or truncated file is reported\n"
            "and the command exits with status 1 (2 when BLOCKFILE is missing or a folder).\n"
            "Format: docs/format.md.\n"
            "\n"
            "options:\n"
            "  -v, --verbose   also print a few dequantized K and V values of each block\n"
            "  -h, --help      show this help\n");
}

int cmd_inspect(int argc, char **argv)
{
    static const struct option opts[] = {
        {"verbose", no_argument, NULL, 'v'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    bool verbose = false;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "vh", opts, NULL)) != -1) {
        switch (c) {
        case 'v': verbose = true; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return EXIT_USAGE;
        }
    }
    if (optind != argc - 1) {
        fprintf(stderr, "strata inspect: expected exactly one BLOCKFILE\n");
        usage(stderr);
        return EXIT_USAGE;
    }
    struct stat st;   /* a file that is not there (or a folder) is bad usage; a bad file is a finding */
    const char *why = stat(argv[optind], &st) != 0 ? strerror(errno) : S_ISDIR(st.st_mode) ? "is a directory" : NULL;
    if (why) {
        fprintf(stderr, "strata inspect: %s: %s\n", argv[optind], why);
        return EXIT_USAGE;
    }
    strata_error err = {0};
    if (kv_blockfile_inspect(argv[optind], stdout, verbose, &err) != STRATA_OK) {
        fflush(stdout);
        fprintf(stderr, "strata inspect: %s\n", err.msg);
        return EXIT_RUNTIME;
    }
    return 0;
}
