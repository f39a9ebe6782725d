/* Subcommands of the `strata` command line and small shared helpers. */
#ifndef STRATA_CLI_H
#define STRATA_CLI_H

#include <stdbool.h>
#include <stdint.h>

#include <stddef.h>

#include "kvstore/error.h"

int cmd_generate(int argc, char **argv);
int cmd_eval(int argc, char **argv);
int cmd_calibrate(int argc, char **argv);
int cmd_inspect(int argc, char **argv);
int cmd_drain(int argc, char **argv);

/* Exit codes: 0 success, 1 runtime failure, 2 bad usage. */
enum { EXIT_RUNTIME = 1, EXIT_USAGE = 2 };

/* Strict number parsing for flags: the whole string must be a number in [min, max].
 * On failure prints "strata: --flag: ..." and returns false. */
bool cli_parse_long(const char *flag, const char *s, long min, long max, long *out);
bool cli_parse_u64(const char *flag, const char *s, uint64_t *out);
bool cli_parse_float(const char *flag, const char *s, double min, double max, float *out);
bool cli_parse_double(const char *flag, const char *s, double min, double max, double *out);

/* The model used when --model is not given: $STRATA_MODEL, else the file the setup script
 * installs. */
const char *cli_default_model(void);

/* Checks a --model argument before anything is loaded: a synthetic:NAME[:seed=N] that parses,
 * or a file that can be read (not a folder). Prints "strata CMD: ..." (with how to get the
 * default model when that is the one missing) and returns EXIT_USAGE otherwise, 0 if fine. */
int cli_check_model(const char *cmd, const char *path);

/* Monotonic clock in seconds. */
double cli_now_seconds(void);

/* A document's token ids as the model reads it: BOS (if the model adds one) then the text,
 * without special-token parsing. *ids is malloc'd. */
struct tokenizer;
int cli_tokenize_document(const struct tokenizer *tok, const char *text, size_t len, int32_t **ids, size_t *n,
                          strata_error *err);

/* Whether the file an output flag names could be written, checked before a long run so that a
 * typo does not throw the run's result away: its folder must exist and be writable, and the
 * path must not be a folder (or an existing file we may not write; with regular_only, anything
 * but a regular file: a device or FIFO the output would replace). Prints
 * "strata CMD: FLAG PATH: ..." and returns false otherwise. Nothing is created. */
bool cli_check_writable(const char *cmd, const char *flag, const char *path, bool regular_only);

/* Reads the --text of eval and calibrate (at most 64 MiB, NUL-terminated, malloc'd): it must be
 * UTF-8 without NUL bytes, since the scores of a binary or mis-encoded file would be numbers
 * about nothing. Prints "strata CMD: --text PATH: ..." and returns EXIT_USAGE otherwise. */
int cli_read_text(const char *cmd, const char *path, char **out, size_t *len);

/* Reads a whole file (at most max_bytes) into a NUL-terminated malloc'd buffer. */
int cli_read_file(const char *path, size_t max_bytes, char **out, size_t *len, strata_error *err);

#endif
