/* Replacing a file whole or not at all: the new contents are written beside the final name,
 * synced, and renamed over it, so a failure (a full disk, an I/O error, a crash) leaves the file
 * that was there as it was, never half written. Every program that writes a user's file (block
 * files, kv plans) goes through this. */
#ifndef STRATA_KVSTORE_REPLACE_FILE_H
#define STRATA_KVSTORE_REPLACE_FILE_H

#include <stdio.h>
#include <sys/types.h>

#include "kvstore/error.h"

/* Writes the contents to f; path is the name to use in messages. STRATA_OK or an error code
 * with err set. */
typedef int (*strata_write_fn)(FILE *f, const char *path, void *ctx, strata_error *err);

/* Writes path through write(). Only a regular file is replaced: a device node, a FIFO or a
 * folder in its place is the user's and refused; a symbolic link to a regular file is kept and
 * its target replaced. A replaced file keeps its permission bits (never set-id bits); a new one
 * gets new_mode (e.g. 0600 for files holding a prompt's keys and values, 0644 otherwise; the
 * umask applies). The folder is synced after the rename. */
int strata_replace_file(const char *path, mode_t new_mode, strata_write_fn write, void *ctx, strata_error *err);

/* The same through a named temporary file PATH.tmp-XXXXXX beside path (.strata-tmp-XXXXXX when
 * the name is too long for that suffix; removed on failure; a
 * process killed while writing leaves it): what strata_replace_file does on a file system
 * without O_TMPFILE or in a process without /proc. Exposed so that this path is tested. */
int strata_replace_file_named(const char *path, mode_t new_mode, strata_write_fn write, void *ctx, strata_error *err);

#endif
