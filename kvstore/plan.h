/* Bit plans: which codec each layer of a model uses.
 *
 * A plan spec is either one codec name for every layer ("kivi2", see kv_codec_parse), or "tada"
 * (TaDA's default plan: 4 bits in the lower half of the layers, 2 bits in the upper half), or a
 * list of ranges "A-B:codec" / "A:codec" separated by commas or newlines ("0-9:tada4,10-29:tada2"),
 * with '#' starting a comment to the end of the line. A range list must cover every layer exactly
 * once. A single ott name leaves layers 0 and 1 without a pool (OTT's rule: their keys have no
 * outlier tokens to trace); in a range list every codec is taken as written.
 * A plan file holds a spec (strata calibrate writes one). */
#ifndef STRATA_KVSTORE_PLAN_H
#define STRATA_KVSTORE_PLAN_H

#include <stdbool.h>
#include <stddef.h>

#include "kvstore/error.h"
#include "kvstore/kv_cache.h"

/* Fills out[0..n_layers) from a spec. Fails with STRATA_EINVAL naming the bad entry, a layer
 * left out or given twice, or an unknown codec. Validation against a geometry is separate
 * (kv_codec_validate, or kv_pool_create_plan). */
int kv_plan_parse(const char *spec, int n_layers, kv_codec_params *out, strata_error *err);

/* Reads a plan file (at most 64 KiB of text: tabs, newlines and CRLF line ends, no other control
 * character, the byte named when there is one) and parses it. */
int kv_plan_load(const char *path, int n_layers, kv_codec_params *out, strata_error *err);

/* True if spec names a plan file rather than a codec or range list: it is not a codec name or
 * range list and a file of that name exists. */
bool kv_plan_is_file(const char *spec);

/* Writes the canonical range list of a plan ("0-9:tada4,10-29:tada2"; one name if uniform, unless
 * parsing that name would give another plan: "0-29:ott2" keeps layers 0-1's pools). Parsing the
 * result gives the plan. */
void kv_plan_format(const kv_codec_params *layers, int n_layers, char *buf, size_t cap);
/* The same, malloc'd and never truncated; NULL when out of memory or n_layers < 1. */
char *kv_plan_name(const kv_codec_params *layers, int n_layers);

/* Writes a plan file: comment lines (each prefixed with "# "; may be NULL; control characters
 * written as '?') then one range per line. A file is replaced whole or not at all
 * (replace_file.h): a failure leaves a plan that was there as it was. A device or a pipe
 * (/dev/stdout) is written to directly. */
int kv_plan_save(const char *path, const kv_codec_params *layers, int n_layers, const char *comment,
                 strata_error *err);

/* STRATA_OK when every layer keeps the same fp16 window (residual R), so that blocks form in every
 * layer at the same step (what the GPU path's batched decode needs); STRATA_EUNSUPPORTED naming
 * the first layer that differs. */
int kv_plan_check_one_window(const kv_codec_params *layers, int n_layers, strata_error *err);

#endif
