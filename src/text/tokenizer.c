/*
 * tokenizer — the interface over the tokenizer families (tok_spm, tok_bpe): building a
 * vocab from plain arrays, BOS and end-of-generation, special-token splitting, encode
 * dispatch and decoding. The token table itself is vocab.c; the GGUF reader is tok_gguf.c
 * (vocab.h has the file map).
 *
 * Design notes
 *  1. tok_from_arrays is the single builder: tok_from_gguf only reads the metadata into a
 *     tok_arrays, so a vocab that travelled over the wire is the same as one read from
 *     the file. The table it fills (texts, hash, specials, end-of-generation) is
 *     described in vocab.c.
 *  2. Encoding (tok_encode_ex): the text is split into fragments by each special token
 *     in turn (longest first), every raw fragment left so far, left to right — the order
 *     of llama.cpp's tokenizer_st_partition; control and unknown tokens take part only
 *     with parse_special. Raw fragments go to tok_spm_encode (which adds the leading
 *     space after a token or at the start) or tok_bpe_encode.
 *  3. Nothing here allocates global state; a vocab is read-only after creation and may
 *     be shared between threads.
 */
#include "tokenizer.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "tok_bpe.h"
#include "tok_impl.h"
#include "tok_spm.h"
#include "util.h"

/* The one builder behind tok_from_arrays and tok_from_gguf (design note 1). */
int tok_from_arrays(const tok_arrays *a, tok_vocab **out, char *msg, size_t msg_cap) {
    if (!out) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "out is NULL");
    *out = NULL;
    if (!a || !a->texts || !a->text_lens) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "token arrays are NULL");
    if (a->kind != TOK_KIND_SPM && a->kind != TOK_KIND_BPE)
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "unknown tokenizer kind %d", (int)a->kind);
    if (a->n_vocab <= 0 || a->n_vocab > TOK_MAX_VOCAB)
        return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "bad vocab size %d", (int)a->n_vocab);
    if (a->add_bos < -1 || a->add_bos > 1)
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "bad add_bos %d", (int)a->add_bos);
    const int32_t n = a->n_vocab;
    const int32_t *special[3] = {&a->bos, &a->eos, &a->unk};
    static const char *const special_name[3] = {"bos", "eos", "unknown"};
    for (int i = 0; i < 3; i++)
        if (*special[i] < -1 || *special[i] >= n)
            return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "%s token id %d out of range (vocab %d)", special_name[i],
                            (int)*special[i], (int)n);
    size_t tmpl_len = 0;
    if (a->chat_template) {
        tmpl_len = strnlen(a->chat_template, (size_t)TOK_MAX_TEMPLATE + 1);
        if (tmpl_len > TOK_MAX_TEMPLATE)
            return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "chat template over %u bytes", (unsigned)TOK_MAX_TEMPLATE);
    }
    if (a->kind == TOK_KIND_BPE) {
        if (a->n_merges < 0 || a->n_merges > TOK_MAX_MERGES)
            return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "bad merge count %d", (int)a->n_merges);
        if (a->n_merges > 0 && (!a->merges || !a->merge_lens))
            return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "merge arrays are NULL");
        if (a->pre && strnlen(a->pre, TOK_MAX_PRE + 1) > TOK_MAX_PRE)
            return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "pre-tokenizer name over %u bytes", (unsigned)TOK_MAX_PRE);
    }

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
    v->kind = a->kind;
    v->n_vocab = n;
    v->max_token_len = max_len;
    v->hash_cap = 1;
    while (v->hash_cap < 2u * (uint32_t)n) v->hash_cap <<= 1;
    v->text_arena = malloc(text_bytes ? (size_t)text_bytes : 1);
    v->text_off = malloc(((size_t)n + 1) * sizeof *v->text_off);
    v->scores = malloc((size_t)n * sizeof *v->scores);
    v->types = malloc((size_t)n);
    v->hash_slots = malloc((size_t)v->hash_cap * sizeof *v->hash_slots);
    if (!v->text_arena || !v->text_off || !v->scores || !v->types || !v->hash_slots) {
        rc = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
        goto fail;
    }
    if (a->chat_template) {
        v->chat_template = malloc(tmpl_len + 1);
        if (!v->chat_template) {
            rc = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
            goto fail;
        }
        memcpy(v->chat_template, a->chat_template, tmpl_len);
        v->chat_template[tmpl_len] = 0;
    }

    tok_vocab_fill(v, a);
    for (int i = 0; i < 256; i++) v->byte_tok[i] = -1;
    if (v->kind == TOK_KIND_SPM && (rc = tok_vocab_byte_tokens(v, msg, msg_cap)) != KVS_OK) goto fail;

    v->bos = a->bos;
    v->eos = a->eos;
    v->unk = a->unk;
    v->add_space_prefix = a->add_space_prefix;
    v->rstrip_specials = a->rstrip_specials;
    tok_vocab_mark_eog(v);
    if (tok_vocab_sort_specials(v) != KVS_OK) {
        rc = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
        goto fail;
    }
    if (v->kind == TOK_KIND_BPE &&
        (rc = tok_bpe_create(v, a->pre, a->merges, a->merge_lens, a->n_merges, &v->bpe, msg, msg_cap)) != KVS_OK)
        goto fail;
    v->add_bos_setting = a->add_bos;
    if (a->add_bos != 0) v->add_bos = a->add_bos > 0;
    else v->add_bos = v->kind == TOK_KIND_SPM || tok_bpe_default_add_bos(v->bpe);
    *out = v;
    return KVS_OK;

fail:
    tok_free(v);
    return rc;
}

void tok_free(tok_vocab *v) {
    if (!v) return;
    tok_bpe_free(v->bpe);
    free(v->text_arena);
    free(v->text_off);
    free(v->scores);
    free(v->types);
    free(v->hash_slots);
    free(v->special_ids);
    free(v->special_lens);
    free(v->chat_template);
    free(v);
}

int32_t tok_n_vocab(const tok_vocab *v) { return v ? v->n_vocab : 0; }
int32_t tok_bos(const tok_vocab *v) { return v ? v->bos : -1; }
int32_t tok_eos(const tok_vocab *v) { return v ? v->eos : -1; }
bool tok_add_bos(const tok_vocab *v) { return v && v->add_bos && v->bos >= 0; }
int8_t tok_add_bos_setting(const tok_vocab *v) { return v ? v->add_bos_setting : 0; }
bool tok_rstrip_specials(const tok_vocab *v) { return v && v->rstrip_specials; }
const char *tok_chat_template(const tok_vocab *v) { return v ? v->chat_template : NULL; }
tok_kind tok_vocab_kind(const tok_vocab *v) { return v ? v->kind : TOK_KIND_SPM; }
const char *tok_pre_name(const tok_vocab *v) { return v && v->bpe ? tok_bpe_pre(v->bpe) : ""; }
int32_t tok_n_merges(const tok_vocab *v) { return v && v->bpe ? tok_bpe_n_merges(v->bpe) : 0; }

bool tok_merge(const tok_vocab *v, int32_t rank, int32_t *left, int32_t *right) {
    return v && v->bpe && tok_bpe_merge(v->bpe, rank, left, right);
}

bool tok_is_eog(const tok_vocab *v, int32_t id) {
    if (!v || id < 0) return false;
    for (int i = 0; i < v->n_eog; i++)
        if (v->eog[i] == id) return true;
    return false;
}

/* ---- encoding (design note 2) --------------------------------------------- */

/* Position of the first occurrence of needle in hay[0..hn), or hn (glibc's memmem: a
 * two-way search, much faster than memchr + memcmp when the first byte is common, as '<'
 * is in code and every special token starts with it). */
static size_t find_bytes(const char *hay, size_t hn, const char *needle, size_t nn) {
    if (nn == 0 || nn > hn) return hn;
    const char *p = memmem(hay, hn, needle, nn);
    return p ? (size_t)(p - hay) : hn;
}

/* Fragments are (start, len, id) with id -1 for raw text. */
typedef struct {
    size_t start, len;
    int32_t id;
} tok_fragment;

/* For a long text: which special texts occur in it at all (present[id of the text] = 1), from
 * one pass over the positions whose byte can start one. A special text absent from the whole
 * text cannot split any fragment of it, so the partition skips it: same result, and the
 * hundreds of specials of a large vocab no longer each scan the text. NULL: no prefilter. */
static uint8_t *specials_present(const tok_vocab *v, const char *text, size_t len) {
    if (len < 4096 || v->n_special < 8) return NULL;
    uint8_t *present = calloc((size_t)v->n_vocab, 1);
    if (!present) return NULL; /* the unfiltered scan is as correct */
    for (size_t pos = 0; pos < len; pos++) {
        uint8_t c = (uint8_t)text[pos];
        if (!(v->special_first[c >> 3] & (1u << (c & 7)))) continue;
        for (int32_t k = 0; k < v->n_special_lens && v->special_lens[k] <= len - pos; k++) {
            int32_t id = tok_vocab_find(v, text + pos, v->special_lens[k]);
            if (id >= 0) present[id] = 1;
        }
    }
    return present;
}

/* Bytes of whitespace at the start of s[0..n) that special token sid strips
 * from its right (rstrip_specials), 0 when it strips none. */
static size_t rstrip_len(const tok_vocab *v, int32_t sid, const char *s, size_t n) {
    static const char *const keep[] = {"<unk>", "<s>", "<|endoftext|>"};
    if (!v->rstrip_specials) return 0;
    size_t tl;
    const char *tt = tok_text(v, sid, &tl);
    for (size_t k = 0; k < sizeof keep / sizeof keep[0]; k++)
        if (tl == strlen(keep[k]) && !memcmp(tt, keep[k], tl)) return 0;
    size_t i = 0;
    while (i < n && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r' || s[i] == '\v' || s[i] == '\f')) i++;
    return i;
}

static int partition_special(const tok_vocab *v, const char *text, size_t len, bool parse_special,
                             tok_fragment **out, size_t *n_out) {
    size_t cap = 16, n = 1;
    tok_fragment *f = malloc(cap * sizeof *f);
    if (!f) return KVS_ERR_NOMEM;
    f[0] = (tok_fragment){0, len, -1};
    uint8_t *present = specials_present(v, text, len);
    for (int32_t u = 0; u < v->n_special; u++) {
        int32_t sid = v->special_ids[u];
        if (!parse_special && v->types[sid] != TOK_TYPE_USER_DEFINED) continue;
        size_t tl;
        const char *tt = tok_text(v, sid, &tl);
        if (present && !present[tok_vocab_find(v, tt, tl)]) continue;
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
                    free(present);
                    return KVS_ERR_NOMEM;
                }
                f = g;
                cap *= 2;
            }
            tok_fragment cur = f[i], rep[3];
            size_t r = 0, rest = cur.len - pos - tl;
            size_t strip = rstrip_len(v, sid, text + cur.start + pos + tl, rest);
            rest -= strip;
            if (pos > 0) rep[r++] = (tok_fragment){cur.start, pos, -1};
            rep[r++] = (tok_fragment){cur.start + pos, tl, sid};
            if (rest > 0) rep[r++] = (tok_fragment){cur.start + pos + tl + strip, rest, -1};
            memmove(&f[i + r], &f[i + 1], (n - i - 1) * sizeof *f);
            memcpy(&f[i], rep, r * sizeof *f);
            n += r - 1;
            /* Continue with the right remainder (searched again for the same token),
             * or with the fragment after the token when nothing remains. */
            i += rest > 0 ? r - 2 : r - 1;
        }
    }
    free(present);
    *out = f;
    *n_out = n;
    return KVS_OK;
}

int tok_encode_ex(const tok_vocab *v, const char *text, size_t len, bool add_bos, bool parse_special, int32_t *ids,
                  int max_ids, int *n_ids) {
    if (n_ids) *n_ids = 0;
    if (!v || !n_ids || (!text && len > 0) || max_ids < 0 || (!ids && max_ids > 0)) return KVS_ERR_INVALID_ARG;
    /* Escaped offsets are int32: each byte may become 3, plus the prefix. */
    if (len > (size_t)(INT32_MAX - 3) / 3) return KVS_ERR_INVALID_ARG;
    if (add_bos && v->bos < 0) return KVS_ERR_UNSUPPORTED;

    tok_out o = {ids, max_ids, 0};
    tok_fragment *frags = NULL;
    size_t n_frags = 0;
    int rc = KVS_OK;

    if (add_bos) tok_emit(&o, v->bos);
    if (len > 0) {
        if ((rc = partition_special(v, text, len, parse_special, &frags, &n_frags)) != KVS_OK) goto done;
        bool prev_special = true;
        for (size_t i = 0; i < n_frags; i++) {
            if (frags[i].id >= 0) {
                tok_emit(&o, frags[i].id);
                prev_special = true;
                continue;
            }
            if (v->kind == TOK_KIND_BPE) rc = tok_bpe_encode(v, text + frags[i].start, frags[i].len, &o);
            else rc = tok_spm_encode(v, text + frags[i].start, frags[i].len, v->add_space_prefix && prev_special, &o);
            if (rc != KVS_OK) goto done;
            prev_special = false;
        }
    }
    if (o.n_out > (size_t)INT_MAX) {
        rc = KVS_ERR_TOO_LARGE;
        *n_ids = INT_MAX;
        goto done;
    }
    *n_ids = (int)o.n_out;
    if (o.n_out > (size_t)max_ids) rc = KVS_ERR_TOO_LARGE;

done:
    free(frags);
    return rc;
}

int tok_encode(const tok_vocab *v, const char *text, size_t len, bool add_bos, int32_t *ids, int max_ids,
               int *n_ids) {
    return tok_encode_ex(v, text, len, add_bos, false, ids, max_ids, n_ids);
}

/* ---- decoding ------------------------------------------------------------- */

static void put_bytes(char *buf, size_t cap, size_t *len, const char *s, size_t n) {
    if (*len < cap) {
        size_t k = cap - *len < n ? cap - *len : n;
        memcpy(buf + *len, s, k);
    }
    *len += n;
}

int tok_piece_ex(const tok_vocab *v, int32_t id, bool special, char *buf, size_t cap, size_t *len) {
    if (len) *len = 0;
    if (!v || !len || (!buf && cap > 0)) return KVS_ERR_INVALID_ARG;
    if (id < 0 || id >= v->n_vocab) return KVS_ERR_INVALID_ARG;
    size_t tl;
    const char *t = tok_text(v, id, &tl);
    switch (v->types[id]) {
    case TOK_TYPE_NORMAL:
        if (v->kind == TOK_KIND_BPE) {
            tok_bpe_decode_text(t, tl, buf, cap, len);
            return KVS_OK;
        }
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
    case TOK_TYPE_CONTROL:
    case TOK_TYPE_UNKNOWN:
        if (special) put_bytes(buf, cap, len, t, tl);
        return KVS_OK;
    case TOK_TYPE_BYTE:
        if (v->kind == TOK_KIND_SPM) {
            char b = (char)tok_vocab_byte_value(t, tl); /* validated at load */
            put_bytes(buf, cap, len, &b, 1);
        }
        return KVS_OK;
    default: /* unused, undefined: no text */
        return KVS_OK;
    }
}

int tok_piece(const tok_vocab *v, int32_t id, char *buf, size_t cap, size_t *len) {
    return tok_piece_ex(v, id, false, buf, cap, len);
}

/* llama.cpp's clean_up_tokenization_spaces, three passes over s[0..n) in place; returns
 * the new length. 1: " ?", " !", " .", " ," lose the space; 2: a lone "'" between two
 * spaces loses both; 3: " 's", " 'm", " 're", " 've" lose the space (" 't", " 'd", " 'll"
 * keep it). Each pass reads the text as the previous pass left it. */
static size_t clean_spaces(char *s, size_t n) {
    if (n == 0) return 0;
    size_t w = 1;
    for (size_t i = 1; i < n; i++) {
        char x = s[i];
        if (s[i - 1] == ' ' && (x == '?' || x == '!' || x == '.' || x == ',')) w--;
        s[w++] = x;
    }
    n = w;
    w = 1;
    for (size_t i = 1; i < n; i++) {
        char x = s[i];
        if (x == '\'' && i + 1 < n && s[i - 1] == ' ' && s[i + 1] == ' ') {
            w--;          /* the space before */
            s[++i] = '\0'; /* the space after is skipped, and no longer reads as a space */
        }
        s[w++] = x;
    }
    n = w;
    w = 1;
    for (size_t i = 1; i < n; i++) {
        char x = s[i];
        if (s[i - 1] == ' ' && x == '\'' && i + 1 < n) {
            char x1 = s[i + 1], x2 = i + 2 < n ? s[i + 2] : 0;
            if (x1 == 's' || x1 == 'm') w--;
            else if (x1 != 't' && x1 != 'd' && i + 2 < n && ((x1 == 'r' && x2 == 'e') || (x1 == 'v' && x2 == 'e'))) w--;
        }
        s[w++] = x;
    }
    return w;
}

int tok_detokenize(const tok_vocab *v, const int32_t *ids, size_t n, bool special, char **out, size_t *len) {
    if (out) *out = NULL;
    if (len) *len = 0;
    if (!v || !out || !len || (!ids && n > 0)) return KVS_ERR_INVALID_ARG;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        size_t pl;
        if (tok_piece_ex(v, ids[i], special, NULL, 0, &pl) != KVS_OK) return KVS_ERR_INVALID_ARG;
        total += pl;
    }
    char *s = malloc(total + 1);
    if (!s) return KVS_ERR_NOMEM;
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        size_t pl = 0;
        tok_piece_ex(v, ids[i], special, s + at, total - at, &pl);
        /* SPM: the space the encoder prefixed goes away (llama.cpp's lstrip of the first piece). */
        if (i == 0 && v->kind == TOK_KIND_SPM && v->add_space_prefix && pl > 0 && s[at] == ' ') {
            memmove(s + at, s + at + 1, pl - 1);
            pl--;
        }
        at += pl;
    }
    if (v->kind == TOK_KIND_BPE && tok_bpe_clean_spaces(v->bpe)) at = clean_spaces(s, at);
    s[at] = 0;
    *out = s;
    *len = at;
    return KVS_OK;
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
