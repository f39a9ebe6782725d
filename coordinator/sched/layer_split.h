/* How a replica's layers are divided among its pipeline stages (the --stage-layers setting).
 *
 * Three ways, all giving contiguous ranges of at least one layer per stage:
 *   "even"      the same number of layers per stage (the first stages take one more when the
 *               count does not divide): every stage holds the same KV per token, so a worker's
 *               KV budget goes furthest; the default.
 *   "balanced"  the same matrix work per decoded token on every stage, counting the output head
 *               (vocabulary x embedding) on the last: the pipeline's slowest stage is as fast as
 *               it can be, but the stages with more layers hold fewer tokens in the same KV
 *               budget. Attention, whose cost grows with the context, is not counted.
 *   "N,N,..."   the layer count of each stage, first to last, as the user chose.
 *
 * Pure functions, no I/O. */
#ifndef STRATA_COORDINATOR_LAYER_SPLIT_H
#define STRATA_COORDINATOR_LAYER_SPLIT_H

#include <stddef.h>
#include <stdint.h>

#include "kvstore/error.h"

#define LAYER_SPLIT_MAX_STAGES 64

typedef enum { LAYER_SPLIT_EVEN, LAYER_SPLIT_BALANCED, LAYER_SPLIT_LIST } layer_split_mode;

typedef struct layer_split_spec {
    layer_split_mode mode;
    uint32_t n_counts;                        /* LAYER_SPLIT_LIST: the stages it names */
    uint32_t counts[LAYER_SPLIT_MAX_STAGES];  /* LAYER_SPLIT_LIST: layers of each stage, >= 1 */
} layer_split_spec;

/* Parses "even", "balanced" or a comma-separated list of positive layer counts (at most
 * LAYER_SPLIT_MAX_STAGES); NULL or "" is "even". STRATA_EINVAL with a message otherwise. */
int layer_split_parse(const char *text, layer_split_spec *out, strata_error *err);

/* What the split costs per decoded token: layer_cost for each layer, head_cost more on the last
 * stage (both in any one unit, e.g. weights multiplied). Only "balanced" uses them. */
typedef struct layer_split_costs {
    double layer_cost;   /* > 0 */
    double head_cost;    /* >= 0 */
} layer_split_costs;

/* Fills begin[0..stages] (begin[0] = 0, begin[stages] = n_layers; stage s holds layers
 * [begin[s], begin[s+1])). STRATA_EINVAL when stages is 0, above n_layers or above
 * LAYER_SPLIT_MAX_STAGES, or when a list names another number of stages or another total of
 * layers than the model has. "balanced" minimises the slowest stage's cost; among equally slow
 * splits, the one whose largest stage has the fewest layers. */
int layer_split_plan(const layer_split_spec *spec, uint32_t n_layers, uint32_t stages, const layer_split_costs *costs,
                     uint32_t *begin, strata_error *err);

/* Writes the split's layer counts as "N,N,..." into buf (cap bytes, truncated if short). */
void layer_split_format(const uint32_t *begin, uint32_t stages, char *buf, size_t cap);

#endif
