/* Real compressed KV blocks for the offload tests and benchmark: encoded with kv_block_encode
 * from pseudo-random fp16-representable rows, in the fp16 and KIVI codecs and several geometries,
 * so that sizes vary as they do in a server (a few KiB to a few MiB). Header-only (static inline)
 * so each test executable takes what it uses. */
#ifndef STRATA_TESTS_OFFLOAD_BLOCKS_H
#define STRATA_TESTS_OFFLOAD_BLOCKS_H

#include <stdint.h>
#include <stdlib.h>

#include "kvstore/block.h"
#include "test_rng.h"

/* One block of codec (KV_CODEC_FP16, or KV_CODEC_KIVI with bits 2 or 4), heads x dim x tokens,
 * or NULL on failure (*size 0). The caller frees it. */
static inline uint8_t *ob_make_block(kv_codec_id codec, int bits, int heads, int dim, int tokens, uint32_t layer,
                                     uint64_t seed, size_t *size)
{
    *size = 0;
    kv_codec_params p = {.codec = codec, .bits = codec == KV_CODEC_FP16 ? 16 : bits,
                         .group = codec == KV_CODEC_FP16 ? 0 : 32, .residual = codec == KV_CODEC_FP16 ? 0 : 128};
    kv_geometry g = {.n_layers = (int)layer + 1, .n_kv_heads = heads, .head_dim = dim, .block_tokens = tokens};
    kv_block_desc d;
    kv_block_desc_init(&d, &p, &g, layer, seed * (uint64_t)tokens);
    size_t n = (size_t)tokens * (size_t)heads * (size_t)dim, bytes = kv_block_bytes(&d);
    float *k = malloc(n * sizeof *k), *v = malloc(n * sizeof *v);
    uint8_t *b = bytes ? malloc(bytes) : NULL;
    if (!k || !v || !b) {
        free(k);
        free(v);
        free(b);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        k[i] = (float)((int)(rng_next(&seed) % 4096) - 2048) / 256.0f;
        v[i] = (float)((int)(rng_next(&seed) % 4096) - 2048) / 512.0f;
    }
    size_t written = 0;
    int rc = kv_block_encode(&d, k, v, b, bytes, &written, NULL);
    free(k);
    free(v);
    if (rc != STRATA_OK || written != bytes) {
        free(b);
        return NULL;
    }
    *size = bytes;
    return b;
}

/* The i-th block of a mix of codecs and geometries: 2.3 KiB to 64 KiB (index % 8), and with
 * large set, every 16th block 1 MiB (fp16, 8 heads x 128 dims x 256 tokens). */
static inline uint8_t *ob_varied_block(unsigned i, int large, size_t *size)
{
    static const struct { kv_codec_id c; int bits, heads, dim, tokens; } mix[8] = {
        {KV_CODEC_KIVI, 2, 3, 64, 64},   /* 9,344 bytes: the default model's kivi2 block */
        {KV_CODEC_KIVI, 4, 3, 64, 64},   /* 15,488 */
        {KV_CODEC_FP16, 16, 3, 64, 64},  /* 49,280 */
        {KV_CODEC_KIVI, 2, 2, 64, 32},   /* under one page */
        {KV_CODEC_KIVI, 4, 8, 128, 64},
        {KV_CODEC_FP16, 16, 1, 64, 32},
        {KV_CODEC_KIVI, 2, 8, 128, 128},
        {KV_CODEC_FP16, 16, 4, 64, 64},  /* 65,664 */
    };
    if (large && i % 16 == 15)
        return ob_make_block(KV_CODEC_FP16, 16, 8, 128, 256, i % 32, i + 1, size);
    unsigned m = i % 8;
    return ob_make_block(mix[m].c, mix[m].bits, mix[m].heads, mix[m].dim, mix[m].tokens, i % 32, i + 1, size);
}

#endif
