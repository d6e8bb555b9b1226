/*
 * sampler — greedy / temperature / top-k / top-p sampling with a seeded PRNG.
 *
 * Pipeline for temp > 0 (the order llama.cpp's common sampler uses):
 *   1. candidates = every id whose logit is a number above -inf (NaN counts as -inf);
 *   2. top-k: keep the k largest (a size-k min-heap, O(n log k));
 *   3. sort descending by logit, ties by lowest id (so the order, and with it every
 *      draw, is fully determined by the logits);
 *   4. softmax of logit/temp in double;
 *   4b. min-p: drop ids whose weight is below min_p times the best one's;
 *   5. top-p: keep the shortest prefix whose mass reaches p (at least one id);
 *   6. draw u in [0, mass) from xoshiro256** and walk the prefix.
 * Worst case O(n log n) for the sort when top-k is off. The scratch buffer is
 * owned by the sampler and grows to n_vocab once; no globals, so separate
 * samplers may be used from separate threads.
 *
 * Counter-based draws (sampler_pick, used by `kvshard run`, `generate` and the tail shard):
 *  7. The uniform number that picks the token for position `pos` is sampler_uniform_at(seed, pos),
 *     a SplitMix64-style hash of (seed, pos) and nothing else: no state advances between calls.
 *     So a replay after a failure, a re-route to a spare, a shard that samples for the client and
 *     a one-process run all draw the same number for the same position and seed, whatever
 *     happened before. The session is deliberately not an input: `kvshard run` has no route
 *     session id, and run == generate for a seed is the contract. Callers that want independent
 *     streams for concurrent sessions give them different seeds.
 *  8. Penalties (before step 1), over the distinct ids of the window the caller passes:
 *     repetition (llama style: a positive logit is divided by the penalty, a negative one
 *     multiplied) then presence (subtracted). A window id outside the vocab is ignored.
 *  9. Log-probs are of the model's own distribution: log-softmax of the raw logits at
 *     temperature 1, before penalties and truncation.
 */
#include "sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvshard.h"

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
    float *pen;          /* scratch, pen_cap entries: penalised logits */
    uint8_t *seen;       /* scratch, pen_cap entries, all 0 between calls: ids already penalised */
    size_t pen_cap;
};

sampler_params sampler_default_params(void) {
    sampler_params p;
    p.temp = 0.8f;
    p.top_k = 40;
    p.top_p = 0.95f;
    p.seed = 42;
    p.min_p = 0.0f;
    p.repeat_penalty = 1.0f;
    p.presence_penalty = 0.0f;
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
    free(s->pen);
    free(s->seen);
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

/* Steps 1-6 of the pipeline. The uniform draw is *u_fixed when given (the counter-based draw of
 * sampler_pick), else the next value of the sampler's own stream (drawn only when needed, so a
 * greedy call leaves the stream untouched). */
static int32_t sample_with(sampler *s, const float *logits, int32_t n_vocab, const double *u_fixed) {
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

    if (p->min_p > 0.0f && n_pos_inf == 0) { /* weights are relative to the best (cand[0] = 1) */
        size_t keep = 1;
        while (keep < n && s->prob[keep] >= (double)p->min_p) keep++;
        n = keep;
        total = 0.0;
        for (size_t i = 0; i < n; i++) total += s->prob[i];
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

    const double u = (u_fixed ? *u_fixed : rng_uniform(s->rng)) * total;
    double cum = 0.0;
    for (size_t i = 0; i < n; i++) {
        cum += s->prob[i];
        if (u < cum) return s->cand[i].id;
    }
    return s->cand[n - 1].id; /* rounding left u at the very top */
}

/* Returns -1 for bad arguments. Falls back to argmax if scratch memory cannot be
 * allocated (the sample is then still a valid id, only not random). */
int32_t sampler_sample(sampler *s, const float *logits, int32_t n_vocab) {
    if (!s || !logits || n_vocab <= 0) return -1;
    return sample_with(s, logits, n_vocab, NULL);
}

/* ---- counter-based draws (design note 7) ---- */

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

double sampler_uniform_at(uint64_t seed, uint32_t pos) {
    uint64_t z = mix64(seed + 0x9e3779b97f4a7c15ULL * ((uint64_t)pos + 1));
    z = mix64(z ^ 0xd1b54a32d192ed03ULL);
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

bool sampler_params_valid(const sampler_params *p) {
    return p && !isnan(p->temp) && !isnan(p->top_p) && !isnan(p->min_p) && p->min_p >= 0.0f && p->min_p <= 1.0f &&
           !isnan(p->repeat_penalty) && p->repeat_penalty >= 0.0f && isfinite(p->repeat_penalty) &&
           isfinite(p->presence_penalty);
}

static bool penalties_on(const sampler_params *p) {
    return (p->repeat_penalty > 0.0f && p->repeat_penalty != 1.0f) || p->presence_penalty != 0.0f;
}

/* Copies logits into s->pen and applies the repetition / presence penalties once per distinct id
 * of window[0..n_window) (ids outside [0, n_vocab) are ignored). */
static int apply_penalties(sampler *s, const float *logits, int32_t n_vocab, const int32_t *window,
                           uint32_t n_window) {
    if ((size_t)n_vocab > s->pen_cap) {
        float *f = malloc((size_t)n_vocab * sizeof *f);
        uint8_t *m = calloc((size_t)n_vocab, 1);
        if (!f || !m) {
            free(f);
            free(m);
            return -1;
        }
        free(s->pen);
        free(s->seen);
        s->pen = f;
        s->seen = m;
        s->pen_cap = (size_t)n_vocab;
    }
    memcpy(s->pen, logits, (size_t)n_vocab * sizeof *s->pen);
    const sampler_params *p = &s->p;
    const bool rep = p->repeat_penalty > 0.0f && p->repeat_penalty != 1.0f;
    for (uint32_t i = 0; i < n_window; i++) {
        int32_t id = window[i];
        if (id < 0 || id >= n_vocab || s->seen[id]) continue;
        s->seen[id] = 1;
        float v = s->pen[id];
        if (rep) v = v > 0.0f ? v / p->repeat_penalty : v * p->repeat_penalty;
        s->pen[id] = v - p->presence_penalty;
    }
    for (uint32_t i = 0; i < n_window; i++)
        if (window[i] >= 0 && window[i] < n_vocab) s->seen[window[i]] = 0;
    return 0;
}

/* log-softmax of logits at temperature 1 for id; -inf for a non-finite logit. */
static float model_logprob(const float *logits, float max_l, double log_z, int32_t id) {
    float v = logits[id];
    if (isnan(v) || v == -INFINITY) return -INFINITY;
    return (float)((double)v - (double)max_l - log_z);
}

int sampler_pick(sampler *s, const float *logits, int32_t n_vocab, uint32_t pos, const int32_t *window,
                 uint32_t n_window, sampler_result *out, uint32_t n_top) {
    if (!s || !logits || !out || n_vocab <= 0 || (n_window && !window) || n_top > SAMPLER_MAX_TOP)
        return KVS_ERR_INVALID_ARG;
    memset(out, 0, sizeof *out);
    const float *l = logits;
    if (n_window && penalties_on(&s->p)) {
        if (apply_penalties(s, logits, n_vocab, window, n_window) != 0) return KVS_ERR_NOMEM;
        l = s->pen;
    }
    const double u = sampler_uniform_at(s->p.seed, pos);
    out->id = sample_with(s, l, n_vocab, &u);

    /* Log-probs of the model's own distribution (raw logits, temperature 1). */
    int32_t best = sampler_argmax(logits, n_vocab);
    float max_l = logits[best];
    double z = 0.0;
    if (isfinite(max_l))
        for (int32_t i = 0; i < n_vocab; i++) {
            float v = logits[i];
            if (!isnan(v) && v != -INFINITY) z += exp((double)v - (double)max_l);
        }
    double log_z = z > 0.0 ? log(z) : 0.0;
    if (!isfinite(max_l)) {
        out->logprob = logits[out->id] == max_l ? 0.0f : -INFINITY;
    } else {
        out->logprob = model_logprob(logits, max_l, log_z, out->id);
    }
    /* The n_top best ids by raw logit (ties: lowest id), best first: n_top passes. */
    uint32_t k = 0;
    for (; k < n_top && k < (uint32_t)n_vocab; k++) {
        int32_t pick = -1;
        for (int32_t i = 0; i < n_vocab; i++) {
            float v = logits[i];
            if (isnan(v)) continue;
            bool taken = false;
            for (uint32_t j = 0; j < k && !taken; j++) taken = out->top[j].id == i;
            if (taken) continue;
            if (pick < 0 || v > logits[pick]) pick = i;
        }
        if (pick < 0) break;
        out->top[k].id = pick;
        out->top[k].logprob = isfinite(max_l) ? model_logprob(logits, max_l, log_z, pick)
                                              : (logits[pick] == max_l ? 0.0f : -INFINITY);
    }
    out->n_top = k;
    return KVS_OK;
}
