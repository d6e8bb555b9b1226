/*
 * vecops_impl — the attention walk and 256-bit tiles that vecops.c (AVX2) and
 * vecops_avx512.c share. Each includer defines VEC_TARGET first (the target
 * attribute of its functions, or nothing where the file is compiled for the
 * ISA), so each gets its own copy compiled for its own ISA; the float
 * operations, and so the bits, are the same in both.
 */
#ifndef KVS_VECOPS_IMPL_H
#define KVS_VECOPS_IMPL_H

#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <string.h>

#include "vecops.h"

#define VEC_INLINE static inline __attribute__((always_inline))
#define VEC_UNROLL _Pragma("GCC unroll 8")

/* Eight elements of a key/value row from element i, as f32. */
VEC_TARGET static inline __attribute__((always_inline)) __m256 row8(const void *r, int f16, int i) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)r + i)))
               : _mm256_loadu_ps((const float *)r + i);
}

/* Lane h = the sum of a[h]'s lanes, for eight accumulators (one fixed tree). */
VEC_TARGET static inline __attribute__((always_inline)) __m256 hsum8x8(const __m256 a[8]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Software prefetch of rows [j, j + n) of a row list, row_bytes each, when
 * they exist: a head's KV rows are short contiguous runs (one per KV block)
 * scattered over the arena, which the hardware prefetchers follow poorly.
 * The walks issue it a tile at a time, between the tiles' arithmetic: a burst
 * of a whole block's prefetches at once overlapped less with the arithmetic
 * and made attention slower. */
enum { KV_AHEAD = 32 };
VEC_INLINE size_t kv_row_bytes(int f16, int hd) { return (size_t)hd * (f16 ? 2u : 4u); }
VEC_INLINE void prefetch_rows(const void *const *rows, int j, int n, int n_rows, size_t row_bytes) {
    const int j1 = j + n < n_rows ? j + n : n_rows;
    for (; j < j1; j++)
        for (size_t b = 0; b < row_bytes; b += 64) _mm_prefetch((const char *)rows[j] + b, _MM_HINT_T0);
}

/* Scores of NK keys against NH heads, NH * NK <= 8, F16 / NH / NK compile-time
 * after inlining: per 8-element slice each key is converted once and each
 * head's query slice loaded once, so the 8 accumulators, the NK key slices and
 * one query slice stay in registers. Accumulator h * NK + kk is (head h, key
 * kk); every lane sums its slices in order and hsum8x8 reduces every
 * accumulator by the same tree, so a score's bits do not depend on the tile it
 * was computed in (group, number of keys, position). */
VEC_TARGET VEC_INLINE void scores_tile(const float *q, int hd, const void *const *keys, const int F16, const int NH,
                                       const int NK, float scale, float *scores, size_t stride) {
    __m256 acc[8];
    VEC_UNROLL for (int a = 0; a < 8; a++) acc[a] = _mm256_setzero_ps();
    VEC_UNROLL for (int c0 = 0; c0 < hd; c0 += 8) {
        __m256 kr[8];
        VEC_UNROLL for (int kk = 0; kk < NK; kk++) kr[kk] = row8(keys[kk], F16, c0);
        VEC_UNROLL for (int h = 0; h < NH; h++) {
            const __m256 qv = _mm256_loadu_ps(q + (size_t)h * (size_t)hd + (size_t)c0);
            VEC_UNROLL for (int kk = 0; kk < NK; kk++) acc[h * NK + kk] = _mm256_fmadd_ps(qv, kr[kk], acc[h * NK + kk]);
        }
    }
    float out[8];
    _mm256_storeu_ps(out, _mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scale)));
    VEC_UNROLL for (int h = 0; h < NH; h++)
        VEC_UNROLL for (int kk = 0; kk < NK; kk++) scores[(size_t)h * stride + (size_t)kk] = out[h * NK + kk];
}

/* The other side of a tile of NH (1..4) heads with 8 accumulators: 8, 4, 2, 2. */
VEC_INLINE int tile_width(const int NH) { return NH == 1 ? 8 : NH == 2 ? 4 : 2; }

/* The walk of scores and weighted sums: rows [j0, j1) a block of KV_BLOCK at
 * a time (they stay in L1 while every tile of four heads passes over them),
 * and within a block the heads [h0, h0 + nh) four at a time. The first tile
 * pass over a block (pf_n set) prefetches the rows KV_AHEAD further on as it
 * goes; the first KV_AHEAD rows are prefetched before the walk. */
enum { KV_BLOCK = 16 };
#define KV_WALK_BEGIN(rows, n, row_bytes)                                                     \
    prefetch_rows(rows, 0, KV_AHEAD, n, row_bytes);                                           \
    for (int j0 = 0; j0 < (n); j0 += KV_BLOCK) {                                              \
        const int j1 = (n) - j0 < KV_BLOCK ? (n) : j0 + KV_BLOCK;                             \
        for (int h0 = 0; h0 < group; h0 += 4) {                                               \
            const int nh = group - h0 < 4 ? group - h0 : 4, pf_n = h0 == 0 ? (n) : 0;
#define KV_WALK_END() }}

/* The entry points of a scores walk and a weighted-sum walk, built around a
 * tile width's per-head-tile function (HEADS: scores_heads-like,
 * (q, hd, keys, j0, j1, F16, NH, scale, scores, stride, pf_n), or
 * wsum_heads-like, (p, ps, j0, j1, rows, F16, NH, hd, out, pf_n)). The walk
 * takes rows a block at a time and heads four at a time (KV_WALK), with F16
 * and NH compile-time in every HEADS call, and the common head sizes (64, 128)
 * as constants so every slice loop unrolls. SC is the entry's storage class
 * (static, or empty for one the other file calls). */
#define VEC_SCORES_CALL(HEADS, F16, NH) HEADS(qg, hd, keys, j0, j1, F16, NH, scale, sg, stride, pf_n)
#define VEC_WSUM_CALL(HEADS, F16, NH) HEADS(pg, p_stride, j0, j1, rows, F16, NH, hd, og, pf_n)
#define VEC_NH_SWITCH(CALL, HEADS, F16)                                                          \
    switch (nh) {                                                                                \
    case 1: CALL(HEADS, F16, 1); break;                                                          \
    case 2: CALL(HEADS, F16, 2); break;                                                          \
    case 3: CALL(HEADS, F16, 3); break;                                                          \
    default: CALL(HEADS, F16, 4); break;                                                         \
    }
#define VEC_SCORES_WALK(SC, NAME, HEADS)                                                         \
    VEC_TARGET VEC_INLINE void NAME##_body(const float *q, int group, const int hd, const void *const *keys,  \
                                           int n_keys, int k_f16, float scale, float *scores, size_t stride) { \
        KV_WALK_BEGIN(keys, n_keys, kv_row_bytes(k_f16, hd))                                     \
            const float *qg = q + (size_t)h0 * (size_t)hd;                                       \
            float *sg = scores + (size_t)h0 * stride;                                            \
            if (k_f16) { VEC_NH_SWITCH(VEC_SCORES_CALL, HEADS, 1) }                              \
            else { VEC_NH_SWITCH(VEC_SCORES_CALL, HEADS, 0) }                                    \
        KV_WALK_END()                                                                            \
    }                                                                                            \
    VEC_TARGET SC void NAME(const float *q, int group, int hd, const void *const *keys, int n_keys, int k_f16, \
                            float scale, float *scores, size_t stride) {                         \
        if (hd == 64) NAME##_body(q, group, 64, keys, n_keys, k_f16, scale, scores, stride);     \
        else if (hd == 128) NAME##_body(q, group, 128, keys, n_keys, k_f16, scale, scores, stride); \
        else NAME##_body(q, group, hd, keys, n_keys, k_f16, scale, scores, stride);              \
    }
#define VEC_WSUM_WALK(SC, NAME, HEADS)                                                           \
    VEC_TARGET VEC_INLINE void NAME##_body(const float *p, size_t p_stride, int group, int n,   \
                                           const void *const *rows, int v_f16, const int hd, float *out) { \
        memset(out, 0, sizeof(float) * (size_t)group * (size_t)hd);                              \
        KV_WALK_BEGIN(rows, n, kv_row_bytes(v_f16, hd))                                          \
            const float *pg = p + (size_t)h0 * p_stride;                                         \
            float *og = out + (size_t)h0 * (size_t)hd;                                           \
            if (v_f16) { VEC_NH_SWITCH(VEC_WSUM_CALL, HEADS, 1) }                                \
            else { VEC_NH_SWITCH(VEC_WSUM_CALL, HEADS, 0) }                                      \
        KV_WALK_END()                                                                            \
    }                                                                                            \
    VEC_TARGET SC void NAME(const float *p, size_t p_stride, int group, int n, const void *const *rows, int v_f16, \
                            int hd, float *out) {                                                \
        if (hd == 64) NAME##_body(p, p_stride, group, n, rows, v_f16, 64, out);                   \
        else if (hd == 128) NAME##_body(p, p_stride, group, n, rows, v_f16, 128, out);            \
        else NAME##_body(p, p_stride, group, n, rows, v_f16, hd, out);                           \
    }

/* A weighted-sum tile, NAME: NC slices of W output elements from c0 (vectors
 * VT, intrinsics P##_..., row slices by ROW(row, F16, i)), for NH heads
 * (NH * NC <= NACC), over rows [j0, j1): accumulators loaded from and stored
 * back to out, so a long run of rows is taken a block at a time with the same
 * per-element order (row j's product is added after row j - 1's, whatever the
 * block, tile, group or width). */
#define VEC_WSUM_TILE(NAME, VT, P, W, NACC, ROW)                                                  \
    VEC_TARGET VEC_INLINE void NAME(const float *p, size_t ps, int j0, int j1, const void *const *rows, \
                                    const int F16, int c0, const int NH, const int NC, int hd, float *out, int pf_n) { \
        VT acc[NACC];                                                                            \
        VEC_UNROLL for (int h = 0; h < NH; h++)                                                  \
            VEC_UNROLL for (int c = 0; c < NC; c++)                                              \
                acc[h * NC + c] = P##_loadu_ps(out + (size_t)h * (size_t)hd + (size_t)(c0 + W * c)); \
        const size_t row_bytes = kv_row_bytes(F16, hd);                                          \
        for (int j = j0; j < j1; j++) {                                                          \
            if (pf_n) prefetch_rows(rows, j + KV_AHEAD, 1, pf_n, row_bytes);                     \
            VT v[NACC];                                                                          \
            VEC_UNROLL for (int c = 0; c < NC; c++) v[c] = ROW(rows[j], F16, c0 + W * c);        \
            VEC_UNROLL for (int h = 0; h < NH; h++) {                                            \
                const VT pv = P##_set1_ps(p[(size_t)h * ps + (size_t)j]);                        \
                VEC_UNROLL for (int c = 0; c < NC; c++) acc[h * NC + c] = P##_fmadd_ps(pv, v[c], acc[h * NC + c]); \
            }                                                                                    \
        }                                                                                        \
        VEC_UNROLL for (int h = 0; h < NH; h++)                                                  \
            VEC_UNROLL for (int c = 0; c < NC; c++)                                              \
                P##_storeu_ps(out + (size_t)h * (size_t)hd + (size_t)(c0 + W * c), acc[h * NC + c]); \
    }
VEC_WSUM_TILE(wsum_tile, __m256, _mm256, 8, 8, row8)

/* exp(x) for x <= 0 as vec_softmax computes it: x = k ln2 + r, |r| <= ln2 / 2,
 * exp(r) by its Taylor polynomial to r^6 (Horner, fused), times 2^k. */
#define EXP_LO -87.0f /* below this exp is taken as 0 (its true value is < 2e-38): keeps 2^k normal */
static const float exp_c[7] = {1.0f, 1.0f, 0.5f, 1.0f / 6.0f, 1.0f / 24.0f, 1.0f / 120.0f, 1.0f / 720.0f};
static const float ln2_hi = 0.693145751953125f, ln2_lo = 1.428606765330187e-06f, log2e = 1.44269504088896341f;

VEC_TARGET VEC_INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

VEC_TARGET VEC_INLINE __m256 exp8(__m256 x) {
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LO));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(log2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(ln2_lo), _mm256_fnmadd_ps(k, _mm256_set1_ps(ln2_hi), x));
    __m256 p = _mm256_set1_ps(exp_c[6]);
    VEC_UNROLL for (int i = 5; i >= 0; i--) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(exp_c[i]));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* The softmax's maximum (exact, so its order does not matter): four
 * 8-lane maxima side by side, not one chain. */
VEC_TARGET VEC_INLINE float softmax_max(const float *x, int n) {
    __m256 v[4];
    VEC_UNROLL for (int k = 0; k < 4; k++) v[k] = _mm256_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 32 <= n; i += 32) VEC_UNROLL for (int k = 0; k < 4; k++) v[k] = _mm256_max_ps(v[k], _mm256_loadu_ps(x + i + 8 * k));
    for (; i + 8 <= n; i += 8) v[0] = _mm256_max_ps(v[0], _mm256_loadu_ps(x + i));
    const __m256 vmax = _mm256_max_ps(_mm256_max_ps(v[0], v[1]), _mm256_max_ps(v[2], v[3]));
    float m[8], max = -INFINITY;
    _mm256_storeu_ps(m, vmax);
    for (int l = 0; l < 8; l++) max = m[l] > max ? m[l] : max;
    for (; i < n; i++) max = x[i] > max ? x[i] : max;
    return max;
}

/* The softmax's exp from element i on, x[0, i) already exp(x - max) with
 * their sum in vsum (lane l: the elements l mod 8, in order): the rest eight
 * at a time into the same lanes, the tail one by one after the lanes' sum;
 * returns the sum. */
VEC_TARGET VEC_INLINE float softmax_exp_rest(float *x, int i, int n, float max, __m256 vsum) {
    const __m256 vm = _mm256_set1_ps(max);
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
        _mm256_storeu_ps(x + i, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum8(vsum);
    for (; i < n; i++) { /* the tail through the same vector exp, one lane used */
        float e[8];
        _mm256_storeu_ps(e, exp8(_mm256_set1_ps(x[i] - max)));
        x[i] = e[0];
        sum += e[0];
    }
    return sum;
}

/* x[i, n) times 1 / sum. */
VEC_TARGET VEC_INLINE void softmax_scale(float *x, int i, int n, float sum) {
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
    for (; i < n; i++) x[i] *= 1.0f / sum;
}

/* The AVX-512 walks (vecops_avx512.c): same arguments and the same bits as the
 * AVX2 ones, hd a multiple of 8. */
void vec_avx512_scores(const float *q, int group, int hd, const void *const *keys, int n_keys, int k_f16, float scale,
                       float *scores, size_t stride);
void vec_avx512_wsum_group(const float *p, size_t p_stride, int group, int n, const void *const *rows, int v_f16,
                           int hd, float *out);
/* vec_softmax with exp 16 lanes at a time (the same bits: each lane's exp is
 * exp8's, and the sum adds them into the AVX2 walk's eight lanes in order). */
void vec_avx512_softmax(float *x, int n);
/* vec_read_sum with 512-bit loads. */
uint64_t vec_avx512_read_sum(const void *p, size_t n, int streams);

/* How far ahead vec_read_sum prefetches. */
#define VEC_READ_PREFETCH 4096

#endif /* KVS_VECOPS_IMPL_H */
