/* Attention over compressed blocks (kernels/cpu/kv_attention.c) against fp64 references:
 *  - the same cache dequantized by a block reader written here from docs/format.md, then
 *    attention in fp64: max |out - ref| / max |ref| <= 1e-5 (only fp32 rounding differs);
 *  - exact fp64 attention on the original values: ||out - exact|| / ||exact|| within a loose,
 *    codec-dependent bound (a sanity check that catches mixed-up groups or axes);
 *  - the KIVI axis ablation: quantizing keys per token instead of per channel on keys with
 *    outlier channels gives a clearly larger attention-score error. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/kv_attention.h"
#include "kvstore/block.h"
#include "kvstore/half.h"
#include "kvstore/kv_cache.h"
#include "ref_bytes.h"
#include "test_rng.h"

enum { NQ = 9, NKV = 3, D = 64, BT = 64 };

/* ---- an independent reader of the block format (docs/format.md), fp64 throughout ---- */

/* Dequantizes one block into K, V: [n_tokens][heads][dim] doubles; returns n_tokens. */
static size_t ref_dequant(const uint8_t *b, double *K, double *V)
{
    assert_int_equal(rd32(b), 0x42564b53u);
    int codec = b[12], kb = b[13], vb = b[14], nsec = b[15];
    size_t T = rd32(b + 20), H = rd16(b + 32), Dm = rd16(b + 34), kg = rd16(b + 36), vg = rd16(b + 38);
    const uint8_t *sec[8] = {0};
    for (int i = 0; i < nsec; i++) {
        const uint8_t *e = b + 64 + 12 * i;
        int id = rd16(e);
        assert_true(id >= 1 && id <= 6);
        sec[id] = b + rd32(e + 4);
    }
    for (size_t t = 0; t < T; t++)
        for (size_t h = 0; h < H; h++)
            for (size_t c = 0; c < Dm; c++) {
                size_t o = (t * H + h) * Dm + c;
                if (codec == 1) {
                    K[o] = ref_half(rd16(sec[5] + 2 * o));
                    V[o] = ref_half(rd16(sec[6] + 2 * o));
                    continue;
                }
                assert_int_equal(codec, 2);
                size_t kr = h * Dm + c, kper = 32 / (size_t)kb;
                uint32_t kw = rd32(sec[1] + kr * (T * (size_t)kb / 8) + 4 * (t / kper));
                unsigned kcode = (kw >> ((t % kper) * (size_t)kb)) & ((1u << kb) - 1);
                const uint8_t *kp = sec[2] + (kr * (T / kg) + t / kg) * 4;
                K[o] = kcode * ref_half(rd16(kp)) + ref_half(rd16(kp + 2));
                size_t vr = t * H + h, vper = 32 / (size_t)vb;
                uint32_t vw = rd32(sec[3] + vr * (Dm * (size_t)vb / 8) + 4 * (c / vper));
                unsigned vcode = (vw >> ((c % vper) * (size_t)vb)) & ((1u << vb) - 1);
                const uint8_t *vp = sec[4] + (vr * (Dm / vg) + c / vg) * 4;
                V[o] = vcode * ref_half(rd16(vp)) + ref_half(rd16(vp + 2));
            }
    return T;
}

/* fp64 attention of one query (NQ heads) over T positions of K, V [T][NKV][D]. */
static void ref_attention(const double *K, const double *V, size_t T, const float *q, double *out)
{
    double *s = malloc(T * sizeof(double));
    assert_non_null(s);
    for (int h = 0; h < NQ; h++) {
        int kvh = h / (NQ / NKV);
        double m = -INFINITY, sum = 0;
        for (size_t j = 0; j < T; j++) {
            double d = 0;
            for (int c = 0; c < D; c++)
                d += (double)q[h * D + c] * K[(j * NKV + (size_t)kvh) * D + (size_t)c];
            s[j] = d / sqrt((double)D);
            m = fmax(m, s[j]);
        }
        for (size_t j = 0; j < T; j++) {
            s[j] = exp(s[j] - m);
            sum += s[j];
        }
        for (int c = 0; c < D; c++) {
            double o = 0;
            for (size_t j = 0; j < T; j++)
                o += s[j] * V[(j * NKV + (size_t)kvh) * D + (size_t)c];
            out[h * D + c] = o / sum;
        }
    }
    free(s);
}

/* Keys with a few large channels (as real post-RoPE keys have), values plain normal. */
static void make_kv(size_t T, uint64_t seed, float *k, float *v)
{
    for (size_t t = 0; t < T; t++)
        for (size_t h = 0; h < NKV; h++)
            for (size_t c = 0; c < D; c++) {
                size_t o = (t * NKV + h) * D + c;
                int outlier = (c == 5 || c == 22 || c == 41 + h);
                k[o] = (float)(outlier ? 6.0 + 3.0 * rng_normal(&seed) : rng_normal(&seed));
                v[o] = (float)rng_normal(&seed);
            }
}

static double l2_rel(const float *got, const double *want, size_t n)
{
    double err = 0, mag = 0;
    for (size_t i = 0; i < n; i++) {
        err += ((double)got[i] - want[i]) * ((double)got[i] - want[i]);
        mag += want[i] * want[i];
    }
    return sqrt(err / mag);
}

static double max_rel(const float *got, const double *want, size_t n)
{
    double err = 0, mag = 0;
    for (size_t i = 0; i < n; i++) {
        err = fmax(err, fabs((double)got[i] - want[i]));
        mag = fmax(mag, fabs(want[i]));
    }
    return err / mag;
}

/* A one-layer cache of T tokens of make_kv data: a prompt, then the last `steps` tokens one at a
 * time. *k and *v hold T + extra tokens (the extra ones for the caller). */
static kv_seq *make_cache(const char *codec_name, size_t T, size_t steps, size_t extra, uint64_t seed,
                          kv_pool **pool, float **k, float **v)
{
    kv_codec_params p;
    strata_error err = {0};
    assert_int_equal(kv_codec_parse(codec_name, &p, &err), STRATA_OK);
    kv_geometry g = {1, NKV, D, BT};
    *pool = kv_pool_create(&g, &p, 64, &err);
    assert_non_null(*pool);
    kv_seq *s = kv_seq_create(*pool, 4096, &err);
    assert_non_null(s);
    const size_t row = NKV * D;
    *k = malloc((T + extra) * row * sizeof(float));
    *v = malloc((T + extra) * row * sizeof(float));
    assert_non_null(*k);
    assert_non_null(*v);
    make_kv(T + extra, seed, *k, *v);
    const size_t prompt = T > steps ? T - steps : T;
    assert_int_equal(kv_seq_append(s, 0, *k, *v, prompt, &err), STRATA_OK);
    for (size_t t = prompt; t < T; t++)
        assert_int_equal(kv_seq_append(s, 0, *k + t * row, *v + t * row, 1, &err), STRATA_OK);
    return s;
}

typedef struct case_result { double vs_dequant, vs_exact; } case_result;

static case_result run_case(const char *codec_name, size_t T, uint64_t seed)
{
    strata_error err = {0};
    kv_pool *pool;
    float *k, *v;
    kv_seq *s = make_cache(codec_name, T, 20, 0, seed, &pool, &k, &v);
    const size_t row = NKV * D;

    kv_layer_view view;
    kv_seq_layer_view(s, 0, &view);
    assert_int_equal(view.n_blocks * BT + view.tail_tokens, T);
    double *K = malloc(T * row * sizeof(double)), *V = malloc(T * row * sizeof(double));
    assert_non_null(K);
    assert_non_null(V);
    size_t at = 0;
    for (size_t i = 0; i < view.n_blocks; i++)
        at += ref_dequant(view.blocks[i], K + at * row, V + at * row);
    for (size_t i = 0; i < view.tail_tokens * row; i++) {
        K[at * row + i] = ref_half(view.tail_k[i]);
        V[at * row + i] = ref_half(view.tail_v[i]);
    }

    float q[NQ * D], out[NQ * D];
    for (int i = 0; i < NQ * D; i++)
        q[i] = (float)(0.7 * rng_normal(&seed));
    size_t scratch_bytes = kern_kv_attention_scratch(&view, NQ);
    void *scratch = aligned_alloc(64, (scratch_bytes + 63) / 64 * 64);
    assert_non_null(scratch);
    assert_int_equal(kern_kv_attention(&view, q, NQ, out, scratch, &err), STRATA_OK);

    double ref[NQ * D], exact[NQ * D];
    ref_attention(K, V, T, q, ref);
    for (size_t i = 0; i < T * row; i++) {
        K[i] = k[i];
        V[i] = v[i];
    }
    ref_attention(K, V, T, q, exact);
    case_result r = {max_rel(out, ref, NQ * D), l2_rel(out, exact, NQ * D)};
    printf("  %-5s T=%4zu (%2zu blocks + %3zu tail): vs fp64 on dequantized %.2e (max), vs exact %.2e (l2)\n", codec_name, T,
           view.n_blocks, view.tail_tokens, r.vs_dequant, r.vs_exact);
    free(scratch);
    free(K);
    free(V);
    free(k);
    free(v);
    kv_seq_destroy(s);
    kv_pool_destroy(pool);
    return r;
}

static void test_agreement(void **state)
{
    (void)state;
    const size_t lengths[] = {1, 50, 64, 128, 192, 256, 1000, 1500};
    struct { const char *codec; double exact_bound; } codecs[] = {{"fp16", 1e-3}, {"kivi4", 0.15}, {"kivi2", 0.75}};
    /* iid normal data is the hard case for a min-max quantizer (no structure to exploit): the
     * measured l2 errors are ~3e-4 (fp16), ~0.10 (kivi4), ~0.52 (kivi2) */
    for (int c = 0; c < 3; c++) {
        double worst_dq = 0, worst_exact = 0;
        for (size_t i = 0; i < sizeof lengths / sizeof lengths[0]; i++) {
            case_result r = run_case(codecs[c].codec, lengths[i], 1000 + i);
            worst_dq = fmax(worst_dq, r.vs_dequant);
            worst_exact = fmax(worst_exact, r.vs_exact);
        }
        printf("  %s worst: %.2e vs dequantized fp64 (max), %.2e vs exact (l2)\n", codecs[c].codec, worst_dq, worst_exact);
        assert_true(worst_dq <= 1e-5);
        assert_true(worst_exact <= codecs[c].exact_bound);
    }
}

/* Bad shapes are EINVAL; blocks that do not belong where the view puts them are EFORMAT. */
static void test_errors(void **state)
{
    (void)state;
    kv_codec_params p;
    strata_error err = {0};
    assert_int_equal(kv_codec_parse("kivi2", &p, &err), STRATA_OK);
    kv_geometry g = {2, NKV, D, BT};
    kv_pool *pool = kv_pool_create(&g, &p, 16, &err);
    kv_seq *s = kv_seq_create(pool, 1000, &err);
    assert_non_null(s);
    const size_t T = 300, row = NKV * D;
    float *k = malloc(T * row * sizeof(float)), *v = malloc(T * row * sizeof(float));
    make_kv(T, 77, k, v);
    assert_int_equal(kv_seq_append(s, 1, k, v, T, &err), STRATA_OK);
    kv_layer_view view;
    kv_seq_layer_view(s, 1, &view);
    size_t bytes = kern_kv_attention_scratch(&view, NQ);
    uint8_t *scratch = aligned_alloc(64, (bytes + 64 + 63) / 64 * 64);
    float q[NQ * D] = {0}, out[NQ * D];
    assert_int_equal(kern_kv_attention(&view, q, NQ, out, scratch, &err), STRATA_OK);
    assert_int_equal(kern_kv_attention(&view, q, 8, out, scratch, &err), STRATA_EINVAL);
    assert_int_equal(kern_kv_attention(&view, q, NQ, out, scratch + 8, &err), STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "aligned"));
    assert_int_equal(kern_kv_attention(NULL, q, NQ, out, scratch, &err), STRATA_EINVAL);

    /* a view claiming another layer: the blocks' layer field disagrees */
    kv_layer_view wrong = view;
    wrong.layer = 0;
    assert_int_equal(kern_kv_attention(&wrong, q, NQ, out, scratch, &err), STRATA_EFORMAT);
    /* blocks out of order: the position check catches it */
    const uint8_t *swapped[2] = {view.blocks[1], view.blocks[0]};
    wrong = view;
    wrong.n_blocks = 2;
    wrong.blocks = swapped;
    assert_int_equal(kern_kv_attention(&wrong, q, NQ, out, scratch, &err), STRATA_EFORMAT);
    /* a damaged block header */
    uint8_t *copy = malloc(view.block_bytes);
    memcpy(copy, view.blocks[0], view.block_bytes);
    copy[13] = 3;
    const uint8_t *bad[1] = {copy};
    wrong = view;
    wrong.n_blocks = 1;
    wrong.blocks = bad;
    memset(&err, 0, sizeof err);
    assert_int_equal(kern_kv_attention(&wrong, q, NQ, out, scratch, &err), STRATA_EFORMAT);
    assert_non_null(strstr(err.msg, "bits"));
    /* a truncated slot size */
    wrong = view;
    wrong.block_bytes = view.block_bytes - 64;
    assert_int_equal(kern_kv_attention(&wrong, q, NQ, out, scratch, &err), STRATA_EFORMAT);
    /* no positions at all */
    kv_layer_view empty;
    kv_seq_layer_view(s, 0, &empty);
    assert_int_equal(kern_kv_attention(&empty, q, NQ, out, scratch, &err), STRATA_EINVAL);
    free(copy);
    free(scratch);
    free(k);
    free(v);
    kv_seq_destroy(s);
    kv_pool_destroy(pool);
}

/* An fp16 block (as a preempted tail would be restored) between KIVI blocks: per-block dispatch. */
static void test_mixed_codecs(void **state)
{
    (void)state;
    const size_t row = NKV * D, T = 3 * BT + 10;
    float *k = malloc(T * row * sizeof(float)), *v = malloc(T * row * sizeof(float));
    make_kv(T, 5, k, v);
    uint8_t *blocks[3];
    size_t bytes = 49280;   /* the largest of the three */
    for (int b = 0; b < 3; b++) {
        kv_block_desc d = {0};
        d.codec = b == 1 ? KV_CODEC_FP16 : KV_CODEC_KIVI;
        d.k_bits = d.v_bits = b == 1 ? 16 : (b == 0 ? 2 : 4);
        d.k_group = d.v_group = b == 1 ? 0 : 32;
        d.residual = b == 1 ? 0 : 128;
        d.layer = 4;
        d.first_pos = (uint64_t)b * BT;
        d.n_tokens = BT;
        d.n_kv_heads = NKV;
        d.head_dim = D;
        blocks[b] = calloc(1, bytes);
        assert_int_equal(kv_block_encode(&d, k + (size_t)b * BT * row, v + (size_t)b * BT * row, blocks[b], bytes,
                                         NULL, NULL), STRATA_OK);
    }
    uint16_t tk[10 * NKV * D], tv[10 * NKV * D];
    double *K = malloc(T * row * sizeof(double)), *V = malloc(T * row * sizeof(double));
    for (int b = 0; b < 3; b++)
        ref_dequant(blocks[b], K + (size_t)b * BT * row, V + (size_t)b * BT * row);
    for (size_t i = 0; i < 10 * row; i++) {
        /* fp16 numbers by construction: multiples of 2^-6 below 32 in magnitude */
        float x = (float)((int)(k[3 * BT * row + i] * 64.0f)) / 64.0f;
        float y = (float)((int)(v[3 * BT * row + i] * 64.0f)) / 64.0f;
        K[3 * BT * row + i] = x;
        V[3 * BT * row + i] = y;
        uint32_t xb, yb;
        memcpy(&xb, &x, 4);
        memcpy(&yb, &y, 4);
        /* build the halves by hand: sign, exponent, 10-bit mantissa (values are normal or 0) */
        uint16_t hx = 0, hy = 0;
        if (x != 0.0f)
            hx = (uint16_t)(((xb >> 16) & 0x8000u) | ((((xb >> 23) & 0xffu) - 112u) << 10) | ((xb >> 13) & 0x3ffu));
        if (y != 0.0f)
            hy = (uint16_t)(((yb >> 16) & 0x8000u) | ((((yb >> 23) & 0xffu) - 112u) << 10) | ((yb >> 13) & 0x3ffu));
        tk[i] = hx;
        tv[i] = hy;
        assert_true(ref_half(hx) == (double)x && ref_half(hy) == (double)y);
    }
    kv_layer_view view = {.layer = 4, .n_kv_heads = NKV, .head_dim = D, .block_tokens = BT, .n_blocks = 3,
                          .blocks = (const uint8_t *const *)blocks, .block_bytes = bytes, .tail_tokens = 10,
                          .tail_k = tk, .tail_v = tv};
    uint64_t seed = 9;
    float q[NQ * D], out[NQ * D];
    for (int i = 0; i < NQ * D; i++)
        q[i] = (float)rng_normal(&seed);
    void *scratch = aligned_alloc(64, (kern_kv_attention_scratch(&view, NQ) + 63) / 64 * 64);
    strata_error err = {0};
    assert_int_equal(kern_kv_attention(&view, q, NQ, out, scratch, &err), STRATA_OK);
    double ref[NQ * D];
    ref_attention(K, V, T, q, ref);
    double rel = max_rel(out, ref, NQ * D);
    printf("  kivi2 + fp16 + kivi4 blocks + tail: %.2e vs fp64 on dequantized\n", rel);
    assert_true(rel <= 1e-5);
    for (int b = 0; b < 3; b++)
        free(blocks[b]);
    free(scratch);
    free(K);
    free(V);
    free(k);
    free(v);
}

/* The KIVI finding (its Table 2): keys have outlier channels, so per-channel groups confine
 * the error to those channels while per-token groups spread an outlier's range over the whole
 * token. Per-channel uses the library (block encode, read back here); per-token is written
 * here in fp64 with exact parameters, which if anything favours it. */
static void per_token_quantize(const double *x, size_t T, size_t Dm, int bits, int G, double *out)
{
    double qmax = (double)((1 << bits) - 1);
    for (size_t t = 0; t < T; t++)
        for (size_t g0 = 0; g0 < Dm; g0 += (size_t)G) {
            const double *grp = x + t * Dm + g0;
            double mn = grp[0], mx = grp[0];
            for (int i = 1; i < G; i++) {
                mn = fmin(mn, grp[i]);
                mx = fmax(mx, grp[i]);
            }
            double s = (mx - mn) / qmax;
            for (int i = 0; i < G; i++) {
                double q = s > 0 ? fmin(qmax, fmax(0.0, round((grp[i] - mn) / s))) : 0;
                out[t * Dm + g0 + (size_t)i] = q * s + mn;
            }
        }
}

static void softmax_row(const double *K, size_t T, const double *q, double *p)
{
    double m = -INFINITY, sum = 0;
    for (size_t j = 0; j < T; j++) {
        double d = 0;
        for (int c = 0; c < D; c++)
            d += q[c] * K[j * D + (size_t)c];
        p[j] = d / sqrt((double)D);
        m = fmax(m, p[j]);
    }
    for (size_t j = 0; j < T; j++) {
        p[j] = exp(p[j] - m);
        sum += p[j];
    }
    for (size_t j = 0; j < T; j++)
        p[j] /= sum;
}

static void test_key_axis_ablation(void **state)
{
    (void)state;
    enum { T = 256 };
    uint64_t seed = 31;
    static float kf[T * D], vf[T * D];
    static double K[T * D], Kc[T * D], Kt[T * D], Vd[T * D];
    for (size_t t = 0; t < T; t++)
        for (size_t c = 0; c < D; c++) {
            int outlier = (c == 3 || c == 17 || c == 50);
            double x = outlier ? 12.0 + 2.0 * rng_normal(&seed) : rng_normal(&seed);
            kf[t * D + c] = (float)((int)(x * 256.0)) / 256.0f;    /* fp16 numbers */
            K[t * D + c] = kf[t * D + c];
            vf[t * D + c] = 0.0f;
        }
    for (int bits = 2; bits <= 4; bits += 2) {
        const size_t bytes = 65536;
        uint8_t *blk = calloc(1, bytes);
        for (int b = 0; b < T / BT; b++) {
            kv_block_desc d = {0};
            d.codec = KV_CODEC_KIVI;
            d.k_bits = d.v_bits = bits;
            d.k_group = d.v_group = 32;
            d.n_tokens = BT;
            d.n_kv_heads = 1;
            d.head_dim = D;
            assert_int_equal(kv_block_encode(&d, kf + (size_t)b * BT * D, vf + (size_t)b * BT * D, blk, bytes, NULL,
                                             NULL), STRATA_OK);
            ref_dequant(blk, Kc + (size_t)b * BT * D, Vd + (size_t)b * BT * D);
        }
        free(blk);
        per_token_quantize(K, T, D, bits, 32, Kt);
        double num_c = 0, num_t = 0, den = 0, rec_c = 0, rec_t = 0, rec_den = 0;
        for (size_t i = 0; i < T * D; i++) {
            rec_c += (Kc[i] - K[i]) * (Kc[i] - K[i]);
            rec_t += (Kt[i] - K[i]) * (Kt[i] - K[i]);
            rec_den += K[i] * K[i];
        }
        static double p[T], pc[T], pt[T];
        for (int trial = 0; trial < 32; trial++) {
            double q[D];
            for (int c = 0; c < D; c++)
                q[c] = rng_normal(&seed);
            softmax_row(K, T, q, p);
            softmax_row(Kc, T, q, pc);
            softmax_row(Kt, T, q, pt);
            for (size_t j = 0; j < T; j++) {
                num_c += (pc[j] - p[j]) * (pc[j] - p[j]);
                num_t += (pt[j] - p[j]) * (pt[j] - p[j]);
                den += p[j] * p[j];
            }
        }
        double ec = sqrt(num_c / den), et = sqrt(num_t / den);
        printf("  %d-bit keys with outlier channels: relative attention-score error per-channel %.4f, "
               "per-token %.4f (%.1fx); key reconstruction error %.4f vs %.4f\n",
               bits, ec, et, et / ec, sqrt(rec_c / rec_den), sqrt(rec_t / rec_den));
        assert_true(et > 2.0 * ec);
    }
}

/* Causal attention of a chunk of rows (kern_kv_attention_rows), as the model runs a prompt chunk
 * that continues a sequence: the chunk's own K/V appended to the view's fp16 tail, row t seeing
 * the cache and chunk rows 0..t. Against fp64 on the dequantized cache for fp16/KIVI (including
 * chunks whose first rows see only part of the blocks), and for every codec against the one-row
 * decode kernel (which never dequantizes a block: an independent implementation) on the view cut
 * where each row's sight ends. Outputs start as NaN. */
static void rows_case(const char *codec_name, size_t T, size_t n_extra, size_t n_rows, size_t visible0,
                      uint64_t seed, double *worst_ref, double *worst_single)
{
    strata_error err = {0};
    kv_pool *pool;
    float *k, *v;
    kv_seq *s = make_cache(codec_name, T, 7, n_extra, seed, &pool, &k, &v);
    const size_t row = NKV * D, all = T + n_extra;
    kv_layer_view view;
    kv_seq_layer_view(s, 0, &view);
    /* the chunk's rows go after the cache's tail, in fp16 */
    const size_t tail = view.tail_tokens + n_extra;
    uint16_t *tk = malloc((tail ? tail : 1) * row * sizeof(uint16_t)), *tv = malloc((tail ? tail : 1) * row * sizeof(uint16_t));
    assert_non_null(tk);
    assert_non_null(tv);
    if (view.tail_tokens) {
        memcpy(tk, view.tail_k, view.tail_tokens * row * sizeof(uint16_t));
        memcpy(tv, view.tail_v, view.tail_tokens * row * sizeof(uint16_t));
    }
    for (size_t i = 0; i < n_extra * row; i++) {
        tk[view.tail_tokens * row + i] = strata_float_to_half(k[T * row + i]);
        tv[view.tail_tokens * row + i] = strata_float_to_half(v[T * row + i]);
    }
    view.tail_tokens = tail;
    view.tail_k = tk;
    view.tail_v = tv;
    assert_int_equal(view.n_blocks * BT + view.tail_tokens, all);

    float *q = malloc(n_rows * NQ * D * sizeof(float)), *out = malloc(n_rows * NQ * D * sizeof(float));
    assert_non_null(q);
    assert_non_null(out);
    for (size_t i = 0; i < n_rows * NQ * D; i++) {
        q[i] = (float)(0.7 * rng_normal(&seed));
        out[i] = NAN;
    }
    const size_t bytes = kern_kv_attention_rows_scratch(&view, NQ, n_rows);
    void *scratch = aligned_alloc(64, (bytes + 63) / 64 * 64);
    assert_non_null(scratch);
    assert_int_equal(kern_kv_attention_rows(&view, q, n_rows, NQ, visible0, out, scratch, &err), STRATA_OK);

    const bool has_ref = strncmp(codec_name, "fp16", 4) == 0 || strncmp(codec_name, "kivi", 4) == 0;
    double *K = malloc(all * row * sizeof(double)), *V = malloc(all * row * sizeof(double));
    assert_non_null(K);
    assert_non_null(V);
    size_t at = 0;
    for (size_t i = 0; has_ref && i < view.n_blocks; i++)
        at += ref_dequant(view.blocks[i], K + at * row, V + at * row);
    for (size_t i = 0; has_ref && i < view.tail_tokens * row; i++) {
        K[at * row + i] = ref_half(tk[i]);
        V[at * row + i] = ref_half(tv[i]);
    }
    float one[NQ * D];
    for (size_t t = 0; t < n_rows; t++) {
        const float *got = out + t * NQ * D;
        if (has_ref) {
            double ref[NQ * D];
            ref_attention(K, V, visible0 + t, q + t * NQ * D, ref);
            *worst_ref = fmax(*worst_ref, max_rel(got, ref, NQ * D));
        }
        const size_t seen = visible0 + t, tail_pos = view.n_blocks * BT;
        if (seen < tail_pos)
            continue;   /* the one-row kernel cannot cut a view inside its blocks */
        kv_layer_view cut = view;
        cut.tail_tokens = seen - tail_pos;
        for (int i = 0; i < NQ * D; i++)
            one[i] = NAN;
        if (cut.n_blocks * BT + cut.tail_tokens == 0)
            continue;
        assert_int_equal(kern_kv_attention(&cut, q + t * NQ * D, NQ, one, scratch, &err), STRATA_OK);
        double want[NQ * D];
        for (int i = 0; i < NQ * D; i++)
            want[i] = one[i];
        *worst_single = fmax(*worst_single, max_rel(got, want, NQ * D));
    }
    for (size_t i = 0; i < n_rows * NQ * D; i++)
        assert_false(isnan(out[i]));
    free(K);
    free(V);
    free(scratch);
    free(q);
    free(out);
    free(tk);
    free(tv);
    free(k);
    free(v);
    kv_seq_destroy(s);
    kv_pool_destroy(pool);
}

static void test_rows_causal(void **state)
{
    (void)state;
    const char *codecs[] = {"fp16", "kivi2", "kivi4", "gear2", "ott2", "tada2"};
    /* (cache tokens, chunk rows after them) around block, row-tile (128) and span (16 blocks)
     * boundaries: blocks over two spans, and a tail longer than a span */
    const size_t shapes[][2] = {{1, 1}, {10, 5}, {64, 16}, {130, 17}, {200, 129}, {300, 33}, {1100, 20}, {10, 1030}};
    for (size_t c = 0; c < sizeof codecs / sizeof codecs[0]; c++) {
        double worst_ref = 0, worst_single = 0;
        for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
            const size_t T = shapes[i][0], n = shapes[i][1];
            rows_case(codecs[c], T, n, n, T + 1, 50 + i, &worst_ref, &worst_single);
        }
        /* rows whose sight starts inside the blocks (the fp64 reference checks these) */
        rows_case(codecs[c], 200, 0, 190, 10, 77, &worst_ref, &worst_single);
        rows_case(codecs[c], 257, 3, 40, 150, 78, &worst_ref, &worst_single);
        if (c < 3)
            printf("  %-5s chunk rows: %.2e vs fp64 on dequantized (max), %.2e vs one row at a time\n", codecs[c],
                   worst_ref, worst_single);
        else   /* this file's block reader knows fp16 and KIVI only */
            printf("  %-5s chunk rows: %.2e vs one row at a time\n", codecs[c], worst_single);
        assert_true(worst_ref <= 1e-5);
        assert_true(worst_single <= 1e-5);
    }
    /* rows past the view, no rows, and a zero sight are refused */
    kv_layer_view view = {.layer = 0, .n_kv_heads = NKV, .head_dim = D, .block_tokens = BT};
    uint16_t tk[4 * NKV * D] = {0}, tv[4 * NKV * D] = {0};
    view.tail_tokens = 4;
    view.tail_k = tk;
    view.tail_v = tv;
    float q[2 * NQ * D] = {0}, out[2 * NQ * D];
    void *scratch = aligned_alloc(64, (kern_kv_attention_rows_scratch(&view, NQ, 2) + 63) / 64 * 64);
    strata_error err = {0};
    assert_int_equal(kern_kv_attention_rows(&view, q, 2, NQ, 4, out, scratch, &err), STRATA_EINVAL);
    assert_int_equal(kern_kv_attention_rows(&view, q, 0, NQ, 1, out, scratch, &err), STRATA_EINVAL);
    assert_int_equal(kern_kv_attention_rows(&view, q, 1, NQ, 0, out, scratch, &err), STRATA_EINVAL);
    assert_int_equal(kern_kv_attention_rows(&view, q, 2, NQ, 3, out, scratch, &err), STRATA_OK);
    free(scratch);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_agreement),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_mixed_codecs),
        cmocka_unit_test(test_key_axis_ablation),
        cmocka_unit_test(test_rows_causal),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
