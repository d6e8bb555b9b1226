/*
 * route — the client side of a route of shards (DESIGN.md §3, §4; docs/protocol.md §6).
 *
 * A route is an ordered list of hops, each a connection to one shard; together the hops' layer
 * ranges cover [0, n_layer) without gaps. A session (random 128-bit route_session_id plus an
 * epoch, starting at 1) is driven along the route one step at a time: token ids into hop 0,
 * f32 hidden rows from each hop into the next, logits of the last position out of the last hop.
 *
 * Design notes
 *  1. The client remembers, per hop, every input row it sent in the session (token ids for hop 0,
 *     hidden rows for hop k > 0). A replay goes in the same FORWARD as the rows that needed it
 *     whenever they fit in one request (max_rows), so a shard under memory pressure cannot evict
 *     the session between the replay and the step; longer replays go first in max_rows pieces.
 *     This relies on the shards' batch-invariant kernels (DESIGN.md §2): a row's result does not
 *     depend on how the rows were split into requests.
 *  2. Recovery, all inside route_forward():
 *       - CACHE_MISS(have) from a hop: its remembered inputs [have, start) are replayed, then the
 *         request is sent again;
 *       - a hop fails (connect refused, EOF/reset, i/o error, undecodable or unexpected reply, or
 *         no reply within timeout_ms): the first spare that serves the same [first, last) of the
 *         same model (same digest) replaces it (when none does, route_params.more_spares may name
 *         more candidates), the session epoch goes E -> E+1 and the current
 *         step is redone from hop 0. Every hop whose state lives in an older epoch gets its next
 *         FORWARD with INHERIT(its epoch, start_pos) — it keeps its positions, no recompute; the
 *         replacement first gets all its remembered inputs [0, start) replayed at epoch E+1;
 *       - STALE_EPOCH: someone else drives this session with a newer epoch; route_forward fails;
 *       - BUSY: retried with backoff until timeout_ms has passed.
 *     Consequently the logits equal those of an uninterrupted run.
 *  3. Hop numbers in messages are 0-based positions in the route ("hop 0" is the head shard).
 *  4. The library never prints: recovery events go to route_params.log when set.
 *  5. Not thread-safe: one thread drives a route and its sessions at a time. Several sessions may
 *     share a route, one step at a time; a hop replaced while driving one session is noticed by
 *     the others at their next step (they bump their epoch and replay into it too).
 *  6. Replay memory is bounded. Per session and position it costs 4 bytes (the token id) plus one
 *     hidden row per hop after the head: n_embd x 4 bytes (f32, the default) or x 2 (f16 or bf16,
 *     route_params.hidden_f16 / hidden_bf16 — the rows then also travel in that dtype, so a replay
 *     sends exactly the bytes first sent). route_params.max_replay_bytes caps it (default 256 MiB): the route's
 *     max_ctx is lowered to what fits, so a session past it gets CONTEXT_FULL instead of growing.
 *     E.g. n_embd 4096, 4 hops, 2048 positions: 96 MiB in f32, 48 MiB in f16.
 *  7. Relay (route_step with opts.relay, every hop speaking protocol v2, two hops or more): the
 *     step goes to hop 0 only, with the rest of the route in a relay block; each shard pushes its
 *     hidden rows to the next and the tail answers on the connection the client registered with
 *     RELAY_LISTEN — n+1 transfers. The client then never sees the hidden rows, so its per-hop
 *     memory is valid only up to s->hidden_valid. Any relay failure (an error answered by a
 *     shard, a STATUS "relay: hop k (...)" from the shard that could not push, a connection
 *     lost, no answer within timeout_ms) makes the client redo the step itself, client-driven,
 *     from hidden_valid: hop 0 rewinds to it, every hop recomputes the rows since, a failed hop
 *     is replaced and replayed as in note 2. Results equal an uninterrupted run because a row's
 *     result does not depend on how rows were split into requests (note 1); the price of a
 *     failure in relay mode is recomputing the positions since hidden_valid on every hop.
 *     Steps that cannot be relayed (more rows than one request, a hop that needs a replay, an
 *     address over WIRE_MAX_ADDR bytes) go client-driven.
 *  8. Sampling (opts.sample): the tail shard runs sampler_pick with the step's settings for the
 *     position after the step and answers the token (FORWARD out_mode SAMPLE): a reply of
 *     8 + 8 x n_top bytes instead of n_vocab floats. The draw depends only on (seed, position)
 *     (sampler.c note 7), so retries, replays and re-routes give the same token.
 */
#ifndef KVS_ROUTE_H
#define KVS_ROUTE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "log.h"
#include "netio.h"
#include "sampler.h"
#include "tokenizer.h"
#include "wire.h"

#define ROUTE_MAX_HOPS 256u                       /* hops (or spares) in one spec */
#define ROUTE_ADDR_MAX (NETIO_HOST_MAX + 8u)      /* "host:port" text, NUL included */
#define ROUTE_DEFAULT_REPLAY_BYTES (256ull << 20) /* replay memory per session, default cap */

typedef struct route route;
typedef struct route_session route_session;

/* Receives one line (no trailing newline) per recovery event; the line is valid during the call.
 * The log type of every module (log.h). */
typedef kvs_log_fn route_log_fn;

typedef struct {
    int64_t timeout_ms; /* connect deadline and reply deadline of every request; < 0: none */
    const char *auth;   /* HELLO auth token; NULL or "" = none; copied by route_open */
    /* Mutual TLS 1.3 to every hop and spare when all three are set (tls.h): this client's
     * certificate and key, and the cluster CA the shards' certificates must chain to. */
    const char *tls_cert, *tls_key, *tls_ca;
    route_log_fn log;   /* recovery events; NULL: silent */
    void *log_user;     /* passed to log */
    bool hidden_f16;    /* hidden states travel (and are remembered for replay) as f16: half the
                           wire bytes and replay memory; every hop after the head must take f16.
                           false (f32): outputs equal a one-process run bit for bit */
    bool hidden_bf16;   /* the same with bfloat16 (protocol v2 hops): the f32 exponent range, an
                           8-bit mantissa. At most one of hidden_f16 / hidden_bf16 */
    uint64_t max_replay_bytes; /* cap on one session's replay memory, bytes (design note 6);
                                  0: ROUTE_DEFAULT_REPLAY_BYTES */
    /* Called when a hop failed and no spare serves its [first, last): a spec of more candidates
     * ("h:p,...", malloc'd, freed by the route; NULL: none), e.g. the live shards of a cluster
     * registry. They join the spares and are checked like them. NULL: only the given spares. */
    char *(*more_spares)(void *ctx, uint32_t first, uint32_t last);
    void *more_spares_ctx;
    /* Called with every hop's and spare's INFO once it is read (route_open, re-routes): non-zero
     * refuses that shard, msg saying why (e.g. a registry entry its INFO contradicts). NULL: none. */
    int (*check_hop)(void *ctx, const char *addr, const struct wire_info *info, char *msg, size_t cap);
    void *check_hop_ctx;
    /* A hop lost (connection closed, refused) is first called again at the same address for
     * this long: a shard restarted with --state-dir is back with the sessions it held, so the
     * step goes on with cache hits (same epoch, nothing replayed) instead of failing over.
     * 0: fail over at once. */
    int64_t reconnect_grace_ms;
} route_params;

/* timeout_ms 30000, no auth, no TLS, no log, f32 hidden states, 256 MiB replay cap. */
route_params route_default_params(void);

/* One "host:port" of a spec. */
typedef struct {
    char host[NETIO_HOST_MAX];
    uint16_t port;
    char text[ROUTE_ADDR_MAX]; /* as written in the spec, for messages */
} route_addr;

/* Parses "h:p,h:p,..." (IPv6 as "[addr]:port"; spaces around entries are ignored). On success
 * *out is a malloc'd array of *n (1..ROUTE_MAX_HOPS) entries owned by the caller (free()).
 * KVS_ERR_INVALID_ARG for an empty spec, an empty entry, a malformed entry (msg names it) or
 * too many entries; KVS_ERR_NOMEM. On failure *out is NULL and *n 0. */
int route_parse_spec(const char *spec, route_addr **out, size_t *n, char *msg, size_t msg_cap);

/* Checks that hops whose INFO is infos[0..n) form a route: same model digest, n_layer, n_embd
 * and n_vocab as hop 0; hop 0 starts at layer 0; each hop starts where the previous one ends;
 * the last hop ends at n_layer; every hop takes f32 hidden input. addrs[k] names hop k in
 * messages. KVS_OK, or KVS_ERR_INVALID_ARG with a message naming the first offending hop, e.g.
 * "hop 2 (127.0.0.1:7002) serves layers [3, 5) but the previous hop ends at 4". Pure. */
int route_check_hops(const struct wire_info *infos, const char *const *addrs, size_t n, char *msg,
                     size_t msg_cap);

/* Connects every hop of route_spec (each within timeout_ms), says HELLO, reads INFO and checks
 * the route (route_check_hops). spares_spec (NULL or "" = none) lists replacement shards; they
 * are connected only when a hop fails, and used only if they serve the failed hop's exact layer
 * range of the same model. On success *out is a new route owned by the caller (route_close).
 * Failure: *out NULL, everything closed, and the code of the first problem — KVS_ERR_INVALID_ARG
 * (bad spec, route does not fit together, shard refused HELLO), KVS_ERR_IO / NOT_FOUND / TIMEOUT /
 * CLOSED (a hop unreachable), KVS_ERR_PROTOCOL (a hop does not speak the protocol) — with a
 * message naming the hop. */
int route_open(const char *route_spec, const char *spares_spec, const route_params *p, route **out,
               char *msg, size_t msg_cap);

/* Closes every connection and frees the route; NULL is fine. Sessions of the route must have
 * been released (route_release) before. */
void route_close(route *r);

/* Shape of the route as it stands now (after any re-route). */
typedef struct {
    uint32_t n_hops;
    uint32_t n_layer, n_embd, n_vocab;
    uint32_t max_ctx;  /* positions per session: the smallest max_ctx of the hops, and no more than
                          max_replay_bytes / (4 + (n_hops - 1) x n_embd x (2 or 4)) */
    uint32_t max_rows; /* rows per request: smallest max_tokens, within the payload limit */
    uint8_t model_digest[WIRE_DIGEST_SIZE];
    uint64_t bytes_sent, bytes_received; /* frame bytes exchanged with hops so far */
    uint32_t reroutes;                   /* hops replaced by spares so far */
    uint32_t relay_steps;                /* steps completed by relay */
    uint32_t relay_fallbacks;            /* relayed steps redone client-driven (design note 7) */
    uint64_t replayed_positions;         /* positions re-sent to a hop because it lacked them */
    uint32_t reconnects;                 /* hops called again at the same address (reconnect_grace_ms) */
    uint32_t moved;                      /* hops switched to the shard a session was moved to (MOVED) */
} route_info;
void route_get_info(const route *r, route_info *out);

/* Address ("host:port") of hop k as it stands now, or NULL when k is out of range. Valid until
 * the next route_forward or route_close. */
const char *route_hop_addr(const route *r, uint32_t k);

/* Builds the tokenizer from the head shard's VOCAB pages (tok_from_arrays). On success *out is
 * a new vocab owned by the caller (tok_free). KVS_ERR_UNSUPPORTED when the shard's tokenizer is
 * neither "llama" nor "gpt2"; KVS_ERR_PROTOCOL for inconsistent pages; transport errors as route_open; a shard
 * status as answered. *out NULL on failure; the route stays usable unless hop 0's connection
 * failed. */
int route_fetch_vocab(route *r, tok_vocab **out, char *msg, size_t msg_cap);

/* Starts a session on r: a random route_session_id (getrandom), epoch 1, position 0. Nothing is
 * sent until route_forward. *out is owned by the caller until route_release. KVS_ERR_IO when no
 * random bytes could be read; KVS_ERR_NOMEM. */
int route_session_open(route *r, route_session **out, char *msg, size_t msg_cap);

/* Appends tokens[0..n) at the session's position and writes the last position's logits
 * (n_vocab floats) to logits_last. Requests are split to fit every hop's max_tokens and the
 * payload limit; failures are recovered as in design note 2. On success the position advances
 * by n. Failure codes: KVS_ERR_INVALID_ARG (n == 0, a token id outside the vocab, NULL
 * argument), KVS_ERR_CONTEXT_FULL (position + n > max_ctx; nothing sent), KVS_ERR_STALE_EPOCH,
 * the transport error of a failed hop when no spare can replace it, or the status a shard
 * answered (BUSY after timeout_ms, BUDGET_EXHAUSTED, ...). msg says which hop and why. After a
 * failure other than INVALID_ARG / CONTEXT_FULL the session's state along the route is
 * unspecified: release it. */
int route_forward(route *r, route_session *s, const int32_t *tokens, uint32_t n, float *logits_last,
                  char *msg, size_t msg_cap);

/* How route_step drives one step. */
typedef struct {
    bool sample;             /* the tail samples (design note 7) into *res; else logits into logits_last */
    sampler_params sp;       /* with sample */
    uint32_t n_top;          /* with sample: top log-probs wanted, <= WIRE_MAX_TOP */
    const int32_t *window;   /* with sample: penalty window; sent only when a penalty is on */
    uint32_t n_window;       /* <= WIRE_MAX_WINDOW */
    bool relay;              /* shard-to-shard relay (design note 7); false: client-driven. Hidden rows
                                are pushed in the route's dtype (route_params.hidden_f16 / hidden_bf16) */
} route_step_opts;

/* Logits, client-driven, f32. */
route_step_opts route_default_step_opts(void);

/* route_forward with options: with o->sample the tail's sample goes to *res (logits_last unused,
 * may be NULL), else the logits to logits_last (res unused). Relay as in design note 7. Same
 * failure codes as route_forward, plus KVS_ERR_UNSUPPORTED when sampling is asked of a tail that
 * speaks protocol version 1 only, KVS_ERR_INVALID_ARG for bad options. */
int route_step(route *r, route_session *s, const int32_t *tokens, uint32_t n, const route_step_opts *o,
               float *logits_last, sampler_result *res, char *msg, size_t msg_cap);

/* Positions the session has completed along the route. */
uint32_t route_session_pos(const route_session *s);
/* Positions of the session's first step that no hop computed: taken from the shards' shared
 * prefix blocks (protocol v3; 0 otherwise). */
uint32_t route_session_cached(const route_session *s);
/* Seeds the session's chain hashes (before its first step; default 0): shards share prefix
 * blocks per connection identity, so a client serving several tenants of its own over one
 * identity (api) gives each its own salt to keep them from sharing (docs/security.md). */
void route_session_prefix_salt(route_session *s, uint64_t salt);
/* The session's first n full blocks are an operator's public prefix: their chain is unsalted, so
 * they are shared with every session whose tokens start the same; the salt enters the chain right
 * after them (docs/security.md). Before the first step; default 0. */
void route_session_public_blocks(route_session *s, uint32_t n);
/* The session's route_session_id. */
void route_session_id(const route_session *s, uint8_t out[WIRE_SID_SIZE]);
/* Current epoch of the session (1 + the re-routes it went through). */
uint64_t route_session_epoch(const route_session *s);
/* Bytes the session's replay memory holds now (allocated): at most max_replay_bytes. */
uint64_t route_session_replay_bytes(const route_session *s);

/* Moves the session back to position pos (<= route_session_pos(s)): the next route_forward
 * appends at pos, and each hop drops its positions past pos when that request reaches it (a
 * FORWARD with start_pos < n_past rewinds, DESIGN.md §2), so a caller can reuse a session's
 * common prefix with a new input. Nothing is sent. KVS_OK, or KVS_ERR_INVALID_ARG (NULL s, pos
 * past the session's position) with the session unchanged. */
int route_session_rewind(route_session *s, uint32_t pos);

/* Sends RELEASE for the session to every hop that holds state for it (errors ignored: a shard
 * that is gone frees it by TTL), then frees the session. NULL s is fine. */
void route_release(route *r, route_session *s);
/* Frees the session without telling the shards (their state stays until TTL / LRU eviction or
 * a later RELEASE). NULL is fine. */
void route_session_forget(route_session *s);

#endif /* KVS_ROUTE_H */
