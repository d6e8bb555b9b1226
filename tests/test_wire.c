/* test_wire — frame codec round trips, rejection of malformed payloads, netio over sockets. */
#include <math.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>

#include "netio.h"
#include "test.h"
#include "util.h"
#include "wire.h"

/* ---- a uniform view of every payload codec ---- */

typedef int (*dec_fn)(const uint8_t *p, size_t n, void *out, char *msg, size_t cap);
typedef int (*enc_fn)(const void *m, uint8_t *buf, size_t cap, size_t *len);

#define ADAPT(name, type)                                                                     \
    static int dec_##name(const uint8_t *p, size_t n, void *out, char *msg, size_t cap) {    \
        return wire_decode_##name(p, n, (type *)out, msg, cap);                               \
    }                                                                                         \
    static int enc_##name(const void *m, uint8_t *buf, size_t cap, size_t *len) {            \
        return wire_encode_##name((const type *)m, buf, cap, len);                            \
    }
ADAPT(hello, struct wire_hello)
ADAPT(info, struct wire_info)
ADAPT(forward, struct wire_forward)
ADAPT(forward_reply, struct wire_forward_reply)
ADAPT(truncate, struct wire_truncate)
ADAPT(release, struct wire_release)
ADAPT(cancel, struct wire_cancel)
ADAPT(status_reply, struct wire_status_reply)
ADAPT(stats_reply, struct wire_stats_reply)
ADAPT(vocab, struct wire_vocab)

/* A decoded VOCAB_REPLY carries entries, not tokens[]: rebuild tokens[] to re-encode it. */
static int dec_vocab_reply(const uint8_t *p, size_t n, void *out, char *msg, size_t cap) {
    return wire_decode_vocab_reply(p, n, out, msg, cap);
}
static int enc_vocab_reply(const void *vm, uint8_t *buf, size_t cap, size_t *len) {
    struct wire_vocab_reply m = *(const struct wire_vocab_reply *)vm;
    struct wire_vocab_token *toks = NULL;
    if (!m.tokens && m.count) {
        toks = calloc(m.count, sizeof *toks);
        if (!toks) return KVS_ERR_NOMEM;
        size_t off = 0;
        for (uint32_t i = 0; i < m.count; i++)
            if (!wire_vocab_next(&m, &off, &toks[i])) {
                free(toks);
                return KVS_ERR_INTERNAL;
            }
        m.tokens = toks;
    }
    int rc = wire_encode_vocab_reply(&m, buf, cap, len);
    free(toks);
    return rc;
}

struct codec {
    const char *name;
    dec_fn dec;
    enc_fn enc;
    size_t size; /* sizeof the struct */
};

static const struct codec codecs[] = {
    {"hello", dec_hello, enc_hello, sizeof(struct wire_hello)},
    {"info", dec_info, enc_info, sizeof(struct wire_info)},
    {"forward", dec_forward, enc_forward, sizeof(struct wire_forward)},
    {"forward_reply", dec_forward_reply, enc_forward_reply, sizeof(struct wire_forward_reply)},
    {"truncate", dec_truncate, enc_truncate, sizeof(struct wire_truncate)},
    {"release", dec_release, enc_release, sizeof(struct wire_release)},
    {"cancel", dec_cancel, enc_cancel, sizeof(struct wire_cancel)},
    {"status_reply", dec_status_reply, enc_status_reply, sizeof(struct wire_status_reply)},
    {"stats_reply", dec_stats_reply, enc_stats_reply, sizeof(struct wire_stats_reply)},
    {"vocab", dec_vocab, enc_vocab, sizeof(struct wire_vocab)},
    {"vocab_reply", dec_vocab_reply, enc_vocab_reply, sizeof(struct wire_vocab_reply)},
};
enum { C_HELLO, C_INFO, C_FORWARD, C_FREPLY, C_TRUNC, C_RELEASE, C_CANCEL, C_STATUS, C_STATS,
       C_VOCAB, C_VREPLY, N_CODECS };

/* Encodes m into a fresh malloc'd buffer (size query first). */
static uint8_t *encode(const struct codec *c, const void *m, size_t *len) {
    size_t need = 0, got = 0;
    int rc = c->enc(m, NULL, 0, &need);
    CHECK_EQ_INT(rc, KVS_OK);
    if (rc != KVS_OK) return NULL;
    uint8_t *buf = malloc(need ? need : 1);
    if (need > 0) { /* one byte short must be refused */
        size_t n2 = 0;
        CHECK_EQ_INT(c->enc(m, buf, need - 1, &n2), KVS_ERR_INVALID_ARG);
        CHECK_EQ_INT(n2, need);
    }
    rc = c->enc(m, buf, need, &got);
    CHECK_EQ_INT(rc, KVS_OK);
    CHECK_EQ_INT(got, need);
    *len = got;
    return buf;
}

/* If p decodes, its re-encoding must be p itself (canonical encoding). Returns decode's rc. */
static int decode_canonical(const struct codec *c, const uint8_t *p, size_t n) {
    void *out = malloc(c->size);
    char msg[KVS_MSG_MAX] = "";
    int rc = c->dec(p, n, out, msg, sizeof msg);
    if (rc == KVS_OK) {
        size_t need = 0;
        int erc = c->enc(out, NULL, 0, &need);
        CHECK_EQ_INT(erc, KVS_OK);
        if (erc == KVS_OK) {
            uint8_t *b = malloc(need ? need : 1);
            CHECK_EQ_INT(c->enc(out, b, need, &need), KVS_OK);
            CHECK_EQ_INT(need, n);
            if (need == n && n && memcmp(b, p, n) != 0) {
                fprintf(stderr, "%s: re-encoding differs\n", c->name);
                CHECK(0);
            }
            free(b);
        }
    } else {
        CHECK(rc == KVS_ERR_PROTOCOL);
        CHECK(msg[0] != 0);
        /* a failed decode leaves *out zeroed */
        const uint8_t *z = out;
        size_t nz = 0;
        for (size_t i = 0; i < c->size; i++) nz += z[i] != 0;
        CHECK_EQ_INT(nz, 0);
    }
    free(out);
    return rc;
}

/* Every strict prefix and one-byte extension of a valid payload is refused; the payload itself
 * decodes and is canonical. */
static void check_truncations(const struct codec *c, const uint8_t *p, size_t n) {
    CHECK_EQ_INT(decode_canonical(c, p, n), KVS_OK);
    uint8_t *copy = malloc(n + 1);
    memcpy(copy, p, n);
    for (size_t k = 0; k < n; k++) {
        /* copy to an exact-size heap block so ASan sees any overread */
        uint8_t *t = malloc(k ? k : 1);
        memcpy(t, p, k);
        int rc = decode_canonical(c, k ? t : NULL, k);
        if (rc == KVS_OK) fprintf(stderr, "%s: prefix of %zu/%zu bytes accepted\n", c->name, k, n);
        CHECK(rc != KVS_OK);
        free(t);
    }
    copy[n] = 0;
    CHECK_EQ_INT(decode_canonical(c, copy, n + 1), KVS_ERR_PROTOCOL);
    free(copy);
}

/* ---- sample messages ---- */

static const uint8_t SID[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
static int32_t sample_tokens[5] = {1, 15043, 3186, 0, 31999};
static float sample_hidden[3 * 4] = {0.5f, -1.25f, 3.0e-8f, 1e30f, 0, -0.0f, 7, 8, 9, 10, 11, -12};
static uint16_t sample_h16[3 * 4];
static uint16_t sample_hb16[3 * 4];
static float sample_logits[2 * 5] = {1, 2, 3, 4, 5, -1, -2, -3, -4, -5};

static struct wire_hello sample_hello(void) {
    struct wire_hello m = {.min_version = 1, .max_version = 3, .auth_len = 6};
    memcpy(m.auth, "s3cret", 7);
    return m;
}
static struct wire_info sample_info(void) {
    struct wire_info m = {.version = 1, .hidden_dtypes = WIRE_DTYPE_F32 | WIRE_DTYPE_F16,
                          .n_layer = 32, .first = 8, .last = 16, .n_embd = 4096,
                          .n_vocab = 32000, .kv_budget_bytes = 8ull << 30, .max_tokens = 512,
                          .max_ctx = 4096, .name_len = 7};
    for (int i = 0; i < 32; i++) m.model_digest[i] = (uint8_t)(i * 7 + 1);
    memcpy(m.name, "shard-1", 8);
    return m;
}
static struct wire_forward sample_forward_tokens(void) {
    struct wire_forward m = {.epoch = 3, .start_pos = 10, .n_tokens = 5, .flags = WIRE_FWD_INHERIT,
                             .out_mode = WIRE_OUT_HIDDEN, .inherit_epoch = 2, .inherit_len = 10,
                             .in_kind = WIRE_IN_TOKENS, .n_embd = 0, .data = sample_tokens};
    memcpy(m.session_id, SID, 16);
    return m;
}
static struct wire_forward sample_forward_hidden(uint32_t kind) {
    struct wire_forward m = {.epoch = 1, .start_pos = 0, .n_tokens = 3, .out_mode = WIRE_OUT_LOGITS_LAST,
                             .in_kind = kind, .n_embd = 4,
                             .data = kind == WIRE_IN_HIDDEN_F16    ? (const void *)sample_h16
                                     : kind == WIRE_IN_HIDDEN_BF16 ? (const void *)sample_hb16
                                                                   : sample_hidden};
    memcpy(m.session_id, SID, 16);
    return m;
}
static struct wire_forward_reply sample_reply_logits(void) {
    struct wire_forward_reply m = {.st = {.status = KVS_OK, .n_past = 15}, .out_kind = WIRE_OUTK_LOGITS_F32,
                                   .n_rows = 2, .n_cols = 5, .data = sample_logits};
    return m;
}
static struct wire_forward_reply sample_reply_miss(void) {
    struct wire_forward_reply m = {.st = {.status = KVS_ERR_CACHE_MISS, .have = 7, .live_epoch = 3, .n_past = 7}};
    return m;
}
static struct wire_stats_reply *sample_stats(void) {
    static struct wire_stats_reply m;
    memset(&m, 0, sizeof m);
    m.n_stats = 3;
    strcpy(m.stats[0].name, "sessions");
    m.stats[0].value = 4;
    strcpy(m.stats[1].name, "kv.bytes_used");
    m.stats[1].value = 123456789012ull;
    strcpy(m.stats[2].name, "evictions_lru");
    m.stats[2].value = UINT64_MAX;
    return &m;
}
static struct wire_vocab_token sample_vtoks[4] = {
    {"<unk>", 5, 0.0f, 2}, {"<s>", 3, 0.0f, 3}, {"\xe2\x96\x81the", 6, -1.5f, 1}, {"", 0, -7.25f, 6}};
static struct wire_vocab_reply sample_vocab_reply(void) {
    struct wire_vocab_reply m = {.n_vocab = 32000, .first = 0, .count = 4, .bos = 1, .eos = 2,
                                 .add_space_prefix = 1, .tok_model_len = 5, .tokens = sample_vtoks};
    memcpy(m.tok_model, "llama", 6);
    return m;
}

/* ---- tests ---- */

static void test_header(void) {
    struct wire_header h = {WIRE_MAGIC, WIRE_VERSION, WIRE_OP_FORWARD, 0, 0x0102030405060708ull, 1234};
    uint8_t b[WIRE_HEADER_SIZE], ex[WIRE_HEADER_SIZE] = {'K', 'V', 'S', 'H', 1, 0, 3, 0, 0, 0, 0, 0,
                                                        8, 7, 6, 5, 4, 3, 2, 1, 0xd2, 0x04, 0, 0};
    CHECK_EQ_INT(wire_encode_header(&h, b), KVS_OK);
    CHECK(memcmp(b, ex, sizeof b) == 0);
    struct wire_header d;
    char msg[KVS_MSG_MAX];
    CHECK_EQ_INT(wire_decode_header(b, &d, msg, sizeof msg), KVS_OK);
    CHECK(d.magic == h.magic && d.version == h.version && d.op == h.op && d.flags == 0 &&
          d.request_id == h.request_id && d.payload_len == 1234);

    uint8_t t[WIRE_HEADER_SIZE];
    memcpy(t, b, sizeof t);
    t[0] = 'X';
    CHECK_EQ_INT(wire_decode_header(t, &d, msg, sizeof msg), KVS_ERR_PROTOCOL);
    CHECK(d.request_id == h.request_id); /* raw fields kept for an error reply */
    memcpy(t, b, sizeof t);
    t[4] = 2;
    CHECK_EQ_INT(wire_decode_header(t, &d, msg, sizeof msg), KVS_ERR_UNSUPPORTED);
    memcpy(t, b, sizeof t);
    t[6] = 0;
    CHECK_EQ_INT(wire_decode_header(t, &d, msg, sizeof msg), KVS_ERR_PROTOCOL);
    t[6] = WIRE_OP_MAX_ + 1;
    CHECK_EQ_INT(wire_decode_header(t, &d, msg, sizeof msg), KVS_ERR_PROTOCOL);
    memcpy(t, b, sizeof t);
    t[8] = 1;
    CHECK_EQ_INT(wire_decode_header(t, &d, msg, sizeof msg), KVS_ERR_PROTOCOL);
    memcpy(t, b, sizeof t);
    kvs_wr_u32(t + 20, WIRE_MAX_PAYLOAD);
    CHECK_EQ_INT(wire_decode_header(t, &d, msg, sizeof msg), KVS_OK);
    kvs_wr_u32(t + 20, WIRE_MAX_PAYLOAD + 1);
    CHECK_EQ_INT(wire_decode_header(t, &d, msg, sizeof msg), KVS_ERR_TOO_LARGE);
    CHECK_EQ_INT(d.payload_len, WIRE_MAX_PAYLOAD + 1);
    kvs_wr_u32(t + 20, UINT32_MAX);
    CHECK_EQ_INT(wire_decode_header(t, &d, msg, sizeof msg), KVS_ERR_TOO_LARGE);

    h.op = 99;
    CHECK_EQ_INT(wire_encode_header(&h, b), KVS_ERR_INVALID_ARG);
    h.op = WIRE_OP_STATS;
    h.payload_len = WIRE_MAX_PAYLOAD + 1;
    CHECK_EQ_INT(wire_encode_header(&h, b), KVS_ERR_TOO_LARGE);
    for (uint32_t op = 1; op <= WIRE_OP_MAX_; op++) CHECK(strcmp(wire_op_name(op), "?") != 0);
    CHECK(strcmp(wire_op_name(0), "?") == 0);
}

static void test_roundtrips(void) {
    char msg[KVS_MSG_MAX];
    size_t n;
    uint8_t *p;

    struct wire_hello hello = sample_hello(), hello2;
    p = encode(&codecs[C_HELLO], &hello, &n);
    CHECK_EQ_INT(n, 2 + 2 + 2 + 6);
    CHECK_EQ_INT(wire_decode_hello(p, n, &hello2, msg, sizeof msg), KVS_OK);
    CHECK(hello2.min_version == 1 && hello2.max_version == 3 && hello2.auth_len == 6);
    CHECK(strcmp(hello2.auth, "s3cret") == 0);
    check_truncations(&codecs[C_HELLO], p, n);
    free(p);
    hello.auth_len = 0;
    p = encode(&codecs[C_HELLO], &hello, &n);
    check_truncations(&codecs[C_HELLO], p, n);
    free(p);

    struct wire_info info = sample_info(), info2;
    p = encode(&codecs[C_INFO], &info, &n);
    CHECK_EQ_INT(wire_decode_info(p, n, &info2, msg, sizeof msg), KVS_OK);
    CHECK(memcmp(info2.model_digest, info.model_digest, 32) == 0);
    CHECK(info2.n_layer == 32 && info2.first == 8 && info2.last == 16 && info2.n_embd == 4096 &&
          info2.n_vocab == 32000 && info2.kv_budget_bytes == (8ull << 30) && info2.max_tokens == 512 &&
          info2.max_ctx == 4096 && info2.hidden_dtypes == 3 && info2.version == 1);
    CHECK(strcmp(info2.name, "shard-1") == 0);
    check_truncations(&codecs[C_INFO], p, n);
    free(p);
    struct wire_info info_err = {.st = {.status = KVS_ERR_UNSUPPORTED}};
    p = encode(&codecs[C_INFO], &info_err, &n);
    CHECK_EQ_INT(n, 20);
    check_truncations(&codecs[C_INFO], p, n);
    free(p);

    struct wire_forward fw = sample_forward_tokens(), fw2;
    p = encode(&codecs[C_FORWARD], &fw, &n);
    CHECK_EQ_INT(n, 60 + 5 * 4);
    CHECK_EQ_INT(wire_decode_forward(p, n, &fw2, msg, sizeof msg), KVS_OK);
    CHECK(memcmp(fw2.session_id, SID, 16) == 0);
    CHECK(fw2.epoch == 3 && fw2.start_pos == 10 && fw2.n_tokens == 5 && fw2.flags == WIRE_FWD_INHERIT &&
          fw2.inherit_epoch == 2 && fw2.inherit_len == 10 && fw2.in_kind == WIRE_IN_TOKENS);
    CHECK(fw2.data == p + 60); /* zero-copy: points into the payload */
    for (uint32_t i = 0; i < 5; i++) CHECK_EQ_INT(wire_forward_token(&fw2, i), sample_tokens[i]);
    float tmp[12];
    CHECK_EQ_INT(wire_forward_hidden_to_f32(&fw2, tmp), KVS_ERR_INVALID_ARG);
    check_truncations(&codecs[C_FORWARD], p, n);
    free(p);

    for (uint32_t k = WIRE_IN_HIDDEN_F32; k <= WIRE_IN_HIDDEN_BF16; k++) {
        fw = sample_forward_hidden(k);
        p = encode(&codecs[C_FORWARD], &fw, &n);
        CHECK_EQ_INT(n, 60 + 12 * (k == WIRE_IN_HIDDEN_F32 ? 4 : 2));
        CHECK_EQ_INT(wire_decode_forward(p, n, &fw2, msg, sizeof msg), KVS_OK);
        CHECK_EQ_INT(wire_forward_hidden_to_f32(&fw2, tmp), KVS_OK);
        for (int i = 0; i < 12; i++) {
            if (k == WIRE_IN_HIDDEN_F32) CHECK(memcmp(&tmp[i], &sample_hidden[i], 4) == 0);
            else {
                float e = k == WIRE_IN_HIDDEN_F16 ? wire_f16_to_f32(sample_h16[i]) : wire_bf16_to_f32(sample_hb16[i]);
                CHECK(memcmp(&tmp[i], &e, 4) == 0);
            }
        }
        check_truncations(&codecs[C_FORWARD], p, n);
        free(p);
    }

    struct wire_forward_reply fr = sample_reply_logits(), fr2;
    p = encode(&codecs[C_FREPLY], &fr, &n);
    CHECK_EQ_INT(n, 20 + 12 + 40);
    CHECK_EQ_INT(wire_decode_forward_reply(p, n, &fr2, msg, sizeof msg), KVS_OK);
    CHECK(fr2.st.status == KVS_OK && fr2.st.n_past == 15 && fr2.out_kind == WIRE_OUTK_LOGITS_F32 &&
          fr2.n_rows == 2 && fr2.n_cols == 5);
    CHECK_EQ_INT(wire_forward_reply_to_f32(&fr2, tmp), KVS_OK);
    for (int i = 0; i < 10; i++) CHECK_NEAR(tmp[i], sample_logits[i], 0);
    check_truncations(&codecs[C_FREPLY], p, n);
    free(p);
    fr = sample_reply_miss();
    p = encode(&codecs[C_FREPLY], &fr, &n);
    CHECK_EQ_INT(n, 20);
    CHECK_EQ_INT(wire_decode_forward_reply(p, n, &fr2, msg, sizeof msg), KVS_OK);
    CHECK(fr2.st.status == KVS_ERR_CACHE_MISS && fr2.st.have == 7 && fr2.st.live_epoch == 3 &&
          fr2.out_kind == WIRE_OUTK_NONE && fr2.data == NULL);
    check_truncations(&codecs[C_FREPLY], p, n);
    free(p);
    fr = (struct wire_forward_reply){.st = {.status = KVS_ERR_STALE_EPOCH, .live_epoch = 9}};
    p = encode(&codecs[C_FREPLY], &fr, &n);
    CHECK_EQ_INT(wire_decode_forward_reply(p, n, &fr2, msg, sizeof msg), KVS_OK);
    CHECK(fr2.st.status == KVS_ERR_STALE_EPOCH && fr2.st.live_epoch == 9);
    free(p);
    fr = (struct wire_forward_reply){.out_kind = WIRE_OUTK_HIDDEN_F16, .n_rows = 3, .n_cols = 4, .data = sample_h16};
    p = encode(&codecs[C_FREPLY], &fr, &n);
    check_truncations(&codecs[C_FREPLY], p, n);
    free(p);
    fr = (struct wire_forward_reply){.out_kind = WIRE_OUTK_HIDDEN_BF16, .n_rows = 3, .n_cols = 4, .data = sample_hb16};
    p = encode(&codecs[C_FREPLY], &fr, &n);
    CHECK_EQ_INT(n, 20 + 12 + 24);
    CHECK_EQ_INT(wire_decode_forward_reply(p, n, &fr2, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(fr2.out_kind, WIRE_OUTK_HIDDEN_BF16);
    CHECK_EQ_INT(wire_forward_reply_to_f32(&fr2, tmp), KVS_OK);
    for (int i = 0; i < 12; i++) {
        float e = wire_bf16_to_f32(sample_hb16[i]);
        CHECK(memcmp(&tmp[i], &e, 4) == 0);
        CHECK_NEAR(tmp[i], sample_hidden[i], fabsf(sample_hidden[i]) * 0x1p-8f);
    }
    check_truncations(&codecs[C_FREPLY], p, n);
    free(p);
    /* INFO: BF16 is a v2 dtype bit */
    info = sample_info();
    info.version = 2;
    info.hidden_dtypes = WIRE_DTYPE_F32 | WIRE_DTYPE_F16 | WIRE_DTYPE_BF16;
    p = encode(&codecs[C_INFO], &info, &n);
    CHECK_EQ_INT(wire_decode_info(p, n, &info2, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(info2.hidden_dtypes, 7);
    check_truncations(&codecs[C_INFO], p, n);
    free(p);
    info.version = 1;
    CHECK_EQ_INT(wire_encode_info(&info, NULL, 0, &n), KVS_ERR_INVALID_ARG);

    struct wire_truncate tr = {.epoch = 5, .len = 100}, tr2;
    memcpy(tr.session_id, SID, 16);
    p = encode(&codecs[C_TRUNC], &tr, &n);
    CHECK_EQ_INT(n, 28);
    CHECK_EQ_INT(wire_decode_truncate(p, n, &tr2, msg, sizeof msg), KVS_OK);
    CHECK(tr2.epoch == 5 && tr2.len == 100 && memcmp(tr2.session_id, SID, 16) == 0);
    check_truncations(&codecs[C_TRUNC], p, n);
    free(p);

    struct wire_release rl = {.epoch = UINT64_MAX}, rl2;
    memcpy(rl.session_id, SID, 16);
    p = encode(&codecs[C_RELEASE], &rl, &n);
    CHECK_EQ_INT(wire_decode_release(p, n, &rl2, msg, sizeof msg), KVS_OK);
    CHECK(rl2.epoch == UINT64_MAX && memcmp(rl2.session_id, SID, 16) == 0);
    check_truncations(&codecs[C_RELEASE], p, n);
    free(p);

    struct wire_cancel cn = {.target_request_id = 42}, cn2;
    p = encode(&codecs[C_CANCEL], &cn, &n);
    CHECK_EQ_INT(wire_decode_cancel(p, n, &cn2, msg, sizeof msg), KVS_OK);
    CHECK(cn2.target_request_id == 42);
    check_truncations(&codecs[C_CANCEL], p, n);
    free(p);

    struct wire_status_reply sr = {.st = {.status = KVS_ERR_CONTEXT_FULL, .n_past = 4096}, .msg_len = 12}, sr2;
    memcpy(sr.msg, "context full", 13);
    p = encode(&codecs[C_STATUS], &sr, &n);
    CHECK_EQ_INT(wire_decode_status_reply(p, n, &sr2, msg, sizeof msg), KVS_OK);
    CHECK(sr2.st.status == KVS_ERR_CONTEXT_FULL && sr2.st.n_past == 4096 && strcmp(sr2.msg, "context full") == 0);
    check_truncations(&codecs[C_STATUS], p, n);
    free(p);

    struct wire_stats_reply *st = sample_stats();
    struct wire_stats_reply *st2 = malloc(sizeof *st2);
    p = encode(&codecs[C_STATS], st, &n);
    CHECK_EQ_INT(wire_decode_stats_reply(p, n, st2, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(st2->n_stats, 3);
    CHECK(strcmp(st2->stats[1].name, "kv.bytes_used") == 0 && st2->stats[1].value == 123456789012ull);
    CHECK(st2->stats[2].value == UINT64_MAX);
    check_truncations(&codecs[C_STATS], p, n);
    free(p);
    strcpy(st->stats[1].name, "bad name");
    CHECK_EQ_INT(wire_encode_stats_reply(st, NULL, 0, &n), KVS_ERR_INVALID_ARG);
    free(st2);

    struct wire_vocab vq = {.first = 100, .max_count = 5000}, vq2;
    p = encode(&codecs[C_VOCAB], &vq, &n);
    CHECK_EQ_INT(wire_decode_vocab(p, n, &vq2, msg, sizeof msg), KVS_OK);
    CHECK(vq2.first == 100 && vq2.max_count == 5000);
    check_truncations(&codecs[C_VOCAB], p, n);
    free(p);

    struct wire_vocab_reply vr = sample_vocab_reply(), vr2;
    p = encode(&codecs[C_VREPLY], &vr, &n);
    CHECK_EQ_INT(wire_decode_vocab_reply(p, n, &vr2, msg, sizeof msg), KVS_OK);
    CHECK(vr2.n_vocab == 32000 && vr2.count == 4 && vr2.bos == 1 && vr2.eos == 2 &&
          vr2.add_space_prefix == 1 && strcmp(vr2.tok_model, "llama") == 0 && vr2.tokens == NULL);
    size_t off = 0;
    struct wire_vocab_token t;
    for (int i = 0; i < 4; i++) {
        CHECK(wire_vocab_next(&vr2, &off, &t));
        CHECK(t.text_len == sample_vtoks[i].text_len && memcmp(t.text, sample_vtoks[i].text, t.text_len) == 0);
        CHECK(t.score == sample_vtoks[i].score && t.type == sample_vtoks[i].type);
    }
    CHECK(!wire_vocab_next(&vr2, &off, &t));
    check_truncations(&codecs[C_VREPLY], p, n);
    free(p);

    CHECK_EQ_INT(wire_decode_empty(NULL, 0, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(wire_decode_empty((const uint8_t *)"x", 1, msg, sizeof msg), KVS_ERR_PROTOCOL);
}

/* Patches a u32 at off of a valid payload and expects the decoder to refuse it. */
static void expect_bad_u32(int ci, const uint8_t *p, size_t n, size_t off, uint32_t v) {
    uint8_t *t = malloc(n);
    memcpy(t, p, n);
    kvs_wr_u32(t + off, v);
    int rc = decode_canonical(&codecs[ci], t, n);
    if (rc == KVS_OK) fprintf(stderr, "%s: u32 %u at %zu accepted\n", codecs[ci].name, v, off);
    CHECK_EQ_INT(rc, KVS_ERR_PROTOCOL);
    free(t);
}

static void test_rejections(void) {
    size_t n;
    uint8_t *p;

    /* FORWARD, tokens: offsets 24 start_pos, 28 n_tokens, 32 flags, 36 out_mode, 40 inherit_epoch,
     * 48 inherit_len, 52 in_kind, 56 n_embd, 60 data */
    struct wire_forward fw = sample_forward_tokens();
    p = encode(&codecs[C_FORWARD], &fw, &n);
    expect_bad_u32(C_FORWARD, p, n, 28, 0);
    expect_bad_u32(C_FORWARD, p, n, 28, 4);                  /* fewer tokens than bytes */
    expect_bad_u32(C_FORWARD, p, n, 28, 6);                  /* more tokens than bytes */
    expect_bad_u32(C_FORWARD, p, n, 28, WIRE_MAX_TOKENS + 1);
    expect_bad_u32(C_FORWARD, p, n, 28, UINT32_MAX);
    expect_bad_u32(C_FORWARD, p, n, 24, WIRE_MAX_POS);       /* start_pos + n over limit */
    expect_bad_u32(C_FORWARD, p, n, 32, 2);                  /* unknown flag */
    expect_bad_u32(C_FORWARD, p, n, 36, 3);                  /* unknown out_mode */
    expect_bad_u32(C_FORWARD, p, n, 40, 3);                  /* inherit_epoch == epoch */
    expect_bad_u32(C_FORWARD, p, n, 48, WIRE_MAX_POS + 1);
    expect_bad_u32(C_FORWARD, p, n, 52, 4);                  /* unknown in_kind */
    expect_bad_u32(C_FORWARD, p, n, 52, WIRE_IN_HIDDEN_BF16);/* hidden without n_embd */
    expect_bad_u32(C_FORWARD, p, n, 56, 1);                  /* n_embd with tokens */
    expect_bad_u32(C_FORWARD, p, n, 60, (uint32_t)-1);       /* negative token */
    expect_bad_u32(C_FORWARD, p, n, 64, WIRE_MAX_VOCAB);     /* token over limit */
    free(p);
    fw.flags = 0;
    fw.inherit_epoch = 0;
    fw.inherit_len = 0;
    p = encode(&codecs[C_FORWARD], &fw, &n);
    expect_bad_u32(C_FORWARD, p, n, 40, 1); /* inherit fields without the flag */
    expect_bad_u32(C_FORWARD, p, n, 48, 1);
    free(p);

    /* FORWARD, hidden f32 3 x 4: size must match n_tokens x n_embd x 4 exactly */
    fw = sample_forward_hidden(WIRE_IN_HIDDEN_F32);
    p = encode(&codecs[C_FORWARD], &fw, &n);
    expect_bad_u32(C_FORWARD, p, n, 56, 3);
    expect_bad_u32(C_FORWARD, p, n, 56, 5);
    expect_bad_u32(C_FORWARD, p, n, 56, 0);
    expect_bad_u32(C_FORWARD, p, n, 56, WIRE_MAX_EMBD + 1);
    expect_bad_u32(C_FORWARD, p, n, 56, 0x40000000u); /* 3 x 2^30 x 4 would overflow u32 */
    expect_bad_u32(C_FORWARD, p, n, 52, WIRE_IN_HIDDEN_F16); /* half the bytes expected */
    expect_bad_u32(C_FORWARD, p, n, 52, WIRE_IN_HIDDEN_BF16);
    expect_bad_u32(C_FORWARD, p, n, 52, 4);                  /* unknown in_kind */
    expect_bad_u32(C_FORWARD, p, n, 52, WIRE_IN_TOKENS);
    free(p);

    /* FORWARD_REPLY: 0 status, 4 have, 8 live_epoch, 16 n_past, 20 out_kind, 24 rows, 28 cols */
    struct wire_forward_reply fr = sample_reply_logits();
    p = encode(&codecs[C_FREPLY], &fr, &n);
    expect_bad_u32(C_FREPLY, p, n, 0, 1);                /* status > 0 */
    expect_bad_u32(C_FREPLY, p, n, 0, (uint32_t)-18);    /* unknown status */
    expect_bad_u32(C_FREPLY, p, n, 0, (uint32_t)KVS_ERR_CACHE_MISS); /* error + body */
    expect_bad_u32(C_FREPLY, p, n, 16, WIRE_MAX_POS + 1);
    expect_bad_u32(C_FREPLY, p, n, 20, 4);
    expect_bad_u32(C_FREPLY, p, n, 20, WIRE_OUTK_NONE);
    expect_bad_u32(C_FREPLY, p, n, 20, WIRE_OUTK_HIDDEN_F16);
    expect_bad_u32(C_FREPLY, p, n, 20, WIRE_OUTK_HIDDEN_BF16); /* 2 x 5 bf16 != 40 bytes */
    expect_bad_u32(C_FREPLY, p, n, 20, 6);                     /* unknown out_kind */
    expect_bad_u32(C_FREPLY, p, n, 24, 1);
    expect_bad_u32(C_FREPLY, p, n, 24, WIRE_MAX_TOKENS + 1);
    expect_bad_u32(C_FREPLY, p, n, 28, 0);
    expect_bad_u32(C_FREPLY, p, n, 28, WIRE_MAX_VOCAB + 1);
    free(p);
    fr = (struct wire_forward_reply){.out_kind = WIRE_OUTK_HIDDEN_F32, .n_rows = 3, .n_cols = 4, .data = sample_hidden};
    p = encode(&codecs[C_FREPLY], &fr, &n);
    expect_bad_u32(C_FREPLY, p, n, 28, 6); /* 3 x 6 f32 != 48 bytes */
    free(p);

    /* INFO: 20 version(u16) hidden_dtypes(u16) 24 digest, 56 n_layer 60 first 64 last 68 n_embd
     * 72 n_vocab 76 budget 84 max_tokens 88 max_ctx 92 name_len(u16) */
    struct wire_info info = sample_info();
    p = encode(&codecs[C_INFO], &info, &n);
    expect_bad_u32(C_INFO, p, n, 20, 4 | (3u << 16));            /* version 4 */
    expect_bad_u32(C_INFO, p, n, 20, 1 | (2u << 16));            /* f16 without f32 */
    expect_bad_u32(C_INFO, p, n, 20, 1 | (5u << 16));            /* bf16 bit in v1 */
    expect_bad_u32(C_INFO, p, n, 20, 1 | (9u << 16));            /* unknown dtype bit */
    expect_bad_u32(C_INFO, p, n, 20, 2 | (9u << 16));            /* unknown dtype bit in v2 */
    expect_bad_u32(C_INFO, p, n, 20, 2 | (4u << 16));            /* bf16 without f32 */
    expect_bad_u32(C_INFO, p, n, 56, 15);                        /* last > n_layer */
    expect_bad_u32(C_INFO, p, n, 56, WIRE_MAX_LAYERS + 1);
    expect_bad_u32(C_INFO, p, n, 60, 16);                        /* first == last */
    expect_bad_u32(C_INFO, p, n, 68, 0);
    expect_bad_u32(C_INFO, p, n, 68, WIRE_MAX_EMBD + 1);
    expect_bad_u32(C_INFO, p, n, 72, WIRE_MAX_VOCAB + 1);
    expect_bad_u32(C_INFO, p, n, 84, 0);
    expect_bad_u32(C_INFO, p, n, 84, WIRE_MAX_TOKENS + 1);
    expect_bad_u32(C_INFO, p, n, 88, WIRE_MAX_POS + 1);
    expect_bad_u32(C_INFO, p, n, 92, 8 | ((uint32_t)'h' << 16) | ((uint32_t)'a' << 24)); /* name_len 8 */
    free(p);
    info.name[3] = 0; /* NUL inside the name */
    CHECK_EQ_INT(wire_encode_info(&info, NULL, 0, &n), KVS_ERR_INVALID_ARG);

    /* HELLO: version range, auth length */
    struct wire_hello hello = sample_hello();
    p = encode(&codecs[C_HELLO], &hello, &n);
    expect_bad_u32(C_HELLO, p, n, 0, 0 | (1u << 16));
    expect_bad_u32(C_HELLO, p, n, 0, 3 | (2u << 16));
    p[4] = 0xff; /* auth_len 0x06ff > limit */
    p[5] = 0x06;
    CHECK_EQ_INT(decode_canonical(&codecs[C_HELLO], p, n), KVS_ERR_PROTOCOL);
    free(p);
    hello.auth_len = WIRE_MAX_AUTH + 1;
    CHECK_EQ_INT(wire_encode_hello(&hello, NULL, 0, &n), KVS_ERR_INVALID_ARG);

    /* STATS: count over limit, bad name */
    struct wire_stats_reply *st = sample_stats();
    p = encode(&codecs[C_STATS], st, &n);
    expect_bad_u32(C_STATS, p, n, 20, WIRE_MAX_STATS + 1);
    expect_bad_u32(C_STATS, p, n, 20, 2);
    expect_bad_u32(C_STATS, p, n, 20, 4);
    p[25] = ' ';
    CHECK_EQ_INT(decode_canonical(&codecs[C_STATS], p, n), KVS_ERR_PROTOCOL);
    p[25] = 'e';
    p[24] = 64; /* name_len over 63 */
    CHECK_EQ_INT(decode_canonical(&codecs[C_STATS], p, n), KVS_ERR_PROTOCOL);
    free(p);
    st->n_stats = WIRE_MAX_STATS + 1;
    CHECK_EQ_INT(wire_encode_stats_reply(st, NULL, 0, &n), KVS_ERR_TOO_LARGE);

    /* VOCAB_REPLY: 20 n_vocab 24 first 28 count 32 bos 36 eos 40 asp(u8) 41 model_len(u8) */
    struct wire_vocab_reply vr = sample_vocab_reply();
    p = encode(&codecs[C_VREPLY], &vr, &n);
    expect_bad_u32(C_VREPLY, p, n, 20, 0);
    expect_bad_u32(C_VREPLY, p, n, 20, 3);                 /* count > n_vocab - first */
    expect_bad_u32(C_VREPLY, p, n, 24, 31999);             /* page past the end */
    expect_bad_u32(C_VREPLY, p, n, 28, 5);                 /* more entries than bytes */
    expect_bad_u32(C_VREPLY, p, n, 28, UINT32_MAX);
    expect_bad_u32(C_VREPLY, p, n, 32, 32000);
    expect_bad_u32(C_VREPLY, p, n, 36, (uint32_t)-2);
    p[40] = 2;
    CHECK_EQ_INT(decode_canonical(&codecs[C_VREPLY], p, n), KVS_ERR_PROTOCOL);
    free(p);
    struct wire_vocab_token bad = {"x", 1, 0, 7};
    vr.tokens = &bad;
    vr.count = 1;
    CHECK_EQ_INT(wire_encode_vocab_reply(&vr, NULL, 0, &n), KVS_ERR_INVALID_ARG);

    /* encoder limits */
    fw = sample_forward_tokens();
    fw.n_tokens = WIRE_MAX_TOKENS + 1;
    CHECK_EQ_INT(wire_encode_forward(&fw, NULL, 0, &n), KVS_ERR_TOO_LARGE);
    fw = sample_forward_hidden(WIRE_IN_HIDDEN_F32);
    fw.n_tokens = WIRE_MAX_TOKENS;
    fw.n_embd = 2048; /* exactly 64 MiB of data + 60 bytes: over the payload limit */
    CHECK_EQ_INT(wire_encode_forward(&fw, NULL, 0, &n), KVS_ERR_TOO_LARGE);
    fw.n_embd = 2047;
    CHECK_EQ_INT(wire_encode_forward(&fw, NULL, 0, &n), KVS_OK);
    CHECK_EQ_INT(n, 60 + (size_t)WIRE_MAX_TOKENS * 2047 * 4);
    fr = (struct wire_forward_reply){.out_kind = WIRE_OUTK_LOGITS_F32, .n_rows = 8192, .n_cols = 32000, .data = sample_logits};
    CHECK_EQ_INT(wire_encode_forward_reply(&fr, NULL, 0, &n), KVS_ERR_TOO_LARGE);
    fw = sample_forward_tokens();
    fw.inherit_epoch = fw.epoch;
    CHECK_EQ_INT(wire_encode_forward(&fw, NULL, 0, &n), KVS_ERR_INVALID_ARG);
}

static void test_f16(void) {
    CHECK_EQ_INT(wire_f32_to_f16(1.0f), 0x3c00);
    CHECK_EQ_INT(wire_f32_to_f16(-2.0f), 0xc000);
    CHECK_EQ_INT(wire_f32_to_f16(65504.0f), 0x7bff);
    CHECK_EQ_INT(wire_f32_to_f16(65520.0f), 0x7c00);
    CHECK_EQ_INT(wire_f32_to_f16(0x1p-24f), 0x0001);
    CHECK_EQ_INT(wire_f32_to_f16(0x1p-25f), 0x0000); /* tie to even */
    CHECK_EQ_INT(wire_f32_to_f16(0x1.8p-24f), 0x0002);
    CHECK_EQ_INT(wire_f32_to_f16(0x1p-14f), 0x0400);
    CHECK_EQ_INT(wire_f32_to_f16(1.0f + 0x1p-11f), 0x3c00); /* tie to even */
    CHECK_EQ_INT(wire_f32_to_f16(1.0f + 0x1.8p-11f), 0x3c01);
    CHECK_EQ_INT(wire_f32_to_f16(1.0f + 0x1.8p-10f), 0x3c02); /* tie to even */
    /* every finite half converts to f32 and back to itself */
    int bad = 0;
    for (uint32_t h = 0; h < 0x10000; h++) {
        if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) {
            float f = wire_f16_to_f32((uint16_t)h);
            bad += f == f; /* NaN stays NaN */
            continue;
        }
        bad += wire_f32_to_f16(wire_f16_to_f32((uint16_t)h)) != h;
    }
    CHECK_EQ_INT(bad, 0);
    for (int i = 0; i < 12; i++) sample_h16[i] = wire_f32_to_f16(sample_hidden[i]);
}

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* bf16: round to nearest even from f32 (ulp at 1.0 is 2^-7), exact back; inf/NaN as f16's rules. */
static void test_bf16(void) {
    CHECK_EQ_INT(wire_f32_to_bf16(1.0f), 0x3f80);
    CHECK_EQ_INT(wire_f32_to_bf16(-2.0f), 0xc000);
    CHECK_EQ_INT(wire_f32_to_bf16(0.0f), 0x0000);
    CHECK_EQ_INT(wire_f32_to_bf16(-0.0f), 0x8000);
    CHECK_EQ_INT(wire_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);   /* tie to even (down) */
    CHECK_EQ_INT(wire_f32_to_bf16(1.0f + 0x1.8p-8f), 0x3f81); /* above the tie */
    CHECK_EQ_INT(wire_f32_to_bf16(1.0f + 0x1p-9f), 0x3f80);   /* below the tie */
    CHECK_EQ_INT(wire_f32_to_bf16(1.0f + 0x1.8p-7f), 0x3f82); /* tie to even (up) */
    CHECK_EQ_INT(wire_f32_to_bf16(3.14159265f), 0x4049);      /* 0x40490fdb: 0x0fdb < 0x8000 */
    CHECK_EQ_INT(wire_f32_to_bf16(-0.1f), 0xbdcd);            /* 0xbdcccccd: 0xcccd > 0x8000 */
    CHECK_EQ_INT(wire_f32_to_bf16(0x1.fep127f), 0x7f7f);      /* largest finite bf16 */
    CHECK_EQ_INT(wire_f32_to_bf16(0x1.fffffep127f), 0x7f80);  /* past it: inf */
    CHECK_EQ_INT(wire_f32_to_bf16(-0x1.fffffep127f), 0xff80);
    CHECK_EQ_INT(wire_f32_to_bf16(INFINITY), 0x7f80);
    CHECK_EQ_INT(wire_f32_to_bf16(-INFINITY), 0xff80);
    CHECK_EQ_INT(wire_f32_to_bf16(bits_f32(0x00000001u)), 0x0000); /* subnormals round too */
    CHECK_EQ_INT(wire_f32_to_bf16(bits_f32(0x00008000u)), 0x0000); /* tie to even */
    CHECK_EQ_INT(wire_f32_to_bf16(bits_f32(0x00018000u)), 0x0002); /* tie to even */
    CHECK_EQ_INT(wire_f32_to_bf16(bits_f32(0x00008001u)), 0x0001);
    CHECK_EQ_INT(wire_f32_to_bf16(bits_f32(0x007fffffu)), 0x0080); /* to the smallest normal */
    /* NaN stays NaN: quiet, sign and top payload kept; a payload only in the low 16 bits does not
     * become inf */
    CHECK_EQ_INT(wire_f32_to_bf16(bits_f32(0x7fc00000u)), 0x7fc0);
    CHECK_EQ_INT(wire_f32_to_bf16(bits_f32(0xffa00000u)), 0xffe0);
    CHECK_EQ_INT(wire_f32_to_bf16(bits_f32(0x7f800001u)), 0x7fc0);
    CHECK_EQ_INT(wire_f32_to_bf16(bits_f32(0x7fffffffu)), 0x7fff);
    /* every bf16 converts to f32 exactly (the top half) and back to itself; NaNs stay NaN */
    int bad = 0;
    for (uint32_t h = 0; h < 0x10000; h++) {
        float f = wire_bf16_to_f32((uint16_t)h);
        bad += f32_bits(f) != h << 16;
        uint16_t back = wire_f32_to_bf16(f);
        if ((h & 0x7f80) == 0x7f80 && (h & 0x7f)) bad += (back & 0x7f80) != 0x7f80 || !(back & 0x7f) ||
                                                         (back & 0x8000) != (h & 0x8000);
        else bad += back != h;
    }
    CHECK_EQ_INT(bad, 0);
    /* nearest: for f32 values around 1, the result is never more than half an ulp (2^-8) away and
     * a tie goes to the even neighbour */
    bad = 0;
    for (uint32_t u = 0x3f800000u; u < 0x3f820000u; u++) {
        float f = bits_f32(u), r = wire_bf16_to_f32(wire_f32_to_bf16(f));
        float err = fabsf(r - f);
        if (err > 0x1p-8f) bad++;
        if (err == 0x1p-8f && (wire_f32_to_bf16(f) & 1)) bad++;
    }
    CHECK_EQ_INT(bad, 0);
    for (int i = 0; i < 12; i++) sample_hb16[i] = wire_f32_to_bf16(sample_hidden[i]);
}

/* ---- random bytes and mutations never crash; anything accepted is canonical ---- */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rng(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static void test_random(void) {
    struct wire_forward f1 = sample_forward_tokens(), f2 = sample_forward_hidden(WIRE_IN_HIDDEN_F16);
    struct wire_forward_reply r1 = sample_reply_logits();
    struct wire_info info = sample_info();
    struct wire_hello hello = sample_hello();
    struct wire_vocab_reply vr = sample_vocab_reply();
    struct wire_status_reply sr = {.st = {.status = KVS_ERR_BUSY}, .msg_len = 2, .msg = "hi"};
    struct { int ci; const void *m; } seeds[] = {
        {C_FORWARD, &f1}, {C_FORWARD, &f2}, {C_FREPLY, &r1}, {C_INFO, &info}, {C_HELLO, &hello},
        {C_VREPLY, &vr}, {C_STATS, sample_stats()}, {C_STATUS, &sr}};
    int accepted = 0;
    for (size_t s = 0; s < sizeof seeds / sizeof seeds[0]; s++) {
        size_t n;
        uint8_t *p = encode(&codecs[seeds[s].ci], seeds[s].m, &n);
        for (int iter = 0; iter < 3000; iter++) {
            uint8_t *t = malloc(n);
            memcpy(t, p, n);
            int flips = 1 + (int)(rng() % 4);
            for (int k = 0; k < flips; k++) {
                size_t at = rng() % n;
                if (rng() & 1) t[at] ^= (uint8_t)(1u << (rng() % 8));
                else t[at] = (uint8_t)rng();
            }
            size_t len = (rng() % 8 == 0) ? rng() % (n + 1) : n;
            accepted += decode_canonical(&codecs[seeds[s].ci], t, len) == KVS_OK;
            free(t);
        }
        free(p);
    }
    /* pure noise into every decoder and the header */
    for (int iter = 0; iter < 20000; iter++) {
        size_t len = rng() % 128;
        uint8_t *t = malloc(len ? len : 1);
        for (size_t i = 0; i < len; i++) t[i] = (uint8_t)rng();
        decode_canonical(&codecs[iter % N_CODECS], len ? t : NULL, len);
        if (len >= WIRE_HEADER_SIZE) {
            struct wire_header h;
            (void)wire_decode_header(t, &h, NULL, 0);
        }
        free(t);
    }
    CHECK(accepted > 0); /* some mutations (e.g. of data bytes) are still valid */
}

/* ---- netio ---- */

static void test_hostport(void) {
    char host[64];
    uint16_t port = 1;
    CHECK_EQ_INT(netio_parse_hostport("127.0.0.1:8080", host, sizeof host, &port), KVS_OK);
    CHECK(strcmp(host, "127.0.0.1") == 0 && port == 8080);
    CHECK_EQ_INT(netio_parse_hostport("localhost:0", host, sizeof host, &port), KVS_OK);
    CHECK(strcmp(host, "localhost") == 0 && port == 0);
    CHECK_EQ_INT(netio_parse_hostport("[::1]:65535", host, sizeof host, &port), KVS_OK);
    CHECK(strcmp(host, "::1") == 0 && port == 65535);
    const char *bad[] = {"", "host", "host:", ":80", "host:65536", "host:8x", "::1:80", "[::1]80",
                         "[::1", "h:-1", "h:99999999999999999999"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECK_EQ_INT(netio_parse_hostport(bad[i], host, sizeof host, &port), KVS_ERR_INVALID_ARG);
    CHECK_EQ_INT(netio_parse_hostport("abcdef:1", host, 4, &port), KVS_ERR_INVALID_ARG);
}

struct sender_arg {
    int fd;
    const uint8_t *payload;
    size_t len;
    int rc;
};
static void *sender_main(void *vp) {
    struct sender_arg *a = vp;
    a->rc = netio_send_frame(a->fd, WIRE_OP_FORWARD, 77, a->payload, a->len, netio_deadline_ms(5000));
    return NULL;
}

static void test_netio_socketpair(void) {
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    char msg[KVS_MSG_MAX] = "";
    struct netio_buf b = {0};
    struct wire_header h;

    /* small frame round trip */
    struct wire_forward fw = sample_forward_tokens(), fw2;
    size_t n;
    uint8_t *p = encode(&codecs[C_FORWARD], &fw, &n);
    CHECK_EQ_INT(netio_send_frame(sv[0], WIRE_OP_FORWARD, 5, p, n, netio_deadline_ms(1000)), KVS_OK);
    CHECK_EQ_INT(netio_recv_frame(sv[1], &h, &b, netio_deadline_ms(1000), msg, sizeof msg), KVS_OK);
    CHECK(h.op == WIRE_OP_FORWARD && h.request_id == 5 && h.payload_len == n && b.len == n);
    CHECK(memcmp(b.data, p, n) == 0);
    CHECK_EQ_INT(wire_decode_forward(b.data, b.len, &fw2, msg, sizeof msg), KVS_OK);
    free(p);

    /* empty payload */
    CHECK_EQ_INT(netio_send_frame(sv[1], WIRE_OP_STATS, 6, NULL, 0, netio_deadline_ms(1000)), KVS_OK);
    CHECK_EQ_INT(netio_recv_frame(sv[0], &h, &b, netio_deadline_ms(1000), msg, sizeof msg), KVS_OK);
    CHECK(h.op == WIRE_OP_STATS && h.request_id == 6 && b.len == 0);

    /* large frame (bigger than the socket buffer) from a thread */
    size_t big = 5u << 20;
    uint8_t *payload = malloc(big);
    for (size_t i = 0; i < big; i++) payload[i] = (uint8_t)(i * 31 + (i >> 12));
    struct sender_arg a = {sv[0], payload, big, -1};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, sender_main, &a) == 0);
    CHECK_EQ_INT(netio_recv_frame(sv[1], &h, &b, netio_deadline_ms(5000), msg, sizeof msg), KVS_OK);
    pthread_join(th, NULL);
    CHECK_EQ_INT(a.rc, KVS_OK);
    CHECK(h.request_id == 77 && b.len == big && memcmp(b.data, payload, big) == 0);
    free(payload);

    /* silent peer: TIMEOUT within a bounded time */
    uint64_t t0 = kvs_now_ns();
    CHECK_EQ_INT(netio_recv_frame(sv[1], &h, &b, netio_deadline_ms(200), msg, sizeof msg), KVS_ERR_TIMEOUT);
    uint64_t ms = (kvs_now_ns() - t0) / 1000000u;
    CHECK(ms >= 190 && ms < 2000);

    /* oversized header: refused before any allocation or payload read */
    struct netio_buf b2 = {0};
    uint8_t hb[WIRE_HEADER_SIZE];
    struct wire_header big_h = {WIRE_MAGIC, WIRE_VERSION, WIRE_OP_FORWARD, 0, 9, WIRE_MAX_PAYLOAD};
    CHECK_EQ_INT(wire_encode_header(&big_h, hb), KVS_OK);
    kvs_wr_u32(hb + 20, UINT32_MAX);
    CHECK_EQ_INT(netio_write_full(sv[0], hb, sizeof hb, netio_deadline_ms(1000)), KVS_OK);
    CHECK_EQ_INT(netio_recv_frame(sv[1], &h, &b2, netio_deadline_ms(1000), msg, sizeof msg), KVS_ERR_TOO_LARGE);
    CHECK(b2.data == NULL && b2.cap == 0 && h.request_id == 9);

    /* bad magic */
    hb[0] = 'Z';
    CHECK_EQ_INT(netio_write_full(sv[0], hb, sizeof hb, netio_deadline_ms(1000)), KVS_OK);
    CHECK_EQ_INT(netio_recv_frame(sv[1], &h, &b2, netio_deadline_ms(1000), msg, sizeof msg), KVS_ERR_PROTOCOL);

    /* a header announcing 64 MiB followed by 10 bytes and a stall: TIMEOUT, little memory */
    kvs_wr_u32(hb + 0, WIRE_MAGIC);
    kvs_wr_u32(hb + 20, WIRE_MAX_PAYLOAD);
    CHECK_EQ_INT(netio_write_full(sv[0], hb, sizeof hb, netio_deadline_ms(1000)), KVS_OK);
    CHECK_EQ_INT(netio_write_full(sv[0], "0123456789", 10, netio_deadline_ms(1000)), KVS_OK);
    CHECK_EQ_INT(netio_recv_frame(sv[1], &h, &b2, netio_deadline_ms(100), msg, sizeof msg), KVS_ERR_TIMEOUT);
    CHECK(b2.cap <= (1u << 20));
    netio_buf_free(&b2);

    /* peer closes mid-frame: CLOSED */
    int sw[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sw) == 0);
    kvs_wr_u32(hb + 20, 100);
    CHECK_EQ_INT(netio_write_full(sw[0], hb, sizeof hb, netio_deadline_ms(1000)), KVS_OK);
    CHECK_EQ_INT(netio_write_full(sw[0], "abc", 3, netio_deadline_ms(1000)), KVS_OK);
    close(sw[0]);
    CHECK_EQ_INT(netio_recv_frame(sw[1], &h, &b, netio_deadline_ms(1000), msg, sizeof msg), KVS_ERR_CLOSED);
    close(sw[1]);
    /* close inside the header */
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sw) == 0);
    CHECK_EQ_INT(netio_write_full(sw[0], hb, 10, netio_deadline_ms(1000)), KVS_OK);
    close(sw[0]);
    CHECK_EQ_INT(netio_recv_frame(sw[1], &h, &b, netio_deadline_ms(1000), msg, sizeof msg), KVS_ERR_CLOSED);
    /* writing to a closed peer: CLOSED, no SIGPIPE */
    CHECK_EQ_INT(netio_send_frame(sw[1], WIRE_OP_STATS, 1, NULL, 0, netio_deadline_ms(1000)), KVS_ERR_CLOSED);
    close(sw[1]);

    CHECK_EQ_INT(netio_send_frame(sv[0], WIRE_OP_FORWARD, 1, NULL, WIRE_MAX_PAYLOAD + 1, 0), KVS_ERR_TOO_LARGE);
    CHECK_EQ_INT(netio_send_frame(sv[0], 0, 1, NULL, 0, 0), KVS_ERR_INVALID_ARG);
    netio_buf_free(&b);
    netio_buf_free(&b); /* idempotent */
    close(sv[0]);
    close(sv[1]);
}

static void test_netio_tcp(void) {
    char msg[KVS_MSG_MAX] = "";
    int lfd = -1, cfd = -1, afd = -1;
    uint16_t port = 0;
    CHECK_EQ_INT(netio_listen("127.0.0.1", 0, 8, &lfd, &port, msg, sizeof msg), KVS_OK);
    CHECK(port != 0);
    CHECK_EQ_INT(netio_connect("127.0.0.1", port, netio_deadline_ms(2000), &cfd, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(netio_accept(lfd, netio_deadline_ms(2000), &afd, msg, sizeof msg), KVS_OK);

    /* HELLO -> INFO exchange */
    struct wire_hello hello = sample_hello(), hello2;
    struct wire_info info = sample_info(), info2;
    uint8_t buf[512];
    size_t n;
    struct netio_buf b = {0};
    struct wire_header h;
    CHECK_EQ_INT(wire_encode_hello(&hello, buf, sizeof buf, &n), KVS_OK);
    CHECK_EQ_INT(netio_send_frame(cfd, WIRE_OP_HELLO, 1, buf, n, netio_deadline_ms(1000)), KVS_OK);
    CHECK_EQ_INT(netio_recv_frame(afd, &h, &b, netio_deadline_ms(1000), msg, sizeof msg), KVS_OK);
    CHECK(h.op == WIRE_OP_HELLO && h.request_id == 1);
    CHECK_EQ_INT(wire_decode_hello(b.data, b.len, &hello2, msg, sizeof msg), KVS_OK);
    CHECK(strcmp(hello2.auth, "s3cret") == 0);
    CHECK_EQ_INT(wire_encode_info(&info, buf, sizeof buf, &n), KVS_OK);
    CHECK_EQ_INT(netio_send_frame(afd, WIRE_OP_INFO, h.request_id, buf, n, netio_deadline_ms(1000)), KVS_OK);
    CHECK_EQ_INT(netio_recv_frame(cfd, &h, &b, netio_deadline_ms(1000), msg, sizeof msg), KVS_OK);
    CHECK(h.op == WIRE_OP_INFO && h.request_id == 1);
    CHECK_EQ_INT(wire_decode_info(b.data, b.len, &info2, msg, sizeof msg), KVS_OK);
    CHECK(info2.n_embd == 4096 && strcmp(info2.name, "shard-1") == 0);

    /* silent server: TIMEOUT */
    uint64_t t0 = kvs_now_ns();
    CHECK_EQ_INT(netio_recv_frame(cfd, &h, &b, netio_deadline_ms(200), msg, sizeof msg), KVS_ERR_TIMEOUT);
    CHECK((kvs_now_ns() - t0) / 1000000u < 2000);
    /* nobody connecting: accept TIMEOUT */
    int x = -1;
    CHECK_EQ_INT(netio_accept(lfd, netio_deadline_ms(50), &x, msg, sizeof msg), KVS_ERR_TIMEOUT);
    CHECK_EQ_INT(x, -1);

    /* server goes away mid-frame */
    uint8_t hb[WIRE_HEADER_SIZE];
    struct wire_header hh = {WIRE_MAGIC, WIRE_VERSION, WIRE_OP_FORWARD_REPLY, 0, 3, 1000};
    CHECK_EQ_INT(wire_encode_header(&hh, hb), KVS_OK);
    CHECK_EQ_INT(netio_write_full(afd, hb, sizeof hb, netio_deadline_ms(1000)), KVS_OK);
    CHECK_EQ_INT(netio_write_full(afd, buf, 100, netio_deadline_ms(1000)), KVS_OK);
    close(afd);
    CHECK_EQ_INT(netio_recv_frame(cfd, &h, &b, netio_deadline_ms(1000), msg, sizeof msg), KVS_ERR_CLOSED);
    close(cfd);
    close(lfd);

    /* connection refused on a port nobody listens on any more */
    CHECK_EQ_INT(netio_connect("127.0.0.1", port, netio_deadline_ms(1000), &cfd, msg, sizeof msg), KVS_ERR_IO);
    CHECK_EQ_INT(cfd, -1);
    netio_buf_free(&b);
}

/* Protocol v3: the FORWARD prefix block round-trips canonically, refuses every truncation,
 * hashes past the covered positions and the fields without the flag; the chain hash is
 * order-sensitive and chained. */
static void test_v3_prefix(void) {
    int32_t toks[40];
    for (int i = 0; i < 40; i++) toks[i] = i + 3;
    uint64_t h[2];
    h[0] = wire_chain_hash(0, toks, 16);
    h[1] = wire_chain_hash(h[0], toks + 16, 16);
    CHECK(h[0] != h[1]);
    int32_t swapped[16];
    memcpy(swapped, toks, sizeof swapped);
    swapped[3] = toks[4];
    swapped[4] = toks[3];
    CHECK(wire_chain_hash(0, swapped, 16) != h[0]);
    struct wire_forward m = {.epoch = 1, .start_pos = 0, .n_tokens = 40, .flags = WIRE_FWD_PREFIX,
                             .in_kind = WIRE_IN_TOKENS, .data = toks,
                             .prefix = {.first = 0, .n_hashes = 2, .hashes = h}};
    size_t n = 0;
    uint8_t *p = encode(&codecs[C_FORWARD], &m, &n);
    CHECK_EQ_INT(n, 60 + 160 + 8 + 16);
    check_truncations(&codecs[C_FORWARD], p, n);
    struct wire_forward d;
    char msg[KVS_MSG_MAX];
    CHECK_EQ_INT(wire_decode_forward(p, n, &d, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(d.prefix.n_hashes, 2);
    CHECK(wire_prefix_hash(&d.prefix, 1) == h[1]);
    uint8_t *t = malloc(n);
    memcpy(t, p, n);
    kvs_wr_u32(t + 220, 2); /* first 2: hashes for positions up to 64 of a request ending at 40 */
    CHECK_EQ_INT(decode_canonical(&codecs[C_FORWARD], t, n), KVS_ERR_PROTOCOL);
    memcpy(t, p, n);
    kvs_wr_u32(t + 32, 0); /* flags 0 with a prefix block: trailing bytes */
    CHECK_EQ_INT(decode_canonical(&codecs[C_FORWARD], t, n), KVS_ERR_PROTOCOL);
    free(t);
    free(p);
    struct wire_forward b = m;
    b.prefix.first = 2;
    size_t len = 0;
    CHECK(wire_encode_forward(&b, NULL, 0, &len) != KVS_OK);
    b = m;
    b.flags = 0;
    CHECK(wire_encode_forward(&b, NULL, 0, &len) != KVS_OK);
}

/* Protocol v2 fields: a FORWARD with a sampler block and a relay block, a SAMPLE reply and
 * RELAY_LISTEN round-trip canonically, refuse every truncation, and refuse bad field values. */
static void test_v2_fields(void) {
    int32_t toks[2] = {5, 7}, window[3] = {1, 2, 3};
    struct wire_forward *m = calloc(1, sizeof *m);
    *m = (struct wire_forward){.epoch = 4, .start_pos = 9, .n_tokens = 2, .flags = WIRE_FWD_RELAY | WIRE_FWD_INHERIT,
                               .out_mode = WIRE_OUT_SAMPLE, .inherit_epoch = 3, .inherit_len = 9,
                               .in_kind = WIRE_IN_TOKENS, .data = toks};
    m->sample = (struct wire_sample_req){.temp = 0.7f, .top_p = 0.9f, .min_p = 0.05f, .repeat_penalty = 1.1f,
                                         .presence_penalty = -0.5f, .top_k = 40, .seed = 0x1122334455667788ull,
                                         .n_top = 5, .n_window = 3, .window = window};
    m->relay = (struct wire_relay){.relay_id = 99, .hop = 0, .hidden_kind = WIRE_IN_HIDDEN_F16, .n_next = 2};
    snprintf(m->relay.next[0].addr, sizeof m->relay.next[0].addr, "10.0.0.2:7001");
    m->relay.next[0].addr_len = (uint8_t)strlen(m->relay.next[0].addr);
    m->relay.next[0].flags = WIRE_FWD_INHERIT;
    m->relay.next[0].inherit_epoch = 2;
    m->relay.next[0].inherit_len = 9;
    snprintf(m->relay.next[1].addr, sizeof m->relay.next[1].addr, "[::1]:7002");
    m->relay.next[1].addr_len = (uint8_t)strlen(m->relay.next[1].addr);
    size_t n = 0;
    uint8_t *p = encode(&codecs[C_FORWARD], m, &n);
    CHECK_EQ_INT(n, 60 + 8 + 40 + 12 + 14 + (1 + 13 + 16) + (1 + 10 + 16));
    check_truncations(&codecs[C_FORWARD], p, n);
    struct wire_forward *d = calloc(1, sizeof *d);
    char msg[KVS_MSG_MAX];
    CHECK_EQ_INT(wire_decode_forward(p, n, d, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(d->sample.seed, 0x1122334455667788ull);
    CHECK_NEAR(d->sample.presence_penalty, -0.5, 0);
    CHECK_EQ_INT(d->sample.n_window, 3);
    CHECK_EQ_INT(kvs_rd_u32((const uint8_t *)d->sample.window + 8), 3);
    CHECK_EQ_INT(d->relay.n_next, 2);
    CHECK(strcmp(d->relay.next[1].addr, "[::1]:7002") == 0);
    CHECK_EQ_INT(d->relay.next[0].inherit_epoch, 2);
    /* Bad values: encoder and decoder refuse them alike. */
    static const char *const bad[] = {"NaN temp", "n_top 21", "relay_id 0", "addr_len 0",
                                      "hop inherit not older", "hidden_kind tokens", "hidden_kind 4",
                                      "window id out of range"};
    int32_t bad_window[3] = {1, (int32_t)WIRE_MAX_VOCAB, 3};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        struct wire_forward *b = calloc(1, sizeof *b);
        *b = *m;
        switch (i) {
        case 0: b->sample.temp = NAN; break;
        case 1: b->sample.n_top = WIRE_MAX_TOP + 1; break;
        case 2: b->relay.relay_id = 0; break;
        case 3: b->relay.next[1].addr_len = 0; break;
        case 4: b->relay.next[0].inherit_epoch = 4; break;
        case 5: b->relay.hidden_kind = WIRE_IN_TOKENS; break;
        case 6: b->relay.hidden_kind = 4; break;
        default: b->sample.window = bad_window; break;
        }
        size_t len = 0;
        int rc = wire_encode_forward(b, NULL, 0, &len);
        if (rc == KVS_OK) fprintf(stderr, "forward v2: %s encoded\n", bad[i]);
        CHECK(rc != KVS_OK);
        free(b);
    }
    /* The same refusals on the decoder side, by patching the valid bytes. */
    uint8_t *t = malloc(n);
    memcpy(t, p, n);
    kvs_wr_u32(t + 68 + 32, WIRE_MAX_TOP + 1); /* n_top */
    CHECK_EQ_INT(decode_canonical(&codecs[C_FORWARD], t, n), KVS_ERR_PROTOCOL);
    memcpy(t, p, n);
    kvs_wr_u32(t + 68, 0x7fc00000u); /* temp = NaN */
    CHECK_EQ_INT(decode_canonical(&codecs[C_FORWARD], t, n), KVS_ERR_PROTOCOL);
    memcpy(t, p, n);
    memset(t + 68 + 40 + 12, 0, 8); /* relay_id 0 */
    CHECK_EQ_INT(decode_canonical(&codecs[C_FORWARD], t, n), KVS_ERR_PROTOCOL);
    memcpy(t, p, n);
    t[68 + 40 + 12 + 14] = 0; /* first hop's addr_len */
    CHECK(decode_canonical(&codecs[C_FORWARD], t, n) != KVS_OK);
    memcpy(t, p, n);
    kvs_wr_u16(t + 68 + 40 + 12 + 10, WIRE_IN_HIDDEN_BF16); /* relay hidden_kind bf16: valid */
    CHECK_EQ_INT(decode_canonical(&codecs[C_FORWARD], t, n), KVS_OK);
    CHECK_EQ_INT(wire_decode_forward(t, n, d, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(d->relay.hidden_kind, WIRE_IN_HIDDEN_BF16);
    kvs_wr_u16(t + 68 + 40 + 12 + 10, 4); /* unknown */
    CHECK_EQ_INT(decode_canonical(&codecs[C_FORWARD], t, n), KVS_ERR_PROTOCOL);
    free(t);
    free(p);
    free(d);
    free(m);

    /* SAMPLE reply. */
    uint8_t data[8 + 8 * 2];
    kvs_wr_u32(data, 17);
    kvs_wr_f32(data + 4, -0.25f);
    kvs_wr_u32(data + 8, 17);
    kvs_wr_f32(data + 12, -0.25f);
    kvs_wr_u32(data + 16, 3);
    kvs_wr_f32(data + 20, -2.0f);
    struct wire_forward_reply r = {.st = {.n_past = 12}, .out_kind = WIRE_OUTK_SAMPLE, .n_rows = 1, .n_cols = 2, .data = data};
    p = encode(&codecs[C_FREPLY], &r, &n);
    CHECK_EQ_INT(n, 32 + 24);
    check_truncations(&codecs[C_FREPLY], p, n);
    struct wire_forward_reply rd;
    CHECK_EQ_INT(wire_decode_forward_reply(p, n, &rd, msg, sizeof msg), KVS_OK);
    int32_t id = 0, ids[2];
    float lp = 0, lps[2];
    CHECK_EQ_INT(wire_forward_reply_sample(&rd, &id, &lp, ids, lps), KVS_OK);
    CHECK_EQ_INT(id, 17);
    CHECK_NEAR(lp, -0.25, 0);
    CHECK_EQ_INT(ids[1], 3);
    CHECK_NEAR(lps[1], -2.0, 0);
    kvs_wr_u32(p + 32 + 8, WIRE_MAX_VOCAB); /* a top id out of range */
    CHECK_EQ_INT(decode_canonical(&codecs[C_FREPLY], p, n), KVS_ERR_PROTOCOL);
    free(p);
    r.n_cols = WIRE_MAX_TOP + 1;
    CHECK(wire_encode_forward_reply(&r, NULL, 0, &n) != KVS_OK);

    /* RELAY_LISTEN. */
    struct wire_relay_listen l = {.relay_id = 0xabcdef}, ld;
    uint8_t lb[8];
    CHECK_EQ_INT(wire_encode_relay_listen(&l, lb, sizeof lb, &n), KVS_OK);
    CHECK_EQ_INT(n, 8);
    CHECK_EQ_INT(wire_decode_relay_listen(lb, n, &ld, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(ld.relay_id, 0xabcdef);
    CHECK_EQ_INT(wire_decode_relay_listen(lb, 7, &ld, msg, sizeof msg), KVS_ERR_PROTOCOL);
    memset(lb, 0, sizeof lb);
    CHECK_EQ_INT(wire_decode_relay_listen(lb, 8, &ld, msg, sizeof msg), KVS_ERR_PROTOCOL);
    l.relay_id = 0;
    CHECK_EQ_INT(wire_encode_relay_listen(&l, lb, sizeof lb, &n), KVS_ERR_INVALID_ARG);
    CHECK(strcmp(wire_op_name(WIRE_OP_RELAY_LISTEN), "RELAY_LISTEN") == 0);
}

int main(void) {
    signal(SIGPIPE, SIG_DFL); /* prove MSG_NOSIGNAL: SIGPIPE would kill the test */
    test_f16();
    test_bf16();
    test_header();
    test_roundtrips();
    test_rejections();
    test_v2_fields();
    test_v3_prefix();
    test_random();
    test_hostport();
    test_netio_socketpair();
    test_netio_tcp();
    return test_finish("test_wire", 1, 0);
}
