/*
 * forward — runs a batch of (session, positions, inputs) through a model's
 * local layers, writing and reading K/V through kvstate transactions.
 *
 * All tokens of all items pass each weight matrix together (one pass over the
 * weights per layer, whatever the number of sessions); attention is computed
 * per (token, kv head) over that token's own session only. Every output
 * element is reduced in a fixed order, so an item's results are bit-identical
 * whether it runs alone or batched with others.
 *
 * One pass for every family in the arch table: the model's arch row and
 * tensors decide the differences (q/k/v and output biases when present,
 * adjacent-pair or neox rope, rope frequencies already divided by
 * rope_freqs and scaled at load).
 */
#ifndef KVS_FORWARD_H
#define KVS_FORWARD_H

#include <stdint.h>

#include "kvstate.h"
#include "model.h"
#include "ops.h"

typedef enum {
    FWD_OUT_HIDDEN = 0,      /* out: n x n_embd hidden states after the last local layer */
    FWD_OUT_LOGITS_ALL = 1,  /* out: n x n_vocab (range must own the head) */
    FWD_OUT_LOGITS_LAST = 2, /* out: n_vocab for the last position only */
} fwd_out_mode;

typedef struct {
    kv_txn *txn;          /* open transaction; positions [pos0, pos0 + n) are computed */
    uint32_t pos0, n;     /* a sub-range of the transaction (chunked prefill: positions
                           * before pos0 must already be written); n == 0: the whole
                           * transaction [start, end) */
    const int32_t *tokens; /* n ids when the range owns layer 0 */
    const float *hidden;  /* n x n_embd otherwise */
    fwd_out_mode out_mode;
    float *out;
    int status;           /* set by fwd_run: KVS_OK or KVS_ERR_CANCELLED */
} fwd_item;

/* Runs the items through layers [m->first, m->last). Items whose transaction
 * is cancelled stop at the next layer boundary (status KVS_ERR_CANCELLED, out
 * untouched); the caller commits or aborts each transaction. Returns
 * KVS_ERR_INVALID_ARG (nothing computed) for inputs that do not fit the model
 * (token id out of range, logits requested from a range without the head, a
 * missing input), KVS_ERR_NOMEM, else KVS_OK. */
int fwd_run(const model *m, ops_pool *pool, const kv_state *kv, fwd_item *items, int n_items);

#endif /* KVS_FORWARD_H */
