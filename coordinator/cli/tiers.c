/* KV memory tiers for the model commands (tiers.h). */
#include "coordinator/cli/tiers.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "coordinator/cli/cli.h"
#include "coordinator/config/config_file.h"
#include "kvstore/numarg.h"

#define DEFAULT_HOST_MIB_WITH_NVME 64.0
#define DEFAULT_NVME_MIB 1024.0

void cli_tier_room_hint(const char *cmd, int code, bool have_tiers)
{
    if (code == STRATA_EFULL)
        fprintf(stderr, "strata %s: give the KV cache more room: a larger --device-kv-mib%s\n", cmd,
                have_tiers ? ", --host-kv-mib or --nvme-kv-mib" : ", or a tier below it (--host-kv-mib, --nvme-dir)");
}

void cli_tier_opts_init(cli_tier_opts *o)
{
    *o = (cli_tier_opts){.device_mib = -1, .host_mib = -1, .nvme_mib = -1};
}

void cli_tier_opts_free(cli_tier_opts *o)
{
    free(o->config_nvme_dir);
    o->config_nvme_dir = NULL;
}

void cli_tier_usage(FILE *out)
{
    fprintf(out,
            "KV memory tiers (a block moves between them as its exact bytes, CRC-checked):\n"
            "      --device-kv-mib N   device KV block pool in MiB, fractions allowed (default: room\n"
            "                          for the whole context); --kv-pool-mib is the same flag\n"
            "      --host-kv-mib N     host memory tier in MiB below the device pool: blocks that\n"
            "                          do not fit the device wait here and come back for attention\n"
            "                          (default: none; %g with --nvme-dir)\n"
            "      --nvme-dir DIR      spill directory of the NVMe tier (created 0700; slab files\n"
            "                          0600, deleted at exit; written and read with io_uring)\n"
            "      --nvme-kv-mib N     NVMe tier budget in MiB (default %g with --nvme-dir)\n"
            "      --config FILE       JSON object (a YAML mapping when FILE ends in .yaml or .yml)\n"
            "                          with any of the keys device_kv_mib, host_kv_mib, nvme_dir,\n"
            "                          nvme_kv_mib (flags win over the file)\n",
            DEFAULT_HOST_MIB_WITH_NVME, DEFAULT_NVME_MIB);
}

int cli_tier_flag(int opt, const char *arg, cli_tier_opts *o)
{
    switch (opt) {
    case OPT_TIER_DEVICE:
        return cli_parse_double("--device-kv-mib", arg, STRATA_KV_MIB_MIN, STRATA_KV_MIB_MAX, &o->device_mib) ? 0 : EXIT_USAGE;
    case OPT_TIER_HOST:
        return cli_parse_double("--host-kv-mib", arg, STRATA_KV_MIB_MIN, STRATA_KV_MIB_MAX, &o->host_mib) ? 0 : EXIT_USAGE;
    case OPT_TIER_NVME:
        return cli_parse_double("--nvme-kv-mib", arg, STRATA_KV_MIB_MIN, STRATA_KV_MIB_MAX, &o->nvme_mib) ? 0 : EXIT_USAGE;
    case OPT_TIER_NVME_DIR:
        if (!*arg) {
            fprintf(stderr, "strata: --nvme-dir needs a directory\n");
            return EXIT_USAGE;
        }
        o->nvme_dir = arg;
        return 0;
    case OPT_TIER_CONFIG:
        o->config = arg;
        return 0;
    default:
        return EXIT_USAGE;
    }
}

/* One number key of the config file into *dst unless a flag set it already. */
static int config_mib(const char *cmd, const char *path, json_t *root, const char *key, double *dst)
{
    json_t *v = json_object_get(root, key);
    if (!v)
        return 0;
    if (!json_is_number(v) || json_number_value(v) < STRATA_KV_MIB_MIN || json_number_value(v) > STRATA_KV_MIB_MAX) {
        fprintf(stderr, "strata %s: --config %s: \"%s\" must be a number of MiB from %g to %g\n", cmd, path, key,
                STRATA_KV_MIB_MIN, STRATA_KV_MIB_MAX);
        return EXIT_USAGE;
    }
    if (*dst < 0)
        *dst = json_number_value(v);
    return 0;
}

static int read_config(const char *cmd, cli_tier_opts *o)
{
    static const char *const known[] = {"device_kv_mib", "host_kv_mib", "nvme_dir", "nvme_kv_mib"};
    char why[300];
    json_t *root = config_file_load(o->config, why, sizeof why);
    if (!root) {
        fprintf(stderr, "strata %s: --config %s: %s\n", cmd, o->config, why);
        return EXIT_USAGE;
    }
    int rc = 0;
    if (!json_is_object(root)) {
        fprintf(stderr, "strata %s: --config %s: the file must hold one %s\n", cmd, o->config,
                config_file_is_yaml(o->config) ? "mapping" : "JSON object");
        rc = EXIT_USAGE;
    }
    const char *key;
    json_t *value;
    json_object_foreach(root, key, value) {
        (void)value;
        bool ok = false;
        for (size_t i = 0; i < sizeof known / sizeof *known; i++)
            ok |= !strcmp(key, known[i]);
        if (!ok && rc == 0) {
            fprintf(stderr, "strata %s: --config %s: unknown key \"%s\" (known: device_kv_mib, host_kv_mib, nvme_dir, "
                            "nvme_kv_mib)\n", cmd, o->config, key);
            rc = EXIT_USAGE;
        }
    }
    if (rc == 0)
        rc = config_mib(cmd, o->config, root, "device_kv_mib", &o->device_mib);
    if (rc == 0)
        rc = config_mib(cmd, o->config, root, "host_kv_mib", &o->host_mib);
    if (rc == 0)
        rc = config_mib(cmd, o->config, root, "nvme_kv_mib", &o->nvme_mib);
    json_t *dir = rc == 0 ? json_object_get(root, "nvme_dir") : NULL;
    if (dir && (!json_is_string(dir) || !*json_string_value(dir))) {
        fprintf(stderr, "strata %s: --config %s: \"nvme_dir\" must be a non-empty string\n", cmd, o->config);
        rc = EXIT_USAGE;
    } else if (dir && !o->nvme_dir) {
        o->config_nvme_dir = strdup(json_string_value(dir));
        if (!o->config_nvme_dir) {
            fprintf(stderr, "strata %s: out of memory\n", cmd);
            rc = EXIT_RUNTIME;
        }
        o->nvme_dir = o->config_nvme_dir;
    }
    json_decref(root);
    return rc;
}

int cli_tier_finish(const char *cmd, cli_tier_opts *o)
{
    if (o->config) {
        int rc = read_config(cmd, o);
        if (rc)
            return rc;
    }
    if (o->nvme_mib >= 0 && !o->nvme_dir) {
        fprintf(stderr, "strata %s: --nvme-kv-mib needs --nvme-dir\n", cmd);
        return EXIT_USAGE;
    }
    if (o->nvme_dir) {
        if (o->host_mib < 0)
            o->host_mib = DEFAULT_HOST_MIB_WITH_NVME;
        if (o->nvme_mib < 0)
            o->nvme_mib = DEFAULT_NVME_MIB;
    }
    return 0;
}

size_t cli_tier_device_slots(const cli_tier_opts *o, const kv_geometry *g, const kv_codec_params *codecs, size_t ctx)
{
    size_t slot = kv_plan_largest_block(g, codecs);
    size_t most = (ctx + (size_t)g->block_tokens - 1) / (size_t)g->block_tokens * (size_t)g->n_layers;
    if (o->device_mib <= 0)
        return o->host_mib > 0 ? most : 0;
    size_t n = slot ? (size_t)(o->device_mib * 1048576.0) / slot : 0;
    return n < most ? n : most;
}

/* ---- the spill files of a command ended by a signal ----
 * A command that Ctrl-C, SIGTERM or SIGHUP ends would otherwise leave its slab files (each up
 * to a GiB, preallocated) and the spill directory it made. The handler removes them with
 * async-signal-safe calls only (unlink, rmdir), then dies of the signal as it would have. The
 * signal may be handled on any thread (matmul workers, BLAS) while the main thread tears the
 * tiers down, so the handler reads only an atomic count and a buffer that is never freed while
 * it could be read: it is replaced only when another set of tiers is armed. A command makes one
 * set of tiers at a time. */

static const int cleanup_signals[] = {SIGINT, SIGTERM, SIGHUP};
#define N_CLEANUP_SIGNALS (sizeof cleanup_signals / sizeof cleanup_signals[0])
static char *cleanup_paths;              /* cleanup_n paths of PATH_MAX bytes */
static atomic_int cleanup_n;             /* lock-free: async-signal-safe */
static const kv_tiers *cleanup_tiers;    /* the tiers armed, NULL: none */
static struct sigaction cleanup_old[N_CLEANUP_SIGNALS];
static bool cleanup_installed[N_CLEANUP_SIGNALS];

static void remove_spill_and_die(int sig)
{
    int saved = errno;
    int n = atomic_load(&cleanup_n);
    for (int i = 0; i < n; i++) {
        const char *p = cleanup_paths + (size_t)i * PATH_MAX;
        if (unlink(p) != 0)
            rmdir(p);   /* the directory, emptied by the unlinks before it */
    }
    errno = saved;
    /* SA_RESETHAND put the default action back: the signal, pending until this returns, ends
     * the process with the status a shell expects (130 for Ctrl-C). */
    raise(sig);
}

static void cleanup_arm(const kv_tiers *t)
{
    const nvme_store *nv = kv_tiers_nvme(t);
    if (!nv || cleanup_tiers)
        return;
    size_t n = nvme_store_owned_paths(nv, NULL, PATH_MAX, 0);
    char *paths = n && n <= INT_MAX ? malloc(n * PATH_MAX) : NULL;
    if (!paths || nvme_store_owned_paths(nv, paths, PATH_MAX, n) != n) {
        free(paths);   /* not fatal: the files are then left as a crash would leave them */
        return;
    }
    free(cleanup_paths);   /* disarmed before (count 0, handlers restored) */
    cleanup_paths = paths;
    atomic_store(&cleanup_n, (int)n);
    cleanup_tiers = t;
    struct sigaction sa = {.sa_handler = remove_spill_and_die, .sa_flags = SA_RESETHAND};
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < N_CLEANUP_SIGNALS; i++)
        sigaddset(&sa.sa_mask, cleanup_signals[i]);   /* one cleanup at a time per thread */
    for (size_t i = 0; i < N_CLEANUP_SIGNALS; i++) {
        /* A signal the command was started ignoring (nohup) stays ignored. */
        cleanup_installed[i] = sigaction(cleanup_signals[i], NULL, &cleanup_old[i]) == 0 &&
                               cleanup_old[i].sa_handler != SIG_IGN &&
                               sigaction(cleanup_signals[i], &sa, NULL) == 0;
    }
}

static void cleanup_disarm(void)
{
    atomic_store(&cleanup_n, 0);
    for (size_t i = 0; i < N_CLEANUP_SIGNALS; i++)
        if (cleanup_installed[i])
            sigaction(cleanup_signals[i], &cleanup_old[i], NULL);
    memset(cleanup_installed, 0, sizeof cleanup_installed);
    cleanup_tiers = NULL;
    /* cleanup_paths stays: a handler that started before the count went to 0 may still read it. */
}

void cli_tier_destroy(kv_tiers *t)
{
    if (!t)
        return;
    bool armed = t == cleanup_tiers;
    kv_tiers_destroy(t);   /* removes the files itself; a signal meanwhile finds some gone */
    if (armed)
        cleanup_disarm();
}

int cli_tier_create(const cli_tier_opts *o, kv_tiers **out, strata_error *err)
{
    return cli_tier_create_with(o, NULL, out, err);
}

int cli_tier_create_with(const cli_tier_opts *o, const host_arena_allocator *alloc, kv_tiers **out,
                         strata_error *err)
{
    *out = NULL;
    if (o->host_mib <= 0)
        return STRATA_OK;
    kv_tiers_options to = {.host_bytes = (size_t)(o->host_mib * 1048576.0), .nvme_dir = o->nvme_dir,
                           .nvme_bytes = o->nvme_mib > 0 ? (uint64_t)(o->nvme_mib * 1048576.0) : 0,
                           .allocator = alloc};
    *out = kv_tiers_create(&to, err);
    if (!*out)
        return err ? err->code : STRATA_EIO;
    cleanup_arm(*out);
    return STRATA_OK;
}

int cli_kv_memory_create(const char *cmd, const cli_tier_opts *o, const kv_geometry *g, const kv_codec_params *codecs,
                         size_t ctx, bool quiet, cli_kv_memory *out)
{
    memset(out, 0, sizeof *out);
    strata_error err = {0};
    out->blocks_for_ctx = (ctx + (size_t)g->block_tokens - 1) / (size_t)g->block_tokens;
    const double budget = o->device_mib > 0 ? o->device_mib * 1048576.0 : 0.0;
    if (o->host_mib > 0) {
        /* With a tier below, any layer may need the whole pool for attention: one slot size. */
        size_t n_slots = cli_tier_device_slots(o, g, codecs, ctx);
        if (n_slots == 0) {
            fprintf(stderr, "strata %s: --device-kv-mib %g holds no block of %zu bytes\n", cmd, o->device_mib,
                    kv_plan_largest_block(g, codecs));
            return EXIT_USAGE;
        }
        out->blocks_per_layer = n_slots / (size_t)g->n_layers;
        out->pool = kv_pool_create_shared(g, codecs, n_slots, &err);
    } else {
        size_t row_bytes = kv_plan_row_bytes(g, codecs);   /* one block slot of every layer */
        out->blocks_per_layer = budget > 0 ? (size_t)budget / row_bytes : out->blocks_for_ctx;
        if (out->blocks_per_layer == 0) {
            fprintf(stderr, "strata %s: --device-kv-mib %g holds less than one block per layer (%zu bytes = %.3f "
                            "MiB)\n", cmd, o->device_mib, row_bytes, (double)row_bytes / 1048576.0);
            return EXIT_USAGE;
        }
        if (out->blocks_per_layer > out->blocks_for_ctx)
            out->blocks_per_layer = out->blocks_for_ctx;   /* more than the context can use */
        out->pool = kv_pool_create_plan(g, codecs, out->blocks_per_layer, &err);
    }
    if (!out->pool) {   /* EINVAL: a budget this machine cannot hold */
        fprintf(stderr, "strata %s: %s\n", cmd, err.msg);
        return err.code == STRATA_EINVAL ? EXIT_USAGE : EXIT_RUNTIME;
    }
    if (o->host_mib > 0) {
        cli_tier_create(o, &out->tiers, &err);
        kv_lower_tier lower;
        if (out->tiers) {
            lower = kv_tiers_lower(out->tiers);
            if (kv_pool_set_lower_tier(out->pool, &lower, &err) != STRATA_OK) {
                cli_tier_destroy(out->tiers);
                out->tiers = NULL;
            }
        }
        if (!out->tiers) {
            fprintf(stderr, "strata %s: %s\n", cmd, err.msg);
            cli_kv_memory_free(out);
            return err.code == STRATA_EINVAL ? EXIT_USAGE : EXIT_RUNTIME;
        }
        if (!quiet)
            fprintf(stderr, "strata: KV tiers: device pool %.2f MiB (%zu slots shared by the layers; the context needs "
                            "%zu per layer); %s\n", (double)kv_pool_bytes(out->pool) / 1048576.0,
                    kv_pool_capacity(out->pool), out->blocks_for_ctx, kv_tiers_describe(out->tiers));
    }
    return 0;
}

void cli_kv_memory_free(cli_kv_memory *mem)
{
    kv_pool_destroy(mem->pool);
    cli_tier_destroy(mem->tiers);
    mem->pool = NULL;
    mem->tiers = NULL;
}

void cli_kv_memory_print_stats(const cli_kv_memory *mem, FILE *out)
{
    kv_pool_stats ps;
    kv_pool_get_stats(mem->pool, &ps);
    fprintf(out, "kv device pool: %zu of %zu slots free (%.1f MiB); %" PRIu64 " evictions (%" PRIu64
                 " copied down, %.2f MiB), %" PRIu64 " fetches (%.2f MiB)",
            ps.free_slots, ps.slots, (double)kv_pool_bytes(mem->pool) / 1048576.0, ps.evictions, ps.writebacks,
            (double)ps.writeback_bytes / 1048576.0, ps.fetches, (double)ps.fetch_bytes / 1048576.0);
    if (ps.seq_spills || ps.seq_resumes)
        fprintf(out, "; %" PRIu64 " sequence spills, %" PRIu64 " resumes", ps.seq_spills, ps.seq_resumes);
    fprintf(out, "\n");
    if (!mem->tiers)
        return;
    kv_tiers_stats ts;
    kv_tiers_get_stats(mem->tiers, &ts);
    fprintf(out, "kv host tier: %zu blocks, %.2f of %.1f MiB used\n", ts.host_blocks,
            (double)ts.host_used_bytes / 1048576.0, (double)ts.host_capacity_bytes / 1048576.0);
    if (ts.nvme_capacity_bytes)
        fprintf(out, "kv nvme tier: %zu blocks, %.2f of %.1f MiB; %" PRIu64 " spills (%.2f MiB written, %.0f MB/s), %"
                     PRIu64 " restores (%.2f MiB read, %.0f MB/s); failures: %" PRIu64 " spills, %" PRIu64 " restores\n",
                ts.nvme_blocks, (double)ts.nvme_stored_bytes / 1048576.0, (double)ts.nvme_capacity_bytes / 1048576.0,
                ts.spills, (double)ts.bytes_written / 1048576.0, ts.write_bytes_per_s / 1e6, ts.restores,
                (double)ts.bytes_read / 1048576.0, ts.read_bytes_per_s / 1e6, ts.spill_failures, ts.restore_failures);
    fprintf(out, "kv CRC failures: %" PRIu64 "\n", ts.crc_failures);
}
