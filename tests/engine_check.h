/*
 * engine_check — engine-level helpers shared by the tests that compare logits
 * (reference_check.h, test_downloads, test_split): open a layer range, make a
 * session id, open a model whole and as two halves, and the two bit-identity
 * checks (KV path against the one-batch path, two ranges passing hidden states
 * against the whole model). Header-only, static inline: a test uses what it needs.
 */
#ifndef KVS_ENGINE_CHECK_H
#define KVS_ENGINE_CHECK_H

#include <stdbool.h>

#include "engine.h"
#include "test.h"

/* Opens layers [first, last) of path (0, 0: the whole model) with 2 threads and
 * a KV budget of kv_budget_bytes; prints the engine's message and returns NULL
 * on failure. The caller closes the engine. */
static inline engine *open_range(const char *path, uint32_t first, uint32_t last, uint64_t kv_budget_bytes) {
    engine_params ep = engine_default_params();
    ep.model_path = path;
    ep.first = first;
    ep.last = last;
    ep.n_threads = 2;
    ep.kv.budget_bytes = kv_budget_bytes;
    engine *e = NULL;
    char msg[KVS_MSG_MAX] = "";
    int err = engine_open(&ep, &e, msg, sizeof(msg));
    if (err) fprintf(stderr, "engine_open(%s, %u, %u): %s\n", path, first, last, msg);
    return e;
}

/* A session id whose first bytes are k, the rest zero. */
static inline void set_sid(kv_sid *sid, int k) {
    memset(sid->bytes, 0, 16);
    memcpy(sid->bytes, &k, sizeof(k));
}

/* One model opened whole and as its two halves [0, n_layer/2), [n_layer/2, n_layer). */
typedef struct {
    engine *whole, *head, *tail;
} engine_halves;

/* Opens path as engine_halves (CHECKs each open); false when the whole model
 * did not open (then nothing is left open). A failed half is left NULL. */
static inline bool open_halves(const char *path, uint64_t kv_budget_bytes, engine_halves *h) {
    h->head = h->tail = NULL;
    h->whole = open_range(path, 0, 0, kv_budget_bytes);
    CHECK(h->whole != NULL);
    if (!h->whole) return false;
    uint32_t nl = h->whole->m->hp.n_layer, mid = nl / 2;
    h->head = open_range(path, 0, mid, kv_budget_bytes);
    h->tail = open_range(path, mid, nl, kv_budget_bytes);
    CHECK(h->head && h->tail);
    return true;
}

static inline void close_halves(engine_halves *h) {
    engine_close(h->whole);
    engine_close(h->head);
    engine_close(h->tail);
}

/* KV path: tok[0..n_prompt) in one step, then tok[n_prompt..n) one at a time
 * on session sid, all logits into out ([n][n_vocab], caller's scratch). True
 * when out equals want bit for bit. */
static inline bool kv_path_matches(engine *e, kv_sid sid, const int32_t *tok, int n_prompt, int n, float *out,
                                   const float *want) {
    size_t nv = e->m->hp.n_vocab;
    engine_req kr = {.sid = sid, .epoch = 1, .n = (uint32_t)n_prompt, .tokens = tok, .out_mode = FWD_OUT_LOGITS_ALL,
                     .out = out};
    CHECK_EQ_INT(engine_step(e, &kr, 1), KVS_OK);
    for (int i = n_prompt; i < n; i++) {
        engine_req d = {.sid = sid, .epoch = 1, .start_pos = (uint32_t)i, .n = 1, .tokens = &tok[i],
                        .out_mode = FWD_OUT_LOGITS_LAST, .out = out + (size_t)i * nv};
        CHECK_EQ_INT(engine_step(e, &d, 1), KVS_OK);
        CHECK_EQ_INT(d.status, KVS_OK);
    }
    return memcmp(out, want, (size_t)n * nv * sizeof(float)) == 0;
}

/* Two ranges: tok[0..n) through head to hidden states (hid, [n][n_embd]
 * scratch), those through tail to logits (out, [n][n_vocab] scratch), both on
 * session id sid_k. True when out equals want bit for bit. */
static inline bool split_matches(engine *head, engine *tail, int sid_k, const int32_t *tok, int n, float *hid,
                                 float *out, const float *want) {
    engine_req h = {.epoch = 1, .n = (uint32_t)n, .tokens = tok, .out_mode = FWD_OUT_HIDDEN, .out = hid};
    set_sid(&h.sid, sid_k);
    CHECK_EQ_INT(engine_step(head, &h, 1), KVS_OK);
    engine_req t = {.epoch = 1, .n = (uint32_t)n, .hidden = hid, .out_mode = FWD_OUT_LOGITS_ALL, .out = out};
    set_sid(&t.sid, sid_k);
    CHECK_EQ_INT(engine_step(tail, &t, 1), KVS_OK);
    return memcmp(out, want, (size_t)n * (size_t)tail->m->hp.n_vocab * sizeof(float)) == 0;
}

#endif /* KVS_ENGINE_CHECK_H */
