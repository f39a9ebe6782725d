/* Autoregressive generation for one sequence: prefill the prompt, then sample token by token
 * through the compressed KV cache, streaming text as it is produced. */
#ifndef STRATA_WORKER_GENERATE_H
#define STRATA_WORKER_GENERATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvstore/kv_cache.h"
#include "worker/model.h"
#include "worker/sampler.h"

typedef struct generate_params {
    sampler_params sampling;
    int max_tokens;              /* > 0 */
    const char *const *stop;     /* stop strings: generation ends before the first match */
    size_t n_stop;
    bool ignore_eos;             /* keep going past end-of-generation tokens */
} generate_params;

typedef enum finish_reason {
    FINISH_EOS,      /* the model produced an end-of-generation token */
    FINISH_STOP,     /* a stop string matched */
    FINISH_LENGTH,   /* max_tokens reached, or the context is full */
    FINISH_ABORT,    /* the callback asked to stop */
} finish_reason;

const char *finish_reason_name(finish_reason r);

typedef struct generate_result {
    finish_reason finish;
    size_t prompt_tokens;
    size_t completion_tokens;
    int32_t *tokens;             /* completion token ids (malloc'd; free with generate_result_free) */
    double prefill_seconds;
    double decode_seconds;       /* after the first token: steps that ran the decode path */
    size_t decode_steps;
} generate_result;

void generate_result_free(generate_result *r);

/* Called with each piece of output text, in order (bytes, possibly a partial UTF-8 sequence).
 * Text that could be the start of a stop string is held back until it is resolved. Return
 * non-zero to stop (FINISH_ABORT). */
typedef int (*generate_text_fn)(void *user, const char *text, size_t len);

/* seq must be empty. The prompt must fit the sequence's max_tokens. */
int generate_run(model *m, kv_seq *seq, size_t seq_max_tokens, const int32_t *prompt, size_t n_prompt,
                 const generate_params *p, generate_text_fn on_text, void *user, generate_result *out,
                 strata_error *err);

/* One step of the backend generate_run_with drives: n tokens at positions pos.. of its one
 * sequence through the model, then the next token picked with smp from the last token's logits
 * (sampler_sample on the CPU; a device may pick on the device with sampler_next_draw's draw,
 * kernels/cuda_sample.h). */
typedef int (*generate_step_fn)(void *step_ctx, const int32_t *tokens, size_t n, size_t pos, sampler *smp,
                                int32_t *next, strata_error *err);

/* generate_run over any backend's steps (the CUDA one: coordinator/cli/generate_cuda.c); cfg and
 * tok are the model's. The sequence behind step must be empty. */
int generate_run_with(const model_config *cfg, const tokenizer *tok, generate_step_fn step, void *step_ctx,
                      size_t seq_max_tokens, const int32_t *prompt, size_t n_prompt, const generate_params *p,
                      generate_text_fn on_text, void *user, generate_result *out, strata_error *err);

#endif
