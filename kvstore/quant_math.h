/* The arithmetic core of the quantizer (kvstore/quant.h), inline so that the CUDA encoder runs the
 * same code as the CPU one and produces the same bytes. Only what decides a bit of the output is
 * here: the outward-rounded fp16 (scale, zero) of a group from its min and max, and the code of a
 * value. The loops around them (min/max, packing) live with each caller. */
#ifndef STRATA_KVSTORE_QUANT_MATH_H
#define STRATA_KVSTORE_QUANT_MATH_H

#include <stdint.h>

#include "kvstore/half.h"
#include "kvstore/hd.h"

typedef struct kv_qgroup {
    uint16_t scale_h;  /* fp16 bit patterns as stored */
    uint16_t zero_h;
    float scale;       /* their values */
    float zero;
} kv_qgroup;

/* The nearest fp16 numbers above and below a finite fp16 value (used for outward rounding). */
STRATA_HD static inline uint16_t kv_half_step_up(uint16_t h)
{
    if ((h & 0x7fffu) == 0)
        return 0x0001u;                 /* from either zero to the smallest positive subnormal */
    return (h & 0x8000u) ? (uint16_t)(h - 1u) : (uint16_t)(h + 1u);
}

STRATA_HD static inline uint16_t kv_half_step_down(uint16_t h)
{
    if ((h & 0x7fffu) == 0)
        return 0x8001u;
    return (h & 0x8000u) ? (uint16_t)(h + 1u) : (uint16_t)(h - 1u);
}

STRATA_HD static inline int kv_half_finite(uint16_t h) { return (h & 0x7c00u) != 0x7c00u; }

/* TaDA's stored mean of one channel of one token over its H heads (sum of their values, lo and
 * hi the smallest and largest): the mean rounded once to fp16, or 0 when a head's deviation from
 * it (x - m in float, as the encoders subtract it) would leave the fp16 range, which only heads
 * of opposite signs near the range's ends reach: the quantizer's zero point would then be -inf
 * and its whole group decode to NaN. With 0 every deviation is the value itself (finite); the
 * reconstruction m + deviation holds for any stored m. */
STRATA_HD static inline uint16_t kv_tada_mean_half(double sum, float lo, float hi, int n_heads)
{
    const uint16_t mh = strata_double_to_half(sum / (double)n_heads);
    const float m = strata_half_to_float(mh);
    return hi - m > 65504.0f || lo - m < -65504.0f ? (uint16_t)0 : mh;
}

/* The group's parameters from its minimum and maximum (finite: every element was finite). */
STRATA_HD static inline void kv_qgroup_from_range(float mn, float mx, int finite, int bits, kv_qgroup *g)
{
    if (!finite) {
        g->zero_h = g->scale_h = 0x7e00u;   /* NaN: a poisoned group stays visibly poisoned */
        g->zero = g->scale = strata_half_to_float(0x7e00u);
        return;
    }
    const double qmax = (double)((1u << bits) - 1u);
    /* Outward rounding keeps every element inside the stored grid, which is what makes the
     * s/2 bound hold against the stored (not the ideal) parameters. */
    uint16_t zh = strata_float_to_half(mn);
    if (kv_half_finite(zh) && strata_half_to_float(zh) > mn)
        zh = kv_half_step_down(zh);
    const double zf = strata_half_to_float(zh);
    uint16_t sh = 0;
    if ((double)mx > zf) {
        sh = strata_float_to_half((float)(((double)mx - zf) / qmax));
        /* zf + qmax*sf is exact in double: both are fp16 numbers and qmax has 8 bits at most
         * (so a fused multiply-add, which a GPU compiler may use, gives the same result). */
        while (kv_half_finite(sh) && zf + qmax * strata_half_to_float(sh) < (double)mx)
            sh = kv_half_step_up(sh);
        /* Every code must reconstruct within fp16: a reader computing in fp16 (the tensor-core
         * attention kernel) turned the top code of a group reaching +65504 into inf. There the
         * scale steps back down; the largest elements then lie at most qmax of the scale's fp16
         * steps above the grid, far inside the half-step bound. */
        while (sh != 0 && zf + qmax * strata_half_to_float(sh) > 65504.0)
            sh = kv_half_step_down(sh);
    }
    g->zero_h = zh;
    g->scale_h = sh;
    g->zero = (float)zf;
    g->scale = strata_half_to_float(sh);
}

/* The code of x in a fitted group: round half up of (x - zero) / scale in double, clamped. */
STRATA_HD static inline uint32_t kv_qgroup_code(float x, const kv_qgroup *g, int bits)
{
    const uint32_t qmax = (1u << bits) - 1u;
    if (!(g->scale > 0.0f))
        return 0;                       /* constant group (or NaN parameters) */
    const double t = ((double)x - (double)g->zero) / (double)g->scale;
    if (!(t > 0.0))
        return 0;                       /* also catches NaN, whose conversion would be undefined */
    if (t >= (double)qmax)
        return qmax;
    uint32_t q = (uint32_t)t;
    if (t - (double)q >= 0.5)
        q++;
    return q;
}

#endif
