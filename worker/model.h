/* A Llama-family model (SmolLM2, Llama 2/3 shapes) loaded from GGUF, run on the CPU backend.
 *
 * A model can hold only the layers [layer_begin, layer_end) so that a pipeline stage loads its
 * slice; the embedding lives with the stage that has layer 0 and the output norm and head
 * with the stage that has the last layer. Weights are dequantized to fp32 at load.
 *
 * A model owns scratch buffers: one model is driven from one thread at a time. */
#ifndef STRATA_WORKER_MODEL_H
#define STRATA_WORKER_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

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
 * layer). Fails with a message naming the missing tensor, wrong shape or unsupported type. */
model *model_load(const char *path, int layer_begin, int layer_end, strata_error *err);
void model_free(model *m);

const model_config *model_get_config(const model *m);
const tokenizer *model_get_tokenizer(const model *m);
int model_layer_begin(const model *m);
int model_layer_end(const model *m);
/* Bytes of weights held in memory (fp32). */
size_t model_weight_bytes(const model *m);

/* KV geometry of this model for a block size (all layers of the model). */
kv_geometry model_kv_geometry(const model *m, int block_tokens);

/* Runs n tokens at positions pos0.. through the whole model (which must hold every layer) and
 * appends their K/V to seq. If seq is empty and n > 1 the prompt is prefilled with exact
 * attention over its fp16-rounded K/V; otherwise tokens go one by one through the decode path
 * (attention over the compressed cache). logits: n_vocab floats for the last token, or, with
 * all_logits, n * n_vocab floats (one row per token). NULL to skip the head.
 * On failure (e.g. STRATA_EFULL from the block pool) the layers of seq may hold different
 * lengths: the caller discards the sequence. */
int model_forward(model *m, kv_seq *seq, const int32_t *tokens, size_t n, size_t pos0,
                  float *logits, bool all_logits, strata_error *err);

#endif
