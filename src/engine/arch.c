#include "arch.h"

#include <stdio.h>
#include <string.h>

#include "util.h"

/* One row per family. llama.cpp's loader (src/llama-model.cpp) and its graph
 * builders (src/models/NAME.cpp) are the authority for what each family's
 * files contain: llama may carry q/k/v/output biases (some fine-tunes do),
 * qwen2 always carries q/k/v biases and no output bias; qwen3 drops the biases
 * for q/k norms; gemma3 layers are local but every 6th (llama.cpp's default
 * pattern, real files carry no pattern key); phi3 may split attn_qkv into
 * three matrices but always fuses gate and up. */
static const arch_info ARCHS[] = {
    {.name = "llama", .rope_style = ARCH_ROPE_NORM, .qkv_bias = ARCH_TENSOR_OPTIONAL,
     .out_bias = ARCH_TENSOR_OPTIONAL, .default_rms_eps = 1e-5f, .default_rope_base = 10000.0f},
    {.name = "qwen2", .rope_style = ARCH_ROPE_NEOX, .qkv_bias = ARCH_TENSOR_REQUIRED,
     .out_bias = ARCH_TENSOR_ABSENT, .default_rms_eps = 1e-6f, .default_rope_base = 10000.0f},
    {.name = "qwen3", .rope_style = ARCH_ROPE_NEOX, .qkv_bias = ARCH_TENSOR_ABSENT, .out_bias = ARCH_TENSOR_ABSENT,
     .default_rms_eps = 1e-6f, .default_rope_base = 10000.0f, .qk_norm = ARCH_TENSOR_REQUIRED},
    {.name = "gemma3", .rope_style = ARCH_ROPE_NEOX, .qkv_bias = ARCH_TENSOR_ABSENT, .out_bias = ARCH_TENSOR_ABSENT,
     .default_rms_eps = 1e-6f, .default_rope_base = 10000.0f, .qk_norm = ARCH_TENSOR_REQUIRED, .post_norms = true,
     .embd_scale = true, .ffn_act = ARCH_FFN_GELU_TANH, .swa_period = 6},
    {.name = "phi3", .rope_style = ARCH_ROPE_NEOX, .qkv_bias = ARCH_TENSOR_ABSENT, .out_bias = ARCH_TENSOR_ABSENT,
     .default_rms_eps = 1e-5f, .default_rope_base = 10000.0f, .fused_qkv = true, .fused_gate_up = true,
     .longrope = true},
};

/* Families llama.cpp runs whose layers the one forward pass cannot express:
 * refused by name with what is missing, rather than as merely unknown. */
static const struct {
    const char *name, *why;
} OUT_OF_REACH[] = {
    {"qwen35", "hybrid recurrent layers (gated delta-net) beside attention"},
    {"qwen35moe", "hybrid recurrent layers (gated delta-net) and a mixture of experts"},
    {"qwen3next", "hybrid recurrent layers (gated delta-net) and a mixture of experts"},
    {"gemma3n", "per-layer embeddings (and altup / laurel blocks)"},
    {"gemma4", "per-layer embeddings"},
    {"qwen2moe", "a mixture of experts"},
    {"qwen3moe", "a mixture of experts"},
    {"phimoe", "a mixture of experts"},
    {"llama4", "a mixture of experts"},
    {"mixtral", "a mixture of experts"},
};
#define N_ARCHS ((int)(sizeof(ARCHS) / sizeof(ARCHS[0])))

const arch_info *arch_at(int i) { return i >= 0 && i < N_ARCHS ? &ARCHS[i] : NULL; }

const arch_info *arch_find(const char *name) {
    for (int i = 0; name && i < N_ARCHS; i++)
        if (!strcmp(ARCHS[i].name, name)) return &ARCHS[i];
    return NULL;
}

int arch_from_gguf(const gguf_ctx *g, const arch_info **out, char *msg, size_t cap) {
    *out = NULL;
    gguf_str s;
    int err = gguf_get_str(g, "general.architecture", &s);
    if (err == KVS_ERR_NOT_FOUND) return kvs_fail(msg, cap, KVS_ERR_FORMAT, "metadata 'general.architecture' is missing");
    if (err) return kvs_fail(msg, cap, KVS_ERR_FORMAT, "metadata 'general.architecture' is not a string");
    for (int i = 0; i < N_ARCHS; i++)
        if (gguf_str_eq(s, ARCHS[i].name)) {
            *out = &ARCHS[i];
            return KVS_OK;
        }
    for (size_t i = 0; i < sizeof(OUT_OF_REACH) / sizeof(OUT_OF_REACH[0]); i++)
        if (gguf_str_eq(s, OUT_OF_REACH[i].name))
            return kvs_fail(msg, cap, KVS_ERR_UNSUPPORTED,
                            "architecture '%s' is not supported: it needs %s, which kvshard does not implement",
                            OUT_OF_REACH[i].name, OUT_OF_REACH[i].why);
    char list[128] = "";
    size_t len = 0;
    for (int i = 0; i < N_ARCHS && len < sizeof(list); i++)
        len += (size_t)snprintf(list + len, sizeof(list) - len, "%s%s", i ? ", " : "", ARCHS[i].name);
    return kvs_fail(msg, cap, KVS_ERR_UNSUPPORTED, "architecture '%.*s' is not supported (kvshard runs: %s)",
                    (int)(s.len > 64 ? 64 : s.len), s.ptr, list);
}

const char *arch_key(const arch_info *a, const char *suffix, char *buf, size_t cap) {
    snprintf(buf, cap, "%s.%s", a->name, suffix);
    return buf;
}
