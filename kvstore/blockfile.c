#include "kvstore/blockfile.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvstore/block.h"
#include "kvstore/bytes.h"
#include "kvstore/crc32c.h"
#include "kvstore/half.h"
#include "kvstore/replace_file.h"

enum {
    KV_FILE_MAGIC = 0,         /* u32 */
    KV_FILE_VERSION = 4,       /* u16 */
    KV_FILE_HEADER_BYTES = 6,  /* u16 */
    KV_FILE_N_BLOCKS = 8,      /* u32 */
    KV_FILE_FLAGS = 12,        /* u32, 0 */
    KV_FILE_BYTES = 16,        /* u64: the whole file */
    KV_FILE_RESERVED = 24,     /* 36 bytes, zero */
    KV_FILE_HEADER_CRC = 60,   /* u32: CRC32C of bytes [0, 60) */
};

typedef struct tail_buffers {
    float *k, *v;
    uint8_t *block;
} tail_buffers;

static void tail_free(tail_buffers *t)
{
    free(t->k);
    free(t->v);
    free(t->block);
}

static void tail_desc(const kv_seq *seq, int layer, const kv_layer_view *view, kv_block_desc *d)
{
    const kv_pool *pool = kv_seq_pool(seq);
    kv_codec_params fp16 = {.codec = KV_CODEC_FP16, .bits = 16};
    kv_block_desc_init(d, &fp16, kv_pool_geometry(pool), (uint32_t)layer,
                       (uint64_t)view->n_blocks * (uint64_t)view->block_tokens);
    d->n_tokens = (uint32_t)view->tail_tokens;
}

static int write_all(FILE *f, const void *p, size_t n, const char *path, strata_error *err)
{
    if (n && fwrite(p, 1, n, f) != n)
        return strata_fail(err, STRATA_EIO, "writing %s: %s", path, strerror(errno));
    return STRATA_OK;
}

static int save_to(kv_seq *seq, FILE *f, const char *path, strata_error *err)
{
    const kv_geometry *g = kv_pool_geometry(kv_seq_pool(seq));
    uint64_t n_blocks = 0, bytes = KV_BLOCKFILE_HEADER_BYTES;
    size_t max_tail_block = 0, max_tail_tokens = 0;
    for (int l = 0; l < g->n_layers; l++) {
        kv_layer_view view;
        int rc = kv_seq_acquire_layer(seq, l, &view, err);   /* blocks may be in a lower tier */
        kv_seq_unpin(seq);
        if (rc != STRATA_OK)
            return strata_error_prefix(err, "saving %s", path);
        n_blocks += view.n_blocks;
        for (size_t b = 0; b < view.n_blocks; b++)
            bytes += kv_ld32(view.blocks[b] + KV_HDR_BLOCK_BYTES);   /* each block's own size */
        if (view.tail_tokens) {
            kv_block_desc d;
            tail_desc(seq, l, &view, &d);
            size_t tb = kv_block_bytes(&d);
            if (tb == 0)
                return strata_fail(err, STRATA_EINVAL, "saving %s: layer %d tail cannot form a block", path, l);
            n_blocks++;
            bytes += tb;
            if (tb > max_tail_block)
                max_tail_block = tb;
            if (view.tail_tokens > max_tail_tokens)
                max_tail_tokens = view.tail_tokens;
        }
    }
    if (n_blocks > UINT32_MAX)
        return strata_fail(err, STRATA_EINVAL, "saving %s: %" PRIu64 " blocks do not fit a block file", path, n_blocks);

    uint8_t hdr[KV_BLOCKFILE_HEADER_BYTES] = {0};
    kv_st32(hdr + KV_FILE_MAGIC, KV_BLOCKFILE_MAGIC);
    kv_st16(hdr + KV_FILE_VERSION, KV_BLOCKFILE_VERSION);
    kv_st16(hdr + KV_FILE_HEADER_BYTES, KV_BLOCKFILE_HEADER_BYTES);
    kv_st32(hdr + KV_FILE_N_BLOCKS, (uint32_t)n_blocks);
    kv_st64(hdr + KV_FILE_BYTES, bytes);
    kv_st32(hdr + KV_FILE_HEADER_CRC, kv_crc32c(0, hdr, KV_FILE_HEADER_CRC));
    int rc = write_all(f, hdr, sizeof hdr, path, err);
    if (rc)
        return rc;

    tail_buffers t = {0};
    size_t row = (size_t)g->n_kv_heads * (size_t)g->head_dim;
    if (max_tail_tokens) {
        t.k = malloc(max_tail_tokens * row * sizeof(float));
        t.v = malloc(max_tail_tokens * row * sizeof(float));
        t.block = malloc(max_tail_block);
        if (!t.k || !t.v || !t.block) {
            tail_free(&t);
            return strata_fail(err, STRATA_ENOMEM, "saving %s: out of memory for the tail blocks", path);
        }
    }
    for (int l = 0; l < g->n_layers && rc == STRATA_OK; l++) {
        kv_layer_view view;
        rc = kv_seq_acquire_layer(seq, l, &view, err);
        kv_seq_unpin(seq);
        for (size_t b = 0; b < view.n_blocks && rc == STRATA_OK; b++)
            rc = write_all(f, view.blocks[b], kv_ld32(view.blocks[b] + KV_HDR_BLOCK_BYTES), path, err);
        if (rc || !view.tail_tokens)
            continue;
        for (size_t i = 0; i < view.tail_tokens * row; i++) {
            t.k[i] = strata_half_to_float(view.tail_k[i]);
            t.v[i] = strata_half_to_float(view.tail_v[i]);
        }
        kv_block_desc d;
        tail_desc(seq, l, &view, &d);
        size_t written;
        rc = kv_block_encode(&d, t.k, t.v, t.block, max_tail_block, &written, err);
        if (rc == STRATA_OK)
            rc = write_all(f, t.block, written, path, err);
    }
    tail_free(&t);
    return rc;
}

static int save_seq(FILE *f, const char *path, void *seq, strata_error *err)
{
    return save_to(seq, f, path, err);
}

int kv_blockfile_save(kv_seq *seq, const char *path, strata_error *err)
{
    if (!seq || !path || !*path)
        return strata_fail(err, STRATA_EINVAL, "saving a block file: no sequence or path");
    /* A new file stays 0600: it holds the prompt's keys and values. */
    return strata_replace_file(path, 0600, save_seq, seq, err);
}

/* Maps the file read-only: inspection touches only what it parses, so a huge file that is not
 * a block file (a wrong path) is refused at its first bytes, not after reading it all. Opened
 * without blocking, so a FIFO is refused rather than waited on. *data is NULL for an empty
 * file. */
static int map_file(const char *path, const uint8_t **data, size_t *size, strata_error *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return strata_fail(err, STRATA_EIO, "cannot open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return strata_fail(err, STRATA_EIO, "%s is not a regular file", path);
    }
    *size = (size_t)st.st_size;
    *data = NULL;
    if (*size) {
        void *map = mmap(NULL, *size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED) {
            int e = errno;
            close(fd);
            return strata_fail(err, STRATA_EIO, "cannot map %s (%zu bytes): %s", path, *size, strerror(e));
        }
        *data = map;
    }
    close(fd);
    return STRATA_OK;
}

/* Keeps the first problem as the result (and in err) while inspection goes on where it can. */
__attribute__((format(printf, 4, 5))) static int keep_first(int rc, strata_error *err, int code,
                                                            const char *fmt, ...)
{
    if (rc)
        return rc;
    char msg[sizeof err->msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return strata_fail(err, code, "%s", msg);
}

static void print_values(const kv_block *b, FILE *out, strata_error *err)
{
    const kv_block_desc *d = &b->desc;
    size_t row = (size_t)d->n_kv_heads * (size_t)d->head_dim;
    size_t n = (size_t)d->n_tokens * row;
    float *k = malloc(n * sizeof(float)), *v = malloc(n * sizeof(float));
    if (!k || !v || kv_block_decode(b, k, v, err) != STRATA_OK) {
        fprintf(out, "    (cannot dequantize: %s)\n", (!k || !v) ? "out of memory" : err->msg);
        free(k);
        free(v);
        return;
    }
    size_t shown = (size_t)d->head_dim < 8 ? (size_t)d->head_dim : 8;
    size_t toks[2] = {0, (size_t)d->n_tokens - 1};
    for (int i = 0; i < (d->n_tokens > 1 ? 2 : 1); i++) {
        for (int kvsel = 0; kvsel < 2; kvsel++) {
            const float *x = (kvsel ? v : k) + toks[i] * row;
            fprintf(out, "    %s[pos %" PRIu64 "][head 0][0..%zu]:", kvsel ? "V" : "K",
                    d->first_pos + toks[i], shown - 1);
            for (size_t c = 0; c < shown; c++)
                fprintf(out, " %.5g", (double)x[c]);
            fprintf(out, "\n");
        }
    }
    free(k);
    free(v);
}

static int inspect_buffer(const char *path, const uint8_t *buf, size_t size, FILE *out, bool verbose,
                          strata_error *err)
{
    fprintf(out, "block file %s: %zu bytes\n", path, size);
    if (size < KV_BLOCKFILE_HEADER_BYTES) {
        fprintf(out, "  ERROR: shorter than the %u-byte file header\n", KV_BLOCKFILE_HEADER_BYTES);
        return strata_fail(err, STRATA_EFORMAT, "%s: truncated block file (%zu bytes)", path, size);
    }
    uint32_t magic = kv_ld32(buf + KV_FILE_MAGIC);
    unsigned version = kv_ld16(buf + KV_FILE_VERSION), hbytes = kv_ld16(buf + KV_FILE_HEADER_BYTES);
    if (magic != KV_BLOCKFILE_MAGIC) {
        fprintf(out, "  ERROR: magic 0x%08" PRIx32 ", expected 0x%08x (\"SKVF\")\n", magic, KV_BLOCKFILE_MAGIC);
        return strata_fail(err, STRATA_EFORMAT, "%s: not a block file (bad magic)", path);
    }
    if (version != KV_BLOCKFILE_VERSION || hbytes != KV_BLOCKFILE_HEADER_BYTES) {
        fprintf(out, "  ERROR: file format version %u with a %u-byte header (this reader knows version %u, %u bytes)\n",
                version, hbytes, KV_BLOCKFILE_VERSION, KV_BLOCKFILE_HEADER_BYTES);
        return strata_fail(err, STRATA_EFORMAT, "%s: unsupported block file version %u with a %u-byte header", path,
                           version, hbytes);
    }
    int rc = STRATA_OK;
    uint32_t n_blocks = kv_ld32(buf + KV_FILE_N_BLOCKS);
    uint64_t file_bytes = kv_ld64(buf + KV_FILE_BYTES);
    uint32_t stored = kv_ld32(buf + KV_FILE_HEADER_CRC), computed = kv_crc32c(0, buf, KV_FILE_HEADER_CRC);
    fprintf(out, "  format version %u, %" PRIu32 " blocks, %" PRIu64 " bytes declared\n", version, n_blocks,
            file_bytes);
    if (stored != computed) {
        fprintf(out, "  file header CRC MISMATCH: stored 0x%08" PRIx32 ", computed 0x%08" PRIx32 "\n", stored, computed);
        rc = keep_first(rc, err, STRATA_ECRC, "%s: file header CRC mismatch", path);
    } else {
        fprintf(out, "  file header CRC 0x%08" PRIx32 " ok\n", stored);
    }
    bool reserved_zero = true;
    for (unsigned i = KV_FILE_RESERVED; i < KV_FILE_HEADER_CRC; i++)
        reserved_zero &= buf[i] == 0;
    if (!reserved_zero) {
        fprintf(out, "  ERROR: reserved file header bytes are not zero\n");
        rc = keep_first(rc, err, STRATA_EFORMAT, "%s: reserved file header bytes are not zero", path);
    }
    if (kv_ld32(buf + KV_FILE_FLAGS) != 0) {
        fprintf(out, "  ERROR: unknown file flags 0x%08" PRIx32 "\n", kv_ld32(buf + KV_FILE_FLAGS));
        rc = keep_first(rc, err, STRATA_EFORMAT, "%s: unknown file flags", path);
    }
    if (file_bytes != size) {
        fprintf(out, "  ERROR: the file is %zu bytes but its header declares %" PRIu64 "%s\n", size, file_bytes,
                size < file_bytes ? " (truncated)" : "");
        rc = keep_first(rc, err, STRATA_EFORMAT, "%s: %zu bytes, header declares %" PRIu64, path, size,
                                  file_bytes);
    }
    size_t off = KV_BLOCKFILE_HEADER_BYTES;
    for (uint32_t i = 0; i < n_blocks; i++) {
        fprintf(out, "block %" PRIu32 " at offset %zu:\n", i, off);
        if (off >= size) {
            fprintf(out, "  ERROR: missing, the file ends at %zu\n", size);
            rc = keep_first(rc, err, STRATA_EFORMAT, "%s: block %" PRIu32 " missing (file ends at %zu)", path,
                                      i, size);
            return rc;
        }
        kv_block b;
        strata_error berr = {0};
        if (kv_block_parse(buf + off, size - off, &b, &berr) != STRATA_OK) {
            fprintf(out, "  ERROR: %s\n", berr.msg);
            rc = keep_first(rc, err, berr.code, "%s: block %" PRIu32 " at offset %zu: %s", path, i, off,
                                      berr.msg);
            return rc;   /* without a trustworthy size the next block cannot be found */
        }
        kv_block_print(&b, out, 2);
        uint32_t hc, pc;
        kv_block_crcs(&b, &hc, &pc);
        bool ok = hc == b.header_crc && pc == b.payload_crc;
        fprintf(out, "  header CRC 0x%08" PRIx32 " %s", b.header_crc, hc == b.header_crc ? "ok" : "MISMATCH");
        if (hc != b.header_crc)
            fprintf(out, " (computed 0x%08" PRIx32 ")", hc);
        fprintf(out, ", payload CRC 0x%08" PRIx32 " %s", b.payload_crc, pc == b.payload_crc ? "ok" : "MISMATCH");
        if (pc != b.payload_crc)
            fprintf(out, " (computed 0x%08" PRIx32 ")", pc);
        fprintf(out, "\n");
        if (!ok)
            rc = keep_first(rc, err, STRATA_ECRC, "%s: block %" PRIu32 " at offset %zu: CRC mismatch", path, i,
                                      off);
        if (verbose) {
            if (!ok)
                fprintf(out, "    (values of a damaged block follow; do not trust them)\n");
            print_values(&b, out, &berr);
        }
        off += b.block_bytes;
    }
    if (off != size) {
        fprintf(out, "ERROR: %zu bytes after the last block\n", size - off);
        rc = keep_first(rc, err, STRATA_EFORMAT, "%s: %zu trailing bytes after %" PRIu32 " blocks", path,
                                  size - off, n_blocks);
    }
    if (rc == STRATA_OK)
        fprintf(out, "all %" PRIu32 " blocks ok\n", n_blocks);
    return rc;
}

int kv_blockfile_inspect(const char *path, FILE *out, bool verbose, strata_error *err)
{
    if (!path || !out)
        return strata_fail(err, STRATA_EINVAL, "inspecting a block file: NULL argument");
    const uint8_t *buf = NULL;
    size_t size = 0;
    int rc = map_file(path, &buf, &size, err);
    if (rc)
        return rc;
    static const uint8_t empty[1];
    rc = inspect_buffer(path, buf ? buf : empty, size, out, verbose, err);
    if (buf)
        munmap((void *)buf, size);
    return rc;
}
