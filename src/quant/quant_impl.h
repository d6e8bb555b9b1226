/*
 * quant_impl — private to the quant module: block layouts, activation
 * layouts, and the per-ISA kernel tables that quant.c dispatches through.
 *
 * Files (kernels by layout x ISA)
 *   quant.h            the public API
 *   quant_impl.h       block layouts, table types, the kernels each file exports
 *   quant.c            traits, the tables of the three ISAs, dispatch, the r8
 *                      entry points (pack, unpack, supported), quant_quantize_row
 *   ref/rows.c         scalar kernels of the plain row formats (dots, dequant,
 *                      activations, f16 rows) and the weight quantizers
 *   ref/r8.c           the r8 layout: packers and scalar kernels
 *   x86/rows_avx2.c    AVX2 kernels of the row formats
 *   x86/rows_avx512.c  rows_avx2.c compiled again with QUANT_VNNI (AVX-512 VNNI)
 *   x86/r8_avx2.c      AVX2 r8 kernels, and under QUANT_VNNI the 512-bit pair
 *                      and one-token walk kernels
 *   x86/r8_avx512.c    r8_avx2.c compiled again with QUANT_VNNI
 *   x86/emu_avx512.h   SIMDe in place of AVX-512 for the emu512 build (CMake)
 * One f16/bf16 value: base/f16.h; which ISA runs: base/cpu.h.
 *
 * Design notes
 *  1. Weight blocks match ggml/GGUF byte for byte (little-endian). Every block
 *     is a struct with a static_assert on its size. Halves are kept as raw
 *     uint16_t bits; weight rows must be at least 2-byte aligned (GGUF tensor
 *     data is 32-byte aligned and every block size is even), f32 rows 4-byte.
 *  2. Activation rows (private format): f32 for float weights; act_q8 blocks
 *     (scale (an f16 value held as f32), f32 scaled sum, 32 x int8; for q8_0 and iq4_nl weights the
 *     exact 128 x sum in place of the scaled sum) for the 32-element types (iq4_nl
 *     included); block_q8_k blocks for the 256-element types (the K-quants and
 *     iq4_xs). Activation rows must be 4-byte aligned and the stride between
 *     them a multiple of 4.
 *  3. Activation quantization is deterministic and identical across ISAs:
 *     act_q8 blocks (32 elements) as llama.cpp's q8_0 activations, d = amax/127
 *     rounded to f16, q = round-half-even(x * (127/amax)), so a dot sees the
 *     activation llama.cpp's does; block_q8_k blocks d = amax/127 (f32),
 *     q = round-half-even(x * (1/d)). So a SIMD quantizer may replace the scalar
 *     one without changing a single bit.
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
 *     q2_k, q3_k and iq4_xs tile kernels also keep the block_q8_k layout; they
 *     run, per weight row, eight tokens at a time through the very function
 *     their multi kernel runs four at a time (design note 4), so they are
 *     bit-identical to it by construction.
 *     An ISA may use its own tile layout (quant_kernels.layout): plain AVX2
 *     q4_0 pairs blocks m and m+4 instead of transposing (x86/rows_avx2.c), and
 *     takes the tile path from one token on (quant_kernels.tile_min_tokens).
 *  7. r8 layout (quant.h; block_q4_0x8, block_q4_1x8, block_q5_0x8,
 *     block_q5_1x8, block_q8_0x8, block_q4_kx8, block_q5_kx8,
 *     block_iq4_xsx8, block_q2_kx8, block_q3_kx8, block_q6_kx8 below; iq4_nl
 *     as q4_0x8): groups of eight rows, interleaved so that i32 lane r of a
 *     32-byte chunk holds four elements of row r. A kernel broadcasts four
 *     activation bytes, and lane r sums row r exactly — no horizontal step, no
 *     weight transpose, one kernel for decode and prefill (quant_kernels.r8,
 *     falling back like dot). Per (row, token) it runs the float steps of its
 *     scalar reference in ref/r8.c over the blocks in order, one
 *     accumulator per row, so every ISA and batch gives the same bits as the
 *     reference (not as quant_dot on the unpacked rows, which reduces in lanes).
 *     A group has the bytes of its eight rows: repacking replaces a matrix at
 *     its size; the six-bit q4_k scales and mins are re-encoded to fit.
 */
#ifndef KVS_QUANT_IMPL_H
#define KVS_QUANT_IMPL_H

#include <assert.h>
#include <stddef.h>
#include <stdint.h>

#include "cpu.h"
#include "f16.h"
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

/* q2_k: elem e = 128h + 32j + l (h 0..1, j 0..3, l 0..31) is bits 2j..2j+1 of
 * qs[32h + l]; its 16-elem group is e / 16. y = d * sc * q - dmin * m. */
typedef struct {
    uint8_t scales[16]; /* group g: low nibble scale sc, high nibble min m */
    uint8_t qs[64];     /* 2-bit quants, four per byte */
    uint16_t d;         /* f16 scale of the scales */
    uint16_t dmin;      /* f16 scale of the mins */
} block_q2_k;
static_assert(sizeof(block_q2_k) == 84, "q2_k block size");

/* q3_k: elem e = 128h + 32j + l has low bits 2j..2j+1 of qs[32h + l] and high
 * bit (4h + j) of hmask[l]; q = low + 4 * high - 4 (-4..3). Group e / 16 has a
 * 6-bit scale s (stored + 32; see quant_q3_k_scales). y = d * s * q. */
typedef struct {
    uint8_t hmask[32];  /* third bits */
    uint8_t qs[64];     /* low 2 bits */
    uint8_t scales[12]; /* 16 x 6-bit scales, packed */
    uint16_t d;         /* f16 scale of the scales */
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

/* iq4_nl: 32 elems; each nibble indexes the non-linear table quant_iq4_values.
 * y[i] = d * v[qs[i] & 15], y[i + 16] = d * v[qs[i] >> 4] (i < 16). */
typedef struct {
    uint16_t d;      /* f16 scale */
    uint8_t qs[16];
} block_iq4_nl;
static_assert(sizeof(block_iq4_nl) == 18, "iq4_nl block size");

/* iq4_xs: 256 elems as eight iq4_nl-like sub-blocks of 32 (sub-block k: nibbles
 * qs[16k..16k+15]) with 6-bit scales: low 4 bits in nibble k % 2 of scales_l[k / 2],
 * high 2 bits at bits 2k..2k+1 of scales_h; y = d * (scale - 32) * v[nibble]. */
typedef struct {
    uint16_t d;          /* f16 scale of the scales */
    uint16_t scales_h;   /* high 2 bits of the 8 scales */
    uint8_t scales_l[4]; /* low 4 bits of the 8 scales */
    uint8_t qs[128];
} block_iq4_xs;
static_assert(sizeof(block_iq4_xs) == 136, "iq4_xs block size");

/* The 16 values of the iq4_nl / iq4_xs table (ggml's kvalues_iq4nl), ascending. */
static const int8_t quant_iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                            1,    13,   25,  38,  53,  69,  89,  113};

/* Q8_K: the K-quant activation format, also ggml's layout. */
typedef struct {
    float d;             /* scale */
    int8_t qs[256];
    int16_t bsums[16];   /* sum of qs over each 16 elems; for q4_k and q5_k weights (mins per 32
                            elements) instead [j < 8] the sum over each 32, [8..15] zero
                            (q8_k_sums32): their kernels read one sum per min */
} block_q8_k;

/* A block's 16-element sums folded in place to the 32-element sums of q4_k /
 * q5_k activations (exact: |sum| <= 32 x 127). */
static inline void q8_k_sums32(block_q8_k *y) {
    for (int j = 0; j < 8; j++) y->bsums[j] = (int16_t)(y->bsums[2 * j] + y->bsums[2 * j + 1]);
    for (int j = 8; j < 16; j++) y->bsums[j] = 0;
}
static_assert(sizeof(block_q8_k) == 292, "q8_k block size");

/* Activation block for the 32-element weight types (private layout). */
typedef struct {
    float d;             /* scale: x ~ d * qs */
    union {
        float s;         /* d * sum(qs): the offset term of q4_0 and q5_0, and of the types with a
                            min (q4_1, q5_1) */
        int32_t qsum128; /* q8_0's and iq4_nl's activations instead: 128 * sum(qs), exact (the
                            offset of their VNNI r8 kernels, whose weights go in as w + 128),
                            made once per row */
    };
    int8_t qs[32];
} act_q8;
static_assert(sizeof(act_q8) == 40, "act_q8 size");

/* A quantized block's second field: q8_0's and iq4_nl's activations
 * (qsum128) carry 128 sum(qs), every other type's d sum(qs). */
static inline void act_q8_set_sum(act_q8 *y, float d, int sum, bool qsum128) {
    if (qsum128) y->qsum128 = 128 * sum;
    else y->s = d * (float)sum;
}

/* Tile layout of eight act_q8 blocks (design note 6), same size as the eight. */
typedef struct {
    float d[8];          /* scale of block k */
    float ns[8];         /* -8 * s of block k (the q4_0 kernel's offset term) */
    int8_t qs[8][32];    /* [i][4k..4k+3] = bytes 4i..4i+3 of block k */
} act_q8x8;
static_assert(sizeof(act_q8x8) == 8 * sizeof(act_q8), "act_q8x8 size");

/* r8 layout of q4_0 (quant.h): block b of eight rows. qs[32 j + 4 r + i] holds
 * row r's elements 8 j + i (low nibble) and 8 j + 4 + i (high nibble), j 0..3,
 * i 0..3, so 32-byte chunk j masked gives every row's elements 8j..8j+3 in its
 * i32 lane r and shifted gives 8j+4..8j+7: each pairs with one 4-byte broadcast
 * of the activation block. A group of nb blocks is nb of these, in order. */
typedef struct {
    uint16_t d[8];   /* f16 scale of row r's block */
    uint8_t qs[128];
} block_q4_0x8;
static_assert(sizeof(block_q4_0x8) == 8 * sizeof(block_q4_0), "q4_0x8 block size");

/* r8 layouts of the other 32-element types, in q4_0x8's nibble order (qs):
 * q4_1x8 and q5_1x8 add row r's f16 min m[r]; q5_0x8 and q5_1x8 the fifth
 * bits, qh[4 r + i] bit 2 j for row r's element 8 j + i (the low nibble of
 * chunk j), bit 2 j + 1 for element 8 j + 4 + i (its high nibble). iq4_nl's
 * r8 layout is q4_0x8's, with table indices in the nibbles. */
typedef struct {
    uint16_t d[8];   /* f16 scale of row r's block */
    uint16_t m[8];   /* f16 min of row r's block */
    uint8_t qs[128];
} block_q4_1x8;
static_assert(sizeof(block_q4_1x8) == 8 * sizeof(block_q4_1), "q4_1x8 block size");

typedef struct {
    uint16_t d[8];
    uint8_t qh[32];
    uint8_t qs[128];
} block_q5_0x8;
static_assert(sizeof(block_q5_0x8) == 8 * sizeof(block_q5_0), "q5_0x8 block size");

typedef struct {
    uint16_t d[8];
    uint16_t m[8];
    uint8_t qh[32];
    uint8_t qs[128];
} block_q5_1x8;
static_assert(sizeof(block_q5_1x8) == 8 * sizeof(block_q5_1), "q5_1x8 block size");

typedef block_q4_0x8 block_iq4_nlx8;

/* r8 layout of q8_0: qs[32 j + 4 r + i] = row r's element 4 j + i (j 0..7, i
 * 0..3): 32-byte chunk j has every row's elements 4j..4j+3 in its lane r. */
typedef struct {
    uint16_t d[8];   /* f16 scale of row r's block */
    int8_t qs[256];
} block_q8_0x8;
static_assert(sizeof(block_q8_0x8) == 8 * sizeof(block_q8_0), "q8_0x8 block size");

/* r8 layout of q4_k: one super-block of eight rows. Scale/min j of row r is
 * entry 8 j + r of 64 six-bit values each: the low four bits of entries k and
 * k + 32 in the low / high nibble of byte k of sc_lo (m_lo), their top two bits
 * in hi[k] (bits 0-1: scale k, 2-3: scale k + 32, 4-5: min k, 6-7: min k + 32).
 * qs[128 j + 32 c + 4 r + i] holds row r's elements 32 j + 8 c + i (low nibble)
 * and 32 j + 8 c + 4 + i (high), sub-block j 0..7, c 0..3, i 0..3: sub-block j
 * is then four q4_0x8-style chunks. */
typedef struct {
    uint16_t d[8];       /* f16 scale of the scales, row r */
    uint16_t dmin[8];    /* f16 scale of the mins, row r */
    uint8_t sc_lo[32];
    uint8_t m_lo[32];
    uint8_t hi[32];
    uint8_t qs[1024];
} block_q4_kx8;
static_assert(sizeof(block_q4_kx8) == 8 * sizeof(block_q4_k), "q4_kx8 block size");

/* r8 layout of q5_k: lo is q4_kx8's layout of the scales, the mins and every
 * element's low four bits; qh[32 j + 4 r + i] holds their fifth bits for byte
 * 4 r + i of lo.qs' four chunks of sub-block j: bit 2c for row r's element
 * 32 j + 8 c + i (chunk c's low nibble), bit 2c + 1 for 32 j + 8 c + 4 + i. */
typedef struct {
    block_q4_kx8 lo;
    uint8_t qh[256];
} block_q5_kx8;
static_assert(sizeof(block_q5_kx8) == 8 * sizeof(block_q5_k), "q5_kx8 block size");

/* r8 layout of iq4_xs: one super-block of eight rows. Scale j of row r is
 * entry k = 8 j + r of 64 six-bit values (unsigned; subtract 32 to use): the
 * low four bits of entries k and k + 32 in the low / high nibble of sc_lo[k %
 * 32], the top two bits of entry k at bits 2 (k / 16) of sc_hi[k % 16]. qs as
 * in q4_kx8: qs[128 j + 32 c + 4 r + i] holds the table indices of row r's
 * elements 32 j + 8 c + i (low nibble) and 32 j + 8 c + 4 + i (high). */
typedef struct {
    uint16_t d[8];     /* f16 scale of the scales, row r */
    uint8_t sc_lo[32];
    uint8_t sc_hi[16];
    uint8_t qs[1024];
} block_iq4_xsx8;
static_assert(sizeof(block_iq4_xsx8) == 8 * sizeof(block_iq4_xs), "iq4_xsx8 block size");

/* r8 layout of q2_k: one super-block of eight rows. sc[8 g + r] is row r's
 * byte scales[g] as it stands (the scale of group g in the low nibble, its
 * min in the high). qs as in q3_kx8: qs[32 g + 4 r + i] bits 2c, 2c + 1 hold
 * q (0..3) of row r's element 16 g + 4 c + i (group g 0..15, c 0..3, i
 * 0..3), so chunk g shifted by 2c gives every row's elements 16 g + 4 c .. + 3
 * in its lane r. */
typedef struct {
    uint16_t d[8];     /* f16 scale of the scales, row r */
    uint16_t dmin[8];  /* f16 scale of the mins, row r */
    uint8_t sc[128];
    uint8_t qs[512];
} block_q2_kx8;
static_assert(sizeof(block_q2_kx8) == 8 * sizeof(block_q2_k), "q2_kx8 block size");

/* r8 layout of q3_k: one super-block of eight rows; u = q + 4 (0..7). Scale g
 * of row r is entry k = 8 g + r of 128 six-bit values (stored + 32): the low
 * four bits of entries k and k + 64 in the low / high nibble of sc_lo[k % 64],
 * the top two bits of entry k at bits 2 (k / 32) of sc_hi[k % 32].
 * qs[32 g + 4 r + i] bits 2c, 2c + 1: the low two bits of u of row r's element
 * 16 g + 4 c + i (group g 0..15, c 0..3, i 0..3), so chunk g shifted by 2c
 * gives every row's elements 16 g + 4 c .. + 3 in its lane r;
 * hm[32 j + 4 r + i] bit 4 h + c: the top bit of u of element 32 j + 16 h +
 * 4 c + i (sub-block j 0..7, its group h 0..1). */
typedef struct {
    uint16_t d[8];     /* f16 super-block scale, row r */
    uint8_t sc_lo[64];
    uint8_t sc_hi[32];
    uint8_t qs[512];
    uint8_t hm[256];
} block_q3_kx8;
static_assert(sizeof(block_q3_kx8) == 8 * sizeof(block_q3_k), "q3_kx8 block size");

/* r8 layout of q6_k: one super-block of eight rows; u = q + 32 (0..63).
 * ql[128 j + 32 c + 4 r + i]: low four bits of u of row r's elements
 * 32 j + 8 c + i (low nibble) and 32 j + 8 c + 4 + i (high), as in q4_kx8;
 * qh[64 j + 32 h + 4 r + i]: their top two bits, elements 32 j + 16 h + i
 * (bits 0-1), + 4 (2-3), + 8 (4-5), + 12 (6-7). sc[8 g + r]: row r's scale of
 * its 16-element group g. */
typedef struct {
    uint16_t d[8];       /* f16 super-block scale, row r */
    int8_t sc[128];
    uint8_t ql[1024];
    uint8_t qh[512];
} block_q6_kx8;
static_assert(sizeof(block_q6_kx8) == 8 * sizeof(block_q6_k), "q6_kx8 block size");

typedef void (*quant_dot_multi_fn)(int64_t n, const void *w, const void *act, size_t act_stride,
                                   int n_act, float *out);
typedef void (*quant_dot_tile_fn)(int64_t n, const void *w, size_t w_stride, int n_rows, const void *act,
                                  size_t act_stride, int n_act, float *out, size_t out_stride);
typedef void (*quant_dequant_fn)(const void *w, float *y, int64_t n);
typedef void (*quant_act_fn)(const float *x, void *act, int64_t n);
typedef void (*quant_layout_fn)(void *act, int64_t n);
typedef void (*quant_dot_r8_fn)(int64_t n, const void *w, int n_groups, const void *act, size_t act_stride,
                                int n_act, float *out, size_t out_stride);

typedef struct {
    quant_dot_multi_fn dot;     /* NULL: fall back */
    quant_dequant_fn dequant;   /* NULL: fall back */
    quant_act_fn act;           /* NULL: fall back */
    quant_dot_tile_fn tile;     /* NULL: no tile kernel under this ISA (no fall back) */
    quant_layout_fn layout;     /* the tile layout when tile is set; NULL: design note 6's */
    int tile_min_tokens;        /* tile is the faster path from this many tokens; 0: from 5 */
    quant_dot_r8_fn r8;         /* kernel over r8 groups (quant.h); NULL: fall back */
    quant_dot_r8_fn r8_pairs1;  /* one token, groups two at a time (QUANT_R8_WALK_PAIRS); NULL: r8 */
    quant_dot_r8_fn r8_quads1;  /* one token, four at a time (QUANT_R8_WALK_QUADS); NULL: r8_pairs1 / r8 */
    quant_dot_r8_fn r8_spread1; /* one token, four far apart (QUANT_R8_WALK_SPREAD); NULL: as QUADS */
} quant_kernels;

typedef struct {
    quant_kernels k[QUANT_TYPE_LIMIT];
    void (*f16_to_f32)(const uint16_t *src, float *dst, int64_t n);   /* NULL: fall back */
    void (*f32_to_f16)(const float *src, uint16_t *dst, int64_t n);   /* NULL: fall back */
} quant_isa_table;

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

/* The 16 signed scales (-32..31) of a q3_k block: scale j has its low 4 bits in
 * nibble j / 8 of byte j % 8 and its high 2 bits at bits 2 (j / 4).. of byte 8 + j % 4. */
static inline void quant_q3_k_scales(const uint8_t packed[12], int8_t sc[16]) {
    for (int j = 0; j < 16; j++) {
        int lo = j < 8 ? packed[j] & 0xF : packed[j - 8] >> 4;
        int hi = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
        sc[j] = (int8_t)((lo | hi << 4) - 32);
    }
}

/* 6-bit scale k (0..7) of an iq4_xs block, unsigned (subtract 32 to use). */
static inline int quant_iq4_xs_scale(const block_iq4_xs *b, int k) {
    return ((b->scales_l[k / 2] >> (4 * (k % 2))) & 0xF) | (((b->scales_h >> (2 * k)) & 3) << 4);
}

/* --- the kernels of each file, which quant.c's tables name -------------------------------
 * quant_<isa>_<kind>_<type>, isa one of ref, avx2, avx512. The dot kernels are "multi" kernels
 * (design note 4); act_<format> makes the activation rows of design note 2 (q8: act_q8 with d
 * sum, q8_0: act_q8 with qsum128, q8k: block_q8_k, q8k32: block_q8_k with 32-element sums). */
#define QUANT_DECL_DOT(isa, type)                                                                      \
    void quant_##isa##_dot_##type(int64_t n, const void *w, const void *act, size_t stride, int n_act,  \
                                  float *out);
#define QUANT_DECL_ACTS(isa)                                                                           \
    void quant_##isa##_act_f32(const float *x, void *act, int64_t n);                                 \
    void quant_##isa##_act_q8(const float *x, void *act, int64_t n);                                  \
    void quant_##isa##_act_q8_0(const float *x, void *act, int64_t n);                                \
    void quant_##isa##_act_q8k(const float *x, void *act, int64_t n);                                 \
    void quant_##isa##_act_q8k32(const float *x, void *act, int64_t n);
#define QUANT_DECL_TILE(isa, type)                                                                     \
    void quant_##isa##_tile_##type(int64_t n, const void *w, size_t w_stride, int n_rows, const void *act, \
                                   size_t act_stride, int n_act, float *out, size_t out_stride);
#define QUANT_DECL_F16_ROWS(isa)                                                                       \
    void quant_##isa##_f16_to_f32_row(const uint16_t *src, float *dst, int64_t n);                    \
    void quant_##isa##_f32_to_f16_row(const float *src, uint16_t *dst, int64_t n);
/* X(arg, type) for every compute type. */
#define QUANT_ROW_TYPES(X, arg) X(arg, f32) X(arg, f16) X(arg, bf16) X(arg, q4_0) X(arg, q4_1) X(arg, q5_0) \
    X(arg, q5_1) X(arg, q8_0) X(arg, q2_k) X(arg, q3_k) X(arg, q4_k) X(arg, q5_k) X(arg, q6_k)            \
    X(arg, iq4_nl) X(arg, iq4_xs)
/* X(arg, type) for every type with an r8 layout. */
#define QUANT_R8_TYPES(X, arg) X(arg, q4_0) X(arg, q8_0) X(arg, q4_1) X(arg, q5_0) X(arg, q5_1) X(arg, iq4_nl) \
    X(arg, q2_k) X(arg, q3_k) X(arg, q4_k) X(arg, q5_k) X(arg, q6_k) X(arg, iq4_xs)

/* ref/rows.c: the scalar kernels, weight quantizers and f16 rows. */
QUANT_ROW_TYPES(QUANT_DECL_DOT, ref)
QUANT_DECL_ACTS(ref)
QUANT_DECL_F16_ROWS(ref)
#define QUANT_DECL_REF_DEQUANT(arg, type) void quant_ref_dequant_##type(const void *w, float *y, int64_t n);
#define QUANT_DECL_REF_QUANTIZE(arg, type) void quant_ref_quantize_##type(const float *x, void *w, int64_t n);
QUANT_ROW_TYPES(QUANT_DECL_REF_DEQUANT, _)
QUANT_R8_TYPES(QUANT_DECL_REF_QUANTIZE, _) /* the block types: the same list */

/* x86/rows_avx2.c, compiled as itself (avx2) and as x86/rows_avx512.c (avx512, QUANT_VNNI). */
QUANT_ROW_TYPES(QUANT_DECL_DOT, avx2)
QUANT_ROW_TYPES(QUANT_DECL_DOT, avx512)
QUANT_DECL_ACTS(avx2)
QUANT_DECL_ACTS(avx512)
QUANT_DECL_F16_ROWS(avx2)
QUANT_DECL_F16_ROWS(avx512)
void quant_avx2_dequant_f16(const void *w, float *y, int64_t n);
void quant_avx512_dequant_f16(const void *w, float *y, int64_t n);
QUANT_DECL_TILE(avx2, q4_0_p8) QUANT_DECL_TILE(avx2, q8_0) QUANT_DECL_TILE(avx2, q4_k)
QUANT_DECL_TILE(avx2, q2_k) QUANT_DECL_TILE(avx2, q3_k) QUANT_DECL_TILE(avx2, iq4_xs)
void quant_avx2_layout_q4_0_pair(void *act, int64_t n); /* tile_q4_0_p8's activations */
QUANT_DECL_TILE(avx512, q4_0) QUANT_DECL_TILE(avx512, q8_0) QUANT_DECL_TILE(avx512, q4_k)
QUANT_DECL_TILE(avx512, q2_k) QUANT_DECL_TILE(avx512, q3_k) QUANT_DECL_TILE(avx512, iq4_xs)

/* ref/r8.c, x86/r8_avx2.c and x86/r8_avx512.c (r8_avx2.c with QUANT_VNNI): one r8 kernel per
 * type, and the packers; the VNNI build also takes one token's groups two (pairs1), four
 * (quads1) or four far apart (spread1) at a time. */
#define QUANT_R8_DECL(isa, type)                                                                     \
    void quant_##isa##_r8_##type(int64_t n, const void *w, int n_groups, const void *act, size_t act_stride, \
                                 int n_act, float *out, size_t out_stride);
#define QUANT_R8_DECL_QUADS1(isa, type) QUANT_R8_DECL(isa, quads1_##type) QUANT_R8_DECL(isa, spread1_##type)
#define QUANT_R8_DECL_CODEC(arg, type)                                                               \
    void quant_ref_r8_pack_##type(int64_t n, const void *rows, size_t row_stride, void *out);        \
    void quant_ref_r8_unpack_##type(int64_t n, const void *group, void *rows, size_t row_stride);
QUANT_R8_TYPES(QUANT_R8_DECL, ref)
QUANT_R8_TYPES(QUANT_R8_DECL_CODEC, _)
QUANT_R8_TYPES(QUANT_R8_DECL, avx2)
QUANT_R8_TYPES(QUANT_R8_DECL, avx512)
QUANT_R8_TYPES(QUANT_R8_DECL_QUADS1, avx512)
QUANT_R8_DECL(avx512, pairs1_q4_0) QUANT_R8_DECL(avx512, pairs1_q8_0)

#endif /* KVS_QUANT_IMPL_H */
