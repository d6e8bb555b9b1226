/*
 * http_guard — how much of `kvshard api` one client can hold (http.h design note 6): the
 * per-connection limits of libmicrohttpd that bound slow or silent clients.
 */
#include <microhttpd.h>
#include <sys/socket.h>

#include "http_impl.h"

void http_guard_long_work(struct MHD_Connection *c, bool begin, unsigned resume_s) {
    /* 0 turns the timeout off while the server itself works (a generation, a queue wait, health
     * probes); setting it again afterwards restarts its clock (libmicrohttpd's rule). */
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, begin ? 0u : resume_s);
}

void http_guard_stream(struct MHD_Connection *c, const http_params *p) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (ci) {
        int sz = p->stream_sndbuf;
        (void)setsockopt(ci->connect_fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz); /* best effort */
    }
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, (unsigned)p->stream_stall_s);
}
