/*
 * bench_util.h — what the harnesses in bench/ share: a monotonic clock, a
 * repeatable random float, and (with quant.h included first) random quantized
 * weight rows and activation rows for a kernel to work on. Header only,
 * static functions: each harness is one executable of its own (CMake option
 * KVS_BENCH; BENCHMARKS.md gives the commands), and includes this beside it.
 */
#ifndef KVS_BENCH_UTIL_H
#define KVS_BENCH_UTIL_H

#include <stdint.h>
#include <stdlib.h>
#include <time.h>

/* Seconds on the monotonic clock. */
static inline double bench_now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* A float in [-0.5, 0.5] from rand() (seed it with srand for the same numbers each run). */
static inline float bench_frand(void) { return (float)rand() / (float)RAND_MAX - 0.5f; }

#ifdef KVS_QUANT_H
/* count random rows of n elements, stride bytes apart from dst: weight rows
 * quantized to type, or (act) activation rows quantized for type's dot. */
static inline void bench_random_rows(uint32_t type, int n, int count, uint8_t *dst, size_t stride, int act) {
    float *x = malloc(sizeof(float) * (size_t)n);
    if (!x) abort();
    for (int r = 0; r < count; r++) {
        for (int i = 0; i < n; i++) x[i] = bench_frand();
        if (act) quant_act_quantize(type, x, dst + (size_t)r * stride, n);
        else quant_quantize_row(type, x, dst + (size_t)r * stride, n);
    }
    free(x);
}
#endif

#endif /* KVS_BENCH_UTIL_H */
