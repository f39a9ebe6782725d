#include "worker/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvstore/bytes.h"

/* SAMPLER_SCRATCH_BYTES is sized for this. */
typedef struct candidate {
    int32_t id;
    float logit;
    float p;
} candidate;
_Static_assert(sizeof(candidate) == 12, "SAMPLER_SCRATCH_BYTES assumes 12-byte candidates");

struct sampler {
    sampler_params params;
    int n_vocab;
    uint64_t rng[4];     /* xoshiro256** state */
    candidate *cand;
};

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t next_u64(uint64_t s[4])
{
    uint64_t result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

/* Uniform in [0, 1) with 53 random bits. */
static double next_unit(uint64_t s[4]) { return (double)(next_u64(s) >> 11) * 0x1.0p-53; }

int sampler_params_validate(const sampler_params *p, strata_error *err)
{
    if (!isfinite(p->temperature) || p->temperature < 0.0f)
        return strata_fail(err, STRATA_EINVAL, "temperature must be a finite number >= 0 (got %g)", (double)p->temperature);
    if (p->top_k < 0)
        return strata_fail(err, STRATA_EINVAL, "top-k must be >= 0 (got %d; 0 disables it)", p->top_k);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return strata_fail(err, STRATA_EINVAL, "top-p must be in (0, 1] (got %g)", (double)p->top_p);
    return STRATA_OK;
}

sampler *sampler_create(const sampler_params *p, int n_vocab, strata_error *err)
{
    if (sampler_params_validate(p, err) != STRATA_OK)
        return NULL;
    if (n_vocab <= 0) {
        strata_fail(err, STRATA_EINVAL, "vocabulary size must be positive");
        return NULL;
    }
    sampler *s = calloc(1, sizeof *s);
    if (s)
        s->cand = malloc((size_t)n_vocab * sizeof *s->cand);
    if (!s || !s->cand) {
        if (s)
            free(s);
        strata_fail(err, STRATA_ENOMEM, "out of memory for the sampler");
        return NULL;
    }
    s->params = *p;
    s->n_vocab = n_vocab;
    uint64_t x = p->seed;
    for (int i = 0; i < 4; i++)
        s->rng[i] = splitmix64(&x);
    return s;
}

void sampler_free(sampler *s)
{
    if (!s)
        return;
    free(s->cand);
    free(s);
}

static int by_logit_desc(const void *a, const void *b)
{
    const candidate *x = a, *y = b;
    if (x->logit != y->logit)
        return x->logit > y->logit ? -1 : 1;
    return x->id < y->id ? -1 : (x->id > y->id); /* ties: lower id first, deterministic */
}

static int32_t argmax(const float *logits, int n)
{
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (logits[i] > logits[best])
            best = i;
    return best;
}

const sampler_params *sampler_get_params(const sampler *s) { return &s->params; }

int sampler_params_greedy(const sampler_params *p) { return p->temperature == 0.0f || p->top_k == 1; }

double sampler_next_draw(sampler *s) { return next_unit(s->rng); }

void sampler_skip_sampled(sampler *s, uint64_t n)
{
    if (sampler_params_greedy(&s->params))
        return;
    for (uint64_t i = 0; i < n; i++)
        (void)next_u64(s->rng);
}

int32_t sampler_sample(sampler *s, const float *logits)
{
    if (sampler_params_greedy(&s->params))
        return argmax(logits, s->n_vocab);
    return sampler_pick(&s->params, logits, s->n_vocab, next_unit(s->rng), s->cand);
}

int32_t sampler_pick(const sampler_params *p, const float *logits, int n_vocab, double u, void *scratch)
{
    if (sampler_params_greedy(p))
        return argmax(logits, n_vocab);

    candidate *cand = scratch;
    int n = n_vocab;
    for (int i = 0; i < n; i++)
        cand[i] = (candidate){.id = i, .logit = logits[i]};
    qsort(cand, (size_t)n, sizeof *cand, by_logit_desc);
    if (p->top_k > 0 && p->top_k < n)
        n = p->top_k;

    double sum = 0.0;
    const float mx = cand[0].logit;
    for (int i = 0; i < n; i++) {
        cand[i].p = expf((cand[i].logit - mx) / p->temperature);
        sum += cand[i].p;
    }
    if (p->top_p < 1.0f) {
        double cum = 0.0;
        int keep = n;
        for (int i = 0; i < n; i++) {
            cum += cand[i].p / sum;
            if (cum >= p->top_p) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
        sum = 0.0;
        for (int i = 0; i < n; i++)
            sum += cand[i].p;
    }
    double r = u * sum;
    for (int i = 0; i < n; i++) {
        r -= cand[i].p;
        if (r < 0.0)
            return cand[i].id;
    }
    return cand[n - 1].id;
}

void sampler_save(const sampler *s, uint8_t out[SAMPLER_STATE_BYTES])
{
    uint32_t t, pp;
    memcpy(&t, &s->params.temperature, 4);
    memcpy(&pp, &s->params.top_p, 4);
    kv_st32(out, t);
    kv_st32(out + 4, (uint32_t)s->params.top_k);
    kv_st32(out + 8, pp);
    kv_st32(out + 12, 0);
    kv_st64(out + 16, s->params.seed);
    for (int i = 0; i < 4; i++)
        kv_st64(out + 24 + 8 * i, s->rng[i]);
}

sampler *sampler_restore(const uint8_t in[SAMPLER_STATE_BYTES], int n_vocab, strata_error *err)
{
    sampler_params p;
    uint32_t t = kv_ld32(in), pp = kv_ld32(in + 8);
    memcpy(&p.temperature, &t, 4);
    memcpy(&p.top_p, &pp, 4);
    p.top_k = (int)kv_ld32(in + 4);
    p.seed = kv_ld64(in + 16);
    sampler *s = sampler_create(&p, n_vocab, err);
    if (s)
        for (int i = 0; i < 4; i++)
            s->rng[i] = kv_ld64(in + 24 + 8 * i);
    return s;
}
