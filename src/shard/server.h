/*
 * server — a shard: one layer range of a model with its hot KV state, served
 * over TCP (protocol: docs/protocol.md).
 *
 * Threads: the caller of srv_run accepts connections; per connection, a reader
 * thread decodes frames and a writer thread sends the queued replies (so no
 * one ever blocks on a client that does not read); the reader answers the cheap
 * ops itself (HELLO, VOCAB,
 * STATS, TRUNCATE, RELEASE, CANCEL); FORWARD requests go to one scheduler
 * thread that batches the work of different sessions into one forward pass
 * (every queued decode step, plus prefill cut into chunks so a long prompt
 * never stalls other sessions' decode) and replies when a request is done.
 * A connection's disconnect cancels its requests in flight; cancellation
 * rolls each session back (kvstate transactions).
 */
#ifndef KVS_SERVER_H
#define KVS_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "log.h"

typedef kvs_log_fn srv_log_fn;

typedef struct {
    const char *model_path;
    uint32_t first, last;       /* layers [first, last); last 0 = n_layer */
    uint32_t max_ctx;           /* positions per session (--ctx-size); 0 = the model's, as the budget holds */
    const char *listen;         /* "HOST:PORT"; port 0 picks a free one */
    const char *name;           /* shard name in INFO (default "HOST:PORT") */
    int n_threads;              /* compute threads; 0 = all CPUs */
    uint64_t kv_budget_bytes;   /* hot KV pool */
    uint64_t kv_ttl_ms;         /* idle session TTL; 0 = none */
    uint32_t max_sessions;      /* 0 = limited by the budget only */
    uint32_t max_tokens;        /* rows per FORWARD accepted */
    uint32_t prefill_chunk;     /* prefill rows per scheduler step */
    int max_batch;              /* requests per forward pass */
    int max_conns;              /* open connections */
    int hello_timeout_ms;       /* a new connection must say HELLO within this */
    int idle_timeout_ms;        /* a connection silent this long is closed */
    const char *digest_cache_dir; /* the model digest's cache (digest_model_cached); NULL: hash */
    int drain_ms;               /* srv_stop drains first: listener closed, new FORWARDs refused,
                                   those in flight answered, for up to this long; 0: stop at once */
    int kv_type;                /* QUANT_F16, QUANT_Q8_0, QUANT_Q4_0 or QUANT_F32 */
    bool kv_prefault;           /* touch the whole KV pool at start (--kv-prefault) */
    size_t max_queued_bytes;    /* replies queued for a connection that is not reading them,
                                   bytes, before it is closed (default 256 MiB) */
    /* Security (docs/security.md). */
    const char *tls_cert, *tls_key, *tls_ca; /* all three set: mutual TLS 1.3 on every connection */
    bool insecure;              /* allow plaintext on an address that is not loopback */
    const char *relay_allow;    /* "HOST:PORT,..." next hops this shard may push to; NULL: loopback
                                   hops when listening on loopback, else none */
    const char *auth_token_file; /* HELLO auth tokens accepted, one per line; NULL: tokens ignored */
    int frame_timeout_ms;       /* a frame must be complete this long after its first byte */
    int max_conns_per_addr;     /* open connections from one IP address */
    int max_inflight;           /* FORWARD requests queued or running per connection; more: BUSY */
    size_t max_buffered_bytes;  /* receive buffers + queued replies over all connections, bytes */
    /* Tenants: one per authenticated identity (docs/security.md "Tenants"). Fair shares of the
     * pool and of max_sessions are always kept; these are each tenant's own caps on top. */
    uint32_t tenant_max_sessions; /* live sessions per identity; 0: none of its own */
    uint64_t tenant_kv_bytes;   /* KV bytes per identity; 0: tenant_kv_share of the budget */
    double tenant_kv_share;     /* (0, 1]: fraction of the budget per identity (1: no own cap) */
    const char *state_dir;      /* NULL: none; else the KV state is written there on stop and loaded
                                   at start (server_state.c) */
    int drain_timeout_ms;       /* on stop with state_dir, and drains: in-flight work gets this long */
    const char *peer_allow;     /* "ID-or-IP,..." peers that may push sessions here or drain this shard
                                   (SESSION_PUSH, DRAIN; server_move.c); NULL: none */
    srv_log_fn log;             /* NULL: silent */
    void *log_ctx;
    /* Test hook: called by the scheduler before each forward pass with the
     * number of requests in it (tests use it to order events without sleeps). */
    void (*before_batch)(void *ctx, int n_items);
    void *hook_ctx;
    /* Test hook: the hot state's clock (TTL, tombstone age), ns; NULL: CLOCK_MONOTONIC. */
    uint64_t (*kv_clock)(void *ctx);
    void *kv_clock_ctx;
    /* Metrics hook: called by the scheduler after each forward pass with its requests, rows
     * and duration (ns); must be quick and thread-safe (src/shard_metrics.c). */
    void (*batch_done)(void *ctx, int n_items, uint32_t n_rows, uint64_t elapsed_ns);
    void *batch_ctx;
} srv_params;

srv_params srv_default_params(void);

typedef struct srv srv;

/* Loads the layer range, hashes the model file, binds the listening socket.
 * Nothing is served until srv_run. */
int srv_create(const srv_params *p, srv **out, char *msg, size_t msg_cap);
uint16_t srv_port(const srv *s);
/* Serves until srv_stop; then closes every connection and returns KVS_OK. */
int srv_run(srv *s);
/* The counters the STATS op answers (kv.* and srv.*), read in-process; thread-safe. */
struct wire_stats_reply;
void srv_stats(srv *s, struct wire_stats_reply *out);
/* The INFO this shard answers a protocol-v2 HELLO with (server_cluster.c), for the registry. */
struct wire_info;
void srv_get_info(const srv *s, struct wire_info *out);
/* Asks srv_run to return; async-signal-safe. With drain_ms, the first call drains (see
 * srv_params) and a second one stops at once. */
void srv_stop(srv *s);
void srv_free(srv *s);

#endif /* KVS_SERVER_H */
