/* kvstate tenants (issue 10): per-tenant quotas on sessions and bytes, and fair-share eviction —
 * one tenant flooding the pool evicts its own sessions, never another's below its fair share; a
 * tenant past its quota evicts its own idle sessions first, and when they are not enough the
 * begin is refused with nothing changed. Deterministic: no clock, no threads, markers stand for
 * computed K/V. */
#include "kvshard.h"
#include "kv_markers.h"
#include "kvstate.h"
#include "quant.h"
#include "test.h"

enum { TA = 0xA, TB = 0xB };

static kv_sid sid_of(int tenant, int k) {
    kv_sid s;
    memset(&s, 0, sizeof(s));
    memcpy(s.bytes, &k, sizeof(k));
    s.bytes[14] = (uint8_t)tenant;
    s.bytes[15] = 0x7E;
    return s;
}

/* 1 layer, 1 kv head x 2, f32, 4 positions per block: block = 64 B. */
static kv_params pool_params(uint32_t blocks) {
    kv_params p = kv_default_params();
    p.n_layers = 1;
    p.n_kv_heads = 1;
    p.head_dim = 2;
    p.block_tokens = 4;
    p.kv_type = QUANT_F32;
    p.budget_bytes = (uint64_t)blocks * 64;
    p.max_positions = 1000;
    return p;
}

static kv_state *make_pool(const kv_params *p) {
    kv_state *kv = NULL;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(kv_create(p, &kv, msg, sizeof(msg)), KVS_OK);
    return kv;
}

static int append(kv_state *kv, uint64_t tenant, kv_sid sid, uint32_t start, uint32_t n, kv_reply *r) {
    kv_txn *t = NULL;
    int err = kv_begin_tenant(kv, tenant, &sid, 1, start, n, NULL, &t, r);
    CHECK_KV(kv);
    if (err) return err;
    for (uint32_t p = start; p < start + n; p++) ((float *)kv_txn_k(t, 0, p, 0))[0] = (float)p;
    kv_commit(kv, t, r);
    CHECK_KV(kv);
    return KVS_OK;
}

static bool alive(kv_state *kv, kv_sid sid, uint32_t n_past) {
    uint32_t have = 0;
    return kv_lookup(kv, &sid, NULL, &have) == KVS_OK && have == n_past;
}

static kv_stats stats(kv_state *kv) {
    kv_stats st;
    kv_get_stats(kv, &st);
    CHECK_KV(kv);
    return st;
}

static uint64_t blocks_of(kv_state *kv, uint64_t tenant, uint32_t *sessions) {
    uint64_t bytes = 0;
    kv_tenant_usage(kv, tenant, sessions, &bytes);
    return bytes / 64;
}

/* I9: the tenants' sessions and blocks add up to the pool's. */
static void check_sums(kv_state *kv, const uint64_t *tenants, int n) {
    uint64_t blocks = 0, sessions = 0;
    for (int i = 0; i < n; i++) {
        uint32_t ns = 0;
        blocks += blocks_of(kv, tenants[i], &ns);
        sessions += ns;
    }
    kv_stats st = stats(kv);
    CHECK_EQ_INT(blocks, st.blocks_total - st.blocks_free);
    CHECK_EQ_INT(sessions, st.sessions);
}

/* Tenant A floods an 8-block pool with 1-block sessions after B made 2: plain LRU would evict
 * B's (the oldest); with fair shares (8 / 2 tenants = 4 blocks) A evicts only its own. */
static void test_flood_spares_other_tenant(void) {
    kv_params p = pool_params(8);
    kv_state *kv = make_pool(&p);
    if (!kv) return;
    kv_reply r;
    CHECK_EQ_INT(append(kv, TB, sid_of(TB, 0), 0, 4, &r), KVS_OK);
    CHECK_EQ_INT(append(kv, TB, sid_of(TB, 1), 0, 4, &r), KVS_OK);
    for (int i = 0; i < 20; i++) CHECK_EQ_INT(append(kv, TA, sid_of(TA, i), 0, 4, &r), KVS_OK);
    CHECK(alive(kv, sid_of(TB, 0), 4));
    CHECK(alive(kv, sid_of(TB, 1), 4));
    uint32_t na = 0, nb = 0;
    CHECK_EQ_INT(blocks_of(kv, TA, &na), 6);
    CHECK_EQ_INT(na, 6);
    CHECK_EQ_INT(blocks_of(kv, TB, &nb), 2);
    CHECK_EQ_INT(nb, 2);
    for (int i = 14; i < 20; i++) CHECK(alive(kv, sid_of(TA, i), 4)); /* A's newest stay: LRU within A */
    kv_stats st = stats(kv);
    CHECK_EQ_INT(st.evict_lru, 14);
    CHECK_EQ_INT(st.evict_quota, 0);
    CHECK_EQ_INT(st.tenants, 2);
    uint64_t ts[] = {TA, TB};
    check_sums(kv, ts, 2);
    /* A single tenant 0 (kv_begin) is plain LRU over the whole pool. */
    kv_free(kv);
    kv = make_pool(&p);
    if (!kv) return;
    for (int i = 0; i < 10; i++) {
        kv_sid sid = sid_of(0, i);
        kv_txn *t = NULL;
        CHECK_EQ_INT(kv_begin(kv, &sid, 1, 0, 4, NULL, &t, &r), KVS_OK);
        CHECK_KV(kv);
        if (t) kv_commit(kv, t, &r);
        CHECK_KV(kv);
    }
    CHECK(!alive(kv, sid_of(0, 1), 4));
    CHECK(alive(kv, sid_of(0, 2), 4));
    CHECK_EQ_INT(stats(kv).evict_lru, 2);
    kv_free(kv);
}

/* A alone may fill the pool; B arriving takes A down to its fair share, not below, and what B
 * cannot fit then is refused with nothing evicted. */
static void test_newcomer_reclaims_fair_share(void) {
    kv_params p = pool_params(8);
    kv_state *kv = make_pool(&p);
    if (!kv) return;
    kv_reply r;
    for (int i = 0; i < 8; i++) CHECK_EQ_INT(append(kv, TA, sid_of(TA, i), 0, 4, &r), KVS_OK);
    CHECK_EQ_INT(stats(kv).blocks_free, 0);
    /* B: 3 blocks; A holds 8 > 4, its 3 oldest go. */
    CHECK_EQ_INT(append(kv, TB, sid_of(TB, 0), 0, 12, &r), KVS_OK);
    for (int i = 0; i < 3; i++) CHECK(!alive(kv, sid_of(TA, i), 4));
    CHECK_EQ_INT(blocks_of(kv, TA, NULL), 5);
    /* B wants 2 more: A may lose one (5 > 4), not two; B has no other idle session: refused. */
    kv_stats before = stats(kv);
    CHECK_EQ_INT(append(kv, TB, sid_of(TB, 0), 12, 8, &r), KVS_ERR_BUDGET_EXHAUSTED);
    CHECK(!r.over_quota);
    kv_stats after = stats(kv);
    CHECK_EQ_INT(after.evict_lru, before.evict_lru);
    CHECK_EQ_INT(after.sessions, before.sessions);
    CHECK_EQ_INT(blocks_of(kv, TA, NULL), 5);
    CHECK(alive(kv, sid_of(TB, 0), 12));
    /* One more block fits: A goes to exactly its fair share. */
    CHECK_EQ_INT(append(kv, TB, sid_of(TB, 0), 12, 4, &r), KVS_OK);
    CHECK_EQ_INT(blocks_of(kv, TA, NULL), 4);
    CHECK_EQ_INT(blocks_of(kv, TB, NULL), 4);
    CHECK(!alive(kv, sid_of(TA, 3), 4));
    CHECK(alive(kv, sid_of(TA, 4), 4));
    uint64_t ts[] = {TA, TB};
    check_sums(kv, ts, 2);
    kv_free(kv);
}

/* tenant_max_sessions 2, tenant_max_bytes 3 blocks: the tenant evicts its own idle sessions,
 * LRU first, to stay within them; past them with nothing of its own idle: refused, unchanged. */
static void test_quota(void) {
    kv_params p = pool_params(16);
    p.tenant_max_sessions = 2;
    p.tenant_max_bytes = 3 * 64 + 10; /* rounds down to 3 blocks */
    kv_state *kv = make_pool(&p);
    if (!kv) return;
    kv_reply r;
    CHECK_EQ_INT(append(kv, TB, sid_of(TB, 0), 0, 4, &r), KVS_OK);
    CHECK_EQ_INT(append(kv, TA, sid_of(TA, 0), 0, 4, &r), KVS_OK);
    CHECK_EQ_INT(append(kv, TA, sid_of(TA, 1), 0, 4, &r), KVS_OK);
    CHECK_EQ_INT(append(kv, TA, sid_of(TA, 2), 0, 4, &r), KVS_OK); /* 3rd session: A's oldest goes */
    CHECK(!alive(kv, sid_of(TA, 0), 4));
    CHECK(alive(kv, sid_of(TA, 1), 4));
    CHECK(alive(kv, sid_of(TB, 0), 4)); /* older, but another tenant's: untouched */
    CHECK_EQ_INT(stats(kv).evict_quota, 1);
    /* A grows session 2 to 3 blocks (2 + 2 > 3): its idle session 1 goes. */
    CHECK_EQ_INT(append(kv, TA, sid_of(TA, 2), 4, 8, &r), KVS_OK);
    CHECK(!alive(kv, sid_of(TA, 1), 4));
    CHECK_EQ_INT(stats(kv).evict_quota, 2);
    /* One more block: nothing of A's idle is left; refused though the pool has 12 free. */
    kv_stats before = stats(kv);
    CHECK_EQ_INT(append(kv, TA, sid_of(TA, 2), 12, 4, &r), KVS_ERR_BUDGET_EXHAUSTED);
    CHECK(r.over_quota);
    CHECK(!r.pinned_short);
    kv_stats after = stats(kv);
    CHECK_EQ_INT(after.quota_refusals, 1);
    CHECK_EQ_INT(after.evict_lru, before.evict_lru);
    CHECK_EQ_INT(after.blocks_free, before.blocks_free);
    CHECK(alive(kv, sid_of(TA, 2), 12));
    /* A rewind of A's full session fits in place (no new blocks past the quota). */
    CHECK_EQ_INT(append(kv, TA, sid_of(TA, 2), 4, 8, &r), KVS_OK);
    CHECK_EQ_INT(blocks_of(kv, TA, NULL), 3);
    /* Session quota with both of A's sessions pinned: BUSY, over_quota, pinned_short. */
    kv_sid a2 = sid_of(TA, 2), a3 = sid_of(TA, 3), a4 = sid_of(TA, 4);
    CHECK_EQ_INT(kv_truncate(kv, &a2, 1, 3, &r), KVS_OK);
    CHECK_KV(kv);
    kv_txn *t2 = NULL, *t3 = NULL, *t4 = NULL;
    CHECK_EQ_INT(kv_begin_tenant(kv, TA, &a2, 1, 3, 1, NULL, &t2, &r), KVS_OK); /* no new block */
    CHECK_KV(kv);
    CHECK_EQ_INT(kv_begin_tenant(kv, TA, &a3, 1, 0, 1, NULL, &t3, &r), KVS_OK);
    CHECK_KV(kv);
    CHECK_EQ_INT(kv_begin_tenant(kv, TA, &a4, 1, 0, 1, NULL, &t4, &r), KVS_ERR_BUSY);
    CHECK_KV(kv);
    CHECK(r.over_quota);
    CHECK(r.pinned_short);
    CHECK(t4 == NULL);
    CHECK_EQ_INT(stats(kv).busy, 0); /* pinned_short: the caller's to retry (kv_note_busy) */
    /* B is not held by A's quota. */
    CHECK_EQ_INT(append(kv, TB, sid_of(TB, 1), 0, 8, &r), KVS_OK);
    if (t2) kv_abort(kv, t2, false);
    CHECK_KV(kv);
    if (t3) kv_abort(kv, t3, false);
    CHECK_KV(kv);
    CHECK_EQ_INT(blocks_of(kv, TA, NULL), 1);
    uint64_t ts[] = {TA, TB};
    check_sums(kv, ts, 2);
    kv_free(kv);
}

/* max_sessions 4: A flooding new sessions takes slots from its own, not from B (1 <= 4 / 2). */
static void test_session_slots_fair(void) {
    kv_params p = pool_params(64);
    p.max_sessions = 4;
    kv_state *kv = make_pool(&p);
    if (!kv) return;
    kv_reply r;
    CHECK_EQ_INT(append(kv, TB, sid_of(TB, 0), 0, 4, &r), KVS_OK);
    for (int i = 0; i < 10; i++) CHECK_EQ_INT(append(kv, TA, sid_of(TA, i), 0, 4, &r), KVS_OK);
    CHECK(alive(kv, sid_of(TB, 0), 4));
    uint32_t na = 0;
    blocks_of(kv, TA, &na);
    CHECK_EQ_INT(na, 3);
    CHECK_EQ_INT(stats(kv).sessions, 4);
    /* B's second session may take A down to 2 slots (3 > 4 / 2). */
    CHECK_EQ_INT(append(kv, TB, sid_of(TB, 1), 0, 4, &r), KVS_OK);
    blocks_of(kv, TA, &na);
    CHECK_EQ_INT(na, 2);
    /* A third: A at 2 is not over its share; B (2 of 4 slots, not over either) pays itself. */
    CHECK_EQ_INT(append(kv, TB, sid_of(TB, 2), 0, 4, &r), KVS_OK);
    blocks_of(kv, TA, &na);
    CHECK_EQ_INT(na, 2);
    CHECK(!alive(kv, sid_of(TB, 0), 4));
    CHECK(alive(kv, sid_of(TB, 1), 4));
    kv_free(kv);
}

/* The tenant record is a counted allocation: its failure is NOMEM with nothing changed, and a
 * tenant whose sessions are all gone holds no record. */
static void test_tenant_records(void) {
    kv_params p = pool_params(8);
    kv_state *kv = make_pool(&p);
    if (!kv) return;
    kv_reply r;
    kv_inject_alloc_failure(kv, 1);
    CHECK_KV(kv);
    CHECK_EQ_INT(append(kv, TA, sid_of(TA, 0), 0, 4, &r), KVS_ERR_NOMEM);
    CHECK_EQ_INT(stats(kv).tenants, 0);
    CHECK_EQ_INT(stats(kv).sessions, 0);
    CHECK_EQ_INT(append(kv, TA, sid_of(TA, 0), 0, 4, &r), KVS_OK);
    CHECK_EQ_INT(append(kv, TB, sid_of(TB, 0), 0, 4, &r), KVS_OK);
    CHECK_EQ_INT(stats(kv).tenants, 2);
    kv_sid a0 = sid_of(TA, 0);
    CHECK_EQ_INT(kv_release(kv, &a0, 1, &r), KVS_OK);
    CHECK_KV(kv);
    CHECK_EQ_INT(stats(kv).tenants, 1);
    /* A refused begin of a new tenant leaves no record. */
    CHECK_EQ_INT(append(kv, TA, sid_of(TA, 1), 0, 32, &r), KVS_ERR_BUDGET_EXHAUSTED);
    CHECK_EQ_INT(stats(kv).tenants, 1);
    uint32_t ns = 7;
    CHECK_EQ_INT(blocks_of(kv, TA, &ns), 0);
    CHECK_EQ_INT(ns, 0);
    kv_free(kv);
}

int main(void) {
    test_flood_spares_other_tenant();
    test_newcomer_reclaims_fair_share();
    test_quota();
    test_session_slots_fair();
    test_tenant_records();
    return test_finish("test_kvstate_tenants", 1, 0);
}
