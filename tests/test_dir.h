/* Test helpers: counts a folder's entries (not . and ..), so that a test can check that a failed
 * or interrupted save left nothing beside the file it replaces (or removes what it left); removes
 * a test's temporary folder with everything in it. Include after cmocka.h. */
#ifndef STRATA_TESTS_TEST_DIR_H
#define STRATA_TESTS_TEST_DIR_H

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <sys/stat.h>
#include <stdbool.h>
#include <string.h>
#include <unistd.h>

/* Entries whose name starts with prefix ("" for all), removed when remove is true. */
static inline int test_dir_entries_starting(const char *dir, const char *prefix, bool remove)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || strncmp(e->d_name, prefix, strlen(prefix)))
            continue;
        n++;
        if (remove)
            assert_int_equal(unlinkat(dirfd(d), e->d_name, 0), 0);
    }
    closedir(d);
    return n;
}

static inline int test_dir_entries(const char *dir)
{
    return test_dir_entries_starting(dir, "", false);
}

static inline int test_dir_remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path);
}

/* Removes path and everything under it (best effort: a test's temporary folder). */
static inline void test_dir_remove_tree(const char *path)
{
    nftw(path, test_dir_remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

#endif
