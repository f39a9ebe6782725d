#include "worker/generate.h"

#include "kvstore/clock.h"
#include "worker/textstream.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

const char *finish_reason_name(finish_reason r)
{
    switch (r) {
    case FINISH_EOS: return "eos";
    case FINISH_STOP: return "stop";
    case FINISH_LENGTH: return "length";
    case FINISH_ABORT: return "abort";
    }
    return "unknown";
}

void generate_result_free(generate_result *r)
{
    free(r->tokens);
    r->tokens = NULL;
}

/* Hands the text that may be shown now to the callback; returns its verdict (non-zero: stop). */
static int emit(text_stream *ts, generate_text_fn on_text, void *user, bool *stopped)
{
    const char *text;
    size_t len;
    text_stream_take(ts, &text, &len, stopped);
    return len && on_text ? on_text(user, text, len) : 0;
}

typedef struct cpu_step {
    model *m;
    kv_seq *seq;
    float *logits;   /* n_vocab */
} cpu_step;

static int step_on_cpu(void *ctx, const int32_t *tokens, size_t n, size_t pos, sampler *smp, int32_t *next,
                       strata_error *err)
{
    const cpu_step *f = ctx;
    int rc = model_forward(f->m, f->seq, tokens, n, pos, f->logits, false, err);
    if (rc == STRATA_OK)
        *next = sampler_sample(smp, f->logits);
    return rc;
}

int generate_run(model *m, kv_seq *seq, size_t seq_max_tokens, const int32_t *prompt, size_t n_prompt,
                 const generate_params *p, generate_text_fn on_text, void *user, generate_result *out,
                 strata_error *err)
{
    cpu_step f = {m, seq, malloc((size_t)model_get_config(m)->n_vocab * sizeof(float))};
    if (!f.logits) {
        memset(out, 0, sizeof *out);
        return strata_fail(err, STRATA_ENOMEM, "out of memory for the logits");
    }
    int rc = generate_run_with(model_get_config(m), model_get_tokenizer(m), step_on_cpu, &f, seq_max_tokens, prompt,
                               n_prompt, p, on_text, user, out, err);
    free(f.logits);
    return rc;
}

int generate_run_with(const model_config *cfg, const tokenizer *tok, generate_step_fn step, void *step_ctx,
                      size_t seq_max_tokens, const int32_t *prompt, size_t n_prompt, const generate_params *p,
                      generate_text_fn on_text, void *user, generate_result *out, strata_error *err)
{
    memset(out, 0, sizeof *out);
    if (n_prompt == 0)
        return strata_fail(err, STRATA_EINVAL, "the prompt is empty");
    if (p->max_tokens <= 0)
        return strata_fail(err, STRATA_EINVAL, "max tokens must be positive (got %d)", p->max_tokens);
    if (n_prompt >= seq_max_tokens)
        return strata_fail(err, STRATA_EINVAL, "the prompt has %zu tokens; the context holds %zu (one more is needed to generate)",
                           n_prompt, seq_max_tokens);
    int rc = sampler_params_validate(&p->sampling, err);
    if (rc != STRATA_OK)
        return rc;

    sampler *smp = sampler_create(&p->sampling, cfg->n_vocab, err);
    out->tokens = malloc((size_t)p->max_tokens * sizeof *out->tokens);
    text_stream ts;
    text_stream_init(&ts, p->stop, p->n_stop, false);   /* the callback takes bytes as they come */
    if (!smp || !out->tokens) {
        sampler_free(smp);
        generate_result_free(out);
        return smp ? strata_fail(err, STRATA_ENOMEM, "out of memory") : (err ? err->code : STRATA_ENOMEM);
    }
    out->prompt_tokens = n_prompt;
    out->finish = FINISH_LENGTH;

    double t0 = strata_mono_s();
    int32_t next = 0;
    rc = step(step_ctx, prompt, n_prompt, 0, smp, &next, err);
    out->prefill_seconds = strata_mono_s() - t0;
    size_t pos = n_prompt;
    double t_decode = strata_mono_s();
    while (rc == STRATA_OK) {
        if (!p->ignore_eos && tokenizer_is_eog(tok, next)) {
            out->finish = FINISH_EOS;
            break;
        }
        out->tokens[out->completion_tokens++] = next;
        if (tokenizer_is_text(tok, next)) {
            size_t len;
            const char *bytes = tokenizer_token_bytes(tok, next, &len);
            rc = text_stream_push(&ts, bytes, len, err);
            if (rc != STRATA_OK)
                break;
        }
        bool stopped = false;
        int cancel = emit(&ts, on_text, user, &stopped);
        if (stopped) {
            out->finish = FINISH_STOP;
            break;
        }
        if (cancel) {
            out->finish = FINISH_ABORT;
            break;
        }
        /* pos + 1 = prompt + generated tokens: the context bounds them (as the server does), not
         * only what the KV holds (one less: the last token is never appended) */
        if (out->completion_tokens == (size_t)p->max_tokens || pos + 1 >= seq_max_tokens) {
            out->finish = FINISH_LENGTH;
            break;
        }
        const int32_t last = next;
        rc = step(step_ctx, &last, 1, pos, smp, &next, err);
        pos++;
        out->decode_steps++;
    }
    out->decode_seconds = strata_mono_s() - t_decode;
    if (rc == STRATA_OK && out->finish != FINISH_STOP && out->finish != FINISH_ABORT) {
        const char *text;   /* release held-back text that never became a stop */
        size_t len;
        text_stream_finish(&ts, &text, &len);
        if (len && on_text)
            on_text(user, text, len);
    }
    text_stream_free(&ts);
    sampler_free(smp);
    return rc;
}
