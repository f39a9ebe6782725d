/* AES-256-GCM records keyed by an ephemeral X25519 agreement (transport_seal.h), all through
 * OpenSSL's EVP interface. */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>

#include "kvstore/bytes.h"
#include "worker/transport/transport_seal.h"

struct dp_kx {
    EVP_PKEY *key;
};

typedef struct seal_dir {
    EVP_CIPHER_CTX *ctx;
    uint64_t next;   /* the number of the next record */
    uint8_t key[DP_SEAL_KEY_BYTES];
} seal_dir;

struct dp_seal {
    seal_dir send, recv;
};

enum { NONCE_BYTES = 12 };
static const char keys_label[] = "strata data plane keys v2";

static int ossl_fail(strata_error *err, const char *what)
{
    return strata_fail(err, STRATA_EIO, "data plane: %s failed (OpenSSL)", what);
}

int dp_kx_new(dp_kx **out, uint8_t public_key[DP_KX_PUBLIC_BYTES], strata_error *err)
{
    *out = NULL;
    dp_kx *kx = calloc(1, sizeof *kx);
    if (!kx)
        return strata_fail(err, STRATA_ENOMEM, "data plane: out of memory for a key exchange");
    EVP_PKEY_CTX *ctx = EVP_PKEY_CTX_new_id(EVP_PKEY_X25519, NULL);
    size_t len = DP_KX_PUBLIC_BYTES;
    int ok = ctx && EVP_PKEY_keygen_init(ctx) > 0 && EVP_PKEY_keygen(ctx, &kx->key) > 0 &&
             EVP_PKEY_get_raw_public_key(kx->key, public_key, &len) > 0 && len == DP_KX_PUBLIC_BYTES;
    EVP_PKEY_CTX_free(ctx);
    if (!ok) {
        dp_kx_free(kx);
        return ossl_fail(err, "X25519 key generation");
    }
    *out = kx;
    return STRATA_OK;
}

void dp_kx_free(dp_kx *kx)
{
    if (!kx)
        return;
    EVP_PKEY_free(kx->key); /* OpenSSL wipes the private key it frees */
    free(kx);
}

static int x25519(const dp_kx *kx, const uint8_t peer_public[DP_KX_PUBLIC_BYTES], uint8_t shared[32],
                  strata_error *err)
{
    EVP_PKEY *peer = EVP_PKEY_new_raw_public_key(EVP_PKEY_X25519, NULL, peer_public, DP_KX_PUBLIC_BYTES);
    if (!peer)
        return strata_fail(err, STRATA_EINVAL, "data plane: the peer's key-exchange value is not an X25519 key");
    EVP_PKEY_CTX *ctx = EVP_PKEY_CTX_new(kx->key, NULL);
    size_t len = 32;
    /* OpenSSL refuses an all-zero result, which a low-order peer point would give. */
    int ok = ctx && EVP_PKEY_derive_init(ctx) > 0 && EVP_PKEY_derive_set_peer(ctx, peer) > 0 &&
             EVP_PKEY_derive(ctx, shared, &len) > 0 && len == 32;
    EVP_PKEY_CTX_free(ctx);
    EVP_PKEY_free(peer);
    if (!ok)
        return strata_fail(err, STRATA_EINVAL, "data plane: X25519 agreement with the peer's key failed "
                                               "(a low-order point?)");
    return STRATA_OK;
}

static int hkdf(const uint8_t *salt, size_t salt_len, const uint8_t *ikm, size_t ikm_len, const uint8_t *info,
                size_t info_len, uint8_t *out, size_t out_len)
{
    if (salt_len > INT_MAX || info_len > INT_MAX)
        return 0;
    EVP_PKEY_CTX *ctx = EVP_PKEY_CTX_new_id(EVP_PKEY_HKDF, NULL);
    size_t len = out_len;
    int ok = ctx && EVP_PKEY_derive_init(ctx) > 0 && EVP_PKEY_CTX_set_hkdf_md(ctx, EVP_sha256()) > 0 &&
             EVP_PKEY_CTX_set1_hkdf_salt(ctx, salt, (int)salt_len) > 0 &&
             EVP_PKEY_CTX_set1_hkdf_key(ctx, ikm, (int)ikm_len) > 0 &&
             EVP_PKEY_CTX_add1_hkdf_info(ctx, info, (int)info_len) > 0 && EVP_PKEY_derive(ctx, out, &len) > 0 &&
             len == out_len;
    EVP_PKEY_CTX_free(ctx);
    return ok;
}

static int dir_init(seal_dir *d, const uint8_t key[DP_SEAL_KEY_BYTES], int encrypt)
{
    memcpy(d->key, key, DP_SEAL_KEY_BYTES);
    d->next = 0;
    d->ctx = EVP_CIPHER_CTX_new();
    return d->ctx && EVP_CipherInit_ex(d->ctx, EVP_aes_256_gcm(), NULL, NULL, NULL, encrypt) > 0 &&
           EVP_CIPHER_CTX_ctrl(d->ctx, EVP_CTRL_GCM_SET_IVLEN, NONCE_BYTES, NULL) > 0 &&
           EVP_CipherInit_ex(d->ctx, NULL, NULL, key, NULL, encrypt) > 0;
}

int dp_seal_new(const dp_kx *kx, const uint8_t peer_public[DP_KX_PUBLIC_BYTES], const uint8_t *secret,
                size_t secret_len, const uint8_t *transcript, size_t transcript_len, int sender_is_connector,
                dp_seal **out, strata_error *err)
{
    *out = NULL;
    uint8_t shared[32];
    int rc = x25519(kx, peer_public, shared, err);
    if (rc != STRATA_OK)
        return rc;
    size_t info_len = sizeof keys_label + transcript_len;
    uint8_t *info = malloc(info_len);
    dp_seal *s = calloc(1, sizeof *s);
    if (!info || !s) {
        free(info);
        free(s);
        OPENSSL_cleanse(shared, sizeof shared);
        return strata_fail(err, STRATA_ENOMEM, "data plane: out of memory for a link's keys");
    }
    memcpy(info, keys_label, sizeof keys_label); /* with its NUL, as a separator */
    memcpy(info + sizeof keys_label, transcript, transcript_len);
    uint8_t keys[2 * DP_SEAL_KEY_BYTES]; /* connector to acceptor, then acceptor to connector */
    int ok = hkdf(secret, secret_len, shared, sizeof shared, info, info_len, keys, sizeof keys);
    OPENSSL_cleanse(shared, sizeof shared);
    free(info);
    if (ok) {
        const uint8_t *c2a = keys, *a2c = keys + DP_SEAL_KEY_BYTES;
        ok = dir_init(&s->send, sender_is_connector ? c2a : a2c, 1) &&
             dir_init(&s->recv, sender_is_connector ? a2c : c2a, 0);
    }
    OPENSSL_cleanse(keys, sizeof keys);
    if (!ok) {
        dp_seal_free(s);
        return ossl_fail(err, "deriving the link's AES-256-GCM keys");
    }
    *out = s;
    return STRATA_OK;
}

void dp_seal_free(dp_seal *s)
{
    if (!s)
        return;
    EVP_CIPHER_CTX_free(s->send.ctx); /* frees (and clears) the expanded keys */
    EVP_CIPHER_CTX_free(s->recv.ctx);
    OPENSSL_cleanse(s, sizeof *s);
    free(s);
}

static void nonce_of(uint64_t n, uint8_t nonce[NONCE_BYTES])
{
    memset(nonce, 0, 4);
    kv_st64(nonce + 4, n);
}

int dp_seal_record(dp_seal *s, const void *a, size_t na, const void *b, size_t nb, uint8_t *out,
                   strata_error *err)
{
    const size_t n = na + nb;
    if (n == 0 || n > DP_RECORD_MAX)
        return strata_fail(err, STRATA_EINVAL, "data plane: a record of %zu bytes (1..%d)", n, DP_RECORD_MAX);
    seal_dir *d = &s->send;
    uint8_t nonce[NONCE_BYTES];
    nonce_of(d->next, nonce);
    kv_st32(out, (uint32_t)n);
    uint8_t *ct = out + DP_RECORD_HEAD;
    int len = 0;
    int ok = EVP_EncryptInit_ex(d->ctx, NULL, NULL, NULL, nonce) > 0 &&
             EVP_EncryptUpdate(d->ctx, NULL, &len, out, DP_RECORD_HEAD) > 0 &&
             (na == 0 || EVP_EncryptUpdate(d->ctx, ct, &len, a, (int)na) > 0) &&
             (nb == 0 || EVP_EncryptUpdate(d->ctx, ct + na, &len, b, (int)nb) > 0) &&
             EVP_EncryptFinal_ex(d->ctx, ct + n, &len) > 0 &&
             EVP_CIPHER_CTX_ctrl(d->ctx, EVP_CTRL_GCM_GET_TAG, DP_RECORD_TAG, ct + n) > 0;
    if (!ok)
        return ossl_fail(err, "AES-256-GCM sealing");
    d->next++;
    return STRATA_OK;
}

void dp_seal_unsend(dp_seal *s)
{
    if (s->send.next > 0)
        s->send.next--;
}

uint32_t dp_record_length(const uint8_t head[DP_RECORD_HEAD]) { return kv_ld32(head); }

int dp_seal_open(dp_seal *s, const uint8_t *head, uint8_t *ct, const uint8_t *tag)
{
    seal_dir *d = &s->recv;
    const uint32_t n = dp_record_length(head);
    if (n == 0 || n > DP_RECORD_MAX)
        return -1;
    uint8_t nonce[NONCE_BYTES], tag_copy[DP_RECORD_TAG];
    nonce_of(d->next, nonce);
    memcpy(tag_copy, tag, sizeof tag_copy); /* OpenSSL takes a non-const pointer */
    int len = 0;
    int ok = EVP_DecryptInit_ex(d->ctx, NULL, NULL, NULL, nonce) > 0 &&
             EVP_DecryptUpdate(d->ctx, NULL, &len, head, DP_RECORD_HEAD) > 0 &&
             EVP_DecryptUpdate(d->ctx, ct, &len, ct, (int)n) > 0 &&
             EVP_CIPHER_CTX_ctrl(d->ctx, EVP_CTRL_GCM_SET_TAG, DP_RECORD_TAG, tag_copy) > 0 &&
             EVP_DecryptFinal_ex(d->ctx, tag_copy, &len) > 0;
    if (!ok) {
        OPENSSL_cleanse(ct, n);
        return -1;
    }
    d->next++;
    return 0;
}

void dp_seal_keys(const dp_seal *s, uint8_t send_key[DP_SEAL_KEY_BYTES], uint8_t recv_key[DP_SEAL_KEY_BYTES])
{
    memcpy(send_key, s->send.key, DP_SEAL_KEY_BYTES);
    memcpy(recv_key, s->recv.key, DP_SEAL_KEY_BYTES);
}
