/*
 * bench_r8_stream — the one-token r8 kernel modes (quant_r8_set_walk: off,
 * pairs, quads, spread quads), the same hand-out with no arithmetic ("no math":
 * its ceiling) and the bandwidth probe's stream counts, streaming weights
 * from DRAM the way decode does, side by side in one run: a 512 MiB buffer of
 * repacked rows of 2048 elements cut into matrices of 5632 rows (TinyLlama's
 * FFN), each matrix split over the threads in guided chunks of 16 rows as
 * ops_matmul does. Every pass runs each mode once, in turn, so a noisy
 * machine's slow spells fall on all of them alike; the median and the best
 * GB/s per mode, and each mode's median over the probe's best.
 *
 * Built with -DKVS_BENCH=ON (CMakeLists.txt); from the repository root:
 *   build/bench_r8_stream [q4_0|q8_0|q4_k|q6_k [threads [passes [N [rows]]]]]
 * (defaults q4_0, 2 threads, 15 passes, rows of 2048, 5632 rows per matrix).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"
#include "quant.h"
#include "util.h"
#include "vecops.h"
#include "bench_util.h"

enum { CHUNK = 16, MAX_PASSES = 64, SEED_ROWS = 64 };
static int N = 2048, MAT_ROWS = 5632; /* row length and rows per matrix (argv 4, 5) */

typedef struct {
    uint32_t type;
    const uint8_t *w; /* one matrix */
    size_t rb;
    const uint8_t *act;
    size_t ab;
    float *out;
} mat_task;

/* The same hand-out with no arithmetic: the call's rows read by vec_read_sum
 * as four streams a quarter of the range apart, as the spread quads walk
 * them (the ceiling of the matmul's structure: chunks, one barrier per matrix). */
static uint64_t read_sink[64]; /* per slot, so the reads are not optimized away */

static void mat_read(void *p, int64_t r0, int64_t r1, int slot) {
    const mat_task *t = p;
    read_sink[slot & 63] += vec_read_sum(t->w + (size_t)r0 * t->rb, (size_t)(r1 - r0) * t->rb, 4);
}

static void mat_rows(void *p, int64_t r0, int64_t r1, int slot) {
    (void)slot;
    const mat_task *t = p;
    quant_dot_r8(t->type, N, t->w + (size_t)r0 * t->rb, (int)((r1 - r0) / 8), t->act, t->ab, 1, t->out + r0, MAT_ROWS);
}

typedef struct {
    const uint8_t *buf;
    size_t chunk;
    int streams;
    uint64_t sink[64];
} probe_task;

static void probe_chunk(void *p, int64_t c0, int64_t c1, int slot) {
    probe_task *t = p;
    for (int64_t c = c0; c < c1; c++) t->sink[slot & 63] += vec_read_sum(t->buf + (size_t)c * t->chunk, t->chunk, t->streams);
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    static const struct {
        const char *name;
        uint32_t type;
    } types[] = {{"q4_0", QUANT_Q4_0}, {"q8_0", QUANT_Q8_0}, {"q4_k", QUANT_Q4_K}, {"q6_k", QUANT_Q6_K}};
    const char *name = argc > 1 ? argv[1] : "q4_0";
    const int threads = argc > 2 ? atoi(argv[2]) : 2, passes = argc > 3 ? atoi(argv[3]) : 15;
    if (argc > 4) N = atoi(argv[4]);
    if (argc > 5) MAT_ROWS = atoi(argv[5]);
    int k = -1;
    for (int i = 0; i < 4; i++)
        if (!strcmp(name, types[i].name)) k = i;
    if (k < 0 || threads < 1 || threads > 64 || passes < 1 || passes > MAX_PASSES || N < 256 || N % 256 ||
        MAT_ROWS < 8 || MAT_ROWS % 8) {
        fprintf(stderr, "usage: bench_r8_stream [q4_0|q8_0|q4_k|q6_k [threads 1-64 [passes 1-%d [row length, a "
                        "multiple of 256 [rows, a multiple of 8]]]]]\n", MAX_PASSES);
        return 2;
    }
    const uint32_t type = types[k].type;
    uint64_t rb = 0;
    if (!quant_row_bytes(type, N, &rb)) return 1;
    const size_t ab = quant_act_row_bytes(type, N), mat_bytes = (size_t)rb * MAT_ROWS;
    const size_t total = (size_t)512 << 20, n_mat = total / mat_bytes;
    size_t mapped = 0;
    uint8_t *buf = kvs_map_big(n_mat * mat_bytes, false, &mapped), *seed = malloc(rb * SEED_ROWS),
            *packed = malloc(rb * SEED_ROWS), *act = malloc(ab);
    float *out = malloc(sizeof(float) * MAT_ROWS);
    ops_pool *pool = ops_pool_create(threads);
    if (!buf || !seed || !packed || !act || !out || !pool) return 1;
    srand(1);
    bench_random_rows(type, N, SEED_ROWS, seed, rb, 0);
    bench_random_rows(type, N, 1, act, ab, 1);
    for (int r = 0; r < SEED_ROWS; r += 8) quant_r8_pack(type, N, seed + (size_t)r * rb, rb, packed + (size_t)r * rb);
    for (size_t off = 0; off < n_mat * mat_bytes; off += rb * SEED_ROWS) {
        const size_t n = n_mat * mat_bytes - off < rb * SEED_ROWS ? n_mat * mat_bytes - off : rb * SEED_ROWS;
        memcpy(buf + off, packed, n);
    }
    static const char *const mode_names[] = {"off", "pairs", "quads", "spread", "no math"};
    enum { MODES = 5, PROBES = 4 };
    static double gbs[MODES + PROBES][MAX_PASSES];
    const double bytes = (double)n_mat * (double)mat_bytes;
    probe_task pt = {.buf = buf, .chunk = (size_t)1 << 20};
    for (int pass = 0; pass < passes; pass++) {
        for (int m = 0; m < MODES; m++) {
            quant_r8_set_walk(m < 4 ? m : -1);
            const double t0 = bench_now_s();
            for (size_t i = 0; i < n_mat; i++) {
                mat_task t = {.type = type, .w = buf + i * mat_bytes, .rb = rb, .act = act, .ab = ab, .out = out};
                ops_parallel_for_guided(pool, MAT_ROWS, CHUNK, 1, m < 4 ? mat_rows : mat_read, &t);
            }
            gbs[m][pass] = bytes / (bench_now_s() - t0) / 1e9;
        }
        for (int p = 0; p < PROBES; p++) {
            pt.streams = 1 << p;
            const double t0 = bench_now_s();
            ops_parallel_for(pool, (int64_t)(bytes / (double)pt.chunk), 4, probe_chunk, &pt);
            gbs[MODES + p][pass] = bytes / (bench_now_s() - t0) / 1e9;
        }
    }
    quant_r8_set_walk(-1);
    double probe_best = 0, med[MODES + PROBES], best[MODES + PROBES];
    for (int m = 0; m < MODES + PROBES; m++) {
        best[m] = 0;
        for (int p = 0; p < passes; p++) best[m] = gbs[m][p] > best[m] ? gbs[m][p] : best[m];
        qsort(gbs[m], (size_t)passes, sizeof(double), cmp_double);
        med[m] = gbs[m][passes / 2];
        if (m >= MODES && best[m] > probe_best) probe_best = best[m];
    }
    printf("%s, %d threads, %.0f MiB in %zu matrices of %d rows, %d passes (GB/s median / best, median/probe-best)\n", name,
           threads, bytes / 1048576.0, n_mat, MAT_ROWS, passes);
    for (int m = 0; m < MODES; m++)
        printf("  r8 one token, %-7s %6.2f / %6.2f  %.3f\n", mode_names[m], med[m], best[m], med[m] / probe_best);
    for (int p = 0; p < PROBES; p++)
        printf("  probe, %d stream%s    %6.2f / %6.2f\n", 1 << p, p ? "s" : " ", med[MODES + p], best[MODES + p]);
    kvs_unmap_big(buf, mapped);
    free(seed), free(packed), free(act), free(out);
    ops_pool_free(pool);
    return 0;
}
