/* Reads a fuzz input a byte at a time; past its end every byte reads as 0, so that a truncated
 * input is still a whole (shorter) program. */
#ifndef STRATA_TESTS_FUZZ_BYTE_READER_H
#define STRATA_TESTS_FUZZ_BYTE_READER_H

#include <stddef.h>
#include <stdint.h>

typedef struct reader {
    const uint8_t *p;
    size_t left;
} reader;

static inline uint8_t next_byte(reader *r)
{
    if (!r->left)
        return 0;
    r->left--;
    return *r->p++;
}

#endif
