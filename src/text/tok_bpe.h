/*
 * tok_bpe — byte-level BPE (tokenizer.ggml.model "gpt2"): the GPT-2 byte <-> unicode map,
 * merges by rank, and the pre-tokenizers named by tokenizer.ggml.pre, their regexes run by
 * PCRE2 (UTF + UCP: Unicode letters, numbers and spaces from PCRE2's tables).
 * Private to the tokenizer; the public interface is tokenizer.h.
 */
#ifndef KVS_TOK_BPE_H
#define KVS_TOK_BPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tok_impl.h"

/* Builds the BPE half of vocab v (whose tokens are loaded): the pre-tokenizer for pre
 * (NULL or "" = "default") and the merge table. A merge whose sides or result are not
 * tokens of v can never apply to token ids and is dropped (real vocabs have none), as is
 * a merge without a space or a repeated pair (the first rank stays, as in llama.cpp).
 * KVS_ERR_UNSUPPORTED for an unknown pre (msg names it and lists the known ones),
 * KVS_ERR_NOMEM, KVS_ERR_INTERNAL when PCRE2 refuses a pattern. */
int tok_bpe_create(const tok_vocab *v, const char *pre, const char *const *merges, const uint32_t *merge_lens,
                   int32_t n_merges, tok_bpe **out, char *msg, size_t msg_cap);
void tok_bpe_free(tok_bpe *b);

/* The pre-tokenizer name as given, and whether that family adds BOS by default and
 * cleans spaces on detokenization (llama.cpp's per-pre settings). */
const char *tok_bpe_pre(const tok_bpe *b);
bool tok_bpe_default_add_bos(const tok_bpe *b);
bool tok_bpe_clean_spaces(const tok_bpe *b);
/* Comma-separated list of the pre-tokenizer names understood (static). */
const char *tok_bpe_pre_names(void);

int32_t tok_bpe_n_merges(const tok_bpe *b);
bool tok_bpe_merge(const tok_bpe *b, int32_t rank, int32_t *left, int32_t *right);

/* Encodes one raw fragment (no special tokens in it). KVS_OK, KVS_ERR_NOMEM, or
 * KVS_ERR_INTERNAL when PCRE2 fails to match (e.g. its JIT stack). */
int tok_bpe_encode(const tok_vocab *v, const char *text, size_t len, tok_out *out);

/* Appends the bytes of a normal token's text (byte-level characters back to bytes; a
 * character outside the map is copied as is). */
void tok_bpe_decode_text(const char *t, size_t n, char *buf, size_t cap, size_t *len);

#endif /* KVS_TOK_BPE_H */
