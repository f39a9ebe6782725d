/* GenerateRequest validation and strict UTF-8. See validate.h. */
#include "proto/validate.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

proto_generate_limits proto_generate_limits_default(uint32_t max_tokens, uint32_t n_vocab)
{
    return (proto_generate_limits){
        .max_tokens = max_tokens,
        .max_text_bytes = (size_t)1 << 20,
        .max_input_tokens = 262144,
        .n_vocab = n_vocab,
        .max_stop = 16,
        .max_stop_bytes = 256,
        .max_stop_token_ids = 64,
        .max_kv_codec_bytes = 1024,
    };
}

size_t proto_utf8_check(const void *data, size_t len)
{
    const unsigned char *s = data;
    size_t i = 0;
    while (i < len) {
        unsigned c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        /* The lead byte fixes the length and the allowed range of the *second* byte; that
         * range is what excludes overlongs, surrogates and values above U+10FFFF (RFC 3629
         * table, section 4). Later bytes are plain continuations 80..BF. */
        size_t n;
        unsigned lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) {
            n = 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            n = 3;
            if (c == 0xE0)
                lo = 0xA0; /* E0 80..9F would be overlong */
            else if (c == 0xED)
                hi = 0x9F; /* ED A0..BF would be a surrogate U+D800..DFFF */
        } else if (c >= 0xF0 && c <= 0xF4) {
            n = 4;
            if (c == 0xF0)
                lo = 0x90; /* F0 80..8F would be overlong */
            else if (c == 0xF4)
                hi = 0x8F; /* F4 90.. would be above U+10FFFF */
        } else {
            return i; /* 80..BF stray continuation, C0/C1 overlong, F5..FF out of range */
        }
        if (len - i < n)
            return i;
        if (s[i + 1] < lo || s[i + 1] > hi)
            return i;
        for (size_t k = 2; k < n; k++)
            if (s[i + k] < 0x80 || s[i + k] > 0xBF)
                return i;
        i += n;
    }
    return len;
}

bool proto_utf8_valid(const void *s, size_t len)
{
    return proto_utf8_check(s, len) == len;
}

float proto_effective_top_p(float top_p)
{
    return top_p == 0.0f ? 1.0f : top_p;
}

/* protobuf-c gives absent strings as "" but a hand-built message may hold NULL: treat as empty. */
static const char *str_or_empty(const char *s)
{
    return s ? s : "";
}

int proto_validate_request_id(const char *id, bool allow_empty, strata_error *err)
{
    id = str_or_empty(id);
    size_t n = strlen(id);
    if (n == 0) {
        if (allow_empty)
            return STRATA_OK;
        return strata_fail(err, STRATA_EINVAL, "request_id is required");
    }
    if (n > PROTO_MAX_REQUEST_ID_BYTES)
        return strata_fail(err, STRATA_EINVAL, "request_id is %zu bytes, at most %d are allowed", n,
                           PROTO_MAX_REQUEST_ID_BYTES);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)id[i];
        /* Visible ASCII only: ids end up in logs and metrics labels, where spaces, control
         * characters and non-ASCII would break parsing or allow log injection. */
        if (c < 0x21 || c > 0x7e)
            return strata_fail(err, STRATA_EINVAL,
                               "request_id has byte 0x%02x at offset %zu: only visible ASCII (0x21-0x7e) is "
                               "allowed",
                               c, i);
    }
    return STRATA_OK;
}

/* Text fields: non-empty, bounded, strict UTF-8. field names the field in messages. */
static int check_text(const char *field, const char *s, size_t max_bytes, strata_error *err)
{
    size_t n = strlen(s);
    if (n == 0)
        return strata_fail(err, STRATA_EINVAL, "%s is empty", field);
    if (n > max_bytes)
        return strata_fail(err, STRATA_EINVAL, "%s is %zu bytes, at most %zu are allowed", field, n, max_bytes);
    size_t bad = proto_utf8_check(s, n);
    if (bad != n)
        return strata_fail(err, STRATA_EINVAL, "%s is not valid UTF-8 (byte 0x%02x at offset %zu)", field,
                           (unsigned char)s[bad], bad);
    return STRATA_OK;
}

static int check_token_ids(const char *field, const uint32_t *ids, size_t n, uint32_t n_vocab, strata_error *err)
{
    if (n && !ids)
        return strata_fail(err, STRATA_EINVAL, "%s: %zu ids but no array", field, n);
    if (!n_vocab)
        return STRATA_OK;
    for (size_t i = 0; i < n; i++)
        if (ids[i] >= n_vocab)
            return strata_fail(err, STRATA_EINVAL, "%s[%zu] = %u is not a token id (the vocabulary has %u)", field,
                               i, ids[i], n_vocab);
    return STRATA_OK;
}

static int check_input(const Strata__V1__GenerateRequest *req, const proto_generate_limits *lim, strata_error *err)
{
    switch (req->input_case) {
    case STRATA__V1__GENERATE_REQUEST__INPUT_TEXT:
        return check_text("input.text", str_or_empty(req->text), lim->max_text_bytes, err);
    case STRATA__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS: {
        size_t n = req->token_ids ? req->token_ids->n_ids : 0;
        if (n == 0)
            return strata_fail(err, STRATA_EINVAL, "input.token_ids is empty");
        if (n > lim->max_input_tokens)
            return strata_fail(err, STRATA_EINVAL, "input.token_ids has %zu ids, at most %zu are allowed", n,
                               lim->max_input_tokens);
        return check_token_ids("input.token_ids", req->token_ids->ids, n, lim->n_vocab, err);
    }
    case STRATA__V1__GENERATE_REQUEST__INPUT__NOT_SET:
        return strata_fail(err, STRATA_EINVAL, "input is missing: set text or token_ids");
    default:
        return strata_fail(err, STRATA_EINVAL, "input has an unknown kind %d", (int)req->input_case);
    }
}

static int check_sampling(const Strata__V1__SamplingParams *sp, const proto_generate_limits *lim,
                          strata_error *err)
{
    /* An absent sampling message means every field at its proto3 default. */
    static const Strata__V1__SamplingParams defaults = STRATA__V1__SAMPLING_PARAMS__INIT;
    if (!sp)
        sp = &defaults;
    /* isfinite first: NaN fails every comparison, so "< 0" alone would let it through. */
    if (!isfinite(sp->temperature) || sp->temperature < 0.0f)
        return strata_fail(err, STRATA_EINVAL, "sampling.temperature must be finite and >= 0, got %g",
                           (double)sp->temperature);
    if (!isfinite(sp->top_p) || sp->top_p < 0.0f || sp->top_p > 1.0f)
        return strata_fail(err, STRATA_EINVAL, "sampling.top_p must be in [0, 1] (0 means 1), got %g",
                           (double)sp->top_p);
    if (sp->max_tokens < 1)
        return strata_fail(err, STRATA_EINVAL, "sampling.max_tokens must be at least 1");
    if (sp->max_tokens > lim->max_tokens)
        return strata_fail(err, STRATA_EINVAL, "sampling.max_tokens is %u, at most %u are allowed", sp->max_tokens,
                           lim->max_tokens);
    if (sp->n_stop > lim->max_stop)
        return strata_fail(err, STRATA_EINVAL, "sampling.stop has %zu strings, at most %zu are allowed",
                           sp->n_stop, lim->max_stop);
    if (sp->n_stop && !sp->stop)
        return strata_fail(err, STRATA_EINVAL, "sampling.stop: %zu strings but no array", sp->n_stop);
    for (size_t i = 0; i < sp->n_stop; i++) {
        char field[48]; /* "sampling.stop[" + 20 digits + "]" */
        snprintf(field, sizeof field, "sampling.stop[%zu]", i);
        int rc = check_text(field, str_or_empty(sp->stop[i]), lim->max_stop_bytes, err);
        if (rc)
            return rc;
    }
    if (sp->n_stop_token_ids > lim->max_stop_token_ids)
        return strata_fail(err, STRATA_EINVAL, "sampling.stop_token_ids has %zu ids, at most %zu are allowed",
                           sp->n_stop_token_ids, lim->max_stop_token_ids);
    return check_token_ids("sampling.stop_token_ids", sp->stop_token_ids, sp->n_stop_token_ids, lim->n_vocab, err);
}

static bool codec_char_ok(unsigned char c)
{
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == ',' || c == ':' || c == '-';
}

static int check_kv_codec(const char *s, const proto_generate_limits *lim, strata_error *err)
{
    size_t n = strlen(s);
    if (n > lim->max_kv_codec_bytes)
        return strata_fail(err, STRATA_EINVAL, "kv_codec is %zu bytes, at most %zu are allowed", n,
                           lim->max_kv_codec_bytes);
    /* A whitelist, not a parse: it keeps anything path-like ('/', '~', spaces) out, so no later
     * code can mistake a client's string for a plan file on the server. */
    for (size_t i = 0; i < n; i++)
        if (!codec_char_ok((unsigned char)s[i]))
            return strata_fail(err, STRATA_EINVAL,
                               "kv_codec has byte 0x%02x at offset %zu: only a-z 0-9 . , : - are allowed "
                               "(a codec name like \"kivi2\" or a range list like \"0-9:tada4,10-29:tada2\")",
                               (unsigned char)s[i], i);
    return STRATA_OK;
}

int proto_validate_generate(const Strata__V1__GenerateRequest *req, const proto_generate_limits *lim,
                            strata_error *err)
{
    if (!req || !lim)
        return strata_fail(err, STRATA_EINVAL, "proto_validate_generate: NULL request or limits");
    int rc = proto_validate_request_id(req->request_id, true, err);
    if (!rc)
        rc = check_input(req, lim, err);
    if (!rc)
        rc = check_sampling(req->sampling, lim, err);
    if (!rc)
        rc = check_kv_codec(str_or_empty(req->kv_codec), lim, err);
    return rc;
}

bool proto_worker_name_valid(const char *name)
{
    size_t n = name ? strlen(name) : 0;
    bool ok = n >= 1 && n <= PROTO_MAX_WORKER_NAME && proto_utf8_valid(name, n);
    for (size_t i = 0; ok && i < n; i++)
        ok = (unsigned char)name[i] >= 0x20 && name[i] != 0x7f;
    return ok;
}
