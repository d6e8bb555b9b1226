/* kvshard delay-proxy: a TCP relay for benchmarks that holds every chunk it reads D ms before
 * writing it on, in both directions, so one machine's loopback behaves like links with a one-way
 * latency of D ms (scripts/bench-route.sh). Each accepted connection gets a connection to the
 * target and two directions; each direction is a reader thread (stamps chunks as they arrive) and
 * a writer thread (sends each chunk in order once its time has come), so holding one chunk never
 * delays reading the next: the link adds latency, not a bandwidth limit. SIGUSR1 prints the bytes
 * forwarded so far ("bytes to_target=N to_client=M"), for per-token wire figures. Not for
 * production. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "args.h"
#include "cli.h"
#include "netio.h"
#include "util.h"

static _Atomic uint64_t g_bytes[2]; /* forwarded: [0] towards the target, [1] back */

typedef struct chunk {
    struct chunk *next;
    uint64_t due_ns; /* arrival + delay */
    size_t len;
    uint8_t data[];
} chunk;

typedef struct {
    int from, to;
    int dir;           /* index into g_bytes */
    uint64_t delay_ns;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    chunk *head, *tail;
    bool eof;
} direction;

static void *dir_reader(void *arg) {
    direction *d = arg;
    for (;;) {
        uint8_t buf[65536];
        ssize_t n = read(d->from, buf, sizeof buf);
        if (n < 0 && errno == EINTR) continue;
        chunk *c = n > 0 ? malloc(sizeof *c + (size_t)n) : NULL;
        pthread_mutex_lock(&d->mu);
        if (!c) {
            d->eof = true;
        } else {
            c->next = NULL;
            c->due_ns = kvs_now_ns() + d->delay_ns;
            c->len = (size_t)n;
            memcpy(c->data, buf, (size_t)n);
            if (d->tail) d->tail->next = c;
            else d->head = c;
            d->tail = c;
        }
        pthread_cond_signal(&d->cv);
        bool done = d->eof;
        pthread_mutex_unlock(&d->mu);
        if (done) return NULL;
    }
}

static void *dir_writer(void *arg) {
    direction *d = arg;
    bool failed = false;
    pthread_mutex_lock(&d->mu);
    for (;;) {
        while (!d->head && !d->eof) pthread_cond_wait(&d->cv, &d->mu);
        chunk *c = d->head;
        if (!c) break;
        d->head = c->next;
        if (!d->head) d->tail = NULL;
        pthread_mutex_unlock(&d->mu);
        uint64_t now = kvs_now_ns();
        if (c->due_ns > now) {
            struct timespec ts = {.tv_sec = (time_t)((c->due_ns - now) / 1000000000u),
                                  .tv_nsec = (long)((c->due_ns - now) % 1000000000u)};
            while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
            }
        }
        if (!failed && netio_write_full(d->to, c->data, c->len, NETIO_NO_DEADLINE) != KVS_OK) failed = true;
        if (!failed) g_bytes[d->dir] += c->len;
        free(c);
        pthread_mutex_lock(&d->mu);
    }
    pthread_mutex_unlock(&d->mu);
    shutdown(d->to, SHUT_WR);
    return NULL;
}

typedef struct {
    int client;
    char host[NETIO_HOST_MAX];
    uint16_t port;
    uint64_t delay_ns;
} conn_args;

static void *conn_main(void *arg) {
    conn_args *a = arg;
    int up = -1;
    char msg[KVS_MSG_MAX];
    if (netio_connect(a->host, a->port, netio_deadline_ms(10000), &up, msg, sizeof msg) != KVS_OK) {
        fprintf(stderr, "kvshard delay-proxy: %s\n", msg);
        close(a->client);
        free(a);
        return NULL;
    }
    direction d[2] = {{.from = a->client, .to = up, .dir = 0, .delay_ns = a->delay_ns},
                      {.from = up, .to = a->client, .dir = 1, .delay_ns = a->delay_ns}};
    pthread_t th[4];
    for (int i = 0; i < 2; i++) {
        pthread_mutex_init(&d[i].mu, NULL);
        pthread_cond_init(&d[i].cv, NULL);
        pthread_create(&th[2 * i], NULL, dir_reader, &d[i]);
        pthread_create(&th[2 * i + 1], NULL, dir_writer, &d[i]);
    }
    for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 2; i++) {
        pthread_mutex_destroy(&d[i].mu);
        pthread_cond_destroy(&d[i].cv);
    }
    close(up);
    close(a->client);
    free(a);
    return NULL;
}

static void *stats_main(void *arg) {
    sigset_t *set = arg;
    for (;;) {
        int sig = 0;
        if (sigwait(set, &sig) != 0) continue;
        fprintf(stderr, "kvshard delay-proxy: bytes to_target=%llu to_client=%llu\n",
                (unsigned long long)g_bytes[0], (unsigned long long)g_bytes[1]);
        fflush(stderr);
    }
    return NULL;
}

int cmd_delay_proxy(int argc, char **argv) {
    const char *listen = "127.0.0.1:0", *to = NULL;
    double delay_ms = 0;
    for (int i = 1; i < argc; i++) {
        bool ok = true;
        if (!strcmp(argv[i], "--listen")) ok = args_str(argc, argv, &i, &listen);
        else if (!strcmp(argv[i], "--to")) ok = args_str(argc, argv, &i, &to);
        else if (!strcmp(argv[i], "--delay-ms")) ok = args_float(argc, argv, &i, 0, 10000, &delay_ms);
        else {
            fprintf(stderr, "usage: kvshard delay-proxy --to HOST:PORT [--listen HOST:PORT] [--delay-ms D]\n"
                            "  benchmark aid: forwards connections to --to, holding every chunk D ms each way;\n"
                            "  prints 'listening on port P' on stderr\n");
            return !strcmp(argv[i], "-h") || !strcmp(argv[i], "--help") ? 0 : 2;
        }
        if (!ok) return 2;
    }
    char lhost[NETIO_HOST_MAX], thost[NETIO_HOST_MAX], msg[KVS_MSG_MAX];
    uint16_t lport = 0, tport = 0, bound = 0;
    if (!to || netio_parse_hostport(listen, lhost, sizeof lhost, &lport) ||
        netio_parse_hostport(to, thost, sizeof thost, &tport)) {
        fprintf(stderr, "kvshard delay-proxy: --to HOST:PORT is required (and --listen must be HOST:PORT)\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    static sigset_t usr1;
    sigemptyset(&usr1);
    sigaddset(&usr1, SIGUSR1);
    pthread_sigmask(SIG_BLOCK, &usr1, NULL); /* every thread inherits it; stats_main takes it */
    pthread_t st;
    pthread_create(&st, NULL, stats_main, &usr1);
    int lfd = -1;
    if (netio_listen(lhost, lport, 64, &lfd, &bound, msg, sizeof msg) != KVS_OK) {
        fprintf(stderr, "kvshard delay-proxy: %s\n", msg);
        return 1;
    }
    fprintf(stderr, "kvshard delay-proxy: listening on port %u\n", bound);
    fflush(stderr);
    for (;;) {
        int fd = -1;
        if (netio_accept(lfd, NETIO_NO_DEADLINE, &fd, msg, sizeof msg) != KVS_OK) continue;
        conn_args *a = malloc(sizeof *a);
        if (!a) {
            close(fd);
            continue;
        }
        *a = (conn_args){.client = fd, .port = tport, .delay_ns = (uint64_t)(delay_ms * 1e6)};
        snprintf(a->host, sizeof a->host, "%s", thost);
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, conn_main, a) != 0) {
            close(fd);
            free(a);
        }
        pthread_attr_destroy(&attr);
    }
}
