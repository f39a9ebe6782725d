/* Pipeline layer splits (layer_split.h). */
#include "coordinator/sched/layer_split.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int layer_split_parse(const char *text, layer_split_spec *out, strata_error *err)
{
    memset(out, 0, sizeof *out);
    if (!text || !*text || !strcmp(text, "even"))
        return STRATA_OK;
    if (!strcmp(text, "balanced")) {
        out->mode = LAYER_SPLIT_BALANCED;
        return STRATA_OK;
    }
    out->mode = LAYER_SPLIT_LIST;
    const char *p = text;
    for (;;) {
        if (out->n_counts == LAYER_SPLIT_MAX_STAGES)
            return strata_fail(err, STRATA_EINVAL, "'%s': more than %d stages", text,
                               LAYER_SPLIT_MAX_STAGES);
        if (*p < '0' || *p > '9')   /* strtoul would take a sign or blanks */
            return strata_fail(err, STRATA_EINVAL, "'%s': expected even, balanced or layer counts "
                               "such as 20,10", text);
        errno = 0;
        char *end;
        unsigned long n = strtoul(p, &end, 10);
        if (n == 0)
            return strata_fail(err, STRATA_EINVAL, "'%s': every stage needs at least 1 layer", text);
        if (errno == ERANGE || n > UINT32_MAX)
            return strata_fail(err, STRATA_EINVAL, "'%s': %.*s layers is more than any model has", text,
                               (int)(end - p), p);
        out->counts[out->n_counts++] = (uint32_t)n;
        if (*end == '\0')
            return STRATA_OK;
        if (*end != ',')
            return strata_fail(err, STRATA_EINVAL, "'%s': expected even, balanced or layer counts "
                               "such as 20,10", text);
        p = end + 1;
    }
}

/* The first k stages take n layers as evenly as possible, the first ones one more. */
static void split_evenly(uint32_t n, uint32_t k, uint32_t *begin)
{
    for (uint32_t s = 0; s < k; s++)
        begin[s + 1] = begin[s] + n / k + (s < n % k ? 1 : 0);
}

/* All layers cost the same and only the last stage has more, so the best split gives the last
 * stage some m layers and shares the rest evenly among the others: try every m. */
static void split_balanced(uint32_t n, uint32_t k, const layer_split_costs *c, uint32_t *begin)
{
    if (k == 1) {
        begin[1] = n;
        return;
    }
    uint32_t best_m = 0;
    double best_cost = 0;
    uint32_t best_widest = 0;
    for (uint32_t m = 1; m + (k - 1) <= n; m++) {
        const uint32_t widest_other = (n - m + k - 2) / (k - 1);
        const double other = (double)widest_other * c->layer_cost, last = (double)m * c->layer_cost + c->head_cost;
        const double cost = other > last ? other : last;
        const uint32_t widest = widest_other > m ? widest_other : m;
        if (best_m == 0 || cost < best_cost || (cost == best_cost && widest < best_widest)) {
            best_m = m;
            best_cost = cost;
            best_widest = widest;
        }
    }
    split_evenly(n - best_m, k - 1, begin);
    begin[k] = n;
}

int layer_split_plan(const layer_split_spec *spec, uint32_t n_layers, uint32_t stages, const layer_split_costs *costs,
                     uint32_t *begin, strata_error *err)
{
    if (stages == 0 || stages > LAYER_SPLIT_MAX_STAGES)
        return strata_fail(err, STRATA_EINVAL, "%u stages: expected 1 to %d", stages, LAYER_SPLIT_MAX_STAGES);
    if (stages > n_layers)
        return strata_fail(err, STRATA_EINVAL, "%u stages for a model of %u layers", stages, n_layers);
    begin[0] = 0;
    switch (spec->mode) {
    case LAYER_SPLIT_EVEN:
        split_evenly(n_layers, stages, begin);
        return STRATA_OK;
    case LAYER_SPLIT_BALANCED:
        if (!costs || !(costs->layer_cost > 0) || !(costs->head_cost >= 0))
            return strata_fail(err, STRATA_EINVAL, "balanced stage layers need a positive cost per layer");
        split_balanced(n_layers, stages, costs, begin);
        return STRATA_OK;
    case LAYER_SPLIT_LIST:
        break;
    }
    if (spec->n_counts != stages)
        return strata_fail(err, STRATA_EINVAL, "the layer counts name %u stages, but there are %u", spec->n_counts, stages);
    uint64_t total = 0;
    for (uint32_t s = 0; s < stages; s++) {
        if (spec->counts[s] == 0)   /* layer_split_parse refuses it too; a spec built in code may not */
            return strata_fail(err, STRATA_EINVAL, "stage %u has 0 layers: every stage needs at least 1", s);
        total += spec->counts[s];
    }
    if (total != n_layers)
        return strata_fail(err, STRATA_EINVAL, "the layer counts add up to %llu, but the model has %u layers",
                           (unsigned long long)total, n_layers);
    for (uint32_t s = 0; s < stages; s++)
        begin[s + 1] = begin[s] + spec->counts[s];
    return STRATA_OK;
}

void layer_split_format(const uint32_t *begin, uint32_t stages, char *buf, size_t cap)
{
    if (cap == 0)
        return;
    buf[0] = '\0';
    size_t at = 0;
    for (uint32_t s = 0; s < stages && at < cap; s++) {
        int w = snprintf(buf + at, cap - at, "%s%u", s ? "," : "", begin[s + 1] - begin[s]);
        if (w < 0)
            return;
        at += (size_t)w;
    }
}
