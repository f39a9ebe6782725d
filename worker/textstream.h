/* Incremental output text of a generation: token bytes go in, text that is safe to show comes
 * out. Text that could be the start of a stop string is held back until it is resolved; when a
 * stop string matches, the text before it is the last output and the rest is dropped. In UTF-8
 * mode (what the gRPC API needs: proto3 strings must be valid UTF-8) a character split across
 * tokens is held until it is complete, and bytes that cannot form valid UTF-8 come out as U+FFFD;
 * in byte mode (the command line) bytes come out as produced.
 *
 * Used by generate_run and by the coordinator's streams. */
#ifndef STRATA_WORKER_TEXTSTREAM_H
#define STRATA_WORKER_TEXTSTREAM_H

#include <stdbool.h>
#include <stddef.h>

#include "kvstore/error.h"

typedef struct text_stream {
    char *buf;              /* every byte pushed (after U+FFFD replacement in UTF-8 mode) */
    size_t len, cap;
    size_t emitted;         /* bytes already taken */
    const char *const *stop;
    size_t n_stop;
    bool utf8;
    bool stopped;           /* a stop string matched: nothing more comes out */
    size_t stop_at;         /* where it matched */
    unsigned char pending[4];   /* UTF-8 mode: the start of an incomplete character */
    size_t n_pending;
} text_stream;

/* stop (n_stop strings, borrowed, non-empty) may be NULL when n_stop is 0. */
void text_stream_init(text_stream *ts, const char *const *stop, size_t n_stop, bool utf8);
void text_stream_free(text_stream *ts);

/* Appends the bytes of one token. Ignored once a stop string matched. */
int text_stream_push(text_stream *ts, const char *bytes, size_t n, strata_error *err);

/* The text that may be shown now (possibly empty), valid until the next push; marks it taken.
 * *stopped is set when a stop string has matched (then this is the last text). */
void text_stream_take(text_stream *ts, const char **text, size_t *len, bool *stopped);

/* At the end of generation (no stop matched): everything held back, including an incomplete
 * character (as U+FFFD in UTF-8 mode). */
void text_stream_finish(text_stream *ts, const char **text, size_t *len);

#endif
