/*
 * cluster_reg — a shard's registration in etcd: one thread that holds a lease and keeps the
 * shard's entry under it (docs/cluster.md).
 *
 * The thread grants a lease (ttl_s), puts the entry, renews the lease every renew_ms and rewrites
 * the entry with fresh figures (fill) every update_ms. When etcd is unreachable it logs once and
 * retries every renew_ms; the shard keeps serving meanwhile. When the lease turns out to be gone
 * (etcd restarted or the shard was unreachable past the TTL) it grants a new one and puts the
 * entry again. cl_reg_stop deletes the entry and revokes the lease (a clean shutdown).
 */
#ifndef KVS_CLUSTER_REG_H
#define KVS_CLUSTER_REG_H

#include "etcd.h"
#include "log.h"
#include "registry.h"

typedef struct cl_reg cl_reg;

typedef struct {
    etcd_params etcd;
    const char *prefix;       /* NULL: CL_DEFAULT_PREFIX */
    int ttl_s;                /* lease TTL (default 10) */
    int renew_ms;             /* keepalive period (default ttl / 3, at most 3000) */
    int update_ms;            /* entry rewrite period (default 3000) */
    /* Refreshes the live figures of e (sessions, KV used, load, state); called on the thread. */
    void (*fill)(void *ctx, cl_entry *e);
    void *fill_ctx;
    kvs_log_fn log;
    void *log_ctx;
} cl_reg_params;

/* Starts the thread with entry e (copied). Fails only on bad parameters or no memory: an
 * unreachable etcd is retried on the thread. */
int cl_reg_start(const cl_reg_params *p, const cl_entry *e, cl_reg **out, char *msg, size_t cap);
/* Stops the thread, deletes the entry and revokes the lease (each bounded by the etcd timeout). */
void cl_reg_stop(cl_reg *r);

#endif /* KVS_CLUSTER_REG_H */
