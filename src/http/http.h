/*
 * http — `kvshard api`: an OpenAI-compatible HTTP front door over a route of shards.
 *
 * Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
 * GET /metrics (Prometheus text format), GET / (the chat page), and those of http_extra.c
 * (GET /v1/models/{id}, POST /tokenize, POST /detokenize, GET /version; CORS). The one-machine case
 * (`kvshard api -m MODEL`) is the same code over a route of one in-process shard.
 *
 * Design notes
 *  1. HTTP is libmicrohttpd in thread-per-connection mode: each connection's thread parses its
 *     request, waits for a lane (note 2) and runs the generation itself. A streamed reply is
 *     produced inside the response's content-reader callback, one forward step per chunk, so
 *     nothing runs ahead of what the client reads and no second thread touches the request.
 *  2. A lane is one route (one connection per hop) with at most one generation on it at a time
 *     (route.h note 5). `lanes` of them run concurrently; the shards batch their steps together
 *     as they batch any sessions. A request that finds every lane busy waits in a bounded queue
 *     (queue_max waiters, queue_timeout_ms each); past that it gets 503 with Retry-After.
 *  3. Each request is its own route session. When it ends normally, its session and its token
 *     history stay in a small per-lane table (prefix_slots per lane). A later request whose
 *     prompt shares a prefix of at least HTTP_MIN_REUSE tokens with a kept history takes that
 *     lane and session, rewinds it to the common prefix (route_session_rewind) and prefills only
 *     the rest: a multi-turn conversation re-sends its history and pays only for the new turn.
 *     Evicting a kept session sends RELEASE; the shards' own LRU may also drop it, which the
 *     route recovers from by replay (route.h note 2), so reuse never changes the output.
 *  4. A client that goes away mid-stream makes the next write fail; libmicrohttpd then frees the
 *     response, and its free callback releases the session on every hop (between steps nothing
 *     is in flight, so RELEASE alone returns the shards' KV to where it was).
 *  5. The library never prints; events go to http_params.log.
 *  6. Guard (http_guard.c): with api keys every endpoint but the page wants
 *     `Authorization: Bearer KEY` (401 otherwise); kept sessions are reused only by the client
 *     identity that left them (its key, else its IP address), so cached_tokens tells a client
 *     nothing about another's prompts; per-IP connection limit and request timeout against
 *     slow-loris; a streamed reply holds a small send buffer and is closed when its client stops
 *     reading for stream_stall_s, which frees its lane.
 */
#ifndef KVS_HTTP_H
#define KVS_HTTP_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "log.h"
#include "route.h"

/* One event line, as every module's log (log.h). */
typedef kvs_log_fn http_log_fn;

typedef struct {
    const char *listen;          /* "HOST:PORT"; port 0 picks a free one (http_port) */
    const char *route;           /* route spec "HOST:PORT,..." (route_parse_spec) */
    const char *spares;          /* NULL or "": none */
    /* Opens a lane's route instead of route_open(route, spares) (kvshard api --cluster plans each
     * lane from the registry); NULL: route_open. Called from several lanes' threads at once. */
    int (*open_route)(void *ctx, const route_params *rp, route **out, char *msg, size_t cap);
    void *open_route_ctx;
    /* With open_route (same ctx): asked about a lane's open route before a request uses it
     * (closing false; true makes the lane close it and open a new one, e.g. a registry that gained
     * shards), and told before the lanes close any route (closing true). NULL: none. */
    bool (*route_stale)(void *ctx, const route *r, bool closing);
    const char *model_name;      /* id in /v1/models and replies; NULL: "kvshard" */
    const char *tokenizer_path;  /* GGUF to read the tokenizer and chat template from; NULL:
                                    the head shard's VOCAB (SentencePiece models only) */
    const char *chat_template;   /* chat_template name overriding the model's; NULL: detect */
    int lanes;                   /* concurrent generations, 1..256 (default 4) */
    int queue_max;               /* requests waiting for a lane before 503, 0..4096 (default 64) */
    int64_t queue_timeout_ms;    /* longest wait for a lane before 503 (default 30000) */
    size_t max_body_bytes;       /* request bodies past this get 413 (default 1 MiB) */
    int prefix_slots;            /* kept sessions per lane for prefix reuse; 0: off (default 4) */
    const char *public_prefix;   /* file with text (as the model sees it, chat template applied)
                                    whose shard prefix blocks every client shares; NULL: none */
    int64_t route_timeout_ms;    /* route_params.timeout_ms (default 30000) */
    const char *auth;            /* route_params.auth: HELLO token for the shards; NULL: none */
    const char *tls_cert, *tls_key, *tls_ca; /* route_params: mutual TLS to the shards, all or none */
    int max_connections;         /* open HTTP connections (default 256) */
    const char *cors;            /* allowed browser origins, comma-separated or "*"; NULL: no CORS */
    const char *version;         /* what GET /version reports; NULL: "unknown" */
    /* Security of the HTTP side (docs/security.md, "kvshard api"). */
    int per_ip_connections;      /* open HTTP connections from one IP address (default 64) */
    int request_timeout_s;       /* a connection silent this long while it sends a request, or
                                    between requests, is closed (default 10) */
    int stream_stall_s;          /* a streamed reply the client reads nothing of for this long is
                                    closed and its lane freed (default 30) */
    int stream_sndbuf;           /* socket send buffer of a streamed reply, bytes: how far a
                                    generation runs ahead of its reader (default 64 KiB) */
    const char *api_key_file;    /* Bearer tokens accepted, one per line, '#' comments; NULL: none
                                    asked (then only a loopback listen, unless insecure) */
    bool insecure;               /* allow a non-loopback listen without api keys */
    http_log_fn log;             /* NULL: silent */
    void *log_ctx;
    /* Test hook: called on the request's thread before each forward step, with the request's
     * number (1, 2, ... in arrival order) and the tokens generated so far. */
    void (*before_step)(void *ctx, uint64_t request_no, uint32_t n_generated);
    void *hook_ctx;
} http_params;

http_params http_default_params(void);

typedef struct http_server http_server;

/* Opens every lane's route (route_open; the tokenizer comes from the head shard), binds
 * p->listen and starts serving. On success *out is a running server owned by the caller
 * (http_stop). On failure *out is NULL, nothing is left open, and msg says why:
 * KVS_ERR_INVALID_ARG (a setting out of range, bad listen address or route spec), the route's
 * errors (route_open), KVS_ERR_UNSUPPORTED (the head shard has no tokenizer), KVS_ERR_IO (bind
 * failed), KVS_ERR_NOMEM. */
int http_start(const http_params *p, http_server **out, char *msg, size_t msg_cap);

/* The port the server listens on. */
uint16_t http_port(const http_server *h);

/* The graceful stop, before http_stop: stops listening (a new connection is refused) and answers
 * new requests on open connections 503 server_shutting_down, then waits up to deadline_ms for
 * the running generations to finish. Those still running then end at their next step as if
 * max_tokens were reached (finish_reason "length"; a stream gets its last chunk and [DONE]);
 * deadline_ms <= 0 ends them at once, and so does *hurry turning nonzero while it waits (a
 * second Ctrl-C; NULL: no such flag). Returns how many were cut short. */
int http_drain(http_server *h, int64_t deadline_ms, volatile sig_atomic_t *hurry);

/* Stops accepting, waits for running requests to end, releases every kept session, closes the
 * routes and frees the server. NULL is fine. */
void http_stop(http_server *h);

#endif /* KVS_HTTP_H */
