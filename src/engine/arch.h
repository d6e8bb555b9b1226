/*
 * arch — the table of supported architectures. Each row says how a family's
 * GGUF keys and tensors map onto the one forward pass (forward.c): where its
 * hyper-parameters live (`{general.architecture}.*`), which optional tensors
 * it carries (q/k/v and output biases), how rope pairs dimensions, and its
 * defaults. Adding a family is a row here plus its tests, not a fork of
 * forward. Knows nothing about sessions or the network.
 *
 * What every row shares (the one forward pass): pre-norm RMSNorm blocks,
 * grouped-query attention with rope, a gated feed-forward, an output norm and
 * an output matrix that may be tied to token_embd, optional per-dimension
 * rope divisors (`rope_freqs.weight`, Llama 3.1+ scaling) and linear rope
 * scaling. What a row may add: per-head q/k RMSNorm (qwen3, gemma3), norms on
 * each block's output and embeddings x sqrt(n_embd) (gemma3), GELU(tanh) in
 * place of SiLU (gemma3), sliding-window layers with their own rope base
 * (gemma3), fused q/k/v and gate/up matrices and LongRoPE factors (phi3).
 * What no row supports is refused by the model loader with the reason: a
 * mixture of experts (`expert_count` > 0 or expert tensors), rope scaling
 * other than none / linear (YaRN, ...), hybrid recurrent layers (qwen35),
 * per-layer embeddings (gemma3n), an unknown architecture.
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

typedef enum {
    ARCH_FFN_SILU = 0,      /* silu(gate) x up (SwiGLU) */
    ARCH_FFN_GELU_TANH = 1, /* gelu(gate) x up, gelu's tanh approximation (GeGLU, gemma) */
} arch_ffn_act;

typedef struct {
    const char *name;              /* general.architecture value, also the key prefix */
    arch_rope_style rope_style;
    arch_tensor_rule qkv_bias;     /* blk.N.attn_q.bias / attn_k.bias / attn_v.bias */
    arch_tensor_rule out_bias;     /* blk.N.attn_output.bias */
    float default_rms_eps;         /* when attention.layer_norm_rms_epsilon is absent */
    float default_rope_base;       /* when rope.freq_base is absent */
    arch_tensor_rule qk_norm;      /* blk.N.attn_q_norm / attn_k_norm: RMSNorm of each q and k head
                                    * (head_dim weights) before rope */
    bool post_norms;               /* blk.N.post_attention_norm / post_ffw_norm: RMSNorm of the
                                    * attention and FFN outputs before each residual add */
    bool embd_scale;               /* token embeddings x sqrt(n_embd) */
    arch_ffn_act ffn_act;
    bool fused_qkv;                /* blk.N.attn_qkv: q rows, then k, then v (one matrix) */
    bool fused_gate_up;            /* blk.N.ffn_up holds 2 n_ff rows: gate, then up; no ffn_gate */
    uint32_t swa_period;           /* sliding-window pattern when the file has attention.sliding_window:
                                    * layer il is global when il % swa_period == swa_period - 1, local
                                    * otherwise (a pattern key overrides); 0: no sliding window */
    bool longrope;                 /* rope_factors_long / rope_factors_short and rope.scaling.attn_factor */
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
