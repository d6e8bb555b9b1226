/* test_tokenizer_wire — a byte-level BPE vocab travels to a route client intact: the
 * VOCAB_META codec (round trip, every bound refused), and a shard serving the Llama 3 /
 * Qwen2 download files whose fetched vocab (route_fetch_vocab) tokenizes, detokenizes and
 * formats chats exactly as the vocab read from the file. */
#include <pthread.h>
#include <stdbool.h>

#include "chat.h"
#include "gguf.h"
#include "route.h"
#include "server.h"
#include "tokenizer.h"
#include "util.h"
#include "wire.h"
#include "test.h"

static void check_codec(void) {
    int32_t ids[6] = {1, 2, 3, 4, 0, 5};
    struct wire_vocab_meta_reply m = {.n_vocab = 6, .add_bos = 1, .pre_len = 5, .n_merges = 3, .first = 0,
                                      .count = 3, .template_len = 4, .chat_template = "tmpl", .merge_ids = ids};
    memcpy(m.pre, "qwen2", 5);
    uint8_t buf[256];
    size_t len = 0;
    CHECK_EQ_INT(wire_encode_vocab_meta_reply(&m, buf, sizeof buf, &len), KVS_OK);
    struct wire_vocab_meta_reply d;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(wire_decode_vocab_meta_reply(buf, len, &d, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(d.n_vocab, 6);
    CHECK_EQ_INT(d.add_bos, 1);
    CHECK(!strcmp(d.pre, "qwen2"));
    CHECK_EQ_INT(d.count, 3);
    CHECK_EQ_INT(d.template_len, 4);
    CHECK(d.chat_template && !memcmp(d.chat_template, "tmpl", 4));
    int32_t l = -1, r = -1;
    CHECK(wire_vocab_meta_merge(&d, 2, &l, &r));
    CHECK_EQ_INT(l, 0);
    CHECK_EQ_INT(r, 5);
    CHECK(!wire_vocab_meta_merge(&d, 3, &l, &r));
    /* canonical: re-encoding the decoded page gives the same bytes */
    int32_t back[6];
    for (uint32_t i = 0; i < 3; i++) wire_vocab_meta_merge(&d, i, &back[2 * i], &back[2 * i + 1]);
    d.merge_ids = back;
    uint8_t buf2[256];
    size_t len2 = 0;
    CHECK_EQ_INT(wire_encode_vocab_meta_reply(&d, buf2, sizeof buf2, &len2), KVS_OK);
    CHECK(len2 == len && !memcmp(buf, buf2, len));
    /* every truncation is refused */
    for (size_t k = 0; k < len; k++) CHECK_EQ_INT(wire_decode_vocab_meta_reply(buf, k, &d, msg, sizeof msg), KVS_ERR_PROTOCOL);
    /* a merge id outside the vocab, a template past page 0, a bad add_bos */
    uint8_t bad[256];
    memcpy(bad, buf, len);
    kvs_wr_u32(bad + len - 4, 6);
    CHECK_EQ_INT(wire_decode_vocab_meta_reply(bad, len, &d, msg, sizeof msg), KVS_ERR_PROTOCOL);
    ids[5] = 6;
    CHECK_EQ_INT(wire_encode_vocab_meta_reply(&m, buf, sizeof buf, &len2), KVS_ERR_INVALID_ARG);
    ids[5] = 5;
    m.first = 1;
    m.count = 2;
    CHECK_EQ_INT(wire_encode_vocab_meta_reply(&m, buf, sizeof buf, &len2), KVS_ERR_INVALID_ARG);
    m.first = 0;
    m.count = 3;
    m.add_bos = 3;
    CHECK_EQ_INT(wire_encode_vocab_meta_reply(&m, buf, sizeof buf, &len2), KVS_ERR_INVALID_ARG);
    /* the request */
    struct wire_vocab_meta q = {.first = 7, .max_count = 100}, qd;
    CHECK_EQ_INT(wire_encode_vocab_meta(&q, buf, sizeof buf, &len), KVS_OK);
    CHECK_EQ_INT(wire_decode_vocab_meta(buf, len, &qd, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(qd.first, 7);
    CHECK_EQ_INT(qd.max_count, 100);
    q.max_count = 0;
    CHECK_EQ_INT(wire_encode_vocab_meta(&q, buf, sizeof buf, &len), KVS_ERR_INVALID_ARG);
    CHECK_EQ_INT(strcmp(wire_op_name(WIRE_OP_VOCAB_META_REPLY), "VOCAB_META_REPLY"), 0);
}

static void *serve(void *p) {
    srv_run(p);
    return NULL;
}

static const char *const TEXTS[] = {
    "Hello world", " leading space", "Numbers: 1 12 123 1234", "I'm sure you're right. Don't!",
    "日本語のテキストです。", "emoji 😀👍🏽🇺🇸", "def add(a, b):\n    return a + b\n",
    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>", "<|im_start|>user\nHi<|im_end|>\n", "\xff\xfe bad",
};

/* Serves path as one shard and compares the fetched vocab with the file's. */
static int check_route(const char *rel) {
    char path[1024];
    if (!test_shared_path(rel, path, sizeof path)) return 0;
    char msg[KVS_MSG_MAX] = "";
    gguf_ctx *g = NULL;
    tok_vocab *local = NULL, *fetched = NULL;
    CHECK_EQ_INT(gguf_open(path, &g, msg, sizeof msg), KVS_OK);
    if (g) CHECK_EQ_INT(tok_from_gguf(g, &local, msg, sizeof msg), KVS_OK);
    gguf_close(g);
    srv_params p = srv_default_params();
    p.model_path = path;
    p.listen = "127.0.0.1:0";
    p.n_threads = 1;
    p.kv_budget_bytes = 4u << 20;
    srv *s = NULL;
    int err = srv_create(&p, &s, msg, sizeof msg);
    if (err) {
        /* the file's architecture may not be computable in this build yet (its layers are
         * another module's): the tokenizer path is what is under test, so say so and skip */
        fprintf(stderr, "note: %s cannot be served (%s); the route vocab check is skipped\n", rel, msg);
        tok_free(local);
        return 0;
    }
    pthread_t th;
    pthread_create(&th, NULL, serve, s);
    char spec[64];
    snprintf(spec, sizeof spec, "127.0.0.1:%u", (unsigned)srv_port(s));
    route_params rp = route_default_params();
    route *r = NULL;
    err = route_open(spec, NULL, &rp, &r, msg, sizeof msg);
    CHECK_EQ_INT(err, KVS_OK);
    if (!err) {
        err = route_fetch_vocab(r, &fetched, msg, sizeof msg);
        if (err) fprintf(stderr, "route_fetch_vocab: %s\n", msg);
        CHECK_EQ_INT(err, KVS_OK);
    }
    if (local && fetched) {
        CHECK_EQ_INT(tok_n_vocab(fetched), tok_n_vocab(local));
        CHECK_EQ_INT(tok_vocab_kind(fetched), TOK_KIND_BPE);
        CHECK(!strcmp(tok_pre_name(fetched), tok_pre_name(local)));
        CHECK_EQ_INT(tok_add_bos(fetched), tok_add_bos(local));
        CHECK_EQ_INT(tok_n_merges(fetched), tok_n_merges(local));
        CHECK(tok_chat_template(fetched) && tok_chat_template(local) &&
              !strcmp(tok_chat_template(fetched), tok_chat_template(local)));
        for (int32_t id = 0; id < tok_n_vocab(local); id++)
            if (tok_is_eog(local, id) != tok_is_eog(fetched, id)) {
                fprintf(stderr, "%s: token %d end-of-generation differs\n", rel, (int)id);
                test_failures_++;
            }
        for (size_t k = 0; k < sizeof TEXTS / sizeof TEXTS[0]; k++) {
            for (int special = 0; special < 2; special++) {
                int32_t a[256], b[256];
                int na = 0, nb = 0;
                CHECK_EQ_INT(tok_encode_ex(local, TEXTS[k], strlen(TEXTS[k]), tok_add_bos(local), special, a, 256, &na),
                             KVS_OK);
                CHECK_EQ_INT(tok_encode_ex(fetched, TEXTS[k], strlen(TEXTS[k]), tok_add_bos(fetched), special, b, 256,
                                           &nb), KVS_OK);
                CHECK_EQ_INT(na, nb);
                CHECK(na == nb && !memcmp(a, b, (size_t)na * sizeof a[0]));
                char *da = NULL, *db = NULL;
                size_t la = 0, lb = 0;
                CHECK_EQ_INT(tok_detokenize(local, a, (size_t)na, true, &da, &la), KVS_OK);
                CHECK_EQ_INT(tok_detokenize(fetched, a, (size_t)na, true, &db, &lb), KVS_OK);
                CHECK(da && db && la == lb && !memcmp(da, db, la));
                free(da);
                free(db);
            }
        }
    }
    tok_free(fetched);
    tok_free(local);
    route_close(r);
    srv_stop(s);
    pthread_join(th, NULL);
    srv_free(s);
    printf("%s: the fetched vocab matches the file's\n", rel);
    return 1;
}

int main(void) {
    int n_run = 0, n_skipped = 0;
    check_codec();
    n_run++;
    if (check_route("downloads/models/llama3-synth-Q4_K_M.gguf")) n_run++;
    else n_skipped++;
    if (check_route("downloads/models/qwen2-synth-Q8_0.gguf")) n_run++;
    else n_skipped++;
    return test_finish("test_tokenizer_wire", n_run, n_skipped);
}
