/*
 * bench_kv_runs — how fast one core reads memory in runs of a given length,
 * the shape of a decode step's KV reads: attention walks one kv head's rows,
 * a run of block_tokens x head_dim x 2 bytes (2 KB for a TinyLlama-shaped f16
 * cache) in each KV block, and the next block's run is a block (~352 KB)
 * away. For each run length, runs that start STRIDE_KB apart are read with
 * 256-bit loads, once, after 128 MiB of other reads have pushed them out of
 * the caches; GB/s of run bytes, after one untimed pass over all lengths (the
 * first pass over the mapping is slower: its page-table walks are cold). The buffer is on 2 MiB pages where the kernel
 * gives them, as kvstate's arena is.
 *
 * Not part of the build. From the repository root:
 *   cc -O2 -mavx2 scripts/bench_kv_runs.c -o build/bench_kv_runs && build/bench_kv_runs [STRIDE_KB [ROUNDS]]
 */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "bench_util.h"

/* Reads n_runs runs of run bytes, stride apart, from buf; returns GB/s. */
static double read_runs(const char *buf, size_t n_runs, size_t run, size_t stride, const char *evict, size_t evict_bytes) {
    volatile char sink = 0;
    for (size_t i = 0; i < evict_bytes; i += 64) sink = (char)(sink + evict[i]);
    __m256i acc = _mm256_setzero_si256();
    const double t0 = bench_now_s();
    for (size_t r = 0; r < n_runs; r++) {
        const char *p = buf + r * stride;
        for (size_t b = 0; b < run; b += 32) acc = _mm256_add_epi32(acc, _mm256_load_si256((const __m256i *)(p + b)));
    }
    const double t = bench_now_s() - t0;
    sink = (char)(sink + (char)_mm256_extract_epi32(acc, 0));
    return (double)(n_runs * run) / t / 1e9;
}

int main(int argc, char **argv) {
    const long stride_kb = argc > 1 ? atol(argv[1]) : 352, rounds = argc > 2 ? atol(argv[2]) : 3;
    static const size_t runs[] = {2048, 4096, 8192, 16384, 65536};
    const size_t n_lens = sizeof runs / sizeof runs[0], stride = (size_t)stride_kb * 1024, n_runs = 2000;
    if (stride_kb < 64 || stride_kb > 4096 || rounds < 1) { /* runs of up to 64 KB must not overlap */
        fprintf(stderr, "usage: bench_kv_runs [STRIDE_KB 64..4096 [ROUNDS >= 1]]\n");
        return 2;
    }
    const size_t huge = 2u << 20, bytes = (n_runs * stride + huge - 1) / huge * huge, evict_bytes = 128u << 20;
    char *buf = NULL, *evict = malloc(evict_bytes);
    if (posix_memalign((void **)&buf, huge, bytes)) buf = NULL;
    if (!buf || !evict) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    madvise(buf, bytes, MADV_HUGEPAGE);
    memset(buf, 1, bytes);
    memset(evict, 2, evict_bytes);
    for (size_t i = 0; i < n_lens; i++) read_runs(buf, n_runs, runs[i], stride, evict, evict_bytes); /* untimed: page walks warm */
    printf("one core, runs %ld KB apart, caches evicted before each, GB/s:\n", stride_kb);
    for (long r = 0; r < rounds; r++) {
        for (size_t i = 0; i < n_lens; i++)
            printf("%3zu KB runs %5.1f   ", runs[i] / 1024,
                   read_runs(buf, n_runs, runs[i], stride, evict, evict_bytes));
        printf("\n");
    }
    free(buf);
    free(evict);
    return 0;
}
