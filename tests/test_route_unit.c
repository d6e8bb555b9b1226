/* test_route_unit — route client pieces without real shards: spec parsing, route validation on
 * fake INFO structs, tokenizer from arrays == from GGUF, and route_forward against a scripted fake
 * shard (BUSY retry, chunking, CACHE_MISS replay with the original request boundaries,
 * STALE_EPOCH, RELEASE). Multi-process routes and kill -9 failover are in test_route. */
#include <pthread.h>
#include <stdbool.h>

#include "gguf.h"
#include "kvshard.h"
#include "netio.h"
#include "route.h"
#include "sampler.h"
#include "tokenizer.h"
#include "util.h"
#include "test.h"

/* ---- spec parsing ---- */

static void test_parse_spec(void) {
    route_addr *a = NULL;
    size_t n = 0;
    char msg[KVS_MSG_MAX];
    CHECK_EQ_INT(route_parse_spec("127.0.0.1:7000, localhost:7001 ,[::1]:7002", &a, &n, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(n, 3);
    if (a && n == 3) {
        CHECK(!strcmp(a[0].host, "127.0.0.1") && a[0].port == 7000);
        CHECK(!strcmp(a[1].host, "localhost") && a[1].port == 7001 && !strcmp(a[1].text, "localhost:7001"));
        CHECK(!strcmp(a[2].host, "::1") && a[2].port == 7002);
    }
    free(a);
    static const char *const bad[] = {"", "h:1,", ",h:1", "h:1,,h:2", "nohost", "h:99999", "h:", ":7"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        msg[0] = 0;
        CHECK_EQ_INT(route_parse_spec(bad[i], &a, &n, msg, sizeof msg), KVS_ERR_INVALID_ARG);
        CHECK(a == NULL && n == 0 && msg[0]);
    }
    CHECK_EQ_INT(route_parse_spec(NULL, &a, &n, msg, sizeof msg), KVS_ERR_INVALID_ARG);
}

/* ---- validation ---- */

static struct wire_info fake_info(uint32_t first, uint32_t last) {
    struct wire_info i = {.version = 1, .hidden_dtypes = WIRE_DTYPE_F32, .n_layer = 6, .first = first, .last = last,
                          .n_embd = 64, .n_vocab = 512, .max_tokens = 512, .max_ctx = 2048};
    memset(i.model_digest, 0xab, sizeof i.model_digest);
    return i;
}

static void test_check_hops(void) {
    const char *names[3] = {"a:1", "b:2", "127.0.0.1:7002"};
    struct wire_info in[3] = {fake_info(0, 2), fake_info(2, 3), fake_info(3, 6)};
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(route_check_hops(in, names, 3, msg, sizeof msg), KVS_OK);
    struct wire_info one = fake_info(0, 6);
    CHECK_EQ_INT(route_check_hops(&one, names, 1, msg, sizeof msg), KVS_OK);

    in[2].first = 4;
    CHECK_EQ_INT(route_check_hops(in, names, 3, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    CHECK(!strcmp(msg, "hop 2 (127.0.0.1:7002) serves layers [4, 6) but the previous hop ends at 3"));
    in[2].first = 3;
    in[0].first = 1;
    CHECK_EQ_INT(route_check_hops(in, names, 3, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    CHECK(strstr(msg, "hop 0 (a:1)") && strstr(msg, "start at layer 0"));
    in[0].first = 0;
    in[2].last = 5;
    CHECK_EQ_INT(route_check_hops(in, names, 3, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    CHECK(strstr(msg, "hop 2") && strstr(msg, "6 layers"));
    in[2].last = 6;
    in[1].model_digest[5] ^= 1;
    CHECK_EQ_INT(route_check_hops(in, names, 3, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    CHECK(strstr(msg, "hop 1 (b:2) serves another model"));
    in[1].model_digest[5] ^= 1;
    in[1].n_embd = 32;
    CHECK_EQ_INT(route_check_hops(in, names, 3, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    CHECK(strstr(msg, "hop 1 (b:2)") && strstr(msg, "n_embd"));
    in[1].n_embd = 64;
    in[2].hidden_dtypes = WIRE_DTYPE_F16;
    CHECK_EQ_INT(route_check_hops(in, names, 3, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    in[2].hidden_dtypes = WIRE_DTYPE_F32;
    CHECK_EQ_INT(route_check_hops(in, names, 0, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    CHECK_EQ_INT(route_check_hops(in, names, 3, msg, sizeof msg), KVS_OK);
}

/* ---- tokenizer from arrays ---- */

static int test_tok_arrays(void) {
    char path[1024];
    if (!test_shared_path("models/stories260K.gguf", path, sizeof path)) return 0;
    gguf_ctx *g = NULL;
    tok_vocab *vg = NULL, *va = NULL;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(gguf_open(path, &g, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(tok_from_gguf(g, &vg, msg, sizeof msg), KVS_OK);
    gguf_close(g);
    if (!vg) return 1;
    int32_t n = tok_n_vocab(vg);
    const char **texts = calloc((size_t)n, sizeof *texts);
    uint32_t *lens = calloc((size_t)n, sizeof *lens);
    float *scores = calloc((size_t)n, sizeof *scores);
    int32_t *types = calloc((size_t)n, sizeof *types);
    for (int32_t i = 0; i < n; i++) {
        size_t l = 0;
        texts[i] = tok_token_text(vg, i, &l);
        lens[i] = (uint32_t)l;
        scores[i] = tok_token_score(vg, i);
        types[i] = tok_token_type(vg, i);
    }
    tok_arrays a = {.n_vocab = n, .texts = texts, .text_lens = lens, .scores = scores, .types = types,
                    .bos = tok_bos(vg), .eos = tok_eos(vg), .unk = 0, .add_space_prefix = tok_add_space_prefix(vg)};
    CHECK_EQ_INT(tok_from_arrays(&a, &va, msg, sizeof msg), KVS_OK);
    if (va) {
        CHECK_EQ_INT(tok_n_vocab(va), n);
        CHECK_EQ_INT(tok_bos(va), tok_bos(vg));
        CHECK_EQ_INT(tok_eos(va), tok_eos(vg));
        int bad_pieces = 0;
        for (int32_t i = 0; i < n; i++) {
            char p1[256], p2[256];
            size_t l1 = 0, l2 = 0;
            tok_piece(vg, i, p1, sizeof p1, &l1);
            tok_piece(va, i, p2, sizeof p2, &l2);
            size_t t1, t2;
            const char *s1 = tok_token_text(vg, i, &t1), *s2 = tok_token_text(va, i, &t2);
            if (l1 != l2 || memcmp(p1, p2, l1 < sizeof p1 ? l1 : sizeof p1) || t1 != t2 || memcmp(s1, s2, t1) ||
                tok_token_score(vg, i) != tok_token_score(va, i) || tok_token_type(vg, i) != tok_token_type(va, i))
                bad_pieces++;
        }
        CHECK_EQ_INT(bad_pieces, 0);
        static const char *const prompts[] = {"Once upon a time", "  two  spaces", "caf\xc3\xa9 \xe2\x9c\x93 \xff\xfe",
                                              "", "Lily said, \"Hi!\"\n"};
        for (size_t i = 0; i < sizeof prompts / sizeof prompts[0]; i++) {
            int32_t i1[256], i2[256];
            int n1 = 0, n2 = 0;
            CHECK_EQ_INT(tok_encode(vg, prompts[i], strlen(prompts[i]), true, i1, 256, &n1), KVS_OK);
            CHECK_EQ_INT(tok_encode(va, prompts[i], strlen(prompts[i]), true, i2, 256, &n2), KVS_OK);
            CHECK(n1 == n2 && !memcmp(i1, i2, (size_t)n1 * sizeof *i1));
        }
        tok_free(va);
        va = NULL;
    }
    /* invalid arrays */
    a.bos = n;
    CHECK_EQ_INT(tok_from_arrays(&a, &va, msg, sizeof msg), KVS_ERR_FORMAT);
    a.bos = 1;
    a.n_vocab = 0;
    CHECK_EQ_INT(tok_from_arrays(&a, &va, msg, sizeof msg), KVS_ERR_FORMAT);
    a.n_vocab = n;
    lens[7] = 5000;
    CHECK_EQ_INT(tok_from_arrays(&a, &va, msg, sizeof msg), KVS_ERR_FORMAT);
    CHECK(va == NULL);
    CHECK_EQ_INT(tok_from_arrays(NULL, &va, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    free(texts);
    free(lens);
    free(scores);
    free(types);
    tok_free(vg);
    return 1;
}

/* ---- a scripted fake shard ---- */

#define FAKE_VOCAB 8u
#define FAKE_MAX_REQ 32
#define FAKE_CLOSE (-1000) /* script entry: close the connection unanswered, as an idle close does */

typedef struct {
    int listen_fd;
    uint16_t port;
    int32_t script[FAKE_MAX_REQ]; /* status to answer the i-th FORWARD with */
    uint32_t have[FAKE_MAX_REQ];  /* for CACHE_MISS */
    int n_fwd;                    /* FORWARDs received */
    struct {
        uint32_t start, n, flags;
        uint64_t epoch;
        int32_t tokens[8];
    } seen[FAKE_MAX_REQ];
    int n_release;
    int n_conns; /* connections accepted; the fake serves them one after another */
} fake_shard;

static void fake_reply(int fd, uint16_t op, uint64_t rid, const uint8_t *buf, size_t len) {
    netio_send_frame(fd, op, rid, buf, len, netio_deadline_ms(5000));
}

/* Serves one connection; true when the script closed it (the fake then takes the next one). */
static bool fake_serve(fake_shard *f, int fd);

static void *fake_main(void *arg) {
    fake_shard *f = arg;
    int fd = -1;
    char msg[KVS_MSG_MAX];
    for (int c = 0; c < 4; c++) {
        if (netio_accept(f->listen_fd, netio_deadline_ms(10000), &fd, msg, sizeof msg) != KVS_OK) return NULL;
        f->n_conns++;
        if (!fake_serve(f, fd)) break;
    }
    return NULL;
}

static bool fake_serve(fake_shard *f, int fd) {
    char msg[KVS_MSG_MAX];
    bool closed_by_script = false;
    struct netio_buf b = {0};
    uint8_t out[256];
    size_t len;
    struct wire_header h;
    while (netio_recv_frame(fd, &h, &b, netio_deadline_ms(10000), msg, sizeof msg) == KVS_OK) {
        if (h.op == WIRE_OP_HELLO) {
            struct wire_info in = {.version = 1, .hidden_dtypes = WIRE_DTYPE_F32, .n_layer = 2, .first = 0, .last = 2,
                                   .n_embd = 4, .n_vocab = FAKE_VOCAB, .max_tokens = 4, .max_ctx = 64};
            wire_encode_info(&in, out, sizeof out, &len);
            fake_reply(fd, WIRE_OP_INFO, h.request_id, out, len);
        } else if (h.op == WIRE_OP_FORWARD) {
            struct wire_forward q;
            if (wire_decode_forward(b.data, b.len, &q, msg, sizeof msg) != KVS_OK) break;
            int i = f->n_fwd++;
            if (i >= FAKE_MAX_REQ) break;
            f->seen[i].start = q.start_pos;
            f->seen[i].n = q.n_tokens;
            f->seen[i].flags = q.flags;
            f->seen[i].epoch = q.epoch;
            for (uint32_t j = 0; j < q.n_tokens && j < 8; j++) f->seen[i].tokens[j] = wire_forward_token(&q, j);
            if (f->script[i] == FAKE_CLOSE) {
                closed_by_script = true;
                break;
            }
            struct wire_forward_reply r = {.st = {.status = f->script[i]}};
            float logits[FAKE_VOCAB] = {0};
            uint32_t end = q.start_pos + q.n_tokens;
            if (r.st.status == KVS_OK) {
                logits[end % FAKE_VOCAB] = 1.0f; /* argmax tells which request the logits came from */
                r.st.n_past = end;
                r.out_kind = WIRE_OUTK_LOGITS_F32;
                r.n_rows = 1;
                r.n_cols = FAKE_VOCAB;
                r.data = logits;
            } else if (r.st.status == KVS_ERR_CACHE_MISS) {
                r.st.have = f->have[i];
                r.st.n_past = f->have[i];
            } else if (r.st.status == KVS_ERR_STALE_EPOCH) {
                r.st.live_epoch = 5;
            }
            wire_encode_forward_reply(&r, out, sizeof out, &len);
            fake_reply(fd, WIRE_OP_FORWARD_REPLY, h.request_id, out, len);
        } else if (h.op == WIRE_OP_RELEASE) {
            f->n_release++;
            struct wire_status_reply sr = {.st = {.status = KVS_OK}};
            wire_encode_status_reply(&sr, out, sizeof out, &len);
            fake_reply(fd, WIRE_OP_STATUS, h.request_id, out, len);
        } else {
            break;
        }
    }
    netio_buf_free(&b);
    close(fd);
    return closed_by_script;
}

/* The shard closes the link just as the next FORWARD arrives (its idle close racing the
 * client's check before the step): the client connects to the same address again, says HELLO
 * and sends the step there, with no spare and no epoch change. */
static void test_fake_shard_closes(void) {
    fake_shard f = {.listen_fd = -1};
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(netio_listen("127.0.0.1", 0, 4, &f.listen_fd, &f.port, msg, sizeof msg), KVS_OK);
    if (f.listen_fd < 0) return;
    int32_t script[] = {KVS_OK, FAKE_CLOSE, KVS_OK};
    memcpy(f.script, script, sizeof script);
    pthread_t th;
    pthread_create(&th, NULL, fake_main, &f);
    char spec[64];
    snprintf(spec, sizeof spec, "127.0.0.1:%u", (unsigned)f.port);
    route_params p = route_default_params();
    p.timeout_ms = 5000;
    route *r = NULL;
    route_session *s = NULL;
    CHECK_EQ_INT(route_open(spec, NULL, &p, &r, msg, sizeof msg), KVS_OK);
    if (r) CHECK_EQ_INT(route_session_open(r, &s, msg, sizeof msg), KVS_OK);
    if (s) {
        float logits[FAKE_VOCAB];
        const int32_t t1[2] = {1, 2}, t2[1] = {3};
        CHECK_EQ_INT(route_forward(r, s, t1, 2, logits, msg, sizeof msg), KVS_OK);
        int rc = route_forward(r, s, t2, 1, logits, msg, sizeof msg);
        if (rc != KVS_OK) fprintf(stderr, "after the shard closed the link: %s\n", msg);
        CHECK_EQ_INT(rc, KVS_OK);
        CHECK_EQ_INT(sampler_argmax(logits, FAKE_VOCAB), 3);
        CHECK_EQ_INT(route_session_epoch(s), 1);
    }
    route_release(r, s);
    route_close(r);
    pthread_join(th, NULL);
    close(f.listen_fd);
    CHECK_EQ_INT(f.n_conns, 2);
    CHECK_EQ_INT(f.n_fwd, 3);
    if (f.n_fwd == 3) CHECK(f.seen[2].start == 2 && f.seen[2].n == 1 && f.seen[2].tokens[0] == 3);
}

static void test_fake_shard(void) {
    fake_shard f = {.listen_fd = -1};
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(netio_listen("127.0.0.1", 0, 4, &f.listen_fd, &f.port, msg, sizeof msg), KVS_OK);
    if (f.listen_fd < 0) return;
    /* step 1: 6 tokens in chunks [0,4) (BUSY first) and [4,6); step 2: 1 token, CACHE_MISS(have 2) ->
     * replay [2,3) alone, then [3,7) (the rest of the replay merged with the step, max_tokens 4);
     * step 3: STALE_EPOCH. */
    int32_t script[] = {KVS_ERR_BUSY, KVS_OK, KVS_OK, KVS_ERR_CACHE_MISS, KVS_OK, KVS_OK, KVS_ERR_STALE_EPOCH};
    memcpy(f.script, script, sizeof script);
    f.have[3] = 2;
    pthread_t th;
    pthread_create(&th, NULL, fake_main, &f);

    char spec[64];
    snprintf(spec, sizeof spec, "127.0.0.1:%u", (unsigned)f.port);
    route_params p = route_default_params();
    p.timeout_ms = 5000;
    route *r = NULL;
    route_session *s = NULL;
    CHECK_EQ_INT(route_open(spec, NULL, &p, &r, msg, sizeof msg), KVS_OK);
    if (r) {
        route_info ri;
        route_get_info(r, &ri);
        CHECK_EQ_INT(ri.n_hops, 1);
        CHECK_EQ_INT(ri.max_rows, 4);
        CHECK_EQ_INT(ri.max_ctx, 64);
        CHECK_EQ_INT(route_session_open(r, &s, msg, sizeof msg), KVS_OK);
    }
    if (s) {
        float logits[FAKE_VOCAB];
        const int32_t t1[6] = {1, 2, 3, 4, 5, 6}, t2[1] = {7}, t3[1] = {3};
        int32_t bad[1] = {(int32_t)FAKE_VOCAB};
        CHECK_EQ_INT(route_forward(r, s, bad, 1, logits, msg, sizeof msg), KVS_ERR_INVALID_ARG);
        int32_t many[65] = {0};
        CHECK_EQ_INT(route_forward(r, s, many, 65, logits, msg, sizeof msg), KVS_ERR_CONTEXT_FULL);
        CHECK_EQ_INT(route_forward(r, s, t1, 6, logits, msg, sizeof msg), KVS_OK);
        CHECK_EQ_INT(sampler_argmax(logits, FAKE_VOCAB), 6);
        CHECK_EQ_INT(route_session_pos(s), 6);
        CHECK_EQ_INT(route_forward(r, s, t2, 1, logits, msg, sizeof msg), KVS_OK);
        CHECK_EQ_INT(sampler_argmax(logits, FAKE_VOCAB), 7);
        CHECK_EQ_INT(route_session_pos(s), 7);
        CHECK_EQ_INT(route_forward(r, s, t3, 1, logits, msg, sizeof msg), KVS_ERR_STALE_EPOCH);
        CHECK(strstr(msg, "epoch 5") != NULL);
        CHECK_EQ_INT(route_session_epoch(s), 1);
    }
    route_release(r, s);
    route_close(r);
    pthread_join(th, NULL);
    close(f.listen_fd);

    static const uint32_t want[][2] = {{0, 4}, {0, 4}, {4, 2}, {6, 1}, {2, 1}, {3, 4}, {7, 1}};
    CHECK_EQ_INT(f.n_fwd, 7);
    for (int i = 0; i < f.n_fwd && i < 7; i++) {
        CHECK_EQ_INT(f.seen[i].start, want[i][0]);
        CHECK_EQ_INT(f.seen[i].n, want[i][1]);
        CHECK_EQ_INT(f.seen[i].epoch, 1);
        CHECK_EQ_INT(f.seen[i].flags, 0);
    }
    CHECK_EQ_INT(f.seen[4].tokens[0], 3); /* replayed input of position 2 */
    for (int j = 0; j < 4; j++) CHECK_EQ_INT(f.seen[5].tokens[j], 4 + j);
    CHECK_EQ_INT(f.n_release, 1);
}

int main(void) {
    int run = 0, skipped = 0;
    test_parse_spec();
    run++;
    test_check_hops();
    run++;
    test_fake_shard_closes();
    run++;
    if (test_tok_arrays()) run++;
    else skipped++;
    test_fake_shard();
    run++;
    return test_finish("test_route_unit", run, skipped);
}
