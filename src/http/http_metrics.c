/*
 * http_metrics — the counters and histograms of `kvshard api`, rendered in the Prometheus text
 * exposition format (version 0.0.4): requests by endpoint and status, tokens in/out, time to
 * first token and per-token latency histograms, failovers (hops replaced by spares), queue
 * depth, busy lanes and prefix reuse.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_impl.h"

static const double bounds[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
#define N_BOUNDS ((int)(sizeof bounds / sizeof bounds[0]))
static const int status_codes[HTTP_N_STATUS - 1] = {200, 400, 404, 405, 413, 500, 502, 503, 504};
static const char *const endpoint_names[EP_COUNT_] = {"/v1/chat/completions", "/v1/completions", "/v1/models",
                                                      "/health", "/metrics", "/", "/v1/models/{id}",
                                                      "/tokenize", "/detokenize", "/version", "/favicon.ico",
                                                      "other"};

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

void http_metrics_tokens(http_metrics *m, uint64_t in, uint64_t out, uint64_t reused, uint64_t cached) {
    pthread_mutex_lock(&m->mu);
    m->c.prefix_cached_tokens += cached;
    m->c.tokens_in += in;
    m->c.tokens_out += out;
    m->c.prefix_reused_tokens += reused;
    pthread_mutex_unlock(&m->mu);
}

void http_metrics_observe(http_metrics *m, enum http_hist_id which, double seconds) {
    pthread_mutex_lock(&m->mu);
    prom_observe(which == HIST_TTFT ? &m->c.ttft : &m->c.token_latency, bounds, N_BOUNDS, seconds);
    pthread_mutex_unlock(&m->mu);
}

void http_metrics_cancelled(http_metrics *m) {
    pthread_mutex_lock(&m->mu);
    m->c.cancelled++;
    pthread_mutex_unlock(&m->mu);
}

char *http_metrics_render(http_metrics *m, http_lanes *L) {
    prom_buf b = {0};
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
    prom_family(&b, "kvshard_api_requests_total", "counter", "HTTP requests by endpoint and status.");
    for (int e = 0; e < EP_COUNT_; e++)
        for (int k = 0; k < HTTP_N_STATUS; k++) {
            if (!c.requests[e][k]) continue;
            char st[16];
            if (k < HTTP_N_STATUS - 1) snprintf(st, sizeof st, "%d", status_codes[k]);
            else snprintf(st, sizeof st, "other");
            prom_printf(&b, "kvshard_api_requests_total{endpoint=\"%s\",status=\"%s\"} %llu\n", endpoint_names[e], st,
                        (unsigned long long)c.requests[e][k]);
        }
    prom_counter(&b, "kvshard_api_prompt_tokens_total", "Prompt tokens of completed requests.", c.tokens_in);
    prom_counter(&b, "kvshard_api_completion_tokens_total", "Generated tokens.", c.tokens_out);
    prom_counter(&b, "kvshard_api_prefix_reused_tokens_total", "Prompt tokens served from a kept session's KV state.",
                 c.prefix_reused_tokens);
    prom_counter(&b, "kvshard_api_prefix_cached_tokens_total",
                 "Prompt tokens of new sessions taken from the shards' shared prefix blocks.", c.prefix_cached_tokens);
    prom_counter(&b, "kvshard_api_prefix_reuse_hits_total", "Requests that continued a kept session.", hits);
    prom_counter(&b, "kvshard_api_prefix_reuse_misses_total", "Requests that started a new session.", misses);
    prom_counter(&b, "kvshard_api_cancelled_total", "Streams ended by the client going away.", c.cancelled);
    prom_counter(&b, "kvshard_api_failovers_total", "Hops replaced by spares.", failovers);
    prom_gauge(&b, "kvshard_api_queue_depth", "Requests waiting for a free lane.", waiting);
    prom_gauge(&b, "kvshard_api_lanes_busy", "Lanes running a generation.", busy);
    prom_gauge(&b, "kvshard_api_lanes", "Lanes (concurrent generations).", lanes);
    prom_histogram(&b, "kvshard_api_time_to_first_token_seconds", "From request to first sampled token.", &c.ttft,
                   bounds, N_BOUNDS);
    prom_histogram(&b, "kvshard_api_token_latency_seconds", "Between consecutive generated tokens.", &c.token_latency,
                   bounds, N_BOUNDS);
    return prom_take(&b);
}
