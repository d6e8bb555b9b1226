/*
 * kvstate — hot KV state of a shard.
 *
 * NOTES ON THE DESIGN
 *
 * Storage. One arena of blocks_total blocks, reserved at creation (pages are
 * touched on first use; 2 MiB pages where the kernel gives them, kvs_map_big).
 * A block holds block_tokens positions of every local layer: layout
 * [layer][kv head][K|V][slot][head_dim], so one head's key rows of a layer
 * are contiguous within a block and its value rows follow them (attention
 * walks a head at a time: the keys, then the values; with the two runs side
 * by side the hardware prefetcher streams the values in with the keys —
 * TinyLlama decode at 2016 positions on a Zen 5, a (layer, head) attention
 * task 138-142 -> 103 kcycles against [layer][K|V][kv head][slot]).
 * Free blocks sit on a stack of ids. A session's block table maps position p
 * to block table[p / block_tokens], slot p % block_tokens.
 *
 * Invariants (kv_check in kvstate_check.c verifies I1-I10; the kvstate tests
 * run it after every operation):
 *  I1. Every block is on the free stack or in exactly one table (a live
 *      session's, or an open transaction's new part table[n_shared..)); never
 *      both. An open transaction's table[0..n_shared) is its session's
 *      blocks[0..n_shared).
 *  I2. blocks_total - blocks_free == the blocks of all tables and all open
 *      transactions' new parts; bytes_used == that x block_bytes <= budget.
 *  I3. A live session holds exactly ceil(n_past / block_tokens) blocks, and
 *      0 < n_past <= max_positions (n_past 0 only while kv_begin's new
 *      session is pinned); only its last block may be partly empty.
 *  I4. A session with an open transaction (pinned) is not on the LRU list,
 *      so neither TTL nor LRU eviction can touch it; every idle one is, most
 *      recently used first.
 *  I5. The session table holds at most one live epoch per session id, in the
 *      bucket of its hash; n_sessions counts them (<= max_sessions when set).
 *  I6. Attention reads a session's K/V only through its own (transaction's)
 *      table: isolation is structural. A transaction is its session's pin
 *      and covers [start, end) with ceil(end / block_tokens) blocks.
 *
 * State of one session id:
 *
 *     absent --kv_begin(start_pos 0)--> pinned(new) --kv_commit--> idle
 *     idle --kv_begin--> pinned --kv_commit--> idle (n_past = start + n)
 *                               --kv_abort---> idle (exactly as before, in place too)
 *     pinned(new) --kv_abort--> absent (no tombstone: as before kv_begin)
 *     idle --kv_truncate--> idle;  idle --kv_release / kv_sweep_ttl / LRU
 *     eviction in kv_begin of another session--> absent
 *
 * Transactions are copy-on-write at block granularity: blocks wholly below
 * the kept length are shared with the old table; the block holding the kept
 * length is shared when nothing live lies past it (a plain append writes
 * only slots beyond n_past, which are dead), otherwise (rewind, inherit
 * shorter than n_past) it is copied into a fresh block. Every position the
 * request writes lands in a fresh or dead slot, so kv_abort only has to free
 * the fresh blocks, and kv_commit frees the old blocks the new table dropped.
 *
 * In-place rewrite (I7). The old blocks past the kept length are superseded:
 * they die with the commit. When the free blocks do not cover a copy-on-write
 * plan, kv_begin reuses the session's own old blocks in place instead (and
 * takes from the pool, evicting LRU neighbours if it must, only the blocks of
 * the positions the request adds). So a retry, a rewind, an inherit or an
 * epoch bump never needs more free blocks than the positions it adds and
 * never evicts a neighbour for what its own blocks can do. To keep abort
 * exact all the same, kv_begin first copies the reused blocks the request
 * writes into (from the one holding start on) to an undo buffer outside the
 * pool (a counted allocation: its failure is NOMEM with nothing changed);
 * kv_abort copies them back, kv_commit frees the buffer. The buffer is heap
 * memory beyond the budget, at most the session's own bytes past start, and
 * only while such a transaction is open: the price of atomicity without
 * taking a neighbour's blocks.
 *
 *  I7. A transaction is in place only when copy-on-write would need more free
 *      blocks than there are (or the tenant's quota); then txn->table[0..n_shared)
 *      are the session's old blocks, in order, and txn->undo holds the
 *      contents of table[start / block_tokens .. n_shared) as of kv_begin.
 *      Otherwise there is no undo and no position the request writes lies in
 *      a shared block below n_past.
 *
 * Tombstones (I8). When a session goes (release, TTL, LRU, truncate to 0, a
 * newer epoch that drops it) its id and epoch are remembered, each forgotten
 * after tombstone_ttl_ns: a request at an older epoch is STALE_EPOCH, so a
 * stale driver cannot re-create it. The table bounds ids, not events: an id
 * has one entry, found through a hash index and updated in place when the id
 * goes again (it then becomes the newest); past max_tombstones ids the least
 * recently recorded id is forgotten. A session kv_begin created and kv_abort
 * rolled back leaves no entry (it never existed for anyone).
 *
 *  I8. One entry per id, on the bucket chain of its hash and on the recording
 *      order list (oldest first, recorded no later than the next); the other
 *      entries are on the free list; n_tombs counts the used ones. A
 *      tombstone is consulted only for an id with no live session; its epoch
 *      is the highest epoch of any dropped session of that id still
 *      remembered. Memory: max_tombstones x sizeof(kv_tomb), fixed.
 *
 * Limits. max_sessions counts live sessions (a session truncated to 0 is
 * dropped, so it does not count). A new session past the limit with every
 * session pinned is KVS_ERR_BUSY (retry later: pins are transient); blocks
 * short with every idle session evicted is KVS_ERR_BUDGET_EXHAUSTED. The
 * per-session cap is clamped at creation to what the pool can hold.
 *
 * Tenants (I9). Every session belongs to the tenant (a 64-bit tag, the server's hash of the
 * peer identity) that created it; a tenant record counts its live sessions (pinned ones and a
 * new one from kv_begin on) and its blocks (its tables plus its open transactions' new parts)
 * and exists exactly while it has sessions (or a kv_begin of it is running). kv_begin plans its
 * evictions in two phases, dry first, so a refused begin evicts nothing:
 *   1. quota: while the tenant would hold more than tenant_max_bytes (blocks) or, for a new
 *      session, tenant_max_sessions, evict its own idle sessions, LRU first. Not enough: refused
 *      (BUDGET_EXHAUSTED / BUSY, over_quota).
 *   2. pool: while the pool is short of blocks (or of a session slot, max_sessions), evict idle
 *      sessions of tenants holding more than their fair share — blocks_total / tenants
 *      (max_sessions / tenants for slots), the requester counted among the tenants — LRU
 *      first; then the requester's own, LRU first. Another tenant's session is never evicted
 *      while that tenant is within its fair share, so one tenant's pressure cannot take another
 *      below it; a tenant alone (or the single tenant 0 of kv_begin) sees plain LRU.
 *
 *  I9. sum over tenants of n_sessions == n_sessions and of n_blocks + n_cached == blocks_total -
 *      n_free; every session's tenant record is live; a tenant is charged once for each block with
 *      references tagged with it, however many of its tables hold it.
 *
 * Shared prefix blocks (I10; docs/hot-kv-state.md). The client names every 16 positions by a
 * chain hash; a full block the transaction completed is keyed at commit under (tenant, the
 * hash at its end) in a prefix index, or replaced by the block already keyed so (charged once).
 * Keyed blocks are read-only, so I1 relaxes: a block is free, or held by refs tables (sessions'
 * and open transactions' new parts), or — keyed with refs 0 — on the prefix cache list. A new
 * session (kv_begin_prefix) takes the keyed blocks below its start_pos into the new part of its
 * transaction. Writable blocks come from the free stack, then from the cache's LRU end, so the
 * cache is evicted before any live session (eviction plans count cached blocks as available).
 *
 *  I10. refs of a block == the tables holding it; more than one only when keyed; a block with
 *      refs 0 is free or keyed and cached (never both); the index holds each keyed block once, in
 *      its bucket, no two with one (tenant, hash); the cache list holds exactly the keyed blocks
 *      with refs 0; a block a transaction writes (fresh, or reused in place) has refs 1 and no
 *      key; a transaction that took prefix blocks belongs to a session it created, and took
 *      exactly the blocks below its start.
 */
#include "kvstate.h"

#include <stdlib.h>
#include <string.h>

#include "kvstate_impl.h"
#include "quant.h"
#include "util.h"

/* ---- counted allocation: the one place metadata memory comes from -------- */

void *kv_alloc(kv_state *kv, size_t n) {
    if (kv->fail_countdown > 0 && --kv->fail_countdown == 0) return NULL;
    return malloc(n);
}

void kv_inject_alloc_failure(kv_state *kv, int n) {
    pthread_mutex_lock(&kv->lock);
    kv->fail_countdown = n > 0 ? n : 0;
    pthread_mutex_unlock(&kv->lock);
}

static uint64_t kv_default_clock(void *ctx) {
    (void)ctx;
    return kvs_now_ns();
}

kv_params kv_default_params(void) {
    kv_params p = {0};
    p.block_tokens = 16;
    p.kv_type = QUANT_F16;
    p.max_positions = 2048;
    p.max_tombstones = KV_TOMB_DEFAULT;
    p.tombstone_ttl_ns = KV_TOMB_TTL_DEFAULT_NS;
    return p;
}

/* ---- table, LRU --------------------------------------------------------- */

kv_session *kv_find(kv_state *kv, const kv_sid *sid) {
    for (kv_session *s = kv->buckets[kv_hash(sid)]; s; s = s->hash_next)
        if (memcmp(s->sid.bytes, sid->bytes, 16) == 0) return s;
    return NULL;
}

static void lru_unlink(kv_session *s) {
    if (!s->lru_prev) return;
    s->lru_prev->lru_next = s->lru_next;
    s->lru_next->lru_prev = s->lru_prev;
    s->lru_prev = s->lru_next = NULL;
}

void kv_lru_push_front(kv_state *kv, kv_session *s) {
    s->lru_next = kv->lru.lru_next;
    s->lru_prev = &kv->lru;
    kv->lru.lru_next->lru_prev = s;
    kv->lru.lru_next = s;
}

static kv_tenant **tenant_slot(kv_state *kv, uint64_t tag) {
    kv_tenant **pp = &kv->tenants[kv_tenant_bucket(tag)];
    while (*pp && (*pp)->tag != tag) pp = &(*pp)->next;
    return pp;
}

/* Frees t when it holds no session and no kv_begin is using it (I9). */
void kv_tenant_release(kv_state *kv, kv_tenant *t) {
    if (t->n_sessions || t == kv->cur_tenant) return;
    KVS_ASSERT(t->n_blocks == 0);
    kv_tenant **pp = tenant_slot(kv, t->tag);
    *pp = t->next;
    free(t);
    kv->n_tenants--;
}

/* ---- prefix blocks (I10) -------------------------------------------------------------------- */

static void cache_unlink(kv_state *kv, uint32_t b) {
    kv_bmeta *m = &kv->bm[b];
    if (m->cprev != KV_NONE) kv->bm[m->cprev].cnext = m->cnext;
    else kv->cache_head = m->cnext;
    if (m->cnext != KV_NONE) kv->bm[m->cnext].cprev = m->cprev;
    else kv->cache_tail = m->cprev;
    m->cprev = m->cnext = KV_NONE;
    kv->n_cached--;
}

static void cache_push(kv_state *kv, uint32_t b) {
    kv_bmeta *m = &kv->bm[b];
    m->cprev = KV_NONE;
    m->cnext = kv->cache_head;
    if (kv->cache_head != KV_NONE) kv->bm[kv->cache_head].cprev = b;
    else kv->cache_tail = b;
    kv->cache_head = b;
    kv->n_cached++;
}

/* The keyed block of (tenant, hash), KV_NONE when there is none. */
static uint32_t index_find(const kv_state *kv, uint64_t tenant, uint64_t hash) {
    for (uint32_t b = kv->pbuckets[kv_prefix_bucket(kv, tenant, hash)]; b != KV_NONE; b = kv->bm[b].hnext)
        if (kv->bm[b].hash == hash && kv->bm[b].tenant == tenant) return b;
    return KV_NONE;
}

static void index_add(kv_state *kv, uint32_t b, uint64_t hash) {
    kv_bmeta *m = &kv->bm[b];
    uint32_t h = kv_prefix_bucket(kv, m->tenant, hash);
    m->hash = hash;
    m->keyed = true;
    m->hnext = kv->pbuckets[h];
    kv->pbuckets[h] = b;
    kv->n_keyed++;
}

/* Takes b out of the prefix index: it becomes a private, writable block. */
static void index_remove(kv_state *kv, uint32_t b) {
    kv_bmeta *m = &kv->bm[b];
    uint32_t *pp = &kv->pbuckets[kv_prefix_bucket(kv, m->tenant, m->hash)];
    while (*pp != b) pp = &kv->bm[*pp].hnext;
    *pp = m->hnext;
    m->hnext = KV_NONE;
    m->keyed = false;
    kv->n_keyed--;
}

/* One more table holds b; a block no table held (a cached one) is charged to t again. */
static void block_ref(kv_state *kv, kv_tenant *t, uint32_t b) {
    kv_bmeta *m = &kv->bm[b];
    if (m->refs++ == 0) {
        if (m->keyed) cache_unlink(kv, b);
        t->n_blocks++;
    }
}

/* One table fewer holds b; with none left a keyed block stays as prefix cache, others go free. */
static void block_unref(kv_state *kv, kv_tenant *t, uint32_t b) {
    kv_bmeta *m = &kv->bm[b];
    KVS_ASSERT(m->refs > 0);
    if (--m->refs) return;
    KVS_ASSERT(t->n_blocks > 0);
    t->n_blocks--;
    if (m->keyed) {
        cache_push(kv, b);
    } else {
        KVS_ASSERT(kv->n_free < kv->blocks_total);
        kv->free_ids[kv->n_free++] = b;
    }
}

/* A writable block for t: a free one, else the least recently cached prefix block (the cache is
 * evicted before any session, I10). The caller made sure one exists. */
static uint32_t take_block(kv_state *kv, kv_tenant *t) {
    uint32_t b;
    if (kv->n_free) {
        b = kv->free_ids[--kv->n_free];
    } else {
        b = kv->cache_tail;
        KVS_ASSERT(b != KV_NONE);
        cache_unlink(kv, b);
        index_remove(kv, b);
        kv->st.prefix_evictions++;
    }
    kv->bm[b].tenant = t->tag;
    kv->bm[b].refs = 1;
    t->n_blocks++;
    return b;
}

/* Blocks the pool can hand out now: free ones and cached prefix blocks. */
static uint64_t kv_avail(const kv_state *kv) { return (uint64_t)kv->n_free + kv->n_cached; }

/* Drops one reference of tenant t's tables to each of n blocks, the last first, so that the
 * next session to take them gets them back in their order (a fresh pool hands out blocks in
 * order: a session's blocks stay in the order they had). */
static void kv_free_blocks(kv_state *kv, kv_tenant *t, const uint32_t *ids, uint32_t n) {
    for (uint32_t i = n; i-- > 0;) block_unref(kv, t, ids[i]);
}

/* The chain hash of the block ending at (block + 1) x block_tokens, when pre has it. */
static bool pre_hash(const kv_state *kv, const kv_prefix *pre, uint32_t block, uint64_t *h) {
    if (!pre || !pre->hashes || kv->p.block_tokens % KV_PREFIX_TOKENS) return false;
    uint64_t idx = (uint64_t)(block + 1) * (uint64_t)(kv->p.block_tokens / KV_PREFIX_TOKENS) - 1;
    if (idx < pre->first || idx - pre->first >= pre->n) return false;
    *h = pre->hashes[idx - pre->first];
    return true;
}

/* How many leading blocks of [0, nb) tenant tag's prefix index holds. */
static uint32_t prefix_run(const kv_state *kv, uint64_t tag, const kv_prefix *pre, uint32_t nb) {
    uint32_t b = 0;
    uint64_t h;
    while (b < nb && pre_hash(kv, pre, b, &h) && index_find(kv, tag, h) != KV_NONE) b++;
    return b;
}

/* ---- tombstones (I8) -------------------------------------------------------- */

static bool tomb_alive(const kv_state *kv, const kv_tomb *t, uint64_t now) {
    return t->used && (now < t->when || now - t->when <= kv->p.tombstone_ttl_ns);
}

/* Takes entry idx off the recording order list. */
static void tomb_order_unlink(kv_state *kv, int32_t idx) {
    kv_tomb *t = &kv->tombs[idx];
    if (t->older != KV_TOMB_NONE) kv->tombs[t->older].newer = t->newer;
    else kv->tomb_oldest = t->newer;
    if (t->newer != KV_TOMB_NONE) kv->tombs[t->newer].older = t->older;
    else kv->tomb_newest = t->older;
    t->older = t->newer = KV_TOMB_NONE;
}

/* Puts entry idx at the newest end of the recording order list. */
static void tomb_order_push(kv_state *kv, int32_t idx) {
    kv_tomb *t = &kv->tombs[idx];
    t->older = kv->tomb_newest;
    t->newer = KV_TOMB_NONE;
    if (kv->tomb_newest != KV_TOMB_NONE) kv->tombs[kv->tomb_newest].newer = idx;
    else kv->tomb_oldest = idx;
    kv->tomb_newest = idx;
}

/* Forgets entry idx: off its bucket chain and the order list, onto the free list. */
static void tomb_forget(kv_state *kv, int32_t idx) {
    kv_tomb *t = &kv->tombs[idx];
    int32_t *pp = &kv->tomb_buckets[kv_hash(&t->sid)];
    while (*pp != idx) pp = &kv->tombs[*pp].next;
    *pp = t->next;
    tomb_order_unlink(kv, idx);
    t->used = false;
    t->next = KV_TOMB_NONE;
    t->newer = kv->tomb_free;
    kv->tomb_free = idx;
    kv->n_tombs--;
}

/* The entry of sid, aged out or not; KV_TOMB_NONE when there is none. */
static int32_t tomb_entry(const kv_state *kv, const kv_sid *sid) {
    for (int32_t i = kv->tomb_buckets[kv_hash(sid)]; i != KV_TOMB_NONE; i = kv->tombs[i].next)
        if (memcmp(kv->tombs[i].sid.bytes, sid->bytes, 16) == 0) return i;
    return KV_TOMB_NONE;
}

/* Index of sid's remembered epoch, -1 when none (or aged out). */
int32_t kv_tomb_find(kv_state *kv, const kv_sid *sid) {
    int32_t i = tomb_entry(kv, sid);
    return i != KV_TOMB_NONE && tomb_alive(kv, &kv->tombs[i], kv->p.clock(kv->p.clock_ctx)) ? i : -1;
}

/* Remembers epoch for sid (keeping the higher of it and one already remembered). One entry per
 * id (I8): an id recorded again is updated in place and becomes the newest, so churning one id
 * never pushes out another's entry; a new id past max_tombstones forgets the least recently
 * recorded one. Aged-out entries at the old end are forgotten on the way (a few per call). */
void kv_tomb_put(kv_state *kv, const kv_sid *sid, uint64_t epoch) {
    uint64_t now = kv->p.clock(kv->p.clock_ctx);
    for (int k = 0; k < 4 && kv->tomb_oldest != KV_TOMB_NONE; k++) {
        int32_t o = kv->tomb_oldest;
        if (tomb_alive(kv, &kv->tombs[o], now)) break;
        tomb_forget(kv, o);
    }
    int32_t idx = tomb_entry(kv, sid);
    if (idx != KV_TOMB_NONE) {
        kv_tomb *t = &kv->tombs[idx];
        if (tomb_alive(kv, t, now) && t->epoch > epoch) epoch = t->epoch;
        tomb_order_unlink(kv, idx);
    } else {
        if (kv->tomb_free == KV_TOMB_NONE) tomb_forget(kv, kv->tomb_oldest);
        idx = kv->tomb_free;
        kv_tomb *t = &kv->tombs[idx];
        kv->tomb_free = t->newer;
        t->sid = *sid;
        t->used = true;
        uint32_t h = kv_hash(sid);
        t->next = kv->tomb_buckets[h];
        kv->tomb_buckets[h] = idx;
        kv->n_tombs++;
    }
    kv->tombs[idx].epoch = epoch;
    kv->tombs[idx].when = now;
    tomb_order_push(kv, idx);
}

/* Removes an idle session entirely, returning its blocks; its epoch becomes a tombstone when
 * remember (a session that goes), not when it never existed for anyone (a rolled-back create). */
void kv_remove(kv_state *kv, kv_session *s, bool remember) {
    KVS_ASSERT(!s->inflight);
    if (remember) kv_tomb_put(kv, &s->sid, s->epoch);
    kv_session **pp = &kv->buckets[kv_hash(&s->sid)];
    while (*pp != s) pp = &(*pp)->hash_next;
    *pp = s->hash_next;
    lru_unlink(s);
    kv_tenant *t = s->tenant;
    kv_free_blocks(kv, t, s->blocks, s->n_blocks);
    free(s->blocks);
    free(s->owner);
    free(s);
    kv->n_sessions--;
    t->n_sessions--;
    kv_tenant_release(kv, t);
}

static void kv_drop(kv_state *kv, kv_session *s) { kv_remove(kv, s, true); }

static int kv_sweep_locked(kv_state *kv, int max_work) {
    if (kv->p.ttl_ns == 0) return 0;
    uint64_t now = kv->p.clock(kv->p.clock_ctx);
    int evicted = 0;
    for (int i = 0; i < max_work; i++) {
        kv_session *s = kv->lru.lru_prev; /* oldest */
        if (s == &kv->lru) break;
        if (now < s->last_used || now - s->last_used <= kv->p.ttl_ns) break;
        kv_drop(kv, s);
        kv->st.evict_ttl++;
        evicted++;
    }
    return evicted;
}

int kv_sweep_ttl(kv_state *kv, int max_work) {
    pthread_mutex_lock(&kv->lock);
    int n = kv_sweep_locked(kv, max_work);
    pthread_mutex_unlock(&kv->lock);
    return n;
}

/* ---- create / free ------------------------------------------------------ */

int kv_create(const kv_params *p, kv_state **out, char *msg, size_t msg_cap) {
    *out = NULL;
    if (p->n_layers < 1 || p->n_kv_heads < 1 || p->head_dim < 1)
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "kv: layers, kv heads and head_dim must be >= 1");
    if (p->block_tokens < 1 || p->block_tokens > 1024)
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "kv: block size %d out of [1, 1024]", p->block_tokens);
    if (!kv_type_supported(p->kv_type))
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "kv: type must be f16, q8_0, q4_0 or f32");
    if (kv_type_is_block(p->kv_type) && p->head_dim > KV_QBLOCK_MAX_HEAD_DIM)
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "kv: head_dim %d is above %d, the most a %s KV cache takes",
                        p->head_dim, KV_QBLOCK_MAX_HEAD_DIM, quant_get_traits(p->kv_type)->name);
    if (kv_type_is_block(p->kv_type) && p->head_dim % KV_QBLOCK_ELEMS != 0)
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG,
                        "kv: head_dim %d is not a multiple of %d, which a %s KV cache needs (use f16)", p->head_dim,
                        KV_QBLOCK_ELEMS, quant_get_traits(p->kv_type)->name);
    kv_state *kv = calloc(1, sizeof(*kv));
    if (!kv) return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "kv: out of memory");
    kv->p = *p;
    if (!kv->p.clock) kv->p.clock = kv_default_clock;
    if (kv->p.max_positions == 0) kv->p.max_positions = UINT32_MAX;
    if (kv->p.max_tombstones == 0) kv->p.max_tombstones = KV_TOMB_DEFAULT;
    if (kv->p.max_tombstones > INT32_MAX) kv->p.max_tombstones = INT32_MAX; /* int32_t entry indices */
    if (kv->p.tombstone_ttl_ns == 0) kv->p.tombstone_ttl_ns = KV_TOMB_TTL_DEFAULT_NS;
    kv->head_bytes = kv_row_bytes(p->kv_type, p->head_dim);
    kv->block_bytes = kv_params_block_bytes(p);
    uint64_t nb = p->budget_bytes / kv->block_bytes;
    if (nb == 0) {
        size_t bb = kv->block_bytes;
        free(kv);
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "kv: budget %llu B is smaller than one block (%zu B)",
                        (unsigned long long)p->budget_bytes, bb);
    }
    if (nb > UINT32_MAX - 1) nb = UINT32_MAX - 1;
    kv->blocks_total = (uint32_t)nb;
    kv->arena_bytes = (size_t)nb * kv->block_bytes;
    kv->arena = kvs_map_big(kv->arena_bytes, true, &kv->arena_mapped);
    if (kv->arena && p->prefault) kvs_prefault(kv->arena, kv->arena_mapped);
    kv->free_ids = malloc((size_t)nb * sizeof(uint32_t));
    kv->tombs = calloc(kv->p.max_tombstones, sizeof(kv_tomb));
    kv->bm = calloc((size_t)nb, sizeof(kv_bmeta));
    kv->n_pbuckets = 64;
    while (kv->n_pbuckets < nb && kv->n_pbuckets < (1u << 30)) kv->n_pbuckets <<= 1;
    kv->pbuckets = malloc((size_t)kv->n_pbuckets * sizeof(uint32_t));
    if (!kv->arena || !kv->free_ids || !kv->tombs || !kv->bm || !kv->pbuckets) {
        kvs_unmap_big(kv->arena, kv->arena_mapped);
        free(kv->free_ids);
        free(kv->tombs);
        free(kv->bm);
        free(kv->pbuckets);
        size_t bb = kv->block_bytes;
        free(kv);
        return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "kv: cannot reserve %llu B for the block pool",
                        (unsigned long long)nb * bb);
    }
    /* Lowest ids on top so that a fresh pool hands out blocks in order. */
    for (uint32_t i = 0; i < kv->blocks_total; i++) kv->free_ids[i] = kv->blocks_total - 1 - i;
    kv->n_free = kv->blocks_total;
    for (uint32_t i = 0; i < kv->blocks_total; i++) kv->bm[i].hnext = kv->bm[i].cprev = kv->bm[i].cnext = KV_NONE;
    for (uint32_t i = 0; i < kv->n_pbuckets; i++) kv->pbuckets[i] = KV_NONE;
    kv->cache_head = kv->cache_tail = KV_NONE;
    /* One session can hold at most the whole pool: that is its cap (INFO max_ctx). */
    uint64_t pool_positions = (uint64_t)kv->blocks_total * (uint64_t)p->block_tokens;
    if (kv->p.max_positions > pool_positions) kv->p.max_positions = (uint32_t)pool_positions;
    for (int b = 0; b < KV_HASH_BUCKETS; b++) kv->tomb_buckets[b] = KV_TOMB_NONE;
    for (uint32_t i = 0; i < kv->p.max_tombstones; i++) {
        kv->tombs[i].next = kv->tombs[i].older = KV_TOMB_NONE;
        kv->tombs[i].newer = i + 1 < kv->p.max_tombstones ? (int32_t)(i + 1) : KV_TOMB_NONE;
    }
    kv->tomb_free = 0;
    kv->tomb_oldest = kv->tomb_newest = KV_TOMB_NONE;
    kv->lru.lru_next = kv->lru.lru_prev = &kv->lru;
    pthread_mutex_init(&kv->lock, NULL);
    kv->st.budget_bytes = p->budget_bytes;
    kv->st.block_bytes = kv->block_bytes;
    kv->st.blocks_total = kv->blocks_total;
    if (p->tenant_max_bytes) {
        kv->quota_blocks = p->tenant_max_bytes / kv->block_bytes;
        if (kv->quota_blocks == 0) kv->quota_blocks = 1;
    }
    *out = kv;
    return KVS_OK;
}

void kv_free(kv_state *kv) {
    if (!kv) return;
    for (int b = 0; b < KV_HASH_BUCKETS; b++) {
        kv_session *s = kv->buckets[b];
        while (s) {
            kv_session *next = s->hash_next;
            free(s->blocks);
            free(s->owner);
            free(s);
            s = next;
        }
    }
    for (int b = 0; b < KV_TENANT_BUCKETS; b++)
        for (kv_tenant *t = kv->tenants[b], *next; t; t = next) {
            next = t->next;
            free(t);
        }
    kvs_unmap_big(kv->arena, kv->arena_mapped);
    free(kv->free_ids);
    free(kv->tombs);
    free(kv->bm);
    free(kv->pbuckets);
    pthread_mutex_destroy(&kv->lock);
    free(kv);
}

size_t kv_block_bytes(const kv_state *kv) { return kv->block_bytes; }

size_t kv_params_block_bytes(const kv_params *p) {
    if (p->n_layers < 1 || p->n_kv_heads < 1 || p->head_dim < 1 || p->block_tokens < 1) return 0;
    size_t row = kv_row_bytes(p->kv_type, p->head_dim);
    return (size_t)p->block_tokens * (size_t)p->n_layers * 2 * (size_t)p->n_kv_heads * row;
}

bool kv_type_supported(uint32_t type) {
    return type == QUANT_F16 || type == QUANT_F32 || type == QUANT_Q8_0 || type == QUANT_Q4_0;
}

bool kv_type_is_block(uint32_t type) { return type == QUANT_Q8_0 || type == QUANT_Q4_0; }

size_t kv_row_bytes(uint32_t type, int head_dim) {
    uint64_t bytes;
    if (head_dim < 1 || !kv_type_supported(type) || !quant_row_bytes(type, (uint64_t)head_dim, &bytes)) return 0;
    return (size_t)bytes;
}
const kv_params *kv_get_params(const kv_state *kv) { return &kv->p; }

/* ---- begin / commit / abort ---------------------------------------------- */

/* Working counters of one eviction plan (I9): a tenant's are copied in when first touched. */
typedef struct {
    uint64_t gen, n_free, fair_blocks;
    uint32_t n_sessions, fair_sessions, need;
    bool new_session, apply;
} kv_plan;

static void plan_touch(const kv_plan *pl, kv_tenant *u) {
    if (u->plan_gen == pl->gen) return;
    u->plan_gen = pl->gen;
    u->plan_sessions = u->n_sessions;
    u->plan_blocks = u->n_blocks;
}

/* Blocks that evicting s would hand back (I10: a shared block only with its last holder), counted
 * per block across the plan's victims so that dry and applied runs decide alike. */
static uint32_t plan_freed(kv_state *kv, const kv_plan *pl, const kv_session *s) {
    uint32_t freed = 0;
    for (uint32_t i = 0; i < s->n_blocks; i++) {
        kv_bmeta *m = &kv->bm[s->blocks[i]];
        if (m->plan_gen != pl->gen) {
            m->plan_gen = pl->gen;
            m->plan_refs = m->refs;
        }
        if (--m->plan_refs == 0) freed++;
    }
    return freed;
}

static void plan_take(kv_state *kv, kv_plan *pl, kv_session *s, bool own_quota) {
    kv_tenant *u = s->tenant;
    plan_touch(pl, u);
    uint32_t freed = plan_freed(kv, pl, s);
    u->plan_blocks -= freed;
    u->plan_sessions--;
    pl->n_free += freed;
    pl->n_sessions--;
    s->plan_gen = pl->gen;
    if (!pl->apply) return;
    kv_drop(kv, s);
    kv->st.evict_lru++;
    if (own_quota) kv->st.evict_quota++;
}

static bool plan_over_quota(const kv_state *kv, const kv_plan *pl, const kv_tenant *t) {
    return (kv->quota_blocks && t->plan_blocks + pl->need > kv->quota_blocks) ||
           (pl->new_session && kv->p.tenant_max_sessions && t->plan_sessions >= kv->p.tenant_max_sessions);
}

static bool plan_slot_short(const kv_state *kv, const kv_plan *pl) {
    return pl->new_session && kv->p.max_sessions && pl->n_sessions >= kv->p.max_sessions;
}

/* One pass of the two-phase plan (I9), dry (apply false: nothing changes) or applying it. */
static int kv_plan_run(kv_state *kv, kv_tenant *t, uint32_t need, bool new_session, const kv_session *keep,
                       bool apply, bool *over_quota) {
    kv_plan pl = {.gen = ++kv->plan_gen, .n_free = kv_avail(kv), .n_sessions = kv->n_sessions, .need = need,
                  .new_session = new_session, .apply = apply};
    plan_touch(&pl, t);
    kv_session *s, *prev;
    for (s = kv->lru.lru_prev; s != &kv->lru && plan_over_quota(kv, &pl, t); s = prev) {
        prev = s->lru_prev;
        if (s != keep && s->tenant == t) plan_take(kv, &pl, s, true);
    }
    if (plan_over_quota(kv, &pl, t)) {
        *over_quota = true;
        return kv->quota_blocks && t->plan_blocks + need > kv->quota_blocks ? KVS_ERR_BUDGET_EXHAUSTED : KVS_ERR_BUSY;
    }
    uint32_t n_ten = kv->n_tenants ? kv->n_tenants : 1;
    pl.fair_blocks = kv->blocks_total / n_ten;
    pl.fair_sessions = kv->p.max_sessions / n_ten;
    /* Tenants over their fair share pay first (the requester too, when it is over), LRU first;
     * then the requester's own sessions. */
    for (int pass = 0; pass < 2; pass++)
        for (s = kv->lru.lru_prev; s != &kv->lru && (pl.n_free < need || plan_slot_short(kv, &pl)); s = prev) {
            prev = s->lru_prev;
            if (s == keep || s->plan_gen == pl.gen) continue;
            kv_tenant *u = s->tenant;
            plan_touch(&pl, u);
            bool over = (pl.n_free < need && u->plan_blocks > pl.fair_blocks) ||
                        (plan_slot_short(kv, &pl) && u->plan_sessions > pl.fair_sessions);
            if (pass == 0 ? over : u == t) plan_take(kv, &pl, s, false);
        }
    if (pl.n_free < need) return KVS_ERR_BUDGET_EXHAUSTED;
    if (plan_slot_short(kv, &pl)) return KVS_ERR_BUSY;
    return KVS_OK;
}

/* Makes room for tenant t: `need` free blocks and, when new_session, a session slot (its own
 * quota and max_sessions), evicting idle sessions (never `keep`) by the plan of I9. Evicts
 * nothing when the plan falls short: KVS_ERR_BUDGET_EXHAUSTED (blocks) or KVS_ERR_BUSY (session
 * slot), *over_quota when the tenant's own quota is what it cannot meet. KVS_OK when done. */
static int kv_make_room(kv_state *kv, kv_tenant *t, uint32_t need, bool new_session, const kv_session *keep,
                        bool *over_quota) {
    *over_quota = false;
    int err = kv_plan_run(kv, t, need, new_session, keep, false, over_quota);
    if (err) return err;
    err = kv_plan_run(kv, t, need, new_session, keep, true, over_quota);
    KVS_ASSERT(err == KVS_OK);
    return err;
}

static void *block_slot(const kv_state *kv, uint32_t block, int layer, int kind, int head, uint32_t slot) {
    size_t off = (size_t)block * kv->block_bytes +
                 (((((size_t)layer * (size_t)kv->p.n_kv_heads + (size_t)head) * 2 + (size_t)kind) *
                   (size_t)kv->p.block_tokens) + slot) * kv->head_bytes;
    return kv->arena + off;
}

int kv_begin(kv_state *kv, const kv_sid *sid, uint64_t epoch, uint32_t start_pos, uint32_t n,
             const kv_inherit *inherit, kv_txn **out, kv_reply *rep) {
    return kv_begin_tenant(kv, 0, sid, epoch, start_pos, n, inherit, out, rep);
}

/* The tenant record of tag, made when missing (NULL: out of memory). */
kv_tenant *kv_tenant_get(kv_state *kv, uint64_t tag) {
    kv_tenant **pp = tenant_slot(kv, tag);
    if (*pp) return *pp;
    kv_tenant *t = kv_alloc(kv, sizeof(*t));
    if (!t) return NULL;
    memset(t, 0, sizeof(*t));
    t->tag = tag;
    *pp = t;
    kv->n_tenants++;
    return t;
}

int kv_begin_tenant(kv_state *kv, uint64_t tenant, const kv_sid *sid, uint64_t epoch, uint32_t start_pos, uint32_t n,
                    const kv_inherit *inherit, kv_txn **out, kv_reply *rep) {
    return kv_begin_prefix(kv, tenant, sid, epoch, start_pos, n, inherit, NULL, out, rep);
}

/* The hashes of the blocks a transaction completes past its shared part, copied for kv_commit
 * (I10). NULL with *n 0 when none is known; *nomem when the copy could not be made. */
static uint64_t *key_hashes(kv_state *kv, const kv_prefix *pre, uint32_t first, uint32_t end_block, uint32_t *n,
                            bool *nomem) {
    *n = 0;
    *nomem = false;
    if (!pre || end_block <= first) return NULL;
    uint32_t count = end_block - first, valid = 0;
    uint64_t h;
    for (uint32_t i = 0; i < count; i++) valid += pre_hash(kv, pre, first + i, &h);
    if (!valid) return NULL;
    uint64_t *keys = kv_alloc(kv, (size_t)count * (sizeof(uint64_t) + 1));
    if (!keys) {
        *nomem = true;
        return NULL;
    }
    uint8_t *ok = (uint8_t *)(keys + count);
    for (uint32_t i = 0; i < count; i++) ok[i] = pre_hash(kv, pre, first + i, &keys[i]);
    *n = count;
    return keys;
}

/* In place may not write a block another table shares (I10): true when one of the old blocks
 * from `from` on is shared. */
static bool old_blocks_shared(const kv_state *kv, const kv_session *s, uint32_t from, uint32_t to) {
    for (uint32_t i = from; i < to && i < s->n_blocks; i++)
        if (kv->bm[s->blocks[i]].refs > 1) return true;
    return false;
}

int kv_begin_prefix(kv_state *kv, uint64_t tenant, const kv_sid *sid, uint64_t epoch, uint32_t start_pos, uint32_t n,
                    const kv_inherit *inherit, const kv_prefix *pre, kv_txn **out, kv_reply *rep) {
    kv_reply r = {0};
    int err = KVS_OK;
    *out = NULL;
    if (n == 0) return KVS_ERR_INVALID_ARG;
    pthread_mutex_lock(&kv->lock);
    kv_sweep_locked(kv, KV_SWEEP_PER_BEGIN);
    kv_session *s = kv_find(kv, sid);
    kv_tenant *t = NULL;
    uint32_t keep = 0;          /* positions of the old state that stay */
    bool inherit_ok = false, rewind = false;
    if (s) {
        r.live_epoch = s->epoch;
        r.n_past = s->n_past;
        if (s->inflight) { kv->st.busy++; err = KVS_ERR_BUSY; goto done; }
        if (epoch < s->epoch) { kv->st.stale++; err = KVS_ERR_STALE_EPOCH; goto done; }
        if (epoch == s->epoch) {
            keep = start_pos < s->n_past ? start_pos : s->n_past;
            rewind = start_pos < s->n_past;
        } else if (inherit && inherit->old_epoch == s->epoch) {
            keep = inherit->len < s->n_past ? inherit->len : s->n_past;
            inherit_ok = true;
            if (start_pos < keep) { keep = start_pos; }
        }
    } else {
        int32_t ti = kv_tomb_find(kv, sid);
        if (ti >= 0 && epoch < kv->tombs[ti].epoch) {
            r.live_epoch = kv->tombs[ti].epoch;
            kv->st.stale++;
            err = KVS_ERR_STALE_EPOCH;
            goto done;
        }
    }
    /* Past the cap no replay could help: say so before any CACHE_MISS. */
    if ((uint64_t)start_pos + n > kv->p.max_positions) { err = KVS_ERR_CONTEXT_FULL; goto done; }
    uint32_t bt = (uint32_t)kv->p.block_tokens;
    uint32_t have = keep;       /* what a CACHE_MISS answers */
    uint32_t n_adopt = 0;       /* I10: blocks below start_pos taken from the prefix index */
    if (pre && start_pos > keep && keep == 0 && !inherit_ok) {
        uint64_t tag = s ? s->tenant->tag : tenant;
        uint32_t run = prefix_run(kv, tag, pre, start_pos / bt);
        if (run == start_pos / bt && start_pos % bt == 0) {
            if (s) { /* a newer epoch that inherits nothing supersedes the old state now */
                kv_drop(kv, s);
                kv_tomb_put(kv, sid, epoch);
                s = NULL;
                r.n_past = 0;
                r.live_epoch = epoch;
            }
            tenant = tag;
            keep = start_pos;
            n_adopt = run;
        } else {
            have = run * bt;
            kv->st.prefix_short++;
        }
    }
    if (start_pos > keep) {
        r.have = have;
        kv->st.misses++;
        err = KVS_ERR_CACHE_MISS;
        /* A newer epoch that inherits nothing supersedes the old state now (DESIGN §2). */
        if (s && epoch > s->epoch && !inherit_ok) {
            kv_drop(kv, s);
            kv_tomb_put(kv, sid, epoch);
            r.n_past = 0;
            r.live_epoch = epoch;
        }
        goto done;
    }

    /* Plan the working table: copy-on-write when the free blocks cover it, else in place (I7). */
    uint32_t n_full = keep / bt;          /* wholly kept blocks, shared */
    uint32_t partial = keep % bt;         /* kept slots of the next block */
    bool live_past_keep = s && keep < s->n_past; /* slots past keep hold live data */
    /* A keyed block is read-only (I10): its dead slots are another session's live ones. */
    bool partial_ro = partial && s && n_full < s->n_blocks && kv->bm[s->blocks[n_full]].keyed;
    bool share_partial = partial && !live_past_keep && !partial_ro;
    uint32_t n_table = blocks_for(kv, start_pos + n);
    uint32_t n_shared = n_adopt ? 0 : n_full + (share_partial ? 1 : 0);
    uint32_t n_old = s ? s->n_blocks : 0;
    t = s ? s->tenant : kv_tenant_get(kv, tenant);
    if (!t) { err = KVS_ERR_NOMEM; goto done; }
    kv->cur_tenant = t;
    /* In place also when copy-on-write would take the tenant past its quota (I7, I9); never over
     * a block another table shares (I10). */
    bool in_place = n_old > n_shared && (kv_avail(kv) < n_table - n_shared ||
                                         (kv->quota_blocks && t->n_blocks + (n_table - n_shared) > kv->quota_blocks));
    if (in_place && old_blocks_shared(kv, s, start_pos / bt, n_table)) in_place = false;
    if (in_place) n_shared = n_old < n_table ? n_old : n_table;
    bool copy_partial = partial && (live_past_keep || partial_ro) && !in_place;
    uint32_t n_fresh = n_table - n_shared - n_adopt;

    /* I7: in place, the old contents of the reused blocks the request writes into are kept
     * aside until commit, so that kv_abort can put them back. */
    uint32_t undo_first = start_pos / bt;
    size_t undo_bytes = in_place && n_shared > undo_first ? (size_t)(n_shared - undo_first) * kv->block_bytes : 0;
    uint32_t key_first = n_shared + n_adopt, key_n = 0;
    bool key_nomem = false;
    kv_txn *txn = kv_alloc(kv, sizeof(*txn));
    uint32_t *table = kv_alloc(kv, (size_t)n_table * sizeof(uint32_t));
    kv_session *fresh_s = s ? NULL : kv_alloc(kv, sizeof(*fresh_s));
    uint8_t *undo = undo_bytes ? kv_alloc(kv, undo_bytes) : NULL;
    uint64_t *keys = key_hashes(kv, pre, key_first, (start_pos + n) / bt, &key_n, &key_nomem);
    if (!txn || !table || (!s && !fresh_s) || (undo_bytes && !undo) || key_nomem) {
        free(txn); free(table); free(fresh_s); free(undo); free(keys);
        err = KVS_ERR_NOMEM;
        goto done;
    }
    /* I10: the adopted blocks are held before any eviction, so none of them can be taken back. */
    for (uint32_t i = 0; i < n_adopt; i++) {
        uint64_t h = 0;
        pre_hash(kv, pre, i, &h);
        table[i] = index_find(kv, t->tag, h);
        block_ref(kv, t, table[i]);
    }
    bool over_quota = false;
    if ((err = kv_make_room(kv, t, n_fresh, !s, s, &over_quota)) != KVS_OK) {
        kv_free_blocks(kv, t, table, n_adopt);
        free(txn); free(table); free(fresh_s); free(undo); free(keys);
        r.pinned_short = err == KVS_ERR_BUSY || (uint64_t)kv->blocks_total - n_old >= n_fresh;
        if (over_quota) {
            /* Only the tenant's own pinned sessions can make room within its quota. */
            r.pinned_short = err == KVS_ERR_BUSY || kv->quota_blocks >= (uint64_t)n_old + n_fresh;
            r.over_quota = true;
            kv->st.quota_refusals++;
        }
        /* A pinned_short BUSY is one the caller may retry itself: it counts only if the caller
         * answers it (kv_note_busy). */
        if (err == KVS_ERR_BUSY && !r.pinned_short) kv->st.busy++;
        goto done;
    }
    for (uint32_t i = 0; i < n_shared; i++) table[i] = s->blocks[i];
    for (uint32_t i = n_shared + n_adopt; i < n_table; i++) table[i] = take_block(kv, t);
    /* In place rewrites its own blocks: one it alone holds stops being a prefix block (I10). */
    for (uint32_t i = undo_first; in_place && i < n_shared; i++)
        if (kv->bm[table[i]].keyed) index_remove(kv, table[i]);
    if (copy_partial) {
        uint32_t src = s->blocks[n_full], dst = table[n_full];
        for (int l = 0; l < kv->p.n_layers; l++)
            for (int kind = 0; kind < 2; kind++)
                for (int h = 0; h < kv->p.n_kv_heads; h++)
                    memcpy(block_slot(kv, dst, l, kind, h, 0), block_slot(kv, src, l, kind, h, 0), partial * kv->head_bytes);
    }
    if (!s) {
        s = fresh_s;
        memset(s, 0, sizeof(*s));
        s->sid = *sid;
        s->epoch = epoch;
        s->tenant = t;
        uint32_t h = kv_hash(sid);
        s->hash_next = kv->buckets[h];
        kv->buckets[h] = s;
        kv->n_sessions++;
        t->n_sessions++;
    } else {
        kv->st.hits++;
    }
    if (n_adopt) {
        kv->st.prefix_hits++;
        kv->st.prefix_positions += keep;
        r.prefix = keep;
    }
    memset(txn, 0, sizeof(*txn));
    txn->s = s;
    txn->created = fresh_s != NULL;
    txn->epoch = epoch;
    txn->start = start_pos;
    txn->end = start_pos + n;
    txn->table = table;
    txn->n_table = n_table;
    txn->n_shared = n_shared;
    txn->n_adopt = n_adopt;
    txn->key_first = key_first;
    txn->key_n = key_n;
    txn->key_hash = keys;
    txn->in_place = in_place;
    txn->undo = undo;
    txn->undo_first = undo_first;
    if (in_place) kv->st.in_place++;
    txn->rewind = rewind;
    txn->inherit = inherit_ok;
    txn->kv = kv;
    atomic_init(&txn->cancel, false);
    s->inflight = txn;
    lru_unlink(s);
    s->last_used = kv->p.clock(kv->p.clock_ctx);
    r.n_past = s->n_past;
    r.live_epoch = s->epoch;
    *out = txn;
done:
    kv->cur_tenant = NULL;
    if (t) kv_tenant_release(kv, t); /* a new tenant whose begin failed */
    if (rep) *rep = r;
    pthread_mutex_unlock(&kv->lock);
    /* The pin keeps everyone else off these blocks: the copy needs no lock. */
    if (err == KVS_OK && (*out)->undo) {
        const kv_txn *tx = *out;
        for (uint32_t b = tx->undo_first; b < tx->n_shared; b++)
            memcpy(tx->undo + (size_t)(b - tx->undo_first) * kv->block_bytes,
                   kv->arena + (size_t)tx->table[b] * kv->block_bytes, kv->block_bytes);
    }
    return err;
}

/* I10: the full blocks the transaction completed are keyed under the session's tenant, or, when
 * an equal block is keyed already, replaced by it (the fresh copy goes back: charged once). */
static void commit_keys(kv_state *kv, const kv_txn *txn, kv_session *s) {
    const uint8_t *ok = (const uint8_t *)(txn->key_hash + txn->key_n);
    kv_tenant *t = s->tenant;
    for (uint32_t i = 0; i < txn->key_n; i++) {
        uint32_t b = txn->key_first + i;
        if (!ok[i] || b >= s->n_blocks || kv->bm[s->blocks[b]].keyed) continue;
        uint32_t have = index_find(kv, t->tag, txn->key_hash[i]);
        if (have == KV_NONE) {
            index_add(kv, s->blocks[b], txn->key_hash[i]);
            continue;
        }
        block_ref(kv, t, have);
        block_unref(kv, t, s->blocks[b]);
        s->blocks[b] = have;
        kv->st.prefix_dedups++;
    }
}

void kv_commit(kv_state *kv, kv_txn *txn, kv_reply *rep) {
    pthread_mutex_lock(&kv->lock);
    kv_session *s = txn->s;
    /* Old blocks the new table does not share go back to the pool. */
    if (s->n_blocks > txn->n_shared)
        kv_free_blocks(kv, s->tenant, s->blocks + txn->n_shared, s->n_blocks - txn->n_shared);
    free(s->blocks);
    s->blocks = txn->table;
    s->n_blocks = txn->n_table;
    if (txn->key_hash) commit_keys(kv, txn, s);
    s->n_past = txn->end;
    s->epoch = txn->epoch;
    s->inflight = NULL;
    s->last_used = kv->p.clock(kv->p.clock_ctx);
    kv_lru_push_front(kv, s);
    kv->st.appends++;
    if (txn->rewind) kv->st.rewinds++;
    if (txn->inherit) kv->st.inherits++;
    if (rep) {
        rep->have = s->n_past;
        rep->n_past = s->n_past;
        rep->live_epoch = s->epoch;
    }
    free(txn->undo);
    free(txn->key_hash);
    free(txn);
    pthread_mutex_unlock(&kv->lock);
}

void kv_abort(kv_state *kv, kv_txn *txn, bool cancelled) {
    /* I7: the reused blocks get their old contents back (still pinned: no lock needed). */
    for (uint32_t b = txn->undo_first; txn->undo && b < txn->n_shared; b++)
        memcpy(kv->arena + (size_t)txn->table[b] * kv->block_bytes,
               txn->undo + (size_t)(b - txn->undo_first) * kv->block_bytes, kv->block_bytes);
    pthread_mutex_lock(&kv->lock);
    kv_session *s = txn->s;
    kv_free_blocks(kv, s->tenant, txn->table + txn->n_shared, txn->n_table - txn->n_shared);
    free(txn->table);
    s->inflight = NULL;
    if (cancelled) kv->st.cancellations++;
    if (txn->created) {
        /* The session never existed for anyone else: no tombstone, the id's remembered epoch
         * (if any) stays as it was. */
        kv_remove(kv, s, false);
    } else {
        s->last_used = kv->p.clock(kv->p.clock_ctx);
        kv_lru_push_front(kv, s);
    }
    free(txn->undo);
    free(txn->key_hash);
    free(txn);
    pthread_mutex_unlock(&kv->lock);
}

void kv_note_busy(kv_state *kv) {
    pthread_mutex_lock(&kv->lock);
    kv->st.busy++;
    pthread_mutex_unlock(&kv->lock);
}

void kv_note_cancel(kv_state *kv) {
    pthread_mutex_lock(&kv->lock);
    kv->st.cancellations++;
    pthread_mutex_unlock(&kv->lock);
}

uint32_t kv_txn_start(const kv_txn *txn) { return txn->start; }
uint32_t kv_txn_end(const kv_txn *txn) { return txn->end; }

/* The row of (layer, K or V, head) at pos in txn's table. */
static void *txn_row(const kv_txn *txn, int layer, int kind, uint32_t pos, int head) {
    uint32_t bt = (uint32_t)txn->kv->p.block_tokens;
    return block_slot(txn->kv, txn->table[pos / bt], layer, kind, head, pos % bt);
}

void *kv_txn_k(const kv_txn *txn, int layer, uint32_t pos, int head) { return txn_row(txn, layer, 0, pos, head); }
void *kv_txn_v(const kv_txn *txn, int layer, uint32_t pos, int head) { return txn_row(txn, layer, 1, pos, head); }

void kv_txn_head_rows(const kv_txn *txn, int layer, int head, uint32_t n, const void **k, const void **v) {
    const kv_state *kv = txn->kv;
    const uint32_t bt = (uint32_t)kv->p.block_tokens;
    const size_t row = kv->head_bytes;
    for (uint32_t b = 0, p = 0; p < n; b++) { /* a block's slots: the head's rows, row bytes apart */
        const uint8_t *kr = block_slot(kv, txn->table[b], layer, 0, head, 0);
        const uint8_t *vr = block_slot(kv, txn->table[b], layer, 1, head, 0);
        const uint32_t end = n - p < bt ? n : p + bt;
        for (; p < end; p++, kr += row, vr += row) {
            k[p] = kr;
            v[p] = vr;
        }
    }
}

bool kv_txn_cancelled(const kv_txn *txn) { return atomic_load_explicit(&txn->cancel, memory_order_relaxed); }

int kv_cancel(kv_state *kv, const kv_sid *sid) {
    pthread_mutex_lock(&kv->lock);
    kv_session *s = kv_find(kv, sid);
    int err = KVS_ERR_NOT_FOUND;
    if (s && s->inflight) {
        atomic_store_explicit(&s->inflight->cancel, true, memory_order_relaxed);
        err = KVS_OK;
    }
    pthread_mutex_unlock(&kv->lock);
    return err;
}

/* ---- truncate / release / queries --------------------------------------- */

/* Finds (sid, epoch) for a non-append op; fills rep and returns an error when
 * it is absent (CACHE_MISS, or STALE_EPOCH below a tombstone), stale, or busy.
 * A newer epoch than the live one drops the live state first (DESIGN §2) and
 * returns CACHE_MISS with *dropped set. */
static int kv_resolve(kv_state *kv, const kv_sid *sid, uint64_t epoch, kv_session **out, kv_reply *r, bool *dropped) {
    kv_session *s = kv_find(kv, sid);
    *dropped = false;
    if (!s) {
        int32_t ti = kv_tomb_find(kv, sid);
        if (ti >= 0 && epoch < kv->tombs[ti].epoch) {
            r->live_epoch = kv->tombs[ti].epoch;
            kv->st.stale++;
            return KVS_ERR_STALE_EPOCH;
        }
        r->have = 0;
        kv->st.misses++;
        return KVS_ERR_CACHE_MISS;
    }
    r->live_epoch = s->epoch;
    r->n_past = s->n_past;
    r->have = s->n_past;
    if (epoch < s->epoch) { kv->st.stale++; return KVS_ERR_STALE_EPOCH; }
    if (s->inflight) { kv->st.busy++; return KVS_ERR_BUSY; }
    if (epoch > s->epoch) {
        kv_drop(kv, s);
        kv_tomb_put(kv, sid, epoch);
        r->have = r->n_past = 0;
        r->live_epoch = epoch;
        *dropped = true;
        return KVS_ERR_CACHE_MISS;
    }
    *out = s;
    return KVS_OK;
}

int kv_truncate(kv_state *kv, const kv_sid *sid, uint64_t epoch, uint32_t len, kv_reply *rep) {
    kv_reply r = {0};
    kv_session *s = NULL;
    bool dropped;
    pthread_mutex_lock(&kv->lock);
    int err = kv_resolve(kv, sid, epoch, &s, &r, &dropped);
    if (dropped && len == 0) err = KVS_OK; /* the newer epoch holds nothing: truncated to 0 */
    if (err == KVS_OK && s && len > s->n_past) err = KVS_ERR_INVALID_ARG;
    if (err == KVS_OK && s && len == 0) {
        kv_drop(kv, s); /* no positions, no slot (max_sessions); the epoch stays as a tombstone */
        kv->st.truncates++;
        r.n_past = r.have = 0;
    } else if (err == KVS_OK && s) {
        uint32_t nb = blocks_for(kv, len);
        kv_free_blocks(kv, s->tenant, s->blocks + nb, s->n_blocks - nb);
        s->n_blocks = nb;
        s->n_past = len;
        s->last_used = kv->p.clock(kv->p.clock_ctx);
        lru_unlink(s);
        kv_lru_push_front(kv, s);
        kv->st.truncates++;
        r.n_past = r.have = len;
    }
    if (rep) *rep = r;
    pthread_mutex_unlock(&kv->lock);
    return err;
}

int kv_release(kv_state *kv, const kv_sid *sid, uint64_t epoch, kv_reply *rep) {
    kv_reply r = {0};
    kv_session *s = NULL;
    bool dropped;
    pthread_mutex_lock(&kv->lock);
    int err = kv_resolve(kv, sid, epoch, &s, &r, &dropped);
    if (err == KVS_OK || dropped) {
        if (s) kv_drop(kv, s);
        kv->st.releases++;
        r.n_past = r.have = 0;
        err = KVS_OK;
    }
    if (rep) *rep = r;
    pthread_mutex_unlock(&kv->lock);
    return err;
}

int kv_lookup(kv_state *kv, const kv_sid *sid, uint64_t *epoch, uint32_t *n_past) {
    pthread_mutex_lock(&kv->lock);
    kv_session *s = kv_find(kv, sid);
    if (s) {
        if (epoch) *epoch = s->epoch;
        if (n_past) *n_past = s->n_past;
    }
    pthread_mutex_unlock(&kv->lock);
    return s ? KVS_OK : KVS_ERR_NOT_FOUND;
}

int kv_set_owner(kv_state *kv, const kv_sid *sid, const void *owner, size_t len) {
    if (len > KV_OWNER_MAX) return KVS_ERR_INVALID_ARG;
    pthread_mutex_lock(&kv->lock);
    kv_session *s = kv_find(kv, sid);
    int err = s ? KVS_OK : KVS_ERR_NOT_FOUND;
    if (s && (s->owner_len != len || (len && memcmp(s->owner, owner, len)))) {
        uint8_t *o = len ? kv_alloc(kv, len) : NULL;
        if (len && !o) {
            err = KVS_ERR_NOMEM;
        } else {
            if (len) memcpy(o, owner, len);
            free(s->owner);
            s->owner = o;
            s->owner_len = (uint32_t)len;
        }
    }
    pthread_mutex_unlock(&kv->lock);
    return err;
}

uint32_t kv_list_idle(kv_state *kv, kv_sid *out, uint32_t cap) {
    pthread_mutex_lock(&kv->lock);
    uint32_t n = 0;
    for (kv_session *s = kv->lru.lru_prev; s != &kv->lru && n < cap; s = s->lru_prev) out[n++] = s->sid;
    pthread_mutex_unlock(&kv->lock);
    return n;
}

uint32_t kv_debug_blocks(kv_state *kv, const kv_sid *sid, uint32_t *ids, uint32_t cap) {
    pthread_mutex_lock(&kv->lock);
    kv_session *s = kv_find(kv, sid);
    uint32_t n = s ? s->n_blocks : 0;
    for (uint32_t i = 0; i < n && i < cap; i++) ids[i] = s->blocks[i];
    pthread_mutex_unlock(&kv->lock);
    return n;
}

void kv_get_stats(kv_state *kv, kv_stats *st) {
    pthread_mutex_lock(&kv->lock);
    *st = kv->st;
    st->sessions = kv->n_sessions;
    st->blocks_free = kv->n_free;
    st->tombstones = kv->n_tombs;
    st->tenants = kv->n_tenants;
    /* Sessions' blocks only: cached prefix blocks are reported apart (evictable, I10). */
    st->bytes_used = (uint64_t)(kv->blocks_total - kv->n_free - kv->n_cached) * kv->block_bytes;
    st->prefix_blocks = kv->n_keyed;
    st->cached_blocks = kv->n_cached;
    st->cached_bytes = (uint64_t)kv->n_cached * kv->block_bytes;
    pthread_mutex_unlock(&kv->lock);
}

void kv_tenant_usage(kv_state *kv, uint64_t tenant, uint32_t *sessions, uint64_t *bytes) {
    pthread_mutex_lock(&kv->lock);
    kv_tenant *t = *tenant_slot(kv, tenant);
    if (sessions) *sessions = t ? t->n_sessions : 0;
    if (bytes) *bytes = t ? t->n_blocks * kv->block_bytes : 0;
    pthread_mutex_unlock(&kv->lock);
}
