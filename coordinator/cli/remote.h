/* `strata generate --server`: the same generation sent to a strata server's public gRPC API
 * (Generate, server streaming) instead of a model loaded in this process. */
#ifndef STRATA_CLI_REMOTE_H
#define STRATA_CLI_REMOTE_H

#include <stdbool.h>
#include <stddef.h>

#include "worker/sampler.h"

typedef struct remote_request {
    const char *server;        /* HOST:PORT */
    const char *token_file;    /* bearer token file; NULL: none */
    const char *tls_ca;        /* PEM roots to verify the server with; NULL: plaintext */
    const char *prompt;        /* text, tokenized by the server */
    int max_tokens;
    sampler_params sampling;
    const char *const *stop;
    size_t n_stop;
    bool ignore_eos;
    const char *kv;            /* kv_codec; NULL: the server's default */
    bool echo, stats, quiet;
} remote_request;

/* Streams the completion to stdout as it arrives. Returns a process exit code: 0, 1 when the
 * server could not be reached or ended the request with an error (printed with its gRPC status),
 * 2 for a bad option (an unreadable token file). */
int cli_remote_generate(const remote_request *r);

/* `strata drain --server HOST:PORT WORKER`: asks the server to drain the worker's replica
 * (DrainWorker) and follows the progress until it is done or timeout_s passes. Returns a process
 * exit code (0 done, 1 failure or timeout, 2 bad option). */
typedef struct remote_drain {
    const char *server, *token_file, *tls_ca;
    const char *worker;
    int timeout_s;
    bool quiet;
} remote_drain;
int cli_remote_drain(const remote_drain *r);

#endif
