/* Fuzz target for config files (coordinator/config/config_file.h): any bytes, read as a YAML file,
 * either load into a document or fail with a message; never a crash, a read out of bounds or a
 * leak, whatever the anchors, aliases, nesting and scalars. The same bytes read as JSON too. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "coordinator/config/config_file.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The input as a file of each kind: config_file_load reads by name. */
static void load_as(const char *suffix, const uint8_t *data, size_t size)
{
    char path[64];
    snprintf(path, sizeof path, "/tmp/strata-fuzz-config-%ld%s", (long)getpid(), suffix);
    FILE *f = fopen(path, "wb");
    if (!f)
        abort();   /* the harness cannot run: not a finding to skip quietly */
    if (size && fwrite(data, 1, size, f) != size)
        abort();
    if (fclose(f) != 0)
        abort();
    char why[300];
    json_t *doc = config_file_load(path, why, sizeof why);
    if (!doc && !why[0])
        abort();   /* a refusal always says why */
    json_decref(doc);
    unlink(path);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    load_as(".yaml", data, size);
    load_as(".json", data, size);
    return 0;
}
