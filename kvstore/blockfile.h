/* Block files: a 64-byte file header followed by whole blocks, back to back (docs/format.md).
 * Used to dump a sequence for `strata inspect` and debugging; the same blocks the pool, the host
 * arena and the wire carry. */
#ifndef STRATA_KVSTORE_BLOCKFILE_H
#define STRATA_KVSTORE_BLOCKFILE_H

#include <stdbool.h>
#include <stdio.h>

#include "kvstore/error.h"
#include "kvstore/kv_cache.h"

#define KV_BLOCKFILE_MAGIC 0x46564b53u   /* the bytes "SKVF" */
#define KV_BLOCKFILE_VERSION 1u
#define KV_BLOCKFILE_HEADER_BYTES 64u

/* Writes every block of seq, layer by layer in position order, each layer's non-empty fp16 tail
 * following its blocks as one fp16-codec block, so the file holds the whole sequence.
 * The file is created with mode 0600 (it holds activations of a user's request). Blocks held in
 * a lower tier are fetched back (kv_seq_acquire_layer). It is written as PATH.tmp-XXXXXX, synced,
 * then renamed to path: on failure whatever was at path is untouched and the temporary file is
 * removed. The new file replaces the old one (its mode, owner and other hard links are not
 * carried over); a symbolic link to a regular file stays and its target is replaced. An existing
 * path that is not a regular file (a device, a FIFO, a link to nothing) is refused. */
int kv_blockfile_save(kv_seq *seq, const char *path, strata_error *err);

/* Reads a block file, prints its header and, per block, the header fields, section table and
 * CRC status; with verbose also a few dequantized values. Damaged or malformed content is
 * reported in the output and in the return value (STRATA_ECRC / STRATA_EFORMAT, the first
 * problem found), never crashed on. */
int kv_blockfile_inspect(const char *path, FILE *out, bool verbose, strata_error *err);

#endif
