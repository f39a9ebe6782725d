/* The tests' own readers of little-endian fields and fp16 values, written from docs/format.md
 * without the project's code (kvstore/bytes.h, kvstore/half.h), so that a block checked with them
 * is checked independently. Header-only. */
#ifndef STRATA_TESTS_REF_BYTES_H
#define STRATA_TESTS_REF_BYTES_H

#include <math.h>
#include <stdint.h>

/* An IEEE binary16 value, exactly, as a double (subnormals, infinities and NaN included). */
static inline double ref_half(uint16_t h)
{
    int e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return (h & 0x8000) ? -v : v;
}

static inline uint32_t rd32(const uint8_t *p)
{
    return p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline void wr32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline void wr16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

#endif
