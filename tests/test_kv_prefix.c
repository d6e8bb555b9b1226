/* kvstate shared prefix blocks (issue 40 part 2, kvstate.c I10): full blocks keyed by (tenant,
 * chain hash) are shared between sessions of one tenant and charged once; a new session takes
 * them instead of computing them; released sessions leave them as a prefix cache inside the
 * budget, evicted before any live session; tenants never share; a keyed block is never written.
 * Deterministic: no clock, no threads; a position's K holds a marker standing for computed K/V. */
#include "kvshard.h"
#include "kv_markers.h"
#include "kvstate.h"
#include "quant.h"
#include "test.h"

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
    CHECK_EQ_INT(stats(kv).bytes_used, 4u * BLOCK); /* inside the budget, counted */
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

int main(void) {
    init_hashes();
    test_adopt_and_budget();
    test_misses_and_isolation();
    test_eviction_order();
    test_cow_and_abort();
    test_many_sessions();
    return test_finish("test_kv_prefix", 1, 0);
}
