/* strata drain: empty one worker's replica for maintenance (DrainWorker, remote.h). */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>

#include "coordinator/cli/cli.h"
#include "coordinator/cli/remote.h"
#include "kvstore/numarg.h"

static void usage(FILE *out)
{
    fprintf(out,
            "usage: strata drain --server HOST:PORT [options] WORKER\n"
            "\n"
            "Drains the replica of WORKER on a running strata server: no new requests go there,\n"
            "its running requests move to the other replicas (their compressed KV blocks travel\n"
            "worker to worker and they continue with the same tokens), then its workers stop (a\n"
            "supervisor restarts them and they rejoin). Prints the progress; exits 0 when done.\n"
            "\n"
            "options:\n"
            "      --server HOST:PORT  the server's public API (required)\n"
            "      --token-file FILE   bearer token for a server started with --token-file\n"
            "      --tls-ca FILE       PEM certificate(s) to verify a TLS server with (enables TLS)\n"
            "      --timeout S         stop following after S seconds (default 300; the drain goes on)\n"
            "  -q, --quiet             only the final line and errors\n"
            "  -h, --help              show this help\n");
}

int cmd_drain(int argc, char **argv)
{
    enum { OPT_SERVER = 1000, OPT_TOKEN, OPT_CA, OPT_TIMEOUT };
    static const struct option opts[] = {
        {"server", required_argument, NULL, OPT_SERVER}, {"token-file", required_argument, NULL, OPT_TOKEN},
        {"tls-ca", required_argument, NULL, OPT_CA},     {"timeout", required_argument, NULL, OPT_TIMEOUT},
        {"quiet", no_argument, NULL, 'q'},               {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    remote_drain r = {.timeout_s = 300};
    long v;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "qh", opts, NULL)) != -1) {
        switch (c) {
        case OPT_SERVER:
            r.server = optarg;
            if (!strata_check_addr("strata drain", "--server", optarg, false))
                return EXIT_USAGE;
            break;
        case OPT_TOKEN: r.token_file = optarg; break;
        case OPT_CA: r.tls_ca = optarg; break;
        case OPT_TIMEOUT:
            if (!cli_parse_long("--timeout", optarg, 1, 86400, &v)) return EXIT_USAGE;
            r.timeout_s = (int)v;
            break;
        case 'q': r.quiet = true; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return EXIT_USAGE;
        }
    }
    if (!r.server || optind != argc - 1) {
        fprintf(stderr, "strata drain: --server and exactly one WORKER name are required (try --help)\n");
        return EXIT_USAGE;
    }
    r.worker = argv[optind];
    return cli_remote_drain(&r);
}
