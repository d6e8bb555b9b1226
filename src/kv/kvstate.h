/*
 * kvstate — the hot KV state of a shard: a paged block pool under a fixed
 * byte budget and a table of route sessions, each with its own block table.
 * DESIGN.md §2 is the contract; kvstate.c opens with the invariants and the
 * state diagram.
 *
 * Use: kv_begin() validates a request against the session's state, reserves
 * the blocks its positions need and pins the session; the caller (forward)
 * writes K/V for the new positions and reads older ones through the returned
 * transaction; kv_commit() makes the result the session's state, kv_abort()
 * (error or cancel) leaves the session exactly as before kv_begin().
 * Thread-safe: any number of threads may drive different sessions at once.
 */
#ifndef KVS_KVSTATE_H
#define KVS_KVSTATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint8_t bytes[16];
} kv_sid;

typedef uint64_t (*kv_clock_fn)(void *ctx); /* nanoseconds, monotonic */

typedef struct {
    int n_layers;           /* local layers stored per block */
    int n_kv_heads;         /* per layer */
    int head_dim;           /* elements per head */
    int block_tokens;       /* positions per block (default 16) */
    uint32_t kv_type;       /* QUANT_F16 (default), QUANT_Q8_0, QUANT_Q4_0 or QUANT_F32 */
    uint64_t budget_bytes;  /* block pool size; floor(budget / block_bytes) blocks */
    uint32_t max_positions; /* per-session cap (CONTEXT_FULL past it); clamped by kv_create to
                               what the pool holds (blocks x block_tokens) */
    uint32_t max_sessions;  /* 0: no limit besides the budget */
    uint64_t ttl_ns;        /* idle time before eviction; 0: never */
    kv_clock_fn clock;      /* NULL: CLOCK_MONOTONIC */
    void *clock_ctx;
    uint32_t max_tombstones;   /* session ids whose highest epoch is remembered after the session
                                  is gone (release, eviction); 0: 4096 */
    uint64_t tombstone_ttl_ns; /* how long such an epoch is remembered; 0: 600 s */
    /* Tenants (kv_begin_tenant): each session belongs to the tenant that created it. */
    uint32_t tenant_max_sessions; /* live sessions one tenant may hold; 0: no own cap */
    uint64_t tenant_max_bytes;    /* KV bytes one tenant may hold (whole blocks, rounded down, at
                                     least one block); 0: no own cap */
    bool prefault; /* touch every page of the pool at creation, so no session's first write (a
                      prefill, an import) waits for the kernel to zero fresh pages */
} kv_params;

kv_params kv_default_params(void);

/* Recovery fields of a reply (filled on success and on error). */
typedef struct {
    uint32_t have;       /* CACHE_MISS: positions the shard holds; resend from here */
    uint64_t live_epoch; /* STALE_EPOCH: the epoch the shard holds */
    uint32_t n_past;     /* positions held after the call */
    bool pinned_short;   /* BUDGET_EXHAUSTED / BUSY only because other sessions are pinned (in
                            flight): the same request can succeed once they finish */
    bool over_quota;     /* BUDGET_EXHAUSTED / BUSY from the tenant's own quota (tenant_max_*) */
    uint32_t prefix;     /* kv_begin_prefix: positions the new session took from the prefix cache */
} kv_reply;

/* Shared prefix blocks (kvstate.c, I10). The client names every KV_PREFIX_TOKENS positions of a
 * session by a chain hash: hashes[i] covers positions [0, (first + i + 1) x KV_PREFIX_TOKENS)
 * (hash of the previous one and these ids). Full blocks with the same (tenant, chain hash) hold
 * the same keys and values, so they are shared; sharing needs block_tokens to be a multiple of
 * KV_PREFIX_TOKENS (else hashes are ignored). */
#define KV_PREFIX_TOKENS 16
typedef struct {
    const uint64_t *hashes;
    uint32_t first, n;
} kv_prefix;

/* Epoch advance that keeps the old epoch's first len positions (no copy). */
typedef struct {
    uint64_t old_epoch;
    uint32_t len;
} kv_inherit;

typedef struct {
    uint64_t sessions, bytes_used, budget_bytes, block_bytes, blocks_total, blocks_free;
    uint64_t hits, misses, stale, evict_ttl, evict_lru, releases, rewinds, cancellations;
    uint64_t appends, truncates, inherits, busy;
    uint64_t in_place; /* rewrites that reused the session's own superseded blocks */
    uint64_t tombstones; /* remembered epochs of gone sessions, now */
    uint64_t tenants;    /* tenants holding sessions, now */
    uint64_t evict_quota; /* of evict_lru: a tenant's own sessions evicted to stay within its quota */
    uint64_t quota_refusals; /* begins refused by the tenant's own quota (over_quota) */
    /* Shared prefix blocks (I10). */
    uint64_t prefix_hits;       /* begins that took blocks from the prefix cache */
    uint64_t prefix_positions;  /* positions so taken (not computed) */
    uint64_t prefix_short;      /* begins answered CACHE_MISS(have) because a prefix block is gone */
    uint64_t prefix_dedups;     /* blocks a commit replaced by an equal keyed block */
    uint64_t prefix_evictions;  /* cached blocks taken back for new ones */
    uint64_t prefix_blocks;     /* keyed blocks now (shared, in use or cached) */
    uint64_t cached_blocks, cached_bytes; /* keyed blocks no session holds now (evictable first; not in
                                             bytes_used, which counts sessions' blocks; with blocks_free
                                             they add up to blocks_total) */
} kv_stats;

typedef struct kv_state kv_state;
typedef struct kv_txn kv_txn;

/* Creates the pool (reserved up front, touched lazily) and the session table.
 * KVS_ERR_INVALID_ARG (msg says which setting) when the budget holds no block. */
int kv_create(const kv_params *p, kv_state **out, char *msg, size_t msg_cap);
/* Frees everything; no transaction may be open. NULL is fine. */
void kv_free(kv_state *kv);
size_t kv_block_bytes(const kv_state *kv);
/* Bytes of one block for these settings (DESIGN §2: block_tokens x n_layers x 2 x n_kv_heads x
 * kv_row_bytes(kv_type, head_dim)); 0 when a setting is out of range. */
size_t kv_params_block_bytes(const kv_params *p);
/* Element types a KV pool may hold: f16, f32, and GGUF's q8_0 / q4_0 blocks. */
bool kv_type_supported(uint32_t type);
/* True for the block-quantized types, whose rows are head_dim / KV_QBLOCK_ELEMS blocks. */
bool kv_type_is_block(uint32_t type);
#define KV_QBLOCK_ELEMS 32
#define KV_QBLOCK_MAX_HEAD_DIM 512 /* kv_attn.h's KV_ATTN_MAX_HEAD_DIM */
/* Bytes of one K or V row (one head at one position): head_dim elements of type, as
 * quant_row_bytes counts them (q8_0: 34 B per 32, q4_0: 18 B per 32); 0 when the type is not
 * a KV type or head_dim does not divide into its blocks. */
size_t kv_row_bytes(uint32_t type, int head_dim);
const kv_params *kv_get_params(const kv_state *kv);

/* Starts an append of n positions at start_pos for (sid, epoch); inherit may
 * be NULL. On success *out is an open transaction (the session is pinned:
 * never evicted, other requests on it get KVS_ERR_BUSY) that must be closed
 * with kv_commit or kv_abort. It takes from the pool only the blocks of the
 * positions it adds (a rewind, retry, inherit or epoch bump that finds no
 * free blocks for a copy rewrites the session's own blocks in place, keeping
 * a copy of what it overwrites outside the pool until commit, so that an
 * abort still restores it).
 * Errors (nothing changed): KVS_ERR_STALE_EPOCH (rep->live_epoch; also below
 * the remembered epoch of a released / evicted session), KVS_ERR_CACHE_MISS
 * (rep->have; a newer epoch that inherits nothing drops the old state even
 * then), KVS_ERR_CONTEXT_FULL, KVS_ERR_BUDGET_EXHAUSTED (blocks short after
 * evicting every idle session), KVS_ERR_BUSY (session pinned, or a new session
 * past max_sessions with every session pinned), KVS_ERR_NOMEM,
 * KVS_ERR_INVALID_ARG. A BUSY with rep->pinned_short is not counted in
 * kv.busy (the caller may retry it itself): kv_note_busy when it answers it. */
int kv_begin(kv_state *kv, const kv_sid *sid, uint64_t epoch, uint32_t start_pos, uint32_t n,
             const kv_inherit *inherit, kv_txn **out, kv_reply *rep);
/* kv_begin for a tenant (kv_begin is tenant 0). A new session belongs to `tenant`; an existing
 * one stays with the tenant that created it. Quotas and fair shares (kvstate.c, "Tenants"):
 * a tenant past tenant_max_bytes / tenant_max_sessions evicts its own idle sessions (LRU
 * first) and, when they are not enough, is refused (BUDGET_EXHAUSTED / BUSY, rep->over_quota,
 * nothing changed); pool pressure evicts another tenant's session only while that tenant holds
 * more than its fair share (pool / tenants, max_sessions / tenants). */
int kv_begin_tenant(kv_state *kv, uint64_t tenant, const kv_sid *sid, uint64_t epoch, uint32_t start_pos, uint32_t n,
                    const kv_inherit *inherit, kv_txn **out, kv_reply *rep);
/* kv_begin_tenant with the chain hashes of the blocks the request covers (pre may be NULL).
 * A session that does not hold the request's start (absent, or superseded by a newer epoch that
 * inherits nothing) at a start_pos that is a multiple of block_tokens takes the blocks below
 * start_pos from the tenant's prefix cache when every one of them is there (rep->prefix);
 * else CACHE_MISS with rep->have the positions the cache holds. At commit, the full blocks the
 * request completed are keyed, or replaced by an equal keyed block (charged once). */
int kv_begin_prefix(kv_state *kv, uint64_t tenant, const kv_sid *sid, uint64_t epoch, uint32_t start_pos, uint32_t n,
                    const kv_inherit *inherit, const kv_prefix *pre, kv_txn **out, kv_reply *rep);
/* A tenant's live sessions and bytes held (open transactions' new blocks included); 0, 0 when
 * it holds none. */
void kv_tenant_usage(kv_state *kv, uint64_t tenant, uint32_t *sessions, uint64_t *bytes);
/* Makes positions [0, start_pos + n) the session's state; frees replaced blocks. */
void kv_commit(kv_state *kv, kv_txn *txn, kv_reply *rep);
/* Rolls back: the session is exactly as before kv_begin — epoch, n_past and
 * contents, in place or not. A session kv_begin created is removed as if it
 * had never been: no tombstone, the id's remembered epoch (if any) unchanged,
 * so kv_lookup answers KVS_ERR_NOT_FOUND. (Sessions that kv_begin evicted to
 * make room stay evicted.) cancelled: counts it in kv.cancellations. */
void kv_abort(kv_state *kv, kv_txn *txn, bool cancelled);
/* The caller answered KVS_ERR_BUSY to a client for a begin that kv reported
 * pinned_short (kv_begin does not count those): counts it in kv.busy. */
void kv_note_busy(kv_state *kv);
/* A request cancelled before it began (it never reached kv_begin): counts it
 * in kv.cancellations. */
void kv_note_cancel(kv_state *kv);

/* Transaction view, valid until commit/abort. A K or V row holds head_dim
 * elements of kv_type (kv_row_bytes bytes) for one kv head (head < n_kv_heads) at one position. */
uint32_t kv_txn_start(const kv_txn *txn);
uint32_t kv_txn_end(const kv_txn *txn); /* start + n */
void *kv_txn_k(const kv_txn *txn, int layer, uint32_t pos, int head); /* pos < end */
void *kv_txn_v(const kv_txn *txn, int layer, uint32_t pos, int head);
/* The K and V rows of one head of a layer at positions [0, n) (n <= end):
 * k[p] = kv_txn_k(txn, layer, p, head), v[p] = kv_txn_v(...), filled a block's
 * run at a time (one table lookup per block, not per row: attention lists
 * every row of a head for every layer and token). */
void kv_txn_head_rows(const kv_txn *txn, int layer, int head, uint32_t n, const void **k, const void **v);
bool kv_txn_cancelled(const kv_txn *txn);
/* Requests cancellation of the session's in-flight append (if any):
 * KVS_OK when one was flagged, KVS_ERR_NOT_FOUND otherwise. */
int kv_cancel(kv_state *kv, const kv_sid *sid);

/* Keeps positions [0, len) (len <= n_past); whole blocks past len return to the pool. len 0
 * drops the session (it no longer counts against max_sessions; its epoch is remembered as for
 * a release). An epoch older than the live one (or than a remembered one): STALE_EPOCH; a newer
 * one drops the live state and answers CACHE_MISS(0) (KVS_OK for len 0). */
int kv_truncate(kv_state *kv, const kv_sid *sid, uint64_t epoch, uint32_t len, kv_reply *rep);
/* Drops the session; later requests see CACHE_MISS(0), and requests at an older epoch
 * STALE_EPOCH for as long as the epoch is remembered (tombstone). A newer epoch than the live
 * one also drops it (KVS_OK). An unknown id: CACHE_MISS(0). */
int kv_release(kv_state *kv, const kv_sid *sid, uint64_t epoch, kv_reply *rep);
/* Current epoch/n_past of a session (either pointer may be NULL): KVS_OK, or
 * KVS_ERR_NOT_FOUND when absent (outputs untouched; a cancelled create is
 * absent: its reply's live_epoch and n_past are 0). */
int kv_lookup(kv_state *kv, const kv_sid *sid, uint64_t *epoch, uint32_t *n_past);
/* Who a session belongs to beyond its keyed id, as the caller defines it (the server: the
 * owner's identity and the raw session id, so that a shard with another key can re-derive the
 * id): kept with the session and carried by its snapshot. At most KV_OWNER_MAX bytes.
 * KVS_OK, KVS_ERR_NOT_FOUND, KVS_ERR_INVALID_ARG (too long), KVS_ERR_NOMEM (unchanged). */
#define KV_OWNER_MAX 256u
int kv_set_owner(kv_state *kv, const kv_sid *sid, const void *owner, size_t len);
/* Ids of up to cap idle (unpinned) sessions, least recently used first; returns the count. */
uint32_t kv_list_idle(kv_state *kv, kv_sid *out, uint32_t cap);
/* Block ids of a session's table (tests: inherit moves blocks, no copy). Returns count. */
uint32_t kv_debug_blocks(kv_state *kv, const kv_sid *sid, uint32_t *ids, uint32_t cap);
/* Evicts idle sessions past their TTL, examining at most max_work sessions; returns evictions. */
int kv_sweep_ttl(kv_state *kv, int max_work);
void kv_get_stats(kv_state *kv, kv_stats *st);
/* Test hook: the n-th counted allocation from now fails (n >= 1); 0 disables. */
void kv_inject_alloc_failure(kv_state *kv, int n);
/* Verifies the invariants I1-I10 of kvstate.c's design notes (block ownership against the free
 * stack, exact byte accounting, block tables against n_past, pins and the LRU list, the session
 * table, transactions, the tombstone index, tenant sums). Takes the lock; walks the whole state
 * (tests and debugging). KVS_OK, or KVS_ERR_INTERNAL with msg naming the invariant and the
 * values that break it (KVS_ERR_NOMEM, KVS_ERR_INVALID_ARG for a NULL kv). */
int kv_check(kv_state *kv, char *msg, size_t msg_cap);

/* ---- snapshot and transfer (kv_snapshot.c; format: docs/hot-kv-state.md "Snapshots") ----
 * A stream of a header (the shard's identity: model digest, layer range, KV geometry and type),
 * session records (id, owner tenant, epoch, n_past, idle age, then every block with its own
 * checksum), tombstone records and a trailer. The callbacks move bytes: a file, a socket, a
 * buffer. */
#define KV_SNAP_VERSION 2u /* 2: q8_0 / q4_0 rows are stored rotated (kv_attn.h) */
typedef int (*kv_snap_write_fn)(void *ctx, const void *buf, size_t len); /* KVS_OK or an error */
typedef int (*kv_snap_read_fn)(void *ctx, void *buf, size_t len);        /* exactly len, or an error */

/* Who the state belongs to: an import is refused unless both sides say the same. */
typedef struct {
    uint8_t digest[32];   /* model file SHA-256 */
    uint32_t first, last; /* layer range */
} kv_snap_ident;

typedef struct {
    uint64_t sessions, tombstones, bytes; /* records and stream bytes written / read */
} kv_snap_counts;

/* Writes every idle session (only: NULL) or the one session `only` (no tombstones), holding the
 * pool's lock for the whole write (callers quiesce the shard first). KVS_ERR_NOT_FOUND when
 * `only` is absent, KVS_ERR_BUSY when it (or, for all, any session) is pinned; the writer's
 * error as returned. */
int kv_export(kv_state *kv, const kv_snap_ident *id, const kv_sid *only, kv_snap_write_fn w, void *ctx,
              kv_snap_counts *out, char *msg, size_t msg_cap);
/* Reads a stream and adds its sessions and tombstones. Everything is checked before it counts:
 * version, identity, geometry and KV type against this pool, every checksum, every size against
 * the pool (free blocks now: an import never evicts), max_positions, max_sessions and the
 * tenant quotas; an id live here or remembered at a newer epoch is refused. On any refusal
 * nothing is changed (sessions added so far are removed again without a trace): KVS_ERR_FORMAT
 * (a checksum, a truncated or malformed stream), KVS_ERR_INVALID_ARG (identity or geometry),
 * KVS_ERR_BUDGET_EXHAUSTED / KVS_ERR_BUSY (pool, session or quota limits), KVS_ERR_STALE_EPOCH,
 * the reader's error; msg says which. */
int kv_import(kv_state *kv, const kv_snap_ident *id, kv_snap_read_fn r, void *ctx, kv_snap_counts *out, char *msg,
              size_t msg_cap);
/* Maps a session's owner bytes (kv_set_owner) to its id and tenant here (a shard with another
 * key re-derives both); KVS_OK, or an error that refuses the whole import. */
typedef int (*kv_snap_rekey_fn)(void *ctx, const uint8_t *owner, size_t len, kv_sid *sid, uint64_t *tenant);
/* kv_import with each session's id and tenant from rekey (NULL: as in the stream). */
int kv_import_rekey(kv_state *kv, const kv_snap_ident *id, kv_snap_read_fn r, void *ctx, kv_snap_rekey_fn rekey,
                    void *rekey_ctx, kv_snap_counts *out, char *msg, size_t msg_cap);
/* Checksum of the format: 64-bit, seeded (kv_snapshot.c). */
uint64_t kv_snap_sum(const void *buf, size_t len, uint64_t seed);

#endif /* KVS_KVSTATE_H */
