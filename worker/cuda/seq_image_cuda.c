/* Migration images of GPU sequences (model_cuda.h: cuda_seq_export, cuda_seq_import): the
 * sequence image of kvstore/seq_image.h written from, and read into, a cuda_seq. Blocks travel as
 * their exact bytes, copied between device slots (or, with the shared pool, wherever the block is:
 * it is brought back first) and the image; the fp16 tails and OTT's tracker state likewise. So
 * an image taken on a GPU imports on a CPU stage and the other way round. */
#include <stdlib.h>
#include <string.h>

#include "kvstore/bytes.h"
#include "kvstore/ott.h"
#include "kvstore/plan.h"
#include "kvstore/seq_image.h"
#include "worker/cuda/model_cuda_impl.h"

typedef struct image_ctx {
    cuda_seq *s;           /* import: made by im_plan on the image's plan */
    cuda_model *cm;        /* import: where, and the plans it may be on */
    const kv_codec_params *const *plans;
    int n_plans, block_tokens;
    size_t max_tokens;
    uint8_t *stage;        /* host staging: one slot, or one layer's OTT state */
    size_t stage_bytes;
    size_t prompt_end;     /* import: the layer being read */
} image_ctx;

static int grow(void **p, size_t *cap, size_t bytes, strata_error *err)
{
    if (bytes <= *cap)
        return STRATA_OK;
    void *q = realloc(*p, bytes);
    if (!q)
        return strata_fail(err, STRATA_ENOMEM, "out of memory for %zu bytes of a migration image", bytes);
    *p = q;
    *cap = bytes;
    return STRATA_OK;
}

/* Layer l's OTT state in the image: the CPU tracker's byte layout, 0 bytes for a layer without. */
static size_t ott_image_bytes(const cuda_seq *s, int l)
{
    return s->enc[l].ott ? kv_ott_state_bytes((size_t)s->enc[l].layout.n_kv_heads, (size_t)s->enc[l].ott_pool) : 0;
}

/* The device's tracker state of a layer: the heads' counters, then each head's pool. */
static uint8_t *ott_device(const cuda_seq *s, int l) { return s->d_ott + (size_t)l * s->ott_stride; }

/* ---- export ---- */

static int ex_layer(void *ctx, int l, kv_image_layer *out, strata_error *err)
{
    (void)err;
    const cuda_seq *s = ((image_ctx *)ctx)->s;
    *out = (kv_image_layer){.n_blocks = (size_t)s->n_blocks[l], .tail_len = (size_t)s->tail_len[l],
                            .prompt_end = s->prompt_end, .ott_bytes = ott_image_bytes(s, l)};
    return STRATA_OK;
}

static int ex_ott(void *ctx, int l, uint8_t *dst, strata_error *err)
{
    image_ctx *c = ctx;
    const cuda_seq *s = c->s;
    const size_t H = (size_t)s->enc[l].layout.n_kv_heads, N = (size_t)s->enc[l].ott_pool;
    int rc = grow((void **)&c->stage, &c->stage_bytes, s->enc[l].ott_state_bytes, err);
    if (rc != STRATA_OK)
        return rc;
    CU(cudaMemcpy(c->stage, ott_device(s, l), s->enc[l].ott_state_bytes, cudaMemcpyDeviceToHost), "OTT state");
    const kv_ott_head *heads = (const kv_ott_head *)(const void *)c->stage;
    kv_ott_state_save(heads, (const kv_ott_member *)(const void *)(heads + H), H, N, N, dst);
    return STRATA_OK;
}

/* Block b of layer l into c->stage (the whole slot), wherever it is. */
static int ex_fetch(image_ctx *c, int l, size_t b, strata_error *err)
{
    cuda_seq *s = c->s;
    const size_t i = (size_t)l * s->max_blocks + b;
    int rc = grow((void **)&c->stage, &c->stage_bytes, s->slot, err);
    if (rc != STRATA_OK)
        return rc;
    const void *src = s->arena ? (const void *)(s->arena + i * s->slot) : NULL;
    void *addr = NULL;
    if (!src) {   /* shared pool: resident again (and pinned) for the copy */
        if ((rc = device_pool_acquire(s->cm->pool, &s->handles[i], 1, &addr, err)) != STRATA_OK)
            return strata_error_prefix(err, "layer %d block %zu", l, b);
        if (s->h_tables[i] != addr) {
            s->h_tables[i] = addr;
            s->row_dirty[l] = 1;
        }
        src = addr;
    }
    const cudaError_t e = cudaMemcpy(c->stage, src, s->slot, cudaMemcpyDeviceToHost);
    if (!s->arena)
        device_pool_unpin_all(s->cm->pool);   /* between steps nothing else is pinned */
    if (e != cudaSuccess)
        return cuda_failf(err, e, "reading layer %d block %zu", l, b);
    return STRATA_OK;
}

static int ex_block_bytes(void *ctx, int l, size_t b, uint32_t *bytes, strata_error *err)
{
    image_ctx *c = ctx;
    int rc = ex_fetch(c, l, b, err);
    kv_block blk;
    if (rc == STRATA_OK && (rc = kv_block_parse(c->stage, c->s->slot, &blk, err)) != STRATA_OK)
        strata_error_prefix(err, "layer %d block %zu on the device", l, b);
    if (rc == STRATA_OK)
        *bytes = blk.block_bytes;
    return rc;
}

static int ex_block(void *ctx, int l, size_t b, uint8_t *dst, strata_error *err)
{
    (void)l, (void)b, (void)err;
    image_ctx *c = ctx;   /* ex_block_bytes fetched it just before */
    kv_block blk;
    int rc = kv_block_parse(c->stage, c->s->slot, &blk, err);
    if (rc == STRATA_OK)
        memcpy(dst, c->stage, blk.block_bytes);
    return rc;
}

static int ex_tail(void *ctx, int l, uint16_t *k, uint16_t *v, strata_error *err)
{
    cuda_seq *s = ((image_ctx *)ctx)->s;
    const size_t bytes = (size_t)s->tail_len[l] * s->row * sizeof(uint16_t);
    CU(cudaMemcpy(k, cuda_seq_tail_at(s, s->tail_k, l, 0), bytes, cudaMemcpyDeviceToHost), "tail");
    CU(cudaMemcpy(v, cuda_seq_tail_at(s, s->tail_v, l, 0), bytes, cudaMemcpyDeviceToHost), "tail");
    return STRATA_OK;
}

int cuda_seq_export(cuda_seq *s, uint8_t **img, size_t *len, strata_error *err)
{
    *img = NULL;
    *len = 0;
    if (!s)
        return strata_fail(err, STRATA_EINVAL, "cuda_seq_export: NULL sequence");
    const model_config *cfg = &s->cm->cfg;
    const kv_geometry g = {.n_layers = s->n_layers, .n_kv_heads = cfg->n_kv_heads, .head_dim = cfg->head_dim,
                           .block_tokens = s->block_tokens};
    image_ctx c = {.s = s};
    const kv_image_source src = {.ctx = &c, .layer = ex_layer, .ott_state = ex_ott, .block_bytes = ex_block_bytes,
                                 .block = ex_block, .tail = ex_tail, .codecs = s->codecs};
    int rc = kv_image_write(&g, &src, img, len, err);
    free(c.stage);
    return rc;
}

/* ---- import ---- */

/* The GPU sequence is made on the image's plan when it is one of the caller's (the device kernels
 * take one layout per layer of a sequence, set at creation; the pool's slots are sized for the
 * caller's plans), before any layer is read. */
static int im_plan(void *ctx, const kv_codec_params *codecs, strata_error *err)
{
    image_ctx *c = ctx;
    const int L = c->cm->n_local;
    char *theirs = kv_plan_name(codecs, L), *own = kv_plan_name(c->plans[0], L);
    int found = -1, rc = STRATA_OK;
    for (int i = 0; theirs && own && found < 0 && rc == STRATA_OK && i < c->n_plans; i++) {
        char *mine = i == 0 ? own : kv_plan_name(c->plans[i], L);
        if (!mine)
            rc = STRATA_ENOMEM;
        else if (strcmp(mine, theirs) == 0)
            found = i;
        if (i > 0)
            free(mine);
    }
    if (!theirs || !own || rc != STRATA_OK)
        rc = strata_fail(err, STRATA_ENOMEM, "kv import: out of memory");
    else if (found < 0)
        rc = strata_fail(err, STRATA_EUNSUPPORTED, "kv import: the image's plan '%s' is not one this GPU model takes "
                         "(its own '%s' and %d other(s))", theirs, own, c->n_plans - 1);
    else if (!(c->s = cuda_seq_create_plan(c->cm, c->plans[found], c->block_tokens, c->max_tokens, err)))
        rc = err ? err->code : STRATA_ENOMEM;
    free(own);
    free(theirs);
    return rc;
}

static int im_layer(void *ctx, int l, const kv_image_layer *info, const uint8_t *ott, strata_error *err)
{
    image_ctx *c = ctx;
    cuda_seq *s = c->s;
    const size_t bt = (size_t)s->block_tokens;
    if (info->n_blocks > s->max_blocks || info->tail_len >= (size_t)(s->residual + s->block_tokens) ||
        info->n_blocks * bt + info->tail_len > c->max_tokens)
        return strata_fail(err, STRATA_EINVAL, "kv import: layer %d holds %zu blocks and %zu tail tokens; this GPU "
                           "sequence takes at most %zu tokens, with a tail under %d", l, info->n_blocks,
                           info->tail_len, c->max_tokens, s->residual + s->block_tokens);
    if (info->ott_bytes != ott_image_bytes(s, l))
        return strata_fail(err, STRATA_EINVAL, "kv import: layer %d's OTT state (%zu bytes) does not fit this "
                           "sequence's codec there (%zu)", l, info->ott_bytes, ott_image_bytes(s, l));
    if (s->enc[l].ott) {
        const size_t H = (size_t)s->enc[l].layout.n_kv_heads, N = (size_t)s->enc[l].ott_pool;
        const size_t bytes = (size_t)s->enc[l].ott_state_bytes;
        int rc = grow((void **)&c->stage, &c->stage_bytes, bytes, err);
        if (rc != STRATA_OK)
            return rc;
        kv_ott_head *heads = (kv_ott_head *)(void *)c->stage;
        memset(c->stage, 0, bytes);
        if (!kv_ott_state_load(heads, (kv_ott_member *)(void *)(heads + H), H, N, N, ott, info->ott_bytes))
            return strata_fail(err, STRATA_EINVAL, "kv import: layer %d's OTT state does not parse", l);
        CU(cudaMemcpy(ott_device(s, l), c->stage, bytes, cudaMemcpyHostToDevice), "OTT state");
    }
    c->prompt_end = info->prompt_end;
    return STRATA_OK;
}

static int im_block(void *ctx, int l, size_t b, const kv_block *blk, strata_error *err)
{
    cuda_seq *s = ((image_ctx *)ctx)->s;
    if ((int)blk->desc.codec != (int)s->codecs[l].codec || blk->block_bytes > s->layer_slot[l])
        return strata_fail(err, STRATA_EINVAL, "kv import: layer %d block %zu (codec %s, %u bytes) is not what this "
                           "GPU sequence stores there (%s, at most %zu bytes)", l, b, kv_codec_id_name(blk->desc.codec),
                           (unsigned)blk->block_bytes, kv_codec_id_name((unsigned)s->codecs[l].codec),
                           s->layer_slot[l]);
    /* The device attention reads every block of the layer with one layout (not each header, as
     * the CPU does): a block of another shape, bit width or grouping would decode as garbage. */
    cuda_kv_layout got;
    if (cuda_kv_layout_from_block(blk, &got, err) != STRATA_OK)
        return strata_error_prefix(err, "kv import: layer %d block %zu", l, b);
    const cuda_kv_layout *want = &s->enc[l].layout;
    const bool sized = blk->desc.codec != KV_CODEC_GEAR && blk->desc.codec != KV_CODEC_OTT;   /* not variable */
    if (got.k_bits != want->k_bits || got.v_bits != want->v_bits || got.k_group != want->k_group ||
        got.v_group != want->v_group || got.block_tokens != want->block_tokens || got.n_kv_heads != want->n_kv_heads ||
        got.head_dim != want->head_dim || got.off_k != want->off_k || got.off_k_scales != want->off_k_scales ||
        got.off_v != want->off_v || got.off_v_scales != want->off_v_scales || got.off_k_mean != want->off_k_mean ||
        got.off_v_mean != want->off_v_mean || (sized && got.block_bytes != want->block_bytes))
        return strata_fail(err, STRATA_EINVAL, "kv import: layer %d block %zu (%s, K/V %d/%d bits, groups %d/%d, %u "
                           "bytes) is not laid out as this GPU sequence's blocks there (%d/%d bits, groups %d/%d, %u "
                           "bytes)", l, b, kv_codec_id_name(blk->desc.codec), got.k_bits, got.v_bits, got.k_group,
                           got.v_group, got.block_bytes, want->k_bits, want->v_bits, want->k_group, want->v_group,
                           want->block_bytes);
    uint8_t *dst = NULL;
    int rc = cuda_seq_new_block(s, l, b, &dst, err);
    if (rc != STRATA_OK)
        return rc;
    const cudaError_t e = cudaMemcpy(dst, blk->bytes, blk->block_bytes, cudaMemcpyHostToDevice);
    if (s->cm->pool)
        device_pool_unpin_all(s->cm->pool);   /* written: it may move down to make room for the next */
    if (e != cudaSuccess)
        return cuda_failf(err, e, "writing layer %d block %zu", l, b);
    s->n_blocks[l] = (int)b + 1;
    return STRATA_OK;
}

static int im_tail(void *ctx, int l, const uint8_t *k, const uint8_t *v, size_t tail_len, strata_error *err)
{
    image_ctx *c = ctx;
    cuda_seq *s = c->s;
    const size_t n = tail_len * s->row;
    uint16_t *rows = n ? malloc(2 * n * sizeof *rows) : NULL;
    if (n && !rows)
        return strata_fail(err, STRATA_ENOMEM, "out of memory for a tail of %zu rows", tail_len);
    for (size_t i = 0; i < n; i++) {   /* little-endian in the image */
        rows[i] = kv_ld16(k + 2 * i);
        rows[n + i] = kv_ld16(v + 2 * i);
    }
    cudaError_t e = cudaSuccess;
    if (n && (e = cudaMemcpy(cuda_seq_tail_at(s, s->tail_k, l, 0), rows, n * 2, cudaMemcpyHostToDevice)) == cudaSuccess)
        e = cudaMemcpy(cuda_seq_tail_at(s, s->tail_v, l, 0), rows + n, n * 2, cudaMemcpyHostToDevice);
    free(rows);
    if (e != cudaSuccess)
        return cuda_failf(err, e, "writing layer %d's tail", l);
    s->tail_len[l] = (int)tail_len;
    s->prompt_end = c->prompt_end;
    s->len = (size_t)s->n_blocks[l] * (size_t)s->block_tokens + tail_len;
    return STRATA_OK;
}

cuda_seq *cuda_seq_import(cuda_model *cm, const kv_codec_params *const *plans, int n_plans, int block_tokens,
                          size_t max_tokens, const uint8_t *img, size_t len, strata_error *err)
{
    if (!cm || !plans || n_plans < 1 || !img || block_tokens < 1) {
        strata_fail(err, STRATA_EINVAL, "cuda_seq_import: bad arguments");
        return NULL;
    }
    const kv_geometry g = {.n_layers = cm->n_local, .n_kv_heads = cm->cfg.n_kv_heads, .head_dim = cm->cfg.head_dim,
                           .block_tokens = block_tokens};
    image_ctx c = {.cm = cm, .plans = plans, .n_plans = n_plans, .block_tokens = block_tokens,
                   .max_tokens = max_tokens};
    const kv_image_sink sink = {.ctx = &c, .plan = im_plan, .layer = im_layer, .block = im_block, .tail = im_tail};
    int rc = kv_image_read(&g, img, len, &sink, err);
    if (rc == STRATA_OK && !c.s)
        rc = strata_fail(err, STRATA_EFORMAT, "kv import: the image names no plan");
    free(c.stage);
    if (rc != STRATA_OK) {
        cuda_seq_free(c.s);
        return NULL;
    }
    return c.s;
}
