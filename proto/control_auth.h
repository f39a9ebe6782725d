/* Proof of the cluster secret on the control plane (proto/strata_internal.proto, protocol
 * version 3): neither side sends the secret; each sends HMAC-SHA256 keyed by it over
 *
 *     label NUL || coordinator nonce (32 bytes) || worker nonce (32 bytes) || worker name
 *
 * with label "strata-control-v3 worker" in Join.secret_proof and "strata-control-v3
 * coordinator" in Admitted.secret_proof. The nonces are fresh random bytes per call, so a proof
 * seen on the wire answers that call only; the name (last, so no boundary is ambiguous) binds
 * it to the worker that joined. This keeps the secret from a passive listener (a weak one can
 * still be guessed offline from a captured proof) and a worker from a coordinator that does
 * not hold it; it does not protect the messages that follow (no TLS on this port): an attacker
 * on the path can let the handshake through and then alter them. */
#ifndef STRATA_PROTO_CONTROL_AUTH_H
#define STRATA_PROTO_CONTROL_AUTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvstore/error.h"

#define PROTO_CONTROL_NONCE_BYTES 32
#define PROTO_CONTROL_PROOF_BYTES 32

typedef enum { PROTO_PROOF_WORKER, PROTO_PROOF_COORDINATOR } proto_proof_role;

/* The proof of role for one call (the formula above). STRATA_EINVAL for NULL arguments or an
 * empty secret; STRATA_ENOMEM; STRATA_EIO when OpenSSL fails. */
int proto_control_proof(proto_proof_role role, const void *secret, size_t secret_len,
                        const uint8_t coordinator_nonce[PROTO_CONTROL_NONCE_BYTES],
                        const uint8_t worker_nonce[PROTO_CONTROL_NONCE_BYTES], const char *worker_name,
                        uint8_t out[PROTO_CONTROL_PROOF_BYTES], strata_error *err);

/* Whether got (got_len bytes, from the wire) is exactly the expected proof; constant time in
 * the bytes compared. */
bool proto_control_proof_equal(const void *got, size_t got_len, const uint8_t expected[PROTO_CONTROL_PROOF_BYTES]);

#endif
