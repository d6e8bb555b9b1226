/* What every command takes besides its own options: see cli_env.h. */
#include "cli_env.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon.h"
#include "kvs_commit.h" /* KVS_COMMIT, written at build time (cmake/commit.cmake) */

/* One environment variable standing for a flag, for the commands listed (space-separated, each
 * followed by a space). */
typedef struct {
    const char *env, *flag, *cmds;
} env_flag;

static const env_flag ENV_FLAGS[] = {
    {"KVSHARD_MODEL", "-m", "run chat serve api "},
    {"KVSHARD_ROUTE", "--route", "generate chat api "},
    {"KVSHARD_LISTEN", "--listen", "serve api "},
    {"KVSHARD_KV_BUDGET", "--kv-budget", "serve api "},
    {"KVSHARD_CTX_SIZE", "--ctx-size", "run chat serve api generate "},
    {"KVSHARD_THREADS", "-t", "run chat serve api "},
    {"KVSHARD_TLS_CERT", "--tls-cert", "serve generate chat api stats "},
    {"KVSHARD_TLS_KEY", "--tls-key", "serve generate chat api stats "},
    {"KVSHARD_TLS_CA", "--tls-ca", "serve generate chat api stats "},
    {"KVSHARD_AUTH_TOKEN_FILE", "--auth-token-file", "serve generate chat api stats "},
};

static bool has_arg(int argc, char **argv, const char *a) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], a)) return true;
    return false;
}

static bool cmd_in(const char *cmd, const char *list) {
    size_t n = strlen(cmd);
    for (const char *p = list; (p = strstr(p, cmd)) != NULL; p += n)
        if ((p == list || p[-1] == ' ') && p[n] == ' ') return true;
    return false;
}

/* Is flag (or its other spelling) on the command line, or excluded by one that is? -m and
 * --route exclude each other (chat, api). */
static bool flag_given(int argc, char **argv, const char *flag) {
    if (has_arg(argc, argv, flag)) return true;
    if (!strcmp(flag, "--ctx-size")) return has_arg(argc, argv, "-c") || has_arg(argc, argv, "--ctx");
    if (!strcmp(flag, "-m")) return has_arg(argc, argv, "--route");
    if (!strcmp(flag, "--route")) return has_arg(argc, argv, "-m");
    return false;
}

static int log_level_of(const char *s) {
    static const char *const names[] = {"error", "warn", "info", "debug"};
    for (int i = 0; i < 4; i++)
        if (!strcmp(s, names[i])) return i;
    return -1;
}

int cli_prepare(int *argc, char ***argv) {
    int n = *argc;
    char **in = *argv;
    const char *cmd = in[0];
    const char *level = getenv("KVSHARD_LOG_LEVEL");
    if (has_arg(n, in, "--version")) {
        printf("kvshard %s\n", KVS_COMMIT);
        return 0;
    }
    /* The new argv: the old one without --log-level, then flags from the environment. */
    size_t n_env = sizeof ENV_FLAGS / sizeof ENV_FLAGS[0];
    char **out = calloc((size_t)n + 2 * n_env + 1, sizeof *out);
    if (!out) return 1;
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (i > 0 && !strcmp(in[i], "--log-level")) {
            if (i + 1 >= n) {
                fprintf(stderr, "kvshard %s: --log-level wants error, warn, info or debug\n", cmd);
                free(out);
                return 2;
            }
            level = in[++i];
            continue;
        }
        out[m++] = in[i];
    }
    if (level && log_level_of(level) < 0) {
        fprintf(stderr, "kvshard %s: --log-level (or KVSHARD_LOG_LEVEL) wants error, warn, info or debug, got '%s'\n",
                cmd, level);
        free(out);
        return 2;
    }
    daemon_set_log_level(level ? log_level_of(level) : DAEMON_LOG_INFO);
    bool help = has_arg(m, out, "-h") || has_arg(m, out, "--help");
    for (size_t k = 0; k < n_env && !help; k++) {
        const char *v = getenv(ENV_FLAGS[k].env);
        if (!v || !v[0] || !cmd_in(cmd, ENV_FLAGS[k].cmds) || flag_given(m, out, ENV_FLAGS[k].flag)) continue;
        out[m++] = (char *)ENV_FLAGS[k].flag;
        out[m++] = (char *)v;
    }
    out[m] = NULL;
    *argc = m;
    *argv = out; /* lives until exit, as argv does */
    return -1;
}
