/*
 * engine — a loaded layer range with its thread pool and hot KV state: the
 * unit a shard server or `kvshard run` drives. engine_step runs one or more
 * session requests as one forward batch: kv_begin for each, one fwd_run over
 * all of them, then kv_commit (or kv_abort on error/cancel) for each.
 */
#ifndef KVS_ENGINE_H
#define KVS_ENGINE_H

#include <stdbool.h>
#include <stdint.h>

#include "forward.h"
#include "kvstate.h"
#include "model.h"
#include "ops.h"
#include "tokenizer.h"

typedef struct {
    const char *model_path;
    uint32_t first, last;   /* layer range; last 0 = n_layer */
    int n_threads;          /* 0: online CPUs */
    kv_params kv;           /* n_layers/heads/head_dim filled from the model */
    uint32_t kv_positions;  /* > 0: size the KV budget (kv.budget_bytes ignored) for kv_sessions
                               sessions of this many positions, plus a block of slack each */
    uint32_t kv_sessions;   /* with kv_positions; 0 counts as 1 */
} engine_params;

engine_params engine_default_params(void);

typedef struct {
    model *m;
    ops_pool *pool;
    kv_state *kv;
    tok_vocab *vocab;       /* NULL when the file has no usable tokenizer */
    double open_s;          /* engine_open's wall time: threads, map + repack, KV pool, tokenizer */
} engine;

int engine_open(const engine_params *p, engine **out, char *msg, size_t msg_cap);
void engine_close(engine *e);

typedef struct {
    kv_sid sid;
    uint64_t epoch;
    uint32_t start_pos, n;
    const kv_inherit *inherit; /* NULL: none */
    const kv_prefix *prefix;   /* chain hashes of shared prefix blocks (kv_begin_prefix); NULL: none */
    const int32_t *tokens;     /* or hidden, per the range */
    const float *hidden;
    fwd_out_mode out_mode;
    float *out;
    int status;                /* result */
    kv_reply reply;
} engine_req;

/* Runs reqs as one batch. Each req gets its own status; returns KVS_OK unless
 * the batch as a whole failed (then every req carries that error too). */
int engine_step(engine *e, engine_req *reqs, int n_reqs);

/* The transaction of one request, for callers that run it over several steps (the shard's
 * scheduler cuts a prefill into chunks); engine_step is these three in one batch.
 * engine_txn_begin: kv_begin_tenant for r (validates it against its session, reserves its
 * blocks, pins the session); KVS_OK with *txn set, or the refusal with rep's recovery fields.
 * engine_txn_run: one forward pass over open transactions (fwd_run).
 * engine_txn_end: commits when status is KVS_OK, else rolls the session back to exactly its
 * state before the begin (a KVS_ERR_CANCELLED status counts as a cancellation); returns
 * status. *txn is gone either way. */
int engine_txn_begin(engine *e, uint64_t tenant, const engine_req *r, kv_txn **txn, kv_reply *rep);
int engine_txn_run(engine *e, fwd_item *items, int n_items);
int engine_txn_end(engine *e, kv_txn *txn, int status, kv_reply *rep);

#endif /* KVS_ENGINE_H */
