/*
 * server_move.c — moving sessions from shard to shard (issue 39): SESSION_PUSH (a peer hands
 * this shard a session), DRAIN (this shard hands all of its idle sessions to peers) and the
 * MOVED answers for sessions that went.
 *
 * DESIGN NOTES
 *
 * 1. Who may push. SESSION_PUSH and DRAIN are accepted only on a connection whose peer the
 *    operator named in --peer-allow: its TLS identity (with TLS) or its IP address (plaintext).
 *    Anyone else — every client identity — is refused (INVALID_ARG) and counted.
 * 2. Owners. At admission the scheduler records each session's owner with kvstate
 *    (srv_move_note_owner: the connection's identity, a NUL, the raw 16-byte session id). A
 *    receiving shard derives the session's id and tenant from them under its own key
 *    (move_rekey), exactly as its reader would for that owner: a moved session stays bound to
 *    its owner identity, and only that owner reaches it on the new shard.
 * 3. The receiver checks everything kv_import checks (digest, layer range, KV type, geometry,
 *    checksums, free blocks without evicting, max_sessions, the owner's quotas, an id live or
 *    remembered at a newer epoch); a refused push changes nothing and is answered with the
 *    status and kv_import's reason.
 * 4. Drain (a thread per DRAIN, holding a reference on the operator's connection): `moving` is
 *    set, so every new FORWARD / TRUNCATE / RELEASE is answered BUSY (the client backs off and
 *    retries) or, for a session already moved, MOVED; the jobs in flight finish (bounded);
 *    then each idle session is exported, pushed to the next peer in turn (one connection per
 *    peer, HELLO checked: same digest and layer range), and on OK released here and entered in
 *    the moved table. A session the peers refuse stays here. Progress goes back on the
 *    operator's connection as STATUS frames (KVS_OK, "progress: ..."), the end as one
 *    "done: ..." (OK, or BUSY when some sessions could not be moved). Without keep-running the
 *    shard then goes on answering MOVED until every moved session was asked for once, or for
 *    --drain-timeout, and stops (srv_stop).
 * 5. MOVED: a FORWARD for a session in the moved table is answered with a STATUS frame, status
 *    KVS_ERR_MOVED and the new HOST:PORT as its message; the route client switches that hop
 *    and goes on at the same epoch (route_spare.c, route_follow_move). A relayed FORWARD is
 *    keyed by the identity of the client that registered its relay id, and MOVED goes to that
 *    client's connection: the client follows it and sends the relayed step again.
 * 6. Locks: mv->mu guards the moved table and the peer list; it is taken alone, never with
 *    s->mu or kv->lock held.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "netio.h"
#include "server_impl.h"
#include "util.h"

#define MOVE_MAX_PEERS 16
#define MOVE_TEXT_MAX 1024u /* DRAIN payload: "HOST:PORT,...[;keep]" */

typedef struct {
    kv_sid sid;
    uint8_t peer;
    bool asked; /* a MOVED answer went out for it */
} move_entry;

struct srv_move {
    pthread_mutex_t mu;
    atomic_bool moving;
    move_entry *moved;
    uint32_t n_moved, cap_moved, n_asked;
    char peers[MOVE_MAX_PEERS][RELAY_ADDR_MAX];
    int n_peers;
    bool running;          /* a drain thread exists */
    atomic_bool lingering; /* moved every session, answering MOVED until it stops */
};

int srv_move_create(srv *s) {
    s->move = calloc(1, sizeof *s->move);
    if (!s->move) return KVS_ERR_NOMEM;
    pthread_mutex_init(&s->move->mu, NULL);
    atomic_init(&s->move->moving, false);
    return KVS_OK;
}

void srv_move_free(srv *s) {
    if (!s->move) return;
    pthread_mutex_destroy(&s->move->mu);
    free(s->move->moved);
    free(s->move);
    s->move = NULL;
}

void srv_move_note_owner(srv *s, const srv_job *j) {
    uint8_t owner[TLS_ID_MAX + WIRE_SID_SIZE];
    size_t il = strlen(j->conn->identity) + 1;
    memcpy(owner, j->conn->identity, il);
    memcpy(owner + il, j->wire_sid, WIRE_SID_SIZE);
    (void)kv_set_owner(s->e->kv, &j->sid, owner, il + WIRE_SID_SIZE);
}

/* Design note 1: the peer's TLS identity or IP address is in --peer-allow. */
bool srv_move_peer_allowed(const srv_conn *c) {
    const char *list = c->s->p.peer_allow;
    const char *who = c->s->tls ? c->identity : c->addr;
    size_t wl = strlen(who);
    while (list && *list) {
        const char *end = strchr(list, ',');
        size_t n = end ? (size_t)(end - list) : strlen(list);
        while (n && *list == ' ') list++, n--;
        while (n && list[n - 1] == ' ') n--;
        if (n == wl && !memcmp(list, who, n)) return true;
        list = end ? end + 1 : NULL;
    }
    return false;
}

/* Design note 2: owner = identity, NUL, raw session id -> this shard's id and tenant for it. */
static int move_rekey(void *ctx, const uint8_t *owner, size_t len, kv_sid *sid, uint64_t *tenant) {
    srv *s = ctx;
    if (len < 2 + WIRE_SID_SIZE || len > TLS_ID_MAX + WIRE_SID_SIZE || owner[len - WIRE_SID_SIZE - 1] != 0)
        return KVS_ERR_INVALID_ARG;
    size_t il = len - WIRE_SID_SIZE; /* identity and its NUL */
    if (memchr(owner, 0, il - 1)) return KVS_ERR_INVALID_ARG;
    crypto_generichash(sid->bytes, sizeof sid->bytes, owner, len, s->sid_key, sizeof s->sid_key);
    uint8_t tag[8];
    crypto_generichash(tag, sizeof tag, owner, il - 1, s->sid_key, sizeof s->sid_key);
    memcpy(tenant, tag, sizeof tag);
    return KVS_OK;
}

static void move_ident(const srv *s, kv_snap_ident *id) {
    memcpy(id->digest, s->digest, sizeof id->digest);
    id->first = s->e->m->first;
    id->last = s->e->m->last;
}

typedef struct {
    const uint8_t *p;
    size_t len, pos;
} mem_in;

static int mem_read(void *ctx, void *buf, size_t len) {
    mem_in *m = ctx;
    if (len > m->len - m->pos) return KVS_ERR_IO;
    memcpy(buf, m->p + m->pos, len);
    m->pos += len;
    return KVS_OK;
}

void srv_handle_session_push(srv_conn *c, uint64_t rid, const uint8_t *payload, size_t len) {
    srv *s = c->s;
    char msg[KVS_MSG_MAX] = "";
    if (!srv_move_peer_allowed(c)) {
        pthread_mutex_lock(&s->mu);
        s->c_push_refused++;
        pthread_mutex_unlock(&s->mu);
        kvs_logf(s->p.log, s->p.log_ctx, "conn %u (%s): SESSION_PUSH from %s refused: not in --peer-allow", c->id,
                 c->peer, c->identity);
        srv_send_status(c, rid, KVS_ERR_INVALID_ARG, NULL, "SESSION_PUSH: this peer is not allowed (--peer-allow)");
        return;
    }
    kv_snap_ident id;
    move_ident(s, &id);
    mem_in m = {.p = payload, .len = len};
    kv_snap_counts cnt = {0};
    int err = atomic_load(&s->move->moving) || atomic_load(&s->draining)
                  ? kvs_fail(msg, sizeof msg, KVS_ERR_BUSY, "the shard is draining itself")
                  : kv_import_rekey(s->e->kv, &id, mem_read, &m, move_rekey, s, &cnt, msg, sizeof msg);
    if (err == KVS_OK && m.pos != m.len) err = kvs_fail(msg, sizeof msg, KVS_ERR_FORMAT, "bytes after the stream");
    pthread_mutex_lock(&s->mu);
    if (err == KVS_OK) {
        s->c_moved_in_sessions += cnt.sessions;
        s->c_moved_in_bytes += cnt.bytes;
    } else {
        s->c_push_refused++;
    }
    pthread_mutex_unlock(&s->mu);
    kvs_logf(s->p.log, s->p.log_ctx, "conn %u (%s): SESSION_PUSH %s: %s", c->id, c->peer,
             err ? "refused" : "taken", err ? msg : "1 session");
    srv_send_status(c, rid, err, NULL, err ? msg : NULL);
}

/* ---- the gate of the reader (design notes 4, 5) ----------------------------------------- */

static int moved_to(srv *s, const kv_sid *sid, char out[RELAY_ADDR_MAX]) {
    struct srv_move *mv = s->move;
    int found = 0;
    pthread_mutex_lock(&mv->mu);
    for (uint32_t i = 0; i < mv->n_moved && !found; i++)
        if (!memcmp(mv->moved[i].sid.bytes, sid->bytes, 16)) {
            snprintf(out, RELAY_ADDR_MAX, "%s", mv->peers[mv->moved[i].peer]);
            if (!mv->moved[i].asked) mv->n_asked++;
            mv->moved[i].asked = true;
            found = 1;
        }
    pthread_mutex_unlock(&mv->mu);
    return found;
}

bool srv_move_gate(srv_conn *c, const struct wire_header *h, const struct netio_buf *buf) {
    srv *s = c->s;
    struct srv_move *mv = s->move;
    bool moving = atomic_load(&mv->moving);
    if (h->op != WIRE_OP_FORWARD && h->op != WIRE_OP_TRUNCATE && h->op != WIRE_OP_RELEASE) return false;
    if (h->op != WIRE_OP_FORWARD) {
        if (moving) srv_send_status(c, h->request_id, KVS_ERR_BUSY, NULL, "the shard is moving its sessions");
        return moving;
    }
    pthread_mutex_lock(&mv->mu);
    bool any = mv->n_moved > 0;
    pthread_mutex_unlock(&mv->mu);
    if (!moving && !any) return false;
    struct wire_forward f;
    char msg[KVS_MSG_MAX], where[RELAY_ADDR_MAX];
    if (wire_decode_forward(buf->data, buf->len, &f, msg, sizeof msg) != KVS_OK) return false; /* answered there */
    /* A relayed step is the session of the client that registered its relay id, and its answer
     * goes to that client's connection (srv_handle_forward does the same). */
    srv_conn *target = f.flags & WIRE_FWD_RELAY ? relay_listen_take(s->relay, f.relay.relay_id, srv_conn_ref) : NULL;
    kv_sid sid;
    srv_conn_sid(target ? target : c, f.session_id, &sid);
    if (moved_to(s, &sid, where)) {
        srv_send_status(target ? target : c, h->request_id, KVS_ERR_MOVED, NULL, where);
        if (target) srv_conn_unref(target);
        return true;
    }
    if (target) srv_conn_unref(target);
    if (!moving) return false;
    struct wire_forward_reply m;
    memset(&m, 0, sizeof m);
    m.st.status = KVS_ERR_BUSY;
    m.out_kind = WIRE_OUTK_NONE;
    uint8_t small[64];
    size_t len = 0;
    if (wire_encode_forward_reply(&m, small, sizeof small, &len) == KVS_OK)
        srv_conn_send(c, WIRE_OP_FORWARD_REPLY, h->request_id, small, len);
    return true;
}

/* ---- drain (design note 4) ------------------------------------------------------------- */

typedef struct {
    uint8_t *buf;
    size_t len, cap;
} mem_out;

typedef struct {
    srv_conn *c; /* the operator's connection: progress goes there */
    uint64_t rid;
    bool keep_running;
    int fd[MOVE_MAX_PEERS];
    struct netio_buf rx;
    /* Two export buffers, kept from session to session (no new pages each): while the peer
     * imports the session just sent from one, the next is exported into the other. */
    mem_out out[2];
} move_job;

static int mem_write(void *ctx, const void *b, size_t n) {
    mem_out *m = ctx;
    if (n > WIRE_MAX_PAYLOAD - m->len) return KVS_ERR_TOO_LARGE;
    if (m->len + n > m->cap) {
        /* the largest frame at once: pages are taken only as written, and nothing is copied */
        size_t cap = WIRE_MAX_PAYLOAD;
        uint8_t *g = realloc(m->buf, cap);
        if (!g) return KVS_ERR_NOMEM;
        kvs_advise_huge(g, cap);
        m->buf = g;
        m->cap = cap;
    }
    memcpy(m->buf + m->len, b, n);
    m->len += n;
    return KVS_OK;
}

static void progress(move_job *mj, int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void progress(move_job *mj, int status, const char *fmt, ...) {
    char text[KVS_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    srv_send_status(mj->c, mj->rid, status, NULL, text);
    kvs_logf(mj->c->s->p.log, mj->c->s->p.log_ctx, "drain: %s", text);
}

/* One request to peer i and its STATUS: the status, its text in why. */
/* The STATUS (or INFO for HELLO) answering the request last sent to peer i: its status, its
 * text in why. */
static int peer_await(srv *s, move_job *mj, int i, uint16_t op, uint64_t until, char *why, size_t cap) {
    struct wire_header h;
    int err = netio_recv_frame(mj->fd[i], &h, &mj->rx, until, why, cap);
    if (err) return err;
    if (op == WIRE_OP_HELLO) {
        struct wire_info info;
        if ((err = wire_decode_info(mj->rx.data, mj->rx.len, &info, why, cap))) return err;
        if (info.st.status) return kvs_fail(why, cap, info.st.status, "HELLO refused");
        if (memcmp(info.model_digest, s->digest, 32) || info.first != s->e->m->first || info.last != s->e->m->last)
            return kvs_fail(why, cap, KVS_ERR_INVALID_ARG, "it serves another model or layers [%u, %u)", info.first,
                            info.last);
        return KVS_OK;
    }
    struct wire_status_reply sr;
    if (h.op != WIRE_OP_STATUS || wire_decode_status_reply(mj->rx.data, mj->rx.len, &sr, why, cap))
        return kvs_fail(why, cap, KVS_ERR_PROTOCOL, "unexpected reply %s", wire_op_name(h.op));
    snprintf(why, cap, "%s", sr.msg);
    return sr.st.status;
}

static uint64_t peer_deadline(const srv *s) {
    return netio_deadline_ms(s->p.hello_timeout_ms > 0 ? 4 * s->p.hello_timeout_ms : 40000);
}

/* One request to peer i and its answer (peer_await). */
static int peer_call(srv *s, move_job *mj, int i, uint16_t op, const uint8_t *p, size_t len, char *why, size_t cap) {
    uint64_t until = peer_deadline(s);
    int err = netio_send_frame(mj->fd[i], op, 1, p, len, until);
    return err ? err : peer_await(s, mj, i, op, until, why, cap);
}

/* Connects peer i (TLS with the shard's own certificate when it has one) and says HELLO. */
static int peer_connect(srv *s, move_job *mj, int i, char *why, size_t cap) {
    char host[NETIO_HOST_MAX];
    uint16_t port;
    int err = netio_parse_hostport(s->move->peers[i], host, sizeof host, &port);
    if (!err) err = netio_connect(host, port, netio_deadline_ms(10000), &mj->fd[i], why, cap);
    char peer_id[TLS_ID_MAX];
    if (!err && s->relay_tls)
        err = tls_handshake(s->relay_tls, mj->fd[i], netio_deadline_ms(10000), peer_id, sizeof peer_id, why, cap);
    struct wire_hello hello = {.min_version = 1, .max_version = WIRE_PROTO_VERSION};
    uint8_t hb[64];
    size_t len = 0;
    if (!err) err = wire_encode_hello(&hello, hb, sizeof hb, &len);
    if (!err) err = peer_call(s, mj, i, WIRE_OP_HELLO, hb, len, why, cap);
    if (err) {
        netio_close(mj->fd[i]);
        mj->fd[i] = -1;
    }
    return err;
}

/* Exports sid into m (KVS_OK, or why it cannot move). */
static int move_export(srv *s, const kv_sid *sid, mem_out *m, uint64_t *epoch, char *why, size_t cap) {
    kv_snap_ident id;
    move_ident(s, &id);
    m->len = 0;
    int err = kv_lookup(s->e->kv, sid, epoch, NULL);
    return err ? err : kv_export(s->e->kv, &id, sid, mem_write, m, NULL, why, cap);
}

static void move_refused(srv *s, move_job *mj, int i, int rc, const char *why) {
    kvs_logf(s->p.log, s->p.log_ctx, "drain: %s refused a session: %s (%s)", s->move->peers[i], kvs_strerror(rc), why);
    if (rc == KVS_ERR_IO || rc == KVS_ERR_TIMEOUT || rc == KVS_ERR_CLOSED || rc == KVS_ERR_PROTOCOL) {
        netio_close(mj->fd[i]);
        mj->fd[i] = -1;
    }
}

/* Pushes the session exported in m (export status err) to the peers in turn from *next until
 * one takes it; then it is released here and entered in the moved table. Before it waits for
 * the first peer's answer it calls overlap(ctx) (the next session's export), so that work runs
 * while the peer imports this one. */
static int move_one(srv *s, move_job *mj, const kv_sid *sid, uint64_t epoch, int err, mem_out *m, int *next,
                    uint64_t *bytes, void (*overlap)(void *), void *ctx) {
    struct srv_move *mv = s->move;
    char why[KVS_MSG_MAX] = "";
    int first = -1;
    for (int t = 0; err == KVS_OK && t < mv->n_peers && first < 0; t++)
        if (mj->fd[(*next + t) % mv->n_peers] >= 0) first = (*next + t) % mv->n_peers;
    uint64_t until = peer_deadline(s);
    int rc = err ? err : first < 0 ? KVS_ERR_NOT_FOUND
                                   : netio_send_frame(mj->fd[first], WIRE_OP_SESSION_PUSH, 1, m->buf, m->len, until);
    if (overlap) overlap(ctx);
    if (err) return err;
    if (first < 0) return KVS_ERR_NOT_FOUND; /* no peer left */
    if (rc == KVS_OK) rc = peer_await(s, mj, first, WIRE_OP_SESSION_PUSH, until, why, sizeof why);
    int taker = rc == KVS_OK ? first : -1;
    if (rc != KVS_OK) move_refused(s, mj, first, rc, why);
    for (int t = 1; taker < 0 && t < mv->n_peers; t++) { /* the others, one at a time */
        int i = (first + t) % mv->n_peers;
        if (mj->fd[i] < 0) continue;
        rc = peer_call(s, mj, i, WIRE_OP_SESSION_PUSH, m->buf, m->len, why, sizeof why);
        if (rc == KVS_OK) taker = i;
        else move_refused(s, mj, i, rc, why);
    }
    if (taker < 0) return KVS_ERR_NOT_FOUND; /* no peer took it */
    *next = (taker + 1) % mv->n_peers;
    *bytes += m->len;
    pthread_mutex_lock(&mv->mu);
    if (mv->n_moved == mv->cap_moved) {
        uint32_t cap = mv->cap_moved ? 2 * mv->cap_moved : 64;
        move_entry *g = realloc(mv->moved, cap * sizeof *g);
        if (g) {
            mv->moved = g;
            mv->cap_moved = cap;
        }
    }
    if (mv->n_moved < mv->cap_moved) mv->moved[mv->n_moved++] = (move_entry){.sid = *sid, .peer = (uint8_t)taker};
    pthread_mutex_unlock(&mv->mu);
    kv_reply r;
    (void)kv_release(s->e->kv, sid, epoch, &r);
    return KVS_OK;
}

/* The export that overlaps a push (move_one's overlap). */
typedef struct {
    srv *s;
    const kv_sid *sid;
    mem_out *m;
    uint64_t epoch;
    int err;
    char why[KVS_MSG_MAX];
} move_next;

static void move_next_export(void *ctx) {
    move_next *x = ctx;
    x->err = move_export(x->s, x->sid, x->m, &x->epoch, x->why, sizeof x->why);
}

/* Waits (bounded) for the jobs in flight to finish; true when none is left. */
static bool move_wait_idle(srv *s) {
    int limit_ms = s->p.drain_timeout_ms > 0 ? s->p.drain_timeout_ms : 30000;
    uint64_t t0 = kvs_now_ns();
    for (;;) {
        pthread_mutex_lock(&s->mu);
        bool idle = s->jobs == NULL;
        pthread_mutex_unlock(&s->mu);
        if (idle) return true;
        if (kvs_now_ns() - t0 > (uint64_t)limit_ms * 1000000ull) return false;
        struct timespec ts = {0, 2 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

/* Without keep-running: MOVED answers go on until each moved session was asked for once, the
 * drain timeout passes or the shard is stopped. */
static void move_linger(srv *s) {
    struct srv_move *mv = s->move;
    atomic_store(&mv->lingering, true);
    int limit_ms = s->p.drain_timeout_ms > 0 ? s->p.drain_timeout_ms : 30000;
    uint64_t t0 = kvs_now_ns();
    while (!atomic_load(&s->stop_requested) && kvs_now_ns() - t0 < (uint64_t)limit_ms * 1000000ull) {
        pthread_mutex_lock(&mv->mu);
        bool all = mv->n_asked >= mv->n_moved;
        pthread_mutex_unlock(&mv->mu);
        if (all) break;
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

static void *drain_main(void *arg) {
    move_job *mj = arg;
    srv *s = mj->c->s;
    struct srv_move *mv = s->move;
    char why[KVS_MSG_MAX];
    int connected = 0;
    for (int i = 0; i < mv->n_peers; i++) {
        why[0] = 0;
        int err = peer_connect(s, mj, i, why, sizeof why);
        if (err) progress(mj, KVS_OK, "progress: peer %s unusable: %s (%s)", mv->peers[i], kvs_strerror(err), why);
        connected += err == KVS_OK;
    }
    bool idle = move_wait_idle(s);
    kv_stats st;
    kv_get_stats(s->e->kv, &st);
    uint32_t n = (uint32_t)st.sessions, moved = 0, failed = 0;
    kv_sid *ids = calloc(n ? n : 1, sizeof *ids);
    n = ids && connected ? kv_list_idle(s->e->kv, ids, n) : 0;
    uint64_t bytes = 0, t0 = kvs_now_ns(), last = t0;
    int next = 0;
    move_next cur = {.s = s}, nx = {.s = s};
    if (n) {
        cur.sid = &ids[0];
        cur.m = &mj->out[0];
        move_next_export(&cur);
    }
    for (uint32_t k = 0; k < n && !atomic_load(&s->stop_requested); k++) {
        nx.sid = k + 1 < n ? &ids[k + 1] : NULL;
        nx.m = &mj->out[(k + 1) % 2];
        if (cur.err) kvs_logf(s->p.log, s->p.log_ctx, "drain: a session cannot move: %s (%s)", kvs_strerror(cur.err),
                              cur.why);
        if (move_one(s, mj, cur.sid, cur.epoch, cur.err, cur.m, &next, &bytes, nx.sid ? move_next_export : NULL,
                     &nx) == KVS_OK)
            moved++;
        else failed++;
        cur = nx;
        double secs = (double)(kvs_now_ns() - t0) / 1e9;
        if (kvs_now_ns() - last > 500000000ull || k + 1 == n) {
            last = kvs_now_ns();
            progress(mj, KVS_OK, "progress: %u of %u sessions, %.1f MiB, %.1f MiB/s", k + 1, n,
                     (double)bytes / (1 << 20), secs > 0 ? (double)bytes / (1 << 20) / secs : 0.0);
        }
    }
    double secs = (double)(kvs_now_ns() - t0) / 1e9;
    kv_get_stats(s->e->kv, &st);
    pthread_mutex_lock(&s->mu);
    s->c_moved_out_sessions += moved;
    s->c_moved_out_bytes += bytes;
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < mv->n_peers; i++) netio_close(mj->fd[i]);
    atomic_store(&mv->moving, false);
    progress(mj, failed || !connected || !idle ? KVS_ERR_BUSY : KVS_OK,
             "done: moved %u of %u sessions (%u failed%s), %.1f MiB in %.3f s (%.1f MiB/s); %llu sessions left%s",
             moved, n, failed, idle ? "" : "; work in flight did not finish", (double)bytes / (1 << 20), secs,
             secs > 0 ? (double)bytes / (1 << 20) / secs : 0.0, (unsigned long long)st.sessions,
             mj->keep_running ? "" : "; stopping");
    if (!mj->keep_running) {
        move_linger(s);
        srv_stop(s);
    }
    free(ids);
    free(mj->out[0].buf);
    free(mj->out[1].buf);
    netio_buf_free(&mj->rx);
    pthread_mutex_lock(&mv->mu);
    mv->running = false;
    pthread_mutex_unlock(&mv->mu);
    srv_conn_unref(mj->c);
    free(mj);
    return NULL;
}

bool srv_draining(srv *s) {
    return atomic_load(&s->draining) || atomic_load(&s->move->moving) || atomic_load(&s->move->lingering);
}

/* "HOST:PORT,...[;keep]" into the peer list; false when malformed. */
static bool parse_peers(struct srv_move *mv, const uint8_t *p, size_t len, bool *keep) {
    char text[MOVE_TEXT_MAX + 1];
    if (len == 0 || len > MOVE_TEXT_MAX) return false;
    memcpy(text, p, len);
    text[len] = 0;
    char *semi = strchr(text, ';');
    *keep = semi && !strcmp(semi + 1, "keep");
    if (semi) *semi = 0;
    mv->n_peers = 0;
    for (char *save = NULL, *tok = strtok_r(text, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (mv->n_peers == MOVE_MAX_PEERS || relay_canon_addr(tok, mv->peers[mv->n_peers]) != KVS_OK) return false;
        mv->n_peers++;
    }
    return mv->n_peers > 0;
}

void srv_handle_drain(srv_conn *c, uint64_t rid, const uint8_t *payload, size_t len) {
    srv *s = c->s;
    struct srv_move *mv = s->move;
    if (!srv_move_peer_allowed(c)) {
        srv_send_status(c, rid, KVS_ERR_INVALID_ARG, NULL, "DRAIN: this peer is not allowed (--peer-allow)");
        return;
    }
    pthread_mutex_lock(&mv->mu);
    bool busy = mv->running, keep = false;
    bool ok = !busy && parse_peers(mv, payload, len, &keep);
    if (ok) mv->running = true;
    pthread_mutex_unlock(&mv->mu);
    if (!ok) {
        srv_send_status(c, rid, busy ? KVS_ERR_BUSY : KVS_ERR_INVALID_ARG, NULL,
                        busy ? "a drain is running" : "DRAIN wants HOST:PORT,...[;keep] (numeric, at most 16)");
        return;
    }
    move_job *mj = calloc(1, sizeof *mj);
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (mj) {
        *mj = (move_job){.c = c, .rid = rid, .keep_running = keep};
        for (int i = 0; i < MOVE_MAX_PEERS; i++) mj->fd[i] = -1;
        atomic_store(&mv->moving, true);
        srv_conn_ref(c);
    }
    if (!mj || pthread_create(&t, &attr, drain_main, mj) != 0) {
        if (mj) {
            atomic_store(&mv->moving, false);
            srv_conn_unref(c);
        }
        free(mj);
        pthread_mutex_lock(&mv->mu);
        mv->running = false;
        pthread_mutex_unlock(&mv->mu);
        srv_send_status(c, rid, KVS_ERR_NOMEM, NULL, "cannot start the drain");
    }
    pthread_attr_destroy(&attr);
}
