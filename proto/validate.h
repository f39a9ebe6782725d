/* Validation of public API input that needs no model: field ranges, lengths and encodings of a
 * GenerateRequest, and a strict UTF-8 check. The coordinator runs it before tokenizing; what
 * needs the model (prompt + max_tokens within the context, a kv_codec the server supports) is
 * checked later. Every rejection is STRATA_EINVAL with a message that names the field as in
 * strata.proto ("sampling.top_p must be in [0, 1] (0 means 1), got 1.5"), fit to send to the
 * client as the INVALID_ARGUMENT status message. No global state. */
#ifndef STRATA_PROTO_VALIDATE_H
#define STRATA_PROTO_VALIDATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvstore/error.h"
#include "proto/strata.pb-c.h"

/* request_id: at most this many bytes of visible ASCII (0x21..0x7e). Fixed by strata.proto. */
#define PROTO_MAX_REQUEST_ID_BYTES 128

typedef struct proto_generate_limits {
    uint32_t max_tokens;         /* sampling.max_tokens must be in 1..max_tokens (>= 1) */
    size_t max_text_bytes;       /* input.text: 1..max_text_bytes bytes */
    size_t max_input_tokens;     /* input.token_ids.ids: 1..max_input_tokens ids */
    uint32_t n_vocab;            /* every token id (input and stop) must be < n_vocab; 0: unchecked */
    size_t max_stop;             /* sampling.stop: at most this many strings */
    size_t max_stop_bytes;       /* each stop string: 1..max_stop_bytes bytes */
    size_t max_stop_token_ids;   /* sampling.stop_token_ids: at most this many */
    size_t max_kv_codec_bytes;   /* kv_codec: at most this many bytes */
} proto_generate_limits;

/* The limits strata.proto documents, with max_tokens (the server's cap, usually its serving
 * context) and n_vocab (0 when unknown) from the caller:
 *   text 1 MiB, 262144 input tokens, 16 stop strings of 256 bytes, 64 stop token ids,
 *   kv_codec 1024 bytes. */
proto_generate_limits proto_generate_limits_default(uint32_t max_tokens, uint32_t n_vocab);

/* Checks every field of req against lim, in the order of strata.proto; fails on the first
 * problem. Rules:
 *   request_id   empty (the server assigns one) or 1..128 bytes of 0x21..0x7e
 *   input        exactly one of text (1..max_text_bytes, strict UTF-8) and token_ids
 *                (1..max_input_tokens ids, each < n_vocab when n_vocab != 0)
 *   sampling     temperature finite and >= 0; top_p finite and in [0, 1] (0 means 1);
 *                max_tokens in 1..lim->max_tokens; at most max_stop stop strings, each
 *                1..max_stop_bytes bytes of strict UTF-8; at most max_stop_token_ids stop ids,
 *                each < n_vocab when n_vocab != 0. A missing sampling message counts as all
 *                zeros (so it fails on max_tokens).
 *   kv_codec     empty or 1..max_kv_codec_bytes of [a-z0-9.,:-] (a codec name, "tada" or a
 *                range list; never a file path: no '/', no spaces). Whether the name parses and
 *                is supported is the server's later check.
 * STRATA_EINVAL also for NULL req or lim. */
int proto_validate_generate(const Strata__V1__GenerateRequest *req, const proto_generate_limits *lim,
                            strata_error *err);

/* Checks a request id as above; allow_empty false for Abort (which must name a request). */
int proto_validate_request_id(const char *id, bool allow_empty, strata_error *err);

/* The nucleus threshold to sample with: top_p, or 1 when top_p is 0 (the proto3 default). */
float proto_effective_top_p(float top_p);

/* A worker's name (strata_internal.proto Join.worker_name): 1 to PROTO_MAX_WORKER_NAME bytes of
 * UTF-8 without control characters, since it appears in logs, metrics and `strata drain`. */
#define PROTO_MAX_WORKER_NAME 128
bool proto_worker_name_valid(const char *name);

/* Strict UTF-8 (RFC 3629): returns len when s[0..len) is valid, else the offset of the first byte
 * of the first invalid or truncated sequence. Rejects overlong forms (C0, C1, E0 80..9F,
 * F0 80..8F), UTF-16 surrogates (ED A0..BF), code points above U+10FFFF (F4 90.., F5..FF), stray
 * continuation bytes and sequences cut short. U+0000 is valid UTF-8. */
size_t proto_utf8_check(const void *s, size_t len);

/* proto_utf8_check(s, len) == len. */
bool proto_utf8_valid(const void *s, size_t len);

#endif
