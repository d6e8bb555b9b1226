#include "vecops.h"

#include <immintrin.h>

#include "quant.h"

/* ---- scalar ---- */

static float dot_f32_ref(const float *a, const float *b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static float dot_f32_f16_ref(const float *a, const uint16_t *b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * quant_f16_to_f32(b[i]);
    return s;
}

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

VEC_TARGET static float dot_f32_avx2(const float *a, const float *b, int n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    float s = hsum8(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

VEC_TARGET static float dot_f32_f16_avx2(const float *a, const uint16_t *b, int n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 b0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i)));
        __m256 b1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i + 8)));
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), b0, acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), b1, acc1);
    }
    for (; i + 8 <= n; i += 8)
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i))), acc0);
    float s = hsum8(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) s += a[i] * _cvtsh_ss(b[i]);
    return s;
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

/* ---- dispatch: follows quant's choice so a test that forces scalar gets scalar here too ---- */

static inline int use_simd(void) { return quant_isa_current() != QUANT_ISA_SCALAR; }

float vec_dot_f32(const float *a, const float *b, int n) {
    return use_simd() ? dot_f32_avx2(a, b, n) : dot_f32_ref(a, b, n);
}

float vec_dot_f32_f16(const float *a, const uint16_t *b, int n) {
    return use_simd() ? dot_f32_f16_avx2(a, b, n) : dot_f32_f16_ref(a, b, n);
}

void vec_axpy_f32(float a, const float *x, float *y, int n) {
    if (use_simd()) axpy_f32_avx2(a, x, y, n);
    else axpy_f32_ref(a, x, y, n);
}

void vec_axpy_f16(float a, const uint16_t *x, float *y, int n) {
    if (use_simd()) axpy_f16_avx2(a, x, y, n);
    else axpy_f16_ref(a, x, y, n);
}
