/* Teacher-forced evaluation of a KV plan (evaluate.h). */
#include "worker/evaluate.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvstore/block.h"
#include "kvstore/clock.h"
#include "kvstore/half.h"

void eval_reference_free(eval_reference *ref)
{
    if (!ref)
        return;
    free(ref->logprobs);
    free(ref->argmax);
    memset(ref, 0, sizeof *ref);
}

void eval_result_free(eval_result *r)
{
    if (!r)
        return;
    free(r->layers);
    memset(r, 0, sizeof *r);
}

void eval_prefix_free(eval_prefix *p)
{
    if (!p)
        return;
    free(p->k);
    free(p->v);
    memset(p, 0, sizeof *p);
}

int eval_prefix_build(model *m, const int32_t *ids, size_t n, int block_tokens, eval_prefix *out, strata_error *err)
{
    memset(out, 0, sizeof *out);
    if (!m || !ids || n < 1)
        return strata_fail(err, STRATA_EINVAL, "eval prefix: no tokens");
    kv_geometry geo = model_kv_geometry(m, block_tokens);
    kv_codec_params fp16;
    int rc = kv_codec_parse("fp16", &fp16, err);
    if (rc)
        return rc;
    kv_pool *pool = kv_pool_create(&geo, &fp16, (n / (size_t)block_tokens + 1) * (size_t)geo.n_layers, err);
    if (!pool)
        return err ? err->code : STRATA_ENOMEM;
    kv_seq *seq = kv_seq_create(pool, n, err);
    const size_t row = (size_t)geo.n_kv_heads * (size_t)geo.head_dim, per_layer = n * row;
    out->tokens = n;
    out->n_layers = geo.n_layers;
    out->row = row;
    out->k = malloc((size_t)geo.n_layers * per_layer * sizeof(float));
    out->v = malloc((size_t)geo.n_layers * per_layer * sizeof(float));
    if (!seq) {
        rc = err ? err->code : STRATA_ENOMEM;
    } else if (!out->k || !out->v) {
        rc = strata_fail(err, STRATA_ENOMEM, "eval prefix: out of memory for %zu tokens x %d layers", n, geo.n_layers);
    } else {
        rc = model_forward(m, seq, ids, n, 0, NULL, false, err);
    }
    /* The fp16 codec is lossless on the fp16-rounded rows it is given: decode the blocks back. */
    for (int l = 0; rc == STRATA_OK && l < geo.n_layers; l++) {
        kv_layer_view view;
        kv_seq_layer_view(seq, l, &view);
        float *k = out->k + (size_t)l * per_layer, *v = out->v + (size_t)l * per_layer;
        size_t at = 0;
        for (size_t b = 0; b < view.n_blocks && rc == STRATA_OK; b++) {
            kv_block blk;
            rc = kv_block_parse(view.blocks[b], view.block_bytes, &blk, err);
            if (rc == STRATA_OK)
                rc = kv_block_decode(&blk, k + at * row, v + at * row, err);
            at += (size_t)view.block_tokens;
        }
        for (size_t i = 0; rc == STRATA_OK && i < view.tail_tokens * row; i++) {
            k[at * row + i] = strata_half_to_float(view.tail_k[i]);
            v[at * row + i] = strata_half_to_float(view.tail_v[i]);
        }
    }
    kv_seq_destroy(seq);
    kv_pool_destroy(pool);
    if (rc)
        eval_prefix_free(out);
    return rc;
}

/* logits -> log-probabilities in place (fp64 normalizer); returns the argmax. */
static int32_t log_softmax(float *x, int n)
{
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    const double m = x[best];
    double sum = 0.0;
    for (int i = 0; i < n; i++)
        sum += exp((double)x[i] - m);
    const double lse = m + log(sum);
    for (int i = 0; i < n; i++)
        x[i] = (float)((double)x[i] - lse);
    return best;
}

int eval_run(model *m, const kv_codec_params *codecs, const int32_t *ids, size_t n_ids, const eval_setup *setup,
             const eval_prefix *prefix, const eval_reference *ref, eval_reference *keep, eval_progress_fn progress,
             void *user, eval_result *out, strata_error *err)
{
    memset(out, 0, sizeof *out);
    if (!m || !codecs || !ids || !setup)
        return strata_fail(err, STRATA_EINVAL, "eval: NULL argument");
    const model_config *cfg = model_get_config(m);
    const size_t N = setup->prefill, T = setup->tokens, V = (size_t)cfg->n_vocab;
    if (N < 1 || T < 1)
        return strata_fail(err, STRATA_EINVAL, "eval: prefill (%zu) and tokens (%zu) must be at least 1", N, T);
    if (n_ids < N + T + 1)
        return strata_fail(err, STRATA_EINVAL,
                           "eval: the text has %zu tokens; prefill %zu + tokens %zu needs %zu (one more to score the last step)",
                           n_ids, N, T, N + T + 1);
    if (N + T > (size_t)cfg->n_ctx_train)
        return strata_fail(err, STRATA_EINVAL, "eval: prefill + tokens = %zu exceeds the model's context of %d",
                           N + T, cfg->n_ctx_train);
    if (prefix && (prefix->tokens != N || prefix->n_layers != cfg->n_layers))
        return strata_fail(err, STRATA_EINVAL, "eval: the prefix holds %zu tokens of %d layers, this run needs %zu of %d",
                           prefix->tokens, prefix->n_layers, N, cfg->n_layers);
    if (ref && (ref->tokens != T || ref->n_vocab != cfg->n_vocab))
        return strata_fail(err, STRATA_EINVAL, "eval: the reference has %zu steps of %d logits, this run %zu of %d",
                           ref->tokens, ref->n_vocab, T, cfg->n_vocab);
    if (keep && T > ((size_t)2 << 30) / sizeof(float) / V)
        return strata_fail(err, STRATA_EINVAL, "eval: keeping %zu steps of %zu log-probabilities needs over 2 GiB",
                           T, V);

    const double t0 = strata_mono_s();
    kv_geometry geo = model_kv_geometry(m, setup->block_tokens);
    const size_t ctx = N + T, ctx_blocks = (ctx + (size_t)geo.block_tokens - 1) / (size_t)geo.block_tokens;
    kv_pool *pool;
    if (setup->device_slots || setup->lower) {
        /* Any layer may need the whole pool for attention: one slot size for all layers. */
        size_t slots = setup->device_slots ? setup->device_slots : ctx_blocks * (size_t)geo.n_layers;
        pool = kv_pool_create_shared(&geo, codecs, slots, err);
        if (pool && setup->lower && kv_pool_set_lower_tier(pool, setup->lower, err) != STRATA_OK) {
            kv_pool_destroy(pool);
            pool = NULL;
        }
    } else {
        pool = kv_pool_create_plan(&geo, codecs, ctx_blocks, err);
    }
    if (!pool)
        return err ? err->code : STRATA_EINVAL;
    kv_seq *seq = kv_seq_create(pool, ctx, err);
    float *logits = malloc(V * sizeof *logits);
    out->layers = calloc((size_t)cfg->n_layers, sizeof *out->layers);
    int rc = STRATA_OK;
    if (!seq) {
        rc = err ? err->code : STRATA_ENOMEM;
        goto done;
    }
    if (!logits || !out->layers) {
        rc = strata_fail(err, STRATA_ENOMEM, "eval: out of memory");
        goto done;
    }
    out->n_layers = cfg->n_layers;
    if (keep) {
        memset(keep, 0, sizeof *keep);
        keep->logprobs = malloc(T * V * sizeof(float));
        keep->argmax = malloc(T * sizeof(int32_t));
        if (!keep->logprobs || !keep->argmax) {
            eval_reference_free(keep);
            rc = strata_fail(err, STRATA_ENOMEM, "eval: out of memory for %zu x %zu log-probabilities", T, V);
            goto done;
        }
        keep->tokens = T;
        keep->n_vocab = cfg->n_vocab;
    }
    kv_seq_track_error(seq, 1, NULL);
    if (prefix) {
        /* What model_forward's prefill does with the K/V rows: one append per layer, whose new
         * blocks stay pinned until unpinned (with a lower tier, so that the next layer's can
         * evict them). */
        rc = kv_seq_check_room(seq, N, err);
        for (int l = 0; l < cfg->n_layers && rc == STRATA_OK; l++) {
            size_t off = (size_t)l * N * prefix->row;
            rc = kv_seq_append(seq, l, prefix->k + off, prefix->v + off, N, err);
            kv_seq_unpin(seq);
        }
    } else {
        rc = model_forward(m, seq, ids, N, 0, NULL, false, err);
    }
    if (rc)
        goto done;
    if (progress && progress(user, 0, T)) {
        rc = strata_fail(err, STRATA_EINVAL, "eval: cancelled");
        goto done;
    }
    double nll = 0.0, kl = 0.0;
    size_t agree = 0;
    for (size_t i = 0; i < T; i++) {
        rc = model_forward(m, seq, ids + N + i, 1, N + i, logits, false, err);
        if (rc)
            goto done;
        int32_t best = log_softmax(logits, (int)V);
        nll -= (double)logits[ids[N + i + 1]];
        if (ref) {
            const float *rp = ref->logprobs + i * V;
            double k = 0.0;
            for (size_t j = 0; j < V; j++) {
                double lp = rp[j];
                k += exp(lp) * (lp - (double)logits[j]);
            }
            /* KL is never negative; below 0 the estimate is rounding (the float log-probabilities'
             * exp sums to 1 only to ~1e-7), which would print as -0.000000. */
            kl += k > 0.0 ? k : 0.0;
            agree += best == ref->argmax[i];
        }
        if (keep) {
            memcpy(keep->logprobs + i * V, logits, V * sizeof(float));
            keep->argmax[i] = best;
        }
        if (progress && progress(user, i + 1, T)) {
            rc = strata_fail(err, STRATA_EINVAL, "eval: cancelled");
            goto done;
        }
    }
    out->nll = nll / (double)T;
    out->ppl = exp(out->nll);
    out->kl = ref ? kl / (double)T : 0.0;
    out->top1 = ref ? (double)agree / (double)T : 1.0;

    kv_seq_stats st;
    kv_seq_get_stats(seq, &st);
    const double L = cfg->n_layers;
    out->block_tokens = st.block_tokens / (size_t)cfg->n_layers;
    out->bytes_per_token = st.block_tokens ? (double)st.block_bytes / ((double)st.block_tokens / L) : 0.0;
    out->total_bytes_per_token = (double)(st.block_bytes + st.tail_bytes) / ((double)st.tokens / L);
    for (int l = 0; l < cfg->n_layers; l++) {
        kv_layer_error e;
        kv_seq_layer_error(seq, l, &e);
        out->layers[l].k_rel = e.k_ref2 > 0 ? sqrt(e.k_err2 / e.k_ref2) : 0.0;
        out->layers[l].v_rel = e.v_ref2 > 0 ? sqrt(e.v_err2 / e.v_ref2) : 0.0;
    }
    kv_pool_stats ps;
    kv_pool_get_stats(pool, &ps);
    out->evictions = ps.evictions;
    out->fetches = ps.fetches;
    out->seconds = strata_mono_s() - t0;
done:
    if (rc) {
        eval_result_free(out);
        if (keep)
            eval_reference_free(keep);
    }
    free(logits);
    kv_seq_destroy(seq);
    kv_pool_destroy(pool);
    return rc;
}
