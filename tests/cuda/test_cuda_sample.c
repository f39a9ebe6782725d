/* Sampling on the device (kernels/cuda/sample.cu, kernels/cuda_sample.h) against the CPU's pick,
 * sampler_pick (worker/sampler.c), on fresh random rows: vocabularies of 1, 2, 17, 1000, 49152
 * and 128256 tokens; temperatures 0, 0.3, 1, 2.5; top_k 0, 1, 5, 40, n-1, n, n+1; top_p 1, 0.9,
 * 0.5, 0.01; draws 0, 0.999999999 and random; logits spread out, rounded to a few values (ties
 * everywhere, -0 among them), one huge tie at the top, -0 and +0 tied at the top, -inf entries,
 * spreads across the whole float range (differences that overflow to -inf), peaked like a
 * model's. Rows with a NaN or +inf logit or no finite one, and parameters the CPU would reject,
 * must give -1.
 *
 * The rule: greedy rows give sampler_pick's token exactly. Other rows give it too, or a token the
 * pick would give with the draw u * (kept sum) or the top-p target top_p * (top-k sum) moved by at
 * most 1e-6 of the kept sum: the device's expf may differ from glibc's by 2 ulp, and its sums run
 * in another order. check_pick measures that distance in double over the CPU's sorted order.
 * Such mismatches are counted and must stay under 1% of the drawn rows; in the emulation, where
 * both sides use glibc's expf and only the order of additions differs, there must be none. Apart:
 * rows whose top-p target equals a cumulative weight exactly (m tokens of weight 1 at top_p 0.5),
 * where the CPU's running sum of p_i / sum decides by its rounding (kernels/cuda_sample.h): they
 * are tolerated at distance 0 and counted separately (a few in 10^4 rows, all of kind "huge").
 *
 * The kernel's phases (kernels/cuda/sample_block.h) run emulated on the CPU, thread after thread
 * (forward and backward, as no thread may depend on another within a phase), in CI; without a
 * CUDA device the test then exits 77 (skipped). On a device: the same kinds of rows, many in one
 * launch, the output poisoned before each, and 64 rows of 128256 tokens. */
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "cuda_test_util.h"
#include "kernels/cuda/sample_block.h"
#include "kernels/cuda_sample.h"
#include "worker/sampler.h"

#define EMU_THREADS 512u     /* the kernel's block size */
#define BOUNDARY_EPS 1e-6    /* how far from a boundary (relative to the kept sum) a differing pick may be */
#define LLAMA_VOCAB 128256

static uint64_t seed = 0x5a3913;

static double unit(void) { return (double)(cuda_test_rng(&seed) >> 11) * 0x1p-53; }

/* ---- Rows and parameters ---------------------------------------------------------------- */

enum { K_SPREAD, K_TIES, K_FLAT, K_ZEROS, K_NEGINF, K_HUGE, K_PEAKED, N_KINDS };
static const char *const kind_names[N_KINDS] = {"spread", "ties", "flat", "zeros", "-inf", "huge", "peaked"};

static void make_logits(float *x, int n, int kind)
{
    for (int i = 0; i < n; i++) {
        const double r = unit();
        const float v = cuda_test_uniform(&seed);
        switch (kind) {
        case K_SPREAD: x[i] = 8.0f * v; break;
        /* 7 values, -0 among them (roundf(-0.3) is -0): every cut falls inside a tie. */
        case K_TIES: x[i] = 0.5f * roundf(3.0f * v); break;
        /* 90% share the top value: cuts deep inside one tie group, resolved by id. */
        case K_FLAT: x[i] = r < 0.9 ? 0.75f : 0.75f - 3.0f * fabsf(v) - 0.001f; break;
        /* -0 and +0 tied at the top, some below. */
        case K_ZEROS: x[i] = r < 0.3 ? -0.0f : r < 0.6 ? 0.0f : r < 0.8 ? -0.25f * roundf(4.0f * fabsf(v)) : -4.0f * fabsf(v); break;
        case K_NEGINF: x[i] = r < 0.4 ? -INFINITY : 6.0f * v; break;
        /* The whole range: FLT_MAX - (-FLT_MAX) overflows to -inf; subnormals; a tie at FLT_MAX. */
        case K_HUGE:
            x[i] = r < 0.05 ? FLT_MAX : r < 0.1 ? -FLT_MAX : r < 0.15 ? 1e-40f * v : copysignf(powf(10.0f, 38.0f * fabsf(v)), v);
            break;
        default: /* peaked, like a model's logits: a bulk and a few clear favourites */
            x[i] = r < 0.002 ? 10.0f + 4.0f * v : 3.0f * (v + cuda_test_uniform(&seed) + cuda_test_uniform(&seed)) - 4.0f;
            break;
        }
    }
}

static const float temps[] = {0.0f, 0.3f, 1.0f, 2.5f};
static const float top_ps[] = {1.0f, 0.9f, 0.5f, 0.01f};
#define N_TOPK 7

static void top_k_values(int n, int ks[N_TOPK])
{
    const int v[N_TOPK] = {0, 1, 5, 40, n - 1, n, n + 1};
    memcpy(ks, v, sizeof v);
}

static double draw_value(int i) { return i == 0 ? 0.0 : i == 1 ? 0.999999999 : unit(); }

/* Combination j of a subset for the big vocabularies: 3, 7 and 4 are coprime, so consecutive j
 * go through every (temperature > 0, top_k, top_p) before repeating. */
static cuda_sample_row spread_combo(int j, int n)
{
    int ks[N_TOPK];
    top_k_values(n, ks);
    const cuda_sample_row row = {.u = draw_value((j + j / 4) % 3), .temperature = temps[1 + j % 3],
                                 .top_p = top_ps[j % 4], .top_k = ks[j % N_TOPK]};
    return row;
}

/* NaN or +inf, or no finite logit: the contract's -1. */
static int row_bad(const float *x, int n)
{
    int finite = 0;
    for (int i = 0; i < n; i++) {
        if (isnan(x[i]) || x[i] == INFINITY)
            return 1;
        finite |= isfinite(x[i]) != 0;
    }
    return !finite;
}

/* ---- The rule ---------------------------------------------------------------------------- */

typedef struct ref_cand {
    int32_t id;
    float logit;
} ref_cand;

/* sampler_pick's order: logit descending, ties lower id first. */
static int ref_order(const void *a, const void *b)
{
    const ref_cand *x = a, *y = b;
    if (x->logit != y->logit)
        return x->logit > y->logit ? -1 : 1;
    return x->id < y->id ? -1 : (x->id > y->id);
}

typedef struct checker {
    int cap;
    void *sampler_scratch;
    ref_cand *cand;
    double *cum;
    long picks, drawn, mismatches, exact_ties;
    double worst;
} checker;

static void checker_init(checker *c, int cap)
{
    memset(c, 0, sizeof *c);
    c->cap = cap;
    c->sampler_scratch = malloc(SAMPLER_SCRATCH_BYTES(cap));
    c->cand = malloc((size_t)cap * sizeof *c->cand);
    c->cum = malloc((size_t)cap * sizeof *c->cum);
    assert_true(c->sampler_scratch && c->cand && c->cum);
}

static void checker_free(checker *c)
{
    free(c->sampler_scratch);
    free(c->cand);
    free(c->cum);
}

/* Distance from v to [a, b) (b = INFINITY: unbounded). */
static double dist_to(double v, double a, double b) { return v < a ? a - v : v >= b ? v - b : 0.0; }

/* How far (relative to the kept sum) the targets must move for sampler_pick's rule to give `got`:
 * over every top-p cut j a moved target could give, the larger of the cut's move (relative to the
 * top-k sum) and the draw's move to got's interval [cum before, cum through) of the kept sum
 * cum[j], the last kept token's interval open upwards (the CPU's fallback). INFINITY when got is
 * outside the top-k. Computed in double over the CPU's sorted order and float weights.
 * *exact_tie: the top-p target top_p * sum equals a cumulative weight exactly, where the CPU's
 * running sum of p_i / sum decides by its rounding alone (kernels/cuda_sample.h). */
static double boundary_distance(checker *c, const float *x, int n, const cuda_sample_row *row, int32_t got,
                                int *exact_tie)
{
    for (int i = 0; i < n; i++)
        c->cand[i] = (ref_cand){i, x[i]};
    qsort(c->cand, (size_t)n, sizeof *c->cand, ref_order);
    const int nk = row->top_k > 0 && row->top_k < n ? row->top_k : n;
    const float mx = c->cand[0].logit;
    int pos = -1;
    double s = 0.0;
    for (int i = 0; i < nk; i++) {
        s += expf((c->cand[i].logit - mx) / row->temperature);
        c->cum[i] = s;
        if (c->cand[i].id == got)
            pos = i;
    }
    const double total = c->cum[nk - 1], target = (double)row->top_p * total;
    *exact_tie = 0;
    for (int j = 0; j < nk && row->top_p < 1.0f; j++)
        *exact_tie |= c->cum[j] == target;
    if (pos < 0)
        return INFINITY;
    double best = INFINITY;
    for (int j = pos; j < nk; j++) {
        double e_cut = 0.0;
        if (row->top_p < 1.0f) { /* j is the cut for targets in (cum[j-1], cum[j]] (the last: above too) */
            const double lo = j ? c->cum[j - 1] : -INFINITY, hi = j == nk - 1 ? INFINITY : c->cum[j];
            e_cut = (target <= lo ? lo - target : target > hi ? target - hi : 0.0) / total;
        } else if (j != nk - 1) {
            continue;
        }
        const double kept = c->cum[j], r = row->u * kept;
        const double e_draw = dist_to(r, pos ? c->cum[pos - 1] : -INFINITY, pos == j ? INFINITY : c->cum[pos]) / kept;
        const double e = e_cut > e_draw ? e_cut : e_draw;
        best = e < best ? e : best;
    }
    return best;
}

/* got against sampler_pick under the rule of the header comment; fails the test otherwise. */
static void check_pick(checker *c, const float *x, int n, const cuda_sample_row *row, int32_t got, const char *what)
{
    c->picks++;
    const sampler_params sp = {.temperature = row->temperature, .top_k = row->top_k, .top_p = row->top_p};
    if (row_bad(x, n)) {
        if (got != -1)
            fail_msg("%s: n %d: a row with NaN/+inf/no finite logit gave %d, want -1", what, n, (int)got);
        return;
    }
    if (got < 0 || got >= n)
        fail_msg("%s: n %d, T %g k %d p %g u %.17g: token %d out of range", what, n, (double)row->temperature,
                 row->top_k, (double)row->top_p, row->u, (int)got);
    const int32_t want = sampler_pick(&sp, x, n, row->u, c->sampler_scratch);
    if (sampler_params_greedy(&sp)) {
        if (got != want)
            fail_msg("%s: n %d greedy (T %g k %d): %d, want the argmax %d", what, n, (double)row->temperature,
                     row->top_k, (int)got, (int)want);
        return;
    }
    c->drawn++;
    if (got == want)
        return;
    int exact_tie;
    const double e = boundary_distance(c, x, n, row, got, &exact_tie);
    printf("  %s: n %d T %g k %d p %g u %.17g: %d instead of %d, %.3g of the kept sum from a boundary%s\n", what, n,
           (double)row->temperature, row->top_k, (double)row->top_p, row->u, (int)got, (int)want, e,
           exact_tie ? " (top-p target exactly on a boundary)" : "");
    if (!(e <= BOUNDARY_EPS))
        fail_msg("%s: token %d differs from sampler_pick's %d by more than the boundary tolerance (%.3g > %g)", what,
                 (int)got, (int)want, e, BOUNDARY_EPS);
    /* An exact tie of the top-p target is a property of the row (weights such as m ties of weight
     * 1 at top_p 0.5), not rounding noise: counted apart from the 1% budget. */
    if (exact_tie)
        c->exact_ties++;
    else
        c->mismatches++;
    c->worst = e > c->worst ? e : c->worst;
}

/* Mismatches other than exact top-p ties: at most 1% of the drawn rows on the device (one is
 * allowed in a set of fewer than 100, where 1% would mean none); none in the emulation, where only
 * the order of additions differs from the CPU (a ~1e-16 effect). */
static void checker_report(const checker *c, const char *what, int emulated)
{
    printf("  %s: %ld rows, %ld drawn, %ld differ from sampler_pick within the tolerance (worst %.3g), %ld more at "
           "an exact top-p tie\n",
           what, c->picks, c->drawn, c->mismatches, c->worst, c->exact_ties);
    if (emulated && c->mismatches)
        fail_msg("%s: %ld rows differ from sampler_pick in the emulation", what, c->mismatches);
    if (c->mismatches > 1 && c->mismatches * 100 > c->drawn)
        fail_msg("%s: %ld of %ld drawn rows differ from sampler_pick: more than 1%%", what, c->mismatches, c->drawn);
}

/* ---- The emulation ------------------------------------------------------------------------ */

/* The kernel's sequence of phases (kernels/cuda/sample.cu) with the threads of each phase run one
 * after another, backwards when `reverse`: the barriers are the loops' ends. */
static int32_t emu_pick(smp_shared *sh, const float *x, int n, const cuda_sample_row *row, int reverse)
{
#define EMU_PHASE(call)                                                                             \
    for (unsigned k_ = 0; k_ < EMU_THREADS; k_++) {                                                 \
        const unsigned t = reverse ? EMU_THREADS - 1 - k_ : k_;                                     \
        call;                                                                                       \
    }
    EMU_PHASE(smp_start(sh, t, EMU_THREADS));
    EMU_PHASE(smp_max_pass(sh, x, n, t, EMU_THREADS));
    EMU_PHASE(smp_plan(sh, row, n, t));
    int levels = 0;
    while (sh->step != SMP_DONE) {
        if (++levels > 3 * 7) /* three descents of at most 7 levels */
            fail_msg("the descent did not finish");
        EMU_PHASE(smp_hist(sh, x, n, t, EMU_THREADS));
        EMU_PHASE(smp_groups(sh, t, EMU_THREADS));
        EMU_PHASE(smp_scan(sh, t, EMU_THREADS));
        EMU_PHASE(smp_descend(sh, t));
        EMU_PHASE(smp_clear(sh, t, EMU_THREADS));
    }
#undef EMU_PHASE
    return sh->result;
}

/* The key is the float order, -0 equal to +0, and comes back to the float. */
static void test_keys(void **state)
{
    (void)state;
    const float v[] = {-INFINITY, -FLT_MAX, -1e30f, -2.0f, -1.0f, -FLT_MIN, -1e-45f, -0.0f,
                       0.0f,      1e-45f,   FLT_MIN, 1.0f,  2.0f,  1e30f,    FLT_MAX, INFINITY};
    const size_t n = sizeof v / sizeof *v;
    assert_int_equal(smp_key(-INFINITY), SMP_KEY_NEG_INF);
    for (size_t i = 0; i < n; i++) {
        const float back = smp_key_value(smp_key(v[i]));
        assert_true(back == v[i] && (v[i] != 0.0f || !signbit(back)));
        if (i + 1 < n) {
            if (v[i] == v[i + 1])
                assert_int_equal(smp_key(v[i]), smp_key(v[i + 1]));
            else
                assert_true(smp_key(v[i]) < smp_key(v[i + 1]));
        }
    }
    assert_true(smp_key(NAN) > smp_key(INFINITY));
    assert_true(smp_key(-NAN) < smp_key(-INFINITY));
    /* The composite: a larger key first, then the lower id. */
    assert_true(smp_composite(smp_key(1.0f), 7) > smp_composite(smp_key(0.5f), 0));
    assert_true(smp_composite(smp_key(1.0f), 3) > smp_composite(smp_key(1.0f), 4));
    assert_true(smp_composite(smp_key(-0.0f), 3) > smp_composite(smp_key(0.0f), 4));
}

/* Every combination of the grid on fresh rows of every kind, n = 1, 2, 17, 1000. */
static void test_emulated_grid(void **state)
{
    (void)state;
    const int sizes[] = {1, 2, 17, 1000};
    smp_shared *sh = malloc(sizeof *sh);
    float *x = malloc(1000 * sizeof *x);
    assert_true(sh && x);
    checker c;
    checker_init(&c, 1000);
    int trial = 0;
    for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
        const int n = sizes[si];
        int ks[N_TOPK];
        top_k_values(n, ks);
        for (int kind = 0; kind < N_KINDS; kind++)
            for (int ti = 0; ti < 4; ti++)
                for (int ki = 0; ki < N_TOPK; ki++)
                    for (int pi = 0; pi < 4; pi++)
                        for (int ui = 0; ui < 3; ui++) {
                            make_logits(x, n, kind);
                            const cuda_sample_row row = {.u = draw_value(ui), .temperature = temps[ti],
                                                         .top_p = top_ps[pi], .top_k = ks[ki]};
                            check_pick(&c, x, n, &row, emu_pick(sh, x, n, &row, trial++ & 1), kind_names[kind]);
                        }
    }
    checker_report(&c, "emulated, n 1-1000", 1);
    checker_free(&c);
    free(x);
    free(sh);
}

/* The big vocabularies: fewer rows, each kind, the combinations spread over the grid. */
static void test_emulated_big(void **state)
{
    (void)state;
    const int sizes[] = {49152, LLAMA_VOCAB}, per_kind[] = {10, 5};
    smp_shared *sh = malloc(sizeof *sh);
    float *x = malloc(LLAMA_VOCAB * sizeof *x);
    assert_true(sh && x);
    checker c;
    checker_init(&c, LLAMA_VOCAB);
    int j = 0;
    for (size_t si = 0; si < 2; si++)
        for (int kind = 0; kind < N_KINDS; kind++)
            for (int r = 0; r < per_kind[si]; r++, j++) {
                const int n = sizes[si];
                make_logits(x, n, kind);
                const cuda_sample_row row = spread_combo(j, n);
                check_pick(&c, x, n, &row, emu_pick(sh, x, n, &row, j & 1), kind_names[kind]);
            }
    checker_report(&c, "emulated, n 49152 and 128256", 1);
    checker_free(&c);
    free(x);
    free(sh);
}

/* -1 for rows the CPU cannot order or weigh, and for parameters it would reject; greedy rows
 * ignore u. */
static void test_emulated_rejects(void **state)
{
    (void)state;
    smp_shared *sh = malloc(sizeof *sh);
    assert_non_null(sh);
    float x[17];
    const cuda_sample_row draw = {.u = 0.5, .temperature = 1.0f, .top_p = 0.9f, .top_k = 5};
    const cuda_sample_row greedy = {.u = 0.5, .temperature = 0.0f, .top_p = 1.0f, .top_k = 0};
    const float poison[] = {NAN, -NAN, INFINITY};
    for (size_t i = 0; i < 3; i++) {
        make_logits(x, 17, K_SPREAD);
        x[11] = poison[i];
        assert_int_equal(emu_pick(sh, x, 17, &draw, 0), -1);
        assert_int_equal(emu_pick(sh, x, 17, &greedy, 1), -1);
    }
    for (int i = 0; i < 17; i++)
        x[i] = -INFINITY;
    assert_int_equal(emu_pick(sh, x, 17, &draw, 0), -1);
    assert_int_equal(emu_pick(sh, x, 17, &greedy, 0), -1);
    x[16] = -FLT_MAX; /* one finite logit: it is every pick */
    assert_int_equal(emu_pick(sh, x, 17, &draw, 0), 16);
    assert_int_equal(emu_pick(sh, x, 17, &greedy, 0), 16);

    make_logits(x, 17, K_SPREAD);
    const cuda_sample_row bad[] = {
        {.u = 0.5, .temperature = -1.0f, .top_p = 1.0f},   {.u = 0.5, .temperature = NAN, .top_p = 1.0f},
        {.u = 0.5, .temperature = INFINITY, .top_p = 1.0f}, {.u = 0.5, .temperature = 1.0f, .top_p = 1.0f, .top_k = -1},
        {.u = 0.5, .temperature = 1.0f, .top_p = 0.0f},    {.u = 0.5, .temperature = 1.0f, .top_p = 1.5f},
        {.u = 0.5, .temperature = 1.0f, .top_p = NAN},     {.u = 1.0, .temperature = 1.0f, .top_p = 1.0f},
        {.u = -0.1, .temperature = 1.0f, .top_p = 1.0f},   {.u = NAN, .temperature = 1.0f, .top_p = 1.0f},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        assert_int_equal(emu_pick(sh, x, 17, &bad[i], 0), -1);
    /* Greedy parameters ignore u, as sampler_pick does. */
    const cuda_sample_row greedy_u = {.u = 7.0, .temperature = 0.0f, .top_p = 1.0f};
    const cuda_sample_row top1_u = {.u = NAN, .temperature = 1.0f, .top_p = 0.5f, .top_k = 1};
    checker c;
    checker_init(&c, 17);
    check_pick(&c, x, 17, &greedy_u, emu_pick(sh, x, 17, &greedy_u, 0), "greedy, u 7");
    check_pick(&c, x, 17, &top1_u, emu_pick(sh, x, 17, &top1_u, 0), "top_k 1, u NaN");
    checker_free(&c);
    free(sh);
}

/* Ties are resolved in ascending id at every cut, whatever the thread order: a row of one value
 * with u stepping through it picks id floor(u * n) (exact: weights 1, the sum n), and top_k = m
 * keeps ids 0..m-1. */
static void test_emulated_tie_order(void **state)
{
    (void)state;
    smp_shared *sh = malloc(sizeof *sh);
    assert_non_null(sh);
    enum { N = 1000 };
    float x[N];
    for (int i = 0; i < N; i++)
        x[i] = (i % 3) ? 2.0f : -0.0f; /* every third a -0, below the 2s */
    for (int m = 2; m <= 600; m += 37)
        for (int rev = 0; rev < 2; rev++) {
            /* The 2s are ids not divisible by 3, in ascending order: the top_k = m kept are the
             * first m of them; the last one of a draw near 1 is the m-th. */
            const cuda_sample_row row = {.u = 0.999999999, .temperature = 1.0f, .top_p = 1.0f, .top_k = m};
            const int want = (m - 1) / 2 * 3 + 1 + (m - 1) % 2;
            assert_int_equal(emu_pick(sh, x, N, &row, rev), want);
        }
    for (int i = 0; i < N; i++)
        x[i] = 1.5f;
    for (int i = 0; i < 50; i++) {
        const double u = (i + 0.5) / 50.0;
        const cuda_sample_row row = {.u = u, .temperature = 0.3f, .top_p = 1.0f};
        assert_int_equal(emu_pick(sh, x, N, &row, i & 1), (int)floor(u * N));
    }
    free(sh);
}

/* Arguments checked before anything reaches the device. */
static void test_launch_arguments(void **state)
{
    (void)state;
    assert_int_equal(cuda_sample_rows(NULL, 0, 10, NULL, NULL, NULL), 0);
    assert_int_equal(cuda_sample_rows(NULL, -3, 10, NULL, NULL, NULL), 0);
    assert_int_equal(cuda_sample_rows(NULL, 4, 0, NULL, NULL, NULL), (int)cudaErrorInvalidValue);
    assert_int_equal(cuda_sample_rows(NULL, 4, -1, NULL, NULL, NULL), (int)cudaErrorInvalidValue);
    assert_int_equal(cuda_sample_rows(NULL, 4, SMP_MAX_VOCAB + 1, NULL, NULL, NULL), (int)cudaErrorInvalidValue);
    assert_int_equal(cuda_sample_rows(NULL, 4, 100, NULL, NULL, NULL), (int)cudaErrorInvalidValue);
}

/* ---- On the device ------------------------------------------------------------------------ */

/* got[r] for n_rows rows of x through one launch, the output poisoned first. */
static void gpu_sample(const float *x, int n_rows, int n, const cuda_sample_row *rows, int32_t *got)
{
    float *d_x = NULL;
    cuda_sample_row *d_rows = NULL;
    int32_t *d_out = NULL;
    const size_t nx = (size_t)n_rows * (size_t)n;
    CUDA_CHECK(cudaMalloc((void **)&d_x, nx * sizeof *d_x));
    CUDA_CHECK(cudaMalloc((void **)&d_rows, (size_t)n_rows * sizeof *d_rows));
    CUDA_CHECK(cudaMalloc((void **)&d_out, (size_t)n_rows * sizeof *d_out));
    CUDA_CHECK(cudaMemcpy(d_x, x, nx * sizeof *d_x, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_rows, rows, (size_t)n_rows * sizeof *d_rows, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(d_out, 0x7f, (size_t)n_rows * sizeof *d_out)); /* 0x7f7f7f7f: never a token */
    assert_int_equal(cuda_sample_rows(d_x, n_rows, n, d_rows, d_out, NULL), 0);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(got, d_out, (size_t)n_rows * sizeof *got, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaFree(d_x));
    CUDA_CHECK(cudaFree(d_rows));
    CUDA_CHECK(cudaFree(d_out));
}

/* The grid on the device: one launch per (size, kind), a fresh row for every combination (the
 * whole grid up to 1000 tokens, a spread subset above). */
static void test_gpu_grid(void **state)
{
    (void)state;
    const int sizes[] = {1, 2, 17, 1000, 49152, LLAMA_VOCAB}, big_rows[] = {0, 0, 0, 0, 48, 16};
    const int grid = 4 * N_TOPK * 4 * 3;
    checker c;
    checker_init(&c, LLAMA_VOCAB);
    for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
        const int n = sizes[si], n_rows = big_rows[si] ? big_rows[si] : grid;
        float *x = malloc((size_t)n_rows * (size_t)n * sizeof *x);
        cuda_sample_row *rows = malloc((size_t)n_rows * sizeof *rows);
        int32_t *got = malloc((size_t)n_rows * sizeof *got);
        assert_true(x && rows && got);
        int ks[N_TOPK];
        top_k_values(n, ks);
        for (int kind = 0; kind < N_KINDS; kind++) {
            for (int r = 0; r < n_rows; r++) {
                make_logits(x + (size_t)r * (size_t)n, n, kind);
                if (big_rows[si]) {
                    rows[r] = spread_combo(r, n);
                } else {
                    const int ti = r / (N_TOPK * 12), ki = r / 12 % N_TOPK, pi = r / 3 % 4, ui = r % 3;
                    rows[r] = (cuda_sample_row){.u = draw_value(ui), .temperature = temps[ti], .top_p = top_ps[pi],
                                                .top_k = ks[ki]};
                }
            }
            gpu_sample(x, n_rows, n, rows, got);
            for (int r = 0; r < n_rows; r++)
                check_pick(&c, x + (size_t)r * (size_t)n, n, &rows[r], got[r], kind_names[kind]);
        }
        free(x);
        free(rows);
        free(got);
    }
    checker_report(&c, "device grid", 0);
    checker_free(&c);
}

/* Rows the contract answers with -1, beside good ones in the same launch. */
static void test_gpu_rejects(void **state)
{
    (void)state;
    enum { N = 17, ROWS = 8 };
    float x[ROWS * N];
    for (int r = 0; r < ROWS; r++)
        make_logits(x + r * N, N, K_SPREAD);
    x[0 * N + 3] = NAN;
    x[1 * N + 16] = INFINITY;
    for (int i = 0; i < N; i++)
        x[2 * N + i] = -INFINITY;
    x[3 * N + 5] = NAN; /* greedy */
    const cuda_sample_row draw = {.u = 0.25, .temperature = 1.0f, .top_p = 0.9f, .top_k = 5};
    const cuda_sample_row greedy = {.u = 0.25, .temperature = 0.0f, .top_p = 1.0f};
    cuda_sample_row rows[ROWS] = {draw, draw, draw, greedy, draw, greedy, draw, draw};
    rows[6].top_p = 0.0f;
    rows[7].u = 1.0;
    int32_t got[ROWS];
    gpu_sample(x, ROWS, N, rows, got);
    const int32_t want[ROWS] = {-1, -1, -1, -1, 0, 0, -1, -1};
    for (int r = 0; r < ROWS; r++)
        if (r == 4 || r == 5) {
            checker c;
            checker_init(&c, N);
            check_pick(&c, x + r * N, N, &rows[r], got[r], "good row beside rejected ones");
            checker_free(&c);
        } else {
            assert_int_equal(got[r], want[r]);
        }
}

/* Llama 3's vocabulary, 64 rows in one launch (a decode batch): no timing, only the rule. */
static void test_gpu_llama_batch(void **state)
{
    (void)state;
    enum { ROWS = 64 };
    const int n = LLAMA_VOCAB;
    float *x = malloc((size_t)ROWS * n * sizeof *x);
    cuda_sample_row rows[ROWS];
    int32_t got[ROWS];
    assert_non_null(x);
    for (int r = 0; r < ROWS; r++) {
        make_logits(x + (size_t)r * n, n, r % 4 == 3 ? (int)(cuda_test_rng(&seed) % N_KINDS) : K_PEAKED);
        rows[r] = (cuda_sample_row){.u = unit(), .temperature = r % 8 == 0 ? 0.0f : 0.7f, .top_p = 0.95f, .top_k = 40};
        if (r % 5 == 1)
            rows[r] = spread_combo(r, n);
    }
    gpu_sample(x, ROWS, n, rows, got);
    checker c;
    checker_init(&c, n);
    for (int r = 0; r < ROWS; r++)
        check_pick(&c, x + (size_t)r * n, n, &rows[r], got[r], "llama batch");
    checker_report(&c, "device, 64 rows of 128256", 0);
    checker_free(&c);
    free(x);
}

int main(void)
{
    const struct CMUnitTest emulated[] = {
        cmocka_unit_test(test_keys),
        cmocka_unit_test(test_emulated_grid),
        cmocka_unit_test(test_emulated_big),
        cmocka_unit_test(test_emulated_rejects),
        cmocka_unit_test(test_emulated_tie_order),
        cmocka_unit_test(test_launch_arguments),
    };
    const int rc = cmocka_run_group_tests(emulated, NULL, NULL);
    if (rc != 0)
        return rc;
    if (!cuda_test_have_device("test_cuda_sample"))
        return CUDA_TEST_SKIP;
    const struct CMUnitTest gpu[] = {
        cmocka_unit_test(test_gpu_grid),
        cmocka_unit_test(test_gpu_rejects),
        cmocka_unit_test(test_gpu_llama_batch),
    };
    return cmocka_run_group_tests(gpu, NULL, NULL);
}
