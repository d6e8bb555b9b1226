/*
 * http_drain — the graceful stop of `kvshard api` (http_drain in http.h): a count of running
 * generations, the flag that refuses new requests, and the one that cuts the running ones.
 *
 * A generation enters (http_drain_enter) before it takes a lane and leaves when libmicrohttpd
 * reports its request complete (http.c on_completed): the reply's bytes are out then, where a
 * queued reply is not yet sent and http_stop after the drain would cut it. The waiter sleeps on
 * the condition variable in slices so that the hurry flag, which a signal handler sets, is
 * seen within a slice.
 */
#include <time.h>

#include "http_impl.h"
#include "util.h"

void http_drain_init(http_drain_state *d) {
    atomic_init(&d->active, 0);
    atomic_init(&d->draining, false);
    atomic_init(&d->cut, false);
    pthread_mutex_init(&d->mu, NULL);
    pthread_cond_init(&d->cv, NULL);
}

void http_drain_destroy(http_drain_state *d) {
    pthread_mutex_destroy(&d->mu);
    pthread_cond_destroy(&d->cv);
}

bool http_drain_enter(http_drain_state *d) {
    pthread_mutex_lock(&d->mu);
    bool ok = !atomic_load(&d->draining);
    if (ok) atomic_fetch_add(&d->active, 1);
    pthread_mutex_unlock(&d->mu);
    return ok;
}

void http_drain_leave(http_drain_state *d) {
    pthread_mutex_lock(&d->mu);
    atomic_fetch_sub(&d->active, 1);
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
}

bool http_drain_cutting(const http_drain_state *d) { return atomic_load(&d->cut); }
bool http_drain_draining(const http_drain_state *d) { return atomic_load(&d->draining); }

void http_drain_begin(http_drain_state *d, bool cut_now) {
    pthread_mutex_lock(&d->mu);
    if (cut_now) {
        d->n_cut = atomic_load(&d->active);
        atomic_store(&d->cut, true);
    }
    atomic_store(&d->draining, true);
    pthread_mutex_unlock(&d->mu);
}

int http_drain_wait(http_drain_state *d, int64_t deadline_ms, int64_t cut_grace_ms, volatile sig_atomic_t *hurry) {
    pthread_mutex_lock(&d->mu);
    /* Cut already (http_drain_begin): the grace is all that is left to wait. */
    int64_t first = atomic_load(&d->cut) ? cut_grace_ms : deadline_ms > 0 ? deadline_ms : 0;
    uint64_t until = kvs_now_ns() + (uint64_t)first * 1000000ull;
    for (;;) {
        if (atomic_load(&d->active) == 0) break;
        uint64_t now = kvs_now_ns();
        if (!atomic_load(&d->cut) && (now >= until || (hurry && *hurry))) {
            d->n_cut = atomic_load(&d->active);
            atomic_store(&d->cut, true); /* each ends at its next step (http.c) */
            until = now + (uint64_t)cut_grace_ms * 1000000ull;
        } else if (atomic_load(&d->cut) && now >= until) {
            break; /* a step that never returns: http_stop closes its connection */
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 50 * 1000000L; /* a slice: *hurry is seen within it */
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        (void)pthread_cond_timedwait(&d->cv, &d->mu, &ts);
    }
    int n = d->n_cut;
    pthread_mutex_unlock(&d->mu);
    return n;
}
