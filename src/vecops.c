#include "vecops.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "quant.h"

/* ---- scalar ---- */

static void axpy_f32_ref(float a, const float *x, float *y, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

static void axpy_f16_ref(float a, const uint16_t *x, float *y, int n) {
    for (int i = 0; i < n; i++) y[i] += a * quant_f16_to_f32(x[i]);
}

/* ---- AVX2 + FMA + F16C ---- */

#define VEC_TARGET __attribute__((target("avx2,fma,f16c")))

VEC_TARGET static float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

VEC_TARGET static void axpy_f32_avx2(float a, const float *x, float *y, int n) {
    __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

VEC_TARGET static void axpy_f16_avx2(float a, const uint16_t *x, float *y, int n) {
    __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 vx = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i)));
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, vx, _mm256_loadu_ps(y + i)));
    }
    for (; i < n; i++) y[i] += a * _cvtsh_ss(x[i]);
}

/* exp(x) for x <= 0 as vec_softmax computes it: x = k ln2 + r, |r| <= ln2 / 2,
 * exp(r) by its Taylor polynomial to r^6 (Horner, fused), times 2^k. */
#define EXP_LO -87.0f /* below this exp is taken as 0 (its true value is < 2e-38): keeps 2^k normal */
static const float exp_c[7] = {1.0f, 1.0f, 0.5f, 1.0f / 6.0f, 1.0f / 24.0f, 1.0f / 120.0f, 1.0f / 720.0f};
static const float ln2_hi = 0.693145751953125f, ln2_lo = 1.428606765330187e-06f, log2e = 1.44269504088896341f;

static float exp_ref(float x) {
    if (!(x >= EXP_LO)) return 0.0f;
    const float k = nearbyintf(x * log2e);
    const float r = fmaf(-k, ln2_lo, fmaf(-k, ln2_hi, x));
    float p = exp_c[6];
    for (int i = 5; i >= 0; i--) p = fmaf(p, r, exp_c[i]);
    return ldexpf(p, (int)k);
}

static void softmax_ref(float *x, int n) {
    float max = -INFINITY;
    for (int i = 0; i < n; i++) max = x[i] > max ? x[i] : max;
    float sum = 0;
    for (int i = 0; i < n; i++) {
        x[i] = exp_ref(x[i] - max);
        sum += x[i];
    }
    const float inv = 1.0f / sum;
    for (int i = 0; i < n; i++) x[i] *= inv;
}

/* silu(g) * u with e = exp(-|g|) in (0, 1] (no overflow for any g):
 * sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) below. */
static void swiglu_ref(float *gate, const float *up, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i], e = exp_ref(-fabsf(g)), r = 1.0f / (1.0f + e);
        gate[i] = g * (g >= 0.0f ? r : e * r) * up[i];
    }
}

/* Key element i as f32. */
static inline float key_at(const void *k, int k_f16, int i) {
    return k_f16 ? quant_f16_to_f32(((const uint16_t *)k)[i]) : ((const float *)k)[i];
}

static void scores_ref(const float *q, int group, int hd, const void *k, int k_f16, float scale, float *scores,
                       size_t stride) { /* one key */
    for (int h = 0; h < group; h++) {
        float s = 0;
        for (int i = 0; i < hd; i++) s += q[(size_t)h * (size_t)hd + (size_t)i] * key_at(k, k_f16, i);
        scores[(size_t)h * stride] = s * scale;
    }
}

static void wsum_ref(const float *p, int n, const void *const *rows, int v_f16, int hd, float *out) {
    memset(out, 0, (size_t)hd * sizeof(float));
    for (int j = 0; j < n; j++)
        for (int i = 0; i < hd; i++) out[i] += p[j] * key_at(rows[j], v_f16, i);
}

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

#define VEC_INLINE static inline __attribute__((always_inline))
#define VEC_UNROLL _Pragma("GCC unroll 8")

/* Software prefetch of rows [j, j + n) of a row list, row_bytes each, when
 * they exist: a head's KV rows are short contiguous runs (one per KV block)
 * scattered over the arena, which the hardware prefetchers follow poorly.
 * The walks issue it a tile at a time, between the tiles' arithmetic: a burst
 * of a whole block's prefetches at once overlapped less with the arithmetic
 * (2-13 % slower attention in decode at 2016 positions, BENCHMARKS.md). */
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

/* Keys [j0, j1) against NH (1..4) heads: tile_width(NH) keys at a time, then
 * one by one. With pf_n (the list's length; 0: none), each tile first
 * prefetches the rows KV_AHEAD past its own. */
VEC_TARGET VEC_INLINE void scores_heads(const float *q, int hd, const void *const *keys, int j0, int j1, const int F16,
                                        const int NH, float scale, float *scores, size_t stride, int pf_n) {
    const int NK = tile_width(NH);
    const size_t row_bytes = kv_row_bytes(F16, hd);
    int j = j0;
    for (; j + NK <= j1; j += NK) {
        if (pf_n) prefetch_rows(keys, j + KV_AHEAD, NK, pf_n, row_bytes);
        scores_tile(q, hd, keys + j, F16, NH, NK, scale, scores + j, stride);
    }
    for (; j < j1; j++) {
        if (pf_n) prefetch_rows(keys, j + KV_AHEAD, 1, pf_n, row_bytes);
        scores_tile(q, hd, keys + j, F16, NH, 1, scale, scores + j, stride);
    }
}

#define SCORES_NH(F16)                                                                               \
    switch (nh) {                                                                                    \
    case 1: scores_heads(qg, hd, keys, j0, j1, F16, 1, scale, sg, stride, pf_n); break;              \
    case 2: scores_heads(qg, hd, keys, j0, j1, F16, 2, scale, sg, stride, pf_n); break;              \
    case 3: scores_heads(qg, hd, keys, j0, j1, F16, 3, scale, sg, stride, pf_n); break;              \
    default: scores_heads(qg, hd, keys, j0, j1, F16, 4, scale, sg, stride, pf_n); break;             \
    }

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

/* hd a multiple of 8: keys a block at a time, four heads at a time within a block. */
VEC_TARGET VEC_INLINE void scores_body(const float *q, int group, const int hd, const void *const *keys, int n_keys,
                                       int k_f16, float scale, float *scores, size_t stride) {
    KV_WALK_BEGIN(keys, n_keys, kv_row_bytes(k_f16, hd))
        const float *qg = q + (size_t)h0 * (size_t)hd;
        float *sg = scores + (size_t)h0 * stride;
        if (k_f16) { SCORES_NH(1) } else { SCORES_NH(0) }
    KV_WALK_END()
}

/* NC slices of eight output elements from c0, for NH heads (NH * NC <= 8), over
 * rows [j0, j1): accumulators loaded from and stored back to out, so a long
 * run of rows is taken a block at a time with the same per-element order (row
 * j's product is added after row j - 1's, whatever the block, tile or group). */
VEC_TARGET VEC_INLINE void wsum_tile(const float *p, size_t ps, int j0, int j1, const void *const *rows, const int F16,
                                     int c0, const int NH, const int NC, int hd, float *out, int pf_n) {
    __m256 acc[8];
    VEC_UNROLL for (int h = 0; h < NH; h++)
        VEC_UNROLL for (int c = 0; c < NC; c++)
            acc[h * NC + c] = _mm256_loadu_ps(out + (size_t)h * (size_t)hd + (size_t)(c0 + 8 * c));
    const size_t row_bytes = kv_row_bytes(F16, hd);
    for (int j = j0; j < j1; j++) {
        if (pf_n) prefetch_rows(rows, j + KV_AHEAD, 1, pf_n, row_bytes);
        __m256 v[8];
        VEC_UNROLL for (int c = 0; c < NC; c++) v[c] = row8(rows[j], F16, c0 + 8 * c);
        VEC_UNROLL for (int h = 0; h < NH; h++) {
            const __m256 pv = _mm256_set1_ps(p[(size_t)h * ps + (size_t)j]);
            VEC_UNROLL for (int c = 0; c < NC; c++) acc[h * NC + c] = _mm256_fmadd_ps(pv, v[c], acc[h * NC + c]);
        }
    }
    VEC_UNROLL for (int h = 0; h < NH; h++)
        VEC_UNROLL for (int c = 0; c < NC; c++)
            _mm256_storeu_ps(out + (size_t)h * (size_t)hd + (size_t)(c0 + 8 * c), acc[h * NC + c]);
}

/* NH (1..4) heads over rows [j0, j1): tile_width(NH) slices at a time while
 * they fit, then one; the first slice pass prefetches as scores_heads does. */
VEC_TARGET VEC_INLINE void wsum_heads(const float *p, size_t ps, int j0, int j1, const void *const *rows, const int F16,
                                      const int NH, int hd, float *out, int pf_n) {
    const int NC = tile_width(NH);
    int c0 = 0;
    for (; c0 + 8 * NC <= hd; c0 += 8 * NC) wsum_tile(p, ps, j0, j1, rows, F16, c0, NH, NC, hd, out, c0 ? 0 : pf_n);
    for (; c0 < hd; c0 += 8) wsum_tile(p, ps, j0, j1, rows, F16, c0, NH, 1, hd, out, c0 ? 0 : pf_n);
}

#define WSUM_NH(F16)                                                                                  \
    switch (nh) {                                                                                     \
    case 1: wsum_heads(pg, p_stride, j0, j1, rows, F16, 1, hd, og, pf_n); break;                      \
    case 2: wsum_heads(pg, p_stride, j0, j1, rows, F16, 2, hd, og, pf_n); break;                      \
    case 3: wsum_heads(pg, p_stride, j0, j1, rows, F16, 3, hd, og, pf_n); break;                      \
    default: wsum_heads(pg, p_stride, j0, j1, rows, F16, 4, hd, og, pf_n); break;                     \
    }

/* Rows a block at a time (their value slices and probabilities stay in L1),
 * four heads at a time. */
VEC_TARGET VEC_INLINE void wsum_body(const float *p, size_t p_stride, int group, int n, const void *const *rows,
                                     int v_f16, const int hd, float *out) {
    memset(out, 0, sizeof(float) * (size_t)group * (size_t)hd);
    KV_WALK_BEGIN(rows, n, kv_row_bytes(v_f16, hd))
        const float *pg = p + (size_t)h0 * p_stride;
        float *og = out + (size_t)h0 * (size_t)hd;
        if (v_f16) { WSUM_NH(1) } else { WSUM_NH(0) }
    KV_WALK_END()
}

/* The common head sizes as constants, so every slice loop unrolls. */
VEC_TARGET static void scores_avx2(const float *q, int group, int hd, const void *const *keys, int n_keys, int k_f16,
                                   float scale, float *scores, size_t stride) {
    if (hd == 64) scores_body(q, group, 64, keys, n_keys, k_f16, scale, scores, stride);
    else if (hd == 128) scores_body(q, group, 128, keys, n_keys, k_f16, scale, scores, stride);
    else scores_body(q, group, hd, keys, n_keys, k_f16, scale, scores, stride);
}

VEC_TARGET static void wsum_group_avx2(const float *p, size_t p_stride, int group, int n, const void *const *rows,
                                       int v_f16, int hd, float *out) {
    if (hd == 64) wsum_body(p, p_stride, group, n, rows, v_f16, 64, out);
    else if (hd == 128) wsum_body(p, p_stride, group, n, rows, v_f16, 128, out);
    else wsum_body(p, p_stride, group, n, rows, v_f16, hd, out);
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

VEC_TARGET static void softmax_avx2(float *x, int n) {
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(x + i));
    float m[8], max = -INFINITY;
    _mm256_storeu_ps(m, vmax);
    for (int l = 0; l < 8; l++) max = m[l] > max ? m[l] : max;
    for (; i < n; i++) max = x[i] > max ? x[i] : max;
    const __m256 vm = _mm256_set1_ps(max);
    __m256 vsum = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
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
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
    for (; i < n; i++) x[i] *= 1.0f / sum;
}

VEC_TARGET static void swiglu_avx2(float *gate, const float *up, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp8(_mm256_or_ps(g, sign)); /* exp(-|g|) */
        const __m256 r = _mm256_div_ps(one, _mm256_add_ps(one, e));
        const __m256 s = _mm256_blendv_ps(r, _mm256_mul_ps(e, r), g); /* sign bit of g set: e / (1 + e) */
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(_mm256_mul_ps(g, s), _mm256_loadu_ps(up + i)));
    }
    if (i < n) swiglu_ref(gate + i, up + i, n - i);
}

/* ---- dispatch: follows quant's choice so a test that forces scalar gets scalar here too ---- */

static inline int use_simd(void) { return quant_isa_current() != QUANT_ISA_SCALAR; }

void vec_axpy_f32(float a, const float *x, float *y, int n) {
    if (use_simd()) axpy_f32_avx2(a, x, y, n);
    else axpy_f32_ref(a, x, y, n);
}

void vec_axpy_f16(float a, const uint16_t *x, float *y, int n) {
    if (use_simd()) axpy_f16_avx2(a, x, y, n);
    else axpy_f16_ref(a, x, y, n);
}

void vec_scores(const float *q, int group, int hd, const void *const *keys, int n_keys, int k_f16, float scale,
                float *scores, size_t stride) {
    if (use_simd() && hd % 8 == 0) scores_avx2(q, group, hd, keys, n_keys, k_f16, scale, scores, stride);
    else
        for (int j = 0; j < n_keys; j++) scores_ref(q, group, hd, keys[j], k_f16, scale, scores + j, stride);
}

void vec_softmax(float *x, int n) {
    if (use_simd()) softmax_avx2(x, n);
    else softmax_ref(x, n);
}

void vec_wsum_group(const float *p, size_t p_stride, int group, int n, const void *const *rows, int v_f16, int hd,
                    float *out) {
    if (use_simd() && hd % 8 == 0) wsum_group_avx2(p, p_stride, group, n, rows, v_f16, hd, out);
    else
        for (int h = 0; h < group; h++)
            wsum_ref(p + (size_t)h * p_stride, n, rows, v_f16, hd, out + (size_t)h * (size_t)hd);
}

void vec_swiglu(float *gate, const float *up, int64_t n) {
    if (use_simd()) swiglu_avx2(gate, up, n);
    else swiglu_ref(gate, up, n);
}
