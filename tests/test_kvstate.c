/* kvstate semantics without a model: DESIGN.md §2 rule by rule, plus a
 * multi-threaded isolation check (run under TSan in CI). */
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvshard.h"
#include "kv_markers.h"
#include "kvstate.h"
#include "kvstate_impl.h" /* test_check_catches corrupts the state on purpose */
#include "quant.h"
#include "test.h"
#include "util.h"

static kv_sid sid_of(int k) {
    kv_sid s;
    memset(&s, 0, sizeof(s));
    memcpy(s.bytes, &k, sizeof(k));
    s.bytes[15] = 0xA5;
    return s;
}

/* 2 layers, 2 kv heads x 4, f32, 4 positions per block: block = 4*2*2*8*4 = 512 B. */
static kv_params small_params(uint32_t blocks) {
    kv_params p = kv_default_params();
    p.n_layers = 2;
    p.n_kv_heads = 2;
    p.head_dim = 4;
    p.block_tokens = 4;
    p.kv_type = QUANT_F32;
    p.budget_bytes = (uint64_t)blocks * 512;
    p.max_positions = 40;
    return p;
}

static kv_state *make_kv(uint32_t blocks, fake_clock *clk, uint64_t ttl_ns) {
    kv_params p = small_params(blocks);
    p.ttl_ns = ttl_ns;
    if (clk) {
        p.clock = fake_now;
        p.clock_ctx = clk;
    }
    kv_state *kv = NULL;
    char msg[KVS_MSG_MAX];
    CHECK_EQ_INT(kv_create(&p, &kv, msg, sizeof(msg)), KVS_OK);
    CHECK_EQ_INT(kv_block_bytes(kv), 512);
    return kv;
}

static const marker_shape SHAPE = {.n_layers = 2, .n_heads = 2, .head_dim = 4};

static void fill(kv_txn *t, float marker) { markers_fill(t, SHAPE, marker); }

static bool holds(kv_state *kv, kv_sid sid, uint64_t epoch, uint32_t n, float marker) {
    return markers_hold(kv, SHAPE, sid, epoch, n, marker);
}

static int append(kv_state *kv, kv_sid sid, uint64_t epoch, uint32_t start, uint32_t n, float marker, kv_reply *r) {
    return markers_append(kv, SHAPE, sid, epoch, start, n, NULL, marker, r);
}

static uint64_t used(kv_state *kv) {
    kv_stats st;
    kv_get_stats(kv, &st);
    CHECK_KV(kv);
    return st.bytes_used;
}

static void test_append_rules(void) {
    kv_state *kv = make_kv(16, NULL, 0);
    kv_sid a = sid_of(1);
    kv_reply r;
    kv_txn *t = NULL;
    /* Unknown session: only start_pos 0. */
    CHECK_EQ_INT(kv_begin(kv, &a, 1, 3, 1, NULL, &t, &r), KVS_ERR_CACHE_MISS);
    CHECK_KV(kv);
    CHECK_EQ_INT(r.have, 0);
    CHECK_EQ_INT(append(kv, a, 1, 0, 6, 100, &r), KVS_OK);
    CHECK_EQ_INT(r.n_past, 6);
    CHECK_EQ_INT(used(kv), 2 * 512);
    /* Gap: CACHE_MISS(have = n_past), nothing changes. */
    CHECK_EQ_INT(kv_begin(kv, &a, 1, 8, 1, NULL, &t, &r), KVS_ERR_CACHE_MISS);
    CHECK_KV(kv);
    CHECK_EQ_INT(r.have, 6);
    /* Decode appends. */
    CHECK_EQ_INT(append(kv, a, 1, 6, 1, 100, &r), KVS_OK);
    CHECK_EQ_INT(append(kv, a, 1, 7, 1, 100, &r), KVS_OK);
    CHECK_EQ_INT(r.n_past, 8);
    CHECK(holds(kv, a, 1, 8, 100));
    /* Rewind then abort: old positions intact (copy-on-write of the partial block). */
    CHECK_EQ_INT(kv_begin(kv, &a, 1, 5, 2, NULL, &t, &r), KVS_OK);
    CHECK_KV(kv);
    fill(t, 900);
    kv_abort(kv, t, true);
    CHECK_KV(kv);
    CHECK(holds(kv, a, 1, 8, 100));
    uint64_t epoch;
    uint32_t n_past;
    CHECK_EQ_INT(kv_lookup(kv, &a, &epoch, &n_past), KVS_OK);
    CHECK_EQ_INT(n_past, 8);
    CHECK_EQ_INT(used(kv), 2 * 512);
    /* Rewind then commit: the retried request is idempotent. */
    CHECK_EQ_INT(append(kv, a, 1, 5, 2, 100, &r), KVS_OK);
    CHECK_EQ_INT(r.n_past, 7);
    CHECK(holds(kv, a, 1, 7, 100));
    CHECK_EQ_INT(used(kv), 2 * 512);
    /* Context cap. */
    CHECK_EQ_INT(kv_begin(kv, &a, 1, 7, 34, NULL, &t, &r), KVS_ERR_CONTEXT_FULL);
    CHECK_KV(kv);
    /* Busy while pinned. */
    CHECK_EQ_INT(kv_begin(kv, &a, 1, 7, 1, NULL, &t, &r), KVS_OK);
    CHECK_KV(kv);
    kv_txn *t2 = NULL;
    CHECK_EQ_INT(kv_begin(kv, &a, 1, 7, 1, NULL, &t2, &r), KVS_ERR_BUSY);
    CHECK_KV(kv);
    CHECK(!r.pinned_short); /* the session itself is in flight: answered as is, so counted */
    CHECK_EQ_INT(kv_cancel(kv, &a), KVS_OK);
    CHECK_KV(kv);
    CHECK(kv_txn_cancelled(t));
    kv_abort(kv, t, true);
    CHECK_KV(kv);
    CHECK_EQ_INT(kv_cancel(kv, &a), KVS_ERR_NOT_FOUND);
    CHECK_KV(kv);
    kv_stats st;
    kv_get_stats(kv, &st);
    CHECK_EQ_INT(st.rewinds, 1);
    CHECK_EQ_INT(st.cancellations, 2);
    CHECK_EQ_INT(st.misses, 2);
    CHECK_EQ_INT(st.busy, 1);
    /* A request cancelled before it reached kv_begin counts as well (kv_note_cancel). */
    kv_note_cancel(kv);
    CHECK_KV(kv);
    kv_get_stats(kv, &st);
    CHECK_EQ_INT(st.cancellations, 3);
    CHECK_EQ_INT(st.busy, 1);
    kv_free(kv);
}

static void test_truncate_release(void) {
    kv_state *kv = make_kv(16, NULL, 0);
    kv_sid a = sid_of(2), b = sid_of(3);
    kv_reply r;
    uint64_t before = used(kv);
    CHECK_EQ_INT(append(kv, a, 1, 0, 10, 0, &r), KVS_OK);
    CHECK_EQ_INT(append(kv, b, 1, 0, 3, 50, &r), KVS_OK);
    CHECK_EQ_INT(used(kv), 4 * 512);
    CHECK_EQ_INT(kv_truncate(kv, &a, 1, 11, &r), KVS_ERR_INVALID_ARG);
    CHECK_KV(kv);
    CHECK_EQ_INT(kv_truncate(kv, &a, 1, 4, &r), KVS_OK);
    CHECK_KV(kv);
    CHECK_EQ_INT(used(kv), 2 * 512);
    CHECK(holds(kv, a, 1, 4, 0));
    CHECK_EQ_INT(kv_truncate(kv, &a, 0, 1, &r), KVS_ERR_STALE_EPOCH);
    CHECK_KV(kv);
    CHECK_EQ_INT(r.live_epoch, 1);
    CHECK_EQ_INT(kv_release(kv, &a, 1, &r), KVS_OK);
    CHECK_KV(kv);
    CHECK(holds(kv, b, 1, 3, 50));
    CHECK_EQ_INT(kv_release(kv, &b, 1, &r), KVS_OK);
    CHECK_KV(kv);
    CHECK_EQ_INT(used(kv), before);
    kv_txn *t = NULL;
    CHECK_EQ_INT(kv_begin(kv, &a, 1, 4, 1, NULL, &t, &r), KVS_ERR_CACHE_MISS);
    CHECK_KV(kv);
    CHECK_EQ_INT(r.have, 0);
    CHECK_EQ_INT(kv_release(kv, &a, 1, &r), KVS_ERR_CACHE_MISS);
    CHECK_KV(kv);
    kv_stats st;
    kv_get_stats(kv, &st);
    CHECK_EQ_INT(st.sessions, 0);
    CHECK_EQ_INT(st.releases, 2);
    CHECK_EQ_INT(st.blocks_free, st.blocks_total);
    kv_free(kv);
}

static void test_epochs(void) {
    kv_state *kv = make_kv(16, NULL, 0);
    kv_sid a = sid_of(4);
    kv_reply r;
    kv_txn *t = NULL;
    CHECK_EQ_INT(append(kv, a, 5, 0, 10, 0, &r), KVS_OK);
    uint32_t ids_before[8], ids_after[8];
    CHECK_EQ_INT(kv_debug_blocks(kv, &a, ids_before, 8), 3);
    /* Stale: rejected, no side effect. */
    kv_stats s0, s1;
    kv_get_stats(kv, &s0);
    CHECK_EQ_INT(kv_begin(kv, &a, 4, 10, 1, NULL, &t, &r), KVS_ERR_STALE_EPOCH);
    CHECK_KV(kv);
    CHECK_EQ_INT(r.live_epoch, 5);
    kv_get_stats(kv, &s1);
    CHECK_EQ_INT(s1.bytes_used, s0.bytes_used);
    CHECK(holds(kv, a, 5, 10, 0));
    /* Inherit (5, 8) into epoch 6: the first two blocks move, no copy. */
    kv_inherit inh = {.old_epoch = 5, .len = 8};
    CHECK_EQ_INT(kv_begin(kv, &a, 6, 8, 1, &inh, &t, &r), KVS_OK);
    CHECK_KV(kv);
    fill(t, 0);
    kv_commit(kv, t, &r);
    CHECK_KV(kv);
    CHECK_EQ_INT(r.n_past, 9);
    CHECK_EQ_INT(r.live_epoch, 6);
    CHECK_EQ_INT(kv_debug_blocks(kv, &a, ids_after, 8), 3);
    CHECK_EQ_INT(ids_after[0], ids_before[0]);
    CHECK_EQ_INT(ids_after[1], ids_before[1]);
    CHECK(holds(kv, a, 6, 9, 0));
    CHECK_EQ_INT(used(kv), 3 * 512);
    /* Old epoch now stale. */
    CHECK_EQ_INT(kv_begin(kv, &a, 5, 9, 1, NULL, &t, &r), KVS_ERR_STALE_EPOCH);
    CHECK_KV(kv);
    /* Inherit asking past what is held: CACHE_MISS(have) and nothing changes. */
    inh.old_epoch = 6;
    inh.len = 9;
    CHECK_EQ_INT(kv_begin(kv, &a, 7, 12, 1, &inh, &t, &r), KVS_ERR_CACHE_MISS);
    CHECK_KV(kv);
    CHECK_EQ_INT(r.have, 9);
    CHECK_EQ_INT(kv_lookup(kv, &a, &(uint64_t){0}, NULL), KVS_OK);
    /* Newer epoch without inherit drops the old state: only start 0 works. */
    CHECK_EQ_INT(kv_begin(kv, &a, 8, 9, 1, NULL, &t, &r), KVS_ERR_CACHE_MISS);
    CHECK_KV(kv);
    CHECK_EQ_INT(r.have, 0);
    CHECK_EQ_INT(append(kv, a, 8, 0, 2, 30, &r), KVS_OK);
    CHECK_EQ_INT(used(kv), 1 * 512);
    CHECK(holds(kv, a, 8, 2, 30));
    kv_free(kv);
}

static void test_lru_budget(void) {
    kv_state *kv = make_kv(8, NULL, 0);
    kv_sid s[4] = {sid_of(10), sid_of(11), sid_of(12), sid_of(13)};
    kv_reply r;
    kv_txn *t = NULL;
    CHECK_EQ_INT(append(kv, s[0], 1, 0, 12, 0, &r), KVS_OK); /* 3 blocks */
    CHECK_EQ_INT(append(kv, s[1], 1, 0, 12, 0, &r), KVS_OK); /* 3 blocks */
    CHECK_EQ_INT(append(kv, s[0], 1, 12, 1, 0, &r), KVS_OK); /* s0 now most recent, 4 blocks */
    CHECK_EQ_INT(used(kv), 7 * 512);
    /* s2 needs 3 blocks, 1 free: the LRU idle session (s1, 3 blocks) goes, and only it. */
    CHECK_EQ_INT(append(kv, s[2], 1, 0, 12, 0, &r), KVS_OK);
    CHECK_EQ_INT(kv_lookup(kv, &s[1], NULL, NULL), KVS_ERR_NOT_FOUND);
    CHECK_EQ_INT(kv_lookup(kv, &s[0], NULL, NULL), KVS_OK);
    CHECK_EQ_INT(used(kv), (4 + 3) * 512);
    /* Pin s0 and s2; s3 needs more than is free and nothing idle: BUDGET_EXHAUSTED, nothing changes. */
    kv_txn *p0 = NULL, *p2 = NULL;
    CHECK_EQ_INT(kv_begin(kv, &s[0], 1, 13, 1, NULL, &p0, &r), KVS_OK);
    CHECK_KV(kv);
    CHECK_EQ_INT(kv_begin(kv, &s[2], 1, 12, 1, NULL, &p2, &r), KVS_OK);
    CHECK_KV(kv);
    uint64_t u = used(kv);
    CHECK_EQ_INT(kv_begin(kv, &s[3], 1, 0, 8, NULL, &t, &r), KVS_ERR_BUDGET_EXHAUSTED);
    CHECK_KV(kv);
    CHECK_EQ_INT(u, 8 * 512); /* s0 fits its 14th position in its 4th block, s2 takes a 4th */
    CHECK_EQ_INT(used(kv), u);
    CHECK_EQ_INT(kv_lookup(kv, &s[3], NULL, NULL), KVS_ERR_NOT_FOUND);
    kv_commit(kv, p0, &r);
    CHECK_KV(kv);
    kv_commit(kv, p2, &r);
    CHECK_KV(kv);
    /* The evicted session gets CACHE_MISS(0) and can replay. */
    CHECK_EQ_INT(kv_begin(kv, &s[1], 1, 12, 1, NULL, &t, &r), KVS_ERR_CACHE_MISS);
    CHECK_KV(kv);
    CHECK_EQ_INT(r.have, 0);
    /* The pool is full: its 1 block takes the LRU idle session — s0, committed before s2. */
    CHECK_EQ_INT(append(kv, s[1], 1, 0, 4, 7, &r), KVS_OK);
    CHECK(holds(kv, s[1], 1, 4, 7));
    CHECK_EQ_INT(kv_lookup(kv, &s[0], NULL, NULL), KVS_ERR_NOT_FOUND);
    CHECK_EQ_INT(kv_lookup(kv, &s[2], NULL, NULL), KVS_OK);
    CHECK(markers_hold_range(kv, SHAPE, s[2], 1, 13, 0, 12, 0)); /* 12 was committed unwritten */
    kv_stats st;
    kv_get_stats(kv, &st);
    CHECK_EQ_INT(st.evict_lru, 2);
    CHECK_EQ_INT(st.bytes_used, (4 + 1) * 512);
    CHECK_EQ_INT(st.blocks_free, 3);
    CHECK_EQ_INT(kv_release(kv, &s[1], 1, &r), KVS_OK);
    CHECK_EQ_INT(kv_release(kv, &s[2], 1, &r), KVS_OK);
    CHECK_KV(kv);
    CHECK_EQ_INT(used(kv), 0);
    kv_free(kv);
}

/* max_sessions: a new session evicts the LRU idle one; with every session pinned it is BUSY
 * and nothing changes. */
static void test_max_sessions(void) {
    kv_params p = small_params(16);
    p.max_sessions = 2;
    kv_state *kv = NULL;
    char msg[KVS_MSG_MAX];
    CHECK_EQ_INT(kv_create(&p, &kv, msg, sizeof(msg)), KVS_OK);
    kv_sid a = sid_of(40), b = sid_of(41), c = sid_of(42);
    kv_reply r;
    kv_txn *t = NULL, *ta = NULL, *tb = NULL;
    CHECK_EQ_INT(append(kv, a, 1, 0, 4, 0, &r), KVS_OK);
    CHECK_EQ_INT(append(kv, b, 1, 0, 4, 0, &r), KVS_OK);
    CHECK_EQ_INT(append(kv, c, 1, 0, 4, 0, &r), KVS_OK); /* a is least recently used */
    CHECK_EQ_INT(kv_lookup(kv, &a, NULL, NULL), KVS_ERR_NOT_FOUND);
    CHECK_EQ_INT(kv_lookup(kv, &b, NULL, NULL), KVS_OK);
    CHECK_EQ_INT(kv_begin(kv, &b, 1, 4, 1, NULL, &tb, &r), KVS_OK);
    CHECK_KV(kv);
    CHECK_EQ_INT(kv_begin(kv, &c, 1, 4, 1, NULL, &ta, &r), KVS_OK);
    CHECK_KV(kv);
    kv_stats s0, s1;
    kv_get_stats(kv, &s0);
    CHECK_EQ_INT(kv_begin(kv, &a, 1, 0, 4, NULL, &t, &r), KVS_ERR_BUSY);
    CHECK_KV(kv);
    CHECK(r.pinned_short);
    kv_get_stats(kv, &s1);
    CHECK_EQ_INT(s1.sessions, 2);
    CHECK_EQ_INT(s1.evict_lru, s0.evict_lru);
    CHECK_EQ_INT(s1.bytes_used, s0.bytes_used);
    CHECK_EQ_INT(s1.bytes_used, 2 * 2 * 512); /* b and c: 5 positions each */
    /* A pinned_short BUSY is the caller's to retry: it counts only once the caller answers it. */
    CHECK_EQ_INT(s1.busy, 0);
    kv_note_busy(kv);
    CHECK_KV(kv);
    kv_get_stats(kv, &s1);
    CHECK_EQ_INT(s1.busy, 1);
    kv_abort(kv, tb, false);
    CHECK_KV(kv);
    kv_abort(kv, ta, false);
    CHECK_KV(kv);
    CHECK_EQ_INT(used(kv), 2 * 512); /* b and c back to 4 positions, 1 block each */
    kv_free(kv);
}

static void test_ttl(void) {
    fake_clock clk = {.now = 1000};
    kv_state *kv = make_kv(8, &clk, 100);
    kv_sid a = sid_of(20), b = sid_of(21);
    kv_reply r;
    CHECK_EQ_INT(append(kv, a, 1, 0, 4, 0, &r), KVS_OK);
    clk.now = 1050;
    CHECK_EQ_INT(append(kv, b, 1, 0, 4, 0, &r), KVS_OK);
    clk.now = 1120; /* a idle 120 > 100, b idle 70 */
    CHECK_EQ_INT(kv_sweep_ttl(kv, 10), 1);
    CHECK_KV(kv);
    CHECK_EQ_INT(kv_lookup(kv, &a, NULL, NULL), KVS_ERR_NOT_FOUND);
    CHECK_EQ_INT(kv_lookup(kv, &b, NULL, NULL), KVS_OK);
    clk.now = 1200;
    CHECK_EQ_INT(kv_sweep_ttl(kv, 10), 1);
    CHECK_KV(kv);
    kv_stats st;
    kv_get_stats(kv, &st);
    CHECK_EQ_INT(st.evict_ttl, 2);
    CHECK_EQ_INT(st.bytes_used, 0);
    CHECK_EQ_INT(st.blocks_free, 8);
    kv_free(kv);
}

static void test_alloc_failure(void) {
    kv_state *kv = make_kv(16, NULL, 0);
    kv_sid a = sid_of(30), b = sid_of(31);
    kv_reply r;
    kv_txn *t = NULL;
    CHECK_EQ_INT(append(kv, a, 1, 0, 6, 0, &r), KVS_OK);
    for (int k = 1; k <= 3; k++) {
        kv_stats s0, s1;
        kv_get_stats(kv, &s0);
        kv_inject_alloc_failure(kv, k);
        CHECK_KV(kv);
        int err = kv_begin(kv, &b, 1, 0, 4, NULL, &t, &r);
        CHECK_KV(kv);
        CHECK_EQ_INT(err, KVS_ERR_NOMEM);
        kv_get_stats(kv, &s1);
        CHECK_EQ_INT(s1.bytes_used, s0.bytes_used);
        CHECK_EQ_INT(s1.sessions, s0.sessions);
        CHECK_EQ_INT(kv_lookup(kv, &b, NULL, NULL), KVS_ERR_NOT_FOUND);
        if (k <= 2) { /* an existing session's append makes two counted allocations */
            kv_inject_alloc_failure(kv, k);
            CHECK_KV(kv);
            CHECK_EQ_INT(kv_begin(kv, &a, 1, 3, 2, NULL, &t, &r), KVS_ERR_NOMEM);
            CHECK_KV(kv);
        }
        kv_inject_alloc_failure(kv, 0);
        CHECK_KV(kv);
        CHECK(holds(kv, a, 1, 6, 0));
    }
    kv_free(kv);
}

/* Four threads, each its own session: appends, rewinds, truncates, cancels,
 * checking after every step that its positions hold only its own marker. */
typedef struct {
    kv_state *kv;
    int id;
    int failures;
} iso_arg;

static void *iso_thread(void *p) {
    iso_arg *a = p;
    kv_sid sid = sid_of(100 + a->id);
    float marker = 1000.0f * (float)(a->id + 1);
    uint32_t n_past = 0;
    uint64_t rng = (uint64_t)a->id * 7919 + 1;
    for (int it = 0; it < 300; it++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        int op = (int)((rng >> 33) % 4);
        kv_reply r;
        kv_txn *t = NULL;
        if (op == 0 || n_past == 0) {
            uint32_t n = 1 + (uint32_t)((rng >> 40) % 5);
            if (n_past + n > 40) n = 1, n_past = 0;
            int err = kv_begin(a->kv, &sid, 1, n_past, n, NULL, &t, &r);
            CHECK_KV(a->kv);
            if (err == KVS_ERR_BUDGET_EXHAUSTED || err == KVS_ERR_CACHE_MISS) { n_past = 0; continue; }
            if (err) { a->failures++; continue; }
            fill(t, marker);
            kv_commit(a->kv, t, &r);
            CHECK_KV(a->kv);
            n_past += n;
        } else if (op == 1) {
            uint32_t start = (uint32_t)((rng >> 40) % n_past);
            int err = kv_begin(a->kv, &sid, 1, start, 1, NULL, &t, &r);
            CHECK_KV(a->kv);
            if (err != KVS_OK) { n_past = 0; continue; }
            fill(t, -1.0f);
            kv_abort(a->kv, t, true);
            CHECK_KV(a->kv);
        } else if (op == 2) {
            uint32_t len = (uint32_t)((rng >> 40) % (n_past + 1));
            if (kv_truncate(a->kv, &sid, 1, len, &r) == KVS_OK) n_past = len;
            else n_past = 0;
            CHECK_KV(a->kv);
        } else {
            if (!holds(a->kv, sid, 1, n_past, marker)) {
                uint32_t np = 0;
                if (kv_lookup(a->kv, &sid, NULL, &np) == KVS_OK && np == n_past) a->failures++;
                n_past = 0; /* evicted under pressure: start over */
            }
        }
    }
    return NULL;
}

static void test_threads(void) {
    kv_state *kv = make_kv(24, NULL, 0);
    pthread_t th[4];
    iso_arg args[4];
    for (int i = 0; i < 4; i++) {
        args[i] = (iso_arg){.kv = kv, .id = i};
        pthread_create(&th[i], NULL, iso_thread, &args[i]);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        CHECK_EQ_INT(args[i].failures, 0);
    }
    CHECK_KV(kv);
    /* Exact accounting: the pool holds ceil(n_past / 4) blocks for each live session, and all of
     * it comes back on release. */
    uint64_t want = 0;
    for (int i = 0; i < 4; i++) {
        kv_sid sid = sid_of(100 + i);
        uint32_t np = 0;
        if (kv_lookup(kv, &sid, NULL, &np) == KVS_OK) want += (np + 3) / 4 * 512ull;
    }
    kv_stats st;
    kv_get_stats(kv, &st);
    CHECK_EQ_INT(st.bytes_used, want);
    for (int i = 0; i < 4; i++) {
        kv_sid sid = sid_of(100 + i);
        kv_reply r;
        kv_release(kv, &sid, 1, &r);
        CHECK_KV(kv);
    }
    kv_get_stats(kv, &st);
    CHECK_EQ_INT(st.bytes_used, 0);
    CHECK_EQ_INT(st.blocks_free, st.blocks_total);
    kv_free(kv);
}

/* True when the session holds exactly the block ids want[0..n), in order. */
static bool ids_are(kv_state *kv, kv_sid sid, const uint32_t *want, uint32_t n) {
    uint32_t ids[16];
    if (kv_debug_blocks(kv, &sid, ids, 16) != n) return false;
    for (uint32_t i = 0; i < n; i++)
        if (ids[i] != want[i]) return false;
    return true;
}

/* Ten blocks of 128 positions (16 f32 per head row): sessions of several blocks each hold their
 * own markers in every head, element, layer and K/V; released blocks come back in their order
 * (the last one freed first), so a session that takes them gets consecutive ids as from a fresh
 * pool; a rewind copies the first rows of a partial block into a fresh one. */
static void test_block_order(void) {
    kv_params p = kv_default_params();
    p.n_layers = 2;
    p.n_kv_heads = 2;
    p.head_dim = 16;
    p.block_tokens = 128;
    p.kv_type = QUANT_F32;
    const uint64_t bb = 128ull * 2 * 2 * 2 * 16 * 4; /* 64 KiB */
    p.budget_bytes = 10 * bb;
    kv_state *kv = NULL;
    char msg[KVS_MSG_MAX];
    CHECK_EQ_INT(kv_create(&p, &kv, msg, sizeof(msg)), KVS_OK);
    CHECK_EQ_INT(kv_block_bytes(kv), bb);
    const marker_shape sh = {.n_layers = 2, .n_heads = 2, .head_dim = 16};
    kv_sid a = sid_of(40), b = sid_of(41), c = sid_of(42);
    kv_reply r;
    CHECK_EQ_INT(markers_append(kv, sh, a, 1, 0, 300, NULL, 1000, &r), KVS_OK);
    CHECK_EQ_INT(markers_append(kv, sh, b, 1, 0, 500, NULL, 3000, &r), KVS_OK);
    CHECK_EQ_INT(markers_append(kv, sh, a, 1, 300, 400, NULL, 1000, &r), KVS_OK); /* the pool is full */
    CHECK(ids_are(kv, a, (const uint32_t[]){0, 1, 2, 7, 8, 9}, 6));
    CHECK(ids_are(kv, b, (const uint32_t[]){3, 4, 5, 6}, 4));
    CHECK(markers_hold(kv, sh, b, 1, 500, 3000));
    CHECK_EQ_INT(kv_release(kv, &b, 1, &r), KVS_OK);
    CHECK_KV(kv);
    CHECK_EQ_INT(markers_append(kv, sh, c, 1, 0, 200, NULL, 5000, &r), KVS_OK);
    CHECK(ids_are(kv, c, (const uint32_t[]){3, 4}, 2)); /* b's first two, in their order */
    CHECK(markers_hold(kv, sh, a, 1, 700, 1000));
    /* a back to 200 positions, then 100 more: block 1 still holds live rows past 200, so its
     * first 72 rows go to a fresh block, 5. */
    CHECK_EQ_INT(markers_append(kv, sh, a, 1, 200, 100, NULL, 1000, &r), KVS_OK);
    CHECK(ids_are(kv, a, (const uint32_t[]){0, 5, 6}, 3));
    CHECK(markers_hold(kv, sh, a, 1, 300, 1000));
    CHECK(markers_hold(kv, sh, c, 1, 200, 5000));
    kv_stats st;
    kv_get_stats(kv, &st);
    CHECK_EQ_INT(st.blocks_free, 5);
    kv_free(kv);
}

/* kv_txn_head_rows lists the rows kv_txn_k / kv_txn_v give, over a table of
 * blocks out of order (another session's in between, a copy-on-write block),
 * for lengths that end inside a block and on its edge. */
static void test_head_rows(void) {
    kv_state *kv = make_kv(16, NULL, 0);
    kv_sid a = sid_of(50), b = sid_of(51);
    kv_reply r;
    CHECK_EQ_INT(append(kv, a, 1, 0, 7, 100, &r), KVS_OK);
    CHECK_EQ_INT(append(kv, b, 1, 0, 6, 300, &r), KVS_OK);
    CHECK_EQ_INT(append(kv, a, 1, 7, 4, 100, &r), KVS_OK);
    kv_txn *t = NULL;
    CHECK_EQ_INT(kv_begin(kv, &a, 1, 11, 2, NULL, &t, &r), KVS_OK);
    CHECK_KV(kv);
    const void *k[13], *v[13];
    const uint32_t lens[] = {1, 4, 5, 11, 13};
    for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++)
        for (int l = 0; l < SHAPE.n_layers; l++)
            for (int h = 0; h < SHAPE.n_heads; h++) {
                memset(k, 0, sizeof(k));
                memset(v, 0, sizeof(v));
                kv_txn_head_rows(t, l, h, lens[i], k, v);
                for (uint32_t p = 0; p < 13; p++) {
                    CHECK(k[p] == (p < lens[i] ? kv_txn_k(t, l, p, h) : NULL));
                    CHECK(v[p] == (p < lens[i] ? kv_txn_v(t, l, p, h) : NULL));
                    if (p < lens[i] && p < 11) {
                        CHECK(((const float *)k[p])[3] == marker_at(100, p, h, 3));
                        CHECK(((const float *)v[p])[3] == marker_at(100, p, h, 3) + 0.125f);
                    }
                }
            }
    /* The layout attention relies on: in a block, a head's key rows of a layer run one after
     * another and its value rows follow them (the hardware prefetcher brings the values in
     * while the keys are walked). */
    const kv_params *kp = kv_get_params(kv);
    const size_t row = kv_block_bytes(kv) / ((size_t)kp->block_tokens * (size_t)kp->n_layers * 2 * (size_t)kp->n_kv_heads);
    for (int l = 0; l < SHAPE.n_layers; l++)
        for (int h = 0; h < SHAPE.n_heads; h++) {
            kv_txn_head_rows(t, l, h, 13, k, v);
            CHECK((const uint8_t *)v[0] == (const uint8_t *)k[0] + (size_t)kp->block_tokens * row);
            for (int p = 1; p < kp->block_tokens; p++) {
                CHECK((const uint8_t *)k[p] == (const uint8_t *)k[p - 1] + row);
                CHECK((const uint8_t *)v[p] == (const uint8_t *)v[p - 1] + row);
            }
        }
    kv_abort(kv, t, false);
    CHECK_KV(kv);
    kv_free(kv);
}

/* kv_check is not a tautology: each kind of corruption it is meant to see is reported, naming
 * its invariant; undone, the state checks clean again. */
static void expect_broken(kv_state *kv, const char *inv) {
    char msg[256] = "";
    CHECK_EQ_INT(kv_check(kv, msg, sizeof(msg)), KVS_ERR_INTERNAL);
    if (strncmp(msg, inv, strlen(inv)) != 0) fprintf(stderr, "kv_check said \"%s\", want %s\n", msg, inv);
    CHECK(strncmp(msg, inv, strlen(inv)) == 0);
}

static void test_check_catches(void) {
    kv_state *kv = make_kv(8, NULL, 0);
    kv_sid a = sid_of(60), b = sid_of(61);
    kv_reply r;
    CHECK_EQ_INT(append(kv, a, 1, 0, 6, 0, &r), KVS_OK);
    CHECK_EQ_INT(append(kv, b, 1, 0, 3, 0, &r), KVS_OK);
    CHECK_EQ_INT(kv_release(kv, &b, 1, &r), KVS_OK);
    CHECK_KV(kv);
    kv_session *s = kv->lru.lru_next; /* a, the only session */
    /* I1: a session's block also on the free stack. */
    uint32_t saved = kv->free_ids[0];
    kv->free_ids[0] = s->blocks[0];
    expect_broken(kv, "I1");
    kv->free_ids[0] = saved;
    /* I1: a block leaked (neither free nor in a table). */
    kv->n_free--;
    expect_broken(kv, "I1");
    kv->n_free++;
    /* I3: n_past that does not match the table. */
    s->n_past = 9;
    expect_broken(kv, "I3");
    s->n_past = 6;
    /* I4: an idle session off the LRU list. */
    kv->lru.lru_next = kv->lru.lru_prev = &kv->lru;
    expect_broken(kv, "I4");
    kv->lru.lru_next = kv->lru.lru_prev = s;
    /* I5: the session count. */
    kv->n_sessions++;
    expect_broken(kv, "I5");
    kv->n_sessions--;
    /* I8: the tombstone count, and an entry lost from its bucket chain. */
    kv->n_tombs++;
    expect_broken(kv, "I8");
    kv->n_tombs--;
    uint32_t h = kv_hash(&b);
    int32_t head = kv->tomb_buckets[h];
    kv->tomb_buckets[h] = KV_TOMB_NONE;
    expect_broken(kv, "I8");
    kv->tomb_buckets[h] = head;
    /* I9: a tenant's block count. */
    s->tenant->n_blocks++;
    expect_broken(kv, "I9");
    s->tenant->n_blocks--;
    CHECK_KV(kv);
    kv_free(kv);
}

/* Pages of [p, p + len) that are resident (mincore). */
static size_t resident_pages(void *p, size_t len) {
    const size_t pg = (size_t)sysconf(_SC_PAGESIZE), n = (len + pg - 1) / pg;
    unsigned char *vec = calloc(n, 1);
    size_t in = 0;
    CHECK(vec && mincore(p, len, vec) == 0);
    for (size_t i = 0; vec && i < n; i++) in += vec[i] & 1;
    free(vec);
    return in;
}

/* --kv-prefault: kvs_prefault makes a fresh no-reserve mapping resident, page by page; a pool
 * created with prefault holds sessions as any other. */
static void test_prefault(void) {
    size_t mapped = 0;
    uint8_t *m = kvs_map_big(8u << 20, true, &mapped);
    CHECK(m != NULL);
    if (!m) return;
    const size_t pages = mapped / (size_t)sysconf(_SC_PAGESIZE);
    CHECK(resident_pages(m, mapped) < pages); /* untouched anonymous memory is not all there */
    kvs_prefault(m, mapped);
    CHECK_EQ_INT(resident_pages(m, mapped), pages);
    CHECK(m[0] == 0 && m[mapped - 1] == 0);
    kvs_unmap_big(m, mapped);

    kv_params p = small_params(64);
    p.prefault = true;
    kv_state *kv = NULL;
    char msg[KVS_MSG_MAX];
    CHECK_EQ_INT(kv_create(&p, &kv, msg, sizeof(msg)), KVS_OK);
    if (!kv) return;
    kv_reply r;
    CHECK_EQ_INT(append(kv, sid_of(1), 1, 0, 9, 3.0f, &r), KVS_OK);
    CHECK(holds(kv, sid_of(1), 1, 9, 3.0f));
    CHECK_EQ_INT(kv_check(kv, msg, sizeof msg), KVS_OK);
    kv_free(kv);
}

int main(void) {
    test_append_rules();
    test_truncate_release();
    test_epochs();
    test_lru_budget();
    test_max_sessions();
    test_ttl();
    test_alloc_failure();
    test_threads();
    test_block_order();
    test_head_rows();
    test_check_catches();
    test_prefault();
    return test_finish("test_kvstate", 1, 0);
}
