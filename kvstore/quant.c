#include "kvstore/quant.h"

#include <math.h>
#include <string.h>

#include "kvstore/bytes.h"
#include "kvstore/half.h"

uint16_t kv_half_next_up(uint16_t h)
{
    if ((h & 0x7fffu) == 0)
        return 0x0001u;                 /* from either zero to the smallest positive subnormal */
    return (h & 0x8000u) ? (uint16_t)(h - 1u) : (uint16_t)(h + 1u);
}

uint16_t kv_half_next_down(uint16_t h)
{
    if ((h & 0x7fffu) == 0)
        return 0x8001u;
    return (h & 0x8000u) ? (uint16_t)(h + 1u) : (uint16_t)(h - 1u);
}

static int half_is_finite(uint16_t h) { return (h & 0x7c00u) != 0x7c00u; }

void kv_quant_fit(const float *x, size_t n, size_t stride, int bits, kv_qgroup *g)
{
    float mn = x[0], mx = x[0];
    int finite = isfinite(x[0]);
    for (size_t i = 1; i < n; i++) {
        float v = x[i * stride];
        finite &= isfinite(v) != 0;
        if (v < mn)
            mn = v;
        if (v > mx)
            mx = v;
    }
    if (!finite) {
        g->zero_h = g->scale_h = 0x7e00u;   /* NaN: a poisoned group stays visibly poisoned */
        g->zero = g->scale = NAN;
        return;
    }
    const double qmax = (double)((1u << bits) - 1u);
    /* Outward rounding keeps every element inside the stored grid, which is what makes the
     * s/2 bound hold against the stored (not the ideal) parameters. */
    uint16_t zh = strata_float_to_half(mn);
    if (half_is_finite(zh) && strata_half_to_float(zh) > mn)
        zh = kv_half_next_down(zh);
    double zf = strata_half_to_float(zh);
    uint16_t sh = 0;
    if ((double)mx > zf) {
        sh = strata_float_to_half((float)(((double)mx - zf) / qmax));
        /* zf + qmax*sf is exact in double: both are fp16 numbers and qmax has 8 bits at most. */
        while (half_is_finite(sh) && zf + qmax * strata_half_to_float(sh) < (double)mx)
            sh = kv_half_next_up(sh);
    }
    g->zero_h = zh;
    g->scale_h = sh;
    g->zero = (float)zf;
    g->scale = strata_half_to_float(sh);
}

uint32_t kv_quant_code(float x, const kv_qgroup *g, int bits)
{
    const uint32_t qmax = (1u << bits) - 1u;
    if (!(g->scale > 0.0f))
        return 0;                       /* constant group (or NaN parameters) */
    double t = ((double)x - (double)g->zero) / (double)g->scale;
    if (!(t > 0.0))
        return 0;                       /* also catches NaN, whose conversion would be undefined */
    if (t >= (double)qmax)
        return qmax;
    uint32_t q = (uint32_t)t;
    if (t - (double)q >= 0.5)
        q++;
    return q;
}

void kv_quant_group(const float *x, size_t n, size_t stride, int bits, kv_qgroup *g, uint32_t *codes)
{
    kv_quant_fit(x, n, stride, bits, g);
    for (size_t i = 0; i < n; i++)
        codes[i] = kv_quant_code(x[i * stride], g, bits);
}

void kv_pack_codes(const uint32_t *codes, size_t n, int bits, uint8_t *dst)
{
    const size_t per = 32u / (unsigned)bits;
    const uint32_t mask = (1u << bits) - 1u;
    for (size_t w = 0; w < n / per; w++) {
        uint32_t word = 0;
        for (size_t k = 0; k < per; k++)
            word |= (codes[w * per + k] & mask) << (k * (size_t)bits);
        kv_st32(dst + 4 * w, word);
    }
}

uint32_t kv_packed_code(const uint8_t *src, size_t i, int bits)
{
    const size_t per = 32u / (unsigned)bits;
    uint32_t word = kv_ld32(src + 4 * (i / per));
    return (word >> ((i % per) * (size_t)bits)) & ((1u << bits) - 1u);
}

/* Byte -> codes as floats, built by the preprocessor so the tables are constant data: the
 * unpacking sits in attention's inner loop and a table lookup beats shifting code by code. Bytes
 * are taken in little-endian word order, which keeps the LSB-first code order. */
#define KV_B2(b) {(float)((b) & 3), (float)(((b) >> 2) & 3), (float)(((b) >> 4) & 3), (float)(((b) >> 6) & 3)}
#define KV_B4(b) {(float)((b) & 15), (float)(((b) >> 4) & 15)}
#define KV_X4(M, n) M(n), M((n) + 1), M((n) + 2), M((n) + 3)
#define KV_X16(M, n) KV_X4(M, n), KV_X4(M, (n) + 4), KV_X4(M, (n) + 8), KV_X4(M, (n) + 12)
#define KV_X64(M, n) KV_X16(M, n), KV_X16(M, (n) + 16), KV_X16(M, (n) + 32), KV_X16(M, (n) + 48)
#define KV_X256(M) KV_X64(M, 0), KV_X64(M, 64), KV_X64(M, 128), KV_X64(M, 192)
static const float codes2_of_byte[256][4] = {KV_X256(KV_B2)};
static const float codes4_of_byte[256][2] = {KV_X256(KV_B4)};

void kv_unpack_codes_f32(const uint8_t *src, size_t n, int bits, float *out)
{
    const size_t per = 32u / (unsigned)bits;
    if (bits == 2) {
        for (size_t i = 0; i < n / 4; i++)
            memcpy(out + 4 * i, codes2_of_byte[src[i]], sizeof codes2_of_byte[0]);
        return;
    }
    if (bits == 4) {
        for (size_t i = 0; i < n / 2; i++)
            memcpy(out + 2 * i, codes4_of_byte[src[i]], sizeof codes4_of_byte[0]);
        return;
    }
    if (bits == 8) {   /* little-endian words: byte i is code i */
        for (size_t i = 0; i < n; i++)
            out[i] = (float)src[i];
        return;
    }
    const uint32_t mask = (1u << bits) - 1u;
    for (size_t w = 0; w < n / per; w++) {
        uint32_t word = kv_ld32(src + 4 * w);
        for (size_t k = 0; k < per; k++) {
            out[w * per + k] = (float)(word & mask);
            word >>= bits;
        }
    }
}
