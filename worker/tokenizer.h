/* Byte-level BPE tokenizer (GPT-2 style vocabularies, tokenizer.ggml.model = "gpt2") loaded
 * from GGUF metadata, following llama.cpp's behaviour for the supported pre-tokenizers:
 *
 *   "smollm", "starcoder": every Unicode number (\p{N}) code point is its own piece, then the
 *                          GPT-2 split  's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+|
 *                          ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+  inside each remaining piece;
 *   "gpt2":                the GPT-2 split only.
 *
 * Each piece is mapped through the GPT-2 byte-to-unicode table and merged by rank with the
 * vocabulary's merges, exactly like llama.cpp (lowest rank first, leftmost on ties).
 *
 * Special tokens: control (type 3) and unknown (type 2) tokens are matched in the input, longest
 * text first, only when parse_special is true. User-defined tokens (type 4) are always matched,
 * as llama.cpp and Hugging Face tokenizers do.
 *
 * Invalid UTF-8: a byte that does not start a well-formed sequence (llama.cpp's lenient decoder:
 * lead byte plus the right number of continuation bytes) is categorized as U+FFFD for the
 * pre-tokenizer, but its original byte is kept and encoded with byte-level tokens, so
 * decode(encode(s)) == s for every byte string when the vocabulary has a token for each of the
 * 256 bytes. (llama.cpp instead replaces such bytes by the UTF-8 of U+FFFD; for valid UTF-8 the
 * two agree.) A byte the vocabulary has no token for is dropped, as llama.cpp and HF drop it
 * (SmolLM2 lacks 0x04 0x06 0x13 0x14 0x16 0x1d 0xc0 0xc1 0xf1 0xf2 0xf5-0xff), and, as in
 * llama.cpp, it still separates its neighbours for merging (HF removes it first, so "!\x04!"
 * is two tokens here and one there).
 *
 * A tokenizer is immutable after loading; every function taking a const tokenizer is safe to
 * call from several threads at once. There is no global state. */
#ifndef STRATA_WORKER_TOKENIZER_H
#define STRATA_WORKER_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvstore/error.h"
#include "worker/gguf.h"

typedef struct tokenizer tokenizer;

/* Token types as stored in tokenizer.ggml.token_type. */
enum tokenizer_token_type {
    TOKENIZER_TYPE_UNDEFINED = 0,
    TOKENIZER_TYPE_NORMAL = 1,
    TOKENIZER_TYPE_UNKNOWN = 2,
    TOKENIZER_TYPE_CONTROL = 3,
    TOKENIZER_TYPE_USER_DEFINED = 4,
    TOKENIZER_TYPE_UNUSED = 5,
    TOKENIZER_TYPE_BYTE = 6,
};

/* Builds a tokenizer from the tokenizer.* metadata of f. Copies everything it needs: f may be
 * closed afterwards. Required keys: tokenizer.ggml.model ("gpt2"), tokenizer.ggml.pre (one of
 * the supported pre-tokenizers), tokenizer.ggml.tokens (string array), tokenizer.ggml.merges
 * (string array, "left right", both sides must be tokens). Optional: token_type (integer array,
 * one per token), bos/eos_token_id, add_bos_token, chat_template.
 * Errors: STRATA_EFORMAT for a missing or malformed vocabulary (message names the key and
 * entry), STRATA_EUNSUPPORTED for another tokenizer model or pre-tokenizer, STRATA_ENOMEM,
 * STRATA_EINVAL for f == NULL. Returns NULL on failure. */
tokenizer *tokenizer_from_gguf(const gguf_file *f, strata_error *err);

/* A string that need not be NUL-terminated. */
typedef struct tokenizer_str {
    const char *ptr;
    size_t len;
} tokenizer_str;

/* A vocabulary held in memory: what tokenizer_from_gguf reads from the tokenizer.* keys (the
 * tokenizer model is always byte-level BPE). tokenizer_from_gguf builds through
 * tokenizer_from_vocab, so both behave the same. */
typedef struct tokenizer_vocab {
    tokenizer_str pre;             /* pre-tokenizer name: "smollm", "starcoder" or "gpt2" */
    const tokenizer_str *tokens;   /* n_tokens stored texts: GPT-2 byte-encoded for normal tokens
                                    * (see tokenizer_byte_text), literal text for control tokens */
    int32_t n_tokens;
    const uint8_t *types;          /* n_tokens enum tokenizer_token_type values; NULL: all normal */
    const tokenizer_str *merges;   /* n_merges rules "left right", highest priority first */
    size_t n_merges;
    int32_t bos, eos;              /* -1: none */
    bool add_bos;
    tokenizer_str chat_template;   /* .ptr NULL: none */
} tokenizer_vocab;

/* Builds a tokenizer from v, copying everything it needs (v's arrays may be freed afterwards).
 * Errors as tokenizer_from_gguf: STRATA_EFORMAT for a malformed vocabulary (no tokens, a type
 * out of range, a merge without a space or naming an unknown token, bos/eos out of range),
 * STRATA_EUNSUPPORTED for another pre-tokenizer, STRATA_ENOMEM, STRATA_EINVAL for v == NULL. */
tokenizer *tokenizer_from_vocab(const tokenizer_vocab *v, strata_error *err);

/* The stored text of raw byte b's token in a GPT-2 byte-level vocabulary (b mapped through
 * bytes_to_unicode, as UTF-8): written to out (room for 2 bytes); returns its length, 1 or 2. */
size_t tokenizer_byte_text(uint8_t b, char *out);

void tokenizer_free(tokenizer *t);

/* Number of tokens in the vocabulary. */
int tokenizer_n_vocab(const tokenizer *t);
/* Beginning / end of sequence ids; -1 when the model does not name one. */
int32_t tokenizer_bos(const tokenizer *t);
int32_t tokenizer_eos(const tokenizer *t);
/* tokenizer.ggml.add_bos_token (false when absent). tokenizer_encode never adds BOS itself. */
bool tokenizer_add_bos(const tokenizer *t);
/* True for control tokens. False for an out-of-range id. */
bool tokenizer_is_control(const tokenizer *t, int32_t id);
/* True for tokens that are text: normal, byte and user-defined ones (added words, runs of
 * spaces, printed as llama.cpp and HF print them). Control, unknown and unused tokens are not
 * printed when streaming or decoding without include_control (as llama.cpp renders them without
 * its "special" flag: nothing). False for an out-of-range id. */
bool tokenizer_is_text(const tokenizer *t, int32_t id);
/* Token type of id (enum tokenizer_token_type), -1 for an out-of-range id. */
int tokenizer_token_type(const tokenizer *t, int32_t id);

/* End of generation: the model's EOS, or a control token that ends a turn in common chat
 * templates (<|endoftext|>, <|im_end|>, <|eot_id|>, </s>, <|end|>). */
bool tokenizer_is_eog(const tokenizer *t, int32_t id);

/* Encodes len bytes of text (arbitrary bytes; no BOS is added). text may be NULL when len is 0.
 * On success *ids_out is a malloc'd array (never NULL, even when *n_out is 0) that the caller
 * frees. Errors: STRATA_EINVAL (NULL arguments), STRATA_ENOMEM. */
int tokenizer_encode(const tokenizer *t, const char *text, size_t len, bool parse_special,
                     int32_t **ids_out, size_t *n_out, strata_error *err);

/* Looks up the token whose stored text is exactly s[0..len) (GPT-2 byte-encoded form for
 * normal tokens, literal text for control tokens). -1 when there is none. */
int32_t tokenizer_find_token(const tokenizer *t, const char *s, size_t len);

/* Raw bytes of one token (GPT-2 byte mapping undone; may be a partial UTF-8 sequence).
 * For control tokens: their text. NULL with *len=0 for an out-of-range id. The pointer stays
 * valid until tokenizer_free and is not NUL-terminated. */
const char *tokenizer_token_bytes(const tokenizer *t, int32_t id, size_t *len);

/* Concatenated bytes of ids (tokens that are not text, tokenizer_is_text, included only if
 * include_control: then every token's stored text).
 * *out is malloc'd, NUL-terminated (the terminator is not counted in *out_len); caller frees.
 * Errors: STRATA_EINVAL for an out-of-range id or NULL arguments, STRATA_ENOMEM. */
int tokenizer_decode(const tokenizer *t, const int32_t *ids, size_t n, bool include_control,
                     char **out, size_t *out_len, strata_error *err);

/* Renders a single-turn chat from the model's tokenizer.chat_template for the user message,
 * with the generation prompt appended:
 *   <|im_start|>system\n{system}<|im_end|>\n      (system, or the template's default system
 *                                                   prompt when system is NULL; omitted when
 *                                                   system is NULL and there is no default)
 *   <|im_start|>user\n{user}<|im_end|>\n
 *   <|im_start|>assistant\n
 * Only ChatML-style templates are supported: anything else (or no template) gives
 * STRATA_EUNSUPPORTED with a message. *out is malloc'd and NUL-terminated. */
int tokenizer_apply_chat(const tokenizer *t, const char *system, const char *user, char **out,
                         strata_error *err);

#endif
