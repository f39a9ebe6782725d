/* A Llama-family model (SmolLM2, Llama 2/3 shapes) loaded from GGUF (or synthetic: random
 * weights of a known shape, worker/synthetic.h), run on the CPU backend.
 *
 * A model can hold only the layers [layer_begin, layer_end) so that a pipeline stage loads its
 * slice; the embedding lives with the stage that has layer 0 and the output norm and head
 * with the stage that has the last layer. Matrices stay in the file's format (kern_matmul_w
 * decodes them as it multiplies, to the same bits as fp32 copies would give); norms are fp32.
 *
 * A model owns scratch buffers: one model is driven from one thread at a time. */
#ifndef STRATA_WORKER_MODEL_H
#define STRATA_WORKER_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/ops.h"
#include "kvstore/error.h"
#include "kvstore/kv_cache.h"
#include "worker/tokenizer.h"

typedef struct model_config {
    char arch[32];
    char name[128];
    int n_layers;        /* of the whole model */
    int n_embd;
    int n_heads;
    int n_kv_heads;
    int head_dim;
    int n_ff;
    int n_vocab;
    int n_ctx_train;
    float rope_theta;
    float rms_eps;
    bool tied_output;    /* output head shares the token embedding */
} model_config;

typedef struct model model;

/* Loads layers [layer_begin, layer_end) of the GGUF at path (layer_end = -1: to the last
 * layer). Fails with a message naming the missing tensor, wrong shape or unsupported type.
 *
 * A path "synthetic:NAME" or "synthetic:NAME:seed=N" instead builds a model of a known shape
 * (llama3-8b, smollm2-135m, tiny, ...) with random weights from the seed (worker/synthetic.h).
 * Its weights are checked against the available memory before anything is allocated:
 * STRATA_ENOMEM with a message naming both sizes when they cannot fit; a malformed spec or an
 * unknown NAME is STRATA_EINVAL (the message lists the known names). */
model *model_load(const char *path, int layer_begin, int layer_end, strata_error *err);

/* Checks what a --model argument names before anything is loaded: a synthetic path that parses,
 * or a file that can be read and is not a folder. STRATA_EINVAL with the reason ("model PATH: No
 * such file or directory", a synthetic spec's error) otherwise. Whether the file is a model is
 * for model_load to find. */
int model_check_path(const char *path, strata_error *err);
void model_free(model *m);

/* Loads a model for a backend that builds its own copy of the weights (the CUDA forward pass,
 * worker/cuda/model_cuda.h, decodes GGUF blocks and generates synthetic weights on the device):
 * as model_load, every tensor of the range is found and its shape and type checked, but only the
 * token embedding (on the first stage: the lookup stays on the host) is read into host memory;
 * the layers, the output norm and the head stay in the mapped file, or as their synthetic
 * streams, for model_tensor_get. model_forward and model_forward_batch refuse such a model
 * (STRATA_EINVAL), model_get_layer_weights too; model_get_output_* are NULL. A synthetic model's
 * memory check counts only the embedding. */
model *model_load_for_device(const char *path, int layer_begin, int layer_end, strata_error *err);
bool model_is_for_device(const model *m);

typedef enum model_tensor_role {
    MODEL_T_ATTN_NORM, MODEL_T_WQ, MODEL_T_WK, MODEL_T_WV, MODEL_T_WO,   /* a layer's nine, */
    MODEL_T_FFN_NORM, MODEL_T_GATE, MODEL_T_UP, MODEL_T_DOWN,            /* MODEL_LAYER_TENSORS */
    MODEL_T_OUTPUT_NORM, MODEL_T_OUTPUT,                                 /* the last stage's */
    MODEL_T_TOKEN_EMBD,                                                  /* the first stage's */
} model_tensor_role;
#define MODEL_LAYER_TENSORS 9

/* Where one tensor's values are, without reading them: ne1 rows of ne0 (GGUF layout, the input
 * dimension contiguous; 1-D tensors have ne1 == 1). */
typedef struct model_tensor {
    char name[96];             /* its GGUF name, for messages */
    uint64_t ne0, ne1;
    bool synthetic;
    uint32_t type;             /* GGUF: a format of kernels/weight_values.h */
    const void *data;          /* GGUF: its blocks in the mapped file, valid while the model lives */
    size_t bytes;
    uint64_t stream_key;       /* synthetic matrix: element i = synthetic_value(key, amp, i); */
    float stream_amp;          /* a synthetic 1-D tensor (a norm) is all 1 */
} model_tensor;

/* The tensor of a role (of layer, for the nine layer roles) of a model from model_load_for_device.
 * MODEL_T_OUTPUT is the token embedding when the head is tied. STRATA_EINVAL for another model or
 * a tensor this stage does not hold. */
int model_tensor_get(const model *m, model_tensor_role role, int layer, model_tensor *out, strata_error *err);

/* Elements [first, first + n) of t as fp32, decoded on the host by the same functions the device
 * uses (kernels/weight_values.h). */
void model_tensor_read(const model_tensor *t, uint64_t first, uint64_t n, float *out);

/* Reads only the configuration and the tokenizer of the GGUF at path (or of a synthetic model,
 * as model_load), no weights: what the coordinator needs to tokenize, check requests and plan
 * KV capacity. *tok is the caller's (tokenizer_free). cfg->n_vocab is the tokenizer's
 * vocabulary. */
int model_read_meta(const char *path, model_config *cfg, tokenizer **tok, strata_error *err);

const model_config *model_get_config(const model *m);
const tokenizer *model_get_tokenizer(const model *m);
int model_layer_begin(const model *m);
int model_layer_end(const model *m);
/* Bytes of weights held in memory: matrices in their file format (a GGUF's quantized bytes) or
 * fp32, norms fp32. */
size_t model_weight_bytes(const model *m);
/* Bytes of fp32 weights that loading layers [layer_begin, layer_end) (layer_end -1: to the last)
 * of a model of configuration c takes: the layers' nine tensors each, the token embedding on
 * the first stage (and on the last when the head is tied to it), the output norm and untied
 * head on the last. Equals model_weight_bytes of such a model when every matrix is fp32 (a
 * synthetic model, an F32 file); an upper bound for the others. 0 for a range outside the
 * model, SIZE_MAX when it does not fit a size_t. */
size_t model_weight_bytes_for(const model_config *c, int layer_begin, int layer_end);

/* Host bytes of the activations model_forward_batch allocates for a step of `rows` tokens
 * (besides the weights, the KV cache and the attention scratch a long cached context takes);
 * SIZE_MAX when that does not fit a size_t. */
size_t model_step_bytes(const model *m, size_t rows);

/* The weights of one held layer (layer_begin <= layer < layer_end), owned by m: the norms in
 * fp32, the matrices as stored (kernels/ops.h: kern_weights, GGUF layout [out][in] with the
 * input dimension contiguous; kern_weights_rows gives their fp32 values). STRATA_EINVAL for a
 * layer m does not hold. */
typedef struct model_layer_weights {
    const float *attn_norm, *ffn_norm;
    kern_weights wq, wk, wv, wo, w_gate, w_up, w_down;
} model_layer_weights;
int model_get_layer_weights(const model *m, int layer, model_layer_weights *out, strata_error *err);
/* [n_vocab][n_embd]; data NULL when m does not hold the embedding (a later stage of an untied
 * model). */
kern_weights model_get_token_embedding(const model *m);
/* The embedding rows of n token ids (each below n_vocab: callers check) into out [n][n_embd];
 * m must hold the embedding. */
void model_embed_tokens(const model *m, const int32_t *tokens, size_t n, float *out);
/* Output norm [n_embd] and head [n_vocab][n_embd] (the embedding when tied); NULL (data NULL)
 * unless m holds the last layer. */
const float *model_get_output_norm(const model *m);
kern_weights model_get_output_weights(const model *m);

/* KV geometry of this model for a block size (all layers of the model). */
kv_geometry model_kv_geometry(const model *m, int block_tokens);

/* KV geometry of the layers this model holds: n_layers = layer_end - layer_begin. A sequence on
 * a pipeline stage holds only that stage's layers, numbered from 0 (local layer il - layer_begin).
 * For a model holding every layer it equals model_kv_geometry. */
kv_geometry model_stage_kv_geometry(const model *m, int block_tokens);

/* Runs n tokens at positions pos0.. through the whole model (which must hold every layer) and
 * appends their K/V to seq. If seq is empty and n > 1 the prompt is prefilled with exact
 * attention over its fp16-rounded K/V; one token on a non-empty sequence is a decode step
 * (attention over the compressed cache, after its own K/V is appended); n > 1 tokens on a
 * non-empty sequence are a prompt chunk (model_forward_batch says how it attends). logits: n_vocab floats for the last token, or, with
 * all_logits, n * n_vocab floats (one row per token). NULL to skip the head. A non-finite
 * logit (a model whose weights overflow fp32) fails the call with STRATA_EFORMAT.
 * On failure (e.g. STRATA_EFULL from the block pool) the layers of seq may hold different
 * lengths: the caller discards the sequence. */
/* Called by model_forward after each layer of a call of at least min_tokens tokens (a long
 * prefill takes minutes on a CPU): layers_done of n_layers, for n_tokens. NULL fn: none. */
typedef void (*model_progress_fn)(void *ctx, int layers_done, int n_layers, size_t n_tokens);
void model_set_progress(model *m, model_progress_fn fn, void *ctx, size_t min_tokens);

int model_forward(model *m, kv_seq *seq, const int32_t *tokens, size_t n, size_t pos0,
                  float *logits, bool all_logits, strata_error *err);

/* One item of a batched step (model_forward_batch). */
typedef struct model_batch_item {
    kv_seq *seq;             /* from a pool of model_stage_kv_geometry; at most once per batch */
    const int32_t *tokens;   /* n_tokens ids: required on the first stage (they are embedded);
                              * on later stages optional (NULL), range-checked when given */
    size_t n_tokens;         /* >= 1 */
    size_t pos0;             /* position of the first token: the sequence's current length */
} model_batch_item;

/* One step of continuous batching through the layers this model holds, [layer_begin, layer_end)
 * (a whole model or a pipeline stage). Each item is either
 *   - a whole prompt on an empty sequence (pos0 == 0, n_tokens > 1): exact causal attention over
 *     its fp16-rounded K/V, as model_forward's prefill; or
 *   - one token (n_tokens == 1, pos0 == the sequence's length, also 0 for a one-token prompt):
 *     attention over the compressed cache (kv_seq_acquire_layer; the next layer is prefetched and
 *     the sequence unpinned after each layer), as model_forward's decode; or
 *   - a prompt chunk continuing a sequence (n_tokens > 1, pos0 == its length > 0: chunked
 *     prefill): all its rows at once; attention over the cache as it was before the chunk
 *     followed by the chunk's own K/V in fp16, causal within the chunk (kern_kv_attention_rows),
 *     then the chunk is appended.
 *
 * Rows: the step has T = sum of n_tokens rows, item after item, each [n_embd] floats.
 *   hidden_in: the T rows entering layer_begin; required when layer_begin > 0, unused (may be
 *     NULL) on the first stage, where the tokens are embedded.
 *   hidden_out: the T rows leaving the stage's last layer; required when layer_end < n_layers,
 *     unused on the last stage. It may be the same buffer as hidden_in.
 *   logits: on the last stage, n_items rows of n_vocab floats, the last token of each item; NULL
 *     skips the head. Unused on other stages.
 * The projection and FFN matmuls run once over all T rows; attention runs per item. The result
 * of every item is bit-identical to running it alone (model_forward, or this function with one
 * item) and to running the layers split over stages: every kernel works row by row or per item
 * (kern_matmul is batch-invariant).
 *
 * Every item is validated, and the items' room checked together per pool (kv_room: they draw
 * on the same slots and tiers), before any layer runs (model_batch_check): a failed check
 * changes no sequence. A failure inside the layers (a lower tier's I/O error) leaves the
 * sequences of the batch with uneven layers, and the caller discards them (as with
 * model_forward). */
int model_forward_batch(model *m, const model_batch_item *items, size_t n_items, const float *hidden_in,
                        float *hidden_out, float *logits, strata_error *err);

/* The checks model_forward_batch makes before its first layer, without running anything: the
 * buffers, every item (sequence, tokens, geometry, position, no sequence twice) and the items'
 * room, each beside the items before it. On failure *bad_item (if non-NULL) is the index of the
 * item at fault, or n_items when the fault is not one item's (no items, a missing buffer); a
 * scheduler can drop or defer that item and check the rest again. STRATA_OK leaves
 * *bad_item = n_items. */
int model_batch_check(const model *m, const model_batch_item *items, size_t n_items, const float *hidden_in,
                      const float *hidden_out, size_t *bad_item, strata_error *err);

#endif
