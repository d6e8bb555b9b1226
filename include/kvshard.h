/*
 * kvshard — public API.
 *
 * Every fallible function returns an int: KVS_OK (0) or one negative code of
 * enum kvs_err. Results come back through out-parameters. Library code never
 * exits and never prints; kvs_strerror() turns a code into text.
 */
#ifndef KVSHARD_H
#define KVSHARD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* X(name, value, message) */
#define KVS_ERR_MAP(X)                                                        \
    X(OK, 0, "ok")                                                            \
    X(ERR_NOMEM, -1, "out of memory")                                         \
    X(ERR_INVALID_ARG, -2, "invalid argument")                                \
    X(ERR_IO, -3, "i/o error")                                                \
    X(ERR_FORMAT, -4, "malformed file or data")                               \
    X(ERR_UNSUPPORTED, -5, "unsupported")                                     \
    X(ERR_NOT_FOUND, -6, "not found")                                         \
    X(ERR_CACHE_MISS, -7, "cache miss: session state missing, replay needed") \
    X(ERR_STALE_EPOCH, -8, "stale route epoch")                               \
    X(ERR_CONTEXT_FULL, -9, "session context full")                           \
    X(ERR_BUDGET_EXHAUSTED, -10, "kv budget exhausted")                       \
    X(ERR_CANCELLED, -11, "cancelled")                                        \
    X(ERR_PROTOCOL, -12, "protocol error")                                    \
    X(ERR_TIMEOUT, -13, "timed out")                                          \
    X(ERR_BUSY, -14, "busy")                                                  \
    X(ERR_CLOSED, -15, "connection closed")                                   \
    X(ERR_TOO_LARGE, -16, "too large")                                        \
    X(ERR_INTERNAL, -17, "internal error")                                \
    X(ERR_MOVED, -18, "session moved to another shard")

enum kvs_err {
#define KVS_ERR_ENUM_(name, value, msg) KVS_##name = value,
    KVS_ERR_MAP(KVS_ERR_ENUM_)
#undef KVS_ERR_ENUM_
};

/* Returns a static, NUL-terminated description of an error code; never NULL. */
const char *kvs_strerror(int err);

/* Size of the optional message buffers that many calls accept (char *msg, size_t msg_cap). */
#define KVS_MSG_MAX 256

/* ======================================================================== *
 * Engine: one layer range of a GGUF Llama model, its compute threads and the
 * hot KV state of every session that passes through it (docs/design.md §1-2).
 *
 * Thread-safety: every kvs_engine_* / kvs_session_* / kvs_forward /
 * kvs_tokenize call may run concurrently with others on the same engine,
 * except kvs_engine_close, which must be the last call on it.
 * ======================================================================== */

typedef struct kvs_engine kvs_engine;

/* Element type of the stored keys/values. */
typedef enum {
    KVS_KV_F16 = 0, /* half the memory; the default */
    KVS_KV_F32 = 1,
} kvs_kv_type;

typedef struct {
    const char *model_path;   /* GGUF file; borrowed for the duration of kvs_engine_open */
    uint32_t first_layer;     /* owned layers [first_layer, last_layer) */
    uint32_t last_layer;      /* 0: n_layer (to the end of the model) */
    int n_threads;            /* compute threads, 0..1024; 0: online CPUs */
    uint64_t kv_budget_bytes; /* KV block pool size in bytes, fixed for the engine's life */
    int kv_block_tokens;      /* positions per KV block, 1..1024 */
    kvs_kv_type kv_type;
    uint64_t kv_ttl_ms;       /* idle time (ms) before a session may be evicted; 0: never */
    uint32_t max_sessions;    /* live sessions; 0: no limit besides the budget */
    uint32_t max_positions;   /* per-session positions (CONTEXT_FULL past it); 0 or > n_ctx: n_ctx */
} kvs_engine_params;

/* Defaults: the whole model, online CPUs, 256 MiB of f16 KV in blocks of 16
 * positions, no TTL, no session limit, max_positions 0 (n_ctx, capped by what the budget holds).
 * model_path is NULL and must be set. */
kvs_engine_params kvs_engine_default_params(void);

/* Loads layers [first_layer, last_layer) of params.model_path (memory-mapped,
 * read-only), reserves the KV pool and starts the compute threads. The
 * tokenizer is read from the file's metadata when it has a usable one.
 * Returns KVS_OK with *out a new engine owned by the caller (kvs_engine_close).
 * On failure *out is NULL, nothing is left allocated, and msg (when non-NULL,
 * msg_cap bytes, KVS_MSG_MAX is enough) says why:
 *   KVS_ERR_INVALID_ARG  NULL out or model_path, a setting out of range,
 *                        first_layer >= last_layer, last_layer > n_layer,
 *                        a budget smaller than one KV block;
 *   KVS_ERR_IO           the file cannot be opened or mapped;
 *   KVS_ERR_FORMAT / KVS_ERR_UNSUPPORTED  the file is not a dense Llama GGUF
 *                        this build can run;
 *   KVS_ERR_NOMEM. */
int kvs_engine_open(kvs_engine_params params, kvs_engine **out, char *msg, size_t msg_cap);

/* Stops the threads, drops every session and unmaps the model. NULL is fine.
 * No other call on the engine may be running or follow. */
void kvs_engine_close(kvs_engine *engine);

typedef struct {
    uint32_t n_vocab;        /* tokens */
    uint32_t n_embd;         /* hidden size: floats per position in a hidden state */
    uint32_t n_layer;        /* layers of the whole model */
    uint32_t n_head;         /* query heads per layer */
    uint32_t n_head_kv;      /* key/value heads per layer */
    uint32_t head_dim;       /* elements per head */
    uint32_t n_ff;           /* feed-forward hidden size */
    uint32_t n_ctx;          /* training context length (positions) */
    uint32_t first_layer;    /* owned layers [first_layer, last_layer) */
    uint32_t last_layer;
    bool has_embeddings;     /* owns layer 0: requests carry token ids */
    bool has_head;           /* owns the last layer: logits can be requested */
    bool has_tokenizer;      /* kvs_tokenize / kvs_token_to_piece are available */
    uint64_t weight_bytes;   /* bytes of the owned tensors in the file */
    uint64_t kv_block_bytes; /* bytes of one KV block */
    uint32_t max_positions;  /* effective per-session cap */
} kvs_model_info;

/* Fills *out with the engine's model and range. KVS_OK, or KVS_ERR_INVALID_ARG
 * for a NULL argument (*out untouched). */
int kvs_engine_info(const kvs_engine *engine, kvs_model_info *out);

/* ---- text ---------------------------------------------------------------- */

/* Tokenizes text[0, len) as llama.cpp does (SentencePiece-style, a leading
 * space added, byte fallback), prepending BOS when add_bos. Writes up to
 * max_ids ids; *n_ids always gets the number the whole text needs, so a call
 * with ids NULL and max_ids 0 sizes the buffer. Returns KVS_OK; on failure the
 * engine is unchanged and: KVS_ERR_TOO_LARGE (the first max_ids ids were
 * written), KVS_ERR_UNSUPPORTED (the model has no tokenizer, or no BOS when
 * add_bos), KVS_ERR_INVALID_ARG (NULL engine / n_ids, text NULL with len > 0,
 * max_ids < 0, ids NULL with max_ids > 0), KVS_ERR_NOMEM. Invalid UTF-8 is not
 * an error. */
int kvs_tokenize(const kvs_engine *engine, const char *text, size_t len, bool add_bos,
                 int32_t *ids, int max_ids, int *n_ids);

/* The text of one token: spaces as ' ', byte tokens as that byte, control
 * tokens (BOS/EOS) as "". Writes at most cap bytes into buf (not
 * NUL-terminated; buf may be NULL when cap is 0) and the full length to *len.
 * KVS_OK when it fit; KVS_ERR_TOO_LARGE when cap was short (the first cap
 * bytes written, *len set); KVS_ERR_UNSUPPORTED without a tokenizer;
 * KVS_ERR_INVALID_ARG for an id out of range or a NULL engine / len. */
int kvs_token_to_piece(const kvs_engine *engine, int32_t id, char *buf, size_t cap, size_t *len);

/* The BOS / EOS token id, or -1 when the model has none (or no tokenizer, or
 * engine is NULL). */
int32_t kvs_token_bos(const kvs_engine *engine);
int32_t kvs_token_eos(const kvs_engine *engine);

/* ---- sessions -------------------------------------------------------------- */

/* A route session id: 128 random bits chosen by the client. */
typedef struct {
    uint8_t bytes[16];
} kvs_session_id;

/* What a request writes to its out buffer (the caller sizes it). */
typedef enum {
    KVS_OUT_HIDDEN = 0,      /* n x n_embd floats: hidden states after the last owned layer */
    KVS_OUT_LOGITS_LAST = 1, /* n_vocab floats: logits of the last position (needs has_head) */
    KVS_OUT_LOGITS_ALL = 2,  /* n x n_vocab floats: logits of every position (needs has_head) */
} kvs_out_kind;

/* Recovery fields, filled on success and on error. */
typedef struct {
    uint32_t have;       /* KVS_ERR_CACHE_MISS: positions held; resend from here */
    uint64_t live_epoch; /* the epoch held (KVS_ERR_STALE_EPOCH: the newer live one); 0 if none */
    uint32_t n_past;     /* positions held after the call */
} kvs_reply;

/* One append of n positions [start_pos, start_pos + n) to a session.
 * Zero-initialize, then set the inputs. Rules (docs/design.md §2): an unknown
 * session starts only at start_pos 0; start_pos < n_past rewinds first (a
 * retry is idempotent); start_pos > n_past is a CACHE_MISS; an older epoch is
 * STALE_EPOCH; a newer epoch drops the old state unless inherit is set. */
typedef struct {
    /* inputs */
    kvs_session_id sid;
    uint64_t epoch;          /* route epoch, >= the live one */
    uint32_t start_pos;      /* first position written */
    uint32_t n;              /* positions, >= 1 */
    const int32_t *tokens;   /* n token ids (engines with has_embeddings) */
    const float *hidden;     /* n x n_embd floats (engines without) */
    kvs_out_kind out_kind;
    float *out;              /* sized per out_kind; written only on success */
    bool inherit;            /* moving to a newer epoch: keep inherit_epoch's state ... */
    uint64_t inherit_epoch;  /* ... when it is the live epoch ... */
    uint32_t inherit_len;    /* ... truncated to this many positions (no copy) */
    /* results */
    int status;              /* KVS_OK or this request's error */
    kvs_reply reply;
} kvs_request;

#define KVS_MAX_BATCH 4096 /* requests per kvs_forward */

/* Runs n_reqs requests as one batch: every position of every request passes
 * each weight matrix together, and each request's outputs are bit-identical
 * to running it alone. Each request gets its own status and reply; a failed
 * request leaves its session exactly as before the call (and its out buffer
 * unspecified) and does not affect the others. Per-request errors:
 * KVS_ERR_CACHE_MISS (reply.have), KVS_ERR_STALE_EPOCH (reply.live_epoch),
 * KVS_ERR_CONTEXT_FULL, KVS_ERR_BUDGET_EXHAUSTED (nothing evictable left),
 * KVS_ERR_BUSY (the session is in another call, e.g. twice in one batch),
 * KVS_ERR_CANCELLED (kvs_session_cancel), KVS_ERR_INVALID_ARG (n 0, a missing
 * input or out buffer, a token id out of range, logits from an engine without
 * the head, an unknown out_kind).
 * Returns KVS_OK unless the batch as a whole failed: KVS_ERR_INVALID_ARG
 * (NULL engine, NULL reqs with n_reqs > 0, n_reqs outside 0..KVS_MAX_BATCH;
 * statuses untouched) or KVS_ERR_NOMEM (every request that was to run
 * carries it; every session unchanged). */
int kvs_forward(kvs_engine *engine, kvs_request *reqs, int n_reqs);


/* Keeps positions [0, len) of (sid, epoch); whole blocks past len return to
 * the pool. KVS_OK, else (session unchanged): KVS_ERR_CACHE_MISS (absent or
 * an older epoch held), KVS_ERR_STALE_EPOCH, KVS_ERR_BUSY, KVS_ERR_INVALID_ARG
 * (len > n_past, NULL engine / sid). rep (may be NULL) gets the recovery fields. */
int kvs_session_truncate(kvs_engine *engine, const kvs_session_id *sid, uint64_t epoch, uint32_t len,
                         kvs_reply *rep);

/* Drops (sid, epoch): every block returns to the pool and later requests see
 * CACHE_MISS(0). Errors as kvs_session_truncate (the session unchanged). */
int kvs_session_release(kvs_engine *engine, const kvs_session_id *sid, uint64_t epoch, kvs_reply *rep);

/* Asks the session's in-flight kvs_forward request (another thread's) to stop
 * at the next layer boundary; that request then fails with KVS_ERR_CANCELLED
 * and the session rolls back. KVS_OK when one was flagged, KVS_ERR_NOT_FOUND
 * when nothing is in flight, KVS_ERR_INVALID_ARG for NULL arguments. */
int kvs_session_cancel(kvs_engine *engine, const kvs_session_id *sid);

/* The live epoch and n_past of a session (either pointer may be NULL).
 * KVS_OK, KVS_ERR_NOT_FOUND (outputs untouched), KVS_ERR_INVALID_ARG. */
int kvs_session_lookup(kvs_engine *engine, const kvs_session_id *sid, uint64_t *epoch, uint32_t *n_past);

/* Evicts sessions idle past kv_ttl_ms, examining at most max_work sessions
 * (kvs_forward also sweeps a few per call). *n_evicted (may be NULL) gets the
 * count. KVS_OK, or KVS_ERR_INVALID_ARG (NULL engine, max_work < 1). */
int kvs_engine_sweep_ttl(kvs_engine *engine, int max_work, int *n_evicted);

/* Counters of the hot KV state (a consistent snapshot). */
typedef struct {
    uint64_t sessions;      /* live sessions */
    uint64_t bytes_used;    /* bytes of blocks in use (<= budget_bytes) */
    uint64_t budget_bytes;  /* pool size */
    uint64_t block_bytes;   /* bytes per block */
    uint64_t blocks_total, blocks_free;
    uint64_t hits;          /* appends that found their state */
    uint64_t misses;        /* CACHE_MISS replies */
    uint64_t stale;         /* STALE_EPOCH replies */
    uint64_t evict_ttl, evict_lru, releases; /* sessions dropped, by cause */
    uint64_t rewinds;       /* appends with start_pos < n_past */
    uint64_t cancellations; /* appends rolled back by cancel */
    uint64_t appends, truncates, inherits;
    uint64_t busy;          /* BUSY replies */
} kvs_kv_stats;

/* Fills *out. KVS_OK, or KVS_ERR_INVALID_ARG for a NULL argument. */
int kvs_engine_kv_stats(kvs_engine *engine, kvs_kv_stats *out);

/* ======================================================================== *
 * Sampler: greedy / temperature / top-k / top-p with a seeded PRNG.
 * One sampler per thread (it owns its PRNG and scratch).
 * ======================================================================== */

typedef struct kvs_sampler kvs_sampler;

typedef struct {
    float temp;    /* <= 0: greedy (argmax, lowest id on ties) */
    int top_k;     /* <= 0: off */
    float top_p;   /* >= 1: off */
    uint64_t seed; /* same seed + same logits -> same ids */
} kvs_sampler_params;

/* temp 0.8, top_k 40, top_p 0.95, seed 42. */
kvs_sampler_params kvs_sampler_default_params(void);

/* KVS_OK with *out a new sampler owned by the caller (kvs_sampler_free);
 * KVS_ERR_INVALID_ARG (NULL out, NaN temp / top_p) or KVS_ERR_NOMEM with *out NULL. */
int kvs_sampler_create(kvs_sampler_params params, kvs_sampler **out);

/* NULL is fine. */
void kvs_sampler_free(kvs_sampler *sampler);

/* Draws one id from logits[0, n_vocab) (not modified) into *id. -inf and NaN
 * logits are never drawn. KVS_OK, or KVS_ERR_INVALID_ARG (NULL argument,
 * n_vocab <= 0) with *id untouched and the sampler's state unchanged. */
int kvs_sampler_sample(kvs_sampler *sampler, const float *logits, int32_t n_vocab, int32_t *id);

#ifdef __cplusplus
}
#endif

#endif /* KVSHARD_H */
