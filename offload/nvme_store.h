/* The NVMe tier: compressed KV blocks (docs/format.md) in preallocated slab files of a private
 * directory, written and read asynchronously with io_uring.
 *
 * Layout. The directory (created 0700 if absent; its parent must exist; an existing one must
 * belong to this process's user and not be writable by group or others) holds slab files
 * slab-NNNN.kv (0600, O_DIRECT, preallocated with fallocate where the filesystem supports it),
 * each slab_bytes long, together at most budget_bytes (nvme_kv_mib). A block of len bytes takes
 * an extent of ceil(len / 4096) whole 4 KiB pages inside one slab (first fit, lowest slab first);
 * the slack after the block in its last page is written as zeros. A store holds an exclusive
 * flock on its directory, so two stores cannot share one. The slab files hold no index: the
 * caller keeps each block's nvme_loc, and destroy deletes the slab files.
 *
 * I/O. Blocks are staged through a fixed set of 4 KiB-aligned staging buffers (staging_bufs of
 * staging_buf_bytes each), registered with the ring, as are the slab files; a block larger than
 * one buffer is moved as several chunk operations, one buffer each. All operations prepared by
 * one call are submitted with one io_uring_submit. Requests that find no free buffer wait in
 * FIFO order inside the store: submit never blocks and never fails for lack of buffers.
 * nvme_store_poll() reaps whatever has completed without blocking, issues what can be issued and
 * returns finished requests; nvme_store_wait() blocks until at least one request finishes.
 *
 * A write is reported complete (status STRATA_OK) only when all of the following hold:
 *  - written fully: every chunk's completion covered its whole length. A short count is
 *    resubmitted for the remainder (a chunk fails with EIO after NVME_MAX_RETRIES resubmissions
 *    in a row that moved nothing: under O_DIRECT a count below one page); 0 bytes written is an
 *    error, never a loop. A transfer that completes with EINTR or EAGAIN is
 *    issued again (the same count of retries; the synchronous path retries EINTR at once).
 *  - durable: after the data of the write completed, an fdatasync (IORING_OP_FSYNC with
 *    IORING_FSYNC_DATASYNC) of its slab file completed successfully. fdatasyncs are batched: one
 *    is issued per slab file when no more writes to it are in flight (or sync_batch writes are
 *    waiting), and it makes every write that completed before it durable (one answering EINTR or EAGAIN is
 *    issued again, up to NVME_MAX_RETRIES times, before its writes fail). This was chosen over
 *    RWF_DSYNC per write because preallocated extents are "unwritten" until first written, so
 *    every DSYNC write would commit the journal on its own; a batch commits once.
 *    Nothing survives a restart (no index; a new store truncates the slabs), so durability is
 *    not for crash recovery: it is how a write-back error (buffered I/O) reaches the write
 *    before the host copy is freed.
 *  - verified: see nvme_verify_mode. Only then may the copy in the tier above be freed.
 * A read is complete when all its bytes were read (short reads resubmitted likewise) and
 * kv_block_verify() accepted them: magic, version, block_bytes equal to the location's length,
 * every header field, and both CRC32Cs. A damaged block is STRATA_ECRC whatever the check that
 * caught it (a header that no longer parses included: the bytes were verified when written),
 * with a message naming the block's tag, slab and offset; the destination then
 * holds the damaged bytes, which the caller must not use.
 *
 * Fallbacks, each reported by nvme_store_describe() and in the stats:
 *  - io_uring_queue_init fails (EPERM under seccomp, ENOSYS, io_uring_disabled sysctl) or is
 *    disabled by the option force_sync_io or the environment variable STRATA_NO_IO_URING=1:
 *    the same API runs on pread/pwrite/fdatasync, executed synchronously inside submit/poll
 *    (completions are still delivered by poll, and fdatasync is still batched per poll).
 *  - buffer or file registration fails (e.g. RLIMIT_MEMLOCK): plain io_uring reads and writes
 *    on unregistered buffers/files.
 *  - the filesystem refuses O_DIRECT (EINVAL at open, e.g. older tmpfs) or force_buffered is
 *    set: buffered I/O; fdatasync still makes writes durable.
 *
 * Faults. Every failure is per request: the completion carries the status and a message saying
 * what failed where (operation, slab, offset, errno text); the store stays usable for other
 * blocks. ENOSPC from the filesystem is STRATA_EFULL, other I/O errors STRATA_EIO, a budget with
 * no extent large enough STRATA_EFULL at submit. A failed write's extent is released by the
 * store (its location must not be used). A failed fdatasync fails every write waiting on it, and
 * every write whose data completed while it ran (it may have written them back and lost them; the
 * kernel reports that error once). io_uring_enter failing for good (any error but EAGAIN, EBUSY
 * and EINTR, or those for 10 s): the operations the kernel has not taken fail with STRATA_EIO
 * naming the error, what it took completes as usual, and new requests are refused (STRATA_EIO);
 * if even waiting for completions keeps failing for 10 s, everything outstanding fails and
 * destroy leaves the staging buffers allocated (the kernel may still write into them).
 *
 * Thread-safety: none; a store belongs to the thread that created it (one ring per worker, design
 * section 5; the ring is created single-issuer). Calls from another thread are refused: submit,
 * free and wait_ticket return STRATA_EINVAL, poll and wait return 0. */
#ifndef STRATA_OFFLOAD_NVME_STORE_H
#define STRATA_OFFLOAD_NVME_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvstore/error.h"

#define NVME_PAGE 4096u
#define NVME_MAX_RETRIES 8  /* resubmissions in a row of one chunk that moved nothing (short counts,
                             * EINTR/EAGAIN), or of one fdatasync */
#define NVME_MAX_SLABS 4096  /* slab files of one store (each a registered file of its ring) */
#define NVME_DEFAULT_SLABS 256 /* the default slab size keeps a budget to this many files */

typedef struct nvme_store nvme_store;

/* Where a block lives: slab file, byte offset (a multiple of 4096) and the block's length. */
typedef struct nvme_loc {
    uint32_t slab;
    uint32_t len;
    uint64_t offset;
} nvme_loc;

typedef enum nvme_verify_mode {
    /* Default. At submit the block is checked with kv_block_verify (both CRCs) before anything
     * is written, so only a correct block reaches the disk, and the completion counts must cover
     * every byte. Cost: one CRC32C pass over the block (~7 GB/s with SSE4.2), no extra I/O.
     * Corruption on the medium after the write is caught at restore (STRATA_ECRC). */
    NVME_VERIFY_CRC = 0,
    /* Additionally, after the write is durable, the extent is read back and compared byte for
     * byte with the source (and CRC-verified). Cost: one extra read of every block. With
     * buffered I/O (no O_DIRECT) the read-back may be served by the page cache. */
    NVME_VERIFY_READBACK = 1,
} nvme_verify_mode;

typedef enum nvme_op_kind {
    NVME_OP_WRITE = 1,
    NVME_OP_READ = 2,
    NVME_OP_FSYNC = 3,
} nvme_op_kind;

/* What a fault-injection hook sees: one completed kernel operation (or pread/pwrite call). */
typedef struct nvme_fault_op {
    nvme_op_kind kind;
    uint64_t seq;        /* 1-based count of completions seen by the hook, all kinds together */
    uint64_t tag;        /* the request's tag */
    uint32_t slab;
    uint64_t offset;     /* file offset of this operation */
    uint32_t len;        /* bytes requested by this operation (0 for fsync) */
    bool readback;       /* a read issued by NVME_VERIFY_READBACK */
    uint8_t *data;       /* a read's bytes as they arrived (res of them when res > 0); NULL for
                          * writes and fsyncs */
} nvme_fault_op;

/* Returns the result the store should see instead of res (the real result: bytes or -errno):
 * return res to leave it alone, -EIO / -ENOSPC to fail it, a smaller count for a short
 * transfer. A read's data may be changed, as a device returning other bytes than it was given
 * would. For tests only. */
typedef int (*nvme_fault_fn)(void *ctx, const nvme_fault_op *op, int res);

typedef struct nvme_store_options {
    const char *dir;            /* spill directory (required) */
    uint64_t budget_bytes;      /* total slab bytes; rounded down to pages (required, >= 1 page) */
    uint64_t slab_bytes;        /* per slab file; 0: min(budget, 1 GiB), or budget / 256 when that
                                 * is more (at most 256 files). Rounded down to pages */
    unsigned staging_bufs;      /* staging buffers = max chunk operations in flight; 0: 64 */
    size_t staging_buf_bytes;   /* per buffer, a multiple of 4096; 0: 256 KiB */
    unsigned sync_batch;        /* fdatasync when this many writes wait even if more are in
                                 * flight; 0: staging_bufs */
    nvme_verify_mode verify;
    bool force_sync_io;         /* pread/pwrite path even if io_uring works */
    bool force_buffered;        /* no O_DIRECT */
    bool no_prealloc;           /* skip fallocate (slabs are sparse; ENOSPC shows at write) */
    bool no_register;           /* do not register buffers/files (tests the plain path) */
    nvme_fault_fn fault;        /* fault injection, tests only */
    void *fault_ctx;
} nvme_store_options;

/* Defaults for everything but dir and budget_bytes. */
void nvme_store_options_init(nvme_store_options *o, const char *dir, uint64_t budget_bytes);

/* Creates the directory if needed, the slab files, the ring and the staging buffers. Errors:
 * STRATA_EIO naming the path and errno (directory not creatable, not a directory, another user's
 * or writable by others, a file not creatable, a symbolic link, hard link or another user's file
 * where a slab file goes (left as it is), directory locked by another store), STRATA_EFULL if preallocation hits ENOSPC,
 * STRATA_EINVAL for bad options, STRATA_ENOMEM. */
nvme_store *nvme_store_create(const nvme_store_options *o, strata_error *err);

/* Cancels nothing: waits for the operations in flight (the kernel owns their buffers), then
 * closes everything and deletes the slab files it created (a file put under a slab's name since
 * stays) and the directory if the store created it. */
void nvme_store_destroy(nvme_store *s);

/* The paths destroy removes, for a process that must remove them where destroy cannot run (a
 * handler of a fatal signal; the store keeps no global state for that): every slab file, then
 * the spill directory when the store created it (remove the files first). Writes path i at
 * paths + i * path_cap for i < cap; returns how many there are, or 0 when one does not fit
 * path_cap bytes. */
size_t nvme_store_owned_paths(const nvme_store *s, char *paths, size_t path_cap, size_t cap);

/* A finished request. */
typedef struct nvme_completion {
    uint64_t ticket;
    uint64_t tag;
    nvme_op_kind kind;    /* NVME_OP_WRITE or NVME_OP_READ */
    int status;           /* STRATA_OK or an error code */
    nvme_loc loc;         /* for a write: valid only if status is STRATA_OK */
    strata_error err;     /* the message when status != STRATA_OK */
} nvme_completion;

/* Starts writing the len-byte block at src (len at most 4 GiB - 4 KiB, else STRATA_EINVAL). src
 * must stay valid and unchanged until the request completes. The block is verified first (kv_block_verify; block_bytes must equal len)
 * and an extent allocated: a bad block (STRATA_ECRC / STRATA_EFORMAT) or a full tier
 * (STRATA_EFULL) fails here, synchronously, and nothing is queued. On success *ticket identifies
 * the request and *loc (may be NULL) where the block will live once the write completes OK.
 * tag is the caller's name for the block (e.g. its tier id); messages use it. */
int nvme_store_submit_write(nvme_store *s, const void *src, size_t len, uint64_t tag,
                            uint64_t *ticket, nvme_loc *loc, strata_error *err);

/* Starts reading the block at loc into dst (cap >= loc.len bytes; any alignment). STRATA_EINVAL
 * unless loc is a block whose write completed OK and that was not freed. dst must stay valid until
 * the request completes; the location must not be freed before that. When dst is
 * 4096-aligned and cap >= loc.len rounded up to 4096 (a host arena extent is), the data is read
 * straight into dst without a staging copy (dst's bytes after loc.len up to that rounded length
 * then receive the on-disk slack, zeros); otherwise it goes through a staging buffer. */
int nvme_store_submit_read(nvme_store *s, const nvme_loc *loc, void *dst, size_t cap, uint64_t tag,
                           uint64_t *ticket, strata_error *err);

/* Reaps completed operations without blocking, issues waiting work, and copies up to max
 * finished requests into out (oldest first). Returns how many. */
size_t nvme_store_poll(nvme_store *s, nvme_completion *out, size_t max);

/* As poll, but blocks until at least one request has finished (returns 0 only when nothing is
 * pending at all). */
size_t nvme_store_wait(nvme_store *s, nvme_completion *out, size_t max);

/* Blocks until the request with this ticket has finished and returns its completion (other
 * requests finishing meanwhile stay queued for poll). STRATA_EINVAL for an unknown ticket. */
int nvme_store_wait_ticket(nvme_store *s, uint64_t ticket, nvme_completion *out);

/* Blocking conveniences: submit and wait. Return the request's status (message in err). */
int nvme_store_write(nvme_store *s, const void *src, size_t len, uint64_t tag, nvme_loc *loc,
                     strata_error *err);
int nvme_store_read(nvme_store *s, const nvme_loc *loc, void *dst, size_t cap, uint64_t tag,
                    strata_error *err);

/* Releases a block's extent. STRATA_EINVAL, changing nothing, unless loc is exactly a location a
 * write completed OK with and that was not freed since: a range inside a block or across two,
 * another length, a write still in flight (free it after its completion), a double free. */
int nvme_store_free(nvme_store *s, const nvme_loc *loc, strata_error *err);

/* Bytes of free space usable by blocks of block_bytes each: whole blocks per free extent
 * (page-rounded), so fragmentation shows; stats' free_bytes counts every free page. */
uint64_t nvme_store_fit_bytes(const nvme_store *s, size_t block_bytes);

/* Requests submitted and not yet returned by poll/wait. */
size_t nvme_store_pending(const nvme_store *s);

typedef struct nvme_store_stats {
    uint64_t blocks_stored, bytes_stored;   /* live blocks and their bytes */
    uint64_t capacity_bytes, free_bytes;    /* budget and free pages, in bytes */
    uint64_t writes, reads;                 /* requests completed OK */
    uint64_t zero_copy_reads;               /* of the reads, those straight into dst (no staging) */
    uint64_t bytes_written, bytes_read;     /* block bytes of those requests */
    uint64_t fsyncs;                        /* fdatasync operations completed */
    uint64_t readbacks;                     /* NVME_VERIFY_READBACK reads completed */
    double write_busy_s, read_busy_s;       /* time with >= 1 write (read) request in flight */
    double write_bytes_per_s, read_bytes_per_s;  /* bytes over busy time */
    uint64_t crc_failures;                  /* reads whose bytes failed kv_block_verify */
    uint64_t readback_mismatches;
    uint64_t short_transfers;               /* short counts resubmitted */
    uint64_t retried_transient;             /* EINTR/EAGAIN completions reissued */
    uint64_t err_nospace, err_io, err_other;  /* failed operations by errno: ENOSPC, EIO, rest */
    uint64_t requests_failed;
    bool io_uring, direct, registered;      /* the active path */
} nvme_store_stats;

void nvme_store_get_stats(const nvme_store *s, nvme_store_stats *out);

/* One line saying which path is active and why, e.g. "io_uring (registered buffers and files),
 * O_DIRECT, 4 slabs of 1024 MiB in /x" or "pread/pwrite (io_uring_queue_init: Operation not
 * permitted), buffered (O_DIRECT refused: Invalid argument), ...". */
const char *nvme_store_describe(const nvme_store *s);

#endif
