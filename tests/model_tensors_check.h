/* Shared by the model tests: a model loaded for a device (model_load_for_device) against the same
 * range loaded for the CPU (model_load), tensor by tensor. Header-only; needs cmocka included. */
#ifndef STRATA_TESTS_MODEL_TENSORS_CHECK_H
#define STRATA_TESTS_MODEL_TENSORS_CHECK_H

#include <stdlib.h>
#include <string.h>

#include "worker/model.h"

/* Every tensor of dev's layers, and its output norm and head when it holds the last layer, read
 * through model_tensor_read (the device's decoding functions) equals host's weights (its fp32
 * norms; its matrices as kern_weights_rows decodes them) bit for bit. synthetic: what every
 * tensor must say it is. */
static inline void expect_tensors_equal_host(const model *host, const model *dev, bool synthetic)
{
    const model_config *c = model_get_config(host);
    const size_t e = (size_t)c->n_embd, ffn = (size_t)c->n_ff * e, embd = (size_t)c->n_vocab * e;
    float *got = malloc((embd > ffn ? embd : ffn) * sizeof *got);   /* the largest tensor */
    float *want = malloc((embd > ffn ? embd : ffn) * sizeof *want);
    assert_non_null(got);
    assert_non_null(want);
    strata_error err = {0};
    model_tensor t;
    for (int il = model_layer_begin(host); il < model_layer_end(host); il++) {
        model_layer_weights w;
        assert_int_equal(model_get_layer_weights(host, il, &w, &err), STRATA_OK);
        const kern_weights none = {0, NULL};
        const kern_weights matrix[MODEL_LAYER_TENSORS] = {none, w.wq, w.wk, w.wv, w.wo, none, w.w_gate, w.w_up, w.w_down};
        for (int role = 0; role < MODEL_LAYER_TENSORS; role++) {
            assert_int_equal(model_tensor_get(dev, (model_tensor_role)role, il, &t, &err), STRATA_OK);
            assert_int_equal(t.synthetic, synthetic);
            model_tensor_read(&t, 0, t.ne0 * t.ne1, got);
            if (matrix[role].data)
                kern_weights_rows(matrix[role], (size_t)t.ne0, 0, (size_t)t.ne1, want);
            else
                memcpy(want, role == MODEL_T_ATTN_NORM ? w.attn_norm : w.ffn_norm, (size_t)t.ne0 * sizeof *want);
            if (memcmp(got, want, (size_t)(t.ne0 * t.ne1) * sizeof *got) != 0)
                fail_msg("layer %d: %s reads differently from model_load's", il, t.name);
        }
    }
    if (model_layer_end(host) == c->n_layers) {
        assert_int_equal(model_tensor_get(dev, MODEL_T_OUTPUT_NORM, 0, &t, &err), STRATA_OK);
        model_tensor_read(&t, 0, e, got);
        assert_memory_equal(got, model_get_output_norm(host), e * sizeof *got);
        assert_int_equal(model_tensor_get(dev, MODEL_T_OUTPUT, 0, &t, &err), STRATA_OK);
        assert_string_equal(t.name, c->tied_output ? "token_embd.weight" : "output.weight");
        model_tensor_read(&t, 0, embd, got);
        kern_weights_rows(model_get_output_weights(host), e, 0, (size_t)c->n_vocab, want);
        assert_memory_equal(got, want, embd * sizeof *got);
        model_tensor_read(&t, 37, 100, got);   /* from inside a block */
        assert_memory_equal(got, want + 37, 100 * sizeof *got);
    }
    free(got);
    free(want);
}

#endif
