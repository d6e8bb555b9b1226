/*
 * tok_heap — the binary heap of candidate merges both encoders pop from (tok_spm.c: bigrams,
 * highest score first; tok_bpe.c: pairs, lowest rank first). Private to those two files.
 *
 * TOK_HEAP_DEFINE(WORK, ITEM, ABOVE) defines, for a scratch struct WORK with the fields
 * `ITEM *heap; size_t heap_n, heap_cap;` and a predicate `bool ABOVE(const ITEM *a, const ITEM *b)`
 * (true when a pops before b; strict, so that equal keys need a tie-break for a deterministic
 * encode):
 *   static int heap_push(WORK *w, ITEM it);  KVS_OK, or KVS_ERR_NOMEM with the heap unchanged
 *   static ITEM heap_pop(WORK *w);           removes and returns the top; w->heap_n must be > 0
 * The array grows by doubling from 64 and is the caller's to free.
 */
#ifndef KVS_TOK_HEAP_H
#define KVS_TOK_HEAP_H

#include <stdlib.h>

#include "kvshard.h"

#define TOK_HEAP_DEFINE(WORK, ITEM, ABOVE)                                \
    static int heap_push(WORK *w, ITEM it) {                              \
        if (w->heap_n == w->heap_cap) {                                   \
            size_t cap = w->heap_cap ? w->heap_cap * 2 : 64;              \
            ITEM *h = realloc(w->heap, cap * sizeof *h);                  \
            if (!h) return KVS_ERR_NOMEM;                                 \
            w->heap = h;                                                  \
            w->heap_cap = cap;                                            \
        }                                                                 \
        size_t i = w->heap_n++;                                           \
        while (i > 0) {                                                   \
            size_t parent = (i - 1) / 2;                                  \
            if (!ABOVE(&it, &w->heap[parent])) break;                     \
            w->heap[i] = w->heap[parent];                                 \
            i = parent;                                                   \
        }                                                                 \
        w->heap[i] = it;                                                  \
        return KVS_OK;                                                    \
    }                                                                     \
                                                                          \
    static ITEM heap_pop(WORK *w) {                                       \
        ITEM top = w->heap[0];                                            \
        ITEM last = w->heap[--w->heap_n];                                 \
        size_t n = w->heap_n, i = 0;                                      \
        for (;;) {                                                        \
            size_t l = 2 * i + 1, r = l + 1, m = l;                       \
            if (l >= n) break;                                            \
            if (r < n && ABOVE(&w->heap[r], &w->heap[l])) m = r;          \
            if (!ABOVE(&w->heap[m], &last)) break;                        \
            w->heap[i] = w->heap[m];                                      \
            i = m;                                                        \
        }                                                                 \
        if (n > 0) w->heap[i] = last;                                     \
        return top;                                                       \
    }

#endif /* KVS_TOK_HEAP_H */
