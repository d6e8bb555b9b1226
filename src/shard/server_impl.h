/*
 * server_impl.h — the shard server's private state, shared by its four files.
 *
 * File map:
 *   server.c        lifecycle: parameters, srv_create (TLS, tokens, engine, relay, digest, listen),
 *                   the accept loop of srv_run, shutdown, srv_free, STATS counters
 *   server_conn.c   one connection: its reader thread (TLS handshake, HELLO, frame loop and the
 *                   dispatch of each op), its writer thread and reply queue, buffer admission,
 *                   the reference count
 *   server_sched.c  the scheduler thread: the job list, cancellation, admission, one batched
 *                   forward step after another, the replies of finished jobs
 *   server_ops.c    the op handlers: FORWARD (validation, the job it becomes, its reply, tail
 *                   sampling, the relay push), TRUNCATE / RELEASE, VOCAB, VOCAB_META, STATS
 *
 * DESIGN NOTES
 *
 * Threads. srv_run's caller accepts connections. Each connection has a reader thread
 * (srv_conn_main) and a writer thread (srv_conn_writer). One scheduler thread (srv_sched_main)
 * runs every forward pass. The relay (relay.c) has a thread per next-hop link: at most
 * max_links, to allowed hops only, each ending after an idle time (relay.h design note 5).
 *
 * Locks, and what each guards (take them in this order, never the reverse):
 *   L1 s->mu          the job list (s->jobs, jobs_tail, every job's state, after, n_after_me,
 *                     skip_step), the connection list and n_conns, every srv_conn's n_running and
 *                     last_admit, the counters c_*. Never held across a forward pass, a socket
 *                     write or a kvstate call that could wait (kvstate has its own lock, L2).
 *   L2 kv->lock       inside kvstate.c: the pool and the session table (kv_* calls only).
 *   L3 c->write_lock  one connection's reply queue (out_head/out_tail/out_bytes, writer_stop,
 *                     writer_gone). Taken alone or inside L1; no other lock is taken inside it.
 * Atomics outside the locks: s->buffered and s->rx_capacity (byte accounting), s->stopping,
 * c->refs, c->closed, c->inflight, c->authed, j->cancel.
 *
 * A job (srv_job: a FORWARD, or a TRUNCATE / RELEASE queued behind one) moves
 *
 *      srv_handle_forward / srv_handle_truncate_release (reader, under L1: srv_jobs_append)
 *            |
 *            v
 *       JOB_QUEUED --- sched_admit: kv_begin_tenant OK ---> JOB_RUNNING --- last rows done:
 *            |                                                  |            engine_txn_end (commit)
 *            | cancel flag seen (sched_reap), or                |                 |
 *            | kv_begin refused (sched_admit)                   | cancel flag seen, error:
 *            v                                                  v  engine_txn_end (abort)
 *        (removed from s->jobs) <-------------------------------+-----------------+
 *            |
 *            v
 *       finish_jobs (scheduler, without L1): the reply is queued (srv_conn_send), inflight
 *       drops, the job is freed and its connection reference dropped.
 *
 * A job is on s->jobs from append to removal; only the scheduler removes it, under L1. A
 * request's cancel flag is set under L1 (srv_cancel_jobs), and the scheduler reads it under L1
 * when it takes a step's results, so a CANCEL answered OK always finds its FORWARD answering
 * CANCELLED. TRUNCATE / RELEASE jobs never run a step: they are applied when their turn comes
 * (arrival order per connection and session: `after`).
 *
 * A connection (srv_conn) is: open (accepted, on s->conns) -> HELLO done -> serving ->
 * closing (reader saw EOF, an error or a bad frame: cancels its jobs, sets closed, lets the
 * writer drain what is queued, joins it) -> freed by the last srv_conn_unref.
 * Slots (admit_slot, under L1): connections that have not finished HELLO (authed false) may
 * hold max_conns - max_conns / 4 slots; when a newcomer finds that many, or the table full,
 * the oldest of them is shut down (closed, shutdown(fd)) to admit it, so connections that never
 * authenticate cannot keep an authenticated client out. A full table of authed ones refuses.
 *
 * The reference rule: c->refs counts the reader (1, from accept) + every job whose conn is c +
 * every relay entry (RELAY_LISTEN registration or queued push) that names c. Whoever drops the
 * count to 0 (srv_conn_unref) unlinks c from s->conns, returns its still-queued reply bytes to
 * s->buffered once, and frees it; n_conns drops last, because srv_run's shutdown waits for
 * n_conns == 0 before srv_free.
 *
 * Byte accounting: s->buffered holds every frame being received (srv_conn_admit reserves it,
 * srv_conn_release_rx returns it), every queued reply (srv_conn_send adds, the writer
 * subtracts what it sends, srv_conn_unref what it never sent) and every relay push not yet
 * written (push_forward adds, srv_relay_done subtracts; the push also holds one of its
 * connection's inflight slots). It is 0 when the shard is idle. At the cap, srv_conn_send
 * closes the connection holding the most unread replies (close_hog), not the one that hit it.
 */
#ifndef KVS_SERVER_IMPL_H
#define KVS_SERVER_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <arpa/inet.h>
#include <sodium.h>

#include "engine.h"
#include "log.h"
#include "relay.h"
#include "server.h"
#include "tls.h"
#include "wire.h"

typedef struct srv_conn srv_conn;
typedef struct srv_job srv_job;

enum job_state { JOB_QUEUED, JOB_RUNNING, JOB_DONE };

/* One FORWARD request, or a TRUNCATE / RELEASE queued behind a request of the
 * same connection on the same session (so they take effect in arrival order).
 * Owned by the scheduler's list while queued/running; holds a reference on its
 * connection. */
struct srv_job {
    srv_conn *conn;
    uint16_t op;            /* WIRE_OP_FORWARD, WIRE_OP_TRUNCATE or WIRE_OP_RELEASE */
    uint32_t truncate_len;  /* TRUNCATE: positions to keep */
    uint64_t request_id;
    kv_sid sid;
    uint64_t epoch;
    uint32_t start_pos, n;
    bool inherit;
    kv_inherit inh;
    kv_prefix prefix;       /* v3 chain hashes (prefix.hashes owned; NULL: none) */
    int32_t *tokens;        /* n ids (head shard) */
    float *hidden;          /* n x n_embd (other shards) */
    bool reply_f16;         /* hidden reply in f16 (the request came in f16) */
    bool reply_bf16;        /* hidden reply in bf16 (the request came in bf16) */
    fwd_out_mode out_mode;
    float *out;             /* rows x cols of the reply */
    uint32_t out_rows, out_cols;
    float *scratch;         /* chunk hidden for LOGITS_LAST prefill chunks */
    enum job_state state;
    kv_txn *txn;
    uint32_t done;          /* rows computed */
    atomic_bool cancel;
    int status;
    kv_reply reply;
    srv_job *after;         /* an earlier request of this connection on this session still in the
                               list: this one waits for it (arrival order); NULL: none */
    int n_after_me;         /* requests whose `after` is this one */
    srv_job *next;          /* scheduler list */
    uint64_t skip_step;     /* scheduler round in which it waits for its own tenant's pins */
    /* v2 (docs/protocol.md §4.3): tail sampling and relay */
    bool sample;            /* out_mode SAMPLE: out holds the last row's logits, answer a token */
    struct wire_sample_req sq; /* with sample: settings; sq.window points to window */
    int32_t *window;        /* (sq.n_window) penalty window ids */
    struct wire_relay *relay; /* relayed with next hops: push the hidden rows on (owned) */
    uint32_t wire_out_mode; /* the request's out_mode, carried on to the next hop */
    uint8_t wire_sid[WIRE_SID_SIZE]; /* the session id as the client sent it (sid is its keyed hash) */
};

/* One queued outgoing frame. */
typedef struct srv_out {
    struct srv_out *next;
    uint16_t op;
    uint64_t request_id;
    size_t len;
    uint8_t data[]; /* payload */
} srv_out;

struct srv_conn {
    srv *s;
    int fd;
    unsigned id;
    char peer[64];
    pthread_t thread;
    /* Outgoing frames go through a queue drained by the connection's writer
     * thread, so no other thread (the scheduler above all) ever blocks on a
     * client that does not read; a queue past max_queued_bytes closes it. */
    pthread_t writer;
    pthread_mutex_t write_lock; /* guards the queue fields below */
    pthread_cond_t write_cv;
    srv_out *out_head, *out_tail;
    size_t out_bytes;
    bool writer_stop;
    bool writer_gone;           /* the writer has exited: conn_send drops frames */
    atomic_int refs;        /* reader + jobs */
    atomic_bool closed;
    bool bulk;              /* an allowed peer pushing sessions: its receive buffer is kept from
                               one push to the next (reader thread only) */
    uint16_t version;       /* message-set version chosen at HELLO */
    srv_conn *next;         /* server's list */
    unsigned long requests;
    char addr[INET6_ADDRSTRLEN]; /* peer IP address (per-address limit) */
    char identity[TLS_ID_MAX];   /* authenticated peer identity; sessions are keyed by it */
    atomic_int inflight;         /* FORWARD jobs queued or running */
    atomic_bool authed;          /* TLS handshake and HELLO done and accepted */
    size_t rx_held;              /* bytes of s->buffered held by the frame being handled */
    size_t rx_cap;               /* bytes of the receive buffer, as counted in s->rx_capacity */
    int n_running;               /* admitted (pinned) requests of this connection; guarded by s->mu */
    uint64_t tenant;             /* the hot state's tenant tag: a keyed hash of identity */
    uint64_t last_admit;         /* scheduler round of its last admitted request; guarded by s->mu */
};

struct srv {
    srv_params p;
    engine *e;
    uint8_t digest[32];
    int listen_fd;
    uint16_t port;
    char name[WIRE_MAX_NAME + 1];
    int stop_pipe[2];
    atomic_bool stopping;
    atomic_bool draining;   /* srv_stop with drain_ms or state_dir: no new connection or work (FORWARD
                               answered CLOSED; with state_dir a request closes its connection, and
                               the client reconnects once the shard is back) */
    relay *relay;           /* shard-to-shard pushes and the RELAY_LISTEN table */
    /* scheduler */
    pthread_t sched_thread;
    pthread_mutex_t mu;     /* guards jobs, conns, counters below */
    pthread_cond_t cv;
    srv_job *jobs, *jobs_tail;
    srv_conn *conns;
    int n_conns;
    unsigned next_conn_id;
    tls_ctx *tls;           /* NULL: plaintext */
    tls_ctx *relay_tls;     /* client side of the same certificate, for relay links; NULL: plaintext */
    uint8_t sid_key[crypto_generichash_KEYBYTES]; /* random per process: session key derivation */
    uint8_t (*tokens)[crypto_generichash_BYTES];  /* (n_tokens) hashes of the accepted auth tokens */
    int n_tokens;
    atomic_ullong buffered; /* receive-buffer and reply-queue bytes over all connections */
    atomic_ullong rx_capacity; /* bytes allocated for receive buffers over all connections */
    atomic_bool stop_requested; /* srv_stop: the accept loop ends (then draining, then stopping) */
    struct srv_move *move;  /* server_move.c: drains, pushes, the moved table */
    /* counters */
    uint64_t c_auth_failures, c_busy_inflight, c_refused_addr, c_frame_timeouts, c_refused_buffers;
    uint64_t c_conns_total, c_requests, c_forward_rows, c_batches, c_batch_items, c_protocol_errors,
        c_rejected_conns;
    uint64_t c_snap_written_sessions, c_snap_written_bytes, c_snap_loaded_sessions, c_snap_loaded_bytes,
        c_snap_refused;
    uint64_t c_moved_in_sessions, c_moved_in_bytes, c_moved_out_sessions, c_moved_out_bytes, c_push_refused;
};

/* server_state.c (serve --state-dir) */
int srv_state_open(srv *s, char *msg, size_t cap); /* the directory and the persistent sid key */
void srv_state_load(srv *s);                       /* loads (and consumes) kv.snap, or refuses it */
int srv_state_save(srv *s);                        /* writes kv.snap crash-safely */
void srv_state_quiesce(srv *s); /* stops admitting, waits (bounded) for the jobs in flight */

/* server_move.c (SESSION_PUSH, DRAIN, MOVED) */
struct netio_buf;
int srv_move_create(srv *s);
void srv_move_free(srv *s);
void srv_move_note_owner(srv *s, const srv_job *j); /* at admission: who the session belongs to */
bool srv_move_peer_allowed(const srv_conn *c); /* its identity or address is in --peer-allow */
/* Answers a FORWARD / TRUNCATE / RELEASE itself while the shard moves its sessions or for a
 * session it moved (BUSY, MOVED); true when it did. */
bool srv_move_gate(srv_conn *c, const struct wire_header *h, const struct netio_buf *buf);
/* True while the shard takes no new sessions: a SIGTERM drain, a DRAIN moving its sessions, or
 * one that moved them and lingers until it stops. */
bool srv_draining(srv *s);
void srv_handle_session_push(srv_conn *c, uint64_t rid, const uint8_t *payload, size_t len);
void srv_handle_drain(srv_conn *c, uint64_t rid, const uint8_t *payload, size_t len);

/* server_conn.c */
void *srv_conn_main(void *arg);   /* a connection's reader thread */
void *srv_conn_writer(void *arg); /* a connection's writer thread */
void srv_conn_ref(void *c);       /* one more reference (relay_listen_take's callback) */
void srv_conn_unref(srv_conn *c);
void srv_conn_send(srv_conn *c, uint16_t op, uint64_t rid, const uint8_t *payload, size_t len);
void srv_send_status(srv_conn *c, uint64_t rid, int status, const kv_reply *r, const char *text);
void srv_conn_sid(const srv_conn *c, const uint8_t raw[WIRE_SID_SIZE], kv_sid *out);
void srv_count_protocol_error(srv *s);

/* server_sched.c */
void *srv_sched_main(void *arg);
bool srv_same_sid(const kv_sid *a, const kv_sid *b);
void srv_jobs_append(srv *s, srv_job *j);
int srv_cancel_jobs(srv_conn *c, bool all, uint64_t rid);

/* server_ops.c */
void srv_job_free(srv_job *j);
void srv_relay_done(void *ctx, void *target, uint64_t rid, uint16_t hop, const char *addr, size_t len, int status,
                    const char *why);
void srv_send_forward_reply(srv_job *j);
int srv_handle_forward(srv_conn *c, uint64_t rid, const uint8_t *payload, size_t len);
void srv_handle_stats(srv_conn *c, uint64_t rid);
void srv_handle_vocab(srv_conn *c, uint64_t rid, const struct wire_vocab *q);
void srv_handle_vocab_meta(srv_conn *c, uint64_t rid, const struct wire_vocab_meta *q);
void srv_handle_truncate_release(srv_conn *c, const struct wire_header *h, const uint8_t *payload, size_t len);

#endif /* KVS_SERVER_IMPL_H */
