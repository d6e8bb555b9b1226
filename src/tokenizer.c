/*
 * tokenizer — SentencePiece-style "llama" (SPM) tokenizer, matching llama.cpp's
 * llm_tokenizer_spm for tokenizer.ggml.model == "llama".
 *
 * Design notes
 *  1. The vocab owns copies of every token text in one arena (text_arena); the
 *     GGUF context (or the caller's arrays) may be freed once tok_from_gguf() /
 *     tok_from_arrays() returns. tok_from_gguf only reads the metadata into a
 *     tok_arrays; tok_from_arrays is the single builder.
 *  2. Token text -> id is an open-addressing hash table (power-of-two slots, load
 *     <= 1/2, linear probing). A text that occurs twice maps to its last id, as in
 *     llama.cpp, whose map assignment overwrites.
 *  3. Encoding (tok_encode):
 *       a. the text is split into fragments at user-defined tokens (type 4), which
 *          llama.cpp matches verbatim even without special-token parsing; longer
 *          user tokens are matched first;
 *       b. each raw fragment gets a leading ' ' when add_space_prefix is set and the
 *          previous fragment was a token (or it is the first), then ' ' -> U+2581;
 *       c. the fragment is split into UTF-8 characters by lead byte alone
 *          (0x00-0xBF: 1 byte, 0xC0-0xDF: 2, 0xE0-0xEF: 3, 0xF0-0xFF: 4, clipped at
 *          the end), so invalid UTF-8 never fails, it only makes odd characters;
 *       d. every adjacent pair whose concatenation is a token enters a max-heap keyed
 *          by (score desc, left index asc); popping a pair whose sides changed since
 *          it was pushed (size mismatch or a side already merged away) is skipped,
 *          otherwise the right symbol merges into the left and the two new pairs
 *          around it are pushed. Each merge pushes at most 2 pairs, so the heap
 *          holds < 3n entries and the loop is O(n log n);
 *       e. a final symbol is its token if the text is in the vocab, else one
 *          <0xNN> token per byte (the unknown id when the vocab lacks that byte).
 *     A merged symbol is always a vocab token, so llama.cpp's rev_merge
 *     re-segmentation never applies and is not needed here.
 *  4. Nothing here allocates global state; a vocab is read-only after creation and
 *     may be shared between threads.
 */
#include "tokenizer.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

enum {
    TOK_TYPE_NORMAL = 1,
    TOK_TYPE_UNKNOWN = 2,
    TOK_TYPE_CONTROL = 3,
    TOK_TYPE_USER_DEFINED = 4,
    TOK_TYPE_UNUSED = 5,
    TOK_TYPE_BYTE = 6,
};

/* Hard limits on metadata from the file. */
#define TOK_MAX_VOCAB (1 << 24)
#define TOK_MAX_TOKEN_BYTES 4096

struct tok_vocab {
    int32_t n_vocab;
    char *text_arena;      /* all token texts back to back, not NUL-terminated */
    uint32_t *text_off;    /* (n_vocab + 1) offsets into text_arena; token i is [off[i], off[i+1]) */
    float *scores;         /* (n_vocab) merge priority, higher merges first */
    uint8_t *types;        /* (n_vocab) TOK_TYPE_* */
    int32_t *hash_slots;   /* (hash_cap) token id or -1 */
    uint32_t hash_cap;     /* power of two, >= 2 * n_vocab */
    int32_t byte_tok[256]; /* id of <0xNN> (or of the 1-byte token "\xNN"), -1 if none */
    int32_t *user_ids;     /* (n_user) user-defined tokens, longest text first */
    int32_t n_user;
    uint32_t max_token_len; /* bytes of the longest token text */
    int32_t bos, eos, unk;  /* -1 when absent */
    bool add_space_prefix;
};

/* ---- hash map ------------------------------------------------------------- */

static uint32_t hash_bytes(const char *s, size_t n) {
    uint32_t h = 2166136261u; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= (uint8_t)s[i];
        h *= 16777619u;
    }
    return h ^ (h >> 15);
}

static const char *tok_text(const tok_vocab *v, int32_t id, size_t *len) {
    *len = v->text_off[id + 1] - v->text_off[id];
    return v->text_arena + v->text_off[id];
}

/* Id of the token whose text is s[0..n), or -1. */
static int32_t vocab_find(const tok_vocab *v, const char *s, size_t n) {
    if (n > v->max_token_len) return -1;
    uint32_t mask = v->hash_cap - 1;
    for (uint32_t i = hash_bytes(s, n) & mask;; i = (i + 1) & mask) {
        int32_t id = v->hash_slots[i];
        if (id < 0) return -1;
        size_t tl;
        const char *t = tok_text(v, id, &tl);
        if (tl == n && memcmp(t, s, n) == 0) return id;
    }
}

/* Inserts id; a previous id with the same text is replaced (last wins). */
static void vocab_insert(tok_vocab *v, int32_t id) {
    size_t n;
    const char *s = tok_text(v, id, &n);
    uint32_t mask = v->hash_cap - 1;
    for (uint32_t i = hash_bytes(s, n) & mask;; i = (i + 1) & mask) {
        int32_t cur = v->hash_slots[i];
        if (cur < 0) {
            v->hash_slots[i] = id;
            return;
        }
        size_t tl;
        const char *t = tok_text(v, cur, &tl);
        if (tl == n && memcmp(t, s, n) == 0) {
            v->hash_slots[i] = id;
            return;
        }
    }
}

/* ---- loading -------------------------------------------------------------- */

static int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

/* Byte value of a "<0xNN>" text, or -1. */
static int parse_byte_token(const char *s, size_t n) {
    if (n != 6 || s[0] != '<' || s[1] != '0' || s[2] != 'x' || s[5] != '>') return -1;
    int hi = hex_digit(s[3]), lo = hex_digit(s[4]);
    if (hi < 0 || lo < 0) return -1;
    return hi * 16 + lo;
}

static bool is_int_type(enum gguf_vtype t) {
    switch (t) {
    case GGUF_VT_U8: case GGUF_VT_I8: case GGUF_VT_U16: case GGUF_VT_I16:
    case GGUF_VT_U32: case GGUF_VT_I32: case GGUF_VT_U64: case GGUF_VT_I64:
        return true;
    default:
        return false;
    }
}

/* Reads an optional token id: absent keeps *id; present must be < n_vocab.
 * A value of -1 / UINT32_MAX (as converters write for "none") sets -1. */
static int read_special_id(const gguf_ctx *g, const char *key, int32_t n_vocab, int32_t *id,
                           char *msg, size_t msg_cap) {
    const gguf_kv *kv = gguf_find_kv(g, key);
    if (!kv) return KVS_OK;
    if (!is_int_type(kv->type)) return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "%s: not an integer", key);
    bool is_signed = kv->type == GGUF_VT_I8 || kv->type == GGUF_VT_I16 || kv->type == GGUF_VT_I32 ||
                     kv->type == GGUF_VT_I64;
    if (is_signed ? kv->val.i == -1 : kv->val.u == UINT32_MAX || kv->val.u == UINT64_MAX) {
        *id = -1;
        return KVS_OK;
    }
    if (is_signed ? (kv->val.i < 0 || kv->val.i >= n_vocab) : kv->val.u >= (uint64_t)n_vocab)
        return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "%s: id out of range (vocab %d)", key, (int)n_vocab);
    *id = is_signed ? (int32_t)kv->val.i : (int32_t)kv->val.u;
    return KVS_OK;
}

typedef struct {
    uint32_t len; /* bytes of the token text */
    int32_t id;
} tok_user_key;

/* Longest text first, then lowest id (llama.cpp sorts by length only). */
static int cmp_user_key(const void *pa, const void *pb) {
    const tok_user_key *a = pa, *b = pb;
    if (a->len != b->len) return a->len > b->len ? -1 : 1;
    return a->id < b->id ? -1 : (a->id > b->id);
}

/* The one builder behind tok_from_arrays and tok_from_gguf: validates a (design note 1: copies
 * everything) and builds the lookup structures. */
int tok_from_arrays(const tok_arrays *a, tok_vocab **out, char *msg, size_t msg_cap) {
    if (!out) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "out is NULL");
    *out = NULL;
    if (!a || !a->texts || !a->text_lens) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "token arrays are NULL");
    if (a->n_vocab <= 0 || a->n_vocab > TOK_MAX_VOCAB)
        return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "bad vocab size %d", (int)a->n_vocab);
    const int32_t n = a->n_vocab;
    const int32_t *special[3] = {&a->bos, &a->eos, &a->unk};
    static const char *const special_name[3] = {"bos", "eos", "unknown"};
    for (int i = 0; i < 3; i++)
        if (*special[i] < -1 || *special[i] >= n)
            return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "%s token id %d out of range (vocab %d)", special_name[i],
                            (int)*special[i], (int)n);

    uint64_t text_bytes = 0;
    uint32_t max_len = 0;
    for (int32_t i = 0; i < n; i++) {
        uint32_t l = a->text_lens[i];
        if (l > TOK_MAX_TOKEN_BYTES)
            return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "token %d: text of %u bytes", (int)i, (unsigned)l);
        if (l > 0 && !a->texts[i]) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "token %d: text is NULL", (int)i);
        text_bytes += l; /* <= 2^24 * 4096: no overflow */
        if (l > max_len) max_len = l;
    }
    if (text_bytes > UINT32_MAX) return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "token texts too large");

    int rc;
    tok_vocab *v = calloc(1, sizeof *v);
    if (!v) return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
    v->n_vocab = n;
    v->max_token_len = max_len;
    v->hash_cap = 1;
    while (v->hash_cap < 2u * (uint32_t)n) v->hash_cap <<= 1;
    v->text_arena = malloc(text_bytes ? (size_t)text_bytes : 1);
    v->text_off = malloc(((size_t)n + 1) * sizeof *v->text_off);
    v->scores = malloc((size_t)n * sizeof *v->scores);
    v->types = malloc((size_t)n);
    v->hash_slots = malloc((size_t)v->hash_cap * sizeof *v->hash_slots);
    v->user_ids = malloc((size_t)n * sizeof *v->user_ids);
    if (!v->text_arena || !v->text_off || !v->scores || !v->types || !v->hash_slots || !v->user_ids) {
        rc = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
        goto fail;
    }

    uint32_t off = 0;
    for (int32_t i = 0; i < n; i++) {
        uint32_t l = a->text_lens[i];
        v->text_off[i] = off;
        if (l) memcpy(v->text_arena + off, a->texts[i], l);
        off += l;
        v->scores[i] = a->scores ? a->scores[i] : 0.0f;
        int32_t t = a->types ? a->types[i] : TOK_TYPE_NORMAL;
        if (t < TOK_TYPE_NORMAL || t > TOK_TYPE_BYTE) t = TOK_TYPE_NORMAL - 1; /* "undefined" (0) */
        v->types[i] = (uint8_t)t;
    }
    v->text_off[n] = off;

    for (uint32_t i = 0; i < v->hash_cap; i++) v->hash_slots[i] = -1;
    for (int32_t i = 0; i < n; i++) vocab_insert(v, i);

    for (int i = 0; i < 256; i++) v->byte_tok[i] = -1;
    for (int32_t i = 0; i < n; i++) {
        if (v->types[i] != TOK_TYPE_BYTE) continue;
        size_t l;
        const char *s = tok_text(v, i, &l);
        int b = parse_byte_token(s, l);
        if (b < 0) {
            rc = kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "byte token %d has text '%.*s', not <0xNN>", (int)i,
                          (int)(l > 32 ? 32 : l), s);
            goto fail;
        }
    }
    /* Byte fallback looks the text up (as llama.cpp does), so a duplicate resolves
     * the same way as any other lookup; a vocab without "<0xNN>" may still hold
     * the raw byte as a one-byte token. */
    for (int b = 0; b < 256; b++) {
        static const char hex[] = "0123456789ABCDEF";
        char buf[6] = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>'};
        int32_t id = vocab_find(v, buf, 6);
        if (id < 0) {
            char c = (char)b;
            id = vocab_find(v, &c, 1);
        }
        v->byte_tok[b] = id;
    }

    v->n_user = 0;
    for (int32_t i = 0; i < n; i++)
        if (v->types[i] == TOK_TYPE_USER_DEFINED && v->text_off[i + 1] > v->text_off[i]) v->n_user++;
    if (v->n_user > 0) {
        tok_user_key *keys = malloc((size_t)v->n_user * sizeof *keys);
        if (!keys) {
            rc = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
            goto fail;
        }
        int32_t k = 0;
        for (int32_t i = 0; i < n; i++) {
            uint32_t l = v->text_off[i + 1] - v->text_off[i];
            if (v->types[i] == TOK_TYPE_USER_DEFINED && l > 0) keys[k++] = (tok_user_key){l, i};
        }
        qsort(keys, (size_t)k, sizeof *keys, cmp_user_key);
        for (int32_t i = 0; i < k; i++) v->user_ids[i] = keys[i].id;
        free(keys);
    }

    v->bos = a->bos;
    v->eos = a->eos;
    v->unk = a->unk;
    v->add_space_prefix = a->add_space_prefix;
    *out = v;
    return KVS_OK;

fail:
    tok_free(v);
    return rc;
}

int tok_from_gguf(const gguf_ctx *g, tok_vocab **out, char *msg, size_t msg_cap) {
    if (!out) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "out is NULL");
    *out = NULL;
    if (!g) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "gguf ctx is NULL");

    gguf_str model;
    int rc = gguf_get_str(g, "tokenizer.ggml.model", &model);
    if (rc == KVS_ERR_NOT_FOUND)
        return kvs_fail(msg, msg_cap, KVS_ERR_UNSUPPORTED, "no tokenizer.ggml.model in the file");
    if (rc != KVS_OK) return kvs_fail(msg, msg_cap, rc, "tokenizer.ggml.model: not a string");
    if (!gguf_str_eq(model, "llama"))
        return kvs_fail(msg, msg_cap, KVS_ERR_UNSUPPORTED, "tokenizer model '%.*s' is not supported (only 'llama')",
                        (int)(model.len > 64 ? 64 : model.len), model.ptr);

    const gguf_kv *ktok = gguf_find_kv(g, "tokenizer.ggml.tokens");
    if (!ktok) return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "tokenizer.ggml.tokens missing");
    if (ktok->type != GGUF_VT_ARRAY || ktok->arr_type != GGUF_VT_STRING || !ktok->arr_strs)
        return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "tokenizer.ggml.tokens: not a string array");
    if (ktok->arr_n == 0 || ktok->arr_n > TOK_MAX_VOCAB)
        return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "tokenizer.ggml.tokens: bad count %llu",
                        (unsigned long long)ktok->arr_n);
    const int32_t n = (int32_t)ktok->arr_n;

    const gguf_kv *kscore = gguf_find_kv(g, "tokenizer.ggml.scores");
    if (kscore && (kscore->type != GGUF_VT_ARRAY || kscore->arr_n != ktok->arr_n ||
                   !(kscore->arr_type == GGUF_VT_F32 || kscore->arr_type == GGUF_VT_F64)))
        return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "tokenizer.ggml.scores: not a float array of %d", (int)n);
    const gguf_kv *ktype = gguf_find_kv(g, "tokenizer.ggml.token_type");
    if (ktype && (ktype->type != GGUF_VT_ARRAY || ktype->arr_n != ktok->arr_n || !is_int_type(ktype->arr_type)))
        return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "tokenizer.ggml.token_type: not an int array of %d", (int)n);

    tok_arrays a = {.n_vocab = n, .bos = n > 1 ? 1 : -1, .eos = n > 2 ? 2 : -1, .unk = 0, .add_space_prefix = true};
    if ((rc = read_special_id(g, "tokenizer.ggml.bos_token_id", n, &a.bos, msg, msg_cap)) != KVS_OK) return rc;
    if ((rc = read_special_id(g, "tokenizer.ggml.eos_token_id", n, &a.eos, msg, msg_cap)) != KVS_OK) return rc;
    if ((rc = read_special_id(g, "tokenizer.ggml.unknown_token_id", n, &a.unk, msg, msg_cap)) != KVS_OK) return rc;
    const gguf_kv *ksp = gguf_find_kv(g, "tokenizer.ggml.add_space_prefix");
    if (ksp) {
        if (ksp->type != GGUF_VT_BOOL)
            return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "tokenizer.ggml.add_space_prefix: not a bool");
        a.add_space_prefix = ksp->val.b;
    }

    /* Texts are borrowed from the mapping; scores and types are converted from whatever
     * element type the file uses. tok_from_arrays copies all of it. */
    const char **texts = malloc((size_t)n * sizeof *texts);
    uint32_t *lens = malloc((size_t)n * sizeof *lens);
    float *scores = kscore ? malloc((size_t)n * sizeof *scores) : NULL;
    int32_t *types = ktype ? malloc((size_t)n * sizeof *types) : NULL;
    if (!texts || !lens || (kscore && !scores) || (ktype && !types)) {
        rc = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
        goto done;
    }
    for (int32_t i = 0; i < n; i++) {
        gguf_str s = ktok->arr_strs[i];
        if (s.len > TOK_MAX_TOKEN_BYTES) {
            rc = kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "token %d: text of %llu bytes", (int)i,
                          (unsigned long long)s.len);
            goto done;
        }
        texts[i] = s.ptr;
        lens[i] = (uint32_t)s.len;
        if (scores) scores[i] = gguf_arr_f32(kscore, (uint64_t)i);
        if (types) {
            int64_t t = gguf_arr_i64(ktype, (uint64_t)i);
            types[i] = t < TOK_TYPE_NORMAL || t > TOK_TYPE_BYTE ? 0 : (int32_t)t;
        }
    }
    a.texts = texts;
    a.text_lens = lens;
    a.scores = scores;
    a.types = types;
    rc = tok_from_arrays(&a, out, msg, msg_cap);

done:
    free(texts);
    free(lens);
    free(scores);
    free(types);
    return rc;
}

void tok_free(tok_vocab *v) {
    if (!v) return;
    free(v->text_arena);
    free(v->text_off);
    free(v->scores);
    free(v->types);
    free(v->hash_slots);
    free(v->user_ids);
    free(v);
}

int32_t tok_n_vocab(const tok_vocab *v) { return v ? v->n_vocab : 0; }
int32_t tok_bos(const tok_vocab *v) { return v ? v->bos : -1; }
int32_t tok_eos(const tok_vocab *v) { return v ? v->eos : -1; }

/* ---- encoding ------------------------------------------------------------- */

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
    int32_t *ids;         /* caller's output */
    int max_ids;
    size_t n_out;         /* ids produced so far (may exceed max_ids) */
} tok_work;

static void emit(tok_work *w, int32_t id) {
    if (w->n_out < (size_t)w->max_ids) w->ids[w->n_out] = id;
    w->n_out++;
}

/* a pops before b: higher score, then leftmost. */
static bool bigram_above(const tok_bigram *a, const tok_bigram *b) {
    return a->score > b->score || (a->score == b->score && a->left < b->left);
}

static int heap_push(tok_work *w, tok_bigram b) {
    if (w->heap_n == w->heap_cap) {
        size_t cap = w->heap_cap ? w->heap_cap * 2 : 64;
        tok_bigram *h = realloc(w->heap, cap * sizeof *h);
        if (!h) return KVS_ERR_NOMEM;
        w->heap = h;
        w->heap_cap = cap;
    }
    size_t i = w->heap_n++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!bigram_above(&b, &w->heap[parent])) break;
        w->heap[i] = w->heap[parent];
        i = parent;
    }
    w->heap[i] = b;
    return KVS_OK;
}

static tok_bigram heap_pop(tok_work *w) {
    tok_bigram top = w->heap[0];
    tok_bigram last = w->heap[--w->heap_n];
    size_t n = w->heap_n, i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = l;
        if (l >= n) break;
        if (r < n && bigram_above(&w->heap[r], &w->heap[l])) m = r;
        if (!bigram_above(&w->heap[m], &last)) break;
        w->heap[i] = w->heap[m];
        i = m;
    }
    if (n > 0) w->heap[i] = last;
    return top;
}

static int try_add_bigram(const tok_vocab *v, tok_work *w, int32_t left, int32_t right) {
    if (left < 0 || right < 0) return KVS_OK;
    const tok_symbol *l = &w->sym[left], *r = &w->sym[right];
    int32_t size = l->n + r->n; /* adjacent: r starts where l ends */
    int32_t id = vocab_find(v, w->text + l->start, (size_t)size);
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
        int32_t id = vocab_find(v, w->text + s->start, (size_t)s->n);
        if (id >= 0) {
            emit(w, id);
            continue;
        }
        for (int32_t j = 0; j < s->n; j++) {
            int32_t bt = v->byte_tok[(uint8_t)w->text[s->start + j]];
            emit(w, bt >= 0 ? bt : v->unk);
        }
    }
    return KVS_OK;
}

/* Position of the first occurrence of needle in hay[0..hn), or hn. */
static size_t find_bytes(const char *hay, size_t hn, const char *needle, size_t nn) {
    if (nn == 0 || nn > hn) return hn;
    const char *p = hay, *end = hay + hn - nn + 1;
    while (p < end) {
        p = memchr(p, needle[0], (size_t)(end - p));
        if (!p) return hn;
        if (memcmp(p, needle, nn) == 0) return (size_t)(p - hay);
        p++;
    }
    return hn;
}

/* Splits text[0..len) at user-defined tokens (design note 3a), in the order
 * llama.cpp's tokenizer_st_partition would: each user token in turn (longest
 * first) splits every raw fragment left so far, left to right. Fragments are
 * (start, len, id) with id -1 for raw text. */
typedef struct {
    size_t start, len;
    int32_t id;
} tok_fragment;

static int partition_user_tokens(const tok_vocab *v, const char *text, size_t len, tok_fragment **out,
                                 size_t *n_out) {
    size_t cap = 16, n = 1;
    tok_fragment *f = malloc(cap * sizeof *f);
    if (!f) return KVS_ERR_NOMEM;
    f[0] = (tok_fragment){0, len, -1};
    for (int32_t u = 0; u < v->n_user; u++) {
        size_t tl;
        const char *tt = tok_text(v, v->user_ids[u], &tl);
        for (size_t i = 0; i < n; i++) {
            if (f[i].id >= 0) continue;
            size_t pos = find_bytes(text + f[i].start, f[i].len, tt, tl);
            if (pos == f[i].len) continue;
            /* Replace f[i] by [left raw][token][right raw]; the right part is
             * searched again on the next iterations of i. */
            if (n + 2 > cap) {
                tok_fragment *g = realloc(f, cap * 2 * sizeof *f);
                if (!g) {
                    free(f);
                    return KVS_ERR_NOMEM;
                }
                f = g;
                cap *= 2;
            }
            tok_fragment cur = f[i], rep[3];
            size_t r = 0, rest = cur.len - pos - tl;
            if (pos > 0) rep[r++] = (tok_fragment){cur.start, pos, -1};
            rep[r++] = (tok_fragment){cur.start + pos, tl, v->user_ids[u]};
            if (rest > 0) rep[r++] = (tok_fragment){cur.start + pos + tl, rest, -1};
            memmove(&f[i + r], &f[i + 1], (n - i - 1) * sizeof *f);
            memcpy(&f[i], rep, r * sizeof *f);
            n += r - 1;
            /* Continue with the right remainder (searched again for the same token),
             * or with the fragment after the token when nothing remains. */
            i += rest > 0 ? r - 2 : r - 1;
        }
    }
    *out = f;
    *n_out = n;
    return KVS_OK;
}

int tok_encode(const tok_vocab *v, const char *text, size_t len, bool add_bos, int32_t *ids, int max_ids,
               int *n_ids) {
    if (n_ids) *n_ids = 0;
    if (!v || !n_ids || (!text && len > 0) || max_ids < 0 || (!ids && max_ids > 0)) return KVS_ERR_INVALID_ARG;
    /* Escaped offsets are int32: each byte may become 3, plus the prefix. */
    if (len > (size_t)(INT32_MAX - 3) / 3) return KVS_ERR_INVALID_ARG;
    if (add_bos && v->bos < 0) return KVS_ERR_UNSUPPORTED;

    tok_work w = {0};
    w.ids = ids;
    w.max_ids = max_ids;
    tok_fragment *frags = NULL;
    size_t n_frags = 0;
    int rc = KVS_OK;

    if (add_bos) emit(&w, v->bos);
    if (len > 0) {
        w.text = malloc(3 * len + 3);
        if (!w.text) {
            rc = KVS_ERR_NOMEM;
            goto done;
        }
        if ((rc = partition_user_tokens(v, text, len, &frags, &n_frags)) != KVS_OK) goto done;
        bool prev_special = true;
        for (size_t i = 0; i < n_frags; i++) {
            if (frags[i].id >= 0) {
                emit(&w, frags[i].id);
                prev_special = true;
                continue;
            }
            rc = encode_fragment(v, &w, text + frags[i].start, frags[i].len, v->add_space_prefix && prev_special);
            if (rc != KVS_OK) goto done;
            prev_special = false;
        }
    }
    if (w.n_out > (size_t)INT_MAX) {
        rc = KVS_ERR_TOO_LARGE;
        *n_ids = INT_MAX;
        goto done;
    }
    *n_ids = (int)w.n_out;
    if (w.n_out > (size_t)max_ids) rc = KVS_ERR_TOO_LARGE;

done:
    free(frags);
    free(w.text);
    free(w.sym);
    free(w.heap);
    return rc;
}

/* ---- decoding ------------------------------------------------------------- */

static void put_bytes(char *buf, size_t cap, size_t *len, const char *s, size_t n) {
    if (*len < cap) {
        size_t k = cap - *len < n ? cap - *len : n;
        memcpy(buf + *len, s, k);
    }
    *len += n;
}

int tok_piece(const tok_vocab *v, int32_t id, char *buf, size_t cap, size_t *len) {
    if (len) *len = 0;
    if (!v || !len || (!buf && cap > 0)) return KVS_ERR_INVALID_ARG;
    if (id < 0 || id >= v->n_vocab) return KVS_ERR_INVALID_ARG;
    size_t tl;
    const char *t = tok_text(v, id, &tl);
    switch (v->types[id]) {
    case TOK_TYPE_NORMAL:
        for (size_t i = 0; i < tl;) {
            if (tl - i >= 3 && memcmp(t + i, "\xE2\x96\x81", 3) == 0) {
                put_bytes(buf, cap, len, " ", 1);
                i += 3;
            } else {
                put_bytes(buf, cap, len, t + i, 1);
                i++;
            }
        }
        return KVS_OK;
    case TOK_TYPE_USER_DEFINED:
        put_bytes(buf, cap, len, t, tl); /* verbatim, as llama.cpp does */
        return KVS_OK;
    case TOK_TYPE_BYTE: {
        char b = (char)parse_byte_token(t, tl); /* validated at load */
        put_bytes(buf, cap, len, &b, 1);
        return KVS_OK;
    }
    default: /* control, unknown, unused, undefined: no text */
        return KVS_OK;
    }
}

/* ---- raw entries (serving the vocab over the wire) ----------------------- */

const char *tok_token_text(const tok_vocab *v, int32_t id, size_t *len) {
    if (id < 0 || id >= v->n_vocab) {
        *len = 0;
        return NULL;
    }
    return tok_text(v, id, len);
}

float tok_token_score(const tok_vocab *v, int32_t id) { return id >= 0 && id < v->n_vocab ? v->scores[id] : 0.0f; }

int32_t tok_token_type(const tok_vocab *v, int32_t id) { return id >= 0 && id < v->n_vocab ? v->types[id] : 0; }

bool tok_add_space_prefix(const tok_vocab *v) { return v->add_space_prefix; }
