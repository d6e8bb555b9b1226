/*
 * tok_spm — SentencePiece-style "llama" (SPM) encoding of one raw fragment, matching
 * llama.cpp's llm_tokenizer_spm for tokenizer.ggml.model == "llama".
 *
 * Design notes
 *  1. Each raw fragment gets a leading ' ' when the caller asks (add_space_prefix and the
 *     previous fragment was a token, or it is the first), then ' ' -> U+2581.
 *  2. The fragment is split into UTF-8 characters by lead byte alone (0x00-0xBF: 1 byte,
 *     0xC0-0xDF: 2, 0xE0-0xEF: 3, 0xF0-0xFF: 4, clipped at the end), so invalid UTF-8
 *     never fails, it only makes odd characters.
 *  3. Every adjacent pair whose concatenation is a token enters a max-heap keyed by
 *     (score desc, left index asc); popping a pair whose sides changed since it was
 *     pushed (size mismatch or a side already merged away) is skipped, otherwise the
 *     right symbol merges into the left and the two new pairs around it are pushed. Each
 *     merge pushes at most 2 pairs, so the heap holds < 3n entries and the loop is
 *     O(n log n).
 *  4. A final symbol is its token if the text is in the vocab, else one <0xNN> token per
 *     byte (the unknown id when the vocab lacks that byte). A merged symbol is always a
 *     vocab token, so llama.cpp's rev_merge re-segmentation never applies.
 */
#include <stdlib.h>
#include <string.h>

#include "tok_heap.h"
#include "tok_spm.h"
#include "util.h"

typedef struct {
    int32_t start; /* byte offset into the escaped fragment */
    int32_t n;     /* bytes; 0 once merged into its left neighbour */
    int32_t prev;  /* index of the previous live symbol, -1 at the start */
    int32_t next;  /* index of the next live symbol, -1 at the end */
} tok_symbol;

typedef struct {
    float score;  /* score of the merged token */
    int32_t left; /* symbol indices */
    int32_t right;
    int32_t size; /* bytes of left + right when pushed; a mismatch at pop means stale */
} tok_bigram;

/* Scratch for one tok_encode call. */
typedef struct {
    char *text;           /* escaped fragment */
    tok_symbol *sym;      /* sym_cap entries */
    size_t sym_cap;
    tok_bigram *heap;
    size_t heap_n, heap_cap;
    tok_out *out;
} tok_work;

/* a pops before b: higher score, then leftmost. */
static bool bigram_above(const tok_bigram *a, const tok_bigram *b) {
    return a->score > b->score || (a->score == b->score && a->left < b->left);
}

TOK_HEAP_DEFINE(tok_work, tok_bigram, bigram_above)

static int try_add_bigram(const tok_vocab *v, tok_work *w, int32_t left, int32_t right) {
    if (left < 0 || right < 0) return KVS_OK;
    const tok_symbol *l = &w->sym[left], *r = &w->sym[right];
    int32_t size = l->n + r->n; /* adjacent: r starts where l ends */
    int32_t id = tok_vocab_find(v, w->text + l->start, (size_t)size);
    if (id < 0) return KVS_OK;
    return heap_push(w, (tok_bigram){v->scores[id], left, right, size});
}

/* UTF-8 sequence length from the lead byte alone, like llama.cpp's unicode_len_utf8. */
static int utf8_len(uint8_t lead) {
    static const uint8_t lookup[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return lookup[lead >> 4];
}

/* SPM-encodes one raw fragment (design note 3b-3e). */
static int encode_fragment(const tok_vocab *v, tok_work *w, const char *src, size_t len, bool add_prefix) {
    static const char spc[3] = {'\xE2', '\x96', '\x81'}; /* U+2581 */
    size_t tl = 0;
    if (add_prefix) {
        memcpy(w->text, spc, 3);
        tl = 3;
    }
    for (size_t i = 0; i < len; i++) {
        if (src[i] == ' ') {
            memcpy(w->text + tl, spc, 3);
            tl += 3;
        } else {
            w->text[tl++] = src[i];
        }
    }
    if (tl == 0) return KVS_OK;

    /* Count first: a lead byte may swallow part of a following U+2581, so the
     * number of characters is not bounded by the input length. */
    size_t need = 0;
    for (size_t off = 0; off < tl; need++) off += (size_t)utf8_len((uint8_t)w->text[off]);
    if (need > w->sym_cap) {
        tok_symbol *ns = realloc(w->sym, need * sizeof *ns);
        if (!ns) return KVS_ERR_NOMEM;
        w->sym = ns;
        w->sym_cap = need;
    }

    int32_t n_sym = 0;
    for (size_t off = 0; off < tl;) {
        size_t cl = (size_t)utf8_len((uint8_t)w->text[off]);
        if (cl > tl - off) cl = tl - off;
        tok_symbol *s = &w->sym[n_sym];
        s->start = (int32_t)off;
        s->n = (int32_t)cl;
        s->prev = n_sym - 1;
        off += cl;
        s->next = off == tl ? -1 : n_sym + 1;
        n_sym++;
    }

    int rc;
    w->heap_n = 0;
    for (int32_t i = 1; i < n_sym; i++)
        if ((rc = try_add_bigram(v, w, i - 1, i)) != KVS_OK) return rc;

    while (w->heap_n > 0) {
        tok_bigram b = heap_pop(w);
        tok_symbol *l = &w->sym[b.left], *r = &w->sym[b.right];
        if (l->n == 0 || r->n == 0 || l->n + r->n != b.size) continue;
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0) w->sym[r->next].prev = b.left;
        if ((rc = try_add_bigram(v, w, l->prev, b.left)) != KVS_OK) return rc;
        if ((rc = try_add_bigram(v, w, b.left, l->next)) != KVS_OK) return rc;
    }

    for (int32_t i = 0; i != -1; i = w->sym[i].next) {
        const tok_symbol *s = &w->sym[i];
        int32_t id = tok_vocab_find(v, w->text + s->start, (size_t)s->n);
        if (id >= 0) {
            tok_emit(w->out, id);
            continue;
        }
        for (int32_t j = 0; j < s->n; j++) {
            int32_t bt = v->byte_tok[(uint8_t)w->text[s->start + j]];
            /* No piece, no byte token and no unknown token: there is no id to give (never -1). */
            if (bt < 0 && v->unk < 0) return KVS_ERR_UNSUPPORTED;
            tok_emit(w->out, bt >= 0 ? bt : v->unk);
        }
    }
    return KVS_OK;
}


int tok_spm_encode(const tok_vocab *v, const char *text, size_t len, bool add_prefix, tok_out *out) {
    tok_work w = {0};
    w.out = out;
    int rc = KVS_OK;
    if (len == 0 && !add_prefix) return KVS_OK;
    w.text = malloc(3 * len + 3);
    if (!w.text) return KVS_ERR_NOMEM;
    rc = encode_fragment(v, &w, text, len, add_prefix);
    free(w.text);
    free(w.sym);
    free(w.heap);
    return rc;
}
