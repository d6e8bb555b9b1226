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

/* One key row against NH heads (1..8), F16 and NH compile-time after inlining
 * so that the key (64 elements at a time) and the accumulators stay in registers. */
VEC_TARGET VEC_INLINE void scores_nh(const float *q, int hd, const void *k, const int F16, const int NH, float scale,
                                     float *scores, size_t stride) {
    __m256 acc[8];
    VEC_UNROLL for (int h = 0; h < 8; h++) acc[h] = _mm256_setzero_ps();
    int c0 = 0;
    for (; c0 + 64 <= hd; c0 += 64) {
        __m256 kr[8];
        VEC_UNROLL for (int c = 0; c < 8; c++) kr[c] = row8(k, F16, c0 + 8 * c);
        VEC_UNROLL for (int h = 0; h < NH; h++)
            VEC_UNROLL for (int c = 0; c < 8; c++)
                acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)h * (size_t)hd + (size_t)(c0 + 8 * c)), kr[c], acc[h]);
    }
    for (; c0 < hd; c0 += 8) {
        const __m256 kr = row8(k, F16, c0);
        VEC_UNROLL for (int h = 0; h < NH; h++)
            acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)h * (size_t)hd + (size_t)c0), kr, acc[h]);
    }
    float out[8];
    _mm256_storeu_ps(out, _mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scale)));
    VEC_UNROLL for (int h = 0; h < NH; h++) scores[(size_t)h * stride] = out[h];
}

#define SCORES_NH(F16)                                                                               \
    switch (nh) {                                                                                    \
    case 1: scores_nh(qg, hd, k, F16, 1, scale, sg, stride); break;                                  \
    case 2: scores_nh(qg, hd, k, F16, 2, scale, sg, stride); break;                                  \
    case 3: scores_nh(qg, hd, k, F16, 3, scale, sg, stride); break;                                  \
    case 4: scores_nh(qg, hd, k, F16, 4, scale, sg, stride); break;                                  \
    case 5: scores_nh(qg, hd, k, F16, 5, scale, sg, stride); break;                                  \
    case 6: scores_nh(qg, hd, k, F16, 6, scale, sg, stride); break;                                  \
    case 7: scores_nh(qg, hd, k, F16, 7, scale, sg, stride); break;                                  \
    default: scores_nh(qg, hd, k, F16, 8, scale, sg, stride); break;                                 \
    }

/* hd a multiple of 8: every key, eight heads at a time. */
VEC_TARGET static void scores_avx2(const float *q, int group, int hd, const uint8_t *kb, size_t k_stride, int n_keys,
                                   int k_f16, float scale, float *scores, size_t stride) {
    for (int h0 = 0; h0 < group; h0 += 8) {
        const int nh = group - h0 < 8 ? group - h0 : 8;
        const float *qg = q + (size_t)h0 * (size_t)hd;
        for (int j = 0; j < n_keys; j++) {
            const void *k = kb + (size_t)j * k_stride;
            float *sg = scores + (size_t)h0 * stride + (size_t)j;
            if (k_f16) { SCORES_NH(1) } else { SCORES_NH(0) }
        }
    }
}

/* Eight output elements c0.. of NH heads (1..8) over every row: one value
 * load and conversion per row for all heads (NH, F16 compile-time). */
VEC_TARGET VEC_INLINE void wsum_heads(const float *p, size_t ps, int n, const void *const *rows, const int F16, int c0,
                                      const int NH, int hd, float *out) {
    __m256 acc[8];
    VEC_UNROLL for (int h = 0; h < NH; h++) acc[h] = _mm256_setzero_ps();
    for (int j = 0; j < n; j++) {
        const __m256 v = row8(rows[j], F16, c0);
        VEC_UNROLL for (int h = 0; h < NH; h++)
            acc[h] = _mm256_fmadd_ps(_mm256_set1_ps(p[(size_t)h * ps + (size_t)j]), v, acc[h]);
    }
    VEC_UNROLL for (int h = 0; h < NH; h++) _mm256_storeu_ps(out + (size_t)h * (size_t)hd + c0, acc[h]);
}

#define WSUM_NH(F16)                                                                                  \
    switch (nh) {                                                                                     \
    case 1: wsum_heads(pg, p_stride, n, rows, F16, c0, 1, hd, og); break;                             \
    case 2: wsum_heads(pg, p_stride, n, rows, F16, c0, 2, hd, og); break;                             \
    case 3: wsum_heads(pg, p_stride, n, rows, F16, c0, 3, hd, og); break;                             \
    case 4: wsum_heads(pg, p_stride, n, rows, F16, c0, 4, hd, og); break;                             \
    case 5: wsum_heads(pg, p_stride, n, rows, F16, c0, 5, hd, og); break;                             \
    case 6: wsum_heads(pg, p_stride, n, rows, F16, c0, 6, hd, og); break;                             \
    case 7: wsum_heads(pg, p_stride, n, rows, F16, c0, 7, hd, og); break;                             \
    default: wsum_heads(pg, p_stride, n, rows, F16, c0, 8, hd, og); break;                            \
    }

VEC_TARGET static void wsum_group_avx2(const float *p, size_t p_stride, int group, int n, const void *const *rows,
                                       int v_f16, int hd, float *out) {
    for (int h0 = 0; h0 < group; h0 += 8) {
        const int nh = group - h0 < 8 ? group - h0 : 8;
        const float *pg = p + (size_t)h0 * p_stride;
        float *og = out + (size_t)h0 * (size_t)hd;
        for (int c0 = 0; c0 < hd; c0 += 8) {
            if (v_f16) { WSUM_NH(1) } else { WSUM_NH(0) }
        }
    }
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

void vec_scores(const float *q, int group, int hd, const void *k, size_t k_stride, int n_keys, int k_f16,
                float scale, float *scores, size_t stride) {
    const uint8_t *kb = k;
    if (use_simd() && hd % 8 == 0) scores_avx2(q, group, hd, kb, k_stride, n_keys, k_f16, scale, scores, stride);
    else
        for (int j = 0; j < n_keys; j++) scores_ref(q, group, hd, kb + (size_t)j * k_stride, k_f16, scale, scores + j, stride);
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
