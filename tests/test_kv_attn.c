/*
 * kv_attn: attention over q8_0 / q4_0 KV rows. Under every ISA the CPU has,
 * the dispatched scores and weighted sums equal the scalar references bit for
 * bit (the SIMD paths differ only in how they form exact integer dots), a
 * score does not depend on the group or the number of keys, and both stay
 * close to a double-precision dot over the dequantized rows (the query's own
 * q8_0 rounding is the only other error). Also the pool side: row and block
 * bytes per type, the refusal of a head_dim that is not a multiple of 32
 * (naming it), and kv_check on a quantized pool.
 */
#include <math.h>
#include <string.h>

#include "cpu.h"
#include "f16.h"
#include "isa_check.h"
#include "kv_attn.h"
#include "kvstate.h"
#include "quant.h"
#include "test.h"

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static float frand(void) { /* [-1, 1) */
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)(rng >> 40) / (float)(1u << 23) - 1.0f;
}

enum { MAX_HD = 256, MAX_GROUP = 12, MAX_ROWS = 301, ROW_CAP = MAX_HD / 32 * 34 };

static uint8_t rows_mem[MAX_ROWS][ROW_CAP];
static const void *rows[MAX_ROWS];
static float rows_f[MAX_ROWS][MAX_HD]; /* the rows dequantized */

static void make_rows(uint32_t type, int n, int hd) {
    float x[MAX_HD];
    for (int j = 0; j < n; j++) {
        for (int i = 0; i < hd; i++) x[i] = frand() * (j % 5 == 0 ? 8.0f : 1.5f);
        if (j == 3) memset(x, 0, sizeof x); /* an all-zero row: scale 0 */
        kv_attn_store_row(type, x, rows_mem[j], hd);
        quant_dequant_row_ref(type, rows_mem[j], rows_f[j], hd);
        rows[j] = rows_mem[j];
    }
}

static void test_scores(uint32_t type, int group, int hd, int n) {
    static float q[MAX_GROUP * MAX_HD], got[MAX_GROUP * MAX_ROWS], ref[MAX_GROUP * MAX_ROWS],
        one[MAX_GROUP * MAX_ROWS];
    for (int i = 0; i < group * hd; i++) q[i] = frand() * 3.0f;
    make_rows(type, n, hd);
    const float scale = 1.0f / sqrtf((float)hd);
    kv_attn_scores(type, q, group, hd, rows, n, scale, got, (size_t)n);
    kv_attn_scores_ref(type, q, group, hd, rows, n, scale, ref, (size_t)n);
    int bad = 0;
    for (int k = 0; k < group * n; k++) bad += memcmp(&got[k], &ref[k], sizeof(float)) != 0;
    if (bad) fprintf(stderr, "scores %s group %d hd %d n %d: %d differ from the reference\n", quant_get_traits(type)->name,
                     group, hd, n, bad);
    CHECK_EQ_INT(bad, 0);
    /* One head and one key at a time: the same bits. */
    for (int h = 0; h < group; h += 3)
        for (int j = 0; j < n; j += 7) {
            kv_attn_scores(type, q + (size_t)h * hd, 1, hd, &rows[j], 1, scale, one, 1);
            CHECK(memcmp(&one[0], &got[(size_t)h * n + j], sizeof(float)) == 0);
        }
    /* Against double precision over the dequantized key: the query's q8_0 rounding bounds the error. */
    for (int h = 0; h < group; h++)
        for (int j = 0; j < n; j++) {
            double want = 0, mag = 0;
            for (int i = 0; i < hd; i++) {
                want += (double)q[h * hd + i] * rows_f[j][i];
                mag += fabs((double)q[h * hd + i] * rows_f[j][i]);
            }
            CHECK_NEAR(got[(size_t)h * n + j], want * scale, (mag * 3.0 / 127.0 + 1e-6) * scale);
        }
}

static void test_wsum(uint32_t type, int group, int hd, int n) {
    static float p[MAX_GROUP * MAX_ROWS], got[MAX_GROUP * MAX_HD], ref[MAX_GROUP * MAX_HD];
    make_rows(type, n, hd);
    for (int k = 0; k < group * n; k++) p[k] = (frand() + 1.0f) / (float)n;
    for (int k = 0; k < group * hd; k++) got[k] = ref[k] = 42.0f; /* overwritten, not accumulated */
    kv_attn_wsum(type, p, (size_t)n, group, n, rows, hd, got);
    kv_attn_wsum_ref(type, p, (size_t)n, group, n, rows, hd, ref);
    int bad = 0;
    for (int k = 0; k < group * hd; k++) bad += memcmp(&got[k], &ref[k], sizeof(float)) != 0;
    if (bad) fprintf(stderr, "wsum %s group %d hd %d n %d: %d differ from the reference\n", quant_get_traits(type)->name,
                     group, hd, n, bad);
    CHECK_EQ_INT(bad, 0);
    for (int h = 0; h < group; h++)
        for (int i = 0; i < hd; i++) {
            double want = 0, mag = 0;
            for (int j = 0; j < n; j++) {
                want += (double)p[h * n + j] * rows_f[j][i];
                mag += fabs((double)p[h * n + j] * rows_f[j][i]);
            }
            CHECK_NEAR(got[h * hd + i], want, 1e-5 * mag + 1e-7);
        }
}

static void test_pool(void) {
    CHECK_EQ_INT((int)kv_row_bytes(QUANT_F16, 64), 128);
    CHECK_EQ_INT((int)kv_row_bytes(QUANT_F32, 64), 256);
    CHECK_EQ_INT((int)kv_row_bytes(QUANT_Q8_0, 64), 68);
    CHECK_EQ_INT((int)kv_row_bytes(QUANT_Q4_0, 128), 72);
    CHECK_EQ_INT((int)kv_row_bytes(QUANT_Q8_0, 48), 0);
    CHECK_EQ_INT((int)kv_row_bytes(QUANT_Q4_1, 64), 0);
    kv_params p = kv_default_params();
    p.n_layers = 3;
    p.n_kv_heads = 2;
    p.head_dim = 64;
    p.block_tokens = 16;
    const uint32_t types[] = {QUANT_F16, QUANT_Q8_0, QUANT_Q4_0};
    const size_t row[] = {128, 68, 36};
    for (int t = 0; t < 3; t++) {
        p.kv_type = types[t];
        CHECK_EQ_INT((int)kv_params_block_bytes(&p), (int)(16 * 3 * 2 * 2 * row[t]));
        p.budget_bytes = 10 * kv_params_block_bytes(&p) + 5;
        kv_state *kv = NULL;
        char msg[256] = "";
        CHECK_EQ_INT(kv_create(&p, &kv, msg, sizeof msg), KVS_OK);
        if (!kv) continue;
        kv_sid sid = {{(uint8_t)(t + 1)}};
        kv_txn *txn = NULL;
        kv_reply rep;
        CHECK_EQ_INT(kv_begin(kv, &sid, 1, 0, 40, NULL, &txn, &rep), KVS_OK);
        if (txn) {
            /* Rows of one block lie row bytes apart. */
            CHECK_EQ_INT((int)((uint8_t *)kv_txn_k(txn, 1, 5, 1) - (uint8_t *)kv_txn_k(txn, 1, 4, 1)), (int)row[t]);
            kv_commit(kv, txn, &rep);
        }
        kv_stats st;
        kv_get_stats(kv, &st);
        CHECK_EQ_INT((int)st.blocks_total, 10);
        CHECK_EQ_INT((int)st.bytes_used, (int)(3 * kv_params_block_bytes(&p)));
        CHECK_EQ_INT(kv_check(kv, msg, sizeof msg), KVS_OK);
        kv_free(kv);
    }
    p.head_dim = 8;
    p.kv_type = QUANT_Q4_0;
    p.budget_bytes = 1 << 20;
    kv_state *kv = NULL;
    char msg[256] = "";
    CHECK_EQ_INT(kv_create(&p, &kv, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    CHECK(strstr(msg, "head_dim 8") != NULL);
    printf("test_kv_attn: refusal: %s\n", msg);
}

/* The rotation of quantized rows (kv_attn.h): llama.cpp's matrix sizes, orthonormal (e0 goes to
 * 1/sqrt(n) everywhere), its own inverse (twice is the identity), run by run. */
static void test_rotation(void) {
    CHECK_EQ_INT(kv_attn_rot_k(QUANT_Q8_0, 64), 64);
    CHECK_EQ_INT(kv_attn_rot_k(QUANT_Q4_0, 128), 128);
    CHECK_EQ_INT(kv_attn_rot_k(QUANT_Q8_0, 192), 64);
    CHECK_EQ_INT(kv_attn_rot_k(QUANT_Q8_0, 96), 0);
    CHECK_EQ_INT(kv_attn_rot_k(QUANT_F16, 128), 0);
    CHECK_EQ_INT(kv_attn_rot_v(QUANT_Q4_0, 256), 64);
    CHECK_EQ_INT(kv_attn_rot_v(QUANT_F32, 64), 0);
    float x[256], y[256];
    memset(x, 0, sizeof x);
    x[128] = 1.0f;
    kv_attn_rotate(x, 256, 128);
    for (int i = 0; i < 128; i++) CHECK(x[i] == 0.0f && fabsf(x[128 + i] - 1.0f / sqrtf(128.0f)) < 1e-7f);
    for (int i = 0; i < 256; i++) x[i] = y[i] = sinf((float)i * 0.37f) * (float)(i % 7);
    kv_attn_rotate(x, 256, 64);
    double moved = 0, norm_x = 0, norm_y = 0;
    for (int i = 0; i < 256; i++) {
        moved += fabs(x[i] - y[i]);
        norm_x += (double)x[i] * x[i];
        norm_y += (double)y[i] * y[i];
    }
    CHECK(moved > 1.0 && fabs(norm_x - norm_y) < 1e-3 * norm_y); /* turned, same length */
    kv_attn_rotate(x, 256, 64);
    for (int i = 0; i < 256; i++) CHECK(fabsf(x[i] - y[i]) < 1e-5f);
}

/* Under the forced ISA: the rotation and the q8_0 rows the pool stores equal their scalar
 * references bit for bit (widths 64 to 256; rows with zeros, a NaN, huge and tiny values). */
static void test_rotation_and_store_bits(void) {
    float x[512], a[512], b[512];
    for (int i = 0; i < 512; i++) x[i] = frand() * (i % 9 == 0 ? 40.0f : 1.0f);
    for (int n = 64; n <= 256; n *= 2) {
        memcpy(a, x, sizeof x);
        memcpy(b, x, sizeof x);
        kv_attn_rotate(a, 512, n);
        kv_attn_rotate_ref(b, 512, n);
        CHECK(memcmp(a, b, sizeof a) == 0);
    }
    memset(x, 0, 32 * sizeof(float));  /* block 0: all zero */
    x[40] = NAN;                        /* block 1: a NaN */
    x[70] = 3e38f;                      /* block 2: huge */
    for (int i = 96; i < 128; i++) x[i] = 1e-30f * (float)(i - 100); /* block 3: tiny */
    for (int i = 128; i < 160; i++) x[i] = (float)(i - 144) * 0.5f; /* block 4: ties (x / d = k + 1/2) */
    uint8_t got[16 * 34], want[16 * 34];
    kv_attn_store_row(QUANT_Q8_0, x, got, 512);
    quant_quantize_row(QUANT_Q8_0, x, want, 512); /* the scalar reference quantizer */
    CHECK(memcmp(got, want, sizeof got) == 0);
}

int main(void) {
    check_expected_isa("test_kv_attn");
    test_rotation();
    enum kvs_isa best = kvs_isa_detect();
    int checked = 0;
    for (int isa = 0; isa <= (int)best; isa++) {
        CHECK(kvs_isa_force((enum kvs_isa)isa));
        static const int hds[] = {32, 64, 128, 256};
        static const int groups[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 12};
        static const int ns[] = {1, 9, 37, 300};
        const uint32_t types[] = {QUANT_Q8_0, QUANT_Q4_0};
        for (int t = 0; t < 2; t++)
            for (size_t a = 0; a < sizeof hds / sizeof hds[0]; a++)
                for (size_t b = 0; b < sizeof groups / sizeof groups[0]; b++)
                    for (size_t c = 0; c < sizeof ns / sizeof ns[0]; c++) {
                        test_scores(types[t], groups[b], hds[a], ns[c]);
                        test_wsum(types[t], groups[b], hds[a], ns[c]);
                    }
        test_rotation_and_store_bits();
        printf("test_kv_attn: %s bit-identical to the scalar references\n", kvs_isa_name((enum kvs_isa)isa));
        checked++;
    }
    kvs_isa_force(best);
    test_pool();
    return test_finish("test_kv_attn", checked, 0);
}
