/*
 * The relay's links under attack (issue 42 items 1 and 2), on relay.c alone: next hops the
 * operator did not allow are never connected, address aliases share one link, the number of
 * links and their idle time are bounded, the push queue is bounded, and a hop that is down
 * fails what is pushed to it at once. Next hops are loopback sockets of this process (one that
 * never accepts stands for a shard that never answers); every wait is bounded.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/socket.h>

#include "relay.h"
#include "test.h"
#include "util.h"

#define MAX_DONE 64

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static int g_n_done;
static int g_status[MAX_DONE]; /* by request id */

static void on_done(void *ctx, void *target, uint64_t rid, uint16_t hop, const char *addr, size_t len, int status,
                    const char *why) {
    (void)ctx, (void)target, (void)hop, (void)addr, (void)len, (void)why;
    pthread_mutex_lock(&g_mu);
    if (rid < MAX_DONE) g_status[rid] = status;
    g_n_done++;
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
}

static int n_done(void) {
    pthread_mutex_lock(&g_mu);
    int n = g_n_done;
    pthread_mutex_unlock(&g_mu);
    return n;
}

/* Waits (10 s at most) until n pushes have ended; the count reached. */
static int wait_done(int n) {
    uint64_t until = kvs_now_ns() + 10000000000ull;
    pthread_mutex_lock(&g_mu);
    while (g_n_done < n && kvs_now_ns() < until) {
        pthread_mutex_unlock(&g_mu);
        usleep(1000);
        pthread_mutex_lock(&g_mu);
    }
    int got = g_n_done;
    pthread_mutex_unlock(&g_mu);
    return got;
}

static void reset_done(void) {
    pthread_mutex_lock(&g_mu);
    g_n_done = 0;
    for (int i = 0; i < MAX_DONE; i++) g_status[i] = 1;
    pthread_mutex_unlock(&g_mu);
}

static int status_of(int rid) {
    pthread_mutex_lock(&g_mu);
    int s = g_status[rid];
    pthread_mutex_unlock(&g_mu);
    return s;
}

/* A loopback listening socket that never accepts (connects still complete in its backlog);
 * its port in *port, the fd or -1. */
static int listener(uint16_t *port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) || listen(fd, 64) ||
        getsockname(fd, (struct sockaddr *)&a, &al)) {
        if (fd >= 0) close(fd);
        return -1;
    }
    *port = ntohs(a.sin_port);
    return fd;
}

/* A loopback port with nothing listening (connects are refused at once). */
static uint16_t closed_port(void) {
    uint16_t p = 0;
    int fd = listener(&p);
    if (fd >= 0) close(fd);
    return p;
}

/* Connections waiting in fd's backlog (accepted and closed here). */
static int count_accepts(int fd) {
    int n = 0;
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    for (int i = 0; i < 64; i++) {
        int c = accept(fd, NULL, NULL);
        if (c < 0) break;
        close(c);
        n++;
    }
    return n;
}

static relay *make(relay_params p) {
    p.done = on_done;
    relay *r = NULL;
    CHECK_EQ_INT(relay_create(&p, &r), KVS_OK);
    return r;
}

static void push(relay *r, const char *addr, size_t len, uint64_t rid) {
    uint8_t *payload = calloc(1, len ? len : 1);
    relay_push(r, addr, 1, payload, len, rid, NULL);
}

static relay_stats stats(relay *r) {
    relay_stats st;
    relay_get_stats(r, &st);
    return st;
}

static void check_canon(void) {
    char c[RELAY_ADDR_MAX];
    CHECK_EQ_INT(relay_canon_addr("127.0.0.1:0080", c), KVS_OK);
    CHECK(!strcmp(c, "127.0.0.1:80"));
    CHECK_EQ_INT(relay_canon_addr("[0:0::1]:0443", c), KVS_OK);
    CHECK(!strcmp(c, "[::1]:443"));
    CHECK_EQ_INT(relay_canon_addr("localhost:80", c), KVS_ERR_INVALID_ARG); /* no name resolution */
    CHECK_EQ_INT(relay_canon_addr("127.1:80", c), KVS_ERR_INVALID_ARG);
    CHECK_EQ_INT(relay_canon_addr("127.0.0.1:0", c), KVS_ERR_INVALID_ARG);
    relay_params p = relay_default_params();
    p.done = on_done;
    p.allow = "127.0.0.1:80,example.com:80";
    relay *r = (relay *)1;
    CHECK_EQ_INT(relay_create(&p, &r), KVS_ERR_INVALID_ARG);
    CHECK(r == NULL);
}

/* Item 1: a hop nobody allowed is refused without a connection; the allow list is canonical. */
static void check_allow(void) {
    uint16_t port = 0, other = 0;
    int lfd = listener(&port), ofd = listener(&other);
    CHECK(lfd >= 0 && ofd >= 0);
    char addr[64], alias[64], addr_other[64], allow[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%u", port);
    snprintf(alias, sizeof alias, "127.0.0.1:00%u", port);
    snprintf(addr_other, sizeof addr_other, "127.0.0.1:%u", other);
    reset_done();
    relay_params p = relay_default_params(); /* no list, no loopback: nothing is allowed */
    p.timeout_ms = 200;
    relay *r = make(p);
    push(r, addr, 16, 1);
    CHECK_EQ_INT(n_done(), 1); /* refused inside relay_push */
    CHECK_EQ_INT(status_of(1), KVS_ERR_INVALID_ARG);
    CHECK_EQ_INT(stats(r).links, 0);
    relay_destroy(r);
    CHECK_EQ_INT(count_accepts(lfd), 0);

    reset_done();
    snprintf(allow, sizeof allow, "127.0.0.1:%u", port);
    p.allow = allow;
    r = make(p);
    CHECK(relay_allowed(r, alias));
    CHECK(!relay_allowed(r, addr_other));
    push(r, addr_other, 16, 2);
    CHECK_EQ_INT(n_done(), 1);
    CHECK_EQ_INT(status_of(2), KVS_ERR_INVALID_ARG);
    relay_destroy(r);
    CHECK_EQ_INT(count_accepts(ofd), 0);
    close(lfd);
    close(ofd);
}

/* Item 1: aliases are one link; the link count is bounded; idle links close. */
static void check_links(void) {
    reset_done();
    relay_params p = relay_default_params();
    p.allow_loopback = true;
    p.max_links = 3;
    p.retry_ms = 0;
    p.idle_ms = 60000;
    relay *r = make(p);
    uint16_t cp = closed_port();
    char a[64], b[64];
    snprintf(a, sizeof a, "127.0.0.1:%u", cp);
    snprintf(b, sizeof b, "127.0.0.1:0%u", cp);
    push(r, a, 16, 1);
    push(r, b, 16, 2);
    CHECK_EQ_INT(wait_done(2), 2);
    CHECK_EQ_INT(stats(r).links, 1);
    int busy = 0;
    for (int i = 0; i < 6; i++) {
        snprintf(a, sizeof a, "127.0.0.%d:%u", 2 + i, cp);
        push(r, a, 16, (uint64_t)(3 + i));
    }
    CHECK_EQ_INT(wait_done(8), 8);
    for (int i = 0; i < 6; i++) busy += status_of(3 + i) == KVS_ERR_BUSY;
    CHECK_EQ_INT(busy, 4); /* one link was open: two more fit */
    CHECK_EQ_INT(stats(r).links, 3);
    relay_destroy(r);

    reset_done();
    p.idle_ms = 50;
    r = make(p);
    snprintf(a, sizeof a, "127.0.0.1:%u", cp);
    push(r, a, 16, 1);
    CHECK_EQ_INT(wait_done(1), 1);
    uint64_t until = kvs_now_ns() + 10000000000ull;
    while (stats(r).links > 0 && kvs_now_ns() < until) usleep(1000);
    CHECK_EQ_INT(stats(r).links, 0);
    relay_destroy(r);
}

/* Item 2: the queue is bounded, and a hop that is down fails pushes at once. */
static void check_queue(void) {
    uint16_t port = 0;
    int lfd = listener(&port); /* connects complete, HELLO is never answered */
    CHECK(lfd >= 0);
    char a[64];
    snprintf(a, sizeof a, "127.0.0.1:%u", port);
    reset_done();
    relay_params p = relay_default_params();
    p.allow_loopback = true;
    p.timeout_ms = 2000; /* far longer than the checks made before it ends */
    p.retry_ms = 600000;
    p.max_queued_bytes = 1000;
    relay *r = make(p);
    push(r, a, 600, 1);
    CHECK_EQ_INT(stats(r).queued_bytes, 600);
    push(r, a, 600, 2);
    CHECK_EQ_INT(n_done(), 1); /* refused inside relay_push, not after the first one's timeout */
    CHECK_EQ_INT(status_of(2), KVS_ERR_BUSY);
    CHECK_EQ_INT(wait_done(2), 2);
    CHECK(status_of(1) != KVS_OK);
    push(r, a, 600, 3);
    CHECK_EQ_INT(n_done(), 3); /* the hop is down: failed at once */
    CHECK_EQ_INT(status_of(3), KVS_ERR_CLOSED);
    CHECK_EQ_INT(stats(r).queued_bytes, 0);
    relay_destroy(r);
    close(lfd);
}

int main(void) {
    reset_done();
    check_canon();
    check_allow();
    check_links();
    check_queue();
    return test_finish("test_relay_links", 4, 0);
}
