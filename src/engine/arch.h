/*
 * arch — the table of supported architectures. Each row says how a family's
 * GGUF keys and tensors map onto the one forward pass (forward.c): where its
 * hyper-parameters live (`{general.architecture}.*`), which optional tensors
 * it carries (q/k/v and output biases), how rope pairs dimensions, and its
 * defaults. Adding a family is a row here plus its tests, not a fork of
 * forward. Knows nothing about sessions or the network.
 *
 * What every row shares (the one forward pass): pre-norm RMSNorm blocks,
 * grouped-query attention with rope, SwiGLU feed-forward, an output norm and
 * an output matrix that may be tied to token_embd, optional per-dimension
 * rope divisors (`rope_freqs.weight`, Llama 3.1+ scaling) and linear rope
 * scaling. What no row supports is refused by the model loader with the
 * reason: a mixture of experts (`expert_count` > 0), rope scaling other than
 * none / linear (YaRN, LongRoPE, ...), an unknown architecture.
 */
#ifndef KVS_ARCH_H
#define KVS_ARCH_H

#include <stdbool.h>
#include <stddef.h>

#include "gguf.h"

typedef enum {
    ARCH_ROPE_NORM = 0, /* rotates adjacent pairs (x[2i], x[2i+1]) — GGUF "llama" */
    ARCH_ROPE_NEOX = 1, /* rotates (x[i], x[i + n_rot/2]): the two halves together — "qwen2" */
} arch_rope_style;

typedef enum {
    ARCH_TENSOR_ABSENT = 0,   /* never in this family's files: refused if present */
    ARCH_TENSOR_OPTIONAL = 1, /* used when present */
    ARCH_TENSOR_REQUIRED = 2, /* refused when missing */
} arch_tensor_rule;

typedef struct {
    const char *name;              /* general.architecture value, also the key prefix */
    arch_rope_style rope_style;
    arch_tensor_rule qkv_bias;     /* blk.N.attn_q.bias / attn_k.bias / attn_v.bias */
    arch_tensor_rule out_bias;     /* blk.N.attn_output.bias */
    float default_rms_eps;         /* when attention.layer_norm_rms_epsilon is absent */
    float default_rope_base;       /* when rope.freq_base is absent */
} arch_info;

/* The row for the file's `general.architecture`. KVS_OK and *out (static
 * storage); KVS_ERR_FORMAT when the key is missing or not a string;
 * KVS_ERR_UNSUPPORTED for an architecture without a row (the message names it
 * and lists the supported ones). */
int arch_from_gguf(const gguf_ctx *g, const arch_info **out, char *msg, size_t msg_cap);

/* The row called name (NUL-terminated), or NULL. */
const arch_info *arch_find(const char *name);
/* The i-th row (for listing), NULL past the end. */
const arch_info *arch_at(int i);

/* Writes "{a->name}.{suffix}" into buf (cap bytes, truncated but always
 * terminated) and returns buf, for reading a family's keys. */
const char *arch_key(const arch_info *a, const char *suffix, char *buf, size_t cap);

#endif /* KVS_ARCH_H */
