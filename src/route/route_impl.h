/*
 * route_impl — the parts of the route client shared between its files (private to src/route/).
 * route.h holds the contract (design notes 1-8); this file holds how the code keeps it.
 *
 *   route.c          route_open / route_close, the route's limits (max_ctx, max_rows) and shape
 *   route_check.c    "h:p,h:p" specs; the check that hops form one route of one model
 *   route_hop.c      one connection: connect + TLS + HELLO/INFO, one request and its reply
 *   route_spare.c    failover: a spare takes a failed hop's place; the session's epoch moves on
 *   route_session.c  sessions: id, replay memory, rewind, RELEASE
 *   route_step.c     route_step: the client-driven step with replay, backoff and failover
 *   route_relay.c    relayed steps: RELAY_LISTEN, one FORWARD to the head, the tail's answer
 *   route_vocab.c    route_fetch_vocab: the tokenizer from the head's VOCAB / VOCAB_META pages
 *
 * NOTES ON THE DESIGN
 *
 * Ownership. The caller owns a route (route_open .. route_close) and its sessions
 * (route_session_open .. route_release / route_session_forget, all before route_close). The
 * route owns every connection (hops and spares), the TLS context, one encode buffer (r->tx) and
 * one receive buffer (r->rx: the payload of the last reply, valid until the next request). A
 * session owns its replay memory (tokens, hidden[k]) and points at its route; during a step it
 * borrows the caller's options and result (s->opts, s->res), which are not used after it.
 *
 * Locks: none. A route is driven by one thread at a time (route.h note 5): every request is
 * sent and its reply awaited before the next, so one tx/rx pair serves all hops. Request ids
 * grow per route (r->next_rid); a frame with a lower id is a late answer to an attempt that
 * was given up and is dropped (route_hop_call, relay_wait).
 *
 * A hop is a slot of r->hops, in layer order. Its connection:
 *
 *     (slot) --route_hop_connect: TCP, TLS, HELLO, INFO--> connected
 *     connected --hop_listen: RELAY_LISTEN OK--> connected + listening (I7)
 *     connected --any failed route_hop_call (a STATUS in place of the reply included), a
 *                 failure in relay_wait or the relayed send, a reply of the wrong shape
 *                 (hop_send)--> disconnected (route_hop_disconnect, fd -1)
 *     connected, the shard closed it while idle --route_refresh_links (before each step and
 *                 RELEASE): HELLO on a new connection--> connected (same model and layers) or
 *                 disconnected
 *     disconnected by a transport error in a step --route_hop_reconnect, once per hop and step:
 *                 the shard may have closed the idle link just after route_refresh_links
 *                 looked--> connected (same model and layers: the step is tried again there)
 *     disconnected --route_reroute / route_fetch_vocab: route_take_spare--> a spare's
 *                 connection in the slot, r->hop_gen[k]++; no usable spare: the call fails
 *     any --route_close--> closed
 *
 * route_open connects every hop; a hop it cannot reach takes the first spare that starts at
 * the same layer (route_open_spare, no hop_gen bump: no session exists yet). A spare's state
 * (r->spare_state[j], enum spare_state):
 *
 *     UNTRIED --connected, INFO read--> KNOWN --chosen: moved into r->hops--> USED
 *     UNTRIED / KNOWN --a refusal (HELLO refused, host not found); in route_take_spare also
 *                       another model or no hidden dtype of ours--> DEAD
 *     a spare that could not be reached (IO, TIMEOUT, CLOSED) stays as it was: the network may
 *     come back. A KNOWN spare of other layers is disconnected and kept for the hop it fits.
 *     route_open_spare counts PROTOCOL as unreachable (route_is_transport_error),
 *     route_take_spare as a refusal.
 *
 * A session along the route: s->pos (positions done), s->hidden_valid (I6), s->epoch, and per
 * hop k what that hop holds of it, s->hop_epoch[k] (I3) and s->hop_gen[k] (I4):
 *
 *     hop_epoch[k] == 0           the hop holds nothing we know of (new session, new hop): its
 *                                 next request first replays inputs [0, start) from memory
 *     0 < hop_epoch[k] < epoch    it holds [0, start) in an older epoch: the next FORWARD
 *                                 carries INHERIT(hop_epoch[k], start), nothing recomputed
 *     hop_epoch[k] == epoch       plain append
 *
 * The transitions of a session, all in route_step (route_forward is route_step with logits):
 *
 *  1. Check the arguments and the context (step_check); copy the tokens into memory
 *     (route_session_reserve).
 *  2. A hop replaced since this session's last step (s->hop_gen[k] != r->hop_gen[k]) gets
 *     hop_epoch 0, and the epoch goes up once.
 *  3. Relay, when route_relay_possible: route_relay_step sends one FORWARD to hop 0 with the
 *     rest of the route in a relay block and waits on every connection. Completed: pos = end,
 *     every hop_epoch = epoch, hidden_valid unchanged (the client never saw the hidden rows).
 *     Anything else: r->relay_fallbacks++ and go to 4 (a hop lost in the attempt is at fd -1).
 *  4. A client-driven attempt from hidden_valid (step_attempt): for each chunk [a, b) of at
 *     most max_rows rows, hop 0 .. n-1 in order, hop_append brings the hop to position a and
 *     sends [a, b) (hop_send: hop_encode, the call, the shape check, hop_store); each hop's
 *     output is stored as the next hop's input (I1). hop_append replays [0, a) to a hop with
 *     hop_epoch 0 (merged into the request when it fits, I2), replays [have, a) on CACHE_MISS
 *     (at most ROUTE_MAX_MISSES in a row), retries BUSY with backoff until timeout_ms, and
 *     turns any other status into HOP_FATAL. A hop left at fd -1 by 3 fails the attempt at once
 *     (HOP_FAILED). Done: pos = hidden_valid = end.
 *  5. HOP_FAILED at hop k (transport; route_is_transport_error): route_reroute puts a spare in
 *     its slot, sets hop_epoch[k] = 0, epoch++, r->reroutes++, and 4 runs again from
 *     hidden_valid. Each failed attempt uses up a spare, so the loop ends. No spare, or
 *     HOP_FATAL: the step fails and the session's state along the route is unspecified.
 *
 * route_session_rewind moves pos (and hidden_valid) back; nothing is sent, the hops drop the
 * positions past it when the next FORWARD reaches them. route_release sends RELEASE to every
 * hop that holds the session in the generation we know, then frees it.
 *
 * Failover and replay, the rule: the client keeps every input it sent to every hop (I1), so any
 * hop can be rebuilt from memory, and a new epoch tells the old shard's state apart from the
 * new one's. Results equal an uninterrupted run because a row's result does not depend on how
 * rows were split into requests (route.h note 1).
 *
 * Bounds. What a shard can make the client allocate is checked before the allocation:
 * route_reply_limit caps a reply by its op, ROUTE_MAX_* cap the vocab; replay memory is capped
 * by max_replay_bytes through max_ctx (route_limits).
 *
 * Invariants
 *  I1. s->tokens[0..pos) and s->hidden[k][0..pos) (k >= 1) hold the inputs hop k was sent for
 *      every completed position; during a step, s->hidden[k][start..b) is filled as soon as
 *      hop k-1 answered for rows [start, b).
 *  I2. A replay is merged into the request it precedes whenever the rows fit in one request
 *      (route.h design note 1).
 *  I3. s->hop_epoch[k] is the epoch in which hop k (as it stands in the route) holds the
 *      session's state, 0 when it holds none we know of. It becomes s->epoch on every OK reply
 *      (hop_send, route_relay_step). A FORWARD to a hop with 0 < hop_epoch < epoch carries
 *      INHERIT(hop_epoch, start_pos).
 *  I4. s->hop_gen[k] == r->hop_gen[k] unless hop k was replaced since this session last used
 *      it; route_forward then treats it as a fresh hop (design note 5 of route.h).
 *  I5. A hop's fd is -1 only while it is being replaced; route_forward returns with every hop
 *      connected or with an error (route_relay_step may leave a lost hop at -1; the client-driven
 *      redo that follows replaces it).
 *  I6. s->hidden_valid <= s->pos: the per-hop memory holds every input of positions
 *      [0, hidden_valid); relayed steps do not extend it (route.h design note 7). A client-driven
 *      step starts at hidden_valid and ends with hidden_valid == pos.
 *  I7. hop->listening: RELAY_LISTEN(r->relay_id) was answered OK on this connection.
 *  I8. Shared prefix (protocol v3, every hop): each driven FORWARD carries the chain hashes of the
 *      16-position blocks it completes (of every block from 0 to a hop that may not hold the
 *      session). A new session's first step starts at s->skip, the last 16-position edge before
 *      its end: each hop takes [0, skip) from its prefix cache or answers CACHE_MISS(have). So
 *      s->hidden[k][0..skip) (k >= 1) were never computed: a hop past the head that needs them
 *      (have < skip) makes the step start over in a new epoch from have (HOP_PREFIX_SHORT, skip =
 *      have rounded down), down to 0 at worst. A new head that holds less (its CACHE_MISS
 *      changed nothing, no hop was asked yet) moves the step's start there in the same epoch.
 */
#ifndef KVS_ROUTE_IMPL_H
#define KVS_ROUTE_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "log.h"
#include "netio.h"
#include "route.h"
#include "sampler.h"
#include "tls.h"
#include "wire.h"

/* Payload bytes of a FORWARD before the data, and of a FORWARD_REPLY before the data. */
#define FWD_HEAD_BYTES 60u
#define FWD_REPLY_HEAD_BYTES 32u
#define ROUTE_MAX_MISSES 32 /* CACHE_MISS answers in a row tolerated for one request */
#define ROUTE_MAX_RECONNECTS 3 /* reconnects at the same address within one step */
/* Bounds on what a (possibly hostile) shard can make the client allocate, checked as each size
 * arrives, before any allocation for it. */
#define ROUTE_MAX_TOKEN_BYTES 4096u          /* one vocab token's text (the tokenizer's limit) */
#define ROUTE_MAX_VOCAB_TEXT (32u << 20)     /* all vocab token texts together, bytes */
#define ROUTE_MAX_SMALL_REPLY 4096u          /* INFO, STATUS payload bytes */

enum spare_state { SPARE_UNTRIED = 0, SPARE_KNOWN, SPARE_USED, SPARE_DEAD };

typedef struct {
    route_addr addr;
    int fd;                /* -1 when not connected */
    struct wire_info info; /* valid once connected (hops) / when SPARE_KNOWN or USED (spares) */
    bool listening;        /* I7 */
} route_hop;

struct route {
    route_params p;
    char *auth;              /* copy of p.auth, "" when none */
    tls_ctx *tls;            /* NULL: plaintext */
    route_hop *hops;         /* (n_hops) in layer order */
    uint32_t *hop_gen;       /* (n_hops) bumped each time hop k is replaced */
    uint32_t n_hops;
    route_hop *spares;       /* (n_spares) */
    uint8_t *spare_state;    /* (n_spares) enum spare_state */
    uint32_t n_spares;
    uint8_t digest[WIRE_DIGEST_SIZE];
    uint32_t n_layer, n_embd, n_vocab;
    uint32_t max_ctx;        /* positions, min over hops and the replay memory cap */
    size_t hid_elem;         /* bytes of one hidden element on the wire and in replay memory: 4 (f32),
                                2 (f16, bf16) */
    uint32_t hid_kind;       /* their wire_in_kind: WIRE_IN_HIDDEN_F32, _F16 or _BF16 */
    uint16_t hid_bit;        /* the matching enum wire_dtype_bit */
    const char *hid_name;    /* "f32", "f16" or "bf16", for messages */
    uint32_t max_rows;       /* rows per FORWARD, min over hops and payload limit */
    uint8_t *tx;             /* encode buffer */
    size_t tx_cap;           /* bytes */
    struct netio_buf rx;     /* last reply */
    uint64_t next_rid;
    float *scratch_logits;   /* (n_vocab) logits of intermediate chunks, discarded */
    uint64_t bytes_sent;     /* frame bytes (header + payload) written to hops */
    uint64_t bytes_received; /* frame bytes read from hops */
    uint32_t reroutes;       /* hops replaced by spares */
    uint64_t replayed;       /* positions re-sent to a hop that lacked them (replays) */
    uint32_t reconnects;     /* hops reconnected at the same address within the grace */
    uint32_t moved;          /* hops switched on a MOVED answer */
    uint64_t relay_id;       /* random, names this client's connections in relay blocks */
    uint32_t relay_steps, relay_fallbacks;
    struct wire_forward *fwd; /* encode scratch for relayed FORWARDs (large: relay block) */
    uint64_t *hashes;         /* chain hash scratch (I8), hashes_cap entries */
    uint32_t hashes_cap;
};

struct route_session {
    route *r;
    uint8_t sid[WIRE_SID_SIZE];
    uint64_t epoch;
    uint32_t pos;            /* positions completed along the whole route */
    uint32_t hidden_valid;   /* I6 */
    const route_step_opts *opts; /* the step being driven */
    sampler_result *res;     /* its sample, with opts->sample */
    uint32_t cap;            /* rows allocated in tokens and hidden[k] */
    int32_t *tokens;         /* (cap) hop 0 inputs */
    uint8_t **hidden;        /* [n_hops] (cap, n_embd) inputs of hop k, hid_elem bytes each (f32 or f16
                                in host order); hidden[0] NULL */
    uint64_t *hop_epoch;     /* (n_hops) I3 */
    uint32_t *hop_gen;       /* (n_hops) I4 */
    uint32_t skip;           /* I8: positions [0, skip) taken from the hops' prefix caches */
    uint32_t short_have;     /* HOP_PREFIX_SHORT: positions the hop holds */
    uint32_t cached;         /* positions of its first step no hop computed (I8) */
    uint64_t prefix_salt;    /* I8: the chain's seed; sessions share blocks only with equal salts */
    uint32_t public_blocks;  /* leading blocks chained unsalted (an operator's public prefix) */
};

/* Result of one request to a hop, as route_forward sees it. */
enum hop_result {
    HOP_OK = 0,
    HOP_FAILED, /* transport: the hop is gone; re-route */
    HOP_FATAL,  /* the step cannot go on; rc + msg say why */
    HOP_PREFIX_SHORT, /* a hop past the head lacks prefix positions whose inputs were never computed
                         (I8): redo from s->short_have in a new epoch */
};

/* Recovery events (route.h design note 4). */
#define route_log(r, ...) kvs_logf((r)->p.log, (r)->p.log_user, __VA_ARGS__)

/* ---- validation (route_check.c) ------------------------------------------------------------ */

/* Same model and shape as ref? Else KVS_ERR_INVALID_ARG with a message naming hop `what`. */
int route_check_same_model(const struct wire_info *ref, const char *ref_name, const struct wire_info *x,
                           const char *what, char *msg, size_t msg_cap);

/* ---- one request on one connection (route_hop.c) ------------------------------------------- */

/* Closes h's connection (fd -1, not listening). */
void route_hop_disconnect(route_hop *h);
/* Makes room for need bytes in r->tx. */
int route_tx_reserve(route *r, size_t need);
/* Largest payload a reply of reply_op may announce. */
uint32_t route_reply_limit(const route *r, uint16_t reply_op);
/* Sends r->tx[0..len) as an op frame on h and waits for its reply_op reply into r->rx; any
 * other outcome disconnects h. */
int route_hop_call(route *r, route_hop *h, uint16_t op, size_t len, uint16_t reply_op, char *why, size_t why_cap);
/* Connects h, TLS, HELLO, reads its INFO into h->info. */
int route_hop_connect(route *r, route_hop *h, char *why, size_t why_cap);
/* Connects h again at its address and checks it serves the same model and layers as before
 * (INVALID_ARG, disconnected, when not); h->info keeps the old INFO on failure. */
int route_hop_reconnect(route *r, route_hop *h, char *why, size_t why_cap);
/* Reconnects (HELLO) the hops whose links the shard closed while idle; see route_hop.c. */
void route_refresh_links(route *r);
/* IO, TIMEOUT, CLOSED, PROTOCOL: the hop is gone, as opposed to a refusal. */
bool route_is_transport_error(int rc);

/* ---- limits (route.c) ----------------------------------------------------------------------- */

/* Replay memory of one position, bytes. */
uint64_t route_position_bytes(const route *r);
/* Recomputes r->max_ctx and r->max_rows from the hops and the replay cap. */
void route_limits(route *r);

/* ---- failover (route_spare.c) --------------------------------------------------------------- */

/* route_open: hop k unreachable; the first spare starting at layer first takes its place. */
int route_open_spare(route *r, uint32_t k, uint32_t first);
/* A spare serving hop k's exact layers of the same model takes its place; r->hop_gen[k]++. */
int route_take_spare(route *r, uint32_t k);
/* Hop k failed: calls its address again within reconnect_grace_ms; true when the same model and
 * layers answer there (the session goes on at its epoch). */
bool route_reconnect(route *r, uint32_t k, const char *why);
/* Hop k answered MOVED with the address `to`: connects it (same model, same layers) and puts it
 * in hop k's place; the session goes on at its epoch there. */
int route_follow_move(route *r, uint32_t k, const char *to, char *msg, size_t msg_cap);
/* Hop k failed with err: take a spare and move the session to a new epoch. */
int route_reroute(route *r, route_session *s, uint32_t k, int err, const char *why, char *msg, size_t msg_cap);

/* ---- sessions (route_session.c) ------------------------------------------------------------- */

/* Grows the session's replay memory to rows positions. */
int route_session_reserve(route_session *s, uint32_t rows);

/* ---- the step (route_step.c) and relayed steps (route_relay.c) ------------------------------ */

/* The sampler block of a SAMPLE request. */
void route_fill_sample(const route_step_opts *o, struct wire_sample_req *q);
/* A decoded SAMPLE reply into *res. */
void route_reply_to_sample(const struct wire_forward_reply *rep, sampler_result *res);
/* True when every hop speaks protocol v3 (I8). */
bool route_prefix_ok(const route *r);
/* Fills f's prefix block (I8) for rows [from, to) of s, every block from 0 when from_zero, from
 * r->hashes; KVS_ERR_NOMEM when the scratch cannot grow. */
int route_fill_prefix(route *r, const route_session *s, uint32_t from, uint32_t to, bool from_zero,
                      struct wire_forward *f);
/* Can the step [base, end) be relayed (route.h note 7)? */
bool route_relay_possible(const route *r, const route_session *s, uint32_t base, uint32_t end);
/* One relayed attempt of the step [base, end); false: redo it client-driven (why says why), or,
 * when hop *moved_hop (else -1) answered MOVED, follow it (why: the address) and send it again. */
bool route_relay_step(route *r, route_session *s, uint32_t base, uint32_t end, float *logits_last, int *moved_hop,
                      char *why, size_t why_cap);

#endif /* KVS_ROUTE_IMPL_H */
