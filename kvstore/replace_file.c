/* Whole-or-nothing file replacement (replace_file.h). */
#include "kvstore/replace_file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* fsync of the folder holding path, so a rename into it is on disk. */
static int sync_folder_of(const char *path, strata_error *err)
{
    const char *slash = strrchr(path, '/');
    char *dir = slash ? strndup(path, slash == path ? 1 : (size_t)(slash - path)) : strdup(".");
    if (!dir)
        return strata_fail(err, STRATA_ENOMEM, "saving %s: out of memory", path);
    int rc = STRATA_OK;
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    /* Some file systems cannot sync a folder (EINVAL): the rename is then as durable as they make it. */
    if (fd < 0 || (fsync(fd) != 0 && errno != EINVAL))
        rc = strata_fail(err, STRATA_EIO, "%s was written but its folder %s could not be synced: %s", path, dir,
                         strerror(errno));
    if (fd >= 0)
        close(fd);
    free(dir);
    return rc;
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

int strata_replace_file(const char *path, mode_t new_mode, strata_write_fn write, void *ctx, strata_error *err)
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
    size_t n = strlen(dest);
    char *tmp = malloc(n + sizeof ".tmp-XXXXXX");
    if (!tmp) {
        free(target);
        return strata_fail(err, STRATA_ENOMEM, "saving %s: out of memory", path);
    }
    memcpy(tmp, dest, n);
    memcpy(tmp + n, ".tmp-XXXXXX", sizeof ".tmp-XXXXXX");
    int fd = mkostemp(tmp, O_CLOEXEC);   /* mode 0600 until the fchmod below */
    if (fd < 0) {
        int e = errno;
        free(tmp);
        free(target);
        return strata_fail(err, STRATA_EIO, "cannot create a file beside %s: %s", dest, strerror(e));
    }
    FILE *f = fdopen(fd, "wb");
    int rc = STRATA_OK;
    if (!f) {
        rc = strata_fail(err, STRATA_EIO, "cannot open %s: %s", tmp, strerror(errno));
        close(fd);
    } else {
        /* A replaced file keeps its permissions, never set-id bits; a new one new_mode. */
        const mode_t mode = exists ? (st.st_mode & 0777) : (new_mode & 0777 & ~current_umask());
        if (fchmod(fd, mode) != 0)
            rc = strata_fail(err, STRATA_EIO, "setting the mode of %s: %s", tmp, strerror(errno));
        if (rc == STRATA_OK)
            rc = write(f, path, ctx, err);
        if (rc == STRATA_OK && fflush(f) != 0)
            rc = strata_fail(err, STRATA_EIO, "writing %s: %s", path, strerror(errno));
        if (rc == STRATA_OK && fsync(fd) != 0)
            rc = strata_fail(err, STRATA_EIO, "writing %s: %s", path, strerror(errno));
        if (fclose(f) != 0 && rc == STRATA_OK)
            rc = strata_fail(err, STRATA_EIO, "writing %s: %s", path, strerror(errno));
    }
    if (rc == STRATA_OK && rename(tmp, dest) != 0)
        rc = strata_fail(err, STRATA_EIO, "renaming %s to %s: %s", tmp, dest, strerror(errno));
    if (rc != STRATA_OK)
        unlink(tmp);
    else
        rc = sync_folder_of(dest, err);   /* the rename itself survives a crash only then */
    free(tmp);
    free(target);
    return rc;
}
