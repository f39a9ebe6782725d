/* Config files (`--config FILE` of strata serve, strata-coordinator and the KV tier options of
 * generate, eval and calibrate): JSON, or YAML when the file name ends in .yaml or .yml, read
 * into one jansson document so that every caller checks its keys one way.
 *
 * YAML is read as the subset a config needs: a mapping of plain values, nested mappings and
 * sequences. A plain scalar becomes true/false, null (null, ~ or nothing), an integer, a finite
 * real or else a string; a quoted scalar is always a string ("8080" stays text). Refused, with
 * the line: a syntax error, a key that is not a scalar, a key given twice (as JSON's duplicate
 * keys are), a NUL character (a quoted "\0") in a key or value, more than one document, nesting
 * deeper than 64, more than 100,000 values (an alias bomb). An empty file, or one of comments
 * only, sets nothing. */
#ifndef STRATA_COORDINATOR_CONFIG_FILE_H
#define STRATA_COORDINATOR_CONFIG_FILE_H

#include <stdbool.h>
#include <stddef.h>

#include <jansson.h>

/* Whether path names a YAML file (ends in .yaml or .yml). */
bool config_file_is_yaml(const char *path);

/* The file's document (any JSON value: the caller checks that it is an object), or NULL with why
 * (cap bytes) saying what went wrong, e.g. "line 3: duplicate key 'max_seqs'", "is a directory,
 * not a config file", "unable to open ...: No such file or directory". */
json_t *config_file_load(const char *path, char *why, size_t cap);

#endif
