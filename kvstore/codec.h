/* The codec interface: what a block's codec contributes to the block format. The block layer
 * (block.c) owns the header, section table, alignment and CRCs; a codec owns the meaning and
 * exact size of its sections. */
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
     * rows [n_tokens][n_kv_heads][head_dim]. extra may be NULL (see kv_block_extra). */
    int (*encode)(const kv_block_desc *d, const float *k, const float *v, const kv_block_extra *extra,
                  uint8_t *const *sec, strata_error *err);
    /* Dequantizes a parsed block into fp32 rows of the same layout. */
    int (*decode)(const kv_block *b, float *k, float *v, strata_error *err);
} kv_codec_ops;

/* The codec of an id, or NULL for an unknown one. */
const kv_codec_ops *kv_codec_ops_for(unsigned id);

extern const kv_codec_ops kv_codec_fp16;
extern const kv_codec_ops kv_codec_kivi;
extern const kv_codec_ops kv_codec_gear;
extern const kv_codec_ops kv_codec_ott;
extern const kv_codec_ops kv_codec_tada;

/* Shared by the KIVI-backbone codecs (kivi, gear, ott, tada): the four KIVI sections of d
 * (K_CODES, K_SCALES, V_CODES, V_SCALES) written to out[0..3]; returns 4. */
int kv_kivi_sections(const kv_block_desc *d, kv_section_spec *out);
/* Quantizes k and v rows into the four KIVI sections sec[0..3] (keys per channel in groups of
 * d->k_group tokens, values per token in groups of d->v_group channels). */
void kv_kivi_encode_sections(const kv_block_desc *d, const float *k, const float *v, uint8_t *const *sec);
/* Dequantizes the four KIVI sections of a parsed block into fp32 rows. */
int kv_kivi_decode_sections(const kv_block *b, float *k, float *v, strata_error *err);
/* Checks bits (allowed: mask of accepted bit widths, bit b set for b bits), groups and word
 * filling of a KIVI-backbone desc; name is the codec for messages. */
int kv_kivi_check_backbone(const kv_block_desc *d, unsigned allowed_bits, const char *name, strata_error *err);
/* Checks an OTT_TOKENS section's entries of block b (in range, in (token, head) order, each once,
 * and each one's backbone value row all zero scales and zero points, as attention needs). */
int kv_ott_entries_check(const kv_block *b, const uint8_t *sec, strata_error *err);
/* Fails unless the gear/ott header fields (rank, sparse, ott tokens) are zero. */
int kv_check_no_extras(const kv_block_desc *d, const char *name, strata_error *err);

#endif
