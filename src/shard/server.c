#include "server.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sodium.h>
#include <sys/socket.h>
#include <unistd.h>

#include "digest.h"
#include "engine.h"
#include "netio.h"
#include "quant.h"
#include "relay.h"
#include "sampler.h"
#include "tls.h"
#include "util.h"
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
    uint16_t version;       /* message-set version chosen at HELLO */
    srv_conn *next;         /* server's list */
    unsigned long requests;
    char addr[INET6_ADDRSTRLEN]; /* peer IP address (per-address limit) */
    char identity[TLS_ID_MAX];   /* authenticated peer identity; sessions are keyed by it */
    atomic_int inflight;         /* FORWARD jobs queued or running */
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
    /* counters */
    uint64_t c_auth_failures, c_busy_inflight, c_refused_addr, c_frame_timeouts, c_refused_buffers;
    uint64_t c_conns_total, c_requests, c_forward_rows, c_batches, c_batch_items, c_protocol_errors,
        c_rejected_conns;
};

static void srv_logf(srv *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void srv_logf(srv *s, const char *fmt, ...) {
    if (!s->p.log) return;
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    s->p.log(s->p.log_ctx, line);
}

srv_params srv_default_params(void) {
    srv_params p = {0};
    p.listen = "127.0.0.1:7000";
    p.kv_budget_bytes = 256ull << 20;
    p.max_tokens = 512;
    p.prefill_chunk = 64;
    p.max_batch = 32;
    p.max_conns = 64;
    p.hello_timeout_ms = 10000;
    p.idle_timeout_ms = 600000;
    p.kv_type = QUANT_F16;
    p.max_queued_bytes = 256ull << 20;
    p.frame_timeout_ms = 10000;
    p.max_conns_per_addr = 16;
    p.max_inflight = 32;
    p.max_buffered_bytes = 512ull << 20;
    p.tenant_kv_share = 1.0;
    return p;
}

/* ---- helpers -------------------------------------------------------------- */

static void conn_unref(srv_conn *c);

static void out_free_all(srv_out *o) {
    while (o) {
        srv_out *next = o->next;
        free(o);
        o = next;
    }
}

/* Queues one frame for c's writer thread (the payload is copied). Never
 * blocks on the peer. A closed connection drops it; a queue over the limit
 * closes the connection (its reader sees the shutdown). */
static void conn_send(srv_conn *c, uint16_t op, uint64_t rid, const uint8_t *payload, size_t len) {
    if (atomic_load(&c->closed)) return;
    srv_out *o = malloc(sizeof(*o) + len);
    if (!o) return;
    o->next = NULL;
    o->op = op;
    o->request_id = rid;
    o->len = len;
    if (len) memcpy(o->data, payload, len);
    pthread_mutex_lock(&c->write_lock);
    if (c->writer_gone) { /* nothing would ever send it */
        pthread_mutex_unlock(&c->write_lock);
        free(o);
        return;
    }
    bool over = c->out_bytes + len > c->s->p.max_queued_bytes ||
                atomic_load(&c->s->buffered) + len > c->s->p.max_buffered_bytes;
    size_t queued = c->out_bytes;
    if (!over) {
        atomic_fetch_add(&c->s->buffered, len);
        if (c->out_tail) c->out_tail->next = o;
        else c->out_head = o;
        c->out_tail = o;
        c->out_bytes += len;
        pthread_cond_signal(&c->write_cv);
    }
    pthread_mutex_unlock(&c->write_lock);
    if (over) {
        free(o);
        srv_logf(c->s, "conn %u (%s): not reading its replies (%zu bytes queued), closing", c->id, c->peer, queued);
        atomic_store(&c->closed, true);
        shutdown(c->fd, SHUT_RDWR);
    }
}

/* Writer thread: sends queued frames in order until told to stop and the
 * queue is empty. After a send error it discards what is left. */
static void *conn_writer(void *arg) {
    srv_conn *c = arg;
    bool failed = false;
    pthread_mutex_lock(&c->write_lock);
    for (;;) {
        while (!c->out_head && !c->writer_stop) pthread_cond_wait(&c->write_cv, &c->write_lock);
        srv_out *o = c->out_head;
        if (!o) break; /* stopped and drained */
        c->out_head = o->next;
        if (!c->out_head) c->out_tail = NULL;
        c->out_bytes -= o->len;
        atomic_fetch_sub(&c->s->buffered, o->len);
        pthread_mutex_unlock(&c->write_lock);
        if (!failed &&
            netio_send_frame(c->fd, o->op, o->request_id, o->data, o->len, netio_deadline_ms(c->s->p.idle_timeout_ms))) {
            failed = true;
            atomic_store(&c->closed, true);
            shutdown(c->fd, SHUT_RDWR);
        }
        free(o);
        pthread_mutex_lock(&c->write_lock);
    }
    c->writer_gone = true; /* conn_send queues nothing more */
    pthread_mutex_unlock(&c->write_lock);
    return NULL;
}

static void send_status(srv_conn *c, uint64_t rid, int status, const kv_reply *r, const char *text) {
    struct wire_status_reply m;
    memset(&m, 0, sizeof(m));
    m.st.status = status;
    if (r) {
        m.st.have = r->have;
        m.st.live_epoch = r->live_epoch;
        m.st.n_past = r->n_past;
    }
    if (text) {
        size_t l = strlen(text);
        if (l > WIRE_MAX_MSG) l = WIRE_MAX_MSG;
        for (size_t i = 0; i < l; i++) m.msg[i] = text[i] ? text[i] : ' ';
        m.msg_len = (uint16_t)l;
    }
    uint8_t buf[512];
    size_t len = 0;
    if (wire_encode_status_reply(&m, buf, sizeof(buf), &len) == KVS_OK) conn_send(c, WIRE_OP_STATUS, rid, buf, len);
}

/* ---- FORWARD replies -------------------------------------------------------- */

static void job_free(srv_job *j) {
    if (!j) return;
    free(j->window);
    free(j->relay);
    free(j->tokens);
    free(j->hidden);
    free(j->out);
    free(j->scratch);
    free(j);
}

static void conn_ref_void(void *c) { atomic_fetch_add(&((srv_conn *)c)->refs, 1); }

/* relay_params.done: a push failed -> tell the client which hop and why; drop the ref. */
static void relay_done(void *ctx, void *target, uint64_t rid, uint16_t hop, const char *addr, int status,
                       const char *why) {
    (void)ctx;
    srv_conn *c = target;
    if (status != KVS_OK) {
        char text[KVS_MSG_MAX];
        snprintf(text, sizeof(text), "relay: hop %u (%s): %s", (unsigned)hop, addr, why);
        send_status(c, rid, status, NULL, text);
    }
    conn_unref(c);
}

/* A relayed job with next hops: its hidden rows go on to next[0] instead of back. */
static void push_forward(srv_job *j) {
    srv *s = j->conn->s;
    uint8_t *payload = NULL;
    size_t len = 0;
    struct wire_sample_req sq = j->sq;
    sq.window = j->window;
    int err = relay_build_next(j->relay, j->wire_sid, j->epoch, j->start_pos, j->n, j->wire_out_mode, &sq, j->out,
                               j->out_cols, &payload, &len);
    if (err) {
        send_status(j->conn, j->request_id, err, &j->reply, "relay: cannot encode the next hop's FORWARD");
        return;
    }
    conn_ref_void(j->conn);
    relay_push(s->relay, j->relay->next[0].addr, (uint16_t)(j->relay->hop + 1), payload, len, j->request_id, j->conn);
}

/* SAMPLE: the token after the last row, from its logits in j->out (sampler.c design note 7). */
static int sample_reply(srv_job *j, uint8_t out[8 + 8 * WIRE_MAX_TOP], struct wire_forward_reply *m) {
    sampler_params sp = {.temp = j->sq.temp, .top_k = (int)j->sq.top_k, .top_p = j->sq.top_p, .seed = j->sq.seed,
                         .min_p = j->sq.min_p, .repeat_penalty = j->sq.repeat_penalty,
                         .presence_penalty = j->sq.presence_penalty};
    sampler *smp = sampler_create(sp);
    if (!smp) return KVS_ERR_NOMEM;
    sampler_result r;
    int err = sampler_pick(smp, j->out, (int32_t)j->out_cols, j->start_pos + j->n, j->window, j->sq.n_window, &r,
                           j->sq.n_top);
    sampler_free(smp);
    if (err) return err;
    kvs_wr_u32(out, (uint32_t)r.id);
    kvs_wr_f32(out + 4, r.logprob);
    for (uint32_t i = 0; i < r.n_top; i++) {
        kvs_wr_u32(out + 8 + 8 * i, (uint32_t)r.top[i].id);
        kvs_wr_f32(out + 12 + 8 * i, r.top[i].logprob);
    }
    m->out_kind = WIRE_OUTK_SAMPLE;
    m->n_rows = 1;
    m->n_cols = r.n_top;
    m->data = out;
    return KVS_OK;
}

static void send_forward_reply(srv_job *j) {
    if (j->status == KVS_OK && j->relay) {
        push_forward(j);
        return;
    }
    uint8_t sampled[8 + 8 * WIRE_MAX_TOP];
    struct wire_forward_reply m;
    memset(&m, 0, sizeof(m));
    m.st.status = j->status;
    m.st.have = j->reply.have;
    m.st.live_epoch = j->reply.live_epoch;
    m.st.n_past = j->reply.n_past;
    m.out_kind = WIRE_OUTK_NONE;
    void *f16 = NULL;
    if (j->status == KVS_OK && j->sample) {
        int err = sample_reply(j, sampled, &m);
        if (err) {
            m.st.status = err;
            m.out_kind = WIRE_OUTK_NONE;
        }
    } else if (j->status == KVS_OK) {
        m.n_rows = j->out_rows;
        m.n_cols = j->out_cols;
        if (j->out_mode == FWD_OUT_HIDDEN && (j->reply_f16 || j->reply_bf16)) {
            size_t n = (size_t)j->out_rows * j->out_cols;
            f16 = malloc(n * sizeof(uint16_t));
            if (!f16) {
                m.st.status = KVS_ERR_NOMEM;
                m.n_rows = m.n_cols = 0;
            } else if (j->reply_f16) {
                quant_f32_to_f16_row(j->out, f16, (int64_t)n);
                m.out_kind = WIRE_OUTK_HIDDEN_F16;
                m.data = f16;
            } else {
                uint16_t *h = f16;
                for (size_t i = 0; i < n; i++) h[i] = wire_f32_to_bf16(j->out[i]);
                m.out_kind = WIRE_OUTK_HIDDEN_BF16;
                m.data = f16;
            }
        } else {
            m.out_kind = j->out_mode == FWD_OUT_HIDDEN ? WIRE_OUTK_HIDDEN_F32 : WIRE_OUTK_LOGITS_F32;
            m.data = j->out;
        }
    }
    size_t len = 0;
    uint8_t *buf = NULL;
    int err = wire_encode_forward_reply(&m, NULL, 0, &len);
    if (!err) {
        buf = malloc(len);
        err = buf ? wire_encode_forward_reply(&m, buf, len, &len) : KVS_ERR_NOMEM;
    }
    if (err) {
        /* Could not encode the result (memory, size): answer with the bare status. */
        memset(&m, 0, sizeof(m));
        m.st.status = err;
        m.st.n_past = j->reply.n_past;
        uint8_t small[64];
        if (wire_encode_forward_reply(&m, small, sizeof(small), &len) == KVS_OK)
            conn_send(j->conn, WIRE_OP_FORWARD_REPLY, j->request_id, small, len);
    } else {
        conn_send(j->conn, WIRE_OP_FORWARD_REPLY, j->request_id, buf, len);
    }
    free(buf);
    free(f16);
}

/* ---- scheduler -------------------------------------------------------------- */

static bool same_sid(const kv_sid *a, const kv_sid *b) { return memcmp(a->bytes, b->bytes, sizeof(a->bytes)) == 0; }

/* Appends j to the scheduler list (s->mu held), ordered after the latest earlier request of its
 * connection on its session. */
static void jobs_append(srv *s, srv_job *j) {
    j->after = NULL;
    for (srv_job *e = s->jobs; e; e = e->next)
        if (e->conn == j->conn && same_sid(&e->sid, &j->sid)) j->after = e;
    if (j->after) j->after->n_after_me++;
    if (s->jobs_tail) s->jobs_tail->next = j;
    else s->jobs = j;
    s->jobs_tail = j;
}

static void jobs_remove(srv *s, srv_job *j) {
    srv_job **pp = &s->jobs, *prev = NULL;
    while (*pp && *pp != j) {
        prev = *pp;
        pp = &(*pp)->next;
    }
    if (!*pp) return;
    *pp = j->next;
    if (s->jobs_tail == j) s->jobs_tail = prev;
    j->next = NULL;
    /* Requests ordered after j now wait for what j waited for (j may go early: cancelled). */
    if (j->after) j->after->n_after_me--;
    for (srv_job *x = s->jobs; x && j->n_after_me > 0; x = x->next)
        if (x->after == j) {
            x->after = j->after;
            if (x->after) x->after->n_after_me++;
            j->n_after_me--;
        }
    j->after = NULL;
}

/* Finishes the jobs on `done` (reply, release the connection reference). Called without s->mu. */
static void finish_jobs(srv_job *done) {
    while (done) {
        srv_job *next = done->next;
        srv_conn *c = done->conn;
        if (done->op == WIRE_OP_FORWARD) send_forward_reply(done);
        else send_status(c, done->request_id, done->status, &done->reply, NULL);
        atomic_fetch_sub(&c->inflight, 1);
        job_free(done);
        conn_unref(c);
        done = next;
    }
}


/* Cuts the rows of this step's items (batch[i] is item i's request): a decode step (1 row
 * left) runs whole; the prefills share `chunk` rows fairly — each gets chunk / n_prefills (at
 * least one), and what a short one leaves goes to the others in arrival order. So every
 * admitted request makes progress every step and a long prompt never holds back a short one. */
static void share_prefill_rows(fwd_item *items, srv_job *const *batch, int n_items, uint32_t chunk) {
    uint32_t n_prefill = 0, used = 0;
    for (int i = 0; i < n_items; i++) n_prefill += batch[i]->n - batch[i]->done > 1;
    if (n_prefill == 0) return;
    uint32_t share = chunk / n_prefill ? chunk / n_prefill : 1;
    for (int i = 0; i < n_items; i++) {
        uint32_t left = batch[i]->n - batch[i]->done;
        items[i].n = left > 1 && left > share ? share : left;
        if (left > 1) used += items[i].n;
    }
    for (int i = 0; i < n_items && used < chunk; i++) {
        uint32_t left = batch[i]->n - batch[i]->done;
        if (left <= 1 || items[i].n >= left) continue;
        uint32_t extra = left - items[i].n;
        if (extra > chunk - used) extra = chunk - used;
        items[i].n += extra;
        used += extra;
    }
}

/* A CANCELLED reply reports the session as the cancel left it: its live epoch and positions,
 * or 0 and 0 when there is none (a request that would have created it leaves nothing). */
static void cancelled_reply(kv_state *kv, srv_job *j) {
    j->reply.n_past = 0;
    j->reply.live_epoch = 0;
    j->reply.have = 0;
    kv_lookup(kv, &j->sid, &j->reply.live_epoch, &j->reply.n_past);
    j->status = KVS_ERR_CANCELLED;
}

static void *sched_main(void *arg) {
    srv *s = arg;
    engine *e = s->e;
    const model *m = e->m;
    size_t d = m->hp.n_embd;
    int max_batch = s->p.max_batch > 0 ? s->p.max_batch : 1;
    int per_conn = max_batch > 1 ? max_batch / 2 : 1; /* admitted requests per connection */
    fwd_item *items = calloc((size_t)max_batch, sizeof(fwd_item));
    srv_job **batch = calloc((size_t)max_batch, sizeof(srv_job *));
    uint64_t last_sweep = kvs_now_ns();
    uint64_t step = 0; /* scheduler rounds: admission stamps */
    pthread_mutex_lock(&s->mu);
    while (!atomic_load(&s->stopping)) {
        if (!s->jobs) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_sec += 1;
            pthread_cond_timedwait(&s->cv, &s->mu, &ts);
        }
        if (kvs_now_ns() - last_sweep > 1000000000ull) {
            int ev = kv_sweep_ttl(e->kv, 64);
            if (ev) srv_logf(s, "ttl: evicted %d idle session(s)", ev);
            last_sweep = kvs_now_ns();
        }
        if (!s->jobs) continue;
        srv_job *done = NULL;
        int n_items = 0;
        /* Requests that hold pins now: a request short of blocks or of a session slot waits
         * for them (BUDGET_EXHAUSTED only when nothing running could free any). */
        int running = 0;
        for (srv_job *j = s->jobs; j; j = j->next) running += j->state == JOB_RUNNING;
        /* Cancellations, and TRUNCATE / RELEASE whose turn has come, in arrival order. */
        for (srv_job *j = s->jobs, *next; j; j = next) {
            next = j->next;
            if (atomic_load(&j->cancel)) {
                if (j->state == JOB_RUNNING) {
                    kv_abort(e->kv, j->txn, true);
                    j->conn->n_running--;
                    running--;
                }
                cancelled_reply(e->kv, j);
                jobs_remove(s, j);
                j->next = done;
                done = j;
                continue;
            }
            if (j->state == JOB_QUEUED && j->after) continue; /* arrival order on a session (jobs_append) */
            if (j->op != WIRE_OP_FORWARD) {
                j->status = j->op == WIRE_OP_TRUNCATE ? kv_truncate(e->kv, &j->sid, j->epoch, j->truncate_len, &j->reply)
                                                      : kv_release(e->kv, &j->sid, j->epoch, &j->reply);
                jobs_remove(s, j);
                j->next = done;
                done = j;
            }
        }
        /* Admission, round-robin over connections: each free slot goes to the queued request
         * whose connection has the fewest admitted, then the one served least recently, then
         * arrival order. At most max_batch requests are admitted, so every admitted one is in
         * every step; one connection holds at most half of them. So a connection pipelining
         * many requests gets one slot in turn with every other, never all of them. */
        step++;
        for (;;) {
            if (running >= max_batch) break;
            srv_job *pick = NULL;
            for (srv_job *j = s->jobs; j; j = j->next) {
                if (j->state != JOB_QUEUED || j->after || j->op != WIRE_OP_FORWARD || j->skip_step == step) continue;
                if (j->conn->n_running >= per_conn) continue;
                if (!pick || j->conn->n_running < pick->conn->n_running ||
                    (j->conn->n_running == pick->conn->n_running && j->conn->last_admit < pick->conn->last_admit))
                    pick = j;
            }
            if (!pick) break;
            srv_job *j = pick;
            /* The tenant is the identity the session key was made from (a relayed step: the
             * identity that registered it, j->conn). */
            j->status = kv_begin_tenant(e->kv, j->conn->tenant, &j->sid, j->epoch, j->start_pos, j->n,
                                        j->inherit ? &j->inh : NULL, &j->txn, &j->reply);
            if ((j->status == KVS_ERR_BUDGET_EXHAUSTED || j->status == KVS_ERR_BUSY) && j->reply.pinned_short &&
                running > 0) {
                /* Short of room that running requests will free: it waits, and later ones are not
                 * admitted before it — unless it is short of its own quota: then it waits for its
                 * tenant's pins and holds no one else. */
                if (!j->reply.over_quota) break;
                j->skip_step = step;
                continue;
            }
            if (j->status) {
                jobs_remove(s, j);
                j->next = done;
                done = j;
                continue;
            }
            j->state = JOB_RUNNING;
            j->conn->n_running++;
            j->conn->last_admit = step;
            running++;
        }
        /* Every admitted request takes part in this step. */
        for (srv_job *j = s->jobs; j; j = j->next) {
            if (j->state != JOB_RUNNING || n_items >= max_batch) continue;
            fwd_item *it = &items[n_items];
            memset(it, 0, sizeof(*it));
            it->txn = j->txn;
            it->pos0 = j->start_pos + j->done;
            it->n = j->n - j->done; /* rows: cut to this step's share below */
            batch[n_items++] = j;
        }
        share_prefill_rows(items, batch, n_items, s->p.prefill_chunk ? s->p.prefill_chunk : 64);
        for (int i = 0; i < n_items; i++) {
            srv_job *j = batch[i];
            fwd_item *it = &items[i];
            if (m->has_embd) it->tokens = j->tokens + j->done;
            else it->hidden = j->hidden + (size_t)j->done * d;
            bool last_chunk = j->done + it->n == j->n;
            if (j->out_mode == FWD_OUT_LOGITS_LAST) {
                it->out_mode = last_chunk ? FWD_OUT_LOGITS_LAST : FWD_OUT_HIDDEN;
                it->out = last_chunk ? j->out : j->scratch;
            } else {
                it->out_mode = j->out_mode;
                it->out = j->out + (size_t)j->done * j->out_cols;
            }
        }
        if (n_items) {
            s->c_batches++;
            s->c_batch_items += (uint64_t)n_items;
            pthread_mutex_unlock(&s->mu);
            if (s->p.before_batch) s->p.before_batch(s->p.hook_ctx, n_items);
            /* Requests cancelled while the lock was down: flag their transactions. */
            for (int i = 0; i < n_items; i++)
                if (atomic_load(&batch[i]->cancel)) kv_cancel(e->kv, &batch[i]->sid);
            uint64_t t_batch = kvs_now_ns();
            int err = fwd_run(m, e->pool, e->kv, items, n_items);
            if (s->p.batch_done) {
                uint32_t rows = 0;
                for (int i = 0; i < n_items; i++) rows += items[i].n;
                s->p.batch_done(s->p.batch_ctx, n_items, rows, kvs_now_ns() - t_batch);
            }
            pthread_mutex_lock(&s->mu);
            for (int i = 0; i < n_items; i++) {
                srv_job *j = batch[i];
                int st = err ? err : items[i].status;
                /* A CANCEL accepted while the batch ran wins over its result: the CANCEL was
                 * answered OK under s->mu, so this request must answer CANCELLED. */
                if (atomic_load(&j->cancel)) st = KVS_ERR_CANCELLED;
                if (st == KVS_OK) {
                    j->done += items[i].n;
                    s->c_forward_rows += items[i].n;
                    if (j->done < j->n) continue;
                    kv_commit(e->kv, j->txn, &j->reply);
                    j->status = KVS_OK;
                } else {
                    kv_abort(e->kv, j->txn, st == KVS_ERR_CANCELLED);
                    if (st == KVS_ERR_CANCELLED) {
                        cancelled_reply(e->kv, j);
                    } else {
                        j->reply.n_past = 0; /* stays 0 when the abort left no session */
                        kv_lookup(e->kv, &j->sid, NULL, &j->reply.n_past);
                        j->status = st;
                    }
                }
                j->state = JOB_DONE;
                j->conn->n_running--;
                jobs_remove(s, j);
                j->next = done;
                done = j;
            }
        }
        if (done) {
            pthread_mutex_unlock(&s->mu);
            finish_jobs(done);
            pthread_mutex_lock(&s->mu);
        }
    }
    /* Shutting down: abort everything still here. */
    srv_job *rest = s->jobs;
    s->jobs = s->jobs_tail = NULL;
    for (srv_job *j = rest; j; j = j->next) {
        if (j->state == JOB_RUNNING) kv_abort(e->kv, j->txn, true);
        j->status = KVS_ERR_CANCELLED;
    }
    pthread_mutex_unlock(&s->mu);
    finish_jobs(rest);
    free(items);
    free(batch);
    return NULL;
}

/* ---- connection: requests --------------------------------------------------- */

static void conn_unref(srv_conn *c) {
    if (atomic_fetch_sub(&c->refs, 1) != 1) return;
    srv *s = c->s;
    /* Replies queued after the writer stopped still count in s->buffered: returned here, once,
     * before n_conns drops (srv_free may follow). */
    atomic_fetch_sub(&s->buffered, c->out_bytes);
    pthread_mutex_lock(&s->mu);
    srv_conn **pp = &s->conns;
    while (*pp && *pp != c) pp = &(*pp)->next;
    if (*pp) *pp = c->next;
    /* Last touch of s: once n_conns drops, srv_run may return and srv_free free s. */
    s->n_conns--;
    pthread_mutex_unlock(&s->mu);
    netio_close(c->fd);
    out_free_all(c->out_head); /* replies queued after the writer stopped */
    pthread_mutex_destroy(&c->write_lock);
    pthread_cond_destroy(&c->write_cv);
    free(c);
}

/* The hot-state key of the client's session id: a keyed hash of (peer identity, sid) under a
 * per-process random key. Another identity naming the same sid reaches another key, so it sees
 * nothing of the session (as if absent) and cannot change it (docs/security.md). */
static void conn_sid(const srv_conn *c, const uint8_t raw[WIRE_SID_SIZE], kv_sid *out) {
    uint8_t in[TLS_ID_MAX + WIRE_SID_SIZE];
    size_t il = strlen(c->identity) + 1; /* the NUL separates identity and sid */
    memcpy(in, c->identity, il);
    memcpy(in + il, raw, WIRE_SID_SIZE);
    crypto_generichash(out->bytes, sizeof out->bytes, in, il + WIRE_SID_SIZE, c->s->sid_key, sizeof c->s->sid_key);
}

static int handle_forward(srv_conn *c, uint64_t rid, const uint8_t *payload, size_t len) {
    srv *s = c->s;
    const model *m = s->e->m;
    struct wire_forward f;
    char msg[KVS_MSG_MAX] = "";
    int err = wire_decode_forward(payload, len, &f, msg, sizeof(msg));
    if (err) {
        pthread_mutex_lock(&s->mu);
        s->c_protocol_errors++;
        pthread_mutex_unlock(&s->mu);
        send_status(c, rid, KVS_ERR_PROTOCOL, NULL, msg);
        return KVS_OK;
    }
    struct wire_forward_reply bad;
    memset(&bad, 0, sizeof(bad));
    bad.st.status = KVS_OK;
    const char *why = NULL;
    bool tokens_in = f.in_kind == WIRE_IN_TOKENS;
    const bool relayed = (f.flags & WIRE_FWD_RELAY) != 0, pushes = relayed && f.relay.n_next > 0;
    /* A relayed step is answered on the connection its client registered (RELAY_LISTEN). */
    srv_conn *target = relayed ? relay_listen_take(s->relay, f.relay.relay_id, conn_ref_void) : NULL;
    if (relayed && !target) conn_ref_void(c);
    if (relayed && !target) target = c;
    if (c->version < 2 && (relayed || f.out_mode == WIRE_OUT_SAMPLE)) {
        bad.st.status = KVS_ERR_UNSUPPORTED;
        why = "sampling and relay need protocol version 2 (say HELLO with max_version 2)";
    } else if (c->version < 2 && f.in_kind == WIRE_IN_HIDDEN_BF16) {
        bad.st.status = KVS_ERR_UNSUPPORTED;
        why = "bf16 hidden states need protocol version 2 (say HELLO with max_version 2)";
    } else if (relayed && f.relay.n_next == 0 && f.out_mode == WIRE_OUT_HIDDEN) {
        bad.st.status = KVS_ERR_INVALID_ARG;
        why = "a relayed step must end in logits or a sample";
    } else if (pushes && m->has_head) {
        bad.st.status = KVS_ERR_INVALID_ARG;
        why = "relay hops after the shard that owns the output head";
    } else if (tokens_in != m->has_embd) {
        bad.st.status = KVS_ERR_INVALID_ARG;
        why = m->has_embd ? "this shard owns layer 0 and takes token ids" : "this shard takes hidden states";
    } else if (!tokens_in && f.n_embd != m->hp.n_embd) {
        bad.st.status = KVS_ERR_INVALID_ARG;
        why = "hidden width does not match n_embd";
    } else if (f.out_mode != WIRE_OUT_HIDDEN && !pushes && !m->has_head) {
        bad.st.status = KVS_ERR_INVALID_ARG;
        why = "logits requested from a shard without the output head";
    } else if (f.n_tokens > s->p.max_tokens) {
        bad.st.status = KVS_ERR_TOO_LARGE;
        why = "more rows than max_tokens";
    } /* positions past the context: kv_begin answers CONTEXT_FULL */
    /* What this shard computes: hidden rows when it pushes on, the last row's logits to sample. */
    uint32_t local_mode = pushes ? WIRE_OUT_HIDDEN : f.out_mode == WIRE_OUT_SAMPLE ? WIRE_OUT_LOGITS_LAST : f.out_mode;
    uint32_t rows = local_mode == WIRE_OUT_LOGITS_LAST ? 1 : f.n_tokens;
    uint32_t cols = local_mode == WIRE_OUT_HIDDEN ? m->hp.n_embd : m->hp.n_vocab;
    if (!why && (uint64_t)rows * cols * 4 + 64 > WIRE_MAX_PAYLOAD) {
        bad.st.status = KVS_ERR_TOO_LARGE;
        why = "the reply would exceed the frame limit";
    }
    if (!why && tokens_in)
        for (uint32_t i = 0; i < f.n_tokens; i++) {
            int32_t t = wire_forward_token(&f, i);
            if (t < 0 || (uint32_t)t >= m->hp.n_vocab) {
                bad.st.status = KVS_ERR_INVALID_ARG;
                why = "token id outside the vocabulary";
                break;
            }
        }
    if (!why && atomic_load(&(target ? target : c)->inflight) >= s->p.max_inflight) {
        bad.st.status = KVS_ERR_BUSY;
        why = "too many requests in flight on this connection";
        pthread_mutex_lock(&s->mu);
        s->c_busy_inflight++;
        pthread_mutex_unlock(&s->mu);
    }
    srv_job *j = NULL;
    if (!why) {
        j = calloc(1, sizeof(*j));
        if (j) {
            size_t d = m->hp.n_embd;
            if (tokens_in) {
                j->tokens = malloc((size_t)f.n_tokens * sizeof(int32_t));
                if (j->tokens)
                    for (uint32_t i = 0; i < f.n_tokens; i++) j->tokens[i] = wire_forward_token(&f, i);
            } else {
                j->hidden = malloc((size_t)f.n_tokens * d * sizeof(float));
                if (j->hidden && wire_forward_hidden_to_f32(&f, j->hidden) != KVS_OK) {
                    free(j->hidden);
                    j->hidden = NULL;
                }
            }
            j->out = malloc((size_t)rows * cols * sizeof(float));
            if (local_mode == WIRE_OUT_LOGITS_LAST && f.n_tokens > 1) j->scratch = malloc((size_t)f.n_tokens * d * sizeof(float));
            bool extra_ok = true;
            if (f.out_mode == WIRE_OUT_SAMPLE && f.sample.n_window) {
                j->window = malloc((size_t)f.sample.n_window * sizeof(int32_t));
                extra_ok = j->window != NULL;
                for (uint32_t i = 0; extra_ok && i < f.sample.n_window; i++)
                    j->window[i] = (int32_t)kvs_rd_u32((const uint8_t *)f.sample.window + 4 * (size_t)i);
            }
            if (pushes && extra_ok) {
                j->relay = malloc(sizeof(*j->relay));
                if (j->relay) *j->relay = f.relay;
                extra_ok = j->relay != NULL;
            }
            if ((!j->tokens && !j->hidden) || !j->out || !extra_ok ||
                (local_mode == WIRE_OUT_LOGITS_LAST && f.n_tokens > 1 && !j->scratch)) {
                job_free(j);
                j = NULL;
            }
        }
        if (!j) {
            bad.st.status = KVS_ERR_NOMEM;
            why = "out of memory";
        }
    }
    if (why) {
        uint8_t buf[64];
        size_t l = 0;
        if (wire_encode_forward_reply(&bad, buf, sizeof(buf), &l) == KVS_OK)
            conn_send(target ? target : c, WIRE_OP_FORWARD_REPLY, rid, buf, l);
        if (target) conn_unref(target);
        return KVS_OK;
    }
    j->conn = target ? target : c; /* a relayed job holds the ref taken with its target */
    j->op = WIRE_OP_FORWARD;
    j->sample = f.out_mode == WIRE_OUT_SAMPLE && !pushes;
    j->sq = f.sample;
    j->sq.window = NULL;
    j->wire_out_mode = f.out_mode;
    j->request_id = rid;
    /* A relayed step acts on the session of the client that registered relay_id: keyed by that
     * connection's identity, as its client-driven steps are (docs/protocol.md §4.3.2). */
    conn_sid(j->conn, f.session_id, &j->sid);
    memcpy(j->wire_sid, f.session_id, WIRE_SID_SIZE);
    j->epoch = f.epoch;
    j->start_pos = f.start_pos;
    j->n = f.n_tokens;
    j->inherit = (f.flags & WIRE_FWD_INHERIT) != 0;
    j->inh.old_epoch = f.inherit_epoch;
    j->inh.len = f.inherit_len;
    j->reply_f16 = f.in_kind == WIRE_IN_HIDDEN_F16;
    j->reply_bf16 = f.in_kind == WIRE_IN_HIDDEN_BF16;
    j->out_mode = local_mode == WIRE_OUT_HIDDEN ? FWD_OUT_HIDDEN
                  : local_mode == WIRE_OUT_LOGITS_ALL ? FWD_OUT_LOGITS_ALL : FWD_OUT_LOGITS_LAST;
    j->out_rows = rows;
    j->out_cols = cols;
    j->state = JOB_QUEUED;
    atomic_init(&j->cancel, false);
    if (!target) atomic_fetch_add(&c->refs, 1);
    atomic_fetch_add(&j->conn->inflight, 1);
    pthread_mutex_lock(&s->mu);
    jobs_append(s, j);
    s->c_requests++;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return KVS_OK;
}

/* Flags c's jobs (all of them, or the one with request id rid) for
 * cancellation; returns how many were flagged. */
static int cancel_jobs(srv_conn *c, bool all, uint64_t rid) {
    srv *s = c->s;
    int n = 0;
    pthread_mutex_lock(&s->mu);
    for (srv_job *j = s->jobs; j; j = j->next) {
        if (j->conn != c || (!all && j->request_id != rid)) continue;
        atomic_store(&j->cancel, true);
        if (j->state == JOB_RUNNING) kv_cancel(s->e->kv, &j->sid);
        n++;
    }
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return n;
}

void srv_stats(srv *s, struct wire_stats_reply *m) {
    kv_stats k;
    kv_get_stats(s->e->kv, &k);
    relay_stats rs;
    relay_get_stats(s->relay, &rs);
    pthread_mutex_lock(&s->mu);
    struct { const char *name; uint64_t v; } list[] = {
        {"kv.sessions", k.sessions},           {"kv.bytes_used", k.bytes_used},
        {"kv.budget_bytes", k.budget_bytes},   {"kv.block_bytes", k.block_bytes},
        {"kv.blocks_total", k.blocks_total},   {"kv.blocks_free", k.blocks_free},
        {"kv.hits", k.hits},                   {"kv.misses", k.misses},
        {"kv.stale", k.stale},                 {"kv.evict_ttl", k.evict_ttl},
        {"kv.evict_lru", k.evict_lru},         {"kv.releases", k.releases},
        {"kv.rewinds", k.rewinds},             {"kv.cancellations", k.cancellations},
        {"kv.appends", k.appends},             {"kv.truncates", k.truncates},
        {"kv.inherits", k.inherits},           {"kv.busy", k.busy},
        {"kv.in_place", k.in_place},           {"kv.tombstones", k.tombstones},
        {"srv.connections_total", s->c_conns_total}, {"srv.connections_open", (uint64_t)s->n_conns},
        {"srv.connections_rejected", s->c_rejected_conns}, {"srv.requests", s->c_requests},
        {"srv.forward_rows", s->c_forward_rows}, {"srv.batches", s->c_batches},
        {"srv.batch_items", s->c_batch_items}, {"srv.protocol_errors", s->c_protocol_errors},
        {"relay.pushed", rs.pushed},           {"relay.failed", rs.failed},
        {"relay.connects", rs.connects},
        {"srv.auth_failures", s->c_auth_failures}, {"srv.busy_inflight", s->c_busy_inflight},
        {"srv.refused_per_addr", s->c_refused_addr}, {"srv.frame_timeouts", s->c_frame_timeouts},
        {"srv.refused_buffers", s->c_refused_buffers},
        {"srv.buffered_bytes", (uint64_t)atomic_load(&s->buffered)},
        {"srv.rx_buffer_bytes", (uint64_t)atomic_load(&s->rx_capacity)},
        {"kv.tenants", k.tenants},             {"kv.evict_quota", k.evict_quota},
        {"kv.quota_refusals", k.quota_refusals},
    };
    pthread_mutex_unlock(&s->mu);
    size_t n = sizeof(list) / sizeof(list[0]);
    for (size_t i = 0; i < n; i++) {
        snprintf(m->stats[i].name, sizeof(m->stats[i].name), "%s", list[i].name);
        m->stats[i].value = list[i].v;
    }
    m->n_stats = (uint32_t)n;
}

static void handle_stats(srv_conn *c, uint64_t rid) {
    struct wire_stats_reply *m = calloc(1, sizeof(*m));
    if (!m) return;
    srv_stats(c->s, m);
    uint8_t *buf = malloc(8192);
    size_t len = 0;
    if (buf && wire_encode_stats_reply(m, buf, 8192, &len) == KVS_OK) conn_send(c, WIRE_OP_STATS_REPLY, rid, buf, len);
    free(buf);
    free(m);
}

static void handle_vocab(srv_conn *c, uint64_t rid, const struct wire_vocab *q) {
    srv *s = c->s;
    const tok_vocab *v = s->e->vocab;
    struct wire_vocab_reply r;
    memset(&r, 0, sizeof(r));
    if (!v || s->e->m->first != 0) { /* only the head shard (layer 0, token ids in) answers */
        r.st.status = KVS_ERR_UNSUPPORTED;
    } else if (q->first >= (uint32_t)tok_n_vocab(v)) {
        r.st.status = KVS_ERR_INVALID_ARG;
    }
    if (r.st.status) {
        uint8_t buf[64];
        size_t len = 0;
        if (wire_encode_vocab_reply(&r, buf, sizeof(buf), &len) == KVS_OK) conn_send(c, WIRE_OP_VOCAB_REPLY, rid, buf, len);
        return;
    }
    uint32_t nv = (uint32_t)tok_n_vocab(v), count = nv - q->first;
    if (count > q->max_count) count = q->max_count;
    if (count > 8192) count = 8192; /* keeps a page well under the frame limit */
    struct wire_vocab_token *toks = calloc(count, sizeof(*toks));
    if (!toks) return;
    for (uint32_t i = 0; i < count; i++) {
        size_t l = 0;
        toks[i].text = tok_token_text(v, (int32_t)(q->first + i), &l);
        toks[i].text_len = (uint32_t)l;
        toks[i].score = tok_token_score(v, (int32_t)(q->first + i));
        toks[i].type = tok_token_type(v, (int32_t)(q->first + i));
    }
    r.n_vocab = nv;
    r.first = q->first;
    r.count = count;
    r.bos = tok_bos(v);
    r.eos = tok_eos(v);
    r.add_space_prefix = tok_add_space_prefix(v);
    const char *model_name = tok_vocab_kind(v) == TOK_KIND_BPE ? "gpt2" : "llama";
    r.tok_model_len = (uint8_t)strlen(model_name);
    memcpy(r.tok_model, model_name, r.tok_model_len);
    r.tokens = toks;
    size_t len = 0;
    uint8_t *buf = NULL;
    int err = wire_encode_vocab_reply(&r, NULL, 0, &len);
    if (!err && (buf = malloc(len))) err = wire_encode_vocab_reply(&r, buf, len, &len);
    if (!err && buf) conn_send(c, WIRE_OP_VOCAB_REPLY, rid, buf, len);
    free(buf);
    free(toks);
}

/* VOCAB_META: the BPE settings, the chat template (first page) and a page of merges. */
static void handle_vocab_meta(srv_conn *c, uint64_t rid, const struct wire_vocab_meta *q) {
    const tok_vocab *v = c->s->e->vocab;
    struct wire_vocab_meta_reply r;
    memset(&r, 0, sizeof(r));
    int32_t nm = v ? tok_n_merges(v) : 0;
    const char *tmpl = v ? tok_chat_template(v) : NULL;
    size_t tl = tmpl ? strlen(tmpl) : 0;
    if (!v) r.st.status = KVS_ERR_UNSUPPORTED;
    else if (q->first > (uint32_t)nm || tl > WIRE_MAX_TEMPLATE || strlen(tok_pre_name(v)) > WIRE_MAX_PRE)
        r.st.status = KVS_ERR_INVALID_ARG;
    uint32_t count = r.st.status ? 0 : (uint32_t)nm - q->first;
    if (count > q->max_count) count = q->max_count;
    if (count > (1u << 20)) count = 1u << 20; /* 8 MiB of ids per page */
    int32_t *ids = count ? malloc((size_t)count * 2 * sizeof(*ids)) : NULL;
    if (count && !ids) r.st.status = KVS_ERR_NOMEM;
    if (!r.st.status) {
        for (uint32_t i = 0; i < count; i++) tok_merge(v, (int32_t)(q->first + i), &ids[2 * i], &ids[2 * i + 1]);
        r.n_vocab = (uint32_t)tok_n_vocab(v);
        int8_t ab = tok_add_bos_setting(v);
        r.add_bos = ab > 0 ? 1 : ab < 0 ? 2 : 0;
        r.pre_len = (uint8_t)strlen(tok_pre_name(v));
        memcpy(r.pre, tok_pre_name(v), r.pre_len);
        r.n_merges = (uint32_t)nm;
        r.first = q->first;
        r.count = count;
        r.template_len = q->first == 0 ? (uint32_t)tl : 0;
        r.chat_template = tmpl;
        r.merge_ids = ids;
    }
    size_t len = 0;
    uint8_t *buf = NULL;
    int err = wire_encode_vocab_meta_reply(&r, NULL, 0, &len);
    if (!err && (buf = malloc(len))) err = wire_encode_vocab_meta_reply(&r, buf, len, &len);
    if (!err && buf) conn_send(c, WIRE_OP_VOCAB_META_REPLY, rid, buf, len);
    free(buf);
    free(ids);
}

static void send_info(srv_conn *c, uint64_t rid, int status) {
    srv *s = c->s;
    const model *m = s->e->m;
    struct wire_info in;
    memset(&in, 0, sizeof(in));
    in.st.status = status;
    if (status == KVS_OK) {
        in.version = c->version;
        in.hidden_dtypes = WIRE_DTYPE_F32 | WIRE_DTYPE_F16 | (c->version >= 2 ? WIRE_DTYPE_BF16 : 0);
        memcpy(in.model_digest, s->digest, 32);
        in.n_layer = m->hp.n_layer;
        in.first = m->first;
        in.last = m->last;
        in.n_embd = m->hp.n_embd;
        in.n_vocab = m->hp.n_vocab;
        in.kv_budget_bytes = s->p.kv_budget_bytes;
        in.max_tokens = s->p.max_tokens;
        in.max_ctx = kv_get_params(s->e->kv)->max_positions;
        in.name_len = (uint16_t)strlen(s->name);
        memcpy(in.name, s->name, in.name_len);
    }
    uint8_t buf[512];
    size_t len = 0;
    if (wire_encode_info(&in, buf, sizeof(buf), &len) == KVS_OK) conn_send(c, WIRE_OP_INFO, rid, buf, len);
}

/* TRUNCATE and RELEASE: decoded, then applied to the hot state at once — or, when a request of
 * this connection on the same session is still queued or running, queued behind it so that
 * operations on one session from one connection take effect in arrival order. Answered with
 * STATUS (PROTOCOL with the decoder's message when the payload does not decode). */
static void handle_truncate_release(srv_conn *c, const struct wire_header *h, const uint8_t *payload, size_t len) {
    char msg[KVS_MSG_MAX] = "";
    srv *s = c->s;
    kv_state *kv = s->e->kv;
    kv_sid sid;
    uint64_t epoch = 0;
    uint32_t keep = 0;
    kv_reply r = {0};
    int err;
    if (h->op == WIRE_OP_TRUNCATE) {
        struct wire_truncate t;
        if (!(err = wire_decode_truncate(payload, len, &t, msg, sizeof(msg)))) {
            conn_sid(c, t.session_id, &sid);
            epoch = t.epoch;
            keep = t.len;
        }
    } else {
        struct wire_release t;
        if (!(err = wire_decode_release(payload, len, &t, msg, sizeof(msg)))) {
            conn_sid(c, t.session_id, &sid);
            epoch = t.epoch;
        }
    }
    if (msg[0]) err = KVS_ERR_PROTOCOL; /* only the decoders write msg */
    if (!err) {
        srv_job *j = calloc(1, sizeof(*j));
        pthread_mutex_lock(&s->mu);
        bool behind = false;
        for (const srv_job *e = s->jobs; e && !behind; e = e->next) behind = e->conn == c && same_sid(&e->sid, &sid);
        bool over = behind && atomic_load(&c->inflight) >= s->p.max_inflight; /* queued ones count too */
        if (over) {
            s->c_busy_inflight++;
            behind = false;
        }
        if (behind && j) {
            j->conn = c;
            j->op = h->op;
            j->request_id = h->request_id;
            j->sid = sid;
            j->epoch = epoch;
            j->truncate_len = keep;
            j->state = JOB_QUEUED;
            atomic_init(&j->cancel, false);
            atomic_fetch_add(&c->refs, 1);
            atomic_fetch_add(&c->inflight, 1);
            jobs_append(s, j);
            pthread_cond_signal(&s->cv);
        }
        pthread_mutex_unlock(&s->mu);
        if (behind && j) return; /* the scheduler answers it */
        free(j);
        if (over) err = KVS_ERR_BUSY;
        else if (behind) err = KVS_ERR_NOMEM;
        else err = h->op == WIRE_OP_TRUNCATE ? kv_truncate(kv, &sid, epoch, keep, &r) : kv_release(kv, &sid, epoch, &r);
    }
    send_status(c, h->request_id, err, &r, msg[0] ? msg : NULL);
}

/* Checks the HELLO token against --auth-token-file and sets c->identity: the TLS identity when
 * there is one, else "token:" + a digest prefix of the token, else "anonymous". KVS_OK or
 * KVS_ERR_INVALID_ARG (a token file is set and the token is not in it). */
static int conn_authenticate(srv_conn *c, const struct wire_hello *hello) {
    srv *s = c->s;
    if (s->n_tokens > 0) {
        uint8_t d[crypto_generichash_BYTES];
        crypto_generichash(d, sizeof d, (const uint8_t *)hello->auth, hello->auth_len, NULL, 0);
        bool found = false;
        for (int i = 0; i < s->n_tokens; i++) found |= sodium_memcmp(d, s->tokens[i], sizeof d) == 0;
        if (!found || hello->auth_len == 0) return KVS_ERR_INVALID_ARG;
        if (!s->tls) snprintf(c->identity, sizeof c->identity, "token:%02x%02x%02x%02x%02x%02x%02x%02x", d[0], d[1],
                              d[2], d[3], d[4], d[5], d[6], d[7]);
    }
    if (!c->identity[0]) snprintf(c->identity, sizeof c->identity, "anonymous");
    uint8_t tag[8];
    crypto_generichash(tag, sizeof tag, (const uint8_t *)c->identity, strlen(c->identity), s->sid_key, sizeof s->sid_key);
    memcpy(&c->tenant, tag, sizeof tag);
    return KVS_OK;
}

/* netio admit hook: reserves the frame's payload in s->buffered, or refuses it with BUSY when
 * every connection together would hold more than max_buffered_bytes. */
static int conn_admit(void *ctx, const struct wire_header *h) {
    srv_conn *c = ctx;
    srv *s = c->s;
    unsigned long long now = atomic_fetch_add(&s->buffered, h->payload_len);
    if (now + h->payload_len > s->p.max_buffered_bytes) {
        atomic_fetch_sub(&s->buffered, h->payload_len);
        return KVS_ERR_BUSY;
    }
    c->rx_held = h->payload_len;
    return KVS_OK;
}

static void conn_release_rx(srv_conn *c) {
    atomic_fetch_sub(&c->s->buffered, c->rx_held);
    c->rx_held = 0;
}

/* Brings s->rx_capacity up to date with c's receive buffer. */
static void conn_count_rx(srv_conn *c, const struct netio_buf *b) {
    atomic_fetch_add(&c->s->rx_capacity, b->cap);
    atomic_fetch_sub(&c->s->rx_capacity, c->rx_cap);
    c->rx_cap = b->cap;
}

static void count_protocol_error(srv *s) {
    pthread_mutex_lock(&s->mu);
    s->c_protocol_errors++;
    pthread_mutex_unlock(&s->mu);
}

static void *conn_main(void *arg) {
    srv_conn *c = arg;
    srv *s = c->s;
    struct netio_buf buf = {0};
    struct wire_header h;
    char msg[KVS_MSG_MAX] = "";
    int err;
    /* One deadline for the TLS handshake and HELLO together. */
    uint64_t hello_deadline = netio_deadline_ms(s->p.hello_timeout_ms);
    if (s->tls && (err = tls_handshake(s->tls, c->fd, hello_deadline, c->identity, sizeof c->identity, msg,
                                       sizeof msg)) != KVS_OK) {
        pthread_mutex_lock(&s->mu);
        s->c_auth_failures++;
        pthread_mutex_unlock(&s->mu);
        srv_logf(s, "conn %u (%s): %s, closing", c->id, c->peer, msg);
        goto out;
    }
    netio_recv_opts hello_opts = {.idle_deadline_ns = hello_deadline, .frame_timeout_ms = -1,
                                  .max_payload = 6 + WIRE_MAX_AUTH};
    err = netio_recv_frame_opt(c->fd, &h, &buf, &hello_opts, msg, sizeof(msg));
    struct wire_hello hello;
    if (err == KVS_OK && h.op == WIRE_OP_HELLO && wire_decode_hello(buf.data, buf.len, &hello, msg, sizeof(msg)) == KVS_OK &&
        hello.min_version <= WIRE_PROTO_VERSION) {
        c->version = hello.max_version < WIRE_PROTO_VERSION ? hello.max_version : (uint16_t)WIRE_PROTO_VERSION;
        if (conn_authenticate(c, &hello) != KVS_OK) {
            pthread_mutex_lock(&s->mu);
            s->c_auth_failures++;
            pthread_mutex_unlock(&s->mu);
            send_info(c, h.request_id, KVS_ERR_INVALID_ARG);
            srv_logf(s, "conn %u (%s): wrong auth token, closing", c->id, c->peer);
            goto out;
        }
        send_info(c, h.request_id, KVS_OK);
        srv_logf(s, "conn %u (%s): peer %s", c->id, c->peer, c->identity);
    } else {
        if (err == KVS_OK || err == KVS_ERR_PROTOCOL || err == KVS_ERR_UNSUPPORTED) {
            send_info(c, h.request_id, err == KVS_OK ? KVS_ERR_PROTOCOL : err);
            pthread_mutex_lock(&s->mu);
            s->c_protocol_errors++;
            pthread_mutex_unlock(&s->mu);
        }
        srv_logf(s, "conn %u (%s): no valid HELLO (%s), closing", c->id, c->peer,
                 err ? kvs_strerror(err) : "wrong first frame or version");
        goto out;
    }
    while (!atomic_load(&c->closed)) {
        conn_release_rx(c);
        netio_buf_trim(&buf); /* a large frame does not keep its buffer while the peer idles */
        conn_count_rx(c, &buf);
        netio_recv_opts o = {.idle_deadline_ns = netio_deadline_ms(s->p.idle_timeout_ms),
                             .frame_timeout_ms = s->p.frame_timeout_ms > 0 ? s->p.frame_timeout_ms : -1,
                             .admit = conn_admit, .admit_ctx = c};
        err = netio_recv_frame_opt(c->fd, &h, &buf, &o, msg, sizeof(msg));
        conn_count_rx(c, &buf);
        if (err) {
            if (err == KVS_ERR_PROTOCOL || err == KVS_ERR_UNSUPPORTED || err == KVS_ERR_TOO_LARGE) {
                send_status(c, h.request_id, err, NULL, msg);
                count_protocol_error(s);
                srv_logf(s, "conn %u (%s): bad frame (%s), closing", c->id, c->peer, msg);
            } else if (err == KVS_ERR_BUSY) {
                pthread_mutex_lock(&s->mu);
                s->c_refused_buffers++;
                pthread_mutex_unlock(&s->mu);
                send_status(c, h.request_id, err, NULL, "the shard holds too many buffered bytes");
                srv_logf(s, "conn %u (%s): %s, closing", c->id, c->peer, msg);
            } else if (err == KVS_ERR_TIMEOUT && o.started) {
                pthread_mutex_lock(&s->mu);
                s->c_frame_timeouts++;
                pthread_mutex_unlock(&s->mu);
                srv_logf(s, "conn %u (%s): a frame took longer than %d ms, closing", c->id, c->peer,
                         s->p.frame_timeout_ms);
            } else if (err == KVS_ERR_TIMEOUT) {
                srv_logf(s, "conn %u (%s): idle for %d ms, closing", c->id, c->peer, s->p.idle_timeout_ms);
            }
            break;
        }
        c->requests++;
        switch (h.op) {
        case WIRE_OP_FORWARD:
            handle_forward(c, h.request_id, buf.data, buf.len);
            break;
        case WIRE_OP_TRUNCATE:
        case WIRE_OP_RELEASE:
            handle_truncate_release(c, &h, buf.data, buf.len);
            break;
        case WIRE_OP_CANCEL: {
            struct wire_cancel t;
            if (wire_decode_cancel(buf.data, buf.len, &t, msg, sizeof(msg))) {
                send_status(c, h.request_id, KVS_ERR_PROTOCOL, NULL, msg);
                break;
            }
            int n = cancel_jobs(c, false, t.target_request_id);
            send_status(c, h.request_id, n ? KVS_OK : KVS_ERR_NOT_FOUND, NULL, NULL);
            break;
        }
        case WIRE_OP_RELAY_LISTEN: {
            struct wire_relay_listen t;
            if (wire_decode_relay_listen(buf.data, buf.len, &t, msg, sizeof(msg)))
                send_status(c, h.request_id, KVS_ERR_PROTOCOL, NULL, msg);
            else if (c->version < 2)
                send_status(c, h.request_id, KVS_ERR_UNSUPPORTED, NULL, "RELAY_LISTEN needs protocol version 2");
            else
                send_status(c, h.request_id, relay_listen_add(s->relay, t.relay_id, c), NULL, NULL);
            break;
        }
        case WIRE_OP_STATS:
            if (wire_decode_empty(buf.data, buf.len, msg, sizeof(msg))) send_status(c, h.request_id, KVS_ERR_PROTOCOL, NULL, msg);
            else handle_stats(c, h.request_id);
            break;
        case WIRE_OP_VOCAB: {
            struct wire_vocab q;
            if (wire_decode_vocab(buf.data, buf.len, &q, msg, sizeof(msg))) send_status(c, h.request_id, KVS_ERR_PROTOCOL, NULL, msg);
            else handle_vocab(c, h.request_id, &q);
            break;
        }
        case WIRE_OP_VOCAB_META: {
            struct wire_vocab_meta q;
            if (wire_decode_vocab_meta(buf.data, buf.len, &q, msg, sizeof(msg)))
                send_status(c, h.request_id, KVS_ERR_PROTOCOL, NULL, msg);
            else handle_vocab_meta(c, h.request_id, &q);
            break;
        }
        default:
            send_status(c, h.request_id, KVS_ERR_PROTOCOL, NULL, "op not valid from a client after HELLO");
            pthread_mutex_lock(&s->mu);
            s->c_protocol_errors++;
            pthread_mutex_unlock(&s->mu);
            break;
        }
    }
out:
    conn_release_rx(c);
    {
        relay_listen_drop(s->relay, c); /* before our unref: relay.h design note 4 */
        int n = cancel_jobs(c, true, 0);
        /* Let the writer flush what is queued (an error reply before closing), then stop it;
         * closed first, so nothing new is queued while it drains. */
        atomic_store(&c->closed, true);
        pthread_mutex_lock(&c->write_lock);
        c->writer_stop = true;
        pthread_cond_signal(&c->write_cv);
        pthread_mutex_unlock(&c->write_lock);
        pthread_join(c->writer, NULL);
        shutdown(c->fd, SHUT_RDWR);
        srv_logf(s, "conn %u (%s): closed after %lu request(s)%s", c->id, c->peer, c->requests,
                 n ? ", cancelled its work in flight" : "");
    }
    netio_buf_free(&buf);
    conn_count_rx(c, &buf);
    conn_unref(c);
    return NULL;
}

/* ---- lifecycle ---------------------------------------------------------------- */

/* True for a host that only this machine can reach: 127.0.0.0/8, ::1, "localhost". */
static bool host_is_loopback(const char *host) {
    struct in_addr a4;
    struct in6_addr a6;
    if (!strcmp(host, "localhost")) return true;
    if (inet_pton(AF_INET, host, &a4) == 1) return (ntohl(a4.s_addr) >> 24) == 127;
    if (inet_pton(AF_INET6, host, &a6) == 1) return IN6_IS_ADDR_LOOPBACK(&a6);
    return false;
}

/* Reads the accepted HELLO tokens (one per line, surrounding blanks ignored, '#' comments) into
 * s->tokens as hashes. INVALID_ARG for an unreadable file, an empty list or a token too long. */
static int load_tokens(srv *s, const char *path, char *msg, size_t cap) {
    FILE *f = fopen(path, "r");
    if (!f) return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "--auth-token-file %s: %s", path, strerror(errno));
    char line[WIRE_MAX_AUTH + 4];
    int rc = KVS_OK, n_line = 0;
    while (fgets(line, sizeof line, f)) {
        n_line++;
        size_t l = strlen(line);
        if (l == sizeof line - 1 && line[l - 1] != '\n') {
            rc = kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "%s:%d: token longer than %u bytes", path, n_line, WIRE_MAX_AUTH);
            break;
        }
        char *b = line;
        while (*b == ' ' || *b == '\t') b++;
        while (l > 0 && (line[l - 1] == '\n' || line[l - 1] == '\r' || line[l - 1] == ' ' || line[l - 1] == '\t')) line[--l] = 0;
        if (!*b || *b == '#') continue;
        void *grown = realloc(s->tokens, (size_t)(s->n_tokens + 1) * sizeof *s->tokens);
        if (!grown) {
            rc = kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
            break;
        }
        s->tokens = grown;
        crypto_generichash(s->tokens[s->n_tokens], sizeof s->tokens[0], (const uint8_t *)b, strlen(b), NULL, 0);
        s->n_tokens++;
    }
    fclose(f);
    if (rc == KVS_OK && s->n_tokens == 0) rc = kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "--auth-token-file %s holds no token", path);
    sodium_memzero(line, sizeof line);
    return rc;
}

/* RAM of this machine in bytes, 0 when unknown. A KV budget above it is refused rather than
 * clamped: the operator asked for something that cannot hold, and a silent clamp would
 * advertise a different budget than the one configured. */
static uint64_t physical_memory_bytes(void) {
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    if (pages <= 0 || page <= 0) return 0;
    uint64_t b;
    return kvs_mul_u64((uint64_t)pages, (uint64_t)page, &b) ? b : 0;
}

int srv_create(const srv_params *p, srv **out, char *msg, size_t cap) {
    *out = NULL;
    srv *s = calloc(1, sizeof(*s));
    if (!s) return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
    s->p = *p;
    s->listen_fd = -1;
    s->stop_pipe[0] = s->stop_pipe[1] = -1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    atomic_init(&s->stopping, false);
    char host[NETIO_HOST_MAX];
    uint16_t port = 0;
    int err = netio_parse_hostport(p->listen, host, sizeof(host), &port);
    if (err) {
        err = kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "--listen '%s' is not HOST:PORT", p->listen);
        goto fail;
    }
    bool want_tls = p->tls_cert || p->tls_key || p->tls_ca;
    if (want_tls && !(p->tls_cert && p->tls_key && p->tls_ca)) {
        err = kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "TLS needs --tls-cert, --tls-key and --tls-ca together");
        goto fail;
    }
    if (!want_tls && !p->insecure && !host_is_loopback(host)) {
        err = kvs_fail(msg, cap, KVS_ERR_INVALID_ARG,
                       "--listen %s is not a loopback address: give --tls-cert/--tls-key/--tls-ca, or --insecure "
                       "to serve plaintext anyway", p->listen);
        goto fail;
    }
    if (sodium_init() < 0) {
        err = kvs_fail(msg, cap, KVS_ERR_INTERNAL, "libsodium failed to start");
        goto fail;
    }
    randombytes_buf(s->sid_key, sizeof s->sid_key);
    atomic_init(&s->buffered, 0);
    atomic_init(&s->rx_capacity, 0);
    if (want_tls && (err = tls_ctx_create(&(tls_params){.cert_file = p->tls_cert, .key_file = p->tls_key,
                                                         .ca_file = p->tls_ca}, true, &s->tls, msg, cap)))
        goto fail;
    /* The same certificate, as a client, for the relay's connections to next hops. */
    if (want_tls && (err = tls_ctx_create(&(tls_params){.cert_file = p->tls_cert, .key_file = p->tls_key,
                                                         .ca_file = p->tls_ca}, false, &s->relay_tls, msg, cap)))
        goto fail;
    if (p->auth_token_file && (err = load_tokens(s, p->auth_token_file, msg, cap))) goto fail;
    uint64_t phys = physical_memory_bytes();
    if (phys && p->kv_budget_bytes > phys) {
        err = kvs_fail(msg, cap, KVS_ERR_INVALID_ARG,
                       "--kv-budget %.1f GiB is more than this machine's physical memory (%.1f GiB)",
                       (double)p->kv_budget_bytes / (1u << 30), (double)phys / (1u << 30));
        goto fail;
    }
    engine_params ep = engine_default_params();
    ep.model_path = p->model_path;
    ep.first = p->first;
    ep.last = p->last;
    ep.n_threads = p->n_threads;
    ep.kv.budget_bytes = p->kv_budget_bytes;
    ep.kv.ttl_ns = p->kv_ttl_ms * 1000000ull;
    ep.kv.max_sessions = p->max_sessions;
    ep.kv.tenant_max_sessions = p->tenant_max_sessions;
    ep.kv.tenant_max_bytes = p->tenant_kv_bytes;
    if (!p->tenant_kv_bytes && p->tenant_kv_share > 0 && p->tenant_kv_share < 1)
        ep.kv.tenant_max_bytes = (uint64_t)((double)p->kv_budget_bytes * p->tenant_kv_share);
    ep.kv.kv_type = (uint32_t)p->kv_type;
    ep.kv.clock = p->kv_clock;
    ep.kv.clock_ctx = p->kv_clock_ctx;
    if ((err = engine_open(&ep, &s->e, msg, cap))) goto fail;
    relay_params rp = relay_default_params();
    rp.done = relay_done;
    rp.log = p->log;
    rp.ctx = p->log_ctx; /* relay_done ignores it */
    rp.timeout_ms = p->hello_timeout_ms;
    rp.tls = s->relay_tls;
    if ((err = relay_create(&rp, &s->relay))) {
        err = kvs_fail(msg, cap, err, "cannot create the relay");
        goto fail;
    }
    srv_logf(s, "loaded %s layers [%u, %u) of %u: %.1f MiB of weights (%d matrices repacked) in %.2f s", p->model_path,
             s->e->m->first, s->e->m->last, s->e->m->hp.n_layer, (double)s->e->m->weight_bytes / (1 << 20),
             s->e->m->n_repacked, s->e->open_s);
    srv_logf(s, "hashing the model file for its digest");
    if ((err = digest_model_sha256(p->model_path, s->digest))) {
        err = kvs_fail(msg, cap, err, "cannot read %s to hash it", p->model_path);
        goto fail;
    }
    if (pipe2(s->stop_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
        err = kvs_fail(msg, cap, KVS_ERR_IO, "pipe: %s", strerror(errno));
        goto fail;
    }
    if ((err = netio_listen(host, port, 64, &s->listen_fd, &s->port, msg, cap))) goto fail;
    if (p->name && p->name[0]) snprintf(s->name, sizeof(s->name), "%s", p->name);
    else snprintf(s->name, sizeof(s->name), "%.100s:%u", host, s->port);
    *out = s;
    return KVS_OK;
fail:
    srv_free(s);
    return err;
}

uint16_t srv_port(const srv *s) { return s->port; }

void srv_stop(srv *s) {
    atomic_store(&s->stopping, true);
    char b = 1;
    ssize_t r = write(s->stop_pipe[1], &b, 1);
    (void)r;
}

/* The peer's IP address (addr) and "addr:port" (peer) of an accepted socket; "?" when unknown. */
static void peer_address(int fd, char addr[INET6_ADDRSTRLEN], char peer[64]) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    if (getpeername(fd, (struct sockaddr *)&ss, &sl) != 0) return;
    unsigned port = 0;
    if (ss.ss_family == AF_INET) {
        inet_ntop(AF_INET, &((struct sockaddr_in *)&ss)->sin_addr, addr, INET6_ADDRSTRLEN);
        port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
    } else if (ss.ss_family == AF_INET6) {
        inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&ss)->sin6_addr, addr, INET6_ADDRSTRLEN);
        port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    } else {
        return;
    }
    snprintf(peer, 64, "%s:%u", addr, port);
}

/* Closes a connection refused for capacity. A plaintext peer first gets STATUS BUSY with the
 * reason (one non-blocking send into the empty socket buffer, request id 0); a TLS peer only sees
 * the close — the shard does not spend a handshake on a connection it will not serve. */
static void refuse_conn(srv *s, int fd, const char *why) {
    if (!s->tls) {
        struct wire_status_reply m;
        memset(&m, 0, sizeof m);
        m.st.status = KVS_ERR_BUSY;
        m.msg_len = (uint16_t)strlen(why);
        memcpy(m.msg, why, m.msg_len);
        uint8_t buf[512];
        size_t len = 0;
        if (wire_encode_status_reply(&m, buf, sizeof buf, &len) == KVS_OK)
            (void)netio_send_frame(fd, WIRE_OP_STATUS, 0, buf, len, netio_deadline_ms(0));
    }
    netio_close(fd);
}

int srv_run(srv *s) {
    kv_stats ks;
    kv_get_stats(s->e->kv, &ks);
    srv_logf(s, "listening on port %u (kv budget %llu MiB = %llu blocks of %llu B)", s->port,
             (unsigned long long)(ks.budget_bytes >> 20), (unsigned long long)ks.blocks_total,
             (unsigned long long)ks.block_bytes);
    if (pthread_create(&s->sched_thread, NULL, sched_main, s) != 0) return KVS_ERR_INTERNAL;
    while (!atomic_load(&s->stopping)) {
        struct pollfd pf[2] = {{.fd = s->listen_fd, .events = POLLIN}, {.fd = s->stop_pipe[0], .events = POLLIN}};
        int r = poll(pf, 2, 1000);
        if (r < 0 && errno != EINTR) break;
        if (r <= 0 || !(pf[0].revents & POLLIN)) continue;
        int fd = -1;
        char msg[KVS_MSG_MAX];
        if (netio_accept(s->listen_fd, netio_deadline_ms(0), &fd, msg, sizeof(msg)) != KVS_OK) continue;
        char addr[INET6_ADDRSTRLEN] = "?", peer[64] = "?";
        peer_address(fd, addr, peer);
        pthread_mutex_lock(&s->mu);
        bool full = s->n_conns >= s->p.max_conns;
        int same = 0;
        for (srv_conn *o = s->conns; o && !full; o = o->next) same += !strcmp(o->addr, addr);
        bool addr_full = !full && s->p.max_conns_per_addr > 0 && same >= s->p.max_conns_per_addr;
        if (full || addr_full) s->c_rejected_conns++;
        if (addr_full) s->c_refused_addr++;
        pthread_mutex_unlock(&s->mu);
        if (full || addr_full) {
            srv_logf(s, "connection from %s refused: %s", peer,
                     full ? "all --max-conns slots open" : "--max-conns-per-addr reached for its address");
            refuse_conn(s, fd, full ? "the shard has no free connection slot" : "too many connections from this address");
            continue;
        }
        srv_conn *c = calloc(1, sizeof(*c));
        if (!c) {
            close(fd);
            continue;
        }
        c->s = s;
        c->fd = fd;
        pthread_mutex_init(&c->write_lock, NULL);
        pthread_cond_init(&c->write_cv, NULL);
        atomic_init(&c->refs, 1);
        atomic_init(&c->closed, false);
        atomic_init(&c->inflight, 0);
        snprintf(c->addr, sizeof c->addr, "%s", addr);
        snprintf(c->peer, sizeof c->peer, "%s", peer);
        pthread_mutex_lock(&s->mu);
        c->id = ++s->next_conn_id;
        c->next = s->conns;
        s->conns = c;
        s->n_conns++;
        s->c_conns_total++;
        pthread_mutex_unlock(&s->mu);
        srv_logf(s, "conn %u (%s): open", c->id, c->peer);
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&c->writer, NULL, conn_writer, c) != 0) {
            atomic_store(&c->closed, true);
            c->writer_gone = true;
            conn_unref(c);
        } else if (pthread_create(&c->thread, &attr, conn_main, c) != 0) {
            atomic_store(&c->closed, true);
            pthread_mutex_lock(&c->write_lock);
            c->writer_stop = true;
            pthread_cond_signal(&c->write_cv);
            pthread_mutex_unlock(&c->write_lock);
            pthread_join(c->writer, NULL);
            conn_unref(c);
        }
        pthread_attr_destroy(&attr);
    }
    srv_logf(s, "shutting down");
    /* Wake every reader; each cancels its work and drops its reference. */
    pthread_mutex_lock(&s->mu);
    for (srv_conn *c = s->conns; c; c = c->next) {
        atomic_store(&c->closed, true);
        shutdown(c->fd, SHUT_RDWR);
    }
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->sched_thread, NULL);
    relay_stop(s->relay); /* fails pushes still queued, so their connection refs go */
    /* Bounded wait for the detached readers to let go of their connections. */
    for (int i = 0; i < 500; i++) {
        pthread_mutex_lock(&s->mu);
        int n = s->n_conns;
        pthread_mutex_unlock(&s->mu);
        if (n == 0) break;
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    kv_get_stats(s->e->kv, &ks);
    srv_logf(s, "stopped: %llu requests in %llu forward passes (%.2f per pass), %llu sessions live, %llu evicted (lru %llu, ttl %llu)",
             (unsigned long long)s->c_requests, (unsigned long long)s->c_batches,
             s->c_batches ? (double)s->c_batch_items / (double)s->c_batches : 0.0, (unsigned long long)ks.sessions,
             (unsigned long long)(ks.evict_lru + ks.evict_ttl), (unsigned long long)ks.evict_lru,
             (unsigned long long)ks.evict_ttl);
    return KVS_OK;
}

void srv_free(srv *s) {
    if (!s) return;
    if (s->listen_fd >= 0) close(s->listen_fd);
    if (s->stop_pipe[0] >= 0) close(s->stop_pipe[0]);
    if (s->stop_pipe[1] >= 0) close(s->stop_pipe[1]);
    relay_destroy(s->relay);
    engine_close(s->e);
    tls_ctx_free(s->tls);
    tls_ctx_free(s->relay_tls); /* after relay_destroy: its links were detached */
    if (s->tokens) sodium_memzero(s->tokens, (size_t)s->n_tokens * sizeof *s->tokens);
    free(s->tokens);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}
