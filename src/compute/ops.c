#include "ops.h"

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "quant.h"
#include "util.h"

/* ------------------------------------------------------------------------ */
/* Thread pool.
 * Workers wait for `generation` to change: they spin a short while (a layer's
 * matmuls come back to back during decode, and a futex round trip per matmul
 * would cost more than the matmul), then sleep on a condition variable.
 * A worker joins a call by incrementing the count in `join` (which also holds
 * the call's generation and a closed bit); the caller closes the call once it
 * has run out of chunks and waits only for the workers that joined. */

#define OPS_SPIN_ITERS 4000
#define JOIN_CLOSED (1ull << 31)
#define JOIN_COUNT_MASK 0x7fffffffull

struct ops_pool {
    int n_threads;
    pthread_t *threads;          /* n_threads - 1 workers */
    pthread_mutex_t run_lock;    /* serializes callers */
    pthread_mutex_t wake_lock;   /* guards sleeping on wake_cv */
    pthread_cond_t wake_cv;
    atomic_uint generation;      /* bumped once per call */
    _Atomic uint64_t join;       /* generation << 32 | closed | joined workers */
    atomic_int n_done;           /* joined workers that finished */
    atomic_bool stop;
    /* The current call; written before generation/join are published. */
    ops_range_fn fn;
    void *arg;
    int64_t n, grain;
    int64_t guided_div;          /* 0: fixed chunks of grain; else chunks of remaining / guided_div */
    _Atomic int64_t next;
};

typedef struct {
    ops_pool *pool;
} ops_worker_arg;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* The next chunk [*i0, *i1); false when none is left. Guided: a chunk is a
 * share of what is left (rounded up to whole grains), so the first chunks are
 * long runs and the last ones a grain each, and no thread is left with a long
 * chunk when the others have run dry. */
static bool take_chunk(ops_pool *pool, int64_t *i0, int64_t *i1) {
    const int64_t n = pool->n, grain = pool->grain;
    if (!pool->guided_div) {
        *i0 = atomic_fetch_add_explicit(&pool->next, grain, memory_order_relaxed);
        if (*i0 >= n) return false;
        *i1 = *i0 + grain < n ? *i0 + grain : n;
        return true;
    }
    int64_t cur = atomic_load_explicit(&pool->next, memory_order_relaxed);
    for (;;) {
        if (cur >= n) return false;
        int64_t c = (n - cur) / pool->guided_div;
        c = c < grain ? grain : (c + grain - 1) / grain * grain;
        if (c > n - cur) c = n - cur;
        if (atomic_compare_exchange_weak_explicit(&pool->next, &cur, cur + c, memory_order_relaxed,
                                                  memory_order_relaxed)) {
            *i0 = cur;
            *i1 = cur + c;
            return true;
        }
    }
}

static void run_chunks(ops_pool *pool, int slot) {
    int64_t i0, i1;
    while (take_chunk(pool, &i0, &i1)) pool->fn(pool->arg, i0, i1, slot);
}

static void *ops_worker_main(void *p) {
    ops_pool *pool = ((ops_worker_arg *)p)->pool;
    free(p);
    unsigned seen = 0;
    for (;;) {
        unsigned gen;
        int spins = 0;
        while ((gen = atomic_load_explicit(&pool->generation, memory_order_acquire)) == seen) {
            if (++spins < OPS_SPIN_ITERS) {
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&pool->wake_lock);
            while ((gen = atomic_load_explicit(&pool->generation, memory_order_acquire)) == seen)
                pthread_cond_wait(&pool->wake_cv, &pool->wake_lock);
            pthread_mutex_unlock(&pool->wake_lock);
            break;
        }
        seen = gen;
        if (atomic_load_explicit(&pool->stop, memory_order_acquire)) return NULL;
        uint64_t s = atomic_load_explicit(&pool->join, memory_order_acquire);
        bool joined = false;
        while ((uint32_t)(s >> 32) == gen && !(s & JOIN_CLOSED)) {
            if (atomic_compare_exchange_weak_explicit(&pool->join, &s, s + 1, memory_order_acq_rel,
                                                      memory_order_acquire)) {
                joined = true;
                break;
            }
        }
        if (!joined) continue; /* too late for this call */
        run_chunks(pool, (int)(s & JOIN_COUNT_MASK) + 1);
        atomic_fetch_add_explicit(&pool->n_done, 1, memory_order_acq_rel);
    }
}

ops_pool *ops_pool_create(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    if (n_threads > 1024) n_threads = 1024;
    ops_pool *pool = calloc(1, sizeof(*pool));
    if (!pool) return NULL;
    pool->n_threads = 1;
    pthread_mutex_init(&pool->run_lock, NULL);
    pthread_mutex_init(&pool->wake_lock, NULL);
    pthread_cond_init(&pool->wake_cv, NULL);
    atomic_init(&pool->generation, 0);
    atomic_init(&pool->join, JOIN_CLOSED);
    atomic_init(&pool->n_done, 0);
    atomic_init(&pool->stop, false);
    atomic_init(&pool->next, 0);
    if (n_threads > 1) {
        pool->threads = calloc((size_t)n_threads - 1, sizeof(pthread_t));
        if (!pool->threads) goto fail;
        for (int i = 1; i < n_threads; i++) {
            ops_worker_arg *wa = malloc(sizeof(*wa));
            if (!wa) goto fail;
            wa->pool = pool;
            if (pthread_create(&pool->threads[i - 1], NULL, ops_worker_main, wa) != 0) {
                free(wa);
                goto fail;
            }
            pool->n_threads = i + 1;
        }
    }
    return pool;
fail:
    ops_pool_free(pool);
    return NULL;
}

void ops_pool_free(ops_pool *pool) {
    if (!pool) return;
    atomic_store_explicit(&pool->stop, true, memory_order_release);
    pthread_mutex_lock(&pool->wake_lock);
    atomic_fetch_add_explicit(&pool->generation, 1, memory_order_acq_rel);
    pthread_cond_broadcast(&pool->wake_cv);
    pthread_mutex_unlock(&pool->wake_lock);
    for (int i = 1; i < pool->n_threads; i++) pthread_join(pool->threads[i - 1], NULL);
    pthread_mutex_destroy(&pool->run_lock);
    pthread_mutex_destroy(&pool->wake_lock);
    pthread_cond_destroy(&pool->wake_cv);
    free(pool->threads);
    free(pool);
}

int ops_pool_threads(const ops_pool *pool) { return pool ? pool->n_threads : 1; }

/* share 0: fixed chunks of grain; else guided, chunks of remaining / (share x threads). */
static void parallel_run(ops_pool *pool, int64_t n, int64_t grain, int share, ops_range_fn fn, void *arg) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    if (!pool || pool->n_threads == 1 || n <= grain) {
        if (share) grain = n; /* one thread: one run, however long */
        for (int64_t i0 = 0; i0 < n; i0 += grain) fn(arg, i0, i0 + grain < n ? i0 + grain : n, 0);
        return;
    }
    pthread_mutex_lock(&pool->run_lock);
    pool->fn = fn;
    pool->arg = arg;
    pool->n = n;
    pool->grain = grain;
    pool->guided_div = (int64_t)share * pool->n_threads;
    atomic_store_explicit(&pool->next, 0, memory_order_relaxed);
    atomic_store_explicit(&pool->n_done, 0, memory_order_relaxed);
    unsigned gen = atomic_load_explicit(&pool->generation, memory_order_relaxed) + 1;
    atomic_store_explicit(&pool->join, (uint64_t)gen << 32, memory_order_release);
    pthread_mutex_lock(&pool->wake_lock);
    atomic_store_explicit(&pool->generation, gen, memory_order_release);
    pthread_cond_broadcast(&pool->wake_cv);
    pthread_mutex_unlock(&pool->wake_lock);
    run_chunks(pool, 0);
    uint64_t s = atomic_fetch_or_explicit(&pool->join, JOIN_CLOSED, memory_order_acq_rel);
    int joined = (int)(s & JOIN_COUNT_MASK);
    int spins = 0;
    while (atomic_load_explicit(&pool->n_done, memory_order_acquire) < joined) {
        if (++spins < OPS_SPIN_ITERS) cpu_relax();
        else sched_yield();
    }
    pthread_mutex_unlock(&pool->run_lock);
}

void ops_parallel_for(ops_pool *pool, int64_t n, int64_t grain, ops_range_fn fn, void *arg) {
    parallel_run(pool, n, grain, 0, fn, arg);
}

void ops_parallel_for_guided(ops_pool *pool, int64_t n, int64_t grain, int share, ops_range_fn fn, void *arg) {
    parallel_run(pool, n, grain, share < 1 ? 1 : share, fn, arg);
}

/* ------------------------------------------------------------------------ */
/* Matmul. Rows are handed out in chunks by ops_parallel_for_guided; within a
 * chunk, tokens are taken in tiles so a tile of activations stays in cache
 * while the chunk's weight rows stream past it. Each (row, token) is one
 * quant_dot reduction whatever the tiling: batch invariant. */

#define MM_ROW_CHUNK 16
#define MM_TOK_TILE 32

#define MM_MAX_GROUP 4

typedef struct {
    int n_w;                          /* weights sharing the input (same type and n_in) */
    const ops_weight *w[MM_MAX_GROUP];
    float *y[MM_MAX_GROUP];
    int64_t y_stride[MM_MAX_GROUP];
    int64_t row0[MM_MAX_GROUP + 1];   /* first virtual row of each weight; row0[n_w] = total */
    const float *x;
    int n_tok;
    uint8_t *act;
    size_t act_bytes; /* per token */
    bool tiled;       /* act rows in the tile layout, dots by quant_dot_tile */
} mm_task;

static void mm_quantize_task(void *p, int64_t i0, int64_t i1, int slot) {
    (void)slot;
    mm_task *t = p;
    const ops_weight *w = t->w[0];
    for (int64_t i = i0; i < i1; i++) {
        uint8_t *act = t->act + (size_t)i * t->act_bytes;
        quant_act_quantize(w->type, t->x + (size_t)i * (size_t)w->n_in, act, w->n_in);
        if (t->tiled) quant_act_tile_layout(w->type, act, w->n_in);
    }
}

/* Rows [r0, r1) of one weight into y. */
static void mm_dot_rows(const mm_task *t, const ops_weight *w, float *y, int64_t y_stride, int64_t r0, int64_t r1) {
    if (w->layout == OPS_R8) { /* r0 and r1 are multiples of 8 (mm_run) */
        for (int t0 = 0; t0 < t->n_tok; t0 += MM_TOK_TILE) {
            int nt = t->n_tok - t0 < MM_TOK_TILE ? t->n_tok - t0 : MM_TOK_TILE;
            quant_dot_r8(w->type, w->n_in, (const uint8_t *)w->data + (size_t)r0 * w->row_bytes, (int)((r1 - r0) / 8),
                         t->act + (size_t)t0 * t->act_bytes, t->act_bytes, nt,
                         y + (size_t)t0 * (size_t)y_stride + (size_t)r0, (size_t)y_stride);
        }
        return;
    }
    if (t->tiled) {
        for (int t0 = 0; t0 < t->n_tok; t0 += MM_TOK_TILE) {
            int nt = t->n_tok - t0 < MM_TOK_TILE ? t->n_tok - t0 : MM_TOK_TILE;
            quant_dot_tile(w->type, w->n_in, (const uint8_t *)w->data + (size_t)r0 * w->row_bytes, w->row_bytes,
                           (int)(r1 - r0), t->act + (size_t)t0 * t->act_bytes, t->act_bytes, nt,
                           y + (size_t)t0 * (size_t)y_stride + (size_t)r0, (size_t)y_stride);
        }
        return;
    }
    float tmp[MM_TOK_TILE];
    for (int t0 = 0; t0 < t->n_tok; t0 += MM_TOK_TILE) {
        int nt = t->n_tok - t0 < MM_TOK_TILE ? t->n_tok - t0 : MM_TOK_TILE;
        const uint8_t *act = t->act + (size_t)t0 * t->act_bytes;
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *row = (const uint8_t *)w->data + (size_t)r * w->row_bytes;
            quant_dot_multi(w->type, w->n_in, row, act, t->act_bytes, nt, tmp);
            for (int j = 0; j < nt; j++) y[(size_t)(t0 + j) * (size_t)y_stride + (size_t)r] = tmp[j];
        }
    }
}

/* Virtual rows [v0, v1) of the group: the part that falls in each weight. */
static void mm_dot_task(void *p, int64_t v0, int64_t v1, int slot) {
    (void)slot;
    mm_task *t = p;
    for (int i = 0; i < t->n_w; i++) {
        int64_t a = v0 > t->row0[i] ? v0 : t->row0[i], b = v1 < t->row0[i + 1] ? v1 : t->row0[i + 1];
        if (a < b) mm_dot_rows(t, t->w[i], t->y[i], t->y_stride[i], a - t->row0[i], b - t->row0[i]);
    }
}

size_t ops_matmul_scratch_bytes(const ops_weight *w, int n_tok) {
    return (size_t)n_tok * quant_act_row_bytes(w->type, w->n_in);
}

static void mm_run(ops_pool *pool, mm_task *t) {
    const ops_weight *w = t->w[0];
    t->act_bytes = quant_act_row_bytes(w->type, w->n_in);
    /* The tile kernel from the batch size where it beats the multi kernel
     * (quant_tile_min_tokens: 5 for most, since the multi kernel streams each
     * weight row once for up to 4 sessions, which is faster than the 4x4 tile
     * kernel at those sizes; 1 for AVX2 q4_0, whose pair-layout tile kernel is
     * the cheaper one even for a single token). Both give bit-identical
     * results. */
    const int tile_min = quant_tile_min_tokens(w->type);
    t->tiled = w->layout == OPS_ROWS && tile_min > 0 && t->n_tok >= tile_min;
    ops_parallel_for(pool, t->n_tok, t->n_tok < 4 ? 4 : 1, mm_quantize_task, t);
    /* Guided chunks: long contiguous row ranges first (the hardware
     * prefetchers stream a long run far better than many 16-row pieces),
     * then shorter ones, so the threads run dry together instead of one waiting out the other's
     * last long range. With one token tile a chunk's rows are read once,
     * whatever its length, and each chunk restarts the weight streams, so
     * the chunks are a share of 1 / threads of what is left (half as many
     * chunks); with more tokens a chunk's rows are read once per tile and
     * shorter chunks keep them in cache between tiles, so 1 / (2 threads). */
    const int share = t->n_tok <= MM_TOK_TILE ? 1 : 2;
    ops_parallel_for_guided(pool, t->row0[t->n_w], MM_ROW_CHUNK, share, mm_dot_task, t);
}

void ops_matmul(ops_pool *pool, const ops_weight *w, const float *x, int n_tok, float *y, int64_t y_stride,
                void *act_scratch) {
    mm_task t = {.n_w = 1, .w = {w}, .y = {y}, .y_stride = {y_stride}, .row0 = {0, w->n_out}, .x = x,
                 .n_tok = n_tok, .act = act_scratch};
    mm_run(pool, &t);
}

void ops_matmul_group(ops_pool *pool, int n_w, const ops_weight *const *ws, const float *x, int n_tok,
                      float *const *ys, const int64_t *y_strides, void *act_scratch) {
    bool same = n_w >= 1 && n_w <= MM_MAX_GROUP;
    for (int i = 1; same && i < n_w; i++)
        same = ws[i]->type == ws[0]->type && ws[i]->n_in == ws[0]->n_in && ws[i]->layout == ws[0]->layout;
    if (!same) {
        for (int i = 0; i < n_w; i++) ops_matmul(pool, ws[i], x, n_tok, ys[i], y_strides[i], act_scratch);
        return;
    }
    mm_task t = {.n_w = n_w, .x = x, .n_tok = n_tok, .act = act_scratch};
    for (int i = 0; i < n_w; i++) {
        t.w[i] = ws[i];
        t.y[i] = ys[i];
        t.y_stride[i] = y_strides[i];
        t.row0[i + 1] = t.row0[i] + ws[i]->n_out;
    }
    mm_run(pool, &t);
}

/* ------------------------------------------------------------------------ */

void ops_rmsnorm(const float *x, const float *weight, float *out, int64_t n, float eps) {
    /* The squares (exact in double) summed in eight chains, element i in chain
     * i mod 8, then the chains in a fixed tree, not in one chain of n dependent
     * adds, whose latency would bound the norm. */
    double acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) acc[k] += (double)x[i + k] * (double)x[i + k];
    double sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) sum += (double)x[i] * (double)x[i];
    float scale = 1.0f / sqrtf((float)(sum / (double)n) + eps);
    for (i = 0; i < n; i++) out[i] = x[i] * scale * weight[i];
}

void ops_rope_freqs(float *inv_freq, int n_rot, float base, float freq_scale, const float *factors) {
    for (int i = 0; i < n_rot / 2; i++) {
        double f = pow((double)base, -2.0 * i / (double)n_rot);
        if (freq_scale != 1.0f) f *= (double)freq_scale;
        if (factors) f /= (double)factors[i];
        inv_freq[i] = (float)f;
    }
}

void ops_rope_cs(float *cs, int n_rot, int32_t pos, const float *inv_freq) {
    for (int i = 0; i < n_rot / 2; i++) {
        const double theta = (double)pos * (double)inv_freq[i];
        cs[2 * i] = (float)cos(theta);
        cs[2 * i + 1] = (float)sin(theta);
    }
}

void ops_rope(float *x, int n_heads, int head_dim, int n_rot, const float *cs) {
    for (int i = 0; i < n_rot / 2; i++) {
        const float c = cs[2 * i], s = cs[2 * i + 1];
        for (int h = 0; h < n_heads; h++) {
            float *v = x + (size_t)h * (size_t)head_dim + 2 * (size_t)i;
            float x0 = v[0], x1 = v[1];
            v[0] = x0 * c - x1 * s;
            v[1] = x0 * s + x1 * c;
        }
    }
}

void ops_rope_neox(float *x, int n_heads, int head_dim, int n_rot, const float *cs) {
    int half = n_rot / 2;
    for (int i = 0; i < half; i++) {
        const float c = cs[2 * i], s = cs[2 * i + 1];
        for (int h = 0; h < n_heads; h++) {
            float *v = x + (size_t)h * (size_t)head_dim + (size_t)i;
            float x0 = v[0], x1 = v[half];
            v[0] = x0 * c - x1 * s;
            v[half] = x0 * s + x1 * c;
        }
    }
}
