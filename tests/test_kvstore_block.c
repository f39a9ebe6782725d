/* The block format: a hand-checked golden block, build/parse round trips, corruption (every
 * byte flip, every truncation, every bad field), section-table rules, and the fuzz seed corpus.
 * CRCs are recomputed here bit by bit from the definition, not with the library's CRC. */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cmocka.h>

#include "kvstore/block.h"
#include "test_rng.h"

static uint32_t crc_bitwise(uint32_t crc, const uint8_t *p, size_t n)
{
    uint32_t c = ~crc;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int b = 0; b < 8; b++)
            c = (c & 1u) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
    }
    return ~c;
}

static uint32_t rd32(const uint8_t *p) { return p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }
static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static void wr32(uint8_t *p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static void wr16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }

/* Re-stamps both CRCs as docs/format.md defines them, so that a field edit must be caught by
 * validation rather than by the checksum. */
static void restamp(uint8_t *b)
{
    uint32_t hb = rd16(b + 6), bb = rd32(b + 8);
    wr32(b + 56, crc_bitwise(0, b + hb, bb - hb));
    wr32(b + 60, 0);
    wr32(b + 60, crc_bitwise(0, b, hb));
}

static kv_block_desc kivi_desc(int heads, int dim, uint32_t tokens, int kb, int vb, int group, int residual)
{
    kv_block_desc d = {0};
    d.codec = KV_CODEC_KIVI;
    d.k_bits = kb;
    d.v_bits = vb;
    d.k_group = d.v_group = group;
    d.residual = residual;
    d.layer = 3;
    d.first_pos = 128;
    d.n_tokens = tokens;
    d.n_kv_heads = heads;
    d.head_dim = dim;
    return d;
}

/* A block of codec 3-5 (bits for K and V, one group; gear rank and outliers per vector, ott entries). */
static kv_block_desc codec_desc(kv_codec_id codec, int heads, int dim, uint32_t tokens, int bits, int group, int rank,
                                int sparse, int ott)
{
    kv_block_desc d = kivi_desc(heads, dim, tokens, bits, bits, group, 0);
    d.codec = codec;
    d.rank = rank;
    d.k_sparse = d.v_sparse = sparse;
    d.ott_tokens = ott;
    return d;
}

static kv_block_desc fp16_desc(int heads, int dim, uint32_t tokens)
{
    kv_block_desc d = {0};
    d.codec = KV_CODEC_FP16;
    d.k_bits = d.v_bits = 16;
    d.layer = 1;
    d.first_pos = 0;
    d.n_tokens = tokens;
    d.n_kv_heads = heads;
    d.head_dim = dim;
    return d;
}

static void assert_desc_equal(const kv_block_desc *a, const kv_block_desc *b)
{
    assert_int_equal(a->codec, b->codec);
    assert_int_equal(a->k_bits, b->k_bits);
    assert_int_equal(a->v_bits, b->v_bits);
    assert_int_equal(a->k_group, b->k_group);
    assert_int_equal(a->v_group, b->v_group);
    assert_int_equal(a->residual, b->residual);
    assert_int_equal(a->layer, b->layer);
    assert_true(a->first_pos == b->first_pos);
    assert_int_equal(a->n_tokens, b->n_tokens);
    assert_int_equal(a->n_kv_heads, b->n_kv_heads);
    assert_int_equal(a->head_dim, b->head_dim);
    assert_int_equal(a->rank, b->rank);
    assert_int_equal(a->k_sparse, b->k_sparse);
    assert_int_equal(a->v_sparse, b->v_sparse);
    assert_int_equal(a->ott_tokens, b->ott_tokens);
}

/* Encodes random rows (fp16-rounded) into a fresh buffer of exactly the block's size. */
static uint8_t *make_block(const kv_block_desc *d, uint64_t seed, size_t *size, float **k_out, float **v_out)
{
    size_t n = (size_t)d->n_tokens * (size_t)d->n_kv_heads * (size_t)d->head_dim;
    float *k = malloc(n * sizeof(float)), *v = malloc(n * sizeof(float));
    assert_non_null(k);
    assert_non_null(v);
    for (size_t i = 0; i < n; i++) {
        k[i] = (float)(int)(rng_sym(&seed) * 2048) / 256.0f;   /* multiples of 1/256: fp16 numbers */
        v[i] = (float)(int)(rng_sym(&seed) * 2048) / 512.0f;
    }
    size_t bytes = kv_block_bytes(d);
    assert_true(bytes > 0);
    uint8_t *b = malloc(bytes);
    assert_non_null(b);
    size_t written = 0;
    strata_error err = {0};
    /* OTT seeds pool the first ott_tokens (head, token) pairs of the first tokens */
    kv_ott_entry entries[8];
    kv_block_extra extra = {entries};
    for (int i = 0; i < d->ott_tokens && i < 8; i++)
        entries[i] = (kv_ott_entry){(uint16_t)(i % d->n_kv_heads), (uint16_t)(i / d->n_kv_heads)};
    if (kv_block_encode_ex(d, k, v, &extra, b, bytes, &written, &err) != STRATA_OK)
        fail_msg("encoding: %s", err.msg);
    assert_int_equal(written, bytes);
    *size = bytes;
    if (k_out) *k_out = k; else free(k);
    if (v_out) *v_out = v; else free(v);
    return b;
}

/* 1 head, head_dim 32, 32 tokens, 2-bit, G = 32: the values and every pinned byte below are
 * derived by hand in the comments. */
static void test_golden_block(void **state)
{
    (void)state;
    float k[32 * 32] = {0}, v[32 * 32] = {0};
    for (int t = 0; t < 32; t++) {
        k[t * 32 + 0] = (float)t;                     /* 0..31 */
        k[t * 32 + 1] = -1.0f;                        /* constant */
        k[t * 32 + 2] = (t % 2) ? 0.5f : -0.5f;       /* +-0.5 */
    }
    for (int c = 0; c < 32; c++) {
        v[0 * 32 + c] = (float)c;
        v[1 * 32 + c] = (c % 4 == 3) ? 3.0f : 0.0f;
    }
    kv_block_desc d = kivi_desc(1, 32, 32, 2, 2, 32, 0);
    d.layer = 5;
    d.first_pos = 64;
    uint8_t b[896];
    size_t written = 0;
    assert_int_equal(kv_block_bytes(&d), 896);
    assert_int_equal(kv_block_encode(&d, k, v, b, sizeof b, &written, NULL), STRATA_OK);
    assert_int_equal(written, 896);

    /* fixed header: "SKVB", version 1, header 128, block 896 (0x380), codec 2, bits 2/2,
     * 4 sections, layer 5, 32 tokens, first position 64, 1 head, dim 32, groups 32/32, R 0 */
    const uint8_t hdr[56] = {
        'S', 'K', 'V', 'B', 1, 0, 128, 0, 0x80, 0x03, 0, 0, 2, 2, 2, 4,
        5, 0, 0, 0, 32, 0, 0, 0, 64, 0, 0, 0, 0, 0, 0, 0,
        1, 0, 32, 0, 32, 0, 32, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0, 0, 0, 0, 0, 0, 0, 0,
    };
    assert_memory_equal(b, hdr, sizeof hdr);
    /* section table: id, flags, offset, length: K_CODES 128+256, K_SCALES 384+128,
     * V_CODES 512+256, V_SCALES 768+128 */
    const uint8_t table[48] = {
        1, 0, 0, 0, 0x80, 0, 0, 0, 0x00, 0x01, 0, 0,
        2, 0, 0, 0, 0x80, 0x01, 0, 0, 0x80, 0, 0, 0,
        3, 0, 0, 0, 0x00, 0x02, 0, 0, 0x00, 0x01, 0, 0,
        4, 0, 0, 0, 0x00, 0x03, 0, 0, 0x80, 0, 0, 0,
    };
    assert_memory_equal(b + 64, table, sizeof table);
    for (int i = 112; i < 128; i++)
        assert_int_equal(b[i], 0);

    /* Key channel 0 holds 0..31: z = 0, s = 31/3 = 10.333 -> fp16 10.3359375 (0x492B; the
     * nearest fp16 is already >= 31/3). Codes: t <= 5 -> 0, 6..15 -> 1, 16..25 -> 2, 26..31 -> 3.
     * Word 0 (tokens 0-15) = 0x55555000, word 1 (tokens 16-31) = 0xFFFAAAAA.
     * Channel 1 is constant -1: s = 0, z = 0xBC00, codes 0.
     * Channel 2 alternates -0.5/+0.5: z = 0xB800; 1/3 rounds to 0x3555 = 0.33325 but
     * -0.5 + 3 * 0.33325 < 0.5, so the scale is rounded up to 0x3556; codes 0,3,0,3.. =
     * 0xCCCCCCCC per word. */
    const uint8_t kcodes[24] = {
        0x00, 0x50, 0x55, 0x55, 0xaa, 0xaa, 0xfa, 0xff,
        0, 0, 0, 0, 0, 0, 0, 0,
        0xcc, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc,
    };
    assert_memory_equal(b + 128, kcodes, sizeof kcodes);
    for (int i = 128 + 24; i < 384; i++)
        assert_int_equal(b[i], 0);              /* channels 3..31 are constant 0 */
    const uint8_t kscales[12] = {0x2b, 0x49, 0x00, 0x00, 0x00, 0x00, 0x00, 0xbc, 0x56, 0x35, 0x00, 0xb8};
    assert_memory_equal(b + 384, kscales, sizeof kscales);
    /* Value token 0 holds 0..31 (same words as key channel 0); token 1 is 3 at every fourth
     * channel: s = 1 (0x3C00), codes 0,0,0,3 -> byte 0xC0. */
    const uint8_t vcodes[16] = {0x00, 0x50, 0x55, 0x55, 0xaa, 0xaa, 0xfa, 0xff,
                                0xc0, 0xc0, 0xc0, 0xc0, 0xc0, 0xc0, 0xc0, 0xc0};
    assert_memory_equal(b + 512, vcodes, sizeof vcodes);
    const uint8_t vscales[8] = {0x2b, 0x49, 0x00, 0x00, 0x00, 0x3c, 0x00, 0x00};
    assert_memory_equal(b + 768, vscales, sizeof vscales);

    assert_int_equal(rd32(b + 56), crc_bitwise(0, b + 128, 896 - 128));
    assert_int_equal(rd32(b + 56), 0x075ceddeu);   /* pinned, as in docs/format.md */
    assert_int_equal(rd32(b + 60), 0x68d17bffu);
    uint8_t h[128];
    memcpy(h, b, 128);
    wr32(h + 60, 0);
    assert_int_equal(rd32(b + 60), crc_bitwise(0, h, 128));

    kv_block pb;
    strata_error err = {0};
    assert_int_equal(kv_block_verify(b, sizeof b, &pb, &err), STRATA_OK);
    float kd[32 * 32], vd[32 * 32];
    assert_int_equal(kv_block_decode(&pb, kd, vd, &err), STRATA_OK);
    /* token 1 of channel 2 has code 3: -0.5 + 3 * 0.333496 = 0.500488 */
    assert_true(kd[1] == -1.0f && fabs(kd[32 + 2] - 0.50048828) < 1e-7 && vd[32 + 3] == 3.0f && vd[0] == 0.0f);
}

static void test_round_trip_fields(void **state)
{
    (void)state;
    kv_block_desc descs[] = {
        kivi_desc(3, 64, 64, 2, 2, 32, 128),
        kivi_desc(3, 64, 64, 4, 4, 32, 128),
        kivi_desc(2, 32, 128, 4, 2, 16, 32),   /* mixed bits, G 16 */
        kivi_desc(5, 96, 32, 2, 4, 32, 0),
        fp16_desc(3, 64, 64),
        fp16_desc(2, 8, 3),                    /* a partial (tail) block */
    };
    for (size_t i = 0; i < sizeof descs / sizeof descs[0]; i++) {
        descs[i].layer = 7 + (uint32_t)i;
        descs[i].first_pos = 0x1234567890ull + i;
        size_t size;
        uint8_t *b = make_block(&descs[i], i, &size, NULL, NULL);
        kv_block pb;
        strata_error err = {0};
        assert_int_equal(kv_block_verify(b, size, &pb, &err), STRATA_OK);
        assert_desc_equal(&pb.desc, &descs[i]);
        assert_int_equal(pb.block_bytes, size);
        assert_int_equal(pb.version, 1);
        assert_int_equal(size % 64, 0);
        for (int s = 0; s < pb.n_sections; s++)
            assert_int_equal(pb.sections[s].offset % 64, 0);
        /* a longer buffer (a pool slot, a file) parses to the same block */
        uint8_t *big = calloc(1, size + 100);
        assert_non_null(big);
        memcpy(big, b, size);
        assert_int_equal(kv_block_verify(big, size + 100, NULL, &err), STRATA_OK);
        free(big);
        free(b);
    }
}

static void test_default_geometry_sizes(void **state)
{
    (void)state;
    kv_geometry g = {30, 3, 64, 64};
    kv_codec_params fp16 = {.codec = KV_CODEC_FP16, .bits = 16}, k2 = {.codec = KV_CODEC_KIVI, .bits = 2, .group = 32, .residual = 128},
                    k4 = {.codec = KV_CODEC_KIVI, .bits = 4, .group = 32, .residual = 128};
    /* payloads: fp16 2 * 64*3*64*2 = 49152; kivi2 codes 2*3072 + scales 2*1536 = 9216;
     * kivi4 codes 2*6144 + scales 2*1536 = 15360; each plus the 128-byte header area */
    assert_int_equal(kv_block_size(&fp16, &g), 49152 + 128);
    assert_int_equal(kv_block_size(&k2, &g), 9216 + 128);
    assert_int_equal(kv_block_size(&k4, &g), 15360 + 128);
    assert_true((double)kv_block_size(&k2, &g) <= 0.2 * (double)kv_block_size(&fp16, &g));
    printf("  3 heads x 64 dims x 64 tokens: fp16 %zu, kivi4 %zu, kivi2 %zu bytes (kivi2/fp16 = %.4f)\n",
           kv_block_size(&fp16, &g), kv_block_size(&k4, &g), kv_block_size(&k2, &g),
           (double)kv_block_size(&k2, &g) / (double)kv_block_size(&fp16, &g));
}

/* Every byte of a block, changed in several ways, must make verify fail; parse alone may pass
 * (a changed code is still a well-formed block) but then the CRC must catch it. */
static void check_all_flips(uint8_t *b, size_t size, const uint8_t *xors, int n_xors)
{
    for (size_t i = 0; i < size; i++)
        for (int x = 0; x < n_xors; x++) {
            b[i] ^= xors[x];
            strata_error err = {0};
            int rc = kv_block_verify(b, size, NULL, &err);
            if (rc != STRATA_ECRC && rc != STRATA_EFORMAT)
                fail_msg("flip of byte %zu by 0x%02x not detected (rc %d)", i, xors[x], rc);
            assert_int_equal(err.code, rc);
            assert_true(err.msg[0] != 0);
            b[i] ^= xors[x];
        }
    assert_int_equal(kv_block_verify(b, size, NULL, NULL), STRATA_OK);
}

static void test_every_byte_flip_detected(void **state)
{
    (void)state;
    const uint8_t all[] = {0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0xff, 0x5a};
    const uint8_t some[] = {0x01, 0x80, 0xff};
    size_t size;
    kv_block_desc small = kivi_desc(1, 32, 32, 2, 2, 32, 0);
    uint8_t *b = make_block(&small, 1, &size, NULL, NULL);
    check_all_flips(b, size, all, 10);
    free(b);
    kv_block_desc small16 = fp16_desc(1, 16, 5);
    b = make_block(&small16, 2, &size, NULL, NULL);
    check_all_flips(b, size, all, 10);
    free(b);
    kv_block_desc full = kivi_desc(3, 64, 64, 2, 2, 32, 128);
    b = make_block(&full, 3, &size, NULL, NULL);
    check_all_flips(b, size, some, 3);
    free(b);
    kv_block_desc full4 = kivi_desc(3, 64, 64, 4, 4, 32, 128);
    b = make_block(&full4, 4, &size, NULL, NULL);
    check_all_flips(b, size, some, 1);
    free(b);
}

static void test_every_truncation_rejected(void **state)
{
    (void)state;
    kv_block_desc descs[] = {kivi_desc(3, 64, 64, 2, 2, 32, 128), fp16_desc(1, 16, 5)};
    for (int k = 0; k < 2; k++) {
        size_t size;
        uint8_t *b = make_block(&descs[k], 9, &size, NULL, NULL);
        for (size_t len = 0; len < size; len++) {
            uint8_t *t = malloc(len ? len : 1);   /* exact size so ASan sees any over-read */
            assert_non_null(t);
            memcpy(t, b, len);
            kv_block pb;
            strata_error err = {0};
            assert_int_equal(kv_block_parse(t, len, &pb, &err), STRATA_EFORMAT);
            assert_non_null(strstr(err.msg, "truncated"));
            free(t);
        }
        free(b);
    }
}

typedef struct field_edit {
    const char *what;
    size_t offset;
    int width;        /* 1, 2 or 4 bytes */
    uint32_t value;
    const char *expect;   /* substring of the message */
    size_t offset2;       /* optional second 4-byte write (0: none) */
    uint32_t value2;
} field_edit;

static void test_bad_fields_rejected(void **state)
{
    (void)state;
    const field_edit edits[] = {
        {"magic", 0, 4, 0x42564b54u, "magic", 0, 0},
        {"version 2", 4, 2, 2, "version", 0, 0},
        {"version 0", 4, 2, 0, "version", 0, 0},
        {"header size", 6, 2, 192, "header size", 0, 0},
        {"block size not aligned", 8, 4, 9344 - 32, "block size", 0, 0},
        {"block size larger", 8, 4, 9344 + 64, "truncated", 0, 0},
        {"block size smaller", 8, 4, 9344 - 64, "past the block end", 0, 0},
        {"codec 0", 12, 1, 0, "codec", 0, 0},
        {"codec 9", 12, 1, 9, "codec", 0, 0},
        {"codec fp16", 12, 1, 1, "fp16", 0, 0},
        {"k bits 3", 13, 1, 3, "bits", 0, 0},
        {"k bits 16", 13, 1, 16, "bits", 0, 0},
        {"v bits 8", 14, 1, 8, "bits", 0, 0},
        {"v bits 4", 14, 1, 4, "V_CODES", 0, 0},
        {"sections 0", 15, 1, 0, "section count", 0, 0},
        {"sections 17", 15, 1, 17, "section count", 0, 0},
        {"sections 3", 15, 1, 3, "padding", 0, 0},
        {"sections 3, last entry cleared", 15, 1, 3, "missing", 64 + 36, 0},
        {"tokens 0", 20, 4, 0, "token count", 0, 0},
        {"tokens 96", 20, 4, 96, "K_CODES", 0, 0},
        {"tokens 48", 20, 4, 48, "key group", 0, 0},
        {"heads 0", 32, 2, 0, "n_kv_heads", 0, 0},
        {"heads 4", 32, 2, 4, "K_CODES", 0, 0},
        {"head_dim 0", 34, 2, 0, "head_dim", 0, 0},
        {"head_dim 48", 34, 2, 48, "value group", 0, 0},
        {"key group 0", 36, 2, 0, "key group", 0, 0},
        {"key group 24", 36, 2, 24, "key group", 0, 0},
        {"key group 16", 36, 2, 16, "K_SCALES", 0, 0},
        {"value group 5", 38, 2, 5, "value group", 0, 0},
        {"residual 100", 40, 2, 100, "residual", 0, 0},
        {"flags", 42, 2, 1, "flags", 0, 0},
        {"reserved", 53, 1, 1, "reserved", 0, 0},
        {"reserved byte 45", 45, 1, 1, "reserved", 0, 0},
        {"first position overflow", 24, 4, 0xffffffffu, NULL, 0, 0},   /* with byte 28.. below */
        {"section id", 64, 2, 7, "not supported", 0, 0},
        {"section id duplicate", 64 + 12, 2, 1, "twice", 0, 0},
        {"section reserved id", 64 + 36, 2, 20, "OTT", 0, 0},
        {"section flags", 66, 2, 2, "flags", 0, 0},
        {"section offset", 68, 4, 192, "offset", 0, 0},
        {"section offset unaligned", 68, 4, 129, "offset", 0, 0},
        {"section length", 72, 4, 3072 + 64, "K_CODES", 0, 0},
        {"section length huge", 72, 4, 0xfffffff0u, "past the block end", 0, 0},
        {"last section length", 64 + 36 + 8, 4, 1536 - 64, "V_SCALES", 0, 0},
        {"header padding", 120, 1, 1, "padding", 0, 0},
    };
    kv_block_desc d = kivi_desc(3, 64, 64, 2, 2, 32, 128);
    size_t size;
    uint8_t *orig = make_block(&d, 5, &size, NULL, NULL);
    assert_int_equal(size, 9344);
    for (size_t e = 0; e < sizeof edits / sizeof edits[0]; e++) {
        uint8_t *b = malloc(size);
        assert_non_null(b);
        memcpy(b, orig, size);
        if (edits[e].width == 1)
            b[edits[e].offset] = (uint8_t)edits[e].value;
        else if (edits[e].width == 2)
            wr16(b + edits[e].offset, (uint16_t)edits[e].value);
        else
            wr32(b + edits[e].offset, edits[e].value);
        if (edits[e].offset2) {
            wr32(b + edits[e].offset2, edits[e].value2);
            wr32(b + edits[e].offset2 + 4, 0);
            wr32(b + edits[e].offset2 + 8, 0);
        }
        if (edits[e].expect == NULL)
            wr32(b + 28, 0xffffffffu);
        if (rd16(b + 6) == 128 && rd32(b + 8) <= size && rd32(b + 8) >= 128)
            restamp(b);
        strata_error err = {0};
        kv_block pb;
        int rc = kv_block_parse(b, size, &pb, &err);
        if (rc != STRATA_EFORMAT)
            fail_msg("%s: parse gave %d, expected EFORMAT", edits[e].what, rc);
        if (edits[e].expect && !strstr(err.msg, edits[e].expect))
            fail_msg("%s: message \"%s\" lacks \"%s\"", edits[e].what, err.msg, edits[e].expect);
        assert_int_equal(kv_block_verify(b, size, NULL, NULL), STRATA_EFORMAT);
        free(b);
    }
    /* a block of a later format version is refused even with valid CRCs */
    free(orig);
}

/* Appends one extra section entry (fp16 block: 2 -> 3 entries still fit the 128-byte header). */
static uint8_t *with_extra_section(uint16_t id, uint16_t flags, size_t *size_io)
{
    kv_block_desc d = fp16_desc(1, 16, 4);
    size_t size;
    uint8_t *b = make_block(&d, 11, &size, NULL, NULL);
    uint8_t *g = calloc(1, size + 64);
    assert_non_null(g);
    memcpy(g, b, size);
    free(b);
    uint8_t *e = g + 64 + 2 * 12;
    wr16(e, id);
    wr16(e + 2, flags);
    wr32(e + 4, (uint32_t)size);
    wr32(e + 8, 40);
    for (int i = 0; i < 40; i++)
        g[size + (size_t)i] = (uint8_t)(i * 7);
    g[15] = 3;
    wr32(g + 8, (uint32_t)size + 64);
    restamp(g);
    *size_io = size + 64;
    return g;
}

static void test_section_rules(void **state)
{
    (void)state;
    size_t size;
    strata_error err = {0};
    kv_block pb;
    uint8_t *g = with_extra_section(99, KV_SECTION_SKIPPABLE, &size);
    assert_int_equal(kv_block_verify(g, size, &pb, &err), STRATA_OK);
    assert_int_equal(pb.n_sections, 3);
    float k[64], v[64];
    assert_int_equal(kv_block_decode(&pb, k, v, &err), STRATA_OK);
    uint32_t len;
    assert_non_null(kv_block_section_data(&pb, 99, &len));
    assert_int_equal(len, 40);
    free(g);

    g = with_extra_section(99, 0, &size);
    assert_int_equal(kv_block_parse(g, size, &pb, &err), STRATA_EFORMAT);
    assert_non_null(strstr(err.msg, "not supported"));
    free(g);

    g = with_extra_section(KV_SEC_GEAR_K_SPARSE, 0, &size);
    assert_int_equal(kv_block_parse(g, size, &pb, &err), STRATA_EFORMAT);
    assert_non_null(strstr(err.msg, "GEAR_K_SPARSE"));
    free(g);

    g = with_extra_section(KV_SEC_K_CODES, 0, &size);   /* a KIVI section in an fp16 block */
    assert_int_equal(kv_block_parse(g, size, &pb, &err), STRATA_EFORMAT);
    free(g);
}

static void test_decode_matches_input(void **state)
{
    (void)state;
    kv_block_desc descs[] = {kivi_desc(3, 64, 64, 4, 2, 32, 128), fp16_desc(3, 64, 7)};
    for (int i = 0; i < 2; i++) {
        size_t size;
        float *k, *v;
        uint8_t *b = make_block(&descs[i], 21, &size, &k, &v);
        kv_block pb;
        assert_int_equal(kv_block_parse(b, size, &pb, NULL), STRATA_OK);
        size_t n = (size_t)descs[i].n_tokens * 3 * 64;
        float *kd = malloc(n * sizeof(float)), *vd = malloc(n * sizeof(float));
        assert_int_equal(kv_block_decode(&pb, kd, vd, NULL), STRATA_OK);
        /* inputs lie in [-8, 8] (K) and [-4, 4] (V): a 4-bit key step is at most 16/15 and a
         * 2-bit value step at most 8/3 (plus one fp16 step of rounding up) */
        double kmax = 0, vmax = 0;
        for (size_t j = 0; j < n; j++) {
            kmax = fmax(kmax, fabs((double)kd[j] - k[j]));
            vmax = fmax(vmax, fabs((double)vd[j] - v[j]));
        }
        if (i == 1) {
            assert_true(kmax == 0 && vmax == 0);
        } else {
            assert_true(kmax <= 16.0 / 15 / 2 * 1.001);
            assert_true(vmax <= 8.0 / 3 / 2 * 1.001);
        }
        free(k); free(v); free(kd); free(vd); free(b);
    }
}

/* The committed seeds for tests/fuzz/fuzz_block must stay valid blocks of the current format;
 * STRATA_REGEN_FUZZ_SEEDS=1 rewrites them. */
static void test_fuzz_seed_corpus(void **state)
{
    (void)state;
    struct { const char *name; kv_block_desc d; } seeds[] = {
        {"kivi2_1x32x32", kivi_desc(1, 32, 32, 2, 2, 32, 0)},
        {"kivi4_2x32x32", kivi_desc(2, 32, 32, 4, 4, 32, 32)},
        {"kivi_k4v2_1x32x64_g16", kivi_desc(1, 32, 64, 4, 2, 16, 64)},
        {"fp16_2x8x4", fp16_desc(2, 8, 4)},
        {"fp16_tail_1x8x3", fp16_desc(1, 8, 3)},
        {"gear2_1x32x32_r2_s2", codec_desc(KV_CODEC_GEAR, 1, 32, 32, 2, 32, 2, 2, 0)},
        {"gearl4_2x32x32_r4", codec_desc(KV_CODEC_GEAR, 2, 32, 32, 4, 32, 4, 0, 0)},
        {"ott2_2x32x32_3entries", codec_desc(KV_CODEC_OTT, 2, 32, 32, 2, 32, 0, 0, 3)},
        {"tada4_3x32x32", codec_desc(KV_CODEC_TADA, 3, 32, 32, 4, 32, 0, 0, 0)},
        {"tada8_2x16x32_g16", codec_desc(KV_CODEC_TADA, 2, 16, 32, 8, 16, 0, 0, 0)},
    };
    const char *dir = STRATA_SOURCE_DIR "/tests/fuzz/corpus/fuzz_block";
    const char *regen = getenv("STRATA_REGEN_FUZZ_SEEDS");
    for (size_t i = 0; i < sizeof seeds / sizeof seeds[0]; i++) {
        char path[512];
        snprintf(path, sizeof path, "%s/%s.blk", dir, seeds[i].name);
        if (regen && regen[0] == '1') {
            size_t size;
            uint8_t *b = make_block(&seeds[i].d, 100 + i, &size, NULL, NULL);
            mkdir(dir, 0755);
            FILE *f = fopen(path, "wb");
            assert_non_null(f);
            assert_int_equal(fwrite(b, 1, size, f), size);
            assert_int_equal(fclose(f), 0);
            free(b);
        }
        FILE *f = fopen(path, "rb");
        if (!f)
            fail_msg("missing fuzz seed %s (%s); run with STRATA_REGEN_FUZZ_SEEDS=1", path, strerror(errno));
        static uint8_t buf[65536];
        size_t n = fread(buf, 1, sizeof buf, f);
        fclose(f);
        kv_block pb;
        strata_error err = {0};
        if (kv_block_verify(buf, n, &pb, &err) != STRATA_OK)
            fail_msg("fuzz seed %s no longer verifies: %s", path, err.msg);
        assert_int_equal(pb.block_bytes, n);
        assert_desc_equal(&pb.desc, &seeds[i].d);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_golden_block),
        cmocka_unit_test(test_round_trip_fields),
        cmocka_unit_test(test_default_geometry_sizes),
        cmocka_unit_test(test_every_byte_flip_detected),
        cmocka_unit_test(test_every_truncation_rejected),
        cmocka_unit_test(test_bad_fields_rejected),
        cmocka_unit_test(test_section_rules),
        cmocka_unit_test(test_decode_matches_input),
        cmocka_unit_test(test_fuzz_seed_corpus),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
