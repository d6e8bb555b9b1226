/*
 * relay — shard-to-shard push of a step's hidden states (docs/protocol.md §4.12, DESIGN.md §3).
 *
 * A shard that computed its layers for a FORWARD carrying a relay block hands the next hop's
 * FORWARD to relay_push(); a per-destination link delivers it over one persistent connection
 * (connected and greeted with HELLO on first use, reconnected after a failure). The shard never
 * waits for the downstream shard: the downstream answers the client itself (RELAY_LISTEN), so the
 * scheduler takes the next session's step at once (pipelining).
 *
 * Design notes
 *  1. One link per "host:port", one worker thread per link, a FIFO queue per link: pushes to one
 *     next hop keep their order; a slow or dead next hop never blocks pushes to another one, and
 *     never the caller (relay_push only queues).
 *  2. Every push ends in exactly one call of relay_params.done, from the link's thread (or from
 *     relay_push / relay_destroy when it cannot be queued): status KVS_OK when the frame was
 *     written to the next hop's socket, else the error and a message naming the hop ("cannot
 *     connect: ...", "refused HELLO: ..."). The caller answers its client on failure.
 *  3. The downstream sends nothing back on success. Anything it does send on the link (an error
 *     for a relay_id it does not know) is read (whole frames) and logged before the next push; an EOF there
 *     marks the link broken, so the next push reconnects. The client, waiting on its own
 *     connections, times out and falls back to driving the step itself (route.c design note 6).
 *  4. The listen table maps a client's relay_id to the connection it registered with
 *     RELAY_LISTEN, and to the identity that registered it: only that identity may move it
 *     (a reconnect); it is bounded in all and per connection, hashed by id and by target.
 *     Entries are opaque pointers; relay_listen_take() calls the caller's ref function under
 *     the table lock, so an entry found is never freed under the finder as long as the owner
 *     calls relay_listen_drop() before dropping its own reference.
 *  5. Links are bounded: only next hops the operator allowed are connected (relay_allowed: the
 *     allow list, else loopback hops from a loopback-only shard), addresses are numeric and
 *     canonical (relay_canon_addr: "127.0.0.1:080" and "127.0.0.1:80" are one link; no name is
 *     resolved), at most max_links are open, and a link with nothing queued for idle_ms closes
 *     and ends its thread. Queued payload bytes over all links stay under max_queued_bytes;
 *     after a failed connect the link is down for retry_ms and pushes to it fail at once.
 */
#ifndef KVS_RELAY_H
#define KVS_RELAY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "log.h"

typedef struct relay relay;

/* Outcome of one push (design note 2). target and request_id are those given to relay_push. */
/* len is the payload's byte count as given to relay_push (for the caller's accounting). */
typedef void (*relay_done_fn)(void *ctx, void *target, uint64_t request_id, uint16_t hop, const char *addr,
                              size_t len, int status, const char *why);
typedef kvs_log_fn relay_log_fn; /* one event line, as every module's log (log.h) */

typedef struct {
    int64_t timeout_ms;  /* connect, HELLO and send deadline per push; < 0: none */
    const char *auth;    /* HELLO auth token for next hops; NULL = none; copied */
    struct tls_ctx *tls; /* client-side TLS context for next hops (not owned); NULL: plaintext */
    const char *allow;   /* "HOST:PORT,..." numeric next hops allowed; NULL/"": allow_loopback rules */
    bool allow_loopback; /* without an allow list: loopback next hops allowed (else none) */
    int max_links;       /* links open at once; more: KVS_ERR_BUSY */
    int64_t idle_ms;     /* a link with nothing queued this long closes; <= 0: never */
    int64_t retry_ms;    /* after a failed connect, pushes to that hop fail at once this long */
    size_t max_queued_bytes; /* payload bytes queued or being sent over all links; more: BUSY */
    int max_listeners;   /* RELAY_LISTEN registrations held at once; more: KVS_ERR_BUSY */
    int max_listeners_per_target; /* registrations one target (connection) holds; more: BUSY */
    relay_done_fn done;  /* required */
    relay_log_fn log;    /* link events (connected, failed); NULL: silent */
    void *ctx;           /* passed to done and log */
} relay_params;

/* timeout 10000 ms, no auth, no callbacks, no allow list and no loopback (nothing allowed), 64
 * links, idle 60 s, retry 1 s, 256 MiB queued, 4096 registrations, 16 per target. */
relay_params relay_default_params(void);

/* KVS_OK with *out a new relay (relay_destroy); KVS_ERR_INVALID_ARG without a done callback or
 * with an allow list entry that is not a numeric HOST:PORT; KVS_ERR_NOMEM. */
int relay_create(const relay_params *p, relay **out);

/* Stops and joins every link: pushes still queued end with done(KVS_ERR_CLOSED); the listen
 * table stays usable. Idempotent. No relay_push may run concurrently or later. */
void relay_stop(relay *r);

/* relay_stop, then frees r (the listen table included). NULL is fine. */
void relay_destroy(relay *r);

/* Queues payload[0..len) (a FORWARD payload; ownership passes to the relay, freed with free())
 * for the shard at addr ("host:port"), frame request id request_id. hop is the index of that
 * shard in the route, for messages. Never blocks on the network. The outcome comes through
 * done (design note 2), also when queueing fails. Thread-safe. */
void relay_push(relay *r, const char *addr, uint16_t hop, uint8_t *payload, size_t len, uint64_t request_id,
                void *target);

/* The canonical form of a numeric "HOST:PORT" ("a.b.c.d:port" or "[v6]:port", port in decimal
 * without leading zeros) into out; KVS_OK, or KVS_ERR_INVALID_ARG for a host name, port 0 or a
 * malformed address (no name is resolved). */
#define RELAY_ADDR_MAX 64
int relay_canon_addr(const char *addr, char out[RELAY_ADDR_MAX]);

/* True when addr is a next hop this relay may connect to (design note 5). */
bool relay_allowed(const relay *r, const char *addr);

/* Builds the FORWARD payload that carries a computed step on to the next hop: rl->next[0]'s
 * inherit fields, out_mode and sample as received, hidden rows (n, n_embd) converted to
 * rl->hidden_kind, and the relay block of the hops after next[0] (hop + 1). rl->n_next must be
 * >= 1. KVS_OK with *payload (malloc'd, owned by the caller) of *len bytes; an encoder error
 * (KVS_ERR_TOO_LARGE, KVS_ERR_INVALID_ARG) or KVS_ERR_NOMEM, *payload NULL. */
struct wire_relay;
struct wire_sample_req;
struct wire_prefix;
/* prefix: the chain hashes the step came with (protocol v3), passed on as they are; NULL: none. */
int relay_build_next(const struct wire_relay *rl, const uint8_t sid[16], uint64_t epoch, uint32_t start_pos,
                     uint32_t n, uint32_t out_mode, const struct wire_sample_req *sample,
                     const struct wire_prefix *prefix, const float *hidden, uint32_t n_embd, uint8_t **payload,
                     size_t *len);

/* ---- listen table (design note 4) ---- */

/* Registers target for relay_id on behalf of identity owner (a tenant tag). An id registered
 * by the same owner moves to target; KVS_ERR_INVALID_ARG when another owner holds it (nothing
 * changes); KVS_ERR_BUSY past max_listeners or max_listeners_per_target; KVS_ERR_NOMEM. O(1):
 * a keyed hash of the id (clients pick ids, so they cannot pick buckets). */
int relay_listen_add(relay *r, uint64_t relay_id, uint64_t owner, void *target);
/* The target registered for relay_id, with ref(target) called under the table lock; NULL when
 * none. */
void *relay_listen_take(relay *r, uint64_t relay_id, void (*ref)(void *target));
/* Removes every registration of target (O(its registrations)). */
void relay_listen_drop(relay *r, void *target);
/* Registrations held now. */
size_t relay_listen_count(relay *r);

/* Counters: pushes written, pushes failed, connections made; links (threads) open now, payload
 * bytes queued now. */
typedef struct {
    uint64_t pushed, failed, connects;
    uint64_t links, queued_bytes;
} relay_stats;
void relay_get_stats(relay *r, relay_stats *out);

#endif /* KVS_RELAY_H */
