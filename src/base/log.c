#include "log.h"

#include <stdio.h>
#include <string.h>

void kvs_vlogf(kvs_log_fn fn, void *ctx, const char *fmt, va_list ap) {
    if (!fn) return;
    char line[KVS_LOG_LINE_MAX];
    vsnprintf(line, sizeof line, fmt, ap);
    /* The callback's contract is one line; libmicrohttpd's messages end in a newline. */
    size_t n = strlen(line);
    while (n && line[n - 1] == '\n') line[--n] = '\0';
    fn(ctx, line);
}

void kvs_logf(kvs_log_fn fn, void *ctx, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    kvs_vlogf(fn, ctx, fmt, ap);
    va_end(ap);
}
