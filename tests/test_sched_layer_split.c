/* Pipeline layer splits (coordinator/sched/layer_split.h): parsing of --stage-layers, the even
 * split, a user's list checked against the model, and the balanced split against an exhaustive
 * search over every split of small models (the slowest stage's cost, then the widest stage),
 * with the real shapes of SmolLM2-135M and Llama-3-8B worked out by hand. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "coordinator/sched/layer_split.h"
#include "test_rng.h"

static void parse_ok(const char *text, layer_split_spec *s)
{
    strata_error err = {0};
    if (layer_split_parse(text, s, &err) != STRATA_OK)
        fail_msg("'%s': %s", text ? text : "(null)", err.msg);
}

static void parse_bad(const char *text, const char *why)
{
    layer_split_spec s;
    strata_error err = {0};
    assert_int_equal(layer_split_parse(text, &s, &err), STRATA_EINVAL);
    if (!strstr(err.msg, why))
        fail_msg("'%s': message '%s' lacks '%s'", text, err.msg, why);
}

static void test_parse(void **state)
{
    (void)state;
    layer_split_spec s;
    parse_ok(NULL, &s);
    assert_int_equal(s.mode, LAYER_SPLIT_EVEN);
    parse_ok("", &s);
    assert_int_equal(s.mode, LAYER_SPLIT_EVEN);
    parse_ok("even", &s);
    assert_int_equal(s.mode, LAYER_SPLIT_EVEN);
    parse_ok("balanced", &s);
    assert_int_equal(s.mode, LAYER_SPLIT_BALANCED);
    parse_ok("19,11", &s);
    assert_int_equal(s.mode, LAYER_SPLIT_LIST);
    assert_int_equal(s.n_counts, 2);
    assert_int_equal(s.counts[0], 19);
    assert_int_equal(s.counts[1], 11);
    parse_ok("30", &s);
    assert_int_equal(s.n_counts, 1);
    assert_int_equal(s.counts[0], 30);

    char many[LAYER_SPLIT_MAX_STAGES * 2 + 8] = "";
    for (int i = 0; i < LAYER_SPLIT_MAX_STAGES; i++)
        strcat(many, i ? ",1" : "1");
    parse_ok(many, &s);
    assert_int_equal(s.n_counts, LAYER_SPLIT_MAX_STAGES);
    strcat(many, ",1");
    parse_bad(many, "more than 64 stages");

    parse_bad("Even", "expected even, balanced");
    parse_bad("19,", "expected even, balanced");
    parse_bad(",19", "expected even, balanced");
    parse_bad("19,,11", "expected even, balanced");
    parse_bad("19;11", "expected even, balanced");
    parse_bad("19 ,11", "expected even, balanced");
    parse_bad(" 19,11", "expected even, balanced");
    parse_bad("-1,31", "expected even, balanced");
    parse_bad("+19,11", "expected even, balanced");
    parse_bad("19.5,10.5", "expected even, balanced");
    parse_bad("0,30", "at least 1 layer");
    parse_bad("30,0", "at least 1 layer");
    parse_bad("4294967296,1", "4294967296 layers is more than any model has");
    parse_bad("99999999999999999999999,1", "99999999999999999999999 layers is more");
}

static void plan_ok(const layer_split_spec *s, uint32_t n, uint32_t k, const layer_split_costs *c, uint32_t *begin)
{
    strata_error err = {0};
    if (layer_split_plan(s, n, k, c, begin, &err) != STRATA_OK)
        fail_msg("%u layers, %u stages: %s", n, k, err.msg);
    assert_int_equal(begin[0], 0);
    assert_int_equal(begin[k], n);
    for (uint32_t i = 0; i < k; i++)
        assert_true(begin[i + 1] > begin[i]);
}

/* Plans a split and compares its layer counts with want ("19,11"). */
static void expect_split(const layer_split_spec *s, uint32_t n, uint32_t k, const layer_split_costs *c,
                         const char *want)
{
    uint32_t b[LAYER_SPLIT_MAX_STAGES + 1];
    char text[LAYER_SPLIT_MAX_STAGES * 11];
    plan_ok(s, n, k, c, b);
    layer_split_format(b, k, text, sizeof text);
    assert_string_equal(text, want);
}

static void plan_bad(const layer_split_spec *s, uint32_t n, uint32_t k, const layer_split_costs *c, const char *why)
{
    uint32_t begin[LAYER_SPLIT_MAX_STAGES + 1];
    strata_error err = {0};
    assert_int_equal(layer_split_plan(s, n, k, c, begin, &err), STRATA_EINVAL);
    if (!strstr(err.msg, why))
        fail_msg("message '%s' lacks '%s'", err.msg, why);
}

static void test_even(void **state)
{
    (void)state;
    layer_split_spec s;
    parse_ok("even", &s);
    expect_split(&s, 30, 2, NULL, "15,15");
    expect_split(&s, 30, 4, NULL, "8,8,7,7");   /* the first stages take the extra layers */
    expect_split(&s, 1, 1, NULL, "1");
    uint32_t b[LAYER_SPLIT_MAX_STAGES + 1];
    plan_ok(&s, 30, 30, NULL, b);   /* a layer each */
    char text[8];   /* too short for 30 stages: cut, still a string */
    layer_split_format(b, 30, text, sizeof text);
    assert_string_equal(text, "1,1,1,1");
    layer_split_format(b, 30, text, 1);
    assert_string_equal(text, "");

    plan_bad(&s, 30, 31, NULL, "31 stages for a model of 30 layers");
    plan_bad(&s, 30, 0, NULL, "0 stages");
    plan_bad(&s, 100, 65, NULL, "65 stages");
}

static void test_list(void **state)
{
    (void)state;
    layer_split_spec s;
    uint32_t b[LAYER_SPLIT_MAX_STAGES + 1];
    parse_ok("19,11", &s);
    plan_ok(&s, 30, 2, NULL, b);
    assert_int_equal(b[1], 19);
    parse_ok("1,28,1", &s);
    plan_ok(&s, 30, 3, NULL, b);
    assert_int_equal(b[1], 1);
    assert_int_equal(b[2], 29);

    parse_ok("19,11", &s);
    plan_bad(&s, 30, 3, NULL, "the layer counts name 2 stages, but there are 3");
    plan_bad(&s, 32, 2, NULL, "add up to 30, but the model has 32 layers");
    parse_ok("4294967295,4294967295", &s);   /* the sum does not wrap */
    plan_bad(&s, 30, 2, NULL, "add up to 8589934590,");
    /* A spec built in code, not parsed: an empty stage adding up to the model is still refused. */
    layer_split_spec built = {.mode = LAYER_SPLIT_LIST, .n_counts = 3, .counts = {15, 0, 15}};
    plan_bad(&built, 30, 3, NULL, "stage 1 has 0 layers");
}

/* The exhaustive reference: every way to cut n layers into k non-empty runs. */
typedef struct best {
    double cost;
    uint32_t widest;
    int found;
} best;

static void search(uint32_t n, uint32_t k, const layer_split_costs *c, uint32_t stage, uint32_t left, double cost,
                   uint32_t widest, best *out)
{
    if (stage == k - 1) {
        const double last = (double)left * c->layer_cost + c->head_cost;
        const double total = last > cost ? last : cost;
        const uint32_t w = left > widest ? left : widest;
        if (!out->found || total < out->cost || (total == out->cost && w < out->widest))
            *out = (best){.cost = total, .widest = w, .found = 1};
        return;
    }
    for (uint32_t take = 1; take + (k - 1 - stage) <= left; take++) {
        const double here = (double)take * c->layer_cost;
        search(n, k, c, stage + 1, left - take, here > cost ? here : cost, take > widest ? take : widest, out);
    }
}

static void split_cost(const uint32_t *b, uint32_t k, const layer_split_costs *c, double *cost, uint32_t *widest)
{
    *cost = 0;
    *widest = 0;
    for (uint32_t s = 0; s < k; s++) {
        const uint32_t layers = b[s + 1] - b[s];
        const double here = (double)layers * c->layer_cost + (s == k - 1 ? c->head_cost : 0);
        *cost = here > *cost ? here : *cost;
        *widest = layers > *widest ? layers : *widest;
    }
}

static void test_balanced_against_search(void **state)
{
    (void)state;
    layer_split_spec s;
    parse_ok("balanced", &s);
    uint64_t rng = 0x5eed0001;
    int cases = 0;
    for (uint32_t n = 1; n <= 14; n++)
        for (uint32_t k = 1; k <= n && k <= 5; k++)
            for (int rep = 0; rep < 6; rep++) {
                /* whole-number costs make exact ties, where the second rule decides */
                layer_split_costs c = {.layer_cost = rep < 3 ? (double)(1 + rng_next(&rng) % 4)
                                                             : 0.1 + rng_uniform(&rng),
                                       .head_cost = rep == 0 ? 0
                                                    : rep < 3 ? (double)(rng_next(&rng) % 20)
                                                              : 10 * rng_uniform(&rng)};
                uint32_t b[LAYER_SPLIT_MAX_STAGES + 1];
                plan_ok(&s, n, k, &c, b);
                best ref = {0};
                search(n, k, &c, 0, n, 0, 0, &ref);
                double cost;
                uint32_t widest;
                split_cost(b, k, &c, &cost, &widest);
                if (cost != ref.cost || widest != ref.widest)
                    fail_msg("%u layers, %u stages, costs %g + head %g: got cost %g widest %u, best is %g, %u", n, k,
                             c.layer_cost, c.head_cost, cost, widest, ref.cost, ref.widest);
                cases++;
            }
    assert_true(cases > 300);
}

/* Matrix weights per token: q and o (embedding x heads x head_dim), k and v, the three FFN
 * matrices; the head is vocabulary x embedding. */
static layer_split_costs shape_costs(double e, double heads_dim, double kv_dim, double ff, double vocab)
{
    return (layer_split_costs){.layer_cost = 2 * e * heads_dim + 2 * e * kv_dim + 3 * e * ff, .head_cost = vocab * e};
}

static void test_balanced_real_shapes(void **state)
{
    (void)state;
    layer_split_spec s;
    parse_ok("balanced", &s);
    /* SmolLM2-135M: 30 layers, 576 wide, 9 x 64 query and 3 x 64 KV, FFN 1536, 49152 tokens.
     * A layer is 3538944 weights and the head 28311552, exactly 8 layers: with two stages,
     * 19 layers against 11 + 8. */
    layer_split_costs smol = shape_costs(576, 576, 192, 1536, 49152);
    expect_split(&s, 30, 2, &smol, "19,11");
    /* three stages: 38 layer-equivalents over 3 is 12.67; 13,13 and 4 + 8 = 12 */
    expect_split(&s, 30, 3, &smol, "13,13,4");
    expect_split(&s, 30, 1, &smol, "30");
    /* A head of more than 29 layers leaves the last stage one layer. */
    layer_split_costs big_head = {.layer_cost = 1, .head_cost = 40};
    expect_split(&s, 30, 2, &big_head, "29,1");

    /* Llama-3-8B: 32 layers, 4096 wide, 32 x 128 query and 8 x 128 KV, FFN 14336, 128256
     * tokens: a layer is 218103808 weights, the head 525336576 (2.41 layers). Two stages:
     * 17 layers (3.71e9) against 15 + head (3.80e9); 18 against 14 + head would be 3.93e9. */
    layer_split_costs llama = shape_costs(4096, 4096, 1024, 14336, 128256);
    expect_split(&s, 32, 2, &llama, "17,15");
    /* four: 35.4 layer-equivalents; 9,9,9,5 and 9,9,8,6 tie (slowest 9 layers, widest 9):
     * the first found, the smallest last stage, is kept */
    expect_split(&s, 32, 4, &llama, "9,9,9,5");

    plan_bad(&s, 30, 2, NULL, "positive cost");
    layer_split_costs zero = {0};
    plan_bad(&s, 30, 2, &zero, "positive cost");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse),
        cmocka_unit_test(test_even),
        cmocka_unit_test(test_list),
        cmocka_unit_test(test_balanced_against_search),
        cmocka_unit_test(test_balanced_real_shapes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
