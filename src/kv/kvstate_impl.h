/*
 * kvstate_impl — the private structures of kvstate (kvstate.c: the operations and the design
 * notes with invariants I1-I10; kvstate_check.c: kv_check, which verifies them). Not for use
 * outside src/kv/.
 */
#ifndef KVS_KVSTATE_IMPL_H
#define KVS_KVSTATE_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "kvstate.h"

#define KV_HASH_BUCKETS 4096
#define KV_TENANT_BUCKETS 256
#define KV_SWEEP_PER_BEGIN 4
#define KV_TOMB_DEFAULT 4096u
#define KV_TOMB_TTL_DEFAULT_NS (600ull * 1000000000ull)
#define KV_TOMB_NONE (-1)
#define KV_NONE UINT32_MAX /* no block: the end of a prefix chain or of the cache list */

/* Per block (I10): its references and, when keyed, its place in the prefix index and, with no
 * reference, on the prefix cache list. */
typedef struct {
    uint64_t tenant;        /* tag of the tenant whose tables hold (held) it */
    uint64_t hash;          /* chain hash of positions [0, end of the block), when keyed */
    uint32_t refs;          /* session tables and open transactions' new parts holding it */
    uint32_t hnext;         /* prefix index chain, KV_NONE: end */
    uint32_t cprev, cnext;  /* prefix cache list (keyed, refs 0), most recent first */
    uint32_t plan_refs;     /* refs left in the current eviction plan, valid when plan_gen matches */
    uint64_t plan_gen;
    bool keyed;             /* in the prefix index under (tenant, hash): read-only */
} kv_bmeta;

typedef struct kv_session kv_session;
typedef struct kv_tenant kv_tenant;

struct kv_tenant {
    uint64_t tag;
    uint32_t n_sessions;  /* live sessions, pinned ones included */
    uint64_t n_blocks;    /* blocks of its tables and of its open transactions' new parts */
    kv_tenant *next;      /* hash chain */
    uint64_t plan_gen;    /* plan_* below are valid when this equals kv->plan_gen */
    uint32_t plan_sessions;
    uint64_t plan_blocks;
};

struct kv_session {
    kv_sid sid;
    uint64_t epoch;
    uint32_t n_past;        /* positions held */
    uint32_t *blocks;       /* block ids, n_blocks of them */
    uint32_t n_blocks;
    uint64_t last_used;     /* clock ns */
    kv_txn *inflight;       /* non-NULL while pinned */
    kv_tenant *tenant;      /* I9 */
    uint64_t plan_gen;      /* == kv->plan_gen: chosen as a victim by the current eviction plan */
    kv_session *hash_next;
    kv_session *lru_prev, *lru_next; /* on the LRU list iff not pinned */
    uint8_t *owner;         /* kv_set_owner's bytes (NULL: none), owner_len of them */
    uint32_t owner_len;
};

struct kv_txn {
    kv_session *s;
    bool created;           /* session did not exist before kv_begin */
    uint64_t epoch;         /* epoch after commit */
    uint32_t start, end;    /* positions written: [start, end) */
    uint32_t *table;        /* working table, n_table entries */
    uint32_t n_table;
    uint32_t n_shared;      /* table[0..n_shared) are blocks of the old table (shared or, in place, reused) */
    bool in_place;          /* I7: the old blocks past start are being overwritten */
    uint8_t *undo;          /* I7: the contents of table[undo_first, n_shared) at kv_begin
                               ((n_shared - undo_first) x block_bytes); NULL unless in place */
    uint32_t undo_first;
    bool rewind, inherit;
    uint32_t n_adopt;       /* I10: table[0..n_adopt) came from the prefix index (new session) */
    uint32_t key_first, key_n; /* blocks table[key_first..+key_n) are keyed at commit where valid */
    uint64_t *key_hash;     /* key_n hashes, then key_n validity bytes; NULL: none */
    atomic_bool cancel;
    const kv_state *kv;
};

/* A gone session's remembered epoch (I8): one entry per id, chained per hash bucket and kept on
 * a list in the order the ids were last recorded (oldest first). Free entries chain through
 * `newer`. */
typedef struct {
    kv_sid sid;
    uint64_t epoch;
    uint64_t when;          /* clock ns when last recorded */
    int32_t next;           /* next index in the bucket chain, KV_TOMB_NONE: end */
    int32_t older, newer;   /* recording order; KV_TOMB_NONE at the ends */
    bool used;
} kv_tomb;

struct kv_state {
    kv_params p;
    size_t head_bytes, block_bytes; /* head_bytes: one row of one head (kv_row_bytes) */
    uint8_t *arena;
    size_t arena_bytes, arena_mapped; /* blocks_total * block_bytes; the length mapped (kvs_map_big) */
    uint32_t blocks_total;
    uint32_t *free_ids; /* stack */
    uint32_t n_free;
    kv_session *buckets[KV_HASH_BUCKETS];
    kv_session lru;     /* sentinel: lru.lru_next is most recent */
    uint32_t n_sessions;
    int fail_countdown; /* counted allocations until an injected failure */
    kv_tomb *tombs;     /* p.max_tombstones entries */
    int32_t tomb_oldest, tomb_newest; /* ends of the recording order list */
    int32_t tomb_free;  /* first free entry */
    uint32_t n_tombs;   /* used entries */
    int32_t tomb_buckets[KV_HASH_BUCKETS]; /* KV_TOMB_NONE: empty */
    kv_stats st;
    kv_tenant *tenants[KV_TENANT_BUCKETS];
    uint32_t n_tenants;
    kv_tenant *cur_tenant;  /* the tenant of the running kv_begin: not freed under it */
    uint64_t quota_blocks;  /* tenant_max_bytes in blocks; 0: none */
    uint64_t plan_gen;
    kv_bmeta *bm;           /* blocks_total entries (I10) */
    uint32_t *pbuckets;     /* prefix index heads, n_pbuckets (a power of two) */
    uint32_t n_pbuckets;
    uint32_t cache_head, cache_tail; /* prefix cache list: most / least recently cached */
    uint32_t n_cached, n_keyed;
    pthread_mutex_t lock;
};

static inline uint32_t kv_hash(const kv_sid *sid) {
    uint64_t a, b;
    memcpy(&a, sid->bytes, 8);
    memcpy(&b, sid->bytes + 8, 8);
    uint64_t h = (a ^ (b * 0x9E3779B97F4A7C15ull)) * 0xBF58476D1CE4E5B9ull;
    return (uint32_t)(h >> 40) % KV_HASH_BUCKETS;
}

static inline uint32_t kv_tenant_bucket(uint64_t tag) {
    return (uint32_t)((tag * 0x9E3779B97F4A7C15ull) >> 56) % KV_TENANT_BUCKETS;
}

static inline uint32_t kv_prefix_bucket(const kv_state *kv, uint64_t tenant, uint64_t hash) {
    uint64_t h = (hash ^ (tenant * 0x9E3779B97F4A7C15ull)) * 0xBF58476D1CE4E5B9ull;
    return (uint32_t)(h >> 32) & (kv->n_pbuckets - 1);
}

static inline uint32_t blocks_for(const kv_state *kv, uint32_t positions) {
    return (uint32_t)(((uint64_t)positions + (uint64_t)kv->p.block_tokens - 1) / (uint64_t)kv->p.block_tokens);
}

/* Shared with kv_snapshot.c (export / import); all of them run under kv->lock. */
void *kv_alloc(kv_state *kv, size_t n);
kv_session *kv_find(kv_state *kv, const kv_sid *sid);
void kv_lru_push_front(kv_state *kv, kv_session *s);
void kv_tenant_release(kv_state *kv, kv_tenant *t);
kv_tenant *kv_tenant_get(kv_state *kv, uint64_t tag);
int32_t kv_tomb_find(kv_state *kv, const kv_sid *sid);
void kv_tomb_put(kv_state *kv, const kv_sid *sid, uint64_t epoch);
void kv_remove(kv_state *kv, kv_session *s, bool remember);

#endif /* KVS_KVSTATE_IMPL_H */
