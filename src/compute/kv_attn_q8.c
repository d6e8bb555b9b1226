/*
 * kv_attn_q8 — attention kernels over q8_0 / q4_0 KV rows (kv_attn.h): the
 * scalar references, AVX2 and AVX-512 VNNI paths, and the dispatch that
 * follows quant's ISA choice. The SIMD paths differ from the
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
#define KV_PF 32 /* rows fetched ahead: a decode step's rows come from memory, not cache */
#define KV_UNROLL _Pragma("GCC unroll 8") /* the tile's accumulators stay in registers only unrolled */
#define AVX2_T __attribute__((target("avx2,fma,f16c")))

/* One query head as q8_0 blocks, with each block's scale widened once. */
typedef struct {
    float d[KV_MAX_BLOCKS];
    block_q8_0 b[KV_MAX_BLOCKS];
} kv_qhead;

static void quantize_q8(const float *x, block_q8_0 *y, int n);

static void quantize_heads(const float *q, int n_heads, int hd, kv_qhead *out) {
    for (int h = 0; h < n_heads; h++) {
        quantize_q8(q + (size_t)h * (size_t)hd, out[h].b, hd);
        for (int b = 0; b < hd / QK32; b++) out[h].d[b] = kvs_f16_to_f32(out[h].b[b].d);
    }
}

static inline size_t block_size(uint32_t type) { return type == QUANT_Q8_0 ? sizeof(block_q8_0) : sizeof(block_q4_0); }

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
                const float w = p[(size_t)h * p_stride + (size_t)j], d = value_scale(type, rows[j], b);
                for (int i = 0; i < QK32; i++)
                    o[b * QK32 + i] = fmaf(w, d * value_of(type, rows[j], b, i), o[b * QK32 + i]);
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

AVX2_T static void scores_avx2(uint32_t type, const float *q, int group, int hd, const void *const *keys,
                               int n_keys, float scale, float *scores, size_t stride) {
    kv_qhead qh[KV_HEAD_TILE];
    const int nb = hd / QK32;
    for (int h0 = 0; h0 < group; h0 += KV_HEAD_TILE) {
        int nh = group - h0 < KV_HEAD_TILE ? group - h0 : KV_HEAD_TILE;
        quantize_heads(q + (size_t)h0 * (size_t)hd, nh, hd, qh);
        for (int j = 0; j < n_keys; j++) {
            float kd[KV_MAX_BLOCKS];
            int isum[KV_MAX_BLOCKS];
            __m256i kx[KV_MAX_BLOCKS];
            if (j + 8 < n_keys) _mm_prefetch((const char *)keys[j + 8], _MM_HINT_T0);
            key_scales(type, keys[j], nb, kd);
            for (int b = 0; b < nb; b++)
                kx[b] = type == QUANT_Q8_0 ? block_bytes_q8((const block_q8_0 *)keys[j] + b)
                                           : block_bytes_q4((const block_q4_0 *)keys[j] + b);
            for (int h = 0; h < nh; h++) {
                for (int b = 0; b < nb; b++)
                    isum[b] = isum_avx2(kx[b], _mm256_loadu_si256((const __m256i *)qh[h].b[b].qs));
                scores[(size_t)(h0 + h) * stride + (size_t)j] = score_of(&qh[h], kd, isum, nb, scale);
            }
        }
    }
}

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

/* Per output block of up to two heads: the value rows in order, each dequantized (times its
 * scale) once for both, then one fused multiply-add per element, as the reference rounds. */
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
                if (j + 8 < n) _mm_prefetch((const char *)rows[j + 8] + b * block_size(type), _MM_HINT_T0);
                value_block(type, rows[j], b, x);
                const __m256 d = _mm256_set1_ps(value_scale(type, rows[j], b));
                for (int i = 0; i < 4; i++) x[i] = _mm256_mul_ps(d, x[i]);
                for (int h = 0; h < nh; h++) {
                    const __m256 w = _mm256_set1_ps(p[(size_t)(h0 + h) * p_stride + (size_t)j]);
                    for (int i = 0; i < 4; i++) acc[h][i] = _mm256_fmadd_ps(w, x[i], acc[h][i]);
                }
            }
            for (int h = 0; h < nh; h++)
                for (int i = 0; i < 4; i++)
                    _mm256_storeu_ps(out + (size_t)(h0 + h) * (size_t)hd + (size_t)(b * QK32 + 8 * i), acc[h][i]);
        }
    }
}

/* ---- AVX-512 VNNI: a query tile's heads in the lanes ----
 *
 * The scores walk puts up to eight query heads in the lanes of one zmm: each
 * block of a key is broadcast four bytes at a time against the tile's query
 * bytes at those places (u8, +128) and vpdpbusd sums the block for every head
 * at once, with no horizontal sum per key and head. Lane 8 holds ones, so it
 * sums the key's bytes; the +128 comes off as 128 x that sum, leaving each
 * head's exact integer dot. Then the reference's float steps run per lane and
 * an 8x8 transpose stores eight keys' scores per head row. */

#define Z_T __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))

/* The tile's query bytes for block b, dword g, as vpdpbusd's unsigned operand. */
typedef struct {
    __m512i v[KV_MAX_BLOCKS][QK32 / 4];
    __m256 d[KV_MAX_BLOCKS]; /* each head's block scale, lane h */
} kv_qtile;

static void qtile_build(const kv_qhead *qh, int nh, int nb, kv_qtile *t) {
    for (int b = 0; b < nb; b++) {
        float d[8] = {0};
        for (int g = 0; g < QK32 / 4; g++) {
            uint32_t lanes[16] = {0};
            for (int h = 0; h < nh; h++) {
                uint8_t u[4];
                for (int i = 0; i < 4; i++) u[i] = (uint8_t)(qh[h].b[b].qs[4 * g + i] ^ 0x80); /* q + 128 */
                memcpy(&lanes[h], u, 4);
            }
            lanes[8] = 0x01010101u;
            memcpy(&t->v[b][g], lanes, sizeof lanes);
        }
        for (int h = 0; h < nh; h++) d[h] = qh[h].d[b];
        memcpy(&t->d[b], d, sizeof d);
    }
}

/* One key's scores for the tile's heads (lane h), scale applied. */
Z_T static inline __m256 key_scores_z(uint32_t type, const void *key, const kv_qtile *t, int nb, __m256 scale) {
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        int8_t buf[QK32];
        const int8_t *kb;
        uint16_t dh;
        if (type == QUANT_Q8_0) {
            kb = ((const block_q8_0 *)key)[b].qs;
            dh = ((const block_q8_0 *)key)[b].d;
        } else {
            _mm256_storeu_si256((__m256i *)buf, block_bytes_q4((const block_q4_0 *)key + b));
            kb = buf;
            dh = ((const block_q4_0 *)key)[b].d;
        }
        __m512i s = _mm512_setzero_si512();
        KV_UNROLL for (int g = 0; g < QK32 / 4; g++) {
            int32_t w;
            memcpy(&w, kb + 4 * g, 4);
            s = _mm512_dpbusd_epi32(s, t->v[b][g], _mm512_set1_epi32(w));
        }
        const __m512i ksum = _mm512_permutexvar_epi32(_mm512_set1_epi32(8), s);
        const __m256i isum = _mm512_castsi512_si256(_mm512_sub_epi32(s, _mm512_slli_epi32(ksum, 7)));
        const __m256 kd = _mm256_set1_ps(_cvtsh_ss(dh));
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(kd, t->d[b]), _mm256_cvtepi32_ps(isum)));
    }
    return _mm256_mul_ps(acc, scale);
}

/* r[k] lane h -> row h, element k (8x8). */
Z_T static inline void transpose8(__m256 r[8]) {
    __m256 a[8], c[8];
    for (int i = 0; i < 8; i += 2) {
        a[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        a[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        c[i] = _mm256_shuffle_ps(a[i], a[i + 2], 0x44);
        c[i + 1] = _mm256_shuffle_ps(a[i], a[i + 2], 0xEE);
        c[i + 2] = _mm256_shuffle_ps(a[i + 1], a[i + 3], 0x44);
        c[i + 3] = _mm256_shuffle_ps(a[i + 1], a[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(c[i], c[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(c[i], c[i + 4], 0x31);
    }
}

Z_T static void scores_z(uint32_t type, const float *q, int group, int hd, const void *const *keys, int n_keys,
                         float scale, float *scores, size_t stride) {
    kv_qhead qh[KV_HEAD_TILE];
    kv_qtile t;
    const int nb = hd / QK32;
    const __m256 sv = _mm256_set1_ps(scale);
    const size_t row_bytes = (size_t)nb * block_size(type);
    for (int h0 = 0; h0 < group; h0 += KV_HEAD_TILE) {
        int nh = group - h0 < KV_HEAD_TILE ? group - h0 : KV_HEAD_TILE;
        quantize_heads(q + (size_t)h0 * (size_t)hd, nh, hd, qh);
        qtile_build(qh, nh, nb, &t);
        float *row0 = scores + (size_t)h0 * stride;
        int j = 0;
        for (; j + 8 <= n_keys; j += 8) {
            __m256 r[8];
            KV_UNROLL for (int k = 0; k < 8; k++) {
                if (j + k + KV_PF < n_keys) { /* a row may straddle two lines */
                    _mm_prefetch((const char *)keys[j + k + KV_PF], _MM_HINT_T0);
                    _mm_prefetch((const char *)keys[j + k + KV_PF] + row_bytes - 1, _MM_HINT_T0);
                }
                r[k] = key_scores_z(type, keys[j + k], &t, nb, sv);
            }
            transpose8(r);
            for (int h = 0; h < nh; h++) _mm256_storeu_ps(row0 + (size_t)h * stride + (size_t)j, r[h]);
        }
        for (; j < n_keys; j++) {
            float one[8];
            _mm256_storeu_ps(one, key_scores_z(type, keys[j], &t, nb, sv));
            for (int h = 0; h < nh; h++) row0[(size_t)h * stride + (size_t)j] = one[h];
        }
    }
}

/* Value block b of a row as two zmm of sixteen floats, each times the block's scale. */
Z_T static inline void value_block_z(uint32_t type, const void *row, int b, __m512 x[2]) {
    __m512i lo, hi;
    uint16_t dh;
    if (type == QUANT_Q8_0) {
        const block_q8_0 *v = (const block_q8_0 *)row + b;
        lo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)v->qs));
        hi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(v->qs + 16)));
        dh = v->d;
    } else {
        const block_q4_0 *v = (const block_q4_0 *)row + b;
        const __m128i raw = _mm_loadu_si128((const __m128i *)v->qs), m = _mm_set1_epi8(15);
        const __m512i eight = _mm512_set1_epi32(8);
        lo = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(raw, m)), eight);
        hi = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), m)), eight);
        dh = v->d;
    }
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(dh));
    x[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo));
    x[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi));
}

/* Block b of NH heads' outputs: every value row dequantized once for all of them. */
Z_T static inline __attribute__((always_inline)) void wsum_z_tile(uint32_t type, const float *p, size_t p_stride,
                                                                 const int NH, int n, const void *const *rows,
                                                                 int b, float *out, int hd) {
    __m512 acc[KV_HEAD_TILE][2];
    KV_UNROLL for (int h = 0; h < NH; h++) acc[h][0] = acc[h][1] = _mm512_setzero_ps();
    const size_t blk = block_size(type), bb = (size_t)b * blk;
    for (int j = 0; j < n; j++) {
        if (j + KV_PF < n) {
            _mm_prefetch((const char *)rows[j + KV_PF] + bb, _MM_HINT_T0);
            _mm_prefetch((const char *)rows[j + KV_PF] + bb + blk - 1, _MM_HINT_T0);
        }
        __m512 x[2];
        value_block_z(type, rows[j], b, x);
        KV_UNROLL for (int h = 0; h < NH; h++) {
            const __m512 w = _mm512_set1_ps(p[(size_t)h * p_stride + (size_t)j]);
            acc[h][0] = _mm512_fmadd_ps(w, x[0], acc[h][0]);
            acc[h][1] = _mm512_fmadd_ps(w, x[1], acc[h][1]);
        }
    }
    KV_UNROLL for (int h = 0; h < NH; h++) {
        _mm512_storeu_ps(out + (size_t)h * (size_t)hd + (size_t)b * QK32, acc[h][0]);
        _mm512_storeu_ps(out + (size_t)h * (size_t)hd + (size_t)b * QK32 + 16, acc[h][1]);
    }
}

Z_T static void wsum_z(uint32_t type, const float *p, size_t p_stride, int group, int n, const void *const *rows,
                       int hd, float *out) {
    for (int h0 = 0; h0 < group; h0 += KV_HEAD_TILE) {
        const int nh = group - h0 < KV_HEAD_TILE ? group - h0 : KV_HEAD_TILE;
        const float *ph = p + (size_t)h0 * p_stride;
        float *oh = out + (size_t)h0 * (size_t)hd;
        for (int b = 0; b < hd / QK32; b++) switch (nh) { /* a constant head count keeps the sums in registers */
            case 1: wsum_z_tile(type, ph, p_stride, 1, n, rows, b, oh, hd); break;
            case 2: wsum_z_tile(type, ph, p_stride, 2, n, rows, b, oh, hd); break;
            case 3: wsum_z_tile(type, ph, p_stride, 3, n, rows, b, oh, hd); break;
            case 4: wsum_z_tile(type, ph, p_stride, 4, n, rows, b, oh, hd); break;
            case 5: wsum_z_tile(type, ph, p_stride, 5, n, rows, b, oh, hd); break;
            case 6: wsum_z_tile(type, ph, p_stride, 6, n, rows, b, oh, hd); break;
            case 7: wsum_z_tile(type, ph, p_stride, 7, n, rows, b, oh, hd); break;
            default: wsum_z_tile(type, ph, p_stride, 8, n, rows, b, oh, hd); break;
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

void kv_attn_rotate_ref(float *x, int len, int n) {
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

/* The reference's butterflies in its order, sixteen lanes at a time: widths 1 to 8 pair lanes
 * of one zmm (the lane with the bit clear takes a + b, its partner a - b), wider ones pair zmms. */
Z_T static void rotate_z(float *x, int len, int n) {
    const __m512 c = _mm512_set1_ps(1.0f / sqrtf((float)n));
    for (float *r = x; r < x + len; r += n) {
        for (int k = 0; k < n; k += 16) {
            __m512 z = _mm512_loadu_ps(r + k);
            z = _mm512_mask_sub_ps(_mm512_add_ps(z, _mm512_permute_ps(z, 0xB1)), 0xAAAA, _mm512_permute_ps(z, 0xB1), z);
            z = _mm512_mask_sub_ps(_mm512_add_ps(z, _mm512_permute_ps(z, 0x4E)), 0xCCCC, _mm512_permute_ps(z, 0x4E), z);
            __m512 t = _mm512_shuffle_f32x4(z, z, 0xB1);
            z = _mm512_mask_sub_ps(_mm512_add_ps(z, t), 0xF0F0, t, z);
            t = _mm512_shuffle_f32x4(z, z, 0x4E);
            z = _mm512_mask_sub_ps(_mm512_add_ps(z, t), 0xFF00, t, z);
            _mm512_storeu_ps(r + k, z);
        }
        for (int s = 16; s < n; s *= 2)
            for (int i = 0; i < n; i += 2 * s)
                for (int j = i; j < i + s; j += 16) {
                    const __m512 a = _mm512_loadu_ps(r + j), b = _mm512_loadu_ps(r + j + s);
                    _mm512_storeu_ps(r + j, _mm512_add_ps(a, b));
                    _mm512_storeu_ps(r + j + s, _mm512_sub_ps(a, b));
                }
        for (int k = 0; k < n; k += 16) _mm512_storeu_ps(r + k, _mm512_mul_ps(_mm512_loadu_ps(r + k), c));
    }
}

/* quant_ref_quantize_q8_0's steps sixteen lanes at a time: the largest |x| (NaN skipped, as the
 * reference's comparison skips it), d = amax / 127, and each x / d rounded to even in [-127, 127]. */
Z_T static void quantize_q8_z(const float *x, block_q8_0 *y, int n) {
    for (int b = 0; b < n / QK32; b++, x += QK32) {
        const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
        const __m512 m = _mm512_max_ps(_mm512_abs_ps(x0), _mm512_max_ps(_mm512_abs_ps(x1), _mm512_setzero_ps()));
        const float amax = _mm512_reduce_max_ps(m), d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = kvs_f32_to_f16(d);
        const __m512 vid = _mm512_set1_ps(id), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
        const __m512 v0 = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(x0, vid), lo), hi);
        const __m512 v1 = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(x1, vid), lo), hi);
        _mm_storeu_si128((__m128i *)y[b].qs, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v0)));
        _mm_storeu_si128((__m128i *)(y[b].qs + 16), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v1)));
    }
}

/* ---- dispatch ---- */

static int use_vnni(void) {
    static int cpu = -1; /* the emulated AVX-512 build may claim the ISA on a CPU without VNNI */
    if (cpu < 0) cpu = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
    return cpu && kvs_isa_current() == KVS_ISA_AVX512;
}

void kv_attn_rotate(float *x, int len, int n) {
    if (use_vnni() && n % 16 == 0) rotate_z(x, len, n);
    else kv_attn_rotate_ref(x, len, n);
}

static void quantize_q8(const float *x, block_q8_0 *y, int n) {
    if (use_vnni()) quantize_q8_z(x, y, n);
    else quant_quantize_row(QUANT_Q8_0, x, y, n);
}

void kv_attn_store_row(uint32_t type, const float *x, void *dst, int hd) {
    if (type == QUANT_F32) memcpy(dst, x, (size_t)hd * sizeof(float));
    else if (type == QUANT_Q8_0) quantize_q8(x, dst, hd);
    else quant_quantize_row(type, x, dst, hd); /* f16, q4_0 */
}

void kv_attn_scores(uint32_t type, const float *q, int group, int hd, const void *const *keys, int n_keys, float scale,
                    float *scores, size_t stride) {
    if (type == QUANT_F32 || type == QUANT_F16)
        vec_scores(q, group, hd, keys, n_keys, type == QUANT_F16, scale, scores, stride);
    else if (use_vnni()) scores_z(type, q, group, hd, keys, n_keys, scale, scores, stride);
    else if (kvs_isa_current() != KVS_ISA_SCALAR) scores_avx2(type, q, group, hd, keys, n_keys, scale, scores, stride);
    else kv_attn_scores_ref(type, q, group, hd, keys, n_keys, scale, scores, stride);
}

void kv_attn_wsum(uint32_t type, const float *p, size_t p_stride, int group, int n, const void *const *rows, int hd,
                  float *out) {
    if (type == QUANT_F32 || type == QUANT_F16) vec_wsum_group(p, p_stride, group, n, rows, type == QUANT_F16, hd, out);
    else if (use_vnni()) wsum_z(type, p, p_stride, group, n, rows, hd, out);
    else if (kvs_isa_current() != KVS_ISA_SCALAR) wsum_avx2(type, p, p_stride, group, n, rows, hd, out);
    else kv_attn_wsum_ref(type, p, p_stride, group, n, rows, hd, out);
}
