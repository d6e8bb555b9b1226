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
 *    the moved table. A session the peers refuse stays here. The drain is a pipeline so that
 *    the link never waits for a copy: an exporter thread (move_exporter) fills MOVE_SLOTS
 *    buffers in list order, the drain thread (move_all) keeps up to MOVE_IN_FLIGHT pushes in
 *    flight and takes their answers oldest first, matched by request id. A refused push is
 *    retried on the other peers once nothing else is in flight (slot_retry). Slot states:
 *    FREE -> EXPORTING (exporter) -> READY -> SENT (move_all) -> FREE (slot_retire); mj->mu
 *    guards the states and the exporter's counters, a slot's other fields belong to the
 *    thread that moved it out of FREE or READY. Progress goes back on the
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
 *    s->mu or kv->lock held. A drain's mj->mu and a connection's push->mu are taken alone too.
 * 7. Receiving pushes: a pushing peer's connection gets an import worker (struct srv_push) on
 *    its first allowed push. The reader hands each received frame over by swapping buffers and
 *    goes on receiving the next one while the worker imports and answers; at most one frame
 *    waits, so a peer holds at most two frames of buffer, both counted in s->buffered and
 *    s->rx_capacity. Pushes are imported and answered in arrival order, which the drain relies
 *    on to match answers (note 4). The reader stops and joins the worker before it closes the
 *    connection (srv_move_conn_done), so every taken push is answered first.
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
static bool peer_allowed(const srv_conn *c) {
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

/* Imports one pushed session (design note 3) and answers it. */
static void push_import(srv_conn *c, uint64_t rid, const uint8_t *payload, size_t len) {
    srv *s = c->s;
    char msg[KVS_MSG_MAX] = "";
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

/* A pushing peer's import worker (design note 7): the reader hands it one received frame and
 * goes on receiving the next while the frame is imported. Its fields are guarded by mu. */
struct srv_push {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct netio_buf buf; /* the frame handed over; once imported, the reader's next buffer */
    uint64_t rid;
    size_t held;    /* bytes of s->buffered the frame holds until it is imported */
    size_t counted; /* buf.cap as counted in s->rx_capacity */
    bool busy;      /* a frame is handed over and not imported yet */
    bool stop;
};

static void *push_worker(void *arg) {
    srv_conn *c = arg;
    struct srv_push *p = c->push;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->busy && !p->stop) pthread_cond_wait(&p->cv, &p->mu);
        if (!p->busy) break;
        pthread_mutex_unlock(&p->mu);
        push_import(c, p->rid, p->buf.data, p->buf.len);
        atomic_fetch_sub(&c->s->buffered, p->held);
        pthread_mutex_lock(&p->mu);
        p->held = 0;
        p->busy = false;
        pthread_cond_broadcast(&p->cv);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* c's import worker, started on its first push; NULL when it cannot be started. */
static struct srv_push *push_worker_of(srv_conn *c) {
    if (c->push) return c->push;
    struct srv_push *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    c->push = p;
    if (pthread_create(&p->thread, NULL, push_worker, c) != 0) {
        c->push = NULL;
        pthread_mutex_destroy(&p->mu);
        pthread_cond_destroy(&p->cv);
        free(p);
    }
    return c->push;
}

void srv_move_conn_done(srv_conn *c) {
    struct srv_push *p = c->push;
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    pthread_join(p->thread, NULL);
    atomic_fetch_sub(&c->s->rx_capacity, p->counted);
    netio_buf_free(&p->buf);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p);
    c->push = NULL;
}

void srv_handle_session_push(srv_conn *c, uint64_t rid, struct netio_buf *buf) {
    srv *s = c->s;
    if (!peer_allowed(c)) {
        pthread_mutex_lock(&s->mu);
        s->c_push_refused++;
        pthread_mutex_unlock(&s->mu);
        kvs_logf(s->p.log, s->p.log_ctx, "conn %u (%s): SESSION_PUSH from %s refused: not in --peer-allow", c->id,
                 c->peer, c->identity);
        srv_send_status(c, rid, KVS_ERR_INVALID_ARG, NULL, "SESSION_PUSH: this peer is not allowed (--peer-allow)");
        return;
    }
    c->bulk = true; /* a drain pushes session after session: no fresh pages for each */
    struct srv_push *p = push_worker_of(c);
    if (!p) {
        push_import(c, rid, buf->data, buf->len);
        return;
    }
    /* At most one frame waits for its import: the reader holds back until the one before is in. */
    pthread_mutex_lock(&p->mu);
    while (p->busy) pthread_cond_wait(&p->cv, &p->mu);
    struct netio_buf spare = p->buf;
    p->buf = *buf;
    *buf = spare;
    atomic_fetch_add(&s->rx_capacity, p->buf.cap);
    atomic_fetch_sub(&s->rx_capacity, p->counted);
    p->counted = p->buf.cap;
    p->rid = rid;
    p->held = c->rx_held; /* the worker gives the frame's bytes back once it is imported */
    c->rx_held = 0;
    p->busy = true;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
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

/* A session on its way out: exported by the exporter thread, pushed by the drain thread. */
typedef struct {
    mem_out out;    /* the session's stream; kept from session to session (no new pages each) */
    kv_sid sid;
    uint64_t epoch; /* released here at this epoch once a peer took it */
    uint32_t seq;   /* position in the drain's session list */
    int err;        /* the export's status */
    int peer;       /* the peer it was sent to, while in flight */
    enum { SLOT_FREE, SLOT_EXPORTING, SLOT_READY, SLOT_SENT } state;
} move_slot;

/* Pushes in flight per drain: one session crosses the link while the peer imports the one
 * before and the exporter fills the next, so exporting, sending and importing overlap. */
#define MOVE_IN_FLIGHT 2
#define MOVE_SLOTS (MOVE_IN_FLIGHT + 1)

typedef struct {
    srv_conn *c; /* the operator's connection: progress goes there */
    uint64_t rid;
    bool keep_running;
    int fd[MOVE_MAX_PEERS];
    struct netio_buf rx;
    /* the exporter thread and the drain thread share the slots under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    move_slot slot[MOVE_SLOTS];
    const kv_sid *ids;
    uint32_t n, exported; /* sessions to move; how many the exporter has taken up */
    bool export_done;
    /* the drain thread's own */
    int next;             /* the peer the next push goes to first */
    uint64_t push_rid;    /* request id of the last push */
    uint32_t moved, failed;
    uint64_t bytes;
} move_job;

static int mem_write(void *ctx, const void *b, size_t n) {
    mem_out *m = ctx;
    if (n > WIRE_MAX_PAYLOAD - m->len) return KVS_ERR_TOO_LARGE;
    if (m->len + n > m->cap) {
        size_t cap = m->cap ? m->cap : 1u << 20;
        while (cap < m->len + n) cap *= 2;
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

/* The deadline of one request to a peer and its answer. */
static uint64_t peer_deadline(const srv *s) {
    return netio_deadline_ms(s->p.hello_timeout_ms > 0 ? 4 * s->p.hello_timeout_ms : 40000);
}

/* Receives the STATUS answering request rid from peer i: its status, its text in why. */
static int peer_status(move_job *mj, int i, uint64_t rid, uint64_t until, char *why, size_t cap) {
    struct wire_header h;
    struct wire_status_reply sr;
    int err = netio_recv_frame(mj->fd[i], &h, &mj->rx, until, why, cap);
    if (err) return err;
    if (h.op != WIRE_OP_STATUS || h.request_id != rid ||
        wire_decode_status_reply(mj->rx.data, mj->rx.len, &sr, why, cap))
        return kvs_fail(why, cap, KVS_ERR_PROTOCOL, "unexpected reply %s to request %llu", wire_op_name(h.op),
                        (unsigned long long)rid);
    snprintf(why, cap, "%s", sr.msg);
    return sr.st.status;
}

/* HELLO to peer i and its INFO: the peer must serve this model and layer range. */
static int peer_hello(srv *s, move_job *mj, int i, char *why, size_t cap) {
    uint64_t until = peer_deadline(s);
    struct wire_hello hello = {.min_version = 1, .max_version = WIRE_PROTO_VERSION};
    uint8_t hb[64];
    size_t len = 0;
    struct wire_header h;
    struct wire_info info;
    int err = wire_encode_hello(&hello, hb, sizeof hb, &len);
    if (!err) err = netio_send_frame(mj->fd[i], WIRE_OP_HELLO, 1, hb, len, until);
    if (!err) err = netio_recv_frame(mj->fd[i], &h, &mj->rx, until, why, cap);
    if (!err) err = wire_decode_info(mj->rx.data, mj->rx.len, &info, why, cap);
    if (err) return err;
    if (info.st.status) return kvs_fail(why, cap, info.st.status, "HELLO refused");
    if (memcmp(info.model_digest, s->digest, 32) || info.first != s->e->m->first || info.last != s->e->m->last)
        return kvs_fail(why, cap, KVS_ERR_INVALID_ARG, "it serves another model or layers [%u, %u)", info.first,
                        info.last);
    return KVS_OK;
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
    if (!err) err = peer_hello(s, mj, i, why, cap);
    if (err) {
        netio_close(mj->fd[i]);
        mj->fd[i] = -1;
    }
    return err;
}

/* A failure of the link itself (not a refusal): the peer's connection is dropped. */
static void peer_failed(move_job *mj, int i, int rc) {
    if (rc == KVS_ERR_IO || rc == KVS_ERR_TIMEOUT || rc == KVS_ERR_CLOSED || rc == KVS_ERR_PROTOCOL) {
        netio_close(mj->fd[i]);
        mj->fd[i] = -1;
    }
}

/* The exporter thread: exports the sessions in list order into free slots, one at a time, so
 * the next session is ready when a push slot opens. */
static void *move_exporter(void *arg) {
    move_job *mj = arg;
    srv *s = mj->c->s;
    kv_snap_ident id;
    move_ident(s, &id);
    pthread_mutex_lock(&mj->mu);
    while (mj->exported < mj->n && !atomic_load(&s->stop_requested)) {
        move_slot *sl = NULL;
        for (int k = 0; k < MOVE_SLOTS && !sl; k++)
            if (mj->slot[k].state == SLOT_FREE) sl = &mj->slot[k];
        if (!sl) {
            pthread_cond_wait(&mj->cv, &mj->mu);
            continue;
        }
        sl->state = SLOT_EXPORTING;
        sl->seq = mj->exported++;
        sl->sid = mj->ids[sl->seq];
        pthread_mutex_unlock(&mj->mu);
        char why[KVS_MSG_MAX] = "";
        sl->out.len = 0;
        sl->epoch = 0;
        sl->err = kv_lookup(s->e->kv, &sl->sid, &sl->epoch, NULL);
        if (!sl->err) sl->err = kv_export(s->e->kv, &id, &sl->sid, mem_write, &sl->out, NULL, why, sizeof why);
        pthread_mutex_lock(&mj->mu);
        sl->state = SLOT_READY;
        pthread_cond_broadcast(&mj->cv);
    }
    mj->export_done = true;
    pthread_cond_broadcast(&mj->cv);
    pthread_mutex_unlock(&mj->mu);
    return NULL;
}

/* Takes the exported slot next in list order (READY -> SENT); with wait, blocks until it is
 * ready or the exporter has finished. NULL when none is ready (or none is left). */
static move_slot *take_ready(move_job *mj, uint32_t seq, bool wait) {
    move_slot *found = NULL;
    pthread_mutex_lock(&mj->mu);
    for (;;) {
        for (int k = 0; k < MOVE_SLOTS && !found; k++)
            if (mj->slot[k].state == SLOT_READY && mj->slot[k].seq == seq) found = &mj->slot[k];
        bool pending = false;
        for (int k = 0; k < MOVE_SLOTS; k++) pending |= mj->slot[k].state == SLOT_EXPORTING;
        if (found || !wait || (mj->export_done && !pending)) break;
        pthread_cond_wait(&mj->cv, &mj->mu);
    }
    if (found) found->state = SLOT_SENT;
    pthread_mutex_unlock(&mj->mu);
    return found;
}

/* A session is done with (moved or not): its slot goes back to the exporter, progress. */
static void slot_retire(move_job *mj, move_slot *sl, bool moved, uint64_t t0, uint64_t *last) {
    srv *s = mj->c->s;
    struct srv_move *mv = s->move;
    if (moved) {
        mj->moved++;
        mj->bytes += sl->out.len;
        pthread_mutex_lock(&mv->mu);
        if (mv->n_moved == mv->cap_moved) {
            uint32_t cap = mv->cap_moved ? 2 * mv->cap_moved : 64;
            move_entry *g = realloc(mv->moved, cap * sizeof *g);
            if (g) {
                mv->moved = g;
                mv->cap_moved = cap;
            }
        }
        if (mv->n_moved < mv->cap_moved)
            mv->moved[mv->n_moved++] = (move_entry){.sid = sl->sid, .peer = (uint8_t)sl->peer};
        pthread_mutex_unlock(&mv->mu);
        kv_reply r;
        (void)kv_release(s->e->kv, &sl->sid, sl->epoch, &r);
    } else {
        mj->failed++;
    }
    uint32_t done = mj->moved + mj->failed;
    if (kvs_now_ns() - *last > 500000000ull || done == mj->n) {
        *last = kvs_now_ns();
        double secs = (double)(*last - t0) / 1e9;
        progress(mj, KVS_OK, "progress: %u of %u sessions, %.1f MiB, %.1f MiB/s", done, mj->n,
                 (double)mj->bytes / (1 << 20), secs > 0 ? (double)mj->bytes / (1 << 20) / secs : 0.0);
    }
    pthread_mutex_lock(&mj->mu);
    sl->state = SLOT_FREE;
    pthread_cond_broadcast(&mj->cv);
    pthread_mutex_unlock(&mj->mu);
}

/* Sends sl to the first connected peer from mj->next on; false when no peer took the frame. */
static bool slot_send(srv *s, move_job *mj, move_slot *sl) {
    int n_peers = s->move->n_peers;
    for (int t = 0; t < n_peers; t++) {
        int i = (mj->next + t) % n_peers;
        if (mj->fd[i] < 0) continue;
        int rc = netio_send_frame(mj->fd[i], WIRE_OP_SESSION_PUSH, ++mj->push_rid, sl->out.buf, sl->out.len,
                                  peer_deadline(s));
        if (rc != KVS_OK) {
            kvs_logf(s->p.log, s->p.log_ctx, "drain: %s: push failed: %s", s->move->peers[i], kvs_strerror(rc));
            peer_failed(mj, i, KVS_ERR_IO); /* the stream position is lost */
            continue;
        }
        sl->peer = i;
        mj->next = (i + 1) % n_peers;
        return true;
    }
    return false;
}

/* A session refused by peer `first`: pushed to the other peers in turn, one at a time (nothing
 * else is in flight then), until one takes it. */
static bool slot_retry(srv *s, move_job *mj, move_slot *sl, int first) {
    int n_peers = s->move->n_peers;
    for (int t = 1; t < n_peers; t++) {
        int i = (first + t) % n_peers;
        if (mj->fd[i] < 0) continue;
        char why[KVS_MSG_MAX] = "";
        uint64_t until = peer_deadline(s), rid = ++mj->push_rid;
        int rc = netio_send_frame(mj->fd[i], WIRE_OP_SESSION_PUSH, rid, sl->out.buf, sl->out.len, until);
        if (!rc) rc = peer_status(mj, i, rid, until, why, sizeof why);
        if (rc == KVS_OK) {
            sl->peer = i;
            return true;
        }
        kvs_logf(s->p.log, s->p.log_ctx, "drain: %s refused a session: %s (%s)", s->move->peers[i],
                 kvs_strerror(rc), why);
        peer_failed(mj, i, rc);
    }
    return false;
}

/* Moves the sessions in mj->ids with up to MOVE_IN_FLIGHT pushes in flight (design note 4):
 * the answers come back in the order of the pushes on each peer's connection, so the oldest
 * push is always the next answer awaited. A refused push waits until nothing else is in
 * flight and then goes to the other peers in turn. */
static void move_all(srv *s, move_job *mj, uint64_t t0) {
    move_slot *fly[MOVE_IN_FLIGHT];
    uint64_t fly_rid[MOVE_IN_FLIGHT];
    move_slot *refused[MOVE_IN_FLIGHT];
    int n_fly = 0, n_refused = 0;
    uint32_t seq = 0;
    uint64_t last = t0;
    for (;;) {
        move_slot *sl = n_fly < MOVE_IN_FLIGHT && !n_refused && seq < mj->n ? take_ready(mj, seq, n_fly == 0) : NULL;
        if (sl) {
            seq++;
            if (sl->err == KVS_OK && slot_send(s, mj, sl)) {
                fly_rid[n_fly] = mj->push_rid;
                fly[n_fly++] = sl;
            } else {
                slot_retire(mj, sl, false, t0, &last);
            }
            continue;
        }
        if (n_fly == 0 && n_refused == 0) break; /* none left, or the exporter stopped */
        if (n_fly > 0) {
            sl = fly[0];
            uint64_t rid = fly_rid[0];
            n_fly--;
            memmove(fly, fly + 1, (size_t)n_fly * sizeof *fly);
            memmove(fly_rid, fly_rid + 1, (size_t)n_fly * sizeof *fly_rid);
            char why[KVS_MSG_MAX] = "";
            int rc = mj->fd[sl->peer] < 0 ? KVS_ERR_CLOSED
                                           : peer_status(mj, sl->peer, rid, peer_deadline(s), why, sizeof why);
            if (rc == KVS_OK) {
                slot_retire(mj, sl, true, t0, &last);
                continue;
            }
            kvs_logf(s->p.log, s->p.log_ctx, "drain: %s refused a session: %s (%s)", s->move->peers[sl->peer],
                     kvs_strerror(rc), why);
            peer_failed(mj, sl->peer, rc);
            refused[n_refused++] = sl;
            continue;
        }
        for (int k = 0; k < n_refused; k++)
            slot_retire(mj, refused[k], slot_retry(s, mj, refused[k], refused[k]->peer), t0, &last);
        n_refused = 0;
    }
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
    uint32_t n = (uint32_t)st.sessions;
    kv_sid *ids = calloc(n ? n : 1, sizeof *ids);
    n = ids && connected ? kv_list_idle(s->e->kv, ids, n) : 0;
    mj->ids = ids;
    mj->n = n;
    uint64_t t0 = kvs_now_ns();
    pthread_t exporter;
    if (n && pthread_create(&exporter, NULL, move_exporter, mj) == 0) {
        move_all(s, mj, t0);
        pthread_join(exporter, NULL);
    } else {
        mj->failed = n;
    }
    double secs = (double)(kvs_now_ns() - t0) / 1e9;
    kv_get_stats(s->e->kv, &st);
    pthread_mutex_lock(&s->mu);
    s->c_moved_out_sessions += mj->moved;
    s->c_moved_out_bytes += mj->bytes;
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < mv->n_peers; i++) netio_close(mj->fd[i]);
    atomic_store(&mv->moving, false);
    double mib = (double)mj->bytes / (1 << 20);
    progress(mj, mj->failed || !connected || !idle ? KVS_ERR_BUSY : KVS_OK,
             "done: moved %u of %u sessions (%u failed%s), %.1f MiB in %.3f s (%.1f MiB/s); %llu sessions left%s",
             mj->moved, n, mj->failed, idle ? "" : "; work in flight did not finish", mib, secs,
             secs > 0 ? mib / secs : 0.0, (unsigned long long)st.sessions, mj->keep_running ? "" : "; stopping");
    if (!mj->keep_running) {
        move_linger(s);
        srv_stop(s);
    }
    free(ids);
    for (int k = 0; k < MOVE_SLOTS; k++) free(mj->slot[k].out.buf);
    netio_buf_free(&mj->rx);
    pthread_mutex_destroy(&mj->mu);
    pthread_cond_destroy(&mj->cv);
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
    if (!peer_allowed(c)) {
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
        mj->c = c;
        mj->rid = rid;
        mj->keep_running = keep;
        for (int i = 0; i < MOVE_MAX_PEERS; i++) mj->fd[i] = -1;
        pthread_mutex_init(&mj->mu, NULL);
        pthread_cond_init(&mj->cv, NULL);
        atomic_store(&mv->moving, true);
        srv_conn_ref(c);
    }
    if (!mj || pthread_create(&t, &attr, drain_main, mj) != 0) {
        if (mj) {
            atomic_store(&mv->moving, false);
            srv_conn_unref(c);
            pthread_mutex_destroy(&mj->mu);
            pthread_cond_destroy(&mj->cv);
        }
        free(mj);
        pthread_mutex_lock(&mv->mu);
        mv->running = false;
        pthread_mutex_unlock(&mv->mu);
        srv_send_status(c, rid, KVS_ERR_NOMEM, NULL, "cannot start the drain");
    }
    pthread_attr_destroy(&attr);
}
