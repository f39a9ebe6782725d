/* cuda_kv_encode_blocks (kernels/cuda/kv_encode.cu) against the CPU writer kv_block_encode: the
 * same fp16 rows must give the same block, byte for byte (header, section table, codes, scales,
 * padding, both CRCs), for fp16, KIVI at 2 and 4 bits, other group sizes, TaDA at 2, 4 and 8 bits, GEAR,
 * OTT (consecutive blocks through one device tracker against the CPU tracker, pools of 0 to 64
 * tokens, one small enough that tracing stops), SmolLM2's and
 * Llama-3-8B's KV shapes, and inputs that exercise the quantizer's edges (constant groups,
 * subnormals, the largest fp16 numbers, a NaN, an infinity). Slots are poisoned (0xA5) first.
 * The kernel's phases (kernels/cuda/kv_encode_block.h) also run emulated on the CPU against the
 * same writer, so its arithmetic is checked in CI; without a CUDA device only those host-side
 * checks run, then the test exits 77 (skipped). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "cuda_test_util.h"
#include "kernels/cuda/kv_encode_block.h"
#include "kernels/cuda_kv_encode.h"
#include "kvstore/block.h"
#include "kvstore/half.h"
#include "kvstore/kv_cache.h"
#include "kvstore/ott.h"

static uint64_t seed = 0xe17c0de;

/* Random fp16 rows [T][H][D]; kind picks the edge cases mixed in. */
static void fill_rows(uint16_t *x, size_t T, size_t H, size_t D, int kind)
{
    for (size_t t = 0; t < T; t++)
        for (size_t h = 0; h < H; h++)
            for (size_t c = 0; c < D; c++) {
                const size_t i = (t * H + h) * D + c;
                float f = 3.0f * cuda_test_uniform(&seed) + (float)(c % 3);
                if (kind >= 1 && c % 11 == 0)
                    f = 1.5f;                                        /* constant key channels */
                if (kind >= 1 && t % 9 == 0 && c < D / 2)
                    f = -0.25f;                                      /* constant value groups */
                if (kind >= 2 && c % 13 == 1)
                    f = 6e-6f * cuda_test_uniform(&seed);            /* subnormal halves */
                if (kind >= 2 && c % 17 == 2)
                    f = (t % 2 ? 65504.0f : -65504.0f) * cuda_test_uniform(&seed);
                x[i] = strata_float_to_half(f);
            }
    if (kind >= 3) {
        x[(1 * H + 0) * D + 3] = 0x7e00u;   /* NaN */
        x[(2 * H + H - 1) * D + 5] = 0x7c00u; /* +inf */
    }
}

static void test_encoder_header(void **state)
{
    (void)state;
    kv_codec_params p;
    strata_error err = {0};
    assert_int_equal(kv_codec_parse("kivi2", &p, &err), STRATA_OK);
    const kv_geometry g = {.n_layers = 2, .n_kv_heads = 8, .head_dim = 128, .block_tokens = 64};
    cuda_kv_encoder enc;
    assert_int_equal(cuda_kv_encoder_init(&p, &g, &enc, &err), STRATA_OK);
    kv_block_desc d;
    kv_block_desc_init(&d, &p, &g, 1, 640);
    const size_t bytes = kv_block_bytes(&d), n = 64 * 8 * 128;
    assert_int_equal(enc.layout.block_bytes, bytes);
    float *zeros = calloc(n, sizeof *zeros);
    uint8_t *block = malloc(bytes);
    assert_true(zeros && block);
    assert_int_equal(kv_block_encode(&d, zeros, zeros, block, bytes, NULL, &err), STRATA_OK);
    /* Everything but layer, first position and the CRCs is shared by the pool's blocks. */
    memset(block + KV_HDR_LAYER, 0, 4);
    memset(block + KV_HDR_FIRST_POS, 0, 8);
    memset(block + KV_HDR_PAYLOAD_CRC, 0, 8);
    assert_int_equal(enc.header_bytes, 128);
    assert_memory_equal(enc.header, block, enc.header_bytes);
    free(zeros);
    free(block);

    /* OTT: the header template checked at init against the CPU's for 1 and the most entries; a
     * pool of 0 is a KIVI block under the OTT id, with no tracker. */
    assert_int_equal(kv_codec_parse("ott2", &p, &err), STRATA_OK);
    assert_int_equal(cuda_kv_encoder_init(&p, &g, &enc, &err), STRATA_OK);
    assert_int_equal(enc.ott, 1);
    assert_true(enc.slot_bytes > enc.layout.block_bytes && enc.ott_state_bytes > 0 && enc.work_bytes > 0);
    assert_int_equal(kv_codec_parse("ott2-n0", &p, &err), STRATA_OK);
    assert_int_equal(cuda_kv_encoder_init(&p, &g, &enc, &err), STRATA_OK);
    assert_int_equal(enc.ott, 0);
    assert_int_equal(cuda_kv_encode_blocks(NULL, NULL, 1, NULL, &err), STRATA_EINVAL);
}

/* The kernel's phases on the CPU, thread after thread, phase after phase (what the barriers
 * guarantee on the GPU). jobs point at host memory here. */
static void encode_emulated(const cuda_kv_encoder *enc, const cuda_kv_encode_job *jobs, int n_jobs, unsigned nthreads)
{
    uint32_t table[256], *piece = malloc(nthreads * sizeof *piece);
    assert_non_null(piece);
    for (uint32_t i = 0; i < 256; i++)
        table[i] = kv_crc32c_table_entry(i);
    for (int b = 0; b < n_jobs; b++) {
        for (unsigned t = 0; t < nthreads; t++)
            kv_enc_zero(enc, jobs[b].dst, t, nthreads);
        for (unsigned t = 0; t < nthreads; t++) {
            kv_enc_header(enc, &jobs[b], jobs[b].dst, t, nthreads);
            kv_enc_means(enc, &jobs[b], jobs[b].dst, t, nthreads);
            kv_enc_gear_select(enc, &jobs[b], t, nthreads);
            kv_enc_ott_select(enc, &jobs[b], t, nthreads);
        }
        for (unsigned t = 0; t < nthreads; t++)
            kv_enc_ott_fill(enc, &jobs[b], jobs[b].dst, t, nthreads);
        for (unsigned t = 0; t < nthreads; t++) {
            kv_enc_sections(enc, &jobs[b], jobs[b].dst, t, nthreads);
            kv_enc_gear_sparse(enc, &jobs[b], jobs[b].dst, t, nthreads);
            kv_enc_ott_rows(enc, &jobs[b], jobs[b].dst, t, nthreads);
        }
        for (unsigned t = 0; t < nthreads; t++)
            kv_enc_gear_residual(enc, &jobs[b], jobs[b].dst, t, nthreads);
        for (unsigned t = 0; t < nthreads; t++)
            kv_enc_gear_fit(enc, &jobs[b], jobs[b].dst, t, nthreads);
        for (unsigned t = 0; t < nthreads; t++)
            piece[t] = kv_enc_piece_crc(enc, table, jobs[b].dst, t, nthreads);
        kv_enc_finish(enc, table, piece, jobs[b].dst, nthreads);
    }
    free(piece);
}

/* threads == 0: on the GPU; otherwise emulated on the CPU with that many threads. */
/* threads == 0: on the GPU; otherwise emulated on the CPU with that many threads. prompt: GEAR
 * blocks at the prompt rank (the CPU pool's blocks made only of prompt tokens). */
static void run_codec_rank(const char *codec, int H, int D, int BT, int n_blocks, unsigned threads, bool prompt)
{
    kv_codec_params p;
    strata_error err = {0};
    assert_int_equal(kv_codec_parse(codec, &p, &err), STRATA_OK);
    const kv_geometry g = {.n_layers = 32, .n_kv_heads = H, .head_dim = D, .block_tokens = BT};
    const int rank = prompt ? p.rank_prompt : -1;
    cuda_kv_encoder enc;
    if (cuda_kv_encoder_init_rank(&p, &g, rank, &enc, &err) != STRATA_OK)
        fail_msg("%s: %s", codec, err.msg);
    const size_t work = (size_t)enc.work_bytes;
    uint8_t *hwork = work ? aligned_alloc(64, ((work * (size_t)n_blocks) + 63) & ~(size_t)63) : NULL;
    assert_true(!work || hwork);
    const size_t rows = (size_t)BT * H * D, slot = enc.slot_bytes;
    /* OTT: one tracker for all the blocks, which are consecutive blocks of one (sequence, layer):
     * on the GPU they go one launch each, in order. */
    uint8_t *hstate = enc.ott ? calloc(1, (size_t)enc.ott_state_bytes) : NULL;
    kv_ott_tracker *tracker = enc.ott ? kv_ott_tracker_create(H, p.pool_tokens, p.aux_tokens) : NULL;
    kv_ott_entry *entries = enc.ott ? calloc((size_t)H * 64, sizeof *entries) : NULL;
    assert_true(!enc.ott || (hstate && tracker && entries));
    int ott_entries = 0;
    uint16_t *k = malloc(rows * n_blocks * sizeof *k), *v = malloc(rows * n_blocks * sizeof *v);
    float *kf = malloc(rows * sizeof *kf), *vf = malloc(rows * sizeof *vf);
    uint8_t *want = malloc(slot), *got = malloc(slot * n_blocks);
    cuda_kv_encode_job *jobs = calloc((size_t)n_blocks, sizeof *jobs);
    assert_true(k && v && kf && vf && want && got && jobs);
    for (int b = 0; b < n_blocks; b++) {
        fill_rows(k + rows * b, (size_t)BT, (size_t)H, (size_t)D, b % 4);
        fill_rows(v + rows * b, (size_t)BT, (size_t)H, (size_t)D, (b + 2) % 4);
    }
    if (threads) {
        memset(got, 0xa5, slot * n_blocks);
        for (int b = 0; b < n_blocks; b++)
            jobs[b] = (cuda_kv_encode_job){.k = k + rows * b, .v = v + rows * b, .dst = got + slot * b,
                                           .first_pos = (uint64_t)b * BT + ((uint64_t)b << 33),
                                           .layer = (uint32_t)(b % 32), .work = work ? hwork + work * b : NULL,
                                           .ott_state = hstate};
        encode_emulated(&enc, jobs, n_blocks, threads);
        goto compare;
    }
    uint16_t *dk, *dv;
    uint8_t *dslots, *dwork = NULL, *dstate = NULL;
    if (enc.ott) {
        CUDA_CHECK(cudaMalloc((void **)&dstate, (size_t)enc.ott_state_bytes));
        CUDA_CHECK(cudaMemset(dstate, 0, (size_t)enc.ott_state_bytes));
    }
    cuda_kv_encode_job *djobs;
    if (work)
        CUDA_CHECK(cudaMalloc((void **)&dwork, work * (size_t)n_blocks));
    CUDA_CHECK(cudaMalloc((void **)&dk, rows * n_blocks * sizeof *dk));
    CUDA_CHECK(cudaMalloc((void **)&dv, rows * n_blocks * sizeof *dv));
    CUDA_CHECK(cudaMalloc((void **)&dslots, slot * n_blocks));
    CUDA_CHECK(cudaMalloc((void **)&djobs, n_blocks * sizeof *djobs));
    CUDA_CHECK(cudaMemcpy(dk, k, rows * n_blocks * sizeof *dk, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dv, v, rows * n_blocks * sizeof *dv, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(dslots, 0xa5, slot * n_blocks));
    for (int b = 0; b < n_blocks; b++)
        jobs[b] = (cuda_kv_encode_job){.k = dk + rows * b, .v = dv + rows * b, .dst = dslots + slot * b,
                                       .first_pos = (uint64_t)b * BT + ((uint64_t)b << 33), .layer = (uint32_t)(b % 32),
                                       .work = work ? dwork + work * b : NULL, .ott_state = dstate};
    CUDA_CHECK(cudaMemcpy(djobs, jobs, n_blocks * sizeof *djobs, cudaMemcpyHostToDevice));
    for (int b = 0; b < n_blocks; b += enc.ott ? 1 : n_blocks)   /* OTT: the tracker's blocks in order */
        if (cuda_kv_encode_blocks(&enc, djobs + b, enc.ott ? 1 : n_blocks, NULL, &err) != STRATA_OK)
            fail_msg("%s: %s", codec, err.msg);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(got, dslots, slot * n_blocks, cudaMemcpyDeviceToHost));
    cudaFree(dk);
    cudaFree(dv);
    cudaFree(dslots);
    cudaFree(djobs);
    cudaFree(dwork);
    cudaFree(dstate);
compare:
    for (int b = 0; b < n_blocks; b++) {
        for (size_t i = 0; i < rows; i++) {
            kf[i] = strata_half_to_float(k[rows * b + i]);
            vf[i] = strata_half_to_float(v[rows * b + i]);
        }
        kv_block_desc d;
        kv_block_desc_init(&d, &p, &g, jobs[b].layer, jobs[b].first_pos);
        if (rank >= 0 && p.codec == KV_CODEC_GEAR)
            d.rank = rank;
        kv_block_extra extra = {NULL};
        if (tracker) {   /* the CPU pool's order: the tracker's choice, then the writer */
            d.ott_tokens = (int)kv_ott_select(tracker, kf, (size_t)BT, D, jobs[b].first_pos, entries);
            extra.ott = entries;
            ott_entries += d.ott_tokens;
        }
        assert_int_equal(kv_block_encode_ex(&d, kf, vf, &extra, want, slot, NULL, &err), STRATA_OK);
        const uint8_t *mine = got + slot * b;
        kv_block wb;
        assert_int_equal(kv_block_parse(want, slot, &wb, &err), STRATA_OK);
        const size_t len = wb.block_bytes;   /* OTT: the size follows the entries; the slot holds the most */
        size_t first_diff = len;
        for (size_t i = 0; i < len && first_diff == len; i++)
            if (mine[i] != want[i])
                first_diff = i;
        if (first_diff != len)
            fail_msg("%s H %d D %d block %d (edge kind %d, %s): block differs from the CPU's at byte %zu of %zu "
                     "(ours %02x, cpu writer %02x)", codec, H, D, b, b % 4, threads ? "emulated" : "gpu", first_diff, len, mine[first_diff],
                     want[first_diff]);
        assert_int_equal(kv_block_verify(mine, slot, NULL, &err), STRATA_OK);
    }
    printf("  %s%s H %d D %d block_tokens %d: %d blocks of up to %zu bytes identical to the CPU writer's (%s)", codec,
           prompt ? " (prompt rank)" : "", H, D, BT, n_blocks, slot, threads ? "emulated" : "gpu");
    if (tracker)
        printf(", %d pooled tokens", ott_entries);
    printf("\n");
    if (tracker && p.pool_tokens > 0 && n_blocks > 1)
        assert_true(ott_entries > 0);   /* the case exercised the pool */
    free(hstate);
    free(entries);
    kv_ott_tracker_destroy(tracker);
    free(hwork);
    free(k);
    free(v);
    free(kf);
    free(vf);
    free(want);
    free(got);
    free(jobs);
}

static void run_codec(const char *codec, int H, int D, int BT, int n_blocks, unsigned threads)
{
    run_codec_rank(codec, H, D, BT, n_blocks, threads, false);
    if (!strncmp(codec, "gear", 4))
        run_codec_rank(codec, H, D, BT, n_blocks, threads, true);
}

static const char *const codecs[] = {"fp16",  "kivi2", "kivi4", "kivi2-g64", "kivi4-g16", "tada2",   "tada4",
                                     "tada8", "gear2", "gear4", "gearl2",    "gear2-s50", "ott2",    "ott4",
                                     "ott2-n16-a8", "ott4-n64-a200", "ott2-n0"};

static void test_blocks_equal_cpu_writer(void **state)
{
    (void)state;
    for (size_t c = 0; c < sizeof codecs / sizeof *codecs; c++) {
        run_codec(codecs[c], 3, 64, 64, 8, 0);
        run_codec(codecs[c], 8, 128, 64, 12, 0);
        run_codec(codecs[c], 2, 64, 128, 5, 0);
    }
}

/* The kernel's code on the CPU: the launch's 256 threads, and an odd count that leaves pieces of
 * unequal length. */
static void test_emulated_blocks_equal_cpu_writer(void **state)
{
    (void)state;
    for (size_t c = 0; c < sizeof codecs / sizeof *codecs; c++) {
        run_codec(codecs[c], 3, 64, 64, 4, 256);
        run_codec(codecs[c], 8, 128, 64, 4, 256);
        run_codec(codecs[c], 2, 64, 128, 4, 7);
    }
}

int main(void)
{
    const struct CMUnitTest host[] = {cmocka_unit_test(test_encoder_header),
                                      cmocka_unit_test(test_emulated_blocks_equal_cpu_writer)};
    const int host_rc = cmocka_run_group_tests(host, NULL, NULL);
    if (host_rc != 0)
        return host_rc;
    if (!cuda_test_have_device("test_cuda_encode"))
        return CUDA_TEST_SKIP;
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_blocks_equal_cpu_writer)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
