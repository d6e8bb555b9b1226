/*
 * netio — blocking TCP socket helpers with deadlines, and whole-frame send/receive.
 *
 * Sockets stay in blocking mode; every wait goes through poll() against an absolute deadline
 * (kvs_now_ns() clock, nanoseconds; NETIO_NO_DEADLINE waits forever), and every read/write uses
 * MSG_DONTWAIT so a spurious wake-up cannot block past the deadline. Writes use MSG_NOSIGNAL:
 * a peer that went away gives KVS_ERR_CLOSED, never SIGPIPE. The fds must be sockets (TCP or
 * AF_UNIX, e.g. socketpair()).
 *
 * Error codes: KVS_ERR_TIMEOUT (deadline passed), KVS_ERR_CLOSED (EOF or reset, including EOF in
 * the middle of a frame), KVS_ERR_PROTOCOL / KVS_ERR_UNSUPPORTED / KVS_ERR_TOO_LARGE (bad frame
 * header, see wire_decode_header), KVS_ERR_IO (any other socket error; msg has strerror),
 * KVS_ERR_NOMEM, KVS_ERR_INVALID_ARG, KVS_ERR_NOT_FOUND (name resolution failed).
 * After a TIMEOUT or CLOSED in the middle of a frame the stream position is unknown: close the fd.
 *
 * TLS: an fd that tls_server_handshake / tls_client_handshake (tls.h) attached a session to is
 * read and written through that session by every function here — callers keep passing the fd.
 * Such an fd is O_NONBLOCK and must be closed with netio_close(). One reader thread and one
 * writer thread may use the same fd at once (the session has its own lock).
 */
#ifndef KVS_NETIO_H
#define KVS_NETIO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "wire.h"

#define NETIO_NO_DEADLINE 0u
#define NETIO_HOST_MAX 256u /* bytes of a host name, NUL included */

/* Absolute deadline timeout_ms from now (kvs_now_ns() clock); a negative timeout gives
 * NETIO_NO_DEADLINE. */
uint64_t netio_deadline_ms(int64_t timeout_ms);

/* Splits "HOST:PORT" ("[v6addr]:PORT" for IPv6) into host (NUL-terminated, capacity host_cap)
 * and port (0..65535). KVS_ERR_INVALID_ARG on a malformed string or host too long; outputs are
 * untouched then. */
int netio_parse_hostport(const char *s, char *host, size_t host_cap, uint16_t *port);

/* True for a host only this machine can reach: 127.0.0.0/8, ::1, "localhost" (numeric hosts are
 * not resolved; any other name is not loopback). */
bool netio_host_is_loopback(const char *host);

/* Listens on host:port (host NULL or "" = all interfaces; port 0 = the kernel picks a free one).
 * On success *fd_out is the listening socket (close-on-exec, SO_REUSEADDR) and *bound_port (if
 * non-NULL) the port actually bound. On failure nothing stays open. */
int netio_listen(const char *host, uint16_t port, int backlog, int *fd_out, uint16_t *bound_port,
                 char *msg, size_t msg_cap);

/* Accepts one connection, waiting until deadline_ns. *fd_out: blocking, close-on-exec,
 * TCP_NODELAY when TCP. KVS_ERR_TIMEOUT when nobody came in time. */
int netio_accept(int listen_fd, uint64_t deadline_ns, int *fd_out, char *msg, size_t msg_cap);

/* Connects to host:port, trying each resolved address until deadline_ns. *fd_out: blocking,
 * close-on-exec, TCP_NODELAY. KVS_ERR_TIMEOUT, KVS_ERR_NOT_FOUND (unresolvable) or KVS_ERR_IO
 * (refused / unreachable). On failure nothing stays open. */
int netio_connect(const char *host, uint16_t port, uint64_t deadline_ns, int *fd_out, char *msg,
                  size_t msg_cap);

/* Reads exactly len bytes. KVS_ERR_CLOSED on EOF before len bytes (some may have been read). */
int netio_read_full(int fd, void *buf, size_t len, uint64_t deadline_ns);

/* Writes exactly len bytes. KVS_ERR_CLOSED when the peer is gone (EPIPE / ECONNRESET). */
int netio_write_full(int fd, const void *buf, size_t len, uint64_t deadline_ns);

/* Sends one frame: the header built from (op, request_id, payload_len = len) then the payload,
 * in one gathered write. KVS_ERR_TOO_LARGE if len > WIRE_MAX_PAYLOAD (nothing sent),
 * KVS_ERR_INVALID_ARG for an unknown op. */
int netio_send_frame(int fd, uint16_t op, uint64_t request_id, const void *payload, size_t len,
                     uint64_t deadline_ns);

/* Growable receive buffer, owned by the caller: start zeroed ({0}), free with netio_buf_free(). */
struct netio_buf {
    uint8_t *data; /* malloc'd; payload of the last frame received */
    size_t len;    /* payload bytes of the last frame */
    size_t cap;    /* bytes allocated */
};
void netio_buf_free(struct netio_buf *b); /* frees data, leaves b zeroed; NULL is fine */
/* Frees b's data when it holds more than NETIO_BUF_KEEP bytes (what a large frame left). */
void netio_buf_trim(struct netio_buf *b);

/* Receives one frame: reads and validates the header, then the payload into b (b->len =
 * payload_len). The payload limit is checked before any allocation, and the buffer grows only
 * as bytes actually arrive (a peer that announces 64 MiB and sends nothing costs at most 64 KiB).
 * A buffer left larger than NETIO_BUF_KEEP by an earlier frame is freed first, so one large
 * frame does not pin its memory for the life of the connection.
 * Header errors (PROTOCOL / UNSUPPORTED / TOO_LARGE) leave the raw header fields in *hdr so a
 * server can answer before closing; the payload has not been read then. Pointers decoded from
 * b->data stay valid until the next call with the same buffer or netio_buf_free(). */
int netio_recv_frame(int fd, struct wire_header *hdr, struct netio_buf *b, uint64_t deadline_ns,
                     char *msg, size_t msg_cap);

#define NETIO_BUF_KEEP (1u << 20) /* receive buffer bytes kept between frames */

/* Limits of one netio_recv_frame_opt call. */
typedef struct {
    uint64_t idle_deadline_ns; /* the frame's first byte must arrive by then (NETIO_NO_DEADLINE: any time) */
    int64_t frame_timeout_ms;  /* once the first byte is in, the whole frame must follow within this
                                  (a slow-loris sender is cut off); < 0: idle_deadline_ns only */
    uint32_t max_payload;      /* 0 = WIRE_MAX_PAYLOAD; a larger announced payload is TOO_LARGE
                                  before anything is allocated */
    /* Called after a valid header, before any payload byte is read or allocated; a non-OK return
     * refuses the frame (returned as is, payload unread). It may set *bulk (which starts as
     * keep_buffer) to take this frame as a bulk one. NULL: always admitted. */
    int (*admit)(void *ctx, const struct wire_header *h, bool *bulk);
    void *admit_ctx;
    bool keep_buffer;          /* bulk frames: keep b's allocation however large (a trusted peer
                                  sending them in a row) and reserve each frame's payload at once (no
                                  copies as it grows); false: a buffer past NETIO_BUF_KEEP is freed
                                  first and grows only as bytes arrive */
    bool started;              /* out: the frame's first byte arrived (a TIMEOUT with this set is
                                  a frame that did not complete in time, not an idle peer) */
} netio_recv_opts;

/* netio_recv_frame under the limits in *o. A frame over max_payload gives KVS_ERR_TOO_LARGE with
 * *hdr filled; a frame that does not complete in time gives KVS_ERR_TIMEOUT. */
int netio_recv_frame_opt(int fd, struct wire_header *hdr, struct netio_buf *b, netio_recv_opts *o,
                         char *msg, size_t msg_cap);

/* Closes fd, first ending and freeing the TLS session attached to it (tls.h), if any. -1 is fine.
 * Every fd that may carry TLS must be closed through here. */
void netio_close(int fd);

#endif /* KVS_NETIO_H */
