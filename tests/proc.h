/* Helpers for multi-process tests: spawn kvshard subcommands, capture output,
 * start shard servers on free ports (read back from their log), bounded waits. */
#ifndef KVS_TEST_PROC_H
#define KVS_TEST_PROC_H

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static inline const char *proc_bin(void) {
    const char *b = getenv("KVS_BIN");
    return b ? b : "./kvshard";
}

static inline void proc_sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Waits for pid up to timeout_ms; kills it (SIGKILL) past that. Returns the
 * exit status (0..255), 128+signal, or -1 on timeout. */
static inline int proc_wait(pid_t pid, int timeout_ms) {
    for (int waited = 0;; waited += 5) {
        int st = 0;
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        if (waited >= timeout_ms) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            return -1;
        }
        proc_sleep_ms(5);
    }
}

/* In a forked child: closes every descriptor above stderr, so a test's open client sockets (curl's
 * have no close-on-exec) do not live on in the child and keep the peer's connection open. */
static inline void proc_close_inherited(void) { close_range(3, ~0U, 0); }

/* Runs argv (argv[0] replaced by the kvshard binary) with stdin from the file
 * in_path (inherited when NULL), stdout captured into a malloc'd string (*out),
 * stderr appended to err_path (or inherited when NULL). The capture stops at
 * EOF or after timeout_ms without output. Returns the exit status (see proc_wait). */
static inline int proc_run_in(char *const argv[], const char *in_path, char **out, const char *err_path,
                              int timeout_ms) {
    int pfd[2];
    if (pipe(pfd) != 0) return -1;
    pid_t pid = fork();
    if (pid == 0) {
        if (in_path) {
            int in = open(in_path, O_RDONLY);
            if (in >= 0) dup2(in, 0);
        }
        dup2(pfd[1], 1);
        close(pfd[0]);
        close(pfd[1]);
        if (err_path) {
            int fd = open(err_path, O_WRONLY | O_CREAT | O_APPEND, 0644);
            if (fd >= 0) dup2(fd, 2);
        }
        proc_close_inherited();
        execv(proc_bin(), argv);
        _exit(127);
    }
    close(pfd[1]);
    size_t len = 0, cap = 4096;
    char *buf = malloc(cap);
    for (int waited = 0; waited < timeout_ms;) {
        struct pollfd p = {.fd = pfd[0], .events = POLLIN};
        int r = poll(&p, 1, 50);
        if (r == 0) {
            waited += 50;
            continue;
        }
        if (len + 4096 > cap) buf = realloc(buf, cap *= 2);
        ssize_t n = read(pfd[0], buf + len, cap - len - 1);
        if (n <= 0) break;
        len += (size_t)n;
    }
    close(pfd[0]);
    buf[len] = 0;
    *out = buf;
    return proc_wait(pid, timeout_ms);
}

/* proc_run_in with stdin inherited. */
static inline int proc_run(char *const argv[], char **out, const char *err_path, int timeout_ms) {
    return proc_run_in(argv, NULL, out, err_path, timeout_ms);
}

/* Runs `kvshard ARGS...` (args NULL-terminated, at most 46) as proc_run does. */
static inline int proc_run_args(const char *const *args, char **out, const char *err_path, int timeout_ms) {
    char *argv[48];
    int n = 0;
    argv[n++] = "kvshard";
    for (int i = 0; args[i] && n < 47; i++) argv[n++] = (char *)args[i];
    argv[n] = NULL;
    return proc_run(argv, out, err_path, timeout_ms);
}

typedef struct {
    pid_t pid;
    int port;
    char log[512];
} proc_server;

/* Starts argv (argv[0] replaced by the kvshard binary; a `kvshard WHAT` command
 * listening on 127.0.0.1:0) with stdin and stdout on /dev/null and stderr in a
 * fresh log under dir, and waits (bounded, 60 s) for the log's "kvshard WHAT:
 * listening on port N" line. False when it exits first or the wait runs out. */
static inline bool proc_start_listener(proc_server *s, const char *dir, const char *what, char *const argv[]) {
    static int counter;
    snprintf(s->log, sizeof(s->log), "%s/%s-%d-%d.log", dir, what, (int)getpid(), counter++);
    char marker[64];
    snprintf(marker, sizeof(marker), "kvshard %s: listening on port ", what);
    s->pid = fork();
    if (s->pid == 0) {
        int fd = open(s->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) dup2(fd, 2);
        int nul = open("/dev/null", O_RDWR);
        if (nul >= 0) {
            dup2(nul, 0);
            dup2(nul, 1);
        }
        proc_close_inherited();
        execv(proc_bin(), argv);
        _exit(127);
    }
    s->port = 0;
    for (int waited = 0; waited < 60000; waited += 10) {
        FILE *f = fopen(s->log, "r");
        if (f) {
            char line[512];
            while (fgets(line, sizeof(line), f)) {
                const char *p = strstr(line, marker);
                if (p && strchr(line, '\n')) s->port = atoi(p + strlen(marker)); /* a whole line only */
            }
            fclose(f);
        }
        if (s->port > 0) return true;
        int st;
        if (waitpid(s->pid, &st, WNOHANG) == s->pid) return false;
        proc_sleep_ms(10);
    }
    return false;
}

/* Starts `kvshard serve -m model --layers layers --listen 127.0.0.1:0 -t 1 [extra...]`
 * with its log in a file under dir, and waits (bounded) for its port. */
static inline bool proc_start_server(proc_server *s, const char *dir, const char *model, const char *layers,
                                     const char *const *extra) {
    char *argv[32];
    int n = 0;
    argv[n++] = "kvshard";
    argv[n++] = "serve";
    argv[n++] = "-m";
    argv[n++] = (char *)model;
    argv[n++] = "--layers";
    argv[n++] = (char *)layers;
    argv[n++] = "--listen";
    argv[n++] = "127.0.0.1:0";
    argv[n++] = "-t";
    argv[n++] = "1";
    for (int i = 0; extra && extra[i] && n < 30; i++) argv[n++] = (char *)extra[i];
    argv[n] = NULL;
    return proc_start_listener(s, dir, "serve", argv);
}

/* kill -9, bounded wait; the server counts as gone (pid 0). */
static inline void proc_kill_server(proc_server *s) {
    if (s->pid <= 0) return;
    kill(s->pid, SIGKILL);
    proc_wait(s->pid, 10000);
    s->pid = 0;
}

/* SIGTERM, bounded wait; returns the exit status. */
static inline int proc_stop_server(proc_server *s) {
    if (s->pid <= 0) return -1;
    kill(s->pid, SIGTERM);
    int st = proc_wait(s->pid, 20000);
    s->pid = 0;
    return st;
}

/* `kvshard ARGS` with stderr appended to DIR/cli.log: its stdout (malloc'd), *status its exit. */
static inline char *proc_cli(const char *dir, const char *const *args, int *status) {
    char errlog[512];
    snprintf(errlog, sizeof errlog, "%s/cli.log", dir);
    char *out = NULL;
    *status = proc_run_args(args, &out, errlog, 120000);
    return out;
}

#endif /* KVS_TEST_PROC_H */
