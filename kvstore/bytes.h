/* Little-endian loads and stores at any alignment. Block bytes are serialized field by field
 * through these, never by copying structs, so the format does not depend on the compiler. */
#ifndef STRATA_KVSTORE_BYTES_H
#define STRATA_KVSTORE_BYTES_H

#include <stdint.h>

static inline uint16_t kv_ld16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t kv_ld32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint64_t kv_ld64(const uint8_t *p) { return kv_ld32(p) | ((uint64_t)kv_ld32(p + 4) << 32); }

static inline void kv_st16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static inline void kv_st32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); p[2] = (uint8_t)(v >> 16); p[3] = (uint8_t)(v >> 24);
}
static inline void kv_st64(uint8_t *p, uint64_t v) { kv_st32(p, (uint32_t)v); kv_st32(p + 4, (uint32_t)(v >> 32)); }

#endif
