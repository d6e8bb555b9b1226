/*
 * quant_impl — private to the quant module: block layouts, activation
 * layouts, and the per-ISA kernel tables that quant.c dispatches through.
 *
 * Design notes
 *  1. Weight blocks match ggml/GGUF byte for byte (little-endian). Every block
 *     is a struct with a static_assert on its size. Halves are kept as raw
 *     uint16_t bits; weight rows must be at least 2-byte aligned (GGUF tensor
 *     data is 32-byte aligned and every block size is even), f32 rows 4-byte.
 *  2. Activation rows (private format): f32 for float weights; act_q8 blocks
 *     (f32 scale, f32 scaled sum, 32 x int8) for the 32-element types; act_q8k
 *     blocks for the K-quants. Activation rows must be 4-byte aligned and the
 *     stride between them a multiple of 4.
 *  3. Activation quantization is deterministic and identical across ISAs:
 *     d = amax/127, q = round-half-even(x * (1/d)). So a SIMD quantizer may
 *     replace the scalar one without changing a single bit.
 *  4. Batch invariance: every dot kernel is written as a "multi" kernel; the
 *     single-row entry point calls it with n_act == 1. Inside, a group of
 *     activation rows shares the weight unpacking, but each row's float
 *     accumulation runs the same instruction sequence whatever the group size.
 *  5. Tables are indexed by type id; a NULL entry in an ISA table falls back to
 *     the next lower ISA (avx512 -> avx2 -> ref), except the tile kernel.
 *  6. Tile layout (q4_0 prefill): each full group of eight act_q8 blocks of a
 *     row becomes one act_q8x8, the four-byte pieces transposed so that one
 *     u8 x s8 dot over a transposed weight group puts block k's partial sum in
 *     lane k (no horizontal reduction); a last partial group stays as it is.
 *     Integer sums are exact, and the float steps per (row, token) are those
 *     of the multi kernel, so the tile kernel is bit-identical to it.
 *     q8_0 uses the same layout (ns unused) and, like q4_0, reduces each
 *     block to one lane in its multi kernel too, so the two agree bit for bit.
 *     q4_k has a tile kernel too; its activations keep the block_q8_k layout
 *     (quant_act_tile_layout leaves them as they are) and each i32 lane of a
 *     block's sum holds the same elements as in the multi kernel.
 */
#ifndef KVS_QUANT_IMPL_H
#define KVS_QUANT_IMPL_H

#include <assert.h>
#include <stddef.h>
#include <stdint.h>

#include "quant.h"

#define QK32 32
#define QKK 256

typedef struct {
    uint16_t d;      /* f16 scale */
    uint8_t qs[16];  /* nibbles: low = elems 0..15, high = elems 16..31 */
} block_q4_0;
static_assert(sizeof(block_q4_0) == 18, "q4_0 block size");

typedef struct {
    uint16_t d;      /* f16 scale */
    uint16_t m;      /* f16 min */
    uint8_t qs[16];
} block_q4_1;
static_assert(sizeof(block_q4_1) == 20, "q4_1 block size");

typedef struct {
    uint16_t d;      /* f16 scale */
    uint8_t qh[4];   /* 5th bits, bit j = elem j (LE u32) */
    uint8_t qs[16];
} block_q5_0;
static_assert(sizeof(block_q5_0) == 22, "q5_0 block size");

typedef struct {
    uint16_t d;      /* f16 scale */
    uint16_t m;      /* f16 min */
    uint8_t qh[4];
    uint8_t qs[16];
} block_q5_1;
static_assert(sizeof(block_q5_1) == 24, "q5_1 block size");

typedef struct {
    uint16_t d;      /* f16 scale */
    int8_t qs[32];
} block_q8_0;
static_assert(sizeof(block_q8_0) == 34, "q8_0 block size");

typedef struct {
    uint16_t d;      /* f16 scale */
    uint16_t s;      /* f16 d * sum(qs) */
    int8_t qs[32];
} block_q8_1;
static_assert(sizeof(block_q8_1) == 36, "q8_1 block size");

typedef struct {
    uint8_t scales[16]; /* 4-bit scale | 4-bit min per 16 elems */
    uint8_t qs[64];     /* 2-bit quants */
    uint16_t d;
    uint16_t dmin;
} block_q2_k;
static_assert(sizeof(block_q2_k) == 84, "q2_k block size");

typedef struct {
    uint8_t hmask[32];
    uint8_t qs[64];
    uint8_t scales[12];
    uint16_t d;
} block_q3_k;
static_assert(sizeof(block_q3_k) == 110, "q3_k block size");

typedef struct {
    uint16_t d;          /* f16 scale of the 6-bit scales */
    uint16_t dmin;       /* f16 scale of the 6-bit mins */
    uint8_t scales[12];  /* 8 x (6-bit scale, 6-bit min), packed */
    uint8_t qs[128];     /* chunk j of 64 elems: low nibbles 64j..+31, high 64j+32..+63 */
} block_q4_k;
static_assert(sizeof(block_q4_k) == 144, "q4_k block size");

typedef struct {
    uint16_t d;
    uint16_t dmin;
    uint8_t scales[12];
    uint8_t qh[32];      /* elem e: bit (e / 32) of qh[e % 32] */
    uint8_t qs[128];
} block_q5_k;
static_assert(sizeof(block_q5_k) == 176, "q5_k block size");

typedef struct {
    uint8_t ql[128];     /* low 4 bits */
    uint8_t qh[64];      /* high 2 bits */
    int8_t scales[16];   /* one per 16 elems */
    uint16_t d;
} block_q6_k;
static_assert(sizeof(block_q6_k) == 210, "q6_k block size");

/* Q8_K: the K-quant activation format, also ggml's layout. */
typedef struct {
    float d;             /* scale */
    int8_t qs[256];
    int16_t bsums[16];   /* sum of qs over each 16 elems */
} block_q8_k;
static_assert(sizeof(block_q8_k) == 292, "q8_k block size");

/* Activation block for the 32-element weight types (private layout). */
typedef struct {
    float d;             /* scale: x ~ d * qs */
    float s;             /* d * sum(qs), used by the types with a min (q4_1, q5_1) */
    int8_t qs[32];
} act_q8;
static_assert(sizeof(act_q8) == 40, "act_q8 size");

/* Tile layout of eight act_q8 blocks (design note 6), same size as the eight. */
typedef struct {
    float d[8];          /* scale of block k */
    float ns[8];         /* -8 * s of block k (the q4_0 kernel's offset term) */
    int8_t qs[8][32];    /* [i][4k..4k+3] = bytes 4i..4i+3 of block k */
} act_q8x8;
static_assert(sizeof(act_q8x8) == 8 * sizeof(act_q8), "act_q8x8 size");

typedef void (*quant_dot_multi_fn)(int64_t n, const void *w, const void *act, size_t act_stride,
                                   int n_act, float *out);
typedef void (*quant_dot_tile_fn)(int64_t n, const void *w, size_t w_stride, int n_rows, const void *act,
                                  size_t act_stride, int n_act, float *out, size_t out_stride);
typedef void (*quant_dequant_fn)(const void *w, float *y, int64_t n);
typedef void (*quant_act_fn)(const float *x, void *act, int64_t n);
typedef void (*quant_layout_fn)(void *act, int64_t n);

typedef struct {
    quant_dot_multi_fn dot;     /* NULL: fall back */
    quant_dequant_fn dequant;   /* NULL: fall back */
    quant_act_fn act;           /* NULL: fall back */
    quant_dot_tile_fn tile;     /* NULL: no tile kernel under this ISA (no fall back) */
    quant_layout_fn layout;     /* the tile layout when tile is set; NULL: design note 6's */
    int tile_min_tokens;        /* tile is the faster path from this many tokens; 0: from 5 */
} quant_kernels;

typedef struct {
    quant_kernels k[QUANT_TYPE_LIMIT];
    void (*f16_to_f32)(const uint16_t *src, float *dst, int64_t n);   /* NULL: fall back */
    void (*f32_to_f16)(const float *src, uint16_t *dst, int64_t n);   /* NULL: fall back */
} quant_isa_table;

/* Tables, one per ISA file. The SIMD tables must only be used on CPUs with the ISA. */
extern const quant_isa_table quant_table_ref;
extern const quant_isa_table quant_table_avx2;
extern const quant_isa_table quant_table_avx512;

/* Scalar helpers shared by the files (defined in quant_ref.c). */
void quant_ref_f16_to_f32_row(const uint16_t *src, float *dst, int64_t n);
void quant_ref_f32_to_f16_row(const float *src, uint16_t *dst, int64_t n);

/* 6-bit scale and min j (0..7) of a q4_k/q5_k block. */
static inline void quant_scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = (uint8_t)(q[j] & 63);
        *m = (uint8_t)(q[j + 4] & 63);
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

#endif /* KVS_QUANT_IMPL_H */
