/*
 * quant — type traits, the kernel table of each ISA and the run-time dispatch
 * through them: the one file that names every ISA's kernels (the kernel files
 * only define them). File map and design notes: quant_impl.h.
 */
#include <stdatomic.h>
#include <string.h>
#include <strings.h>

#include "cpu.h"
#include "quant_impl.h"
#include "util.h"

static const quant_traits traits[QUANT_TYPE_LIMIT] = {
    [QUANT_F32] = {"f32", 1, 4, true},
    [QUANT_F16] = {"f16", 1, 2, true},
    [QUANT_BF16] = {"bf16", 1, 2, true},
    [QUANT_Q4_0] = {"q4_0", 32, sizeof(block_q4_0), true},
    [QUANT_Q4_1] = {"q4_1", 32, sizeof(block_q4_1), true},
    [QUANT_Q5_0] = {"q5_0", 32, sizeof(block_q5_0), true},
    [QUANT_Q5_1] = {"q5_1", 32, sizeof(block_q5_1), true},
    [QUANT_Q8_0] = {"q8_0", 32, sizeof(block_q8_0), true},
    [QUANT_Q8_1] = {"q8_1", 32, sizeof(block_q8_1), false},
    [QUANT_Q2_K] = {"q2_k", 256, sizeof(block_q2_k), true},
    [QUANT_Q3_K] = {"q3_k", 256, sizeof(block_q3_k), true},
    [QUANT_Q4_K] = {"q4_k", 256, sizeof(block_q4_k), true},
    [QUANT_Q5_K] = {"q5_k", 256, sizeof(block_q5_k), true},
    [QUANT_Q6_K] = {"q6_k", 256, sizeof(block_q6_k), true},
    [QUANT_Q8_K] = {"q8_k", 256, sizeof(block_q8_k), false},
    [QUANT_IQ4_NL] = {"iq4_nl", 32, sizeof(block_iq4_nl), true},
    [QUANT_IQ4_XS] = {"iq4_xs", 256, sizeof(block_iq4_xs), true},
};

const quant_traits *quant_get_traits(uint32_t type) {
    if (type >= QUANT_TYPE_LIMIT || !traits[type].name) return NULL;
    return &traits[type];
}

bool quant_row_bytes(uint32_t type, uint64_t n, uint64_t *out_bytes) {
    const quant_traits *t = quant_get_traits(type);
    if (!t || n % t->block_elems != 0) return false;
    return kvs_mul_u64(n / t->block_elems, t->block_bytes, out_bytes);
}

int quant_type_from_name(const char *name) {
    if (!name) return -1;
    for (int i = 0; i < QUANT_TYPE_LIMIT; i++)
        if (traits[i].name && strcasecmp(traits[i].name, name) == 0) return i;
    return -1;
}

/* --- dispatch ------------------------------------------------------------ */

/* The tables: for each ISA the kernels of each type; a NULL entry falls back to the ISA below
 * (design note 5). This is the one place that names every ISA's kernels. */
#define REF(type, act_fmt)                                                                          \
    .dot = quant_ref_dot_##type, .dequant = quant_ref_dequant_##type, .act = quant_ref_act_##act_fmt
#define ROW(isa, type, act_fmt) .dot = quant_##isa##_dot_##type, .act = quant_##isa##_act_##act_fmt
#define R8(isa, type) .r8 = quant_##isa##_r8_##type
#define R8_QUADS1(type) \
    R8(avx512, type), .r8_quads1 = quant_avx512_r8_quads1_##type, .r8_spread1 = quant_avx512_r8_spread1_##type
#define R8_PAIRS1(type) R8_QUADS1(type), .r8_pairs1 = quant_avx512_r8_pairs1_##type

static const quant_isa_table table_ref = {
    .k = {
        [QUANT_F32] = {REF(f32, f32)},
        [QUANT_F16] = {REF(f16, f32)},
        [QUANT_BF16] = {REF(bf16, f32)},
        [QUANT_Q4_0] = {REF(q4_0, q8), R8(ref, q4_0)},
        [QUANT_Q4_1] = {REF(q4_1, q8), R8(ref, q4_1)},
        [QUANT_Q5_0] = {REF(q5_0, q8), R8(ref, q5_0)},
        [QUANT_Q5_1] = {REF(q5_1, q8), R8(ref, q5_1)},
        [QUANT_Q8_0] = {REF(q8_0, q8_0), R8(ref, q8_0)},
        [QUANT_Q4_K] = {REF(q4_k, q8k32), R8(ref, q4_k)},
        [QUANT_Q5_K] = {REF(q5_k, q8k32), R8(ref, q5_k)},
        [QUANT_Q6_K] = {REF(q6_k, q8k), R8(ref, q6_k)},
        [QUANT_Q2_K] = {REF(q2_k, q8k), R8(ref, q2_k)},
        [QUANT_Q3_K] = {REF(q3_k, q8k), R8(ref, q3_k)},
        [QUANT_IQ4_NL] = {REF(iq4_nl, q8_0), R8(ref, iq4_nl)},
        [QUANT_IQ4_XS] = {REF(iq4_xs, q8k), R8(ref, iq4_xs)},
    },
    .f16_to_f32 = quant_ref_f16_to_f32_row,
    .f32_to_f16 = quant_ref_f32_to_f16_row,
};

/* Plain AVX2 tiles q4_0 in its own pair layout, from one token on (design note 6). */
static const quant_isa_table table_avx2 = {
    .k = {
        [QUANT_F32] = {ROW(avx2, f32, f32)},
        [QUANT_F16] = {ROW(avx2, f16, f32), .dequant = quant_avx2_dequant_f16},
        [QUANT_BF16] = {ROW(avx2, bf16, f32)},
        [QUANT_Q4_0] = {ROW(avx2, q4_0, q8), .tile = quant_avx2_tile_q4_0_p8, .layout = quant_avx2_layout_q4_0_pair,
                        .tile_min_tokens = 1, R8(avx2, q4_0)},
        [QUANT_Q4_1] = {ROW(avx2, q4_1, q8), R8(avx2, q4_1)},
        [QUANT_Q5_0] = {ROW(avx2, q5_0, q8), R8(avx2, q5_0)},
        [QUANT_Q5_1] = {ROW(avx2, q5_1, q8), R8(avx2, q5_1)},
        [QUANT_Q8_0] = {ROW(avx2, q8_0, q8_0), .tile = quant_avx2_tile_q8_0, R8(avx2, q8_0)},
        [QUANT_Q4_K] = {ROW(avx2, q4_k, q8k32), .tile = quant_avx2_tile_q4_k, R8(avx2, q4_k)},
        [QUANT_Q5_K] = {ROW(avx2, q5_k, q8k32), R8(avx2, q5_k)},
        [QUANT_Q6_K] = {ROW(avx2, q6_k, q8k), R8(avx2, q6_k)},
        [QUANT_Q2_K] = {ROW(avx2, q2_k, q8k), .tile = quant_avx2_tile_q2_k, R8(avx2, q2_k)},
        [QUANT_Q3_K] = {ROW(avx2, q3_k, q8k), .tile = quant_avx2_tile_q3_k, R8(avx2, q3_k)},
        [QUANT_IQ4_NL] = {ROW(avx2, iq4_nl, q8_0), R8(avx2, iq4_nl)},
        [QUANT_IQ4_XS] = {ROW(avx2, iq4_xs, q8k), .tile = quant_avx2_tile_iq4_xs, R8(avx2, iq4_xs)},
    },
    .f16_to_f32 = quant_avx2_f16_to_f32_row,
    .f32_to_f16 = quant_avx2_f32_to_f16_row,
};

/* AVX-512 (VNNI) has the one-token r8 kernels that take several groups at a time. */
static const quant_isa_table table_avx512 = {
    .k = {
        [QUANT_F32] = {ROW(avx512, f32, f32)},
        [QUANT_F16] = {ROW(avx512, f16, f32), .dequant = quant_avx512_dequant_f16},
        [QUANT_BF16] = {ROW(avx512, bf16, f32)},
        [QUANT_Q4_0] = {ROW(avx512, q4_0, q8), .tile = quant_avx512_tile_q4_0, R8_PAIRS1(q4_0)},
        [QUANT_Q4_1] = {ROW(avx512, q4_1, q8), R8_QUADS1(q4_1)},
        [QUANT_Q5_0] = {ROW(avx512, q5_0, q8), R8_QUADS1(q5_0)},
        [QUANT_Q5_1] = {ROW(avx512, q5_1, q8), R8_QUADS1(q5_1)},
        [QUANT_Q8_0] = {ROW(avx512, q8_0, q8_0), .tile = quant_avx512_tile_q8_0, R8_PAIRS1(q8_0)},
        [QUANT_Q4_K] = {ROW(avx512, q4_k, q8k32), .tile = quant_avx512_tile_q4_k, R8_QUADS1(q4_k)},
        [QUANT_Q5_K] = {ROW(avx512, q5_k, q8k32), R8_QUADS1(q5_k)},
        [QUANT_Q6_K] = {ROW(avx512, q6_k, q8k), R8_QUADS1(q6_k)},
        [QUANT_Q2_K] = {ROW(avx512, q2_k, q8k), .tile = quant_avx512_tile_q2_k, R8_QUADS1(q2_k)},
        [QUANT_Q3_K] = {ROW(avx512, q3_k, q8k), .tile = quant_avx512_tile_q3_k, R8_QUADS1(q3_k)},
        [QUANT_IQ4_NL] = {ROW(avx512, iq4_nl, q8_0), R8_QUADS1(iq4_nl)},
        [QUANT_IQ4_XS] = {ROW(avx512, iq4_xs, q8k), .tile = quant_avx512_tile_iq4_xs, R8_QUADS1(iq4_xs)},
    },
    .f16_to_f32 = quant_avx512_f16_to_f32_row,
    .f32_to_f16 = quant_avx512_f32_to_f16_row,
};

/* Indexed by enum kvs_isa. */
static const quant_isa_table *const isa_tables[] = {&table_ref, &table_avx2, &table_avx512};

const char *quant_kernel_path(uint32_t wtype) {
    static const char *const names[3][2] = {
        {"scalar", "scalar+tile"}, {"avx2", "avx2+tile"}, {"avx512-vnni", "avx512-vnni+tile"}};
    if (wtype >= QUANT_TYPE_LIMIT || !table_ref.k[wtype].dot) return NULL;
    int i = (int)kvs_isa_current();
    while (i > 0 && !isa_tables[i]->k[wtype].dot) i--;
    return names[i][quant_has_tile(wtype) ? 1 : 0];
}

/* The kernels for a compute type under the current ISA; NULL entries fall back
 * to the next lower ISA. Asserts on a non-compute type: callers validate types
 * when they load a model, so reaching here with one is a bug. */
static quant_kernels resolve(uint32_t type) {
    KVS_ASSERT(type < QUANT_TYPE_LIMIT && table_ref.k[type].dot);
    quant_kernels k = {0};
    for (int i = (int)kvs_isa_current(); i >= 0; i--) {
        const quant_kernels *t = &isa_tables[i]->k[type];
        if (!k.dot) k.dot = t->dot;
        if (!k.dequant) k.dequant = t->dequant;
        if (!k.act) k.act = t->act;
    }
    return k;
}

static void check_n(uint32_t type, int64_t n) {
    KVS_ASSERT(n >= 0 && n % traits[type].block_elems == 0);
}

size_t quant_act_row_bytes(uint32_t wtype, int64_t n) {
    if (wtype >= QUANT_TYPE_LIMIT || !table_ref.k[wtype].dot || n < 0) return 0;
    switch (wtype) {
    case QUANT_F32: case QUANT_F16: case QUANT_BF16: return (size_t)n * sizeof(float);
    case QUANT_Q2_K: case QUANT_Q3_K: case QUANT_Q4_K: case QUANT_Q5_K: case QUANT_Q6_K: case QUANT_IQ4_XS:
        return (size_t)(n / QKK) * sizeof(block_q8_k);
    default: return (size_t)(n / QK32) * sizeof(act_q8);
    }
}

void quant_act_quantize(uint32_t wtype, const float *x, void *act, int64_t n) {
    quant_kernels k = resolve(wtype);
    check_n(wtype, n);
    k.act(x, act, n);
}

float quant_dot(uint32_t wtype, int64_t n, const void *w, const void *act) {
    quant_kernels k = resolve(wtype);
    check_n(wtype, n);
    float r;
    k.dot(n, w, act, 0, 1, &r);
    return r;
}

void quant_dot_multi(uint32_t wtype, int64_t n, const void *w, const void *act, size_t act_stride,
                     int n_act, float *out) {
    quant_kernels k = resolve(wtype);
    check_n(wtype, n);
    if (n_act > 0) k.dot(n, w, act, act_stride, n_act, out);
}

void quant_dequant_row(uint32_t wtype, const void *w, float *y, int64_t n) {
    quant_kernels k = resolve(wtype);
    check_n(wtype, n);
    k.dequant(w, y, n);
}

void quant_act_quantize_ref(uint32_t wtype, const float *x, void *act, int64_t n) {
    KVS_ASSERT(wtype < QUANT_TYPE_LIMIT && table_ref.k[wtype].act);
    check_n(wtype, n);
    table_ref.k[wtype].act(x, act, n);
}

float quant_dot_ref(uint32_t wtype, int64_t n, const void *w, const void *act) {
    KVS_ASSERT(wtype < QUANT_TYPE_LIMIT && table_ref.k[wtype].dot);
    check_n(wtype, n);
    float r;
    table_ref.k[wtype].dot(n, w, act, 0, 1, &r);
    return r;
}

void quant_dequant_row_ref(uint32_t wtype, const void *w, float *y, int64_t n) {
    KVS_ASSERT(wtype < QUANT_TYPE_LIMIT && table_ref.k[wtype].dequant);
    check_n(wtype, n);
    table_ref.k[wtype].dequant(w, y, n);
}

void quant_f16_to_f32_row(const uint16_t *src, float *dst, int64_t n) {
    for (int i = (int)kvs_isa_current(); i >= 0; i--)
        if (isa_tables[i]->f16_to_f32) {
            isa_tables[i]->f16_to_f32(src, dst, n);
            return;
        }
}

void quant_f32_to_f16_row(const float *src, uint16_t *dst, int64_t n) {
    for (int i = (int)kvs_isa_current(); i >= 0; i--)
        if (isa_tables[i]->f32_to_f16) {
            isa_tables[i]->f32_to_f16(src, dst, n);
            return;
        }
}

/* --- weight quantizers (the reference ones of ref/rows.c) ------------------- */

bool quant_quantize_row(uint32_t type, const float *x, void *w, int64_t n) {
    const quant_traits *t = quant_get_traits(type);
    if (!t || n < 0 || n % t->block_elems != 0) return false;
    switch (type) {
    case QUANT_F32: memcpy(w, x, (size_t)n * sizeof(float)); return true;
    case QUANT_F16: quant_f32_to_f16_row(x, (uint16_t *)w, n); return true;
    case QUANT_BF16: {
        uint16_t *y = (uint16_t *)w;
        for (int64_t i = 0; i < n; i++) y[i] = kvs_f32_to_bf16(x[i]);
        return true;
    }
    case QUANT_Q4_0: quant_ref_quantize_q4_0(x, w, n); return true;
    case QUANT_Q4_1: quant_ref_quantize_q4_1(x, w, n); return true;
    case QUANT_Q5_0: quant_ref_quantize_q5_0(x, w, n); return true;
    case QUANT_Q5_1: quant_ref_quantize_q5_1(x, w, n); return true;
    case QUANT_Q8_0: quant_ref_quantize_q8_0(x, w, n); return true;
    case QUANT_Q4_K: quant_ref_quantize_q4_k(x, w, n); return true;
    case QUANT_Q5_K: quant_ref_quantize_q5_k(x, w, n); return true;
    case QUANT_Q6_K: quant_ref_quantize_q6_k(x, w, n); return true;
    case QUANT_Q2_K: quant_ref_quantize_q2_k(x, w, n); return true;
    case QUANT_Q3_K: quant_ref_quantize_q3_k(x, w, n); return true;
    case QUANT_IQ4_NL: quant_ref_quantize_iq4_nl(x, w, n); return true;
    case QUANT_IQ4_XS: quant_ref_quantize_iq4_xs(x, w, n); return true;
    default: return false;
    }
}

/* --- tiled prefill (design note 6) ----------------------------------------- */

bool quant_has_tile(uint32_t wtype) {
    return wtype < QUANT_TYPE_LIMIT && isa_tables[kvs_isa_current()]->k[wtype].tile != NULL;
}

int quant_tile_min_tokens(uint32_t wtype) {
    if (!quant_has_tile(wtype)) return 0;
    const int m = isa_tables[kvs_isa_current()]->k[wtype].tile_min_tokens;
    return m > 0 ? m : 5;
}

void quant_act_tile_layout(uint32_t wtype, void *act, int64_t n) {
    KVS_ASSERT(wtype == QUANT_Q4_0 || wtype == QUANT_Q8_0 || wtype == QUANT_Q4_K || wtype == QUANT_Q2_K ||
               wtype == QUANT_Q3_K || wtype == QUANT_IQ4_XS);
    check_n(wtype, n);
    const quant_layout_fn own = isa_tables[kvs_isa_current()]->k[wtype].layout;
    if (own) {
        own(act, n);
        return;
    }
    if (wtype != QUANT_Q4_0 && wtype != QUANT_Q8_0) return; /* these tiles read block_q8_k rows as they are */
    act_q8 *y = (act_q8 *)act;
    for (int64_t g = 0; g + 8 <= n / QK32; g += 8) {
        act_q8 b[8];
        memcpy(b, y + g, sizeof b);
        act_q8x8 t;
        for (int k = 0; k < 8; k++) {
            t.d[k] = b[k].d;
            t.ns[k] = wtype == QUANT_Q4_0 ? b[k].s * -8.0f : 0.0f; /* q8_0: unused (and no s) */
            for (int i = 0; i < 8; i++) memcpy(&t.qs[i][4 * k], &b[k].qs[4 * i], 4);
        }
        memcpy(y + g, &t, sizeof t);
    }
}

void quant_dot_tile(uint32_t wtype, int64_t n, const void *w, size_t w_stride, int n_rows, const void *act,
                    size_t act_stride, int n_act, float *out, size_t out_stride) {
    KVS_ASSERT(quant_has_tile(wtype));
    check_n(wtype, n);
    if (n_rows > 0 && n_act > 0)
        isa_tables[kvs_isa_current()]->k[wtype].tile(n, w, w_stride, n_rows, act, act_stride, n_act, out,
                                                       out_stride);
}

/* --- r8 (row-interleaved) weights ------------------------------------------ */

/* Each type's packer and unpacker; quant_r8_supported is "has one". */
typedef struct {
    void (*pack)(int64_t n, const void *rows, size_t row_stride, void *out);
    void (*unpack)(int64_t n, const void *group, void *rows, size_t row_stride);
} r8_codec;
#define R8_CODEC(T, type) [T] = {quant_ref_r8_pack_##type, quant_ref_r8_unpack_##type}
static const r8_codec R8_CODECS[QUANT_TYPE_LIMIT] = {
    R8_CODEC(QUANT_Q4_0, q4_0),   R8_CODEC(QUANT_Q4_1, q4_1),     R8_CODEC(QUANT_Q5_0, q5_0),
    R8_CODEC(QUANT_Q5_1, q5_1),   R8_CODEC(QUANT_Q8_0, q8_0),     R8_CODEC(QUANT_IQ4_NL, iq4_nl),
    R8_CODEC(QUANT_Q2_K, q2_k),   R8_CODEC(QUANT_Q3_K, q3_k),     R8_CODEC(QUANT_Q4_K, q4_k),
    R8_CODEC(QUANT_Q5_K, q5_k),   R8_CODEC(QUANT_Q6_K, q6_k),     R8_CODEC(QUANT_IQ4_XS, iq4_xs),
};

bool quant_r8_supported(uint32_t wtype) { return wtype < QUANT_TYPE_LIMIT && R8_CODECS[wtype].pack; }

/* A supported type and whole blocks of it. */
static void check_r8(uint32_t wtype, int64_t n) {
    KVS_ASSERT(quant_r8_supported(wtype) && n >= 0 && n % quant_get_traits(wtype)->block_elems == 0);
}

void quant_r8_pack(uint32_t wtype, int64_t n, const void *rows, size_t row_stride, void *out) {
    check_r8(wtype, n);
    R8_CODECS[wtype].pack(n, rows, row_stride, out);
}

void quant_r8_unpack(uint32_t wtype, int64_t n, const void *group, void *rows, size_t row_stride) {
    check_r8(wtype, n);
    R8_CODECS[wtype].unpack(n, group, rows, row_stride);
}

void quant_dot_r8_ref(uint32_t wtype, int64_t n, const void *w, int n_groups, const void *act,
                      size_t act_stride, int n_act, float *out, size_t out_stride) {
    check_r8(wtype, n);
    table_ref.k[wtype].r8(n, w, n_groups, act, act_stride, n_act, out, out_stride);
}

static atomic_bool r8_enabled = true;

void quant_r8_set_enabled(bool on) { atomic_store(&r8_enabled, on); }

bool quant_r8_preferred(uint32_t wtype) {
    if (!quant_r8_supported(wtype) || !atomic_load(&r8_enabled)) return false;
    for (int i = (int)kvs_isa_current(); i > (int)KVS_ISA_SCALAR; i--)
        if (isa_tables[i]->k[wtype].r8) return true;
    return false;
}

static _Atomic int r8_walk = QUANT_R8_WALK_SPREAD; /* enum quant_r8_walk */

void quant_r8_set_walk(enum quant_r8_walk walk) {
    const int w = (int)walk;
    atomic_store(&r8_walk, w < 0 ? QUANT_R8_WALK_SPREAD : w > QUANT_R8_WALK_SPREAD ? QUANT_R8_WALK_SPREAD : w);
}

enum quant_r8_walk quant_r8_walk(void) {
    return (enum quant_r8_walk)atomic_load_explicit(&r8_walk, memory_order_relaxed);
}

/* The kernel table entry whose r8 kernels wtype runs under the current ISA
 * (the best one that has them); NULL: none. */
static const quant_kernels *r8_entry(uint32_t wtype) {
    for (int i = (int)kvs_isa_current(); i >= 0; i--)
        if (isa_tables[i]->k[wtype].r8) return &isa_tables[i]->k[wtype];
    return NULL;
}

/* The kernel of entry k (r8_entry) for n_act tokens; NULL: none. */
static quant_dot_r8_fn r8_kernel(const quant_kernels *k, int n_act) {
    if (!k || n_act != 1) return k ? k->r8 : NULL;
    const enum quant_r8_walk walk = quant_r8_walk();
    if (walk == QUANT_R8_WALK_SPREAD && k->r8_spread1) return k->r8_spread1;
    if (walk >= QUANT_R8_WALK_QUADS && k->r8_quads1) return k->r8_quads1;
    return walk != QUANT_R8_WALK_ONE && k->r8_pairs1 ? k->r8_pairs1 : k->r8;
}

enum quant_r8_walk quant_r8_walk_used(uint32_t wtype) {
    if (!quant_r8_supported(wtype)) return QUANT_R8_WALK_ONE;
    const quant_kernels *k = r8_entry(wtype);
    if (!k) return QUANT_R8_WALK_ONE;
    const quant_dot_r8_fn one = r8_kernel(k, 1);
    if (one == k->r8_spread1) return QUANT_R8_WALK_SPREAD;
    if (one == k->r8_quads1) return QUANT_R8_WALK_QUADS;
    return one == k->r8_pairs1 ? QUANT_R8_WALK_PAIRS : QUANT_R8_WALK_ONE;
}

void quant_dot_r8(uint32_t wtype, int64_t n, const void *w, int n_groups, const void *act, size_t act_stride,
                  int n_act, float *out, size_t out_stride) {
    KVS_ASSERT(quant_r8_supported(wtype));
    check_n(wtype, n);
    if (n_groups <= 0 || n_act <= 0) return;
    quant_dot_r8_fn f = r8_kernel(r8_entry(wtype), n_act);
    KVS_ASSERT(f && "no r8 kernel");
    f(n, w, n_groups, act, act_stride, n_act, out, out_stride);
}
