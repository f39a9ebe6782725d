/* Control-plane proofs of the cluster secret (control_auth.h). */
#include "proto/control_auth.h"

#include <stdlib.h>
#include <string.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

int proto_control_proof(proto_proof_role role, const void *secret, size_t secret_len,
                        const uint8_t coordinator_nonce[PROTO_CONTROL_NONCE_BYTES],
                        const uint8_t worker_nonce[PROTO_CONTROL_NONCE_BYTES], const char *worker_name,
                        uint8_t out[PROTO_CONTROL_PROOF_BYTES], strata_error *err)
{
    if (!secret || !secret_len || !coordinator_nonce || !worker_nonce || !worker_name || !out)
        return strata_fail(err, STRATA_EINVAL, "control proof: NULL argument or empty secret");
    /* sizeof takes the label's NUL too: it ends the label. */
    static const char worker_label[] = "strata-control-v3 worker", coord_label[] = "strata-control-v3 coordinator";
    const char *label = role == PROTO_PROOF_WORKER ? worker_label : coord_label;
    const size_t label_len = role == PROTO_PROOF_WORKER ? sizeof worker_label : sizeof coord_label;
    const size_t name_len = strlen(worker_name);
    if (secret_len > INT32_MAX)
        return strata_fail(err, STRATA_EINVAL, "control proof: secret of %zu bytes", secret_len);
    const size_t msg_len = label_len + 2 * PROTO_CONTROL_NONCE_BYTES + name_len;
    uint8_t *msg = malloc(msg_len);
    if (!msg)
        return strata_fail(err, STRATA_ENOMEM, "control proof: out of memory");
    uint8_t *p = msg;
    memcpy(p, label, label_len);
    p += label_len;
    memcpy(p, coordinator_nonce, PROTO_CONTROL_NONCE_BYTES);
    p += PROTO_CONTROL_NONCE_BYTES;
    memcpy(p, worker_nonce, PROTO_CONTROL_NONCE_BYTES);
    p += PROTO_CONTROL_NONCE_BYTES;
    memcpy(p, worker_name, name_len);
    unsigned len = 0;
    const bool ok = HMAC(EVP_sha256(), secret, (int)secret_len, msg, msg_len, out, &len) && len == PROTO_CONTROL_PROOF_BYTES;
    free(msg);
    return ok ? STRATA_OK : strata_fail(err, STRATA_EIO, "control proof: HMAC-SHA256 failed (OpenSSL)");
}

bool proto_control_proof_equal(const void *got, size_t got_len, const uint8_t expected[PROTO_CONTROL_PROOF_BYTES])
{
    return got && got_len == PROTO_CONTROL_PROOF_BYTES && CRYPTO_memcmp(got, expected, PROTO_CONTROL_PROOF_BYTES) == 0;
}
