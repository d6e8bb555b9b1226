/*
 * bench_quant_kernels — time the dot kernels of some weight types on one core,
 * rows resident in cache (compute, not bandwidth): ns per weight row of 2048
 * elements for one token (decode) and per row-token for eight tokens
 * (prefill: quant_dot_multi, and quant_dot_tile where the type has one), and
 * for the types with an r8 layout the same rows repacked (quant_dot_r8, 1 and
 * eight tokens).
 * Minimum over 40 repeats, so a shared machine's noise mostly drops out.
 *
 * Built with -DKVS_BENCH=ON (CMakeLists.txt); from the repository root:
 *   build/bench_quant_kernels [scalar|avx2|avx512]
 * (an ISA named: its kernels instead of the best this CPU has).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "quant.h"
#include "bench_util.h"

enum { N = 2048, ROWS = 256, T = 8, REPEATS = 40 };

int main(int argc, char **argv) {
    static const uint32_t types[] = {QUANT_Q4_0, QUANT_Q8_0, QUANT_Q4_K, QUANT_Q6_K, QUANT_Q2_K,
                                     QUANT_Q3_K, QUANT_IQ4_NL, QUANT_IQ4_XS};
    static float out[ROWS * T];
    if (argc > 2 || (argc == 2 && !kvs_isa_force_name(argv[1]))) {
        fprintf(stderr, "usage: bench_quant_kernels [scalar|avx2|avx512] (an ISA this CPU has)\n");
        return 2;
    }
    srand(1);
    printf("isa %s, n %d, %d rows\n", kvs_isa_name(kvs_isa_current()), N, ROWS);
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        const uint32_t type = types[ti];
        uint64_t rb = 0;
        if (!quant_row_bytes(type, N, &rb)) return 1;
        const size_t ab = quant_act_row_bytes(type, N);
        uint8_t *w = malloc(rb * ROWS), *act = malloc(ab * T), *tiled = malloc(ab * T), *r8 = malloc(rb * ROWS);
        if (!w || !act || !tiled || !r8) return 1;
        bench_random_rows(type, N, ROWS, w, rb, 0);
        bench_random_rows(type, N, T, act, ab, 1);
        const bool tile = quant_has_tile(type), packed = quant_r8_supported(type);
        for (int r = 0; packed && r < ROWS; r += 8) quant_r8_pack(type, N, w + (size_t)r * rb, rb, r8 + (size_t)r * rb);
        memcpy(tiled, act, ab * T);
        for (int t = 0; tile && t < T; t++) quant_act_tile_layout(type, tiled + (size_t)t * ab, N);
        double one = 1e30, multi = 1e30, til = 1e30, r8_one = 1e30, r8_multi = 1e30;
        for (int rep = 0; rep < REPEATS; rep++) {
            double t0 = bench_now_s();
            for (int r = 0; r < ROWS; r++) quant_dot_multi(type, N, w + (size_t)r * rb, act, ab, 1, out + r);
            double t1 = bench_now_s();
            for (int r = 0; r < ROWS; r++) quant_dot_multi(type, N, w + (size_t)r * rb, act, ab, T, out);
            double t2 = bench_now_s();
            if (tile) quant_dot_tile(type, N, w, rb, ROWS, tiled, ab, T, out, ROWS);
            double t3 = bench_now_s();
            if (packed) quant_dot_r8(type, N, r8, ROWS / 8, act, ab, 1, out, ROWS);
            double t4 = bench_now_s();
            if (packed) quant_dot_r8(type, N, r8, ROWS / 8, act, ab, T, out, ROWS);
            double t5 = bench_now_s();
            r8_one = t4 - t3 < r8_one ? t4 - t3 : r8_one;
            r8_multi = t5 - t4 < r8_multi ? t5 - t4 : r8_multi;
            one = t1 - t0 < one ? t1 - t0 : one;
            multi = t2 - t1 < multi ? t2 - t1 : multi;
            til = t3 - t2 < til ? t3 - t2 : til;
        }
        const double ns = 1e9; /* the clock reads seconds */
        printf("%-7s 1 token %6.1f ns/row   %d tokens: multi %6.1f", quant_get_traits(type)->name, one * ns / ROWS, T,
               multi * ns / (ROWS * T));
        if (tile) printf(", tile %6.1f", til * ns / (ROWS * T));
        printf(" ns/row-token");
        if (packed)
            printf("   r8: 1 token %6.1f ns/row, %d tokens %6.1f ns/row-token", r8_one * ns / ROWS, T,
                   r8_multi * ns / (ROWS * T));
        printf("\n");
        free(w);
        free(act);
        free(tiled);
        free(r8);
    }
    return 0;
}
