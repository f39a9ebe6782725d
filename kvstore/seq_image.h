/* The sequence image of migration (docs/format.md section 10): one sequence of one pipeline
 * stage as bytes, its blocks exactly as stored. Written from, and read into, any holder of a
 * sequence through callbacks, so the CPU pool (kv_seq_export / kv_seq_import) and the GPU cache
 * (worker/cuda) produce and accept the same images, and an image moves between them. */
#ifndef STRATA_KVSTORE_SEQ_IMAGE_H
#define STRATA_KVSTORE_SEQ_IMAGE_H

#include <stddef.h>
#include <stdint.h>

#include "kvstore/block.h"
#include "kvstore/error.h"
#include "kvstore/kv_cache.h"

/* One layer's record, without its bytes. */
typedef struct kv_image_layer {
    size_t n_blocks;     /* complete blocks, positions 0 .. n_blocks * block_tokens */
    size_t tail_len;     /* fp16 tail rows after them */
    size_t prompt_end;   /* tokens that entered in multi-token appends (GEAR's prompt rank) */
    size_t ott_bytes;    /* OTT pool state bytes (kv_ott_tracker_save's layout), 0 without a pool */
} kv_image_layer;

/* What the writer asks the holder, layer by layer in order (l = 0 .. n_layers - 1). Each returns
 * STRATA_OK or an error code with err set, which ends the write. */
typedef struct kv_image_source {
    void *ctx;
    int (*layer)(void *ctx, int l, kv_image_layer *out, strata_error *err);
    int (*ott_state)(void *ctx, int l, uint8_t *dst, strata_error *err);          /* ott_bytes into dst */
    int (*block_bytes)(void *ctx, int l, size_t b, uint32_t *bytes, strata_error *err);
    int (*block)(void *ctx, int l, size_t b, uint8_t *dst, strata_error *err);    /* its exact bytes */
    int (*tail)(void *ctx, int l, uint16_t *k, uint16_t *v, strata_error *err);   /* tail_len rows each */
    const kv_codec_params *codecs;   /* the sequence's plan: n_layers entries, written as its range list */
} kv_image_source;

/* The image of a sequence of geometry g (n_layers local layers); *out is malloc'd. Every block
 * is checked (kv_block_verify) as it goes in: a damaged block does not travel. */
int kv_image_write(const kv_geometry *g, const kv_image_source *src, uint8_t **out, size_t *len,
                   strata_error *err);

/* The most bytes an image of a sequence of geometry g can take when the sequence holds at most
 * max_tokens tokens and its blocks' stored bytes total at most block_bytes (a holder's KV budgets:
 * a block is never larger than the slot or extent that holds it). A cap for a receiver of images
 * (a migration link's largest frame); it counts the largest plan name and OTT state any plan may
 * have, so it is loose by up to about a MiB per layer. */
uint64_t kv_image_max_bytes(const kv_geometry *g, uint64_t max_tokens, uint64_t block_bytes);

/* What the reader hands the holder. Blocks come verified (both CRCs) and placed (their layer,
 * first position and token count are those of block b of layer l); the sink checks what only it
 * knows (codec, slot size, its room, whether its OTT state fits). */
typedef struct kv_image_sink {
    void *ctx;
    /* the sequence's plan (n_layers entries, parsed from the image), before any layer */
    int (*plan)(void *ctx, const kv_codec_params *codecs, strata_error *err);
    /* layer l's counts and OTT state (NULL when ott_bytes is 0), before its blocks */
    int (*layer)(void *ctx, int l, const kv_image_layer *info, const uint8_t *ott_state, strata_error *err);
    int (*block)(void *ctx, int l, size_t b, const kv_block *parsed, strata_error *err);
    /* the tail's rows, fp16 values in little-endian byte order (tail_len rows of K, then of V) */
    int (*tail)(void *ctx, int l, const uint8_t *k, const uint8_t *v, size_t tail_len, strata_error *err);
} kv_image_sink;

/* Checks the image (CRC, magic, version, geometry g, its plan, each record's bounds, every block, equal
 * token counts across layers, nothing after the last layer) while handing it to the sink in
 * order. STRATA_EFORMAT for a truncated or malformed image, STRATA_ECRC for a CRC mismatch,
 * STRATA_EINVAL for an image that does not fit g; the sink's own codes pass through. On failure
 * the sink may hold part of the sequence: its owner discards it. */
int kv_image_read(const kv_geometry *g, const uint8_t *img, size_t len, const kv_image_sink *sink,
                  strata_error *err);

/* The image of the first n_tokens tokens of the sequence in img (prefix caching): the first
 * n_tokens / block_tokens blocks of every layer exactly as stored, no fp16 tail, GEAR's prompt
 * mark cut to n_tokens. The sequence it makes continues from n_tokens as any other (its next
 * tokens enter an empty tail). n_tokens must be a positive multiple of block_tokens that every
 * layer holds in blocks (STRATA_EINVAL otherwise); STRATA_EUNSUPPORTED for a plan with an OTT
 * layer (the image carries the tracker's state at its end only, not at the cut); what
 * kv_image_read returns for a bad image. *out is malloc'd. */
int kv_image_prefix(const kv_geometry *g, const uint8_t *img, size_t len, size_t n_tokens, uint8_t **out,
                    size_t *out_len, strata_error *err);

#endif
