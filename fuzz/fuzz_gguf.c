/* fuzz_gguf — libFuzzer target for the GGUF reader (gguf_open_buffer).
 *
 * Build: CC=clang cmake -DKVS_FUZZ=ON ... ; for coverage inside the library,
 * also pass -DCMAKE_C_FLAGS=-fsanitize=fuzzer-no-link (the target itself is
 * built with -fsanitize=fuzzer,address,undefined).
 * Run:   ./fuzz_gguf -max_total_time=60 -max_len=400000 corpus_dir
 *        (seed corpus_dir with a real model, e.g. stories260K-Q4_0.gguf).
 *
 * Every accepted input is walked through the whole read API, so that a
 * pointer or count that escaped validation shows up as an ASan report. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "kvshard.h"
#include "quant.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static volatile uint64_t sink;

static void touch(const void *p, uint64_t n) {
    const uint8_t *b = p;
    if (n > 0) sink += (uint64_t)b[0] + b[n - 1];
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    gguf_ctx *g = NULL;
    char msg[KVS_MSG_MAX];
    msg[0] = '\0';
    int rc = gguf_open_buffer(data, size, &g, msg, sizeof msg);
    if (rc != KVS_OK) {
        if (g != NULL || msg[0] == '\0') abort(); /* a refusal must say why and return nothing */
        return 0;
    }
    uint64_t data_off = gguf_data_offset(g);
    for (uint64_t i = 0; i < gguf_n_kv(g); i++) {
        const gguf_kv *kv = gguf_kv_at(g, i);
        touch(kv->key.ptr, kv->key.len);
        char key[512];
        if (kv->key.len < sizeof key) {
            memcpy(key, kv->key.ptr, kv->key.len);
            key[kv->key.len] = '\0';
            /* keys with an embedded NUL can't be found by C string; others must be */
            if (!memchr(kv->key.ptr, 0, kv->key.len) && gguf_find_kv(g, key) != kv) abort();
            uint32_t u32;
            uint64_t u64;
            float f;
            bool b;
            gguf_str s;
            sink += (uint64_t)gguf_get_u32(g, key, &u32) + (uint64_t)gguf_get_u64(g, key, &u64) +
                    (uint64_t)gguf_get_f32(g, key, &f) + (uint64_t)gguf_get_bool(g, key, &b) +
                    (uint64_t)gguf_get_str(g, key, &s);
        }
        if (kv->type == GGUF_VT_STRING) touch(kv->str.ptr, kv->str.len);
        if (kv->type == GGUF_VT_ARRAY) {
            if (kv->arr_type == GGUF_VT_STRING) {
                for (uint64_t j = 0; j < kv->arr_n; j++) touch(kv->arr_strs[j].ptr, kv->arr_strs[j].len);
            } else {
                for (uint64_t j = 0; j < kv->arr_n; j++) {
                    sink += (uint64_t)gguf_arr_i64(kv, j);
                    float f = gguf_arr_f32(kv, j);
                    sink += f == f;
                }
            }
        }
    }
    for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
        const gguf_tensor *t = gguf_tensor_at(g, i);
        if (!quant_get_traits(t->type)) abort();
        if (t->offset % gguf_alignment(g) != 0) abort();
        if (data_off + t->offset + t->size > size) abort();
        if ((const uint8_t *)t->data != data + data_off + t->offset) abort();
        touch(t->data, t->size);
        char name[GGUF_MAX_NAME_LEN + 1];
        memcpy(name, t->name.ptr, t->name.len);
        name[t->name.len] = '\0';
        if (!memchr(t->name.ptr, 0, t->name.len) && gguf_find_tensor(g, name) != t) abort();
    }
    gguf_close(g);
    return 0;
}
