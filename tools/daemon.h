/* What the long-running commands (`kvshard serve`, `kvshard api`) share: their log line and
 * their stop signals. */
#ifndef KVS_DAEMON_H
#define KVS_DAEMON_H

/* A srv / http log callback: prints "[HH:MM:SS] TAG: line" (UTC) on stderr, TAG being ctx
 * (a NUL-terminated string the caller keeps alive). */
void daemon_log_line(void *ctx, const char *line);

/* Installs handler for SIGINT and SIGTERM (sigaction, no flags, empty mask). */
void daemon_on_stop_signals(void (*handler)(int));

#endif /* KVS_DAEMON_H */
