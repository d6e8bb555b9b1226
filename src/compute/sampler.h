/* sampler — greedy / temperature / top-k / top-p sampling with a seeded PRNG. */
#ifndef KVS_SAMPLER_H
#define KVS_SAMPLER_H

#include <stdbool.h>
#include <stdint.h>

typedef struct {
    float temp;    /* <= 0: greedy (argmax, lowest id on ties) */
    int top_k;     /* <= 0: off */
    float top_p;   /* >= 1: off */
    uint64_t seed; /* same seed + same logits -> same ids */
    float min_p;            /* 0..1, relative to the best id's probability; 0: off */
    float repeat_penalty;   /* over the window (sampler_pick only); 0 or 1: off */
    float presence_penalty; /* subtracted once per distinct window id (sampler_pick only); 0: off */
} sampler_params;

/* temp 0.8, top_k 40, top_p 0.95, seed 42, min_p 0, repeat_penalty 1, presence_penalty 0 */
sampler_params sampler_default_params(void);
/* Every float is a number, min_p in [0, 1], repeat_penalty >= 0 and finite. */
bool sampler_params_valid(const sampler_params *p);

typedef struct sampler sampler;

/* NULL on allocation failure. */
sampler *sampler_create(sampler_params p);
void sampler_free(sampler *s);
/* Picks one id from logits[0..n_vocab). Does not modify logits. -inf and NaN
 * logits are never drawn (all of them: returns argmax). -1 for NULL s/logits
 * or n_vocab <= 0. Not thread-safe per sampler (it owns the PRNG and scratch). */
int32_t sampler_sample(sampler *s, const float *logits, int32_t n_vocab);
#define SAMPLER_MAX_TOP 20u /* top log-probs one pick can report */

typedef struct {
    int32_t id;    /* the sampled token */
    float logprob; /* its log-probability under the model (sampler.c design note 9) */
    uint32_t n_top;
    struct {
        int32_t id;
        float logprob;
    } top[SAMPLER_MAX_TOP]; /* (n_top) the best ids by logit, best first, ties lowest id */
} sampler_result;

/* The counter-based uniform in [0, 1) for position pos: a pure function of (seed, pos)
 * (sampler.c design note 7). */
double sampler_uniform_at(uint64_t seed, uint32_t pos);

/* Samples the token for position pos (the position the new token will take) from logits, with
 * the penalties over window[0..n_window) (may be NULL when n_window is 0), the pipeline of
 * sampler_sample and the counter-based draw for pos — so the result depends only on the
 * arguments, never on earlier calls. Fills *out (id, its log-prob, the n_top <= SAMPLER_MAX_TOP
 * best log-probs). KVS_OK; KVS_ERR_INVALID_ARG for NULL arguments, n_vocab <= 0 or n_top too
 * big; KVS_ERR_NOMEM when penalty scratch cannot be allocated (*out then zeroed). */
int sampler_pick(sampler *s, const float *logits, int32_t n_vocab, uint32_t pos, const int32_t *window,
                 uint32_t n_window, sampler_result *out, uint32_t n_top);

/* Index of the largest logit (lowest index on ties; NaN loses); -1 if n_vocab <= 0. */
int32_t sampler_argmax(const float *logits, int32_t n_vocab);

#endif /* KVS_SAMPLER_H */
