/* Weights built on the device (kernels/cuda_weights.h) against the CPU loader, bit for bit:
 * random GGUF data of every format strata reads decoded to fp32 (== gguf_tensor_to_f32) and to
 * fp16 (== strata_float_to_half of that), whole and in block-aligned pieces; every tensor of the
 * default model decoded on the device equal to model_load's weights; synthetic streams equal to
 * synthetic_fill from any first element; values that are not finite (or beyond fp16) reported
 * at their first element; an unknown type refused; a model file with an infinite scale fails the
 * device's build naming the tensor and element, as the CPU loader does. Outputs are poisoned
 * before each run. Without a CUDA device the test exits 77 (skipped); the fake device
 * (tests/fakecuda) runs it in every build as test_cuda_weights_fake. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "cuda_test_util.h"
#include "kernels/cuda_weights.h"
#include "kernels/weight_values.h"
#include "kvstore/half.h"
#include "worker/cuda/model_cuda.h"
#include "worker/gguf.h"
#include "worker/model.h"
#include "worker/synthetic.h"

static uint64_t seed = 0x77e1647u;

static void *to_device(const void *host, size_t bytes)
{
    void *d = NULL;
    CUDA_CHECK(cudaMalloc(&d, bytes ? bytes : 1));
    if (bytes)
        CUDA_CHECK(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice));
    return d;
}

/* Random data of a format: n elements, fp16 scales in a trained model's range. */
static uint8_t *random_gguf(uint32_t type, uint64_t n, size_t *bytes)
{
    uint64_t be, bb;
    assert_true(gguf_type_block(type, &be, &bb));
    *bytes = (size_t)(n / be * bb);
    uint8_t *p = malloc(*bytes);
    assert_non_null(p);
    for (size_t i = 0; i < *bytes; i++)
        p[i] = (uint8_t)cuda_test_rng(&seed);
    for (uint64_t b = 0; b < n / be; b++) {
        uint8_t *blk = p + b * bb;
        uint16_t h;
        switch (type) {
        case GGUF_T_F32: {
            const float f = cuda_test_uniform(&seed) * 4.0f;
            memcpy(blk, &f, 4);
            break;
        }
        case GGUF_T_F16: h = strata_float_to_half(cuda_test_uniform(&seed) * 4.0f); memcpy(blk, &h, 2); break;
        case GGUF_T_BF16: h = (uint16_t)(strata_f32_bits(cuda_test_uniform(&seed) * 4.0f) >> 16); memcpy(blk, &h, 2); break;
        case GGUF_T_Q4_1:   /* m, then d as the other block formats */
            h = strata_float_to_half(cuda_test_uniform(&seed) * 0.05f);
            memcpy(blk + 2, &h, 2);
            /* fall through */
        default:
            h = strata_float_to_half(fabsf(cuda_test_uniform(&seed)) * 0.02f + 1e-4f);
            memcpy(blk, &h, 2);
            break;
        }
    }
    return p;
}

/* Decodes [0, n) of d_data on the device in pieces of `piece` elements (whole blocks), first
 * offsets as a caller gives them; returns the first bad element reported. */
static unsigned long long decode(uint32_t type, const uint8_t *d_data, uint64_t n, uint64_t piece, void *d_out,
                                 bool f16)
{
    uint64_t be, bb;
    assert_true(gguf_type_block(type, &be, &bb));
    unsigned long long *d_bad = NULL, bad = 0;
    CUDA_CHECK(cudaMalloc((void **)&d_bad, sizeof *d_bad));
    CUDA_CHECK(cudaMemset(d_bad, 0xff, sizeof *d_bad));
    CUDA_CHECK(cudaMemset(d_out, 0xff, (size_t)n * (f16 ? 2 : 4)));   /* poison: NaN either way */
    for (uint64_t at = 0; at < n; at += piece) {
        const uint64_t m = n - at < piece ? n - at : piece;
        assert_int_equal(cuda_weights_from_gguf(type, d_data + at / be * bb, m, at,
                                                (uint8_t *)d_out + at * (f16 ? 2 : 4), f16, d_bad, NULL),
                         0);
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(&bad, d_bad, sizeof bad, cudaMemcpyDeviceToHost));
    cudaFree(d_bad);
    return bad;
}

static void expect_equal_f32(const float *got, const float *want, uint64_t n, const char *what)
{
    for (uint64_t i = 0; i < n; i++)
        if (strata_f32_bits(got[i]) != strata_f32_bits(want[i]))
            fail_msg("%s: element %llu: device %a, CPU %a", what, (unsigned long long)i, (double)got[i],
                     (double)want[i]);
}

static void expect_equal_f16(const uint16_t *got, const float *want, uint64_t n, const char *what)
{
    for (uint64_t i = 0; i < n; i++)
        if (got[i] != strata_float_to_half(want[i]))
            fail_msg("%s: element %llu: device 0x%04x, CPU 0x%04x", what, (unsigned long long)i, got[i],
                     strata_float_to_half(want[i]));
}

static void test_every_format(void **state)
{
    (void)state;
    static const uint32_t types[] = {GGUF_T_F32, GGUF_T_F16, GGUF_T_BF16, GGUF_T_Q8_0, GGUF_T_Q4_0, GGUF_T_Q4_1};
    const uint64_t n = 32 * 1031;
    float *want = malloc(n * sizeof *want), *got = malloc(n * sizeof *got);
    uint16_t *got16 = malloc(n * sizeof *got16);
    assert_true(want && got && got16);
    void *d_out = NULL;
    CUDA_CHECK(cudaMalloc(&d_out, n * sizeof(float)));
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
        size_t bytes;
        uint8_t *data = random_gguf(types[k], n, &bytes);
        const gguf_tensor t = {.name = "random", .n_dims = 1, .ne = {n, 1, 1, 1}, .type = types[k],
                               .n_elements = n, .data = data, .nbytes = bytes};
        strata_error err = {0};
        assert_int_equal(gguf_tensor_to_f32(&t, want, &err), STRATA_OK);
        uint8_t *d_data = to_device(data, bytes);
        const uint64_t pieces[] = {n, 32 * 100};   /* whole, and block-aligned pieces with a short last one */
        for (size_t p = 0; p < 2; p++) {
            char what[64];
            snprintf(what, sizeof what, "%s to fp32, pieces of %llu", gguf_tensor_type_name(types[k]),
                     (unsigned long long)pieces[p]);
            assert_true(decode(types[k], d_data, n, pieces[p], d_out, false) == ~0ull);
            CUDA_CHECK(cudaMemcpy(got, d_out, n * sizeof *got, cudaMemcpyDeviceToHost));
            expect_equal_f32(got, want, n, what);
            snprintf(what, sizeof what, "%s to fp16, pieces of %llu", gguf_tensor_type_name(types[k]),
                     (unsigned long long)pieces[p]);
            assert_true(decode(types[k], d_data, n, pieces[p], d_out, true) == ~0ull);
            CUDA_CHECK(cudaMemcpy(got16, d_out, n * sizeof *got16, cudaMemcpyDeviceToHost));
            expect_equal_f16(got16, want, n, what);
        }
        printf("  %s: %llu elements bit-identical to the CPU loader (fp32 and fp16, whole and in pieces)\n",
               gguf_tensor_type_name(types[k]), (unsigned long long)n);
        cudaFree(d_data);
        free(data);
    }
    cudaFree(d_out);
    free(want);
    free(got);
    free(got16);
}

/* The first element that is not finite (or not finite in fp16) is reported, as an index in the
 * whole tensor; an unknown type is refused. */
static void test_bad_values(void **state)
{
    (void)state;
    const uint64_t n = 4096;
    float *f = malloc(n * sizeof *f);
    assert_non_null(f);
    for (uint64_t i = 0; i < n; i++)
        f[i] = (float)i * 0.25f;
    f[2000] = INFINITY;
    f[1234] = NAN;
    uint8_t *d = to_device(f, n * sizeof *f);
    void *d_out = NULL;
    CUDA_CHECK(cudaMalloc(&d_out, n * sizeof(float)));
    assert_int_equal(decode(GGUF_T_F32, d, n, 1024, d_out, false), 1234);
    f[1234] = 1.0f;
    f[2000] = 1.0f;
    f[77] = 70000.0f;   /* finite in fp32, beyond fp16 */
    CUDA_CHECK(cudaMemcpy(d, f, n * sizeof *f, cudaMemcpyHostToDevice));
    assert_true(decode(GGUF_T_F32, d, n, 1024, d_out, false) == ~0ull);
    assert_int_equal(decode(GGUF_T_F32, d, n, 1024, d_out, true), 77);

    size_t bytes;
    uint8_t *q = random_gguf(GGUF_T_Q8_0, n, &bytes);
    const uint16_t inf = 0x7c00;
    memcpy(q + 3 * 34, &inf, 2);   /* block 3's scale */
    uint8_t *dq = to_device(q, bytes);
    unsigned long long *d_bad = NULL, bad = 0;
    CUDA_CHECK(cudaMalloc((void **)&d_bad, sizeof *d_bad));
    CUDA_CHECK(cudaMemset(d_bad, 0xff, sizeof *d_bad));
    /* a piece of the tensor that starts at element 1024: the report counts from the tensor's start */
    assert_int_equal(cuda_weights_from_gguf(GGUF_T_Q8_0, dq, 512, 1024, d_out, false, d_bad, NULL), 0);
    CUDA_CHECK(cudaMemcpy(&bad, d_bad, sizeof bad, cudaMemcpyDeviceToHost));
    assert_int_equal(bad, 1024 + 3 * 32);
    assert_int_equal(cuda_weights_from_gguf(12 /* Q4_K */, dq, 512, 0, d_out, false, d_bad, NULL),
                     (int)cudaErrorInvalidValue);
    cudaFree(d_bad);
    cudaFree(dq);
    cudaFree(d);
    cudaFree(d_out);
    free(q);
    free(f);
}

/* A synthetic stream from any first element, odd lengths and offsets, equal to synthetic_fill. */
static void test_synthetic(void **state)
{
    (void)state;
    synthetic_spec s;
    assert_int_equal(synthetic_parse("synthetic:tiny:seed=7", &s, NULL), STRATA_OK);
    const uint64_t ne0 = 320, ne1 = 131, n = ne0 * ne1;   /* odd rows: an odd count */
    float *want = malloc(n * sizeof *want), *got = malloc(n * sizeof *got);
    uint16_t *got16 = malloc(n * sizeof *got16);
    assert_true(want && got && got16);
    synthetic_fill(&s, "blk.3.attn_q.weight", ne0, ne1, want);
    const synthetic_stream st = synthetic_tensor_stream(&s, "blk.3.attn_q.weight", ne0);
    void *d_out = NULL;
    CUDA_CHECK(cudaMalloc(&d_out, n * sizeof(float)));
    CUDA_CHECK(cudaMemset(d_out, 0xff, n * sizeof(float)));
    assert_int_equal(cuda_weights_synthetic(st.key, st.amp, 0, 1001, d_out, false, NULL), 0);
    assert_int_equal(cuda_weights_synthetic(st.key, st.amp, 1001, n - 1001, (float *)d_out + 1001, false, NULL), 0);
    CUDA_CHECK(cudaMemcpy(got, d_out, n * sizeof *got, cudaMemcpyDeviceToHost));
    expect_equal_f32(got, want, n, "synthetic, fp32");
    CUDA_CHECK(cudaMemset(d_out, 0xff, n * sizeof(float)));
    assert_int_equal(cuda_weights_synthetic(st.key, st.amp, 0, n, d_out, true, NULL), 0);
    CUDA_CHECK(cudaMemcpy(got16, d_out, n * sizeof *got16, cudaMemcpyDeviceToHost));
    expect_equal_f16(got16, want, n, "synthetic, fp16");
    printf("  synthetic: %llu elements bit-identical to synthetic_fill\n", (unsigned long long)n);
    cudaFree(d_out);
    free(want);
    free(got);
    free(got16);
}

/* Every tensor of the default model (GGUF blocks as in the file) decoded on the device equals
 * model_load's weights (its fp32 norms, its stored matrices as the CPU decodes them). */
static void test_default_model(void **state)
{
    (void)state;
    const char *path = getenv("STRATA_MODEL") ? getenv("STRATA_MODEL") : STRATA_DEFAULT_MODEL;
    strata_error err = {0};
    model *host = model_load(path, 0, -1, &err), *dev = host ? model_load_for_device(path, 0, -1, &err) : NULL;
    if (!dev) {
        model_free(host);
        skip();   /* no model file: test_model says why */
    }
    const model_config *c = model_get_config(host);
    const size_t most = (size_t)c->n_vocab * (size_t)c->n_embd;
    float *got = malloc(most * sizeof *got), *ref = malloc(most * sizeof *ref);
    assert_non_null(got);
    assert_non_null(ref);
    void *d_out = NULL;
    CUDA_CHECK(cudaMalloc(&d_out, most * sizeof(float)));
    size_t n_tensors = 0;
    for (int il = 0; il <= c->n_layers; il++) {
        model_layer_weights w = {0};
        if (il < c->n_layers)
            assert_int_equal(model_get_layer_weights(host, il, &w, &err), STRATA_OK);
        const kern_weights matrix[MODEL_LAYER_TENSORS] = {{0, NULL}, w.wq, w.wk, w.wv, w.wo, {0, NULL}, w.w_gate, w.w_up,
                                                          w.w_down};
        const int n_roles = il < c->n_layers ? MODEL_LAYER_TENSORS : 2;
        for (int r = 0; r < n_roles; r++) {
            const model_tensor_role role = il < c->n_layers ? (model_tensor_role)r : r ? MODEL_T_OUTPUT : MODEL_T_OUTPUT_NORM;
            model_tensor t;
            assert_int_equal(model_tensor_get(dev, role, il, &t, &err), STRATA_OK);
            const kern_weights stored = il < c->n_layers ? matrix[r] : r ? model_get_output_weights(host) : matrix[0];
            const float *norm = il < c->n_layers ? (r == MODEL_T_ATTN_NORM ? w.attn_norm : w.ffn_norm)
                                                 : model_get_output_norm(host);
            if (stored.data)
                kern_weights_rows(stored, (size_t)t.ne0, 0, (size_t)t.ne1, ref);
            else
                memcpy(ref, norm, (size_t)t.ne0 * sizeof *ref);
            uint8_t *d_data = to_device(t.data, t.bytes);
            assert_true(decode(t.type, d_data, t.ne0 * t.ne1, t.ne0 * t.ne1, d_out, false) == ~0ull);
            CUDA_CHECK(cudaMemcpy(got, d_out, (size_t)(t.ne0 * t.ne1) * sizeof *got, cudaMemcpyDeviceToHost));
            expect_equal_f32(got, ref, t.ne0 * t.ne1, t.name);
            cudaFree(d_data);
            n_tensors++;
        }
    }
    printf("  default model: %zu tensors decoded on the device, bit-identical to model_load's\n", n_tensors);
    cudaFree(d_out);
    free(got);
    free(ref);
    model_free(dev);
    model_free(host);
}

/* A copy of the default model with bytes changed, in a temporary file (removed by the caller). */
static char *patched_model(const char *path, const char *tensor, size_t block, uint16_t scale,
                           const char *rename_from, const char *rename_to)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    const long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *bytes = malloc((size_t)size);
    assert_non_null(bytes);
    assert_int_equal(fread(bytes, 1, (size_t)size, f), (size_t)size);
    fclose(f);
    if (tensor) {   /* the tensor's data: where its first 64 bytes stand in the file */
        strata_error err = {0};
        gguf_file *g = gguf_open(path, &err);
        assert_non_null(g);
        const gguf_tensor *t = gguf_find_tensor(g, tensor);
        assert_non_null(t);
        assert_int_equal(t->type, GGUF_T_Q4_1);
        const uint8_t *at = memmem(bytes, (size_t)size, t->data, 64);
        assert_non_null(at);
        memcpy(bytes + (at - bytes) + block * 20, &scale, 2);   /* d of a Q4_1 block */
        gguf_close(g);
    }
    if (rename_from) {
        uint8_t *name = memmem(bytes, (size_t)size, rename_from, strlen(rename_from));
        assert_non_null(name);
        memcpy(name, rename_to, strlen(rename_to));
    }
    char *out = strdup("/tmp/strata-test-model-XXXXXX");
    const int fd = mkstemp(out);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, bytes, (size_t)size), size);
    close(fd);
    free(bytes);
    return out;
}

/* Damaged model files: a weight that is not finite fails the device's build naming the tensor and
 * its first bad element, as the CPU loader names it; a missing tensor fails both loads at once. */
static void test_damaged_model_file(void **state)
{
    (void)state;
    const char *path = getenv("STRATA_MODEL") ? getenv("STRATA_MODEL") : STRATA_DEFAULT_MODEL;
    char *inf = patched_model(path, "blk.2.ffn_up.weight", 2, 0x7c00, NULL, NULL);
    if (!inf)
        skip();   /* no model file: test_model says why */
    strata_error err = {0};
    assert_null(model_load(inf, 0, -1, &err));
    assert_int_equal(err.code, STRATA_EFORMAT);
    assert_non_null(strstr(err.msg, "'blk.2.ffn_up.weight' holds a non-finite value at element 64"));
    model *dev = model_load_for_device(inf, 0, -1, &err);   /* the values are the device's to check */
    if (!dev)
        fail_msg("%s", err.msg);
    assert_int_equal(cuda_select_device(0, &err), STRATA_OK);
    for (int f16 = 0; f16 < 2; f16++) {
        assert_null(cuda_model_create(dev, f16 ? CUDA_WEIGHTS_F16 : CUDA_WEIGHTS_F32, &err));
        assert_int_equal(err.code, STRATA_EFORMAT);
        if (!strstr(err.msg, "tensor 'blk.2.ffn_up.weight' holds a value that is not finite") ||
            !strstr(err.msg, "at element 64"))
            fail_msg("unexpected message: %s", err.msg);
    }
    model_free(dev);
    unlink(inf);
    free(inf);

    char *renamed = patched_model(path, NULL, 0, 0, "blk.3.attn_q.weight", "blk.3.attn_Q.weight");
    assert_null(model_load(renamed, 0, -1, &err));
    assert_non_null(strstr(err.msg, "missing tensor 'blk.3.attn_q.weight'"));
    assert_null(model_load_for_device(renamed, 0, -1, &err));
    assert_non_null(strstr(err.msg, "missing tensor 'blk.3.attn_q.weight'"));
    unlink(renamed);
    free(renamed);
}

int main(void)
{
    if (!cuda_test_have_device("test_cuda_weights"))
        return CUDA_TEST_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_format),
        cmocka_unit_test(test_bad_values),
        cmocka_unit_test(test_synthetic),
        cmocka_unit_test(test_default_model),
        cmocka_unit_test(test_damaged_model_file),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
