/*
 * tls — mutual TLS 1.3 under netio (OpenSSL), and the peer identity sessions are keyed by.
 *
 * Design notes
 *  1. Every node of a cluster holds a certificate signed by the cluster CA (tls_make_cluster
 *     writes a CA and node certificates). A server demands a client certificate and a client
 *     checks the server's chain against the same CA: both ends are authenticated, and only
 *     TLS 1.3 is spoken. Host names are not checked: any certificate of the cluster CA is a
 *     member of the cluster (docs/security.md).
 *  2. The peer identity is "cn:" + the subject common names of the peer's certificate as
 *     UTF-8, escaped reversibly (bytes outside [A-Za-z0-9._-] as %XX, names joined by ","), or
 *     "cnh:" + the hex SHA-256 of those names when the escaped form does not fit TLS_ID_MAX,
 *     or "sha256:" + the hex SHA-256 of the certificate when it has no CN. The mapping is
 *     injective, so two certificates with different CNs never see each other's sessions
 *     (the server keys sessions by it).
 *  3. A handshake attaches a tls_conn to its socket fd in a process-wide table (fds below
 *     TLS_MAX_FD); netio reads and writes such an fd through the session, so the rest of the
 *     code keeps passing plain fds. netio_close() (tls_detach) ends and frees the session; an fd
 *     with a session must never be close()d directly.
 *  4. The socket stays blocking: the session reads and writes it with MSG_DONTWAIT and
 *     MSG_NOSIGNAL through its own BIO, netio waits with poll() against its deadlines. Every
 *     SSL call on one session is made under the session's lock and never waits inside it, so a
 *     reader thread and a writer thread can share an fd.
 *  5. No session tickets, no resumption, no renegotiation (TLS 1.3 has none).
 */
#ifndef KVS_TLS_H
#define KVS_TLS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define TLS_ID_MAX 80u       /* bytes of a peer identity, NUL included */
#define TLS_MAX_FD 65536     /* fds at or above this cannot carry TLS */

typedef struct tls_ctx tls_ctx;
typedef struct tls_conn tls_conn;

typedef struct {
    const char *cert_file; /* PEM certificate of this node (chain allowed) */
    const char *key_file;  /* PEM private key of cert_file */
    const char *ca_file;   /* PEM cluster CA: a peer must present a certificate it signed */
} tls_params;

/* Loads certificate, key and CA into a context for servers (server true) or clients. On success
 * *out is owned by the caller (tls_ctx_free). KVS_ERR_INVALID_ARG with a message naming the file
 * and OpenSSL's reason when a file is missing or does not fit (key not matching the certificate);
 * *out NULL then. */
int tls_ctx_create(const tls_params *p, bool server, tls_ctx **out, char *msg, size_t msg_cap);
void tls_ctx_free(tls_ctx *c); /* NULL is fine; sessions made from it must be detached first */

/* Runs the TLS handshake on a connected socket fd (server or client side as c was made), until
 * deadline_ns (kvs_now_ns clock; 0 = none). On success the session is attached to fd (design
 * note 3) and peer_id (capacity id_cap >= TLS_ID_MAX) holds the peer's identity. Failure:
 * KVS_ERR_TIMEOUT, KVS_ERR_CLOSED (peer went away), KVS_ERR_INVALID_ARG (no or untrusted peer
 * certificate, not TLS 1.3, any other handshake failure; msg has OpenSSL's reason), KVS_ERR_NOMEM;
 * nothing is attached then and fd stays open (the caller closes it). */
int tls_handshake(tls_ctx *c, int fd, uint64_t deadline_ns, char *peer_id, size_t id_cap, char *msg,
                  size_t msg_cap);

/* The identity (design note 2) of the PEM certificate in path, into id (cap >= TLS_ID_MAX).
 * KVS_OK; KVS_ERR_IO when unreadable, KVS_ERR_INVALID_ARG when not a certificate. */
int tls_cert_file_identity(const char *path, char *id, size_t cap);

/* The session attached to fd, NULL for a plain fd. */
tls_conn *tls_conn_of(int fd);

/* One non-blocking read / write on the session: > 0 bytes moved; 0 when it would block, with
 * *want set to the poll() events to wait for (POLLIN or POLLOUT); < 0 an error code
 * (KVS_ERR_CLOSED for EOF / reset / close_notify, KVS_ERR_IO otherwise). len is capped at
 * INT_MAX. */
long tls_conn_read(tls_conn *t, void *buf, size_t len, short *want);
long tls_conn_write(tls_conn *t, const void *buf, size_t len, short *want);
/* True when the session holds decrypted bytes not yet read (poll() would not see them). */
bool tls_conn_pending(tls_conn *t);

/* Sends close_notify (best effort, never waits) and frees the session attached to fd, if any.
 * Only netio_close() calls this. */
void tls_detach(int fd);

/* Writes a cluster CA and one certificate per node into dir (which must exist):
 * dir/ca.pem, dir/ca.key, and dir/NAME.pem, dir/NAME.key for each of names[0..n) (subject
 * CN = NAME, valid for days days, usable as TLS server and client). Keys are EC P-256, files
 * with keys are mode 0600. NAME must be 1..63 characters of [A-Za-z0-9._-]. KVS_ERR_INVALID_ARG
 * for a bad name or days, KVS_ERR_IO when a file cannot be written (msg names it). Files
 * written before a failure stay. */
int tls_make_cluster(const char *dir, const char *const *names, size_t n, int days, char *msg, size_t msg_cap);

#endif /* KVS_TLS_H */
