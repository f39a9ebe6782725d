/* Test helper: counts a folder's entries (not . and ..), so that a test can check that a failed
 * or interrupted save left nothing beside the file it replaces. Include after cmocka.h. */
#ifndef STRATA_TESTS_TEST_DIR_H
#define STRATA_TESTS_TEST_DIR_H

#include <dirent.h>
#include <string.h>

static inline int test_dir_entries(const char *dir)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        n += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
    closedir(d);
    return n;
}

#endif
