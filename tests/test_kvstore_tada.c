/* The TaDA codec (codec 5) and its attention path, against fp64 computations written here:
 *  - the per-token mean across heads is stored as the fp16-rounded mean and restored exactly;
 *    the reconstruction error is the deviation's quantization error alone (within s/2 of its
 *    group), and identical heads reconstruct exactly;
 *  - with a large offset shared by all heads (RoPE-like rotating channels), tada2 is clearly
 *    better than kivi2 on the same data; the error falls with bits, 8 bits is below 1 %;
 *  - attention over views of tada (and mixed tada / kivi) blocks plus an fp16 tail matches
 *    fp64 softmax attention over the values read back by an independent reader;
 *  - section sizes, header fields, determinism; parameter validation.
 * The block reader below follows docs/format.md (KIVI sections + TADA_K_MEAN / TADA_V_MEAN). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/kv_attention.h"
#include "kvstore/block.h"
#include "kvstore/kv_cache.h"
#include "ref_bytes.h"
#include "test_rng.h"

enum { NQ = 9, NKV = 3, D = 64, BT = 64, G = 32 };

/* The fp16 number nearest to x, ties to even (finite, in range): 11 significant bits, or a
 * multiple of 2^-24 below 2^-14. */
static double ref_round_half(double x)
{
    if (x == 0.0)
        return x;
    int e;
    frexp(fabs(x), &e);          /* |x| in [2^(e-1), 2^e) */
    int qe = e - 11 < -24 ? -24 : e - 11;
    return ldexp(nearbyint(ldexp(x, -qe)), qe);
}

/* fp16 bits of an fp16 number (finite, in range). */
static uint16_t ref_half_bits(double x)
{
    if (x == 0.0)
        return 0;
    if (fabs(x) < 0x1p-14)                          /* subnormal: a multiple of 2^-24 */
        return (uint16_t)((uint16_t)(fabs(x) * 0x1p24) | (x < 0 ? 0x8000 : 0));
    int e;
    double m = frexp(fabs(x), &e);                  /* m in [0.5, 1) */
    uint16_t bits = (uint16_t)(((e - 1 + 15) << 10) | ((uint16_t)(m * 2048.0) & 1023));
    return (uint16_t)(bits | (x < 0 ? 0x8000 : 0));
}

/* ---- an independent reader of KIVI (2) and TaDA (5) blocks ---- */

typedef struct ref_block {
    int codec, kb, vb, nsec;
    size_t T, H, Dm, kg, vg;
    const uint8_t *sec[23];
    uint32_t off[23], len[23];
} ref_block;

static void ref_parse(const uint8_t *b, ref_block *r)
{
    memset(r, 0, sizeof *r);
    assert_int_equal(rd32(b), 0x42564b53u);
    r->codec = b[12];
    r->kb = b[13];
    r->vb = b[14];
    r->nsec = b[15];
    r->T = rd32(b + 20);
    r->H = rd16(b + 32);
    r->Dm = rd16(b + 34);
    r->kg = rd16(b + 36);
    r->vg = rd16(b + 38);
    assert_true(r->codec == 2 || r->codec == 5);
    for (int i = 0; i < r->nsec; i++) {
        const uint8_t *e = b + 64 + 12 * i;
        unsigned id = rd16(e);
        assert_true((id >= 1 && id <= 4) || id == 21 || id == 22);
        r->off[id] = rd32(e + 4);
        r->len[id] = rd32(e + 8);
        r->sec[id] = b + r->off[id];
    }
}

/* Dequantized deviation (or KIVI value) of key element (t, h, c) and its group's scale. */
static double ref_kdev(const ref_block *r, size_t t, size_t h, size_t c, double *scale)
{
    size_t row = h * r->Dm + c, per = 32 / (size_t)r->kb;
    uint32_t w = rd32(r->sec[1] + row * (r->T * (size_t)r->kb / 8) + 4 * (t / per));
    unsigned code = (w >> ((t % per) * (size_t)r->kb)) & ((1u << r->kb) - 1);
    const uint8_t *p = r->sec[2] + (row * (r->T / r->kg) + t / r->kg) * 4;
    *scale = ref_half(rd16(p));
    return code * *scale + ref_half(rd16(p + 2));
}

static double ref_vdev(const ref_block *r, size_t t, size_t h, size_t c, double *scale)
{
    size_t row = t * r->H + h, per = 32 / (size_t)r->vb;
    uint32_t w = rd32(r->sec[3] + row * (r->Dm * (size_t)r->vb / 8) + 4 * (c / per));
    unsigned code = (w >> ((c % per) * (size_t)r->vb)) & ((1u << r->vb) - 1);
    const uint8_t *p = r->sec[4] + (row * (r->Dm / r->vg) + c / r->vg) * 4;
    *scale = ref_half(rd16(p));
    return code * *scale + ref_half(rd16(p + 2));
}

static double ref_kmean(const ref_block *r, size_t t, size_t c)
{
    return r->codec == 5 ? ref_half(rd16(r->sec[21] + 2 * (t * r->Dm + c))) : 0.0;
}
static double ref_vmean(const ref_block *r, size_t t, size_t c)
{
    return r->codec == 5 ? ref_half(rd16(r->sec[22] + 2 * (t * r->Dm + c))) : 0.0;
}

/* Reads a whole block as fp64 rows [T][H][D]: mean + dequantized deviation. Returns T. */
static size_t ref_decode(const uint8_t *b, double *K, double *V)
{
    ref_block r;
    ref_parse(b, &r);
    double s;
    for (size_t t = 0; t < r.T; t++)
        for (size_t h = 0; h < r.H; h++)
            for (size_t c = 0; c < r.Dm; c++) {
                size_t o = (t * r.H + h) * r.Dm + c;
                K[o] = ref_kmean(&r, t, c) + ref_kdev(&r, t, h, c, &s);
                V[o] = ref_vmean(&r, t, c) + ref_vdev(&r, t, h, c, &s);
            }
    return r.T;
}

/* ---- data ---- */

/* Rows [T][H][D]: a part shared by all heads plus per-head noise N(0, noise^2). The shared part
 * is amp * cos(w_c t + phi_c) on four channels (a rotating large offset, as post-RoPE keys
 * carry) and N(0, shared^2) on the others. */
static void make_rows(size_t T, size_t H, uint64_t seed, double amp, double shared, double noise, float *x)
{
    for (size_t t = 0; t < T; t++)
        for (size_t c = 0; c < D; c++) {
            bool big = c == 5 || c == 21 || c == 38 || c == 50;
            double common = big ? amp * cos(0.07 * (double)(1 + c % 5) * (double)t + (double)c)
                                : shared * rng_normal(&seed);
            for (size_t h = 0; h < H; h++)
                x[(t * H + h) * D + c] = (float)(common + noise * rng_normal(&seed));
        }
}

static void round_rows_to_half(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (float)ref_round_half(x[i]);
}

static kv_block_desc desc_for(const char *codec, size_t H, uint32_t layer, uint64_t first_pos)
{
    kv_codec_params p;
    strata_error err = {0};
    assert_int_equal(kv_codec_parse(codec, &p, &err), STRATA_OK);
    kv_geometry g = {1, (int)H, D, BT};
    assert_int_equal(kv_codec_validate(&p, &g, &err), STRATA_OK);
    kv_block_desc d;
    kv_block_desc_init(&d, &p, &g, layer, first_pos);
    return d;
}

/* Encodes T rows (a multiple of BT) block by block with the library and decodes them back with
 * the library; returns the block size. */
static size_t lib_roundtrip(const char *codec, size_t H, size_t T, const float *k, const float *v, float *kd, float *vd)
{
    const size_t row = H * D;
    size_t bytes = 0;
    for (size_t b0 = 0; b0 < T; b0 += BT) {
        kv_block_desc d = desc_for(codec, H, 0, b0);
        bytes = kv_block_bytes(&d);
        assert_true(bytes > 0);
        uint8_t *blk = malloc(bytes);
        assert_non_null(blk);
        strata_error err = {0};
        assert_int_equal(kv_block_encode(&d, k + b0 * row, v + b0 * row, blk, bytes, NULL, &err), STRATA_OK);
        kv_block parsed;
        assert_int_equal(kv_block_verify(blk, bytes, &parsed, &err), STRATA_OK);
        assert_int_equal(kv_block_decode(&parsed, kd + b0 * row, vd + b0 * row, &err), STRATA_OK);
        free(blk);
    }
    return bytes;
}

static double rel_frobenius(const float *got, const float *want, size_t n)
{
    double e = 0, m = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)got[i] - (double)want[i];
        e += d * d;
        m += (double)want[i] * (double)want[i];
    }
    return sqrt(e / m);
}

/* ---- (a) the mean is restored exactly; the error is the deviation's alone ---- */

static void check_block_against_input(const uint8_t *blk, size_t bytes, const float *k, const float *v)
{
    ref_block r;
    ref_parse(blk, &r);
    assert_int_equal(r.codec, 5);
    const size_t T = r.T, H = r.H;
    /* the stored means are the fp16-rounded means across heads, or 0 where a deviation from that
     * mean (in float, as the writer subtracts it) would leave the fp16 range */
    for (size_t t = 0; t < T; t++)
        for (size_t c = 0; c < D; c++) {
            double sk = 0, sv = 0;
            for (size_t h = 0; h < H; h++) {
                sk += k[(t * H + h) * D + c];
                sv += v[(t * H + h) * D + c];
            }
            double mk = ref_round_half(sk / (double)H), mv = ref_round_half(sv / (double)H);
            for (size_t h = 0; h < H; h++) {
                if (fabsf(k[(t * H + h) * D + c] - (float)mk) > 65504.0f)
                    mk = 0.0;
                if (fabsf(v[(t * H + h) * D + c] - (float)mv) > 65504.0f)
                    mv = 0.0;
            }
            assert_true(ref_kmean(&r, t, c) == mk);
            assert_true(ref_vmean(&r, t, c) == mv);
        }
    /* decoded = mean + dequantized deviation; decoded - input = the deviation's error */
    float *kd = malloc(T * H * D * sizeof(float)), *vd = malloc(T * H * D * sizeof(float));
    assert_non_null(kd);
    assert_non_null(vd);
    kv_block parsed;
    strata_error err = {0};
    assert_int_equal(kv_block_verify(blk, bytes, &parsed, &err), STRATA_OK);
    assert_int_equal(kv_block_decode(&parsed, kd, vd, &err), STRATA_OK);
    for (int which = 0; which < 2; which++) {
        const float *x = which ? v : k, *xd = which ? vd : kd;
        for (size_t t = 0; t < T; t++)
            for (size_t h = 0; h < H; h++)
                for (size_t c = 0; c < D; c++) {
                    size_t o = (t * H + h) * D + c;
                    double s;
                    double m = which ? ref_vmean(&r, t, c) : ref_kmean(&r, t, c);
                    double dq = which ? ref_vdev(&r, t, h, c, &s) : ref_kdev(&r, t, h, c, &s);
                    double got = xd[o], want = x[o];
                    /* fp32 evaluation of q s + z and of m + deq: a few ulps */
                    double ulp = 0x1p-22 * (fabs(m) + fabs(dq) + fabs(want));
                    assert_true(fabs((got - m) - dq) <= ulp);
                    double dev = want - m;                         /* exact deviation */
                    assert_true(fabs((got - want) - (dq - dev)) <= ulp);
                    assert_true(fabs(got - want) <= s / 2 + ulp);
                }
    }
    free(kd);
    free(vd);
}

/* Rows k, v encoded as one block of codec for that layer and first position; the caller frees it. */
static uint8_t *encode_rows(const char *codec, size_t H, uint32_t layer, uint64_t first_pos, const float *k,
                            const float *v, size_t *bytes)
{
    kv_block_desc d = desc_for(codec, H, layer, first_pos);
    *bytes = kv_block_bytes(&d);
    uint8_t *blk = malloc(*bytes);
    assert_non_null(blk);
    assert_int_equal(kv_block_encode(&d, k, v, blk, *bytes, NULL, NULL), STRATA_OK);
    return blk;
}

static void test_mean_restored(void **state)
{
    (void)state;
    const size_t H = NKV, n = (size_t)BT * H * D;
    float *k = malloc(n * sizeof(float)), *v = malloc(n * sizeof(float));
    float *kd = malloc(n * sizeof(float)), *vd = malloc(n * sizeof(float));
    assert_non_null(k);
    assert_non_null(v);
    assert_non_null(kd);
    assert_non_null(vd);
    const char *codecs[] = {"tada2", "tada4", "tada8", "tada4-g16"};
    for (int ci = 0; ci < 4; ci++)
        for (uint64_t seed = 1; seed <= 3; seed++) {
            make_rows(BT, H, seed * 101 + (uint64_t)ci, 20.0, 2.0, 1.0, k);
            make_rows(BT, H, seed * 211 + (uint64_t)ci, 5.0, 1.0, 0.5, v);
            size_t bytes;
            uint8_t *blk = encode_rows(codecs[ci], H, 2, 64, k, v, &bytes);
            check_block_against_input(blk, bytes, k, v);
            free(blk);
        }

    /* Rounding the mean once: heads (3M, 3 * 2^-30, 0) with M = 1 + 2^-11, the midpoint of the
     * fp16 numbers 1 and 1 + 2^-10, have the mean M + 2^-30, which rounds to 1 + 2^-10; through
     * fp32 (round to nearest) it would become M and then tie to even, 1. Exactly on the midpoint
     * (heads 3M, 0, 0) the tie goes to even. The same with the signs flipped. */
    make_rows(BT, H, 77, 20.0, 2.0, 1.0, k);
    make_rows(BT, H, 78, 5.0, 1.0, 0.5, v);
    const float M3 = (float)(3.0 * (1.0 + 0x1p-11)), tiny = (float)(3.0 * 0x1p-30);
    const float heads[4][3] = {{M3, tiny, 0.0f}, {M3, 0.0f, 0.0f}, {-M3, -tiny, 0.0f}, {-M3, 0.0f, 0.0f}};
    const uint16_t want_bits[4] = {0x3c01, 0x3c00, 0xbc01, 0xbc00};
    for (size_t t = 0; t < 4; t++)
        for (size_t h = 0; h < H; h++) {
            k[(t * H + h) * D + 7] = heads[t][h];
            v[(t * H + h) * D + 9] = heads[t][h];
        }
    {
        size_t bytes;
        uint8_t *blk = encode_rows("tada4", H, 0, 0, k, v, &bytes);
        ref_block r;
        ref_parse(blk, &r);
        for (size_t t = 0; t < 4; t++) {
            assert_int_equal(rd16(r.sec[21] + 2 * (t * D + 7)), want_bits[t]);
            assert_int_equal(rd16(r.sec[22] + 2 * (t * D + 9)), want_bits[t]);
        }
        check_block_against_input(blk, bytes, k, v);
        free(blk);
    }

    /* Heads of opposite signs near the fp16 range's ends, whose deviations from their mean leave
     * it ((-65504, 32768, 32768): mean 10.67, deviation -65514.7; (-60000, 40000, 40000): -66667):
     * the mean is stored as 0 and every value comes back within its bound, where the quantizer's
     * zero point became -inf and the group decoded to NaN. */
    make_rows(BT, H, 79, 20.0, 2.0, 1.0, k);
    make_rows(BT, H, 80, 5.0, 1.0, 0.5, v);
    const float edge[2][3] = {{-65504.0f, 32768.0f, 32768.0f}, {-60000.0f, 40000.0f, 40000.0f}};
    for (size_t t = 0; t < 2; t++)
        for (size_t h = 0; h < H; h++) {
            k[(t * H + h) * D + 3] = edge[t][h % 3];
            v[(t * H + h) * D + 5] = edge[t][h % 3];
        }
    for (int bi = 0; bi < 3; bi++) {
        const char *names[] = {"tada2", "tada4", "tada8"};
        size_t bytes;
        uint8_t *blk = encode_rows(names[bi], H, 0, 0, k, v, &bytes);
        check_block_against_input(blk, bytes, k, v);
        lib_roundtrip(names[bi], H, BT, k, v, kd, vd);
        for (size_t i = 0; i < n; i++)
            if (!isfinite(kd[i]) || !isfinite(vd[i]))
                fail_msg("%s: element %zu decodes to %g / %g", names[bi], i, (double)kd[i], (double)vd[i]);
        free(blk);
    }

    /* identical heads, fp16 numbers: the deviations are 0 and every value comes back exactly */
    uint64_t seed = 5;
    for (size_t t = 0; t < BT; t++)
        for (size_t c = 0; c < D; c++) {
            float a = (float)ref_round_half(10.0 * rng_normal(&seed)), b = (float)ref_round_half(rng_normal(&seed));
            for (size_t h = 0; h < H; h++) {
                k[(t * H + h) * D + c] = a;
                v[(t * H + h) * D + c] = b;
            }
        }
    const char *bits[] = {"tada2", "tada4", "tada8"};
    for (int bi = 0; bi < 3; bi++) {
        lib_roundtrip(bits[bi], H, BT, k, v, kd, vd);
        assert_memory_equal(kd, k, n * sizeof(float));
        assert_memory_equal(vd, v, n * sizeof(float));
    }
    free(k);
    free(v);
    free(kd);
    free(vd);
}

/* ---- (b), (c) a shared offset: tada against kivi, and the error against bits ---- */

static void test_shared_offset_and_bits(void **state)
{
    (void)state;
    enum { T = 4 * BT };
    const size_t H = NKV, n = (size_t)T * H * D;
    float *k = malloc(n * sizeof(float)), *v = malloc(n * sizeof(float));
    float *kd = malloc(n * sizeof(float)), *vd = malloc(n * sizeof(float));
    assert_non_null(k);
    assert_non_null(v);
    assert_non_null(kd);
    assert_non_null(vd);

    struct { const char *what; double amp, shared; } data[] = {
        {"shared +-50 rotating channels", 50.0, 1.0},
        {"iid normal, nothing shared", 0.0, 0.0},
    };
    for (int di = 0; di < 2; di++) {
        make_rows(T, H, 17 + (uint64_t)di, data[di].amp, data[di].shared, 1.0, k);
        make_rows(T, H, 29 + (uint64_t)di, data[di].amp, data[di].shared, 1.0, v);
        const char *codecs[] = {"kivi2", "kivi4", "tada2", "tada4", "tada8"};
        double ek[5], ev[5];
        size_t bytes[5];
        printf("  %s (%d tokens, %zu kv heads, head_dim %d):\n", data[di].what, T, H, D);
        for (int ci = 0; ci < 5; ci++) {
            bytes[ci] = lib_roundtrip(codecs[ci], H, T, k, v, kd, vd);
            ek[ci] = rel_frobenius(kd, k, n);
            ev[ci] = rel_frobenius(vd, v, n);
            printf("    %-5s block %6zu bytes: relative error K %.4f V %.4f\n", codecs[ci], bytes[ci], ek[ci], ev[ci]);
        }
        if (di == 0) {
            /* (b) centering removes the shared offset that stretches KIVI's groups */
            assert_true(ek[2] < 0.5 * ek[0]);
            assert_true(ev[2] < 0.5 * ev[0]);
        }
        /* (c) the error falls with bits; 8 bits is below 1 % */
        assert_true(ek[3] < ek[2] && ek[4] < ek[3]);
        assert_true(ev[3] < ev[2] && ev[4] < ev[3]);
        assert_true(ek[4] < 0.01 && ev[4] < 0.01);
    }
    free(k);
    free(v);
    free(kd);
    free(vd);
}

/* ---- (d) attention ---- */

static void ref_attention(const double *K, const double *V, size_t T, size_t nq, size_t nkv, const float *q,
                          double *out)
{
    double *s = malloc(T * sizeof(double));
    assert_non_null(s);
    for (size_t h = 0; h < nq; h++) {
        size_t kvh = h / (nq / nkv);
        double m = -INFINITY, sum = 0;
        for (size_t j = 0; j < T; j++) {
            double d = 0;
            for (size_t c = 0; c < D; c++)
                d += (double)q[h * D + c] * K[(j * nkv + kvh) * D + c];
            s[j] = d / sqrt((double)D);
            m = fmax(m, s[j]);
        }
        for (size_t j = 0; j < T; j++) {
            s[j] = exp(s[j] - m);
            sum += s[j];
        }
        for (size_t c = 0; c < D; c++) {
            double o = 0;
            for (size_t j = 0; j < T; j++)
                o += s[j] * V[(j * nkv + kvh) * D + c];
            out[h * D + c] = o / sum;
        }
    }
    free(s);
}

/* Attention over blocks of the given codecs (one per block, in position order) plus a tail of
 * fp16 tokens, against fp64 attention over what the reader here reads back. With fp16_data the
 * rows are fp16 numbers (so that one head means zero deviations). Returns max|out-ref|/max|ref|. */
static double attention_case(const char *const *codecs, size_t n_blocks, size_t nkv, size_t tail, bool fp16_data,
                             uint64_t seed)
{
    const size_t nq = NQ, row = nkv * D, T = n_blocks * BT + tail;
    const uint32_t layer = 7;
    float *k = malloc(T * row * sizeof(float)), *v = malloc(T * row * sizeof(float));
    double *K = malloc(T * row * sizeof(double)), *V = malloc(T * row * sizeof(double));
    assert_non_null(k);
    assert_non_null(v);
    assert_non_null(K);
    assert_non_null(V);
    make_rows(T, nkv, seed, 8.0, 1.0, 1.0, k);
    make_rows(T, nkv, seed + 1, 4.0, 1.0, 1.0, v);
    if (fp16_data) {
        round_rows_to_half(k, T * row);
        round_rows_to_half(v, T * row);
    }
    size_t bytes = 0;
    for (size_t b = 0; b < n_blocks; b++) {
        kv_block_desc d = desc_for(codecs[b], nkv, layer, b * BT);
        size_t nb = kv_block_bytes(&d);
        bytes = nb > bytes ? nb : bytes;
    }
    uint8_t **blocks = calloc(n_blocks ? n_blocks : 1, sizeof *blocks);
    assert_non_null(blocks);
    for (size_t b = 0; b < n_blocks; b++) {
        kv_block_desc d = desc_for(codecs[b], nkv, layer, b * BT);
        blocks[b] = calloc(1, bytes);
        assert_non_null(blocks[b]);
        strata_error err = {0};
        assert_int_equal(kv_block_encode(&d, k + b * BT * row, v + b * BT * row, blocks[b], bytes, NULL, &err),
                         STRATA_OK);
        assert_int_equal(ref_decode(blocks[b], K + b * BT * row, V + b * BT * row), BT);
        if (nkv == 1 && d.codec == KV_CODEC_TADA) {
            /* one head is its own mean: every deviation is 0, so the whole backbone is zeros
             * (codes 0, scale 0, zero 0) and the block reads back exactly */
            ref_block r;
            ref_parse(blocks[b], &r);
            for (unsigned id = 1; id <= 4; id++)
                for (uint32_t i = 0; i < r.len[id]; i++)
                    assert_int_equal(r.sec[id][i], 0);
            for (size_t i = 0; i < BT * row; i++) {
                assert_true(K[b * BT * row + i] == (double)k[b * BT * row + i]);
                assert_true(V[b * BT * row + i] == (double)v[b * BT * row + i]);
            }
        }
    }
    uint16_t *tk = malloc((tail ? tail : 1) * row * sizeof(uint16_t));
    uint16_t *tv = malloc((tail ? tail : 1) * row * sizeof(uint16_t));
    assert_non_null(tk);
    assert_non_null(tv);
    const size_t t0 = n_blocks * BT * row;
    for (size_t i = 0; i < tail * row; i++) {
        double x = ref_round_half(k[t0 + i]), y = ref_round_half(v[t0 + i]);
        tk[i] = ref_half_bits(x);
        tv[i] = ref_half_bits(y);
        assert_true(ref_half(tk[i]) == x && ref_half(tv[i]) == y);
        K[t0 + i] = x;
        V[t0 + i] = y;
    }
    kv_layer_view view = {.layer = (int)layer, .n_kv_heads = (int)nkv, .head_dim = D, .block_tokens = BT,
                          .n_blocks = n_blocks, .blocks = (const uint8_t *const *)blocks, .block_bytes = bytes,
                          .tail_tokens = tail, .tail_k = tk, .tail_v = tv};
    float q[NQ * D], out[NQ * D];
    for (size_t i = 0; i < nq * D; i++)
        q[i] = (float)(0.5 * rng_normal(&seed));
    void *scratch = aligned_alloc(64, (kern_kv_attention_scratch(&view, (int)nq) + 63) / 64 * 64);
    assert_non_null(scratch);
    strata_error err = {0};
    assert_int_equal(kern_kv_attention(&view, q, (int)nq, out, scratch, &err), STRATA_OK);
    double ref[NQ * D];
    ref_attention(K, V, T, nq, nkv, q, ref);
    double e = 0, m = 0;
    for (size_t i = 0; i < nq * D; i++) {
        e = fmax(e, fabs((double)out[i] - ref[i]));
        m = fmax(m, fabs(ref[i]));
    }
    printf("  %zu blocks (%s", n_blocks, n_blocks ? codecs[0] : "");
    for (size_t b = 1; b < n_blocks; b++)
        printf(" %s", codecs[b]);
    printf(") + %zu tail, %zu query / %zu kv heads: %.2e vs fp64 on the read-back cache\n", tail, nq, nkv, e / m);
    free(scratch);
    for (size_t b = 0; b < n_blocks; b++)
        free(blocks[b]);
    free(blocks);
    free(tk);
    free(tv);
    free(K);
    free(V);
    free(k);
    free(v);
    return e / m;
}

static void test_attention(void **state)
{
    (void)state;
    const char *tada[] = {"tada2", "tada4", "tada8", "tada2", "tada4"};
    const char *same2[] = {"tada2", "tada2", "tada2", "tada2"};
    const char *mixed[] = {"kivi2", "tada4", "kivi4", "tada2", "tada8"};
    assert_true(attention_case(same2, 4, NKV, 10, false, 41) <= 1e-5);
    assert_true(attention_case(tada, 5, NKV, 37, false, 43) <= 1e-5);
    assert_true(attention_case(tada, 1, NKV, 0, false, 47) <= 1e-5);
    assert_true(attention_case(mixed, 5, NKV, 10, false, 53) <= 1e-5);
    assert_true(attention_case(tada, 3, 1, 10, true, 59) <= 1e-5);
    assert_true(attention_case(mixed, 5, 1, 5, true, 61) <= 1e-5);
}

/* ---- (e) layout ---- */

static uint64_t align64(uint64_t x) { return (x + 63) & ~(uint64_t)63; }

static void test_layout(void **state)
{
    (void)state;
    const size_t H = NKV, n = (size_t)BT * H * D;
    float *k = malloc(n * sizeof(float)), *v = malloc(n * sizeof(float));
    assert_non_null(k);
    assert_non_null(v);
    make_rows(BT, H, 3, 30.0, 1.0, 1.0, k);
    make_rows(BT, H, 4, 3.0, 1.0, 1.0, v);
    const int bit_list[] = {2, 4, 8};
    const char *names[] = {"tada2", "tada4", "tada8"};
    for (int bi = 0; bi < 3; bi++) {
        const int b = bit_list[bi];
        kv_block_desc d = desc_for(names[bi], H, 9, 192);
        const uint64_t T = BT, Hh = H, Dd = D;
        const uint64_t len[6] = {Hh * Dd * T * (uint64_t)b / 8, Hh * Dd * (T / G) * 4, T * Hh * Dd * (uint64_t)b / 8,
                                 T * Hh * (Dd / G) * 4, T * Dd * 2, T * Dd * 2};
        const unsigned ids[6] = {1, 2, 3, 4, 21, 22};
        uint64_t at = align64(64 + 12 * 6), expect_off[6];
        for (int i = 0; i < 6; i++) {
            at = align64(at);
            expect_off[i] = at;
            at += len[i];
        }
        const uint64_t total = align64(at);
        assert_int_equal(kv_block_bytes(&d), total);
        kv_codec_params p;
        assert_int_equal(kv_codec_parse(names[bi], &p, NULL), STRATA_OK);
        kv_geometry g = {1, (int)H, D, BT};
        assert_int_equal(kv_block_size(&p, &g), total);
        printf("  %s block (3 kv heads, head_dim 64, 64 tokens): %llu bytes (%.1f bytes/token; fp16: 49280)\n",
               names[bi], (unsigned long long)total, (double)total / BT);

        uint8_t *b1 = malloc(total), *b2 = malloc(total);
        assert_non_null(b1);
        assert_non_null(b2);
        memset(b1, 0xa5, total);
        memset(b2, 0x5a, total);
        size_t written = 0;
        strata_error err = {0};
        assert_int_equal(kv_block_encode(&d, k, v, b1, total, &written, &err), STRATA_OK);
        assert_int_equal(written, total);
        assert_int_equal(kv_block_encode(&d, k, v, b2, total, NULL, &err), STRATA_OK);
        assert_memory_equal(b1, b2, total);     /* deterministic, padding included */

        /* header fields */
        assert_int_equal(rd32(b1), 0x42564b53u);
        assert_int_equal(rd16(b1 + 4), 1);
        assert_int_equal(rd16(b1 + 6), align64(64 + 12 * 6));
        assert_int_equal(rd32(b1 + 8), total);
        assert_int_equal(b1[12], 5);
        assert_int_equal(b1[13], b);
        assert_int_equal(b1[14], b);
        assert_int_equal(b1[15], 6);
        assert_int_equal(rd32(b1 + 16), 9);
        assert_int_equal(rd32(b1 + 20), BT);
        assert_int_equal(rd32(b1 + 24), 192);
        assert_int_equal(rd32(b1 + 28), 0);
        assert_int_equal(rd16(b1 + 32), H);
        assert_int_equal(rd16(b1 + 34), D);
        assert_int_equal(rd16(b1 + 36), G);
        assert_int_equal(rd16(b1 + 38), G);
        assert_int_equal(rd16(b1 + 40), 128);
        for (int i = 42; i < 56; i++)
            assert_int_equal(b1[i], 0);         /* flags, rank, sparse, ott entries, reserved */
        for (int i = 0; i < 6; i++) {
            const uint8_t *e = b1 + 64 + 12 * i;
            assert_int_equal(rd16(e), ids[i]);
            assert_int_equal(rd16(e + 2), 0);
            assert_int_equal(rd32(e + 4), expect_off[i]);
            assert_int_equal(rd32(e + 8), len[i]);
        }
        for (uint64_t i = 64 + 12 * 6; i < align64(64 + 12 * 6); i++)
            assert_int_equal(b1[i], 0);
        kv_block parsed;
        assert_int_equal(kv_block_verify(b1, total, &parsed, &err), STRATA_OK);
        assert_int_equal(parsed.desc.codec, KV_CODEC_TADA);
        assert_int_equal(parsed.n_sections, 6);
        free(b1);
        free(b2);
    }

    /* fields tada does not use, and unsupported bits, make the desc invalid */
    strata_error err = {0};
    kv_block_desc d = desc_for("tada4", H, 0, 0);
    assert_int_equal(kv_block_desc_check(&d, &err), STRATA_OK);
    kv_block_desc bad = d;
    bad.rank = 1;
    assert_int_not_equal(kv_block_desc_check(&bad, &err), STRATA_OK);
    bad = d;
    bad.ott_tokens = 2;
    assert_int_not_equal(kv_block_desc_check(&bad, &err), STRATA_OK);
    bad = d;
    bad.k_sparse = 2;
    assert_int_not_equal(kv_block_desc_check(&bad, &err), STRATA_OK);
    bad = d;
    bad.k_bits = bad.v_bits = 3;
    assert_int_not_equal(kv_block_desc_check(&bad, &err), STRATA_OK);
    bad = d;
    bad.k_bits = bad.v_bits = 16;
    assert_int_not_equal(kv_block_desc_check(&bad, &err), STRATA_OK);
    assert_int_equal(kv_block_bytes(&bad), 0);
    free(k);
    free(v);
}

/* ---- (f) parameters ---- */

static void test_params(void **state)
{
    (void)state;
    kv_codec_params p;
    strata_error err = {0};
    kv_geometry g = {2, NKV, D, BT};
    assert_int_equal(kv_codec_parse("tada8", &p, &err), STRATA_OK);
    assert_int_equal(p.codec, KV_CODEC_TADA);
    assert_int_equal(p.bits, 8);
    assert_int_equal(p.group, 32);
    assert_int_equal(p.residual, 128);
    assert_int_equal(kv_codec_validate(&p, &g, &err), STRATA_OK);
    assert_int_equal(kv_codec_parse("tada2", &p, &err), STRATA_OK);
    assert_int_equal(p.bits, 2);
    assert_int_equal(kv_codec_parse("tada3", &p, &err), STRATA_EINVAL);
    assert_int_equal(kv_codec_parse("tada16", &p, &err), STRATA_EINVAL);

    memset(&err, 0, sizeof err);
    assert_int_equal(kv_codec_parse("tada4-g48", &p, &err), STRATA_OK);
    assert_int_equal(kv_codec_validate(&p, &g, &err), STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "G="));
    printf("  tada4-g48: %s\n", err.msg);

    memset(&err, 0, sizeof err);
    assert_int_equal(kv_codec_parse("tada4-r100", &p, &err), STRATA_OK);
    assert_int_equal(kv_codec_validate(&p, &g, &err), STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "R="));
    printf("  tada4-r100: %s\n", err.msg);

    /* 8 bits packs 4 codes a word: group 4 is possible there, not at 2 bits */
    assert_int_equal(kv_codec_parse("tada8-g4-r8", &p, &err), STRATA_OK);
    assert_int_equal(kv_codec_validate(&p, &g, &err), STRATA_OK);
    assert_int_equal(kv_codec_parse("tada2-g4-r8", &p, &err), STRATA_OK);
    assert_int_equal(kv_codec_validate(&p, &g, &err), STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "G="));

    /* the canonical name parses back */
    char name[64];
    assert_int_equal(kv_codec_parse("tada8-g16-r64", &p, &err), STRATA_OK);
    kv_codec_name(&p, name, sizeof name);
    assert_string_equal(name, "tada8-g16-r64");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mean_restored),
        cmocka_unit_test(test_shared_offset_and_bits),
        cmocka_unit_test(test_attention),
        cmocka_unit_test(test_layout),
        cmocka_unit_test(test_params),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
