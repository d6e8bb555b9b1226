/* route_hop — one connection to a shard: connect, HELLO, and one request and its reply. */
#include "route.h"

#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "route_impl.h"
#include "util.h"

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

/* What a HELLO reached when the first bytes back are not a frame: "HTTP/" (an HTTP server) or a
 * TLS record (an alert or a handshake: the shard wants TLS). NULL: nothing recognisable. */
static const char *foreign_answer(int fd) {
    uint8_t b[5];
    ssize_t n = recv(fd, b, sizeof b, MSG_PEEK | MSG_DONTWAIT);
    if (n == 5 && !memcmp(b, "HTTP/", 5)) return "an HTTP server answered (an api port?), not a shard";
    if (n >= 2 && (b[0] == 0x15 || b[0] == 0x16) && b[1] == 0x03)
        return "it answered in TLS: give --tls-cert, --tls-key and --tls-ca";
    return NULL;
}

/* Does an HTTP server listen at h? A fresh connection asks; false when nothing says "HTTP/"
 * within 2 s. Used only when a HELLO went unanswered, since a shard answers it at once. */
static bool hop_is_http(const route_hop *h) {
    int fd = -1;
    char msg[KVS_MSG_MAX];
    uint64_t until = netio_deadline_ms(2000);
    static const char req[] = "GET / HTTP/1.0\r\n\r\n";
    char b[5] = {0};
    bool http = netio_connect(h->addr.host, h->addr.port, until, &fd, msg, sizeof msg) == KVS_OK &&
                netio_write_full(fd, req, sizeof req - 1, until) == KVS_OK &&
                netio_read_full(fd, b, sizeof b, until) == KVS_OK && !memcmp(b, "HTTP/", 5);
    netio_close(fd);
    return http;
}

/* A plaintext HELLO just sent on h: waits up to 2 s for the first bytes of the answer. An HTTP or
 * TLS answer (or, when nothing came, an HTTP server found at the address) fails at once with what
 * was reached, instead of "no reply" after the whole timeout or "connection closed". */
static int hello_screen(route *r, route_hop *h, char *why, size_t why_cap) {
    int64_t wait_ms = r->p.timeout_ms >= 0 && r->p.timeout_ms < 2000 ? r->p.timeout_ms : 2000;
    struct pollfd pfd = {.fd = h->fd, .events = POLLIN};
    int ready = poll(&pfd, 1, (int)wait_ms);
    const char *what = ready > 0 ? foreign_answer(h->fd) : hop_is_http(h) ? "an HTTP server listens there (an api "
                                                                              "port?), not a shard"
                                                                            : NULL;
    if (!what) return KVS_OK;
    route_hop_disconnect(h);
    return kvs_fail(why, why_cap, KVS_ERR_PROTOCOL, "HELLO: %s", what);
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
    if (op == WIRE_OP_HELLO && !r->tls && (rc = hello_screen(r, h, why, why_cap)) != KVS_OK) return rc;
    struct wire_header hdr;
    netio_recv_opts ro = {.idle_deadline_ns = deadline, .frame_timeout_ms = -1,
                          .max_payload = route_reply_limit(r, reply_op)};
    /* Late answers to earlier requests (a relayed attempt that was given up) are dropped. */
    do {
        rc = netio_recv_frame_opt(h->fd, &hdr, &r->rx, &ro, nmsg, sizeof nmsg);
        if (rc == KVS_OK) r->bytes_received += WIRE_HEADER_SIZE + r->rx.len;
        /* A socket that is never empty never waits, so the deadline is checked per frame too. */
        if (rc == KVS_OK && hdr.request_id < rid && deadline != NETIO_NO_DEADLINE && kvs_now_ns() >= deadline)
            rc = KVS_ERR_TIMEOUT;
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
            /* The session went to another shard: why is its address (route_follow_move). */
            if (sr.st.status == KVS_ERR_MOVED) return kvs_fail(why, why_cap, KVS_ERR_MOVED, "%s", sr.msg);
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
    if (r->p.check_hop && r->p.check_hop(r->p.check_hop_ctx, h->addr.text, &h->info, nmsg, sizeof nmsg) != KVS_OK) {
        route_hop_disconnect(h);
        return kvs_fail(why, why_cap, KVS_ERR_INVALID_ARG, "%s", nmsg);
    }
    return KVS_OK;
}

/* Errors of a hop that is gone (the connection or the shard), as opposed to a refusal. */
bool route_is_transport_error(int rc) {
    return rc == KVS_ERR_IO || rc == KVS_ERR_TIMEOUT || rc == KVS_ERR_CLOSED || rc == KVS_ERR_PROTOCOL;
}

/* True when the shard has closed h's connection while it sat unused (a shard closes a link
 * silent past its --idle-timeout): FIN, reset or EOF pending, seen without blocking. A link with
 * frames waiting (late answers) is alive. */
static bool hop_link_closed(const route_hop *h) {
    struct pollfd pfd = {.fd = h->fd, .events = POLLIN | POLLRDHUP};
    if (poll(&pfd, 1, 0) <= 0) return false;
    if (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR)) return true;
    char c;
    return recv(h->fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

int route_hop_reconnect(route *r, route_hop *h, char *why, size_t why_cap) {
    struct wire_info was = h->info;
    int rc = route_hop_connect(r, h, why, why_cap);
    if (rc == KVS_OK && (memcmp(was.model_digest, h->info.model_digest, WIRE_DIGEST_SIZE) != 0 ||
                         was.first != h->info.first || was.last != h->info.last)) {
        route_hop_disconnect(h);
        snprintf(why, why_cap, "it now serves another model or other layers");
        rc = KVS_ERR_INVALID_ARG;
    }
    h->info = rc == KVS_OK ? h->info : was;
    return rc;
}

/* Reconnects every hop whose link the shard closed while idle: HELLO again on a new connection.
 * Sessions live on the shard by id, not by connection, so nothing is replayed. A hop that cannot
 * be reached again, or now serves other layers or another model, is left disconnected: the step
 * that follows treats it as failed (failover). */
void route_refresh_links(route *r) {
    for (uint32_t k = 0; k < r->n_hops; k++) {
        route_hop *h = &r->hops[k];
        if (h->fd < 0 || !hop_link_closed(h)) continue;
        char why[KVS_MSG_MAX] = "";
        int rc = route_hop_reconnect(r, h, why, sizeof why);
        route_log(r, "hop %u (%s): the shard closed the idle link; %s%s", k, h->addr.text,
                  rc == KVS_OK ? "reconnected" : "cannot reconnect: ", rc == KVS_OK ? "" : why);
    }
}
