/*
 * tok_bpe — byte-level BPE (GPT-2 family) as llama.cpp's llm_tokenizer_bpe does it.
 *
 * Design notes
 *  1. Byte map: every byte b has a printable code point — b itself for '!'..'~',
 *     U+00A1..U+00AC and U+00AE..U+00FF, else U+0100 + (its rank among the other bytes)
 *     — and token texts are written in those code points. Encoding therefore never
 *     builds the mapped text except for whole-pre-token lookups: the first symbols of a
 *     pre-token are the ids of its bytes' one-character tokens (byte_id).
 *  2. Merges are keyed by the token ids of their two sides (an open-addressing table of
 *     (left << 32 | right) -> rank, result id). Ranks keep the file's order; a merge that
 *     cannot apply to ids (a side or the result not in the vocab, no space) is dropped and
 *     the later ones move up, which keeps their order and so the result.
 *  3. Pre-tokenizer: a list of PCRE2 patterns (UTF + UCP, JIT when available) applied in
 *     turn, as llama.cpp's unicode_regex_split: each pattern splits every piece of the
 *     previous step into its matches and the text between them (both kept), a match never
 *     looking past its piece. The patterns are those the model cards publish, with
 *     (?i:'s|...) spelled '[sS]|... so that PCRE2's Unicode case folding (which would let
 *     "'ſ" match) stays out, as in llama.cpp.
 *  4. Invalid UTF-8 reads as U+FFFD per bad byte before pre-tokenizing (llama.cpp's
 *     unicode_cpts_from_utf8); PCRE2 then runs with its UTF check off.
 *  5. Merging one pre-token: a min-heap of adjacent pairs keyed by (rank, left index);
 *     a popped pair is stale when either side changed since it was pushed (the ids
 *     recorded at push time no longer match, or the two are no longer neighbours). With
 *     ignore_merges (Llama 3), a pre-token that is itself a token is emitted whole.
 *  6. A pre-token's ids depend on its bytes alone, and text repeats its words, so one
 *     encode call keeps a cache of pre-tokens (<= BPE_CACHE_WORD bytes) -> ids: an
 *     open-addressing table that stops taking entries at half load. Merge-table lookups
 *     are cache misses on a 4-16 MiB table; the word cache turns most words into one.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "tok_bpe.h"

#include <pcre2.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tok_heap.h"
#include "util.h"

#define BPE_MAX_REGEX 4
#define BPE_CACHE_SLOTS (1u << 16) /* power of two */
#define BPE_CACHE_WORD 64          /* bytes of the longest cached pre-token */

/* ---- pre-tokenizers (design note 3) ---- */

#define RE_CONTRACTIONS "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
#define RE_LLAMA3                                                                                  \
    RE_CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|" \
                    "\\s+(?!\\S)|\\s+"
#define RE_QWEN2                                                                                \
    RE_CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|" \
                    "\\s+(?!\\S)|\\s+"
#define RE_GPT2 "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"

typedef struct {
    const char *names[4];          /* tokenizer.ggml.pre values (NULL-terminated) */
    const char *regex[BPE_MAX_REGEX];
    bool ignore_merges;            /* a pre-token found in the vocab is emitted whole */
    bool add_bos;                  /* default when add_bos_token is absent */
    bool clean_spaces;             /* detokenization cleans spaces */
} bpe_pre_def;

static const bpe_pre_def PRE_DEFS[] = {
    {{"llama-bpe", "llama3", "llama-v3", NULL}, {RE_LLAMA3}, true, true, true},
    {{"smaug-bpe", NULL}, {RE_LLAMA3}, false, false, true},
    {{"qwen2", "deepseek-r1-qwen", NULL}, {RE_QWEN2}, false, false, false},
    {{"smollm", NULL}, {"\\p{N}", RE_GPT2}, false, false, false},
    {{"gpt-2", NULL}, {RE_GPT2}, false, false, true},
    {{"default", NULL}, {"[\\p{P}\\$\\+<=>\\^~\\|]+", RE_GPT2, "\\p{N}+", "[0-9][0-9][0-9]"}, false, false, true},
};

const char *tok_bpe_pre_names(void) {
    return "llama-bpe, llama3, llama-v3, smaug-bpe, qwen2, deepseek-r1-qwen, smollm, gpt-2, default";
}

typedef struct {
    uint64_t key;   /* left << 32 | right; UINT64_MAX when empty */
    int32_t rank;
    int32_t result; /* id of the merged token */
} bpe_slot;

struct tok_bpe {
    const bpe_pre_def *pre;
    char pre_name[TOK_MAX_PRE + 1];
    pcre2_code *re[BPE_MAX_REGEX];
    int n_re;
    int32_t byte_id[256];   /* id of the one-character token of each byte, -1 if none */
    bpe_slot *slots;        /* (slot_cap) merge table */
    uint32_t slot_cap;      /* power of two, >= 2 * n_merges */
    int32_t n_merges;       /* kept merges */
    int32_t *merge_lr;      /* (2 * n_merges) left, right ids by rank */
};

/* ---- byte map (design note 1) ---- */

static uint32_t byte_cp(int b) {
    if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255)) return (uint32_t)b;
    int rank = 0; /* bytes below b that are not printable */
    for (int c = 0; c < b; c++)
        if (!((c >= 33 && c <= 126) || (c >= 161 && c <= 172) || (c >= 174 && c <= 255))) rank++;
    return 256u + (uint32_t)rank;
}

/* Code point -> byte for U+0000..U+0143, -1 elsewhere. */
static int16_t cp_byte[324];
static pthread_once_t cp_once = PTHREAD_ONCE_INIT;
static uint32_t byte_cps[256];

static void init_maps(void) {
    for (int i = 0; i < 324; i++) cp_byte[i] = -1;
    for (int b = 0; b < 256; b++) {
        byte_cps[b] = byte_cp(b);
        cp_byte[byte_cps[b]] = (int16_t)b;
    }
}

/* UTF-8 of cp < 0x800 into out; returns its length. */
static size_t put_cp(uint32_t cp, char *out) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    out[0] = (char)(0xC0 | (cp >> 6));
    out[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
}

/* ---- merge table (design note 2) ---- */

static uint32_t pair_hash(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return (uint32_t)k;
}

static const bpe_slot *merge_find(const tok_bpe *b, int32_t left, int32_t right) {
    uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    uint32_t mask = b->slot_cap - 1;
    for (uint32_t i = pair_hash(key) & mask;; i = (i + 1) & mask) {
        const bpe_slot *s = &b->slots[i];
        if (s->key == key) return s;
        if (s->key == UINT64_MAX) return NULL;
    }
}

/* Inserts unless the pair is already there (the first rank stays). */
static bool merge_insert(tok_bpe *b, int32_t left, int32_t right, int32_t result) {
    uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    uint32_t mask = b->slot_cap - 1;
    for (uint32_t i = pair_hash(key) & mask;; i = (i + 1) & mask) {
        bpe_slot *s = &b->slots[i];
        if (s->key == key) return false;
        if (s->key == UINT64_MAX) {
            *s = (bpe_slot){key, b->n_merges, result};
            b->merge_lr[2 * b->n_merges] = left;
            b->merge_lr[2 * b->n_merges + 1] = right;
            b->n_merges++;
            return true;
        }
    }
}

void tok_bpe_free(tok_bpe *b) {
    if (!b) return;
    for (int i = 0; i < b->n_re; i++) pcre2_code_free(b->re[i]);
    free(b->slots);
    free(b->merge_lr);
    free(b);
}

int tok_bpe_create(const tok_vocab *v, const char *pre, const char *const *merges, const uint32_t *merge_lens,
                   int32_t n_merges, tok_bpe **out, char *msg, size_t msg_cap) {
    *out = NULL;
    pthread_once(&cp_once, init_maps);
    const char *name = pre && pre[0] ? pre : "default";
    const bpe_pre_def *def = NULL;
    for (size_t i = 0; i < sizeof PRE_DEFS / sizeof PRE_DEFS[0] && !def; i++)
        for (int k = 0; PRE_DEFS[i].names[k]; k++)
            if (!strcmp(name, PRE_DEFS[i].names[k])) def = &PRE_DEFS[i];
    if (!def)
        return kvs_fail(msg, msg_cap, KVS_ERR_UNSUPPORTED,
                        "unknown pre-tokenizer tokenizer.ggml.pre = '%s' (supported: %s)", name, tok_bpe_pre_names());
    if (n_merges < 0 || n_merges > TOK_MAX_MERGES) return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "bad merge count");

    int rc;
    char *buf = NULL;
    tok_bpe *b = calloc(1, sizeof *b);
    if (!b) return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
    b->pre = def;
    snprintf(b->pre_name, sizeof b->pre_name, "%s", name);
    for (int i = 0; i < BPE_MAX_REGEX && def->regex[i]; i++) {
        int err;
        PCRE2_SIZE at;
        b->re[i] = pcre2_compile((PCRE2_SPTR)def->regex[i], PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &err, &at,
                                 NULL);
        if (!b->re[i]) {
            PCRE2_UCHAR why[128];
            pcre2_get_error_message(err, why, sizeof why);
            rc = kvs_fail(msg, msg_cap, KVS_ERR_INTERNAL, "PCRE2 refuses pattern %d of '%s' at %zu: %s", i, name,
                          (size_t)at, (const char *)why);
            goto fail;
        }
        b->n_re = i + 1;
        (void)pcre2_jit_compile(b->re[i], PCRE2_JIT_COMPLETE); /* the interpreter runs it otherwise */
    }

    for (int c = 0; c < 256; c++) {
        char u[2];
        size_t l = put_cp(byte_cps[c], u);
        b->byte_id[c] = tok_vocab_find(v, u, l);
    }

    b->slot_cap = 16;
    while (b->slot_cap < 2u * (uint32_t)n_merges) b->slot_cap <<= 1;
    b->slots = malloc((size_t)b->slot_cap * sizeof *b->slots);
    b->merge_lr = malloc(((size_t)n_merges * 2 + 1) * sizeof *b->merge_lr);
    buf = malloc(2 * TOK_MAX_TOKEN_BYTES + 2);
    if (!b->slots || !b->merge_lr || !buf) {
        rc = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
        goto fail;
    }
    for (uint32_t i = 0; i < b->slot_cap; i++) b->slots[i].key = UINT64_MAX;
    for (int32_t i = 0; i < n_merges; i++) {
        const char *m = merges[i];
        size_t ml = merge_lens[i];
        if (ml > 2 * TOK_MAX_TOKEN_BYTES + 1 || (ml > 0 && !m)) {
            rc = kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "merge %d: bad length %zu", (int)i, ml);
            goto fail;
        }
        const char *sp = ml > 1 ? memchr(m + 1, ' ', ml - 1) : NULL; /* llama.cpp: find(' ', 1) */
        if (!sp) continue;
        size_t ll = (size_t)(sp - m), rl = ml - ll - 1;
        int32_t left = tok_vocab_find(v, m, ll), right = tok_vocab_find(v, sp + 1, rl);
        if (left < 0 || right < 0) continue;
        memcpy(buf, m, ll);
        memcpy(buf + ll, sp + 1, rl);
        int32_t result = tok_vocab_find(v, buf, ll + rl);
        if (result < 0) continue;
        merge_insert(b, left, right, result);
    }
    free(buf);
    *out = b;
    return KVS_OK;

fail:
    free(buf);
    tok_bpe_free(b);
    return rc;
}

const char *tok_bpe_pre(const tok_bpe *b) { return b ? b->pre_name : ""; }
bool tok_bpe_default_add_bos(const tok_bpe *b) { return b && b->pre->add_bos; }
bool tok_bpe_clean_spaces(const tok_bpe *b) { return b && b->pre->clean_spaces; }
int32_t tok_bpe_n_merges(const tok_bpe *b) { return b ? b->n_merges : 0; }

bool tok_bpe_merge(const tok_bpe *b, int32_t rank, int32_t *left, int32_t *right) {
    if (!b || rank < 0 || rank >= b->n_merges) return false;
    if (left) *left = b->merge_lr[2 * rank];
    if (right) *right = b->merge_lr[2 * rank + 1];
    return true;
}

/* ---- encoding ---- */

typedef struct {
    size_t start, len;
} bpe_piece;

typedef struct {
    int32_t rank;
    int32_t left, right;       /* symbol indices */
    int32_t left_id, right_id; /* their ids when pushed (design note 5) */
} bpe_pair;

typedef struct {
    const uint8_t *word; /* into the encoded text; NULL when empty */
    uint32_t hash;
    uint16_t len;        /* bytes */
    uint16_t n_ids;
    uint32_t ids_off;    /* into cache_ids */
} bpe_cache_slot;

typedef struct {
    bpe_piece *pieces[2];      /* ping-pong piece lists of the regex steps */
    size_t n_pieces[2], cap_pieces[2];
    int32_t *sym_id, *sym_prev, *sym_next;
    size_t sym_cap;
    bpe_pair *heap;
    size_t heap_n, heap_cap;
    char *enc;                 /* mapped text of one pre-token (ignore_merges lookups) */
    size_t enc_cap;
    int32_t *word_ids;         /* ids of one pre-token (sym_cap + 1) */
    size_t word_ids_cap;
    bpe_cache_slot *cache;     /* (BPE_CACHE_SLOTS) design note 6; NULL: no cache */
    uint32_t cache_n;
    int32_t *cache_ids;        /* ids of the cached words, back to back */
    size_t cache_ids_n, cache_ids_cap;
} bpe_work;

static int piece_push(bpe_work *w, int k, size_t start, size_t len) {
    if (w->n_pieces[k] == w->cap_pieces[k]) {
        size_t cap = w->cap_pieces[k] ? w->cap_pieces[k] * 2 : 256;
        bpe_piece *p = realloc(w->pieces[k], cap * sizeof *p);
        if (!p) return KVS_ERR_NOMEM;
        w->pieces[k] = p;
        w->cap_pieces[k] = cap;
    }
    w->pieces[k][w->n_pieces[k]++] = (bpe_piece){start, len};
    return KVS_OK;
}

/* Splits text[p.start, +p.len) by re into list k (design note 3). */
static int split_piece(const pcre2_code *re, pcre2_match_data *md, const char *text, bpe_piece p, bpe_work *w,
                       int k) {
    const PCRE2_SPTR subj = (PCRE2_SPTR)(text + p.start);
    size_t off = 0, gap = 0, n = p.len;
    int rc;
    while (off < n) {
        int m = pcre2_match(re, subj, n, off, PCRE2_NO_UTF_CHECK, md, NULL);
        if (m == PCRE2_ERROR_NOMATCH) break;
        if (m < 0) return KVS_ERR_INTERNAL;
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t s = ov[0], e = ov[1];
        if (e <= s) { /* an empty match: step over one character, it stays in the gap */
            off = s + 1;
            while (off < n && (subj[off] & 0xC0) == 0x80) off++;
            continue;
        }
        if (s > gap && (rc = piece_push(w, k, p.start + gap, s - gap)) != KVS_OK) return rc;
        if ((rc = piece_push(w, k, p.start + s, e - s)) != KVS_OK) return rc;
        off = gap = e;
    }
    if (gap < n && (rc = piece_push(w, k, p.start + gap, n - gap)) != KVS_OK) return rc;
    return KVS_OK;
}

/* a pops before b: lower rank, then leftmost. */
static bool pair_above(const bpe_pair *a, const bpe_pair *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

TOK_HEAP_DEFINE(bpe_work, bpe_pair, pair_above)

static int try_pair(const tok_bpe *b, bpe_work *w, int32_t left, int32_t right) {
    if (left < 0 || right < 0) return KVS_OK;
    int32_t l = w->sym_id[left], r = w->sym_id[right];
    if (l < 0 || r < 0) return KVS_OK;
    const bpe_slot *s = merge_find(b, l, r);
    if (!s) return KVS_OK;
    return heap_push(w, (bpe_pair){s->rank, left, right, l, r});
}

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return KVS_OK;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *q = realloc(*p, c * elem);
    if (!q) return KVS_ERR_NOMEM;
    *p = q;
    *cap = c;
    return KVS_OK;
}

/* BPE-merges one pre-token p[0..n) and emits its ids (design note 5). */
static int encode_word(const tok_vocab *v, const tok_bpe *b, bpe_work *w, const uint8_t *p, size_t n, tok_out *out) {
    if (n == 1) {
        if (b->byte_id[p[0]] >= 0) tok_emit(out, b->byte_id[p[0]]);
        return KVS_OK;
    }
    if (b->pre->ignore_merges && n <= TOK_MAX_TOKEN_BYTES) {
        size_t cap = w->enc_cap;
        if (grow((void **)&w->enc, &cap, 2 * n, 1) != KVS_OK) return KVS_ERR_NOMEM;
        w->enc_cap = cap;
        size_t el = 0;
        for (size_t i = 0; i < n; i++) el += put_cp(byte_cps[p[i]], w->enc + el);
        int32_t id = tok_vocab_find(v, w->enc, el);
        if (id >= 0) {
            tok_emit(out, id);
            return KVS_OK;
        }
    }
    if (n > w->sym_cap) {
        size_t c1 = w->sym_cap, c2 = w->sym_cap, c3 = w->sym_cap;
        if (grow((void **)&w->sym_id, &c1, n, sizeof(int32_t)) || grow((void **)&w->sym_prev, &c2, n, sizeof(int32_t)) ||
            grow((void **)&w->sym_next, &c3, n, sizeof(int32_t)))
            return KVS_ERR_NOMEM;
        w->sym_cap = c1 < c2 ? (c1 < c3 ? c1 : c3) : (c2 < c3 ? c2 : c3);
    }
    for (size_t i = 0; i < n; i++) {
        w->sym_id[i] = b->byte_id[p[i]];
        w->sym_prev[i] = (int32_t)i - 1;
        w->sym_next[i] = i + 1 == n ? -1 : (int32_t)i + 1;
    }
    int rc;
    w->heap_n = 0;
    for (size_t i = 1; i < n; i++)
        if ((rc = try_pair(b, w, (int32_t)i - 1, (int32_t)i)) != KVS_OK) return rc;
    while (w->heap_n > 0) {
        bpe_pair q = heap_pop(w);
        if (w->sym_next[q.left] != q.right || w->sym_id[q.left] != q.left_id || w->sym_id[q.right] != q.right_id)
            continue; /* stale */
        const bpe_slot *s = merge_find(b, q.left_id, q.right_id);
        w->sym_id[q.left] = s->result;
        w->sym_id[q.right] = -2; /* merged away */
        int32_t next = w->sym_next[q.right];
        w->sym_next[q.left] = next;
        if (next >= 0) w->sym_prev[next] = q.left;
        w->sym_next[q.right] = -1;
        if ((rc = try_pair(b, w, w->sym_prev[q.left], q.left)) != KVS_OK) return rc;
        if ((rc = try_pair(b, w, q.left, next)) != KVS_OK) return rc;
    }
    for (int32_t i = 0; i >= 0; i = w->sym_next[i])
        if (w->sym_id[i] >= 0) tok_emit(out, w->sym_id[i]); /* a byte without a token has no id (as llama.cpp) */
    return KVS_OK;
}

static uint32_t word_hash(const uint8_t *p, size_t n) {
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 16777619u;
    return h;
}

/* encode_word through the word cache (design note 6). */
static int encode_word_cached(const tok_vocab *v, const tok_bpe *b, bpe_work *w, const uint8_t *p, size_t n,
                              tok_out *out) {
    if (n <= 1 || n > BPE_CACHE_WORD || !w->cache) return encode_word(v, b, w, p, n, out);
    uint32_t h = word_hash(p, n), mask = BPE_CACHE_SLOTS - 1, i = h & mask;
    for (;; i = (i + 1) & mask) {
        bpe_cache_slot *c = &w->cache[i];
        if (!c->word) break;
        if (c->hash == h && c->len == n && !memcmp(c->word, p, n)) {
            for (uint32_t k = 0; k < c->n_ids; k++) tok_emit(out, w->cache_ids[c->ids_off + k]);
            return KVS_OK;
        }
    }
    /* a miss: encode into word_ids, then remember it while the table is under half full */
    size_t cap = w->word_ids_cap;
    if (grow((void **)&w->word_ids, &cap, n + 1, sizeof(int32_t)) != KVS_OK) return KVS_ERR_NOMEM;
    w->word_ids_cap = cap;
    tok_out local = {w->word_ids, (int)(n + 1), 0};
    int rc = encode_word(v, b, w, p, n, &local);
    if (rc != KVS_OK) return rc;
    for (size_t k = 0; k < local.n_out; k++) tok_emit(out, w->word_ids[k]);
    if (w->cache_n < BPE_CACHE_SLOTS / 2) {
        cap = w->cache_ids_cap;
        if (grow((void **)&w->cache_ids, &cap, w->cache_ids_n + local.n_out, sizeof(int32_t)) != KVS_OK)
            return KVS_OK; /* no room to remember: still correct */
        w->cache_ids_cap = cap;
        memcpy(w->cache_ids + w->cache_ids_n, w->word_ids, local.n_out * sizeof(int32_t));
        w->cache[i] = (bpe_cache_slot){p, h, (uint16_t)n, (uint16_t)local.n_out, (uint32_t)w->cache_ids_n};
        w->cache_ids_n += local.n_out;
        w->cache_n++;
    }
    return KVS_OK;
}

/* Copy of s[0..n) with each invalid UTF-8 byte replaced by U+FFFD (design note 4), or NULL
 * in *out when s is valid already. */
static int sanitize(const char *s, size_t n, char **out, size_t *out_n) {
    *out = NULL;
    size_t i = 0;
    while (i < n) {
        if ((uint8_t)s[i] < 0x80) { /* ASCII: the common case */
            i++;
            continue;
        }
        int k = tok_utf8_char(s + i, n - i, NULL);
        if (k == 0) break;
        i += (size_t)k;
    }
    if (i == n) return KVS_OK;
    char *r = malloc(3 * n);
    if (!r) return KVS_ERR_NOMEM;
    memcpy(r, s, i);
    size_t w = i;
    while (i < n) {
        int k = tok_utf8_char(s + i, n - i, NULL);
        if (k == 0) {
            memcpy(r + w, "\xEF\xBF\xBD", 3);
            w += 3;
            i++;
        } else {
            memcpy(r + w, s + i, (size_t)k);
            w += (size_t)k;
            i += (size_t)k;
        }
    }
    *out = r;
    *out_n = w;
    return KVS_OK;
}

int tok_bpe_encode(const tok_vocab *v, const char *text, size_t len, tok_out *out) {
    const tok_bpe *b = v->bpe;
    if (len == 0) return KVS_OK;
    char *clean = NULL;
    int rc = sanitize(text, len, &clean, &len);
    if (rc != KVS_OK) return rc;
    if (clean) text = clean;

    bpe_work w = {0};
    pcre2_match_data *md = NULL;
    if ((rc = piece_push(&w, 0, 0, len)) != KVS_OK) goto done;
    int cur = 0;
    for (int r = 0; r < b->n_re; r++) {
        pcre2_match_data_free(md);
        md = pcre2_match_data_create_from_pattern(b->re[r], NULL);
        if (!md) {
            rc = KVS_ERR_NOMEM;
            goto done;
        }
        int nxt = 1 - cur;
        w.n_pieces[nxt] = 0;
        for (size_t i = 0; i < w.n_pieces[cur]; i++)
            if ((rc = split_piece(b->re[r], md, text, w.pieces[cur][i], &w, nxt)) != KVS_OK) goto done;
        cur = nxt;
    }
    if (w.n_pieces[cur] > 64) w.cache = calloc(BPE_CACHE_SLOTS, sizeof *w.cache); /* NULL: uncached */
    for (size_t i = 0; i < w.n_pieces[cur]; i++) {
        bpe_piece p = w.pieces[cur][i];
        if ((rc = encode_word_cached(v, b, &w, (const uint8_t *)text + p.start, p.len, out)) != KVS_OK) goto done;
    }

done:
    pcre2_match_data_free(md);
    free(w.pieces[0]);
    free(w.pieces[1]);
    free(w.sym_id);
    free(w.sym_prev);
    free(w.sym_next);
    free(w.heap);
    free(w.enc);
    free(w.word_ids);
    free(w.cache);
    free(w.cache_ids);
    free(clean);
    return rc;
}

/* ---- decoding ---- */

void tok_bpe_decode_text(const char *t, size_t n, char *buf, size_t cap, size_t *len) {
    pthread_once(&cp_once, init_maps);
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int k = tok_utf8_char(t + i, n - i, &cp);
        size_t step = k > 0 ? (size_t)k : 1;
        char byte;
        const char *src = t + i;
        size_t sl = step;
        if (k > 0 && cp < 324 && cp_byte[cp] >= 0) {
            byte = (char)cp_byte[cp];
            src = &byte;
            sl = 1;
        }
        if (*len < cap) {
            size_t c = cap - *len < sl ? cap - *len : sl;
            memcpy(buf + *len, src, c);
        }
        *len += sl;
        i += step;
    }
}
