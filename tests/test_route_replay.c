/*
 * test_route_replay — the route client's replay memory (issue 7, defect 7), against two
 * in-process shards of the synthetic `small` model:
 *  - f16 hidden states (route_params.hidden_f16): replays after evictions (a tail budget for one
 *    session, two sessions interleaved) give logits identical to an undisturbed f16 run, because a
 *    replay sends exactly the bytes first sent; the replay memory is half the f32 one;
 *  - max_replay_bytes bounds it: max_ctx drops to what fits, the session's memory never passes
 *    the cap, and a step past it is CONTEXT_FULL with nothing sent;
 *  - a hop that is gone when the route opens is replaced by a spare (soak: a shard killed while a
 *    client says HELLO).
 */
#include <pthread.h>

#include "mkmodel.h"
#include "netio.h"
#include "quant.h"
#include "route.h"
#include "server.h"
#include "test.h"
#include "util.h"

typedef struct {
    srv *s;
    pthread_t th;
} shard;

static void *serve_main(void *p) {
    srv_run(((shard *)p)->s);
    return NULL;
}

static bool shard_start(shard *sh, const char *model_path, uint32_t first, uint32_t last, uint64_t budget) {
    srv_params p = srv_default_params();
    p.model_path = model_path;
    p.first = first;
    p.last = last;
    p.listen = "127.0.0.1:0";
    p.n_threads = 1;
    p.kv_budget_bytes = budget;
    char msg[KVS_MSG_MAX] = "";
    if (srv_create(&p, &sh->s, msg, sizeof msg) != KVS_OK) {
        fprintf(stderr, "srv_create: %s\n", msg);
        sh->s = NULL; /* shard_stop: nothing to stop */
        return false;
    }
    pthread_create(&sh->th, NULL, serve_main, sh);
    return true;
}

/* Stops and frees a shard; one whose start failed is left as it is. */
static void shard_stop(shard *sh) {
    if (!sh->s) return;
    srv_stop(sh->s);
    pthread_join(sh->th, NULL);
    srv_free(sh->s);
}

enum { N_PROMPT = 8, N_STEPS = 24, N_VOCAB = 512 };

/* Drives a session: an 8-token prompt, then 24 one-token steps of fixed ids; the logits of every
 * step go to out[(N_STEPS + 1) x N_VOCAB]. With `other`, a second session is stepped between
 * every two steps of the first (it evicts the first where the budget holds one). */
static int drive(route *r, route_session *s, route_session *other, int k, float *out) {
    int32_t toks[N_PROMPT + N_STEPS];
    for (int i = 0; i < N_PROMPT + N_STEPS; i++) toks[i] = (i * 11 + k * 5 + 3) % N_VOCAB;
    char msg[KVS_MSG_MAX] = "";
    float scratch[N_VOCAB];
    int rc = route_forward(r, s, toks, N_PROMPT, out, msg, sizeof msg);
    if (!rc && other) rc = route_forward(r, other, toks, N_PROMPT, scratch, msg, sizeof msg);
    for (int i = 0; !rc && i < N_STEPS; i++) {
        rc = route_forward(r, s, &toks[N_PROMPT + i], 1, out + (size_t)(i + 1) * N_VOCAB, msg, sizeof msg);
        if (!rc && other) rc = route_forward(r, other, &toks[N_PROMPT + i], 1, scratch, msg, sizeof msg);
    }
    if (rc) fprintf(stderr, "drive: %s\n", msg);
    return rc;
}

static int g_misses; /* "cache miss" events logged by the route */

static void count_misses(void *user, const char *line) {
    (void)user;
    if (strstr(line, "cache miss")) g_misses++;
}

static route *open_route(shard *head, shard *tail, bool f16, uint64_t cap) {
    char spec[64];
    snprintf(spec, sizeof spec, "127.0.0.1:%u,127.0.0.1:%u", srv_port(head->s), srv_port(tail->s));
    route_params rp = route_default_params();
    rp.hidden_f16 = f16;
    rp.max_replay_bytes = cap;
    rp.log = count_misses;
    route *r = NULL;
    char msg[KVS_MSG_MAX] = "";
    int rc = route_open(spec, NULL, &rp, &r, msg, sizeof msg);
    if (rc) fprintf(stderr, "route_open: %s\n", msg);
    CHECK_EQ_INT(rc, KVS_OK);
    return r;
}

/* The route checks, over the two full-budget shards and the tight tail. */
static void check_routes(shard *head, shard *tail, shard *tight) {
    char msg[KVS_MSG_MAX];
    size_t n = (size_t)(N_STEPS + 1) * N_VOCAB;
    float *ref = malloc(n * sizeof(float)), *got = malloc(n * sizeof(float));

    /* An undisturbed f16 run, then the same with evictions on the tail and replays. */
    route *r = open_route(head, tail, true, 0);
    route_session *s = NULL, *o = NULL;
    CHECK_EQ_INT(route_session_open(r, &s, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(drive(r, s, NULL, 1, ref), KVS_OK);
    uint64_t f16_bytes = route_session_replay_bytes(s);
    route_release(r, s);
    route_close(r);
    r = open_route(head, tight, true, 0);
    CHECK_EQ_INT(route_session_open(r, &s, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(route_session_open(r, &o, msg, sizeof msg), KVS_OK);
    g_misses = 0;
    CHECK_EQ_INT(drive(r, s, o, 1, got), KVS_OK);
    CHECK(g_misses > 0); /* the tail evicted and the client replayed */
    CHECK(memcmp(ref, got, n * sizeof(float)) == 0);
    route_release(r, s);
    route_release(r, o);
    route_close(r);

    /* f32 costs twice the hidden part: (4 + 256 x 4) vs (4 + 256 x 2) bytes per position. */
    r = open_route(head, tail, false, 0);
    CHECK_EQ_INT(route_session_open(r, &s, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(drive(r, s, NULL, 1, got), KVS_OK);
    uint64_t f32_bytes = route_session_replay_bytes(s);
    CHECK_EQ_INT(f32_bytes / (4 + 256 * 4), f16_bytes / (4 + 256 * 2)); /* same rows allocated */
    CHECK_EQ_INT(f32_bytes % (4 + 256 * 4), 0);
    route_release(r, s);
    route_close(r);

    /* A cap of 20 positions in f16: max_ctx 20, memory within the cap, step 21 refused. */
    uint64_t cap = 20 * (4 + 256 * 2);
    r = open_route(head, tail, true, cap);
    route_info info;
    route_get_info(r, &info);
    CHECK_EQ_INT(info.max_ctx, 20);
    CHECK_EQ_INT(route_session_open(r, &s, msg, sizeof msg), KVS_OK);
    int32_t toks[20];
    for (int i = 0; i < 20; i++) toks[i] = i + 1;
    CHECK_EQ_INT(route_forward(r, s, toks, 20, got, msg, sizeof msg), KVS_OK);
    CHECK(route_session_replay_bytes(s) <= cap);
    CHECK_EQ_INT(route_forward(r, s, toks, 1, got, msg, sizeof msg), KVS_ERR_CONTEXT_FULL);
    CHECK_EQ_INT(route_session_pos(s), 20);
    route_release(r, s);
    route_close(r);

    /* A hop that is gone when the route opens is replaced by a spare of the same start layer. */
    {
        int lfd = -1;
        uint16_t dead = 0;
        CHECK_EQ_INT(netio_listen("127.0.0.1", 0, 1, &lfd, &dead, msg, sizeof msg), KVS_OK);
        close(lfd); /* nothing listens there now */
        char spec[64], spare[32];
        snprintf(spec, sizeof spec, "127.0.0.1:%u,127.0.0.1:%u", dead, srv_port(tail->s));
        snprintf(spare, sizeof spare, "127.0.0.1:%u", srv_port(head->s));
        route_params rp = route_default_params();
        CHECK_EQ_INT(route_open(spec, spare, &rp, &r, msg, sizeof msg), KVS_OK);
        if (r) {
            route_get_info(r, &info);
            CHECK_EQ_INT(info.reroutes, 1);
            CHECK_EQ_INT(route_session_open(r, &s, msg, sizeof msg), KVS_OK);
            CHECK_EQ_INT(route_forward(r, s, toks, 4, got, msg, sizeof msg), KVS_OK);
            route_release(r, s);
            route_close(r);
        }
    }

    free(ref);
    free(got);
}

int main(void) {
    char dir[] = "/tmp/kvs-replay-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char model_path[256];
    snprintf(model_path, sizeof model_path, "%s/small-q8_0.gguf", dir);
    mkmodel_params mp = mkmodel_default_params();
    mp.shape = "small";
    mp.type = QUANT_Q8_0;
    mp.n_threads = 1;
    char msg[KVS_MSG_MAX];
    CHECK_EQ_INT(mkmodel_write(model_path, mp, msg, sizeof msg), KVS_OK);
    /* small: n_embd 256, 2 layers, KV block of one layer = 16 x 2 x 2 x 64 x 2 = 8 KiB. */
    shard head, tail, tight;
    bool up = shard_start(&head, model_path, 0, 1, 16u << 20);
    up = shard_start(&tail, model_path, 1, 2, 16u << 20) && up;
    up = shard_start(&tight, model_path, 1, 2, 3u * 8192u) && up; /* one session of 32 positions */
    CHECK(up);
    if (up) check_routes(&head, &tail, &tight); /* nothing runs without all three */
    shard_stop(&head);
    shard_stop(&tail);
    shard_stop(&tight);
    unlink(model_path);
    rmdir(dir);
    return test_finish("test_route_replay", 1, 0);
}
