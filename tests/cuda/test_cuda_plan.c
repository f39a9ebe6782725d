/* The host side of the CUDA KV kernels, which runs without a GPU: the layout read from a real block
 * of each codec (offsets equal the block's own section table), the split plan (every block and the
 * tail covered exactly once, the grid filled, limits refused), and the tail kernels' bodies
 * emulated thread after thread. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/cuda/kv_tail_block.h"
#include "kernels/cuda/kv_attention_mma.h"
#include "kernels/cuda/kv_attention_mma_codec.h"
#include "kernels/cuda_kv_attention.h"
#include "kvstore/block.h"
#include "kvstore/kv_cache.h"

static uint8_t *encode_block(const char *codec, const kv_geometry *g, kv_block *b)
{
    kv_codec_params p;
    strata_error err;
    assert_int_equal(kv_codec_parse(codec, &p, &err), STRATA_OK);
    assert_int_equal(kv_codec_validate(&p, g, &err), STRATA_OK);
    kv_block_desc d;
    kv_block_desc_init(&d, &p, g, 3, 128);
    const size_t n = (size_t)g->block_tokens * g->n_kv_heads * g->head_dim;
    float *k = malloc(n * sizeof *k), *v = malloc(n * sizeof *v);
    assert_non_null(k);
    assert_non_null(v);
    for (size_t i = 0; i < n; i++) {
        k[i] = (float)((i * 37) % 101) / 50.0f - 1.0f;
        v[i] = (float)((i * 53) % 97) / 48.0f - 1.0f;
    }
    const size_t cap = kv_block_size(&p, g);
    uint8_t *buf = aligned_alloc(64, cap);
    assert_non_null(buf);
    kv_block_extra extra = {0};
    kv_ott_entry ott[1] = {{0, 0}};
    if (p.codec == KV_CODEC_OTT) {
        d.ott_tokens = 1;
        extra.ott = ott;
    }
    assert_int_equal(kv_block_encode_ex(&d, k, v, &extra, buf, cap, NULL, &err), STRATA_OK);
    assert_int_equal(kv_block_parse(buf, cap, b, &err), STRATA_OK);
    free(k);
    free(v);
    return buf;
}

static const kv_geometry geometry = {.n_layers = 4, .n_kv_heads = 8, .head_dim = 128, .block_tokens = 64};

static void expect_offset(const kv_block *b, uint16_t id, uint32_t off)
{
    uint32_t len;
    const uint8_t *data = kv_block_section_data(b, id, &len);
    assert_non_null(data);
    assert_int_equal((uint32_t)(data - b->bytes), off);
}

static void test_layout_fp16_kivi_tada(void **state)
{
    (void)state;
    const char *codecs[] = {"fp16", "kivi2", "kivi4", "tada2", "tada8"};
    for (size_t i = 0; i < sizeof codecs / sizeof *codecs; i++) {
        kv_block b;
        uint8_t *buf = encode_block(codecs[i], &geometry, &b);
        cuda_kv_layout l;
        strata_error err;
        assert_int_equal(cuda_kv_layout_from_block(&b, &l, &err), STRATA_OK);
        assert_int_equal(l.codec, b.desc.codec);
        assert_int_equal(l.block_tokens, 64);
        assert_int_equal(l.n_kv_heads, 8);
        assert_int_equal(l.head_dim, 128);
        assert_int_equal(l.layer, 3);
        assert_int_equal(l.block_bytes, b.block_bytes);
        if (l.codec == KV_CODEC_FP16) {
            expect_offset(&b, KV_SEC_K_FP16, l.off_k);
            expect_offset(&b, KV_SEC_V_FP16, l.off_v);
        } else {
            assert_int_equal(l.k_bits, b.desc.k_bits);
            assert_int_equal(l.v_group, b.desc.v_group);
            expect_offset(&b, KV_SEC_K_CODES, l.off_k);
            expect_offset(&b, KV_SEC_K_SCALES, l.off_k_scales);
            expect_offset(&b, KV_SEC_V_CODES, l.off_v);
            expect_offset(&b, KV_SEC_V_SCALES, l.off_v_scales);
        }
        if (l.codec == KV_CODEC_TADA) {
            expect_offset(&b, KV_SEC_TADA_K_MEAN, l.off_k_mean);
            expect_offset(&b, KV_SEC_TADA_V_MEAN, l.off_v_mean);
        }
        free(buf);
    }
}

/* GEAR and OTT blocks vary in size: the layout keeps the backbone's place, which every block of
 * the codec shares, and the kernel reads the rest from each block. */
static void test_layout_gear_ott(void **state)
{
    (void)state;
    const char *codecs[] = {"gear2", "gear4", "ott2"};
    for (size_t i = 0; i < sizeof codecs / sizeof *codecs; i++) {
        kv_block b;
        uint8_t *buf = encode_block(codecs[i], &geometry, &b);
        cuda_kv_layout l;
        strata_error err = {0};
        assert_int_equal(cuda_kv_layout_from_block(&b, &l, &err), STRATA_OK);
        assert_int_equal(l.codec, b.desc.codec);
        expect_offset(&b, KV_SEC_K_CODES, l.off_k);
        expect_offset(&b, KV_SEC_V_SCALES, l.off_v_scales);
        free(buf);
    }
    assert_int_equal(cuda_kv_layout_from_block(NULL, NULL, NULL), STRATA_EINVAL);
}

static void test_plan_covers_every_block_once(void **state)
{
    (void)state;
    const cuda_kv_layout l = {.codec = KV_CODEC_KIVI, .n_kv_heads = 8, .head_dim = 128, .block_tokens = 64};
    const int seqs[] = {1, 3, 64};
    const int blocks[] = {0, 1, 7, 63, 64, 511, 2047};
    for (size_t a = 0; a < 3; a++) {
        for (size_t b = 0; b < sizeof blocks / sizeof *blocks; b++) {
            cuda_kv_plan p;
            strata_error err;
            assert_int_equal(cuda_kv_attention_plan(&l, seqs[a], 32, blocks[b], 132, &p, &err), STRATA_OK);
            const long units = blocks[b] + 1;
            /* Covered, and no split is empty for the longest sequence. */
            assert_true((long)p.n_splits * p.blocks_per_split >= units);
            assert_true((long)(p.n_splits - 1) * p.blocks_per_split < units);
            assert_true(p.n_splits >= 1 && p.n_splits <= units);
            /* The grid fills 132 multiprocessors twice when there is enough work. */
            const long ctas = (long)p.n_splits * seqs[a] * l.n_kv_heads;
            if (units * seqs[a] * l.n_kv_heads >= 264)
                assert_true(ctas >= 264 - (long)seqs[a] * l.n_kv_heads);
            assert_int_equal(cuda_kv_attention_workspace(&l, &p),
                             (size_t)seqs[a] * 32 * (size_t)p.n_splits * 130 * sizeof(float));
        }
    }
}

/* The shapes around the tensor-core kernel's (it takes some): each backbone codec, head_dim 64
 * and 128, 2 and 4 bits, groups 8 to 64, one group for keys and values, 64-token blocks. */
#define MMA_SHAPES 64
static void mma_shapes(cuda_kv_layout out[MMA_SHAPES])
{
    const int codecs[] = {KV_CODEC_KIVI, KV_CODEC_TADA, KV_CODEC_GEAR, KV_CODEC_OTT};
    size_t n = 0;
    for (size_t c = 0; c < 4; c++)
        for (int D = 64; D <= 128; D *= 2)
            for (int bits = 2; bits <= 4; bits += 2)
                for (int G = 8; G <= 64; G *= 2)
                    out[n++] = (cuda_kv_layout){.codec = codecs[c], .k_bits = bits, .v_bits = bits, .k_group = G,
                                                .v_group = G, .n_kv_heads = 8, .head_dim = D, .block_tokens = 64};
}

/* The tensor-core kernel's plan (a layout of each codec it takes; GEAR and OTT fit fewer thread
 * blocks a multiprocessor): every block covered once, at least one block a warp, and no worse in
 * waves x blocks a split than the plain "fill the device once" plan it replaced. */
static void test_plan_tensor_cores_counts_waves(void **state)
{
    (void)state;
    const int codecs[] = {KV_CODEC_KIVI, KV_CODEC_TADA, KV_CODEC_GEAR, KV_CODEC_OTT};
    for (size_t c = 0; c < 4; c++) {
        const cuda_kv_layout l = {.codec = codecs[c], .k_bits = 2, .v_bits = 2, .k_group = 32, .v_group = 32,
                                  .n_kv_heads = 8, .head_dim = 128, .block_tokens = 64};
        assert_true(kv_mma_eligible(&l, 4));
        const long slots = 132L * kv_mma_ctas_per_sm(128, 2, 32, codecs[c]);
        assert_int_equal(slots, codecs[c] == KV_CODEC_GEAR || codecs[c] == KV_CODEC_OTT ? 264 : 396);
        const int seqs[] = {1, 3, 64, 200};
        const int blocks[] = {0, 1, 7, 63, 64, 511, 2047};
        for (size_t a = 0; a < sizeof seqs / sizeof *seqs; a++)
            for (size_t b = 0; b < sizeof blocks / sizeof *blocks; b++) {
                cuda_kv_plan p;
                strata_error err;
                assert_int_equal(cuda_kv_attention_plan(&l, seqs[a], 32, blocks[b], 132, &p, &err), STRATA_OK);
                const long units = blocks[b] + 1, rows = (long)seqs[a] * 8;
                assert_true((long)p.n_splits * p.blocks_per_split >= units);
                assert_true((long)(p.n_splits - 1) * p.blocks_per_split < units);
                assert_true(p.n_splits == 1 || p.blocks_per_split >= KV_MMA_WARPS);
                const long cost = (rows * p.n_splits + slots - 1) / slots * p.blocks_per_split;
                long plain = (slots + rows - 1) / rows;   /* one wave's worth of splits */
                if (plain > (units + KV_MMA_WARPS - 1) / KV_MMA_WARPS)
                    plain = (units + KV_MMA_WARPS - 1) / KV_MMA_WARPS;
                const long per = (units + plain - 1) / plain, used = (units + per - 1) / per;
                const long plain_cost = (rows * used + slots - 1) / slots * per;
                if (cost > plain_cost)
                    fail_msg("codec %d, %d sequences x %d blocks: %d splits of %d cost %ld, the plain plan %ld",
                             codecs[c], seqs[a], blocks[b], p.n_splits, p.blocks_per_split, cost, plain_cost);
            }
    }
    /* Every layout the kernel takes fits as many thread blocks a multiprocessor as the plan and the
     * launch bounds count on: an H100 has 228 KiB of shared memory a multiprocessor, at most 227
     * a thread block, and keeps 1 KiB a thread block for itself. */
    cuda_kv_layout shapes[MMA_SHAPES];
    mma_shapes(shapes);
    for (size_t i = 0; i < MMA_SHAPES; i++) {
        const cuda_kv_layout *l = &shapes[i];
        const int D = l->head_dim, bits = l->k_bits, G = l->k_group;
        if (!kv_mma_eligible(l, 8))
            continue;
        assert_int_equal(kv_mma_stage_of(l).bytes, kv_mma_stage_bytes(D, bits, G));
        const size_t smem = kv_mma_smem_bytes(l), ctas = (size_t)kv_mma_ctas_per_sm(D, bits, G, l->codec);
        assert_true(ctas >= 1);
        if (smem > 227 * 1024 || ctas * (smem + 1024) > 228 * 1024)
            fail_msg("codec %d, head_dim %d, %d bits, group %d: %zu thread blocks of %zu bytes", l->codec, D, bits, G,
                     ctas, smem);
    }
    /* TaDA's 8-bit codes stay on the generic kernel. */
    const cuda_kv_layout t8 = {.codec = KV_CODEC_TADA, .k_bits = 8, .v_bits = 8, .k_group = 32, .v_group = 32,
                               .n_kv_heads = 8, .head_dim = 128, .block_tokens = 64};
    assert_false(kv_mma_eligible(&t8, 4));
}

/* Which layouts the tensor-core kernel runs by the shared memory a GPU allows a thread block:
 * all of them on an H100 or B200 (227 KiB) and on an A100 (163 KiB); on a GPU with 99 KiB
 * (sm_86/89/120) every 2-bit one, and of the 4-bit ones at head_dim 128 only those whose groups
 * keep the stage buffers small (the others pass to the staged or generic kernel). A cap of 0
 * runs none. The plan leaves the device's limit in force (smem_limit 0). */
static void test_tensor_cores_by_shared_memory(void **state)
{
    (void)state;
    const size_t h100 = 232448, a100 = 166912, ada = 101376;
    int eligible = 0, on_ada = 0;
    cuda_kv_layout shapes[MMA_SHAPES];
    mma_shapes(shapes);
    for (size_t i = 0; i < MMA_SHAPES; i++) {
        const cuda_kv_layout *l = &shapes[i];
        if (!kv_mma_eligible(l, 4)) {
            assert_false(kv_mma_runs(l, 4, h100));
            continue;
        }
        eligible++;
        assert_true(kv_mma_runs(l, 4, h100));
        assert_true(kv_mma_runs(l, 4, a100));
        assert_false(kv_mma_runs(l, 4, 0));
        const bool fits = kv_mma_runs(l, 4, ada);
        on_ada += fits;
        assert_true(fits == (kv_mma_smem_bytes(l) <= ada));
        if (l->k_bits == 2 || l->head_dim == 64)
            assert_true(fits);
    }
    /* 4 codecs x 2 head sizes x (3 groups at 2 bits + 4 at 4 bits); 8 of them too big for 99 KiB:
     * KIVI and TaDA 4-bit group 8, GEAR and OTT 4-bit groups 8, 16 and 32, all at head_dim 128. */
    assert_int_equal(eligible, 56);
    assert_int_equal(on_ada, 48);
    const cuda_kv_layout kivi4g8 = {.codec = KV_CODEC_KIVI, .k_bits = 4, .v_bits = 4, .k_group = 8, .v_group = 8,
                                    .n_kv_heads = 8, .head_dim = 128, .block_tokens = 64};
    assert_false(kv_mma_runs(&kivi4g8, 4, ada));
    cuda_kv_plan p;
    strata_error err;
    assert_int_equal(cuda_kv_attention_plan(&kivi4g8, 1, 32, 4, 132, &p, &err), STRATA_OK);
    assert_int_equal(p.smem_limit, 0);
}

static void test_plan_refuses_bad_shapes(void **state)
{
    (void)state;
    const cuda_kv_layout l = {.codec = KV_CODEC_KIVI, .n_kv_heads = 2, .head_dim = 64, .block_tokens = 64};
    cuda_kv_plan p;
    strata_error err = {0};
    assert_int_equal(cuda_kv_attention_plan(&l, 1, 3, 4, 132, &p, &err), STRATA_EINVAL);  /* 3 % 2 */
    assert_non_null(strstr(err.msg, "multiple"));
    assert_int_equal(cuda_kv_attention_plan(&l, 1, 34, 4, 132, &p, &err), STRATA_EINVAL); /* 17 per KV head */
    assert_non_null(strstr(err.msg, "up to 16"));
    assert_int_equal(cuda_kv_attention_plan(&l, 0, 4, 4, 132, &p, &err), STRATA_EINVAL);
    assert_int_equal(cuda_kv_attention_plan(&l, 1, 4, -1, 132, &p, &err), STRATA_EINVAL);
    assert_int_equal(cuda_kv_attention_plan(&l, 1, 32, 4, 132, &p, &err), STRATA_OK);     /* 16 per KV head */
}

/* The tail kernels' bodies (kernels/cuda/kv_tail_block.h), thread after thread: after a block's
 * rows are encoded, the residual rows move to the front with the overlapping case (residual 128
 * over block 64, and 160, not a multiple of it) as well as residual 32 and 0; appended rows land
 * where the job points. Against a copy made the plain way. */
static void test_tail_kernels_emulated(void **state)
{
    (void)state;
    const size_t row = 8 * 16;   /* 8 KV heads x head_dim 16 */
    const int bt = 64, keeps[] = {128, 160, 32, 0};
    for (size_t x = 0; x < sizeof keeps / sizeof *keeps; x++) {
        const int keep = keeps[x];
        const size_t rows = (size_t)(keep + bt), n = rows * row;
        uint16_t *k = malloc(n * 2), *v = malloc(n * 2), *want_k = malloc(n * 2), *want_v = malloc(n * 2);
        assert_true(k && v && want_k && want_v);
        for (size_t i = 0; i < n; i++) {
            k[i] = (uint16_t)(i * 7 + 1);
            v[i] = (uint16_t)(i * 13 + 5);
        }
        memcpy(want_k, k, n * 2);
        memcpy(want_v, v, n * 2);
        memmove(want_k, want_k + (size_t)bt * row, (size_t)keep * row * 2);
        memmove(want_v, want_v + (size_t)bt * row, (size_t)keep * row * 2);
        const cuda_kv_shift_job job = {k, v};
        for (int r0 = 0; r0 < keep; r0 += bt)   /* the kernel's steps, a barrier after each */
            for (unsigned t = 0; t < 256; t++)
                kv_tail_shift_step(&job, bt, keep, r0, row, t, 256);
        assert_memory_equal(k, want_k, (size_t)keep * row * 2);
        assert_memory_equal(v, want_v, (size_t)keep * row * 2);

        /* Append two rows of a step (rows 3 and 4) at the tail's row 5. */
        uint16_t step_k[6 * 128], step_v[6 * 128];
        for (size_t i = 0; i < 6 * row; i++) {
            step_k[i] = (uint16_t)(40000 + i);
            step_v[i] = (uint16_t)(50000 + i);
        }
        const cuda_kv_append_job app = {k + 5 * row, v + 5 * row, 3, 2};
        for (unsigned t = 0; t < 256; t++)
            kv_tail_append(&app, step_k, step_v, row, t, 256);
        assert_memory_equal(k + 5 * row, step_k + 3 * row, 2 * row * 2);
        assert_memory_equal(v + 5 * row, step_v + 3 * row, 2 * row * 2);
        free(k);
        free(v);
        free(want_k);
        free(want_v);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layout_fp16_kivi_tada),
        cmocka_unit_test(test_layout_gear_ott),
        cmocka_unit_test(test_plan_covers_every_block_once),
        cmocka_unit_test(test_plan_tensor_cores_counts_waves),
        cmocka_unit_test(test_tensor_cores_by_shared_memory),
        cmocka_unit_test(test_plan_refuses_bad_shapes),
        cmocka_unit_test(test_tail_kernels_emulated),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
