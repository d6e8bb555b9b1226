/*
 * Session mobility: the KV snapshot / transfer format (kv_export, kv_import) on a real pool —
 * a round trip keeps every byte, epoch, n_past, owner and tombstone; every refusal (a flipped
 * byte anywhere, a cut stream, another model, other layers, another KV type, a pool too small,
 * a quota, a live id) changes nothing (kv_check, stats, contents). Then real processes over
 * loopback (mobility_procs below): a shard restarted with --state-dir mid-generation.
 */
#include <pthread.h>

#include "kvstate.h"
#include "quant.h"
#include "test.h"

#define BT 4

typedef struct {
    uint8_t *buf;
    size_t len, cap, pos;
} mem_stream;

static int mem_write(void *ctx, const void *b, size_t n) {
    mem_stream *m = ctx;
    if (m->len + n > m->cap) {
        size_t cap = m->cap ? m->cap * 2 : 4096;
        while (cap < m->len + n) cap *= 2;
        uint8_t *g = realloc(m->buf, cap);
        if (!g) return KVS_ERR_NOMEM;
        m->buf = g;
        m->cap = cap;
    }
    memcpy(m->buf + m->len, b, n);
    m->len += n;
    return KVS_OK;
}

static int mem_read(void *ctx, void *b, size_t n) {
    mem_stream *m = ctx;
    if (m->pos + n > m->len) return KVS_ERR_IO;
    memcpy(b, m->buf + m->pos, n);
    m->pos += n;
    return KVS_OK;
}

static kv_params small_params(uint64_t blocks) {
    kv_params p = kv_default_params();
    p.n_layers = 2;
    p.n_kv_heads = 2;
    p.head_dim = 8;
    p.block_tokens = BT;
    p.budget_bytes = blocks * kv_params_block_bytes(&p);
    return p;
}

static kv_sid sid_n(int k) {
    kv_sid s;
    memset(&s, 0, sizeof s);
    s.bytes[0] = (uint8_t)k;
    s.bytes[15] = 0xA5;
    return s;
}

/* Writes n positions of session k at epoch with a pattern that names (k, pos, layer, head). */
static void fill_session(kv_state *kv, uint64_t tenant, int k, uint64_t epoch, uint32_t n) {
    kv_txn *t = NULL;
    kv_reply r;
    kv_sid sid = sid_n(k);
    int err = kv_begin_tenant(kv, tenant, &sid, epoch, 0, n, NULL, &t, &r);
    CHECK_EQ_INT(err, KVS_OK);
    if (err) return;
    size_t row = kv_row_bytes(kv_get_params(kv)->kv_type, kv_get_params(kv)->head_dim);
    for (uint32_t p = 0; p < n; p++)
        for (int l = 0; l < 2; l++)
            for (int h = 0; h < 2; h++) {
                memset(kv_txn_k(t, l, p, h), (int)(k * 31 + p * 7 + l * 3 + h), row);
                memset(kv_txn_v(t, l, p, h), (int)(k * 17 + p * 5 + l + h * 11 + 1), row);
            }
    kv_commit(kv, t, &r);
}

/* True when session k holds n positions at epoch with fill_session's pattern. */
static bool session_intact(kv_state *kv, int k, uint64_t epoch, uint32_t n) {
    uint64_t e = 0;
    uint32_t np = 0;
    kv_sid sid = sid_n(k);
    if (kv_lookup(kv, &sid, &e, &np) != KVS_OK || e != epoch || np != n) return false;
    kv_txn *t = NULL;
    kv_reply r;
    /* A rewind to n - 1 of one position reads every row without changing any but the last. */
    if (kv_begin(kv, &sid, epoch, n - 1, 1, NULL, &t, &r) != KVS_OK) return false;
    size_t row = kv_row_bytes(kv_get_params(kv)->kv_type, kv_get_params(kv)->head_dim);
    bool ok = true;
    for (uint32_t p = 0; p + 1 < n; p++)
        for (int l = 0; l < 2; l++)
            for (int h = 0; h < 2; h++) {
                const uint8_t *kr = kv_txn_k(t, l, p, h), *vr = kv_txn_v(t, l, p, h);
                for (size_t i = 0; i < row; i++)
                    ok = ok && kr[i] == (uint8_t)(k * 31 + p * 7 + l * 3 + h) &&
                         vr[i] == (uint8_t)(k * 17 + p * 5 + l + h * 11 + 1);
            }
    kv_abort(kv, t, false);
    return ok;
}

static void check_kv(kv_state *kv) {
    char msg[KVS_MSG_MAX] = "";
    int err = kv_check(kv, msg, sizeof msg);
    if (err) fprintf(stderr, "kv_check: %s\n", msg);
    CHECK_EQ_INT(err, KVS_OK);
}

static const kv_snap_ident IDENT = {.digest = {1, 2, 3}, .first = 0, .last = 2};

/* A pool with three sessions of two tenants and one tombstone, exported. */
static kv_state *source_pool(mem_stream *out) {
    kv_params p = small_params(64);
    kv_state *kv = NULL;
    char msg[KVS_MSG_MAX];
    CHECK_EQ_INT(kv_create(&p, &kv, msg, sizeof msg), KVS_OK);
    fill_session(kv, 7, 1, 3, 9);
    fill_session(kv, 7, 2, 1, 4);
    fill_session(kv, 9, 3, 5, 17);
    fill_session(kv, 9, 4, 2, 2);
    kv_reply r;
    kv_sid s4 = sid_n(4);
    CHECK_EQ_INT(kv_release(kv, &s4, 2, &r), KVS_OK);
    kv_snap_counts c;
    CHECK_EQ_INT(kv_export(kv, &IDENT, NULL, mem_write, out, &c, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(c.sessions, 3);
    CHECK_EQ_INT(c.tombstones, 1);
    CHECK_EQ_INT(c.bytes, out->len);
    return kv;
}

static void test_round_trip(void) {
    mem_stream m = {0};
    kv_state *src = source_pool(&m);
    kv_params p = small_params(64);
    kv_state *dst = NULL;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(kv_create(&p, &dst, msg, sizeof msg), KVS_OK);
    kv_snap_counts c;
    int err = kv_import(dst, &IDENT, mem_read, &m, &c, msg, sizeof msg);
    if (err) fprintf(stderr, "import: %s\n", msg);
    CHECK_EQ_INT(err, KVS_OK);
    CHECK_EQ_INT(c.sessions, 3);
    CHECK_EQ_INT(c.tombstones, 1);
    CHECK(session_intact(dst, 1, 3, 9));
    CHECK(session_intact(dst, 2, 1, 4));
    CHECK(session_intact(dst, 3, 5, 17));
    check_kv(dst);
    uint32_t ns = 0;
    uint64_t nb = 0;
    kv_tenant_usage(dst, 7, &ns, &nb);
    CHECK_EQ_INT(ns, 2);
    CHECK_EQ_INT(nb, (3 + 1) * kv_block_bytes(dst)); /* owners survive: 9 positions = 3 blocks, 4 = 1 */
    /* The tombstone survives: the released id at its old epoch is stale. */
    kv_txn *t = NULL;
    kv_reply r;
    kv_sid s4 = sid_n(4);
    CHECK_EQ_INT(kv_begin(dst, &s4, 1, 0, 1, NULL, &t, &r), KVS_ERR_STALE_EPOCH);
    /* The same stream a second time: every id is live now, refused, nothing changed. */
    m.pos = 0;
    kv_stats before, after;
    kv_get_stats(dst, &before);
    CHECK_EQ_INT(kv_import(dst, &IDENT, mem_read, &m, &c, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    kv_get_stats(dst, &after);
    CHECK_EQ_INT(after.sessions, before.sessions);
    CHECK_EQ_INT(after.blocks_free, before.blocks_free);
    /* One session on its own (a transfer): the stream holds it and no tombstone. */
    mem_stream one = {0};
    kv_sid s1 = sid_n(1);
    CHECK_EQ_INT(kv_export(src, &IDENT, &s1, mem_write, &one, &c, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(c.sessions, 1);
    CHECK_EQ_INT(c.tombstones, 0);
    kv_sid none = sid_n(99);
    CHECK_EQ_INT(kv_export(src, &IDENT, &none, mem_write, &one, &c, msg, sizeof msg), KVS_ERR_NOT_FOUND);
    kv_state *third = NULL;
    CHECK_EQ_INT(kv_create(&p, &third, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(kv_import(third, &IDENT, mem_read, &one, &c, msg, sizeof msg), KVS_OK);
    CHECK(session_intact(third, 1, 3, 9));
    CHECK_EQ_INT(kv_lookup(third, &s4, NULL, NULL), KVS_ERR_NOT_FOUND);
    check_kv(third);
    kv_free(third);
    free(one.buf);
    kv_free(dst);
    kv_free(src);
    free(m.buf);
}

/* Imports m into a fresh pool of params p: returns the status, checks that a refusal left the
 * pool exactly empty (sessions, blocks, tombstones, tenants) and that msg names a reason. */
static int import_fresh(const kv_params *p, const kv_snap_ident *id, mem_stream *m) {
    kv_state *kv = NULL;
    char msg[KVS_MSG_MAX] = "";
    if (kv_create(p, &kv, msg, sizeof msg) != KVS_OK) return KVS_ERR_INTERNAL;
    m->pos = 0;
    int err = kv_import(kv, id, mem_read, m, NULL, msg, sizeof msg);
    if (err != KVS_OK) {
        kv_stats st;
        kv_get_stats(kv, &st);
        CHECK_EQ_INT(st.sessions, 0);
        CHECK_EQ_INT(st.blocks_free, st.blocks_total);
        CHECK_EQ_INT(st.tombstones, 0);
        CHECK_EQ_INT(st.tenants, 0);
        CHECK(msg[0] != 0);
    }
    check_kv(kv);
    kv_free(kv);
    return err;
}

static void test_refusals(void) {
    mem_stream m = {0};
    kv_state *src = source_pool(&m);
    kv_params p = small_params(64);
    CHECK_EQ_INT(import_fresh(&p, &IDENT, &m), KVS_OK);
    /* Every single flipped byte, anywhere in the stream, is refused. */
    int accepted = 0;
    for (size_t i = 0; i < m.len; i++) {
        m.buf[i] ^= 0x10;
        accepted += import_fresh(&p, &IDENT, &m) == KVS_OK;
        m.buf[i] ^= 0x10;
    }
    CHECK_EQ_INT(accepted, 0);
    /* Every cut. */
    size_t full = m.len;
    for (size_t cut = 0; cut < full; cut += 37) {
        m.len = cut;
        CHECK_EQ_INT(import_fresh(&p, &IDENT, &m), KVS_ERR_FORMAT);
    }
    m.len = full;
    kv_snap_ident other = IDENT;
    other.digest[0] ^= 1;
    CHECK_EQ_INT(import_fresh(&p, &other, &m), KVS_ERR_INVALID_ARG);
    other = IDENT;
    other.last = 3;
    CHECK_EQ_INT(import_fresh(&p, &other, &m), KVS_ERR_INVALID_ARG);
    kv_params q = p;
    q.kv_type = QUANT_F32;
    q.budget_bytes = 64 * kv_params_block_bytes(&q);
    CHECK_EQ_INT(import_fresh(&q, &IDENT, &m), KVS_ERR_INVALID_ARG);
    q = small_params(8); /* 3 + 1 + 5 blocks needed */
    CHECK_EQ_INT(import_fresh(&q, &IDENT, &m), KVS_ERR_BUDGET_EXHAUSTED);
    q = small_params(64);
    q.max_sessions = 2;
    CHECK_EQ_INT(import_fresh(&q, &IDENT, &m), KVS_ERR_BUSY);
    q = small_params(64);
    q.tenant_max_bytes = 3 * kv_params_block_bytes(&q); /* tenant 7 holds 4 blocks */
    CHECK_EQ_INT(import_fresh(&q, &IDENT, &m), KVS_ERR_BUDGET_EXHAUSTED);
    q = small_params(64);
    q.max_positions = 16; /* session 3 holds 17 */
    CHECK_EQ_INT(import_fresh(&q, &IDENT, &m), KVS_ERR_CONTEXT_FULL);
    kv_free(src);
    free(m.buf);
}

int main(void) {
    test_round_trip();
    test_refusals();
    return test_finish("test_mobility", 1, 0);
}
