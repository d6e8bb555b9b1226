/*
 * kv_snapshot — a shard's hot KV state as a byte stream: the sessions (every block of their
 * positions, epoch, n_past, owner tenant, idle age) and the tombstones, for a restart
 * (serve --state-dir) and for moving a session to another shard.
 *
 * NOTES ON THE DESIGN
 *
 * Format (little-endian; docs/hot-kv-state.md "Snapshots" is the reference):
 *   header   96 B  magic "KVSSNAP\n", version, flags, model digest, layer range, KV type and
 *                  geometry (n_layers, n_kv_heads, head_dim, block_tokens, block_bytes), sum
 *   session  64 B  "SESS", n_past, id, tenant, epoch, idle ns, n_blocks, owner_len, sum; then the
 *                  owner (owner_len bytes, 8 B sum) when owner_len > 0; then n_blocks x
 *                  (block_bytes of the block, 8 B sum)
 *   tomb     48 B  "TOMB", id, epoch, age ns, sum
 *   end      24 B  "END.", sessions, tombstones, sum
 * Every sum is kv_snap_sum of its record seeded with the sum of the record before it (a
 * block's with its session record's sum plus its index), so a flipped byte, a record dropped,
 * swapped or cut short fails the check of that record or of the trailer.
 *
 * Atomicity of an import: it runs under kv->lock; a session's blocks are taken off the free
 * stack and filled from the stream, and the session is linked only when every block's sum
 * matched. Tombstones are collected aside and applied after the trailer checked out. Any
 * refusal removes the sessions added so far without tombstones (kv_remove(remember false)),
 * which leaves the pool, the table, the tenants and the counters as they were.
 */
#include <stdlib.h>
#include <string.h>

#include "kvstate.h"
#include "kvstate_impl.h"
#include "util.h"

#define SNAP_MAGIC "KVSSNAP\n"
#define SNAP_HEAD 96u
#define SNAP_SESS 64u
#define SNAP_TOMB 48u
#define SNAP_END 24u
#define TAG_SESS 0x53534553u /* "SESS" */
#define TAG_TOMB 0x424d4f54u /* "TOMB" */
#define TAG_END 0x2e444e45u  /* "END." */

static const uint64_t P1 = 0x9E3779B185EBCA87ull, P2 = 0xC2B2AE3D27D4EB4Full, P3 = 0x165667B19E3779F9ull,
                      P4 = 0x85EBCA77C2B2AE63ull, P5 = 0x27D4EB2F165667C5ull;

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

uint64_t kv_snap_sum(const void *buf, size_t len, uint64_t seed) {
    const uint8_t *p = buf;
    uint64_t h0 = seed + P1 + P2, h1 = seed + P2, h2 = seed, h3 = seed - P1;
    size_t i = 0;
    for (; i + 32 <= len; i += 32) { /* four independent lanes: several GB/s on one core */
        h0 = rotl64(h0 + kvs_rd_u64(p + i) * P2, 31) * P1;
        h1 = rotl64(h1 + kvs_rd_u64(p + i + 8) * P2, 31) * P1;
        h2 = rotl64(h2 + kvs_rd_u64(p + i + 16) * P2, 31) * P1;
        h3 = rotl64(h3 + kvs_rd_u64(p + i + 24) * P2, 31) * P1;
    }
    uint64_t h = rotl64(h0, 1) + rotl64(h1, 7) + rotl64(h2, 12) + rotl64(h3, 18) + (uint64_t)len;
    for (; i + 8 <= len; i += 8) h = rotl64(h ^ (rotl64(kvs_rd_u64(p + i) * P2, 31) * P1), 27) * P1 + P4;
    for (; i < len; i++) h = rotl64(h ^ (p[i] * P5), 11) * P1;
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    return h ^ (h >> 32);
}

/* ---- export ------------------------------------------------------------------------------ */

typedef struct {
    kv_snap_write_fn w;
    void *ctx;
    uint64_t bytes;
    uint64_t chain; /* sum of the last record */
} snap_out;

static int out_put(snap_out *o, const void *buf, size_t len) {
    o->bytes += len;
    return o->w(o->ctx, buf, len);
}

/* Seals a record: its sum (seeded with the chain) into its last 8 bytes, then writes it. */
static int out_record(snap_out *o, uint8_t *rec, size_t len) {
    o->chain = kv_snap_sum(rec, len - 8, o->chain);
    kvs_wr_u64(rec + len - 8, o->chain);
    return out_put(o, rec, len);
}

static void head_fill(const kv_state *kv, const kv_snap_ident *id, uint32_t flags, uint8_t h[SNAP_HEAD]) {
    memset(h, 0, SNAP_HEAD);
    memcpy(h, SNAP_MAGIC, 8);
    kvs_wr_u32(h + 8, KV_SNAP_VERSION);
    kvs_wr_u32(h + 12, flags);
    memcpy(h + 16, id->digest, 32);
    kvs_wr_u32(h + 48, id->first);
    kvs_wr_u32(h + 52, id->last);
    kvs_wr_u32(h + 56, kv->p.kv_type);
    kvs_wr_u32(h + 60, (uint32_t)kv->p.n_layers);
    kvs_wr_u32(h + 64, (uint32_t)kv->p.n_kv_heads);
    kvs_wr_u32(h + 68, (uint32_t)kv->p.head_dim);
    kvs_wr_u32(h + 72, (uint32_t)kv->p.block_tokens);
    kvs_wr_u64(h + 80, kv->block_bytes);
}

static int export_session(kv_state *kv, snap_out *o, const kv_session *s, uint64_t now) {
    uint8_t rec[SNAP_SESS] = {0};
    kvs_wr_u32(rec, TAG_SESS);
    kvs_wr_u32(rec + 4, s->n_past);
    memcpy(rec + 8, s->sid.bytes, 16);
    kvs_wr_u64(rec + 24, s->tenant->tag);
    kvs_wr_u64(rec + 32, s->epoch);
    kvs_wr_u64(rec + 40, now > s->last_used ? now - s->last_used : 0);
    kvs_wr_u32(rec + 48, s->n_blocks);
    kvs_wr_u32(rec + 52, s->owner_len);
    int err = out_record(o, rec, sizeof rec);
    if (err == KVS_OK && s->owner_len) {
        uint8_t sum[8];
        o->chain = kv_snap_sum(s->owner, s->owner_len, o->chain);
        kvs_wr_u64(sum, o->chain);
        if ((err = out_put(o, s->owner, s->owner_len)) == KVS_OK) err = out_put(o, sum, 8);
    }
    const uint64_t seed = o->chain;
    for (uint32_t b = 0; err == KVS_OK && b < s->n_blocks; b++) {
        const uint8_t *data = kv->arena + (size_t)s->blocks[b] * kv->block_bytes;
        uint8_t sum[8];
        kvs_wr_u64(sum, kv_snap_sum(data, kv->block_bytes, seed + b));
        if ((err = out_put(o, data, kv->block_bytes)) == KVS_OK) err = out_put(o, sum, 8);
    }
    return err;
}

static int export_tombs(kv_state *kv, snap_out *o, uint64_t now, uint32_t *n) {
    int err = KVS_OK;
    for (int32_t i = kv->tomb_oldest; err == KVS_OK && i != KV_TOMB_NONE; i = kv->tombs[i].newer) {
        const kv_tomb *t = &kv->tombs[i];
        uint64_t age = now > t->when ? now - t->when : 0;
        if (age > kv->p.tombstone_ttl_ns) continue;
        uint8_t rec[SNAP_TOMB] = {0};
        kvs_wr_u32(rec, TAG_TOMB);
        memcpy(rec + 8, t->sid.bytes, 16);
        kvs_wr_u64(rec + 24, t->epoch);
        kvs_wr_u64(rec + 32, age);
        err = out_record(o, rec, sizeof rec);
        (*n)++;
    }
    return err;
}

int kv_export(kv_state *kv, const kv_snap_ident *id, const kv_sid *only, kv_snap_write_fn w, void *ctx,
              kv_snap_counts *out, char *msg, size_t msg_cap) {
    snap_out o = {.w = w, .ctx = ctx};
    uint32_t n_sess = 0, n_tomb = 0;
    uint8_t head[SNAP_HEAD], end[SNAP_END] = {0};
    pthread_mutex_lock(&kv->lock);
    uint64_t now = kv->p.clock(kv->p.clock_ctx);
    const kv_session *one = only ? kv_find(kv, only) : NULL;
    int err = KVS_OK;
    if (only && !one) err = kvs_fail(msg, msg_cap, KVS_ERR_NOT_FOUND, "kv export: no such session");
    else if (one && one->inflight) err = kvs_fail(msg, msg_cap, KVS_ERR_BUSY, "kv export: the session is in flight");
    if (err == KVS_OK) {
        head_fill(kv, id, only ? 1u : 0u, head);
        err = out_record(&o, head, sizeof head);
    }
    if (err == KVS_OK && one) {
        err = export_session(kv, &o, one, now);
        n_sess = 1;
    } else if (err == KVS_OK) {
        /* Oldest first: the import pushes each to the front, so the LRU order survives. */
        for (kv_session *s = kv->lru.lru_prev; err == KVS_OK && s != &kv->lru; s = s->lru_prev, n_sess++)
            err = export_session(kv, &o, s, now);
        if (err == KVS_OK) err = export_tombs(kv, &o, now, &n_tomb);
    }
    if (err == KVS_OK) {
        kvs_wr_u32(end, TAG_END);
        kvs_wr_u32(end + 8, n_sess);
        kvs_wr_u32(end + 12, n_tomb);
        err = out_record(&o, end, sizeof end);
    }
    pthread_mutex_unlock(&kv->lock);
    if (out) *out = (kv_snap_counts){.sessions = n_sess, .tombstones = n_tomb, .bytes = o.bytes};
    if (err != KVS_OK && msg && !msg[0]) kvs_fail(msg, msg_cap, err, "kv export: write failed: %s", kvs_strerror(err));
    return err;
}

/* ---- import ------------------------------------------------------------------------------ */

typedef struct {
    kv_snap_read_fn r;
    void *ctx;
    uint64_t bytes, chain;
    kv_session **added; /* sessions linked so far (rollback) */
    uint32_t n_added, cap_added;
    uint8_t (*tombs)[40]; /* sid 16, epoch 8, age 8, pad: applied after the trailer */
    uint32_t n_tombs, cap_tombs;
    char *msg;
    size_t msg_cap;
    kv_snap_rekey_fn rekey;
    void *rekey_ctx;
} snap_in;

static int in_get(snap_in *in, void *buf, size_t len) {
    int err = in->r(in->ctx, buf, len);
    if (err != KVS_OK) return kvs_fail(in->msg, in->msg_cap, KVS_ERR_FORMAT, "kv import: the stream ends early");
    in->bytes += len;
    return KVS_OK;
}

/* Checks the sum of a record of len bytes (the sum in its last 8) against the chain. */
static int in_check(snap_in *in, const uint8_t *rec, size_t len, const char *what) {
    uint64_t sum = kv_snap_sum(rec, len - 8, in->chain);
    if (sum != kvs_rd_u64(rec + len - 8))
        return kvs_fail(in->msg, in->msg_cap, KVS_ERR_FORMAT, "kv import: %s record %u: checksum mismatch", what,
                        in->n_added + in->n_tombs);
    in->chain = sum;
    return KVS_OK;
}

static int check_head(kv_state *kv, const kv_snap_ident *id, snap_in *in, const uint8_t *h) {
    if (memcmp(h, SNAP_MAGIC, 8) != 0)
        return kvs_fail(in->msg, in->msg_cap, KVS_ERR_FORMAT, "kv import: not a kvshard KV snapshot");
    if (kvs_rd_u32(h + 8) != KV_SNAP_VERSION)
        return kvs_fail(in->msg, in->msg_cap, KVS_ERR_FORMAT, "kv import: format version %u (this build reads %u)",
                        kvs_rd_u32(h + 8), KV_SNAP_VERSION);
    int err = in_check(in, h, SNAP_HEAD, "header");
    if (err) return err;
    if (memcmp(h + 16, id->digest, 32) != 0)
        return kvs_fail(in->msg, in->msg_cap, KVS_ERR_INVALID_ARG, "kv import: another model (digest differs)");
    if (kvs_rd_u32(h + 48) != id->first || kvs_rd_u32(h + 52) != id->last)
        return kvs_fail(in->msg, in->msg_cap, KVS_ERR_INVALID_ARG, "kv import: layers [%u, %u), this shard [%u, %u)",
                        kvs_rd_u32(h + 48), kvs_rd_u32(h + 52), id->first, id->last);
    if (kvs_rd_u32(h + 56) != kv->p.kv_type)
        return kvs_fail(in->msg, in->msg_cap, KVS_ERR_INVALID_ARG, "kv import: KV type %u, this pool %u",
                        kvs_rd_u32(h + 56), kv->p.kv_type);
    if (kvs_rd_u32(h + 60) != (uint32_t)kv->p.n_layers || kvs_rd_u32(h + 64) != (uint32_t)kv->p.n_kv_heads ||
        kvs_rd_u32(h + 68) != (uint32_t)kv->p.head_dim || kvs_rd_u32(h + 72) != (uint32_t)kv->p.block_tokens ||
        kvs_rd_u64(h + 80) != kv->block_bytes)
        return kvs_fail(in->msg, in->msg_cap, KVS_ERR_INVALID_ARG, "kv import: block geometry differs from this pool's");
    return KVS_OK;
}

/* Whether the pool can take a session of n_blocks for tenant tag without evicting anyone. */
static int import_room(kv_state *kv, snap_in *in, const kv_sid *sid, uint64_t tag, uint64_t epoch, uint32_t n_past,
                       uint32_t n_blocks) {
    if (n_past == 0 || n_blocks != blocks_for(kv, n_past))
        return kvs_fail(in->msg, in->msg_cap, KVS_ERR_FORMAT, "kv import: a session of %u positions in %u blocks",
                        n_past, n_blocks);
    if (n_past > kv->p.max_positions)
        return kvs_fail(in->msg, in->msg_cap, KVS_ERR_CONTEXT_FULL, "kv import: a session of %u positions (this pool "
                        "holds at most %u per session)", n_past, kv->p.max_positions);
    if (kv_find(kv, sid))
        return kvs_fail(in->msg, in->msg_cap, KVS_ERR_INVALID_ARG, "kv import: a session with that id is live here");
    int32_t ti = kv_tomb_find(kv, sid);
    if (ti >= 0 && epoch < kv->tombs[ti].epoch)
        return kvs_fail(in->msg, in->msg_cap, KVS_ERR_STALE_EPOCH, "kv import: epoch %llu is below the remembered %llu",
                        (unsigned long long)epoch, (unsigned long long)kv->tombs[ti].epoch);
    if (n_blocks > kv->n_free)
        return kvs_fail(in->msg, in->msg_cap, KVS_ERR_BUDGET_EXHAUSTED,
                        "kv import: %u blocks needed, %u free (an import never evicts)", n_blocks, kv->n_free);
    if (kv->p.max_sessions && kv->n_sessions >= kv->p.max_sessions)
        return kvs_fail(in->msg, in->msg_cap, KVS_ERR_BUSY, "kv import: max sessions (%u) reached", kv->p.max_sessions);
    const kv_tenant *t = NULL;
    for (t = kv->tenants[kv_tenant_bucket(tag)]; t && t->tag != tag; t = t->next) {
    }
    uint64_t held = t ? t->n_blocks : 0;
    uint32_t sessions = t ? t->n_sessions : 0;
    if (kv->quota_blocks && held + n_blocks > kv->quota_blocks)
        return kvs_fail(in->msg, in->msg_cap, KVS_ERR_BUDGET_EXHAUSTED, "kv import: over the owner's KV quota");
    if (kv->p.tenant_max_sessions && sessions >= kv->p.tenant_max_sessions)
        return kvs_fail(in->msg, in->msg_cap, KVS_ERR_BUSY, "kv import: over the owner's session quota");
    return KVS_OK;
}

/* Reads the blocks of a session into blocks popped off the free stack; on failure pushes them
 * back (the stack entries are untouched, so the pool is exactly as before). */
static int import_blocks(kv_state *kv, snap_in *in, uint32_t *ids, uint32_t n) {
    const uint64_t seed = in->chain;
    int err = KVS_OK;
    uint32_t b;
    for (b = 0; b < n; b++) ids[b] = kv->free_ids[--kv->n_free];
    for (b = 0; err == KVS_OK && b < n; b++) {
        uint8_t *data = kv->arena + (size_t)ids[b] * kv->block_bytes;
        uint8_t sum[8];
        if ((err = in_get(in, data, kv->block_bytes)) == KVS_OK && (err = in_get(in, sum, 8)) == KVS_OK &&
            kv_snap_sum(data, kv->block_bytes, seed + b) != kvs_rd_u64(sum))
            err = kvs_fail(in->msg, in->msg_cap, KVS_ERR_FORMAT, "kv import: session %u, block %u: checksum mismatch",
                           in->n_added, b);
    }
    if (err != KVS_OK) kv->n_free += n;
    return err;
}

/* The owner bytes after a session record (and their sum) into owner; then the rekey, if any. */
static int import_owner(snap_in *in, uint8_t *owner, uint32_t len, kv_sid *sid, uint64_t *tag) {
    if (len > KV_OWNER_MAX)
        return kvs_fail(in->msg, in->msg_cap, KVS_ERR_FORMAT, "kv import: an owner of %u bytes", len);
    uint8_t sum[8];
    int err = len ? in_get(in, owner, len) : KVS_OK;
    if (err == KVS_OK && len) err = in_get(in, sum, 8);
    if (err) return err;
    if (len) {
        uint64_t want = kv_snap_sum(owner, len, in->chain);
        if (want != kvs_rd_u64(sum))
            return kvs_fail(in->msg, in->msg_cap, KVS_ERR_FORMAT, "kv import: session %u: owner checksum mismatch",
                            in->n_added);
        in->chain = want;
    }
    if (in->rekey && (err = in->rekey(in->rekey_ctx, owner, len, sid, tag)) != KVS_OK)
        return kvs_fail(in->msg, in->msg_cap, err, "kv import: session %u: its owner is not acceptable here",
                        in->n_added);
    return KVS_OK;
}

static int import_session(kv_state *kv, snap_in *in, const uint8_t *rec) {
    int err = in_check(in, rec, SNAP_SESS, "session");
    if (err) return err;
    kv_sid sid;
    memcpy(sid.bytes, rec + 8, 16);
    uint32_t n_past = kvs_rd_u32(rec + 4), n_blocks = kvs_rd_u32(rec + 48), owner_len = kvs_rd_u32(rec + 52);
    uint64_t tag = kvs_rd_u64(rec + 24), epoch = kvs_rd_u64(rec + 32), idle = kvs_rd_u64(rec + 40);
    uint8_t owner[KV_OWNER_MAX];
    if ((err = import_owner(in, owner, owner_len, &sid, &tag)) != KVS_OK) return err;
    if ((err = import_room(kv, in, &sid, tag, epoch, n_past, n_blocks)) != KVS_OK) return err;
    if (in->n_added == in->cap_added) {
        uint32_t cap = in->cap_added ? in->cap_added * 2 : 64;
        kv_session **a = realloc(in->added, cap * sizeof *a);
        if (!a) return kvs_fail(in->msg, in->msg_cap, KVS_ERR_NOMEM, "kv import: out of memory");
        in->added = a;
        in->cap_added = cap;
    }
    kv_session *s = kv_alloc(kv, sizeof *s);
    uint32_t *ids = kv_alloc(kv, (size_t)n_blocks * sizeof *ids);
    uint8_t *own = owner_len ? kv_alloc(kv, owner_len) : NULL;
    kv_tenant *t = s && ids && (own || !owner_len) ? kv_tenant_get(kv, tag) : NULL;
    if (!t) {
        free(s);
        free(ids);
        free(own);
        return kvs_fail(in->msg, in->msg_cap, KVS_ERR_NOMEM, "kv import: out of memory");
    }
    if ((err = import_blocks(kv, in, ids, n_blocks)) != KVS_OK) {
        free(s);
        free(ids);
        free(own);
        kv_tenant_release(kv, t);
        return err;
    }
    for (uint32_t b = 0; b < n_blocks; b++) { /* I10: private blocks of this session, unkeyed */
        kv->bm[ids[b]].refs = 1;
        kv->bm[ids[b]].tenant = tag;
        kv->bm[ids[b]].keyed = false;
    }
    memset(s, 0, sizeof *s);
    s->sid = sid;
    s->epoch = epoch;
    s->n_past = n_past;
    s->blocks = ids;
    s->n_blocks = n_blocks;
    s->tenant = t;
    if (owner_len) memcpy(own, owner, owner_len);
    s->owner = own;
    s->owner_len = owner_len;
    uint64_t now = kv->p.clock(kv->p.clock_ctx);
    s->last_used = now > idle ? now - idle : 0;
    uint32_t h = kv_hash(&sid);
    s->hash_next = kv->buckets[h];
    kv->buckets[h] = s;
    kv->n_sessions++;
    t->n_sessions++;
    t->n_blocks += n_blocks;
    kv_lru_push_front(kv, s);
    in->added[in->n_added++] = s;
    return KVS_OK;
}

static int import_tomb(snap_in *in, const uint8_t *rec) {
    int err = in_check(in, rec, SNAP_TOMB, "tombstone");
    if (err) return err;
    if (in->n_tombs == in->cap_tombs) {
        uint32_t cap = in->cap_tombs ? in->cap_tombs * 2 : 64;
        void *a = realloc(in->tombs, cap * sizeof *in->tombs);
        if (!a) return kvs_fail(in->msg, in->msg_cap, KVS_ERR_NOMEM, "kv import: out of memory");
        in->tombs = a;
        in->cap_tombs = cap;
    }
    memcpy(in->tombs[in->n_tombs++], rec + 8, 32);
    return KVS_OK;
}

/* Remembers the collected tombstones with their age, for ids that have no live session. */
static void apply_tombs(kv_state *kv, snap_in *in) {
    uint64_t now = kv->p.clock(kv->p.clock_ctx);
    for (uint32_t i = 0; i < in->n_tombs; i++) {
        kv_sid sid;
        memcpy(sid.bytes, in->tombs[i], 16);
        uint64_t epoch = kvs_rd_u64(in->tombs[i] + 16), age = kvs_rd_u64(in->tombs[i] + 24);
        if (kv_find(kv, &sid) || age > kv->p.tombstone_ttl_ns) continue;
        kv_tomb_put(kv, &sid, epoch);
        int32_t ti = kv_tomb_find(kv, &sid);
        if (ti >= 0 && now > age) kv->tombs[ti].when = now - age;
    }
}

/* The records after the header, up to and with the trailer. */
static int import_records(kv_state *kv, snap_in *in) {
    for (;;) {
        uint8_t rec[SNAP_SESS];
        int err = in_get(in, rec, 8);
        if (err) return err;
        uint32_t tag = kvs_rd_u32(rec);
        size_t len = tag == TAG_SESS ? SNAP_SESS : tag == TAG_TOMB ? SNAP_TOMB : tag == TAG_END ? SNAP_END : 0;
        if (!len) return kvs_fail(in->msg, in->msg_cap, KVS_ERR_FORMAT, "kv import: unknown record 0x%08x", tag);
        if ((err = in_get(in, rec + 8, len - 8)) != KVS_OK) return err;
        if (tag == TAG_SESS) err = import_session(kv, in, rec);
        else if (tag == TAG_TOMB) err = import_tomb(in, rec);
        else if ((err = in_check(in, rec, SNAP_END, "end")) == KVS_OK &&
                 (kvs_rd_u32(rec + 8) != in->n_added || kvs_rd_u32(rec + 12) != in->n_tombs))
            err = kvs_fail(in->msg, in->msg_cap, KVS_ERR_FORMAT, "kv import: the trailer counts differ from the records");
        if (err || tag == TAG_END) return err;
    }
}

int kv_import(kv_state *kv, const kv_snap_ident *id, kv_snap_read_fn r, void *ctx, kv_snap_counts *out, char *msg,
              size_t msg_cap) {
    return kv_import_rekey(kv, id, r, ctx, NULL, NULL, out, msg, msg_cap);
}

int kv_import_rekey(kv_state *kv, const kv_snap_ident *id, kv_snap_read_fn r, void *ctx, kv_snap_rekey_fn rekey,
                    void *rekey_ctx, kv_snap_counts *out, char *msg, size_t msg_cap) {
    snap_in in = {.r = r, .ctx = ctx, .msg = msg, .msg_cap = msg_cap, .rekey = rekey, .rekey_ctx = rekey_ctx};
    uint8_t head[SNAP_HEAD];
    pthread_mutex_lock(&kv->lock);
    int err = in_get(&in, head, sizeof head);
    if (err == KVS_OK) err = check_head(kv, id, &in, head);
    if (err == KVS_OK) err = import_records(kv, &in);
    if (err == KVS_OK) {
        apply_tombs(kv, &in);
    } else {
        for (uint32_t i = in.n_added; i-- > 0;) kv_remove(kv, in.added[i], false);
        in.n_added = in.n_tombs = 0;
    }
    pthread_mutex_unlock(&kv->lock);
    if (out) *out = (kv_snap_counts){.sessions = in.n_added, .tombstones = in.n_tombs, .bytes = in.bytes};
    free(in.added);
    free(in.tombs);
    return err;
}
