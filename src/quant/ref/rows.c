/*
 * ref/rows — the scalar kernels of the plain row formats: the reference every SIMD kernel is
 * tested against, and the fallback on CPUs without AVX2. Integer sums per 16- or 32-element
 * group are exact; each block adds its float contribution to one running sum, in block order.
 *
 * Also the weight quantizers (for mkmodel and tests; not llama.cpp's search-based ones): plain
 * round to nearest. Per group, a scale (and for the types with a min, a min) is taken from the
 * group's range, the group scales are rounded to the block's few-bit grid of a shared f16
 * scale, and each element is rounded to the nearest level of the group's effective scale.
 * Quality is below llama.cpp's for the same type; the files are for speed and correctness
 * tests, not for perplexity.
 */
#include <math.h>
#include <string.h>

#include "quant_impl.h"
#include "util.h"

/* --- half precision rows ------------------------------------------------ */

void quant_ref_f16_to_f32_row(const uint16_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = kvs_f16_to_f32(src[i]);
}

void quant_ref_f32_to_f16_row(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = kvs_f32_to_f16(src[i]);
}

static inline float h2f(uint16_t h) { return kvs_f16_to_f32(h); }

/* Round half to even under the default rounding mode, clamped to [lo, hi]; NaN -> lo. */
static inline int round_clamp(float v, int lo, int hi) {
    if (!(v > (float)lo)) return lo;
    if (!(v < (float)hi)) return hi;
    return (int)rintf(v);
}

/* --- activations --------------------------------------------------------- */

void quant_ref_act_f32(const float *x, void *act, int64_t n) {
    memcpy(act, x, (size_t)n * sizeof(float));
}

/* Quantizes 'len' values to int8 with d = amax/127 (design note 3). Returns d. f16_scale: d
 * rounded to f16 and q = x x 127/amax, as llama.cpp's q8_0 activation blocks. */
static float q8_block(const float *x, int8_t *q, int len, int *sum, bool f16_scale) {
    float amax = 0.0f;
    for (int i = 0; i < len; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    float d = amax / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    if (f16_scale) {
        id = amax != 0.0f ? 127.0f / amax : 0.0f;
        d = kvs_f16_to_f32(kvs_f32_to_f16(d));
    }
    int s = 0;
    for (int i = 0; i < len; i++) {
        float v = x[i] * id;
        v = v < 127.0f ? v : 127.0f; /* mirrors min_ps/max_ps, NaN -> 127 */
        v = v > -127.0f ? v : -127.0f;
        q[i] = (int8_t)rintf(v);
        s += q[i];
    }
    *sum = s;
    return d;
}

static void act_q8_rows_ref(const float *x, act_q8 *y, int64_t n, bool qsum128) {
    for (int64_t b = 0; b < n / QK32; b++) {
        int s;
        y[b].d = q8_block(x + b * QK32, y[b].qs, QK32, &s, true);
        act_q8_set_sum(&y[b], y[b].d, s, qsum128);
    }
}

void quant_ref_act_q8(const float *x, void *act, int64_t n) { act_q8_rows_ref(x, act, n, false); }
void quant_ref_act_q8_0(const float *x, void *act, int64_t n) { act_q8_rows_ref(x, act, n, true); }

void quant_ref_act_q8k(const float *x, void *act, int64_t n) {
    block_q8_k *y = (block_q8_k *)act;
    for (int64_t b = 0; b < n / QKK; b++) {
        int s;
        y[b].d = q8_block(x + b * QKK, y[b].qs, QKK, &s, false);
        for (int j = 0; j < 16; j++) {
            int bs = 0;
            for (int i = 0; i < 16; i++) bs += y[b].qs[16 * j + i];
            y[b].bsums[j] = (int16_t)bs;
        }
    }
}

/* q4_k / q5_k: 32-element sums (q8_k_sums32). */
void quant_ref_act_q8k32(const float *x, void *act, int64_t n) {
    quant_ref_act_q8k(x, act, n);
    for (int64_t b = 0; b < n / QKK; b++) q8_k_sums32((block_q8_k *)act + b);
}

/* --- dequantization ------------------------------------------------------ */

void quant_ref_dequant_f32(const void *w, float *y, int64_t n) { memcpy(y, w, (size_t)n * sizeof(float)); }

void quant_ref_dequant_f16(const void *w, float *y, int64_t n) {
    quant_ref_f16_to_f32_row((const uint16_t *)w, y, n);
}

void quant_ref_dequant_bf16(const void *w, float *y, int64_t n) {
    const uint16_t *x = (const uint16_t *)w;
    for (int64_t i = 0; i < n; i++) y[i] = kvs_bf16_to_f32(x[i]);
}

void quant_ref_dequant_q4_0(const void *w, float *y, int64_t n) {
    const block_q4_0 *x = (const block_q4_0 *)w;
    for (int64_t b = 0; b < n / QK32; b++, y += QK32) {
        float d = h2f(x[b].d);
        for (int i = 0; i < 16; i++) {
            y[i] = d * (float)((x[b].qs[i] & 0xF) - 8);
            y[i + 16] = d * (float)((x[b].qs[i] >> 4) - 8);
        }
    }
}

void quant_ref_dequant_q4_1(const void *w, float *y, int64_t n) {
    const block_q4_1 *x = (const block_q4_1 *)w;
    for (int64_t b = 0; b < n / QK32; b++, y += QK32) {
        float d = h2f(x[b].d), m = h2f(x[b].m);
        for (int i = 0; i < 16; i++) {
            y[i] = d * (float)(x[b].qs[i] & 0xF) + m;
            y[i + 16] = d * (float)(x[b].qs[i] >> 4) + m;
        }
    }
}

static inline int q5_hi(const uint8_t qh[4], int i) { return (int)((kvs_rd_u32(qh) >> i) & 1u) << 4; }

void quant_ref_dequant_q5_0(const void *w, float *y, int64_t n) {
    const block_q5_0 *x = (const block_q5_0 *)w;
    for (int64_t b = 0; b < n / QK32; b++, y += QK32) {
        float d = h2f(x[b].d);
        for (int i = 0; i < 16; i++) {
            y[i] = d * (float)(((x[b].qs[i] & 0xF) | q5_hi(x[b].qh, i)) - 16);
            y[i + 16] = d * (float)(((x[b].qs[i] >> 4) | q5_hi(x[b].qh, i + 16)) - 16);
        }
    }
}

void quant_ref_dequant_q5_1(const void *w, float *y, int64_t n) {
    const block_q5_1 *x = (const block_q5_1 *)w;
    for (int64_t b = 0; b < n / QK32; b++, y += QK32) {
        float d = h2f(x[b].d), m = h2f(x[b].m);
        for (int i = 0; i < 16; i++) {
            y[i] = d * (float)((x[b].qs[i] & 0xF) | q5_hi(x[b].qh, i)) + m;
            y[i + 16] = d * (float)((x[b].qs[i] >> 4) | q5_hi(x[b].qh, i + 16)) + m;
        }
    }
}

void quant_ref_dequant_q8_0(const void *w, float *y, int64_t n) {
    const block_q8_0 *x = (const block_q8_0 *)w;
    for (int64_t b = 0; b < n / QK32; b++, y += QK32) {
        float d = h2f(x[b].d);
        for (int i = 0; i < QK32; i++) y[i] = d * (float)x[b].qs[i];
    }
}

void quant_ref_dequant_q4_k(const void *w, float *y, int64_t n) {
    const block_q4_k *x = (const block_q4_k *)w;
    for (int64_t b = 0; b < n / QKK; b++) {
        float d = h2f(x[b].d), dmin = h2f(x[b].dmin);
        for (int e = 0; e < QKK; e++) {
            uint8_t sc, m;
            quant_scale_min_k4(e / 32, x[b].scales, &sc, &m);
            uint8_t byte = x[b].qs[(e / 64) * 32 + e % 32];
            int q = (e / 32) % 2 ? byte >> 4 : byte & 0xF;
            *y++ = d * (float)sc * (float)q - dmin * (float)m;
        }
    }
}

void quant_ref_dequant_q5_k(const void *w, float *y, int64_t n) {
    const block_q5_k *x = (const block_q5_k *)w;
    for (int64_t b = 0; b < n / QKK; b++) {
        float d = h2f(x[b].d), dmin = h2f(x[b].dmin);
        for (int e = 0; e < QKK; e++) {
            uint8_t sc, m;
            quant_scale_min_k4(e / 32, x[b].scales, &sc, &m);
            uint8_t byte = x[b].qs[(e / 64) * 32 + e % 32];
            int q = (e / 32) % 2 ? byte >> 4 : byte & 0xF;
            q |= ((x[b].qh[e % 32] >> (e / 32)) & 1) << 4;
            *y++ = d * (float)sc * (float)q - dmin * (float)m;
        }
    }
}

/* 6-bit quant e (0..255) of a q6_k block, unsigned (0..63). */
static inline int q6_get(const block_q6_k *x, int e) {
    int half = e / 128, k = (e % 128) / 32, l = e % 32;
    uint8_t lo = x->ql[64 * half + l + 32 * (k & 1)];
    int q = k < 2 ? lo & 0xF : lo >> 4;
    return q | (((x->qh[32 * half + l] >> (2 * k)) & 3) << 4);
}

void quant_ref_dequant_q6_k(const void *w, float *y, int64_t n) {
    const block_q6_k *x = (const block_q6_k *)w;
    for (int64_t b = 0; b < n / QKK; b++) {
        float d = h2f(x[b].d);
        for (int e = 0; e < QKK; e++)
            *y++ = d * (float)x[b].scales[e / 16] * (float)(q6_get(&x[b], e) - 32);
    }
}

/* 2-bit quant of elem e (0..255) of q2_k/q3_k: bits 2j..2j+1 of qs[32h + l]. */
static inline int low2(const uint8_t qs[64], int e) {
    int h = e / 128, j = (e % 128) / 32, l = e % 32;
    return (qs[32 * h + l] >> (2 * j)) & 3;
}

/* Signed quant (-4..3) of elem e of a q3_k block. */
static inline int q3_get(const block_q3_k *b, int e) {
    int h = e / 128, j = (e % 128) / 32, l = e % 32;
    return low2(b->qs, e) + 4 * ((b->hmask[l] >> (4 * h + j)) & 1) - 4;
}

/* Table value of nibble e (0..31) of a 16-byte iq4 group. */
static inline int iq4_get(const uint8_t qs[16], int e) {
    return quant_iq4_values[e < 16 ? qs[e] & 0xF : qs[e - 16] >> 4];
}


void quant_ref_dequant_q2_k(const void *w, float *y, int64_t n) {
    const block_q2_k *x = (const block_q2_k *)w;
    for (int64_t b = 0; b < n / QKK; b++) {
        float d = h2f(x[b].d), dmin = h2f(x[b].dmin);
        for (int e = 0; e < QKK; e++) {
            uint8_t sm = x[b].scales[e / 16];
            *y++ = d * (float)(sm & 0xF) * (float)low2(x[b].qs, e) - dmin * (float)(sm >> 4);
        }
    }
}

void quant_ref_dequant_q3_k(const void *w, float *y, int64_t n) {
    const block_q3_k *x = (const block_q3_k *)w;
    for (int64_t b = 0; b < n / QKK; b++) {
        float d = h2f(x[b].d);
        int8_t sc[16];
        quant_q3_k_scales(x[b].scales, sc);
        for (int e = 0; e < QKK; e++) *y++ = d * (float)sc[e / 16] * (float)q3_get(&x[b], e);
    }
}

void quant_ref_dequant_iq4_nl(const void *w, float *y, int64_t n) {
    const block_iq4_nl *x = (const block_iq4_nl *)w;
    for (int64_t b = 0; b < n / QK32; b++) {
        float d = h2f(x[b].d);
        for (int e = 0; e < QK32; e++) *y++ = d * (float)iq4_get(x[b].qs, e);
    }
}

void quant_ref_dequant_iq4_xs(const void *w, float *y, int64_t n) {
    const block_iq4_xs *x = (const block_iq4_xs *)w;
    for (int64_t b = 0; b < n / QKK; b++) {
        float d = h2f(x[b].d);
        for (int k = 0; k < 8; k++) {
            float dl = d * (float)(quant_iq4_xs_scale(&x[b], k) - 32);
            for (int e = 0; e < 32; e++) *y++ = dl * (float)iq4_get(x[b].qs + 16 * k, e);
        }
    }
}

/* --- dots ---------------------------------------------------------------- */

static float dot_f32(int64_t n, const void *w, const void *act) {
    const uint8_t *x = (const uint8_t *)w;
    const float *a = (const float *)act;
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += kvs_rd_f32(x + 4 * i) * a[i];
    return s;
}

static float dot_f16(int64_t n, const void *w, const void *act) {
    const uint16_t *x = (const uint16_t *)w;
    const float *a = (const float *)act;
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += h2f(x[i]) * a[i];
    return s;
}

static float dot_bf16(int64_t n, const void *w, const void *act) {
    const uint16_t *x = (const uint16_t *)w;
    const float *a = (const float *)act;
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += kvs_bf16_to_f32(x[i]) * a[i];
    return s;
}

static float dot_q4_0(int64_t n, const void *w, const void *act) {
    const block_q4_0 *x = (const block_q4_0 *)w;
    const act_q8 *a = (const act_q8 *)act;
    float s = 0.0f;
    for (int64_t b = 0; b < n / QK32; b++) {
        int is = 0;
        for (int i = 0; i < 16; i++)
            is += ((x[b].qs[i] & 0xF) - 8) * a[b].qs[i] + ((x[b].qs[i] >> 4) - 8) * a[b].qs[i + 16];
        s += (float)is * (h2f(x[b].d) * a[b].d);
    }
    return s;
}

static float dot_q4_1(int64_t n, const void *w, const void *act) {
    const block_q4_1 *x = (const block_q4_1 *)w;
    const act_q8 *a = (const act_q8 *)act;
    float s = 0.0f;
    for (int64_t b = 0; b < n / QK32; b++) {
        int is = 0;
        for (int i = 0; i < 16; i++)
            is += (x[b].qs[i] & 0xF) * a[b].qs[i] + (x[b].qs[i] >> 4) * a[b].qs[i + 16];
        s += (float)is * (h2f(x[b].d) * a[b].d) + h2f(x[b].m) * a[b].s;
    }
    return s;
}

static float dot_q5_0(int64_t n, const void *w, const void *act) {
    const block_q5_0 *x = (const block_q5_0 *)w;
    const act_q8 *a = (const act_q8 *)act;
    float s = 0.0f;
    for (int64_t b = 0; b < n / QK32; b++) {
        int is = 0;
        for (int i = 0; i < 16; i++) {
            is += (((x[b].qs[i] & 0xF) | q5_hi(x[b].qh, i)) - 16) * a[b].qs[i];
            is += (((x[b].qs[i] >> 4) | q5_hi(x[b].qh, i + 16)) - 16) * a[b].qs[i + 16];
        }
        s += (float)is * (h2f(x[b].d) * a[b].d);
    }
    return s;
}

static float dot_q5_1(int64_t n, const void *w, const void *act) {
    const block_q5_1 *x = (const block_q5_1 *)w;
    const act_q8 *a = (const act_q8 *)act;
    float s = 0.0f;
    for (int64_t b = 0; b < n / QK32; b++) {
        int is = 0;
        for (int i = 0; i < 16; i++) {
            is += ((x[b].qs[i] & 0xF) | q5_hi(x[b].qh, i)) * a[b].qs[i];
            is += ((x[b].qs[i] >> 4) | q5_hi(x[b].qh, i + 16)) * a[b].qs[i + 16];
        }
        s += (float)is * (h2f(x[b].d) * a[b].d) + h2f(x[b].m) * a[b].s;
    }
    return s;
}

static float dot_q8_0(int64_t n, const void *w, const void *act) {
    const block_q8_0 *x = (const block_q8_0 *)w;
    const act_q8 *a = (const act_q8 *)act;
    float s = 0.0f;
    for (int64_t b = 0; b < n / QK32; b++) {
        int is = 0;
        for (int i = 0; i < QK32; i++) is += x[b].qs[i] * a[b].qs[i];
        s += (float)is * (h2f(x[b].d) * a[b].d);
    }
    return s;
}

/* Shared by q4_k and q5_k: q(e) gives the unsigned quant of element e. */
static float dot_k4_block(const uint8_t scales[12], uint16_t d, uint16_t dmin, const int q[QKK],
                          const block_q8_k *a) {
    int is = 0, ms = 0;
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        quant_scale_min_k4(j, scales, &sc, &m);
        int sub = 0;
        for (int i = 0; i < 32; i++) sub += q[32 * j + i] * a->qs[32 * j + i];
        is += sc * sub;
        ms += m * a->bsums[j]; /* 32-element sums (q8_k_sums32) */
    }
    return h2f(d) * a->d * (float)is - h2f(dmin) * a->d * (float)ms;
}

static float dot_q4_k(int64_t n, const void *w, const void *act) {
    const block_q4_k *x = (const block_q4_k *)w;
    const block_q8_k *a = (const block_q8_k *)act;
    float s = 0.0f;
    for (int64_t b = 0; b < n / QKK; b++) {
        int q[QKK];
        for (int e = 0; e < QKK; e++) {
            uint8_t byte = x[b].qs[(e / 64) * 32 + e % 32];
            q[e] = (e / 32) % 2 ? byte >> 4 : byte & 0xF;
        }
        s += dot_k4_block(x[b].scales, x[b].d, x[b].dmin, q, &a[b]);
    }
    return s;
}

static float dot_q5_k(int64_t n, const void *w, const void *act) {
    const block_q5_k *x = (const block_q5_k *)w;
    const block_q8_k *a = (const block_q8_k *)act;
    float s = 0.0f;
    for (int64_t b = 0; b < n / QKK; b++) {
        int q[QKK];
        for (int e = 0; e < QKK; e++) {
            uint8_t byte = x[b].qs[(e / 64) * 32 + e % 32];
            q[e] = (e / 32) % 2 ? byte >> 4 : byte & 0xF;
            q[e] |= ((x[b].qh[e % 32] >> (e / 32)) & 1) << 4;
        }
        s += dot_k4_block(x[b].scales, x[b].d, x[b].dmin, q, &a[b]);
    }
    return s;
}

static float dot_q6_k(int64_t n, const void *w, const void *act) {
    const block_q6_k *x = (const block_q6_k *)w;
    const block_q8_k *a = (const block_q8_k *)act;
    float s = 0.0f;
    for (int64_t b = 0; b < n / QKK; b++) {
        int is = 0;
        for (int j = 0; j < 16; j++) {
            int sub = 0;
            for (int i = 0; i < 16; i++) sub += (q6_get(&x[b], 16 * j + i) - 32) * a[b].qs[16 * j + i];
            is += x[b].scales[j] * sub;
        }
        s += h2f(x[b].d) * a[b].d * (float)is;
    }
    return s;
}

#define REF_MULTI(name)                                                                        \
    void quant_ref_##name(int64_t n, const void *w, const void *act, size_t stride, int n_act, \
                          float *out) {                                                        \
        for (int j = 0; j < n_act; j++) out[j] = name(n, w, (const uint8_t *)act + (size_t)j * stride); \
    }
REF_MULTI(dot_f32)
REF_MULTI(dot_f16)
REF_MULTI(dot_bf16)
REF_MULTI(dot_q4_0)
REF_MULTI(dot_q4_1)
REF_MULTI(dot_q5_0)
REF_MULTI(dot_q5_1)
REF_MULTI(dot_q8_0)
REF_MULTI(dot_q4_k)
REF_MULTI(dot_q5_k)
REF_MULTI(dot_q6_k)


static float dot_q2_k(int64_t n, const block_q2_k *x, const block_q8_k *a) {
    float s = 0.0f;
    for (int64_t b = 0; b < n / QKK; b++) {
        int is = 0, ms = 0;
        for (int g = 0; g < 16; g++) {
            int sub = 0;
            for (int i = 0; i < 16; i++) sub += low2(x[b].qs, 16 * g + i) * a[b].qs[16 * g + i];
            is += (x[b].scales[g] & 0xF) * sub;
            ms += (x[b].scales[g] >> 4) * a[b].bsums[g];
        }
        s += h2f(x[b].d) * a[b].d * (float)is - h2f(x[b].dmin) * a[b].d * (float)ms;
    }
    return s;
}

static float dot_q3_k(int64_t n, const block_q3_k *x, const block_q8_k *a) {
    float s = 0.0f;
    for (int64_t b = 0; b < n / QKK; b++) {
        int8_t sc[16];
        quant_q3_k_scales(x[b].scales, sc);
        int is = 0;
        for (int g = 0; g < 16; g++) {
            int sub = 0;
            for (int i = 0; i < 16; i++) sub += q3_get(&x[b], 16 * g + i) * a[b].qs[16 * g + i];
            is += sc[g] * sub;
        }
        s += h2f(x[b].d) * a[b].d * (float)is;
    }
    return s;
}

static float dot_iq4_nl(int64_t n, const block_iq4_nl *x, const act_q8 *a) {
    float s = 0.0f;
    for (int64_t b = 0; b < n / QK32; b++) {
        int is = 0;
        for (int e = 0; e < QK32; e++) is += iq4_get(x[b].qs, e) * a[b].qs[e];
        s += (float)is * (h2f(x[b].d) * a[b].d);
    }
    return s;
}

static float dot_iq4_xs(int64_t n, const block_iq4_xs *x, const block_q8_k *a) {
    float s = 0.0f;
    for (int64_t b = 0; b < n / QKK; b++) {
        int is = 0;
        for (int k = 0; k < 8; k++) {
            int sub = 0;
            for (int e = 0; e < 32; e++) sub += iq4_get(x[b].qs + 16 * k, e) * a[b].qs[32 * k + e];
            is += (quant_iq4_xs_scale(&x[b], k) - 32) * sub;
        }
        s += h2f(x[b].d) * a[b].d * (float)is;
    }
    return s;
}

#define REF_MULTI_TYPED(type, block_t, act_t)                                                        \
    void quant_ref_dot_##type(int64_t n, const void *w, const void *act, size_t stride, int n_act,    \
                              float *out) {                                                           \
        for (int j = 0; j < n_act; j++)                                                               \
            out[j] = dot_##type(n, (const block_t *)w,                                                \
                                (const act_t *)(const void *)((const uint8_t *)act + (size_t)j * stride)); \
    }
REF_MULTI_TYPED(q2_k, block_q2_k, block_q8_k)
REF_MULTI_TYPED(q3_k, block_q3_k, block_q8_k)
REF_MULTI_TYPED(iq4_nl, block_iq4_nl, act_q8)
REF_MULTI_TYPED(iq4_xs, block_iq4_xs, block_q8_k)

/* --- weight quantizers (reference only) ---------------------------------- */

/* Value of x[0..len) with the largest magnitude, sign kept. */
static float signed_amax(const float *x, int len) {
    float best = 0.0f, amax = 0.0f;
    for (int i = 0; i < len; i++)
        if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); best = x[i]; }
    return best;
}

void quant_ref_quantize_q4_0(const float *x, void *w, int64_t n) {
    block_q4_0 *y = (block_q4_0 *)w;
    for (int64_t b = 0; b < n / QK32; b++, x += QK32) {
        float d = signed_amax(x, QK32) / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = kvs_f32_to_f16(d);
        for (int i = 0; i < 16; i++)
            y[b].qs[i] = (uint8_t)(round_clamp(x[i] * id + 8.0f, 0, 15) |
                                   round_clamp(x[i + 16] * id + 8.0f, 0, 15) << 4);
    }
}

static void minmax(const float *x, int len, float *mn, float *mx) {
    *mn = x[0];
    *mx = x[0];
    for (int i = 1; i < len; i++) {
        *mn = x[i] < *mn ? x[i] : *mn;
        *mx = x[i] > *mx ? x[i] : *mx;
    }
}

void quant_ref_quantize_q4_1(const float *x, void *w, int64_t n) {
    block_q4_1 *y = (block_q4_1 *)w;
    for (int64_t b = 0; b < n / QK32; b++, x += QK32) {
        float mn, mx;
        minmax(x, QK32, &mn, &mx);
        float d = (mx - mn) / 15.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = kvs_f32_to_f16(d);
        y[b].m = kvs_f32_to_f16(mn);
        for (int i = 0; i < 16; i++)
            y[b].qs[i] = (uint8_t)(round_clamp((x[i] - mn) * id, 0, 15) |
                                   round_clamp((x[i + 16] - mn) * id, 0, 15) << 4);
    }
}

void quant_ref_quantize_q5_0(const float *x, void *w, int64_t n) {
    block_q5_0 *y = (block_q5_0 *)w;
    for (int64_t b = 0; b < n / QK32; b++, x += QK32) {
        float d = signed_amax(x, QK32) / -16.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = kvs_f32_to_f16(d);
        uint32_t qh = 0;
        for (int i = 0; i < 16; i++) {
            int q0 = round_clamp(x[i] * id + 16.0f, 0, 31), q1 = round_clamp(x[i + 16] * id + 16.0f, 0, 31);
            y[b].qs[i] = (uint8_t)((q0 & 0xF) | (q1 & 0xF) << 4);
            qh |= (uint32_t)(q0 >> 4) << i | (uint32_t)(q1 >> 4) << (i + 16);
        }
        kvs_wr_u32(y[b].qh, qh);
    }
}

void quant_ref_quantize_q5_1(const float *x, void *w, int64_t n) {
    block_q5_1 *y = (block_q5_1 *)w;
    for (int64_t b = 0; b < n / QK32; b++, x += QK32) {
        float mn, mx;
        minmax(x, QK32, &mn, &mx);
        float d = (mx - mn) / 31.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = kvs_f32_to_f16(d);
        y[b].m = kvs_f32_to_f16(mn);
        uint32_t qh = 0;
        for (int i = 0; i < 16; i++) {
            int q0 = round_clamp((x[i] - mn) * id, 0, 31), q1 = round_clamp((x[i + 16] - mn) * id, 0, 31);
            y[b].qs[i] = (uint8_t)((q0 & 0xF) | (q1 & 0xF) << 4);
            qh |= (uint32_t)(q0 >> 4) << i | (uint32_t)(q1 >> 4) << (i + 16);
        }
        kvs_wr_u32(y[b].qh, qh);
    }
}

void quant_ref_quantize_q8_0(const float *x, void *w, int64_t n) {
    block_q8_0 *y = (block_q8_0 *)w;
    for (int64_t b = 0; b < n / QK32; b++, x += QK32) {
        float amax = fabsf(signed_amax(x, QK32));
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = kvs_f32_to_f16(d);
        for (int i = 0; i < QK32; i++) y[b].qs[i] = (int8_t)round_clamp(x[i] * id, -127, 127);
    }
}

/* q4_k / q5_k: per 32-elem sub-block an affine map with min <= 0; 6-bit scales
 * rounded up so the range is always covered. Writes d, dmin, scales and q[256]. */
static void qz_k4(const float *x, int nmax, uint16_t *d16, uint16_t *dmin16, uint8_t scales[12],
                  int q[QKK]) {
    float sub_scale[8], sub_min[8], max_scale = 0.0f, max_min = 0.0f;
    for (int j = 0; j < 8; j++) {
        float mn, mx;
        minmax(x + 32 * j, 32, &mn, &mx);
        mn = mn < 0.0f ? mn : 0.0f;
        sub_scale[j] = (mx - mn) / (float)nmax;
        sub_min[j] = -mn;
        max_scale = sub_scale[j] > max_scale ? sub_scale[j] : max_scale;
        max_min = sub_min[j] > max_min ? sub_min[j] : max_min;
    }
    *d16 = kvs_f32_to_f16(max_scale / 63.0f);
    *dmin16 = kvs_f32_to_f16(max_min / 63.0f);
    float d = h2f(*d16), dmin = h2f(*dmin16);
    uint8_t sc[8], m[8];
    for (int j = 0; j < 8; j++) {
        sc[j] = (uint8_t)(d > 0.0f ? round_clamp(ceilf(sub_scale[j] / d), 0, 63) : 0);
        m[j] = (uint8_t)(dmin > 0.0f ? round_clamp(sub_min[j] / dmin, 0, 63) : 0);
    }
    memset(scales, 0, 12);
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            scales[j] |= sc[j];
            scales[j + 4] |= m[j];
        } else {
            scales[j + 4] = (uint8_t)((sc[j] & 0xF) | (m[j] & 0xF) << 4);
            scales[j - 4] |= (uint8_t)((sc[j] >> 4) << 6);
            scales[j] |= (uint8_t)((m[j] >> 4) << 6);
        }
    }
    for (int j = 0; j < 8; j++) {
        float es = d * (float)sc[j], em = dmin * (float)m[j];
        for (int i = 0; i < 32; i++)
            q[32 * j + i] = es > 0.0f ? round_clamp((x[32 * j + i] + em) / es, 0, nmax) : 0;
    }
}

void quant_ref_quantize_q4_k(const float *x, void *w, int64_t n) {
    block_q4_k *y = (block_q4_k *)w;
    for (int64_t b = 0; b < n / QKK; b++, x += QKK) {
        int q[QKK];
        qz_k4(x, 15, &y[b].d, &y[b].dmin, y[b].scales, q);
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++)
                y[b].qs[32 * c + l] = (uint8_t)(q[64 * c + l] | q[64 * c + 32 + l] << 4);
    }
}

void quant_ref_quantize_q5_k(const float *x, void *w, int64_t n) {
    block_q5_k *y = (block_q5_k *)w;
    for (int64_t b = 0; b < n / QKK; b++, x += QKK) {
        int q[QKK];
        qz_k4(x, 31, &y[b].d, &y[b].dmin, y[b].scales, q);
        memset(y[b].qh, 0, sizeof y[b].qh);
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++)
                y[b].qs[32 * c + l] = (uint8_t)((q[64 * c + l] & 0xF) | (q[64 * c + 32 + l] & 0xF) << 4);
        for (int e = 0; e < QKK; e++) y[b].qh[e % 32] |= (uint8_t)((q[e] >> 4) << (e / 32));
    }
}

void quant_ref_quantize_q6_k(const float *x, void *w, int64_t n) {
    block_q6_k *y = (block_q6_k *)w;
    for (int64_t b = 0; b < n / QKK; b++, x += QKK) {
        float sub_scale[16], max_scale = 0.0f;
        for (int j = 0; j < 16; j++) {
            sub_scale[j] = signed_amax(x + 16 * j, 16) / -32.0f;
            max_scale = fabsf(sub_scale[j]) > max_scale ? fabsf(sub_scale[j]) : max_scale;
        }
        y[b].d = kvs_f32_to_f16(max_scale / 127.0f);
        float d = h2f(y[b].d);
        int q[QKK];
        for (int j = 0; j < 16; j++) {
            y[b].scales[j] = (int8_t)(d > 0.0f ? round_clamp(sub_scale[j] / d, -128, 127) : 0);
            float es = d * (float)y[b].scales[j];
            for (int i = 0; i < 16; i++)
                q[16 * j + i] = es != 0.0f ? round_clamp(x[16 * j + i] / es, -32, 31) + 32 : 32;
        }
        memset(y[b].ql, 0, sizeof y[b].ql);
        memset(y[b].qh, 0, sizeof y[b].qh);
        for (int e = 0; e < QKK; e++) {
            int half = e / 128, k = (e % 128) / 32, l = e % 32;
            y[b].ql[64 * half + l + 32 * (k & 1)] |= (uint8_t)((q[e] & 0xF) << (k < 2 ? 0 : 4));
            y[b].qh[32 * half + l] |= (uint8_t)((q[e] >> 4) << (2 * k));
        }
    }
}

/* Index of the table value nearest to v (ties to the lower index). */
static int iq4_nearest(float v) {
    int lo = 0, hi = 15; /* invariant: the answer is in [lo, hi] */
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (v < (float)quant_iq4_values[mid]) hi = mid;
        else lo = mid;
    }
    return fabsf(v - (float)quant_iq4_values[lo]) <= fabsf(v - (float)quant_iq4_values[hi]) ? lo : hi;
}

/* 32 nibbles of x / d (d == 0: the level nearest 0) into qs[16]. */
static void iq4_pack(const float *x, float d, uint8_t qs[16]) {
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < 16; i++)
        qs[i] = (uint8_t)(iq4_nearest(x[i] * id) | iq4_nearest(x[i + 16] * id) << 4);
}

/* q2_k: per 16-elem group, min m = -min(x, 0) and scale = (max + m) / 3, both on
 * 4-bit grids of the block's f16 d and dmin; q = round((x + m) / scale). */
void quant_ref_quantize_q2_k(const float *x, void *w, int64_t n) {
    block_q2_k *y = (block_q2_k *)w;
    for (int64_t b = 0; b < n / QKK; b++, x += QKK) {
        float gmin[16], gmax[16], max_min = 0.0f, max_scale = 0.0f;
        for (int g = 0; g < 16; g++) {
            float mn = 0.0f, mx = 0.0f;
            for (int i = 0; i < 16; i++) {
                mn = x[16 * g + i] < mn ? x[16 * g + i] : mn;
                mx = x[16 * g + i] > mx ? x[16 * g + i] : mx;
            }
            gmin[g] = -mn;
            gmax[g] = mx;
            max_min = gmin[g] > max_min ? gmin[g] : max_min;
            max_scale = (mx - mn) / 3.0f > max_scale ? (mx - mn) / 3.0f : max_scale;
        }
        y[b].d = kvs_f32_to_f16(max_scale / 15.0f);
        y[b].dmin = kvs_f32_to_f16(max_min / 15.0f);
        float d = h2f(y[b].d), dmin = h2f(y[b].dmin);
        int q[QKK];
        for (int g = 0; g < 16; g++) {
            int m = dmin > 0.0f ? round_clamp(gmin[g] / dmin, 0, 15) : 0;
            float em = dmin * (float)m; /* the min actually stored */
            int sc = d > 0.0f ? round_clamp((gmax[g] + em) / 3.0f / d, 0, 15) : 0;
            float es = d * (float)sc;
            y[b].scales[g] = (uint8_t)(sc | m << 4);
            for (int i = 0; i < 16; i++)
                q[16 * g + i] = es > 0.0f ? round_clamp((x[16 * g + i] + em) / es, 0, 3) : 0;
        }
        memset(y[b].qs, 0, sizeof y[b].qs);
        for (int e = 0; e < QKK; e++) y[b].qs[32 * (e / 128) + e % 32] |= (uint8_t)(q[e] << (2 * ((e % 128) / 32)));
    }
}

/* q3_k: per 16-elem group a signed scale mapping the largest-magnitude element
 * to -4, on the 6-bit signed grid of the block's f16 d; q = round(x / scale). */
void quant_ref_quantize_q3_k(const float *x, void *w, int64_t n) {
    block_q3_k *y = (block_q3_k *)w;
    for (int64_t b = 0; b < n / QKK; b++, x += QKK) {
        float gs[16], amax = 0.0f;
        for (int g = 0; g < 16; g++) {
            gs[g] = signed_amax(x + 16 * g, 16) / -4.0f;
            amax = fabsf(gs[g]) > amax ? fabsf(gs[g]) : amax;
        }
        y[b].d = kvs_f32_to_f16(amax / 31.0f);
        float d = h2f(y[b].d);
        int sc[16], q[QKK];
        for (int g = 0; g < 16; g++) {
            sc[g] = d > 0.0f ? round_clamp(gs[g] / d, -32, 31) : 0;
            float es = d * (float)sc[g];
            for (int i = 0; i < 16; i++)
                q[16 * g + i] = es != 0.0f ? round_clamp(x[16 * g + i] / es, -4, 3) : 0;
        }
        memset(y[b].scales, 0, sizeof y[b].scales);
        for (int j = 0; j < 16; j++) {
            int u = sc[j] + 32;
            y[b].scales[j % 8] |= (uint8_t)((u & 0xF) << (4 * (j / 8)));
            y[b].scales[8 + j % 4] |= (uint8_t)((u >> 4) << (2 * (j / 4)));
        }
        memset(y[b].qs, 0, sizeof y[b].qs);
        memset(y[b].hmask, 0, sizeof y[b].hmask);
        for (int e = 0; e < QKK; e++) {
            int u = q[e] + 4, h = e / 128, j = (e % 128) / 32, l = e % 32;
            y[b].qs[32 * h + l] |= (uint8_t)((u & 3) << (2 * j));
            y[b].hmask[l] |= (uint8_t)((u >> 2) << (4 * h + j));
        }
    }
}

/* iq4_nl: d maps the largest-magnitude element to the table's -127. */
void quant_ref_quantize_iq4_nl(const float *x, void *w, int64_t n) {
    block_iq4_nl *y = (block_iq4_nl *)w;
    for (int64_t b = 0; b < n / QK32; b++, x += QK32) {
        y[b].d = kvs_f32_to_f16(signed_amax(x, QK32) / -127.0f);
        iq4_pack(x, h2f(y[b].d), y[b].qs);
    }
}

/* iq4_xs: as iq4_nl per 32-elem sub-block, the sub-block scales on the 6-bit
 * signed grid of the block's f16 d. */
void quant_ref_quantize_iq4_xs(const float *x, void *w, int64_t n) {
    block_iq4_xs *y = (block_iq4_xs *)w;
    for (int64_t b = 0; b < n / QKK; b++, x += QKK) {
        float ks[8], amax = 0.0f;
        for (int k = 0; k < 8; k++) {
            ks[k] = signed_amax(x + 32 * k, 32) / -127.0f;
            amax = fabsf(ks[k]) > amax ? fabsf(ks[k]) : amax;
        }
        y[b].d = kvs_f32_to_f16(amax / 31.0f);
        float d = h2f(y[b].d);
        uint16_t sh = 0;
        memset(y[b].scales_l, 0, sizeof y[b].scales_l);
        for (int k = 0; k < 8; k++) {
            int s = d > 0.0f ? round_clamp(ks[k] / d, -32, 31) : 0, u = s + 32;
            y[b].scales_l[k / 2] |= (uint8_t)((u & 0xF) << (4 * (k % 2)));
            sh |= (uint16_t)((u >> 4) << (2 * k));
            iq4_pack(x + 32 * k, d * (float)s, y[b].qs + 16 * k);
        }
        y[b].scales_h = sh;
    }
}
