/* What a shard tells the cluster registry about itself (server.h, srv_get_info). */
#include <string.h>

#include "engine.h"
#include "kvstate.h"
#include "server_impl.h"

void srv_get_info(const srv *s, struct wire_info *out) {
    const model *m = s->e->m;
    memset(out, 0, sizeof *out);
    out->version = WIRE_PROTO_VERSION;
    out->hidden_dtypes = WIRE_DTYPE_F32 | WIRE_DTYPE_F16 | WIRE_DTYPE_BF16;
    memcpy(out->model_digest, s->digest, 32);
    out->n_layer = m->hp.n_layer;
    out->first = m->first;
    out->last = m->last;
    out->n_embd = m->hp.n_embd;
    out->n_vocab = m->hp.n_vocab;
    out->kv_budget_bytes = s->p.kv_budget_bytes;
    out->max_tokens = s->p.max_tokens;
    out->max_ctx = kv_get_params(s->e->kv)->max_positions;
    out->name_len = (uint16_t)strlen(s->name);
    memcpy(out->name, s->name, out->name_len);
}
