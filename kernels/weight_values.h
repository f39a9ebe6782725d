/* How a weight's value follows from where it is stored: element i of a GGUF tensor in one of the
 * block formats strata reads, and element i of a synthetic model's tensor (worker/synthetic.h).
 *
 * Shared by the CPU loader (worker/gguf.c, worker/synthetic.c) and the device's
 * (kernels/cuda/weights.cu, compiled without fused multiply-adds), so a GPU builds its weights
 * with the same code, and the same bits, as the CPU reference. Every function is a pure
 * function of its arguments. */
#ifndef STRATA_KERNELS_WEIGHT_VALUES_H
#define STRATA_KERNELS_WEIGHT_VALUES_H

#include <stdint.h>

#include "kvstore/half.h"
#include "kvstore/hd.h"

/* ggml tensor type ids: the formats below, plus the others' ids for messages (gguf.c names them). */
typedef enum gguf_tensor_type {
    GGUF_T_F32 = 0, GGUF_T_F16 = 1, GGUF_T_Q4_0 = 2, GGUF_T_Q4_1 = 3, GGUF_T_Q8_0 = 8,
    GGUF_T_BF16 = 30,
} gguf_tensor_type;

/* Elements per block and bytes per block of a format strata reads; false for any other type. */
STRATA_HD static inline int gguf_type_block(uint32_t type, uint64_t *block_elems, uint64_t *block_bytes)
{
    uint64_t e = 1, b = 0;
    switch (type) {
    case GGUF_T_F32: b = 4; break;
    case GGUF_T_F16: case GGUF_T_BF16: b = 2; break;
    case GGUF_T_Q4_0: e = 32; b = 18; break;
    case GGUF_T_Q4_1: e = 32; b = 20; break;
    case GGUF_T_Q8_0: e = 32; b = 34; break;
    default: e = 0; break;
    }
    *block_elems = e;
    *block_bytes = b;
    return b != 0;
}

/* Little-endian fields at any alignment (a GGUF tensor's blocks are only byte-aligned in general). */
STRATA_HD static inline uint16_t gguf_le16(const uint8_t *p) { return (uint16_t)(p[0] | (uint16_t)p[1] << 8); }
STRATA_HD static inline float gguf_half_at(const uint8_t *p) { return strata_half_to_float(gguf_le16(p)); }

STRATA_HD static inline float gguf_f32_value(const uint8_t *data, uint64_t i)
{
    const uint8_t *p = data + 4 * i;
    return strata_bits_f32((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
}

STRATA_HD static inline float gguf_f16_value(const uint8_t *data, uint64_t i) { return gguf_half_at(data + 2 * i); }

STRATA_HD static inline float gguf_bf16_value(const uint8_t *data, uint64_t i)
{
    return strata_bf16_to_float(gguf_le16(data + 2 * i));
}

/* The quantized formats: blocks of 32 elements with fp16 scales first. The _at functions give
 * element j (0..31) of a block whose scales are already read (a CPU loop reads them once a block);
 * the _value functions element i of the data. */

/* Q8_0: fp16 d and 32 int8 q; value = d * q. */
STRATA_HD static inline float gguf_q8_0_at(const uint8_t *blk, float d, unsigned j) { return d * (float)(int8_t)blk[2 + j]; }

/* The 4-bit code of element j of a Q4 block's 16 bytes: low nibbles hold elements 0-15, high
 * nibbles 16-31. */
STRATA_HD static inline int gguf_q4_code(const uint8_t *qs, unsigned j)
{
    return j < 16 ? qs[j] & 0x0f : qs[j - 16] >> 4;
}

/* Q4_0: fp16 d and 16 bytes of codes; value = d * (q - 8). */
STRATA_HD static inline float gguf_q4_0_at(const uint8_t *blk, float d, unsigned j)
{
    return d * (float)(gguf_q4_code(blk + 2, j) - 8);
}

/* Q4_1: fp16 d, fp16 m and 16 bytes of codes; value = d * q + m, rounded twice (no FMA: the
 * device file is compiled with --fmad=false so its values equal these). */
STRATA_HD static inline float gguf_q4_1_at(const uint8_t *blk, float d, float m, unsigned j)
{
    return d * (float)gguf_q4_code(blk + 4, j) + m;
}

STRATA_HD static inline float gguf_q8_0_value(const uint8_t *data, uint64_t i)
{
    const uint8_t *b = data + (i / 32) * 34;
    return gguf_q8_0_at(b, gguf_half_at(b), (unsigned)(i % 32));
}

STRATA_HD static inline float gguf_q4_0_value(const uint8_t *data, uint64_t i)
{
    const uint8_t *b = data + (i / 32) * 18;
    return gguf_q4_0_at(b, gguf_half_at(b), (unsigned)(i % 32));
}

STRATA_HD static inline float gguf_q4_1_value(const uint8_t *data, uint64_t i)
{
    const uint8_t *b = data + (i / 32) * 20;
    return gguf_q4_1_at(b, gguf_half_at(b), gguf_half_at(b + 2), (unsigned)(i % 32));
}

/* Element i of data of a type gguf_type_block accepts (0 for any other). */
STRATA_HD static inline float gguf_value(uint32_t type, const uint8_t *data, uint64_t i)
{
    switch (type) {
    case GGUF_T_F32: return gguf_f32_value(data, i);
    case GGUF_T_F16: return gguf_f16_value(data, i);
    case GGUF_T_BF16: return gguf_bf16_value(data, i);
    case GGUF_T_Q8_0: return gguf_q8_0_value(data, i);
    case GGUF_T_Q4_0: return gguf_q4_0_value(data, i);
    case GGUF_T_Q4_1: return gguf_q4_1_value(data, i);
    default: return 0.0f;
    }
}

/* ---- Synthetic weights ---------------------------------------------------------------------- */

STRATA_HD static inline uint64_t synthetic_mix64(uint64_t z)   /* splitmix64's finalizer */
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* A 24-bit draw as a uniform value on [-1, 1). */
STRATA_HD static inline float synthetic_unit24(uint64_t bits24)
{
    return (float)((int32_t)bits24 - (1 << 23)) * (1.0f / 8388608.0f);
}

/* Draw j of a synthetic matrix's stream (key: synthetic_tensor_stream): splitmix64 in counter
 * mode. Its top 24 bits make element 2j, bits 8-31 element 2j + 1. */
STRATA_HD static inline uint64_t synthetic_draw(uint64_t key, uint64_t j)
{
    return synthetic_mix64(key + (j + 1) * 0x9e3779b97f4a7c15ull);
}

STRATA_HD static inline float synthetic_even(uint64_t draw, float amp) { return synthetic_unit24(draw >> 40) * amp; }
STRATA_HD static inline float synthetic_odd(uint64_t draw, float amp)
{
    return synthetic_unit24((draw >> 8) & 0xffffffu) * amp;
}

/* Element i of the matrix: any element, in any order, from the key alone. */
STRATA_HD static inline float synthetic_value(uint64_t key, float amp, uint64_t i)
{
    const uint64_t r = synthetic_draw(key, i / 2);
    return i % 2 ? synthetic_odd(r, amp) : synthetic_even(r, amp);
}

#endif
