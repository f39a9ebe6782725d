/* Writes the seed corpus of fuzz_seq_image: migration images (kv_seq_export) of small sequences
 * of the geometries and codecs that target builds pools for. A development tool, not part of
 * the build; regenerate after a format change with
 *   cc -std=c11 -I. tests/fuzz/make_seq_image_seeds.c build/kvstore/libstrata_kvstore.a -lm -o /tmp/seeds
 *   /tmp/seeds tests/fuzz/corpus/fuzz_seq_image */
#include <stdio.h>
#include <stdlib.h>

#include "kvstore/kv_cache.h"

static int write_seed(const char *dir, const char *codec, int layers, int heads, int dim, int bt, size_t prompt,
                      size_t decode)
{
    kv_codec_params p;
    strata_error err = {0};
    const kv_geometry g = {layers, heads, dim, bt};
    if (kv_codec_parse(codec, &p, &err) || kv_codec_validate(&p, &g, &err)) {
        fprintf(stderr, "%s: %s\n", codec, err.msg);
        return 1;
    }
    kv_pool *pool = kv_pool_create(&g, &p, (size_t)layers * 12, &err);
    kv_seq *s = pool ? kv_seq_create(pool, 160, &err) : NULL;
    const size_t row = (size_t)heads * (size_t)dim, n = prompt + decode;
    float *k = malloc(n * row * sizeof *k), *v = malloc(n * row * sizeof *v);
    if (!s || !k || !v) {
        fprintf(stderr, "%s: %s\n", codec, err.msg);
        return 1;
    }
    uint32_t x = 12345u;
    for (size_t i = 0; i < n * row; i++) {
        x = x * 1664525u + 1013904223u;
        k[i] = (float)((int)(x >> 20) - 2048) / 512.0f;
        v[i] = (float)((int)((x >> 8) & 4095) - 2048) / 1024.0f;
    }
    for (int l = 0; l < layers; l++) {
        if (kv_seq_append(s, l, k, v, prompt, &err))
            return 1;
        for (size_t t = prompt; t < n; t++)
            if (kv_seq_append(s, l, k + t * row, v + t * row, 1, &err))
                return 1;
    }
    uint8_t *img = NULL;
    size_t len = 0;
    if (kv_seq_export(s, &img, &len, &err)) {
        fprintf(stderr, "%s: %s\n", codec, err.msg);
        return 1;
    }
    char path[512];
    snprintf(path, sizeof path, "%s/%s_%dx%dx%d_bt%d_%zu.img", dir, codec, layers, heads, dim, bt, n);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(img, 1, len, f) != len || fclose(f)) {
        perror(path);
        return 1;
    }
    free(img);
    free(k);
    free(v);
    kv_seq_destroy(s);
    kv_pool_destroy(pool);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
        return 2;
    }
    int bad = 0;
    bad |= write_seed(argv[1], "fp16", 2, 2, 16, 16, 40, 5);
    bad |= write_seed(argv[1], "kivi2-g16-r16", 2, 2, 32, 16, 50, 9);
    bad |= write_seed(argv[1], "kivi4-g16-r16", 1, 4, 16, 32, 70, 3);
    bad |= write_seed(argv[1], "gear2-g16-r16", 2, 1, 32, 16, 60, 20);
    bad |= write_seed(argv[1], "ott2-g16-r16", 3, 2, 16, 16, 45, 30);
    bad |= write_seed(argv[1], "tada4-g16-r16", 2, 2, 16, 32, 80, 2);
    return bad;
}
