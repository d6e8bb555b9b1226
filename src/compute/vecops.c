#include "vecops.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "cpu.h"
#include "f16.h"
#define VEC_TARGET __attribute__((target("avx2,fma,f16c")))
#include "vecops_impl.h"

/* ---- scalar ---- */

static void axpy_f32_ref(float a, const float *x, float *y, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

static void axpy_f16_ref(float a, const uint16_t *x, float *y, int n) {
    for (int i = 0; i < n; i++) y[i] += a * kvs_f16_to_f32(x[i]);
}

/* ---- AVX2 + FMA + F16C ---- */

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
    return k_f16 ? kvs_f16_to_f32(((const uint16_t *)k)[i]) : ((const float *)k)[i];
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

VEC_SCORES_WALK(static, scores_avx2, scores_heads)

/* NH (1..4) heads over rows [j0, j1): tile_width(NH) slices at a time while
 * they fit, then one; the first slice pass prefetches as scores_heads does. */
VEC_TARGET VEC_INLINE void wsum_heads(const float *p, size_t ps, int j0, int j1, const void *const *rows, const int F16,
                                      const int NH, int hd, float *out, int pf_n) {
    const int NC = tile_width(NH);
    int c0 = 0;
    for (; c0 + 8 * NC <= hd; c0 += 8 * NC) wsum_tile(p, ps, j0, j1, rows, F16, c0, NH, NC, hd, out, c0 ? 0 : pf_n);
    for (; c0 < hd; c0 += 8) wsum_tile(p, ps, j0, j1, rows, F16, c0, NH, 1, hd, out, c0 ? 0 : pf_n);
}

VEC_WSUM_WALK(static, wsum_group_avx2, wsum_heads)

VEC_TARGET static void softmax_avx2(float *x, int n) {
    const float max = softmax_max(x, n);
    softmax_scale(x, 0, n, softmax_exp_rest(x, 0, n, max, _mm256_setzero_ps()));
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

static uint64_t read_sum_ref(const void *p, size_t n, int streams) {
    const size_t part = n / 8 / (size_t)streams; /* words per stream */
    const uint64_t *w = p;
    uint64_t a = 0, b = 0, c = 0, d = 0;
    for (size_t i = 0; i + 4 <= part; i += 4)
        for (int k = 0; k < streams; k++) {
            const uint64_t *q = w + (size_t)k * part + i;
            a += q[0];
            b += q[1];
            c += q[2];
            d += q[3];
        }
    return a + b + c + d;
}

VEC_TARGET static uint64_t read_sum_avx2(const void *p, size_t n, int streams) {
    const uint8_t *b = p;
    const size_t part = n / (size_t)streams;
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
    for (size_t i = 0; i < part; i += 128)
        for (int k = 0; k < streams; k++) {
            const uint8_t *q = b + (size_t)k * part + i;
            _mm_prefetch((const char *)q + VEC_READ_PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)q + VEC_READ_PREFETCH + 64, _MM_HINT_T0);
            s0 = _mm256_add_epi64(s0, _mm256_load_si256((const __m256i *)q));
            s1 = _mm256_add_epi64(s1, _mm256_load_si256((const __m256i *)(q + 32)));
            s2 = _mm256_add_epi64(s2, _mm256_load_si256((const __m256i *)(q + 64)));
            s3 = _mm256_add_epi64(s3, _mm256_load_si256((const __m256i *)(q + 96)));
        }
    const __m256i s = _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3));
    uint64_t w[4];
    _mm256_storeu_si256((__m256i *)w, s);
    return w[0] + w[1] + w[2] + w[3];
}

/* ---- dispatch: the ISA of base/cpu.h, quant's too, so a test that forces scalar gets scalar here too ---- */

static inline int use_simd(void) { return kvs_isa_current() != KVS_ISA_SCALAR; }
/* The 512-bit attention walks (vecops_avx512.c): the same bits as the AVX2 ones. */
static inline int use_avx512(void) { return kvs_isa_current() == KVS_ISA_AVX512; }

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
    if (use_avx512() && hd % 8 == 0) vec_avx512_scores(q, group, hd, keys, n_keys, k_f16, scale, scores, stride);
    else if (use_simd() && hd % 8 == 0) scores_avx2(q, group, hd, keys, n_keys, k_f16, scale, scores, stride);
    else
        for (int j = 0; j < n_keys; j++) scores_ref(q, group, hd, keys[j], k_f16, scale, scores + j, stride);
}

void vec_softmax(float *x, int n) {
    if (use_avx512()) vec_avx512_softmax(x, n);
    else if (use_simd()) softmax_avx2(x, n);
    else softmax_ref(x, n);
}

void vec_wsum_group(const float *p, size_t p_stride, int group, int n, const void *const *rows, int v_f16, int hd,
                    float *out) {
    if (use_avx512() && hd % 8 == 0) vec_avx512_wsum_group(p, p_stride, group, n, rows, v_f16, hd, out);
    else if (use_simd() && hd % 8 == 0) wsum_group_avx2(p, p_stride, group, n, rows, v_f16, hd, out);
    else
        for (int h = 0; h < group; h++)
            wsum_ref(p + (size_t)h * p_stride, n, rows, v_f16, hd, out + (size_t)h * (size_t)hd);
}

void vec_swiglu(float *gate, const float *up, int64_t n) {
    if (use_simd()) swiglu_avx2(gate, up, n);
    else swiglu_ref(gate, up, n);
}

uint64_t vec_read_sum(const void *p, size_t n, int streams) {
    if (use_avx512()) return vec_avx512_read_sum(p, n, streams);
    if (use_simd()) return read_sum_avx2(p, n, streams);
    return read_sum_ref(p, n, streams);
}
