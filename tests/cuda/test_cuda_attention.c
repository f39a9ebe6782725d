/* cuda_kv_attention (kernels/cuda/kv_attention.cu) against an fp64 reference written here over
 * the blocks' dequantized values (kv_block_decode) and the fp16 tail, and against the CPU kernel
 * (kern_kv_attention) on the same blocks. Fresh random K/V/q for every case; the output is
 * poisoned (all NaN) before every launch, so an unwritten element fails. Codecs: fp16, KIVI, TaDA
 * (whose per-token means the kernel adds), GEAR (low-rank term and outliers; blocks of two ranks)
 * and OTT (pooled tokens; blocks with 0, 1 and 2 of them). Shapes: SmolLM2's
 * (9 query heads on 3 KV heads, head_dim 64) and Llama-3-8B's (32 on 8, head_dim 128); batches
 * of sequences of unequal lengths, from an empty sequence to hundreds of blocks (many splits),
 * tails longer than a block. Bound: ||gpu - ref|| / ||ref|| <= 1e-4 (fp32 arithmetic against
 * fp64). Bad block tables (swapped blocks, a NULL entry) must raise the status flag.
 * Prefill and prompt chunks go through cuBLAS (cuda_attention_prefill_gemm, kernels/cuda_prefill.h;
 * a chunk after its cache written out as fp32 rows by cuda_kv_dequantize_view), each against an
 * fp64 causal reference written here (same bound), with the CPU's kern_attention_causal and
 * kern_kv_attention_rows checked against the same reference.
 * The kernels' phases (kernels/cuda/kv_attention_block.h) also run emulated on the CPU, thread
 * after thread, against the decode reference: that part and the harness checks (references vs
 * CPU kernels) run in CI; without a CUDA device the test then exits 77 (skipped). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <cublas_v2.h>

#include "cuda_test_util.h"
#include "kernels/cuda/kv_attention_emu.h"
#include "kernels/cuda/kv_attention_mma_emu.h"
#include "kernels/cuda_kv_attention.h"
#include "kernels/cuda_prefill.h"
#include "kernels/kv_attention.h"
#include "kernels/ops.h"
#include "kvstore/block.h"
#include "kvstore/bytes.h"
#include "kvstore/half.h"
#include "kvstore/kv_cache.h"

#define REL_BOUND 1e-4
/* The tensor-core path (KIVI under CUDA_KV_KERNEL_AUTO) rounds the scaled query, the dequantized
 * K/V and the softmax weights to fp16 (unit roundoff 2^-11 = 4.9e-4); its error against fp64 on
 * these inputs (peaked softmax: keys up to about 5 against queries up to 2) measured 2e-4 to 4e-4
 * on the CPU emulation. Bound: 2e-3, four fp16 roundings' worth. */
#define REL_BOUND_FP16 2e-3

typedef struct host_seq {
    int n_blocks, tail;
    uint8_t *blocks;      /* n_blocks slots of slot_bytes, 64-aligned */
    uint16_t *tail_k, *tail_v;
} host_seq;

typedef struct test_case {
    const char *codec;
    int nq, nkv, D;
    int n_seqs;
    const int *n_blocks, *tails;
    int block_tokens;     /* 0: 64 */
    int kernel;           /* cuda_kv_kernel; 0: AUTO */
} test_case;

static uint64_t seed = 0x5eed;

/* The shared memory an H100 allows a thread block (cudaDevAttrMaxSharedMemoryPerBlockOptin): what
 * the emulation assumes. */
#define H100_SMEM 232448

/* Keys get a per-channel offset and scale (the outlier channels KIVI quantizes per channel for). */
static void random_rows(float *k, float *v, size_t tokens, int nkv, int D)
{
    for (size_t t = 0; t < tokens; t++)
        for (int h = 0; h < nkv; h++)
            for (int c = 0; c < D; c++) {
                const size_t i = (t * (size_t)nkv + (size_t)h) * (size_t)D + (size_t)c;
                const float chan = (c % 7 == 0) ? 4.0f : 1.0f;
                k[i] = strata_round_half(chan * cuda_test_uniform(&seed) + 0.25f * (float)(c % 5));
                v[i] = strata_round_half(cuda_test_uniform(&seed));
            }
}

static void make_seq(const kv_codec_params *p, const kv_geometry *g, int n_blocks, int tail, size_t slot,
                     host_seq *s)
{
    const size_t rows = (size_t)g->block_tokens * g->n_kv_heads * g->head_dim;
    const size_t tail_n = (size_t)tail * g->n_kv_heads * g->head_dim;
    s->n_blocks = n_blocks;
    s->tail = tail;
    s->blocks = aligned_alloc(64, slot * (size_t)(n_blocks ? n_blocks : 1));
    s->tail_k = malloc((tail_n ? tail_n : 1) * sizeof(uint16_t));
    s->tail_v = malloc((tail_n ? tail_n : 1) * sizeof(uint16_t));
    float *k = malloc(rows * sizeof *k), *v = malloc(rows * sizeof *v);
    assert_true(s->blocks && s->tail_k && s->tail_v && k && v);
    for (int b = 0; b < n_blocks; b++) {
        random_rows(k, v, (size_t)g->block_tokens, g->n_kv_heads, g->head_dim);
        kv_block_desc d;
        kv_block_desc_init(&d, p, g, 0, (uint64_t)b * (uint64_t)g->block_tokens);
        /* Blocks of one sequence differ in size: GEAR's prompt blocks carry a higher rank, and OTT
         * blocks pool 0, 1 or 2 tokens. */
        kv_ott_entry ott[2];
        kv_block_extra extra = {NULL};
        if (p->codec == KV_CODEC_GEAR && b % 2 == 0)
            d.rank = p->rank_prompt;
        if (p->codec == KV_CODEC_OTT && b % 3 != 2) {
            const uint16_t t0 = (uint16_t)(b % g->block_tokens), t1 = (uint16_t)((b * 7 + 5) % g->block_tokens);
            ott[0] = (kv_ott_entry){0, t0 < t1 ? t0 : t1};
            ott[1] = (kv_ott_entry){(uint16_t)(g->n_kv_heads - 1), t0 < t1 ? t1 : t0};
            d.ott_tokens = (b % 3 == 0 && t0 != t1) ? 2 : 1;
            if (d.ott_tokens == 1)
                ott[0] = (kv_ott_entry){(uint16_t)(b % g->n_kv_heads), t0};
            extra.ott = ott;
        }
        strata_error err;
        assert_int_equal(kv_block_encode_ex(&d, k, v, &extra, s->blocks + (size_t)b * slot, slot, NULL, &err), STRATA_OK);
    }
    for (size_t i = 0; i < tail_n; i++) {
        s->tail_k[i] = strata_float_to_half(2.0f * cuda_test_uniform(&seed));
        s->tail_v[i] = strata_float_to_half(cuda_test_uniform(&seed));
    }
    free(k);
    free(v);
}

static void free_seq(host_seq *s)
{
    free(s->blocks);
    free(s->tail_k);
    free(s->tail_v);
}

/* fp64 attention over the dequantized blocks then the tail: out [nq][D]. */
static void reference(const host_seq *s, const kv_geometry *g, size_t slot, const float *q, int nq, double *out)
{
    const int nkv = g->n_kv_heads, D = g->head_dim, BT = g->block_tokens;
    const size_t T = (size_t)s->n_blocks * BT + (size_t)s->tail;
    float *k = malloc((T ? T : 1) * nkv * D * sizeof *k), *v = malloc((T ? T : 1) * nkv * D * sizeof *v);
    double *w = malloc((T ? T : 1) * sizeof *w);
    assert_true(k && v && w);
    for (int b = 0; b < s->n_blocks; b++) {
        kv_block blk;
        strata_error err;
        assert_int_equal(kv_block_parse(s->blocks + (size_t)b * slot, slot, &blk, &err), STRATA_OK);
        const size_t at = (size_t)b * BT * nkv * D;
        assert_int_equal(kv_block_decode(&blk, k + at, v + at, &err), STRATA_OK);
    }
    const size_t at = (size_t)s->n_blocks * BT * nkv * D;
    for (size_t i = 0; i < (size_t)s->tail * nkv * D; i++) {
        k[at + i] = strata_half_to_float(s->tail_k[i]);
        v[at + i] = strata_half_to_float(s->tail_v[i]);
    }
    for (int h = 0; h < nq; h++) {
        const size_t kh = (size_t)(h / (nq / nkv));
        cuda_test_attend_fp64(q + (size_t)h * D, k + kh * D, v + kh * D, T, (size_t)nkv * D, D, w, out + (size_t)h * D);
    }
    free(k);
    free(v);
    free(w);
}

/* The CPU kernel on the same blocks, as a second opinion (it must agree with the reference too). */
static void cpu_kernel(const host_seq *s, const kv_geometry *g, size_t slot, const float *q, int nq, float *out)
{
    const uint8_t **ptrs = malloc((size_t)(s->n_blocks ? s->n_blocks : 1) * sizeof *ptrs);
    assert_non_null(ptrs);
    for (int b = 0; b < s->n_blocks; b++)
        ptrs[b] = s->blocks + (size_t)b * slot;
    kv_layer_view view = {.layer = 0, .n_kv_heads = g->n_kv_heads, .head_dim = g->head_dim,
                          .block_tokens = g->block_tokens, .n_blocks = (size_t)s->n_blocks, .blocks = ptrs,
                          .block_bytes = slot, .tail_tokens = (size_t)s->tail, .tail_k = s->tail_k,
                          .tail_v = s->tail_v};
    void *scratch = aligned_alloc(64, (kern_kv_attention_scratch(&view, nq) + 63) & ~(size_t)63);
    assert_non_null(scratch);
    strata_error err;
    assert_int_equal(kern_kv_attention(&view, q, nq, out, scratch, &err), STRATA_OK);
    free(scratch);
    free(ptrs);
}

/* Device copies of a batch; returns the device array of cuda_kv_seq. Everything allocated is
 * appended to allocs (freed by the caller). */
static cuda_kv_seq *upload(const host_seq *hs, int n_seqs, size_t slot, const kv_geometry *g, void **allocs,
                           int *n_allocs)
{
    cuda_kv_seq *seqs = calloc((size_t)n_seqs, sizeof *seqs);
    assert_non_null(seqs);
    for (int i = 0; i < n_seqs; i++) {
        const host_seq *s = &hs[i];
        const size_t tail_bytes = (size_t)s->tail * g->n_kv_heads * g->head_dim * 2;
        uint8_t *d_blocks = NULL;
        const uint8_t **table = malloc((size_t)(s->n_blocks ? s->n_blocks : 1) * sizeof *table);
        assert_non_null(table);
        if (s->n_blocks) {
            CUDA_CHECK(cudaMalloc((void **)&d_blocks, slot * (size_t)s->n_blocks));
            CUDA_CHECK(cudaMemcpy(d_blocks, s->blocks, slot * (size_t)s->n_blocks, cudaMemcpyHostToDevice));
            allocs[(*n_allocs)++] = d_blocks;
        }
        for (int b = 0; b < s->n_blocks; b++)
            table[b] = d_blocks + (size_t)b * slot;
        void *d_table = NULL, *d_tk = NULL, *d_tv = NULL;
        CUDA_CHECK(cudaMalloc(&d_table, (size_t)(s->n_blocks ? s->n_blocks : 1) * sizeof *table));
        CUDA_CHECK(cudaMemcpy(d_table, table, (size_t)s->n_blocks * sizeof *table, cudaMemcpyHostToDevice));
        allocs[(*n_allocs)++] = d_table;
        if (tail_bytes) {
            CUDA_CHECK(cudaMalloc(&d_tk, tail_bytes));
            CUDA_CHECK(cudaMalloc(&d_tv, tail_bytes));
            CUDA_CHECK(cudaMemcpy(d_tk, s->tail_k, tail_bytes, cudaMemcpyHostToDevice));
            CUDA_CHECK(cudaMemcpy(d_tv, s->tail_v, tail_bytes, cudaMemcpyHostToDevice));
            allocs[(*n_allocs)++] = d_tk;
            allocs[(*n_allocs)++] = d_tv;
        }
        seqs[i] = (cuda_kv_seq){.blocks = d_table, .tail_k = d_tk, .tail_v = d_tv, .n_blocks = s->n_blocks,
                                .tail_tokens = s->tail};
        free(table);
    }
    cuda_kv_seq *d_seqs = NULL;
    CUDA_CHECK(cudaMalloc((void **)&d_seqs, (size_t)n_seqs * sizeof *seqs));
    CUDA_CHECK(cudaMemcpy(d_seqs, seqs, (size_t)n_seqs * sizeof *seqs, cudaMemcpyHostToDevice));
    allocs[(*n_allocs)++] = d_seqs;
    free(seqs);
    return d_seqs;
}

typedef struct gpu_run {
    cuda_kv_layout layout;
    cuda_kv_plan plan;
    float *d_q, *d_out;
    void *d_ws;
    int *d_status;
} gpu_run;

/* Launches on the batch and returns the status flag; out gets n_seqs * nq * D floats. */
static int run_gpu(gpu_run *r, const cuda_kv_seq *d_seqs, const float *q, float *out)
{
    const size_t n = (size_t)r->plan.n_seqs * r->plan.n_q_heads * r->layout.head_dim;
    CUDA_CHECK(cudaMemcpy(r->d_q, q, n * sizeof *q, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(r->d_out, 0xff, n * sizeof *out)); /* NaN everywhere */
    CUDA_CHECK(cudaMemset(r->d_status, 0, sizeof(int)));
    strata_error err = {0};
    if (cuda_kv_attention(&r->layout, &r->plan, d_seqs, r->d_q, r->d_out, r->d_ws, r->d_status, NULL, &err) !=
        STRATA_OK)
        fail_msg("cuda_kv_attention: %s", err.msg);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(out, r->d_out, n * sizeof *out, cudaMemcpyDeviceToHost));
    int status = -1;
    CUDA_CHECK(cudaMemcpy(&status, r->d_status, sizeof status, cudaMemcpyDeviceToHost));
    return status;
}

/* Device buffers of a launch: n query floats in and out, the plan's workspace, the status. */
static void gpu_run_alloc(gpu_run *r, size_t n)
{
    CUDA_CHECK(cudaMalloc((void **)&r->d_q, n * sizeof(float)));
    CUDA_CHECK(cudaMalloc((void **)&r->d_out, n * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&r->d_ws, cuda_kv_attention_workspace(&r->layout, &r->plan)));
    CUDA_CHECK(cudaMalloc((void **)&r->d_status, sizeof(int)));
}

/* Frees them and upload()'s allocations. */
static void gpu_run_free(gpu_run *r, void **allocs, int n_allocs)
{
    for (int i = 0; i < n_allocs; i++)
        CUDA_CHECK(cudaFree(allocs[i]));
    cudaFree(r->d_q);
    cudaFree(r->d_out);
    cudaFree(r->d_ws);
    cudaFree(r->d_status);
}

/* ---- The kernels' loops on the CPU (kernels/cuda/kv_attention_emu.h, shared with the fake
 * device of tests/fakecuda): each phase run for every thread before the next (what the barriers
 * guarantee), on host pointers. */

static int emu_attention(const cuda_kv_layout *L, const cuda_kv_plan *P, const cuda_kv_seq *seqs, const float *q,
                         float *out)
{
    float *ws = malloc(cuda_kv_attention_workspace(L, P));
    assert_non_null(ws);
    const int qpk = P->n_q_heads / L->n_kv_heads;
    const int status = P->kernel == CUDA_KV_KERNEL_AUTO && kv_mma_runs(L, qpk, P->smem_limit ? P->smem_limit : H100_SMEM)
                           ? kv_mma_emu_attention(L, P, seqs, q, out, ws)
                           : kv_att_emu_attention(L, P, seqs, q, out, ws);
    free(ws);
    assert_true(status >= 0);
    return status;
}

/* Host-pointer views of a batch, what the kernel gets as device pointers. */
static cuda_kv_seq *host_views(const host_seq *hs, int n_seqs, size_t slot)
{
    cuda_kv_seq *seqs = calloc((size_t)n_seqs, sizeof *seqs);
    assert_non_null(seqs);
    for (int i = 0; i < n_seqs; i++) {
        const uint8_t **table = malloc((size_t)(hs[i].n_blocks ? hs[i].n_blocks : 1) * sizeof *table);
        assert_non_null(table);
        for (int b = 0; b < hs[i].n_blocks; b++)
            table[b] = hs[i].blocks + (size_t)b * slot;
        seqs[i] = (cuda_kv_seq){.blocks = table, .tail_k = hs[i].tail_k, .tail_v = hs[i].tail_v,
                                .n_blocks = hs[i].n_blocks, .tail_tokens = hs[i].tail};
    }
    return seqs;
}

static void free_host_views(cuda_kv_seq *seqs, int n_seqs)
{
    for (int i = 0; i < n_seqs; i++)
        free((void *)(uintptr_t)seqs[i].blocks);
    free(seqs);
}

static bool emulated;   /* run_case: the kernels emulated on the CPU instead of the GPU */

/* One case; smem_limit: the plan's cap on a thread block's shared memory (0: the device's). */
static void run_case_limited(const test_case *tc, int smem_limit)
{
    kv_codec_params p;
    strata_error err;
    assert_int_equal(kv_codec_parse(tc->codec, &p, &err), STRATA_OK);
    const kv_geometry g = {.n_layers = 1, .n_kv_heads = tc->nkv, .head_dim = tc->D,
                           .block_tokens = tc->block_tokens ? tc->block_tokens : 64};
    assert_int_equal(kv_codec_validate(&p, &g, &err), STRATA_OK);
    const size_t slot = kv_block_size(&p, &g);
    host_seq *hs = calloc((size_t)tc->n_seqs, sizeof *hs);
    assert_non_null(hs);
    int max_blocks = 0;
    for (int i = 0; i < tc->n_seqs; i++) {
        make_seq(&p, &g, tc->n_blocks[i], tc->tails[i], slot, &hs[i]);
        max_blocks = tc->n_blocks[i] > max_blocks ? tc->n_blocks[i] : max_blocks;
    }
    /* The layout comes from a block of the pool; a batch without blocks borrows a fresh one. */
    host_seq tmpl;
    make_seq(&p, &g, 1, 0, slot, &tmpl);
    kv_block b;
    assert_int_equal(kv_block_parse(tmpl.blocks, slot, &b, &err), STRATA_OK);

    gpu_run r = {0};
    assert_int_equal(cuda_kv_layout_from_block(&b, &r.layout, &err), STRATA_OK);
    r.layout.block_bytes = (uint32_t)slot;   /* GEAR, OTT: the largest block; the others: every block */
    int sms = 132;   /* the emulation plans for an H100's multiprocessors */
    if (!emulated)
        CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    assert_int_equal(cuda_kv_attention_plan(&r.layout, tc->n_seqs, tc->nq, max_blocks, sms, &r.plan, &err), STRATA_OK);
    r.plan.kernel = tc->kernel;
    r.plan.smem_limit = smem_limit;
    int allowed = H100_SMEM;
    if (!emulated)
        CUDA_CHECK(cudaDeviceGetAttribute(&allowed, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    if (smem_limit > 0 && smem_limit < allowed)
        allowed = smem_limit;
    const bool mma = tc->kernel == CUDA_KV_KERNEL_AUTO && kv_mma_runs(&r.layout, tc->nq / tc->nkv, (size_t)allowed);
    const size_t per_seq = (size_t)tc->nq * tc->D, n = per_seq * tc->n_seqs;
    float *q = malloc(n * sizeof *q), *out = malloc(n * sizeof *out), *cpu = malloc(per_seq * sizeof *cpu);
    double *ref = malloc(per_seq * sizeof *ref);
    assert_true(q && out && cpu && ref);
    for (size_t i = 0; i < n; i++)
        q[i] = 2.0f * cuda_test_uniform(&seed);
    void *allocs[512];
    int n_allocs = 0;
    if (emulated) {
        cuda_kv_seq *views = host_views(hs, tc->n_seqs, slot);
        for (size_t i = 0; i < n; i++)
            out[i] = NAN;
        assert_int_equal(emu_attention(&r.layout, &r.plan, views, q, out), 0);
        free_host_views(views, tc->n_seqs);
    } else {
        gpu_run_alloc(&r, n);
        const cuda_kv_seq *d_seqs = upload(hs, tc->n_seqs, slot, &g, allocs, &n_allocs);
        assert_int_equal(run_gpu(&r, d_seqs, q, out), 0);
    }
    for (int i = 0; i < tc->n_seqs; i++) {
        reference(&hs[i], &g, slot, q + i * per_seq, tc->nq, ref);
        const double e = cuda_test_rel_error(out + i * per_seq, ref, per_seq);
        const double bound = mma ? REL_BOUND_FP16 : REL_BOUND;
        printf("  %s%s%s nq %d nkv %d D %d seq %d (%d blocks + %d tail, %d splits of %d): rel error %.2e\n",
               emulated ? "emulated " : "", tc->codec, mma ? " (tensor cores)" : "", tc->nq, tc->nkv, tc->D, i,
               hs[i].n_blocks, hs[i].tail, r.plan.n_splits, r.plan.blocks_per_split, e);
        if (!(e <= bound))
            fail_msg("%s vs fp64 reference: %.3e > %.0e", emulated ? "emulated kernel" : "GPU", e, bound);
        if (hs[i].n_blocks + hs[i].tail > 0) {
            cpu_kernel(&hs[i], &g, slot, q + i * per_seq, tc->nq, cpu);
            if (!(cuda_test_rel_error(cpu, ref, per_seq) <= REL_BOUND))
                fail_msg("CPU kernel vs fp64 reference disagree: the reference is suspect");
        } else {
            for (size_t x = 0; x < per_seq; x++)
                assert_true(out[i * per_seq + x] == 0.0f);
        }
    }
    if (!emulated)
        gpu_run_free(&r, allocs, n_allocs);
    for (int i = 0; i < tc->n_seqs; i++)
        free_seq(&hs[i]);
    free_seq(&tmpl);
    free(hs);
    free(q);
    free(out);
    free(cpu);
    free(ref);
}

static void run_case(const test_case *tc)
{
    run_case_limited(tc, 0);
}

static void test_single_sequences(void **state)
{
    (void)state;
    const char *codecs[] = {"fp16", "kivi2", "kivi4", "tada2", "tada4", "tada8", "gear2", "gear4", "ott2", "ott4"};
    static const int blocks[] = {5}, tails[] = {17};
    static const int blocks0[] = {0}, tails0[] = {1};
    for (size_t c = 0; c < 10; c++) {
        const test_case smol = {codecs[c], 9, 3, 64, 1, blocks, tails, 0, 0};
        run_case(&smol);
        const test_case one = {codecs[c], 32, 8, 128, 1, blocks0, tails0, 0, 0};
        run_case(&one);
    }
    /* KIVI without the tensor cores (the staged kernel's fp32 path, which benchmarks compare). */
    for (size_t c = 1; c < 3; c++) {
        const test_case staged = {codecs[c], 32, 8, 128, 1, blocks, tails, 0, CUDA_KV_KERNEL_STAGED};
        run_case(&staged);
    }
}

static void test_batches_of_unequal_lengths(void **state)
{
    (void)state;
    const char *codecs[] = {"fp16", "kivi2", "kivi4", "tada2", "tada4", "gear2", "ott2"};
    static const int blocks[] = {0, 3, 37, 0, 130}, tails[] = {40, 0, 100, 0, 191};
    for (size_t c = 0; c < 7; c++) {
        const test_case llama = {codecs[c], 32, 8, 128, 5, blocks, tails, 0, 0};
        run_case(&llama);
        const test_case smol = {codecs[c], 9, 3, 64, 5, blocks, tails, 0, 0};
        run_case(&smol);
    }
}

static void test_group_shapes(void **state)
{
    (void)state;
    static const int blocks[] = {9, 2}, tails[] = {63, 64};
    /* One query head per KV head; 16 per KV head (the limit, the generic kernel's); head_dim 256
     * (the generic kernel's). Then the staged kernel's compiled head counts (1, 2, 3, 4, 8; 5 runs
     * as 8 with zero heads) and its block sizes (16, 32, 64 tokens). */
    const test_case cases[] = {
        {"kivi2", 4, 4, 128, 2, blocks, tails, 0, 0},      {"kivi4", 16, 1, 128, 2, blocks, tails, 0, 0},
        {"fp16", 8, 2, 256, 2, blocks, tails, 0, 0},       {"kivi2", 16, 2, 64, 2, blocks, tails, 0, 0},
        {"fp16", 10, 2, 128, 2, blocks, tails, 0, 0},      {"kivi4", 16, 8, 128, 2, blocks, tails, 0, 0},
        {"kivi2-g16", 9, 3, 64, 2, blocks, tails, 16, 0},  {"kivi4", 32, 8, 128, 2, blocks, tails, 32, 0},
        {"fp16", 32, 8, 128, 2, blocks, tails, 16, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        run_case(&cases[i]);
}

/* On a GPU that allows a thread block 99 KiB of shared memory (sm_86/89/120), the tensor-core
 * layouts that need more run on the staged or generic kernel, right (fp32 bound), instead of
 * failing the launch; a cap below what even the generic kernel needs fails with
 * STRATA_EUNSUPPORTED naming both sizes. Here the cap comes from the plan, on the lent GPU. */
static void test_small_shared_memory(void **state)
{
    (void)state;
    static const int blocks[] = {6, 1}, tails[] = {33, 64};
    const int ada = 101376;
    const test_case cases[] = {
        {"kivi4-g8", 32, 8, 128, 2, blocks, tails, 0, 0},
        {"tada4-g8", 32, 8, 128, 2, blocks, tails, 0, 0},
        {"gear4-g32", 32, 8, 128, 2, blocks, tails, 0, 0},
        {"ott4-g16", 32, 8, 128, 2, blocks, tails, 0, 0},
        {"kivi2", 32, 8, 128, 2, blocks, tails, 0, 0},   /* fits: still the tensor cores */
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        kv_codec_params p;
        strata_error err;
        assert_int_equal(kv_codec_parse(cases[i].codec, &p, &err), STRATA_OK);
        const cuda_kv_layout l = {.codec = (int)p.codec, .k_bits = p.bits, .v_bits = p.bits, .k_group = p.group,
                                  .v_group = p.group, .n_kv_heads = 8, .head_dim = 128, .block_tokens = 64};
        /* Not vacuous: each of the first four needs more than 99 KiB on the tensor cores. */
        assert_true(kv_mma_eligible(&l, 4));
        assert_true(kv_mma_runs(&l, 4, (size_t)ada) == (i == 4));
        run_case_limited(&cases[i], ada);
    }

    static const int one[] = {2}, tail1[] = {5};
    const test_case fp16 = {"fp16", 32, 8, 128, 1, one, tail1, 0, 0};
    gpu_run r = {0};
    kv_codec_params p;
    strata_error err = {0};
    assert_int_equal(kv_codec_parse("fp16", &p, &err), STRATA_OK);
    const kv_geometry g = {.n_layers = 1, .n_kv_heads = 8, .head_dim = 128, .block_tokens = 64};
    const size_t slot = kv_block_size(&p, &g);
    host_seq hs;
    make_seq(&p, &g, one[0], tail1[0], slot, &hs);
    kv_block b;
    assert_int_equal(kv_block_parse(hs.blocks, slot, &b, &err), STRATA_OK);
    assert_int_equal(cuda_kv_layout_from_block(&b, &r.layout, &err), STRATA_OK);
    assert_int_equal(cuda_kv_attention_plan(&r.layout, 1, fp16.nq, one[0], 132, &r.plan, &err), STRATA_OK);
    r.plan.smem_limit = 4096;   /* the generic kernel needs about 14 KiB here */
    const size_t n = (size_t)fp16.nq * 128;
    gpu_run_alloc(&r, n);
    void *allocs[8];
    int n_allocs = 0;
    const cuda_kv_seq *d_seqs = upload(&hs, 1, slot, &g, allocs, &n_allocs);
    float *q = calloc(n, sizeof *q);
    assert_non_null(q);
    CUDA_CHECK(cudaMemcpy(r.d_q, q, n * sizeof *q, cudaMemcpyHostToDevice));
    const int rc = cuda_kv_attention(&r.layout, &r.plan, d_seqs, r.d_q, r.d_out, r.d_ws, r.d_status, NULL, &err);
    if (rc != STRATA_EUNSUPPORTED || !strstr(err.msg, "this GPU allows 4096"))
        fail_msg("a 4 KiB cap: %d (%s)", rc, err.msg);
    CUDA_CHECK(cudaDeviceSynchronize());
    gpu_run_free(&r, allocs, n_allocs);
    free_seq(&hs);
    free(q);
}

/* A table entry pointing at the wrong block (swapped positions) or at nothing must be reported. */
static void test_bad_tables_raise_status(void **state)
{
    (void)state;
    kv_codec_params p;
    strata_error err;
    assert_int_equal(kv_codec_parse("kivi2", &p, &err), STRATA_OK);
    const kv_geometry g = {.n_layers = 1, .n_kv_heads = 2, .head_dim = 64, .block_tokens = 64};
    const size_t slot = kv_block_size(&p, &g);
    host_seq hs;
    make_seq(&p, &g, 4, 5, slot, &hs);
    kv_block b;
    assert_int_equal(kv_block_parse(hs.blocks, slot, &b, &err), STRATA_OK);
    gpu_run r;
    assert_int_equal(cuda_kv_layout_from_block(&b, &r.layout, &err), STRATA_OK);
    assert_int_equal(cuda_kv_attention_plan(&r.layout, 1, 4, 4, 1, &r.plan, &err), STRATA_OK);
    gpu_run_alloc(&r, 4 * 64);
    void *allocs[8];
    int n_allocs = 0;
    cuda_kv_seq *d_seqs = upload(&hs, 1, slot, &g, allocs, &n_allocs);
    cuda_kv_seq seq;
    CUDA_CHECK(cudaMemcpy(&seq, d_seqs, sizeof seq, cudaMemcpyDeviceToHost));
    const uint8_t *table[4];
    CUDA_CHECK(cudaMemcpy(table, seq.blocks, sizeof table, cudaMemcpyDeviceToHost));
    float q[4 * 64], out[4 * 64];
    for (int i = 0; i < 4 * 64; i++)
        q[i] = cuda_test_uniform(&seed);
    assert_int_equal(run_gpu(&r, d_seqs, q, out), 0);

    const uint8_t *swapped[4] = {table[1], table[0], table[2], table[3]};
    CUDA_CHECK(cudaMemcpy((void *)seq.blocks, swapped, sizeof swapped, cudaMemcpyHostToDevice));
    assert_int_equal(run_gpu(&r, d_seqs, q, out), 1);

    const uint8_t *holed[4] = {table[0], NULL, table[2], table[3]};
    CUDA_CHECK(cudaMemcpy((void *)seq.blocks, holed, sizeof holed, cudaMemcpyHostToDevice));
    assert_int_equal(run_gpu(&r, d_seqs, q, out), 2);

    gpu_run_free(&r, allocs, n_allocs);
    free_seq(&hs);
}

/* What reads a damaged GEAR block: the attention kernel the plan names, or the prompt chunk's
 * dequantization (cuda_kv_dequantize_view, GPU only: its CPU emulation is the fake device's). */
enum { GEAR_READ_DEQUANT = -1 };

/* A GEAR block that breaks the format where the block's lookups do not look by themselves
 * (docs/format.md: outlier indices inside their vector and strictly ascending, 4b; sections on
 * the 64-byte grid, 2.2) must raise status 1, emulated or on the GPU, whichever reads it: the
 * tensor-core kernel, the generic one or the dequantization. damage: 0 none, 1 a key vector's
 * second index equal to its first, 2 a value index past the head's channels, 3 the key outliers'
 * section moved 4 bytes (its bytes still inside the block), 4 the key codes' section declared
 * 64 bytes shorter than the layout's (the kernels would read the layout's length regardless). */
static int gear_damage_status(int damage, int reader, bool on_gpu)
{
    kv_codec_params p;
    strata_error err;
    assert_int_equal(kv_codec_parse("gear2", &p, &err), STRATA_OK);
    const kv_geometry g = {.n_layers = 1, .n_kv_heads = 2, .head_dim = 64, .block_tokens = 64};
    const size_t slot = kv_block_size(&p, &g);
    host_seq hs;
    make_seq(&p, &g, 3, 5, slot, &hs);
    uint8_t *blk = hs.blocks + slot;   /* block 1 */
    kv_block b;
    assert_int_equal(kv_block_parse(blk, slot, &b, &err), STRATA_OK);
    assert_true(b.desc.k_sparse >= 2 && b.desc.v_sparse >= 2);
    uint8_t *ks = (uint8_t *)(uintptr_t)kv_block_section_data(&b, KV_SEC_GEAR_K_SPARSE, NULL);
    uint8_t *vs = (uint8_t *)(uintptr_t)kv_block_section_data(&b, KV_SEC_GEAR_V_SPARSE, NULL);
    assert_true(ks && vs);
    if (damage == 1)
        memcpy(ks + 4, ks, 2);
    if (damage == 2) {
        vs[0] = 64;
        vs[1] = 0;
    }
    if (damage == 3)
        for (int i = 0; i < b.n_sections; i++)
            if (blk[64 + 12 * i] == KV_SEC_GEAR_K_SPARSE)
                blk[64 + 12 * i + 4] += 4;
    if (damage == 4)
        for (int i = 0; i < b.n_sections; i++)
            if (blk[64 + 12 * i] == KV_SEC_K_CODES)
                kv_st32(blk + 64 + 12 * i + 8, kv_ld32(blk + 64 + 12 * i + 8) - 64);
    kv_block tmpl;
    assert_int_equal(kv_block_parse(hs.blocks, slot, &tmpl, &err), STRATA_OK);
    gpu_run r = {0};
    assert_int_equal(cuda_kv_layout_from_block(&tmpl, &r.layout, &err), STRATA_OK);
    r.layout.block_bytes = (uint32_t)slot;
    assert_int_equal(cuda_kv_attention_plan(&r.layout, 1, 4, 3, 132, &r.plan, &err), STRATA_OK);
    assert_true(kv_mma_eligible(&r.layout, 2));
    if (reader != GEAR_READ_DEQUANT)
        r.plan.kernel = (cuda_kv_kernel)reader;
    float q[4 * 64], out[4 * 64];
    for (int i = 0; i < 4 * 64; i++)
        q[i] = cuda_test_uniform(&seed);
    int status;
    if (on_gpu) {
        gpu_run_alloc(&r, 4 * 64);
        void *allocs[8];
        int n_allocs = 0;
        const cuda_kv_seq *d_seqs = upload(&hs, 1, slot, &g, allocs, &n_allocs);
        if (reader == GEAR_READ_DEQUANT) {
            cuda_kv_seq seq;
            float *rows;
            const size_t n_rows = (size_t)(3 * 64 + 5) * 2 * 64;   /* tokens x heads x channels */
            CUDA_CHECK(cudaMemcpy(&seq, d_seqs, sizeof seq, cudaMemcpyDeviceToHost));
            CUDA_CHECK(cudaMalloc((void **)&rows, 2 * n_rows * sizeof *rows));
            CUDA_CHECK(cudaMemset(r.d_status, 0, sizeof(int)));
            if (cuda_kv_dequantize_view(&r.layout, &seq, rows, rows + n_rows, r.d_status, NULL, &err) != STRATA_OK)
                fail_msg("cuda_kv_dequantize_view: %s", err.msg);
            CUDA_CHECK(cudaMemcpy(&status, r.d_status, sizeof status, cudaMemcpyDeviceToHost));
            CUDA_CHECK(cudaFree(rows));
        } else {
            status = run_gpu(&r, d_seqs, q, out);
        }
        gpu_run_free(&r, allocs, n_allocs);
    } else {
        cuda_kv_seq *views = host_views(&hs, 1, slot);
        status = emu_attention(&r.layout, &r.plan, views, q, out);
        free_host_views(views, 1);
    }
    free_seq(&hs);
    return status;
}

static void check_gear_damage(bool on_gpu)
{
    const int readers[] = {CUDA_KV_KERNEL_AUTO, CUDA_KV_KERNEL_GENERIC, GEAR_READ_DEQUANT};
    const char *names[] = {"tensor-core kernel", "generic kernel", "dequantization"};
    for (int x = 0; x < (on_gpu ? 3 : 2); x++)
        for (int damage = 0; damage <= 4; damage++) {
            const int status = gear_damage_status(damage, readers[x], on_gpu);
            printf("  %sGEAR block, damage %d, %s: status %d\n", on_gpu ? "" : "emulated ", damage, names[x], status);
            assert_int_equal(status, damage ? 1 : 0);
        }
}

static void test_damaged_gear_blocks(void **state)
{
    (void)state;
    check_gear_damage(true);
}

/* Causal attention in fp64 over K/V [n][nkv][D] (fp16 values): query i attends to keys 0..i. */
static void prefill_reference(const float *q, const float *k, const float *v, int n, int nq, int nkv, int D, double *ref)
{
    double *w = malloc((size_t)n * sizeof *w);
    assert_non_null(w);
    for (int i = 0; i < n; i++)
        for (int h = 0; h < nq; h++) {
            const size_t kh = (size_t)(h / (nq / nkv)), at = (size_t)i * nq + (size_t)h;
            cuda_test_attend_fp64(q + at * D, k + kh * D, v + kh * D, (size_t)i + 1, (size_t)nkv * D, D, w,
                                  ref + at * D);
        }
    free(w);
}

/* Prefill through cuBLAS (cuda_attention_prefill_gemm, the forward pass's path): causal attention
 * over fp16 K/V values (widened to fp32, as the forward pass does) against fp64, with
 * kern_attention_causal on the same values as a second opinion; prompts of 2 to 1100 tokens. */
static void test_prefill(void **state)
{
    (void)state;
    const int shapes[][3] = {{9, 3, 64}, {32, 8, 128}, {16, 1, 128}};
    /* 1100 tokens of 16 query heads per KV head: the score tiles (32 MiB) hold 476 query rows, so
     * it runs in three tiles; every length also runs with the smallest workspace (16 rows a
     * tile). */
    const int lengths[] = {2, 63, 64, 65, 200, 1100};
    cublasHandle_t blas;
    assert_int_equal(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
    for (size_t sh = 0; sh < 3; sh++) {
        for (size_t li = 0; li < 6; li++) {
            if (lengths[li] > 200 && sh != 2)
                continue;
            const int nq = shapes[sh][0], nkv = shapes[sh][1], D = shapes[sh][2], n = lengths[li];
            const size_t nqd = (size_t)n * nq * D, nkd = (size_t)n * nkv * D;
            float *q = malloc(nqd * sizeof *q), *k = malloc(nkd * sizeof *k), *v = malloc(nkd * sizeof *v);
            float *out = malloc(nqd * sizeof *out), *scratch = malloc(kern_attention_causal_scratch((size_t)n) * 4);
            float *cpu = malloc(nqd * sizeof *cpu);
            uint16_t *k16 = malloc(nkd * 2), *v16 = malloc(nkd * 2);
            double *ref = malloc(nqd * sizeof *ref);
            assert_true(q && k && v && out && scratch && cpu && k16 && v16 && ref);
            for (size_t i = 0; i < nqd; i++)
                q[i] = 2.0f * cuda_test_uniform(&seed);
            for (size_t i = 0; i < nkd; i++) {
                k16[i] = strata_float_to_half(2.0f * cuda_test_uniform(&seed));
                v16[i] = strata_float_to_half(cuda_test_uniform(&seed));
                k[i] = strata_half_to_float(k16[i]);
                v[i] = strata_half_to_float(v16[i]);
            }
            kern_attention_causal(q, k, v, (size_t)n, (size_t)nq, (size_t)nkv, (size_t)D, cpu, scratch);
            prefill_reference(q, k, v, n, nq, nkv, D, ref);
            const double ec = cuda_test_rel_error(cpu, ref, nqd);
            printf("  prefill n %d nq %d nkv %d D %d: cpu %.2e vs fp64\n", n, nq, nkv, D, ec);
            if (!(ec <= REL_BOUND))
                fail_msg("prefill n %d: cpu %.3e > %.0e", n, ec, REL_BOUND);
            float *dq, *dout, *dk32, *dv32;
            void *dws;
            strata_error err = {0};
            const size_t ws = cuda_prefill_workspace(0, n, nq, nkv);
            assert_true(ws > 0);
            CUDA_CHECK(cudaMalloc((void **)&dq, nqd * 4));
            CUDA_CHECK(cudaMalloc((void **)&dout, nqd * 4));
            CUDA_CHECK(cudaMalloc((void **)&dk32, nkd * 4));
            CUDA_CHECK(cudaMalloc((void **)&dv32, nkd * 4));
            CUDA_CHECK(cudaMalloc(&dws, ws));
            CUDA_CHECK(cudaMemcpy(dq, q, nqd * 4, cudaMemcpyHostToDevice));
            CUDA_CHECK(cudaMemcpy(dk32, k, nkd * 4, cudaMemcpyHostToDevice));
            CUDA_CHECK(cudaMemcpy(dv32, v, nkd * 4, cudaMemcpyHostToDevice));
            const size_t ws_min = (size_t)(nq / nkv) * (size_t)(n < 16 ? n : 16) * (size_t)n * 4;
            assert_int_equal(cuda_attention_prefill_gemm(blas, dq, dk32, dv32, 0, n, nq, nkv, D, dout, dws, ws_min - 4,
                                                         &err),
                             STRATA_EINVAL);   /* a workspace too small is refused, nothing launched */
            for (int small = 0; small < 2; small++) {
                CUDA_CHECK(cudaMemset(dout, 0xff, nqd * 4));   /* NaN everywhere */
                if (cuda_attention_prefill_gemm(blas, dq, dk32, dv32, 0, n, nq, nkv, D, dout, dws, small ? ws_min : ws,
                                                &err) != STRATA_OK)
                    fail_msg("cuda_attention_prefill_gemm: %s", err.msg);
                CUDA_CHECK(cudaDeviceSynchronize());
                CUDA_CHECK(cudaMemcpy(out, dout, nqd * 4, cudaMemcpyDeviceToHost));
                const double eg = cuda_test_rel_error(out, ref, nqd);
                printf("  prefill n %d nq %d nkv %d D %d: cuBLAS %.2e vs fp64 (%s workspace)\n", n, nq, nkv, D, eg,
                       small ? "smallest" : "full");
                if (!(eg <= REL_BOUND))
                    fail_msg("cuBLAS prefill n %d: %.3e > %.0e", n, eg, REL_BOUND);
            }
            cudaFree(dk32);
            cudaFree(dv32);
            cudaFree(dws);
            cudaFree(dq);
            cudaFree(dout);
            free(q); free(k); free(v); free(out); free(scratch); free(cpu); free(k16); free(v16); free(ref);
        }
    }
    cublasDestroy(blas);
}

/* The harness itself, without a GPU: the fp64 reference and the CPU kernel agree on the blocks
 * this file builds, so a GPU failure points at the GPU kernel, not at the test. */
static void test_reference_matches_cpu_kernel(void **state)
{
    (void)state;
    const char *codecs[] = {"fp16", "kivi2", "kivi4", "tada2", "tada8", "gear2", "gear4", "ott2", "ott4"};
    const int shapes[][3] = {{9, 3, 64}, {32, 8, 128}};
    for (size_t c = 0; c < 9; c++) {
        for (size_t sh = 0; sh < 2; sh++) {
            kv_codec_params p;
            strata_error err;
            assert_int_equal(kv_codec_parse(codecs[c], &p, &err), STRATA_OK);
            const int nq = shapes[sh][0], D = shapes[sh][2];
            const kv_geometry g = {.n_layers = 1, .n_kv_heads = shapes[sh][1], .head_dim = D, .block_tokens = 64};
            const size_t slot = kv_block_size(&p, &g), n = (size_t)nq * D;
            host_seq hs;
            make_seq(&p, &g, 6, 100, slot, &hs);
            float *q = malloc(n * sizeof *q), *cpu = malloc(n * sizeof *cpu);
            double *ref = malloc(n * sizeof *ref);
            assert_true(q && cpu && ref);
            for (size_t i = 0; i < n; i++)
                q[i] = 2.0f * cuda_test_uniform(&seed);
            reference(&hs, &g, slot, q, nq, ref);
            cpu_kernel(&hs, &g, slot, q, nq, cpu);
            const double e = cuda_test_rel_error(cpu, ref, n);
            printf("  harness %s nq %d D %d: CPU kernel vs fp64 reference %.2e\n", codecs[c], nq, D, e);
            assert_true(e <= REL_BOUND);
            free_seq(&hs);
            free(q);
            free(cpu);
            free(ref);
        }
    }
}

/* The same cases with the kernels' phases emulated on the CPU (smaller batches: the emulation is
 * slow), and the status for a bad table. */
/* The tensor-core kernel's fragments (kernels/cuda/kv_attention_mma.h) address every key and value
 * of a staged block once and decode it to its dequantized value: the B registers of every lane,
 * read back through the mma.sync layout as documented there (b0: rows 2tig, 2tig+1, b1: rows
 * 2tig+8, 2tig+9, column gid), against kv_block_decode: each within half an fp16 ulp (the
 * kernel rounds scale * code + zero once). */
static void check_fragments(const char *codec, int D, int BT)
{
    kv_codec_params p;
    strata_error err;
    assert_int_equal(kv_codec_parse(codec, &p, &err), STRATA_OK);
    const int H = 2;
    const kv_geometry g = {.n_layers = 1, .n_kv_heads = H, .head_dim = D, .block_tokens = BT};
    assert_int_equal(kv_codec_validate(&p, &g, &err), STRATA_OK);
    const size_t slot = kv_block_size(&p, &g);
    host_seq hs;
    make_seq(&p, &g, 1, 0, slot, &hs);
    kv_block b;
    assert_int_equal(kv_block_parse(hs.blocks, slot, &b, &err), STRATA_OK);
    cuda_kv_layout L;
    assert_int_equal(cuda_kv_layout_from_block(&b, &L, &err), STRATA_OK);
    assert_true(kv_mma_eligible(&L, 4));
    const size_t n = (size_t)BT * H * D;
    float *k = malloc(n * sizeof *k), *v = malloc(n * sizeof *v);
    const kv_mma_stage S = kv_mma_stage_of(&L);
    uint8_t *st = aligned_alloc(16, S.bytes);
    int *seen = calloc((size_t)BT * D, sizeof *seen);
    assert_true(k && v && st && seen);
    assert_int_equal(kv_block_decode(&b, k, v, &err), STRATA_OK);
    const int kshift = __builtin_ctz((unsigned)L.k_group), vshift = __builtin_ctz((unsigned)L.v_group), B = L.k_bits;
    for (int h = 0; h < H; h++)
        for (int part = 0; part < 2; part++) {   /* keys, then values */
            const float *ref = part ? v : k;
            kv_mma_emu_stage(&L, &S, hs.blocks, h, st);
            uint8_t *sec = st + (part ? S.off_vz : S.off_kz);
            const int rows = part ? BT : D, groups = part ? S.v_groups : S.k_groups;
            for (int lane = 0; lane < 32; lane++)
                kv_mma_section_prep(sec, rows, groups, lane);
            memset(seen, 0, (size_t)BT * D * sizeof *seen);
            /* keys: kk over channel steps, n over 8-token tiles; values: kv over token steps, n over
             * 8-channel tiles. Row r of the contraction, column col of the tile. */
            const int steps = part ? BT / 16 : D / 16, tiles = part ? D / 8 : BT / 8;
            const int row_bytes = part ? S.v_row_bytes : S.k_row_bytes, shift = part ? vshift : kshift;
            const uint8_t *codes = st + (part ? S.off_vc : 0);
            for (int ks = 0; ks < steps; ks++)
                for (int tile = 0; tile < tiles; tile++)
                    for (int lane = 0; lane < 32; lane++) {
                        const int gid = lane >> 2, tig = lane & 3, col = 8 * tile + gid, grp = (8 * tile) >> shift;
                        const kv_mma_lane cl = kv_mma_lane_of(lane, B);
                        for (int reg = 0; reg < 2; reg++) {   /* b0, b1 */
                            const int r = 16 * ks + 2 * tig + 8 * reg;
                            const uint8_t *w = codes + 4 * (size_t)kv_mma_word_of(tile, B);
                            const uint32_t x = kv_mma_codes(kv_mma_ld(w + (size_t)r * row_bytes),
                                                            kv_mma_ld(w + (size_t)(r + 1) * row_bytes), &cl, tile, B);
                            const uint32_t got = kv_mma_dequant(x, kv_mma_ld(sec + kv_mma_scale_offset(r, groups, grp)),
                                                                kv_mma_ld(sec + kv_mma_zero_offset(r, groups, grp)), B);
                            for (int hi = 0; hi < 2; hi++) {
                                /* keys: contraction rows are channels, columns tokens; values the reverse */
                                const int t = part ? r + hi : col, c = part ? col : r + hi;
                                const float want = ref[((size_t)t * H + h) * D + c];
                                const float have = strata_half_to_float((uint16_t)(got >> (16 * hi)));
                                if (!(fabsf(have - want) <= fabsf(want) * 0x1p-11f + 0x1p-25f))
                                    fail_msg("%s D %d BT %d %s head %d token %d channel %d: %g, decoded %g", codec, D,
                                             BT, part ? "value" : "key", h, t, c, have, want);
                                seen[t * D + c]++;
                            }
                        }
                    }
            for (int i = 0; i < BT * D; i++)
                if (seen[i] != 1)
                    fail_msg("%s D %d BT %d: element %d addressed %d times", codec, D, BT, i, seen[i]);
        }
    free(k);
    free(v);
    free(st);
    free(seen);
    free_seq(&hs);
}

static void test_mma_fragments(void **state)
{
    (void)state;
    /* Every group size the kernel takes (kv_mma_eligible: 64-token blocks). */
    static const char *codecs[] = {"kivi2-g16", "kivi2", "kivi2-g64", "kivi4-g8", "kivi4-g16", "kivi4", "kivi4-g64"};
    for (size_t c = 0; c < sizeof codecs / sizeof *codecs; c++)
        for (int D = 64; D <= 128; D *= 2)
            check_fragments(codecs[c], D, 64);
}

static void test_emulated_kernels(void **state)
{
    (void)state;
    emulated = true;
    const char *codecs[] = {"fp16", "kivi2", "kivi4", "tada4", "tada8", "gear2", "gear4", "ott2", "ott4"};
    static const int blocks[] = {0, 3, 9, 0}, tails[] = {40, 0, 191, 0};
    static const int blocks1[] = {5}, tails1[] = {17};
    for (size_t c = 0; c < 9; c++) {
        const test_case smol = {codecs[c], 9, 3, 64, 1, blocks1, tails1, 0, 0};
        run_case(&smol);
        const test_case llama = {codecs[c], 32, 8, 128, 4, blocks, tails, 0, 0};
        run_case(&llama);
    }
    static const int blocks2[] = {9, 2}, tails2[] = {63, 64};
    const test_case wide = {"kivi4", 16, 1, 128, 2, blocks2, tails2, 0, 0};
    run_case(&wide);
    /* Tensor cores, a short sequence (blocks and a tail) beside a long one: the splits past the
     * short one's tail must not attend it again. */
    const test_case tc_one = {"kivi2", 4, 4, 128, 2, blocks2, tails2, 0, 0};
    run_case(&tc_one);
    const test_case tc_g16 = {"kivi2-g16", 9, 3, 64, 2, blocks2, tails2, 0, 0};
    run_case(&tc_g16);
    emulated = false;

    /* A swapped table raises status 1 in the emulation as on the GPU. */
    kv_codec_params p;
    strata_error err;
    assert_int_equal(kv_codec_parse("kivi2", &p, &err), STRATA_OK);
    const kv_geometry g = {.n_layers = 1, .n_kv_heads = 2, .head_dim = 64, .block_tokens = 64};
    const size_t slot = kv_block_size(&p, &g);
    host_seq hs;
    make_seq(&p, &g, 3, 5, slot, &hs);
    kv_block b;
    cuda_kv_layout layout;
    cuda_kv_plan plan;
    assert_int_equal(kv_block_parse(hs.blocks, slot, &b, &err), STRATA_OK);
    assert_int_equal(cuda_kv_layout_from_block(&b, &layout, &err), STRATA_OK);
    assert_int_equal(cuda_kv_attention_plan(&layout, 1, 4, 3, 132, &plan, &err), STRATA_OK);
    cuda_kv_seq *views = host_views(&hs, 1, slot);
    const uint8_t **table = (const uint8_t **)(uintptr_t)views[0].blocks;
    const uint8_t *t0 = table[0];
    table[0] = table[1];
    table[1] = t0;
    float q[4 * 64], out[4 * 64];
    for (int i = 0; i < 4 * 64; i++)
        q[i] = cuda_test_uniform(&seed);
    assert_int_equal(emu_attention(&layout, &plan, views, q, out), 1);
    free_host_views(views, 1);
    free_seq(&hs);

    /* An OTT block naming a head that does not exist is rejected, not read out of bounds; so is
     * one whose entries repeat a pair (two lanes would write one score, the value added twice)
     * or leave (token, head) order. */
    assert_int_equal(kv_codec_parse("ott2", &p, &err), STRATA_OK);
    const size_t oslot = kv_block_size(&p, &g);
    make_seq(&p, &g, 3, 5, oslot, &hs);
    assert_int_equal(kv_block_parse(hs.blocks, oslot, &b, &err), STRATA_OK);
    assert_true(b.desc.ott_tokens > 0);
    uint8_t *entries = (uint8_t *)(uintptr_t)kv_block_section_data(&b, KV_SEC_OTT_TOKENS, NULL);
    assert_non_null(entries);
    assert_int_equal(cuda_kv_layout_from_block(&b, &layout, &err), STRATA_OK);
    layout.block_bytes = (uint32_t)oslot;
    assert_int_equal(cuda_kv_attention_plan(&layout, 1, 4, 3, 132, &plan, &err), STRATA_OK);
    views = host_views(&hs, 1, oslot);
    assert_int_equal(emu_attention(&layout, &plan, views, q, out), 0);
    assert_int_equal(b.desc.ott_tokens, 2);   /* block 0: (head 0, token 0), (head 1, token 5) */
    uint8_t pair[8];
    memcpy(pair, entries, sizeof pair);
    entries[0] = 99;   /* head 99 of 2 */
    assert_int_equal(emu_attention(&layout, &plan, views, q, out), 1);
    memcpy(entries + 4, pair, 4);   /* the first pair twice */
    memcpy(entries, pair, 4);
    assert_int_equal(emu_attention(&layout, &plan, views, q, out), 1);
    memcpy(entries, pair + 4, 4);   /* the two pairs swapped */
    memcpy(entries + 4, pair, 4);
    assert_int_equal(emu_attention(&layout, &plan, views, q, out), 1);
    memcpy(entries, pair, sizeof pair);
    assert_int_equal(emu_attention(&layout, &plan, views, q, out), 0);
    free_host_views(views, 1);
    free_seq(&hs);

    check_gear_damage(false);
}

/* A prompt chunk continuing a sequence: n chunk rows over a cache of n_blocks blocks and a tail,
 * then the chunk's own rows, causal. The fp64 reference (reference() on the cache with the
 * chunk's first i + 1 rows appended to its tail, per row) against the CPU's
 * kern_kv_attention_rows on the same view and, on the device, against the forward pass's path:
 * the cache written out as fp32 rows (cuda_kv_dequantize_view), the chunk's rows after them, the
 * cuBLAS prefill with the cache as the past (output poisoned before). */
static void chunk_case(const char *codec, int nq, int nkv, int D, int n_blocks, int tail, int n, bool on_gpu)
{
    kv_codec_params p;
    strata_error err = {0};
    assert_int_equal(kv_codec_parse(codec, &p, &err), STRATA_OK);
    const kv_geometry g = {.n_layers = 1, .n_kv_heads = nkv, .head_dim = D, .block_tokens = 64};
    const size_t slot = kv_block_size(&p, &g), row = (size_t)nkv * D, nqd = (size_t)n * nq * D;
    host_seq hs;
    make_seq(&p, &g, n_blocks, tail, slot, &hs);
    /* the view with the chunk after the tail, as the model builds it for the CPU kernel */
    host_seq ext = hs;
    ext.tail = tail + n;
    ext.tail_k = malloc((size_t)ext.tail * row * 2);
    ext.tail_v = malloc((size_t)ext.tail * row * 2);
    float *q = malloc(nqd * sizeof *q), *cpu = malloc(nqd * sizeof *cpu);
    double *ref = malloc(nqd * sizeof *ref);
    assert_true(ext.tail_k && ext.tail_v && q && cpu && ref);
    memcpy(ext.tail_k, hs.tail_k, (size_t)tail * row * 2);
    memcpy(ext.tail_v, hs.tail_v, (size_t)tail * row * 2);
    uint16_t *ck = ext.tail_k + (size_t)tail * row, *cv = ext.tail_v + (size_t)tail * row;
    for (size_t i = 0; i < (size_t)n * row; i++) {
        ck[i] = strata_float_to_half(2.0f * cuda_test_uniform(&seed));
        cv[i] = strata_float_to_half(cuda_test_uniform(&seed));
    }
    for (size_t i = 0; i < nqd; i++)
        q[i] = 2.0f * cuda_test_uniform(&seed);
    for (int i = 0; i < n; i++) {   /* fp64: row i sees the cache and chunk rows 0..i */
        host_seq cut = ext;
        cut.tail = tail + i + 1;
        reference(&cut, &g, slot, q + (size_t)i * nq * D, nq, ref + (size_t)i * nq * D);
    }
    const uint8_t **ptrs = malloc((size_t)(n_blocks ? n_blocks : 1) * sizeof *ptrs);
    assert_non_null(ptrs);
    for (int b = 0; b < n_blocks; b++)
        ptrs[b] = hs.blocks + (size_t)b * slot;
    const kv_layer_view view = {.layer = 0, .n_kv_heads = nkv, .head_dim = D, .block_tokens = 64,
                                .n_blocks = (size_t)n_blocks, .blocks = ptrs, .block_bytes = slot,
                                .tail_tokens = (size_t)ext.tail, .tail_k = ext.tail_k, .tail_v = ext.tail_v};
    void *scratch = aligned_alloc(64, (kern_kv_attention_rows_scratch(&view, nq, (size_t)n) + 63) & ~(size_t)63);
    assert_non_null(scratch);
    assert_int_equal(kern_kv_attention_rows(&view, q, (size_t)n, nq, (size_t)n_blocks * 64 + (size_t)tail + 1, cpu,
                                            scratch, &err), STRATA_OK);
    const double ec = cuda_test_rel_error(cpu, ref, nqd);
    if (!on_gpu) {
        printf("  chunk %s nq %d nkv %d D %d, %d blocks + %d tail + %d rows: cpu %.2e vs fp64\n", codec, nq, nkv, D,
               n_blocks, tail, n, ec);
    } else {
        cuda_kv_layout layout = {0};
        if (n_blocks) {
            kv_block b;
            assert_int_equal(kv_block_parse(hs.blocks, slot, &b, &err), STRATA_OK);
            assert_int_equal(cuda_kv_layout_from_block(&b, &layout, &err), STRATA_OK);
        } else {
            layout = (cuda_kv_layout){.codec = KV_CODEC_FP16, .block_tokens = 64, .n_kv_heads = nkv, .head_dim = D};
        }
        layout.block_bytes = (uint32_t)slot;
        void *allocs[8];
        int n_allocs = 0;
        cuda_kv_seq *d_seq = upload(&hs, 1, slot, &g, allocs, &n_allocs), seq;
        CUDA_CHECK(cudaMemcpy(&seq, d_seq, sizeof seq, cudaMemcpyDeviceToHost));
        const size_t past = (size_t)n_blocks * 64 + (size_t)tail, rows = past + (size_t)n;
        float *dq, *dout, *dctx, *chunk32 = malloc((size_t)n * row * 4), *out = malloc(nqd * 4);
        int *dstatus;
        void *dws;
        assert_true(chunk32 && out);
        const size_t ws = cuda_prefill_workspace((int)past, n, nq, nkv);
        CUDA_CHECK(cudaMalloc((void **)&dq, nqd * 4));
        CUDA_CHECK(cudaMalloc((void **)&dout, nqd * 4));
        CUDA_CHECK(cudaMalloc((void **)&dstatus, sizeof(int)));
        CUDA_CHECK(cudaMalloc((void **)&dctx, 2 * rows * row * 4));
        CUDA_CHECK(cudaMalloc(&dws, ws));
        CUDA_CHECK(cudaMemcpy(dq, q, nqd * 4, cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemset(dstatus, 0, sizeof(int)));
        assert_int_equal(cuda_kv_dequantize_view(&layout, &seq, dctx, dctx + rows * row, dstatus, NULL, &err), STRATA_OK);
        for (size_t i = 0; i < (size_t)n * row; i++)
            chunk32[i] = strata_half_to_float(ck[i]);
        CUDA_CHECK(cudaMemcpy(dctx + past * row, chunk32, (size_t)n * row * 4, cudaMemcpyHostToDevice));
        for (size_t i = 0; i < (size_t)n * row; i++)
            chunk32[i] = strata_half_to_float(cv[i]);
        CUDA_CHECK(cudaMemcpy(dctx + rows * row + past * row, chunk32, (size_t)n * row * 4, cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemset(dout, 0xff, nqd * 4));   /* NaN everywhere */
        cublasHandle_t blas;
        assert_int_equal(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
        if (cuda_attention_prefill_gemm(blas, dq, dctx, dctx + rows * row, (int)past, n, nq, nkv, D, dout, dws, ws,
                                        &err) != STRATA_OK)
            fail_msg("cuda_attention_prefill_gemm after %zu cached: %s", past, err.msg);
        CUDA_CHECK(cudaDeviceSynchronize());
        CUDA_CHECK(cudaMemcpy(out, dout, nqd * 4, cudaMemcpyDeviceToHost));
        int status = -1;
        CUDA_CHECK(cudaMemcpy(&status, dstatus, sizeof status, cudaMemcpyDeviceToHost));
        assert_int_equal(status, 0);
        const double e = cuda_test_rel_error(out, ref, nqd);
        printf("  chunk %s nq %d nkv %d D %d, %d blocks + %d tail + %d rows: dequantized + cuBLAS %.2e, cpu %.2e vs "
               "fp64\n",
               codec, nq, nkv, D, n_blocks, tail, n, e, ec);
        if (!(e <= REL_BOUND))
            fail_msg("chunk %s through cuBLAS: %.3e > %.0e", codec, e, REL_BOUND);
        cublasDestroy(blas);
        cudaFree(dctx);
        cudaFree(dws);
        cudaFree(dq);
        cudaFree(dout);
        cudaFree(dstatus);
        free(chunk32);
        free(out);
        for (int i = 0; i < n_allocs; i++)
            CUDA_CHECK(cudaFree(allocs[i]));
    }
    if (!(ec <= REL_BOUND))
        fail_msg("chunk %s: cpu %.3e > %.0e", codec, ec, REL_BOUND);
    free(scratch);
    free(ptrs);
    free(q);
    free(cpu);
    free(ref);
    free(ext.tail_k);
    free(ext.tail_v);
    free_seq(&hs);
}

/* The chunk cases' harness, without a GPU: the fp64 reference and kern_kv_attention_rows agree. */
static void test_chunk_reference_matches_cpu_kernel(void **state)
{
    (void)state;
    const char *codecs[] = {"fp16", "kivi2", "tada4", "gear2", "ott2"};
    for (size_t c = 0; c < 5; c++)
        chunk_case(codecs[c], 9, 3, 64, 3, 40, 70, false);
    chunk_case("kivi4", 9, 3, 64, 0, 0, 5, false);     /* no cache yet but the chunk */
    chunk_case("kivi2", 32, 8, 128, 2, 64, 3, false);   /* Llama-3-8B's heads */
}

static void test_chunk(void **state)
{
    (void)state;
    const char *codecs[] = {"fp16", "kivi2", "kivi4", "tada4", "gear2", "ott2"};
    for (size_t c = 0; c < 6; c++) {
        chunk_case(codecs[c], 9, 3, 64, 5, 17, 130, true);
        chunk_case(codecs[c], 32, 8, 128, 20, 100, 300, true);
    }
}

int main(void)
{
    /* One test by name (cmocka's * and ? wildcards), for the slow runs under compute-sanitizer. */
    const char *filter = getenv("STRATA_TEST_FILTER");
    if (filter && *filter)
        cmocka_set_test_filter(filter);
    const struct CMUnitTest harness[] = {cmocka_unit_test(test_reference_matches_cpu_kernel),
                                         cmocka_unit_test(test_mma_fragments),
                                         cmocka_unit_test(test_emulated_kernels),
                                         cmocka_unit_test(test_chunk_reference_matches_cpu_kernel)};
    const int harness_rc = cmocka_run_group_tests(harness, NULL, NULL);
    if (harness_rc != 0)
        return harness_rc;
    if (!cuda_test_have_device("test_cuda_attention"))
        return CUDA_TEST_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_single_sequences),
        cmocka_unit_test(test_batches_of_unequal_lengths),
        cmocka_unit_test(test_group_shapes),
        cmocka_unit_test(test_small_shared_memory),
        cmocka_unit_test(test_bad_tables_raise_status),
        cmocka_unit_test(test_damaged_gear_blocks),
        cmocka_unit_test(test_prefill),
        cmocka_unit_test(test_chunk),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
