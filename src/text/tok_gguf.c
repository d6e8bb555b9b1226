/*
 * tok_gguf — tok_from_gguf: reads the tokenizer metadata of a GGUF file into a tok_arrays
 * (texts borrowed from the mapping, scores and types converted from the file's element
 * types) and builds the vocab with tok_from_arrays, the one builder (tokenizer.c).
 */
#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer.h"
#include "util.h"
#include "vocab.h"

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


/* Copies a GGUF string into a new NUL-terminated buffer (*out; NULL when kv is absent). */
static int dup_gguf_str(const gguf_kv *kv, const char *key, size_t max, char **out, char *msg, size_t msg_cap) {
    *out = NULL;
    if (!kv) return KVS_OK;
    if (kv->type != GGUF_VT_STRING) return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "%s: not a string", key);
    if (kv->str.len > max)
        return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "%s: %llu bytes, over the limit of %zu", key,
                        (unsigned long long)kv->str.len, max);
    if (memchr(kv->str.ptr, 0, (size_t)kv->str.len))
        return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "%s: NUL byte in the string", key);
    char *s = malloc((size_t)kv->str.len + 1);
    if (!s) return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
    if (kv->str.len) memcpy(s, kv->str.ptr, (size_t)kv->str.len);
    s[kv->str.len] = 0;
    *out = s;
    return KVS_OK;
}

/* The metadata entries of the tokenizer, found and checked against each other. */
typedef struct {
    tok_kind kind;
    const gguf_kv *tokens;  /* tokenizer.ggml.tokens: string array of 1..TOK_MAX_VOCAB */
    const gguf_kv *scores;  /* tokenizer.ggml.scores: NULL or a float array, one per token */
    const gguf_kv *types;   /* tokenizer.ggml.token_type: NULL or an int array, one per token */
    const gguf_kv *merges;  /* tokenizer.ggml.merges: BPE only, string array of <= TOK_MAX_MERGES */
} tok_gguf_keys;

/* tokenizer.ggml.model -> the family. KVS_ERR_UNSUPPORTED when absent or unknown. */
static int read_kind(const gguf_ctx *g, tok_kind *kind, char *msg, size_t msg_cap) {
    gguf_str model;
    int rc = gguf_get_str(g, "tokenizer.ggml.model", &model);
    if (rc == KVS_ERR_NOT_FOUND)
        return kvs_fail(msg, msg_cap, KVS_ERR_UNSUPPORTED, "no tokenizer.ggml.model in the file");
    if (rc != KVS_OK) return kvs_fail(msg, msg_cap, rc, "tokenizer.ggml.model: not a string");
    if (gguf_str_eq(model, "llama")) *kind = TOK_KIND_SPM;
    else if (gguf_str_eq(model, "gpt2")) *kind = TOK_KIND_BPE;
    else
        return kvs_fail(msg, msg_cap, KVS_ERR_UNSUPPORTED, "tokenizer.ggml.model '%.*s' is not supported (llama, gpt2)",
                        (int)(model.len > 64 ? 64 : model.len), model.ptr);
    return KVS_OK;
}

/* Finds the token table's arrays (k->kind set) and checks their types and counts. */
static int find_arrays(const gguf_ctx *g, tok_gguf_keys *k, char *msg, size_t msg_cap) {
    const gguf_kv *ktok = gguf_find_kv(g, "tokenizer.ggml.tokens");
    if (!ktok || ktok->type != GGUF_VT_ARRAY || ktok->arr_type != GGUF_VT_STRING)
        return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "tokenizer.ggml.tokens: missing or not a string array");
    if (ktok->arr_n == 0 || ktok->arr_n > TOK_MAX_VOCAB)
        return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "tokenizer.ggml.tokens: bad count %llu",
                        (unsigned long long)ktok->arr_n);
    const int32_t n = (int32_t)ktok->arr_n;
    k->tokens = ktok;

    const gguf_kv *kscore = gguf_find_kv(g, "tokenizer.ggml.scores");
    if (kscore && (kscore->type != GGUF_VT_ARRAY || kscore->arr_n != ktok->arr_n ||
                   !(kscore->arr_type == GGUF_VT_F32 || kscore->arr_type == GGUF_VT_F64)))
        return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "tokenizer.ggml.scores: not a float array of %d", (int)n);
    k->scores = kscore;
    const gguf_kv *ktype = gguf_find_kv(g, "tokenizer.ggml.token_type");
    if (ktype && (ktype->type != GGUF_VT_ARRAY || ktype->arr_n != ktok->arr_n || !is_int_type(ktype->arr_type)))
        return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "tokenizer.ggml.token_type: not an int array of %d", (int)n);
    k->types = ktype;
    k->merges = NULL;
    if (k->kind == TOK_KIND_BPE) {
        const gguf_kv *kmerges = gguf_find_kv(g, "tokenizer.ggml.merges");
        if (!kmerges || kmerges->type != GGUF_VT_ARRAY || kmerges->arr_type != GGUF_VT_STRING)
            return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "tokenizer.ggml.merges: missing or not a string array");
        if (kmerges->arr_n > TOK_MAX_MERGES)
            return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "tokenizer.ggml.merges: %llu merges, over the limit",
                            (unsigned long long)kmerges->arr_n);
        k->merges = kmerges;
    }
    return KVS_OK;
}

/* The special token ids and the BOS / space-prefix settings into a (n_vocab and kind set):
 * the family's defaults, then what the file says. */
static int read_specials(const gguf_ctx *g, tok_arrays *a, char *msg, size_t msg_cap) {
    const int32_t n = a->n_vocab;
    int rc;
    if (a->kind == TOK_KIND_SPM) {
        a->bos = n > 1 ? 1 : -1;
        a->eos = n > 2 ? 2 : -1;
        a->unk = 0;
        a->add_space_prefix = true;
    } else {
        a->bos = a->eos = a->unk = -1;
    }
    if ((rc = read_special_id(g, "tokenizer.ggml.bos_token_id", n, &a->bos, msg, msg_cap)) != KVS_OK) return rc;
    if ((rc = read_special_id(g, "tokenizer.ggml.eos_token_id", n, &a->eos, msg, msg_cap)) != KVS_OK) return rc;
    if ((rc = read_special_id(g, "tokenizer.ggml.unknown_token_id", n, &a->unk, msg, msg_cap)) != KVS_OK) return rc;
    gguf_str name;
    if (gguf_get_str(g, "general.name", &name) == KVS_OK) { /* llama.cpp: lower-cased name contains phi-3 / phi3 */
        char low[256];
        size_t nl = name.len < sizeof low - 1 ? name.len : sizeof low - 1;
        for (size_t i = 0; i < nl; i++) low[i] = (char)tolower((unsigned char)name.ptr[i]);
        low[nl] = 0;
        a->rstrip_specials = strstr(low, "phi-3") || strstr(low, "phi3");
    }
    const gguf_kv *ksp = gguf_find_kv(g, "tokenizer.ggml.add_space_prefix");
    if (ksp) {
        if (ksp->type != GGUF_VT_BOOL)
            return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "tokenizer.ggml.add_space_prefix: not a bool");
        a->add_space_prefix = ksp->val.b;
    }
    const gguf_kv *kbos = gguf_find_kv(g, "tokenizer.ggml.add_bos_token");
    if (kbos) {
        if (kbos->type != GGUF_VT_BOOL)
            return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "tokenizer.ggml.add_bos_token: not a bool");
        a->add_bos = kbos->val.b ? 1 : -1;
    }
    return KVS_OK;
}

/* The arrays a tok_arrays points into while tok_from_gguf runs (all owned here; the texts
 * they hold are borrowed from the mapping). */
typedef struct {
    const char **texts;
    uint32_t *lens;
    float *scores;
    int32_t *types;
    const char **merges;
    uint32_t *merge_lens;
    char *pre, *tmpl;
} tok_gguf_bufs;

static void bufs_free(tok_gguf_bufs *b) {
    free(b->texts);
    free(b->lens);
    free(b->scores);
    free(b->types);
    free(b->merges);
    free(b->merge_lens);
    free(b->pre);
    free(b->tmpl);
}

/* Allocates b for n tokens and k's arrays. KVS_OK or KVS_ERR_NOMEM (b's allocations stay
 * for bufs_free). */
static int bufs_alloc(tok_gguf_bufs *b, const tok_gguf_keys *k, int32_t n, char *msg, size_t msg_cap) {
    b->texts = malloc((size_t)n * sizeof *b->texts);
    b->lens = malloc((size_t)n * sizeof *b->lens);
    b->scores = k->scores ? malloc((size_t)n * sizeof *b->scores) : NULL;
    b->types = k->types ? malloc((size_t)n * sizeof *b->types) : NULL;
    size_t n_merges = k->merges ? (size_t)k->merges->arr_n : 0;
    b->merges = n_merges ? malloc(n_merges * sizeof *b->merges) : NULL;
    b->merge_lens = n_merges ? malloc(n_merges * sizeof *b->merge_lens) : NULL;
    if (!b->texts || !b->lens || (k->scores && !b->scores) || (k->types && !b->types) ||
        (n_merges && (!b->merges || !b->merge_lens)))
        return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
    return KVS_OK;
}

/* The token table: texts borrowed from the mapping, scores and types converted from
 * whatever element type the file uses (a type out of 1..6 reads as undefined). */
static int read_tokens(const tok_gguf_keys *k, int32_t n, tok_gguf_bufs *b, char *msg, size_t msg_cap) {
    for (int32_t i = 0; i < n; i++) {
        gguf_str s = k->tokens->arr_strs[i];
        if (s.len > TOK_MAX_TOKEN_BYTES)
            return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "token %d: text of %llu bytes", (int)i,
                            (unsigned long long)s.len);
        b->texts[i] = s.ptr;
        b->lens[i] = (uint32_t)s.len;
        if (b->scores) b->scores[i] = gguf_arr_f32(k->scores, (uint64_t)i);
        if (b->types) {
            int64_t t = gguf_arr_i64(k->types, (uint64_t)i);
            b->types[i] = t < TOK_TYPE_NORMAL || t > TOK_TYPE_BYTE ? 0 : (int32_t)t;
        }
    }
    return KVS_OK;
}

/* BPE merges "left right" in rank order, borrowed from the mapping. */
static int read_merges(const tok_gguf_keys *k, tok_gguf_bufs *b, char *msg, size_t msg_cap) {
    size_t n_merges = k->merges ? (size_t)k->merges->arr_n : 0;
    for (size_t i = 0; i < n_merges; i++) {
        gguf_str s = k->merges->arr_strs[i];
        if (s.len > 2 * TOK_MAX_TOKEN_BYTES + 1)
            return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "merge %zu: %llu bytes", i, (unsigned long long)s.len);
        b->merges[i] = s.ptr;
        b->merge_lens[i] = (uint32_t)s.len;
    }
    return KVS_OK;
}

int tok_from_gguf(const gguf_ctx *g, tok_vocab **out, char *msg, size_t msg_cap) {
    if (!out) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "out is NULL");
    *out = NULL;
    if (!g) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "gguf ctx is NULL");

    tok_gguf_keys k = {0};
    int rc = read_kind(g, &k.kind, msg, msg_cap);
    if (rc == KVS_OK) rc = find_arrays(g, &k, msg, msg_cap);
    if (rc != KVS_OK) return rc;
    tok_arrays a = {.n_vocab = (int32_t)k.tokens->arr_n, .kind = k.kind};
    if ((rc = read_specials(g, &a, msg, msg_cap)) != KVS_OK) return rc;

    /* tok_from_arrays copies everything a points to, so b is freed right after. */
    tok_gguf_bufs b = {0};
    if ((rc = bufs_alloc(&b, &k, a.n_vocab, msg, msg_cap)) != KVS_OK) goto done;
    if (k.kind == TOK_KIND_BPE &&
        (rc = dup_gguf_str(gguf_find_kv(g, "tokenizer.ggml.pre"), "tokenizer.ggml.pre", TOK_MAX_PRE, &b.pre, msg,
                           msg_cap)) != KVS_OK)
        goto done;
    if ((rc = dup_gguf_str(gguf_find_kv(g, "tokenizer.chat_template"), "tokenizer.chat_template", TOK_MAX_TEMPLATE,
                           &b.tmpl, msg, msg_cap)) != KVS_OK)
        goto done;
    if ((rc = read_tokens(&k, a.n_vocab, &b, msg, msg_cap)) != KVS_OK) goto done;
    if ((rc = read_merges(&k, &b, msg, msg_cap)) != KVS_OK) goto done;
    a.texts = b.texts;
    a.text_lens = b.lens;
    a.scores = b.scores;
    a.types = b.types;
    a.pre = b.pre;
    a.merges = b.merges;
    a.merge_lens = b.merge_lens;
    a.n_merges = k.merges ? (int32_t)k.merges->arr_n : 0;
    a.chat_template = b.tmpl;
    rc = tok_from_arrays(&a, out, msg, msg_cap);

done:
    bufs_free(&b);
    return rc;
}
