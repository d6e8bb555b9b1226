/* What every command takes besides its own options:
 *   --version            prints "kvshard COMMIT" and exits 0
 *   --log-level LEVEL    error, warn, info (default) or debug, for the log of serve and api
 *                        (daemon_log_line); KVSHARD_LOG_LEVEL sets the same
 *   KVSHARD_* variables  stand for common flags not given on the command line: KVSHARD_MODEL (-m),
 *                        KVSHARD_ROUTE (--route), KVSHARD_LISTEN, KVSHARD_KV_BUDGET,
 *                        KVSHARD_CTX_SIZE, KVSHARD_THREADS (-t), KVSHARD_TLS_CERT, KVSHARD_TLS_KEY,
 *                        KVSHARD_TLS_CA, KVSHARD_AUTH_TOKEN_FILE, each for the commands that take it.
 */
#ifndef KVS_CLI_ENV_H
#define KVS_CLI_ENV_H

/* argv[0] is the command's name. Returns -1 to go on with *argc / *argv (a new array when
 * anything was removed or added; it lives until exit), or the exit status to return now
 * (--version: 0; a bad --log-level: 2, reported). */
int cli_prepare(int *argc, char ***argv);

#endif /* KVS_CLI_ENV_H */
