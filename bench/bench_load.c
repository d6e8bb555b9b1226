/*
 * bench_load — what loading a model costs: the r8 packing rate of each
 * repacked type on one core (2048 random rows of 2048 elements, in memory,
 * best of 5), with a hash of the packed bytes so two builds can be checked to
 * pack alike, then for each model file given the wall time of model_load_on
 * (map, repack on a pool of one thread per online CPU, as engine_open's
 * default, release the mapped rows) and of model_free, three loads per file.
 *
 * Built with -DKVS_BENCH=ON (CMakeLists.txt); from the repository root:
 *   taskset -c 1 build/bench_load              (packing only, pinned)
 *   build/bench_load MODEL.gguf ...            (packing, then each model's loads)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "quant.h"
#include "model.h"
#include "bench_util.h"

enum { N = 2048, ROWS = 2048, REPEATS = 5, LOADS = 3 };

int main(int argc, char **argv) {
    static const uint32_t types[] = {QUANT_Q4_0, QUANT_Q8_0, QUANT_Q4_K, QUANT_Q6_K};
    srand(1);
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        const uint32_t type = types[ti];
        uint64_t rb = 0;
        if (!quant_row_bytes(type, N, &rb)) return 1;
        const size_t bytes = (size_t)rb * ROWS;
        uint8_t *src = malloc(bytes), *dst = calloc(1, bytes);
        if (!src || !dst) return 1;
        for (size_t i = 0; i < bytes; i++) src[i] = (uint8_t)rand(); /* every bit pattern packs */
        double best = 1e30;
        for (int rep = 0; rep < REPEATS; rep++) {
            const double t0 = bench_now_s();
            for (int r = 0; r < ROWS; r += 8) quant_r8_pack(type, N, src + (size_t)r * rb, rb, dst + (size_t)r * rb);
            const double t = bench_now_s() - t0;
            best = t < best ? t : best;
        }
        uint32_t h = 2166136261u; /* FNV-1a of the packed bytes */
        for (size_t i = 0; i < bytes; i++) h = (h ^ dst[i]) * 16777619u;
        printf("pack %-5s %6.2f MB in %7.3f ms = %5.2f GB/s  (packed bytes fnv1a %08x)\n", quant_get_traits(type)->name,
               (double)bytes / 1e6, best * 1e3, (double)bytes / best / 1e9, h);
        free(src);
        free(dst);
    }
    const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    ops_pool *pool = argc > 1 ? ops_pool_create(cpus > 0 ? (int)cpus : 1) : NULL;
    if (argc > 1 && !pool) return 1;
    for (int a = 1; a < argc; a++)
        for (int l = 0; l < LOADS; l++) {
            char msg[512] = "";
            model *m = NULL;
            const double t0 = bench_now_s();
            const int err = model_load_on(argv[a], 0, 0, pool, &m, msg, sizeof msg);
            const double t1 = bench_now_s();
            if (err) {
                fprintf(stderr, "bench_load: %s: %s\n", argv[a], msg);
                ops_pool_free(pool);
                return 1;
            }
            const int repacked = m->n_repacked;
            model_free(m);
            printf("load %s: %.3f s (%d matrices repacked), free %.3f s\n", argv[a], t1 - t0, repacked,
                   bench_now_s() - t1);
        }
    ops_pool_free(pool);
    return 0;
}
