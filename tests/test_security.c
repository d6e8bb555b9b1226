/*
 * Attacks on operator input and on the client: a FIFO given as a model must fail at once (not
 * hang), a KV budget above the machine's memory is refused, a hostile shard cannot make the
 * route client allocate without bound (VOCAB pages of huge tokens, oversized replies), and VOCAB
 * is answered only by the head shard. Every wait is bounded (alarm, deadlines); ports are picked
 * by the kernel.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "digest.h"
#include "gguf.h"
#include "mkmodel.h"
#include "netio.h"
#include "quant.h"
#include "route.h"
#include "server.h"
#include "test.h"
#include "util.h"
#include "wire.h"

/* ---- a model path that is a FIFO --------------------------------------------------- */

/* In a child with a 5 s alarm (a hang is a failure, not a stuck test): gguf_open and the digest
 * of a FIFO both fail with KVS_ERR_IO, naming the reason. */
static void test_fifo(const char *dir) {
    char fifo[300];
    snprintf(fifo, sizeof fifo, "%s/model.fifo", dir);
    CHECK_EQ_INT(mkfifo(fifo, 0600), 0);
    pid_t pid = fork();
    if (pid == 0) {
        alarm(5);
        gguf_ctx *g = NULL;
        char msg[KVS_MSG_MAX] = "";
        int rc = gguf_open(fifo, &g, msg, sizeof msg);
        if (rc != KVS_ERR_IO || g || !strstr(msg, "not a regular file")) _exit(3);
        uint8_t d[32];
        if (digest_file_sha256(fifo, d) != KVS_ERR_IO) _exit(4);
        _exit(0);
    }
    int st = 0;
    CHECK(waitpid(pid, &st, 0) == pid);
    CHECK(WIFEXITED(st)); /* killed by SIGALRM = it hung on the FIFO */
    if (WIFEXITED(st)) CHECK_EQ_INT(WEXITSTATUS(st), 0);
    unlink(fifo);
}

/* ---- --kv-budget beyond physical memory ---------------------------------------------- */

static void test_budget_refused(const char *model) {
    srv_params p = srv_default_params();
    p.model_path = model;
    p.listen = "127.0.0.1:0";
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    p.kv_budget_bytes = (uint64_t)pages * (uint64_t)page + (1ull << 30);
    srv *s = NULL;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(srv_create(&p, &s, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    CHECK(s == NULL);
    CHECK(strstr(msg, "physical memory") != NULL);
    p.kv_budget_bytes = UINT64_MAX; /* 99999999G and the like */
    CHECK_EQ_INT(srv_create(&p, &s, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    srv_free(s);
}

/* ---- a hostile shard ------------------------------------------------------------- */

enum hostile_mode { HOSTILE_HUGE_TOKENS, HOSTILE_BIG_INFO };

typedef struct {
    int listen_fd;
    enum hostile_mode mode;
    atomic_int pages_served;
} hostile;

static int send_info_frame_nv(int fd, uint64_t rid, uint32_t n_vocab);
static int send_info_frame(int fd, uint64_t rid) { return send_info_frame_nv(fd, rid, WIRE_MAX_VOCAB); }

static int send_info_frame_nv(int fd, uint64_t rid, uint32_t n_vocab) {
    struct wire_info in;
    memset(&in, 0, sizeof in);
    in.version = WIRE_VERSION;
    in.hidden_dtypes = WIRE_DTYPE_F32;
    in.n_layer = 1;
    in.first = 0;
    in.last = 1;
    in.n_embd = 8;
    in.n_vocab = n_vocab;
    in.kv_budget_bytes = 1 << 20;
    in.max_tokens = 8;
    in.max_ctx = 64;
    uint8_t buf[512];
    size_t len = 0;
    if (wire_encode_info(&in, buf, sizeof buf, &len) != KVS_OK) return KVS_ERR_INTERNAL;
    return netio_send_frame(fd, WIRE_OP_INFO, rid, buf, len, netio_deadline_ms(5000));
}

/* Serves one connection: INFO for any HELLO, then pages of 16 tokens of 65,535 bytes each. */
static void *hostile_main(void *arg) {
    hostile *h = arg;
    int fd = -1;
    char msg[KVS_MSG_MAX];
    if (netio_accept(h->listen_fd, netio_deadline_ms(10000), &fd, msg, sizeof msg) != KVS_OK) return NULL;
    struct netio_buf b = {0};
    struct wire_header hd;
    if (netio_recv_frame(fd, &hd, &b, netio_deadline_ms(10000), msg, sizeof msg) != KVS_OK) goto out;
    if (h->mode == HOSTILE_BIG_INFO) {
        /* an "INFO" of 8 MiB: the client must refuse it from the header alone */
        uint8_t *big = calloc(1, 8u << 20);
        if (big) (void)netio_send_frame(fd, WIRE_OP_INFO, hd.request_id, big, 8u << 20, netio_deadline_ms(2000));
        free(big);
        goto out;
    }
    if (send_info_frame(fd, hd.request_id) != KVS_OK) goto out;
    enum { PAGE = 16, TEXT = 65535 };
    char *text = malloc(TEXT);
    struct wire_vocab_token toks[PAGE];
    if (!text) goto out;
    memset(text, 'a', TEXT);
    for (;;) {
        if (netio_recv_frame(fd, &hd, &b, netio_deadline_ms(10000), msg, sizeof msg) != KVS_OK) break;
        struct wire_vocab q;
        if (hd.op != WIRE_OP_VOCAB || wire_decode_vocab(b.data, b.len, &q, msg, sizeof msg) != KVS_OK) break;
        for (int i = 0; i < PAGE; i++) toks[i] = (struct wire_vocab_token){.text = text, .text_len = TEXT};
        struct wire_vocab_reply r;
        memset(&r, 0, sizeof r);
        r.n_vocab = WIRE_MAX_VOCAB;
        r.first = q.first;
        r.count = PAGE;
        r.bos = r.eos = -1;
        memcpy(r.tok_model, "llama", 5);
        r.tok_model_len = 5;
        r.tokens = toks;
        size_t len = 0;
        if (wire_encode_vocab_reply(&r, NULL, 0, &len) != KVS_OK) break;
        uint8_t *out = malloc(len);
        atomic_fetch_add(&h->pages_served, 1); /* before the send: the client may be done right after */
        if (!out || wire_encode_vocab_reply(&r, out, len, &len) != KVS_OK ||
            netio_send_frame(fd, WIRE_OP_VOCAB_REPLY, hd.request_id, out, len, netio_deadline_ms(5000)) != KVS_OK) {
            free(out);
            break;
        }
        free(out);
    }
    free(text);
out:
    netio_buf_free(&b);
    netio_close(fd);
    return NULL;
}

static void test_hostile_shard(enum hostile_mode mode) {
    hostile h = {.listen_fd = -1, .mode = mode};
    atomic_init(&h.pages_served, 0);
    uint16_t port = 0;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(netio_listen("127.0.0.1", 0, 4, &h.listen_fd, &port, msg, sizeof msg), KVS_OK);
    pthread_t th;
    pthread_create(&th, NULL, hostile_main, &h);
    char spec[64];
    snprintf(spec, sizeof spec, "127.0.0.1:%u", (unsigned)port);
    route_params rp = route_default_params();
    rp.timeout_ms = 10000;
    route *r = NULL;
    int rc = route_open(spec, NULL, &rp, &r, msg, sizeof msg);
    if (mode == HOSTILE_BIG_INFO) {
        CHECK_EQ_INT(rc, KVS_ERR_TOO_LARGE);
        CHECK(strstr(msg, spec) != NULL); /* the error names the peer */
    } else {
        CHECK_EQ_INT(rc, KVS_OK);
        if (rc == KVS_OK) {
            tok_vocab *v = NULL;
            rc = route_fetch_vocab(r, &v, msg, sizeof msg);
            CHECK_EQ_INT(rc, KVS_ERR_PROTOCOL);
            CHECK(v == NULL);
            CHECK(strstr(msg, spec) != NULL);
            CHECK(strstr(msg, "65535 bytes") != NULL);
            /* refused at the first page: nothing was piled up page after page */
            CHECK_EQ_INT(atomic_load(&h.pages_served), 1);
            tok_free(v);
        }
    }
    route_close(r); /* the hostile thread sees EOF and ends */
    pthread_join(th, NULL);
    close(h.listen_fd);
}

/* ---- VOCAB_META merges: a small page announcing gigabytes of merge texts ---------------- */

enum { MERGE_NV = 4, MERGE_PAGE = 100000 };

/* Serves one connection: INFO (4 tokens), a gpt2 VOCAB page of 4 tokens of 4,096 bytes, then
 * VOCAB_META pages of 100,000 merges "token0 token1" (8 bytes each on the wire, 8,193 bytes
 * each as text) of a 2^20-merge table. */
static void *merges_main(void *arg) {
    int lfd = *(int *)arg, fd = -1;
    char msg[KVS_MSG_MAX];
    if (netio_accept(lfd, netio_deadline_ms(10000), &fd, msg, sizeof msg) != KVS_OK) return NULL;
    struct netio_buf b = {0};
    struct wire_header hd;
    char *text = malloc(4096);
    int32_t *ids = malloc(2 * sizeof(int32_t) * MERGE_PAGE);
    uint8_t *out = malloc(16u << 20);
    if (!text || !ids || !out) goto out;
    memset(text, 'a', 4096);
    for (int i = 0; i < 2 * MERGE_PAGE; i++) ids[i] = i & 1;
    if (netio_recv_frame(fd, &hd, &b, netio_deadline_ms(10000), msg, sizeof msg) != KVS_OK ||
        send_info_frame_nv(fd, hd.request_id, MERGE_NV) != KVS_OK)
        goto out;
    while (netio_recv_frame(fd, &hd, &b, netio_deadline_ms(10000), msg, sizeof msg) == KVS_OK) {
        size_t len = 0;
        int rc = KVS_ERR_PROTOCOL;
        if (hd.op == WIRE_OP_VOCAB) {
            struct wire_vocab_token toks[MERGE_NV];
            for (int i = 0; i < MERGE_NV; i++) toks[i] = (struct wire_vocab_token){.text = text, .text_len = 4096};
            struct wire_vocab_reply r = {.n_vocab = MERGE_NV, .count = MERGE_NV, .bos = -1, .eos = -1,
                                         .tok_model_len = 4, .tokens = toks};
            memcpy(r.tok_model, "gpt2", 4);
            rc = wire_encode_vocab_reply(&r, out, 16u << 20, &len);
        } else if (hd.op == WIRE_OP_VOCAB_META) {
            struct wire_vocab_meta q;
            if (wire_decode_vocab_meta(b.data, b.len, &q, msg, sizeof msg) != KVS_OK) break;
            struct wire_vocab_meta_reply r = {.n_vocab = MERGE_NV, .n_merges = 1u << 20, .first = q.first,
                                              .count = MERGE_PAGE, .merge_ids = ids};
            rc = wire_encode_vocab_meta_reply(&r, out, 16u << 20, &len);
        }
        uint16_t op = hd.op == WIRE_OP_VOCAB ? WIRE_OP_VOCAB_REPLY : WIRE_OP_VOCAB_META_REPLY;
        if (rc != KVS_OK || netio_send_frame(fd, op, hd.request_id, out, len, netio_deadline_ms(5000)) != KVS_OK) break;
    }
out:
    free(text);
    free(ids);
    free(out);
    netio_buf_free(&b);
    netio_close(fd);
    return NULL;
}

/* Issue 42 item 6: the merges are counted in the client's 32 MiB vocab text cap before they
 * are allocated, so the first page is refused (PROTOCOL). In a child with 1 GiB of address
 * space and a 20 s alarm: without the bound the client would allocate ~8.6 GB (NOMEM here). */
static void test_hostile_merges(void) {
    pid_t pid = fork();
    if (pid == 0) {
        alarm(20);
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
        /* (The sanitizers' shadow memory needs more address space than any such limit.) */
        struct rlimit lim = {.rlim_cur = 1ull << 30, .rlim_max = 1ull << 30};
        setrlimit(RLIMIT_AS, &lim);
#endif
        int lfd = -1;
        uint16_t port = 0;
        char msg[KVS_MSG_MAX] = "";
        if (netio_listen("127.0.0.1", 0, 4, &lfd, &port, msg, sizeof msg) != KVS_OK) _exit(2);
        pthread_t th;
        if (pthread_create(&th, NULL, merges_main, &lfd) != 0) _exit(2);
        char spec[64];
        snprintf(spec, sizeof spec, "127.0.0.1:%u", (unsigned)port);
        route_params rp = route_default_params();
        rp.timeout_ms = 10000;
        route *r = NULL;
        if (route_open(spec, NULL, &rp, &r, msg, sizeof msg) != KVS_OK) _exit(3);
        tok_vocab *v = NULL;
        int rc = route_fetch_vocab(r, &v, msg, sizeof msg);
        fprintf(stderr, "  hostile merges: %s (%s)\n", kvs_strerror(rc), msg);
        route_close(r);
        pthread_join(th, NULL);
        _exit(rc == KVS_ERR_PROTOCOL && strstr(msg, "vocab cap") && !v ? 0 : 4);
    }
    int st = 0;
    CHECK(waitpid(pid, &st, 0) == pid);
    CHECK(WIFEXITED(st));
    if (WIFEXITED(st)) CHECK_EQ_INT(WEXITSTATUS(st), 0);
}

/* ---- VOCAB only from the head shard ------------------------------------------------- */

static void *serve_thread(void *arg) {
    srv_run(arg);
    return NULL;
}

static void test_vocab_head_only(const char *model) {
    srv_params p = srv_default_params();
    p.model_path = model;
    p.first = 1;
    p.last = 0;
    p.listen = "127.0.0.1:0";
    p.n_threads = 1;
    p.kv_budget_bytes = 4u << 20;
    srv *s = NULL;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(srv_create(&p, &s, msg, sizeof msg), KVS_OK);
    if (!s) return;
    pthread_t th;
    pthread_create(&th, NULL, serve_thread, s);
    int fd = -1;
    CHECK_EQ_INT(netio_connect("127.0.0.1", srv_port(s), netio_deadline_ms(5000), &fd, msg, sizeof msg), KVS_OK);
    struct wire_hello hello = {.min_version = 1, .max_version = 1};
    uint8_t buf[512];
    size_t len = 0;
    wire_encode_hello(&hello, buf, sizeof buf, &len);
    CHECK_EQ_INT(netio_send_frame(fd, WIRE_OP_HELLO, 1, buf, len, netio_deadline_ms(5000)), KVS_OK);
    struct netio_buf b = {0};
    struct wire_header hd;
    CHECK_EQ_INT(netio_recv_frame(fd, &hd, &b, netio_deadline_ms(10000), msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(hd.op, WIRE_OP_INFO);
    struct wire_vocab q = {.first = 0, .max_count = 16};
    wire_encode_vocab(&q, buf, sizeof buf, &len);
    CHECK_EQ_INT(netio_send_frame(fd, WIRE_OP_VOCAB, 2, buf, len, netio_deadline_ms(5000)), KVS_OK);
    CHECK_EQ_INT(netio_recv_frame(fd, &hd, &b, netio_deadline_ms(10000), msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(hd.op, WIRE_OP_VOCAB_REPLY);
    struct wire_vocab_reply v;
    CHECK_EQ_INT(wire_decode_vocab_reply(b.data, b.len, &v, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(v.st.status, KVS_ERR_UNSUPPORTED);
    netio_buf_free(&b);
    netio_close(fd);
    srv_stop(s);
    pthread_join(th, NULL);
    srv_free(s);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    char dir[] = "/tmp/kvs-security-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    test_fifo(dir); /* first: fork while single-threaded */
    char model[300];
    snprintf(model, sizeof model, "%s/tiny.gguf", dir);
    mkmodel_params mp = mkmodel_default_params();
    mp.n_threads = 1;
    char msg[KVS_MSG_MAX];
    CHECK_EQ_INT(mkmodel_write(model, mp, msg, sizeof msg), KVS_OK);
    test_budget_refused(model);
    test_hostile_shard(HOSTILE_HUGE_TOKENS);
    test_hostile_shard(HOSTILE_BIG_INFO);
    test_hostile_merges();
    test_vocab_head_only(model);
    unlink(model);
    rmdir(dir);
    return test_finish("test_security", 1, 0);
}
