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

/* Builds the vocab from the GGUF metadata (copied: the ctx may be closed
 * afterwards). KVS_ERR_UNSUPPORTED when tokenizer.ggml.model is not "llama";
 * KVS_ERR_FORMAT on inconsistent arrays. */
int tok_from_gguf(const gguf_ctx *g, tok_vocab **out, char *msg, size_t msg_cap);
void tok_free(tok_vocab *v);

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
