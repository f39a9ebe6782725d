/* gRPC's log sink: see grpc_log.h. */
#include "proto/grpc_log.h"

#include <errno.h>
#include <grpc/grpc.h>
#include <grpc/support/log.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

/* What one thread keeps while it captures (gRPC logs a failed listen on the caller's thread). */
static _Thread_local struct {
    bool on;
    char first[1024];
} capture;

/* Definitive TLS handshake failures gRPC logged (see proto_grpc_tls_failures). */
static pthread_mutex_t tls_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t tls_failures;
static char tls_reason[256];

/* "Handshake failed with fatal error SSL_ERROR_SSL: error:0A000086:SSL routines::certificate
 * verify failed.": a protocol-level failure (an I/O one is SSL_ERROR_SYSCALL and may pass). */
static bool note_tls_failure(const char *msg)
{
    if (!strstr(msg, "Handshake failed") || !strstr(msg, "SSL_ERROR_SSL"))
        return false;
    const char *why = msg, *p;
    while ((p = strstr(why, "::")) != NULL)
        why = p + 2;
    size_t len = strlen(why);
    while (len && (why[len - 1] == '.' || why[len - 1] == '\n'))
        len--;
    pthread_mutex_lock(&tls_mu);
    tls_failures++;
    snprintf(tls_reason, sizeof tls_reason, "%.*s", (int)len, why);
    pthread_mutex_unlock(&tls_mu);
    return true;
}

static atomic_bool quiet_tls;

void proto_grpc_log_quiet_tls(bool quiet) { atomic_store(&quiet_tls, quiet); }

uint64_t proto_grpc_tls_failures(char *reason, size_t n)
{
    pthread_mutex_lock(&tls_mu);
    const uint64_t count = tls_failures;
    if (reason && n)
        snprintf(reason, n, "%s", tls_reason);
    pthread_mutex_unlock(&tls_mu);
    return count;
}

/* line without the values of its created_time:"..." fields (gRPC stamps its error records), so
 * that two reports of the same failure compare equal. */
static void without_times(const char *line, char *out, size_t cap)
{
    static const char field[] = "created_time:\"";
    size_t o = 0;
    for (const char *p = line; *p && o + 1 < cap;) {
        if (!strncmp(p, field, sizeof field - 1)) {
            const char *end = strchr(p + sizeof field - 1, '"');
            if (end) {
                p = end + 1;
                continue;
            }
        }
        out[o++] = *p++;
    }
    out[o] = '\0';
}

static void sink(gpr_log_func_args *a)
{
    const char *msg = a->message ? a->message : "";
    if (note_tls_failure(msg) && atomic_load(&quiet_tls))
        return;
    const bool assertion = strncmp(msg, "assertion failed", 16) == 0;
    if (capture.on && a->severity == GPR_LOG_SEVERITY_ERROR && !assertion) {
        if (!capture.first[0])
            snprintf(capture.first, sizeof capture.first, "%s", msg);
        return;
    }
    const char *file = a->file ? strrchr(a->file, '/') : NULL;
    file = file ? file + 1 : (a->file ? a->file : "?");
    const char *level = a->severity == GPR_LOG_SEVERITY_ERROR  ? "error"
                        : a->severity == GPR_LOG_SEVERITY_INFO ? "info"
                                                               : "debug";
    char line[2048];
    snprintf(line, sizeof line, "gRPC %s (%s:%d): %s", level, file, a->line, msg);
    /* gRPC retries a failing connection every second or so and logs each try the same way (a
     * TLS handshake it cannot pass): a line equal to the last one, within a minute of it, is
     * counted instead of printed, and the count said before the next different line. */
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    static char last[sizeof line];
    static time_t last_at;
    static unsigned repeats;
    char key[sizeof line];
    without_times(line, key, sizeof key);
    const time_t now = time(NULL);
    pthread_mutex_lock(&mu);
    if (!assertion && !strcmp(key, last) && now - last_at < PROTO_GRPC_LOG_REPEAT_S) {
        repeats++;
        pthread_mutex_unlock(&mu);
        return;
    }
    if (repeats)
        fprintf(stderr, "%s: gRPC: the line before came %u more time%s\n", program_invocation_short_name, repeats,
                repeats == 1 ? "" : "s");
    fprintf(stderr, "%s: %s\n", program_invocation_short_name, line);
    memcpy(last, key, sizeof key);
    last_at = now;
    repeats = 0;
    pthread_mutex_unlock(&mu);
}

static void install(void)
{
    gpr_set_log_function(sink);
}

void proto_grpc_init(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    (void)pthread_once(&once, install);
    grpc_init();
}

void proto_grpc_log_capture_begin(void)
{
    capture.on = true;
    capture.first[0] = '\0';
}

void proto_grpc_log_capture_end(char *reason, size_t n)
{
    capture.on = false;
    if (reason && n)
        proto_grpc_error_reason(capture.first, reason, n);
    capture.first[0] = '\0';
}

/* The quoted value of `key:"..."` in text ("" when absent), into out. */
static bool quoted_field(const char *text, const char *key, char *out, size_t n)
{
    char pat[32];
    snprintf(pat, sizeof pat, "%s:\"", key);
    const char *at = NULL;
    for (const char *p = strstr(text, pat); p; p = strstr(p + 1, pat))
        at = p;   /* the last one: the deepest record */
    if (!at)
        return false;
    at += strlen(pat);
    const char *end = strchr(at, '"');
    size_t len = end ? (size_t)(end - at) : strlen(at);
    snprintf(out, n, "%.*s", (int)len, at);
    return true;
}

void proto_grpc_error_reason(const char *text, char *out, size_t n)
{
    if (!out || !n)
        return;
    out[0] = '\0';
    if (!text)
        return;
    char os_error[256], syscall_name[64];
    if (quoted_field(text, "os_error", os_error, sizeof os_error)) {
        if (quoted_field(text, "syscall", syscall_name, sizeof syscall_name))
            snprintf(out, n, "%s: %s", syscall_name, os_error);
        else
            snprintf(out, n, "%s", os_error);
        return;
    }
    const char *rec = text;
    for (const char *p = strstr(text, "children:["); p; p = strstr(p + 1, "children:["))
        rec = p + strlen("children:[");
    /* A record reads STATUS:message {fields}; the status is upper case and underscores. */
    const char *colon = rec;
    while ((*colon >= 'A' && *colon <= 'Z') || *colon == '_')
        colon++;
    if (colon > rec && *colon == ':')
        rec = colon + 1;
    const char *end = strstr(rec, " {");
    size_t len = end ? (size_t)(end - rec) : strlen(rec);
    snprintf(out, n, "%.*s", (int)len, rec);
}
