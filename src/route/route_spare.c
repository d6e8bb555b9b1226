/* route_spare — failover: a spare takes a failed hop's place. */
#include "route.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "route_impl.h"
#include "util.h"

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

/* Adds the candidates of p.more_spares for [first, last) that are not spares or hops yet, as
 * untried spares. True when at least one was added. */
static bool refill_spares(route *r, uint32_t first, uint32_t last) {
    char *spec = r->p.more_spares ? r->p.more_spares(r->p.more_spares_ctx, first, last) : NULL;
    route_addr *a = NULL;
    size_t n = 0;
    bool added = false;
    if (spec && *spec && route_parse_spec(spec, &a, &n, NULL, 0) == KVS_OK) {
        route_hop *sp = realloc(r->spares, (r->n_spares + n) * sizeof *sp);
        if (sp) r->spares = sp;
        uint8_t *st = sp ? realloc(r->spare_state, r->n_spares + n) : NULL;
        if (st) r->spare_state = st;
        for (size_t i = 0; st && i < n; i++) {
            bool known = false;
            for (uint32_t j = 0; j < r->n_spares && !known; j++) known = !strcmp(r->spares[j].addr.text, a[i].text);
            for (uint32_t k = 0; k < r->n_hops && !known; k++) known = !strcmp(r->hops[k].addr.text, a[i].text);
            if (known) continue;
            r->spares[r->n_spares] = (route_hop){.addr = a[i], .fd = -1};
            r->spare_state[r->n_spares++] = SPARE_UNTRIED;
            added = true;
        }
    }
    free(a);
    free(spec);
    return added;
}

/* Hop k failed with `err` (why): replace it and move the session to a new epoch. */
int route_reroute(route *r, route_session *s, uint32_t k, int err, const char *why, char *msg, size_t msg_cap) {
    route_hop old = r->hops[k];
    route_hop_disconnect(&r->hops[k]);
    route_log(r, "hop %u (%s) failed: %s", k, old.addr.text, why);
    if (route_take_spare(r, k) != KVS_OK &&
        (!refill_spares(r, old.info.first, old.info.last) || route_take_spare(r, k) != KVS_OK))
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

bool route_reconnect(route *r, uint32_t k, const char *why) {
    if (r->p.reconnect_grace_ms <= 0) return false;
    route_hop *h = &r->hops[k];
    const struct wire_info was = h->info;
    const int64_t timeout = r->p.timeout_ms;
    const uint64_t t0 = kvs_now_ns(), until = t0 + (uint64_t)r->p.reconnect_grace_ms * 1000000ull;
    unsigned wait_ms = 10;
    route_log(r, "hop %u (%s) failed (%s): calling it again for up to %lld ms", k, h->addr.text, why,
              (long long)r->p.reconnect_grace_ms);
    for (int attempt = 0; attempt < 10000; attempt++) {
        uint64_t now = kvs_now_ns();
        if (now >= until) break;
        /* No attempt outlives the grace: a shard that accepts but does not answer ends it too. */
        int64_t left_ms = (int64_t)((until - now) / 1000000ull) + 1;
        r->p.timeout_ms = timeout >= 0 && timeout < left_ms ? timeout : left_ms;
        char err[KVS_MSG_MAX] = "";
        int rc = route_hop_connect(r, h, err, sizeof err);
        r->p.timeout_ms = timeout;
        if (rc == KVS_OK && !memcmp(was.model_digest, h->info.model_digest, WIRE_DIGEST_SIZE) &&
            was.first == h->info.first && was.last == h->info.last) {
            r->reconnects++;
            route_log(r, "hop %u (%s): reconnected after %.0f ms; the session goes on at its epoch", k, h->addr.text,
                      (double)(kvs_now_ns() - t0) / 1e6);
            return true;
        }
        if (rc == KVS_OK) { /* another model or other layers there now: fail over */
            route_hop_disconnect(h);
            h->info = was;
            route_log(r, "hop %u (%s): it now serves another model or other layers", k, h->addr.text);
            return false;
        }
        h->info = was;
        struct timespec ts = {0, (long)wait_ms * 1000000L};
        nanosleep(&ts, NULL);
        if (wait_ms < 100) wait_ms *= 2;
    }
    route_log(r, "hop %u (%s): not back within %lld ms", k, h->addr.text, (long long)r->p.reconnect_grace_ms);
    return false;
}

int route_follow_move(route *r, uint32_t k, const char *to, char *msg, size_t msg_cap) {
    route_addr *a = NULL;
    size_t n = 0;
    char why[KVS_MSG_MAX] = "";
    if (route_parse_spec(to, &a, &n, why, sizeof why) != KVS_OK || n != 1) {
        free(a);
        return kvs_fail(msg, msg_cap, KVS_ERR_PROTOCOL, "hop %u (%s) answered MOVED with no usable address '%s'", k,
                        r->hops[k].addr.text, to);
    }
    route_hop nh = {.addr = a[0], .fd = -1};
    free(a);
    const struct wire_info *want = &r->hops[k].info;
    int rc = route_hop_connect(r, &nh, why, sizeof why);
    char what[ROUTE_ADDR_MAX + 16], ref[ROUTE_ADDR_MAX + 16];
    snprintf(what, sizeof what, "moved-to %s", nh.addr.text);
    snprintf(ref, sizeof ref, "hop %u (%s)", k, r->hops[k].addr.text);
    struct wire_info model = *want;
    memcpy(model.model_digest, r->digest, WIRE_DIGEST_SIZE);
    if (rc == KVS_OK && route_check_same_model(&model, ref, &nh.info, what, why, sizeof why) != KVS_OK)
        rc = KVS_ERR_INVALID_ARG;
    if (rc == KVS_OK && (nh.info.first != want->first || nh.info.last != want->last))
        rc = kvs_fail(why, sizeof why, KVS_ERR_INVALID_ARG, "it serves layers [%u, %u), not [%u, %u)", nh.info.first,
                      nh.info.last, want->first, want->last);
    if (rc != KVS_OK) {
        route_hop_disconnect(&nh);
        return kvs_fail(msg, msg_cap, rc, "hop %u (%s) moved the session to %s: %s", k, r->hops[k].addr.text,
                        nh.addr.text, why);
    }
    route_log(r, "hop %u (%s): the session moved to %s; following it (same epoch, nothing replayed)", k,
              r->hops[k].addr.text, nh.addr.text);
    route_hop_disconnect(&r->hops[k]);
    r->hops[k] = nh;
    r->moved++;
    route_limits(r);
    return KVS_OK;
}
