/*
 * fuzz_wire — libFuzzer target over the frame header and every payload decoder.
 *
 * Input: byte 0 picks the decoder, the rest is the payload (for the header: the first 24 bytes).
 * Oracles besides the sanitizers: a decoder that accepts a payload must (1) fill only valid
 * fields, so re-encoding succeeds, and (2) re-encode to exactly the input bytes (the encoding is
 * canonical); the bulk accessors must stay within the payload.
 *
 * Build: CC=clang cmake -S . -B build-fuzz -DKVS_FUZZ=ON && cmake --build build-fuzz --target fuzz_wire
 * For coverage feedback inside the library, add CFLAGS=-fsanitize=fuzzer-no-link,address,undefined.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FUZZ_CHECK(c) \
    do {              \
        if (!(c)) __builtin_trap(); \
    } while (0)

/* Re-encodes an accepted message and checks it reproduces p[0..n). */
#define CANONICAL(enc, m, p, n)                                            \
    do {                                                                   \
        size_t need_ = 0;                                                  \
        FUZZ_CHECK(enc((m), NULL, 0, &need_) == KVS_OK);                   \
        FUZZ_CHECK(need_ == (n));                                          \
        uint8_t *b_ = malloc(need_ ? need_ : 1);                           \
        FUZZ_CHECK(b_ != NULL);                                            \
        FUZZ_CHECK(enc((m), b_, need_, &need_) == KVS_OK);                 \
        FUZZ_CHECK(need_ == 0 || memcmp(b_, (p), need_) == 0);             \
        free(b_);                                                          \
    } while (0)

static void sum_floats(const float *f, size_t n) {
    volatile float s = 0;
    for (size_t i = 0; i < n; i++) s += f[i];
    (void)s;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    uint8_t sel = data[0] % 15;
    /* an exact-size copy so ASan flags any read past the payload */
    size_t n = size - 1;
    uint8_t *p = malloc(n ? n : 1);
    if (!p) return 0;
    memcpy(p, data + 1, n);
    const uint8_t *pp = n ? p : NULL;
    char msg[KVS_MSG_MAX];

    switch (sel) {
    case 0: {
        struct wire_hello m;
        if (wire_decode_hello(pp, n, &m, msg, sizeof msg) == KVS_OK) {
            FUZZ_CHECK(strlen(m.auth) == m.auth_len);
            CANONICAL(wire_encode_hello, &m, p, n);
        }
        break;
    }
    case 1: {
        struct wire_info m;
        if (wire_decode_info(pp, n, &m, msg, sizeof msg) == KVS_OK) CANONICAL(wire_encode_info, &m, p, n);
        break;
    }
    case 2: {
        struct wire_forward m;
        if (wire_decode_forward(pp, n, &m, msg, sizeof msg) == KVS_OK) {
            CANONICAL(wire_encode_forward, &m, p, n);
            if (m.in_kind == WIRE_IN_TOKENS) {
                for (uint32_t i = 0; i < m.n_tokens; i++) FUZZ_CHECK(wire_forward_token(&m, i) >= 0);
            } else {
                size_t cnt = (size_t)m.n_tokens * m.n_embd;
                float *f = malloc(cnt * sizeof *f);
                if (f) {
                    FUZZ_CHECK(wire_forward_hidden_to_f32(&m, f) == KVS_OK);
                    sum_floats(f, cnt);
                    free(f);
                }
            }
        }
        break;
    }
    case 3: {
        struct wire_forward_reply m;
        if (wire_decode_forward_reply(pp, n, &m, msg, sizeof msg) == KVS_OK) {
            CANONICAL(wire_encode_forward_reply, &m, p, n);
            if (m.out_kind != WIRE_OUTK_NONE && m.out_kind != WIRE_OUTK_SAMPLE) { /* SAMPLE is not floats */
                size_t cnt = (size_t)m.n_rows * m.n_cols;
                float *f = malloc(cnt * sizeof *f);
                if (f) {
                    FUZZ_CHECK(wire_forward_reply_to_f32(&m, f) == KVS_OK);
                    sum_floats(f, cnt);
                    free(f);
                }
            }
        }
        break;
    }
    case 4: {
        struct wire_truncate m;
        if (wire_decode_truncate(pp, n, &m, msg, sizeof msg) == KVS_OK) CANONICAL(wire_encode_truncate, &m, p, n);
        break;
    }
    case 5: {
        struct wire_release m;
        if (wire_decode_release(pp, n, &m, msg, sizeof msg) == KVS_OK) CANONICAL(wire_encode_release, &m, p, n);
        break;
    }
    case 6: {
        struct wire_cancel m;
        if (wire_decode_cancel(pp, n, &m, msg, sizeof msg) == KVS_OK) CANONICAL(wire_encode_cancel, &m, p, n);
        break;
    }
    case 7: {
        struct wire_status_reply m;
        if (wire_decode_status_reply(pp, n, &m, msg, sizeof msg) == KVS_OK) {
            FUZZ_CHECK(strlen(m.msg) == m.msg_len);
            CANONICAL(wire_encode_status_reply, &m, p, n);
        }
        break;
    }
    case 8: {
        static struct wire_stats_reply m;
        if (wire_decode_stats_reply(pp, n, &m, msg, sizeof msg) == KVS_OK) CANONICAL(wire_encode_stats_reply, &m, p, n);
        break;
    }
    case 9: {
        struct wire_vocab m;
        if (wire_decode_vocab(pp, n, &m, msg, sizeof msg) == KVS_OK) CANONICAL(wire_encode_vocab, &m, p, n);
        break;
    }
    case 10: {
        struct wire_vocab_reply m;
        if (wire_decode_vocab_reply(pp, n, &m, msg, sizeof msg) == KVS_OK) {
            struct wire_vocab_token *toks = calloc(m.count ? m.count : 1, sizeof *toks);
            FUZZ_CHECK(toks != NULL);
            size_t off = 0;
            for (uint32_t i = 0; i < m.count; i++) FUZZ_CHECK(wire_vocab_next(&m, &off, &toks[i]));
            struct wire_vocab_token extra;
            FUZZ_CHECK(!wire_vocab_next(&m, &off, &extra));
            FUZZ_CHECK(off == m.entries_len);
            m.tokens = toks;
            CANONICAL(wire_encode_vocab_reply, &m, p, n);
            free(toks);
        }
        break;
    }
    case 11: {
        (void)wire_decode_empty(pp, n, msg, sizeof msg);
        break;
    }
    case 13: {
        struct wire_vocab_meta m;
        if (wire_decode_vocab_meta(pp, n, &m, msg, sizeof msg) == KVS_OK) CANONICAL(wire_encode_vocab_meta, &m, p, n);
        break;
    }
    case 14: {
        struct wire_vocab_meta_reply m;
        if (wire_decode_vocab_meta_reply(pp, n, &m, msg, sizeof msg) == KVS_OK) {
            int32_t *ids = calloc(2 * (size_t)m.count + 1, sizeof *ids);
            FUZZ_CHECK(ids != NULL);
            for (uint32_t i = 0; i < m.count; i++) FUZZ_CHECK(wire_vocab_meta_merge(&m, i, &ids[2 * i], &ids[2 * i + 1]));
            int32_t l_, r_;
            FUZZ_CHECK(!wire_vocab_meta_merge(&m, m.count, &l_, &r_));
            m.merge_ids = ids;
            CANONICAL(wire_encode_vocab_meta_reply, &m, p, n);
            free(ids);
        }
        break;
    }
    default: {
        if (n >= WIRE_HEADER_SIZE) {
            struct wire_header h;
            if (wire_decode_header(p, &h, msg, sizeof msg) == KVS_OK) {
                uint8_t b[WIRE_HEADER_SIZE];
                FUZZ_CHECK(wire_encode_header(&h, b) == KVS_OK);
                FUZZ_CHECK(memcmp(b, p, WIRE_HEADER_SIZE) == 0);
            }
        }
        break;
    }
    }
    free(p);
    return 0;
}
