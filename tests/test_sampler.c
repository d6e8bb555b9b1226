/* test_sampler — greedy, top-k, top-p, temperature and seeding of the sampler. */
#include <math.h>

#include "sampler.h"
#include "test.h"

static sampler_params params(float temp, int top_k, float top_p, uint64_t seed) {
    sampler_params p = sampler_default_params();
    p.temp = temp;
    p.top_k = top_k;
    p.top_p = top_p;
    p.seed = seed;
    return p;
}

static void test_defaults(void) {
    sampler_params p = sampler_default_params();
    CHECK_NEAR(p.temp, 0.8, 1e-6);
    CHECK_EQ_INT(p.top_k, 40);
    CHECK_NEAR(p.top_p, 0.95, 1e-6);
    CHECK_EQ_INT(p.seed, 42);
    sampler_free(NULL);
}

static void test_greedy(void) {
    const float l[6] = {0.5f, 3.0f, -1.0f, 3.0f, 2.9f, 3.0f};
    CHECK_EQ_INT(sampler_argmax(l, 6), 1);
    const float neg[3] = {-INFINITY, -5.0f, -5.0f};
    CHECK_EQ_INT(sampler_argmax(neg, 3), 1);
    const float nan_first[3] = {NAN, 1.0f, 2.0f};
    CHECK_EQ_INT(sampler_argmax(nan_first, 3), 2);
    CHECK_EQ_INT(sampler_argmax(l, 0), -1);

    for (int t = 0; t < 2; t++) {
        sampler *s = sampler_create(params(t == 0 ? 0.0f : -1.0f, 40, 0.95f, 7));
        CHECK(s != NULL);
        for (int i = 0; i < 10; i++) CHECK_EQ_INT(sampler_sample(s, l, 6), 1);
        sampler_free(s);
    }
}

static void test_top_k_one_is_greedy(void) {
    enum { N = 1000 };
    static float l[N];
    for (int i = 0; i < N; i++) l[i] = sinf((float)i * 0.37f) * 4.0f;
    l[123] = 10.0f;
    l[700] = 10.0f; /* tie: lowest id wins */
    const float temps[4] = {0.1f, 1.0f, 5.0f, 100.0f};
    for (int t = 0; t < 4; t++) {
        sampler *s = sampler_create(params(temps[t], 1, 1.0f, (uint64_t)t));
        CHECK(s != NULL);
        for (int i = 0; i < 50; i++) CHECK_EQ_INT(sampler_sample(s, l, N), 123);
        sampler_free(s);
    }
}

static void draw_seq(uint64_t seed, const float *l, int n, int32_t *out, int count) {
    sampler *s = sampler_create(params(1.0f, 0, 1.0f, seed));
    CHECK(s != NULL);
    if (!s) return;
    for (int i = 0; i < count; i++) out[i] = sampler_sample(s, l, n);
    sampler_free(s);
}

static void test_seeding(void) {
    enum { N = 64, DRAWS = 200 };
    float l[N];
    for (int i = 0; i < N; i++) l[i] = (float)(i % 7) * 0.3f;
    int32_t a[DRAWS], b[DRAWS], c[DRAWS];
    draw_seq(1234, l, N, a, DRAWS);
    draw_seq(1234, l, N, b, DRAWS);
    draw_seq(1235, l, N, c, DRAWS);
    int same_ab = 0, same_ac = 0;
    for (int i = 0; i < DRAWS; i++) {
        same_ab += a[i] == b[i];
        same_ac += a[i] == c[i];
        CHECK(a[i] >= 0 && a[i] < N);
    }
    CHECK_EQ_INT(same_ab, DRAWS);
    CHECK(same_ac < DRAWS / 2);
}

/* Empirical frequencies over many draws match softmax(logits / temp). */
static void test_distribution(void) {
    enum { N = 5, DRAWS = 20000 };
    const float l[N] = {1.0f, 2.0f, 0.5f, -1.0f, 1.5f};
    const float temps[2] = {1.0f, 0.7f};
    for (int t = 0; t < 2; t++) {
        double p[N], sum = 0;
        for (int i = 0; i < N; i++) sum += p[i] = exp((double)l[i] / temps[t]);
        for (int i = 0; i < N; i++) p[i] /= sum;
        sampler *s = sampler_create(params(temps[t], 0, 1.0f, 99 + (uint64_t)t));
        CHECK(s != NULL);
        if (!s) return;
        int count[N] = {0};
        for (int d = 0; d < DRAWS; d++) {
            int32_t id = sampler_sample(s, l, N);
            CHECK(id >= 0 && id < N);
            if (id >= 0 && id < N) count[id]++;
        }
        /* std of a frequency is <= 0.0036 at 20000 draws; 0.015 is > 4 sigma */
        for (int i = 0; i < N; i++) CHECK_NEAR((double)count[i] / DRAWS, p[i], 0.015);
        sampler_free(s);
    }
}

/* top-k keeps the k largest and renormalises among them. */
static void test_top_k(void) {
    enum { N = 6, DRAWS = 20000 };
    const float l[N] = {0.0f, 3.0f, 1.0f, 2.0f, 2.5f, -2.0f};
    sampler *s = sampler_create(params(1.0f, 3, 1.0f, 5));
    CHECK(s != NULL);
    if (!s) return;
    int count[N] = {0};
    for (int d = 0; d < DRAWS; d++) {
        int32_t id = sampler_sample(s, l, N);
        if (id >= 0 && id < N) count[id]++;
    }
    CHECK_EQ_INT(count[0] + count[2] + count[5], 0);
    double z = exp(3.0) + exp(2.0) + exp(2.5);
    CHECK_NEAR((double)count[1] / DRAWS, exp(3.0) / z, 0.015);
    CHECK_NEAR((double)count[3] / DRAWS, exp(2.0) / z, 0.015);
    CHECK_NEAR((double)count[4] / DRAWS, exp(2.5) / z, 0.015);
    sampler_free(s);
}

/* top-p: the smallest prefix (descending) with mass >= p; nothing outside is drawn. */
static void test_top_p(void) {
    enum { N = 5, DRAWS = 20000 };
    /* probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 */
    const float l[N] = {logf(0.0625f), logf(0.25f), logf(0.5f), logf(0.0625f), logf(0.125f)};
    sampler *s = sampler_create(params(1.0f, 0, 0.7f, 11));
    CHECK(s != NULL);
    if (!s) return;
    int count[N] = {0};
    for (int d = 0; d < DRAWS; d++) {
        int32_t id = sampler_sample(s, l, N);
        if (id >= 0 && id < N) count[id]++;
    }
    /* 0.5 < 0.7 <= 0.75: nucleus is {2, 1} */
    CHECK_EQ_INT(count[0] + count[3] + count[4], 0);
    CHECK_NEAR((double)count[2] / DRAWS, 2.0 / 3.0, 0.015);
    CHECK_NEAR((double)count[1] / DRAWS, 1.0 / 3.0, 0.015);
    sampler_free(s);

    /* a tiny p keeps only the top token */
    s = sampler_create(params(2.0f, 0, 0.01f, 3));
    CHECK(s != NULL);
    for (int d = 0; s && d < 100; d++) CHECK_EQ_INT(sampler_sample(s, l, N), 2);
    sampler_free(s);
}

static void test_non_finite(void) {
    enum { N = 6, DRAWS = 5000 };
    const float l[N] = {-INFINITY, 1.0f, -INFINITY, NAN, 1.0f, -INFINITY};
    sampler *s = sampler_create(params(1.0f, 0, 1.0f, 8));
    CHECK(s != NULL);
    if (!s) return;
    int count[N] = {0};
    for (int d = 0; d < DRAWS; d++) {
        int32_t id = sampler_sample(s, l, N);
        CHECK(id >= 0 && id < N);
        if (id >= 0 && id < N) count[id]++;
    }
    CHECK_EQ_INT(count[0] + count[2] + count[3] + count[5], 0);
    CHECK_NEAR((double)count[1] / DRAWS, 0.5, 0.03);

    /* all -inf: still a valid id (the lowest) */
    const float all_neg[3] = {-INFINITY, -INFINITY, -INFINITY};
    CHECK_EQ_INT(sampler_sample(s, all_neg, 3), 0);
    /* +inf dominates everything finite */
    const float pos[4] = {5.0f, INFINITY, 1e30f, INFINITY};
    for (int d = 0; d < 100; d++) {
        int32_t id = sampler_sample(s, pos, 4);
        CHECK(id == 1 || id == 3);
    }
    CHECK_EQ_INT(sampler_sample(s, pos, 0), -1);
    CHECK_EQ_INT(sampler_sample(NULL, pos, 4), -1);
    sampler_free(s);
}

/* A full-size vocab with defaults: ids stay in range, and it is not slow. */
static void test_large_vocab(void) {
    enum { N = 32000 };
    static float l[N];
    for (int i = 0; i < N; i++) l[i] = cosf((float)i * 0.011f) * 6.0f + (float)(i % 13) * 0.1f;
    const sampler_params ps[3] = {sampler_default_params(), params(1.0f, 0, 1.0f, 1), params(0.9f, 0, 0.9f, 2)};
    for (int k = 0; k < 3; k++) {
        sampler *s = sampler_create(ps[k]);
        CHECK(s != NULL);
        for (int d = 0; s && d < 200; d++) {
            int32_t id = sampler_sample(s, l, N);
            CHECK(id >= 0 && id < N);
        }
        sampler_free(s);
    }
}

int main(void) {
    test_defaults();
    test_greedy();
    test_top_k_one_is_greedy();
    test_seeding();
    test_distribution();
    test_top_k();
    test_top_p();
    test_non_finite();
    test_large_vocab();
    return test_finish("test_sampler", 1, 0);
}
