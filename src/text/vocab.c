/*
 * vocab — the token table of vocab.h: filling it from a tok_arrays, the text -> id hash,
 * the end-of-generation set, the sorted special tokens and the SPM byte tokens.
 *
 * Design notes
 *  1. The vocab owns copies of every token text in one arena (text_arena); the caller's
 *     arrays may be freed once tok_from_arrays() returns.
 *  2. Token text -> id is an open-addressing hash table (power-of-two slots, load
 *     <= 1/2, linear probing). A text that occurs twice maps to its last id, as in
 *     llama.cpp, whose map assignment overwrites.
 *  3. Special tokens, as llama.cpp (llama_vocab::load): a token whose text is one of the
 *     end-of-generation texts (EOG_TEXTS) is forced to CONTROL type and joins the EOG
 *     set, with EOS and the fill-in-the-middle pad/repo/separator tokens. Control,
 *     unknown and user-defined tokens are "special": sorted longest text first (then
 *     lowest id), they split the text before the family encoder sees it (tokenizer.c).
 */
#include "vocab.h"

#include <stdlib.h>
#include <string.h>

#include "util.h"

/* ---- hash map (design note 2) --------------------------------------------- */

static uint32_t hash_bytes(const char *s, size_t n) {
    uint32_t h = 2166136261u; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= (uint8_t)s[i];
        h *= 16777619u;
    }
    return h ^ (h >> 15);
}

int32_t tok_vocab_find(const tok_vocab *v, const char *s, size_t n) {
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

/* ---- filling --------------------------------------------------------------- */

static int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

int tok_vocab_byte_value(const char *s, size_t n) {
    if (n != 6 || s[0] != '<' || s[1] != '0' || s[2] != 'x' || s[5] != '>') return -1;
    int hi = hex_digit(s[3]), lo = hex_digit(s[4]);
    if (hi < 0 || lo < 0) return -1;
    return hi * 16 + lo;
}

void tok_vocab_fill(tok_vocab *v, const tok_arrays *a) {
    const int32_t n = v->n_vocab;
    uint32_t off = 0;
    for (int32_t i = 0; i < n; i++) {
        uint32_t l = a->text_lens[i];
        v->text_off[i] = off;
        if (l) memcpy(v->text_arena + off, a->texts[i], l);
        off += l;
        v->scores[i] = a->scores ? a->scores[i] : 0.0f;
        int32_t t = a->types ? a->types[i] : TOK_TYPE_NORMAL;
        if (t < TOK_TYPE_NORMAL || t > TOK_TYPE_BYTE) t = TOK_TYPE_UNDEFINED;
        v->types[i] = (uint8_t)t;
    }
    v->text_off[n] = off;

    for (uint32_t i = 0; i < v->hash_cap; i++) v->hash_slots[i] = -1;
    for (int32_t i = 0; i < n; i++) vocab_insert(v, i);
}

/* Texts that end a generation (llama.cpp's EOT/EOM/EOG and FIM pad/repo/separator lists);
 * design note 3. */
static const char *const EOG_TEXTS[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
    "<\357\275\234end\342\226\201of\342\226\201sentence\357\275\234>", /* DeepSeek */
    "</s>", "<|fim_pad|>", "<fim-pad>", "<PAD>", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<|file_sep|>",
};

static void eog_add(tok_vocab *v, int32_t id) {
    if (id < 0 || v->n_eog == TOK_MAX_EOG) return;
    int i = 0;
    while (i < v->n_eog && v->eog[i] < id) i++;
    if (i < v->n_eog && v->eog[i] == id) return;
    memmove(&v->eog[i + 1], &v->eog[i], (size_t)(v->n_eog - i) * sizeof v->eog[0]);
    v->eog[i] = id;
    v->n_eog++;
}

void tok_vocab_mark_eog(tok_vocab *v) {
    for (size_t k = 0; k < sizeof EOG_TEXTS / sizeof EOG_TEXTS[0]; k++) {
        int32_t id = tok_vocab_find(v, EOG_TEXTS[k], strlen(EOG_TEXTS[k]));
        if (id < 0) continue;
        v->types[id] = TOK_TYPE_CONTROL;
        eog_add(v, id);
    }
    eog_add(v, v->eos);
}

typedef struct {
    uint32_t len; /* bytes of the token text */
    int32_t id;
} tok_special_key;

/* Longest text first, then lowest id (llama.cpp sorts by length only). */
static int cmp_special_key(const void *pa, const void *pb) {
    const tok_special_key *a = pa, *b = pb;
    if (a->len != b->len) return a->len > b->len ? -1 : 1;
    return a->id < b->id ? -1 : (a->id > b->id);
}

static bool is_special_type(uint8_t t) {
    return t == TOK_TYPE_CONTROL || t == TOK_TYPE_UNKNOWN || t == TOK_TYPE_USER_DEFINED;
}

int tok_vocab_sort_specials(tok_vocab *v) {
    int32_t n = 0;
    for (int32_t i = 0; i < v->n_vocab; i++)
        if (is_special_type(v->types[i]) && v->text_off[i + 1] > v->text_off[i]) n++;
    if (n == 0) return KVS_OK;
    tok_special_key *keys = malloc((size_t)n * sizeof *keys);
    v->special_ids = malloc((size_t)n * sizeof *v->special_ids);
    if (!keys || !v->special_ids) {
        free(keys);
        return KVS_ERR_NOMEM;
    }
    int32_t k = 0;
    for (int32_t i = 0; i < v->n_vocab; i++) {
        uint32_t l = v->text_off[i + 1] - v->text_off[i];
        if (is_special_type(v->types[i]) && l > 0) keys[k++] = (tok_special_key){l, i};
    }
    qsort(keys, (size_t)k, sizeof *keys, cmp_special_key);
    for (int32_t i = 0; i < k; i++) v->special_ids[i] = keys[i].id;
    v->n_special = k;
    /* the prefilter of partition_special: first bytes and distinct lengths (keys are
     * longest first, so the lengths come out descending; stored ascending) */
    v->special_lens = malloc((size_t)k * sizeof *v->special_lens);
    if (!v->special_lens) {
        free(keys);
        return KVS_ERR_NOMEM;
    }
    for (int32_t i = k - 1; i >= 0; i--) {
        if (v->n_special_lens == 0 || v->special_lens[v->n_special_lens - 1] != keys[i].len)
            v->special_lens[v->n_special_lens++] = (uint16_t)keys[i].len;
        uint8_t c = (uint8_t)v->text_arena[v->text_off[keys[i].id]];
        v->special_first[c >> 3] |= (uint8_t)(1u << (c & 7));
    }
    free(keys);
    return KVS_OK;
}

/* SPM byte tokens: every BYTE-type token must read <0xNN>; byte_tok[b] is the id that
 * the text "<0xNN>" (else the 1-byte text) looks up to, as llama.cpp's fallback does. */
int tok_vocab_byte_tokens(tok_vocab *v, char *msg, size_t msg_cap) {
    for (int32_t i = 0; i < v->n_vocab; i++) {
        if (v->types[i] != TOK_TYPE_BYTE) continue;
        size_t l;
        const char *s = tok_text(v, i, &l);
        if (tok_vocab_byte_value(s, l) < 0)
            return kvs_fail(msg, msg_cap, KVS_ERR_FORMAT, "byte token %d has text '%.*s', not <0xNN>", (int)i,
                            (int)(l > 32 ? 32 : l), s);
    }
    for (int b = 0; b < 256; b++) {
        static const char hex[] = "0123456789ABCDEF";
        char buf[6] = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>'};
        int32_t id = tok_vocab_find(v, buf, 6);
        if (id < 0) {
            char c = (char)b;
            id = tok_vocab_find(v, &c, 1);
        }
        v->byte_tok[b] = id;
    }
    return KVS_OK;
}

