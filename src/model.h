/*
 * model — hyper-parameters and tensor views of one layer range [first, last)
 * of a dense Llama GGUF, plus token_embd when first == 0 and output_norm /
 * output when last == n_layer. Weight data stays in the read-only mapping:
 * only the owned tensors are ever touched, so resident weight memory follows
 * the range. Knows nothing about sessions or the network.
 */
#ifndef KVS_MODEL_H
#define KVS_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gguf.h"
#include "ops.h"

typedef struct {
    uint32_t n_vocab;
    uint32_t n_embd;     /* hidden size */
    uint32_t n_layer;    /* layers of the whole model */
    uint32_t n_head;     /* query heads */
    uint32_t n_head_kv;  /* key/value heads (GQA: divides n_head) */
    uint32_t head_dim;   /* n_embd / n_head */
    uint32_t n_ff;       /* feed-forward hidden size */
    uint32_t n_rot;      /* rope dimensions per head (<= head_dim, even) */
    uint32_t n_ctx;      /* training context length */
    float rope_base;     /* rope frequency base */
    float rms_eps;       /* rmsnorm epsilon */
} model_hparams;

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
} model_layer;

typedef struct model model;

struct model {
    gguf_ctx *gguf;          /* owns the mapping */
    model_hparams hp;
    uint32_t first, last;    /* owned layers [first, last) */
    model_layer *layers;     /* last - first entries */
    bool has_embd, has_head;
    ops_weight tok_embd;     /* n_vocab rows of n_embd (has_embd) */
    const float *out_norm;   /* [n_embd] (has_head) */
    ops_weight output;       /* n_embd -> n_vocab (has_head; token_embd when tied) */
    uint64_t weight_bytes;   /* bytes of the owned tensors */
    size_t act_row_bytes;    /* largest quantized activation row any owned matrix needs, bytes */
    float *rope_inv_freq;    /* [n_rot / 2] rope frequencies, base^(-2i/n_rot) */
    float **owned_floats;    /* norm vectors converted to f32, freed with the model */
    int n_owned_floats;
};

/* Reads the hyper-parameters only (no tensor checks). */
int model_read_hparams(const gguf_ctx *g, model_hparams *hp, char *msg, size_t msg_cap);

/* Opens path and maps layers [first, last) (last == 0 means n_layer). Refuses
 * (KVS_ERR_UNSUPPORTED / KVS_ERR_FORMAT, message says what) other
 * architectures, nonsensical hyper-parameters, missing tensors, tensors whose
 * shapes do not match, and unsupported compute types. *out owned by caller. */
int model_load(const char *path, uint32_t first, uint32_t last, model **out, char *msg, size_t msg_cap);
void model_free(model *m);

/* Row `id` of token_embd as f32 (n_embd values). */
void model_embed(const model *m, int32_t id, float *out);

#endif /* KVS_MODEL_H */
