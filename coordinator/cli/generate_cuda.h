/* `strata generate --device cuda[:N]`: the generation loop over the CUDA forward pass
 * (worker/cuda/model_cuda.h) instead of the CPU one. In a build without CUDA (nvcc not found at
 * configure time) it says so and fails. */
#ifndef STRATA_CLI_GENERATE_CUDA_H
#define STRATA_CLI_GENERATE_CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "coordinator/cli/tiers.h"
#include "kvstore/kv_cache.h"
#include "worker/generate.h"
#include "worker/model.h"

/* Runs the prompt through m's layers on CUDA device `device` with one KV codec for every layer
 * (fp16 weights), streaming text to on_text (after echo, when given, once the device is set up);
 * with stats, timing (and the KV tiers' traffic) to stderr. Without tier options the sequence's
 * cache is an arena for ctx tokens; with them, a device block pool of --device-kv-mib (default:
 * the whole context) over pinned host memory (--host-kv-mib) and NVMe (--nvme-dir): the pool must
 * hold one layer's blocks of the context when a tier is below it, all of them otherwise. Returns
 * the command's exit status (0; EXIT_USAGE for a configuration the GPU path cannot hold;
 * EXIT_RUNTIME for no device or a failure; each after a message). */
int cli_generate_cuda(model *m, int device, const kv_codec_params *codecs, int block_tokens, size_t ctx,
                      const cli_tier_opts *tiers, const int32_t *prompt, size_t n_prompt, const generate_params *gp,
                      const char *echo, generate_text_fn on_text, bool stats, bool quiet);

#endif
