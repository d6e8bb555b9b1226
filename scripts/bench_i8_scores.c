/*
 * bench_i8_scores — a measurement for a KV format kvshard does not have: the
 * scores step of one decode step at N_POS positions with f16 keys (the
 * engine's vec_scores) against int8 keys with one f32 scale per 64-element
 * row and the query quantized to int8 once per head (vpsignb / vpmaddubsw /
 * vpmaddwd into int32, scales applied after the reduction). Keys laid out as
 * kvstate lays them out, blocks of 16 positions
 * [block][layer][K|V][kv head][slot][head_dim]; an int8 head block holds its 16
 * rows of 64 bytes and then their scales (16; 32 for q8_0). The kernels alternate within
 * one process; minimum over the repeats, ms per layer; LAYERS > 1 walks more
 * KV than the caches hold. TinyLlama-1.1B shape (4 kv heads x 8 query heads,
 * head_dim 64). FORMAT "row" (default) or "q8_0": a scale per 32 elements
 * instead, for keys and query alike (llama.cpp's q8_0 block). BENCHMARKS.md,
 * round 7, has the figures.
 *
 * Not part of the build. From the repository root, after building build/:
 *   cc -O2 -Isrc -Iinclude scripts/bench_i8_scores.c build/libkvshard_core.a -lpcre2-8 -lm -lpthread \
 *      -o build/bench_i8_scores && build/bench_i8_scores [N_POS [LAYERS [row|q8_0]]]
 */
#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include "quant.h"
#include "vecops.h"

#include "bench_util.h"

enum { HD = 64, GROUP = 8, NKV = 4, BT = 16 };

/* The int8 scores of keys [0, n), n even, against the GROUP heads: tiles of 4 heads x 2 keys. */
__attribute__((target("avx2,fma"))) static void scores_i8(const int8_t *q8, const int8_t *qa, const float *dq, const int8_t *const *keys,
                                                          const float *const *kscale, int n, float scale, float *sc, size_t stride) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int h0 = 0; h0 < GROUP; h0 += 4) {
        for (int j = 0; j + 2 <= n; j += 2) {
            if (j + 32 < n) { _mm_prefetch((const char *)keys[j + 32], _MM_HINT_T0); _mm_prefetch((const char *)keys[j + 33], _MM_HINT_T0); }
            const __m256i k00 = _mm256_loadu_si256((const __m256i *)keys[j]), k01 = _mm256_loadu_si256((const __m256i *)(keys[j] + 32));
            const __m256i k10 = _mm256_loadu_si256((const __m256i *)keys[j + 1]), k11 = _mm256_loadu_si256((const __m256i *)(keys[j + 1] + 32));
            __m256i acc[8];
            for (int h = 0; h < 4; h++) {
                const int8_t *qh = q8 + (size_t)(h0 + h) * HD, *ah = qa + (size_t)(h0 + h) * HD;
                const __m256i q0 = _mm256_loadu_si256((const __m256i *)qh), q1 = _mm256_loadu_si256((const __m256i *)(qh + 32));
                const __m256i a0 = _mm256_loadu_si256((const __m256i *)ah), a1 = _mm256_loadu_si256((const __m256i *)(ah + 32));
                acc[h * 2] = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(k00, q0)), ones),
                                              _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(k01, q1)), ones));
                acc[h * 2 + 1] = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(k10, q0)), ones),
                                                  _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(k11, q1)), ones));
            }
            const __m256i t0 = _mm256_hadd_epi32(acc[0], acc[1]), t1 = _mm256_hadd_epi32(acc[2], acc[3]);
            const __m256i t2 = _mm256_hadd_epi32(acc[4], acc[5]), t3 = _mm256_hadd_epi32(acc[6], acc[7]);
            const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
            const __m256i s = _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
            /* lane h*2+kk */
            const float k0s = *kscale[j] * scale, k1s = *kscale[j + 1] * scale;
            const __m256 f = _mm256_setr_ps(dq[h0] * k0s, dq[h0] * k1s, dq[h0 + 1] * k0s, dq[h0 + 1] * k1s, dq[h0 + 2] * k0s,
                                            dq[h0 + 2] * k1s, dq[h0 + 3] * k0s, dq[h0 + 3] * k1s);
            float out[8];
            _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(s), f));
            for (int h = 0; h < 4; h++) { sc[(size_t)(h0 + h) * stride + j] = out[h * 2]; sc[(size_t)(h0 + h) * stride + j + 1] = out[h * 2 + 1]; }
        }
    }
}

/* The same for q8_0-style keys: a scale per 32 elements (kscale[j] -> 2 floats,
 * rows j and j + 1 adjacent), the query likewise (dq2l: per pair of heads, the
 * 8 lanes (h, key, half) of the scale vector, times the score scale). Tiles of
 * 2 heads x 2 keys x 2 halves; all heads per key pair. */
__attribute__((target("avx2,fma"))) static void scores_q8_0(const int8_t *q8, const int8_t *qa, const float *dq2l, const int8_t *const *keys,
                                                            const float *const *kscale, int n, float *sc, size_t stride) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int j = 0; j + 2 <= n; j += 2) {
        if (j + 32 < n) { _mm_prefetch((const char *)keys[j + 32], _MM_HINT_T0); _mm_prefetch((const char *)keys[j + 33], _MM_HINT_T0); }
        const __m256i k00 = _mm256_loadu_si256((const __m256i *)keys[j]), k01 = _mm256_loadu_si256((const __m256i *)(keys[j] + 32));
        const __m256i k10 = _mm256_loadu_si256((const __m256i *)keys[j + 1]), k11 = _mm256_loadu_si256((const __m256i *)(keys[j + 1] + 32));
        const __m256 dkv = _mm256_broadcast_ps((const __m128 *)kscale[j]);
        for (int h0 = 0; h0 < GROUP; h0 += 2) {
            __m256i acc[8];
            for (int h = 0; h < 2; h++) {
                const int8_t *qh = q8 + (size_t)(h0 + h) * HD, *ah = qa + (size_t)(h0 + h) * HD;
                const __m256i q0 = _mm256_loadu_si256((const __m256i *)qh), q1 = _mm256_loadu_si256((const __m256i *)(qh + 32));
                const __m256i a0 = _mm256_loadu_si256((const __m256i *)ah), a1 = _mm256_loadu_si256((const __m256i *)(ah + 32));
                acc[h * 4 + 0] = _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(k00, q0)), ones);
                acc[h * 4 + 1] = _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(k01, q1)), ones);
                acc[h * 4 + 2] = _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(k10, q0)), ones);
                acc[h * 4 + 3] = _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(k11, q1)), ones);
            }
            const __m256i t0 = _mm256_hadd_epi32(acc[0], acc[1]), t1 = _mm256_hadd_epi32(acc[2], acc[3]);
            const __m256i t2 = _mm256_hadd_epi32(acc[4], acc[5]), t3 = _mm256_hadd_epi32(acc[6], acc[7]);
            const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
            const __m256i sum = _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
            const __m256 f = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sum), dkv), _mm256_loadu_ps(dq2l + 4 * h0));
            float out[8];
            _mm256_storeu_ps(out, _mm256_hadd_ps(f, f)); /* (h0, k0) (h0, k1) at 0, 1; (h0 + 1, ...) at 4, 5 */
            sc[(size_t)h0 * stride + j] = out[0], sc[(size_t)h0 * stride + j + 1] = out[1];
            sc[(size_t)(h0 + 1) * stride + j] = out[4], sc[(size_t)(h0 + 1) * stride + j + 1] = out[5];
        }
    }
}

int main(int argc, char **argv) {
    const int n = argc > 1 ? atoi(argv[1]) : 2016, layers = argc > 2 ? atoi(argv[2]) : 1;
    const char *format = argc > 3 ? argv[3] : "row";
    const int blocks32 = !strcmp(format, "q8_0");
    if (n < 2 || n % 2 || layers < 1 || (!blocks32 && strcmp(format, "row"))) {
        fprintf(stderr, "usage: bench_i8_scores [N_POS (even, >= 2) [LAYERS >= 1 [row|q8_0]]]\n");
        return 2;
    }
    const int nb = (n + BT - 1) / BT;
    const size_t row16 = HD * 2, blk16 = (size_t)BT * layers * 2 * NKV * row16;
    const int n_scales = blocks32 ? 2 : 1; /* per key row */
    const size_t headblk8 = BT * HD + (size_t)n_scales * BT * sizeof(float), blk8 = (size_t)layers * 2 * NKV * headblk8;
    const size_t huge = 2u << 20;
    size_t b16 = ((size_t)nb * blk16 + huge - 1) / huge * huge, b8 = ((size_t)nb * blk8 + huge - 1) / huge * huge;
    uint8_t *a16, *a8;
    if (posix_memalign((void **)&a16, huge, b16) || posix_memalign((void **)&a8, huge, b8)) { fprintf(stderr, "out of memory\n"); return 1; }
    madvise(a16, b16, MADV_HUGEPAGE); madvise(a8, b8, MADV_HUGEPAGE);
    srand(1);
    float q[GROUP * HD]; int8_t q8[GROUP * HD], qa[GROUP * HD]; float dq[GROUP];
    for (int i = 0; i < GROUP * HD; i++) q[i] = bench_frand();
    float dq2[GROUP][2]; /* q8_0: per half */
    float dq2l[GROUP * 4]; /* per pair of heads: the 8 lanes (head, key, half) of scores_q8_0's scale vector */
    for (int h = 0; h < GROUP; h++) {
        float m = 0; for (int i = 0; i < HD; i++) m = fmaxf(m, fabsf(q[h * HD + i]));
        dq[h] = m / 127.f;
        for (int half = 0; half < 2; half++) {
            float mh = 0; for (int i = half * 32; i < half * 32 + 32; i++) mh = fmaxf(mh, fabsf(q[h * HD + i]));
            dq2[h][half] = mh / 127.f;
        }
        for (int i = 0; i < HD; i++) {
            const float d = blocks32 ? dq2[h][i / 32] : dq[h];
            int v = (int)lrintf(q[h * HD + i] / d); q8[h * HD + i] = (int8_t)v; qa[h * HD + i] = (int8_t)abs(v);
        }
    }
    for (int p = 0; p < GROUP / 2; p++) {
        for (int i = 0; i < 8; i++) dq2l[8 * p + i] = dq2[2 * p + i / 4][i % 2] * 0.125f;
    }
    /* Key row (block b, layer l, kv head g, slot) in f16, and the int8 head block holding it. */
#define ROW16(b, l, g, slot) (a16 + (size_t)(b) * blk16 + ((size_t)(l) * 2 * NKV + (size_t)(g)) * BT * row16 + (size_t)(slot) * row16)
#define HEAD8(b, l, g) (a8 + (size_t)(b) * blk8 + ((size_t)(l) * 2 * NKV + (size_t)(g)) * headblk8)
    /* The same random keys in both forms. */
    float kf[HD];
    for (int b = 0; b < nb; b++) for (int l = 0; l < layers; l++) for (int g = 0; g < NKV; g++) for (int s = 0; s < BT; s++) {
        for (int i = 0; i < HD; i++) kf[i] = bench_frand();
        uint16_t *r16 = (uint16_t *)ROW16(b, l, g, s);
        for (int i = 0; i < HD; i++) r16[i] = quant_f32_to_f16(kf[i]);
        uint8_t *hb = HEAD8(b, l, g);
        int8_t *r8 = (int8_t *)hb + (size_t)s * HD; float *ks = (float *)(hb + BT * HD) + n_scales * s;
        for (int half = 0; half < n_scales; half++) {
            const int i0 = half * HD / n_scales, i1 = i0 + HD / n_scales;
            float m = 0; for (int i = i0; i < i1; i++) m = fmaxf(m, fabsf(kf[i]));
            ks[half] = m / 127.f;
            for (int i = i0; i < i1; i++) r8[i] = (int8_t)lrintf(kf[i] / ks[half]);
        }
    }
    const void **k16 = malloc(sizeof(void *) * n); const int8_t **k8 = malloc(sizeof(void *) * n); const float **kss = malloc(sizeof(void *) * n);
    float *s16 = malloc(sizeof(float) * GROUP * n), *s8 = malloc(sizeof(float) * GROUP * n);
    if (!k16 || !k8 || !kss || !s16 || !s8) { fprintf(stderr, "out of memory\n"); return 1; }
    double best16 = 1e9, best8 = 1e9, maxerr = 0;
    const int reps = layers == 1 ? 200 : 10;
    for (int rep = 0; rep < reps; rep++) {
        double t16 = 0, t8 = 0;
        for (int pass = 0; pass < 2; pass++)
            for (int l = 0; l < layers; l++) for (int g = 0; g < NKV; g++) {
                for (int j = 0; j < n; j++) {
                    k16[j] = ROW16(j / BT, l, g, j % BT);
                    const uint8_t *hb = HEAD8(j / BT, l, g);
                    k8[j] = (const int8_t *)hb + (size_t)(j % BT) * HD; kss[j] = (const float *)(hb + BT * HD) + n_scales * (j % BT);
                }
                double t0 = bench_now_s();
                if (((pass ^ rep) & 1) && blocks32) scores_q8_0(q8, qa, dq2l, k8, kss, n, s8, (size_t)n);
                else if ((pass ^ rep) & 1) scores_i8(q8, qa, dq, k8, kss, n, 0.125f, s8, (size_t)n);
                else vec_scores(q, GROUP, HD, k16, n, 1, 0.125f, s16, (size_t)n);
                double t1 = bench_now_s();
                if ((pass ^ rep) & 1) t8 += t1 - t0; else t16 += t1 - t0;
            }
        if (t16 < best16) best16 = t16;
        if (t8 < best8) best8 = t8;
        for (int i = 0; i < GROUP * n; i++) if (fabs(s16[i] - s8[i]) > maxerr) maxerr = fabs(s16[i] - s8[i]);
    }
    printf("%d positions, %d layer(s), int8 keys with a scale per %s: scores ms per layer f16 %.4f  int8 %.4f  (int8/f16 %.3f; max |score diff| %.4f, last layer)\n",
           n, layers, blocks32 ? "32 elements (q8_0)" : "row",
           best16 * 1e3 / layers, best8 * 1e3 / layers, best8 / best16, maxerr);
    free(a16); free(a8); free(k16); free(k8); free(kss); free(s16); free(s8);
    return 0;
}
