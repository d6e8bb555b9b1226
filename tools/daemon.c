/* Log line and stop signals of serve and api: see daemon.h. */
#include "daemon.h"

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

static int g_level = DAEMON_LOG_INFO;

void daemon_set_log_level(int level) { g_level = level; }

static bool has_any(const char *line, const char *const *words, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (strstr(line, words[i])) return true;
    return false;
}

static int line_level(const char *line) {
    static const char *const debug[] = {"): peer ", "): closed after "};
    static const char *const error[] = {"fail", "error", "cannot"};
    static const char *const warn[] = {"refus", "wrong", "no valid", "invalid", "lost", "plaintext", "too many"};
    if (has_any(line, error, 3)) return DAEMON_LOG_ERROR;
    if (has_any(line, warn, sizeof warn / sizeof warn[0])) return DAEMON_LOG_WARN;
    if (has_any(line, debug, 2)) return DAEMON_LOG_DEBUG;
    return DAEMON_LOG_INFO;
}

void daemon_log_line(void *ctx, const char *line) {
    if (line_level(line) > g_level) return;
    char ts[32];
    time_t t = time(NULL);
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(ts, sizeof(ts), "%H:%M:%S", &tm);
    fprintf(stderr, "[%s] %s: %s\n", ts, (const char *)ctx, line);
}

void daemon_notify(const char *state) {
    const char *path = getenv("NOTIFY_SOCKET");
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    size_t n = path ? strlen(path) : 0;
    if (n < 2 || n >= sizeof sa.sun_path || (path[0] != '/' && path[0] != '@')) return;
    memcpy(sa.sun_path, path, n);
    if (sa.sun_path[0] == '@') sa.sun_path[0] = 0;
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return;
    ssize_t r = sendto(fd, state, strlen(state), MSG_NOSIGNAL, (struct sockaddr *)&sa,
                       (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n));
    (void)r;
    close(fd);
}

const char *daemon_cache_dir(const char *flag, char *buf, size_t cap) {
    if (flag) return strcmp(flag, "off") ? flag : NULL;
    const char *v = getenv("KVSHARD_CACHE_DIR");
    if (v && v[0]) return v;
    if ((v = getenv("CACHE_DIRECTORY")) && v[0]) { /* systemd: a ':'-separated list, the first is ours */
        snprintf(buf, cap, "%.*s", (int)strcspn(v, ":"), v);
        return buf;
    }
    if ((v = getenv("XDG_CACHE_HOME")) && v[0] == '/') {
        snprintf(buf, cap, "%s/kvshard", v);
        return buf;
    }
    if ((v = getenv("HOME")) && v[0] == '/') {
        snprintf(buf, cap, "%s/.cache/kvshard", v);
        return buf;
    }
    return NULL;
}

void daemon_on_stop_signals(void (*handler)(int)) {
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = handler;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}
