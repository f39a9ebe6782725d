/* TLS files for gRPC, read and checked before gRPC sees them: gRPC takes any text and then fails
 * to listen, or fails every handshake, with the reason only in its log. Here a bad file is named
 * with what is wrong with it. Every text is PEM, NUL-terminated, malloc'd. */
#ifndef STRATA_PROTO_TLS_FILES_H
#define STRATA_PROTO_TLS_FILES_H

#include <stdbool.h>

#include "kvstore/error.h"

/* Largest TLS file read (a certificate chain, a key, a CA bundle). */
#define PROTO_TLS_FILE_MAX ((size_t)1 << 20)

/* A server's certificate chain and private key: both must be PEM that OpenSSL reads (an
 * encrypted key is refused: nobody could type its passphrase) and the key must be the
 * certificate's. STRATA_EINVAL for a file that is bad or cannot be read (the message names it),
 * STRATA_ENOMEM. On success free the key with proto_tls_free_key. */
int proto_tls_read_pair(const char *cert_path, const char *key_path, char **cert, char **key, strata_error *err);

/* Trust roots for a client (a CA bundle, or a self-signed server certificate): at least one
 * certificate OpenSSL reads. Errors as proto_tls_read_pair, each message starting with path
 * ("PATH: No such file or directory", "PATH holds no valid PEM certificate ..."). */
int proto_tls_read_roots(const char *path, char **pem, strata_error *err);

/* Whether the first certificate in the PEM file names host (*named: an IP address against its
 * IP subjectAltNames, a name against its DNS names, as a TLS client checks them). Errors as
 * proto_tls_read_pair for a file that cannot be read or holds no certificate. */
int proto_tls_cert_names(const char *cert_path, const char *host, bool *named, strata_error *err);

/* Wipes and frees a private key's text (NULL: nothing). */
void proto_tls_free_key(char *key);

#endif
