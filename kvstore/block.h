/* The compressed block: one layer, block of consecutive tokens, all KV heads, K and V.
 * The byte layout is specified in docs/format.md; this header is the reader and writer.
 *
 * Writing: describe the block (kv_block_desc), then kv_block_encode() lays out the header and
 * section table, lets the codec fill the sections from fp32 rows and stamps both CRCs.
 * Reading: kv_block_parse() validates every header field and section bound against the buffer
 * (without reading the payload), kv_block_verify() additionally checks both CRCs. Neither trusts
 * any byte: a malformed block is STRATA_EFORMAT, a damaged one STRATA_ECRC. */
#ifndef STRATA_KVSTORE_BLOCK_H
#define STRATA_KVSTORE_BLOCK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvstore/error.h"
#include "kvstore/kv_cache.h"

#define KV_BLOCK_MAGIC 0x42564b53u        /* the bytes "SKVB" */
#define KV_BLOCK_VERSION 1u
#define KV_BLOCK_FIXED_BYTES 64u          /* fixed header before the section table */
#define KV_BLOCK_SECTION_ENTRY_BYTES 12u
#define KV_BLOCK_MAX_SECTIONS 16
#define KV_BLOCK_ALIGN 64u                /* header area, every section and the block size */

/* Byte offsets of the fixed header fields (all little-endian). */
enum {
    KV_HDR_MAGIC = 0,         /* u32 */
    KV_HDR_VERSION = 4,       /* u16 */
    KV_HDR_HEADER_BYTES = 6,  /* u16: fixed header + section table + zero padding */
    KV_HDR_BLOCK_BYTES = 8,   /* u32: the whole block */
    KV_HDR_CODEC = 12,        /* u8 */
    KV_HDR_K_BITS = 13,       /* u8 */
    KV_HDR_V_BITS = 14,       /* u8 */
    KV_HDR_N_SECTIONS = 15,   /* u8 */
    KV_HDR_LAYER = 16,        /* u32 */
    KV_HDR_N_TOKENS = 20,     /* u32 */
    KV_HDR_FIRST_POS = 24,    /* u64 */
    KV_HDR_N_KV_HEADS = 32,   /* u16 */
    KV_HDR_HEAD_DIM = 34,     /* u16 */
    KV_HDR_K_GROUP = 36,      /* u16: tokens per key group (0 for fp16) */
    KV_HDR_V_GROUP = 38,      /* u16: channels per value group (0 for fp16) */
    KV_HDR_RESIDUAL = 40,     /* u16: the writer's residual window R (informational) */
    KV_HDR_FLAGS = 42,        /* u16: 0 in version 1 */
    KV_HDR_RANK = 44,         /* u8: gear low rank per head (0 for other codecs) */
    KV_HDR_RESERVED1 = 45,    /* u8, zero */
    KV_HDR_K_SPARSE = 46,     /* u16: gear outliers per key vector (0 for other codecs) */
    KV_HDR_V_SPARSE = 48,     /* u16: gear outliers per value vector */
    KV_HDR_OTT_TOKENS = 50,   /* u16: ott pooled (head, token) entries in this block */
    KV_HDR_RESERVED = 52,     /* 4 bytes, zero */
    KV_HDR_PAYLOAD_CRC = 56,  /* u32: CRC32C of bytes [header_bytes, block_bytes) */
    KV_HDR_HEADER_CRC = 60,   /* u32: CRC32C of bytes [0, header_bytes) with this field as zero */
};

/* Section ids. 1-6 are defined by version 1; 16-22 are reserved for the error-correcting
 * codecs still to come, so that a reader of this version rejects them by name. */
enum kv_section_id {
    KV_SEC_K_CODES = 1,         /* packed key codes, channel-major */
    KV_SEC_K_SCALES = 2,        /* key (scale, zero) fp16 pairs */
    KV_SEC_V_CODES = 3,         /* packed value codes, token-major */
    KV_SEC_V_SCALES = 4,        /* value (scale, zero) fp16 pairs */
    KV_SEC_K_FP16 = 5,          /* keys as fp16 [token][head][dim] */
    KV_SEC_V_FP16 = 6,          /* values as fp16 [token][head][dim] */
    KV_SEC_GEAR_K_SPARSE = 16,  /* GEAR key outliers: per key vector (u16 token, f16 value) */
    KV_SEC_GEAR_V_SPARSE = 17,  /* GEAR value outliers: per value vector (u16 channel, f16 value) */
    KV_SEC_GEAR_K_LOWRANK = 18, /* GEAR key residual factors: per head A [token][rank], B [dim][rank] f16 */
    KV_SEC_GEAR_V_LOWRANK = 19, /* GEAR value residual factors, same layout */
    KV_SEC_OTT_TOKENS = 20,     /* OTT pooled tokens: (u16 head, u16 token) entries, then f16 K and V rows */
    KV_SEC_TADA_K_MEAN = 21,    /* TaDA per-token key mean across heads, f16 [token][dim] */
    KV_SEC_TADA_V_MEAN = 22,    /* TaDA per-token value mean across heads, f16 [token][dim] */
};

/* Section flag: a reader that does not know the section may skip it (the block still decodes
 * correctly without it). Sections without the flag that a reader does not know make the block
 * unreadable for that reader. */
#define KV_SECTION_SKIPPABLE 0x0001u

/* The header fields that describe a block, independent of its bytes. */
typedef struct kv_block_desc {
    kv_codec_id codec;
    int k_bits, v_bits;    /* 16 and 16 for fp16; 2 or 4 each for kivi, gear, ott; 2, 4, 8 for tada */
    int k_group;           /* tokens per key group (quantized codecs), 0 for fp16 */
    int v_group;           /* channels per value group (quantized codecs), 0 for fp16 */
    int residual;          /* writer's residual window, informational */
    int rank;              /* gear: low rank per head */
    int k_sparse;          /* gear: outliers per key vector (one channel of one head, n_tokens long) */
    int v_sparse;          /* gear: outliers per value vector (one token of one head, head_dim long) */
    int ott_tokens;        /* ott: pooled (head, token) entries held by this block */
    int power_iters;       /* gear, writer only (not stored): power iterations of the low-rank fit;
                            * 0: GEAR_POWER_ITERS */
    uint32_t layer;
    uint64_t first_pos;    /* position of the block's first token */
    uint32_t n_tokens;
    int n_kv_heads;
    int head_dim;
} kv_block_desc;

typedef struct kv_block_section {
    uint16_t id;
    uint16_t flags;
    uint32_t offset;       /* from the start of the block */
    uint32_t length;
} kv_block_section;

/* A parsed block: a view of bytes that stay owned by the caller. */
typedef struct kv_block {
    const uint8_t *bytes;
    kv_block_desc desc;
    unsigned version;
    uint32_t header_bytes;
    uint32_t block_bytes;
    uint32_t payload_crc;  /* as stored */
    uint32_t header_crc;   /* as stored */
    int n_sections;
    kv_block_section sections[KV_BLOCK_MAX_SECTIONS];
} kv_block;

/* The desc of a full block of a pool's codec and geometry (n_tokens = block_tokens), with the
 * gear decode rank and no ott entries; the writer adjusts rank / ott_tokens per block. */
void kv_block_desc_init(kv_block_desc *d, const kv_codec_params *p, const kv_geometry *g,
                        uint32_t layer, uint64_t first_pos);

/* An OTT pool entry: the token (index within the block) of one KV head kept in fp16. */
typedef struct kv_ott_entry {
    uint16_t head;
    uint16_t token;
} kv_ott_entry;

/* What a block's encoder needs beyond the rows: the ott entries (d->ott_tokens of them, sorted
 * by token then head, each pair at most once). NULL when the codec needs nothing. */
typedef struct kv_block_extra {
    const kv_ott_entry *ott;
} kv_block_extra;

/* Checks that a desc is a block this version can hold (codec, bits, groups, sizes). */
int kv_block_desc_check(const kv_block_desc *d, strata_error *err);

/* Exact bytes of the block d describes, 0 if d is invalid. */
size_t kv_block_bytes(const kv_block_desc *d);

/* Encodes n_tokens rows (fp32, [n_tokens][n_kv_heads][head_dim] for k and v) into dst, which
 * must have room for kv_block_bytes(d) bytes; *written gets that size (may be NULL). */
int kv_block_encode(const kv_block_desc *d, const float *k, const float *v, uint8_t *dst,
                    size_t cap, size_t *written, strata_error *err);
/* The same with the codec's extra input (may be NULL). */
int kv_block_encode_ex(const kv_block_desc *d, const float *k, const float *v, const kv_block_extra *extra,
                       uint8_t *dst, size_t cap, size_t *written, strata_error *err);

/* Parses and validates the header and section table of the block at buf. len may exceed the
 * block (a pool slot, a file tail); the block's own size is out->block_bytes. Does not read
 * the payload and does not check CRCs. */
int kv_block_parse(const uint8_t *buf, size_t len, kv_block *out, strata_error *err);

/* Computes both CRCs of a parsed block. */
void kv_block_crcs(const kv_block *b, uint32_t *header_crc, uint32_t *payload_crc);

/* Parses (if out is NULL into a local) and checks both CRCs: STRATA_EFORMAT if malformed,
 * STRATA_ECRC if a CRC does not match. */
int kv_block_verify(const uint8_t *buf, size_t len, kv_block *out, strata_error *err);

/* The bytes of section id, or NULL (and *len 0) when the block has none. */
const uint8_t *kv_block_section_data(const kv_block *b, uint16_t id, uint32_t *len);

/* Dequantizes a parsed block to fp32 rows [n_tokens][n_kv_heads][head_dim] (k and v each
 * n_tokens * n_kv_heads * head_dim floats). Decode attention never does this; the attention of a
 * prompt chunk (kern_kv_attention_rows) decodes a span of blocks at a time. */
int kv_block_decode(const kv_block *b, float *k, float *v, strata_error *err);

/* Names for printing. */
const char *kv_section_name(uint16_t id);
const char *kv_codec_id_name(unsigned id);

/* Prints the header fields and section table of a parsed block, indented by indent spaces. */
void kv_block_print(const kv_block *b, FILE *out, int indent);

#endif
