/* The codec interface: what a block's codec contributes to the block format. The block layer
 * (block.c) owns the header, section table, alignment and CRCs; a codec owns the meaning and
 * exact size of its sections. fp16 and KIVI are implemented; GEAR, OTT and TaDA will be further
 * entries (their section ids are reserved in block.h). */
#ifndef STRATA_KVSTORE_CODEC_H
#define STRATA_KVSTORE_CODEC_H

#include <stdint.h>

#include "kvstore/block.h"

typedef struct kv_section_spec {
    uint16_t id;
    uint64_t length;  /* exact bytes; 64-bit so that absurd geometries are caught, not wrapped */
} kv_section_spec;

typedef struct kv_codec_ops {
    kv_codec_id id;
    const char *name;
    /* Codec-specific checks of a desc (bits, groups, divisibility); the generic ones (sizes
     * positive and bounded) are done before. */
    int (*check)(const kv_block_desc *d, strata_error *err);
    /* The sections of a block of d in layout order; returns their count (<= KV_BLOCK_MAX_SECTIONS).
     * d has passed check. */
    int (*sections)(const kv_block_desc *d, kv_section_spec *out);
    /* Fills the sections (sec[i] points at section i of sections(), already zeroed) from fp32
     * rows [n_tokens][n_kv_heads][head_dim]. */
    int (*encode)(const kv_block_desc *d, const float *k, const float *v, uint8_t *const *sec,
                  strata_error *err);
    /* Dequantizes a parsed block into fp32 rows of the same layout. */
    int (*decode)(const kv_block *b, float *k, float *v, strata_error *err);
} kv_codec_ops;

/* The codec of an id, or NULL for an unknown one. */
const kv_codec_ops *kv_codec_ops_for(unsigned id);

extern const kv_codec_ops kv_codec_fp16;
extern const kv_codec_ops kv_codec_kivi;

#endif
