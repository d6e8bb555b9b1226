/*
 * kv_attn_q8 — attention kernels over q8_0 / q4_0 KV rows (kv_attn.h): the
 * scalar references, AVX2 and AVX-512 VNNI (256 bits wide) paths, and the
 * dispatch that follows quant's ISA choice. The SIMD paths differ from the
 * references only in how they form the exact integer dot of a 32-element
 * block; every float step is the reference's, in its order.
 */
#include "kv_attn.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "cpu.h"
#include "f16.h"
#include "quant.h"
#include "quant_impl.h"
#include "vecops.h"

#define KV_MAX_BLOCKS (KV_ATTN_MAX_HEAD_DIM / QK32)
#define KV_HEAD_TILE 8 /* query heads quantized and scored together per walk over the keys */
#define AVX2_T __attribute__((target("avx2,fma,f16c")))
#define VNNI_T __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))

/* One query head as q8_0 blocks, with each block's scale widened once. */
typedef struct {
    float d[KV_MAX_BLOCKS];
    block_q8_0 b[KV_MAX_BLOCKS];
} kv_qhead;

static void quantize_heads(const float *q, int n_heads, int hd, kv_qhead *out) {
    for (int h = 0; h < n_heads; h++) {
        quant_quantize_row(QUANT_Q8_0, q + (size_t)h * (size_t)hd, out[h].b, hd);
        for (int b = 0; b < hd / QK32; b++) out[h].d[b] = kvs_f16_to_f32(out[h].b[b].d);
    }
}

/* ---- scalar references ---- */

static int isum_q8_ref(const block_q8_0 *k, const int8_t *q) {
    int s = 0;
    for (int i = 0; i < QK32; i++) s += (int)k->qs[i] * (int)q[i];
    return s;
}

static int isum_q4_ref(const block_q4_0 *k, const int8_t *q) {
    int s = 0;
    for (int i = 0; i < QK32 / 2; i++)
        s += ((int)(k->qs[i] & 15) - 8) * (int)q[i] + ((int)(k->qs[i] >> 4) - 8) * (int)q[i + QK32 / 2];
    return s;
}

/* The float steps every path shares: blocks in order, scale last. */
static inline float score_of(const kv_qhead *qh, const float *kd, const int *isum, int nb, float scale) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++) acc += (kd[b] * qh->d[b]) * (float)isum[b];
    return acc * scale;
}

static void key_scales(uint32_t type, const void *key, int nb, float *kd) {
    if (type == QUANT_Q8_0)
        for (int b = 0; b < nb; b++) kd[b] = kvs_f16_to_f32(((const block_q8_0 *)key)[b].d);
    else
        for (int b = 0; b < nb; b++) kd[b] = kvs_f16_to_f32(((const block_q4_0 *)key)[b].d);
}

void kv_attn_scores_ref(uint32_t type, const float *q, int group, int hd, const void *const *keys, int n_keys,
                        float scale, float *scores, size_t stride) {
    kv_qhead qh[KV_HEAD_TILE];
    const int nb = hd / QK32;
    for (int h0 = 0; h0 < group; h0 += KV_HEAD_TILE) {
        int nh = group - h0 < KV_HEAD_TILE ? group - h0 : KV_HEAD_TILE;
        quantize_heads(q + (size_t)h0 * (size_t)hd, nh, hd, qh);
        for (int j = 0; j < n_keys; j++) {
            float kd[KV_MAX_BLOCKS];
            int isum[KV_MAX_BLOCKS];
            key_scales(type, keys[j], nb, kd);
            for (int h = 0; h < nh; h++) {
                for (int b = 0; b < nb; b++)
                    isum[b] = type == QUANT_Q8_0 ? isum_q8_ref((const block_q8_0 *)keys[j] + b, qh[h].b[b].qs)
                                                 : isum_q4_ref((const block_q4_0 *)keys[j] + b, qh[h].b[b].qs);
                scores[(size_t)(h0 + h) * stride + (size_t)j] = score_of(&qh[h], kd, isum, nb, scale);
            }
        }
    }
}

/* Element i of a value row's block b, as a float. */
static inline float value_of(uint32_t type, const void *row, int b, int i) {
    if (type == QUANT_Q8_0) return (float)((const block_q8_0 *)row)[b].qs[i];
    const block_q4_0 *v = (const block_q4_0 *)row + b;
    int nib = i < QK32 / 2 ? v->qs[i] & 15 : v->qs[i - QK32 / 2] >> 4;
    return (float)(nib - 8);
}

static inline float value_scale(uint32_t type, const void *row, int b) {
    return kvs_f16_to_f32(type == QUANT_Q8_0 ? ((const block_q8_0 *)row)[b].d : ((const block_q4_0 *)row)[b].d);
}

void kv_attn_wsum_ref(uint32_t type, const float *p, size_t p_stride, int group, int n, const void *const *rows, int hd,
                      float *out) {
    memset(out, 0, (size_t)group * (size_t)hd * sizeof(float));
    for (int h = 0; h < group; h++) {
        float *o = out + (size_t)h * (size_t)hd;
        for (int j = 0; j < n; j++)
            for (int b = 0; b < hd / QK32; b++) {
                const float w = p[(size_t)h * p_stride + (size_t)j] * value_scale(type, rows[j], b);
                for (int i = 0; i < QK32; i++) o[b * QK32 + i] = o[b * QK32 + i] + w * value_of(type, rows[j], b, i);
            }
    }
}

/* ---- AVX2 and AVX-512 VNNI ---- */

/* A block's 32 elements as signed bytes (q4_0: nibble - 8, low nibbles first). */
AVX2_T static inline __m256i block_bytes_q8(const block_q8_0 *k) { return _mm256_loadu_si256((const __m256i *)k->qs); }

AVX2_T static inline __m256i block_bytes_q4(const block_q4_0 *k) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)k->qs), m = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(raw, m), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m);
    return _mm256_sub_epi8(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(8));
}

AVX2_T static inline int hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* Exact: |x| <= 127 and |y| <= 127, so the pairwise i16 sums cannot saturate. */
AVX2_T static inline int isum_avx2(__m256i x, __m256i y) {
    const __m256i ax = _mm256_sign_epi8(x, x), sy = _mm256_sign_epi8(y, x);
    return hsum_i32(_mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1)));
}

VNNI_T static inline int isum_vnni(__m256i x, __m256i y) {
    const __m256i ax = _mm256_sign_epi8(x, x), sy = _mm256_sign_epi8(y, x);
    return hsum_i32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy));
}

#define KV_SCORES_SIMD(NAME, TARGET, ISUM)                                                                          \
    TARGET static void NAME(uint32_t type, const float *q, int group, int hd, const void *const *keys, int n_keys,  \
                            float scale, float *scores, size_t stride) {                                           \
        kv_qhead qh[KV_HEAD_TILE];                                                                                 \
        const int nb = hd / QK32;                                                                                  \
        for (int h0 = 0; h0 < group; h0 += KV_HEAD_TILE) {                                                         \
            int nh = group - h0 < KV_HEAD_TILE ? group - h0 : KV_HEAD_TILE;                                        \
            quantize_heads(q + (size_t)h0 * (size_t)hd, nh, hd, qh);                                               \
            for (int j = 0; j < n_keys; j++) {                                                                     \
                float kd[KV_MAX_BLOCKS];                                                                           \
                int isum[KV_MAX_BLOCKS];                                                                           \
                __m256i kx[KV_MAX_BLOCKS];                                                                         \
                if (j + 8 < n_keys) _mm_prefetch((const char *)keys[j + 8], _MM_HINT_T0);                          \
                key_scales(type, keys[j], nb, kd);                                                                 \
                for (int b = 0; b < nb; b++)                                                                       \
                    kx[b] = type == QUANT_Q8_0 ? block_bytes_q8((const block_q8_0 *)keys[j] + b)                   \
                                               : block_bytes_q4((const block_q4_0 *)keys[j] + b);                  \
                for (int h = 0; h < nh; h++) {                                                                     \
                    for (int b = 0; b < nb; b++)                                                                   \
                        isum[b] = ISUM(kx[b], _mm256_loadu_si256((const __m256i *)qh[h].b[b].qs));                 \
                    scores[(size_t)(h0 + h) * stride + (size_t)j] = score_of(&qh[h], kd, isum, nb, scale);         \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
    }

KV_SCORES_SIMD(scores_avx2, AVX2_T, isum_avx2)
KV_SCORES_SIMD(scores_vnni, VNNI_T, isum_vnni)

/* Value block b of a row as four vectors of eight floats, elements in order. */
AVX2_T static inline void value_block(uint32_t type, const void *row, int b, __m256 x[4]) {
    const __m256i v = type == QUANT_Q8_0 ? block_bytes_q8((const block_q8_0 *)row + b)
                                         : block_bytes_q4((const block_q4_0 *)row + b);
    const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    x[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    x[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    x[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    x[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

/* Per output block of up to two heads: the value rows in order, each dequantized once for
 * both; multiply then add (no fused step), as the reference rounds. */
AVX2_T static void wsum_avx2(uint32_t type, const float *p, size_t p_stride, int group, int n,
                             const void *const *rows, int hd, float *out) {
    for (int h0 = 0; h0 < group; h0 += 2) {
        const int nh = group - h0 < 2 ? group - h0 : 2;
        for (int b = 0; b < hd / QK32; b++) {
            __m256 acc[2][4];
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < 4; i++) acc[h][i] = _mm256_setzero_ps();
            for (int j = 0; j < n; j++) {
                __m256 x[4];
                if (j + 8 < n) _mm_prefetch((const char *)rows[j + 8] + b * (type == QUANT_Q8_0 ? 34 : 18), _MM_HINT_T0);
                value_block(type, rows[j], b, x);
                const float d = value_scale(type, rows[j], b);
                for (int h = 0; h < nh; h++) {
                    const __m256 w = _mm256_set1_ps(p[(size_t)(h0 + h) * p_stride + (size_t)j] * d);
                    for (int i = 0; i < 4; i++) acc[h][i] = _mm256_add_ps(acc[h][i], _mm256_mul_ps(w, x[i]));
                }
            }
            for (int h = 0; h < nh; h++)
                for (int i = 0; i < 4; i++)
                    _mm256_storeu_ps(out + (size_t)(h0 + h) * (size_t)hd + (size_t)(b * QK32 + 8 * i), acc[h][i]);
        }
    }
}

/* ---- rotation (kv_attn.h) ---- */

int kv_attn_rot_k(uint32_t type, int hd) {
    if ((type != QUANT_Q8_0 && type != QUANT_Q4_0) || hd % 64 != 0) return 0;
    int n = 64;
    while (hd % (2 * n) == 0) n *= 2;
    return n;
}

int kv_attn_rot_v(uint32_t type, int hd) {
    return (type == QUANT_Q8_0 || type == QUANT_Q4_0) && hd % 64 == 0 ? 64 : 0;
}

void kv_attn_rotate(float *x, int len, int n) {
    const float c = 1.0f / sqrtf((float)n);
    for (float *r = x; r < x + len; r += n) {
        for (int s = 1; s < n; s *= 2) /* the fast transform: butterflies of width s */
            for (int i = 0; i < n; i += 2 * s)
                for (int j = i; j < i + s; j++) {
                    const float a = r[j], b = r[j + s];
                    r[j] = a + b;
                    r[j + s] = a - b;
                }
        for (int i = 0; i < n; i++) r[i] *= c;
    }
}

/* ---- dispatch ---- */

static int use_vnni(void) {
    static int cpu = -1; /* the emulated AVX-512 build may claim the ISA on a CPU without VNNI */
    if (cpu < 0) cpu = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
    return cpu && kvs_isa_current() == KVS_ISA_AVX512;
}

void kv_attn_store_row(uint32_t type, const float *x, void *dst, int hd) {
    if (type == QUANT_F32) memcpy(dst, x, (size_t)hd * sizeof(float));
    else quant_quantize_row(type, x, dst, hd); /* f16, q8_0, q4_0 */
}

void kv_attn_scores(uint32_t type, const float *q, int group, int hd, const void *const *keys, int n_keys, float scale,
                    float *scores, size_t stride) {
    if (type == QUANT_F32 || type == QUANT_F16)
        vec_scores(q, group, hd, keys, n_keys, type == QUANT_F16, scale, scores, stride);
    else if (use_vnni()) scores_vnni(type, q, group, hd, keys, n_keys, scale, scores, stride);
    else if (kvs_isa_current() != KVS_ISA_SCALAR) scores_avx2(type, q, group, hd, keys, n_keys, scale, scores, stride);
    else kv_attn_scores_ref(type, q, group, hd, keys, n_keys, scale, scores, stride);
}

void kv_attn_wsum(uint32_t type, const float *p, size_t p_stride, int group, int n, const void *const *rows, int hd,
                  float *out) {
    if (type == QUANT_F32 || type == QUANT_F16) vec_wsum_group(p, p_stride, group, n, rows, type == QUANT_F16, hd, out);
    else if (kvs_isa_current() != KVS_ISA_SCALAR) wsum_avx2(type, p, p_stride, group, n, rows, hd, out);
    else kv_attn_wsum_ref(type, p, p_stride, group, n, rows, hd, out);
}
