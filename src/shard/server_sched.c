/* server_sched.c — the scheduler thread: admission, batched steps, cancellation, replies. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server_impl.h"
#include "util.h"

bool srv_same_sid(const kv_sid *a, const kv_sid *b) { return memcmp(a->bytes, b->bytes, sizeof(a->bytes)) == 0; }

/* Appends j to the scheduler list (s->mu held), ordered after the latest earlier request of its
 * connection on its session. */
void srv_jobs_append(srv *s, srv_job *j) {
    j->after = NULL;
    for (srv_job *e = s->jobs; e; e = e->next)
        if (e->conn == j->conn && srv_same_sid(&e->sid, &j->sid)) j->after = e;
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
        if (done->op == WIRE_OP_FORWARD) srv_send_forward_reply(done);
        else srv_send_status(c, done->request_id, done->status, &done->reply, NULL);
        atomic_fetch_sub(&c->inflight, 1);
        srv_job_free(done);
        srv_conn_unref(c);
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

/* The scheduler's working set for one pass of its loop. */
typedef struct {
    srv *s;
    engine *e;
    int max_batch, per_conn; /* requests per step; admitted requests per connection */
    fwd_item *items;         /* (max_batch) this step's items */
    srv_job **batch;         /* (max_batch) the job of each item */
    int running;             /* jobs in JOB_RUNNING (pinned) */
    uint64_t step;           /* scheduler rounds: admission stamps */
    srv_job *done;           /* removed from s->jobs, to be answered by finish_jobs */
} sched;

static void sched_done(sched *sc, srv_job *j) {
    jobs_remove(sc->s, j);
    j->next = sc->done;
    sc->done = j;
}

/* Cancellations, and TRUNCATE / RELEASE whose turn has come, in arrival order (s->mu held). */
static void sched_reap(sched *sc) {
    kv_state *kv = sc->e->kv;
    for (srv_job *j = sc->s->jobs, *next; j; j = next) {
        next = j->next;
        if (atomic_load(&j->cancel)) {
            if (j->state == JOB_RUNNING) {
                engine_txn_end(sc->e, j->txn, KVS_ERR_CANCELLED, &j->reply);
                j->conn->n_running--;
                sc->running--;
            } else if (j->op == WIRE_OP_FORWARD) {
                kv_note_cancel(kv); /* it never began, but its client is told CANCELLED */
            }
            cancelled_reply(kv, j);
            sched_done(sc, j);
            continue;
        }
        if (j->state == JOB_QUEUED && j->after) continue; /* arrival order on a session (srv_jobs_append) */
        if (j->op != WIRE_OP_FORWARD) {
            j->status = j->op == WIRE_OP_TRUNCATE ? kv_truncate(kv, &j->sid, j->epoch, j->truncate_len, &j->reply)
                                                  : kv_release(kv, &j->sid, j->epoch, &j->reply);
            sched_done(sc, j);
        }
    }
}

/* The queued FORWARD a free slot goes to: the one whose connection has the fewest admitted,
 * then the one served least recently, then arrival order; NULL: none may be admitted now. */
static srv_job *sched_pick(sched *sc) {
    srv_job *pick = NULL;
    for (srv_job *j = sc->s->jobs; j; j = j->next) {
        if (j->state != JOB_QUEUED || j->after || j->op != WIRE_OP_FORWARD || j->skip_step == sc->step) continue;
        if (j->conn->n_running >= sc->per_conn) continue;
        if (!pick || j->conn->n_running < pick->conn->n_running ||
            (j->conn->n_running == pick->conn->n_running && j->conn->last_admit < pick->conn->last_admit))
            pick = j;
    }
    return pick;
}

/* Admission, round-robin over connections (s->mu held): at most max_batch requests are
 * admitted, so every admitted one is in every step; one connection holds at most half of them.
 * So a connection pipelining many requests gets one slot in turn with every other. */
static void sched_admit(sched *sc) {
    sc->step++;
    while (sc->running < sc->max_batch) {
        srv_job *j = sched_pick(sc);
        if (!j) break;
        /* The tenant is the identity the session key was made from (a relayed step: the
         * identity that registered it, j->conn). */
        engine_req r = {.sid = j->sid, .epoch = j->epoch, .start_pos = j->start_pos, .n = j->n,
                        .inherit = j->inherit ? &j->inh : NULL, .prefix = j->prefix.hashes ? &j->prefix : NULL};
        j->status = engine_txn_begin(sc->e, j->conn->tenant, &r, &j->txn, &j->reply);
        bool short_of_room = (j->status == KVS_ERR_BUDGET_EXHAUSTED || j->status == KVS_ERR_BUSY) &&
                             j->reply.pinned_short;
        if (short_of_room && sc->running > 0) {
            /* Short of room that running requests will free: it waits, and later ones are not
             * admitted before it — unless it is short of its own quota: then it waits for its
             * tenant's pins and holds no one else. */
            if (!j->reply.over_quota) break;
            j->skip_step = sc->step;
            continue;
        }
        if (j->status) {
            if (short_of_room && j->status == KVS_ERR_BUSY) kv_note_busy(sc->e->kv); /* the client sees it */
            sched_done(sc, j);
            continue;
        }
        j->state = JOB_RUNNING;
        srv_move_note_owner(sc->s, j);
        j->conn->n_running++;
        j->conn->last_admit = sc->step;
        sc->running++;
    }
}

/* This step's items: every admitted request, its rows cut to its share (s->mu held). */
static int sched_fill(sched *sc) {
    int n_items = 0;
    const model *m = sc->e->m;
    for (srv_job *j = sc->s->jobs; j; j = j->next) {
        if (j->state != JOB_RUNNING || n_items >= sc->max_batch) continue;
        fwd_item *it = &sc->items[n_items];
        memset(it, 0, sizeof(*it));
        it->txn = j->txn;
        it->pos0 = j->start_pos + j->done;
        it->n = j->n - j->done; /* rows: cut to this step's share below */
        sc->batch[n_items++] = j;
    }
    share_prefill_rows(sc->items, sc->batch, n_items, sc->s->p.prefill_chunk ? sc->s->p.prefill_chunk : 64);
    for (int i = 0; i < n_items; i++) {
        srv_job *j = sc->batch[i];
        fwd_item *it = &sc->items[i];
        if (m->has_embd) it->tokens = j->tokens + j->done;
        else it->hidden = j->hidden + (size_t)j->done * m->hp.n_embd;
        bool last_chunk = j->done + it->n == j->n;
        if (j->out_mode == FWD_OUT_LOGITS_LAST) {
            it->out_mode = last_chunk ? FWD_OUT_LOGITS_LAST : FWD_OUT_HIDDEN;
            it->out = last_chunk ? j->out : j->scratch;
        } else {
            it->out_mode = j->out_mode;
            it->out = j->out + (size_t)j->done * j->out_cols;
        }
    }
    return n_items;
}

/* Runs one forward pass over the step's items with s->mu released, then takes the results
 * under it: a finished request commits, a failed one rolls back, and one whose CANCEL was
 * accepted meanwhile answers CANCELLED whatever the pass did (so CANCEL OK always means so). */
static void sched_step(sched *sc, int n_items) {
    srv *s = sc->s;
    s->c_batches++;
    s->c_batch_items += (uint64_t)n_items;
    pthread_mutex_unlock(&s->mu);
    if (s->p.before_batch) s->p.before_batch(s->p.hook_ctx, n_items);
    /* Requests cancelled while the lock was down: flag their transactions. */
    for (int i = 0; i < n_items; i++)
        if (atomic_load(&sc->batch[i]->cancel)) kv_cancel(sc->e->kv, &sc->batch[i]->sid);
    uint64_t t_batch = kvs_now_ns();
    int err = engine_txn_run(sc->e, sc->items, n_items);
    if (s->p.batch_done) {
        uint32_t rows = 0;
        for (int i = 0; i < n_items; i++) rows += sc->items[i].n;
        s->p.batch_done(s->p.batch_ctx, n_items, rows, kvs_now_ns() - t_batch);
    }
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < n_items; i++) {
        srv_job *j = sc->batch[i];
        int st = err ? err : sc->items[i].status;
        if (atomic_load(&j->cancel)) st = KVS_ERR_CANCELLED;
        if (st == KVS_OK) {
            j->done += sc->items[i].n;
            s->c_forward_rows += sc->items[i].n;
            if (j->done < j->n) continue;
        }
        j->status = engine_txn_end(sc->e, j->txn, st, &j->reply);
        if (st == KVS_ERR_CANCELLED) {
            cancelled_reply(sc->e->kv, j);
        } else if (st != KVS_OK) {
            j->reply.n_past = 0; /* stays 0 when the rollback left no session */
            kv_lookup(sc->e->kv, &j->sid, NULL, &j->reply.n_past);
        }
        j->state = JOB_DONE;
        j->conn->n_running--;
        sc->running--;
        sched_done(sc, j);
    }
}

/* Shutting down (s->mu held, released on return): everything still here is cancelled. */
static void sched_shutdown(sched *sc) {
    srv_job *rest = sc->s->jobs;
    sc->s->jobs = sc->s->jobs_tail = NULL;
    for (srv_job *j = rest; j; j = j->next) {
        if (j->state == JOB_RUNNING) engine_txn_end(sc->e, j->txn, KVS_ERR_CANCELLED, &j->reply);
        else if (j->op == WIRE_OP_FORWARD) kv_note_cancel(sc->e->kv);
        j->status = KVS_ERR_CANCELLED;
    }
    pthread_mutex_unlock(&sc->s->mu);
    finish_jobs(rest);
}

void *srv_sched_main(void *arg) {
    srv *s = arg;
    sched sc = {.s = s, .e = s->e, .max_batch = s->p.max_batch > 0 ? s->p.max_batch : 1};
    sc.per_conn = sc.max_batch > 1 ? sc.max_batch / 2 : 1;
    sc.items = calloc((size_t)sc.max_batch, sizeof(fwd_item));
    sc.batch = calloc((size_t)sc.max_batch, sizeof(srv_job *));
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
            int ev = kv_sweep_ttl(sc.e->kv, 64);
            if (ev) kvs_logf(s->p.log, s->p.log_ctx, "ttl: evicted %d idle session(s)", ev);
            last_sweep = kvs_now_ns();
        }
        if (!s->jobs) continue;
        /* Requests that hold pins now: a request short of blocks or of a session slot waits
         * for them (BUDGET_EXHAUSTED only when nothing running could free any). */
        sc.running = 0;
        for (srv_job *j = s->jobs; j; j = j->next) sc.running += j->state == JOB_RUNNING;
        sched_reap(&sc);
        sched_admit(&sc);
        int n_items = sched_fill(&sc);
        if (n_items) sched_step(&sc, n_items);
        if (sc.done) {
            srv_job *done = sc.done;
            sc.done = NULL;
            pthread_mutex_unlock(&s->mu);
            finish_jobs(done);
            pthread_mutex_lock(&s->mu);
        }
    }
    sched_shutdown(&sc);
    free(sc.items);
    free(sc.batch);
    return NULL;
}

/* Flags c's jobs (all of them, or the one with request id rid) for
 * cancellation; returns how many were flagged. */
int srv_cancel_jobs(srv_conn *c, bool all, uint64_t rid) {
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
