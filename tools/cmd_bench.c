/* kvshard bench: prefill / decode speed, memory bandwidth and the decode roofline. */
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "args.h"
#include "cli.h"
#include "cpu.h"
#include "digest.h"
#include "engine.h"
#include "quant.h"
#include "util.h"
#include "vecops.h"

#include "kvs_commit.h" /* KVS_COMMIT, written at build time (cmake/commit.cmake) */

static void bench_usage(FILE *f) {
    fprintf(f, "usage: kvshard bench -m MODEL [-t THREADS] [-p PROMPT_TOKENS] [-n DECODE_TOKENS] [--sessions N]\n"
               "                     [--layers FIRST:LAST] [--no-repack] [--depth D] [--isa NAME]\n"
               "                     [--pairs1 auto|on|off|quad|spread] [--paired K] [--kv-type f16|q8_0|q4_0|f32]\n"
               "  --layers          bench one shard's range (hidden-state input/output where it lacks\n"
               "                    the embeddings/head); reports its resident memory (rss_bytes)\n"
               "  --no-repack       keep the weights in the file's row layout (no r8 repacking)\n"
               "  --isa NAME        run the kernels of scalar, avx2 or avx512 (default: the best this\n"
               "                    CPU has; one it lacks is an error), for an A/B on one machine\n"
               "  --pairs1 MODE     how one-token r8 kernels (AVX-512 VNNI) take row groups: off (one\n"
               "                    at a time), on (two: q4_0, q8_0), quad (four neighbours), spread\n"
               "                    (four far apart; the default, also named auto); the kernels field\n"
               "                    says +pairs1, +quads1 or +spread1\n"
               "  --depth D         also decode a second session after a D-token prompt, alternating\n"
               "                    with the first step by step (both under the same machine state):\n"
               "                    adds decode_depth_tok_s and depth_slowdown (one session)\n"
               "  --paired K        then K more decode steps, each followed by one bandwidth-probe pass\n"
               "                    at mem_bw_streams: adds decode_roofline_paired (the median over the\n"
               "                    K pairs of the step's roofline against its own pass's bandwidth,\n"
               "                    so a slow spell of the machine falls on both), paired_step_ms and\n"
               "                    paired_bw_gbs (medians); decode_roofline stays as it is\n"
               "  prints one JSON object: prefill_tok_s, decode_tok_s, mem_bw_gbs, weight_bytes_per_token,\n"
               "  decode_roofline, load_s (engine open: threads, map + repack, KV pool), model_sha256, threads,\n"
               "  cpu, isa, kernels\n"
               "  (the kernel path per weight type), commit, ... (defaults -p 128 -n 32 --sessions 1)\n"
               "  (mem_bw_gbs: the best of five reads of a 512 MiB buffer by every thread at each of 1, 2,\n"
               "  4 and 8 streams per 1 MiB chunk (mem_bw_streams: the count that read it), with the ISA's\n"
               "  widest loads and a prefetch ahead; decode_roofline: weight bytes per token / mem_bw_gbs /\n"
               "  decode step time)\n");
}

/* ---- memory read bandwidth: threads sum disjoint parts of a 512 MiB buffer
 * with vec_read_sum (the ISA's widest loads, prefetching ahead, 1-8 streams) ---- */
typedef struct {
    const uint8_t *buf;
    size_t bytes;
    int streams; /* per chunk, walked side by side (vec_read_sum) */
    atomic_ullong sink;
} bw_task;

#define BW_CHUNK ((size_t)1 << 20) /* bytes per chunk: 1 MiB */

static void bw_read(void *p, int64_t c0, int64_t c1, int slot) {
    (void)slot;
    bw_task *t = p;
    size_t lo = (size_t)c0 * BW_CHUNK, hi = (size_t)c1 * BW_CHUNK < t->bytes ? (size_t)c1 * BW_CHUNK : t->bytes;
    atomic_fetch_add(&t->sink, vec_read_sum(t->buf + lo, hi - lo, t->streams));
}

/* The probe's buffer: 512 MiB in 2 MiB pages where the kernel gives them, as
 * the repacked weights are, written once so every page is resident. */
typedef struct {
    uint8_t *buf;
    size_t bytes, mapped;
} bw_buffer;

static bool bw_open(bw_buffer *b) {
    b->bytes = 512u << 20;
    b->mapped = 0;
    b->buf = kvs_map_big(b->bytes, false, &b->mapped);
    if (!b->buf) return false;
    memset(b->buf, 1, b->bytes);
    return true;
}

static void bw_close(bw_buffer *b) {
    if (b->buf) kvs_unmap_big(b->buf, b->mapped);
    b->buf = NULL;
}

/* One read of the whole buffer by every thread, `streams` per chunk: GB/s. */
static double bw_pass(ops_pool *pool, const bw_buffer *b, int streams) {
    bw_task t = {.buf = b->buf, .bytes = b->bytes, .streams = streams};
    atomic_init(&t.sink, 0);
    uint64_t t0 = kvs_now_ns();
    ops_parallel_for(pool, (int64_t)((b->bytes + BW_CHUNK - 1) / BW_CHUNK), 4, bw_read, &t);
    return (double)b->bytes / ((double)(kvs_now_ns() - t0) / 1e9) / 1e9;
}

/* The best of five passes at each of 1, 2, 4 and 8 streams per chunk: a core
 * that reads one stream at a time leaves DRAM bandwidth unused on some
 * machines, and a decode kernel may walk several row groups at
 * once, so the roofline is the most any of them reads. *best_streams: the
 * stream count that read it. */
static double measure_bw_gbs(ops_pool *pool, const bw_buffer *b, int *best_streams) {
    double best = 0;
    *best_streams = 0;
    for (int streams = 1; streams <= 8; streams *= 2)
        for (int rep = 0; rep < 5; rep++) {
            const double gbs = bw_pass(pool, b, streams);
            if (gbs > best) {
                best = gbs;
                *best_streams = streams;
            }
        }
    return best;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The median of v[0..n) (sorts v); 0 when n is 0. */
static double median(double *v, long n) {
    if (n <= 0) return 0;
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* Resident set size of this process (VmRSS), bytes; 0 when unknown. */
static uint64_t rss_bytes(void) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return 0;
    char line[256];
    uint64_t kb = 0;
    while (fgets(line, sizeof(line), f))
        if (!strncmp(line, "VmRSS:", 6)) kb = strtoull(line + 6, NULL, 10);
    fclose(f);
    return kb * 1024;
}

static void cpu_name(char *out, size_t cap) {
    snprintf(out, cap, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof(line), f)) {
        if (!strncmp(line, "model name", 10)) {
            char *c = strchr(line, ':');
            if (c) {
                c += 2;
                c[strcspn(c, "\n")] = 0;
                snprintf(out, cap, "%s", c);
            }
            break;
        }
    }
    fclose(f);
}

/* Cost of session operations on a pool shaped like the engine's (no compute):
 * open = first append of a new session (1 position) + commit, release, and an
 * open that must first evict the LRU idle session. Microseconds per op. */
typedef struct {
    double open_us, release_us, open_evict_us;
} kv_op_costs;

static void measure_kv_ops(const kv_params *shape, kv_op_costs *out) {
    enum { N = 20000, CAP = 64 };
    kv_params p = *shape;
    p.ttl_ns = 0;
    p.max_sessions = 0;
    p.budget_bytes = 0;
    kv_state *probe = NULL;
    p.budget_bytes = 1ull << 40; /* sizing only */
    char msg[KVS_MSG_MAX];
    if (kv_create(&p, &probe, msg, sizeof(msg)) != KVS_OK) return;
    size_t bb = kv_block_bytes(probe);
    kv_free(probe);
    p.budget_bytes = (uint64_t)CAP * bb;
    kv_state *kv = NULL;
    if (kv_create(&p, &kv, msg, sizeof(msg)) != KVS_OK) return;
    kv_sid sid;
    memset(&sid, 0, sizeof(sid));
    kv_txn *t;
    kv_reply r;
    uint64_t t0 = kvs_now_ns();
    for (uint32_t i = 0; i < N; i++) {
        memcpy(sid.bytes, &i, sizeof(i));
        if (kv_begin(kv, &sid, 1, 0, 1, NULL, &t, &r) == KVS_OK) kv_commit(kv, t, &r);
        if (i % CAP == CAP - 1) /* keep the pool from filling: release the batch */
            for (uint32_t k = i + 1 - CAP; k <= i; k++) {
                memcpy(sid.bytes, &k, sizeof(k));
                kv_release(kv, &sid, 1, &r);
            }
    }
    uint64_t t1 = kvs_now_ns();
    /* Release alone: open CAP, time their releases. */
    uint64_t rel_ns = 0;
    for (uint32_t round = 0; round < N / CAP; round++) {
        for (uint32_t k = 0; k < CAP; k++) {
            memcpy(sid.bytes, &k, sizeof(k));
            if (kv_begin(kv, &sid, 1, 0, 1, NULL, &t, &r) == KVS_OK) kv_commit(kv, t, &r);
        }
        uint64_t a = kvs_now_ns();
        for (uint32_t k = 0; k < CAP; k++) {
            memcpy(sid.bytes, &k, sizeof(k));
            kv_release(kv, &sid, 1, &r);
        }
        rel_ns += kvs_now_ns() - a;
    }
    /* Full pool: every open evicts the LRU session. */
    for (uint32_t k = 0; k < CAP; k++) {
        memcpy(sid.bytes, &k, sizeof(k));
        if (kv_begin(kv, &sid, 1, 0, 1, NULL, &t, &r) == KVS_OK) kv_commit(kv, t, &r);
    }
    uint64_t e0 = kvs_now_ns();
    for (uint32_t i = CAP; i < CAP + N; i++) {
        memcpy(sid.bytes, &i, sizeof(i));
        if (kv_begin(kv, &sid, 1, 0, 1, NULL, &t, &r) == KVS_OK) kv_commit(kv, t, &r);
    }
    uint64_t e1 = kvs_now_ns();
    /* The first loop also released every session: subtract the release cost. */
    double rel_us = (double)rel_ns / 1e3 / (double)((N / CAP) * CAP);
    out->release_us = rel_us;
    out->open_us = (double)(t1 - t0) / 1e3 / N - rel_us;
    out->open_evict_us = (double)(e1 - e0) / 1e3 / N;
    kv_free(kv);
}

static void mark_used(const ops_weight *w, bool *used, bool *r8) {
    if (w->type >= QUANT_TYPE_LIMIT) return;
    used[w->type] = true;
    if (w->layout == OPS_R8) r8[w->type] = true;
}

/* "kernels":{"q4_0":"avx2+tile+r8",...}: the kernel path of each weight type the owned
 * matmuls use, in type-id order; "+r8" when some of its matrices are repacked,
 * "+pairs1" / "+quads1" when one token takes their row groups two / four at a time. */
static void kernel_paths(const model *m, char *out, size_t cap) {
    bool used[QUANT_TYPE_LIMIT] = {false}, r8[QUANT_TYPE_LIMIT] = {false};
    for (uint32_t l = 0; l < m->last - m->first; l++)
        for (int k = 0; k < MODEL_LAYER_MATRICES; k++) mark_used(model_layer_matrix(&m->layers[l], k), used, r8);
    if (m->has_head) mark_used(&m->output, used, r8);
    size_t len = (size_t)snprintf(out, cap, "{");
    for (int t = 0; t < QUANT_TYPE_LIMIT && len < cap; t++) {
        const char *path = used[t] ? quant_kernel_path((uint32_t)t) : NULL;
        if (path)
            len += (size_t)snprintf(out + len, cap - len, "%s\"%s\":\"%s%s\"", len > 1 ? "," : "",
                                    quant_get_traits((uint32_t)t)->name, path,
                                    !r8[t] ? "" : (const char *[]){"+r8", "+r8+pairs1", "+r8+quads1", "+r8+spread1"}[quant_r8_walk_used((uint32_t)t)]);
    }
    if (len < cap) snprintf(out + len, cap - len, "}");
}

/* Turns r into the next one-token decode step of its session: token tok (kept
 * in *slot) or, for a range without the embeddings, the hidden row hidden_row. */
static void decode_next(engine_req *r, int32_t *slot, int32_t tok, const float *hidden_row) {
    r->start_pos += r->n;
    r->n = 1;
    *slot = tok;
    r->tokens = slot;
    r->hidden = hidden_row;
}

/* The bench's sessions as decode steps them: step s of session j takes token
 * (toks[(s + j) % n_prompt] + s) % nv, or hidden row (s + j) % n_prompt for a
 * range without the embeddings. */
typedef struct {
    engine *e;
    engine_req *reqs; /* n_sessions, prefilled */
    int32_t *next;    /* n_sessions token slots */
    long n_sessions, n_prompt;
    const int32_t *toks;
    const float *hidden; /* n_prompt rows of d, or NULL */
    size_t d;
    int nv;
} bench_sessions;

/* Decode step `step` of every session in one engine_step: its seconds, or -1
 * after printing why a session failed. */
static double step_sessions(const bench_sessions *b, long step) {
    for (long s = 0; s < b->n_sessions; s++) {
        const long row = (step + s) % b->n_prompt;
        decode_next(&b->reqs[s], &b->next[s], (int32_t)((b->toks[row] + step) % b->nv),
                    b->hidden ? b->hidden + (size_t)row * b->d : NULL);
    }
    uint64_t t0 = kvs_now_ns();
    engine_step(b->e, b->reqs, (int)b->n_sessions);
    const double dt = (double)(kvs_now_ns() - t0) / 1e9;
    for (long s = 0; s < b->n_sessions; s++)
        if (b->reqs[s].status) {
            fprintf(stderr, "kvshard bench: decode failed: %s\n", kvs_strerror(b->reqs[s].status));
            return -1;
        }
    return dt;
}

/* --pairs1 auto|off|on|quad|spread: quant_r8_set_walk(-1 .. 3). */
static bool bench_pairs1(const char *mode) {
    static const char *const names[] = {"auto", "off", "on", "quad", "spread"};
    for (int i = 0; i < (int)(sizeof names / sizeof names[0]); i++)
        if (!strcmp(mode, names[i])) {
            quant_r8_set_walk(i - 1);
            return true;
        }
    fprintf(stderr, "kvshard bench: --pairs1 wants auto, on, off, quad or spread, got '%s'\n", mode);
    return false;
}

/* --isa NAME: the kernels of one ISA instead of the best detected (an A/B on one machine). */
static bool bench_force_isa(const char *name) {
    if (kvs_isa_force_name(name)) return true;
    fprintf(stderr, "kvshard bench: --isa %s: not one this CPU runs (scalar, avx2 or avx512 up to %s)\n",
            name, kvs_isa_name(kvs_isa_detect()));
    return false;
}

int cmd_bench(int argc, char **argv) {
    const char *path = NULL, *layers = NULL;
    const char *isa = NULL, *pairs1 = NULL;
    long threads = 0, n_prompt = 128, n_decode = 32, n_sessions = 1, depth = 0, paired = 0;
    uint32_t kv_type = QUANT_F16;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool ok = true;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { bench_usage(stdout); return 0; }
        else if (!strcmp(a, "-m")) ok = args_str(argc, argv, &i, &path);
        else if (!strcmp(a, "-t")) ok = args_int(argc, argv, &i, 1, 1024, &threads);
        else if (!strcmp(a, "-p")) ok = args_int(argc, argv, &i, 1, 1 << 16, &n_prompt);
        else if (!strcmp(a, "-n")) ok = args_int(argc, argv, &i, 1, 1 << 16, &n_decode);
        else if (!strcmp(a, "--sessions")) ok = args_int(argc, argv, &i, 1, 256, &n_sessions);
        else if (!strcmp(a, "--layers")) ok = args_str(argc, argv, &i, &layers);
        else if (!strcmp(a, "--depth")) ok = args_int(argc, argv, &i, 1, 1 << 16, &depth);
        else if (!strcmp(a, "--paired")) ok = args_int(argc, argv, &i, 1, 1 << 16, &paired);
        else if (!strcmp(a, "--no-repack")) quant_r8_set_enabled(false);
        else if (!strcmp(a, "--kv-type")) ok = args_kv_type(argc, argv, &i, &kv_type);
        else if (!strcmp(a, "--isa")) ok = args_str(argc, argv, &i, &isa) && bench_force_isa(isa);
        else if (!strcmp(a, "--pairs1")) ok = args_str(argc, argv, &i, &pairs1) && bench_pairs1(pairs1);
        else { fprintf(stderr, "kvshard bench: unknown option '%s'\n", a); bench_usage(stderr); return 2; }
        if (!ok) return 2;
    }
    if (!path) { fprintf(stderr, "kvshard bench: -m MODEL is required\n"); bench_usage(stderr); return 2; }
    if (depth && n_sessions != 1) { fprintf(stderr, "kvshard bench: --depth measures one session (no --sessions)\n"); return 2; }
    unsigned first = 0, last = 0;
    if (layers && (sscanf(layers, "%u:%u", &first, &last) != 2 || last <= first)) {
        fprintf(stderr, "kvshard bench: --layers wants FIRST:LAST with FIRST < LAST, got '%s'\n", layers);
        return 2;
    }
    char msg[KVS_MSG_MAX] = "";
    engine_params ep = engine_default_params();
    ep.model_path = path;
    ep.n_threads = (int)threads;
    ep.first = first;
    ep.last = last;
    ep.kv.kv_type = kv_type;
    /* Every session's prompt + decode, plus a block of slack each. */
    const long n_toks = depth > n_prompt ? depth : n_prompt; /* prompt tokens made */
    ep.kv_positions = (uint32_t)(n_toks + n_decode + paired);
    ep.kv_sessions = (uint32_t)(n_sessions + (depth ? 1 : 0));
    engine *e = NULL;
    int err;
    if ((err = engine_open(&ep, &e, msg, sizeof(msg)))) { fprintf(stderr, "kvshard bench: %s: %s\n", path, msg); return 1; }
    const model *m = e->m;
    if (n_toks + n_decode + paired > (long)m->hp.n_ctx) {
        fprintf(stderr, "kvshard bench: -p (or --depth) + -n + --paired exceed the context %u\n", m->hp.n_ctx);
        engine_close(e);
        return 2;
    }
    /* KV bytes per position of the local layers (docs/design.md §2). */
    uint64_t kv_tok = kv_block_bytes(e->kv) / (uint64_t)kv_get_params(e->kv)->block_tokens;
    int nv = (int)m->hp.n_vocab;
    size_t d = m->hp.n_embd;
    /* Per session output: logits of the last row, or hidden states of every prompt row. */
    size_t out_per = m->has_head ? (size_t)nv : (size_t)n_prompt * d;
    fwd_out_mode out_mode = m->has_head ? FWD_OUT_LOGITS_LAST : FWD_OUT_HIDDEN;
    int32_t *toks = malloc((size_t)n_toks * sizeof(int32_t));
    float *hidden = m->has_embd ? NULL : malloc((size_t)n_toks * d * sizeof(float));
    float *logits = malloc(((size_t)n_sessions * out_per + (depth ? (m->has_head ? (size_t)nv : (size_t)depth * d) : 0)) *
                           sizeof(float));
    engine_req *reqs = calloc((size_t)n_sessions, sizeof(engine_req));
    int32_t *next = calloc((size_t)n_sessions, sizeof(int32_t));
    if (!toks || !logits || !reqs || !next || (!m->has_embd && !hidden)) {
        fprintf(stderr, "kvshard bench: out of memory\n");
        return 1;
    }
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    for (long i = 0; i < n_toks; i++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        toks[i] = (int32_t)((rng >> 33) % (uint64_t)nv);
    }
    /* A range without the embeddings gets hidden states of O(1) values. */
    for (size_t i = 0; hidden && i < (size_t)n_toks * d; i++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        hidden[i] = (float)((double)(rng >> 40) / (double)(1ull << 24) * 2.0 - 1.0);
    }
    fprintf(stderr, "bench: warming up (touching the weights)\n");
    {
        engine_req w = {.epoch = 1, .n = 1, .tokens = toks, .hidden = hidden, .out_mode = out_mode, .out = logits};
        memcpy(w.sid.bytes, "bench-warmup-000", 16);
        engine_step(e, &w, 1);
        kv_release(e->kv, &w.sid, 1, NULL);
    }
    fprintf(stderr, "bench: prefill %ld tokens x %ld session(s)\n", n_prompt, n_sessions);
    double prefill_s = 0;
    for (long s = 0; s < n_sessions; s++) {
        engine_req *r = &reqs[s];
        char sid[32];
        snprintf(sid, sizeof(sid), "bench-%010ld", s % 10000000000L);
        memcpy(r->sid.bytes, sid, 16);
        r->epoch = 1;
        r->start_pos = 0;
        r->n = (uint32_t)n_prompt;
        r->tokens = toks;
        r->hidden = hidden;
        r->out_mode = out_mode;
        r->out = logits + (size_t)s * out_per;
        uint64_t t0 = kvs_now_ns();
        engine_step(e, r, 1);
        prefill_s += (double)(kvs_now_ns() - t0) / 1e9;
        if (r->status) { fprintf(stderr, "kvshard bench: prefill failed: %s\n", kvs_strerror(r->status)); return 1; }
    }
    /* --depth: the deep session, prefilled here (not part of prefill_tok_s). */
    engine_req deep = {.epoch = 1, .n = (uint32_t)depth, .tokens = toks, .hidden = hidden, .out_mode = out_mode,
                       .out = logits + (size_t)n_sessions * out_per};
    memcpy(deep.sid.bytes, "bench-depth-0000", 16);
    if (depth) {
        fprintf(stderr, "bench: prefill %ld tokens (the --depth session)\n", depth);
        engine_step(e, &deep, 1);
        if (deep.status) { fprintf(stderr, "kvshard bench: prefill failed: %s\n", kvs_strerror(deep.status)); return 1; }
    }
    fprintf(stderr, "bench: decode %ld steps x %ld session(s)%s\n", n_decode, n_sessions,
            depth ? ", alternating with the --depth session" : "");
    double decode_s = 0, depth_s = 0;
    int32_t deep_next = 0;
    const bench_sessions bs = {.e = e, .reqs = reqs, .next = next, .n_sessions = n_sessions, .n_prompt = n_prompt,
                               .toks = toks, .hidden = hidden, .d = d, .nv = nv};
    for (long step = 0; step < n_decode; step++) {
        if (depth) { /* a step of the deep session, then one of the others */
            decode_next(&deep, &deep_next, (int32_t)((toks[step % n_toks] + step + 1) % nv),
                        hidden ? hidden + (size_t)(step % n_toks) * d : NULL);
            uint64_t t1 = kvs_now_ns();
            engine_step(e, &deep, 1);
            depth_s += (double)(kvs_now_ns() - t1) / 1e9;
            if (deep.status) { fprintf(stderr, "kvshard bench: decode failed: %s\n", kvs_strerror(deep.status)); return 1; }
        }
        const double dt = step_sessions(&bs, step);
        if (dt < 0) return 1;
        decode_s += dt;
    }
    uint64_t rss = rss_bytes(); /* before the bandwidth probe allocates its buffer */
    fprintf(stderr, "bench: measuring memory bandwidth\n");
    int bw_streams = 0;
    bw_buffer bwb;
    const bool have_bw = bw_open(&bwb); /* without its 512 MiB: mem_bw_gbs 0, no paired steps */
    if (!have_bw) fprintf(stderr, "kvshard bench: no memory for the bandwidth probe's 512 MiB\n");
    double bw = have_bw ? measure_bw_gbs(e->pool, &bwb, &bw_streams) : 0;
    uint64_t wbytes = m->weight_bytes;
    if (m->has_embd && m->output.data != m->tok_embd.data) wbytes -= (uint64_t)m->tok_embd.row_bytes * m->tok_embd.n_out;
    /* --paired K: K more decode steps, each followed by one probe pass at its
     * best stream count; per pair the step's roofline against the bandwidth of
     * that pass, moments apart, so a slow spell of the machine falls on both
     * (decode_roofline sets the mean of the steps above against the best probe
     * pass after them). Reported beside decode_roofline, not in its place. */
    double paired_roof = 0, paired_bw = 0, paired_ms = 0;
    if (paired && have_bw) {
        fprintf(stderr, "bench: %ld paired decode steps and probe passes\n", paired);
        double *roof = malloc(3 * (size_t)paired * sizeof(double));
        if (!roof) { fprintf(stderr, "kvshard bench: out of memory\n"); return 1; }
        double *pbw = roof + paired, *pms = pbw + paired;
        for (long k = 0; k < paired; k++) {
            const double dt = step_sessions(&bs, n_decode + k);
            if (dt < 0) return 1;
            pbw[k] = bw_pass(e->pool, &bwb, bw_streams);
            pms[k] = dt * 1e3;
            roof[k] = (double)wbytes / (pbw[k] * 1e9) / dt;
        }
        paired_roof = median(roof, paired);
        paired_bw = median(pbw, paired);
        paired_ms = median(pms, paired);
        free(roof);
    }
    if (have_bw) bw_close(&bwb);
    double decode_tok_s = (double)(n_decode * n_sessions) / decode_s;
    double step_s = decode_s / (double)n_decode;
    double floor_s = bw > 0 ? (double)wbytes / (bw * 1e9) : 0;
    char sha[65] = "unavailable", cpu[256];
    fprintf(stderr, "bench: hashing the model file\n");
    uint8_t dg[32];
    if (digest_file_sha256(path, dg) == KVS_OK) digest_hex(dg, sha);
    cpu_name(cpu, sizeof(cpu));
    char kernels[512];
    kernel_paths(m, kernels, sizeof(kernels));
    kv_stats ks;
    kv_get_stats(e->kv, &ks);
    /* docs/design.md §2: block_bytes = block_tokens x n_local_layers x 2 x n_kv_heads x head_dim x sizeof(kv).
     * Held bytes over the exact need must stay under one block per session. */
    uint64_t positions = (uint64_t)(n_prompt + n_decode + paired);
    uint64_t kv_need = ((uint64_t)n_sessions * positions + (depth ? (uint64_t)(depth + n_decode) : 0)) * kv_tok;
    uint64_t kv_waste = ks.bytes_used - kv_need;
    char depth_json[320] = "";
    if (depth)
        snprintf(depth_json, sizeof(depth_json), ",\"depth\":%ld,\"decode_depth_tok_s\":%.2f,\"depth_slowdown\":%.3f", depth,
                 (double)n_decode / depth_s, depth_s / decode_s);
    if (paired) {
        const size_t len = strlen(depth_json);
        snprintf(depth_json + len, sizeof(depth_json) - len,
                 ",\"paired\":%ld,\"paired_step_ms\":%.3f,\"paired_bw_gbs\":%.2f,\"decode_roofline_paired\":%.3f", paired,
                 paired_ms, paired_bw, paired_roof);
    }
    kv_op_costs ops = {0};
    measure_kv_ops(kv_get_params(e->kv), &ops);
    printf("{\"model\":\"%s\",\"model_sha256\":\"%s\",\"threads\":%d,\"cpu\":\"%s\",\"isa\":\"%s\",\"kernels\":%s,\"commit\":\"%s\","
           "\"first_layer\":%u,\"last_layer\":%u,\"load_s\":%.3f,\"weight_bytes\":%llu,\"rss_bytes\":%llu,"
           "\"n_prompt\":%ld,\"n_decode\":%ld,\"sessions\":%ld,"
           "\"prefill_tok_s\":%.2f,\"decode_tok_s\":%.2f,\"decode_step_ms\":%.3f,"
           "\"mem_bw_gbs\":%.2f,\"mem_bw_streams\":%d,\"weight_bytes_per_token\":%llu,\"decode_floor_ms\":%.3f,\"decode_roofline\":%.3f,"
           "\"kv_type\":\"%s\",\"kv_bytes_per_token\":%llu,\"kv_block_bytes\":%llu,\"kv_bytes_used\":%llu,\"kv_bytes_needed\":%llu,"
           "\"kv_waste_bytes\":%llu,\"kv_waste_under_one_block_per_session\":%s,"
           "\"kv_open_us\":%.3f,\"kv_release_us\":%.3f,\"kv_open_evict_us\":%.3f%s}\n",
           path, sha, ops_pool_threads(e->pool), cpu, kvs_isa_name(kvs_isa_current()), kernels, KVS_COMMIT, m->first, m->last, e->open_s,
           (unsigned long long)m->weight_bytes, (unsigned long long)rss, n_prompt, n_decode,
           n_sessions, (double)(n_prompt * n_sessions) / prefill_s, decode_tok_s, step_s * 1e3, bw, bw_streams,
           (unsigned long long)wbytes, floor_s * 1e3, floor_s / step_s, quant_get_traits(kv_type)->name, (unsigned long long)kv_tok,
           (unsigned long long)ks.block_bytes, (unsigned long long)ks.bytes_used, (unsigned long long)kv_need,
           (unsigned long long)kv_waste, kv_waste < (uint64_t)(n_sessions + (depth ? 1 : 0)) * ks.block_bytes ? "true" : "false",
           ops.open_us, ops.release_us, ops.open_evict_us, depth_json);
    free(toks);
    free(hidden);
    free(logits);
    free(reqs);
    free(next);
    engine_close(e);
    return 0;
}
