/* route_session — sessions: open, replay memory, rewind, release. */
#include "route.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "route_impl.h"
#include "util.h"

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
uint32_t route_session_cached(const route_session *s) { return s ? s->cached : 0; }
void route_session_prefix_salt(route_session *s, uint64_t salt) { s->prefix_salt = salt; }

void route_session_public_blocks(route_session *s, uint32_t n) { s->public_blocks = n; }
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

void route_release(route *r, route_session *s) {
    if (!s) return;
    if (r && s->r == r) {
        route_refresh_links(r);
        for (uint32_t k = 0; k < r->n_hops; k++) {
            route_hop *h = &r->hops[k];
            if (h->fd < 0 || s->hop_epoch[k] == 0 || s->hop_gen[k] != r->hop_gen[k]) continue;
            struct wire_release rel = {.epoch = s->hop_epoch[k]};
            memcpy(rel.session_id, s->sid, WIRE_SID_SIZE);
            size_t len = 0;
            char why[KVS_MSG_MAX];
            if (route_tx_reserve(r, 24) != KVS_OK || wire_encode_release(&rel, r->tx, r->tx_cap, &len) != KVS_OK)
                continue;
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
