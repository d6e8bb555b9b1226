/*
 * ops — the numeric building blocks of a transformer layer over a persistent
 * thread pool: matmul against block-format weights, rmsnorm, rope, softmax,
 * SwiGLU. Knows nothing about GGUF or sessions.
 *
 * Batch invariance: every output element is reduced in one fixed order that
 * does not depend on how many rows/tokens are in the call or how the work is
 * split across threads, so a token's result is the same alone or batched.
 */
#ifndef KVS_OPS_H
#define KVS_OPS_H

#include <stddef.h>
#include <stdint.h>

/* ---- thread pool ---- */
typedef struct ops_pool ops_pool;

/* Range body: handles items [i0, i1); slot in [0, ops_pool_threads) is unique
 * among the threads of one call (index per-thread scratch with it). */
typedef void (*ops_range_fn)(void *arg, int64_t i0, int64_t i1, int slot);

/* Starts n_threads - 1 workers (the caller is thread 0). NULL on failure. */
ops_pool *ops_pool_create(int n_threads);
/* Stops and joins the workers; NULL is fine. */
void ops_pool_free(ops_pool *pool);
int ops_pool_threads(const ops_pool *pool);
/* Runs fn over [0, n) in chunks of `grain` items, handed out dynamically to the
 * caller and to whichever workers join in time, and returns when every chunk
 * is done. A worker that is descheduled when the call starts simply does not
 * join: the call never waits for a thread that has no work in hand. Calls
 * from different threads are serialized. */
void ops_parallel_for(ops_pool *pool, int64_t n, int64_t grain, ops_range_fn fn, void *arg);
/* The same, with guided chunks: each a share of the items left (1 / (share x
 * threads), share >= 1, rounded up to whole grains, at least one grain), so
 * long runs first and single grains at the end. Every chunk but the last is a
 * multiple of grain, and starts at one. With one thread: fn once over [0, n). */
void ops_parallel_for_guided(ops_pool *pool, int64_t n, int64_t grain, int share, ops_range_fn fn, void *arg);

/* ---- weights ---- */
typedef struct {
    uint32_t type;     /* enum quant_type */
    int64_t n_in;      /* row length (elements), GGUF ne[0] */
    int64_t n_out;     /* rows, GGUF ne[1] */
    size_t row_bytes;  /* bytes per row */
    const void *data;  /* n_out rows, row_bytes each (OPS_ROWS), or n_out / 8 r8 groups of
                          8 x row_bytes each (OPS_R8, quant.h) */
    int layout;        /* OPS_ROWS, or OPS_R8 (n_out a multiple of 8, quant_r8_supported(type)) */
} ops_weight;

enum { OPS_ROWS = 0, OPS_R8 = 1 };

/* y[t][r] = dot(w row r, x[t]) for t < n_tok, r < n_out. x: n_tok x n_in f32
 * (row stride n_in); y: n_tok x n_out (row stride y_stride >= n_out).
 * act_scratch must hold n_tok * quant_act_row_bytes(w->type, n_in) bytes. */
void ops_matmul(ops_pool *pool, const ops_weight *w, const float *x, int n_tok,
                float *y, int64_t y_stride, void *act_scratch);
size_t ops_matmul_scratch_bytes(const ops_weight *w, int n_tok);
/* ys[i] = ws[i] x for up to 4 weights that read the same input (Q/K/V, gate/up):
 * x is quantized once and the pool makes one pass over all their rows (fewer
 * synchronizations per layer). Weights of different types or row lengths fall
 * back to one ops_matmul each. Results are identical to separate calls. */
void ops_matmul_group(ops_pool *pool, int n_w, const ops_weight *const *ws, const float *x, int n_tok,
                      float *const *ys, const int64_t *y_strides, void *act_scratch);

/* ---- elementwise (single-threaded; callers parallelize over rows) ---- */
void ops_rmsnorm(const float *x, const float *weight, float *out, int64_t n, float eps);
/* The rotation of position pos: cs[2i] = cos(pos * inv_freq[i]) and
 * cs[2i + 1] = sin(...), angle in double, i < n_rot/2. The same for every
 * layer and head, so a forward computes it once per token. */
void ops_rope_cs(float *cs, int n_rot, int32_t pos, const float *inv_freq);
/* Rotates adjacent pairs (x[2i], x[2i+1]) of each of n_heads heads (head_dim
 * each) by the angles of cs (ops_rope_cs), for i < n_rot/2 (GGUF "llama" /
 * ggml normal rope). */
void ops_rope(float *x, int n_heads, int head_dim, int n_rot, const float *cs);
/* Same rotation for the two halves of the rotated dimensions: pairs
 * (x[i], x[i + n_rot/2]) (GGUF "qwen2" / ggml neox rope). */
void ops_rope_neox(float *x, int n_heads, int head_dim, int n_rot, const float *cs);
/* inv_freq[i] = base^(-2i/n_rot) x freq_scale / factors[i], i < n_rot/2, in
 * double before the one rounding to float. freq_scale: linear rope scaling (1:
 * none); factors: rope_freqs.weight divisors (Llama 3.1+), or NULL for none. */
void ops_rope_freqs(float *inv_freq, int n_rot, float base, float freq_scale, const float *factors);

#endif /* KVS_OPS_H */
