#include "kvstore/quant.h"

#include <math.h>
#include <string.h>

#include "kvstore/bytes.h"
#include "kvstore/half.h"

uint16_t kv_half_next_up(uint16_t h) { return kv_half_step_up(h); }

uint16_t kv_half_next_down(uint16_t h) { return kv_half_step_down(h); }

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
    kv_qgroup_from_range(mn, mx, finite, bits, g);
}

uint32_t kv_quant_code(float x, const kv_qgroup *g, int bits) { return kv_qgroup_code(x, g, bits); }

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
