/* kvstore/replace_file.c: a file is replaced whole or not at all, and a process killed while
 * writing leaves neither a half-written file nor (where O_TMPFILE works) a temporary one. (The refusals of paths that are
 * not regular files, links and modes are in test_kvstore_blockfile and test_kvstore_plan, through
 * the two savers built on it.) */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tests/test_dir.h"

#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvstore/replace_file.h"

typedef struct contents {
    size_t bytes;     /* written in 4 KiB pieces */
    bool fail_half;   /* fail after half of them */
} contents;

static int write_contents(FILE *f, const char *path, void *ctx, strata_error *err)
{
    const contents *c = ctx;
    char piece[4096];
    memset(piece, 'n', sizeof piece);
    for (size_t done = 0; done < c->bytes; done += sizeof piece) {
        if (c->fail_half && done >= c->bytes / 2)
            return strata_fail(err, STRATA_EFORMAT, "writing %s: scripted failure", path);
        if (fwrite(piece, 1, sizeof piece, f) != sizeof piece || fflush(f) != 0)
            return strata_fail(err, STRATA_EIO, "writing %s: short write", path);
    }
    return STRATA_OK;
}

static void expect_old(const char *path)
{
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    char buf[64] = {0};
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    assert_int_equal(n, 9);
    assert_string_equal(buf, "old file\n");
}

typedef int (*replace_fn)(const char *, mode_t, strata_write_fn, void *, strata_error *);

/* replace() on a file of "old file\n" (mode 0640): killed half way, a failing writer, success, a
 * missing folder. unnamed: the O_TMPFILE path, whose kill leaves nothing; else the named
 * temporary file's, whose kill leaves PATH.tmp-XXXXXX beside the intact old file. */
static void whole_or_nothing(replace_fn replace, bool unnamed)
{
    char dir[] = "/tmp/strata-replace-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path[128];
    snprintf(path, sizeof path, "%s/kept.txt", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs("old file\n", f);
    fclose(f);
    assert_int_equal(chmod(path, 0640), 0);

    /* Killed half way through (SIGXFSZ at a 64 KiB file size limit, as a Ctrl-C would): the old
     * file is intact. */
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        struct rlimit core = {0, 0}, small = {64 * 1024, 64 * 1024};
        setrlimit(RLIMIT_CORE, &core);
        signal(SIGXFSZ, SIG_DFL);
        setrlimit(RLIMIT_FSIZE, &small);
        contents c = {.bytes = 1 << 20};
        replace(path, 0644, write_contents, &c, NULL);
        _exit(0);   /* not reached: the write past the limit kills the process */
    }
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFSIGNALED(st) && WTERMSIG(st) == SIGXFSZ);
    expect_old(path);
    assert_int_equal(test_dir_entries(dir), unnamed ? 1 : 2);
    /* The named path's leftover, which the user removes by hand. */
    assert_int_equal(test_dir_entries_starting(dir, "kept.txt.tmp-", true), unnamed ? 0 : 1);

    /* A failing writer: the old file, and nothing else. */
    strata_error err = {0};
    contents half = {.bytes = 1 << 20, .fail_half = true};
    assert_int_equal(replace(path, 0644, write_contents, &half, &err), STRATA_EFORMAT);
    assert_non_null(strstr(err.msg, "scripted failure"));
    expect_old(path);
    assert_int_equal(test_dir_entries(dir), 1);

    /* Success: the new contents, the old mode, one file. */
    contents whole = {.bytes = 1 << 20};
    assert_int_equal(replace(path, 0644, write_contents, &whole, &err), STRATA_OK);
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    assert_int_equal(sb.st_size, 1 << 20);
    assert_int_equal(sb.st_mode & 07777, 0640);
    assert_int_equal(test_dir_entries(dir), 1);

    /* A new file gets the mode asked for (umask 022 here). */
    char fresh[160];
    snprintf(fresh, sizeof fresh, "%s/new.txt", dir);
    const mode_t old_mask = umask(022);
    assert_int_equal(replace(fresh, 0600, write_contents, &whole, &err), STRATA_OK);
    umask(old_mask);
    assert_int_equal(stat(fresh, &sb), 0);
    assert_int_equal(sb.st_mode & 07777, 0600);
    assert_int_equal(unlink(fresh), 0);

    /* A new file in a folder that does not exist: a clear error. */
    char missing[160];
    snprintf(missing, sizeof missing, "%s/no/such/file", dir);
    assert_int_equal(replace(missing, 0644, write_contents, &whole, &err), STRATA_EIO);
    assert_non_null(strstr(err.msg, "cannot create a file beside"));
    assert_int_equal(unlink(path), 0);
    assert_int_equal(rmdir(dir), 0);
}

static void test_whole_or_nothing(void **state)
{
    (void)state;
    whole_or_nothing(strata_replace_file, true);
}

/* A name of 255 bytes (NAME_MAX), too long for NAME.tmp-XXXXXX: saved all the same, both ways. */
static void test_longest_name(void **state)
{
    (void)state;
    char dir[] = "/tmp/strata-replace-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path[400];
    int at = snprintf(path, sizeof path, "%s/", dir);
    memset(path + at, 'k', 255);
    path[at + 255] = '\0';
    contents whole = {.bytes = 8192};
    strata_error err = {0};
    const replace_fn ways[] = {strata_replace_file, strata_replace_file_named};
    for (int w = 0; w < 2; w++) {
        if (ways[w](path, 0644, write_contents, &whole, &err) != STRATA_OK)
            fail_msg("way %d: %s", w, err.msg);
        struct stat sb;
        assert_int_equal(stat(path, &sb), 0);
        assert_int_equal(sb.st_size, 8192);
        assert_int_equal(test_dir_entries(dir), 1);
    }
    assert_int_equal(unlink(path), 0);
    assert_int_equal(rmdir(dir), 0);
}

/* The path of file systems without O_TMPFILE and of processes without /proc. */
static void test_named_temporary_file(void **state)
{
    (void)state;
    whole_or_nothing(strata_replace_file_named, false);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_whole_or_nothing),
        cmocka_unit_test(test_named_temporary_file),
        cmocka_unit_test(test_longest_name),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
