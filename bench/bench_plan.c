/* The route planner on a synthetic registry (BENCHMARKS.md "Cluster planner"): 10,000 shards of
 * 100 models, each model 32 layers in stages of 4 or 8 layers with several replicas and random
 * loads. Prints one JSON line: the median and p99 time of cl_pick_model + cl_plan_route for a
 * random model, over 2,000 plans. Usage: bench_plan [SHARDS] [MODELS] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "plan.h"
#include "registry.h"

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    size_t n = argc > 1 ? (size_t)atol(argv[1]) : 10000, models = argc > 2 ? (size_t)atol(argv[2]) : 100;
    if (models == 0 || n < models) return 2;
    cl_entry *e = calloc(n, sizeof *e);
    if (!e) return 1;
    srand(7);
    for (size_t i = 0; i < n; i++) {
        size_t m = i % models, k = i / models;
        uint32_t stage = (m % 2) ? 4 : 8, n_stage = 32 / stage;
        uint32_t s = (uint32_t)(k % n_stage);
        snprintf(e[i].addr, sizeof e[i].addr, "10.%zu.%zu.%zu:7000", m / 256, m % 256, k);
        snprintf(e[i].name, sizeof e[i].name, "model-%zu", m);
        for (int d = 0; d < 64; d++) e[i].digest[d] = "0123456789abcdef"[(m >> (4 * (d % 4))) & 15];
        e[i].digest[64] = 0;
        e[i].n_layer = 32;
        e[i].first = s * stage;
        e[i].last = (s + 1) * stage;
        e[i].kv_budget = 1ull << 30;
        e[i].kv_used = (uint64_t)(rand() % 1000) << 20;
        e[i].load = (double)(rand() % 1000) / 100.0;
    }
    enum { RUNS = 2000 };
    static double t[RUNS];
    size_t hops = 0;
    for (int r = 0; r < RUNS; r++) {
        char want[32], digest[CL_DIGEST_HEX + 1];
        snprintf(want, sizeof want, "model-%d", rand() % (int)models);
        double t0 = now_us();
        cl_plan p;
        if (cl_pick_model(e, n, want, digest, NULL, 0) || cl_plan_route(e, n, digest, &p, NULL, 0)) return 1;
        t[r] = now_us() - t0;
        hops += p.n_hops;
        cl_plan_free(&p);
    }
    qsort(t, RUNS, sizeof t[0], cmp_d);
    printf("{\"shards\":%zu,\"models\":%zu,\"plans\":%d,\"median_us\":%.1f,\"p99_us\":%.1f,\"mean_hops\":%.2f}\n", n,
           models, RUNS, t[RUNS / 2], t[RUNS * 99 / 100], (double)hops / RUNS);
    free(e);
    return 0;
}
