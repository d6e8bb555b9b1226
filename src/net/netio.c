/* netio — blocking sockets with poll() deadlines. See netio.h. */
#include "netio.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "tls.h"
#include "util.h"

/* The buffer grows in steps of at least this much, and never beyond what has arrived plus this. */
#define NETIO_RECV_CHUNK (64u << 10)

uint64_t netio_deadline_ms(int64_t timeout_ms) {
    if (timeout_ms < 0) return NETIO_NO_DEADLINE;
    uint64_t d;
    if (!kvs_mul_u64((uint64_t)timeout_ms, 1000000u, &d) || !kvs_add_u64(d, kvs_now_ns(), &d))
        return NETIO_NO_DEADLINE;
    return d == NETIO_NO_DEADLINE ? 1 : d;
}

/* poll() timeout until the deadline: -1 for none, 0 if passed, else ms rounded up so a wait
 * never ends just before the deadline and spins. */
static int poll_timeout(uint64_t deadline_ns) {
    if (deadline_ns == NETIO_NO_DEADLINE) return -1;
    uint64_t now = kvs_now_ns();
    if (now >= deadline_ns) return 0;
    uint64_t ms = (deadline_ns - now + 999999u) / 1000000u;
    return ms > INT_MAX ? INT_MAX : (int)ms;
}

/* Waits for events on fd. KVS_OK when ready (or an error/hangup is pending: the next syscall
 * reports it), KVS_ERR_TIMEOUT, KVS_ERR_IO. */
static int wait_fd(int fd, short events, uint64_t deadline_ns) {
    for (;;) {
        int to = poll_timeout(deadline_ns);
        struct pollfd p = {.fd = fd, .events = events, .revents = 0};
        int rc = poll(&p, 1, to);
        if (rc > 0) return KVS_OK;
        if (rc == 0) {
            if (to == 0 || poll_timeout(deadline_ns) == 0) return KVS_ERR_TIMEOUT;
            continue;
        }
        if (errno != EINTR) return KVS_ERR_IO;
    }
}

static void set_nodelay(int fd) {
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); /* fails harmlessly on AF_UNIX */
}

bool netio_host_is_loopback(const char *host) {
    struct in_addr a4;
    struct in6_addr a6;
    if (!strcmp(host, "localhost")) return true;
    if (inet_pton(AF_INET, host, &a4) == 1) return (ntohl(a4.s_addr) >> 24) == 127;
    if (inet_pton(AF_INET6, host, &a6) == 1) return IN6_IS_ADDR_LOOPBACK(&a6);
    return false;
}

int netio_parse_hostport(const char *s, char *host, size_t host_cap, uint16_t *port) {
    if (!s || !host || !port || host_cap == 0) return KVS_ERR_INVALID_ARG;
    const char *h = s, *colon;
    size_t hl;
    if (s[0] == '[') {
        const char *close = strchr(s, ']');
        if (!close || close[1] != ':') return KVS_ERR_INVALID_ARG;
        h = s + 1;
        hl = (size_t)(close - h);
        colon = close + 1;
    } else {
        colon = strrchr(s, ':');
        if (!colon) return KVS_ERR_INVALID_ARG;
        hl = (size_t)(colon - s);
        if (memchr(s, ':', hl)) return KVS_ERR_INVALID_ARG; /* bare IPv6 needs brackets */
    }
    if (hl == 0 || hl >= host_cap) return KVS_ERR_INVALID_ARG;
    const char *p = colon + 1;
    if (*p == 0) return KVS_ERR_INVALID_ARG;
    uint32_t v = 0;
    for (; *p; p++) {
        if (*p < '0' || *p > '9') return KVS_ERR_INVALID_ARG;
        v = v * 10 + (uint32_t)(*p - '0');
        if (v > 65535) return KVS_ERR_INVALID_ARG;
    }
    memcpy(host, h, hl);
    host[hl] = 0;
    *port = (uint16_t)v;
    return KVS_OK;
}

static int resolve(const char *host, uint16_t port, bool passive, struct addrinfo **res, char *msg,
                   size_t msg_cap) {
    char service[8];
    snprintf(service, sizeof service, "%u", (unsigned)port);
    struct addrinfo hints;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
    if (host && host[0] == 0) host = NULL;
    int rc = getaddrinfo(host, service, &hints, res);
    if (rc != 0)
        return kvs_fail(msg, msg_cap, KVS_ERR_NOT_FOUND, "resolve %s: %s", host ? host : "*",
                        gai_strerror(rc));
    return KVS_OK;
}

int netio_listen(const char *host, uint16_t port, int backlog, int *fd_out, uint16_t *bound_port,
                 char *msg, size_t msg_cap) {
    struct addrinfo *res = NULL;
    if (!fd_out) return KVS_ERR_INVALID_ARG;
    *fd_out = -1;
    int rc = resolve(host, port, true, &res, msg, msg_cap);
    if (rc != KVS_OK) return rc;
    int fd = -1, err = 0;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            err = errno;
            continue;
        }
        int one = 1;
        (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, backlog > 0 ? backlog : 64) == 0)
            break;
        err = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0)
        return kvs_fail(msg, msg_cap, KVS_ERR_IO, "listen %s:%u: %s", host ? host : "*",
                        (unsigned)port, strerror(err));
    if (bound_port) {
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        if (getsockname(fd, (struct sockaddr *)&ss, &sl) != 0) {
            err = errno;
            close(fd);
            return kvs_fail(msg, msg_cap, KVS_ERR_IO, "getsockname: %s", strerror(err));
        }
        if (ss.ss_family == AF_INET6)
            *bound_port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
        else
            *bound_port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
    }
    *fd_out = fd;
    return KVS_OK;
}

int netio_accept(int listen_fd, uint64_t deadline_ns, int *fd_out, char *msg, size_t msg_cap) {
    if (!fd_out) return KVS_ERR_INVALID_ARG;
    *fd_out = -1;
    for (;;) {
        int rc = wait_fd(listen_fd, POLLIN, deadline_ns);
        if (rc == KVS_ERR_TIMEOUT) return kvs_fail(msg, msg_cap, rc, "accept timed out");
        if (rc != KVS_OK) return kvs_fail(msg, msg_cap, rc, "poll: %s", strerror(errno));
        int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd >= 0) {
            int fl = fcntl(fd, F_GETFL);
            if (fl >= 0) (void)fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
            set_nodelay(fd);
            *fd_out = fd;
            return KVS_OK;
        }
        /* a connection that vanished between poll and accept, or a signal: wait again */
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED)
            continue;
        return kvs_fail(msg, msg_cap, KVS_ERR_IO, "accept: %s", strerror(errno));
    }
}

/* Non-blocking connect to one address, waiting until the deadline. */
static int connect_one(const struct addrinfo *ai, uint64_t deadline_ns, int *fd_out, int *err) {
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) {
        *err = errno;
        return KVS_ERR_IO;
    }
    int rc = KVS_OK;
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
        if (errno != EINPROGRESS && errno != EINTR) {
            *err = errno;
            rc = KVS_ERR_IO;
            goto fail;
        }
        rc = wait_fd(fd, POLLOUT, deadline_ns);
        if (rc != KVS_OK) {
            *err = rc == KVS_ERR_TIMEOUT ? ETIMEDOUT : errno;
            goto fail;
        }
        int soerr = 0;
        socklen_t sl = sizeof soerr;
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) != 0) soerr = errno;
        if (soerr != 0) {
            *err = soerr;
            rc = KVS_ERR_IO;
            goto fail;
        }
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        *err = errno;
        rc = KVS_ERR_IO;
        goto fail;
    }
    set_nodelay(fd);
    *fd_out = fd;
    return KVS_OK;
fail:
    close(fd);
    return rc;
}

int netio_connect(const char *host, uint16_t port, uint64_t deadline_ns, int *fd_out, char *msg,
                  size_t msg_cap) {
    struct addrinfo *res = NULL;
    if (!fd_out || !host || !host[0]) return KVS_ERR_INVALID_ARG;
    *fd_out = -1;
    int rc = resolve(host, port, false, &res, msg, msg_cap);
    if (rc != KVS_OK) return rc;
    int err = 0;
    rc = KVS_ERR_IO;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        rc = connect_one(ai, deadline_ns, fd_out, &err);
        if (rc == KVS_OK || rc == KVS_ERR_TIMEOUT) break;
    }
    freeaddrinfo(res);
    if (rc != KVS_OK)
        kvs_fail(msg, msg_cap, rc, "connect %s:%u: %s", host, (unsigned)port, strerror(err));
    return rc;
}

static int sock_errno_code(int e) {
    return (e == EPIPE || e == ECONNRESET || e == ENOTCONN) ? KVS_ERR_CLOSED : KVS_ERR_IO;
}

/* netio_read_full over the TLS session t of fd. */
static int tls_read_full(tls_conn *t, int fd, uint8_t *p, size_t len, uint64_t deadline_ns) {
    size_t got = 0;
    while (got < len) {
        short want = POLLIN;
        long n = tls_conn_read(t, p + got, len - got, &want);
        if (n > 0) {
            got += (size_t)n;
            continue;
        }
        if (n < 0) return (int)n;
        int rc = wait_fd(fd, want, deadline_ns);
        if (rc != KVS_OK) return rc;
    }
    return KVS_OK;
}

int netio_read_full(int fd, void *buf, size_t len, uint64_t deadline_ns) {
    uint8_t *p = buf;
    size_t got = 0;
    if (len && !buf) return KVS_ERR_INVALID_ARG;
    tls_conn *t = tls_conn_of(fd);
    if (t) return tls_read_full(t, fd, p, len, deadline_ns);
    while (got < len) {
        ssize_t n = recv(fd, p + got, len - got, MSG_DONTWAIT);
        if (n > 0) {
            got += (size_t)n;
            continue;
        }
        if (n == 0) return KVS_ERR_CLOSED;
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return sock_errno_code(errno);
        int rc = wait_fd(fd, POLLIN, deadline_ns);
        if (rc != KVS_OK) return rc;
    }
    return KVS_OK;
}

/* Writes len bytes through the TLS session t of fd. */
static int tls_write_full(tls_conn *t, int fd, const uint8_t *p, size_t len, uint64_t deadline_ns) {
    size_t put = 0;
    while (put < len) {
        short want = POLLOUT;
        long n = tls_conn_write(t, p + put, len - put, &want);
        if (n > 0) {
            put += (size_t)n;
            continue;
        }
        if (n < 0) return (int)n;
        int rc = wait_fd(fd, want, deadline_ns);
        if (rc != KVS_OK) return rc;
    }
    return KVS_OK;
}

/* Small frames go out as one TLS record (header and payload copied together). */
#define NETIO_TLS_COALESCE 16384u

/* Writes the iovecs through TLS; small gathers are coalesced into one record. */
static int tls_writev_full(tls_conn *t, int fd, const struct iovec *iov, int iovcnt, uint64_t deadline_ns) {
    size_t total = 0;
    for (int i = 0; i < iovcnt; i++) total += iov[i].iov_len;
    if (iovcnt > 1 && total <= NETIO_TLS_COALESCE) {
        uint8_t one[NETIO_TLS_COALESCE];
        size_t off = 0;
        for (int i = 0; i < iovcnt; i++) {
            if (iov[i].iov_len) memcpy(one + off, iov[i].iov_base, iov[i].iov_len);
            off += iov[i].iov_len;
        }
        return tls_write_full(t, fd, one, total, deadline_ns);
    }
    for (int i = 0; i < iovcnt; i++) {
        int rc = tls_write_full(t, fd, iov[i].iov_base, iov[i].iov_len, deadline_ns);
        if (rc != KVS_OK) return rc;
    }
    return KVS_OK;
}

/* Writes the iovecs completely (the array is modified). */
static int writev_full(int fd, struct iovec *iov, int iovcnt, uint64_t deadline_ns) {
    tls_conn *t = tls_conn_of(fd);
    if (t) return tls_writev_full(t, fd, iov, iovcnt, deadline_ns);
    while (iovcnt > 0) {
        if (iov->iov_len == 0) {
            iov++;
            iovcnt--;
            continue;
        }
        struct msghdr mh;
        memset(&mh, 0, sizeof mh);
        mh.msg_iov = iov;
        mh.msg_iovlen = (size_t)iovcnt;
        ssize_t n = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) return sock_errno_code(errno);
            int rc = wait_fd(fd, POLLOUT, deadline_ns);
            if (rc != KVS_OK) return rc;
            continue;
        }
        size_t left = (size_t)n;
        while (iovcnt > 0 && left >= iov->iov_len) {
            left -= iov->iov_len;
            iov++;
            iovcnt--;
        }
        if (iovcnt > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + left;
            iov->iov_len -= left;
        }
    }
    return KVS_OK;
}

int netio_write_full(int fd, const void *buf, size_t len, uint64_t deadline_ns) {
    if (len && !buf) return KVS_ERR_INVALID_ARG;
    struct iovec iov = {.iov_base = (void *)(uintptr_t)buf, .iov_len = len};
    return writev_full(fd, &iov, 1, deadline_ns);
}

int netio_send_frame(int fd, uint16_t op, uint64_t request_id, const void *payload, size_t len,
                     uint64_t deadline_ns) {
    if (len > WIRE_MAX_PAYLOAD) return KVS_ERR_TOO_LARGE;
    if (len && !payload) return KVS_ERR_INVALID_ARG;
    struct wire_header h = {.magic = WIRE_MAGIC, .version = WIRE_VERSION, .op = op, .flags = 0,
                            .request_id = request_id, .payload_len = (uint32_t)len};
    uint8_t hb[WIRE_HEADER_SIZE];
    int rc = wire_encode_header(&h, hb);
    if (rc != KVS_OK) return rc;
    struct iovec iov[2] = {{.iov_base = hb, .iov_len = sizeof hb},
                           {.iov_base = (void *)(uintptr_t)payload, .iov_len = len}};
    return writev_full(fd, iov, 2, deadline_ns);
}

void netio_buf_free(struct netio_buf *b) {
    if (!b) return;
    free(b->data);
    memset(b, 0, sizeof *b);
}

void netio_buf_trim(struct netio_buf *b) {
    if (b && b->cap > NETIO_BUF_KEEP) netio_buf_free(b);
}

/* A receive buffer this large holds a bulk frame (a session pushed): huge pages for it. */
#define NETIO_HUGE_BUF (4u << 20)

/* Makes b hold at least need bytes (keeping contents). */
static int buf_reserve(struct netio_buf *b, size_t need) {
    if (need <= b->cap) return KVS_OK;
    size_t nc = b->cap ? b->cap : NETIO_RECV_CHUNK;
    while (nc < need) nc *= 2;
    uint8_t *p = realloc(b->data, nc);
    if (!p) return KVS_ERR_NOMEM;
    if (nc >= NETIO_HUGE_BUF) kvs_advise_huge(p, nc);
    b->data = p;
    b->cap = nc;
    return KVS_OK;
}

/* Waits for the first byte of a frame (decrypted data already held by a TLS session counts). */
static int wait_first_byte(int fd, uint64_t deadline_ns) {
    tls_conn *t = tls_conn_of(fd);
    if (t && tls_conn_pending(t)) return KVS_OK;
    return wait_fd(fd, POLLIN, deadline_ns);
}

int netio_recv_frame(int fd, struct wire_header *hdr, struct netio_buf *b, uint64_t deadline_ns,
                     char *msg, size_t msg_cap) {
    netio_recv_opts o = {.idle_deadline_ns = deadline_ns, .frame_timeout_ms = -1};
    return netio_recv_frame_opt(fd, hdr, b, &o, msg, msg_cap);
}

int netio_recv_frame_opt(int fd, struct wire_header *hdr, struct netio_buf *b, netio_recv_opts *o,
                         char *msg, size_t msg_cap) {
    uint8_t hb[WIRE_HEADER_SIZE];
    if (!hdr || !b || !o) return KVS_ERR_INVALID_ARG;
    if (!o->keep_buffer) netio_buf_trim(b);
    b->len = 0;
    uint64_t deadline_ns = o->idle_deadline_ns;
    int rc;
    o->started = false;
    if (o->frame_timeout_ms >= 0) {
        rc = wait_first_byte(fd, o->idle_deadline_ns);
        if (rc != KVS_OK) return kvs_fail(msg, msg_cap, rc, "waiting for a frame: %s", kvs_strerror(rc));
        o->started = true;
        deadline_ns = netio_deadline_ms(o->frame_timeout_ms);
    }
    rc = netio_read_full(fd, hb, sizeof hb, deadline_ns);
    if (rc != KVS_OK) return kvs_fail(msg, msg_cap, rc, "frame header: %s", kvs_strerror(rc));
    rc = wire_decode_header(hb, hdr, msg, msg_cap);
    if (rc != KVS_OK) return rc;
    if (o->max_payload && hdr->payload_len > o->max_payload)
        return kvs_fail(msg, msg_cap, KVS_ERR_TOO_LARGE, "%s of %u bytes is over the %u bytes expected here",
                        wire_op_name(hdr->op), (unsigned)hdr->payload_len, (unsigned)o->max_payload);
    bool bulk = o->keep_buffer;
    if (o->admit && (rc = o->admit(o->admit_ctx, hdr, &bulk)) != KVS_OK)
        return kvs_fail(msg, msg_cap, rc, "%s of %u bytes refused: %s", wire_op_name(hdr->op),
                        (unsigned)hdr->payload_len, kvs_strerror(rc));
    /* Limit checked by wire_decode_header; grow only as data arrives, but for a bulk frame. */
    size_t total = hdr->payload_len, got = 0;
    if (bulk && (rc = buf_reserve(b, total)) != KVS_OK)
        return kvs_fail(msg, msg_cap, rc, "payload buffer of %zu bytes", total);
    while (got < total) {
        size_t want = total - got;
        if (want > NETIO_RECV_CHUNK && got + want > b->cap) {
            /* at most double what we hold, so memory tracks bytes received */
            size_t step = got > NETIO_RECV_CHUNK ? got : NETIO_RECV_CHUNK;
            if (want > step) want = step;
        }
        rc = buf_reserve(b, got + want);
        if (rc != KVS_OK) return kvs_fail(msg, msg_cap, rc, "payload buffer of %zu bytes", got + want);
        rc = netio_read_full(fd, b->data + got, want, deadline_ns);
        if (rc != KVS_OK)
            return kvs_fail(msg, msg_cap, rc, "%s payload after %zu of %zu bytes: %s",
                            wire_op_name(hdr->op), got, total, kvs_strerror(rc));
        got += want;
    }
    b->len = total;
    return KVS_OK;
}

void netio_close(int fd) {
    if (fd < 0) return;
    tls_detach(fd);
    close(fd);
}
