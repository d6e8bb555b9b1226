#include "engine.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "util.h"

engine_params engine_default_params(void) {
    engine_params p = {0};
    p.kv = kv_default_params();
    p.kv.budget_bytes = 256ull << 20;
    p.kv.max_positions = 0; /* the model's context length, as far as the budget holds it */
    return p;
}

int engine_open(const engine_params *p, engine **out, char *msg, size_t cap) {
    *out = NULL;
    const uint64_t t0 = kvs_now_ns();
    engine *e = calloc(1, sizeof(*e));
    if (!e) return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
    int err = KVS_OK;
    int nt = p->n_threads > 0 ? p->n_threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (nt < 1) nt = 1;
    e->pool = ops_pool_create(nt); /* first: it also repacks the weights */
    if (!e->pool) {
        err = kvs_fail(msg, cap, KVS_ERR_NOMEM, "cannot start %d threads", nt);
        goto fail;
    }
    if ((err = model_load_on(p->model_path, p->first, p->last, e->pool, &e->m, msg, cap))) goto fail;
    kv_params kp = p->kv;
    kp.n_layers = (int)(e->m->last - e->m->first);
    kp.n_kv_heads = (int)e->m->hp.n_head_kv;
    kp.head_dim = (int)e->m->hp.head_dim;
    if (kp.max_positions == 0 || kp.max_positions > e->m->hp.n_ctx) kp.max_positions = e->m->hp.n_ctx;
    if (p->kv_positions > 0) {
        uint64_t blocks = ((uint64_t)p->kv_positions + (uint64_t)kp.block_tokens - 1) / (uint64_t)kp.block_tokens + 1;
        kp.budget_bytes = (p->kv_sessions ? p->kv_sessions : 1) * blocks * kv_params_block_bytes(&kp);
    }
    if ((err = kv_create(&kp, &e->kv, msg, cap))) goto fail;
    char tmsg[KVS_MSG_MAX];
    if (tok_from_gguf(e->m->gguf, &e->vocab, tmsg, sizeof(tmsg)) != KVS_OK) e->vocab = NULL;
    e->open_s = (double)(kvs_now_ns() - t0) / 1e9;
    *out = e;
    return KVS_OK;
fail:
    engine_close(e);
    return err;
}

void engine_close(engine *e) {
    if (!e) return;
    tok_free(e->vocab);
    ops_pool_free(e->pool);
    kv_free(e->kv);
    model_free(e->m);
    free(e);
}

int engine_step(engine *e, engine_req *reqs, int n_reqs) {
    fwd_item stack_items[16];
    fwd_item *items = n_reqs <= 16 ? stack_items : calloc((size_t)n_reqs, sizeof(fwd_item));
    int *map = calloc((size_t)n_reqs + 1, sizeof(int));
    if (!items || !map) {
        if (items != stack_items) free(items);
        free(map);
        for (int i = 0; i < n_reqs; i++) reqs[i].status = KVS_ERR_NOMEM;
        return KVS_ERR_NOMEM;
    }
    int n_items = 0;
    for (int i = 0; i < n_reqs; i++) {
        engine_req *r = &reqs[i];
        kv_txn *txn = NULL;
        r->status = engine_txn_begin(e, 0, r, &txn, &r->reply);
        if (r->status) continue;
        fwd_item *it = &items[n_items];
        memset(it, 0, sizeof(*it));
        it->txn = txn;
        it->tokens = r->tokens;
        it->hidden = r->hidden;
        it->out_mode = r->out_mode;
        it->out = r->out;
        map[n_items++] = i;
    }
    int err = n_items ? engine_txn_run(e, items, n_items) : KVS_OK;
    for (int k = 0; k < n_items; k++) {
        engine_req *r = &reqs[map[k]];
        r->status = engine_txn_end(e, items[k].txn, err ? err : items[k].status, &r->reply);
    }
    if (items != stack_items) free(items);
    free(map);
    return err;
}

int engine_txn_begin(engine *e, uint64_t tenant, const engine_req *r, kv_txn **txn, kv_reply *rep) {
    return kv_begin_prefix(e->kv, tenant, &r->sid, r->epoch, r->start_pos, r->n, r->inherit, r->prefix, txn, rep);
}

int engine_txn_run(engine *e, fwd_item *items, int n_items) { return fwd_run(e->m, e->pool, e->kv, items, n_items); }

int engine_txn_end(engine *e, kv_txn *txn, int status, kv_reply *rep) {
    if (status == KVS_OK) kv_commit(e->kv, txn, rep);
    else kv_abort(e->kv, txn, status == KVS_ERR_CANCELLED);
    return status;
}
