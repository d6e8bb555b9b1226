/*
 * model — hyper-parameters and tensor views of one layer range [first, last)
 * of a dense GGUF model of a family in the arch table (llama, qwen2), plus
 * token_embd when first == 0 and output_norm / output when last == n_layer.
 * Weight data stays in the read-only mapping: only the owned tensors are ever
 * touched, so resident weight memory follows the range. Where the CPU has an
 * r8 kernel for a matrix's type (quant_r8_preferred), the loader repacks that
 * matrix once into owned memory of the same size (one arena for all of them,
 * in 2 MiB pages where the kernel gives them) and drops its mapped pages
 * (madvise), so the weights are resident once either way. A split model
 * (NAME-00001-of-0000N.gguf) is read through a gguf_set: the metadata of the
 * first part, and the tensor data of only the parts that hold owned tensors
 * (with a kvshard manifest only those parts need be on disk, and each owned
 * tensor is checked against the manifest's digest as it is mapped).
 * Knows nothing about sessions or the network.
 */
#ifndef KVS_MODEL_H
#define KVS_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "arch.h"
#include "gguf.h"
#include "ops.h"

typedef struct {
    uint32_t n_vocab;
    uint32_t n_embd;     /* hidden size */
    uint32_t n_layer;    /* layers of the whole model */
    uint32_t n_head;     /* query heads */
    uint32_t n_head_kv;  /* key/value heads (GQA: divides n_head) */
    uint32_t head_dim;   /* per head, of keys and values: attention.key_length (= value_length),
                            default n_embd / n_head */
    uint32_t n_ff;       /* feed-forward hidden size */
    uint32_t n_rot;      /* rope dimensions per head (<= head_dim, even) */
    uint32_t n_ctx;      /* training context length */
    float rope_base;     /* rope frequency base */
    float rope_freq_scale; /* linear rope scaling: positions x this (1 / rope.scaling.factor); 1: none */
    float rms_eps;       /* rmsnorm epsilon */
    float rope_attn_factor; /* rope.scaling.attn_factor: cos and sin x this (LongRoPE); 1: none */
    uint32_t n_ctx_orig; /* rope.scaling.original_context_length (LongRoPE), else n_ctx */
    uint32_t n_swa;      /* attention.sliding_window: a local layer attends to the last n_swa
                            positions, its own included; 0: every layer global */
    uint32_t swa_period; /* layer il is local when n_swa && il % swa_period != swa_period - 1 */
    float rope_base_swa; /* rope.freq_base_swa of local layers (no linear scaling there) */
    const arch_info *arch; /* the family's row (static storage) */
} model_hparams;

/* True when layer il (of the whole model) attends only inside the sliding window. */
static inline bool model_layer_is_swa(const model_hparams *hp, uint32_t il) {
    return hp->n_swa > 0 && hp->swa_period > 0 && il % hp->swa_period != hp->swa_period - 1;
}

typedef struct {
    const float *attn_norm; /* [n_embd] */
    const float *ffn_norm;  /* [n_embd] */
    ops_weight wq;          /* n_embd -> n_head * head_dim */
    ops_weight wk;          /* n_embd -> n_head_kv * head_dim */
    ops_weight wv;          /* n_embd -> n_head_kv * head_dim */
    ops_weight wo;          /* n_head * head_dim -> n_embd */
    ops_weight w_gate;      /* n_embd -> n_ff */
    ops_weight w_up;        /* n_embd -> n_ff */
    ops_weight w_down;      /* n_ff -> n_embd */
    const float *bq;        /* [n_head * head_dim] q bias, or NULL */
    const float *bk;        /* [n_head_kv * head_dim] k bias, or NULL */
    const float *bv;        /* [n_head_kv * head_dim] v bias, or NULL */
    const float *bo;        /* [n_embd] attention output bias, or NULL */
    const float *q_norm;    /* [head_dim] RMSNorm of each q head before rope, or NULL */
    const float *k_norm;    /* [head_dim] the same for k, or NULL */
    const float *post_attn_norm; /* [n_embd] RMSNorm of the attention output, or NULL */
    const float *post_ffn_norm;  /* [n_embd] RMSNorm of the FFN output, or NULL */
} model_layer;

/* The matrices of a layer, k < MODEL_LAYER_MATRICES: wq, wk, wv, wo, w_gate, w_up, w_down. */
enum { MODEL_LAYER_MATRICES = 7 };
static inline const ops_weight *model_layer_matrix(const model_layer *L, int k) {
    const ops_weight *ws[MODEL_LAYER_MATRICES] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
    return ws[k];
}

typedef struct model model;

struct model {
    gguf_set *files;         /* owns the mappings (one part, or every part of a split model) */
    const gguf_ctx *gguf;    /* the metadata: the first part of files */
    model_hparams hp;
    uint32_t first, last;    /* owned layers [first, last) */
    model_layer *layers;     /* last - first entries */
    bool has_embd, has_head;
    ops_weight tok_embd;     /* n_vocab rows of n_embd (has_embd) */
    const float *out_norm;   /* [n_embd] (has_head) */
    ops_weight output;       /* n_embd -> n_vocab (has_head; token_embd when tied) */
    uint64_t weight_bytes;   /* bytes of the owned tensors */
    size_t act_row_bytes;    /* largest quantized activation row any owned matrix needs, bytes */
    float *rope_inv_freq;    /* [n_rot / 2] rope frequencies per position: base^(-2i/n_rot) x
                              * rope_freq_scale / rope_freqs[i] (rope_freqs.weight, or LongRoPE's
                              * rope_factors_long, when present) */
    float *rope_inv_freq_swa; /* [n_rot / 2] the local layers' frequencies (rope_base_swa, unscaled),
                               * NULL when no layer is local */
    void **owned;            /* memory freed with the model: norm vectors converted to f32 */
    int n_owned;
    int n_repacked;          /* weights held in the r8 layout (quant.h), 0 when not repacked */
    void *repacked;          /* those weights, one mapping (kvs_map_big), NULL when none */
    size_t repacked_mapped;
};

/* Reads the hyper-parameters (keys under `{general.architecture}.`) and
 * n_vocab from token_embd's shape; no other tensor checks. KVS_ERR_UNSUPPORTED
 * (message says why) for an architecture without an arch row, a mixture of
 * experts (expert_count > 0), rope scaling other than none / linear, key and
 * value head sizes that differ; KVS_ERR_FORMAT for missing or nonsensical
 * values. */
int model_read_hparams(const gguf_set *files, model_hparams *hp, char *msg, size_t msg_cap);

/* Opens path (a single file or the first part of a split model) and maps
 * layers [first, last) (last == 0 means n_layer). Refuses (KVS_ERR_UNSUPPORTED
 * / KVS_ERR_FORMAT, message says what) what model_read_hparams refuses,
 * missing tensors, tensors the architecture does not use (the result would be
 * wrong without them), tensors whose shapes do not match, and unsupported
 * compute types. *out owned by caller. Repacks (quant.h, r8) on the calling
 * thread; model_load_on shares the repacking out over pool's threads (NULL:
 * the calling thread). */
int model_load(const char *path, uint32_t first, uint32_t last, model **out, char *msg, size_t msg_cap);
int model_load_on(const char *path, uint32_t first, uint32_t last, ops_pool *pool, model **out, char *msg,
                  size_t msg_cap);
void model_free(model *m);

/* Bytes of tensor data mapped for this model (gguf_set_mapped_data_bytes):
 * a split model's shard maps only the parts holding its tensors. */
uint64_t model_mapped_data_bytes(const model *m);

/* For gguf_split_write: part_of[i] for every tensor i of the single-file
 * model g, splitting it into n_parts parts by layers — blk.N goes to part
 * N * n_parts / n_layer, output_norm / output to the last part, every other
 * tensor (token_embd, rope_freqs) to the first. KVS_ERR_INVALID_ARG when a
 * part would be empty (n_parts > n_layer + 1) or n_parts is 0. */
int model_split_plan(const gguf_ctx *g, uint32_t n_parts, uint32_t *part_of, char *msg, size_t msg_cap);

/* Row `id` of token_embd as f32 (n_embd values). */
void model_embed(const model *m, int32_t id, float *out);

#endif /* KVS_MODEL_H */
