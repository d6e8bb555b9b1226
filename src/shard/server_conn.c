/* server_conn.c — one connection: reader and writer threads, reply queue, admission, references. */
#include <stdbool.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "netio.h"
#include "server_impl.h"
#include "util.h"

static void out_free_all(srv_out *o) {
    while (o) {
        srv_out *next = o->next;
        free(o);
        o = next;
    }
}

/* Puts o on c's queue unless that would pass c's own cap or (unless force) the global cap:
 * 0 queued (or dropped: the writer is gone, o freed), 1 over c's own cap, 2 over the global
 * one; *queued is c's queue before. */
static int conn_enqueue(srv_conn *c, srv_out *o, bool force, size_t *queued) {
    pthread_mutex_lock(&c->write_lock);
    if (c->writer_gone) { /* nothing would ever send it */
        pthread_mutex_unlock(&c->write_lock);
        free(o);
        return 0;
    }
    *queued = c->out_bytes;
    bool own = c->out_bytes + o->len > c->s->p.max_queued_bytes;
    bool all = !force && atomic_load(&c->s->buffered) + o->len > c->s->p.max_buffered_bytes;
    if (!own && !all) {
        atomic_fetch_add(&c->s->buffered, o->len);
        if (c->out_tail) c->out_tail->next = o;
        else c->out_head = o;
        c->out_tail = o;
        c->out_bytes += o->len;
        pthread_cond_signal(&c->write_cv);
    }
    pthread_mutex_unlock(&c->write_lock);
    return own ? 1 : all ? 2 : 0;
}

/* The global cap is reached while c would hold mine bytes: closes the connection holding the
 * most queued reply bytes when that is another one holding more (the hog, not its victim);
 * its writer then discards its queue. true when one was closed. Called without locks. */
static bool close_hog(srv *s, const srv_conn *c, size_t mine) {
    srv_conn *hog = NULL;
    size_t most = mine;
    pthread_mutex_lock(&s->mu);
    for (srv_conn *o = s->conns; o; o = o->next) {
        if (o == c || atomic_load(&o->closed)) continue;
        pthread_mutex_lock(&o->write_lock); /* L3 inside L1 */
        size_t b = o->out_bytes;
        pthread_mutex_unlock(&o->write_lock);
        if (b > most) {
            most = b;
            hog = o;
        }
    }
    if (hog) {
        kvs_logf(s->p.log, s->p.log_ctx, "conn %u (%s): holds %zu unread reply bytes of the shard's cap, closing", hog->id,
                 hog->peer, most);
        atomic_store(&hog->closed, true);
        shutdown(hog->fd, SHUT_RDWR);
    }
    pthread_mutex_unlock(&s->mu);
    return hog != NULL;
}

/* Queues one frame for c's writer thread (the payload is copied). Never blocks on the peer. A
 * closed connection drops it. A queue over its own cap closes c; at the global cap the
 * connection holding the most (close_hog) is closed instead when that is another one, and the
 * frame is queued over the cap while that one's queue is discarded. */
void srv_conn_send(srv_conn *c, uint16_t op, uint64_t rid, const uint8_t *payload, size_t len) {
    if (atomic_load(&c->closed)) return;
    srv_out *o = malloc(sizeof(*o) + len);
    if (!o) return;
    o->next = NULL;
    o->op = op;
    o->request_id = rid;
    o->len = len;
    if (len) memcpy(o->data, payload, len);
    size_t queued = 0;
    int over = conn_enqueue(c, o, false, &queued);
    if (over == 2 && close_hog(c->s, c, queued + len)) over = conn_enqueue(c, o, true, &queued);
    if (over) {
        free(o);
        kvs_logf(c->s->p.log, c->s->p.log_ctx, "conn %u (%s): not reading its replies (%zu bytes queued), closing", c->id, c->peer, queued);
        atomic_store(&c->closed, true);
        shutdown(c->fd, SHUT_RDWR);
    }
}

/* Writer thread: sends queued frames in order until told to stop and the
 * queue is empty. After a send error it discards what is left. */
void *srv_conn_writer(void *arg) {
    srv_conn *c = arg;
    bool failed = false;
    pthread_mutex_lock(&c->write_lock);
    for (;;) {
        while (!c->out_head && !c->writer_stop) pthread_cond_wait(&c->write_cv, &c->write_lock);
        srv_out *o = c->out_head;
        if (!o) break; /* stopped and drained */
        c->out_head = o->next;
        if (!c->out_head) c->out_tail = NULL;
        c->out_bytes -= o->len;
        atomic_fetch_sub(&c->s->buffered, o->len);
        pthread_mutex_unlock(&c->write_lock);
        if (!failed &&
            netio_send_frame(c->fd, o->op, o->request_id, o->data, o->len, netio_deadline_ms(c->s->p.idle_timeout_ms))) {
            failed = true;
            atomic_store(&c->closed, true);
            shutdown(c->fd, SHUT_RDWR);
        }
        free(o);
        pthread_mutex_lock(&c->write_lock);
    }
    c->writer_gone = true; /* srv_conn_send queues nothing more */
    pthread_mutex_unlock(&c->write_lock);
    return NULL;
}

void srv_send_status(srv_conn *c, uint64_t rid, int status, const kv_reply *r, const char *text) {
    struct wire_status_reply m;
    memset(&m, 0, sizeof(m));
    m.st.status = status;
    if (r) {
        m.st.have = r->have;
        m.st.live_epoch = r->live_epoch;
        m.st.n_past = r->n_past;
    }
    if (text) {
        size_t l = strlen(text);
        if (l > WIRE_MAX_MSG) l = WIRE_MAX_MSG;
        for (size_t i = 0; i < l; i++) m.msg[i] = text[i] ? text[i] : ' ';
        m.msg_len = (uint16_t)l;
    }
    uint8_t buf[512];
    size_t len = 0;
    if (wire_encode_status_reply(&m, buf, sizeof(buf), &len) == KVS_OK) srv_conn_send(c, WIRE_OP_STATUS, rid, buf, len);
}

void srv_conn_ref(void *c) { atomic_fetch_add(&((srv_conn *)c)->refs, 1); }

void srv_conn_unref(srv_conn *c) {
    if (atomic_fetch_sub(&c->refs, 1) != 1) return;
    srv *s = c->s;
    /* Replies queued after the writer stopped still count in s->buffered: returned here, once,
     * before n_conns drops (srv_free may follow). */
    atomic_fetch_sub(&s->buffered, c->out_bytes);
    pthread_mutex_lock(&s->mu);
    srv_conn **pp = &s->conns;
    while (*pp && *pp != c) pp = &(*pp)->next;
    if (*pp) *pp = c->next;
    /* Last touch of s: once n_conns drops, srv_run may return and srv_free free s. */
    s->n_conns--;
    pthread_mutex_unlock(&s->mu);
    netio_close(c->fd);
    out_free_all(c->out_head); /* replies queued after the writer stopped */
    pthread_mutex_destroy(&c->write_lock);
    pthread_cond_destroy(&c->write_cv);
    free(c);
}

/* The hot-state key of the client's session id: a keyed hash of (peer identity, sid) under a
 * per-process random key. Another identity naming the same sid reaches another key, so it sees
 * nothing of the session (as if absent) and cannot change it (docs/security.md). */
void srv_conn_sid(const srv_conn *c, const uint8_t raw[WIRE_SID_SIZE], kv_sid *out) {
    uint8_t in[TLS_ID_MAX + WIRE_SID_SIZE];
    size_t il = strlen(c->identity) + 1; /* the NUL separates identity and sid */
    memcpy(in, c->identity, il);
    memcpy(in + il, raw, WIRE_SID_SIZE);
    crypto_generichash(out->bytes, sizeof out->bytes, in, il + WIRE_SID_SIZE, c->s->sid_key, sizeof c->s->sid_key);
}

/* Checks the HELLO token against --auth-token-file and sets c->identity: the TLS identity when
 * there is one, else "token:" + a digest prefix of the token, else "anonymous". KVS_OK or
 * KVS_ERR_INVALID_ARG (a token file is set and the token is not in it). */
static int conn_authenticate(srv_conn *c, const struct wire_hello *hello) {
    srv *s = c->s;
    if (s->n_tokens > 0) {
        uint8_t d[crypto_generichash_BYTES];
        crypto_generichash(d, sizeof d, (const uint8_t *)hello->auth, hello->auth_len, NULL, 0);
        bool found = false;
        for (int i = 0; i < s->n_tokens; i++) found |= sodium_memcmp(d, s->tokens[i], sizeof d) == 0;
        if (!found || hello->auth_len == 0) return KVS_ERR_INVALID_ARG;
        if (!s->tls) snprintf(c->identity, sizeof c->identity, "token:%02x%02x%02x%02x%02x%02x%02x%02x", d[0], d[1],
                              d[2], d[3], d[4], d[5], d[6], d[7]);
    }
    if (!c->identity[0]) snprintf(c->identity, sizeof c->identity, "anonymous");
    uint8_t tag[8];
    crypto_generichash(tag, sizeof tag, (const uint8_t *)c->identity, strlen(c->identity), s->sid_key, sizeof s->sid_key);
    memcpy(&c->tenant, tag, sizeof tag);
    return KVS_OK;
}

/* netio admit hook: reserves the frame's payload in s->buffered, or refuses it with BUSY when
 * every connection together would hold more than max_buffered_bytes and no other connection
 * holds more unread replies than the frame (close_hog). */
static int conn_admit(void *ctx, const struct wire_header *h, bool *bulk) {
    srv_conn *c = ctx;
    srv *s = c->s;
    /* a drain pushes session after session: one kept buffer, no fresh pages or copies for each */
    if (h->op == WIRE_OP_SESSION_PUSH && srv_move_peer_allowed(c)) *bulk = c->bulk = true;
    unsigned long long now = atomic_fetch_add(&s->buffered, h->payload_len);
    if (now + h->payload_len > s->p.max_buffered_bytes && !close_hog(s, c, h->payload_len)) {
        atomic_fetch_sub(&s->buffered, h->payload_len); /* a hog that held more was closed instead */
        return KVS_ERR_BUSY;
    }
    c->rx_held = h->payload_len;
    return KVS_OK;
}

static void conn_release_rx(srv_conn *c) {
    atomic_fetch_sub(&c->s->buffered, c->rx_held);
    c->rx_held = 0;
}

/* Brings s->rx_capacity up to date with c's receive buffer. */
static void conn_count_rx(srv_conn *c, const struct netio_buf *b) {
    atomic_fetch_add(&c->s->rx_capacity, b->cap);
    atomic_fetch_sub(&c->s->rx_capacity, c->rx_cap);
    c->rx_cap = b->cap;
}

void srv_count_protocol_error(srv *s) {
    pthread_mutex_lock(&s->mu);
    s->c_protocol_errors++;
    pthread_mutex_unlock(&s->mu);
}

static void send_info(srv_conn *c, uint64_t rid, int status) {
    srv *s = c->s;
    const model *m = s->e->m;
    struct wire_info in;
    memset(&in, 0, sizeof(in));
    in.st.status = status;
    if (status == KVS_OK) {
        in.version = c->version;
        in.hidden_dtypes = WIRE_DTYPE_F32 | WIRE_DTYPE_F16 | (c->version >= 2 ? WIRE_DTYPE_BF16 : 0);
        memcpy(in.model_digest, s->digest, 32);
        in.n_layer = m->hp.n_layer;
        in.first = m->first;
        in.last = m->last;
        in.n_embd = m->hp.n_embd;
        in.n_vocab = m->hp.n_vocab;
        in.kv_budget_bytes = s->p.kv_budget_bytes;
        in.max_tokens = s->p.max_tokens;
        in.max_ctx = kv_get_params(s->e->kv)->max_positions;
        in.name_len = (uint16_t)strlen(s->name);
        memcpy(in.name, s->name, in.name_len);
    }
    uint8_t buf[512];
    size_t len = 0;
    if (wire_encode_info(&in, buf, sizeof(buf), &len) == KVS_OK) srv_conn_send(c, WIRE_OP_INFO, rid, buf, len);
}

static void count_locked(srv *s, uint64_t *counter) {
    pthread_mutex_lock(&s->mu);
    (*counter)++;
    pthread_mutex_unlock(&s->mu);
}

/* A plaintext kvshard client at this TLS port (its first bytes are the frame magic, not a TLS
 * ClientHello): told so in a plaintext STATUS it can read, and logged, instead of a handshake
 * error that names neither side's mistake. */
static bool conn_plaintext_peer(srv_conn *c, struct netio_buf *buf, uint64_t deadline) {
    uint64_t now = kvs_now_ns();
    struct pollfd p = {.fd = c->fd, .events = POLLIN};
    uint8_t b[4];
    if (poll(&p, 1, deadline > now ? (int)((deadline - now) / 1000000u) : 0) <= 0 ||
        recv(c->fd, b, sizeof b, MSG_PEEK | MSG_DONTWAIT) != (ssize_t)sizeof b || memcmp(b, "KVSH", 4) != 0)
        return false;
    struct wire_header h;
    char msg[KVS_MSG_MAX] = "";
    netio_recv_opts o = {.idle_deadline_ns = deadline, .frame_timeout_ms = -1, .max_payload = 6 + WIRE_MAX_AUTH};
    if (netio_recv_frame_opt(c->fd, &h, buf, &o, msg, sizeof msg) == KVS_OK)
        srv_send_status(c, h.request_id, KVS_ERR_UNSUPPORTED, NULL,
                        "this shard speaks TLS: give the client --tls-cert, --tls-key and --tls-ca");
    srv_count_protocol_error(c->s);
    kvs_logf(c->s->p.log, c->s->p.log_ctx, "conn %u (%s): a plaintext kvshard client at this TLS port, closing", c->id,
             c->peer);
    return true;
}

/* The TLS handshake and HELLO, under one deadline: KVS_OK when the peer is authenticated and
 * has been sent INFO; otherwise the connection is to be closed (logged and counted here). */
static int conn_hello(srv_conn *c, struct netio_buf *buf) {
    srv *s = c->s;
    struct wire_header h;
    char msg[KVS_MSG_MAX] = "";
    int err;
    uint64_t hello_deadline = netio_deadline_ms(s->p.hello_timeout_ms);
    if (s->tls && conn_plaintext_peer(c, buf, hello_deadline)) return KVS_ERR_PROTOCOL;
    if (s->tls && (err = tls_handshake(s->tls, c->fd, hello_deadline, c->identity, sizeof c->identity, msg,
                                       sizeof msg)) != KVS_OK) {
        count_locked(s, &s->c_auth_failures);
        kvs_logf(s->p.log, s->p.log_ctx, "conn %u (%s): %s, closing", c->id, c->peer, msg);
        return err;
    }
    netio_recv_opts hello_opts = {.idle_deadline_ns = hello_deadline, .frame_timeout_ms = -1,
                                  .max_payload = 6 + WIRE_MAX_AUTH};
    err = netio_recv_frame_opt(c->fd, &h, buf, &hello_opts, msg, sizeof(msg));
    struct wire_hello hello;
    bool hello_ok = err == KVS_OK && h.op == WIRE_OP_HELLO &&
                    wire_decode_hello(buf->data, buf->len, &hello, msg, sizeof(msg)) == KVS_OK;
    if (hello_ok && hello.min_version > WIRE_PROTO_VERSION) /* protocol.md §4.1: a version we lack */
        err = KVS_ERR_UNSUPPORTED;
    else if (hello_ok) {
        c->version = hello.max_version < WIRE_PROTO_VERSION ? hello.max_version : (uint16_t)WIRE_PROTO_VERSION;
        if (conn_authenticate(c, &hello) != KVS_OK) {
            count_locked(s, &s->c_auth_failures);
            send_info(c, h.request_id, KVS_ERR_INVALID_ARG);
            kvs_logf(s->p.log, s->p.log_ctx, "conn %u (%s): wrong auth token, closing", c->id, c->peer);
            return KVS_ERR_INVALID_ARG;
        }
        atomic_store(&c->authed, true); /* before INFO: from now on it is never evicted for a newcomer */
        send_info(c, h.request_id, KVS_OK);
        kvs_logf(s->p.log, s->p.log_ctx, "conn %u (%s): peer %s", c->id, c->peer, c->identity);
        return KVS_OK;
    }
    if (err == KVS_OK || err == KVS_ERR_PROTOCOL || err == KVS_ERR_UNSUPPORTED) {
        send_info(c, h.request_id, err == KVS_OK ? KVS_ERR_PROTOCOL : err);
        srv_count_protocol_error(s);
    }
    const char *who = err != KVS_ERR_PROTOCOL ? "" /* the header's magic, read little-endian */
                      : h.magic == 0x20544547u || h.magic == 0x54534f50u ? "; an HTTP client at a shard's port"
                      : (h.magic & 0xffffu) == 0x0316u ? "; a TLS client at a plaintext shard" : "";
    kvs_logf(s->p.log, s->p.log_ctx, "conn %u (%s): no valid HELLO (%s%s), closing", c->id, c->peer,
             err ? kvs_strerror(err) : "wrong first frame or version", who);
    return err ? err : KVS_ERR_PROTOCOL;
}

/* A frame that could not be received: answered when the peer can still read it, logged and
 * counted; the connection closes after it. */
static void conn_recv_failed(srv_conn *c, int err, const struct wire_header *h, const netio_recv_opts *o,
                             const char *msg) {
    srv *s = c->s;
    if (err == KVS_ERR_PROTOCOL || err == KVS_ERR_UNSUPPORTED || err == KVS_ERR_TOO_LARGE) {
        srv_send_status(c, h->request_id, err, NULL, msg);
        srv_count_protocol_error(s);
        kvs_logf(s->p.log, s->p.log_ctx, "conn %u (%s): bad frame (%s), closing", c->id, c->peer, msg);
    } else if (err == KVS_ERR_BUSY) {
        count_locked(s, &s->c_refused_buffers);
        srv_send_status(c, h->request_id, err, NULL, "the shard holds too many buffered bytes");
        kvs_logf(s->p.log, s->p.log_ctx, "conn %u (%s): %s, closing", c->id, c->peer, msg);
    } else if (err == KVS_ERR_TIMEOUT && o->started) {
        count_locked(s, &s->c_frame_timeouts);
        kvs_logf(s->p.log, s->p.log_ctx, "conn %u (%s): a frame took longer than %d ms, closing", c->id, c->peer, s->p.frame_timeout_ms);
    } else if (err == KVS_ERR_TIMEOUT) {
        kvs_logf(s->p.log, s->p.log_ctx, "conn %u (%s): idle for %d ms, closing", c->id, c->peer, s->p.idle_timeout_ms);
    }
}

/* One request frame after HELLO: the cheap ops are answered here, FORWARD (and TRUNCATE /
 * RELEASE behind one) become jobs for the scheduler. */
static void conn_dispatch(srv_conn *c, const struct wire_header *h, const struct netio_buf *buf) {
    srv *s = c->s;
    char msg[KVS_MSG_MAX] = "";
    const uint64_t rid = h->request_id;
    switch (h->op) {
    case WIRE_OP_FORWARD:
        srv_handle_forward(c, rid, buf->data, buf->len);
        break;
    case WIRE_OP_TRUNCATE:
    case WIRE_OP_RELEASE:
        srv_handle_truncate_release(c, h, buf->data, buf->len);
        break;
    case WIRE_OP_CANCEL: {
        struct wire_cancel t;
        if (wire_decode_cancel(buf->data, buf->len, &t, msg, sizeof(msg))) {
            srv_send_status(c, rid, KVS_ERR_PROTOCOL, NULL, msg);
            break;
        }
        int n = srv_cancel_jobs(c, false, t.target_request_id);
        srv_send_status(c, rid, n ? KVS_OK : KVS_ERR_NOT_FOUND, NULL, NULL);
        break;
    }
    case WIRE_OP_RELAY_LISTEN: {
        struct wire_relay_listen t;
        if (wire_decode_relay_listen(buf->data, buf->len, &t, msg, sizeof(msg)))
            srv_send_status(c, rid, KVS_ERR_PROTOCOL, NULL, msg);
        else if (c->version < 2)
            srv_send_status(c, rid, KVS_ERR_UNSUPPORTED, NULL, "RELAY_LISTEN needs protocol version 2");
        else
            srv_send_status(c, rid, relay_listen_add(s->relay, t.relay_id, c->tenant, c), NULL, NULL);
        break;
    }
    case WIRE_OP_SESSION_PUSH:
        srv_handle_session_push(c, rid, buf->data, buf->len);
        break;
    case WIRE_OP_DRAIN:
        srv_handle_drain(c, rid, buf->data, buf->len);
        break;
    case WIRE_OP_STATS:
        if (wire_decode_empty(buf->data, buf->len, msg, sizeof(msg))) srv_send_status(c, rid, KVS_ERR_PROTOCOL, NULL, msg);
        else srv_handle_stats(c, rid);
        break;
    case WIRE_OP_VOCAB: {
        struct wire_vocab q;
        if (wire_decode_vocab(buf->data, buf->len, &q, msg, sizeof(msg))) srv_send_status(c, rid, KVS_ERR_PROTOCOL, NULL, msg);
        else srv_handle_vocab(c, rid, &q);
        break;
    }
    case WIRE_OP_VOCAB_META: {
        struct wire_vocab_meta q;
        if (wire_decode_vocab_meta(buf->data, buf->len, &q, msg, sizeof(msg)))
            srv_send_status(c, rid, KVS_ERR_PROTOCOL, NULL, msg);
        else srv_handle_vocab_meta(c, rid, &q);
        break;
    }
    default:
        srv_send_status(c, rid, KVS_ERR_PROTOCOL, NULL, "op not valid from a client after HELLO");
        srv_count_protocol_error(s);
        break;
    }
}

/* The reader is done: its jobs are cancelled, the writer drains what is queued and stops. */
static void conn_close(srv_conn *c) {
    srv *s = c->s;
    relay_listen_drop(s->relay, c); /* before our unref: relay.h design note 4 */
    int n = srv_cancel_jobs(c, true, 0);
    /* Closed first, so nothing new is queued while the writer drains (an error reply before
     * closing still goes out), then it is stopped and joined. */
    atomic_store(&c->closed, true);
    pthread_mutex_lock(&c->write_lock);
    c->writer_stop = true;
    pthread_cond_signal(&c->write_cv);
    pthread_mutex_unlock(&c->write_lock);
    pthread_join(c->writer, NULL);
    shutdown(c->fd, SHUT_RDWR);
    kvs_logf(s->p.log, s->p.log_ctx, "conn %u (%s): closed after %lu request(s)%s", c->id, c->peer, c->requests,
             n ? ", cancelled its work in flight" : "");
}

void *srv_conn_main(void *arg) {
    srv_conn *c = arg;
    srv *s = c->s;
    struct netio_buf buf = {0};
    if (conn_hello(c, &buf) == KVS_OK) {
        while (!atomic_load(&c->closed)) {
            conn_release_rx(c);
            if (!c->bulk) netio_buf_trim(&buf); /* a large frame does not keep its buffer while the peer idles */
            conn_count_rx(c, &buf);
            struct wire_header h;
            char msg[KVS_MSG_MAX] = "";
            netio_recv_opts o = {.idle_deadline_ns = netio_deadline_ms(s->p.idle_timeout_ms),
                                 .frame_timeout_ms = s->p.frame_timeout_ms > 0 ? s->p.frame_timeout_ms : -1,
                                 .admit = conn_admit, .admit_ctx = c, .keep_buffer = c->bulk};
            int err = netio_recv_frame_opt(c->fd, &h, &buf, &o, msg, sizeof(msg));
            conn_count_rx(c, &buf);
            if (err) {
                conn_recv_failed(c, err, &h, &o, msg);
                break;
            }
            if (atomic_load(&s->draining) && s->p.state_dir &&
                (h.op == WIRE_OP_FORWARD || h.op == WIRE_OP_TRUNCATE || h.op == WIRE_OP_RELEASE)) {
                kvs_logf(s->p.log, s->p.log_ctx, "conn %u (%s): stopping: new work not admitted, closing", c->id,
                         c->peer);
                break;
            }
            c->requests++;
            if (srv_move_gate(c, &h, &buf)) continue;
            conn_dispatch(c, &h, &buf);
        }
    }
    conn_release_rx(c);
    conn_close(c);
    netio_buf_free(&buf);
    conn_count_rx(c, &buf);
    srv_conn_unref(c);
    return NULL;
}
