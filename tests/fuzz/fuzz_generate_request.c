/* Fuzz target for what the server does with a client's Generate request before any model runs
 * (coordinator/service/coord_api.c, api_generate and check_kv): protobuf-c unpacks any bytes, a
 * request that unpacks is checked by proto_validate_generate (the limits strata.proto documents,
 * SmolLM2's serving context and vocabulary), and the kv_codec of one that passes is parsed as a
 * plan of 30 layers and named canonically (kv_plan_name), as the server compares it with the
 * plans it offers. Whatever the bytes: no crash, no read outside them, and a canonical name that
 * parses again to exactly the same plan (plan.h promises it).
 *
 * An input starting with 'K' is a kv_codec alone (the bytes after it), so that the plan grammar
 * gets mutated without the protobuf framing around it; it is parsed whether the request's checks
 * pass or not, as `--kv` and plan files reach the same parser without them.
 * Seeds: tests/fuzz/make_request_seeds.py. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvstore/plan.h"
#include "proto/validate.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define N_LAYERS 30

static bool same_params(const kv_codec_params *a, const kv_codec_params *b)
{
    return a->codec == b->codec && a->bits == b->bits && a->group == b->group && a->residual == b->residual &&
           a->rank_prompt == b->rank_prompt && a->rank_decode == b->rank_decode && a->power_iters == b->power_iters &&
           a->sparse_pct == b->sparse_pct && a->pool_tokens == b->pool_tokens && a->aux_tokens == b->aux_tokens;
}

static void check_kv_codec(const char *spec)
{
    kv_codec_params plan[N_LAYERS], again[N_LAYERS];
    strata_error err;
    if (kv_plan_parse(spec, N_LAYERS, plan, &err) != STRATA_OK)
        return;
    char *name = kv_plan_name(plan, N_LAYERS);
    if (!name)
        return;   /* out of memory */
    if (kv_plan_parse(name, N_LAYERS, again, &err) != STRATA_OK)
        abort();   /* the canonical name of a plan must parse */
    for (int l = 0; l < N_LAYERS; l++)
        if (!same_params(&plan[l], &again[l]))
            abort();   /* ... to the same plan */
    free(name);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const proto_generate_limits lim = proto_generate_limits_default(8192, 49152);
    if (size > 0 && data[0] == 'K') {
        char *spec = malloc(size);
        if (!spec)
            return 0;
        memcpy(spec, data + 1, size - 1);
        spec[size - 1] = '\0';
        Strata__V1__GenerateRequest req = STRATA__V1__GENERATE_REQUEST__INIT;
        Strata__V1__SamplingParams sp = STRATA__V1__SAMPLING_PARAMS__INIT;
        sp.max_tokens = 1;
        req.sampling = &sp;
        req.input_case = STRATA__V1__GENERATE_REQUEST__INPUT_TEXT;
        req.text = (char *)"hi";
        req.kv_codec = spec;
        (void)proto_validate_generate(&req, &lim, NULL);
        check_kv_codec(spec);   /* refused or not: plan files and --kv reach the same parser */
        free(spec);
        return 0;
    }
    Strata__V1__GenerateRequest *req = strata__v1__generate_request__unpack(NULL, size, data);
    if (!req)
        return 0;
    if (proto_validate_generate(req, &lim, NULL) == STRATA_OK && req->kv_codec && *req->kv_codec)
        check_kv_codec(req->kv_codec);
    strata__v1__generate_request__free_unpacked(req, NULL);
    return 0;
}
