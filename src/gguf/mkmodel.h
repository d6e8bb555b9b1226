/*
 * mkmodel — writes a synthetic Llama GGUF (seeded random weights, byte-level
 * vocab) at a named shape and weight type, for tests and benchmarks; or, with
 * mkmodel_params.arch, the same shape as a qwen3, gemma3 or phi3 file with that
 * family's extra tensors and keys (see mkmodel_arch_supported).
 *
 * The file is what llama.cpp's converter would write for such a model:
 * llama.* metadata keys, tokenizer.ggml.* vocab ("<unk>", "<s>", "</s>",
 * "<0x00>".."<0xFF>", then filler pieces), ggml tensor names with ne[0] = input
 * dim. Matrices use the requested type; a matrix whose row length is not a
 * multiple of that type's block size falls back to q8_0 (or f16); norm weights
 * stay f32. Weights are scaled so activations stay O(1) through every layer and
 * logits have a std of a few units.
 *
 * Determinism: every row's values derive from (seed, tensor index, row) only,
 * so the bytes are identical for a seed whatever the thread count. The file is
 * streamed (gguf_writer_begin/write_data): memory stays a few MB per thread
 * whatever the model size.
 */
#ifndef KVS_MKMODEL_H
#define KVS_MKMODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    const char *name; /* "tiny", "small", "smollm2-360m", "tinyllama-1.1b", "llama-7b" */
    uint32_t n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab, n_ctx;
} mkmodel_shape;

/* The shape called name, or NULL. Static storage. */
const mkmodel_shape *mkmodel_find_shape(const char *name);
/* The i-th known shape (for listing), NULL past the end. */
const mkmodel_shape *mkmodel_shape_at(int i);

/* Called once per line of progress ("tensor 3/20 blk.0.attn_q.weight q4_0 [64, 64]");
 * line is valid during the call only. */
typedef void (*mkmodel_progress_fn)(void *user, const char *line);

typedef struct {
    const char *shape;   /* shape name */
    uint32_t type;       /* quant type id for matrices: f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 q2_k q3_k
                          * q4_k q5_k q6_k iq4_nl iq4_xs (quant_quantize_row: round to nearest) */
    bool k_m;            /* with type q4_k: llama.cpp's Q4_K_M mix instead (q6_k for output.weight and
                          * for attn_v / ffn_down of the first and last eighth of the layers and every
                          * third between; file_type 15) */
    uint64_t seed;
    const char *arch;    /* NULL or "llama"; "qwen3" (q/k norms), "gemma3" (q/k norms, post norms,
                          * sliding window 512 on 5 layers of 6, tied output), "phi3" (fused qkv and
                          * gate+up, LongRoPE factors) */
    int n_threads;       /* 0: online CPUs, at most 8 */
    mkmodel_progress_fn progress; /* may be NULL */
    void *progress_user;
} mkmodel_params;

mkmodel_params mkmodel_default_params(void); /* tiny, f32, seed 1, auto threads */

/* True when mkmodel can write a file of this architecture (NULL: llama). */
bool mkmodel_arch_supported(const char *arch);

/* True when mkmodel can write matrices of this type. */
bool mkmodel_type_supported(uint32_t type);

/* Writes the model to path (via path.tmp, renamed on success).
 * KVS_ERR_INVALID_ARG: unknown shape or unsupported type (msg says which);
 * KVS_ERR_IO / KVS_ERR_NOMEM otherwise. On failure no file is left at path. */
int mkmodel_write(const char *path, mkmodel_params params, char *msg, size_t msg_cap);

#endif /* KVS_MKMODEL_H */
