/*
 * The shard server at its KV budget (issue 7), in-process on a free loopback port, driven by a raw
 * wire client. Events are ordered by the scheduler gate (before_batch hook), by the order in which
 * one connection's reader handles frames (a STATS reply proves the frames before it were queued),
 * and by an injected hot-state clock — never by sleeps.
 *  - a retry, a rewind, a re-route inherit and an epoch bump succeed in a full pool with the same
 *    logits, and evict no idle neighbour (defect 1);
 *  - a request short of blocks waits while anything running could free them (defect 2);
 *  - prefills share each step's rows: a short prompt is not held behind a long one (defect 3);
 *  - FORWARD then TRUNCATE / RELEASE on one session from one connection take effect in order (4);
 *  - INFO max_ctx is what one session can hold under the budget; --max-sessions waits / evicts
 *    instead of refusing (6); --kv-ttl evicts by the injected clock.
 */
#include <errno.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "engine.h"
#include "mkmodel.h"
#include "netio.h"
#include "quant.h"
#include "server.h"
#include "shard_harness.h"
#include "test.h"
#include "util.h"
#include "wire.h"

typedef struct {
    srv *s;
    pthread_t th;
    sem_t gate;
    sem_t held;               /* posted by the hook when it holds a step for hold_at */
    atomic_bool gated;
    atomic_bool at_gate;      /* the scheduler waits in the gated branch of the hook */
    atomic_int hold_at;       /* > 0: the first step with at least this many requests waits at the gate */
    atomic_uint_fast64_t now; /* hot-state clock, ns */
} server_ctx;

static void hook(void *ctx, int n) {
    server_ctx *sc = ctx;
    if (atomic_load(&sc->gated)) {
        atomic_store(&sc->at_gate, true);
        while (sem_wait(&sc->gate) != 0 && errno == EINTR) {
        }
        atomic_store(&sc->at_gate, false);
    }
    int h = atomic_load(&sc->hold_at);
    if (h > 0 && n >= h) {
        atomic_store(&sc->hold_at, 0);
        sem_post(&sc->held);
        while (sem_wait(&sc->gate) != 0 && errno == EINTR) {
        }
    }
}

static uint64_t fake_clock(void *ctx) { return (uint64_t)atomic_load(&((server_ctx *)ctx)->now); }

static void *serve_thread(void *p) {
    srv_run(((server_ctx *)p)->s);
    return NULL;
}

static int start_server(server_ctx *sc, const char *model_path, uint64_t budget, uint32_t chunk, uint32_t max_sessions,
                        uint64_t ttl_ms) {
    srv_params p = srv_default_params();
    p.model_path = model_path;
    p.listen = "127.0.0.1:0";
    p.n_threads = 2;
    p.kv_budget_bytes = budget;
    p.prefill_chunk = chunk;
    p.max_sessions = max_sessions;
    p.kv_ttl_ms = ttl_ms;
    p.before_batch = hook;
    p.hook_ctx = sc;
    p.kv_clock = fake_clock;
    p.kv_clock_ctx = sc;
    p.log = test_quiet_log;
    sem_init(&sc->gate, 0, 0);
    sem_init(&sc->held, 0, 0);
    atomic_init(&sc->gated, false);
    atomic_init(&sc->at_gate, false);
    atomic_init(&sc->hold_at, 0);
    atomic_init(&sc->now, 1000000000ull);
    char msg[KVS_MSG_MAX] = "";
    int err = srv_create(&p, &sc->s, msg, sizeof(msg));
    if (err) {
        fprintf(stderr, "srv_create: %s\n", msg);
        return err;
    }
    pthread_create(&sc->th, NULL, serve_thread, sc);
    return KVS_OK;
}

static void stop_server(server_ctx *sc) {
    srv_stop(sc->s);
    pthread_join(sc->th, NULL);
    srv_free(sc->s);
    sem_destroy(&sc->gate);
    sem_destroy(&sc->held);
}

static void ungate(server_ctx *sc) {
    atomic_store(&sc->gated, false);
    sem_post(&sc->gate);
}

static int connect_hello(server_ctx *sc, struct wire_info *info) {
    int fd = -1;
    char msg[KVS_MSG_MAX];
    if (netio_connect("127.0.0.1", srv_port(sc->s), netio_deadline_ms(20000), &fd, msg, sizeof(msg))) return -1;
    struct wire_hello h = {.min_version = 1, .max_version = 1};
    uint8_t buf[64];
    size_t len;
    wire_encode_hello(&h, buf, sizeof(buf), &len);
    netio_send_frame(fd, WIRE_OP_HELLO, 1, buf, len, netio_deadline_ms(20000));
    struct netio_buf b = {0};
    struct wire_header hd;
    int err = netio_recv_frame(fd, &hd, &b, netio_deadline_ms(60000), msg, sizeof(msg));
    if (!err) err = hd.op == WIRE_OP_INFO ? wire_decode_info(b.data, b.len, info, msg, sizeof(msg)) : KVS_ERR_PROTOCOL;
    netio_buf_free(&b);
    if (err || info->st.status) {
        close(fd);
        return -1;
    }
    return fd;
}

static kv_sid sid_of(int k) {
    kv_sid s;
    memset(&s, 0, sizeof(s));
    memcpy(s.bytes, &k, sizeof(k));
    s.bytes[13] = 0x3C;
    return s;
}

/* Frames are built into one buffer and written at once ("in one write"). */
typedef struct {
    uint8_t *data;
    size_t len, cap;
} outbuf;

static void put_frame(outbuf *o, uint16_t op, uint64_t rid, const uint8_t *payload, size_t len) {
    if (o->len + WIRE_HEADER_SIZE + len > o->cap) {
        o->cap = (o->len + WIRE_HEADER_SIZE + len) * 2;
        o->data = realloc(o->data, o->cap);
    }
    struct wire_header h = {.magic = WIRE_MAGIC, .version = 1, .op = op, .request_id = rid, .payload_len = (uint32_t)len};
    wire_encode_header(&h, o->data + o->len);
    if (len) memcpy(o->data + o->len + WIRE_HEADER_SIZE, payload, len);
    o->len += WIRE_HEADER_SIZE + len;
}

static void put_forward(outbuf *o, uint64_t rid, kv_sid sid, uint64_t epoch, uint32_t start, uint32_t n,
                        const int32_t *toks, const kv_inherit *inh) {
    struct wire_forward f = {.epoch = epoch, .start_pos = start, .n_tokens = n, .out_mode = WIRE_OUT_LOGITS_LAST,
                             .in_kind = WIRE_IN_TOKENS, .data = toks};
    if (inh) {
        f.flags = WIRE_FWD_INHERIT;
        f.inherit_epoch = inh->old_epoch;
        f.inherit_len = inh->len;
    }
    memcpy(f.session_id, sid.bytes, 16);
    size_t len = 0;
    wire_encode_forward(&f, NULL, 0, &len);
    uint8_t *buf = malloc(len);
    wire_encode_forward(&f, buf, len, &len);
    put_frame(o, WIRE_OP_FORWARD, rid, buf, len);
    free(buf);
}

static void put_release(outbuf *o, uint64_t rid, kv_sid sid, uint64_t epoch) {
    struct wire_release r = {.epoch = epoch};
    memcpy(r.session_id, sid.bytes, 16);
    uint8_t buf[64];
    size_t len;
    wire_encode_release(&r, buf, sizeof(buf), &len);
    put_frame(o, WIRE_OP_RELEASE, rid, buf, len);
}

static void put_truncate(outbuf *o, uint64_t rid, kv_sid sid, uint64_t epoch, uint32_t keep) {
    struct wire_truncate t = {.epoch = epoch, .len = keep};
    memcpy(t.session_id, sid.bytes, 16);
    uint8_t buf[64];
    size_t len;
    wire_encode_truncate(&t, buf, sizeof(buf), &len);
    put_frame(o, WIRE_OP_TRUNCATE, rid, buf, len);
}

static void flush(int fd, outbuf *o) {
    CHECK_EQ_INT(netio_write_full(fd, o->data, o->len, netio_deadline_ms(20000)), KVS_OK);
    o->len = 0;
}

/* One reply of any kind: op, request id, status block and (FORWARD_REPLY) logits. */
typedef struct {
    int op;
    uint64_t rid;
    struct wire_status st;
    float *logits; /* malloc'd n_vocab floats for an OK FORWARD_REPLY, else NULL */
    uint64_t stat_value; /* STATS_REPLY: the counter asked for in recv_reply */
} reply;

static reply recv_reply(int fd, uint32_t n_vocab, const char *stat) {
    reply out = {.op = -1};
    struct netio_buf b = {0};
    struct wire_header hd;
    char msg[KVS_MSG_MAX];
    if (netio_recv_frame(fd, &hd, &b, netio_deadline_ms(120000), msg, sizeof(msg)) != KVS_OK) return out;
    out.op = hd.op;
    out.rid = hd.request_id;
    if (hd.op == WIRE_OP_FORWARD_REPLY) {
        struct wire_forward_reply r;
        if (wire_decode_forward_reply(b.data, b.len, &r, msg, sizeof(msg)) == KVS_OK) {
            out.st = r.st;
            if (r.st.status == KVS_OK && r.n_cols == n_vocab) {
                out.logits = malloc((size_t)n_vocab * sizeof(float));
                wire_forward_reply_to_f32(&r, out.logits);
            }
        }
    } else if (hd.op == WIRE_OP_STATUS) {
        struct wire_status_reply r;
        if (wire_decode_status_reply(b.data, b.len, &r, msg, sizeof(msg)) == KVS_OK) out.st = r.st;
    } else if (hd.op == WIRE_OP_STATS_REPLY) {
        struct wire_stats_reply *r = calloc(1, sizeof(*r));
        if (wire_decode_stats_reply(b.data, b.len, r, msg, sizeof(msg)) == KVS_OK)
            for (uint32_t i = 0; stat && i < r->n_stats; i++)
                if (strcmp(r->stats[i].name, stat) == 0) out.stat_value = r->stats[i].value;
        free(r);
    }
    netio_buf_free(&b);
    return out;
}

static uint64_t stat_of(int fd, const char *name) {
    outbuf o = {0};
    put_frame(&o, WIRE_OP_STATS, 999, NULL, 0);
    flush(fd, &o);
    free(o.data);
    reply r = recv_reply(fd, 0, name);
    CHECK_EQ_INT(r.op, WIRE_OP_STATS_REPLY);
    return r.stat_value;
}

/* Local reference: logits of the last of tokens[0..n) for a fresh session. */
static float *solo_logits(engine *e, int k, const int32_t *toks, uint32_t n) {
    float *out = malloc((size_t)e->m->hp.n_vocab * sizeof(float));
    engine_req rq = {.sid = sid_of(100000 + k), .epoch = 1, .n = n, .tokens = toks, .out_mode = FWD_OUT_LOGITS_LAST,
                     .out = out};
    CHECK_EQ_INT(engine_step(e, &rq, 1), KVS_OK);
    CHECK_EQ_INT(rq.status, KVS_OK);
    return out;
}

static bool same_logits(const float *a, const float *b, uint32_t n) {
    return a && b && memcmp(a, b, (size_t)n * sizeof(float)) == 0;
}

static void fill_tokens(int32_t *t, uint32_t n, int k, uint32_t nv) {
    for (uint32_t i = 0; i < n; i++) t[i] = (int32_t)((i * 7 + (uint32_t)k * 13 + 1) % nv);
}

/* Defect 1 over the wire: a pool of 3 blocks (48 positions), an idle neighbour of 1 block, and a
 * session of 20 positions (2 blocks): the pool is full. */
static void test_full_pool_retry(const char *model_path, engine *e, size_t block_bytes) {
    server_ctx sc;
    CHECK_EQ_INT(start_server(&sc, model_path, 3 * block_bytes, 64, 0, 0), KVS_OK);
    struct wire_info info;
    int fd = connect_hello(&sc, &info);
    CHECK(fd >= 0);
    uint32_t nv = info.n_vocab;
    int32_t toks[20], nb[4];
    fill_tokens(toks, 20, 1, nv);
    fill_tokens(nb, 4, 2, nv);
    float *want = solo_logits(e, 1, toks, 20);
    kv_sid a = sid_of(1), n = sid_of(2);
    outbuf o = {0};
    put_forward(&o, 1, n, 1, 0, 4, nb, NULL);
    put_forward(&o, 2, a, 1, 0, 20, toks, NULL);
    flush(fd, &o);
    for (int i = 0; i < 2; i++) {
        reply r = recv_reply(fd, nv, NULL);
        CHECK_EQ_INT(r.st.status, KVS_OK);
        if (r.rid == 2) CHECK(same_logits(r.logits, want, nv));
        free(r.logits);
    }
    CHECK_EQ_INT(stat_of(fd, "kv.blocks_free"), 0);
    /* The same request again, its last position again, a re-route survivor's inherit, a new epoch
     * — each with tokens the session has not held at those positions, so a rewrite that left the
     * old rows in place would answer the old logits. */
    kv_inherit inh = {.old_epoch = 1, .len = 19};
    struct { uint64_t epoch; uint32_t start; const kv_inherit *inh; } steps[] = {
        {1, 0, NULL}, {1, 19, NULL}, {2, 19, &inh}, {3, 0, NULL}};
    int32_t cur[20];
    memcpy(cur, toks, sizeof(cur));
    for (size_t i = 0; i < sizeof(steps) / sizeof(steps[0]); i++) {
        int32_t fresh[20];
        fill_tokens(fresh, 20, 60 + (int)i, nv);
        memcpy(cur + steps[i].start, fresh + steps[i].start, (20 - steps[i].start) * sizeof(int32_t));
        float *want_i = solo_logits(e, 60 + (int)i, cur, 20);
        put_forward(&o, 10 + i, a, steps[i].epoch, steps[i].start, 20 - steps[i].start, cur + steps[i].start,
                    steps[i].inh);
        flush(fd, &o);
        reply r = recv_reply(fd, nv, NULL);
        CHECK_EQ_INT(r.st.status, KVS_OK);
        CHECK_EQ_INT(r.st.n_past, 20);
        CHECK(same_logits(r.logits, want_i, nv));
        CHECK(!same_logits(want_i, want, nv)); /* the check can tell old rows from new */
        free(r.logits);
        free(want_i);
    }
    CHECK_EQ_INT(stat_of(fd, "kv.blocks_free"), 0);
    CHECK_EQ_INT(stat_of(fd, "kv.bytes_used"), 3 * block_bytes);
    CHECK_EQ_INT(stat_of(fd, "kv.evict_lru"), 0);
    /* The neighbour is still there: its next position is a hit, not CACHE_MISS(0). */
    put_forward(&o, 20, n, 1, 4, 1, nb, NULL);
    flush(fd, &o);
    reply r = recv_reply(fd, nv, NULL);
    CHECK_EQ_INT(r.st.status, KVS_OK);
    CHECK_EQ_INT(r.st.n_past, 5);
    free(r.logits);
    free(want);
    free(o.data);
    close(fd);
    stop_server(&sc);
}

/* Defect 2: a pool of 4 blocks, one row per step; P (2 blocks), Q (4 blocks), R (1 block) in one
 * write. Q waits for P and R instead of failing; all three equal their solo runs. */
static void test_wait_for_running(const char *model_path, engine *e, size_t block_bytes) {
    server_ctx sc;
    CHECK_EQ_INT(start_server(&sc, model_path, 4 * block_bytes, 1, 0, 0), KVS_OK);
    struct wire_info info;
    int fd = connect_hello(&sc, &info);
    CHECK(fd >= 0);
    uint32_t nv = info.n_vocab;
    CHECK_EQ_INT(info.max_ctx, 64); /* defect 6: what one session can hold in 4 blocks of 16 */
    uint32_t rows[3] = {32, 64, 16};
    int32_t toks[3][64];
    float *want[3];
    outbuf o = {0};
    for (int k = 0; k < 3; k++) {
        fill_tokens(toks[k], rows[k], 10 + k, nv);
        want[k] = solo_logits(e, 10 + k, toks[k], rows[k]);
        put_forward(&o, (uint64_t)k, sid_of(10 + k), 1, 0, rows[k], toks[k], NULL);
    }
    flush(fd, &o);
    for (int i = 0; i < 3; i++) {
        reply r = recv_reply(fd, nv, NULL);
        CHECK_EQ_INT(r.op, WIRE_OP_FORWARD_REPLY);
        if (r.rid < 3) {
            if (r.st.status != KVS_OK) fprintf(stderr, "request %d (%u rows): status %d\n", (int)r.rid, rows[r.rid], r.st.status);
            CHECK_EQ_INT(r.st.status, KVS_OK);
            CHECK(same_logits(r.logits, want[r.rid], nv));
        }
        free(r.logits);
    }
    /* Exactly what is left: P ran first, Q evicted it (the pool holds Q alone), R evicted Q. */
    CHECK_EQ_INT(stat_of(fd, "kv.sessions"), 1);
    CHECK_EQ_INT(stat_of(fd, "kv.bytes_used"), 1 * block_bytes);
    CHECK_EQ_INT(stat_of(fd, "kv.evict_lru"), 2);
    for (int k = 0; k < 3; k++) free(want[k]);
    free(o.data);
    close(fd);
    stop_server(&sc);
}

/* Defect 3: a 512-row prompt, then a 2-row and a 1-row one, 16 prefill rows per step: the short
 * ones are answered while the long one still runs. */
static void test_fair_chunks(const char *model_path, engine *e) {
    server_ctx sc;
    CHECK_EQ_INT(start_server(&sc, model_path, 16u << 20, 16, 0, 0), KVS_OK);
    struct wire_info info;
    int fd = connect_hello(&sc, &info);
    CHECK(fd >= 0);
    uint32_t nv = info.n_vocab;
    static int32_t longp[512];
    int32_t two[2], one[1];
    fill_tokens(longp, 512, 20, nv);
    fill_tokens(two, 2, 21, nv);
    fill_tokens(one, 1, 22, nv);
    float *want_long = solo_logits(e, 20, longp, 512), *want_two = solo_logits(e, 21, two, 2);
    atomic_store(&sc.gated, true);
    outbuf o = {0};
    put_forward(&o, 1, sid_of(20), 1, 0, 512, longp, NULL);
    put_forward(&o, 2, sid_of(21), 1, 0, 2, two, NULL);
    put_forward(&o, 3, sid_of(22), 1, 0, 1, one, NULL);
    put_frame(&o, WIRE_OP_STATS, 4, NULL, 0);
    flush(fd, &o);
    reply st = recv_reply(fd, nv, NULL); /* the reader has queued all three */
    CHECK_EQ_INT(st.op, WIRE_OP_STATS_REPLY);
    ungate(&sc);
    uint64_t order[3] = {0};
    for (int i = 0; i < 3; i++) {
        reply r = recv_reply(fd, nv, NULL);
        CHECK_EQ_INT(r.st.status, KVS_OK);
        order[i] = r.rid;
        if (r.rid == 1) CHECK(same_logits(r.logits, want_long, nv));
        if (r.rid == 2) CHECK(same_logits(r.logits, want_two, nv));
        free(r.logits);
    }
    CHECK_EQ_INT(order[2], 1); /* the long prompt is answered last */
    free(want_long);
    free(want_two);
    free(o.data);
    close(fd);
    stop_server(&sc);
}

/* Defect 4: FORWARD(decode) then RELEASE, and FORWARD then TRUNCATE, in one write: they take
 * effect in that order (5 rounds each). */
static void test_op_order(const char *model_path) {
    server_ctx sc;
    CHECK_EQ_INT(start_server(&sc, model_path, 16u << 20, 64, 0, 0), KVS_OK);
    struct wire_info info;
    int fd = connect_hello(&sc, &info);
    CHECK(fd >= 0);
    uint32_t nv = info.n_vocab;
    int32_t toks[8];
    fill_tokens(toks, 8, 30, nv);
    outbuf o = {0};
    for (int round = 0; round < 5; round++) {
        kv_sid sid = sid_of(30 + round);
        put_forward(&o, 1, sid, 1, 0, 4, toks, NULL);
        flush(fd, &o);
        reply r = recv_reply(fd, nv, NULL);
        CHECK_EQ_INT(r.st.status, KVS_OK);
        free(r.logits);
        /* decode + TRUNCATE(2): the decode lands first (n_past 5), then the truncate. */
        put_forward(&o, 2, sid, 1, 4, 1, toks + 4, NULL);
        put_truncate(&o, 3, sid, 1, 2);
        flush(fd, &o);
        for (int i = 0; i < 2; i++) {
            r = recv_reply(fd, nv, NULL);
            CHECK_EQ_INT(r.st.status, KVS_OK);
            CHECK_EQ_INT(r.st.n_past, r.rid == 2 ? 5 : 2);
            free(r.logits);
        }
        /* decode at 2 + RELEASE: the decode succeeds, then the session is gone. */
        put_forward(&o, 4, sid, 1, 2, 1, toks + 2, NULL);
        put_release(&o, 5, sid, 1);
        put_forward(&o, 6, sid, 1, 3, 1, toks + 3, NULL);
        flush(fd, &o);
        for (int i = 0; i < 3; i++) {
            r = recv_reply(fd, nv, NULL);
            if (r.rid == 4) {
                CHECK_EQ_INT(r.st.status, KVS_OK);
                CHECK_EQ_INT(r.st.n_past, 3);
            } else if (r.rid == 5) {
                CHECK_EQ_INT(r.st.status, KVS_OK);
            } else {
                CHECK_EQ_INT(r.rid, 6);
                CHECK_EQ_INT(r.st.status, KVS_ERR_CACHE_MISS);
                CHECK_EQ_INT(r.st.have, 0);
            }
            free(r.logits);
        }
    }
    free(o.data);
    close(fd);
    stop_server(&sc);
}

/* --max-sessions 1: B waits while A runs, then evicts idle A; --kv-ttl by the injected clock. */
static void test_sessions_ttl(const char *model_path, engine *e) {
    server_ctx sc;
    CHECK_EQ_INT(start_server(&sc, model_path, 16u << 20, 64, 1, 1000), KVS_OK);
    struct wire_info info;
    int fd = connect_hello(&sc, &info);
    CHECK(fd >= 0);
    uint32_t nv = info.n_vocab;
    int32_t ta[8], tb[8];
    fill_tokens(ta, 8, 40, nv);
    fill_tokens(tb, 8, 41, nv);
    float *want_b = solo_logits(e, 41, tb, 8);
    atomic_store(&sc.gated, true);
    outbuf o = {0};
    put_forward(&o, 1, sid_of(40), 1, 0, 8, ta, NULL);
    put_forward(&o, 2, sid_of(41), 1, 0, 8, tb, NULL);
    put_frame(&o, WIRE_OP_STATS, 3, NULL, 0);
    flush(fd, &o);
    reply st = recv_reply(fd, nv, NULL);
    CHECK_EQ_INT(st.op, WIRE_OP_STATS_REPLY);
    ungate(&sc);
    for (int i = 0; i < 2; i++) {
        reply r = recv_reply(fd, nv, NULL);
        CHECK_EQ_INT(r.st.status, KVS_OK);
        if (r.rid == 2) CHECK(same_logits(r.logits, want_b, nv));
        free(r.logits);
    }
    /* B waited for A's pin inside the scheduler; no client was answered BUSY, so kv.busy
     * counts none (issue 36 defect 6). */
    CHECK_EQ_INT(stat_of(fd, "kv.busy"), 0);
    /* A was evicted for B (LRU, the limit): its next position misses. */
    put_forward(&o, 4, sid_of(40), 1, 8, 1, ta, NULL);
    flush(fd, &o);
    reply r = recv_reply(fd, nv, NULL);
    CHECK_EQ_INT(r.st.status, KVS_ERR_CACHE_MISS);
    CHECK_EQ_INT(r.st.have, 0);
    CHECK_EQ_INT(stat_of(fd, "kv.evict_lru"), 1);
    /* TTL: B idle past 1 s of the injected clock is evicted by the next request's sweep. */
    atomic_fetch_add(&sc.now, 2000000000ull);
    put_forward(&o, 5, sid_of(42), 1, 0, 2, ta, NULL);
    put_forward(&o, 6, sid_of(41), 1, 8, 1, tb, NULL);
    flush(fd, &o);
    for (int i = 0; i < 2; i++) {
        r = recv_reply(fd, nv, NULL);
        if (r.rid == 5) CHECK_EQ_INT(r.st.status, KVS_OK);
        else CHECK_EQ_INT(r.st.status, KVS_ERR_CACHE_MISS);
        free(r.logits);
    }
    CHECK_EQ_INT(stat_of(fd, "kv.evict_ttl"), 1);
    free(want_b);
    free(o.data);
    close(fd);
    stop_server(&sc);
}

/* Also test: one session cancelled mid-prefill while two others decode in the same forward pass
 * (its rows are compacted out at the layer boundary): the decodes equal their solo runs, and the
 * cancelled session is as before (absent: its next request at 0 starts it). */
static void test_cancel_in_batch(const char *model_path, engine *e) {
    server_ctx sc;
    CHECK_EQ_INT(start_server(&sc, model_path, 16u << 20, 16, 0, 0), KVS_OK);
    struct wire_info info;
    int fd = connect_hello(&sc, &info);
    CHECK(fd >= 0);
    uint32_t nv = info.n_vocab;
    int32_t ty[9], tz[9], tx[100];
    fill_tokens(ty, 9, 50, nv);
    fill_tokens(tz, 9, 51, nv);
    fill_tokens(tx, 100, 52, nv);
    float *want_y = solo_logits(e, 50, ty, 9), *want_z = solo_logits(e, 51, tz, 9);
    outbuf o = {0};
    put_forward(&o, 1, sid_of(50), 1, 0, 8, ty, NULL);
    put_forward(&o, 2, sid_of(51), 1, 0, 8, tz, NULL);
    flush(fd, &o);
    for (int i = 0; i < 2; i++) free(recv_reply(fd, nv, NULL).logits);
    /* The first step holding all three (X's prefill chunk, Y's and Z's decode) waits at the gate.
     * Not left to arrival order: the hook runs after a step's requests are picked, so the
     * scheduler is first parked at the gate in a step of its own (W, another session) while X, Y
     * and Z are sent; once the STATS reply shows the reader has queued all three, the hold is
     * armed and the gate opened: W's step ends and the next step picks X, Y and Z together
     * (a step picked while they were still arriving could hold only some of them). */
    int32_t tw[1];
    fill_tokens(tw, 1, 53, nv);
    atomic_store(&sc.gated, true);
    put_forward(&o, 10, sid_of(53), 1, 0, 1, tw, NULL);
    flush(fd, &o);
    for (int waited = 0; waited < 60000 && !atomic_load(&sc.at_gate); waited++) {
        struct timespec ms = {0, 1000 * 1000};
        nanosleep(&ms, NULL);
    }
    CHECK(atomic_load(&sc.at_gate)); /* parked in W's step */
    put_forward(&o, 3, sid_of(52), 2, 0, 100, tx, NULL);
    put_forward(&o, 4, sid_of(50), 1, 8, 1, ty + 8, NULL);
    put_forward(&o, 5, sid_of(51), 1, 8, 1, tz + 8, NULL);
    put_frame(&o, WIRE_OP_STATS, 8, NULL, 0);
    flush(fd, &o);
    reply st = recv_reply(fd, nv, NULL); /* the reader has queued all three */
    CHECK_EQ_INT(st.op, WIRE_OP_STATS_REPLY);
    free(st.logits);
    atomic_store(&sc.hold_at, 3);
    ungate(&sc);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 60; /* bounded: the step comes as soon as the gate opens */
    int w;
    while ((w = sem_timedwait(&sc.held, &until)) != 0 && errno == EINTR) {
    }
    CHECK_EQ_INT(w, 0);
    reply wr = recv_reply(fd, nv, NULL); /* W's step ended before the held one began */
    CHECK_EQ_INT(wr.rid, 10);
    CHECK_EQ_INT(wr.st.status, KVS_OK);
    free(wr.logits);
    struct wire_cancel c = {.target_request_id = 3};
    uint8_t cb[16];
    size_t cl;
    wire_encode_cancel(&c, cb, sizeof(cb), &cl);
    put_frame(&o, WIRE_OP_CANCEL, 6, cb, cl);
    flush(fd, &o);
    reply cr = recv_reply(fd, nv, NULL); /* CANCEL answered while the step is held */
    CHECK_EQ_INT(cr.op, WIRE_OP_STATUS);
    CHECK_EQ_INT(cr.rid, 6);
    CHECK_EQ_INT(cr.st.status, KVS_OK);
    sem_post(&sc.gate);
    for (int i = 0; i < 3; i++) {
        reply r = recv_reply(fd, nv, NULL);
        if (r.rid == 3) {
            CHECK_EQ_INT(r.st.status, KVS_ERR_CANCELLED);
            CHECK_EQ_INT(r.st.n_past, 0);
        } else {
            CHECK_EQ_INT(r.st.status, KVS_OK);
            CHECK(same_logits(r.logits, r.rid == 4 ? want_y : want_z, nv));
        }
        free(r.logits);
    }
    put_forward(&o, 7, sid_of(52), 2, 1, 1, tx, NULL);
    flush(fd, &o);
    reply r = recv_reply(fd, nv, NULL);
    CHECK_EQ_INT(r.st.status, KVS_ERR_CACHE_MISS);
    CHECK_EQ_INT(r.st.have, 0);
    CHECK_EQ_INT(stat_of(fd, "kv.cancellations"), 1);
    /* The cancelled request would have created the session at epoch 2: it left no tombstone, so
     * epoch 1 starts it (issue 36 defect 2). */
    CHECK_EQ_INT(stat_of(fd, "kv.tombstones"), 0);
    put_forward(&o, 9, sid_of(52), 1, 0, 1, tx, NULL);
    flush(fd, &o);
    r = recv_reply(fd, nv, NULL);
    CHECK_EQ_INT(r.st.status, KVS_OK);
    free(r.logits);
    free(want_y);
    free(want_z);
    free(o.data);
    close(fd);
    stop_server(&sc);
}

int main(void) {
    char dir[] = "/tmp/kvs-srvp-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char model_path[256];
    snprintf(model_path, sizeof(model_path), "%s/small-q8_0.gguf", dir);
    mkmodel_params mp = mkmodel_default_params();
    mp.shape = "small";
    mp.type = QUANT_Q8_0;
    mp.n_threads = 1;
    char msg[KVS_MSG_MAX];
    CHECK_EQ_INT(mkmodel_write(model_path, mp, msg, sizeof(msg)), KVS_OK);
    engine_params ep = engine_default_params();
    ep.model_path = model_path;
    ep.n_threads = 2;
    ep.kv.budget_bytes = 16u << 20;
    engine *e = NULL;
    CHECK_EQ_INT(engine_open(&ep, &e, msg, sizeof(msg)), KVS_OK);
    if (e) {
        size_t block_bytes = kv_block_bytes(e->kv);
        /* Also test: a block holds only the shard's own layers (docs/design.md §2): small has 2 layers,
         * 2 kv heads x 64, f16 KV, 16 positions per block. */
        CHECK_EQ_INT(block_bytes, 16 * 2 * 2 * 2 * 64 * 2);
        engine_params hp = ep;
        hp.first = 0;
        hp.last = 1;
        engine *head = NULL;
        CHECK_EQ_INT(engine_open(&hp, &head, msg, sizeof(msg)), KVS_OK);
        if (head) CHECK_EQ_INT(kv_block_bytes(head->kv), 16 * 1 * 2 * 2 * 64 * 2);
        engine_close(head);
        test_full_pool_retry(model_path, e, block_bytes);
        test_wait_for_running(model_path, e, block_bytes);
        test_fair_chunks(model_path, e);
        test_op_order(model_path);
        test_sessions_ttl(model_path, e);
        test_cancel_in_batch(model_path, e);
    }
    engine_close(e);
    unlink(model_path);
    rmdir(dir);
    return test_finish("test_server_pressure", 1, 0);
}
