/*
 * kv_check — verifies the invariants I1-I9 of kvstate.c's design notes over the whole state,
 * under the lock. For tests and debugging: it walks every block, session, tombstone and tenant
 * (O(pool + sessions + max_tombstones)), so it is not for a hot path.
 */
#include <stdlib.h>

#include "kvstate.h"
#include "kvstate_impl.h"
#include "util.h"

/* Block owners, one byte per block: what I1 allows a block to be. */
enum { OWN_NONE, OWN_FREE, OWN_SESSION, OWN_FRESH };

static int check_blocks(kv_state *kv, uint8_t *own, char *msg, size_t cap) {
    for (uint32_t i = 0; i < kv->n_free; i++) {
        uint32_t b = kv->free_ids[i];
        if (b >= kv->blocks_total) return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I1: free stack slot %u holds block %u of %u", i, b, kv->blocks_total);
        if (own[b] != OWN_NONE) return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I1: block %u is on the free stack twice", b);
        own[b] = OWN_FREE;
    }
    return KVS_OK;
}

/* I1 (a session's blocks), I3, I6, I7 for one session and its open transaction. */
static int check_session(kv_state *kv, kv_session *s, uint8_t *own, uint64_t *held, char *msg, size_t cap) {
    const kv_txn *x = s->inflight;
    bool created = x && x->created;
    if (s->n_blocks != blocks_for(kv, s->n_past))
        return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I3: a session holds %u blocks for n_past %u (want %u)", s->n_blocks,
                        s->n_past, blocks_for(kv, s->n_past));
    if (s->n_past > kv->p.max_positions || (s->n_past == 0 && !created))
        return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I3: a %s session holds n_past %u (cap %u)", x ? "pinned" : "idle",
                        s->n_past, kv->p.max_positions);
    for (uint32_t i = 0; i < s->n_blocks; i++) {
        uint32_t b = s->blocks[i];
        if (b >= kv->blocks_total || own[b] != OWN_NONE)
            return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I1: block %u of a session's table is %s", b,
                            b >= kv->blocks_total ? "out of range" : own[b] == OWN_FREE ? "also free" : "owned twice");
        own[b] = OWN_SESSION;
    }
    *held += s->n_blocks;
    if (!x) return KVS_OK;
    if (x->s != s || x->kv != kv) return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I6: an open transaction points at another session or pool");
    if (x->start >= x->end || x->end > kv->p.max_positions || x->n_table != blocks_for(kv, x->end) ||
        x->n_shared > x->n_table || x->n_shared > s->n_blocks)
        return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I6: transaction [%u, %u) with %u blocks, %u shared, session holds %u",
                        x->start, x->end, x->n_table, x->n_shared, s->n_blocks);
    for (uint32_t i = 0; i < x->n_shared; i++)
        if (x->table[i] != s->blocks[i])
            return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I1: transaction table[%u] = %u is not the session's block %u", i,
                            x->table[i], s->blocks[i]);
    for (uint32_t i = x->n_shared; i < x->n_table; i++) {
        uint32_t b = x->table[i];
        if (b >= kv->blocks_total || own[b] != OWN_NONE)
            return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I1: new block %u of a transaction is %s", b,
                            b >= kv->blocks_total ? "out of range" : own[b] == OWN_FREE ? "also free" : "owned twice");
        own[b] = OWN_FRESH;
    }
    *held += x->n_table - x->n_shared;
    if (x->in_place) {
        uint32_t want_first = x->start / (uint32_t)kv->p.block_tokens;
        if ((x->n_shared > want_first) != (x->undo != NULL) || x->undo_first != want_first)
            return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I7: in-place transaction at %u keeps %s undo from block %u (shared %u)",
                            x->start, x->undo ? "an" : "no", x->undo_first, x->n_shared);
    } else if (x->undo) {
        return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I7: a copy-on-write transaction holds an undo copy");
    } else if ((uint64_t)x->n_shared * (uint64_t)kv->p.block_tokens > x->start && s->n_past > x->start) {
        /* Copy-on-write writes only fresh blocks and dead slots of a shared one. */
        return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I7: a copy-on-write transaction writes from %u into shared block %u, live up to %u",
                        x->start, x->n_shared - 1, s->n_past);
    }
    return KVS_OK;
}

/* I5 (one session per id, in its bucket), I1-I3, I6, I7 per session; I4 (pins and LRU). */
static int check_sessions(kv_state *kv, uint8_t *own, char *msg, size_t cap) {
    uint64_t held = 0;
    uint32_t n = 0, idle = 0;
    for (uint32_t h = 0; h < KV_HASH_BUCKETS; h++)
        for (kv_session *s = kv->buckets[h]; s; s = s->hash_next) {
            if (kv_hash(&s->sid) != h) return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I5: a session sits in bucket %u, not %u", h, kv_hash(&s->sid));
            uint32_t rest = 0; /* bounded: a cycle in the chain is caught by the count above */
            for (kv_session *o = s->hash_next; o && rest++ < kv->n_sessions; o = o->hash_next)
                if (memcmp(o->sid.bytes, s->sid.bytes, 16) == 0) return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I5: an id has two sessions");
            if (++n > kv->n_sessions) return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I5: more sessions in the table than n_sessions %u", kv->n_sessions);
            bool listed = s->lru_prev != NULL;
            if (listed == (s->inflight != NULL))
                return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I4: a %s session is %s the LRU list", s->inflight ? "pinned" : "idle",
                                listed ? "on" : "off");
            idle += !s->inflight;
            int err = check_session(kv, s, own, &held, msg, cap);
            if (err) return err;
        }
    if (n != kv->n_sessions) return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I5: %u sessions in the table, n_sessions %u", n, kv->n_sessions);
    if (kv->p.max_sessions && n > kv->p.max_sessions)
        return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I5: %u sessions past max_sessions %u", n, kv->p.max_sessions);
    uint32_t listed = 0;
    for (kv_session *s = kv->lru.lru_next, *prev = &kv->lru; s != &kv->lru; prev = s, s = s->lru_next) {
        if (s == NULL || s->lru_prev != prev || ++listed > idle)
            return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I4: the LRU list is broken after %u entries (%u idle sessions)", listed, idle);
        if (prev != &kv->lru && prev->last_used < s->last_used)
            return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I4: LRU entry %u used at %llu ns is before the next one at %llu ns", listed - 1,
                            (unsigned long long)prev->last_used, (unsigned long long)s->last_used);
    }
    if (listed != idle || kv->lru.lru_prev->lru_next != &kv->lru)
        return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I4: %u sessions on the LRU list, %u idle", listed, idle);
    /* I1: every block accounted for exactly once; I2: the byte count is exact. */
    for (uint32_t b = 0; b < kv->blocks_total; b++)
        if (own[b] == OWN_NONE) return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I1: block %u is neither free nor in a table (leaked)", b);
    if (held + kv->n_free != kv->blocks_total)
        return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I2: %llu blocks held + %u free != %u", (unsigned long long)held, kv->n_free, kv->blocks_total);
    uint64_t bytes = (uint64_t)(kv->blocks_total - kv->n_free) * kv->block_bytes;
    if (bytes > kv->p.budget_bytes)
        return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I2: %llu bytes used past the budget %llu", (unsigned long long)bytes,
                        (unsigned long long)kv->p.budget_bytes);
    return KVS_OK;
}

/* I8: one entry per id, each on its bucket chain and on the recording order list (oldest first,
 * recorded no later than the next), the rest on the free list. */
static int check_tombs(kv_state *kv, char *msg, size_t cap) {
    uint32_t cap_t = kv->p.max_tombstones, used = 0, chained = 0, ordered = 0, free_n = 0;
    for (uint32_t i = 0; i < cap_t; i++) used += kv->tombs[i].used;
    if (used != kv->n_tombs) return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I8: %u entries used, n_tombs %u", used, kv->n_tombs);
    for (uint32_t h = 0; h < KV_HASH_BUCKETS; h++)
        for (int32_t i = kv->tomb_buckets[h]; i != KV_TOMB_NONE; i = kv->tombs[i].next) {
            if (i < 0 || (uint32_t)i >= cap_t || !kv->tombs[i].used || kv_hash(&kv->tombs[i].sid) != h || ++chained > used)
                return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I8: bucket %u chains entry %d wrongly", h, i);
            uint32_t rest = 0; /* bounded: a cycle in the chain is caught by the count above */
            for (int32_t j = kv->tombs[i].next; j != KV_TOMB_NONE && j >= 0 && (uint32_t)j < cap_t && rest++ < used;
                 j = kv->tombs[j].next)
                if (memcmp(kv->tombs[j].sid.bytes, kv->tombs[i].sid.bytes, 16) == 0)
                    return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I8: an id has entries %d and %d", i, j);
        }
    if (chained != used) return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I8: %u entries on bucket chains, %u used", chained, used);
    int32_t prev = KV_TOMB_NONE;
    for (int32_t i = kv->tomb_oldest; i != KV_TOMB_NONE; prev = i, i = kv->tombs[i].newer) {
        if (i < 0 || (uint32_t)i >= cap_t || !kv->tombs[i].used || kv->tombs[i].older != prev || ++ordered > used)
            return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I8: the order list is broken at entry %d after %u", i, ordered);
        if (prev != KV_TOMB_NONE && kv->tombs[prev].when > kv->tombs[i].when)
            return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I8: entry %d recorded at %llu ns is older than the one before it (%llu ns)", i,
                            (unsigned long long)kv->tombs[i].when, (unsigned long long)kv->tombs[prev].when);
    }
    if (ordered != used || kv->tomb_newest != prev)
        return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I8: %u entries on the order list, %u used", ordered, used);
    for (int32_t i = kv->tomb_free; i != KV_TOMB_NONE; i = kv->tombs[i].newer)
        if (i < 0 || (uint32_t)i >= cap_t || kv->tombs[i].used || ++free_n > cap_t - used)
            return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I8: the free list is broken at entry %d", i);
    if (free_n + used != cap_t) return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I8: %u free + %u used != %u entries", free_n, used, cap_t);
    return KVS_OK;
}

/* I9: the tenants' sessions and blocks add up to the pool's; every session's tenant is live. */
static int check_tenants(kv_state *kv, char *msg, size_t cap) {
    uint64_t blocks = 0, sessions = 0;
    uint32_t n = 0;
    for (uint32_t h = 0; h < KV_TENANT_BUCKETS; h++)
        for (kv_tenant *t = kv->tenants[h]; t; t = t->next) {
            if (kv_tenant_bucket(t->tag) != h || t->n_sessions == 0)
                return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I9: tenant %llx in bucket %u holds %u sessions", (unsigned long long)t->tag, h,
                                t->n_sessions);
            blocks += t->n_blocks;
            sessions += t->n_sessions;
            n++;
        }
    if (n != kv->n_tenants) return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I9: %u tenant records, n_tenants %u", n, kv->n_tenants);
    if (sessions != kv->n_sessions || blocks != (uint64_t)kv->blocks_total - kv->n_free)
        return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I9: tenants hold %llu sessions and %llu blocks; the pool %u and %u",
                        (unsigned long long)sessions, (unsigned long long)blocks, kv->n_sessions, kv->blocks_total - kv->n_free);
    for (uint32_t h = 0; h < KV_HASH_BUCKETS; h++)
        for (kv_session *s = kv->buckets[h]; s; s = s->hash_next) {
            kv_tenant *t = kv->tenants[kv_tenant_bucket(s->tenant->tag)];
            while (t && t != s->tenant) t = t->next;
            if (!t) return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I9: a session's tenant %llx has no record", (unsigned long long)s->tenant->tag);
        }
    return KVS_OK;
}

int kv_check(kv_state *kv, char *msg, size_t msg_cap) {
    if (!kv) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "kv_check: no state");
    uint8_t *own = calloc(kv->blocks_total, 1);
    if (!own) return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "kv_check: no memory for %u block owners", kv->blocks_total);
    pthread_mutex_lock(&kv->lock);
    int err = check_blocks(kv, own, msg, msg_cap);
    if (!err) err = check_sessions(kv, own, msg, msg_cap);
    if (!err) err = check_tombs(kv, msg, msg_cap);
    if (!err) err = check_tenants(kv, msg, msg_cap);
    pthread_mutex_unlock(&kv->lock);
    free(own);
    return err;
}
