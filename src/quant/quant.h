/*
 * quant — tensor block formats and the kernels over them.
 *
 * Type ids are GGUF's (ggml's) numbers so that a tensor's type field maps 1:1.
 * Every kernel has a scalar `_ref` twin; the public entry points dispatch at
 * run time to the best ISA the CPU has (AVX-512/VNNI, AVX2+FMA, scalar).
 *
 * Matmul model: a weight row (in its block format) is dotted with an
 * "activation row" — the input vector converted once per row of input into the
 * format this weight type pairs with (f32 for float weights; an 8-bit block
 * format for quantized weights). quant_act_row_bytes / quant_act_quantize make
 * that conversion; quant_dot / quant_dot_multi do the dot.
 *
 * Batch invariance: quant_dot_multi(w, acts[0..n)) gives out[j] bit-identical to
 * quant_dot(w, acts[j]) for the same ISA, whatever n is.
 */
#ifndef KVS_QUANT_H
#define KVS_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum quant_type {
    QUANT_F32 = 0,
    QUANT_F16 = 1,
    QUANT_Q4_0 = 2,
    QUANT_Q4_1 = 3,
    QUANT_Q5_0 = 6,
    QUANT_Q5_1 = 7,
    QUANT_Q8_0 = 8,
    QUANT_Q8_1 = 9,
    QUANT_Q2_K = 10,
    QUANT_Q3_K = 11,
    QUANT_Q4_K = 12,
    QUANT_Q5_K = 13,
    QUANT_Q6_K = 14,
    QUANT_Q8_K = 15,
    QUANT_IQ4_NL = 20,
    QUANT_IQ4_XS = 23,
    QUANT_BF16 = 30,
    QUANT_TYPE_LIMIT = 64 /* ids at or above this are unknown */
};

typedef struct {
    const char *name;     /* "q4_0", "f16", ... */
    uint32_t block_elems; /* elements per block (1 for f32/f16/bf16) */
    uint32_t block_bytes; /* bytes per block */
    bool compute;         /* true when quant_dot/dequant support it as a weight type */
} quant_traits;

/* Traits of a GGUF type id, or NULL when the id is unknown to kvshard (a file
 * with such a tensor is refused). Types known only by size (q8_1, q8_k) have
 * compute == false. */
const quant_traits *quant_get_traits(uint32_t type);

/* Bytes of a row of n elements of type; false when the type is unknown, n is
 * not a multiple of the block size, or the size overflows. */
bool quant_row_bytes(uint32_t type, uint64_t n, uint64_t *out_bytes);

/* Parses a type name ("f32", "q4_0", "q4_k", ...); returns -1 when unknown. */
int quant_type_from_name(const char *name);

/* --- half precision rows (one value: base/f16.h) -------------------------- */
void quant_f16_to_f32_row(const uint16_t *src, float *dst, int64_t n);
void quant_f32_to_f16_row(const float *src, uint16_t *dst, int64_t n);

/* --- activations --------------------------------------------------------- */
/* Bytes needed for one activation row of n elements paired with weight type wtype. */
size_t quant_act_row_bytes(uint32_t wtype, int64_t n);
/* Converts x[0..n) into the activation format of wtype (n a multiple of the block size). */
void quant_act_quantize(uint32_t wtype, const float *x, void *act, int64_t n);

/* --- kernels (dispatched) ------------------------------------------------ */
/* Dot of one weight row (n elements of wtype) with one activation row. */
float quant_dot(uint32_t wtype, int64_t n, const void *w, const void *act);
/* out[j] = quant_dot(wtype, n, w, act + j * act_stride) for j in [0, n_act), bit-identical. */
void quant_dot_multi(uint32_t wtype, int64_t n, const void *w, const void *act,
                     size_t act_stride, int n_act, float *out);
/* Tiled prefill kernels. For some types (q4_0, q8_0, q4_k, q2_k, q3_k, iq4_xs)
 * under some ISAs (AVX2, AVX-512) a kernel takes a block of weight rows x
 * activation rows at once; it reads the
 * activations in a reordered "tile layout" of the same size, which
 * quant_act_tile_layout makes in place from a quant_act_quantize row.
 * quant_dot_tile gives out[t * out_stride + r] bit-identical to
 * quant_dot(wtype, n, w + r * w_stride, act_t) for r in [0, n_rows), t in
 * [0, n_act), act_t being activation row t before the layout change; the ISA
 * must not change between the two calls. */
/* True when the current ISA has a tile kernel for wtype. */
bool quant_has_tile(uint32_t wtype);
/* The smallest number of tokens from which the tile kernel of wtype is the faster
 * path under the current ISA (1 where it beats the multi kernel even for decode);
 * 0 when quant_has_tile is false. */
int quant_tile_min_tokens(uint32_t wtype);
/* Reorders one quantized activation row (n elements) into the tile layout
 * (which may differ between ISAs);
 * only for types where quant_has_tile is true. */
void quant_act_tile_layout(uint32_t wtype, void *act, int64_t n);
void quant_dot_tile(uint32_t wtype, int64_t n, const void *w, size_t w_stride, int n_rows, const void *act,
                    size_t act_stride, int n_act, float *out, size_t out_stride);
/* Row-interleaved ("r8") weights. For every quantized type (quant_r8_supported)
 * a matrix whose row count is a multiple of 8 can be repacked once, at load,
 * into groups of eight rows whose blocks are interleaved so that one SIMD
 * register holds the same four elements of all eight rows: a kernel then dots
 * eight rows with one broadcast of the activations and no horizontal
 * reduction. A group has the bytes of its eight rows (8 x row bytes), so the
 * repacked matrix replaces the mapped one at the same size. The layout is the
 * same under every ISA. quant_dot_r8 reads activation rows as
 * quant_act_quantize makes them (no tile layout) and gives
 * out[t * out_stride + 8 g + r] = the dot of row r of group g with activation
 * row t, bit-identical whatever n_groups and n_act are and under the scalar
 * reference too (the integer sums are exact and every ISA runs the same float
 * steps). It rounds differently from quant_dot on the unpacked rows (one
 * accumulator per row instead of quant_dot's lanes), within the same bound. */
/* True when wtype has an r8 layout. */
bool quant_r8_supported(uint32_t wtype);
/* True when the current ISA has a SIMD r8 kernel for wtype, i.e. repacking pays,
 * and repacking is enabled. */
bool quant_r8_preferred(uint32_t wtype);
/* Turns repacking on (the default) or off process-wide, for models loaded after
 * the call (kvshard's --no-repack; tests that compare the two). */
void quant_r8_set_enabled(bool on);
/* How the r8 kernels walk the row groups for a single token, where the ISA has
 * such kernels (AVX-512 VNNI); the bits are the same every way. */
enum quant_r8_walk {
    QUANT_R8_WALK_DEFAULT = -1, /* for quant_r8_set_walk: QUANT_R8_WALK_SPREAD */
    QUANT_R8_WALK_ONE = 0,      /* one group at a time: one weight stream per thread */
    QUANT_R8_WALK_PAIRS = 1,    /* two at a time (q4_0, q8_0): two streams */
    QUANT_R8_WALK_QUADS = 2,    /* four at a time, two pairs side by side: four streams */
    QUANT_R8_WALK_SPREAD = 3,   /* four at a time at i, i + Q, i + 2Q, i + 3Q (Q = the call's
                                   groups / 4): four streams far apart */
};
/* The walk set for a single token. SPREAD by default on every CPU: more weight
 * streams, and streams far apart, read DRAM faster on every machine measured
 * (BENCHMARKS.md). */
enum quant_r8_walk quant_r8_walk(void);
/* Sets the walk process-wide, from the next call; QUANT_R8_WALK_DEFAULT (or any
 * negative value) restores the default, a value above SPREAD means SPREAD. */
void quant_r8_set_walk(enum quant_r8_walk walk);
/* The walk a single token of wtype runs under the current ISA and setting: the
 * set one or the nearest below it that wtype has a kernel for; ONE where it has
 * none (its own r8 kernel) or no r8 layout. */
enum quant_r8_walk quant_r8_walk_used(uint32_t wtype);
/* Packs 8 rows (n elements of wtype each, row_stride bytes apart) into one group
 * (8 x the row bytes at out; out must not overlap the rows). */
void quant_r8_pack(uint32_t wtype, int64_t n, const void *rows, size_t row_stride, void *out);
/* Unpacks one group back into 8 rows (the inverse of quant_r8_pack; for tests). */
void quant_r8_unpack(uint32_t wtype, int64_t n, const void *group, void *rows, size_t row_stride);
void quant_dot_r8(uint32_t wtype, int64_t n, const void *w, int n_groups, const void *act, size_t act_stride,
                  int n_act, float *out, size_t out_stride);
/* The same through the scalar reference kernel, for tests. */
void quant_dot_r8_ref(uint32_t wtype, int64_t n, const void *w, int n_groups, const void *act,
                      size_t act_stride, int n_act, float *out, size_t out_stride);
/* Dequantizes n elements of wtype into y. */
void quant_dequant_row(uint32_t wtype, const void *w, float *y, int64_t n);
/* Reference quantizer (weights), for mkmodel and tests: f32, f16, bf16, q4_0,
 * q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl, iq4_xs (round to
 * nearest, not llama.cpp's search). Returns false for other types. */
bool quant_quantize_row(uint32_t type, const float *x, void *w, int64_t n);

/* --- scalar references (always available, used by tests) --------------- */
void quant_act_quantize_ref(uint32_t wtype, const float *x, void *act, int64_t n);
float quant_dot_ref(uint32_t wtype, int64_t n, const void *w, const void *act);
void quant_dequant_row_ref(uint32_t wtype, const void *w, float *y, int64_t n);

/* --- dispatch (the ISA: base/cpu.h) ------------------------------------- */
/* The kernel path the dispatcher takes for weight type wtype under the current
 * ISA, for reports: "scalar", "avx2" or "avx512-vnni" (the table that supplies
 * the dot kernel after fall back), with "+tile" when a tiled prefill kernel
 * exists. NULL for a type without kernels. */
const char *quant_kernel_path(uint32_t wtype);

#endif /* KVS_QUANT_H */
