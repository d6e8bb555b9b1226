/* route — open and close a route, its limits and its shape (route_impl.h has the design). */
#include "route.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "route_impl.h"
#include "tls.h"
#include "util.h"

route_params route_default_params(void) {
    return (route_params){.timeout_ms = 30000, .auth = NULL, .log = NULL, .log_user = NULL, .hidden_f16 = false,
                          .hidden_bf16 = false, .max_replay_bytes = ROUTE_DEFAULT_REPLAY_BYTES};
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
    free(r->hashes);
    netio_buf_free(&r->rx);
    free(r);
}

/* The settings of p (NULL: defaults) into r: the hidden dtype, a copy of the auth token, the TLS
 * context. r->auth NULL after a failed copy is reported with the other allocations. */
static int route_set_params(route *r, const route_params *p, char *msg, size_t msg_cap) {
    r->p = p ? *p : route_default_params();
    if (r->p.max_replay_bytes == 0) r->p.max_replay_bytes = ROUTE_DEFAULT_REPLAY_BYTES;
    if (r->p.hidden_f16 && r->p.hidden_bf16)
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "hidden_f16 and hidden_bf16 both set");
    r->hid_kind = r->p.hidden_f16 ? WIRE_IN_HIDDEN_F16 : r->p.hidden_bf16 ? WIRE_IN_HIDDEN_BF16 : WIRE_IN_HIDDEN_F32;
    r->hid_bit = r->p.hidden_f16 ? WIRE_DTYPE_F16 : r->p.hidden_bf16 ? WIRE_DTYPE_BF16 : WIRE_DTYPE_F32;
    r->hid_name = r->p.hidden_f16 ? "f16" : r->p.hidden_bf16 ? "bf16" : "f32";
    r->hid_elem = r->hid_kind == WIRE_IN_HIDDEN_F32 ? 4 : 2;
    r->p.auth = NULL;
    const char *auth = p && p->auth ? p->auth : "";
    if (strlen(auth) > WIRE_MAX_AUTH)
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "auth token longer than %u bytes", WIRE_MAX_AUTH);
    r->auth = strdup(auth);
    if (p && (p->tls_cert || p->tls_key || p->tls_ca)) {
        tls_params tp = {.cert_file = p->tls_cert, .key_file = p->tls_key, .ca_file = p->tls_ca};
        int rc = tls_ctx_create(&tp, false, &r->tls, msg, msg_cap);
        if (rc != KVS_OK) return rc;
    }
    r->p.tls_cert = r->p.tls_key = r->p.tls_ca = NULL; /* not kept: the context holds what it needs */
    return KVS_OK;
}

/* Connects every hop in order; one that cannot be reached is replaced by a spare starting where
 * the previous hop ends (route_open_spare). names[k] and infos[k] get hop k's address and INFO. */
static int route_connect_hops(route *r, const char **names, struct wire_info *infos, char *msg, size_t msg_cap) {
    for (size_t k = 0; k < r->n_hops; k++) {
        char why[KVS_MSG_MAX];
        int rc = route_hop_connect(r, &r->hops[k], why, sizeof why);
        if (rc != KVS_OK && route_is_transport_error(rc)) {
            char old[ROUTE_ADDR_MAX];
            snprintf(old, sizeof old, "%s", r->hops[k].addr.text);
            if (route_open_spare(r, (uint32_t)k, k ? infos[k - 1].last : 0) == KVS_OK) {
                route_log(r, "hop %zu (%s): %s; using spare %s", k, old, why, r->hops[k].addr.text);
                rc = KVS_OK;
            }
        }
        if (rc != KVS_OK) return kvs_fail(msg, msg_cap, rc, "hop %zu (%s): %s", k, r->hops[k].addr.text, why);
        names[k] = r->hops[k].addr.text;
        infos[k] = r->hops[k].info;
    }
    return KVS_OK;
}

/* Checks that the connected hops form a route in r's hidden dtype and takes its shape: model,
 * limits, the scratch buffers, a relay id. */
static int route_take_shape(route *r, const char *const *names, const struct wire_info *infos, char *msg,
                            size_t msg_cap) {
    const size_t n = r->n_hops;
    int rc = route_check_hops(infos, names, n, msg, msg_cap);
    if (rc != KVS_OK) return rc;
    for (size_t k = 1; k < n; k++)
        if (!(infos[k].hidden_dtypes & r->hid_bit))
            return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "hop %zu (%s) does not take %s hidden states", k,
                            names[k], r->hid_name);
    memcpy(r->digest, infos[0].model_digest, WIRE_DIGEST_SIZE);
    r->n_layer = infos[0].n_layer;
    r->n_embd = infos[0].n_embd;
    r->n_vocab = infos[0].n_vocab;
    route_limits(r);
    r->scratch_logits = malloc((size_t)r->n_vocab * sizeof(float));
    r->fwd = calloc(1, sizeof *r->fwd);
    if (getrandom(&r->relay_id, sizeof r->relay_id, 0) != (ssize_t)sizeof r->relay_id || r->relay_id == 0)
        r->relay_id = (uint64_t)kvs_now_ns() | 1; /* unique enough to name our connections */
    if (!r->scratch_logits || !r->fwd) return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
    return KVS_OK;
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
        goto done;
    }
    if ((rc = route_set_params(r, p, msg, msg_cap)) != KVS_OK) goto done;
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
        goto done;
    }
    for (size_t k = 0; k < n; k++) r->hops[k] = (route_hop){.addr = addrs[k], .fd = -1};
    for (size_t k = 0; k < n_spares; k++) r->spares[k] = (route_hop){.addr = spare_addrs[k], .fd = -1};
    if ((rc = route_connect_hops(r, names, infos, msg, msg_cap)) == KVS_OK)
        rc = route_take_shape(r, names, infos, msg, msg_cap);
done:
    free(addrs);
    free(spare_addrs);
    free(names);
    free(infos);
    if (rc == KVS_OK) *out = r;
    else route_close(r);
    return rc;
}

void route_get_info(const route *r, route_info *out) {
    *out = (route_info){.n_hops = r->n_hops, .n_layer = r->n_layer, .n_embd = r->n_embd, .n_vocab = r->n_vocab,
                        .max_ctx = r->max_ctx, .max_rows = r->max_rows, .bytes_sent = r->bytes_sent,
                        .bytes_received = r->bytes_received, .reroutes = r->reroutes,
                        .relay_steps = r->relay_steps, .relay_fallbacks = r->relay_fallbacks,
                        .replayed_positions = r->replayed, .reconnects = r->reconnects,
                        .moved = r->moved};
    memcpy(out->model_digest, r->digest, WIRE_DIGEST_SIZE);
}

const char *route_hop_addr(const route *r, uint32_t k) { return r && k < r->n_hops ? r->hops[k].addr.text : NULL; }
