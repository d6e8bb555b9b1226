/* route_vocab — the tokenizer from the head shard's VOCAB and VOCAB_META pages. */
#include "route.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "route_impl.h"
#include "util.h"

/* ---- vocab ------------------------------------------------------------------ */

/* Lowest id of type UNKNOWN (2), else 0 — what GGUF llama vocabs declare as unknown_token_id
 * (the wire does not carry it). */
static int32_t guess_unk(const int32_t *types, int32_t n) {
    for (int32_t i = 0; i < n; i++)
        if (types[i] == 2) return i;
    return 0;
}

/* The BPE half of a vocab (VOCAB_META pages): merges rebuilt as "left right" texts. */
typedef struct {
    char pre[WIRE_MAX_PRE + 1];
    int8_t add_bos;
    char *chat_template;
    uint32_t n_merges;
    char **merges;
    uint32_t *merge_lens;
} bpe_meta;

static void bpe_meta_free(bpe_meta *m) {
    for (uint32_t i = 0; m->merges && i < m->n_merges; i++) free(m->merges[i]);
    free(m->merges);
    free(m->merge_lens);
    free(m->chat_template);
}

static int fetch_bpe_meta(route *r, uint32_t nv, const char *const *texts, const uint32_t *lens, bpe_meta *m,
                          char *msg, size_t msg_cap) {
    route_hop *h = &r->hops[0];
    int rc;
    for (uint32_t first = 0;;) {
        char why[KVS_MSG_MAX];
        struct wire_vocab_meta q = {.first = first, .max_count = WIRE_MAX_MERGES};
        size_t len = 0;
        if ((rc = route_tx_reserve(r, 8)) != KVS_OK || (rc = wire_encode_vocab_meta(&q, r->tx, r->tx_cap, &len)) != KVS_OK)
            return kvs_fail(msg, msg_cap, rc, "cannot encode VOCAB_META: %s", kvs_strerror(rc));
        if ((rc = route_hop_call(r, h, WIRE_OP_VOCAB_META, len, WIRE_OP_VOCAB_META_REPLY, why, sizeof why)) != KVS_OK)
            return kvs_fail(msg, msg_cap, rc, "hop 0 (%s): %s", h->addr.text, why);
        struct wire_vocab_meta_reply v;
        if ((rc = wire_decode_vocab_meta_reply(r->rx.data, r->rx.len, &v, why, sizeof why)) != KVS_OK)
            return kvs_fail(msg, msg_cap, rc, "hop 0 (%s): bad VOCAB_META_REPLY: %s", h->addr.text, why);
        if (v.st.status != KVS_OK)
            return kvs_fail(msg, msg_cap, v.st.status, "hop 0 (%s) refused VOCAB_META: %s", h->addr.text,
                            kvs_strerror(v.st.status));
        if (v.n_vocab != nv || v.first != first || (first > 0 && v.n_merges != m->n_merges) ||
            (v.count == 0 && first < v.n_merges))
            return kvs_fail(msg, msg_cap, KVS_ERR_PROTOCOL, "hop 0 (%s): VOCAB_META page [%u, +%u) of %u does not "
                            "continue [%u, ...)", h->addr.text, v.first, v.count, v.n_merges, first);
        if (first == 0) {
            memcpy(m->pre, v.pre, sizeof m->pre);
            m->add_bos = v.add_bos == 1 ? 1 : v.add_bos == 2 ? -1 : 0;
            m->n_merges = v.n_merges;
            m->merges = calloc(v.n_merges ? v.n_merges : 1, sizeof *m->merges);
            m->merge_lens = calloc(v.n_merges ? v.n_merges : 1, sizeof *m->merge_lens);
            if (v.template_len) {
                m->chat_template = malloc((size_t)v.template_len + 1);
                if (m->chat_template) {
                    memcpy(m->chat_template, v.chat_template, v.template_len);
                    m->chat_template[v.template_len] = 0;
                }
            }
            if (!m->merges || !m->merge_lens || (v.template_len && !m->chat_template))
                return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
        }
        for (uint32_t i = 0; i < v.count; i++) {
            int32_t lid, rid;
            wire_vocab_meta_merge(&v, i, &lid, &rid); /* ids < n_vocab: checked by the decoder */
            size_t ll = lens[lid], rl = lens[rid];
            char *s = malloc(ll + rl + 2);
            if (!s) return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
            if (ll) memcpy(s, texts[lid], ll);
            s[ll] = ' ';
            if (rl) memcpy(s + ll + 1, texts[rid], rl);
            m->merges[first + i] = s;
            m->merge_lens[first + i] = (uint32_t)(ll + rl + 1);
        }
        first += v.count;
        if (first >= v.n_merges) return KVS_OK;
    }
}

int route_fetch_vocab(route *r, tok_vocab **out, char *msg, size_t msg_cap) {
    if (!out) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "out is NULL");
    *out = NULL;
    if (!r) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "route is NULL");
    route_hop *h = &r->hops[0];
    const uint32_t nv = r->n_vocab;
    char *arena = NULL;
    size_t arena_len = 0, arena_cap = 0;
    uint64_t *text_off = malloc((size_t)nv * sizeof *text_off);
    uint32_t *lens = malloc((size_t)nv * sizeof *lens);
    float *scores = malloc((size_t)nv * sizeof *scores);
    int32_t *types = malloc((size_t)nv * sizeof *types);
    const char **texts = malloc((size_t)nv * sizeof *texts);
    int32_t bos = -1, eos = -1;
    bool add_space_prefix = true, is_bpe = false;
    bpe_meta meta = {0};
    int rc;
    if (!text_off || !lens || !scores || !types || !texts) {
        rc = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
        goto done;
    }
    for (uint32_t first = 0; first < nv;) {
        char why[KVS_MSG_MAX];
        struct wire_vocab q = {.first = first, .max_count = nv - first};
        size_t len = 0;
        if ((rc = route_tx_reserve(r, 8)) != KVS_OK || (rc = wire_encode_vocab(&q, r->tx, r->tx_cap, &len)) != KVS_OK) {
            rc = kvs_fail(msg, msg_cap, rc, "cannot encode VOCAB: %s", kvs_strerror(rc));
            goto done;
        }
        if ((rc = route_hop_call(r, h, WIRE_OP_VOCAB, len, WIRE_OP_VOCAB_REPLY, why, sizeof why)) != KVS_OK) {
            char old[ROUTE_ADDR_MAX];
            snprintf(old, sizeof old, "%s", h->addr.text);
            route_hop_disconnect(h);
            if (route_is_transport_error(rc) && route_take_spare(r, 0) == KVS_OK) { /* the head died: ask its spare */
                route_log(r, "hop 0 (%s) failed during VOCAB (%s): now %s", old, why, h->addr.text);
                r->reroutes++;
                first = 0;
                arena_len = 0;
                continue;
            }
            rc = kvs_fail(msg, msg_cap, rc, "hop 0 (%s): %s", old, why);
            goto done;
        }
        struct wire_vocab_reply v;
        if ((rc = wire_decode_vocab_reply(r->rx.data, r->rx.len, &v, why, sizeof why)) != KVS_OK) {
            rc = kvs_fail(msg, msg_cap, rc, "hop 0 (%s): bad VOCAB_REPLY: %s", h->addr.text, why);
            goto done;
        }
        if (v.st.status != KVS_OK) {
            rc = kvs_fail(msg, msg_cap, v.st.status, "hop 0 (%s) refused VOCAB: %s", h->addr.text,
                          kvs_strerror(v.st.status));
            goto done;
        }
        if (strcmp(v.tok_model, "llama") != 0 && strcmp(v.tok_model, "gpt2") != 0) {
            rc = kvs_fail(msg, msg_cap, KVS_ERR_UNSUPPORTED, "hop 0 (%s) has a '%s' tokenizer (only llama, gpt2)",
                          h->addr.text, v.tok_model);
            goto done;
        }
        if (first == 0) is_bpe = !strcmp(v.tok_model, "gpt2");
        else if (is_bpe != !strcmp(v.tok_model, "gpt2")) {
            rc = kvs_fail(msg, msg_cap, KVS_ERR_PROTOCOL, "hop 0 (%s): VOCAB pages disagree on the tokenizer",
                          h->addr.text);
            goto done;
        }
        if (v.n_vocab != nv || v.first != first || v.count == 0 ||
            (first > 0 && (v.bos != bos || v.eos != eos || (v.add_space_prefix != 0) != add_space_prefix))) {
            rc = kvs_fail(msg, msg_cap, KVS_ERR_PROTOCOL,
                          "hop 0 (%s): VOCAB page [%u, +%u) of %u does not continue [%u, ...) of %u", h->addr.text,
                          v.first, v.count, v.n_vocab, first, nv);
            goto done;
        }
        bos = v.bos;
        eos = v.eos;
        add_space_prefix = v.add_space_prefix != 0;
        size_t off = 0;
        struct wire_vocab_token t;
        uint32_t i = first;
        while (wire_vocab_next(&v, &off, &t)) {
            if (i >= first + v.count) break; /* the decoder guarantees count entries */
            if (t.text_len > ROUTE_MAX_TOKEN_BYTES || arena_len + t.text_len > ROUTE_MAX_VOCAB_TEXT) {
                rc = kvs_fail(msg, msg_cap, KVS_ERR_PROTOCOL,
                              "hop 0 (%s): VOCAB token %u is %u bytes (limit %u, %u for the whole vocab)",
                              h->addr.text, i, t.text_len, ROUTE_MAX_TOKEN_BYTES, ROUTE_MAX_VOCAB_TEXT);
                goto done;
            }
            if (arena_len + t.text_len > arena_cap) {
                size_t cap = arena_cap ? arena_cap * 2 : 65536;
                while (cap < arena_len + t.text_len) cap *= 2;
                char *a = realloc(arena, cap);
                if (!a) {
                    rc = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
                    goto done;
                }
                arena = a;
                arena_cap = cap;
            }
            if (t.text_len) memcpy(arena + arena_len, t.text, t.text_len);
            text_off[i] = arena_len;
            lens[i] = t.text_len;
            arena_len += t.text_len;
            scores[i] = t.score;
            types[i] = t.type;
            i++;
        }
        if (i != first + v.count) {
            rc = kvs_fail(msg, msg_cap, KVS_ERR_PROTOCOL, "hop 0 (%s): VOCAB page holds %u entries, announced %u",
                          h->addr.text, i - first, v.count);
            goto done;
        }
        first += v.count;
    }
    for (uint32_t i = 0; i < nv; i++) texts[i] = arena ? arena + text_off[i] : NULL;
    tok_arrays a = {.n_vocab = (int32_t)nv, .texts = texts, .text_lens = lens, .scores = scores, .types = types,
                    .bos = bos, .eos = eos, .unk = is_bpe ? -1 : guess_unk(types, (int32_t)nv),
                    .add_space_prefix = add_space_prefix};
    if (is_bpe) {
        if ((rc = fetch_bpe_meta(r, nv, texts, lens, &meta, msg, msg_cap)) != KVS_OK) goto done;
        a.kind = TOK_KIND_BPE;
        a.pre = meta.pre;
        a.add_bos = meta.add_bos;
        a.chat_template = meta.chat_template;
        a.n_merges = (int32_t)meta.n_merges;
        a.merges = (const char *const *)meta.merges;
        a.merge_lens = meta.merge_lens;
    }
    char tmsg[KVS_MSG_MAX] = "";
    rc = tok_from_arrays(&a, out, tmsg, sizeof tmsg);
    if (rc != KVS_OK) rc = kvs_fail(msg, msg_cap, rc, "hop 0 (%s): vocab: %s", h->addr.text, tmsg);

done:
    bpe_meta_free(&meta);
    free(arena);
    free(text_off);
    free(lens);
    free(scores);
    free(types);
    free(texts);
    return rc;
}
