/*
 * tokenizer — text <-> ids from GGUF metadata, giving the ids llama.cpp gives. One
 * interface over the tokenizer families (tokenizer.ggml.model):
 *   "llama" (tok_spm): SentencePiece — score-driven bigram merges, byte fallback
 *           (<0xNN> tokens), a leading space added to the text, spaces as U+2581;
 *   "gpt2"  (tok_bpe): byte-level BPE — merges by rank, the GPT-2 byte <-> unicode map,
 *           the pre-tokenizer named by tokenizer.ggml.pre (regexes run by PCRE2).
 * Common to both: special tokens (control / user-defined) matched in the text, BOS per
 * tokenizer.ggml.add_bos_token, the end-of-generation set, the chat template text.
 */
#ifndef KVS_TOKENIZER_H
#define KVS_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gguf.h"

typedef struct tok_vocab tok_vocab;

typedef enum {
    TOK_KIND_SPM = 0, /* tokenizer.ggml.model "llama" */
    TOK_KIND_BPE = 1, /* tokenizer.ggml.model "gpt2" */
} tok_kind;

#define TOK_MAX_MERGES (1 << 22)       /* BPE merges */
#define TOK_MAX_TEMPLATE (1u << 20)    /* bytes of tokenizer.chat_template */
#define TOK_MAX_PRE 64u                /* bytes of tokenizer.ggml.pre */

/* A vocab as plain arrays (all borrowed; tok_from_arrays copies what it keeps). */
typedef struct {
    int32_t n_vocab;                /* tokens, 1..2^24 */
    const char *const *texts;       /* (n_vocab) token text as stored in GGUF (U+2581 for spaces,
                                       "<0xNN>" for bytes), not NUL-terminated; NULL ok when len 0 */
    const uint32_t *text_lens;      /* (n_vocab) bytes of each text, <= 4096 */
    const float *scores;            /* (n_vocab) merge priority; NULL: all 0 */
    const int32_t *types;           /* (n_vocab) llama token type 1..6 (others: undefined); NULL: all normal */
    int32_t bos, eos, unk;          /* token ids, -1 when absent */
    bool add_space_prefix;          /* prepend ' ' to the text before encoding (SPM) */
    bool rstrip_specials;           /* whitespace right after a special token is dropped, but after
                                       <unk>, <s>, <|endoftext|> (llama.cpp's RSTRIP, which it sets
                                       for Phi-3 by general.name, as the HF tokenizer does) */
    /* Added for byte-level BPE and chat; zero means "as before" (an SPM vocab, BOS added). */
    tok_kind kind;                  /* TOK_KIND_SPM (0) or TOK_KIND_BPE */
    const char *pre;                /* BPE: tokenizer.ggml.pre, NUL-terminated; NULL or "": "default" */
    int32_t n_merges;               /* BPE: 0..TOK_MAX_MERGES */
    const char *const *merges;      /* BPE: (n_merges) "left right" in rank order, not NUL-terminated */
    const uint32_t *merge_lens;     /* BPE: (n_merges) bytes of each, <= 2 * 4096 + 1 */
    int8_t add_bos;                 /* 1: add BOS, -1: don't, 0: the family's default (SPM yes; BPE
                                       yes for the llama3 pre-tokenizers, else no), as llama.cpp */
    const char *chat_template;      /* tokenizer.chat_template, NUL-terminated, <= TOK_MAX_TEMPLATE
                                       bytes; NULL: none */
} tok_arrays;

/* Builds the vocab from the GGUF metadata (copied: the ctx may be closed
 * afterwards). KVS_ERR_UNSUPPORTED when tokenizer.ggml.model is neither "llama" nor
 * "gpt2", or tokenizer.ggml.pre names a pre-tokenizer this code does not have (msg
 * names the value); KVS_ERR_FORMAT on inconsistent arrays. */
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

/* tok_encode_ex with parse_special = false: control-token text is tokenized as plain
 * text (user-defined tokens are still matched, as llama.cpp does). */
int tok_encode(const tok_vocab *v, const char *text, size_t len, bool add_bos,
               int32_t *ids, int max_ids, int *n_ids);

/* Tokenizes text[0..len). Writes up to max_ids ids; *n_ids gets the count
 * needed. Returns KVS_ERR_TOO_LARGE (ids written up to max_ids) if it did not
 * fit. add_bos prepends BOS. ids may be NULL when max_ids is 0 (a sizing call).
 * KVS_ERR_INVALID_ARG for NULL v / n_ids, text NULL with len > 0, or text over
 * ~700 MB; KVS_ERR_UNSUPPORTED for add_bos when the vocab has no BOS, or (SPM) for a
 * character that has no piece when the vocab has neither byte tokens nor an unknown token
 * (never an id of -1); KVS_ERR_NOMEM. Invalid UTF-8 is not an error (bytes fall back to <0xNN>).
 * Thread-safe: a vocab is read-only after tok_from_gguf().
 * parse_special: control and unknown-type tokens written in the text ("<|eot_id|>") become
 * those tokens (llama.cpp's parse_special); user-defined tokens are matched either way.
 * Byte-level BPE reads invalid UTF-8 as U+FFFD, as llama.cpp does. */
int tok_encode_ex(const tok_vocab *v, const char *text, size_t len, bool add_bos, bool parse_special,
                  int32_t *ids, int max_ids, int *n_ids);

/* Whether the file asks for BOS before a prompt (tokenizer.ggml.add_bos_token, else the
 * family's default) and has one. */
bool tok_add_bos(const tok_vocab *v);

/* Whether generation stops at id: EOS, and every token whose text is one of llama.cpp's
 * end-of-generation texts (<|eot_id|>, <|eom_id|>, <|im_end|>, <|end|>, <end_of_turn>,
 * <|endoftext|>, <EOT>) or fill-in-the-middle separators (<|fim_pad|>, <|repo_name|>,
 * <|file_sep|>, ...) present in the vocab. False for NULL v or an id out of range. */
bool tok_is_eog(const tok_vocab *v, int32_t id);

/* The file's tokenizer.chat_template (NUL-terminated, valid while v lives), NULL if none. */
const char *tok_chat_template(const tok_vocab *v);

tok_kind tok_vocab_kind(const tok_vocab *v);
/* BPE: the pre-tokenizer name as given in the file ("llama-bpe"); SPM: "". Valid while v lives. */
const char *tok_pre_name(const tok_vocab *v);

/* Text of one token: U+2581 -> ' ', <0xNN> -> that byte (SPM); byte-level characters ->
 * their bytes (BPE); user-defined tokens verbatim; control tokens (BOS/EOS) -> "".
 * Writes at most cap bytes (not NUL-terminated); *len gets the full length.
 * KVS_ERR_INVALID_ARG for an id out of range. A piece may end inside a UTF-8 character. */
int tok_piece(const tok_vocab *v, int32_t id, char *buf, size_t cap, size_t *len);
/* tok_piece, with special = true rendering control and unknown tokens as their text. */
int tok_piece_ex(const tok_vocab *v, int32_t id, bool special, char *buf, size_t cap, size_t *len);

/* llama.cpp's llama_detokenize(remove_special = false, unparse_special = special): the
 * pieces of ids[0..n) joined; SPM drops the leading space of the first piece; BPE vocabs
 * whose pre-tokenizer asks for it (llama3, gpt-2, default, smaug) clean spaces before
 * ?!., and contractions ('s 'm 're 've). On success *out is a malloc'd NUL-terminated
 * string (*len bytes, may hold NUL bytes and invalid UTF-8) the caller frees.
 * KVS_ERR_INVALID_ARG (NULL args, an id out of range), KVS_ERR_NOMEM; *out NULL then. */
int tok_detokenize(const tok_vocab *v, const int32_t *ids, size_t n, bool special, char **out, size_t *len);

/* Raw vocab entries, for serving the vocab to a client over the wire.
 * tok_token_text: the token's stored text (not NUL-terminated, valid while v
 * lives), NULL for an id out of range. */
const char *tok_token_text(const tok_vocab *v, int32_t id, size_t *len);
float tok_token_score(const tok_vocab *v, int32_t id);
int32_t tok_token_type(const tok_vocab *v, int32_t id); /* llama token type 0..6 */
bool tok_add_space_prefix(const tok_vocab *v);
/* BPE merges in rank order (the kept ones; see tok_bpe.h): "left" and "right" token ids. */
int32_t tok_n_merges(const tok_vocab *v);
bool tok_merge(const tok_vocab *v, int32_t rank, int32_t *left, int32_t *right);
/* The add_bos setting as given (tok_arrays.add_bos: 1, -1, or 0 = default). */
int8_t tok_add_bos_setting(const tok_vocab *v);
/* tok_arrays.rstrip_specials as given (a route client learns it from VOCAB_META). */
bool tok_rstrip_specials(const tok_vocab *v);

/* ---- UTF-8 helpers (tok_utf8.c) for text that leaves the process ---- */

/* Length of the strict UTF-8 character at s[0..n) (1..4; no overlongs, surrogates or
 * code points past U+10FFFF), with its code point in *cp; 0 when s does not start with one. */
int tok_utf8_char(const char *s, size_t n, uint32_t *cp);

/* Bytes of s[0..n) up to (not including) an incomplete character at its very end: a
 * stream of pieces prints this much now and holds the rest back until it completes.
 * Invalid bytes are not held back (they never complete). */
size_t tok_utf8_complete_len(const char *s, size_t n);

/* s[0..n) as valid UTF-8: each maximal invalid or incomplete subsequence becomes U+FFFD.
 * *out is malloc'd, NUL-terminated (*out_len bytes, may hold NUL bytes from s); the caller
 * frees it. KVS_ERR_INVALID_ARG (NULL args), KVS_ERR_NOMEM. */
int tok_utf8_repair(const char *s, size_t n, char **out, size_t *out_len);

#endif /* KVS_TOKENIZER_H */
