/* GGUF reader: a file built byte by byte in the test (so expected values are known without
 * the reader), every truncation and a set of corruptions, and the real default model. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kvstore/half.h"
#include "worker/gguf.h"

typedef struct buf {
    uint8_t data[8192];
    size_t len;
} buf;

static void put(buf *b, const void *p, size_t n)
{
    assert_true(b->len + n <= sizeof b->data);
    memcpy(b->data + b->len, p, n);
    b->len += n;
}
static void put_u32(buf *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(buf *b, uint64_t v) { put(b, &v, 8); }
static void put_f32(buf *b, float v) { put(b, &v, 4); }
static void put_u16(buf *b, uint16_t v) { put(b, &v, 2); }
static void put_str(buf *b, const char *s)
{
    put_u64(b, strlen(s));
    put(b, s, strlen(s));
}

/* Tensor payloads with values chosen so every dequantized number is exact in fp32. */
enum { N_TENSORS = 6 };
static const char *const names[N_TENSORS] = {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"};
static const uint32_t types[N_TENSORS] = {GGUF_T_F32, GGUF_T_F16, GGUF_T_BF16, GGUF_T_Q8_0, GGUF_T_Q4_0, GGUF_T_Q4_1};

static float expected_value(int t, int i)
{
    switch (t) {
    case 0: return (float)i * 0.5f - 3.0f;
    case 1: return (float)i * 0.25f - 1.0f;
    case 2: return (float)i * 2.0f - 16.0f;
    case 3: return 0.5f * (float)(i - 16);                   /* d = 0.5, q = i - 16 */
    /* ggml's 4-bit blocks: byte j holds element j in its low nibble and element j + 16 in its
     * high one. The halves differ here (q = i, then 31 - i), so a decoder that swaps them fails. */
    case 4: return 0.25f * (float)((i < 16 ? i : 31 - i) - 8);   /* d = 0.25 */
    case 5: return 2.0f * (float)(i < 16 ? i : 31 - i) + 1.5f;   /* d = 2, m = 1.5 */
    default: return 0.0f;
    }
}

static void put_tensor_data(buf *b, int t)
{
    switch (t) {
    case 0: for (int i = 0; i < 32; i++) put_f32(b, expected_value(0, i)); break;
    case 1: for (int i = 0; i < 32; i++) put_u16(b, strata_float_to_half(expected_value(1, i))); break;
    case 2: for (int i = 0; i < 32; i++) { float f = expected_value(2, i); uint32_t u; memcpy(&u, &f, 4); put_u16(b, (uint16_t)(u >> 16)); } break;
    case 3:
        put_u16(b, 0x3800); /* 0.5 */
        for (int i = 0; i < 32; i++) { int8_t q = (int8_t)(i - 16); put(b, &q, 1); }
        break;
    case 4:
        put_u16(b, 0x3400); /* 0.25 */
        for (int j = 0; j < 16; j++) { uint8_t q = (uint8_t)(j | ((15 - j) << 4)); put(b, &q, 1); }
        break;
    case 5:
        put_u16(b, 0x4000); /* 2.0 */
        put_u16(b, 0x3e00); /* 1.5 */
        for (int j = 0; j < 16; j++) { uint8_t q = (uint8_t)(j | ((15 - j) << 4)); put(b, &q, 1); }
        break;
    }
}

static size_t tensor_bytes(int t)
{
    static const size_t sizes[N_TENSORS] = {128, 64, 64, 34, 18, 20};
    return sizes[t];
}

static void pad_to(buf *b, size_t align)
{
    while (b->len % align)
        put(b, "", 1);
}

/* A complete little GGUF v3 file: 4 metadata keys and the six tensors above. */
static void build_file(buf *b)
{
    b->len = 0;
    put(b, "GGUF", 4);
    put_u32(b, 3);
    put_u64(b, N_TENSORS);
    put_u64(b, 4);
    put_str(b, "general.architecture"); put_u32(b, GGUF_STRING); put_str(b, "llama");
    put_str(b, "test.count"); put_u32(b, GGUF_UINT16); put_u16(b, 513);
    put_str(b, "test.theta"); put_u32(b, GGUF_FLOAT32); put_f32(b, 100000.0f);
    put_str(b, "test.words"); put_u32(b, GGUF_ARRAY); put_u32(b, GGUF_STRING); put_u64(b, 3);
    put_str(b, "alpha"); put_str(b, ""); put_str(b, "gamma\xc3\xa9");
    uint64_t offset = 0;
    for (int t = 0; t < N_TENSORS; t++) {
        put_str(b, names[t]);
        put_u32(b, 1);
        put_u64(b, 32);
        put_u32(b, types[t]);
        put_u64(b, offset);
        offset += (tensor_bytes(t) + 31) / 32 * 32;
    }
    pad_to(b, 32);
    for (int t = 0; t < N_TENSORS; t++) {
        put_tensor_data(b, t);
        pad_to(b, 32);
    }
}

static void test_builds_and_reads_every_type(void **state)
{
    (void)state;
    static buf b;
    build_file(&b);
    strata_error err = {0};
    gguf_file *f = gguf_open_memory(b.data, b.len, &err);
    assert_non_null(f);
    assert_int_equal(gguf_version(f), 3);
    assert_int_equal(gguf_n_tensors(f), N_TENSORS);

    gguf_str s;
    assert_int_equal(gguf_get_str(f, "general.architecture", &s, &err), STRATA_OK);
    assert_int_equal(s.len, 5);
    assert_memory_equal(s.ptr, "llama", 5);
    uint32_t u;
    assert_int_equal(gguf_get_u32(f, "test.count", &u, &err), STRATA_OK);
    assert_int_equal(u, 513);
    float theta;
    assert_int_equal(gguf_get_f32(f, "test.theta", &theta, &err), STRATA_OK);
    assert_true(theta == 100000.0f);
    gguf_array a;
    assert_int_equal(gguf_get_array(f, "test.words", &a, &err), STRATA_OK);
    assert_int_equal(a.n, 3);
    assert_int_equal(gguf_array_str(&a, 0).len, 5);
    assert_int_equal(gguf_array_str(&a, 1).len, 0);
    assert_memory_equal(gguf_array_str(&a, 2).ptr, "gamma\xc3\xa9", 7);
    assert_int_equal(gguf_array_str(&a, 3).len, 0); /* past the end: empty, not a crash */

    /* Wrong-type and missing keys are errors with messages, not crashes. */
    assert_int_equal(gguf_get_u32(f, "general.architecture", &u, &err), STRATA_EFORMAT);
    assert_int_equal(gguf_get_f32(f, "no.such.key", &theta, &err), STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "no.such.key"));

    for (int t = 0; t < N_TENSORS; t++) {
        const gguf_tensor *tn = gguf_find_tensor(f, names[t]);
        assert_non_null(tn);
        assert_int_equal(tn->type, types[t]);
        assert_int_equal(tn->nbytes, tensor_bytes(t));
        float out[32];
        assert_int_equal(gguf_tensor_to_f32(tn, out, &err), STRATA_OK);
        for (int i = 0; i < 32; i++) {
            if (out[i] != expected_value(t, i))
                fail_msg("tensor %s element %d: got %g, expected %g", names[t], i, (double)out[i],
                         (double)expected_value(t, i));
        }
    }
    assert_null(gguf_find_tensor(f, "missing"));
    gguf_close(f);
}

static void test_every_truncation_is_rejected(void **state)
{
    (void)state;
    static buf b;
    build_file(&b);
    /* The last tensor (Q4_1, 20 bytes) is followed by 12 bytes of alignment padding that a
     * file may omit; any shorter file lacks data. */
    const size_t data_end = b.len - 12;
    for (size_t n = 0; n <= b.len; n++) {
        strata_error err = {0};
        gguf_file *f = gguf_open_memory(b.data, n, &err);
        if (n >= data_end) {
            assert_non_null(f);
            gguf_close(f);
            continue;
        }
        if (f)
            fail_msg("a file truncated to %zu of %zu bytes was accepted", n, b.len);
        assert_true(err.code == STRATA_EFORMAT);
        assert_true(strlen(err.msg) > 0);
    }
}

static void expect_rejected(buf *b, size_t at, const void *bytes, size_t n, int code, const char *needle)
{
    static buf c;
    memcpy(&c, b, sizeof c);
    memcpy(c.data + at, bytes, n);
    strata_error err = {0};
    gguf_file *f = gguf_open_memory(c.data, c.len, &err);
    if (f) {
        gguf_close(f);
        fail_msg("corruption at byte %zu was accepted", at);
    }
    assert_int_equal(err.code, code);
    if (needle && !strstr(err.msg, needle))
        fail_msg("message '%s' does not mention '%s'", err.msg, needle);
}

static void test_corruptions_are_named(void **state)
{
    (void)state;
    static buf b;
    build_file(&b);
    uint32_t v;
    uint64_t big = UINT64_MAX / 2;
    expect_rejected(&b, 0, "GGUG", 4, STRATA_EFORMAT, "magic");
    v = 1;
    expect_rejected(&b, 4, &v, 4, STRATA_EUNSUPPORTED, "version");
    expect_rejected(&b, 8, &big, 8, STRATA_EFORMAT, "tensors");          /* absurd tensor count */
    expect_rejected(&b, 16, &big, 8, STRATA_EFORMAT, "metadata");        /* absurd kv count */
    expect_rejected(&b, 24, &big, 8, STRATA_EFORMAT, NULL);              /* key length */
    /* first key's value type -> unknown type 77 */
    v = 77;
    expect_rejected(&b, 24 + 8 + strlen("general.architecture"), &v, 4, STRATA_EFORMAT, "type");

    /* A key or a tensor name given twice, two tensors sharing bytes: each reader would resolve
     * them its own way (the first key, the last alignment), so the file is refused. */
    const uint8_t *at = memmem(b.data, b.len, "test.count", 10);
    assert_non_null(at);
    expect_rejected(&b, (size_t)(at - b.data), "test.theta", 10, STRATA_EFORMAT, "key 'test.theta' appears twice");
    const char f16_record[] = {3, 0, 0, 0, 0, 0, 0, 0, 'f', '1', '6'};
    at = memmem(b.data, b.len, f16_record, sizeof f16_record);
    assert_non_null(at);
    size_t f16_at = (size_t)(at - b.data);
    expect_rejected(&b, f16_at + 8, "f32", 3, STRATA_EFORMAT, "tensor 'f32' appears twice");
    uint64_t zero = 0;   /* f16's data offset (after n_dims, ne[0], type) -> f32's */
    expect_rejected(&b, f16_at + sizeof f16_record + 4 + 8 + 4, &zero, 8, STRATA_EFORMAT, "overlap");
}

static void test_missing_file_is_an_io_error(void **state)
{
    (void)state;
    strata_error err = {0};
    assert_null(gguf_open("/nonexistent/model.gguf", &err));
    assert_int_equal(err.code, STRATA_EIO);
    assert_non_null(strstr(err.msg, "/nonexistent/model.gguf"));
}

static void test_real_model(void **state)
{
    (void)state;
    const char *path = getenv("STRATA_MODEL") ? getenv("STRATA_MODEL") : STRATA_DEFAULT_MODEL;
    strata_error err = {0};
    gguf_file *f = gguf_open(path, &err);
    if (!f)
        fail_msg("cannot open the default model (%s): %s; run scripts/setup.sh", path, err.msg);
    assert_int_equal(gguf_n_tensors(f), 272);
    uint32_t layers;
    assert_int_equal(gguf_get_u32(f, "llama.block_count", &layers, &err), STRATA_OK);
    assert_int_equal(layers, 30);
    gguf_array tokens;
    assert_int_equal(gguf_get_array(f, "tokenizer.ggml.tokens", &tokens, &err), STRATA_OK);
    assert_int_equal(tokens.n, 49152);
    const gguf_tensor *emb = gguf_find_tensor(f, "token_embd.weight");
    assert_non_null(emb);
    assert_int_equal(emb->type, GGUF_T_Q8_0);
    assert_int_equal(emb->ne[0], 576);
    assert_int_equal(emb->ne[1], 49152);
    const gguf_tensor *q = gguf_find_tensor(f, "blk.0.attn_q.weight");
    assert_non_null(q);
    assert_int_equal(q->type, GGUF_T_Q4_1);
    /* Q4_1 rows dequantize to finite values within the block's [m, m + 15 d] range. */
    float *w = malloc(q->n_elements * sizeof *w);
    assert_non_null(w);
    assert_int_equal(gguf_tensor_to_f32(q, w, &err), STRATA_OK);
    double sum2 = 0;
    for (uint64_t i = 0; i < q->n_elements; i++)
        sum2 += (double)w[i] * w[i];
    assert_true(sum2 > 0.0 && sum2 < 1e9);
    free(w);
    gguf_close(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_builds_and_reads_every_type),
        cmocka_unit_test(test_every_truncation_is_rejected),
        cmocka_unit_test(test_corruptions_are_named),
        cmocka_unit_test(test_missing_file_is_an_io_error),
        cmocka_unit_test(test_real_model),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
