#include "shard_metrics.h"

#include <microhttpd.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "netio.h"
#include "server.h"
#include "prom.h"
#include "util.h"
#include "wire.h"

static const double size_bounds[] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};
static const double time_bounds[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5};
#define N_SIZE ((int)(sizeof size_bounds / sizeof size_bounds[0]))
#define N_TIME ((int)(sizeof time_bounds / sizeof time_bounds[0]))

struct shard_metrics {
    pthread_mutex_t mu;
    prom_hist batch_requests, batch_rows, batch_seconds;
    struct MHD_Daemon *d;
    uint16_t port;
    srv *shard;
    bool allow_remote; /* a non-loopback listen address is accepted */
};

int shard_metrics_create(shard_metrics **out) {
    *out = calloc(1, sizeof **out);
    if (!*out) return KVS_ERR_NOMEM;
    pthread_mutex_init(&(*out)->mu, NULL);
    return KVS_OK;
}

void shard_metrics_on_batch(void *p, int n_items, uint32_t n_rows, uint64_t elapsed_ns) {
    shard_metrics *m = p;
    pthread_mutex_lock(&m->mu);
    prom_observe(&m->batch_requests, size_bounds, N_SIZE, n_items);
    prom_observe(&m->batch_rows, size_bounds, N_SIZE, n_rows);
    prom_observe(&m->batch_seconds, time_bounds, N_TIME, (double)elapsed_ns / 1e9);
    pthread_mutex_unlock(&m->mu);
}

static uint64_t stat_of(const struct wire_stats_reply *st, const char *name) {
    for (uint32_t i = 0; i < st->n_stats; i++)
        if (!strcmp(st->stats[i].name, name)) return st->stats[i].value;
    return 0;
}

static char *render(shard_metrics *m) {
    struct wire_stats_reply *st = calloc(1, sizeof *st);
    if (!st) return NULL;
    srv_stats(m->shard, st);
    prom_buf b = {0};
    static const struct { const char *stat, *name, *type, *help; } map[] = {
        {"kv.bytes_used", "kvshard_shard_kv_bytes_used", "gauge", "Bytes of KV blocks in use."},
        {"kv.budget_bytes", "kvshard_shard_kv_budget_bytes", "gauge", "KV pool size in bytes."},
        {"kv.blocks_total", "kvshard_shard_kv_blocks", "gauge", "KV blocks in the pool."},
        {"kv.blocks_free", "kvshard_shard_kv_blocks_free", "gauge", "Free KV blocks."},
        {"kv.sessions", "kvshard_shard_sessions", "gauge", "Live sessions."},
        {"kv.hits", "kvshard_shard_kv_hits_total", "counter", "Appends that found their session state."},
        {"kv.misses", "kvshard_shard_kv_misses_total", "counter", "CACHE_MISS replies."},
        {"kv.stale", "kvshard_shard_kv_stale_total", "counter", "STALE_EPOCH replies."},
        {"kv.releases", "kvshard_shard_kv_releases_total", "counter", "Sessions released by clients."},
        {"kv.rewinds", "kvshard_shard_kv_rewinds_total", "counter", "Appends that rewound a session."},
        {"kv.cancellations", "kvshard_shard_kv_cancellations_total", "counter", "Appends rolled back by cancel."},
        {"kv.inherits", "kvshard_shard_kv_inherits_total", "counter", "Sessions moved to a newer epoch."},
        {"kv.prefix_hits", "kvshard_shard_kv_prefix_hits_total", "counter", "New sessions that took shared prefix blocks."},
        {"kv.prefix_positions", "kvshard_shard_kv_prefix_positions_total", "counter", "Positions taken from shared prefix blocks, not computed."},
        {"kv.cached_bytes", "kvshard_shard_kv_prefix_cached_bytes", "gauge", "Bytes of prefix blocks no session holds (evicted first)."},
        {"srv.requests", "kvshard_shard_requests_total", "counter", "FORWARD requests."},
        {"srv.forward_rows", "kvshard_shard_forward_rows_total", "counter", "Rows computed."},
        {"srv.batches", "kvshard_shard_batches_total", "counter", "Forward passes."},
        {"srv.connections_open", "kvshard_shard_connections", "gauge", "Open connections."},
        {"srv.connections_rejected", "kvshard_shard_connections_rejected_total", "counter", "Connections refused."},
        {"srv.protocol_errors", "kvshard_shard_protocol_errors_total", "counter", "Malformed frames."},
    };
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++) {
        prom_family(&b, map[i].name, map[i].type, map[i].help);
        prom_printf(&b, "%s %llu\n", map[i].name, (unsigned long long)stat_of(st, map[i].stat));
    }
    prom_family(&b, "kvshard_shard_kv_evictions_total", "counter", "Sessions evicted, by cause.");
    prom_printf(&b, "kvshard_shard_kv_evictions_total{cause=\"ttl\"} %llu\n",
                (unsigned long long)stat_of(st, "kv.evict_ttl"));
    prom_printf(&b, "kvshard_shard_kv_evictions_total{cause=\"lru\"} %llu\n",
                (unsigned long long)stat_of(st, "kv.evict_lru"));
    free(st);
    pthread_mutex_lock(&m->mu);
    prom_hist req = m->batch_requests, rows = m->batch_rows, secs = m->batch_seconds;
    pthread_mutex_unlock(&m->mu);
    prom_histogram(&b, "kvshard_shard_batch_requests", "Requests per forward pass.", &req, size_bounds, N_SIZE);
    prom_histogram(&b, "kvshard_shard_batch_rows", "Rows (positions) per forward pass.", &rows, size_bounds, N_SIZE);
    prom_histogram(&b, "kvshard_shard_forward_seconds", "Duration of a forward pass.", &secs, time_bounds, N_TIME);
    return prom_take(&b);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    (void)version;
    (void)upload;
    (void)upload_size;
    if (!*con_cls) { /* first call: headers only */
        *con_cls = (void *)1;
        return MHD_YES;
    }
    shard_metrics *m = cls;
    char *body = NULL;
    unsigned status = 200;
    const char *type = "text/plain; version=0.0.4; charset=utf-8";
    if (strcmp(method, "GET") || strcmp(url, "/metrics")) {
        status = 404;
        type = "text/plain";
        body = strdup("only GET /metrics\n");
    } else {
        body = render(m);
    }
    if (!body) return MHD_NO;
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    enum MHD_Result ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

void shard_metrics_allow_remote(shard_metrics *m, bool allow) { m->allow_remote = allow; }

int shard_metrics_listen(shard_metrics *m, const char *listen, srv *shard, char *msg, size_t cap) {
    char host[NETIO_HOST_MAX];
    uint16_t port = 0;
    if (!listen || netio_parse_hostport(listen, host, sizeof host, &port) != KVS_OK)
        return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "--metrics-listen wants HOST:PORT");
    if (!m->allow_remote && !netio_host_is_loopback(host))
        return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG,
                        "--metrics-listen %.100s: metrics are plaintext HTTP without authentication; give a "
                        "loopback address (scrape through a proxy or tunnel) or --insecure",
                        listen);
    int fd = -1;
    int err = netio_listen(host, port, 16, &fd, &m->port, msg, cap);
    if (err) return err;
    m->shard = shard;
    m->d = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD, 0, NULL, NULL, on_request, m, MHD_OPTION_LISTEN_SOCKET, fd,
                            MHD_OPTION_CONNECTION_LIMIT, 16u, MHD_OPTION_CONNECTION_TIMEOUT, 30u, MHD_OPTION_END);
    if (!m->d) {
        close(fd);
        m->port = 0;
        return kvs_fail(msg, cap, KVS_ERR_IO, "cannot serve metrics on %.100s", listen);
    }
    return KVS_OK;
}

uint16_t shard_metrics_port(const shard_metrics *m) { return m ? m->port : 0; }

void shard_metrics_free(shard_metrics *m) {
    if (!m) return;
    if (m->d) MHD_stop_daemon(m->d);
    pthread_mutex_destroy(&m->mu);
    free(m);
}
