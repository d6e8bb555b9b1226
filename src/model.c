#include "model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"
#include "util.h"

#define MODEL_MAX_EMBD 65536u
#define MODEL_MAX_LAYERS 4096u
#define MODEL_MAX_HEADS 1024u
#define MODEL_MAX_FF (1u << 20)
#define MODEL_MAX_VOCAB (1u << 22)

static int get_u32_opt(const gguf_ctx *g, const char *key, uint32_t def, uint32_t *out, char *msg, size_t cap) {
    int err = gguf_get_u32(g, key, out);
    if (err == KVS_ERR_NOT_FOUND) {
        *out = def;
        return KVS_OK;
    }
    if (err) return kvs_fail(msg, cap, KVS_ERR_FORMAT, "metadata '%s' is not a 32-bit unsigned integer", key);
    return KVS_OK;
}

int model_read_hparams(const gguf_ctx *g, model_hparams *hp, char *msg, size_t cap) {
    memset(hp, 0, sizeof(*hp));
    gguf_str arch;
    if (gguf_get_str(g, "general.architecture", &arch) != KVS_OK)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "metadata 'general.architecture' is missing");
    if (!gguf_str_eq(arch, "llama"))
        return kvs_fail(msg, cap, KVS_ERR_UNSUPPORTED, "architecture '%.*s' is not supported (kvshard runs dense 'llama' models)",
                        (int)(arch.len > 64 ? 64 : arch.len), arch.ptr);
    int err;
    static const struct { const char *key; size_t off; } required[] = {
        {"llama.embedding_length", offsetof(model_hparams, n_embd)},
        {"llama.block_count", offsetof(model_hparams, n_layer)},
        {"llama.attention.head_count", offsetof(model_hparams, n_head)},
        {"llama.feed_forward_length", offsetof(model_hparams, n_ff)},
    };
    for (size_t i = 0; i < sizeof(required) / sizeof(required[0]); i++) {
        uint32_t *dst = (uint32_t *)((char *)hp + required[i].off);
        err = gguf_get_u32(g, required[i].key, dst);
        if (err == KVS_ERR_NOT_FOUND) return kvs_fail(msg, cap, KVS_ERR_FORMAT, "metadata '%s' is missing", required[i].key);
        if (err) return kvs_fail(msg, cap, KVS_ERR_FORMAT, "metadata '%s' is not a 32-bit unsigned integer", required[i].key);
    }
    if ((err = get_u32_opt(g, "llama.attention.head_count_kv", hp->n_head, &hp->n_head_kv, msg, cap))) return err;
    if ((err = get_u32_opt(g, "llama.context_length", 2048, &hp->n_ctx, msg, cap))) return err;
    if (hp->n_embd == 0 || hp->n_embd > MODEL_MAX_EMBD)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "embedding_length %u out of range [1, %u]", hp->n_embd, MODEL_MAX_EMBD);
    if (hp->n_layer == 0 || hp->n_layer > MODEL_MAX_LAYERS)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "block_count %u out of range [1, %u]", hp->n_layer, MODEL_MAX_LAYERS);
    if (hp->n_head == 0 || hp->n_head > MODEL_MAX_HEADS)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "head_count %u out of range [1, %u]", hp->n_head, MODEL_MAX_HEADS);
    if (hp->n_head_kv == 0 || hp->n_head_kv > hp->n_head || hp->n_head % hp->n_head_kv != 0)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "head_count_kv %u must be >= 1 and divide head_count %u", hp->n_head_kv,
                        hp->n_head);
    if (hp->n_embd % hp->n_head != 0)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "embedding_length %u is not a multiple of head_count %u", hp->n_embd,
                        hp->n_head);
    if (hp->n_ff == 0 || hp->n_ff > MODEL_MAX_FF)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "feed_forward_length %u out of range [1, %u]", hp->n_ff, MODEL_MAX_FF);
    if (hp->n_ctx == 0) return kvs_fail(msg, cap, KVS_ERR_FORMAT, "context_length is 0");
    hp->head_dim = hp->n_embd / hp->n_head;
    if ((err = get_u32_opt(g, "llama.rope.dimension_count", hp->head_dim, &hp->n_rot, msg, cap))) return err;
    if (hp->n_rot == 0 || hp->n_rot > hp->head_dim || hp->n_rot % 2)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "rope.dimension_count %u must be even and in [2, head_dim %u]", hp->n_rot,
                        hp->head_dim);
    hp->rope_base = 10000.0f;
    err = gguf_get_f32(g, "llama.rope.freq_base", &hp->rope_base);
    if (err && err != KVS_ERR_NOT_FOUND) return kvs_fail(msg, cap, KVS_ERR_FORMAT, "metadata 'llama.rope.freq_base' is not a float");
    if (!(hp->rope_base > 1.0f && hp->rope_base < 1e12f))
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "rope.freq_base %g out of range", (double)hp->rope_base);
    hp->rms_eps = 1e-5f;
    err = gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", &hp->rms_eps);
    if (err && err != KVS_ERR_NOT_FOUND)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "metadata 'llama.attention.layer_norm_rms_epsilon' is not a float");
    if (!(hp->rms_eps > 0.0f && hp->rms_eps < 1.0f))
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "layer_norm_rms_epsilon %g out of range (0, 1)", (double)hp->rms_eps);
    const gguf_tensor *te = gguf_find_tensor(g, "token_embd.weight");
    if (!te) return kvs_fail(msg, cap, KVS_ERR_FORMAT, "tensor 'token_embd.weight' is missing");
    if (te->n_dims != 2 || te->ne[0] != hp->n_embd || te->ne[1] == 0 || te->ne[1] > MODEL_MAX_VOCAB)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "tensor 'token_embd.weight' has shape [%llu, %llu], expected [%u, n_vocab]",
                        (unsigned long long)te->ne[0], (unsigned long long)te->ne[1], hp->n_embd);
    hp->n_vocab = (uint32_t)te->ne[1];
    return KVS_OK;
}

/* Finds a 2-D weight [n_in, n_out] and checks its shape and type. */
static int bind_weight(const gguf_ctx *g, const char *name, uint64_t n_in, uint64_t n_out, ops_weight *w,
                       uint64_t *bytes, char *msg, size_t cap) {
    const gguf_tensor *t = gguf_find_tensor(g, name);
    if (!t) return kvs_fail(msg, cap, KVS_ERR_FORMAT, "tensor '%s' is missing", name);
    if (t->n_dims != 2 || t->ne[0] != n_in || t->ne[1] != n_out)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "tensor '%s' has shape [%llu, %llu] (%u dims), expected [%llu, %llu]", name,
                        (unsigned long long)t->ne[0], (unsigned long long)t->ne[1], t->n_dims,
                        (unsigned long long)n_in, (unsigned long long)n_out);
    const quant_traits *tr = quant_get_traits(t->type);
    if (!tr || !tr->compute)
        return kvs_fail(msg, cap, KVS_ERR_UNSUPPORTED, "tensor '%s' has type %s, which kvshard cannot compute with", name,
                        tr ? tr->name : "unknown");
    uint64_t rb;
    if (!quant_row_bytes(t->type, n_in, &rb))
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "tensor '%s': row of %llu elements does not fit type %s", name,
                        (unsigned long long)n_in, tr->name);
    w->type = t->type;
    w->n_in = (int64_t)n_in;
    w->n_out = (int64_t)n_out;
    w->row_bytes = (size_t)rb;
    w->data = t->data;
    *bytes += t->size;
    return KVS_OK;
}

/* Finds a 1-D f32-able vector of n elements; converts non-f32 types into owned memory. */
static int bind_vector(model *m, const char *name, uint64_t n, const float **out, char *msg, size_t cap) {
    const gguf_tensor *t = gguf_find_tensor(m->gguf, name);
    if (!t) return kvs_fail(msg, cap, KVS_ERR_FORMAT, "tensor '%s' is missing", name);
    if (t->n_dims != 1 || t->ne[0] != n)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "tensor '%s' has %llu elements (%u dims), expected a vector of %llu", name,
                        (unsigned long long)t->ne[0], t->n_dims, (unsigned long long)n);
    m->weight_bytes += t->size;
    if (t->type == QUANT_F32 && ((uintptr_t)t->data % sizeof(float)) == 0) {
        *out = t->data;
        return KVS_OK;
    }
    const quant_traits *tr = quant_get_traits(t->type);
    if (!tr || !tr->compute || n % tr->block_elems)
        return kvs_fail(msg, cap, KVS_ERR_UNSUPPORTED, "tensor '%s' has a type kvshard cannot read as a vector", name);
    float *f = malloc(n * sizeof(float));
    float **list = realloc(m->owned_floats, (size_t)(m->n_owned_floats + 1) * sizeof(float *));
    if (!f || !list) {
        free(f);
        if (list) m->owned_floats = list;
        return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory converting '%s'", name);
    }
    m->owned_floats = list;
    m->owned_floats[m->n_owned_floats++] = f;
    quant_dequant_row(t->type, t->data, f, (int64_t)n);
    *out = f;
    return KVS_OK;
}

int model_load(const char *path, uint32_t first, uint32_t last, model **out, char *msg, size_t cap) {
    *out = NULL;
    model *m = calloc(1, sizeof(*m));
    if (!m) return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
    int err = gguf_open(path, &m->gguf, msg, cap);
    if (err) goto fail;
    model_hparams *hp = &m->hp;
    if ((err = model_read_hparams(m->gguf, hp, msg, cap))) goto fail;
    if (last == 0) last = hp->n_layer;
    if (first >= last || last > hp->n_layer) {
        err = kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "layer range [%u, %u) is not inside [0, %u)", first, last, hp->n_layer);
        goto fail;
    }
    /* The declared layer count must match the tensors present. */
    char name[96];
    for (uint32_t i = 0; i < hp->n_layer; i++) {
        snprintf(name, sizeof(name), "blk.%u.attn_q.weight", i);
        if (!gguf_find_tensor(m->gguf, name)) {
            err = kvs_fail(msg, cap, KVS_ERR_FORMAT, "block_count is %u but tensor '%s' is missing", hp->n_layer, name);
            goto fail;
        }
    }
    snprintf(name, sizeof(name), "blk.%u.attn_q.weight", hp->n_layer);
    if (gguf_find_tensor(m->gguf, name)) {
        err = kvs_fail(msg, cap, KVS_ERR_FORMAT, "block_count is %u but the file has tensor '%s'", hp->n_layer, name);
        goto fail;
    }
    m->first = first;
    m->last = last;
    m->has_embd = first == 0;
    m->has_head = last == hp->n_layer;
    m->layers = calloc(last - first, sizeof(model_layer));
    if (!m->layers) {
        err = kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
        goto fail;
    }
    uint64_t q_dim = (uint64_t)hp->n_head * hp->head_dim, kv_dim = (uint64_t)hp->n_head_kv * hp->head_dim;
    for (uint32_t i = first; i < last; i++) {
        model_layer *L = &m->layers[i - first];
        struct { const char *suffix; uint64_t n_in, n_out; ops_weight *w; } ws[] = {
            {"attn_q", hp->n_embd, q_dim, &L->wq},       {"attn_k", hp->n_embd, kv_dim, &L->wk},
            {"attn_v", hp->n_embd, kv_dim, &L->wv},      {"attn_output", q_dim, hp->n_embd, &L->wo},
            {"ffn_gate", hp->n_embd, hp->n_ff, &L->w_gate}, {"ffn_up", hp->n_embd, hp->n_ff, &L->w_up},
            {"ffn_down", hp->n_ff, hp->n_embd, &L->w_down},
        };
        for (size_t k = 0; k < sizeof(ws) / sizeof(ws[0]); k++) {
            snprintf(name, sizeof(name), "blk.%u.%s.weight", i, ws[k].suffix);
            if ((err = bind_weight(m->gguf, name, ws[k].n_in, ws[k].n_out, ws[k].w, &m->weight_bytes, msg, cap))) goto fail;
        }
        snprintf(name, sizeof(name), "blk.%u.attn_norm.weight", i);
        if ((err = bind_vector(m, name, hp->n_embd, &L->attn_norm, msg, cap))) goto fail;
        snprintf(name, sizeof(name), "blk.%u.ffn_norm.weight", i);
        if ((err = bind_vector(m, name, hp->n_embd, &L->ffn_norm, msg, cap))) goto fail;
    }
    bool tied = !gguf_find_tensor(m->gguf, "output.weight");
    if (m->has_embd || (m->has_head && tied)) {
        uint64_t b = 0;
        if ((err = bind_weight(m->gguf, "token_embd.weight", hp->n_embd, hp->n_vocab, &m->tok_embd, &b, msg, cap))) goto fail;
        m->weight_bytes += b;
    }
    if (m->has_head) {
        if ((err = bind_vector(m, "output_norm.weight", hp->n_embd, &m->out_norm, msg, cap))) goto fail;
        if (tied) {
            m->output = m->tok_embd; /* its bytes are counted once, with token_embd */
        } else if ((err = bind_weight(m->gguf, "output.weight", hp->n_embd, hp->n_vocab, &m->output, &m->weight_bytes, msg,
                                      cap))) {
            goto fail;
        }
    }
    /* Derived once here rather than on every forward call. */
    for (uint32_t l = 0; l < last - first; l++) {
        const model_layer *L = &m->layers[l];
        const ops_weight *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (size_t k = 0; k < sizeof(ws) / sizeof(ws[0]); k++) {
            size_t b = ops_matmul_scratch_bytes(ws[k], 1);
            if (b > m->act_row_bytes) m->act_row_bytes = b;
        }
    }
    if (m->has_head && ops_matmul_scratch_bytes(&m->output, 1) > m->act_row_bytes)
        m->act_row_bytes = ops_matmul_scratch_bytes(&m->output, 1);
    m->rope_inv_freq = malloc((hp->n_rot / 2 + 1) * sizeof(float));
    if (!m->rope_inv_freq) {
        err = kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
        goto fail;
    }
    ops_rope_freqs(m->rope_inv_freq, (int)hp->n_rot, hp->rope_base);
    *out = m;
    return KVS_OK;
fail:
    model_free(m);
    return err;
}

void model_free(model *m) {
    if (!m) return;
    for (int i = 0; i < m->n_owned_floats; i++) free(m->owned_floats[i]);
    free(m->owned_floats);
    free(m->rope_inv_freq);
    free(m->layers);
    gguf_close(m->gguf);
    free(m);
}

void model_embed(const model *m, int32_t id, float *out) {
    const ops_weight *w = &m->tok_embd;
    quant_dequant_row(w->type, (const uint8_t *)w->data + (size_t)id * w->row_bytes, out, w->n_in);
}
