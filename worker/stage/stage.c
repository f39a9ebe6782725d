/* A worker's pipeline stage (stage.h). */
#include "worker/stage/stage.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvstore/bytes.h"
#include "kvstore/kv_cache.h"
#include "kvstore/plan.h"
#include "kvstore/seq_image.h"
#include "kvstore/sysmem.h"
#include "offload/kv_tiers.h"
#include "worker/sampler.h"
#include "worker/stage/stage_gpu.h"

typedef struct seq_entry {
    uint64_t id;
    kv_seq *kv;            /* CPU stage */
    stage_gpu_seq *gpu;    /* GPU stage */
    bool waiting;          /* GPU stage: preempted */
    sampler *smp;
} seq_entry;

/* A prefix entry (prefix caching, StepPlan.park_prefixes): the KV image of a sequence's first
 * n_tokens (kv_image_prefix), or, when the park failed, why (a copy of it then fails with that). */
typedef struct prefix_entry {
    uint64_t id;
    uint8_t *img;
    size_t len, n_tokens;
    char why[sizeof(((strata_error *)0)->msg)];
} prefix_entry;

/* The table that precedes the rows of a HIDDEN frame: which sequences the sender ran. */
#define TABLE_HEAD_BYTES 8u    /* u32 n_items, u32 zero */
#define TABLE_ENTRY_BYTES 16u  /* u64 seq_id, u32 n_tokens, u32 zero */

struct stage {
    model *m;
    const model_config *cfg;
    bool first, last;
    size_t max_seq_tokens;
    uint32_t layer_begin;
    kv_geometry geo;           /* this stage's layers */
    /* The plans a sequence may use, this stage's layers only: [0] the assignment's kv_plan, then
     * its kv_plans; as parsed and in canonical form (a request's is compared by its form). */
    kv_codec_params **plans;
    char **plan_names;
    int n_plans;
    kv_pool *pool;
    kv_tiers *tiers;
    stage_gpu *gpu;            /* a GPU stage: its compute and KV (pool and tiers stay NULL) */
    stage_gpu_item *gpu_items;
    size_t cap_gpu_items;
    cuda_sample_row *gpu_sample;   /* last GPU stage: each item's sampling row, and its pick */
    int32_t *gpu_next;
    size_t cap_gpu_sample, cap_gpu_next;
    seq_entry *seqs;
    size_t n_seqs, cap_seqs;
    prefix_entry *prefixes;
    size_t n_prefixes, cap_prefixes, prefix_bytes;
    dp_link *prev, *next;
    dp_link *rows_prev, *rows_next;   /* GPU stages: NCCL links for the rows (device memory), or NULL */
    int link_timeout_ms;
    /* per-step scratch, grown on demand */
    stage_seq_result *res;
    size_t n_res, cap_res;
    model_batch_item *items;
    size_t *plan_index;        /* items[i] runs plan->seqs[plan_index[i]] */
    bool *ok;
    int32_t *tokens;
    size_t cap_items, cap_index, cap_ok, cap_tokens;
    float *hidden_in, *hidden_out, *logits;
    size_t cap_in, cap_out, cap_logits;
    uint8_t *frame;
    size_t cap_frame;
};

static int grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return STRATA_OK;
    size_t n = need < 16 ? 16 : need * 2;
    void *q = realloc(*p, n * elem);
    if (!q)
        return STRATA_ENOMEM;
    *p = q;
    *cap = n;
    return STRATA_OK;
}

#define STAGE_MAX_PLANS 64   /* the assignment's plan and up to 63 others a request may choose */

/* A plan for the whole model (spec) cut to this stage's layers, each validated; *names its
 * canonical form (malloc'd). */
static int stage_plan_slice(const stage *s, const char *spec, const kv_geometry *geo, kv_codec_params **out,
                            char **name, strata_error *err)
{
    const int L = s->cfg->n_layers;
    kv_codec_params *all = malloc((size_t)L * sizeof *all);
    *out = malloc((size_t)geo->n_layers * sizeof **out);
    *name = NULL;
    int rc = !all || !*out ? strata_fail(err, STRATA_ENOMEM, "stage: out of memory") : kv_plan_parse(spec, L, all, err);
    if (rc == STRATA_OK)
        memcpy(*out, all + s->layer_begin, (size_t)geo->n_layers * sizeof **out);
    for (int l = 0; rc == STRATA_OK && l < geo->n_layers; l++)
        if ((rc = kv_codec_validate(&(*out)[l], geo, err)) != STRATA_OK)
            strata_error_prefix(err, "layer %u", s->layer_begin + (unsigned)l);
    if (rc == STRATA_OK && !(*name = kv_plan_name(*out, geo->n_layers)))
        rc = strata_fail(err, STRATA_ENOMEM, "stage: out of memory");
    free(all);
    if (rc != STRATA_OK) {
        free(*out);
        free(*name);
        *out = NULL;
        *name = NULL;
    }
    return rc;
}

/* The assignment's plans: kv_plan (empty: kivi4), then kv_plans, cut to this stage's layers. */
static int stage_plans(stage *s, const Strata__Internal__V1__Assignment *a, const kv_geometry *geo, strata_error *err)
{
    const size_t n = 1 + a->n_kv_plans;
    if (n > STAGE_MAX_PLANS)
        return strata_fail(err, STRATA_EINVAL, "stage: %zu KV plans assigned; at most %d", n, STAGE_MAX_PLANS);
    s->plans = calloc(n, sizeof *s->plans);
    s->plan_names = calloc(n, sizeof *s->plan_names);
    if (!s->plans || !s->plan_names)
        return strata_fail(err, STRATA_ENOMEM, "stage: out of memory");
    for (size_t i = 0; i < n; i++) {
        const char *spec = i == 0 ? (a->kv_plan && *a->kv_plan ? a->kv_plan : "kivi4") : a->kv_plans[i - 1];
        int rc = stage_plan_slice(s, spec, geo, &s->plans[i], &s->plan_names[i], err);
        if (rc != STRATA_OK)
            return strata_error_prefix(err, "stage: KV plan '%s'", spec);
        s->n_plans++;
    }
    return STRATA_OK;
}

/* Which of the stage's plans a sequence's plan (the whole model's spec) is; -1 with err set
 * (STRATA_EUNSUPPORTED) when it is none of them. */
static int stage_plan_index(const stage *s, const char *spec, strata_error *err)
{
    kv_codec_params *plan = NULL;
    char *name = NULL;
    int found = -1;
    if (stage_plan_slice(s, spec, &s->geo, &plan, &name, err) != STRATA_OK) {
        strata_error_prefix(err, "KV plan '%s'", spec);
        return -1;
    }
    for (int i = 0; i < s->n_plans && found < 0; i++)
        if (strcmp(name, s->plan_names[i]) == 0)
            found = i;
    if (found < 0)
        strata_fail(err, STRATA_EUNSUPPORTED, "KV plan '%s' (here '%s') is not one this worker was assigned: its own "
                    "'%s' and %d other(s)", spec, name, s->plan_names[0], s->n_plans - 1);
    free(plan);
    free(name);
    return found;
}

/* True when a sequence's plan (this stage's layers) is one of the stage's. */
static bool stage_plan_known(const stage *s, const kv_seq *kv)
{
    kv_codec_params *plan = malloc((size_t)s->geo.n_layers * sizeof *plan);
    char *name = NULL;
    bool known = false;
    if (plan) {
        for (int l = 0; l < s->geo.n_layers; l++)
            plan[l] = *kv_seq_codec(kv, l);
        name = kv_plan_name(plan, s->geo.n_layers);
    }
    if (name) {
        for (int i = 0; i < s->n_plans && !known; i++)
            known = strcmp(name, s->plan_names[i]) == 0;
    }
    free(plan);
    free(name);
    return known;
}

static size_t add_sat(size_t a, size_t b) { return a > SIZE_MAX - b ? SIZE_MAX : a + b; }

/* A CPU stage's memory at its largest step (the weights, the KV budgets, the activations of
 * max_batch_tokens rows and the stage's own row buffers) within what the machine lets the
 * process have: refused here, naming the flag, instead of an allocation failing (or the OOM
 * killer) at the first step that large. */
static int check_step_memory(const stage *s, const Strata__Internal__V1__Assignment *a, strata_error *err)
{
    const size_t rows = a->max_batch_tokens, e = (size_t)s->cfg->n_embd, vocab = (size_t)s->cfg->n_vocab;
    const size_t act = model_step_bytes(s->m, rows);
    size_t buffers = rows > SIZE_MAX / (sizeof(int32_t) + 2 * e * sizeof(float))
                         ? SIZE_MAX
                         : rows * (sizeof(int32_t) + 2 * e * sizeof(float));   /* tokens, rows in and out */
    if (s->last)
        buffers = add_sat(buffers, a->max_batch_seqs > SIZE_MAX / (vocab * sizeof(float))
                                       ? SIZE_MAX
                                       : (size_t)a->max_batch_seqs * vocab * sizeof(float));
    const size_t weights = model_weight_bytes(s->m);
    const size_t kv = add_sat(kv_pool_bytes(s->pool), a->host_kv_bytes > SIZE_MAX ? SIZE_MAX : (size_t)a->host_kv_bytes);
    char what[320];
    snprintf(what, sizeof what, "stage: a step of up to %u tokens (--max-batch-tokens) takes %.1f MiB of activations "
             "and row buffers; with the weights (%.1f MiB) and the KV budgets (%.1f MiB) that",
             a->max_batch_tokens, (double)add_sat(act, buffers) / 1048576.0, (double)weights / 1048576.0,
             (double)kv / 1048576.0);
    return strata_check_memory(what, add_sat(add_sat(act, buffers), add_sat(weights, kv)), err);
}

stage *stage_create(const Strata__Internal__V1__Assignment *a, model *m, const stage_options *o, dp_link *prev,
                    dp_link *next, strata_error *err)
{
    if (!a || !m) {
        strata_fail(err, STRATA_EINVAL, "stage: NULL assignment or model");
        return NULL;
    }
    const model_config *cfg = model_get_config(m);
    if ((int)a->layer_begin != model_layer_begin(m) || (int)a->layer_end != model_layer_end(m) ||
        (int)a->n_layers_total != cfg->n_layers) {
        strata_fail(err, STRATA_EINVAL, "stage: the assignment's layers [%u, %u) of %u do not match the model's [%d, %d) of %d",
                    a->layer_begin, a->layer_end, a->n_layers_total, model_layer_begin(m), model_layer_end(m),
                    cfg->n_layers);
        return NULL;
    }
    bool first = a->layer_begin == 0, last = (int)a->layer_end == cfg->n_layers;
    if (o && (o->rows_prev || o->rows_next) && !o->cuda) {
        strata_fail(err, STRATA_EINVAL, "stage: rows on NCCL links need a GPU stage");
        return NULL;
    }
    if ((!first && !prev) || (!last && !next)) {
        strata_fail(err, STRATA_EINVAL, "stage %u of %u: missing data-plane link to the %s stage", a->stage, a->n_stages,
                    !first && !prev ? "previous" : "next");
        return NULL;
    }
    if (a->block_tokens == 0 || a->max_seq_tokens == 0 || a->max_batch_seqs == 0) {
        strata_fail(err, STRATA_EINVAL, "stage: block_tokens, max_seq_tokens and max_batch_seqs must be set");
        return NULL;
    }
    stage *s = calloc(1, sizeof *s);
    if (!s) {
        strata_fail(err, STRATA_ENOMEM, "stage: out of memory");
        return NULL;
    }
    s->m = m;
    s->cfg = cfg;
    s->first = first;
    s->last = last;
    s->prev = prev;
    s->next = next;
    s->rows_prev = o ? o->rows_prev : NULL;
    s->rows_next = o ? o->rows_next : NULL;
    s->max_seq_tokens = a->max_seq_tokens;
    s->link_timeout_ms = o && o->link_timeout_ms ? o->link_timeout_ms : 120000;

    kv_geometry geo = model_stage_kv_geometry(m, (int)a->block_tokens);
    s->layer_begin = a->layer_begin;
    s->geo = geo;
    int rc = stage_plans(s, a, &geo, err);
    const size_t per_seq_blocks = (a->max_seq_tokens + a->block_tokens - 1) / a->block_tokens;
    if (rc == STRATA_OK && model_is_for_device(m) != (o && o->cuda))
        rc = strata_fail(err, STRATA_EINVAL, "stage: a %s stage needs a model loaded %s", o && o->cuda ? "GPU" : "CPU",
                         o && o->cuda ? "by model_load_for_device" : "by model_load");
    if (rc == STRATA_OK && o && o->cuda) {
        for (int i = 0; rc == STRATA_OK && i < s->n_plans; i++)   /* before any device */
            if ((rc = kv_plan_check_one_window(s->plans[i], geo.n_layers, err)) != STRATA_OK)
                strata_error_prefix(err, "stage: the plan '%s'",
                                    i > 0 ? a->kv_plans[i - 1] : a->kv_plan && *a->kv_plan ? a->kv_plan : "kivi4");
        kv_tiers_options to = {.host_bytes = (size_t)a->host_kv_bytes,
                               .nvme_dir = o->nvme_dir && a->nvme_kv_bytes ? o->nvme_dir : NULL,
                               .nvme_bytes = a->nvme_kv_bytes};
        const stage_gpu_config gc = {.device = o->cuda_device, .plans = (const kv_codec_params *const *)s->plans,
                                     .n_plans = s->n_plans, .block_tokens = (int)a->block_tokens,
                                     .max_seq_tokens = a->max_seq_tokens, .max_batch_seqs = a->max_batch_seqs,
                                     .max_batch_tokens = a->max_batch_tokens,
                                     .device_kv_bytes = a->device_kv_bytes,
                                     .tiers = a->host_kv_bytes > 0 ? &to : NULL};
        if (rc == STRATA_OK)
            rc = stage_gpu_create(m, &gc, &s->gpu, err);
    } else if (rc == STRATA_OK && a->host_kv_bytes > 0) {
        kv_tiers_options to = {.host_bytes = (size_t)a->host_kv_bytes,
                               .nvme_dir = o && o->nvme_dir && a->nvme_kv_bytes ? o->nvme_dir : NULL,
                               .nvme_bytes = a->nvme_kv_bytes};
        size_t slot = kv_plans_largest_block(&geo, (const kv_codec_params *const *)s->plans, s->n_plans);
        size_t n_slots = a->device_kv_bytes ? (size_t)a->device_kv_bytes / slot
                                            : per_seq_blocks * a->max_batch_seqs * (size_t)geo.n_layers;
        if (n_slots == 0)
            rc = strata_fail(err, STRATA_EINVAL, "stage: a device KV budget of %" PRIu64 " bytes holds no block of %zu",
                             a->device_kv_bytes, slot);
        if (rc == STRATA_OK && !(s->tiers = kv_tiers_create(&to, err)))
            rc = err ? err->code : STRATA_EIO;
        if (rc == STRATA_OK && !(s->pool = kv_pool_create_plans(&geo, (const kv_codec_params *const *)s->plans,
                                                                 s->n_plans, n_slots, true, err)))
            rc = err ? err->code : STRATA_ENOMEM;
        if (rc == STRATA_OK) {
            kv_lower_tier lower = kv_tiers_lower(s->tiers);
            rc = kv_pool_set_lower_tier(s->pool, &lower, err);
        }
    } else if (rc == STRATA_OK) {
        size_t row = kv_plans_row_bytes(&geo, (const kv_codec_params *const *)s->plans, s->n_plans);
        size_t per_layer = a->device_kv_bytes ? (size_t)a->device_kv_bytes / row : per_seq_blocks * a->max_batch_seqs;
        if (per_layer == 0)
            rc = strata_fail(err, STRATA_EINVAL, "stage: a device KV budget of %" PRIu64 " bytes holds less than one "
                             "block per layer (%zu bytes)", a->device_kv_bytes, row);
        else if (!(s->pool = kv_pool_create_plans(&geo, (const kv_codec_params *const *)s->plans, s->n_plans,
                                                   per_layer, false, err)))
            rc = err ? err->code : STRATA_ENOMEM;
    }
    if (rc == STRATA_OK && !s->gpu && a->max_batch_tokens)
        rc = check_step_memory(s, a, err);
    if (rc != STRATA_OK) {
        stage_destroy(s);
        return NULL;
    }
    return s;
}

static void entry_free(seq_entry *e)
{
    kv_seq_destroy(e->kv);
    stage_gpu_seq_free(e->gpu);
    sampler_free(e->smp);
}

/* The sequence's sampler, made from its first sampling work; NULL after recording why not. */
static sampler *entry_sampler(stage *s, seq_entry *e, const Strata__Internal__V1__SeqWork *w);

/* The entry's sequence length, and whether it is preempted, on either kind of stage. */
static size_t entry_length(const seq_entry *e)
{
    return e->gpu ? stage_gpu_seq_length(e->gpu) : kv_seq_length(e->kv, 0);
}
static bool entry_preempted(const seq_entry *e) { return e->gpu ? e->waiting : kv_seq_is_spilled(e->kv); }

void stage_destroy(stage *s)
{
    if (!s)
        return;
    for (size_t i = 0; i < s->n_seqs; i++)
        entry_free(&s->seqs[i]);
    free(s->seqs);
    for (size_t i = 0; i < s->n_prefixes; i++)
        free(s->prefixes[i].img);
    free(s->prefixes);
    kv_pool_destroy(s->pool);
    kv_tiers_destroy(s->tiers);
    for (int i = 0; i < s->n_plans; i++) {
        free(s->plans[i]);
        free(s->plan_names[i]);
    }
    free(s->plans);
    free(s->plan_names);
    stage_gpu_destroy(s->gpu);
    free(s->gpu_items);
    free(s->gpu_sample);
    free(s->gpu_next);
    free(s->res);
    free(s->items);
    free(s->plan_index);
    free(s->ok);
    free(s->tokens);
    free(s->hidden_in);
    free(s->hidden_out);
    free(s->logits);
    free(s->frame);
    free(s);
}

static seq_entry *find(stage *s, uint64_t id)
{
    for (size_t i = 0; i < s->n_seqs; i++)
        if (s->seqs[i].id == id)
            return &s->seqs[i];
    return NULL;
}

static void drop(stage *s, uint64_t id)
{
    seq_entry *e = find(s, id);
    if (!e)
        return;
    entry_free(e);
    *e = s->seqs[--s->n_seqs];
}

static stage_seq_result *result(stage *s, uint64_t id)
{
    for (size_t i = 0; i < s->n_res; i++)
        if (s->res[i].seq_id == id)
            return &s->res[i];
    if (grow((void **)&s->res, &s->cap_res, s->n_res + 1, sizeof *s->res) != STRATA_OK)
        return NULL;
    stage_seq_result *r = &s->res[s->n_res++];
    memset(r, 0, sizeof *r);
    r->seq_id = id;
    return r;
}

static bool failed(stage *s, uint64_t id);
static int fail_seq(stage *s, uint64_t id, int status, const char *msg);

static sampler *entry_sampler(stage *s, seq_entry *e, const Strata__Internal__V1__SeqWork *w)
{
    if (!e->smp) {
        strata_error e1 = {0};
        /* top_k is unsigned on the wire; at or above the vocabulary it keeps every token, as 0 does */
        const int top_k = w->top_k >= (uint32_t)s->cfg->n_vocab ? 0 : (int)w->top_k;
        sampler_params sp = {.temperature = w->temperature, .top_k = top_k,
                             .top_p = w->top_p > 0.0f ? w->top_p : 1.0f, .seed = w->seed};
        if (sampler_params_validate(&sp, &e1) != STRATA_OK || !(e->smp = sampler_create(&sp, s->cfg->n_vocab, &e1)))
            fail_seq(s, w->seq_id, e1.code, e1.msg);
        else
            sampler_skip_sampled(e->smp, w->sampled_before);
    }
    return e->smp;
}

static bool failed(stage *s, uint64_t id)
{
    for (size_t i = 0; i < s->n_res; i++)
        if (s->res[i].seq_id == id && s->res[i].status != STRATA_OK)
            return true;
    return false;
}

/* Records a sequence's failure on this stage (the first reason wins). */
static int fail_seq(stage *s, uint64_t id, int status, const char *msg)
{
    stage_seq_result *r = result(s, id);
    if (!r)
        return STRATA_ENOMEM;
    if (r->status == STRATA_OK) {
        r->status = status ? status : STRATA_EINVAL;
        snprintf(r->message, sizeof r->message, "%s", msg);
    }
    return STRATA_OK;
}

/* Sends this stage's table (a CONTROL frame) and rows (a HIDDEN frame, when there are any) to
 * the next stage. */
static int send_rows(stage *s, const Strata__Internal__V1__StepPlan *plan, size_t n_run, size_t rows,
                     strata_error *err)
{
    const size_t e = (size_t)s->cfg->n_embd;
    size_t len = TABLE_HEAD_BYTES + n_run * TABLE_ENTRY_BYTES;
    if (grow((void **)&s->frame, &s->cap_frame, len, 1) != STRATA_OK)
        return strata_fail(err, STRATA_ENOMEM, "stage: out of memory for a %zu-byte table", len);
    memset(s->frame, 0, len);
    kv_st32(s->frame, (uint32_t)n_run);
    for (size_t i = 0; i < n_run; i++) {
        uint8_t *t = s->frame + TABLE_HEAD_BYTES + i * TABLE_ENTRY_BYTES;
        const Strata__Internal__V1__SeqWork *w = plan->seqs[s->plan_index[i]];
        kv_st64(t, w->seq_id);
        kv_st32(t + 8, (uint32_t)w->n_tokens);
    }
    const uint64_t step = plan->step;
    dp_msg_header h = {.kind = DP_MSG_CONTROL, .dtype = DP_DTYPE_BYTES, .step = step};
    int rc = dp_send(s->next, &h, s->frame, len, err);
    if (rc == STRATA_OK && rows) {
        /* fp32 rows in the machine's byte order (little-endian on the supported hosts); on an NCCL
         * link from the GPU stage's device buffer */
        dp_msg_header hh = {.kind = DP_MSG_HIDDEN, .dtype = DP_DTYPE_F32, .step = step, .n_rows = (uint32_t)rows,
                            .row_bytes = (uint32_t)(e * sizeof(float))};
        const float *out = s->rows_next ? stage_gpu_device_rows(s->gpu, 1, rows, err) : s->hidden_out;
        rc = out ? dp_send(s->rows_next ? s->rows_next : s->next, &hh, out, rows * e * sizeof(float), err)
                 : (err ? err->code : STRATA_EIO);
    }
    return rc == STRATA_OK ? rc : strata_error_prefix(err, "stage: sending step %" PRIu64 " to the next stage", step);
}

/* Receives the previous stage's table (into s->frame, *n_table entries) and its rows (into
 * s->hidden_in, *rows of them) for this step. */
static int recv_rows(stage *s, uint64_t step, size_t *n_table, size_t *rows, strata_error *err)
{
    dp_msg_header h;
    int rc = dp_recv_header(s->prev, &h, s->link_timeout_ms, err);
    if (rc != STRATA_OK)
        return strata_error_prefix(err, "stage: waiting for step %" PRIu64 " from the previous stage", step);
    if (h.kind != DP_MSG_CONTROL || h.step != step || h.payload_len < TABLE_HEAD_BYTES)
        return strata_fail(err, STRATA_EFORMAT, "stage: expected the table of step %" PRIu64 ", got a %s frame of step %" PRIu64,
                           step, dp_kind_name(h.kind), h.step);
    if (grow((void **)&s->frame, &s->cap_frame, h.payload_len, 1) != STRATA_OK)
        return strata_fail(err, STRATA_ENOMEM, "stage: out of memory for a %" PRIu64 "-byte table", h.payload_len);
    if ((rc = dp_recv_payload(s->prev, s->frame, s->cap_frame, err)) != STRATA_OK)
        return rc;
    size_t n = kv_ld32(s->frame);
    if (h.payload_len != TABLE_HEAD_BYTES + (uint64_t)n * TABLE_ENTRY_BYTES)
        return strata_fail(err, STRATA_EFORMAT, "stage: malformed table for step %" PRIu64, step);
    size_t total = 0;
    for (size_t i = 0; i < n; i++)
        total += kv_ld32(s->frame + TABLE_HEAD_BYTES + i * TABLE_ENTRY_BYTES + 8);
    *n_table = n;
    *rows = total;
    if (total == 0)
        return STRATA_OK;
    const size_t e = (size_t)s->cfg->n_embd;
    /* The rows: into host memory from the TCP link, or into the GPU stage's device buffer from
     * the NCCL link beside it. */
    dp_link *from = s->rows_prev ? s->rows_prev : s->prev;
    float *into = NULL;
    size_t cap = 0;
    if (s->rows_prev) {
        if (!(into = stage_gpu_device_rows(s->gpu, 0, total, err)))
            return err ? err->code : STRATA_EIO;
        cap = total * e * sizeof(float);
    } else {
        if (grow((void **)&s->hidden_in, &s->cap_in, total * e, sizeof(float)) != STRATA_OK)
            return strata_fail(err, STRATA_ENOMEM, "stage: out of memory for %zu rows", total);
        into = s->hidden_in;
        cap = s->cap_in * sizeof(float);
    }
    if ((rc = dp_recv_header(from, &h, s->link_timeout_ms, err)) != STRATA_OK)
        return strata_error_prefix(err, "stage: waiting for the rows of step %" PRIu64, step);
    if (h.kind != DP_MSG_HIDDEN || h.step != step || h.n_rows != total || h.row_bytes != e * sizeof(float))
        return strata_fail(err, STRATA_EFORMAT, "stage: expected %zu rows of step %" PRIu64 ", got a %s frame of %u rows "
                           "(step %" PRIu64 ")", total, step, dp_kind_name(h.kind), h.n_rows, h.step);
    return dp_recv_payload(from, into, cap, err);
}

static int plan_position(const Strata__Internal__V1__StepPlan *plan, uint64_t id, size_t *at)
{
    for (size_t i = 0; i < plan->n_seqs; i++)
        if (plan->seqs[i]->seq_id == id) {
            *at = i;
            return 1;
        }
    return 0;
}

/* ---- prefix entries ---- */

static prefix_entry *find_prefix(stage *s, uint64_t id)
{
    for (size_t i = 0; i < s->n_prefixes; i++)
        if (s->prefixes[i].id == id)
            return &s->prefixes[i];
    return NULL;
}

static void drop_prefix(stage *s, uint64_t id)
{
    prefix_entry *p = find_prefix(s, id);
    if (!p)
        return;
    s->prefix_bytes -= p->len;
    free(p->img);
    *p = s->prefixes[--s->n_prefixes];
}

/* Keeps the first n_tokens of a sequence as a prefix entry. A park that cannot be made (the
 * sequence is not here, is preempted, holds fewer blocks, its export fails) leaves an entry
 * that says why, so that a request started from it fails with the reason; STRATA_ENOMEM only
 * when not even that can be recorded. */
static int park_prefix(stage *s, const Strata__Internal__V1__PrefixPark *pk)
{
    drop_prefix(s, pk->seq_id);   /* the coordinator never reuses an id; a repeat replaces */
    if (grow((void **)&s->prefixes, &s->cap_prefixes, s->n_prefixes + 1, sizeof *s->prefixes) != STRATA_OK)
        return STRATA_ENOMEM;
    prefix_entry *p = &s->prefixes[s->n_prefixes++];
    *p = (prefix_entry){.id = pk->seq_id, .n_tokens = pk->n_tokens};
    strata_error e1 = {0};
    seq_entry *e = find(s, pk->seq_id);
    uint8_t *whole = NULL;
    size_t whole_len = 0;
    int rc = !e                  ? strata_fail(&e1, STRATA_EINVAL, "the sequence is not on this stage")
             : entry_preempted(e) ? strata_fail(&e1, STRATA_EINVAL, "the sequence was preempted")
             : e->gpu            ? stage_gpu_seq_export(s->gpu, e->gpu, &whole, &whole_len, &e1)
                                 : kv_seq_export(e->kv, &whole, &whole_len, &e1);
    if (rc == STRATA_OK)
        rc = kv_image_prefix(&s->geo, whole, whole_len, pk->n_tokens, &p->img, &p->len, &e1);
    free(whole);
    if (rc != STRATA_OK) {
        snprintf(p->why, sizeof p->why, "%s", e1.msg);
        p->img = NULL;
        p->len = 0;
    }
    s->prefix_bytes += p->len;
    return STRATA_OK;
}

/* Adds sequence id from a KV sequence image (a migration's or a prefix entry's), with its
 * sampler (owned from here on; NULL: made at its first sampling work). */
static int add_imported(stage *s, uint64_t id, const uint8_t *img, size_t len, sampler *smp, strata_error *err)
{
    if (grow((void **)&s->seqs, &s->cap_seqs, s->n_seqs + 1, sizeof *s->seqs) != STRATA_OK) {
        sampler_free(smp);
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    }
    kv_seq *kv = NULL;
    stage_gpu_seq *gq = NULL;
    if (s->gpu)
        gq = stage_gpu_seq_import(s->gpu, img, len, err);
    else if ((kv = kv_seq_import(s->pool, s->max_seq_tokens, img, len, err)) && !stage_plan_known(s, kv)) {
        kv_seq_destroy(kv);
        kv = NULL;
        strata_fail(err, STRATA_EUNSUPPORTED, "the sequence's KV plan is not one this worker was assigned");
    }
    if (!kv && !gq) {
        sampler_free(smp);
        return err && err->code ? err->code : STRATA_EFORMAT;
    }
    if (kv)
        kv_seq_set_id(kv, id);
    s->seqs[s->n_seqs++] = (seq_entry){.id = id, .kv = kv, .gpu = gq, .smp = smp};
    return STRATA_OK;
}

/* A new sequence as a copy of the first n_tokens tokens of prefix entry `entry`
 * (SeqWork.prefix_entry and pos0: a request may share only the entry's first blocks with it);
 * NULL with e1 set. */
/* On failure *entry_fault tells whether the entry was at fault (absent, too short, damaged) or
 * this stage (no room or memory for the copy): SeqResult.prefix_failed. */
static seq_entry *start_from_prefix(stage *s, uint64_t id, uint64_t entry, size_t n_tokens, bool *entry_fault,
                                    strata_error *e1)
{
    const prefix_entry *p = find_prefix(s, entry);
    *entry_fault = true;
    if (!p || !p->img) {
        strata_fail(e1, STRATA_EINVAL, "prefix entry %" PRIu64 " is not on this stage%s%s", entry, p ? ": " : "",
                    p ? p->why : "");
        return NULL;
    }
    if (n_tokens > p->n_tokens) {
        strata_fail(e1, STRATA_EINVAL, "prefix entry %" PRIu64 " holds %zu tokens; the plan takes %zu", entry,
                    (size_t)p->n_tokens, n_tokens);
        return NULL;
    }
    uint8_t *cut = NULL;
    size_t cut_len = 0;
    if (n_tokens < p->n_tokens && kv_image_prefix(&s->geo, p->img, p->len, n_tokens, &cut, &cut_len, e1) != STRATA_OK) {
        strata_error_prefix(e1, "starting from the first %zu tokens of prefix entry %" PRIu64, n_tokens, entry);
        return NULL;
    }
    const int rc = cut ? add_imported(s, id, cut, cut_len, NULL, e1) : add_imported(s, id, p->img, p->len, NULL, e1);
    free(cut);
    if (rc != STRATA_OK) {
        *entry_fault = rc != STRATA_EFULL && rc != STRATA_ENOMEM;
        strata_error_prefix(e1, "starting from prefix entry %" PRIu64, entry);
        return NULL;
    }
    return &s->seqs[s->n_seqs - 1];
}

/* The checks a step makes before its first layer, on either kind of stage. */
static int check_batch(stage *s, size_t n_run, size_t *bad, strata_error *e)
{
    if (s->gpu)
        return stage_gpu_batch_check(s->gpu, s->gpu_items, n_run, bad, e);
    return model_batch_check(s->m, s->items, n_run, s->first ? NULL : s->hidden_in, s->last ? NULL : s->hidden_out,
                             bad, e);
}

/* Items the forward pass would refuse before its first layer (one sequence's room check: the KV
 * tiers too full for its chunk, a layer of it larger than the device budget or pool) fail alone,
 * with nothing of theirs changed, and the rest of the batch runs: else one long prompt chunk
 * would fail every decoding sequence beside it. A fault that is no item's falls through to the
 * forward pass, which fails the batch. Returns the items left; *rows and the entering rows (host
 * memory, or the device's when they came by NCCL) follow. */
static int drop_unfit_items(stage *s, const Strata__Internal__V1__StepPlan *plan, size_t *n_run, size_t *rows,
                            strata_error *err)
{
    const size_t emb = (size_t)s->cfg->n_embd;
    strata_error e = {0};
    size_t bad;
    while (*n_run && check_batch(s, *n_run, &bad, &e) != STRATA_OK && bad < *n_run) {
        const uint64_t id = plan->seqs[s->plan_index[bad]]->seq_id;
        if (s->gpu)   /* the device pool does not know the stage's names for its sequences */
            strata_error_prefix(&e, "sequence %" PRIu64, id);
        fail_seq(s, id, e.code, e.msg);
        size_t row0 = 0;
        for (size_t k = 0; k < bad; k++)
            row0 += s->items[k].n_tokens;
        const size_t n_tok = s->items[bad].n_tokens, after = *rows - row0 - n_tok;
        if (!s->first && s->rows_prev) {
            const int rc = after ? stage_gpu_compact_rows(s->gpu, row0, row0 + n_tok, after, err) : STRATA_OK;
            if (rc != STRATA_OK)
                return rc;
        } else if (!s->first) {
            memmove(s->hidden_in + row0 * emb, s->hidden_in + (row0 + n_tok) * emb, after * emb * sizeof(float));
        }
        const size_t tail = *n_run - bad - 1;
        memmove(&s->items[bad], &s->items[bad + 1], tail * sizeof *s->items);
        memmove(&s->plan_index[bad], &s->plan_index[bad + 1], tail * sizeof *s->plan_index);
        if (s->gpu)
            memmove(&s->gpu_items[bad], &s->gpu_items[bad + 1], tail * sizeof *s->gpu_items);
        *rows -= n_tok;
        (*n_run)--;
    }
    return STRATA_OK;
}

int stage_step(stage *s, const Strata__Internal__V1__StepPlan *plan, stage_result *out, strata_error *err)
{
    memset(out, 0, sizeof *out);
    if (!s || !plan)
        return strata_fail(err, STRATA_EINVAL, "stage: NULL step");
    s->n_res = 0;
    out->step = plan->step;
    strata_error e1 = {0};
    for (size_t i = 0; i < plan->n_park_prefixes; i++)
        if (park_prefix(s, plan->park_prefixes[i]) != STRATA_OK)
            return strata_fail(err, STRATA_ENOMEM, "stage: out of memory");
    for (size_t i = 0; i < plan->n_drop_prefixes; i++)
        drop_prefix(s, plan->drop_prefixes[i]);
    for (size_t i = 0; i < plan->n_free_seqs; i++)
        drop(s, plan->free_seqs[i]);
    for (size_t i = 0; i < plan->n_preempt_seqs; i++) {
        seq_entry *e = find(s, plan->preempt_seqs[i]);
        if (e && e->gpu) {
            stage_gpu_seq_set_waiting(e->gpu, true);
            e->waiting = true;
        } else if (e && kv_seq_spill(e->kv, &e1) != STRATA_OK && fail_seq(s, e->id, e1.code, e1.msg) != STRATA_OK) {
            return strata_fail(err, STRATA_ENOMEM, "stage: out of memory");
        }
    }
    for (size_t i = 0; i < plan->n_resume_seqs; i++) {
        seq_entry *e = find(s, plan->resume_seqs[i]);
        if (e && e->gpu) {
            stage_gpu_seq_set_waiting(e->gpu, false);
            e->waiting = false;
        } else if (e && kv_seq_resume(e->kv, &e1) != STRATA_OK && fail_seq(s, e->id, e1.code, e1.msg) != STRATA_OK) {
            return strata_fail(err, STRATA_ENOMEM, "stage: out of memory");
        }
    }
    const size_t n_plan = plan->n_seqs;
    if (n_plan == 0)
        goto done;
    size_t plan_tokens = 0;
    for (size_t i = 0; i < n_plan; i++)
        plan_tokens += plan->seqs[i]->n_tokens;
    if (grow((void **)&s->items, &s->cap_items, n_plan, sizeof *s->items) != STRATA_OK ||
        grow((void **)&s->plan_index, &s->cap_index, n_plan, sizeof *s->plan_index) != STRATA_OK ||
        grow((void **)&s->ok, &s->cap_ok, n_plan, sizeof *s->ok) != STRATA_OK ||
        grow((void **)&s->tokens, &s->cap_tokens, plan_tokens, sizeof *s->tokens) != STRATA_OK)
        return strata_fail(err, STRATA_ENOMEM, "stage: out of memory");
    memset(s->ok, 0, n_plan * sizeof *s->ok);

    /* Which of the plan's sequences can run here. */
    for (size_t i = 0; i < n_plan; i++) {
        const Strata__Internal__V1__SeqWork *w = plan->seqs[i];
        char msg[200];
        size_t first;
        if (failed(s, w->seq_id))
            continue;
        if (plan_position(plan, w->seq_id, &first) && first != i) {   /* one batch item per sequence */
            snprintf(msg, sizeof msg, "sequence %" PRIu64 " is listed twice in step %" PRIu64, w->seq_id, plan->step);
            fail_seq(s, w->seq_id, STRATA_EINVAL, msg);
            continue;
        }
        seq_entry *e = find(s, w->seq_id);
        if (!e && w->pos0 == 0 && w->n_tokens > 0) {
            const int kv_plan = w->kv_plan && *w->kv_plan ? stage_plan_index(s, w->kv_plan, &e1) : 0;
            if (kv_plan < 0) {
                fail_seq(s, w->seq_id, e1.code, e1.msg);
                continue;
            }
            kv_seq *kv = s->gpu ? NULL : kv_seq_create_plan(s->pool, s->plans[kv_plan], s->max_seq_tokens, &e1);
            stage_gpu_seq *gq = s->gpu ? stage_gpu_seq_create(s->gpu, kv_plan, &e1) : NULL;
            const bool made = kv || gq;
            if (!made || grow((void **)&s->seqs, &s->cap_seqs, s->n_seqs + 1, sizeof *s->seqs) != STRATA_OK) {
                kv_seq_destroy(kv);
                stage_gpu_seq_free(gq);
                fail_seq(s, w->seq_id, made ? STRATA_ENOMEM : e1.code, made ? "out of memory" : e1.msg);
                continue;
            }
            if (kv)
                kv_seq_set_id(kv, w->seq_id);
            s->seqs[s->n_seqs++] = (seq_entry){.id = w->seq_id, .kv = kv, .gpu = gq};
            e = &s->seqs[s->n_seqs - 1];
        }
        bool entry_fault = false;
        if (!e && w->pos0 > 0 && w->prefix_entry &&
            !(e = start_from_prefix(s, w->seq_id, w->prefix_entry, w->pos0, &entry_fault, &e1))) {
            fail_seq(s, w->seq_id, e1.code, e1.msg);   /* its first failure: failed ones were skipped above */
            stage_seq_result *r = entry_fault ? result(s, w->seq_id) : NULL;
            if (r)
                r->prefix_failed = true;
            continue;
        }
        if (!e) {
            snprintf(msg, sizeof msg, "sequence %" PRIu64 " is unknown to this stage (pos0 %u)", w->seq_id, w->pos0);
            fail_seq(s, w->seq_id, STRATA_EINVAL, msg);
        } else if (entry_preempted(e)) {
            snprintf(msg, sizeof msg, "sequence %" PRIu64 " is preempted; resume it first", w->seq_id);
            fail_seq(s, w->seq_id, STRATA_EINVAL, msg);
        } else if (w->sampled_before >= (uint64_t)w->pos0 + w->n_tokens) {   /* a bound on the sampler's skip too */
            snprintf(msg, sizeof msg, "sequence %" PRIu64 ": %" PRIu64 " tokens sampled before, not fewer than the %" PRIu64
                     " it has fed", w->seq_id, w->sampled_before, (uint64_t)w->pos0 + w->n_tokens);
            fail_seq(s, w->seq_id, STRATA_EINVAL, msg);
        } else if (w->n_tokens == 0 || entry_length(e) != w->pos0) {
            snprintf(msg, sizeof msg, "sequence %" PRIu64 " holds %zu tokens here; the plan says %u (+%zu)", w->seq_id,
                     entry_length(e), w->pos0, w->n_tokens);
            fail_seq(s, w->seq_id, STRATA_EINVAL, msg);
        } else {
            s->ok[i] = true;
        }
    }

    /* A sequence that failed on a later entry of the plan does not run on an earlier one. */
    for (size_t i = 0; i < n_plan; i++)
        s->ok[i] = s->ok[i] && !failed(s, plan->seqs[i]->seq_id);

    /* The sequences to run, in the order the rows arrive (stage 0: the plan's order). */
    size_t n_run = 0, rows = 0, in_rows = 0, n_table = 0;
    const size_t emb = (size_t)s->cfg->n_embd;
    int rc = STRATA_OK;
    if (!s->first) {
        if ((rc = recv_rows(s, plan->step, &n_table, &in_rows, err)) != STRATA_OK)
            return rc;
        /* Keep the rows of the sequences that can run here, in the table's order. */
        size_t src_row = 0;
        for (size_t t = 0; t < n_table; t++) {
            const uint8_t *ent = s->frame + TABLE_HEAD_BYTES + t * TABLE_ENTRY_BYTES;
            uint64_t id = kv_ld64(ent);
            size_t n_tok = kv_ld32(ent + 8), at;
            if (plan_position(plan, id, &at) && s->ok[at] && plan->seqs[at]->n_tokens == n_tok) {
                for (size_t k = 0; k < n_run; k++)   /* each plan entry runs once: n_run <= n_plan */
                    if (s->plan_index[k] == at)
                        return strata_fail(err, STRATA_EFORMAT,
                                           "stage: the previous stage's rows of step %" PRIu64
                                           " list sequence %" PRIu64 " twice",
                                           plan->step, id);
                if (rows != src_row && s->rows_prev) {
                    if ((rc = stage_gpu_compact_rows(s->gpu, rows, src_row, n_tok, err)) != STRATA_OK)
                        return rc;
                } else if (rows != src_row) {
                    memmove(s->hidden_in + rows * emb, s->hidden_in + src_row * emb, n_tok * emb * sizeof(float));
                }
                s->plan_index[n_run++] = at;
                rows += n_tok;
            }
            src_row += n_tok;
        }
    } else {
        for (size_t i = 0; i < n_plan; i++)
            if (s->ok[i]) {
                s->plan_index[n_run++] = i;
                rows += plan->seqs[i]->n_tokens;
            }
    }
    if (s->gpu && grow((void **)&s->gpu_items, &s->cap_gpu_items, n_plan, sizeof *s->gpu_items) != STRATA_OK)
        return strata_fail(err, STRATA_ENOMEM, "stage: out of memory");
    size_t tok_at = 0;
    for (size_t r = 0; r < n_run; r++) {
        const Strata__Internal__V1__SeqWork *w = plan->seqs[s->plan_index[r]];
        for (size_t k = 0; k < w->n_tokens; k++)
            s->tokens[tok_at + k] = (int32_t)w->tokens[k];
        const seq_entry *e = find(s, w->seq_id);
        s->items[r] = (model_batch_item){.seq = e->kv, .tokens = s->tokens + tok_at, .n_tokens = w->n_tokens,
                                         .pos0 = w->pos0};
        if (s->gpu)
            s->gpu_items[r] = (stage_gpu_item){.seq = e->gpu, .tokens = s->tokens + tok_at, .n_tokens = w->n_tokens};
        tok_at += w->n_tokens;
    }
    if (n_run && grow((void **)&s->hidden_out, &s->cap_out, rows * emb, sizeof(float)) != STRATA_OK)
        return strata_fail(err, STRATA_ENOMEM, "stage: out of memory for %zu rows", rows);
    if (n_run && (rc = drop_unfit_items(s, plan, &n_run, &rows, err)) != STRATA_OK)
        return rc;
    if (n_run) {
        if (s->last && grow((void **)&s->logits, &s->cap_logits, n_run * (size_t)s->cfg->n_vocab, sizeof(float)) != STRATA_OK)
            return strata_fail(err, STRATA_ENOMEM, "stage: out of memory for %zu rows", rows);
        if (s->gpu && s->last) {   /* the picks on the device: only the token ids come back */
            if (grow((void **)&s->gpu_sample, &s->cap_gpu_sample, n_run, sizeof *s->gpu_sample) != STRATA_OK ||
                grow((void **)&s->gpu_next, &s->cap_gpu_next, n_run, sizeof *s->gpu_next) != STRATA_OK)
                return strata_fail(err, STRATA_ENOMEM, "stage: out of memory");
            for (size_t r = 0; r < n_run; r++) {
                const Strata__Internal__V1__SeqWork *w = plan->seqs[s->plan_index[r]];
                sampler *smp = w->sample ? entry_sampler(s, find(s, w->seq_id), w) : NULL;
                const sampler_params *sp = smp ? sampler_get_params(smp) : NULL;
                s->gpu_sample[r] = sp ? (cuda_sample_row){.u = sampler_params_greedy(sp) ? 0.0 : sampler_next_draw(smp),
                                                          .temperature = sp->temperature, .top_p = sp->top_p,
                                                          .top_k = sp->top_k}
                                      : (cuda_sample_row){.u = 0.0, .temperature = 0.0f, .top_p = 1.0f, .top_k = 0};
            }
            const float *in = s->first ? NULL : s->rows_prev ? stage_gpu_device_rows(s->gpu, 0, rows, &e1) : s->hidden_in;
            rc = !s->first && !in ? e1.code
                                  : stage_gpu_forward_sample(s->gpu, s->gpu_items, n_run, in, s->rows_prev != NULL,
                                                             s->gpu_sample, s->gpu_next, &e1);
        } else if (s->gpu) {
            const float *in = s->first ? NULL : s->rows_prev ? stage_gpu_device_rows(s->gpu, 0, rows, &e1) : s->hidden_in;
            float *rows_out = s->last ? NULL : s->rows_next ? stage_gpu_device_rows(s->gpu, 1, rows, &e1) : s->hidden_out;
            rc = (!s->first && !in) || (!s->last && !rows_out)
                     ? e1.code
                     : stage_gpu_forward(s->gpu, s->gpu_items, n_run, in, s->rows_prev != NULL, rows_out,
                                         s->rows_next != NULL, s->last ? s->logits : NULL, &e1);
        } else {
            rc = model_forward_batch(s->m, s->items, n_run, s->first ? NULL : s->hidden_in,
                                     s->last ? NULL : s->hidden_out, s->last ? s->logits : NULL, &e1);
        }
        if (rc != STRATA_OK) {
            /* The batch's sequences may now hold uneven layers: they are lost on this stage. */
            for (size_t r = 0; r < n_run; r++) {
                uint64_t id = plan->seqs[s->plan_index[r]]->seq_id;
                fail_seq(s, id, rc, e1.msg);
                drop(s, id);
            }
            n_run = rows = 0;
            /* A device that lost its context fails every step from now on: the stage fails
             * instead, so the worker leaves (the coordinator ends its requests as UNAVAILABLE,
             * retry-safe) and is restarted with a new context. */
            if (s->gpu && stage_gpu_context_lost(s->gpu, err))
                return strata_error_prefix(err, "%s", e1.msg);
        }
    }
    if (!s->last && (rc = send_rows(s, plan, n_run, rows, err)) != STRATA_OK)
        return rc;
    if (s->last)
        for (size_t r = 0; r < n_run; r++) {
            const Strata__Internal__V1__SeqWork *w = plan->seqs[s->plan_index[r]];
            if (!w->sample)
                continue;
            seq_entry *e = find(s, w->seq_id);
            if (!entry_sampler(s, e, w))
                continue;   /* why is recorded */
            stage_seq_result *res = result(s, w->seq_id);
            if (!res)
                return strata_fail(err, STRATA_ENOMEM, "stage: out of memory");
            res->sampled = true;
            res->token = s->gpu ? (uint32_t)s->gpu_next[r]
                                : (uint32_t)sampler_sample(e->smp, s->logits + r * (size_t)s->cfg->n_vocab);
        }
done:
    out->seqs = s->res;
    out->n_seqs = s->n_res;
    return STRATA_OK;
}

void stage_get_kv_usage(const stage *s, stage_kv_usage *out)
{
    memset(out, 0, sizeof *out);
    if (!s)
        return;
    if (s->gpu) {
        stage_gpu_usage(s->gpu, out);
        out->sequences = s->n_seqs;
        out->prefix_entries = s->n_prefixes;
        out->prefix_bytes = s->prefix_bytes;
        return;
    }
    kv_pool_stats ps;
    kv_pool_get_stats(s->pool, &ps);
    out->device_capacity_blocks = ps.slots;
    out->device_blocks = ps.slots - ps.free_slots;
    out->device_capacity_bytes = kv_pool_bytes(s->pool);
    out->device_bytes = ps.slots ? out->device_capacity_bytes / ps.slots * out->device_blocks : 0;
    out->sequences = s->n_seqs;
    out->prefix_entries = s->n_prefixes;
    out->prefix_bytes = s->prefix_bytes;
    if (s->tiers) {
        stage_usage_add_tiers(s->tiers, out);
        out->spills += ps.evictions;
        out->restores += ps.fetches;
    }
}

/* A migration image: u32 magic "SMIG", u32 flags (bit 0: a sampler state follows), the sampler
 * state (SAMPLER_STATE_BYTES, zeros without one), then the KV sequence image. */
#define MIGRATION_MAGIC 0x47494d53u
#define MIGRATION_HEAD (8u + SAMPLER_STATE_BYTES)

int stage_export_seq(stage *s, uint64_t id, uint8_t **img, size_t *len, strata_error *err)
{
    *img = NULL;
    *len = 0;
    seq_entry *e = find(s, id);
    if (!e)
        return strata_fail(err, STRATA_EINVAL, "sequence %" PRIu64 " is not on this stage", id);
    if (entry_preempted(e))   /* its image would arrive as running while the coordinator holds it preempted */
        return strata_fail(err, STRATA_EINVAL, "sequence %" PRIu64 " is preempted: resume it before moving it", id);
    uint8_t *kv = NULL;
    size_t kv_len = 0;
    int rc = e->gpu ? stage_gpu_seq_export(s->gpu, e->gpu, &kv, &kv_len, err) : kv_seq_export(e->kv, &kv, &kv_len, err);
    if (rc != STRATA_OK)
        return rc;
    uint8_t *out = malloc(MIGRATION_HEAD + kv_len);
    if (!out) {
        free(kv);
        return strata_fail(err, STRATA_ENOMEM, "out of memory for a %zu-byte migration image", kv_len);
    }
    memset(out, 0, MIGRATION_HEAD);
    kv_st32(out, MIGRATION_MAGIC);
    kv_st32(out + 4, e->smp ? 1u : 0u);
    if (e->smp)
        sampler_save(e->smp, out + 8);
    memcpy(out + MIGRATION_HEAD, kv, kv_len);
    free(kv);
    *img = out;
    *len = MIGRATION_HEAD + kv_len;
    return STRATA_OK;
}

int stage_import_seq(stage *s, uint64_t id, const uint8_t *img, size_t len, strata_error *err)
{
    if (find(s, id))
        return strata_fail(err, STRATA_EINVAL, "sequence %" PRIu64 " is already on this stage", id);
    if (len < MIGRATION_HEAD || kv_ld32(img) != MIGRATION_MAGIC || (kv_ld32(img + 4) & ~1u))
        return strata_fail(err, STRATA_EFORMAT, "not a migration image (%zu bytes)", len);
    sampler *smp = NULL;
    if ((kv_ld32(img + 4) & 1u) && !(smp = sampler_restore(img + 8, s->cfg->n_vocab, err)))
        return err ? err->code : STRATA_EINVAL;
    return add_imported(s, id, img + MIGRATION_HEAD, len - MIGRATION_HEAD, smp, err);
}

void stage_drop_seq(stage *s, uint64_t id) { drop(s, id); }
