/*
 * tok_gguf — tok_from_gguf: reads the tokenizer metadata of a GGUF file into a tok_arrays
 * (texts borrowed from the mapping, scores and types converted from the file's element
 * types) and builds the vocab with tok_from_arrays, the one builder (tokenizer.c).
 */
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

int tok_from_gguf(const gguf_ctx *g, tok_vocab **out, char *msg, size_t msg_cap) {
    if (!out) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "out is NULL");
    *out = NULL;
    if (!g) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "gguf ctx is NULL");

    gguf_str model;
    int rc = gguf_get_str(g, "tokenizer.ggml.model", &model);
    if (rc == KVS_ERR_NOT_FOUND)
        return kvs_fail(msg, msg_cap, KVS_ERR_UNSUPPORTED, "no tokenizer.ggml.model in the file");
    if (rc != KVS_OK) return kvs_fail(msg, msg_cap, rc, "tokenizer.ggml.model: not a string");
    tok_kind kind;
    if (gguf_str_eq(model, "llama")) kind = TOK_KIND_SPM;
    else if (gguf_str_eq(model, "gpt2")) kind = TOK_KIND_BPE;
    else
        return kvs_fail(msg, msg_cap, KVS_ERR_UNSUPPORTED, "tokenizer.ggml.model '%.*s' is not supported (llama, gpt2)",
                        (int)(model.len > 64 ? 64 : model.len), model.ptr);

    const gguf_kv *ktok = gguf_find_kv(g, "tokenizer.ggml.tokens");
    if (!ktok || ktok->type != GGUF_VT_ARRAY || ktok->arr_type != GGUF_VT_STRING)
        return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "tokenizer.ggml.tokens: missing or not a string array");
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
    const gguf_kv *kmerges = NULL;
    if (kind == TOK_KIND_BPE) {
        kmerges = gguf_find_kv(g, "tokenizer.ggml.merges");
        if (!kmerges || kmerges->type != GGUF_VT_ARRAY || kmerges->arr_type != GGUF_VT_STRING)
            return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "tokenizer.ggml.merges: missing or not a string array");
        if (kmerges->arr_n > TOK_MAX_MERGES)
            return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "tokenizer.ggml.merges: %llu merges, over the limit",
                            (unsigned long long)kmerges->arr_n);
    }

    tok_arrays a = {.n_vocab = n, .kind = kind};
    if (kind == TOK_KIND_SPM) {
        a.bos = n > 1 ? 1 : -1;
        a.eos = n > 2 ? 2 : -1;
        a.unk = 0;
        a.add_space_prefix = true;
    } else {
        a.bos = a.eos = a.unk = -1;
    }
    if ((rc = read_special_id(g, "tokenizer.ggml.bos_token_id", n, &a.bos, msg, msg_cap)) != KVS_OK) return rc;
    if ((rc = read_special_id(g, "tokenizer.ggml.eos_token_id", n, &a.eos, msg, msg_cap)) != KVS_OK) return rc;
    if ((rc = read_special_id(g, "tokenizer.ggml.unknown_token_id", n, &a.unk, msg, msg_cap)) != KVS_OK) return rc;
    const gguf_kv *ksp = gguf_find_kv(g, "tokenizer.ggml.add_space_prefix");
    if (ksp) {
        if (ksp->type != GGUF_VT_BOOL)
            return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "tokenizer.ggml.add_space_prefix: not a bool");
        a.add_space_prefix = ksp->val.b;
    }
    const gguf_kv *kbos = gguf_find_kv(g, "tokenizer.ggml.add_bos_token");
    if (kbos) {
        if (kbos->type != GGUF_VT_BOOL)
            return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "tokenizer.ggml.add_bos_token: not a bool");
        a.add_bos = kbos->val.b ? 1 : -1;
    }

    /* Texts are borrowed from the mapping; scores and types are converted from whatever
     * element type the file uses. tok_from_arrays copies all of it. */
    char *pre = NULL, *tmpl = NULL;
    const char **texts = malloc((size_t)n * sizeof *texts);
    uint32_t *lens = malloc((size_t)n * sizeof *lens);
    float *scores = kscore ? malloc((size_t)n * sizeof *scores) : NULL;
    int32_t *types = ktype ? malloc((size_t)n * sizeof *types) : NULL;
    size_t n_merges = kmerges ? (size_t)kmerges->arr_n : 0;
    const char **merges = n_merges ? malloc(n_merges * sizeof *merges) : NULL;
    uint32_t *merge_lens = n_merges ? malloc(n_merges * sizeof *merge_lens) : NULL;
    if (!texts || !lens || (kscore && !scores) || (ktype && !types) || (n_merges && (!merges || !merge_lens))) {
        rc = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
        goto done;
    }
    if (kind == TOK_KIND_BPE &&
        (rc = dup_gguf_str(gguf_find_kv(g, "tokenizer.ggml.pre"), "tokenizer.ggml.pre", TOK_MAX_PRE, &pre, msg,
                           msg_cap)) != KVS_OK)
        goto done;
    if ((rc = dup_gguf_str(gguf_find_kv(g, "tokenizer.chat_template"), "tokenizer.chat_template", TOK_MAX_TEMPLATE,
                           &tmpl, msg, msg_cap)) != KVS_OK)
        goto done;
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
    for (size_t i = 0; i < n_merges; i++) {
        gguf_str s = kmerges->arr_strs[i];
        if (s.len > 2 * TOK_MAX_TOKEN_BYTES + 1) {
            rc = kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "merge %zu: %llu bytes", i, (unsigned long long)s.len);
            goto done;
        }
        merges[i] = s.ptr;
        merge_lens[i] = (uint32_t)s.len;
    }
    a.texts = texts;
    a.text_lens = lens;
    a.scores = scores;
    a.types = types;
    a.pre = pre;
    a.merges = merges;
    a.merge_lens = merge_lens;
    a.n_merges = (int32_t)n_merges;
    a.chat_template = tmpl;
    rc = tok_from_arrays(&a, out, msg, msg_cap);

done:
    free(texts);
    free(lens);
    free(scores);
    free(types);
    free(merges);
    free(merge_lens);
    free(pre);
    free(tmpl);
    return rc;
}
