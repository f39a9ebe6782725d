/* How many block rows (one block of each of a stage's layers) a pipeline stage holds on its
 * device and in the tiers below: the admission figures of sched_replica_config.
 *
 * The figures follow the rules the workers' room checks apply, so that admission never reserves
 * more than a worker takes (a request admitted beyond it failed part way with
 * RESOURCE_EXHAUSTED):
 *   - device: with no tier below, a layer's slots hold the largest block the plans make in that
 *     layer (kv_pool_create_plans); with one, slots of the plans' largest block are shared by
 *     every layer, and one layer of a sequence alone may take every slot but one.
 *   - below: every block counts as the plans' largest block rounded up to whole 4 KiB pages
 *     (kv_lower_unit_bytes; offload/kv_tiers.c's room), in the larger of the host and NVMe
 *     budgets, not their sum (making room in host memory moves blocks to NVMe), the NVMe budget
 *     cut into slab files as nvme_store does by default (no block spans two).
 *
 * Pure function, no I/O. */
#ifndef STRATA_COORDINATOR_KV_ROWS_H
#define STRATA_COORDINATOR_KV_ROWS_H

#include <stdint.h>

#include "coordinator/sched/scheduler.h"
#include "kvstore/error.h"
#include "kvstore/kv_cache.h"

typedef struct kv_stage_budget {
    uint64_t device_bytes;   /* the stage's device KV budget */
    uint64_t host_bytes;     /* its host tier's; 0: no tier below the device */
    uint64_t nvme_bytes;     /* its NVMe tier's, below host memory; 0: none (ignored without a host tier) */
} kv_stage_budget;

/* Fills *out for a stage of g->n_layers layers whose requests may use any of n_plans plans
 * (each plans[i] has g->n_layers entries: the stage's layers). STRATA_EINVAL with a message
 * when a plan does not validate or the device budget holds no block row. */
int kv_stage_rows(const kv_geometry *g, const kv_codec_params *const *plans, int n_plans, const kv_stage_budget *b,
                  sched_replica_config *out, strata_error *err);

/* Blocks of unit_bytes (a multiple of 4096) that an empty NVMe tier of budget_bytes holds in
 * nvme_store's default slab files (exported for its test against a real store). */
uint64_t kv_nvme_blocks(uint64_t budget_bytes, uint64_t unit_bytes);

#endif
