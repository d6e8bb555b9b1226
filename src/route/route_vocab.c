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
    bool rstrip_specials;
    char *chat_template;
    uint32_t n_merges;
    char **merges;
    uint32_t *merge_lens;
    size_t budget; /* bytes the merge table may still take: what the vocab texts left of
                      ROUTE_MAX_VOCAB_TEXT, charged before each allocation */
} bpe_meta;

/* Takes bytes from m's budget; false (nothing taken) when they do not fit. */
static bool bpe_meta_charge(bpe_meta *m, size_t bytes) {
    if (bytes > m->budget) return false;
    m->budget -= bytes;
    return true;
}

static void bpe_meta_free(bpe_meta *m) {
    for (uint32_t i = 0; m->merges && i < m->n_merges; i++) free(m->merges[i]);
    free(m->merges);
    free(m->merge_lens);
    free(m->chat_template);
}

/* The first VOCAB_META page v sets up m: pre, add_bos, the chat template, the merge arrays. */
static int bpe_meta_start(bpe_meta *m, const struct wire_vocab_meta_reply *v, char *msg, size_t msg_cap) {
    memcpy(m->pre, v->pre, sizeof m->pre);
    m->add_bos = v->add_bos == 1 ? 1 : v->add_bos == 2 ? -1 : 0;
    m->rstrip_specials = v->rstrip_specials;
    m->n_merges = v->n_merges;
    if (!bpe_meta_charge(m, (size_t)(v->n_merges ? v->n_merges : 1) * (sizeof *m->merges + sizeof *m->merge_lens)))
        return kvs_fail(msg, msg_cap, KVS_ERR_PROTOCOL, "VOCAB_META announces %u merges: past the %u-byte vocab cap",
                        v->n_merges, ROUTE_MAX_VOCAB_TEXT);
    m->merges = calloc(v->n_merges ? v->n_merges : 1, sizeof *m->merges);
    m->merge_lens = calloc(v->n_merges ? v->n_merges : 1, sizeof *m->merge_lens);
    if (v->template_len) {
        m->chat_template = malloc((size_t)v->template_len + 1);
        if (m->chat_template) {
            memcpy(m->chat_template, v->chat_template, v->template_len);
            m->chat_template[v->template_len] = 0;
        }
    }
    if (!m->merges || !m->merge_lens || (v->template_len && !m->chat_template))
        return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
    return KVS_OK;
}

/* The merges of page v, which starts at merge `first`, as "left right" texts. */
static int bpe_meta_add_merges(bpe_meta *m, const struct wire_vocab_meta_reply *v, uint32_t first,
                               const char *const *texts, const uint32_t *lens, char *msg, size_t msg_cap) {
    for (uint32_t i = 0; i < v->count; i++) {
        int32_t lid, rid;
        wire_vocab_meta_merge(v, i, &lid, &rid); /* ids < n_vocab: checked by the decoder */
        size_t ll = lens[lid], rl = lens[rid];
        if (!bpe_meta_charge(m, ll + rl + 2 + 2 * sizeof(void *))) /* with the allocator's overhead */
            return kvs_fail(msg, msg_cap, KVS_ERR_PROTOCOL, "VOCAB_META merges pass the %u-byte vocab cap at merge %u",
                            ROUTE_MAX_VOCAB_TEXT, first + i);
        char *s = malloc(ll + rl + 2);
        if (!s) return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
        if (ll) memcpy(s, texts[lid], ll);
        s[ll] = ' ';
        if (rl) memcpy(s + ll + 1, texts[rid], rl);
        m->merges[first + i] = s;
        m->merge_lens[first + i] = (uint32_t)(ll + rl + 1);
    }
    return KVS_OK;
}

static int fetch_bpe_meta(route *r, uint32_t nv, const char *const *texts, const uint32_t *lens, bpe_meta *m,
                          char *msg, size_t msg_cap) {
    route_hop *h = &r->hops[0];
    int rc;
    size_t used = 0;
    for (uint32_t i = 0; i < nv; i++) used += lens[i];
    m->budget = used < ROUTE_MAX_VOCAB_TEXT ? ROUTE_MAX_VOCAB_TEXT - used : 0;
    for (uint32_t first = 0;;) {
        char why[KVS_MSG_MAX];
        struct wire_vocab_meta q = {.first = first, .max_count = WIRE_MAX_MERGES};
        size_t len = 0;
        if ((rc = route_tx_reserve(r, 8)) != KVS_OK ||
            (rc = wire_encode_vocab_meta(&q, r->tx, r->tx_cap, &len)) != KVS_OK)
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
        if (first == 0 && (rc = bpe_meta_start(m, &v, msg, msg_cap)) != KVS_OK) return rc;
        if ((rc = bpe_meta_add_merges(m, &v, first, texts, lens, msg, msg_cap)) != KVS_OK) return rc;
        first += v.count;
        if (first >= v.n_merges) return KVS_OK;
    }
}

/* The vocab as its VOCAB pages arrive: every token text in one arena (text_off[i] into it), the
 * per-token arrays, and what every page must repeat (bos, eos, add_space_prefix, the family). */
typedef struct {
    uint32_t n; /* n_vocab of the route */
    char *arena;
    size_t arena_len, arena_cap;
    uint64_t *text_off;
    uint32_t *lens;
    float *scores;
    int32_t *types;
    const char **texts; /* set from the arena once every page is in */
    int32_t bos, eos;
    bool add_space_prefix, is_bpe;
} vocab_pages;

static int vocab_pages_init(vocab_pages *vp, uint32_t nv, char *msg, size_t msg_cap) {
    *vp = (vocab_pages){.n = nv, .bos = -1, .eos = -1, .add_space_prefix = true};
    vp->text_off = malloc((size_t)nv * sizeof *vp->text_off);
    vp->lens = malloc((size_t)nv * sizeof *vp->lens);
    vp->scores = malloc((size_t)nv * sizeof *vp->scores);
    vp->types = malloc((size_t)nv * sizeof *vp->types);
    vp->texts = malloc((size_t)nv * sizeof *vp->texts);
    if (!vp->text_off || !vp->lens || !vp->scores || !vp->types || !vp->texts)
        return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
    return KVS_OK;
}

static void vocab_pages_free(vocab_pages *vp) {
    free(vp->arena);
    free(vp->text_off);
    free(vp->lens);
    free(vp->scores);
    free(vp->types);
    free(vp->texts);
}

/* Is VOCAB_REPLY v, asked for at `first`, a page of the vocab the pages before it describe? */
static int vocab_page_check(const route_hop *h, const vocab_pages *vp, const struct wire_vocab_reply *v,
                            uint32_t first, char *msg, size_t msg_cap) {
    if (v->st.status != KVS_OK)
        return kvs_fail(msg, msg_cap, v->st.status, "hop 0 (%s) refused VOCAB: %s", h->addr.text,
                        kvs_strerror(v->st.status));
    if (strcmp(v->tok_model, "llama") != 0 && strcmp(v->tok_model, "gpt2") != 0)
        return kvs_fail(msg, msg_cap, KVS_ERR_UNSUPPORTED, "hop 0 (%s) has a '%s' tokenizer (only llama, gpt2)",
                        h->addr.text, v->tok_model);
    if (first > 0 && vp->is_bpe != !strcmp(v->tok_model, "gpt2"))
        return kvs_fail(msg, msg_cap, KVS_ERR_PROTOCOL, "hop 0 (%s): VOCAB pages disagree on the tokenizer",
                        h->addr.text);
    if (v->n_vocab != vp->n || v->first != first || v->count == 0 ||
        (first > 0 && (v->bos != vp->bos || v->eos != vp->eos || (v->add_space_prefix != 0) != vp->add_space_prefix)))
        return kvs_fail(msg, msg_cap, KVS_ERR_PROTOCOL,
                        "hop 0 (%s): VOCAB page [%u, +%u) of %u does not continue [%u, ...) of %u", h->addr.text,
                        v->first, v->count, v->n_vocab, first, vp->n);
    return KVS_OK;
}

/* Appends the tokens of page v (checked, starting at `first`) to vp, within the size limits. */
static int vocab_page_store(const route_hop *h, vocab_pages *vp, const struct wire_vocab_reply *v, uint32_t first,
                            char *msg, size_t msg_cap) {
    size_t off = 0;
    struct wire_vocab_token t;
    uint32_t i = first;
    while (wire_vocab_next(v, &off, &t)) {
        if (i >= first + v->count) break; /* the decoder guarantees count entries */
        if (t.text_len > ROUTE_MAX_TOKEN_BYTES || vp->arena_len + t.text_len > ROUTE_MAX_VOCAB_TEXT)
            return kvs_fail(msg, msg_cap, KVS_ERR_PROTOCOL,
                            "hop 0 (%s): VOCAB token %u is %u bytes (limit %u, %u for the whole vocab)",
                            h->addr.text, i, t.text_len, ROUTE_MAX_TOKEN_BYTES, ROUTE_MAX_VOCAB_TEXT);
        if (vp->arena_len + t.text_len > vp->arena_cap) {
            size_t cap = vp->arena_cap ? vp->arena_cap * 2 : 65536;
            while (cap < vp->arena_len + t.text_len) cap *= 2;
            char *a = realloc(vp->arena, cap);
            if (!a) return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
            vp->arena = a;
            vp->arena_cap = cap;
        }
        if (t.text_len) memcpy(vp->arena + vp->arena_len, t.text, t.text_len);
        vp->text_off[i] = vp->arena_len;
        vp->lens[i] = t.text_len;
        vp->arena_len += t.text_len;
        vp->scores[i] = t.score;
        vp->types[i] = t.type;
        i++;
    }
    if (i != first + v->count)
        return kvs_fail(msg, msg_cap, KVS_ERR_PROTOCOL, "hop 0 (%s): VOCAB page holds %u entries, announced %u",
                        h->addr.text, i - first, v->count);
    return KVS_OK;
}

/* Reads every VOCAB page from hop 0 into vp. When hop 0 fails, a spare takes its place
 * (route_take_spare) and the pages start over from its first. */
static int fetch_vocab_pages(route *r, vocab_pages *vp, char *msg, size_t msg_cap) {
    route_hop *h = &r->hops[0];
    int rc;
    for (uint32_t first = 0; first < vp->n;) {
        char why[KVS_MSG_MAX];
        struct wire_vocab q = {.first = first, .max_count = vp->n - first};
        size_t len = 0;
        if ((rc = route_tx_reserve(r, 8)) != KVS_OK || (rc = wire_encode_vocab(&q, r->tx, r->tx_cap, &len)) != KVS_OK)
            return kvs_fail(msg, msg_cap, rc, "cannot encode VOCAB: %s", kvs_strerror(rc));
        if ((rc = route_hop_call(r, h, WIRE_OP_VOCAB, len, WIRE_OP_VOCAB_REPLY, why, sizeof why)) != KVS_OK) {
            char old[ROUTE_ADDR_MAX];
            snprintf(old, sizeof old, "%s", h->addr.text);
            route_hop_disconnect(h);
            if (route_is_transport_error(rc) && route_take_spare(r, 0) == KVS_OK) { /* the head died: ask its spare */
                route_log(r, "hop 0 (%s) failed during VOCAB (%s): now %s", old, why, h->addr.text);
                r->reroutes++;
                first = 0;
                vp->arena_len = 0;
                continue;
            }
            return kvs_fail(msg, msg_cap, rc, "hop 0 (%s): %s", old, why);
        }
        struct wire_vocab_reply v;
        if ((rc = wire_decode_vocab_reply(r->rx.data, r->rx.len, &v, why, sizeof why)) != KVS_OK)
            return kvs_fail(msg, msg_cap, rc, "hop 0 (%s): bad VOCAB_REPLY: %s", h->addr.text, why);
        if ((rc = vocab_page_check(h, vp, &v, first, msg, msg_cap)) != KVS_OK) return rc;
        if (first == 0) vp->is_bpe = !strcmp(v.tok_model, "gpt2");
        vp->bos = v.bos;
        vp->eos = v.eos;
        vp->add_space_prefix = v.add_space_prefix != 0;
        if ((rc = vocab_page_store(h, vp, &v, first, msg, msg_cap)) != KVS_OK) return rc;
        first += v.count;
    }
    return KVS_OK;
}

/* The tokenizer from the pages in vp (and, for a BPE vocab, hop 0's VOCAB_META pages). */
static int vocab_build(route *r, vocab_pages *vp, tok_vocab **out, char *msg, size_t msg_cap) {
    const uint32_t nv = vp->n;
    for (uint32_t i = 0; i < nv; i++) vp->texts[i] = vp->arena ? vp->arena + vp->text_off[i] : NULL;
    tok_arrays a = {.n_vocab = (int32_t)nv, .texts = vp->texts, .text_lens = vp->lens, .scores = vp->scores,
                    .types = vp->types, .bos = vp->bos, .eos = vp->eos,
                    .unk = vp->is_bpe ? -1 : guess_unk(vp->types, (int32_t)nv),
                    .add_space_prefix = vp->add_space_prefix};
    bpe_meta meta = {0};
    /* Every vocab asks for VOCAB_META: a SentencePiece one (gemma3, phi3) has no merges, but
     * its chat template and add_bos setting come only from there. */
    int rc = fetch_bpe_meta(r, nv, vp->texts, vp->lens, &meta, msg, msg_cap);
    if (rc != KVS_OK) goto done;
    a.add_bos = meta.add_bos;
    a.chat_template = meta.chat_template;
    a.rstrip_specials = meta.rstrip_specials;
    if (vp->is_bpe) {
        a.kind = TOK_KIND_BPE;
        a.pre = meta.pre;
        a.n_merges = (int32_t)meta.n_merges;
        a.merges = (const char *const *)meta.merges;
        a.merge_lens = meta.merge_lens;
    }
    char tmsg[KVS_MSG_MAX] = "";
    rc = tok_from_arrays(&a, out, tmsg, sizeof tmsg);
    if (rc != KVS_OK) rc = kvs_fail(msg, msg_cap, rc, "hop 0 (%s): vocab: %s", r->hops[0].addr.text, tmsg);
done:
    bpe_meta_free(&meta);
    return rc;
}

int route_fetch_vocab(route *r, tok_vocab **out, char *msg, size_t msg_cap) {
    if (!out) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "out is NULL");
    *out = NULL;
    if (!r) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "route is NULL");
    vocab_pages vp;
    int rc = vocab_pages_init(&vp, r->n_vocab, msg, msg_cap);
    if (rc == KVS_OK) rc = fetch_vocab_pages(r, &vp, msg, msg_cap);
    if (rc == KVS_OK) rc = vocab_build(r, &vp, out, msg, msg_cap);
    vocab_pages_free(&vp);
    return rc;
}
