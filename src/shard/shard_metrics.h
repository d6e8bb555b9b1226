/*
 * shard_metrics — `kvshard serve --metrics-listen HOST:PORT`: GET /metrics of a shard in the
 * Prometheus text format. Counters and gauges (KV bytes used / budget, blocks, sessions, hits,
 * misses, stale epochs, evictions by cause, releases, cancellations, requests, rows, batches,
 * connections) are read at each scrape from the server in-process (srv_stats, the counters the
 * STATS op answers), so the figures are exactly the ones `kvshard stats` shows; forward-pass batch sizes (requests, rows)
 * and durations are histograms fed by srv_params.batch_done.
 */
#ifndef KVS_SHARD_METRICS_H
#define KVS_SHARD_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct shard_metrics shard_metrics;

/* A collector with empty histograms; nothing served yet. KVS_OK or KVS_ERR_NOMEM (*out NULL). */
int shard_metrics_create(shard_metrics **out);

/* srv_params.batch_done: one forward pass of n_items requests and n_rows rows took elapsed_ns.
 * Thread-safe. */
void shard_metrics_on_batch(void *m, int n_items, uint32_t n_rows, uint64_t elapsed_ns);

/* The metrics port is plaintext HTTP without authentication: by default only a loopback
 * address is accepted (a scraper elsewhere goes through a proxy or an SSH tunnel). allow: any
 * address (`serve --insecure`). */
void shard_metrics_allow_remote(shard_metrics *m, bool allow);

/* Starts serving GET /metrics on listen ("HOST:PORT", port 0 picks one), reading the counters
 * of shard (which must outlive m). KVS_OK; KVS_ERR_INVALID_ARG (bad address, or not loopback
 * without shard_metrics_allow_remote), KVS_ERR_IO (bind failed) with msg. */
typedef struct srv srv;
int shard_metrics_listen(shard_metrics *m, const char *listen, srv *shard, char *msg, size_t cap);

/* The metrics port (0 before shard_metrics_listen). */
uint16_t shard_metrics_port(const shard_metrics *m);

/* Stops serving and frees; NULL is fine. */
void shard_metrics_free(shard_metrics *m);

#endif /* KVS_SHARD_METRICS_H */
