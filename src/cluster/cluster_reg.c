/* A shard's registration thread (cluster_reg.h). */
#include "cluster_reg.h"

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "util.h"

struct cl_reg {
    cl_reg_params p;
    char prefix[256];
    char key_text[512];
    cl_entry e;
    etcd *db;
    int64_t lease;
    bool down;            /* the last attempt failed: log again only when it recovers */
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop;
};

static uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static int put_entry(cl_reg *r, char *msg, size_t cap) {
    if (r->p.fill) r->p.fill(r->p.fill_ctx, &r->e);
    char *json = cl_entry_encode(&r->e);
    if (!json) return KVS_ERR_NOMEM;
    int err = etcd_put(r->db, r->key_text, json, r->lease, msg, cap);
    free(json);
    return err;
}

/* One renewal: a new lease and entry when there is none, else a keepalive (and the entry when
 * due). Returns KVS_OK or the error of the etcd request that failed. */
static int tick(cl_reg *r, bool update, char *msg, size_t cap) {
    int err;
    if (r->lease) {
        int64_t left = 0;
        if ((err = etcd_lease_keepalive(r->db, r->lease, &left, msg, cap))) {
            r->lease = 0; /* unknown after an error (etcd may come back without it): start over */
            return err;
        }
        if (left <= 0) {
            kvs_logf(r->p.log, r->p.log_ctx, "cluster: lease %llx expired, registering again",
                     (unsigned long long)r->lease);
            r->lease = 0;
        }
    }
    if (!r->lease) {
        if ((err = etcd_lease_grant(r->db, r->p.ttl_s, &r->lease, msg, cap))) return err;
        update = true;
    }
    if (update && (err = put_entry(r, msg, cap))) {
        r->lease = 0; /* a put on an unknown lease fails: start over with a new one */
        return err;
    }
    return KVS_OK;
}

static void *reg_main(void *arg) {
    cl_reg *r = arg;
    uint64_t last_update = 0;
    pthread_mutex_lock(&r->mu);
    while (!r->stop) {
        pthread_mutex_unlock(&r->mu);
        char msg[KVS_MSG_MAX] = "";
        uint64_t t = now_ms();
        bool update = t - last_update >= (uint64_t)r->p.update_ms;
        int err = tick(r, update, msg, sizeof msg);
        if (err && !r->down) kvs_logf(r->p.log, r->p.log_ctx, "cluster: registry unreachable, retrying: %s", msg);
        if (!err && (r->down || last_update == 0))
            kvs_logf(r->p.log, r->p.log_ctx, "cluster: registered %s (lease %llx, ttl %d s)", r->key_text,
                     (unsigned long long)r->lease, r->p.ttl_s);
        r->down = err != KVS_OK;
        if (!err && update) last_update = t;
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        uint64_t ns = (uint64_t)until.tv_nsec + (uint64_t)r->p.renew_ms * 1000000u;
        until.tv_sec += (time_t)(ns / 1000000000u);
        until.tv_nsec = (long)(ns % 1000000000u);
        pthread_mutex_lock(&r->mu);
        while (!r->stop && pthread_cond_timedwait(&r->cv, &r->mu, &until) != ETIMEDOUT) {
        }
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

int cl_reg_start(const cl_reg_params *p, const cl_entry *e, cl_reg **out, char *msg, size_t cap) {
    *out = NULL;
    cl_reg *r = calloc(1, sizeof *r);
    if (!r) return KVS_ERR_NOMEM;
    r->p = *p;
    if (r->p.ttl_s <= 0) r->p.ttl_s = 10;
    if (r->p.renew_ms <= 0) r->p.renew_ms = r->p.ttl_s * 1000 / 3 < 3000 ? r->p.ttl_s * 1000 / 3 : 3000;
    if (r->p.renew_ms < 100) r->p.renew_ms = 100;
    if (r->p.update_ms <= 0) r->p.update_ms = 3000;
    if (r->p.etcd.timeout_ms <= 0) r->p.etcd.timeout_ms = r->p.renew_ms < 2000 ? r->p.renew_ms : 2000;
    snprintf(r->prefix, sizeof r->prefix, "%s", p->prefix ? p->prefix : CL_DEFAULT_PREFIX);
    r->e = *e;
    cl_entry_key(&r->e, r->prefix, r->key_text, sizeof r->key_text);
    int err = etcd_open(&r->p.etcd, &r->db, msg, cap);
    if (err) {
        free(r);
        return err;
    }
    r->p.etcd = (etcd_params){0}; /* the handle keeps its own copies */
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    if (pthread_create(&r->thread, NULL, reg_main, r) != 0) {
        etcd_close(r->db);
        free(r);
        return kvs_fail(msg, cap, KVS_ERR_NOMEM, "cluster: cannot start the registration thread");
    }
    *out = r;
    return KVS_OK;
}

void cl_reg_stop(cl_reg *r) {
    if (!r) return;
    pthread_mutex_lock(&r->mu);
    r->stop = true;
    pthread_cond_signal(&r->cv);
    pthread_mutex_unlock(&r->mu);
    pthread_join(r->thread, NULL);
    char msg[KVS_MSG_MAX] = "";
    if (etcd_delete(r->db, r->key_text, msg, sizeof msg) == KVS_OK)
        kvs_logf(r->p.log, r->p.log_ctx, "cluster: deregistered %s", r->key_text);
    if (r->lease) etcd_lease_revoke(r->db, r->lease, msg, sizeof msg);
    etcd_close(r->db);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r);
}
