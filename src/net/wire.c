/*
 * wire — frame codec. See wire.h for the design notes and docs/protocol.md for the layout.
 *
 * Every encoder is one function run twice: first with a counting writer (no buffer) to get the
 * size, then, if the caller's buffer is large enough, with a writing one. So the size query and
 * the bytes can never disagree. Every decoder walks a bounded reader that refuses to step past
 * the end; the first failing read records the field name and all later reads fail too, so the
 * decoders check once at the end of each group instead of after every field.
 */
#include "wire.h"

#include <string.h>

#include "util.h"

/* ---- bounded writer ---- */

struct wr {
    uint8_t *p; /* NULL: count only */
    size_t n;   /* bytes produced (or that would be) */
};

static void wr_bytes(struct wr *w, const void *src, size_t n) {
    if (w->p && n) memcpy(w->p + w->n, src, n);
    w->n += n;
}
static void wr_u8(struct wr *w, uint8_t v) { wr_bytes(w, &v, 1); }
static void wr_u16(struct wr *w, uint16_t v) {
    uint8_t b[2];
    kvs_wr_u16(b, v);
    wr_bytes(w, b, 2);
}
static void wr_u32(struct wr *w, uint32_t v) {
    uint8_t b[4];
    kvs_wr_u32(b, v);
    wr_bytes(w, b, 4);
}
static void wr_u64(struct wr *w, uint64_t v) {
    uint8_t b[8];
    kvs_wr_u64(b, v);
    wr_bytes(w, b, 8);
}

/* ---- bounded reader ---- */

struct rd {
    const uint8_t *p;
    size_t n, off;
    bool bad;          /* sticky: a read ran past the end */
    const char *field; /* first field that could not be read */
};

static bool rd_take(struct rd *r, size_t n, const char *field, const uint8_t **at) {
    if (r->bad || n > r->n - r->off) {
        if (!r->bad) r->field = field;
        r->bad = true;
        *at = NULL;
        return false;
    }
    *at = r->p + r->off;
    r->off += n;
    return true;
}
static uint8_t rd_u8(struct rd *r, const char *f) {
    const uint8_t *a;
    return rd_take(r, 1, f, &a) ? a[0] : 0;
}
static uint16_t rd_u16(struct rd *r, const char *f) {
    const uint8_t *a;
    return rd_take(r, 2, f, &a) ? kvs_rd_u16(a) : 0;
}
static uint32_t rd_u32(struct rd *r, const char *f) {
    const uint8_t *a;
    return rd_take(r, 4, f, &a) ? kvs_rd_u32(a) : 0;
}
static uint64_t rd_u64(struct rd *r, const char *f) {
    const uint8_t *a;
    return rd_take(r, 8, f, &a) ? kvs_rd_u64(a) : 0;
}
static void rd_copy(struct rd *r, void *dst, size_t n, const char *f) {
    const uint8_t *a;
    if (rd_take(r, n, f, &a)) memcpy(dst, a, n);
}

/* Truncation error if any read failed, trailing-bytes error if bytes remain. */
static int rd_end(const struct rd *r, char *msg, size_t cap) {
    if (r->bad) return kvs_fail(msg, cap, KVS_ERR_PROTOCOL, "payload truncated at %s", r->field);
    if (r->off != r->n)
        return kvs_fail(msg, cap, KVS_ERR_PROTOCOL, "%zu trailing payload bytes", r->n - r->off);
    return KVS_OK;
}
static int rd_short(const struct rd *r, char *msg, size_t cap) {
    return kvs_fail(msg, cap, KVS_ERR_PROTOCOL, "payload truncated at %s", r->field);
}

#define PROTO(...) kvs_fail(msg, msg_cap, KVS_ERR_PROTOCOL, __VA_ARGS__)

/* ---- shared helpers ---- */

bool wire_status_known(int32_t v) {
    switch (v) {
#define WIRE_ERR_CASE_(name, value, text) case value:
        KVS_ERR_MAP(WIRE_ERR_CASE_)
#undef WIRE_ERR_CASE_
        return true;
    default: return false;
    }
}

const char *wire_op_name(uint32_t op) {
    switch (op) {
    case WIRE_OP_HELLO: return "HELLO";
    case WIRE_OP_INFO: return "INFO";
    case WIRE_OP_FORWARD: return "FORWARD";
    case WIRE_OP_FORWARD_REPLY: return "FORWARD_REPLY";
    case WIRE_OP_TRUNCATE: return "TRUNCATE";
    case WIRE_OP_RELEASE: return "RELEASE";
    case WIRE_OP_CANCEL: return "CANCEL";
    case WIRE_OP_STATS: return "STATS";
    case WIRE_OP_STATS_REPLY: return "STATS_REPLY";
    case WIRE_OP_VOCAB: return "VOCAB";
    case WIRE_OP_VOCAB_REPLY: return "VOCAB_REPLY";
    case WIRE_OP_STATUS: return "STATUS";
    case WIRE_OP_RELAY_LISTEN: return "RELAY_LISTEN";
    case WIRE_OP_VOCAB_META: return "VOCAB_META";
    case WIRE_OP_VOCAB_META_REPLY: return "VOCAB_META_REPLY";
    case WIRE_OP_SESSION_PUSH: return "SESSION_PUSH";
    case WIRE_OP_DRAIN: return "DRAIN";
    default: return "?";
    }
}

/* Bytes of (rows x cols) elements of esize bytes, overflow-checked; false if over max_bytes. */
static bool tensor_bytes(uint32_t rows, uint32_t cols, uint32_t esize, uint64_t max_bytes,
                         uint64_t *out) {
    uint64_t n;
    if (!kvs_mul_u64(rows, cols, &n) || !kvs_mul_u64(n, esize, &n)) return false;
    if (n > max_bytes) return false;
    *out = n;
    return true;
}

static bool has_nul(const char *s, size_t n) { return n && memchr(s, 0, n) != NULL; }

static bool stat_name_ok(const char *s, size_t n) {
    if (n == 0 || n > WIRE_MAX_STAT_NAME) return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '_' || c == '.';
        if (!ok) return false;
    }
    return true;
}

/* Runs an encoder body twice (count, then write); see the file comment. */
typedef int (*enc_fn)(struct wr *w, const void *m);

static int run_encoder(enc_fn fn, const void *m, uint8_t *buf, size_t cap, size_t *len) {
    struct wr w = {NULL, 0};
    if (!m || !len) return KVS_ERR_INVALID_ARG;
    int rc = fn(&w, m);
    if (rc != KVS_OK) return rc;
    if (w.n > WIRE_MAX_PAYLOAD) return KVS_ERR_TOO_LARGE;
    *len = w.n;
    if (!buf) return KVS_OK;
    if (cap < w.n) return KVS_ERR_INVALID_ARG;
    w.p = buf;
    w.n = 0;
    rc = fn(&w, m);
    KVS_ASSERT(rc == KVS_OK && w.n == *len);
    return KVS_OK;
}

/* ---- header ---- */

int wire_encode_header(const struct wire_header *h, uint8_t out[WIRE_HEADER_SIZE]) {
    if (!h || !out) return KVS_ERR_INVALID_ARG;
    if (h->magic != WIRE_MAGIC || h->version != WIRE_VERSION || h->flags != 0 || h->op == 0 ||
        h->op > WIRE_OP_MAX_)
        return KVS_ERR_INVALID_ARG;
    if (h->payload_len > WIRE_MAX_PAYLOAD) return KVS_ERR_TOO_LARGE;
    kvs_wr_u32(out + 0, h->magic);
    kvs_wr_u16(out + 4, h->version);
    kvs_wr_u16(out + 6, h->op);
    kvs_wr_u32(out + 8, h->flags);
    kvs_wr_u64(out + 12, h->request_id);
    kvs_wr_u32(out + 20, h->payload_len);
    return KVS_OK;
}

int wire_decode_header(const uint8_t in[WIRE_HEADER_SIZE], struct wire_header *out, char *msg,
                       size_t msg_cap) {
    if (!in || !out) return KVS_ERR_INVALID_ARG;
    struct wire_header h;
    h.magic = kvs_rd_u32(in + 0);
    h.version = kvs_rd_u16(in + 4);
    h.op = kvs_rd_u16(in + 6);
    h.flags = kvs_rd_u32(in + 8);
    h.request_id = kvs_rd_u64(in + 12);
    h.payload_len = kvs_rd_u32(in + 20);
    *out = h; /* raw fields even on failure: a server may echo request_id in its error reply */
    if (h.magic != WIRE_MAGIC) return PROTO("bad frame magic 0x%08x", (unsigned)h.magic);
    if (h.version != WIRE_VERSION)
        return kvs_fail(msg, msg_cap, KVS_ERR_UNSUPPORTED, "frame version %u (speak %u)",
                        (unsigned)h.version, WIRE_VERSION);
    if (h.op == 0 || h.op > WIRE_OP_MAX_) return PROTO("unknown op %u", (unsigned)h.op);
    if (h.flags != 0) return PROTO("reserved header flags 0x%x set", (unsigned)h.flags);
    if (h.payload_len > WIRE_MAX_PAYLOAD)
        return kvs_fail(msg, msg_cap, KVS_ERR_TOO_LARGE, "payload %u bytes over limit %u",
                        (unsigned)h.payload_len, WIRE_MAX_PAYLOAD);
    return KVS_OK;
}

/* ---- status block ---- */

static void enc_status(struct wr *w, const struct wire_status *s) {
    wr_u32(w, (uint32_t)s->status);
    wr_u32(w, s->have);
    wr_u64(w, s->live_epoch);
    wr_u32(w, s->n_past);
}

static void dec_status(struct rd *r, struct wire_status *s) {
    s->status = (int32_t)rd_u32(r, "status");
    s->have = rd_u32(r, "have");
    s->live_epoch = rd_u64(r, "live_epoch");
    s->n_past = rd_u32(r, "n_past");
}

static bool status_fields_ok(const struct wire_status *s) {
    return wire_status_known(s->status) && s->have <= WIRE_MAX_POS && s->n_past <= WIRE_MAX_POS;
}

/* Reads and validates the status block. The caller then reads the body only when status is
 * KVS_OK; an error reply must end right after the block. */
static int dec_status_checked(struct rd *r, struct wire_status *s, char *msg, size_t msg_cap) {
    dec_status(r, s);
    if (r->bad) return rd_short(r, msg, msg_cap);
    if (!wire_status_known(s->status)) return PROTO("unknown status %d", (int)s->status);
    if (s->have > WIRE_MAX_POS) return PROTO("have %u over limit", (unsigned)s->have);
    if (s->n_past > WIRE_MAX_POS) return PROTO("n_past %u over limit", (unsigned)s->n_past);
    return KVS_OK;
}

/* ---- HELLO ---- */

static int enc_hello(struct wr *w, const void *vm) {
    const struct wire_hello *m = vm;
    if (m->min_version < 1 || m->min_version > m->max_version) return KVS_ERR_INVALID_ARG;
    if (m->auth_len > WIRE_MAX_AUTH || has_nul(m->auth, m->auth_len)) return KVS_ERR_INVALID_ARG;
    wr_u16(w, m->min_version);
    wr_u16(w, m->max_version);
    wr_u16(w, m->auth_len);
    wr_bytes(w, m->auth, m->auth_len);
    return KVS_OK;
}

int wire_encode_hello(const struct wire_hello *m, uint8_t *buf, size_t cap, size_t *len) {
    return run_encoder(enc_hello, m, buf, cap, len);
}

static int dec_hello(struct rd *r, struct wire_hello *m, char *msg, size_t msg_cap) {
    m->min_version = rd_u16(r, "min_version");
    m->max_version = rd_u16(r, "max_version");
    m->auth_len = rd_u16(r, "auth_len");
    if (r->bad) return rd_short(r, msg, msg_cap);
    if (m->min_version < 1 || m->min_version > m->max_version)
        return PROTO("bad version range [%u, %u]", (unsigned)m->min_version,
                     (unsigned)m->max_version);
    if (m->auth_len > WIRE_MAX_AUTH) return PROTO("auth_len %u over limit", (unsigned)m->auth_len);
    rd_copy(r, m->auth, m->auth_len, "auth");
    if (r->bad) return rd_short(r, msg, msg_cap);
    m->auth[m->auth_len] = 0;
    if (has_nul(m->auth, m->auth_len)) return PROTO("NUL byte in auth token");
    return rd_end(r, msg, msg_cap);
}

/* ---- INFO ---- */

/* F32 set; F16 from v1 on, BF16 from v2 on; no other bit. */
static bool dtypes_ok(uint16_t d, uint16_t version) {
    uint16_t known = WIRE_DTYPE_F32 | WIRE_DTYPE_F16 | (version >= 2 ? WIRE_DTYPE_BF16 : 0);
    return (d & WIRE_DTYPE_F32) && !(d & ~known);
}

static int enc_info(struct wr *w, const void *vm) {
    const struct wire_info *m = vm;
    if (!status_fields_ok(&m->st)) return KVS_ERR_INVALID_ARG;
    enc_status(w, &m->st);
    if (m->st.status != KVS_OK) return KVS_OK;
    if (m->version < 1 || m->version > WIRE_PROTO_VERSION) return KVS_ERR_INVALID_ARG;
    if (!dtypes_ok(m->hidden_dtypes, m->version)) return KVS_ERR_INVALID_ARG;
    if (m->n_layer > WIRE_MAX_LAYERS || m->first >= m->last || m->last > m->n_layer)
        return KVS_ERR_INVALID_ARG;
    if (m->n_embd < 1 || m->n_embd > WIRE_MAX_EMBD || m->n_vocab < 1 || m->n_vocab > WIRE_MAX_VOCAB)
        return KVS_ERR_INVALID_ARG;
    if (m->max_tokens < 1 || m->max_tokens > WIRE_MAX_TOKENS || m->max_ctx > WIRE_MAX_POS)
        return KVS_ERR_INVALID_ARG;
    if (m->name_len > WIRE_MAX_NAME || has_nul(m->name, m->name_len)) return KVS_ERR_INVALID_ARG;
    wr_u16(w, m->version);
    wr_u16(w, m->hidden_dtypes);
    wr_bytes(w, m->model_digest, WIRE_DIGEST_SIZE);
    wr_u32(w, m->n_layer);
    wr_u32(w, m->first);
    wr_u32(w, m->last);
    wr_u32(w, m->n_embd);
    wr_u32(w, m->n_vocab);
    wr_u64(w, m->kv_budget_bytes);
    wr_u32(w, m->max_tokens);
    wr_u32(w, m->max_ctx);
    wr_u16(w, m->name_len);
    wr_bytes(w, m->name, m->name_len);
    return KVS_OK;
}

int wire_encode_info(const struct wire_info *m, uint8_t *buf, size_t cap, size_t *len) {
    return run_encoder(enc_info, m, buf, cap, len);
}

static int dec_info(struct rd *r, struct wire_info *m, char *msg, size_t msg_cap) {
    int rc = dec_status_checked(r, &m->st, msg, msg_cap);
    if (rc != KVS_OK) return rc;
    if (m->st.status != KVS_OK) return rd_end(r, msg, msg_cap);
    m->version = rd_u16(r, "version");
    m->hidden_dtypes = rd_u16(r, "hidden_dtypes");
    rd_copy(r, m->model_digest, WIRE_DIGEST_SIZE, "model_digest");
    m->n_layer = rd_u32(r, "n_layer");
    m->first = rd_u32(r, "first");
    m->last = rd_u32(r, "last");
    m->n_embd = rd_u32(r, "n_embd");
    m->n_vocab = rd_u32(r, "n_vocab");
    m->kv_budget_bytes = rd_u64(r, "kv_budget_bytes");
    m->max_tokens = rd_u32(r, "max_tokens");
    m->max_ctx = rd_u32(r, "max_ctx");
    m->name_len = rd_u16(r, "name_len");
    if (r->bad) return rd_short(r, msg, msg_cap);
    if (m->version < 1 || m->version > WIRE_PROTO_VERSION)
        return PROTO("unsupported version %u", (unsigned)m->version);
    if (!dtypes_ok(m->hidden_dtypes, m->version))
        return PROTO("bad hidden_dtypes 0x%x for version %u", (unsigned)m->hidden_dtypes, (unsigned)m->version);
    if (m->n_layer > WIRE_MAX_LAYERS) return PROTO("n_layer %u over limit", (unsigned)m->n_layer);
    if (m->first >= m->last || m->last > m->n_layer)
        return PROTO("bad layer range [%u, %u) of %u", (unsigned)m->first, (unsigned)m->last,
                     (unsigned)m->n_layer);
    if (m->n_embd < 1 || m->n_embd > WIRE_MAX_EMBD) return PROTO("bad n_embd %u", (unsigned)m->n_embd);
    if (m->n_vocab < 1 || m->n_vocab > WIRE_MAX_VOCAB)
        return PROTO("bad n_vocab %u", (unsigned)m->n_vocab);
    if (m->max_tokens < 1 || m->max_tokens > WIRE_MAX_TOKENS)
        return PROTO("bad max_tokens %u", (unsigned)m->max_tokens);
    if (m->max_ctx > WIRE_MAX_POS) return PROTO("max_ctx %u over limit", (unsigned)m->max_ctx);
    if (m->name_len > WIRE_MAX_NAME) return PROTO("name_len %u over limit", (unsigned)m->name_len);
    rd_copy(r, m->name, m->name_len, "name");
    if (r->bad) return rd_short(r, msg, msg_cap);
    m->name[m->name_len] = 0;
    if (has_nul(m->name, m->name_len)) return PROTO("NUL byte in shard name");
    return rd_end(r, msg, msg_cap);
}

/* ---- FORWARD ---- */

static uint32_t in_esize(uint32_t kind) {
    switch (kind) {
    case WIRE_IN_TOKENS: return 4;
    case WIRE_IN_HIDDEN_F32: return 4;
    case WIRE_IN_HIDDEN_F16: return 2;
    case WIRE_IN_HIDDEN_BF16: return 2;
    default: return 0;
    }
}

/* Shared FORWARD field rules; returns a static reason or NULL when valid. *data_bytes gets the
 * size of the input data. */
static const char *forward_check(const struct wire_forward *m, uint64_t *data_bytes, bool *too_large) {
    *too_large = false;
    if (m->n_tokens < 1) return "n_tokens is 0";
    if (m->n_tokens > WIRE_MAX_TOKENS) {
        *too_large = true;
        return "n_tokens over limit";
    }
    if ((uint64_t)m->start_pos + m->n_tokens > WIRE_MAX_POS) return "start_pos + n_tokens over limit";
    if (m->flags & ~(uint32_t)WIRE_FWD_FLAGS_KNOWN) return "unknown forward flags";
    if (m->out_mode > WIRE_OUT_SAMPLE) return "unknown out_mode";
    if (m->flags & WIRE_FWD_INHERIT) {
        if (m->inherit_epoch >= m->epoch) return "inherit_epoch not older than epoch";
        if (m->inherit_len > WIRE_MAX_POS) return "inherit_len over limit";
    } else if (m->inherit_epoch != 0 || m->inherit_len != 0) {
        return "inherit fields set without the inherit flag";
    }
    uint32_t es = in_esize(m->in_kind);
    if (es == 0) return "unknown in_kind";
    uint32_t cols = m->n_embd;
    if (m->in_kind == WIRE_IN_TOKENS) {
        if (m->n_embd != 0) return "n_embd must be 0 for token input";
        cols = 1;
    } else if (m->n_embd < 1 || m->n_embd > WIRE_MAX_EMBD) {
        return "bad n_embd";
    }
    if (!tensor_bytes(m->n_tokens, cols, es, WIRE_MAX_PAYLOAD, data_bytes)) {
        *too_large = true;
        return "input data over the payload limit";
    }
    return NULL;
}

static void wr_f32(struct wr *w, float v) {
    uint8_t b[4];
    kvs_wr_f32(b, v);
    wr_bytes(w, b, 4);
}
static float rd_f32(struct rd *r, const char *f) {
    const uint8_t *a;
    return rd_take(r, 4, f, &a) ? kvs_rd_f32(a) : 0.0f;
}

static bool f32_in(float v, float lo, float hi) { return v >= lo && v <= hi; } /* false for NaN */

/* Sampler block rules (not the window ids); a static reason or NULL. */
static const char *sample_check(const struct wire_sample_req *q) {
    if (!f32_in(q->temp, -1e30f, 1e30f)) return "sampler temp is not a finite number";
    if (!f32_in(q->top_p, 0.0f, 1.0f)) return "sampler top_p outside [0, 1]";
    if (!f32_in(q->min_p, 0.0f, 1.0f)) return "sampler min_p outside [0, 1]";
    if (!f32_in(q->repeat_penalty, 0.0f, 1e30f)) return "sampler repeat_penalty not in [0, finite]";
    if (!f32_in(q->presence_penalty, -1e30f, 1e30f)) return "sampler presence_penalty is not a finite number";
    if (q->top_k > WIRE_MAX_VOCAB) return "sampler top_k over limit";
    if (q->n_top > WIRE_MAX_TOP) return "sampler n_top over limit";
    if (q->n_window > WIRE_MAX_WINDOW) return "sampler n_window over limit";
    return NULL;
}

static bool addr_ok(const char *a, size_t n) {
    if (n < 1 || n > WIRE_MAX_ADDR) return false;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)a[i] < 0x21 || (unsigned char)a[i] > 0x7e) return false;
    return true;
}

/* Relay block rules; a static reason or NULL. */
static const char *relay_check(const struct wire_relay *rl, uint64_t epoch) {
    if (rl->relay_id == 0) return "relay_id is 0";
    if (rl->hidden_kind != WIRE_IN_HIDDEN_F32 && rl->hidden_kind != WIRE_IN_HIDDEN_F16 &&
        rl->hidden_kind != WIRE_IN_HIDDEN_BF16)
        return "relay hidden_kind is not a hidden kind";
    if (rl->n_next > WIRE_MAX_RELAY_HOPS) return "relay n_next over limit";
    for (uint32_t i = 0; i < rl->n_next; i++) {
        const struct wire_relay_hop *h = &rl->next[i];
        if (!addr_ok(h->addr, h->addr_len)) return "relay hop address is not 1..64 printable bytes";
        if (h->flags & ~(uint32_t)WIRE_FWD_INHERIT) return "relay hop flags unknown";
        if (h->flags & WIRE_FWD_INHERIT) {
            if (h->inherit_epoch >= epoch) return "relay hop inherit_epoch not older than epoch";
            if (h->inherit_len > WIRE_MAX_POS) return "relay hop inherit_len over limit";
        } else if (h->inherit_epoch || h->inherit_len) {
            return "relay hop inherit fields set without the inherit flag";
        }
    }
    return NULL;
}

/* Prefix block rules; a static reason or NULL. */
static const char *prefix_check(const struct wire_forward *m) {
    const struct wire_prefix *p = &m->prefix;
    if (!(m->flags & WIRE_FWD_PREFIX)) return p->first || p->n_hashes || p->hashes ? "prefix fields set without the prefix flag" : NULL;
    if (p->n_hashes < 1 || p->n_hashes > WIRE_MAX_PREFIX_HASHES) return "prefix n_hashes out of range";
    if (((uint64_t)p->first + p->n_hashes) * WIRE_PREFIX_TOKENS > (uint64_t)m->start_pos + m->n_tokens)
        return "prefix hashes past the positions the request covers";
    return NULL;
}

uint64_t wire_chain_hash(uint64_t prev, const int32_t *ids, uint32_t n) {
    uint64_t h = prev ^ 0x6A09E667F3BCC909ull;
    for (uint32_t i = 0; i < n; i++) { /* splitmix64 steps over each id: well mixed, order-sensitive */
        h ^= (uint64_t)(uint32_t)ids[i] + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
        h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
        h ^= h >> 31;
    }
    return h;
}

uint64_t wire_prefix_hash(const struct wire_prefix *p, uint32_t i) {
    return kvs_rd_u64((const uint8_t *)p->hashes + 8 * (size_t)i);
}

static int enc_forward(struct wr *w, const void *vm) {
    const struct wire_forward *m = vm;
    uint64_t nb;
    bool big;
    if (forward_check(m, &nb, &big)) return big ? KVS_ERR_TOO_LARGE : KVS_ERR_INVALID_ARG;
    if (!m->data) return KVS_ERR_INVALID_ARG;
    if (m->in_kind == WIRE_IN_TOKENS) {
        for (uint32_t i = 0; i < m->n_tokens; i++) {
            int32_t t = (int32_t)kvs_rd_u32((const uint8_t *)m->data + 4 * (size_t)i);
            if (t < 0 || (uint32_t)t >= WIRE_MAX_VOCAB) return KVS_ERR_INVALID_ARG;
        }
    }
    wr_bytes(w, m->session_id, WIRE_SID_SIZE);
    wr_u64(w, m->epoch);
    wr_u32(w, m->start_pos);
    wr_u32(w, m->n_tokens);
    wr_u32(w, m->flags);
    wr_u32(w, m->out_mode);
    wr_u64(w, m->inherit_epoch);
    wr_u32(w, m->inherit_len);
    wr_u32(w, m->in_kind);
    wr_u32(w, m->n_embd);
    wr_bytes(w, m->data, (size_t)nb);
    if (m->out_mode == WIRE_OUT_SAMPLE) {
        const struct wire_sample_req *q = &m->sample;
        if (sample_check(q)) return KVS_ERR_INVALID_ARG;
        if (q->n_window && !q->window) return KVS_ERR_INVALID_ARG;
        for (uint32_t i = 0; i < q->n_window; i++) {
            int32_t t = (int32_t)kvs_rd_u32((const uint8_t *)q->window + 4 * (size_t)i);
            if (t < 0 || (uint32_t)t >= WIRE_MAX_VOCAB) return KVS_ERR_INVALID_ARG;
        }
        wr_f32(w, q->temp);
        wr_f32(w, q->top_p);
        wr_f32(w, q->min_p);
        wr_f32(w, q->repeat_penalty);
        wr_f32(w, q->presence_penalty);
        wr_u32(w, q->top_k);
        wr_u64(w, q->seed);
        wr_u32(w, q->n_top);
        wr_u32(w, q->n_window);
        if (q->n_window) wr_bytes(w, q->window, (size_t)q->n_window * 4);
    }
    if (m->flags & WIRE_FWD_RELAY) {
        const struct wire_relay *rl = &m->relay;
        if (relay_check(rl, m->epoch)) return KVS_ERR_INVALID_ARG;
        wr_u64(w, rl->relay_id);
        wr_u16(w, rl->hop);
        wr_u16(w, rl->hidden_kind);
        wr_u16(w, rl->n_next);
        for (uint32_t i = 0; i < rl->n_next; i++) {
            const struct wire_relay_hop *h = &rl->next[i];
            wr_u8(w, h->addr_len);
            wr_bytes(w, h->addr, h->addr_len);
            wr_u32(w, h->flags);
            wr_u64(w, h->inherit_epoch);
            wr_u32(w, h->inherit_len);
        }
    }
    if (prefix_check(m)) return KVS_ERR_INVALID_ARG;
    if (m->flags & WIRE_FWD_PREFIX) {
        if (!m->prefix.hashes) return KVS_ERR_INVALID_ARG;
        wr_u32(w, m->prefix.first);
        wr_u32(w, m->prefix.n_hashes);
        wr_bytes(w, m->prefix.hashes, (size_t)m->prefix.n_hashes * 8);
    }
    return KVS_OK;
}

int wire_encode_forward(const struct wire_forward *m, uint8_t *buf, size_t cap, size_t *len) {
    return run_encoder(enc_forward, m, buf, cap, len);
}

static int dec_forward(struct rd *r, struct wire_forward *m, char *msg, size_t msg_cap) {
    rd_copy(r, m->session_id, WIRE_SID_SIZE, "session_id");
    m->epoch = rd_u64(r, "epoch");
    m->start_pos = rd_u32(r, "start_pos");
    m->n_tokens = rd_u32(r, "n_tokens");
    m->flags = rd_u32(r, "flags");
    m->out_mode = rd_u32(r, "out_mode");
    m->inherit_epoch = rd_u64(r, "inherit_epoch");
    m->inherit_len = rd_u32(r, "inherit_len");
    m->in_kind = rd_u32(r, "in_kind");
    m->n_embd = rd_u32(r, "n_embd");
    if (r->bad) return rd_short(r, msg, msg_cap);
    uint64_t nb;
    bool big;
    const char *why = forward_check(m, &nb, &big);
    if (why) return PROTO("FORWARD: %s", why);
    const bool blocks = m->out_mode == WIRE_OUT_SAMPLE || (m->flags & (WIRE_FWD_RELAY | WIRE_FWD_PREFIX));
    if (blocks ? nb > r->n - r->off : nb != r->n - r->off)
        return PROTO("FORWARD: input data is %zu bytes, n_tokens %u x n_embd %u needs %llu",
                     r->n - r->off, (unsigned)m->n_tokens, (unsigned)m->n_embd,
                     (unsigned long long)nb);
    const uint8_t *a;
    rd_take(r, (size_t)nb, "data", &a);
    m->data = a;
    if (m->in_kind == WIRE_IN_TOKENS) {
        for (uint32_t i = 0; i < m->n_tokens; i++) {
            int32_t t = (int32_t)kvs_rd_u32(a + 4 * (size_t)i);
            if (t < 0 || (uint32_t)t >= WIRE_MAX_VOCAB)
                return PROTO("FORWARD: token %u has id %d", (unsigned)i, (int)t);
        }
    }
    if (m->out_mode == WIRE_OUT_SAMPLE) {
        struct wire_sample_req *q = &m->sample;
        q->temp = rd_f32(r, "sampler temp");
        q->top_p = rd_f32(r, "sampler top_p");
        q->min_p = rd_f32(r, "sampler min_p");
        q->repeat_penalty = rd_f32(r, "sampler repeat_penalty");
        q->presence_penalty = rd_f32(r, "sampler presence_penalty");
        q->top_k = rd_u32(r, "sampler top_k");
        q->seed = rd_u64(r, "sampler seed");
        q->n_top = rd_u32(r, "sampler n_top");
        q->n_window = rd_u32(r, "sampler n_window");
        if (r->bad) return rd_short(r, msg, msg_cap);
        if ((why = sample_check(q)) != NULL) return PROTO("FORWARD: %s", why);
        if (!rd_take(r, (size_t)q->n_window * 4, "sampler window", &a)) return rd_short(r, msg, msg_cap);
        q->window = q->n_window ? a : NULL;
        for (uint32_t i = 0; i < q->n_window; i++) {
            int32_t t = (int32_t)kvs_rd_u32(a + 4 * (size_t)i);
            if (t < 0 || (uint32_t)t >= WIRE_MAX_VOCAB)
                return PROTO("FORWARD: window id %u is %d", (unsigned)i, (int)t);
        }
    }
    if (m->flags & WIRE_FWD_RELAY) {
        struct wire_relay *rl = &m->relay;
        rl->relay_id = rd_u64(r, "relay_id");
        rl->hop = rd_u16(r, "relay hop");
        rl->hidden_kind = rd_u16(r, "relay hidden_kind");
        rl->n_next = rd_u16(r, "relay n_next");
        if (r->bad) return rd_short(r, msg, msg_cap);
        if (rl->n_next > WIRE_MAX_RELAY_HOPS) return PROTO("FORWARD: relay n_next over limit");
        for (uint32_t i = 0; i < rl->n_next; i++) {
            struct wire_relay_hop *h = &rl->next[i];
            h->addr_len = rd_u8(r, "relay hop addr_len");
            if (h->addr_len > WIRE_MAX_ADDR) return PROTO("FORWARD: relay hop %u addr_len over limit", (unsigned)i);
            rd_copy(r, h->addr, h->addr_len, "relay hop addr");
            h->flags = rd_u32(r, "relay hop flags");
            h->inherit_epoch = rd_u64(r, "relay hop inherit_epoch");
            h->inherit_len = rd_u32(r, "relay hop inherit_len");
            if (r->bad) return rd_short(r, msg, msg_cap);
        }
        if ((why = relay_check(rl, m->epoch)) != NULL) return PROTO("FORWARD: %s", why);
    }
    if (m->flags & WIRE_FWD_PREFIX) {
        m->prefix.first = rd_u32(r, "prefix first");
        m->prefix.n_hashes = rd_u32(r, "prefix n_hashes");
        if (r->bad) return rd_short(r, msg, msg_cap);
        if ((why = prefix_check(m)) != NULL) return PROTO("FORWARD: %s", why);
        if (!rd_take(r, (size_t)m->prefix.n_hashes * 8, "prefix hashes", &a)) return rd_short(r, msg, msg_cap);
        m->prefix.hashes = a;
    }
    return rd_end(r, msg, msg_cap);
}

int32_t wire_forward_token(const struct wire_forward *m, uint32_t i) {
    return (int32_t)kvs_rd_u32((const uint8_t *)m->data + 4 * (size_t)i);
}

/* ---- FORWARD_REPLY ---- */

static uint32_t out_esize(uint32_t kind) {
    switch (kind) {
    case WIRE_OUTK_HIDDEN_F32: return 4;
    case WIRE_OUTK_HIDDEN_F16: return 2;
    case WIRE_OUTK_HIDDEN_BF16: return 2;
    case WIRE_OUTK_LOGITS_F32: return 4;
    default: return 0;
    }
}

static const char *reply_check(const struct wire_forward_reply *m, uint64_t *data_bytes,
                               bool *too_large) {
    *too_large = false;
    *data_bytes = 0;
    if (m->out_kind == WIRE_OUTK_NONE) {
        if (m->n_rows || m->n_cols) return "dims set with out_kind NONE";
        return NULL;
    }
    if (m->out_kind == WIRE_OUTK_SAMPLE) {
        if (m->n_rows != 1) return "SAMPLE reply with n_rows != 1";
        if (m->n_cols > WIRE_MAX_TOP) return "SAMPLE reply n_cols over limit";
        *data_bytes = 8 + 8 * (uint64_t)m->n_cols;
        return NULL;
    }
    uint32_t es = out_esize(m->out_kind);
    if (es == 0) return "unknown out_kind";
    if (m->n_rows < 1) return "n_rows is 0";
    if (m->n_rows > WIRE_MAX_TOKENS) {
        *too_large = true;
        return "n_rows over limit";
    }
    uint32_t max_cols = m->out_kind == WIRE_OUTK_LOGITS_F32 ? WIRE_MAX_VOCAB : WIRE_MAX_EMBD;
    if (m->n_cols < 1 || m->n_cols > max_cols) return "bad n_cols";
    if (!tensor_bytes(m->n_rows, m->n_cols, es, WIRE_MAX_PAYLOAD, data_bytes)) {
        *too_large = true;
        return "output data over the payload limit";
    }
    return NULL;
}

static int enc_forward_reply(struct wr *w, const void *vm) {
    const struct wire_forward_reply *m = vm;
    uint64_t nb;
    bool big;
    if (!status_fields_ok(&m->st)) return KVS_ERR_INVALID_ARG;
    enc_status(w, &m->st);
    if (m->st.status != KVS_OK) return KVS_OK;
    if (reply_check(m, &nb, &big)) return big ? KVS_ERR_TOO_LARGE : KVS_ERR_INVALID_ARG;
    if (nb && !m->data) return KVS_ERR_INVALID_ARG;
    wr_u32(w, m->out_kind);
    wr_u32(w, m->n_rows);
    wr_u32(w, m->n_cols);
    wr_bytes(w, m->data, (size_t)nb);
    return KVS_OK;
}

int wire_encode_forward_reply(const struct wire_forward_reply *m, uint8_t *buf, size_t cap,
                              size_t *len) {
    return run_encoder(enc_forward_reply, m, buf, cap, len);
}

static int dec_forward_reply(struct rd *r, struct wire_forward_reply *m, char *msg, size_t msg_cap) {
    int rc = dec_status_checked(r, &m->st, msg, msg_cap);
    if (rc != KVS_OK) return rc;
    if (m->st.status != KVS_OK) return rd_end(r, msg, msg_cap);
    m->out_kind = rd_u32(r, "out_kind");
    m->n_rows = rd_u32(r, "n_rows");
    m->n_cols = rd_u32(r, "n_cols");
    if (r->bad) return rd_short(r, msg, msg_cap);
    uint64_t nb;
    bool big;
    const char *why = reply_check(m, &nb, &big);
    if (why) return PROTO("FORWARD_REPLY: %s", why);
    if (nb != r->n - r->off)
        return PROTO("FORWARD_REPLY: data is %zu bytes, %u x %u needs %llu", r->n - r->off,
                     (unsigned)m->n_rows, (unsigned)m->n_cols, (unsigned long long)nb);
    const uint8_t *a;
    rd_take(r, (size_t)nb, "data", &a);
    m->data = nb ? a : NULL;
    if (m->out_kind == WIRE_OUTK_SAMPLE)
        for (uint32_t i = 0; i <= m->n_cols; i++) {
            int32_t t = (int32_t)kvs_rd_u32(a + 8 * (size_t)i);
            if (t < 0 || (uint32_t)t >= WIRE_MAX_VOCAB)
                return PROTO("FORWARD_REPLY: sampled id %u is %d", (unsigned)i, (int)t);
        }
    return rd_end(r, msg, msg_cap);
}

int wire_forward_reply_sample(const struct wire_forward_reply *m, int32_t *id, float *logprob, int32_t *top_ids,
                              float *top_lp) {
    if (!m || !id || !logprob || m->out_kind != WIRE_OUTK_SAMPLE || !m->data) return KVS_ERR_INVALID_ARG;
    const uint8_t *a = m->data;
    *id = (int32_t)kvs_rd_u32(a);
    *logprob = kvs_rd_f32(a + 4);
    for (uint32_t i = 0; i < m->n_cols; i++) {
        if (top_ids) top_ids[i] = (int32_t)kvs_rd_u32(a + 8 + 8 * (size_t)i);
        if (top_lp) top_lp[i] = kvs_rd_f32(a + 12 + 8 * (size_t)i);
    }
    return KVS_OK;
}

/* ---- f16 ---- */

float wire_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13); /* inf / NaN (payload kept) */
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: value = man * 2^-24, exact in f32 */
            float f = (float)man * 0x1p-24f;
            memcpy(&bits, &f, 4);
            bits |= sign;
        }
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t wire_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00 | ((ax >> 13) & 0x3ff)); /* NaN */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* rounds to >= 65520: inf */
    if (ax < 0x38800000u) {                                 /* below the smallest normal 2^-14 */
        /* subnormal or zero: scale so the result is an integer count of 2^-24 units, rounding
         * to nearest even via the FPU (exact: values here are < 2^-14, well within f32). */
        float a;
        memcpy(&a, &ax, 4);
        float q = a * 0x1p24f; /* in [0, 1024) */
        uint32_t n = (uint32_t)q;
        float rem = q - (float)n;
        if (rem > 0.5f || (rem == 0.5f && (n & 1))) n++;
        return (uint16_t)(sign | n); /* n == 1024 becomes the smallest normal: correct */
    }
    uint32_t e = (ax >> 23) - 112;
    uint32_t m = ax & 0x7fffff;
    uint32_t hv = (e << 10) | (m >> 13);
    uint32_t rest = m & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (hv & 1))) hv++; /* carry into exp is correct */
    return (uint16_t)(sign | hv);
}

/* ---- bf16 ---- */

float wire_bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t wire_f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x0040); /* NaN: quiet, payload top kept */
    /* round to nearest even on the low 16 bits; a carry into the exponent is correct (up to inf) */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* n little-endian elements of type elem to host floats. */
enum { ELEM_F32, ELEM_F16, ELEM_BF16 };
static void le_to_f32(const uint8_t *src, int elem, size_t n, float *dst) {
    if (elem == ELEM_F16) {
        for (size_t i = 0; i < n; i++) dst[i] = wire_f16_to_f32(kvs_rd_u16(src + 2 * i));
    } else if (elem == ELEM_BF16) {
        for (size_t i = 0; i < n; i++) dst[i] = wire_bf16_to_f32(kvs_rd_u16(src + 2 * i));
    } else {
        for (size_t i = 0; i < n; i++) dst[i] = kvs_rd_f32(src + 4 * i);
    }
}

int wire_forward_hidden_to_f32(const struct wire_forward *m, float *dst) {
    if (!m || !dst || !m->data) return KVS_ERR_INVALID_ARG;
    if (m->in_kind != WIRE_IN_HIDDEN_F32 && m->in_kind != WIRE_IN_HIDDEN_F16 && m->in_kind != WIRE_IN_HIDDEN_BF16)
        return KVS_ERR_INVALID_ARG;
    int elem = m->in_kind == WIRE_IN_HIDDEN_F16 ? ELEM_F16 : m->in_kind == WIRE_IN_HIDDEN_BF16 ? ELEM_BF16 : ELEM_F32;
    le_to_f32(m->data, elem, (size_t)m->n_tokens * m->n_embd, dst);
    return KVS_OK;
}

int wire_forward_reply_to_f32(const struct wire_forward_reply *m, float *dst) {
    if (!m || !dst || !m->data) return KVS_ERR_INVALID_ARG;
    uint32_t es = out_esize(m->out_kind);
    if (es == 0) return KVS_ERR_INVALID_ARG;
    int elem = m->out_kind == WIRE_OUTK_HIDDEN_F16 ? ELEM_F16 : m->out_kind == WIRE_OUTK_HIDDEN_BF16 ? ELEM_BF16 : ELEM_F32;
    le_to_f32(m->data, elem, (size_t)m->n_rows * m->n_cols, dst);
    return KVS_OK;
}

/* ---- TRUNCATE / RELEASE / CANCEL ---- */

static int enc_truncate(struct wr *w, const void *vm) {
    const struct wire_truncate *m = vm;
    if (m->len > WIRE_MAX_POS) return KVS_ERR_INVALID_ARG;
    wr_bytes(w, m->session_id, WIRE_SID_SIZE);
    wr_u64(w, m->epoch);
    wr_u32(w, m->len);
    return KVS_OK;
}

int wire_encode_truncate(const struct wire_truncate *m, uint8_t *buf, size_t cap, size_t *len) {
    return run_encoder(enc_truncate, m, buf, cap, len);
}

static int dec_truncate(struct rd *r, struct wire_truncate *m, char *msg, size_t msg_cap) {
    rd_copy(r, m->session_id, WIRE_SID_SIZE, "session_id");
    m->epoch = rd_u64(r, "epoch");
    m->len = rd_u32(r, "len");
    if (r->bad) return rd_short(r, msg, msg_cap);
    if (m->len > WIRE_MAX_POS) return PROTO("TRUNCATE: len %u over limit", (unsigned)m->len);
    return rd_end(r, msg, msg_cap);
}

static int enc_release(struct wr *w, const void *vm) {
    const struct wire_release *m = vm;
    wr_bytes(w, m->session_id, WIRE_SID_SIZE);
    wr_u64(w, m->epoch);
    return KVS_OK;
}

int wire_encode_release(const struct wire_release *m, uint8_t *buf, size_t cap, size_t *len) {
    return run_encoder(enc_release, m, buf, cap, len);
}

static int dec_release(struct rd *r, struct wire_release *m, char *msg, size_t msg_cap) {
    rd_copy(r, m->session_id, WIRE_SID_SIZE, "session_id");
    m->epoch = rd_u64(r, "epoch");
    return rd_end(r, msg, msg_cap);
}

static int enc_cancel(struct wr *w, const void *vm) {
    const struct wire_cancel *m = vm;
    wr_u64(w, m->target_request_id);
    return KVS_OK;
}

int wire_encode_cancel(const struct wire_cancel *m, uint8_t *buf, size_t cap, size_t *len) {
    return run_encoder(enc_cancel, m, buf, cap, len);
}

static int dec_cancel(struct rd *r, struct wire_cancel *m, char *msg, size_t msg_cap) {
    m->target_request_id = rd_u64(r, "target_request_id");
    return rd_end(r, msg, msg_cap);
}

/* ---- STATUS ---- */

static int enc_status_reply(struct wr *w, const void *vm) {
    const struct wire_status_reply *m = vm;
    if (!status_fields_ok(&m->st)) return KVS_ERR_INVALID_ARG;
    if (m->msg_len > WIRE_MAX_MSG || has_nul(m->msg, m->msg_len)) return KVS_ERR_INVALID_ARG;
    enc_status(w, &m->st);
    wr_u16(w, m->msg_len);
    wr_bytes(w, m->msg, m->msg_len);
    return KVS_OK;
}

int wire_encode_status_reply(const struct wire_status_reply *m, uint8_t *buf, size_t cap,
                             size_t *len) {
    return run_encoder(enc_status_reply, m, buf, cap, len);
}

static int dec_status_reply(struct rd *r, struct wire_status_reply *m, char *msg, size_t msg_cap) {
    int rc = dec_status_checked(r, &m->st, msg, msg_cap);
    if (rc != KVS_OK) return rc;
    m->msg_len = rd_u16(r, "msg_len");
    if (r->bad) return rd_short(r, msg, msg_cap);
    if (m->msg_len > WIRE_MAX_MSG) return PROTO("STATUS: msg_len %u over limit", (unsigned)m->msg_len);
    rd_copy(r, m->msg, m->msg_len, "msg");
    if (r->bad) return rd_short(r, msg, msg_cap);
    m->msg[m->msg_len] = 0;
    if (has_nul(m->msg, m->msg_len)) return PROTO("STATUS: NUL byte in message");
    return rd_end(r, msg, msg_cap);
}

/* ---- STATS ---- */

static int enc_stats_reply(struct wr *w, const void *vm) {
    const struct wire_stats_reply *m = vm;
    if (!status_fields_ok(&m->st)) return KVS_ERR_INVALID_ARG;
    enc_status(w, &m->st);
    if (m->st.status != KVS_OK) return KVS_OK;
    if (m->n_stats > WIRE_MAX_STATS) return KVS_ERR_TOO_LARGE;
    wr_u32(w, m->n_stats);
    for (uint32_t i = 0; i < m->n_stats; i++) {
        size_t nl = strnlen(m->stats[i].name, sizeof m->stats[i].name);
        if (!stat_name_ok(m->stats[i].name, nl)) return KVS_ERR_INVALID_ARG;
        wr_u8(w, (uint8_t)nl);
        wr_bytes(w, m->stats[i].name, nl);
        wr_u64(w, m->stats[i].value);
    }
    return KVS_OK;
}

int wire_encode_stats_reply(const struct wire_stats_reply *m, uint8_t *buf, size_t cap,
                            size_t *len) {
    return run_encoder(enc_stats_reply, m, buf, cap, len);
}

static int dec_stats_reply(struct rd *r, struct wire_stats_reply *m, char *msg, size_t msg_cap) {
    int rc = dec_status_checked(r, &m->st, msg, msg_cap);
    if (rc != KVS_OK) return rc;
    if (m->st.status != KVS_OK) return rd_end(r, msg, msg_cap);
    m->n_stats = rd_u32(r, "n_stats");
    if (r->bad) return rd_short(r, msg, msg_cap);
    if (m->n_stats > WIRE_MAX_STATS) return PROTO("STATS_REPLY: n_stats %u over limit", (unsigned)m->n_stats);
    for (uint32_t i = 0; i < m->n_stats; i++) {
        struct wire_stat *s = &m->stats[i];
        uint8_t nl = rd_u8(r, "stat name_len");
        if (r->bad) return rd_short(r, msg, msg_cap);
        if (nl > WIRE_MAX_STAT_NAME) return PROTO("STATS_REPLY: name %u too long", (unsigned)i);
        rd_copy(r, s->name, nl, "stat name");
        s->value = rd_u64(r, "stat value");
        if (r->bad) return rd_short(r, msg, msg_cap);
        s->name[nl] = 0;
        if (!stat_name_ok(s->name, nl)) return PROTO("STATS_REPLY: bad name of counter %u", (unsigned)i);
    }
    return rd_end(r, msg, msg_cap);
}

/* ---- VOCAB ---- */

static int enc_vocab(struct wr *w, const void *vm) {
    const struct wire_vocab *m = vm;
    if (m->max_count < 1 || m->max_count > WIRE_MAX_VOCAB || m->first >= WIRE_MAX_VOCAB)
        return KVS_ERR_INVALID_ARG;
    wr_u32(w, m->first);
    wr_u32(w, m->max_count);
    return KVS_OK;
}

int wire_encode_vocab(const struct wire_vocab *m, uint8_t *buf, size_t cap, size_t *len) {
    return run_encoder(enc_vocab, m, buf, cap, len);
}

static int dec_vocab(struct rd *r, struct wire_vocab *m, char *msg, size_t msg_cap) {
    m->first = rd_u32(r, "first");
    m->max_count = rd_u32(r, "max_count");
    if (r->bad) return rd_short(r, msg, msg_cap);
    if (m->first >= WIRE_MAX_VOCAB) return PROTO("VOCAB: first %u over limit", (unsigned)m->first);
    if (m->max_count < 1 || m->max_count > WIRE_MAX_VOCAB)
        return PROTO("VOCAB: bad max_count %u", (unsigned)m->max_count);
    return rd_end(r, msg, msg_cap);
}

static const char *vocab_head_check(const struct wire_vocab_reply *m) {
    if (m->n_vocab < 1 || m->n_vocab > WIRE_MAX_VOCAB) return "bad n_vocab";
    if (m->first > m->n_vocab || m->count > m->n_vocab - m->first) return "page outside the vocab";
    if (m->bos < -1 || (m->bos >= 0 && (uint32_t)m->bos >= m->n_vocab)) return "bad bos";
    if (m->eos < -1 || (m->eos >= 0 && (uint32_t)m->eos >= m->n_vocab)) return "bad eos";
    if (m->add_space_prefix > 1) return "bad add_space_prefix";
    if (m->tok_model_len > WIRE_MAX_TOK_MODEL) return "tok_model too long";
    if (has_nul(m->tok_model, m->tok_model_len)) return "NUL byte in tok_model";
    return NULL;
}

static int enc_vocab_reply(struct wr *w, const void *vm) {
    const struct wire_vocab_reply *m = vm;
    if (!status_fields_ok(&m->st)) return KVS_ERR_INVALID_ARG;
    enc_status(w, &m->st);
    if (m->st.status != KVS_OK) return KVS_OK;
    if (vocab_head_check(m)) return KVS_ERR_INVALID_ARG;
    if (m->count && !m->tokens) return KVS_ERR_INVALID_ARG;
    wr_u32(w, m->n_vocab);
    wr_u32(w, m->first);
    wr_u32(w, m->count);
    wr_u32(w, (uint32_t)m->bos);
    wr_u32(w, (uint32_t)m->eos);
    wr_u8(w, m->add_space_prefix);
    wr_u8(w, m->tok_model_len);
    wr_bytes(w, m->tok_model, m->tok_model_len);
    for (uint32_t i = 0; i < m->count; i++) {
        const struct wire_vocab_token *t = &m->tokens[i];
        if (t->text_len > WIRE_MAX_TOKEN_TEXT || (t->text_len && !t->text)) return KVS_ERR_INVALID_ARG;
        if (t->type < 0 || t->type > WIRE_TOKEN_TYPE_MAX) return KVS_ERR_INVALID_ARG;
        uint32_t sbits;
        memcpy(&sbits, &t->score, 4);
        wr_u16(w, (uint16_t)t->text_len);
        wr_bytes(w, t->text, t->text_len);
        wr_u32(w, sbits);
        wr_u32(w, (uint32_t)t->type);
        if (w->n > WIRE_MAX_PAYLOAD) return KVS_ERR_TOO_LARGE; /* stop counting early */
    }
    return KVS_OK;
}

int wire_encode_vocab_reply(const struct wire_vocab_reply *m, uint8_t *buf, size_t cap,
                            size_t *len) {
    return run_encoder(enc_vocab_reply, m, buf, cap, len);
}

/* One entry at entries[*off]; false at the end or on malformed bytes. */
static bool vocab_entry(const uint8_t *p, size_t n, size_t *off, struct wire_vocab_token *tok) {
    size_t o = *off;
    if (o > n || n - o < 2) return false;
    uint16_t tl = kvs_rd_u16(p + o);
    if (n - o - 2 < (size_t)tl + 8) return false;
    tok->text = (const char *)(p + o + 2);
    tok->text_len = tl;
    tok->score = kvs_rd_f32(p + o + 2 + tl);
    tok->type = (int32_t)kvs_rd_u32(p + o + 2 + tl + 4);
    *off = o + 2 + tl + 8;
    return true;
}

static int dec_vocab_reply(struct rd *r, struct wire_vocab_reply *m, char *msg, size_t msg_cap) {
    int rc = dec_status_checked(r, &m->st, msg, msg_cap);
    if (rc != KVS_OK) return rc;
    if (m->st.status != KVS_OK) return rd_end(r, msg, msg_cap);
    m->n_vocab = rd_u32(r, "n_vocab");
    m->first = rd_u32(r, "first");
    m->count = rd_u32(r, "count");
    m->bos = (int32_t)rd_u32(r, "bos");
    m->eos = (int32_t)rd_u32(r, "eos");
    m->add_space_prefix = rd_u8(r, "add_space_prefix");
    m->tok_model_len = rd_u8(r, "tok_model_len");
    if (r->bad) return rd_short(r, msg, msg_cap);
    if (m->tok_model_len > WIRE_MAX_TOK_MODEL) return PROTO("VOCAB_REPLY: tok_model too long");
    rd_copy(r, m->tok_model, m->tok_model_len, "tok_model");
    if (r->bad) return rd_short(r, msg, msg_cap);
    m->tok_model[m->tok_model_len] = 0;
    const char *why = vocab_head_check(m);
    if (why) return PROTO("VOCAB_REPLY: %s", why);
    /* Each entry takes >= 10 bytes: a cheap bound before walking. */
    if ((uint64_t)m->count * 10 > r->n - r->off)
        return PROTO("VOCAB_REPLY: %u entries cannot fit in %zu bytes", (unsigned)m->count,
                     r->n - r->off);
    const uint8_t *base = r->p + r->off;
    size_t avail = r->n - r->off, off = 0;
    for (uint32_t i = 0; i < m->count; i++) {
        struct wire_vocab_token t;
        if (!vocab_entry(base, avail, &off, &t)) return PROTO("VOCAB_REPLY: entry %u truncated", (unsigned)i);
        if (t.type < 0 || t.type > WIRE_TOKEN_TYPE_MAX)
            return PROTO("VOCAB_REPLY: entry %u has type %d", (unsigned)i, (int)t.type);
    }
    const uint8_t *a;
    rd_take(r, off, "entries", &a);
    m->entries = off ? a : NULL;
    m->entries_len = off;
    m->tokens = NULL;
    return rd_end(r, msg, msg_cap);
}

bool wire_vocab_next(const struct wire_vocab_reply *v, size_t *off, struct wire_vocab_token *tok) {
    if (!v || !off || !tok || !v->entries) return false;
    return vocab_entry(v->entries, v->entries_len, off, tok);
}

/* ---- RELAY_LISTEN ---- */

static int enc_relay_listen(struct wr *w, const void *vm) {
    const struct wire_relay_listen *m = vm;
    if (m->relay_id == 0) return KVS_ERR_INVALID_ARG;
    wr_u64(w, m->relay_id);
    return KVS_OK;
}

int wire_encode_relay_listen(const struct wire_relay_listen *m, uint8_t *buf, size_t cap, size_t *len) {
    return run_encoder(enc_relay_listen, m, buf, cap, len);
}

static int dec_relay_listen(struct rd *r, struct wire_relay_listen *m, char *msg, size_t msg_cap) {
    m->relay_id = rd_u64(r, "relay_id");
    if (r->bad) return rd_short(r, msg, msg_cap);
    if (m->relay_id == 0) return PROTO("RELAY_LISTEN: relay_id is 0");
    return rd_end(r, msg, msg_cap);
}

/* ---- VOCAB_META ---- */

static int enc_vocab_meta(struct wr *w, const void *vm) {
    const struct wire_vocab_meta *m = vm;
    if (m->first > WIRE_MAX_MERGES || m->max_count < 1 || m->max_count > WIRE_MAX_MERGES) return KVS_ERR_INVALID_ARG;
    wr_u32(w, m->first);
    wr_u32(w, m->max_count);
    return KVS_OK;
}

int wire_encode_vocab_meta(const struct wire_vocab_meta *m, uint8_t *buf, size_t cap, size_t *len) {
    return run_encoder(enc_vocab_meta, m, buf, cap, len);
}

static int dec_vocab_meta(struct rd *r, struct wire_vocab_meta *m, char *msg, size_t msg_cap) {
    m->first = rd_u32(r, "first");
    m->max_count = rd_u32(r, "max_count");
    if (r->bad) return rd_short(r, msg, msg_cap);
    if (m->first > WIRE_MAX_MERGES) return PROTO("VOCAB_META: first %u over limit", (unsigned)m->first);
    if (m->max_count < 1 || m->max_count > WIRE_MAX_MERGES)
        return PROTO("VOCAB_META: bad max_count %u", (unsigned)m->max_count);
    return rd_end(r, msg, msg_cap);
}

static const char *vocab_meta_check(const struct wire_vocab_meta_reply *m) {
    if (m->n_vocab < 1 || m->n_vocab > WIRE_MAX_VOCAB) return "bad n_vocab";
    if (m->add_bos > 2) return "bad add_bos";
    if (m->rstrip_specials > 1) return "bad rstrip_specials";
    if (m->pre_len > WIRE_MAX_PRE) return "pre too long";
    if (has_nul(m->pre, m->pre_len)) return "NUL byte in pre";
    if (m->n_merges > WIRE_MAX_MERGES) return "too many merges";
    if (m->first > m->n_merges || m->count > m->n_merges - m->first) return "page outside the merges";
    if (m->template_len > WIRE_MAX_TEMPLATE) return "chat template too long";
    if (m->template_len && m->first != 0) return "chat template outside the first page";
    return NULL;
}

static int enc_vocab_meta_reply(struct wr *w, const void *vm) {
    const struct wire_vocab_meta_reply *m = vm;
    if (!status_fields_ok(&m->st)) return KVS_ERR_INVALID_ARG;
    enc_status(w, &m->st);
    if (m->st.status != KVS_OK) return KVS_OK;
    if (vocab_meta_check(m)) return KVS_ERR_INVALID_ARG;
    if ((m->count && !m->merge_ids) || (m->template_len && !m->chat_template)) return KVS_ERR_INVALID_ARG;
    if (has_nul(m->chat_template, m->template_len)) return KVS_ERR_INVALID_ARG;
    wr_u32(w, m->n_vocab);
    wr_u8(w, (uint8_t)(m->add_bos | m->rstrip_specials << 2));
    wr_u8(w, m->pre_len);
    wr_bytes(w, m->pre, m->pre_len);
    wr_u32(w, m->n_merges);
    wr_u32(w, m->first);
    wr_u32(w, m->count);
    wr_u32(w, m->template_len);
    wr_bytes(w, m->chat_template, m->template_len);
    for (uint64_t i = 0; i < 2ull * m->count; i++) {
        int32_t id = m->merge_ids[i];
        if (id < 0 || (uint32_t)id >= m->n_vocab) return KVS_ERR_INVALID_ARG;
        wr_u32(w, (uint32_t)id);
        if (w->n > WIRE_MAX_PAYLOAD) return KVS_ERR_TOO_LARGE;
    }
    return KVS_OK;
}

int wire_encode_vocab_meta_reply(const struct wire_vocab_meta_reply *m, uint8_t *buf, size_t cap,
                                 size_t *len) {
    return run_encoder(enc_vocab_meta_reply, m, buf, cap, len);
}

static int dec_vocab_meta_reply(struct rd *r, struct wire_vocab_meta_reply *m, char *msg, size_t msg_cap) {
    int rc = dec_status_checked(r, &m->st, msg, msg_cap);
    if (rc != KVS_OK) return rc;
    if (m->st.status != KVS_OK) return rd_end(r, msg, msg_cap);
    m->n_vocab = rd_u32(r, "n_vocab");
    const uint8_t flags = rd_u8(r, "add_bos");
    m->pre_len = rd_u8(r, "pre_len");
    if (r->bad) return rd_short(r, msg, msg_cap);
    if (flags & ~7u) return PROTO("VOCAB_META_REPLY: reserved bits set in the add_bos byte");
    m->add_bos = flags & 3u;
    m->rstrip_specials = flags >> 2;
    if (m->pre_len > WIRE_MAX_PRE) return PROTO("VOCAB_META_REPLY: pre too long");
    rd_copy(r, m->pre, m->pre_len, "pre");
    m->n_merges = rd_u32(r, "n_merges");
    m->first = rd_u32(r, "first");
    m->count = rd_u32(r, "count");
    m->template_len = rd_u32(r, "template_len");
    if (r->bad) return rd_short(r, msg, msg_cap);
    m->pre[m->pre_len] = 0;
    const char *why = vocab_meta_check(m);
    if (why) return PROTO("VOCAB_META_REPLY: %s", why);
    const uint8_t *t = NULL;
    if (m->template_len && !rd_take(r, m->template_len, "chat_template", &t)) return rd_short(r, msg, msg_cap);
    if (t && memchr(t, 0, m->template_len)) return PROTO("VOCAB_META_REPLY: NUL byte in the chat template");
    m->chat_template = (const char *)t;
    if ((uint64_t)m->count * 8 != r->n - r->off)
        return PROTO("VOCAB_META_REPLY: %u merges need %llu bytes, %zu left", (unsigned)m->count,
                     (unsigned long long)m->count * 8, r->n - r->off);
    const uint8_t *a = NULL;
    if (m->count && !rd_take(r, (size_t)m->count * 8, "merges", &a)) return rd_short(r, msg, msg_cap);
    for (uint64_t i = 0; i < 2ull * m->count; i++)
        if (kvs_rd_u32(a + 4 * i) >= m->n_vocab)
            return PROTO("VOCAB_META_REPLY: merge %llu names a token outside the vocab", (unsigned long long)(i / 2));
    m->merges = a;
    m->merge_ids = NULL;
    return rd_end(r, msg, msg_cap);
}

bool wire_vocab_meta_merge(const struct wire_vocab_meta_reply *m, uint32_t i, int32_t *left, int32_t *right) {
    if (!m || !m->merges || i >= m->count) return false;
    *left = (int32_t)kvs_rd_u32(m->merges + 8 * (size_t)i);
    *right = (int32_t)kvs_rd_u32(m->merges + 8 * (size_t)i + 4);
    return true;
}

/* ---- public decoders: zero, parse, zero again on failure ---- */

#define WIRE_DECODER_(name, type)                                                        \
    int wire_decode_##name(const uint8_t *payload, size_t len, type *out, char *msg,     \
                           size_t msg_cap) {                                             \
        if (!out || (!payload && len)) return KVS_ERR_INVALID_ARG;                       \
        memset(out, 0, sizeof *out);                                                     \
        struct rd r = {payload, len, 0, false, NULL};                                    \
        int rc = dec_##name(&r, out, msg, msg_cap);                                      \
        if (rc != KVS_OK) memset(out, 0, sizeof *out);                                   \
        return rc;                                                                       \
    }

WIRE_DECODER_(hello, struct wire_hello)
WIRE_DECODER_(info, struct wire_info)
WIRE_DECODER_(forward, struct wire_forward)
WIRE_DECODER_(forward_reply, struct wire_forward_reply)
WIRE_DECODER_(truncate, struct wire_truncate)
WIRE_DECODER_(release, struct wire_release)
WIRE_DECODER_(cancel, struct wire_cancel)
WIRE_DECODER_(relay_listen, struct wire_relay_listen)
WIRE_DECODER_(status_reply, struct wire_status_reply)
WIRE_DECODER_(stats_reply, struct wire_stats_reply)
WIRE_DECODER_(vocab, struct wire_vocab)
WIRE_DECODER_(vocab_reply, struct wire_vocab_reply)
WIRE_DECODER_(vocab_meta, struct wire_vocab_meta)
WIRE_DECODER_(vocab_meta_reply, struct wire_vocab_meta_reply)

int wire_decode_empty(const uint8_t *payload, size_t len, char *msg, size_t msg_cap) {
    (void)payload;
    if (len != 0) return PROTO("%zu bytes in a payload that must be empty", len);
    return KVS_OK;
}
