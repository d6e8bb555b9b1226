/*
 * tls: cluster certificates from tls_make_cluster; a mutual TLS 1.3 handshake gives each side the
 * other's identity (CN); frames of every size cross it, also with a reader and a writer thread on
 * one fd; a certificate from another CA, a plaintext peer and a silent peer are refused (the last
 * at the handshake deadline). Through the shard server: a route over TLS gives the same logits
 * as over plaintext, and a second certificate identity cannot read or change the first one's
 * session (the hijack sequence). Ports are picked by the kernel; every wait is bounded.
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/stat.h>

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include "mkmodel.h"
#include "netio.h"
#include "route.h"
#include "server.h"
#include "shard_harness.h"
#include "test.h"
#include "tls.h"
#include "util.h"
#include "wire.h"

static char g_dir[64], g_evil[80];

static void paths(const char *dir, const char *name, char *cert, char *key, char *ca) {
    snprintf(cert, 200, "%s/%s.pem", dir, name);
    snprintf(key, 200, "%s/%s.key", dir, name);
    snprintf(ca, 200, "%s/ca.pem", dir);
}

static tls_ctx *ctx_for(const char *dir, const char *name, bool server) {
    char cert[200], key[200], ca[200], msg[KVS_MSG_MAX] = "";
    paths(dir, name, cert, key, ca);
    tls_params p = {.cert_file = cert, .key_file = key, .ca_file = ca};
    tls_ctx *c = NULL;
    int rc = tls_ctx_create(&p, server, &c, msg, sizeof msg);
    if (rc) fprintf(stderr, "tls_ctx_create %s: %s\n", name, msg);
    return c;
}

/* ---- handshake and frames, below the server --------------------------------------- */

typedef struct {
    tls_ctx *ctx;
    int listen_fd;
    int fd;
    int rc;
    char id[TLS_ID_MAX];
    char msg[KVS_MSG_MAX];
    int frames; /* echo this many frames back, reading and writing from two threads */
} peer;

typedef struct {
    int fd, n;
    atomic_int queued;
    struct netio_buf q[8];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int head, tail;
    bool failed;
} echo_q;

/* Writer half of the echo: sends what the reader queued. */
static void *echo_writer(void *arg) {
    echo_q *e = arg;
    for (int i = 0; i < e->n; i++) {
        pthread_mutex_lock(&e->mu);
        while (e->head == e->tail && !e->failed) pthread_cond_wait(&e->cv, &e->mu);
        if (e->head == e->tail) {
            pthread_mutex_unlock(&e->mu);
            break;
        }
        struct netio_buf b = e->q[e->head % 8];
        pthread_mutex_unlock(&e->mu);
        int rc = netio_send_frame(e->fd, WIRE_OP_STATS, (uint64_t)i, b.data, b.len, netio_deadline_ms(10000));
        pthread_mutex_lock(&e->mu);
        netio_buf_free(&e->q[e->head % 8]);
        e->head++;
        pthread_cond_broadcast(&e->cv);
        pthread_mutex_unlock(&e->mu);
        if (rc) break;
    }
    return NULL;
}

static void *server_main(void *arg) {
    peer *p = arg;
    p->rc = netio_accept(p->listen_fd, netio_deadline_ms(10000), &p->fd, p->msg, sizeof p->msg);
    if (p->rc) return NULL;
    p->rc = tls_handshake(p->ctx, p->fd, netio_deadline_ms(3000), p->id, sizeof p->id, p->msg, sizeof p->msg);
    if (p->rc || p->frames == 0) return NULL;
    echo_q e = {.fd = p->fd, .n = p->frames};
    pthread_mutex_init(&e.mu, NULL);
    pthread_cond_init(&e.cv, NULL);
    pthread_t w;
    pthread_create(&w, NULL, echo_writer, &e);
    for (int i = 0; i < p->frames; i++) {
        struct netio_buf b = {0};
        struct wire_header h;
        char msg[KVS_MSG_MAX];
        int rc = netio_recv_frame(p->fd, &h, &b, netio_deadline_ms(10000), msg, sizeof msg);
        pthread_mutex_lock(&e.mu);
        if (rc) {
            e.failed = true;
            p->rc = rc;
        } else {
            while (e.tail - e.head >= 8) pthread_cond_wait(&e.cv, &e.mu);
            e.q[e.tail % 8] = b;
            e.tail++;
        }
        pthread_cond_broadcast(&e.cv);
        pthread_mutex_unlock(&e.mu);
        if (rc) break;
    }
    pthread_join(w, NULL);
    for (int i = e.head; i < e.tail; i++) netio_buf_free(&e.q[i % 8]);
    pthread_mutex_destroy(&e.mu);
    pthread_cond_destroy(&e.cv);
    return NULL;
}

/* Client side of one connection to a peer server thread; returns the client's handshake code. */
static int client_handshake(uint16_t port, tls_ctx *c, int *fd, char *id) {
    char msg[KVS_MSG_MAX] = "";
    int rc = netio_connect("127.0.0.1", port, netio_deadline_ms(5000), fd, msg, sizeof msg);
    if (rc) return rc;
    rc = tls_handshake(c, *fd, netio_deadline_ms(3000), id, TLS_ID_MAX, msg, sizeof msg);
    if (rc && getenv("KVS_TEST_VERBOSE")) fprintf(stderr, "client handshake: %s\n", msg);
    return rc;
}

static void test_handshake_and_frames(void) {
    tls_ctx *srv_ctx = ctx_for(g_dir, "s1", true), *cli = ctx_for(g_dir, "c1", false);
    CHECK(srv_ctx && cli);
    if (!srv_ctx || !cli) return;
    peer p = {.ctx = srv_ctx, .fd = -1, .frames = 40};
    uint16_t port = 0;
    char msg[KVS_MSG_MAX];
    CHECK_EQ_INT(netio_listen("127.0.0.1", 0, 8, &p.listen_fd, &port, msg, sizeof msg), KVS_OK);
    pthread_t th;
    pthread_create(&th, NULL, server_main, &p);
    int fd = -1;
    char id[TLS_ID_MAX] = "";
    CHECK_EQ_INT(client_handshake(port, cli, &fd, id), KVS_OK);
    CHECK(!strcmp(id, "cn:s1"));
    /* sizes from empty to 3 MiB (many TLS records), checked byte for byte on the way back */
    size_t max = 3u << 20;
    uint8_t *data = malloc(max);
    for (size_t i = 0; i < max; i++) data[i] = (uint8_t)(i * 131u + 7u);
    struct netio_buf b = {0};
    int good = 0;
    for (int i = 0; i < p.frames; i++) {
        size_t len = i == 0 ? 0 : i % 10 == 9 ? max - (size_t)i : (size_t)(i * 997) % 40000;
        CHECK_EQ_INT(netio_send_frame(fd, WIRE_OP_STATS, (uint64_t)i, data, len, netio_deadline_ms(10000)), KVS_OK);
        struct wire_header h;
        if (netio_recv_frame(fd, &h, &b, netio_deadline_ms(10000), msg, sizeof msg) == KVS_OK && b.len == len &&
            (len == 0 || memcmp(b.data, data, len) == 0) && h.request_id == (uint64_t)i)
            good++;
    }
    CHECK_EQ_INT(good, p.frames);
    pthread_join(th, NULL);
    CHECK_EQ_INT(p.rc, KVS_OK);
    CHECK(!strcmp(p.id, "cn:c1"));
    netio_buf_free(&b);
    free(data);
    netio_close(fd);
    netio_close(p.fd);
    CHECK(tls_conn_of(fd) == NULL);

    /* a certificate signed by another CA (its holder trusting ours): refused by the server */
    char ecert[200], ekey[200], eca[200], ca[200], k2[200];
    paths(g_evil, "c1", ecert, ekey, eca);
    paths(g_dir, "c1", ca, k2, ca);
    tls_ctx *evil = NULL;
    tls_params ep = {.cert_file = ecert, .key_file = ekey, .ca_file = ca};
    CHECK_EQ_INT(tls_ctx_create(&ep, false, &evil, msg, sizeof msg), KVS_OK);
    peer q = {.ctx = srv_ctx, .fd = -1, .listen_fd = p.listen_fd};
    pthread_create(&th, NULL, server_main, &q);
    fd = -1;
    int crc = client_handshake(port, evil, &fd, id);
    pthread_join(th, NULL);
    CHECK_EQ_INT(q.rc, KVS_ERR_INVALID_ARG);
    CHECK(strstr(q.msg, "certificate") != NULL);
    if (!strstr(q.msg, "certificate")) fprintf(stderr, "server said: %s\n", q.msg);
    (void)crc; /* TLS 1.3: the client may finish before the server's verdict arrives */
    netio_close(fd);
    netio_close(q.fd);

    /* the client refuses a server whose certificate is from another CA */
    tls_ctx *evil_srv = ctx_for(g_evil, "s1", true);
    peer r = {.ctx = evil_srv, .fd = -1, .listen_fd = p.listen_fd};
    pthread_create(&th, NULL, server_main, &r);
    fd = -1;
    CHECK_EQ_INT(client_handshake(port, cli, &fd, id), KVS_ERR_INVALID_ARG);
    netio_close(fd);
    pthread_join(th, NULL);
    CHECK(r.rc != KVS_OK);
    netio_close(r.fd);

    /* a plaintext HELLO is no TLS ClientHello; a silent peer meets the deadline */
    peer t = {.ctx = srv_ctx, .fd = -1, .listen_fd = p.listen_fd};
    pthread_create(&th, NULL, server_main, &t);
    CHECK_EQ_INT(netio_connect("127.0.0.1", port, netio_deadline_ms(5000), &fd, msg, sizeof msg), KVS_OK);
    struct wire_hello hello = {.min_version = 1, .max_version = 1};
    uint8_t hb[64];
    size_t hl = 0;
    wire_encode_hello(&hello, hb, sizeof hb, &hl);
    CHECK_EQ_INT(netio_send_frame(fd, WIRE_OP_HELLO, 1, hb, hl, netio_deadline_ms(5000)), KVS_OK);
    pthread_join(th, NULL);
    CHECK_EQ_INT(t.rc, KVS_ERR_INVALID_ARG);
    netio_close(fd);
    netio_close(t.fd);
    peer u = {.ctx = srv_ctx, .fd = -1, .listen_fd = p.listen_fd};
    pthread_create(&th, NULL, server_main, &u);
    CHECK_EQ_INT(netio_connect("127.0.0.1", port, netio_deadline_ms(5000), &fd, msg, sizeof msg), KVS_OK);
    pthread_join(th, NULL); /* server_main gives the handshake 3 s */
    CHECK_EQ_INT(u.rc, KVS_ERR_TIMEOUT);
    netio_close(fd);
    netio_close(u.fd);

    close(p.listen_fd);
    tls_ctx_free(evil_srv);
    tls_ctx_free(evil);
    tls_ctx_free(cli);
    tls_ctx_free(srv_ctx);
}

/* ---- through the shard server ------------------------------------------------------- */

static void *serve_main(void *arg) {
    srv_run(arg);
    return NULL;
}

static srv *start_shard(const char *model, bool tls, pthread_t *th) {
    char cert[200], key[200], ca[200];
    paths(g_dir, "s1", cert, key, ca);
    srv_params p = srv_default_params();
    p.model_path = model;
    p.listen = "127.0.0.1:0";
    p.n_threads = 1;
    p.kv_budget_bytes = 8u << 20;
    p.hello_timeout_ms = 3000;
    if (tls) {
        p.tls_cert = cert;
        p.tls_key = key;
        p.tls_ca = ca;
    }
    srv *s = NULL;
    char msg[KVS_MSG_MAX] = "";
    if (srv_create(&p, &s, msg, sizeof msg)) {
        fprintf(stderr, "srv_create: %s\n", msg);
        return NULL;
    }
    pthread_create(th, NULL, serve_main, s);
    return s;
}

/* Logits of prompt then one decode step, through a route to port (TLS as client c1 when tls). */
static int route_logits(uint16_t port, bool tls, const int32_t *toks, uint32_t n, float *out, uint32_t *nv) {
    char spec[32], cert[200], key[200], ca[200], msg[KVS_MSG_MAX] = "";
    snprintf(spec, sizeof spec, "127.0.0.1:%u", (unsigned)port);
    paths(g_dir, "c1", cert, key, ca);
    route_params rp = route_default_params();
    rp.timeout_ms = 10000;
    if (tls) {
        rp.tls_cert = cert;
        rp.tls_key = key;
        rp.tls_ca = ca;
    }
    route *r = NULL;
    int rc = route_open(spec, NULL, &rp, &r, msg, sizeof msg);
    if (rc) {
        if (getenv("KVS_TEST_VERBOSE")) fprintf(stderr, "route_open: %s\n", msg);
        return rc;
    }
    route_info ri;
    route_get_info(r, &ri);
    *nv = ri.n_vocab;
    route_session *s = NULL;
    rc = route_session_open(r, &s, msg, sizeof msg);
    if (!rc) rc = route_forward(r, s, toks, n - 1, out, msg, sizeof msg);
    if (!rc) rc = route_forward(r, s, toks + n - 1, 1, out, msg, sizeof msg);
    route_release(r, s);
    route_close(r);
    return rc;
}

/* Raw client connection over TLS as identity name, HELLO done; -1 on failure. */
static int tls_client(uint16_t port, const char *name, tls_ctx **ctx) {
    *ctx = ctx_for(g_dir, name, false);
    int fd = -1;
    char id[TLS_ID_MAX], msg[KVS_MSG_MAX];
    if (!*ctx || client_handshake(port, *ctx, &fd, id)) return -1;
    struct wire_hello hello = {.min_version = 1, .max_version = 1};
    uint8_t hb[64];
    size_t hl = 0;
    wire_encode_hello(&hello, hb, sizeof hb, &hl);
    struct netio_buf b = {0};
    struct wire_header h;
    int rc = netio_send_frame(fd, WIRE_OP_HELLO, 1, hb, hl, netio_deadline_ms(5000));
    if (!rc) rc = netio_recv_frame(fd, &h, &b, netio_deadline_ms(10000), msg, sizeof msg);
    netio_buf_free(&b);
    if (rc || h.op != WIRE_OP_INFO) {
        netio_close(fd);
        return -1;
    }
    return fd;
}

static int fwd(int fd, const uint8_t sid[16], uint64_t epoch, uint32_t start, uint32_t n, const int32_t *toks,
               uint32_t *have) {
    int rc = send_forward_frame(fd, 3, sid, epoch, start, n, toks, WIRE_OUT_LOGITS_LAST);
    struct netio_buf b = {0};
    struct wire_header h;
    struct wire_forward_reply r;
    char msg[KVS_MSG_MAX];
    if (!rc) rc = netio_recv_frame(fd, &h, &b, netio_deadline_ms(10000), msg, sizeof msg);
    if (!rc) rc = h.op == WIRE_OP_FORWARD_REPLY ? wire_decode_forward_reply(b.data, b.len, &r, msg, sizeof msg) : KVS_ERR_PROTOCOL;
    if (!rc) {
        rc = r.st.status;
        if (have) *have = r.st.have;
    }
    netio_buf_free(&b);
    return rc;
}

static void test_server_over_tls(const char *model) {
    pthread_t t1, t2;
    srv *plain = start_shard(model, false, &t1), *sec = start_shard(model, true, &t2);
    CHECK(plain && sec);
    if (!plain || !sec) return;
    int32_t toks[6] = {1, 20, 40, 60, 80, 100};
    uint32_t nv = 0;
    float *a = malloc(4096 * sizeof(float)), *b = malloc(4096 * sizeof(float));
    CHECK_EQ_INT(route_logits(srv_port(plain), false, toks, 6, a, &nv), KVS_OK);
    CHECK_EQ_INT(route_logits(srv_port(sec), true, toks, 6, b, &nv), KVS_OK);
    CHECK(nv > 0 && nv <= 4096 && memcmp(a, b, nv * sizeof(float)) == 0);
    /* a plaintext client cannot use the TLS shard */
    CHECK(route_logits(srv_port(sec), false, toks, 6, b, &nv) != KVS_OK);

    /* the hijack sequence with two certificate identities */
    tls_ctx *ca_ = NULL, *cb_ = NULL;
    int va = tls_client(srv_port(sec), "c1", &ca_), vb = tls_client(srv_port(sec), "c2", &cb_);
    CHECK(va >= 0 && vb >= 0);
    uint8_t sid[16] = {0x42, 0x42, 7};
    uint32_t have = 99;
    CHECK_EQ_INT(fwd(va, sid, 1, 0, 4, toks, NULL), KVS_OK);
    CHECK_EQ_INT(fwd(vb, sid, 1, 4, 1, toks + 4, &have), KVS_ERR_CACHE_MISS); /* c2 sees nothing */
    CHECK_EQ_INT(have, 0);
    CHECK_EQ_INT(fwd(vb, sid, 5, 0, 1, toks, NULL), KVS_OK);  /* its own session; c1's keeps epoch 1 */
    CHECK_EQ_INT(fwd(va, sid, 1, 4, 1, toks + 4, NULL), KVS_OK);
    netio_close(va);
    netio_close(vb);
    tls_ctx_free(ca_);
    tls_ctx_free(cb_);
    free(a);
    free(b);
    srv_stop(plain);
    srv_stop(sec);
    pthread_join(t1, NULL);
    pthread_join(t2, NULL);
    srv_free(plain);
    srv_free(sec);
}

static void test_bad_files(void) {
    tls_params p = {.cert_file = "/nonexistent.pem", .key_file = "/nonexistent.key", .ca_file = "/nonexistent.ca"};
    tls_ctx *c = NULL;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(tls_ctx_create(&p, true, &c, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    CHECK(c == NULL && strstr(msg, "/nonexistent.pem") != NULL);
    /* a key that is not the certificate's */
    char cert[200], key[200], ca[200], key2[200];
    paths(g_dir, "s1", cert, key, ca);
    snprintf(key2, sizeof key2, "%s/c1.key", g_dir);
    p = (tls_params){.cert_file = cert, .key_file = key2, .ca_file = ca};
    CHECK_EQ_INT(tls_ctx_create(&p, true, &c, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    CHECK(strstr(msg, "c1.key") != NULL);
    const char *bad[] = {"ok", "no/slash"};
    CHECK_EQ_INT(tls_make_cluster(g_dir, bad, 2, 10, msg, sizeof msg), KVS_ERR_INVALID_ARG);
}

/* Writes a self-signed certificate whose subject CN is cn[0..n) as ASN.1 string type type
 * (MBSTRING_UTF8 or V_ASN1_BMPSTRING: raw big-endian UCS-2) to path; true on success. */
static bool write_cert_cn(const char *path, int type, const unsigned char *cn, int n) {
    EVP_PKEY *k = EVP_PKEY_Q_keygen(NULL, NULL, "EC", "P-256");
    X509 *x = X509_new();
    bool ok = k && x;
    X509_NAME *nm = ok ? X509_get_subject_name(x) : NULL;
    ok = ok && X509_set_version(x, 2) && ASN1_INTEGER_set(X509_get_serialNumber(x), 1) &&
         X509_gmtime_adj(X509_getm_notBefore(x), 0) && X509_gmtime_adj(X509_getm_notAfter(x), 3600) &&
         X509_NAME_add_entry_by_NID(nm, NID_commonName, type, cn, n, -1, 0) && X509_set_issuer_name(x, nm) &&
         X509_set_pubkey(x, k) && X509_sign(x, k, EVP_sha256()) > 0;
    FILE *f = ok ? fopen(path, "w") : NULL;
    ok = f && PEM_write_X509(f, x);
    if (f) fclose(f);
    X509_free(x);
    EVP_PKEY_free(k);
    return ok;
}

/* Issue 42 item 4: each pair of certificates the old mapping merged gets two identities, and
 * the plain names keep their readable form. */
static void test_identities_injective(void) {
    char long_a[65], long_b[65];
    memset(long_a, 'a', 64);
    long_a[64] = 0;
    memcpy(long_b, long_a, 65);
    long_b[63] = 'b';
    static const unsigned char bmp_bob[] = {0, 'b', 0, 'o', 0, 'b'}, bmp_eve[] = {0, 'e', 0, 'v', 0, 'e'};
    struct {
        int type;
        const unsigned char *cn;
        int n;
    } pairs[][2] = {
        {{MBSTRING_UTF8, (const unsigned char *)"alice bob", 9}, {MBSTRING_UTF8, (const unsigned char *)"alice_bob", 9}},
        {{MBSTRING_UTF8, (const unsigned char *)"alice/bob", 9}, {MBSTRING_UTF8, (const unsigned char *)"alice_bob", 9}},
        {{MBSTRING_UTF8, (const unsigned char *)long_a, 64}, {MBSTRING_UTF8, (const unsigned char *)long_b, 64}},
        {{MBSTRING_UTF8, (const unsigned char *)"caf\xc3\xa9", 5}, {MBSTRING_UTF8, (const unsigned char *)"caf__", 5}},
        {{V_ASN1_BMPSTRING, bmp_bob, 6}, {V_ASN1_BMPSTRING, bmp_eve, 6}},
    };
    char path[2][200], id[2][TLS_ID_MAX];
    for (size_t p = 0; p < sizeof pairs / sizeof pairs[0]; p++) {
        for (int i = 0; i < 2; i++) {
            snprintf(path[i], sizeof path[i], "%s/id%zu_%d.pem", g_dir, p, i);
            CHECK(write_cert_cn(path[i], pairs[p][i].type, pairs[p][i].cn, pairs[p][i].n));
            id[i][0] = 0;
            CHECK_EQ_INT(tls_cert_file_identity(path[i], id[i], sizeof id[i]), KVS_OK);
        }
        if (!strcmp(id[0], id[1])) fprintf(stderr, "pair %zu: both map to '%s'\n", p, id[0]);
        CHECK(strcmp(id[0], id[1]) != 0);
    }
    CHECK(write_cert_cn(path[0], V_ASN1_BMPSTRING, bmp_bob, 6));
    CHECK_EQ_INT(tls_cert_file_identity(path[0], id[0], sizeof id[0]), KVS_OK);
    if (strcmp(id[0], "cn:bob")) fprintf(stderr, "BMPString bob: got '%s', want 'cn:bob'\n", id[0]);
    CHECK(!strcmp(id[0], "cn:bob"));
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    snprintf(g_dir, sizeof g_dir, "/tmp/kvs-tls-XXXXXX");
    CHECK(mkdtemp(g_dir) != NULL);
    snprintf(g_evil, sizeof g_evil, "%s/evil", g_dir);
    CHECK_EQ_INT(mkdir(g_evil, 0700), 0);
    char msg[KVS_MSG_MAX] = "";
    const char *names[] = {"s1", "c1", "c2"};
    CHECK_EQ_INT(tls_make_cluster(g_dir, names, 3, 30, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(tls_make_cluster(g_evil, names, 2, 30, msg, sizeof msg), KVS_OK);
    struct stat st;
    char keyp[200];
    snprintf(keyp, sizeof keyp, "%s/ca.key", g_dir);
    CHECK(stat(keyp, &st) == 0 && (st.st_mode & 077) == 0);
    test_handshake_and_frames();
    test_bad_files();
    test_identities_injective();
    char model[200];
    snprintf(model, sizeof model, "%s/tiny.gguf", g_dir);
    mkmodel_params mp = mkmodel_default_params();
    mp.n_threads = 1;
    CHECK_EQ_INT(mkmodel_write(model, mp, msg, sizeof msg), KVS_OK);
    test_server_over_tls(model);
    char cmd[200];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    if (system(cmd) != 0) fprintf(stderr, "note: could not remove %s\n", g_dir);
    return test_finish("test_tls", 1, 0);
}
