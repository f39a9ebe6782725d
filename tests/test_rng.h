/* The tests' random numbers: splitmix64 from a seed each test names, so every run draws the same
 * values and a failure can be replayed. Header-only. */
#ifndef STRATA_TESTS_TEST_RNG_H
#define STRATA_TESTS_TEST_RNG_H

#include <math.h>
#include <stdint.h>

static inline uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform on [0, 1), 53 bits. */
static inline double rng_uniform(uint64_t *s) { return (double)(rng_next(s) >> 11) * 0x1p-53; }

/* Uniform on [-1, 1). */
static inline float rng_sym(uint64_t *s) { return (float)((double)(rng_next(s) >> 11) * 0x1p-52 - 1.0); }

/* Standard normal (Box-Muller, one of the pair). */
static inline double rng_normal(uint64_t *s)
{
    double u = rng_uniform(s), v = rng_uniform(s);
    return sqrt(-2.0 * log(u + 1e-300)) * cos(6.283185307179586 * v);
}

#endif
