/* Synthetic models: a Llama-family shape with the published hyperparameters of a real model and
 * random weights from a seed, so throughput can be measured at real sizes without downloading
 * weights. model_load and model_read_meta accept one wherever they accept a GGUF path:
 *
 *   synthetic:NAME             seed 1
 *   synthetic:NAME:seed=N      N a decimal integer in [0, 2^64)
 *
 * NAME is one of the shapes below (synthetic_shape_name); nothing else may follow. Everything
 * is case-sensitive and no spaces are allowed.
 *
 * Weights (fp32): every tensor is its own counter-based stream, keyed by the seed and the
 * tensor's GGUF name ("blk.7.attn_q.weight"), so element i of a tensor is a pure function of
 * (seed, name, i): a pipeline stage holding layers [a, b) has exactly the weights of those layers
 * of the whole model, whatever the load order. Norm weights are 1; matrices are uniform with
 * standard deviation 1/sqrt(fan in) (the embedding and output head: 1/sqrt(n_embd)), which keeps
 * activations and logits of order 1 over many layers.
 *
 * Tokenizer: byte level, no merges: ids 0..255 are the 256 bytes (GPT-2 byte-encoded text,
 * id = byte value), 256 is BOS "<|begin_of_text|>", 257 EOS "<|end_of_text|>" (both control
 * tokens), and the rest up to the shape's vocabulary are placeholders "<|unused_N|>" (type
 * unused: never produced by encoding, printed as their text when generated). Pre-tokenizer
 * "gpt2", BOS added, no chat template. decode(encode(s)) == s for any bytes.
 *
 * No global state: every function is safe from any thread. */
#ifndef STRATA_WORKER_SYNTHETIC_H
#define STRATA_WORKER_SYNTHETIC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvstore/error.h"
#include "worker/model.h"
#include "worker/tokenizer.h"

#define SYNTHETIC_PREFIX "synthetic:"
#define SYNTHETIC_DEFAULT_SEED 1u
/* Token ids of the synthetic vocabulary. */
#define SYNTHETIC_BOS 256
#define SYNTHETIC_EOS 257

/* Environment variable that, when set, replaces the memory the system reports as available for
 * the check before a synthetic model's weights are allocated: bytes, or with a suffix K, M, G
 * (binary: KiB, MiB, GiB). Lets tests and constrained hosts exercise the refusal. */
#define SYNTHETIC_MEM_LIMIT_ENV "STRATA_SYNTHETIC_MEM_LIMIT"

typedef struct synthetic_shape {
    const char *name;
    int n_layers, n_embd, n_heads, n_kv_heads, head_dim, n_ff, n_vocab, n_ctx_train;
    float rope_theta, rms_eps;
    bool tied_output;
} synthetic_shape;

typedef struct synthetic_spec {
    const synthetic_shape *shape;
    uint64_t seed;
} synthetic_spec;

/* True when path names a synthetic model (starts with "synthetic:"), well-formed or not. */
bool synthetic_is_path(const char *path);

/* Parses a synthetic model path. Errors (STRATA_EINVAL, message naming the path): not a
 * synthetic path, an unknown or empty NAME (the message lists the known names), a malformed
 * seed (empty, not decimal, out of range) or anything else after NAME. */
int synthetic_parse(const char *path, synthetic_spec *out, strata_error *err);

/* The shape table, in order of size: synthetic_shape_at(i) for i < synthetic_n_shapes(). */
size_t synthetic_n_shapes(void);
const synthetic_shape *synthetic_shape_at(size_t i);
/* The shape called name, NULL when there is none. */
const synthetic_shape *synthetic_find_shape(const char *name);

/* The model configuration of a spec: the shape's hyperparameters, arch "llama", name
 * "synthetic NAME seed N". */
void synthetic_config(const synthetic_spec *s, model_config *cfg);

/* The byte-level tokenizer described above, of the shape's vocabulary size. */
tokenizer *synthetic_tokenizer(const synthetic_spec *s, strata_error *err);

/* The stream of the matrix called name (ne1 > 1) with fan in ne0: its element i is
 * synthetic_value(key, amp, i) (kernels/weight_values.h), so a device can generate it. */
typedef struct synthetic_stream {
    uint64_t key;
    float amp;
} synthetic_stream;
synthetic_stream synthetic_tensor_stream(const synthetic_spec *s, const char *name, uint64_t ne0);

/* Fills out with the ne0 x ne1 weights of the tensor called name (GGUF naming; ne0 is the fan
 * in, 1-D tensors have ne1 == 1 and are norm weights, all 1). Deterministic in (seed, name). */
void synthetic_fill(const synthetic_spec *s, const char *name, uint64_t ne0, uint64_t ne1, float *out);

/* Memory available for new allocations: $STRATA_SYNTHETIC_MEM_LIMIT when set, else the lesser
 * of /proc/meminfo's MemAvailable (sysconf(_SC_AVPHYS_PAGES) when unreadable) and the cgroup v2
 * limit's headroom (memory.max - memory.current) when there is one. *source names where the
 * figure came from (for messages). Fails (STRATA_EINVAL) only for a malformed environment value. */
int synthetic_available_memory(size_t *bytes, const char **source, strata_error *err);

/* Refuses (STRATA_ENOMEM, message naming both sizes in GiB and the figure's source) when need
 * bytes of weights for layers [layer_begin, layer_end) of s exceed the available memory. */
int synthetic_check_memory(const synthetic_spec *s, int layer_begin, int layer_end, size_t need,
                           strata_error *err);

#endif
