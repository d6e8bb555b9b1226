/* kvshard run / kvshard logits: the whole model in one process. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "engine.h"
#include "gen_loop.h"
#include "local_engine.h"
#include "quant.h"
#include "util.h"

static void run_usage(FILE *f) {
    fprintf(f, "usage: kvshard run -m MODEL -p PROMPT [-n N] [-t THREADS] [--temp X] [--top-k K] [--top-p P]\n"
               "                   [--seed S] [--json] [--stats] [--kv-type f16|q8_0|q4_0|f32]\n"
               "  -m MODEL          a llama GGUF file\n"
               "  -t THREADS        compute threads (default: all CPUs)\n"
               "  --kv-type T       KV cache element type (default f16; q8_0 / q4_0: GGUF blocks along head_dim)\n");
    gen_usage_common(f);
}

int cmd_run(int argc, char **argv) {
    const char *path = NULL;
    long threads = 0;
    uint32_t kv_type = QUANT_F16;
    gen_opts o;
    gen_opts_default(&o);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool ok = true;
        int g = gen_parse_opt(&o, argc, argv, &i);
        if (g < 0) return 2;
        if (g > 0) continue;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { run_usage(stdout); return 0; }
        else if (!strcmp(a, "-m")) ok = args_str(argc, argv, &i, &path);
        else if (!strcmp(a, "-t")) ok = args_int(argc, argv, &i, 1, 1024, &threads);
        else if (!strcmp(a, "--kv-type")) ok = args_kv_type(argc, argv, &i, &kv_type);
        else { fprintf(stderr, "kvshard run: unknown option '%s'\n", a); run_usage(stderr); return 2; }
        if (!ok) return 2;
    }
    if (!path || !o.prompt) { fprintf(stderr, "kvshard run: -m MODEL and -p PROMPT are required\n"); run_usage(stderr); return 2; }
    engine *e = NULL;
    /* The pool holds what this run needs, or the -c asked for. */
    size_t need = o.n_ctx ? (size_t)o.n_ctx : 3 * strlen(o.prompt) + 2 + (size_t)o.n_gen;
    if (local_engine_open("kvshard", path, (int)threads, kv_type, (uint32_t)(need < (1u << 24) ? need : 1u << 24), &e))
        return 1;
    int rc = 1;
    if (!e->vocab) {
        local_engine_say_no_vocab("run", path, e);
    } else if (o.n_ctx && (uint32_t)o.n_ctx > e->m->hp.n_ctx) {
        fprintf(stderr, "kvshard run: -c/--ctx-size %ld is more than the model's context length %u\n", o.n_ctx,
                e->m->hp.n_ctx);
    } else {
        local_session c = {.e = e, .req = {.epoch = 1, .out_mode = FWD_OUT_LOGITS_LAST}};
        memcpy(c.req.sid.bytes, "kvshard-run-sess", 16);
        gen_target t = {.cmd = "run", .vocab = e->vocab, .n_vocab = (int32_t)e->m->hp.n_vocab,
                        .max_ctx = o.n_ctx ? (uint32_t)o.n_ctx : e->m->hp.n_ctx, .backend = {.forward = local_session_step, .ctx = &c}};
        rc = gen_run(&o, &t);
    }
    engine_close(e);
    return rc;
}

static void logits_usage(FILE *f) {
    fprintf(f, "usage: kvshard logits -m MODEL (-p PROMPT | --tokens ID,ID,...) [--top K] [--plain] [-t THREADS]\n"
               "                      [--kv-type f16|q8_0|q4_0|f32]\n"
               "  prints {\"tokens\":[ids],\"logits\":[[...],...]}: every position's logits, one batch\n"
               "  (-p: BOS as the file says, special-token text parsed unless --plain; --tokens as is)\n"
               "  --top K   instead of full vectors, per position {\"lse\": log-sum-exp, \"top\": [[id, logit],\n"
               "            ...]}, the K largest first: {\"tokens\":[..],\"logits_top\":[...]}\n");
}

/* The k largest of x[0..n) into idx[0..k) (k <= n), largest first; ties: lower id first. */
static void top_k(const float *x, size_t n, int k, int32_t *idx) {
    int have = 0;
    for (size_t j = 0; j < n; j++) {
        float v = x[j];
        if (have == k && !(v > x[idx[k - 1]])) continue;
        int at = have < k ? have++ : k - 1;
        while (at > 0 && v > x[idx[at - 1]]) {
            idx[at] = idx[at - 1];
            at--;
        }
        idx[at] = (int32_t)j;
    }
}

static double log_sum_exp(const float *x, size_t n) {
    double m = -INFINITY, s = 0;
    for (size_t j = 0; j < n; j++)
        if (x[j] > m) m = x[j];
    if (!isfinite(m)) return m;
    for (size_t j = 0; j < n; j++) s += exp((double)x[j] - m);
    return m + log(s);
}

int cmd_logits(int argc, char **argv) {
    const char *path = NULL, *prompt = NULL, *toks = NULL;
    long threads = 0, top = 0;
    bool plain = false;
    uint32_t kv_type = QUANT_F16;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool ok = true;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { logits_usage(stdout); return 0; }
        else if (!strcmp(a, "-m")) ok = args_str(argc, argv, &i, &path);
        else if (!strcmp(a, "-p")) ok = args_str(argc, argv, &i, &prompt);
        else if (!strcmp(a, "--tokens")) ok = args_str(argc, argv, &i, &toks);
        else if (!strcmp(a, "--top")) ok = args_int(argc, argv, &i, 1, 1 << 20, &top);
        else if (!strcmp(a, "--plain")) plain = true;
        else if (!strcmp(a, "-t")) ok = args_int(argc, argv, &i, 1, 1024, &threads);
        else if (!strcmp(a, "--kv-type")) ok = args_kv_type(argc, argv, &i, &kv_type);
        else { fprintf(stderr, "kvshard logits: unknown option '%s'\n", a); logits_usage(stderr); return 2; }
        if (!ok) return 2;
    }
    if (!path || (!prompt == !toks)) {
        fprintf(stderr, "kvshard logits: -m MODEL and exactly one of -p / --tokens are required\n");
        logits_usage(stderr);
        return 2;
    }
    int32_t *ids = NULL;
    size_t n_list = 0;
    if (toks && args_ids(toks, &ids, &n_list) != 0) {
        fprintf(stderr, "kvshard logits: --tokens wants comma-separated ids, got '%s'\n", toks);
        return 2;
    }
    int n = (int)n_list;
    size_t cap = prompt ? 3 * strlen(prompt) + 2 : n_list + 1; /* positions for the KV budget */
    engine *e = NULL;
    if (local_engine_open("kvshard", path, (int)threads, kv_type, (uint32_t)cap, &e)) { free(ids); return 1; }
    int rc = 1;
    float *logits = NULL;
    if (prompt) {
        if (!e->vocab) { local_engine_say_no_vocab("logits", path, e); goto out; }
        if (gen_tokenize(e->vocab, prompt, tok_add_bos(e->vocab), !plain, &ids, &n) != KVS_OK) goto out;
    }
    if (n == 0) { fprintf(stderr, "kvshard logits: no tokens\n"); goto out; }
    if ((uint32_t)n > e->m->hp.n_ctx) { fprintf(stderr, "kvshard logits: %d tokens exceed the context length %u\n", n, e->m->hp.n_ctx); goto out; }
    for (int i = 0; i < n; i++)
        if ((uint32_t)ids[i] >= e->m->hp.n_vocab) {
            fprintf(stderr, "kvshard logits: token id %d is outside the vocabulary (%u)\n", ids[i], e->m->hp.n_vocab);
            goto out;
        }
    size_t nv = e->m->hp.n_vocab;
    logits = malloc((size_t)n * nv * sizeof(float));
    if (!logits) goto out;
    engine_req req = {.epoch = 1, .start_pos = 0, .n = (uint32_t)n, .tokens = ids, .out_mode = FWD_OUT_LOGITS_ALL, .out = logits};
    engine_step(e, &req, 1);
    if (req.status) { fprintf(stderr, "kvshard logits: forward failed: %s\n", kvs_strerror(req.status)); goto out; }
    printf("{\"tokens\":[");
    for (int i = 0; i < n; i++) printf(i ? ",%d" : "%d", ids[i]);
    if (top > 0) {
        int k = (size_t)top < nv ? (int)top : (int)nv;
        int32_t *idx = malloc((size_t)k * sizeof *idx);
        if (!idx) goto out;
        printf("],\"logits_top\":[");
        for (int i = 0; i < n; i++) {
            const float *row = logits + (size_t)i * nv;
            top_k(row, nv, k, idx);
            printf("%s{\"lse\":%.7g,\"top\":[", i ? "," : "", log_sum_exp(row, nv));
            for (int j = 0; j < k; j++) printf("%s[%d,%.7g]", j ? "," : "", (int)idx[j], (double)row[idx[j]]);
            printf("]}");
        }
        printf("]}\n");
        free(idx);
        rc = 0;
        goto out;
    }
    printf("],\"logits\":[");
    for (int i = 0; i < n; i++) {
        printf(i ? ",[" : "[");
        for (size_t j = 0; j < nv; j++) printf(j ? ",%.7g" : "%.7g", (double)logits[(size_t)i * nv + j]);
        putchar(']');
    }
    printf("]}\n");
    rc = 0;
out:
    free(logits);
    free(ids);
    engine_close(e);
    return rc;
}
