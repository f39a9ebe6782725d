/* Private to worker/transport: the encryption of a TCP link (README.md, "Encryption").
 *
 * Each side of a handshake makes an ephemeral X25519 key (dp_kx) and sends its public half in
 * its hello; once the peer's proof on the cluster secret checks out, both derive two
 * AES-256-GCM keys with HKDF-SHA256 (salt: the cluster secret, input: the X25519 shared
 * secret, info: a label and both hellos), one per direction. The byte stream is then cut into
 * sealed records: u32 little-endian plaintext length (1..DP_RECORD_MAX), the ciphertext, a
 * 16-byte tag; the length is the additional data and the nonce is the record's number in its
 * direction (4 zero bytes, u64 little-endian), so a record dropped, repeated, reordered,
 * truncated or altered fails its tag.
 *
 * A dp_seal's sending half and receiving half share nothing, so one thread may seal while
 * another opens. */
#ifndef STRATA_WORKER_TRANSPORT_SEAL_H
#define STRATA_WORKER_TRANSPORT_SEAL_H

#include <stddef.h>
#include <stdint.h>

#include "kvstore/error.h"

#define DP_KX_PUBLIC_BYTES 32
#define DP_RECORD_MAX 65536    /* plaintext bytes in one record */
#define DP_RECORD_HEAD 4       /* the length */
#define DP_RECORD_TAG 16
#define DP_RECORD_OVERHEAD (DP_RECORD_HEAD + DP_RECORD_TAG)
#define DP_SEAL_KEY_BYTES 32

/* An ephemeral X25519 key pair, used for one handshake. */
typedef struct dp_kx dp_kx;
int dp_kx_new(dp_kx **out, uint8_t public_key[DP_KX_PUBLIC_BYTES], strata_error *err);
void dp_kx_free(dp_kx *kx); /* wipes the private half; NULL is a no-op */

typedef struct dp_seal dp_seal;

/* Derives both directions' keys from kx and the peer's public key. sender_is_connector: this
 * side connected (its sending key is the connector-to-acceptor one). transcript: both hellos,
 * the connector's first. STRATA_EINVAL when the peer's key is unusable (a low-order point). */
int dp_seal_new(const dp_kx *kx, const uint8_t peer_public[DP_KX_PUBLIC_BYTES], const uint8_t *secret,
                size_t secret_len, const uint8_t *transcript, size_t transcript_len, int sender_is_connector,
                dp_seal **out, strata_error *err);
void dp_seal_free(dp_seal *s); /* wipes the keys; NULL is a no-op */

/* Seals the na bytes at a then the nb bytes at b (1 <= na + nb <= DP_RECORD_MAX) as this side's
 * next record into out (na + nb + DP_RECORD_OVERHEAD bytes). */
int dp_seal_record(dp_seal *s, const void *a, size_t na, const void *b, size_t nb, uint8_t *out,
                   strata_error *err);
/* Takes back the last sealed record, which never reached the wire (its number is used again). */
void dp_seal_unsend(dp_seal *s);

/* The plaintext length a record head announces (not yet checked against DP_RECORD_MAX). */
uint32_t dp_record_length(const uint8_t head[DP_RECORD_HEAD]);

/* Opens the peer's next record: head (its DP_RECORD_HEAD bytes), ct (dp_record_length(head)
 * bytes of ciphertext, decrypted in place) and tag (DP_RECORD_TAG bytes), which need not be
 * contiguous. Returns 0, or -1 when the tag does not verify (ct is then wiped: nothing
 * unauthenticated is ever handed on). */
int dp_seal_open(dp_seal *s, const uint8_t *head, uint8_t *ct, const uint8_t *tag);

/* Tests only: the keys of this side's sending and receiving directions. */
void dp_seal_keys(const dp_seal *s, uint8_t send_key[DP_SEAL_KEY_BYTES], uint8_t recv_key[DP_SEAL_KEY_BYTES]);

#endif
