/*
 * kv_check — verifies the invariants I1-I10 of kvstate.c's design notes over the whole state,
 * under the lock. For tests and debugging: it walks every block, session, tombstone and tenant
 * (O(pool + sessions + max_tombstones)), so it is not for a hot path.
 */
#include <stdlib.h>

#include "kvstate.h"
#include "kvstate_impl.h"
#include "util.h"

/* Per block: the tables found holding it (I1, I10), and FREE_MARK when it is on the free stack. */
#define FREE_MARK UINT32_MAX

static int check_blocks(kv_state *kv, uint32_t *own, char *msg, size_t cap) {
    for (uint32_t i = 0; i < kv->n_free; i++) {
        uint32_t b = kv->free_ids[i];
        if (b >= kv->blocks_total) return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I1: free stack slot %u holds block %u of %u", i, b, kv->blocks_total);
        if (own[b] != 0) return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I1: block %u is on the free stack twice", b);
        if (kv->bm[b].refs || kv->bm[b].keyed)
            return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I10: free block %u has %u refs%s", b, kv->bm[b].refs, kv->bm[b].keyed ? " and a key" : "");
        own[b] = FREE_MARK;
    }
    return KVS_OK;
}

/* One more table holds block b (I1: never a free one). */
static int own_block(const kv_state *kv, uint32_t *own, uint32_t b, const char *what, char *msg, size_t cap) {
    if (b >= kv->blocks_total || own[b] == FREE_MARK)
        return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I1: block %u of %s is %s", b, what, b >= kv->blocks_total ? "out of range" : "also free");
    own[b]++;
    return KVS_OK;
}

/* I10: a block a transaction writes is its own: one reference, no key. */
static int check_writable(const kv_state *kv, uint32_t b, char *msg, size_t cap) {
    if (kv->bm[b].refs != 1 || kv->bm[b].keyed)
        return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I10: block %u that a transaction writes has %u refs%s", b, kv->bm[b].refs,
                        kv->bm[b].keyed ? " and a key" : "");
    return KVS_OK;
}

/* I1 (a session's blocks), I3, I6, I7 for one session and its open transaction. */
static int check_session(kv_state *kv, kv_session *s, uint32_t *own, char *msg, size_t cap) {
    const kv_txn *x = s->inflight;
    bool created = x && x->created;
    if (s->n_blocks != blocks_for(kv, s->n_past))
        return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I3: a session holds %u blocks for n_past %u (want %u)", s->n_blocks,
                        s->n_past, blocks_for(kv, s->n_past));
    if (s->n_past > kv->p.max_positions || (s->n_past == 0 && !created))
        return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I3: a %s session holds n_past %u (cap %u)", x ? "pinned" : "idle",
                        s->n_past, kv->p.max_positions);
    int err;
    for (uint32_t i = 0; i < s->n_blocks; i++)
        if ((err = own_block(kv, own, s->blocks[i], "a session's table", msg, cap))) return err;
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
    if (x->n_adopt && (x->n_shared || !created || (uint64_t)x->n_adopt * (uint64_t)kv->p.block_tokens != x->start))
        return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I10: a transaction adopts %u blocks at start %u, %u shared, %s session",
                        x->n_adopt, x->start, x->n_shared, created ? "a new" : "an existing");
    for (uint32_t i = x->n_shared; i < x->n_table; i++) {
        if ((err = own_block(kv, own, x->table[i], "a transaction's new part", msg, cap))) return err;
        if (i < x->n_shared + x->n_adopt ? !kv->bm[x->table[i]].keyed : (err = check_writable(kv, x->table[i], msg, cap)) != 0)
            return err ? err : kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I10: adopted block %u has no key", x->table[i]);
    }
    for (uint32_t i = x->undo_first; x->in_place && i < x->n_shared; i++)
        if ((err = check_writable(kv, x->table[i], msg, cap))) return err;
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
static int check_sessions(kv_state *kv, uint32_t *own, char *msg, size_t cap) {
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
            int err = check_session(kv, s, own, msg, cap);
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
    /* I1, I10: every block free, cached or held by exactly refs tables (more than one only when
     * keyed); I2: the byte count is exact. */
    uint64_t cached = 0;
    for (uint32_t b = 0; b < kv->blocks_total; b++) {
        const kv_bmeta *m = &kv->bm[b];
        if (own[b] == FREE_MARK) continue;
        if (own[b] != m->refs)
            return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I10: block %u is in %u tables, refs %u", b, own[b], m->refs);
        if (own[b] == 0 && !m->keyed)
            return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I1: block %u is neither free nor in a table nor cached (leaked)", b);
        if (own[b] > 1 && !m->keyed)
            return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I10: block %u is shared by %u tables without a key", b, own[b]);
        held += own[b] > 0;
        cached += own[b] == 0;
    }
    if (cached != kv->n_cached || held + cached + kv->n_free != kv->blocks_total)
        return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I2: %llu blocks held + %llu cached (n_cached %u) + %u free != %u",
                        (unsigned long long)held, (unsigned long long)cached, kv->n_cached, kv->n_free, kv->blocks_total);
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

/* I10: the prefix index holds every keyed block once, in its bucket, with no two of one (tenant,
 * hash); the cache list holds exactly the keyed blocks no table holds, most recent first. */
static int check_prefix(kv_state *kv, char *msg, size_t cap) {
    uint32_t keyed = 0, listed = 0;
    for (uint32_t b = 0; b < kv->blocks_total; b++) keyed += kv->bm[b].keyed;
    if (keyed != kv->n_keyed) return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I10: %u keyed blocks, n_keyed %u", keyed, kv->n_keyed);
    uint32_t chained = 0;
    for (uint32_t h = 0; h < kv->n_pbuckets; h++)
        for (uint32_t b = kv->pbuckets[h]; b != KV_NONE; b = kv->bm[b].hnext) {
            if (b >= kv->blocks_total || !kv->bm[b].keyed || kv_prefix_bucket(kv, kv->bm[b].tenant, kv->bm[b].hash) != h ||
                ++chained > keyed)
                return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I10: prefix bucket %u chains block %u wrongly", h, b);
            for (uint32_t o = kv->bm[b].hnext, rest = 0; o != KV_NONE && o < kv->blocks_total && rest++ < keyed; o = kv->bm[o].hnext)
                if (kv->bm[o].hash == kv->bm[b].hash && kv->bm[o].tenant == kv->bm[b].tenant)
                    return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I10: blocks %u and %u have one key", b, o);
        }
    if (chained != keyed) return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I10: %u blocks in the prefix index, %u keyed", chained, keyed);
    uint32_t prev = KV_NONE;
    for (uint32_t b = kv->cache_head; b != KV_NONE; prev = b, b = kv->bm[b].cnext) {
        if (b >= kv->blocks_total || kv->bm[b].cprev != prev || !kv->bm[b].keyed || kv->bm[b].refs || ++listed > kv->n_cached)
            return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I10: the prefix cache list is broken at block %u after %u", b, listed);
    }
    if (listed != kv->n_cached || kv->cache_tail != prev)
        return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I10: %u blocks on the cache list, n_cached %u", listed, kv->n_cached);
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
    if (sessions != kv->n_sessions || blocks + kv->n_cached != (uint64_t)kv->blocks_total - kv->n_free)
        return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I9: tenants hold %llu sessions and %llu blocks (+%u cached); the pool %u and %u",
                        (unsigned long long)sessions, (unsigned long long)blocks, kv->n_cached, kv->n_sessions,
                        kv->blocks_total - kv->n_free);
    /* A shared block is charged once, to the tenant whose tables hold it. */
    for (uint32_t h = 0; h < KV_TENANT_BUCKETS; h++)
        for (kv_tenant *t = kv->tenants[h]; t; t = t->next) {
            uint64_t mine = 0;
            for (uint32_t b = 0; b < kv->blocks_total; b++) mine += kv->bm[b].refs && kv->bm[b].tenant == t->tag;
            if (mine != t->n_blocks)
                return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "I9: tenant %llx is charged %llu blocks, holds %llu",
                                (unsigned long long)t->tag, (unsigned long long)t->n_blocks, (unsigned long long)mine);
        }
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
    uint32_t *own = calloc(kv->blocks_total, sizeof(uint32_t));
    if (!own) return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "kv_check: no memory for %u block owners", kv->blocks_total);
    pthread_mutex_lock(&kv->lock);
    int err = check_blocks(kv, own, msg, msg_cap);
    if (!err) err = check_sessions(kv, own, msg, msg_cap);
    if (!err) err = check_tombs(kv, msg, msg_cap);
    if (!err) err = check_prefix(kv, msg, msg_cap);
    if (!err) err = check_tenants(kv, msg, msg_cap);
    pthread_mutex_unlock(&kv->lock);
    free(own);
    return err;
}
