/*
 * shard_harness — an in-process shard server for the wire-level tests (test_server, test_tls,
 * test_security_net, test_server_pressure): the server on its own thread with a before_batch
 * gate the test can close (ordering by a hook, not by sleeps), a quiet log, and the FORWARD a
 * raw client sends.
 */
#ifndef KVS_SHARD_HARNESS_H
#define KVS_SHARD_HARNESS_H

#include <errno.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <time.h>

#include "netio.h"
#include "server.h"
#include "test.h"
#include "wire.h"

typedef struct {
    srv *s;
    pthread_t th;      /* runs srv_run */
    sem_t gate;        /* the before_batch hook waits here while gated */
    atomic_bool gated; /* true: every step waits for one sem_post of gate */
    atomic_int held;   /* steps that have reached the closed gate (their requests picked) */
} test_shard;

static inline void test_shard_hook(void *ctx, int n) {
    (void)n;
    test_shard *sh = ctx;
    if (atomic_load(&sh->gated)) {
        atomic_fetch_add(&sh->held, 1);
        while (sem_wait(&sh->gate) != 0 && errno == EINTR) {
        }
    }
}

/* Waits (bounded: 60 s) until n steps in all have reached the closed gate; false on timeout.
 * A step reaches the hook after its requests are picked, so at that point they are in it. */
static inline bool test_shard_wait_held(test_shard *sh, int n) {
    for (int i = 0; i < 60000 && atomic_load(&sh->held) < n; i++) {
        struct timespec ts = {0, 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return atomic_load(&sh->held) >= n;
}

static inline void *test_shard_main(void *p) {
    srv_run(((test_shard *)p)->s);
    return NULL;
}

/* The server log, printed only under KVS_TEST_VERBOSE. */
static inline void test_quiet_log(void *ctx, const char *line) {
    (void)ctx;
    if (getenv("KVS_TEST_VERBOSE")) fprintf(stderr, "serve: %s\n", line);
}

/* Creates the server of p (its before_batch hook replaced by the gate, open) and runs it on a
 * thread. KVS_OK, or srv_create's error (printed; nothing left to stop). */
static inline int test_shard_start(test_shard *sh, srv_params p) {
    sem_init(&sh->gate, 0, 0);
    atomic_init(&sh->gated, false);
    atomic_init(&sh->held, 0);
    p.before_batch = test_shard_hook;
    p.hook_ctx = sh;
    char msg[KVS_MSG_MAX] = "";
    int rc = srv_create(&p, &sh->s, msg, sizeof msg);
    if (rc) {
        fprintf(stderr, "srv_create: %s\n", msg);
        sem_destroy(&sh->gate);
        return rc;
    }
    pthread_create(&sh->th, NULL, test_shard_main, sh);
    return KVS_OK;
}

/* Opens the gate (so a held step can finish), stops the server and frees it. */
static inline void test_shard_stop(test_shard *sh) {
    atomic_store(&sh->gated, false);
    for (int i = 0; i < 64; i++) sem_post(&sh->gate);
    srv_stop(sh->s);
    pthread_join(sh->th, NULL);
    srv_free(sh->s);
    sem_destroy(&sh->gate);
}

/* Sends FORWARD(session sid, epoch, tokens toks[0..n) from start, out_mode) as request rid
 * (5 s bound). KVS_OK or the send's error. */
static inline int send_forward_frame(int fd, uint64_t rid, const uint8_t sid[16], uint64_t epoch, uint32_t start,
                                     uint32_t n, const int32_t *toks, uint32_t out_mode) {
    struct wire_forward f = {.epoch = epoch, .start_pos = start, .n_tokens = n, .out_mode = out_mode,
                             .in_kind = WIRE_IN_TOKENS, .data = toks};
    memcpy(f.session_id, sid, 16);
    size_t len = 0;
    wire_encode_forward(&f, NULL, 0, &len);
    uint8_t *buf = malloc(len);
    wire_encode_forward(&f, buf, len, &len);
    int err = netio_send_frame(fd, WIRE_OP_FORWARD, rid, buf, len, netio_deadline_ms(5000));
    free(buf);
    return err;
}

#endif /* KVS_SHARD_HARNESS_H */
