/* sampler — greedy / temperature / top-k / top-p sampling with a seeded PRNG. */
#ifndef KVS_SAMPLER_H
#define KVS_SAMPLER_H

#include <stdint.h>

typedef struct {
    float temp;    /* <= 0: greedy (argmax, lowest id on ties) */
    int top_k;     /* <= 0: off */
    float top_p;   /* >= 1: off */
    uint64_t seed; /* same seed + same logits -> same ids */
} sampler_params;

sampler_params sampler_default_params(void); /* temp 0.8, top_k 40, top_p 0.95, seed 42 */

typedef struct sampler sampler;

/* NULL on allocation failure. */
sampler *sampler_create(sampler_params p);
void sampler_free(sampler *s);
/* Picks one id from logits[0..n_vocab). Does not modify logits. -inf and NaN
 * logits are never drawn (all of them: returns argmax). -1 for NULL s/logits
 * or n_vocab <= 0. Not thread-safe per sampler (it owns the PRNG and scratch). */
int32_t sampler_sample(sampler *s, const float *logits, int32_t n_vocab);
/* Index of the largest logit (lowest index on ties; NaN loses); -1 if n_vocab <= 0. */
int32_t sampler_argmax(const float *logits, int32_t n_vocab);

#endif /* KVS_SAMPLER_H */
