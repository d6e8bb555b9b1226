/*
 * http_impl — the parts of `kvshard api` shared between its files (private to src/http*.c):
 *   http_req.c      OpenAI request bodies -> http_gen_req, with OpenAI-shaped errors
 *   http_chat.c     messages -> prompt text (the chat template)
 *   http_lanes.c    lanes, the bounded wait queue, kept sessions (prefix reuse), health probes
 *   http_gen.c      one generation on a lane: the loop of gen.h, logprobs, metrics
 *   http_openai.c   reply bodies and server-sent events
 *   http_metrics.c  counters and histograms, Prometheus text
 *   http_page.c     the embedded chat page
 *   http_extra.c    /v1/models/{id}, /tokenize, /detokenize, /version, CORS
 *   http_drain.c    the graceful stop: running generations, refusing new ones, cutting them
 *   http.c          libmicrohttpd plumbing and the endpoint table
 */
#ifndef KVS_HTTP_IMPL_H
#define KVS_HTTP_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gen.h"
#include "http.h"
#include "prom.h"
#include "route.h"
#include "sampler.h"
#include "tokenizer.h"

#define HTTP_MAX_STOP 4          /* stop strings per request (OpenAI's limit) */
#define HTTP_MAX_STOP_LEN 256    /* bytes per stop string */
#define HTTP_MAX_TOP_LOGPROBS 20 /* chat top_logprobs limit (completions: 5) */
#define HTTP_MIN_REUSE 4         /* common-prefix tokens that make a kept session worth taking */
#define HTTP_MAX_MESSAGES 1024
#define HTTP_REPEAT_WINDOW 64    /* penalty window of sampler_pick, as kvshard run's --repeat-last-n */

/* ---- errors ------------------------------------------------------------------------------ */

/* An OpenAI-shaped error: {"error":{"message","type","param","code"}} with an HTTP status. */
typedef struct {
    int status;          /* HTTP status */
    const char *type;    /* "invalid_request_error", "server_error", ... */
    const char *code;    /* NULL: JSON null */
    char param[64];      /* "": JSON null */
    char message[320];
} http_err;

/* Fills e and returns false (so parsers can `return http_fail(...)`). */
bool http_fail(http_err *e, int status, const char *type, const char *code, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));

/* ---- requests ------------------------------------------------------------------------------ */

typedef struct {
    char *role;    /* owned */
    char *content; /* owned */
} http_message;

typedef struct {
    bool chat;                  /* /v1/chat/completions (messages) or /v1/completions (prompt) */
    char *prompt;               /* completions: owned */
    http_message *msgs;         /* chat: owned, n_msgs */
    size_t n_msgs;
    long max_tokens;            /* -1: up to the context */
    sampler_params sp;          /* temperature, top_p, seed; top_k, min_p, penalties: llama.cpp's fields */
    uint32_t repeat_last_n;     /* penalty window, ids (HTTP_REPEAT_WINDOW unless the request says) */
    char *stop[HTTP_MAX_STOP];  /* owned */
    int n_stop;
    bool stream;
    bool include_usage;         /* stream_options.include_usage */
    bool logprobs;
    int top_logprobs;           /* 0..HTTP_MAX_TOP_LOGPROBS */
    uint64_t owner;             /* the client identity (http_guard): scopes prefix reuse; not from the body */
} http_gen_req;

/* Parses and validates a request body. true: *out filled (free with http_gen_req_free). false:
 * e says why (400) and *out holds nothing. */
bool http_req_parse(const char *body, size_t len, bool chat, http_gen_req *out, http_err *e);
void http_gen_req_free(http_gen_req *r);

/* ---- chat template --------------------------------------------------------------------------- */

/* The template (a chat_template value) to use: name when non-empty, else the one the vocab's
 * tokenizer.chat_template is recognised as, else ChatML when the file has none.
 * KVS_OK; KVS_ERR_INVALID_ARG (unknown name) / KVS_ERR_UNSUPPORTED (unrecognised template). */
int http_chat_pick(const tok_vocab *v, const char *name, int *tmpl, char *msg, size_t cap);

/* Formats msgs with tmpl, ending with the assistant's turn opened. *out malloc'd, owned by
 * the caller. KVS_OK, KVS_ERR_NOMEM, chat_format's errors. */
int http_chat_format(int tmpl, const http_message *msgs, size_t n, char **out);

/* ---- lanes ----------------------------------------------------------------------------------- */

typedef struct {
    route_session *s;  /* NULL: slot empty */
    int32_t *hist;     /* (n) tokens the session holds along the route */
    uint32_t n, cap;
    uint64_t last_used; /* lanes->clock tick */
    uint64_t owner;     /* the client identity that left it: only it may reuse it (note 6 of http.h) */
} http_kept;

typedef struct {
    route *r;            /* NULL while broken (reopened by the next request) */
    bool busy;
    uint32_t reroutes;   /* of r, as of the lane's last request */
    uint64_t owner;      /* identity of the request holding the lane (what it keeps is its) */
    http_kept *kept;     /* (prefix_slots) */
} http_lane;

typedef struct {
    http_params p;
    char *route_spec, *spares_spec;
    http_lane *lanes;        /* (p.lanes) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int waiting;             /* requests in the queue */
    uint64_t clock;
    tok_vocab *vocab;
    int chat_tmpl;           /* http_chat_pick */
    int32_t *pub_ids;        /* (n_pub) tokens of p.public_prefix; NULL: none */
    int n_pub;
    route_info info;         /* of lane 0 at start */
    char hops[ROUTE_MAX_HOPS][ROUTE_ADDR_MAX]; /* current hop addresses (refreshed after each use) */
    uint32_t n_hops;
    uint64_t reroutes_done;  /* reroutes of lanes since closed/reopened */
    uint64_t reuse_hits, reuse_misses, reused_tokens;
} http_lanes;

int http_lanes_open(http_lanes *L, const http_params *p, char *msg, size_t cap);
void http_lanes_close(http_lanes *L);

/* Waits for a lane (queue note 2 of http.h). On KVS_OK *lane is held and, when a kept session
 * of the same owner (client identity) shares >= HTTP_MIN_REUSE tokens with prompt[0..n), *kept
 * is that session (taken out of the table, rewound to the common prefix *reuse, at most n - 1)
 * else NULL with *reuse 0. KVS_ERR_BUSY: the queue is full or the wait timed out. KVS_ERR_IO:
 * the lane's route could not be reopened (msg). */
int http_lanes_acquire(http_lanes *L, const int32_t *prompt, uint32_t n, uint64_t owner, int *lane,
                       route_session **kept, uint32_t *reuse, char *msg, size_t cap);
/* Ends a request on the lane: keep (hist[0..n) is what s holds) puts s into the lane's table
 * (owned by the lane's owner),
 * evicting the least recently used entry (RELEASE); !keep releases s. s may be NULL. broken
 * closes the lane's route (reopened on next use). Wakes one waiter. */
void http_lanes_finish(http_lanes *L, int lane, route_session *s, const int32_t *hist, uint32_t n, bool keep,
                       bool broken);
/* Probes every current hop (connect, HELLO, INFO) within timeout_ms each. Writes one line per
 * hop into report (cap bytes). true when all answered. */
bool http_lanes_health(http_lanes *L, int64_t timeout_ms, char *report, size_t cap);

/* ---- guard (http_guard.c, http.h design note 6) --------------------------------------------- */

#define HTTP_KEY_HASH 32 /* BLAKE2b-256 of an api key */
#define HTTP_PUBLIC_PREFIX_MAX (1 << 20) /* bytes of --public-prefix text */

/* Open connections of one client address (the per-IP limit). */
typedef struct {
    uint64_t addr; /* http_guard_owner_addr's tag of the address */
    int n;
} http_ip_count;

typedef struct {
    uint8_t (*keys)[HTTP_KEY_HASH]; /* (n_keys) hashes of the accepted keys; the keys are not kept */
    int n_keys;
    uint8_t id_key[16];             /* random per process: keys the client identity tags */
    /* Per-IP connection counts, kept here rather than by libmicrohttpd, whose count drops only at
     * its next cleanup pass: a client reconnecting at once met its own closed connections. */
    pthread_mutex_t ip_mu;
    http_ip_count *ips;             /* (n_ips) addresses with open connections, at most max_ips */
    int n_ips, max_ips, per_ip;     /* max_ips: the connection limit */
} http_guard;

struct MHD_Connection;
struct sockaddr;

/* Loads p->api_key_file and checks the listen host (not loopback: keys or p->insecure needed).
 * KVS_OK; KVS_ERR_INVALID_ARG with msg; KVS_ERR_NOMEM. */
int http_guard_open(http_guard *g, const http_params *p, const char *host, char *msg, size_t cap);
void http_guard_close(http_guard *g);
/* Without keys: true, *owner 0 (the caller tags the client by address). With keys: true when
 * authorization is "Bearer KEY" with an accepted KEY (constant time), *owner then that key's
 * identity tag; false otherwise. */
bool http_guard_check(const http_guard *g, const char *authorization, uint64_t *owner);
/* The identity tag of a client address (no api keys). */
uint64_t http_guard_owner_addr(const http_guard *g, const struct sockaddr *sa);
/* The accept policy: false when the address holds per_ip_connections open connections. Called
 * by libmicrohttpd's one accepting thread, before http_guard_conn counts the new connection. */
bool http_guard_admit(http_guard *g, const struct sockaddr *sa);
/* A connection of the address tagged addr (http_guard_owner_addr) opened (open) or closed: the
 * count http_guard_admit reads. */
void http_guard_conn(http_guard *g, uint64_t addr, bool open);
/* Turns the connection's timeout off while the server works for it (begin), or back on at
 * resume_s with its clock restarted. */
void http_guard_long_work(struct MHD_Connection *c, bool begin, unsigned resume_s);
/* A streamed reply: a small send buffer and the stall timeout on its connection. */
void http_guard_stream(struct MHD_Connection *c, const http_params *p);

/* ---- metrics -------------------------------------------------------------------------------- */

enum http_endpoint {
    EP_CHAT = 0, EP_COMPLETIONS, EP_MODELS, EP_HEALTH, EP_METRICS, EP_PAGE,
    EP_MODEL_ONE, EP_TOKENIZE, EP_DETOKENIZE, EP_VERSION, EP_FAVICON, /* http_extra.c */
    EP_OTHER, EP_COUNT_
};

#define HTTP_N_STATUS 10

typedef struct {
    uint64_t requests[EP_COUNT_][HTTP_N_STATUS]; /* by status_codes index (http_metrics.c); the last: other */
    uint64_t tokens_in, tokens_out, cancelled, prefix_reused_tokens, prefix_cached_tokens;
    prom_hist ttft, token_latency; /* seconds */
} http_counters;

typedef struct {
    pthread_mutex_t mu;
    http_counters c;
} http_metrics;

enum http_hist_id { HIST_TTFT, HIST_TOKEN };

void http_metrics_init(http_metrics *m);
void http_metrics_destroy(http_metrics *m);
void http_metrics_request(http_metrics *m, enum http_endpoint ep, int status);
/* reused: from a kept session; cached: from the shards' shared prefix blocks (a new session) */
void http_metrics_tokens(http_metrics *m, uint64_t in, uint64_t out, uint64_t reused, uint64_t cached);
void http_metrics_observe(http_metrics *m, enum http_hist_id h, double seconds);
void http_metrics_cancelled(http_metrics *m);
/* Renders every metric (plus the lanes' gauges) as Prometheus text; malloc'd, NULL on NOMEM. */
char *http_metrics_render(http_metrics *m, http_lanes *L);

/* ---- generation ------------------------------------------------------------------------------- */

typedef struct {
    int32_t id;
    float logprob;
    int n_top;
    int32_t top_id[HTTP_MAX_TOP_LOGPROBS];
    float top_lp[HTTP_MAX_TOP_LOGPROBS];
} http_tok_lp;

typedef enum { FINISH_NONE = 0, FINISH_STOP, FINISH_LENGTH } http_finish;

typedef struct {
    http_lanes *L;
    const http_gen_req *req;
    int lane;
    route *r;
    route_session *s;
    gen_state gen;          /* the loop (gen.h): ids, sampler, text, stop strings */
    uint32_t reuse;         /* prompt tokens that came from a kept session */
    /* Views of gen for http_openai.c and http.c, refreshed by http_gen_step. */
    uint32_t n_prompt, n_gen;
    char *text;             /* generated text (after stop truncation); gen owns it */
    size_t text_len;
    http_finish finish;     /* of gen.finish: an end-of-generation id and a stop string both STOP */
    size_t emitted;         /* text bytes already sent (streaming) */
    http_tok_lp *lps;       /* (max_gen) when req->logprobs */
    size_t lp_emitted;      /* entries already sent (streaming) */
    bool failed;
    char err[KVS_MSG_MAX];
    uint64_t t_start_ns, t_first_ns, t_last_ns;
    uint64_t request_no;
    http_metrics *metrics;
} http_gen;

/* Tokenizes the prompt, validates it against the context, acquires a lane (possibly with a
 * kept session) and opens the session. true: g is ready (http_gen_end must follow). false: e
 * says why (400 context_length_exceeded, 503 busy, 502 route failure) and nothing is held. */
bool http_gen_begin(http_gen *g, http_lanes *L, http_metrics *m, const http_gen_req *req, const char *prompt,
                    uint64_t request_no, http_err *e);
/* Runs one forward step and samples one token (or finishes). Returns false on a route failure
 * (g->failed, g->err). Sets g->finish when done. */
bool http_gen_step(http_gen *g);
/* Text that can be sent now: [emitted, *end). Holds back a tail that could begin a stop string
 * or that ends inside a UTF-8 sequence, unless finished. */
size_t http_gen_ready(const http_gen *g);
/* Ends the request: keeps the session for prefix reuse when it finished normally and !cancel,
 * releases it otherwise; frees g's buffers and gives the lane back. */
void http_gen_end(http_gen *g, bool cancel);

/* ---- replies ------------------------------------------------------------------------------ */

typedef struct {
    const char *model;
    char id[40];         /* "chatcmpl-..." / "cmpl-..." */
    long long created;   /* unix seconds */
} http_reply_meta;

/* Whole non-streamed reply body (malloc'd JSON). */
char *http_reply_full(const http_gen *g, const http_reply_meta *meta);
/* One SSE event with the text [g->emitted, end) and the logprobs not yet sent, or the final
 * chunk(s) when g->finish is set and all text was sent: "data: {...}\n\n" (malloc'd, *len).
 * first: include the role delta (chat). Advances g->emitted / g->lp_emitted. */
char *http_reply_chunk(http_gen *g, const http_reply_meta *meta, size_t end, bool first, size_t *len);
/* The OpenAI error body for e (malloc'd JSON). */
char *http_err_body(const http_err *e);

/* ---- page --------------------------------------------------------------------------------- */

/* The chat page (http_page.c), built at the first call; "" (len 0) when out of memory. */
const char *http_page(size_t *len);

/* ---- more endpoints and CORS (http_extra.c) ---------------------------------------------------- */

struct MHD_Response;
struct MHD_Connection;
/* EP_MODEL_ONE, EP_TOKENIZE, EP_DETOKENIZE, EP_VERSION or EP_FAVICON for their paths, else EP_OTHER. */
enum http_endpoint http_extra_classify(const char *url);
/* Is ep answered to POST (else to GET/HEAD)? */
bool http_extra_is_post(enum http_endpoint ep);
/* The JSON body (malloc'd) answering EP_MODEL_ONE/TOKENIZE/DETOKENIZE/VERSION with 200, or NULL
 * with e filled (400, 404, 500). */
char *http_extra_answer(enum http_endpoint ep, const char *url, const char *body, size_t len, const http_lanes *L,
                        const char *model, const char *version, http_err *e);
/* Adds the CORS headers this request's Origin earns under allowed (http_params.cors). */
void http_cors_headers(struct MHD_Response *r, struct MHD_Connection *c, const char *allowed);
/* An OPTIONS preflight of ep: true with *out (to queue with *status) when CORS is on and ep known. */
bool http_cors_preflight(struct MHD_Connection *c, const char *allowed, enum http_endpoint ep, int *status,
                         struct MHD_Response **out);

/* ---- graceful stop (http_drain.c) ------------------------------------------------------------- */

typedef struct {
    atomic_int active;     /* generations between enter and leave */
    atomic_bool draining;  /* new requests are refused (503, Connection: close) */
    atomic_bool cut;       /* running generations end at their next step, finish_reason "length" */
    int n_cut;             /* generations running when cut was set (under mu) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
} http_drain_state;

void http_drain_init(http_drain_state *d);
void http_drain_destroy(http_drain_state *d);
/* A generation starts: false (nothing counted) while draining. */
bool http_drain_enter(http_drain_state *d);
void http_drain_leave(http_drain_state *d);
bool http_drain_draining(const http_drain_state *d);
bool http_drain_cutting(const http_drain_state *d);
/* Refuse new requests from now; cut_now: also cut the running ones at once. */
void http_drain_begin(http_drain_state *d, bool cut_now);
/* Waits until no generation runs; past deadline_ms (or once *hurry is nonzero) cuts them and
 * waits cut_grace_ms more. Returns how many were cut. */
int http_drain_wait(http_drain_state *d, int64_t deadline_ms, int64_t cut_grace_ms, volatile sig_atomic_t *hurry);

#endif /* KVS_HTTP_IMPL_H */
