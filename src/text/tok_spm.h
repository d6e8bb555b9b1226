/*
 * tok_spm — SentencePiece encoding (tokenizer.ggml.model "llama") of one raw fragment.
 * Private to the tokenizer; the public interface is tokenizer.h.
 */
#ifndef KVS_TOK_SPM_H
#define KVS_TOK_SPM_H

#include <stdbool.h>
#include <stddef.h>

#include "tok_impl.h"

/* SPM-encodes one raw fragment (no special tokens in it); add_prefix prepends ' '.
 * KVS_OK or KVS_ERR_NOMEM. */
int tok_spm_encode(const tok_vocab *v, const char *text, size_t len, bool add_prefix, tok_out *out);

#endif /* KVS_TOK_SPM_H */
