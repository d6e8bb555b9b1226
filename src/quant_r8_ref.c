/*
 * quant_r8_ref — the row-interleaved ("r8") weight layout (quant.h,
 * block_q4_0x8 in quant_impl.h): packing, unpacking and the scalar reference
 * kernel. The SIMD kernels (quant_r8_avx2.c) run the same float steps per
 * (row, token) — t = fma(P, da, -8 s), acc = fma(t, dw, acc) over the blocks in
 * order, P the exact integer sum — so they are bit-identical to this one.
 */
#include <math.h>
#include <string.h>

#include "quant_impl.h"
#include "util.h"

/* Row r's element e (0..31) of a q4_0 block, unsigned (0..15). */
static int q4_0_nibble(const block_q4_0 *b, int e) { return e < 16 ? b->qs[e] & 0xF : b->qs[e - 16] >> 4; }

static void pack_q4_0(int64_t n, const void *rows, size_t row_stride, void *out) {
    const int64_t nb = n / QK32;
    block_q4_0x8 *g = (block_q4_0x8 *)out;
    for (int64_t b = 0; b < nb; b++) {
        block_q4_0x8 o;
        for (int r = 0; r < 8; r++) {
            const block_q4_0 *x = (const block_q4_0 *)((const uint8_t *)rows + (size_t)r * row_stride) + b;
            o.d[r] = x->d;
            for (int j = 0; j < 4; j++)
                for (int i = 0; i < 4; i++)
                    o.qs[32 * j + 4 * r + i] = (uint8_t)(q4_0_nibble(x, 8 * j + i) | q4_0_nibble(x, 8 * j + 4 + i) << 4);
        }
        memcpy(&g[b], &o, sizeof o);
    }
}

static void unpack_q4_0(int64_t n, const void *group, void *rows, size_t row_stride) {
    const int64_t nb = n / QK32;
    const block_q4_0x8 *g = (const block_q4_0x8 *)group;
    for (int64_t b = 0; b < nb; b++)
        for (int r = 0; r < 8; r++) {
            block_q4_0 x;
            x.d = g[b].d[r];
            uint8_t e[32];
            for (int j = 0; j < 4; j++)
                for (int i = 0; i < 4; i++) {
                    uint8_t v = g[b].qs[32 * j + 4 * r + i];
                    e[8 * j + i] = v & 0xF;
                    e[8 * j + 4 + i] = v >> 4;
                }
            for (int k = 0; k < 16; k++) x.qs[k] = (uint8_t)(e[k] | e[k + 16] << 4);
            memcpy((uint8_t *)rows + (size_t)r * row_stride + (size_t)b * sizeof x, &x, sizeof x);
        }
}

void quant_ref_r8_q4_0(int64_t n, const void *w, int n_groups, const void *act, size_t act_stride, int n_act,
                       float *out, size_t out_stride) {
    const int64_t nb = n / QK32;
    for (int gi = 0; gi < n_groups; gi++) {
        const block_q4_0x8 *g = (const block_q4_0x8 *)w + (size_t)gi * (size_t)nb;
        for (int t = 0; t < n_act; t++) {
            const act_q8 *a = (const act_q8 *)((const uint8_t *)act + (size_t)t * act_stride);
            for (int r = 0; r < 8; r++) {
                float acc = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    int32_t p = 0;
                    for (int j = 0; j < 4; j++)
                        for (int i = 0; i < 4; i++) {
                            const uint8_t v = g[b].qs[32 * j + 4 * r + i];
                            p += (v & 0xF) * a[b].qs[8 * j + i] + (v >> 4) * a[b].qs[8 * j + 4 + i];
                        }
                    const float tt = fmaf((float)p, a[b].d, a[b].s * -8.0f);
                    acc = fmaf(tt, quant_f16_to_f32(g[b].d[r]), acc);
                }
                out[(size_t)t * out_stride + 8 * (size_t)gi + (size_t)r] = acc;
            }
        }
    }
}

/* q8_0: element e of row r sits at qs[32 (e / 4) + 4 r + e % 4]. */
static void pack_q8_0(int64_t n, const void *rows, size_t row_stride, void *out) {
    const int64_t nb = n / QK32;
    block_q8_0x8 *g = (block_q8_0x8 *)out;
    for (int64_t b = 0; b < nb; b++) {
        block_q8_0x8 o;
        for (int r = 0; r < 8; r++) {
            const block_q8_0 *x = (const block_q8_0 *)((const uint8_t *)rows + (size_t)r * row_stride) + b;
            o.d[r] = x->d;
            for (int e = 0; e < 32; e++) o.qs[32 * (e / 4) + 4 * r + e % 4] = x->qs[e];
        }
        memcpy(&g[b], &o, sizeof o);
    }
}

static void unpack_q8_0(int64_t n, const void *group, void *rows, size_t row_stride) {
    const int64_t nb = n / QK32;
    const block_q8_0x8 *g = (const block_q8_0x8 *)group;
    for (int64_t b = 0; b < nb; b++)
        for (int r = 0; r < 8; r++) {
            block_q8_0 x;
            x.d = g[b].d[r];
            for (int e = 0; e < 32; e++) x.qs[e] = g[b].qs[32 * (e / 4) + 4 * r + e % 4];
            memcpy((uint8_t *)rows + (size_t)r * row_stride + (size_t)b * sizeof x, &x, sizeof x);
        }
}

/* The q8_0 float steps: t = P * da (P the exact sum), acc = fma(t, dw, acc). */
void quant_ref_r8_q8_0(int64_t n, const void *w, int n_groups, const void *act, size_t act_stride, int n_act,
                       float *out, size_t out_stride) {
    const int64_t nb = n / QK32;
    for (int gi = 0; gi < n_groups; gi++) {
        const block_q8_0x8 *g = (const block_q8_0x8 *)w + (size_t)gi * (size_t)nb;
        for (int t = 0; t < n_act; t++) {
            const act_q8 *a = (const act_q8 *)((const uint8_t *)act + (size_t)t * act_stride);
            for (int r = 0; r < 8; r++) {
                float acc = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    int32_t p = 0;
                    for (int e = 0; e < 32; e++) p += g[b].qs[32 * (e / 4) + 4 * r + e % 4] * a[b].qs[e];
                    acc = fmaf((float)p * a[b].d, quant_f16_to_f32(g[b].d[r]), acc);
                }
                out[(size_t)t * out_stride + 8 * (size_t)gi + (size_t)r] = acc;
            }
        }
    }
}

bool quant_r8_supported(uint32_t wtype) { return wtype == QUANT_Q4_0 || wtype == QUANT_Q8_0; }

void quant_r8_pack(uint32_t wtype, int64_t n, const void *rows, size_t row_stride, void *out) {
    KVS_ASSERT(quant_r8_supported(wtype) && n >= 0 && n % QK32 == 0);
    if (wtype == QUANT_Q4_0) pack_q4_0(n, rows, row_stride, out);
    else pack_q8_0(n, rows, row_stride, out);
}

void quant_r8_unpack(uint32_t wtype, int64_t n, const void *group, void *rows, size_t row_stride) {
    KVS_ASSERT(quant_r8_supported(wtype) && n >= 0 && n % QK32 == 0);
    if (wtype == QUANT_Q4_0) unpack_q4_0(n, group, rows, row_stride);
    else unpack_q8_0(n, group, rows, row_stride);
}

void quant_dot_r8_ref(uint32_t wtype, int64_t n, const void *w, int n_groups, const void *act,
                      size_t act_stride, int n_act, float *out, size_t out_stride) {
    KVS_ASSERT(quant_r8_supported(wtype) && n >= 0 && n % QK32 == 0);
    quant_table_ref.k[wtype].r8(n, w, n_groups, act, act_stride, n_act, out, out_stride);
}
