#include "arch.h"

#include <stdio.h>
#include <string.h>

#include "util.h"

/* One row per family. llama.cpp's loader is the authority for what each
 * family's files contain: llama may carry q/k/v/output biases (some
 * fine-tunes do), qwen2 always carries q/k/v biases and no output bias. */
static const arch_info ARCHS[] = {
    {.name = "llama", .rope_style = ARCH_ROPE_NORM, .qkv_bias = ARCH_TENSOR_OPTIONAL,
     .out_bias = ARCH_TENSOR_OPTIONAL, .default_rms_eps = 1e-5f, .default_rope_base = 10000.0f},
    {.name = "qwen2", .rope_style = ARCH_ROPE_NEOX, .qkv_bias = ARCH_TENSOR_REQUIRED,
     .out_bias = ARCH_TENSOR_ABSENT, .default_rms_eps = 1e-6f, .default_rope_base = 10000.0f},
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
