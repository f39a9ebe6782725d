/* CRC32C (Castagnoli): reflected polynomial 0x82F63B78, initial value and final xor 0xFFFFFFFF.
 * The check value of the nine bytes "123456789" is 0xE3069283. */
#ifndef STRATA_KVSTORE_CRC32C_H
#define STRATA_KVSTORE_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* CRC32C of n bytes, continuing from crc (the CRC of the bytes before; 0 to start):
 * kv_crc32c(kv_crc32c(0, a, na), b, nb) equals the CRC of a followed by b.
 * Uses the SSE4.2 crc32 instruction when the CPU has it, else a table. */
uint32_t kv_crc32c(uint32_t crc, const void *data, size_t n);

/* The CRC of A followed by B, from crc_a = CRC(A), crc_b = CRC(B) and the length of B, without
 * the bytes (pieces checksummed in parallel, then joined). */
uint32_t kv_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

/* The same function, always in portable software (exposed so tests can compare the paths). */
uint32_t kv_crc32c_sw(uint32_t crc, const void *data, size_t n);

#endif
