#include "model.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>
#include <string.h>

#include "quant.h"
#include "util.h"

#define MODEL_MAX_EMBD 65536u
#define MODEL_MAX_LAYERS 4096u
#define MODEL_MAX_HEADS 1024u
#define MODEL_MAX_FF (1u << 20)
#define MODEL_MAX_VOCAB (1u << 22)

#define MODEL_MAX_HEAD_DIM 1024u

/* A u32 under the family's prefix; def when absent. */
static int get_u32_opt(const gguf_ctx *g, const arch_info *a, const char *suffix, uint32_t def, uint32_t *out, char *msg,
                       size_t cap) {
    char key[128];
    int err = gguf_get_u32(g, arch_key(a, suffix, key, sizeof(key)), out);
    if (err == KVS_ERR_NOT_FOUND) {
        *out = def;
        return KVS_OK;
    }
    if (err) return kvs_fail(msg, cap, KVS_ERR_FORMAT, "metadata '%s' is not a 32-bit unsigned integer", key);
    return KVS_OK;
}

static int get_f32_opt(const gguf_ctx *g, const arch_info *a, const char *suffix, float def, float *out, char *msg,
                       size_t cap) {
    char key[128];
    int err = gguf_get_f32(g, arch_key(a, suffix, key, sizeof(key)), out);
    if (err == KVS_ERR_NOT_FOUND) {
        *out = def;
        return KVS_OK;
    }
    if (err) return kvs_fail(msg, cap, KVS_ERR_FORMAT, "metadata '%s' is not a float", key);
    return KVS_OK;
}

/* rope.scaling.type (or the older rope.scale_linear) -> hp->rope_freq_scale. */
static int read_rope_scaling(const gguf_ctx *g, model_hparams *hp, char *msg, size_t cap) {
    char key[128];
    const arch_info *a = hp->arch;
    gguf_str type;
    float factor = 0.0f;
    int err;
    hp->rope_freq_scale = 1.0f;
    err = gguf_get_str(g, arch_key(a, "rope.scaling.type", key, sizeof(key)), &type);
    if (err == KVS_ERR_NOT_FOUND) {
        if ((err = get_f32_opt(g, a, "rope.scale_linear", 0.0f, &factor, msg, cap))) return err;
        if (factor == 0.0f) return KVS_OK;
    } else if (err) {
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "metadata '%s' is not a string", key);
    } else if (gguf_str_eq(type, "none")) {
        return KVS_OK;
    } else if (gguf_str_eq(type, "linear")) {
        if ((err = get_f32_opt(g, a, "rope.scaling.factor", 0.0f, &factor, msg, cap))) return err;
        if (factor == 0.0f) return KVS_OK; /* llama.cpp reads 0 as no scaling */
    } else {
        return kvs_fail(msg, cap, KVS_ERR_UNSUPPORTED,
                        "rope scaling type '%.*s' (%s) is not supported (kvshard implements none and linear)",
                        (int)(type.len > 32 ? 32 : type.len), type.ptr, key);
    }
    if (!(factor >= 1e-3f && factor <= 1e6f))
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "linear rope scaling factor %g out of range", (double)factor);
    hp->rope_freq_scale = 1.0f / factor;
    return KVS_OK;
}

/* The keys only some rows use: LongRoPE's original context and attention
 * factor, the sliding window, its pattern and its rope base. */
static int read_family_hparams(const gguf_ctx *g, model_hparams *hp, char *msg, size_t cap) {
    const arch_info *a = hp->arch;
    int err;
    hp->rope_attn_factor = 1.0f;
    hp->n_ctx_orig = hp->n_ctx;
    hp->rope_base_swa = hp->rope_base;
    if (a->longrope) {
        if ((err = get_u32_opt(g, a, "rope.scaling.original_context_length", hp->n_ctx, &hp->n_ctx_orig, msg, cap)) ||
            (err = get_f32_opt(g, a, "rope.scaling.attn_factor", 1.0f, &hp->rope_attn_factor, msg, cap)))
            return err;
        if (!(hp->rope_attn_factor > 0.0f && hp->rope_attn_factor < 100.0f))
            return kvs_fail(msg, cap, KVS_ERR_FORMAT, "rope.scaling.attn_factor %g out of range",
                            (double)hp->rope_attn_factor);
    }
    if (a->swa_period == 0) return KVS_OK; /* phi3's sliding_window key is ignored, as llama.cpp does */
    hp->swa_period = a->swa_period;
    if ((err = get_u32_opt(g, a, "attention.sliding_window", 0, &hp->n_swa, msg, cap)) ||
        (err = get_u32_opt(g, a, "attention.sliding_window_pattern", a->swa_period, &hp->swa_period, msg, cap)) ||
        (err = get_f32_opt(g, a, "rope.freq_base_swa", a->default_rope_base, &hp->rope_base_swa, msg, cap)))
        return err;
    if (hp->swa_period == 0 || hp->swa_period > MODEL_MAX_LAYERS)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "attention.sliding_window_pattern %u out of range [1, %u]",
                        hp->swa_period, MODEL_MAX_LAYERS);
    if (!(hp->rope_base_swa > 1.0f && hp->rope_base_swa < 1e12f))
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "rope.freq_base_swa %g out of range", (double)hp->rope_base_swa);
    return KVS_OK;
}

int model_read_hparams(const gguf_set *files, model_hparams *hp, char *msg, size_t cap) {
    memset(hp, 0, sizeof(*hp));
    const gguf_ctx *g = gguf_set_meta(files);
    int err = arch_from_gguf(g, &hp->arch, msg, cap);
    if (err) return err;
    const arch_info *a = hp->arch;
    char key[128];
    static const struct { const char *suffix; size_t off; } required[] = {
        {"embedding_length", offsetof(model_hparams, n_embd)},
        {"block_count", offsetof(model_hparams, n_layer)},
        {"attention.head_count", offsetof(model_hparams, n_head)},
        {"feed_forward_length", offsetof(model_hparams, n_ff)},
    };
    for (size_t i = 0; i < sizeof(required) / sizeof(required[0]); i++) {
        uint32_t *dst = (uint32_t *)((char *)hp + required[i].off);
        err = gguf_get_u32(g, arch_key(a, required[i].suffix, key, sizeof(key)), dst);
        if (err == KVS_ERR_NOT_FOUND) return kvs_fail(msg, cap, KVS_ERR_FORMAT, "metadata '%s' is missing", key);
        if (err) return kvs_fail(msg, cap, KVS_ERR_FORMAT, "metadata '%s' is not a 32-bit unsigned integer", key);
    }
    uint32_t n_expert = 0;
    if ((err = get_u32_opt(g, a, "expert_count", 0, &n_expert, msg, cap))) return err;
    if (n_expert > 0)
        return kvs_fail(msg, cap, KVS_ERR_UNSUPPORTED,
                        "'%s.expert_count' is %u: mixture-of-experts models (e.g. Mixtral) are not supported "
                        "(kvshard runs dense models)",
                        a->name, n_expert);
    if ((err = get_u32_opt(g, a, "attention.head_count_kv", hp->n_head, &hp->n_head_kv, msg, cap))) return err;
    if ((err = get_u32_opt(g, a, "context_length", 2048, &hp->n_ctx, msg, cap))) return err;
    if (hp->n_embd == 0 || hp->n_embd > MODEL_MAX_EMBD)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "embedding_length %u out of range [1, %u]", hp->n_embd, MODEL_MAX_EMBD);
    if (hp->n_layer == 0 || hp->n_layer > MODEL_MAX_LAYERS)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "block_count %u out of range [1, %u]", hp->n_layer, MODEL_MAX_LAYERS);
    if (hp->n_head == 0 || hp->n_head > MODEL_MAX_HEADS)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "head_count %u out of range [1, %u]", hp->n_head, MODEL_MAX_HEADS);
    if (hp->n_head_kv == 0 || hp->n_head_kv > hp->n_head || hp->n_head % hp->n_head_kv != 0)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "head_count_kv %u must be >= 1 and divide head_count %u", hp->n_head_kv,
                        hp->n_head);
    if (hp->n_ff == 0 || hp->n_ff > MODEL_MAX_FF)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "feed_forward_length %u out of range [1, %u]", hp->n_ff, MODEL_MAX_FF);
    if (hp->n_ctx == 0) return kvs_fail(msg, cap, KVS_ERR_FORMAT, "context_length is 0");
    /* Head size: key_length / value_length where the file says so, else n_embd / n_head. */
    uint32_t k_len = 0, v_len = 0;
    if ((err = get_u32_opt(g, a, "attention.key_length", 0, &k_len, msg, cap)) ||
        (err = get_u32_opt(g, a, "attention.value_length", 0, &v_len, msg, cap)))
        return err;
    if ((k_len == 0 || v_len == 0) && hp->n_embd % hp->n_head != 0)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "embedding_length %u is not a multiple of head_count %u", hp->n_embd,
                        hp->n_head);
    if (k_len == 0) k_len = hp->n_embd / hp->n_head;
    if (v_len == 0) v_len = hp->n_embd / hp->n_head;
    if (k_len != v_len)
        return kvs_fail(msg, cap, KVS_ERR_UNSUPPORTED,
                        "attention.key_length %u differs from attention.value_length %u (kvshard needs one head size)",
                        k_len, v_len);
    if (k_len > MODEL_MAX_HEAD_DIM)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "attention.key_length %u out of range [1, %u]", k_len, MODEL_MAX_HEAD_DIM);
    hp->head_dim = k_len;
    if ((err = get_u32_opt(g, a, "rope.dimension_count", hp->head_dim, &hp->n_rot, msg, cap))) return err;
    if (hp->n_rot == 0 || hp->n_rot > hp->head_dim || hp->n_rot % 2)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "rope.dimension_count %u must be even and in [2, head_dim %u]", hp->n_rot,
                        hp->head_dim);
    if ((err = get_f32_opt(g, a, "rope.freq_base", a->default_rope_base, &hp->rope_base, msg, cap))) return err;
    if (!(hp->rope_base > 1.0f && hp->rope_base < 1e12f))
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "rope.freq_base %g out of range", (double)hp->rope_base);
    if ((err = read_rope_scaling(g, hp, msg, cap)) || (err = read_family_hparams(g, hp, msg, cap))) return err;
    if ((err = get_f32_opt(g, a, "attention.layer_norm_rms_epsilon", a->default_rms_eps, &hp->rms_eps, msg, cap)))
        return err;
    if (!(hp->rms_eps > 0.0f && hp->rms_eps < 1.0f))
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "layer_norm_rms_epsilon %g out of range (0, 1)", (double)hp->rms_eps);
    const gguf_tensor *te = gguf_set_find_tensor(files, "token_embd.weight", NULL);
    if (!te) return kvs_fail(msg, cap, KVS_ERR_FORMAT, "tensor 'token_embd.weight' is missing");
    if (te->n_dims != 2 || te->ne[0] != hp->n_embd || te->ne[1] == 0 || te->ne[1] > MODEL_MAX_VOCAB)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "tensor 'token_embd.weight' has shape [%llu, %llu], expected [%u, n_vocab]",
                        (unsigned long long)te->ne[0], (unsigned long long)te->ne[1], hp->n_embd);
    hp->n_vocab = (uint32_t)te->ne[1];
    return KVS_OK;
}

/* True when blk.N.SUFFIX is a tensor the forward pass uses for family a. */
static bool layer_tensor_known(const arch_info *a, const char *suffix) {
    static const char *const always[] = {"attn_norm.weight", "attn_output.weight", "ffn_norm.weight",
                                         "ffn_up.weight", "ffn_down.weight"};
    static const char *const qkv[] = {"attn_q.weight", "attn_k.weight", "attn_v.weight"};
    static const char *const qkv_bias[] = {"attn_q.bias", "attn_k.bias", "attn_v.bias"};
    for (size_t k = 0; k < sizeof(always) / sizeof(always[0]); k++)
        if (!strcmp(suffix, always[k])) return true;
    for (size_t k = 0; k < 3; k++)
        if (!strcmp(suffix, qkv[k]) || (a->qkv_bias != ARCH_TENSOR_ABSENT && !strcmp(suffix, qkv_bias[k]))) return true;
    if (a->out_bias != ARCH_TENSOR_ABSENT && !strcmp(suffix, "attn_output.bias")) return true;
    if (!a->fused_gate_up && !strcmp(suffix, "ffn_gate.weight")) return true;
    if (a->fused_qkv && !strcmp(suffix, "attn_qkv.weight")) return true;
    if (a->qk_norm != ARCH_TENSOR_ABSENT && (!strcmp(suffix, "attn_q_norm.weight") || !strcmp(suffix, "attn_k_norm.weight")))
        return true;
    return a->post_norms && (!strcmp(suffix, "post_attention_norm.weight") || !strcmp(suffix, "post_ffw_norm.weight"));
}

/* Every tensor of the file must be one the forward pass uses: a file with
 * others (experts, extra norms) would silently compute something else. */
static int check_tensor_names(const gguf_set *files, const model_hparams *hp, char *msg, size_t cap) {
    static const char *const global[] = {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"};
    static const char *const longrope[] = {"rope_factors_long.weight", "rope_factors_short.weight"};
    for (uint64_t i = 0; i < gguf_set_n_tensors(files); i++) {
        const gguf_tensor *t = gguf_set_tensor_at(files, i);
        char name[GGUF_MAX_NAME_LEN + 1];
        snprintf(name, sizeof(name), "%.*s", (int)t->name.len, t->name.ptr);
        bool known = false;
        for (size_t k = 0; k < sizeof(global) / sizeof(global[0]) && !known; k++) known = !strcmp(name, global[k]);
        for (size_t k = 0; k < 2 && !known && hp->arch->longrope; k++) known = !strcmp(name, longrope[k]);
        unsigned blk;
        int used = 0;
        if (!known && sscanf(name, "blk.%u.%n", &blk, &used) == 1 && used > 0 && blk < hp->n_layer)
            known = layer_tensor_known(hp->arch, name + used);
        if (!known && strstr(name, "_exps."))
            return kvs_fail(msg, cap, KVS_ERR_UNSUPPORTED,
                            "tensor '%s' holds mixture-of-experts weights: kvshard runs dense models only", name);
        if (!known && (strstr(name, "per_layer") || strstr(name, "altup") || strstr(name, "laurel")))
            return kvs_fail(msg, cap, KVS_ERR_UNSUPPORTED,
                            "tensor '%s' belongs to per-layer embeddings (Gemma 3n style), which kvshard does not "
                            "implement", name);
        if (!known)
            return kvs_fail(msg, cap, KVS_ERR_UNSUPPORTED,
                            "tensor '%s' is not used by a dense '%s' model; kvshard cannot run this file correctly",
                            name, hp->arch->name);
    }
    return KVS_OK;
}

/* Finds a 2-D weight [n_in, n_out] and checks its shape and type. */
static int bind_weight(gguf_set *files, const char *name, uint64_t n_in, uint64_t n_out, ops_weight *w,
                       uint64_t *bytes, char *msg, size_t cap) {
    const gguf_tensor *t = NULL;
    int err = gguf_set_map_tensor(files, name, &t, msg, cap);
    if (err == KVS_ERR_NOT_FOUND) return kvs_fail(msg, cap, KVS_ERR_FORMAT, "tensor '%s' is missing", name);
    if (err) return err;
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
    /* Every field, layout included: a fused matrix is bound into a stack struct
     * whose garbage layout once made the loader skip repacking its parts. */
    *w = (ops_weight){.type = t->type, .n_in = (int64_t)n_in, .n_out = (int64_t)n_out, .row_bytes = (size_t)rb,
                      .data = t->data, .layout = OPS_ROWS};
    *bytes += t->size;
    return KVS_OK;
}

/* Adds p to the memory freed with the model; false (p not added) when out of memory. */
static bool own(model *m, void *p) {
    void **list = realloc(m->owned, (size_t)(m->n_owned + 1) * sizeof(void *));
    if (!list) return false;
    m->owned = list;
    m->owned[m->n_owned++] = p;
    return true;
}

/* True when the loader repacks w into the r8 layout (quant.h): the CPU has an
 * r8 kernel for its type and it has a multiple of 8 rows. */
static bool repacks(const ops_weight *w) {
    return w->layout == OPS_ROWS && quant_r8_preferred(w->type) && w->n_out % 8 == 0;
}

typedef struct {
    const ops_weight *w;
    uint8_t *dst;
} repack_job;

/* Groups [g0, g1) of a repack_job's matrix. */
static void repack_task(void *arg, int64_t g0, int64_t g1, int slot) {
    (void)slot;
    const repack_job *j = arg;
    const uint8_t *src = j->w->data;
    for (int64_t g = g0; g < g1; g++) {
        const size_t off = (size_t)g * 8 * j->w->row_bytes;
        quant_r8_pack(j->w->type, j->w->n_in, src + off, j->w->row_bytes, j->dst + off);
    }
}

/* Repacks matrix w (repacks(w)) into the next w's bytes of the model's repack
 * arena at *at, its row groups shared out over pool (NULL: this thread); the
 * pages of the mapping that lie wholly inside the old rows are then released,
 * so it stays resident once. Not for a matrix whose rows are also read one by
 * one (the embeddings). */
static void repack_weight(model *m, ops_pool *pool, ops_weight *w, size_t *at) {
    const size_t bytes = (size_t)w->n_out * w->row_bytes;
    uint8_t *p = (uint8_t *)m->repacked + *at;
    *at += (bytes + 63) / 64 * 64;
    const uint8_t *src = w->data;
    repack_job job = {.w = w, .dst = p};
    if (pool) ops_parallel_for(pool, w->n_out / 8, 16, repack_task, &job);
    else repack_task(&job, 0, w->n_out / 8, 0);
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t pg = page > 0 ? (uintptr_t)page : 4096, lo = ((uintptr_t)src + pg - 1) / pg * pg,
              hi = ((uintptr_t)src + bytes) / pg * pg;
    if (hi > lo) (void)madvise((void *)lo, hi - lo, MADV_DONTNEED); /* advice only: the bytes stay valid */
    w->data = p;
    w->layout = OPS_R8;
    m->n_repacked++;
}

/* Matrix i of those the loader may repack: the owned layers' (i < layers x
 * MODEL_LAYER_MATRICES), then the output when it is not tied; NULL past them. */
static ops_weight *repack_candidate(model *m, bool tied, int i) {
    const int n_layer = (int)(m->last - m->first) * MODEL_LAYER_MATRICES;
    if (i < n_layer) /* model_layer_matrix reads; m is the loader's own */
        return (ops_weight *)model_layer_matrix(&m->layers[i / MODEL_LAYER_MATRICES], i % MODEL_LAYER_MATRICES);
    return i == n_layer && m->has_head && !tied ? &m->output : NULL;
}

/* Repacks every candidate matrix the loader repacks into one arena (one
 * mapping, in 2 MiB pages where the kernel gives them: a decode step walks all
 * of it, and 4 KiB pages would cost a TLB miss every 4 KiB), on pool's
 * threads (NULL: this one). KVS_OK or KVS_ERR_NOMEM (nothing repacked). */
static int repack_weights(model *m, bool tied, ops_pool *pool, char *msg, size_t cap) {
    size_t total = 0;
    ops_weight *w;
    for (int i = 0; (w = repack_candidate(m, tied, i)); i++)
        if (repacks(w)) total += ((size_t)w->n_out * w->row_bytes + 63) / 64 * 64;
    if (total == 0) return KVS_OK;
    if (!(m->repacked = kvs_map_big(total, false, &m->repacked_mapped)))
        return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory repacking %zu bytes of weights", total);
    size_t at = 0;
    for (int i = 0; (w = repack_candidate(m, tied, i)); i++)
        if (repacks(w)) repack_weight(m, pool, w, &at);
    return KVS_OK;
}

/* Finds a 1-D f32-able vector of n elements; converts non-f32 types into owned memory. */
static int bind_vector(model *m, const char *name, uint64_t n, const float **out, char *msg, size_t cap) {
    const gguf_tensor *t = NULL;
    int err = gguf_set_map_tensor(m->files, name, &t, msg, cap);
    if (err == KVS_ERR_NOT_FOUND) return kvs_fail(msg, cap, KVS_ERR_FORMAT, "tensor '%s' is missing", name);
    if (err) return err;
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
    if (!f || !own(m, f)) {
        free(f);
        return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory converting '%s'", name);
    }
    quant_dequant_row(t->type, t->data, f, (int64_t)n);
    *out = f;
    return KVS_OK;
}

/* Optional bias vector: NULL when absent and allowed, an error when required. */
static int bind_bias(model *m, const char *name, arch_tensor_rule rule, uint64_t n, const float **out, char *msg,
                     size_t cap) {
    *out = NULL;
    if (rule == ARCH_TENSOR_OPTIONAL && !gguf_set_find_tensor(m->files, name, NULL)) return KVS_OK;
    return bind_vector(m, name, n, out, msg, cap);
}

/* The per-dimension divisors of the inverse frequencies: rope_freqs.weight
 * (Llama 3.1+), or LongRoPE's long or short set. llama.cpp uses the long set
 * whenever its context exceeds the original one; a kvshard session may grow
 * to the training context, so the long set is the one whenever the training
 * context exceeds the original (every Phi-3 128k file). NULL when none. */
static int read_rope_factors(model *m, const float **factors, char *msg, size_t cap) {
    *factors = NULL;
    const char *name = "rope_freqs.weight";
    if (m->hp.arch->longrope && gguf_set_find_tensor(m->files, "rope_factors_long.weight", NULL))
        name = m->hp.n_ctx > m->hp.n_ctx_orig ? "rope_factors_long.weight" : "rope_factors_short.weight";
    if (!gguf_set_find_tensor(m->files, name, NULL)) return KVS_OK;
    uint32_t n = m->hp.n_rot / 2;
    int err = bind_vector(m, name, n, factors, msg, cap);
    if (err) return err;
    for (uint32_t i = 0; i < n; i++)
        if (!((*factors)[i] > 0.0f && (*factors)[i] < 1e30f))
            return kvs_fail(msg, cap, KVS_ERR_FORMAT, "%s[%u] = %g is not a positive factor", name, i,
                            (double)(*factors)[i]);
    return KVS_OK;
}

/* Derives the rope frequencies once: the global layers' (rope_base, linear
 * scaling, divisors) and, when a layer is local, the local layers' (their own
 * base, no linear scaling: llama.cpp scales only the global layers). */
static int set_rope(model *m, char *msg, size_t cap) {
    const model_hparams *hp = &m->hp;
    const float *factors = NULL;
    int err = read_rope_factors(m, &factors, msg, cap);
    if (err) return err;
    m->rope_inv_freq = malloc((hp->n_rot / 2 + 1) * sizeof(float));
    if (!m->rope_inv_freq) return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
    ops_rope_freqs(m->rope_inv_freq, (int)hp->n_rot, hp->rope_base, hp->rope_freq_scale, factors);
    if (hp->n_swa == 0) return KVS_OK;
    m->rope_inv_freq_swa = malloc((hp->n_rot / 2 + 1) * sizeof(float));
    if (!m->rope_inv_freq_swa) return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
    ops_rope_freqs(m->rope_inv_freq_swa, (int)hp->n_rot, hp->rope_base_swa, 1.0f, factors);
    return KVS_OK;
}

/* Views rows [row0, row0 + n_out) of the fused matrix w as a matrix of its
 * own: a fused tensor's parts are whole rows one after another, so each part
 * is multiplied, repacked and split across threads like a separate tensor. */
static ops_weight weight_rows(const ops_weight *w, int64_t row0, int64_t n_out) {
    ops_weight part = *w;
    part.data = (const uint8_t *)w->data + (size_t)row0 * w->row_bytes;
    part.n_out = n_out;
    return part;
}

/* Binds the matrices of layer i: q, k, v separate or from attn_qkv (its rows
 * q, k, v in that order), gate and up separate or from a fused ffn_up (gate
 * rows, then up rows). */
static int bind_layer_matrices(model *m, uint32_t i, model_layer *L, char *msg, size_t cap) {
    const model_hparams *hp = &m->hp;
    const uint64_t q_dim = (uint64_t)hp->n_head * hp->head_dim, kv_dim = (uint64_t)hp->n_head_kv * hp->head_dim;
    char name[96];
    int err;
    snprintf(name, sizeof(name), "blk.%u.attn_qkv.weight", i);
    if (hp->arch->fused_qkv && gguf_set_find_tensor(m->files, name, NULL)) {
        ops_weight w;
        if ((err = bind_weight(m->files, name, hp->n_embd, q_dim + 2 * kv_dim, &w, &m->weight_bytes, msg, cap))) return err;
        L->wq = weight_rows(&w, 0, (int64_t)q_dim);
        L->wk = weight_rows(&w, (int64_t)q_dim, (int64_t)kv_dim);
        L->wv = weight_rows(&w, (int64_t)(q_dim + kv_dim), (int64_t)kv_dim);
    } else {
        struct { const char *suffix; uint64_t n_out; ops_weight *w; } ws[] = {
            {"attn_q", q_dim, &L->wq}, {"attn_k", kv_dim, &L->wk}, {"attn_v", kv_dim, &L->wv}};
        for (size_t k = 0; k < 3; k++) {
            snprintf(name, sizeof(name), "blk.%u.%s.weight", i, ws[k].suffix);
            if ((err = bind_weight(m->files, name, hp->n_embd, ws[k].n_out, ws[k].w, &m->weight_bytes, msg, cap))) return err;
        }
    }
    snprintf(name, sizeof(name), "blk.%u.attn_output.weight", i);
    if ((err = bind_weight(m->files, name, q_dim, hp->n_embd, &L->wo, &m->weight_bytes, msg, cap))) return err;
    snprintf(name, sizeof(name), "blk.%u.ffn_down.weight", i);
    if ((err = bind_weight(m->files, name, hp->n_ff, hp->n_embd, &L->w_down, &m->weight_bytes, msg, cap))) return err;
    snprintf(name, sizeof(name), "blk.%u.ffn_up.weight", i);
    if (hp->arch->fused_gate_up) {
        ops_weight w;
        if ((err = bind_weight(m->files, name, hp->n_embd, 2 * (uint64_t)hp->n_ff, &w, &m->weight_bytes, msg, cap)))
            return err;
        L->w_gate = weight_rows(&w, 0, hp->n_ff);
        L->w_up = weight_rows(&w, hp->n_ff, hp->n_ff);
        return KVS_OK;
    }
    if ((err = bind_weight(m->files, name, hp->n_embd, hp->n_ff, &L->w_up, &m->weight_bytes, msg, cap))) return err;
    snprintf(name, sizeof(name), "blk.%u.ffn_gate.weight", i);
    return bind_weight(m->files, name, hp->n_embd, hp->n_ff, &L->w_gate, &m->weight_bytes, msg, cap);
}

/* Binds layer i (of the whole model) into L: its matrices, norms and the
 * biases and norms its family has. */
static int bind_layer(model *m, uint32_t i, model_layer *L, char *msg, size_t cap) {
    const model_hparams *hp = &m->hp;
    const arch_info *a = hp->arch;
    const uint64_t q_dim = (uint64_t)hp->n_head * hp->head_dim, kv_dim = (uint64_t)hp->n_head_kv * hp->head_dim;
    char name[96];
    int err;
    if ((err = bind_layer_matrices(m, i, L, msg, cap))) return err;
    struct { const char *suffix; bool used; uint64_t n; const float **v; } vs[] = {
        {"attn_norm", true, hp->n_embd, &L->attn_norm},
        {"ffn_norm", true, hp->n_embd, &L->ffn_norm},
        {"attn_q_norm", a->qk_norm == ARCH_TENSOR_REQUIRED, hp->head_dim, &L->q_norm},
        {"attn_k_norm", a->qk_norm == ARCH_TENSOR_REQUIRED, hp->head_dim, &L->k_norm},
        {"post_attention_norm", a->post_norms, hp->n_embd, &L->post_attn_norm},
        {"post_ffw_norm", a->post_norms, hp->n_embd, &L->post_ffn_norm},
    };
    for (size_t k = 0; k < sizeof(vs) / sizeof(vs[0]); k++) {
        if (!vs[k].used) continue;
        snprintf(name, sizeof(name), "blk.%u.%s.weight", i, vs[k].suffix);
        if ((err = bind_vector(m, name, vs[k].n, vs[k].v, msg, cap))) return err;
    }
    struct { const char *suffix; arch_tensor_rule rule; uint64_t n; const float **b; } bs[] = {
        {"attn_q", a->qkv_bias, q_dim, &L->bq}, {"attn_k", a->qkv_bias, kv_dim, &L->bk},
        {"attn_v", a->qkv_bias, kv_dim, &L->bv}, {"attn_output", a->out_bias, hp->n_embd, &L->bo},
    };
    for (size_t k = 0; k < sizeof(bs) / sizeof(bs[0]); k++) {
        if (bs[k].rule == ARCH_TENSOR_ABSENT) continue; /* check_tensor_names refused any present */
        snprintf(name, sizeof(name), "blk.%u.%s.bias", i, bs[k].suffix);
        if ((err = bind_bias(m, name, bs[k].rule, bs[k].n, bs[k].b, msg, cap))) return err;
    }
    return KVS_OK;
}

/* The tensors a range [first, last) maps: its layers', the rope factors, token_embd for the
 * head (or a tail with a tied output), output_norm / output for the tail. */
static bool range_wants(const char *name, void *user) {
    const model *m = user;
    unsigned blk;
    if (sscanf(name, "blk.%u.", &blk) == 1) return blk >= m->first && blk < m->last;
    if (!strcmp(name, "token_embd.weight"))
        return m->has_embd || (m->has_head && !gguf_set_find_tensor(m->files, "output.weight", NULL));
    if (!strncmp(name, "output", 6)) return m->has_head;
    return true;
}

int model_load(const char *path, uint32_t first, uint32_t last, model **out, char *msg, size_t cap) {
    return model_load_on(path, first, last, NULL, out, msg, cap);
}

int model_load_on(const char *path, uint32_t first, uint32_t last, ops_pool *pool, model **out, char *msg,
                  size_t cap) {
    *out = NULL;
    model *m = calloc(1, sizeof(*m));
    if (!m) return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
    int err = gguf_set_open(path, &m->files, msg, cap);
    if (err) goto fail;
    m->gguf = gguf_set_meta(m->files);
    model_hparams *hp = &m->hp;
    if ((err = model_read_hparams(m->files, hp, msg, cap))) goto fail;
    if (last == 0) last = hp->n_layer;
    if (first >= last && last <= hp->n_layer) {
        err = kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "layer range [%u, %u) is empty: LAST must be above FIRST", first,
                       last);
        goto fail;
    }
    if (first >= last || last > hp->n_layer) {
        err = kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "layer range [%u, %u) is not inside [0, %u)", first, last, hp->n_layer);
        goto fail;
    }
    /* The declared layer count must match the tensors present. */
    char name[96];
    for (uint32_t i = 0; i < hp->n_layer; i++) {
        snprintf(name, sizeof(name), "blk.%u.attn_norm.weight", i);
        if (!gguf_set_find_tensor(m->files, name, NULL)) {
            err = kvs_fail(msg, cap, KVS_ERR_FORMAT, "block_count is %u but tensor '%s' is missing", hp->n_layer, name);
            goto fail;
        }
    }
    snprintf(name, sizeof(name), "blk.%u.attn_norm.weight", hp->n_layer);
    if (gguf_set_find_tensor(m->files, name, NULL)) {
        err = kvs_fail(msg, cap, KVS_ERR_FORMAT, "block_count is %u but the file has tensor '%s'", hp->n_layer, name);
        goto fail;
    }
    if ((err = check_tensor_names(m->files, hp, msg, cap))) goto fail;
    m->first = first;
    m->last = last;
    m->has_embd = first == 0;
    m->has_head = last == hp->n_layer;
    m->layers = calloc(last - first, sizeof(model_layer));
    if (!m->layers) {
        err = kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
        goto fail;
    }
    /* A split's manifest: the owned tensors are checked at once, over the pool's threads. */
    if ((err = gguf_set_verify(m->files, range_wants, m, pool ? (uint32_t)ops_pool_threads(pool) : 1, msg, cap))) goto fail;
    for (uint32_t i = first; i < last; i++)
        if ((err = bind_layer(m, i, &m->layers[i - first], msg, cap))) goto fail;
    bool tied = !gguf_set_find_tensor(m->files, "output.weight", NULL);
    if (m->has_embd || (m->has_head && tied)) {
        uint64_t b = 0;
        if ((err = bind_weight(m->files, "token_embd.weight", hp->n_embd, hp->n_vocab, &m->tok_embd, &b, msg, cap))) goto fail;
        m->weight_bytes += b;
    }
    if (m->has_head) {
        if ((err = bind_vector(m, "output_norm.weight", hp->n_embd, &m->out_norm, msg, cap))) goto fail;
        if (tied) {
            m->output = m->tok_embd; /* its bytes are counted once, with token_embd */
        } else if ((err = bind_weight(m->files, "output.weight", hp->n_embd, hp->n_vocab, &m->output, &m->weight_bytes, msg,
                                      cap))) {
            goto fail;
        }
    }
    if ((err = repack_weights(m, tied, pool, msg, cap))) goto fail;
    /* Derived once here rather than on every forward call. */
    for (uint32_t l = 0; l < last - first; l++)
        for (int k = 0; k < MODEL_LAYER_MATRICES; k++) {
            size_t b = ops_matmul_scratch_bytes(model_layer_matrix(&m->layers[l], k), 1);
            if (b > m->act_row_bytes) m->act_row_bytes = b;
        }
    if (m->has_head && ops_matmul_scratch_bytes(&m->output, 1) > m->act_row_bytes)
        m->act_row_bytes = ops_matmul_scratch_bytes(&m->output, 1);
    if ((err = set_rope(m, msg, cap))) goto fail;
    *out = m;
    return KVS_OK;
fail:
    model_free(m);
    return err;
}

void model_free(model *m) {
    if (!m) return;
    for (int i = 0; i < m->n_owned; i++) free(m->owned[i]);
    free(m->owned);
    kvs_unmap_big(m->repacked, m->repacked_mapped);
    free(m->rope_inv_freq);
    free(m->rope_inv_freq_swa);
    free(m->layers);
    gguf_set_close(m->files);
    free(m);
}

uint64_t model_mapped_data_bytes(const model *m) { return gguf_set_mapped_data_bytes(m->files); }

int model_split_plan(const gguf_ctx *g, uint32_t n_parts, uint32_t *part_of, char *msg, size_t cap) {
    uint32_t n_layer = 0;
    gguf_str arch;
    char key[128];
    if (gguf_get_str(g, "general.architecture", &arch) != KVS_OK || arch.len > 64)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "metadata 'general.architecture' is missing");
    snprintf(key, sizeof(key), "%.*s.block_count", (int)arch.len, arch.ptr);
    if (gguf_get_u32(g, key, &n_layer) != KVS_OK || n_layer == 0)
        return kvs_fail(msg, cap, KVS_ERR_FORMAT, "metadata '%s' is missing or 0", key);
    if (n_parts == 0 || n_parts > n_layer + 1 || n_parts > GGUF_SPLIT_MAX_PARTS)
        return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "%u parts for %u layers: each part must hold a layer or the head",
                        n_parts, n_layer);
    for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
        const gguf_tensor *t = gguf_tensor_at(g, i);
        char name[GGUF_MAX_NAME_LEN + 1];
        snprintf(name, sizeof(name), "%.*s", (int)t->name.len, t->name.ptr);
        unsigned blk;
        if (sscanf(name, "blk.%u.", &blk) == 1 && blk < n_layer)
            part_of[i] = (uint32_t)((uint64_t)blk * n_parts / n_layer);
        else if (!strcmp(name, "output.weight") || !strcmp(name, "output_norm.weight"))
            part_of[i] = n_parts - 1;
        else
            part_of[i] = 0;
    }
    return KVS_OK;
}

void model_embed(const model *m, int32_t id, float *out) {
    const ops_weight *w = &m->tok_embd;
    quant_dequant_row(w->type, (const uint8_t *)w->data + (size_t)id * w->row_bytes, out, w->n_in);
}
