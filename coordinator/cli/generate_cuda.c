#include "coordinator/cli/generate_cuda.h"

#include <stdio.h>
#include <string.h>

#include "coordinator/cli/cli.h"

#ifdef STRATA_HAVE_CUDA

#include "kernels/cuda_kv_encode.h"
#include "kvstore/plan.h"
#include "worker/cuda/device_mem.h"
#include "worker/cuda/model_cuda.h"

typedef struct cuda_step {
    cuda_model *cm;
    cuda_seq *seq;
} cuda_step;

/* The step and the pick both on the device; only the draw (from the host's PRNG) goes down and
 * the token id comes back. */
static int step_on_cuda(void *ctx, const int32_t *tokens, size_t n, size_t pos, sampler *smp, int32_t *next,
                        strata_error *err)
{
    const cuda_step *f = ctx;
    if (pos != cuda_seq_length(f->seq))
        return strata_fail(err, STRATA_EINVAL, "position %zu on a sequence of %zu", pos, cuda_seq_length(f->seq));
    const sampler_params *sp = sampler_get_params(smp);
    const cuda_sample_row row = {.u = sampler_params_greedy(sp) ? 0.0 : sampler_next_draw(smp),
                                 .temperature = sp->temperature, .top_p = sp->top_p, .top_k = sp->top_k};
    const cuda_batch_item item = {f->seq, tokens, n};   /* a prompt, a prompt chunk or one token */
    return cuda_model_forward_batch_sample(f->cm, &item, 1, &row, next, err);
}

/* Device pool slots under the tier options: 0 when none is asked for (the sequence gets an arena),
 * else --device-kv-mib over the slot size (default: every block of the context); EXIT_USAGE
 * after a message when that cannot hold what a step needs. */
static int pool_slots(const cli_tier_opts *t, const kv_codec_params *codecs, const kv_geometry *g, size_t ctx,
                      size_t *slots)
{
    *slots = 0;
    if (t->device_mib < 0 && t->host_mib <= 0)
        return 0;
    cuda_kv_pool_size z;
    strata_error err = {0};
    if (cuda_kv_pool_sizing(&codecs, 1, g, ctx, 1, t->device_mib < 0 ? 0 : (uint64_t)(t->device_mib * 1048576.0),
                            t->host_mib > 0, &z, &err) != STRATA_OK) {
        fprintf(stderr, "strata generate: %s\n", err.msg);
        return EXIT_USAGE;
    }
    *slots = z.slots < z.seq_blocks ? z.slots : z.seq_blocks;   /* more than the context can use is no use */
    if (*slots < z.need) {
        fprintf(stderr,
                "strata generate: --device-kv-mib %g holds %zu blocks of %zu bytes; a context of %zu tokens needs %zu "
                "%s\n", t->device_mib, *slots, z.slot_bytes, ctx, z.need,
                t->host_mib > 0 ? "at once (one layer's blocks and the one forming)"
                                : "without a tier below (--host-kv-mib streams the layers from host memory)");
        return EXIT_USAGE;
    }
    return 0;
}

int cli_generate_cuda(model *m, int device, const kv_codec_params *codecs, int block_tokens, size_t ctx,
                      const cli_tier_opts *tiers, const int32_t *prompt, size_t n_prompt, const generate_params *gp,
                      const char *echo, generate_text_fn on_text, bool stats, bool quiet)
{
    strata_error err = {0};
    int exit_code = EXIT_RUNTIME;
    cuda_step f = {0};
    generate_result result = {0};
    kv_tiers *kt = NULL;
    size_t kv_bytes = 0, slots = 0;
    /* The codec first: a configuration the GPU path cannot run is refused on any machine. */
    const model_config *cfg = model_get_config(m);
    const kv_geometry g = {.n_layers = cfg->n_layers, .n_kv_heads = cfg->n_kv_heads, .head_dim = cfg->head_dim,
                           .block_tokens = block_tokens};
    int bad = cuda_seq_check_plan(codecs, g.n_layers, &err);
    for (int l = 0; !bad && l < g.n_layers; l++) {
        cuda_kv_encoder enc;
        if ((bad = cuda_kv_encoder_init(&codecs[l], &g, &enc, &err)) != STRATA_OK)
            strata_error_prefix(&err, "layer %d", l);
    }
    if (bad) {
        fprintf(stderr, "strata generate: --device cuda: %s\n", err.msg);
        return EXIT_USAGE;
    }
    if (pool_slots(tiers, codecs, &g, ctx, &slots) != 0)
        return EXIT_USAGE;
    if (cuda_select_device(device, &err) != STRATA_OK || !(f.cm = cuda_model_create(m, CUDA_WEIGHTS_F16, &err)))
        goto device_error;
    if (slots) {   /* a shared pool, over pinned host memory and NVMe when asked for */
        kv_lower_tier lower;
        if (cli_tier_create_with(tiers, cuda_pinned_host_allocator(), &kt, &err) != STRATA_OK)
            goto device_error;
        if (kt)
            lower = kv_tiers_lower(kt);
        if (cuda_model_create_kv_pool_plan(f.cm, codecs, block_tokens, slots, kt ? &lower : NULL, &err) != STRATA_OK)
            goto device_error;
    }
    if (!(f.seq = cuda_seq_create_plan(f.cm, codecs, block_tokens, ctx, &err)))
        goto device_error;
    kv_bytes = cuda_seq_bytes(f.seq);
    if (!quiet) {
        fprintf(stderr, "strata: cuda:%d: %.0f MiB of fp16 weights, KV cache %.1f MiB for %zu tokens\n", device,
                (double)cuda_model_weight_bytes(f.cm) / 1048576.0, (double)kv_bytes / 1048576.0, ctx);
        if (slots)
            fprintf(stderr, "strata: KV tiers: device pool %.2f MiB (%zu blocks of %zu bytes); %s\n",
                    (double)slots * (double)kv_plan_largest_block(&g, codecs) / 1048576.0, slots,
                    kv_plan_largest_block(&g, codecs),
                    kt ? kv_tiers_describe(kt) : "nothing below it");
    }
    if (echo)
        on_text(NULL, echo, strlen(echo));
    const int rc = generate_run_with(cfg, model_get_tokenizer(m), step_on_cuda, &f, ctx, prompt,
                                     n_prompt, gp, on_text, NULL, &result, &err);
    printf("\n");
    fflush(stdout);
    if (rc != STRATA_OK) {
        fprintf(stderr, "strata generate: %s\n", err.msg);
        goto done;
    }
    if (stats) {
        fprintf(stderr, "prefill: %zu tokens in %.3f s (%.1f tokens/s) on cuda:%d\n", result.prompt_tokens,
                result.prefill_seconds,
                result.prefill_seconds > 0 ? (double)result.prompt_tokens / result.prefill_seconds : 0.0, device);
        fprintf(stderr, "decode:  %zu tokens in %.3f s (%.2f tokens/s)\n", result.decode_steps, result.decode_seconds,
                result.decode_seconds > 0 ? (double)result.decode_steps / result.decode_seconds : 0.0);
        fprintf(stderr, "finish:  %s after %zu tokens\n", finish_reason_name(result.finish), result.completion_tokens);
        if (slots) {
            device_pool_stats ps;
            cuda_model_kv_pool_stats(f.cm, &ps);
            fprintf(stderr, "kv:      device pool %zu/%zu blocks resident, %llu moved down (%llu copied, %.1f MiB), "
                            "%llu brought back (%.1f MiB)\n", ps.resident_blocks, ps.slots,
                    (unsigned long long)ps.evictions, (unsigned long long)ps.writebacks,
                    (double)ps.writeback_bytes / 1048576.0, (unsigned long long)ps.fetches,
                    (double)ps.fetch_bytes / 1048576.0);
        }
    }
    exit_code = 0;
    goto done;
device_error:
    fprintf(stderr, "strata generate: --device cuda:%d: %s\n", device, err.msg);
done:
    generate_result_free(&result);
    cuda_seq_free(f.seq);
    cuda_model_free(f.cm);   /* the pool, and its copies in the tiers */
    cli_tier_destroy(kt);
    return exit_code;
}

#else

int cli_generate_cuda(model *m, int device, const kv_codec_params *codecs, int block_tokens, size_t ctx,
                      const cli_tier_opts *tiers, const int32_t *prompt, size_t n_prompt, const generate_params *gp,
                      const char *echo, generate_text_fn on_text, bool stats, bool quiet)
{
    (void)m, (void)codecs, (void)block_tokens, (void)ctx, (void)tiers, (void)prompt, (void)n_prompt, (void)gp, (void)echo;
    (void)on_text;
    (void)stats, (void)quiet;
    fprintf(stderr, "strata generate: --device cuda:%d: this build has no CUDA support (nvcc was not found when it "
                    "was configured, or -DSTRATA_CUDA=OFF)\n", device);
    return EXIT_RUNTIME;
}

#endif
