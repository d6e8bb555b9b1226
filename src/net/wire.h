/*
 * wire — the shard <-> client frame codec. Pure byte work: no sockets (netio), no compute.
 *
 * A frame is a fixed 24-byte header followed by payload_len payload bytes. Every integer is
 * little-endian and every field is written and read one at a time (never a struct image);
 * docs/protocol.md is the normative description and lists every byte.
 *
 * Design notes
 *  1. Decoders trust nothing: every count is checked against the bytes left and against a hard
 *     WIRE_MAX_* limit, size math is overflow-checked, enum fields must hold a known value,
 *     reserved fields must be zero and the payload must be consumed exactly. Because of that the
 *     encoding is canonical: for any payload a decoder accepts, encoding the decoded struct gives
 *     back the same bytes (the fuzz target checks this).
 *  2. Encoders validate the same rules, so they never produce a payload the decoder refuses.
 *  3. Small strings (auth token, shard name, status message, stat names) are COPIED into fixed
 *     NUL-terminated arrays in the struct. Bulk data (token ids, hidden states, logits, vocab
 *     entries) is NOT copied: the decoded struct points into the payload buffer, so it is valid
 *     only as long as that buffer is unchanged — in particular only until the next
 *     netio_recv_frame() into the same netio_buf. Those pointers may be unaligned; read them with
 *     the wire_*_get / wire_*_to_f32 helpers (or memcpy).
 *  4. Bulk data fields (`data`) hold elements in wire representation: little-endian i32 / f32 /
 *     IEEE binary16 bits, any alignment. On a little-endian host (x86-64, AArch64) that is simply a
 *     host array, so encoders copy it with one memcpy.
 *  5. Every reply starts with a struct wire_status block. When its status is not KVS_OK the reply
 *     carries nothing else (except STATUS, which always carries a message).
 *
 * Error codes: decoders return KVS_OK or KVS_ERR_PROTOCOL (with a message naming the field);
 * wire_decode_header also returns KVS_ERR_UNSUPPORTED (version) and KVS_ERR_TOO_LARGE (payload
 * over WIRE_MAX_PAYLOAD). Encoders return KVS_OK, KVS_ERR_TOO_LARGE (a count over a hard limit or
 * a payload over WIRE_MAX_PAYLOAD), or KVS_ERR_INVALID_ARG (any other field invalid, or the
 * output buffer too small). On a decoder failure *out is zeroed; on an encoder failure the
 * contents of buf are unspecified.
 */
#ifndef KVS_WIRE_H
#define KVS_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvshard.h"

/* ---- header and limits ---- */

#define WIRE_MAGIC 0x4853564Bu /* bytes "KVSH" read as a little-endian u32 */
#define WIRE_VERSION 1u        /* frame header version (the framing of docs/protocol.md §1) */
/* Message-set versions negotiated by HELLO / INFO. 1: the base set. 2 adds FORWARD out_mode SAMPLE
 * with its sampler block, the RELAY flag with its relay block, FORWARD_REPLY out_kind SAMPLE and
 * the RELAY_LISTEN op. A shard answers a v1 client in v1 and refuses v2 fields on that
 * connection (UNSUPPORTED); frames keep header version WIRE_VERSION either way. 3 adds the
 * FORWARD prefix block (WIRE_FWD_PREFIX: chain hashes for shared prefix blocks). */
#define WIRE_PROTO_VERSION 3u
#define WIRE_HEADER_SIZE 24u

#define WIRE_MAX_PAYLOAD (64u << 20)  /* bytes after the header */
#define WIRE_MAX_TOKENS 8192u         /* token rows per FORWARD / FORWARD_REPLY */
#define WIRE_MAX_EMBD 65536u          /* hidden width */
#define WIRE_MAX_VOCAB (1u << 20)     /* vocab size, logits width */
#define WIRE_MAX_LAYERS 4096u         /* n_layer in INFO */
#define WIRE_MAX_POS (1u << 24)       /* positions: start_pos + n_tokens, inherit_len, lengths */
#define WIRE_MAX_AUTH 256u            /* auth token bytes in HELLO */
#define WIRE_MAX_NAME 128u            /* shard name bytes in INFO */
#define WIRE_MAX_MSG 255u             /* message bytes in STATUS */
#define WIRE_MAX_STATS 128u           /* counters in STATS_REPLY */
#define WIRE_MAX_STAT_NAME 63u        /* bytes of one counter name */
#define WIRE_MAX_TOKEN_TEXT 65535u    /* bytes of one vocab token text */
#define WIRE_MAX_TOK_MODEL 32u        /* bytes of the tokenizer model name ("llama") */
#define WIRE_TOKEN_TYPE_MAX 6         /* llama token types 0 (undefined) .. 6 (byte) */
#define WIRE_DIGEST_SIZE 32u
#define WIRE_MAX_MERGES (1u << 22)    /* BPE merges in VOCAB_META_REPLY */
#define WIRE_MAX_TEMPLATE (1u << 20)  /* bytes of the chat template in VOCAB_META_REPLY */
#define WIRE_MAX_PRE 64u              /* bytes of the pre-tokenizer name */

enum wire_op {
    WIRE_OP_HELLO = 1,         /* client -> shard: struct wire_hello */
    WIRE_OP_INFO = 2,          /* reply to HELLO: struct wire_info */
    WIRE_OP_FORWARD = 3,       /* struct wire_forward */
    WIRE_OP_FORWARD_REPLY = 4, /* struct wire_forward_reply */
    WIRE_OP_TRUNCATE = 5,      /* struct wire_truncate; reply STATUS */
    WIRE_OP_RELEASE = 6,       /* struct wire_release; reply STATUS */
    WIRE_OP_CANCEL = 7,        /* struct wire_cancel; reply STATUS */
    WIRE_OP_STATS = 8,         /* empty payload */
    WIRE_OP_STATS_REPLY = 9,   /* struct wire_stats_reply */
    WIRE_OP_VOCAB = 10,        /* struct wire_vocab */
    WIRE_OP_VOCAB_REPLY = 11,  /* struct wire_vocab_reply */
    WIRE_OP_STATUS = 12,       /* struct wire_status_reply: generic reply / error */
    WIRE_OP_VOCAB_META = 13,       /* struct wire_vocab_meta: tokenizer settings + BPE merges */
    WIRE_OP_VOCAB_META_REPLY = 14, /* struct wire_vocab_meta_reply */
    WIRE_OP_RELAY_LISTEN = 15,     /* v2, struct wire_relay_listen; reply STATUS */
    WIRE_OP_SESSION_PUSH = 16,     /* shard -> shard: one session's KV stream (docs/hot-kv-state.md); reply STATUS */
    WIRE_OP_DRAIN = 17,            /* operator -> shard: "HOST:PORT,...[;keep]"; replies STATUS "progress: .." .. "done: .." */
};
#define WIRE_OP_MAX_ 17

struct wire_header {
    uint32_t magic;       /* WIRE_MAGIC */
    uint16_t version;     /* WIRE_VERSION */
    uint16_t op;          /* enum wire_op */
    uint32_t flags;       /* reserved, must be 0 */
    uint64_t request_id;  /* chosen by the requester, echoed in the reply */
    uint32_t payload_len; /* bytes following the header, <= WIRE_MAX_PAYLOAD */
};

/* Writes the 24 header bytes. KVS_ERR_INVALID_ARG for an unknown op, nonzero flags or a bad
 * magic/version; KVS_ERR_TOO_LARGE for payload_len > WIRE_MAX_PAYLOAD. */
int wire_encode_header(const struct wire_header *h, uint8_t out[WIRE_HEADER_SIZE]);

/* Parses and validates 24 header bytes. KVS_ERR_PROTOCOL for a bad magic, unknown op or nonzero
 * flags; KVS_ERR_UNSUPPORTED for another version; KVS_ERR_TOO_LARGE for an oversized payload.
 * *out always receives the raw fields read, even on failure (then untrusted: use request_id only
 * to address an error reply before closing). */
int wire_decode_header(const uint8_t in[WIRE_HEADER_SIZE], struct wire_header *out, char *msg,
                       size_t msg_cap);

/* Static name of an op ("FORWARD"), "?" when unknown. */
const char *wire_op_name(uint32_t op);

/* True when v is one of the values of enum kvs_err. */
bool wire_status_known(int32_t v);

/* ---- the status block that starts every reply (20 bytes) ---- */

struct wire_status {
    int32_t status;      /* enum kvs_err; KVS_OK on success */
    uint32_t have;       /* CACHE_MISS: positions the shard holds; replay from here */
    uint64_t live_epoch; /* STALE_EPOCH: the epoch the shard holds for the session */
    uint32_t n_past;     /* positions held for the session after the request */
};

/* ---- HELLO / INFO ---- */

struct wire_hello {
    uint16_t min_version, max_version; /* versions the client speaks, 1 <= min <= max */
    uint16_t auth_len;                 /* <= WIRE_MAX_AUTH */
    char auth[WIRE_MAX_AUTH + 1];      /* auth token, NUL-terminated copy; no NUL inside */
};

enum wire_dtype_bit { WIRE_DTYPE_F32 = 1u << 0, WIRE_DTYPE_F16 = 1u << 1, WIRE_DTYPE_BF16 = 1u << 2 /* v2 */ };

struct wire_info {
    struct wire_status st;
    uint16_t version;                   /* chosen protocol version */
    uint16_t hidden_dtypes;             /* enum wire_dtype_bit mask; F32 always set; BF16 only in v2 */
    uint8_t model_digest[WIRE_DIGEST_SIZE];
    uint32_t n_layer;                   /* layers of the whole model */
    uint32_t first, last;               /* owned layers [first, last), first < last <= n_layer */
    uint32_t n_embd;                    /* hidden width, 1..WIRE_MAX_EMBD */
    uint32_t n_vocab;                   /* 1..WIRE_MAX_VOCAB */
    uint64_t kv_budget_bytes;           /* hot KV pool size, bytes */
    uint32_t max_tokens;                /* tokens per FORWARD the shard accepts, 1..WIRE_MAX_TOKENS */
    uint32_t max_ctx;                   /* positions per session, <= WIRE_MAX_POS */
    uint16_t name_len;                  /* <= WIRE_MAX_NAME */
    char name[WIRE_MAX_NAME + 1];       /* shard name, NUL-terminated copy; no NUL inside */
};

/* ---- FORWARD ---- */

#define WIRE_SID_SIZE 16u
#define WIRE_FWD_INHERIT (1u << 0) /* take over inherit_epoch's state truncated to inherit_len */
#define WIRE_FWD_RELAY (1u << 1)   /* v2: a relay block follows; push the step on to relay.next[] */
#define WIRE_FWD_PREFIX (1u << 2)  /* v3: a prefix block follows: chain hashes of covered blocks */
#define WIRE_FWD_FLAGS_KNOWN (WIRE_FWD_INHERIT | WIRE_FWD_RELAY | WIRE_FWD_PREFIX)
#define WIRE_PREFIX_TOKENS 16u    /* positions named by one chain hash */
#define WIRE_MAX_PREFIX_HASHES (WIRE_MAX_POS / WIRE_PREFIX_TOKENS)

#define WIRE_MAX_WINDOW 8192u   /* penalty window ids in a sampler block */
#define WIRE_MAX_TOP 20u        /* top log-probs a SAMPLE reply may carry */
#define WIRE_MAX_RELAY_HOPS 64u /* next hops in a relay block */
#define WIRE_MAX_ADDR 64u       /* bytes of one "host:port" in a relay block */

enum wire_out_mode {
    WIRE_OUT_HIDDEN = 0,      /* return hidden states of every input row */
    WIRE_OUT_LOGITS_LAST = 1, /* return logits of the last row only */
    WIRE_OUT_LOGITS_ALL = 2,  /* return logits of every row */
    WIRE_OUT_SAMPLE = 3,      /* v2: sample the token after the last row (sampler block) */
};

enum wire_in_kind {
    WIRE_IN_TOKENS = 0,     /* data: i32[n_tokens]; n_embd must be 0 */
    WIRE_IN_HIDDEN_F32 = 1, /* data: f32[n_tokens x n_embd] */
    WIRE_IN_HIDDEN_F16 = 2, /* data: binary16[n_tokens x n_embd] */
    WIRE_IN_HIDDEN_BF16 = 3, /* v2; data: bfloat16[n_tokens x n_embd] (the top half of an f32) */
};

/* Sampler settings of an out_mode SAMPLE request (src/compute/sampler.h has the meaning of each). */
struct wire_sample_req {
    float temp, top_p, min_p;          /* numbers; top_p, min_p in [0, 1] */
    float repeat_penalty;              /* >= 0, finite */
    float presence_penalty;            /* finite */
    uint32_t top_k;                    /* 0 = off, <= WIRE_MAX_VOCAB */
    uint64_t seed;
    uint32_t n_top;                    /* top log-probs wanted, <= WIRE_MAX_TOP */
    uint32_t n_window;                 /* <= WIRE_MAX_WINDOW */
    const void *window;                /* i32[n_window] ids < WIRE_MAX_VOCAB (design note 3/4) */
};

/* One next hop of a relay block: where to push, and that hop's inherit fields. */
struct wire_relay_hop {
    uint8_t addr_len;                  /* 1..WIRE_MAX_ADDR */
    char addr[WIRE_MAX_ADDR + 1];      /* "host:port", NUL-terminated copy; printable ASCII */
    uint32_t flags;                    /* WIRE_FWD_INHERIT or 0 */
    uint64_t inherit_epoch;            /* as in wire_forward, for that hop */
    uint32_t inherit_len;
};

struct wire_relay {
    uint64_t relay_id;                 /* the client's RELAY_LISTEN id: where the answer goes */
    uint16_t hop;                      /* this shard's index in the route (for messages) */
    uint16_t hidden_kind;              /* in_kind of pushed hidden rows: HIDDEN_F32, _F16 or _BF16 */
    uint16_t n_next;                   /* <= WIRE_MAX_RELAY_HOPS; 0: this shard is the tail */
    struct wire_relay_hop next[WIRE_MAX_RELAY_HOPS];
};

/* Chain hashes of a FORWARD (v3): hash i names positions [0, (first + i + 1) x 16) of the session,
 * wire_chain_hash of the hash before it and these 16 ids; first + n_hashes blocks lie within
 * start_pos + n_tokens. */
struct wire_prefix {
    uint32_t first;                    /* block index of the first hash */
    uint32_t n_hashes;                 /* 1..WIRE_MAX_PREFIX_HASHES */
    const void *hashes;                /* u64[n_hashes], design note 3/4 */
};

struct wire_forward {
    uint8_t session_id[WIRE_SID_SIZE]; /* route_session_id, opaque 128 bits */
    uint64_t epoch;                    /* route_epoch */
    uint32_t start_pos;                /* position of the first input row */
    uint32_t n_tokens;                 /* rows, 1..WIRE_MAX_TOKENS; start_pos + n_tokens <= WIRE_MAX_POS */
    uint32_t flags;                    /* WIRE_FWD_* */
    uint32_t out_mode;                 /* enum wire_out_mode */
    uint64_t inherit_epoch;            /* with WIRE_FWD_INHERIT: < epoch; else 0 */
    uint32_t inherit_len;              /* with WIRE_FWD_INHERIT: positions kept, <= WIRE_MAX_POS; else 0 */
    uint32_t in_kind;                  /* enum wire_in_kind */
    uint32_t n_embd;                   /* hidden width, 1..WIRE_MAX_EMBD; 0 for tokens */
    const void *data;                  /* (n_tokens) or (n_tokens, n_embd), see design note 3/4 */
    struct wire_sample_req sample;     /* out_mode SAMPLE only; else all zero */
    struct wire_relay relay;           /* flag RELAY only; else all zero */
    struct wire_prefix prefix;         /* flag PREFIX only; else all zero */
};

/* The chain hash of a block of ids after the block hashed prev (0 before the first block). */
uint64_t wire_chain_hash(uint64_t prev, const int32_t *ids, uint32_t n);
/* Hash i of a decoded prefix block. */
uint64_t wire_prefix_hash(const struct wire_prefix *p, uint32_t i);

enum wire_out_kind {
    WIRE_OUTK_NONE = 0,       /* no data; n_rows = n_cols = 0 */
    WIRE_OUTK_HIDDEN_F32 = 1, /* f32 (n_rows, n_cols = n_embd) */
    WIRE_OUTK_HIDDEN_F16 = 2, /* binary16 (n_rows, n_cols = n_embd) */
    WIRE_OUTK_LOGITS_F32 = 3, /* f32 (n_rows, n_cols = n_vocab) */
    WIRE_OUTK_SAMPLE = 4,     /* v2: n_rows 1, n_cols = n_top; data: id i32, logprob f32, then
                                 n_cols x (id i32, logprob f32) */
    WIRE_OUTK_HIDDEN_BF16 = 5, /* v2: bfloat16 (n_rows, n_cols = n_embd) */
};

struct wire_forward_reply {
    struct wire_status st;
    uint32_t out_kind;  /* enum wire_out_kind; NONE when st.status != KVS_OK */
    uint32_t n_rows;    /* 1..WIRE_MAX_TOKENS unless NONE */
    uint32_t n_cols;    /* 1..WIRE_MAX_EMBD (hidden) or 1..WIRE_MAX_VOCAB (logits) unless NONE */
    const void *data;   /* (n_rows, n_cols) elements, see design note 3/4 */
};

/* ---- TRUNCATE / RELEASE / CANCEL / STATUS ---- */

struct wire_truncate {
    uint8_t session_id[WIRE_SID_SIZE];
    uint64_t epoch;
    uint32_t len; /* positions to keep, <= WIRE_MAX_POS */
};

struct wire_release {
    uint8_t session_id[WIRE_SID_SIZE];
    uint64_t epoch;
};

struct wire_cancel {
    uint64_t target_request_id; /* request_id of an in-flight FORWARD on the same connection */
};

struct wire_relay_listen {
    uint64_t relay_id; /* nonzero: relayed steps naming it are answered on this connection */
};

struct wire_status_reply {
    struct wire_status st;
    uint16_t msg_len;          /* <= WIRE_MAX_MSG */
    char msg[WIRE_MAX_MSG + 1]; /* human-readable detail, NUL-terminated copy; may be empty */
};

/* ---- STATS ---- */

struct wire_stat {
    char name[WIRE_MAX_STAT_NAME + 1]; /* 1..63 chars of [A-Za-z0-9_.], NUL-terminated */
    uint64_t value;
};

struct wire_stats_reply {
    struct wire_status st;
    uint32_t n_stats; /* <= WIRE_MAX_STATS */
    struct wire_stat stats[WIRE_MAX_STATS];
};

/* ---- VOCAB (head shard's tokenizer, paged) ---- */

struct wire_vocab {
    uint32_t first;     /* first token id wanted */
    uint32_t max_count; /* 1..WIRE_MAX_VOCAB; the shard returns fewer if the page would not fit */
};

struct wire_vocab_token {
    const char *text; /* not NUL-terminated; into the caller's arrays or the payload */
    uint32_t text_len; /* <= WIRE_MAX_TOKEN_TEXT */
    float score;
    int32_t type;     /* 0..WIRE_TOKEN_TYPE_MAX */
};

struct wire_vocab_reply {
    struct wire_status st;
    uint32_t n_vocab;          /* whole vocab, 1..WIRE_MAX_VOCAB */
    uint32_t first, count;     /* this page: ids [first, first + count), first + count <= n_vocab */
    int32_t bos, eos;          /* -1 (none) or < n_vocab */
    uint8_t add_space_prefix;  /* 0 or 1 */
    uint8_t tok_model_len;     /* <= WIRE_MAX_TOK_MODEL */
    char tok_model[WIRE_MAX_TOK_MODEL + 1]; /* tokenizer.ggml.model, NUL-terminated copy */
    /* encode: count entries taken from tokens[] (caller-owned).
     * decode: tokens is NULL; entries/entries_len span the validated entry bytes in the payload
     * (lifetime: design note 3); walk them with wire_vocab_next(). */
    const struct wire_vocab_token *tokens;
    const uint8_t *entries;
    size_t entries_len;
};

/* Decoded-page iterator: start with *off = 0; fills *tok (text points into the payload) and
 * returns true while entries remain, false after the last one. Never reads out of bounds, even
 * on a struct that was not produced by wire_decode_vocab_reply. */
bool wire_vocab_next(const struct wire_vocab_reply *v, size_t *off, struct wire_vocab_token *tok);

/* ---- VOCAB_META (the rest of a byte-level BPE tokenizer, paged by merge rank) ----
 * Asked for after VOCAB when tok_model is "gpt2" (an SPM client never asks, so older
 * shards and clients keep working with SPM vocabs). */

struct wire_vocab_meta {
    uint32_t first;     /* first merge rank wanted, <= WIRE_MAX_MERGES */
    uint32_t max_count; /* 1..WIRE_MAX_MERGES; the shard returns fewer if it likes */
};

struct wire_vocab_meta_reply {
    struct wire_status st;
    uint32_t n_vocab;          /* 1..WIRE_MAX_VOCAB: every merge id is < n_vocab */
    uint8_t add_bos;           /* 0: the tokenizer family's default, 1: add BOS, 2: do not */
    uint8_t rstrip_specials;   /* 1: whitespace after a special token is dropped (phi3); wire: bit 2
                                  of the add_bos byte */
    uint8_t pre_len;           /* <= WIRE_MAX_PRE */
    char pre[WIRE_MAX_PRE + 1]; /* tokenizer.ggml.pre, NUL-terminated copy, no NUL inside */
    uint32_t n_merges;         /* the whole table, <= WIRE_MAX_MERGES */
    uint32_t first, count;     /* this page: ranks [first, first + count), first + count <= n_merges */
    uint32_t template_len;     /* <= WIRE_MAX_TEMPLATE; nonzero only in the page with first == 0 */
    const char *chat_template; /* template_len bytes, no NUL (encode: caller's; decode: payload) */
    /* encode: 2 * count ids (left, right of each merge, by rank), caller-owned.
     * decode: NULL; read the page with wire_vocab_meta_merge (design note 3). */
    const int32_t *merge_ids;
    const uint8_t *merges;     /* decode: count * 8 bytes in the payload */
};

/* Merge i (< count) of a decoded page; false when out of range. */
bool wire_vocab_meta_merge(const struct wire_vocab_meta_reply *m, uint32_t i, int32_t *left, int32_t *right);

/* ---- encoders ----
 * Each writes the payload (not the header) of its message into buf[0..cap) and sets *len to its
 * size. With buf == NULL nothing is written: *len gets the size needed and KVS_OK is returned.
 * When buf is non-NULL and cap < needed: KVS_ERR_INVALID_ARG, *len = needed. */
int wire_encode_hello(const struct wire_hello *m, uint8_t *buf, size_t cap, size_t *len);
int wire_encode_info(const struct wire_info *m, uint8_t *buf, size_t cap, size_t *len);
int wire_encode_forward(const struct wire_forward *m, uint8_t *buf, size_t cap, size_t *len);
int wire_encode_forward_reply(const struct wire_forward_reply *m, uint8_t *buf, size_t cap,
                              size_t *len);
int wire_encode_truncate(const struct wire_truncate *m, uint8_t *buf, size_t cap, size_t *len);
int wire_encode_release(const struct wire_release *m, uint8_t *buf, size_t cap, size_t *len);
int wire_encode_cancel(const struct wire_cancel *m, uint8_t *buf, size_t cap, size_t *len);
int wire_encode_relay_listen(const struct wire_relay_listen *m, uint8_t *buf, size_t cap, size_t *len);
int wire_encode_status_reply(const struct wire_status_reply *m, uint8_t *buf, size_t cap,
                             size_t *len);
int wire_encode_stats_reply(const struct wire_stats_reply *m, uint8_t *buf, size_t cap,
                            size_t *len);
int wire_encode_vocab(const struct wire_vocab *m, uint8_t *buf, size_t cap, size_t *len);
int wire_encode_vocab_reply(const struct wire_vocab_reply *m, uint8_t *buf, size_t cap,
                            size_t *len);
int wire_encode_vocab_meta(const struct wire_vocab_meta *m, uint8_t *buf, size_t cap, size_t *len);
int wire_encode_vocab_meta_reply(const struct wire_vocab_meta_reply *m, uint8_t *buf, size_t cap,
                                 size_t *len);

/* ---- decoders ----
 * Each parses payload[0..len) completely (trailing bytes are an error). KVS_OK or
 * KVS_ERR_PROTOCOL (msg names the field); *out is zeroed on failure. Pointers in *out point into
 * payload (design note 3). The STATS request has an empty payload: wire_decode_empty(). */
int wire_decode_empty(const uint8_t *payload, size_t len, char *msg, size_t msg_cap);
int wire_decode_hello(const uint8_t *payload, size_t len, struct wire_hello *out, char *msg,
                      size_t msg_cap);
int wire_decode_info(const uint8_t *payload, size_t len, struct wire_info *out, char *msg,
                     size_t msg_cap);
int wire_decode_forward(const uint8_t *payload, size_t len, struct wire_forward *out, char *msg,
                        size_t msg_cap);
int wire_decode_forward_reply(const uint8_t *payload, size_t len, struct wire_forward_reply *out,
                              char *msg, size_t msg_cap);
int wire_decode_truncate(const uint8_t *payload, size_t len, struct wire_truncate *out, char *msg,
                         size_t msg_cap);
int wire_decode_release(const uint8_t *payload, size_t len, struct wire_release *out, char *msg,
                        size_t msg_cap);
int wire_decode_cancel(const uint8_t *payload, size_t len, struct wire_cancel *out, char *msg,
                       size_t msg_cap);
int wire_decode_relay_listen(const uint8_t *payload, size_t len, struct wire_relay_listen *out, char *msg,
                             size_t msg_cap);
int wire_decode_status_reply(const uint8_t *payload, size_t len, struct wire_status_reply *out,
                             char *msg, size_t msg_cap);
int wire_decode_stats_reply(const uint8_t *payload, size_t len, struct wire_stats_reply *out,
                            char *msg, size_t msg_cap);
int wire_decode_vocab(const uint8_t *payload, size_t len, struct wire_vocab *out, char *msg,
                      size_t msg_cap);
int wire_decode_vocab_reply(const uint8_t *payload, size_t len, struct wire_vocab_reply *out,
                            char *msg, size_t msg_cap);
int wire_decode_vocab_meta(const uint8_t *payload, size_t len, struct wire_vocab_meta *out,
                           char *msg, size_t msg_cap);
int wire_decode_vocab_meta_reply(const uint8_t *payload, size_t len,
                                 struct wire_vocab_meta_reply *out, char *msg, size_t msg_cap);

/* ---- bulk data readers (host order, alignment-safe) ---- */

/* Token i of a decoded FORWARD with in_kind TOKENS; i < n_tokens (caller's duty). */
int32_t wire_forward_token(const struct wire_forward *m, uint32_t i);

/* Converts a decoded FORWARD's hidden input (f32, f16 or bf16) to host floats:
 * dst must hold n_tokens * n_embd floats. KVS_ERR_INVALID_ARG when in_kind is TOKENS. */
int wire_forward_hidden_to_f32(const struct wire_forward *m, float *dst);

/* Converts a decoded FORWARD_REPLY's output (hidden f32/f16/bf16 or logits) to host floats:
 * dst must hold n_rows * n_cols floats. KVS_ERR_INVALID_ARG when out_kind is NONE. */
int wire_forward_reply_to_f32(const struct wire_forward_reply *m, float *dst);

/* Sampled result of a decoded FORWARD_REPLY with out_kind SAMPLE: *id and *logprob of the pick;
 * top[i] (i < n_cols) of the top list when top_ids/top_lp are non-NULL. KVS_ERR_INVALID_ARG for
 * another out_kind. */
int wire_forward_reply_sample(const struct wire_forward_reply *m, int32_t *id, float *logprob, int32_t *top_ids,
                              float *top_lp);

/* IEEE binary16 <-> binary32 (round to nearest even; NaN stays NaN). */
float wire_f16_to_f32(uint16_t h);
uint16_t wire_f32_to_f16(float f);

/* bfloat16 (the top 16 bits of a binary32) <-> binary32. To bf16: round to nearest even; inf
 * stays inf, finite values past the largest bf16 round to inf; NaN stays NaN (sign and top payload
 * bits kept, quiet bit set), as in the f16 conversion. From bf16: exact. */
float wire_bf16_to_f32(uint16_t h);
uint16_t wire_f32_to_bf16(float f);

#endif /* KVS_WIRE_H */
