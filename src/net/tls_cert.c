/* tls_cert — a cluster CA and node certificates for tests and small clusters (tls.h). */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/bn.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include "tls.h"
#include "util.h"

static bool name_ok(const char *s) {
    size_t n = strlen(s);
    if (n == 0 || n > 63) return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '-' ||
              c == '_'))
            return false;
    }
    return strcmp(s, "ca") != 0; /* ca.pem is the CA's */
}

static bool add_ext(X509 *x, X509 *issuer, int nid, const char *value) {
    X509V3_CTX v;
    X509V3_set_ctx_nodb(&v);
    X509V3_set_ctx(&v, issuer, x, NULL, NULL, 0);
    X509_EXTENSION *e = X509V3_EXT_conf_nid(NULL, &v, nid, value);
    if (!e) return false;
    bool ok = X509_add_ext(x, e, -1) == 1;
    X509_EXTENSION_free(e);
    return ok;
}

/* A certificate for key with subject CN=cn, signed by issuer_key (issuer NULL: self-signed CA). */
static X509 *make_cert(EVP_PKEY *key, const char *cn, X509 *issuer, EVP_PKEY *issuer_key, int days) {
    X509 *x = X509_new();
    if (!x) return NULL;
    unsigned char serial[16];
    BIGNUM *bn = NULL;
    bool ok = getrandom(serial, sizeof serial, 0) == (ssize_t)sizeof serial;
    serial[0] &= 0x7f; /* positive */
    if (ok) ok = (bn = BN_bin2bn(serial, sizeof serial, NULL)) != NULL;
    ok = ok && X509_set_version(x, 2) == 1 && BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(x)) != NULL;
    ok = ok && X509_gmtime_adj(X509_getm_notBefore(x), -3600) && X509_gmtime_adj(X509_getm_notAfter(x), (long)days * 86400);
    ok = ok && X509_set_pubkey(x, key) == 1;
    X509_NAME *name = X509_get_subject_name(x);
    ok = ok && X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, (const unsigned char *)cn, -1, -1, 0) == 1;
    ok = ok && X509_set_issuer_name(x, issuer ? X509_get_subject_name(issuer) : name) == 1;
    X509 *iss = issuer ? issuer : x;
    if (issuer) {
        ok = ok && add_ext(x, iss, NID_basic_constraints, "critical,CA:FALSE") &&
             add_ext(x, iss, NID_key_usage, "critical,digitalSignature,keyAgreement") &&
             add_ext(x, iss, NID_ext_key_usage, "serverAuth,clientAuth");
    } else {
        ok = ok && add_ext(x, iss, NID_basic_constraints, "critical,CA:TRUE,pathlen:0") &&
             add_ext(x, iss, NID_key_usage, "critical,keyCertSign,cRLSign");
    }
    ok = ok && add_ext(x, iss, NID_subject_key_identifier, "hash");
    ok = ok && X509_sign(x, issuer_key, EVP_sha256()) > 0;
    BN_free(bn);
    if (!ok) {
        X509_free(x);
        return NULL;
    }
    return x;
}

/* Writes dir/base.pem (certificate) and dir/base.key (key, mode 0600). */
static int write_pair(const char *dir, const char *base, X509 *x, EVP_PKEY *key, char *msg, size_t msg_cap) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.key", dir, base);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!f) {
        if (fd >= 0) close(fd);
        return kvs_fail(msg, msg_cap, KVS_ERR_IO, "cannot write %s", path);
    }
    bool ok = PEM_write_PrivateKey(f, key, NULL, NULL, 0, NULL, NULL) == 1;
    if (fclose(f) != 0 || !ok) return kvs_fail(msg, msg_cap, KVS_ERR_IO, "cannot write %s", path);
    snprintf(path, sizeof path, "%s/%s.pem", dir, base);
    f = fopen(path, "w");
    if (!f) return kvs_fail(msg, msg_cap, KVS_ERR_IO, "cannot write %s", path);
    ok = PEM_write_X509(f, x) == 1;
    if (fclose(f) != 0 || !ok) return kvs_fail(msg, msg_cap, KVS_ERR_IO, "cannot write %s", path);
    return KVS_OK;
}

int tls_make_cluster(const char *dir, const char *const *names, size_t n, int days, char *msg, size_t msg_cap) {
    if (!dir || (n && !names) || days < 1 || days > 36500)
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "bad argument (days must be 1..36500)");
    for (size_t i = 0; i < n; i++)
        if (!names[i] || !name_ok(names[i]))
            return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG,
                            "node name '%s' must be 1..63 characters of [A-Za-z0-9._-] (and not 'ca')",
                            names[i] ? names[i] : "(null)");
    int rc = KVS_OK;
    EVP_PKEY *ca_key = EVP_PKEY_Q_keygen(NULL, NULL, "EC", "P-256");
    /* A random tag in the CA's name: two clusters' CAs never share a subject. */
    unsigned char tag[4] = {0};
    char ca_cn[64];
    if (getrandom(tag, sizeof tag, 0) != (ssize_t)sizeof tag) memset(tag, 0, sizeof tag);
    snprintf(ca_cn, sizeof ca_cn, "kvshard cluster CA %02x%02x%02x%02x", tag[0], tag[1], tag[2], tag[3]);
    X509 *ca = ca_key ? make_cert(ca_key, ca_cn, NULL, ca_key, days) : NULL;
    if (!ca) {
        rc = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "cannot make the CA certificate");
        goto done;
    }
    if ((rc = write_pair(dir, "ca", ca, ca_key, msg, msg_cap)) != KVS_OK) goto done;
    for (size_t i = 0; i < n; i++) {
        EVP_PKEY *k = EVP_PKEY_Q_keygen(NULL, NULL, "EC", "P-256");
        X509 *x = k ? make_cert(k, names[i], ca, ca_key, days) : NULL;
        if (!x) rc = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "cannot make the certificate of %s", names[i]);
        else rc = write_pair(dir, names[i], x, k, msg, msg_cap);
        X509_free(x);
        EVP_PKEY_free(k);
        if (rc != KVS_OK) goto done;
    }
done:
    X509_free(ca);
    EVP_PKEY_free(ca_key);
    return rc;
}
