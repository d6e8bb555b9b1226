/*
 * x86/r8_avx2 — the r8 (row-interleaved) kernels of every type under AVX2;
 * compiled a second time as r8_avx512.c with QUANT_VNNI, where vpdpbusd makes
 * each block's integer sum in place of maddubs + add + madd, where 512-bit
 * pair kernels (below, "512-bit pair kernels") take neighbouring groups two
 * at a time, faster than the 256-bit VNNI kernels with the rows in cache, and
 * where one-token kernels for q4_0 and q4_k take two neighbouring blocks
 * (sub-blocks) of one group (one weight stream).
 *
 * Per block of eight rows, q4_0 for example: four 32-byte loads give, masked and shifted, eight
 * registers whose i32 lane r holds four unsigned elements of row r (layout in
 * quant_impl.h, block_q4_0x8). Each pairs with one 4-byte broadcast of the
 * activation block, so the eight u8 x s8 products sum to row r's exact block
 * sum P in lane r with no horizontal step: under plain AVX2 the eight maddubs
 * add in i16 (|sum| <= 16 x 15 x 127 = 30480, no saturation) and one madd
 * makes i32. Then the float steps of ref/r8.c, one lane per row:
 * t = fma(P, da, -8 s), acc = fma(t, dw, acc). The unpacked weights of a
 * block serve up to four tokens. Same steps whatever the number of tokens:
 * batch invariant, and bit-identical to the scalar reference.
 */
#include <immintrin.h>
#include <stddef.h>
#include <string.h>

#include "quant_impl.h"

#define R8_INLINE static inline __attribute__((always_inline))
#define R8_UNROLL _Pragma("GCC unroll 8")
#ifdef QUANT_VNNI
#define R8_TOKENS 8 /* tokens per pass over a group's blocks (32 registers) */
#else
#define R8_TOKENS 4 /* tokens per pass over a group's blocks */
#endif
#ifndef R8_PREFETCH
#define R8_PREFETCH 2304 /* bytes ahead (16 blocks) the weights are prefetched */
#endif

#ifdef QUANT_VNNI
#define R8_NAME(x) quant_avx512_##x
#else
#define R8_NAME(x) quant_avx2_##x
#endif

/* The frame of every group kernel: a[t] = token t's activation blocks and
 * acc[t] = its rows' sums (lane r), stored at out + t * ostride at the end;
 * vec_t / P: __m256 / _mm256 for one group (eight rows), __m512 / _mm512 for
 * the pair kernels (sixteen). */
#define R8_FRAME_BEGIN(act_t, vec_t, P)                                                        \
    const act_t *a[R8_TOKENS];                                                                 \
    vec_t acc[R8_TOKENS];                                                                      \
    R8_UNROLL for (int t = 0; t < T; t++) {                                                    \
        a[t] = (const act_t *)(act + (size_t)t * astride);                                     \
        acc[t] = P##_setzero_ps();                                                             \
    }
#define R8_FRAME_END(P) R8_UNROLL for (int t = 0; t < T; t++) P##_storeu_ps(out + (size_t)t * ostride, acc[t])
#define R8_GROUP_BEGIN(act_t) R8_FRAME_BEGIN(act_t, __m256, _mm256)
#define R8_GROUP_END() R8_FRAME_END(_mm256)

R8_INLINE __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Lane r: the exact sum of row r's 32 products with activation block y. */
R8_INLINE __m256i r8_block_sum(const __m256i lo[4], const __m256i hi[4], const int8_t *q) {
#ifdef QUANT_VNNI
    __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo[0], bcast4(q));
    s = _mm256_dpbusd_epi32(s, hi[0], bcast4(q + 4));
    R8_UNROLL for (int j = 1; j < 4; j++) {
        s = _mm256_dpbusd_epi32(s, lo[j], bcast4(q + 8 * j));
        s = _mm256_dpbusd_epi32(s, hi[j], bcast4(q + 8 * j + 4));
    }
    return s;
#else
    __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo[0], bcast4(q)), _mm256_maddubs_epi16(hi[0], bcast4(q + 4)));
    R8_UNROLL for (int j = 1; j < 4; j++) {
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[j], bcast4(q + 8 * j)));
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[j], bcast4(q + 8 * j + 4)));
    }
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
#endif
}

/* iq4_nl's and iq4_xs's sixteen values, for vpshufb on nibbles: under VNNI
 * plus 128 (0..255, a flipped top bit), the unsigned side of vpdpbusd, so a
 * sum comes back as P + 128 S (S the activation's sum over the same elements,
 * which the kernels take off again); under AVX2 as they are (-127..113),
 * for r8_signed_block_sum, since maddubs would saturate on the unsigned
 * ones (2 x 240 x 127 > 32767). */
R8_INLINE __m256i r8_iq4_table(void) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)quant_iq4_values));
#ifdef QUANT_VNNI
    return _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));
#else
    return v;
#endif
}

#ifdef QUANT_VNNI
#define R8_NL_EXACT(P, p, y) P##_sub_epi32(p, P##_set1_epi32((y)->qsum128)) /* P + 128 S less 128 S */
#else
#define R8_NL_EXACT(P, p, y) (p)
/* Lane r: the exact sum of row r's 32 products with q, the weights signed
 * (lo / hi as for r8_block_sum): maddubs(|w|, sign(q, w)) per chunk, each i16
 * pair <= 2 x 127 x 127, widened to i32 at once, as q8_0's chunks. */
R8_INLINE __m256i r8_signed_block_sum(const __m256i lo[4], const __m256i hi[4], const int8_t *q) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s = _mm256_setzero_si256();
    R8_UNROLL for (int j = 0; j < 4; j++) {
        const __m256i pl = _mm256_maddubs_epi16(_mm256_abs_epi8(lo[j]), _mm256_sign_epi8(bcast4(q + 8 * j), lo[j]));
        const __m256i ph = _mm256_maddubs_epi16(_mm256_abs_epi8(hi[j]), _mm256_sign_epi8(bcast4(q + 8 * j + 4), hi[j]));
        s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_madd_epi16(pl, ones), _mm256_madd_epi16(ph, ones)));
    }
    return s;
}
#endif

/* The weights R8_PREFETCH bytes past a q4_0x8 block: a single core's DRAM
 * stream (decode, weights far beyond L3) runs faster with it on some cores and
 * no slower on others (BENCHMARKS.md). */
R8_INLINE void r8_prefetch_q4_0(const block_q4_0x8 *blk) {
    _mm_prefetch((const char *)blk + R8_PREFETCH, _MM_HINT_T0);
    _mm_prefetch((const char *)blk + R8_PREFETCH + 72, _MM_HINT_T0);
}

/* The scale header (the first head bytes, those before the quants: q4_kx8
 * 128, q6_kx8 144) of the block R8_PREFETCH bytes ahead of blk: the kernels
 * prefetch the quants of that block as they step through this one's, and
 * without these lines the header of every block was a demand miss on the
 * stream (each block starts with it). */
R8_INLINE void r8_prefetch_head(const void *blk, size_t head) {
    R8_UNROLL for (size_t l = 0; l < head; l += 64) _mm_prefetch((const char *)blk + R8_PREFETCH + l, _MM_HINT_T0);
}

/* Four 32-byte chunks of nibbles from qs: lo[c] / hi[c] their low / high nibbles. */
R8_INLINE void r8_nibbles(const uint8_t *qs, __m256i lo[4], __m256i hi[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    R8_UNROLL for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        lo[c] = _mm256_and_si256(v, m4);
        hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
}

/* q4_0's float steps for one block and token (lane r: row r), the reference's:
 * t = fma(P, da, -8 s), acc = fma(t, dw, acc). */
R8_INLINE __m256 r8_q4_0_step(__m256i p, const act_q8 *y, __m256 dw, __m256 acc) {
    const __m256 tt = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(y->d), _mm256_set1_ps(y->s * -8.0f));
    return _mm256_fmadd_ps(tt, dw, acc);
}

#ifdef QUANT_VNNI
R8_INLINE void r8z_q4_0_one(int64_t nb, const block_q4_0x8 *g, const act_q8 *y, float *out);
#endif

/* One group (nb blocks) x T tokens (T compile-time after inlining); in the
 * VNNI build one token goes to r8z_q4_0_one. */
R8_INLINE void r8_q4_0_group(int64_t nb, const block_q4_0x8 *g, const uint8_t *act, size_t astride, const int T,
                             float *out, size_t ostride) {
#ifdef QUANT_VNNI
    if (T == 1) {
        r8z_q4_0_one(nb, g, (const act_q8 *)act, out);
        return;
    }
#endif
    R8_GROUP_BEGIN(act_q8);
    for (int64_t b = 0; b < nb; b++) {
        r8_prefetch_q4_0(&g[b]);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g[b].d));
        __m256i lo[4], hi[4];
        r8_nibbles(g[b].qs, lo, hi);
        R8_UNROLL for (int t = 0; t < T; t++) acc[t] = r8_q4_0_step(r8_block_sum(lo, hi, a[t][b].qs), &a[t][b], dw, acc[t]);
    }
    R8_GROUP_END();
}

/* Chunk j of block b of G groups: each group's |w| once, then every token's
 * 4-byte broadcast meets every group's chunk, its products into s[k][t]. */
#ifdef QUANT_VNNI
#define R8_Q8_0_DOT(s, u, v) _mm256_dpbusd_epi32(s, u, v)
#else
#define R8_Q8_0_DOT(s, u, v) _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), ones))
#endif
#define R8_Q8_0_CHUNK(j)                                                                       \
    do {                                                                                       \
        __m256i w[2], u[2];                                                                    \
        R8_UNROLL for (int k = 0; k < G; k++) {                                                \
            w[k] = _mm256_loadu_si256((const __m256i *)(g[k * nb + b].qs + 32 * (j)));         \
            u[k] = _mm256_abs_epi8(w[k]);                                                      \
        }                                                                                      \
        R8_UNROLL for (int t = 0; t < T; t++) {                                                \
            const __m256i v = bcast4(a[t][b].qs + 4 * (j));                                    \
            R8_UNROLL for (int k = 0; k < G; k++)                                              \
                s[k][t] = R8_Q8_0_DOT(s[k][t], u[k], _mm256_sign_epi8(v, w[k]));               \
        }                                                                                      \
    } while (0)

/* q8_0, per block: eight 32-byte chunks (four elements of every row each);
 * each chunk's |w| is taken once and meets every token's sign(a, w) of one
 * 4-byte broadcast, so maddubs never sees a negative unsigned side: each i16
 * pair sum is <= 2 x 128 x 127 (no saturation) and goes to i32 at once
 * (s[k][t], exact, so the order of chunks, groups and tokens does not
 * matter). G (1 or 2) groups of eight rows at a time, group k at g + k nb and
 * its sums at out + 8 k: a broadcast serves both groups (a little less time per row-token than
 * one group, in cache). Float steps of ref/r8.c:
 * acc = fma(P da, dw, acc). */
R8_INLINE void r8_q8_0_groups(int64_t nb, const block_q8_0x8 *g, const int G, const uint8_t *act, size_t astride,
                              const int T, float *out, size_t ostride) {
    const act_q8 *a[R8_TOKENS];
    __m256 acc[2][R8_TOKENS];
    R8_UNROLL for (int t = 0; t < T; t++) {
        a[t] = (const act_q8 *)(act + (size_t)t * astride);
        R8_UNROLL for (int k = 0; k < G; k++) acc[k][t] = _mm256_setzero_ps();
    }
#ifndef QUANT_VNNI
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    for (int64_t b = 0; b < nb; b++) {
        R8_UNROLL for (int k = 0; k < G; k++) {
            const char *gb = (const char *)&g[k * nb + b];
            R8_UNROLL for (int c = 0; c < 4; c++) _mm_prefetch(gb + R8_PREFETCH + 64 * c, _MM_HINT_T0);
        }
        __m256i s[2][R8_TOKENS];
        R8_UNROLL for (int k = 0; k < G; k++) R8_UNROLL for (int t = 0; t < T; t++) s[k][t] = _mm256_setzero_si256();
        /* With four tokens a fully unrolled chunk loop spills (gcc keeps every
         * chunk's products live); rolled, the pass runs faster.
         * Fewer tokens keep the unrolled form, which is faster there. */
        if (T >= R8_TOKENS) {
            _Pragma("GCC unroll 1") for (int j = 0; j < 8; j++) R8_Q8_0_CHUNK(j);
        } else {
            R8_UNROLL for (int j = 0; j < 8; j++) R8_Q8_0_CHUNK(j);
        }
        R8_UNROLL for (int k = 0; k < G; k++) {
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g[k * nb + b].d));
            R8_UNROLL for (int t = 0; t < T; t++) {
                const __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(s[k][t]), _mm256_set1_ps(a[t][b].d));
                acc[k][t] = _mm256_fmadd_ps(p, dw, acc[k][t]);
            }
        }
    }
    R8_UNROLL for (int k = 0; k < G; k++)
        R8_UNROLL for (int t = 0; t < T; t++) _mm256_storeu_ps(out + 8 * k + (size_t)t * ostride, acc[k][t]);
}

/* Lane r = row r's sum of 32 products of one q4_0x8-style sub-block with q,
 * still as two i16 halves per lane (each <= 16 x 15 x 127). */
R8_INLINE __m256i r8_sub_sum16(const __m256i lo[4], const __m256i hi[4], const int8_t *q) {
    __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo[0], bcast4(q)), _mm256_maddubs_epi16(hi[0], bcast4(q + 4)));
    R8_UNROLL for (int j = 1; j < 4; j++) {
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[j], bcast4(q + 8 * j)));
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[j], bcast4(q + 8 * j + 4)));
    }
    return s;
}

/* q4_k, per super-block of eight rows: the 64 scales and 64 mins decoded once
 * (lane r of sc32[j] = row r's scale j in both i16 halves; of mn32[p] = its
 * mins 2p and 2p + 1), then per sub-block the q4_0-style sums, times the scale
 * by one madd (exact: S1 <= 8 x 63 x 60960), and per token the mins against
 * the activation's sub-block sums by four madds; float steps of
 * ref/r8.c. */
/* The 6-bit scale and min bytes of a q4_kx8 super-block from its sc_lo (l),
 * m_lo (ml) and hi (h) bytes: b[0] / b[1] = scales 0-3 / 4-7 (byte 8j + r:
 * row r's scale j or 4 + j), b[2] / b[3] the mins; at either width (P _mm256
 * or _mm512, S si256 or si512, m4_ / m3_ bytes 0x0F / 0x03; at 512 bits, two
 * super-blocks side by side). */
#define R8_Q4_K_SCALE_BYTES(P, S, l, ml, h, m4_, m3_, b)                                                          \
    do {                                                                                                       \
        b[0] = P##_or_##S(P##_and_##S(l, m4_), P##_slli_epi16(P##_and_##S(h, m3_), 4));                          \
        b[1] = P##_or_##S(P##_and_##S(P##_srli_epi16(l, 4), m4_),                                              \
                          P##_slli_epi16(P##_and_##S(P##_srli_epi16(h, 2), m3_), 4));                           \
        b[2] = P##_or_##S(P##_and_##S(ml, m4_), P##_slli_epi16(P##_and_##S(P##_srli_epi16(h, 4), m3_), 4));     \
        b[3] = P##_or_##S(P##_and_##S(P##_srli_epi16(ml, 4), m4_),                                             \
                          P##_slli_epi16(P##_and_##S(P##_srli_epi16(h, 6), m3_), 4));                           \
    } while (0)

R8_INLINE void r8_q4_k_scale_bytes(const block_q4_kx8 *g, __m256i b[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x03);
    const __m256i l = _mm256_loadu_si256((const __m256i *)g->sc_lo), ml = _mm256_loadu_si256((const __m256i *)g->m_lo),
                  h = _mm256_loadu_si256((const __m256i *)g->hi);
    R8_Q4_K_SCALE_BYTES(_mm256, si256, l, ml, h, m4, m3, b);
}

R8_INLINE void r8_q4_k_scales(const block_q4_kx8 *g, __m256i sc32[8], __m256i mn32[4]) {
    __m256i bytes[4];
    r8_q4_k_scale_bytes(g, bytes);
    uint8_t sc[64], mn[64];
    _mm256_storeu_si256((__m256i *)sc, bytes[0]);
    _mm256_storeu_si256((__m256i *)(sc + 32), bytes[1]);
    _mm256_storeu_si256((__m256i *)mn, bytes[2]);
    _mm256_storeu_si256((__m256i *)(mn + 32), bytes[3]);
    R8_UNROLL for (int j = 0; j < 8; j++) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8 * j)));
        sc32[j] = _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
    }
    R8_UNROLL for (int p = 0; p < 4; p++) {
        const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mn + 16 * p)));
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mn + 16 * p + 8)));
        mn32[p] = _mm256_or_si256(a, _mm256_slli_epi32(b, 16));
    }
}

/* The float steps of the types with mins (q4_k, q5_k, q2_k) for one
 * super-block and token (lane r: row r): the mins, np i16 pairs mn[p], against
 * the activation's sums (q4_k's 32-element sums, q8_k_sums32, four pairs;
 * q2_k's 16-element sums, eight), then acc += S1 d da, acc -= S2 dmin da. */
R8_INLINE __m256 r8_min_step(__m256i s1, const block_q8_k *y, const __m256i *mn, const int np, __m256 d, __m256 dmin,
                             __m256 acc) {
    __m256i s2 = _mm256_setzero_si256();
    R8_UNROLL for (int p = 0; p < np; p++)
        s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(mn[p], bcast4((const int8_t *)(y->bsums + 2 * p))));
    const __m256 da = _mm256_set1_ps(y->d);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d, da), acc);
    return _mm256_fnmadd_ps(_mm256_cvtepi32_ps(s2), _mm256_mul_ps(dmin, da), acc);
}

#ifdef QUANT_VNNI
R8_INLINE void r8z_q4_k_one(int64_t nb, const block_q4_kx8 *g, const block_q8_k *y, float *out);
#endif

/* One group x T tokens; in the VNNI build one token goes to r8z_q4_k_one. */
R8_INLINE void r8_q4_k_group(int64_t nb, const block_q4_kx8 *g, const uint8_t *act, size_t astride, const int T,
                             float *out, size_t ostride) {
#ifdef QUANT_VNNI
    if (T == 1) {
        r8z_q4_k_one(nb, g, (const block_q8_k *)act, out);
        return;
    }
#endif
    R8_GROUP_BEGIN(block_q8_k);
    for (int64_t b = 0; b < nb; b++) {
        __m256i sc32[8], mn32[4], s1[R8_TOKENS];
        r8_prefetch_head(&g[b], offsetof(block_q4_kx8, qs));
        r8_q4_k_scales(&g[b], sc32, mn32);
        R8_UNROLL for (int t = 0; t < T; t++) s1[t] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const uint8_t *qs = g[b].qs + 128 * j;
            _mm_prefetch((const char *)qs + R8_PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)qs + R8_PREFETCH + 64, _MM_HINT_T0);
            __m256i lo[4], hi[4];
            r8_nibbles(qs, lo, hi);
            R8_UNROLL for (int t = 0; t < T; t++) {
#ifdef QUANT_VNNI
                s1[t] = _mm256_dpwssd_epi32(s1[t], r8_sub_sum16(lo, hi, a[t][b].qs + 32 * j), sc32[j]);
#else
                s1[t] = _mm256_add_epi32(s1[t], _mm256_madd_epi16(r8_sub_sum16(lo, hi, a[t][b].qs + 32 * j), sc32[j]));
#endif
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g[b].d));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g[b].dmin));
        R8_UNROLL for (int t = 0; t < T; t++) acc[t] = r8_min_step(s1[t], &a[t][b], mn32, 4, d, dmin, acc[t]);
    }
    R8_GROUP_END();
}

/* h shifted left by k bits in each 16-bit lane (right by -k; k a constant
 * after inlining): moves bit 4 - k of each byte to bit 4 for k in -3..4. */
R8_INLINE __m256i r8_shift16(__m256i h, const int k) {
    return k > 0 ? _mm256_slli_epi16(h, k) : k < 0 ? _mm256_srli_epi16(h, -k) : h;
}

/* q5_k's 5-bit values of sub-block j: r8_nibbles of its four chunks with each
 * element's fifth bit from qh (bit 2c / 2c + 1 of the byte, block_q5_kx8)
 * moved to bit 4: lo[c] / hi[c] in 0..31. */
R8_INLINE void r8_q5_nibbles(const uint8_t *qs, const uint8_t *qh, __m256i lo[4], __m256i hi[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m10 = _mm256_set1_epi8(0x10);
    const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
    R8_UNROLL for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        lo[c] = _mm256_or_si256(_mm256_and_si256(v, m4), _mm256_and_si256(r8_shift16(h, 4 - 2 * c), m10));
        hi[c] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), _mm256_and_si256(r8_shift16(h, 3 - 2 * c), m10));
    }
}

/* Lane r: row r's sum of the 16 products of x[0..3] with q (bytes off,
 * 8 + off, ..) as two i16 halves: each <= 8 x 31 x 127, so a 5-bit
 * sub-block sums its low and its high chunks apart (r8_sub_sum16's one sum
 * of 32 would overflow). */
R8_INLINE __m256i r8_half_sum16(const __m256i x[4], const int8_t *q, const int off) {
    __m256i s = _mm256_maddubs_epi16(x[0], bcast4(q + off));
    R8_UNROLL for (int c = 1; c < 4; c++) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(x[c], bcast4(q + 8 * c + off)));
    return s;
}

/* q5_k: r8_q4_k_group with 5-bit values (the same scales, mins and float
 * steps; S1 <= 8 x 63 x 32 x 31 x 127, exact in i32). */
R8_INLINE void r8_q5_k_group(int64_t nb, const block_q5_kx8 *g, const uint8_t *act, size_t astride, const int T,
                             float *out, size_t ostride) {
    R8_GROUP_BEGIN(block_q8_k);
    for (int64_t b = 0; b < nb; b++) {
        __m256i sc32[8], mn32[4], s1[R8_TOKENS];
        r8_prefetch_head(&g[b], offsetof(block_q4_kx8, qs));
        r8_q4_k_scales(&g[b].lo, sc32, mn32);
        R8_UNROLL for (int t = 0; t < T; t++) s1[t] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const uint8_t *qs = g[b].lo.qs + 128 * j, *qh = g[b].qh + 32 * j;
            _mm_prefetch((const char *)qs + R8_PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)qs + R8_PREFETCH + 64, _MM_HINT_T0);
            if (j % 2 == 0) _mm_prefetch((const char *)qh + R8_PREFETCH, _MM_HINT_T0); /* a line: two sub-blocks */
            __m256i lo[4], hi[4];
            r8_q5_nibbles(qs, qh, lo, hi);
            R8_UNROLL for (int t = 0; t < T; t++) {
                const int8_t *q = a[t][b].qs + 32 * j;
#ifdef QUANT_VNNI
                s1[t] = _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(s1[t], r8_half_sum16(lo, q, 0), sc32[j]),
                                            r8_half_sum16(hi, q, 4), sc32[j]);
#else
                s1[t] = _mm256_add_epi32(s1[t], _mm256_add_epi32(_mm256_madd_epi16(r8_half_sum16(lo, q, 0), sc32[j]),
                                                                 _mm256_madd_epi16(r8_half_sum16(hi, q, 4), sc32[j])));
#endif
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g[b].lo.d));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g[b].lo.dmin));
        R8_UNROLL for (int t = 0; t < T; t++) acc[t] = r8_min_step(s1[t], &a[t][b], mn32, 4, d, dmin, acc[t]);
    }
    R8_GROUP_END();
}

/* q6_k, per super-block of eight rows: lane r of sc16[g] = row r's scale of
 * group g in both i16 halves (r8_i8_scales with both; without, in the low
 * half only), of scp[p] = its scales of groups 2p and 2p + 1.
 * Per sub-block the 6-bit u = q + 32 are rebuilt from ql and qh; per 16-element
 * group two maddubs add in i16 (|sum| <= 4 x 63 x 127) and one madd applies
 * the scale; the -32 offset comes back as 32 sum_g sc_g bs_g (eight madds per
 * token); float steps of ref/r8.c. */
R8_INLINE void r8_i8_scales(const int8_t *sc, const int both, __m256i sc16[16], __m256i scp[8]) {
    const __m256i lo16 = _mm256_set1_epi32(0xFFFF);
    __m256i v[16];
    R8_UNROLL for (int k = 0; k < 16; k++) {
        v[k] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8 * k)));
        sc16[k] = both ? _mm256_or_si256(_mm256_and_si256(v[k], lo16), _mm256_slli_epi32(v[k], 16))
                       : _mm256_and_si256(v[k], lo16);
    }
    R8_UNROLL for (int p = 0; p < 8; p++)
        scp[p] = _mm256_or_si256(_mm256_and_si256(v[2 * p], lo16), _mm256_slli_epi32(v[2 * p + 1], 16));
}
R8_INLINE void r8_q6_k_scales(const block_q6_kx8 *g, __m256i sc16[16], __m256i scp[8]) {
    r8_i8_scales(g->sc, 1, sc16, scp);
}

/* The 6-bit u = q + 32 of four 32-byte registers u[0..3] from two ql chunks
 * (q0, q1) and one qh chunk (hb), and the two i16 sums of a 16-element group
 * against activations q (x: u[0], u[1]; y: u[2], u[3]), at either width: P
 * is _mm256 or _mm512, S si256 or si512, BCAST its 4-byte broadcast. */
#define R8_Q6_K_UNPACK(P, S, q0, q1, hb, m4, m3, u)                                                            \
    do {                                                                                                     \
        u[0] = P##_or_##S(P##_and_##S(q0, m4), P##_slli_epi16(P##_and_##S(hb, m3), 4));                        \
        u[1] = P##_or_##S(P##_and_##S(P##_srli_epi16(q0, 4), m4), P##_slli_epi16(P##_and_##S(P##_srli_epi16(hb, 2), m3), 4)); \
        u[2] = P##_or_##S(P##_and_##S(q1, m4), P##_slli_epi16(P##_and_##S(P##_srli_epi16(hb, 4), m3), 4));    \
        u[3] = P##_or_##S(P##_and_##S(P##_srli_epi16(q1, 4), m4), P##_slli_epi16(P##_and_##S(P##_srli_epi16(hb, 6), m3), 4)); \
    } while (0)
#define R8_Q6_K_SUMS16(P, BCAST, u, q, x, y)                                                                   \
    do {                                                                                                     \
        x = P##_add_epi16(P##_maddubs_epi16(u[0], BCAST(q)), P##_maddubs_epi16(u[1], BCAST(q + 4)));          \
        y = P##_add_epi16(P##_maddubs_epi16(u[2], BCAST(q + 8)), P##_maddubs_epi16(u[3], BCAST(q + 12)));     \
    } while (0)

/* q6_k's and q3_k's float step per super-block and token: S = s1 - 2^shift
 * sum_g sc_g bs_g (their offset, 32 or 4, against the activation's 16-element
 * sums; scp as r8_i8_scales gives it), acc = fma(S, d da, acc). */
R8_INLINE __m256 r8_offset_step(__m256i s1, const __m256i scp[8], const block_q8_k *y, const int shift, __m256 d,
                                __m256 acc) {
    __m256i s2 = _mm256_madd_epi16(scp[0], bcast4((const int8_t *)y->bsums));
    R8_UNROLL for (int p = 1; p < 8; p++)
        s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(scp[p], bcast4((const int8_t *)(y->bsums + 2 * p))));
    const __m256i sum = _mm256_sub_epi32(s1, _mm256_slli_epi32(s2, shift));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(y->d)), acc);
}

R8_INLINE void r8_q6_k_group(int64_t nb, const block_q6_kx8 *g, const uint8_t *act, size_t astride, const int T,
                             float *out, size_t ostride) {
    R8_GROUP_BEGIN(block_q8_k);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x03);
    for (int64_t b = 0; b < nb; b++) {
        __m256i sc16[16], scp[8], s1[R8_TOKENS];
        r8_prefetch_head(&g[b], offsetof(block_q6_kx8, ql));
        r8_q6_k_scales(&g[b], sc16, scp);
        R8_UNROLL for (int t = 0; t < T; t++) s1[t] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const uint8_t *ql = g[b].ql + 128 * j, *qh = g[b].qh + 64 * j;
            _mm_prefetch((const char *)ql + R8_PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)ql + R8_PREFETCH + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)qh + R8_PREFETCH, _MM_HINT_T0);
            R8_UNROLL for (int h = 0; h < 2; h++) {
                const __m256i q0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h)),
                              q1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32)),
                              hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
                __m256i u[4];
                R8_Q6_K_UNPACK(_mm256, si256, q0, q1, hb, m4, m3, u);
                const __m256i sc = sc16[2 * j + h];
                R8_UNROLL for (int t = 0; t < T; t++) {
                    const int8_t *q = a[t][b].qs + 32 * j + 16 * h;
                    __m256i x, y;
                    R8_Q6_K_SUMS16(_mm256, bcast4, u, q, x, y);
#ifdef QUANT_VNNI
                    s1[t] = _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(s1[t], x, sc), y, sc);
#else
                    s1[t] = _mm256_add_epi32(s1[t], _mm256_add_epi32(_mm256_madd_epi16(x, sc), _mm256_madd_epi16(y, sc)));
#endif
                }
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g[b].d));
        R8_UNROLL for (int t = 0; t < T; t++) acc[t] = r8_offset_step(s1[t], scp, &a[t][b], 5, d, acc[t]);
    }
    R8_GROUP_END();
}

/* q3_k, per super-block of eight rows: the 128 six-bit scales decoded to
 * signed bytes in q6_kx8's order (sc[8 g + r], 32 subtracted) and taken as
 * q6_k takes its own. Each 16-element group's u = q + 4 (0..7) come from one
 * qs chunk (the low two bits at 2c) and the sub-block's hm chunk (the top bit
 * at 4 h + c, moved to bit 2); the -4 offset comes back as 4 sum_g sc_g bs_g.
 * Under VNNI a group's four vpdpbusd make its exact sum P (|P| <= 16 x 7 x
 * 127, an i16), and one vpdpwssd against the scale in the low i16 half only
 * adds sc P; under AVX2 q6_k's i16 sums and madd. The same integers either
 * way, and the reference's float steps. */
R8_INLINE void r8_q3_k_scales(const block_q3_kx8 *g, __m256i sc16[16], __m256i scp[8]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x03), k32 = _mm256_set1_epi8(32);
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)g->sc_lo),
                  l1 = _mm256_loadu_si256((const __m256i *)(g->sc_lo + 32)),
                  hb = _mm256_loadu_si256((const __m256i *)g->sc_hi);
    int8_t sc[128];
    R8_UNROLL for (int m = 0; m < 4; m++) { /* entries 32 m .. 32 m + 31 */
        const __m256i l = m % 2 ? l1 : l0;
        const __m256i lo = m < 2 ? _mm256_and_si256(l, m4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
        const __m256i hi = _mm256_and_si256(m ? _mm256_srli_epi16(hb, 2 * m) : hb, m3);
        const __m256i v = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
        _mm256_storeu_si256((__m256i *)(sc + 32 * m), _mm256_sub_epi8(v, k32));
    }
#ifdef QUANT_VNNI
    r8_i8_scales(sc, 0, sc16, scp);
#else
    r8_i8_scales(sc, 1, sc16, scp);
#endif
}

#ifdef QUANT_VNNI
#define R8_LOW2_OR(P, S, x, hi, m3) P##_ternarylogic_epi32(x, hi, m3, 0xEC) /* (x & m3) | hi */
#else
#define R8_LOW2_OR(P, S, x, hi, m3) P##_or_##S(P##_and_##S(x, m3), hi)
#endif
/* The u (0..7) of group h (0, 1) of a sub-block, four registers u[c] (lane r:
 * row r's elements 16 h + 4 c .. + 3), from its qs chunk q and the
 * sub-block's hm chunk hb (bit 4 h + c moved to bit 2 by SHIFT16: r8_shift16
 * or z_shift16), at either width. */
#define R8_Q3_K_UNPACK(P, S, SHIFT16, q, hb, h, m3, b2, u)                                                      \
    R8_UNROLL for (int c_ = 0; c_ < 4; c_++) u[c_] =                                                            \
        R8_LOW2_OR(P, S, c_ ? P##_srli_epi16(q, 2 * c_) : q, P##_and_##S(SHIFT16(hb, 2 - 4 * (h) - c_), b2), m3)

/* One 16-element group of q3_k / q2_k (u[c] in 0..7, four elements of each
 * row) against activations aq: s1 + sc P, P the exact sum (|P| <= 16 x 7 x
 * 127, an i16). VNNI: four vpdpbusd make P and one vpdpwssd meets the scale
 * in the low i16 half only (P's high half, its sign, meets a zero); AVX2:
 * q6_k's i16 sums and madd against the scale in both halves. */
R8_INLINE __m256i r8_group16_sum(const __m256i u[4], const int8_t *aq, __m256i sc, __m256i s1) {
#ifdef QUANT_VNNI
    __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u[0], bcast4(aq));
    R8_UNROLL for (int c = 1; c < 4; c++) p = _mm256_dpbusd_epi32(p, u[c], bcast4(aq + 4 * c));
    return _mm256_dpwssd_epi32(s1, p, sc);
#else
    __m256i x, y;
    R8_Q6_K_SUMS16(_mm256, bcast4, u, aq, x, y);
    return _mm256_add_epi32(s1, _mm256_add_epi32(_mm256_madd_epi16(x, sc), _mm256_madd_epi16(y, sc)));
#endif
}

R8_INLINE void r8_q3_k_group(int64_t nb, const block_q3_kx8 *g, const uint8_t *act, size_t astride, const int T,
                             float *out, size_t ostride) {
    R8_GROUP_BEGIN(block_q8_k);
    const __m256i m3 = _mm256_set1_epi8(0x03), b2 = _mm256_set1_epi8(0x04);
    for (int64_t b = 0; b < nb; b++) {
        __m256i sc16[16], scp[8], s1[R8_TOKENS];
        r8_prefetch_head(&g[b], offsetof(block_q3_kx8, qs));
        r8_q3_k_scales(&g[b], sc16, scp);
        R8_UNROLL for (int t = 0; t < T; t++) s1[t] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const uint8_t *qs = g[b].qs + 64 * j, *hm = g[b].hm + 32 * j;
            _mm_prefetch((const char *)qs + R8_PREFETCH, _MM_HINT_T0);
            if (j % 2 == 0) _mm_prefetch((const char *)hm + R8_PREFETCH, _MM_HINT_T0);
            const __m256i hb = _mm256_loadu_si256((const __m256i *)hm);
            R8_UNROLL for (int h = 0; h < 2; h++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
                __m256i u[4];
                R8_Q3_K_UNPACK(_mm256, si256, r8_shift16, q, hb, h, m3, b2, u);
                const __m256i sc = sc16[2 * j + h];
                R8_UNROLL for (int t = 0; t < T; t++) s1[t] = r8_group16_sum(u, a[t][b].qs + 32 * j + 16 * h, sc, s1[t]);
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g[b].d));
        R8_UNROLL for (int t = 0; t < T; t++) acc[t] = r8_offset_step(s1[t], scp, &a[t][b], 2, d, acc[t]);
    }
    R8_GROUP_END();
}

/* q2_k, per super-block of eight rows: lane r of sc16[g] = row r's scale of
 * group g (the low nibble of sc[8 g + r]) in the low i16 half, under AVX2 in
 * both; of mnp[p] = its mins of groups 2p and 2p + 1 (the high nibbles) as an
 * i16 pair. Both nibbles are unsigned (0..15). */
R8_INLINE void r8_q2_k_scales(const block_q2_kx8 *g, __m256i sc16[16], __m256i mnp[8]) {
    const __m256i m4 = _mm256_set1_epi32(0x0F);
    __m256i mn[16];
    R8_UNROLL for (int k = 0; k < 16; k++) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(g->sc + 8 * k)));
        const __m256i sc = _mm256_and_si256(v, m4);
#ifdef QUANT_VNNI
        sc16[k] = sc;
#else
        sc16[k] = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
#endif
        mn[k] = _mm256_srli_epi32(v, 4);
    }
    R8_UNROLL for (int p = 0; p < 8; p++) mnp[p] = _mm256_or_si256(mn[2 * p], _mm256_slli_epi32(mn[2 * p + 1], 16));
}

/* The q (0..3) of a 16-element group, four registers u[c] (lane r: row r's
 * elements 16 g + 4 c .. + 3), from its qs chunk q, at either width (the bits
 * a 16-bit shift brings in from the next byte land above the mask). */
#define R8_Q2_K_UNPACK(P, S, q, m3, u) \
    R8_UNROLL for (int c_ = 0; c_ < 4; c_++) u[c_] = P##_and_##S(c_ ? P##_srli_epi16(q, 2 * c_) : q, m3)

/* q2_k: q3_k's integer sums on q (0..3), with unsigned scales and no offset.
 * A group's exact sum P (|P| <= 16 x 3 x 128) fits an i16: under VNNI four
 * vpdpbusd make it and one vpdpwssd against the scale in the low i16 half
 * only adds sc P (the high half of P's i32, its sign, meets a zero); under
 * AVX2 q6_k's i16 sums and madd. The mins meet the activation's 16-element
 * sums by eight madds per token; then step_q4_k's float steps: acc += S1 d da,
 * acc -= S2 dmin da. */
R8_INLINE void r8_q2_k_group(int64_t nb, const block_q2_kx8 *g, const uint8_t *act, size_t astride, const int T,
                             float *out, size_t ostride) {
    R8_GROUP_BEGIN(block_q8_k);
    const __m256i m3 = _mm256_set1_epi8(0x03);
    for (int64_t b = 0; b < nb; b++) {
        __m256i sc16[16], mnp[8], s1[R8_TOKENS];
        r8_prefetch_head(&g[b], offsetof(block_q2_kx8, qs));
        r8_q2_k_scales(&g[b], sc16, mnp);
        R8_UNROLL for (int t = 0; t < T; t++) s1[t] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) { /* groups 2j and 2j + 1: one 64-byte line */
            const uint8_t *qs = g[b].qs + 64 * j;
            _mm_prefetch((const char *)qs + R8_PREFETCH, _MM_HINT_T0);
            R8_UNROLL for (int h = 0; h < 2; h++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
                __m256i u[4];
                R8_Q2_K_UNPACK(_mm256, si256, q, m3, u);
                const __m256i sc = sc16[2 * j + h];
                R8_UNROLL for (int t = 0; t < T; t++) s1[t] = r8_group16_sum(u, a[t][b].qs + 32 * j + 16 * h, sc, s1[t]);
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g[b].d));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g[b].dmin));
        R8_UNROLL for (int t = 0; t < T; t++) acc[t] = r8_min_step(s1[t], &a[t][b], mnp, 8, d, dmin, acc[t]);
    }
    R8_GROUP_END();
}

#ifdef QUANT_VNNI
/* --- 512-bit pair kernels (VNNI build) ---------------------------------------
 * Two neighbouring groups at once, one zmm: lanes 0-7 are group g's rows,
 * lanes 8-15 the next group's (its blocks start nb blocks after g's), whose
 * sums belong at out + 8, right after g's.
 * Every lane makes the integer sums and float steps of the 256-bit kernels
 * above (the same exact sums, the same float operations in the same order),
 * so the bits are the same; on a core with full-width 512-bit units (Zen 5)
 * each instruction does twice the work. */
R8_INLINE __m512i z_bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* 32 bytes of group 0 in the low half, 32 of group 1 in the high half. */
R8_INLINE __m512i z_load2(const void *p0, const void *p1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p0)),
                              _mm256_loadu_si256((const __m256i *)p1), 1);
}

/* Eight f16 scales of each group, as 16 floats. */
R8_INLINE __m512 z_f16x2(const uint16_t *d0, const uint16_t *d1) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)d0))),
                              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)d1)), 1);
}

/* Lane r: row r's exact sums of the 16 products of its low (*s) and of its
 * high (*u) nibbles with q, two independent chains of four vpdpbusd. */
R8_INLINE void z_block_halves(const __m512i lo[4], const __m512i hi[4], const int8_t *q, __m512i *s, __m512i *u) {
    *s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[0], z_bcast4(q));
    *u = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[0], z_bcast4(q + 4));
    R8_UNROLL for (int j = 1; j < 4; j++) {
        *s = _mm512_dpbusd_epi32(*s, lo[j], z_bcast4(q + 8 * j));
        *u = _mm512_dpbusd_epi32(*u, hi[j], z_bcast4(q + 8 * j + 4));
    }
}

/* Lane r: row r's exact sum of 32 products with q (r8_block_sum on 16 lanes). */
R8_INLINE __m512i z_block_sum(const __m512i lo[4], const __m512i hi[4], const int8_t *q) {
    __m512i s, u;
    z_block_halves(lo, hi, q, &s, &u);
    return _mm512_add_epi32(s, u);
}

#define R8Z_PAIR_BEGIN(act_t) R8_FRAME_BEGIN(act_t, __m512, _mm512)
#define R8Z_PAIR_END() R8_FRAME_END(_mm512)

/* From a type's pair step (r8z_TYPE_pair_block: super-block b of groups g and
 * h, T tokens, into acc[t]'s 16 lanes), its pair kernel (groups g and g + nb,
 * T tokens) and its one-token quad kernel (groups gs[0..3], wherever they lie,
 * as two pairs stepped side by side: four weight streams per thread, which
 * read DRAM faster than two; group k's eight outputs to
 * os[k]; per lane the pair kernel's steps, so the same bits). */
#define R8Z_PAIR_KERNELS(type, block_t, act_t)                                                                   \
    R8_INLINE void r8z_##type##_pair(int64_t nb, const block_t *g, const uint8_t *act, size_t astride, const int T,  \
                                     float *out, size_t ostride) {                                               \
        R8Z_PAIR_BEGIN(act_t);                                                                                   \
        for (int64_t b = 0; b < nb; b++) r8z_##type##_pair_block(g, g + nb, b, a, T, acc);                       \
        R8Z_PAIR_END();                                                                                          \
    }                                                                                                            \
    R8_INLINE void r8z_##type##_quad1(int64_t nb, const block_t *const gs[4], const act_t *y, float *const os[4]) { \
        const act_t *const a[1] = {y};                                                                           \
        __m512 acc[2][1] = {{_mm512_setzero_ps()}, {_mm512_setzero_ps()}};                                       \
        for (int64_t b = 0; b < nb; b++)                                                                         \
            R8_UNROLL for (int p = 0; p < 2; p++) r8z_##type##_pair_block(gs[2 * p], gs[2 * p + 1], b, a, 1, acc[p]); \
        R8_UNROLL for (int p = 0; p < 2; p++) {                                                                  \
            _mm256_storeu_ps(os[2 * p], _mm512_castps512_ps256(acc[p][0]));                                      \
            _mm256_storeu_ps(os[2 * p + 1], _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[p][0]), 1))); \
        }                                                                                                        \
    }

/* q4_0: r8_q4_0_group's steps on 16 lanes. */
R8_INLINE void r8z_q4_0_pair_block(const block_q4_0x8 *g, const block_q4_0x8 *h, int64_t b, const act_q8 *const *a,
                                   const int T, __m512 *acc) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    r8_prefetch_q4_0(&g[b]);
    r8_prefetch_q4_0(&h[b]);
    const __m512 dw = z_f16x2(g[b].d, h[b].d);
    __m512i lo[4], hi[4];
    R8_UNROLL for (int j = 0; j < 4; j++) {
        const __m512i v = z_load2(g[b].qs + 32 * j, h[b].qs + 32 * j);
        lo[j] = _mm512_and_si512(v, m4);
        hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
    R8_UNROLL for (int t = 0; t < T; t++) {
        const act_q8 *y = a[t] + b;
        const __m512 tt =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(z_block_sum(lo, hi, y->qs)), _mm512_set1_ps(y->d), _mm512_set1_ps(y->s * -8.0f));
        acc[t] = _mm512_fmadd_ps(tt, dw, acc[t]);
    }
}
R8Z_PAIR_KERNELS(q4_0, block_q4_0x8, act_q8)

/* q4_0, one token (decode): one group, two consecutive blocks per zmm (lanes
 * 0-7 block b's rows, 8-15 block b + 1's), so the weights stay one stream per
 * thread (a pair of groups is two, which read DRAM slower) while each vpdpbusd does the work of two 256-bit ones. The
 * activation pieces come from one load of both blocks' quants by vpermd.
 * Per lane the group kernel's integer sum and float steps; the two blocks
 * meet the accumulator in order (block b's fma, then b + 1's), so the bits
 * are the group kernel's. */
R8_INLINE __m512i z_piece(__m512i q, int k) { /* dword k of each half, across that half */
    return _mm512_permutexvar_epi32(_mm512_inserti64x4(_mm512_set1_epi32(k), _mm256_set1_epi32(8 + k), 1), q);
}

R8_INLINE __m512 z_set2(float a, float b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(a)), _mm256_set1_ps(b), 1);
}

R8_INLINE void r8z_q4_0_one(int64_t nb, const block_q4_0x8 *g, const act_q8 *y, float *out) {
    __m256 acc = _mm256_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        r8_prefetch_q4_0(&g[b]);
        r8_prefetch_q4_0(&g[b + 1]);
        const __m512 dw = z_f16x2(g[b].d, g[b + 1].d);
        const __m512i q = z_load2(y[b].qs, y[b + 1].qs);
        __m512i s = _mm512_setzero_si512(), u = _mm512_setzero_si512();
        R8_UNROLL for (int j = 0; j < 4; j++) {
            const __m512i v = z_load2(g[b].qs + 32 * j, g[b + 1].qs + 32 * j);
            s = _mm512_dpbusd_epi32(s, _mm512_and_si512(v, m4), z_piece(q, 2 * j));
            u = _mm512_dpbusd_epi32(u, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4), z_piece(q, 2 * j + 1));
        }
        const __m512 tt = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s, u)), z_set2(y[b].d, y[b + 1].d),
                                          z_set2(y[b].s * -8.0f, y[b + 1].s * -8.0f));
        acc = _mm256_fmadd_ps(_mm512_castps512_ps256(tt), _mm512_castps512_ps256(dw), acc);
        acc = _mm256_fmadd_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(tt), 1)),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(dw), 1)), acc);
    }
    if (b < nb) { /* an odd last block: the group kernel's step */
        __m256i lo[4], hi[4];
        r8_nibbles(g[b].qs, lo, hi);
        acc = r8_q4_0_step(r8_block_sum(lo, hi, y[b].qs), &y[b], _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g[b].d)), acc);
    }
    _mm256_storeu_ps(out, acc);
}

/* q8_0: vpdpbusd wants one unsigned side, so the weights go in as w + 128
 * (a flipped top bit) and the exact sum P = sum (w + 128) q - 128 sum q comes
 * back per token with one subtraction of the activation block's qsum128
 * (made once per row when it is quantized: computing it here, per pair of
 * groups, took a quarter of the kernel's time), in place of |w| and
 * sign(q, w) per chunk; then r8_q8_0_groups' float steps:
 * acc = fma(P da, dw, acc). */
R8_INLINE void r8z_q8_0_pair_block(const block_q8_0x8 *g, const block_q8_0x8 *h, int64_t b, const act_q8 *const *a,
                                   const int T, __m512 *acc) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    R8_UNROLL for (int c = 0; c < 4; c++) {
        _mm_prefetch((const char *)&g[b] + R8_PREFETCH + 64 * c, _MM_HINT_T0);
        _mm_prefetch((const char *)&h[b] + R8_PREFETCH + 64 * c, _MM_HINT_T0);
    }
    __m512i s[R8_TOKENS];
    R8_UNROLL for (int t = 0; t < T; t++) s[t] = _mm512_setzero_si512();
    R8_UNROLL for (int j = 0; j < 8; j++) {
        const __m512i u = _mm512_xor_si512(z_load2(g[b].qs + 32 * j, h[b].qs + 32 * j), flip);
        R8_UNROLL for (int t = 0; t < T; t++) s[t] = _mm512_dpbusd_epi32(s[t], u, z_bcast4(a[t][b].qs + 4 * j));
    }
    const __m512 dw = z_f16x2(g[b].d, h[b].d);
    R8_UNROLL for (int t = 0; t < T; t++) {
        const __m512i p = _mm512_sub_epi32(s[t], _mm512_set1_epi32(a[t][b].qsum128));
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(a[t][b].d)), dw, acc[t]);
    }
}
R8Z_PAIR_KERNELS(q8_0, block_q8_0x8, act_q8)

/* Group 0's register in the low half, group 1's in the high half. */
R8_INLINE __m512i z_join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }

/* Block b's two sets of scale registers (NA of A, NB of B) as a 256-bit kernel
 * decodes them (DECODE: r8_q4_k_scales or r8_q6_k_scales), for groups g and h
 * joined into 16 lanes. */
#define R8Z_SCALES(DECODE, NA, A, NB, B)                                                       \
    do {                                                                                       \
        __m256i ga_[NA], gb_[NB], ha_[NA], hb_[NB];                                            \
        DECODE(&g[b], ga_, gb_);                                                               \
        DECODE(&h[b], ha_, hb_);                                                               \
        R8_UNROLL for (int i_ = 0; i_ < (NA); i_++) A[i_] = z_join(ga_[i_], ha_[i_]);          \
        R8_UNROLL for (int i_ = 0; i_ < (NB); i_++) B[i_] = z_join(gb_[i_], hb_[i_]);          \
    } while (0)

/* r8_q4_k_scales' bytes kept in registers for the one-token kernel: scp[p] =
 * the scales of sub-blocks 2p and 2p + 1 (byte 8i + r: row r's scale 2p + i),
 * mn32 as r8_q4_k_scales gives it (lane r: row r's mins 2p and 2p + 1 as
 * i16s), without the round trip through the stack. */
R8_INLINE void r8z_q4_k_scales_one(const block_q4_kx8 *g, __m128i scp[4], __m256i mn32[4]) {
    __m256i b[4];
    r8_q4_k_scale_bytes(g, b);
    R8_UNROLL for (int p = 0; p < 4; p++) {
        const __m256i sc = b[p / 2], mn = b[2 + p / 2];
        scp[p] = p % 2 ? _mm256_extracti128_si256(sc, 1) : _mm256_castsi256_si128(sc);
        const __m128i m = p % 2 ? _mm256_extracti128_si256(mn, 1) : _mm256_castsi256_si128(mn);
        mn32[p] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, _mm_srli_si128(m, 8)));
    }
}

/* Super-block b's scales of groups g and h as 16 lanes (sc[j] lane r: row
 * r's scale j, g's rows then h's) and their mins as pairs of i16s (mn32[p]
 * lane r: mins 2p and 2p + 1), decoded for both groups at once in 512-bit
 * registers (r8_q4_k_scale_bytes' bytes, g's in the low half, h's in the
 * high), then per sub-block one qword permute and one widening: 48 vector
 * instructions where two 256-bit decodes and their joins took 84. */
R8_INLINE void r8z_q4_k_scales_pair(const block_q4_kx8 *g, const block_q4_kx8 *h, __m512i sc[8], __m512i mn32[4]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(0x03);
    const __m512i l = z_load2(g->sc_lo, h->sc_lo), ml = z_load2(g->m_lo, h->m_lo), hb = z_load2(g->hi, h->hi);
    __m512i b[4];
    R8_Q4_K_SCALE_BYTES(_mm512, si512, l, ml, hb, m4, m3, b);
    R8_UNROLL for (int j = 0; j < 8; j++) { /* qwords j % 4 (g) and 4 + j % 4 (h) of b[j / 4] */
        const __m512i pick = _mm512_set_epi64(0, 0, 0, 0, 0, 0, 4 + j % 4, j % 4);
        sc[j] = _mm512_cvtepu8_epi32(_mm512_castsi512_si128(_mm512_permutexvar_epi64(pick, b[j / 4])));
    }
    R8_UNROLL for (int k = 0; k < 2; k++) {
        /* 128-bit lane i of t: mins 2p and 2p + 1 of each row, interleaved (p = 2k + i % 2; g's for i < 2) */
        const __m512i t = _mm512_unpacklo_epi8(b[2 + k], _mm512_unpackhi_epi64(b[2 + k], b[2 + k]));
        mn32[2 * k] = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(_mm512_shuffle_i32x4(t, t, 0x08))); /* lanes 0, 2 */
        mn32[2 * k + 1] = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(_mm512_shuffle_i32x4(t, t, 0x0D))); /* 1, 3 */
    }
}

/* Sub-block chunks of groups g and h side by side (qg, qh: 128 bytes each,
 * q4_kx8's order), prefetched R8_PREFETCH ahead and split into their low
 * (lo[c]) and high (hi[c]) nibbles. */
R8_INLINE void z_nibbles2(const uint8_t *qg, const uint8_t *qh, __m512i lo[4], __m512i hi[4]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    _mm_prefetch((const char *)qg + R8_PREFETCH, _MM_HINT_T0);
    _mm_prefetch((const char *)qg + R8_PREFETCH + 64, _MM_HINT_T0);
    _mm_prefetch((const char *)qh + R8_PREFETCH, _MM_HINT_T0);
    _mm_prefetch((const char *)qh + R8_PREFETCH + 64, _MM_HINT_T0);
    R8_UNROLL for (int c = 0; c < 4; c++) {
        const __m512i v = z_load2(qg + 32 * c, qh + 32 * c);
        lo[c] = _mm512_and_si512(v, m4);
        hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
}

/* r8_min_step on 16 lanes. */
R8_INLINE __m512 z_min_step(__m512i s1, const block_q8_k *y, const __m512i *mn, const int np, __m512 d, __m512 dmin,
                            __m512 acc) {
    __m512i s2 = _mm512_setzero_si512();
    R8_UNROLL for (int p = 0; p < np; p++) s2 = _mm512_dpwssd_epi32(s2, mn[p], z_bcast4((const int8_t *)(y->bsums + 2 * p)));
    const __m512 da = _mm512_set1_ps(y->d);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(d, da), acc);
    return _mm512_fnmadd_ps(_mm512_cvtepi32_ps(s2), _mm512_mul_ps(dmin, da), acc);
}

/* q4_k's (and q5_k's) float steps of super-block b for groups g and h, from
 * each token's integer sums s1[t] and the mins mn32: the mins against the
 * activation's 32-element sums (q8_k_sums32), then acc += S1 d da, acc -=
 * S2 dmin da. */
R8_INLINE void r8z_q4_k_steps(const block_q4_kx8 *g, const block_q4_kx8 *h, int64_t b, const block_q8_k *const *a,
                              const int T, const __m512i *s1, const __m512i mn32[4], __m512 *acc) {
    const __m512 d = z_f16x2(g->d, h->d), dmin = z_f16x2(g->dmin, h->dmin);
    R8_UNROLL for (int t = 0; t < T; t++) acc[t] = z_min_step(s1[t], &a[t][b], mn32, 4, d, dmin, acc[t]);
}

/* q4_k: r8_q4_k_group's integer sums and float steps on 16 lanes. Each
 * sub-block's sums of its low and of its high nibbles (each <= 16 x 15 x 127,
 * an i16 in its i32 lane) meet its scale (< 64 in the low i16 half, the high
 * half zero) in one vpdpwssd each: S1 = sum_j sc_j P_j, exact, the integer of
 * the 256-bit kernel, two one-uop instructions where an add and a vpmulld
 * (two uops, ten cycles' latency on the Xeon) took three. */
R8_INLINE void r8z_q4_k_pair_block(const block_q4_kx8 *g, const block_q4_kx8 *h, int64_t b, const block_q8_k *const *a,
                                   const int T, __m512 *acc) {
    __m512i sc[8], mn32[4], s1[R8_TOKENS];
    r8_prefetch_head(&g[b], offsetof(block_q4_kx8, qs));
    r8_prefetch_head(&h[b], offsetof(block_q4_kx8, qs));
    r8z_q4_k_scales_pair(&g[b], &h[b], sc, mn32);
    R8_UNROLL for (int t = 0; t < T; t++) s1[t] = _mm512_setzero_si512();
    for (int j = 0; j < 8; j++) {
        __m512i lo[4], hi[4];
        z_nibbles2(g[b].qs + 128 * j, h[b].qs + 128 * j, lo, hi);
        R8_UNROLL for (int t = 0; t < T; t++) {
            __m512i ps, pu;
            z_block_halves(lo, hi, a[t][b].qs + 32 * j, &ps, &pu);
            s1[t] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(s1[t], ps, sc[j]), pu, sc[j]);
        }
    }
    r8z_q4_k_steps(&g[b], &h[b], b, a, T, s1, mn32, acc);
}
R8Z_PAIR_KERNELS(q4_k, block_q4_kx8, block_q8_k)

/* r8_shift16 at 512 bits. */
R8_INLINE __m512i z_shift16(__m512i h, const int k) {
    return k > 0 ? _mm512_slli_epi16(h, (unsigned)k) : k < 0 ? _mm512_srli_epi16(h, (unsigned)-k) : h;
}

/* Each element's fifth bit from hb (bit 2c / 2c + 1 of the byte, q5_kx8's
 * order for one sub-block, q5_0x8's for one block) or-ed in at bit 4 of its
 * nibble lo[c] / hi[c]: one vpternlogd each (0xF8: a | (b & c)). */
R8_INLINE void z_fifth_bits(__m512i hb, __m512i lo[4], __m512i hi[4]) {
    const __m512i m10 = _mm512_set1_epi8(0x10);
    R8_UNROLL for (int c = 0; c < 4; c++) {
        lo[c] = _mm512_ternarylogic_epi32(lo[c], z_shift16(hb, 4 - 2 * c), m10, 0xF8);
        hi[c] = _mm512_ternarylogic_epi32(hi[c], z_shift16(hb, 3 - 2 * c), m10, 0xF8);
    }
}

/* q5_k: q4_k's pair step with each element's fifth bit or-ed in at bit 4
 * (one vpternlogd: nibble | (shifted qh & 0x10)); P <= 32 x 31 x 127 whole
 * from vpdpbusd, S1 <= 8 x 63 x P: exact, the reference's integers. */
R8_INLINE void r8z_q5_k_pair_block(const block_q5_kx8 *g, const block_q5_kx8 *h, int64_t b, const block_q8_k *const *a,
                                   const int T, __m512 *acc) {
    __m512i sc[8], mn32[4], s1[R8_TOKENS];
    r8_prefetch_head(&g[b], offsetof(block_q4_kx8, qs));
    r8_prefetch_head(&h[b], offsetof(block_q4_kx8, qs));
    r8z_q4_k_scales_pair(&g[b].lo, &h[b].lo, sc, mn32);
    R8_UNROLL for (int t = 0; t < T; t++) s1[t] = _mm512_setzero_si512();
    for (int j = 0; j < 8; j++) {
        const uint8_t *bg = g[b].qh + 32 * j, *bh = h[b].qh + 32 * j;
        if (j % 2 == 0) { /* a line holds two sub-blocks' fifth bits */
            _mm_prefetch((const char *)bg + R8_PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)bh + R8_PREFETCH, _MM_HINT_T0);
        }
        const __m512i hb = z_load2(bg, bh);
        __m512i lo[4], hi[4];
        z_nibbles2(g[b].lo.qs + 128 * j, h[b].lo.qs + 128 * j, lo, hi);
        z_fifth_bits(hb, lo, hi);
        R8_UNROLL for (int t = 0; t < T; t++)
            s1[t] = _mm512_add_epi32(s1[t], _mm512_mullo_epi32(z_block_sum(lo, hi, a[t][b].qs + 32 * j), sc[j]));
    }
    r8z_q4_k_steps(&g[b].lo, &h[b].lo, b, a, T, s1, mn32, acc);
}
R8Z_PAIR_KERNELS(q5_k, block_q5_kx8, block_q8_k)

#endif /* QUANT_VNNI */

/* --- iq4_xs ----------------------------------------------------------------
 * Each nibble indexes r8_iq4_table by vpshufb. Under VNNI a sub-block's sum
 * comes back as P' = P + 128 S_j, S_j the activation's sum over it (bsums[2j]
 * + bsums[2j + 1]), and per row and token S = sum_j (sc_j - 32) P'_j - 128
 * sum_j (sc_j - 32) S_j; under AVX2 P comes whole from r8_signed_block_sum
 * and S = sum_j (sc_j - 32) P_j. Either is the reference's exact integer
 * (|S| < 2^28); then acc = fma(S, d da, acc).
 *
 * The scale bytes (0..63) of an iq4_xsx8 super-block, r8_q4_k_scale_bytes'
 * arrangement: b[0] byte k = entry k, b[1] byte k = entry 32 + k. The top
 * bits of entries k and k + 16 share sc_hi[k % 16], so sc_hi sits in both
 * 128-bit lanes of hb and each lane shifts its own pair of bits down (m4_ /
 * m3_: bytes 0x0F / 0x03). */
#define R8_IQ4_XS_SCALE_BYTES(P, S, l, hb, cnt_lo, cnt_hi, m4_, m3_, b)                                             \
    do {                                                                                                          \
        b[0] = P##_or_##S(P##_and_##S(l, m4_), P##_slli_epi16(P##_and_##S(P##_srlv_epi32(hb, cnt_lo), m3_), 4)); \
        b[1] = P##_or_##S(P##_and_##S(P##_srli_epi16(l, 4), m4_),                                              \
                          P##_slli_epi16(P##_and_##S(P##_srlv_epi32(hb, cnt_hi), m3_), 4));                    \
    } while (0)

/* Lane r of sc[j]: row r's scale j minus 32. */
R8_INLINE void r8_iq4_xs_scales(const block_iq4_xsx8 *g, __m256i sc[8]) {
    const __m256i l = _mm256_loadu_si256((const __m256i *)g->sc_lo),
                  hb = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)g->sc_hi));
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x03);
    __m256i b[2];
    R8_IQ4_XS_SCALE_BYTES(_mm256, si256, l, hb, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2),
                          _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6), m4, m3, b);
    uint8_t e[64];
    _mm256_storeu_si256((__m256i *)e, b[0]);
    _mm256_storeu_si256((__m256i *)(e + 32), b[1]);
    R8_UNROLL for (int j = 0; j < 8; j++)
        sc[j] = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(e + 8 * j))), _mm256_set1_epi32(32));
}

/* The scale as the same i16 in both halves of each lane, for vpdpwssd. */
#define R8_I16_PAIR(P, S, x) P##_or_##S(P##_and_##S(x, P##_set1_epi32(0xFFFF)), P##_slli_epi32(x, 16))

R8_INLINE void r8_iq4_xs_group(int64_t nb, const block_iq4_xsx8 *g, const uint8_t *act, size_t astride, const int T,
                               float *out, size_t ostride) {
    R8_GROUP_BEGIN(block_q8_k);
    const __m256i m4 = _mm256_set1_epi8(0x0F), tbl = r8_iq4_table();
    for (int64_t b = 0; b < nb; b++) {
        __m256i sc[8], s1[R8_TOKENS];
#ifdef QUANT_VNNI
        __m256i s2[R8_TOKENS];
        R8_UNROLL for (int t = 0; t < T; t++) s2[t] = _mm256_setzero_si256();
#endif
        r8_prefetch_head(&g[b], offsetof(block_iq4_xsx8, qs));
        r8_iq4_xs_scales(&g[b], sc);
        R8_UNROLL for (int t = 0; t < T; t++) s1[t] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const uint8_t *qs = g[b].qs + 128 * j;
            _mm_prefetch((const char *)qs + R8_PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)qs + R8_PREFETCH + 64, _MM_HINT_T0);
            __m256i lo[4], hi[4];
            R8_UNROLL for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                lo[c] = _mm256_shuffle_epi8(tbl, _mm256_and_si256(v, m4));
                hi[c] = _mm256_shuffle_epi8(tbl, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
            }
#ifdef QUANT_VNNI
            const __m256i scp = R8_I16_PAIR(_mm256, si256, sc[j]);
            R8_UNROLL for (int t = 0; t < T; t++) {
                s1[t] = _mm256_add_epi32(s1[t], _mm256_mullo_epi32(r8_block_sum(lo, hi, a[t][b].qs + 32 * j), sc[j]));
                s2[t] = _mm256_dpwssd_epi32(s2[t], scp, bcast4((const int8_t *)(a[t][b].bsums + 2 * j)));
            }
#else
            R8_UNROLL for (int t = 0; t < T; t++)
                s1[t] = _mm256_add_epi32(s1[t],
                                         _mm256_mullo_epi32(r8_signed_block_sum(lo, hi, a[t][b].qs + 32 * j), sc[j]));
#endif
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g[b].d));
        R8_UNROLL for (int t = 0; t < T; t++) {
#ifdef QUANT_VNNI
            const __m256i sum = _mm256_sub_epi32(s1[t], _mm256_slli_epi32(s2[t], 7));
#else
            const __m256i sum = s1[t];
#endif
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(a[t][b].d)), acc[t]);
        }
    }
    R8_GROUP_END();
}

#ifdef QUANT_VNNI

/* r8_iq4_xs_group's step on 16 lanes: groups g and h. */
R8_INLINE void r8z_iq4_xs_pair_block(const block_iq4_xsx8 *g, const block_iq4_xsx8 *h, int64_t b,
                                     const block_q8_k *const *a, const int T, __m512 *acc) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), tbl = _mm512_broadcast_i32x4(_mm256_castsi256_si128(r8_iq4_table()));
    __m512i sc[8], s1[R8_TOKENS], s2[R8_TOKENS];
    r8_prefetch_head(&g[b], offsetof(block_iq4_xsx8, qs));
    r8_prefetch_head(&h[b], offsetof(block_iq4_xsx8, qs));
    {
        const __m512i l = z_load2(g[b].sc_lo, h[b].sc_lo);
        const __m512i hb = z_join(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)g[b].sc_hi)),
                                  _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)h[b].sc_hi)));
        const __m256i c02 = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2), c46 = _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6);
        __m512i bytes[2];
        R8_IQ4_XS_SCALE_BYTES(_mm512, si512, l, hb, z_join(c02, c02), z_join(c46, c46), m4, _mm512_set1_epi8(0x03), bytes);
        R8_UNROLL for (int j = 0; j < 8; j++) { /* qwords j % 4 (g) and 4 + j % 4 (h) of bytes[j / 4] */
            const __m512i pick = _mm512_set_epi64(0, 0, 0, 0, 0, 0, 4 + j % 4, j % 4);
            sc[j] = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm512_castsi512_si128(_mm512_permutexvar_epi64(pick, bytes[j / 4]))),
                                     _mm512_set1_epi32(32));
        }
    }
    R8_UNROLL for (int t = 0; t < T; t++) s1[t] = s2[t] = _mm512_setzero_si512();
    for (int j = 0; j < 8; j++) {
        __m512i lo[4], hi[4];
        z_nibbles2(g[b].qs + 128 * j, h[b].qs + 128 * j, lo, hi);
        R8_UNROLL for (int c = 0; c < 4; c++) {
            lo[c] = _mm512_shuffle_epi8(tbl, lo[c]);
            hi[c] = _mm512_shuffle_epi8(tbl, hi[c]);
        }
        const __m512i scp = R8_I16_PAIR(_mm512, si512, sc[j]);
        R8_UNROLL for (int t = 0; t < T; t++) {
            s1[t] = _mm512_add_epi32(s1[t], _mm512_mullo_epi32(z_block_sum(lo, hi, a[t][b].qs + 32 * j), sc[j]));
            s2[t] = _mm512_dpwssd_epi32(s2[t], scp, z_bcast4((const int8_t *)(a[t][b].bsums + 2 * j)));
        }
    }
    const __m512 d = z_f16x2(g[b].d, h[b].d);
    R8_UNROLL for (int t = 0; t < T; t++) {
        const __m512i sum = _mm512_sub_epi32(s1[t], _mm512_slli_epi32(s2[t], 7));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(a[t][b].d)), acc[t]);
    }
}
R8Z_PAIR_KERNELS(iq4_xs, block_iq4_xsx8, block_q8_k)

/* q4_k, one token (decode): one group, two neighbouring sub-blocks per zmm
 * (lanes 0-7 sub-block j's rows, 8-15 sub-block j + 1's; their quants and the
 * activation's are adjacent), one weight stream per thread as r8z_q4_0_one.
 * Each sub-block's exact sum P meets its scale by vpmulld; the two halves add
 * to r8_q4_k_group's integer S1 (exact, so in any order), then its float steps:
 * the same bits. */
R8_INLINE void r8z_q4_k_one(int64_t nb, const block_q4_kx8 *g, const block_q8_k *y, float *out) {
    __m256 acc = _mm256_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        __m128i scp[4];
        __m256i mn32[4];
        r8_prefetch_head(&g[b], offsetof(block_q4_kx8, qs));
        r8z_q4_k_scales_one(&g[b], scp, mn32);
        __m512i s1 = _mm512_setzero_si512();
        R8_UNROLL for (int j = 0; j < 8; j += 2) {
            const uint8_t *qs = g[b].qs + 128 * j;
            R8_UNROLL for (int l = 0; l < 4; l++) _mm_prefetch((const char *)qs + R8_PREFETCH + 64 * l, _MM_HINT_T0);
            const __m512i q = _mm512_loadu_si512((const void *)(y[b].qs + 32 * j));
            __m512i s = _mm512_setzero_si512(), u = _mm512_setzero_si512();
            R8_UNROLL for (int c = 0; c < 4; c++) {
                const __m512i v = z_load2(qs + 32 * c, qs + 128 + 32 * c);
                s = _mm512_dpbusd_epi32(s, _mm512_and_si512(v, m4), z_piece(q, 2 * c));
                u = _mm512_dpbusd_epi32(u, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4), z_piece(q, 2 * c + 1));
            }
            const __m512i sc = _mm512_cvtepu8_epi32(scp[j / 2]);
            s1 = _mm512_add_epi32(s1, _mm512_mullo_epi32(_mm512_add_epi32(s, u), sc));
        }
        const __m256i S1 = _mm256_add_epi32(_mm512_castsi512_si256(s1), _mm512_extracti64x4_epi64(s1, 1));
        acc = r8_min_step(S1, &y[b], mn32, 4, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g[b].d)),
                           _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g[b].dmin)), acc);
    }
    _mm256_storeu_ps(out, acc);
}

/* r8_offset_step on 16 lanes. */
R8_INLINE __m512 z_offset_step(__m512i s1, const __m512i scp[8], const block_q8_k *y, const int shift, __m512 d,
                               __m512 acc) {
    __m512i s2 = _mm512_setzero_si512();
    R8_UNROLL for (int p = 0; p < 8; p++) s2 = _mm512_dpwssd_epi32(s2, scp[p], z_bcast4((const int8_t *)(y->bsums + 2 * p)));
    const __m512i sum = _mm512_sub_epi32(s1, _mm512_slli_epi32(s2, shift));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(y->d)), acc);
}

/* q6_k: r8_q6_k_group's steps on 16 lanes. */
R8_INLINE void r8z_q6_k_pair_block(const block_q6_kx8 *g, const block_q6_kx8 *h, int64_t b, const block_q8_k *const *a,
                                   const int T, __m512 *acc) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(0x03);
    __m512i sc16[16], scp[8], s1[R8_TOKENS];
    r8_prefetch_head(&g[b], offsetof(block_q6_kx8, ql));
    r8_prefetch_head(&h[b], offsetof(block_q6_kx8, ql));
    R8Z_SCALES(r8_q6_k_scales, 16, sc16, 8, scp);
    R8_UNROLL for (int t = 0; t < T; t++) s1[t] = _mm512_setzero_si512();
    for (int j = 0; j < 8; j++) {
        const uint8_t *lg = g[b].ql + 128 * j, *hg = g[b].qh + 64 * j;
        const uint8_t *lh = h[b].ql + 128 * j, *hh = h[b].qh + 64 * j;
        _mm_prefetch((const char *)lg + R8_PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)lg + R8_PREFETCH + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)hg + R8_PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)lh + R8_PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)lh + R8_PREFETCH + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)hh + R8_PREFETCH, _MM_HINT_T0);
        R8_UNROLL for (int k = 0; k < 2; k++) {
            const __m512i q0 = z_load2(lg + 64 * k, lh + 64 * k), q1 = z_load2(lg + 64 * k + 32, lh + 64 * k + 32),
                          hb = z_load2(hg + 32 * k, hh + 32 * k);
            __m512i u[4];
            R8_Q6_K_UNPACK(_mm512, si512, q0, q1, hb, m4, m3, u);
            const __m512i sc = sc16[2 * j + k];
            R8_UNROLL for (int t = 0; t < T; t++) {
                const int8_t *q = a[t][b].qs + 32 * j + 16 * k;
                __m512i x, y;
                R8_Q6_K_SUMS16(_mm512, z_bcast4, u, q, x, y);
                s1[t] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(s1[t], x, sc), y, sc);
            }
        }
    }
    const __m512 d = z_f16x2(g[b].d, h[b].d);
    R8_UNROLL for (int t = 0; t < T; t++) acc[t] = z_offset_step(s1[t], scp, &a[t][b], 5, d, acc[t]);
}
R8Z_PAIR_KERNELS(q6_k, block_q6_kx8, block_q8_k)

/* Super-block b's scale registers of groups g and h decoded in 512-bit
 * registers (g's bytes in the low half, h's in the high) rather than as two
 * 256-bit decodes joined: sc16[k] lane r the scale of group k in the low i16
 * half, scp[p] the i16 pair of groups 2p and 2p + 1, as r8_q3_k_scales /
 * r8_q2_k_scales give them under VNNI (q2_k: mnp, its mins). */
R8_INLINE void r8z_q3_k_scales_pair(const block_q3_kx8 *g, const block_q3_kx8 *h, __m512i sc16[16], __m512i scp[8]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(0x03), k32 = _mm512_set1_epi8(32),
                  lo16 = _mm512_set1_epi32(0xFFFF);
    const __m512i l0 = z_load2(g->sc_lo, h->sc_lo), l1 = z_load2(g->sc_lo + 32, h->sc_lo + 32),
                  hb = z_load2(g->sc_hi, h->sc_hi);
    R8_UNROLL for (int m = 0; m < 4; m++) { /* entries 32 m .. 32 m + 31: groups 4 m .. 4 m + 3 */
        const __m512i l = m % 2 ? l1 : l0;
        const __m512i lo = m < 2 ? _mm512_and_si512(l, m4) : _mm512_and_si512(_mm512_srli_epi16(l, 4), m4);
        const __m512i hi = _mm512_and_si512(m ? _mm512_srli_epi16(hb, 2 * m) : hb, m3);
        const __m512i e = _mm512_sub_epi8(_mm512_or_si512(lo, _mm512_slli_epi16(hi, 4)), k32);
        R8_UNROLL for (int q = 0; q < 4; q++) { /* qwords q (g) and 4 + q (h) */
            const __m512i pick = _mm512_set_epi64(0, 0, 0, 0, 0, 0, 4 + q, q);
            sc16[4 * m + q] = _mm512_and_si512(
                _mm512_cvtepi8_epi32(_mm512_castsi512_si128(_mm512_permutexvar_epi64(pick, e))), lo16);
        }
    }
    R8_UNROLL for (int p = 0; p < 8; p++) scp[p] = _mm512_or_si512(sc16[2 * p], _mm512_slli_epi32(sc16[2 * p + 1], 16));
}

R8_INLINE void r8z_q2_k_scales_pair(const block_q2_kx8 *g, const block_q2_kx8 *h, __m512i sc16[16], __m512i mnp[8]) {
    const __m512i m4 = _mm512_set1_epi32(0x0F);
    __m512i mn[16];
    R8_UNROLL for (int k = 0; k < 16; k += 8) { /* groups k .. k + 7 of g and of h, 64 bytes each */
        const __m512i vg = _mm512_loadu_si512((const void *)(g->sc + 8 * k)),
                      vh = _mm512_loadu_si512((const void *)(h->sc + 8 * k));
        R8_UNROLL for (int q = 0; q < 8; q++) {
            const __m512i pick = _mm512_set_epi64(0, 0, 0, 0, 0, 0, 8 + q, q);
            const __m512i v = _mm512_cvtepu8_epi32(_mm512_castsi512_si128(_mm512_permutex2var_epi64(vg, pick, vh)));
            sc16[k + q] = _mm512_and_si512(v, m4);
            mn[k + q] = _mm512_srli_epi32(v, 4);
        }
    }
    R8_UNROLL for (int p = 0; p < 8; p++) mnp[p] = _mm512_or_si512(mn[2 * p], _mm512_slli_epi32(mn[2 * p + 1], 16));
}

/* r8_group16_sum's VNNI step on 16 lanes. */
R8_INLINE __m512i z_group16_sum(const __m512i u[4], const int8_t *aq, __m512i sc, __m512i s1) {
    __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], z_bcast4(aq));
    R8_UNROLL for (int c = 1; c < 4; c++) p = _mm512_dpbusd_epi32(p, u[c], z_bcast4(aq + 4 * c));
    return _mm512_dpwssd_epi32(s1, p, sc);
}

/* q3_k: r8_q3_k_group's VNNI steps on 16 lanes. */
R8_INLINE void r8z_q3_k_pair_block(const block_q3_kx8 *g, const block_q3_kx8 *h, int64_t b, const block_q8_k *const *a,
                                   const int T, __m512 *acc) {
    const __m512i m3 = _mm512_set1_epi8(0x03), b2 = _mm512_set1_epi8(0x04);
    __m512i sc16[16], scp[8], s1[R8_TOKENS];
    r8_prefetch_head(&g[b], offsetof(block_q3_kx8, qs));
    r8_prefetch_head(&h[b], offsetof(block_q3_kx8, qs));
    r8z_q3_k_scales_pair(&g[b], &h[b], sc16, scp);
    R8_UNROLL for (int t = 0; t < T; t++) s1[t] = _mm512_setzero_si512();
    for (int j = 0; j < 8; j++) {
        const uint8_t *qg = g[b].qs + 64 * j, *hg = g[b].hm + 32 * j;
        const uint8_t *qh = h[b].qs + 64 * j, *hh = h[b].hm + 32 * j;
        _mm_prefetch((const char *)qg + R8_PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)qh + R8_PREFETCH, _MM_HINT_T0);
        if (j % 2 == 0) {
            _mm_prefetch((const char *)hg + R8_PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)hh + R8_PREFETCH, _MM_HINT_T0);
        }
        const __m512i hb = z_load2(hg, hh);
        R8_UNROLL for (int k = 0; k < 2; k++) {
            const __m512i q = z_load2(qg + 32 * k, qh + 32 * k);
            __m512i u[4];
            R8_Q3_K_UNPACK(_mm512, si512, z_shift16, q, hb, k, m3, b2, u);
            const __m512i sc = sc16[2 * j + k];
            R8_UNROLL for (int t = 0; t < T; t++) s1[t] = z_group16_sum(u, a[t][b].qs + 32 * j + 16 * k, sc, s1[t]);
        }
    }
    const __m512 d = z_f16x2(g[b].d, h[b].d);
    R8_UNROLL for (int t = 0; t < T; t++) acc[t] = z_offset_step(s1[t], scp, &a[t][b], 2, d, acc[t]);
}
R8Z_PAIR_KERNELS(q3_k, block_q3_kx8, block_q8_k)

/* q2_k: r8_q2_k_group's VNNI steps on 16 lanes. */
R8_INLINE void r8z_q2_k_pair_block(const block_q2_kx8 *g, const block_q2_kx8 *h, int64_t b, const block_q8_k *const *a,
                                   const int T, __m512 *acc) {
    const __m512i m3 = _mm512_set1_epi8(0x03);
    __m512i sc16[16], mnp[8], s1[R8_TOKENS];
    r8_prefetch_head(&g[b], offsetof(block_q2_kx8, qs));
    r8_prefetch_head(&h[b], offsetof(block_q2_kx8, qs));
    r8z_q2_k_scales_pair(&g[b], &h[b], sc16, mnp);
    R8_UNROLL for (int t = 0; t < T; t++) s1[t] = _mm512_setzero_si512();
    for (int j = 0; j < 8; j++) {
        const uint8_t *qg = g[b].qs + 64 * j, *qh = h[b].qs + 64 * j;
        _mm_prefetch((const char *)qg + R8_PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)qh + R8_PREFETCH, _MM_HINT_T0);
        R8_UNROLL for (int k = 0; k < 2; k++) {
            const __m512i q = z_load2(qg + 32 * k, qh + 32 * k);
            __m512i u[4];
            R8_Q2_K_UNPACK(_mm512, si512, q, m3, u);
            const __m512i sc = sc16[2 * j + k];
            R8_UNROLL for (int t = 0; t < T; t++) s1[t] = z_group16_sum(u, a[t][b].qs + 32 * j + 16 * k, sc, s1[t]);
        }
    }
    const __m512 d = z_f16x2(g[b].d, h[b].d), dmin = z_f16x2(g[b].dmin, h[b].dmin);
    R8_UNROLL for (int t = 0; t < T; t++) acc[t] = z_min_step(s1[t], &a[t][b], mnp, 8, d, dmin, acc[t]);
}
R8Z_PAIR_KERNELS(q2_k, block_q2_kx8, block_q8_k)
#endif /* QUANT_VNNI */

/* --- the other 32-element types: q4_1, q5_0, q5_1 and iq4_nl ---------------
 * q4_0's frame with each type's values and float steps: VALUES says how a
 * block's chunks become bytes (R8_B32_NIB: the nibbles; R8_B32_Q5: with the
 * fifth bit at bit 4, as q5_k's; R8_B32_NL: r8_iq4_table's values by vpshufb,
 * under AVX2 signed, summed by r8_signed_block_sum), STEP the reference's float
 * steps per block (ref/r8.c): R8_B32_OFF16 (q5_0) t = fma(P, da, -16 s),
 * acc = fma(t, dw, acc); R8_B32_MIN (q4_1, q5_1) acc = fma(P da, dw, acc),
 * acc = fma(m, s, acc); R8_B32_EXACT (iq4_nl) P (under VNNI less the
 * activation's qsum128: R8_NL_EXACT), acc = fma(P da, dw, acc). Under AVX2 a
 * 5-bit block sums its low and its high chunks apart in i16 (r8_half_sum16:
 * 4 x 2 x 31 x 127 each). */
enum { R8_B32_NIB, R8_B32_Q5, R8_B32_NL };
enum { R8_B32_OFF16, R8_B32_MIN, R8_B32_EXACT };

/* A 32-element r8 block's fields (m, qh NULL where the type has none). */
typedef struct {
    const uint16_t *d, *m;
    const uint8_t *qh, *qs;
} r8_b32_view;
R8_INLINE r8_b32_view r8_view_q4_1(const block_q4_1x8 *x) { return (r8_b32_view){x->d, x->m, NULL, x->qs}; }
R8_INLINE r8_b32_view r8_view_q5_0(const block_q5_0x8 *x) { return (r8_b32_view){x->d, NULL, x->qh, x->qs}; }
R8_INLINE r8_b32_view r8_view_q5_1(const block_q5_1x8 *x) { return (r8_b32_view){x->d, x->m, x->qh, x->qs}; }
R8_INLINE r8_b32_view r8_view_iq4_nl(const block_iq4_nlx8 *x) { return (r8_b32_view){x->d, NULL, NULL, x->qs}; }

R8_INLINE void r8_b32_values(const r8_b32_view v, const int values, __m256i lo[4], __m256i hi[4]) {
    if (values == R8_B32_Q5) {
        r8_q5_nibbles(v.qs, v.qh, lo, hi);
        return;
    }
    r8_nibbles(v.qs, lo, hi);
    if (values == R8_B32_NL) {
        const __m256i tbl = r8_iq4_table();
        R8_UNROLL for (int c = 0; c < 4; c++) {
            lo[c] = _mm256_shuffle_epi8(tbl, lo[c]);
            hi[c] = _mm256_shuffle_epi8(tbl, hi[c]);
        }
    }
}

R8_INLINE __m256i r8_b32_sum(const __m256i lo[4], const __m256i hi[4], const int8_t *q, const int values) {
#ifndef QUANT_VNNI
    if (values == R8_B32_Q5) {
        const __m256i ones = _mm256_set1_epi16(1);
        return _mm256_add_epi32(_mm256_madd_epi16(r8_half_sum16(lo, q, 0), ones),
                                _mm256_madd_epi16(r8_half_sum16(hi, q, 4), ones));
    }
    if (values == R8_B32_NL) return r8_signed_block_sum(lo, hi, q);
#endif
    (void)values;
    return r8_block_sum(lo, hi, q);
}

#define R8_B32_STEP(P, p, y, dw, mw, step, acc)                                                                 \
    ((step) == R8_B32_OFF16                                                                                     \
         ? P##_fmadd_ps(P##_fmadd_ps(P##_cvtepi32_ps(p), P##_set1_ps((y)->d), P##_set1_ps((y)->s * -16.0f)), dw, acc) \
     : (step) == R8_B32_MIN                                                                                     \
         ? P##_fmadd_ps(mw, P##_set1_ps((y)->s), P##_fmadd_ps(P##_mul_ps(P##_cvtepi32_ps(p), P##_set1_ps((y)->d)), dw, acc)) \
         : P##_fmadd_ps(P##_mul_ps(P##_cvtepi32_ps(R8_NL_EXACT(P, p, y)), P##_set1_ps((y)->d)), dw, acc))

/* A type's group kernel (every ISA its VALUES allows). */
#define R8_B32_GROUP(type, block_t, VALUES, STEP)                                                               \
    R8_INLINE void r8_##type##_group(int64_t nb, const block_t *g, const uint8_t *act, size_t astride, const int T, \
                                     float *out, size_t ostride) {                                              \
        R8_GROUP_BEGIN(act_q8);                                                                                 \
        for (int64_t b = 0; b < nb; b++) {                                                                      \
            const r8_b32_view v = r8_view_##type(&g[b]);                                                        \
            r8_prefetch_head(&g[b], sizeof(block_t));                                                           \
            __m256i lo[4], hi[4];                                                                               \
            r8_b32_values(v, VALUES, lo, hi);                                                                   \
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)v.d));                          \
            const __m256 mw = v.m ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)v.m)) : _mm256_setzero_ps(); \
            R8_UNROLL for (int t = 0; t < T; t++)                                                               \
                acc[t] = R8_B32_STEP(_mm256, r8_b32_sum(lo, hi, a[t][b].qs, VALUES), &a[t][b], dw, mw, STEP, acc[t]); \
        }                                                                                                       \
        R8_GROUP_END();                                                                                         \
    }
R8_B32_GROUP(q4_1, block_q4_1x8, R8_B32_NIB, R8_B32_MIN)
R8_B32_GROUP(q5_0, block_q5_0x8, R8_B32_Q5, R8_B32_OFF16)
R8_B32_GROUP(q5_1, block_q5_1x8, R8_B32_Q5, R8_B32_MIN)
R8_B32_GROUP(iq4_nl, block_iq4_nlx8, R8_B32_NL, R8_B32_EXACT)

#ifdef QUANT_VNNI

/* A type's 512-bit pair step: the group kernel's on 16 lanes. */
#define R8Z_B32_PAIR(type, block_t, VALUES, STEP)                                                               \
    R8_INLINE void r8z_##type##_pair_block(const block_t *g, const block_t *h, int64_t b, const act_q8 *const *a, \
                                           const int T, __m512 *acc) {                                          \
        const r8_b32_view vg = r8_view_##type(&g[b]), vh = r8_view_##type(&h[b]);                               \
        r8_prefetch_head(&g[b], offsetof(block_t, qs));                                                         \
        r8_prefetch_head(&h[b], offsetof(block_t, qs));                                                         \
        __m512i lo[4], hi[4];                                                                                   \
        z_nibbles2(vg.qs, vh.qs, lo, hi);                                                                       \
        if ((VALUES) == R8_B32_Q5) {                                                                            \
            z_fifth_bits(z_load2(vg.qh, vh.qh), lo, hi);                                                        \
        } else if ((VALUES) == R8_B32_NL) {                                                                     \
            const __m512i tbl = _mm512_broadcast_i32x4(_mm256_castsi256_si128(r8_iq4_table()));                 \
            R8_UNROLL for (int c = 0; c < 4; c++) {                                                             \
                lo[c] = _mm512_shuffle_epi8(tbl, lo[c]);                                                        \
                hi[c] = _mm512_shuffle_epi8(tbl, hi[c]);                                                        \
            }                                                                                                   \
        }                                                                                                       \
        const __m512 dw = z_f16x2(vg.d, vh.d), mw = vg.m ? z_f16x2(vg.m, vh.m) : _mm512_setzero_ps();           \
        R8_UNROLL for (int t = 0; t < T; t++)                                                                   \
            acc[t] = R8_B32_STEP(_mm512, z_block_sum(lo, hi, a[t][b].qs), &a[t][b], dw, mw, STEP, acc[t]);      \
    }                                                                                                           \
    R8Z_PAIR_KERNELS(type, block_t, act_q8)
R8Z_B32_PAIR(q4_1, block_q4_1x8, R8_B32_NIB, R8_B32_MIN)
R8Z_B32_PAIR(q5_0, block_q5_0x8, R8_B32_Q5, R8_B32_OFF16)
R8Z_B32_PAIR(q5_1, block_q5_1x8, R8_B32_Q5, R8_B32_MIN)
R8Z_B32_PAIR(iq4_nl, block_iq4_nlx8, R8_B32_NL, R8_B32_EXACT)
#endif

/* The exported kernel of a type: groups two at a time through PAIR_FN when
 * there are at least PAIR tokens, else one at a time; tokens R8_TOKENS at a
 * time, then the rest; the token count T compile-time in each call. A type
 * without a pair kernel names its group kernel as PAIR_FN with PAIR 0 (never
 * called). A single token is memory bound for most types, and one group at a
 * time (one weight stream per thread) streams closer to the machine's
 * bandwidth than a pair's two streams 9 KB apart, though the pair is faster in
 * cache: those types pair from two tokens. q6_k, q3_k and q2_k, whose single
 * group is compute bound, stream no better alone and pair from one. For one
 * token the VNNI build also has kernels that walk more groups at once
 * (quant_r8_walk): pairs for q4_0 and q8_0, and quads and spread quads for
 * every type, since more streams, and streams far apart, read DRAM faster on
 * the machines measured (BENCHMARKS.md). */
#define R8_PASS(type, TT, pair_fn)                                                                            \
    case TT:                                                                                                  \
        if (two) pair_fn(nb, g, at, act_stride, TT, ot, out_stride);                                          \
        else r8_##type##_group(nb, g, at, act_stride, TT, ot, out_stride);                                    \
        break;
#ifdef QUANT_VNNI
#define R8_PASS_WIDE(type, pair_fn) R8_PASS(type, 8, pair_fn) R8_PASS(type, 7, pair_fn) R8_PASS(type, 6, pair_fn) R8_PASS(type, 5, pair_fn)
#else
#define R8_PASS_WIDE(type, pair_fn)
#endif
#ifndef KVS_EMU_AVX512_H
#define R8_PASSES(type, pair_fn)                                                                              \
    switch (T) {                                                                                              \
    R8_PASS_WIDE(type, pair_fn)                                                                               \
    R8_PASS(type, 4, pair_fn)                                                                                 \
    R8_PASS(type, 3, pair_fn)                                                                                 \
    R8_PASS(type, 2, pair_fn)                                                                                 \
    default: R8_PASS(type, 1, pair_fn)                                                                        \
    }
#else
/* Under emulation (a KVS_EMU_AVX512 build: SIMDe, src/emu_avx512.h) one pass
 * with the token count at run time instead of one per count: the same source
 * and the same float steps, so the same bits, at a fraction of the compile
 * time (the emulated intrinsics made this file the longest of the CI build). */
#define R8_PASSES(type, pair_fn)                                                                              \
    if (two) pair_fn(nb, g, at, act_stride, T, ot, out_stride);                                               \
    else r8_##type##_group(nb, g, at, act_stride, T, ot, out_stride);
#endif
#define R8_KERNEL(name, type, block_t, QB, PAIR, pair_fn)                                                            \
    void R8_NAME(name)(int64_t n, const void *w, int n_groups, const void *act, size_t act_stride,       \
                            int n_act, float *out, size_t out_stride) {                                       \
        const int64_t nb = n / (QB);                                                                          \
        const uint8_t *ab = (const uint8_t *)act;                                                             \
        for (int gi = 0; gi < n_groups;) {                                                                    \
            const block_t *g = (const block_t *)w + (size_t)gi * (size_t)nb;                                  \
            const int two = (PAIR) && n_act >= (PAIR) && n_groups - gi >= 2;                               \
            float *o = out + 8 * (size_t)gi;                                                                  \
            for (int t = 0; t < n_act;) {                                                                     \
                const int T = n_act - t >= R8_TOKENS ? R8_TOKENS : n_act - t;                                 \
                const uint8_t *at = ab + (size_t)t * act_stride;                                              \
                float *ot = o + (size_t)t * out_stride;                                                       \
                R8_PASSES(type, pair_fn)                                                                      \
                t += T;                                                                                       \
            }                                                                                                 \
            gi += two ? 2 : 1;                                                                                \
        }                                                                                                     \
    }

/* q8_0 one group at a time is r8_q8_0_groups with G = 1, two at a time G = 2
 * (the VNNI build: r8z_q8_0_pair). */
R8_INLINE void r8_q8_0_group(int64_t nb, const block_q8_0x8 *g, const uint8_t *act, size_t astride, const int T,
                             float *out, size_t ostride) {
    r8_q8_0_groups(nb, g, 1, act, astride, T, out, ostride);
}
#ifdef QUANT_VNNI
R8_KERNEL(r8_q4_0, q4_0, block_q4_0x8, QK32, 2, r8z_q4_0_pair)
R8_KERNEL(r8_q8_0, q8_0, block_q8_0x8, QK32, 2, r8z_q8_0_pair)
R8_KERNEL(r8_q4_k, q4_k, block_q4_kx8, QKK, 2, r8z_q4_k_pair)
R8_KERNEL(r8_q5_k, q5_k, block_q5_kx8, QKK, 2, r8z_q5_k_pair)
R8_KERNEL(r8_iq4_xs, iq4_xs, block_iq4_xsx8, QKK, 2, r8z_iq4_xs_pair)
R8_KERNEL(r8_q6_k, q6_k, block_q6_kx8, QKK, 1, r8z_q6_k_pair)
R8_KERNEL(r8_q3_k, q3_k, block_q3_kx8, QKK, 1, r8z_q3_k_pair)
R8_KERNEL(r8_q4_1, q4_1, block_q4_1x8, QK32, 2, r8z_q4_1_pair)
R8_KERNEL(r8_q5_0, q5_0, block_q5_0x8, QK32, 2, r8z_q5_0_pair)
R8_KERNEL(r8_q5_1, q5_1, block_q5_1x8, QK32, 2, r8z_q5_1_pair)
R8_KERNEL(r8_iq4_nl, iq4_nl, block_iq4_nlx8, QK32, 2, r8z_iq4_nl_pair)
R8_KERNEL(r8_q2_k, q2_k, block_q2_kx8, QKK, 1, r8z_q2_k_pair)
/* q4_0 and q8_0 with pairs from one token (QUANT_R8_WALK_PAIRS: two weight
 * streams per thread). */
R8_KERNEL(r8_pairs1_q4_0, q4_0, block_q4_0x8, QK32, 1, r8z_q4_0_pair)
R8_KERNEL(r8_pairs1_q8_0, q8_0, block_q8_0x8, QK32, 1, r8z_q8_0_pair)
/* One token four groups at a time (r8z_TYPE_quad1), the last one to three
 * through ONE_FN (the pairs or the plain kernel); more tokens: the plain
 * kernel. r8_quads1_TYPE (QUANT_R8_WALK_QUADS) takes neighbouring groups
 * 4i .. 4i + 3; r8_spread1_TYPE (QUANT_R8_WALK_SPREAD) takes i, i + Q, i + 2Q and i + 3Q
 * (Q = n_groups / 4), four streams a quarter of the range apart rather than
 * 9 KB. */
#define R8_KERNEL_QUADS1(type, block_t, QB, one_fn)                                                      \
    static void r8_quads1_run_##type(int64_t n, const void *w, int n_groups, const void *act, size_t act_stride, \
                                     float *out, size_t out_stride, int spread) {                                \
        const int64_t nb = n / (QB);                                                                             \
        const block_t *g = w;                                                                                    \
        const int q = n_groups / 4;                                                                              \
        for (int i = 0; i < q; i++) {                                                                            \
            const block_t *gs[4];                                                                                \
            float *os[4];                                                                                        \
            R8_UNROLL for (int k = 0; k < 4; k++) {                                                              \
                const size_t gi = spread ? (size_t)(i + k * q) : (size_t)(4 * i + k);                            \
                gs[k] = g + gi * (size_t)nb;                                                                     \
                os[k] = out + 8 * gi;                                                                            \
            }                                                                                                    \
            r8z_##type##_quad1(nb, gs, act, os);                                                                 \
        }                                                                                                        \
        if (4 * q < n_groups)                                                                                    \
            R8_NAME(one_fn)(n, g + (size_t)(4 * q) * (size_t)nb, n_groups - 4 * q, act, act_stride, 1,           \
                            out + 8 * (size_t)(4 * q), out_stride);                                              \
    }                                                                                                            \
    void R8_NAME(r8_quads1_##type)(int64_t n, const void *w, int n_groups, const void *act, size_t act_stride, \
                                   int n_act, float *out, size_t out_stride) {                                   \
        if (n_act != 1) R8_NAME(r8_##type)(n, w, n_groups, act, act_stride, n_act, out, out_stride);             \
        else r8_quads1_run_##type(n, w, n_groups, act, act_stride, out, out_stride, 0);                         \
    }                                                                                                            \
    void R8_NAME(r8_spread1_##type)(int64_t n, const void *w, int n_groups, const void *act, size_t act_stride, \
                                    int n_act, float *out, size_t out_stride) {                                  \
        if (n_act != 1) R8_NAME(r8_##type)(n, w, n_groups, act, act_stride, n_act, out, out_stride);             \
        else r8_quads1_run_##type(n, w, n_groups, act, act_stride, out, out_stride, 1);                         \
    }
R8_KERNEL_QUADS1(q4_0, block_q4_0x8, QK32, r8_pairs1_q4_0)
R8_KERNEL_QUADS1(q8_0, block_q8_0x8, QK32, r8_pairs1_q8_0)
R8_KERNEL_QUADS1(q4_k, block_q4_kx8, QKK, r8_q4_k)
R8_KERNEL_QUADS1(q5_k, block_q5_kx8, QKK, r8_q5_k)
R8_KERNEL_QUADS1(iq4_xs, block_iq4_xsx8, QKK, r8_iq4_xs)
R8_KERNEL_QUADS1(q6_k, block_q6_kx8, QKK, r8_q6_k)
R8_KERNEL_QUADS1(q3_k, block_q3_kx8, QKK, r8_q3_k)
R8_KERNEL_QUADS1(q4_1, block_q4_1x8, QK32, r8_q4_1)
R8_KERNEL_QUADS1(q5_0, block_q5_0x8, QK32, r8_q5_0)
R8_KERNEL_QUADS1(q5_1, block_q5_1x8, QK32, r8_q5_1)
R8_KERNEL_QUADS1(iq4_nl, block_iq4_nlx8, QK32, r8_iq4_nl)
R8_KERNEL_QUADS1(q2_k, block_q2_kx8, QKK, r8_q2_k)
#else
R8_INLINE void r8_q8_0_pair(int64_t nb, const block_q8_0x8 *g, const uint8_t *act, size_t astride, const int T,
                            float *out, size_t ostride) {
    r8_q8_0_groups(nb, g, 2, act, astride, T, out, ostride);
}
R8_KERNEL(r8_q4_0, q4_0, block_q4_0x8, QK32, 0, r8_q4_0_group)
R8_KERNEL(r8_q8_0, q8_0, block_q8_0x8, QK32, 1, r8_q8_0_pair)
R8_KERNEL(r8_q4_k, q4_k, block_q4_kx8, QKK, 0, r8_q4_k_group)
R8_KERNEL(r8_q5_k, q5_k, block_q5_kx8, QKK, 0, r8_q5_k_group)
R8_KERNEL(r8_q6_k, q6_k, block_q6_kx8, QKK, 0, r8_q6_k_group)
R8_KERNEL(r8_q3_k, q3_k, block_q3_kx8, QKK, 0, r8_q3_k_group)
R8_KERNEL(r8_q4_1, q4_1, block_q4_1x8, QK32, 0, r8_q4_1_group)
R8_KERNEL(r8_q5_0, q5_0, block_q5_0x8, QK32, 0, r8_q5_0_group)
R8_KERNEL(r8_q5_1, q5_1, block_q5_1x8, QK32, 0, r8_q5_1_group)
R8_KERNEL(r8_iq4_nl, iq4_nl, block_iq4_nlx8, QK32, 0, r8_iq4_nl_group)
R8_KERNEL(r8_iq4_xs, iq4_xs, block_iq4_xsx8, QKK, 0, r8_iq4_xs_group)
R8_KERNEL(r8_q2_k, q2_k, block_q2_kx8, QKK, 0, r8_q2_k_group)
#endif
