/* route_relay — relayed steps: RELAY_LISTEN, one FORWARD to the head, the tail's answer. */
#include "route.h"

#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <string.h>

#include "route_impl.h"
#include "util.h"

/* Sends RELAY_LISTEN on hop k unless it is listening already (I7). */
static int hop_listen(route *r, uint32_t k, char *why, size_t why_cap) {
    route_hop *h = &r->hops[k];
    if (h->listening) return KVS_OK;
    struct wire_relay_listen m = {.relay_id = r->relay_id};
    size_t len = 0;
    int rc;
    if ((rc = route_tx_reserve(r, 8)) != KVS_OK ||
        (rc = wire_encode_relay_listen(&m, r->tx, r->tx_cap, &len)) != KVS_OK ||
        (rc = route_hop_call(r, h, WIRE_OP_RELAY_LISTEN, len, WIRE_OP_STATUS, why, why_cap)) != KVS_OK)
        return rc;
    struct wire_status_reply sr;
    char dmsg[KVS_MSG_MAX];
    if ((rc = wire_decode_status_reply(r->rx.data, r->rx.len, &sr, dmsg, sizeof dmsg)) != KVS_OK)
        return kvs_fail(why, why_cap, rc, "bad STATUS: %s", dmsg);
    if (sr.st.status != KVS_OK)
        return kvs_fail(why, why_cap, sr.st.status, "RELAY_LISTEN refused: %s", kvs_strerror(sr.st.status));
    h->listening = true;
    return KVS_OK;
}

/* Can the step [base, end) be relayed (route.h design note 7)? */
bool route_relay_possible(const route *r, const route_session *s, uint32_t base, uint32_t end) {
    if (!s->opts->relay || r->n_hops < 2 || end - base > r->max_rows || r->n_hops - 1 > WIRE_MAX_RELAY_HOPS)
        return false;
    for (uint32_t k = 0; k < r->n_hops; k++) {
        const route_hop *h = &r->hops[k];
        if (h->fd < 0 || h->info.version < 2 || strlen(h->addr.text) > WIRE_MAX_ADDR) return false;
        /* Shards push only to numeric next hops (relay.h design note 5): a named hop is driven. */
        uint8_t ip[16];
        if (inet_pton(AF_INET, h->addr.host, ip) != 1 && inet_pton(AF_INET6, h->addr.host, ip) != 1) return false;
        if (s->hop_epoch[k] == 0 && base > 0) return false; /* needs a replay: client-driven */
    }
    return true;
}

/* Waits for the frame answering request rid on any hop's connection (relayed steps are answered
 * by whichever shard ends the chain). KVS_OK with the frame in r->rx, its op in *op and the hop
 * it came from in *from; frames of other requests (late answers to earlier attempts) are
 * dropped. A connection that fails is closed (hop fd -1) and its error returned with *from set;
 * KVS_ERR_TIMEOUT when nothing came within timeout_ms. */
static int relay_wait(route *r, uint64_t rid, uint16_t *op, uint32_t *from, char *why, size_t why_cap) {
    uint64_t deadline = netio_deadline_ms(r->p.timeout_ms);
    struct pollfd pf[ROUTE_MAX_HOPS];
    for (;;) {
        uint32_t np = 0;
        for (uint32_t k = 0; k < r->n_hops; k++) pf[np++] = (struct pollfd){.fd = r->hops[k].fd, .events = POLLIN};
        int wait_ms = -1;
        bool pending[ROUTE_MAX_HOPS] = {false}; /* bytes already decrypted in a TLS session */
        for (uint32_t k = 0; k < np; k++) {
            tls_conn *t = pf[k].fd >= 0 ? tls_conn_of(pf[k].fd) : NULL;
            if (t && tls_conn_pending(t)) pending[k] = true, wait_ms = 0;
        }
        if (wait_ms != 0 && deadline != NETIO_NO_DEADLINE) {
            uint64_t now = kvs_now_ns();
            if (now >= deadline)
                return kvs_fail(why, why_cap, KVS_ERR_TIMEOUT, "no answer to the relayed step within %lld ms",
                                (long long)r->p.timeout_ms);
            wait_ms = (int)((deadline - now) / 1000000u) + 1;
        }
        int got = poll(pf, np, wait_ms);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) return kvs_fail(why, why_cap, KVS_ERR_IO, "poll: %s", strerror(errno));
        for (uint32_t k = 0; k < np; k++) {
            if (pf[k].fd < 0 || !(pending[k] || (pf[k].revents & (POLLIN | POLLHUP | POLLERR)))) continue;
            struct wire_header hdr;
            char nmsg[KVS_MSG_MAX] = "";
            netio_recv_opts ro = {.idle_deadline_ns = deadline, .frame_timeout_ms = -1,
                                  .max_payload = route_reply_limit(r, WIRE_OP_FORWARD_REPLY)};
            int rc = netio_recv_frame_opt(r->hops[k].fd, &hdr, &r->rx, &ro, nmsg, sizeof nmsg);
            if (rc != KVS_OK) {
                route_hop_disconnect(&r->hops[k]);
                *from = k;
                return kvs_fail(why, why_cap, rc, "hop %u (%s): %s", k, r->hops[k].addr.text,
                                nmsg[0] ? nmsg : kvs_strerror(rc));
            }
            r->bytes_received += WIRE_HEADER_SIZE + r->rx.len;
            if (hdr.request_id != rid && deadline != NETIO_NO_DEADLINE && kvs_now_ns() >= deadline)
                return kvs_fail(why, why_cap, KVS_ERR_TIMEOUT, "no answer to the relayed step within %lld ms",
                                (long long)r->p.timeout_ms); /* stale frames must not outlast it */
            if (hdr.request_id != rid) continue;
            *op = hdr.op;
            *from = k;
            return KVS_OK;
        }
    }
}

/* The relayed FORWARD of the step [base, end) into r->fwd: the tokens for hop 0, the rest of
 * the route in the relay block, INHERIT for each hop that holds the session in an older epoch. */
static int relay_fill_forward(route *r, const route_session *s, uint32_t base, uint32_t end) {
    struct wire_forward *f = r->fwd;
    memset(f, 0, sizeof *f);
    memcpy(f->session_id, s->sid, WIRE_SID_SIZE);
    f->epoch = s->epoch;
    f->start_pos = base;
    f->n_tokens = end - base;
    f->flags = WIRE_FWD_RELAY;
    f->out_mode = s->opts->sample ? WIRE_OUT_SAMPLE : WIRE_OUT_LOGITS_LAST;
    f->in_kind = WIRE_IN_TOKENS;
    f->data = s->tokens + base;
    if (s->opts->sample) route_fill_sample(s->opts, &f->sample);
    f->relay.relay_id = r->relay_id;
    f->relay.hop = 0;
    f->relay.hidden_kind = (uint16_t)r->hid_kind;
    f->relay.n_next = (uint16_t)(r->n_hops - 1);
    for (uint32_t k = 0; k < r->n_hops; k++) {
        bool inherit = s->hop_epoch[k] != 0 && s->hop_epoch[k] < s->epoch && base > 0;
        if (k == 0) {
            if (inherit) {
                f->flags |= WIRE_FWD_INHERIT;
                f->inherit_epoch = s->hop_epoch[0];
                f->inherit_len = base;
            }
            continue;
        }
        struct wire_relay_hop *nx = &f->relay.next[k - 1];
        nx->addr_len = (uint8_t)strlen(r->hops[k].addr.text);
        memcpy(nx->addr, r->hops[k].addr.text, nx->addr_len);
        if (inherit) {
            nx->flags = WIRE_FWD_INHERIT;
            nx->inherit_epoch = s->hop_epoch[k];
            nx->inherit_len = base;
        }
    }
    bool from_zero = false; /* I8: from block 0 when a hop may not hold the session */
    for (uint32_t k = 0; k < r->n_hops; k++) from_zero |= s->hop_epoch[k] != s->epoch;
    return route_fill_prefix(r, s, base, end, from_zero, f);
}

/* The answer (op, in r->rx) that hop k gave to the relayed step ending at `end`: true when it is
 * the tail's result, stored in logits_last / s->res; false with why otherwise. */
static bool relay_take_answer(route *r, route_session *s, uint32_t end, uint16_t op, uint32_t k, float *logits_last,
                              int *moved_hop, char *why, size_t why_cap) {
    char dmsg[KVS_MSG_MAX] = "";
    if (op == WIRE_OP_STATUS) { /* a shard could not push on (relay.h design note 2), or MOVED */
        struct wire_status_reply sr;
        if (wire_decode_status_reply(r->rx.data, r->rx.len, &sr, dmsg, sizeof dmsg) != KVS_OK) {
            kvs_fail(why, why_cap, KVS_ERR_PROTOCOL, "hop %u (%s): bad STATUS: %s", k, r->hops[k].addr.text, dmsg);
        } else if (sr.st.status == KVS_ERR_MOVED) {
            *moved_hop = (int)k;
            kvs_fail(why, why_cap, KVS_ERR_MOVED, "%s", sr.msg); /* the new address */
        } else {
            kvs_fail(why, why_cap, sr.st.status, "hop %u (%s) answered %s%s%s", k, r->hops[k].addr.text,
                     kvs_strerror(sr.st.status), sr.msg[0] ? ": " : "", sr.msg);
        }
        return false;
    }
    struct wire_forward_reply rep;
    if (op != WIRE_OP_FORWARD_REPLY ||
        wire_decode_forward_reply(r->rx.data, r->rx.len, &rep, dmsg, sizeof dmsg) != KVS_OK) {
        kvs_fail(why, why_cap, KVS_ERR_PROTOCOL, "hop %u (%s): unexpected %s answer: %s", k, r->hops[k].addr.text,
                 wire_op_name(op), dmsg);
        return false;
    }
    if (rep.st.status != KVS_OK) {
        kvs_fail(why, why_cap, rep.st.status, "hop %u (%s) answered %s (have %u, live epoch %llu)", k,
                 r->hops[k].addr.text, kvs_strerror(rep.st.status), rep.st.have,
                 (unsigned long long)rep.st.live_epoch);
        return false;
    }
    const bool sample = s->opts->sample;
    bool shape_ok = k + 1 == r->n_hops && rep.st.n_past == end &&
                    (sample ? rep.out_kind == WIRE_OUTK_SAMPLE && rep.n_cols == s->opts->n_top
                            : rep.out_kind == WIRE_OUTK_LOGITS_F32 && rep.n_rows == 1 && rep.n_cols == r->n_vocab);
    if (!shape_ok) {
        kvs_fail(why, why_cap, KVS_ERR_PROTOCOL, "hop %u (%s): relayed step answered out_kind %u, %u x %u, n_past %u",
                 k, r->hops[k].addr.text, rep.out_kind, rep.n_rows, rep.n_cols, rep.st.n_past);
        return false;
    }
    if (sample) route_reply_to_sample(&rep, s->res);
    else wire_forward_reply_to_f32(&rep, logits_last);
    return true;
}

/* One relayed attempt of the step [base, end) (route.h design note 7). True when it completed:
 * the result is in logits_last / s->res and every hop holds the step in s->epoch. False: redo it
 * client-driven (why says what happened; a lost hop is left disconnected for that redo). */
bool route_relay_step(route *r, route_session *s, uint32_t base, uint32_t end, float *logits_last, int *moved_hop,
                      char *why, size_t why_cap) {
    *moved_hop = -1;
    for (uint32_t k = 0; k < r->n_hops; k++)
        if (hop_listen(r, k, why, why_cap) != KVS_OK) return false;
    size_t len = 0;
    int rc;
    if ((rc = relay_fill_forward(r, s, base, end)) != KVS_OK || (rc = wire_encode_forward(r->fwd, NULL, 0, &len)) != KVS_OK || (rc = route_tx_reserve(r, len)) != KVS_OK ||
        (rc = wire_encode_forward(r->fwd, r->tx, r->tx_cap, &len)) != KVS_OK) {
        kvs_fail(why, why_cap, rc, "cannot encode the relayed FORWARD: %s", kvs_strerror(rc));
        return false;
    }
    route_hop *h0 = &r->hops[0];
    uint64_t rid = ++r->next_rid;
    rc = netio_send_frame(h0->fd, WIRE_OP_FORWARD, rid, r->tx, len, netio_deadline_ms(r->p.timeout_ms));
    r->bytes_sent += WIRE_HEADER_SIZE + len;
    if (rc != KVS_OK) {
        route_hop_disconnect(h0);
        kvs_fail(why, why_cap, rc, "hop 0 (%s): sending FORWARD: %s", h0->addr.text, kvs_strerror(rc));
        return false;
    }
    uint16_t op = 0;
    uint32_t k = 0;
    if (relay_wait(r, rid, &op, &k, why, why_cap) != KVS_OK) return false;
    if (!relay_take_answer(r, s, end, op, k, logits_last, moved_hop, why, why_cap)) return false;
    for (uint32_t j = 0; j < r->n_hops; j++) s->hop_epoch[j] = s->epoch;
    return true;
}
