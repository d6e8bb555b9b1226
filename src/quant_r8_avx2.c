/*
 * quant_r8_avx2 — the r8 (row-interleaved) q4_0 kernel under AVX2; compiled a
 * second time as quant_r8_avx512.c with QUANT_R8_VNNI, where vpdpbusd makes
 * each block's integer sum in place of maddubs + add + madd.
 *
 * Per block of eight rows: four 32-byte loads give, masked and shifted, eight
 * registers whose i32 lane r holds four unsigned elements of row r (layout in
 * quant_impl.h, block_q4_0x8). Each pairs with one 4-byte broadcast of the
 * activation block, so the eight u8 x s8 products sum to row r's exact block
 * sum P in lane r with no horizontal step: under plain AVX2 the eight maddubs
 * add in i16 (|sum| <= 16 x 15 x 127 = 30480, no saturation) and one madd
 * makes i32. Then the float steps of quant_r8_ref.c, one lane per row:
 * t = fma(P, da, -8 s), acc = fma(t, dw, acc). The unpacked weights of a
 * block serve up to four tokens. Same steps whatever the number of tokens:
 * batch invariant, and bit-identical to the scalar reference.
 */
#include <immintrin.h>
#include <string.h>

#include "quant_impl.h"

#define R8_INLINE static inline __attribute__((always_inline))
#define R8_UNROLL _Pragma("GCC unroll 8")
#define R8_TOKENS 4 /* tokens per pass over a group's blocks */
#define R8_PREFETCH 2304 /* bytes ahead (16 blocks) the weights are prefetched */

#ifdef QUANT_R8_VNNI
#define R8_NAME(x) quant_avx512_##x
#else
#define R8_NAME(x) quant_avx2_##x
#endif

/* The frame of every group kernel: a[t] = token t's activation blocks and
 * acc[t] = its eight rows' sums (lane r), stored at out + t * ostride at the end. */
#define R8_GROUP_BEGIN(act_t)                                                                  \
    const act_t *a[R8_TOKENS];                                                                 \
    __m256 acc[R8_TOKENS];                                                                     \
    R8_UNROLL for (int t = 0; t < T; t++) {                                                    \
        a[t] = (const act_t *)(act + (size_t)t * astride);                                     \
        acc[t] = _mm256_setzero_ps();                                                          \
    }
#define R8_GROUP_END() R8_UNROLL for (int t = 0; t < T; t++) _mm256_storeu_ps(out + (size_t)t * ostride, acc[t])

R8_INLINE __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Lane r: the exact sum of row r's 32 products with activation block y. */
R8_INLINE __m256i r8_block_sum(const __m256i lo[4], const __m256i hi[4], const int8_t *q) {
#ifdef QUANT_R8_VNNI
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

/* One group (nb blocks) x T tokens (T compile-time after inlining). */
R8_INLINE void r8_q4_0_group(int64_t nb, const block_q4_0x8 *g, const uint8_t *act, size_t astride, const int T,
                             float *out, size_t ostride) {
    R8_GROUP_BEGIN(act_q8);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        /* A single core's DRAM stream runs ~1.3x faster with this on the EPYC
         * (decode, weights far beyond L3: 11 -> 14 GB/s per core). */
        _mm_prefetch((const char *)&g[b] + R8_PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)&g[b] + R8_PREFETCH + 72, _MM_HINT_T0);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g[b].d));
        __m256i lo[4], hi[4];
        R8_UNROLL for (int j = 0; j < 4; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(g[b].qs + 32 * j));
            lo[j] = _mm256_and_si256(v, m4);
            hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        }
        R8_UNROLL for (int t = 0; t < T; t++) {
            const act_q8 *y = a[t] + b;
            const __m256 p = _mm256_cvtepi32_ps(r8_block_sum(lo, hi, y->qs));
            const __m256 tt = _mm256_fmadd_ps(p, _mm256_set1_ps(y->d), _mm256_set1_ps(y->s * -8.0f));
            acc[t] = _mm256_fmadd_ps(tt, dw, acc[t]);
        }
    }
    R8_GROUP_END();
}

/* Chunk j of block b of G groups: each group's |w| once, then every token's
 * 4-byte broadcast meets every group's chunk, its products into s[k][t]. */
#ifdef QUANT_R8_VNNI
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
 * its sums at out + 8 k: a broadcast serves both groups (one core, in cache:
 * 3-5 % less per row-token than one group). Float steps of quant_r8_ref.c:
 * acc = fma(P da, dw, acc). */
R8_INLINE void r8_q8_0_groups(int64_t nb, const block_q8_0x8 *g, const int G, const uint8_t *act, size_t astride,
                              const int T, float *out, size_t ostride) {
    const act_q8 *a[R8_TOKENS];
    __m256 acc[2][R8_TOKENS];
    R8_UNROLL for (int t = 0; t < T; t++) {
        a[t] = (const act_q8 *)(act + (size_t)t * astride);
        R8_UNROLL for (int k = 0; k < G; k++) acc[k][t] = _mm256_setzero_ps();
    }
#ifndef QUANT_R8_VNNI
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
         * chunk's products live); rolled, the pass runs ~4 % faster on one core.
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
 * quant_r8_ref.c. */
R8_INLINE void r8_q4_k_scales(const block_q4_kx8 *g, __m256i sc32[8], __m256i mn32[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x03);
    const __m256i l = _mm256_loadu_si256((const __m256i *)g->sc_lo), ml = _mm256_loadu_si256((const __m256i *)g->m_lo),
                  h = _mm256_loadu_si256((const __m256i *)g->hi);
    uint8_t sc[64], mn[64];
    _mm256_storeu_si256((__m256i *)sc, _mm256_or_si256(_mm256_and_si256(l, m4), _mm256_slli_epi16(_mm256_and_si256(h, m3), 4)));
    _mm256_storeu_si256((__m256i *)(sc + 32),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l, 4), m4),
                                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m3), 4)));
    _mm256_storeu_si256((__m256i *)mn, _mm256_or_si256(_mm256_and_si256(ml, m4),
                                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m3), 4)));
    _mm256_storeu_si256((__m256i *)(mn + 32),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ml, 4), m4),
                                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m3), 4)));
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

R8_INLINE void r8_q4_k_group(int64_t nb, const block_q4_kx8 *g, const uint8_t *act, size_t astride, const int T,
                             float *out, size_t ostride) {
    R8_GROUP_BEGIN(block_q8_k);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        __m256i sc32[8], mn32[4], s1[R8_TOKENS];
        r8_q4_k_scales(&g[b], sc32, mn32);
        R8_UNROLL for (int t = 0; t < T; t++) s1[t] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const uint8_t *qs = g[b].qs + 128 * j;
            _mm_prefetch((const char *)qs + R8_PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)qs + R8_PREFETCH + 64, _MM_HINT_T0);
            __m256i lo[4], hi[4];
            R8_UNROLL for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                lo[c] = _mm256_and_si256(v, m4);
                hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            }
            R8_UNROLL for (int t = 0; t < T; t++) {
#ifdef QUANT_R8_VNNI
                s1[t] = _mm256_dpwssd_epi32(s1[t], r8_sub_sum16(lo, hi, a[t][b].qs + 32 * j), sc32[j]);
#else
                s1[t] = _mm256_add_epi32(s1[t], _mm256_madd_epi16(r8_sub_sum16(lo, hi, a[t][b].qs + 32 * j), sc32[j]));
#endif
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g[b].d));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g[b].dmin));
        R8_UNROLL for (int t = 0; t < T; t++) {
            const block_q8_k *y = &a[t][b];
            __m256i s2 = _mm256_setzero_si256();
            R8_UNROLL for (int p = 0; p < 4; p++) {
                const int16_t *bs = y->bsums + 4 * p;
                const uint32_t pair = (uint16_t)(bs[0] + bs[1]) | (uint32_t)(uint16_t)(bs[2] + bs[3]) << 16;
                s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(mn32[p], _mm256_set1_epi32((int32_t)pair)));
            }
            const __m256 da = _mm256_set1_ps(y->d);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1[t]), _mm256_mul_ps(d, da), acc[t]);
            acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(s2), _mm256_mul_ps(dmin, da), acc[t]);
        }
    }
    R8_GROUP_END();
}

/* q6_k, per super-block of eight rows: lane r of sc16[g] = row r's scale of
 * group g in both i16 halves, of scp[p] = its scales of groups 2p and 2p + 1.
 * Per sub-block the 6-bit u = q + 32 are rebuilt from ql and qh; per 16-element
 * group two maddubs add in i16 (|sum| <= 4 x 63 x 127) and one madd applies
 * the scale; the -32 offset comes back as 32 sum_g sc_g bs_g (eight madds per
 * token); float steps of quant_r8_ref.c. */
R8_INLINE void r8_q6_k_scales(const block_q6_kx8 *g, __m256i sc16[16], __m256i scp[8]) {
    const __m256i lo16 = _mm256_set1_epi32(0xFFFF);
    R8_UNROLL for (int k = 0; k < 16; k++) {
        const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(g->sc + 8 * k)));
        sc16[k] = _mm256_or_si256(_mm256_and_si256(v, lo16), _mm256_slli_epi32(v, 16));
    }
    R8_UNROLL for (int p = 0; p < 8; p++) scp[p] = _mm256_or_si256(_mm256_and_si256(sc16[2 * p], lo16),
                                                                 _mm256_andnot_si256(lo16, sc16[2 * p + 1]));
}

R8_INLINE void r8_q6_k_group(int64_t nb, const block_q6_kx8 *g, const uint8_t *act, size_t astride, const int T,
                             float *out, size_t ostride) {
    R8_GROUP_BEGIN(block_q8_k);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x03);
    for (int64_t b = 0; b < nb; b++) {
        __m256i sc16[16], scp[8], s1[R8_TOKENS];
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
                const __m256i u0 = _mm256_or_si256(_mm256_and_si256(q0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m3), 4));
                const __m256i u1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q0, 4), m4),
                                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m3), 4));
                const __m256i u2 = _mm256_or_si256(_mm256_and_si256(q1, m4),
                                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m3), 4));
                const __m256i u3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q1, 4), m4),
                                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m3), 4));
                const __m256i sc = sc16[2 * j + h];
                R8_UNROLL for (int t = 0; t < T; t++) {
                    const int8_t *q = a[t][b].qs + 32 * j + 16 * h;
                    const __m256i x = _mm256_add_epi16(_mm256_maddubs_epi16(u0, bcast4(q)), _mm256_maddubs_epi16(u1, bcast4(q + 4)));
                    const __m256i y = _mm256_add_epi16(_mm256_maddubs_epi16(u2, bcast4(q + 8)),
                                                       _mm256_maddubs_epi16(u3, bcast4(q + 12)));
#ifdef QUANT_R8_VNNI
                    s1[t] = _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(s1[t], x, sc), y, sc);
#else
                    s1[t] = _mm256_add_epi32(s1[t], _mm256_add_epi32(_mm256_madd_epi16(x, sc), _mm256_madd_epi16(y, sc)));
#endif
                }
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g[b].d));
        R8_UNROLL for (int t = 0; t < T; t++) {
            const block_q8_k *y = &a[t][b];
            __m256i s2 = _mm256_madd_epi16(scp[0], bcast4((const int8_t *)y->bsums));
            R8_UNROLL for (int p = 1; p < 8; p++)
                s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(scp[p], bcast4((const int8_t *)(y->bsums + 2 * p))));
            const __m256i sum = _mm256_sub_epi32(s1[t], _mm256_slli_epi32(s2, 5));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(y->d)), acc[t]);
        }
    }
    R8_GROUP_END();
}

/* The exported kernel of a type: every group, tokens four at a time, then the rest. */
#define R8_KERNEL(type, block_t, QB)                                                                          \
    void R8_NAME(r8_##type)(int64_t n, const void *w, int n_groups, const void *act, size_t act_stride,       \
                            int n_act, float *out, size_t out_stride) {                                       \
        const int64_t nb = n / (QB);                                                                          \
        const uint8_t *ab = (const uint8_t *)act;                                                             \
        for (int gi = 0; gi < n_groups; gi++) {                                                               \
            const block_t *g = (const block_t *)w + (size_t)gi * (size_t)nb;                                  \
            float *o = out + 8 * (size_t)gi;                                                                  \
            int t = 0;                                                                                        \
            for (; n_act - t >= R8_TOKENS; t += R8_TOKENS)                                                    \
                r8_##type##_group(nb, g, ab + (size_t)t * act_stride, act_stride, R8_TOKENS,                  \
                                  o + (size_t)t * out_stride, out_stride);                                    \
            const uint8_t *at = ab + (size_t)t * act_stride;                                                  \
            float *ot = o + (size_t)t * out_stride;                                                           \
            switch (n_act - t) {                                                                              \
            case 3: r8_##type##_group(nb, g, at, act_stride, 3, ot, out_stride); break;                       \
            case 2: r8_##type##_group(nb, g, at, act_stride, 2, ot, out_stride); break;                       \
            case 1: r8_##type##_group(nb, g, at, act_stride, 1, ot, out_stride); break;                       \
            default: break;                                                                                   \
            }                                                                                                 \
        }                                                                                                     \
    }

R8_KERNEL(q4_0, block_q4_0x8, QK32)
/* q8_0: groups two at a time (the last one alone when their number is odd),
 * tokens four at a time, then the rest; G and T compile-time in each call. */
#define R8_Q8_0_PASS(TT)                                                                     \
    case TT:                                                                                 \
        if (pair) r8_q8_0_groups(nb, g, 2, at, act_stride, TT, ot, out_stride);              \
        else r8_q8_0_groups(nb, g, 1, at, act_stride, TT, ot, out_stride);                   \
        break;

void R8_NAME(r8_q8_0)(int64_t n, const void *w, int n_groups, const void *act, size_t act_stride, int n_act,
                      float *out, size_t out_stride) {
    const int64_t nb = n / QK32;
    const uint8_t *ab = (const uint8_t *)act;
    for (int gi = 0; gi < n_groups;) {
        const block_q8_0x8 *g = (const block_q8_0x8 *)w + (size_t)gi * (size_t)nb;
        const int pair = n_groups - gi >= 2;
        float *o = out + 8 * (size_t)gi;
        for (int t = 0; t < n_act;) {
            const int T = n_act - t >= R8_TOKENS ? R8_TOKENS : n_act - t;
            const uint8_t *at = ab + (size_t)t * act_stride;
            float *ot = o + (size_t)t * out_stride;
            switch (T) {
            R8_Q8_0_PASS(4)
            R8_Q8_0_PASS(3)
            R8_Q8_0_PASS(2)
            default: R8_Q8_0_PASS(1)
            }
            t += T;
        }
        gi += pair ? 2 : 1;
    }
}
R8_KERNEL(q4_k, block_q4_kx8, QKK)
R8_KERNEL(q6_k, block_q6_kx8, QKK)
