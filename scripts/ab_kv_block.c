/*
 * ab_kv_block — decode step time under two KV block sizes in one process:
 * one engine (one model, one thread pool) and two hot-KV pools, A with
 * BT_A positions per block and B with BT_B. Each pool holds a short session
 * (SHORT prompt tokens) and a deep one (DEPTH). Then STEPS rounds, each a
 * decode step of every session in both pools, the pools' order swapped every
 * round (A B, B A, ...), so both see the same machine state. Prints the mean
 * and median ms per step of each session in each pool, and deep / short per
 * pool (what `kvshard bench --depth` reports as depth_slowdown).
 *
 * Not part of the build. From the repository root, after building build/:
 *   cc -O2 -Isrc -Iinclude scripts/ab_kv_block.c build/libkvshard_core.a -lpcre2-8 -lm -lpthread \
 *      -o build/ab_kv_block && build/ab_kv_block MODEL [DEPTH [SHORT [STEPS [BT_A [BT_B [THREADS]]]]]]
 * (defaults 2016 128 32 16 64 2)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "util.h"

#include "bench_util.h"

enum { POOLS = 2, KINDS = 2 }; /* kind 0: the short session, 1: the deep one */

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int step(engine *e, kv_state *kv, engine_req *r) {
    e->kv = kv;
    engine_step(e, r, 1);
    if (r->status) fprintf(stderr, "ab_kv_block: step failed: %s\n", kvs_strerror(r->status));
    return r->status;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: ab_kv_block MODEL [DEPTH [SHORT [STEPS [BT_A [BT_B [THREADS]]]]]]\n");
        return 2;
    }
    const int depth = argc > 2 ? atoi(argv[2]) : 2016, shortp = argc > 3 ? atoi(argv[3]) : 128;
    const int steps = argc > 4 ? atoi(argv[4]) : 32, threads = argc > 7 ? atoi(argv[7]) : 2;
    const int bt[POOLS] = {argc > 5 ? atoi(argv[5]) : 16, argc > 6 ? atoi(argv[6]) : 64};
    if (depth < 1 || shortp < 1 || steps < 1 || threads < 1 || bt[0] < 1 || bt[1] < 1) {
        fprintf(stderr, "ab_kv_block: every argument must be >= 1\n");
        return 2;
    }
    char msg[KVS_MSG_MAX] = "";
    engine_params ep = engine_default_params();
    ep.model_path = argv[1];
    ep.n_threads = threads;
    ep.kv.block_tokens = bt[0];
    ep.kv_positions = (uint32_t)(depth + steps); /* pool A: room for both sessions (engine_open sizes it) */
    ep.kv_sessions = KINDS;
    engine *e = NULL;
    if (engine_open(&ep, &e, msg, sizeof msg)) {
        fprintf(stderr, "ab_kv_block: %s\n", msg);
        return 1;
    }
    if ((unsigned)(depth + steps) > e->m->hp.n_ctx || !e->m->has_embd || !e->m->has_head) {
        fprintf(stderr, "ab_kv_block: needs a whole model with DEPTH + STEPS <= %u\n", e->m->hp.n_ctx);
        return 2;
    }
    /* Pool B: pool A's settings (the model's shape, filled by engine_open), its own block size,
     * and a budget of as many positions plus a block per session (each rounds up on its own). */
    kv_state *kv[POOLS] = {e->kv, NULL};
    kv_params kp = *kv_get_params(kv[0]);
    kv_stats st;
    kv_get_stats(kv[0], &st);
    const uint64_t positions = st.blocks_total * (uint64_t)kp.block_tokens;
    kp.block_tokens = bt[1];
    kp.budget_bytes = ((positions + (uint64_t)bt[1] - 1) / (uint64_t)bt[1] + KINDS) * kv_params_block_bytes(&kp);
    if (kv_create(&kp, &kv[1], msg, sizeof msg)) {
        fprintf(stderr, "ab_kv_block: %s\n", msg);
        return 1;
    }
    const int nv = (int)e->m->hp.n_vocab;
    const int n_toks = depth > shortp ? depth : shortp;
    int32_t *toks = malloc(sizeof(int32_t) * (size_t)n_toks);
    float *logits = malloc(sizeof(float) * (size_t)nv);
    double *ms = malloc(sizeof(double) * (size_t)steps * POOLS * KINDS);
#define SERIES(p, k) (ms + ((size_t)(p) * KINDS + (size_t)(k)) * (size_t)steps) /* ms of one session's steps */
    if (!toks || !logits || !ms) {
        fprintf(stderr, "ab_kv_block: out of memory\n");
        return 1;
    }
    srand(1);
    for (int i = 0; i < n_toks; i++) toks[i] = (int32_t)(rand() % nv); /* any tokens: the time is what counts */
    engine_req req[POOLS][KINDS];
    int32_t next[POOLS][KINDS];
    fprintf(stderr, "ab_kv_block: prefill %d and %d tokens in pools of %d and %d positions per block\n", shortp, depth,
            bt[0], bt[1]);
    for (int p = 0; p < POOLS; p++)
        for (int k = 0; k < KINDS; k++) {
            engine_req *r = &req[p][k];
            memset(r, 0, sizeof *r);
            memcpy(r->sid.bytes, k ? "ab-kv-block-deep" : "ab-kv-block-shrt", 16);
            r->epoch = 1;
            r->n = (uint32_t)(k ? depth : shortp);
            r->tokens = toks;
            r->out_mode = FWD_OUT_LOGITS_LAST;
            r->out = logits;
            if (step(e, kv[p], r)) return 1;
        }
    for (int s = 0; s < steps; s++)
        for (int i = 0; i < POOLS; i++) {
            const int p = (s & 1) ? POOLS - 1 - i : i;
            for (int k = 0; k < KINDS; k++) {
                engine_req *r = &req[p][k];
                r->start_pos += r->n;
                r->n = 1;
                next[p][k] = (toks[s % n_toks] + s + 1) % nv;
                r->tokens = &next[p][k];
                double t0 = bench_now_s();
                if (step(e, kv[p], r)) return 1;
                SERIES(p, k)[s] = (bench_now_s() - t0) * 1e3;
            }
        }
    printf("%d threads, %d steps each; ms per decode step, mean / median\n", threads, steps);
    double med[POOLS][KINDS];
    for (int p = 0; p < POOLS; p++) {
        double mean[KINDS];
        for (int k = 0; k < KINDS; k++) {
            double *v = SERIES(p, k), sum = 0;
            for (int s = 0; s < steps; s++) sum += v[s];
            mean[k] = sum / steps;
            qsort(v, (size_t)steps, sizeof(double), cmp_double);
            med[p][k] = v[steps / 2];
        }
        printf("block %4d: short (%d) %.3f / %.3f  deep (%d) %.3f / %.3f  deep/short %.3f / %.3f\n", bt[p], shortp,
               mean[0], med[p][0], depth, mean[1], med[p][1], mean[1] / mean[0], med[p][1] / med[p][0]);
    }
    printf("B/A medians: short %.3f  deep %.3f\n", med[1][0] / med[0][0], med[1][1] / med[0][1]);
    e->kv = kv[0]; /* the engine's own, freed with it */
    kv_free(kv[1]);
    engine_close(e);
    free(toks);
    free(logits);
    free(ms);
    return 0;
}
