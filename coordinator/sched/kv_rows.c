/* Block rows of a pipeline stage (kv_rows.h). */
#include "coordinator/sched/kv_rows.h"

#include <inttypes.h>

enum { PAGE = 4096, DEFAULT_SLABS = 256 };
#define DEFAULT_SLAB_BYTES ((uint64_t)1 << 30)

uint64_t kv_nvme_blocks(uint64_t budget_bytes, uint64_t unit_bytes)
{
    /* offload/nvme_store.c's default: slabs of min(budget, 1 GiB), or budget / 256 rounded up
     * to pages when that is more; the last slab holds what is left. */
    const uint64_t pages = budget_bytes / PAGE, unit_pages = unit_bytes / PAGE;
    if (pages == 0 || unit_pages == 0)
        return 0;
    uint64_t slab_pages = DEFAULT_SLAB_BYTES / PAGE;
    if (pages > DEFAULT_SLABS * slab_pages)
        slab_pages = (pages + DEFAULT_SLABS - 1) / DEFAULT_SLABS;
    if (slab_pages > pages)
        slab_pages = pages;
    return pages / slab_pages * (slab_pages / unit_pages) + pages % slab_pages / unit_pages;
}

int kv_stage_rows(const kv_geometry *g, const kv_codec_params *const *plans, int n_plans, const kv_stage_budget *b,
                  sched_replica_config *out, strata_error *err)
{
    const size_t row = kv_plans_row_bytes(g, plans, n_plans), largest = kv_plans_largest_block(g, plans, n_plans);
    if (row == 0 || largest == 0)
        return strata_fail(err, STRATA_EINVAL, "the KV plan does not fit these layers");
    const size_t layers = (size_t)g->n_layers;
    size_t dev, stream, total;
    if (b->host_bytes > 0) {
        const uint64_t slots = b->device_bytes / largest;
        dev = (size_t)(slots / layers);
        stream = slots > dev + 1 ? (size_t)(slots - 1) : dev;   /* a GPU stage keeps one for the block forming */
        const uint64_t unit = kv_lower_unit_bytes(largest), in_host = b->host_bytes / unit,
                       in_nvme = kv_nvme_blocks(b->nvme_bytes, unit);
        total = dev + (size_t)((in_host > in_nvme ? in_host : in_nvme) / layers);
    } else {
        dev = stream = total = (size_t)(b->device_bytes / row);
    }
    if (dev == 0)
        return strata_fail(err, STRATA_EINVAL, "a device KV budget of %" PRIu64 " bytes holds no block row (%zu bytes)",
                           b->device_bytes, b->host_bytes > 0 ? largest * layers : row);
    *out = (sched_replica_config){.device_blocks = dev, .stream_blocks = stream, .total_blocks = total};
    return STRATA_OK;
}
