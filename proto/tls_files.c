/* TLS files: see tls_files.h. */
#include "proto/tls_files.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <stdlib.h>
#include <string.h>

#include "proto/credential_file.h"

void proto_tls_free_key(char *key)
{
    if (key) {
        explicit_bzero(key, strlen(key));
        free(key);
    }
}

/* The whole file, which must look like PEM. */
static int read_pem(const char *path, const char *what, char **out, strata_error *err)
{
    size_t n = 0;
    strata_error why = {0};
    *out = NULL;
    int rc = credential_file_read(path, PROTO_TLS_FILE_MAX, false, out, &n, &why);
    if (rc != STRATA_OK)   /* a file the user named: EINVAL, as a bad one */
        return strata_fail(err, rc == STRATA_ENOMEM ? rc : STRATA_EINVAL, "cannot read the TLS %s %s: %s", what,
                           path, why.msg);
    if (!strstr(*out, "-----BEGIN ")) {
        proto_tls_free_key(*out);   /* perhaps a key in another format */
        *out = NULL;
        return strata_fail(err, STRATA_EINVAL, "the TLS %s %s is not a PEM file", what, path);
    }
    return STRATA_OK;
}

/* A passphrase callback that has none: an encrypted key fails to load instead of OpenSSL asking
 * for its passphrase on the terminal. */
static int no_passphrase(char *buf, int size, int rwflag, void *u)
{
    (void)buf, (void)size, (void)rwflag, (void)u;
    return -1;
}

/* The first certificate of the PEM text (from the file at path, for the message). */
static int first_cert(const char *pem, const char *path, X509 **out, strata_error *err)
{
    BIO *b = BIO_new_mem_buf(pem, -1);
    *out = b ? PEM_read_bio_X509(b, NULL, no_passphrase, NULL) : NULL;
    BIO_free(b);
    ERR_clear_error();
    if (!b)
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    if (!*out)
        return strata_fail(err, STRATA_EINVAL, "the TLS certificate %s holds no certificate OpenSSL can read", path);
    return STRATA_OK;
}

static int check_pair(const char *cert, const char *key, const char *cert_path, const char *key_path,
                      strata_error *err)
{
    X509 *x;
    int rc = first_cert(cert, cert_path, &x, err);
    if (rc)
        return rc;
    BIO *kb = BIO_new_mem_buf(key, -1);
    EVP_PKEY *k = kb ? PEM_read_bio_PrivateKey(kb, NULL, no_passphrase, NULL) : NULL;
    if (!kb)
        rc = strata_fail(err, STRATA_ENOMEM, "out of memory");
    else if (!k)
        rc = strata_fail(err, STRATA_EINVAL, "the TLS key %s holds no private key OpenSSL can read (an encrypted "
                         "key is not taken: no passphrase can be given)", key_path);
    else if (X509_check_private_key(x, k) != 1)
        rc = strata_fail(err, STRATA_EINVAL, "the TLS key %s does not belong to the certificate %s", key_path,
                         cert_path);
    EVP_PKEY_free(k);
    X509_free(x);
    BIO_free(kb);
    ERR_clear_error();
    return rc;
}

int proto_tls_read_pair(const char *cert_path, const char *key_path, char **cert, char **key, strata_error *err)
{
    *cert = *key = NULL;
    int rc = read_pem(cert_path, "certificate", cert, err);
    if (!rc)
        rc = read_pem(key_path, "key", key, err);
    if (!rc)
        rc = check_pair(*cert, *key, cert_path, key_path, err);
    if (rc) {
        free(*cert);
        proto_tls_free_key(*key);
        *cert = *key = NULL;
    }
    return rc;
}

/* How many X.509 certificates in pem parse; -1 when out of memory. */
static int pem_certificates(const char *pem)
{
    BIO *bio = BIO_new_mem_buf(pem, -1);
    if (!bio)
        return -1;
    int n = 0;
    for (X509 *x; (x = PEM_read_bio_X509(bio, NULL, NULL, NULL)) != NULL; n++)
        X509_free(x);
    ERR_clear_error();   /* the read that ended the loop leaves its "no start line" */
    BIO_free(bio);
    return n;
}

int proto_tls_read_roots(const char *path, char **pem, strata_error *err)
{
    size_t len = 0;
    strata_error why = {0};
    *pem = NULL;
    int rc = credential_file_read(path, PROTO_TLS_FILE_MAX, false, pem, &len, &why);
    if (rc != STRATA_OK)
        return strata_fail(err, rc == STRATA_ENOMEM ? rc : STRATA_EINVAL, "%s: %s", path, why.msg);
    const int n = pem_certificates(*pem);
    if (n > 0)
        return STRATA_OK;
    proto_tls_free_key(*pem);   /* perhaps a private key given by mistake */
    *pem = NULL;
    if (n < 0)
        return strata_fail(err, STRATA_ENOMEM, "out of memory");
    return strata_fail(err, STRATA_EINVAL, "%s holds no valid PEM certificate (-----BEGIN CERTIFICATE-----)", path);
}

int proto_tls_cert_names(const char *cert_path, const char *host, bool *named, strata_error *err)
{
    *named = false;
    char *pem = NULL;
    X509 *x = NULL;
    int rc = read_pem(cert_path, "certificate", &pem, err);
    if (!rc)
        rc = first_cert(pem, cert_path, &x, err);
    if (!rc)
        *named = X509_check_ip_asc(x, host, 0) == 1 || X509_check_host(x, host, 0, 0, NULL) == 1;
    X509_free(x);
    free(pem);
    ERR_clear_error();
    return rc;
}
