/* kvstate with the pool at its budget (issue 7): a retry, a rewind, an inherit and an epoch bump
 * need only the blocks of the positions they add and never evict a neighbour; the highest epoch
 * seen survives release and eviction (bounded, aged tombstones); the session limit answers BUSY;
 * the session cap follows the budget; truncated-to-0 sessions hold no slot. No model: markers in
 * K/V stand for computed values. */
#include "kvshard.h"
#include "kv_markers.h"
#include "kvstate.h"
#include "quant.h"
#include "test.h"

static kv_sid sid_of(int k) {
    kv_sid s;
    memset(&s, 0, sizeof(s));
    memcpy(s.bytes, &k, sizeof(k));
    s.bytes[15] = 0x5A;
    return s;
}

/* 1 layer, 1 kv head x 2, f32, 4 positions per block: block = 4 * 1 * 2 * 2 * 4 = 64 B. */
static kv_params pool_params(uint32_t blocks, fake_clock *clk) {
    kv_params p = kv_default_params();
    p.n_layers = 1;
    p.n_kv_heads = 1;
    p.head_dim = 2;
    p.block_tokens = 4;
    p.kv_type = QUANT_F32;
    p.budget_bytes = (uint64_t)blocks * 64;
    p.max_positions = 1000;
    if (clk) {
        p.clock = fake_now;
        p.clock_ctx = clk;
    }
    return p;
}

static kv_state *make_pool(const kv_params *p) {
    kv_state *kv = NULL;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(kv_create(p, &kv, msg, sizeof(msg)), KVS_OK);
    if (kv) CHECK_EQ_INT(kv_block_bytes(kv), 64);
    return kv;
}

static const marker_shape SHAPE = {.n_layers = 1, .n_heads = 1, .head_dim = 2};

static void fill(kv_txn *t, float marker) { markers_fill(t, SHAPE, marker); }

/* The session is at (epoch, n) and positions [0, n) hold marker + p. */
static bool holds(kv_state *kv, kv_sid sid, uint64_t epoch, uint32_t n, float marker) {
    uint32_t n_past = 0;
    uint64_t e = 0;
    if (kv_lookup(kv, &sid, &e, &n_past) != KVS_OK || e != epoch || n_past != n) return false;
    return markers_hold(kv, SHAPE, sid, epoch, n, marker);
}

static int append(kv_state *kv, kv_sid sid, uint64_t epoch, uint32_t start, uint32_t n, const kv_inherit *inh,
                  float marker, kv_reply *r) {
    return markers_append(kv, SHAPE, sid, epoch, start, n, inh, marker, r);
}

static kv_stats stats(kv_state *kv) {
    kv_stats st;
    kv_get_stats(kv, &st);
    CHECK_KV(kv);
    return st;
}

/* The session is at (epoch, n) and positions [lo, hi) hold marker + p. */
static bool holds_range(kv_state *kv, kv_sid sid, uint64_t epoch, uint32_t n, uint32_t lo, uint32_t hi, float marker) {
    uint32_t n_past = 0;
    uint64_t e = 0;
    if (kv_lookup(kv, &sid, &e, &n_past) != KVS_OK || e != epoch || n_past != n) return false;
    return markers_hold_range(kv, SHAPE, sid, epoch, n, lo, hi, marker);
}

/* Begins (sid, epoch, start, n, inh), writes `marker` over every position it covers, then
 * cancels it (kv_cancel, kv_abort(cancelled)) or aborts it as an error would. Returns
 * kv_begin's result; the txn was in place when *in_place. */
static int write_then_abort(kv_state *kv, kv_sid sid, uint64_t epoch, uint32_t start, uint32_t n, const kv_inherit *inh,
                            float marker, bool cancel, bool *in_place) {
    kv_stats s0 = stats(kv);
    kv_txn *t = NULL;
    kv_reply r;
    int err = kv_begin(kv, &sid, epoch, start, n, inh, &t, &r);
    CHECK_KV(kv);
    if (in_place) *in_place = stats(kv).in_place == s0.in_place + 1;
    if (err) return err;
    fill(t, marker);
    if (cancel) {
        CHECK_EQ_INT(kv_cancel(kv, &sid), KVS_OK);
        CHECK(kv_txn_cancelled(t));
    }
    kv_abort(kv, t, cancel);
    CHECK_KV(kv);
    CHECK_EQ_INT(stats(kv).cancellations, s0.cancellations + (cancel ? 1 : 0));
    return KVS_OK;
}

/* Defect 1: a full pool of 2 blocks holding one session of 8 positions. Every rewrite carries new
 * markers, so a rewrite that wrote nothing (or an abort that restored nothing) shows. */
static void test_full_pool_retry(void) {
    kv_params p = pool_params(2, NULL);
    kv_state *kv = make_pool(&p);
    kv_sid a = sid_of(1);
    kv_reply r;
    CHECK_EQ_INT(append(kv, a, 1, 0, 8, NULL, 10, &r), KVS_OK);
    CHECK_EQ_INT(stats(kv).blocks_free, 0);
    CHECK(holds(kv, a, 1, 8, 10));
    /* The same request again: a rewind to 0 that adds nothing. */
    CHECK_EQ_INT(append(kv, a, 1, 0, 8, NULL, 11, &r), KVS_OK);
    CHECK_EQ_INT(r.n_past, 8);
    CHECK(holds(kv, a, 1, 8, 11));
    /* The last position again. */
    CHECK_EQ_INT(append(kv, a, 1, 7, 1, NULL, 12, &r), KVS_OK);
    CHECK_EQ_INT(r.n_past, 8);
    CHECK(holds_range(kv, a, 1, 8, 0, 7, 11));
    CHECK(holds_range(kv, a, 1, 8, 7, 8, 12));
    /* A rewind into the first block with different values. */
    CHECK_EQ_INT(append(kv, a, 1, 2, 6, NULL, 13, &r), KVS_OK);
    CHECK(holds_range(kv, a, 1, 8, 0, 2, 11));
    CHECK(holds_range(kv, a, 1, 8, 2, 8, 13));
    /* A re-route survivor: epoch 2 inheriting 7 positions of epoch 1, then the 8th. */
    kv_inherit inh = {.old_epoch = 1, .len = 7};
    CHECK_EQ_INT(append(kv, a, 2, 7, 1, &inh, 14, &r), KVS_OK);
    CHECK_EQ_INT(r.live_epoch, 2);
    CHECK(holds_range(kv, a, 2, 8, 2, 7, 13));
    CHECK(holds_range(kv, a, 2, 8, 7, 8, 14));
    /* Epoch 3 from position 0 without inherit (protocol.md §6: as for an unknown sid). */
    CHECK_EQ_INT(append(kv, a, 3, 0, 8, NULL, 20, &r), KVS_OK);
    CHECK_EQ_INT(r.live_epoch, 3);
    CHECK(holds(kv, a, 3, 8, 20));
    kv_stats st = stats(kv);
    CHECK_EQ_INT(st.bytes_used, 2 * 64);
    CHECK_EQ_INT(st.blocks_free, 0);
    CHECK_EQ_INT(st.evict_lru, 0);
    /* Aborts of in-place rewrites (issue 36, defect 3): the session is exactly as before — all 8
     * positions, epoch 3, marker 20 — whether a retry, a rewind, an inherit or an epoch bump,
     * cancelled or failed. */
    bool in_place = false;
    CHECK_EQ_INT(write_then_abort(kv, a, 3, 5, 3, NULL, 99, true, &in_place), KVS_OK);
    CHECK(in_place);
    CHECK(holds(kv, a, 3, 8, 20));
    CHECK_EQ_INT(write_then_abort(kv, a, 3, 0, 8, NULL, 98, false, &in_place), KVS_OK);
    CHECK(in_place);
    CHECK(holds(kv, a, 3, 8, 20));
    inh = (kv_inherit){.old_epoch = 3, .len = 5};
    CHECK_EQ_INT(write_then_abort(kv, a, 4, 5, 3, &inh, 97, true, &in_place), KVS_OK);
    CHECK(in_place);
    CHECK(holds(kv, a, 3, 8, 20));
    CHECK_EQ_INT(write_then_abort(kv, a, 4, 0, 8, NULL, 96, true, &in_place), KVS_OK);
    CHECK(in_place);
    CHECK(holds(kv, a, 3, 8, 20));
    CHECK_EQ_INT(stats(kv).bytes_used, 2 * 64);
    /* The undo copy is a counted allocation (the third of an existing session's begin): its
     * failure is NOMEM with nothing changed. */
    for (int k = 1; k <= 3; k++) {
        kv_txn *t = NULL;
        kv_inject_alloc_failure(kv, k);
        CHECK_EQ_INT(kv_begin(kv, &a, 3, 2, 6, NULL, &t, &r), KVS_ERR_NOMEM);
        kv_inject_alloc_failure(kv, 0);
        CHECK_KV(kv);
        CHECK(holds(kv, a, 3, 8, 20));
    }
    /* A committed in-place rewrite keeps what it wrote. */
    CHECK_EQ_INT(append(kv, a, 3, 4, 4, NULL, 30, &r), KVS_OK);
    CHECK(holds_range(kv, a, 3, 8, 0, 4, 20));
    CHECK(holds_range(kv, a, 3, 8, 4, 8, 30));
    /* Growing past the pool is still refused, and changes nothing. */
    kv_txn *t = NULL;
    CHECK_EQ_INT(kv_begin(kv, &a, 3, 5, 4, NULL, &t, &r), KVS_ERR_CONTEXT_FULL);
    CHECK_KV(kv);
    CHECK_EQ_INT(kv_release(kv, &a, 3, &r), KVS_OK);
    CHECK_KV(kv);
    CHECK_EQ_INT(stats(kv).bytes_used, 0);
    CHECK_EQ_INT(stats(kv).blocks_free, 2);
    kv_free(kv);
}

/* Issue 36, defect 3: a 20-block pool holding A (58 positions, 15 blocks) and an idle neighbour B
 * (18 positions, 5 blocks, used less recently than A). A cancelled retry of A's whole prefill, an
 * aborted rewind, a cancelled INHERIT and a cancelled epoch bump each leave A exactly as before
 * (58 positions at epoch 1, its own markers) and B untouched: nothing evicted, bytes exact. */
static void test_atomic_at_budget(void) {
    kv_params p = pool_params(20, NULL);
    kv_state *kv = make_pool(&p);
    kv_sid a = sid_of(80), b = sid_of(81);
    kv_reply r;
    CHECK_EQ_INT(append(kv, b, 1, 0, 18, NULL, 50, &r), KVS_OK);
    CHECK_EQ_INT(append(kv, a, 1, 0, 58, NULL, 10, &r), KVS_OK);
    CHECK_EQ_INT(stats(kv).blocks_free, 0);
    CHECK_EQ_INT(stats(kv).bytes_used, 20 * 64);
    kv_inherit inh = {.old_epoch = 1, .len = 25};
    struct {
        uint64_t epoch;
        uint32_t start, n;
        const kv_inherit *inh;
        float marker;
        bool cancel;
    } cases[] = {
        {1, 0, 58, NULL, 99, true},  /* the retry of the whole prefill */
        {1, 25, 33, NULL, 98, false}, /* a rewind to 25, failed */
        {1, 25, 33, NULL, 95, true}, /* the same, cancelled */
        {2, 25, 33, &inh, 97, true}, /* INHERIT(1, 25) */
        {2, 0, 58, NULL, 96, true},  /* an epoch bump from 0 */
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        bool in_place = false;
        CHECK_EQ_INT(write_then_abort(kv, a, cases[i].epoch, cases[i].start, cases[i].n, cases[i].inh, cases[i].marker,
                                      cases[i].cancel, &in_place),
                     KVS_OK);
        CHECK(in_place);
        if (!holds(kv, a, 1, 58, 10)) fprintf(stderr, "case %zu: A is not as before\n", i);
        CHECK(holds(kv, a, 1, 58, 10));
        CHECK(holds(kv, b, 1, 18, 50));
        kv_stats st = stats(kv);
        CHECK_EQ_INT(st.evict_lru, 0);
        CHECK_EQ_INT(st.sessions, 2);
        CHECK_EQ_INT(st.bytes_used, 20 * 64);
        CHECK_EQ_INT(st.blocks_free, 0);
    }
    /* Committed, the rewind keeps its rows, and still evicts no one. */
    CHECK_EQ_INT(append(kv, a, 1, 25, 33, NULL, 94, &r), KVS_OK);
    CHECK(holds_range(kv, a, 1, 58, 0, 25, 10));
    CHECK(holds_range(kv, a, 1, 58, 25, 58, 94));
    CHECK(holds(kv, b, 1, 18, 50));
    CHECK_EQ_INT(stats(kv).evict_lru, 0);
    CHECK_EQ_INT(kv_release(kv, &a, 1, &r), KVS_OK);
    CHECK_EQ_INT(kv_release(kv, &b, 1, &r), KVS_OK);
    CHECK_KV(kv);
    CHECK_EQ_INT(stats(kv).bytes_used, 0);
    kv_free(kv);
}

/* Issue 36, defect 2: a cancelled begin that created its session rolls back to exactly the state
 * before it — no session, no tombstone at its epoch, the id's earlier tombstone (if any) as it was. */
static void test_cancelled_create(void) {
    fake_clock clk = {.now = 1000};
    kv_params p = pool_params(8, &clk);
    kv_state *kv = make_pool(&p);
    kv_sid x = sid_of(90), y = sid_of(91), z = sid_of(92);
    kv_reply r;
    kv_txn *t = NULL;
    /* A never-seen id at epoch 5. */
    kv_stats s0 = stats(kv);
    CHECK_EQ_INT(write_then_abort(kv, x, 5, 0, 6, NULL, 40, true, NULL), KVS_OK);
    kv_stats s1 = stats(kv);
    uint64_t e = 77;
    uint32_t np = 77;
    CHECK_EQ_INT(kv_lookup(kv, &x, &e, &np), KVS_ERR_NOT_FOUND);
    CHECK_EQ_INT(e, 77); /* untouched: the caller reports live_epoch 0, n_past 0 */
    CHECK_EQ_INT(np, 77);
    CHECK_EQ_INT(s1.tombstones, s0.tombstones);
    CHECK_EQ_INT(s1.sessions, 0);
    CHECK_EQ_INT(s1.bytes_used, 0);
    CHECK_EQ_INT(s1.cancellations, 1);
    /* Epoch 4 is not stale: nothing of epoch 5 was ever there. */
    CHECK_EQ_INT(kv_begin(kv, &x, 4, 0, 1, NULL, &t, &r), KVS_OK);
    CHECK_KV(kv);
    if (t) kv_abort(kv, t, false);
    CHECK_KV(kv);
    CHECK_EQ_INT(stats(kv).tombstones, s0.tombstones);
    /* An LRU-evicted session re-created by INHERIT(4, 0) at epoch 5, cancelled: its tombstone stays
     * at 4 — epoch 4 is accepted, epoch 3 is STALE_EPOCH(4). */
    CHECK_EQ_INT(append(kv, y, 4, 0, 12, NULL, 60, &r), KVS_OK); /* 3 blocks */
    CHECK_EQ_INT(append(kv, z, 1, 0, 32, NULL, 70, &r), KVS_OK); /* the pool: y goes */
    CHECK_EQ_INT(kv_lookup(kv, &y, NULL, NULL), KVS_ERR_NOT_FOUND);
    CHECK_EQ_INT(stats(kv).evict_lru, 1);
    CHECK_EQ_INT(kv_release(kv, &z, 1, &r), KVS_OK);
    CHECK_KV(kv);
    s0 = stats(kv);
    CHECK_EQ_INT(s0.tombstones, 2);
    kv_inherit inh = {.old_epoch = 4, .len = 0};
    CHECK_EQ_INT(write_then_abort(kv, y, 5, 0, 6, &inh, 41, true, NULL), KVS_OK);
    s1 = stats(kv);
    CHECK_EQ_INT(kv_lookup(kv, &y, NULL, NULL), KVS_ERR_NOT_FOUND);
    CHECK_EQ_INT(s1.tombstones, s0.tombstones);
    CHECK_EQ_INT(s1.bytes_used, 0);
    CHECK_EQ_INT(kv_begin(kv, &y, 3, 0, 1, NULL, &t, &r), KVS_ERR_STALE_EPOCH);
    CHECK_KV(kv);
    CHECK_EQ_INT(r.live_epoch, 4);
    CHECK_EQ_INT(kv_begin(kv, &y, 4, 0, 1, NULL, &t, &r), KVS_OK);
    CHECK_KV(kv);
    if (t) kv_abort(kv, t, true);
    CHECK_KV(kv);
    CHECK_EQ_INT(stats(kv).tombstones, s0.tombstones);
    kv_free(kv);
}

/* Issue 36, defect 4: the tombstone table bounds ids, not releases. One id churned 4,200 times
 * holds one entry, so another id's tombstone outlives it; past max_tombstones the least recently
 * recorded id is the one forgotten. */
static void test_tombstone_ids(void) {
    fake_clock clk = {.now = 1000};
    kv_params p = pool_params(4, &clk);
    kv_state *kv = make_pool(&p);
    CHECK_EQ_INT(kv_get_params(kv)->max_tombstones, 4096);
    kv_sid a = sid_of(30), b = sid_of(31);
    kv_reply r;
    kv_txn *t = NULL;
    CHECK_EQ_INT(append(kv, a, 5, 0, 2, NULL, 0, &r), KVS_OK);
    CHECK_EQ_INT(kv_release(kv, &a, 5, &r), KVS_OK);
    CHECK_KV(kv);
    for (int i = 0; i < 4200; i++) {
        clk.now++;
        CHECK_EQ_INT(append(kv, b, 1, 0, 1, NULL, 0, &r), KVS_OK);
        CHECK_EQ_INT(kv_release(kv, &b, 1, &r), KVS_OK);
        CHECK_KV(kv);
    }
    CHECK_EQ_INT(stats(kv).tombstones, 2);
    CHECK_EQ_INT(kv_begin(kv, &a, 4, 0, 1, NULL, &t, &r), KVS_ERR_STALE_EPOCH);
    CHECK_KV(kv);
    CHECK_EQ_INT(r.live_epoch, 5);
    kv_free(kv);
    /* Room for 3 ids: x, y, z recorded, x again, then w: y (the least recently recorded) goes. */
    p.max_tombstones = 3;
    kv = make_pool(&p);
    kv_sid ids[4] = {sid_of(40), sid_of(41), sid_of(42), sid_of(43)}; /* x, y, z, w */
    const int order[] = {0, 1, 2, 0, 3};
    for (int i = 0; i < 5; i++) {
        clk.now++;
        CHECK_EQ_INT(append(kv, ids[order[i]], 5, 0, 1, NULL, 0, &r), KVS_OK);
        CHECK_EQ_INT(kv_release(kv, &ids[order[i]], 5, &r), KVS_OK);
        CHECK_KV(kv);
    }
    CHECK_EQ_INT(stats(kv).tombstones, 3);
    for (int i = 0; i < 4; i++) {
        int want = i == 1 ? KVS_OK : KVS_ERR_STALE_EPOCH;
        CHECK_EQ_INT(kv_begin(kv, &ids[i], 4, 0, 1, NULL, &t, &r), want);
        CHECK_KV(kv);
        if (t) kv_abort(kv, t, false);
        t = NULL;
        CHECK_KV(kv);
    }
    kv_free(kv);
}

/* Defect 1: with an idle neighbour in a pool that has no free block, a retry, an inherit and an
 * epoch bump use the session's own blocks; the neighbour is never evicted. With free blocks the
 * rewrite is copy-on-write, so an abort leaves the session exactly as before. */
static void test_retry_spares_neighbour(void) {
    kv_params p = pool_params(3, NULL);
    kv_state *kv = make_pool(&p);
    kv_sid a = sid_of(2), b = sid_of(3);
    kv_reply r;
    CHECK_EQ_INT(append(kv, b, 1, 0, 3, NULL, 50, &r), KVS_OK); /* b: 1 block, least recently used */
    CHECK_EQ_INT(append(kv, a, 1, 0, 8, NULL, 10, &r), KVS_OK); /* a: 2 blocks; pool full */
    CHECK_EQ_INT(append(kv, a, 1, 0, 8, NULL, 10, &r), KVS_OK);
    CHECK_EQ_INT(append(kv, a, 1, 6, 2, NULL, 10, &r), KVS_OK);
    kv_inherit inh = {.old_epoch = 1, .len = 6};
    CHECK_EQ_INT(append(kv, a, 2, 6, 2, &inh, 10, &r), KVS_OK);
    CHECK_EQ_INT(append(kv, a, 3, 0, 8, NULL, 10, &r), KVS_OK);
    kv_stats st = stats(kv);
    CHECK_EQ_INT(st.evict_lru, 0);
    CHECK(holds(kv, b, 1, 3, 50));
    /* Room in the pool: b released, the rewrite is copy-on-write and an abort restores all. */
    CHECK_EQ_INT(kv_release(kv, &b, 1, &r), KVS_OK);
    CHECK_KV(kv);
    kv_txn *t = NULL;
    CHECK_EQ_INT(kv_begin(kv, &a, 3, 1, 2, NULL, &t, &r), KVS_OK);
    CHECK_KV(kv);
    if (t) {
        fill(t, 77);
        kv_abort(kv, t, true);
        CHECK_KV(kv);
    }
    uint32_t n_past = 0;
    CHECK_EQ_INT(kv_lookup(kv, &a, NULL, &n_past), KVS_OK);
    CHECK_EQ_INT(n_past, 8);
    CHECK_EQ_INT(stats(kv).bytes_used, 2 * 64);
    /* A session that grows still evicts the LRU idle neighbour, and only for the blocks it adds. */
    CHECK_EQ_INT(append(kv, b, 1, 0, 4, NULL, 50, &r), KVS_OK);      /* pool full again */
    CHECK_EQ_INT(append(kv, a, 3, 0, 9, NULL, 10, &r), KVS_OK);      /* adds 1 block: b goes */
    CHECK_EQ_INT(kv_lookup(kv, &b, NULL, NULL), KVS_ERR_NOT_FOUND);
    CHECK_EQ_INT(stats(kv).evict_lru, 1);
    kv_free(kv);
}

/* Defect 5: the highest epoch seen outlives release and eviction, within a bound and an age. */
static void test_tombstones(void) {
    fake_clock clk = {.now = 1000};
    kv_params p = pool_params(4, &clk);
    p.max_tombstones = 3;
    p.tombstone_ttl_ns = 500;
    kv_state *kv = make_pool(&p);
    kv_sid a = sid_of(10);
    kv_reply r;
    kv_txn *t = NULL;
    CHECK_EQ_INT(append(kv, a, 3, 0, 4, NULL, 0, &r), KVS_OK);
    CHECK_EQ_INT(kv_release(kv, &a, 3, &r), KVS_OK);
    CHECK_KV(kv);
    /* An older driver cannot re-create it. */
    CHECK_EQ_INT(kv_begin(kv, &a, 2, 0, 4, NULL, &t, &r), KVS_ERR_STALE_EPOCH);
    CHECK_KV(kv);
    CHECK_EQ_INT(r.live_epoch, 3);
    CHECK_EQ_INT(kv_release(kv, &a, 2, &r), KVS_ERR_STALE_EPOCH);
    CHECK_KV(kv);
    CHECK_EQ_INT(kv_truncate(kv, &a, 2, 0, &r), KVS_ERR_STALE_EPOCH);
    CHECK_KV(kv);
    /* The same epoch (or a newer one) starts over at 0. */
    CHECK_EQ_INT(kv_begin(kv, &a, 3, 2, 1, NULL, &t, &r), KVS_ERR_CACHE_MISS);
    CHECK_KV(kv);
    CHECK_EQ_INT(r.have, 0);
    CHECK_EQ_INT(append(kv, a, 3, 0, 4, NULL, 0, &r), KVS_OK);
    /* RELEASE at a newer epoch drops the old epoch's state; the old epoch is stale after it. */
    CHECK_EQ_INT(kv_release(kv, &a, 4, &r), KVS_OK);
    CHECK_KV(kv);
    CHECK_EQ_INT(stats(kv).bytes_used, 0);
    CHECK_EQ_INT(kv_begin(kv, &a, 3, 0, 1, NULL, &t, &r), KVS_ERR_STALE_EPOCH);
    CHECK_KV(kv);
    CHECK_EQ_INT(r.live_epoch, 4);
    /* TRUNCATE at a newer epoch drops it too. */
    CHECK_EQ_INT(append(kv, a, 5, 0, 4, NULL, 0, &r), KVS_OK);
    CHECK_EQ_INT(kv_truncate(kv, &a, 6, 0, &r), KVS_OK);
    CHECK_KV(kv);
    CHECK_EQ_INT(stats(kv).bytes_used, 0);
    CHECK_EQ_INT(kv_begin(kv, &a, 5, 0, 1, NULL, &t, &r), KVS_ERR_STALE_EPOCH);
    CHECK_KV(kv);
    /* A FORWARD at a newer epoch that cannot inherit drops the old state even when it misses. */
    CHECK_EQ_INT(append(kv, a, 7, 0, 4, NULL, 0, &r), KVS_OK);
    CHECK_EQ_INT(kv_begin(kv, &a, 8, 4, 1, NULL, &t, &r), KVS_ERR_CACHE_MISS);
    CHECK_KV(kv);
    CHECK_EQ_INT(r.have, 0);
    CHECK_EQ_INT(stats(kv).bytes_used, 0);
    CHECK_EQ_INT(kv_begin(kv, &a, 7, 0, 1, NULL, &t, &r), KVS_ERR_STALE_EPOCH);
    CHECK_KV(kv);
    /* Eviction (LRU) leaves a tombstone as well. */
    kv_sid b = sid_of(11), c = sid_of(12);
    CHECK_EQ_INT(append(kv, b, 9, 0, 8, NULL, 0, &r), KVS_OK);
    CHECK_EQ_INT(append(kv, c, 1, 0, 16, NULL, 0, &r), KVS_OK); /* evicts b */
    CHECK_EQ_INT(kv_lookup(kv, &b, NULL, NULL), KVS_ERR_NOT_FOUND);
    CHECK_EQ_INT(kv_begin(kv, &b, 8, 0, 1, NULL, &t, &r), KVS_ERR_STALE_EPOCH);
    CHECK_KV(kv);
    CHECK_EQ_INT(r.live_epoch, 9);
    CHECK_EQ_INT(kv_release(kv, &c, 1, &r), KVS_OK);
    CHECK_KV(kv);
    /* Aged out: past tombstone_ttl_ns an old epoch is accepted again. */
    clk.now += 501;
    CHECK_EQ_INT(append(kv, b, 8, 0, 1, NULL, 0, &r), KVS_OK);
    CHECK_EQ_INT(kv_release(kv, &b, 8, &r), KVS_OK);
    CHECK_KV(kv);
    /* Bounded: with room for 3, the oldest of 4 tombstones is forgotten. */
    for (int i = 0; i < 4; i++) {
        kv_sid s = sid_of(100 + i);
        CHECK_EQ_INT(append(kv, s, 5, 0, 1, NULL, 0, &r), KVS_OK);
        CHECK_EQ_INT(kv_release(kv, &s, 5, &r), KVS_OK);
        CHECK_KV(kv);
    }
    kv_sid s0 = sid_of(100), s3 = sid_of(103);
    CHECK_EQ_INT(kv_begin(kv, &s3, 4, 0, 1, NULL, &t, &r), KVS_ERR_STALE_EPOCH);
    CHECK_KV(kv);
    CHECK_EQ_INT(append(kv, s0, 4, 0, 1, NULL, 0, &r), KVS_OK);
    CHECK_EQ_INT(stats(kv).tombstones, 3); /* 101-103; 100 is live again */
    kv_free(kv);
}

/* Defect 6: the session limit is BUSY (retry later), the cap follows the budget, and a session
 * truncated to 0 holds no slot. */
static void test_limits(void) {
    kv_params p = pool_params(4, NULL);
    p.max_sessions = 2;
    kv_state *kv = make_pool(&p);
    CHECK_EQ_INT(kv_get_params(kv)->max_positions, 16); /* 4 blocks of 4, not 1000 */
    kv_sid a = sid_of(20), b = sid_of(21), c = sid_of(22);
    kv_reply r;
    kv_txn *ta = NULL, *tb = NULL, *t = NULL;
    CHECK_EQ_INT(append(kv, a, 1, 0, 2, NULL, 0, &r), KVS_OK);
    CHECK_EQ_INT(append(kv, b, 1, 0, 2, NULL, 0, &r), KVS_OK);
    CHECK_EQ_INT(kv_begin(kv, &a, 1, 2, 1, NULL, &ta, &r), KVS_OK);
    CHECK_KV(kv);
    CHECK_EQ_INT(kv_begin(kv, &b, 1, 2, 1, NULL, &tb, &r), KVS_OK);
    CHECK_KV(kv);
    CHECK_EQ_INT(kv_begin(kv, &c, 1, 0, 1, NULL, &t, &r), KVS_ERR_BUSY);
    CHECK_KV(kv);
    /* Issue 36, defect 6: a BUSY only because others are pinned is the caller's to retry; kv.busy
     * counts it once the caller answers it (kv_note_busy). */
    CHECK(r.pinned_short);
    CHECK_EQ_INT(stats(kv).busy, 0);
    kv_note_busy(kv);
    CHECK_EQ_INT(stats(kv).busy, 1);
    if (t) kv_abort(kv, t, false);
    CHECK_KV(kv);
    if (ta) kv_abort(kv, ta, false);
    CHECK_KV(kv);
    if (tb) kv_abort(kv, tb, false);
    CHECK_KV(kv);
    /* a truncated to 0: c fits without evicting b. */
    CHECK_EQ_INT(kv_truncate(kv, &a, 1, 0, &r), KVS_OK);
    CHECK_KV(kv);
    CHECK_EQ_INT(r.n_past, 0);
    CHECK_EQ_INT(append(kv, c, 1, 0, 1, NULL, 0, &r), KVS_OK);
    CHECK_EQ_INT(kv_lookup(kv, &b, NULL, NULL), KVS_OK);
    CHECK_EQ_INT(stats(kv).evict_lru, 0);
    CHECK_EQ_INT(stats(kv).sessions, 2);
    /* The truncated session starts over at 0 (same epoch), like a released one. */
    CHECK_EQ_INT(kv_begin(kv, &a, 1, 1, 1, NULL, &t, &r), KVS_ERR_CACHE_MISS);
    CHECK_KV(kv);
    CHECK_EQ_INT(r.have, 0);
    /* One session may use the whole pool: 16 positions fit, 17 are CONTEXT_FULL. */
    CHECK_EQ_INT(kv_begin(kv, &a, 1, 0, 17, NULL, &t, &r), KVS_ERR_CONTEXT_FULL);
    CHECK_KV(kv);
    CHECK_EQ_INT(append(kv, a, 1, 0, 16, NULL, 0, &r), KVS_OK);
    kv_free(kv);
}

/* Also test: DESIGN §2 at the limit with idle neighbours — a refused begin evicts nothing; TTL
 * never takes a pinned session, and use refreshes it; LRU takes the least recently used first. */
static void test_limit_rules(void) {
    fake_clock clk = {.now = 1000};
    kv_params p = pool_params(4, &clk);
    p.ttl_ns = 100;
    kv_state *kv = make_pool(&p);
    kv_sid n1 = sid_of(60), pin = sid_of(61), n2 = sid_of(62), c = sid_of(63);
    kv_reply r;
    kv_txn *tp = NULL, *t = NULL;
    CHECK_EQ_INT(append(kv, n1, 1, 0, 4, NULL, 0, &r), KVS_OK);  /* 1 block, idle */
    CHECK_EQ_INT(append(kv, pin, 1, 0, 8, NULL, 0, &r), KVS_OK); /* 2 blocks */
    CHECK_EQ_INT(append(kv, n2, 1, 0, 4, NULL, 0, &r), KVS_OK);  /* 1 block, idle: pool full */
    CHECK_EQ_INT(kv_begin(kv, &pin, 1, 7, 1, NULL, &tp, &r), KVS_OK); /* a rewind in place: pinned */
    CHECK_EQ_INT(stats(kv).evict_lru, 0);
    /* A new session of 16 positions: free 0 + idle 2 < 4 — refused, nothing evicted. */
    kv_stats s0 = stats(kv);
    CHECK_EQ_INT(kv_begin(kv, &c, 1, 0, 16, NULL, &t, &r), KVS_ERR_BUDGET_EXHAUSTED);
    CHECK_KV(kv);
    CHECK(r.pinned_short);
    kv_stats s1 = stats(kv);
    CHECK_EQ_INT(s1.evict_lru, s0.evict_lru);
    CHECK_EQ_INT(s1.sessions, 3);
    /* TTL: past it, the idle ones go and the pinned one stays. */
    clk.now += 150;
    CHECK_EQ_INT(kv_sweep_ttl(kv, 10), 2);
    CHECK_KV(kv);
    CHECK_EQ_INT(kv_lookup(kv, &pin, NULL, NULL), KVS_OK);
    /* Use refreshes: committed now, it survives a sweep 60 later, and goes 150 later. */
    if (tp) {
        fill(tp, 0);
        kv_commit(kv, tp, &r);
        CHECK_KV(kv);
    }
    clk.now += 60;
    CHECK_EQ_INT(kv_sweep_ttl(kv, 10), 0);
    CHECK_KV(kv);
    clk.now += 90;
    CHECK_EQ_INT(kv_sweep_ttl(kv, 10), 1);
    CHECK_KV(kv);
    /* LRU order: a, b, c idle in that order of use, then a used again; d needs one block more
     * than is free: the least recently used (b) goes. */
    kv_sid a = sid_of(70), b = sid_of(71), cc = sid_of(72), d = sid_of(73);
    CHECK_EQ_INT(append(kv, a, 1, 0, 4, NULL, 0, &r), KVS_OK);
    CHECK_EQ_INT(append(kv, b, 1, 0, 4, NULL, 0, &r), KVS_OK);
    CHECK_EQ_INT(append(kv, cc, 1, 0, 4, NULL, 0, &r), KVS_OK);
    CHECK(holds(kv, a, 1, 4, 0)); /* a request on a (even one rolled back) is a use: b is now oldest */
    CHECK_EQ_INT(append(kv, d, 1, 0, 8, NULL, 0, &r), KVS_OK);
    CHECK_EQ_INT(kv_lookup(kv, &b, NULL, NULL), KVS_ERR_NOT_FOUND);
    CHECK_EQ_INT(kv_lookup(kv, &a, NULL, NULL), KVS_OK);
    CHECK_EQ_INT(kv_lookup(kv, &cc, NULL, NULL), KVS_OK);
    kv_free(kv);
}

int main(void) {
    test_full_pool_retry();
    test_atomic_at_budget();
    test_cancelled_create();
    test_tombstone_ids();
    test_retry_spares_neighbour();
    test_tombstones();
    test_limits();
    test_limit_rules();
    return test_finish("test_kvstate_pressure", 1, 0);
}
