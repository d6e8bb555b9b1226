/*
 * vocab — the token table every tokenizer family reads: token texts in one arena, their
 * scores and types, the text -> id hash, the special tokens and the end-of-generation set.
 * Private to the text layer. The files above it, lowest first:
 *   vocab.c        this table: built from a tok_arrays, looked up by text (no caller above)
 *   tok_spm.c      SentencePiece encoding of one raw fragment       (uses vocab)
 *   tok_bpe.c      byte-level BPE: pre-tokenizer, merges, encoding (uses vocab)
 *   tokenizer.c    the interface of tokenizer.h: builds a vocab, splits special tokens,
 *                  dispatches raw fragments to a family, decodes   (uses all of the above)
 *   tok_gguf.c     tok_from_gguf: GGUF metadata -> tok_arrays -> tok_from_arrays
 * No family calls into tokenizer.c, so the files form no cycle.
 */
#ifndef KVS_VOCAB_H
#define KVS_VOCAB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tokenizer.h"

enum {
    TOK_TYPE_UNDEFINED = 0,
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
#define TOK_MAX_EOG 32

typedef struct tok_bpe tok_bpe;

struct tok_vocab {
    tok_kind kind;
    int32_t n_vocab;
    char *text_arena;      /* all token texts back to back, not NUL-terminated */
    uint32_t *text_off;    /* (n_vocab + 1) offsets into text_arena; token i is [off[i], off[i+1]) */
    float *scores;         /* (n_vocab) merge priority, higher merges first (SPM) */
    uint8_t *types;        /* (n_vocab) TOK_TYPE_* (end-of-generation texts forced to CONTROL) */
    int32_t *hash_slots;   /* (hash_cap) token id or -1 */
    uint32_t hash_cap;     /* power of two, >= 2 * n_vocab */
    int32_t byte_tok[256]; /* SPM: id of <0xNN> (or of the 1-byte token "\xNN"), -1 if none */
    int32_t *special_ids;  /* (n_special) control, unknown and user-defined tokens, longest text first */
    int32_t n_special;
    uint8_t special_first[32]; /* bitmap of the first bytes of special texts */
    uint16_t *special_lens;    /* (n_special_lens) distinct special text lengths, ascending */
    int32_t n_special_lens;
    uint32_t max_token_len; /* bytes of the longest token text */
    int32_t bos, eos, unk;  /* -1 when absent */
    bool add_space_prefix;
    bool rstrip_specials; /* tok_arrays.rstrip_specials */
    int8_t add_bos_setting; /* as given: 1, -1, 0 (family default) */
    bool add_bos;           /* resolved */
    int32_t eog[TOK_MAX_EOG]; /* end-of-generation ids, ascending */
    int n_eog;
    char *chat_template;    /* NUL-terminated copy, NULL if none */
    tok_bpe *bpe;           /* BPE only: merges and pre-tokenizer */
};

static inline const char *tok_text(const tok_vocab *v, int32_t id, size_t *len) {
    *len = v->text_off[id + 1] - v->text_off[id];
    return v->text_arena + v->text_off[id];
}

/* Id of the token whose text is s[0..n), or -1. */
int32_t tok_vocab_find(const tok_vocab *v, const char *s, size_t n);

/* Fills v's token table from a (validated by tok_from_arrays: counts, lengths, total
 * under 4 GiB): the text arena and offsets, scores, types (out-of-range types read as
 * undefined) and the text -> id hash. v->n_vocab, max_token_len and hash_cap are set and
 * the arrays allocated by the caller. */
void tok_vocab_fill(tok_vocab *v, const tok_arrays *a);

/* Marks the end-of-generation set from the texts of design note 3 of tokenizer.c (each
 * forced to CONTROL) and v->eos. Needs the filled table and v->eos. */
void tok_vocab_mark_eog(tok_vocab *v);

/* Sorts the special tokens (control, unknown, user-defined with a text) longest first,
 * then lowest id, and builds their first-byte and length prefilter. KVS_OK or
 * KVS_ERR_NOMEM (the arrays allocated so far stay in v for tok_free). */
int tok_vocab_sort_specials(tok_vocab *v);

/* Byte value of a "<0xNN>" text, or -1. */
int tok_vocab_byte_value(const char *s, size_t n);

/* SPM byte tokens: every BYTE-type token must read <0xNN> (else KVS_ERR_FORMAT, msg names
 * it); v->byte_tok[b] becomes the id "<0xNN>" (else the 1-byte text) looks up to. */
int tok_vocab_byte_tokens(tok_vocab *v, char *msg, size_t msg_cap);

#endif /* KVS_VOCAB_H */
