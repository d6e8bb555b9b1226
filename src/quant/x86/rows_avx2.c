/*
 * x86/rows_avx2 — AVX2+FMA+F16C kernels (256-bit) of the plain row formats:
 * the dots, tile kernels, activation quantizers and f16 rows.
 *
 * rows_avx512.c includes this file with QUANT_VNNI defined: the same 256-bit
 * kernels then use AVX512-VNNI (vpdpbusd / vpdpwssd) for the int8 and int16
 * dot steps and export quant_avx512_* names instead of quant_avx2_* (QK_NAME).
 * Integer sums are exact either way (no step saturates), so only the float
 * parts decide rounding.
 *
 * Batch invariance (design note 4 in quant_impl.h): each *_rows function takes
 * a compile-time group size g; after inlining, row r of a group runs exactly
 * the instruction sequence of a group of one. The dot kernels walk n_act in
 * groups (QK_MULTI, LB_MULTI).
 */
#include <immintrin.h>
#include <string.h>

#include "quant_impl.h"

#define QK_INLINE static inline __attribute__((always_inline))
/* The exported kernels, by the ISA the file is compiled for (quant_impl.h declares both). */
#ifdef QUANT_VNNI
#define QK_NAME(x) quant_avx512_##x
#else
#define QK_NAME(x) quant_avx2_##x
#endif

/* Micro-tile of the tiled q4_0 kernel: weight rows x tokens. */
#ifndef QK_TILE_R
#ifdef QUANT_VNNI /* 32 registers: 16 accumulators, the fastest shape measured */
#define QK_TILE_R 4
#define QK_TILE_T 4
#else
#define QK_TILE_R 1
#define QK_TILE_T 4
#endif
#endif

/* --- helpers --------------------------------------------------------------- */

QK_INLINE float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

QK_INLINE float h2f(uint16_t h) { return _cvtsh_ss(h); }

/* Sum of u8 x s8 products, four bytes per i32 lane. No saturation here: the
 * callers keep |u| <= 128 and |s| <= 127, so maddubs never saturates either. */
QK_INLINE __m256i dot_u8s8(__m256i u, __m256i s) {
#ifdef QUANT_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* acc + pairwise i16 products of p and scale. */
QK_INLINE __m256i acc_i16(__m256i acc, __m256i p, __m256i scale) {
#ifdef QUANT_VNNI
    return _mm256_dpwssd_epi32(acc, p, scale);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, scale));
#endif
}

/* 16 bytes of nibbles -> 32 bytes: low nibbles first, then high nibbles. */
QK_INLINE __m256i nibbles32(const uint8_t *p) {
    __m128i t = _mm_loadu_si128((const __m128i *)p);
    __m256i b = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
}

/* 32 bits -> 32 bytes, byte i = 0x10 when bit i is set. */
QK_INLINE __m256i bits32_x10(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    const __m256i idx = _mm256_set_epi64x(0x0303030303030303ll, 0x0202020202020202ll,
                                          0x0101010101010101ll, 0);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)v), idx);
    b = _mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit);
    return _mm256_and_si256(b, _mm256_set1_epi8(0x10));
}

/* Walks n_act rows of activations in groups of G (then 3, 2, 1). */
#define QK_MULTI(name, G)                                                                        \
    void QK_NAME(dot_##name)(int64_t n, const void *w, const void *act, size_t stride, int n_act, \
                             float *out) {                                                       \
        const uint8_t *a = (const uint8_t *)act;                                                 \
        int j = 0;                                                                               \
        for (; n_act - j >= (G); j += (G)) avx_##name##_rows(n, w, a + (size_t)j * stride, stride, (G), out + j); \
        switch (n_act - j) {                                                                     \
        case 3: avx_##name##_rows(n, w, a + (size_t)j * stride, stride, 3, out + j); break;      \
        case 2: avx_##name##_rows(n, w, a + (size_t)j * stride, stride, 2, out + j); break;      \
        case 1: avx_##name##_rows(n, w, a + (size_t)j * stride, stride, 1, out + j); break;      \
        default: break;                                                                          \
        }                                                                                        \
    }

#define FOR_ROWS _Pragma("GCC unroll 4") for (int r = 0; r < g; r++)
#define QK_UNROLL _Pragma("GCC unroll 8")

/* --- float weights ----------------------------------------------------------- */

/* Per row: four 8-wide accumulators over 32 elements, then 8-wide steps, then a
 * scalar tail. */
#define QK_FLOAT_ROWS(name, LOAD8, LOAD1)                                                      \
    QK_INLINE void name##_rows(int64_t n, const void *w, const uint8_t *act, size_t stride,     \
                               const int g, float *out) {                                      \
        const uint8_t *x = (const uint8_t *)w;                                                 \
        const float *a[4];                                                                     \
        __m256 acc[4][4];                                                                      \
        FOR_ROWS {                                                                             \
            a[r] = (const float *)(act + (size_t)r * stride);                                  \
            for (int k = 0; k < 4; k++) acc[r][k] = _mm256_setzero_ps();                       \
        }                                                                                      \
        int64_t i = 0;                                                                         \
        for (; i + 32 <= n; i += 32) {                                                         \
            __m256 w0 = LOAD8(x, i), w1 = LOAD8(x, i + 8), w2 = LOAD8(x, i + 16), w3 = LOAD8(x, i + 24); \
            FOR_ROWS {                                                                         \
                acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(a[r] + i), acc[r][0]);         \
                acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(a[r] + i + 8), acc[r][1]);     \
                acc[r][2] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(a[r] + i + 16), acc[r][2]);    \
                acc[r][3] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(a[r] + i + 24), acc[r][3]);    \
            }                                                                                  \
        }                                                                                      \
        for (; i + 8 <= n; i += 8) {                                                           \
            __m256 w0 = LOAD8(x, i);                                                           \
            FOR_ROWS acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(a[r] + i), acc[r][0]);    \
        }                                                                                      \
        FOR_ROWS {                                                                             \
            __m256 s = _mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]),                      \
                                     _mm256_add_ps(acc[r][2], acc[r][3]));                     \
            float t = hsum_ps(s);                                                              \
            for (int64_t k = i; k < n; k++) t += LOAD1(x, k) * a[r][k];                        \
            out[r] = t;                                                                        \
        }                                                                                      \
    }

QK_INLINE __m256 ld8_f32(const uint8_t *x, int64_t i) { return _mm256_loadu_ps((const float *)x + i); }
QK_INLINE float ld1_f32(const uint8_t *x, int64_t i) { float f; memcpy(&f, x + 4 * i, 4); return f; }
QK_INLINE __m256 ld8_f16(const uint8_t *x, int64_t i) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + 2 * i)));
}
QK_INLINE float ld1_f16(const uint8_t *x, int64_t i) { uint16_t h; memcpy(&h, x + 2 * i, 2); return h2f(h); }
QK_INLINE __m256 ld8_bf16(const uint8_t *x, int64_t i) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x + 2 * i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
QK_INLINE float ld1_bf16(const uint8_t *x, int64_t i) {
    uint16_t h;
    memcpy(&h, x + 2 * i, 2);
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

QK_FLOAT_ROWS(avx_f32, ld8_f32, ld1_f32)
QK_FLOAT_ROWS(avx_f16, ld8_f16, ld1_f16)
QK_FLOAT_ROWS(avx_bf16, ld8_bf16, ld1_bf16)
QK_MULTI(f32, 2)
QK_MULTI(f16, 2)
QK_MULTI(bf16, 2)

/* --- 32-element blocks with signed quants (q5_0; q4_0 and q8_0 below) ------- */

/* Per row and pair of blocks: t = p0 * (dw0 * da0); t = fma(p1, dw1 * da1, t);
 * acc += t — one add on the loop-carried chain per two blocks. An odd last
 * block does acc = fma(p, dw * da, acc). UNPACK(blk) yields s8 quants. */
#define QK_SIGNED32_ROWS(name, block_t, UNPACK)                                                \
    QK_INLINE void name##_rows(int64_t n, const void *w, const uint8_t *act, size_t stride,     \
                               const int g, float *out) {                                      \
        const block_t *x = (const block_t *)w;                                                 \
        const int64_t nb = n / QK32;                                                           \
        const act_q8 *a[4];                                                                    \
        __m256 acc[4];                                                                         \
        FOR_ROWS {                                                                             \
            a[r] = (const act_q8 *)(act + (size_t)r * stride);                                 \
            acc[r] = _mm256_setzero_ps();                                                      \
        }                                                                                      \
        int64_t ib = 0;                                                                        \
        for (; ib + 1 < nb; ib += 2) {                                                         \
            const __m256i q0 = UNPACK(&x[ib]), q1 = UNPACK(&x[ib + 1]);                        \
            const __m256i u0 = _mm256_sign_epi8(q0, q0), u1 = _mm256_sign_epi8(q1, q1);        \
            const __m256 d0 = _mm256_set1_ps(h2f(x[ib].d)), d1 = _mm256_set1_ps(h2f(x[ib + 1].d)); \
            FOR_ROWS {                                                                         \
                const act_q8 *y = a[r] + ib;                                                   \
                __m256i s0 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)y[0].qs), q0); \
                __m256i s1 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)y[1].qs), q1); \
                __m256 p0 = _mm256_cvtepi32_ps(dot_u8s8(u0, s0));                              \
                __m256 p1 = _mm256_cvtepi32_ps(dot_u8s8(u1, s1));                              \
                __m256 t = _mm256_mul_ps(p0, _mm256_mul_ps(d0, _mm256_broadcast_ss(&y[0].d))); \
                t = _mm256_fmadd_ps(p1, _mm256_mul_ps(d1, _mm256_broadcast_ss(&y[1].d)), t);   \
                acc[r] = _mm256_add_ps(acc[r], t);                                             \
            }                                                                                  \
        }                                                                                      \
        if (ib < nb) {                                                                         \
            const __m256i q0 = UNPACK(&x[ib]);                                                 \
            const __m256i u0 = _mm256_sign_epi8(q0, q0);                                       \
            const __m256 d0 = _mm256_set1_ps(h2f(x[ib].d));                                    \
            FOR_ROWS {                                                                         \
                const act_q8 *y = a[r] + ib;                                                   \
                __m256i s0 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)y[0].qs), q0); \
                __m256 p0 = _mm256_cvtepi32_ps(dot_u8s8(u0, s0));                              \
                acc[r] = _mm256_fmadd_ps(p0, _mm256_mul_ps(d0, _mm256_broadcast_ss(&y[0].d)), acc[r]); \
            }                                                                                  \
        }                                                                                      \
        FOR_ROWS out[r] = hsum_ps(acc[r]);                                                     \
    }

QK_INLINE __m256i unpack_q5_0(const block_q5_0 *b) {
    return _mm256_sub_epi8(_mm256_or_si256(nibbles32(b->qs), bits32_x10(b->qh)), _mm256_set1_epi8(16));
}

QK_SIGNED32_ROWS(avx_q5_0, block_q5_0, unpack_q5_0)
QK_MULTI(q5_0, 4)

/* --- q4_0 ----------------------------------------------------------------------
 * Unsigned nibbles u = 0..15 go straight into the u8 x s8 dot (no sign trick):
 * sum (u - 8) q * dw * da = dw * (da * sum(u q) - 8 s), s = da * sum(q) being the
 * activation block's scaled sum. Blocks go eight per step: the eight i32x8
 * products are reduced to one vector (lane k = block k), the eight f16 scales
 * convert with one vcvtph2ps, and each (row, token) pair then costs two fmas
 * per step. A short last step pads with zero lanes (d = s = 0, product 0).
 *
 * Batch invariance: the float work of a (row, token) pair is
 *   t = fma(P, da, -8 s); acc = fma(t, dw, acc); out = hsum(acc)
 * with da, s, dw gathered the same way whatever the tile shape. */

/* 16 bytes of nibbles -> 32 bytes (low nibbles, then high), unsigned. */
QK_INLINE __m256i q4_0_u(const block_q4_0 *b) {
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)b->qs));
    v = _mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

/* Lane k of the result = sum of the lanes of p[k]. */
QK_INLINE __m256i hsum8_epi32(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
    /* p0..p3 are hadd pairs: per 128-bit half, lanes of blocks (2k, 2k+1) */
    const __m256i ab = _mm256_hadd_epi32(p0, p1), cd = _mm256_hadd_epi32(p2, p3);
    /* ab = [b0..b3 low half sums | b0..b3 high], cd likewise for b4..b7 */
    const __m256i x = _mm256_permute2x128_si256(ab, cd, 0x21);
    return _mm256_add_epi32(_mm256_blend_epi32(ab, cd, 0xF0), x);
}

/* d and -8 s of activation blocks y[0..nk) in lanes 0..nk), zero above; ns
 * NULL: d only (q8_0, whose activations carry qsum128 where s would be). */
QK_INLINE void q4_0_act_ds(const act_q8 *y, const int nk, __m256 *d, __m256 *ns) {
    __m256 d8, s8;
    if (nk == 8) {
        __m128 v[8];
        QK_UNROLL for (int k = 0; k < 8; k++) v[k] = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)&y[k]));
        const __m256 lo = _mm256_set_m128(_mm_movelh_ps(v[4], v[5]), _mm_movelh_ps(v[0], v[1]));
        const __m256 hi = _mm256_set_m128(_mm_movelh_ps(v[6], v[7]), _mm_movelh_ps(v[2], v[3]));
        d8 = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0));
        s8 = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1));
    } else {
        float dv[8] = {0}, sv[8] = {0};
        QK_UNROLL for (int k = 0; k < nk; k++) {
            dv[k] = y[k].d;
            sv[k] = y[k].s;
        }
        d8 = _mm256_loadu_ps(dv);
        s8 = _mm256_loadu_ps(sv);
    }
    *d = d8;
    if (ns) *ns = _mm256_mul_ps(s8, _mm256_set1_ps(-8.0f));
}

/* The f16 scales of blocks x[0..nk) in lanes 0..nk), zero above. */
QK_INLINE __m256 q4_0_w_d(const block_q4_0 *x, const int nk) {
#ifdef QUANT_VNNI
    /* the scales are words 9k of the group's first 128 bytes: one word permute */
    if (nk == 8) {
        const __m512i lo = _mm512_loadu_si512((const void *)x);
        const __m512i hi = _mm512_loadu_si512((const void *)((const uint8_t *)x + 64));
        const __m512i idx = _mm512_castsi128_si512(_mm_setr_epi16(0, 9, 18, 27, 36, 45, 54, 63));
        return _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutex2var_epi16(lo, idx, hi)));
    }
#endif
    if (nk == 8) { /* a chain of word inserts straight from memory */
        __m128i h = _mm_cvtsi32_si128(x[0].d);
        h = _mm_insert_epi16(h, x[1].d, 1);
        h = _mm_insert_epi16(h, x[2].d, 2);
        h = _mm_insert_epi16(h, x[3].d, 3);
        h = _mm_insert_epi16(h, x[4].d, 4);
        h = _mm_insert_epi16(h, x[5].d, 5);
        h = _mm_insert_epi16(h, x[6].d, 6);
        h = _mm_insert_epi16(h, x[7].d, 7);
        return _mm256_cvtph_ps(h);
    }
    uint16_t h[8] = {0};
    QK_UNROLL for (int k = 0; k < nk; k++) h[k] = x[k].d;
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* One step of up to eight blocks from block ib for an R x T tile. */
QK_INLINE void q4_0_step(const block_q4_0 *const *x, const int R, const act_q8 *const *a, const int T,
                         int64_t ib, const int nk, __m256 acc[4][4]) {
    __m256 da[4], ns[4], dw[4];
    QK_UNROLL for (int t = 0; t < T; t++) q4_0_act_ds(a[t] + ib, nk, &da[t], &ns[t]);
    QK_UNROLL for (int r = 0; r < R; r++) dw[r] = q4_0_w_d(x[r] + ib, nk);
    __m256i h[4][4][4];
    QK_UNROLL for (int kk = 0; kk < 4; kk++) {
        QK_UNROLL for (int r = 0; r < R; r++) {
            const int k0 = 2 * kk, k1 = 2 * kk + 1;
            const __m256i u0 = k0 < nk ? q4_0_u(x[r] + ib + k0) : _mm256_setzero_si256();
            const __m256i u1 = k1 < nk ? q4_0_u(x[r] + ib + k1) : _mm256_setzero_si256();
            QK_UNROLL for (int t = 0; t < T; t++) {
                const __m256i p0 = k0 < nk ? dot_u8s8(u0, _mm256_loadu_si256((const __m256i *)a[t][ib + k0].qs))
                                           : _mm256_setzero_si256();
                const __m256i p1 = k1 < nk ? dot_u8s8(u1, _mm256_loadu_si256((const __m256i *)a[t][ib + k1].qs))
                                           : _mm256_setzero_si256();
                h[r][t][kk] = _mm256_hadd_epi32(p0, p1);
            }
        }
    }
    QK_UNROLL for (int r = 0; r < R; r++)
        QK_UNROLL for (int t = 0; t < T; t++) {
            const __m256 p = _mm256_cvtepi32_ps(hsum8_epi32(h[r][t][0], h[r][t][1], h[r][t][2], h[r][t][3]));
            acc[r][t] = _mm256_fmadd_ps(_mm256_fmadd_ps(p, da[t], ns[t]), dw[r], acc[r][t]);
        }
}

/* out[t * ostride + r] for an R x T tile (R, T <= 4, compile-time after inlining). */
QK_INLINE void q4_0_tile(int64_t n, const uint8_t *w, size_t wstride, const int R, const uint8_t *act,
                         size_t astride, const int T, float *out, size_t ostride) {
    const int64_t nb = n / QK32;
    const block_q4_0 *x[4];
    const act_q8 *a[4];
    __m256 acc[4][4];
    QK_UNROLL for (int r = 0; r < R; r++) x[r] = (const block_q4_0 *)(w + (size_t)r * wstride);
    QK_UNROLL for (int t = 0; t < T; t++) a[t] = (const act_q8 *)(act + (size_t)t * astride);
    QK_UNROLL for (int r = 0; r < R; r++)
        QK_UNROLL for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps();
    int64_t ib = 0;
    for (; ib + 8 <= nb; ib += 8) q4_0_step(x, R, a, T, ib, 8, acc);
    if (ib < nb) q4_0_step(x, R, a, T, ib, (int)(nb - ib), acc);
    QK_UNROLL for (int r = 0; r < R; r++)
        QK_UNROLL for (int t = 0; t < T; t++) out[(size_t)t * ostride + (size_t)r] = hsum_ps(acc[r][t]);
}

QK_INLINE void avx_q4_0_rows(int64_t n, const void *w, const uint8_t *act, size_t stride, const int g,
                             float *out) {
    q4_0_tile(n, (const uint8_t *)w, 0, 1, act, stride, g, out, 1);
}
QK_MULTI(q4_0, 4)

/* Tiled q4_0 (design note 6 in quant_impl.h). A full group of eight blocks of a
 * weight row is transposed once per R x T micro-tile: chunk i, lane k = unpacked
 * bytes 4i..4i+3 of block k, matching the act_q8x8 layout, so eight u8 x s8 dots
 * summed in i32 give P with lane k = block k's exact integer sum — the same P as
 * q4_0_step — and the float steps per (row, token) are q4_0_step's. A last
 * partial group goes through q4_0_step itself. */

/* Sum of u8 x s8 products added to acc (exact, as in dot_u8s8). */
QK_INLINE __m256i dot_u8s8_acc(__m256i acc, __m256i u, __m256i s) {
#ifdef QUANT_VNNI
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, dot_u8s8(u, s));
#endif
}

#ifdef QUANT_VNNI /* the transposed q4_0 tile: plain AVX2 uses the pair-layout kernel below */
/* The eight transposed weight chunks of blocks x[0..8). */
QK_INLINE void q4_0_w_chunks(const block_q4_0 *x, __m256i c[8]) {
    __m256i b[4];
    QK_UNROLL for (int k = 0; k < 4; k++)
        b[k] = _mm256_loadu2_m128i((const __m128i *)x[k + 4].qs, (const __m128i *)x[k].qs);
    const __m256i t0 = _mm256_unpacklo_epi32(b[0], b[1]), t1 = _mm256_unpackhi_epi32(b[0], b[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(b[2], b[3]), t3 = _mm256_unpackhi_epi32(b[2], b[3]);
    const __m256i d[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                          _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    QK_UNROLL for (int i = 0; i < 4; i++) {
        c[i] = _mm256_and_si256(d[i], m4);
        c[i + 4] = _mm256_and_si256(_mm256_srli_epi16(d[i], 4), m4);
    }
}
#endif

/* Walks n_rows x n_act in micro-tiles of QK_TILE_R rows (then 1) and QK_TILE_T tokens
 * (then 1), calling RT (an inline kernel specialized on its constant R and T). */
#define QK_TILE_WALK(name, RT)                                                                    \
    void name(int64_t n, const void *w, size_t wstride, int n_rows, const void *act, size_t astride, \
                     int n_act, float *out, size_t ostride) {                                     \
        const uint8_t *wb = (const uint8_t *)w, *ab = (const uint8_t *)act;                       \
        for (int r = 0; r < n_rows;) {                                                            \
            const int R = n_rows - r >= QK_TILE_R ? QK_TILE_R : 1;                                \
            const uint8_t *wr = wb + (size_t)r * wstride;                                         \
            int t = 0;                                                                            \
            for (; n_act - t >= QK_TILE_T; t += QK_TILE_T) {                                      \
                float *o = out + (size_t)t * ostride + (size_t)r;                                 \
                if (R == QK_TILE_R) RT(n, wr, wstride, QK_TILE_R, ab + (size_t)t * astride, astride, QK_TILE_T, o, ostride); \
                else RT(n, wr, wstride, 1, ab + (size_t)t * astride, astride, QK_TILE_T, o, ostride); \
            }                                                                                     \
            for (; t < n_act; t++) {                                                              \
                float *o = out + (size_t)t * ostride + (size_t)r;                                 \
                if (R == QK_TILE_R) RT(n, wr, wstride, QK_TILE_R, ab + (size_t)t * astride, astride, 1, o, ostride); \
                else RT(n, wr, wstride, 1, ab + (size_t)t * astride, astride, 1, o, ostride);     \
            }                                                                                     \
            r += R;                                                                               \
        }                                                                                         \
    }

/* The start of a q4_0 / q8_0 micro-tile: nb blocks per row, x[r] = weight row r,
 * a[t] = activation row t, acc[r][t] = 0. Uses the tile's n, w, wstride, act,
 * astride, R and T. */
#define QK_TILE_START(block_t)                                                                    \
    const int64_t nb = n / QK32;                                                                  \
    const block_t *x[QK_TILE_R];                                                                  \
    const act_q8 *a[QK_TILE_T];                                                                   \
    __m256 acc[QK_TILE_R][QK_TILE_T];                                                             \
    QK_UNROLL for (int r = 0; r < R; r++) x[r] = (const block_t *)(w + (size_t)r * wstride);      \
    QK_UNROLL for (int t = 0; t < T; t++) a[t] = (const act_q8 *)(act + (size_t)t * astride);     \
    QK_UNROLL for (int r = 0; r < R; r++)                                                         \
        QK_UNROLL for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps()

/* The end of a q4_0 / q8_0 micro-tile: blocks past the last group of 8 go one (row, token) at a
 * time through the multi kernel's STEP (so the float sequence stays the multi kernel's), then
 * each accumulator is reduced into out[t * ostride + r]. Uses the tile's x, a, acc, R, T, ib, nb. */
#define QK_TILE_FINISH(STEP)                                                                      \
    do {                                                                                          \
        if (ib < nb)                                                                              \
            QK_UNROLL for (int r = 0; r < R; r++)                                                 \
                QK_UNROLL for (int t = 0; t < T; t++) {                                           \
                    __m256 one[4][4];                                                             \
                    one[0][0] = acc[r][t];                                                        \
                    STEP(&x[r], 1, &a[t], 1, ib, (int)(nb - ib), one);                            \
                    acc[r][t] = one[0][0];                                                        \
                }                                                                                 \
        QK_UNROLL for (int r = 0; r < R; r++)                                                     \
            QK_UNROLL for (int t = 0; t < T; t++) out[(size_t)t * ostride + (size_t)r] = hsum_ps(acc[r][t]); \
    } while (0)

#ifdef QUANT_VNNI
/* out[t * ostride + r] for an R x T micro-tile, R and T compile-time. */
QK_INLINE void q4_0_tile_rt(int64_t n, const uint8_t *w, size_t wstride, const int R, const uint8_t *act,
                            size_t astride, const int T, float *out, size_t ostride) {
    QK_TILE_START(block_q4_0);
    int64_t ib = 0;
    for (; ib + 8 <= nb; ib += 8) {
        QK_UNROLL for (int r = 0; r < R; r++) {
            __m256i c[8];
            q4_0_w_chunks(x[r] + ib, c);
            const __m256 dw = q4_0_w_d(x[r] + ib, 8);
            QK_UNROLL for (int t = 0; t < T; t++) {
                const act_q8x8 *y = (const act_q8x8 *)(a[t] + ib);
                __m256i s = dot_u8s8(c[0], _mm256_loadu_si256((const __m256i *)y->qs[0]));
                QK_UNROLL for (int i = 1; i < 8; i++)
                    s = dot_u8s8_acc(s, c[i], _mm256_loadu_si256((const __m256i *)y->qs[i]));
                const __m256 p = _mm256_cvtepi32_ps(s);
                const __m256 tt = _mm256_fmadd_ps(p, _mm256_loadu_ps(y->d), _mm256_loadu_ps(y->ns));
                acc[r][t] = _mm256_fmadd_ps(tt, dw, acc[r][t]);
            }
        }
    }
    QK_TILE_FINISH(q4_0_step);
}

/* Rows in micro-tiles of QK_TILE_R (then 1), tokens of QK_TILE_T (then fewer). */
QK_TILE_WALK(QK_NAME(tile_q4_0), q4_0_tile_rt)
#endif

#ifndef QUANT_VNNI
/* Tiled q4_0 under plain AVX2, pair layout. Without vpdpbusd the transpose
 * above costs as much as it saves, so the AVX2 table reorders the activations
 * differently (quant_kernels.layout) and leaves the weights as they are: a
 * full group of eight act_q8 blocks becomes one act_q8x8 with d and -8 s as
 * in design note 6 and
 *   qs[2m]     = block m elems  0..15 | block m+4 elems  0..15
 *   qs[2m + 1] = block m elems 16..31 | block m+4 elems 16..31   (m = 0..3),
 * so that one 32-byte load of blocks m and m+4 of a weight row gives their low
 * and high nibbles in exactly that order. Per pair the two u8 x s8 products
 * add in i16 (|sum| <= 4 x 15 x 127, no saturation) and one madd makes i32
 * lanes 0..3 = block m, 4..7 = block m+4; three hadds then put block k's exact
 * sum in lane k: the same P as q4_0_step, followed by q4_0_step's float steps,
 * so this is bit-identical to the q4_0 dot kernel. It pays from one token on, so
 * decode takes it too (quant_tile_min_tokens). */
void QK_NAME(layout_q4_0_pair)(void *act, int64_t n) {
    act_q8 *y = (act_q8 *)act;
    for (int64_t g = 0; g + 8 <= n / QK32; g += 8) {
        act_q8 b[8];
        memcpy(b, y + g, sizeof b);
        act_q8x8 t;
        for (int k = 0; k < 8; k++) {
            t.d[k] = b[k].d;
            t.ns[k] = b[k].s * -8.0f;
        }
        for (int m = 0; m < 4; m++) {
            memcpy(&t.qs[2 * m][0], &b[m].qs[0], 16);
            memcpy(&t.qs[2 * m][16], &b[m + 4].qs[0], 16);
            memcpy(&t.qs[2 * m + 1][0], &b[m].qs[16], 16);
            memcpy(&t.qs[2 * m + 1][16], &b[m + 4].qs[16], 16);
        }
        memcpy(y + g, &t, sizeof t);
    }
}

/* i32 lanes 0..3 / 4..7: partial sums of the pair's two blocks. */
QK_INLINE __m256i q4_0_pair_dot(__m256i lo, __m256i hi, const int8_t *qa, const int8_t *qb) {
    const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)qa)),
                                       _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)qb)));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
}

/* R x T micro-tile: QK_TILE_R x QK_TILE_T (AVX2: 1 x 4), as for the kernel above. */
QK_INLINE void q4_0_p8_rt(int64_t n, const uint8_t *w, size_t wstride, const int R, const uint8_t *act,
                          size_t astride, const int T, float *out, size_t ostride) {
    QK_TILE_START(block_q4_0);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    int64_t ib = 0;
    for (; ib + 8 <= nb; ib += 8) {
        QK_UNROLL for (int r = 0; r < R; r++) {
            const block_q4_0 *xb = x[r] + ib;
            __m256i h[QK_TILE_T][2];
            QK_UNROLL for (int hh = 0; hh < 2; hh++) {
                __m256i v[QK_TILE_T][2];
                QK_UNROLL for (int mm = 0; mm < 2; mm++) {
                    const int m = 2 * hh + mm;
                    const __m256i b = _mm256_loadu2_m128i((const __m128i *)xb[m + 4].qs, (const __m128i *)xb[m].qs);
                    const __m256i lo = _mm256_and_si256(b, m4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
                    QK_UNROLL for (int t = 0; t < T; t++) {
                        const act_q8x8 *y = (const act_q8x8 *)(a[t] + ib);
                        v[t][mm] = q4_0_pair_dot(lo, hi, y->qs[2 * m], y->qs[2 * m + 1]);
                    }
                }
                QK_UNROLL for (int t = 0; t < T; t++) h[t][hh] = _mm256_hadd_epi32(v[t][0], v[t][1]);
            }
            const __m256 dw = q4_0_w_d(xb, 8);
            QK_UNROLL for (int t = 0; t < T; t++) {
                const act_q8x8 *y = (const act_q8x8 *)(a[t] + ib);
                const __m256 p = _mm256_cvtepi32_ps(_mm256_hadd_epi32(h[t][0], h[t][1]));
                const __m256 tt = _mm256_fmadd_ps(p, _mm256_loadu_ps(y->d), _mm256_loadu_ps(y->ns));
                acc[r][t] = _mm256_fmadd_ps(tt, dw, acc[r][t]);
            }
        }
    }
    QK_TILE_FINISH(q4_0_step);
}

QK_TILE_WALK(QK_NAME(tile_q4_0_p8), q4_0_p8_rt)
#endif


/* --- q8_0 ------------------------------------------------------------------------
 * The q4_0 scheme with the sign trick: |q| x sign(a, q) (both within +-127, so
 * maddubs never saturates) gives block k's exact sum(q a) in lane k of P after
 * hsum8_epi32. Per (row, token) and step of up to eight blocks:
 *   acc = fma(P * da, dw, acc); out = hsum(acc)
 * and the tile kernel (transposed groups as in q4_0, same P) runs the same
 * float steps, so dot, multi and tile agree bit for bit. */

/* The f16 scales of blocks x[0..nk) in lanes 0..nk), zero above. */
QK_INLINE __m256 q8_0_w_d(const block_q8_0 *x, const int nk) {
    uint16_t h[8] = {0};
    QK_UNROLL for (int k = 0; k < nk; k++) h[k] = x[k].d;
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* One step of up to eight blocks from block ib for an R x T tile, plain activation rows. */
QK_INLINE void q8_0_step(const block_q8_0 *const *x, const int R, const act_q8 *const *a, const int T,
                         int64_t ib, const int nk, __m256 acc[4][4]) {
    __m256 da[4], dw[4];
    QK_UNROLL for (int t = 0; t < T; t++) q4_0_act_ds(a[t] + ib, nk, &da[t], NULL);
    QK_UNROLL for (int r = 0; r < R; r++) dw[r] = q8_0_w_d(x[r] + ib, nk);
    __m256i h[4][4][4];
    QK_UNROLL for (int kk = 0; kk < 4; kk++) {
        QK_UNROLL for (int r = 0; r < R; r++) {
            const int k0 = 2 * kk, k1 = 2 * kk + 1;
            const __m256i q0 = k0 < nk ? _mm256_loadu_si256((const __m256i *)x[r][ib + k0].qs) : _mm256_setzero_si256();
            const __m256i q1 = k1 < nk ? _mm256_loadu_si256((const __m256i *)x[r][ib + k1].qs) : _mm256_setzero_si256();
            const __m256i u0 = _mm256_sign_epi8(q0, q0), u1 = _mm256_sign_epi8(q1, q1);
            QK_UNROLL for (int t = 0; t < T; t++) {
                const __m256i p0 = k0 < nk ? dot_u8s8(u0, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)a[t][ib + k0].qs), q0))
                                           : _mm256_setzero_si256();
                const __m256i p1 = k1 < nk ? dot_u8s8(u1, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)a[t][ib + k1].qs), q1))
                                           : _mm256_setzero_si256();
                h[r][t][kk] = _mm256_hadd_epi32(p0, p1);
            }
        }
    }
    QK_UNROLL for (int r = 0; r < R; r++)
        QK_UNROLL for (int t = 0; t < T; t++) {
            const __m256 p = _mm256_cvtepi32_ps(hsum8_epi32(h[r][t][0], h[r][t][1], h[r][t][2], h[r][t][3]));
            acc[r][t] = _mm256_fmadd_ps(_mm256_mul_ps(p, da[t]), dw[r], acc[r][t]);
        }
}

QK_INLINE void avx_q8_0_rows(int64_t n, const void *w, const uint8_t *act, size_t stride, const int g,
                             float *out) {
    const int64_t nb = n / QK32;
    const block_q8_0 *x[1] = {(const block_q8_0 *)w};
    const act_q8 *a[4];
    __m256 acc[4][4];
    FOR_ROWS {
        a[r] = (const act_q8 *)(act + (size_t)r * stride);
        acc[0][r] = _mm256_setzero_ps();
    }
    int64_t ib = 0;
    for (; ib + 8 <= nb; ib += 8) q8_0_step(x, 1, a, g, ib, 8, acc);
    if (ib < nb) q8_0_step(x, 1, a, g, ib, (int)(nb - ib), acc);
    FOR_ROWS out[r] = hsum_ps(acc[0][r]);
}
QK_MULTI(q8_0, 4)

/* Chunk i, lane k = bytes 4i..4i+3 of block x[k] (an 8 x 8 transpose of i32). */
QK_INLINE void q8_0_w_chunks(const block_q8_0 *x, __m256i c[8]) {
    __m256i b[8], t[8], u[8];
    QK_UNROLL for (int k = 0; k < 8; k++) b[k] = _mm256_loadu_si256((const __m256i *)x[k].qs);
    QK_UNROLL for (int k = 0; k < 8; k += 2) {
        t[k] = _mm256_unpacklo_epi32(b[k], b[k + 1]);
        t[k + 1] = _mm256_unpackhi_epi32(b[k], b[k + 1]);
    }
    /* t[2m] = [b2m0 b2m+1,0 b2m1 b2m+1,1 | lanes 4,5], t[2m+1] = lanes 2,3 | 6,7 */
    QK_UNROLL for (int k = 0; k < 8; k += 4) {
        u[k] = _mm256_unpacklo_epi64(t[k], t[k + 2]);     /* lane 0 | 4 of blocks k..k+3 */
        u[k + 1] = _mm256_unpackhi_epi64(t[k], t[k + 2]); /* lane 1 | 5 */
        u[k + 2] = _mm256_unpacklo_epi64(t[k + 1], t[k + 3]); /* lane 2 | 6 */
        u[k + 3] = _mm256_unpackhi_epi64(t[k + 1], t[k + 3]); /* lane 3 | 7 */
    }
    QK_UNROLL for (int i = 0; i < 4; i++) {
        c[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        c[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}

QK_INLINE void q8_0_tile_rt(int64_t n, const uint8_t *w, size_t wstride, const int R, const uint8_t *act,
                            size_t astride, const int T, float *out, size_t ostride) {
    QK_TILE_START(block_q8_0);
    int64_t ib = 0;
    for (; ib + 8 <= nb; ib += 8) {
        QK_UNROLL for (int r = 0; r < R; r++) {
            __m256i c[8], u[8];
            q8_0_w_chunks(x[r] + ib, c);
            QK_UNROLL for (int i = 0; i < 8; i++) u[i] = _mm256_sign_epi8(c[i], c[i]);
            const __m256 dw = q8_0_w_d(x[r] + ib, 8);
            QK_UNROLL for (int t = 0; t < T; t++) {
                const act_q8x8 *y = (const act_q8x8 *)(a[t] + ib);
                __m256i s = dot_u8s8(u[0], _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)y->qs[0]), c[0]));
                QK_UNROLL for (int i = 1; i < 8; i++)
                    s = dot_u8s8_acc(s, u[i], _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)y->qs[i]), c[i]));
                const __m256 p = _mm256_cvtepi32_ps(s);
                acc[r][t] = _mm256_fmadd_ps(_mm256_mul_ps(p, _mm256_loadu_ps(y->d)), dw, acc[r][t]);
            }
        }
    }
    QK_TILE_FINISH(q8_0_step);
}

QK_TILE_WALK(QK_NAME(tile_q8_0), q8_0_tile_rt)

/* --- 32-element blocks with unsigned quants and a min (q4_1, q5_1) --------- */

#define QK_MIN32_ROWS(name, block_t, UNPACK)                                                   \
    QK_INLINE void name##_rows(int64_t n, const void *w, const uint8_t *act, size_t stride,     \
                               const int g, float *out) {                                      \
        const block_t *x = (const block_t *)w;                                                 \
        const int64_t nb = n / QK32;                                                           \
        const act_q8 *a[4];                                                                    \
        __m256 acc[4];                                                                         \
        float summ[4];                                                                         \
        FOR_ROWS {                                                                             \
            a[r] = (const act_q8 *)(act + (size_t)r * stride);                                 \
            acc[r] = _mm256_setzero_ps();                                                      \
            summ[r] = 0.0f;                                                                    \
        }                                                                                      \
        for (int64_t ib = 0; ib < nb; ib++) {                                                  \
            const __m256i q = UNPACK(&x[ib]);                                                  \
            const __m256 d = _mm256_set1_ps(h2f(x[ib].d));                                     \
            const float m = h2f(x[ib].m);                                                      \
            FOR_ROWS {                                                                         \
                const act_q8 *y = a[r] + ib;                                                   \
                __m256 p = _mm256_cvtepi32_ps(dot_u8s8(q, _mm256_loadu_si256((const __m256i *)y->qs))); \
                acc[r] = _mm256_fmadd_ps(p, _mm256_mul_ps(d, _mm256_broadcast_ss(&y->d)), acc[r]); \
                summ[r] += m * y->s;                                                           \
            }                                                                                  \
        }                                                                                      \
        FOR_ROWS out[r] = hsum_ps(acc[r]) + summ[r];                                           \
    }

QK_INLINE __m256i unpack_q4_1(const block_q4_1 *b) { return nibbles32(b->qs); }
QK_INLINE __m256i unpack_q5_1(const block_q5_1 *b) {
    return _mm256_or_si256(nibbles32(b->qs), bits32_x10(b->qh));
}

QK_MIN32_ROWS(avx_q4_1, block_q4_1, unpack_q4_1)
QK_MIN32_ROWS(avx_q5_1, block_q5_1, unpack_q5_1)
QK_MULTI(q4_1, 4)
QK_MULTI(q5_1, 4)

/* --- K-quants with Q8_K activations ------------------------------------------ */

/* Lane k: min k of a q4_k / q5_k block as i32, from the decoded scale bytes
 * (bytes 8..15 = the mins, see quant_scale_min_k4). */
QK_INLINE __m256i k4_mins32(__m128i sm) { return _mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)); }

/* Lane k: min k times the activation's sum over sub-block k (its 32-element
 * sums, q8_k_sums32), exact. */
QK_INLINE __m256i k4_min_sums(const block_q8_k *y, __m256i mins32) {
    return _mm256_mullo_epi32(_mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)y->bsums)), mins32);
}

/* q4_k and q5_k share everything but the high bit. Per row and block:
 * acc += (d * da) * sumi; accm += (dmin * da) * (mins . bsums). */
QK_INLINE void k4_rows(int64_t n, const void *w, const uint8_t *act, size_t stride, const int g,
                       float *out, const bool five) {
    const size_t bsz = five ? sizeof(block_q5_k) : sizeof(block_q4_k);
    const int64_t nb = n / QKK;
    const block_q8_k *a[4];
    __m256 acc[4], accm[4];
    FOR_ROWS {
        a[r] = (const block_q8_k *)(act + (size_t)r * stride);
        acc[r] = _mm256_setzero_ps();
        accm[r] = _mm256_setzero_ps();
    }
    for (int64_t ib = 0; ib < nb; ib++) {
        const uint8_t *blk = (const uint8_t *)w + (size_t)ib * bsz;
        uint16_t d16, dmin16;
        memcpy(&d16, blk, 2);
        memcpy(&dmin16, blk + 2, 2);
        const float d = h2f(d16), dmin = h2f(dmin16);
        const uint8_t *scales = blk + 4;
        const uint8_t *qh = five ? blk + 16 : NULL;
        const uint8_t *qs = five ? blk + 48 : blk + 16;
        /* bytes 0..7 = the 6-bit scales, 8..15 = the mins (see quant_scale_min_k4) */
        uint32_t u0, u1, u2;
        memcpy(&u0, scales, 4);
        memcpy(&u1, scales + 4, 4);
        memcpy(&u2, scales + 8, 4);
        const __m128i sm = _mm_set_epi32(
            (int)(((u2 >> 4) & 0x0F0F0F0Fu) | ((u1 >> 6) & 0x03030303u) << 4), (int)(u1 & 0x3F3F3F3Fu),
            (int)((u2 & 0x0F0F0F0Fu) | ((u0 >> 6) & 0x03030303u) << 4), (int)(u0 & 0x3F3F3F3Fu));
        const __m256i sm2 = _mm256_broadcastsi128_si256(sm);
        const __m256i mins = k4_mins32(sm);
        __m256i sumi[4];
        FOR_ROWS {
            __m256i bs = k4_min_sums(&a[r][ib], mins);
            accm[r] = _mm256_fmadd_ps(_mm256_set1_ps(dmin * a[r][ib].d), _mm256_cvtepi32_ps(bs), accm[r]);
            sumi[r] = _mm256_setzero_si256();
        }
        const __m256i hb = five ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
        QK_UNROLL for (int c = 0; c < 4; c++) { /* unrolled: the shuffle indices fold to constants */
            const __m256i q4 = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            const __m256i m4 = _mm256_set1_epi8(0x0F);
            __m256i lo = _mm256_and_si256(q4, m4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4);
            if (five) {
                const __m256i one = _mm256_set1_epi8(1);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(
                                             _mm256_and_si256(_mm256_srli_epi16(hb, 2 * c), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(
                                             _mm256_and_si256(_mm256_srli_epi16(hb, 2 * c + 1), one), 4));
            }
            /* i16 lanes = scale 2c (resp. 2c+1): index byte picks it, 0x80 zeroes the high byte */
            const __m256i sl = _mm256_shuffle_epi8(sm2, _mm256_set1_epi16((short)(0x8000 | (2 * c))));
            const __m256i sh = _mm256_shuffle_epi8(sm2, _mm256_set1_epi16((short)(0x8000 | (2 * c + 1))));
            FOR_ROWS {
                const int8_t *y = a[r][ib].qs + 64 * c;
                __m256i pl = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)y));
                __m256i ph = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(y + 32)));
                sumi[r] = acc_i16(acc_i16(sumi[r], pl, sl), ph, sh);
            }
        }
        FOR_ROWS acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[r][ib].d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
    }
    FOR_ROWS out[r] = hsum_ps(acc[r]) - hsum_ps(accm[r]);
}

QK_INLINE void avx_q4_k_rows(int64_t n, const void *w, const uint8_t *act, size_t stride, const int g,
                             float *out) {
    k4_rows(n, w, act, stride, g, out, false);
}
QK_INLINE void avx_q5_k_rows(int64_t n, const void *w, const uint8_t *act, size_t stride, const int g,
                             float *out) {
    k4_rows(n, w, act, stride, g, out, true);
}

/* q6_k: sumi = sum_j sc_j * (q . y)_j - 32 * (scales . bsums); acc += (d * da) * sumi. */
QK_INLINE void avx_q6_k_rows(int64_t n, const void *w, const uint8_t *act, size_t stride, const int g,
                             float *out) {
    const block_q6_k *x = (const block_q6_k *)w;
    const int64_t nb = n / QKK;
    const block_q8_k *a[4];
    __m256 acc[4];
    FOR_ROWS {
        a[r] = (const block_q8_k *)(act + (size_t)r * stride);
        acc[r] = _mm256_setzero_ps();
    }
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    for (int64_t ib = 0; ib < nb; ib++) {
        const block_q6_k *b = &x[ib];
        const float d = h2f(b->d);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b->scales));
        __m256i sumi[4];
        FOR_ROWS {
            __m256i bs = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)a[r][ib].bsums), sc16);
            sumi[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(bs, 5));
        }
        QK_UNROLL for (int h = 0; h < 2; h++) { /* unrolled: shifts, selects and scale indices fold */
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * h));
            QK_UNROLL for (int k = 0; k < 4; k++) {
                __m256i l = k & 1 ? l1 : l0;
                __m256i q = k < 2 ? _mm256_and_si256(l, m4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
                q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * k), m2), 4));
                const int s = 8 * h + 2 * k;
                const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(b->scales[s + 1]), _mm_set1_epi16(b->scales[s]));
                FOR_ROWS {
                    const int8_t *y = a[r][ib].qs + 128 * h + 32 * k;
                    __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)y));
                    sumi[r] = acc_i16(sumi[r], p, scv);
                }
            }
        }
        FOR_ROWS acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[r][ib].d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
    }
    FOR_ROWS out[r] = hsum_ps(acc[r]);
}

/* Tiled q4_k (design note 6): R weight rows x T tokens per step, each row's
 * block unpacked once per step and each token's quants loaded once for the R
 * rows. Lane j of sumi gets the same exact i32 as in k4_rows, and the float
 * steps per (row, token) are k4_rows' (acc, accm, then hsum(acc) - hsum(accm)),
 * so the result is bit-identical. The activations keep the block_q8_k layout. */
#ifndef QK_KTILE_R /* one row by eight tokens: the fastest shape measured, VNNI or not */
#define QK_KTILE_R 1
#define QK_KTILE_T 8
#endif

QK_INLINE void q4_k_tile_rt(int64_t n, const uint8_t *w, size_t wstride, const int R, const uint8_t *act,
                            size_t astride, const int T, float *out, size_t ostride) {
    const int64_t nb = n / QKK;
    const block_q8_k *a[QK_KTILE_T];
    __m256 acc[QK_KTILE_R][QK_KTILE_T], accm[QK_KTILE_R][QK_KTILE_T];
    QK_UNROLL for (int t = 0; t < T; t++) a[t] = (const block_q8_k *)(act + (size_t)t * astride);
    QK_UNROLL for (int r = 0; r < R; r++)
        QK_UNROLL for (int t = 0; t < T; t++) acc[r][t] = accm[r][t] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t ib = 0; ib < nb; ib++) {
        const block_q4_k *x[QK_KTILE_R];
        float d[QK_KTILE_R];
        __m256i sm2[QK_KTILE_R], sumi[QK_KTILE_R][QK_KTILE_T];
        QK_UNROLL for (int r = 0; r < R; r++) {
            x[r] = (const block_q4_k *)(w + (size_t)r * wstride) + ib;
            d[r] = h2f(x[r]->d);
            const float dmin = h2f(x[r]->dmin);
            uint32_t u0, u1, u2;
            memcpy(&u0, x[r]->scales, 4);
            memcpy(&u1, x[r]->scales + 4, 4);
            memcpy(&u2, x[r]->scales + 8, 4);
            const __m128i sm = _mm_set_epi32(
                (int)(((u2 >> 4) & 0x0F0F0F0Fu) | ((u1 >> 6) & 0x03030303u) << 4), (int)(u1 & 0x3F3F3F3Fu),
                (int)((u2 & 0x0F0F0F0Fu) | ((u0 >> 6) & 0x03030303u) << 4), (int)(u0 & 0x3F3F3F3Fu));
            sm2[r] = _mm256_broadcastsi128_si256(sm);
            const __m256i mins = k4_mins32(sm);
            QK_UNROLL for (int t = 0; t < T; t++) {
                __m256i bs = k4_min_sums(&a[t][ib], mins);
                accm[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(dmin * a[t][ib].d), _mm256_cvtepi32_ps(bs), accm[r][t]);
                sumi[r][t] = _mm256_setzero_si256();
            }
        }
        QK_UNROLL for (int c = 0; c < 4; c++) {
            __m256i lo[QK_KTILE_R], hi[QK_KTILE_R], sl[QK_KTILE_R], sh[QK_KTILE_R];
            QK_UNROLL for (int r = 0; r < R; r++) {
                const __m256i q4 = _mm256_loadu_si256((const __m256i *)(x[r]->qs + 32 * c));
                lo[r] = _mm256_and_si256(q4, m4);
                hi[r] = _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4);
                sl[r] = _mm256_shuffle_epi8(sm2[r], _mm256_set1_epi16((short)(0x8000 | (2 * c))));
                sh[r] = _mm256_shuffle_epi8(sm2[r], _mm256_set1_epi16((short)(0x8000 | (2 * c + 1))));
            }
            QK_UNROLL for (int t = 0; t < T; t++) {
                const int8_t *y = a[t][ib].qs + 64 * c;
                const __m256i yl = _mm256_loadu_si256((const __m256i *)y);
                const __m256i yh = _mm256_loadu_si256((const __m256i *)(y + 32));
                QK_UNROLL for (int r = 0; r < R; r++)
                    sumi[r][t] = acc_i16(acc_i16(sumi[r][t], _mm256_maddubs_epi16(lo[r], yl), sl[r]),
                                         _mm256_maddubs_epi16(hi[r], yh), sh[r]);
            }
        }
        QK_UNROLL for (int r = 0; r < R; r++)
            QK_UNROLL for (int t = 0; t < T; t++)
                acc[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(d[r] * a[t][ib].d), _mm256_cvtepi32_ps(sumi[r][t]), acc[r][t]);
    }
    QK_UNROLL for (int r = 0; r < R; r++)
        QK_UNROLL for (int t = 0; t < T; t++)
            out[(size_t)t * ostride + (size_t)r] = hsum_ps(acc[r][t]) - hsum_ps(accm[r][t]);
}

/* One row group (R = QK_KTILE_R or 1) over all tokens: T = QK_KTILE_T, then one at a time. */
#define QK_KTILE_ROWS(R)                                                                              \
    do {                                                                                              \
        int t = 0;                                                                                    \
        for (; n_act - t >= QK_KTILE_T; t += QK_KTILE_T)                                              \
            q4_k_tile_rt(n, wr, wstride, (R), ab + (size_t)t * astride, astride, QK_KTILE_T,          \
                         out + (size_t)t * ostride + (size_t)r, ostride);                             \
        for (; t < n_act; t++)                                                                        \
            q4_k_tile_rt(n, wr, wstride, (R), ab + (size_t)t * astride, astride, 1,                   \
                         out + (size_t)t * ostride + (size_t)r, ostride);                             \
    } while (0)

void QK_NAME(tile_q4_k)(int64_t n, const void *w, size_t wstride, int n_rows, const void *act,
                          size_t astride, int n_act, float *out, size_t ostride) {
    const uint8_t *wb = (const uint8_t *)w, *ab = (const uint8_t *)act;
    int r = 0;
    for (; n_rows - r >= QK_KTILE_R; r += QK_KTILE_R) {
        const uint8_t *wr = wb + (size_t)r * wstride;
        QK_KTILE_ROWS(QK_KTILE_R);
    }
    for (; r < n_rows; r++) {
        const uint8_t *wr = wb + (size_t)r * wstride;
        QK_KTILE_ROWS(1);
    }
}

#ifdef QUANT_VNNI
QK_MULTI(q4_k, 4)
QK_MULTI(q5_k, 4)
QK_MULTI(q6_k, 4)
#else
QK_MULTI(q4_k, 2)
QK_MULTI(q5_k, 2)
QK_MULTI(q6_k, 2)
#endif

/* --- q2_k, q3_k, iq4_nl, iq4_xs (design note 4: *_rows by a group size g) ---- */

/* Activation rows per group. Under AVX2 (16 registers) 4 spills a little yet
 * runs faster than 2. */
#define LB_GROUP_K 4  /* q2_k, q3_k, iq4_xs */
#define LB_GROUP_32 4 /* iq4_nl */

#define LB_MAX_G 8 /* largest group: the tile walk's */
#undef FOR_ROWS /* these kernels run groups of up to LB_MAX_G rows */
#define FOR_ROWS _Pragma("GCC unroll 8") for (int r = 0; r < g; r++)
#define LB_UNROLL _Pragma("GCC unroll 8") /* constant shift counts and shuffle controls */

/* The iq4 table in both 128-bit halves, for vpshufb lookups. */
QK_INLINE __m256i iq4_table(void) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)quant_iq4_values));
}

/* i16 lanes: scale byte 2c of sc2 in the low half, byte 2c + 1 in the high half,
 * zero-extended (sc2 holds 16 u8 scales in each half). */
QK_INLINE __m256i scale_pair_u8(__m256i sc2, const int c) {
    return _mm256_shuffle_epi8(sc2, _mm256_set_m128i(_mm_set1_epi16((short)(0x8000 | (2 * c + 1))),
                                                     _mm_set1_epi16((short)(0x8000 | (2 * c)))));
}

/* As scale_pair_u8 for signed i8 scales: the byte goes into both halves of the
 * i16 lane, and an arithmetic shift sign-extends it. */
QK_INLINE __m256i scale_pair_s8(__m256i sc2, const int c) {
    const short lo = (short)(2 * c * 0x101), hi = (short)((2 * c + 1) * 0x101);
    return _mm256_srai_epi16(_mm256_shuffle_epi8(sc2, _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo))), 8);
}

/* Walks n_act rows of activations in groups of G (then 3, 2, 1). */
#define LB_MULTI(type, G)                                                                                  \
    void QK_NAME(dot_##type)(int64_t n, const void *w, const void *act, size_t stride, int n_act, float *out) { \
        const uint8_t *a = (const uint8_t *)act;                                                           \
        int j = 0;                                                                                         \
        for (; n_act - j >= (G); j += (G)) type##_rows(n, w, a + (size_t)j * stride, stride, (G), out + j); \
        switch (n_act - j) {                                                                               \
        case 3: type##_rows(n, w, a + (size_t)j * stride, stride, 3, out + j); break;                      \
        case 2: type##_rows(n, w, a + (size_t)j * stride, stride, 2, out + j); break;                      \
        case 1: type##_rows(n, w, a + (size_t)j * stride, stride, 1, out + j); break;                      \
        default: break;                                                                                    \
        }                                                                                                  \
    }

/* --- q2_k --------------------------------------------------------------------
 * sumi = sum_g sc_g * (q . y)_g per block, the mins separately as
 * m . bsums; acc += (d * da) * sumi, accm += (dmin * da) * (m . bsums);
 * out = hsum(acc) - hsum(accm). Quants c = 4h + j (32 elems, groups 2c and
 * 2c + 1) are bits 2j.. of qs[32h..32h+31]: one shift and mask per 32 elems. */
QK_INLINE void q2_k_rows(int64_t n, const void *w, const uint8_t *act, size_t stride, const int g, float *out) {
    const block_q2_k *x = (const block_q2_k *)w;
    const int64_t nb = n / QKK;
    const block_q8_k *a[LB_MAX_G];
    __m256 acc[LB_MAX_G], accm[LB_MAX_G];
    FOR_ROWS {
        a[r] = (const block_q8_k *)(const void *)(act + (size_t)r * stride);
        acc[r] = accm[r] = _mm256_setzero_ps();
    }
    const __m256i m3 = _mm256_set1_epi8(3);
    for (int64_t ib = 0; ib < nb; ib++) {
        const block_q2_k *b = &x[ib];
        const float d = h2f(b->d), dmin = h2f(b->dmin);
        const __m128i sm = _mm_loadu_si128((const __m128i *)b->scales);
        const __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sm, 4), _mm_set1_epi8(0x0F)));
        const __m256i sc2 = _mm256_broadcastsi128_si256(_mm_and_si128(sm, _mm_set1_epi8(0x0F)));
        __m256i sumi[LB_MAX_G];
        FOR_ROWS {
            const __m256i bs = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)a[r][ib].bsums), mins);
            accm[r] = _mm256_fmadd_ps(_mm256_set1_ps(dmin * a[r][ib].d), _mm256_cvtepi32_ps(bs), accm[r]);
            sumi[r] = _mm256_setzero_si256();
        }
        LB_UNROLL for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * h));
            LB_UNROLL for (int j = 0; j < 4; j++) {
                const __m256i u = _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), m3);
                const __m256i s = scale_pair_u8(sc2, 4 * h + j);
                FOR_ROWS {
                    const int8_t *y = a[r][ib].qs + 128 * h + 32 * j;
                    sumi[r] = acc_i16(sumi[r], _mm256_maddubs_epi16(u, _mm256_loadu_si256((const __m256i *)y)), s);
                }
            }
        }
        FOR_ROWS acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[r][ib].d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
    }
    FOR_ROWS out[r] = hsum_ps(acc[r]) - hsum_ps(accm[r]);
}

/* --- q3_k --------------------------------------------------------------------
 * With u = low + 4 * high (0..7), q = u - 4, so per block
 * sumi = sum_g s_g * (u . y)_g - 4 * (s . bsums); acc += (d * da) * sumi. */

/* The 16 signed scales (-32..31) of a q3_k block as bytes (quant_q3_k_scales). */
QK_INLINE __m128i q3_k_scales8(const uint8_t packed[12]) {
    uint32_t u0, u1, u2;
    memcpy(&u0, packed, 4);
    memcpy(&u1, packed + 4, 4);
    memcpy(&u2, packed + 8, 4);
    const uint32_t m4 = 0x0F0F0F0Fu, m2 = 0x03030303u;
    const __m128i s = _mm_setr_epi32((int)((u0 & m4) | (u2 & m2) << 4), (int)((u1 & m4) | ((u2 >> 2) & m2) << 4),
                                     (int)(((u0 >> 4) & m4) | ((u2 >> 4) & m2) << 4),
                                     (int)(((u1 >> 4) & m4) | ((u2 >> 6) & m2) << 4));
    return _mm_sub_epi8(s, _mm_set1_epi8(32));
}

QK_INLINE void q3_k_rows(int64_t n, const void *w, const uint8_t *act, size_t stride, const int g, float *out) {
    const block_q3_k *x = (const block_q3_k *)w;
    const int64_t nb = n / QKK;
    const block_q8_k *a[LB_MAX_G];
    __m256 acc[LB_MAX_G];
    FOR_ROWS {
        a[r] = (const block_q8_k *)(const void *)(act + (size_t)r * stride);
        acc[r] = _mm256_setzero_ps();
    }
    const __m256i m3 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    for (int64_t ib = 0; ib < nb; ib++) {
        const block_q3_k *b = &x[ib];
        const float d = h2f(b->d);
        const __m128i sc8 = q3_k_scales8(b->scales);
        const __m256i sc16 = _mm256_cvtepi8_epi16(sc8), sc2 = _mm256_broadcastsi128_si256(sc8);
        const __m256i hm = _mm256_loadu_si256((const __m256i *)b->hmask);
        __m256i sumi[LB_MAX_G];
        FOR_ROWS {
            const __m256i bs = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)a[r][ib].bsums), sc16);
            sumi[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(bs, 2));
        }
        LB_UNROLL for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * h));
            LB_UNROLL for (int j = 0; j < 4; j++) {
                const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), m3);
                /* bit k = 4h + j of each hmask byte moved to bit 2 (a 16-bit shift by k - 2) */
                const int k = 4 * h + j;
                const __m256i hb = k >= 2 ? _mm256_srli_epi16(hm, k - 2) : _mm256_slli_epi16(hm, 2 - k);
                const __m256i u = _mm256_or_si256(lo, _mm256_and_si256(hb, four));
                const __m256i s = scale_pair_s8(sc2, 4 * h + j);
                FOR_ROWS {
                    const int8_t *y = a[r][ib].qs + 128 * h + 32 * j;
                    sumi[r] = acc_i16(sumi[r], _mm256_maddubs_epi16(u, _mm256_loadu_si256((const __m256i *)y)), s);
                }
            }
        }
        FOR_ROWS acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[r][ib].d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
    }
    FOR_ROWS out[r] = hsum_ps(acc[r]);
}

/* --- iq4_nl ------------------------------------------------------------------
 * Nibbles index the table with one vpshufb; signed x signed goes through the
 * sign trick (|q| as u8, y with q's sign). Per row and pair of blocks:
 * t = p0 * (dw0 * da0); t = fma(p1, dw1 * da1, t); acc += t. An odd last block
 * does acc = fma(p, dw * da, acc). */
QK_INLINE void iq4_nl_rows(int64_t n, const void *w, const uint8_t *act, size_t stride, const int g, float *out) {
    const block_iq4_nl *x = (const block_iq4_nl *)w;
    const int64_t nb = n / QK32;
    const act_q8 *a[LB_MAX_G];
    __m256 acc[LB_MAX_G];
    FOR_ROWS {
        a[r] = (const act_q8 *)(const void *)(act + (size_t)r * stride);
        acc[r] = _mm256_setzero_ps();
    }
    const __m256i table = iq4_table();
    int64_t ib = 0;
    for (; ib + 1 < nb; ib += 2) {
        const __m256i q0 = _mm256_shuffle_epi8(table, nibbles32(x[ib].qs));
        const __m256i q1 = _mm256_shuffle_epi8(table, nibbles32(x[ib + 1].qs));
        const __m256i u0 = _mm256_sign_epi8(q0, q0), u1 = _mm256_sign_epi8(q1, q1);
        const __m256 d0 = _mm256_set1_ps(h2f(x[ib].d)), d1 = _mm256_set1_ps(h2f(x[ib + 1].d));
        FOR_ROWS {
            const act_q8 *y = a[r] + ib;
            const __m256i s0 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)y[0].qs), q0);
            const __m256i s1 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)y[1].qs), q1);
            const __m256 p0 = _mm256_cvtepi32_ps(dot_u8s8(u0, s0)), p1 = _mm256_cvtepi32_ps(dot_u8s8(u1, s1));
            __m256 t = _mm256_mul_ps(p0, _mm256_mul_ps(d0, _mm256_broadcast_ss(&y[0].d)));
            t = _mm256_fmadd_ps(p1, _mm256_mul_ps(d1, _mm256_broadcast_ss(&y[1].d)), t);
            acc[r] = _mm256_add_ps(acc[r], t);
        }
    }
    if (ib < nb) {
        const __m256i q0 = _mm256_shuffle_epi8(table, nibbles32(x[ib].qs));
        const __m256i u0 = _mm256_sign_epi8(q0, q0);
        const __m256 d0 = _mm256_set1_ps(h2f(x[ib].d));
        FOR_ROWS {
            const act_q8 *y = a[r] + ib;
            const __m256i s0 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)y[0].qs), q0);
            const __m256 p0 = _mm256_cvtepi32_ps(dot_u8s8(u0, s0));
            acc[r] = _mm256_fmadd_ps(p0, _mm256_mul_ps(d0, _mm256_broadcast_ss(&y[0].d)), acc[r]);
        }
    }
    FOR_ROWS out[r] = hsum_ps(acc[r]);
}

/* --- iq4_xs ------------------------------------------------------------------
 * Per block sumi = sum_k (scale_k - 32) * (v . y)_k over the eight 32-elem
 * sub-blocks (table lookup and sign trick as iq4_nl); acc += (d * da) * sumi. */
QK_INLINE void iq4_xs_rows(int64_t n, const void *w, const uint8_t *act, size_t stride, const int g, float *out) {
    const block_iq4_xs *x = (const block_iq4_xs *)w;
    const int64_t nb = n / QKK;
    const block_q8_k *a[LB_MAX_G];
    __m256 acc[LB_MAX_G];
    FOR_ROWS {
        a[r] = (const block_q8_k *)(const void *)(act + (size_t)r * stride);
        acc[r] = _mm256_setzero_ps();
    }
    const __m256i table = iq4_table();
    for (int64_t ib = 0; ib < nb; ib++) {
        const block_iq4_xs *b = &x[ib];
        const float d = h2f(b->d);
        __m256i sumi[LB_MAX_G];
        FOR_ROWS sumi[r] = _mm256_setzero_si256();
        LB_UNROLL for (int k = 0; k < 8; k++) {
            const __m256i q = _mm256_shuffle_epi8(table, nibbles32(b->qs + 16 * k));
            const __m256i u = _mm256_sign_epi8(q, q);
            const __m256i s = _mm256_set1_epi16((short)(quant_iq4_xs_scale(b, k) - 32));
            FOR_ROWS {
                const __m256i y = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(a[r][ib].qs + 32 * k)), q);
                sumi[r] = acc_i16(sumi[r], _mm256_maddubs_epi16(u, y), s);
            }
        }
        FOR_ROWS acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[r][ib].d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
    }
    FOR_ROWS out[r] = hsum_ps(acc[r]);
}

/* Tile walk (no layout change: quant_act_tile_layout leaves these rows as they
 * are): per weight row, tokens in groups of LB_TILE_T through the same *_rows
 * function as quant_dot, so out[t * ostride + r] is bit-identical to it. */
#define LB_TILE_T 8
#define LB_TILE(type)                                                                                      \
    void QK_NAME(tile_##type)(int64_t n, const void *w, size_t wstride, int n_rows, const void *act,        \
                              size_t astride, int n_act, float *out, size_t ostride) {                     \
        const uint8_t *wb = (const uint8_t *)w, *ab = (const uint8_t *)act;                                \
        for (int r = 0; r < n_rows; r++) {                                                                 \
            const void *wr = wb + (size_t)r * wstride;                                                     \
            float o[LB_TILE_T];                                                                            \
            for (int t = 0; t < n_act;) {                                                                  \
                const int left = n_act - t;                                                                \
                int g;                                                                                     \
                if (left >= LB_TILE_T) type##_rows(n, wr, ab + (size_t)t * astride, astride, g = LB_TILE_T, o); \
                else if (left >= 4) type##_rows(n, wr, ab + (size_t)t * astride, astride, g = 4, o);        \
                else if (left == 3) type##_rows(n, wr, ab + (size_t)t * astride, astride, g = 3, o);        \
                else if (left == 2) type##_rows(n, wr, ab + (size_t)t * astride, astride, g = 2, o);        \
                else type##_rows(n, wr, ab + (size_t)t * astride, astride, g = 1, o);                       \
                for (int k = 0; k < g; k++) out[(size_t)(t + k) * ostride + (size_t)r] = o[k];              \
                t += g;                                                                                    \
            }                                                                                              \
        }                                                                                                  \
    }

LB_MULTI(q2_k, LB_GROUP_K)
LB_MULTI(q3_k, LB_GROUP_K)
LB_MULTI(iq4_nl, LB_GROUP_32)
LB_MULTI(iq4_xs, LB_GROUP_K)
LB_TILE(q2_k)
LB_TILE(q3_k)
LB_TILE(iq4_xs)

/* --- activations (bit-identical to ref/rows.c, design note 3) -------------- */

/* Quantizes 32 floats with inverse scale id into q; returns the sum of q. */
QK_INLINE int q8_32(const float *x, __m256 id, int8_t *q) {
    const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    __m256i v[4];
    for (int k = 0; k < 4; k++) {
        __m256 t = _mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), id);
        t = _mm256_max_ps(_mm256_min_ps(t, hi), lo);
        v[k] = _mm256_cvtps_epi32(t);
    }
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p);
    return _mm_cvtsi128_si32(s4);
}

QK_INLINE float amax_ps(const float *x, int len) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < len; i += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

QK_INLINE void avx_act_q8_rows(const float *x, act_q8 *y, int64_t n, const bool qsum128) {
    for (int64_t b = 0; b < n / QK32; b++, x += QK32) {
        const float amax = amax_ps(x, QK32), id = amax != 0.0f ? 127.0f / amax : 0.0f;
        const float d = kvs_f16_to_f32(kvs_f32_to_f16(amax / 127.0f));
        int s = q8_32(x, _mm256_set1_ps(id), y[b].qs);
        y[b].d = d;
        act_q8_set_sum(&y[b], d, s, qsum128);
    }
}

void QK_NAME(act_q8)(const float *x, void *act, int64_t n) { avx_act_q8_rows(x, act, n, false); }
void QK_NAME(act_q8_0)(const float *x, void *act, int64_t n) { avx_act_q8_rows(x, act, n, true); }

void QK_NAME(act_q8k)(const float *x, void *act, int64_t n) {
    block_q8_k *y = (block_q8_k *)act;
    for (int64_t b = 0; b < n / QKK; b++, x += QKK) {
        float d = amax_ps(x, QKK) / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int k = 0; k < 8; k++) (void)q8_32(x + 32 * k, _mm256_set1_ps(id), y[b].qs + 32 * k);
        y[b].d = d;
        for (int j = 0; j < 16; j++) {
            /* sum of 16 int8: sign-extend to i16 and add pairwise */
            __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(y[b].qs + 16 * j)));
            __m128i s = _mm_add_epi16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            s = _mm_madd_epi16(s, _mm_set1_epi16(1));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
            y[b].bsums[j] = (int16_t)_mm_cvtsi128_si32(s);
        }
    }
}

void QK_NAME(act_q8k32)(const float *x, void *act, int64_t n) { /* q4_k, q5_k */
    QK_NAME(act_q8k)(x, act, n);
    for (int64_t b = 0; b < n / QKK; b++) q8_k_sums32((block_q8_k *)act + b);
}

void QK_NAME(act_f32)(const float *x, void *act, int64_t n) { memcpy(act, x, (size_t)n * sizeof(float)); }

/* --- f16 rows ------------------------------------------------------------------ */

void QK_NAME(f16_to_f32_row)(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    quant_ref_f16_to_f32_row(src + i, dst + i, n - i);
}

void QK_NAME(f32_to_f16_row)(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    quant_ref_f32_to_f16_row(src + i, dst + i, n - i);
}

void QK_NAME(dequant_f16)(const void *w, float *y, int64_t n) { QK_NAME(f16_to_f32_row)((const uint16_t *)w, y, n); }
