/* server_ops.c — the handlers of FORWARD, TRUNCATE / RELEASE, VOCAB, VOCAB_META and STATS. */
#include <stdlib.h>
#include <string.h>

#include "netio.h"
#include "quant.h"
#include "sampler.h"
#include "server_impl.h"
#include "util.h"

void srv_job_free(srv_job *j) {
    if (!j) return;
    free(j->window);
    free(j->relay);
    free((void *)j->prefix.hashes);
    free(j->tokens);
    free(j->hidden);
    free(j->out);
    free(j->scratch);
    free(j);
}

/* relay_params.done: a push failed -> tell the client which hop and why; return the push's
 * bytes to s->buffered and its slot to the connection's in-flight count; drop the ref. */
void srv_relay_done(void *ctx, void *target, uint64_t rid, uint16_t hop, const char *addr, size_t len, int status,
                    const char *why) {
    (void)ctx;
    srv_conn *c = target;
    atomic_fetch_sub(&c->s->buffered, len);
    atomic_fetch_sub(&c->inflight, 1);
    if (status != KVS_OK) {
        char text[KVS_MSG_MAX];
        snprintf(text, sizeof(text), "relay: hop %u (%s): %s", (unsigned)hop, addr, why);
        srv_send_status(c, rid, status, NULL, text);
    }
    srv_conn_unref(c);
}

/* A relayed job with next hops: its hidden rows go on to next[0] instead of back. */
static void push_forward(srv_job *j) {
    srv *s = j->conn->s;
    uint8_t *payload = NULL;
    size_t len = 0;
    struct wire_sample_req sq = j->sq;
    sq.window = j->window;
    struct wire_prefix px = {.first = j->prefix.first, .n_hashes = j->prefix.n, .hashes = j->prefix.hashes};
    int err = relay_build_next(j->relay, j->wire_sid, j->epoch, j->start_pos, j->n, j->wire_out_mode, &sq,
                               j->prefix.hashes ? &px : NULL, j->out, j->out_cols, &payload, &len);
    if (err) {
        srv_send_status(j->conn, j->request_id, err, &j->reply, "relay: cannot encode the next hop's FORWARD");
        return;
    }
    /* The push is the originating connection's work until it is written: it holds bytes of the
     * global cap and one of the connection's in-flight slots (srv_relay_done returns both). */
    unsigned long long before = atomic_fetch_add(&s->buffered, len);
    if (before + len > s->p.max_buffered_bytes) {
        atomic_fetch_sub(&s->buffered, len);
        free(payload);
        srv_send_status(j->conn, j->request_id, KVS_ERR_BUSY, &j->reply, "relay: the shard holds too many buffered bytes");
        return;
    }
    atomic_fetch_add(&j->conn->inflight, 1);
    srv_conn_ref(j->conn);
    relay_push(s->relay, j->relay->next[0].addr, (uint16_t)(j->relay->hop + 1), payload, len, j->request_id, j->conn);
}

/* SAMPLE: the token after the last row, from its logits in j->out (sampler.c design note 7). */
static int sample_reply(srv_job *j, uint8_t out[8 + 8 * WIRE_MAX_TOP], struct wire_forward_reply *m) {
    sampler_params sp = {.temp = j->sq.temp, .top_k = (int)j->sq.top_k, .top_p = j->sq.top_p, .seed = j->sq.seed,
                         .min_p = j->sq.min_p, .repeat_penalty = j->sq.repeat_penalty,
                         .presence_penalty = j->sq.presence_penalty};
    sampler *smp = sampler_create(sp);
    if (!smp) return KVS_ERR_NOMEM;
    sampler_result r;
    int err = sampler_pick(smp, j->out, (int32_t)j->out_cols, j->start_pos + j->n, j->window, j->sq.n_window, &r,
                           j->sq.n_top);
    sampler_free(smp);
    if (err) return err;
    kvs_wr_u32(out, (uint32_t)r.id);
    kvs_wr_f32(out + 4, r.logprob);
    for (uint32_t i = 0; i < r.n_top; i++) {
        kvs_wr_u32(out + 8 + 8 * i, (uint32_t)r.top[i].id);
        kvs_wr_f32(out + 12 + 8 * i, r.top[i].logprob);
    }
    m->out_kind = WIRE_OUTK_SAMPLE;
    m->n_rows = 1;
    m->n_cols = r.n_top;
    m->data = out;
    return KVS_OK;
}

void srv_send_forward_reply(srv_job *j) {
    if (j->status == KVS_OK && j->relay) {
        push_forward(j);
        return;
    }
    uint8_t sampled[8 + 8 * WIRE_MAX_TOP];
    struct wire_forward_reply m;
    memset(&m, 0, sizeof(m));
    m.st.status = j->status;
    m.st.have = j->reply.have;
    m.st.live_epoch = j->reply.live_epoch;
    m.st.n_past = j->reply.n_past;
    m.out_kind = WIRE_OUTK_NONE;
    void *f16 = NULL;
    if (j->status == KVS_OK && j->sample) {
        int err = sample_reply(j, sampled, &m);
        if (err) {
            m.st.status = err;
            m.out_kind = WIRE_OUTK_NONE;
        }
    } else if (j->status == KVS_OK) {
        m.n_rows = j->out_rows;
        m.n_cols = j->out_cols;
        if (j->out_mode == FWD_OUT_HIDDEN && (j->reply_f16 || j->reply_bf16)) {
            size_t n = (size_t)j->out_rows * j->out_cols;
            f16 = malloc(n * sizeof(uint16_t));
            if (!f16) {
                m.st.status = KVS_ERR_NOMEM;
                m.n_rows = m.n_cols = 0;
            } else if (j->reply_f16) {
                quant_f32_to_f16_row(j->out, f16, (int64_t)n);
                m.out_kind = WIRE_OUTK_HIDDEN_F16;
                m.data = f16;
            } else {
                uint16_t *h = f16;
                for (size_t i = 0; i < n; i++) h[i] = wire_f32_to_bf16(j->out[i]);
                m.out_kind = WIRE_OUTK_HIDDEN_BF16;
                m.data = f16;
            }
        } else {
            m.out_kind = j->out_mode == FWD_OUT_HIDDEN ? WIRE_OUTK_HIDDEN_F32 : WIRE_OUTK_LOGITS_F32;
            m.data = j->out;
        }
    }
    size_t len = 0;
    uint8_t *buf = NULL;
    int err = wire_encode_forward_reply(&m, NULL, 0, &len);
    if (!err) {
        buf = malloc(len);
        err = buf ? wire_encode_forward_reply(&m, buf, len, &len) : KVS_ERR_NOMEM;
    }
    if (err) {
        /* Could not encode the result (memory, size): answer with the bare status. */
        memset(&m, 0, sizeof(m));
        m.st.status = err;
        m.st.n_past = j->reply.n_past;
        uint8_t small[64];
        if (wire_encode_forward_reply(&m, small, sizeof(small), &len) == KVS_OK)
            srv_conn_send(j->conn, WIRE_OP_FORWARD_REPLY, j->request_id, small, len);
    } else {
        srv_conn_send(j->conn, WIRE_OP_FORWARD_REPLY, j->request_id, buf, len);
    }
    free(buf);
    free(f16);
}

/* The shape of a FORWARD's work here: what this shard computes (hidden rows when it pushes on,
 * the last row's logits to sample) and the reply's rows x cols. */
typedef struct {
    bool tokens_in, relayed, pushes;
    uint32_t local_mode; /* WIRE_OUT_* this shard computes */
    uint32_t rows, cols;
} fwd_shape;

static fwd_shape forward_shape(const model *m, const struct wire_forward *f) {
    fwd_shape sh = {.tokens_in = f->in_kind == WIRE_IN_TOKENS, .relayed = (f->flags & WIRE_FWD_RELAY) != 0};
    sh.pushes = sh.relayed && f->relay.n_next > 0;
    sh.local_mode = sh.pushes ? WIRE_OUT_HIDDEN : f->out_mode == WIRE_OUT_SAMPLE ? WIRE_OUT_LOGITS_LAST : f->out_mode;
    sh.rows = sh.local_mode == WIRE_OUT_LOGITS_LAST ? 1 : f->n_tokens;
    sh.cols = sh.local_mode == WIRE_OUT_HIDDEN ? m->hp.n_embd : m->hp.n_vocab;
    return sh;
}

/* True when canon (relay_canon_addr) names this shard's own listening socket: its port on its
 * listen host, on any loopback address when that is loopback, on any host for a wildcard. */
static bool hop_is_self(const srv *s, const char *canon) {
    char host[NETIO_HOST_MAX], own[RELAY_ADDR_MAX + NETIO_HOST_MAX], port[8];
    uint16_t lport;
    snprintf(port, sizeof port, ":%u", (unsigned)s->port);
    size_t pl = strlen(port), cl = strlen(canon);
    if (cl < pl || strcmp(canon + cl - pl, port)) return false;
    if (netio_parse_hostport(s->p.listen, host, sizeof host, &lport) != KVS_OK) return true;
    snprintf(own, sizeof own, strchr(host, ':') ? "[%s]%s" : "%s%s", host, port);
    char canon_own[RELAY_ADDR_MAX];
    if (relay_canon_addr(own, canon_own) != KVS_OK) return true; /* a host name: any port match */
    if (!strncmp(canon_own, "0.0.0.0:", 8) || !strncmp(canon_own, "[::]:", 5)) return true;
    bool loop_own = !strncmp(canon_own, "127.", 4) || !strncmp(canon_own, "[::1]:", 6);
    bool loop_hop = !strncmp(canon, "127.", 4) || !strncmp(canon, "[::1]:", 6);
    return !strcmp(canon_own, canon) || (loop_own && loop_hop);
}

/* Why the relay hops of f are refused (NULL: they are not): every hop a numeric HOST:PORT, none
 * twice, none this shard (a loop multiplies the work of one request), next[0] allowed here. */
static const char *relay_hops_refusal(const srv *s, const struct wire_relay *rl) {
    char canon[WIRE_MAX_RELAY_HOPS][RELAY_ADDR_MAX];
    for (uint16_t i = 0; i < rl->n_next && i < WIRE_MAX_RELAY_HOPS; i++) {
        if (relay_canon_addr(rl->next[i].addr, canon[i]) != KVS_OK) return "a relay hop is not a numeric HOST:PORT";
        if (hop_is_self(s, canon[i])) return "a relay hop names this shard (a loop)";
        for (uint16_t k = 0; k < i; k++)
            if (!strcmp(canon[k], canon[i])) return "a relay hop is listed twice";
    }
    if (rl->n_next && !relay_allowed(s->relay, canon[0])) return "the next relay hop is not allowed here (--relay-allow)";
    return NULL;
}

/* Why this shard refuses the FORWARD before queueing it (NULL: it does not), with the status. */
static const char *forward_refusal(srv_conn *c, const struct wire_forward *f, const fwd_shape *sh, int *status) {
    const model *m = c->s->e->m;
    *status = KVS_ERR_INVALID_ARG;
    if (c->version < 2 && (sh->relayed || f->out_mode == WIRE_OUT_SAMPLE)) {
        *status = KVS_ERR_UNSUPPORTED;
        return "sampling and relay need protocol version 2 (say HELLO with max_version 2)";
    }
    if (c->version < 3 && (f->flags & WIRE_FWD_PREFIX)) {
        *status = KVS_ERR_UNSUPPORTED;
        return "prefix hashes need protocol version 3 (say HELLO with max_version 3)";
    }
    if (c->version < 2 && f->in_kind == WIRE_IN_HIDDEN_BF16) {
        *status = KVS_ERR_UNSUPPORTED;
        return "bf16 hidden states need protocol version 2 (say HELLO with max_version 2)";
    }
    if (sh->relayed && f->relay.n_next == 0 && f->out_mode == WIRE_OUT_HIDDEN)
        return "a relayed step must end in logits or a sample";
    if (sh->pushes && m->has_head) return "relay hops after the shard that owns the output head";
    const char *hops = sh->relayed ? relay_hops_refusal(c->s, &f->relay) : NULL;
    if (hops) return hops;
    if (sh->tokens_in != m->has_embd)
        return m->has_embd ? "this shard owns layer 0 and takes token ids" : "this shard takes hidden states";
    if (!sh->tokens_in && f->n_embd != m->hp.n_embd) return "hidden width does not match n_embd";
    if (f->out_mode != WIRE_OUT_HIDDEN && !sh->pushes && !m->has_head)
        return "logits requested from a shard without the output head";
    *status = KVS_ERR_TOO_LARGE;
    if (f->n_tokens > c->s->p.max_tokens) return "more rows than max_tokens";
    /* positions past the context: kv_begin answers CONTEXT_FULL */
    if ((uint64_t)sh->rows * sh->cols * 4 + 64 > WIRE_MAX_PAYLOAD) return "the reply would exceed the frame limit";
    *status = KVS_ERR_INVALID_ARG;
    if (sh->tokens_in)
        for (uint32_t i = 0; i < f->n_tokens; i++) {
            int32_t t = wire_forward_token(f, i);
            if (t < 0 || (uint32_t)t >= m->hp.n_vocab) return "token id outside the vocabulary";
        }
    return NULL;
}

/* A job's buffers for f: its input rows, its output, the chunk scratch, the penalty window and
 * the relay hops. NULL when out of memory (nothing left allocated). */
static srv_job *forward_job_alloc(const model *m, const struct wire_forward *f, const fwd_shape *sh) {
    srv_job *j = calloc(1, sizeof(*j));
    if (!j) return NULL;
    size_t d = m->hp.n_embd;
    if (sh->tokens_in) {
        j->tokens = malloc((size_t)f->n_tokens * sizeof(int32_t));
        if (j->tokens)
            for (uint32_t i = 0; i < f->n_tokens; i++) j->tokens[i] = wire_forward_token(f, i);
    } else {
        j->hidden = malloc((size_t)f->n_tokens * d * sizeof(float));
        if (j->hidden && wire_forward_hidden_to_f32(f, j->hidden) != KVS_OK) {
            free(j->hidden);
            j->hidden = NULL;
        }
    }
    j->out = malloc((size_t)sh->rows * sh->cols * sizeof(float));
    bool chunked_last = sh->local_mode == WIRE_OUT_LOGITS_LAST && f->n_tokens > 1;
    if (chunked_last) j->scratch = malloc((size_t)f->n_tokens * d * sizeof(float));
    bool extra_ok = true;
    if (f->out_mode == WIRE_OUT_SAMPLE && f->sample.n_window) {
        j->window = malloc((size_t)f->sample.n_window * sizeof(int32_t));
        extra_ok = j->window != NULL;
        for (uint32_t i = 0; extra_ok && i < f->sample.n_window; i++)
            j->window[i] = (int32_t)kvs_rd_u32((const uint8_t *)f->sample.window + 4 * (size_t)i);
    }
    if ((f->flags & WIRE_FWD_PREFIX) && extra_ok) {
        uint64_t *h = malloc((size_t)f->prefix.n_hashes * sizeof(uint64_t));
        for (uint32_t i = 0; h && i < f->prefix.n_hashes; i++) h[i] = wire_prefix_hash(&f->prefix, i);
        j->prefix = (kv_prefix){.hashes = h, .first = f->prefix.first, .n = h ? f->prefix.n_hashes : 0};
        extra_ok = h != NULL;
    }
    if (sh->pushes && extra_ok) {
        j->relay = malloc(sizeof(*j->relay));
        if (j->relay) *j->relay = f->relay;
        extra_ok = j->relay != NULL;
    }
    if ((!j->tokens && !j->hidden) || !j->out || !extra_ok || (chunked_last && !j->scratch)) {
        srv_job_free(j);
        return NULL;
    }
    return j;
}

/* Fills a new job's request fields from f; conn is the connection that answers it. */
static void forward_job_fill(srv_job *j, srv_conn *conn, uint64_t rid, const struct wire_forward *f,
                             const fwd_shape *sh) {
    j->conn = conn;
    j->op = WIRE_OP_FORWARD;
    j->sample = f->out_mode == WIRE_OUT_SAMPLE && !sh->pushes;
    j->sq = f->sample;
    j->sq.window = NULL;
    j->wire_out_mode = f->out_mode;
    j->request_id = rid;
    /* A relayed step acts on the session of the client that registered relay_id: keyed by that
     * connection's identity, as its client-driven steps are (docs/protocol.md §4.3.2). */
    srv_conn_sid(j->conn, f->session_id, &j->sid);
    memcpy(j->wire_sid, f->session_id, WIRE_SID_SIZE);
    j->epoch = f->epoch;
    j->start_pos = f->start_pos;
    j->n = f->n_tokens;
    j->inherit = (f->flags & WIRE_FWD_INHERIT) != 0;
    j->inh.old_epoch = f->inherit_epoch;
    j->inh.len = f->inherit_len;
    j->reply_f16 = f->in_kind == WIRE_IN_HIDDEN_F16;
    j->reply_bf16 = f->in_kind == WIRE_IN_HIDDEN_BF16;
    j->out_mode = sh->local_mode == WIRE_OUT_HIDDEN       ? FWD_OUT_HIDDEN
                  : sh->local_mode == WIRE_OUT_LOGITS_ALL ? FWD_OUT_LOGITS_ALL
                                                          : FWD_OUT_LOGITS_LAST;
    j->out_rows = sh->rows;
    j->out_cols = sh->cols;
    j->state = JOB_QUEUED;
    atomic_init(&j->cancel, false);
}

/* FORWARD: decoded and checked here (a refusal is answered at once), then queued as a job for
 * the scheduler. A relayed step is answered on the connection its client registered
 * (RELAY_LISTEN), whose reference the job holds. Always KVS_OK: errors are replies. */
int srv_handle_forward(srv_conn *c, uint64_t rid, const uint8_t *payload, size_t len) {
    srv *s = c->s;
    struct wire_forward f;
    char msg[KVS_MSG_MAX] = "";
    if (wire_decode_forward(payload, len, &f, msg, sizeof(msg))) {
        srv_count_protocol_error(s);
        srv_send_status(c, rid, KVS_ERR_PROTOCOL, NULL, msg);
        return KVS_OK;
    }
    fwd_shape sh = forward_shape(s->e->m, &f);
    srv_conn *target = sh.relayed ? relay_listen_take(s->relay, f.relay.relay_id, srv_conn_ref) : NULL;
    srv_conn *answer = target ? target : c;
    int status = KVS_OK;
    const char *why = forward_refusal(c, &f, &sh, &status);
    if (!why && atomic_load(&s->draining)) { /* srv_stop's drain: the client moves to a spare */
        status = KVS_ERR_CLOSED;
        why = "the shard is shutting down";
    }
    if (!why && sh.relayed && !target) {
        /* Nobody registered the id: computing it under the pushing peer's identity would let a
         * client spend that peer's quota here (issue 42 item 13). */
        status = KVS_ERR_NOT_FOUND;
        why = "no RELAY_LISTEN registration for this relay_id";
    }
    if (!why && atomic_load(&answer->inflight) >= s->p.max_inflight) {
        status = KVS_ERR_BUSY;
        why = "too many requests in flight on this connection";
        pthread_mutex_lock(&s->mu);
        s->c_busy_inflight++;
        pthread_mutex_unlock(&s->mu);
    }
    srv_job *j = why ? NULL : forward_job_alloc(s->e->m, &f, &sh);
    if (!why && !j) {
        status = KVS_ERR_NOMEM;
        why = "out of memory";
    }
    if (why) {
        struct wire_forward_reply bad;
        memset(&bad, 0, sizeof(bad));
        bad.st.status = status;
        uint8_t buf[64];
        size_t l = 0;
        if (wire_encode_forward_reply(&bad, buf, sizeof(buf), &l) == KVS_OK)
            srv_conn_send(answer, WIRE_OP_FORWARD_REPLY, rid, buf, l);
        if (target) srv_conn_unref(target);
        return KVS_OK;
    }
    forward_job_fill(j, answer, rid, &f, &sh); /* a relayed job holds the ref taken with its target */
    if (!target) srv_conn_ref(c);
    atomic_fetch_add(&j->conn->inflight, 1);
    pthread_mutex_lock(&s->mu);
    srv_jobs_append(s, j);
    s->c_requests++;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return KVS_OK;
}

void srv_handle_stats(srv_conn *c, uint64_t rid) {
    struct wire_stats_reply *m = calloc(1, sizeof(*m));
    if (!m) return;
    srv_stats(c->s, m);
    uint8_t *buf = malloc(8192);
    size_t len = 0;
    if (buf && wire_encode_stats_reply(m, buf, 8192, &len) == KVS_OK) srv_conn_send(c, WIRE_OP_STATS_REPLY, rid, buf, len);
    free(buf);
    free(m);
}

void srv_handle_vocab(srv_conn *c, uint64_t rid, const struct wire_vocab *q) {
    srv *s = c->s;
    const tok_vocab *v = s->e->vocab;
    struct wire_vocab_reply r;
    memset(&r, 0, sizeof(r));
    if (!v || s->e->m->first != 0) { /* only the head shard (layer 0, token ids in) answers */
        r.st.status = KVS_ERR_UNSUPPORTED;
    } else if (q->first >= (uint32_t)tok_n_vocab(v)) {
        r.st.status = KVS_ERR_INVALID_ARG;
    }
    if (r.st.status) {
        uint8_t buf[64];
        size_t len = 0;
        if (wire_encode_vocab_reply(&r, buf, sizeof(buf), &len) == KVS_OK) srv_conn_send(c, WIRE_OP_VOCAB_REPLY, rid, buf, len);
        return;
    }
    uint32_t nv = (uint32_t)tok_n_vocab(v), count = nv - q->first;
    if (count > q->max_count) count = q->max_count;
    if (count > 8192) count = 8192; /* keeps a page well under the frame limit */
    struct wire_vocab_token *toks = calloc(count, sizeof(*toks));
    if (!toks) return;
    for (uint32_t i = 0; i < count; i++) {
        size_t l = 0;
        toks[i].text = tok_token_text(v, (int32_t)(q->first + i), &l);
        toks[i].text_len = (uint32_t)l;
        toks[i].score = tok_token_score(v, (int32_t)(q->first + i));
        toks[i].type = tok_token_type(v, (int32_t)(q->first + i));
    }
    r.n_vocab = nv;
    r.first = q->first;
    r.count = count;
    r.bos = tok_bos(v);
    r.eos = tok_eos(v);
    r.add_space_prefix = tok_add_space_prefix(v);
    const char *model_name = tok_vocab_kind(v) == TOK_KIND_BPE ? "gpt2" : "llama";
    r.tok_model_len = (uint8_t)strlen(model_name);
    memcpy(r.tok_model, model_name, r.tok_model_len);
    r.tokens = toks;
    size_t len = 0;
    uint8_t *buf = NULL;
    int err = wire_encode_vocab_reply(&r, NULL, 0, &len);
    if (!err && (buf = malloc(len))) err = wire_encode_vocab_reply(&r, buf, len, &len);
    if (!err && buf) srv_conn_send(c, WIRE_OP_VOCAB_REPLY, rid, buf, len);
    free(buf);
    free(toks);
}

/* VOCAB_META: the BPE settings, the chat template (first page) and a page of merges. */
void srv_handle_vocab_meta(srv_conn *c, uint64_t rid, const struct wire_vocab_meta *q) {
    const tok_vocab *v = c->s->e->vocab;
    struct wire_vocab_meta_reply r;
    memset(&r, 0, sizeof(r));
    int32_t nm = v ? tok_n_merges(v) : 0;
    const char *tmpl = v ? tok_chat_template(v) : NULL;
    size_t tl = tmpl ? strlen(tmpl) : 0;
    if (!v) r.st.status = KVS_ERR_UNSUPPORTED;
    else if (q->first > (uint32_t)nm || tl > WIRE_MAX_TEMPLATE || strlen(tok_pre_name(v)) > WIRE_MAX_PRE)
        r.st.status = KVS_ERR_INVALID_ARG;
    uint32_t count = r.st.status ? 0 : (uint32_t)nm - q->first;
    if (count > q->max_count) count = q->max_count;
    if (count > (1u << 20)) count = 1u << 20; /* 8 MiB of ids per page */
    int32_t *ids = count ? malloc((size_t)count * 2 * sizeof(*ids)) : NULL;
    if (count && !ids) r.st.status = KVS_ERR_NOMEM;
    if (!r.st.status) {
        for (uint32_t i = 0; i < count; i++) tok_merge(v, (int32_t)(q->first + i), &ids[2 * i], &ids[2 * i + 1]);
        r.n_vocab = (uint32_t)tok_n_vocab(v);
        int8_t ab = tok_add_bos_setting(v);
        r.add_bos = ab > 0 ? 1 : ab < 0 ? 2 : 0;
        r.rstrip_specials = tok_rstrip_specials(v);
        r.pre_len = (uint8_t)strlen(tok_pre_name(v));
        memcpy(r.pre, tok_pre_name(v), r.pre_len);
        r.n_merges = (uint32_t)nm;
        r.first = q->first;
        r.count = count;
        r.template_len = q->first == 0 ? (uint32_t)tl : 0;
        r.chat_template = tmpl;
        r.merge_ids = ids;
    }
    size_t len = 0;
    uint8_t *buf = NULL;
    int err = wire_encode_vocab_meta_reply(&r, NULL, 0, &len);
    if (!err && (buf = malloc(len))) err = wire_encode_vocab_meta_reply(&r, buf, len, &len);
    if (!err && buf) srv_conn_send(c, WIRE_OP_VOCAB_META_REPLY, rid, buf, len);
    free(buf);
    free(ids);
}

/* TRUNCATE and RELEASE: decoded, then applied to the hot state at once — or, when a request of
 * this connection on the same session is still queued or running, queued behind it so that
 * operations on one session from one connection take effect in arrival order. Answered with
 * STATUS (PROTOCOL with the decoder's message when the payload does not decode). */
void srv_handle_truncate_release(srv_conn *c, const struct wire_header *h, const uint8_t *payload, size_t len) {
    char msg[KVS_MSG_MAX] = "";
    srv *s = c->s;
    kv_state *kv = s->e->kv;
    kv_sid sid;
    uint64_t epoch = 0;
    uint32_t keep = 0;
    kv_reply r = {0};
    int err;
    if (h->op == WIRE_OP_TRUNCATE) {
        struct wire_truncate t;
        if (!(err = wire_decode_truncate(payload, len, &t, msg, sizeof(msg)))) {
            srv_conn_sid(c, t.session_id, &sid);
            epoch = t.epoch;
            keep = t.len;
        }
    } else {
        struct wire_release t;
        if (!(err = wire_decode_release(payload, len, &t, msg, sizeof(msg)))) {
            srv_conn_sid(c, t.session_id, &sid);
            epoch = t.epoch;
        }
    }
    if (msg[0]) err = KVS_ERR_PROTOCOL; /* only the decoders write msg */
    if (!err) {
        srv_job *j = calloc(1, sizeof(*j));
        pthread_mutex_lock(&s->mu);
        bool behind = false;
        for (const srv_job *e = s->jobs; e && !behind; e = e->next) behind = e->conn == c && srv_same_sid(&e->sid, &sid);
        bool over = behind && atomic_load(&c->inflight) >= s->p.max_inflight; /* queued ones count too */
        if (over) {
            s->c_busy_inflight++;
            behind = false;
        }
        if (behind && j) {
            j->conn = c;
            j->op = h->op;
            j->request_id = h->request_id;
            j->sid = sid;
            j->epoch = epoch;
            j->truncate_len = keep;
            j->state = JOB_QUEUED;
            atomic_init(&j->cancel, false);
            atomic_fetch_add(&c->refs, 1);
            atomic_fetch_add(&c->inflight, 1);
            srv_jobs_append(s, j);
            pthread_cond_signal(&s->cv);
        }
        pthread_mutex_unlock(&s->mu);
        if (behind && j) return; /* the scheduler answers it */
        free(j);
        if (over) err = KVS_ERR_BUSY;
        else if (behind) err = KVS_ERR_NOMEM;
        else err = h->op == WIRE_OP_TRUNCATE ? kv_truncate(kv, &sid, epoch, keep, &r) : kv_release(kv, &sid, epoch, &r);
    }
    srv_send_status(c, h->request_id, err, &r, msg[0] ? msg : NULL);
}
