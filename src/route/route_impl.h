/*
 * route_impl — the parts of the route client shared between its files (private to src/route/).
 * Client side: route validation, session driving, failure detection, re-route + replay.
 * See route.h for the design notes; the numbered invariants below are what the code keeps.
 *
 * Invariants
 *  I1. s->tokens[0..pos) and s->hidden[k][0..pos) (k >= 1) hold the inputs hop k was sent for
 *      every completed position; during a step, s->hidden[k][start..b) is filled as soon as
 *      hop k-1 answered for rows [start, b).
 *  I2. A replay is merged into the request it precedes whenever the rows fit in one request
 *      (route.h design note 1).
 *  I3. s->hop_epoch[k] is the epoch in which hop k (as it stands in the route) holds the
 *      session's state, 0 when it holds none we know of. It becomes s->epoch on every OK reply
 *      (hop_send). A FORWARD to a hop with 0 < hop_epoch < epoch carries INHERIT(hop_epoch,
 *      start_pos).
 *  I4. s->hop_gen[k] == r->hop_gen[k] unless hop k was replaced since this session last used
 *      it; route_forward then treats it as a fresh hop (design note 5 of route.h).
 *  I5. A hop's fd is -1 only while it is being replaced; route_forward returns with every hop
 *      connected or with an error (route_relay_step may leave a lost hop at -1; the client-driven
 *      redo that follows replaces it).
 *  I6. s->hidden_valid <= s->pos: the per-hop memory holds every input of positions
 *      [0, hidden_valid); relayed steps do not extend it (route.h design note 7). A client-driven
 *      step starts at hidden_valid and ends with hidden_valid == pos.
 *  I7. hop->listening: RELAY_LISTEN(r->relay_id) was answered OK on this connection.
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
    size_t hid_elem;         /* bytes of one hidden element on the wire and in replay memory: 4 (f32) or 2 (f16, bf16) */
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
    uint64_t relay_id;       /* random, names this client's connections in relay blocks */
    uint32_t relay_steps, relay_fallbacks;
    struct wire_forward *fwd; /* encode scratch for relayed FORWARDs (large: relay block) */
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
};

/* Result of one request to a hop, as route_forward sees it. */
enum hop_result {
    HOP_OK = 0,
    HOP_FAILED, /* transport: the hop is gone; re-route */
    HOP_FATAL,  /* the step cannot go on; rc + msg say why */
};

/* Recovery events (route.h design note 4). */
#define route_log(r, ...) kvs_logf((r)->p.log, (r)->p.log_user, __VA_ARGS__)

/* ---- validation (route_check.c) ------------------------------------------------------------ */

/* Same model and shape as ref? Else KVS_ERR_INVALID_ARG with a message naming hop `what`. */
int route_check_same_model(const struct wire_info *ref, const char *ref_name, const struct wire_info *x,
                           const char *what, char *msg, size_t msg_cap);

/* ---- one request on one connection (route_hop.c) ------------------------------------------- */

void route_hop_disconnect(route_hop *h);
int route_tx_reserve(route *r, size_t need);
uint32_t route_reply_limit(const route *r, uint16_t reply_op);
int route_hop_call(route *r, route_hop *h, uint16_t op, size_t len, uint16_t reply_op, char *why, size_t why_cap);
int route_hop_connect(route *r, route_hop *h, char *why, size_t why_cap);
bool route_is_transport_error(int rc);

/* ---- limits (route.c) ----------------------------------------------------------------------- */

uint64_t route_position_bytes(const route *r);
void route_limits(route *r);

/* ---- failover (route_spare.c) --------------------------------------------------------------- */

int route_open_spare(route *r, uint32_t k, uint32_t first);
int route_take_spare(route *r, uint32_t k);
int route_reroute(route *r, route_session *s, uint32_t k, int err, const char *why, char *msg, size_t msg_cap);

/* ---- sessions (route_session.c) ------------------------------------------------------------- */

int route_session_reserve(route_session *s, uint32_t rows);

/* ---- the step (route_step.c) and relayed steps (route_relay.c) ------------------------------ */

void route_fill_sample(const route_step_opts *o, struct wire_sample_req *q);
void route_reply_to_sample(const struct wire_forward_reply *rep, sampler_result *res);
bool route_relay_possible(const route *r, const route_session *s, uint32_t base, uint32_t end);
bool route_relay_step(route *r, route_session *s, uint32_t base, uint32_t end, float *logits_last, char *why,
                      size_t why_cap);

#endif /* KVS_ROUTE_IMPL_H */
