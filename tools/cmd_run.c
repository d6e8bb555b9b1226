/* kvshard run / kvshard logits: the whole model in one process. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "engine.h"
#include "sampler.h"
#include "util.h"

static void run_usage(FILE *f) {
    fprintf(f,
            "usage: kvshard run -m MODEL -p PROMPT [-n N] [-t THREADS] [--temp X] [--top-k K]\n"
            "                   [--top-p P] [--seed S] [--json] [--kv-type f16|f32]\n"
            "  -n N        tokens to generate (default 64; stops early at end-of-text)\n"
            "  -t THREADS  compute threads (default: all CPUs)\n"
            "  --temp X    sampling temperature; 0 = greedy (default 0.8)\n"
            "  --top-k K   keep the K most likely tokens (default 40; 0 = off)\n"
            "  --top-p P   nucleus sampling threshold (default 0.95; 1 = off)\n"
            "  --seed S    sampler seed (default 42)\n"
            "  --json      print {\"prompt_tokens\":[..],\"generated\":[..],\"text\":\"..\"} only\n");
}

/* Writes the text of id to f (or appends to buf); returns false on error. */
static void piece_append(const tok_vocab *v, int32_t id, char **buf, size_t *len, size_t *cap) {
    char tmp[256];
    size_t n = 0;
    if (tok_piece(v, id, tmp, sizeof(tmp), &n) != KVS_OK) return;
    if (n > sizeof(tmp)) n = sizeof(tmp);
    if (*len + n + 1 > *cap) {
        size_t nc = (*cap ? *cap * 2 : 256) + n;
        char *nb = realloc(*buf, nc);
        if (!nb) return;
        *buf = nb;
        *cap = nc;
    }
    memcpy(*buf + *len, tmp, n);
    *len += n;
    (*buf)[*len] = 0;
}

static int open_engine(const char *path, int threads, uint32_t kv_type, uint32_t positions, engine **e) {
    char msg[KVS_MSG_MAX] = "";
    engine_params ep = engine_default_params();
    ep.model_path = path;
    ep.n_threads = threads;
    ep.kv.kv_type = kv_type;
    /* Budget for one session of `positions` tokens, rounded up to blocks. */
    ep.kv.budget_bytes = 1; /* replaced below once the shape is known */
    model *m = NULL;
    int err = model_load(path, 0, 0, &m, msg, sizeof(msg));
    if (err) {
        fprintf(stderr, "kvshard: %s: %s\n", path, msg[0] ? msg : kvs_strerror(err));
        return err;
    }
    uint64_t per_tok = (uint64_t)m->hp.n_layer * 2 * m->hp.n_head_kv * m->hp.head_dim * (kv_type == 1 ? 2 : 4);
    uint64_t blocks = (positions + (uint64_t)ep.kv.block_tokens - 1) / (uint64_t)ep.kv.block_tokens + 1;
    ep.kv.budget_bytes = blocks * (uint64_t)ep.kv.block_tokens * per_tok;
    model_free(m);
    err = engine_open(&ep, e, msg, sizeof(msg));
    if (err) fprintf(stderr, "kvshard: %s: %s\n", path, msg[0] ? msg : kvs_strerror(err));
    return err;
}

static bool parse_kv_type(const char *s, uint32_t *out) {
    if (!strcmp(s, "f16")) *out = 1;
    else if (!strcmp(s, "f32")) *out = 0;
    else return false;
    return true;
}

int cmd_run(int argc, char **argv) {
    const char *path = NULL, *prompt = NULL, *kvt = "f16";
    long n_gen = 64, threads = 0;
    double temp = 0.8, top_p = 0.95;
    long top_k = 40;
    uint64_t seed = 42;
    bool json = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool ok = true;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { run_usage(stdout); return 0; }
        else if (!strcmp(a, "-m")) ok = args_str(argc, argv, &i, &path);
        else if (!strcmp(a, "-p")) ok = args_str(argc, argv, &i, &prompt);
        else if (!strcmp(a, "-n")) ok = args_int(argc, argv, &i, 0, 1 << 20, &n_gen);
        else if (!strcmp(a, "-t")) ok = args_int(argc, argv, &i, 1, 1024, &threads);
        else if (!strcmp(a, "--temp")) ok = args_float(argc, argv, &i, 0, 100, &temp);
        else if (!strcmp(a, "--top-k")) ok = args_int(argc, argv, &i, 0, 1 << 24, &top_k);
        else if (!strcmp(a, "--top-p")) ok = args_float(argc, argv, &i, 0, 1, &top_p);
        else if (!strcmp(a, "--seed")) ok = args_u64(argc, argv, &i, &seed);
        else if (!strcmp(a, "--kv-type")) ok = args_str(argc, argv, &i, &kvt);
        else if (!strcmp(a, "--json")) json = true;
        else { fprintf(stderr, "kvshard run: unknown option '%s'\n", a); run_usage(stderr); return 2; }
        if (!ok) return 2;
    }
    uint32_t kv_type;
    if (!path || !prompt) { fprintf(stderr, "kvshard run: -m MODEL and -p PROMPT are required\n"); run_usage(stderr); return 2; }
    if (!parse_kv_type(kvt, &kv_type)) { fprintf(stderr, "kvshard run: --kv-type must be f16 or f32\n"); return 2; }

    /* Tokenize first with a throwaway engine-free path: we need the count for the budget. */
    engine *e = NULL;
    size_t plen = strlen(prompt);
    if (open_engine(path, (int)threads, kv_type, (uint32_t)(plen + 2 + (size_t)n_gen), &e)) return 1;
    int rc = 1;
    int32_t *ids = NULL, *gen = NULL;
    float *logits = NULL;
    char *text = NULL;
    size_t text_len = 0, text_cap = 0;
    sampler *smp = NULL;
    if (!e->vocab) { fprintf(stderr, "kvshard run: %s has no llama tokenizer\n", path); goto out; }
    int n_ids = 0, cap_ids = (int)plen + 2;
    ids = malloc((size_t)cap_ids * sizeof(int32_t));
    gen = malloc(((size_t)n_gen + 1) * sizeof(int32_t));
    logits = malloc((size_t)e->m->hp.n_vocab * sizeof(float));
    if (!ids || !gen || !logits) { fprintf(stderr, "kvshard run: out of memory\n"); goto out; }
    if (tok_encode(e->vocab, prompt, plen, true, ids, cap_ids, &n_ids) != KVS_OK) {
        fprintf(stderr, "kvshard run: cannot tokenize the prompt\n");
        goto out;
    }
    if ((uint64_t)n_ids + (uint64_t)n_gen > e->m->hp.n_ctx) {
        fprintf(stderr, "kvshard run: prompt (%d tokens) + %ld new tokens exceed the context length %u\n", n_ids, n_gen,
                e->m->hp.n_ctx);
        goto out;
    }
    sampler_params sp = {.temp = (float)temp, .top_k = (int)top_k, .top_p = (float)top_p, .seed = seed};
    smp = sampler_create(sp);
    if (!smp) goto out;
    if (!json) {
        fputs(prompt, stdout);
        fflush(stdout);
    }
    engine_req req = {.epoch = 1, .start_pos = 0, .n = (uint32_t)n_ids, .tokens = ids,
                      .out_mode = FWD_OUT_LOGITS_LAST, .out = logits};
    memcpy(req.sid.bytes, "kvshard-run-sess", 16);
    int n_out = 0;
    for (;;) {
        engine_step(e, &req, 1);
        if (req.status) {
            fprintf(stderr, "\nkvshard run: forward failed: %s\n", kvs_strerror(req.status));
            goto out;
        }
        if (n_out >= n_gen) break;
        int32_t id = sampler_sample(smp, logits, (int32_t)e->m->hp.n_vocab);
        if (id == tok_eos(e->vocab)) break;
        gen[n_out++] = id;
        size_t before = text_len;
        piece_append(e->vocab, id, &text, &text_len, &text_cap);
        if (!json && text) {
            fwrite(text + before, 1, text_len - before, stdout);
            fflush(stdout);
        }
        if (n_out >= n_gen) break;
        req.start_pos += req.n;
        req.n = 1;
        req.tokens = &gen[n_out - 1];
    }
    if (json) {
        cJSON *o = cJSON_CreateObject();
        cJSON *pt = cJSON_AddArrayToObject(o, "prompt_tokens");
        for (int i = 0; i < n_ids; i++) cJSON_AddItemToArray(pt, cJSON_CreateNumber(ids[i]));
        cJSON *g = cJSON_AddArrayToObject(o, "generated");
        for (int i = 0; i < n_out; i++) cJSON_AddItemToArray(g, cJSON_CreateNumber(gen[i]));
        cJSON_AddStringToObject(o, "text", text ? text : "");
        char *s = cJSON_PrintUnformatted(o);
        if (s) puts(s);
        free(s);
        cJSON_Delete(o);
    } else {
        putchar('\n');
    }
    rc = 0;
out:
    sampler_free(smp);
    free(ids);
    free(gen);
    free(logits);
    free(text);
    engine_close(e);
    return rc;
}

static void logits_usage(FILE *f) {
    fprintf(f, "usage: kvshard logits -m MODEL (-p PROMPT | --tokens ID,ID,...) [-t THREADS] [--kv-type f16|f32]\n"
               "  prints {\"tokens\":[ids],\"logits\":[[...],...]}: every position's logits, one batch\n"
               "  (-p adds BOS before the prompt; --tokens is taken as is)\n");
}

int cmd_logits(int argc, char **argv) {
    const char *path = NULL, *prompt = NULL, *toks = NULL, *kvt = "f16";
    long threads = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool ok = true;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { logits_usage(stdout); return 0; }
        else if (!strcmp(a, "-m")) ok = args_str(argc, argv, &i, &path);
        else if (!strcmp(a, "-p")) ok = args_str(argc, argv, &i, &prompt);
        else if (!strcmp(a, "--tokens")) ok = args_str(argc, argv, &i, &toks);
        else if (!strcmp(a, "-t")) ok = args_int(argc, argv, &i, 1, 1024, &threads);
        else if (!strcmp(a, "--kv-type")) ok = args_str(argc, argv, &i, &kvt);
        else { fprintf(stderr, "kvshard logits: unknown option '%s'\n", a); logits_usage(stderr); return 2; }
        if (!ok) return 2;
    }
    uint32_t kv_type;
    if (!path || (!prompt == !toks)) {
        fprintf(stderr, "kvshard logits: -m MODEL and exactly one of -p / --tokens are required\n");
        logits_usage(stderr);
        return 2;
    }
    if (!parse_kv_type(kvt, &kv_type)) { fprintf(stderr, "kvshard logits: --kv-type must be f16 or f32\n"); return 2; }
    size_t cap = prompt ? strlen(prompt) + 2 : strlen(toks) / 2 + 2;
    int32_t *ids = malloc(cap * sizeof(int32_t));
    if (!ids) return 1;
    int n = 0;
    if (toks) {
        const char *s = toks;
        while (*s) {
            char *end;
            long v = strtol(s, &end, 10);
            if (end == s || v < 0 || v > INT32_MAX || (*end && *end != ',')) {
                fprintf(stderr, "kvshard logits: --tokens wants comma-separated ids, got '%s'\n", toks);
                free(ids);
                return 2;
            }
            ids[n++] = (int32_t)v;
            s = *end ? end + 1 : end;
        }
    }
    engine *e = NULL;
    if (open_engine(path, (int)threads, kv_type, (uint32_t)cap, &e)) { free(ids); return 1; }
    int rc = 1;
    float *logits = NULL;
    if (prompt) {
        if (!e->vocab) { fprintf(stderr, "kvshard logits: %s has no llama tokenizer\n", path); goto out; }
        if (tok_encode(e->vocab, prompt, strlen(prompt), true, ids, (int)cap, &n) != KVS_OK) goto out;
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
