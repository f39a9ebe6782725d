/* gRPC's own log lines. gRPC prints its errors itself, in its own format (a timestamped line
 * holding a nested error record); strata's programs route them through one sink instead, so
 * that a failure strata reports itself (a port it cannot listen on) is said once, in strata's
 * words, with gRPC's innermost reason in it. GRPC_VERBOSITY still picks what gRPC logs. */
#ifndef STRATA_PROTO_GRPC_LOG_H
#define STRATA_PROTO_GRPC_LOG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* A gRPC line equal to the last one printed, within this many seconds of it, is counted rather
 * than printed again (gRPC logs each retry of a failing connection); the count is printed before
 * the next different line. */
#define PROTO_GRPC_LOG_REPEAT_S 60

/* grpc_init, after installing the sink (once per process). Every strata program calls this
 * where it would call grpc_init; pair it with grpc_shutdown as usual. */
void proto_grpc_init(void);

/* Between capture_begin and capture_end, on the calling thread only, gRPC's error lines are
 * kept rather than printed (a failed assertion still prints: the process aborts after it).
 * capture_end writes the innermost reason of the first kept line to reason ("" when none) and
 * stops keeping. */
void proto_grpc_log_capture_begin(void);
void proto_grpc_log_capture_end(char *reason, size_t n);

/* How many TLS handshakes gRPC has logged as failed for good in this process (an SSL protocol
 * error: a certificate the trust roots do not sign, a peer that speaks no TLS; not an I/O error),
 * and the last one's reason ("certificate verify failed", "wrong version number") into reason.
 * gRPC retries such a connection until the caller's deadline; a caller that compares the count
 * before and after can give up at once, with the reason. */
uint64_t proto_grpc_tls_failures(char *reason, size_t n);

/* Process-wide: whether those TLS handshake failures are counted only, not printed (for a
 * program whose calls' statuses already carry the reason, as strata generate --server's do). */
void proto_grpc_log_quiet_tls(bool quiet);

/* The innermost reason in one of gRPC's error texts: "bind: Address already in use" for a
 * socket error (its syscall and os_error), else the message of the deepest child record
 * ("Name or service not known"), else the text before the record's fields. Never fails: a text
 * it cannot read is copied up to its first " {" (truncated to n). */
void proto_grpc_error_reason(const char *text, char *out, size_t n);

#endif
