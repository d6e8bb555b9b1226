/*
 * kv_markers — kvstate tests (test_kvstate*): CHECK_KV, the invariant checker run after an
 * operation; an injected clock; and marker values standing for computed K/V (position p of a
 * session holds marker + p in every float of every layer's K and V), written by an append
 * transaction and read back through one that is aborted.
 */
#ifndef KVS_KV_MARKERS_H
#define KVS_KV_MARKERS_H

#include <stdbool.h>

#include "kvstate.h"
#include "test.h"

/* kv_check (I1-I9 of kvstate.c) passes; on failure its message names the invariant and values. */
#define CHECK_KV(kv)                                                                        \
    do {                                                                                    \
        char kv_msg_[256] = "";                                                             \
        int kv_err_ = kv_check((kv), kv_msg_, sizeof(kv_msg_));                             \
        if (kv_err_) fprintf(stderr, "%s:%d: kv_check: %s\n", __FILE__, __LINE__, kv_msg_); \
        CHECK_EQ_INT(kv_err_, KVS_OK);                                                      \
    } while (0)

typedef struct {
    uint64_t now; /* ns */
} fake_clock;

static inline uint64_t fake_now(void *ctx) { return ((fake_clock *)ctx)->now; }

/* The pool's shape as the markers see it. */
typedef struct {
    int n_layers;
    int n_heads, head_dim; /* the pool's kv heads and elements per head (f32) */
} marker_shape;

/* The marker of element e of head h at position p, distinct per head and
 * element (exact in f32 for markers and positions below 2^14, head_dim < 32);
 * V holds it + 1/8, so K, V, heads and elements cannot stand in for each other. */
static inline float marker_at(float marker, uint32_t p, int h, int e) {
    return marker + (float)p + 0.25f * (float)h + (float)e / 256.0f;
}

/* Writes marker + p (per head and element, marker_at) into positions [start, end) of t, every layer's K and V. */
static inline void markers_fill(kv_txn *t, marker_shape sh, float marker) {
    for (uint32_t p = kv_txn_start(t); p < kv_txn_end(t); p++)
        for (int l = 0; l < sh.n_layers; l++)
            for (int h = 0; h < sh.n_heads; h++) {
                float *k = kv_txn_k(t, l, p, h), *v = kv_txn_v(t, l, p, h);
                for (int e = 0; e < sh.head_dim; e++) {
                    k[e] = marker_at(marker, p, h, e);
                    v[e] = k[e] + 0.125f;
                }
            }
}

/* True when positions [lo, hi) of a session holding n positions hold marker + p (marker_at). Read
 * through a txn that adds position n when that takes no block it would have to evict for (n
 * inside a block, or a free block), else — in a full pool — one that rewrites position n - 1 in
 * place (it adds nothing, so it evicts no one); aborted without writing. False when it cannot
 * begin. */
static inline bool markers_hold_range(kv_state *kv, marker_shape sh, kv_sid sid, uint64_t epoch, uint32_t n, uint32_t lo,
                                      uint32_t hi, float marker) {
    kv_txn *t = NULL;
    kv_reply r;
    kv_stats st;
    kv_get_stats(kv, &st);
    const uint32_t bt = (uint32_t)kv_get_params(kv)->block_tokens;
    int err = kv_begin(kv, &sid, epoch, n > 0 && n % bt == 0 && st.blocks_free == 0 ? n - 1 : n, 1, NULL, &t, &r);
    CHECK_KV(kv);
    if (err != KVS_OK) return false;
    bool ok = hi <= n;
    for (uint32_t p = lo; p < hi && ok; p++)
        for (int l = 0; l < sh.n_layers; l++)
            for (int h = 0; h < sh.n_heads; h++) {
                const float *k = kv_txn_k(t, l, p, h), *v = kv_txn_v(t, l, p, h);
                for (int e = 0; e < sh.head_dim; e++)
                    ok = ok && k[e] == marker_at(marker, p, h, e) && v[e] == marker_at(marker, p, h, e) + 0.125f;
            }
    kv_abort(kv, t, false);
    CHECK_KV(kv);
    return ok;
}

/* True when positions [0, n) of the session hold marker + p (marker_at). */
static inline bool markers_hold(kv_state *kv, marker_shape sh, kv_sid sid, uint64_t epoch, uint32_t n, float marker) {
    return markers_hold_range(kv, sh, sid, epoch, n, 0, n, marker);
}

/* Appends positions [start, start + n) with markers (kv_begin, markers_fill, kv_commit); r gets
 * the reply. KVS_OK or kv_begin's error (then nothing changed). */
static inline int markers_append(kv_state *kv, marker_shape sh, kv_sid sid, uint64_t epoch, uint32_t start, uint32_t n,
                                 const kv_inherit *inh, float marker, kv_reply *r) {
    kv_txn *t = NULL;
    int err = kv_begin(kv, &sid, epoch, start, n, inh, &t, r);
    CHECK_KV(kv);
    if (err) return err;
    markers_fill(t, sh, marker);
    kv_commit(kv, t, r);
    CHECK_KV(kv);
    return KVS_OK;
}

#endif /* KVS_KV_MARKERS_H */
