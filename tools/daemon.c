/* Log line and stop signals of serve and api: see daemon.h. */
#include "daemon.h"

#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

void daemon_log_line(void *ctx, const char *line) {
    char ts[32];
    time_t t = time(NULL);
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(ts, sizeof(ts), "%H:%M:%S", &tm);
    fprintf(stderr, "[%s] %s: %s\n", ts, (const char *)ctx, line);
}

void daemon_on_stop_signals(void (*handler)(int)) {
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = handler;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}
