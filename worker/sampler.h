/* Next-token sampling: greedy, or top-k -> temperature -> top-p (nucleus) with a seeded PRNG,
 * so the same seed and logits give the same tokens on every machine. */
#ifndef STRATA_WORKER_SAMPLER_H
#define STRATA_WORKER_SAMPLER_H

#include <stdint.h>

#include "kvstore/error.h"

typedef struct sampler_params {
    float temperature;  /* 0: greedy (argmax); > 0: sample */
    int top_k;          /* keep the k most likely tokens; 0: all */
    float top_p;        /* keep the smallest set whose probability reaches top_p; 1: all */
    uint64_t seed;
} sampler_params;

/* Rejects temperature < 0 or non-finite, top_k < 0, top_p outside (0, 1]. */
int sampler_params_validate(const sampler_params *p, strata_error *err);

typedef struct sampler sampler;

sampler *sampler_create(const sampler_params *p, int n_vocab, strata_error *err);
void sampler_free(sampler *s);
/* Picks the next token from n_vocab logits (not modified): sampler_pick with the next draw of
 * the sampler's PRNG (no draw is taken when the parameters are greedy). */
int32_t sampler_sample(sampler *s, const float *logits);

/* The sampler's parameters. */
const sampler_params *sampler_get_params(const sampler *s);

/* True when the parameters pick the argmax (temperature 0 or top_k 1): no draw is needed. */
int sampler_params_greedy(const sampler_params *p);

/* The next uniform draw in [0, 1) from the sampler's PRNG (53 random bits), advancing it: what
 * sampler_sample would use for its next non-greedy pick. A device that samples (kernels/
 * cuda_sample.h) takes the draw from here, so the PRNG state stays on the host and
 * sampler_save/restore cover it. */
double sampler_next_draw(sampler *s);

/* Takes n draws and drops them, as n tokens sampled with non-greedy parameters would have
 * (greedy parameters take none: nothing is skipped). A sequence whose KV was rebuilt from its
 * tokens (the coordinator's recovery) gets a fresh sampler skipped past the tokens it already
 * sampled, so that it samples the tokens it would have. */
void sampler_skip_sampled(sampler *s, uint64_t n);

/* The pick itself, a pure function: the n logits sorted by value (descending; ties: lower id
 * first), the first top_k kept (0: all), weights expf((logit - max) / temperature), the smallest
 * prefix whose normalised cumulative weight reaches top_p kept, then the first token whose
 * cumulative weight exceeds u * (the kept weight). Greedy parameters return the argmax (lowest id
 * on ties) and ignore u. scratch: room for n (id, logit, weight) triples, SAMPLER_SCRATCH_BYTES(n). */
#define SAMPLER_SCRATCH_BYTES(n) ((size_t)(n) * 12u)
int32_t sampler_pick(const sampler_params *p, const float *logits, int n, double u, void *scratch);

/* The whole state (parameters and PRNG position) in SAMPLER_STATE_BYTES little-endian bytes,
 * so that a sequence moved to another worker samples exactly the tokens it would have. */
#define SAMPLER_STATE_BYTES 56
void sampler_save(const sampler *s, uint8_t out[SAMPLER_STATE_BYTES]);
/* A sampler in the saved state; STRATA_EINVAL (NULL) for parameters that do not validate. */
sampler *sampler_restore(const uint8_t in[SAMPLER_STATE_BYTES], int n_vocab, strata_error *err);

#endif
