/* The CUDA compute of a pipeline stage (stage_gpu.h). */
#include "worker/stage/stage_gpu.h"

#include <stdlib.h>
#include <string.h>

void stage_usage_add_tiers(const kv_tiers *t, stage_kv_usage *out)
{
    kv_tiers_stats ts;
    kv_tiers_get_stats(t, &ts);
    out->host_blocks = ts.host_blocks;
    out->host_bytes = ts.host_used_bytes;
    out->host_capacity_bytes = ts.host_capacity_bytes;
    out->nvme_blocks = ts.nvme_blocks;
    out->nvme_bytes = ts.nvme_stored_bytes;
    out->nvme_capacity_bytes = ts.nvme_capacity_bytes;
    out->spills += ts.spills;
    out->restores += ts.restores;
    out->crc_failures = ts.crc_failures;
    out->spill_failures = ts.spill_failures;
    out->restore_failures = ts.restore_failures;
    out->spill_error = ts.spill_error;
}

#ifdef STRATA_HAVE_CUDA

#include <cuda_runtime.h>

#include "offload/device_pool.h"
#include "worker/cuda/device_mem.h"
#include "worker/cuda/model_cuda.h"
#include "worker/cuda/cuda_fail.h"

struct stage_gpu {
    const model_config *cfg;
    bool first, last;
    cuda_model *cm;
    kv_tiers *tiers;
    stage_gpu_config c;           /* c.plans points at plans */
    kv_codec_params **plans;      /* copies of the config's plans, each the stage's layers */
    /* per-step scratch, grown on demand */
    float *d_in, *d_out;          /* device rows of a step whose rows come or go through the host */
    size_t cap_d;                 /* floats in each */
    cuda_batch_item *batch;       /* the step's items for the model */
    size_t cap_items;
    float *d_step[2];             /* a step's entering and leaving rows when they cross on NCCL */
    size_t cap_step[2];           /* floats */
};

struct stage_gpu_seq {
    cuda_seq *s;
    int device;
};

int stage_gpu_probe(int device, strata_error *err) { return cuda_select_device(device, err); }

/* The current device is per thread, and the worker may step the stage from another thread than
 * the one that created it. */
static int use_device(const stage_gpu *g, strata_error *err)
{
    cudaError_t e = cudaSetDevice(g->c.device);
    return e == cudaSuccess ? STRATA_OK
                            : cuda_failf(err, e, "selecting cuda:%d", g->c.device);
}

/* Room for a step's items and rows (host entering rows go up through d_in, leaving ones through d_out). */
static int ensure(stage_gpu *g, size_t items, size_t rows, strata_error *err);

int stage_gpu_create(model *m, const stage_gpu_config *c, stage_gpu **out, strata_error *err)
{
    *out = NULL;
    int rc = cuda_select_device(c->device, err);
    if (rc != STRATA_OK)
        return rc;
    stage_gpu *g = calloc(1, sizeof *g);
    if (!g)
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    g->c = *c;
    g->c.tiers = NULL;
    const int n_layers = model_layer_end(m) - model_layer_begin(m);
    if (!c->plans || c->n_plans < 1 || !(g->plans = calloc((size_t)c->n_plans, sizeof *g->plans))) {
        free(g);
        return strata_fail(err, c->plans && c->n_plans > 0 ? STRATA_ENOMEM : STRATA_EINVAL,
                           "GPU stage: no KV plan, or out of memory");
    }
    g->c.plans = (const kv_codec_params *const *)g->plans;
    for (int i = 0; i < c->n_plans; i++) {
        if (!c->plans[i] || !(g->plans[i] = malloc((size_t)n_layers * sizeof **g->plans))) {
            stage_gpu_destroy(g);
            return strata_fail(err, c->plans[i] ? STRATA_ENOMEM : STRATA_EINVAL, "GPU stage: no KV plan %d, or out "
                               "of memory", i);
        }
        memcpy(g->plans[i], c->plans[i], (size_t)n_layers * sizeof **g->plans);
    }
    g->cfg = model_get_config(m);
    g->first = model_layer_begin(m) == 0;
    g->last = model_layer_end(m) == g->cfg->n_layers;
    const kv_geometry geo = {.n_layers = n_layers, .n_kv_heads = g->cfg->n_kv_heads, .head_dim = g->cfg->head_dim,
                             .block_tokens = c->block_tokens};
    cuda_kv_pool_size z = {0};
    for (int i = 0; rc == STRATA_OK && i < c->n_plans; i++)
        rc = cuda_seq_check_plan(g->plans[i], n_layers, err);
    if (rc == STRATA_OK)
        rc = cuda_kv_pool_sizing(g->c.plans, c->n_plans, &geo, c->max_seq_tokens, c->max_batch_seqs,
                                 c->device_kv_bytes, c->tiers != NULL, &z, err);
    if (rc == STRATA_OK && z.slots < z.need)
        rc = strata_fail(err, STRATA_EINVAL, "GPU stage: a device KV budget of %llu bytes holds %zu blocks of %zu "
                         "bytes; a %zu-token sequence needs %zu%s", (unsigned long long)c->device_kv_bytes, z.slots,
                         z.slot_bytes, c->max_seq_tokens, z.need,
                         c->tiers ? " (one layer's blocks and the one forming)" : " without a host tier below");
    /* Without a tier below, the coordinator counts block rows of each layer's own slot size
     * (kv_plans_row_bytes, as a CPU stage's pool holds them); this pool's slots all take the
     * largest block, so where the plans' layers differ in size it would hold fewer rows than
     * the coordinator admits, and steps would fail for want of slots. Refused here instead. */
    if (rc == STRATA_OK && !c->tiers && c->device_kv_bytes) {
        const size_t row = kv_plans_row_bytes(&geo, g->c.plans, c->n_plans);
        const size_t counted = row ? (size_t)(c->device_kv_bytes / row) : 0, held = z.slots / (size_t)n_layers;
        if (held < counted)
            rc = strata_fail(err, STRATA_EINVAL, "GPU stage: its KV pool has one slot size for every layer (%zu bytes, "
                             "the largest block of its plans), so the device budget holds %zu blocks per layer where "
                             "the coordinator counts %zu (the plans' layers differ in block size): give the workers a "
                             "host tier (--host-kv-mib), with which both count slots of the largest block",
                             z.slot_bytes, held, counted);
    }
    const size_t slots = z.slots;
    if (rc == STRATA_OK && !(g->cm = cuda_model_create(m, CUDA_WEIGHTS_F16, err)))
        rc = err ? err->code : STRATA_EIO;
    kv_lower_tier lower;
    if (rc == STRATA_OK && c->tiers) {
        kv_tiers_options to = *c->tiers;
        to.allocator = cuda_pinned_host_allocator();
        if (!(g->tiers = kv_tiers_create(&to, err)))
            rc = err ? err->code : STRATA_EIO;
        else
            lower = kv_tiers_lower(g->tiers);
    }
    if (rc == STRATA_OK)
        rc = cuda_model_create_kv_pool_plans(g->cm, g->c.plans, c->n_plans, c->block_tokens, slots,
                                             g->tiers ? &lower : NULL, err);
    if (rc == STRATA_OK && c->max_batch_tokens) {   /* the largest step's buffers, beside the weights and pool */
        rc = cuda_model_reserve_step(g->cm, c->max_batch_tokens, c->max_batch_seqs, err);
        if (rc == STRATA_OK)
            rc = ensure(g, c->max_batch_seqs, g->first && g->last ? 0 : c->max_batch_tokens, err);
        if (rc != STRATA_OK)
            strata_error_prefix(err, "GPU stage: a step of up to %zu tokens (--max-batch-tokens) for %zu sequences",
                                c->max_batch_tokens, c->max_batch_seqs);
    }
    if (rc != STRATA_OK) {
        stage_gpu_destroy(g);
        return rc;
    }
    *out = g;
    return STRATA_OK;
}

void stage_gpu_destroy(stage_gpu *g)
{
    if (!g)
        return;
    (void)use_device(g, NULL);
    cudaFree(g->d_in);
    cudaFree(g->d_out);
    cudaFree(g->d_step[0]);
    cudaFree(g->d_step[1]);
    cuda_model_free(g->cm);   /* the pool, and its copies in the tiers */
    kv_tiers_destroy(g->tiers);
    free(g->batch);
    for (int i = 0; g->plans && i < g->c.n_plans; i++)
        free(g->plans[i]);
    free(g->plans);
    free(g);
}

/* A new sequence of the stage: empty on plans[plan] (img NULL) or made from a migration image
 * on its own plan, one of the stage's. */
static stage_gpu_seq *new_seq(stage_gpu *g, int plan, const uint8_t *img, size_t len, strata_error *err)
{
    if (plan < 0 || plan >= g->c.n_plans) {
        strata_fail(err, STRATA_EINVAL, "GPU stage: no KV plan %d", plan);
        return NULL;
    }
    if (use_device(g, err) != STRATA_OK)
        return NULL;
    stage_gpu_seq *q = calloc(1, sizeof *q);
    if (!q) {
        strata_fail(err, STRATA_ENOMEM, "out of memory");
        return NULL;
    }
    q->device = g->c.device;
    q->s = img ? cuda_seq_import(g->cm, g->c.plans, g->c.n_plans, g->c.block_tokens, g->c.max_seq_tokens, img, len,
                                 err)
               : cuda_seq_create_plan(g->cm, g->plans[plan], g->c.block_tokens, g->c.max_seq_tokens, err);
    if (!q->s) {
        free(q);
        return NULL;
    }
    return q;
}

stage_gpu_seq *stage_gpu_seq_create(stage_gpu *g, int plan, strata_error *err) { return new_seq(g, plan, NULL, 0, err); }

void stage_gpu_seq_free(stage_gpu_seq *q)
{
    if (!q)
        return;
    (void)cudaSetDevice(q->device);   /* its memory is on that device (see use_device) */
    cuda_seq_free(q->s);
    free(q);
}

size_t stage_gpu_seq_length(const stage_gpu_seq *q) { return q ? cuda_seq_length(q->s) : 0; }

void stage_gpu_seq_set_waiting(stage_gpu_seq *q, bool waiting)
{
    if (q)
        cuda_seq_set_waiting(q->s, waiting);
}

int stage_gpu_seq_export(stage_gpu *g, stage_gpu_seq *q, uint8_t **img, size_t *len, strata_error *err)
{
    *img = NULL;
    *len = 0;
    int rc = use_device(g, err);
    return rc == STRATA_OK ? cuda_seq_export(q->s, img, len, err) : rc;
}

stage_gpu_seq *stage_gpu_seq_import(stage_gpu *g, const uint8_t *img, size_t len, strata_error *err)
{
    if (!img) {
        strata_fail(err, STRATA_EINVAL, "stage_gpu_seq_import: no image");
        return NULL;
    }
    return new_seq(g, 0, img, len, err);
}

static int ensure(stage_gpu *g, size_t items, size_t rows, strata_error *err)
{
    const size_t floats = rows * (size_t)g->cfg->n_embd;
    if (items > g->cap_items) {
        cuda_batch_item *b = realloc(g->batch, items * sizeof *b);
        if (!b)
            return strata_fail(err, STRATA_ENOMEM, "out of memory");
        g->batch = b;
        g->cap_items = items;
    }
    if (floats > g->cap_d) {
        cudaFree(g->d_in);
        cudaFree(g->d_out);
        g->d_in = g->d_out = NULL;
        g->cap_d = 0;
        cudaError_t ce = cudaMalloc((void **)&g->d_in, floats * sizeof(float));
        if (ce == cudaSuccess)
            ce = cudaMalloc((void **)&g->d_out, floats * sizeof(float));
        if (ce != cudaSuccess)
            return cuda_fail(err, ce, "rows of a step");
        g->cap_d = floats;
    }
    return STRATA_OK;
}

float *stage_gpu_device_rows(stage_gpu *g, int which, size_t rows, strata_error *err)
{
    if (!g || which < 0 || which > 1) {
        strata_fail(err, STRATA_EINVAL, "stage_gpu_device_rows: bad arguments");
        return NULL;
    }
    if (use_device(g, err) != STRATA_OK)
        return NULL;
    const size_t floats = rows * (size_t)g->cfg->n_embd;
    if (floats > g->cap_step[which]) {
        float *p = NULL;
        cudaError_t ce = cudaMalloc((void **)&p, floats * sizeof(float));
        if (ce == cudaSuccess && g->cap_step[which])
            ce = cudaMemcpy(p, g->d_step[which], g->cap_step[which] * sizeof(float), cudaMemcpyDeviceToDevice);
        if (ce != cudaSuccess) {
            cudaFree(p);
            cuda_failf(err, ce, "%zu rows of a step", rows);
            return NULL;
        }
        cudaFree(g->d_step[which]);
        g->d_step[which] = p;
        g->cap_step[which] = floats;
    }
    return g->d_step[which];
}

bool stage_gpu_context_lost(stage_gpu *g, strata_error *err)
{
    if (!g)
        return false;
    return use_device(g, err) != STRATA_OK || cuda_model_context_lost(g->cm, err);   /* either way no step runs */
}

int stage_gpu_compact_rows(stage_gpu *g, size_t dst, size_t src, size_t n, strata_error *err)
{
    const size_t e = (size_t)g->cfg->n_embd;
    if (dst >= src || (src + n) * e > g->cap_step[0])
        return strata_fail(err, STRATA_EINVAL, "stage_gpu_compact_rows: rows %zu..%zu to %zu", src, src + n, dst);
    /* In pieces of at most src - dst rows: a piece's source and destination never overlap. */
    for (size_t r = 0, piece = src - dst; r < n; r += piece) {
        const size_t k = n - r < piece ? n - r : piece;
        cudaError_t ce = cudaMemcpy(g->d_step[0] + (dst + r) * e, g->d_step[0] + (src + r) * e, k * e * sizeof(float),
                                    cudaMemcpyDeviceToDevice);
        if (ce != cudaSuccess)
            return cuda_fail(err, ce, "moving rows");
    }
    return STRATA_OK;
}

int stage_gpu_batch_check(stage_gpu *g, const stage_gpu_item *items, size_t n_items, size_t *bad_item,
                          strata_error *err)
{
    if (bad_item)
        *bad_item = n_items;
    if (!g || !items || n_items == 0)
        return strata_fail(err, STRATA_EINVAL, "GPU stage: no items");
    const int rc = ensure(g, n_items, 0, err);
    if (rc != STRATA_OK)
        return rc;
    for (size_t i = 0; i < n_items; i++)
        g->batch[i] = (cuda_batch_item){items[i].seq->s, items[i].tokens, items[i].n_tokens};
    return cuda_model_batch_check(g->cm, g->batch, n_items, bad_item, err);
}

/* One step: every item whole (a prompt, a prompt chunk continuing its sequence, or one token),
 * the rows in the step's layout (items one after another), on the device or through it. */
static int forward_step(stage_gpu *g, const stage_gpu_item *items, size_t n_items, const float *hidden_in,
                        bool in_on_device, float *hidden_out, bool out_on_device, float *logits,
                        const cuda_sample_row *sample, int32_t *next, strata_error *err)
{
    if (!g || !items || n_items == 0)
        return strata_fail(err, STRATA_EINVAL, "GPU stage: no items");
    if ((!g->first && !hidden_in) || (!g->last && !hidden_out))
        return strata_fail(err, STRATA_EINVAL, "GPU stage: missing rows");
    size_t rows = 0;
    for (size_t i = 0; i < n_items; i++)
        rows += items[i].n_tokens;
    int rc = use_device(g, err);
    if (rc == STRATA_OK)
        rc = ensure(g, n_items, rows, err);
    if (rc != STRATA_OK)
        return rc;
    for (size_t i = 0; i < n_items; i++)
        g->batch[i] = (cuda_batch_item){items[i].seq->s, items[i].tokens, items[i].n_tokens};
    const size_t bytes = rows * (size_t)g->cfg->n_embd * sizeof(float);
    cuda_stage_io io = {NULL, NULL};
    if (!g->first) {
        io.hidden_in = in_on_device ? hidden_in : g->d_in;
        cudaError_t ce = in_on_device ? cudaSuccess : cudaMemcpy(g->d_in, hidden_in, bytes, cudaMemcpyHostToDevice);
        if (ce != cudaSuccess)
            return cuda_fail(err, ce, "stage input rows");
    }
    if (!g->last)
        io.hidden_out = out_on_device ? hidden_out : g->d_out;
    rc = sample ? cuda_model_stage_step_sample(g->cm, g->batch, n_items, &io, sample, next, err)
                : cuda_model_stage_step(g->cm, g->batch, n_items, &io, g->last ? logits : NULL, err);
    if (rc == STRATA_OK && !g->last && !out_on_device) {
        cudaError_t ce = cudaMemcpy(hidden_out, g->d_out, bytes, cudaMemcpyDeviceToHost);
        if (ce != cudaSuccess)
            rc = cuda_fail(err, ce, "stage output rows");
    }
    return rc;
}

int stage_gpu_forward(stage_gpu *g, const stage_gpu_item *items, size_t n_items, const float *hidden_in,
                      bool in_on_device, float *hidden_out, bool out_on_device, float *logits, strata_error *err)
{
    return forward_step(g, items, n_items, hidden_in, in_on_device, hidden_out, out_on_device, logits, NULL, NULL,
                          err);
}

int stage_gpu_forward_sample(stage_gpu *g, const stage_gpu_item *items, size_t n_items, const float *hidden_in,
                             bool in_on_device, const cuda_sample_row *sample, int32_t *next, strata_error *err)
{
    if (!g || !g->last || !sample || !next)
        return strata_fail(err, STRATA_EINVAL, "GPU stage: sampling needs the last stage, rows and an output");
    return forward_step(g, items, n_items, hidden_in, in_on_device, NULL, false, NULL, sample, next, err);
}

void stage_gpu_usage(const stage_gpu *g, stage_kv_usage *out)
{
    memset(out, 0, sizeof *out);
    if (!g)
        return;
    device_pool_stats ps;
    cuda_model_kv_pool_stats(g->cm, &ps);
    out->device_capacity_blocks = ps.slots;
    out->device_blocks = ps.slots - ps.free_slots;
    if (g->tiers)
        stage_usage_add_tiers(g->tiers, out);
    out->spills += ps.evictions;
    out->restores += ps.fetches;
}

#else   /* a build without CUDA */

static int no_cuda(strata_error *err)
{
    return strata_fail(err, STRATA_EUNSUPPORTED, "this build has no CUDA support (nvcc was not found when it was "
                       "configured, or -DSTRATA_CUDA=OFF): the worker can only compute on the CPU");
}

int stage_gpu_probe(int device, strata_error *err)
{
    (void)device;
    return no_cuda(err);
}

int stage_gpu_create(model *m, const stage_gpu_config *c, stage_gpu **out, strata_error *err)
{
    (void)m, (void)c;
    *out = NULL;
    return no_cuda(err);
}

void stage_gpu_destroy(stage_gpu *g) { (void)g; }

stage_gpu_seq *stage_gpu_seq_create(stage_gpu *g, int plan, strata_error *err)
{
    (void)g, (void)plan;
    no_cuda(err);
    return NULL;
}

void stage_gpu_seq_free(stage_gpu_seq *q) { (void)q; }
size_t stage_gpu_seq_length(const stage_gpu_seq *q)
{
    (void)q;
    return 0;
}
void stage_gpu_seq_set_waiting(stage_gpu_seq *q, bool waiting) { (void)q, (void)waiting; }

int stage_gpu_seq_export(stage_gpu *g, stage_gpu_seq *q, uint8_t **img, size_t *len, strata_error *err)
{
    (void)g, (void)q;
    *img = NULL;
    *len = 0;
    return no_cuda(err);
}

stage_gpu_seq *stage_gpu_seq_import(stage_gpu *g, const uint8_t *img, size_t len, strata_error *err)
{
    (void)g, (void)img, (void)len;
    no_cuda(err);
    return NULL;
}

int stage_gpu_batch_check(stage_gpu *g, const stage_gpu_item *items, size_t n_items, size_t *bad_item,
                          strata_error *err)
{
    (void)g, (void)items;
    if (bad_item)
        *bad_item = n_items;
    return no_cuda(err);
}

int stage_gpu_forward(stage_gpu *g, const stage_gpu_item *items, size_t n_items, const float *hidden_in,
                      bool in_on_device, float *hidden_out, bool out_on_device, float *logits, strata_error *err)
{
    (void)g, (void)items, (void)n_items, (void)hidden_in, (void)in_on_device, (void)hidden_out, (void)out_on_device;
    (void)logits;
    return no_cuda(err);
}

int stage_gpu_forward_sample(stage_gpu *g, const stage_gpu_item *items, size_t n_items, const float *hidden_in,
                             bool in_on_device, const cuda_sample_row *sample, int32_t *next, strata_error *err)
{
    (void)g, (void)items, (void)n_items, (void)hidden_in, (void)in_on_device, (void)sample, (void)next;
    return no_cuda(err);
}

float *stage_gpu_device_rows(stage_gpu *g, int which, size_t rows, strata_error *err)
{
    (void)g, (void)which, (void)rows;
    no_cuda(err);
    return NULL;
}

int stage_gpu_compact_rows(stage_gpu *g, size_t dst, size_t src, size_t n, strata_error *err)
{
    (void)g, (void)dst, (void)src, (void)n;
    return no_cuda(err);
}

bool stage_gpu_context_lost(stage_gpu *g, strata_error *err)
{
    (void)g, (void)err;
    return false;
}

void stage_gpu_usage(const stage_gpu *g, stage_kv_usage *out)
{
    (void)g;
    memset(out, 0, sizeof *out);
}

#endif
