/* IEEE binary16 and bfloat16 conversions, portable C (no F16C needed).
 * fp32 -> fp16 rounds to nearest even, handles subnormals, overflow to inf, and NaN. */
#ifndef STRATA_KVSTORE_HALF_H
#define STRATA_KVSTORE_HALF_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvstore/hd.h"

STRATA_HD static inline uint32_t strata_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
STRATA_HD static inline float strata_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

STRATA_HD static inline float strata_half_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1f)                       /* inf / NaN */
        return strata_bits_f32(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
        if (mant == 0)
            return strata_bits_f32(sign);
        /* subnormal: value = mant * 2^-24 */
        float v = (float)mant * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    return strata_bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

STRATA_HD static inline uint16_t strata_float_to_half(float f)
{
    uint32_t x = strata_f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t abs = x & 0x7fffffffu;
    if (abs >= 0x7f800000u)                /* inf or NaN (keep NaN quiet and non-zero) */
        return (uint16_t)(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
    if (abs >= 0x477ff000u)                /* rounds to >= 65520: overflow to inf */
        return (uint16_t)(sign | 0x7c00u);
    if (abs < 0x38800000u) {               /* below the smallest normal half (2^-14) */
        if (abs < 0x33000000u)             /* below half of the smallest subnormal: zero */
            return sign;
        uint32_t e = abs >> 23;
        uint32_t m = (abs & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e;         /* 14..24 */
        uint32_t q = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u);
        uint32_t halfway = 1u << (shift - 1u);
        if (rem > halfway || (rem == halfway && (q & 1u)))
            q++;
        return (uint16_t)(sign | q);
    }
    uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);   /* round to nearest even on bit 13 */
    return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
}

STRATA_HD static inline float strata_bf16_to_float(uint16_t b) { return strata_bits_f32((uint32_t)b << 16); }

/* The fp16 nearest to a double (ties to even), rounded once. Going through fp32 with
 * round-to-nearest could round twice (a double just above an fp16 midpoint may land exactly on
 * it); rounding to fp32 "to odd" first (an inexact result takes the neighbour with an odd last
 * bit) keeps the sticky information, and fp32 has more than 11 + 2 bits, so the second rounding
 * is exact. */
STRATA_HD static inline uint16_t strata_double_to_half(double x)
{
    float f = (float)x;
    if (isfinite(f) && (double)f != x && (strata_f32_bits(f) & 1u) == 0)
        f = nextafterf(f, (double)f < x ? INFINITY : -INFINITY);
    return strata_float_to_half(f);
}

/* Rounds x to the nearest fp16 value and back: the precision the KV cache keeps. */
STRATA_HD static inline float strata_round_half(float x) { return strata_half_to_float(strata_float_to_half(x)); }

#endif
