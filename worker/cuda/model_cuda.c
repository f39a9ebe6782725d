/* The CUDA forward pass (see model_cuda.h). Everything runs on the default stream, in order; the
 * host waits only where it reads results (logits, the attention status) or reuses a host buffer. */
#include "worker/cuda/model_cuda.h"

#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda_ops.h"
#include "kernels/cuda_prefill.h"
#include "kernels/cuda_weights.h"
#include "kvstore/plan.h"
#include "worker/cuda/model_cuda_impl.h"

#define KERNEL(call, what) CU((cudaError_t)(call), (what))

/* GGUF blocks cross to the device through one staging buffer of this many bytes, chunk by chunk. */
#define WEIGHT_STAGE_BYTES ((size_t)32 << 20)

/* What building the weights needs besides the model: the staging buffer and the device word the
 * decoder reports a bad value in. */
typedef struct weight_builder {
    void *stage;
    unsigned long long *d_first_bad;
    float *host;          /* a 1-D tensor decoded on the host */
    size_t host_cap;
} weight_builder;

static void builder_free(weight_builder *b)
{
    cudaFree(b->stage);
    cudaFree(b->d_first_bad);
    free(b->host);
}

/* A GGUF matrix: whole blocks copied to the staging buffer and decoded into out there; then the
 * decoder's report (the CPU loader refuses non-finite values; the device also refuses values
 * fp16 cannot hold). */
static int decode_gguf(cuda_model *cm, weight_builder *b, const model_tensor *t, void *out, strata_error *err)
{
    uint64_t block_elems, block_bytes;
    gguf_type_block(t->type, &block_elems, &block_bytes);
    const bool f16 = cm->dtype == CUDA_WEIGHTS_F16;
    const uint64_t n = t->ne0 * t->ne1, chunk_blocks = WEIGHT_STAGE_BYTES / block_bytes;
    CU(cudaMemset(b->d_first_bad, 0xff, sizeof *b->d_first_bad), "resetting the weight check");
    for (uint64_t at = 0; at < n; at += chunk_blocks * block_elems) {
        const uint64_t m = n - at < chunk_blocks * block_elems ? n - at : chunk_blocks * block_elems;
        CU(cudaMemcpy(b->stage, (const uint8_t *)t->data + at / block_elems * block_bytes,
                      (size_t)(m / block_elems * block_bytes), cudaMemcpyHostToDevice),
           "copying weights");
        KERNEL(cuda_weights_from_gguf(t->type, b->stage, m, at, (uint8_t *)out + at * (f16 ? 2 : 4), f16,
                                      b->d_first_bad, NULL),
               "decoding weights");
    }
    unsigned long long bad = 0;
    CU(cudaMemcpy(&bad, b->d_first_bad, sizeof bad, cudaMemcpyDeviceToHost), "reading the weight check");
    if (bad != ~0ull)
        return strata_fail(err, STRATA_EFORMAT, "tensor '%s' holds a value that is not finite%s at element %llu",
                           t->name, f16 ? " in fp16 (beyond +-65504)" : "", bad);
    return STRATA_OK;
}

/* A new device array holding the tensor of role (of layer): matrices in the model's dtype, decoded
 * or generated on the device; 1-D tensors (norms) in fp32, decoded on the host (a row: too small
 * for a launch to matter). */
static int build(cuda_model *cm, weight_builder *b, model_tensor_role role, int layer, void **out, strata_error *err)
{
    *out = NULL;
    model_tensor t;
    int rc = model_tensor_get(cm->host, role, layer, &t, err);
    if (rc != STRATA_OK)
        return rc;
    const uint64_t n = t.ne0 * t.ne1;
    const bool f16 = t.ne1 > 1 && cm->dtype == CUDA_WEIGHTS_F16;
    const size_t bytes = (size_t)n * (f16 ? 2 : 4);
    if (cudaMalloc(out, bytes) != cudaSuccess) {
        cudaGetLastError();
        *out = NULL;
        return strata_fail(err, STRATA_EIO, "CUDA: out of device memory for tensor '%s' (%.1f MiB; %.1f MiB of "
                           "weights already on the device)", t.name, (double)bytes / 1048576.0,
                           (double)cm->weight_bytes / 1048576.0);
    }
    cm->weight_bytes += bytes;
    if (t.ne1 == 1) {
        if (n > b->host_cap) {
            float *grown = realloc(b->host, (size_t)n * sizeof *grown);
            if (!grown)
                return strata_fail(err, STRATA_ENOMEM, "out of memory");
            b->host = grown;
            b->host_cap = (size_t)n;
        }
        model_tensor_read(&t, 0, n, b->host);
        CU(cudaMemcpy(*out, b->host, bytes, cudaMemcpyHostToDevice), "copying weights");
        return STRATA_OK;
    }
    if (t.synthetic) {
        KERNEL(cuda_weights_synthetic(t.stream_key, t.stream_amp, 0, n, *out, f16, NULL), "generating weights");
        return STRATA_OK;
    }
    return decode_gguf(cm, b, &t, *out, err);
}

static int build_weights(cuda_model *cm, strata_error *err)
{
    weight_builder b = {0};
    int rc = STRATA_OK;
    cudaError_t e;
    if ((e = cudaMalloc(&b.stage, WEIGHT_STAGE_BYTES)) != cudaSuccess ||
        (e = cudaMalloc((void **)&b.d_first_bad, sizeof *b.d_first_bad)) != cudaSuccess)
        rc = cuda_fail(err, e, "allocating the weights' staging buffer");
    for (int il = 0; rc == STRATA_OK && il < cm->n_local; il++) {
        cuda_layer *L = &cm->layers[il];
        void **dst[MODEL_LAYER_TENSORS] = {
            [MODEL_T_ATTN_NORM] = (void **)&L->attn_norm, [MODEL_T_WQ] = &L->wq, [MODEL_T_WK] = &L->wk,
            [MODEL_T_WV] = &L->wv, [MODEL_T_WO] = &L->wo, [MODEL_T_FFN_NORM] = (void **)&L->ffn_norm,
            [MODEL_T_GATE] = &L->w_gate, [MODEL_T_UP] = &L->w_up, [MODEL_T_DOWN] = &L->w_down,
        };
        for (int role = 0; rc == STRATA_OK && role < MODEL_LAYER_TENSORS; role++)
            rc = build(cm, &b, (model_tensor_role)role, cm->layer_begin + il, dst[role], err);
    }
    if (rc == STRATA_OK && cm->last)
        rc = build(cm, &b, MODEL_T_OUTPUT_NORM, 0, (void **)&cm->output_norm, err);
    if (rc == STRATA_OK && cm->last)
        rc = build(cm, &b, MODEL_T_OUTPUT, 0, &cm->output, err);
    builder_free(&b);
    return rc;
}

/* Why cudaGetDeviceCount found no device, in a user's terms: the runtime calls a machine without
 * an NVIDIA driver "CUDA driver version is insufficient", which reads as an upgrade hint. */
static int no_device(cudaError_t e, strata_error *err)
{
    if (e == cudaSuccess || e == cudaErrorNoDevice)
        return strata_fail(err, STRATA_EIO, "no CUDA device: the NVIDIA driver finds no GPU on this machine");
    if (e == cudaErrorInsufficientDriver)
        return strata_fail(err, STRATA_EIO, "no CUDA device: no NVIDIA driver is loaded, or it is older than this "
                           "build's CUDA runtime (%s)", cudaGetErrorString(e));
    return strata_fail(err, STRATA_EIO, "no CUDA device: %s", cudaGetErrorString(e));
}

int cuda_select_device(int device, strata_error *err)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0)
        return no_device(e, err);
    if (device < 0 || device >= n)
        return strata_fail(err, STRATA_EINVAL, "CUDA device %d does not exist (this machine has cuda:0..cuda:%d)", device,
                           n - 1);
    CU(cudaSetDevice(device), "selecting the device");
    return STRATA_OK;
}

cuda_model *cuda_model_create(const model *m, cuda_weight_dtype dtype, strata_error *err)
{
    if (!m || (dtype != CUDA_WEIGHTS_F16 && dtype != CUDA_WEIGHTS_F32)) {
        strata_fail(err, STRATA_EINVAL, "cuda_model_create: bad arguments");
        return NULL;
    }
    if (!model_is_for_device(m)) {
        strata_fail(err, STRATA_EINVAL, "cuda_model_create: the model must come from model_load_for_device (its "
                    "weights are built on the device)");
        return NULL;
    }
    const model_config *c = model_get_config(m);
    const int begin = model_layer_begin(m), end = model_layer_end(m);
    if (begin < 0 || end <= begin || end > c->n_layers || (begin == 0 && !model_get_token_embedding(m).data)) {
        strata_fail(err, STRATA_EINVAL, "the CUDA forward pass needs a model holding layers [%d, %d) with the embedding "
                    "on the first stage", begin, end);
        return NULL;
    }
    if (c->head_dim * c->n_heads != c->n_embd) {
        strata_fail(err, STRATA_EUNSUPPORTED, "head_dim %d x %d heads != n_embd %d", c->head_dim, c->n_heads, c->n_embd);
        return NULL;
    }
    int n_dev = 0;
    cudaError_t e = cudaGetDeviceCount(&n_dev);
    if (e != cudaSuccess || n_dev == 0) {
        no_device(e, err);
        return NULL;
    }
    cuda_model *cm = calloc(1, sizeof *cm);
    if (!cm) {
        strata_fail(err, STRATA_ENOMEM, "out of memory");
        return NULL;
    }
    cm->host = m;
    cm->cfg = *c;
    cm->chunk_tile_keys = CUDA_CHUNK_TILE_KEYS;
    cm->dtype = dtype;
    cm->layer_begin = begin;
    cm->n_local = end - begin;
    cm->first = begin == 0;
    cm->last = end == c->n_layers;
    cm->layers = calloc((size_t)cm->n_local, sizeof *cm->layers);
    int rc = cm->layers ? STRATA_OK : strata_fail(err, STRATA_ENOMEM, "out of memory");
    int dev = 0;
    if (rc == STRATA_OK && (cudaGetDevice(&dev) != cudaSuccess ||
                            cudaDeviceGetAttribute(&cm->sm_count, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess))
        rc = strata_fail(err, STRATA_EIO, "CUDA: reading the multiprocessor count");
    if (rc == STRATA_OK) {
        cublasStatus_t st = cublasCreate(&cm->blas);
        cm->blas_ok = st == CUBLAS_STATUS_SUCCESS;
        if (!cm->blas_ok)
            rc = strata_fail(err, STRATA_EIO, "cuBLAS: cublasCreate failed (status %d)", (int)st);
    }
    if (rc == STRATA_OK && ((e = cudaMalloc((void **)&cm->d_status, sizeof(int))) != cudaSuccess ||
                            (e = cudaMemset(cm->d_status, 0, sizeof(int))) != cudaSuccess))
        rc = cuda_fail(err, e, "allocating the status flag");
    if (rc == STRATA_OK)
        rc = build_weights(cm, err);
    if (rc != STRATA_OK) {
        cuda_model_free(cm);
        return NULL;
    }
    return cm;
}

static void free_workspace(cuda_model *cm)
{
    void *bufs[] = {cm->x, cm->xn, cm->q, cm->k, cm->v, cm->attn, cm->proj, cm->gate, cm->up, cm->act16, cm->k16,
                    cm->v16, cm->d_pos};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
        cudaFree(bufs[i]);
    free(cm->h_rows);
    free(cm->h_pos);
    cm->x = cm->xn = cm->q = cm->k = cm->v = cm->attn = cm->proj = cm->gate = cm->up = NULL;
    cm->act16 = cm->k16 = cm->v16 = NULL;
    cm->d_pos = cm->h_pos = NULL;
    cm->h_rows = NULL;
    cm->cap = 0;
}

static void free_item_buffers(cuda_model *cm)
{
    void *bufs[] = {cm->head_x, cm->logits, cm->d_next, cm->d_sample, cm->d_views, cm->d_append, cm->d_encode,
                    cm->d_shift};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
        cudaFree(bufs[i]);
    free(cm->h_logits);
    free(cm->h_next);
    free(cm->h_sample);
    cm->d_next = cm->h_next = NULL;
    cm->d_sample = cm->h_sample = NULL;
    free(cm->h_views);
    free(cm->h_append);
    free(cm->h_encode);
    free(cm->h_shift);
    cm->head_x = cm->logits = cm->h_logits = NULL;
    cm->d_views = cm->h_views = NULL;
    cm->d_append = cm->h_append = NULL;
    cm->d_encode = cm->h_encode = NULL;
    cm->d_shift = cm->h_shift = NULL;
    cm->cap_items = 0;
}

void cuda_model_free(cuda_model *cm)
{
    if (!cm)
        return;
    cuda_uploads_free(&cm->uploads);   /* waits for copies still reading it */
    cuda_phase_timer_free(cm->phases);
    device_pool_destroy(cm->pool);
    cuda_device_mem_free(cm->pool_mem);
    free(cm->h_acquire);
    free(cm->h_addrs);
    free_workspace(cm);
    free_item_buffers(cm);
    cudaFree(cm->d_ws);
    cudaFree(cm->d_gear_work);
    cudaFree(cm->d_pencode);
    cudaFree(cm->d_ptail);
    cudaFree(cm->d_stream);
    free(cm->h_pencode);
    free(cm->h_ptail);
    free(cm->h_stream_k);
    free(cm->h_stream_v);
    cudaFree(cm->d_status);
    for (int il = 0; cm->layers && il < cm->n_local; il++) {
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

int cuda_model_time_phases(cuda_model *cm, bool on, strata_error *err)
{
    if (!cm)
        return strata_fail(err, STRATA_EINVAL, "cuda_model_time_phases: NULL model");
    cuda_phase_timer_free(cm->phases);
    cm->phases = NULL;
    if (on && !(cm->phases = cuda_phase_timer_create(err)))
        return err ? err->code : STRATA_ENOMEM;
    return STRATA_OK;
}

void cuda_model_phase_times(const cuda_model *cm, cuda_phase_times *out)
{
    cuda_phase_timer_totals(cm ? cm->phases : NULL, out);
}

int cuda_model_set_chunk_tile(cuda_model *cm, int keys, strata_error *err)
{
    if (!cm || keys < 1)
        return strata_fail(err, STRATA_EINVAL, "cuda_model_set_chunk_tile: %d keys (at least 1)", keys);
    cm->chunk_tile_keys = keys;
    return STRATA_OK;
}

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
        {(void **)&cm->act16, n * wide * 2}, {(void **)&cm->k16, n * kvd * 2}, {(void **)&cm->v16, n * kvd * 2},
        {(void **)&cm->d_pos, n * sizeof(int32_t)},
    };
    for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
        cudaError_t e_ = cudaMalloc(want[i].p, want[i].bytes);
        if (e_ != cudaSuccess) {
            free_workspace(cm);
            return cuda_failf(err, e_, "activations for %zu tokens", n);
        }
    }
    if (!(cm->h_rows = malloc(n * e * sizeof(float))) || !(cm->h_pos = malloc(n * sizeof(int32_t)))) {
        free_workspace(cm);
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    }
    cm->cap = n;
    return STRATA_OK;
}

static int ensure_items(cuda_model *cm, size_t n, strata_error *err)
{
    if (n <= cm->cap_items)
        return STRATA_OK;
    free_item_buffers(cm);
    const model_config *c = &cm->cfg;
    const size_t L = (size_t)cm->n_local;
    struct { void **d; void **h; size_t bytes; } want[] = {
        {(void **)&cm->head_x, NULL, n * (size_t)c->n_embd * 4},
        {(void **)&cm->logits, (void **)&cm->h_logits, n * (size_t)c->n_vocab * 4},
        /* picked ids, then each row's first non-finite logit: one copy brings both back */
        {(void **)&cm->d_next, (void **)&cm->h_next, 2 * n * sizeof(int32_t)},
        {(void **)&cm->d_sample, (void **)&cm->h_sample, n * sizeof(cuda_sample_row)},
        {(void **)&cm->d_views, (void **)&cm->h_views, L * n * sizeof(cuda_kv_seq)},
        {(void **)&cm->d_append, (void **)&cm->h_append, L * n * sizeof(cuda_kv_append_job)},
        {(void **)&cm->d_encode, (void **)&cm->h_encode, L * n * sizeof(cuda_kv_encode_job)},
        {(void **)&cm->d_shift, (void **)&cm->h_shift, L * n * sizeof(cuda_kv_shift_job)},
    };
    for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
        cudaError_t e_ = cudaMalloc(want[i].d, want[i].bytes);
        if (e_ != cudaSuccess) {
            free_item_buffers(cm);
            return cuda_failf(err, e_, "buffers for %zu sequences", n);
        }
        if (want[i].h && !(*want[i].h = malloc(want[i].bytes))) {
            free_item_buffers(cm);
            return strata_fail(err, STRATA_ENOMEM, "out of memory");
        }
    }
    cm->cap_items = n;
    return STRATA_OK;
}

int cuda_model_reserve_step(cuda_model *cm, size_t rows, size_t items, strata_error *err)
{
    if (!cm || rows == 0 || items == 0)
        return strata_fail(err, STRATA_EINVAL, "cuda_model_reserve_step: a step of %zu tokens over %zu sequences",
                           rows, items);
    int rc = ensure_workspace(cm, rows, err);
    return rc == STRATA_OK ? ensure_items(cm, items, err) : rc;
}

static int ensure_attention_workspace(cuda_model *cm, size_t bytes, strata_error *err)
{
    if (bytes <= cm->ws_bytes)
        return STRATA_OK;
    cudaFree(cm->d_ws);
    cm->d_ws = NULL;
    cm->ws_bytes = 0;
    CU(cudaMalloc(&cm->d_ws, bytes), "attention workspace");
    cm->ws_bytes = bytes;
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

int cuda_seq_check_codec(const kv_codec_params *codec, strata_error *err)
{
    if (!codec)
        return strata_fail(err, STRATA_EINVAL, "no codec");
    (void)err;   /* every codec of this version: fp16, KIVI, GEAR, OTT, TaDA */
    return STRATA_OK;
}

int cuda_seq_check_plan(const kv_codec_params *codecs, int n_layers, strata_error *err)
{
    if (!codecs || n_layers < 1)
        return strata_fail(err, STRATA_EINVAL, "no KV plan");
    for (int l = 0; l < n_layers; l++) {
        int rc = cuda_seq_check_codec(&codecs[l], err);
        if (rc != STRATA_OK)
            return rc;
    }
    /* one window for all layers: blocks then form in every layer at the same step, which the
     * batched decode staging relies on */
    return kv_plan_check_one_window(codecs, n_layers, err);
}

cuda_seq *cuda_seq_create(cuda_model *cm, const kv_codec_params *codec, int block_tokens, size_t max_tokens,
                          strata_error *err)
{
    if (!cm || !codec) {
        strata_fail(err, STRATA_EINVAL, "cuda_seq_create: bad arguments");
        return NULL;
    }
    kv_codec_params *plan = malloc((size_t)cm->n_local * sizeof *plan);
    if (!plan) {
        strata_fail(err, STRATA_ENOMEM, "out of memory");
        return NULL;
    }
    for (int l = 0; l < cm->n_local; l++)
        plan[l] = *codec;
    cuda_seq *s = cuda_seq_create_plan(cm, plan, block_tokens, max_tokens, err);
    free(plan);
    return s;
}

/* Per layer: the codec, its encoders and slot size; the sequence's largest slot, scratch and OTT
 * stride. */
static int init_layers(cuda_seq *s, const kv_codec_params *codecs, const kv_geometry *g, strata_error *err)
{
    const size_t L = (size_t)s->n_layers;
    s->codecs = malloc(L * sizeof *s->codecs);
    s->enc = calloc(L, sizeof *s->enc);
    s->enc_prompt = calloc(L, sizeof *s->enc_prompt);
    s->layer_slot = calloc(L, sizeof *s->layer_slot);
    if (!s->codecs || !s->enc || !s->enc_prompt || !s->layer_slot)
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    for (size_t l = 0; l < L; l++) {
        const kv_codec_params *p = &codecs[l];
        s->codecs[l] = *p;
        int rc = cuda_kv_encoder_init(p, g, &s->enc[l], err);
        if (rc == STRATA_OK && p->codec == KV_CODEC_GEAR)
            rc = cuda_kv_encoder_init_rank(p, g, p->rank_prompt, &s->enc_prompt[l], err);
        if (rc != STRATA_OK)
            return strata_error_prefix(err, "layer %zu", l);
        /* Slots hold the largest block: GEAR's prompt-rank blocks are larger than its decode-rank ones. */
        s->layer_slot[l] = kv_block_size(p, g);
        s->slot = s->layer_slot[l] > s->slot ? s->layer_slot[l] : s->slot;
        const size_t work = (size_t)(s->enc[l].work_bytes > s->enc_prompt[l].work_bytes ? s->enc[l].work_bytes
                                                                                          : s->enc_prompt[l].work_bytes);
        s->work_bytes = work > s->work_bytes ? work : s->work_bytes;
        if (s->enc[l].ott && s->enc[l].ott_state_bytes > s->ott_stride)
            s->ott_stride = (size_t)s->enc[l].ott_state_bytes;
    }
    return STRATA_OK;
}

cuda_seq *cuda_seq_create_plan(cuda_model *cm, const kv_codec_params *codecs, int block_tokens, size_t max_tokens,
                               strata_error *err)
{
    if (!cm || !codecs || block_tokens < 1 || max_tokens < 1) {
        strata_fail(err, STRATA_EINVAL, "cuda_seq_create: bad arguments");
        return NULL;
    }
    if (cuda_seq_check_plan(codecs, cm->n_local, err) != STRATA_OK)
        return NULL;
    const model_config *c = &cm->cfg;
    const kv_geometry g = {.n_layers = cm->n_local, .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim,
                           .block_tokens = block_tokens};
    cuda_seq *s = calloc(1, sizeof *s);
    if (!s) {
        strata_fail(err, STRATA_ENOMEM, "out of memory");
        return NULL;
    }
    s->cm = cm;
    s->n_layers = cm->n_local;
    s->block_tokens = block_tokens;
    s->residual = codecs[0].residual;
    s->max_tokens = max_tokens;
    s->max_blocks = (max_tokens + (size_t)block_tokens - 1) / (size_t)block_tokens;
    s->row = (size_t)c->n_kv_heads * (size_t)c->head_dim;
    int rc = init_layers(s, codecs, &g, err);
    const size_t L = (size_t)s->n_layers, tail_rows = (size_t)(s->residual + block_tokens);
    cudaError_t e = cudaSuccess;
    if (rc == STRATA_OK) {
        s->tail_len = calloc(L, sizeof *s->tail_len);
        s->n_blocks = calloc(L, sizeof *s->n_blocks);
        if (!s->tail_len || !s->n_blocks)
            rc = strata_fail(err, STRATA_ENOMEM, "out of memory");
    }
    if (rc == STRATA_OK && cm->pool) {
        if (s->slot > cm->pool_slot)
            rc = strata_fail(err, STRATA_EINVAL, "the shared KV pool's slots hold %zu bytes; this plan's largest "
                             "blocks need %zu", cm->pool_slot, s->slot);
        else if (!(s->handles = calloc(L * s->max_blocks, sizeof *s->handles)) ||
                 !(s->h_tables = calloc(L * s->max_blocks, sizeof *s->h_tables)) || !(s->row_dirty = calloc(L, 1)))
            rc = strata_fail(err, STRATA_ENOMEM, "out of memory");
        s->owner = ++cm->next_owner;
    }
    if (rc == STRATA_OK && (cm->pool || (e = cudaMalloc((void **)&s->arena, L * s->max_blocks * s->slot)) == cudaSuccess) &&
        (e = cudaMalloc((void **)&s->tail_k, L * tail_rows * s->row * 2)) == cudaSuccess &&
        (e = cudaMalloc((void **)&s->tail_v, L * tail_rows * s->row * 2)) == cudaSuccess &&
        (e = cudaMalloc((void **)&s->d_tables, L * s->max_blocks * sizeof(void *))) == cudaSuccess &&
        s->ott_stride &&
        (e = cudaMalloc((void **)&s->d_ott, L * s->ott_stride)) == cudaSuccess)
        e = cudaMemset(s->d_ott, 0, L * s->ott_stride);   /* empty pools, as the CPU tracker starts */
    if (rc == STRATA_OK && e != cudaSuccess)
        rc = cuda_failf(err, e, "KV cache for %zu tokens", max_tokens);
    /* Own arena: block b of layer l always lives in slot l * max_blocks + b: the tables never
     * change. Shared pool: entries are written as blocks form and move (upload_row). */
    if (rc == STRATA_OK && !cm->pool) {
        const uint8_t **table = malloc(L * s->max_blocks * sizeof *table);
        if (!table)
            rc = strata_fail(err, STRATA_ENOMEM, "out of memory");
        for (size_t i = 0; table && i < L * s->max_blocks; i++)
            table[i] = s->arena + i * s->slot;
        if (table && (e = cudaMemcpy(s->d_tables, table, L * s->max_blocks * sizeof *table, cudaMemcpyHostToDevice)) !=
                         cudaSuccess)
            rc = cuda_fail(err, e, "block tables");
        free(table);
    }
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
    void *bufs[] = {s->arena, s->tail_k, s->tail_v, (void *)(uintptr_t)s->d_tables, s->d_ott};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
        cudaFree(bufs[i]);
    for (size_t i = 0; s->handles && i < (size_t)s->n_layers * s->max_blocks; i++)
        device_pool_free(s->cm->pool, s->handles[i]);   /* 0 (never formed) is ignored */
    free(s->handles);
    free(s->h_tables);
    free(s->row_dirty);
    free(s->tail_len);
    free(s->n_blocks);
    free(s->codecs);
    free(s->enc);
    free(s->enc_prompt);
    free(s->layer_slot);
    free(s);
}

size_t cuda_seq_length(const cuda_seq *s) { return s ? s->len : 0; }

uint16_t *cuda_seq_tail_at(const cuda_seq *s, uint16_t *base, int layer, size_t token)
{
    return base + ((size_t)layer * (size_t)(s->residual + s->block_tokens) + token) * s->row;
}

/* Block b holds only prompt tokens (they came in multi-token appends). */
static bool prompt_block(const cuda_seq *s, size_t b) { return (b + 1) * (size_t)s->block_tokens <= s->prompt_end; }

/* The encoder of block b of a layer: GEAR blocks made only of prompt tokens take the prompt rank
 * (the CPU pool's rule), every other block the layer's own. */
static const cuda_kv_encoder *block_encoder(const cuda_seq *s, int layer, size_t b)
{
    return s->codecs[layer].codec == KV_CODEC_GEAR && prompt_block(s, b) ? &s->enc_prompt[layer] : &s->enc[layer];
}

/* A layer's OTT tracker on the device, or NULL when the layer's codec has none. */
static void *ott_state(const cuda_seq *s, int layer)
{
    return s->enc[layer].ott ? s->d_ott + (size_t)layer * s->ott_stride : NULL;
}

/* Where block b of a layer is written: its slot in the sequence's arena, or a new block of the
 * shared pool (pinned until the layer ends; the table entry is uploaded before the layer's next
 * attention). */
int cuda_seq_new_block(cuda_seq *s, int layer, size_t b, uint8_t **dst, strata_error *err)
{
    const size_t i = (size_t)layer * s->max_blocks + b;
    if (!s->cm->pool) {
        *dst = s->arena + i * s->slot;
        return STRATA_OK;
    }
    void *addr = NULL;
    int rc = device_pool_alloc(s->cm->pool, s->owner, &s->handles[i], &addr, err);
    if (rc != STRATA_OK)
        return strata_error_prefix(err, "layer %d block %zu", layer, b);
    *dst = addr;
    s->h_tables[i] = addr;
    s->row_dirty[layer] = 1;
    return STRATA_OK;
}

/* One layer's row of a sequence's block table, n entries, to the device if it changed. */
static int upload_row(cuda_seq *s, int layer, size_t n, strata_error *err)
{
    if (!s->row_dirty[layer] || n == 0)
        return STRATA_OK;
    const size_t at = (size_t)layer * s->max_blocks;
    int rc = cuda_uploads_copy(&s->cm->uploads, (void *)(uintptr_t)(s->d_tables + at), s->h_tables + at,
                               n * sizeof(void *), "block table", err);
    if (rc != STRATA_OK)
        return rc;
    s->row_dirty[layer] = 0;
    return STRATA_OK;
}

/* Decode items whose sequences share a KV plan (per-request codecs: a step may hold several):
 * one encoder launch, one tail move and one attention launch per layer each. */
typedef struct dec_group {
    size_t begin, end;       /* its decode items: internal positions [begin, end) */
    size_t full_begin;       /* its forming blocks' jobs in a layer's slice: [full_begin, + n_full) */
    size_t n_full;           /* decode items whose tail fills this step (a block forms) */
    size_t n_full_prompt;    /* of those, GEAR blocks at the prompt rank (their jobs come first) */
    int max_blocks;          /* the most blocks a sequence of the group has after the step */
    cuda_kv_plan attn;       /* its attention launch */
} dec_group;

/* One step's plan: items reordered so that the decode items (one token on a non-empty sequence)
 * come first, group by group, their rows contiguous for the batched attention, then the prompts. */
typedef struct step_plan {
    size_t n_items, n_dec, rows;
    size_t *order;     /* internal position -> caller's item index */
    size_t *row0;      /* internal position -> first row */
    dec_group *groups;
    size_t n_groups;
    size_t n_full;     /* forming blocks of every group */
    size_t work;       /* encoder scratch per forming block (the groups' largest) */
    cuda_seq **full_seq;   /* shared pool: the sequence of each forming block, in the jobs' order */
} step_plan;

/* Whether two sequences' blocks are made and read alike: the same block size and, layer by
 * layer, the same codec (compared field by field: the structs may hold padding). */
static bool same_codec(const kv_codec_params *a, const kv_codec_params *b)
{
    return a->codec == b->codec && a->bits == b->bits && a->group == b->group && a->residual == b->residual &&
           a->rank_prompt == b->rank_prompt && a->rank_decode == b->rank_decode && a->power_iters == b->power_iters &&
           a->sparse_pct == b->sparse_pct && a->pool_tokens == b->pool_tokens && a->aux_tokens == b->aux_tokens;
}

static bool same_plan(const cuda_seq *a, const cuda_seq *b)
{
    if (a->block_tokens != b->block_tokens || a->n_layers != b->n_layers)
        return false;
    for (int l = 0; l < a->n_layers; l++)
        if (!same_codec(&a->codecs[l], &b->codecs[l]))
            return false;
    return true;
}

/* Every item on its own, and no sequence twice; *bad: the first item at fault. */
static int check_items(cuda_model *cm, const cuda_batch_item *items, size_t n_items, size_t *bad, strata_error *err)
{
    cm->step++;   /* a fresh mark for this step's sequences (never 0: new sequences start at 0) */
    for (size_t i = 0; i < n_items; i++) {
        const cuda_batch_item *it = &items[i];
        *bad = i;
        if (!it->seq || it->seq->cm != cm || (!it->tokens && cm->first) || it->n_tokens == 0)
            return strata_fail(err, STRATA_EINVAL, "batch item %zu: no sequence of this model, or no tokens", i);
        const cuda_seq *s = it->seq;
        if (it->n_tokens > s->max_tokens - s->len)
            return strata_fail(err, STRATA_EINVAL, "batch item %zu: %zu tokens after %zu exceed the sequence's %zu", i,
                               it->n_tokens, s->len, s->max_tokens);
        if (it->n_tokens > 65535)
            return strata_fail(err, STRATA_EINVAL, "batch item %zu: %zu tokens in one step (at most 65535)", i,
                               it->n_tokens);
        for (size_t t = 0; it->tokens && t < it->n_tokens; t++)
            if (it->tokens[t] < 0 || it->tokens[t] >= cm->cfg.n_vocab)
                return strata_fail(err, STRATA_EINVAL, "batch item %zu: token %d out of range 0..%d", i,
                                   (int)it->tokens[t], cm->cfg.n_vocab - 1);
        if (s->seen_in_step == cm->step)
            return strata_fail(err, STRATA_EINVAL, "batch item %zu: a sequence named twice in one step", i);
        it->seq->seen_in_step = cm->step;
    }
    *bad = n_items;
    return STRATA_OK;
}

/* Host side of the decode items' KV for every layer: append jobs, the blocks that form, the
 * tail moves, and the attention views after the append; uploaded in four copies. */
static int ensure_encoder_scratch(cuda_model *cm, size_t bytes, strata_error *err);

static int stage_decode_jobs(cuda_model *cm, const cuda_batch_item *items, step_plan *sp, strata_error *err)
{
    const size_t L = (size_t)cm->n_local, nd = sp->n_dec;
    size_t n_full = 0;
    /* The full tails first: how many blocks form in each group, and how many of them at GEAR's
     * prompt rank; each group's jobs take the next stretch of a layer's slice. */
    sp->work = 0;
    for (size_t g = 0; g < sp->n_groups; g++) {
        dec_group *G = &sp->groups[g];
        G->full_begin = n_full;
        G->n_full = G->n_full_prompt = 0;
        G->max_blocks = 0;
        for (size_t j = G->begin; j < G->end; j++) {
            const cuda_seq *s = items[sp->order[j]].seq;
            if (s->tail_len[0] + 1 == s->residual + s->block_tokens) {
                G->n_full++;
                G->n_full_prompt += prompt_block(s, (size_t)s->n_blocks[0]);
            }
            sp->work = s->work_bytes > sp->work ? s->work_bytes : sp->work;
        }
        n_full += G->n_full;
    }
    const size_t work = sp->work;
    int rc = ensure_encoder_scratch(cm, n_full * work, err);
    if (rc != STRATA_OK)
        return rc;
    if (cm->pool && n_full && !(sp->full_seq = malloc(n_full * sizeof *sp->full_seq)))
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    for (size_t g = 0; g < sp->n_groups; g++) {
        dec_group *G = &sp->groups[g];
        size_t at_prompt = G->full_begin, at_decode = G->full_begin + G->n_full_prompt;   /* where its jobs go */
        for (size_t j = G->begin; j < G->end; j++) {
            cuda_seq *s = items[sp->order[j]].seq;
            const int full = s->tail_len[0] + 1 == s->residual + s->block_tokens;
            const int blocks_after = s->n_blocks[0] + full, tail_after = full ? s->residual : s->tail_len[0] + 1;
            if (full && (size_t)s->n_blocks[0] >= s->max_blocks)
                return strata_fail(err, STRATA_EFULL, "sequence at %zu tokens: no block slot left", s->len);
            if (blocks_after > G->max_blocks)
                G->max_blocks = blocks_after;
            size_t slot_in_layer = 0;
            if (full)
                slot_in_layer = prompt_block(s, (size_t)s->n_blocks[0]) ? at_prompt++ : at_decode++;
            for (size_t l = 0; l < L; l++) {
                const int il = (int)l;
                cm->h_append[l * nd + j] = (cuda_kv_append_job){
                    .dst_k = cuda_seq_tail_at(s, s->tail_k, il, (size_t)s->tail_len[0]),
                    .dst_v = cuda_seq_tail_at(s, s->tail_v, il, (size_t)s->tail_len[0]),
                    .src_row = (int)j,
                    .n_rows = 1,
                };
                cm->h_views[l * nd + j] = (cuda_kv_seq){
                    .blocks = s->d_tables + l * s->max_blocks,
                    .tail_k = cuda_seq_tail_at(s, s->tail_k, il, 0),
                    .tail_v = cuda_seq_tail_at(s, s->tail_v, il, 0),
                    .n_blocks = blocks_after,
                    .tail_tokens = tail_after,
                };
                if (!full)
                    continue;
                /* Shared pool: the slot is taken when the layer runs (acquire_layer). */
                uint8_t *dst = NULL;
                if (!cm->pool) {
                    if ((rc = cuda_seq_new_block(s, il, (size_t)s->n_blocks[0], &dst, err)) != STRATA_OK)
                        return rc;
                } else if (l == 0) {
                    sp->full_seq[slot_in_layer] = s;
                }
                cm->h_encode[l * nd + slot_in_layer] = (cuda_kv_encode_job){
                    .k = cuda_seq_tail_at(s, s->tail_k, il, 0),
                    .v = cuda_seq_tail_at(s, s->tail_v, il, 0),
                    .dst = dst,
                    .first_pos = (uint64_t)s->n_blocks[0] * (uint64_t)s->block_tokens,
                    .layer = (uint32_t)l,
                    .work = work ? cm->d_gear_work + slot_in_layer * work : NULL,
                    .ott_state = ott_state(s, il),
                };
                cm->h_shift[l * nd + slot_in_layer] = (cuda_kv_shift_job){cuda_seq_tail_at(s, s->tail_k, il, 0),
                                                                          cuda_seq_tail_at(s, s->tail_v, il, 0)};
            }
        }
    }
    sp->n_full = n_full;
    if (nd == 0)
        return STRATA_OK;
    CU(cudaMemcpy(cm->d_append, cm->h_append, L * nd * sizeof *cm->h_append, cudaMemcpyHostToDevice), "append jobs");
    CU(cudaMemcpy(cm->d_views, cm->h_views, L * nd * sizeof *cm->h_views, cudaMemcpyHostToDevice), "views");
    if (n_full && !cm->pool) {   /* shared pool: per layer, once the new blocks have slots */
        /* Jobs of layer l start at l * nd: copy the whole strided arrays. */
        CU(cudaMemcpy(cm->d_encode, cm->h_encode, L * nd * sizeof *cm->h_encode, cudaMemcpyHostToDevice), "encoder jobs");
    }
    if (n_full) {
        CU(cudaMemcpy(cm->d_shift, cm->h_shift, L * nd * sizeof *cm->h_shift, cudaMemcpyHostToDevice), "tail jobs");
    }
    return STRATA_OK;
}

/* Room for n blocks in the acquire arrays. */
static int ensure_acquire(cuda_model *cm, size_t n, strata_error *err)
{
    if (n <= cm->cap_acquire)
        return STRATA_OK;
    device_block *h = realloc(cm->h_acquire, n * sizeof *h);
    if (h)
        cm->h_acquire = h;
    void **a = h ? realloc(cm->h_addrs, n * sizeof *a) : NULL;
    if (!h || !a)
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    cm->h_addrs = a;
    cm->cap_acquire = n;
    return STRATA_OK;
}

/* Shared pool, before a layer's decode attention: the layer's blocks of every decoding sequence
 * resident and pinned until the layer ends (blocks of other layers and sequences may move down to
 * make room), the blocks forming in this step allocated, and the tables of that layer current on
 * the device. Then the encoder jobs of the layer, which name the new blocks, go up. */
static int acquire_layer(cuda_model *cm, const cuda_batch_item *items, const step_plan *sp, int il,
                         strata_error *err)
{
    const size_t nd = sp->n_dec, l = (size_t)il;
    size_t n = 0;
    for (size_t j = 0; j < nd; j++)
        n += (size_t)items[sp->order[j]].seq->n_blocks[0];
    int rc = ensure_acquire(cm, n, err);
    if (rc != STRATA_OK)
        return rc;
    size_t at = 0;
    for (size_t j = 0; j < nd; j++) {
        const cuda_seq *s = items[sp->order[j]].seq;
        for (int b = 0; b < s->n_blocks[0]; b++)
            cm->h_acquire[at++] = s->handles[l * s->max_blocks + (size_t)b];
    }
    rc = device_pool_acquire(cm->pool, cm->h_acquire, n, cm->h_addrs, err);
    if (rc != STRATA_OK)
        return rc;
    at = 0;
    for (size_t j = 0; j < nd; j++) {
        cuda_seq *s = items[sp->order[j]].seq;
        for (int b = 0; b < s->n_blocks[0]; b++, at++) {
            const size_t i = l * s->max_blocks + (size_t)b;
            if (s->h_tables[i] != cm->h_addrs[at]) {
                s->h_tables[i] = cm->h_addrs[at];
                s->row_dirty[il] = 1;
            }
        }
    }
    for (size_t f = 0; f < sp->n_full; f++) {   /* the blocks this step forms, in the jobs' order */
        cuda_seq *s = sp->full_seq[f];
        uint8_t *dst = NULL;
        if ((rc = cuda_seq_new_block(s, il, (size_t)s->n_blocks[0], &dst, err)) != STRATA_OK)
            return rc;
        cm->h_encode[l * nd + f].dst = dst;
    }
    for (size_t j = 0; j < nd; j++) {
        cuda_seq *s = items[sp->order[j]].seq;
        const int full = s->tail_len[0] + 1 == s->residual + s->block_tokens;
        if ((rc = upload_row(s, il, (size_t)s->n_blocks[0] + (size_t)full, err)) != STRATA_OK)
            return rc;
    }
    if (sp->n_full)
        return cuda_uploads_copy(&cm->uploads, cm->d_encode + l * nd, cm->h_encode + l * nd,
                                 sp->n_full * sizeof *cm->h_encode, "encoder jobs", err);
    return STRATA_OK;
}

/* The decode items' K/V of one layer into their tails (one launch), then group by group the
 * blocks that fill and attention over every decode item's cache of the group at once. */
static int decode_layer(cuda_model *cm, const cuda_batch_item *items, const step_plan *sp, int il, strata_error *err)
{
    const size_t nd = sp->n_dec, l = (size_t)il, e = (size_t)cm->cfg.n_embd;
    if (cm->pool) {
        cuda_phase_mark(cm->phases, CUDA_PHASE_KV_FETCH);
        int rc = acquire_layer(cm, items, sp, il, err);
        if (rc != STRATA_OK)
            return rc;
    }
    cuda_phase_mark(cm->phases, CUDA_PHASE_KV_APPEND);
    const size_t row = items[sp->order[0]].seq->row;   /* the model's: every sequence's */
    KERNEL(cuda_kv_append_rows(cm->d_append + l * nd, (int)nd, cm->k16, cm->v16, row, NULL), "appending K/V");
    for (size_t g = 0; g < sp->n_groups; g++) {
        const dec_group *G = &sp->groups[g];
        const cuda_seq *s0 = items[sp->order[G->begin]].seq;
        if (G->n_full) {
            /* The jobs of blocks made only of prompt tokens come first: on a GEAR layer they take
             * the prompt-rank encoder, on any other layer the layer's one encoder takes them all. */
            if (g > 0)   /* back from the group before's attention */
                cuda_phase_mark(cm->phases, CUDA_PHASE_KV_APPEND);
            const cuda_kv_encode_job *jobs = cm->d_encode + l * nd + G->full_begin;
            const size_t np = s0->codecs[l].codec == KV_CODEC_GEAR ? G->n_full_prompt : 0;
            int rc = np ? cuda_kv_encode_blocks(&s0->enc_prompt[l], jobs, (int)np, NULL, err) : STRATA_OK;
            if (rc == STRATA_OK && G->n_full > np)
                rc = cuda_kv_encode_blocks(&s0->enc[l], jobs + np, (int)(G->n_full - np), NULL, err);
            if (rc != STRATA_OK)
                return rc;
            KERNEL(cuda_kv_shift_tails(cm->d_shift + l * nd + G->full_begin, (int)G->n_full, s0->block_tokens,
                                       s0->residual, s0->row, NULL),
                   "moving tails");
        }
        cuda_kv_layout layout = s0->enc[l].layout;
        layout.layer = (uint32_t)il;
        layout.block_bytes = (uint32_t)s0->layer_slot[l];   /* GEAR: prompt-rank blocks are the larger ones */
        if (g == 0 || G->n_full)
            cuda_phase_mark(cm->phases, CUDA_PHASE_DECODE_ATTN);
        /* Decode item j's query and output are row j (decode rows come first). */
        int rc = cuda_kv_attention(&layout, &G->attn, cm->d_views + l * nd + G->begin, cm->q + G->begin * e,
                                   cm->attn + G->begin * e, cm->d_ws, cm->d_status, NULL, err);
        if (rc != STRATA_OK)
            return rc;
    }
    return STRATA_OK;
}

/* The tile of a sequence's past that a prompt chunk reads at a time: cm->chunk_tile_keys keys,
 * whole blocks (at least one). */
static int chunk_tile(const cuda_model *cm, const cuda_seq *s)
{
    const int bt = s->block_tokens, keys = cm->chunk_tile_keys > bt ? cm->chunk_tile_keys : bt;
    return keys / bt * bt;
}

/* A chunk's past, one tile of fp32 rows at a time (cuda_attention_chunk_gemm's callback). */
typedef struct chunk_past {
    const cuda_kv_layout *layout;
    const cuda_kv_seq *view;
    int *d_status;
} chunk_past;

static int chunk_past_rows(void *ctx, int k0, int nk, float *d_k, float *d_v, strata_cuda_stream stream,
                           strata_error *err)
{
    const chunk_past *p = ctx;
    return cuda_kv_dequantize_rows(p->layout, p->view, k0, nk, d_k, d_v, p->d_status, stream, err);
}

/* A prompt chunk continuing s, one layer: its rows attend the layer's blocks and tail as they were
 * before the chunk (written out as fp32 rows a tile at a time), then the chunk's own rows (k, v:
 * fp32 at fp16 values), causal: kern_kv_attention_rows's semantics, the CPU stage's. The chunk
 * joins the cache afterwards (append_prompts_layer). Shared pool: the layer's blocks are brought
 * back and pinned first, and the table row uploaded. */
static int chunk_layer(cuda_model *cm, cuda_seq *s, int il, const float *q, const float *k, const float *v, size_t n,
                       float *attn, strata_error *err)
{
    const size_t l = (size_t)il, nb = (size_t)s->n_blocks[il];
    int rc = STRATA_OK;
    if (cm->pool && nb) {
        cuda_phase_mark(cm->phases, CUDA_PHASE_KV_FETCH);
        if ((rc = ensure_acquire(cm, nb, err)) != STRATA_OK)
            return rc;
        for (size_t b = 0; b < nb; b++)
            cm->h_acquire[b] = s->handles[l * s->max_blocks + b];
        if ((rc = device_pool_acquire(cm->pool, cm->h_acquire, nb, cm->h_addrs, err)) != STRATA_OK)
            return rc;
        for (size_t b = 0; b < nb; b++)
            if (s->h_tables[l * s->max_blocks + b] != cm->h_addrs[b]) {
                s->h_tables[l * s->max_blocks + b] = cm->h_addrs[b];
                s->row_dirty[il] = 1;
            }
        if ((rc = upload_row(s, il, nb, err)) != STRATA_OK)
            return rc;
    }
    cuda_kv_layout layout = s->enc[il].layout;
    layout.layer = (uint32_t)il;
    layout.block_bytes = (uint32_t)s->layer_slot[il];
    const cuda_kv_seq view = {
        .blocks = s->d_tables + l * s->max_blocks,
        .tail_k = cuda_seq_tail_at(s, s->tail_k, il, 0),
        .tail_v = cuda_seq_tail_at(s, s->tail_v, il, 0),
        .n_blocks = (int)nb,
        .tail_tokens = s->tail_len[il],
    };
    const size_t past = nb * (size_t)layout.block_tokens + (size_t)view.tail_tokens;
    if (past != s->len)
        return strata_fail(err, STRATA_EINVAL, "layer %d holds %zu positions, the sequence %zu", il, past, s->len);
    chunk_past p = {&layout, &view, cm->d_status};
    cuda_phase_mark(cm->phases, CUDA_PHASE_CHUNK_ATTN);
    return cuda_attention_chunk_gemm(cm->blas, q, (int)past, chunk_past_rows, &p, k, v, (int)n, cm->cfg.n_heads,
                                     cm->cfg.n_kv_heads, cm->cfg.head_dim, chunk_tile(cm, s), attn, cm->d_ws,
                                     cm->ws_bytes, err);
}

/* Room for `bytes` of encoder scratch (GEAR, OTT: work_bytes for each block encoded in one launch). */
static int ensure_encoder_scratch(cuda_model *cm, size_t bytes, strata_error *err)
{
    if (bytes <= cm->gear_work_bytes)
        return STRATA_OK;
    cudaFree(cm->d_gear_work);
    cm->d_gear_work = NULL;
    cm->gear_work_bytes = 0;
    CU(cudaMalloc((void **)&cm->d_gear_work, bytes), "encoder scratch");
    cm->gear_work_bytes = bytes;
    return STRATA_OK;
}

/* Room for a layer's multi-token appends: n_jobs blocks, n_items tails, stream_elems fp16 values
 * of chunk streams. */
static int ensure_prompt_appends(cuda_model *cm, size_t n_jobs, size_t n_items, size_t stream_elems, strata_error *err)
{
    if (n_jobs > cm->cap_pencode) {
        cudaFree(cm->d_pencode);
        cm->d_pencode = NULL;
        cm->cap_pencode = 0;
        cuda_kv_encode_job *h = realloc(cm->h_pencode, n_jobs * sizeof *h);
        if (!h)
            return strata_fail(err, STRATA_ENOMEM, "out of memory");
        cm->h_pencode = h;
        CU(cudaMalloc((void **)&cm->d_pencode, n_jobs * sizeof *h), "encoder jobs");
        cm->cap_pencode = n_jobs;
    }
    if (n_items > cm->cap_ptail) {
        cudaFree(cm->d_ptail);
        cm->d_ptail = NULL;
        cm->cap_ptail = 0;
        cuda_kv_append_job *h = realloc(cm->h_ptail, n_items * sizeof *h);
        const uint16_t **k = h ? realloc(cm->h_stream_k, n_items * sizeof *k) : NULL;
        if (k)
            cm->h_stream_k = k;
        const uint16_t **v = k ? realloc(cm->h_stream_v, n_items * sizeof *v) : NULL;
        if (h)
            cm->h_ptail = h;
        if (!v)
            return strata_fail(err, STRATA_ENOMEM, "out of memory");
        cm->h_stream_v = v;
        CU(cudaMalloc((void **)&cm->d_ptail, n_items * sizeof *h), "tail jobs");
        cm->cap_ptail = n_items;
    }
    if (stream_elems > cm->stream_cap) {
        cudaFree(cm->d_stream);
        cm->d_stream = NULL;
        cm->stream_cap = 0;
        CU(cudaMalloc((void **)&cm->d_stream, stream_elems * sizeof(uint16_t)), "prompt chunks' rows");
        cm->stream_cap = stream_elems;
    }
    return STRATA_OK;
}

/* How many blocks a layer forms when n rows join a tail of t0 rows: each time the tail reaches
 * R + block_tokens its oldest block_tokens rows become a block (the CPU pool's rule,
 * kv_seq_append), so with the tail and the new rows as one stream, block j is the stream's rows
 * [j * block_tokens, (j + 1) * block_tokens) and the tail keeps what follows the last. */
static size_t blocks_forming(const cuda_seq *s, size_t t0, size_t n)
{
    const size_t r = (size_t)s->residual, bt = (size_t)s->block_tokens;
    return t0 + n >= r + bt ? (t0 + n - r) / bt : 0;
}

/* With the shared pool, the items' room together (device_room): in each layer a decode token or a
 * later chunk pins the layer's blocks, and every item allocates the blocks it forms, all pinned
 * until the layer ends (run_layer). *bad: the first item that does not fit beside those before. */
static int check_room(const cuda_model *cm, const cuda_batch_item *items, size_t n_items, size_t *bad,
                      strata_error *err)
{
    *bad = n_items;
    if (!cm->pool)
        return STRATA_OK;   /* a sequence's own arena holds its max_tokens: check_items */
    device_room *room = device_room_begin(cm->pool, err);
    if (!room)
        return err ? err->code : STRATA_ENOMEM;
    int rc = STRATA_OK;
    for (size_t i = 0; i < n_items && rc == STRATA_OK; i++) {
        const cuda_seq *s = items[i].seq;
        const size_t pinned = s->len > 0 ? (size_t)s->n_blocks[0] : 0;
        const size_t forming = blocks_forming(s, (size_t)s->tail_len[0], items[i].n_tokens);
        rc = device_room_add(room, s->handles, s->max_blocks, (size_t)s->n_layers, pinned, forming, err);
        if (rc != STRATA_OK) {
            *bad = i;
            strata_error_prefix(err, "batch item %zu (%zu tokens after %zu)", i, items[i].n_tokens, s->len);
        }
    }
    device_room_end(room);
    return rc;
}

int cuda_model_batch_check(cuda_model *cm, const cuda_batch_item *items, size_t n_items, size_t *bad_item,
                           strata_error *err)
{
    size_t bad = n_items;
    int rc = !cm || !items || n_items == 0 || n_items > 65535
                 ? strata_fail(err, STRATA_EINVAL, "cuda_model_batch_check: 1..65535 items")
                 : check_items(cm, items, n_items, &bad, err);
    if (rc == STRATA_OK)
        rc = check_room(cm, items, n_items, &bad, err);
    if (bad_item)
        *bad_item = bad;
    return rc;
}

/* Encoder scratch the step's prompts and chunks need in each layer: a slot for every item that
 * forms a block (a round's launch holds at most one block of each), of the largest work size.
 * The same in every layer (their tails are equal between steps). */
static size_t prompt_scratch_bytes(const cuda_batch_item *items, const step_plan *sp)
{
    size_t widest = 0, work = 0;
    for (size_t p = sp->n_dec; p < sp->n_items; p++) {
        const cuda_batch_item *it = &items[sp->order[p]];
        if (blocks_forming(it->seq, (size_t)it->seq->tail_len[0], it->n_tokens) == 0)
            continue;
        widest++;
        work = it->seq->work_bytes > work ? it->seq->work_bytes : work;
    }
    return widest * work;
}

/* The multi-token items of a step (prompts, and chunks continuing a sequence) join one layer's
 * cache, after their attention: every block they form is encoded straight from its rows, in one
 * launch per round (round j: the j-th block of each item, so an OTT tracker sees its sequence's
 * blocks in order and no launch names a tracker twice), and each item's last rows go to its
 * tail in one launch. A prompt's stream is its rows in the step; a chunk's is its tail followed
 * by its rows, copied together first (the tail is rewritten). The jobs go up once per layer:
 * forming blocks one by one synchronized the host with the device at every block and ran the
 * encoder one thread block at a time. */
static int append_prompts_layer(cuda_model *cm, const cuda_batch_item *items, const step_plan *sp, int il,
                                strata_error *err)
{
    const size_t n_items = sp->n_items - sp->n_dec;
    if (n_items == 0)
        return STRATA_OK;
    cuda_phase_mark(cm->phases, CUDA_PHASE_PROMPT_BLOCKS);
    const cuda_seq *s0 = items[sp->order[sp->n_dec]].seq;
    const size_t row = s0->row;   /* the model's: every sequence's */
    size_t n_jobs = 0, rounds = 0, widest = 0, stream_rows = 0, n_fresh = 0, work = 0;
    for (size_t p = sp->n_dec; p < sp->n_items; p++) {
        const cuda_batch_item *it = &items[sp->order[p]];
        const size_t t0 = (size_t)it->seq->tail_len[il], nb = blocks_forming(it->seq, t0, it->n_tokens);
        if (nb && it->seq->work_bytes > work)   /* as prompt_scratch_bytes counts it */
            work = it->seq->work_bytes;
        n_jobs += nb;
        rounds = nb > rounds ? nb : rounds;
        widest += nb > 0;
        stream_rows += t0 ? t0 + it->n_tokens : 0;
        n_fresh += t0 == 0;
    }
    int rc = ensure_prompt_appends(cm, n_jobs, n_items, 2 * stream_rows * row, err);
    if (rc != STRATA_OK)
        return rc;
    /* Reserved by forward_batch before the decode jobs took their scratch slots: growing it here
     * would free the buffer those jobs point into. */
    if (widest * work > cm->gear_work_bytes)
        return strata_fail(err, STRATA_EINVAL, "layer %d: the prompts' encoder scratch (%zu bytes) was not reserved "
                           "before the step", il, widest * work);
    /* Streams and tails: items whose tail is empty first (their rows are in cm->k16/v16), then
     * the chunks (their streams in cm->d_stream, keys then values). */
    uint16_t *stream_k = cm->d_stream;   /* NULL with no chunk: then no offset (NULL + 0 is UB) */
    uint16_t *stream_v = stream_k ? stream_k + stream_rows * row : NULL;
    size_t fresh_at = 0, chunk_at = n_fresh, at_row = 0;
    for (size_t p = sp->n_dec; p < sp->n_items; p++) {
        const cuda_batch_item *it = &items[sp->order[p]];
        cuda_seq *s = it->seq;
        const size_t i = p - sp->n_dec, t0 = (size_t)s->tail_len[il], n = it->n_tokens, r0 = sp->row0[p];
        const size_t keep_from = blocks_forming(s, t0, n) * (size_t)s->block_tokens;   /* the rows the tail keeps */
        uint16_t *tk = cuda_seq_tail_at(s, s->tail_k, il, 0), *tv = cuda_seq_tail_at(s, s->tail_v, il, 0);
        if (t0 == 0) {
            cm->h_stream_k[i] = cm->k16 + r0 * row;
            cm->h_stream_v[i] = cm->v16 + r0 * row;
            cm->h_ptail[fresh_at++] = (cuda_kv_append_job){tk, tv, (int)(r0 + keep_from), (int)(n - keep_from)};
            continue;
        }
        uint16_t *k = stream_k + at_row * row, *v = stream_v + at_row * row;
        CU(cudaMemcpyAsync(k, tk, t0 * row * 2, cudaMemcpyDeviceToDevice, NULL), "a chunk's stream");
        CU(cudaMemcpyAsync(v, tv, t0 * row * 2, cudaMemcpyDeviceToDevice, NULL), "a chunk's stream");
        CU(cudaMemcpyAsync(k + t0 * row, cm->k16 + r0 * row, n * row * 2, cudaMemcpyDeviceToDevice, NULL),
           "a chunk's stream");
        CU(cudaMemcpyAsync(v + t0 * row, cm->v16 + r0 * row, n * row * 2, cudaMemcpyDeviceToDevice, NULL),
           "a chunk's stream");
        cm->h_stream_k[i] = k;
        cm->h_stream_v[i] = v;
        cm->h_ptail[chunk_at++] = (cuda_kv_append_job){tk, tv, (int)(at_row + keep_from), (int)(t0 + n - keep_from)};
        at_row += t0 + n;
    }
    /* The blocks, round by round, and within a round one launch per codec of the layer (requests
     * may use their own plans); each job's scratch is its slot in its launch. Every block a
     * multi-token append forms ends before the append's end (prompt_end), so a launch's encoder
     * is its first block's (block_encoder: on a GEAR layer the prompt rank). */
    struct launch { size_t end; const cuda_kv_encoder *enc; } *launch = malloc((n_jobs + 1) * sizeof *launch);
    bool *placed = malloc(n_items * sizeof *placed);
    if (!launch || !placed) {
        free(launch);
        free(placed);
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    }
    size_t at = 0, n_launch = 0;
    for (size_t j = 0; j < rounds && rc == STRATA_OK; j++) {
        for (size_t i = 0; i < n_items; i++) {
            const cuda_batch_item *it = &items[sp->order[sp->n_dec + i]];
            placed[i] = blocks_forming(it->seq, (size_t)it->seq->tail_len[il], it->n_tokens) <= j;   /* none */
        }
        for (size_t first = 0; first < n_items && rc == STRATA_OK; first++) {
            if (placed[first])
                continue;
            const cuda_seq *lead = items[sp->order[sp->n_dec + first]].seq;
            size_t slot = 0;
            for (size_t i = first; i < n_items && rc == STRATA_OK; i++) {
                cuda_seq *s = items[sp->order[sp->n_dec + i]].seq;
                if (placed[i] || s->block_tokens != lead->block_tokens || !same_codec(&s->codecs[il], &lead->codecs[il]))
                    continue;
                placed[i] = true;
                const size_t bt = (size_t)s->block_tokens, b = (size_t)s->n_blocks[il] + j;
                uint8_t *dst = NULL;
                if (b >= s->max_blocks) {
                    rc = strata_fail(err, STRATA_EFULL, "layer %d: no block slot left", il);
                    break;
                }
                if ((rc = cuda_seq_new_block(s, il, b, &dst, err)) != STRATA_OK)
                    break;
                if (slot == 0)
                    launch[n_launch].enc = block_encoder(s, il, b);
                cm->h_pencode[at++] = (cuda_kv_encode_job){
                    .k = cm->h_stream_k[i] + j * bt * row,
                    .v = cm->h_stream_v[i] + j * bt * row,
                    .dst = dst,
                    .first_pos = (uint64_t)b * bt,
                    .layer = (uint32_t)il,
                    .work = work ? cm->d_gear_work + slot * work : NULL,
                    .ott_state = ott_state(s, il),
                };
                slot++;
            }
            if (slot)
                launch[n_launch++].end = at;
        }
    }
    free(placed);
    /* Through the step's pinned staging, as the decode jobs go: a copy from pageable memory would
     * wait for the device to finish the layers before, every layer of a step with a prompt. */
    if (rc == STRATA_OK && n_jobs)
        rc = cuda_uploads_copy(&cm->uploads, cm->d_pencode, cm->h_pencode, n_jobs * sizeof *cm->h_pencode,
                               "prompt encoder jobs", err);
    if (rc == STRATA_OK)
        rc = cuda_uploads_copy(&cm->uploads, cm->d_ptail, cm->h_ptail, n_items * sizeof *cm->h_ptail,
                               "prompt tail jobs", err);
    for (size_t k = 0, from = 0; k < n_launch && rc == STRATA_OK; from = launch[k++].end)
        rc = cuda_kv_encode_blocks(launch[k].enc, cm->d_pencode + from, (int)(launch[k].end - from), NULL, err);
    free(launch);
    if (rc != STRATA_OK)
        return rc;
    KERNEL(cuda_kv_append_rows(cm->d_ptail, (int)n_fresh, cm->k16, cm->v16, row, NULL), "prompt tails");
    KERNEL(cuda_kv_append_rows(cm->d_ptail + n_fresh, (int)(n_items - n_fresh), stream_k, stream_v, row, NULL),
           "chunk tails");
    for (size_t p = sp->n_dec; p < sp->n_items; p++) {
        cuda_seq *s = items[sp->order[p]].seq;
        const size_t t0 = (size_t)s->tail_len[il], n = items[sp->order[p]].n_tokens, nb = blocks_forming(s, t0, n);
        s->n_blocks[il] += (int)nb;
        s->tail_len[il] = (int)(t0 + n - nb * (size_t)s->block_tokens);
    }
    return STRATA_OK;
}

static int run_layer(cuda_model *cm, const cuda_batch_item *items, const step_plan *sp, int il, strata_error *err)
{
    const model_config *c = &cm->cfg;
    const cuda_layer *L = &cm->layers[il];
    const size_t T = sp->rows, e = (size_t)c->n_embd, hd = (size_t)c->head_dim, kvd = (size_t)c->n_kv_heads * hd;
    const size_t ff = (size_t)c->n_ff;
    int rc;
    cuda_phase_mark(cm->phases, CUDA_PHASE_QKV);
    KERNEL(cuda_rmsnorm(cm->x, L->attn_norm, T, e, c->rms_eps, cm->xn, NULL), "rmsnorm");
    if ((rc = gemm(cm, cm->xn, T, e, L->wq, e, cm->q, err)) || (rc = gemm(cm, cm->xn, T, e, L->wk, kvd, cm->k, err)) ||
        (rc = gemm(cm, cm->xn, T, e, L->wv, kvd, cm->v, err)))
        return rc;
    KERNEL(cuda_rope_rows(cm->q, T, (size_t)c->n_heads, hd, cm->d_pos, c->rope_theta, NULL), "rope");
    KERNEL(cuda_rope_rows(cm->k, T, (size_t)c->n_kv_heads, hd, cm->d_pos, c->rope_theta, NULL), "rope");
    KERNEL(cuda_f32_to_f16(cm->k, cm->k16, T * kvd, NULL), "keys to fp16");
    KERNEL(cuda_f32_to_f16(cm->v, cm->v16, T * kvd, NULL), "values to fp16");
    if (sp->n_items > sp->n_dec) {
        /* Prompts attend their own K/V at the cache's precision, as the CPU prefill does: their
         * fp32 rows (after the decode items' rows) become the fp16 values. */
        const size_t p0 = sp->row0[sp->n_dec] * kvd, np = T * kvd - p0;
        KERNEL(cuda_f16_to_f32(cm->k16 + p0, cm->k + p0, np, NULL), "keys at fp16 precision");
        KERNEL(cuda_f16_to_f32(cm->v16 + p0, cm->v + p0, np, NULL), "values at fp16 precision");
    }
    if (sp->n_dec && (rc = decode_layer(cm, items, sp, il, err)) != STRATA_OK)
        return rc;
    for (size_t p = sp->n_dec; p < sp->n_items; p++) {
        const cuda_batch_item *it = &items[sp->order[p]];
        const size_t r0 = sp->row0[p];
        if (it->seq->len > 0) {   /* a prompt chunk continuing the sequence: the cache as it was */
            rc = chunk_layer(cm, it->seq, il, cm->q + r0 * e, cm->k + r0 * kvd, cm->v + r0 * kvd, it->n_tokens,
                             cm->attn + r0 * e, err);
        } else {
            cuda_phase_mark(cm->phases, CUDA_PHASE_PREFILL_ATTN);
            rc = cuda_attention_prefill_gemm(cm->blas, cm->q + r0 * e, cm->k + r0 * kvd, cm->v + r0 * kvd, 0,
                                             (int)it->n_tokens, c->n_heads, c->n_kv_heads, c->head_dim,
                                             cm->attn + r0 * e, cm->d_ws, cm->ws_bytes, err);
        }
        if (rc != STRATA_OK)
            return rc;
    }
    if ((rc = append_prompts_layer(cm, items, sp, il, err)) != STRATA_OK)
        return rc;
    cuda_phase_mark(cm->phases, CUDA_PHASE_MLP);
    if ((rc = gemm(cm, cm->attn, T, e, L->wo, e, cm->proj, err)))
        return rc;
    KERNEL(cuda_add(cm->x, cm->proj, T * e, NULL), "residual");
    KERNEL(cuda_rmsnorm(cm->x, L->ffn_norm, T, e, c->rms_eps, cm->xn, NULL), "rmsnorm");
    if ((rc = gemm(cm, cm->xn, T, e, L->w_gate, ff, cm->gate, err)) || (rc = gemm(cm, cm->xn, T, e, L->w_up, ff, cm->up, err)))
        return rc;
    KERNEL(cuda_swiglu(cm->gate, cm->up, T * ff, cm->gate, NULL), "swiglu");
    if ((rc = gemm(cm, cm->gate, T, ff, L->w_down, e, cm->proj, err)))
        return rc;
    KERNEL(cuda_add(cm->x, cm->proj, T * e, NULL), "residual");
    /* The layer's kernels are enqueued: its blocks may leave now (a copy out waits for them). */
    device_pool_unpin_all(cm->pool);
    return STRATA_OK;
}

/* Non-finite logits (weights or metadata that overflow fp32 on some input) would be picked as
 * token 0 or garbage without a word: they fail the step, as the CPU head does. bad[p] is row p's
 * first non-finite column or -1. */
static int check_logits_finite(cuda_model *cm, const step_plan *sp, const int32_t *bad, strata_error *err)
{
    const size_t nv = (size_t)cm->cfg.n_vocab;
    for (size_t p = 0; p < sp->n_items; p++) {
        if (bad[p] < 0)
            continue;
        float v = 0.0f;
        CU(cudaMemcpy(&v, cm->logits + p * nv + (size_t)bad[p], sizeof v, cudaMemcpyDeviceToHost), "logit check");
        return strata_fail(err, STRATA_EFORMAT,
                           "the model produced a non-finite logit (%g for token id %d of item %zu): its weights or "
                           "metadata overflow fp32", (double)v, (int)bad[p], sp->order[p]);
    }
    return STRATA_OK;
}

/* The last row of every item through the output norm and head, then the logits and/or the
 * tokens picked on the device to the host, in the caller's order: the argmax when sample is NULL,
 * else item i's pick with sample[i] (only the ids cross to the host). */
static int run_head(cuda_model *cm, const cuda_batch_item *items, const step_plan *sp, float *logits,
                    const cuda_sample_row *sample, int32_t *next, strata_error *err)
{
    const model_config *c = &cm->cfg;
    const size_t e = (size_t)c->n_embd, nv = (size_t)c->n_vocab, n = sp->n_items;
    const float *rows = cm->x;   /* decode items only: rows 0..n-1 are already the last rows */
    if (sp->n_dec < n) {
        for (size_t p = 0; p < n; p++) {
            const size_t last = sp->row0[p] + items[sp->order[p]].n_tokens - 1;
            CU(cudaMemcpy(cm->head_x + p * e, cm->x + last * e, e * sizeof(float), cudaMemcpyDeviceToDevice),
               "gathering last rows");
        }
        rows = cm->head_x;
    }
    KERNEL(cuda_rmsnorm(rows, cm->output_norm, n, e, c->rms_eps, cm->xn, NULL), "output norm");
    int rc = gemm(cm, cm->xn, n, e, cm->output, nv, cm->logits, err);
    if (rc != STRATA_OK)
        return rc;
    int32_t *d_bad = cm->d_next + n, *h_bad = cm->h_next + n;
    KERNEL(cuda_first_nonfinite_rows(cm->logits, n, nv, d_bad, NULL), "logit check");
    if (next && !sample) {
        KERNEL(cuda_argmax_rows(cm->logits, n, nv, cm->d_next, NULL), "argmax");
    } else if (next) {
        for (size_t p = 0; p < n; p++)
            cm->h_sample[p] = sample[sp->order[p]];
        CU(cudaMemcpy(cm->d_sample, cm->h_sample, n * sizeof(cuda_sample_row), cudaMemcpyHostToDevice),
           "sampling parameters");
        KERNEL(cuda_sample_rows(cm->logits, (int)n, (int)nv, cm->d_sample, cm->d_next, NULL), "sampling");
    }
    if (next)
        CU(cudaMemcpy(cm->h_next, cm->d_next, 2 * n * sizeof(int32_t), cudaMemcpyDeviceToHost), "sampled tokens");
    else
        CU(cudaMemcpy(h_bad, d_bad, n * sizeof(int32_t), cudaMemcpyDeviceToHost), "logit check");
    if ((rc = check_logits_finite(cm, sp, h_bad, err)) != STRATA_OK)
        return rc;
    if (next) {
        for (size_t p = 0; p < n; p++) {
            if (cm->h_next[p] < 0)   /* the logits are finite: the parameters were refused */
                return strata_fail(err, STRATA_EINVAL, "item %zu: the device sampler refused its parameters",
                                   sp->order[p]);
            next[sp->order[p]] = cm->h_next[p];
        }
    }
    if (logits) {
        CU(cudaMemcpy(cm->h_logits, cm->logits, n * nv * sizeof(float), cudaMemcpyDeviceToHost), "logits");
        for (size_t p = 0; p < n; p++)
            memcpy(logits + sp->order[p] * nv, cm->h_logits + p * nv, nv * sizeof(float));
    }
    return STRATA_OK;
}

static void after_step(const cuda_batch_item *items, const step_plan *sp)
{
    for (size_t p = 0; p < sp->n_items; p++) {
        cuda_seq *s = items[sp->order[p]].seq;
        if (p < sp->n_dec) {   /* the decode bookkeeping staged before the layers, now true */
            const int full = s->tail_len[0] + 1 == s->residual + s->block_tokens;
            for (int l = 0; l < s->n_layers; l++) {
                s->n_blocks[l] += full;
                s->tail_len[l] = full ? s->residual : s->tail_len[l] + 1;
            }
        }
        s->len += items[sp->order[p]].n_tokens;   /* prompts: append_prompts_layer kept their layers' state */
    }
}

/* Copies each item's rows between the step's internal order (sp) and the caller's (items one
 * after another): into cm->x from src, or from cm->x to dst. */
static int move_rows(cuda_model *cm, const cuda_batch_item *items, const step_plan *sp, const float *src, float *dst,
                     strata_error *err)
{
    const size_t e = (size_t)cm->cfg.n_embd;
    size_t *caller_row = malloc(sp->n_items * sizeof *caller_row);   /* each item's first row, caller's order */
    if (!caller_row)
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    for (size_t i = 0, at = 0; i < sp->n_items; at += items[i].n_tokens, i++)
        caller_row[i] = at;
    cudaError_t ce = cudaSuccess;
    for (size_t p = 0; ce == cudaSuccess && p < sp->n_items; p++) {
        const size_t n = items[sp->order[p]].n_tokens * e * sizeof(float), at = caller_row[sp->order[p]] * e;
        ce = src ? cudaMemcpy(cm->x + sp->row0[p] * e, src + at, n, cudaMemcpyDeviceToDevice)
                 : cudaMemcpy(dst + at, cm->x + sp->row0[p] * e, n, cudaMemcpyDeviceToDevice);
    }
    free(caller_row);
    if (ce != cudaSuccess)
        return cuda_failf(err, ce, "stage %s rows", src ? "input" : "output");
    return STRATA_OK;
}

/* One token on a non-empty sequence: batched decode attention. Everything else (a prompt on an
 * empty sequence, a prompt chunk continuing one) runs item by item. */
static bool is_decode(const cuda_batch_item *it) { return it->seq->len > 0 && it->n_tokens == 1; }

static int forward_batch(cuda_model *cm, const cuda_batch_item *items, size_t n_items, const cuda_stage_io *io,
                         float *logits, const cuda_sample_row *sample, int32_t *next, strata_error *err)
{
    if (!cm || !items || n_items == 0 || n_items > 65535)
        return strata_fail(err, STRATA_EINVAL, "cuda_model_forward_batch: 1..65535 items");
    const float *hidden_in = io ? io->hidden_in : NULL;
    float *hidden_out = io ? io->hidden_out : NULL;
    if (!cm->first && !hidden_in)
        return strata_fail(err, STRATA_EINVAL, "a stage holding layers from %d takes its rows from the stage before it "
                           "(cuda_model_stage_step's hidden_in)", cm->layer_begin);
    if (!cm->last && (!hidden_out || logits || next))
        return strata_fail(err, STRATA_EINVAL, "a stage ending before the last layer hands its rows on (hidden_out) "
                           "and has no head (no logits or tokens)");
    cuda_phase_timer_discard(cm->phases);   /* a failed step leaves its marks: forgotten here, once */
    cuda_phase_mark(cm->phases, CUDA_PHASE_INPUT);
    size_t bad;
    int rc = check_items(cm, items, n_items, &bad, err);
    if (rc == STRATA_OK)   /* before anything changes: a step that ran out of room part way would leave
                            * its sequences' layers uneven */
        rc = check_room(cm, items, n_items, &bad, err);
    if (rc == STRATA_OK)
        rc = cuda_uploads_begin(&cm->uploads, err);
    if (rc != STRATA_OK)
        return rc;
    /* The kernels only ever set the status: a block rejected in an earlier step (or a status a
     * failed step left) must not fail this one. Likewise an error a failed call recorded and no
     * one took (cuda_fail takes those it reports; a sticky one comes back at once). */
    (void)cudaGetLastError();
    cudaError_t zeroed = cudaMemsetAsync(cm->d_status, 0, sizeof(int), 0);
    if (zeroed != cudaSuccess)
        return cuda_fail(err, zeroed, "clearing the step's status");
    step_plan sp = {.n_items = n_items};
    sp.order = malloc(n_items * sizeof *sp.order);
    sp.row0 = malloc(n_items * sizeof *sp.row0);
    sp.groups = malloc(n_items * sizeof *sp.groups);
    size_t *group_of = malloc(n_items * sizeof *group_of);   /* a decode item's group, by caller's index */
    if (!sp.order || !sp.row0 || !sp.groups || !group_of) {
        free(sp.order);
        free(sp.row0);
        free(sp.groups);
        free(group_of);
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    }
    /* Decode items first, group by group (a group: the sequences of one KV plan, in the order
     * the plans first appear), then prompts and prompt chunks. */
    size_t *lead = sp.row0;   /* scratch until the rows are counted: each group's first item */
    for (size_t i = 0; i < n_items; i++) {
        if (!is_decode(&items[i]))
            continue;
        sp.n_dec++;
        size_t g = 0;
        while (g < sp.n_groups && !same_plan(items[lead[g]].seq, items[i].seq))
            g++;
        if (g == sp.n_groups)
            lead[sp.n_groups++] = i;
        group_of[i] = g;
    }
    size_t at = 0;
    for (size_t g = 0; g < sp.n_groups; g++) {
        sp.groups[g] = (dec_group){.begin = at};
        for (size_t i = 0; i < n_items; i++)
            if (is_decode(&items[i]) && group_of[i] == g)
                sp.order[at++] = i;
        sp.groups[g].end = at;
    }
    for (size_t i = 0; i < n_items; i++)
        if (!is_decode(&items[i]))
            sp.order[at++] = i;
    free(group_of);
    for (size_t p = 0; p < n_items; p++) {
        sp.row0[p] = sp.rows;
        sp.rows += items[sp.order[p]].n_tokens;
    }

    const model_config *c = &cm->cfg;
    const size_t e = (size_t)c->n_embd;
    /* The prompts' encoder scratch first: the decode jobs written next point into it. */
    if ((rc = ensure_workspace(cm, sp.rows, err)) == STRATA_OK && (rc = ensure_items(cm, n_items, err)) == STRATA_OK &&
        (rc = ensure_encoder_scratch(cm, prompt_scratch_bytes(items, &sp), err)) == STRATA_OK)
        rc = stage_decode_jobs(cm, items, &sp, err);
    for (size_t g = 0; rc == STRATA_OK && g < sp.n_groups; g++) {   /* the groups run one after another */
        dec_group *G = &sp.groups[g];
        const cuda_seq *s0 = items[sp.order[G->begin]].seq;
        rc = cuda_kv_attention_plan(&s0->enc[0].layout, (int)(G->end - G->begin), c->n_heads, G->max_blocks,
                                    cm->sm_count, &G->attn, err);
        if (rc == STRATA_OK)
            rc = ensure_attention_workspace(cm, cuda_kv_attention_workspace(&s0->enc[0].layout, &G->attn), err);
    }
    /* A prompt's attention (cuda_attention_prefill_gemm) keeps its score tiles in the same
     * workspace, after the step's decode attention on the same stream; a chunk continuing a
     * sequence (cuda_attention_chunk_gemm) also a tile of its past as fp32 rows. */
    for (size_t p = sp.n_dec; rc == STRATA_OK && p < n_items; p++) {
        const cuda_batch_item *it = &items[sp.order[p]];
        const size_t past = it->seq->len;
        if (past > INT_MAX)
            rc = strata_fail(err, STRATA_EINVAL, "a sequence of %zu positions", past);
        else if (past == 0)
            rc = ensure_attention_workspace(
                cm, cuda_prefill_workspace(0, (int)it->n_tokens, c->n_heads, c->n_kv_heads), err);
        else
            rc = ensure_attention_workspace(cm, cuda_chunk_workspace((int)past, (int)it->n_tokens, c->n_heads,
                                                                     c->n_kv_heads, c->head_dim,
                                                                     chunk_tile(cm, it->seq)), err);
    }
    for (size_t p = sp.n_dec; rc == STRATA_OK && p < n_items; p++) {   /* as kv_seq_append records it */
        const cuda_batch_item *it = &items[sp.order[p]];
        if (it->n_tokens > 1)
            it->seq->prompt_end = it->seq->len + it->n_tokens;
    }
    if (rc == STRATA_OK) {   /* the rows entering the first layer: embedded here, or the stage before's */
        const bool table = cm->first;
        for (size_t p = 0; p < n_items; p++) {
            const cuda_batch_item *it = &items[sp.order[p]];
            if (table)
                model_embed_tokens(cm->host, it->tokens, it->n_tokens, cm->h_rows + sp.row0[p] * e);
            for (size_t t = 0; t < it->n_tokens; t++)
                cm->h_pos[sp.row0[p] + t] = (int32_t)(it->seq->len + t);
        }
        cudaError_t ce = table ? cudaMemcpy(cm->x, cm->h_rows, sp.rows * e * sizeof(float), cudaMemcpyHostToDevice)
                               : cudaSuccess;
        if (ce == cudaSuccess)
            ce = cudaMemcpy(cm->d_pos, cm->h_pos, sp.rows * sizeof(int32_t), cudaMemcpyHostToDevice);
        if (ce != cudaSuccess)
            rc = cuda_fail(err, ce, "embedding rows");
        if (rc == STRATA_OK && !table)
            rc = move_rows(cm, items, &sp, hidden_in, NULL, err);
    }
    for (int il = 0; rc == STRATA_OK && il < cm->n_local; il++)
        if ((rc = run_layer(cm, items, &sp, il, err)) != STRATA_OK)
            strata_error_prefix(err, "layer %d", cm->layer_begin + il);
    /* The rows handed on are copied before the status is read: that read waits for the device,
     * so the rows are complete when the caller passes them to another stream (an NCCL link). */
    if (rc == STRATA_OK && hidden_out)
        rc = move_rows(cm, items, &sp, NULL, hidden_out, err);
    if (rc == STRATA_OK) {
        after_step(items, &sp);
        cuda_phase_mark(cm->phases, CUDA_PHASE_HEAD);
        int status = 0;
        cudaError_t ce = cudaMemcpy(&status, cm->d_status, sizeof status, cudaMemcpyDeviceToHost);
        if (ce != cudaSuccess)
            rc = cuda_fail(err, ce, "reading the step's status");
        else if (status)
            rc = strata_fail(err, STRATA_EFORMAT, "the CUDA attention kernel rejected a block of a cache (status %d)",
                             status);
    }
    if (rc == STRATA_OK && (logits || next))
        rc = run_head(cm, items, &sp, logits, sample, next, err);
    if (rc == STRATA_OK) {
        /* The step ran and its sequences advanced: a failed timing loses only its times (counted
         * in dropped_steps); failing the step would leave the caller behind its sequences. A
         * device that really failed fails the next step's own work. */
        strata_error timer_err = {0};
        (void)cuda_phase_timer_end_step(cm->phases, &timer_err);
    }
    device_pool_unpin_all(cm->pool);   /* also after a failure mid-layer */
    free(sp.full_seq);
    free(sp.groups);
    free(sp.order);
    free(sp.row0);
    return rc;
}

int cuda_model_forward_batch(cuda_model *cm, const cuda_batch_item *items, size_t n_items, float *logits,
                             strata_error *err)
{
    return forward_batch(cm, items, n_items, NULL, logits, NULL, NULL, err);
}

int cuda_model_forward_batch_greedy(cuda_model *cm, const cuda_batch_item *items, size_t n_items, int32_t *next,
                                    strata_error *err)
{
    if (!next)
        return strata_fail(err, STRATA_EINVAL, "cuda_model_forward_batch_greedy: NULL output");
    return forward_batch(cm, items, n_items, NULL, NULL, NULL, next, err);
}

/* The sampling rows sampler_params_validate would accept, with a draw in [0, 1). */
static int check_sample_rows(const char *fn, const cuda_sample_row *sample, size_t n, int32_t *next, strata_error *err)
{
    if (!next || !sample)
        return strata_fail(err, STRATA_EINVAL, "%s: NULL parameters or output", fn);
    for (size_t i = 0; i < n; i++) {
        const cuda_sample_row *r = &sample[i];
        if (!(r->u >= 0.0 && r->u < 1.0) || !isfinite(r->temperature) || r->temperature < 0.0f || r->top_k < 0 ||
            !(r->top_p > 0.0f && r->top_p <= 1.0f))
            return strata_fail(err, STRATA_EINVAL,
                               "%s: item %zu: draw %g, temperature %g, top-k %d, top-p %g (want a draw in [0, 1), "
                               "temperature >= 0, top-k >= 0, top-p in (0, 1])",
                               fn, i, r->u, (double)r->temperature, (int)r->top_k, (double)r->top_p);
    }
    return STRATA_OK;
}

int cuda_model_forward_batch_sample(cuda_model *cm, const cuda_batch_item *items, size_t n_items,
                                    const cuda_sample_row *sample, int32_t *next, strata_error *err)
{
    int rc = check_sample_rows("cuda_model_forward_batch_sample", sample, items ? n_items : 0, next, err);
    return rc != STRATA_OK ? rc : forward_batch(cm, items, n_items, NULL, NULL, sample, next, err);
}

bool cuda_model_context_lost(cuda_model *cm, strata_error *err)
{
    (void)cm;
    /* An error recorded by a call that failed (out of memory, a bad argument) goes at the first
     * synchronization and not at the second; one the device met stays. */
    cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        e = cudaDeviceSynchronize();
    }
    if (e == cudaSuccess)
        return false;
    strata_fail(err, STRATA_EIO, "the CUDA context is lost (%s); every later step would fail", cudaGetErrorString(e));
    return true;
}

int cuda_model_stage_step_sample(cuda_model *cm, const cuda_batch_item *items, size_t n_items, const cuda_stage_io *io,
                                 const cuda_sample_row *sample, int32_t *next, strata_error *err)
{
    if (!io)
        return strata_fail(err, STRATA_EINVAL, "cuda_model_stage_step_sample: NULL io");
    int rc = check_sample_rows("cuda_model_stage_step_sample", sample, items ? n_items : 0, next, err);
    return rc != STRATA_OK ? rc : forward_batch(cm, items, n_items, io, NULL, sample, next, err);
}

int cuda_model_stage_step(cuda_model *cm, const cuda_batch_item *items, size_t n_items, const cuda_stage_io *io,
                          float *logits, strata_error *err)
{
    if (!io)
        return strata_fail(err, STRATA_EINVAL, "cuda_model_stage_step: NULL io");
    return forward_batch(cm, items, n_items, io, logits, NULL, NULL, err);
}

/* What cuda_seq_create allocates on the device. */
static size_t seq_bytes(const cuda_model *cm, size_t slot, int block_tokens, int residual, size_t max_tokens)
{
    const size_t L = (size_t)cm->n_local, row = (size_t)cm->cfg.n_kv_heads * (size_t)cm->cfg.head_dim;
    const size_t max_blocks = (max_tokens + (size_t)block_tokens - 1) / (size_t)block_tokens;
    const size_t blocks = cm->pool ? 0 : L * max_blocks * slot;   /* the shared pool holds them */
    return blocks + 2 * L * (size_t)(residual + block_tokens) * row * 2 + L * max_blocks * sizeof(void *);
}

int cuda_model_create_kv_pool_plans(cuda_model *cm, const kv_codec_params *const *plans, int n_plans, int block_tokens,
                                    size_t n_blocks, const kv_lower_tier *lower, strata_error *err)
{
    if (!cm || !plans || n_plans < 1 || block_tokens < 1 || n_blocks < 1)
        return strata_fail(err, STRATA_EINVAL, "cuda_model_create_kv_pool: bad arguments");
    if (cm->pool)
        return strata_fail(err, STRATA_EINVAL, "cuda_model_create_kv_pool: the model already has a pool");
    if (cm->next_owner || cm->step)
        return strata_fail(err, STRATA_EINVAL, "cuda_model_create_kv_pool: create the pool before any sequence");
    for (int i = 0; i < n_plans; i++) {
        int rc = plans[i] ? cuda_seq_check_plan(plans[i], cm->n_local, err)
                          : strata_fail(err, STRATA_EINVAL, "cuda_model_create_kv_pool: bad arguments");
        if (rc != STRATA_OK)
            return rc;
    }
    const kv_geometry g = {.n_layers = cm->n_local, .n_kv_heads = cm->cfg.n_kv_heads,
                           .head_dim = cm->cfg.head_dim, .block_tokens = block_tokens};
    const size_t slot = kv_plans_largest_block(&g, plans, n_plans);   /* any layer's block of any plan fits */
    if (slot == 0)
        return strata_fail(err, STRATA_EINVAL, "cuda_model_create_kv_pool: no block size for this plan and geometry");
    int device = 0;
    CU(cudaGetDevice(&device), "current device");
    device_pool_mem ops;
    if (!(cm->pool_mem = cuda_device_mem_create(device, &ops, err)))
        return err ? err->code : STRATA_EIO;
    if (!(cm->pool = device_pool_create(slot, n_blocks, &ops, lower, err))) {
        cuda_device_mem_free(cm->pool_mem);
        cm->pool_mem = NULL;
        return err ? err->code : STRATA_EIO;
    }
    cm->pool_slot = slot;
    return STRATA_OK;
}

int cuda_model_create_kv_pool_plan(cuda_model *cm, const kv_codec_params *codecs, int block_tokens, size_t n_blocks,
                                   const kv_lower_tier *lower, strata_error *err)
{
    return cuda_model_create_kv_pool_plans(cm, &codecs, 1, block_tokens, n_blocks, lower, err);
}

int cuda_model_create_kv_pool(cuda_model *cm, const kv_codec_params *codec, int block_tokens, size_t n_blocks,
                              const kv_lower_tier *lower, strata_error *err)
{
    if (!cm || !codec)
        return strata_fail(err, STRATA_EINVAL, "cuda_model_create_kv_pool: bad arguments");
    kv_codec_params *plan = malloc((size_t)cm->n_local * sizeof *plan);
    if (!plan)
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    for (int l = 0; l < cm->n_local; l++)
        plan[l] = *codec;
    const int rc = cuda_model_create_kv_pool_plan(cm, plan, block_tokens, n_blocks, lower, err);
    free(plan);
    return rc;
}

int cuda_kv_pool_sizing(const kv_codec_params *const *plans, int n_plans, const kv_geometry *g, size_t max_tokens,
                        size_t n_seqs, uint64_t budget_bytes, bool tier_below, cuda_kv_pool_size *out,
                        strata_error *err)
{
    const size_t slot = plans && n_plans > 0 && g && g->block_tokens > 0 ? kv_plans_largest_block(g, plans, n_plans) : 0;
    if (slot == 0)
        return strata_fail(err, STRATA_EINVAL, "KV pool: no block size for this plan and geometry");
    const size_t per_layer = (max_tokens + (size_t)g->block_tokens - 1) / (size_t)g->block_tokens;
    const size_t all = per_layer * (size_t)g->n_layers;
    *out = (cuda_kv_pool_size){.slot_bytes = slot,
                               .slots = budget_bytes ? (size_t)(budget_bytes / slot) : all * (n_seqs ? n_seqs : 1),
                               .need = tier_below ? per_layer + 1 : all,
                               .seq_blocks = all};
    return STRATA_OK;
}

void cuda_model_kv_pool_stats(const cuda_model *cm, device_pool_stats *out)
{
    device_pool_get_stats(cm ? cm->pool : NULL, out);
}

void cuda_seq_set_waiting(cuda_seq *s, bool waiting)
{
    if (s && s->cm->pool)
        device_pool_set_waiting(s->cm->pool, s->owner, waiting);
}

size_t cuda_seq_bytes(const cuda_seq *s)
{
    if (!s)
        return 0;
    return seq_bytes(s->cm, s->slot, s->block_tokens, s->residual, s->max_tokens) + (size_t)s->n_layers * s->ott_stride;
}

int cuda_seq_device_bytes(const cuda_model *cm, const kv_codec_params *codec, int block_tokens, size_t max_tokens,
                          size_t *bytes, strata_error *err)
{
    if (!cm || !codec || !bytes || block_tokens < 1 || max_tokens < 1)
        return strata_fail(err, STRATA_EINVAL, "cuda_seq_device_bytes: bad arguments");
    if (cuda_seq_check_codec(codec, err) != STRATA_OK)
        return err ? err->code : STRATA_EUNSUPPORTED;
    const kv_geometry g = {.n_layers = cm->n_local, .n_kv_heads = cm->cfg.n_kv_heads,
                           .head_dim = cm->cfg.head_dim, .block_tokens = block_tokens};
    cuda_kv_encoder enc;
    int rc = cuda_kv_encoder_init(codec, &g, &enc, err);
    if (rc == STRATA_OK)
        *bytes = seq_bytes(cm, kv_block_size(codec, &g), block_tokens, codec->residual, max_tokens) +
                 (size_t)cm->n_local * (size_t)enc.ott_state_bytes;
    return rc;
}

int cuda_model_forward(cuda_model *cm, cuda_seq *s, const int32_t *tokens, size_t n, float *logits, strata_error *err)
{
    if (!cm || !s || !tokens || n == 0)
        return strata_fail(err, STRATA_EINVAL, "cuda_model_forward: bad arguments");
    const cuda_batch_item item = {s, tokens, n};   /* a prompt, a prompt chunk or one token */
    return cuda_model_forward_batch(cm, &item, 1, logits, err);
}
