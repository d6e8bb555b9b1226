/* What the long-running commands (`kvshard serve`, `kvshard api`) share: their log line and
 * their stop signals. */
#ifndef KVS_DAEMON_H
#define KVS_DAEMON_H

#include <stddef.h>

/* A srv / http log callback: prints "[HH:MM:SS] TAG: line" (UTC) on stderr, TAG being ctx
 * (a NUL-terminated string the caller keeps alive), when the line's level is shown. The library's
 * lines carry no level, so it is read from the text: a connection opened or closed in the normal
 * way is debug; a failure, refusal or error is warn (error when it says fail/error/cannot); the
 * rest is info. */
void daemon_log_line(void *ctx, const char *line);

/* Levels of daemon_log_line's lines: a line shows when its level is at most the one set. */
enum { DAEMON_LOG_ERROR = 0, DAEMON_LOG_WARN, DAEMON_LOG_INFO, DAEMON_LOG_DEBUG };
void daemon_set_log_level(int level);

/* sd_notify(3) without libsystemd: sends state ("READY=1", "STOPPING=1") as one datagram to
 * the unix socket $NOTIFY_SOCKET names ('@' first: abstract), as systemd's Type=notify units
 * expect. Nothing when the variable is unset or the send fails. */
void daemon_notify(const char *state);

/* The model digest's cache directory: flag ("off": none) when given, else $KVSHARD_CACHE_DIR,
 * systemd's $CACHE_DIRECTORY (CacheDirectory=), $XDG_CACHE_HOME/kvshard, ~/.cache/kvshard;
 * NULL when none applies. The string is flag, an environment value or buf. */
const char *daemon_cache_dir(const char *flag, char *buf, size_t cap);

/* Installs handler for SIGINT and SIGTERM (sigaction, no flags, empty mask). */
void daemon_on_stop_signals(void (*handler)(int));

#endif /* KVS_DAEMON_H */
