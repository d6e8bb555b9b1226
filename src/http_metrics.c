/*
 * http_metrics — the counters and histograms of `kvshard api`, rendered in the Prometheus text
 * exposition format (version 0.0.4): requests by endpoint and status, tokens in/out, time to
 * first token and per-token latency histograms, failovers (hops replaced by spares), queue
 * depth, busy lanes and prefix reuse.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_impl.h"

static const double bounds[HTTP_HIST_BUCKETS - 1] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                                     0.25,  0.5,    1,     2.5,  5,     10};
static const int status_codes[HTTP_N_STATUS - 1] = {200, 400, 404, 405, 413, 500, 502, 503, 504};
static const char *const endpoint_names[EP_COUNT_] = {"/v1/chat/completions", "/v1/completions", "/v1/models",
                                                      "/health", "/metrics", "/", "other"};

void http_metrics_init(http_metrics *m) {
    memset(m, 0, sizeof *m);
    pthread_mutex_init(&m->mu, NULL);
}

void http_metrics_destroy(http_metrics *m) { pthread_mutex_destroy(&m->mu); }

void http_metrics_request(http_metrics *m, enum http_endpoint ep, int status) {
    int k = HTTP_N_STATUS - 1;
    for (int i = 0; i < HTTP_N_STATUS - 1; i++)
        if (status_codes[i] == status) k = i;
    pthread_mutex_lock(&m->mu);
    m->c.requests[ep][k]++;
    pthread_mutex_unlock(&m->mu);
}

void http_metrics_tokens(http_metrics *m, uint64_t in, uint64_t out, uint64_t reused) {
    pthread_mutex_lock(&m->mu);
    m->c.tokens_in += in;
    m->c.tokens_out += out;
    m->c.prefix_reused_tokens += reused;
    pthread_mutex_unlock(&m->mu);
}

void http_metrics_observe(http_metrics *m, enum http_hist_id which, double seconds) {
    int b = HTTP_HIST_BUCKETS - 1;
    for (int i = 0; i < HTTP_HIST_BUCKETS - 1; i++)
        if (seconds <= bounds[i]) {
            b = i;
            break;
        }
    pthread_mutex_lock(&m->mu);
    http_hist *h = which == HIST_TTFT ? &m->c.ttft : &m->c.token_latency;
    h->bucket[b]++;
    h->count++;
    h->sum += seconds;
    pthread_mutex_unlock(&m->mu);
}

void http_metrics_cancelled(http_metrics *m) {
    pthread_mutex_lock(&m->mu);
    m->c.cancelled++;
    pthread_mutex_unlock(&m->mu);
}

typedef struct {
    char *s;
    size_t len, cap;
    bool oom;
} sbuf;

static void put(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(sbuf *b, const char *fmt, ...) {
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->s + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = true;
            return;
        }
        if ((size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        size_t nc = b->cap * 2 + (size_t)n;
        char *ns = realloc(b->s, nc);
        if (!ns) {
            b->oom = true;
            return;
        }
        b->s = ns;
        b->cap = nc;
    }
}

static void head(sbuf *b, const char *name, const char *type, const char *help) {
    put(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void counter(sbuf *b, const char *name, const char *help, uint64_t v) {
    head(b, name, "counter", help);
    put(b, "%s %llu\n", name, (unsigned long long)v);
}

static void gauge(sbuf *b, const char *name, const char *help, double v) {
    head(b, name, "gauge", help);
    put(b, "%s %.17g\n", name, v);
}

static void histogram(sbuf *b, const char *name, const char *help, const http_hist *h) {
    head(b, name, "histogram", help);
    uint64_t cum = 0;
    for (int i = 0; i < HTTP_HIST_BUCKETS - 1; i++) {
        cum += h->bucket[i];
        put(b, "%s_bucket{le=\"%g\"} %llu\n", name, bounds[i], (unsigned long long)cum);
    }
    put(b, "%s_bucket{le=\"+Inf\"} %llu\n", name, (unsigned long long)h->count);
    put(b, "%s_sum %.9g\n%s_count %llu\n", name, h->sum, name, (unsigned long long)h->count);
}

char *http_metrics_render(http_metrics *m, http_lanes *L) {
    sbuf b = {.cap = 8192};
    if (!(b.s = malloc(b.cap))) return NULL;
    b.s[0] = 0;
    pthread_mutex_lock(&L->mu);
    int busy = 0, waiting = L->waiting, lanes = L->p.lanes;
    uint64_t failovers = L->reroutes_done, hits = L->reuse_hits, misses = L->reuse_misses;
    for (int i = 0; i < L->p.lanes; i++) {
        busy += L->lanes[i].busy;
        failovers += L->lanes[i].reroutes;
    }
    pthread_mutex_unlock(&L->mu);
    pthread_mutex_lock(&m->mu);
    http_counters c = m->c; /* a consistent snapshot */
    pthread_mutex_unlock(&m->mu);
    head(&b, "kvshard_api_requests_total", "counter", "HTTP requests by endpoint and status.");
    for (int e = 0; e < EP_COUNT_; e++)
        for (int k = 0; k < HTTP_N_STATUS; k++) {
            if (!c.requests[e][k]) continue;
            char st[16];
            if (k < HTTP_N_STATUS - 1) snprintf(st, sizeof st, "%d", status_codes[k]);
            else snprintf(st, sizeof st, "other");
            put(&b, "kvshard_api_requests_total{endpoint=\"%s\",status=\"%s\"} %llu\n", endpoint_names[e], st,
                (unsigned long long)c.requests[e][k]);
        }
    counter(&b, "kvshard_api_prompt_tokens_total", "Prompt tokens of completed requests.", c.tokens_in);
    counter(&b, "kvshard_api_completion_tokens_total", "Generated tokens.", c.tokens_out);
    counter(&b, "kvshard_api_prefix_reused_tokens_total", "Prompt tokens served from a kept session's KV state.",
            c.prefix_reused_tokens);
    counter(&b, "kvshard_api_prefix_reuse_hits_total", "Requests that continued a kept session.", hits);
    counter(&b, "kvshard_api_prefix_reuse_misses_total", "Requests that started a new session.", misses);
    counter(&b, "kvshard_api_cancelled_total", "Streams ended by the client going away.", c.cancelled);
    counter(&b, "kvshard_api_failovers_total", "Hops replaced by spares.", failovers);
    gauge(&b, "kvshard_api_queue_depth", "Requests waiting for a free lane.", waiting);
    gauge(&b, "kvshard_api_lanes_busy", "Lanes running a generation.", busy);
    gauge(&b, "kvshard_api_lanes", "Lanes (concurrent generations).", lanes);
    histogram(&b, "kvshard_api_time_to_first_token_seconds", "From request to first sampled token.", &c.ttft);
    histogram(&b, "kvshard_api_token_latency_seconds", "Between consecutive generated tokens.", &c.token_latency);
    if (b.oom) {
        free(b.s);
        return NULL;
    }
    return b.s;
}
