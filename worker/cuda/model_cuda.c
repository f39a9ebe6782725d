/* The CUDA forward pass (see model_cuda.h). Everything runs on the default stream, in order; the
 * host waits only where it reads results (logits, the attention status) or reuses a host buffer. */
#include "worker/cuda/model_cuda.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda_kv_attention.h"
#include "kernels/cuda_kv_encode.h"
#include "kernels/cuda_ops.h"

typedef struct cuda_layer {
    float *attn_norm, *ffn_norm;               /* fp32 */
    void *wq, *wk, *wv, *wo, *w_gate, *w_up, *w_down;  /* dtype */
} cuda_layer;

struct cuda_model {
    const model *host;
    model_config cfg;
    cuda_weight_dtype dtype;
    cublasHandle_t blas;
    bool blas_ok;
    int sm_count;
    cuda_layer *layers;
    float *output_norm;
    void *output;
    size_t weight_bytes;
    /* Activations for up to cap tokens. */
    size_t cap;
    float *x, *xn, *q, *k, *v, *attn, *proj, *gate, *up, *logits;
    uint16_t *act16, *k16, *v16;
    float *h_rows;   /* host staging of embedding rows */
};

struct cuda_seq {
    cuda_model *cm;
    kv_codec_params codec;
    cuda_kv_encoder enc;
    int n_layers, block_tokens, residual;
    size_t max_tokens, len, max_blocks, slot, row;  /* row: elements of one token's K (H * D) */
    uint8_t *arena;                  /* device: n_layers * max_blocks slots */
    uint16_t *tail_k, *tail_v, *tmp;  /* device: n_layers * (R + BT) rows; tmp: R rows */
    int *tail_len, *n_blocks;        /* host, per layer */
    const uint8_t **d_tables;        /* device: n_layers * max_blocks block pointers */
    cuda_kv_seq *d_views;            /* device: one per layer */
    cuda_kv_encode_job *d_job;
    void *d_ws;
    int *d_status;
};

#define CU(call, what)                                                                                     \
    do {                                                                                                   \
        cudaError_t e_ = (call);                                                                           \
        if (e_ != cudaSuccess)                                                                             \
            return strata_fail(err, STRATA_EIO, "CUDA %s: %s", (what), cudaGetErrorString(e_));            \
    } while (0)

#define KERNEL(call, what) CU((cudaError_t)(call), (what))

static size_t elem_bytes(cuda_weight_dtype t) { return t == CUDA_WEIGHTS_F16 ? 2 : 4; }

/* n fp32 values to a new device array of dtype; fp16 conversion on the device in chunks. */
static int upload(cuda_model *cm, const float *host, size_t n, cuda_weight_dtype dtype, void **out, strata_error *err)
{
    *out = NULL;
    CU(cudaMalloc(out, n * elem_bytes(dtype)), "allocating weights");
    cm->weight_bytes += n * elem_bytes(dtype);
    if (dtype == CUDA_WEIGHTS_F32) {
        CU(cudaMemcpy(*out, host, n * sizeof(float), cudaMemcpyHostToDevice), "copying weights");
        return STRATA_OK;
    }
    const size_t chunk = (size_t)16 << 20;
    float *stage = NULL;
    CU(cudaMalloc((void **)&stage, (n < chunk ? n : chunk) * sizeof(float)), "allocating a staging buffer");
    int rc = STRATA_OK;
    for (size_t at = 0; at < n && rc == STRATA_OK; at += chunk) {
        const size_t m = n - at < chunk ? n - at : chunk;
        cudaError_t e = cudaMemcpy(stage, host + at, m * sizeof(float), cudaMemcpyHostToDevice);
        if (e == cudaSuccess)
            e = (cudaError_t)cuda_f32_to_f16(stage, (uint16_t *)*out + at, m, NULL);
        if (e != cudaSuccess)
            rc = strata_fail(err, STRATA_EIO, "CUDA converting weights to fp16: %s", cudaGetErrorString(e));
    }
    cudaFree(stage);
    return rc;
}

static int upload_f32(cuda_model *cm, const float *host, size_t n, float **out, strata_error *err)
{
    return upload(cm, host, n, CUDA_WEIGHTS_F32, (void **)out, err);
}

static int upload_layers(cuda_model *cm, strata_error *err)
{
    const model_config *c = &cm->cfg;
    const size_t e = (size_t)c->n_embd, kvd = (size_t)c->n_kv_heads * (size_t)c->head_dim, ff = (size_t)c->n_ff;
    for (int il = 0; il < c->n_layers; il++) {
        model_layer_weights w;
        int rc = model_get_layer_weights(cm->host, il, &w, err);
        cuda_layer *L = &cm->layers[il];
        if (rc == STRATA_OK)
            rc = upload_f32(cm, w.attn_norm, e, &L->attn_norm, err);
        if (rc == STRATA_OK)
            rc = upload_f32(cm, w.ffn_norm, e, &L->ffn_norm, err);
        if (rc == STRATA_OK)
            rc = upload(cm, w.wq, e * e, cm->dtype, &L->wq, err);
        if (rc == STRATA_OK)
            rc = upload(cm, w.wk, kvd * e, cm->dtype, &L->wk, err);
        if (rc == STRATA_OK)
            rc = upload(cm, w.wv, kvd * e, cm->dtype, &L->wv, err);
        if (rc == STRATA_OK)
            rc = upload(cm, w.wo, e * e, cm->dtype, &L->wo, err);
        if (rc == STRATA_OK)
            rc = upload(cm, w.w_gate, ff * e, cm->dtype, &L->w_gate, err);
        if (rc == STRATA_OK)
            rc = upload(cm, w.w_up, ff * e, cm->dtype, &L->w_up, err);
        if (rc == STRATA_OK)
            rc = upload(cm, w.w_down, e * ff, cm->dtype, &L->w_down, err);
        if (rc != STRATA_OK)
            return strata_error_prefix(err, "layer %d", il);
    }
    return STRATA_OK;
}

cuda_model *cuda_model_create(const model *m, cuda_weight_dtype dtype, strata_error *err)
{
    if (!m || (dtype != CUDA_WEIGHTS_F16 && dtype != CUDA_WEIGHTS_F32)) {
        strata_fail(err, STRATA_EINVAL, "cuda_model_create: bad arguments");
        return NULL;
    }
    const model_config *c = model_get_config(m);
    if (model_layer_begin(m) != 0 || model_layer_end(m) != c->n_layers || !model_get_token_embedding(m)) {
        strata_fail(err, STRATA_EINVAL, "the CUDA forward pass needs a model holding every layer (this one holds [%d, %d))",
                    model_layer_begin(m), model_layer_end(m));
        return NULL;
    }
    if (c->head_dim * c->n_heads != c->n_embd) {
        strata_fail(err, STRATA_EUNSUPPORTED, "head_dim %d x %d heads != n_embd %d", c->head_dim, c->n_heads, c->n_embd);
        return NULL;
    }
    int n_dev = 0;
    cudaError_t e = cudaGetDeviceCount(&n_dev);
    if (e != cudaSuccess || n_dev == 0) {
        strata_fail(err, STRATA_EIO, "no CUDA device (%s)", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        return NULL;
    }
    cuda_model *cm = calloc(1, sizeof *cm);
    if (!cm) {
        strata_fail(err, STRATA_ENOMEM, "out of memory");
        return NULL;
    }
    cm->host = m;
    cm->cfg = *c;
    cm->dtype = dtype;
    cm->layers = calloc((size_t)c->n_layers, sizeof *cm->layers);
    int rc = cm->layers ? STRATA_OK : strata_fail(err, STRATA_ENOMEM, "out of memory");
    if (rc == STRATA_OK && cudaDeviceGetAttribute(&cm->sm_count, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess)
        rc = strata_fail(err, STRATA_EIO, "CUDA: reading the multiprocessor count");
    if (rc == STRATA_OK) {
        cublasStatus_t st = cublasCreate(&cm->blas);
        cm->blas_ok = st == CUBLAS_STATUS_SUCCESS;
        if (!cm->blas_ok)
            rc = strata_fail(err, STRATA_EIO, "cuBLAS: cublasCreate failed (status %d)", (int)st);
    }
    if (rc == STRATA_OK)
        rc = upload_layers(cm, err);
    const size_t e_ = (size_t)c->n_embd, nv = (size_t)c->n_vocab;
    if (rc == STRATA_OK)
        rc = upload_f32(cm, model_get_output_norm(m), e_, &cm->output_norm, err);
    if (rc == STRATA_OK)
        rc = upload(cm, model_get_output_weights(m), nv * e_, dtype, &cm->output, err);
    if (rc != STRATA_OK) {
        cuda_model_free(cm);
        return NULL;
    }
    return cm;
}

static void free_workspace(cuda_model *cm)
{
    void *bufs[] = {cm->x, cm->xn, cm->q, cm->k, cm->v, cm->attn, cm->proj, cm->gate, cm->up, cm->logits,
                    cm->act16, cm->k16, cm->v16};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
        cudaFree(bufs[i]);
    free(cm->h_rows);
    cm->x = cm->xn = cm->q = cm->k = cm->v = cm->attn = cm->proj = cm->gate = cm->up = cm->logits = NULL;
    cm->act16 = cm->k16 = cm->v16 = NULL;
    cm->h_rows = NULL;
    cm->cap = 0;
}

void cuda_model_free(cuda_model *cm)
{
    if (!cm)
        return;
    free_workspace(cm);
    for (int il = 0; cm->layers && il < cm->cfg.n_layers; il++) {
        cuda_layer *L = &cm->layers[il];
        void *bufs[] = {L->attn_norm, L->ffn_norm, L->wq, L->wk, L->wv, L->wo, L->w_gate, L->w_up, L->w_down};
        for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
            cudaFree(bufs[i]);
    }
    free(cm->layers);
    cudaFree(cm->output_norm);
    cudaFree(cm->output);
    if (cm->blas_ok)
        cublasDestroy(cm->blas);
    free(cm);
}

size_t cuda_model_weight_bytes(const cuda_model *cm) { return cm ? cm->weight_bytes : 0; }

static int ensure_workspace(cuda_model *cm, size_t n, strata_error *err)
{
    if (n <= cm->cap)
        return STRATA_OK;
    free_workspace(cm);
    const model_config *c = &cm->cfg;
    const size_t e = (size_t)c->n_embd, kvd = (size_t)c->n_kv_heads * (size_t)c->head_dim, ff = (size_t)c->n_ff;
    const size_t wide = ff > e ? ff : e;
    struct { void **p; size_t bytes; } want[] = {
        {(void **)&cm->x, n * e * 4},     {(void **)&cm->xn, n * e * 4},      {(void **)&cm->q, n * e * 4},
        {(void **)&cm->k, n * kvd * 4},   {(void **)&cm->v, n * kvd * 4},     {(void **)&cm->attn, n * e * 4},
        {(void **)&cm->proj, n * e * 4},  {(void **)&cm->gate, n * ff * 4},   {(void **)&cm->up, n * ff * 4},
        {(void **)&cm->logits, (size_t)c->n_vocab * 4}, {(void **)&cm->act16, n * wide * 2},
        {(void **)&cm->k16, n * kvd * 2}, {(void **)&cm->v16, n * kvd * 2},
    };
    for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
        cudaError_t e_ = cudaMalloc(want[i].p, want[i].bytes);
        if (e_ != cudaSuccess) {
            free_workspace(cm);
            return strata_fail(err, STRATA_EIO, "CUDA: activations for %zu tokens: %s", n, cudaGetErrorString(e_));
        }
    }
    if (!(cm->h_rows = malloc(n * e * sizeof(float)))) {
        free_workspace(cm);
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    }
    cm->cap = n;
    return STRATA_OK;
}

/* y[n][out] = x[n][in] W^T with W [out][in] (GGUF layout): in cuBLAS's column-major terms
 * y^T = W x^T, W read as an in x out matrix and transposed. fp16 weights take an fp16 copy of x
 * and accumulate in fp32; fp32 weights use exact fp32 arithmetic (no TF32). */
static int gemm(cuda_model *cm, const float *x, size_t n, size_t in, const void *w, size_t out, float *y,
                strata_error *err)
{
    const void *xb = x;
    cudaDataType_t t = CUDA_R_32F;
    cublasComputeType_t compute = CUBLAS_COMPUTE_32F_PEDANTIC;
    if (cm->dtype == CUDA_WEIGHTS_F16) {
        KERNEL(cuda_f32_to_f16(x, cm->act16, n * in, NULL), "converting activations");
        xb = cm->act16;
        t = CUDA_R_16F;
        compute = CUBLAS_COMPUTE_32F;
    }
    const float one = 1.0f, zero = 0.0f;
    cublasStatus_t st = cublasGemmEx(cm->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)out, (int)n, (int)in, &one, w, t,
                                     (int)in, xb, t, (int)in, &zero, y, CUDA_R_32F, (int)out, compute,
                                     CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS)
        return strata_fail(err, STRATA_EIO, "cuBLAS GEMM %zux%zu by %zu rows failed (status %d)", out, in, n, (int)st);
    return STRATA_OK;
}

cuda_seq *cuda_seq_create(cuda_model *cm, const kv_codec_params *codec, int block_tokens, size_t max_tokens,
                          strata_error *err)
{
    if (!cm || !codec || block_tokens < 1 || max_tokens < 1) {
        strata_fail(err, STRATA_EINVAL, "cuda_seq_create: bad arguments");
        return NULL;
    }
    const model_config *c = &cm->cfg;
    const kv_geometry g = {.n_layers = c->n_layers, .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim,
                           .block_tokens = block_tokens};
    cuda_seq *s = calloc(1, sizeof *s);
    if (!s) {
        strata_fail(err, STRATA_ENOMEM, "out of memory");
        return NULL;
    }
    s->cm = cm;
    s->codec = *codec;
    s->n_layers = c->n_layers;
    s->block_tokens = block_tokens;
    s->residual = codec->residual;
    s->max_tokens = max_tokens;
    s->max_blocks = (max_tokens + (size_t)block_tokens - 1) / (size_t)block_tokens;
    s->row = (size_t)c->n_kv_heads * (size_t)c->head_dim;
    int rc = cuda_kv_encoder_init(codec, &g, &s->enc, err);
    s->slot = s->enc.layout.block_bytes;
    const size_t L = (size_t)s->n_layers, tail_rows = (size_t)(s->residual + block_tokens);
    cudaError_t e = cudaSuccess;
    if (rc == STRATA_OK) {
        s->tail_len = calloc(L, sizeof *s->tail_len);
        s->n_blocks = calloc(L, sizeof *s->n_blocks);
        if (!s->tail_len || !s->n_blocks)
            rc = strata_fail(err, STRATA_ENOMEM, "out of memory");
    }
    if (rc == STRATA_OK && (e = cudaMalloc((void **)&s->arena, L * s->max_blocks * s->slot)) == cudaSuccess &&
        (e = cudaMalloc((void **)&s->tail_k, L * tail_rows * s->row * 2)) == cudaSuccess &&
        (e = cudaMalloc((void **)&s->tail_v, L * tail_rows * s->row * 2)) == cudaSuccess &&
        (e = cudaMalloc((void **)&s->tmp, ((size_t)s->residual + 1) * s->row * 2)) == cudaSuccess &&
        (e = cudaMalloc((void **)&s->d_tables, L * s->max_blocks * sizeof(void *))) == cudaSuccess &&
        (e = cudaMalloc((void **)&s->d_views, L * sizeof(cuda_kv_seq))) == cudaSuccess &&
        (e = cudaMalloc((void **)&s->d_job, sizeof(cuda_kv_encode_job))) == cudaSuccess &&
        (e = cudaMalloc((void **)&s->d_status, sizeof(int))) == cudaSuccess)
        e = cudaMemset(s->d_status, 0, sizeof(int));
    if (rc == STRATA_OK && e != cudaSuccess)
        rc = strata_fail(err, STRATA_EIO, "CUDA: KV cache for %zu tokens: %s", max_tokens, cudaGetErrorString(e));
    /* Block b of layer l always lives in slot l * max_blocks + b: the tables never change. */
    if (rc == STRATA_OK) {
        const uint8_t **table = malloc(L * s->max_blocks * sizeof *table);
        if (!table)
            rc = strata_fail(err, STRATA_ENOMEM, "out of memory");
        for (size_t i = 0; table && i < L * s->max_blocks; i++)
            table[i] = s->arena + i * s->slot;
        if (table && (e = cudaMemcpy(s->d_tables, table, L * s->max_blocks * sizeof *table, cudaMemcpyHostToDevice)) !=
                         cudaSuccess)
            rc = strata_fail(err, STRATA_EIO, "CUDA: block tables: %s", cudaGetErrorString(e));
        free(table);
    }
    cuda_kv_plan plan;
    if (rc == STRATA_OK)
        rc = cuda_kv_attention_plan(&s->enc.layout, 1, c->n_heads, (int)s->max_blocks, cm->sm_count, &plan, err);
    if (rc == STRATA_OK && (e = cudaMalloc(&s->d_ws, cuda_kv_attention_workspace(&s->enc.layout, &plan))) != cudaSuccess)
        rc = strata_fail(err, STRATA_EIO, "CUDA: attention workspace: %s", cudaGetErrorString(e));
    if (rc != STRATA_OK) {
        cuda_seq_free(s);
        return NULL;
    }
    return s;
}

void cuda_seq_free(cuda_seq *s)
{
    if (!s)
        return;
    void *bufs[] = {s->arena, s->tail_k, s->tail_v, s->tmp, (void *)s->d_tables, s->d_views, s->d_job, s->d_ws,
                    s->d_status};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
        cudaFree(bufs[i]);
    free(s->tail_len);
    free(s->n_blocks);
    free(s);
}

size_t cuda_seq_length(const cuda_seq *s) { return s ? s->len : 0; }

static uint16_t *tail_at(const cuda_seq *s, uint16_t *base, int layer, size_t token)
{
    return base + ((size_t)layer * (size_t)(s->residual + s->block_tokens) + token) * s->row;
}

/* Appends n fp16 rows to a layer: the tail and the new rows are one stream, and every time the
 * tail reaches R + block_tokens its oldest block_tokens become a block (the CPU pool's rule,
 * kv_seq_append, so blocks form at the same positions). */
static int append_layer(cuda_seq *s, int layer, const uint16_t *k16, const uint16_t *v16, size_t n, strata_error *err)
{
    const size_t full = (size_t)(s->residual + s->block_tokens), bt = (size_t)s->block_tokens, bytes = s->row * 2;
    for (size_t i = 0; i < n;) {
        size_t take = full - (size_t)s->tail_len[layer];
        if (take > n - i)
            take = n - i;
        CU(cudaMemcpy(tail_at(s, s->tail_k, layer, (size_t)s->tail_len[layer]), k16 + i * s->row, take * bytes,
                      cudaMemcpyDeviceToDevice), "appending keys");
        CU(cudaMemcpy(tail_at(s, s->tail_v, layer, (size_t)s->tail_len[layer]), v16 + i * s->row, take * bytes,
                      cudaMemcpyDeviceToDevice), "appending values");
        s->tail_len[layer] += (int)take;
        i += take;
        if ((size_t)s->tail_len[layer] < full)
            continue;
        const size_t b = (size_t)s->n_blocks[layer];
        if (b >= s->max_blocks)
            return strata_fail(err, STRATA_EFULL, "layer %d: no block slot left", layer);
        const cuda_kv_encode_job job = {
            .k = tail_at(s, s->tail_k, layer, 0),
            .v = tail_at(s, s->tail_v, layer, 0),
            .dst = s->arena + ((size_t)layer * s->max_blocks + b) * s->slot,
            .first_pos = (uint64_t)b * bt,
            .layer = (uint32_t)layer,
        };
        CU(cudaMemcpy(s->d_job, &job, sizeof job, cudaMemcpyHostToDevice), "encoder job");
        int rc = cuda_kv_encode_blocks(&s->enc, s->d_job, 1, NULL, err);
        if (rc != STRATA_OK)
            return rc;
        s->n_blocks[layer]++;
        /* The R newest rows move to the front (through tmp: the ranges overlap when R > bt). */
        if (s->residual > 0) {
            const size_t r = (size_t)s->residual;
            CU(cudaMemcpy(s->tmp, tail_at(s, s->tail_k, layer, bt), r * bytes, cudaMemcpyDeviceToDevice), "tail");
            CU(cudaMemcpy(tail_at(s, s->tail_k, layer, 0), s->tmp, r * bytes, cudaMemcpyDeviceToDevice), "tail");
            CU(cudaMemcpy(s->tmp, tail_at(s, s->tail_v, layer, bt), r * bytes, cudaMemcpyDeviceToDevice), "tail");
            CU(cudaMemcpy(tail_at(s, s->tail_v, layer, 0), s->tmp, r * bytes, cudaMemcpyDeviceToDevice), "tail");
        }
        s->tail_len[layer] = s->residual;
    }
    return STRATA_OK;
}

/* Decode attention of one token over layer's cache (its blocks and tail, the new token included). */
static int attend_cache(cuda_seq *s, int layer, strata_error *err)
{
    cuda_model *cm = s->cm;
    const cuda_kv_seq view = {
        .blocks = s->d_tables + (size_t)layer * s->max_blocks,
        .tail_k = tail_at(s, s->tail_k, layer, 0),
        .tail_v = tail_at(s, s->tail_v, layer, 0),
        .n_blocks = s->n_blocks[layer],
        .tail_tokens = s->tail_len[layer],
    };
    cuda_kv_seq *d_view = s->d_views + layer;
    CU(cudaMemcpy(d_view, &view, sizeof view, cudaMemcpyHostToDevice), "attention view");
    cuda_kv_layout layout = s->enc.layout;
    layout.layer = (uint32_t)layer;
    cuda_kv_plan plan;
    int rc = cuda_kv_attention_plan(&layout, 1, cm->cfg.n_heads, s->n_blocks[layer], cm->sm_count, &plan, err);
    if (rc == STRATA_OK)
        rc = cuda_kv_attention(&layout, &plan, d_view, cm->q, cm->attn, s->d_ws, s->d_status, NULL, err);
    return rc;
}

static int run_layer(cuda_seq *s, int il, size_t n, size_t pos0, bool prefill, strata_error *err)
{
    cuda_model *cm = s->cm;
    const model_config *c = &cm->cfg;
    const cuda_layer *L = &cm->layers[il];
    const size_t e = (size_t)c->n_embd, hd = (size_t)c->head_dim, kvd = (size_t)c->n_kv_heads * hd;
    const size_t ff = (size_t)c->n_ff;
    int rc;
    KERNEL(cuda_rmsnorm(cm->x, L->attn_norm, n, e, c->rms_eps, cm->xn, NULL), "rmsnorm");
    if ((rc = gemm(cm, cm->xn, n, e, L->wq, e, cm->q, err)) || (rc = gemm(cm, cm->xn, n, e, L->wk, kvd, cm->k, err)) ||
        (rc = gemm(cm, cm->xn, n, e, L->wv, kvd, cm->v, err)))
        return rc;
    KERNEL(cuda_rope(cm->q, n, (size_t)c->n_heads, hd, pos0, c->rope_theta, NULL), "rope");
    KERNEL(cuda_rope(cm->k, n, (size_t)c->n_kv_heads, hd, pos0, c->rope_theta, NULL), "rope");
    KERNEL(cuda_f32_to_f16(cm->k, cm->k16, n * kvd, NULL), "keys to fp16");
    KERNEL(cuda_f32_to_f16(cm->v, cm->v16, n * kvd, NULL), "values to fp16");
    if ((rc = append_layer(s, il, cm->k16, cm->v16, n, err)) != STRATA_OK)
        return rc;
    if (prefill)
        rc = cuda_attention_prefill(cm->q, cm->k16, cm->v16, (int)n, c->n_heads, c->n_kv_heads, c->head_dim, cm->attn,
                                    NULL, err);
    else
        rc = attend_cache(s, il, err);
    if (rc != STRATA_OK)
        return rc;
    if ((rc = gemm(cm, cm->attn, n, e, L->wo, e, cm->proj, err)))
        return rc;
    KERNEL(cuda_add(cm->x, cm->proj, n * e, NULL), "residual");
    KERNEL(cuda_rmsnorm(cm->x, L->ffn_norm, n, e, c->rms_eps, cm->xn, NULL), "rmsnorm");
    if ((rc = gemm(cm, cm->xn, n, e, L->w_gate, ff, cm->gate, err)) || (rc = gemm(cm, cm->xn, n, e, L->w_up, ff, cm->up, err)))
        return rc;
    KERNEL(cuda_swiglu(cm->gate, cm->up, n * ff, cm->gate, NULL), "swiglu");
    if ((rc = gemm(cm, cm->gate, n, ff, L->w_down, e, cm->proj, err)))
        return rc;
    KERNEL(cuda_add(cm->x, cm->proj, n * e, NULL), "residual");
    return STRATA_OK;
}

/* n tokens at positions len.. through every layer, all at once (prefill) or one (decode). */
static int run_tokens(cuda_seq *s, const int32_t *tokens, size_t n, bool prefill, float *logits, strata_error *err)
{
    cuda_model *cm = s->cm;
    const model_config *c = &cm->cfg;
    const size_t e = (size_t)c->n_embd;
    int rc = ensure_workspace(cm, n, err);
    if (rc != STRATA_OK)
        return rc;
    const float *table = model_get_token_embedding(cm->host);
    for (size_t i = 0; i < n; i++)
        memcpy(cm->h_rows + i * e, table + (size_t)tokens[i] * e, e * sizeof(float));
    CU(cudaMemcpy(cm->x, cm->h_rows, n * e * sizeof(float), cudaMemcpyHostToDevice), "embedding rows");
    for (int il = 0; il < c->n_layers; il++)
        if ((rc = run_layer(s, il, n, s->len, prefill, err)) != STRATA_OK)
            return strata_error_prefix(err, "layer %d", il);
    s->len += n;
    int status = 0;
    CU(cudaMemcpy(&status, s->d_status, sizeof status, cudaMemcpyDeviceToHost), "attention status");
    if (status)
        return strata_fail(err, STRATA_EFORMAT, "the CUDA attention kernel rejected a block of the cache (status %d)",
                           status);
    if (!logits)
        return STRATA_OK;
    const float *last = cm->x + (n - 1) * e;
    KERNEL(cuda_rmsnorm(last, cm->output_norm, 1, e, c->rms_eps, cm->xn, NULL), "output norm");
    if ((rc = gemm(cm, cm->xn, 1, e, cm->output, (size_t)c->n_vocab, cm->logits, err)))
        return rc;
    CU(cudaMemcpy(logits, cm->logits, (size_t)c->n_vocab * sizeof(float), cudaMemcpyDeviceToHost), "logits");
    return STRATA_OK;
}

int cuda_model_forward(cuda_model *cm, cuda_seq *s, const int32_t *tokens, size_t n, float *logits, strata_error *err)
{
    if (!cm || !s || s->cm != cm || !tokens || n == 0)
        return strata_fail(err, STRATA_EINVAL, "cuda_model_forward: bad arguments");
    if (n > s->max_tokens - s->len)
        return strata_fail(err, STRATA_EINVAL, "%zu tokens after %zu exceed the sequence's %zu", n, s->len,
                           s->max_tokens);
    for (size_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= cm->cfg.n_vocab)
            return strata_fail(err, STRATA_EINVAL, "token %d out of range 0..%d", (int)tokens[i], cm->cfg.n_vocab - 1);
    if (s->len == 0 && n > 1)
        return run_tokens(s, tokens, n, true, logits, err);
    for (size_t i = 0; i < n; i++) {
        int rc = run_tokens(s, tokens + i, 1, false, i + 1 == n ? logits : NULL, err);
        if (rc != STRATA_OK)
            return rc;
    }
    return STRATA_OK;
}
