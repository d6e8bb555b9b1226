/* tls — mutual TLS 1.3 sessions attached to socket fds. See tls.h for the design notes. */
#include "tls.h"

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

#include "util.h"

struct tls_ctx {
    SSL_CTX *ssl;
    bool server;
};

struct tls_conn {
    SSL *ssl;
    pthread_mutex_t lock; /* every SSL call on ssl (design note 4) */
};

static _Atomic(tls_conn *) g_conns[TLS_MAX_FD];

/* ---- the BIO: send/recv with MSG_DONTWAIT | MSG_NOSIGNAL on a blocking socket ---------- */

static BIO_METHOD *g_bio_method;
static pthread_once_t g_bio_once = PTHREAD_ONCE_INIT;

static int bio_fd(BIO *b) { return (int)(intptr_t)BIO_get_data(b); }

static int bio_write(BIO *b, const char *data, int len) {
    BIO_clear_retry_flags(b);
    ssize_t n = send(bio_fd(b), data, (size_t)len, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n >= 0) return (int)n;
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) BIO_set_retry_write(b);
    return -1;
}

static int bio_read(BIO *b, char *data, int len) {
    BIO_clear_retry_flags(b);
    ssize_t n = recv(bio_fd(b), data, (size_t)len, MSG_DONTWAIT);
    if (n >= 0) return (int)n;
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) BIO_set_retry_read(b);
    return -1;
}

static long bio_ctrl(BIO *b, int cmd, long num, void *ptr) {
    (void)b;
    (void)num;
    (void)ptr;
    return cmd == BIO_CTRL_FLUSH ? 1 : 0; /* writes are never buffered here */
}

static int bio_create(BIO *b) {
    BIO_set_init(b, 1);
    return 1;
}

static void bio_method_init(void) {
    BIO_METHOD *m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "kvshard socket");
    if (m && BIO_meth_set_write(m, bio_write) && BIO_meth_set_read(m, bio_read) &&
        BIO_meth_set_ctrl(m, bio_ctrl) && BIO_meth_set_create(m, bio_create))
        g_bio_method = m;
    else
        BIO_meth_free(m);
}

/* OpenSSL's reason for the last failure on this thread, or fallback. */
static const char *ossl_reason(char *buf, size_t cap, const char *fallback) {
    unsigned long e = ERR_peek_last_error();
    if (!e) return fallback;
    ERR_error_string_n(e, buf, cap);
    return buf;
}

/* ---- contexts ---------------------------------------------------------------- */

int tls_ctx_create(const tls_params *p, bool server, tls_ctx **out, char *msg, size_t msg_cap) {
    char why[256];
    if (!out) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "out is NULL");
    *out = NULL;
    if (!p || !p->cert_file || !p->key_file || !p->ca_file)
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "TLS needs a certificate, its key and the cluster CA");
    pthread_once(&g_bio_once, bio_method_init);
    if (!g_bio_method) return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "cannot make the socket BIO");
    tls_ctx *c = calloc(1, sizeof *c);
    if (!c) return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
    c->server = server;
    ERR_clear_error();
    c->ssl = SSL_CTX_new(server ? TLS_server_method() : TLS_client_method());
    int rc = KVS_ERR_INVALID_ARG;
    if (!c->ssl) {
        rc = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "SSL_CTX_new: %s", ossl_reason(why, sizeof why, "failed"));
        goto fail;
    }
    SSL_CTX_set_min_proto_version(c->ssl, TLS1_3_VERSION);
    SSL_CTX_set_max_proto_version(c->ssl, TLS1_3_VERSION);
    SSL_CTX_set_mode(c->ssl, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    SSL_CTX_set_session_cache_mode(c->ssl, SSL_SESS_CACHE_OFF);
    SSL_CTX_set_options(c->ssl, SSL_OP_NO_TICKET);
    if (server) SSL_CTX_set_num_tickets(c->ssl, 0);
    if (SSL_CTX_use_certificate_chain_file(c->ssl, p->cert_file) != 1) {
        rc = kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "certificate %s: %s", p->cert_file,
                      ossl_reason(why, sizeof why, "cannot load"));
        goto fail;
    }
    if (SSL_CTX_use_PrivateKey_file(c->ssl, p->key_file, SSL_FILETYPE_PEM) != 1 ||
        SSL_CTX_check_private_key(c->ssl) != 1) {
        rc = kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "key %s: %s", p->key_file,
                      ossl_reason(why, sizeof why, "does not match the certificate"));
        goto fail;
    }
    if (SSL_CTX_load_verify_locations(c->ssl, p->ca_file, NULL) != 1) {
        rc = kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "CA %s: %s", p->ca_file,
                      ossl_reason(why, sizeof why, "cannot load"));
        goto fail;
    }
    int mode = SSL_VERIFY_PEER | (server ? SSL_VERIFY_FAIL_IF_NO_PEER_CERT : 0);
    SSL_CTX_set_verify(c->ssl, mode, NULL);
    if (server) {
        STACK_OF(X509_NAME) *cas = SSL_load_client_CA_file(p->ca_file);
        if (cas) SSL_CTX_set_client_CA_list(c->ssl, cas);
    }
    ERR_clear_error();
    *out = c;
    return KVS_OK;
fail:
    ERR_clear_error();
    tls_ctx_free(c);
    return rc;
}

void tls_ctx_free(tls_ctx *c) {
    if (!c) return;
    SSL_CTX_free(c->ssl);
    free(c);
}

/* ---- handshake and identity -------------------------------------------------------- */

/* Waits for events on fd until deadline_ns: KVS_OK (ready or error pending), KVS_ERR_TIMEOUT. */
static int wait_events(int fd, short events, uint64_t deadline_ns) {
    for (;;) {
        int to = -1;
        if (deadline_ns) {
            uint64_t now = kvs_now_ns();
            if (now >= deadline_ns) return KVS_ERR_TIMEOUT;
            uint64_t ms = (deadline_ns - now + 999999u) / 1000000u;
            to = ms > INT_MAX ? INT_MAX : (int)ms;
        }
        struct pollfd pf = {.fd = fd, .events = events, .revents = 0};
        int r = poll(&pf, 1, to);
        if (r > 0) return KVS_OK;
        if (r < 0 && errno != EINTR) return KVS_ERR_IO;
    }
}

/* "PREFIX" + the hex SHA-256 of data[0..n) into id; KVS_OK or KVS_ERR_INVALID_ARG. */
static int hex_digest_id(const char *prefix, const unsigned char *data, size_t n, char *id, size_t cap) {
    unsigned char md[32];
    unsigned int ml = 0;
    if (EVP_Digest(data, n, md, &ml, EVP_sha256(), NULL) != 1 || ml != 32) return KVS_ERR_INVALID_ARG;
    char hex[65];
    for (int i = 0; i < 32; i++) snprintf(hex + 2 * i, 3, "%02x", md[i]);
    snprintf(id, cap, "%s%s", prefix, hex);
    return KVS_OK;
}

/* Appends the UTF-8 bytes of one CN to esc (length *k of cap) escaped reversibly: [A-Za-z0-9._-]
 * as they are, every other byte as %XX, so distinct names never meet. false when it does not fit. */
static bool escape_cn(const unsigned char *u, int n, char *esc, size_t *k, size_t cap) {
    for (int i = 0; i < n; i++) {
        unsigned char ch = u[i];
        bool plain = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '.' ||
                     ch == '-' || ch == '_';
        if (*k + (plain ? 1 : 3) >= cap) return false;
        if (plain) esc[(*k)++] = (char)ch;
        else *k += (size_t)snprintf(esc + *k, 4, "%%%02X", ch);
    }
    return true;
}

/* The identity of certificate x (design note 2): every subject CN as UTF-8 (BMPString and
 * UTF8String alike), escaped and joined by ','; its SHA-256 when the escaped form is longer
 * than an identity holds; the certificate's SHA-256 without a CN. */
static int cert_identity(X509 *x, char *id, size_t cap) {
    X509_NAME *nm = X509_get_subject_name(x);
    char esc[TLS_ID_MAX - 3];
    size_t k = 0;
    bool fits = true, any = false;
    unsigned char *all = NULL; /* the joined UTF-8 names, for the digest form */
    size_t all_len = 0;
    for (int pos = X509_NAME_get_index_by_NID(nm, NID_commonName, -1); pos >= 0;
         pos = X509_NAME_get_index_by_NID(nm, NID_commonName, pos)) {
        unsigned char *u = NULL;
        int n = ASN1_STRING_to_UTF8(&u, X509_NAME_ENTRY_get_data(X509_NAME_get_entry(nm, pos)));
        unsigned char *grown = n >= 0 ? realloc(all, all_len + (size_t)n + 1) : NULL;
        if (!grown) {
            OPENSSL_free(u);
            free(all);
            return KVS_ERR_INVALID_ARG;
        }
        all = grown;
        if (any) all[all_len++] = ',';
        memcpy(all + all_len, u, (size_t)n);
        all_len += (size_t)n;
        if (any) fits = fits && escape_cn((const unsigned char *)",", 1, esc, &k, sizeof esc);
        fits = fits && escape_cn(u, n, esc, &k, sizeof esc);
        any = true;
        OPENSSL_free(u);
    }
    int rc = KVS_OK;
    if (any && fits) {
        esc[k] = 0;
        snprintf(id, cap, "cn:%s", esc);
    } else if (any) {
        rc = hex_digest_id("cnh:", all, all_len, id, cap); /* "cnh:" never starts a "cn:" id */
    } else {
        unsigned char md[32];
        unsigned int ml = 0;
        if (X509_digest(x, EVP_sha256(), md, &ml) != 1 || ml != 32) {
            rc = KVS_ERR_INVALID_ARG;
        } else {
            char hex[65];
            for (int i = 0; i < 32; i++) snprintf(hex + 2 * i, 3, "%02x", md[i]);
            snprintf(id, cap, "sha256:%s", hex);
        }
    }
    free(all);
    return rc;
}

/* Writes the identity of the peer's certificate (design note 2). */
static int peer_identity(SSL *ssl, char *id, size_t cap) {
    X509 *x = SSL_get1_peer_certificate(ssl);
    if (!x) return KVS_ERR_INVALID_ARG;
    int rc = cert_identity(x, id, cap);
    X509_free(x);
    return rc;
}

int tls_cert_file_identity(const char *path, char *id, size_t cap) {
    if (!path || !id || cap < TLS_ID_MAX) return KVS_ERR_INVALID_ARG;
    FILE *f = fopen(path, "r");
    if (!f) return KVS_ERR_IO;
    X509 *x = PEM_read_X509(f, NULL, NULL, NULL);
    fclose(f);
    if (!x) return KVS_ERR_INVALID_ARG;
    int rc = cert_identity(x, id, cap);
    X509_free(x);
    return rc;
}

int tls_handshake(tls_ctx *c, int fd, uint64_t deadline_ns, char *peer_id, size_t id_cap, char *msg,
                  size_t msg_cap) {
    char why[256];
    if (!c || fd < 0 || !peer_id || id_cap < TLS_ID_MAX)
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "bad argument");
    if (fd >= TLS_MAX_FD) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "fd %d too high for TLS", fd);
    tls_conn *t = calloc(1, sizeof *t);
    BIO *bio = BIO_new(g_bio_method);
    SSL *ssl = SSL_new(c->ssl);
    if (!t || !bio || !ssl) {
        free(t);
        BIO_free(bio);
        SSL_free(ssl);
        return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
    }
    BIO_set_data(bio, (void *)(intptr_t)fd);
    SSL_set_bio(ssl, bio, bio); /* ssl owns bio now */
    if (c->server) SSL_set_accept_state(ssl);
    else SSL_set_connect_state(ssl);
    int rc = KVS_OK;
    ERR_clear_error();
    for (;;) {
        int r = SSL_do_handshake(ssl);
        if (r == 1) break;
        int e = SSL_get_error(ssl, r);
        short ev = e == SSL_ERROR_WANT_READ ? POLLIN : e == SSL_ERROR_WANT_WRITE ? POLLOUT : 0;
        if (ev) {
            rc = wait_events(fd, ev, deadline_ns);
            if (rc == KVS_OK) continue;
            rc = kvs_fail(msg, msg_cap, rc, "TLS handshake: %s", rc == KVS_ERR_TIMEOUT ? "timed out" : "poll failed");
            goto fail;
        }
        if (e == SSL_ERROR_SYSCALL || e == SSL_ERROR_ZERO_RETURN) {
            rc = kvs_fail(msg, msg_cap, KVS_ERR_CLOSED, "TLS handshake: the peer closed the connection%s%s",
                          ERR_peek_last_error() ? ": " : "", ossl_reason(why, sizeof why, ""));
            goto fail;
        }
        long v = SSL_get_verify_result(ssl);
        if (v != X509_V_OK)
            rc = kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "TLS handshake: peer certificate: %s",
                          X509_verify_cert_error_string(v));
        else
            rc = kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "TLS handshake: %s",
                          ossl_reason(why, sizeof why, "failed"));
        goto fail;
    }
    if (SSL_version(ssl) != TLS1_3_VERSION || peer_identity(ssl, peer_id, id_cap) != KVS_OK) {
        rc = kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "TLS handshake: no TLS 1.3 peer certificate");
        goto fail;
    }
    t->ssl = ssl;
    pthread_mutex_init(&t->lock, NULL);
    tls_conn *prev = atomic_exchange(&g_conns[fd], t);
    if (prev) { /* a stale entry means someone closed a TLS fd without netio_close: free it */
        SSL_free(prev->ssl);
        pthread_mutex_destroy(&prev->lock);
        free(prev);
    }
    ERR_clear_error();
    return KVS_OK;
fail:
    ERR_clear_error();
    SSL_free(ssl);
    free(t);
    return rc;
}

/* ---- I/O ---------------------------------------------------------------------------------- */

tls_conn *tls_conn_of(int fd) {
    if (fd < 0 || fd >= TLS_MAX_FD) return NULL;
    return atomic_load_explicit(&g_conns[fd], memory_order_acquire);
}

/* Maps the result r of SSL_read / SSL_write (called under t->lock). */
static long io_result(tls_conn *t, int r, short *want) {
    if (r > 0) return r;
    int e = SSL_get_error(t->ssl, r);
    long out;
    if (e == SSL_ERROR_WANT_READ) {
        *want = POLLIN;
        out = 0;
    } else if (e == SSL_ERROR_WANT_WRITE) {
        *want = POLLOUT;
        out = 0;
    } else if (e == SSL_ERROR_ZERO_RETURN || e == SSL_ERROR_SYSCALL) {
        out = KVS_ERR_CLOSED;
    } else {
        unsigned long le = ERR_peek_last_error();
        out = ERR_GET_REASON(le) == SSL_R_UNEXPECTED_EOF_WHILE_READING ? KVS_ERR_CLOSED : KVS_ERR_IO;
    }
    ERR_clear_error();
    return out;
}

long tls_conn_read(tls_conn *t, void *buf, size_t len, short *want) {
    int n = len > INT_MAX ? INT_MAX : (int)len;
    if (n == 0) return 0;
    pthread_mutex_lock(&t->lock);
    ERR_clear_error();
    long r = io_result(t, SSL_read(t->ssl, buf, n), want);
    pthread_mutex_unlock(&t->lock);
    return r;
}

long tls_conn_write(tls_conn *t, const void *buf, size_t len, short *want) {
    int n = len > INT_MAX ? INT_MAX : (int)len;
    if (n == 0) return 0;
    pthread_mutex_lock(&t->lock);
    ERR_clear_error();
    long r = io_result(t, SSL_write(t->ssl, buf, n), want);
    pthread_mutex_unlock(&t->lock);
    return r;
}

bool tls_conn_pending(tls_conn *t) {
    pthread_mutex_lock(&t->lock);
    bool p = SSL_pending(t->ssl) > 0;
    pthread_mutex_unlock(&t->lock);
    return p;
}

void tls_detach(int fd) {
    if (fd < 0 || fd >= TLS_MAX_FD) return;
    tls_conn *t = atomic_exchange(&g_conns[fd], NULL);
    if (!t) return;
    pthread_mutex_lock(&t->lock);
    ERR_clear_error();
    (void)SSL_shutdown(t->ssl); /* one non-blocking try at close_notify */
    ERR_clear_error();
    pthread_mutex_unlock(&t->lock);
    SSL_free(t->ssl);
    pthread_mutex_destroy(&t->lock);
    free(t);
}
