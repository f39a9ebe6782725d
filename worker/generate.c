#include "worker/generate.h"

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

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* End-of-generation: the model's EOS, or a control token that ends a turn in common templates. */
static bool is_end_of_generation(const tokenizer *t, int32_t id)
{
    if (id == tokenizer_eos(t))
        return true;
    if (!tokenizer_is_control(t, id))
        return false;
    size_t len;
    const char *s = tokenizer_token_bytes(t, id, &len);
    static const char *const eog[] = {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "</s>", "<|end|>"};
    for (size_t i = 0; i < sizeof eog / sizeof eog[0]; i++)
        if (s && len == strlen(eog[i]) && memcmp(s, eog[i], len) == 0)
            return true;
    return false;
}

/* Output text with stop-string handling. */
typedef struct text_state {
    char *buf;
    size_t len, cap;
    size_t emitted;   /* bytes already passed to the callback */
} text_state;

static int text_append(text_state *ts, const char *s, size_t n, strata_error *err)
{
    if (ts->len + n + 1 > ts->cap) {
        size_t cap = ts->cap ? ts->cap * 2 : 256;
        while (cap < ts->len + n + 1)
            cap *= 2;
        char *grown = realloc(ts->buf, cap);
        if (!grown)
            return strata_fail(err, STRATA_ENOMEM, "out of memory for generated text");
        ts->buf = grown;
        ts->cap = cap;
    }
    memcpy(ts->buf + ts->len, s, n);
    ts->len += n;
    ts->buf[ts->len] = '\0';
    return STRATA_OK;
}

/* Earliest match of any stop string that ends in the unscanned part, or SIZE_MAX. */
static size_t find_stop(const text_state *ts, const generate_params *p)
{
    size_t best = SIZE_MAX;
    for (size_t i = 0; i < p->n_stop; i++) {
        size_t sl = strlen(p->stop[i]);
        if (sl == 0 || sl > ts->len)
            continue;
        size_t from = ts->emitted;
        for (size_t at = from; at + sl <= ts->len; at++)
            if (memcmp(ts->buf + at, p->stop[i], sl) == 0 && at < best) {
                best = at;
                break;
            }
    }
    return best;
}

/* Bytes at the end of the text that could begin a stop string and so must wait. */
static size_t holdback(const text_state *ts, const generate_params *p)
{
    size_t hold = 0;
    for (size_t i = 0; i < p->n_stop; i++) {
        size_t sl = strlen(p->stop[i]);
        for (size_t k = sl > 0 ? sl - 1 : 0; k > hold; k--)
            if (k <= ts->len - ts->emitted && memcmp(ts->buf + ts->len - k, p->stop[i], k) == 0) {
                hold = k;
                break;
            }
    }
    return hold;
}

static int flush_text(text_state *ts, size_t upto, generate_text_fn on_text, void *user)
{
    if (upto <= ts->emitted)
        return 0;
    int stop = on_text ? on_text(user, ts->buf + ts->emitted, upto - ts->emitted) : 0;
    ts->emitted = upto;
    return stop;
}

int generate_run(model *m, kv_seq *seq, size_t seq_max_tokens, const int32_t *prompt, size_t n_prompt,
                 const generate_params *p, generate_text_fn on_text, void *user, generate_result *out,
                 strata_error *err)
{
    memset(out, 0, sizeof *out);
    const model_config *cfg = model_get_config(m);
    const tokenizer *tok = model_get_tokenizer(m);
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
    float *logits = malloc((size_t)cfg->n_vocab * sizeof *logits);
    out->tokens = malloc((size_t)p->max_tokens * sizeof *out->tokens);
    text_state ts = {0};
    if (!smp || !logits || !out->tokens) {
        sampler_free(smp);
        free(logits);
        generate_result_free(out);
        return smp ? strata_fail(err, STRATA_ENOMEM, "out of memory") : (err ? err->code : STRATA_ENOMEM);
    }
    out->prompt_tokens = n_prompt;
    out->finish = FINISH_LENGTH;

    double t0 = now_seconds();
    rc = model_forward(m, seq, prompt, n_prompt, 0, logits, false, err);
    out->prefill_seconds = now_seconds() - t0;
    size_t pos = n_prompt;
    double t_decode = now_seconds();
    while (rc == STRATA_OK) {
        int32_t next = sampler_sample(smp, logits);
        if (!p->ignore_eos && is_end_of_generation(tok, next)) {
            out->finish = FINISH_EOS;
            break;
        }
        out->tokens[out->completion_tokens++] = next;
        if (!tokenizer_is_control(tok, next)) {
            size_t len;
            const char *bytes = tokenizer_token_bytes(tok, next, &len);
            rc = text_append(&ts, bytes, len, err);
            if (rc != STRATA_OK)
                break;
        }
        size_t stop_at = find_stop(&ts, p);
        if (stop_at != SIZE_MAX) {
            flush_text(&ts, stop_at, on_text, user);
            out->finish = FINISH_STOP;
            break;
        }
        if (flush_text(&ts, ts.len - holdback(&ts, p), on_text, user)) {
            out->finish = FINISH_ABORT;
            break;
        }
        if (out->completion_tokens == (size_t)p->max_tokens || pos + 1 > seq_max_tokens) {
            out->finish = FINISH_LENGTH;
            break;
        }
        rc = model_forward(m, seq, &next, 1, pos, logits, false, err);
        pos++;
        out->decode_steps++;
    }
    out->decode_seconds = now_seconds() - t_decode;
    if (rc == STRATA_OK && out->finish != FINISH_STOP && out->finish != FINISH_ABORT)
        flush_text(&ts, ts.len, on_text, user);   /* release held-back text that never became a stop */
    free(ts.buf);
    free(logits);
    sampler_free(smp);
    return rc;
}
