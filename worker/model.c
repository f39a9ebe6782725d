#include "worker/model.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <utf8proc.h>

#include "kernels/kv_attention.h"
#include "kernels/ops.h"
#include "kernels/weight_values.h"
#include "kvstore/half.h"
#include "worker/gguf.h"
#include "worker/synthetic.h"

/* Matrices stay in the file's format (kern_matmul_w decodes them a panel at a time): decoding is
 * cheaper than reading fp32 from memory, which limits a decode step. Norms are fp32. */
typedef struct layer_weights {
    float *attn_norm, *ffn_norm;
    kern_weights wq, wk, wv, wo, w_gate, w_up, w_down;
} layer_weights;

struct model {
    model_config cfg;
    int layer_begin, layer_end;
    layer_weights *layers;   /* layer_end - layer_begin entries */
    kern_weights tok_embd;   /* [n_vocab][n_embd], present on the first stage or when tied */
    float *output_norm;      /* last stage only */
    kern_weights output;     /* [n_vocab][n_embd]; aliases tok_embd when tied */
    tokenizer *tok;
    size_t weight_bytes;
    bool for_device;         /* model_load_for_device: layers and head stay in src */
    model_progress_fn progress;   /* model_set_progress */
    void *progress_ctx;
    size_t progress_min_tokens;
    struct model_source *src;   /* kept open for model_tensor_get (for_device only) */
};

static int read_u32_key(gguf_file *f, const char *arch, const char *suffix, int *out, strata_error *err)
{
    char key[128];
    uint32_t v;
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int rc = gguf_get_u32(f, key, &v, err);
    if (rc == STRATA_OK) {
        if (v == 0 || v > (1u << 24))
            return strata_fail(err, STRATA_EFORMAT, "model metadata %s = %u is out of range", key, v);
        *out = (int)v;
    }
    return rc;
}

/* The model's name from the file, fit for a terminal line, a log and a JSON or proto string:
 * whole UTF-8 characters only (cut before one that does not fit), an invalid byte or a control
 * character becomes '?'. */
static void display_name(char *dst, size_t cap, const char *src, size_t len)
{
    size_t o = 0;
    for (size_t i = 0; i < len && o + 1 < cap;) {
        utf8proc_int32_t cp;
        utf8proc_ssize_t n = utf8proc_iterate((const utf8proc_uint8_t *)src + i, (utf8proc_ssize_t)(len - i), &cp);
        if (n <= 0 || cp < 0x20 || cp == 0x7f || (cp >= 0x80 && cp < 0xa0)) {
            dst[o++] = '?';
            i += n > 0 ? (size_t)n : 1;
            continue;
        }
        if (o + (size_t)n + 1 > cap)
            break;
        memcpy(dst + o, src + i, (size_t)n);
        o += (size_t)n;
        i += (size_t)n;
    }
    dst[o] = '\0';
}

static int read_config(gguf_file *f, model_config *c, strata_error *err)
{
    gguf_str s;
    int rc = gguf_get_str(f, "general.architecture", &s, err);
    if (rc != STRATA_OK)
        return rc;
    snprintf(c->arch, sizeof c->arch, "%.*s", (int)(s.len < 31 ? s.len : 31), s.ptr);
    if (strcmp(c->arch, "llama") != 0)
        return strata_fail(err, STRATA_EUNSUPPORTED,
                           "model architecture '%s' is not supported (strata runs the llama family)", c->arch);
    if (gguf_get_str(f, "general.name", &s, NULL) == STRATA_OK)
        display_name(c->name, sizeof c->name, s.ptr, s.len);
    if ((rc = read_u32_key(f, c->arch, "block_count", &c->n_layers, err)) ||
        (rc = read_u32_key(f, c->arch, "embedding_length", &c->n_embd, err)) ||
        (rc = read_u32_key(f, c->arch, "attention.head_count", &c->n_heads, err)) ||
        (rc = read_u32_key(f, c->arch, "feed_forward_length", &c->n_ff, err)) ||
        (rc = read_u32_key(f, c->arch, "context_length", &c->n_ctx_train, err)))
        return rc;
    c->n_kv_heads = c->n_heads;
    char key[128];
    snprintf(key, sizeof key, "%s.attention.head_count_kv", c->arch);
    if (gguf_has_key(f, key) && (rc = read_u32_key(f, c->arch, "attention.head_count_kv", &c->n_kv_heads, err)))
        return rc;
    c->rope_theta = 10000.0f;
    snprintf(key, sizeof key, "%s.rope.freq_base", c->arch);
    if (gguf_has_key(f, key) && (rc = gguf_get_f32(f, key, &c->rope_theta, err)))
        return rc;
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", c->arch);
    if ((rc = gguf_get_f32(f, key, &c->rms_eps, err)))
        return rc;
    if (c->n_embd % c->n_heads != 0 || c->n_heads % c->n_kv_heads != 0)
        return strata_fail(err, STRATA_EFORMAT,
                           "model shape is inconsistent: %d embedding dims, %d heads, %d KV heads",
                           c->n_embd, c->n_heads, c->n_kv_heads);
    c->head_dim = c->n_embd / c->n_heads;
    if (c->head_dim % 2 != 0)
        return strata_fail(err, STRATA_EFORMAT, "head dimension %d is odd: RoPE needs pairs", c->head_dim);
    if (!(c->rope_theta > 0.0f) || !(c->rms_eps > 0.0f) || !isfinite(c->rope_theta) || !isfinite(c->rms_eps))
        return strata_fail(err, STRATA_EFORMAT,
                           "model metadata: rope theta %g and rms epsilon %g must be finite and positive",
                           (double)c->rope_theta, (double)c->rms_eps);
    /* RoPE turns every pair of a head; a model rotating only part of each head (or with another
     * head size) would run here with wrong attention, silently: refuse it. */
    snprintf(key, sizeof key, "%s.rope.dimension_count", c->arch);
    int rope_dims = c->head_dim;
    if (gguf_has_key(f, key) && (rc = read_u32_key(f, c->arch, "rope.dimension_count", &rope_dims, err)))
        return rc;
    if (rope_dims != c->head_dim)
        return strata_fail(err, STRATA_EUNSUPPORTED, "model metadata: RoPE over %d dimensions of each %d-dimension "
                           "head; only full-head RoPE is supported", rope_dims, c->head_dim);
    /* A block_count below the file's layers would run a truncated model without a word. */
    for (size_t i = 0; i < gguf_n_tensors(f); i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        unsigned long layer;
        char *end;
        if (!strncmp(t->name, "blk.", 4) && (layer = strtoul(t->name + 4, &end, 10), end > t->name + 4) &&
            layer >= (unsigned long)c->n_layers)
            return strata_fail(err, STRATA_EFORMAT, "tensor %.96s belongs to layer %lu, but %s.block_count is %d",
                               t->name, layer, c->arch, c->n_layers);
    }
    return STRATA_OK;
}

/* ---- Where a model comes from: a GGUF file or a synthetic spec (worker/synthetic.h) ---------- */

struct model_source {
    gguf_file *gguf;      /* NULL for a synthetic model */
    synthetic_spec syn;
};
typedef struct model_source model_source;

/* Opens the GGUF, or parses the synthetic spec. Its messages name the path already. */
static int source_open(const char *path, model_source *src, strata_error *err)
{
    memset(src, 0, sizeof *src);
    if (synthetic_is_path(path))
        return synthetic_parse(path, &src->syn, err);
    src->gguf = gguf_open(path, err);
    return src->gguf ? STRATA_OK : err ? err->code : STRATA_EIO;
}

static void source_close(model_source *src)
{
    gguf_close(src->gguf);
    src->gguf = NULL;
}

/* The configuration (n_vocab is the tokenizer's; tied_output: no separate head) and the
 * tokenizer (*tok NULL on failure). */
static int source_meta(const model_source *src, model_config *cfg, tokenizer **tok, strata_error *err)
{
    *tok = NULL;
    memset(cfg, 0, sizeof *cfg);
    if (!src->gguf) {
        synthetic_config(&src->syn, cfg);
        *tok = synthetic_tokenizer(&src->syn, err);
        return *tok ? STRATA_OK : err ? err->code : STRATA_ENOMEM;
    }
    int rc = read_config(src->gguf, cfg, err);
    if (rc == STRATA_OK && !(*tok = tokenizer_from_gguf(src->gguf, err)))
        rc = err ? err->code : STRATA_EFORMAT;
    if (rc == STRATA_OK && tokenizer_n_vocab(*tok) <= 0)
        rc = strata_fail(err, STRATA_EFORMAT, "model has an empty vocabulary");
    if (rc == STRATA_OK) {
        cfg->n_vocab = tokenizer_n_vocab(*tok);
        cfg->tied_output = gguf_find_tensor(src->gguf, "output.weight") == NULL;
    }
    if (rc != STRATA_OK) {
        tokenizer_free(*tok);
        *tok = NULL;
    }
    return rc;
}

/* The tensors a model's range needs, by role: name and shape [ne1][ne0] (1-D: ne1 == 1). */
static void tensor_spec(const model_config *c, model_tensor_role role, int layer, char name[96], uint64_t *ne0,
                        uint64_t *ne1)
{
    static const char *const suffix[] = {
        [MODEL_T_ATTN_NORM] = "attn_norm", [MODEL_T_WQ] = "attn_q", [MODEL_T_WK] = "attn_k",
        [MODEL_T_WV] = "attn_v", [MODEL_T_WO] = "attn_output", [MODEL_T_FFN_NORM] = "ffn_norm",
        [MODEL_T_GATE] = "ffn_gate", [MODEL_T_UP] = "ffn_up", [MODEL_T_DOWN] = "ffn_down",
    };
    const uint64_t e = (uint64_t)c->n_embd, kvd = (uint64_t)c->n_kv_heads * (uint64_t)c->head_dim;
    const uint64_t ff = (uint64_t)c->n_ff, nv = (uint64_t)c->n_vocab;
    *ne0 = e;
    *ne1 = 1;   /* the norms; set before the switch so that no path leaves it unset */
    switch (role) {
    case MODEL_T_ATTN_NORM: case MODEL_T_FFN_NORM: case MODEL_T_OUTPUT_NORM: break;
    case MODEL_T_WQ: case MODEL_T_WO: *ne1 = e; break;
    case MODEL_T_WK: case MODEL_T_WV: *ne1 = kvd; break;
    case MODEL_T_GATE: case MODEL_T_UP: *ne1 = ff; break;
    case MODEL_T_DOWN: *ne0 = ff; *ne1 = e; break;
    case MODEL_T_OUTPUT: case MODEL_T_TOKEN_EMBD: *ne1 = nv; break;
    }
    if (role == MODEL_T_OUTPUT_NORM)
        snprintf(name, 96, "output_norm.weight");
    else if (role == MODEL_T_TOKEN_EMBD || (role == MODEL_T_OUTPUT && c->tied_output))
        snprintf(name, 96, "token_embd.weight");
    else if (role == MODEL_T_OUTPUT)
        snprintf(name, 96, "output.weight");
    else
        snprintf(name, 96, "blk.%d.%s.weight", layer, suffix[role]);
}

/* Finds the named tensor in src and checks its shape is exactly [ne1][ne0] and its type one
 * strata reads: where its values are, without reading them. */
static int locate(const model_source *src, const char *name, uint64_t ne0, uint64_t ne1, model_tensor *out,
                  strata_error *err)
{
    memset(out, 0, sizeof *out);
    snprintf(out->name, sizeof out->name, "%s", name);
    out->ne0 = ne0;
    out->ne1 = ne1;
    if (!src->gguf) {
        out->synthetic = true;
        if (ne1 > 1) {
            const synthetic_stream st = synthetic_tensor_stream(&src->syn, name, ne0);
            out->stream_key = st.key;
            out->stream_amp = st.amp;
        }
        return STRATA_OK;
    }
    const gguf_tensor *t = gguf_find_tensor(src->gguf, name);
    if (!t)
        return strata_fail(err, STRATA_EFORMAT, "model is missing tensor '%s'", name);
    uint64_t want_dims = ne1 > 1 ? 2 : 1, block_elems, block_bytes;
    if (t->ne[0] != ne0 || t->ne[1] != ne1 || t->ne[2] != 1 || t->ne[3] != 1 || (uint64_t)t->n_dims < want_dims)
        return strata_fail(err, STRATA_EFORMAT, "tensor '%s' has shape [%llu, %llu, %llu, %llu], expected [%llu, %llu]",
                           name, (unsigned long long)t->ne[0], (unsigned long long)t->ne[1],
                           (unsigned long long)t->ne[2], (unsigned long long)t->ne[3], (unsigned long long)ne0,
                           (unsigned long long)ne1);
    if (!gguf_type_block(t->type, &block_elems, &block_bytes))
        return strata_fail(err, STRATA_EUNSUPPORTED,
                           "tensor '%s' has type %s (%u); strata loads F32, F16, BF16, Q8_0, Q4_0 and Q4_1", name,
                           gguf_tensor_type_name(t->type), t->type);
    out->type = t->type;
    out->data = t->data;
    out->bytes = t->nbytes;
    return STRATA_OK;
}

void model_tensor_read(const model_tensor *t, uint64_t first, uint64_t n, float *out)
{
    for (uint64_t i = 0; i < n; i++) {
        const uint64_t at = first + i;
        out[i] = !t->synthetic ? gguf_value(t->type, t->data, at)
                 : t->ne1 == 1 ? 1.0f
                               : synthetic_value(t->stream_key, t->stream_amp, at);
    }
}

/* Dequantizes the named GGUF tensor after checking its shape is exactly [ne1][ne0]. */
static float *read_gguf_tensor(const model_source *src, const char *name, uint64_t ne0, uint64_t ne1,
                               strata_error *err)
{
    model_tensor where;
    if (locate(src, name, ne0, ne1, &where, err) != STRATA_OK)
        return NULL;
    const gguf_tensor *t = gguf_find_tensor(src->gguf, name);
    float *out = malloc((size_t)t->n_elements * sizeof *out);
    if (!out) {
        strata_fail(err, STRATA_ENOMEM, "out of memory loading tensor '%s' (%llu elements)", name,
                    (unsigned long long)t->n_elements);
        return NULL;
    }
    if (gguf_tensor_to_f32(t, out, err) != STRATA_OK) {
        free(out);
        return NULL;
    }
    for (uint64_t i = 0; i < t->n_elements; i++) {
        if (!isfinite(out[i])) {
            strata_fail(err, STRATA_EFORMAT, "tensor '%s' holds a non-finite value at element %llu", name,
                        (unsigned long long)i);
            free(out);
            return NULL;
        }
    }
    return out;
}

/* The fp32 values of the named [ne1][ne0] tensor, from the file or generated; counted in the
 * model's weight bytes. */
static float *load_tensor(model *m, const model_source *src, const char *name, uint64_t ne0, uint64_t ne1,
                          strata_error *err)
{
    float *out;
    if (src->gguf) {
        out = read_gguf_tensor(src, name, ne0, ne1, err);
    } else if ((out = malloc((size_t)(ne0 * ne1) * sizeof *out))) {
        synthetic_fill(&src->syn, name, ne0, ne1, out);
    } else {
        strata_fail(err, STRATA_ENOMEM, "out of memory generating tensor '%s' (%llu elements)", name,
                    (unsigned long long)(ne0 * ne1));
    }
    if (out)
        m->weight_bytes += (size_t)(ne0 * ne1) * sizeof *out;
    return out;
}

/* Checks that every value of a stored matrix is finite, decoding it a few rows at a time. */
static int check_finite(const char *name, kern_weights w, uint64_t ne0, uint64_t ne1, strata_error *err)
{
    const size_t rows_per = ne0 < 16384 ? 16384 / (size_t)ne0 : 1;
    float *buf = malloc(rows_per * (size_t)ne0 * sizeof *buf);
    if (!buf)
        return strata_fail(err, STRATA_ENOMEM, "out of memory checking tensor '%s'", name);
    int rc = STRATA_OK;
    for (uint64_t r0 = 0; rc == STRATA_OK && r0 < ne1; r0 += rows_per) {
        const size_t rows = ne1 - r0 < rows_per ? (size_t)(ne1 - r0) : rows_per;
        kern_weights_rows(w, (size_t)ne0, (size_t)r0, rows, buf);
        for (size_t i = 0; i < rows * (size_t)ne0; i++)
            if (!isfinite(buf[i])) {
                rc = strata_fail(err, STRATA_EFORMAT, "tensor '%s' holds a non-finite value at element %llu", name,
                                 (unsigned long long)(r0 * ne0 + i));
                break;
            }
    }
    free(buf);
    return rc;
}

/* A [ne1][ne0] matrix as the forward pass multiplies by it: a GGUF tensor's own bytes when its
 * rows are whole blocks of a format kern_matmul_w reads (F16, BF16, Q8_0, Q4_0, Q4_1), else its
 * fp32 values (F32 tensors, odd row lengths, synthetic weights). */
static int load_matrix(model *m, const model_source *src, const char *name, uint64_t ne0, uint64_t ne1,
                       kern_weights *out, strata_error *err)
{
    *out = (kern_weights){GGUF_T_F32, NULL};
    model_tensor where;
    if (src->gguf && locate(src, name, ne0, ne1, &where, err) != STRATA_OK)
        return err ? err->code : STRATA_EFORMAT;
    if (src->gguf && where.type != GGUF_T_F32 && kern_weights_row_bytes(where.type, (size_t)ne0) != 0) {
        void *bytes = malloc(where.bytes);
        if (!bytes)
            return strata_fail(err, STRATA_ENOMEM, "out of memory loading tensor '%s' (%zu bytes)", name,
                               (size_t)where.bytes);
        memcpy(bytes, where.data, where.bytes);
        const kern_weights w = {where.type, bytes};
        int rc = check_finite(name, w, ne0, ne1, err);
        if (rc != STRATA_OK) {
            free(bytes);
            return rc;
        }
        *out = w;
        m->weight_bytes += where.bytes;
        return STRATA_OK;
    }
    float *f = load_tensor(m, src, name, ne0, ne1, err);
    if (!f)
        return err ? err->code : STRATA_EFORMAT;
    out->data = f;
    return STRATA_OK;
}

static int load_layer(model *m, const model_source *src, int il, layer_weights *L, strata_error *err)
{
    kern_weights *matrix[] = {
        [MODEL_T_WQ] = &L->wq, [MODEL_T_WK] = &L->wk, [MODEL_T_WV] = &L->wv, [MODEL_T_WO] = &L->wo,
        [MODEL_T_GATE] = &L->w_gate, [MODEL_T_UP] = &L->w_up, [MODEL_T_DOWN] = &L->w_down,
    };
    for (int role = 0; role < MODEL_LAYER_TENSORS; role++) {
        char name[96];
        uint64_t ne0, ne1;
        tensor_spec(&m->cfg, (model_tensor_role)role, il, name, &ne0, &ne1);
        int rc = STRATA_OK;
        if (role == MODEL_T_ATTN_NORM || role == MODEL_T_FFN_NORM) {
            float **norm = role == MODEL_T_ATTN_NORM ? &L->attn_norm : &L->ffn_norm;
            if (!(*norm = load_tensor(m, src, name, ne0, ne1, err)))
                rc = err ? err->code : STRATA_EFORMAT;
        } else {
            rc = load_matrix(m, src, name, ne0, ne1, matrix[role], err);
        }
        if (rc != STRATA_OK)
            return rc;
    }
    return STRATA_OK;
}

size_t model_weight_bytes_for(const model_config *c, int layer_begin, int layer_end)
{
    if (layer_end < 0)
        layer_end = c->n_layers;
    if (layer_begin < 0 || layer_begin >= layer_end || layer_end > c->n_layers)
        return 0;
    const uint64_t e = (uint64_t)c->n_embd, kvd = (uint64_t)c->n_kv_heads * (uint64_t)c->head_dim;
    const uint64_t nv = (uint64_t)c->n_vocab, ff = (uint64_t)c->n_ff;
    /* the nine tensors of load_layer */
    const uint64_t per_layer = 2 * e + 2 * e * e + 2 * e * kvd + 3 * e * ff;
    uint64_t n = per_layer * (uint64_t)(layer_end - layer_begin);
    const bool first = layer_begin == 0, last = layer_end == c->n_layers;
    if (first || (last && c->tied_output))
        n += nv * e;   /* token embedding (also the head when tied) */
    if (last)
        n += e + (c->tied_output ? 0 : nv * e);   /* output norm, separate head */
    return n > SIZE_MAX / sizeof(float) ? SIZE_MAX : (size_t)n * sizeof(float);
}

/* The embedding, output norm and head this model's range needs, then its layers. */
static int load_weights(model *m, const model_source *src, strata_error *err)
{
    const bool first = m->layer_begin == 0, last = m->layer_end == m->cfg.n_layers;
    const uint64_t e = (uint64_t)m->cfg.n_embd, nv = (uint64_t)m->cfg.n_vocab;
    int rc = STRATA_OK;
    if ((first || (last && m->cfg.tied_output)) &&
        (rc = load_matrix(m, src, "token_embd.weight", e, nv, &m->tok_embd, err)) != STRATA_OK)
        return rc;
    if (last) {
        if (!(m->output_norm = load_tensor(m, src, "output_norm.weight", e, 1, err)))
            return err ? err->code : STRATA_EFORMAT;
        if (m->cfg.tied_output)
            m->output = m->tok_embd;
        else if ((rc = load_matrix(m, src, "output.weight", e, nv, &m->output, err)) != STRATA_OK)
            return rc;
    }
    m->layers = calloc((size_t)(m->layer_end - m->layer_begin), sizeof *m->layers);
    if (!m->layers)
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    for (int il = m->layer_begin; rc == STRATA_OK && il < m->layer_end; il++)
        rc = load_layer(m, src, il, &m->layers[il - m->layer_begin], err);
    return rc;
}

/* The layer range (layer_end -1: to the last layer) within the model's layers. */
static int set_layer_range(model *m, int layer_begin, int layer_end, strata_error *err)
{
    if (layer_end < 0)
        layer_end = m->cfg.n_layers;
    if (layer_begin < 0 || layer_begin >= layer_end || layer_end > m->cfg.n_layers)
        return strata_fail(err, STRATA_EINVAL, "layer range [%d, %d) is outside the model's %d layers", layer_begin,
                           layer_end, m->cfg.n_layers);
    m->layer_begin = layer_begin;
    m->layer_end = layer_end;
    return STRATA_OK;
}

/* For the device: the embedding on the first stage (its lookup stays on the host); every other
 * tensor only located, so a missing, misshapen or unreadable one fails here as in model_load. */
static int locate_weights(model *m, strata_error *err)
{
    const uint64_t e = (uint64_t)m->cfg.n_embd, nv = (uint64_t)m->cfg.n_vocab;
    int rc = STRATA_OK;
    if (m->layer_begin == 0 && (rc = load_matrix(m, m->src, "token_embd.weight", e, nv, &m->tok_embd, err)) != STRATA_OK)
        return rc;
    model_tensor t;
    for (int il = m->layer_begin; rc == STRATA_OK && il < m->layer_end; il++)
        for (int role = 0; rc == STRATA_OK && role < MODEL_LAYER_TENSORS; role++)
            rc = model_tensor_get(m, (model_tensor_role)role, il, &t, err);
    if (rc == STRATA_OK && m->layer_end == m->cfg.n_layers)
        if ((rc = model_tensor_get(m, MODEL_T_OUTPUT_NORM, 0, &t, err)) == STRATA_OK)
            rc = model_tensor_get(m, MODEL_T_OUTPUT, 0, &t, err);
    return rc;
}

static model *load(const char *path, int layer_begin, int layer_end, bool for_device, strata_error *err)
{
    model_source src;
    if (source_open(path, &src, err) != STRATA_OK)
        return NULL;
    model *m = calloc(1, sizeof *m);
    if (!m || (for_device && !(m->src = calloc(1, sizeof *m->src)))) {
        strata_fail(err, STRATA_ENOMEM, "out of memory");
        free(m);
        source_close(&src);
        return NULL;
    }
    m->for_device = for_device;
    int rc = source_meta(&src, &m->cfg, &m->tok, err);
    if (rc == STRATA_OK)
        rc = set_layer_range(m, layer_begin, layer_end, err);
    /* Generated weights would take whatever is asked: refuse what cannot fit rather than be
     * killed part way. (A GGUF's own size bounds what it can ask.) For the device only the
     * embedding is on the host. */
    if (rc == STRATA_OK && !src.gguf) {
        const size_t embd = (size_t)m->cfg.n_vocab * (size_t)m->cfg.n_embd * sizeof(float);
        const size_t need = !for_device ? model_weight_bytes_for(&m->cfg, m->layer_begin, m->layer_end)
                            : m->layer_begin == 0 ? embd
                                                  : 0;
        rc = synthetic_check_memory(&src.syn, m->layer_begin, m->layer_end, need, err);
    }
    if (rc == STRATA_OK && for_device) {
        *m->src = src;   /* the model owns it now: the tensors' bytes stay mapped */
        rc = locate_weights(m, err);
    } else {
        if (rc == STRATA_OK)
            rc = load_weights(m, &src, err);
        source_close(&src);
    }
    if (rc != STRATA_OK) {
        if (err)
            strata_error_prefix(err, "loading model '%s'", path);
        model_free(m);
        return NULL;
    }
    return m;
}

model *model_load(const char *path, int layer_begin, int layer_end, strata_error *err)
{
    return load(path, layer_begin, layer_end, false, err);
}

model *model_load_for_device(const char *path, int layer_begin, int layer_end, strata_error *err)
{
    return load(path, layer_begin, layer_end, true, err);
}

bool model_is_for_device(const model *m) { return m->for_device; }

void model_set_progress(model *m, model_progress_fn fn, void *ctx, size_t min_tokens)
{
    m->progress = fn;
    m->progress_ctx = ctx;
    m->progress_min_tokens = min_tokens;
}

int model_tensor_get(const model *m, model_tensor_role role, int layer, model_tensor *out, strata_error *err)
{
    if (!m || !out || !m->for_device)
        return strata_fail(err, STRATA_EINVAL, "model_tensor_get: the model was not loaded for a device");
    const bool first = m->layer_begin == 0, last = m->layer_end == m->cfg.n_layers;
    if ((int)role < MODEL_LAYER_TENSORS) {
        if (layer < m->layer_begin || layer >= m->layer_end)
            return strata_fail(err, STRATA_EINVAL, "layer %d is not held by this model (layers [%d, %d))", layer,
                               m->layer_begin, m->layer_end);
    } else if (role == MODEL_T_TOKEN_EMBD ? !first : !last || role > MODEL_T_TOKEN_EMBD) {
        return strata_fail(err, STRATA_EINVAL, "model_tensor_get: tensor %d is not held by this stage", (int)role);
    }
    char name[96];
    uint64_t ne0, ne1;
    tensor_spec(&m->cfg, role, layer, name, &ne0, &ne1);
    return locate(m->src, name, ne0, ne1, out, err);
}

int model_read_meta(const char *path, model_config *cfg, tokenizer **tok, strata_error *err)
{
    *tok = NULL;
    memset(cfg, 0, sizeof *cfg);
    model_source src;
    int rc = source_open(path, &src, err);
    if (rc != STRATA_OK)
        return rc;
    rc = source_meta(&src, cfg, tok, err);
    source_close(&src);
    if (rc != STRATA_OK && err)
        strata_error_prefix(err, "reading model '%s'", path);
    return rc;
}

void model_free(model *m)
{
    if (!m)
        return;
    if (m->layers) {
        for (int i = 0; i < m->layer_end - m->layer_begin; i++) {
            layer_weights *L = &m->layers[i];
            const void *all[] = {L->attn_norm, L->wq.data, L->wk.data, L->wv.data, L->wo.data, L->ffn_norm,
                                 L->w_gate.data, L->w_up.data, L->w_down.data};
            for (size_t j = 0; j < sizeof all / sizeof all[0]; j++)
                free((void *)all[j]);
        }
        free(m->layers);
    }
    if (m->output.data != m->tok_embd.data)
        free((void *)m->output.data);
    free((void *)m->tok_embd.data);
    free(m->output_norm);
    tokenizer_free(m->tok);
    if (m->src) {
        source_close(m->src);
        free(m->src);
    }
    free(m);
}

const model_config *model_get_config(const model *m) { return &m->cfg; }
const tokenizer *model_get_tokenizer(const model *m) { return m->tok; }
int model_layer_begin(const model *m) { return m->layer_begin; }
int model_layer_end(const model *m) { return m->layer_end; }
size_t model_weight_bytes(const model *m) { return m->weight_bytes; }

int model_get_layer_weights(const model *m, int layer, model_layer_weights *out, strata_error *err)
{
    if (!m || !out || layer < m->layer_begin || layer >= m->layer_end)
        return strata_fail(err, STRATA_EINVAL, "layer %d is not held by this model (layers [%d, %d))", layer,
                           m ? m->layer_begin : 0, m ? m->layer_end : 0);
    if (m->for_device)
        return strata_fail(err, STRATA_EINVAL, "the model was loaded for a device: its layers are not on the host");
    const layer_weights *L = &m->layers[layer - m->layer_begin];
    *out = (model_layer_weights){L->attn_norm, L->ffn_norm, L->wq, L->wk, L->wv, L->wo, L->w_gate, L->w_up, L->w_down};
    return STRATA_OK;
}

kern_weights model_get_token_embedding(const model *m) { return m->tok_embd; }
const float *model_get_output_norm(const model *m) { return m->output_norm; }
kern_weights model_get_output_weights(const model *m)
{
    return m->output_norm ? m->output : (kern_weights){GGUF_T_F32, NULL};
}

void model_embed_tokens(const model *m, const int32_t *tokens, size_t n, float *out)
{
    const size_t e = (size_t)m->cfg.n_embd;
    for (size_t i = 0; i < n; i++)
        kern_weights_rows(m->tok_embd, e, (size_t)tokens[i], 1, out + i * e);
}

kv_geometry model_kv_geometry(const model *m, int block_tokens)
{
    return (kv_geometry){.n_layers = m->cfg.n_layers, .n_kv_heads = m->cfg.n_kv_heads,
                         .head_dim = m->cfg.head_dim, .block_tokens = block_tokens};
}

kv_geometry model_stage_kv_geometry(const model *m, int block_tokens)
{
    return (kv_geometry){.n_layers = m->layer_end - m->layer_begin, .n_kv_heads = m->cfg.n_kv_heads,
                         .head_dim = m->cfg.head_dim, .block_tokens = block_tokens};
}

/* Activations of one forward call over n tokens. */
typedef struct workspace {
    float *x, *xn, *q, *k, *v, *attn, *proj, *gate, *up;
    float *att_scratch;   /* causal prefill: kern_attention_causal_scratch(n) floats */
    void *kv_scratch;     /* attention over the cache, grown on demand */
    size_t kv_scratch_bytes;
    uint16_t *chunk_k, *chunk_v;   /* a chunk's view of the tail: the cache's tail + the chunk, fp16 */
    size_t chunk_cap;              /* halves each holds */
} workspace;

static void workspace_free(workspace *w)
{
    float *all[] = {w->x, w->xn, w->q, w->k, w->v, w->attn, w->proj, w->gate, w->up, w->att_scratch};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        free(all[i]);
    free(w->kv_scratch);
    free(w->chunk_k);
    free(w->chunk_v);
}

size_t model_step_bytes(const model *m, size_t rows)
{
    const model_config *c = &m->cfg;
    const size_t e = (size_t)c->n_embd, kvd = (size_t)c->n_kv_heads * (size_t)c->head_dim, ff = (size_t)c->n_ff;
    const size_t per_row = (5 * e + 2 * kvd + 2 * ff) * sizeof(float);   /* workspace_alloc's buffers */
    const size_t scratch = kern_attention_causal_scratch(rows);
    if (rows > (SIZE_MAX - scratch * sizeof(float)) / per_row)
        return SIZE_MAX;
    return rows * per_row + scratch * sizeof(float);
}

static int workspace_alloc(workspace *w, const model_config *c, size_t n, strata_error *err)
{
    memset(w, 0, sizeof *w);
    const size_t e = (size_t)c->n_embd, kvd = (size_t)c->n_kv_heads * (size_t)c->head_dim;
    w->x = malloc(n * e * sizeof(float));
    w->xn = malloc(n * e * sizeof(float));
    w->q = malloc(n * e * sizeof(float));
    w->k = malloc(n * kvd * sizeof(float));
    w->v = malloc(n * kvd * sizeof(float));
    w->attn = malloc(n * e * sizeof(float));
    w->proj = malloc(n * e * sizeof(float));
    w->gate = malloc(n * (size_t)c->n_ff * sizeof(float));
    w->up = malloc(n * (size_t)c->n_ff * sizeof(float));
    w->att_scratch = malloc(kern_attention_causal_scratch(n) * sizeof(float));
    if (!w->x || !w->xn || !w->q || !w->k || !w->v || !w->attn || !w->proj || !w->gate || !w->up ||
        !w->att_scratch) {
        workspace_free(w);
        return strata_fail(err, STRATA_ENOMEM, "out of memory for activations of %zu tokens", n);
    }
    return STRATA_OK;
}

static int ensure_kv_scratch(workspace *w, size_t bytes, strata_error *err)
{
    if (bytes <= w->kv_scratch_bytes)
        return STRATA_OK;
    size_t rounded = (bytes + 63) / 64 * 64;
    free(w->kv_scratch);
    w->kv_scratch = aligned_alloc(64, rounded);
    if (!w->kv_scratch) {
        w->kv_scratch_bytes = 0;
        return strata_fail(err, STRATA_ENOMEM, "out of memory for attention scratch (%zu bytes)", rounded);
    }
    w->kv_scratch_bytes = rounded;
    return STRATA_OK;
}

/* The output head over n rows. Non-finite logits (weights or metadata that overflow fp32 on
 * some input) would be sampled as token 0 or garbage without a word: they fail the call. */
static int run_head(const model *m, const float *x, size_t n, float *xn, float *logits, strata_error *err)
{
    const model_config *c = &m->cfg;
    kern_rmsnorm(x, m->output_norm, n, (size_t)c->n_embd, c->rms_eps, xn);
    kern_matmul_w(xn, n, (size_t)c->n_embd, m->output, (size_t)c->n_vocab, logits);
    const size_t total = n * (size_t)c->n_vocab;
    for (size_t i = 0; i < total; i++)
        if (!isfinite(logits[i]))
            return strata_fail(err, STRATA_EFORMAT,
                               "the model produced a non-finite logit (%g for token id %zu of row %zu): its weights "
                               "or metadata overflow fp32", (double)logits[i], i % (size_t)c->n_vocab,
                               i / (size_t)c->n_vocab);
    return STRATA_OK;
}

static int run_layer_batch(model *m, const model_batch_item *items, size_t n_items, int il, workspace *w,
                           size_t rows, strata_error *err);

int model_forward(model *m, kv_seq *seq, const int32_t *tokens, size_t n, size_t pos0, float *logits,
                  bool all_logits, strata_error *err)
{
    const model_config *c = &m->cfg;
    if (m->for_device)
        return strata_fail(err, STRATA_EINVAL, "model_forward: the model was loaded for a device, not the CPU");
    if (m->layer_begin != 0 || m->layer_end != c->n_layers)
        return strata_fail(err, STRATA_EINVAL, "model_forward needs every layer; this model holds [%d, %d)",
                           m->layer_begin, m->layer_end);
    if (n == 0)
        return strata_fail(err, STRATA_EINVAL, "no tokens to run");
    for (size_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= c->n_vocab)
            return strata_fail(err, STRATA_EINVAL, "token id %d at index %zu is outside the vocabulary (%d)",
                               tokens[i], i, c->n_vocab);
    if (kv_seq_length(seq, 0) != pos0)
        return strata_fail(err, STRATA_EINVAL, "position %zu does not follow the cache's %zu tokens", pos0,
                           kv_seq_length(seq, 0));

    /* Fail before the first layer rather than part way, which would leave layers uneven. */
    int rc = kv_seq_check_room(seq, n, err);
    if (rc != STRATA_OK)
        return rc;

    const size_t e = (size_t)c->n_embd;
    const model_batch_item item = {.seq = seq, .tokens = tokens, .n_tokens = n, .pos0 = pos0};
    workspace w;
    rc = workspace_alloc(&w, c, n, err);
    if (rc != STRATA_OK)
        return rc;
    model_embed_tokens(m, tokens, n, w.x);
    for (int il = 0; il < c->n_layers && rc == STRATA_OK; il++) {
        rc = run_layer_batch(m, &item, 1, il, &w, n, err);
        if (rc == STRATA_OK && m->progress && n >= m->progress_min_tokens)
            m->progress(m->progress_ctx, il + 1, c->n_layers, n);
    }
    if (rc == STRATA_OK && logits)
        rc = run_head(m, w.x + (all_logits ? 0 : (n - 1) * e), all_logits ? n : 1, w.xn, logits, err);
    workspace_free(&w);
    return rc;
}

/* ---- Batched steps (continuous batching, pipeline stages) ---------------------------------- */

/* Checks every item and the buffers before anything changes; *rows_out = the step's rows,
 * *bad = the failing item (n_items when the failure is not one item's). */
static int batch_validate(const model *m, const model_batch_item *items, size_t n_items, const float *hidden_in,
                          const float *hidden_out, size_t *rows_out, size_t *bad, strata_error *err)
{
    *bad = n_items;
    const model_config *c = &m->cfg;
    const bool first = m->layer_begin == 0, last = m->layer_end == c->n_layers;
    if (!items || n_items == 0)
        return strata_fail(err, STRATA_EINVAL, "batch: no items to run");
    if (!first && !hidden_in)
        return strata_fail(err, STRATA_EINVAL,
                           "batch: hidden_in is NULL, but this stage starts at layer %d and takes the hidden states "
                           "of the stage before it", m->layer_begin);
    if (!last && !hidden_out)
        return strata_fail(err, STRATA_EINVAL,
                           "batch: hidden_out is NULL, but this stage ends at layer %d of %d and passes its hidden "
                           "states on", m->layer_end, c->n_layers);
    const kv_geometry want = model_stage_kv_geometry(m, 0);
    size_t rows = 0;
    for (size_t j = 0; j < n_items; j++) {
        *bad = j;
        const model_batch_item *it = &items[j];
        if (!it->seq)
            return strata_fail(err, STRATA_EINVAL, "batch item %zu has no sequence", j);
        if (it->n_tokens == 0)
            return strata_fail(err, STRATA_EINVAL, "batch item %zu has no tokens", j);
        if (first && !it->tokens)
            return strata_fail(err, STRATA_EINVAL, "batch item %zu has no token ids (the first stage embeds them)", j);
        for (size_t i = 0; it->tokens && i < it->n_tokens; i++)
            if (it->tokens[i] < 0 || it->tokens[i] >= c->n_vocab)
                return strata_fail(err, STRATA_EINVAL,
                                   "batch item %zu: token id %d at index %zu is outside the vocabulary (%d)", j,
                                   it->tokens[i], i, c->n_vocab);
        const kv_geometry *g = kv_pool_geometry(kv_seq_pool(it->seq));
        if (g->n_layers != want.n_layers || g->n_kv_heads != want.n_kv_heads || g->head_dim != want.head_dim)
            return strata_fail(err, STRATA_EINVAL,
                               "batch item %zu: the sequence's KV pool has %d layers of %d KV heads x %d, but this "
                               "stage holds layers [%d, %d) of %d KV heads x %d (use model_stage_kv_geometry)",
                               j, g->n_layers, g->n_kv_heads, g->head_dim, m->layer_begin, m->layer_end,
                               want.n_kv_heads, want.head_dim);
        for (size_t k = 0; k < j; k++)
            if (items[k].seq == it->seq)
                return strata_fail(err, STRATA_EINVAL, "batch items %zu and %zu are the same sequence", k, j);
        const size_t len = kv_seq_length(it->seq, 0);
        if (it->pos0 != len)
            return strata_fail(err, STRATA_EINVAL, "batch item %zu: position %zu does not follow the cache's %zu tokens",
                               j, it->pos0, len);
        if (it->n_tokens > SIZE_MAX / 4 / (size_t)c->n_ff - rows)
            return strata_fail(err, STRATA_EINVAL, "batch: too many tokens in one step");
        rows += it->n_tokens;
    }
    *bad = n_items;
    *rows_out = rows;
    return STRATA_OK;
}

static int fail_item(strata_error *err, int rc, const char *what, size_t item, int il)
{
    if (err)
        strata_error_prefix(err, "%s layer %d (batch item %zu)", what, il, item);
    return rc;
}

/* A prompt chunk continuing a sequence: its n rows attend the layer's cache as it was before the
 * chunk (compressed blocks + fp16 tail) followed by the chunk's own K/V rounded to fp16, row t
 * seeing chunk rows 0..t, all in one pass over the cache (kern_kv_attention_rows). The chunk is
 * appended afterwards by the caller. So chunk tokens see one another exactly as a first prompt's
 * tokens do, and only the earlier chunks compressed. Leaves the sequence unpinned. */
static int attend_chunk(workspace *w, kv_seq *seq, int layer, const float *q, const float *k, const float *v,
                        size_t n, int n_heads, float *attn, strata_error *err)
{
    kv_seq_prefetch_layer(seq, layer + 1);
    kv_layer_view view;
    int rc = kv_seq_acquire_layer(seq, layer, &view, err);
    const size_t kvd = (size_t)view.n_kv_heads * (size_t)view.head_dim, tail = view.tail_tokens + n;
    if (rc == STRATA_OK && tail * kvd > w->chunk_cap) {
        free(w->chunk_k);
        free(w->chunk_v);
        w->chunk_k = malloc(tail * kvd * sizeof(uint16_t));
        w->chunk_v = malloc(tail * kvd * sizeof(uint16_t));
        w->chunk_cap = w->chunk_k && w->chunk_v ? tail * kvd : 0;
        if (!w->chunk_cap)
            rc = strata_fail(err, STRATA_ENOMEM, "out of memory for a chunk of %zu tokens", n);
    }
    if (rc == STRATA_OK) {
        const size_t had = view.tail_tokens * kvd;
        if (had) {
            memcpy(w->chunk_k, view.tail_k, had * sizeof(uint16_t));
            memcpy(w->chunk_v, view.tail_v, had * sizeof(uint16_t));
        }
        for (size_t i = 0; i < n * kvd; i++) {
            w->chunk_k[had + i] = strata_float_to_half(k[i]);
            w->chunk_v[had + i] = strata_float_to_half(v[i]);
        }
        const size_t before = view.n_blocks * (size_t)view.block_tokens + view.tail_tokens;
        view.tail_tokens = tail;
        view.tail_k = w->chunk_k;
        view.tail_v = w->chunk_v;
        rc = ensure_kv_scratch(w, kern_kv_attention_rows_scratch(&view, n_heads, n), err);
        if (rc == STRATA_OK)
            rc = kern_kv_attention_rows(&view, q, n, n_heads, before + 1, attn, w->kv_scratch, err);
    }
    kv_seq_unpin(seq);
    return rc;
}

/* Layer il (of the whole model) over all rows of a batch: the matmuls over every row at once,
 * then attention item by item (a prompt on an empty sequence, a prompt chunk continuing one, or
 * one token), on the sequences' local layer il - layer_begin. */
static int run_layer_batch(model *m, const model_batch_item *items, size_t n_items, int il, workspace *w,
                           size_t rows, strata_error *err)
{
    const model_config *c = &m->cfg;
    const int ll = il - m->layer_begin;
    const layer_weights *L = &m->layers[ll];
    const size_t e = (size_t)c->n_embd, hd = (size_t)c->head_dim;
    const size_t kvd = (size_t)c->n_kv_heads * hd;

    kern_rmsnorm(w->x, L->attn_norm, rows, e, c->rms_eps, w->xn);
    kern_matmul_w(w->xn, rows, e, L->wq, e, w->q);
    kern_matmul_w(w->xn, rows, e, L->wk, kvd, w->k);
    kern_matmul_w(w->xn, rows, e, L->wv, kvd, w->v);
    size_t r0 = 0;
    for (size_t j = 0; j < n_items; j++) {
        for (size_t i = 0; i < items[j].n_tokens; i++) {
            kern_rope(w->q + (r0 + i) * e, (size_t)c->n_heads, hd, items[j].pos0 + i, c->rope_theta);
            kern_rope(w->k + (r0 + i) * kvd, (size_t)c->n_kv_heads, hd, items[j].pos0 + i, c->rope_theta);
        }
        r0 += items[j].n_tokens;
    }
    r0 = 0;
    for (size_t j = 0; j < n_items; j++) {
        kv_seq *seq = items[j].seq;
        const size_t n = items[j].n_tokens;
        float *q = w->q + r0 * e, *k = w->k + r0 * kvd, *v = w->v + r0 * kvd, *attn = w->attn + r0 * e;
        int rc;
        if (n > 1 && items[j].pos0 > 0) {
            rc = attend_chunk(w, seq, ll, q, k, v, n, c->n_heads, attn, err);
            if (rc != STRATA_OK)
                return fail_item(err, rc, "a prompt chunk's attention in", j, il);
        }
        rc = kv_seq_append(seq, ll, k, v, n, err);
        if (rc != STRATA_OK) {
            kv_seq_unpin(seq);
            return fail_item(err, rc, "appending K/V in", j, il);
        }
        if (n > 1 && items[j].pos0 == 0) {
            /* A whole prompt: exact attention at the precision the cache keeps recent tokens in. */
            for (size_t i = 0; i < n * kvd; i++) {
                k[i] = strata_round_half(k[i]);
                v[i] = strata_round_half(v[i]);
            }
            kern_attention_causal(q, k, v, n, (size_t)c->n_heads, (size_t)c->n_kv_heads, hd, attn, w->att_scratch);
        } else if (n == 1) {
            kv_seq_prefetch_layer(seq, ll + 1);
            kv_layer_view view;
            rc = kv_seq_acquire_layer(seq, ll, &view, err);
            if (rc == STRATA_OK)
                rc = ensure_kv_scratch(w, kern_kv_attention_scratch(&view, c->n_heads), err);
            if (rc == STRATA_OK)
                rc = kern_kv_attention(&view, q, c->n_heads, attn, w->kv_scratch, err);
            if (rc != STRATA_OK) {
                kv_seq_unpin(seq);
                return fail_item(err, rc, "attention in", j, il);
            }
        }
        kv_seq_unpin(seq);   /* this layer's blocks may now move down to make room for others */
        r0 += n;
    }
    kern_matmul_w(w->attn, rows, e, L->wo, e, w->proj);
    kern_add(w->x, w->proj, rows * e);

    kern_rmsnorm(w->x, L->ffn_norm, rows, e, c->rms_eps, w->xn);
    kern_matmul_w(w->xn, rows, e, L->w_gate, (size_t)c->n_ff, w->gate);
    kern_matmul_w(w->xn, rows, e, L->w_up, (size_t)c->n_ff, w->up);
    kern_swiglu(w->gate, w->up, rows * (size_t)c->n_ff, w->gate);
    kern_matmul_w(w->gate, rows, (size_t)c->n_ff, L->w_down, e, w->proj);
    kern_add(w->x, w->proj, rows * e);
    return STRATA_OK;
}

/* Validation, then the items' room, summed per pool (they draw on the same slots and tiers): all
 * before the first layer, so a refused step changes nothing. */
static int batch_check(const model *m, const model_batch_item *items, size_t n_items, const float *hidden_in,
                       const float *hidden_out, size_t *rows, size_t *bad, strata_error *err)
{
    int rc = batch_validate(m, items, n_items, hidden_in, hidden_out, rows, bad, err);
    if (rc != STRATA_OK)
        return rc;
    /* One kv_room per pool in the batch, in order of first appearance (one in a stage). */
    kv_room **rooms = calloc(n_items, sizeof *rooms);
    const kv_pool **pools = calloc(n_items, sizeof *pools);
    size_t n_pools = 0;
    if (!rooms || !pools)
        rc = strata_fail(err, STRATA_ENOMEM, "model: out of memory");
    for (size_t j = 0; j < n_items && rc == STRATA_OK; j++) {
        const kv_pool *pool = kv_seq_pool(items[j].seq);
        size_t k = 0;
        while (k < n_pools && pools[k] != pool)
            k++;
        if (k == n_pools) {
            if (!(rooms[k] = kv_room_begin(pool, err))) {
                rc = err ? err->code : STRATA_ENOMEM;
                break;
            }
            pools[n_pools++] = pool;
        }
        rc = kv_room_add(rooms[k], items[j].seq, items[j].n_tokens, err);
        if (rc != STRATA_OK) {
            *bad = j;
            if (err)
                strata_error_prefix(err, "batch item %zu", j);
        }
    }
    for (size_t k = 0; k < n_pools; k++)
        kv_room_end(rooms[k]);
    free(rooms);
    free(pools);
    return rc;
}

int model_batch_check(const model *m, const model_batch_item *items, size_t n_items, const float *hidden_in,
                      const float *hidden_out, size_t *bad_item, strata_error *err)
{
    size_t rows, bad;
    int rc = batch_check(m, items, n_items, hidden_in, hidden_out, &rows, &bad, err);
    if (bad_item)
        *bad_item = bad;
    return rc;
}

int model_forward_batch(model *m, const model_batch_item *items, size_t n_items, const float *hidden_in,
                        float *hidden_out, float *logits, strata_error *err)
{
    const model_config *c = &m->cfg;
    const bool first = m->layer_begin == 0, last = m->layer_end == c->n_layers;
    size_t rows = 0, bad;
    if (m->for_device)
        return strata_fail(err, STRATA_EINVAL, "model_forward_batch: the model was loaded for a device, not the CPU");
    int rc = batch_check(m, items, n_items, hidden_in, hidden_out, &rows, &bad, err);
    if (rc != STRATA_OK)
        return rc;

    const size_t e = (size_t)c->n_embd;
    workspace w;
    rc = workspace_alloc(&w, c, rows, err);
    if (rc != STRATA_OK)
        return rc;
    if (first) {
        size_t r = 0;
        for (size_t j = 0; j < n_items; r += items[j].n_tokens, j++)
            model_embed_tokens(m, items[j].tokens, items[j].n_tokens, w.x + r * e);
    } else {
        memcpy(w.x, hidden_in, rows * e * sizeof(float));
    }
    for (int il = m->layer_begin; il < m->layer_end && rc == STRATA_OK; il++)
        rc = run_layer_batch(m, items, n_items, il, &w, rows, err);
    if (rc == STRATA_OK && !last) {
        memcpy(hidden_out, w.x, rows * e * sizeof(float));
    } else if (rc == STRATA_OK && logits) {
        /* The last row of every item, gathered (w.attn is free now), through the head at once. */
        size_t r = 0;
        for (size_t j = 0; j < n_items; j++) {
            r += items[j].n_tokens;
            memcpy(w.attn + j * e, w.x + (r - 1) * e, e * sizeof(float));
        }
        rc = run_head(m, w.attn, n_items, w.xn, logits, err);
    }
    workspace_free(&w);
    return rc;
}

int model_check_path(const char *path, strata_error *err)
{
    if (!path)
        return strata_fail(err, STRATA_EINVAL, "model_check_path: NULL path");
    if (synthetic_is_path(path)) {
        synthetic_spec spec;
        return synthetic_parse(path, &spec, err);
    }
    struct stat st;
    const char *why = stat(path, &st) != 0      ? strerror(errno)
                      : S_ISDIR(st.st_mode)      ? "is a directory, not a GGUF file"
                      : access(path, R_OK) != 0 ? strerror(errno)
                                                 : NULL;
    return why ? strata_fail(err, STRATA_EINVAL, "model %s: %s", path, why) : STRATA_OK;
}
