/*
 * ref/r8 — the row-interleaved ("r8") weight layout (quant.h,
 * block_q4_0x8 in quant_impl.h): packing, unpacking and the scalar reference
 * kernels. The SIMD kernels (x86/r8_avx2.c) run the same float steps per
 * (row, token) — t = fma(P, da, -8 s), acc = fma(t, dw, acc) over the blocks in
 * order, P the exact integer sum — so they are bit-identical to this one.
 */
#include <math.h>
#include <string.h>

#include "quant_impl.h"

/* Four bytes at p as one word (the packers move four elements at a time). */
static uint32_t ld32(const void *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
static void st32(void *p, uint32_t v) { memcpy(p, &v, 4); }

#define LO4 0x0F0F0F0Fu /* the low nibble of each byte */
#define LO2 0x03030303u /* its low two bits */

/* Four bytes of packed nibbles from the words of elements e..e+3 (lo) and
 * e+4..e+7 (hi), both in the low (high: from_hi) nibbles of their bytes:
 * element e + i to the low nibble of byte i, e + 4 + i to its high nibble. */
static uint32_t nib_pair(uint32_t lo, uint32_t hi, bool from_hi) {
    return from_hi ? (lo >> 4 & LO4) | (hi & ~LO4) : (lo & LO4) | (hi & LO4) << 4;
}

/* Row r's 32 nibbles of a q4_0-style block (qs[k]: element k low, k + 16
 * high) into an r8 block's qs (q4_0x8's order): elements 8 j + i and 8 j + 4 +
 * i are the low nibbles of qs[8 j + i] and qs[8 j + 4 + i] for j = 0, 1, their
 * high nibbles for j + 2. */
static void pack_nibbles32(uint8_t *oqs, int r, const uint8_t qs[16]) {
    for (int j = 0; j < 2; j++) {
        const uint32_t lo = ld32(qs + 8 * j), hi = ld32(qs + 8 * j + 4);
        st32(oqs + 32 * j + 4 * r, nib_pair(lo, hi, false));
        st32(oqs + 32 * (j + 2) + 4 * r, nib_pair(lo, hi, true));
    }
}

/* Nibble of row r's element e (0..31) in an r8 block's qs (q4_0x8's order). */
static int nibble32(const uint8_t *gqs, int r, int e) {
    const uint8_t v = gqs[32 * (e / 8) + 4 * r + e % 4];
    return e % 8 < 4 ? v & 0xF : v >> 4;
}

static void unpack_nibbles32(const uint8_t *gqs, int r, uint8_t qs[16]) {
    for (int k = 0; k < 16; k++) qs[k] = (uint8_t)(nibble32(gqs, r, k) | nibble32(gqs, r, k + 16) << 4);
}

/* The fifth bits of a q5 block (bit e of the LE word qh: element e) as q5_0x8 /
 * q5_1x8 keep them for row r (quant_impl.h), and back. */
static void pack_qh32(uint8_t *oqh, int r, const uint8_t qh[4]) {
    const uint32_t h = ld32(qh);
    for (int i = 0; i < 4; i++) { /* bit k of byte i: element 4 k + i, bit 4 k + i of h */
        uint32_t x = h >> i & 0x11111111u;
        x = (x | x >> 3) & 0x03030303u;
        x = (x | x >> 6) & 0x000F000Fu;
        oqh[4 * r + i] = (uint8_t)(x | x >> 12);
    }
}

static int qh32_bit(const uint8_t *gqh, int r, int e) { return gqh[4 * r + e % 4] >> (2 * (e / 8) + (e % 8) / 4) & 1; }

static void unpack_qh32(const uint8_t *gqh, int r, uint8_t qh[4]) {
    uint32_t h = 0;
    for (int e = 0; e < 32; e++) h |= (uint32_t)qh32_bit(gqh, r, e) << e;
    st32(qh, h);
}

/* The 32-element types' packers and unpackers: d and the nibbles, and the
 * min m (MOVE_M / BACK_M) and fifth bits qh (MOVE_QH / BACK_QH) where the
 * type has them (R8_B32_NONE where not). */
#define R8_B32_MOVE_M(o, x, r) ((o).m[r] = (x)->m)
#define R8_B32_MOVE_QH(o, x, r) pack_qh32((o).qh, r, (x)->qh)
#define R8_B32_BACK_M(x, g, r) ((x).m = (g).m[r])
#define R8_B32_BACK_QH(x, g, r) unpack_qh32((g).qh, r, (x).qh)
#define R8_B32_NONE(a, b, r) ((void)0)
#define R8_B32_PACKERS(type, rowblk_t, blk_t, MOVE_M, MOVE_QH, BACK_M, BACK_QH)                               \
    void quant_ref_r8_pack_##type(int64_t n, const void *rows, size_t row_stride, void *out) {                \
        blk_t *g = (blk_t *)out;                                                                              \
        for (int64_t b = 0; b < n / QK32; b++) {                                                              \
            blk_t o;                                                                                          \
            memset(&o, 0, sizeof o);                                                                          \
            for (int r = 0; r < 8; r++) {                                                                     \
                const rowblk_t *x = (const rowblk_t *)((const uint8_t *)rows + (size_t)r * row_stride) + b;   \
                o.d[r] = x->d;                                                                                \
                MOVE_M(o, x, r);                                                                              \
                MOVE_QH(o, x, r);                                                                             \
                pack_nibbles32(o.qs, r, x->qs);                                                               \
            }                                                                                                 \
            memcpy(&g[b], &o, sizeof o);                                                                      \
        }                                                                                                     \
    }                                                                                                         \
    void quant_ref_r8_unpack_##type(int64_t n, const void *group, void *rows, size_t row_stride) {            \
        const blk_t *g = (const blk_t *)group;                                                                \
        for (int64_t b = 0; b < n / QK32; b++)                                                                \
            for (int r = 0; r < 8; r++) {                                                                     \
                rowblk_t x;                                                                                   \
                x.d = g[b].d[r];                                                                              \
                BACK_M(x, g[b], r);                                                                           \
                BACK_QH(x, g[b], r);                                                                          \
                unpack_nibbles32(g[b].qs, r, x.qs);                                                           \
                memcpy((uint8_t *)rows + (size_t)r * row_stride + (size_t)b * sizeof x, &x, sizeof x);        \
            }                                                                                                 \
    }
R8_B32_PACKERS(q4_0, block_q4_0, block_q4_0x8, R8_B32_NONE, R8_B32_NONE, R8_B32_NONE, R8_B32_NONE)
R8_B32_PACKERS(iq4_nl, block_iq4_nl, block_iq4_nlx8, R8_B32_NONE, R8_B32_NONE, R8_B32_NONE, R8_B32_NONE)
R8_B32_PACKERS(q4_1, block_q4_1, block_q4_1x8, R8_B32_MOVE_M, R8_B32_NONE, R8_B32_BACK_M, R8_B32_NONE)
R8_B32_PACKERS(q5_0, block_q5_0, block_q5_0x8, R8_B32_NONE, R8_B32_MOVE_QH, R8_B32_NONE, R8_B32_BACK_QH)
R8_B32_PACKERS(q5_1, block_q5_1, block_q5_1x8, R8_B32_MOVE_M, R8_B32_MOVE_QH, R8_B32_BACK_M, R8_B32_BACK_QH)

/* Row r's exact sum P of u a over a 32-element r8 block, u its nibble (with
 * the fifth bit from qh when qh is not NULL). */
static int32_t sum32(const uint8_t *qs, const uint8_t *qh, int r, const act_q8 *a) {
    int32_t p = 0;
    for (int e = 0; e < 32; e++) p += (nibble32(qs, r, e) | (qh ? qh32_bit(qh, r, e) << 4 : 0)) * a->qs[e];
    return p;
}

/* Row r's block step: t = fma(P, da, -8 s), acc = fma(t, dw, acc). */
static float step_q4_0(const block_q4_0x8 *g, const act_q8 *a, int r, float acc) {
    const float tt = fmaf((float)sum32(g->qs, NULL, r, a), a->d, a->s * -8.0f);
    return fmaf(tt, kvs_f16_to_f32(g->d[r]), acc);
}

/* q4_1 / q5_1 (u: the nibble, or with the fifth bit): acc = fma(P da, dw,
 * acc), then acc = fma(m, s, acc) (s = da sum(a)). */
static float step_min32(const uint16_t *d, const uint16_t *m, int32_t p, const act_q8 *a, int r, float acc) {
    acc = fmaf((float)p * a->d, kvs_f16_to_f32(d[r]), acc);
    return fmaf(kvs_f16_to_f32(m[r]), a->s, acc);
}

static float step_q4_1(const block_q4_1x8 *g, const act_q8 *a, int r, float acc) {
    return step_min32(g->d, g->m, sum32(g->qs, NULL, r, a), a, r, acc);
}

static float step_q5_1(const block_q5_1x8 *g, const act_q8 *a, int r, float acc) {
    return step_min32(g->d, g->m, sum32(g->qs, g->qh, r, a), a, r, acc);
}

/* q5_0: q4_0's steps with u = q + 16: t = fma(P, da, -16 s), acc = fma(t, dw, acc). */
static float step_q5_0(const block_q5_0x8 *g, const act_q8 *a, int r, float acc) {
    return fmaf(fmaf((float)sum32(g->qs, g->qh, r, a), a->d, a->s * -16.0f), kvs_f16_to_f32(g->d[r]), acc);
}

/* iq4_nl: the exact sum of table values P (its activations carry qsum128, the
 * SIMD kernels' offset), acc = fma(P da, dw, acc). */
static float step_iq4_nl(const block_iq4_nlx8 *g, const act_q8 *a, int r, float acc) {
    int32_t p = 0;
    for (int e = 0; e < 32; e++) p += quant_iq4_values[nibble32(g->qs, r, e)] * a->qs[e];
    return fmaf((float)p * a->d, kvs_f16_to_f32(g->d[r]), acc);
}

/* q8_0: element e of row r sits at qs[32 (e / 4) + 4 r + e % 4]. */
void quant_ref_r8_pack_q8_0(int64_t n, const void *rows, size_t row_stride, void *out) {
    const int64_t nb = n / QK32;
    block_q8_0x8 *g = (block_q8_0x8 *)out;
    for (int64_t b = 0; b < nb; b++) {
        block_q8_0x8 o;
        for (int r = 0; r < 8; r++) {
            const block_q8_0 *x = (const block_q8_0 *)((const uint8_t *)rows + (size_t)r * row_stride) + b;
            o.d[r] = x->d;
            for (int j = 0; j < 8; j++) memcpy(&o.qs[32 * j + 4 * r], &x->qs[4 * j], 4);
        }
        memcpy(&g[b], &o, sizeof o);
    }
}

void quant_ref_r8_unpack_q8_0(int64_t n, const void *group, void *rows, size_t row_stride) {
    const int64_t nb = n / QK32;
    const block_q8_0x8 *g = (const block_q8_0x8 *)group;
    for (int64_t b = 0; b < nb; b++)
        for (int r = 0; r < 8; r++) {
            block_q8_0 x;
            x.d = g[b].d[r];
            for (int e = 0; e < 32; e++) x.qs[e] = g[b].qs[32 * (e / 4) + 4 * r + e % 4];
            memcpy((uint8_t *)rows + (size_t)r * row_stride + (size_t)b * sizeof x, &x, sizeof x);
        }
}

/* Row r's block step: acc = fma(P da, dw, acc), P the exact sum. */
static float step_q8_0(const block_q8_0x8 *g, const act_q8 *a, int r, float acc) {
    int32_t p = 0;
    for (int e = 0; e < 32; e++) p += g->qs[32 * (e / 4) + 4 * r + e % 4] * a->qs[e];
    return fmaf((float)p * a->d, kvs_f16_to_f32(g->d[r]), acc);
}

/* The six-bit scale (mins: m) of entry k (8 j + r) of a q4_kx8 block. */
static int q4_kx8_entry(const block_q4_kx8 *g, int k, bool min) {
    const uint8_t *lo = min ? g->m_lo : g->sc_lo;
    const int hi_shift = (min ? 4 : 0) + (k < 32 ? 0 : 2);
    const int low4 = k < 32 ? lo[k] & 0xF : lo[k - 32] >> 4;
    return low4 | ((g->hi[k % 32] >> hi_shift) & 3) << 4;
}

/* Row r of o from x: its scales, mins and nibbles in q4_kx8's places (o's
 * shared bytes or-ed into, so o starts zeroed). */
static void pack_q4_k_row(block_q4_kx8 *o, int r, const block_q4_k *x) {
    o->d[r] = x->d;
    o->dmin[r] = x->dmin;
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        quant_scale_min_k4(j, x->scales, &sc, &m);
        const int k = 8 * j + r, sh = k < 32 ? 0 : 4;
        o->sc_lo[k % 32] |= (uint8_t)((sc & 0xF) << sh);
        o->m_lo[k % 32] |= (uint8_t)((m & 0xF) << sh);
        o->hi[k % 32] |= (uint8_t)((sc >> 4) << (k < 32 ? 0 : 2) | (m >> 4) << (k < 32 ? 4 : 6));
    }
    /* Elements 32 j + 8 c + i and + 4. A q4_k block holds element 64 jj + l
     * (l < 32) in the low nibble of qs[32 jj + l], 64 jj + 32 + l in the high
     * one: the low nibbles of qs[32 (j / 2) + 8 c + i] and qs[.. + 4] for
     * even j, their high ones for odd j. */
    for (int jj = 0; jj < 4; jj++)
        for (int c = 0; c < 4; c++) {
            const uint32_t lo = ld32(x->qs + 32 * jj + 8 * c), hi = ld32(x->qs + 32 * jj + 8 * c + 4);
            st32(o->qs + 128 * (2 * jj) + 32 * c + 4 * r, nib_pair(lo, hi, false));
            st32(o->qs + 128 * (2 * jj + 1) + 32 * c + 4 * r, nib_pair(lo, hi, true));
        }
}

void quant_ref_r8_pack_q4_k(int64_t n, const void *rows, size_t row_stride, void *out) {
    const int64_t nb = n / QKK;
    block_q4_kx8 *g = (block_q4_kx8 *)out;
    for (int64_t b = 0; b < nb; b++) {
        block_q4_kx8 o;
        memset(&o, 0, sizeof o);
        for (int r = 0; r < 8; r++)
            pack_q4_k_row(&o, r, (const block_q4_k *)((const uint8_t *)rows + (size_t)r * row_stride) + b);
        memcpy(&g[b], &o, sizeof o);
    }
}

/* Row r of g as a q4_k block (the inverse of pack_q4_k_row). */
static void unpack_q4_k_row(const block_q4_kx8 *g, int r, block_q4_k *x) {
    memset(x, 0, sizeof *x);
    x->d = g->d[r];
    x->dmin = g->dmin[r];
    for (int j = 0; j < 8; j++) { /* the inverse of quant_scale_min_k4 */
        const int sc = q4_kx8_entry(g, 8 * j + r, false), m = q4_kx8_entry(g, 8 * j + r, true);
        if (j < 4) {
            x->scales[j] |= (uint8_t)(sc & 63);
            x->scales[j + 4] |= (uint8_t)(m & 63);
        } else {
            x->scales[j + 4] = (uint8_t)((sc & 0xF) | (m & 0xF) << 4);
            x->scales[j - 4] |= (uint8_t)((sc >> 4) << 6);
            x->scales[j] |= (uint8_t)((m >> 4) << 6);
        }
    }
    for (int j = 0; j < 8; j++)
        for (int c = 0; c < 4; c++)
            for (int i = 0; i < 4; i++) {
                const uint8_t v = g->qs[128 * j + 32 * c + 4 * r + i];
                const int e = 32 * j + 8 * c + i;
                const int e2 = e + 4;
                const int ce = e / 64, we = e % 64, ce2 = e2 / 64, we2 = e2 % 64;
                if (we < 32) x->qs[32 * ce + we] |= v & 0xF; else x->qs[32 * ce + we - 32] |= (uint8_t)((v & 0xF) << 4);
                if (we2 < 32) x->qs[32 * ce2 + we2] |= v >> 4; else x->qs[32 * ce2 + we2 - 32] |= (uint8_t)((v >> 4) << 4);
            }
}

void quant_ref_r8_unpack_q4_k(int64_t n, const void *group, void *rows, size_t row_stride) {
    const int64_t nb = n / QKK;
    const block_q4_kx8 *g = (const block_q4_kx8 *)group;
    for (int64_t b = 0; b < nb; b++)
        for (int r = 0; r < 8; r++) {
            block_q4_k x;
            unpack_q4_k_row(&g[b], r, &x);
            memcpy((uint8_t *)rows + (size_t)r * row_stride + (size_t)b * sizeof x, &x, sizeof x);
        }
}

/* The 8 x 8 bit matrix x (bit j of byte k) transposed (to bit k of byte j). */
static uint64_t bit_transpose8(uint64_t x) {
    uint64_t t = (x ^ (x >> 7)) & 0x00AA00AA00AA00AAull;
    x ^= t ^ (t << 7);
    t = (x ^ (x >> 14)) & 0x0000CCCC0000CCCCull;
    x ^= t ^ (t << 14);
    t = (x ^ (x >> 28)) & 0x00000000F0F0F0F0ull;
    return x ^ t ^ (t << 28);
}

/* q5_k: the low four bits and the scales through q4_k's packing, then the
 * fifth bits. A q5_k block keeps element e's in bit e / 32 of qh[e % 32], so
 * byte 8 c + 4 h + i of its qh holds, in bit j, the fifth bit of element
 * 32 j + 8 c + 4 h + i, which block_q5_kx8 wants in bit 2 c + h of
 * qh[32 j + 4 r + i]: for each i, the eight bytes (c, h) as one 8 x 8 bit
 * matrix, transposed. */

void quant_ref_r8_pack_q5_k(int64_t n, const void *rows, size_t row_stride, void *out) {
    const int64_t nb = n / QKK;
    block_q5_kx8 *g = (block_q5_kx8 *)out;
    for (int64_t b = 0; b < nb; b++) {
        block_q5_kx8 o;
        memset(&o, 0, sizeof o);
        for (int r = 0; r < 8; r++) {
            const block_q5_k *x = (const block_q5_k *)((const uint8_t *)rows + (size_t)r * row_stride) + b;
            block_q4_k low = {.d = x->d, .dmin = x->dmin};
            memcpy(low.scales, x->scales, sizeof low.scales);
            memcpy(low.qs, x->qs, sizeof low.qs);
            pack_q4_k_row(&o.lo, r, &low);
            for (int i = 0; i < 4; i++) {
                uint64_t m = 0; /* byte 2 c + h: qh[8 c + 4 h + i] */
                for (int k = 0; k < 8; k++) m |= (uint64_t)x->qh[8 * (k / 2) + 4 * (k % 2) + i] << (8 * k);
                m = bit_transpose8(m);
                for (int j = 0; j < 8; j++) o.qh[32 * j + 4 * r + i] = (uint8_t)(m >> (8 * j));
            }
        }
        memcpy(&g[b], &o, sizeof o);
    }
}

/* Row r's fifth bit of element 32 j + 8 c + i + 4 h (h 0: low nibble, 1: high). */
static int q5_kx8_bit(const block_q5_kx8 *g, int r, int j, int c, int i, int h) {
    return (g->qh[32 * j + 4 * r + i] >> (2 * c + h)) & 1;
}

void quant_ref_r8_unpack_q5_k(int64_t n, const void *group, void *rows, size_t row_stride) {
    const int64_t nb = n / QKK;
    const block_q5_kx8 *g = (const block_q5_kx8 *)group;
    for (int64_t b = 0; b < nb; b++)
        for (int r = 0; r < 8; r++) {
            block_q4_k low;
            unpack_q4_k_row(&g[b].lo, r, &low);
            block_q5_k x = {.d = low.d, .dmin = low.dmin};
            memcpy(x.scales, low.scales, sizeof x.scales);
            memcpy(x.qs, low.qs, sizeof x.qs);
            for (int j = 0; j < 8; j++)
                for (int c = 0; c < 4; c++)
                    for (int i = 0; i < 4; i++)
                        for (int h = 0; h < 2; h++) {
                            const int e = 32 * j + 8 * c + i + 4 * h;
                            x.qh[e % 32] |= (uint8_t)(q5_kx8_bit(&g[b], r, j, c, i, h) << (e / 32));
                        }
            memcpy((uint8_t *)rows + (size_t)r * row_stride + (size_t)b * sizeof x, &x, sizeof x);
        }
}

/* Row r's super-block step: S1 = sum_j sc_j P_j, S2 = sum_j m_j bs_j (exact
 * integers; bs_j the activation's sum over sub-block j),
 * acc = fma(S1, d da, acc), acc = fma(S2, -(dmin da), acc). */
static float step_q4_k(const block_q4_kx8 *g, const block_q8_k *a, int r, float acc) {
    int32_t s1 = 0, s2 = 0;
    for (int j = 0; j < 8; j++) {
        int32_t p = 0;
        for (int c = 0; c < 4; c++)
            for (int i = 0; i < 4; i++) {
                const uint8_t v = g->qs[128 * j + 32 * c + 4 * r + i];
                const int e = 32 * j + 8 * c + i;
                p += (v & 0xF) * a->qs[e] + (v >> 4) * a->qs[e + 4];
            }
        s1 += q4_kx8_entry(g, 8 * j + r, false) * p;
        s2 += q4_kx8_entry(g, 8 * j + r, true) * a->bsums[j]; /* 32-element sums (q8_k_sums32) */
    }
    const float dd = kvs_f16_to_f32(g->d[r]) * a->d, dm = kvs_f16_to_f32(g->dmin[r]) * a->d;
    acc = fmaf((float)s1, dd, acc);
    return fmaf((float)s2, -dm, acc);
}

/* q5_k: step_q4_k with each element's fifth bit (u = nibble + 16 bit, 0..31). */
static float step_q5_k(const block_q5_kx8 *g, const block_q8_k *a, int r, float acc) {
    int32_t s1 = 0, s2 = 0;
    for (int j = 0; j < 8; j++) {
        int32_t p = 0;
        for (int c = 0; c < 4; c++)
            for (int i = 0; i < 4; i++) {
                const uint8_t v = g->lo.qs[128 * j + 32 * c + 4 * r + i];
                const int e = 32 * j + 8 * c + i;
                p += ((v & 0xF) + 16 * q5_kx8_bit(g, r, j, c, i, 0)) * a->qs[e] +
                     ((v >> 4) + 16 * q5_kx8_bit(g, r, j, c, i, 1)) * a->qs[e + 4];
            }
        s1 += q4_kx8_entry(&g->lo, 8 * j + r, false) * p;
        s2 += q4_kx8_entry(&g->lo, 8 * j + r, true) * a->bsums[j]; /* 32-element sums (q8_k_sums32) */
    }
    const float dd = kvs_f16_to_f32(g->lo.d[r]) * a->d, dm = kvs_f16_to_f32(g->lo.dmin[r]) * a->d;
    acc = fmaf((float)s1, dd, acc);
    return fmaf((float)s2, -dm, acc);
}

/* iq4_xs: the six-bit scale (0..63) of entry k (8 j + r) of an iq4_xsx8 block. */
static int iq4_xsx8_scale(const block_iq4_xsx8 *g, int k) {
    const int low4 = k < 32 ? g->sc_lo[k] & 0xF : g->sc_lo[k - 32] >> 4;
    return low4 | ((g->sc_hi[k % 16] >> (2 * (k / 16))) & 3) << 4;
}

/* An iq4_xs block keeps element e (0..31) of sub-block j in the low nibble of
 * qs[16 j + e] (e < 16) or the high one of qs[16 j + e - 16]: elements 8 c + i
 * and 8 c + 4 + i are the low (c < 2) or high (c >= 2) nibbles of qs[16 j +
 * 8 (c % 2) + i] and [.. + 4]. */
void quant_ref_r8_pack_iq4_xs(int64_t n, const void *rows, size_t row_stride, void *out) {
    const int64_t nb = n / QKK;
    block_iq4_xsx8 *g = (block_iq4_xsx8 *)out;
    for (int64_t b = 0; b < nb; b++) {
        block_iq4_xsx8 o;
        memset(&o, 0, sizeof o);
        for (int r = 0; r < 8; r++) {
            const block_iq4_xs *x = (const block_iq4_xs *)((const uint8_t *)rows + (size_t)r * row_stride) + b;
            o.d[r] = x->d;
            for (int j = 0; j < 8; j++) {
                const int ls = quant_iq4_xs_scale(x, j), k = 8 * j + r;
                o.sc_lo[k % 32] |= (uint8_t)((ls & 0xF) << (k < 32 ? 0 : 4));
                o.sc_hi[k % 16] |= (uint8_t)((ls >> 4) << (2 * (k / 16)));
                for (int c = 0; c < 4; c++) {
                    const uint8_t *q = x->qs + 16 * j + 8 * (c % 2);
                    st32(o.qs + 128 * j + 32 * c + 4 * r, nib_pair(ld32(q), ld32(q + 4), c >= 2));
                }
            }
        }
        memcpy(&g[b], &o, sizeof o);
    }
}

void quant_ref_r8_unpack_iq4_xs(int64_t n, const void *group, void *rows, size_t row_stride) {
    const int64_t nb = n / QKK;
    const block_iq4_xsx8 *g = (const block_iq4_xsx8 *)group;
    for (int64_t b = 0; b < nb; b++)
        for (int r = 0; r < 8; r++) {
            block_iq4_xs x;
            memset(&x, 0, sizeof x);
            x.d = g[b].d[r];
            for (int j = 0; j < 8; j++) {
                const int ls = iq4_xsx8_scale(&g[b], 8 * j + r);
                x.scales_l[j / 2] |= (uint8_t)((ls & 0xF) << (4 * (j % 2)));
                x.scales_h |= (uint16_t)((ls >> 4) << (2 * j));
                for (int c = 0; c < 4; c++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t v = g[b].qs[128 * j + 32 * c + 4 * r + i];
                        for (int h = 0; h < 2; h++) {
                            const int e = 8 * c + i + 4 * h, nib = h ? v >> 4 : v & 0xF;
                            if (e < 16) x.qs[16 * j + e] |= (uint8_t)nib;
                            else x.qs[16 * j + e - 16] |= (uint8_t)(nib << 4);
                        }
                    }
            }
            memcpy((uint8_t *)rows + (size_t)r * row_stride + (size_t)b * sizeof x, &x, sizeof x);
        }
}

/* Row r's super-block step: S = sum_j (sc_j - 32) P_j, P_j the exact sum of
 * sub-block j's table values times the activation, acc = fma(S, d da, acc). */
static float step_iq4_xs(const block_iq4_xsx8 *g, const block_q8_k *a, int r, float acc) {
    int32_t s = 0;
    for (int j = 0; j < 8; j++) {
        int32_t p = 0;
        for (int c = 0; c < 4; c++)
            for (int i = 0; i < 4; i++) {
                const uint8_t v = g->qs[128 * j + 32 * c + 4 * r + i];
                const int e = 32 * j + 8 * c + i;
                p += quant_iq4_values[v & 0xF] * a->qs[e] + quant_iq4_values[v >> 4] * a->qs[e + 4];
            }
        s += (iq4_xsx8_scale(g, 8 * j + r) - 32) * p;
    }
    return fmaf((float)s, kvs_f16_to_f32(g->d[r]) * a->d, acc);
}

/* q6_k: element e = 128 half + 32 k + l of a block has u (0..63) with its low
 * four bits in ql[64 half + 32 (k & 1) + l] (the low nibble for k < 2, the
 * high one for k >= 2) and its top two in bits 2k, 2k + 1 of qh[32 half + l].
 * Sets u of element e (on a zeroed block). */
static void q6_k_set_u(block_q6_k *x, int e, int u) {
    const int half = e / 128, k = (e % 128) / 32, l = e % 32;
    x->ql[64 * half + l + 32 * (k & 1)] |= (uint8_t)((u & 0xF) << (k < 2 ? 0 : 4));
    x->qh[32 * half + l] |= (uint8_t)((u >> 4) << (2 * k));
}

/* Position of row r's element e (0..255) in a q6_kx8 block: its ql byte and
 * nibble, its qh byte and bit pair. */
static void q6_kx8_pos(int r, int e, int *ql, int *ql_shift, int *qh, int *qh_shift) {
    const int j = e / 32, w = e % 32, c = w / 8, i = w % 4, up = (w % 8) / 4;
    *ql = 128 * j + 32 * c + 4 * r + i;
    *ql_shift = 4 * up;
    const int h = w / 16, part = (w % 16) / 4; /* 0: +0, 1: +4, 2: +8, 3: +12 */
    *qh = 64 * j + 32 * h + 4 * r + i;
    *qh_shift = 2 * part;
}

void quant_ref_r8_pack_q6_k(int64_t n, const void *rows, size_t row_stride, void *out) {
    const int64_t nb = n / QKK;
    block_q6_kx8 *g = (block_q6_kx8 *)out;
    for (int64_t b = 0; b < nb; b++) {
        block_q6_kx8 o;
        memset(&o, 0, sizeof o);
        for (int r = 0; r < 8; r++) {
            const block_q6_k *x = (const block_q6_k *)((const uint8_t *)rows + (size_t)r * row_stride) + b;
            uint8_t u[QKK]; /* u of element e (q6_k_set_u), four elements l..l+3 of each quarter k at a time */
            for (int half = 0; half < 2; half++)
                for (int l = 0; l < 32; l += 4) {
                    const uint32_t l0 = ld32(x->ql + 64 * half + l), l1 = ld32(x->ql + 64 * half + 32 + l),
                                   h = ld32(x->qh + 32 * half + l);
                    uint8_t *uk = u + 128 * half + l; /* quarter k at uk + 32 k */
                    st32(uk, (l0 & LO4) | (h & LO2) << 4);
                    st32(uk + 32, (l1 & LO4) | (h >> 2 & LO2) << 4);
                    st32(uk + 64, (l0 >> 4 & LO4) | (h >> 4 & LO2) << 4);
                    st32(uk + 96, (l1 >> 4 & LO4) | (h >> 6 & LO2) << 4);
                }
            o.d[r] = x->d;
            for (int k = 0; k < 16; k++) o.sc[8 * k + r] = x->scales[k];
            for (int j = 0; j < 8; j++)
                for (int c = 0; c < 4; c++) { /* elements 32 j + 8 c + i and + 4 */
                    const int e = 32 * j + 8 * c;
                    st32(o.ql + 128 * j + 32 * c + 4 * r, nib_pair(ld32(u + e), ld32(u + e + 4), false));
                }
            for (int j = 0; j < 8; j++)
                for (int h = 0; h < 2; h++) { /* the top two bits of elements e + i, + 4, + 8, + 12 */
                    const uint8_t *ue = u + 32 * j + 16 * h;
                    st32(o.qh + 64 * j + 32 * h + 4 * r,
                         (ld32(ue) >> 4 & LO2) | (ld32(ue + 4) >> 4 & LO2) << 2 |
                             (ld32(ue + 8) >> 4 & LO2) << 4 | (ld32(ue + 12) >> 4 & LO2) << 6);
                }
        }
        memcpy(&g[b], &o, sizeof o);
    }
}

static int q6_kx8_u(const block_q6_kx8 *g, int r, int e) {
    int ql, qls, qh, qhs;
    q6_kx8_pos(r, e, &ql, &qls, &qh, &qhs);
    return ((g->ql[ql] >> qls) & 0xF) | ((g->qh[qh] >> qhs) & 3) << 4;
}

void quant_ref_r8_unpack_q6_k(int64_t n, const void *group, void *rows, size_t row_stride) {
    const int64_t nb = n / QKK;
    const block_q6_kx8 *g = (const block_q6_kx8 *)group;
    for (int64_t b = 0; b < nb; b++)
        for (int r = 0; r < 8; r++) {
            block_q6_k x;
            memset(&x, 0, sizeof x);
            x.d = g[b].d[r];
            for (int k = 0; k < 16; k++) x.scales[k] = g[b].sc[8 * k + r];
            for (int e = 0; e < QKK; e++) q6_k_set_u(&x, e, q6_kx8_u(&g[b], r, e));
            memcpy((uint8_t *)rows + (size_t)r * row_stride + (size_t)b * sizeof x, &x, sizeof x);
        }
}

/* Row r's super-block step: S = sum_g sc_g (sum_{e in g} u_e a_e - 32 bs_g)
 * (exact; bs_g the activation's sum over group g), acc = fma(S, d da, acc). */
static float step_q6_k(const block_q6_kx8 *g, const block_q8_k *a, int r, float acc) {
    int32_t s1 = 0, s2 = 0;
    for (int k = 0; k < 16; k++) {
        int32_t p = 0;
        for (int e = 16 * k; e < 16 * k + 16; e++) p += q6_kx8_u(g, r, e) * a->qs[e];
        s1 += g->sc[8 * k + r] * p;
        s2 += g->sc[8 * k + r] * a->bsums[k];
    }
    return fmaf((float)(s1 - 32 * s2), kvs_f16_to_f32(g->d[r]) * a->d, acc);
}

/* The two-bit q of the 256 elements of a q2_k / q3_k block's qs (element
 * 128 h + 32 j + l: bits 2j of qs[32 h + l]), four l at a time, into q[256],
 * with q3_k's top bits (hmask bit 4 h + j) at bit 2 where hmask is not NULL. */
static void crumbs256(const uint8_t qs[64], const uint8_t *hmask, uint8_t q[QKK]) {
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l += 4) {
            const uint32_t v = ld32(qs + 32 * h + l), m = hmask ? ld32(hmask + l) : 0;
            for (int j = 0; j < 4; j++)
                st32(q + 128 * h + 32 * j + l, (v >> (2 * j) & LO2) | (m >> (4 * h + j) & 0x01010101u) << 2);
        }
}

/* The low two bits of u[256] (crumbs256's order) into row r's words of an r8
 * block's qs (q2_kx8 / q3_kx8: qs[32 g + 4 r + i] bits 2c, element 16 g + 4 c
 * + i), and back: the q (0..3) of row r's element e. */
static void pack_crumbs(uint8_t *oqs, int r, const uint8_t u[QKK]) {
    for (int grp = 0; grp < 16; grp++) {
        uint32_t w = 0;
        for (int c = 0; c < 4; c++) w |= (ld32(u + 16 * grp + 4 * c) & LO2) << (2 * c);
        st32(oqs + 32 * grp + 4 * r, w);
    }
}

static int crumb(const uint8_t *gqs, int r, int e) {
    return (gqs[32 * (e / 16) + 4 * r + e % 4] >> (2 * ((e % 16) / 4))) & 3;
}

/* Row r's q of every element (0..255, crumb) into a q2_k / q3_k block's qs:
 * bits 2j of qs[32 h + l] for element 128 h + 32 j + l. */
static void unpack_crumbs(const uint8_t *gqs, int r, uint8_t qs[64]) {
    for (int e = 0; e < QKK; e++) qs[32 * (e / 128) + e % 32] |= (uint8_t)(crumb(gqs, r, e) << (2 * ((e % 128) / 32)));
}

/* q3_k: the six-bit scale (stored + 32, 0..63) of entry k (8 g + r) of a
 * q3_kx8 block. */
static int q3_kx8_scale(const block_q3_kx8 *g, int k) {
    const int low4 = k < 64 ? g->sc_lo[k] & 0xF : g->sc_lo[k - 64] >> 4;
    return low4 | ((g->sc_hi[k % 32] >> (2 * (k / 32))) & 3) << 4;
}

/* The top bit (0, 1) of row r's element e (32 j + 16 h + 4 c + i) of a
 * q3_kx8 block, and its u (0..7: crumb and top bit). */
static int q3_kx8_top(const block_q3_kx8 *g, int r, int e) {
    return (g->hm[32 * (e / 32) + 4 * r + e % 4] >> (4 * ((e % 32) / 16) + (e % 16) / 4)) & 1;
}

static int q3_kx8_u(const block_q3_kx8 *g, int r, int e) { return crumb(g->qs, r, e) | q3_kx8_top(g, r, e) << 2; }

void quant_ref_r8_pack_q3_k(int64_t n, const void *rows, size_t row_stride, void *out) {
    const int64_t nb = n / QKK;
    block_q3_kx8 *g = (block_q3_kx8 *)out;
    for (int64_t b = 0; b < nb; b++) {
        block_q3_kx8 o;
        memset(&o, 0, sizeof o);
        for (int r = 0; r < 8; r++) {
            const block_q3_k *x = (const block_q3_k *)((const uint8_t *)rows + (size_t)r * row_stride) + b;
            uint8_t u[QKK];
            int8_t sc[16];
            crumbs256(x->qs, x->hmask, u);
            quant_q3_k_scales(x->scales, sc);
            o.d[r] = x->d;
            for (int grp = 0; grp < 16; grp++) {
                const int k = 8 * grp + r, v = sc[grp] + 32;
                o.sc_lo[k % 64] |= (uint8_t)((v & 0xF) << (k < 64 ? 0 : 4));
                o.sc_hi[k % 32] |= (uint8_t)((v >> 4) << (2 * (k / 32)));
            }
            pack_crumbs(o.qs, r, u);
            for (int j = 0; j < 8; j++) {
                uint32_t w = 0;
                for (int hc = 0; hc < 8; hc++) w |= (ld32(u + 32 * j + 4 * hc) >> 2 & 0x01010101u) << hc;
                st32(o.hm + 32 * j + 4 * r, w);
            }
        }
        memcpy(&g[b], &o, sizeof o);
    }
}

void quant_ref_r8_unpack_q3_k(int64_t n, const void *group, void *rows, size_t row_stride) {
    const int64_t nb = n / QKK;
    const block_q3_kx8 *g = (const block_q3_kx8 *)group;
    for (int64_t b = 0; b < nb; b++)
        for (int r = 0; r < 8; r++) {
            block_q3_k x;
            memset(&x, 0, sizeof x);
            x.d = g[b].d[r];
            for (int grp = 0; grp < 16; grp++) {
                const int v = q3_kx8_scale(&g[b], 8 * grp + r);
                x.scales[grp % 8] |= (uint8_t)((v & 0xF) << (grp < 8 ? 0 : 4));
                x.scales[8 + grp % 4] |= (uint8_t)((v >> 4) << (2 * (grp / 4)));
            }
            unpack_crumbs(g[b].qs, r, x.qs);
            for (int e = 0; e < QKK; e++) /* e = 128 h + 32 j + l */
                x.hmask[e % 32] |= (uint8_t)(q3_kx8_top(&g[b], r, e) << (4 * (e / 128) + (e % 128) / 32));
            memcpy((uint8_t *)rows + (size_t)r * row_stride + (size_t)b * sizeof x, &x, sizeof x);
        }
}

/* Row r's super-block step: S = sum_g sc_g (sum_{e in g} u_e a_e - 4 bs_g)
 * (exact), acc = fma(S, d da, acc). */
static float step_q3_k(const block_q3_kx8 *g, const block_q8_k *a, int r, float acc) {
    int32_t s1 = 0, s2 = 0;
    for (int k = 0; k < 16; k++) {
        int32_t p = 0;
        for (int e = 16 * k; e < 16 * k + 16; e++) p += q3_kx8_u(g, r, e) * a->qs[e];
        const int sc = q3_kx8_scale(g, 8 * k + r) - 32;
        s1 += sc * p;
        s2 += sc * a->bsums[k];
    }
    return fmaf((float)(s1 - 4 * s2), kvs_f16_to_f32(g->d[r]) * a->d, acc);
}

void quant_ref_r8_pack_q2_k(int64_t n, const void *rows, size_t row_stride, void *out) {
    const int64_t nb = n / QKK;
    block_q2_kx8 *g = (block_q2_kx8 *)out;
    for (int64_t b = 0; b < nb; b++) {
        block_q2_kx8 o;
        for (int r = 0; r < 8; r++) {
            const block_q2_k *x = (const block_q2_k *)((const uint8_t *)rows + (size_t)r * row_stride) + b;
            uint8_t q[QKK];
            crumbs256(x->qs, NULL, q);
            o.d[r] = x->d;
            o.dmin[r] = x->dmin;
            for (int grp = 0; grp < 16; grp++) o.sc[8 * grp + r] = x->scales[grp];
            pack_crumbs(o.qs, r, q);
        }
        memcpy(&g[b], &o, sizeof o);
    }
}

void quant_ref_r8_unpack_q2_k(int64_t n, const void *group, void *rows, size_t row_stride) {
    const int64_t nb = n / QKK;
    const block_q2_kx8 *g = (const block_q2_kx8 *)group;
    for (int64_t b = 0; b < nb; b++)
        for (int r = 0; r < 8; r++) {
            block_q2_k x;
            memset(&x, 0, sizeof x);
            x.d = g[b].d[r];
            x.dmin = g[b].dmin[r];
            for (int grp = 0; grp < 16; grp++) x.scales[grp] = g[b].sc[8 * grp + r];
            unpack_crumbs(g[b].qs, r, x.qs);
            memcpy((uint8_t *)rows + (size_t)r * row_stride + (size_t)b * sizeof x, &x, sizeof x);
        }
}

/* Row r's super-block step: S1 = sum_g sc_g P_g, S2 = sum_g m_g bs_g (exact;
 * P_g = sum_{e in g} q_e a_e, bs_g the activation's sum over group g), then
 * step_q4_k's float steps: acc = fma(S1, d da, acc), acc = fma(S2, -(dmin da),
 * acc). */
static float step_q2_k(const block_q2_kx8 *g, const block_q8_k *a, int r, float acc) {
    int32_t s1 = 0, s2 = 0;
    for (int k = 0; k < 16; k++) {
        int32_t p = 0;
        for (int e = 16 * k; e < 16 * k + 16; e++) p += crumb(g->qs, r, e) * a->qs[e];
        const int sm = g->sc[8 * k + r];
        s1 += (sm & 0xF) * p;
        s2 += (sm >> 4) * a->bsums[k];
    }
    const float dd = kvs_f16_to_f32(g->d[r]) * a->d, dm = kvs_f16_to_f32(g->dmin[r]) * a->d;
    acc = fmaf((float)s1, dd, acc);
    return fmaf((float)s2, -dm, acc);
}

/* The reference kernels: every (group, token, row), the type's step over the
 * blocks in order from acc = 0. */
#define R8_REF_KERNEL(type, block_t, act_t, QB)                                                           \
    void quant_ref_r8_##type(int64_t n, const void *w, int n_groups, const void *act, size_t act_stride,   \
                             int n_act, float *out, size_t out_stride) {                                   \
        const int64_t nb = n / (QB);                                                                       \
        for (int gi = 0; gi < n_groups; gi++) {                                                            \
            const block_t *g = (const block_t *)w + (size_t)gi * (size_t)nb;                               \
            for (int t = 0; t < n_act; t++) {                                                              \
                const act_t *a = (const act_t *)((const uint8_t *)act + (size_t)t * act_stride);           \
                for (int r = 0; r < 8; r++) {                                                              \
                    float acc = 0.0f;                                                                      \
                    for (int64_t b = 0; b < nb; b++) acc = step_##type(&g[b], &a[b], r, acc);             \
                    out[(size_t)t * out_stride + 8 * (size_t)gi + (size_t)r] = acc;                        \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
    }

R8_REF_KERNEL(q4_0, block_q4_0x8, act_q8, QK32)
R8_REF_KERNEL(q8_0, block_q8_0x8, act_q8, QK32)
R8_REF_KERNEL(q4_1, block_q4_1x8, act_q8, QK32)
R8_REF_KERNEL(q5_0, block_q5_0x8, act_q8, QK32)
R8_REF_KERNEL(q5_1, block_q5_1x8, act_q8, QK32)
R8_REF_KERNEL(iq4_nl, block_iq4_nlx8, act_q8, QK32)
R8_REF_KERNEL(q4_k, block_q4_kx8, block_q8_k, QKK)
R8_REF_KERNEL(q5_k, block_q5_kx8, block_q8_k, QKK)
R8_REF_KERNEL(iq4_xs, block_iq4_xsx8, block_q8_k, QKK)
R8_REF_KERNEL(q6_k, block_q6_kx8, block_q8_k, QKK)
R8_REF_KERNEL(q3_k, block_q3_kx8, block_q8_k, QKK)
R8_REF_KERNEL(q2_k, block_q2_kx8, block_q8_k, QKK)
