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
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "digest.h"
#include "engine.h"
#include "netio.h"
#include "quant.h"
#include "util.h"
#include "wire.h"

typedef struct srv_conn srv_conn;
typedef struct srv_job srv_job;

enum job_state { JOB_QUEUED, JOB_RUNNING, JOB_DONE };

/* One FORWARD request. Owned by the scheduler's list while queued/running;
 * holds a reference on its connection. */
struct srv_job {
    srv_conn *conn;
    uint64_t request_id;
    kv_sid sid;
    uint64_t epoch;
    uint32_t start_pos, n;
    bool inherit;
    kv_inherit inh;
    int32_t *tokens;        /* n ids (head shard) */
    float *hidden;          /* n x n_embd (other shards) */
    bool reply_f16;         /* hidden reply in f16 (the request came in f16) */
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
    srv_job *next;          /* scheduler list */
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
    atomic_int refs;        /* reader + jobs */
    atomic_bool closed;
    srv_conn *next;         /* server's list */
    unsigned long requests;
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
    /* scheduler */
    pthread_t sched_thread;
    pthread_mutex_t mu;     /* guards jobs, conns, counters below */
    pthread_cond_t cv;
    srv_job *jobs, *jobs_tail;
    srv_conn *conns;
    int n_conns;
    unsigned next_conn_id;
    /* counters */
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
    bool over = c->out_bytes + len > c->s->p.max_queued_bytes;
    size_t queued = c->out_bytes;
    if (!over) {
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
    free(j->tokens);
    free(j->hidden);
    free(j->out);
    free(j->scratch);
    free(j);
}

static void send_forward_reply(srv_job *j) {
    struct wire_forward_reply m;
    memset(&m, 0, sizeof(m));
    m.st.status = j->status;
    m.st.have = j->reply.have;
    m.st.live_epoch = j->reply.live_epoch;
    m.st.n_past = j->reply.n_past;
    m.out_kind = WIRE_OUTK_NONE;
    void *f16 = NULL;
    if (j->status == KVS_OK) {
        m.n_rows = j->out_rows;
        m.n_cols = j->out_cols;
        if (j->out_mode == FWD_OUT_HIDDEN && j->reply_f16) {
            size_t n = (size_t)j->out_rows * j->out_cols;
            f16 = malloc(n * sizeof(uint16_t));
            if (!f16) {
                m.st.status = KVS_ERR_NOMEM;
                m.n_rows = m.n_cols = 0;
            } else {
                quant_f32_to_f16_row(j->out, f16, (int64_t)n);
                m.out_kind = WIRE_OUTK_HIDDEN_F16;
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
}

/* Finishes the jobs on `done` (reply, release the connection reference). Called without s->mu. */
static void finish_jobs(srv_job *done) {
    while (done) {
        srv_job *next = done->next;
        srv_conn *c = done->conn;
        send_forward_reply(done);
        job_free(done);
        conn_unref(c);
        done = next;
    }
}

static void *sched_main(void *arg) {
    srv *s = arg;
    engine *e = s->e;
    const model *m = e->m;
    size_t d = m->hp.n_embd;
    int max_batch = s->p.max_batch > 0 ? s->p.max_batch : 1;
    fwd_item *items = calloc((size_t)max_batch, sizeof(fwd_item));
    srv_job **batch = calloc((size_t)max_batch, sizeof(srv_job *));
    uint64_t last_sweep = kvs_now_ns();
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
        uint32_t prefill_budget = s->p.prefill_chunk ? s->p.prefill_chunk : 64;
        /* Admit, cancel, and pick work in arrival order. */
        for (srv_job *j = s->jobs, *next; j; j = next) {
            next = j->next;
            if (atomic_load(&j->cancel)) {
                if (j->state == JOB_RUNNING) kv_abort(e->kv, j->txn, true);
                kv_lookup(e->kv, &j->sid, &j->reply.live_epoch, &j->reply.n_past);
                j->status = KVS_ERR_CANCELLED;
                jobs_remove(s, j);
                j->next = done;
                done = j;
                continue;
            }
            if (j->state == JOB_QUEUED) {
                j->status = kv_begin(e->kv, &j->sid, j->epoch, j->start_pos, j->n, j->inherit ? &j->inh : NULL,
                                     &j->txn, &j->reply);
                /* The pool is full of sessions pinned by this batch: wait for them to finish
                 * rather than fail, unless nothing is running that could free blocks. */
                if (j->status == KVS_ERR_BUDGET_EXHAUSTED && n_items > 0) continue;
                if (j->status) {
                    jobs_remove(s, j);
                    j->next = done;
                    done = j;
                    continue;
                }
                j->state = JOB_RUNNING;
            }
            if (n_items >= max_batch) continue;
            uint32_t left = j->n - j->done, take = left;
            if (left > 1) { /* prefill: share the chunk budget; at least one row when the budget is gone */
                if (prefill_budget == 0) continue;
                if (take > prefill_budget) take = prefill_budget;
                prefill_budget -= take;
            }
            fwd_item *it = &items[n_items];
            memset(it, 0, sizeof(*it));
            it->txn = j->txn;
            it->pos0 = j->start_pos + j->done;
            it->n = take;
            if (m->has_embd) it->tokens = j->tokens + j->done;
            else it->hidden = j->hidden + (size_t)j->done * d;
            bool last_chunk = j->done + take == j->n;
            if (j->out_mode == FWD_OUT_LOGITS_LAST) {
                it->out_mode = last_chunk ? FWD_OUT_LOGITS_LAST : FWD_OUT_HIDDEN;
                it->out = last_chunk ? j->out : j->scratch;
            } else {
                it->out_mode = j->out_mode;
                it->out = j->out + (size_t)j->done * j->out_cols;
            }
            batch[n_items++] = j;
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
                if (st == KVS_OK) {
                    j->done += items[i].n;
                    s->c_forward_rows += items[i].n;
                    if (j->done < j->n) continue;
                    kv_commit(e->kv, j->txn, &j->reply);
                } else {
                    kv_abort(e->kv, j->txn, st == KVS_ERR_CANCELLED);
                    kv_lookup(e->kv, &j->sid, NULL, &j->reply.n_past);
                }
                j->status = st;
                j->state = JOB_DONE;
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
    pthread_mutex_lock(&s->mu);
    srv_conn **pp = &s->conns;
    while (*pp && *pp != c) pp = &(*pp)->next;
    if (*pp) *pp = c->next;
    s->n_conns--;
    pthread_mutex_unlock(&s->mu);
    close(c->fd);
    out_free_all(c->out_head); /* replies queued after the writer stopped */
    pthread_mutex_destroy(&c->write_lock);
    pthread_cond_destroy(&c->write_cv);
    free(c);
}

static int handle_forward(srv_conn *c, uint64_t rid, const uint8_t *payload, size_t len) {
    srv *s = c->s;
    const model *m = s->e->m;
    struct wire_forward f;
    char msg[KVS_MSG_MAX] = "";
    int err = wire_decode_forward(payload, len, &f, msg, sizeof(msg));
    if (err) {
        s->c_protocol_errors++;
        send_status(c, rid, KVS_ERR_PROTOCOL, NULL, msg);
        return KVS_OK;
    }
    struct wire_forward_reply bad;
    memset(&bad, 0, sizeof(bad));
    bad.st.status = KVS_OK;
    const char *why = NULL;
    bool tokens_in = f.in_kind == WIRE_IN_TOKENS;
    if (tokens_in != m->has_embd) {
        bad.st.status = KVS_ERR_INVALID_ARG;
        why = m->has_embd ? "this shard owns layer 0 and takes token ids" : "this shard takes hidden states";
    } else if (!tokens_in && f.n_embd != m->hp.n_embd) {
        bad.st.status = KVS_ERR_INVALID_ARG;
        why = "hidden width does not match n_embd";
    } else if (f.out_mode != WIRE_OUT_HIDDEN && !m->has_head) {
        bad.st.status = KVS_ERR_INVALID_ARG;
        why = "logits requested from a shard without the output head";
    } else if (f.n_tokens > s->p.max_tokens) {
        bad.st.status = KVS_ERR_TOO_LARGE;
        why = "more rows than max_tokens";
    } /* positions past the context: kv_begin answers CONTEXT_FULL */
    uint32_t rows = f.out_mode == WIRE_OUT_LOGITS_LAST ? 1 : f.n_tokens;
    uint32_t cols = f.out_mode == WIRE_OUT_HIDDEN ? m->hp.n_embd : m->hp.n_vocab;
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
            if (f.out_mode == WIRE_OUT_LOGITS_LAST && f.n_tokens > 1) j->scratch = malloc((size_t)f.n_tokens * d * sizeof(float));
            if ((!j->tokens && !j->hidden) || !j->out || (f.out_mode == WIRE_OUT_LOGITS_LAST && f.n_tokens > 1 && !j->scratch)) {
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
        if (wire_encode_forward_reply(&bad, buf, sizeof(buf), &l) == KVS_OK) conn_send(c, WIRE_OP_FORWARD_REPLY, rid, buf, l);
        return KVS_OK;
    }
    j->conn = c;
    j->request_id = rid;
    memcpy(j->sid.bytes, f.session_id, 16);
    j->epoch = f.epoch;
    j->start_pos = f.start_pos;
    j->n = f.n_tokens;
    j->inherit = (f.flags & WIRE_FWD_INHERIT) != 0;
    j->inh.old_epoch = f.inherit_epoch;
    j->inh.len = f.inherit_len;
    j->reply_f16 = f.in_kind == WIRE_IN_HIDDEN_F16;
    j->out_mode = f.out_mode == WIRE_OUT_HIDDEN ? FWD_OUT_HIDDEN
                  : f.out_mode == WIRE_OUT_LOGITS_ALL ? FWD_OUT_LOGITS_ALL : FWD_OUT_LOGITS_LAST;
    j->out_rows = rows;
    j->out_cols = cols;
    j->state = JOB_QUEUED;
    atomic_init(&j->cancel, false);
    atomic_fetch_add(&c->refs, 1);
    pthread_mutex_lock(&s->mu);
    if (s->jobs_tail) s->jobs_tail->next = j;
    else s->jobs = j;
    s->jobs_tail = j;
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

static void handle_stats(srv_conn *c, uint64_t rid) {
    srv *s = c->s;
    kv_stats k;
    kv_get_stats(s->e->kv, &k);
    struct wire_stats_reply *m = calloc(1, sizeof(*m));
    if (!m) return;
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
        {"srv.connections_total", s->c_conns_total}, {"srv.connections_open", (uint64_t)s->n_conns},
        {"srv.connections_rejected", s->c_rejected_conns}, {"srv.requests", s->c_requests},
        {"srv.forward_rows", s->c_forward_rows}, {"srv.batches", s->c_batches},
        {"srv.batch_items", s->c_batch_items}, {"srv.protocol_errors", s->c_protocol_errors},
    };
    pthread_mutex_unlock(&s->mu);
    size_t n = sizeof(list) / sizeof(list[0]);
    for (size_t i = 0; i < n; i++) {
        snprintf(m->stats[i].name, sizeof(m->stats[i].name), "%s", list[i].name);
        m->stats[i].value = list[i].v;
    }
    m->n_stats = (uint32_t)n;
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
    if (!v) {
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
    memcpy(r.tok_model, "llama", 5);
    r.tok_model_len = 5;
    r.tokens = toks;
    size_t len = 0;
    uint8_t *buf = NULL;
    int err = wire_encode_vocab_reply(&r, NULL, 0, &len);
    if (!err && (buf = malloc(len))) err = wire_encode_vocab_reply(&r, buf, len, &len);
    if (!err && buf) conn_send(c, WIRE_OP_VOCAB_REPLY, rid, buf, len);
    free(buf);
    free(toks);
}

static void send_info(srv_conn *c, uint64_t rid, int status) {
    srv *s = c->s;
    const model *m = s->e->m;
    struct wire_info in;
    memset(&in, 0, sizeof(in));
    in.st.status = status;
    if (status == KVS_OK) {
        in.version = WIRE_VERSION;
        in.hidden_dtypes = WIRE_DTYPE_F32 | WIRE_DTYPE_F16;
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

/* TRUNCATE and RELEASE: decoded, applied to the hot state, answered with STATUS
 * (PROTOCOL with the decoder's message when the payload does not decode). */
static void handle_truncate_release(srv_conn *c, const struct wire_header *h, const uint8_t *payload, size_t len) {
    char msg[KVS_MSG_MAX] = "";
    kv_state *kv = c->s->e->kv;
    kv_sid sid;
    kv_reply r = {0};
    int err;
    if (h->op == WIRE_OP_TRUNCATE) {
        struct wire_truncate t;
        if (!(err = wire_decode_truncate(payload, len, &t, msg, sizeof(msg)))) {
            memcpy(sid.bytes, t.session_id, 16);
            err = kv_truncate(kv, &sid, t.epoch, t.len, &r);
        }
    } else {
        struct wire_release t;
        if (!(err = wire_decode_release(payload, len, &t, msg, sizeof(msg)))) {
            memcpy(sid.bytes, t.session_id, 16);
            err = kv_release(kv, &sid, t.epoch, &r);
        }
    }
    if (msg[0]) err = KVS_ERR_PROTOCOL; /* only the decoders write msg */
    send_status(c, h->request_id, err, &r, msg[0] ? msg : NULL);
}

static void *conn_main(void *arg) {
    srv_conn *c = arg;
    srv *s = c->s;
    struct netio_buf buf = {0};
    struct wire_header h;
    char msg[KVS_MSG_MAX] = "";
    int err = netio_recv_frame(c->fd, &h, &buf, netio_deadline_ms(s->p.hello_timeout_ms), msg, sizeof(msg));
    struct wire_hello hello;
    if (err == KVS_OK && h.op == WIRE_OP_HELLO && wire_decode_hello(buf.data, buf.len, &hello, msg, sizeof(msg)) == KVS_OK &&
        hello.min_version <= WIRE_VERSION && hello.max_version >= WIRE_VERSION) {
        send_info(c, h.request_id, KVS_OK);
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
        err = netio_recv_frame(c->fd, &h, &buf, netio_deadline_ms(s->p.idle_timeout_ms), msg, sizeof(msg));
        if (err) {
            if (err == KVS_ERR_PROTOCOL || err == KVS_ERR_UNSUPPORTED || err == KVS_ERR_TOO_LARGE) {
                send_status(c, h.request_id, err, NULL, msg);
                pthread_mutex_lock(&s->mu);
                s->c_protocol_errors++;
                pthread_mutex_unlock(&s->mu);
                srv_logf(s, "conn %u (%s): bad frame (%s), closing", c->id, c->peer, msg);
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
        default:
            send_status(c, h.request_id, KVS_ERR_PROTOCOL, NULL, "op not valid from a client after HELLO");
            pthread_mutex_lock(&s->mu);
            s->c_protocol_errors++;
            pthread_mutex_unlock(&s->mu);
            break;
        }
    }
out:
    {
        int n = cancel_jobs(c, true, 0);
        /* Let the writer flush what is queued (an error reply before closing), then stop it. */
        pthread_mutex_lock(&c->write_lock);
        c->writer_stop = true;
        pthread_cond_signal(&c->write_cv);
        pthread_mutex_unlock(&c->write_lock);
        pthread_join(c->writer, NULL);
        atomic_store(&c->closed, true);
        shutdown(c->fd, SHUT_RDWR);
        srv_logf(s, "conn %u (%s): closed after %lu request(s)%s", c->id, c->peer, c->requests,
                 n ? ", cancelled its work in flight" : "");
    }
    netio_buf_free(&buf);
    conn_unref(c);
    return NULL;
}

/* ---- lifecycle ---------------------------------------------------------------- */

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
    engine_params ep = engine_default_params();
    ep.model_path = p->model_path;
    ep.first = p->first;
    ep.last = p->last;
    ep.n_threads = p->n_threads;
    ep.kv.budget_bytes = p->kv_budget_bytes;
    ep.kv.ttl_ns = p->kv_ttl_ms * 1000000ull;
    ep.kv.max_sessions = p->max_sessions;
    ep.kv.kv_type = (uint32_t)p->kv_type;
    if ((err = engine_open(&ep, &s->e, msg, cap))) goto fail;
    srv_logf(s, "loaded %s layers [%u, %u) of %u: %.1f MiB of weights", p->model_path, s->e->m->first, s->e->m->last,
             s->e->m->hp.n_layer, (double)s->e->m->weight_bytes / (1 << 20));
    srv_logf(s, "hashing the model file for its digest");
    if ((err = digest_file_sha256(p->model_path, s->digest))) {
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
        pthread_mutex_lock(&s->mu);
        bool full = s->n_conns >= s->p.max_conns;
        if (full) s->c_rejected_conns++;
        pthread_mutex_unlock(&s->mu);
        if (full) {
            srv_logf(s, "connection refused: %d open (--max-conns)", s->p.max_conns);
            close(fd);
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
        struct sockaddr_storage ss;
        socklen_t sl = sizeof(ss);
        snprintf(c->peer, sizeof(c->peer), "?");
        if (getpeername(fd, (struct sockaddr *)&ss, &sl) == 0 && ss.ss_family == AF_INET) {
            const uint8_t *a = (const uint8_t *)&((struct sockaddr_in *)&ss)->sin_addr;
            snprintf(c->peer, sizeof(c->peer), "%u.%u.%u.%u:%u", a[0], a[1], a[2], a[3],
                     (unsigned)__builtin_bswap16(((struct sockaddr_in *)&ss)->sin_port));
        }
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
    engine_close(s->e);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}
