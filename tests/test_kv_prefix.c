/* kvstate shared prefix blocks (issue 40 part 2, kvstate.c I10): full blocks keyed by (tenant,
 * chain hash) are shared between sessions of one tenant and charged once; a new session takes
 * them instead of computing them; released sessions leave them as a prefix cache inside the
 * budget, evicted before any live session; tenants never share; a keyed block is never written.
 * The kvstate parts are deterministic (no clock, no threads; a position's K holds a marker
 * standing for computed K/V). Over the wire (protocol v3): sessions with a common prefix through a
 * real 2-shard route (in-process servers on loopback) skip the cached prefix and give logits
 * bit-identical to a local run of the whole model; a tail that lacks the prefix makes the route
 * start over and still gives the same logits; a v2 client is answered in v2 and refused the
 * prefix block, and works as before. */
#include <pthread.h>

#include "engine.h"
#include "kv_markers.h"
#include "kvshard.h"
#include "kvstate.h"
#include "mkmodel.h"
#include "netio.h"
#include "quant.h"
#include "route.h"
#include "server.h"
#include "test.h"
#include "util.h"
#include "wire.h"

#define BT 16u
#define BLOCK 256u /* 16 positions x 1 layer x 2 (K, V) x 1 head x 2 f32 */
enum { T1 = 1, T2 = 2 };

static kv_sid sid_of(int k) {
    kv_sid s;
    memset(&s, 0, sizeof(s));
    memcpy(s.bytes, &k, sizeof(k));
    s.bytes[15] = 0x40;
    return s;
}

static kv_state *make_pool(uint32_t blocks) {
    kv_params p = kv_default_params();
    p.n_layers = 1;
    p.n_kv_heads = 1;
    p.head_dim = 2;
    p.block_tokens = BT;
    p.kv_type = QUANT_F32;
    p.budget_bytes = (uint64_t)blocks * BLOCK;
    p.max_positions = 2048;
    kv_state *kv = NULL;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(kv_create(&p, &kv, msg, sizeof(msg)), KVS_OK);
    CHECK_EQ_INT((int)kv_block_bytes(kv), (int)BLOCK);
    return kv;
}

/* Chain hashes of prompt family f: hashes[i] names positions [0, 16 (i + 1)). */
static uint64_t hashes_of[3][64];
static void init_hashes(void) {
    for (int f = 0; f < 3; f++)
        for (int i = 0; i < 64; i++) hashes_of[f][i] = 0x9E3779B97F4A7C15ull * (uint64_t)(f + 1) + (uint64_t)i * 7919u;
}

static float marker(int f, uint32_t p) { return (float)(f * 10000) + (float)p; }

/* Appends [start, start + n) of family f's prompt to sid with the hashes of every block up to
 * the end (pre) or none; writes the markers of the positions it computes. */
static int append(kv_state *kv, uint64_t tenant, int sid, int f, uint32_t start, uint32_t n, bool pre, kv_reply *r) {
    kv_sid s = sid_of(sid);
    kv_prefix px = {.hashes = hashes_of[f], .first = 0, .n = (start + n) / BT};
    kv_txn *t = NULL;
    int err = kv_begin_prefix(kv, tenant, &s, 1, start, n, NULL, pre ? &px : NULL, &t, r);
    CHECK_KV(kv);
    if (err) return err;
    for (uint32_t p = start; p < start + n; p++) ((float *)kv_txn_k(t, 0, p, 0))[0] = marker(f, p);
    kv_commit(kv, t, r);
    CHECK_KV(kv);
    return KVS_OK;
}

/* The K marker sid holds at p (read through an aborted one-position append). */
static float read_k(kv_state *kv, int sid, uint32_t p) {
    kv_sid s = sid_of(sid);
    uint32_t n_past = 0;
    uint64_t ep = 0;
    CHECK_EQ_INT(kv_lookup(kv, &s, &ep, &n_past), KVS_OK);
    kv_txn *t = NULL;
    kv_reply r;
    if (kv_begin(kv, &s, ep, n_past, 1, NULL, &t, &r) != KVS_OK) return -1.0f;
    float v = ((float *)kv_txn_k(t, 0, p, 0))[0];
    kv_abort(kv, t, false);
    CHECK_KV(kv);
    return v;
}

static kv_stats stats(kv_state *kv) {
    kv_stats st;
    kv_get_stats(kv, &st);
    return st;
}

static uint32_t block_of(kv_state *kv, int sid, uint32_t i) {
    uint32_t ids[128];
    kv_sid s = sid_of(sid);
    uint32_t n = kv_debug_blocks(kv, &s, ids, 128);
    return i < n ? ids[i] : UINT32_MAX;
}

static void release(kv_state *kv, int sid) {
    kv_sid s = sid_of(sid);
    kv_reply r;
    CHECK_EQ_INT(kv_release(kv, &s, 1, &r), KVS_OK);
    CHECK_KV(kv);
}

/* A second session adopts the first one's full blocks: no compute, charged once. */
static void test_adopt_and_budget(void) {
    kv_state *kv = make_pool(64);
    kv_reply r;
    CHECK_EQ_INT(append(kv, T1, 1, 0, 0, 72, true, &r), KVS_OK); /* 4 full blocks + 8 */
    CHECK_EQ_INT(stats(kv).bytes_used, 5u * BLOCK);
    CHECK_EQ_INT(stats(kv).prefix_blocks, 4);
    /* Session 2: the same 64-position prefix, then 8 of its own. */
    CHECK_EQ_INT(append(kv, T1, 2, 0, 64, 8, true, &r), KVS_OK);
    CHECK_EQ_INT((int)r.n_past, 72);
    CHECK_EQ_INT(stats(kv).prefix_hits, 1);
    CHECK_EQ_INT(stats(kv).prefix_positions, 64);
    /* Exactly one more block: the shared four are charged once, to the tenant too. */
    CHECK_EQ_INT(stats(kv).bytes_used, 6u * BLOCK);
    uint32_t sessions = 0;
    uint64_t bytes = 0;
    kv_tenant_usage(kv, T1, &sessions, &bytes);
    CHECK_EQ_INT(bytes, 6u * BLOCK);
    for (uint32_t i = 0; i < 4; i++) CHECK_EQ_INT((int)block_of(kv, 2, i), (int)block_of(kv, 1, i));
    CHECK(block_of(kv, 2, 4) != block_of(kv, 1, 4));
    CHECK(read_k(kv, 2, 37) == marker(0, 37)); /* read through the shared block */
    /* Session 3 computes the prefix itself (no skip): its commit swaps in the keyed blocks. */
    CHECK_EQ_INT(append(kv, T1, 3, 0, 0, 70, true, &r), KVS_OK);
    CHECK_EQ_INT(stats(kv).prefix_dedups, 4);
    CHECK_EQ_INT(stats(kv).bytes_used, 7u * BLOCK);
    for (uint32_t i = 0; i < 4; i++) CHECK_EQ_INT((int)block_of(kv, 3, i), (int)block_of(kv, 1, i));
    /* Releases: each shared block goes when its last holder does, into the cache. */
    release(kv, 1);
    CHECK_EQ_INT(stats(kv).bytes_used, 6u * BLOCK);
    CHECK_EQ_INT(stats(kv).cached_blocks, 0);
    release(kv, 2);
    release(kv, 3);
    CHECK_EQ_INT(stats(kv).cached_blocks, 4);
    CHECK_EQ_INT(stats(kv).cached_bytes, 4u * BLOCK);
    CHECK_EQ_INT(stats(kv).bytes_used, 0); /* sessions' bytes; the cache is inside the budget */
    CHECK_EQ_INT(stats(kv).blocks_free, 64 - 4);
    kv_tenant_usage(kv, T1, &sessions, &bytes);
    CHECK_EQ_INT(bytes, 0);
    /* A new session on the cached prefix takes it back from the cache. */
    CHECK_EQ_INT(append(kv, T1, 4, 0, 64, 1, true, &r), KVS_OK);
    CHECK_EQ_INT((int)r.prefix, 64);
    CHECK_EQ_INT(stats(kv).cached_blocks, 0);
    CHECK_EQ_INT(stats(kv).bytes_used, 5u * BLOCK);
    CHECK(read_k(kv, 4, 63) == marker(0, 63));
    kv_free(kv);
}

/* Misses: part of the prefix cached answers CACHE_MISS(have) with nothing changed; no hashes
 * (an old client) is today's CACHE_MISS(0); another tenant never sees the blocks. */
static void test_misses_and_isolation(void) {
    kv_state *kv = make_pool(64);
    kv_reply r;
    CHECK_EQ_INT(append(kv, T1, 1, 0, 0, 32, true, &r), KVS_OK); /* blocks 0, 1 keyed */
    kv_stats before = stats(kv);
    CHECK_EQ_INT(append(kv, T1, 2, 0, 64, 4, true, &r), KVS_ERR_CACHE_MISS);
    CHECK_EQ_INT((int)r.have, 32);
    CHECK_EQ_INT(append(kv, T1, 2, 0, 64, 4, false, &r), KVS_ERR_CACHE_MISS);
    CHECK_EQ_INT((int)r.have, 0);
    CHECK_EQ_INT(append(kv, T1, 2, 0, 24, 4, true, &r), KVS_ERR_CACHE_MISS); /* not at a block edge */
    CHECK_EQ_INT((int)r.have, 16);
    CHECK_EQ_INT(stats(kv).bytes_used, before.bytes_used);
    CHECK_EQ_INT(append(kv, T1, 2, 0, 32, 4, true, &r), KVS_OK);
    /* Tenant 2, same hashes: a miss, and computed from 0 its blocks are its own. */
    CHECK_EQ_INT(append(kv, T2, 3, 0, 32, 4, true, &r), KVS_ERR_CACHE_MISS);
    CHECK_EQ_INT((int)r.have, 0);
    CHECK_EQ_INT(append(kv, T2, 3, 0, 0, 36, true, &r), KVS_OK);
    for (uint32_t i = 0; i < 2; i++) CHECK(block_of(kv, 3, i) != block_of(kv, 1, i));
    CHECK_EQ_INT(stats(kv).prefix_dedups, 0);
    uint64_t b1 = 0, b2 = 0;
    kv_tenant_usage(kv, T1, NULL, &b1);
    kv_tenant_usage(kv, T2, NULL, &b2);
    CHECK_EQ_INT(b1, 3u * BLOCK); /* 2 shared + session 2's own partial one */
    CHECK_EQ_INT(b2, 3u * BLOCK);
    /* Released, tenant 1's blocks are cached; tenant 2 still cannot take them. */
    release(kv, 1);
    release(kv, 2);
    CHECK_EQ_INT(append(kv, T2, 4, 0, 32, 1, true, &r), KVS_OK); /* its own (session 3's) blocks */
    CHECK_EQ_INT((int)block_of(kv, 4, 0), (int)block_of(kv, 3, 0));
    CHECK_EQ_INT(stats(kv).cached_blocks, 2); /* tenant 1's, untouched */
    kv_free(kv);
}

/* The cache is evicted (LRU) before any live session; then sessions, LRU. */
static void test_eviction_order(void) {
    kv_state *kv = make_pool(8);
    kv_reply r;
    CHECK_EQ_INT(append(kv, T1, 1, 0, 0, 32, true, &r), KVS_OK); /* family 0: 2 blocks */
    CHECK_EQ_INT(append(kv, T1, 2, 1, 0, 32, true, &r), KVS_OK); /* family 1: 2 blocks */
    release(kv, 1);                                               /* family 0 cached first (older) */
    release(kv, 2);
    CHECK_EQ_INT(stats(kv).cached_blocks, 4);
    CHECK_EQ_INT(append(kv, T1, 3, 2, 0, 16, false, &r), KVS_OK); /* a live idle session: 1 block */
    /* 3 free blocks; a session of 5 takes 2 cached blocks — family 0's, the least recent. */
    CHECK_EQ_INT(append(kv, T1, 4, 2, 0, 80, false, &r), KVS_OK);
    CHECK_EQ_INT(stats(kv).prefix_evictions, 2);
    CHECK_EQ_INT(stats(kv).evict_lru, 0);
    CHECK_EQ_INT(append(kv, T1, 5, 0, 16, 1, true, &r), KVS_ERR_CACHE_MISS); /* family 0 gone */
    CHECK_EQ_INT(append(kv, T1, 6, 1, 16, 1, true, &r), KVS_OK);            /* family 1 still there */
    release(kv, 6);
    /* Now 2 cached blocks, session 3 idle (1), session 4 idle (5): 3 more blocks take the cache
     * first, then session 3 (the least recently used). */
    CHECK_EQ_INT(append(kv, T1, 7, 2, 0, 48, false, &r), KVS_OK);
    CHECK_EQ_INT(stats(kv).prefix_evictions, 4);
    CHECK_EQ_INT(stats(kv).evict_lru, 1);
    kv_sid s3 = sid_of(3), s4 = sid_of(4);
    CHECK_EQ_INT(kv_lookup(kv, &s3, NULL, NULL), KVS_ERR_NOT_FOUND);
    CHECK_EQ_INT(kv_lookup(kv, &s4, NULL, NULL), KVS_OK);
    CHECK_EQ_INT(stats(kv).bytes_used, 8u * BLOCK);
    kv_free(kv);
}

/* A keyed block is read-only: a session that truncates into a shared block and appends other
 * tokens writes a copy; an adopting begin that is aborted or refused changes nothing. */
static void test_cow_and_abort(void) {
    kv_state *kv = make_pool(16);
    kv_reply r;
    CHECK_EQ_INT(append(kv, T1, 1, 0, 0, 64, true, &r), KVS_OK);
    CHECK_EQ_INT(append(kv, T1, 2, 0, 64, 1, true, &r), KVS_OK);
    kv_sid s2 = sid_of(2);
    CHECK_EQ_INT(kv_truncate(kv, &s2, 1, 40, &r), KVS_OK);
    CHECK_KV(kv);
    CHECK_EQ_INT(append(kv, T1, 2, 1, 40, 8, false, &r), KVS_OK); /* other tokens at 40.. */
    CHECK(read_k(kv, 1, 41) == marker(0, 41));                     /* session 1 untouched */
    CHECK(read_k(kv, 2, 41) == marker(1, 41));
    CHECK(read_k(kv, 2, 39) == marker(0, 39)); /* the copy kept the live slots */
    CHECK(block_of(kv, 2, 2) != block_of(kv, 1, 2));
    CHECK_EQ_INT((int)block_of(kv, 2, 1), (int)block_of(kv, 1, 1));
    /* Abort of an adopting begin: the blocks go back where they were. */
    release(kv, 1);
    release(kv, 2);
    kv_stats before = stats(kv);
    kv_sid s3 = sid_of(3);
    kv_prefix px = {.hashes = hashes_of[0], .first = 0, .n = 4};
    kv_txn *t = NULL;
    CHECK_EQ_INT(kv_begin_prefix(kv, T1, &s3, 1, 64, 1, NULL, &px, &t, &r), KVS_OK);
    CHECK_KV(kv);
    CHECK_EQ_INT(stats(kv).cached_blocks, before.cached_blocks - 4);
    kv_abort(kv, t, true);
    CHECK_KV(kv);
    CHECK_EQ_INT(stats(kv).cached_blocks, before.cached_blocks);
    CHECK_EQ_INT(stats(kv).bytes_used, before.bytes_used);
    CHECK_EQ_INT(kv_lookup(kv, &s3, NULL, NULL), KVS_ERR_NOT_FOUND);
    /* Injected allocation failures at every counted allocation leave everything as it was. */
    for (int k = 1; k <= 6; k++) {
        kv_inject_alloc_failure(kv, k);
        int err = kv_begin_prefix(kv, T1, &s3, 1, 64, 20, NULL, &px, &t, &r);
        kv_inject_alloc_failure(kv, 0);
        CHECK_KV(kv);
        if (err == KVS_OK) {
            kv_abort(kv, t, false);
        } else {
            CHECK_EQ_INT(err, KVS_ERR_NOMEM);
        }
        CHECK_EQ_INT(stats(kv).cached_blocks, before.cached_blocks);
        CHECK_EQ_INT(stats(kv).bytes_used, before.bytes_used);
    }
    kv_free(kv);
}

/* 32 sessions with a common 1,024-position prefix and 64 positions each hold the prefix once:
 * exactly 64 + 32 x 4 blocks (the goal's arithmetic, positions a multiple of 16). */
static void test_many_sessions(void) {
    kv_state *kv = make_pool(256);
    static uint64_t h[68];
    for (int i = 0; i < 64; i++) h[i] = 0xABCD0000ull + (uint64_t)i;
    kv_reply r;
    for (int k = 0; k < 32; k++) {
        kv_sid s = sid_of(100 + k);
        for (int i = 64; i < 68; i++) h[i] = 0x55550000ull + (uint64_t)k * 100u + (uint64_t)i; /* own tail */
        kv_prefix px = {.hashes = h, .first = 0, .n = 68};
        kv_txn *t = NULL;
        uint32_t start = k == 0 ? 0 : 1024;
        CHECK_EQ_INT(kv_begin_prefix(kv, T1, &s, 1, start, 1088 - start, NULL, &px, &t, &r), KVS_OK);
        CHECK_EQ_INT((int)r.prefix, (int)start);
        kv_commit(kv, t, &r);
    }
    CHECK_KV(kv);
    CHECK_EQ_INT(stats(kv).bytes_used, (64u + 32u * 4u) * BLOCK);
    CHECK_EQ_INT(stats(kv).prefix_hits, 31);
    kv_free(kv);
}


/* ---- over the wire ---------------------------------------------------------------------------- */

typedef struct {
    srv *s;
    pthread_t th;
} shard;

static void *serve_main(void *p) {
    srv_run(((shard *)p)->s);
    return NULL;
}

static bool shard_start(shard *sh, const char *model_path, uint32_t first, uint32_t last) {
    srv_params p = srv_default_params();
    p.model_path = model_path;
    p.first = first;
    p.last = last;
    p.listen = "127.0.0.1:0";
    p.n_threads = 1;
    p.kv_budget_bytes = 4u << 20;
    char msg[KVS_MSG_MAX] = "";
    if (srv_create(&p, &sh->s, msg, sizeof msg) != KVS_OK) {
        fprintf(stderr, "srv_create: %s\n", msg);
        sh->s = NULL;
        return false;
    }
    pthread_create(&sh->th, NULL, serve_main, sh);
    return true;
}

static void shard_stop(shard *sh) {
    if (!sh->s) return;
    srv_stop(sh->s);
    pthread_join(sh->th, NULL);
    srv_free(sh->s);
}

static uint64_t srv_stat(shard *sh, const char *name) {
    static struct wire_stats_reply m;
    srv_stats(sh->s, &m);
    for (uint32_t i = 0; i < m.n_stats; i++)
        if (!strcmp(m.stats[i].name, name)) return m.stats[i].value;
    fprintf(stderr, "no stat %s\n", name);
    return UINT64_MAX;
}

enum { N_COMMON = 64, N_OWN = 8, N_DECODE = 3, N_VOC = 512, N_SESS = 3 };

/* Session k's tokens: the common prefix, then its own. */
static void tokens_of(int k, int32_t *t) {
    for (int i = 0; i < N_COMMON; i++) t[i] = (i * 7 + 3) % N_VOC;
    for (int i = N_COMMON; i < N_COMMON + N_OWN + N_DECODE; i++) t[i] = (i * 13 + k * 31 + 5) % N_VOC;
}

/* Reference logits of session k, (1 + N_DECODE) x N_VOC: a local run of the whole model. */
static void reference(engine *e, int k, float *out) {
    int32_t t[N_COMMON + N_OWN + N_DECODE];
    tokens_of(k, t);
    kv_sid sid = sid_of(500 + k);
    engine_req q = {.sid = sid, .epoch = 1, .start_pos = 0, .n = N_COMMON + N_OWN, .tokens = t,
                    .out_mode = FWD_OUT_LOGITS_LAST, .out = out};
    CHECK_EQ_INT(engine_step(e, &q, 1), KVS_OK);
    CHECK_EQ_INT(q.status, KVS_OK);
    for (int i = 0; i < N_DECODE; i++) {
        q.start_pos = N_COMMON + N_OWN + (uint32_t)i;
        q.n = 1;
        q.tokens = t + q.start_pos;
        q.out = out + (size_t)(i + 1) * N_VOC;
        CHECK_EQ_INT(engine_step(e, &q, 1), KVS_OK);
    }
}

/* Session k through route r: the prompt, then N_DECODE steps; *cached: positions of the prompt
 * step no hop computed. The session is released. */
static uint64_t g_salt; /* route_session_prefix_salt of the sessions drive opens */
static void drive(route *r, int k, float *out, uint32_t *cached) {
    int32_t t[N_COMMON + N_OWN + N_DECODE];
    tokens_of(k, t);
    char msg[KVS_MSG_MAX] = "";
    route_session *s = NULL;
    CHECK_EQ_INT(route_session_open(r, &s, msg, sizeof msg), KVS_OK);
    route_session_prefix_salt(s, g_salt);
    int rc = route_forward(r, s, t, N_COMMON + N_OWN, out, msg, sizeof msg);
    *cached = route_session_cached(s);
    for (int i = 0; !rc && i < N_DECODE; i++)
        rc = route_forward(r, s, t + N_COMMON + N_OWN + i, 1, out + (size_t)(i + 1) * N_VOC, msg, sizeof msg);
    if (rc) fprintf(stderr, "drive %d: %s\n", k, msg);
    CHECK_EQ_INT(rc, KVS_OK);
    route_release(r, s);
}

static int g_restarts; /* "starting over" events logged by the route (I8) */
static void count_restarts(void *user, const char *line) {
    (void)user;
    if (strstr(line, "starting over")) g_restarts++;
}

static route *open_route(shard *a, shard *b) {
    char spec[64];
    snprintf(spec, sizeof spec, "127.0.0.1:%u,127.0.0.1:%u", srv_port(a->s), srv_port(b->s));
    route_params rp = route_default_params();
    rp.log = count_restarts;
    route *r = NULL;
    char msg[KVS_MSG_MAX] = "";
    int rc = route_open(spec, NULL, &rp, &r, msg, sizeof msg);
    if (rc) fprintf(stderr, "route_open: %s\n", msg);
    CHECK_EQ_INT(rc, KVS_OK);
    return r;
}

/* A v2 client: answered in v2, refused the prefix block, served as before. */
static void check_old_client(shard *head) {
    int fd = -1;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(netio_connect("127.0.0.1", srv_port(head->s), netio_deadline_ms(5000), &fd, msg, sizeof msg), KVS_OK);
    struct wire_hello h = {.min_version = 1, .max_version = 2};
    uint8_t buf[1024];
    size_t len = 0;
    wire_encode_hello(&h, buf, sizeof buf, &len);
    CHECK_EQ_INT(netio_send_frame(fd, WIRE_OP_HELLO, 1, buf, len, netio_deadline_ms(5000)), KVS_OK);
    struct netio_buf b = {0};
    struct wire_header hd;
    struct wire_info info;
    CHECK_EQ_INT(netio_recv_frame(fd, &hd, &b, netio_deadline_ms(10000), msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(wire_decode_info(b.data, b.len, &info, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(info.version, 2);
    int32_t t[N_COMMON + N_OWN + N_DECODE];
    tokens_of(0, t);
    uint64_t hs[4];
    for (int i = 0; i < 4; i++) hs[i] = wire_chain_hash(i ? hs[i - 1] : 0, t + 16 * i, 16);
    for (int v = 0; v < 2; v++) { /* with the prefix block: UNSUPPORTED; without: as before */
        struct wire_forward f = {.epoch = 1, .start_pos = 0, .n_tokens = 64, .out_mode = WIRE_OUT_HIDDEN,
                                 .in_kind = WIRE_IN_TOKENS, .data = t};
        if (v == 0) {
            f.flags = WIRE_FWD_PREFIX;
            f.prefix = (struct wire_prefix){.first = 0, .n_hashes = 4, .hashes = hs};
        }
        memset(f.session_id, 0x5A, 16);
        uint8_t *fb = malloc(8192);
        CHECK_EQ_INT(wire_encode_forward(&f, fb, 8192, &len), KVS_OK);
        CHECK_EQ_INT(netio_send_frame(fd, WIRE_OP_FORWARD, 2 + (uint64_t)v, fb, len, netio_deadline_ms(5000)), KVS_OK);
        free(fb);
        CHECK_EQ_INT(netio_recv_frame(fd, &hd, &b, netio_deadline_ms(30000), msg, sizeof msg), KVS_OK);
        struct wire_forward_reply rep;
        int st = hd.op == WIRE_OP_FORWARD_REPLY && wire_decode_forward_reply(b.data, b.len, &rep, msg, sizeof msg) == KVS_OK
                     ? rep.st.status
                 : hd.op == WIRE_OP_STATUS ? KVS_ERR_UNSUPPORTED /* a STATUS reply names the refusal */
                                           : KVS_ERR_PROTOCOL;
        if (hd.op == WIRE_OP_STATUS) {
            struct wire_status_reply sr;
            st = wire_decode_status_reply(b.data, b.len, &sr, msg, sizeof msg) == KVS_OK ? sr.st.status : KVS_ERR_PROTOCOL;
        }
        CHECK_EQ_INT(st, v == 0 ? KVS_ERR_UNSUPPORTED : KVS_OK);
    }
    netio_buf_free(&b);
    close(fd);
}

static void check_route(const char *model_path) {
    shard head, tail, tail2;
    bool up = shard_start(&head, model_path, 0, 1);
    up = shard_start(&tail, model_path, 1, 2) && up;
    up = shard_start(&tail2, model_path, 1, 2) && up;
    CHECK(up);
    engine_params ep = engine_default_params();
    ep.model_path = model_path;
    ep.n_threads = 1;
    engine *e = NULL;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(engine_open(&ep, &e, msg, sizeof msg), KVS_OK);
    if (!up || !e) {
        engine_close(e);
        shard_stop(&head);
        shard_stop(&tail);
        shard_stop(&tail2);
        return;
    }
    size_t nl = (size_t)(1 + N_DECODE) * N_VOC;
    float *ref = malloc(nl * sizeof(float)), *got = malloc(nl * sizeof(float));
    route *r = open_route(&head, &tail);
    for (int k = 0; k < N_SESS; k++) {
        reference(e, k, ref);
        uint32_t cached = 99;
        drive(r, k, got, &cached);
        CHECK_EQ_INT(cached, k == 0 ? 0 : N_COMMON); /* the first computes it, the others share it */
        CHECK(memcmp(ref, got, nl * sizeof(float)) == 0);
        if (k == 0) {
            /* While session 1 runs, session 0's prefix is cached: 4 blocks on each shard. */
            CHECK_EQ_INT(srv_stat(&head, "kv.cached_blocks"), 4);
            CHECK_EQ_INT(srv_stat(&tail, "kv.cached_blocks"), 4);
        }
    }
    CHECK_EQ_INT(srv_stat(&head, "kv.prefix_hits"), N_SESS - 1);
    CHECK_EQ_INT(srv_stat(&tail, "kv.prefix_hits"), N_SESS - 1);
    CHECK_EQ_INT(srv_stat(&tail, "kv.prefix_positions"), (N_SESS - 1) * N_COMMON);
    CHECK_EQ_INT(g_restarts, 0);
    /* Another salt (a client's own tenant): the same tokens share nothing, same logits. */
    g_salt = 0x5A17;
    reference(e, 1, ref);
    uint32_t salted = 99;
    drive(r, 1, got, &salted);
    CHECK_EQ_INT(salted, 0);
    CHECK(memcmp(ref, got, nl * sizeof(float)) == 0);
    g_salt = 0;
    route_close(r);
    /* A tail that never saw the prefix: the head holds it, the tail does not; the route starts
     * over from 0 in a new epoch and the logits are still the local run's. */
    r = open_route(&head, &tail2);
    reference(e, 7, ref);
    uint32_t cached = 99;
    drive(r, 7, got, &cached);
    CHECK_EQ_INT(g_restarts, 1);
    CHECK_EQ_INT(cached, 0);
    CHECK(memcmp(ref, got, nl * sizeof(float)) == 0);
    /* The next session finds the prefix on both. */
    reference(e, 8, ref);
    drive(r, 8, got, &cached);
    CHECK_EQ_INT(cached, N_COMMON);
    CHECK_EQ_INT(g_restarts, 1);
    CHECK(memcmp(ref, got, nl * sizeof(float)) == 0);
    route_close(r);
    check_old_client(&head);
    free(ref);
    free(got);
    engine_close(e);
    shard_stop(&head);
    shard_stop(&tail);
    shard_stop(&tail2);
}

int main(void) {
    init_hashes();
    test_adopt_and_budget();
    test_misses_and_isolation();
    test_eviction_order();
    test_cow_and_abort();
    test_many_sessions();
    char dir[] = "/tmp/kvs-prefix-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char model_path[256];
    snprintf(model_path, sizeof model_path, "%s/small-q8_0.gguf", dir);
    mkmodel_params mp = mkmodel_default_params();
    mp.shape = "small";
    mp.type = QUANT_Q8_0;
    mp.n_threads = 1;
    char msg[KVS_MSG_MAX];
    CHECK_EQ_INT(mkmodel_write(model_path, mp, msg, sizeof msg), KVS_OK);
    check_route(model_path);
    unlink(model_path);
    rmdir(dir);
    return test_finish("test_kv_prefix", 1, 0);
}
