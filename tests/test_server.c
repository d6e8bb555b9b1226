/*
 * The shard server in-process on a free loopback port, driven by a raw wire
 * client: results equal the local engine bit for bit, recovery fields,
 * rejected input (bad frames, wrong shard, sizes) never affects the server or
 * other connections, cancel and disconnect roll the session back (ordered by
 * a scheduler hook, not by sleeps), and concurrent clients get their solo
 * results while their decode steps are batched.
 */
#include <pthread.h>
#include <errno.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/socket.h>

#include "engine.h"
#include "mkmodel.h"
#include "netio.h"
#include "f16.h"
#include "quant.h"
#include "sampler.h"
#include "server.h"
#include "shard_harness.h"
#include "test.h"
#include "util.h"
#include "wire.h"

static atomic_int g_disconnect_cancels;
static atomic_int g_slow_closed;

/* A second gate, after a step's forward pass and before its results are committed (the
 * batch_done hook): the window in which a CANCEL can race a finishing FORWARD. */
static sem_t g_after_gate;
static atomic_int g_max_items; /* the most requests one step has held (after_batch_hook) */
static atomic_bool g_after_gated;
static atomic_int g_after_held;

static void after_batch_hook(void *ctx, int n_items, uint32_t n_rows, uint64_t ns) {
    (void)ctx, (void)n_rows, (void)ns;
    int seen = atomic_load(&g_max_items);
    while (n_items > seen && !atomic_compare_exchange_weak(&g_max_items, &seen, n_items)) {
    }
    if (!atomic_load(&g_after_gated)) return;
    atomic_fetch_add(&g_after_held, 1);
    while (sem_wait(&g_after_gate) != 0 && errno == EINTR) {
    }
}

/* The value of counter `name` of the in-process server (0 when absent). */
static uint64_t srv_stat(test_shard *sc, const char *name) {
    struct wire_stats_reply *m = calloc(1, sizeof(*m));
    srv_stats(sc->s, m);
    uint64_t v = 0;
    for (uint32_t i = 0; i < m->n_stats; i++)
        if (strcmp(m->stats[i].name, name) == 0) v = m->stats[i].value;
    free(m);
    return v;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void test_log(void *ctx, const char *line) {
    (void)ctx;
    if (strstr(line, "cancelled its work in flight")) atomic_fetch_add(&g_disconnect_cancels, 1);
    if (strstr(line, "not reading its replies")) atomic_fetch_add(&g_slow_closed, 1);
    if (getenv("KVS_TEST_VERBOSE")) fprintf(stderr, "serve: %s\n", line);
}

/* hello_ms: the HELLO deadline; only the server of the silent-client check uses a short one, so
 * no other check depends on how fast a loaded machine gets a HELLO out. */
static int start_server_hello(test_shard *sc, const char *model_path, uint32_t first, uint32_t last, uint32_t chunk,
                              int hello_ms) {
    srv_params p = srv_default_params();
    p.model_path = model_path;
    p.first = first;
    p.last = last;
    p.listen = "127.0.0.1:0";
    p.n_threads = 2;
    p.kv_budget_bytes = 16u << 20;
    p.hello_timeout_ms = hello_ms;
    p.prefill_chunk = chunk;
    p.log = test_log;
    p.max_queued_bytes = 1u << 20;
    p.max_inflight = 4096; /* test_slow_reader pipelines 2000 requests (the cap: test_security_net) */
    p.batch_done = after_batch_hook;
    return test_shard_start(sc, p);
}

static int start_server(test_shard *sc, const char *model_path, uint32_t first, uint32_t last, uint32_t chunk) {
    return start_server_hello(sc, model_path, first, last, chunk, 60000);
}

static int connect_to(test_shard *sc) {
    int fd = -1;
    char msg[KVS_MSG_MAX];
    if (netio_connect("127.0.0.1", srv_port(sc->s), netio_deadline_ms(5000), &fd, msg, sizeof(msg))) return -1;
    return fd;
}

static int hello_v(int fd, uint16_t max_version, struct wire_info *info) {
    struct wire_hello h = {.min_version = 1, .max_version = max_version};
    uint8_t buf[512];
    size_t len;
    wire_encode_hello(&h, buf, sizeof(buf), &len);
    if (netio_send_frame(fd, WIRE_OP_HELLO, 1, buf, len, netio_deadline_ms(5000))) return KVS_ERR_IO;
    struct netio_buf b = {0};
    struct wire_header hd;
    char msg[KVS_MSG_MAX];
    int err = netio_recv_frame(fd, &hd, &b, netio_deadline_ms(10000), msg, sizeof(msg));
    if (!err) err = hd.op == WIRE_OP_INFO ? wire_decode_info(b.data, b.len, info, msg, sizeof(msg)) : KVS_ERR_PROTOCOL;
    netio_buf_free(&b);
    return err ? err : info->st.status;
}

static int hello(int fd, struct wire_info *info) { return hello_v(fd, 1, info); }

static kv_sid sid_of(int k) {
    kv_sid s;
    memset(&s, 0, sizeof(s));
    memcpy(s.bytes, &k, sizeof(k));
    s.bytes[12] = 0x77;
    return s;
}

/* Sends FORWARD (tokens) on session sid. */
static int send_forward(int fd, uint64_t rid, kv_sid sid, uint64_t epoch, uint32_t start, uint32_t n,
                        const int32_t *toks, uint32_t out_mode) {
    return send_forward_frame(fd, rid, sid.bytes, epoch, start, n, toks, out_mode);
}

/* Receives one frame; returns its op (or a negative error). */
static int recv_any(int fd, struct netio_buf *b, struct wire_header *hd) {
    char msg[KVS_MSG_MAX];
    int err = netio_recv_frame(fd, hd, b, netio_deadline_ms(60000), msg, sizeof(msg));
    return err ? err : hd->op;
}

static int recv_forward(int fd, struct netio_buf *b, struct wire_forward_reply *r, uint64_t *rid) {
    struct wire_header hd;
    int op = recv_any(fd, b, &hd);
    if (op < 0) return op;
    if (rid) *rid = hd.request_id;
    if (op != WIRE_OP_FORWARD_REPLY) return KVS_ERR_PROTOCOL;
    char msg[KVS_MSG_MAX];
    return wire_decode_forward_reply(b->data, b->len, r, msg, sizeof(msg));
}

static engine *local_engine(const char *path) {
    engine_params ep = engine_default_params();
    ep.model_path = path;
    ep.n_threads = 2;
    ep.kv.budget_bytes = 16u << 20;
    engine *e = NULL;
    char msg[KVS_MSG_MAX];
    CHECK_EQ_INT(engine_open(&ep, &e, msg, sizeof(msg)), KVS_OK);
    return e;
}

/* ---- checks ---- */

static void test_basic(test_shard *sc, const char *model_path) {
    int fd = connect_to(sc);
    CHECK(fd >= 0);
    struct wire_info info;
    CHECK_EQ_INT(hello(fd, &info), KVS_OK);
    CHECK_EQ_INT(info.first, 0);
    CHECK_EQ_INT(info.last, info.n_layer);
    uint8_t zero[32] = {0};
    CHECK(memcmp(info.model_digest, zero, 32) != 0);
    engine *e = local_engine(model_path);
    int nv = (int)info.n_vocab;
    float *local = malloc((size_t)nv * sizeof(float));
    int32_t toks[40];
    for (int i = 0; i < 40; i++) toks[i] = (i * 7 + 1) % nv;
    kv_sid sid = sid_of(1);
    engine_req lr = {.sid = sid, .epoch = 1, .n = 20, .tokens = toks, .out_mode = FWD_OUT_LOGITS_LAST, .out = local};
    engine_step(e, &lr, 1);
    struct netio_buf b = {0};
    struct wire_forward_reply r;
    CHECK_EQ_INT(send_forward(fd, 10, sid, 1, 0, 20, toks, WIRE_OUT_LOGITS_LAST), KVS_OK);
    CHECK_EQ_INT(recv_forward(fd, &b, &r, NULL), KVS_OK);
    CHECK_EQ_INT(r.st.status, KVS_OK);
    CHECK_EQ_INT(r.st.n_past, 20);
    float *remote = malloc((size_t)nv * sizeof(float));
    CHECK_EQ_INT(wire_forward_reply_to_f32(&r, remote), KVS_OK);
    CHECK(memcmp(remote, local, (size_t)nv * sizeof(float)) == 0);
    /* Decode steps. */
    for (uint32_t p = 20; p < 24; p++) {
        engine_req d = {.sid = sid, .epoch = 1, .start_pos = p, .n = 1, .tokens = &toks[p], .out_mode = FWD_OUT_LOGITS_LAST, .out = local};
        engine_step(e, &d, 1);
        CHECK_EQ_INT(send_forward(fd, 11 + p, sid, 1, p, 1, &toks[p], WIRE_OUT_LOGITS_LAST), KVS_OK);
        CHECK_EQ_INT(recv_forward(fd, &b, &r, NULL), KVS_OK);
        CHECK_EQ_INT(r.st.status, KVS_OK);
        wire_forward_reply_to_f32(&r, remote);
        CHECK(memcmp(remote, local, (size_t)nv * sizeof(float)) == 0);
    }
    /* Recovery fields: gap -> CACHE_MISS(have); older epoch -> STALE_EPOCH(live); unknown sid -> have 0. */
    CHECK_EQ_INT(send_forward(fd, 30, sid, 1, 30, 1, toks, WIRE_OUT_LOGITS_LAST), KVS_OK);
    CHECK_EQ_INT(recv_forward(fd, &b, &r, NULL), KVS_OK);
    CHECK_EQ_INT(r.st.status, KVS_ERR_CACHE_MISS);
    CHECK_EQ_INT(r.st.have, 24);
    CHECK_EQ_INT(send_forward(fd, 31, sid, 0, 24, 1, toks, WIRE_OUT_LOGITS_LAST), KVS_OK);
    CHECK_EQ_INT(recv_forward(fd, &b, &r, NULL), KVS_OK);
    CHECK_EQ_INT(r.st.status, KVS_ERR_STALE_EPOCH);
    CHECK_EQ_INT(r.st.live_epoch, 1);
    CHECK_EQ_INT(send_forward(fd, 32, sid_of(99), 1, 5, 1, toks, WIRE_OUT_LOGITS_LAST), KVS_OK);
    CHECK_EQ_INT(recv_forward(fd, &b, &r, NULL), KVS_OK);
    CHECK_EQ_INT(r.st.status, KVS_ERR_CACHE_MISS);
    CHECK_EQ_INT(r.st.have, 0);
    /* Token id outside the vocab, position past the context, too many rows. */
    int32_t bad_tok = nv + 5;
    CHECK_EQ_INT(send_forward(fd, 33, sid_of(2), 1, 0, 1, &bad_tok, WIRE_OUT_LOGITS_LAST), KVS_OK);
    CHECK_EQ_INT(recv_forward(fd, &b, &r, NULL), KVS_OK);
    CHECK_EQ_INT(r.st.status, KVS_ERR_INVALID_ARG);
    CHECK_EQ_INT(send_forward(fd, 34, sid_of(2), 1, info.max_ctx, 1, toks, WIRE_OUT_LOGITS_LAST), KVS_OK);
    CHECK_EQ_INT(recv_forward(fd, &b, &r, NULL), KVS_OK);
    CHECK_EQ_INT(r.st.status, KVS_ERR_CONTEXT_FULL);
    /* Release, then CACHE_MISS(0). */
    struct wire_release rel = {.epoch = 1};
    memcpy(rel.session_id, sid.bytes, 16);
    uint8_t rb[64];
    size_t rl;
    wire_encode_release(&rel, rb, sizeof(rb), &rl);
    netio_send_frame(fd, WIRE_OP_RELEASE, 40, rb, rl, netio_deadline_ms(5000));
    struct wire_header hd;
    CHECK_EQ_INT(recv_any(fd, &b, &hd), WIRE_OP_STATUS);
    struct wire_status_reply sr;
    char msg[KVS_MSG_MAX];
    CHECK_EQ_INT(wire_decode_status_reply(b.data, b.len, &sr, msg, sizeof(msg)), KVS_OK);
    CHECK_EQ_INT(sr.st.status, KVS_OK);
    CHECK_EQ_INT(send_forward(fd, 41, sid, 1, 24, 1, toks, WIRE_OUT_LOGITS_LAST), KVS_OK);
    CHECK_EQ_INT(recv_forward(fd, &b, &r, NULL), KVS_OK);
    CHECK_EQ_INT(r.st.status, KVS_ERR_CACHE_MISS);
    CHECK_EQ_INT(r.st.have, 0);
    /* STATS. */
    netio_send_frame(fd, WIRE_OP_STATS, 50, NULL, 0, netio_deadline_ms(5000));
    CHECK_EQ_INT(recv_any(fd, &b, &hd), WIRE_OP_STATS_REPLY);
    struct wire_stats_reply *st = calloc(1, sizeof(*st));
    CHECK_EQ_INT(wire_decode_stats_reply(b.data, b.len, st, msg, sizeof(msg)), KVS_OK);
    CHECK(st->n_stats > 10);
    free(st);
    netio_buf_free(&b);
    close(fd);
    free(local);
    free(remote);
    engine_close(e);
}

/* A client that connects and never sends is closed after the HELLO timeout (a server of its
 * own with a 100 ms deadline; the wait for the close is bounded by recv_any's 20 s). */
static void test_hello_timeout(const char *model_path) {
    test_shard sc;
    CHECK_EQ_INT(start_server_hello(&sc, model_path, 0, 0, 16, 100), KVS_OK);
    int fd = connect_to(&sc);
    CHECK(fd >= 0);
    struct netio_buf b = {0};
    struct wire_header hd;
    CHECK(recv_any(fd, &b, &hd) < 0);
    netio_buf_free(&b);
    close(fd);
    test_shard_stop(&sc);
}

/* Bad input: the server answers or closes, stays up, and other connections go on. */
static void test_bad_input(test_shard *sc) {
    int keep = connect_to(sc);
    struct wire_info info;
    CHECK_EQ_INT(hello(keep, &info), KVS_OK);
    struct netio_buf b = {0};
    struct wire_header hd;
    uint8_t junk[256];
    uint64_t rng = 12345;
    /* 1. Random bytes instead of HELLO: closed. */
    for (int round = 0; round < 20; round++) {
        int fd = connect_to(sc);
        for (size_t i = 0; i < sizeof(junk); i++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            junk[i] = (uint8_t)(rng >> 56);
        }
        netio_write_full(fd, junk, (size_t)(1 + round * 12), netio_deadline_ms(1000));
        shutdown(fd, SHUT_WR); /* a short header is complete at EOF: no wait for the HELLO deadline */
        int op;
        while ((op = recv_any(fd, &b, &hd)) > 0) {}
        CHECK(op < 0);
        close(fd);
    }
    /* 2. Wrong magic / version / unknown op / oversized length after HELLO: STATUS then close. */
    struct { uint32_t magic; uint16_t version, op; uint32_t len; int want; } cases[] = {
        {0x12345678u, 1, WIRE_OP_STATS, 0, KVS_ERR_PROTOCOL},
        {WIRE_MAGIC, 9, WIRE_OP_STATS, 0, KVS_ERR_UNSUPPORTED},
        {WIRE_MAGIC, 1, 200, 0, KVS_ERR_PROTOCOL},
        {WIRE_MAGIC, 1, WIRE_OP_FORWARD, WIRE_MAX_PAYLOAD + 1u, KVS_ERR_TOO_LARGE},
    };
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        int fd = connect_to(sc);
        CHECK_EQ_INT(hello(fd, &info), KVS_OK);
        uint8_t h[WIRE_HEADER_SIZE];
        kvs_wr_u32(h, cases[k].magic);
        kvs_wr_u16(h + 4, cases[k].version);
        kvs_wr_u16(h + 6, cases[k].op);
        kvs_wr_u32(h + 8, 0);
        kvs_wr_u64(h + 12, 77);
        kvs_wr_u32(h + 20, cases[k].len);
        netio_write_full(fd, h, sizeof(h), netio_deadline_ms(1000));
        CHECK_EQ_INT(recv_any(fd, &b, &hd), WIRE_OP_STATUS);
        struct wire_status_reply sr;
        char msg[KVS_MSG_MAX];
        CHECK_EQ_INT(wire_decode_status_reply(b.data, b.len, &sr, msg, sizeof(msg)), KVS_OK);
        CHECK_EQ_INT(sr.st.status, cases[k].want);
        CHECK(recv_any(fd, &b, &hd) < 0); /* then closed */
        close(fd);
    }
    /* 3. A payload that does not decode (truncated FORWARD): STATUS PROTOCOL, connection stays. */
    {
        int fd = connect_to(sc);
        CHECK_EQ_INT(hello(fd, &info), KVS_OK);
        uint8_t half[20] = {0};
        netio_send_frame(fd, WIRE_OP_FORWARD, 5, half, sizeof(half), netio_deadline_ms(1000));
        CHECK_EQ_INT(recv_any(fd, &b, &hd), WIRE_OP_STATUS);
        CHECK_EQ_INT(hd.request_id, 5);
        netio_send_frame(fd, WIRE_OP_STATS, 6, NULL, 0, netio_deadline_ms(1000));
        CHECK_EQ_INT(recv_any(fd, &b, &hd), WIRE_OP_STATS_REPLY);
        /* 4. Header promising more payload than sent, then hang up: the server just closes. */
        uint8_t h[WIRE_HEADER_SIZE];
        struct wire_header wh = {.magic = WIRE_MAGIC, .version = 1, .op = WIRE_OP_FORWARD, .request_id = 8, .payload_len = 1000};
        wire_encode_header(&wh, h);
        netio_write_full(fd, h, sizeof(h), netio_deadline_ms(1000));
        netio_write_full(fd, half, 10, netio_deadline_ms(1000));
        close(fd);
    }
    /* 5. A client that connects and never sends: test_hello_timeout. */
    /* 6. Hidden states sent to the head shard: INVALID_ARG. */
    {
        float hid[64] = {0};
        struct wire_forward f = {.epoch = 1, .n_tokens = 1, .in_kind = WIRE_IN_HIDDEN_F32, .n_embd = 64, .data = hid};
        uint8_t buf[512];
        size_t len;
        CHECK_EQ_INT(wire_encode_forward(&f, buf, sizeof(buf), &len), KVS_OK);
        netio_send_frame(keep, WIRE_OP_FORWARD, 9, buf, len, netio_deadline_ms(1000));
        struct wire_forward_reply r;
        CHECK_EQ_INT(recv_forward(keep, &b, &r, NULL), KVS_OK);
        CHECK_EQ_INT(r.st.status, KVS_ERR_INVALID_ARG);
    }
    /* The long-lived connection still works. */
    netio_send_frame(keep, WIRE_OP_STATS, 7, NULL, 0, netio_deadline_ms(1000));
    CHECK_EQ_INT(recv_any(keep, &b, &hd), WIRE_OP_STATS_REPLY);
    close(keep);
    netio_buf_free(&b);
}

/* CANCEL and disconnect roll the session back; ordered with the scheduler gate. */
static void test_cancel(test_shard *sc) {
    int fd = connect_to(sc);
    struct wire_info info;
    CHECK_EQ_INT(hello(fd, &info), KVS_OK);
    int32_t toks[100];
    for (int i = 0; i < 100; i++) toks[i] = (i * 5 + 2) % (int)info.n_vocab;
    struct netio_buf b = {0};
    struct wire_header hd;
    struct wire_forward_reply r;
    kv_sid sid = sid_of(7);
    /* A committed prefix of 10, then a 90-row prefill (chunked) cancelled mid-way. */
    send_forward(fd, 1, sid, 1, 0, 10, toks, WIRE_OUT_LOGITS_LAST);
    CHECK_EQ_INT(recv_forward(fd, &b, &r, NULL), KVS_OK);
    CHECK_EQ_INT(r.st.status, KVS_OK);
    const int held0 = atomic_load(&sc->held);
    atomic_store(&sc->gated, true);
    send_forward(fd, 2, sid, 1, 10, 90, toks + 10, WIRE_OUT_LOGITS_LAST);
    CHECK(test_shard_wait_held(sc, held0 + 1)); /* the first chunk's step holds it */
    sem_post(&sc->gate);                        /* let that chunk through */
    /* Cancel only once the next chunk's step holds the request: a CANCEL that arrived between
     * two steps would find it queued and answer its FORWARD first. */
    CHECK(test_shard_wait_held(sc, held0 + 2));
    struct wire_cancel c = {.target_request_id = 2};
    uint8_t cb[16];
    size_t cl;
    wire_encode_cancel(&c, cb, sizeof(cb), &cl);
    netio_send_frame(fd, WIRE_OP_CANCEL, 3, cb, cl, netio_deadline_ms(1000));
    /* The CANCEL's STATUS comes first: the request is still gated. */
    CHECK_EQ_INT(recv_any(fd, &b, &hd), WIRE_OP_STATUS);
    CHECK_EQ_INT(hd.request_id, 3);
    atomic_store(&sc->gated, false);
    sem_post(&sc->gate);
    sem_post(&sc->gate);
    uint64_t rid = 0;
    CHECK_EQ_INT(recv_forward(fd, &b, &r, &rid), KVS_OK);
    CHECK_EQ_INT(rid, 2);
    CHECK_EQ_INT(r.st.status, KVS_ERR_CANCELLED);
    CHECK_EQ_INT(r.st.n_past, 10);
    /* The session is exactly as before: position 10 continues. */
    send_forward(fd, 4, sid, 1, 11, 1, toks, WIRE_OUT_LOGITS_LAST);
    CHECK_EQ_INT(recv_forward(fd, &b, &r, NULL), KVS_OK);
    CHECK_EQ_INT(r.st.status, KVS_ERR_CACHE_MISS);
    CHECK_EQ_INT(r.st.have, 10);
    /* Disconnect with a request in flight: cancelled, session rolled back. */
    int fd2 = connect_to(sc);
    CHECK_EQ_INT(hello(fd2, &info), KVS_OK);
    kv_sid sid2 = sid_of(8);
    atomic_store(&sc->gated, true);
    send_forward(fd2, 1, sid2, 1, 0, 90, toks, WIRE_OUT_LOGITS_LAST);
    /* Hang up while it is held at the gate; release the gate only once the server has
     * noticed the disconnect and flagged the request (its log line says so). */
    int before = atomic_load(&g_disconnect_cancels);
    shutdown(fd2, SHUT_RDWR);
    close(fd2);
    for (int i = 0; i < 60000 && atomic_load(&g_disconnect_cancels) == before; i++) {
        struct timespec ts = {0, 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    CHECK(atomic_load(&g_disconnect_cancels) > before);
    atomic_store(&sc->gated, false);
    sem_post(&sc->gate);
    /* The session was never committed: position 1 is a CACHE_MISS(0). BUSY only while the
     * scheduler is still rolling the cancelled request back. */
    int got = KVS_OK;
    for (int tries = 0; tries < 12000; tries++) {
        send_forward(fd, 5, sid2, 1, 1, 1, toks, WIRE_OUT_LOGITS_LAST);
        CHECK_EQ_INT(recv_forward(fd, &b, &r, NULL), KVS_OK);
        got = r.st.status;
        if (got != KVS_ERR_BUSY) break;
        struct timespec ts = {0, 5 * 1000 * 1000};
        nanosleep(&ts, NULL); /* BUSY: the cancelled request is still being rolled back */
    }
    CHECK_EQ_INT(got, KVS_ERR_CACHE_MISS);
    CHECK_EQ_INT(r.st.have, 0);
    netio_buf_free(&b);
    close(fd);
}

/* Issue 36 defect 1: clients that hang up while their FORWARD runs. Each connects, sends a
 * 400-row prefill and closes after 0-19 ms, so the close lands before, during and after the
 * computation and its reply (a reply queued after the connection's writer stopped once counted
 * twice out of srv.buffered_bytes, which wrapped and refused every later frame BUSY). After
 * all of them the buffered bytes are back to exactly 0, and a new client is served. */
static void test_hangups(test_shard *sc) {
    int32_t toks[400];
    struct wire_info info;
    int probe = connect_to(sc);
    CHECK_EQ_INT(hello(probe, &info), KVS_OK);
    close(probe);
    for (int i = 0; i < 400; i++) toks[i] = (i * 7 + 3) % (int)info.n_vocab;
    for (int k = 0; k < 120; k++) {
        int fd = connect_to(sc);
        CHECK(fd >= 0);
        if (fd < 0) break;
        struct wire_info hi;
        CHECK_EQ_INT(hello(fd, &hi), KVS_OK);
        send_forward(fd, 1, sid_of(9000 + k), 1, 0, 400, toks, WIRE_OUT_LOGITS_ALL);
        if (k % 20) sleep_ms(k % 20); /* spreads the hang-up over the step (not an ordering) */
        close(fd);
    }
    /* Every connection has gone once none is open (bounded: 60 s). */
    for (int i = 0; i < 6000 && srv_stat(sc, "srv.connections_open") > 0; i++) sleep_ms(10);
    CHECK_EQ_INT(srv_stat(sc, "srv.connections_open"), 0);
    CHECK_EQ_INT(srv_stat(sc, "srv.buffered_bytes"), 0);
    /* And the shard still serves: HELLO and a small FORWARD. */
    int fd = connect_to(sc);
    CHECK_EQ_INT(hello(fd, &info), KVS_OK);
    struct netio_buf b = {0};
    struct wire_forward_reply r;
    send_forward(fd, 2, sid_of(9999), 1, 0, 4, toks, WIRE_OUT_LOGITS_LAST);
    CHECK_EQ_INT(recv_forward(fd, &b, &r, NULL), KVS_OK);
    CHECK_EQ_INT(r.st.status, KVS_OK);
    netio_buf_free(&b);
    close(fd);
}

/* Sends CANCEL(target) as request rid and returns the status of its STATUS reply. */
static int cancel_request(int fd, uint64_t rid, uint64_t target) {
    struct wire_cancel c = {.target_request_id = target};
    uint8_t cb[16];
    size_t cl;
    wire_encode_cancel(&c, cb, sizeof(cb), &cl);
    CHECK_EQ_INT(netio_send_frame(fd, WIRE_OP_CANCEL, rid, cb, cl, netio_deadline_ms(5000)), KVS_OK);
    struct netio_buf b = {0};
    struct wire_header hd;
    int op = recv_any(fd, &b, &hd);
    CHECK_EQ_INT(op, WIRE_OP_STATUS);
    CHECK_EQ_INT(hd.request_id, rid);
    struct wire_status_reply st;
    char msg[KVS_MSG_MAX];
    int status = KVS_ERR_PROTOCOL;
    if (op == WIRE_OP_STATUS && wire_decode_status_reply(b.data, b.len, &st, msg, sizeof(msg)) == KVS_OK)
        status = st.st.status;
    netio_buf_free(&b);
    return status;
}

/* Issue 36 defect 5: a CANCEL that arrives after a FORWARD's forward pass but before its
 * commit is accepted (OK), so the FORWARD must answer CANCELLED and leave the session as it
 * was; a CANCEL after the reply answers NOT_FOUND. Ordered by the after-batch gate. */
static void test_cancel_vs_commit(test_shard *sc) {
    int fd = connect_to(sc);
    struct wire_info info;
    CHECK_EQ_INT(hello(fd, &info), KVS_OK);
    int32_t toks[8];
    for (int i = 0; i < 8; i++) toks[i] = (i * 11 + 5) % (int)info.n_vocab;
    struct netio_buf b = {0};
    struct wire_forward_reply r;
    kv_sid sid = sid_of(7100);
    send_forward(fd, 1, sid, 1, 0, 4, toks, WIRE_OUT_LOGITS_LAST);
    CHECK_EQ_INT(recv_forward(fd, &b, &r, NULL), KVS_OK);
    CHECK_EQ_INT(r.st.status, KVS_OK);
    /* The decode step of position 4 finishes its pass and waits before the commit. */
    while (sem_trywait(&g_after_gate) == 0) {
    }
    const int held0 = atomic_load(&g_after_held);
    atomic_store(&g_after_gated, true);
    send_forward(fd, 2, sid, 1, 4, 1, toks + 4, WIRE_OUT_LOGITS_LAST);
    for (int i = 0; i < 6000 && atomic_load(&g_after_held) == held0; i++) sleep_ms(10);
    CHECK(atomic_load(&g_after_held) > held0);
    CHECK_EQ_INT(cancel_request(fd, 3, 2), KVS_OK);
    atomic_store(&g_after_gated, false);
    sem_post(&g_after_gate);
    uint64_t rid = 0;
    CHECK_EQ_INT(recv_forward(fd, &b, &r, &rid), KVS_OK);
    CHECK_EQ_INT(rid, 2);
    CHECK_EQ_INT(r.st.status, KVS_ERR_CANCELLED);
    CHECK_EQ_INT(r.st.n_past, 4);
    CHECK_EQ_INT(r.st.live_epoch, 1);
    /* Position 4 was not committed: it is computed again, and now a late CANCEL is NOT_FOUND. */
    send_forward(fd, 4, sid, 1, 4, 1, toks + 4, WIRE_OUT_LOGITS_LAST);
    CHECK_EQ_INT(recv_forward(fd, &b, &r, NULL), KVS_OK);
    CHECK_EQ_INT(r.st.status, KVS_OK);
    CHECK_EQ_INT(r.st.n_past, 5);
    CHECK_EQ_INT(cancel_request(fd, 5, 4), KVS_ERR_NOT_FOUND);
    netio_buf_free(&b);
    close(fd);
}

/* Issue 36 defects 2 and 6: a cancelled FORWARD that would have created a session leaves
 * nothing (no tombstone at its epoch: an older epoch is served, and the CANCELLED reply names
 * no live epoch), and a FORWARD cancelled while still queued counts in kv.cancellations. */
static void test_cancel_creates_nothing(test_shard *sc) {
    int fd = connect_to(sc);
    struct wire_info info;
    CHECK_EQ_INT(hello(fd, &info), KVS_OK);
    int32_t toks[8];
    for (int i = 0; i < 8; i++) toks[i] = (i * 13 + 1) % (int)info.n_vocab;
    struct netio_buf b = {0};
    struct wire_forward_reply r;
    kv_sid sid = sid_of(7200);
    const uint64_t tombs0 = srv_stat(sc, "kv.tombstones"), cancels0 = srv_stat(sc, "kv.cancellations");
    while (sem_trywait(&sc->gate) == 0) {
    } /* earlier checks may leave the gate open by a post */
    const int held0 = atomic_load(&sc->held);
    atomic_store(&sc->gated, true);
    send_forward(fd, 1, sid, 5, 0, 8, toks, WIRE_OUT_LOGITS_LAST);
    CHECK(test_shard_wait_held(sc, held0 + 1));
    /* A second request on the session queues behind the first (arrival order). */
    send_forward(fd, 2, sid, 5, 8, 1, toks, WIRE_OUT_LOGITS_LAST);
    CHECK_EQ_INT(cancel_request(fd, 3, 1), KVS_OK);
    CHECK_EQ_INT(cancel_request(fd, 4, 2), KVS_OK);
    atomic_store(&sc->gated, false);
    sem_post(&sc->gate);
    for (int k = 0; k < 2; k++) {
        uint64_t rid = 0;
        CHECK_EQ_INT(recv_forward(fd, &b, &r, &rid), KVS_OK);
        CHECK(rid == 1 || rid == 2);
        CHECK_EQ_INT(r.st.status, KVS_ERR_CANCELLED);
        CHECK_EQ_INT(r.st.n_past, 0);
        CHECK_EQ_INT(r.st.live_epoch, 0);
    }
    CHECK_EQ_INT(srv_stat(sc, "kv.tombstones"), tombs0);
    CHECK_EQ_INT(srv_stat(sc, "kv.cancellations"), cancels0 + 2);
    /* The id was never created, so epoch 4 is a new session, not STALE_EPOCH(5). */
    send_forward(fd, 5, sid, 4, 0, 8, toks, WIRE_OUT_LOGITS_LAST);
    CHECK_EQ_INT(recv_forward(fd, &b, &r, NULL), KVS_OK);
    CHECK_EQ_INT(r.st.status, KVS_OK);
    CHECK_EQ_INT(r.st.n_past, 8);
    netio_buf_free(&b);
    close(fd);
}

typedef struct {
    test_shard *sc;
    int k;        /* prompt */
    int sid_base; /* session ids differ between runs */
    int32_t ids[16];
    float *logits; /* 16 x n_vocab: every step's logits, for the bitwise comparison */
    int n_vocab;
    int failures;
} client_arg;

static void *client_thread(void *p) {
    client_arg *a = p;
    int fd = connect_to(a->sc);
    struct wire_info info;
    if (hello(fd, &info) != KVS_OK) {
        a->failures++;
        close(fd);
        return NULL;
    }
    int nv = a->n_vocab = (int)info.n_vocab;
    int32_t toks[64];
    for (int i = 0; i < 8; i++) toks[i] = (i * 3 + a->k * 17 + 1) % nv;
    kv_sid sid = sid_of(a->sid_base + a->k);
    struct netio_buf b = {0};
    struct wire_forward_reply r;
    a->logits = calloc((size_t)16 * nv, sizeof(float));
    uint32_t pos = 0, n = 8;
    for (int s = 0; s < 16; s++) {
        send_forward(fd, (uint64_t)s, sid, 1, pos, n, toks + pos, WIRE_OUT_LOGITS_LAST);
        if (recv_forward(fd, &b, &r, NULL) != KVS_OK || r.st.status != KVS_OK) {
            a->failures++;
            break;
        }
        float *logits = a->logits + (size_t)s * nv;
        wire_forward_reply_to_f32(&r, logits);
        pos += n;
        n = 1;
        toks[pos] = a->ids[s] = sampler_argmax(logits, nv);
    }
    netio_buf_free(&b);
    close(fd);
    return NULL;
}

/* Four clients at once: the server batches their steps (a step holds several of them: the
 * first step is held at the gate until all four first requests have arrived), and each gets
 * its solo logits bit for bit at every step. */
static void test_concurrent(test_shard *sc) {
    client_arg solo[4], conc[4];
    pthread_t th[4];
    for (int k = 0; k < 4; k++) {
        solo[k] = (client_arg){.sc = sc, .k = k, .sid_base = 1000};
        client_thread(&solo[k]);
        CHECK_EQ_INT(solo[k].failures, 0);
        conc[k] = (client_arg){.sc = sc, .k = k, .sid_base = 2000};
    }
    while (sem_trywait(&sc->gate) == 0) {
    }
    atomic_store(&g_max_items, 0);
    const uint64_t req0 = srv_stat(sc, "srv.requests");
    atomic_store(&sc->gated, true);
    for (int k = 0; k < 4; k++) pthread_create(&th[k], NULL, client_thread, &conc[k]);
    for (int i = 0; i < 6000 && srv_stat(sc, "srv.requests") < req0 + 4; i++) sleep_ms(10);
    CHECK(srv_stat(sc, "srv.requests") >= req0 + 4);
    atomic_store(&sc->gated, false);
    sem_post(&sc->gate);
    for (int k = 0; k < 4; k++) pthread_join(th[k], NULL);
    CHECK(atomic_load(&g_max_items) >= 2);
    for (int k = 0; k < 4; k++) {
        CHECK_EQ_INT(conc[k].failures, 0);
        CHECK(memcmp(conc[k].ids, solo[k].ids, sizeof(solo[k].ids)) == 0);
        CHECK(conc[k].logits && solo[k].logits &&
              memcmp(conc[k].logits, solo[k].logits, (size_t)16 * solo[k].n_vocab * sizeof(float)) == 0);
        free(conc[k].logits);
        free(solo[k].logits);
    }
}

/* A tail shard (layers [1, 2)) takes hidden states in f32 or f16 (and bf16 on a v2 connection)
 * and answers in the same dtype; the f16 / bf16 answer is the f32 one rounded (inputs rounded
 * first), and all equal the local engine's split computation. */
static void test_hidden_dtypes(const char *model_path) {
    test_shard tail;
    CHECK_EQ_INT(start_server(&tail, model_path, 1, 2, 16), KVS_OK);
    int fd = connect_to(&tail);
    struct wire_info info;
    CHECK_EQ_INT(hello(fd, &info), KVS_OK);
    CHECK_EQ_INT(info.first, 1);
    CHECK(info.hidden_dtypes & WIRE_DTYPE_F16);
    uint32_t d = info.n_embd, n = 6;
    float *hid = malloc((size_t)n * d * sizeof(float)), *back = malloc((size_t)n * d * sizeof(float));
    uint16_t *h16 = malloc((size_t)n * d * sizeof(uint16_t));
    for (size_t i = 0; i < (size_t)n * d; i++) hid[i] = (float)((int)(i * 37 % 101) - 50) / 25.0f;
    quant_f32_to_f16_row(hid, h16, (int64_t)n * d);
    quant_f16_to_f32_row(h16, hid, (int64_t)n * d); /* both requests carry the same values */
    /* The local engine on the same range. */
    engine_params ep = engine_default_params();
    ep.model_path = model_path;
    ep.first = 1;
    ep.last = 2;
    ep.n_threads = 2;
    ep.kv.budget_bytes = 4u << 20;
    engine *e = NULL;
    char msg[KVS_MSG_MAX];
    CHECK_EQ_INT(engine_open(&ep, &e, msg, sizeof(msg)), KVS_OK);
    float *local = malloc((size_t)n * d * sizeof(float));
    engine_req lr = {.sid = sid_of(900), .epoch = 1, .n = n, .hidden = hid, .out_mode = FWD_OUT_HIDDEN, .out = local};
    if (e) engine_step(e, &lr, 1);
    struct netio_buf b = {0};
    for (int pass = 0; pass < 2; pass++) {
        bool f16 = pass == 1;
        struct wire_forward f = {.epoch = 1, .n_tokens = n, .out_mode = WIRE_OUT_HIDDEN,
                                 .in_kind = f16 ? WIRE_IN_HIDDEN_F16 : WIRE_IN_HIDDEN_F32, .n_embd = d,
                                 .data = f16 ? (const void *)h16 : (const void *)hid};
        kv_sid sid = sid_of(910 + pass);
        memcpy(f.session_id, sid.bytes, 16);
        size_t len = 0;
        wire_encode_forward(&f, NULL, 0, &len);
        uint8_t *buf = malloc(len);
        CHECK_EQ_INT(wire_encode_forward(&f, buf, len, &len), KVS_OK);
        netio_send_frame(fd, WIRE_OP_FORWARD, 1, buf, len, netio_deadline_ms(5000));
        free(buf);
        struct wire_forward_reply r;
        CHECK_EQ_INT(recv_forward(fd, &b, &r, NULL), KVS_OK);
        CHECK_EQ_INT(r.st.status, KVS_OK);
        CHECK_EQ_INT(r.out_kind, f16 ? WIRE_OUTK_HIDDEN_F16 : WIRE_OUTK_HIDDEN_F32);
        CHECK_EQ_INT(r.n_rows, n);
        CHECK_EQ_INT(r.n_cols, d);
        CHECK_EQ_INT(wire_forward_reply_to_f32(&r, back), KVS_OK);
        for (size_t i = 0; i < (size_t)n * d; i++) {
            float want = f16 ? kvs_f16_to_f32(kvs_f32_to_f16(local[i])) : local[i];
            if (back[i] != want) {
                fprintf(stderr, "%s hidden reply differs at %zu: %g vs %g\n", f16 ? "f16" : "f32", i,
                        (double)back[i], (double)want);
                test_failures_++;
                break;
            }
        }
    }
    /* bf16 (a v2 dtype): not advertised and refused UNSUPPORTED on this v1 connection; on a v2 one
     * advertised, and the answer is the local engine's on the same (bf16-exact) input, rounded. */
    CHECK(!(info.hidden_dtypes & WIRE_DTYPE_BF16));
    uint16_t *hb = malloc((size_t)n * d * sizeof(uint16_t));
    float *hidb = malloc((size_t)n * d * sizeof(float)), *localb = malloc((size_t)n * d * sizeof(float));
    for (size_t i = 0; i < (size_t)n * d; i++) {
        hb[i] = wire_f32_to_bf16((float)((int)(i * 41 % 103) - 51) / 23.0f);
        hidb[i] = wire_bf16_to_f32(hb[i]);
    }
    engine_req lrb = {.sid = sid_of(901), .epoch = 1, .n = n, .hidden = hidb, .out_mode = FWD_OUT_HIDDEN, .out = localb};
    if (e) engine_step(e, &lrb, 1);
    for (uint16_t v = 1; v <= 2; v++) {
        int c = fd;
        if (v == 2) {
            c = connect_to(&tail);
            CHECK_EQ_INT(hello_v(c, 2, &info), KVS_OK);
            CHECK_EQ_INT(info.version, 2);
            CHECK(info.hidden_dtypes & WIRE_DTYPE_BF16);
        }
        struct wire_forward f = {.epoch = 1, .n_tokens = n, .out_mode = WIRE_OUT_HIDDEN,
                                 .in_kind = WIRE_IN_HIDDEN_BF16, .n_embd = d, .data = hb};
        kv_sid sid = sid_of(930 + v);
        memcpy(f.session_id, sid.bytes, 16);
        size_t len = 0;
        wire_encode_forward(&f, NULL, 0, &len);
        uint8_t *buf = malloc(len);
        CHECK_EQ_INT(wire_encode_forward(&f, buf, len, &len), KVS_OK);
        netio_send_frame(c, WIRE_OP_FORWARD, 2, buf, len, netio_deadline_ms(5000));
        free(buf);
        struct wire_forward_reply r;
        CHECK_EQ_INT(recv_forward(c, &b, &r, NULL), KVS_OK);
        if (v == 1) {
            CHECK_EQ_INT(r.st.status, KVS_ERR_UNSUPPORTED);
            continue;
        }
        CHECK_EQ_INT(r.st.status, KVS_OK);
        CHECK_EQ_INT(r.out_kind, WIRE_OUTK_HIDDEN_BF16);
        CHECK_EQ_INT(r.n_rows, n);
        CHECK_EQ_INT(r.n_cols, d);
        CHECK_EQ_INT(wire_forward_reply_to_f32(&r, back), KVS_OK);
        for (size_t i = 0; i < (size_t)n * d; i++) {
            float want = wire_bf16_to_f32(wire_f32_to_bf16(localb[i]));
            if (back[i] != want) {
                fprintf(stderr, "bf16 hidden reply differs at %zu: %g vs %g\n", i, (double)back[i], (double)want);
                test_failures_++;
                break;
            }
        }
        close(c);
    }
    free(hb);
    free(hidb);
    free(localb);
    /* Token ids are refused by a shard that does not own layer 0. */
    int32_t tok = 1;
    CHECK_EQ_INT(send_forward(fd, 3, sid_of(920), 1, 0, 1, &tok, WIRE_OUT_HIDDEN), KVS_OK);
    struct wire_forward_reply r;
    CHECK_EQ_INT(recv_forward(fd, &b, &r, NULL), KVS_OK);
    CHECK_EQ_INT(r.st.status, KVS_ERR_INVALID_ARG);
    netio_buf_free(&b);
    close(fd);
    engine_close(e);
    free(hid);
    free(back);
    free(h16);
    free(local);
    test_shard_stop(&tail);
}

/* A client that floods requests and never reads its replies: the scheduler never waits on it
 * (replies queue per connection), another client is served meanwhile, and once the queue passes
 * max_queued_bytes (1 MiB here) the flooder is disconnected. */
static void test_slow_reader(test_shard *sc) {
    int flood = connect_to(sc), ok = connect_to(sc);
    struct wire_info info;
    CHECK_EQ_INT(hello(flood, &info), KVS_OK);
    CHECK_EQ_INT(hello(ok, &info), KVS_OK);
    int32_t toks[16];
    for (int i = 0; i < 16; i++) toks[i] = (i * 11 + 3) % (int)info.n_vocab;
    /* 2000 replies of 16 x n_vocab floats (32 KiB each): far past any socket buffer. */
    int sent = 0;
    for (int i = 0; i < 2000; i++) {
        if (send_forward(flood, (uint64_t)i, sid_of(3000 + i), 1, 0, 16, toks, WIRE_OUT_LOGITS_ALL) != KVS_OK) break;
        sent++;
    }
    CHECK(sent > 0);
    /* The other client still gets answers. */
    struct netio_buf b = {0};
    struct wire_forward_reply r;
    for (int i = 0; i < 5; i++) {
        CHECK_EQ_INT(send_forward(ok, 100 + (uint64_t)i, sid_of(5000 + i), 1, 0, 4, toks, WIRE_OUT_LOGITS_LAST), KVS_OK);
        CHECK_EQ_INT(recv_forward(ok, &b, &r, NULL), KVS_OK);
        CHECK_EQ_INT(r.st.status, KVS_OK);
    }
    /* The flooder is cut off once its queue passes the limit (bounded wait on the log line). */
    for (int i = 0; i < 60000 && atomic_load(&g_slow_closed) == 0; i++) {
        struct timespec ts = {0, 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    CHECK(atomic_load(&g_slow_closed) > 0);
    netio_buf_free(&b);
    close(flood);
    close(ok);
}

int main(void) {
    sem_init(&g_after_gate, 0, 0);
    char dir[] = "/tmp/kvs-server-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char model_file[256];
    snprintf(model_file, sizeof(model_file), "%s/small-q8_0.gguf", dir);
    mkmodel_params mp = mkmodel_default_params();
    mp.shape = "small";
    mp.type = QUANT_Q8_0;
    mp.n_threads = 1;
    char msg[KVS_MSG_MAX];
    CHECK_EQ_INT(mkmodel_write(model_file, mp, msg, sizeof(msg)), KVS_OK);
    test_shard sc;
    CHECK_EQ_INT(start_server(&sc, model_file, 0, 0, 16), KVS_OK);
    test_basic(&sc, model_file);
    test_bad_input(&sc);
    test_cancel(&sc);
    test_cancel_vs_commit(&sc);
    test_cancel_creates_nothing(&sc);
    test_concurrent(&sc);
    test_hangups(&sc);
    test_slow_reader(&sc);
    test_shard_stop(&sc);
    test_hidden_dtypes(model_file);
    test_hello_timeout(model_file);
    unlink(model_file);
    rmdir(dir);
    return test_finish("test_server", 1, 0);
}
