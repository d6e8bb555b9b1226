/* route_step — the client-driven step: per-hop requests, replay, backoff, failover. */
#include "route.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "route_impl.h"
#include "util.h"

/* ---- driving ------------------------------------------------------------------ */

/* The sampler block of a SAMPLE request; the window goes only when a penalty uses it. */
void route_fill_sample(const route_step_opts *o, struct wire_sample_req *q) {
    const sampler_params *p = &o->sp;
    *q = (struct wire_sample_req){.temp = p->temp, .top_p = p->top_p, .min_p = p->min_p,
                                  .repeat_penalty = p->repeat_penalty, .presence_penalty = p->presence_penalty,
                                  .top_k = p->top_k > 0 ? (uint32_t)p->top_k : 0, .seed = p->seed, .n_top = o->n_top};
    if (q->top_p > 1.0f) q->top_p = 1.0f;
    bool penalties = (p->repeat_penalty > 0.0f && p->repeat_penalty != 1.0f) || p->presence_penalty != 0.0f;
    if (penalties && o->n_window) {
        q->n_window = o->n_window;
        q->window = o->window;
    }
}

/* A decoded SAMPLE reply into *res. */
void route_reply_to_sample(const struct wire_forward_reply *rep, sampler_result *res) {
    int32_t ids[WIRE_MAX_TOP];
    float lp[WIRE_MAX_TOP];
    memset(res, 0, sizeof *res);
    wire_forward_reply_sample(rep, &res->id, &res->logprob, ids, lp);
    res->n_top = rep->n_cols;
    for (uint32_t i = 0; i < rep->n_cols; i++) {
        res->top[i].id = ids[i];
        res->top[i].logprob = lp[i];
    }
}

bool route_prefix_ok(const route *r) {
    for (uint32_t k = 0; k < r->n_hops; k++)
        if (r->hops[k].info.version < 3) return false;
    return true;
}

int route_fill_prefix(route *r, const route_session *s, uint32_t from, uint32_t to, bool from_zero,
                      struct wire_forward *f) {
    const uint32_t first = from_zero ? 0 : from / WIRE_PREFIX_TOKENS, end = to / WIRE_PREFIX_TOKENS;
    if (!route_prefix_ok(r) || end <= first) return KVS_OK;
    if (end > r->hashes_cap) {
        uint64_t *h = realloc(r->hashes, (size_t)end * sizeof *h);
        if (!h) return KVS_ERR_NOMEM;
        r->hashes = h;
        r->hashes_cap = end;
    }
    /* the chain from block 0 (the tokens may have changed: rewind); a public prefix's blocks
     * unsalted, the salt mixed in right after them */
    uint64_t prev = s->public_blocks ? 0 : s->prefix_salt;
    for (uint32_t i = 0; i < end; i++) {
        if (i > 0 && i == s->public_blocks) prev ^= s->prefix_salt;
        r->hashes[i] = prev = wire_chain_hash(prev, s->tokens + (size_t)i * WIRE_PREFIX_TOKENS, WIRE_PREFIX_TOKENS);
    }
    f->flags |= WIRE_FWD_PREFIX;
    f->prefix = (struct wire_prefix){.first = first, .n_hashes = end - first, .hashes = r->hashes + first};
    return KVS_OK;
}

/* Encodes into r->tx the FORWARD of rows [from, to) to hop k: token ids for hop 0, remembered
 * hidden rows for the others, INHERIT for a hop that holds the session in an older epoch (I3). */
static int hop_encode(route *r, const route_session *s, uint32_t k, uint32_t from, uint32_t to, size_t *len) {
    const bool last = k + 1 == r->n_hops;
    const bool sample = last && s->opts->sample;
    const uint32_t n = to - from;
    struct wire_forward f = {.epoch = s->epoch, .start_pos = from, .n_tokens = n,
                             .out_mode = !last ? WIRE_OUT_HIDDEN : sample ? WIRE_OUT_SAMPLE : WIRE_OUT_LOGITS_LAST};
    memcpy(f.session_id, s->sid, WIRE_SID_SIZE);
    if (s->hop_epoch[k] != 0 && s->hop_epoch[k] < s->epoch && from > 0) {
        f.flags = WIRE_FWD_INHERIT;
        f.inherit_epoch = s->hop_epoch[k];
        f.inherit_len = from;
    }
    if (sample) route_fill_sample(s->opts, &f.sample);
    size_t bytes;
    if (k == 0) {
        f.in_kind = WIRE_IN_TOKENS;
        f.data = s->tokens + from;
        bytes = FWD_HEAD_BYTES + (size_t)n * 4;
    } else {
        f.in_kind = r->hid_kind;
        f.n_embd = r->n_embd;
        f.data = s->hidden[k] + (size_t)from * r->n_embd * r->hid_elem;
        bytes = FWD_HEAD_BYTES + (size_t)n * r->n_embd * r->hid_elem;
    }
    /* I8: the hashes of the blocks this request completes; from block 0 to a hop that may not
     * hold the session, so that it can take them from its prefix cache. */
    int rc = route_fill_prefix(r, s, from, to, s->hop_epoch[k] != s->epoch, &f);
    *len = 0;
    if (rc == KVS_OK && (rc = wire_encode_forward(&f, NULL, 0, len)) == KVS_OK &&
        (rc = route_tx_reserve(r, *len > bytes ? *len : bytes)) == KVS_OK)
        rc = wire_encode_forward(&f, r->tx, r->tx_cap, len);
    return rc;
}

/* The out_kind of hidden rows in the route's dtype. In f16 / bf16 mode the head answers token
 * input in f32 (rounded here, once); the others in the route's dtype. */
static uint32_t route_half_outk(const route *r) {
    return r->hid_kind == WIRE_IN_HIDDEN_F16    ? WIRE_OUTK_HIDDEN_F16
           : r->hid_kind == WIRE_IN_HIDDEN_BF16 ? WIRE_OUTK_HIDDEN_BF16
                                                : WIRE_OUTK_HIDDEN_F32;
}

/* Stores the output of hop k's OK reply to rows [from, to), shape checked: the sample into
 * s->res, else to out (hidden rows [out_from, to) for hop k+1 in the route's dtype, or the
 * logits row); out NULL: discarded. */
static void hop_store(const route *r, route_session *s, uint32_t k, uint32_t from, uint32_t to, uint32_t out_from,
                      void *out, struct wire_forward_reply *rep) {
    const bool last = k + 1 == r->n_hops;
    if (last && s->opts->sample) {
        route_reply_to_sample(rep, s->res);
        return;
    }
    if (!out) return;
    if (!last && out_from > from) { /* only the rows the caller asked for */
        rep->n_rows = to - out_from;
        rep->data = (const uint8_t *)rep->data +
                    (size_t)(out_from - from) * r->n_embd * (rep->out_kind == WIRE_OUTK_HIDDEN_F32 ? 4 : 2);
    }
    if (!last && r->hid_elem == 2) { /* kept as f16/bf16: what the next hop is sent, and replayed, exactly */
        const uint8_t *src = rep->data;
        uint16_t *dst = out;
        size_t count = (size_t)rep->n_rows * rep->n_cols;
        if (rep->out_kind == route_half_outk(r)) {
            for (size_t i = 0; i < count; i++) dst[i] = kvs_rd_u16(src + 2 * i);
        } else if (r->hid_kind == WIRE_IN_HIDDEN_F16) {
            for (size_t i = 0; i < count; i++) dst[i] = wire_f32_to_f16(kvs_rd_f32(src + 4 * i));
        } else {
            for (size_t i = 0; i < count; i++) dst[i] = wire_f32_to_bf16(kvs_rd_f32(src + 4 * i));
        }
    } else {
        wire_forward_reply_to_f32(rep, out);
    }
}

/* One FORWARD of rows [from, to) to hop k. On HOP_OK *st is the shard's status block; when it is
 * OK the output went to out (hop_store) and hop_epoch[k] is the session epoch. HOP_FAILED:
 * transport failure or a reply of the wrong shape, why says what; the hop is disconnected.
 * HOP_FATAL: the request could not be encoded; *rc and why say why. */
static enum hop_result hop_send(route *r, route_session *s, uint32_t k, uint32_t from, uint32_t to,
                                uint32_t out_from, void *out, struct wire_status *st, int *rc, char *why,
                                size_t why_cap) {
    route_hop *h = &r->hops[k];
    const bool last = k + 1 == r->n_hops;
    const bool sample = last && s->opts->sample;
    size_t len = 0;
    if ((*rc = hop_encode(r, s, k, from, to, &len)) != KVS_OK) {
        kvs_fail(why, why_cap, *rc, "cannot encode FORWARD [%u, %u): %s", from, to, kvs_strerror(*rc));
        return HOP_FATAL;
    }
    *rc = route_hop_call(r, h, WIRE_OP_FORWARD, len, WIRE_OP_FORWARD_REPLY, why, why_cap);
    if (*rc != KVS_OK) return HOP_FAILED;
    struct wire_forward_reply rep;
    char dmsg[KVS_MSG_MAX] = "";
    if (wire_decode_forward_reply(r->rx.data, r->rx.len, &rep, dmsg, sizeof dmsg) != KVS_OK) {
        route_hop_disconnect(h);
        *rc = kvs_fail(why, why_cap, KVS_ERR_PROTOCOL, "bad FORWARD_REPLY: %s", dmsg);
        return HOP_FAILED;
    }
    *st = rep.st;
    if (rep.st.status != KVS_OK) return HOP_OK;
    const bool hid_ok = rep.out_kind == WIRE_OUTK_HIDDEN_F32 || rep.out_kind == route_half_outk(r);
    bool shape_ok = sample ? rep.out_kind == WIRE_OUTK_SAMPLE && rep.n_cols == s->opts->n_top
                    : last ? rep.out_kind == WIRE_OUTK_LOGITS_F32 && rep.n_rows == 1 && rep.n_cols == r->n_vocab
                           : hid_ok && rep.n_rows == to - from && rep.n_cols == r->n_embd;
    if (!shape_ok || rep.st.n_past != to) {
        const char *want = sample ? "a sample" : last ? "1 row of logits" : r->hid_elem == 2 ? "hidden f32 or half rows"
                                                                                             : "hidden f32 rows";
        route_hop_disconnect(h);
        *rc = kvs_fail(why, why_cap, KVS_ERR_PROTOCOL,
                       "FORWARD [%u, %u) answered out_kind %u, %u x %u, n_past %u (expected %s, n_past %u)", from, to,
                       rep.out_kind, rep.n_rows, rep.n_cols, rep.st.n_past, want, to);
        return HOP_FAILED;
    }
    hop_store(r, s, k, from, to, out_from, out, &rep);
    s->hop_epoch[k] = s->epoch;
    return HOP_OK;
}

static void sleep_ms(unsigned ms) {
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* Brings hop k to position a (replaying remembered inputs where it lacks them), then sends rows
 * [a, b) with output to out. A replay shares the request of rows [a, b) when everything fits in
 * one request, so a shard under memory pressure cannot evict the session between the two.
 * Handles CACHE_MISS (replay) and BUSY (backoff); any other status is HOP_FATAL with *rc = that
 * status. */
static enum hop_result hop_append(route *r, route_session *s, uint32_t k, uint32_t a, uint32_t b, void *out,
                                  int *rc, char *why, size_t why_cap) {
    route_hop *h = &r->hops[k];
    uint32_t from = s->hop_epoch[k] != 0 ? a : s->skip < a ? s->skip : a; /* I8: a new hop may hold [0, skip) */
    if (from < a) route_log(r, "hop %u (%s): replaying positions [0, %u)", k, h->addr.text, a);
    r->replayed += a - from;
    int misses = 0;
    unsigned backoff_ms = 5;
    uint64_t busy_until = 0;
    for (;;) {
        /* The last request ends at b and is as long as allowed; the ones before it replay only
         * (b - max_rows <= a because b - a <= max_rows). */
        uint32_t to = b - from <= r->max_rows ? b : from + r->max_rows < b - r->max_rows ? from + r->max_rows
                                                                                          : b - r->max_rows;
        struct wire_status st;
        enum hop_result res = hop_send(r, s, k, from, to, a, to == b ? out : NULL, &st, rc, why, why_cap);
        if (res != HOP_OK) return res;
        switch (st.status) {
        case KVS_OK:
            if (to == b) return HOP_OK;
            from = to;
            misses = 0;
            backoff_ms = 5;
            busy_until = 0;
            continue;
        case KVS_ERR_CACHE_MISS:
            /* I8: past the head, inputs that were never computed; at a new head, its answer
             * (nothing changed) says where the whole step should start. */
            if (st.have < from && st.have < s->skip && (k > 0 || (s->hop_epoch[0] == 0 && from == s->skip))) {
                s->short_have = st.have;
                return HOP_PREFIX_SHORT;
            }
            if (st.have >= from || ++misses > ROUTE_MAX_MISSES) {
                *rc = kvs_fail(why, why_cap, KVS_ERR_CACHE_MISS,
                               "answered CACHE_MISS(have %u) for start %u %s", st.have, from,
                               st.have >= from ? "(not a miss)" : "too many times in a row");
                return HOP_FATAL;
            }
            route_log(r, "hop %u (%s): cache miss at %u (holds %u): replaying [%u, %u)", k, h->addr.text, from,
                      st.have, st.have, a);
            r->replayed += from - st.have;
            from = st.have;
            continue;
        case KVS_ERR_BUSY:
            if (!busy_until) busy_until = netio_deadline_ms(r->p.timeout_ms);
            if (busy_until != NETIO_NO_DEADLINE && kvs_now_ns() >= busy_until) {
                *rc = kvs_fail(why, why_cap, KVS_ERR_BUSY, "still busy after %lld ms", (long long)r->p.timeout_ms);
                return HOP_FATAL;
            }
            sleep_ms(backoff_ms);
            if (backoff_ms < 500) backoff_ms *= 2;
            continue;
        case KVS_ERR_STALE_EPOCH:
            *rc = kvs_fail(why, why_cap, KVS_ERR_STALE_EPOCH,
                           "the session is driven elsewhere: the shard holds epoch %llu, this client %llu",
                           (unsigned long long)st.live_epoch, (unsigned long long)s->epoch);
            return HOP_FATAL;
        case KVS_ERR_CLOSED: /* the shard drains before it stops: re-route (a spare) like a lost hop */
            *rc = kvs_fail(why, why_cap, KVS_ERR_CLOSED, "FORWARD [%u, %u) refused: the shard is shutting down", from, to);
            return HOP_FAILED;
        default:
            *rc = kvs_fail(why, why_cap, st.status, "FORWARD [%u, %u) refused: %s", from, to,
                           kvs_strerror(st.status));
            return HOP_FATAL;
        }
    }
}

route_step_opts route_default_step_opts(void) {
    route_step_opts o;
    memset(&o, 0, sizeof o);
    o.sp = sampler_default_params();
    return o;
}

int route_forward(route *r, route_session *s, const int32_t *tokens, uint32_t n, float *logits_last, char *msg,
                  size_t msg_cap) {
    route_step_opts o = route_default_step_opts();
    return route_step(r, s, tokens, n, &o, logits_last, NULL, msg, msg_cap);
}

/* The arguments of route_step, and room in the route's context for n more positions. */
static int step_check(const route *r, const route_session *s, const int32_t *tokens, uint32_t n,
                      const route_step_opts *o, const float *logits_last, const sampler_result *res, char *msg,
                      size_t msg_cap) {
    if (!r || !s || !tokens || !o || s->r != r || (o->sample ? !res : !logits_last))
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "NULL argument or session of another route");
    if (n == 0) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "no tokens");
    if (o->sample && (o->n_top > WIRE_MAX_TOP || o->n_window > WIRE_MAX_WINDOW || (o->n_window && !o->window) ||
                      !sampler_params_valid(&o->sp)))
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "bad sampler options");
    if (o->sample && r->hops[r->n_hops - 1].info.version < 2)
        return kvs_fail(msg, msg_cap, KVS_ERR_UNSUPPORTED,
                        "hop %u (%s) speaks protocol version 1: it cannot sample (use logits)", r->n_hops - 1,
                        r->hops[r->n_hops - 1].addr.text);
    for (uint32_t i = 0; i < n; i++)
        if (tokens[i] < 0 || (uint32_t)tokens[i] >= r->n_vocab)
            return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "token %u: id %d outside the vocab (%u)", i,
                            (int)tokens[i], r->n_vocab);
    if ((uint64_t)s->pos + n > r->max_ctx)
        return kvs_fail(msg, msg_cap, KVS_ERR_CONTEXT_FULL, "%u + %u positions exceed the route's context of %u",
                        s->pos, n, r->max_ctx);
    return KVS_OK;
}

/* One client-driven attempt of the step [start, end): chunks of max_rows rows, each through
 * hop 0 .. n-1 (hop_append), the last hop's output of the last chunk to last_out. Not HOP_OK:
 * *k is the hop that failed, *rc and why say how. */
static enum hop_result step_attempt(route *r, route_session *s, uint32_t start, uint32_t end, void *last_out,
                                    uint32_t *k, int *rc, char *why, size_t why_cap) {
    for (uint32_t k0 = 0; k0 < r->n_hops; k0++) /* a hop lost during a relayed attempt */
        if (r->hops[k0].fd < 0) {
            *k = k0;
            *rc = kvs_fail(why, why_cap, KVS_ERR_CLOSED, "connection lost");
            return HOP_FAILED;
        }
    for (uint32_t a = start; a < end;) {
        uint32_t b = end - a > r->max_rows ? a + r->max_rows : end;
        for (*k = 0; *k < r->n_hops; (*k)++) {
            const uint32_t j = *k;
            void *out = j + 1 < r->n_hops ? (void *)(s->hidden[j + 1] + (size_t)a * r->n_embd * r->hid_elem)
                                          : (b == end ? last_out : (void *)r->scratch_logits);
            enum hop_result res = hop_append(r, s, j, a, b, out, rc, why, why_cap);
            if (res != HOP_OK) return res;
        }
        a = b;
    }
    return HOP_OK;
}

int route_step(route *r, route_session *s, const int32_t *tokens, uint32_t n, const route_step_opts *o,
               float *logits_last, sampler_result *res, char *msg, size_t msg_cap) {
    int rc = step_check(r, s, tokens, n, o, logits_last, res, msg, msg_cap);
    if (rc != KVS_OK) return rc;
    route_refresh_links(r); /* links the shards closed while the route sat idle */
    /* A link that could not be renewed is called again within the grace first, so that a shard
     * restarted with its sessions takes this step as any other (relayed, nothing recomputed). */
    bool graced = false; /* a hop already had its grace in this step: no second wait for it */
    for (uint32_t k = 0; k < r->n_hops; k++)
        if (r->hops[k].fd < 0 && !route_reconnect(r, k, "connection lost")) graced = true;
    const uint32_t base = s->pos;
    const uint32_t end = base + n;
    if (route_session_reserve(s, end) != KVS_OK)
        return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
    memcpy(s->tokens + base, tokens, (size_t)n * sizeof *tokens);
    s->opts = o;
    s->res = res;

    /* Hops replaced while another session was driving (I4). */
    bool replaced = false;
    for (uint32_t k = 0; k < r->n_hops; k++)
        if (s->hop_gen[k] != r->hop_gen[k]) {
            s->hop_gen[k] = r->hop_gen[k];
            s->hop_epoch[k] = 0;
            replaced = true;
        }
    if (replaced) s->epoch++;

    /* I8: a new session's first step is driven, so that each hop can start at the prefix it holds. */
    bool fresh = route_prefix_ok(r) && base == 0 && s->hidden_valid == 0 && end > WIRE_PREFIX_TOKENS;
    for (uint32_t k = 0; k < r->n_hops; k++) fresh = fresh && s->hop_epoch[k] == 0;
    for (int moves = 0; !fresh && route_relay_possible(r, s, base, end); moves++) {
        char why[KVS_MSG_MAX] = "";
        int moved_hop = -1;
        if (route_relay_step(r, s, base, end, logits_last, &moved_hop, why, sizeof why)) {
            r->relay_steps++;
            s->pos = end;
            return KVS_OK;
        }
        /* A drained hop: follow it and relay the step again (the hops before it take the same
         * positions once more, as a rewind; nothing is replayed) */
        if (moved_hop >= 0 && moves < ROUTE_MAX_RECONNECTS &&
            route_follow_move(r, (uint32_t)moved_hop, why, msg, msg_cap) == KVS_OK)
            continue;
        r->relay_fallbacks++;
        route_log(r, "relayed step [%u, %u) failed (%s): redoing it client-driven from position %u", base, end, why,
                  s->hidden_valid);
        break;
    }

    /* Client-driven from hidden_valid (I6): rows [hidden_valid, base) are re-sent from memory. */
    uint32_t start = s->hidden_valid;
    if (fresh) /* I8: the hops may hold the prompt's full blocks but the last position's */
        start = s->skip = (end - 1) / WIRE_PREFIX_TOKENS * WIRE_PREFIX_TOKENS;
    void *last_out = s->opts->sample ? r->scratch_logits : logits_last;
    bool reconnected[ROUTE_MAX_HOPS] = {false};
    int reconnects = graced ? ROUTE_MAX_RECONNECTS : 0;
    for (;;) { /* one attempt of the step per iteration; each failed attempt uses up a spare (or one of
                  a few reconnects) */
        uint32_t k = 0;
        char why[KVS_MSG_MAX] = "";
        if (fresh) s->cached = start;
        if (base > start) r->replayed += (uint64_t)(base - start) * r->n_hops; /* rows since hidden_valid go to every hop again */
        enum hop_result res_k = step_attempt(r, s, start, end, last_out, &k, &rc, why, sizeof why);
        if (res_k == HOP_PREFIX_SHORT) { /* I8: start at what hop k holds; past the head, in a new epoch */
            start = s->skip = s->short_have / WIRE_PREFIX_TOKENS * WIRE_PREFIX_TOKENS;
            if (k == 0) continue; /* the head answered first: no hop changed */
            route_log(r, "hop %u (%s) holds %u of the prefix: starting over from %u in a new epoch", k,
                      r->hops[k].addr.text, s->short_have, start);
            s->epoch++;
            for (uint32_t j = 0; j < r->n_hops; j++) s->hop_epoch[j] = 0;
            continue;
        }
        if (res_k == HOP_OK) {
            s->pos = end;
            s->hidden_valid = end;
            return KVS_OK;
        }
        if (res_k == HOP_FATAL)
            return kvs_fail(msg, msg_cap, rc, "hop %u (%s): %s", k, r->hops[k].addr.text, why);
        if (rc == KVS_ERR_MOVED && reconnects < ROUTE_MAX_RECONNECTS) {
            reconnects++;
            if ((rc = route_follow_move(r, k, why, msg, msg_cap)) != KVS_OK) return rc;
            continue;
        }
        /* A link the shard closed for idleness between route_refresh_links and this request
         * fails like a dead shard (closed or reset, not a timeout: a hung shard would only
         * cost a second one): try the same address once more before any spare. The session
         * lives on the shard by id; if the shard lost it, CACHE_MISS replays. */
        char why2[KVS_MSG_MAX] = "";
        if ((rc == KVS_ERR_CLOSED || rc == KVS_ERR_IO) && !reconnected[k]) {
            reconnected[k] = true;
            if (route_hop_reconnect(r, &r->hops[k], why2, sizeof why2) == KVS_OK) {
                route_log(r, "hop %u (%s): %s; reconnected, trying the step again", k, r->hops[k].addr.text, why);
                continue;
            }
        }
        /* A shard restarting (serve --state-dir) is called again for the grace, before any spare. */
        if (reconnects < ROUTE_MAX_RECONNECTS && route_reconnect(r, k, why)) {
            reconnects++;
            continue;
        }
        if ((rc = route_reroute(r, s, k, rc, why, msg, msg_cap)) != KVS_OK) return rc;
    }
}
