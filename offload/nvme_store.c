/* The NVMe tier (see nvme_store.h for the contract).
 *
 * Structure: a request (one block write or read) is cut into chunk operations of at most one
 * staging buffer each. Staging buffer i and chunk operation slot i are the same index, so an
 * operation in flight owns exactly its buffer. Two backends execute operations: io_uring
 * (prepared as SQEs, submitted in one io_uring_submit per pump, reaped with io_uring_peek_cqe)
 * and a synchronous one (pread/pwrite/fdatasync executed at issue, the result queued as a
 * synthetic completion). Everything above the backend (short-count resubmission, batched
 * fdatasync, read-back, verification, fault injection, error accounting) is shared, so the
 * fallback path behaves exactly like the main one. */
#include "offload/nvme_store.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <liburing.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kvstore/block.h"
#include "kvstore/bytes.h"
#include "kvstore/clock.h"
#include "offload/extent.h"

#define NONE UINT32_MAX
/* The user data of an SQE taken back after the ring failed (rewritten as a no-op): ignored. */
#define UD_DISCARD UINT64_MAX
/* The result given to an operation that a failed ring will never run. */
#define RING_FAILED_RES (-ECANCELED)

/* Per-page marks of a slab, one bitmap each: the first page of every allocation, its last page,
 * and (on the first page) whether its write completed OK. They make free and read exact: a
 * location must be one whole allocation whose write succeeded. */
enum { MARK_START, MARK_END, MARK_STORED, N_MARKS };

enum req_state {
    RQ_FREE = 0,
    RQ_IO,         /* chunks being transferred (write, read, or read-back) */
    RQ_SYNC_WAIT,  /* write data complete, waiting for an fdatasync of its slab */
    RQ_SYNCING,    /* covered by the fdatasync in flight */
    RQ_DONE,       /* in the done list, waiting for poll */
};

typedef struct req {
    uint64_t ticket, tag;
    nvme_op_kind kind;
    enum req_state state;
    bool readback;        /* a write in its read-back phase */
    bool in_pending;
    bool zero_copy;       /* a read straight into dst (page-aligned, room for the padded length) */
    const uint8_t *src;   /* write */
    uint8_t *dst;         /* read */
    nvme_loc loc;
    uint32_t padded;      /* bytes on disk: len rounded up to pages */
    uint32_t n_chunks, issued, done_chunks, inflight;
    int status;
    strata_error err;
    uint32_t next;        /* link in the pending, slab-wait, syncing or done list */
    uint32_t next_free;
} req;

typedef struct chunk_op {
    uint32_t req;
    uint32_t chunk;
    uint32_t len;         /* bytes of this chunk (whole pages) */
    uint32_t done;        /* transferred so far */
    uint32_t retries;
    bool busy;
} chunk_op;

typedef struct req_list {
    uint32_t head, tail;
} req_list;

typedef struct slab {
    int fd;
    uint64_t bytes;
    off_extents ext;
    uint32_t writes_io;   /* write requests to this slab in RQ_IO (issued or not) */
    uint32_t n_waiting;
    req_list waiting;     /* RQ_SYNC_WAIT */
    req_list syncing;     /* RQ_SYNCING: covered by the fdatasync in flight */
    bool sync_inflight;
    uint8_t sync_retries; /* EINTR/EAGAIN answers to the fdatasync in flight */
    uint64_t *marks;      /* N_MARKS bitmaps of mark_words words each */
    size_t mark_words;
    dev_t dev;            /* the file created, so that destroy deletes no other under its name */
    ino_t ino;
    char name[32];
} slab;

typedef struct sync_cqe {
    uint64_t ud;
    int res;
} sync_cqe;

struct nvme_store {
    nvme_store_options opt;
    char *dir;
    int dirfd;
    bool created_dir;
    slab *slabs;
    uint32_t n_slabs;
    uint64_t page_total;

    /* staging */
    uint8_t *staging;
    unsigned n_bufs;
    size_t buf_bytes;
    chunk_op *ops;
    uint32_t *free_bufs;
    unsigned n_free_bufs;

    /* backend */
    bool uring, direct, reg_bufs, reg_files;
    struct io_uring ring;
    pthread_t owner;        /* the creating thread: the only one whose submissions the ring takes */
    int ring_errno;         /* io_uring_enter failed for good: nothing more is submitted */
    bool ring_abandoned;    /* and completions cannot be waited for either (see ring_abandon) */
    char ring_why[160];
    unsigned to_submit;     /* SQEs prepared, not yet submitted */
    unsigned k_inflight;    /* operations in the kernel (or queued synthetic completions) */
    sync_cqe *scq;          /* synthetic completion queue of the sync backend */
    unsigned scq_head, scq_n, scq_cap;

    /* requests */
    req *reqs;
    uint32_t n_reqs, cap_reqs, free_req;  /* free_req: index + 1 */
    req_list pending, done;
    size_t n_pending_reqs;  /* submitted, not yet returned */
    uint64_t next_ticket;
    uint64_t fault_seq;

    /* stats */
    nvme_store_stats st;
    unsigned active_w, active_r;
    uint64_t t_w, t_r;
    char describe[512];
};

/* ---- lists (indices into s->reqs, linked by req.next) ---- */

static void list_push(nvme_store *s, req_list *l, uint32_t i)
{
    s->reqs[i].next = NONE;
    if (l->head == NONE)
        l->head = i;
    else
        s->reqs[l->tail].next = i;
    l->tail = i;
}

static uint32_t list_pop(nvme_store *s, req_list *l)
{
    uint32_t i = l->head;
    if (i != NONE) {
        l->head = s->reqs[i].next;
        if (l->head == NONE)
            l->tail = NONE;
    }
    return i;
}

static void list_remove(nvme_store *s, req_list *l, uint32_t i)
{
    uint32_t prev = NONE;
    for (uint32_t j = l->head; j != NONE; prev = j, j = s->reqs[j].next) {
        if (j != i)
            continue;
        if (prev == NONE)
            l->head = s->reqs[j].next;
        else
            s->reqs[prev].next = s->reqs[j].next;
        if (l->tail == j)
            l->tail = prev;
        return;
    }
}

/* ---- messages and accounting ---- */

static void active_change(nvme_store *s, nvme_op_kind kind, int delta)
{
    unsigned *n = kind == NVME_OP_WRITE ? &s->active_w : &s->active_r;
    uint64_t *t = kind == NVME_OP_WRITE ? &s->t_w : &s->t_r;
    double *busy = kind == NVME_OP_WRITE ? &s->st.write_busy_s : &s->st.read_busy_s;
    if (delta > 0 && (*n)++ == 0)
        *t = strata_mono_ns();
    if (delta < 0 && --(*n) == 0)
        *busy += (double)(strata_mono_ns() - *t) * 1e-9;
}

static const char *kind_name(nvme_op_kind k, bool readback)
{
    return k == NVME_OP_WRITE ? (readback ? "read-back" : "write") : k == NVME_OP_READ ? "read" : "fdatasync";
}

/* Fails a request (first error wins) with "<what> of <len> bytes at <slab> offset <off>: ...". The
 * tag is the caller's and means nothing to a reader of the message, so it is left out. */
static void req_fail(nvme_store *s, req *r, int code, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void req_fail(nvme_store *s, req *r, int code, const char *fmt, ...)
{
    if (r->status != STRATA_OK)
        return;
    char what[384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    r->status = code;
    strata_fail(&r->err, code, "nvme tier: %s of %" PRIu32 " bytes at %s/%s offset %" PRIu64 ": %s",
                kind_name(r->kind, r->readback), r->loc.len, s->dir, s->slabs[r->loc.slab].name, r->loc.offset, what);
}

/* Maps a failed operation's errno to a status and counts it. */
static int errno_status(nvme_store *s, int e)
{
    if (e == ENOSPC || e == EDQUOT) {
        s->st.err_nospace++;
        return STRATA_EFULL;
    }
    if (e == EIO)
        s->st.err_io++;
    else
        s->st.err_other++;
    return STRATA_EIO;
}

/* ---- allocations ---- */

static bool mark_get(const slab *sl, int which, uint64_t page)
{
    return (sl->marks[(size_t)which * sl->mark_words + page / 64] >> (page % 64)) & 1u;
}

static void mark_put(slab *sl, int which, uint64_t page, bool on)
{
    uint64_t *w = &sl->marks[(size_t)which * sl->mark_words + page / 64];
    *w = on ? *w | (1ull << (page % 64)) : *w & ~(1ull << (page % 64));
}

/* Whether pages [start, start + pages) are exactly one allocation (written or being written):
 * allocations never overlap, so a start mark at start, an end mark at its last page and no start
 * mark in between can only be one allocation's. */
static bool is_allocation(const slab *sl, uint64_t start, uint64_t pages)
{
    const uint64_t total = sl->bytes / NVME_PAGE;
    if (pages == 0 || start >= total || pages > total - start)
        return false;
    if (!mark_get(sl, MARK_START, start) || !mark_get(sl, MARK_END, start + pages - 1))
        return false;
    for (uint64_t p = start + 1; p < start + pages; p++)
        if (mark_get(sl, MARK_START, p))
            return false;
    return true;
}

/* Whether loc names a block whose write completed OK and that was not freed since. */
static bool is_stored(const nvme_store *s, const nvme_loc *loc)
{
    if (loc->slab >= s->n_slabs || loc->len == 0 || loc->offset % NVME_PAGE != 0)
        return false;
    const slab *sl = &s->slabs[loc->slab];
    const uint64_t start = loc->offset / NVME_PAGE;
    return is_allocation(sl, start, ((uint64_t)loc->len + NVME_PAGE - 1) / NVME_PAGE) &&
           mark_get(sl, MARK_STORED, start);
}

static void extent_taken(slab *sl, uint64_t start, uint64_t pages)
{
    mark_put(sl, MARK_START, start, true);
    mark_put(sl, MARK_END, start + pages - 1, true);
}

static void extent_release(slab *sl, uint64_t start, uint64_t pages)
{
    mark_put(sl, MARK_START, start, false);
    mark_put(sl, MARK_END, start + pages - 1, false);
    mark_put(sl, MARK_STORED, start, false);
    off_extents_free(&sl->ext, start, pages);
}

/* Whether the calling thread may use the store. With IORING_SETUP_SINGLE_ISSUER the kernel
 * refuses submissions from any other thread (EEXIST); the same rule holds for every path. */
static bool foreign_thread(const nvme_store *s)
{
    return !pthread_equal(pthread_self(), s->owner);
}

#define FOREIGN_THREAD_MSG "used from a thread other than the one that created it (a store belongs to one thread)"

/* What went wrong with an operation that completed with res < 0. */
static const char *op_error_text(const nvme_store *s, int res)
{
    if (res == RING_FAILED_RES && s->ring_errno)
        return s->ring_why;
    return strerror(-res);
}

/* ---- the request lifecycle ---- */

static void finish(nvme_store *s, uint32_t i)
{
    req *r = &s->reqs[i];
    if (r->in_pending) {
        list_remove(s, &s->pending, i);
        r->in_pending = false;
    }
    if (r->kind == NVME_OP_WRITE) {
        if (r->status == STRATA_OK) {
            mark_put(&s->slabs[r->loc.slab], MARK_STORED, r->loc.offset / NVME_PAGE, true);
            s->st.writes++;
            s->st.bytes_written += r->loc.len;
            s->st.blocks_stored++;
            s->st.bytes_stored += r->loc.len;
        } else {
            /* The extent holds nothing valid: give it back. */
            extent_release(&s->slabs[r->loc.slab], r->loc.offset / NVME_PAGE, r->padded / NVME_PAGE);
        }
    } else if (r->status == STRATA_OK) {
        s->st.reads++;
        s->st.zero_copy_reads += r->zero_copy;
        s->st.bytes_read += r->loc.len;
    }
    if (r->status != STRATA_OK)
        s->st.requests_failed++;
    active_change(s, r->kind, -1);
    r->state = RQ_DONE;
    list_push(s, &s->done, i);
}

static void start_chunks(nvme_store *s, uint32_t i)
{
    req *r = &s->reqs[i];
    r->state = RQ_IO;
    r->issued = r->done_chunks = r->inflight = 0;
    r->in_pending = true;
    list_push(s, &s->pending, i);
}

/* A request's transfer phase has no chunk left in flight and either failed or finished. */
static void io_phase_end(nvme_store *s, uint32_t i)
{
    req *r = &s->reqs[i];
    slab *sl = &s->slabs[r->loc.slab];
    if (r->kind == NVME_OP_READ) {
        if (r->status == STRATA_OK) {
            strata_error e = {0};
            kv_block b;
            int rc = kv_block_verify(r->dst, r->loc.len, &b, &e);
            if (rc == STRATA_OK && b.block_bytes != r->loc.len) {
                rc = STRATA_EFORMAT;
                snprintf(e.msg, sizeof e.msg, "block_bytes %" PRIu32 " differs from the stored length",
                         b.block_bytes);
            }
            if (rc != STRATA_OK) {   /* bytes that were verified when written: damaged on disk since */
                s->st.crc_failures++;
                req_fail(s, r, STRATA_ECRC, "restored bytes fail verification: %s", e.msg);
            }
        }
        finish(s, i);
        return;
    }
    if (r->readback) {
        if (r->status == STRATA_OK)
            s->st.readbacks++;
        finish(s, i);
        return;
    }
    sl->writes_io--;
    if (r->status != STRATA_OK) {
        finish(s, i);
        return;
    }
    r->state = RQ_SYNC_WAIT;
    sl->n_waiting++;
    list_push(s, &sl->waiting, i);
}

static void release_buf(nvme_store *s, uint32_t b)
{
    s->ops[b].busy = false;
    s->free_bufs[s->n_free_bufs++] = b;
}

static bool backend_issue(nvme_store *s, uint64_t ud, nvme_op_kind kind, uint32_t slab_idx, uint8_t *buf,
                          uint32_t len, uint64_t off, int buf_idx);

static void issue_op(nvme_store *s, uint32_t b)
{
    chunk_op *op = &s->ops[b];
    req *r = &s->reqs[op->req];
    nvme_op_kind k = (r->kind == NVME_OP_WRITE && !r->readback) ? NVME_OP_WRITE : NVME_OP_READ;
    uint64_t off = r->loc.offset + (uint64_t)op->chunk * s->buf_bytes + op->done;
    if (r->zero_copy)  /* not a registered buffer: buf_idx -1 */
        backend_issue(s, b, k, r->loc.slab, r->dst + (size_t)op->chunk * s->buf_bytes + op->done,
                      op->len - op->done, off, -1);
    else
        backend_issue(s, b, k, r->loc.slab, s->staging + (size_t)b * s->buf_bytes + op->done, op->len - op->done,
                      off, (int)b);
}

/* Issues chunks of pending requests while staging buffers are free. Returns whether any was. */
static bool issue_chunks(nvme_store *s)
{
    bool any = false;
    while (s->n_free_bufs > 0 && s->pending.head != NONE) {
        uint32_t i = s->pending.head;
        req *r = &s->reqs[i];
        if (r->status != STRATA_OK || r->issued == r->n_chunks) {
            list_pop(s, &s->pending);
            r->in_pending = false;
            continue;
        }
        uint32_t b = s->free_bufs[--s->n_free_bufs];
        chunk_op *op = &s->ops[b];
        uint32_t c = r->issued++;
        uint64_t start = (uint64_t)c * s->buf_bytes;
        *op = (chunk_op){.req = i, .chunk = c, .busy = true};
        op->len = (uint32_t)((r->padded - start) < s->buf_bytes ? r->padded - start : s->buf_bytes);
        if (r->kind == NVME_OP_WRITE && !r->readback) {
            /* Stage the block's bytes; the slack of the last page is zeros. */
            uint8_t *buf = s->staging + (size_t)b * s->buf_bytes;
            uint64_t have = r->loc.len > start ? r->loc.len - start : 0;
            if (have > op->len)
                have = op->len;
            memcpy(buf, r->src + start, have);
            memset(buf + have, 0, op->len - have);
        }
        r->inflight++;
        /* Leave the pending list before the last chunk can complete: the link is reused by
         * the next list the request joins. */
        if (r->issued == r->n_chunks) {
            list_pop(s, &s->pending);
            r->in_pending = false;
        }
        issue_op(s, b);
        any = true;
    }
    return any;
}

/* Issues an fdatasync for every slab whose waiting writes are due (see nvme_store.h). */
static bool issue_syncs(nvme_store *s, bool force)
{
    bool any = false;
    for (uint32_t k = 0; k < s->n_slabs; k++) {
        slab *sl = &s->slabs[k];
        if (sl->sync_inflight || sl->n_waiting == 0)
            continue;
        if (!force && sl->writes_io > 0 && sl->n_waiting < s->opt.sync_batch)
            continue;
        /* Every write now waiting completed before this fdatasync is issued: it covers them. */
        for (uint32_t i = list_pop(s, &sl->waiting); i != NONE; i = list_pop(s, &sl->waiting)) {
            s->reqs[i].state = RQ_SYNCING;
            list_push(s, &sl->syncing, i);
        }
        sl->n_waiting = 0;
        sl->sync_inflight = true;
        sl->sync_retries = 0;
        backend_issue(s, (uint64_t)s->n_bufs + k, NVME_OP_FSYNC, k, NULL, 0, 0, 0);
        any = true;
    }
    return any;
}

static int fault(nvme_store *s, nvme_op_kind kind, const req *r, uint32_t slab_idx, uint64_t off, uint32_t len,
                 uint8_t *data, int res)
{
    if (!s->opt.fault)
        return res;
    nvme_fault_op f = {
        .kind = kind, .seq = ++s->fault_seq, .tag = r ? r->tag : 0, .slab = slab_idx, .offset = off,
        .len = len, .readback = r ? r->readback : false, .data = kind == NVME_OP_READ ? data : NULL,
    };
    return s->opt.fault(s->opt.fault_ctx, &f, res);
}

static void complete_sync(nvme_store *s, uint32_t k, int res)
{
    slab *sl = &s->slabs[k];
    res = fault(s, NVME_OP_FSYNC, NULL, k, 0, 0, NULL, res);
    if ((res == -EINTR || res == -EAGAIN) && ++sl->sync_retries <= NVME_MAX_RETRIES) {
        /* Interrupted or refused for now: the writes it covers are not durable yet, and
         * nothing says they are lost. Ask again; the same requests stay in `syncing`. */
        s->st.retried_transient++;
        backend_issue(s, (uint64_t)s->n_bufs + k, NVME_OP_FSYNC, k, NULL, 0, 0, 0);
        return;
    }
    sl->sync_inflight = false;
    int code = STRATA_OK;
    if (res < 0)
        code = errno_status(s, -res);
    else
        s->st.fsyncs++;
    if (code != STRATA_OK) {
        /* Writes whose data completed while this fdatasync ran may have been written back by
         * it and lost with its error; the kernel reports that error once, so the next fdatasync
         * would call them durable. They fail with the batch. */
        for (uint32_t i = list_pop(s, &sl->waiting); i != NONE; i = list_pop(s, &sl->waiting))
            list_push(s, &sl->syncing, i);
        sl->n_waiting = 0;
    }
    for (uint32_t i = list_pop(s, &sl->syncing); i != NONE; i = list_pop(s, &sl->syncing)) {
        req *r = &s->reqs[i];
        if (code != STRATA_OK) {
            req_fail(s, r, code, "fdatasync failed, the write is not durable: %s", op_error_text(s, res));
            finish(s, i);
        } else if (s->opt.verify == NVME_VERIFY_READBACK) {
            r->readback = true;
            start_chunks(s, i);
        } else {
            finish(s, i);
        }
    }
}

/* The system call that moved a chunk, as the messages name it. */
static const char *io_name(const nvme_store *s, bool writing)
{
    if (s->uring)
        return writing ? "io_uring write" : "io_uring read";
    return writing ? "pwrite" : "pread";
}

static void complete_chunk(nvme_store *s, uint32_t b, int res)
{
    chunk_op *op = &s->ops[b];
    uint32_t i = op->req;
    req *r = &s->reqs[i];
    bool writing = r->kind == NVME_OP_WRITE && !r->readback;
    uint64_t off = r->loc.offset + (uint64_t)op->chunk * s->buf_bytes + op->done;
    uint32_t want = op->len - op->done;
    uint8_t *at = writing       ? NULL
                  : r->zero_copy ? r->dst + (size_t)op->chunk * s->buf_bytes + op->done
                                 : s->staging + (size_t)b * s->buf_bytes + op->done;
    res = fault(s, writing ? NVME_OP_WRITE : NVME_OP_READ, r, r->loc.slab, off, want, at, res);
    bool chunk_done = false;
    if ((res == -EINTR || res == -EAGAIN) && ++op->retries <= NVME_MAX_RETRIES) {
        /* Interrupted or refused for now (a signal, a full device queue): nothing was moved,
         * issue the same transfer again. */
        s->st.retried_transient++;
        issue_op(s, b);
        return;
    } else if (res < 0) {
        req_fail(s, r, errno_status(s, -res), "%s at offset %" PRIu64 " (%" PRIu32 " bytes) failed: %s",
                 io_name(s, writing), off, want, op_error_text(s, res));
    } else if (res == 0 || (uint32_t)res > want) {
        s->st.err_io++;
        req_fail(s, r, STRATA_EIO, "%s at offset %" PRIu64 " returned %d of %" PRIu32 " bytes%s",
                 io_name(s, writing), off, res, want,
                 res == 0 ? (writing ? " (no progress)" : " (end of file)") : "");
    } else if ((uint32_t)res < want) {
        s->st.short_transfers++;
        const uint32_t before = op->done;
        op->done += (uint32_t)res;
        /* O_DIRECT needs page-aligned offsets: redo the partial page (rewriting or rereading a
         * few bytes is harmless). */
        if (s->direct)
            op->done &= ~(NVME_PAGE - 1);
        /* A file system may move a large transfer in many small pieces: only resubmissions that
         * moved nothing count towards the limit. */
        if (op->done > before)
            op->retries = 0;
        if (op->done == before && ++op->retries > NVME_MAX_RETRIES) {
            s->st.err_io++;
            req_fail(s, r, STRATA_EIO, "still short after %d resubmissions that moved nothing (last: %d of %" PRIu32
                     " bytes at offset %" PRIu64 ")", NVME_MAX_RETRIES, res, want, off);
        } else {
            issue_op(s, b);
            return;  /* the buffer stays with the operation */
        }
    } else {
        chunk_done = true;
    }
    if (chunk_done && r->status == STRATA_OK && !writing) {
        const uint8_t *buf = s->staging + (size_t)b * s->buf_bytes;
        uint64_t start = (uint64_t)op->chunk * s->buf_bytes;
        uint64_t have = r->loc.len > start ? r->loc.len - start : 0;
        if (have > op->len)
            have = op->len;
        if (r->kind == NVME_OP_READ) {
            if (!r->zero_copy)
                memcpy(r->dst + start, buf, have);
        } else {
            /* Read-back: the bytes must equal what was written, slack included. */
            size_t bad = SIZE_MAX;
            if (memcmp(buf, r->src + start, have) != 0) {
                for (size_t j = 0; j < have; j++)
                    if (buf[j] != r->src[start + j]) {
                        bad = start + j;
                        break;
                    }
            } else {
                for (size_t j = have; j < op->len; j++)
                    if (buf[j] != 0) {
                        bad = start + j;
                        break;
                    }
            }
            if (bad != SIZE_MAX) {
                s->st.readback_mismatches++;
                req_fail(s, r, STRATA_ECRC, "read-back differs from the bytes written, first at byte %zu", bad);
            }
        }
    }
    r->done_chunks += chunk_done;
    r->inflight--;
    release_buf(s, b);
    if (r->inflight == 0 && (r->status != STRATA_OK || r->done_chunks == r->n_chunks))
        io_phase_end(s, i);
}

static void dispatch(nvme_store *s, uint64_t ud, int res)
{
    s->k_inflight--;
    if (ud < s->n_bufs)
        complete_chunk(s, (uint32_t)ud, res);
    else
        complete_sync(s, (uint32_t)(ud - s->n_bufs), res);
}

/* ---- backends ---- */

/* Queues a completion that no kernel produced: the sync backend's results, and operations the
 * ring could not take. The queue has room for every operation that can be outstanding. */
static void scq_push(nvme_store *s, uint64_t ud, int res)
{
    s->scq[(s->scq_head + s->scq_n++) % s->scq_cap] = (sync_cqe){ud, res};
}

/* io_uring_enter answers these when it may work if asked again later. */
static bool enter_error_transient(int e)
{
    return e == EAGAIN || e == EBUSY || e == EINTR;
}

/* io_uring_enter failed for good (or refused for the whole retry budget): the operations
 * prepared but not taken by the kernel are taken back (rewritten as no-ops that are ignored if
 * they ever run) and fail, as does everything issued from now on; what the kernel already took
 * still completes normally. New requests are refused. */
static void ring_fail(nvme_store *s, int e)
{
    if (s->ring_errno)
        return;
    s->ring_errno = e;
    snprintf(s->ring_why, sizeof s->ring_why, "io_uring_enter failed (%s); the store's ring is unusable",
             strerror(e));
    struct io_uring_sq *sq = &s->ring.sq;
    for (unsigned j = io_uring_smp_load_acquire(sq->khead); j != sq->sqe_tail; j++) {
        struct io_uring_sqe *sqe = &sq->sqes[sq->array[j & sq->ring_mask]];
        const uint64_t ud = sqe->user_data;
        io_uring_prep_nop(sqe);
        io_uring_sqe_set_data64(sqe, UD_DISCARD);
        scq_push(s, ud, RING_FAILED_RES);
    }
    s->to_submit = 0;
}

/* Completions cannot even be waited for: every operation the kernel still holds fails too, and
 * the ring is no longer read (a late completion would count twice). The kernel may still write
 * into the staging buffers, so destroy leaves them allocated. */
static void ring_abandon(nvme_store *s, int e)
{
    ring_fail(s, e);
    if (s->ring_abandoned)
        return;
    s->ring_abandoned = true;
    /* Every operation in flight (a chunk's buffer, a slab's fdatasync) whose completion is not
     * queued already is one the kernel holds. */
    unsigned kernel = s->k_inflight - s->scq_n;
    for (uint64_t ud = 0; ud < (uint64_t)s->n_bufs + s->n_slabs && kernel > 0; ud++) {
        const bool inflight = ud < s->n_bufs ? s->ops[ud].busy : s->slabs[ud - s->n_bufs].sync_inflight;
        bool queued = false;
        for (unsigned q = 0; q < s->scq_n && !queued; q++)
            queued = s->scq[(s->scq_head + q) % s->scq_cap].ud == ud;
        if (inflight && !queued) {
            scq_push(s, ud, RING_FAILED_RES);
            kernel--;
        }
    }
}

static bool backend_issue(nvme_store *s, uint64_t ud, nvme_op_kind kind, uint32_t slab_idx, uint8_t *buf,
                          uint32_t len, uint64_t off, int buf_idx)
{
    int fd = s->slabs[slab_idx].fd;
    s->k_inflight++;
    if (!s->uring) {
        ssize_t n;
        do {   /* a signal before any byte moved (files on FUSE or NFS can be interrupted) */
            if (kind == NVME_OP_WRITE)
                n = pwrite(fd, buf, len, (off_t)off);
            else if (kind == NVME_OP_READ)
                n = pread(fd, buf, len, (off_t)off);
            else
                n = fdatasync(fd);
        } while (n < 0 && errno == EINTR);
        scq_push(s, ud, n < 0 ? -errno : (int)n);
        return true;
    }
    if (s->ring_errno) {
        scq_push(s, ud, RING_FAILED_RES);
        return false;
    }
    struct io_uring_sqe *sqe = io_uring_get_sqe(&s->ring);
    if (!sqe) {
        /* The ring has room for every possible operation, so this only means the prepared SQEs
         * were not submitted yet: submit them and try again. */
        int rc = io_uring_submit(&s->ring);
        if (rc < 0 && !enter_error_transient(-rc)) {
            ring_fail(s, -rc);
            scq_push(s, ud, RING_FAILED_RES);
            return false;
        }
        s->to_submit = io_uring_sq_ready(&s->ring);
        sqe = io_uring_get_sqe(&s->ring);
    }
    if (!sqe) {   /* a synthetic completion: dispatch counts it out of k_inflight like any other */
        scq_push(s, ud, -EBUSY);
        return false;
    }
    int target = s->reg_files ? (int)slab_idx : fd;
    if (kind == NVME_OP_WRITE) {
        if (s->reg_bufs && buf_idx >= 0)
            io_uring_prep_write_fixed(sqe, target, buf, len, off, buf_idx);
        else
            io_uring_prep_write(sqe, target, buf, len, off);
    } else if (kind == NVME_OP_READ) {
        if (s->reg_bufs && buf_idx >= 0)
            io_uring_prep_read_fixed(sqe, target, buf, len, off, buf_idx);
        else
            io_uring_prep_read(sqe, target, buf, len, off);
    } else {
        io_uring_prep_fsync(sqe, target, IORING_FSYNC_DATASYNC);
    }
    if (s->reg_files)
        sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data64(sqe, ud);
    s->to_submit++;
    return true;
}

static void flush_submit(nvme_store *s)
{
    if (s->uring && s->to_submit > 0) {
        int rc = io_uring_submit(&s->ring);
        /* On a transient failure, or when the kernel took fewer than offered (short of memory),
         * the rest stay in the ring and go with the next submit. */
        if (rc >= 0)
            s->to_submit = io_uring_sq_ready(&s->ring);
        else if (!enter_error_transient(-rc))
            ring_fail(s, -rc);
    }
}

/* Handles every completion available now; returns how many. */
static unsigned reap(nvme_store *s)
{
    unsigned n = 0;
    /* Synthetic completions: of the sync backend, or of an SQE that could not be had. */
    while (s->scq_n > 0) {
        sync_cqe c = s->scq[s->scq_head];
        s->scq_head = (s->scq_head + 1) % s->scq_cap;
        s->scq_n--;
        dispatch(s, c.ud, c.res);
        n++;
    }
    if (s->uring && !s->ring_abandoned) {
        struct io_uring_cqe *cqe;
        while (io_uring_peek_cqe(&s->ring, &cqe) == 0 && cqe) {
            uint64_t ud = io_uring_cqe_get_data64(cqe);
            int res = cqe->res;
            io_uring_cqe_seen(&s->ring, cqe);
            if (ud == UD_DISCARD)
                continue;
            dispatch(s, ud, res);
            n++;
        }
    }
    return n;
}

/* Moves everything forward as far as possible without blocking: handles what has completed,
 * issues what can be issued, and repeats while anything changed; then submits everything
 * prepared with one io_uring_submit (and goes round again if completions arrived meanwhile). */
static void pump(nvme_store *s)
{
    bool progress;
    do {
        progress = reap(s) > 0;
        progress |= issue_chunks(s);
        /* Sync backend: finish all transfers first, so that one fdatasync covers them. */
        if (!s->uring && s->scq_n > 0)
            continue;
        progress |= issue_syncs(s, false);
        if (!progress && s->uring && s->to_submit > 0) {
            flush_submit(s);
            progress = io_uring_cq_ready(&s->ring) > 0;
        }
    } while (progress);
}

/* Blocks until at least one completion arrived (or nothing is outstanding). Requests a failed
 * submit left in the ring are submitted here first: waiting alone would never end when they are
 * all that is in flight. A transient refusal (EAGAIN: the kernel is short of memory; EBUSY: the
 * completion queue is full) is retried every millisecond, unless completions are there to reap;
 * a signal is simply retried. A permanent error, or refusals for 10 s, fail the ring
 * (ring_fail: what it was not given fails; a wait that keeps failing: ring_abandon). */
static void block_once(nvme_store *s)
{
    if (s->k_inflight == 0 || !s->uring || s->scq_n > 0 || s->ring_abandoned)
        return;
    struct io_uring_cqe *cqe;
    int rc = 0;
    for (int slept = 0; slept < 10000;) {
        if (s->to_submit > 0) {
            rc = io_uring_submit_and_wait(&s->ring, 1);
            if (rc >= 0) {
                /* The kernel may take fewer than offered, and then does not wait: what is left
                 * goes with the next call; none taken counts as a refusal. */
                s->to_submit = io_uring_sq_ready(&s->ring);
                if (rc > 0 || s->to_submit == 0)
                    return;
                rc = -EAGAIN;
            } else if (!enter_error_transient(-rc)) {
                ring_fail(s, -rc);
                return;
            }
        } else {
            rc = io_uring_wait_cqe(&s->ring, &cqe);
            if (rc == 0)
                return;
        }
        if (rc == -EINTR)
            continue;
        if (io_uring_cq_ready(&s->ring) > 0)
            return;
        const struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
        slept++;
    }
    if (s->to_submit > 0)
        ring_fail(s, -rc);
    else
        ring_abandon(s, -rc);
}

/* ---- public API ---- */

void nvme_store_options_init(nvme_store_options *o, const char *dir, uint64_t budget_bytes)
{
    memset(o, 0, sizeof *o);
    o->dir = dir;
    o->budget_bytes = budget_bytes;
}

static int new_req(nvme_store *s, uint32_t *out, strata_error *err)
{
    if (!s->free_req) {
        if (s->n_reqs == s->cap_reqs) {
            uint32_t cap = s->cap_reqs ? s->cap_reqs * 2 : 64;
            req *v = realloc(s->reqs, (size_t)cap * sizeof *v);
            if (!v)
                return strata_fail(err, STRATA_ENOMEM, "nvme tier: out of memory for requests");
            s->reqs = v;
            s->cap_reqs = cap;
        }
        s->reqs[s->n_reqs].next_free = 0;
        s->n_reqs++;
        s->free_req = s->n_reqs;
    }
    uint32_t i = s->free_req - 1;
    s->free_req = s->reqs[i].next_free;
    memset(&s->reqs[i], 0, sizeof s->reqs[i]);
    s->reqs[i].ticket = ++s->next_ticket;
    s->reqs[i].next = NONE;
    *out = i;
    return STRATA_OK;
}

static void free_req(nvme_store *s, uint32_t i)
{
    s->reqs[i].state = RQ_FREE;
    s->reqs[i].next_free = s->free_req;
    s->free_req = i + 1;
}

int nvme_store_submit_write(nvme_store *s, const void *src, size_t len, uint64_t tag, uint64_t *ticket,
                            nvme_loc *loc, strata_error *err)
{
    if (!s || !src || !ticket)
        return strata_fail(err, STRATA_EINVAL, "nvme tier: write of block %" PRIu64 ": NULL argument", tag);
    if (foreign_thread(s))
        return strata_fail(err, STRATA_EINVAL, "nvme tier: write of block %" PRIu64 ": " FOREIGN_THREAD_MSG, tag);
    if (s->ring_errno)
        return strata_fail(err, STRATA_EIO, "nvme tier: write of block %" PRIu64 " refused: %s", tag, s->ring_why);
    if (len > UINT32_MAX - (NVME_PAGE - 1))
        return strata_fail(err, STRATA_EINVAL, "nvme tier: write of block %" PRIu64 ": %zu bytes, more than a "
                           "location holds", tag, len);
    kv_block b;
    int rc = kv_block_verify(src, len, &b, err);
    if (rc != STRATA_OK)
        return strata_error_prefix(err, "nvme tier: refusing to write block %" PRIu64 " (%zu bytes)", tag, len);
    if (b.block_bytes != len)
        return strata_fail(err, STRATA_EFORMAT,
                           "nvme tier: refusing to write block %" PRIu64 ": length %zu but block_bytes %" PRIu32,
                           tag, len, b.block_bytes);
    uint64_t pages = (len + NVME_PAGE - 1) / NVME_PAGE;
    uint32_t i;
    if ((rc = new_req(s, &i, err)) != STRATA_OK)
        return rc;
    uint64_t start = 0;
    uint32_t k;
    rc = STRATA_EFULL;
    for (k = 0; k < s->n_slabs; k++) {
        rc = off_extents_alloc(&s->slabs[k].ext, pages, &start);
        if (rc != STRATA_EFULL)
            break;
    }
    if (rc != STRATA_OK) {
        free_req(s, i);
        if (rc == STRATA_ENOMEM)
            return strata_fail(err, rc, "nvme tier: out of memory for the free list");
        uint64_t free_units = 0, largest = 0;
        for (k = 0; k < s->n_slabs; k++) {
            free_units += s->slabs[k].ext.free_units;
            uint64_t l = off_extents_largest(&s->slabs[k].ext);
            largest = l > largest ? l : largest;
        }
        return strata_fail(err, STRATA_EFULL,
                           "nvme tier full: no free extent of %" PRIu64 " KiB in %s (%" PRIu64 " KiB free of %" PRIu64
                           " KiB budget, largest hole %" PRIu64 " KiB)",
                           pages * 4, s->dir, free_units * 4, s->page_total * 4, largest * 4);
    }
    extent_taken(&s->slabs[k], start, pages);
    req *r = &s->reqs[i];
    r->tag = tag;
    r->kind = NVME_OP_WRITE;
    r->src = src;
    r->loc = (nvme_loc){.slab = k, .len = (uint32_t)len, .offset = start * NVME_PAGE};
    r->padded = (uint32_t)(pages * NVME_PAGE);
    r->n_chunks = (uint32_t)((r->padded + s->buf_bytes - 1) / s->buf_bytes);
    s->slabs[k].writes_io++;
    s->n_pending_reqs++;
    active_change(s, NVME_OP_WRITE, +1);
    start_chunks(s, i);
    *ticket = r->ticket;
    if (loc)
        *loc = r->loc;
    /* io_uring: start the transfer now. The sync backend does its work in poll/wait, so that
     * a burst of submits shares one fdatasync. */
    if (s->uring)
        pump(s);
    return STRATA_OK;
}

int nvme_store_submit_read(nvme_store *s, const nvme_loc *loc, void *dst, size_t cap, uint64_t tag,
                           uint64_t *ticket, strata_error *err)
{
    if (!s || !loc || !dst || !ticket)
        return strata_fail(err, STRATA_EINVAL, "nvme tier: read of block %" PRIu64 ": NULL argument", tag);
    if (foreign_thread(s))
        return strata_fail(err, STRATA_EINVAL, "nvme tier: read of block %" PRIu64 ": " FOREIGN_THREAD_MSG, tag);
    if (s->ring_errno)
        return strata_fail(err, STRATA_EIO, "nvme tier: read of block %" PRIu64 " refused: %s", tag, s->ring_why);
    if (!is_stored(s, loc))
        return strata_fail(err, STRATA_EINVAL,
                           "nvme tier: read of block %" PRIu64 ": slab %" PRIu32 " offset %" PRIu64 " length %" PRIu32
                           " holds no stored block (never written, still being written, or freed)", tag, loc->slab,
                           loc->offset, loc->len);
    if (cap < loc->len)
        return strata_fail(err, STRATA_EINVAL,
                           "nvme tier: read of block %" PRIu64 ": destination of %zu bytes for a %" PRIu32 "-byte block",
                           tag, cap, loc->len);
    uint32_t i;
    int rc = new_req(s, &i, err);
    if (rc != STRATA_OK)
        return rc;
    req *r = &s->reqs[i];
    r->tag = tag;
    r->kind = NVME_OP_READ;
    r->dst = dst;
    r->loc = *loc;
    r->padded = (uint32_t)(((uint64_t)loc->len + NVME_PAGE - 1) / NVME_PAGE * NVME_PAGE);
    r->n_chunks = (uint32_t)((r->padded + s->buf_bytes - 1) / s->buf_bytes);
    /* A page-aligned destination with room for the padded extent (a host arena extent is one)
     * takes the data directly: no staging copy, which is what bounds restore speed otherwise. */
    r->zero_copy = (uintptr_t)dst % NVME_PAGE == 0 && cap >= r->padded;
    s->n_pending_reqs++;
    active_change(s, NVME_OP_READ, +1);
    start_chunks(s, i);
    *ticket = r->ticket;
    if (s->uring)
        pump(s);
    return STRATA_OK;
}

static size_t take_done(nvme_store *s, nvme_completion *out, size_t max)
{
    size_t n = 0;
    while (n < max && s->done.head != NONE) {
        uint32_t i = list_pop(s, &s->done);
        req *r = &s->reqs[i];
        out[n] = (nvme_completion){.ticket = r->ticket, .tag = r->tag, .kind = r->kind, .status = r->status,
                                   .loc = r->loc, .err = r->err};
        if (r->status == STRATA_OK)
            out[n].err = (strata_error){0};
        free_req(s, i);
        s->n_pending_reqs--;
        n++;
    }
    return n;
}

size_t nvme_store_poll(nvme_store *s, nvme_completion *out, size_t max)
{
    if (foreign_thread(s))
        return 0;
    pump(s);
    return take_done(s, out, max);
}

/* One blocking step: pumps, and if nothing finished, waits for the backend's next completion.
 * Returns false when nothing is outstanding that could ever finish. */
static bool step(nvme_store *s)
{
    pump(s);
    if (s->done.head != NONE)
        return true;
    if (s->k_inflight == 0) {
        /* Nothing in flight but requests may wait: flush any fdatasync held back for batching
         * (cannot be needed by construction; this only guarantees that a wait never hangs). */
        if (!issue_syncs(s, true))
            return false;
        flush_submit(s);
        pump(s);
        return true;
    }
    block_once(s);
    pump(s);
    return true;
}

size_t nvme_store_wait(nvme_store *s, nvme_completion *out, size_t max)
{
    if (max == 0 || foreign_thread(s))
        return 0;
    pump(s);
    while (s->done.head == NONE && s->n_pending_reqs > 0)
        if (!step(s))
            break;
    return take_done(s, out, max);
}

int nvme_store_wait_ticket(nvme_store *s, uint64_t ticket, nvme_completion *out)
{
    if (foreign_thread(s)) {
        memset(out, 0, sizeof *out);
        return strata_fail(&out->err, STRATA_EINVAL, "nvme tier: wait: " FOREIGN_THREAD_MSG);
    }
    for (;;) {
        for (uint32_t i = s->done.head; i != NONE; i = s->reqs[i].next) {
            if (s->reqs[i].ticket != ticket)
                continue;
            /* Move it to the front of the done list and take it. */
            list_remove(s, &s->done, i);
            s->reqs[i].next = s->done.head;
            s->done.head = i;
            if (s->done.tail == NONE)
                s->done.tail = i;
            take_done(s, out, 1);
            return out->status;
        }
        bool known = false;
        for (uint32_t i = 0; i < s->n_reqs && !known; i++)
            known = s->reqs[i].state != RQ_FREE && s->reqs[i].ticket == ticket;
        if (!known) {
            memset(out, 0, sizeof *out);
            return strata_fail(&out->err, STRATA_EINVAL, "nvme tier: unknown ticket %" PRIu64, ticket);
        }
        if (!step(s)) {
            memset(out, 0, sizeof *out);
            return strata_fail(&out->err, STRATA_EIO, "nvme tier: ticket %" PRIu64 " cannot progress", ticket);
        }
    }
}

int nvme_store_write(nvme_store *s, const void *src, size_t len, uint64_t tag, nvme_loc *loc, strata_error *err)
{
    uint64_t t = 0;
    int rc = nvme_store_submit_write(s, src, len, tag, &t, loc, err);
    if (rc != STRATA_OK)
        return rc;
    nvme_completion c;
    rc = nvme_store_wait_ticket(s, t, &c);
    if (rc != STRATA_OK && err)
        *err = c.err;
    return rc;
}

int nvme_store_read(nvme_store *s, const nvme_loc *loc, void *dst, size_t cap, uint64_t tag, strata_error *err)
{
    uint64_t t = 0;
    int rc = nvme_store_submit_read(s, loc, dst, cap, tag, &t, err);
    if (rc != STRATA_OK)
        return rc;
    nvme_completion c;
    rc = nvme_store_wait_ticket(s, t, &c);
    if (rc != STRATA_OK && err)
        *err = c.err;
    return rc;
}

int nvme_store_free(nvme_store *s, const nvme_loc *loc, strata_error *err)
{
    if (!s || !loc)
        return strata_fail(err, STRATA_EINVAL, "nvme tier: free: NULL argument");
    if (foreign_thread(s))
        return strata_fail(err, STRATA_EINVAL, "nvme tier: free: " FOREIGN_THREAD_MSG);
    if (!is_stored(s, loc)) {
        const bool writing = loc->slab < s->n_slabs && loc->len > 0 && loc->offset % NVME_PAGE == 0 &&
                             is_allocation(&s->slabs[loc->slab], loc->offset / NVME_PAGE,
                                           ((uint64_t)loc->len + NVME_PAGE - 1) / NVME_PAGE);
        return strata_fail(err, STRATA_EINVAL,
                           "nvme tier: free of slab %" PRIu32 " offset %" PRIu64 " length %" PRIu32 ": %s", loc->slab,
                           loc->offset, loc->len,
                           writing ? "its write has not completed (free it after its completion)"
                                   : "not a stored block (double free, or not a location the store gave)");
    }
    extent_release(&s->slabs[loc->slab], loc->offset / NVME_PAGE, ((uint64_t)loc->len + NVME_PAGE - 1) / NVME_PAGE);
    s->st.blocks_stored--;
    s->st.bytes_stored -= loc->len;
    return STRATA_OK;
}

size_t nvme_store_pending(const nvme_store *s) { return s->n_pending_reqs; }

uint64_t nvme_store_fit_bytes(const nvme_store *s, size_t block_bytes)
{
    const uint64_t pages = ((uint64_t)block_bytes + NVME_PAGE - 1) / NVME_PAGE;
    uint64_t n = 0;
    for (uint32_t k = 0; pages && k < s->n_slabs; k++)
        n += off_extents_fit(&s->slabs[k].ext, pages);
    return n * pages * NVME_PAGE;
}

void nvme_store_get_stats(const nvme_store *s, nvme_store_stats *out)
{
    *out = s->st;
    uint64_t free_units = 0;
    for (uint32_t k = 0; k < s->n_slabs; k++)
        free_units += s->slabs[k].ext.free_units;
    out->capacity_bytes = s->page_total * NVME_PAGE;
    out->free_bytes = free_units * NVME_PAGE;
    uint64_t t = strata_mono_ns();
    if (s->active_w)
        out->write_busy_s += (double)(t - s->t_w) * 1e-9;
    if (s->active_r)
        out->read_busy_s += (double)(t - s->t_r) * 1e-9;
    out->write_bytes_per_s = out->write_busy_s > 0 ? (double)out->bytes_written / out->write_busy_s : 0;
    out->read_bytes_per_s = out->read_busy_s > 0 ? (double)out->bytes_read / out->read_busy_s : 0;
    out->io_uring = s->uring;
    out->direct = s->direct;
    out->registered = s->reg_bufs && s->reg_files;
}

const char *nvme_store_describe(const nvme_store *s) { return s->describe; }

size_t nvme_store_owned_paths(const nvme_store *s, char *paths, size_t path_cap, size_t cap)
{
    size_t n = s->n_slabs + (s->created_dir ? 1 : 0);
    for (size_t i = 0; i < n && i < cap; i++) {
        int len = i < s->n_slabs ? snprintf(paths + i * path_cap, path_cap, "%s/%s", s->dir, s->slabs[i].name)
                                 : snprintf(paths + i * path_cap, path_cap, "%s", s->dir);
        if (len < 0 || (size_t)len >= path_cap)
            return 0;
    }
    return n;
}

/* ---- create / destroy ---- */

static void close_all(nvme_store *s, bool unlink_files)
{
    for (uint32_t k = 0; k < s->n_slabs; k++) {
        slab *sl = &s->slabs[k];
        if (sl->fd >= 0) {
            close(sl->fd);
            /* Only the file this store created: one put there since under the same name stays. */
            struct stat now;
            if (unlink_files && s->dirfd >= 0 && sl->ino != 0 &&
                fstatat(s->dirfd, sl->name, &now, AT_SYMLINK_NOFOLLOW) == 0 && now.st_dev == sl->dev &&
                now.st_ino == sl->ino)
                unlinkat(s->dirfd, sl->name, 0);
        }
        off_extents_fini(&sl->ext);
        free(sl->marks);
    }
    if (s->uring)
        io_uring_queue_exit(&s->ring);
    if (s->dirfd >= 0)
        close(s->dirfd);  /* releases the flock */
    if (s->created_dir && unlink_files)
        rmdir(s->dir);
    free(s->slabs);
    if (!s->ring_abandoned)   /* else the kernel may still write into it */
        free(s->staging);
    free(s->ops);
    free(s->free_bufs);
    free(s->scq);
    free(s->reqs);
    free(s->dir);
    free(s);
}

static int open_dir(nvme_store *s, strata_error *err)
{
    if (mkdir(s->dir, 0700) == 0) {
        s->created_dir = true;
    } else if (errno != EEXIST) {
        return strata_fail(err, STRATA_EIO, "nvme tier: cannot create spill directory '%s': %s", s->dir,
                           strerror(errno));
    }
    /* The store truncates, fills and deletes files here: the folder must be this user's alone,
     * or another local user could plant links to files of ours in it. */
    struct stat st;
    if (lstat(s->dir, &st) == 0 && S_ISLNK(st.st_mode) && st.st_uid != geteuid() && st.st_uid != 0)
        return strata_fail(err, STRATA_EIO,
                           "nvme tier: spill directory '%s' is a symbolic link owned by another user (uid %u): "
                           "give a private folder", s->dir, (unsigned)st.st_uid);
    s->dirfd = open(s->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (s->dirfd < 0)
        return strata_fail(err, STRATA_EIO, "nvme tier: cannot open spill directory '%s': %s", s->dir,
                           strerror(errno));
    if (fstat(s->dirfd, &st) != 0)
        return strata_fail(err, STRATA_EIO, "nvme tier: spill directory '%s': %s", s->dir, strerror(errno));
    if (st.st_uid != geteuid())
        return strata_fail(err, STRATA_EIO,
                           "nvme tier: spill directory '%s' belongs to uid %u, not to this process's uid %u: give a "
                           "private folder (created 0700 when absent)", s->dir, (unsigned)st.st_uid, (unsigned)geteuid());
    if (st.st_mode & (S_IWGRP | S_IWOTH))
        return strata_fail(err, STRATA_EIO,
                           "nvme tier: spill directory '%s' is writable by other users (mode %04o): give a private "
                           "folder (created 0700 when absent)", s->dir, (unsigned)(st.st_mode & 07777));
    if (flock(s->dirfd, LOCK_EX | LOCK_NB) != 0)
        return strata_fail(err, STRATA_EIO, "nvme tier: spill directory '%s' %s", s->dir,
                           errno == EWOULDBLOCK ? "is in use by another store" : strerror(errno));
    return STRATA_OK;
}

/* Whether an existing file may be a slab a crashed store left: empty, or its first page all zeros
 * (preallocated, never written) or starting with a block. A user's file that happens to carry a
 * slab's name is anything else, and is refused rather than truncated. -1 with errno on a read
 * error. */
static int looks_like_slab(int fd)
{
    uint8_t *page;
    if (posix_memalign((void **)&page, NVME_PAGE, NVME_PAGE) != 0) {
        errno = ENOMEM;
        return -1;
    }
    const ssize_t n = pread(fd, page, NVME_PAGE, 0);
    int ours = n < 0 ? -1 : 1;
    if (n > 0 && !(n >= 4 && kv_ld32(page) == KV_BLOCK_MAGIC)) {
        for (ssize_t i = 0; i < n && ours == 1; i++)
            ours = page[i] == 0;
    }
    free(page);
    return ours;
}

static int open_slabs(nvme_store *s, char *why_buffered, size_t why_cap, bool *prealloc_all, strata_error *err)
{
    uint64_t left = s->page_total * NVME_PAGE;
    *prealloc_all = !s->opt.no_prealloc;
    for (uint32_t k = 0; k < s->n_slabs; k++) {
        slab *sl = &s->slabs[k];
        sl->bytes = left < s->opt.slab_bytes ? left : s->opt.slab_bytes;
        left -= sl->bytes;
        snprintf(sl->name, sizeof sl->name, "slab-%04" PRIu32 ".kv", k);
        /* A file left by a store that crashed is reused; a link never is (O_NOFOLLOW, one link). */
        int flags = O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC;
        sl->fd = openat(s->dirfd, sl->name, flags | (s->direct ? O_DIRECT : 0), 0600);
        if (sl->fd < 0 && s->direct && errno == EINVAL) {
            /* The filesystem refuses O_DIRECT: buffered I/O (fdatasync still makes it durable). */
            snprintf(why_buffered, why_cap, "O_DIRECT refused: %s", strerror(errno));
            s->direct = false;
            sl->fd = openat(s->dirfd, sl->name, flags, 0600);
        }
        if (sl->fd < 0)
            return strata_fail(err, STRATA_EIO, "nvme tier: cannot create slab file '%s/%s': %s", s->dir, sl->name,
                               errno == ELOOP ? "it is a symbolic link (remove it)" : strerror(errno));
        struct stat st;
        if (fstat(sl->fd, &st) != 0)
            return strata_fail(err, STRATA_EIO, "nvme tier: '%s/%s': %s", s->dir, sl->name, strerror(errno));
        sl->dev = st.st_dev;
        sl->ino = st.st_ino;
        if (!S_ISREG(st.st_mode) || st.st_nlink != 1 || st.st_uid != geteuid()) {
            close(sl->fd);
            sl->fd = -1;   /* not ours: destroy must not delete it either */
            return strata_fail(err, STRATA_EIO,
                               "nvme tier: '%s/%s' exists and is not a slab file this store may overwrite (%s): "
                               "remove it", s->dir, sl->name,
                               !S_ISREG(st.st_mode) ? "not a regular file"
                               : st.st_nlink != 1   ? "it has other hard links"
                                                    : "another user's file");
        }
        const int ours = st.st_size == 0 ? 1 : looks_like_slab(sl->fd);
        if (ours != 1) {
            const int e = errno;
            close(sl->fd);
            sl->fd = -1;
            if (ours < 0)
                return strata_fail(err, STRATA_EIO, "nvme tier: reading '%s/%s': %s", s->dir, sl->name, strerror(e));
            return strata_fail(err, STRATA_EIO,
                               "nvme tier: '%s/%s' exists and does not look like a slab file (%lld bytes, neither "
                               "zeros nor a KV block at its start): not overwriting it; remove it or give "
                               "another spill directory", s->dir, sl->name, (long long)st.st_size);
        }
        if (ftruncate(sl->fd, 0) != 0)
            return strata_fail(err, STRATA_EIO, "nvme tier: truncating '%s/%s': %s", s->dir, sl->name,
                               strerror(errno));
        if (fchmod(sl->fd, 0600) != 0)
            return strata_fail(err, STRATA_EIO, "nvme tier: chmod 0600 '%s/%s': %s", s->dir, sl->name,
                               strerror(errno));
        int rc = -1;
        if (!s->opt.no_prealloc) {
            rc = fallocate(sl->fd, 0, 0, (off_t)sl->bytes);
            if (rc != 0 && (errno == ENOSPC || errno == EDQUOT))
                return strata_fail(err, STRATA_EFULL,
                                   "nvme tier: preallocating %" PRIu64 " MiB for '%s/%s': %s (budget %" PRIu64
                                   " MiB too large for this filesystem?)",
                                   sl->bytes >> 20, s->dir, sl->name, strerror(errno), (s->page_total * NVME_PAGE) >> 20);
            if (rc != 0 && errno != EOPNOTSUPP && errno != ENOSYS)
                return strata_fail(err, STRATA_EIO, "nvme tier: preallocating '%s/%s': %s", s->dir, sl->name,
                                   strerror(errno));
        }
        if (rc != 0) {
            *prealloc_all = false;
            if (ftruncate(sl->fd, (off_t)sl->bytes) != 0)
                return strata_fail(err, errno == ENOSPC ? STRATA_EFULL : STRATA_EIO,
                                   "nvme tier: sizing '%s/%s': %s", s->dir, sl->name, strerror(errno));
        }
        if ((rc = off_extents_init(&sl->ext, sl->bytes / NVME_PAGE, err)) != STRATA_OK)
            return rc;
        sl->mark_words = (size_t)((sl->bytes / NVME_PAGE + 63) / 64);
        sl->marks = calloc(N_MARKS * sl->mark_words, sizeof *sl->marks);
        if (!sl->marks)
            return strata_fail(err, STRATA_ENOMEM, "nvme tier: out of memory for the block map of '%s/%s'", s->dir,
                               sl->name);
    }
    return STRATA_OK;
}

nvme_store *nvme_store_create(const nvme_store_options *o, strata_error *err)
{
    if (!o || !o->dir || !o->dir[0]) {
        strata_fail(err, STRATA_EINVAL, "nvme tier: no spill directory given");
        return NULL;
    }
    nvme_store *s = calloc(1, sizeof *s);
    if (!s) {
        strata_fail(err, STRATA_ENOMEM, "nvme tier: out of memory");
        return NULL;
    }
    s->dirfd = -1;
    s->owner = pthread_self();
    s->opt = *o;
    s->pending = s->done = (req_list){NONE, NONE};
    s->dir = strdup(o->dir);
    if (!s->dir) {
        free(s);
        strata_fail(err, STRATA_ENOMEM, "nvme tier: out of memory");
        return NULL;
    }
    s->opt.dir = s->dir;
    nvme_store_options *op = &s->opt;
    if (!op->staging_bufs)
        op->staging_bufs = 64;
    if (!op->staging_buf_bytes)
        op->staging_buf_bytes = 256 * 1024;
    if (!op->sync_batch)
        op->sync_batch = op->staging_bufs;
    s->page_total = op->budget_bytes / NVME_PAGE;
    uint64_t slab_bytes = op->slab_bytes ? op->slab_bytes : (1ull << 30);
    /* The default grows with the budget past 256 GiB, so that a budget of many TiB is still 256
     * files: each holds an open descriptor (the usual limit is 1024) and a registered slot of the
     * ring. */
    if (!op->slab_bytes && s->page_total > NVME_DEFAULT_SLABS * (slab_bytes / NVME_PAGE))
        slab_bytes = (s->page_total + NVME_DEFAULT_SLABS - 1) / NVME_DEFAULT_SLABS * NVME_PAGE;
    slab_bytes = slab_bytes / NVME_PAGE * NVME_PAGE;
    if (slab_bytes > s->page_total * NVME_PAGE)
        slab_bytes = s->page_total * NVME_PAGE;
    op->slab_bytes = slab_bytes;
    if (s->page_total == 0 || slab_bytes == 0 || op->staging_buf_bytes % NVME_PAGE != 0 ||
        op->staging_buf_bytes > (1u << 30) || op->staging_bufs > 4096 || op->verify > NVME_VERIFY_READBACK) {
        strata_fail(err, STRATA_EINVAL,
                    "nvme tier: bad options (budget %" PRIu64 " bytes must be >= 4096; staging buffers %u x %zu bytes: "
                    "at most 4096 buffers of a multiple of 4096 bytes)", op->budget_bytes, op->staging_bufs,
                    op->staging_buf_bytes);
        free(s->dir);
        free(s);
        return NULL;
    }
    uint64_t n_slabs = (s->page_total * NVME_PAGE + slab_bytes - 1) / slab_bytes;
    if (n_slabs > NVME_MAX_SLABS) {
        strata_fail(err, STRATA_EINVAL, "nvme tier: %" PRIu64 " slab files of %" PRIu64 " bytes; at most %d: use larger "
                    "slab_bytes", n_slabs, slab_bytes, NVME_MAX_SLABS);
        free(s->dir);
        free(s);
        return NULL;
    }
    s->n_bufs = op->staging_bufs;
    s->buf_bytes = op->staging_buf_bytes;
    s->slabs = calloc(n_slabs, sizeof *s->slabs);
    s->ops = calloc(s->n_bufs, sizeof *s->ops);
    s->free_bufs = calloc(s->n_bufs, sizeof *s->free_bufs);
    s->scq_cap = s->n_bufs + (unsigned)n_slabs;
    s->scq = calloc(s->scq_cap, sizeof *s->scq);
    s->staging = aligned_alloc(NVME_PAGE, (size_t)s->n_bufs * s->buf_bytes);
    if (s->slabs)
        for (uint64_t k = 0; k < n_slabs; k++) {
            s->slabs[k].fd = -1;
            s->slabs[k].waiting = s->slabs[k].syncing = (req_list){NONE, NONE};
        }
    s->n_slabs = (uint32_t)n_slabs;
    if (!s->slabs || !s->ops || !s->free_bufs || !s->scq || !s->staging) {
        strata_fail(err, STRATA_ENOMEM, "nvme tier: out of memory for %u staging buffers of %zu bytes", s->n_bufs,
                    s->buf_bytes);
        s->n_slabs = s->slabs ? s->n_slabs : 0;
        close_all(s, false);
        return NULL;
    }
    memset(s->staging, 0, (size_t)s->n_bufs * s->buf_bytes);
    for (unsigned b = 0; b < s->n_bufs; b++)
        s->free_bufs[s->n_free_bufs++] = s->n_bufs - 1 - b;

    char why_buffered[128] = "", why_sync[160] = "", why_unreg[160] = "";
    s->direct = !op->force_buffered;
    if (op->force_buffered)
        snprintf(why_buffered, sizeof why_buffered, "O_DIRECT off by option");
    bool prealloc = false;
    if (open_dir(s, err) != STRATA_OK || open_slabs(s, why_buffered, sizeof why_buffered, &prealloc, err) != STRATA_OK) {
        close_all(s, true);
        return NULL;
    }

    const char *env = getenv("STRATA_NO_IO_URING");
    if (op->force_sync_io) {
        snprintf(why_sync, sizeof why_sync, "io_uring off by option");
    } else if (env && env[0] && strcmp(env, "0") != 0) {
        snprintf(why_sync, sizeof why_sync, "io_uring off by STRATA_NO_IO_URING");
    } else {
        unsigned entries = 8;
        while (entries < s->scq_cap)
            entries *= 2;
        /* One thread submits and reaps: let the kernel skip cross-thread wakeups where it can
         * (6.0+); older kernels reject the flags, then plain setup. */
        int rc = io_uring_queue_init(entries, &s->ring, IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_COOP_TASKRUN);
        if (rc == -EINVAL)
            rc = io_uring_queue_init(entries, &s->ring, 0);
        if (rc < 0) {
            snprintf(why_sync, sizeof why_sync, "io_uring_queue_init: %s", strerror(-rc));
        } else {
            s->uring = true;
            if (op->no_register) {
                snprintf(why_unreg, sizeof why_unreg, "registration off by option");
            } else {
                struct iovec *iov = calloc(s->n_bufs, sizeof *iov);
                int *fds = calloc(s->n_slabs, sizeof *fds);
                if (!iov || !fds) {
                    snprintf(why_unreg, sizeof why_unreg, "out of memory");
                } else {
                    for (unsigned b = 0; b < s->n_bufs; b++)
                        iov[b] = (struct iovec){s->staging + (size_t)b * s->buf_bytes, s->buf_bytes};
                    for (uint32_t k = 0; k < s->n_slabs; k++)
                        fds[k] = s->slabs[k].fd;
                    rc = io_uring_register_buffers(&s->ring, iov, s->n_bufs);
                    if (rc < 0) {
                        snprintf(why_unreg, sizeof why_unreg, "io_uring_register_buffers: %s", strerror(-rc));
                    } else {
                        s->reg_bufs = true;
                        rc = io_uring_register_files(&s->ring, fds, s->n_slabs);
                        if (rc < 0)
                            snprintf(why_unreg, sizeof why_unreg, "io_uring_register_files: %s", strerror(-rc));
                        else
                            s->reg_files = true;
                    }
                }
                free(iov);
                free(fds);
            }
        }
    }
    /* A description cut at the buffer's end is still a description: the length is not checked. */
    int described = snprintf(s->describe, sizeof s->describe, "%s%s%s%s%s, %s%s%s%s, %" PRIu32 " slab%s of %.4g MiB%s in %s, "
             "%u staging buffers of %zu KiB, verify %s",
             s->uring ? "io_uring" : "pread/pwrite", s->uring ? "" : " (", s->uring ? "" : why_sync,
             s->uring ? (s->reg_bufs && s->reg_files ? " (registered buffers and files)" : " (unregistered: ") : ")",
             s->uring && !(s->reg_bufs && s->reg_files) ? why_unreg : "",
             s->uring && !(s->reg_bufs && s->reg_files) ? ")" : "",
             s->direct ? "O_DIRECT" : "buffered (", s->direct ? "" : why_buffered, s->direct ? "" : ")",
             s->n_slabs, s->n_slabs == 1 ? "" : "s", (double)(s->n_slabs ? s->slabs[0].bytes : 0) / 1048576.0, prealloc ? " (preallocated)" : " (sparse)",
             s->dir, s->n_bufs, s->buf_bytes / 1024, op->verify == NVME_VERIFY_READBACK ? "read-back" : "crc");
    (void)described;
    s->st.io_uring = s->uring;
    s->st.direct = s->direct;
    return s;
}

void nvme_store_destroy(nvme_store *s)
{
    if (!s)
        return;
    /* The kernel may still be using staging buffers: let every operation in flight finish
     * (completions are handled normally; nothing new is issued but short-count resubmits). */
    while (s->k_inflight > 0) {
        flush_submit(s);
        block_once(s);   /* submits what a refused submit left, retrying a while */
        if (s->uring && s->to_submit > 0 && io_uring_cq_ready(&s->ring) == 0)
            break;  /* the ring refused submissions for 10 s: nothing more will complete */
        reap(s);
    }
    close_all(s, true);
}
