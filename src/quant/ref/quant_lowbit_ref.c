/*
 * quant_lowbit_ref — scalar reference kernels and quantizers for the low-bit
 * types of large-model downloads: q2_k, q3_k, iq4_nl, iq4_xs (layouts in
 * quant_impl.h). The SIMD kernels in quant_lowbit_avx2.c are tested against
 * these; quant_ref.c registers them in the scalar table.
 *
 * Dots: integer sums per 16- or 32-element group are exact; each 256-block (32
 * for iq4_nl) adds its float contribution to one running sum, in block order.
 *
 * Quantizers (for mkmodel and tests; not llama.cpp's search-based ones): plain
 * round to nearest. Per group, a scale (and for q2_k a min) is taken from the
 * group's range, the group scales are rounded to the block's few-bit grid of a
 * shared f16 scale, and each element is rounded to the nearest level of the
 * group's effective scale. Quality is below llama.cpp's for the same type; the
 * files are for speed and correctness tests, not for perplexity.
 */
#include <math.h>
#include <string.h>

#include "quant_impl.h"

static inline float h2f(uint16_t h) { return kvs_f16_to_f32(h); }

/* Round half to even, clamped to [lo, hi]; NaN -> lo. */
static inline int nearest_clamp(float v, int lo, int hi) {
    if (!(v > (float)lo)) return lo;
    if (!(v < (float)hi)) return hi;
    return (int)rintf(v);
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

/* --- dequantization ------------------------------------------------------ */

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

#define LOWBIT_REF_MULTI(type, block_t, act_t)                                                       \
    void quant_ref_dot_##type(int64_t n, const void *w, const void *act, size_t stride, int n_act,    \
                              float *out) {                                                           \
        for (int j = 0; j < n_act; j++)                                                               \
            out[j] = dot_##type(n, (const block_t *)w,                                                \
                                (const act_t *)(const void *)((const uint8_t *)act + (size_t)j * stride)); \
    }
LOWBIT_REF_MULTI(q2_k, block_q2_k, block_q8_k)
LOWBIT_REF_MULTI(q3_k, block_q3_k, block_q8_k)
LOWBIT_REF_MULTI(iq4_nl, block_iq4_nl, act_q8)
LOWBIT_REF_MULTI(iq4_xs, block_iq4_xs, block_q8_k)

/* --- quantizers ---------------------------------------------------------- */

/* Value of x[0..len) with the largest magnitude, sign kept. */
static float signed_amax(const float *x, int len) {
    float best = 0.0f, amax = 0.0f;
    for (int i = 0; i < len; i++)
        if (fabsf(x[i]) > amax) {
            amax = fabsf(x[i]);
            best = x[i];
        }
    return best;
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
            int m = dmin > 0.0f ? nearest_clamp(gmin[g] / dmin, 0, 15) : 0;
            float em = dmin * (float)m; /* the min actually stored */
            int sc = d > 0.0f ? nearest_clamp((gmax[g] + em) / 3.0f / d, 0, 15) : 0;
            float es = d * (float)sc;
            y[b].scales[g] = (uint8_t)(sc | m << 4);
            for (int i = 0; i < 16; i++)
                q[16 * g + i] = es > 0.0f ? nearest_clamp((x[16 * g + i] + em) / es, 0, 3) : 0;
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
            sc[g] = d > 0.0f ? nearest_clamp(gs[g] / d, -32, 31) : 0;
            float es = d * (float)sc[g];
            for (int i = 0; i < 16; i++)
                q[16 * g + i] = es != 0.0f ? nearest_clamp(x[16 * g + i] / es, -4, 3) : 0;
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
            int s = d > 0.0f ? nearest_clamp(ks[k] / d, -32, 31) : 0, u = s + 32;
            y[b].scales_l[k / 2] |= (uint8_t)((u & 0xF) << (4 * (k % 2)));
            sh |= (uint16_t)((u >> 4) << (2 * k));
            iq4_pack(x + 32 * k, d * (float)s, y[b].qs + 16 * k);
        }
        y[b].scales_h = sh;
    }
}
