/*
 * ab_r8 — two builds of the r8 kernels (src/quant_r8_avx2.c), A and B, timed
 * side by side on one core, rows in cache: the same 256 repacked rows of 2048
 * elements and T activation rows, A and B called alternately 300 times, the
 * minimum of each in ns per row-token, and whether B's outputs are A's bits.
 * Built by scripts/ab_r8.sh, which compiles each file with its kernels renamed
 * va_r8_* / vb_r8_*.
 *
 * Usage: ab_r8 [q4_0|q8_0|q4_k|q6_k|q3_k|q2_k [T]]   (default q8_0, 8 tokens); a
 * VNNI build (AB_R8_VNNI) also times the one-token kernels q4_0/pairs1,
 * q8_0/pairs1, q4_0/quads1, q8_0/quads1, q4_k/quads1, q3_k/quads1 and
 * q2_k/quads1 (their exports at any T).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"
#include "bench_util.h"

typedef void r8_fn(int64_t n, const void *w, int n_groups, const void *act, size_t act_stride, int n_act, float *out,
                   size_t out_stride);
r8_fn va_r8_q4_0, va_r8_q8_0, va_r8_q4_k, va_r8_q6_k, vb_r8_q4_0, vb_r8_q8_0, vb_r8_q4_k, vb_r8_q6_k;
r8_fn va_r8_q3_k, va_r8_q2_k, vb_r8_q3_k, vb_r8_q2_k;
#ifdef AB_R8_VNNI /* the one-token pairs and quads kernels of the VNNI build */
r8_fn va_r8_pairs1_q4_0, va_r8_pairs1_q8_0, vb_r8_pairs1_q4_0, vb_r8_pairs1_q8_0;
r8_fn va_r8_quads1_q4_0, va_r8_quads1_q8_0, va_r8_quads1_q4_k, vb_r8_quads1_q4_0, vb_r8_quads1_q8_0, vb_r8_quads1_q4_k;
r8_fn va_r8_quads1_q3_k, va_r8_quads1_q2_k, vb_r8_quads1_q3_k, vb_r8_quads1_q2_k;
#endif

enum { N = 2048, ROWS = 256, MAX_T = 128, REPEATS = 300 };

int main(int argc, char **argv) {
    static const struct {
        const char *name;
        uint32_t type;
        r8_fn *a, *b;
    } kinds[] = {{"q4_0", QUANT_Q4_0, va_r8_q4_0, vb_r8_q4_0},
                 {"q8_0", QUANT_Q8_0, va_r8_q8_0, vb_r8_q8_0},
                 {"q4_k", QUANT_Q4_K, va_r8_q4_k, vb_r8_q4_k},
                 {"q6_k", QUANT_Q6_K, va_r8_q6_k, vb_r8_q6_k},
                 {"q3_k", QUANT_Q3_K, va_r8_q3_k, vb_r8_q3_k},
                 {"q2_k", QUANT_Q2_K, va_r8_q2_k, vb_r8_q2_k},
#ifdef AB_R8_VNNI
                 {"q4_0/pairs1", QUANT_Q4_0, va_r8_pairs1_q4_0, vb_r8_pairs1_q4_0},
                 {"q8_0/pairs1", QUANT_Q8_0, va_r8_pairs1_q8_0, vb_r8_pairs1_q8_0},
                 {"q4_0/quads1", QUANT_Q4_0, va_r8_quads1_q4_0, vb_r8_quads1_q4_0},
                 {"q8_0/quads1", QUANT_Q8_0, va_r8_quads1_q8_0, vb_r8_quads1_q8_0},
                 {"q4_k/quads1", QUANT_Q4_K, va_r8_quads1_q4_k, vb_r8_quads1_q4_k},
                 {"q3_k/quads1", QUANT_Q3_K, va_r8_quads1_q3_k, vb_r8_quads1_q3_k},
                 {"q2_k/quads1", QUANT_Q2_K, va_r8_quads1_q2_k, vb_r8_quads1_q2_k},
#endif
    };
    const int n_kinds = (int)(sizeof kinds / sizeof kinds[0]);
    const char *name = argc > 1 ? argv[1] : "q8_0";
    const int nt = argc > 2 ? atoi(argv[2]) : 8;
    int k = -1;
    for (int i = 0; i < n_kinds; i++)
        if (!strcmp(name, kinds[i].name)) k = i;
    if (k < 0 || nt < 1 || nt > MAX_T) {
        fprintf(stderr, "usage: ab_r8 [q4_0|q8_0|q4_k|q6_k|q3_k|q2_k (VNNI: also q4_0/pairs1 q8_0/pairs1 q4_0/quads1 "
                        "q8_0/quads1 q4_k/quads1 q3_k/quads1 q2_k/quads1) [T in 1..%d]]\n", MAX_T);
        return 2;
    }
    const uint32_t type = kinds[k].type;
    uint64_t rb = 0;
    if (!quant_row_bytes(type, N, &rb)) return 1;
    const size_t ab = quant_act_row_bytes(type, N);
    float *oa = malloc(sizeof(float) * ROWS * MAX_T), *ob = malloc(sizeof(float) * ROWS * MAX_T);
    uint8_t *w = malloc(rb * ROWS), *act = malloc(ab * MAX_T), *r8 = malloc(rb * ROWS);
    if (!oa || !ob || !w || !act || !r8) return 1;
    srand(1);
    bench_random_rows(type, N, ROWS, w, rb, 0);
    bench_random_rows(type, N, MAX_T, act, ab, 1);
    for (int r = 0; r < ROWS; r += 8) quant_r8_pack(type, N, w + (size_t)r * rb, rb, r8 + (size_t)r * rb);
    double ta = 1e30, tb = 1e30;
    for (int rep = 0; rep < REPEATS; rep++) {
        const double t0 = bench_now_s();
        kinds[k].a(N, r8, ROWS / 8, act, ab, nt, oa, ROWS);
        const double t1 = bench_now_s();
        kinds[k].b(N, r8, ROWS / 8, act, ab, nt, ob, ROWS);
        const double t2 = bench_now_s();
        ta = t1 - t0 < ta ? t1 - t0 : ta;
        tb = t2 - t1 < tb ? t2 - t1 : tb;
    }
    const int same = !memcmp(oa, ob, sizeof(float) * ROWS * (size_t)nt);
    printf("%s, %d tokens: A %.2f  B %.2f ns/row-token  B/A %.3f  %s\n", name, nt, ta * 1e9 / (ROWS * nt), tb * 1e9 / (ROWS * nt),
           tb / ta, same ? "same bits" : "OUTPUTS DIFFER");
    free(oa), free(ob), free(w), free(act), free(r8);
    return same ? 0 : 1;
}
