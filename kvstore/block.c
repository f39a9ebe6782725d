#include "kvstore/block.h"

#include <inttypes.h>
#include <string.h>

#include "kvstore/bytes.h"
#include "kvstore/codec.h"
#include "kvstore/crc32c.h"

/* Bounds a block's element count so that every section length and the block size fit the u32
 * header fields for any codec of version 1 (at most 9 bytes per element in all). */
#define KV_BLOCK_MAX_ELEMS (1ull << 28)

static uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

static uint32_t header_area_bytes(unsigned n_sections)
{
    return (uint32_t)align_up(KV_BLOCK_FIXED_BYTES + (uint64_t)n_sections * KV_BLOCK_SECTION_ENTRY_BYTES,
                              KV_BLOCK_ALIGN);
}

void kv_block_desc_init(kv_block_desc *d, const kv_codec_params *p, const kv_geometry *g,
                        uint32_t layer, uint64_t first_pos)
{
    memset(d, 0, sizeof *d);
    d->codec = p->codec;
    if (p->codec == KV_CODEC_FP16) {
        d->k_bits = d->v_bits = 16;
    } else {
        d->k_bits = d->v_bits = p->bits;
        d->k_group = d->v_group = p->group;
        d->residual = p->residual;
    }
    if (p->codec == KV_CODEC_GEAR) {
        d->rank = p->rank_decode;
        d->power_iters = p->power_iters;
        d->k_sparse = kv_gear_outliers(p->sparse_pct, g->block_tokens);
        d->v_sparse = kv_gear_outliers(p->sparse_pct, g->head_dim);
    }
    d->layer = layer;
    d->first_pos = first_pos;
    d->n_tokens = g->block_tokens > 0 ? (uint32_t)g->block_tokens : 0;
    d->n_kv_heads = g->n_kv_heads;
    d->head_dim = g->head_dim;
}

int kv_block_desc_check(const kv_block_desc *d, strata_error *err)
{
    const kv_codec_ops *ops = kv_codec_ops_for((unsigned)d->codec);
    if (!ops)
        return strata_fail(err, STRATA_EFORMAT, "unknown codec id %u", (unsigned)d->codec);
    if (d->n_tokens < 1)
        return strata_fail(err, STRATA_EFORMAT, "token count is 0");
    if (d->n_kv_heads < 1 || d->n_kv_heads > UINT16_MAX)
        return strata_fail(err, STRATA_EFORMAT, "n_kv_heads %d out of range 1..65535", d->n_kv_heads);
    if (d->head_dim < 1 || d->head_dim > UINT16_MAX)
        return strata_fail(err, STRATA_EFORMAT, "head_dim %d out of range 1..65535", d->head_dim);
    if (d->k_group < 0 || d->k_group > UINT16_MAX || d->v_group < 0 || d->v_group > UINT16_MAX)
        return strata_fail(err, STRATA_EFORMAT, "group sizes %d/%d out of range 0..65535",
                           d->k_group, d->v_group);
    if (d->residual < 0 || d->residual > UINT16_MAX)
        return strata_fail(err, STRATA_EFORMAT, "residual %d out of range 0..65535", d->residual);
    if (d->rank < 0 || d->rank > UINT8_MAX || d->k_sparse < 0 || d->k_sparse > UINT16_MAX || d->v_sparse < 0 ||
        d->v_sparse > UINT16_MAX || d->ott_tokens < 0 || d->ott_tokens > UINT16_MAX)
        return strata_fail(err, STRATA_EFORMAT, "rank %d / outliers %d, %d / ott entries %d out of range", d->rank,
                           d->k_sparse, d->v_sparse, d->ott_tokens);
    if (d->first_pos > UINT64_MAX - d->n_tokens)
        return strata_fail(err, STRATA_EFORMAT, "first position %" PRIu64 " overflows", d->first_pos);
    uint64_t elems = (uint64_t)d->n_tokens * (uint64_t)d->n_kv_heads;  /* < 2^48: no overflow */
    if (elems > KV_BLOCK_MAX_ELEMS || elems * (uint64_t)d->head_dim > KV_BLOCK_MAX_ELEMS)
        return strata_fail(err, STRATA_EFORMAT,
                           "block of %" PRIu32 " tokens x %d heads x %d dims is too large (limit %llu values)",
                           d->n_tokens, d->n_kv_heads, d->head_dim, KV_BLOCK_MAX_ELEMS);
    return ops->check(d, err);
}

typedef struct block_layout {
    int n;
    kv_section_spec spec[KV_BLOCK_MAX_SECTIONS];
    uint64_t offset[KV_BLOCK_MAX_SECTIONS];
    uint32_t header_bytes;
    uint64_t block_bytes;
} block_layout;

/* The canonical layout: sections in order, each at the next 64-byte boundary after the header
 * area or the previous section; the block ends at the boundary after the last one. */
static int block_layout_of(const kv_block_desc *d, block_layout *L, strata_error *err)
{
    int rc = kv_block_desc_check(d, err);
    if (rc)
        return rc;
    const kv_codec_ops *ops = kv_codec_ops_for((unsigned)d->codec);
    L->n = ops->sections(d, L->spec);
    L->header_bytes = header_area_bytes((unsigned)L->n);
    uint64_t at = L->header_bytes;
    for (int i = 0; i < L->n; i++) {
        at = align_up(at, KV_BLOCK_ALIGN);
        L->offset[i] = at;
        at += L->spec[i].length;
    }
    L->block_bytes = align_up(at, KV_BLOCK_ALIGN);
    if (L->block_bytes > UINT32_MAX)
        return strata_fail(err, STRATA_EFORMAT, "block would be %" PRIu64 " bytes, over the 4 GiB limit",
                           L->block_bytes);
    return STRATA_OK;
}

size_t kv_block_bytes(const kv_block_desc *d)
{
    block_layout L;
    if (block_layout_of(d, &L, NULL) != STRATA_OK)
        return 0;
    return (size_t)L.block_bytes;
}

static void stamp_crcs(uint8_t *b, uint32_t header_bytes, uint32_t block_bytes)
{
    kv_st32(b + KV_HDR_PAYLOAD_CRC, kv_crc32c(0, b + header_bytes, block_bytes - header_bytes));
    kv_st32(b + KV_HDR_HEADER_CRC, 0);
    kv_st32(b + KV_HDR_HEADER_CRC, kv_crc32c(0, b, header_bytes));
}

int kv_block_encode(const kv_block_desc *d, const float *k, const float *v, uint8_t *dst,
                    size_t cap, size_t *written, strata_error *err)
{
    return kv_block_encode_ex(d, k, v, NULL, dst, cap, written, err);
}

int kv_block_encode_ex(const kv_block_desc *d, const float *k, const float *v, const kv_block_extra *extra,
                       uint8_t *dst, size_t cap, size_t *written, strata_error *err)
{
    block_layout L;
    if (block_layout_of(d, &L, err) != STRATA_OK) {
        if (err)
            err->code = STRATA_EINVAL;   /* the caller's description is wrong, not some bytes */
        return STRATA_EINVAL;
    }
    if (!dst || !k || !v)
        return strata_fail(err, STRATA_EINVAL, "encoding a block: NULL buffer");
    if (cap < L.block_bytes)
        return strata_fail(err, STRATA_EINVAL, "encoding a block: %zu bytes of room, the block needs %" PRIu64,
                           cap, L.block_bytes);
    memset(dst, 0, (size_t)L.block_bytes);
    kv_st32(dst + KV_HDR_MAGIC, KV_BLOCK_MAGIC);
    kv_st16(dst + KV_HDR_VERSION, KV_BLOCK_VERSION);
    kv_st16(dst + KV_HDR_HEADER_BYTES, (uint16_t)L.header_bytes);
    kv_st32(dst + KV_HDR_BLOCK_BYTES, (uint32_t)L.block_bytes);
    dst[KV_HDR_CODEC] = (uint8_t)d->codec;
    dst[KV_HDR_K_BITS] = (uint8_t)d->k_bits;
    dst[KV_HDR_V_BITS] = (uint8_t)d->v_bits;
    dst[KV_HDR_N_SECTIONS] = (uint8_t)L.n;
    kv_st32(dst + KV_HDR_LAYER, d->layer);
    kv_st32(dst + KV_HDR_N_TOKENS, d->n_tokens);
    kv_st64(dst + KV_HDR_FIRST_POS, d->first_pos);
    kv_st16(dst + KV_HDR_N_KV_HEADS, (uint16_t)d->n_kv_heads);
    kv_st16(dst + KV_HDR_HEAD_DIM, (uint16_t)d->head_dim);
    kv_st16(dst + KV_HDR_K_GROUP, (uint16_t)d->k_group);
    kv_st16(dst + KV_HDR_V_GROUP, (uint16_t)d->v_group);
    kv_st16(dst + KV_HDR_RESIDUAL, (uint16_t)d->residual);
    dst[KV_HDR_RANK] = (uint8_t)d->rank;
    kv_st16(dst + KV_HDR_K_SPARSE, (uint16_t)d->k_sparse);
    kv_st16(dst + KV_HDR_V_SPARSE, (uint16_t)d->v_sparse);
    kv_st16(dst + KV_HDR_OTT_TOKENS, (uint16_t)d->ott_tokens);
    uint8_t *sec[KV_BLOCK_MAX_SECTIONS];
    for (int i = 0; i < L.n; i++) {
        uint8_t *e = dst + KV_BLOCK_FIXED_BYTES + (size_t)i * KV_BLOCK_SECTION_ENTRY_BYTES;
        kv_st16(e, L.spec[i].id);
        kv_st16(e + 2, 0);
        kv_st32(e + 4, (uint32_t)L.offset[i]);
        kv_st32(e + 8, (uint32_t)L.spec[i].length);
        sec[i] = dst + L.offset[i];
    }
    int rc = kv_codec_ops_for((unsigned)d->codec)->encode(d, k, v, extra, sec, err);
    if (rc)
        return rc;
    stamp_crcs(dst, L.header_bytes, (uint32_t)L.block_bytes);
    if (written)
        *written = (size_t)L.block_bytes;
    return STRATA_OK;
}

static bool all_zero(const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (p[i])
            return false;
    return true;
}

int kv_block_parse(const uint8_t *buf, size_t len, kv_block *out, strata_error *err)
{
    memset(out, 0, sizeof *out);
    if (!buf)
        return strata_fail(err, STRATA_EINVAL, "block: NULL buffer");
    if (len < KV_BLOCK_FIXED_BYTES)
        return strata_fail(err, STRATA_EFORMAT, "block truncated: %zu bytes, the fixed header alone is %u",
                           len, KV_BLOCK_FIXED_BYTES);
    uint32_t magic = kv_ld32(buf + KV_HDR_MAGIC);
    if (magic != KV_BLOCK_MAGIC)
        return strata_fail(err, STRATA_EFORMAT, "not a block: magic 0x%08" PRIx32 ", expected 0x%08x (\"SKVB\")",
                           magic, KV_BLOCK_MAGIC);
    unsigned version = kv_ld16(buf + KV_HDR_VERSION);
    if (version != KV_BLOCK_VERSION)
        return strata_fail(err, STRATA_EFORMAT, "unsupported block format version %u (this reader knows %u)",
                           version, KV_BLOCK_VERSION);
    unsigned n_sections = buf[KV_HDR_N_SECTIONS];
    if (n_sections < 1 || n_sections > KV_BLOCK_MAX_SECTIONS)
        return strata_fail(err, STRATA_EFORMAT, "section count %u out of range 1..%d", n_sections,
                           KV_BLOCK_MAX_SECTIONS);
    uint32_t header_bytes = kv_ld16(buf + KV_HDR_HEADER_BYTES);
    if (header_bytes != header_area_bytes(n_sections))
        return strata_fail(err, STRATA_EFORMAT, "header size %" PRIu32 " does not match %u sections (expected %" PRIu32 ")",
                           header_bytes, n_sections, header_area_bytes(n_sections));
    if (len < header_bytes)
        return strata_fail(err, STRATA_EFORMAT, "block truncated: %zu bytes, the header is %" PRIu32,
                           len, header_bytes);
    uint32_t block_bytes = kv_ld32(buf + KV_HDR_BLOCK_BYTES);
    if (block_bytes % KV_BLOCK_ALIGN || block_bytes < header_bytes)
        return strata_fail(err, STRATA_EFORMAT, "bad block size %" PRIu32 " (must be a multiple of %u and hold the header)",
                           block_bytes, KV_BLOCK_ALIGN);
    if (len < block_bytes)
        return strata_fail(err, STRATA_EFORMAT, "block truncated: %zu bytes of %" PRIu32, len, block_bytes);
    unsigned flags = kv_ld16(buf + KV_HDR_FLAGS);
    if (flags)
        return strata_fail(err, STRATA_EFORMAT, "unknown header flags 0x%04x", flags);
    if (buf[KV_HDR_RESERVED1] || !all_zero(buf + KV_HDR_RESERVED, 4))
        return strata_fail(err, STRATA_EFORMAT, "reserved header bytes are not zero");
    uint32_t table_end = KV_BLOCK_FIXED_BYTES + n_sections * KV_BLOCK_SECTION_ENTRY_BYTES;
    if (!all_zero(buf + table_end, header_bytes - table_end))
        return strata_fail(err, STRATA_EFORMAT, "header padding is not zero");

    kv_block_desc *d = &out->desc;
    d->codec = (kv_codec_id)buf[KV_HDR_CODEC];
    d->k_bits = buf[KV_HDR_K_BITS];
    d->v_bits = buf[KV_HDR_V_BITS];
    d->layer = kv_ld32(buf + KV_HDR_LAYER);
    d->n_tokens = kv_ld32(buf + KV_HDR_N_TOKENS);
    d->first_pos = kv_ld64(buf + KV_HDR_FIRST_POS);
    d->n_kv_heads = kv_ld16(buf + KV_HDR_N_KV_HEADS);
    d->head_dim = kv_ld16(buf + KV_HDR_HEAD_DIM);
    d->k_group = kv_ld16(buf + KV_HDR_K_GROUP);
    d->v_group = kv_ld16(buf + KV_HDR_V_GROUP);
    d->residual = kv_ld16(buf + KV_HDR_RESIDUAL);
    d->rank = buf[KV_HDR_RANK];
    d->k_sparse = kv_ld16(buf + KV_HDR_K_SPARSE);
    d->v_sparse = kv_ld16(buf + KV_HDR_V_SPARSE);
    d->ott_tokens = kv_ld16(buf + KV_HDR_OTT_TOKENS);
    block_layout L;
    int rc = block_layout_of(d, &L, err);
    if (rc) {
        if (err) {
            strata_error_prefix(err, "block header");
            err->code = STRATA_EFORMAT;
        }
        return STRATA_EFORMAT;
    }

    bool seen[KV_BLOCK_MAX_SECTIONS] = {false};
    uint64_t at = header_bytes;
    for (unsigned i = 0; i < n_sections; i++) {
        const uint8_t *e = buf + KV_BLOCK_FIXED_BYTES + i * KV_BLOCK_SECTION_ENTRY_BYTES;
        kv_block_section s = {kv_ld16(e), kv_ld16(e + 2), kv_ld32(e + 4), kv_ld32(e + 8)};
        if (s.flags & ~KV_SECTION_SKIPPABLE)
            return strata_fail(err, STRATA_EFORMAT, "section %u: unknown flags 0x%04x", i, (unsigned)s.flags);
        at = align_up(at, KV_BLOCK_ALIGN);
        if (s.offset != at)
            return strata_fail(err, STRATA_EFORMAT, "section %u (%s): offset %" PRIu32 ", expected %" PRIu64,
                               i, kv_section_name(s.id), s.offset, at);
        at += s.length;
        if (at > block_bytes)
            return strata_fail(err, STRATA_EFORMAT,
                               "section %u (%s): %" PRIu32 " bytes at %" PRIu32 " run past the block end %" PRIu32,
                               i, kv_section_name(s.id), s.length, s.offset, block_bytes);
        for (unsigned j = 0; j < i; j++)
            if (out->sections[j].id == s.id)
                return strata_fail(err, STRATA_EFORMAT, "section %s appears twice", kv_section_name(s.id));
        int known = -1;
        for (int j = 0; j < L.n; j++)
            if (L.spec[j].id == s.id)
                known = j;
        if (known >= 0) {
            if (s.length != L.spec[known].length)
                return strata_fail(err, STRATA_EFORMAT, "section %s: %" PRIu32 " bytes, the geometry needs %" PRIu64,
                                   kv_section_name(s.id), s.length, L.spec[known].length);
            seen[known] = true;
        } else if (!(s.flags & KV_SECTION_SKIPPABLE)) {
            return strata_fail(err, STRATA_EFORMAT, "section %s (id %u) is not supported in a %s block",
                               kv_section_name(s.id), (unsigned)s.id, kv_codec_id_name((unsigned)d->codec));
        }
        out->sections[i] = s;
    }
    for (int j = 0; j < L.n; j++)
        if (!seen[j])
            return strata_fail(err, STRATA_EFORMAT, "section %s is missing", kv_section_name(L.spec[j].id));
    if (align_up(at, KV_BLOCK_ALIGN) != block_bytes)
        return strata_fail(err, STRATA_EFORMAT, "block size %" PRIu32 " does not match its sections (%" PRIu64 ")",
                           block_bytes, align_up(at, KV_BLOCK_ALIGN));

    out->bytes = buf;
    out->version = version;
    out->header_bytes = header_bytes;
    out->block_bytes = block_bytes;
    out->payload_crc = kv_ld32(buf + KV_HDR_PAYLOAD_CRC);
    out->header_crc = kv_ld32(buf + KV_HDR_HEADER_CRC);
    out->n_sections = (int)n_sections;
    return STRATA_OK;
}

void kv_block_crcs(const kv_block *b, uint32_t *header_crc, uint32_t *payload_crc)
{
    static const uint8_t zero4[4] = {0, 0, 0, 0};
    uint32_t h = kv_crc32c(0, b->bytes, KV_HDR_HEADER_CRC);
    h = kv_crc32c(h, zero4, 4);
    h = kv_crc32c(h, b->bytes + KV_HDR_HEADER_CRC + 4, b->header_bytes - (KV_HDR_HEADER_CRC + 4));
    *header_crc = h;
    *payload_crc = kv_crc32c(0, b->bytes + b->header_bytes, b->block_bytes - b->header_bytes);
}

int kv_block_verify(const uint8_t *buf, size_t len, kv_block *out, strata_error *err)
{
    kv_block local;
    kv_block *b = out ? out : &local;
    int rc = kv_block_parse(buf, len, b, err);
    if (rc)
        return rc;
    uint32_t hc, pc;
    kv_block_crcs(b, &hc, &pc);
    if (hc != b->header_crc)
        return strata_fail(err, STRATA_ECRC, "block header CRC mismatch: stored 0x%08" PRIx32 ", computed 0x%08" PRIx32,
                           b->header_crc, hc);
    if (pc != b->payload_crc)
        return strata_fail(err, STRATA_ECRC, "block payload CRC mismatch: stored 0x%08" PRIx32 ", computed 0x%08" PRIx32,
                           b->payload_crc, pc);
    return STRATA_OK;
}

const uint8_t *kv_block_section_data(const kv_block *b, uint16_t id, uint32_t *len)
{
    for (int i = 0; i < b->n_sections; i++)
        if (b->sections[i].id == id) {
            if (len)
                *len = b->sections[i].length;
            return b->bytes + b->sections[i].offset;
        }
    if (len)
        *len = 0;
    return NULL;
}

int kv_block_decode(const kv_block *b, float *k, float *v, strata_error *err)
{
    const kv_codec_ops *ops = kv_codec_ops_for((unsigned)b->desc.codec);
    if (!ops || !b->bytes)
        return strata_fail(err, STRATA_EINVAL, "decoding a block that was not parsed");
    return ops->decode(b, k, v, err);
}

const char *kv_section_name(uint16_t id)
{
    switch (id) {
    case KV_SEC_K_CODES: return "K_CODES";
    case KV_SEC_K_SCALES: return "K_SCALES";
    case KV_SEC_V_CODES: return "V_CODES";
    case KV_SEC_V_SCALES: return "V_SCALES";
    case KV_SEC_K_FP16: return "K_FP16";
    case KV_SEC_V_FP16: return "V_FP16";
    case KV_SEC_GEAR_K_SPARSE: return "GEAR_K_SPARSE";
    case KV_SEC_GEAR_V_SPARSE: return "GEAR_V_SPARSE";
    case KV_SEC_GEAR_K_LOWRANK: return "GEAR_K_LOWRANK";
    case KV_SEC_GEAR_V_LOWRANK: return "GEAR_V_LOWRANK";
    case KV_SEC_OTT_TOKENS: return "OTT_TOKENS";
    case KV_SEC_TADA_K_MEAN: return "TADA_K_MEAN";
    case KV_SEC_TADA_V_MEAN: return "TADA_V_MEAN";
    default: return "unknown";
    }
}

const char *kv_codec_id_name(unsigned id)
{
    switch (id) {
    case KV_CODEC_FP16: return "fp16";
    case KV_CODEC_KIVI: return "kivi";
    case KV_CODEC_GEAR: return "gear";
    case KV_CODEC_OTT: return "ott";
    case KV_CODEC_TADA: return "tada";
    default: return "unknown";
    }
}

void kv_block_print(const kv_block *b, FILE *out, int indent)
{
    const kv_block_desc *d = &b->desc;
    int w = indent;
    fprintf(out, "%*sformat version %u, %" PRIu32 " bytes (header %" PRIu32 ")\n", w, "", b->version,
            b->block_bytes, b->header_bytes);
    if (d->codec == KV_CODEC_FP16)
        fprintf(out, "%*scodec %s (id %u), K %d-bit, V %d-bit\n", w, "", kv_codec_id_name((unsigned)d->codec),
                (unsigned)d->codec, d->k_bits, d->v_bits);
    else
        fprintf(out, "%*scodec %s (id %u), K %d-bit, V %d-bit, key group %d tokens, value group %d channels, residual %d\n",
                w, "", kv_codec_id_name((unsigned)d->codec), (unsigned)d->codec, d->k_bits, d->v_bits,
                d->k_group, d->v_group, d->residual);
    if (d->codec == KV_CODEC_GEAR)
        fprintf(out, "%*slow rank %d per head, outliers per key vector %d, per value vector %d\n", w, "", d->rank,
                d->k_sparse, d->v_sparse);
    if (d->codec == KV_CODEC_OTT)
        fprintf(out, "%*soutlier tokens held: %d (head, token) entries\n", w, "", d->ott_tokens);
    fprintf(out, "%*slayer %" PRIu32 ", positions %" PRIu64 "..%" PRIu64 " (%" PRIu32 " tokens), %d kv heads x %d dims\n",
            w, "", d->layer, d->first_pos, d->first_pos + d->n_tokens - 1, d->n_tokens, d->n_kv_heads,
            d->head_dim);
    fprintf(out, "%*ssections (%d):\n", w, "", b->n_sections);
    for (int i = 0; i < b->n_sections; i++) {
        const kv_block_section *s = &b->sections[i];
        fprintf(out, "%*s  %-10s id %2u  offset %8" PRIu32 "  length %8" PRIu32 "%s\n", w, "",
                kv_section_name(s->id), (unsigned)s->id, s->offset, s->length,
                (s->flags & KV_SECTION_SKIPPABLE) ? "  (skippable)" : "");
    }
}
