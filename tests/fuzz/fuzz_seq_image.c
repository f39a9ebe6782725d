/* Fuzz target for the sequence image reader (kvstore/seq_image.c through kv_seq_import), what a
 * worker runs on the bytes of a migration: any bytes are refused with a status or become a
 * sequence; an imported sequence exports to the same bytes, then takes one more token and
 * attends over its layers, all inside its buffers. Pools are made for the geometry the image's
 * header claims (bounded), with each of a few codecs, and each input is also tried with its image
 * CRC recomputed, so mutated images get past the header and the CRC.
 * Seeds: tests/fuzz/make_seq_image_seeds.c. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kv_attention.h"
#include "kvstore/bytes.h"
#include "kvstore/crc32c.h"
#include "kvstore/kv_cache.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void exercise(kv_seq *s, const kv_geometry *g, const uint8_t *data, size_t size)
{
    strata_error err;
    uint8_t *img = NULL;
    size_t len = 0;
    if (kv_seq_export(s, &img, &len, &err) == STRATA_OK && (len != size || memcmp(img, data, size) != 0))
        abort();   /* an accepted image must come back as the same bytes */
    free(img);
    const size_t row = (size_t)g->n_kv_heads * (size_t)g->head_dim;
    float *k = calloc(row, sizeof(float)), *v = calloc(row, sizeof(float));
    float *q = calloc(row * 2, sizeof(float)), *out = malloc(row * 2 * sizeof(float));
    for (int l = 0; k && v && q && out && l < g->n_layers; l++) {
        for (size_t i = 0; i < row; i++)
            k[i] = v[i] = (float)(i % 3) - 1.0f;
        if (kv_seq_append(s, l, k, v, 1, &err) != STRATA_OK)
            break;
        kv_layer_view view;
        kv_seq_layer_view(s, l, &view);
        const size_t bytes = kern_kv_attention_scratch(&view, g->n_kv_heads);
        void *scratch = bytes < ((size_t)1 << 28) ? aligned_alloc(64, (bytes + 63) / 64 * 64) : NULL;
        if (scratch)
            (void)kern_kv_attention(&view, q, g->n_kv_heads, out, scratch, &err);
        free(scratch);
    }
    free(k);
    free(v);
    free(q);
    free(out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 24)
        return 0;
    const kv_geometry g = {.n_layers = (int)kv_ld32(data + 8), .n_kv_heads = (int)kv_ld32(data + 12),
                           .head_dim = (int)kv_ld32(data + 16), .block_tokens = (int)kv_ld32(data + 20)};
    if (g.n_layers < 1 || g.n_layers > 4 || g.n_kv_heads < 1 || g.n_kv_heads > 4 ||
        (g.head_dim != 16 && g.head_dim != 32) || (g.block_tokens != 16 && g.block_tokens != 32))
        return 0;
    /* The image CRC would stop almost every mutation at the door: the bytes are also tried with
     * it made right, so that the structure behind it is what gets fuzzed. */
    uint8_t *fixed = malloc(size);
    if (!fixed)
        return 0;
    memcpy(fixed, data, size);
    kv_st32(fixed + size - 4, kv_crc32c(0, fixed, size - 4));
    static const char *const codecs[] = {"fp16", "kivi2-g16-r16", "kivi4-g16-r16", "gear2-g16-r16", "ott2-g16-r16",
                                         "tada4-g16-r16"};
    for (size_t c = 0; c < sizeof codecs / sizeof codecs[0]; c++) {
        kv_codec_params p;
        strata_error err;
        if (kv_codec_parse(codecs[c], &p, &err) != STRATA_OK || kv_codec_validate(&p, &g, &err) != STRATA_OK)
            continue;
        kv_pool *pool = kv_pool_create(&g, &p, (size_t)g.n_layers * 12, &err);
        if (!pool)
            continue;
        for (int pass = 0; pass < 2; pass++) {
            const uint8_t *img = pass ? fixed : data;
            kv_seq *s = kv_seq_import(pool, 160, img, size, &err);
            if (s) {
                exercise(s, &g, img, size);
                kv_seq_destroy(s);
            }
        }
        kv_pool_destroy(pool);
    }
    free(fixed);
    return 0;
}
