/*
 * Hot KV state through the engine: four sessions on four threads
 * (interleaving prefill, decode, truncate, rewind and cancel) are bit-identical
 * to their solo runs; batched decode of several sessions in one forward is
 * bit-identical to each alone; a forward whose first item was cancelled gives
 * the others their solo logits; the state after truncates/rewinds agrees with a
 * full recompute; a budget for about two sessions with four active evicts
 * LRU-first and replay after CACHE_MISS reproduces the same logits.
 * Runs on a synthetic model (always) and stories260K (when ../shared has it).
 */
#include <pthread.h>
#include <stdlib.h>

#include "engine.h"
#include "kv_markers.h"
#include "mkmodel.h"
#include "quant.h"
#include "sampler.h"
#include "test.h"

#define N_SESS 4
#define MAX_STEPS 32
#define MAX_TOK 64

typedef struct {
    int32_t toks[MAX_TOK]; /* the session's token history */
    uint32_t n_past;
    float *logits;         /* [MAX_STEPS][nv] recorded outputs */
    int n_steps;
    int32_t ids[MAX_STEPS];
} script_out;

static engine *open_engine(const char *path, uint64_t budget) {
    engine_params ep = engine_default_params();
    ep.model_path = path;
    ep.n_threads = 2;
    ep.kv.budget_bytes = budget;
    engine *e = NULL;
    char msg[KVS_MSG_MAX] = "";
    if (engine_open(&ep, &e, msg, sizeof(msg)) != KVS_OK) fprintf(stderr, "engine_open(%s): %s\n", path, msg);
    return e;
}

static kv_sid sid_of(int k) {
    kv_sid s;
    memset(&s, 0, sizeof(s));
    memcpy(s.bytes, &k, sizeof(k));
    s.bytes[8] = 0x5E;
    return s;
}

/* Appends toks[start, end) and records the last position's logits. */
static int step(engine *e, int k, script_out *o, uint32_t start, uint32_t end) {
    int nv = (int)e->m->hp.n_vocab;
    float *out = o->logits + (size_t)o->n_steps * (size_t)nv;
    engine_req r = {.sid = sid_of(k), .epoch = 1, .start_pos = start, .n = end - start, .tokens = o->toks + start,
                    .out_mode = FWD_OUT_LOGITS_LAST, .out = out};
    engine_step(e, &r, 1);
    if (r.status) return r.status;
    o->n_past = end;
    o->ids[o->n_steps] = sampler_argmax(out, nv);
    o->n_steps++;
    return KVS_OK;
}

typedef struct {
    engine *e;
    int k;
    script_out *o;
    pthread_barrier_t *barrier; /* NULL: solo */
    int failures;
} script_arg;

static void sync_point(script_arg *a) {
    if (a->barrier) pthread_barrier_wait(a->barrier);
}

#define SCRIPT_CHECK(cond) do { if (!(cond)) { fprintf(stderr, "script %d: %s failed at line %d\n", a->k, #cond, __LINE__); a->failures++; } } while (0)

/* kv_check from a script thread (counted in the script's failures, not test.h's counter). */
#define SCRIPT_CHECK_KV()                                                                  \
    do {                                                                                   \
        char kv_msg_[256] = "";                                                            \
        if (kv_check(e->kv, kv_msg_, sizeof(kv_msg_)) != KVS_OK) {                         \
            fprintf(stderr, "script %d: kv_check at line %d: %s\n", a->k, __LINE__, kv_msg_); \
            a->failures++;                                                                 \
        }                                                                                  \
    } while (0)

/* Prefill, 6 greedy decodes, truncate by 3 and re-append, a cancelled append,
 * a rewind by 2, 4 more decodes. Same sync points in every script. */
static void *script(void *p) {
    script_arg *a = p;
    engine *e = a->e;
    script_out *o = a->o;
    int nv = (int)e->m->hp.n_vocab;
    uint32_t n_prompt = 5 + 3 * (uint32_t)a->k;
    for (uint32_t i = 0; i < n_prompt; i++) o->toks[i] = (int32_t)((i * 37 + (uint32_t)a->k * 11 + 3) % (uint32_t)nv);
    o->toks[0] = 1;
    sync_point(a);
    SCRIPT_CHECK(step(e, a->k, o, 0, n_prompt) == KVS_OK);
    SCRIPT_CHECK_KV();
    for (int i = 0; i < 6; i++) {
        sync_point(a);
        o->toks[o->n_past] = o->ids[o->n_steps - 1];
        SCRIPT_CHECK(step(e, a->k, o, o->n_past, o->n_past + 1) == KVS_OK);
        SCRIPT_CHECK_KV();
    }
    sync_point(a);
    kv_sid sid = sid_of(a->k);
    kv_reply rep;
    uint32_t len = o->n_past - 3, full = o->n_past;
    SCRIPT_CHECK(kv_truncate(e->kv, &sid, 1, len, &rep) == KVS_OK);
    SCRIPT_CHECK_KV();
    SCRIPT_CHECK(step(e, a->k, o, len, full) == KVS_OK);
    SCRIPT_CHECK_KV();
    sync_point(a);
    /* A cancelled append: the session must come back exactly as it was. */
    kv_txn *txn = NULL;
    o->toks[o->n_past] = o->ids[o->n_steps - 1];
    SCRIPT_CHECK(kv_begin(e->kv, &sid, 1, o->n_past, 1, NULL, &txn, &rep) == KVS_OK);
    SCRIPT_CHECK_KV();
    if (txn) {
        SCRIPT_CHECK(kv_cancel(e->kv, &sid) == KVS_OK);
        SCRIPT_CHECK_KV();
        float *junk = malloc((size_t)nv * sizeof(float));
        fwd_item it = {.txn = txn, .tokens = o->toks + o->n_past, .out_mode = FWD_OUT_LOGITS_LAST, .out = junk};
        SCRIPT_CHECK(fwd_run(e->m, e->pool, e->kv, &it, 1) == KVS_OK);
        SCRIPT_CHECK_KV();
        SCRIPT_CHECK(it.status == KVS_ERR_CANCELLED);
        kv_abort(e->kv, txn, true);
        SCRIPT_CHECK_KV();
        free(junk);
    }
    uint32_t np = 0;
    SCRIPT_CHECK(kv_lookup(e->kv, &sid, NULL, &np) == KVS_OK && np == o->n_past);
    SCRIPT_CHECK_KV();
    sync_point(a);
    /* Rewind by 2 through append (start_pos < n_past). */
    SCRIPT_CHECK(step(e, a->k, o, o->n_past - 2, o->n_past) == KVS_OK);
    SCRIPT_CHECK_KV();
    for (int i = 0; i < 4; i++) {
        sync_point(a);
        o->toks[o->n_past] = o->ids[o->n_steps - 1];
        SCRIPT_CHECK(step(e, a->k, o, o->n_past, o->n_past + 1) == KVS_OK);
        SCRIPT_CHECK_KV();
    }
    return NULL;
}

static script_out *new_outs(int nv) {
    script_out *o = calloc(N_SESS, sizeof(script_out));
    for (int k = 0; k < N_SESS; k++) o[k].logits = calloc((size_t)MAX_STEPS * (size_t)nv, sizeof(float));
    return o;
}

static void free_outs(script_out *o) {
    for (int k = 0; k < N_SESS; k++) free(o[k].logits);
    free(o);
}

static void check_same(const char *what, const script_out *a, const script_out *b, int nv) {
    CHECK_EQ_INT(a->n_steps, b->n_steps);
    CHECK_EQ_INT(a->n_past, b->n_past);
    int bad = 0;
    for (int s = 0; s < a->n_steps && s < b->n_steps; s++) {
        if (a->ids[s] != b->ids[s]) bad++;
        if (memcmp(a->logits + (size_t)s * nv, b->logits + (size_t)s * nv, (size_t)nv * sizeof(float))) bad++;
    }
    if (bad) fprintf(stderr, "%s: %d steps differ from the solo run\n", what, bad);
    CHECK_EQ_INT(bad, 0);
}

static void run_model(const char *path) {
    printf("model %s\n", path);
    /* Solo runs, each on a fresh engine. */
    engine *probe = open_engine(path, 64ull << 20);
    CHECK(probe != NULL);
    if (!probe) return;
    int nv = (int)probe->m->hp.n_vocab;
    engine_close(probe);
    script_out *solo = new_outs(nv), *conc = new_outs(nv);
    for (int k = 0; k < N_SESS; k++) {
        engine *e = open_engine(path, 64ull << 20);
        script_arg a = {.e = e, .k = k, .o = &solo[k]};
        script(&a);
        CHECK_EQ_INT(a.failures, 0);
        engine_close(e);
    }
    /* Four threads on one engine, in lock step. */
    engine *e = open_engine(path, 64ull << 20);
    kv_stats before;
    kv_get_stats(e->kv, &before);
    pthread_barrier_t barrier;
    pthread_barrier_init(&barrier, NULL, N_SESS);
    pthread_t th[N_SESS];
    script_arg args[N_SESS];
    for (int k = 0; k < N_SESS; k++) {
        args[k] = (script_arg){.e = e, .k = k, .o = &conc[k], .barrier = &barrier};
        pthread_create(&th[k], NULL, script, &args[k]);
    }
    for (int k = 0; k < N_SESS; k++) {
        pthread_join(th[k], NULL);
        CHECK_EQ_INT(args[k].failures, 0);
        check_same("4 threads", &conc[k], &solo[k], nv);
    }
    pthread_barrier_destroy(&barrier);
    kv_stats st;
    kv_get_stats(e->kv, &st);
    CHECK_EQ_INT(st.sessions, N_SESS);
    CHECK_EQ_INT(st.cancellations, N_SESS);
    CHECK(st.rewinds >= N_SESS);
    /* The state after truncates/rewinds agrees with a full recompute. */
    float *full = malloc((size_t)MAX_TOK * (size_t)nv * sizeof(float));
    for (int k = 0; k < N_SESS; k++) {
        engine_req r = {.sid = sid_of(100 + k), .epoch = 1, .n = conc[k].n_past, .tokens = conc[k].toks,
                        .out_mode = FWD_OUT_LOGITS_LAST, .out = full};
        engine_step(e, &r, 1);
        CHECK_KV(e->kv);
        CHECK_EQ_INT(r.status, KVS_OK);
        CHECK(memcmp(full, conc[k].logits + (size_t)(conc[k].n_steps - 1) * nv, (size_t)nv * sizeof(float)) == 0);
    }
    /* Release: bytes_used returns exactly to its earlier value. */
    for (int k = 0; k < N_SESS; k++) {
        kv_sid a = sid_of(k), b = sid_of(100 + k);
        CHECK_EQ_INT(kv_release(e->kv, &a, 1, NULL), KVS_OK);
        CHECK_KV(e->kv);
        CHECK_EQ_INT(kv_release(e->kv, &b, 1, NULL), KVS_OK);
        CHECK_KV(e->kv);
    }
    kv_get_stats(e->kv, &st);
    CHECK_EQ_INT(st.bytes_used, before.bytes_used);
    CHECK_EQ_INT(st.sessions, 0);

    /* Batched decode: the 4 sessions' steps in one forward, vs solo. */
    for (int k = 0; k < N_SESS; k++) {
        engine_req r = {.sid = sid_of(k), .epoch = 1, .n = 5 + 3 * (uint32_t)k, .tokens = solo[k].toks,
                        .out_mode = FWD_OUT_LOGITS_LAST, .out = full};
        engine_step(e, &r, 1);
        CHECK_KV(e->kv);
        CHECK(memcmp(full, solo[k].logits, (size_t)nv * sizeof(float)) == 0);
    }
    engine_req reqs[N_SESS];
    float *bl = malloc((size_t)N_SESS * (size_t)nv * sizeof(float));
    for (int s = 1; s <= 6; s++) {
        for (int k = 0; k < N_SESS; k++) {
            uint32_t pos = 5 + 3 * (uint32_t)k + (uint32_t)s - 1;
            reqs[k] = (engine_req){.sid = sid_of(k), .epoch = 1, .start_pos = pos, .n = 1, .tokens = &solo[k].toks[pos],
                                   .out_mode = FWD_OUT_LOGITS_LAST, .out = bl + (size_t)k * nv};
        }
        CHECK_EQ_INT(engine_step(e, reqs, N_SESS), KVS_OK);
        CHECK_KV(e->kv);
        for (int k = 0; k < N_SESS; k++) {
            CHECK_EQ_INT(reqs[k].status, KVS_OK);
            CHECK(memcmp(bl + (size_t)k * nv, solo[k].logits + (size_t)s * nv, (size_t)nv * sizeof(float)) == 0);
        }
    }
    /* A forward of two items whose first was cancelled: the second's tokens move to the front
     * (with their positions' rotations: positions 3-4 of session 201, where the cancelled
     * item's were 0-7) and its logits are its solo prefill's, bit for bit. */
    {
        const kv_sid ca = sid_of(200), cb = sid_of(201);
        const uint32_t na = 5 + 3 * 1, nb = 5;
        engine_req r = {.sid = cb, .epoch = 1, .n = 3, .tokens = solo[0].toks, .out_mode = FWD_OUT_LOGITS_LAST, .out = full};
        engine_step(e, &r, 1);
        CHECK_KV(e->kv);
        CHECK_EQ_INT(r.status, KVS_OK);
        kv_txn *ta = NULL, *tb = NULL;
        kv_reply rep;
        CHECK_EQ_INT(kv_begin(e->kv, &ca, 1, 0, na, NULL, &ta, &rep), KVS_OK);
        CHECK_KV(e->kv);
        CHECK_EQ_INT(kv_begin(e->kv, &cb, 1, 3, nb - 3, NULL, &tb, &rep), KVS_OK);
        CHECK_KV(e->kv);
        if (ta && tb) {
            CHECK_EQ_INT(kv_cancel(e->kv, &ca), KVS_OK);
            CHECK_KV(e->kv);
            float *junk = malloc((size_t)nv * sizeof(float));
            fwd_item items[2] = {{.txn = ta, .tokens = solo[1].toks, .out_mode = FWD_OUT_LOGITS_LAST, .out = junk},
                                 {.txn = tb, .tokens = solo[0].toks + 3, .out_mode = FWD_OUT_LOGITS_LAST, .out = full}};
            CHECK_EQ_INT(fwd_run(e->m, e->pool, e->kv, items, 2), KVS_OK);
            CHECK_EQ_INT(items[0].status, KVS_ERR_CANCELLED);
            CHECK_EQ_INT(items[1].status, KVS_OK);
            CHECK(memcmp(full, solo[0].logits, (size_t)nv * sizeof(float)) == 0);
            kv_abort(e->kv, ta, true);
            CHECK_KV(e->kv);
            kv_commit(e->kv, tb, &rep);
            CHECK_KV(e->kv);
            free(junk);
        }
    }
    engine_close(e);

    /* A budget for about two sessions with four active: LRU eviction, CACHE_MISS(0), replay. */
    uint32_t longest = 0;
    for (int k = 0; k < N_SESS; k++)
        if (solo[k].n_past > longest) longest = solo[k].n_past;
    model *m = NULL;
    char msg[KVS_MSG_MAX];
    CHECK_EQ_INT(model_load(path, 0, 0, &m, msg, sizeof(msg)), KVS_OK);
    uint64_t block = 16ull * m->hp.n_layer * 2 * m->hp.n_head_kv * m->hp.head_dim * 2;
    model_free(m);
    uint64_t blocks_per_sess = (longest + 15) / 16;
    engine *tight = open_engine(path, (2 * blocks_per_sess + 1) * block);
    CHECK(tight != NULL);
    if (tight) CHECK_EQ_INT(kv_block_bytes(tight->kv), block);
    /* A reference model of the pool: which sessions live, with how many positions, and when each
     * was last used (a step counter). Every eviction must take the least recently used idle
     * sessions, and the bytes held must be exactly their blocks. */
    int misses = 0, evictions = 0;
    uint64_t last_use[N_SESS] = {0}, clock = 0;
    for (int s = 0; s < 7 && tight; s++) {
        for (int k = 0; k < N_SESS; k++) {
            bool alive_before[N_SESS];
            for (int j = 0; j < N_SESS; j++) {
                kv_sid sj = sid_of(j);
                alive_before[j] = kv_lookup(tight->kv, &sj, NULL, NULL) == KVS_OK;
            }
            /* Client: ask for the next position; on CACHE_MISS replay from have. */
            uint32_t end = 5 + 3 * (uint32_t)k + (uint32_t)s;
            uint32_t start = s == 0 ? 0 : end - 1;
            engine_req r = {.sid = sid_of(k), .epoch = 1, .start_pos = start, .n = end - start,
                            .tokens = solo[k].toks + start, .out_mode = FWD_OUT_LOGITS_LAST, .out = full};
            engine_step(tight, &r, 1);
            CHECK_KV(tight->kv);
            if (r.status == KVS_ERR_CACHE_MISS) {
                misses++;
                CHECK(s > 0 && !alive_before[k]); /* only an evicted session misses */
                CHECK_EQ_INT(r.reply.have, 0);
                r.start_pos = r.reply.have;
                r.n = end - r.reply.have;
                r.tokens = solo[k].toks + r.reply.have;
                engine_step(tight, &r, 1);
                CHECK_KV(tight->kv);
            }
            CHECK_EQ_INT(r.status, KVS_OK);
            CHECK(memcmp(full, solo[k].logits + (size_t)s * nv, (size_t)nv * sizeof(float)) == 0);
            last_use[k] = ++clock;
            /* LRU first: every session this step evicted was used less recently than every idle
             * one it left. */
            uint64_t newest_evicted = 0, oldest_kept = UINT64_MAX, want_bytes = 0;
            uint32_t live = 0;
            for (int j = 0; j < N_SESS; j++) {
                kv_sid sj = sid_of(j);
                uint32_t np = 0;
                bool alive = kv_lookup(tight->kv, &sj, NULL, &np) == KVS_OK;
                if (j == k) CHECK(alive && np == end);
                if (alive) {
                    live++;
                    want_bytes += (np + 15) / 16 * block;
                }
                if (j == k || !alive_before[j]) continue;
                if (!alive) {
                    evictions++;
                    if (last_use[j] > newest_evicted) newest_evicted = last_use[j];
                } else if (last_use[j] < oldest_kept) {
                    oldest_kept = last_use[j];
                }
            }
            if (newest_evicted >= oldest_kept)
                fprintf(stderr, "step %d of session %d: evicted a session used at %llu, kept one used at %llu\n", s, k,
                        (unsigned long long)newest_evicted, (unsigned long long)oldest_kept);
            CHECK(newest_evicted < oldest_kept);
            kv_get_stats(tight->kv, &st);
            CHECK_EQ_INT(st.bytes_used, want_bytes);
            CHECK_EQ_INT(st.sessions, live);
            CHECK_EQ_INT(st.evict_lru, evictions);
        }
    }
    if (tight) {
        kv_get_stats(tight->kv, &st);
        printf("  tight budget: %llu blocks, %d cache misses, %llu LRU evictions\n", (unsigned long long)st.blocks_total,
               misses, (unsigned long long)st.evict_lru);
        CHECK(misses > 0);
        CHECK(st.evict_lru > 0);
        CHECK(st.sessions <= 3);
        /* Every byte comes back on release. */
        for (int k = 0; k < N_SESS; k++) {
            kv_sid sk = sid_of(k);
            kv_release(tight->kv, &sk, 1, NULL);
            CHECK_KV(tight->kv);
        }
        kv_get_stats(tight->kv, &st);
        CHECK_EQ_INT(st.bytes_used, 0);
        CHECK_EQ_INT(st.blocks_free, st.blocks_total);
    }
    engine_close(tight);
    free(bl);
    free(full);
    free_outs(solo);
    free_outs(conc);
}

int main(void) {
    char dir[] = "/tmp/kvs-sessions-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char synth[256];
    snprintf(synth, sizeof(synth), "%s/small-q8_0.gguf", dir);
    mkmodel_params mp = mkmodel_default_params();
    mp.shape = "small";
    mp.type = QUANT_Q8_0;
    mp.seed = 7;
    mp.n_threads = 1;
    char msg[KVS_MSG_MAX];
    CHECK_EQ_INT(mkmodel_write(synth, mp, msg, sizeof(msg)), KVS_OK);
    run_model(synth);
    unlink(synth);
    rmdir(dir);
    int skipped = 0;
    char buf[1024];
    const char *stories = test_shared_path("models/stories260K.gguf", buf, sizeof(buf));
    if (stories) run_model(stories);
    else skipped++;
    return test_finish("test_kvstate_sessions", 1, skipped);
}
