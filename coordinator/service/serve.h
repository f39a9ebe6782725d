/* The serving process: option and config-file parsing, the public API server, the control
 * server, the metrics endpoint, the coordinator core, signal handling and the drain on SIGTERM.
 * `strata-coordinator` runs it alone (workers join from elsewhere); `strata serve` also starts
 * and supervises the local workers (restarting one that exits). */
#ifndef STRATA_COORDINATOR_SERVICE_SERVE_H
#define STRATA_COORDINATOR_SERVICE_SERVE_H

#include <stdbool.h>

/* prog: the name in messages and --help ("strata serve", "strata-coordinator"). Returns the
 * process exit code: 0 after a clean shutdown, 1 on a runtime failure, 2 on a usage error. */
int serve_main(int argc, char **argv, const char *prog, bool local_workers);

#endif
