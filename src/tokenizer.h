/*
 * tokenizer — SentencePiece-style "llama" tokenizer built from GGUF metadata
 * (tokenizer.ggml.tokens / scores / token_type, bos/eos ids, add_space_prefix),
 * giving the ids llama.cpp gives: score-driven bigram merges, byte fallback
 * (<0xNN> tokens), a leading space added to the text, spaces as U+2581.
 */
#ifndef KVS_TOKENIZER_H
#define KVS_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gguf.h"

typedef struct tok_vocab tok_vocab;

/* A vocab as plain arrays (all borrowed; tok_from_arrays copies what it keeps). */
typedef struct {
    int32_t n_vocab;                /* tokens, 1..2^24 */
    const char *const *texts;       /* (n_vocab) token text as stored in GGUF (U+2581 for spaces,
                                       "<0xNN>" for bytes), not NUL-terminated; NULL ok when len 0 */
    const uint32_t *text_lens;      /* (n_vocab) bytes of each text, <= 4096 */
    const float *scores;            /* (n_vocab) merge priority; NULL: all 0 */
    const int32_t *types;           /* (n_vocab) llama token type 1..6 (others: undefined); NULL: all normal */
    int32_t bos, eos, unk;          /* token ids, -1 when absent */
    bool add_space_prefix;          /* prepend ' ' to the text before encoding */
} tok_arrays;

/* Builds the vocab from the GGUF metadata (copied: the ctx may be closed
 * afterwards). KVS_ERR_UNSUPPORTED when tokenizer.ggml.model is not "llama";
 * KVS_ERR_FORMAT on inconsistent arrays. */
int tok_from_gguf(const gguf_ctx *g, tok_vocab **out, char *msg, size_t msg_cap);

/* Builds the vocab from arrays (e.g. the head shard's VOCAB_REPLY pages). Everything is
 * copied: a may be freed once this returns. On success *out is a new vocab owned by the
 * caller (tok_free). On failure *out is NULL and: KVS_ERR_INVALID_ARG (NULL arrays),
 * KVS_ERR_FORMAT (bad n_vocab, a text over 4096 bytes, a special id out of range, a byte
 * token whose text is not <0xNN>), KVS_ERR_NOMEM. tok_from_gguf reads the metadata into a
 * tok_arrays and calls this, so both give identical vocabs for the same data. */
int tok_from_arrays(const tok_arrays *a, tok_vocab **out, char *msg, size_t msg_cap);

void tok_free(tok_vocab *v); /* NULL is fine */

/* tok_bos / tok_eos return -1 when the metadata marks the token as absent. */
int32_t tok_n_vocab(const tok_vocab *v);
int32_t tok_bos(const tok_vocab *v);
int32_t tok_eos(const tok_vocab *v);

/* Tokenizes text[0..len). Writes up to max_ids ids; *n_ids gets the count
 * needed. Returns KVS_ERR_TOO_LARGE (ids written up to max_ids) if it did not
 * fit. add_bos prepends BOS. ids may be NULL when max_ids is 0 (a sizing call).
 * KVS_ERR_INVALID_ARG for NULL v / n_ids, text NULL with len > 0, or text over
 * ~700 MB; KVS_ERR_UNSUPPORTED for add_bos when the vocab has no BOS;
 * KVS_ERR_NOMEM. Invalid UTF-8 is not an error (bytes fall back to <0xNN>).
 * Thread-safe: a vocab is read-only after tok_from_gguf(). */
int tok_encode(const tok_vocab *v, const char *text, size_t len, bool add_bos,
               int32_t *ids, int max_ids, int *n_ids);

/* Text of one token: U+2581 -> ' ', <0xNN> -> that byte, control tokens (BOS/EOS) -> "".
 * Writes at most cap bytes (not NUL-terminated); *len gets the full length.
 * KVS_ERR_INVALID_ARG for an id out of range. */
int tok_piece(const tok_vocab *v, int32_t id, char *buf, size_t cap, size_t *len);

/* Raw vocab entries, for serving the vocab to a client over the wire.
 * tok_token_text: the token's stored text (not NUL-terminated, valid while v
 * lives), NULL for an id out of range. */
const char *tok_token_text(const tok_vocab *v, int32_t id, size_t *len);
float tok_token_score(const tok_vocab *v, int32_t id);
int32_t tok_token_type(const tok_vocab *v, int32_t id); /* llama token type 0..6 */
bool tok_add_space_prefix(const tok_vocab *v);

#endif /* KVS_TOKENIZER_H */
