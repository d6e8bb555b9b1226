/* route — open and close a route, its limits and its shape (route_impl.h has the design). */
#include "route.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "route_impl.h"
#include "tls.h"
#include "util.h"

route_params route_default_params(void) {
    return (route_params){.timeout_ms = 30000, .auth = NULL, .log = NULL, .log_user = NULL, .hidden_f16 = false, .hidden_bf16 = false,
                          .max_replay_bytes = ROUTE_DEFAULT_REPLAY_BYTES};
}

/* ---- specs -------------------------------------------------------------- */

int route_parse_spec(const char *spec, route_addr **out, size_t *n, char *msg, size_t msg_cap) {
    if (!out || !n) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "out is NULL");
    *out = NULL;
    *n = 0;
    if (!spec) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "no route given");
    size_t count = 1;
    for (const char *c = spec; *c; c++) count += *c == ',';
    if (count > ROUTE_MAX_HOPS)
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "%zu entries in '%s' (at most %u)", count, spec,
                        ROUTE_MAX_HOPS);
    route_addr *a = calloc(count, sizeof *a);
    if (!a) return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
    size_t k = 0;
    for (const char *p = spec;; k++) {
        const char *end = strchr(p, ',');
        if (!end) end = p + strlen(p);
        while (p < end && (*p == ' ' || *p == '\t')) p++;
        const char *e = end;
        while (e > p && (e[-1] == ' ' || e[-1] == '\t')) e--;
        size_t len = (size_t)(e - p);
        if (len == 0 || len >= ROUTE_ADDR_MAX) {
            free(a);
            return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "entry %zu of '%s' is %s (want HOST:PORT)", k, spec,
                            len ? "too long" : "empty");
        }
        memcpy(a[k].text, p, len);
        a[k].text[len] = '\0';
        if (netio_parse_hostport(a[k].text, a[k].host, sizeof a[k].host, &a[k].port) != KVS_OK) {
            int rc = kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "'%s' is not HOST:PORT", a[k].text);
            free(a);
            return rc;
        }
        if (!*end) break;
        p = end + 1;
    }
    *out = a;
    *n = k + 1;
    return KVS_OK;
}

/* ---- validation --------------------------------------------------------- */

static void digest_hex(const uint8_t *d, char out[17]) {
    static const char hex[] = "0123456789abcdef";
    for (int i = 0; i < 8; i++) {
        out[2 * i] = hex[d[i] >> 4];
        out[2 * i + 1] = hex[d[i] & 15];
    }
    out[16] = '\0';
}

/* Same model and shape as ref? Else a message naming hop `what`. */
int route_check_same_model(const struct wire_info *ref, const char *ref_name, const struct wire_info *x,
                            const char *what, char *msg, size_t msg_cap) {
    if (memcmp(ref->model_digest, x->model_digest, WIRE_DIGEST_SIZE) != 0) {
        char a[17], b[17];
        digest_hex(x->model_digest, a);
        digest_hex(ref->model_digest, b);
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG,
                        "%s serves another model (digest %s... but %s has %s...)", what, a, ref_name, b);
    }
    if (x->n_layer != ref->n_layer || x->n_embd != ref->n_embd || x->n_vocab != ref->n_vocab)
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG,
                        "%s reports n_layer %u, n_embd %u, n_vocab %u but %s reports %u, %u, %u", what, x->n_layer,
                        x->n_embd, x->n_vocab, ref_name, ref->n_layer, ref->n_embd, ref->n_vocab);
    if (!(x->hidden_dtypes & WIRE_DTYPE_F32))
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "%s does not take f32 hidden states", what);
    return KVS_OK;
}

int route_check_hops(const struct wire_info *infos, const char *const *addrs, size_t n, char *msg,
                     size_t msg_cap) {
    if (!infos || !addrs || n == 0) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "empty route");
    char ref_name[ROUTE_ADDR_MAX + 16], what[ROUTE_ADDR_MAX + 16];
    snprintf(ref_name, sizeof ref_name, "hop 0 (%s)", addrs[0]);
    for (size_t k = 0; k < n; k++) {
        const struct wire_info *x = &infos[k];
        snprintf(what, sizeof what, "hop %zu (%s)", k, addrs[k]);
        int rc = route_check_same_model(&infos[0], ref_name, x, what, msg, msg_cap);
        if (rc != KVS_OK) return rc;
        if (x->first >= x->last || x->last > x->n_layer)
            return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "%s reports an invalid layer range [%u, %u) of %u",
                            what, x->first, x->last, x->n_layer);
        if (k == 0 && x->first != 0)
            return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG,
                            "%s serves layers [%u, %u) but a route must start at layer 0", what, x->first, x->last);
        if (k > 0 && x->first != infos[k - 1].last)
            return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG,
                            "%s serves layers [%u, %u) but the previous hop ends at %u", what, x->first, x->last,
                            infos[k - 1].last);
        if (k + 1 == n && x->last != x->n_layer)
            return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG,
                            "%s is the last hop and serves layers [%u, %u) but the model has %u layers", what,
                            x->first, x->last, x->n_layer);
    }
    return KVS_OK;
}

/* ---- one request on one connection --------------------------------------- */

void route_hop_disconnect(route_hop *h) {
    netio_close(h->fd);
    h->fd = -1;
    h->listening = false;
}

/* Makes room for `need` bytes in r->tx. */
int route_tx_reserve(route *r, size_t need) {
    if (need <= r->tx_cap) return KVS_OK;
    size_t cap = r->tx_cap ? r->tx_cap : 4096;
    while (cap < need) cap *= 2;
    uint8_t *b = realloc(r->tx, cap);
    if (!b) return KVS_ERR_NOMEM;
    r->tx = b;
    r->tx_cap = cap;
    return KVS_OK;
}

/* Largest payload a reply of op reply_op (or a STATUS in its place) may announce. */
uint32_t route_reply_limit(const route *r, uint16_t reply_op) {
    uint64_t lim = WIRE_MAX_PAYLOAD;
    if (reply_op == WIRE_OP_INFO) lim = ROUTE_MAX_SMALL_REPLY;
    if (reply_op == WIRE_OP_FORWARD_REPLY && r->n_embd) {
        uint64_t cols = r->n_vocab > r->n_embd ? r->n_vocab : r->n_embd;
        uint64_t rows = r->max_rows ? r->max_rows : WIRE_MAX_TOKENS;
        lim = FWD_REPLY_HEAD_BYTES + rows * cols * 4u;
    }
    if (lim < ROUTE_MAX_SMALL_REPLY) lim = ROUTE_MAX_SMALL_REPLY;
    return lim > WIRE_MAX_PAYLOAD ? WIRE_MAX_PAYLOAD : (uint32_t)lim;
}

/* Sends r->tx[0..len) as one `op` frame on h and waits for the reply frame; KVS_OK when a frame
 * with op reply_op and the same request id arrived (payload in r->rx). Any other outcome is a
 * transport failure (the connection is closed; why says what happened): the code from netio, or
 * KVS_ERR_PROTOCOL for an unexpected frame. A STATUS frame in place of the reply is reported
 * with the shard's message. */
int route_hop_call(route *r, route_hop *h, uint16_t op, size_t len, uint16_t reply_op, char *why, size_t why_cap) {
    if (h->fd < 0) return kvs_fail(why, why_cap, KVS_ERR_CLOSED, "not connected");
    uint64_t rid = ++r->next_rid;
    uint64_t deadline = netio_deadline_ms(r->p.timeout_ms);
    char nmsg[KVS_MSG_MAX] = "";
    int rc = netio_send_frame(h->fd, op, rid, r->tx, len, deadline);
    r->bytes_sent += WIRE_HEADER_SIZE + len;
    if (rc != KVS_OK) {
        route_hop_disconnect(h);
        return kvs_fail(why, why_cap, rc, "sending %s: %s", wire_op_name(op), kvs_strerror(rc));
    }
    struct wire_header hdr;
    netio_recv_opts ro = {.idle_deadline_ns = deadline, .frame_timeout_ms = -1,
                          .max_payload = route_reply_limit(r, reply_op)};
    /* Late answers to earlier requests (a relayed attempt that was given up) are dropped. */
    do {
        rc = netio_recv_frame_opt(h->fd, &hdr, &r->rx, &ro, nmsg, sizeof nmsg);
        if (rc == KVS_OK) r->bytes_received += WIRE_HEADER_SIZE + r->rx.len;
    } while (rc == KVS_OK && hdr.request_id < rid);
    if (rc != KVS_OK) {
        route_hop_disconnect(h);
        if (rc == KVS_ERR_TIMEOUT)
            return kvs_fail(why, why_cap, rc, "no reply to %s within %lld ms", wire_op_name(op),
                            (long long)r->p.timeout_ms);
        return kvs_fail(why, why_cap, rc, "waiting for the reply to %s: %s", wire_op_name(op),
                        nmsg[0] ? nmsg : kvs_strerror(rc));
    }
    if (hdr.request_id == rid && hdr.op == reply_op) return KVS_OK;
    if (hdr.request_id == rid && hdr.op == WIRE_OP_STATUS) {
        struct wire_status_reply sr;
        if (wire_decode_status_reply(r->rx.data, r->rx.len, &sr, nmsg, sizeof nmsg) == KVS_OK) {
            route_hop_disconnect(h);
            return kvs_fail(why, why_cap, KVS_ERR_PROTOCOL, "the shard refused %s: %s%s%s", wire_op_name(op),
                            kvs_strerror(sr.st.status), sr.msg[0] ? ": " : "", sr.msg);
        }
    }
    route_hop_disconnect(h);
    return kvs_fail(why, why_cap, KVS_ERR_PROTOCOL, "expected %s (request %llu), got %s (request %llu)",
                    wire_op_name(reply_op), (unsigned long long)rid, wire_op_name(hdr.op),
                    (unsigned long long)hdr.request_id);
}

/* Connects h, says HELLO and reads its INFO into h->info. On failure h is disconnected and the
 * code (transport, or the INFO status / INVALID_ARG for a refusal) comes with why. */
int route_hop_connect(route *r, route_hop *h, char *why, size_t why_cap) {
    route_hop_disconnect(h);
    char nmsg[KVS_MSG_MAX] = "";
    int rc = netio_connect(h->addr.host, h->addr.port, netio_deadline_ms(r->p.timeout_ms), &h->fd, nmsg, sizeof nmsg);
    if (rc != KVS_OK) {
        h->fd = -1;
        return kvs_fail(why, why_cap, rc, "cannot connect: %s", nmsg[0] ? nmsg : kvs_strerror(rc));
    }
    if (r->tls) {
        char peer_id[TLS_ID_MAX];
        rc = tls_handshake(r->tls, h->fd, netio_deadline_ms(r->p.timeout_ms), peer_id, sizeof peer_id, nmsg,
                           sizeof nmsg);
        if (rc != KVS_OK) {
            route_hop_disconnect(h);
            return kvs_fail(why, why_cap, rc, "%s", nmsg);
        }
    }
    struct wire_hello hello = {.min_version = 1, .max_version = WIRE_PROTO_VERSION};
    size_t alen = strlen(r->auth);
    hello.auth_len = (uint16_t)alen;
    memcpy(hello.auth, r->auth, alen + 1);
    size_t len = 0;
    if ((rc = route_tx_reserve(r, 6 + alen)) != KVS_OK ||
        (rc = wire_encode_hello(&hello, r->tx, r->tx_cap, &len)) != KVS_OK) {
        route_hop_disconnect(h);
        return kvs_fail(why, why_cap, rc, "cannot encode HELLO: %s", kvs_strerror(rc));
    }
    if ((rc = route_hop_call(r, h, WIRE_OP_HELLO, len, WIRE_OP_INFO, why, why_cap)) != KVS_OK) return rc;
    rc = wire_decode_info(r->rx.data, r->rx.len, &h->info, nmsg, sizeof nmsg);
    if (rc != KVS_OK) {
        route_hop_disconnect(h);
        return kvs_fail(why, why_cap, rc, "bad INFO: %s", nmsg);
    }
    if (h->info.st.status != KVS_OK) {
        int st = h->info.st.status;
        route_hop_disconnect(h);
        if (st == KVS_ERR_INVALID_ARG) return kvs_fail(why, why_cap, st, "the shard refused HELLO (wrong auth token?)");
        return kvs_fail(why, why_cap, st == KVS_ERR_UNSUPPORTED ? st : KVS_ERR_INVALID_ARG,
                        "the shard refused HELLO: %s", kvs_strerror(st));
    }
    return KVS_OK;
}

/* Replay memory of one position: its token id plus one hidden row per hop after the head. */
uint64_t route_position_bytes(const route *r) {
    return 4u + (uint64_t)(r->n_hops - 1) * r->n_embd * r->hid_elem;
}

/* Recomputes max_ctx / max_rows from the hops. */
void route_limits(route *r) {
    uint32_t ctx = WIRE_MAX_POS, rows = WIRE_MAX_TOKENS;
    uint64_t row_bytes = (uint64_t)r->n_embd * r->hid_elem;
    uint64_t by_payload = (WIRE_MAX_PAYLOAD - FWD_HEAD_BYTES) / row_bytes;
    /* The replay memory of a session is bounded: positions x (token + (hops - 1) hidden rows). */
    uint64_t by_replay = r->p.max_replay_bytes / route_position_bytes(r);
    if (by_replay < ctx) ctx = by_replay ? (uint32_t)by_replay : 1;
    if (by_payload < rows) rows = (uint32_t)by_payload;
    for (uint32_t k = 0; k < r->n_hops; k++) {
        if (r->hops[k].info.max_ctx < ctx) ctx = r->hops[k].info.max_ctx;
        if (r->hops[k].info.max_tokens < rows) rows = r->hops[k].info.max_tokens;
    }
    r->max_ctx = ctx;
    r->max_rows = rows ? rows : 1;
}

/* Errors of a hop that is gone (the connection or the shard), as opposed to a refusal. */
bool route_is_transport_error(int rc) {
    return rc == KVS_ERR_IO || rc == KVS_ERR_TIMEOUT || rc == KVS_ERR_CLOSED || rc == KVS_ERR_PROTOCOL;
}

/* route_open found hop k unreachable: puts in its place the first spare that starts at layer
 * `first` (the route check then validates the whole chain). KVS_OK or KVS_ERR_NOT_FOUND. */
int route_open_spare(route *r, uint32_t k, uint32_t first) {
    for (uint32_t j = 0; j < r->n_spares; j++) {
        route_hop *sp = &r->spares[j];
        if (r->spare_state[j] == SPARE_USED || r->spare_state[j] == SPARE_DEAD) continue;
        if (r->spare_state[j] == SPARE_KNOWN && sp->info.first != first) continue;
        char why[KVS_MSG_MAX];
        int rc = route_hop_connect(r, sp, why, sizeof why);
        if (rc != KVS_OK) {
            route_log(r, "spare %s: %s", sp->addr.text, why);
            if (!route_is_transport_error(rc)) r->spare_state[j] = SPARE_DEAD;
            continue;
        }
        r->spare_state[j] = SPARE_KNOWN;
        if (sp->info.first != first) {
            route_hop_disconnect(sp);
            continue;
        }
        r->spare_state[j] = SPARE_USED;
        r->hops[k] = *sp;
        sp->fd = -1;
        r->reroutes++;
        return KVS_OK;
    }
    return KVS_ERR_NOT_FOUND;
}

/* ---- open / close --------------------------------------------------------- */

void route_close(route *r) {
    if (!r) return;
    for (uint32_t k = 0; k < r->n_hops; k++) route_hop_disconnect(&r->hops[k]);
    for (uint32_t k = 0; k < r->n_spares; k++) route_hop_disconnect(&r->spares[k]);
    free(r->hops);
    free(r->hop_gen);
    free(r->spares);
    free(r->spare_state);
    free(r->auth);
    tls_ctx_free(r->tls);
    free(r->tx);
    free(r->scratch_logits);
    free(r->fwd);
    netio_buf_free(&r->rx);
    free(r);
}

int route_open(const char *route_spec, const char *spares_spec, const route_params *p, route **out, char *msg,
               size_t msg_cap) {
    if (!out) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "out is NULL");
    *out = NULL;
    route_addr *addrs = NULL, *spare_addrs = NULL;
    size_t n = 0, n_spares = 0;
    const char **names = NULL;
    struct wire_info *infos = NULL;
    int rc = route_parse_spec(route_spec, &addrs, &n, msg, msg_cap);
    if (rc != KVS_OK) return rc;
    if (spares_spec && *spares_spec &&
        (rc = route_parse_spec(spares_spec, &spare_addrs, &n_spares, msg, msg_cap)) != KVS_OK) {
        free(addrs);
        return rc;
    }
    route *r = calloc(1, sizeof *r);
    if (!r) {
        rc = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
        goto fail;
    }
    r->p = p ? *p : route_default_params();
    if (r->p.max_replay_bytes == 0) r->p.max_replay_bytes = ROUTE_DEFAULT_REPLAY_BYTES;
    if (r->p.hidden_f16 && r->p.hidden_bf16) {
        rc = kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "hidden_f16 and hidden_bf16 both set");
        goto fail;
    }
    r->hid_kind = r->p.hidden_f16 ? WIRE_IN_HIDDEN_F16 : r->p.hidden_bf16 ? WIRE_IN_HIDDEN_BF16 : WIRE_IN_HIDDEN_F32;
    r->hid_bit = r->p.hidden_f16 ? WIRE_DTYPE_F16 : r->p.hidden_bf16 ? WIRE_DTYPE_BF16 : WIRE_DTYPE_F32;
    r->hid_name = r->p.hidden_f16 ? "f16" : r->p.hidden_bf16 ? "bf16" : "f32";
    r->hid_elem = r->hid_kind == WIRE_IN_HIDDEN_F32 ? 4 : 2;
    r->p.auth = NULL;
    const char *auth = p && p->auth ? p->auth : "";
    if (strlen(auth) > WIRE_MAX_AUTH) {
        rc = kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "auth token longer than %u bytes", WIRE_MAX_AUTH);
        goto fail;
    }
    r->auth = strdup(auth);
    if (p && (p->tls_cert || p->tls_key || p->tls_ca)) {
        tls_params tp = {.cert_file = p->tls_cert, .key_file = p->tls_key, .ca_file = p->tls_ca};
        if ((rc = tls_ctx_create(&tp, false, &r->tls, msg, msg_cap)) != KVS_OK) goto fail;
    }
    r->p.tls_cert = r->p.tls_key = r->p.tls_ca = NULL; /* not kept: the context holds what it needs */
    r->n_hops = (uint32_t)n;
    r->n_spares = (uint32_t)n_spares;
    r->hops = calloc(n, sizeof *r->hops);
    r->hop_gen = calloc(n, sizeof *r->hop_gen);
    r->spares = calloc(n_spares ? n_spares : 1, sizeof *r->spares);
    r->spare_state = calloc(n_spares ? n_spares : 1, 1);
    names = calloc(n, sizeof *names);
    infos = calloc(n, sizeof *infos);
    if (!r->auth || !r->hops || !r->hop_gen || !r->spares || !r->spare_state || !names || !infos) {
        rc = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
        goto fail;
    }
    for (size_t k = 0; k < n; k++) r->hops[k] = (route_hop){.addr = addrs[k], .fd = -1};
    for (size_t k = 0; k < n_spares; k++) r->spares[k] = (route_hop){.addr = spare_addrs[k], .fd = -1};

    for (size_t k = 0; k < n; k++) {
        char why[KVS_MSG_MAX];
        rc = route_hop_connect(r, &r->hops[k], why, sizeof why);
        if (rc != KVS_OK && route_is_transport_error(rc)) {
            char old[ROUTE_ADDR_MAX];
            snprintf(old, sizeof old, "%s", r->hops[k].addr.text);
            if (route_open_spare(r, (uint32_t)k, k ? infos[k - 1].last : 0) == KVS_OK) {
                route_log(r, "hop %zu (%s): %s; using spare %s", k, old, why, r->hops[k].addr.text);
                rc = KVS_OK;
            }
        }
        if (rc != KVS_OK) {
            rc = kvs_fail(msg, msg_cap, rc, "hop %zu (%s): %s", k, r->hops[k].addr.text, why);
            goto fail;
        }
        names[k] = r->hops[k].addr.text;
        infos[k] = r->hops[k].info;
    }
    if ((rc = route_check_hops(infos, names, n, msg, msg_cap)) != KVS_OK) goto fail;
    for (size_t k = 1; k < n; k++)
        if (!(infos[k].hidden_dtypes & r->hid_bit)) {
            rc = kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "hop %zu (%s) does not take %s hidden states", k,
                          names[k], r->hid_name);
            goto fail;
        }
    memcpy(r->digest, infos[0].model_digest, WIRE_DIGEST_SIZE);
    r->n_layer = infos[0].n_layer;
    r->n_embd = infos[0].n_embd;
    r->n_vocab = infos[0].n_vocab;
    route_limits(r);
    r->scratch_logits = malloc((size_t)r->n_vocab * sizeof(float));
    r->fwd = calloc(1, sizeof *r->fwd);
    if (getrandom(&r->relay_id, sizeof r->relay_id, 0) != (ssize_t)sizeof r->relay_id || r->relay_id == 0)
        r->relay_id = (uint64_t)kvs_now_ns() | 1; /* unique enough to name our connections */
    if (!r->scratch_logits || !r->fwd) {
        rc = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
        goto fail;
    }
    free(addrs);
    free(spare_addrs);
    free(names);
    free(infos);
    *out = r;
    return KVS_OK;

fail:
    free(addrs);
    free(spare_addrs);
    free(names);
    free(infos);
    route_close(r);
    return rc;
}

void route_get_info(const route *r, route_info *out) {
    *out = (route_info){.n_hops = r->n_hops, .n_layer = r->n_layer, .n_embd = r->n_embd, .n_vocab = r->n_vocab,
                        .max_ctx = r->max_ctx, .max_rows = r->max_rows, .bytes_sent = r->bytes_sent,
                        .bytes_received = r->bytes_received, .reroutes = r->reroutes,
                        .relay_steps = r->relay_steps, .relay_fallbacks = r->relay_fallbacks};
    memcpy(out->model_digest, r->digest, WIRE_DIGEST_SIZE);
}

const char *route_hop_addr(const route *r, uint32_t k) { return r && k < r->n_hops ? r->hops[k].addr.text : NULL; }

/* ---- vocab ------------------------------------------------------------------ */

/* Lowest id of type UNKNOWN (2), else 0 — what GGUF llama vocabs declare as unknown_token_id
 * (the wire does not carry it). */
static int32_t guess_unk(const int32_t *types, int32_t n) {
    for (int32_t i = 0; i < n; i++)
        if (types[i] == 2) return i;
    return 0;
}

/* The BPE half of a vocab (VOCAB_META pages): merges rebuilt as "left right" texts. */
typedef struct {
    char pre[WIRE_MAX_PRE + 1];
    int8_t add_bos;
    char *chat_template;
    uint32_t n_merges;
    char **merges;
    uint32_t *merge_lens;
} bpe_meta;

static void bpe_meta_free(bpe_meta *m) {
    for (uint32_t i = 0; m->merges && i < m->n_merges; i++) free(m->merges[i]);
    free(m->merges);
    free(m->merge_lens);
    free(m->chat_template);
}

static int fetch_bpe_meta(route *r, uint32_t nv, const char *const *texts, const uint32_t *lens, bpe_meta *m,
                          char *msg, size_t msg_cap) {
    route_hop *h = &r->hops[0];
    int rc;
    for (uint32_t first = 0;;) {
        char why[KVS_MSG_MAX];
        struct wire_vocab_meta q = {.first = first, .max_count = WIRE_MAX_MERGES};
        size_t len = 0;
        if ((rc = route_tx_reserve(r, 8)) != KVS_OK || (rc = wire_encode_vocab_meta(&q, r->tx, r->tx_cap, &len)) != KVS_OK)
            return kvs_fail(msg, msg_cap, rc, "cannot encode VOCAB_META: %s", kvs_strerror(rc));
        if ((rc = route_hop_call(r, h, WIRE_OP_VOCAB_META, len, WIRE_OP_VOCAB_META_REPLY, why, sizeof why)) != KVS_OK)
            return kvs_fail(msg, msg_cap, rc, "hop 0 (%s): %s", h->addr.text, why);
        struct wire_vocab_meta_reply v;
        if ((rc = wire_decode_vocab_meta_reply(r->rx.data, r->rx.len, &v, why, sizeof why)) != KVS_OK)
            return kvs_fail(msg, msg_cap, rc, "hop 0 (%s): bad VOCAB_META_REPLY: %s", h->addr.text, why);
        if (v.st.status != KVS_OK)
            return kvs_fail(msg, msg_cap, v.st.status, "hop 0 (%s) refused VOCAB_META: %s", h->addr.text,
                            kvs_strerror(v.st.status));
        if (v.n_vocab != nv || v.first != first || (first > 0 && v.n_merges != m->n_merges) ||
            (v.count == 0 && first < v.n_merges))
            return kvs_fail(msg, msg_cap, KVS_ERR_PROTOCOL, "hop 0 (%s): VOCAB_META page [%u, +%u) of %u does not "
                            "continue [%u, ...)", h->addr.text, v.first, v.count, v.n_merges, first);
        if (first == 0) {
            memcpy(m->pre, v.pre, sizeof m->pre);
            m->add_bos = v.add_bos == 1 ? 1 : v.add_bos == 2 ? -1 : 0;
            m->n_merges = v.n_merges;
            m->merges = calloc(v.n_merges ? v.n_merges : 1, sizeof *m->merges);
            m->merge_lens = calloc(v.n_merges ? v.n_merges : 1, sizeof *m->merge_lens);
            if (v.template_len) {
                m->chat_template = malloc((size_t)v.template_len + 1);
                if (m->chat_template) {
                    memcpy(m->chat_template, v.chat_template, v.template_len);
                    m->chat_template[v.template_len] = 0;
                }
            }
            if (!m->merges || !m->merge_lens || (v.template_len && !m->chat_template))
                return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
        }
        for (uint32_t i = 0; i < v.count; i++) {
            int32_t lid, rid;
            wire_vocab_meta_merge(&v, i, &lid, &rid); /* ids < n_vocab: checked by the decoder */
            size_t ll = lens[lid], rl = lens[rid];
            char *s = malloc(ll + rl + 2);
            if (!s) return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
            if (ll) memcpy(s, texts[lid], ll);
            s[ll] = ' ';
            if (rl) memcpy(s + ll + 1, texts[rid], rl);
            m->merges[first + i] = s;
            m->merge_lens[first + i] = (uint32_t)(ll + rl + 1);
        }
        first += v.count;
        if (first >= v.n_merges) return KVS_OK;
    }
}

int route_fetch_vocab(route *r, tok_vocab **out, char *msg, size_t msg_cap) {
    if (!out) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "out is NULL");
    *out = NULL;
    if (!r) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "route is NULL");
    route_hop *h = &r->hops[0];
    const uint32_t nv = r->n_vocab;
    char *arena = NULL;
    size_t arena_len = 0, arena_cap = 0;
    uint64_t *text_off = malloc((size_t)nv * sizeof *text_off);
    uint32_t *lens = malloc((size_t)nv * sizeof *lens);
    float *scores = malloc((size_t)nv * sizeof *scores);
    int32_t *types = malloc((size_t)nv * sizeof *types);
    const char **texts = malloc((size_t)nv * sizeof *texts);
    int32_t bos = -1, eos = -1;
    bool add_space_prefix = true, is_bpe = false;
    bpe_meta meta = {0};
    int rc;
    if (!text_off || !lens || !scores || !types || !texts) {
        rc = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
        goto done;
    }
    for (uint32_t first = 0; first < nv;) {
        char why[KVS_MSG_MAX];
        struct wire_vocab q = {.first = first, .max_count = nv - first};
        size_t len = 0;
        if ((rc = route_tx_reserve(r, 8)) != KVS_OK || (rc = wire_encode_vocab(&q, r->tx, r->tx_cap, &len)) != KVS_OK) {
            rc = kvs_fail(msg, msg_cap, rc, "cannot encode VOCAB: %s", kvs_strerror(rc));
            goto done;
        }
        if ((rc = route_hop_call(r, h, WIRE_OP_VOCAB, len, WIRE_OP_VOCAB_REPLY, why, sizeof why)) != KVS_OK) {
            char old[ROUTE_ADDR_MAX];
            snprintf(old, sizeof old, "%s", h->addr.text);
            route_hop_disconnect(h);
            if (route_is_transport_error(rc) && route_take_spare(r, 0) == KVS_OK) { /* the head died: ask its spare */
                route_log(r, "hop 0 (%s) failed during VOCAB (%s): now %s", old, why, h->addr.text);
                r->reroutes++;
                first = 0;
                arena_len = 0;
                continue;
            }
            rc = kvs_fail(msg, msg_cap, rc, "hop 0 (%s): %s", old, why);
            goto done;
        }
        struct wire_vocab_reply v;
        if ((rc = wire_decode_vocab_reply(r->rx.data, r->rx.len, &v, why, sizeof why)) != KVS_OK) {
            rc = kvs_fail(msg, msg_cap, rc, "hop 0 (%s): bad VOCAB_REPLY: %s", h->addr.text, why);
            goto done;
        }
        if (v.st.status != KVS_OK) {
            rc = kvs_fail(msg, msg_cap, v.st.status, "hop 0 (%s) refused VOCAB: %s", h->addr.text,
                          kvs_strerror(v.st.status));
            goto done;
        }
        if (strcmp(v.tok_model, "llama") != 0 && strcmp(v.tok_model, "gpt2") != 0) {
            rc = kvs_fail(msg, msg_cap, KVS_ERR_UNSUPPORTED, "hop 0 (%s) has a '%s' tokenizer (only llama, gpt2)",
                          h->addr.text, v.tok_model);
            goto done;
        }
        if (first == 0) is_bpe = !strcmp(v.tok_model, "gpt2");
        else if (is_bpe != !strcmp(v.tok_model, "gpt2")) {
            rc = kvs_fail(msg, msg_cap, KVS_ERR_PROTOCOL, "hop 0 (%s): VOCAB pages disagree on the tokenizer",
                          h->addr.text);
            goto done;
        }
        if (v.n_vocab != nv || v.first != first || v.count == 0 ||
            (first > 0 && (v.bos != bos || v.eos != eos || (v.add_space_prefix != 0) != add_space_prefix))) {
            rc = kvs_fail(msg, msg_cap, KVS_ERR_PROTOCOL,
                          "hop 0 (%s): VOCAB page [%u, +%u) of %u does not continue [%u, ...) of %u", h->addr.text,
                          v.first, v.count, v.n_vocab, first, nv);
            goto done;
        }
        bos = v.bos;
        eos = v.eos;
        add_space_prefix = v.add_space_prefix != 0;
        size_t off = 0;
        struct wire_vocab_token t;
        uint32_t i = first;
        while (wire_vocab_next(&v, &off, &t)) {
            if (i >= first + v.count) break; /* the decoder guarantees count entries */
            if (t.text_len > ROUTE_MAX_TOKEN_BYTES || arena_len + t.text_len > ROUTE_MAX_VOCAB_TEXT) {
                rc = kvs_fail(msg, msg_cap, KVS_ERR_PROTOCOL,
                              "hop 0 (%s): VOCAB token %u is %u bytes (limit %u, %u for the whole vocab)",
                              h->addr.text, i, t.text_len, ROUTE_MAX_TOKEN_BYTES, ROUTE_MAX_VOCAB_TEXT);
                goto done;
            }
            if (arena_len + t.text_len > arena_cap) {
                size_t cap = arena_cap ? arena_cap * 2 : 65536;
                while (cap < arena_len + t.text_len) cap *= 2;
                char *a = realloc(arena, cap);
                if (!a) {
                    rc = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
                    goto done;
                }
                arena = a;
                arena_cap = cap;
            }
            if (t.text_len) memcpy(arena + arena_len, t.text, t.text_len);
            text_off[i] = arena_len;
            lens[i] = t.text_len;
            arena_len += t.text_len;
            scores[i] = t.score;
            types[i] = t.type;
            i++;
        }
        if (i != first + v.count) {
            rc = kvs_fail(msg, msg_cap, KVS_ERR_PROTOCOL, "hop 0 (%s): VOCAB page holds %u entries, announced %u",
                          h->addr.text, i - first, v.count);
            goto done;
        }
        first += v.count;
    }
    for (uint32_t i = 0; i < nv; i++) texts[i] = arena ? arena + text_off[i] : NULL;
    tok_arrays a = {.n_vocab = (int32_t)nv, .texts = texts, .text_lens = lens, .scores = scores, .types = types,
                    .bos = bos, .eos = eos, .unk = is_bpe ? -1 : guess_unk(types, (int32_t)nv),
                    .add_space_prefix = add_space_prefix};
    if (is_bpe) {
        if ((rc = fetch_bpe_meta(r, nv, texts, lens, &meta, msg, msg_cap)) != KVS_OK) goto done;
        a.kind = TOK_KIND_BPE;
        a.pre = meta.pre;
        a.add_bos = meta.add_bos;
        a.chat_template = meta.chat_template;
        a.n_merges = (int32_t)meta.n_merges;
        a.merges = (const char *const *)meta.merges;
        a.merge_lens = meta.merge_lens;
    }
    char tmsg[KVS_MSG_MAX] = "";
    rc = tok_from_arrays(&a, out, tmsg, sizeof tmsg);
    if (rc != KVS_OK) rc = kvs_fail(msg, msg_cap, rc, "hop 0 (%s): vocab: %s", h->addr.text, tmsg);

done:
    bpe_meta_free(&meta);
    free(arena);
    free(text_off);
    free(lens);
    free(scores);
    free(types);
    free(texts);
    return rc;
}

/* ---- sessions ---------------------------------------------------------------- */

int route_session_open(route *r, route_session **out, char *msg, size_t msg_cap) {
    if (!out) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "out is NULL");
    *out = NULL;
    if (!r) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "route is NULL");
    route_session *s = calloc(1, sizeof *s);
    if (!s) return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
    s->r = r;
    s->epoch = 1;
    s->hidden = calloc(r->n_hops, sizeof *s->hidden);
    s->hop_epoch = calloc(r->n_hops, sizeof *s->hop_epoch);
    s->hop_gen = malloc(r->n_hops * sizeof *s->hop_gen);
    if (!s->hidden || !s->hop_epoch || !s->hop_gen) {
        route_release(NULL, s);
        return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
    }
    memcpy(s->hop_gen, r->hop_gen, r->n_hops * sizeof *s->hop_gen);
    size_t got = 0;
    while (got < WIRE_SID_SIZE) {
        ssize_t k = getrandom(s->sid + got, WIRE_SID_SIZE - got, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            route_release(NULL, s);
            return kvs_fail(msg, msg_cap, KVS_ERR_IO, "getrandom: %s", strerror(errno));
        }
        got += (size_t)k;
    }
    *out = s;
    return KVS_OK;
}

uint32_t route_session_pos(const route_session *s) { return s ? s->pos : 0; }
void route_session_id(const route_session *s, uint8_t out[WIRE_SID_SIZE]) { memcpy(out, s->sid, WIRE_SID_SIZE); }

uint64_t route_session_epoch(const route_session *s) { return s ? s->epoch : 0; }

int route_session_rewind(route_session *s, uint32_t pos) {
    if (!s || pos > s->pos) return KVS_ERR_INVALID_ARG;
    s->pos = pos; /* I1 still holds: the inputs of [0, pos) stay remembered */
    if (s->hidden_valid > pos) s->hidden_valid = pos; /* I6 */
    return KVS_OK;
}

uint64_t route_session_replay_bytes(const route_session *s) {
    return s ? (uint64_t)s->cap * route_position_bytes(s->r) : 0;
}

/* Grows the per-hop input memory to hold `rows` positions. */
int route_session_reserve(route_session *s, uint32_t rows) {
    if (rows <= s->cap) return KVS_OK;
    const route *r = s->r;
    uint32_t cap = s->cap ? s->cap : 64;
    while (cap < rows) cap = cap > UINT32_MAX / 2 ? rows : cap * 2;
    if (cap > r->max_ctx) cap = r->max_ctx > rows ? r->max_ctx : rows; /* never past the replay cap */
    int32_t *t = realloc(s->tokens, (size_t)cap * sizeof *t);
    if (!t) return KVS_ERR_NOMEM;
    s->tokens = t;
    for (uint32_t k = 1; k < r->n_hops; k++) {
        uint8_t *h = realloc(s->hidden[k], (size_t)cap * r->n_embd * r->hid_elem);
        if (!h) return KVS_ERR_NOMEM;
        s->hidden[k] = h;
    }
    s->cap = cap;
    return KVS_OK;
}

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

/* One FORWARD of rows [from, to) to hop k. On HOP_OK *st is the shard's status block; when it is
 * OK the output went to out (hidden rows [out_from, to) for hop k+1, or the logits row; out NULL:
 * discarded) and hop_epoch[k] is the session epoch. HOP_FAILED: transport failure, why says what; the hop is
 * disconnected. HOP_FATAL: *rc and why (an encoder failure, or a reply of the wrong shape). */
static enum hop_result hop_send(route *r, route_session *s, uint32_t k, uint32_t from, uint32_t to,
                                uint32_t out_from, void *out, struct wire_status *st, int *rc, char *why,
                                size_t why_cap) {
    route_hop *h = &r->hops[k];
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
    size_t len = 0;
    if ((*rc = wire_encode_forward(&f, NULL, 0, &len)) != KVS_OK || (*rc = route_tx_reserve(r, len > bytes ? len : bytes)) != KVS_OK ||
        (*rc = wire_encode_forward(&f, r->tx, r->tx_cap, &len)) != KVS_OK) {
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
    /* f16 / bf16 mode: the head answers token input in f32 (rounded here, once); the others in the
     * route's dtype. */
    const uint32_t half_outk = r->hid_kind == WIRE_IN_HIDDEN_F16    ? WIRE_OUTK_HIDDEN_F16
                               : r->hid_kind == WIRE_IN_HIDDEN_BF16 ? WIRE_OUTK_HIDDEN_BF16
                                                                    : WIRE_OUTK_HIDDEN_F32;
    const bool hid_ok = rep.out_kind == WIRE_OUTK_HIDDEN_F32 || rep.out_kind == half_outk;
    bool shape_ok = sample ? rep.out_kind == WIRE_OUTK_SAMPLE && rep.n_cols == s->opts->n_top
                    : last ? rep.out_kind == WIRE_OUTK_LOGITS_F32 && rep.n_rows == 1 && rep.n_cols == r->n_vocab
                           : hid_ok && rep.n_rows == n && rep.n_cols == r->n_embd;
    if (!shape_ok || rep.st.n_past != to) {
        route_hop_disconnect(h);
        *rc = kvs_fail(why, why_cap, KVS_ERR_PROTOCOL,
                       "FORWARD [%u, %u) answered out_kind %u, %u x %u, n_past %u (expected %s, n_past %u)", from, to,
                       rep.out_kind, rep.n_rows, rep.n_cols, rep.st.n_past,
                       sample ? "a sample" : last ? "1 row of logits" : r->hid_elem == 2 ? "hidden f32 or half rows" : "hidden f32 rows", to);
        return HOP_FAILED;
    }
    if (sample) {
        route_reply_to_sample(&rep, s->res);
    } else if (out) {
        if (!last && out_from > from) { /* only the rows the caller asked for */
            rep.n_rows = to - out_from;
            rep.data = (const uint8_t *)rep.data +
                       (size_t)(out_from - from) * r->n_embd * (rep.out_kind == WIRE_OUTK_HIDDEN_F32 ? 4 : 2);
        }
        if (!last && r->hid_elem == 2) { /* kept as f16/bf16: what the next hop is sent, and replayed, exactly */
            const uint8_t *src = rep.data;
            uint16_t *dst = out;
            size_t count = (size_t)rep.n_rows * rep.n_cols;
            if (rep.out_kind == half_outk) {
                for (size_t i = 0; i < count; i++) dst[i] = kvs_rd_u16(src + 2 * i);
            } else if (r->hid_kind == WIRE_IN_HIDDEN_F16) {
                for (size_t i = 0; i < count; i++) dst[i] = wire_f32_to_f16(kvs_rd_f32(src + 4 * i));
            } else {
                for (size_t i = 0; i < count; i++) dst[i] = wire_f32_to_bf16(kvs_rd_f32(src + 4 * i));
            }
        } else {
            wire_forward_reply_to_f32(&rep, out);
        }
    }
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
    uint32_t from = s->hop_epoch[k] == 0 ? 0 : a;
    if (from < a) route_log(r, "hop %u (%s): replaying positions [0, %u)", k, h->addr.text, a);
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
            if (st.have >= from || ++misses > ROUTE_MAX_MISSES) {
                *rc = kvs_fail(why, why_cap, KVS_ERR_CACHE_MISS,
                               "answered CACHE_MISS(have %u) for start %u %s", st.have, from,
                               st.have >= from ? "(not a miss)" : "too many times in a row");
                return HOP_FATAL;
            }
            route_log(r, "hop %u (%s): cache miss at %u (holds %u): replaying [%u, %u)", k, h->addr.text, from,
                      st.have, st.have, a);
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
        default:
            *rc = kvs_fail(why, why_cap, st.status, "FORWARD [%u, %u) refused: %s", from, to,
                           kvs_strerror(st.status));
            return HOP_FATAL;
        }
    }
}

/* Finds a spare for hop k (same model, same [first, last)), connects it and puts it in place.
 * KVS_OK, or KVS_ERR_NOT_FOUND when none is usable. */
int route_take_spare(route *r, uint32_t k) {
    const struct wire_info *want = &r->hops[k].info;
    for (uint32_t j = 0; j < r->n_spares; j++) {
        route_hop *sp = &r->spares[j];
        if (r->spare_state[j] == SPARE_USED || r->spare_state[j] == SPARE_DEAD) continue;
        if (r->spare_state[j] == SPARE_KNOWN && (sp->info.first != want->first || sp->info.last != want->last))
            continue;
        char why[KVS_MSG_MAX];
        int rc = route_hop_connect(r, sp, why, sizeof why);
        if (rc != KVS_OK) {
            route_log(r, "spare %s: %s", sp->addr.text, why);
            if (rc != KVS_ERR_TIMEOUT && rc != KVS_ERR_IO && rc != KVS_ERR_CLOSED) r->spare_state[j] = SPARE_DEAD;
            continue;
        }
        char what[ROUTE_ADDR_MAX + 16], ref[ROUTE_ADDR_MAX + 16];
        snprintf(what, sizeof what, "spare %s", sp->addr.text);
        snprintf(ref, sizeof ref, "hop 0 (%s)", r->hops[0].addr.text);
        struct wire_info model = *want;
        memcpy(model.model_digest, r->digest, WIRE_DIGEST_SIZE);
        if (route_check_same_model(&model, ref, &sp->info, what, why, sizeof why) != KVS_OK) {
            route_log(r, "%s", why);
            r->spare_state[j] = SPARE_DEAD;
            route_hop_disconnect(sp);
            continue;
        }
        r->spare_state[j] = SPARE_KNOWN;
        if (k > 0 && !(sp->info.hidden_dtypes & r->hid_bit)) {
            route_log(r, "spare %s does not take %s hidden states", sp->addr.text, r->hid_name);
            r->spare_state[j] = SPARE_DEAD;
            route_hop_disconnect(sp);
            continue;
        }
        if (sp->info.first != want->first || sp->info.last != want->last) {
            route_log(r, "spare %s serves layers [%u, %u), not [%u, %u)", sp->addr.text, sp->info.first,
                      sp->info.last, want->first, want->last);
            route_hop_disconnect(sp);
            continue;
        }
        r->spare_state[j] = SPARE_USED;
        r->hops[k] = *sp;
        sp->fd = -1;
        r->hop_gen[k]++;
        route_limits(r);
        return KVS_OK;
    }
    return KVS_ERR_NOT_FOUND;
}

/* Hop k failed with `err` (why): replace it and move the session to a new epoch. */
int route_reroute(route *r, route_session *s, uint32_t k, int err, const char *why, char *msg, size_t msg_cap) {
    route_hop old = r->hops[k];
    route_hop_disconnect(&r->hops[k]);
    route_log(r, "hop %u (%s) failed: %s", k, old.addr.text, why);
    if (route_take_spare(r, k) != KVS_OK)
        return kvs_fail(msg, msg_cap, err, "hop %u (%s) failed (%s) and no spare serves layers [%u, %u)", k,
                        old.addr.text, why, old.info.first, old.info.last);
    s->hop_epoch[k] = 0;
    s->hop_gen[k] = r->hop_gen[k];
    s->epoch++;
    r->reroutes++;
    route_log(r, "re-route: hop %u [%u, %u) now %s; epoch %llu -> %llu; %u positions to replay into it", k,
              old.info.first, old.info.last, r->hops[k].addr.text, (unsigned long long)(s->epoch - 1),
              (unsigned long long)s->epoch, s->pos);
    return KVS_OK;
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

/* Sends RELAY_LISTEN on hop k unless it is listening already (I7). */
static int hop_listen(route *r, uint32_t k, char *why, size_t why_cap) {
    route_hop *h = &r->hops[k];
    if (h->listening) return KVS_OK;
    struct wire_relay_listen m = {.relay_id = r->relay_id};
    size_t len = 0;
    int rc;
    if ((rc = route_tx_reserve(r, 8)) != KVS_OK || (rc = wire_encode_relay_listen(&m, r->tx, r->tx_cap, &len)) != KVS_OK ||
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
            if (now >= deadline) return kvs_fail(why, why_cap, KVS_ERR_TIMEOUT, "no answer to the relayed step within %lld ms",
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
            if (hdr.request_id != rid) continue;
            *op = hdr.op;
            *from = k;
            return KVS_OK;
        }
    }
}

/* One relayed attempt of the step [base, end) (route.h design note 7). True when it completed:
 * the result is in logits_last / s->res and every hop holds the step in s->epoch. False: redo it
 * client-driven (why says what happened; a lost hop is left disconnected for that redo). */
bool route_relay_step(route *r, route_session *s, uint32_t base, uint32_t end, float *logits_last, char *why,
                       size_t why_cap) {
    for (uint32_t k = 0; k < r->n_hops; k++)
        if (hop_listen(r, k, why, why_cap) != KVS_OK) return false;
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
    size_t len = 0;
    int rc;
    if ((rc = wire_encode_forward(f, NULL, 0, &len)) != KVS_OK || (rc = route_tx_reserve(r, len)) != KVS_OK ||
        (rc = wire_encode_forward(f, r->tx, r->tx_cap, &len)) != KVS_OK) {
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
    char dmsg[KVS_MSG_MAX] = "";
    if (op == WIRE_OP_STATUS) { /* a shard could not push on (relay.h design note 2) */
        struct wire_status_reply sr;
        if (wire_decode_status_reply(r->rx.data, r->rx.len, &sr, dmsg, sizeof dmsg) == KVS_OK)
            kvs_fail(why, why_cap, sr.st.status, "hop %u (%s) answered %s%s%s", k, r->hops[k].addr.text,
                     kvs_strerror(sr.st.status), sr.msg[0] ? ": " : "", sr.msg);
        else
            kvs_fail(why, why_cap, KVS_ERR_PROTOCOL, "hop %u (%s): bad STATUS: %s", k, r->hops[k].addr.text, dmsg);
        return false;
    }
    struct wire_forward_reply rep;
    if (op != WIRE_OP_FORWARD_REPLY || wire_decode_forward_reply(r->rx.data, r->rx.len, &rep, dmsg, sizeof dmsg) != KVS_OK) {
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
    for (uint32_t j = 0; j < r->n_hops; j++) s->hop_epoch[j] = s->epoch;
    return true;
}

int route_step(route *r, route_session *s, const int32_t *tokens, uint32_t n, const route_step_opts *o,
               float *logits_last, sampler_result *res, char *msg, size_t msg_cap) {
    if (!r || !s || !tokens || !o || s->r != r || (o->sample ? !res : !logits_last))
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "NULL argument or session of another route");
    if (n == 0) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "no tokens");
    if (o->sample && (o->n_top > WIRE_MAX_TOP || o->n_window > WIRE_MAX_WINDOW || (o->n_window && !o->window) ||
                      !sampler_params_valid(&o->sp)))
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "bad sampler options");
    if (o->sample && r->hops[r->n_hops - 1].info.version < 2)
        return kvs_fail(msg, msg_cap, KVS_ERR_UNSUPPORTED, "hop %u (%s) speaks protocol version 1: it cannot sample (use logits)",
                        r->n_hops - 1, r->hops[r->n_hops - 1].addr.text);
    for (uint32_t i = 0; i < n; i++)
        if (tokens[i] < 0 || (uint32_t)tokens[i] >= r->n_vocab)
            return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "token %u: id %d outside the vocab (%u)", i,
                            (int)tokens[i], r->n_vocab);
    const uint32_t base = s->pos;
    if ((uint64_t)base + n > r->max_ctx)
        return kvs_fail(msg, msg_cap, KVS_ERR_CONTEXT_FULL, "%u + %u positions exceed the route's context of %u",
                        base, n, r->max_ctx);
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

    if (route_relay_possible(r, s, base, end)) {
        char why[KVS_MSG_MAX] = "";
        if (route_relay_step(r, s, base, end, logits_last, why, sizeof why)) {
            r->relay_steps++;
            s->pos = end;
            return KVS_OK;
        }
        r->relay_fallbacks++;
        route_log(r, "relayed step [%u, %u) failed (%s): redoing it client-driven from position %u", base, end, why,
                  s->hidden_valid);
    }

    /* Client-driven from hidden_valid (I6): rows [hidden_valid, base) are re-sent from memory. */
    const uint32_t start = s->hidden_valid;
    void *dummy_out = s->opts->sample ? r->scratch_logits : logits_last;
    for (;;) { /* one attempt of the step per iteration; each failed attempt uses up a spare */
        enum hop_result res_k = HOP_OK;
        uint32_t k = 0;
        int rc = KVS_OK;
        char why[KVS_MSG_MAX] = "";
        for (uint32_t k0 = 0; k0 < r->n_hops; k0++) /* a hop lost during a relayed attempt */
            if (r->hops[k0].fd < 0) {
                res_k = HOP_FAILED;
                k = k0;
                rc = kvs_fail(why, sizeof why, KVS_ERR_CLOSED, "connection lost");
                break;
            }
        for (uint32_t a = start; a < end && res_k == HOP_OK;) {
            uint32_t b = end - a > r->max_rows ? a + r->max_rows : end;
            for (k = 0; k < r->n_hops; k++) {
                void *out = k + 1 < r->n_hops ? (void *)(s->hidden[k + 1] + (size_t)a * r->n_embd * r->hid_elem)
                                              : (b == end ? dummy_out : (void *)r->scratch_logits);
                res_k = hop_append(r, s, k, a, b, out, &rc, why, sizeof why);
                if (res_k != HOP_OK) break;
            }
            a = b;
        }
        if (res_k == HOP_OK) {
            s->pos = end;
            s->hidden_valid = end;
            return KVS_OK;
        }
        if (res_k == HOP_FATAL)
            return kvs_fail(msg, msg_cap, rc, "hop %u (%s): %s", k, r->hops[k].addr.text, why);
        if ((rc = route_reroute(r, s, k, rc, why, msg, msg_cap)) != KVS_OK) return rc;
    }
}

void route_release(route *r, route_session *s) {
    if (!s) return;
    if (r && s->r == r) {
        for (uint32_t k = 0; k < r->n_hops; k++) {
            route_hop *h = &r->hops[k];
            if (h->fd < 0 || s->hop_epoch[k] == 0 || s->hop_gen[k] != r->hop_gen[k]) continue;
            struct wire_release rel = {.epoch = s->hop_epoch[k]};
            memcpy(rel.session_id, s->sid, WIRE_SID_SIZE);
            size_t len = 0;
            char why[KVS_MSG_MAX];
            if (route_tx_reserve(r, 24) != KVS_OK || wire_encode_release(&rel, r->tx, r->tx_cap, &len) != KVS_OK) continue;
            (void)route_hop_call(r, h, WIRE_OP_RELEASE, len, WIRE_OP_STATUS, why, sizeof why);
        }
    }
    route_session_forget(s);
}

void route_session_forget(route_session *s) {
    if (!s) return;
    if (s->hidden)
        for (uint32_t k = 0; k < s->r->n_hops; k++) free(s->hidden[k]);
    free(s->hidden);
    free(s->tokens);
    free(s->hop_epoch);
    free(s->hop_gen);
    free(s);
}
