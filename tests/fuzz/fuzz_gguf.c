/* Fuzz target: the GGUF parser, metadata getters and dequantization must never crash or read
 * out of bounds on arbitrary bytes. */
#include <stdint.h>
#include <stdlib.h>

#include "worker/gguf.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    gguf_file *f = gguf_open_memory(data, size, NULL);
    if (!f)
        return 0;
    for (size_t i = 0; i < gguf_n_kv(f); i++) {
        gguf_str key = gguf_kv_key(f, i);
        (void)key;
    }
    uint32_t u;
    float x;
    bool b;
    gguf_str s;
    gguf_array a;
    gguf_get_u32(f, "llama.block_count", &u, NULL);
    gguf_get_f32(f, "llama.rope.freq_base", &x, NULL);
    gguf_get_bool(f, "tokenizer.ggml.add_bos_token", &b, NULL);
    gguf_get_str(f, "general.architecture", &s, NULL);
    if (gguf_get_array(f, "tokenizer.ggml.tokens", &a, NULL) == STRATA_OK) {
        for (uint64_t i = 0; i < a.n && i < 64; i++) {
            gguf_str t = gguf_array_str(&a, i);
            (void)t;
            (void)gguf_array_int(&a, i);
        }
    }
    for (size_t i = 0; i < gguf_n_tensors(f); i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        if (t->n_elements > (1u << 16))
            continue;
        float *out = malloc((size_t)t->n_elements * sizeof *out);
        if (out) {
            gguf_tensor_to_f32(t, out, NULL);
            free(out);
        }
    }
    gguf_close(f);
    return 0;
}
