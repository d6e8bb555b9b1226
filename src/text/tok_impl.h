/*
 * tok_impl — the vocab shared by tokenizer.c (the interface: loading, special tokens,
 * decoding) and the family encoders tok_spm.c / tok_bpe.c. Private to those files.
 */
#ifndef KVS_TOK_IMPL_H
#define KVS_TOK_IMPL_H

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
    int8_t add_bos_setting; /* as given: 1, -1, 0 (family default) */
    bool add_bos;           /* resolved */
    int32_t eog[TOK_MAX_EOG]; /* end-of-generation ids, ascending */
    int n_eog;
    char *chat_template;    /* NUL-terminated copy, NULL if none */
    tok_bpe *bpe;           /* BPE only: merges and pre-tokenizer */
};

/* Output of one encode call: ids past max_ids are counted, not written. */
typedef struct {
    int32_t *ids;
    int max_ids;
    size_t n_out;
} tok_out;

static inline void tok_emit(tok_out *o, int32_t id) {
    if (o->n_out < (size_t)o->max_ids) o->ids[o->n_out] = id;
    o->n_out++;
}

static inline const char *tok_text(const tok_vocab *v, int32_t id, size_t *len) {
    *len = v->text_off[id + 1] - v->text_off[id];
    return v->text_arena + v->text_off[id];
}

/* Id of the token whose text is s[0..n), or -1. */
int32_t tok_vocab_find(const tok_vocab *v, const char *s, size_t n);

/* SPM-encodes one raw fragment (no special tokens in it); add_prefix prepends ' '.
 * KVS_OK or KVS_ERR_NOMEM. */
int tok_spm_encode(const tok_vocab *v, const char *text, size_t len, bool add_prefix, tok_out *out);

#endif /* KVS_TOK_IMPL_H */
