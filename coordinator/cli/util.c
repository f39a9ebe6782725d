/* Small helpers shared by the subcommands. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "coordinator/cli/cli.h"
#include "proto/validate.h"
#include "worker/model.h"
#include "worker/tokenizer.h"

double cli_now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Why the folder of path (a file's path) cannot take a new file, or NULL. */
static const char *folder_refuses(const char *path)
{
    const char *why = NULL;
    struct stat st;
    const char *slash = strrchr(path, '/');
    char *dir = slash ? strndup(path, slash == path ? 1 : (size_t)(slash - path)) : strdup(".");
    if (!dir)
        why = "out of memory";
    else if (stat(dir, &st) != 0)
        why = errno == ENOENT ? "its folder does not exist" : strerror(errno);
    else if (!S_ISDIR(st.st_mode))
        why = "its folder is not a folder";
    else if (access(dir, W_OK | X_OK) != 0)
        why = "its folder is not writable";
    free(dir);
    return why;
}

bool cli_check_writable(const char *cmd, const char *flag, const char *path, bool regular_only)
{
    const char *why = NULL;
    struct stat st;
    if (!*path) {
        why = "an empty path";
    } else if (stat(path, &st) == 0) {
        if (S_ISDIR(st.st_mode)) {
            why = "is a folder";
        } else if (regular_only && !S_ISREG(st.st_mode)) {
            why = "exists and is not a regular file";
        } else if (access(path, W_OK) != 0) {
            why = strerror(errno);
        } else if (S_ISREG(st.st_mode)) {
            /* Replaced by a new file beside it (or beside a link's target): its folder must
             * take one too. (A device or pipe is written in place.) */
            char *target = realpath(path, NULL);
            why = target ? folder_refuses(target) : strerror(errno);
            free(target);
        }
    } else if (errno != ENOENT) {
        why = strerror(errno);
    } else if (lstat(path, &st) == 0) {
        why = "is a symbolic link to nothing";
    } else {
        why = folder_refuses(path);
    }
    if (why)
        fprintf(stderr, "strata %s: %s %s: %s\n", cmd, flag, path, why);
    return why == NULL;
}

int cli_read_text(const char *cmd, const char *path, char **out, size_t *len)
{
    strata_error err = {0};
    if (cli_read_file(path, 64u << 20, out, len, &err) != STRATA_OK) {
        fprintf(stderr, "strata %s: --text: %s\n", cmd, err.msg);
        return EXIT_USAGE;
    }
    size_t valid = proto_utf8_check(*out, *len);
    const char *nul = memchr(*out, 0, *len);
    if (valid == *len && !nul)
        return 0;
    bool at_nul = nul && (size_t)(nul - *out) <= valid;
    fprintf(stderr, "strata %s: --text %s: %s at byte %zu (the text must be UTF-8)\n", cmd, path,
            at_nul ? "a NUL byte" : "invalid UTF-8", at_nul ? (size_t)(nul - *out) : valid);
    free(*out);
    *out = NULL;
    return EXIT_USAGE;
}

int cli_read_file(const char *path, size_t max_bytes, char **out, size_t *len, strata_error *err)
{
    *out = NULL;
    *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f)
        return strata_fail(err, STRATA_EIO, "%s: %s", path, strerror(errno));
    size_t cap = 65536, n = 0;
    char *buf = malloc(cap + 1);
    while (buf) {
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (n > max_bytes)
            break;
        if (got == 0)
            break;
        if (n == cap) {
            char *grown = realloc(buf, cap * 2 + 1);
            if (!grown) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = grown;
            cap *= 2;
        }
    }
    int rd_err = ferror(f) ? (errno ? errno : EIO) : 0;  /* EISDIR for a folder */
    fclose(f);
    if (!buf)
        return strata_fail(err, STRATA_ENOMEM, "%s: out of memory", path);
    if (rd_err || n > max_bytes) {
        free(buf);
        return rd_err ? strata_fail(err, STRATA_EIO, "%s: %s", path, strerror(rd_err))
                      : strata_fail(err, STRATA_EINVAL, "%s: larger than %zu bytes", path, max_bytes);
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return STRATA_OK;
}

int cli_tokenize_document(const tokenizer *tok, const char *text, size_t len, int32_t **ids, size_t *n,
                          strata_error *err)
{
    *ids = NULL;
    *n = 0;
    int32_t *body = NULL;
    size_t n_body = 0;
    int rc = tokenizer_encode(tok, text, len, false, &body, &n_body, err);
    if (rc)
        return rc;
    const bool bos = tokenizer_add_bos(tok);
    int32_t *out = malloc((n_body + 1) * sizeof *out);
    if (!out) {
        free(body);
        return strata_fail(err, STRATA_ENOMEM, "out of memory for %zu token ids", n_body + 1);
    }
    if (bos)
        out[0] = tokenizer_bos(tok);
    if (n_body)
        memcpy(out + (bos ? 1 : 0), body, n_body * sizeof *body);
    free(body);
    *ids = out;
    *n = n_body + (bos ? 1 : 0);
    return STRATA_OK;
}

int cli_check_model(const char *cmd, const char *path)
{
    strata_error err = {0};
    if (model_check_path(path, &err) == STRATA_OK)
        return 0;
    fprintf(stderr, "strata %s: %s\n", cmd, err.msg);
    if (!strcmp(path, STRATA_DEFAULT_MODEL))
        fprintf(stderr, "strata %s: run scripts/setup.sh to download the default model, or pass --model\n", cmd);
    return EXIT_USAGE;
}
