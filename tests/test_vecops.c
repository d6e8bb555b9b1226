/*
 * vecops: the attention kernels under every ISA the CPU has against a double
 * precision reference — scores of a group of heads against one key row, the
 * weighted sum of value rows (bit-identical to one vec_axpy per row), and the
 * softmax with its polynomial exp (accuracy, underflow, tails).
 */
#include <math.h>
#include <string.h>

#include "f16.h"
#include "isa_check.h"
#include "test.h"
#include "vecops.h"

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static float frand(void) { /* [-1, 1) */
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)(rng >> 40) / (float)(1u << 23) - 1.0f;
}

enum { MAX_HD = 288, MAX_GROUP = 12, MAX_ROWS = 301 };

static void test_scores(int group, int hd, int f16) {
    static float q[MAX_GROUP * MAX_HD], kf[MAX_HD], got[MAX_GROUP * 3];
    static uint16_t kh[MAX_HD];
    for (int i = 0; i < group * hd; i++) q[i] = frand();
    for (int i = 0; i < hd; i++) {
        kh[i] = kvs_f32_to_f16(frand() * 2.0f);
        kf[i] = f16 ? kvs_f16_to_f32(kh[i]) : frand() * 2.0f;
    }
    const float scale = 0.125f;
    memset(got, 0, sizeof got);
    const void *key = f16 ? (const void *)kh : (const void *)kf;
    vec_scores(q, group, hd, &key, 1, f16, scale, got, 3);
    for (int h = 0; h < group; h++) {
        double want = 0, mag = 0;
        for (int i = 0; i < hd; i++) {
            want += (double)q[h * hd + i] * kf[i];
            mag += fabs((double)q[h * hd + i] * kf[i]);
        }
        CHECK_NEAR(got[h * 3], want * scale, 1e-6 * mag + 1e-7);
        CHECK(got[h * 3 + 1] == 0.0f); /* only every stride-th entry is written */
    }
}

/* Many keys in one call (blocks, tiles and their tails) equal one call per
 * key, and a group's scores equal each head's alone, bit for bit. */
static void test_scores_run(int group, int hd, int f16) {
    enum { KEYS = 37 };
    static float q[MAX_GROUP * MAX_HD], kf[KEYS][MAX_HD], run[MAX_GROUP * KEYS], one[MAX_GROUP * KEYS],
        head[MAX_GROUP * KEYS];
    static uint16_t kh[KEYS][MAX_HD];
    static const void *keys[KEYS];
    for (int i = 0; i < group * hd; i++) q[i] = frand();
    for (int j = 0; j < KEYS; j++) {
        for (int i = 0; i < hd; i++) {
            kf[j][i] = frand();
            kh[j][i] = kvs_f32_to_f16(kf[j][i]);
        }
        const int r = (j * 11) % KEYS; /* rows in no particular order, as KV blocks are */
        keys[j] = f16 ? (const void *)kh[r] : (const void *)kf[r];
    }
    vec_scores(q, group, hd, keys, KEYS, f16, 0.5f, run, KEYS);
    for (int j = 0; j < KEYS; j++) vec_scores(q, group, hd, keys + j, 1, f16, 0.5f, one + j, KEYS);
    for (int h = 0; h < group; h++) vec_scores(q + h * hd, 1, hd, keys, KEYS, f16, 0.5f, head + h * KEYS, KEYS);
    CHECK(memcmp(run, one, sizeof(float) * (size_t)(group * KEYS)) == 0);
    CHECK(memcmp(run, head, sizeof(float) * (size_t)(group * KEYS)) == 0);
}

static void test_wsum(int n, int hd, int f16) {
    static float p[MAX_ROWS], vf[MAX_ROWS][MAX_HD], got[MAX_HD], axpy[MAX_HD];
    static uint16_t vh[MAX_ROWS][MAX_HD];
    static const void *rows[MAX_ROWS];
    for (int j = 0; j < n; j++) {
        p[j] = frand() * 0.5f + 0.5f;
        for (int i = 0; i < hd; i++) {
            vh[j][i] = kvs_f32_to_f16(frand());
            vf[j][i] = f16 ? kvs_f16_to_f32(vh[j][i]) : frand();
        }
        rows[j] = f16 ? (const void *)vh[j] : (const void *)vf[j];
    }
    vec_wsum_group(p, 0, 1, n, rows, f16, hd, got);
    memset(axpy, 0, sizeof axpy);
    for (int j = 0; j < n; j++) {
        if (f16) vec_axpy_f16(p[j], vh[j], axpy, hd);
        else vec_axpy_f32(p[j], vf[j], axpy, hd);
    }
    int diff = 0;
    for (int i = 0; i < hd; i++) {
        double want = 0, mag = 0;
        for (int j = 0; j < n; j++) {
            want += (double)p[j] * vf[j][i];
            mag += fabs((double)p[j] * vf[j][i]);
        }
        CHECK_NEAR(got[i], want, 1e-6 * mag + 1e-7);
        diff += memcmp(&got[i], &axpy[i], 4) != 0;
    }
    CHECK_EQ_INT(diff, 0);
    /* every head of a group at once: the same bits as each head alone */
    enum { G = 11 };
    static float pg[G][MAX_ROWS], outg[G * MAX_HD], outh[MAX_HD];
    for (int h = 0; h < G; h++)
        for (int j = 0; j < n; j++) pg[h][j] = frand() * 0.5f + 0.5f;
    for (int group = 1; group <= G; group += 3) {
        vec_wsum_group(&pg[0][0], MAX_ROWS, group, n, rows, f16, hd, outg);
        int gdiff = 0;
        for (int h = 0; h < group; h++) {
            vec_wsum_group(pg[h], 0, 1, n, rows, f16, hd, outh);
            gdiff += memcmp(outh, outg + (size_t)h * (size_t)hd, sizeof(float) * (size_t)hd) != 0;
        }
        CHECK_EQ_INT(gdiff, 0);
    }
}

static void test_softmax(int n, float spread) {
    static float x[4096];
    static double want[4096];
    for (int i = 0; i < n; i++) x[i] = frand() * spread;
    if (n > 3) x[3] = -1e30f; /* underflows to 0 */
    static double slack[4096];
    double max = -INFINITY, sum = 0;
    for (int i = 0; i < n; i++) max = x[i] > max ? x[i] : max;
    for (int i = 0; i < n; i++) {
        sum += want[i] = exp((double)x[i] - max);
        slack[i] = fabs((double)x[i] - max) * 6e-8; /* x - max is rounded to float first, as for expf */
    }
    vec_softmax(x, n);
    double got_sum = 0, worst = 0;
    for (int i = 0; i < n; i++) {
        want[i] /= sum;
        got_sum += x[i];
        double rel = fabs(x[i] - want[i]) / (want[i] + 1e-30) - slack[i];
        if (want[i] > 1e-30 && rel > worst) worst = rel;
        CHECK(x[i] >= 0.0f && isfinite(x[i]));
    }
    if (worst >= 2e-6) printf("softmax n=%d spread %g: worst relative error %.3g\n", n, (double)spread, worst);
    CHECK(worst < 2e-6);
    CHECK_NEAR(got_sum, 1.0, 1e-5);
    if (n > 3) CHECK(x[3] == 0.0f);
}

/* silu(g) * u against double precision, including tails where exp(-g)
 * overflows float (g << 0) and vector tails (n not a multiple of 8). */
static void test_swiglu(int n) {
    static float g[1031], u[1031];
    for (int i = 0; i < n; i++) {
        g[i] = frand() * 12.0f;
        u[i] = frand() * 3.0f;
    }
    static const float edge[] = {0.0f, -0.0f, 1e-8f, -1e-8f, 88.5f, -88.5f, 100.0f, -100.0f, -200.0f, 3e4f};
    for (int i = 0; i < n && i < (int)(sizeof edge / sizeof edge[0]); i++) g[(i * 7) % n] = edge[i];
    static float want[1031];
    for (int i = 0; i < n; i++) want[i] = (float)((double)g[i] / (1.0 + exp(-(double)g[i])) * (double)u[i]);
    vec_swiglu(g, u, n);
    int bad = 0;
    for (int i = 0; i < n; i++) bad += !(fabs((double)g[i] - want[i]) <= 1e-6 * fabs(want[i]) + 1e-30) || !isfinite(g[i]);
    CHECK_EQ_INT(bad, 0);
}

/* vec_read_sum against the plain sum of the words, for sizes from one 256-byte
 * step up, read as 1, 2, 4 and 8 streams where the size splits; the words differ in every byte, so a skipped or repeated load, a
 * lost lane or a carry dropped across lanes changes the sum. */
static void test_read_sum(size_t n) {
    static _Alignas(64) uint64_t w[4096 + 32];
    uint64_t want = 0;
    for (size_t i = 0; i < n / 8; i++) {
        w[i] = (rng = rng * 6364136223846793005ull + 1442695040888963407ull);
        want += w[i];
    }
    for (int streams = 1; streams <= 8; streams *= 2)
        if (n % (256 * (size_t)streams) == 0) CHECK(vec_read_sum(w, n, streams) == want);
}

/* The AVX-512 walks against the AVX2 ones, bit for bit: scores, softmax and
 * weighted sums of every head count 1-12 (tiles of 1-4 heads and their tails), key
 * counts through full tiles, pairs and a last key, head sizes with and without
 * an 8-element tail. */
static void test_avx512_bits(int group, int hd, int f16, int n) {
    static float q[MAX_GROUP * MAX_HD], kf[MAX_ROWS][MAX_HD], s2[MAX_GROUP * MAX_ROWS], s5[MAX_GROUP * MAX_ROWS];
    static float o2[MAX_GROUP * MAX_HD], o5[MAX_GROUP * MAX_HD], w[MAX_GROUP * MAX_ROWS], w5[MAX_GROUP * MAX_ROWS];
    static uint16_t kh[MAX_ROWS][MAX_HD];
    static const void *rows[MAX_ROWS];
    for (int i = 0; i < group * hd; i++) q[i] = frand();
    for (int j = 0; j < n; j++) {
        for (int i = 0; i < hd; i++) {
            kf[j][i] = frand();
            kh[j][i] = kvs_f32_to_f16(kf[j][i]);
        }
        const int r = (j * 7) % n;
        rows[j] = f16 ? (const void *)kh[r] : (const void *)kf[r];
    }
    CHECK(kvs_isa_force(KVS_ISA_AVX2));
    vec_scores(q, group, hd, rows, n, f16, 0.25f, s2, (size_t)n);
    memcpy(w, s2, sizeof(float) * (size_t)(group * n));
    for (int h = 0; h < group; h++) vec_softmax(w + (size_t)h * (size_t)n, n);
    vec_wsum_group(w, (size_t)n, group, n, rows, f16, hd, o2);
    CHECK(kvs_isa_force(KVS_ISA_AVX512));
    vec_scores(q, group, hd, rows, n, f16, 0.25f, s5, (size_t)n);
    const int sdiff = memcmp(s2, s5, sizeof(float) * (size_t)(group * n)) != 0;
    memcpy(w5, s2, sizeof(float) * (size_t)(group * n));
    for (int h = 0; h < group; h++) vec_softmax(w5 + (size_t)h * (size_t)n, n);
    const int mdiff = memcmp(w, w5, sizeof(float) * (size_t)(group * n)) != 0;
    vec_wsum_group(w, (size_t)n, group, n, rows, f16, hd, o5); /* the same weights for both */
    const int wdiff = memcmp(o2, o5, sizeof(float) * (size_t)(group * hd)) != 0;
    if (sdiff || mdiff || wdiff)
        fprintf(stderr, "avx512 vs avx2: group %d hd %d f16 %d n %d: scores %s, softmax %s, weighted sums %s\n", group,
                hd, f16, n, sdiff ? "differ" : "same", mdiff ? "differs" : "same", wdiff ? "differ" : "same");
    CHECK_EQ_INT(sdiff, 0);
    CHECK_EQ_INT(mdiff, 0);
    CHECK_EQ_INT(wdiff, 0);
}

int main(void) {
    check_expected_isa("test_vecops");
    enum kvs_isa best = kvs_isa_detect();
    int checked = 0;
    for (int isa = 0; isa <= (int)best; isa++) {
        CHECK(kvs_isa_force((enum kvs_isa)isa));
        static const int hds[] = {8, 64, 72, 128, 136};
        static const int groups[] = {1, 3, 7, 8, 12};
        for (size_t a = 0; a < sizeof hds / sizeof hds[0]; a++)
            for (size_t b = 0; b < sizeof groups / sizeof groups[0]; b++)
                for (int f16 = 0; f16 < 2; f16++) {
                    test_scores(groups[b], hds[a], f16);
                    test_scores_run(groups[b], hds[a], f16);
                }
        static const int ns[] = {1, 2, 9, 300};
        for (size_t a = 0; a < sizeof hds / sizeof hds[0]; a++)
            for (size_t b = 0; b < sizeof ns / sizeof ns[0]; b++)
                for (int f16 = 0; f16 < 2; f16++) test_wsum(ns[b], hds[a], f16);
        static const int sn[] = {1, 7, 8, 33, 2049, 4096};
        for (size_t a = 0; a < sizeof sn / sizeof sn[0]; a++) {
            test_softmax(sn[a], 1.0f);
            test_softmax(sn[a], 80.0f);
        }
        static const int wn[] = {1, 7, 8, 13, 1031};
        for (size_t a = 0; a < sizeof wn / sizeof wn[0]; a++) test_swiglu(wn[a]);
        static const size_t rn[] = {256, 512, 768, 4096, 32768};
        for (size_t a = 0; a < sizeof rn / sizeof rn[0]; a++) test_read_sum(rn[a]);
        printf("test_vecops: %s checked\n", kvs_isa_name((enum kvs_isa)isa));
        checked++;
    }
    if (best >= KVS_ISA_AVX512) {
        /* 32, 64, 96, 128 and 256: the transposed f16 scores (head sizes a multiple of 32 up to 256);
         * 288: past them, the per-tile walk */
        static const int hds[] = {8, 24, 32, 48, 64, 72, 96, 128, 136, 256, 288};
        static const int ns[] = {1, 2, 3, 17, 37, 300};
        for (size_t a = 0; a < sizeof hds / sizeof hds[0]; a++)
            for (int group = 1; group <= MAX_GROUP; group++)
                for (size_t b = 0; b < sizeof ns / sizeof ns[0]; b++)
                    for (int f16 = 0; f16 < 2; f16++) test_avx512_bits(group, hds[a], f16, ns[b]);
        printf("test_vecops: avx512 attention bit-identical to avx2\n");
    }
    kvs_isa_force(best);
    return test_finish("test_vecops", checked, 0);
}
