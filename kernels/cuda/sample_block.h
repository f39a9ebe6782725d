/* The body of the sampling kernel (kernels/cuda/sample.cu, contract in kernels/cuda_sample.h),
 * phase by phase, as inline functions that compile for the device and for the CPU, so that
 * tests/cuda/test_cuda_sample.c runs them in CI with the threads taken one after another (as the
 * encoder's, attention's and the tails' phases are run). Within a phase no thread reads what
 * another writes; what threads combine goes through atomics on the device and plain read-modify-
 * writes in the emulation, so any thread order gives the same result up to the order of additions.
 *
 * One thread block per row; no sort. The sorted order of sampler_pick (logit descending, ties:
 * lower id first) is that of a 64-bit composite, descending:
 *     key(logit) << 32 | ~id
 * where key is an order-preserving map of the float (-0 canonicalized to +0, as the CPU's
 * comparison finds them equal). Every cut in that order (top-k, top-p, the draw) is found by a
 * radix descent over the composite's digits, 8 bits per level, most significant first: levels
 * 0-3 are the key's bytes, levels 4-6 the low 24 bits of ~id (ids < 2^24, so bits 31..24 of ~id
 * are all ones and need no level). Per level: a 256-bucket histogram over the tokens of the
 * current domain whose composite matches the digits chosen so far, measured by count (top-k) or by
 * weight (top-p, draw); buckets scanned from the largest digit down to the first whose cumulative
 * measure crosses the target; the larger buckets' measure subtracted; next level. The id levels
 * run only when the cut falls inside a group of tied logits past its first token; otherwise the
 * last key level's lowest id per bucket names the token (the common case: 4 levels per cut).
 *
 * A domain is "every token at or before cut C" in sorted order, i.e. composite >= C (0: all).
 * Steps (smp_plan, then smp_found after each descent):
 *   greedy rows (temperature 0 or top_k 1): the maximum composite (argmax, lowest id), no descent;
 *   top-k (0 < top_k < n): count descent to the top_k-th token;
 *   top-p (top_p < 1): weight descent, first position whose cumulative weight >= top_p * S over
 *     the top-k domain, S its kept weight sum (the CPU accumulates p_i / S and compares with
 *     top_p: the same up to the rounding of that division, ~1e-16 relative);
 *   draw: weight descent over the kept domain, first position whose cumulative weight exceeds
 *     u * S' (strictly, as the CPU's `r -= p; if (r < 0)`), S' the kept weight sum; when nothing
 *     exceeds it (rounding), the domain's last token, as the CPU falls back to its last kept one.
 * The kept sums S, S' need no pass of their own: they are the total of the next descent's first
 * histogram (relative targets: scale * total). Weights are the CPU's floats, expf((l - mx) / T),
 * summed in double. Cost per row: one pass for the maximum, then 4 passes per cut (top-k, top-p,
 * draw), 3 more for a cut inside a tie; each pass reads the row's logits once (L2 after the first).
 *
 * Determinism: the histograms' double atomicAdds run in whatever order the threads reach them, so
 * bucket sums can differ in the last bit between runs; the pick can then differ only when the
 * draw (or the top-p target) lies within ~1e-16 relative of a boundary between two tokens.
 *
 * Shared memory (smp_shared, ~4.3 KiB): 256 doubles and 256 counts for the histogram, 256 lowest
 * ids (last key level), 16 group sums for the scan, a few scalars.
 *
 * The kernel (and the emulation) runs, with a barrier after each phase:
 *     smp_start; smp_max_pass; smp_plan;
 *     while (step != SMP_DONE) { smp_hist; smp_groups; smp_scan; smp_descend; smp_clear; }
 * and thread 0 writes sh->result (the token, or -1). */
#ifndef STRATA_KERNELS_CUDA_SAMPLE_BLOCK_H
#define STRATA_KERNELS_CUDA_SAMPLE_BLOCK_H

#include <float.h>
#include <math.h>
#include <stdint.h>

#include "kernels/cuda_sample.h"
#include "kvstore/half.h"
#include "kvstore/hd.h"

#define SMP_DIGITS 256
#define SMP_GROUPS 16                   /* the scan's first level: 16 groups of 16 digits */
#define SMP_MAX_VOCAB (1 << 24)         /* ids fit the composite's low 24 bits */
#define SMP_KEY_NEG_INF 0x007fffffu     /* smp_key(-inf): a maximum at or below it means no finite logit */
#define SMP_SLOTS 8                     /* per-thread accumulators in smp_hist */

enum { SMP_DONE = 0, SMP_TOPK = 1, SMP_TOPP = 2, SMP_DRAW = 3 };

typedef struct smp_shared {
    double hist[SMP_DIGITS];            /* per digit: tokens (count descent) or weight (weight descent) */
    double group[SMP_GROUPS];           /* hist summed over each group of 16 digits */
    unsigned int count[SMP_DIGITS];     /* per digit: tokens (both descents: an empty bucket is never chosen) */
    unsigned int min_id[SMP_DIGITS];    /* per digit, at the last key level: the lowest id */
    unsigned long long best;            /* maximum composite of the row: its argmax, lowest id */
    unsigned long long cut;             /* the current domain: composites >= cut */
    unsigned long long prefix;          /* the digits chosen so far in this descent */
    double target;                      /* measure still to reach inside the chosen prefix */
    double scale;                       /* weight descents: level 0's target = scale * its total */
    cuda_sample_row par;                /* the row's parameters */
    float mx, temperature;              /* weights: expf((l - mx) / temperature) */
    int bad;                            /* a NaN or +inf logit */
    int step;                           /* SMP_TOPK, SMP_TOPP, SMP_DRAW or SMP_DONE */
    int level;                          /* 0-6: the digit being chosen */
    int weighted, strict, relative;     /* this descent's measure and comparison */
    int take_last;                      /* nothing crossed the target (rounding): the last token */
    int pick;                           /* the scan's result: the largest digit that crosses, or -1 */
    int last;                           /* the smallest non-empty digit, or SMP_DIGITS */
    int32_t result;                     /* the token, or -1 */
} smp_shared;

/* Order-preserving: a < b as floats (-0 == +0) iff smp_key(a) < smp_key(b); NaNs land outside
 * [smp_key(-inf), smp_key(+inf)] and are rejected before any descent. */
STRATA_HD static inline uint32_t smp_key(float x)
{
    uint32_t b = strata_f32_bits(x);
    if ((b & 0x7fffffffu) == 0)
        b = 0; /* -0 sorts with +0: the CPU's comparison finds them equal, so only the id orders them */
    return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}

/* The float of a key (zeros come back as +0, which gives the same weights as -0). */
STRATA_HD static inline float smp_key_value(uint32_t k)
{
    return strata_bits_f32((k & 0x80000000u) ? k & 0x7fffffffu : ~k);
}

STRATA_HD static inline unsigned long long smp_composite(uint32_t key, uint32_t id)
{
    return ((unsigned long long)key << 32) | (unsigned long long)(uint32_t)~id;
}

/* The CPU's weight, as a float: the same expression sampler_pick evaluates. */
STRATA_HD static inline float smp_weight(float x, float mx, float temperature) { return expf((x - mx) / temperature); }

/* The position of a level's digit in the composite, and the bits above it (already chosen). */
STRATA_HD static inline int smp_shift(int level) { return level < 4 ? 56 - 8 * level : 48 - 8 * level; }

STRATA_HD static inline unsigned long long smp_mask(int level)
{
    return level == 0 ? 0ull : ~0ull << (smp_shift(level) + 8);
}

/* Device: atomics on shared memory; emulation: the threads run one after another. */
STRATA_HD static inline void smp_add_f64(double *p, double v)
{
#ifdef __CUDA_ARCH__
    atomicAdd(p, v);
#else
    *p += v;
#endif
}

STRATA_HD static inline void smp_add_u32(unsigned int *p, unsigned int v)
{
#ifdef __CUDA_ARCH__
    atomicAdd(p, v);
#else
    *p += v;
#endif
}

STRATA_HD static inline void smp_min_u32(unsigned int *p, unsigned int v)
{
#ifdef __CUDA_ARCH__
    atomicMin(p, v);
#else
    *p = v < *p ? v : *p;
#endif
}

STRATA_HD static inline void smp_max_u64(unsigned long long *p, unsigned long long v)
{
#ifdef __CUDA_ARCH__
    atomicMax(p, v);
#else
    *p = v > *p ? v : *p;
#endif
}

STRATA_HD static inline void smp_max_i32(int *p, int v)
{
#ifdef __CUDA_ARCH__
    atomicMax(p, v);
#else
    *p = v > *p ? v : *p;
#endif
}

STRATA_HD static inline void smp_min_i32(int *p, int v)
{
#ifdef __CUDA_ARCH__
    atomicMin(p, v);
#else
    *p = v < *p ? v : *p;
#endif
}

/* A product that nvcc may not fuse with a following subtraction: smp_scan and smp_descend both
 * evaluate the level's target and must get the same double. */
STRATA_HD static inline double smp_mul(double a, double b)
{
#ifdef __CUDA_ARCH__
    return __dmul_rn(a, b);
#else
    return a * b;
#endif
}

/* Phase: the histogram emptied (also the start of every descent: smp_clear runs after each level). */
STRATA_HD static inline void smp_clear(smp_shared *sh, unsigned tid, unsigned nthreads)
{
    for (unsigned j = tid; j < SMP_DIGITS; j += nthreads) {
        sh->hist[j] = 0.0;
        sh->count[j] = 0;
        sh->min_id[j] = 0xffffffffu;
    }
}

/* Phase 0. */
STRATA_HD static inline void smp_start(smp_shared *sh, unsigned tid, unsigned nthreads)
{
    smp_clear(sh, tid, nthreads);
    if (tid == 0) {
        sh->best = 0;
        sh->bad = 0;
        sh->pick = -1;
        sh->last = SMP_DIGITS;
        sh->step = SMP_DONE;
        sh->result = -1;
    }
}

/* Phase 1: the row's maximum composite (the argmax, lowest id on ties) and whether it holds a NaN
 * or +inf. One atomic per thread. */
STRATA_HD static inline void smp_max_pass(smp_shared *sh, const float *x, int n, unsigned tid, unsigned nthreads)
{
    unsigned long long best = 0;
    int bad = 0;
    for (unsigned i = tid; i < (unsigned)n; i += nthreads) {
        const uint32_t b = strata_f32_bits(x[i]);
        if ((b & 0x7fffffffu) > 0x7f800000u || b == 0x7f800000u)
            bad = 1;
        const unsigned long long c = smp_composite(smp_key(x[i]), i);
        best = c > best ? c : best;
    }
    smp_max_u64(&sh->best, best);
    if (bad)
        smp_max_i32(&sh->bad, 1);
}

/* Thread 0: a descent over the current domain. */
STRATA_HD static inline void smp_begin(smp_shared *sh, int step)
{
    sh->step = step;
    sh->level = 0;
    sh->prefix = 0;
    sh->take_last = 0;
    sh->weighted = step != SMP_TOPK;
    sh->strict = step == SMP_DRAW;      /* the draw: cumulative weight exceeds u * S' */
    sh->relative = step != SMP_TOPK;
    sh->target = step == SMP_TOPK ? (double)sh->par.top_k : 0.0;
    sh->scale = step == SMP_TOPP ? (double)sh->par.top_p : sh->par.u;
}

/* Thread 0: a descent has found its cut c; narrow the domain and go on, or the draw's token. */
STRATA_HD static inline void smp_found(smp_shared *sh, unsigned long long c)
{
    if (sh->step == SMP_TOPK) {
        sh->cut = c;
        smp_begin(sh, sh->par.top_p < 1.0f ? SMP_TOPP : SMP_DRAW);
    } else if (sh->step == SMP_TOPP) {
        sh->cut = c;
        smp_begin(sh, SMP_DRAW);
    } else {
        sh->result = (int32_t)~(uint32_t)c;
        sh->step = SMP_DONE;
    }
}

/* Phase 2 (thread 0): the row's verdict and the first descent. -1 for a NaN or +inf logit, no
 * finite logit, or parameters sampler_params_validate rejects (and u outside [0, 1) unless
 * greedy); the argmax for greedy parameters. */
STRATA_HD static inline void smp_plan(smp_shared *sh, const cuda_sample_row *row, int n, unsigned tid)
{
    if (tid != 0)
        return;
    const cuda_sample_row p = *row;
    sh->par = p;
    sh->result = -1;
    sh->step = SMP_DONE;
    const uint32_t key = (uint32_t)(sh->best >> 32);
    if (sh->bad || key <= SMP_KEY_NEG_INF)
        return;
    if (!(p.temperature >= 0.0f && p.temperature <= FLT_MAX) || p.top_k < 0 || !(p.top_p > 0.0f && p.top_p <= 1.0f))
        return;
    if (p.temperature == 0.0f || p.top_k == 1) {
        sh->result = (int32_t)~(uint32_t)sh->best;
        return;
    }
    if (!(p.u >= 0.0 && p.u < 1.0))
        return;
    sh->mx = smp_key_value(key);
    sh->temperature = p.temperature;
    sh->cut = 0;
    smp_begin(sh, p.top_k > 0 && p.top_k < n ? SMP_TOPK : p.top_p < 1.0f ? SMP_TOPP : SMP_DRAW);
}

STRATA_HD static inline void smp_flush(smp_shared *sh, int d, double m, unsigned cnt, unsigned first, int track_id)
{
    smp_add_f64(&sh->hist[d], m);
    smp_add_u32(&sh->count[d], cnt);
    if (track_id)
        smp_min_u32(&sh->min_id[d], first);
}

/* Phase 3: the level's histogram over the tokens of the domain that match the prefix. Each thread
 * keeps SMP_SLOTS accumulators (direct-mapped by digit) and adds them to shared memory when a slot
 * changes digit and at the end: at the top levels a row's logits fall into a few digits, and one
 * shared atomic per token there would serialize on those few addresses. A thread's ids increase,
 * so the first id since a slot was (re)started is its lowest. */
STRATA_HD static inline void smp_hist(smp_shared *sh, const float *x, int n, unsigned tid, unsigned nthreads)
{
    const int level = sh->level, shift = smp_shift(level), weighted = sh->weighted, track_id = level == 3;
    const unsigned long long mask = smp_mask(level), prefix = sh->prefix, cut = sh->cut;
    const float mx = sh->mx, temperature = sh->temperature;
    int dig[SMP_SLOTS];
    double acc[SMP_SLOTS];
    unsigned cnt[SMP_SLOTS], first[SMP_SLOTS];
    for (int s = 0; s < SMP_SLOTS; s++) {
        dig[s] = -1;
        acc[s] = 0.0;
        cnt[s] = first[s] = 0;
    }
    for (unsigned i = tid; i < (unsigned)n; i += nthreads) {
        const float l = x[i];
        const unsigned long long c = smp_composite(smp_key(l), i);
        if (c < cut || (c & mask) != prefix)
            continue;
        const int d = (int)((c >> shift) & 0xffu);
        const double m = weighted ? (double)smp_weight(l, mx, temperature) : 1.0;
        for (int s = 0; s < SMP_SLOTS; s++) { /* constant indices: the slots stay in registers */
            if (s != (d & (SMP_SLOTS - 1)))
                continue;
            if (dig[s] != d) {
                if (dig[s] >= 0)
                    smp_flush(sh, dig[s], acc[s], cnt[s], first[s], track_id);
                dig[s] = d;
                acc[s] = 0.0;
                cnt[s] = 0;
                first[s] = i;
            }
            acc[s] += m;
            cnt[s]++;
        }
    }
    for (int s = 0; s < SMP_SLOTS; s++)
        if (dig[s] >= 0)
            smp_flush(sh, dig[s], acc[s], cnt[s], first[s], track_id);
}

/* Phase 4: group sums, each over its 16 digits from the largest down. */
STRATA_HD static inline void smp_groups(smp_shared *sh, unsigned tid, unsigned nthreads)
{
    for (unsigned g = tid; g < SMP_GROUPS; g += nthreads) {
        double s = 0.0;
        for (int j = 15; j >= 0; j--)
            s += sh->hist[g * 16 + (unsigned)j];
        sh->group[g] = s;
    }
}

/* The measure of digits >= b (0 for b past the top), always added in the same order, so that any
 * thread computing it for the same b gets the same double (smp_scan and smp_descend rely on it). */
STRATA_HD static inline double smp_suffix(const smp_shared *sh, int b)
{
    if (b >= SMP_DIGITS)
        return 0.0;
    const int g = b / 16;
    double s = 0.0;
    for (int k = SMP_GROUPS - 1; k > g; k--)
        s += sh->group[k];
    for (int j = g * 16 + 15; j >= b; j--)
        s += sh->hist[j];
    return s;
}

/* The target the current level must reach: a relative descent's level 0 takes scale * its total
 * (the kept sum of the domain, which this histogram has just measured). */
STRATA_HD static inline double smp_level_target(const smp_shared *sh)
{
    return sh->relative && sh->level == 0 ? smp_mul(sh->scale, smp_suffix(sh, 0)) : sh->target;
}

/* Phase 5, a thread per digit: the largest non-empty digit whose cumulative measure (digits at or
 * above it) reaches the target (exceeds it, for the draw), and the smallest non-empty digit (the
 * domain's last tokens, the fallback). Requiring a non-empty bucket keeps a rounding wobble of the
 * suffix sums from choosing a digit no token has. */
STRATA_HD static inline void smp_scan(smp_shared *sh, unsigned tid, unsigned nthreads)
{
    const double t = smp_level_target(sh);
    for (unsigned b = tid; b < SMP_DIGITS; b += nthreads) {
        if (!sh->count[b])
            continue;
        smp_min_i32(&sh->last, (int)b);
        if (sh->take_last)
            continue;
        const double s = smp_suffix(sh, (int)b);
        if (sh->strict ? s > t : s >= t)
            smp_max_i32(&sh->pick, (int)b);
    }
}

/* Phase 6 (thread 0): the digit chosen, the target left inside it, and the next level; after the
 * last key level the token itself when the cut is its key's first token in the domain (or the
 * only one), else the id levels. */
STRATA_HD static inline void smp_descend(smp_shared *sh, unsigned tid)
{
    if (tid != 0)
        return;
    const double t = smp_level_target(sh);
    int d;
    if (sh->pick >= 0) {
        d = sh->pick;
        sh->target = t - smp_suffix(sh, d + 1);
    } else if (sh->last < SMP_DIGITS) {
        d = sh->last;
        sh->take_last = 1;
    } else { /* an empty domain: cannot happen (the row's first token is in every one); stop, do not loop */
        sh->result = -1;
        sh->step = SMP_DONE;
        return;
    }
    sh->pick = -1;
    sh->last = SMP_DIGITS;
    const int level = sh->level;
    sh->prefix |= (unsigned long long)d << smp_shift(level);
    if (level == 3) {
        int first = sh->count[d] == 1;
        if (!first && !sh->take_last) {
            if (sh->weighted) { /* tied tokens weigh the same: does the first one alone reach the target? */
                const double w = (double)smp_weight(smp_key_value((uint32_t)(sh->prefix >> 32)), sh->mx, sh->temperature);
                first = sh->strict ? w > sh->target : w >= sh->target;
            } else {
                first = sh->target <= 1.0;
            }
        }
        if (first) {
            smp_found(sh, sh->prefix | (unsigned long long)(uint32_t)~sh->min_id[d]);
            return;
        }
        sh->prefix |= 0xffull << 24; /* bits 31..24 of ~id: ids < 2^24 */
    } else if (level == 6) {
        smp_found(sh, sh->prefix);
        return;
    }
    sh->level = level + 1;
}

#endif
