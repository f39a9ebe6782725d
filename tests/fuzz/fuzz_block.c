/* Fuzz target for the block parser: any bytes either fail to parse with a status or parse into
 * a block whose every section is in bounds; a parsed block then goes through CRC verification,
 * the codec's dequantization and the attention kernels (a one-block view: decode, and two rows of
 * a prompt chunk), which must all stay inside the buffer whatever the codes, scales and CRCs
 * hold. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kv_attention.h"
#include "kvstore/block.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kv_block b;
    strata_error err;
    if (kv_block_parse(data, size, &b, &err) != STRATA_OK)
        return 0;
    (void)kv_block_verify(data, size, NULL, &err);

    const kv_block_desc *d = &b.desc;
    size_t elems = (size_t)d->n_tokens * (size_t)d->n_kv_heads * (size_t)d->head_dim;
    float *k = malloc(elems * sizeof(float)), *v = malloc(elems * sizeof(float));
    if (k && v)
        (void)kv_block_decode(&b, k, v, &err);
    free(k);
    free(v);

    if (d->first_pos != 0 || d->layer > INT32_MAX || d->n_tokens > INT32_MAX)
        return 0;
    const uint8_t *blocks[1] = {data};
    kv_layer_view view = {
        .layer = (int)d->layer,
        .n_kv_heads = d->n_kv_heads,
        .head_dim = d->head_dim,
        .block_tokens = (int)d->n_tokens,
        .n_blocks = 1,
        .blocks = blocks,
        .block_bytes = size,
    };
    int n_q = d->n_kv_heads;
    float *q = calloc((size_t)n_q * (size_t)d->head_dim, sizeof(float));
    float *out = malloc((size_t)n_q * (size_t)d->head_dim * sizeof(float));
    size_t scratch_bytes = kern_kv_attention_scratch(&view, n_q);
    void *scratch = scratch_bytes < ((size_t)1 << 30) ? aligned_alloc(64, (scratch_bytes + 63) / 64 * 64) : NULL;
    if (q && out && scratch) {
        for (size_t i = 0; i < (size_t)n_q * (size_t)d->head_dim; i++)
            q[i] = (float)(i % 7) - 3.0f;
        (void)kern_kv_attention(&view, q, n_q, out, scratch, &err);
    }
    free(q);
    free(out);
    free(scratch);

    /* The prompt-chunk kernel, which decodes the block instead: two rows, the first seeing all
     * but the block's last position. */
    const size_t rows = 2, positions = (size_t)d->n_tokens;
    if (positions < 2)
        return 0;
    q = calloc(rows * (size_t)n_q * (size_t)d->head_dim, sizeof(float));
    out = malloc(rows * (size_t)n_q * (size_t)d->head_dim * sizeof(float));
    scratch_bytes = kern_kv_attention_rows_scratch(&view, n_q, rows);
    scratch = scratch_bytes < ((size_t)1 << 30) ? aligned_alloc(64, (scratch_bytes + 63) / 64 * 64) : NULL;
    if (q && out && scratch) {
        for (size_t i = 0; i < rows * (size_t)n_q * (size_t)d->head_dim; i++)
            q[i] = (float)(i % 5) - 2.0f;
        (void)kern_kv_attention_rows(&view, q, rows, n_q, positions - 1, out, scratch, &err);
    }
    free(q);
    free(out);
    free(scratch);
    return 0;
}
