/* Quality of a compressed KV cache, measured against the fp16 cache (strata eval / calibrate).
 *
 * The first `prefill` tokens of a text are prefilled with exact attention (as serving does);
 * then the next `tokens` tokens are fed one at a time through the decode path, each step
 * attending over the compressed cache (teacher forcing), and the distribution it predicts for
 * the following token is scored. The reference is the same procedure with an fp16 cache:
 * perplexity, KL(fp16 || codec) of the next-token distributions, top-1 agreement; plus the
 * bytes stored per token and each layer's relative compression error of K and V. */
#ifndef STRATA_WORKER_EVALUATE_H
#define STRATA_WORKER_EVALUATE_H

#include <stddef.h>
#include <stdint.h>

#include "kvstore/kv_cache.h"
#include "worker/model.h"

typedef struct eval_setup {
    size_t prefill;       /* tokens prefilled exactly (>= 1) */
    size_t tokens;        /* decode steps scored (>= 1); the text needs prefill + tokens + 1 ids */
    int block_tokens;     /* KV block size */
    /* Memory of the run's KV cache (optional; zeros: one pool with room for the whole context,
     * as kv_pool_create_plan makes it). With device_slots or lower set, the pool is
     * kv_pool_create_shared's: device_slots slots of the plan's largest block
     * (kv_plan_largest_block) shared by every layer (0: enough for the whole context), with
     * lower attached below it (kv_pool_set_lower_tier) when non-NULL. Blocks move between the
     * tiers as their exact bytes, so the results are those of the unconstrained run; a budget
     * too small for one step fails the run with STRATA_EFULL. The tiers apply to the run only:
     * eval_prefix_build's reference prefill always has room for the whole prompt. lower's ctx
     * must outlive the call; the run leaves no block in it. */
    size_t device_slots;
    const kv_lower_tier *lower;
} eval_setup;

/* The prefill's K/V of every layer, recorded once from an fp16 cache so that runs with other
 * codecs start from it instead of recomputing the prompt. The rows are the fp16-rounded values
 * every codec starts from, so a run from a prefix is identical to one that prefills itself. */
typedef struct eval_prefix {
    size_t tokens;
    int n_layers;
    size_t row;           /* n_kv_heads * head_dim */
    float *k, *v;         /* [n_layers][tokens][row] */
} eval_prefix;

int eval_prefix_build(model *m, const int32_t *ids, size_t n, int block_tokens, eval_prefix *out, strata_error *err);
void eval_prefix_free(eval_prefix *p);

/* Called after the prefill (step 0) and after each decode step; return non-zero to cancel. */
typedef int (*eval_progress_fn)(void *user, size_t step, size_t steps);

/* The fp16 run's next-token log-probabilities, kept to score other runs against. */
typedef struct eval_reference {
    size_t tokens;
    int n_vocab;
    float *logprobs;      /* [tokens][n_vocab] */
    int32_t *argmax;      /* [tokens] */
} eval_reference;

void eval_reference_free(eval_reference *ref);

typedef struct eval_layer_error {
    double k_rel;         /* ||K - K'||_F / ||K||_F over the layer's blocks */
    double v_rel;
} eval_layer_error;

typedef struct eval_result {
    double nll;                 /* mean negative log-likelihood of the scored tokens (nats) */
    double ppl;                 /* exp(nll) */
    double kl;                  /* mean KL(reference || this run); 0 without a reference */
    double top1;                /* fraction of steps whose argmax equals the reference's */
    double bytes_per_token;     /* bytes of all blocks (headers and every section) per token,
                                   summed over layers: the rate of the compressed format */
    double total_bytes_per_token; /* the same including the fp16 tail, at the end of the run */
    size_t block_tokens;        /* tokens per layer held in blocks at the end */
    int n_layers;
    eval_layer_error *layers;   /* [n_layers] (malloc'd) */
    uint64_t evictions;         /* device pool: blocks moved down to the lower tier */
    uint64_t fetches;           /* device pool: blocks brought back for attention */
    double seconds;
} eval_result;

void eval_result_free(eval_result *r);

/* Runs the procedure with the plan codecs[0..n_layers). With ref == NULL nothing is compared
 * (kl 0, top1 1); with keep != NULL the run's log-probabilities are stored in it (the
 * reference for later runs). ids holds at least prefill + tokens + 1 token ids. With prefix
 * (built from the same ids, prefix->tokens == setup->prefill) the prompt is not recomputed. */
int eval_run(model *m, const kv_codec_params *codecs, const int32_t *ids, size_t n_ids, const eval_setup *setup,
             const eval_prefix *prefix, const eval_reference *ref, eval_reference *keep, eval_progress_fn progress,
             void *user, eval_result *out, strata_error *err);

#endif
