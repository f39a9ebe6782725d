/* Memory tiers of the KV cache for the commands that run the model: the device pool budget, the
 * host arena and the NVMe spill directory (flags and config keys), and the pool they make. */
#ifndef STRATA_CLI_TIERS_H
#define STRATA_CLI_TIERS_H

#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>

#include "kvstore/kv_cache.h"
#include "offload/kv_tiers.h"

/* getopt values of the tier flags; a command adds CLI_TIER_OPTIONS to its option table and
 * hands these values to cli_tier_flag. */
enum {
    OPT_TIER_DEVICE = 3000, OPT_TIER_HOST, OPT_TIER_NVME_DIR, OPT_TIER_NVME, OPT_TIER_CONFIG,
};
#define CLI_TIER_OPTIONS                                                  \
    {"device-kv-mib", required_argument, NULL, OPT_TIER_DEVICE},          \
    {"kv-pool-mib", required_argument, NULL, OPT_TIER_DEVICE},            \
    {"host-kv-mib", required_argument, NULL, OPT_TIER_HOST},              \
    {"nvme-dir", required_argument, NULL, OPT_TIER_NVME_DIR},             \
    {"nvme-kv-mib", required_argument, NULL, OPT_TIER_NVME},              \
    {"config", required_argument, NULL, OPT_TIER_CONFIG}

typedef struct cli_tier_opts {
    double device_mib;      /* MiB, fractions allowed; -1: room for the whole context */
    double host_mib;        /* -1: unset */
    const char *nvme_dir;   /* NULL: unset */
    double nvme_mib;        /* -1: unset */
    const char *config;     /* --config FILE */
    char *config_nvme_dir;  /* owned copy of the config file's nvme_dir */
} cli_tier_opts;

void cli_tier_opts_init(cli_tier_opts *o);
/* After a run failed with code: when the KV memory was full (STRATA_EFULL), tells the user which
 * flags give it more room (have_tiers: a tier below the device exists). */
void cli_tier_room_hint(const char *cmd, int code, bool have_tiers);
void cli_tier_opts_free(cli_tier_opts *o);

/* The help lines of these options. */
void cli_tier_usage(FILE *out);

/* Handles one tier flag. Returns 0 when handled, EXIT_USAGE (after a message) when its value is
 * bad. */
int cli_tier_flag(int opt, const char *arg, cli_tier_opts *o);

/* After parsing: reads --config (flags win over its keys) and checks the combination.
 * Returns 0 or EXIT_USAGE after a message "strata CMD: ...". */
int cli_tier_finish(const char *cmd, cli_tier_opts *o);

/* Device slots for one plan under the options, for a pool shared by every layer
 * (kv_pool_create_shared): --device-kv-mib over the plan's largest block (0 when it holds none),
 * at most what ctx tokens of every layer can use; without --device-kv-mib that maximum when a
 * tier below is asked for, else 0 (no tier flags: the caller sizes the pool itself). */
size_t cli_tier_device_slots(const cli_tier_opts *o, const kv_geometry *g, const kv_codec_params *codecs, size_t ctx);

/* The host (and NVMe) tiers the options ask for in *out, or NULL without --host-kv-mib /
 * --nvme-dir. Fails with the kv_tiers_create error. Until cli_tier_destroy, SIGINT, SIGTERM and
 * SIGHUP (unless ignored) remove the NVMe tier's slab files and the spill directory it made
 * before the signal ends the process. */
int cli_tier_create(const cli_tier_opts *o, kv_tiers **out, strata_error *err);
/* The same with the host arena's memory from alloc (NULL: aligned host memory; a GPU passes
 * pinned memory). */
int cli_tier_create_with(const cli_tier_opts *o, const host_arena_allocator *alloc, kv_tiers **out,
                         strata_error *err);

/* kv_tiers_destroy, and the signal handlers of cli_tier_create put back. NULL: nothing. */
void cli_tier_destroy(kv_tiers *t);

/* A block pool sized by the options for ctx tokens, with the host/NVMe tiers attached when
 * asked for. */
typedef struct cli_kv_memory {
    kv_pool *pool;
    kv_tiers *tiers;   /* NULL without --host-kv-mib / --nvme-dir */
    size_t blocks_per_layer;
    size_t blocks_for_ctx;
} cli_kv_memory;

/* Returns 0, EXIT_USAGE (a budget below one block per layer) or EXIT_RUNTIME (allocation or
 * NVMe set-up failed), after a message. */
int cli_kv_memory_create(const char *cmd, const cli_tier_opts *o, const kv_geometry *g, const kv_codec_params *codecs,
                         size_t ctx, bool quiet, cli_kv_memory *out);
/* The sequences of the pool must be destroyed first. */
void cli_kv_memory_free(cli_kv_memory *mem);

/* Prints the pool's and the tiers' statistics (blocks and bytes per tier, evictions, fetches,
 * spills, restores, NVMe bytes/s, CRC failures) to out. */
void cli_kv_memory_print_stats(const cli_kv_memory *mem, FILE *out);

#endif
