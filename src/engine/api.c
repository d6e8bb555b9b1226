/*
 * api — the public C API (include/kvshard.h) over the internal modules.
 *
 * Each public handle wraps one internal object; this file only validates
 * arguments from the caller, translates public types to internal ones and
 * back, and forwards. The semantics live in engine / kvstate / forward /
 * tokenizer / sampler.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "kvshard.h"
#include "quant.h"
#include "sampler.h"
#include "util.h"

#define API_MAX_THREADS 1024

struct kvs_engine {
    engine *eng;
};

struct kvs_sampler {
    sampler *smp;
};

static kv_sid sid_in(const kvs_session_id *sid) {
    kv_sid s;
    memcpy(s.bytes, sid->bytes, sizeof(s.bytes));
    return s;
}

static kvs_reply reply_out(const kv_reply *r) {
    kvs_reply o = {.have = r->have, .live_epoch = r->live_epoch, .n_past = r->n_past};
    return o;
}

/* ---- engine --------------------------------------------------------------- */

kvs_engine_params kvs_engine_default_params(void) {
    engine_params ep = engine_default_params();
    kvs_engine_params p;
    memset(&p, 0, sizeof(p));
    p.model_path = NULL;
    p.first_layer = ep.first;
    p.last_layer = ep.last;
    p.n_threads = ep.n_threads;
    p.kv_budget_bytes = ep.kv.budget_bytes;
    p.kv_block_tokens = ep.kv.block_tokens;
    p.kv_type = ep.kv.kv_type == QUANT_F32 ? KVS_KV_F32 : KVS_KV_F16;
    p.kv_ttl_ms = ep.kv.ttl_ns / 1000000u;
    p.max_sessions = ep.kv.max_sessions;
    p.max_positions = ep.kv.max_positions;
    return p;
}

int kvs_engine_open(kvs_engine_params p, kvs_engine **out, char *msg, size_t msg_cap) {
    if (msg && msg_cap) msg[0] = '\0';
    if (!out) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "out is NULL");
    *out = NULL;
    if (!p.model_path) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "model_path is NULL");
    if (p.last_layer != 0 && p.first_layer >= p.last_layer)
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "layer range [%u, %u) is empty", p.first_layer,
                        p.last_layer);
    if (p.n_threads < 0 || p.n_threads > API_MAX_THREADS)
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "n_threads %d out of [0, %d]", p.n_threads,
                        API_MAX_THREADS);
    if (p.kv_type != KVS_KV_F16 && p.kv_type != KVS_KV_F32)
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "kv_type %d is neither KVS_KV_F16 nor KVS_KV_F32",
                        (int)p.kv_type);
    uint64_t ttl_ns;
    if (!kvs_mul_u64(p.kv_ttl_ms, 1000000u, &ttl_ns))
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "kv_ttl_ms %llu is too large",
                        (unsigned long long)p.kv_ttl_ms);

    engine_params ep = engine_default_params();
    ep.model_path = p.model_path;
    ep.first = p.first_layer;
    ep.last = p.last_layer;
    ep.n_threads = p.n_threads;
    ep.kv.budget_bytes = p.kv_budget_bytes;
    ep.kv.block_tokens = p.kv_block_tokens; /* kv_create checks the range */
    ep.kv.kv_type = p.kv_type == KVS_KV_F32 ? QUANT_F32 : QUANT_F16;
    ep.kv.ttl_ns = ttl_ns;
    ep.kv.max_sessions = p.max_sessions;
    ep.kv.max_positions = p.max_positions; /* engine_open caps 0 / > n_ctx to n_ctx */

    kvs_engine *h = calloc(1, sizeof(*h));
    if (!h) return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
    int err = engine_open(&ep, &h->eng, msg, msg_cap);
    if (err != KVS_OK) {
        free(h);
        return err;
    }
    *out = h;
    return KVS_OK;
}

void kvs_engine_close(kvs_engine *h) {
    if (!h) return;
    engine_close(h->eng);
    free(h);
}

int kvs_engine_info(const kvs_engine *h, kvs_model_info *out) {
    if (!h || !out) return KVS_ERR_INVALID_ARG;
    const model *m = h->eng->m;
    kvs_model_info i;
    memset(&i, 0, sizeof(i));
    i.n_vocab = m->hp.n_vocab;
    i.n_embd = m->hp.n_embd;
    i.n_layer = m->hp.n_layer;
    i.n_head = m->hp.n_head;
    i.n_head_kv = m->hp.n_head_kv;
    i.head_dim = m->hp.head_dim;
    i.n_ff = m->hp.n_ff;
    i.n_ctx = m->hp.n_ctx;
    i.first_layer = m->first;
    i.last_layer = m->last;
    i.has_embeddings = m->has_embd;
    i.has_head = m->has_head;
    i.has_tokenizer = h->eng->vocab != NULL;
    i.weight_bytes = m->weight_bytes;
    i.kv_block_bytes = kv_block_bytes(h->eng->kv);
    i.max_positions = kv_get_params(h->eng->kv)->max_positions;
    *out = i;
    return KVS_OK;
}

/* ---- text ------------------------------------------------------------------ */

int kvs_tokenize(const kvs_engine *h, const char *text, size_t len, bool add_bos, int32_t *ids, int max_ids,
                 int *n_ids) {
    if (!h || !n_ids || max_ids < 0 || (!ids && max_ids > 0) || (!text && len > 0)) return KVS_ERR_INVALID_ARG;
    if (!h->eng->vocab) return KVS_ERR_UNSUPPORTED;
    return tok_encode(h->eng->vocab, text, len, add_bos, ids, max_ids, n_ids);
}

int kvs_token_to_piece(const kvs_engine *h, int32_t id, char *buf, size_t cap, size_t *len) {
    if (!h || !len || (!buf && cap > 0)) return KVS_ERR_INVALID_ARG;
    *len = 0;
    if (!h->eng->vocab) return KVS_ERR_UNSUPPORTED;
    int err = tok_piece(h->eng->vocab, id, buf, cap, len);
    if (err == KVS_OK && *len > cap) return KVS_ERR_TOO_LARGE;
    return err;
}

int32_t kvs_token_bos(const kvs_engine *h) {
    return h && h->eng->vocab ? tok_bos(h->eng->vocab) : -1;
}

int32_t kvs_token_eos(const kvs_engine *h) {
    return h && h->eng->vocab ? tok_eos(h->eng->vocab) : -1;
}

/* ---- sessions ---------------------------------------------------------------- */

/* The checks fwd_run would make for the whole batch, made per request so that
 * one bad request fails alone. */
static int check_request(const model *m, const kvs_request *r, fwd_out_mode *mode) {
    switch (r->out_kind) {
    case KVS_OUT_HIDDEN: *mode = FWD_OUT_HIDDEN; break;
    case KVS_OUT_LOGITS_LAST: *mode = FWD_OUT_LOGITS_LAST; break;
    case KVS_OUT_LOGITS_ALL: *mode = FWD_OUT_LOGITS_ALL; break;
    default: return KVS_ERR_INVALID_ARG;
    }
    if (r->n == 0 || !r->out) return KVS_ERR_INVALID_ARG;
    if (*mode != FWD_OUT_HIDDEN && !m->has_head) return KVS_ERR_INVALID_ARG;
    if (m->has_embd) {
        if (!r->tokens) return KVS_ERR_INVALID_ARG;
        for (uint32_t j = 0; j < r->n; j++)
            if (r->tokens[j] < 0 || (uint32_t)r->tokens[j] >= m->hp.n_vocab) return KVS_ERR_INVALID_ARG;
    } else if (!r->hidden) {
        return KVS_ERR_INVALID_ARG;
    }
    return KVS_OK;
}

int kvs_forward(kvs_engine *h, kvs_request *reqs, int n_reqs) {
    if (!h || n_reqs < 0 || n_reqs > KVS_MAX_BATCH || (!reqs && n_reqs > 0)) return KVS_ERR_INVALID_ARG;
    if (n_reqs == 0) return KVS_OK;
    engine *e = h->eng;
    engine_req *ereqs = calloc((size_t)n_reqs, sizeof(*ereqs));
    kv_inherit *inh = calloc((size_t)n_reqs, sizeof(*inh));
    int *map = calloc((size_t)n_reqs, sizeof(*map));
    int err = KVS_OK;
    if (!ereqs || !inh || !map) {
        for (int i = 0; i < n_reqs; i++) {
            reqs[i].status = KVS_ERR_NOMEM;
            memset(&reqs[i].reply, 0, sizeof(reqs[i].reply));
        }
        err = KVS_ERR_NOMEM;
        goto done;
    }
    int n_run = 0;
    for (int i = 0; i < n_reqs; i++) {
        kvs_request *r = &reqs[i];
        memset(&r->reply, 0, sizeof(r->reply));
        fwd_out_mode mode = FWD_OUT_HIDDEN;
        r->status = check_request(e->m, r, &mode);
        if (r->status != KVS_OK) continue;
        engine_req *q = &ereqs[n_run];
        q->sid = sid_in(&r->sid);
        q->epoch = r->epoch;
        q->start_pos = r->start_pos;
        q->n = r->n;
        if (r->inherit) {
            inh[n_run].old_epoch = r->inherit_epoch;
            inh[n_run].len = r->inherit_len;
            q->inherit = &inh[n_run];
        }
        q->tokens = e->m->has_embd ? r->tokens : NULL;
        q->hidden = e->m->has_embd ? NULL : r->hidden;
        q->out_mode = mode;
        q->out = r->out;
        map[n_run++] = i;
    }
    if (n_run > 0) err = engine_step(e, ereqs, n_run);
    for (int k = 0; k < n_run; k++) {
        kvs_request *r = &reqs[map[k]];
        r->status = err != KVS_OK && ereqs[k].status == KVS_OK ? err : ereqs[k].status;
        r->reply = reply_out(&ereqs[k].reply);
    }
done:
    free(ereqs);
    free(inh);
    free(map);
    return err;
}

int kvs_session_truncate(kvs_engine *h, const kvs_session_id *sid, uint64_t epoch, uint32_t len, kvs_reply *rep) {
    if (rep) memset(rep, 0, sizeof(*rep));
    if (!h || !sid) return KVS_ERR_INVALID_ARG;
    kv_sid s = sid_in(sid);
    kv_reply r = {0};
    int err = kv_truncate(h->eng->kv, &s, epoch, len, &r);
    if (rep) *rep = reply_out(&r);
    return err;
}

int kvs_session_release(kvs_engine *h, const kvs_session_id *sid, uint64_t epoch, kvs_reply *rep) {
    if (rep) memset(rep, 0, sizeof(*rep));
    if (!h || !sid) return KVS_ERR_INVALID_ARG;
    kv_sid s = sid_in(sid);
    kv_reply r = {0};
    int err = kv_release(h->eng->kv, &s, epoch, &r);
    if (rep) *rep = reply_out(&r);
    return err;
}

int kvs_session_cancel(kvs_engine *h, const kvs_session_id *sid) {
    if (!h || !sid) return KVS_ERR_INVALID_ARG;
    kv_sid s = sid_in(sid);
    return kv_cancel(h->eng->kv, &s);
}

int kvs_session_lookup(kvs_engine *h, const kvs_session_id *sid, uint64_t *epoch, uint32_t *n_past) {
    if (!h || !sid) return KVS_ERR_INVALID_ARG;
    kv_sid s = sid_in(sid);
    return kv_lookup(h->eng->kv, &s, epoch, n_past);
}

int kvs_engine_sweep_ttl(kvs_engine *h, int max_work, int *n_evicted) {
    if (!h || max_work < 1) return KVS_ERR_INVALID_ARG;
    int n = kv_sweep_ttl(h->eng->kv, max_work);
    if (n_evicted) *n_evicted = n;
    return KVS_OK;
}

int kvs_engine_kv_stats(kvs_engine *h, kvs_kv_stats *out) {
    if (!h || !out) return KVS_ERR_INVALID_ARG;
    kv_stats st;
    kv_get_stats(h->eng->kv, &st);
    kvs_kv_stats o;
    memset(&o, 0, sizeof(o));
    o.sessions = st.sessions;
    o.bytes_used = st.bytes_used;
    o.budget_bytes = st.budget_bytes;
    o.block_bytes = st.block_bytes;
    o.blocks_total = st.blocks_total;
    o.blocks_free = st.blocks_free;
    o.hits = st.hits;
    o.misses = st.misses;
    o.stale = st.stale;
    o.evict_ttl = st.evict_ttl;
    o.evict_lru = st.evict_lru;
    o.releases = st.releases;
    o.rewinds = st.rewinds;
    o.cancellations = st.cancellations;
    o.appends = st.appends;
    o.truncates = st.truncates;
    o.inherits = st.inherits;
    o.busy = st.busy;
    *out = o;
    return KVS_OK;
}

/* ---- sampler ------------------------------------------------------------------ */

kvs_sampler_params kvs_sampler_default_params(void) {
    sampler_params sp = sampler_default_params();
    kvs_sampler_params p = {.temp = sp.temp, .top_k = sp.top_k, .top_p = sp.top_p, .seed = sp.seed};
    return p;
}

int kvs_sampler_create(kvs_sampler_params p, kvs_sampler **out) {
    if (!out) return KVS_ERR_INVALID_ARG;
    *out = NULL;
    if (isnan(p.temp) || isnan(p.top_p)) return KVS_ERR_INVALID_ARG;
    kvs_sampler *h = calloc(1, sizeof(*h));
    if (!h) return KVS_ERR_NOMEM;
    sampler_params sp = {.temp = p.temp, .top_k = p.top_k, .top_p = p.top_p, .seed = p.seed};
    h->smp = sampler_create(sp);
    if (!h->smp) {
        free(h);
        return KVS_ERR_NOMEM;
    }
    *out = h;
    return KVS_OK;
}

void kvs_sampler_free(kvs_sampler *h) {
    if (!h) return;
    sampler_free(h->smp);
    free(h);
}

int kvs_sampler_sample(kvs_sampler *h, const float *logits, int32_t n_vocab, int32_t *id) {
    if (!h || !logits || !id || n_vocab <= 0) return KVS_ERR_INVALID_ARG;
    int32_t r = sampler_sample(h->smp, logits, n_vocab);
    if (r < 0) return KVS_ERR_INVALID_ARG;
    *id = r;
    return KVS_OK;
}
