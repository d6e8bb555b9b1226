/*
 * test_server_fuzz — a seeded, bounded wire-level fuzz of one in-process shard against a
 * reference model of its session table (issue 36).
 *
 * Two client connections (one identity, so they share sessions) drive a few session ids with
 * random FORWARD (appends, rewinds, retries, epoch bumps, stale epochs, misses), TRUNCATE,
 * RELEASE, and FORWARD+CANCEL pairs, while hang-up clients open connections, send a prefill
 * and close at random moments. Every reply is checked against the model: status, n_past,
 * have, live epoch, and for every OK FORWARD the logits bit for bit against the local engine
 * running the tokens the model says the session holds. A CANCEL answered OK means its FORWARD
 * must answer CANCELLED and change nothing; NOT_FOUND means the FORWARD took its normal
 * course. At the end: no connection left, srv.buffered_bytes exactly 0, and the pool holds
 * exactly the blocks of the sessions the model holds.
 */
#include <errno.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/socket.h>

#include "engine.h"
#include "mkmodel.h"
#include "netio.h"
#include "quant.h"
#include "server.h"
#include "shard_harness.h"
#include "test.h"
#include "util.h"
#include "wire.h"

#define N_SIDS 4
#define MAX_POS 64    /* positions a fuzzed session may reach */
#define BLOCK_TOKENS 16

typedef struct {
    bool live;
    uint64_t epoch;     /* live epoch */
    uint32_t n_past;
    uint64_t tomb;      /* remembered epoch once gone (0: none) */
    int32_t toks[MAX_POS];
} model_sess;

typedef struct {
    test_shard sh;
    engine *local;       /* the reference for logits */
    uint32_t nv;
    int fds[2];
    model_sess m[N_SIDS];
    uint64_t rng;
    uint64_t next_rid;
    int solo_id;         /* fresh local session per reference run */
    int n_ok, n_cancelled, n_cancel_late, n_hangups;
} fuzz;

static uint32_t rnd(fuzz *f, uint32_t n) {
    f->rng = f->rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(f->rng >> 33) % n;
}

static kv_sid wire_sid(int k) {
    kv_sid s;
    memset(&s, 0, sizeof(s));
    s.bytes[0] = (uint8_t)k;
    s.bytes[15] = 0x5a;
    return s;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static uint64_t stat_value(fuzz *f, const char *name) {
    struct wire_stats_reply *m = calloc(1, sizeof(*m));
    srv_stats(f->sh.s, m);
    uint64_t v = UINT64_MAX;
    for (uint32_t i = 0; i < m->n_stats; i++)
        if (strcmp(m->stats[i].name, name) == 0) v = m->stats[i].value;
    free(m);
    return v;
}

static int open_conn(fuzz *f) {
    int fd = -1;
    char msg[KVS_MSG_MAX];
    if (netio_connect("127.0.0.1", srv_port(f->sh.s), netio_deadline_ms(5000), &fd, msg, sizeof msg)) return -1;
    struct wire_hello h = {.min_version = 1, .max_version = 1};
    uint8_t buf[512];
    size_t len;
    wire_encode_hello(&h, buf, sizeof buf, &len);
    struct netio_buf b = {0};
    struct wire_header hd;
    int err = netio_send_frame(fd, WIRE_OP_HELLO, 1, buf, len, netio_deadline_ms(5000));
    if (!err) err = netio_recv_frame(fd, &hd, &b, netio_deadline_ms(30000), msg, sizeof msg);
    struct wire_info info;
    if (!err) err = hd.op == WIRE_OP_INFO ? wire_decode_info(b.data, b.len, &info, msg, sizeof msg) : KVS_ERR_PROTOCOL;
    if (!err) f->nv = info.n_vocab;
    netio_buf_free(&b);
    if (err) {
        close(fd);
        return -1;
    }
    return fd;
}

/* One reply: op, request id, status block, logits of an OK FORWARD_REPLY (malloc'd). */
typedef struct {
    int op;
    uint64_t rid;
    struct wire_status st;
    float *logits;
} reply;

static reply recv_one(fuzz *f, int fd) {
    reply out = {.op = -1};
    struct netio_buf b = {0};
    struct wire_header hd;
    char msg[KVS_MSG_MAX];
    if (netio_recv_frame(fd, &hd, &b, netio_deadline_ms(60000), msg, sizeof msg) == KVS_OK) {
        out.op = hd.op;
        out.rid = hd.request_id;
        if (hd.op == WIRE_OP_FORWARD_REPLY) {
            struct wire_forward_reply r;
            if (wire_decode_forward_reply(b.data, b.len, &r, msg, sizeof msg) == KVS_OK) {
                out.st = r.st;
                if (r.st.status == KVS_OK && r.n_cols == f->nv) {
                    out.logits = malloc((size_t)f->nv * sizeof(float));
                    wire_forward_reply_to_f32(&r, out.logits);
                }
            }
        } else if (hd.op == WIRE_OP_STATUS) {
            struct wire_status_reply r;
            if (wire_decode_status_reply(b.data, b.len, &r, msg, sizeof msg) == KVS_OK) out.st = r.st;
        }
    }
    netio_buf_free(&b);
    return out;
}

/* The local engine's logits for the last of toks[0..n) in a fresh session. */
static float *reference_logits(fuzz *f, const int32_t *toks, uint32_t n) {
    float *out = malloc((size_t)f->nv * sizeof(float));
    kv_sid sid;
    memset(&sid, 0, sizeof sid);
    int id = ++f->solo_id;
    memcpy(sid.bytes, &id, sizeof id);
    engine_req rq = {.sid = sid, .epoch = 1, .n = n, .tokens = toks, .out_mode = FWD_OUT_LOGITS_LAST, .out = out};
    CHECK_EQ_INT(engine_step(f->local, &rq, 1), KVS_OK);
    CHECK_EQ_INT(rq.status, KVS_OK);
    kv_reply kr;
    kv_release(f->local->kv, &sid, 1, &kr);
    return out;
}

/* What the model says a FORWARD(epoch, start, n) does; fills the recovery fields it expects. */
typedef struct {
    int status;
    uint32_t n_past, have;
    uint64_t live_epoch;
} expect;

static expect model_forward(const model_sess *s, uint64_t epoch, uint32_t start, uint32_t n) {
    expect x = {0};
    if (s->live && epoch < s->epoch) {
        x.status = KVS_ERR_STALE_EPOCH;
        x.live_epoch = s->epoch;
        x.n_past = s->n_past;
    } else if (!s->live && s->tomb && epoch < s->tomb) {
        x.status = KVS_ERR_STALE_EPOCH;
        x.live_epoch = s->tomb;
    } else if (s->live && epoch == s->epoch && start > s->n_past) {
        x.status = KVS_ERR_CACHE_MISS;
        x.have = s->n_past;
        x.n_past = s->n_past;
    } else if ((!s->live || epoch > s->epoch) && start > 0) {
        x.status = KVS_ERR_CACHE_MISS; /* the generator never sends this for a live session */
    } else {
        x.status = KVS_OK;
        x.n_past = start + n;
    }
    (void)n;
    return x;
}

static void model_apply_forward(model_sess *s, uint64_t epoch, uint32_t start, uint32_t n, const int32_t *toks) {
    memcpy(s->toks + start, toks, n * sizeof(int32_t));
    s->live = true;
    s->epoch = epoch;
    s->n_past = start + n;
}

static void check_forward_reply(fuzz *f, model_sess *s, const reply *r, expect x, uint64_t epoch, uint32_t start,
                                uint32_t n, const int32_t *toks) {
    CHECK_EQ_INT(r->op, WIRE_OP_FORWARD_REPLY);
    CHECK_EQ_INT(r->st.status, x.status);
    if (r->st.status != x.status) return;
    if (x.status == KVS_OK) {
        model_apply_forward(s, epoch, start, n, toks);
        CHECK_EQ_INT(r->st.n_past, s->n_past);
        float *want = reference_logits(f, s->toks, s->n_past);
        CHECK(r->logits && memcmp(r->logits, want, (size_t)f->nv * sizeof(float)) == 0);
        free(want);
        f->n_ok++;
    } else if (x.status == KVS_ERR_CACHE_MISS) {
        CHECK_EQ_INT(r->st.have, x.have);
    } else if (x.status == KVS_ERR_STALE_EPOCH) {
        CHECK_EQ_INT(r->st.live_epoch, x.live_epoch);
    }
}

static void send_fwd(int fd, uint64_t rid, int k, uint64_t epoch, uint32_t start, uint32_t n, const int32_t *toks) {
    kv_sid sid = wire_sid(k);
    CHECK_EQ_INT(send_forward_frame(fd, rid, sid.bytes, epoch, start, n, toks, WIRE_OUT_LOGITS_LAST), KVS_OK);
}

/* Picks a FORWARD the model can judge: on a live session the same epoch (append, rewind, retry,
 * or a miss past n_past), an older one (stale) or a newer one from 0; on a gone one an epoch
 * around its tombstone, from 0 or past it (a miss). */
static void pick_forward(fuzz *f, const model_sess *s, uint64_t *epoch, uint32_t *start, uint32_t *n) {
    *n = 1 + rnd(f, 8);
    if (s->live) {
        uint32_t r = rnd(f, 10);
        if (r < 6) {
            *epoch = s->epoch;
            *start = s->n_past ? rnd(f, s->n_past + 2) : 0; /* rewind, append, or a miss by one */
        } else if (r < 8 && s->epoch > 1) {
            *epoch = s->epoch - 1;
            *start = 0;
        } else {
            *epoch = s->epoch + 1;
            *start = 0;
        }
    } else {
        uint64_t base = s->tomb ? s->tomb : 2;
        *epoch = base - 1 + rnd(f, 3);
        *start = rnd(f, 4) == 0 ? 1 + rnd(f, 4) : 0;
    }
    if (*start + *n > MAX_POS) *start = 0;
}

static void op_forward(fuzz *f, int fd, int k) {
    model_sess *s = &f->m[k];
    uint64_t epoch;
    uint32_t start, n;
    pick_forward(f, s, &epoch, &start, &n);
    int32_t toks[8];
    for (uint32_t i = 0; i < n; i++) toks[i] = (int32_t)rnd(f, f->nv);
    expect x = model_forward(s, epoch, start, n);
    uint64_t rid = f->next_rid++;
    send_fwd(fd, rid, k, epoch, start, n, toks);
    reply r = recv_one(f, fd);
    CHECK_EQ_INT(r.rid, rid);
    check_forward_reply(f, s, &r, x, epoch, start, n, toks);
    free(r.logits);
}

/* FORWARD and CANCEL pipelined: either the CANCEL found it (OK: the FORWARD answers CANCELLED
 * and nothing changed) or it came too late (NOT_FOUND: the FORWARD took its course). */
static void op_forward_cancel(fuzz *f, int fd, int k) {
    model_sess *s = &f->m[k];
    uint64_t epoch;
    uint32_t start, n;
    pick_forward(f, s, &epoch, &start, &n);
    int32_t toks[8];
    for (uint32_t i = 0; i < n; i++) toks[i] = (int32_t)rnd(f, f->nv);
    expect x = model_forward(s, epoch, start, n);
    uint64_t rid = f->next_rid++, crid = f->next_rid++;
    send_fwd(fd, rid, k, epoch, start, n, toks);
    struct wire_cancel c = {.target_request_id = rid};
    uint8_t cb[16];
    size_t cl;
    wire_encode_cancel(&c, cb, sizeof cb, &cl);
    CHECK_EQ_INT(netio_send_frame(fd, WIRE_OP_CANCEL, crid, cb, cl, netio_deadline_ms(5000)), KVS_OK);
    reply a = recv_one(f, fd), b = recv_one(f, fd);
    reply *fr = a.rid == rid ? &a : &b, *cr = a.rid == crid ? &a : &b;
    CHECK(fr != cr);
    CHECK_EQ_INT(cr->op, WIRE_OP_STATUS);
    if (cr->st.status == KVS_OK) {
        CHECK_EQ_INT(fr->op, WIRE_OP_FORWARD_REPLY);
        CHECK_EQ_INT(fr->st.status, KVS_ERR_CANCELLED);
        CHECK_EQ_INT(fr->st.n_past, s->live ? s->n_past : 0);
        CHECK_EQ_INT(fr->st.live_epoch, s->live ? s->epoch : 0);
        f->n_cancelled++;
    } else {
        CHECK_EQ_INT(cr->st.status, KVS_ERR_NOT_FOUND);
        check_forward_reply(f, s, fr, x, epoch, start, n, toks);
        f->n_cancel_late++;
    }
    free(a.logits);
    free(b.logits);
}

/* TRUNCATE or RELEASE at the live epoch of a live session. */
static void op_truncate_release(fuzz *f, int fd, int k) {
    model_sess *s = &f->m[k];
    if (!s->live) return;
    bool release = rnd(f, 3) == 0;
    uint8_t buf[64];
    size_t len = 0;
    uint64_t rid = f->next_rid++;
    kv_sid sid = wire_sid(k);
    uint32_t keep = rnd(f, s->n_past + 1);
    if (release) {
        struct wire_release m = {.epoch = s->epoch};
        memcpy(m.session_id, sid.bytes, 16);
        CHECK_EQ_INT(wire_encode_release(&m, buf, sizeof buf, &len), KVS_OK);
        CHECK_EQ_INT(netio_send_frame(fd, WIRE_OP_RELEASE, rid, buf, len, netio_deadline_ms(5000)), KVS_OK);
    } else {
        struct wire_truncate m = {.epoch = s->epoch, .len = keep};
        memcpy(m.session_id, sid.bytes, 16);
        CHECK_EQ_INT(wire_encode_truncate(&m, buf, sizeof buf, &len), KVS_OK);
        CHECK_EQ_INT(netio_send_frame(fd, WIRE_OP_TRUNCATE, rid, buf, len, netio_deadline_ms(5000)), KVS_OK);
    }
    reply r = recv_one(f, fd);
    CHECK_EQ_INT(r.rid, rid);
    CHECK_EQ_INT(r.st.status, KVS_OK);
    if (release || keep == 0) {
        s->live = false;
        s->tomb = s->epoch;
        s->n_past = 0;
    } else {
        s->n_past = keep;
        CHECK_EQ_INT(r.st.n_past, keep);
    }
    free(r.logits);
}

/* A client that sends a prefill on a session of its own and hangs up at a random moment. */
static void op_hangup(fuzz *f) {
    int fd = open_conn(f);
    CHECK(fd >= 0);
    if (fd < 0) return;
    int32_t toks[48];
    for (int i = 0; i < 48; i++) toks[i] = (int32_t)rnd(f, f->nv);
    send_fwd(fd, 1, 100 + f->n_hangups % 8, 1, 0, 16 + rnd(f, 32), toks);
    int wait = (int)rnd(f, 4);
    if (wait) sleep_ms(wait); /* spreads the close over the step; no order depends on it */
    close(fd);
    f->n_hangups++;
}

static uint64_t model_bytes(const fuzz *f, uint64_t block_bytes) {
    uint64_t blocks = 0;
    for (int k = 0; k < N_SIDS; k++)
        if (f->m[k].live) blocks += (f->m[k].n_past + BLOCK_TOKENS - 1) / BLOCK_TOKENS;
    return blocks * block_bytes;
}

static void run_seed(const char *model_path, uint64_t seed, int n_ops) {
    fuzz *f = calloc(1, sizeof(*f));
    f->rng = seed;
    f->next_rid = 10;
    srv_params p = srv_default_params();
    p.model_path = model_path;
    p.listen = "127.0.0.1:0";
    p.n_threads = 1;
    p.kv_budget_bytes = 16u << 20;
    p.prefill_chunk = 16;
    p.log = test_quiet_log;
    CHECK_EQ_INT(test_shard_start(&f->sh, p), KVS_OK);
    engine_params ep = engine_default_params();
    ep.model_path = model_path;
    ep.n_threads = 1;
    ep.kv.budget_bytes = 16u << 20;
    char msg[KVS_MSG_MAX];
    CHECK_EQ_INT(engine_open(&ep, &f->local, msg, sizeof msg), KVS_OK);
    for (int i = 0; i < 2; i++) {
        f->fds[i] = open_conn(f);
        CHECK(f->fds[i] >= 0);
    }
    for (int i = 0; i < n_ops; i++) {
        int fd = f->fds[rnd(f, 2)], k = (int)rnd(f, N_SIDS);
        uint32_t op = rnd(f, 20);
        if (op < 10) op_forward(f, fd, k);
        else if (op < 15) op_forward_cancel(f, fd, k);
        else if (op < 18) op_truncate_release(f, fd, k);
        else op_hangup(f);
    }
    /* The hang-up clients' work ends with their connections (their references hold them). */
    for (int i = 0; i < 6000 && stat_value(f, "srv.connections_open") > 2; i++) sleep_ms(10);
    CHECK_EQ_INT(stat_value(f, "srv.connections_open"), 2);
    /* Their sessions may or may not have committed: release what is there, by the wire. */
    for (int k = 100; k < 108; k++) {
        kv_sid sid = wire_sid(k);
        struct wire_release m = {.epoch = 1};
        memcpy(m.session_id, sid.bytes, 16);
        uint8_t buf[64];
        size_t len = 0;
        wire_encode_release(&m, buf, sizeof buf, &len);
        netio_send_frame(f->fds[0], WIRE_OP_RELEASE, 5, buf, len, netio_deadline_ms(5000));
        reply r = recv_one(f, f->fds[0]);
        CHECK(r.st.status == KVS_OK || r.st.status == KVS_ERR_CACHE_MISS);
        free(r.logits);
    }
    uint64_t block_bytes = stat_value(f, "kv.block_bytes");
    int live = 0;
    for (int k = 0; k < N_SIDS; k++) live += f->m[k].live;
    CHECK_EQ_INT(stat_value(f, "kv.sessions"), live);
    CHECK_EQ_INT(stat_value(f, "kv.bytes_used"), model_bytes(f, block_bytes));
    for (int i = 0; i < 2; i++) close(f->fds[i]);
    for (int i = 0; i < 6000 && stat_value(f, "srv.connections_open") > 0; i++) sleep_ms(10);
    CHECK_EQ_INT(stat_value(f, "srv.connections_open"), 0);
    CHECK_EQ_INT(stat_value(f, "srv.buffered_bytes"), 0);
    printf("  seed %llu: %d ops: %d forwards ok, %d cancelled, %d cancels too late, %d hang-ups\n",
           (unsigned long long)seed, n_ops, f->n_ok, f->n_cancelled, f->n_cancel_late, f->n_hangups);
    CHECK(f->n_ok > 0 && f->n_hangups > 0);
    engine_close(f->local);
    test_shard_stop(&f->sh);
    free(f);
}

int main(void) {
    char dir[] = "/tmp/kvs-srvfuzz-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char model_path[256];
    snprintf(model_path, sizeof model_path, "%s/small-q8_0.gguf", dir);
    mkmodel_params mp = mkmodel_default_params();
    mp.shape = "small";
    mp.type = QUANT_Q8_0;
    mp.n_threads = 1;
    char msg[KVS_MSG_MAX];
    CHECK_EQ_INT(mkmodel_write(model_path, mp, msg, sizeof msg), KVS_OK);
    const uint64_t seeds[] = {1, 2, 3};
    for (size_t i = 0; i < sizeof seeds / sizeof seeds[0]; i++) run_seed(model_path, seeds[i], 600);
    unlink(model_path);
    rmdir(dir);
    return test_finish("test_server_fuzz", 1, 0);
}
