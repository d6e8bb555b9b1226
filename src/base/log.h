/*
 * log — the one way a library module reports an event: a formatted line handed to a callback.
 *
 * The library never prints. A module that has events to report (recovery in route, link events in
 * relay, requests in http, connections in server) takes a kvs_log_fn and its context in its
 * params, and formats each event with kvs_logf:
 *
 *     kvs_logf(p->log, p->log_ctx, "hop %u (%s) failed: %s", k, addr, why);
 *
 * A NULL callback costs one test and no formatting. The modules' own callback types (route_log_fn,
 * relay_log_fn, http_log_fn, srv_log_fn) are the same function type, so their fields are passed
 * as they are.
 */
#ifndef KVS_LOG_H
#define KVS_LOG_H

#include <stdarg.h>

/* Longest line a callback receives, NUL included; a longer line is cut there. */
#define KVS_LOG_LINE_MAX 512

/* Receives one line without a trailing newline; the line is valid only during the call. */
typedef void (*kvs_log_fn)(void *ctx, const char *line);

/* Formats fmt into a line (cut at KVS_LOG_LINE_MAX - 1 bytes, trailing newlines removed) and
 * hands it to fn(ctx, line). fn NULL: nothing happens. */
void kvs_logf(kvs_log_fn fn, void *ctx, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* kvs_logf with a va_list (for callbacks that receive one, such as libmicrohttpd's logger). */
void kvs_vlogf(kvs_log_fn fn, void *ctx, const char *fmt, va_list ap) __attribute__((format(printf, 3, 0)));

#endif /* KVS_LOG_H */
