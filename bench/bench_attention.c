/*
 * bench_attention — time the attention kernels of one decode step on one
 * core: for every kv head of a layer, vec_scores (a GQA group of query heads
 * against n keys), vec_softmax per head and vec_wsum_group over the n value
 * rows, with the keys and values laid out as kvstate lays them out: blocks of
 * BT positions (default 16, kvstate's), [block][layer][kv head][K|V][slot][head_dim],
 * the session's blocks in order (ORDER "in-order", a fresh pool) or shuffled
 * ("shuffled", a pool long in use). The arena is on 2 MiB pages where the
 * kernel gives them (MADV_HUGEPAGE), as kvstate's is.
 * Default shape: TinyLlama-1.1B (8 query heads per kv head, 4 kv heads,
 * head_dim 64, f16 KV). Minimum over the repeats, ms per layer. With
 * LAYERS > 1 the KV of that many layers is walked (more than the caches
 * hold), so memory counts as well as arithmetic. One head's rows of a layer
 * run BT x head_dim x 2 bytes in a block (2 KB at BT 16), its value rows
 * right after its key rows.
 *
 * Built with -DKVS_BENCH=ON (CMakeLists.txt):
 *   build/bench_attention [N_POS [LAYERS [in-order|shuffled [BT]]]]
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "cpu.h"
#include "f16.h"
#include "quant.h"
#include "vecops.h"

#include "bench_util.h"

enum { HD = 64, GROUP = 8, NKV = 4 };

/* The row of (layer l, K|V kind, kv head g) at slot of block id b, as kvstate's
 * block_slot places it: rows of row bytes, blocks of bt positions and block bytes each. */
static const void *row_at(const uint8_t *arena, size_t block, size_t row, int bt, int b, int l, int kind, int g,
                          int slot) {
    size_t r = (((size_t)l * NKV + (size_t)g) * 2 + (size_t)kind) * (size_t)bt + (size_t)slot;
    return arena + (size_t)b * block + r * row;
}

int main(int argc, char **argv) {
    const int n = argc > 1 ? atoi(argv[1]) : 2016, layers = argc > 2 ? atoi(argv[2]) : 1;
    const char *order = argc > 3 ? argv[3] : "in-order";
    const int BT = argc > 4 ? atoi(argv[4]) : 16;
    const bool shuffled = !strcmp(order, "shuffled");
    if (n < 1 || layers < 1 || BT < 1 || BT > 1024 ||
        (!shuffled && strcmp(order, "in-order"))) {
        fprintf(stderr, "usage: bench_attention [N_POS >= 1 [LAYERS >= 1 [in-order|shuffled [BT 1..1024]]]]]\n");
        return 2;
    }
    const int nb = (n + BT - 1) / BT;
    const size_t row = HD * sizeof(uint16_t), block = (size_t)BT * (size_t)layers * 2 * NKV * row;
    const size_t huge = 2u << 20, bytes = ((size_t)nb * block + huge - 1) / huge * huge;
    uint16_t *arena = NULL;
    if (posix_memalign((void **)&arena, huge, bytes)) arena = NULL;
    if (arena) madvise(arena, bytes, MADV_HUGEPAGE);
    int *perm = malloc(sizeof(int) * (size_t)nb);
    float *q = malloc(sizeof(float) * GROUP * HD), *sc = malloc(sizeof(float) * GROUP * (size_t)n), out[GROUP * HD];
    const void **keys = malloc(sizeof(void *) * (size_t)n), **vals = malloc(sizeof(void *) * (size_t)n);
    if (!arena || !perm || !q || !sc || !keys || !vals) { fprintf(stderr, "out of memory\n"); return 1; }
    for (size_t i = 0; i < bytes / sizeof(uint16_t); i++) arena[i] = kvs_f32_to_f16((float)((int)(i % 13) - 6) * 0.01f);
    for (int i = 0; i < GROUP * HD; i++) q[i] = (float)(i % 7 - 3) * 0.1f;
    for (int i = 0; i < nb; i++) perm[i] = i;
    srand(1);
    for (int i = nb - 1; shuffled && i > 0; i--) { int r = rand() % (i + 1), t = perm[i]; perm[i] = perm[r]; perm[r] = t; }
    double best[3] = {1e9, 1e9, 1e9};
    const int reps = layers == 1 ? 200 : 10;
    for (int rep = 0; rep < reps; rep++) {
        double t[3] = {0, 0, 0};
        for (int l = 0; l < layers; l++)
            for (int g = 0; g < NKV; g++) {
                for (int j = 0; j < n; j++) {
                    keys[j] = row_at((const uint8_t *)arena, block, row, BT, perm[j / BT], l, 0, g, j % BT);
                    vals[j] = row_at((const uint8_t *)arena, block, row, BT, perm[j / BT], l, 1, g, j % BT);
                }
                double t0 = bench_now_s();
                vec_scores(q, GROUP, HD, keys, n, 1, 0.125f, sc, (size_t)n);
                double t1 = bench_now_s();
                for (int h = 0; h < GROUP; h++) vec_softmax(sc + (size_t)h * (size_t)n, n);
                double t2 = bench_now_s();
                vec_wsum_group(sc, (size_t)n, GROUP, n, vals, 1, HD, out);
                double t3 = bench_now_s();
                t[0] += t1 - t0, t[1] += t2 - t1, t[2] += t3 - t2;
            }
        for (int k = 0; k < 3; k++) best[k] = t[k] < best[k] ? t[k] : best[k];
    }
    printf("isa %s, %d positions, %d layer(s) of %d kv heads x %d query heads, head_dim %d, f16 KV, "
           "blocks of %d positions %s; ms per layer:\n"
           "scores %.4f  softmax %.4f  weighted sums %.4f  (total %.4f; out[3] = %g)\n",
           kvs_isa_name(kvs_isa_current()), n, layers, NKV, GROUP, HD, BT, order, best[0] * 1e3 / layers, best[1] * 1e3 / layers,
           best[2] * 1e3 / layers, (best[0] + best[1] + best[2]) * 1e3 / layers, (double)out[3]);
    free(arena); free(perm); free(q); free(sc); free(keys); free(vals);
    return 0;
}
