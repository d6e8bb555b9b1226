/*
 * Session mobility: the KV snapshot / transfer format (kv_export, kv_import) on a real pool —
 * a round trip keeps every byte, epoch, n_past, owner and tombstone; every refusal (a flipped
 * byte anywhere, a cut stream, another model, other layers, another KV type, a pool too small,
 * a quota, a live id) changes nothing (kv_check, stats, contents). Then real processes over
 * loopback (mobility_procs below): a shard restarted with --state-dir mid-generation.
 */
#include <pthread.h>
#include <sys/stat.h>

#include "kvstate.h"
#include "quant.h"
#include "route_harness.h"
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
    kv_sid s4 = sid_n(4), s1 = sid_n(1);
    CHECK_EQ_INT(kv_release(kv, &s4, 2, &r), KVS_OK);
    CHECK_EQ_INT(kv_set_owner(kv, &s1, "alice", 5), KVS_OK);
    kv_snap_counts c;
    CHECK_EQ_INT(kv_export(kv, &IDENT, NULL, mem_write, out, &c, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(c.sessions, 3);
    CHECK_EQ_INT(c.tombstones, 1);
    CHECK_EQ_INT(c.bytes, out->len);
    return kv;
}

/* A rekey that moves "alice"'s session to id 50 of tenant 42, and refuses anyone else. */
static int rekey_alice(void *ctx, const uint8_t *owner, size_t len, kv_sid *sid, uint64_t *tenant) {
    (void)ctx;
    if (len != 5 || memcmp(owner, "alice", 5)) return KVS_ERR_INVALID_ARG;
    *sid = sid_n(50);
    *tenant = 42;
    return KVS_OK;
}

static void test_rekey(void) {
    mem_stream m = {0}, one = {0};
    kv_state *src = source_pool(&m);
    kv_params p = small_params(64);
    kv_state *dst = NULL;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(kv_create(&p, &dst, msg, sizeof msg), KVS_OK);
    /* The whole pool: sessions without an owner are refused by this rekey, so nothing lands. */
    CHECK_EQ_INT(kv_import_rekey(dst, &IDENT, mem_read, &m, rekey_alice, NULL, NULL, msg, sizeof msg),
                 KVS_ERR_INVALID_ARG);
    kv_stats st;
    kv_get_stats(dst, &st);
    CHECK_EQ_INT(st.sessions, 0);
    CHECK_EQ_INT(st.blocks_free, st.blocks_total);
    kv_sid s1 = sid_n(1), s50 = sid_n(50);
    CHECK_EQ_INT(kv_export(src, &IDENT, &s1, mem_write, &one, NULL, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(kv_import_rekey(dst, &IDENT, mem_read, &one, rekey_alice, NULL, NULL, msg, sizeof msg), KVS_OK);
    uint64_t e = 0;
    uint32_t np = 0, ns = 0;
    uint64_t nb = 0;
    CHECK_EQ_INT(kv_lookup(dst, &s50, &e, &np), KVS_OK);
    CHECK_EQ_INT(e, 3);
    CHECK_EQ_INT(np, 9);
    CHECK_EQ_INT(kv_lookup(dst, &s1, NULL, NULL), KVS_ERR_NOT_FOUND);
    kv_tenant_usage(dst, 42, &ns, &nb);
    CHECK_EQ_INT(ns, 1);
    CHECK_EQ_INT(nb, 3 * kv_block_bytes(dst));
    check_kv(dst);
    /* The owner travels on: exported again from here it still says "alice". */
    mem_stream again = {0};
    CHECK_EQ_INT(kv_export(dst, &IDENT, &s50, mem_write, &again, NULL, msg, sizeof msg), KVS_OK);
    CHECK(again.len == one.len);
    free(again.buf);
    free(one.buf);
    free(m.buf);
    kv_free(dst);
    kv_free(src);
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

/* ---- real processes over loopback ------------------------------------------------------- */

static char g_dir[256];

static char *run_cli(const char *const *args, int *status) { return proc_cli(g_dir, args, status); }

static char *reference(const char *model, const char *prompt, const char *n) {
    int st;
    const char *args[] = {"run", "-m", model, "-p", prompt, "-n", n, "--temp", "0", "--seed", "5", "-t", "1",
                          "--json", NULL};
    char *out = run_cli(args, &st);
    CHECK_EQ_INT(st, 0);
    return out;
}

/* True when the whole file at path has a line containing needle. */
static bool log_has(const char *path, const char *needle) {
    FILE *f = fopen(path, "r");
    char line[1024];
    bool found = false;
    while (f && !found && fgets(line, sizeof line, f)) found = strstr(line, needle) != NULL;
    if (f) fclose(f);
    return found;
}

static void dump_log(const char *what, const char *path) {
    FILE *f = fopen(path, "r");
    char line[1024];
    fprintf(stderr, "---- %s (%s)\n", what, path);
    while (f && fgets(line, sizeof line, f)) fprintf(stderr, "  | %s", line);
    if (f) fclose(f);
}

typedef struct {
    const char *model;
    int n;                 /* shards */
    const char *layers[3];
    proc_server s[3];
    char state[3][300];
    int port[3];
} mob_route;

/* Starts shard i of m, at port (0: a free one) with its --state-dir. */
static bool mob_start(mob_route *m, int i, int port) {
    char listen[64];
    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    const char *extra[] = {"--state-dir", m->state[i], "--listen", listen, NULL};
    bool ok = proc_start_server(&m->s[i], g_dir, m->model, m->layers[i], extra);
    if (ok) m->port[i] = m->s[i].port;
    else dump_log("shard did not start", m->s[i].log);
    return ok;
}

static bool mob_open(mob_route *m, const char *tag) {
    bool ok = true;
    for (int i = 0; i < m->n; i++) {
        snprintf(m->state[i], sizeof m->state[i], "%s/state-%s-%d", g_dir, tag, i);
        ok = ok && mob_start(m, i, 0);
    }
    return ok;
}

/* SIGTERM shard i and wait for it to exit; its log must say what it wrote. */
static void mob_stop(mob_route *m, int i, const char *wrote) {
    char log[512];
    snprintf(log, sizeof log, "%s", m->s[i].log);
    CHECK_EQ_INT(proc_stop_server(&m->s[i]), 0);
    if (wrote && !log_has(log, wrote)) {
        CHECK(!"the stopped shard's log names its snapshot");
        dump_log("stopped shard", log);
    }
}

static void mob_close(mob_route *m) {
    for (int i = 0; i < m->n; i++) proc_stop_server(&m->s[i]);
}

/* The sessions the rolling restart and the drain move at once (the issue asks for 4). */
#define N_SESS 4
static const char *const k_prompts[N_SESS] = {"Once upon a time", "Lily and Ben went to", "The little dog",
                                               "One day a bird"};

/* A generate child on m's route for prompt, paused after 8 tokens; log under g_dir/<tag>.err. */
static bool mob_generate(mob_route *m, paused_gen *g, char *errlog, size_t cap, const char *tag, const char *prompt) {
    char route[256];
    route_of(route, sizeof route, m->s, m->n);
    snprintf(errlog, cap, "%s/%s.err", g_dir, tag);
    char *argv[] = {"kvshard", "generate", "--route", route, "-p", (char *)prompt, "-n", "24", "--temp", "0",
                    "--seed", "5", "--json", "--stats", "-v", "--pause-after", "8", "--timeout", "60000",
                    "--reconnect-grace", "60000", NULL};
    return paused_gen_start(g, argv, errlog) && paused_gen_wait(g, "paused after 8 tokens", NULL, 0);
}

static int mob_finish(paused_gen *g, const char *errlog, const char *ref, const char *what) {
    char *got = NULL;
    int st = paused_gen_finish(g, &got);
    CHECK_EQ_INT(st, 0);
    bool same = got && strcmp(got, ref) == 0;
    CHECK(same);
    if (st != 0 || !same) {
        fprintf(stderr, "%s:\n  got  %s  want %s", what, got ? got : "", ref);
        dump_log("client", errlog);
    }
    free(got);
    return same && st == 0;
}

/* Every shard of the route restarted one after the other while N_SESS clients are paused mid-
 * generation, the last one while the clients already wait for it (their reconnect grace): each
 * output equals `kvshard run`, no position replayed, no re-route, the epoch unchanged. */
static void check_rolling_restart(const char *model, int n, const char *const *layers, char *const *ref) {
    mob_route m = {.model = model, .n = n};
    for (int i = 0; i < n; i++) m.layers[i] = layers[i];
    if (!mob_open(&m, "roll")) {
        CHECK(!"shards start");
        mob_close(&m);
        return;
    }
    paused_gen g[N_SESS];
    char errlog[N_SESS][300], tag[16], wrote[64];
    for (int k = 0; k < N_SESS; k++) {
        snprintf(tag, sizeof tag, "roll-%d", k);
        CHECK(mob_generate(&m, &g[k], errlog[k], sizeof errlog[k], tag, k_prompts[k]));
    }
    snprintf(wrote, sizeof wrote, "state: wrote %d session(s)", N_SESS);
    char loaded[64];
    snprintf(loaded, sizeof loaded, "state: loaded %d session(s)", N_SESS);
    for (int i = 0; i + 1 < n; i++) {
        mob_stop(&m, i, wrote);
        CHECK(mob_start(&m, i, m.port[i]));
        CHECK(log_has(m.s[i].log, loaded));
    }
    mob_stop(&m, n - 1, wrote);
    /* Resumed while the tail is down: each client calls it again until it is back. */
    for (int k = 0; k < N_SESS; k++) {
        paused_gen_resume(&g[k]);
        CHECK(paused_gen_wait(&g[k], "calling it again", NULL, 0));
    }
    CHECK(mob_start(&m, n - 1, m.port[n - 1]));
    CHECK(log_has(m.s[n - 1].log, loaded));
    int same = 0;
    for (int k = 0; k < N_SESS; k++) {
        char *got = NULL;
        int st = paused_gen_collect(&g[k], &got);
        CHECK_EQ_INT(st, 0);
        CHECK(strcmp(got, ref[k]) == 0);
        CHECK_EQ_INT(stat_of(errlog[k], "replayed_positions"), 0);
        CHECK_EQ_INT(stat_of(errlog[k], "reroutes"), 0);
        CHECK_EQ_INT(stat_of(errlog[k], "epoch"), 1);
        CHECK(stat_of(errlog[k], "reconnects") >= 1);
        if (st != 0 || strcmp(got, ref[k]) || stat_of(errlog[k], "replayed_positions") != 0) {
            fprintf(stderr, "rolling restart, session %d:\n  got  %s  want %s", k, got, ref[k]);
            dump_log("client", errlog[k]);
        } else {
            same++;
        }
        free(got);
    }
    if (same == N_SESS)
        printf("  rolling restart of %d shards with %d sessions mid-generation: outputs identical, 0 positions "
               "replayed\n", n, N_SESS);
    mob_close(&m);
}

/* Flips one byte in the middle of path. */
static void flip_byte(const char *path) {
    size_t n = 0;
    uint8_t *b = test_read_file(path, &n);
    CHECK(b != NULL && n > 200);
    if (!b || n <= 200) {
        free(b);
        return;
    }
    FILE *f = fopen(path, "r+b");
    CHECK(f != NULL);
    if (f) {
        fseek(f, (long)(n / 2), SEEK_SET);
        fputc(b[n / 2] ^ 0x40, f);
        fclose(f);
    }
    free(b);
}

/* The last shard's snapshot damaged (a flipped byte) or cut short (kill -9 during the write):
 * the restarted shard says so, serves with an empty pool, and the client replays into it — the
 * output still equals `kvshard run`. */
static void check_bad_snapshot(const char *model, int n, const char *const *layers, const char *ref, bool killed) {
    mob_route m = {.model = model, .n = n};
    for (int i = 0; i < n; i++) m.layers[i] = layers[i];
    const char *tag = killed ? "killed" : "flipped";
    if (!mob_open(&m, tag)) {
        CHECK(!"shards start");
        mob_close(&m);
        return;
    }
    paused_gen g;
    char errlog[300], snap[400], tmp[400];
    CHECK(mob_generate(&m, &g, errlog, sizeof errlog, tag, k_prompts[0]));
    int t = n - 1;
    snprintf(snap, sizeof snap, "%s/kv.snap", m.state[t]);
    snprintf(tmp, sizeof tmp, "%s/kv.snap.tmp", m.state[t]);
    if (killed) {
        /* Restarted with the stall hook, then SIGTERM: it stops inside its snapshot write. */
        mob_stop(&m, t, "state: wrote 1 session(s)");
        setenv("KVS_TEST_STATE_STALL", "1", 1);
        CHECK(mob_start(&m, t, m.port[t]));
        unsetenv("KVS_TEST_STATE_STALL");
        kill(m.s[t].pid, SIGTERM);
        bool stalled = false;
        for (int waited = 0; waited < 60000 && !stalled; waited += 5) {
            stalled = log_has(m.s[t].log, "state: test stall");
            if (!stalled) proc_sleep_ms(5);
        }
        CHECK(stalled);
        proc_kill_server(&m.s[t]);
        CHECK(access(snap, F_OK) != 0); /* the old one was consumed at start; the new one never named */
        CHECK(access(tmp, F_OK) == 0);
    } else {
        mob_stop(&m, t, "state: wrote 1 session(s)");
        flip_byte(snap);
    }
    CHECK(mob_start(&m, t, m.port[t]));
    if (killed) {
        CHECK(log_has(m.s[t].log, "state: no snapshot"));
        CHECK(access(tmp, F_OK) != 0);
    } else {
        CHECK(log_has(m.s[t].log, "refused (kv import: session"));
        CHECK(log_has(m.s[t].log, "serving with an empty pool"));
        char port[16], *out = NULL;
        snprintf(port, sizeof port, "127.0.0.1:%d", m.port[t]);
        int st;
        const char *args[] = {"stats", port, NULL};
        out = run_cli(args, &st);
        CHECK(out && strstr(out, "state.snapshot_refused") != NULL);
        CHECK(out && strstr(out, "kv.sessions") != NULL);
        free(out);
    }
    if (mob_finish(&g, errlog, ref, tag)) {
        double replayed = stat_of(errlog, "replayed_positions");
        CHECK(replayed >= 8);
        printf("  %s: refused or absent on restart, empty pool, %g positions replayed, output identical\n",
               killed ? "kill -9 during the snapshot write" : "a flipped byte in the snapshot", replayed);
    }
    mob_close(&m);
}

/* A counter of `kvshard stats` for the shard at port; -1 when unreadable. */
static long long shard_stat(int port, const char *name) {
    char addr[32], pat[96], *out = NULL;
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    snprintf(pat, sizeof pat, "\"%s\":", name);
    int st;
    const char *args[] = {"stats", addr, NULL};
    out = run_cli(args, &st);
    const char *p = st == 0 && out ? strstr(out, pat) : NULL;
    long long v = p ? atoll(p + strlen(pat)) : -1;
    free(out);
    return v;
}

/* `kvshard drain 127.0.0.1:from --to 127.0.0.1:to [--keep-running]`: its exit status, its output. */
static int run_drain(int from, int to, bool keep, char **out) {
    char a[32], b[32];
    snprintf(a, sizeof a, "127.0.0.1:%d", from);
    snprintf(b, sizeof b, "127.0.0.1:%d", to);
    int st;
    const char *args[] = {"drain", a, "--to", b, keep ? "--keep-running" : NULL, NULL};
    *out = run_cli(args, &st);
    return st;
}

/* The tail of a route with N_SESS sessions paused mid-generation (client-driven) is drained:
 * first to a shard that does not allow it as a peer (refused, nothing moves), to a shard of other
 * layers (unusable), then to a peer that allows it: the sessions move, each client follows MOVED,
 * every output equals `kvshard run` with no position replayed and no re-route, and the drained
 * shard exits. */
static void check_drain(const char *model, int n, const char *const *layers, char *const *ref) {
    mob_route m = {.model = model, .n = n};
    for (int i = 0; i < n; i++) m.layers[i] = layers[i];
    bool ok = true;
    for (int i = 0; i < n; i++) {
        const char *extra[] = {"--peer-allow", "127.0.0.1", NULL};
        ok = ok && proc_start_server(&m.s[i], g_dir, model, layers[i], extra);
    }
    proc_server peer, closed, other;
    const char *allow[] = {"--peer-allow", "127.0.0.1", NULL}, *deny[] = {"--peer-allow", "10.9.9.9", NULL};
    ok = ok && proc_start_server(&peer, g_dir, model, layers[n - 1], allow);
    ok = ok && proc_start_server(&closed, g_dir, model, layers[n - 1], deny);
    ok = ok && proc_start_server(&other, g_dir, model, layers[0], allow);
    CHECK(ok);
    paused_gen g[N_SESS];
    char errlog[N_SESS][300], route[256], want[96];
    route_of(route, sizeof route, m.s, n);
    for (int k = 0; k < N_SESS; k++) {
        snprintf(errlog[k], sizeof errlog[k], "%s/drain-%d.err", g_dir, k);
        /* even sessions client-driven, odd ones relayed (the shards pass hidden states on) */
        char *argv[] = {"kvshard", "generate", "--route", route, "-p", (char *)k_prompts[k], "-n", "24", "--temp",
                        "0", "--seed", "5", "--json", "--stats", "-v", "--pause-after", "8", "--timeout", "60000",
                        k % 2 ? NULL : "--no-relay", NULL};
        CHECK(ok && paused_gen_start(&g[k], argv, errlog[k]) && paused_gen_wait(&g[k], "paused after 8 tokens", NULL, 0));
    }
    int tail = m.s[n - 1].port;
    char *out = NULL;
    CHECK_EQ_INT(run_drain(tail, closed.port, true, &out), 1);
    snprintf(want, sizeof want, "done: moved 0 of %d sessions (%d failed", N_SESS, N_SESS);
    CHECK(out && strstr(out, want) != NULL);
    free(out);
    CHECK_EQ_INT(shard_stat(closed.port, "move.refused"), N_SESS);
    CHECK_EQ_INT(shard_stat(closed.port, "kv.sessions"), 0);
    CHECK_EQ_INT(shard_stat(tail, "kv.sessions"), N_SESS);
    CHECK_EQ_INT(run_drain(tail, other.port, true, &out), 1);
    CHECK(out && strstr(out, "unusable") != NULL);
    free(out);
    CHECK_EQ_INT(shard_stat(tail, "kv.sessions"), N_SESS);
    /* Without --keep-running: it answers MOVED until every session was asked for, then exits. */
    CHECK_EQ_INT(run_drain(tail, peer.port, false, &out), 0);
    snprintf(want, sizeof want, "done: moved %d of %d sessions (0 failed)", N_SESS, N_SESS);
    CHECK(out && strstr(out, want) != NULL);
    if (out) printf("  drain: %s", strstr(out, "done: ") ? strstr(out, "done: ") : out);
    free(out);
    CHECK_EQ_INT(shard_stat(tail, "kv.sessions"), 0);
    CHECK_EQ_INT(shard_stat(tail, "move.sessions_out"), N_SESS);
    CHECK_EQ_INT(shard_stat(peer.port, "move.sessions_in"), N_SESS);
    CHECK_EQ_INT(shard_stat(peer.port, "kv.sessions"), N_SESS);
    int same = 0;
    for (int k = 0; k < N_SESS; k++) {
        if (!mob_finish(&g[k], errlog[k], ref[k], "drain")) continue;
        CHECK_EQ_INT(stat_of(errlog[k], "replayed_positions"), 0);
        CHECK_EQ_INT(stat_of(errlog[k], "moved"), 1);
        CHECK_EQ_INT(stat_of(errlog[k], "reroutes"), 0);
        CHECK_EQ_INT(stat_of(errlog[k], "epoch"), 1);
        if (k % 2) { /* relayed: MOVED came back on the relay path and the step was relayed again */
            CHECK(stat_of(errlog[k], "relay_steps") >= 16);
            CHECK_EQ_INT(stat_of(errlog[k], "relay_fallbacks"), 0);
        }
        same++;
    }
    if (same == N_SESS)
        printf("  drained the tail with %d sessions mid-generation: each client followed MOVED, outputs identical, "
               "0 replayed\n", N_SESS);
    CHECK_EQ_INT(proc_wait(m.s[n - 1].pid, 60000), 0); /* the drained shard exits by itself */
    m.s[n - 1].pid = 0;
    mob_close(&m);
    proc_stop_server(&peer);
    proc_stop_server(&closed);
    proc_stop_server(&other);
}

/* Sessions of one drain, each next one exported while the peer imports the one before. */
#define N_PIPE 8
static const char *const k_pipe_prompts[N_PIPE] = {"Once upon a time", "Lily and Ben went to", "The little dog",
                                                    "One day a bird",   "Tom had a red",        "The sun was",
                                                    "A big cat",        "Mia liked to"};

/* The tail of a route holding N_PIPE paused sessions is drained to two peers, the first of which
 * takes only two sessions (--max-sessions): its refusals arrive while the next session is
 * already exported and go to the second peer. Every session moves once, the counters agree, and every client
 * goes on from the moved state to the output of `kvshard run`, nothing replayed. */
static void check_drain_pipeline(const char *model, int n, const char *const *layers) {
    mob_route m = {.model = model, .n = n};
    for (int i = 0; i < n; i++) m.layers[i] = layers[i];
    bool ok = true;
    const char *allow[] = {"--peer-allow", "127.0.0.1", NULL};
    const char *small_args[] = {"--peer-allow", "127.0.0.1", "--max-sessions", "2", NULL};
    for (int i = 0; i < n; i++) ok = ok && proc_start_server(&m.s[i], g_dir, model, layers[i], allow);
    proc_server small, big;
    ok = ok && proc_start_server(&small, g_dir, model, layers[n - 1], small_args);
    ok = ok && proc_start_server(&big, g_dir, model, layers[n - 1], allow);
    CHECK(ok);
    paused_gen g[N_PIPE];
    char errlog[N_PIPE][300], route[256], peers[80], from[32], want[96];
    char *ref[N_PIPE];
    route_of(route, sizeof route, m.s, n);
    for (int k = 0; k < N_PIPE; k++) {
        ref[k] = reference(model, k_pipe_prompts[k], "24");
        snprintf(errlog[k], sizeof errlog[k], "%s/pipe-%d.err", g_dir, k);
        char *argv[] = {"kvshard", "generate", "--route", route, "-p", (char *)k_pipe_prompts[k], "-n", "24",
                        "--temp", "0", "--seed", "5", "--json", "--stats", "-v", "--pause-after", "8",
                        "--timeout", "60000", "--no-relay", NULL};
        CHECK(ok && paused_gen_start(&g[k], argv, errlog[k]) && paused_gen_wait(&g[k], "paused after 8 tokens", NULL, 0));
    }
    int tail = m.s[n - 1].port;
    snprintf(from, sizeof from, "127.0.0.1:%d", tail);
    snprintf(peers, sizeof peers, "127.0.0.1:%d,127.0.0.1:%d", small.port, big.port);
    const char *args[] = {"drain", from, "--to", peers, "--keep-running", NULL};
    int st;
    char *out = run_cli(args, &st);
    CHECK_EQ_INT(st, 0);
    snprintf(want, sizeof want, "done: moved %d of %d sessions (0 failed)", N_PIPE, N_PIPE);
    CHECK(out && strstr(out, want) != NULL);
    if (out && !strstr(out, want)) fprintf(stderr, "drain said:\n%s", out);
    free(out);
    CHECK_EQ_INT(shard_stat(tail, "kv.sessions"), 0);
    CHECK_EQ_INT(shard_stat(tail, "move.sessions_out"), N_PIPE);
    CHECK_EQ_INT(shard_stat(small.port, "move.sessions_in"), 2);
    CHECK_EQ_INT(shard_stat(big.port, "move.sessions_in"), N_PIPE - 2);
    CHECK(shard_stat(small.port, "move.refused") >= 1);
    CHECK_EQ_INT(shard_stat(small.port, "move.bytes_in") + shard_stat(big.port, "move.bytes_in"),
                 shard_stat(tail, "move.bytes_out"));
    int same = 0;
    for (int k = 0; k < N_PIPE; k++) {
        if (mob_finish(&g[k], errlog[k], ref[k], "overlapped drain")) {
            CHECK_EQ_INT(stat_of(errlog[k], "replayed_positions"), 0);
            CHECK_EQ_INT(stat_of(errlog[k], "moved"), 1);
            same++;
        }
        free(ref[k]);
    }
    if (same == N_PIPE)
        printf("  overlapped drain of %d sessions to two peers (one refusing): outputs identical, 0 replayed\n", N_PIPE);
    mob_close(&m);
    proc_stop_server(&small);
    proc_stop_server(&big);
}

static void check_procs(const char *model, int n, const char *const *layers) {
    printf("model %s, %d shards\n", model, n);
    char *ref[N_SESS];
    for (int k = 0; k < N_SESS; k++) ref[k] = reference(model, k_prompts[k], "24");
    check_rolling_restart(model, n, layers, ref);
    check_bad_snapshot(model, n, layers, ref[0], false);
    check_bad_snapshot(model, n, layers, ref[0], true);
    check_drain(model, n, layers, ref);
    check_drain_pipeline(model, n, layers);
    for (int k = 0; k < N_SESS; k++) free(ref[k]);
}

int main(void) {
    test_round_trip();
    test_refusals();
    test_rekey();
    signal(SIGPIPE, SIG_IGN);
    snprintf(g_dir, sizeof g_dir, "/tmp/kvs-mobility-XXXXXX");
    CHECK(mkdtemp(g_dir) != NULL);
    char buf[1024];
    const char *stories = test_shared_path("models/stories260K.gguf", buf, sizeof buf);
    if (stories) {
        static const char *layers[] = {"0:2", "2:4", "4:5"};
        check_procs(stories, 3, layers);
    } else {
        char synth[300];
        snprintf(synth, sizeof synth, "%s/small.gguf", g_dir);
        int st;
        const char *mk[] = {"mkmodel", "-o", synth, "--shape", "small", "--type", "q8_0", "--seed", "3", "-q", NULL};
        free(run_cli(mk, &st));
        CHECK_EQ_INT(st, 0);
        static const char *layers[] = {"0:1", "1:2"};
        check_procs(synth, 2, layers);
    }
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    if (test_failures_ == 0 && system(cmd) != 0) fprintf(stderr, "note: could not remove %s\n", g_dir);
    return test_finish("test_mobility", 1, 0);
}
