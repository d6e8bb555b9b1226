/*
 * prom — writes the Prometheus text exposition format (version 0.0.4) into a growing buffer:
 * counters, gauges and fixed-bucket histograms, each with its # HELP and # TYPE lines. Used by
 * the /metrics of `kvshard api` (http_metrics.c) and of `kvshard serve` (shard_metrics.c).
 */
#ifndef KVS_PROM_H
#define KVS_PROM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    char *s;       /* malloc'd text, NUL-terminated */
    size_t len, cap;
    bool oom;      /* an allocation failed: the text is incomplete */
} prom_buf;

/* A histogram with n_bounds finite upper bounds (ascending); bucket[i] counts observations
 * <= bounds[i] and > bounds[i-1] (not cumulative); bucket[n_bounds] counts the rest. */
#define PROM_MAX_BOUNDS 16
typedef struct {
    uint64_t bucket[PROM_MAX_BOUNDS + 1];
    uint64_t count;
    double sum;
} prom_hist;

void prom_observe(prom_hist *h, const double *bounds, int n_bounds, double v);

void prom_printf(prom_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* # HELP / # TYPE lines of a family. */
void prom_family(prom_buf *b, const char *name, const char *type, const char *help);
void prom_counter(prom_buf *b, const char *name, const char *help, uint64_t v);
void prom_gauge(prom_buf *b, const char *name, const char *help, double v);
void prom_histogram(prom_buf *b, const char *name, const char *help, const prom_hist *h, const double *bounds,
                    int n_bounds);
/* The finished text (owned by the caller, free()), or NULL when an allocation failed. */
char *prom_take(prom_buf *b);

#endif /* KVS_PROM_H */
