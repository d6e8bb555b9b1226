/*
 * http_lanes — the routes `kvshard api` drives (http.h design notes 2 and 3).
 *
 * Invariants (all under L->mu)
 *  L1. lanes[i].busy is true exactly while one request holds lane i; only that request's thread
 *      touches lanes[i].r and the sessions in lanes[i].kept (network I/O happens outside mu,
 *      with busy set).
 *  L2. A kept session is in exactly one slot and held by no request; a request takes it out of
 *      the table before driving it and puts it (or nothing) back in http_lanes_finish.
 *  L3. waiting <= p.queue_max; a request that would exceed it gets KVS_ERR_BUSY at once.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gguf.h"
#include "http_impl.h"
#include "util.h"

static void lanes_route_log(void *user, const char *line) {
    http_lanes *L = user;
    if (L->p.log) L->p.log(L->p.log_ctx, line);
}

static route_params lane_params(http_lanes *L, int64_t timeout_ms) {
    route_params rp = route_default_params();
    rp.timeout_ms = timeout_ms;
    rp.auth = L->p.auth;
    rp.tls_cert = L->p.tls_cert;
    rp.tls_key = L->p.tls_key;
    rp.tls_ca = L->p.tls_ca;
    rp.log = lanes_route_log;
    rp.log_user = L;
    return rp;
}

static int open_route(http_lanes *L, route **r, char *msg, size_t cap) {
    route_params rp = lane_params(L, L->p.route_timeout_ms);
    if (L->p.open_route) return L->p.open_route(L->p.open_route_ctx, &rp, r, msg, cap);
    return route_open(L->route_spec, L->spares_spec, &rp, r, msg, cap);
}

/* Closes a lane's route, telling p.route_stale first (it may count the lanes on each shard). */
static void lane_route_close(http_lanes *L, route *r) {
    if (r && L->p.route_stale) L->p.route_stale(L->p.open_route_ctx, r, true);
    route_close(r);
}

static char *dup_or_empty(const char *s) {
    size_t n = s ? strlen(s) : 0;
    char *d = malloc(n + 1);
    if (d) {
        if (n) memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

/* Copies the hop addresses of r into L->hops (caller holds mu). */
static void note_hops(http_lanes *L, const route *r) {
    route_info ri;
    route_get_info(r, &ri);
    L->n_hops = ri.n_hops < ROUTE_MAX_HOPS ? ri.n_hops : ROUTE_MAX_HOPS;
    for (uint32_t k = 0; k < L->n_hops; k++) snprintf(L->hops[k], ROUTE_ADDR_MAX, "%s", route_hop_addr(r, k));
}

/* The public prefix's tokens: the file's text as a prompt is tokenized (BOS, special tokens). */
static int load_public_prefix(http_lanes *L, const char *path, char *msg, size_t cap) {
    FILE *f = fopen(path, "rb");
    if (!f) return kvs_fail(msg, cap, KVS_ERR_IO, "cannot open the public prefix %.200s: %s", path, strerror(errno));
    char *text = malloc(HTTP_PUBLIC_PREFIX_MAX + 1);
    size_t n = text ? fread(text, 1, HTTP_PUBLIC_PREFIX_MAX + 1, f) : 0;
    fclose(f);
    if (!text) return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
    int err = KVS_OK;
    if (n > HTTP_PUBLIC_PREFIX_MAX)
        err = kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "the public prefix %.200s is over %d bytes", path,
                       HTTP_PUBLIC_PREFIX_MAX);
    else if (n == 0 || memchr(text, 0, n))
        err = kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "the public prefix %.200s is empty or not text", path);
    if (!err) {
        text[n] = 0;
        err = gen_tokenize(L->vocab, text, tok_add_bos(L->vocab), true, &L->pub_ids, &L->n_pub);
        if (err) err = kvs_fail(msg, cap, err, "the public prefix %.200s cannot be tokenized", path);
    }
    free(text);
    return err;
}

int http_lanes_open(http_lanes *L, const http_params *p, char *msg, size_t cap) {
    memset(L, 0, sizeof *L);
    L->p = *p;
    pthread_mutex_init(&L->mu, NULL);
    pthread_cond_init(&L->cv, NULL);
    L->route_spec = dup_or_empty(p->route);
    L->spares_spec = dup_or_empty(p->spares);
    L->lanes = calloc((size_t)p->lanes, sizeof *L->lanes);
    if (!L->route_spec || !L->spares_spec || !L->lanes) goto nomem;
    for (int i = 0; i < p->lanes; i++) {
        if (p->prefix_slots > 0 && !(L->lanes[i].kept = calloc((size_t)p->prefix_slots, sizeof(http_kept)))) goto nomem;
        int err = open_route(L, &L->lanes[i].r, msg, cap);
        if (err) {
            http_lanes_close(L);
            return err;
        }
    }
    route_get_info(L->lanes[0].r, &L->info);
    note_hops(L, L->lanes[0].r);
    int err;
    if (p->tokenizer_path && p->tokenizer_path[0]) {
        gguf_ctx *g = NULL;
        err = gguf_open_header(p->tokenizer_path, &g, msg, cap);
        if (!err) err = tok_from_gguf(g, &L->vocab, msg, cap);
        gguf_close(g);
    } else {
        err = route_fetch_vocab(L->lanes[0].r, &L->vocab, msg, cap);
    }
    if (!err && (uint32_t)tok_n_vocab(L->vocab) != L->info.n_vocab)
        err = kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "the tokenizer has %d tokens but the route's model %u",
                       (int)tok_n_vocab(L->vocab), L->info.n_vocab);
    if (!err) err = http_chat_pick(L->vocab, p->chat_template, &L->chat_tmpl, msg, cap);
    if (!err && p->public_prefix) err = load_public_prefix(L, p->public_prefix, msg, cap);
    if (err) {
        http_lanes_close(L);
        return err;
    }
    return KVS_OK;
nomem:
    http_lanes_close(L);
    return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
}

static void kept_drop(http_lanes *L, int lane, http_kept *k) {
    route_release(L->lanes[lane].r, k->s);
    free(k->hist);
    memset(k, 0, sizeof *k);
}

void http_lanes_close(http_lanes *L) {
    if (L->lanes) {
        for (int i = 0; i < L->p.lanes; i++) {
            http_lane *ln = &L->lanes[i];
            if (ln->kept)
                for (int j = 0; j < L->p.prefix_slots; j++)
                    if (ln->kept[j].s) kept_drop(L, i, &ln->kept[j]);
            free(ln->kept);
            lane_route_close(L, ln->r);
        }
    }
    free(L->lanes);
    tok_free(L->vocab);
    free(L->pub_ids);
    free(L->route_spec);
    free(L->spares_spec);
    pthread_mutex_destroy(&L->mu);
    pthread_cond_destroy(&L->cv);
    memset(L, 0, sizeof *L);
}

static uint32_t common_prefix(const int32_t *a, uint32_t na, const int32_t *b, uint32_t nb) {
    uint32_t n = na < nb ? na : nb, i = 0;
    while (i < n && a[i] == b[i]) i++;
    return i;
}

static void deadline_in(struct timespec *ts, int64_t ms) {
    clock_gettime(CLOCK_REALTIME, ts);
    ts->tv_sec += (time_t)(ms / 1000);
    ts->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

static bool any_free(const http_lanes *L) {
    for (int i = 0; i < L->p.lanes; i++)
        if (!L->lanes[i].busy) return true;
    return false;
}

/* The lane (held busy, L1) drops its route for a new one: its kept sessions, taken or not, are
 * released on the old route first; the next open_route plans afresh. */
static void lane_replace_route(http_lanes *L, http_lane *ln, route_session **taken) {
    if (*taken) route_release(ln->r, *taken);
    *taken = NULL;
    for (int j = 0; j < L->p.prefix_slots; j++)
        if (ln->kept[j].s) {
            route_release(ln->r, ln->kept[j].s);
            free(ln->kept[j].hist);
            memset(&ln->kept[j], 0, sizeof ln->kept[j]);
        }
    route_info ri;
    route_get_info(ln->r, &ri);
    route_close(ln->r); /* route_stale already took it off its counts */
    pthread_mutex_lock(&L->mu);
    L->reroutes_done += ri.reroutes;
    ln->r = NULL;
    ln->reroutes = 0;
    pthread_mutex_unlock(&L->mu);
}

int http_lanes_acquire(http_lanes *L, const int32_t *prompt, uint32_t n, uint64_t owner, int *lane,
                       route_session **kept, uint32_t *reuse, char *msg, size_t cap) {
    *lane = -1;
    *kept = NULL;
    *reuse = 0;
    pthread_mutex_lock(&L->mu);
    if (!any_free(L)) {
        if (L->waiting >= L->p.queue_max) {
            pthread_mutex_unlock(&L->mu);
            return kvs_fail(msg, cap, KVS_ERR_BUSY, "all %d lanes are busy and %d requests are queued", L->p.lanes,
                            L->p.queue_max);
        }
        struct timespec until;
        deadline_in(&until, L->p.queue_timeout_ms);
        L->waiting++;
        int rc = 0;
        while (!any_free(L) && rc != ETIMEDOUT) rc = pthread_cond_timedwait(&L->cv, &L->mu, &until);
        L->waiting--;
        if (!any_free(L)) {
            pthread_mutex_unlock(&L->mu);
            return kvs_fail(msg, cap, KVS_ERR_BUSY, "no lane became free within %lld ms",
                            (long long)L->p.queue_timeout_ms);
        }
    }
    int best_lane = -1, best_slot = -1;
    uint32_t best = 0;
    for (int i = 0; i < L->p.lanes; i++) {
        if (L->lanes[i].busy) continue;
        if (best_lane < 0) best_lane = i;
        for (int j = 0; j < L->p.prefix_slots; j++) {
            const http_kept *k = &L->lanes[i].kept[j];
            if (!k->s || k->owner != owner) continue; /* another client's prompt is not an oracle */
            uint32_t c = common_prefix(prompt, n, k->hist, k->n);
            if (c > best) {
                best = c;
                best_lane = i;
                best_slot = j;
            }
        }
    }
    http_lane *ln = &L->lanes[best_lane];
    ln->busy = true;
    ln->owner = owner;
    if (best >= HTTP_MIN_REUSE) {
        http_kept *k = &ln->kept[best_slot];
        *kept = k->s;
        *reuse = best < n ? best : n - 1;
        free(k->hist);
        memset(k, 0, sizeof *k);
        L->reuse_hits++;
        L->reused_tokens += *reuse;
    } else {
        L->reuse_misses++;
    }
    pthread_mutex_unlock(&L->mu);
    *lane = best_lane;
    if (*kept && route_session_rewind(*kept, *reuse) != KVS_OK) { /* cannot happen: reuse <= hist n */
        route_release(ln->r, *kept);
        *kept = NULL;
        *reuse = 0;
    }
    if (ln->r && L->p.route_stale && L->p.route_stale(L->p.open_route_ctx, ln->r, false)) {
        lane_replace_route(L, ln, kept);
        *reuse = 0;
    }
    if (!ln->r) {
        int err = open_route(L, &ln->r, msg, cap);
        if (err) {
            http_lanes_finish(L, best_lane, NULL, NULL, 0, false, false);
            *lane = -1;
            return err;
        }
    }
    return KVS_OK;
}

void http_lanes_finish(http_lanes *L, int lane, route_session *s, const int32_t *hist, uint32_t n, bool keep,
                       bool broken) {
    http_lane *ln = &L->lanes[lane];
    http_kept victim = {0};
    bool stored = false;
    if (keep && s && !broken && L->p.prefix_slots > 0 && n > 0) {
        int32_t *copy = malloc((size_t)n * sizeof *copy);
        if (copy) {
            memcpy(copy, hist, (size_t)n * sizeof *copy);
            pthread_mutex_lock(&L->mu);
            int slot = 0;
            for (int j = 0; j < L->p.prefix_slots; j++) {
                if (!ln->kept[j].s) {
                    slot = j;
                    break;
                }
                if (ln->kept[j].last_used < ln->kept[slot].last_used) slot = j;
            }
            victim = ln->kept[slot];
            ln->kept[slot] = (http_kept){.s = s, .hist = copy, .n = n, .cap = n, .last_used = ++L->clock,
                                         .owner = ln->owner};
            pthread_mutex_unlock(&L->mu);
            stored = true;
        }
    }
    /* Network I/O with the lane still busy (L1). */
    if (victim.s) kept_drop(L, lane, &victim);
    if (s && !stored) route_release(broken ? NULL : ln->r, s);
    if (broken && ln->r) {
        for (int j = 0; j < L->p.prefix_slots; j++)
            if (ln->kept[j].s) {
                route_session_forget(ln->kept[j].s);
                free(ln->kept[j].hist);
                memset(&ln->kept[j], 0, sizeof ln->kept[j]);
            }
        route_info ri;
        route_get_info(ln->r, &ri);
        lane_route_close(L, ln->r);
        pthread_mutex_lock(&L->mu);
        L->reroutes_done += ri.reroutes;
        ln->r = NULL;
        ln->reroutes = 0;
        pthread_mutex_unlock(&L->mu);
    }
    route_info ri = {0};
    if (ln->r) route_get_info(ln->r, &ri);
    pthread_mutex_lock(&L->mu);
    if (ln->r) note_hops(L, ln->r);
    ln->reroutes = ri.reroutes;
    ln->busy = false;
    pthread_cond_signal(&L->cv);
    pthread_mutex_unlock(&L->mu);
}

bool http_lanes_health(http_lanes *L, int64_t timeout_ms, char *report, size_t cap) {
    /* A fresh route over the current hops: every hop connects (TLS when configured), answers
     * HELLO with INFO, and the hops still fit together (route_open). */
    char spec[ROUTE_MAX_HOPS * ROUTE_ADDR_MAX];
    size_t used = 0;
    pthread_mutex_lock(&L->mu);
    for (uint32_t k = 0; k < L->n_hops && used < sizeof spec; k++) {
        int w = snprintf(spec + used, sizeof spec - used, "%s%s", k ? "," : "", L->hops[k]);
        if (w > 0) used += (size_t)w;
    }
    pthread_mutex_unlock(&L->mu);
    route_params rp = lane_params(L, timeout_ms);
    rp.log = NULL;
    route *r = NULL;
    char msg[KVS_MSG_MAX] = "";
    int err = used ? route_open(spec, NULL, &rp, &r, msg, sizeof msg) : KVS_ERR_NOT_FOUND;
    route_close(r);
    if (err) snprintf(report, cap, "%s: %s", spec, msg[0] ? msg : kvs_strerror(err));
    else snprintf(report, cap, "%s: every hop answered", spec);
    return err == KVS_OK;
}
