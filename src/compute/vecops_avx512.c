/*
 * vecops_avx512 — the attention walks of vecops.c at 512 bits, for a core
 * with full-width AVX-512 (vecops.c picks them when the ISA in use, base/cpu.h,
 * is AVX-512). The same bits as the AVX2 walks:
 * - scores, f16 keys and head sizes a multiple of 32 (the usual case): the
 *   keys transposed eight at a time, element pairs across lanes, each lane one
 *   of the AVX2 tile's lane sums, reduced in hsum8x8's tree (scores_t_body);
 * - scores otherwise: a zmm holds the 8-lane accumulators of two keys side by
 *   side (lanes 0-7 key k, 8-15 key k + 1) against a query slice broadcast to
 *   both halves, so every lane makes the AVX2 tile's fma sequence, and each
 *   half is reduced by the same hsum8x8 tree; a tile is 16 (head, key) sums,
 *   twice the AVX2 tile's, for a quarter of the key loads per head.
 * - weighted sums: 16 output elements per accumulator; each element is still
 *   one fma per row in row order.
 * Compiled with the AVX-512 flags (CMake), or over SIMDe in the emu512 build.
 */
#include <immintrin.h>
#include <string.h>

#define VEC_TARGET
#include "vecops_impl.h"

/* Eight elements from i of row a (lanes 0-7) and of row b (lanes 8-15). */
VEC_INLINE __m512 row8x2(const void *a, const void *b, int f16, int i) {
    if (f16)
        return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)a + i)))),
                                  _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)b + i))), 1);
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps((const float *)a + i)),
                              _mm256_loadu_ps((const float *)b + i), 1);
}

/* Sixteen f16 (a 256-bit vector) as f32. */
VEC_INLINE __m512 f16x16(__m256i h) {
#ifdef KVS_EMU_AVX512_H /* SIMDe has no _mm512_cvtph_ps: the two halves, the same exact conversion */
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_cvtph_ps(_mm256_castsi256_si128(h))),
                              _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), 1);
#else
    return _mm512_cvtph_ps(h);
#endif
}

/* Sixteen elements of a row from element i. */
VEC_INLINE __m512 row16(const void *r, int f16, int i) {
    if (f16) return f16x16(_mm256_loadu_si256((const __m256i *)((const uint16_t *)r + i)));
    return _mm512_loadu_ps((const float *)r + i);
}

VEC_INLINE __m256 hi256(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

/* NH heads x NK keys (NK even, NH * NK <= 16): accumulator h * NK / 2 + p is
 * (head h, keys 2p and 2p + 1); per 8-element slice each key pair is loaded
 * once and each head's query slice once. Each (head, key) half gets the AVX2
 * tile's lane sums and its hsum8x8 tree. */
VEC_INLINE void scores_tile2(const float *q, int hd, const void *const *keys, const int F16, const int NH,
                             const int NK, float scale, float *scores, size_t stride) {
    const int NP = NK / 2;
    __m512 acc[8];
    VEC_UNROLL for (int a = 0; a < NH * NP; a++) acc[a] = _mm512_setzero_ps();
    VEC_UNROLL for (int c0 = 0; c0 < hd; c0 += 8) {
        __m512 kr[8];
        VEC_UNROLL for (int p = 0; p < NP; p++) kr[p] = row8x2(keys[2 * p], keys[2 * p + 1], F16, c0);
        VEC_UNROLL for (int h = 0; h < NH; h++) {
            const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + (size_t)h * (size_t)hd + (size_t)c0));
            VEC_UNROLL for (int p = 0; p < NP; p++) acc[h * NP + p] = _mm512_fmadd_ps(qv, kr[p], acc[h * NP + p]);
        }
    }
    __m256 half[16];
    VEC_UNROLL for (int a = 0; a < 16; a++) half[a] = _mm256_setzero_ps();
    VEC_UNROLL for (int a = 0; a < NH * NP; a++) {
        half[2 * a] = _mm512_castps512_ps256(acc[a]);
        half[2 * a + 1] = hi256(acc[a]);
    }
    float out[16];
    const __m256 vs = _mm256_set1_ps(scale);
    _mm256_storeu_ps(out, _mm256_mul_ps(hsum8x8(half), vs));
    if (NH * NK > 8) _mm256_storeu_ps(out + 8, _mm256_mul_ps(hsum8x8(half + 8), vs));
    VEC_UNROLL for (int h = 0; h < NH; h++)
        VEC_UNROLL for (int kk = 0; kk < NK; kk++) scores[(size_t)h * stride + (size_t)kk] = out[h * NK + kk];
}

/* Keys per full tile of NH (1..4) heads: 16 (head, key) sums in 8 registers. */
VEC_INLINE int tile_width2(const int NH) { return NH == 1 ? 16 : NH == 2 ? 8 : 4; }

/* Keys [j0, j1) against NH heads: full tiles, then pairs, then a last key
 * through the 256-bit tile (same bits); prefetching as scores_heads does. */
VEC_INLINE void scores_heads2(const float *q, int hd, const void *const *keys, int j0, int j1, const int F16,
                              const int NH, float scale, float *scores, size_t stride, int pf_n) {
    const int NK = tile_width2(NH);
    const size_t row_bytes = kv_row_bytes(F16, hd);
    int j = j0;
    for (; j + NK <= j1; j += NK) {
        if (pf_n) prefetch_rows(keys, j + KV_AHEAD, NK, pf_n, row_bytes);
        scores_tile2(q, hd, keys + j, F16, NH, NK, scale, scores + j, stride);
    }
    for (; j + 2 <= j1; j += 2) {
        if (pf_n) prefetch_rows(keys, j + KV_AHEAD, 2, pf_n, row_bytes);
        scores_tile2(q, hd, keys + j, F16, NH, 2, scale, scores + j, stride);
    }
    if (j < j1) {
        if (pf_n) prefetch_rows(keys, j + KV_AHEAD, 1, pf_n, row_bytes);
        scores_tile(q, hd, keys + j, F16, NH, 1, scale, scores + j, stride);
    }
}

VEC_SCORES_WALK(static, scores_walk2, scores_heads2)

/* The f16 scores walk with the keys transposed, for head sizes that are a
 * multiple of 32 (up to T_MAX_HD): eight keys at a time are turned into hd / 2
 * vectors, vector D holding elements 2D and 2D + 1 of each key (lane 2j + p:
 * key j, element 2D + p), stored once and read by every head of the group.
 * A head's query pair (2D, 2D + 1) is broadcast to all eight lane pairs, and
 * accumulator D mod 4 takes the product, so lane (j, p) of accumulator m sums
 * elements 2m + p, 2m + p + 8, ... of key j in order: the AVX2 tile's lane
 * 2m + p. The lane pairs are added, then the accumulators in hsum8x8's tree
 * ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)), and the result times the scale:
 * the AVX2 scores' bits, for a transposition (24 shuffles and 16 conversions
 * per 8 keys and 32 elements) shared by all the heads instead of a key
 * conversion per tile of four heads and a horizontal reduction per score. */
enum { T_MAX_HD = 256 };

/* Keys kp[0..7], elements [32c, 32c + 32) (16 dword pairs), transposed into
 * f + 16 * (16c + d) for d < 16. */
VEC_INLINE void keys_t8(const void *const kp[8], int c, float *f) {
    __m512i z[8], t[8], u[8];
    VEC_UNROLL for (int j = 0; j < 8; j++) z[j] = _mm512_loadu_si512((const void *)((const uint16_t *)kp[j] + 32 * c));
    /* per 128-bit lane k: t[2i] = (z[2i].4k, z[2i+1].4k, z[2i].4k+1, z[2i+1].4k+1), t[2i+1] the next two */
    VEC_UNROLL for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
    }
    /* u[i] (i < 4): per lane k, dword 4k + i of keys 0-3; u[4 + i] of keys 4-7 */
    VEC_UNROLL for (int g = 0; g < 2; g++) {
        __m512i *tg = t + 4 * g, *ug = u + 4 * g;
        ug[0] = _mm512_unpacklo_epi64(tg[0], tg[2]);
        ug[1] = _mm512_unpackhi_epi64(tg[0], tg[2]);
        ug[2] = _mm512_unpacklo_epi64(tg[1], tg[3]);
        ug[3] = _mm512_unpackhi_epi64(tg[1], tg[3]);
    }
    /* dword 4k + i of keys 0-7: lane k of u[i], then of u[4 + i] (k = 0, 1 in one vector, 2, 3 in another) */
    const __m512i lo = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), hi = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    VEC_UNROLL for (int i = 0; i < 4; i++) {
        const __m512i a = _mm512_permutex2var_epi64(u[i], lo, u[4 + i]), b = _mm512_permutex2var_epi64(u[i], hi, u[4 + i]);
        _mm512_store_ps(f + 16 * (16 * c + i), f16x16(_mm512_castsi512_si256(a)));
        _mm512_store_ps(f + 16 * (16 * c + 4 + i), f16x16(_mm512_extracti64x4_epi64(a, 1)));
        _mm512_store_ps(f + 16 * (16 * c + 8 + i), f16x16(_mm512_castsi512_si256(b)));
        _mm512_store_ps(f + 16 * (16 * c + 12 + i), f16x16(_mm512_extracti64x4_epi64(b, 1)));
    }
}

/* NH (1..4) heads against KS (1, 2) sets of eight transposed keys (set s at
 * f + s * 8 * hd; nk keys in all), two of the four accumulator chains at a
 * time (m = 0, 1, then 2, 3: sixteen chains in flight for four heads and two
 * sets, with one partial sum each between the halves; one chain at a time
 * left too few in flight, all four need 32 registers). */
VEC_INLINE void scores_t_heads(const float *f, const float *q, const int hd, const int NH, const int KS, int nk,
                               float scale, float *scores, size_t stride) {
    __m512 tree[4][2]; /* per (head, set): the lane pairs' ((0 + 1) + (2 + 3)), then that + ((4 + 5) + (6 + 7)) */
    VEC_UNROLL for (int m0 = 0; m0 < 4; m0 += 2) {
        __m512 a[2][4][2];
        VEC_UNROLL for (int m = 0; m < 2; m++) VEC_UNROLL for (int h = 0; h < NH; h++) VEC_UNROLL for (int k = 0; k < KS; k++)
            a[m][h][k] = _mm512_setzero_ps();
        for (int d0 = m0; d0 < hd / 2; d0 += 4)
            VEC_UNROLL for (int m = 0; m < 2; m++) {
                const int d = d0 + m;
                __m512 kv[2];
                VEC_UNROLL for (int k = 0; k < KS; k++) kv[k] = _mm512_load_ps(f + (size_t)k * 8 * (size_t)hd + 16 * (size_t)d);
                VEC_UNROLL for (int h = 0; h < NH; h++) {
                    double qp;
                    memcpy(&qp, q + (size_t)h * (size_t)hd + 2 * (size_t)d, sizeof qp);
                    const __m512 qv = _mm512_castpd_ps(_mm512_set1_pd(qp));
                    VEC_UNROLL for (int k = 0; k < KS; k++) a[m][h][k] = _mm512_fmadd_ps(qv, kv[k], a[m][h][k]);
                }
            }
        VEC_UNROLL for (int h = 0; h < NH; h++) VEC_UNROLL for (int k = 0; k < KS; k++) {
            __m512 pm[2]; /* lane pairs */
            VEC_UNROLL for (int m = 0; m < 2; m++) pm[m] = _mm512_add_ps(a[m][h][k], _mm512_shuffle_ps(a[m][h][k], a[m][h][k], 0xb1));
            const __m512 pq = _mm512_add_ps(pm[0], pm[1]);
            tree[h][k] = m0 == 0 ? pq : _mm512_add_ps(tree[h][k], pq);
        }
    }
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512 vs = _mm512_set1_ps(scale);
    VEC_UNROLL for (int h = 0; h < NH; h++) {
        const __m512 s0 = _mm512_mul_ps(tree[h][0], vs), s1 = KS > 1 ? _mm512_mul_ps(tree[h][1], vs) : s0;
        const __m512 sk = _mm512_permutex2var_ps(s0, even, s1);
        if (nk == 16) _mm512_storeu_ps(scores + (size_t)h * stride, sk);
        else { /* the last, short tile (a plain store and a copy: SIMDe has no masked store) */
            float t[16];
            _mm512_storeu_ps(t, sk);
            memcpy(scores + (size_t)h * stride, t, sizeof(float) * (size_t)nk);
        }
    }
}

/* Keys [j0, j0 + 16) at most: KS sets of eight transposed into f, then the
 * group's heads four at a time. */
VEC_INLINE void scores_t_tile(const float *q, int group, const int hd, const void *const *keys, int nk, const int KS,
                              float scale, float *scores, size_t stride, float *f) {
    VEC_UNROLL for (int k = 0; k < KS; k++) {
        const int base = 8 * k, n = nk - base < 8 ? nk - base : 8;
        const void *kp[8];
        VEC_UNROLL for (int j = 0; j < 8; j++) kp[j] = keys[base + (j < n ? j : n - 1)]; /* a short set repeats its last key */
        for (int c = 0; c < hd / 32; c++) keys_t8(kp, c, f + (size_t)k * 8 * (size_t)hd);
    }
    for (int h0 = 0; h0 < group; h0 += 4) {
        const float *qg = q + (size_t)h0 * (size_t)hd;
        float *sg = scores + (size_t)h0 * stride;
        switch (group - h0 < 4 ? group - h0 : 4) {
        case 1: scores_t_heads(f, qg, hd, 1, KS, nk, scale, sg, stride); break;
        case 2: scores_t_heads(f, qg, hd, 2, KS, nk, scale, sg, stride); break;
        case 3: scores_t_heads(f, qg, hd, 3, KS, nk, scale, sg, stride); break;
        default: scores_t_heads(f, qg, hd, 4, KS, nk, scale, sg, stride); break;
        }
    }
}

VEC_INLINE void scores_t_body(const float *q, int group, const int hd, const void *const *keys, int n_keys, float scale,
                              float *scores, size_t stride) {
    _Alignas(64) float f[16 * T_MAX_HD];
    const size_t row_bytes = kv_row_bytes(1, hd);
    prefetch_rows(keys, 0, KV_AHEAD, n_keys, row_bytes);
    for (int j0 = 0; j0 < n_keys; j0 += 16) {
        const int nk = n_keys - j0 < 16 ? n_keys - j0 : 16;
        prefetch_rows(keys, j0 + KV_AHEAD, 16, n_keys, row_bytes);
        if (nk > 8) scores_t_tile(q, group, hd, keys + j0, nk, 2, scale, scores + j0, stride, f);
        else scores_t_tile(q, group, hd, keys + j0, nk, 1, scale, scores + j0, stride, f);
    }
}

void vec_avx512_scores(const float *q, int group, int hd, const void *const *keys, int n_keys, int k_f16, float scale,
                       float *scores, size_t stride) {
    if (!k_f16 || hd % 32 || hd > T_MAX_HD) scores_walk2(q, group, hd, keys, n_keys, k_f16, scale, scores, stride);
    else if (hd == 64) scores_t_body(q, group, 64, keys, n_keys, scale, scores, stride);
    else if (hd == 128) scores_t_body(q, group, 128, keys, n_keys, scale, scores, stride);
    else scores_t_body(q, group, hd, keys, n_keys, scale, scores, stride);
}

/* wsum_tile at twice the width: 16-element slices, up to 16 accumulators. */
VEC_WSUM_TILE(wsum_tile16, __m512, _mm512, 16, 16, row16)

/* Slices per full tile of NH (1..4) heads: 16 accumulators. */
VEC_INLINE int wsum_width16(const int NH) { return NH == 1 ? 16 : NH == 2 ? 8 : 4; }

/* NH heads over rows [j0, j1): full tiles of 16-element slices, then tiles of
 * four, two and one slice, then an 8-element tail through the 256-bit tile;
 * the first slice pass prefetches. */
VEC_INLINE void wsum_heads16(const float *p, size_t ps, int j0, int j1, const void *const *rows, const int F16,
                             const int NH, int hd, float *out, int pf_n) {
    const int NC = wsum_width16(NH);
    int c0 = 0;
    for (; c0 + 16 * NC <= hd; c0 += 16 * NC) wsum_tile16(p, ps, j0, j1, rows, F16, c0, NH, NC, hd, out, c0 ? 0 : pf_n);
    if (NC > 4) /* one or two heads and a head shorter than a full tile: four slices, then fewer */
        for (; c0 + 64 <= hd; c0 += 64) wsum_tile16(p, ps, j0, j1, rows, F16, c0, NH, 4, hd, out, c0 ? 0 : pf_n);
    for (; c0 + 32 <= hd; c0 += 32) wsum_tile16(p, ps, j0, j1, rows, F16, c0, NH, 2, hd, out, c0 ? 0 : pf_n);
    for (; c0 + 16 <= hd; c0 += 16) wsum_tile16(p, ps, j0, j1, rows, F16, c0, NH, 1, hd, out, c0 ? 0 : pf_n);
    if (c0 < hd) wsum_tile(p, ps, j0, j1, rows, F16, c0, NH, 1, hd, out, c0 ? 0 : pf_n);
}

VEC_WSUM_WALK(, vec_avx512_wsum_group, wsum_heads16)

/* exp8 on sixteen lanes: the same operations per lane (round to nearest,
 * the fused reduction and Horner steps, 2^k, zero below EXP_LO). */
VEC_INLINE __m512 exp16(__m512 x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LO), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_LO));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(log2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(ln2_lo), _mm512_fnmadd_ps(k, _mm512_set1_ps(ln2_hi), x));
    __m512 p = _mm512_set1_ps(exp_c[6]);
    VEC_UNROLL for (int i = 5; i >= 0; i--) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(exp_c[i]));
    /* k (integral, |k| < 2^22) as i32 exactly, as cvtps_epi32 gives it: the low mantissa bits of k + 1.5 x 2^23
     * (SIMDe, for the emu512 build, has no 512-bit float-to-int conversion) */
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    const __m512i ki = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(k, magic)), _mm512_castps_si512(magic));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(ki, _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps(keep, _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
}

/* The maximum by softmax_max (four 8-lane maxima side by side: a 16-lane
 * copy of it read no faster), the exp 16 lanes at a time. */
void vec_avx512_softmax(float *x, int n) {
    const float max = softmax_max(x, n);
    const __m512 vm = _mm512_set1_ps(max);
    __m256 vsum = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm));
        _mm512_storeu_ps(x + i, e);
        vsum = _mm256_add_ps(_mm256_add_ps(vsum, _mm512_castps512_ps256(e)), hi256(e)); /* lanes l, then l + 8 */
    }
    const float sum = softmax_exp_rest(x, i, n, max, vsum);
    const __m512 inv = _mm512_set1_ps(1.0f / sum);
    for (i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), inv));
    softmax_scale(x, i, n, sum);
}

uint64_t vec_avx512_read_sum(const void *p, size_t n, int streams) {
    const uint8_t *b = p;
    const size_t part = n / (size_t)streams;
    __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
    for (size_t i = 0; i < part; i += 256)
        for (int k = 0; k < streams; k++) {
            const uint8_t *q = b + (size_t)k * part + i;
            for (int l = 0; l < 4; l++) _mm_prefetch((const char *)q + VEC_READ_PREFETCH + 64 * l, _MM_HINT_T0);
            s0 = _mm512_add_epi64(s0, _mm512_load_si512((const void *)q));
            s1 = _mm512_add_epi64(s1, _mm512_load_si512((const void *)(q + 64)));
            s2 = _mm512_add_epi64(s2, _mm512_load_si512((const void *)(q + 128)));
            s3 = _mm512_add_epi64(s3, _mm512_load_si512((const void *)(q + 192)));
        }
    const __m512i s = _mm512_add_epi64(_mm512_add_epi64(s0, s1), _mm512_add_epi64(s2, s3));
    uint64_t w[8], r = 0;
    _mm512_storeu_si512((void *)w, s);
    for (int k = 0; k < 8; k++) r += w[k];
    return r;
}
