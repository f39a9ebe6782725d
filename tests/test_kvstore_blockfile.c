/* Block files: save a sequence, read it back independently, inspect it (fields, CRC status,
 * values), and report damaged, truncated or foreign files without crashing. */
#include <math.h>
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

#include "tests/test_dir.h"

#include "kvstore/blockfile.h"
#include "kvstore/kv_cache.h"
#include "test_rng.h"

static uint32_t rd32(const uint8_t *p) { return p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }
static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

typedef struct fixture {
    char path[64];
    kv_pool *pool;
    kv_seq *seq;
} fixture;

/* kivi2, 2 layers: layer 0 gets 300 tokens (2 blocks + 172 tail), layer 1 gets 100 (tail only). */
static int setup(void **state)
{
    fixture *f = calloc(1, sizeof *f);
    strcpy(f->path, "/tmp/strata_blockfile_XXXXXX");
    int fd = mkstemp(f->path);
    if (fd < 0)
        return -1;
    close(fd);
    kv_codec_params p;
    kv_codec_parse("kivi2", &p, NULL);
    kv_geometry g = {2, 3, 64, 64};
    f->pool = kv_pool_create(&g, &p, 16, NULL);
    f->seq = f->pool ? kv_seq_create(f->pool, 1000, NULL) : NULL;
    if (!f->seq)
        return -1;
    size_t row = 3 * 64;
    float *x = malloc(300 * row * sizeof(float));
    uint64_t s = 3;
    for (size_t i = 0; i < 300 * row; i++)
        x[i] = (float)(int)(rng_next(&s) % 4096) / 512.0f - 4.0f;
    if (kv_seq_append(f->seq, 0, x, x, 300, NULL) || kv_seq_append(f->seq, 1, x, x, 100, NULL))
        return -1;
    free(x);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    unlink(f->path);
    kv_seq_destroy(f->seq);
    kv_pool_destroy(f->pool);
    free(f);
    return 0;
}

static char *inspect_to_string(const char *path, bool verbose, int *rc, strata_error *err)
{
    char *text = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&text, &len);
    assert_non_null(m);
    *rc = kv_blockfile_inspect(path, m, verbose, err);
    fclose(m);
    return text;
}

static uint8_t *slurp(const char *path, size_t *size)
{
    FILE *fp = fopen(path, "rb");
    assert_non_null(fp);
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)n);
    assert_int_equal(fread(b, 1, (size_t)n, fp), (size_t)n);
    fclose(fp);
    *size = (size_t)n;
    return b;
}

static void spit(const char *path, const uint8_t *b, size_t n)
{
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(b, 1, n, fp), n);
    fclose(fp);
}

static void test_save_layout(void **state)
{
    fixture *f = *state;
    strata_error err = {0};
    assert_int_equal(kv_blockfile_save(f->seq, f->path, &err), STRATA_OK);
    struct stat st;
    assert_int_equal(stat(f->path, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0600);
    size_t size;
    uint8_t *b = slurp(f->path, &size);
    /* file header, then layer 0: 2 kivi blocks + fp16 tail of 172; layer 1: fp16 tail of 100 */
    assert_int_equal(rd32(b), 0x46564b53u);
    assert_int_equal(rd16(b + 4), 1);
    assert_int_equal(rd16(b + 6), 64);
    assert_int_equal(rd32(b + 8), 4);
    assert_int_equal(rd32(b + 16), size);
    size_t off = 64;
    const struct { int codec; uint32_t layer, tokens, first; } want[4] = {
        {2, 0, 64, 0}, {2, 0, 64, 64}, {1, 0, 172, 128}, {1, 1, 100, 0}};
    for (int i = 0; i < 4; i++) {
        const uint8_t *blk = b + off;
        assert_int_equal(rd32(blk), 0x42564b53u);
        assert_int_equal(blk[12], want[i].codec);
        assert_int_equal(rd32(blk + 16), want[i].layer);
        assert_int_equal(rd32(blk + 20), want[i].tokens);
        assert_int_equal(rd32(blk + 24), want[i].first);
        off += rd32(blk + 8);
    }
    assert_int_equal(off, size);
    /* the tail block holds exactly the cache's fp16 tail */
    kv_layer_view v;
    kv_seq_layer_view(f->seq, 1, &v);
    const uint8_t *last = b + 64;
    for (int i = 0; i < 3; i++)
        last += rd32(last + 8);
    const uint8_t *ksec = last + rd32(last + 64 + 4);
    for (size_t i = 0; i < 100 * 3 * 64; i++)
        assert_int_equal(rd16(ksec + 2 * i), v.tail_k[i]);
    free(b);
}

static void test_inspect_ok(void **state)
{
    fixture *f = *state;
    strata_error err = {0};
    assert_int_equal(kv_blockfile_save(f->seq, f->path, &err), STRATA_OK);
    int rc;
    char *text = inspect_to_string(f->path, true, &rc, &err);
    assert_int_equal(rc, STRATA_OK);
    const char *expect[] = {"4 blocks", "file header CRC", "block 0 at offset 64", "codec kivi (id 2), K 2-bit, V 2-bit",
                            "key group 32 tokens", "residual 128", "layer 0, positions 0..63 (64 tokens)",
                            "3 kv heads x 64 dims", "K_CODES", "V_SCALES", "offset      128  length     3072",
                            "block 1 at offset 9408", "positions 64..127", "codec fp16", "positions 128..299 (172 tokens)",
                            "layer 1, positions 0..99", "payload CRC", "ok", "K[pos 0][head 0][0..7]:",
                            "V[pos 299][head 0][0..7]:", "all 4 blocks ok"};
    for (size_t i = 0; i < sizeof expect / sizeof expect[0]; i++)
        if (!strstr(text, expect[i]))
            fail_msg("inspect output lacks \"%s\":\n%s", expect[i], text);
    assert_null(strstr(text, "MISMATCH"));
    free(text);
    text = inspect_to_string(f->path, false, &rc, &err);
    assert_int_equal(rc, STRATA_OK);
    assert_null(strstr(text, "K[pos"));
    free(text);
}

static void test_inspect_damage(void **state)
{
    fixture *f = *state;
    strata_error err = {0};
    assert_int_equal(kv_blockfile_save(f->seq, f->path, &err), STRATA_OK);
    size_t size;
    uint8_t *orig = slurp(f->path, &size);
    uint8_t *b = malloc(size);
    int rc;
    char *text;

    /* a payload byte of block 1: reported as a CRC mismatch, the other blocks still listed */
    memcpy(b, orig, size);
    b[64 + 9344 + 500] ^= 0x10;
    spit(f->path, b, size);
    memset(&err, 0, sizeof err);
    text = inspect_to_string(f->path, true, &rc, &err);
    assert_int_equal(rc, STRATA_ECRC);
    assert_non_null(strstr(text, "payload CRC"));
    assert_non_null(strstr(text, "MISMATCH"));
    assert_non_null(strstr(text, "block 3 at offset"));
    assert_non_null(strstr(err.msg, "block 1"));
    free(text);

    /* a block header field (bits): the block is malformed, the walk stops there */
    memcpy(b, orig, size);
    b[64 + 9344 + 13] = 3;
    spit(f->path, b, size);
    text = inspect_to_string(f->path, false, &rc, &err);
    assert_int_equal(rc, STRATA_EFORMAT);
    assert_non_null(strstr(text, "ERROR"));
    assert_non_null(strstr(err.msg, "block 1"));
    free(text);

    /* the file header's block count */
    memcpy(b, orig, size);
    b[8] = 9;
    spit(f->path, b, size);
    text = inspect_to_string(f->path, false, &rc, &err);
    assert_int_equal(rc, STRATA_ECRC);
    assert_non_null(strstr(text, "file header CRC MISMATCH"));
    free(text);

    /* every truncation */
    for (size_t n = 0; n < size; n += (n < 200 ? 1 : 397)) {
        spit(f->path, orig, n);
        text = inspect_to_string(f->path, n % 2 == 0, &rc, &err);
        assert_true(rc == STRATA_EFORMAT);
        free(text);
    }
    /* trailing garbage */
    memcpy(b, orig, size);
    spit(f->path, b, size - 1);
    FILE *fp = fopen(f->path, "ab");
    fputs("xyz", fp);
    fclose(fp);
    text = inspect_to_string(f->path, false, &rc, &err);
    assert_int_equal(rc, STRATA_EFORMAT);
    free(text);

    /* not a block file at all, a missing file */
    spit(f->path, (const uint8_t *)"hello, this is not a block file at all; it is long enough to have a header...", 78);
    text = inspect_to_string(f->path, false, &rc, &err);
    assert_int_equal(rc, STRATA_EFORMAT);
    assert_non_null(strstr(text, "magic"));
    free(text);
    text = inspect_to_string("/nonexistent/dir/file.skv", false, &rc, &err);
    assert_int_equal(rc, STRATA_EIO);
    free(text);

    /* random byte changes anywhere: a status, never a crash */
    uint64_t s = 5;
    for (int i = 0; i < 300; i++) {
        memcpy(b, orig, size);
        for (int j = 0; j < 3; j++)
            b[rng_next(&s) % size] = (uint8_t)rng_next(&s);
        spit(f->path, b, size);
        text = inspect_to_string(f->path, true, &rc, &err);
        assert_true(rc == STRATA_OK || rc == STRATA_ECRC || rc == STRATA_EFORMAT);
        free(text);
    }
    free(b);
    free(orig);
}

static void test_save_errors(void **state)
{
    fixture *f = *state;
    strata_error err = {0};
    assert_int_equal(kv_blockfile_save(f->seq, "/nonexistent/dir/x.skv", &err), STRATA_EIO);
    assert_non_null(strstr(err.msg, "/nonexistent/dir/x.skv"));
    assert_int_equal(kv_blockfile_save(NULL, f->path, &err), STRATA_EINVAL);
}

/* A save that fails leaves what was at the path as it was (a file written before, a FIFO) and
 * nothing beside it: the disk filling half way (here a file size limit) must not cost the
 * user an older dump, and a path that is not a regular file is never replaced. */
static void test_save_failure_keeps_old(void **state)
{
    fixture *f = *state;
    strata_error err = {0};
    char dir[] = "/tmp/strata_blockfile_dir_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char old[64], fifo[64];
    snprintf(old, sizeof old, "%s/old.skv", dir);
    snprintf(fifo, sizeof fifo, "%s/fifo", dir);
    static const uint8_t before[100] = {1, 2, 3};
    spit(old, before, sizeof before);
    struct rlimit was;
    assert_int_equal(getrlimit(RLIMIT_FSIZE, &was), 0);
    struct rlimit small = {4096, was.rlim_max};
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);   /* a write past the limit fails with EFBIG */
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &small), 0);
    int rc = kv_blockfile_save(f->seq, old, &err);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &was), 0);
    signal(SIGXFSZ, prev);
    assert_int_equal(rc, STRATA_EIO);
    assert_non_null(strstr(err.msg, "File too large"));
    size_t n;
    uint8_t *after = slurp(old, &n);
    assert_int_equal(n, sizeof before);
    assert_memory_equal(after, before, n);
    free(after);
    assert_int_equal(test_dir_entries(dir), 1);   /* no temporary file left */
    /* Not a regular file: refused before anything is written, and kept. */
    assert_int_equal(mkfifo(fifo, 0600), 0);
    assert_int_equal(kv_blockfile_save(f->seq, fifo, &err), STRATA_EIO);
    assert_non_null(strstr(err.msg, "not a regular file"));
    struct stat st;
    assert_int_equal(lstat(fifo, &st), 0);
    assert_true(S_ISFIFO(st.st_mode));
    /* And a save that succeeds replaces the old file whole, keeping its permissions; a new
     * file is the user's alone (it holds the prompt's keys and values). */
    assert_int_equal(chmod(old, 0640), 0);
    assert_int_equal(kv_blockfile_save(f->seq, old, &err), STRATA_OK);
    assert_int_equal(stat(old, &st), 0);
    assert_true(st.st_size > 4096);
    assert_int_equal(st.st_mode & 07777, 0640);
    assert_int_equal(test_dir_entries(dir), 2);
    char fresh[64];
    snprintf(fresh, sizeof fresh, "%s/fresh.skv", dir);
    assert_int_equal(kv_blockfile_save(f->seq, fresh, &err), STRATA_OK);
    assert_int_equal(stat(fresh, &st), 0);
    assert_int_equal(st.st_mode & 07777, 0600);
    assert_int_equal(unlink(fresh), 0);
    /* Through a symbolic link: the link stays, its target is replaced; a link to nothing is
     * refused. */
    char link[64], dangling[64];
    snprintf(link, sizeof link, "%s/link", dir);
    snprintf(dangling, sizeof dangling, "%s/dangling", dir);
    spit(old, before, sizeof before);
    assert_int_equal(symlink("old.skv", link), 0);
    assert_int_equal(kv_blockfile_save(f->seq, link, &err), STRATA_OK);
    assert_int_equal(lstat(link, &st), 0);
    assert_true(S_ISLNK(st.st_mode));
    assert_int_equal(stat(old, &st), 0);
    assert_true(st.st_size > 4096);
    assert_int_equal(symlink("none.skv", dangling), 0);
    assert_int_equal(kv_blockfile_save(f->seq, dangling, &err), STRATA_EIO);
    assert_non_null(strstr(err.msg, "symbolic link to nothing"));
    assert_int_equal(test_dir_entries(dir), 4);
    unlink(link);
    unlink(dangling);
    unlink(old);
    unlink(fifo);
    assert_int_equal(rmdir(dir), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_save_layout, setup, teardown),
        cmocka_unit_test_setup_teardown(test_inspect_ok, setup, teardown),
        cmocka_unit_test_setup_teardown(test_inspect_damage, setup, teardown),
        cmocka_unit_test_setup_teardown(test_save_errors, setup, teardown),
        cmocka_unit_test_setup_teardown(test_save_failure_keeps_old, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
