/*
 * sampler — greedy / temperature / top-k / top-p sampling with a seeded PRNG.
 *
 * Pipeline for temp > 0 (the order llama.cpp's common sampler uses):
 *   1. candidates = every id whose logit is a number above -inf (NaN counts as -inf);
 *   2. top-k: keep the k largest (a size-k min-heap, O(n log k));
 *   3. sort descending by logit, ties by lowest id (so the order, and with it every
 *      draw, is fully determined by the logits);
 *   4. softmax of logit/temp in double;
 *   5. top-p: keep the shortest prefix whose mass reaches p (at least one id);
 *   6. draw u in [0, mass) from xoshiro256** and walk the prefix.
 * Worst case O(n log n) for the sort when top-k is off. The scratch buffer is
 * owned by the sampler and grows to n_vocab once; no globals, so separate
 * samplers may be used from separate threads.
 */
#include "sampler.h"

#include <math.h>
#include <stdlib.h>

typedef struct {
    float logit;
    int32_t id;
} sampler_cand;

struct sampler {
    sampler_params p;
    uint64_t rng[4];     /* xoshiro256** state; never all zero */
    sampler_cand *cand;  /* scratch, cand_cap entries */
    size_t cand_cap;
    double *prob;        /* scratch, cand_cap entries: unnormalised weights */
};

sampler_params sampler_default_params(void) {
    sampler_params p;
    p.temp = 0.8f;
    p.top_k = 40;
    p.top_p = 0.95f;
    p.seed = 42;
    return p;
}

static uint64_t splitmix64_next(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static uint64_t rotl64(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t xoshiro_next(uint64_t s[4]) {
    const uint64_t result = rotl64(s[1] * 5, 7) * 9;
    const uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl64(s[3], 45);
    return result;
}

/* Uniform double in [0, 1) with 53 random bits. */
static double rng_uniform(uint64_t s[4]) {
    return (double)(xoshiro_next(s) >> 11) * (1.0 / 9007199254740992.0);
}

sampler *sampler_create(sampler_params p) {
    sampler *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->p = p;
    uint64_t x = p.seed;
    for (int i = 0; i < 4; i++) s->rng[i] = splitmix64_next(&x);
    /* splitmix64 is a bijection of distinct counters, so four zero outputs cannot
     * happen; guard anyway because an all-zero state would emit zeros forever. */
    if ((s->rng[0] | s->rng[1] | s->rng[2] | s->rng[3]) == 0) s->rng[0] = 1;
    return s;
}

void sampler_free(sampler *s) {
    if (!s) return;
    free(s->cand);
    free(s->prob);
    free(s);
}

int32_t sampler_argmax(const float *logits, int32_t n_vocab) {
    if (!logits || n_vocab <= 0) return -1;
    int32_t best = 0;
    float best_v = logits[0];
    for (int32_t i = 1; i < n_vocab; i++) {
        float v = logits[i];
        /* A NaN best is replaced by anything that is a number. */
        if (v > best_v || (isnan(best_v) && !isnan(v))) {
            best_v = v;
            best = i;
        }
    }
    return best;
}

/* a ranks before b: larger logit first, then lower id. */
static int cand_before(const sampler_cand *a, const sampler_cand *b) {
    if (a->logit != b->logit) return a->logit > b->logit;
    return a->id < b->id;
}

static int cand_cmp(const void *pa, const void *pb) {
    const sampler_cand *a = pa, *b = pb;
    if (cand_before(a, b)) return -1;
    if (cand_before(b, a)) return 1;
    return 0;
}

/* Min-heap on rank (the root is the candidate that ranks last). */
static void heap_sift_down(sampler_cand *h, size_t n, size_t i) {
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && cand_before(&h[m], &h[l])) m = l;
        if (r < n && cand_before(&h[m], &h[r])) m = r;
        if (m == i) return;
        sampler_cand t = h[i];
        h[i] = h[m];
        h[m] = t;
        i = m;
    }
}

static int ensure_scratch(sampler *s, size_t n) {
    if (n <= s->cand_cap) return 0;
    sampler_cand *c = malloc(n * sizeof *c);
    double *p = malloc(n * sizeof *p);
    if (!c || !p) {
        free(c);
        free(p);
        return -1;
    }
    free(s->cand);
    free(s->prob);
    s->cand = c;
    s->prob = p;
    s->cand_cap = n;
    return 0;
}

/* Keeps the k best of cand[0..n) in cand[0..k) (unordered); returns k. */
static size_t select_top_k(sampler_cand *cand, size_t n, size_t k) {
    if (k >= n) return n;
    for (size_t i = k / 2; i-- > 0;) heap_sift_down(cand, k, i);
    for (size_t i = k; i < n; i++) {
        if (cand_before(&cand[i], &cand[0])) {
            cand[0] = cand[i];
            heap_sift_down(cand, k, 0);
        }
    }
    return k;
}

/* Returns -1 for bad arguments. Falls back to argmax if scratch memory cannot be
 * allocated (the sample is then still a valid id, only not random). */
int32_t sampler_sample(sampler *s, const float *logits, int32_t n_vocab) {
    if (!s || !logits || n_vocab <= 0) return -1;
    const sampler_params *p = &s->p;
    if (!(p->temp > 0.0f) || p->top_k == 1) return sampler_argmax(logits, n_vocab);
    if (ensure_scratch(s, (size_t)n_vocab) != 0) return sampler_argmax(logits, n_vocab);

    size_t n = 0;
    int n_pos_inf = 0;
    for (int32_t i = 0; i < n_vocab; i++) {
        float v = logits[i];
        if (isnan(v) || v == -INFINITY) continue;
        if (v == INFINITY) n_pos_inf++;
        s->cand[n].logit = v;
        s->cand[n].id = i;
        n++;
    }
    if (n == 0) return sampler_argmax(logits, n_vocab);

    if (p->top_k > 0) n = select_top_k(s->cand, n, (size_t)p->top_k);
    qsort(s->cand, n, sizeof *s->cand, cand_cmp);

    /* +inf logits take all the mass, shared equally. */
    if (n_pos_inf > 0) {
        size_t m = 0;
        while (m < n && s->cand[m].logit == INFINITY) m++;
        n = m;
    }

    const double inv_temp = 1.0 / (double)p->temp;
    const double max_l = (double)s->cand[0].logit;
    double total = 0.0;
    for (size_t i = 0; i < n; i++) {
        double w = n_pos_inf > 0 ? 1.0 : exp(((double)s->cand[i].logit - max_l) * inv_temp);
        s->prob[i] = w;
        total += w;
    }

    if (p->top_p < 1.0f) {
        const double target = (double)p->top_p * total;
        double cum = 0.0;
        size_t keep = n;
        for (size_t i = 0; i < n; i++) {
            cum += s->prob[i];
            if (cum >= target) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
        total = cum;
    }

    const double u = rng_uniform(s->rng) * total;
    double cum = 0.0;
    for (size_t i = 0; i < n; i++) {
        cum += s->prob[i];
        if (u < cum) return s->cand[i].id;
    }
    return s->cand[n - 1].id; /* rounding left u at the very top */
}
