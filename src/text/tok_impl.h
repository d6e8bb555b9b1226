/*
 * tok_impl — what the family encoders (tok_spm.c, tok_bpe.c) write into: the output of one
 * encode call. Private to the text layer; the vocab they read is vocab.h.
 */
#ifndef KVS_TOK_IMPL_H
#define KVS_TOK_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "vocab.h"

/* Output of one encode call: ids past max_ids are counted, not written. */
typedef struct {
    int32_t *ids;
    int max_ids;
    size_t n_out;
} tok_out;

static inline void tok_emit(tok_out *o, int32_t id) {
    if (o->n_out < (size_t)o->max_ids) o->ids[o->n_out] = id;
    o->n_out++;
}

#endif /* KVS_TOK_IMPL_H */
