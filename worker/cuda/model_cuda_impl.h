/* Internal to worker/cuda: the forward pass's and the GPU sequence's state, shared by
 * model_cuda.c (the forward pass) and seq_image_cuda.c (migration images). Not a public header. */
#ifndef STRATA_WORKER_CUDA_MODEL_CUDA_IMPL_H
#define STRATA_WORKER_CUDA_MODEL_CUDA_IMPL_H

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/cuda_kv_attention.h"
#include "kernels/cuda_kv_encode.h"
#include "kernels/cuda_kv_tail.h"
#include "kernels/cuda_sample.h"
#include "offload/device_pool.h"
#include "worker/cuda/cuda_fail.h"
#include "worker/cuda/device_mem.h"
#include "worker/cuda/model_cuda.h"
#include "worker/cuda/phase_timer.h"
#include "worker/cuda/uploads.h"

typedef struct cuda_layer {
    float *attn_norm, *ffn_norm;               /* fp32 */
    void *wq, *wk, *wv, *wo, *w_gate, *w_up, *w_down;  /* dtype */
} cuda_layer;

struct cuda_model {
    const model *host;
    model_config cfg;
    /* The layers held, [layer_begin, layer_begin + n_local): a whole model or a pipeline stage.
     * Sequences and their blocks number them from 0, as the CPU stages do. */
    int layer_begin, n_local;
    bool first, last;   /* embeds the tokens / holds the output head */
    cuda_weight_dtype dtype;
    cublasHandle_t blas;
    bool blas_ok;
    int sm_count;
    cuda_layer *layers;
    float *output_norm;
    void *output;
    size_t weight_bytes;
    /* Activations for up to cap rows (tokens of a step). */
    size_t cap;
    float *x, *xn, *q, *k, *v, *attn, *proj, *gate, *up;
    uint16_t *act16, *k16, *v16;
    int32_t *d_pos;
    float *h_rows;   /* host staging of embedding rows */
    int32_t *h_pos;
    /* Per-item buffers for up to cap_items items of a step. */
    size_t cap_items;
    float *head_x, *logits, *h_logits;        /* [items][n_embd], [items][n_vocab] device, host */
    int32_t *d_next, *h_next;                 /* [items] sampled tokens */
    cuda_sample_row *d_sample, *h_sample;     /* [items] sampling parameters and draws */
    cuda_kv_seq *d_views, *h_views;           /* [layer][decode item] */
    cuda_kv_append_job *d_append, *h_append;  /* [layer][decode item] */
    cuda_kv_encode_job *d_encode, *h_encode;  /* [layer][decode item whose tail fills] */
    cuda_kv_shift_job *d_shift, *h_shift;
    void *d_ws;                               /* attention workspace */
    int chunk_tile_keys;                      /* a prompt chunk reads its past this many keys at a time */
    size_t ws_bytes;
    uint8_t *d_gear_work;                     /* GEAR, OTT: a scratch per block encoded in one launch */
    size_t gear_work_bytes;
    /* A layer's multi-token appends (append_prompts_layer): the blocks' jobs round after round,
     * each item's tail job, where each item's stream starts, and the chunks' streams. */
    cuda_kv_encode_job *d_pencode, *h_pencode;
    cuda_kv_append_job *d_ptail, *h_ptail;
    const uint16_t **h_stream_k, **h_stream_v;
    size_t cap_pencode, cap_ptail;
    uint16_t *d_stream;
    size_t stream_cap;                        /* elements */
    int *d_status;
    uint64_t step;                            /* steps checked so far: marks sequences seen in one */
    /* The shared block pool (cuda_model_create_kv_pool), or NULL: each sequence has its arena. */
    device_pool *pool;
    cuda_device_mem *pool_mem;
    size_t pool_slot;
    uint64_t next_owner;
    device_block *h_acquire;                  /* a step's blocks, and their addresses */
    void **h_addrs;
    size_t cap_acquire;
    cuda_uploads uploads;                     /* the shared pool's per-layer table rows and encoder jobs */
    cuda_phase_timer *phases;                 /* cuda_model_time_phases, or NULL */
};

/* A sequence's KV on the device. Its layers may use different codecs (a plan), sharing the block
 * size and the fp16 window R, so blocks form in every layer at the same step. */
struct cuda_seq {
    cuda_model *cm;
    kv_codec_params *codecs;         /* [n_layers] */
    cuda_kv_encoder *enc;            /* [n_layers] */
    cuda_kv_encoder *enc_prompt;     /* [n_layers] GEAR layers: blocks made only of prompt tokens take rank_prompt */
    size_t *layer_slot;              /* [n_layers] the largest block of the layer's codec (kv_block_size) */
    int n_layers, block_tokens, residual;
    size_t max_tokens, len, max_blocks, slot, row;  /* slot: the largest over layers; row: H * D elements */
    uint8_t *arena;                  /* device: n_layers * max_blocks slots; NULL with the shared pool */
    uint64_t owner;                  /* the shared pool's name for this sequence */
    device_block *handles;           /* shared pool: block b of layer l is handles[l * max_blocks + b] */
    const uint8_t **h_tables;        /* shared pool: the host copy of d_tables */
    uint8_t *row_dirty;              /* shared pool, per layer: its h_tables row changed since uploaded */
    uint16_t *tail_k, *tail_v;       /* device: n_layers * (R + BT) rows */
    int *tail_len, *n_blocks;        /* host, per layer (equal across layers between steps) */
    const uint8_t **d_tables;        /* device: n_layers * max_blocks block pointers */
    size_t prompt_end;               /* where the last multi-token append (prompt or chunk) ended, as on the CPU */
    size_t work_bytes;               /* GEAR, OTT: the largest encoder scratch of any layer, per block */
    uint8_t *d_ott;                  /* OTT layers' trackers, ott_stride bytes each, device */
    size_t ott_stride;               /* the largest enc[l].ott_state_bytes; 0 without an OTT layer */
    uint64_t seen_in_step;           /* cm->step of the last step that named this sequence */
};

#define CU(call, what)                                                                                     \
    do {                                                                                                   \
        cudaError_t e_ = (call);                                                                           \
        if (e_ != cudaSuccess)                                                                             \
            return cuda_fail(err, e_, (what));                                                             \
    } while (0)

/* Row `token` of a layer's fp16 tail (base: s->tail_k or s->tail_v). */
uint16_t *cuda_seq_tail_at(const cuda_seq *s, uint16_t *base, int layer, size_t token);

/* Where block b of a layer is written: its slot in the sequence's arena, or a new block of the
 * shared pool (pinned until device_pool_unpin_all; its table entry is marked for upload). */
int cuda_seq_new_block(cuda_seq *s, int layer, size_t b, uint8_t **dst, strata_error *err);

#endif
