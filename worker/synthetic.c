/* Synthetic models: see synthetic.h. */
#include "worker/synthetic.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/weight_values.h"

/* The published hyperparameters (the models' config.json), smallest first. head_dim is always
 * n_embd / n_heads: the forward pass assumes it. The Llama 3.x rope frequency scaling for long
 * contexts is not modelled (the weights are random, only the shapes and costs matter). */
static const synthetic_shape shapes[] = {
    /* for tests: a few layers, grouped-query attention, head_dim 64 so every KV codec's default
     * group (32, GEAR 64) divides it, an untied head like the Llama shapes */
    {.name = "tiny", .n_layers = 4, .n_embd = 256, .n_heads = 4, .n_kv_heads = 2, .head_dim = 64, .n_ff = 512,
     .n_vocab = 384, .n_ctx_train = 2048, .rope_theta = 10000.0f, .rms_eps = 1e-5f, .tied_output = false},
    /* HuggingFaceTB/SmolLM2-135M: the default model's shape */
    {.name = "smollm2-135m", .n_layers = 30, .n_embd = 576, .n_heads = 9, .n_kv_heads = 3, .head_dim = 64,
     .n_ff = 1536, .n_vocab = 49152, .n_ctx_train = 8192, .rope_theta = 100000.0f, .rms_eps = 1e-5f,
     .tied_output = true},
    /* meta-llama/Llama-3.2-1B */
    {.name = "llama3.2-1b", .n_layers = 16, .n_embd = 2048, .n_heads = 32, .n_kv_heads = 8, .head_dim = 64,
     .n_ff = 8192, .n_vocab = 128256, .n_ctx_train = 131072, .rope_theta = 500000.0f, .rms_eps = 1e-5f,
     .tied_output = true},
    /* meta-llama/Llama-2-7b */
    {.name = "llama2-7b", .n_layers = 32, .n_embd = 4096, .n_heads = 32, .n_kv_heads = 32, .head_dim = 128,
     .n_ff = 11008, .n_vocab = 32000, .n_ctx_train = 4096, .rope_theta = 10000.0f, .rms_eps = 1e-5f,
     .tied_output = false},
    /* meta-llama/Meta-Llama-3-8B */
    {.name = "llama3-8b", .n_layers = 32, .n_embd = 4096, .n_heads = 32, .n_kv_heads = 8, .head_dim = 128,
     .n_ff = 14336, .n_vocab = 128256, .n_ctx_train = 8192, .rope_theta = 500000.0f, .rms_eps = 1e-5f,
     .tied_output = false},
    /* meta-llama/Meta-Llama-3-70B */
    {.name = "llama3-70b", .n_layers = 80, .n_embd = 8192, .n_heads = 64, .n_kv_heads = 8, .head_dim = 128,
     .n_ff = 28672, .n_vocab = 128256, .n_ctx_train = 8192, .rope_theta = 500000.0f, .rms_eps = 1e-5f,
     .tied_output = false},
};

#define N_SHAPES (sizeof shapes / sizeof shapes[0])

size_t synthetic_n_shapes(void) { return N_SHAPES; }

const synthetic_shape *synthetic_shape_at(size_t i) { return i < N_SHAPES ? &shapes[i] : NULL; }

const synthetic_shape *synthetic_find_shape(const char *name)
{
    for (size_t i = 0; name && i < N_SHAPES; i++)
        if (strcmp(shapes[i].name, name) == 0)
            return &shapes[i];
    return NULL;
}

bool synthetic_is_path(const char *path)
{
    return path && strncmp(path, SYNTHETIC_PREFIX, strlen(SYNTHETIC_PREFIX)) == 0;
}

/* ---- Parsing ---------------------------------------------------------------------------------- */

static void known_names(char *buf, size_t cap)
{
    size_t o = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < N_SHAPES && o < cap; i++) {
        int k = snprintf(buf + o, cap - o, "%s%s", i ? ", " : "", shapes[i].name);
        if (k < 0)
            break;
        o += (size_t)k;
    }
}

static int fail_malformed(strata_error *err, const char *path, const char *why)
{
    return strata_fail(err, STRATA_EINVAL,
                       "malformed synthetic model '%.160s': %s (expected synthetic:NAME or synthetic:NAME:seed=N, "
                       "N a decimal integer)", path, why);
}

/* A decimal uint64 filling all of s: no sign, no spaces, no overflow. */
static bool parse_u64(const char *s, uint64_t *out)
{
    if (!*s)
        return false;
    uint64_t v = 0;
    for (; *s; s++) {
        if (*s < '0' || *s > '9')
            return false;
        unsigned d = (unsigned)(*s - '0');
        if (v > (UINT64_MAX - d) / 10)
            return false;
        v = v * 10 + d;
    }
    *out = v;
    return true;
}

int synthetic_parse(const char *path, synthetic_spec *out, strata_error *err)
{
    if (!synthetic_is_path(path) || !out)
        return strata_fail(err, STRATA_EINVAL, "'%.160s' is not a synthetic model path (synthetic:NAME)",
                           path ? path : "(null)");
    const char *name = path + strlen(SYNTHETIC_PREFIX);
    const char *colon = strchr(name, ':');
    const size_t name_len = colon ? (size_t)(colon - name) : strlen(name);
    char names[256];
    known_names(names, sizeof names);
    const synthetic_shape *shape = NULL;
    for (size_t i = 0; i < N_SHAPES && !shape; i++)
        if (strlen(shapes[i].name) == name_len && memcmp(shapes[i].name, name, name_len) == 0)
            shape = &shapes[i];
    if (!shape)
        return strata_fail(err, STRATA_EINVAL, "unknown synthetic model shape '%.*s' in '%.160s' (known: %s)",
                           (int)(name_len > 64 ? 64 : name_len), name, path, names);
    uint64_t seed = SYNTHETIC_DEFAULT_SEED;
    if (colon) {
        static const char key[] = "seed=";
        if (strncmp(colon + 1, key, strlen(key)) != 0)
            return fail_malformed(err, path, "only ':seed=N' may follow the name");
        if (!parse_u64(colon + 1 + strlen(key), &seed))
            return fail_malformed(err, path, "the seed is not a decimal integer below 2^64");
    }
    out->shape = shape;
    out->seed = seed;
    return STRATA_OK;
}

void synthetic_config(const synthetic_spec *s, model_config *cfg)
{
    const synthetic_shape *h = s->shape;
    memset(cfg, 0, sizeof *cfg);
    snprintf(cfg->arch, sizeof cfg->arch, "llama");
    snprintf(cfg->name, sizeof cfg->name, "synthetic %s seed %" PRIu64, h->name, s->seed);
    cfg->n_layers = h->n_layers;
    cfg->n_embd = h->n_embd;
    cfg->n_heads = h->n_heads;
    cfg->n_kv_heads = h->n_kv_heads;
    cfg->head_dim = h->head_dim;
    cfg->n_ff = h->n_ff;
    cfg->n_vocab = h->n_vocab;
    cfg->n_ctx_train = h->n_ctx_train;
    cfg->rope_theta = h->rope_theta;
    cfg->rms_eps = h->rms_eps;
    cfg->tied_output = h->tied_output;
}

/* ---- Tokenizer -------------------------------------------------------------------------------- */

tokenizer *synthetic_tokenizer(const synthetic_spec *s, strata_error *err)
{
    const int32_t n = s->shape->n_vocab;
    if (n < SYNTHETIC_EOS + 1) {
        strata_fail(err, STRATA_EINVAL, "synthetic %s: a vocabulary of %d is below the %d byte and control tokens",
                    s->shape->name, (int)n, SYNTHETIC_EOS + 1);
        return NULL;
    }
    /* Every text in one arena: bytes take at most 2, placeholders at most 24 ("<|unused_NNNNNNNNNN|>"). */
    const size_t arena_cap = (size_t)n * 24 + 64;
    char *arena = malloc(arena_cap);
    tokenizer_str *toks = malloc((size_t)n * sizeof *toks);
    uint8_t *types = malloc((size_t)n);
    tokenizer *t = NULL;
    if (!arena || !toks || !types) {
        strata_fail(err, STRATA_ENOMEM, "synthetic %s: out of memory for a vocabulary of %d", s->shape->name, (int)n);
    } else {
        size_t o = 0;
        for (int32_t i = 0; i < n; i++) {
            size_t len;
            if (i < 256) {
                len = tokenizer_byte_text((uint8_t)i, arena + o);
                types[i] = TOKENIZER_TYPE_NORMAL;
            } else if (i <= SYNTHETIC_EOS) {
                len = (size_t)snprintf(arena + o, arena_cap - o, "%s",
                                       i == SYNTHETIC_BOS ? "<|begin_of_text|>" : "<|end_of_text|>");
                types[i] = TOKENIZER_TYPE_CONTROL;
            } else {
                len = (size_t)snprintf(arena + o, arena_cap - o, "<|unused_%d|>", (int)(i - SYNTHETIC_EOS - 1));
                types[i] = TOKENIZER_TYPE_UNUSED;
            }
            toks[i] = (tokenizer_str){arena + o, len};
            o += len;
        }
        const tokenizer_vocab v = {.pre = {"gpt2", 4}, .tokens = toks, .n_tokens = n, .types = types,
                                   .bos = SYNTHETIC_BOS, .eos = SYNTHETIC_EOS, .add_bos = true};
        t = tokenizer_from_vocab(&v, err);
    }
    free(arena);
    free(toks);
    free(types);
    return t;
}

/* ---- Weights ---------------------------------------------------------------------------------- */

static uint64_t fnv1a(const char *s)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) {
        h ^= (uint8_t)*s;
        h *= 0x100000001b3ull;
    }
    return h;
}

synthetic_stream synthetic_tensor_stream(const synthetic_spec *s, const char *name, uint64_t ne0)
{
    /* Uniform on [-a, a) has standard deviation a / sqrt(3). */
    return (synthetic_stream){
        .key = synthetic_mix64(synthetic_mix64(s->seed ^ 0x5eed5eed5eed5eedull) ^ fnv1a(name)),
        .amp = (float)(sqrt(3.0) / sqrt((double)ne0)),
    };
}

void synthetic_fill(const synthetic_spec *s, const char *name, uint64_t ne0, uint64_t ne1, float *out)
{
    const uint64_t n = ne0 * ne1;
    if (ne1 == 1) {   /* a norm's weights: the identity scale, as a trained model's start */
        for (uint64_t i = 0; i < n; i++)
            out[i] = 1.0f;
        return;
    }
    const synthetic_stream st = synthetic_tensor_stream(s, name, ne0);
    for (uint64_t j = 0; j < n / 2; j++) {   /* one draw, two elements */
        const uint64_t r = synthetic_draw(st.key, j);
        out[2 * j] = synthetic_even(r, st.amp);
        out[2 * j + 1] = synthetic_odd(r, st.amp);
    }
    if (n % 2)
        out[n - 1] = synthetic_value(st.key, st.amp, n - 1);
}

/* ---- Memory ----------------------------------------------------------------------------------- */

/* "123", "64K", "512M", "20G" (binary multiples) -> bytes. */
static bool parse_bytes(const char *s, size_t *out)
{
    char num[32];
    size_t len = strlen(s), mult = 1;
    if (len == 0 || len >= sizeof num)
        return false;
    memcpy(num, s, len + 1);
    switch (num[len - 1]) {
    case 'K': case 'k': mult = (size_t)1 << 10; break;
    case 'M': case 'm': mult = (size_t)1 << 20; break;
    case 'G': case 'g': mult = (size_t)1 << 30; break;
    default: break;
    }
    if (mult > 1)
        num[len - 1] = '\0';
    uint64_t v;
    if (!parse_u64(num, &v) || v > SIZE_MAX / mult)
        return false;
    *out = (size_t)v * mult;
    return true;
}

/* A "Key:   N kB" line of /proc/meminfo. */
static bool meminfo_available(size_t *bytes)
{
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f)
        return false;
    char line[256];
    bool found = false;
    while (!found && fgets(line, sizeof line, f)) {
        unsigned long long kb;
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1 && kb <= SIZE_MAX / 1024) {
            *bytes = (size_t)kb * 1024;
            found = true;
        }
    }
    fclose(f);
    return found;
}

static bool read_u64_file(const char *path, uint64_t *v)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return false;
    char buf[64] = {0};
    bool ok = fgets(buf, sizeof buf, f) != NULL;
    fclose(f);
    buf[strcspn(buf, "\n")] = '\0';
    return ok && parse_u64(buf, v);   /* "max" (no limit) does not parse */
}

/* The room left under this process's cgroup v2 memory limit, when it has one. */
static bool cgroup_headroom(size_t *bytes)
{
    uint64_t max, cur;
    if (!read_u64_file("/sys/fs/cgroup/memory.max", &max) || !read_u64_file("/sys/fs/cgroup/memory.current", &cur))
        return false;
    uint64_t room = max > cur ? max - cur : 0;
    *bytes = room > SIZE_MAX ? SIZE_MAX : (size_t)room;
    return true;
}

int synthetic_available_memory(size_t *bytes, const char **source, strata_error *err)
{
    const char *env = getenv(SYNTHETIC_MEM_LIMIT_ENV);
    if (env && *env) {
        if (!parse_bytes(env, bytes))
            return strata_fail(err, STRATA_EINVAL, "%s='%.64s' is not a byte count (e.g. 20G, 512M, 1048576)",
                               SYNTHETIC_MEM_LIMIT_ENV, env);
        *source = SYNTHETIC_MEM_LIMIT_ENV;
        return STRATA_OK;
    }
    size_t avail = SIZE_MAX;
    *source = "MemAvailable in /proc/meminfo";
    if (!meminfo_available(&avail)) {
        long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
        *source = "sysconf(_SC_AVPHYS_PAGES)";
        if (pages > 0 && page > 0 && (unsigned long)pages <= SIZE_MAX / (unsigned long)page)
            avail = (size_t)pages * (size_t)page;
    }
    size_t room;
    if (cgroup_headroom(&room) && room < avail) {
        avail = room;
        *source = "the cgroup's memory.max - memory.current";
    }
    *bytes = avail;
    return STRATA_OK;
}

static double gib(size_t b) { return (double)b / (1024.0 * 1024.0 * 1024.0); }

int synthetic_check_memory(const synthetic_spec *s, int layer_begin, int layer_end, size_t need,
                           strata_error *err)
{
    size_t avail = 0;
    const char *source = "unknown";
    int rc = synthetic_available_memory(&avail, &source, err);
    if (rc != STRATA_OK)
        return rc;
    if (need <= avail)
        return STRATA_OK;
    return strata_fail(err, STRATA_ENOMEM,
                       "synthetic %s layers [%d, %d) need %.2f GiB of fp32 weights, but only %.2f GiB of memory is "
                       "available (%s); load fewer layers (a pipeline stage: --stages) or a smaller shape",
                       s->shape->name, layer_begin, layer_end, gib(need), gib(avail), source);
}
