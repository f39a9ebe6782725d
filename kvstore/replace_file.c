/* Whole-or-nothing file replacement (replace_file.h). */
#include "kvstore/replace_file.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* The folder holding path ("." for a bare name), malloc'd; NULL when out of memory. */
static char *folder_of(const char *path)
{
    const char *slash = strrchr(path, '/');
    return slash ? strndup(path, slash == path ? 1 : (size_t)(slash - path)) : strdup(".");
}

/* fsync of folder dir, so a rename of path into it is on disk. */
static int sync_folder(const char *dir, const char *path, strata_error *err)
{
    int rc = STRATA_OK;
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    /* Some file systems cannot sync a folder (EINVAL): the rename is then as durable as they make it. */
    if (fd < 0 || (fsync(fd) != 0 && errno != EINVAL))
        rc = strata_fail(err, STRATA_EIO, "%s was written but its folder %s could not be synced: %s", path, dir,
                         strerror(errno));
    if (fd >= 0)
        close(fd);
    return rc;
}

/* Gives the unnamed file fd (O_TMPFILE) a name: tmp, a template ending in XXXXXX whose X's are
 * replaced until a name is free. linkat through /proc names it without the privilege that
 * AT_EMPTY_PATH needs. */
static int link_unnamed(int fd, char *tmp, const char *dest, strata_error *err)
{
    char proc[64];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
    static const char digits[] = "abcdefghijklmnopqrstuvwxyz0123456789";
    char *x = tmp + strlen(tmp) - 6;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t seed = (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)tmp;
    for (int attempt = 0; attempt < 100; attempt++) {
        for (int i = 0; i < 6; i++) {
            seed = seed * 6364136223846793005ull + 1442695040888963407ull;
            x[i] = digits[(seed >> 33) % (sizeof digits - 1)];
        }
        if (linkat(AT_FDCWD, proc, AT_FDCWD, tmp, AT_SYMLINK_FOLLOW) == 0)
            return STRATA_OK;
        if (errno != EEXIST)
            return strata_fail(err, STRATA_EIO, "naming the file written beside %s: %s", dest, strerror(errno));
    }
    return strata_fail(err, STRATA_EIO, "naming the file written beside %s: no free temporary name", dest);
}

/* The process's umask without changing it (umask(2) can only be read by setting it, which races
 * with other threads creating files): from /proc, else the common 022. */
static mode_t current_umask(void)
{
    mode_t mask = 022;
    FILE *f = fopen("/proc/self/status", "re");
    if (!f)
        return mask;
    char line[256];
    while (fgets(line, sizeof line, f)) {
        unsigned m;
        if (sscanf(line, "Umask: %o", &m) == 1) {
            mask = (mode_t)(m & 0777);
            break;
        }
    }
    fclose(f);
    return mask;
}

/* unnamed: first try an unnamed file (O_TMPFILE) named once complete. */
static int replace_file(const char *path, mode_t new_mode, strata_write_fn write, void *ctx, bool unnamed,
                        strata_error *err)
{
    if (!path || !*path || !write)
        return strata_fail(err, STRATA_EINVAL, "saving a file: no path or contents");
    /* Only a regular file is ever replaced: a device node or a FIFO in its place is the user's.
     * A link to a regular file is kept, and its target replaced. */
    struct stat st;
    char *target = NULL;
    const bool exists = lstat(path, &st) == 0;
    if (exists && S_ISLNK(st.st_mode)) {
        if (!(target = realpath(path, NULL)))
            return strata_fail(err, STRATA_EIO, "%s is a symbolic link to nothing (%s)", path, strerror(errno));
        if (stat(target, &st) != 0 || !S_ISREG(st.st_mode)) {
            free(target);
            return strata_fail(err, STRATA_EIO, "%s links to something that is not a regular file: not replacing it",
                               path);
        }
    } else if (exists && !S_ISREG(st.st_mode)) {
        return strata_fail(err, STRATA_EIO, "%s exists and is not a regular file: not replacing it", path);
    }
    const char *dest = target ? target : path;
    /* The contents go first into an unnamed file in the destination's folder (O_TMPFILE), named
     * only once complete and synced: a process killed while writing (Ctrl-C during a long save)
     * leaves nothing behind. File systems without O_TMPFILE (and processes without /proc, which
     * the naming goes through) get a named temporary file instead, which such a kill leaves. */
    char *dir = folder_of(dest);
    if (!dir) {
        free(target);
        return strata_fail(err, STRATA_ENOMEM, "saving %s: out of memory", path);
    }
    /* The temporary name is PATH.tmp-XXXXXX, so a user can tell what a left one was; a name too
     * long for that (NAME_MAX) gets .strata-tmp-XXXXXX in the same folder. */
    const char *base = strrchr(dest, '/') ? strrchr(dest, '/') + 1 : dest;
    const bool short_name = strlen(base) + sizeof ".tmp-XXXXXX" - 1 > NAME_MAX;
    size_t n = short_name ? (size_t)(base - dest) : strlen(dest);
    const char *suffix = short_name ? ".strata-tmp-XXXXXX" : ".tmp-XXXXXX";
    char *tmp = malloc(n + strlen(suffix) + 1);
    if (!tmp) {
        free(dir);
        free(target);
        return strata_fail(err, STRATA_ENOMEM, "saving %s: out of memory", path);
    }
    memcpy(tmp, dest, n);
    memcpy(tmp + n, suffix, strlen(suffix) + 1);
    bool tmp_exists = false;
    int fd = unnamed ? open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600) : -1;
    if (!unnamed || (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL))) {
        unnamed = false;
        fd = mkostemp(tmp, O_CLOEXEC);   /* mode 0600 until the fchmod below */
        tmp_exists = fd >= 0;
    }
    if (fd < 0) {
        int e = errno;
        free(tmp);
        free(dir);
        free(target);
        return strata_fail(err, STRATA_EIO, "cannot create a file beside %s: %s", dest, strerror(e));
    }
    FILE *f = fdopen(fd, "wb");
    int rc = STRATA_OK;
    if (!f) {
        rc = strata_fail(err, STRATA_EIO, "cannot open a file beside %s: %s", dest, strerror(errno));
        close(fd);
    } else {
        /* A replaced file keeps its permissions, never set-id bits; a new one new_mode. */
        const mode_t mode = exists ? (st.st_mode & 0777) : (new_mode & 0777 & ~current_umask());
        if (fchmod(fd, mode) != 0)
            rc = strata_fail(err, STRATA_EIO, "setting the mode of a file beside %s: %s", dest, strerror(errno));
        if (rc == STRATA_OK)
            rc = write(f, path, ctx, err);
        if (rc == STRATA_OK && fflush(f) != 0)
            rc = strata_fail(err, STRATA_EIO, "writing %s: %s", path, strerror(errno));
        if (rc == STRATA_OK && fsync(fd) != 0)
            rc = strata_fail(err, STRATA_EIO, "writing %s: %s", path, strerror(errno));
        if (rc == STRATA_OK && unnamed && (rc = link_unnamed(fd, tmp, dest, err)) == STRATA_OK)
            tmp_exists = true;   /* linked before fclose: the descriptor is what names it */
        if (fclose(f) != 0 && rc == STRATA_OK)
            rc = strata_fail(err, STRATA_EIO, "writing %s: %s", path, strerror(errno));
    }
    if (rc == STRATA_OK && rename(tmp, dest) != 0)
        rc = strata_fail(err, STRATA_EIO, "renaming %s to %s: %s", tmp, dest, strerror(errno));
    if (rc != STRATA_OK && tmp_exists)
        unlink(tmp);
    else if (rc == STRATA_OK)
        rc = sync_folder(dir, dest, err);   /* the rename itself survives a crash only then */
    free(dir);
    free(tmp);
    free(target);
    return rc;
}

int strata_replace_file(const char *path, mode_t new_mode, strata_write_fn write, void *ctx, strata_error *err)
{
    /* The unnamed file is named through /proc/self/fd, which a container may lack. */
    return replace_file(path, new_mode, write, ctx, access("/proc/self/fd", X_OK) == 0, err);
}

int strata_replace_file_named(const char *path, mode_t new_mode, strata_write_fn write, void *ctx, strata_error *err)
{
    return replace_file(path, new_mode, write, ctx, false, err);
}
