/* Bit plans (kvstore/plan.c) and pools whose layers use different codecs (kvstore/pool.c). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvstore/block.h"
#include "kvstore/kv_cache.h"
#include "kvstore/plan.h"

enum { L = 30 };

static void name_of(const kv_codec_params *p, char *buf) { kv_codec_name(p, buf, 64); }

static void expect_layer(const kv_codec_params *plan, int l, const char *name)
{
    char buf[64];
    name_of(&plan[l], buf);
    if (strcmp(buf, name) != 0)
        fail_msg("layer %d is %s, expected %s", l, buf, name);
}

static void expect_error(const char *spec, int n_layers, const char *word)
{
    kv_codec_params plan[L];
    strata_error err = {0};
    if (kv_plan_parse(spec, n_layers, plan, &err) != STRATA_EINVAL)
        fail_msg("\"%s\" was accepted", spec);
    if (!strstr(err.msg, word))
        fail_msg("\"%s\": message \"%s\" lacks \"%s\"", spec, err.msg, word);
}

static void test_parse(void **state)
{
    (void)state;
    kv_codec_params plan[L];
    strata_error err = {0};
    assert_int_equal(kv_plan_parse("kivi2", L, plan, &err), STRATA_OK);
    for (int l = 0; l < L; l++)
        expect_layer(plan, l, "kivi2");
    assert_int_equal(kv_plan_parse("ott2", L, plan, &err), STRATA_OK);
    expect_layer(plan, 0, "ott2-n0");   /* OTT: layers 0 and 1 trace nothing */
    expect_layer(plan, 1, "ott2-n0");
    expect_layer(plan, 2, "ott2");
    assert_int_equal(kv_plan_parse("tada", L, plan, &err), STRATA_OK);
    expect_layer(plan, 0, "tada4");
    expect_layer(plan, 14, "tada4");
    expect_layer(plan, 15, "tada2");
    expect_layer(plan, 29, "tada2");
    assert_int_equal(kv_plan_parse("0-9:tada4,10-29:tada2", L, plan, &err), STRATA_OK);
    expect_layer(plan, 9, "tada4");
    expect_layer(plan, 10, "tada2");
    assert_int_equal(kv_plan_parse(" # a plan\n0 : fp16\n1-28: gear2-d4 # middle\n\n29:kivi4-r64\n", L, plan, &err),
                     STRATA_OK);
    expect_layer(plan, 0, "fp16");
    expect_layer(plan, 1, "gear2-d4");
    expect_layer(plan, 29, "kivi4-r64");

    expect_error("0-9:tada4,11-29:tada2", L, "layer 10 has no codec");
    expect_error("0-9:tada4,9-29:tada2", L, "layer 9 is given twice");
    expect_error("0-30:kivi2", L, "out of range");
    expect_error("0-29:kivi3", L, "unknown kv codec");
    expect_error("9-0:kivi2", L, "bad layer range");
    expect_error("x-3:kivi2", L, "bad layer range");
    expect_error("0-29:", L, "unknown kv codec");
    expect_error("kivi9", L, "unknown kv codec");
    expect_error("0-29:kivi2,tada4", L, "LAYERS:CODEC");
    expect_error("0-29:tada", L, "unknown kv codec");   /* a range names a codec with its bits */
}

static void test_format_round_trip(void **state)
{
    (void)state;
    const char *specs[] = {"kivi2", "0-9:tada4,10-29:tada2", "0:fp16,1-28:gear2-s1,29:ott4-n5-a8",
                           "0-1:ott2-n0,2-29:ott2"};
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        kv_codec_params a[L], b[L];
        char buf[512];
        assert_int_equal(kv_plan_parse(specs[i], L, a, NULL), STRATA_OK);
        kv_plan_format(a, L, buf, sizeof buf);
        assert_string_equal(buf, specs[i]);
        assert_int_equal(kv_plan_parse(buf, L, b, NULL), STRATA_OK);
        for (int l = 0; l < L; l++) {
            char x[64], y[64];
            name_of(&a[l], x);
            name_of(&b[l], y);
            assert_string_equal(x, y);
        }
    }
    /* ott2 as one name formats as its per-layer truth */
    kv_codec_params o[L];
    char buf[256];
    assert_int_equal(kv_plan_parse("ott2", L, o, NULL), STRATA_OK);
    kv_plan_format(o, L, buf, sizeof buf);
    assert_string_equal(buf, "0-1:ott2-n0,2-29:ott2");
    /* and every layer with a pool as the range that keeps it (one name would drop layers 0-1's) */
    assert_int_equal(kv_plan_parse("0-29:ott2", L, o, NULL), STRATA_OK);
    kv_plan_format(o, L, buf, sizeof buf);
    assert_string_equal(buf, "0-29:ott2");
    kv_codec_params back[L];
    assert_int_equal(kv_plan_parse(buf, L, back, NULL), STRATA_OK);
    for (int l = 0; l < L; l++)
        assert_int_equal(back[l].pool_tokens, o[l].pool_tokens);
    assert_int_equal(kv_plan_parse("ott2-n0", L, o, NULL), STRATA_OK);   /* no pool anywhere: one name */
    kv_plan_format(o, L, buf, sizeof buf);
    assert_string_equal(buf, "ott2-n0");
}

static void test_files(void **state)
{
    (void)state;
    char dir[] = "/tmp/strata-plan-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path[128];
    snprintf(path, sizeof path, "%s/plan.txt", dir);
    kv_codec_params a[L], b[L];
    assert_int_equal(kv_plan_parse("0-4:tada8,5-19:tada4,20-29:tada2", L, a, NULL), STRATA_OK);
    strata_error err = {0};
    assert_int_equal(kv_plan_save(path, a, L, "written by a test: model x, text y\nsecond line, with commas: 1,2"
                                  " and a path with \x1b and \r in it", &err), STRATA_OK);
    assert_true(kv_plan_is_file(path));
    assert_false(kv_plan_is_file("kivi2"));
    assert_int_equal(kv_plan_load(path, L, b, &err), STRATA_OK);
    for (int l = 0; l < L; l++) {
        char x[64], y[64];
        name_of(&a[l], x);
        name_of(&b[l], y);
        assert_string_equal(x, y);
    }
    /* a file with the wrong layer count names itself and the problem */
    assert_int_equal(kv_plan_load(path, 24, b, &err), STRATA_EINVAL);
    assert_non_null(strstr(err.msg, path));
    assert_non_null(strstr(err.msg, "out of range"));
    /* a file holding one name */
    FILE *f = fopen(path, "w");
    fputs("# uniform: one name, a comment with a colon, and a comma\nkivi4\n", f);
    fclose(f);
    assert_int_equal(kv_plan_load(path, L, b, &err), STRATA_OK);
    expect_layer(b, 17, "kivi4");
    /* binary junk */
    f = fopen(path, "wb");
    fwrite("0-29:kivi2\0\1\2", 1, 13, f);
    fclose(f);
    assert_int_equal(kv_plan_load(path, L, b, &err), STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "not a text file (byte 0x00 at offset 10)"));
    /* control bytes (an escape sequence, a lone CR) are refused before any entry is quoted back;
     * CRLF line ends and tabs are text */
    static const struct { const char *text; const char *why; } files[] = {
        {"0-29:\x1b[31mkivi2\n", "byte 0x1b at offset 5"},
        {"0-9:kivi2\r15-29:kivi4\n", "byte 0x0d at offset 9"},
        {"0-29:kivi2\x7f\n", "byte 0x7f at offset 10"},
        {"0-29:kivi2\r", "byte 0x0d at offset 10"},
        {"# a plan\r\n0-14:kivi2,\t15-29:kivi4\r\n", NULL},
    };
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        f = fopen(path, "wb");
        fputs(files[i].text, f);
        fclose(f);
        const int rc = kv_plan_load(path, L, b, &err);
        if (files[i].why ? rc != STRATA_EINVAL || !strstr(err.msg, files[i].why) : rc != STRATA_OK)
            fail_msg("file %zu: rc %d, '%s'", i, rc, err.msg);
    }
    expect_layer(b, 15, "kivi4");
    snprintf(path, sizeof path, "%s/missing.txt", dir);
    assert_int_equal(kv_plan_load(path, L, b, &err), STRATA_EIO);
    assert_non_null(strstr(err.msg, "missing.txt"));
    snprintf(path, sizeof path, "%s/plan.txt", dir);
    unlink(path);
    rmdir(dir);
}

/* Saving replaces a plan whole or not at all: calibrate's --out names a file the user may have
 * kept, and a disk filling half way must not leave half a plan (which would load as a plan of
 * fewer ranges, or fail to load) in its place. */
static void test_save_failure_keeps_old(void **state)
{
    (void)state;
    char dir[] = "/tmp/strata-plan-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path[128];
    snprintf(path, sizeof path, "%s/plan.txt", dir);
    kv_codec_params a[L], b[L];
    assert_int_equal(kv_plan_parse("0-9:kivi4,10-29:kivi2", L, a, NULL), STRATA_OK);
    strata_error err = {0};
    const mode_t was_mask = umask(022);
    assert_int_equal(kv_plan_save(path, a, L, "the old plan", &err), STRATA_OK);
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_mode & 07777, 0644);   /* a plan is not secret */
    assert_int_equal(chmod(path, 0600), 0);
    char comment[8192];
    memset(comment, 'c', sizeof comment - 1);
    comment[sizeof comment - 1] = 0;
    kv_codec_params other[L];
    assert_int_equal(kv_plan_parse("fp16", L, other, NULL), STRATA_OK);
    struct rlimit lim;
    assert_int_equal(getrlimit(RLIMIT_FSIZE, &lim), 0);
    struct rlimit small = {1024, lim.rlim_max};
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);   /* a write past the limit fails with EFBIG */
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &small), 0);
    const int rc = kv_plan_save(path, other, L, comment, &err);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &lim), 0);
    signal(SIGXFSZ, prev);
    assert_int_equal(rc, STRATA_EIO);
    assert_non_null(strstr(err.msg, "writing kv plan"));
    assert_non_null(strstr(err.msg, "File too large"));
    assert_int_equal(kv_plan_load(path, L, b, &err), STRATA_OK);   /* the old plan, whole */
    expect_layer(b, 9, "kivi4");
    expect_layer(b, 29, "kivi2");
    /* A replaced plan keeps its mode (the rmdir below checks no temporary file is left). */
    assert_int_equal(kv_plan_save(path, other, L, NULL, &err), STRATA_OK);
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_mode & 07777, 0600);
    assert_int_equal(kv_plan_load(path, L, b, &err), STRATA_OK);
    expect_layer(b, 0, "fp16");
    /* A device is written to, never replaced (calibrate --out /dev/stdout); a folder is refused. */
    assert_int_equal(kv_plan_save("/dev/null", a, L, NULL, &err), STRATA_OK);
    assert_int_equal(stat("/dev/null", &st), 0);
    assert_true(S_ISCHR(st.st_mode));
    assert_int_equal(kv_plan_save(dir, a, L, NULL, &err), STRATA_EIO);
    assert_non_null(strstr(err.msg, "not a regular file"));
    umask(was_mask);
    unlink(path);
    assert_int_equal(rmdir(dir), 0);   /* empty: nothing was left beside the plan */
}

/* A pool for a mixed plan: each layer's blocks are its codec's, sized by it. */
static void test_mixed_pool(void **state)
{
    (void)state;
    kv_geometry g = {.n_layers = 4, .n_kv_heads = 3, .head_dim = 64, .block_tokens = 64};
    kv_codec_params plan[4];
    strata_error err = {0};
    assert_int_equal(kv_plan_parse("0:fp16,1:kivi2-r0,2:kivi4-r0,3:kivi2-r64", 4, plan, &err), STRATA_OK);
    size_t row = kv_plan_row_bytes(&g, plan);
    assert_int_equal(row, kv_block_size(&plan[0], &g) + 2 * kv_block_size(&plan[1], &g) + kv_block_size(&plan[2], &g));
    kv_pool *pool = kv_pool_create_plan(&g, plan, 3, &err);
    assert_non_null(pool);
    assert_int_equal(kv_pool_capacity(pool), 12);
    assert_int_equal(kv_pool_bytes(pool), 3 * row);
    kv_seq *seq = kv_seq_create(pool, 256, &err);
    assert_non_null(seq);
    float *k = calloc(192 * 192, sizeof(float)), *v = calloc(192 * 192, sizeof(float));
    for (size_t i = 0; i < 192 * 192; i++) {
        k[i] = (float)((i * 7919) % 101) / 50.0f - 1.0f;
        v[i] = (float)((i * 104729) % 103) / 51.0f - 1.0f;
    }
    for (int l = 0; l < 4; l++)
        assert_int_equal(kv_seq_append(seq, l, k, v, 192, &err), STRATA_OK);
    const unsigned codecs[4] = {KV_CODEC_FP16, KV_CODEC_KIVI, KV_CODEC_KIVI, KV_CODEC_KIVI};
    const size_t blocks[4] = {3, 3, 3, 2};
    size_t stored = 0;
    for (int l = 0; l < 4; l++) {
        kv_layer_view view;
        kv_seq_layer_view(seq, l, &view);
        assert_int_equal(view.n_blocks, blocks[l]);
        assert_int_equal(view.block_bytes, kv_block_size(&plan[l], &g));
        for (size_t i = 0; i < view.n_blocks; i++) {
            kv_block b;
            assert_int_equal(kv_block_verify(view.blocks[i], view.block_bytes, &b, &err), STRATA_OK);
            assert_int_equal(b.desc.codec, codecs[l]);
            assert_int_equal(b.desc.k_bits, l == 0 ? 16 : l == 2 ? 4 : 2);
            stored += b.block_bytes;
        }
    }
    kv_seq_stats st;
    kv_seq_get_stats(seq, &st);
    assert_int_equal(st.block_bytes, stored);
    assert_int_equal(st.blocks, 11);
    /* layer 3's class (kivi2) is shared with layer 1: 6 slots, 5 used; another 64 tokens of
     * layer 1 fit, but fp16's 3 slots are used up */
    assert_int_equal(kv_seq_append(seq, 0, k, v, 64, &err), STRATA_EFULL);
    assert_non_null(strstr(err.msg, "layer 0"));
    assert_int_equal(kv_seq_append(seq, 1, k, v, 64, &err), STRATA_OK);
    kv_seq_destroy(seq);
    assert_int_equal(kv_pool_free(pool), 12);
    /* a plan layer that does not fit the geometry is named */
    assert_int_equal(kv_plan_parse("0-2:kivi2,3:kivi2-g48", 4, plan, &err), STRATA_OK);
    assert_null(kv_pool_create_plan(&g, plan, 3, &err));
    assert_non_null(strstr(err.msg, "layer 3"));
    assert_non_null(strstr(err.msg, "G=48"));
    kv_pool_destroy(pool);
    free(k);
    free(v);
}

/* The GPU path's condition: one fp16 window for every layer. The refusal says how to meet it,
 * which for a plan with fp16 layers (they keep no window) is -r0 on the others. */
static void test_one_window(void **state)
{
    (void)state;
    kv_codec_params plan[4];
    strata_error err = {0};
    assert_int_equal(kv_plan_parse("0-1:kivi2,2-3:tada4", 4, plan, &err), STRATA_OK);
    assert_int_equal(kv_plan_check_one_window(plan, 4, &err), STRATA_OK);
    assert_int_equal(kv_plan_parse("0:fp16,1-3:kivi2-r0", 4, plan, &err), STRATA_OK);
    assert_int_equal(kv_plan_check_one_window(plan, 4, &err), STRATA_OK);
    assert_int_equal(kv_plan_parse("0:fp16,1-3:kivi2", 4, plan, &err), STRATA_OK);
    assert_int_equal(kv_plan_check_one_window(plan, 4, &err), STRATA_EUNSUPPORTED);
    assert_non_null(strstr(err.msg, "layer 1 keeps an fp16 window of 128 tokens and layer 0 one of 0"));
    assert_non_null(strstr(err.msg, "-r0"));
    assert_int_equal(kv_plan_parse("0-2:kivi2,3:kivi4-r64", 4, plan, &err), STRATA_OK);
    assert_int_equal(kv_plan_check_one_window(plan, 4, &err), STRATA_EUNSUPPORTED);
    assert_non_null(strstr(err.msg, "same -rN"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse),
        cmocka_unit_test(test_format_round_trip),
        cmocka_unit_test(test_files),
        cmocka_unit_test(test_save_failure_keeps_old),
        cmocka_unit_test(test_mixed_pool),
        cmocka_unit_test(test_one_window),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
