/* The asymmetric min-max quantizer shared by the KIVI codec (and later GEAR/OTT/TaDA), and the
 * bit packing of its codes.
 *
 * For a group x[0..n) at B bits: z = min x, s = (max x - z) / (2^B - 1), both stored as fp16.
 * The fp16 values are rounded outward (z down, s up until z + (2^B-1) s >= max x, checked in
 * exact arithmetic) so the stored grid still covers the whole group; the codes are then computed
 * against the stored fp16 s and z: q = clamp(round((x - z) / s), 0, 2^B - 1). Every element thus
 * reconstructs as q s + z within s/2 of its value (s the stored scale; the only slack is the
 * 2^-52-relative error of evaluating (x - z)/s in double). A constant group has s = 0, all codes 0
 * and reconstructs exactly when its value is an fp16 number. Non-finite inputs give non-finite
 * parameters (and codes 0), never undefined behaviour.
 *
 * Packing: 32/B codes per 32-bit little-endian word; code i sits at bit (i % (32/B)) * B of word
 * i / (32/B), least significant bits first. */
#ifndef STRATA_KVSTORE_QUANT_H
#define STRATA_KVSTORE_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "kvstore/quant_math.h"   /* kv_qgroup and the arithmetic shared with the CUDA encoder */

/* Fits the group x[i * stride], i < n (n >= 1), at bits (1..8). */
void kv_quant_fit(const float *x, size_t n, size_t stride, int bits, kv_qgroup *g);

/* The code of one value against a fitted group. */
uint32_t kv_quant_code(float x, const kv_qgroup *g, int bits);

/* Fits and codes a group in one call: codes[i] for x[i * stride]. */
void kv_quant_group(const float *x, size_t n, size_t stride, int bits, kv_qgroup *g, uint32_t *codes);

/* Packs n codes (n a multiple of 32/bits) into n*bits/8 bytes at dst. */
void kv_pack_codes(const uint32_t *codes, size_t n, int bits, uint8_t *dst);

/* Code i of a packed row. */
uint32_t kv_packed_code(const uint8_t *src, size_t i, int bits);

/* Unpacks n codes (n a multiple of 32/bits) as floats, for the dequantizing inner loops. */
void kv_unpack_codes_f32(const uint8_t *src, size_t n, int bits, float *out);

/* The nearest fp16 numbers above and below a finite fp16 value (used for outward rounding). */
uint16_t kv_half_next_up(uint16_t h);
uint16_t kv_half_next_down(uint16_t h);

#endif
