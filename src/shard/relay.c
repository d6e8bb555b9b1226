/*
 * relay — shard-to-shard push links and the RELAY_LISTEN table. See relay.h for the design notes.
 *
 * Invariants
 *  I1. A push is on exactly one queue until its done() call; done() is called without any relay
 *      lock held, so it may call back into the server freely (not into relay_destroy).
 *  I2. link->fd is touched only by the link's worker thread (and by relay_destroy after the
 *      worker has been joined).
 */
#include "relay.h"

#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <sodium.h>

#include "kvshard.h"
#include "log.h"
#include "netio.h"
#include "tls.h"
#include "util.h"
#include "wire.h"

typedef struct relay_item {
    struct relay_item *next;
    uint8_t *payload; /* FORWARD payload, owned */
    size_t len;
    uint64_t rid;
    uint16_t hop;
    void *target;
} relay_item;

typedef struct relay_link {
    struct relay_link *next;
    relay *r;
    char addr[RELAY_ADDR_MAX];  /* canonical (relay_canon_addr) */
    char host[NETIO_HOST_MAX];
    uint16_t port;
    int fd;                     /* -1 when not connected (I2) */
    pthread_t thread;
    relay_item *head, *tail;    /* guarded by r->mu */
    bool stop;                  /* guarded by r->mu */
    bool exited;                /* the worker left on idle; relay_reap joins it (guarded by r->mu) */
    uint64_t down_until;        /* kvs_now_ns() until which pushes fail at once (guarded by r->mu) */
    char down_why[KVS_MSG_MAX]; /* why the last connect failed (guarded by r->mu) */
} relay_link;

/* A RELAY_LISTEN registration: on the id chain of its bucket and on its target's list. */
typedef struct listen_ent {
    uint64_t id, owner;
    void *target;
    struct listen_ent *next, *tnext;
} listen_ent;

/* The registrations of one target (a connection), for its per-target cap and drop. */
typedef struct listen_tgt {
    void *target;
    uint32_t n;
    listen_ent *first;
    struct listen_tgt *next;
} listen_tgt;

struct relay {
    relay_params p;
    char *auth;
    pthread_mutex_t mu;         /* links, queues, stop flags, counters */
    pthread_cond_t cv;          /* a queue got an item or a stop */
    relay_link *links;
    relay_stats st;             /* st.links: links not yet reaped; st.queued_bytes: items not done */
    char (*allow)[RELAY_ADDR_MAX]; /* (n_allow) canonical next hops allowed */
    size_t n_allow;
    pthread_mutex_t listen_mu;  /* the listen table (design note 4) */
    listen_ent **by_id;         /* (n_buckets) chains, bucket of listen_hash(id) */
    listen_tgt **by_target;     /* (n_buckets) chains, bucket of target_hash(target) */
    size_t n_buckets;           /* a power of two >= max_listeners */
    size_t n_listeners;
    uint8_t hash_key[crypto_shorthash_KEYBYTES]; /* ids are the clients' choice: keyed buckets */
};

relay_params relay_default_params(void) {
    return (relay_params){.timeout_ms = 10000, .max_links = 64, .idle_ms = 60000, .retry_ms = 1000,
                          .max_queued_bytes = (size_t)256 << 20, .max_listeners = 4096, .max_listeners_per_target = 16};
}

int relay_canon_addr(const char *addr, char out[RELAY_ADDR_MAX]) {
    char host[NETIO_HOST_MAX], ip[INET6_ADDRSTRLEN];
    uint16_t port;
    struct in_addr a4;
    struct in6_addr a6;
    if (!addr || netio_parse_hostport(addr, host, sizeof host, &port) != KVS_OK || port == 0)
        return KVS_ERR_INVALID_ARG;
    if (inet_pton(AF_INET, host, &a4) == 1 && inet_ntop(AF_INET, &a4, ip, sizeof ip))
        snprintf(out, RELAY_ADDR_MAX, "%s:%u", ip, (unsigned)port);
    else if (inet_pton(AF_INET6, host, &a6) == 1 && inet_ntop(AF_INET6, &a6, ip, sizeof ip))
        snprintf(out, RELAY_ADDR_MAX, "[%s]:%u", ip, (unsigned)port);
    else
        return KVS_ERR_INVALID_ARG;
    return KVS_OK;
}

/* True for a canonical address on 127.0.0.0/8 or ::1. */
static bool canon_is_loopback(const char *canon) {
    return !strncmp(canon, "127.", 4) || !strncmp(canon, "[::1]:", 6);
}

bool relay_allowed(const relay *r, const char *addr) {
    char canon[RELAY_ADDR_MAX];
    if (relay_canon_addr(addr, canon) != KVS_OK) return false;
    if (!r->n_allow) return r->p.allow_loopback && canon_is_loopback(canon);
    for (size_t i = 0; i < r->n_allow; i++)
        if (!strcmp(r->allow[i], canon)) return true;
    return false;
}

/* Parses the comma-separated allow list into r->allow; KVS_OK, INVALID_ARG or NOMEM. */
static int parse_allow(relay *r, const char *list) {
    const char *p = list;
    while (p && *p) {
        const char *end = strchr(p, ',');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        char one[RELAY_ADDR_MAX + 8];
        if (n == 0 || n >= sizeof one) return KVS_ERR_INVALID_ARG;
        memcpy(one, p, n);
        one[n] = 0;
        void *grown = realloc(r->allow, (r->n_allow + 1) * sizeof *r->allow);
        if (!grown) return KVS_ERR_NOMEM;
        r->allow = grown;
        if (relay_canon_addr(one, r->allow[r->n_allow]) != KVS_OK) return KVS_ERR_INVALID_ARG;
        r->n_allow++;
        p = end ? end + 1 : NULL;
    }
    return KVS_OK;
}

int relay_create(const relay_params *p, relay **out) {
    if (!out) return KVS_ERR_INVALID_ARG;
    *out = NULL;
    if (!p || !p->done || p->max_listeners < 1 || p->max_listeners_per_target < 1) return KVS_ERR_INVALID_ARG;
    relay *r = calloc(1, sizeof *r);
    if (!r) return KVS_ERR_NOMEM;
    r->p = *p;
    r->auth = strdup(p->auth ? p->auth : "");
    for (r->n_buckets = 16; r->n_buckets < (size_t)p->max_listeners; r->n_buckets *= 2) {
    }
    r->by_id = calloc(r->n_buckets, sizeof *r->by_id);
    r->by_target = calloc(r->n_buckets, sizeof *r->by_target);
    randombytes_buf(r->hash_key, sizeof r->hash_key);
    int rc = r->auth && r->by_id && r->by_target ? parse_allow(r, p->allow) : KVS_ERR_NOMEM;
    if (rc != KVS_OK) {
        free(r->by_id);
        free(r->by_target);
        free(r->allow);
        free(r->auth);
        free(r);
        return rc;
    }
    r->p.auth = NULL;
    r->p.allow = NULL; /* parsed; the caller's strings need not outlive relay_create */
    pthread_mutex_init(&r->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* the idle wait's clock, as kvs_now_ns */
    pthread_cond_init(&r->cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&r->listen_mu, NULL);
    *out = r;
    return KVS_OK;
}

static void link_close(relay_link *l) {
    if (l->fd >= 0) netio_close(l->fd); /* ends a TLS session too */
    l->fd = -1;
}

/* Connects l and says HELLO (v2); KVS_OK, or the error with why. */
static int link_connect(relay_link *l, char *why, size_t cap) {
    relay *r = l->r;
    uint64_t deadline = netio_deadline_ms(r->p.timeout_ms);
    char nmsg[KVS_MSG_MAX] = "";
    int rc = netio_connect(l->host, l->port, deadline, &l->fd, nmsg, sizeof nmsg);
    if (rc != KVS_OK) {
        l->fd = -1;
        return kvs_fail(why, cap, rc, "cannot connect: %s", nmsg[0] ? nmsg : kvs_strerror(rc));
    }
    char peer[TLS_ID_MAX];
    if (r->p.tls && (rc = tls_handshake(r->p.tls, l->fd, deadline, peer, sizeof peer, nmsg, sizeof nmsg)) != KVS_OK) {
        link_close(l);
        return kvs_fail(why, cap, rc, "TLS: %s", nmsg);
    }
    struct wire_hello h = {.min_version = 2, .max_version = WIRE_PROTO_VERSION};
    size_t alen = strlen(r->auth);
    if (alen > WIRE_MAX_AUTH) alen = WIRE_MAX_AUTH;
    h.auth_len = (uint16_t)alen;
    memcpy(h.auth, r->auth, alen);
    uint8_t buf[8 + WIRE_MAX_AUTH];
    size_t len = 0;
    struct netio_buf rx = {0};
    struct wire_header hdr;
    struct wire_info info;
    if ((rc = wire_encode_hello(&h, buf, sizeof buf, &len)) == KVS_OK &&
        (rc = netio_send_frame(l->fd, WIRE_OP_HELLO, 1, buf, len, deadline)) == KVS_OK &&
        (rc = netio_recv_frame(l->fd, &hdr, &rx, deadline, nmsg, sizeof nmsg)) == KVS_OK) {
        if (hdr.op != WIRE_OP_INFO) rc = kvs_fail(nmsg, sizeof nmsg, KVS_ERR_PROTOCOL, "answered %s", wire_op_name(hdr.op));
        else if ((rc = wire_decode_info(rx.data, rx.len, &info, nmsg, sizeof nmsg)) == KVS_OK && info.st.status != KVS_OK)
            rc = kvs_fail(nmsg, sizeof nmsg, info.st.status, "refused HELLO: %s", kvs_strerror(info.st.status));
        else if (rc == KVS_OK && info.version < 2)
            rc = kvs_fail(nmsg, sizeof nmsg, KVS_ERR_UNSUPPORTED, "speaks protocol version %u only", info.version);
    }
    netio_buf_free(&rx);
    if (rc != KVS_OK) {
        link_close(l);
        return kvs_fail(why, cap, rc, "%s", nmsg[0] ? nmsg : kvs_strerror(rc));
    }
    pthread_mutex_lock(&r->mu);
    r->st.connects++;
    pthread_mutex_unlock(&r->mu);
    kvs_logf(r->p.log, r->p.ctx, "relay: connected to %s", l->addr);
    return KVS_OK;
}

/* Reads and drops whatever the next hop sent on the link (design note 3); false on EOF/error. */
static bool link_drain(relay_link *l) {
    struct netio_buf junk = {0};
    bool ok = true;
    for (;;) {
        tls_conn *t = tls_conn_of(l->fd);
        struct pollfd pf = {.fd = l->fd, .events = POLLIN};
        int n = t && tls_conn_pending(t) ? 1 : poll(&pf, 1, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            ok = n == 0;
            break;
        }
        struct wire_header hdr;
        char msg[KVS_MSG_MAX];
        if (netio_recv_frame(l->fd, &hdr, &junk, netio_deadline_ms(1000), msg, sizeof msg) != KVS_OK) {
            ok = false;
            break;
        }
        kvs_logf(l->r->p.log, l->r->p.ctx, "relay: %s answered %s (request %llu) on the link; dropped", l->addr,
                 wire_op_name(hdr.op), (unsigned long long)hdr.request_id);
    }
    netio_buf_free(&junk);
    return ok;
}

/* Sends one item; KVS_OK or the error with why. One reconnect when the link was broken. */
static int link_send(relay_link *l, const relay_item *it, char *why, size_t cap) {
    if (l->fd >= 0 && !link_drain(l)) {
        kvs_logf(l->r->p.log, l->r->p.ctx, "relay: %s closed the link; reconnecting", l->addr);
        link_close(l);
    }
    int rc = KVS_OK;
    if (l->fd < 0 && (rc = link_connect(l, why, cap)) != KVS_OK) return rc;
    rc = netio_send_frame(l->fd, WIRE_OP_FORWARD, it->rid, it->payload, it->len, netio_deadline_ms(l->r->p.timeout_ms));
    if (rc != KVS_OK) {
        link_close(l);
        return kvs_fail(why, cap, rc, "sending FORWARD: %s", kvs_strerror(rc));
    }
    return KVS_OK;
}

/* Waits (r->mu held) for an item or a stop; false when the link stayed idle for idle_ms. */
static bool link_wait(relay_link *l) {
    relay *r = l->r;
    uint64_t until = r->p.idle_ms > 0 ? kvs_now_ns() + (uint64_t)r->p.idle_ms * 1000000ull : 0;
    while (!l->head && !l->stop) {
        if (!until) {
            pthread_cond_wait(&r->cv, &r->mu);
            continue;
        }
        uint64_t now = kvs_now_ns();
        if (now >= until) return false;
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t at = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec + (until - now);
        ts.tv_sec = (time_t)(at / 1000000000ull);
        ts.tv_nsec = (long)(at % 1000000000ull);
        pthread_cond_timedwait(&r->cv, &r->mu, &ts);
    }
    return true;
}

/* One item's outcome: counters, done, then the item freed and its bytes returned. */
static void item_finish(relay_link *l, relay_item *it, int rc, const char *why) {
    relay *r = l->r;
    if (rc != KVS_OK) kvs_logf(r->p.log, r->p.ctx, "relay: push to hop %u (%s) failed: %s", it->hop, l->addr, why);
    pthread_mutex_lock(&r->mu);
    if (rc == KVS_OK) r->st.pushed++;
    else r->st.failed++;
    pthread_mutex_unlock(&r->mu);
    r->p.done(r->p.ctx, it->target, it->rid, it->hop, l->addr, it->len, rc, why);
    pthread_mutex_lock(&r->mu);
    r->st.queued_bytes -= it->len; /* after done: the caller's accounting is released first */
    pthread_mutex_unlock(&r->mu);
    free(it->payload);
    free(it);
}

static void *link_main(void *arg) {
    relay_link *l = arg;
    relay *r = l->r;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        if (!link_wait(l)) {
            l->exited = true; /* idle: relay_reap joins and frees us */
            break;
        }
        relay_item *it = l->head;
        if (!it) break; /* stopped, queue empty */
        l->head = it->next;
        if (!l->head) l->tail = NULL;
        bool stopping = l->stop, down = l->down_until > kvs_now_ns();
        char why[KVS_MSG_MAX] = "";
        if (down) snprintf(why, sizeof why, "%s", l->down_why);
        pthread_mutex_unlock(&r->mu);
        int rc = stopping ? kvs_fail(why, sizeof why, KVS_ERR_CLOSED, "the shard is shutting down")
                 : down   ? KVS_ERR_CLOSED
                          : link_send(l, it, why, sizeof why);
        if (rc != KVS_OK && l->fd < 0 && !down && !stopping) {
            pthread_mutex_lock(&r->mu); /* the hop is down: what is queued behind fails at once */
            l->down_until = kvs_now_ns() + (uint64_t)(r->p.retry_ms > 0 ? r->p.retry_ms : 0) * 1000000ull;
            snprintf(l->down_why, sizeof l->down_why, "next hop down: %.200s", why);
            pthread_mutex_unlock(&r->mu);
        }
        item_finish(l, it, rc, why);
        pthread_mutex_lock(&r->mu);
    }
    pthread_mutex_unlock(&r->mu);
    link_close(l);
    return NULL;
}

/* Joins and frees every link whose worker left on idle. Called with r->mu (the worker no
 * longer takes it once exited is set). */
static void relay_reap(relay *r) {
    for (relay_link **pl = &r->links; *pl;) {
        relay_link *l = *pl;
        if (!l->exited) {
            pl = &l->next;
            continue;
        }
        *pl = l->next;
        pthread_join(l->thread, NULL);
        free(l);
        r->st.links--;
    }
}

/* The link for the canonical address canon, created (with its thread) when new; NULL with the
 * status in *rc on failure. Called with r->mu. */
static relay_link *link_get(relay *r, const char *canon, int *rc, char *why, size_t cap) {
    relay_reap(r);
    for (relay_link *l = r->links; l; l = l->next)
        if (!strcmp(l->addr, canon)) return l;
    if (r->st.links >= (uint64_t)(r->p.max_links > 0 ? r->p.max_links : 0)) {
        *rc = kvs_fail(why, cap, KVS_ERR_BUSY, "%d relay links are open already", r->p.max_links);
        return NULL;
    }
    relay_link *l = calloc(1, sizeof *l);
    if (!l) {
        *rc = kvs_fail(why, cap, KVS_ERR_NOMEM, "out of memory");
        return NULL;
    }
    l->r = r;
    l->fd = -1;
    snprintf(l->addr, sizeof l->addr, "%s", canon);
    if (netio_parse_hostport(canon, l->host, sizeof l->host, &l->port) != KVS_OK) {
        free(l);
        *rc = kvs_fail(why, cap, KVS_ERR_INVALID_ARG, "'%s' is not HOST:PORT", canon);
        return NULL;
    }
    if (pthread_create(&l->thread, NULL, link_main, l) != 0) {
        free(l);
        *rc = kvs_fail(why, cap, KVS_ERR_NOMEM, "cannot start a link thread");
        return NULL;
    }
    l->next = r->links;
    r->links = l;
    r->st.links++;
    return l;
}

/* Why a push to addr cannot be queued now (KVS_OK: it can), with *lp its link. r->mu held. */
static int push_admit(relay *r, const char *addr, size_t len, relay_link **lp, char *why, size_t cap) {
    char canon[RELAY_ADDR_MAX];
    *lp = NULL;
    if (relay_canon_addr(addr, canon) != KVS_OK)
        return kvs_fail(why, cap, KVS_ERR_INVALID_ARG, "'%s' is not a numeric HOST:PORT", addr);
    if (!relay_allowed(r, canon))
        return kvs_fail(why, cap, KVS_ERR_INVALID_ARG, "%s is not an allowed next hop (--relay-allow)", canon);
    if (len > r->p.max_queued_bytes || r->st.queued_bytes > r->p.max_queued_bytes - len)
        return kvs_fail(why, cap, KVS_ERR_BUSY, "relay queue full (%zu bytes)", r->p.max_queued_bytes);
    int rc = KVS_OK;
    relay_link *l = link_get(r, canon, &rc, why, cap);
    if (!l) return rc;
    if (l->down_until > kvs_now_ns()) return kvs_fail(why, cap, KVS_ERR_CLOSED, "%s", l->down_why);
    *lp = l;
    return KVS_OK;
}

void relay_push(relay *r, const char *addr, uint16_t hop, uint8_t *payload, size_t len, uint64_t request_id,
                void *target) {
    char why[KVS_MSG_MAX] = "";
    int rc = KVS_OK;
    relay_link *l = NULL;
    relay_item *it = calloc(1, sizeof *it);
    if (!it) rc = kvs_fail(why, sizeof why, KVS_ERR_NOMEM, "out of memory");
    pthread_mutex_lock(&r->mu);
    if (rc == KVS_OK) rc = push_admit(r, addr, len, &l, why, sizeof why);
    if (rc == KVS_OK) {
        *it = (relay_item){.payload = payload, .len = len, .rid = request_id, .hop = hop, .target = target};
        if (l->tail) l->tail->next = it;
        else l->head = it;
        l->tail = it;
        r->st.queued_bytes += len;
        pthread_cond_broadcast(&r->cv);
    } else {
        r->st.failed++;
    }
    pthread_mutex_unlock(&r->mu);
    if (rc != KVS_OK) {
        free(it);
        free(payload);
        r->p.done(r->p.ctx, target, request_id, hop, addr, len, rc, why);
    }
}

void relay_stop(relay *r) {
    if (!r) return;
    pthread_mutex_lock(&r->mu);
    for (relay_link *l = r->links; l; l = l->next) l->stop = true;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    relay_link *l = r->links;
    while (l) {
        relay_link *next = l->next;
        pthread_join(l->thread, NULL); /* the worker fails what was queued (done CLOSED) */
        free(l);
        l = next;
    }
    r->links = NULL;
    r->st.links = 0;
}

void relay_destroy(relay *r) {
    if (!r) return;
    relay_stop(r);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    pthread_mutex_destroy(&r->listen_mu);
    for (size_t b = 0; b < r->n_buckets; b++) {
        for (listen_ent *e = r->by_id[b], *nx; e; e = nx) {
            nx = e->next;
            free(e);
        }
        for (listen_tgt *t = r->by_target[b], *nx; t; t = nx) {
            nx = t->next;
            free(t);
        }
    }
    free(r->by_id);
    free(r->by_target);
    free(r->allow);
    free(r->auth);
    free(r);
}

int relay_build_next(const struct wire_relay *rl, const uint8_t sid[16], uint64_t epoch, uint32_t start_pos,
                     uint32_t n, uint32_t out_mode, const struct wire_sample_req *sample,
                     const struct wire_prefix *prefix, const float *hidden, uint32_t n_embd, uint8_t **payload,
                     size_t *len) {
    *payload = NULL;
    *len = 0;
    if (!rl || rl->n_next < 1 || !hidden) return KVS_ERR_INVALID_ARG;
    struct wire_forward *f = calloc(1, sizeof *f);
    if (!f) return KVS_ERR_NOMEM;
    const struct wire_relay_hop *nx = &rl->next[0];
    memcpy(f->session_id, sid, WIRE_SID_SIZE);
    f->epoch = epoch;
    f->start_pos = start_pos;
    f->n_tokens = n;
    f->flags = (nx->flags & WIRE_FWD_INHERIT) | WIRE_FWD_RELAY;
    f->out_mode = out_mode;
    f->inherit_epoch = nx->inherit_epoch;
    f->inherit_len = nx->inherit_len;
    f->in_kind = rl->hidden_kind;
    f->n_embd = n_embd;
    if (out_mode == WIRE_OUT_SAMPLE && sample) f->sample = *sample;
    if (prefix && prefix->n_hashes) { /* every hop keys its blocks by the same hashes */
        f->flags |= WIRE_FWD_PREFIX;
        f->prefix = *prefix;
    }
    f->relay.relay_id = rl->relay_id;
    f->relay.hop = (uint16_t)(rl->hop + 1);
    f->relay.hidden_kind = rl->hidden_kind;
    f->relay.n_next = (uint16_t)(rl->n_next - 1);
    memcpy(f->relay.next, rl->next + 1, (size_t)f->relay.n_next * sizeof f->relay.next[0]);
    size_t cnt = (size_t)n * n_embd;
    uint16_t *half = NULL;
    if (rl->hidden_kind == WIRE_IN_HIDDEN_F16 || rl->hidden_kind == WIRE_IN_HIDDEN_BF16) {
        half = malloc(cnt * sizeof *half);
        if (!half) {
            free(f);
            return KVS_ERR_NOMEM;
        }
        if (rl->hidden_kind == WIRE_IN_HIDDEN_F16)
            for (size_t i = 0; i < cnt; i++) half[i] = wire_f32_to_f16(hidden[i]);
        else
            for (size_t i = 0; i < cnt; i++) half[i] = wire_f32_to_bf16(hidden[i]);
        f->data = half;
    } else {
        f->data = hidden; /* f32 rows are their own wire form on a little-endian host (wire.h note 4) */
    }
    int rc = wire_encode_forward(f, NULL, 0, len);
    uint8_t *buf = rc == KVS_OK ? malloc(*len) : NULL;
    if (rc == KVS_OK && !buf) rc = KVS_ERR_NOMEM;
    if (rc == KVS_OK) rc = wire_encode_forward(f, buf, *len, len);
    free(half);
    free(f);
    if (rc != KVS_OK) {
        free(buf);
        *len = 0;
        return rc;
    }
    *payload = buf;
    return KVS_OK;
}

static size_t listen_bucket(const relay *r, uint64_t id) {
    uint8_t h[crypto_shorthash_BYTES];
    crypto_shorthash(h, (const unsigned char *)&id, sizeof id, r->hash_key);
    uint64_t v;
    memcpy(&v, h, sizeof v);
    return (size_t)(v & (r->n_buckets - 1));
}

static size_t target_bucket(const relay *r, const void *target) {
    uint64_t v = (uint64_t)(uintptr_t)target * 0x9e3779b97f4a7c15ull; /* pointers are ours, not a client's */
    return (size_t)((v >> 32) & (r->n_buckets - 1));
}

/* The registration of id, or NULL (listen_mu held); *link: the pointer that points at it. */
static listen_ent *listen_find(relay *r, uint64_t id, listen_ent ***link) {
    listen_ent **pp = &r->by_id[listen_bucket(r, id)];
    while (*pp && (*pp)->id != id) pp = &(*pp)->next;
    if (link) *link = pp;
    return *pp;
}

/* The target's record, created when create is set (NULL: none, or out of memory). */
static listen_tgt *target_find(relay *r, void *target, bool create) {
    listen_tgt **pp = &r->by_target[target_bucket(r, target)];
    while (*pp && (*pp)->target != target) pp = &(*pp)->next;
    if (!*pp && create && (*pp = calloc(1, sizeof **pp))) (*pp)->target = target;
    return *pp;
}

/* Takes e off its target's list; frees the target's record when it was the last (listen_mu held). */
static void target_unlink(relay *r, listen_ent *e) {
    listen_tgt **tp = &r->by_target[target_bucket(r, e->target)];
    while (*tp && (*tp)->target != e->target) tp = &(*tp)->next;
    listen_tgt *t = *tp;
    if (!t) return;
    for (listen_ent **pp = &t->first; *pp; pp = &(*pp)->tnext)
        if (*pp == e) {
            *pp = e->tnext;
            t->n--;
            break;
        }
    if (!t->n) {
        *tp = t->next;
        free(t);
    }
}

int relay_listen_add(relay *r, uint64_t relay_id, uint64_t owner, void *target) {
    int rc = KVS_OK;
    pthread_mutex_lock(&r->listen_mu);
    listen_ent **link, *e = listen_find(r, relay_id, &link);
    listen_tgt *t = target_find(r, target, false);
    if (e && e->owner != owner)
        rc = KVS_ERR_INVALID_ARG; /* another identity's id: never moved to a stranger (issue 42 item 12) */
    else if (e && e->target == target)
        rc = KVS_OK;
    else if ((t && t->n >= (uint32_t)r->p.max_listeners_per_target) ||
             (!e && r->n_listeners >= (size_t)r->p.max_listeners))
        rc = KVS_ERR_BUSY;
    else if (!(t = target_find(r, target, true)) || (!e && !(e = calloc(1, sizeof *e))))
        rc = KVS_ERR_NOMEM; /* an empty target record left behind is freed with the table */
    else {
        if (e->target) {
            target_unlink(r, e); /* moved from the owner's earlier connection */
        } else {
            *link = e;
            e->id = relay_id;
            e->owner = owner;
            r->n_listeners++;
        }
        e->target = target;
        e->tnext = t->first;
        t->first = e;
        t->n++;
    }
    pthread_mutex_unlock(&r->listen_mu);
    return rc;
}

void *relay_listen_take(relay *r, uint64_t relay_id, void (*ref)(void *target)) {
    pthread_mutex_lock(&r->listen_mu);
    listen_ent *e = listen_find(r, relay_id, NULL);
    void *t = e ? e->target : NULL;
    if (t && ref) ref(t);
    pthread_mutex_unlock(&r->listen_mu);
    return t;
}

void relay_listen_drop(relay *r, void *target) {
    pthread_mutex_lock(&r->listen_mu);
    listen_tgt **tp = &r->by_target[target_bucket(r, target)];
    while (*tp && (*tp)->target != target) tp = &(*tp)->next;
    listen_tgt *t = *tp;
    if (t) {
        *tp = t->next;
        for (listen_ent *e = t->first, *nx; e; e = nx) {
            nx = e->tnext;
            listen_ent **link;
            listen_find(r, e->id, &link);
            *link = e->next;
            free(e);
            r->n_listeners--;
        }
        free(t);
    }
    pthread_mutex_unlock(&r->listen_mu);
}

size_t relay_listen_count(relay *r) {
    pthread_mutex_lock(&r->listen_mu);
    size_t n = r->n_listeners;
    pthread_mutex_unlock(&r->listen_mu);
    return n;
}

void relay_get_stats(relay *r, relay_stats *out) {
    pthread_mutex_lock(&r->mu);
    relay_reap(r); /* links reports live links: idle ones that left are gone */
    *out = r->st;
    pthread_mutex_unlock(&r->mu);
}
