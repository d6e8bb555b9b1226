/* test_quant — block layouts, conversions, and every kernel against its scalar twin. */
#include <math.h>
#include <stdint.h>

#include "isa_check.h"
#include "cpu.h"
#include "f16.h"
#include "quant.h"
#include "test.h"

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint32_t rng_u32(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 32);
}

static float rng_unit(void) { return (float)(rng_u32() >> 8) * (1.0f / 16777216.0f); } /* [0,1) */

/* Roughly Gaussian, with a per-32 scale that varies so blocks differ. */
static void fill_random(float *x, int64_t n, float scale) {
    float s = scale;
    for (int64_t i = 0; i < n; i++) {
        if (i % 32 == 0) s = scale * (0.25f + 2.0f * rng_unit());
        x[i] = s * (rng_unit() + rng_unit() + rng_unit() - 1.5f);
    }
}

static float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static int n_isas;
static enum kvs_isa isas[3];

static void test_traits(void) {
    CHECK(quant_get_traits(4) == NULL);
    CHECK(quant_get_traits(5) == NULL);
    CHECK(quant_get_traits(63) == NULL);
    CHECK(quant_get_traits(21) == NULL); /* iq3_s: not known */
    CHECK_EQ_INT(QUANT_IQ4_NL, 20);      /* GGUF's ids */
    CHECK_EQ_INT(QUANT_IQ4_XS, 23);
    CHECK(quant_get_traits(64) == NULL);
    CHECK(quant_get_traits(0xFFFFFFFFu) == NULL);
    static const struct { uint32_t type; uint32_t elems, bytes; bool compute; } want[] = {
        {QUANT_F32, 1, 4, true},     {QUANT_F16, 1, 2, true},      {QUANT_BF16, 1, 2, true},
        {QUANT_Q4_0, 32, 18, true},  {QUANT_Q4_1, 32, 20, true},   {QUANT_Q5_0, 32, 22, true},
        {QUANT_Q5_1, 32, 24, true},  {QUANT_Q8_0, 32, 34, true},   {QUANT_Q8_1, 32, 36, false},
        {QUANT_Q2_K, 256, 84, true}, {QUANT_Q3_K, 256, 110, true}, {QUANT_Q4_K, 256, 144, true},
        {QUANT_Q5_K, 256, 176, true}, {QUANT_Q6_K, 256, 210, true}, {QUANT_Q8_K, 256, 292, false},
        {QUANT_IQ4_NL, 32, 18, true}, {QUANT_IQ4_XS, 256, 136, true},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const quant_traits *t = quant_get_traits(want[i].type);
        CHECK(t != NULL);
        if (!t) continue;
        CHECK_EQ_INT(t->block_elems, want[i].elems);
        CHECK_EQ_INT(t->block_bytes, want[i].bytes);
        CHECK_EQ_INT(t->compute, want[i].compute);
        CHECK_EQ_INT(quant_type_from_name(t->name), want[i].type);
    }
    CHECK_EQ_INT(quant_type_from_name("Q4_K"), QUANT_Q4_K);
    CHECK_EQ_INT(quant_type_from_name("IQ4_XS"), QUANT_IQ4_XS);
    CHECK_EQ_INT(quant_type_from_name("q4_2"), -1);
    CHECK_EQ_INT(quant_type_from_name(""), -1);

    uint64_t b = 0;
    CHECK(quant_row_bytes(QUANT_Q4_0, 64, &b));
    CHECK_EQ_INT(b, 36);
    CHECK(quant_row_bytes(QUANT_Q6_K, 512, &b));
    CHECK_EQ_INT(b, 420);
    CHECK(quant_row_bytes(QUANT_F16, 3, &b));
    CHECK_EQ_INT(b, 6);
    b = 12345;
    CHECK(!quant_row_bytes(QUANT_Q4_0, 31, &b));
    CHECK(!quant_row_bytes(QUANT_Q4_K, 300, &b));
    CHECK(!quant_row_bytes(QUANT_F32, UINT64_MAX / 2, &b));
    CHECK(!quant_row_bytes(QUANT_Q8_0, (UINT64_MAX / 32) * 32, &b));
    CHECK(!quant_row_bytes(QUANT_F16, UINT64_MAX / 2 + 1, &b));
    CHECK(!quant_row_bytes(4, 32, &b));
    CHECK_EQ_INT(b, 12345);
}

static void test_half(void) {
    CHECK_EQ_INT(kvs_f32_to_f16(1.0f), 0x3C00);
    CHECK_EQ_INT(kvs_f32_to_f16(-2.0f), 0xC000);
    CHECK_EQ_INT(kvs_f32_to_f16(0.0f), 0x0000);
    CHECK_EQ_INT(kvs_f32_to_f16(-0.0f), 0x8000);
    CHECK_EQ_INT(kvs_f32_to_f16(65504.0f), 0x7BFF);
    CHECK_EQ_INT(kvs_f32_to_f16(65519.0f), 0x7BFF);
    CHECK_EQ_INT(kvs_f32_to_f16(65520.0f), 0x7C00);
    CHECK_EQ_INT(kvs_f32_to_f16(INFINITY), 0x7C00);
    CHECK_EQ_INT(kvs_f32_to_f16(-INFINITY), 0xFC00);
    CHECK_EQ_INT(kvs_f32_to_f16(0x1p-24f), 0x0001);
    CHECK_EQ_INT(kvs_f32_to_f16(0x1p-25f), 0x0000);       /* tie -> even */
    CHECK_EQ_INT(kvs_f32_to_f16(0x1.8p-25f), 0x0001);
    CHECK_EQ_INT(kvs_f32_to_f16(0x1.8p-24f), 0x0002);     /* tie -> even */
    CHECK_EQ_INT(kvs_f32_to_f16(0x1p-14f), 0x0400);
    CHECK_EQ_INT(kvs_f32_to_f16(0x1p-30f), 0x0000);
    CHECK_EQ_INT(kvs_f32_to_f16(1.0f + 0x1p-11f), 0x3C00); /* tie -> even */
    CHECK_EQ_INT(kvs_f32_to_f16(1.0f + 0x1.8p-10f), 0x3C02);
    uint16_t hn = kvs_f32_to_f16(NAN);
    CHECK((hn & 0x7C00) == 0x7C00 && (hn & 0x3FF) != 0);
    CHECK(isnan(kvs_f16_to_f32(0x7E00)));
    CHECK(kvs_f16_to_f32(0x7C00) == INFINITY);
    CHECK(kvs_f16_to_f32(0xFC00) == -INFINITY);
    CHECK(kvs_f16_to_f32(0x0001) == 0x1p-24f);
    CHECK(kvs_f16_to_f32(0x03FF) == 1023.0f * 0x1p-24f);
    CHECK(kvs_f16_to_f32(0x8000) == 0.0f && signbit(kvs_f16_to_f32(0x8000)));
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        if ((h & 0x7C00) == 0x7C00 && (h & 0x3FF)) continue;
        if (kvs_f32_to_f16(kvs_f16_to_f32((uint16_t)h)) != h) bad++;
    }
    CHECK_EQ_INT(bad, 0);

    CHECK_EQ_INT(kvs_f32_to_bf16(1.0f), 0x3F80);
    CHECK_EQ_INT(kvs_f32_to_bf16(bits_f32(0x3F808000u)), 0x3F80); /* tie -> even */
    CHECK_EQ_INT(kvs_f32_to_bf16(bits_f32(0x3F818000u)), 0x3F82);
    CHECK_EQ_INT(kvs_f32_to_bf16(bits_f32(0x3F808001u)), 0x3F81);
    CHECK_EQ_INT(kvs_f32_to_bf16(INFINITY), 0x7F80);
    CHECK(isnan(kvs_bf16_to_f32(kvs_f32_to_bf16(NAN))));
    CHECK(kvs_bf16_to_f32(0xC040) == -3.0f);

    /* rows: every ISA equals the scalar conversion (NaN excluded) */
    enum { N = 1037 };
    static float src[N], back_ref[N], back[N];
    static uint16_t h_ref[N], h[N], hsrc[N];
    for (int i = 0; i < N; i++) {
        uint32_t u;
        do u = rng_u32(); while ((u & 0x7F800000u) == 0x7F800000u && (u & 0x7FFFFFu));
        /* mostly values in f16 range, some huge/tiny/subnormal */
        src[i] = i % 7 ? (rng_unit() - 0.5f) * 70000.0f * (i % 3 ? 1.0f : 1e-6f) : bits_f32(u);
        do hsrc[i] = (uint16_t)rng_u32(); while ((hsrc[i] & 0x7C00) == 0x7C00 && (hsrc[i] & 0x3FF));
    }
    for (int i = 0; i < N; i++) {
        h_ref[i] = kvs_f32_to_f16(src[i]);
        back_ref[i] = kvs_f16_to_f32(hsrc[i]);
    }
    for (int k = 0; k < n_isas; k++) {
        kvs_isa_force(isas[k]);
        quant_f32_to_f16_row(src, h, N);
        quant_f16_to_f32_row(hsrc, back, N);
        int diff_h = 0, diff_f = 0;
        for (int i = 0; i < N; i++) {
            diff_h += h[i] != h_ref[i];
            diff_f += memcmp(&back[i], &back_ref[i], 4) != 0;
        }
        CHECK_EQ_INT(diff_h, 0);
        CHECK_EQ_INT(diff_f, 0);
    }
}

/* Hand-built blocks pin the bit layouts. */
static void test_layouts(void) {
    float y[256];
    uint8_t q40[18] = {0x00, 0x3C, 0x1F}; /* d = 1; qs[0]: low 15, high 1 */
    quant_dequant_row_ref(QUANT_Q4_0, q40, y, 32);
    CHECK(y[0] == 7.0f && y[16] == -7.0f && y[1] == -8.0f);

    uint8_t q50[22] = {0x00, 0x40, 0x01, 0x00, 0x01, 0x00, 0x03}; /* d = 2; bits 0, 16 */
    quant_dequant_row_ref(QUANT_Q5_0, q50, y, 32);
    CHECK(y[0] == 2.0f * (19 - 16) && y[16] == 2.0f * (16 - 16) && y[1] == -32.0f);

    uint8_t q4k[144] = {0};
    q4k[1] = 0x3C; q4k[3] = 0x3C;  /* d = dmin = 1 */
    q4k[4 + 0] = 2 | 0x40;         /* sc0 = 2, 5th bit of sc4 */
    q4k[4 + 4] = 1;                /* m0 = 1 */
    q4k[4 + 8] = 0x21;             /* sc4 low 1, m4 low 2 */
    q4k[16 + 0] = 0x53;            /* elem 0 = 3, elem 32 = 5 */
    q4k[16 + 64] = 0x01;           /* elem 128 = 1 */
    quant_dequant_row_ref(QUANT_Q4_K, q4k, y, 256);
    CHECK(y[0] == 5.0f && y[32] == 0.0f && y[128] == 15.0f && y[1] == -1.0f);

    uint8_t q6k[210] = {0};
    for (int i = 0; i < 16; i++) q6k[192 + i] = 1;
    q6k[209] = 0x3C;
    q6k[0] = 0x21;
    q6k[128] = 0xE4; /* elem0 hi 0, elem32 hi 1, elem64 hi 2, elem96 hi 3 */
    quant_dequant_row_ref(QUANT_Q6_K, q6k, y, 256);
    CHECK(y[0] == -31.0f && y[32] == -16.0f && y[64] == 2.0f && y[96] == 16.0f && y[128] == -32.0f);

    uint8_t q2k[84] = {0};
    q2k[81] = 0x3C; q2k[83] = 0x3C; /* d = dmin = 1 */
    q2k[0] = 0x12;                  /* group 0: scale 2, min 1 */
    q2k[2] = 0x03;                  /* group 2 (elems 32..47): scale 3, min 0 */
    q2k[15] = 0x51;                 /* group 15 (elems 240..255): scale 1, min 5 */
    q2k[16 + 0] = 0x07;             /* elem 0: q 3; elem 32: q 1 */
    q2k[16 + 63] = 0xC0;            /* elem 255 (h 1, j 3, l 31): q 3 */
    quant_dequant_row_ref(QUANT_Q2_K, q2k, y, 256);
    CHECK(y[0] == 5.0f && y[1] == -1.0f && y[32] == 3.0f && y[33] == 0.0f && y[255] == -2.0f && y[254] == -5.0f);

    uint8_t q3k[110] = {0};
    q3k[109] = 0x3C;                /* d = 1 */
    q3k[96 + 0] = 0x21;             /* scale 0 low 1, scale 8 low 2 */
    q3k[96 + 8] = 0x02 | 0x80;      /* scale 0 high 2 (-> 33 - 32 = 1), scale 12 high 2 (-> 32 - 32 = 0) */
    q3k[96 + 5] = 0xF0;             /* scale 13 low 15; high 0 -> 15 - 32 = -17 */
    q3k[0] = 0x01;                  /* elem 0: high bit set */
    q3k[32 + 0] = 0x03;             /* elem 0: low 3 -> q = 3 + 4 - 4 = 3 */
    q3k[32 + 32 + 16] = 0x01 << 2;  /* elem 128 + 32 + 16 = 176 (h 1, j 1, group 11): low 1, no high bit */
    q3k[16] = 0x20;                 /* elem 176: high bit (4h + j = 5) set */
    quant_dequant_row_ref(QUANT_Q3_K, q3k, y, 256);
    /* elem 1: q = 0 + 0 - 4 = -4 with scale 1; group 8 scale 2 + 16*0 - 32 = -30; elem 208 in group 13 */
    CHECK(y[0] == 3.0f && y[1] == -4.0f && y[128] == 120.0f && y[208] == 68.0f);
    CHECK(y[176] == -32.0f); /* q = 1 + 4 - 4, group 11 scale 0 - 32 */

    uint8_t iq4[18] = {0x00, 0x3C, 0xF0, 0x78}; /* d = 1; elem 0 idx 0, elem 16 idx 15; elem 1 idx 8, elem 17 idx 7 */
    quant_dequant_row_ref(QUANT_IQ4_NL, iq4, y, 32);
    CHECK(y[0] == -127.0f && y[16] == 113.0f && y[1] == 1.0f && y[17] == -10.0f);

    uint8_t iq4x[136] = {0};
    iq4x[1] = 0x3C;                     /* d = 1 */
    iq4x[2] = 0x02 | 0x80;              /* scales_h: scale 0 high 2, scale 3 high 2 */
    iq4x[4] = 0x21;                     /* scale 0 low 1 (-> 33), scale 1 low 2 (-> 2) */
    iq4x[5] = 0xF0;                     /* scale 3 low 15 (-> 47) */
    iq4x[8] = 0xF0;                     /* elem 0 idx 0, elem 16 idx 15 */
    iq4x[8 + 16] = 0x08;                /* elem 32 idx 8 */
    iq4x[8 + 48 + 15] = 0xE0;           /* elem 96 + 31 (sub-block 3): idx 14 */
    quant_dequant_row_ref(QUANT_IQ4_XS, iq4x, y, 256);
    CHECK(y[0] == -127.0f && y[16] == 113.0f && y[32] == -30.0f && y[127] == 15.0f * 89.0f);
    CHECK(y[64] == -32.0f * -127.0f);   /* sub-block 2: scale 0 - 32 */
}

static double dotd(const float *a, const float *b, int64_t n, double *abs_sum) {
    double s = 0, as = 0;
    for (int64_t i = 0; i < n; i++) {
        s += (double)a[i] * b[i];
        as += fabs((double)a[i] * b[i]);
    }
    *abs_sum = as;
    return s;
}

enum { MAX_N = 1024, N_ACT = 9 };

static void test_type(uint32_t type, int64_t n, double rt_bound) {
    const quant_traits *t = quant_get_traits(type);
    static float x[MAX_N], y_ref[MAX_N], y[MAX_N], a[N_ACT][MAX_N];
    static uint8_t w[MAX_N * 4], act[N_ACT][MAX_N * 4], act2[MAX_N * 4], acts[N_ACT * (MAX_N * 4 + 8)];
    uint64_t wbytes = 0;
    CHECK(quant_row_bytes(type, (uint64_t)n, &wbytes));
    size_t abytes = quant_act_row_bytes(type, n);
    CHECK(abytes > 0 && abytes <= sizeof act[0]);

    fill_random(x, n, 1.0f);
    CHECK(quant_quantize_row(type, x, w, n));
    quant_dequant_row_ref(type, w, y_ref, n);

    double err2 = 0, sig2 = 0;
    for (int64_t i = 0; i < n; i++) {
        err2 += ((double)y_ref[i] - x[i]) * ((double)y_ref[i] - x[i]);
        sig2 += (double)x[i] * x[i];
    }
    double rel_rmse = sqrt(err2 / sig2);
    if (!(rel_rmse <= rt_bound))
        fprintf(stderr, "%s n=%lld: round-trip rel rmse %g > %g\n", t->name, (long long)n, rel_rmse, rt_bound);
    CHECK(rel_rmse <= rt_bound);

    /* activations; row 0 has a zero block to exercise d == 0 */
    for (int j = 0; j < N_ACT; j++) {
        fill_random(a[j], n, 0.5f + (float)j);
        if (j == 0) memset(a[j], 0, sizeof(float) * (n < 32 ? (size_t)n : 32));
        quant_act_quantize_ref(type, a[j], act[j], n);
    }

    /* dot_ref against the float dot of the dequantized row */
    float maxdiff_ratio = 0;
    for (int j = 0; j < N_ACT; j++) {
        double abs_sum, want = dotd(y_ref, a[j], n, &abs_sum);
        double bound = 1e-5 * abs_sum + 1e-6;
        if (t->block_elems > 1) {
            /* int8 activations: each element off by at most amax(block)/254 */
            int64_t be = t->block_elems; /* the activation blocks are as long as the weight blocks */
            for (int64_t b0 = 0; b0 < n; b0 += be) {
                float amax = 0, wsum = 0;
                for (int64_t i = b0; i < b0 + be; i++) {
                    amax = fabsf(a[j][i]) > amax ? fabsf(a[j][i]) : amax;
                    wsum += fabsf(y_ref[i]);
                }
                bound += (double)wsum * amax / 254.0 * 1.01;
            }
        }
        float got = quant_dot_ref(type, n, w, act[j]);
        CHECK_NEAR(got, want, bound);
        if ((float)(fabs(got - want) / bound) > maxdiff_ratio) maxdiff_ratio = (float)(fabs(got - want) / bound);
    }

    for (int k = 0; k < n_isas; k++) {
        CHECK(kvs_isa_force(isas[k]));
        quant_dequant_row(type, w, y, n);
        CHECK(memcmp(y, y_ref, sizeof(float) * (size_t)n) == 0);

        size_t stride = abytes + (k == 1 ? 8 : 0); /* an odd stride on one pass */
        for (int j = 0; j < N_ACT; j++) {
            quant_act_quantize(type, a[j], act2, n);
            CHECK(memcmp(act2, act[j], abytes) == 0);
            memcpy(acts + (size_t)j * stride, act[j], abytes);
        }
        float single[N_ACT];
        for (int j = 0; j < N_ACT; j++) {
            single[j] = quant_dot(type, n, w, act[j]);
            float ref = quant_dot_ref(type, n, w, act[j]);
            double abs_sum;
            dotd(y_ref, a[j], n, &abs_sum);
            CHECK_NEAR(single[j], ref, 2e-5 * abs_sum + 1e-6);
        }
        for (int m = 1; m <= N_ACT; m++) {
            float out[N_ACT];
            quant_dot_multi(type, n, w, acts, stride, m, out);
            int same = memcmp(out, single, sizeof(float) * (size_t)m) == 0;
            if (!same)
                fprintf(stderr, "%s/%s n=%lld n_act=%d: dot_multi differs from dot\n", t->name,
                        kvs_isa_name(isas[k]), (long long)n, m);
            CHECK(same);
        }
    }
    printf("  %-5s n=%-5lld round-trip rel rmse %.4f, dot_ref err/bound %.3f\n", t->name, (long long)n,
           rel_rmse, (double)maxdiff_ratio);
}

/* quant_dot_tile against quant_dot, bit for bit, on every ISA with a tile kernel. */
static void test_tile(uint32_t type, int64_t n) {
    enum { ROWS = 7, TOKS = 11 };
    static float x[MAX_N], a[MAX_N];
    static uint8_t w[ROWS][MAX_N * 4], act[TOKS][MAX_N * 4], tiled[TOKS * (MAX_N * 4 + 8)];
    uint64_t wbytes = 0;
    CHECK(quant_row_bytes(type, (uint64_t)n, &wbytes));
    for (int r = 0; r < ROWS; r++) {
        fill_random(x, n, 1.0f + (float)r);
        CHECK(quant_quantize_row(type, x, w[r], n));
    }
    for (int t = 0; t < TOKS; t++) {
        fill_random(a, n, 0.5f + (float)t);
        if (t == 0) memset(a, 0, sizeof(float) * 32);
        quant_act_quantize_ref(type, a, act[t], n);
    }
    size_t abytes = quant_act_row_bytes(type, n);
    int tested = 0;
    for (int k = 0; k < n_isas; k++) {
        CHECK(kvs_isa_force(isas[k]));
        if (!quant_has_tile(type)) continue;
        tested++;
        static float single[TOKS][ROWS];
        for (int t = 0; t < TOKS; t++)
            for (int r = 0; r < ROWS; r++) single[t][r] = quant_dot(type, n, w[r], act[t]);
        size_t stride = abytes + (k == 1 ? 8 : 0);
        for (int t = 0; t < TOKS; t++) {
            memcpy(tiled + (size_t)t * stride, act[t], abytes);
            quant_act_tile_layout(type, tiled + (size_t)t * stride, n);
        }
        static const int shapes[][2] = {{1, 1}, {1, 4}, {2, 4}, {4, 4}, {5, 9}, {7, 11}, {3, 2}, {4, 8}, {7, 1}};
        for (size_t sh = 0; sh < sizeof shapes / sizeof shapes[0]; sh++) {
            const int nr = shapes[sh][0], nt = shapes[sh][1];
            float out[TOKS][ROWS + 1];
            memset(out, 0xFF, sizeof out);
            quant_dot_tile(type, n, w[0], sizeof w[0], nr, tiled, stride, nt, &out[0][0], ROWS + 1);
            int diff = 0;
            for (int t = 0; t < nt; t++)
                for (int r = 0; r < nr; r++) diff += memcmp(&out[t][r], &single[t][r], 4) != 0;
            if (diff)
                fprintf(stderr, "%s/%s n=%lld tile %dx%d: %d outputs differ from quant_dot\n",
                        quant_get_traits(type)->name, kvs_isa_name(isas[k]), (long long)n, nr, nt, diff);
            CHECK_EQ_INT(diff, 0);
        }
    }
    printf("  %-5s n=%-5lld tile kernel bit-identical to dot on %d ISA(s)\n", quant_get_traits(type)->name,
           (long long)n, tested);
}

/* Blocks of random bytes (only the f16 scales kept finite and small) reach every
 * bit pattern of the packed scales and quants, which a quantizer's output may
 * not: every ISA's dot, dot_multi and dequant against the scalar reference. */
static void test_random_blocks(uint32_t type, int64_t n) {
    const quant_traits *t = quant_get_traits(type);
    static uint8_t w[MAX_N * 4], act[N_ACT][MAX_N * 4], acts[N_ACT * MAX_N * 4];
    static float a[MAX_N], y_ref[MAX_N], y[MAX_N];
    size_t f16_at[2] = {0, 0};
    int n_f16 = 1;
    switch (type) { /* byte offsets of the f16 fields in a block */
    case QUANT_Q2_K: f16_at[0] = 80; f16_at[1] = 82; n_f16 = 2; break;
    case QUANT_Q3_K: f16_at[0] = 108; break;
    default: break; /* iq4_nl, iq4_xs: d first */
    }
    const int64_t nb = n / t->block_elems;
    for (int64_t i = 0; i < nb * (int64_t)t->block_bytes; i++) w[i] = (uint8_t)rng_u32();
    for (int64_t b = 0; b < nb; b++)
        for (int k = 0; k < n_f16; k++) {
            uint16_t h = kvs_f32_to_f16((rng_unit() + 0.01f) * 0.02f);
            memcpy(w + (size_t)b * t->block_bytes + f16_at[k], &h, 2);
        }
    quant_dequant_row_ref(type, w, y_ref, n);
    size_t abytes = quant_act_row_bytes(type, n);
    float ref[N_ACT];
    double tol[N_ACT];
    for (int j = 0; j < N_ACT; j++) {
        fill_random(a, n, 1.0f + (float)j);
        quant_act_quantize_ref(type, a, act[j], n);
        memcpy(acts + (size_t)j * abytes, act[j], abytes);
        ref[j] = quant_dot_ref(type, n, w, act[j]);
        double abs_sum;
        dotd(y_ref, a, n, &abs_sum);
        tol[j] = 2e-5 * abs_sum + 1e-6;
    }
    for (int k = 0; k < n_isas; k++) {
        CHECK(kvs_isa_force(isas[k]));
        quant_dequant_row(type, w, y, n);
        CHECK(memcmp(y, y_ref, sizeof(float) * (size_t)n) == 0);
        float single[N_ACT], multi[N_ACT];
        for (int j = 0; j < N_ACT; j++) {
            single[j] = quant_dot(type, n, w, act[j]);
            CHECK_NEAR(single[j], ref[j], tol[j]);
        }
        quant_dot_multi(type, n, w, acts, abytes, N_ACT, multi);
        CHECK(memcmp(multi, single, sizeof single) == 0);
    }
    printf("  %-6s n=%-5lld random blocks: every ISA matches the reference\n", t->name, (long long)n);
}

static void test_zero(uint32_t type, int64_t n) {
    static float z[MAX_N];
    static uint8_t w[MAX_N * 4], act[MAX_N * 4];
    memset(z, 0, sizeof z);
    CHECK(quant_quantize_row(type, z, w, n));
    for (int k = 0; k < n_isas; k++) {
        kvs_isa_force(isas[k]);
        quant_act_quantize(type, z, act, n);
        float d = quant_dot(type, n, w, act);
        CHECK(d == 0.0f);
    }
}

/* The reported kernel path follows the forced ISA and the tile kernels. */
static void test_kernel_path(void) {
    static const char *const want_q4_0[] = {"scalar", "avx2+tile", "avx512-vnni+tile"};
    for (int k = 0; k < n_isas; k++) {
        CHECK(kvs_isa_force(isas[k]));
        const char *p = quant_kernel_path(QUANT_Q4_0);
        CHECK(p != NULL);
        if (p && strcmp(p, want_q4_0[isas[k]]) != 0)
            fprintf(stderr, "q4_0 kernel path under %s: got '%s', want '%s'\n", kvs_isa_name(isas[k]), p,
                    want_q4_0[isas[k]]);
        CHECK(p && strcmp(p, want_q4_0[isas[k]]) == 0);
        /* a tile kernel pays from some batch size; without one there is none */
        CHECK(quant_has_tile(QUANT_Q4_0) ? quant_tile_min_tokens(QUANT_Q4_0) >= 1
                                         : quant_tile_min_tokens(QUANT_Q4_0) == 0);
        CHECK_EQ_INT(quant_tile_min_tokens(QUANT_F32), 0);
        p = quant_kernel_path(QUANT_F32);
        CHECK(p != NULL && strstr(p, "+tile") == NULL);
    }
    CHECK(quant_kernel_path(QUANT_TYPE_LIMIT) == NULL);
    CHECK(quant_kernel_path(QUANT_Q8_K) == NULL);
}

/* r8 groups: pack/unpack round trip, every ISA's kernel bit-identical to the
 * scalar reference for every group count and batch size, and each output
 * within the dot bound of quant_dot_ref on the unpacked row. */
static void test_r8(uint32_t type, int64_t n) {
    enum { GROUPS = 11, ROWS = 8 * GROUPS, TOKS = 11 };
    static float x[MAX_N], af[TOKS][MAX_N], yr[MAX_N];
    static uint8_t w[ROWS][MAX_N * 2], packed[ROWS * MAX_N * 2], back[ROWS][MAX_N * 2], act[TOKS * (MAX_N * 2 + 8)];
    uint64_t rb = 0;
    CHECK(quant_r8_supported(type));
    CHECK(quant_row_bytes(type, (uint64_t)n, &rb) && rb <= sizeof w[0]);
    for (int r = 0; r < ROWS; r++) {
        fill_random(x, n, 1.0f + (float)r);
        CHECK(quant_quantize_row(type, x, w[r], n));
    }
    for (int g = 0; g < GROUPS; g++) {
        quant_r8_pack(type, n, w[8 * g], sizeof w[0], packed + (size_t)g * 8 * rb);
        quant_r8_unpack(type, n, packed + (size_t)g * 8 * rb, back[8 * g], sizeof back[0]);
    }
    int rt_diff = 0;
    for (int r = 0; r < ROWS; r++) rt_diff += memcmp(w[r], back[r], (size_t)rb) != 0;
    CHECK_EQ_INT(rt_diff, 0);
    size_t abytes = quant_act_row_bytes(type, n), stride = abytes + 8;
    for (int t = 0; t < TOKS; t++) {
        fill_random(af[t], n, 0.5f + (float)t);
        if (t == 0) memset(af[t], 0, sizeof(float) * 32);
        quant_act_quantize_ref(type, af[t], act + (size_t)t * stride, n);
    }
    static float ref[TOKS][ROWS];
    quant_dot_r8_ref(type, n, packed, GROUPS, act, stride, TOKS, &ref[0][0], ROWS);
    /* the reference against quant_dot_ref on the plain rows */
    for (int r = 0; r < ROWS; r++) {
        quant_dequant_row_ref(type, w[r], yr, n);
        for (int t = 0; t < TOKS; t++) {
            double abs_sum = 0;
            for (int64_t i = 0; i < n; i++) abs_sum += fabs((double)yr[i] * af[t][i]);
            CHECK_NEAR(ref[t][r], quant_dot_ref(type, n, w[r], act + (size_t)t * stride), 2e-5 * abs_sum + 1e-6);
        }
    }
    static const char *const modes[] = {"", "+pairs1", "+quads1", "+spread1"};
    for (int k = 0; k < 4 * n_isas; k++) { /* every ISA with one-token pairs off, on, quads, spread quads */
        CHECK(kvs_isa_force(isas[k % n_isas]));
        quant_r8_set_walk(k / n_isas);
        static const int shapes[][2] = {{1, 1}, {1, 4}, {3, 11}, {2, 5}, {3, 3}, {1, 8}, {2, 2}, {3, 1},
                                        {4, 1}, {5, 1}, {6, 1}, {7, 1}, {7, 3}, {4, 2},
                                        {8, 1}, {9, 1}, {10, 1}, {11, 1}, {11, 2}, {8, 3}};
        for (size_t sh = 0; sh < sizeof shapes / sizeof shapes[0]; sh++) {
            const int ng = shapes[sh][0], nt = shapes[sh][1];
            float out[TOKS][ROWS + 3];
            memset(out, 0xFF, sizeof out);
            quant_dot_r8(type, n, packed, ng, act, stride, nt, &out[0][0], ROWS + 3);
            int diff = 0;
            for (int t = 0; t < nt; t++)
                for (int r = 0; r < 8 * ng; r++) diff += memcmp(&out[t][r], &ref[t][r], 4) != 0;
            if (diff)
                fprintf(stderr, "%s/%s%s n=%lld r8 %d groups x %d tokens: %d outputs differ from the reference\n",
                        quant_get_traits(type)->name, kvs_isa_name(isas[k % n_isas]), modes[k / n_isas],
                        (long long)n, ng, nt, diff);
            CHECK_EQ_INT(diff, 0);
            int untouched = 0; /* nothing written past the groups */
            for (int t = 0; t < nt; t++) untouched += out[t][8 * ng] != out[t][8 * ng] ? 1 : 0;
            CHECK_EQ_INT(untouched, nt);
        }
    }
    quant_r8_set_walk(QUANT_R8_WALK_DEFAULT);
    printf("  %-5s n=%-5lld r8 groups bit-identical to the reference on %d ISA(s), one-token one/pairs/quads/spread\n",
           quant_get_traits(type)->name, (long long)n, n_isas);
}

int main(void) {
    check_expected_isa("test_quant");
    enum kvs_isa best = kvs_isa_detect();
    for (int i = 0; i <= (int)best; i++) isas[n_isas++] = (enum kvs_isa)i;
    CHECK(!kvs_isa_force((enum kvs_isa)3));
    CHECK(kvs_isa_current() == best);
    /* By name: every ISA up to the best, none past it, no unknown name; a refusal changes nothing. */
    for (int i = 0; i <= (int)KVS_ISA_AVX512; i++) {
        CHECK_EQ_INT(kvs_isa_force_name(kvs_isa_name((enum kvs_isa)i)), i <= (int)best);
        if (i <= (int)best) CHECK(kvs_isa_current() == (enum kvs_isa)i);
    }
    CHECK(kvs_isa_force(best));
    CHECK(!kvs_isa_force_name("sse9") && !kvs_isa_force_name(""));
    CHECK(kvs_isa_current() == best);

    test_traits();
    test_half();
    test_layouts();
    test_kernel_path();

    static const struct { uint32_t type; double rt; } types[] = {
        {QUANT_F32, 0.0},    {QUANT_F16, 1e-3},   {QUANT_BF16, 5e-3},  {QUANT_Q4_0, 0.15},
        {QUANT_Q4_1, 0.12},  {QUANT_Q5_0, 0.08},  {QUANT_Q5_1, 0.06},  {QUANT_Q8_0, 0.01},
        {QUANT_Q4_K, 0.15},  {QUANT_Q5_K, 0.08},  {QUANT_Q6_K, 0.04},  {QUANT_Q2_K, 0.40},
        {QUANT_Q3_K, 0.20},  {QUANT_IQ4_NL, 0.12}, {QUANT_IQ4_XS, 0.12},
    };
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        uint32_t be = quant_get_traits(types[i].type)->block_elems;
        const int64_t *ns;
        static const int64_t n_float[] = {1, 17, 515, 1024, 0};
        static const int64_t n_32[] = {32, 224, 1024, 0};
        static const int64_t n_256[] = {256, 768, 1024, 0};
        ns = be == 1 ? n_float : be == 32 ? n_32 : n_256;
        for (; *ns; ns++) test_type(types[i].type, *ns, types[i].rt);
        test_zero(types[i].type, be == 1 ? 64 : 512);
    }
    static const uint32_t lowbit[] = {QUANT_Q2_K, QUANT_Q3_K, QUANT_IQ4_NL, QUANT_IQ4_XS};
    for (size_t i = 0; i < sizeof lowbit / sizeof lowbit[0]; i++) {
        test_random_blocks(lowbit[i], 256);
        test_random_blocks(lowbit[i], 1024);
    }
    static const int64_t n_tile[] = {32, 224, 256, 288, 1024};
    for (size_t i = 0; i < sizeof n_tile / sizeof n_tile[0]; i++) {
        test_tile(QUANT_Q4_0, n_tile[i]);
        test_tile(QUANT_Q8_0, n_tile[i]);
        test_r8(QUANT_Q4_0, n_tile[i]);
        test_r8(QUANT_Q8_0, n_tile[i]);
        test_r8(QUANT_Q4_1, n_tile[i]);
        test_r8(QUANT_Q5_0, n_tile[i]);
        test_r8(QUANT_Q5_1, n_tile[i]);
        test_r8(QUANT_IQ4_NL, n_tile[i]);
    }
    CHECK(!quant_r8_supported(QUANT_Q8_K) && !quant_r8_supported(QUANT_F32));
    static const int64_t n_ktile[] = {256, 768, 1024};
    for (size_t i = 0; i < sizeof n_ktile / sizeof n_ktile[0]; i++) {
        test_tile(QUANT_Q4_K, n_ktile[i]);
        test_tile(QUANT_Q2_K, n_ktile[i]);
        test_tile(QUANT_Q3_K, n_ktile[i]);
        test_tile(QUANT_IQ4_XS, n_ktile[i]);
        test_r8(QUANT_Q4_K, n_ktile[i]);
        test_r8(QUANT_Q5_K, n_ktile[i]);
        test_r8(QUANT_IQ4_XS, n_ktile[i]);
        test_r8(QUANT_Q3_K, n_ktile[i]);
        test_r8(QUANT_Q2_K, n_ktile[i]);
        test_r8(QUANT_Q6_K, n_ktile[i]);
    }
    /* One-token pairs: forced on, only the AVX-512 table's q4_0 and q8_0 take
     * them (q6_k's kernel pairs anyway, q4_k and q5_k keep one group); quads and
     * spread quads, those and q4_1, q5_0, q5_1, q4_k, q5_k, q6_k, q3_k, q2_k,
     * iq4_nl and iq4_xs; forced off, none does; f16 has no r8 layout. */
    for (int on = 0; on <= 3; on++) {
        quant_r8_set_walk(on);
        CHECK(quant_r8_walk() == on);
        for (int k = 0; k < n_isas; k++) {
            CHECK(kvs_isa_force(isas[k]));
            const int want = isas[k] == KVS_ISA_AVX512 ? on : 0;
            CHECK_EQ_INT(quant_r8_walk_used(QUANT_Q4_0), want);
            CHECK_EQ_INT(quant_r8_walk_used(QUANT_Q8_0), want);
            CHECK_EQ_INT(quant_r8_walk_used(QUANT_Q4_K), want >= 2 ? want : 0);
            CHECK_EQ_INT(quant_r8_walk_used(QUANT_Q5_K), want >= 2 ? want : 0);
            CHECK_EQ_INT(quant_r8_walk_used(QUANT_Q6_K), want >= 2 ? want : 0);
            CHECK_EQ_INT(quant_r8_walk_used(QUANT_IQ4_XS), want >= 2 ? want : 0);
            CHECK_EQ_INT(quant_r8_walk_used(QUANT_IQ4_NL), want >= 2 ? want : 0);
            CHECK_EQ_INT(quant_r8_walk_used(QUANT_Q4_1), want >= 2 ? want : 0);
            CHECK_EQ_INT(quant_r8_walk_used(QUANT_Q5_0), want >= 2 ? want : 0);
            CHECK_EQ_INT(quant_r8_walk_used(QUANT_Q5_1), want >= 2 ? want : 0);
            CHECK_EQ_INT(quant_r8_walk_used(QUANT_Q3_K), want >= 2 ? want : 0);
            CHECK_EQ_INT(quant_r8_walk_used(QUANT_Q2_K), want >= 2 ? want : 0);
            CHECK(!quant_r8_supported(QUANT_F16) && !quant_r8_walk_used(QUANT_F16));
        }
    }
    /* Every type with an r8 layout has a SIMD r8 kernel under every SIMD ISA
     * (so test_r8 above ran that kernel, not the scalar one it falls back to). */
    for (int k = 0; k < n_isas; k++) {
        if (isas[k] == KVS_ISA_SCALAR) continue;
        CHECK(kvs_isa_force(isas[k]));
        int no_simd = 0;
        for (uint32_t t = 0; t < QUANT_TYPE_LIMIT; t++)
            if (quant_r8_supported(t) && !quant_r8_preferred(t)) {
                fprintf(stderr, "%s has no r8 kernel under %s\n", quant_get_traits(t)->name, kvs_isa_name(isas[k]));
                no_simd++;
            }
        CHECK_EQ_INT(no_simd, 0);
    }
    /* By default the spread quads, on every CPU. */
    quant_r8_set_walk(QUANT_R8_WALK_ONE);
    quant_r8_set_walk(QUANT_R8_WALK_DEFAULT);
    CHECK_EQ_INT(quant_r8_walk(), QUANT_R8_WALK_SPREAD);
    kvs_isa_force(best);
    return test_finish("test_quant", 1, 0);
}
