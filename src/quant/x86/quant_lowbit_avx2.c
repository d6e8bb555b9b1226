/*
 * quant_lowbit_avx2 — AVX2+FMA+F16C dot kernels for q2_k, q3_k, iq4_nl and
 * iq4_xs (layouts in quant_impl.h; scalar twins in quant_lowbit_ref.c).
 *
 * quant_lowbit_avx512.c includes this file with QUANT_VNNI defined: the
 * same 256-bit kernels then use AVX512-VNNI (vpdpbusd / vpdpwssd) for the int8
 * and int16 dot steps and export quant_avx512_* names instead of quant_avx2_*.
 *
 * Integer sums are exact (no step saturates: |u| <= 127 and |s| <= 127 in every
 * u8 x s8 product pair), so only the float steps decide rounding. Batch
 * invariance (design note 4 in quant_impl.h): each *_rows function takes a
 * compile-time group size g; after inlining, row r of a group runs exactly the
 * instruction sequence of a group of one, and LB_MULTI walks n_act in groups.
 */
#include <immintrin.h>
#include <string.h>

#include "quant_impl.h"

#ifdef QUANT_VNNI
#define LB_NAME(x) quant_avx512_##x
#else
#define LB_NAME(x) quant_avx2_##x
#endif
/* Activation rows per group. Under AVX2 (16 registers) 4 spills a little yet
 * measured faster than 2 on Zen (ns per row-token at n = 2048, 8 tokens, one
 * core: q2_k 42 vs 48, q3_k 44 vs 58, iq4_xs 50 vs 66). */
#define LB_GROUP_K 4  /* q2_k, q3_k, iq4_xs */
#define LB_GROUP_32 4 /* iq4_nl */

#define LB_INLINE static inline __attribute__((always_inline))
#define LB_MAX_G 8 /* largest group: the tile walk's */
#define FOR_ROWS _Pragma("GCC unroll 8") for (int r = 0; r < g; r++)
#define LB_UNROLL _Pragma("GCC unroll 8") /* constant shift counts and shuffle controls */

/* --- helpers --------------------------------------------------------------- */

LB_INLINE float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

LB_INLINE float h2f(uint16_t h) { return _cvtsh_ss(h); }

/* Sum of u8 x s8 products, four bytes per i32 lane. */
LB_INLINE __m256i dot_u8s8(__m256i u, __m256i s) {
#ifdef QUANT_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* acc + pairwise i16 products of p and scale. */
LB_INLINE __m256i acc_i16(__m256i acc, __m256i p, __m256i scale) {
#ifdef QUANT_VNNI
    return _mm256_dpwssd_epi32(acc, p, scale);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, scale));
#endif
}

/* 16 bytes of nibbles -> 32 bytes: low nibbles (elems 0..15), then high (16..31). */
LB_INLINE __m256i nibbles32(const uint8_t *p) {
    __m128i t = _mm_loadu_si128((const __m128i *)p);
    __m256i b = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
}

/* The iq4 table in both 128-bit halves, for vpshufb lookups. */
LB_INLINE __m256i iq4_table(void) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)quant_iq4_values));
}

/* i16 lanes: scale byte 2c of sc2 in the low half, byte 2c + 1 in the high half,
 * zero-extended (sc2 holds 16 u8 scales in each half). */
LB_INLINE __m256i scale_pair_u8(__m256i sc2, const int c) {
    return _mm256_shuffle_epi8(sc2, _mm256_set_m128i(_mm_set1_epi16((short)(0x8000 | (2 * c + 1))),
                                                     _mm_set1_epi16((short)(0x8000 | (2 * c)))));
}

/* As scale_pair_u8 for signed i8 scales: the byte goes into both halves of the
 * i16 lane, and an arithmetic shift sign-extends it. */
LB_INLINE __m256i scale_pair_s8(__m256i sc2, const int c) {
    const short lo = (short)(2 * c * 0x101), hi = (short)((2 * c + 1) * 0x101);
    return _mm256_srai_epi16(_mm256_shuffle_epi8(sc2, _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo))), 8);
}

/* Walks n_act rows of activations in groups of G (then 3, 2, 1). */
#define LB_MULTI(type, G)                                                                                  \
    void LB_NAME(dot_##type)(int64_t n, const void *w, const void *act, size_t stride, int n_act, float *out) { \
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
LB_INLINE void q2_k_rows(int64_t n, const void *w, const uint8_t *act, size_t stride, const int g, float *out) {
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
LB_INLINE __m128i q3_k_scales8(const uint8_t packed[12]) {
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

LB_INLINE void q3_k_rows(int64_t n, const void *w, const uint8_t *act, size_t stride, const int g, float *out) {
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
LB_INLINE void iq4_nl_rows(int64_t n, const void *w, const uint8_t *act, size_t stride, const int g, float *out) {
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
LB_INLINE void iq4_xs_rows(int64_t n, const void *w, const uint8_t *act, size_t stride, const int g, float *out) {
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
    void LB_NAME(tile_##type)(int64_t n, const void *w, size_t wstride, int n_rows, const void *act,        \
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
