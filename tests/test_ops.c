/*
 * ops: the thread pool's two schedules and the matmul over them.
 * - ops_parallel_for and ops_parallel_for_guided hand out every item exactly
 *   once, in chunks of the promised shape (fixed: grain items; guided, shares
 *   1 and 2: whole grains starting at a multiple of grain, a share of what is
 *   left, only the last one short), for 1-4 threads and item counts around
 *   the grain.
 * - ops_matmul and ops_matmul_group over r8 and row-layout weights give the
 *   same bits with 1, 2 and 3 threads as one quant_dot per row (row layout;
 *   its multi and tile kernels are bit-identical to it, test_quant) or the
 *   r8 reference per group, for 1, 3 and 5 tokens: however the guided
 *   schedule splits the rows, each lands once and in its place.
 * - ops_rmsnorm, whose sum of squares runs in eight chains, gives the float
 *   a long double sum gives, at lengths with and without a tail past the
 *   chains (every element's square counted once).
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "isa_check.h"
#include "ops.h"
#include "quant.h"
#include "test.h"

enum { MAX_N = 700 };

typedef struct {
    atomic_int seen[MAX_N];
    int64_t n, grain;
    bool guided;
    int n_threads;
    atomic_int bad_shape, bad_slot;
} cover_ctx;

static void cover_fn(void *p, int64_t i0, int64_t i1, int slot) {
    cover_ctx *c = p;
    if (slot < 0 || slot >= c->n_threads) atomic_fetch_add(&c->bad_slot, 1);
    const int64_t len = i1 - i0;
    bool ok = i0 >= 0 && i1 <= c->n && len > 0;
    if (c->n_threads == 1 && c->guided) ok = ok && i0 == 0 && i1 == c->n; /* one run */
    else if (c->guided) ok = ok && i0 % c->grain == 0 && (len % c->grain == 0 || i1 == c->n);
    else ok = ok && i0 % c->grain == 0 && (len == c->grain || i1 == c->n);
    if (!ok) atomic_fetch_add(&c->bad_shape, 1);
    for (int64_t i = i0; i < i1 && i < MAX_N; i++) atomic_fetch_add(&c->seen[i], 1);
}

/* Guided chunks shrink: the first is a share (n / (share x threads), rounded
 * up to whole grains) of everything, so with several threads no chunk is the
 * whole. */
typedef struct {
    atomic_llong max_len;
} len_ctx;

static void len_fn(void *p, int64_t i0, int64_t i1, int slot) {
    (void)slot;
    len_ctx *c = p;
    long long len = (long long)(i1 - i0), m = atomic_load(&c->max_len);
    while (len > m && !atomic_compare_exchange_weak(&c->max_len, &m, len)) {
    }
}

static void test_cover(void) {
    static const int64_t ns[] = {0, 1, 7, 15, 16, 17, 48, 100, 257, MAX_N};
    static const int64_t grains[] = {1, 4, 16};
    static cover_ctx c;
    for (int nth = 1; nth <= 4; nth++) {
        ops_pool *pool = ops_pool_create(nth);
        CHECK(pool != NULL);
        if (!pool) continue;
        CHECK_EQ_INT(ops_pool_threads(pool), nth);
        for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++)
            for (size_t gi = 0; gi < sizeof grains / sizeof grains[0]; gi++)
                for (int guided = 0; guided < 3; guided++) { /* fixed, then guided shares 1 and 2 */
                    memset(&c, 0, sizeof c);
                    c.n = ns[ni];
                    c.grain = grains[gi];
                    c.guided = guided;
                    c.n_threads = nth;
                    if (guided) ops_parallel_for_guided(pool, c.n, c.grain, guided, cover_fn, &c);
                    else ops_parallel_for(pool, c.n, c.grain, cover_fn, &c);
                    int wrong = 0;
                    for (int64_t i = 0; i < c.n; i++) wrong += atomic_load(&c.seen[i]) != 1;
                    if (wrong || atomic_load(&c.bad_shape) || atomic_load(&c.bad_slot))
                        fprintf(stderr, "threads %d n %lld grain %lld guided share %d: %d items not run once, "
                                        "%d bad chunks, %d bad slots\n",
                                nth, (long long)c.n, (long long)c.grain, guided, wrong,
                                atomic_load(&c.bad_shape), atomic_load(&c.bad_slot));
                    CHECK_EQ_INT(wrong, 0);
                    CHECK_EQ_INT(atomic_load(&c.bad_shape), 0);
                    CHECK_EQ_INT(atomic_load(&c.bad_slot), 0);
                }
        if (nth > 1) {
            for (int share = 1; share <= 2; share++) {
                len_ctx lc;
                atomic_init(&lc.max_len, 0);
                ops_parallel_for_guided(pool, 1600, 16, share, len_fn, &lc);
                /* first chunk: 1600 / (share nth) rounded up to 16s; never the whole range */
                const long long first = (1600 / (share * nth) + 15) / 16 * 16;
                CHECK_EQ_INT(atomic_load(&lc.max_len), first);
            }
        }
        ops_pool_free(pool);
    }
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static float frand(void) { /* [-1, 1) */
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)(rng >> 40) / (float)(1u << 23) - 1.0f;
}

/* A weight of rows x n elements of type, random, in the row layout (*rows_out)
 * and, where the type has one, the r8 layout (*r8_out, else NULL). */
static bool make_weight(uint32_t type, int64_t n, int64_t rows, uint8_t **rows_out, uint8_t **r8_out, size_t *rb) {
    uint64_t b = 0;
    if (!quant_row_bytes(type, (uint64_t)n, &b)) return false;
    *rb = (size_t)b;
    uint8_t *w = malloc(*rb * (size_t)rows), *r8 = NULL;
    float *x = malloc((size_t)n * sizeof(float));
    if (!w || !x) return false;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < n; i++) x[i] = frand();
        if (!quant_quantize_row(type, x, w + (size_t)r * *rb, n)) return false;
    }
    free(x);
    if (quant_r8_supported(type) && rows % 8 == 0) {
        r8 = malloc(*rb * (size_t)rows);
        if (!r8) return false;
        for (int64_t g = 0; g < rows / 8; g++)
            quant_r8_pack(type, n, w + (size_t)g * 8 * *rb, *rb, r8 + (size_t)g * 8 * *rb);
    }
    *rows_out = w;
    *r8_out = r8;
    return true;
}

/* y[t][r] of weights a (rows_a) and b (rows_b), which read the same x, against
 * one dot per (row, token); threads 1-3, grouped and alone. */
static void test_matmul_type(uint32_t type) {
    enum { N = 512, TOK = 5 };
    const int64_t rows_a = 344, rows_b = 72; /* 43 and 9 r8 groups: odd, so a pair kernel meets a lone group */
    uint8_t *wa = NULL, *wa8 = NULL, *wb = NULL, *wb8 = NULL;
    size_t rb = 0;
    CHECK(make_weight(type, N, rows_a, &wa, &wa8, &rb));
    CHECK(make_weight(type, N, rows_b, &wb, &wb8, &rb));
    if (!wa || !wb) return;
    static float x[TOK * N], want_a[TOK * 344], want_b[TOK * 72], ya[TOK * 344], yb[TOK * 72];
    for (int i = 0; i < TOK * N; i++) x[i] = frand() * 3.0f;
    const size_t ab = quant_act_row_bytes(type, N);
    uint8_t *act = malloc(ab * TOK), *scratch = malloc(ab * TOK);
    CHECK(act && scratch);
    if (!act || !scratch) return;
    for (int t = 0; t < TOK; t++) quant_act_quantize(type, x + (size_t)t * N, act + (size_t)t * ab, N);
    for (int t = 0; t < TOK; t++) {
        for (int64_t r = 0; r < rows_a; r++)
            want_a[t * rows_a + r] = quant_dot(type, N, wa + (size_t)r * rb, act + (size_t)t * ab);
        for (int64_t r = 0; r < rows_b; r++)
            want_b[t * rows_b + r] = quant_dot(type, N, wb + (size_t)r * rb, act + (size_t)t * ab);
    }
    for (int layout = OPS_ROWS; layout <= (wa8 ? OPS_R8 : OPS_ROWS); layout++) {
        const ops_weight a = {.type = type, .n_in = N, .n_out = rows_a, .row_bytes = rb,
                              .data = layout == OPS_R8 ? wa8 : wa, .layout = layout};
        const ops_weight b = {.type = type, .n_in = N, .n_out = rows_b, .row_bytes = rb,
                              .data = layout == OPS_R8 ? wb8 : wb, .layout = layout};
        if (layout == OPS_R8) { /* the r8 kernels are checked against their own reference */
            for (int t = 0; t < TOK; t++) {
                quant_dot_r8_ref(type, N, wa8, (int)(rows_a / 8), act + (size_t)t * ab, ab, 1, want_a + t * rows_a, (size_t)rows_a);
                quant_dot_r8_ref(type, N, wb8, (int)(rows_b / 8), act + (size_t)t * ab, ab, 1, want_b + t * rows_b, (size_t)rows_b);
            }
        }
        for (int nth = 1; nth <= 3; nth++) {
            ops_pool *pool = ops_pool_create(nth);
            CHECK(pool != NULL);
            if (!pool) continue;
            for (int n_tok = 1; n_tok <= TOK; n_tok += 2) {
                for (int grouped = 0; grouped < 2; grouped++) {
                    memset(ya, 0, sizeof ya);
                    memset(yb, 0, sizeof yb);
                    if (grouped) {
                        const ops_weight *ws[2] = {&a, &b};
                        float *ys[2] = {ya, yb};
                        const int64_t st[2] = {rows_a, rows_b};
                        ops_matmul_group(pool, 2, ws, x, n_tok, ys, st, scratch);
                    } else {
                        ops_matmul(pool, &a, x, n_tok, ya, rows_a, scratch);
                        ops_matmul(pool, &b, x, n_tok, yb, rows_b, scratch);
                    }
                    int diff = 0;
                    for (int i = 0; i < n_tok * rows_a; i++) diff += memcmp(&ya[i], &want_a[i], sizeof(float)) != 0;
                    for (int i = 0; i < n_tok * rows_b; i++) diff += memcmp(&yb[i], &want_b[i], sizeof(float)) != 0;
                    if (diff)
                        fprintf(stderr, "%s %s threads %d tokens %d %s: %d outputs differ from the reference\n",
                                quant_get_traits(type)->name, layout == OPS_R8 ? "r8" : "rows", nth, n_tok,
                                grouped ? "grouped" : "alone", diff);
                    CHECK_EQ_INT(diff, 0);
                }
            }
            ops_pool_free(pool);
        }
    }
    free(wa); free(wa8); free(wb); free(wb8); free(act); free(scratch);
}

static void test_rmsnorm(void) {
    static const int64_t lens[] = {1, 7, 8, 13, 2048, 2051};
    enum { N_MAX = 2051 };
    static float x[N_MAX], w[N_MAX], out[N_MAX];
    uint32_t r = 12345;
    for (int i = 0; i < N_MAX; i++) {
        r = r * 1664525u + 1013904223u;
        x[i] = ((float)(r >> 8) / 16777216.0f - 0.5f) * (i % 5 == 0 ? 40.0f : 3.0f);
        w[i] = 0.5f + (float)(i % 17) / 16.0f;
    }
    for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++) {
        const int64_t n = lens[k];
        long double sum = 0;
        for (int64_t i = 0; i < n; i++) sum += (long double)x[i] * (long double)x[i];
        const float scale = 1.0f / sqrtf((float)(double)(sum / (long double)n) + 1e-5f);
        ops_rmsnorm(x, w, out, n, 1e-5f);
        int diff = 0;
        for (int64_t i = 0; i < n; i++) diff += out[i] != x[i] * scale * w[i];
        CHECK_EQ_INT(diff, 0);
    }
}

int main(void) {
    check_expected_isa("test_ops");
    test_rmsnorm();
    test_cover();
    static const uint32_t types[] = {QUANT_Q4_0, QUANT_Q8_0, QUANT_Q4_K, QUANT_Q6_K};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) test_matmul_type(types[i]);
    return test_finish("test_ops", 1, 0);
}
