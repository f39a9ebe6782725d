/* CRC32C arithmetic shared with the CUDA encoder: the byte table entry, a plain byte-wise update,
 * and the combination of two CRCs, which lets many threads checksum pieces of a block at once.
 *
 * Polynomials are in the CRC's reflected order: bit 31 holds the coefficient of x^0, bit 0 that
 * of x^31. Multiplying by x is a right shift, reduced by the polynomial when x^32 appears. */
#ifndef STRATA_KVSTORE_CRC32C_MATH_H
#define STRATA_KVSTORE_CRC32C_MATH_H

#include <stddef.h>
#include <stdint.h>

#include "kvstore/hd.h"

#define KV_CRC32C_POLY 0x82f63b78u

/* The table entry of byte n: the register after shifting n through it eight times. */
STRATA_HD static inline uint32_t kv_crc32c_table_entry(uint32_t n)
{
    for (int i = 0; i < 8; i++)
        n = (n & 1u) ? (n >> 1) ^ KV_CRC32C_POLY : n >> 1;
    return n;
}

/* a * b mod P. */
STRATA_HD static inline uint32_t kv_crc32c_mulmod(uint32_t a, uint32_t b)
{
    uint32_t product = 0;
    for (int i = 0; i < 32; i++) {        /* coefficient of x^i in a, times b x^i */
        if (a & (0x80000000u >> i))
            product ^= b;
        b = (b & 1u) ? (b >> 1) ^ KV_CRC32C_POLY : b >> 1;
    }
    return product;
}

/* x^(8 n) mod P: what appending n zero bytes does to a CRC register. */
STRATA_HD static inline uint32_t kv_crc32c_shift_op(uint64_t n)
{
    uint32_t result = 0x80000000u;         /* x^0 */
    uint32_t power = 0x00800000u;          /* x^8: one byte */
    while (n) {
        if (n & 1u)
            result = kv_crc32c_mulmod(result, power);
        power = kv_crc32c_mulmod(power, power);
        n >>= 1;
    }
    return result;
}

/* The CRC of A followed by B from crc(A), crc(B) and len(B); shift_op is kv_crc32c_shift_op(len(B))
 * (callers combining many pieces of one length compute it once). */
STRATA_HD static inline uint32_t kv_crc32c_combine_op(uint32_t crc_a, uint32_t crc_b, uint32_t shift_op)
{
    return kv_crc32c_mulmod(shift_op, crc_a) ^ crc_b;
}

#endif
