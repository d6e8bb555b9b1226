/*
 * route_harness — the multi-process route tests' shared pieces (test_route, test_relay,
 * test_tls_route): a route spec naming started shards, the value of a key in a client's JSON
 * stats line, and a `kvshard generate` run with a --pause-after handshake: started with its
 * stdin and stdout on pipes, waited on (bounded) until its log says it paused, then resumed with
 * a newline and read to the end. The test does what it tests (kill, stop) while it is paused.
 */
#ifndef KVS_ROUTE_HARNESS_H
#define KVS_ROUTE_HARNESS_H

#include "proc.h"
#include "test.h"

/* "127.0.0.1:P0,127.0.0.1:P1,..." for the first n servers of s. */
static inline void route_of(char *buf, size_t cap, const proc_server *s, int n) {
    buf[0] = 0;
    for (int i = 0; i < n; i++) {
        size_t l = strlen(buf);
        snprintf(buf + l, cap - l, "%s127.0.0.1:%d", i ? "," : "", s[i].port);
    }
}

/* Value of "key": in the JSON stats line (the line starting with '{') of log; -1 when absent. */
static inline double stat_of(const char *log, const char *key) {
    FILE *f = fopen(log, "r");
    char line[2048], pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    double v = -1;
    while (f && fgets(line, sizeof line, f)) {
        const char *p = line[0] == '{' ? strstr(line, pat) : NULL;
        if (p) v = atof(p + strlen(pat));
    }
    if (f) fclose(f);
    return v;
}

/* A `kvshard generate ... --pause-after N` child. */
typedef struct {
    pid_t pid;       /* -1 when it did not start */
    int stdin_fd;    /* write end of its stdin; -1 once closed */
    int stdout_fd;   /* read end of its stdout; -1 once closed */
    const char *log; /* its stderr (truncated at start); the caller's string */
} paused_gen;

/* Forks argv (argv[0] replaced by the kvshard binary) with stdin and stdout on pipes and stderr
 * truncated into log. False (g->pid -1, nothing left open) when the pipes cannot be made. */
static inline bool paused_gen_start(paused_gen *g, char *const argv[], const char *log) {
    int in[2], out[2];
    g->pid = -1;
    g->stdin_fd = g->stdout_fd = -1;
    g->log = log;
    if (pipe(in) != 0) return false;
    if (pipe(out) != 0) {
        close(in[0]);
        close(in[1]);
        return false;
    }
    g->pid = fork();
    if (g->pid == 0) {
        dup2(in[0], 0);
        dup2(out[1], 1);
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, 2);
        close(in[1]);
        close(out[0]);
        proc_close_inherited();
        execv(proc_bin(), argv);
        _exit(127);
    }
    close(in[0]);
    close(out[1]);
    g->stdin_fd = in[1];
    g->stdout_fd = out[0];
    return true;
}

/* Waits (bounded, 60 s) for a whole log line containing marker; the rest of that line after marker
 * goes to rest (cap bytes, may be NULL). True when seen. */
static inline bool paused_gen_wait(const paused_gen *g, const char *marker, char *rest, size_t cap) {
    if (g->pid <= 0) return false;
    bool paused = false;
    for (int waited = 0; waited < 60000 && !paused; waited += 5) {
        FILE *f = fopen(g->log, "r");
        char line[512];
        while (f && !paused && fgets(line, sizeof line, f)) {
            const char *p = strstr(line, marker);
            /* Only a whole line: the client may still be writing the rest of it (the session id). */
            if (!p || !strchr(line, '\n')) continue;
            if (rest) snprintf(rest, cap, "%s", p + strlen(marker));
            paused = true;
        }
        if (f) fclose(f);
        if (!paused) proc_sleep_ms(5);
    }
    return paused;
}

/* Lets a paused child go on (a line on its stdin, then EOF). */
static inline void paused_gen_resume(paused_gen *g) {
    CHECK_EQ_INT(write(g->stdin_fd, "\n", 1), 1);
    close(g->stdin_fd);
    g->stdin_fd = -1;
}

/* A resumed child's whole stdout (*out, malloc'd) and exit status. */
static inline int paused_gen_collect(paused_gen *g, char **out) {
    size_t len = 0, cap = 1 << 16;
    char *got = malloc(cap);
    ssize_t n;
    while ((n = read(g->stdout_fd, got + len, cap - len - 1)) > 0) len += (size_t)n;
    got[len] = 0;
    close(g->stdout_fd);
    g->stdout_fd = -1;
    *out = got;
    return proc_wait(g->pid, 60000);
}

/* Resumes it (one newline on its stdin, then EOF), reads its stdout to the end into a malloc'd
 * string (*out, the caller frees), and waits for it (60 s). Returns its exit status (proc_wait),
 * -1 when it never started (then *out is an empty string). */
static inline int paused_gen_finish(paused_gen *g, char **out) {
    if (g->pid <= 0) {
        *out = calloc(1, 1);
        return -1;
    }
    paused_gen_resume(g);
    return paused_gen_collect(g, out);
}

#endif /* KVS_ROUTE_HARNESS_H */
