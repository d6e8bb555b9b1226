#include "forward.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kv_attn.h"
#include "quant.h"
#include "util.h"
#include "vecops.h"

/* One forward call's working set. Rows are tokens of the active items, in
 * item order; tok_item/tok_pos say whose and where each row is. */
typedef struct {
    const model *m;
    ops_pool *pool;
    const kv_state *kv;
    fwd_item *items;
    int n_tok;
    int *tok_item;     /* [n_tok] item index */
    int32_t *tok_pos;  /* [n_tok] absolute position */
    float *x;          /* [n_tok][n_embd] residual stream */
    float *xb;         /* [n_tok][n_embd] normed input */
    float *q;          /* [n_tok][n_head * head_dim] */
    float *k;          /* [n_tok][kv_dim] */
    float *v;          /* [n_tok][kv_dim] */
    float *att;        /* [n_tok][n_head * head_dim] */
    float *gate;       /* [n_tok][n_ff] */
    float *up;         /* [n_tok][n_ff] */
    float *rope_cs;    /* [n_tok][n_rot] the token's rotation (ops_rope_cs), for every global layer */
    float *rope_cs_swa; /* [n_tok][n_rot] the same for local (sliding-window) layers, or NULL */
    void *act;         /* matmul activation scratch */
    float *att_scratch; /* per thread: scores [group][max_pos] + k/v row */
    size_t att_scratch_per_thread;
    const void **att_rows; /* per thread: the key then the value rows of one head, [2 * max_pos] */
    size_t att_rows_per_thread;
    int layer;         /* local layer index being computed */
} fwd_run_ctx;

static void *xmalloc_checked(size_t a, size_t b, bool *ok) {
    uint64_t n;
    if (!kvs_mul_u64(a, b, &n) || n > SIZE_MAX) {
        *ok = false;
        return NULL;
    }
    void *p = malloc(n ? (size_t)n : 1);
    if (!p) *ok = false;
    return p;
}

/* ---- per-token parallel helpers ---- */

static void norm_task(void *p, int64_t t0, int64_t t1, int slot) {
    (void)slot;
    fwd_run_ctx *c = p;
    const model_layer *L = &c->m->layers[c->layer];
    int64_t d = c->m->hp.n_embd;
    for (int64_t t = t0; t < t1; t++)
        ops_rmsnorm(c->x + (size_t)t * d, L->attn_norm, c->xb + (size_t)t * d, d, c->m->hp.rms_eps);
}

static void ffn_norm_task(void *p, int64_t t0, int64_t t1, int slot) {
    (void)slot;
    fwd_run_ctx *c = p;
    const model_layer *L = &c->m->layers[c->layer];
    int64_t d = c->m->hp.n_embd;
    for (int64_t t = t0; t < t1; t++)
        ops_rmsnorm(c->x + (size_t)t * d, L->ffn_norm, c->xb + (size_t)t * d, d, c->m->hp.rms_eps);
}

/* gelu(x) with the tanh approximation, as ggml_gelu (Gemma's hidden_activation). */
static void geglu(float *gate, const float *up, int64_t n) {
    const float k = 0.79788456080286535588f; /* sqrt(2 / pi) */
    for (int64_t i = 0; i < n; i++) {
        const float x = gate[i];
        gate[i] = 0.5f * x * (1.0f + tanhf(k * x * (1.0f + 0.044715f * x * x))) * up[i];
    }
}

static void swiglu_task(void *p, int64_t t0, int64_t t1, int slot) {
    (void)slot;
    fwd_run_ctx *c = p;
    int64_t f = c->m->hp.n_ff;
    bool gelu = c->m->hp.arch->ffn_act == ARCH_FFN_GELU_TANH;
    for (int64_t t = t0; t < t1; t++) {
        if (gelu) geglu(c->gate + (size_t)t * f, c->up + (size_t)t * f, f);
        else vec_swiglu(c->gate + (size_t)t * f, c->up + (size_t)t * f, f);
    }
}

/* RMSNorm of each of n_heads heads of x in place (q/k norm). */
static void norm_heads(float *x, const float *w, int n_heads, int head_dim, float eps) {
    for (int h = 0; h < n_heads; h++) ops_rmsnorm(x + (size_t)h * (size_t)head_dim, w, x + (size_t)h * (size_t)head_dim, head_dim, eps);
}

static void add_bias(float *x, const float *b, int n) {
    for (int i = 0; i < n; i++) x[i] += b[i];
}

/* Biases and q/k norms (where the architecture has them) and rope on q and
 * k (the local layers' rotation on a sliding-window layer), then K/V into the
 * session's blocks at the token's position. */
static void rope_store_task(void *p, int64_t t0, int64_t t1, int slot) {
    (void)slot;
    fwd_run_ctx *c = p;
    const model_hparams *hp = &c->m->hp;
    const model_layer *L = &c->m->layers[c->layer];
    void (*rope)(float *, int, int, int, const float *) = hp->arch->rope_style == ARCH_ROPE_NEOX ? ops_rope_neox : ops_rope;
    int kv_dim = (int)(hp->n_head_kv * hp->head_dim), q_dim = (int)(hp->n_head * hp->head_dim);
    const uint32_t kv_type = kv_get_params(c->kv)->kv_type;
    for (int64_t t = t0; t < t1; t++) {
        float *q = c->q + (size_t)t * (size_t)q_dim, *k = c->k + (size_t)t * (size_t)kv_dim;
        float *v = c->v + (size_t)t * (size_t)kv_dim;
        if (L->bq) add_bias(q, L->bq, q_dim);
        if (L->bk) add_bias(k, L->bk, kv_dim);
        if (L->bv) add_bias(v, L->bv, kv_dim);
        if (L->q_norm) norm_heads(q, L->q_norm, (int)hp->n_head, (int)hp->head_dim, hp->rms_eps);
        if (L->k_norm) norm_heads(k, L->k_norm, (int)hp->n_head_kv, (int)hp->head_dim, hp->rms_eps);
        const bool swa = model_layer_is_swa(hp, c->m->first + (uint32_t)c->layer);
        const float *cs = (swa ? c->rope_cs_swa : c->rope_cs) + (size_t)t * hp->n_rot;
        rope(q, (int)hp->n_head, (int)hp->head_dim, (int)hp->n_rot, cs);
        rope(k, (int)hp->n_head_kv, (int)hp->head_dim, (int)hp->n_rot, cs);
        kv_txn *txn = c->items[c->tok_item[t]].txn;
        const int hd = (int)hp->head_dim, rot_k = kv_attn_rot_k(kv_type, hd), rot_v = kv_attn_rot_v(kv_type, hd);
        if (rot_k) { /* a quantized cache holds rotated rows (kv_attn.h): q, k and v turn with them */
            kv_attn_rotate(q, q_dim, rot_k);
            kv_attn_rotate(k, kv_dim, rot_k);
        }
        if (rot_v) kv_attn_rotate(v, kv_dim, rot_v);
        for (int h = 0; h < (int)hp->n_head_kv; h++) { /* one row per kv head */
            void *kd = kv_txn_k(txn, c->layer, (uint32_t)c->tok_pos[t], h);
            void *vd = kv_txn_v(txn, c->layer, (uint32_t)c->tok_pos[t], h);
            const float *kh = k + (size_t)h * (size_t)hd, *vh = v + (size_t)h * (size_t)hd;
            kv_attn_store_row(kv_type, kh, kd, hd);
            kv_attn_store_row(kv_type, vh, vd, hd);
        }
    }
}

/* Attention for one (token, kv head) task: the group of query heads that
 * share the kv head attend over positions [0, pos] of the token's session, or
 * on a sliding-window layer over the last n_swa of them, [pos - n_swa + 1, pos]
 * (llama.cpp's standard window). */
static void attention_task(void *p, int64_t task0, int64_t task1, int slot) {
    fwd_run_ctx *c = p;
    const model_hparams *hp = &c->m->hp;
    int hd = (int)hp->head_dim, n_kv = (int)hp->n_head_kv, group = (int)(hp->n_head / hp->n_head_kv);
    int q_dim = (int)hp->n_head * hd;
    const uint32_t kv_type = kv_get_params(c->kv)->kv_type;
    float scale = 1.0f / sqrtf((float)hd);
    float *scratch = c->att_scratch + (size_t)slot * c->att_scratch_per_thread;
    const bool swa = model_layer_is_swa(hp, c->m->first + (uint32_t)c->layer);
    const int rot_v = kv_attn_rot_v(kv_type, hd);
    for (int64_t task = task0; task < task1; task++) {
        int t = (int)(task / n_kv), g = (int)(task % n_kv);
        int32_t pos = c->tok_pos[t];
        int n_pos = pos + 1;
        int lo = swa && (uint32_t)n_pos > hp->n_swa ? n_pos - (int)hp->n_swa : 0; /* first position in the window */
        kv_txn *txn = c->items[c->tok_item[t]].txn;
        const float *q = c->q + (size_t)t * (size_t)q_dim + (size_t)g * (size_t)group * (size_t)hd;
        float *scores = scratch; /* [group][n_pos] */
        const void **keys = c->att_rows + (size_t)slot * c->att_rows_per_thread; /* this head's key rows */
        const void **rows = keys + c->att_rows_per_thread / 2;                    /* and value rows */
        kv_txn_head_rows(txn, c->layer, g, (uint32_t)n_pos, keys, rows);
        keys += lo;
        rows += lo;
        n_pos -= lo;
        kv_attn_scores(kv_type, q, group, hd, keys, n_pos, scale, scores, (size_t)n_pos);
        float *out = c->att + (size_t)t * (size_t)q_dim + (size_t)g * (size_t)group * (size_t)hd;
        for (int h = 0; h < group; h++) vec_softmax(scores + (size_t)h * (size_t)n_pos, n_pos);
        kv_attn_wsum(kv_type, scores, (size_t)n_pos, group, n_pos, rows, hd, out);
        if (rot_v) kv_attn_rotate(out, group * hd, rot_v); /* back from the values' rotation */
    }
}

static void run_tokens(fwd_run_ctx *c, ops_range_fn fn) {
    ops_parallel_for(c->pool, c->n_tok, c->n_tok < 4 ? 4 : 1, fn, c);
}

/* Drops rows of items whose transaction was cancelled; returns rows left. */
static int drop_cancelled(fwd_run_ctx *c, int n_items) {
    bool any = false;
    for (int i = 0; i < n_items; i++)
        if (c->items[i].status == KVS_OK && kv_txn_cancelled(c->items[i].txn)) {
            c->items[i].status = KVS_ERR_CANCELLED;
            any = true;
        }
    if (!any) return c->n_tok;
    size_t d = c->m->hp.n_embd;
    int w = 0;
    for (int t = 0; t < c->n_tok; t++) {
        if (c->items[c->tok_item[t]].status != KVS_OK) continue;
        if (w != t) {
            memmove(c->x + (size_t)w * d, c->x + (size_t)t * d, d * sizeof(float));
            memmove(c->rope_cs + (size_t)w * c->m->hp.n_rot, c->rope_cs + (size_t)t * c->m->hp.n_rot,
                    c->m->hp.n_rot * sizeof(float));
            if (c->rope_cs_swa)
                memmove(c->rope_cs_swa + (size_t)w * c->m->hp.n_rot, c->rope_cs_swa + (size_t)t * c->m->hp.n_rot,
                        c->m->hp.n_rot * sizeof(float));
            c->tok_item[w] = c->tok_item[t];
            c->tok_pos[w] = c->tok_pos[t];
        }
        w++;
    }
    c->n_tok = w;
    return w;
}

/* Asks for n floats at p in cache ahead of their use: a norm's weights are
 * read once per token and layer, so by then the ~26 MB of a layer's matrices
 * have pushed them out, and the norm would wait on its weights from DRAM;
 * asking for them before the matmul that precedes it hides that wait. */
static void prefetch_floats(const float *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 64 / (int64_t)sizeof(float)) __builtin_prefetch(p + i, 0, 3);
}

/* Row t's rotations: cos and sin of each angle, both x rope_attn_factor
 * (LongRoPE's magnitude scaling, which ggml applies to cos and sin alike). */
static void token_rope(fwd_run_ctx *c, size_t t) {
    const model_hparams *hp = &c->m->hp;
    float *cs = c->rope_cs + t * hp->n_rot;
    ops_rope_cs(cs, (int)hp->n_rot, c->tok_pos[t], c->m->rope_inv_freq);
    if (hp->rope_attn_factor != 1.0f)
        for (uint32_t i = 0; i < hp->n_rot; i++) cs[i] *= hp->rope_attn_factor;
    if (c->rope_cs_swa)
        ops_rope_cs(c->rope_cs_swa + t * hp->n_rot, (int)hp->n_rot, c->tok_pos[t], c->m->rope_inv_freq_swa);
}

static void layer_forward(fwd_run_ctx *c, int l) {
    const model_hparams *hp = &c->m->hp;
    const model_layer *L = &c->m->layers[l];
    int64_t d = hp->n_embd, q_dim = (int64_t)hp->n_head * hp->head_dim, kv_dim = (int64_t)hp->n_head_kv * hp->head_dim;
    int T = c->n_tok;
    c->layer = l;
    run_tokens(c, norm_task);
    const ops_weight *qkv[3] = {&L->wq, &L->wk, &L->wv};
    float *qkv_out[3] = {c->q, c->k, c->v};
    const int64_t qkv_stride[3] = {q_dim, kv_dim, kv_dim};
    ops_matmul_group(c->pool, 3, qkv, c->xb, T, qkv_out, qkv_stride, c->act);
    run_tokens(c, rope_store_task);
    /* One token: each thread takes a run of adjacent kv heads, whose KV runs lie side by side
     * in a block, so what the hardware prefetcher brings in past one head's values is the next
     * head's keys, for the same core; this matters at long contexts, where attention reads
     * the KV from DRAM. More tokens: a (token, head) task at a time. */
    const int nth = ops_pool_threads(c->pool);
    const int64_t heads_each = T == 1 ? ((int64_t)hp->n_head_kv + nth - 1) / nth : 1;
    ops_parallel_for(c->pool, (int64_t)T * hp->n_head_kv, heads_each, attention_task, c);
    prefetch_floats(L->ffn_norm, d);
    ops_matmul(c->pool, &L->wo, c->att, T, c->xb, d, c->act);
    if (L->bo)
        for (int t = 0; t < T; t++) add_bias(c->xb + (size_t)t * (size_t)d, L->bo, (int)d);
    if (L->post_attn_norm)
        for (int t = 0; t < T; t++) ops_rmsnorm(c->xb + (size_t)t * d, L->post_attn_norm, c->xb + (size_t)t * d, d, hp->rms_eps);
    for (size_t i = 0; i < (size_t)T * (size_t)d; i++) c->x[i] += c->xb[i];
    run_tokens(c, ffn_norm_task);
    const ops_weight *gu[2] = {&L->w_gate, &L->w_up};
    float *gu_out[2] = {c->gate, c->up};
    const int64_t gu_stride[2] = {hp->n_ff, hp->n_ff};
    ops_matmul_group(c->pool, 2, gu, c->xb, T, gu_out, gu_stride, c->act);
    run_tokens(c, swiglu_task);
    if (l + 1 < (int)(c->m->last - c->m->first)) prefetch_floats(c->m->layers[l + 1].attn_norm, d);
    ops_matmul(c->pool, &L->w_down, c->gate, T, c->xb, d, c->act);
    if (L->post_ffn_norm)
        for (int t = 0; t < T; t++) ops_rmsnorm(c->xb + (size_t)t * d, L->post_ffn_norm, c->xb + (size_t)t * d, d, hp->rms_eps);
    for (size_t i = 0; i < (size_t)T * (size_t)d; i++) c->x[i] += c->xb[i];
}

int fwd_run(const model *m, ops_pool *pool, const kv_state *kv, fwd_item *items, int n_items) {
    const model_hparams *hp = &m->hp;
    int n_tok = 0;
    uint32_t max_pos = 0;
    for (int i = 0; i < n_items; i++) {
        fwd_item *it = &items[i];
        it->status = KVS_OK;
        if (it->n == 0) {
            it->pos0 = kv_txn_start(it->txn);
            it->n = kv_txn_end(it->txn) - it->pos0;
        }
        if (it->pos0 < kv_txn_start(it->txn) || it->pos0 > kv_txn_end(it->txn) ||
            it->n > kv_txn_end(it->txn) - it->pos0)
            return KVS_ERR_INVALID_ARG;
        uint32_t n = it->n;
        if (it->out_mode != FWD_OUT_HIDDEN && !m->has_head) return KVS_ERR_INVALID_ARG;
        if (!it->out || (m->has_embd ? !it->tokens : !it->hidden)) return KVS_ERR_INVALID_ARG;
        if (m->has_embd)
            for (uint32_t j = 0; j < n; j++)
                if (it->tokens[j] < 0 || (uint32_t)it->tokens[j] >= hp->n_vocab) return KVS_ERR_INVALID_ARG;
        if (n > (uint32_t)(INT32_MAX / 2) || n_tok > INT32_MAX / 2) return KVS_ERR_INVALID_ARG;
        n_tok += (int)n;
        if (it->pos0 + n > max_pos) max_pos = it->pos0 + n;
    }
    if (n_tok == 0) return KVS_OK;

    fwd_run_ctx c = {.m = m, .pool = pool, .kv = kv, .items = items, .n_tok = n_tok};
    size_t T = (size_t)n_tok, d = hp->n_embd, q_dim = (size_t)hp->n_head * hp->head_dim;
    size_t kv_dim = (size_t)hp->n_head_kv * hp->head_dim, ff = hp->n_ff;
    int nth = ops_pool_threads(pool);
    size_t group = hp->n_head / hp->n_head_kv;
    c.att_scratch_per_thread = group * (size_t)max_pos + hp->head_dim + 16;
    bool ok = true;
    c.tok_item = xmalloc_checked(T, sizeof(int), &ok);
    c.tok_pos = xmalloc_checked(T, sizeof(int32_t), &ok);
    c.x = xmalloc_checked(T, d * sizeof(float), &ok);
    c.xb = xmalloc_checked(T, d * sizeof(float), &ok);
    c.q = xmalloc_checked(T, q_dim * sizeof(float), &ok);
    c.k = xmalloc_checked(T, kv_dim * sizeof(float), &ok);
    c.v = xmalloc_checked(T, kv_dim * sizeof(float), &ok);
    c.att = xmalloc_checked(T, q_dim * sizeof(float), &ok);
    c.gate = xmalloc_checked(T, ff * sizeof(float), &ok);
    c.up = xmalloc_checked(T, ff * sizeof(float), &ok);
    c.rope_cs = xmalloc_checked(T, (size_t)hp->n_rot * sizeof(float), &ok);
    if (m->rope_inv_freq_swa) c.rope_cs_swa = xmalloc_checked(T, (size_t)hp->n_rot * sizeof(float), &ok);
    c.act = xmalloc_checked(T, m->act_row_bytes, &ok);
    c.att_scratch = xmalloc_checked((size_t)nth, c.att_scratch_per_thread * sizeof(float), &ok);
    c.att_rows_per_thread = 2 * (size_t)max_pos;
    c.att_rows = xmalloc_checked((size_t)nth, c.att_rows_per_thread * sizeof(void *), &ok);
    int err = KVS_OK;
    if (!ok) {
        err = KVS_ERR_NOMEM;
        goto out;
    }

    /* Inputs. */
    size_t t = 0;
    for (int i = 0; i < n_items; i++) {
        uint32_t s = items[i].pos0, n = items[i].n;
        for (uint32_t j = 0; j < n; j++, t++) {
            c.tok_item[t] = i;
            c.tok_pos[t] = (int32_t)(s + j);
            token_rope(&c, t);
            if (m->has_embd) model_embed(m, items[i].tokens[j], c.x + t * d);
            else memcpy(c.x + t * d, items[i].hidden + (size_t)j * d, d * sizeof(float));
            if (m->has_embd && hp->arch->embd_scale)
                for (size_t e = 0; e < d; e++) c.x[t * d + e] *= sqrtf((float)d);
        }
    }

    for (uint32_t l = 0; l < m->last - m->first; l++) {
        if (drop_cancelled(&c, n_items) == 0) goto out;
        layer_forward(&c, (int)l);
    }
    if (drop_cancelled(&c, n_items) == 0) goto out;

    /* Outputs, item by item (rows of an item are contiguous). */
    for (t = 0; t < (size_t)c.n_tok;) {
        int i = c.tok_item[t];
        size_t n = 0;
        while (t + n < (size_t)c.n_tok && c.tok_item[t + n] == i) n++;
        fwd_item *it = &items[i];
        if (it->out_mode == FWD_OUT_HIDDEN) {
            memcpy(it->out, c.x + t * d, n * d * sizeof(float));
        } else {
            size_t first = it->out_mode == FWD_OUT_LOGITS_LAST ? t + n - 1 : t;
            size_t rows = t + n - first;
            for (size_t r = 0; r < rows; r++)
                ops_rmsnorm(c.x + (first + r) * d, m->out_norm, c.xb + r * d, (int64_t)d, hp->rms_eps);
            ops_matmul(pool, &m->output, c.xb, (int)rows, it->out, hp->n_vocab, c.act);
        }
        t += n;
    }
out:
    free(c.tok_item); free(c.tok_pos); free(c.x); free(c.xb); free(c.q); free(c.k); free(c.v);
    free(c.att); free(c.gate); free(c.up); free(c.rope_cs); free(c.rope_cs_swa); free(c.act); free(c.att_scratch); free(c.att_rows);
    return err;
}
