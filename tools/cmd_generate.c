/* kvshard generate: drive a route of shards (no weights here). Same tokenizer, sampler, stop rule
 * and output as `kvshard run`, so for the same prompt, model and sampling the ids and text match. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "gguf.h"
#include "route.h"
#include "sampler.h"
#include "tokenizer.h"

static void generate_usage(FILE *f) {
    fprintf(f,
            "usage: kvshard generate --route HOST:PORT[,HOST:PORT...] -p PROMPT [-n N] [--temp X]\n"
            "                        [--top-k K] [--top-p P] [--seed S] [--spare HOST:PORT[,...]]\n"
            "                        [-m MODEL] [--json] [--timeout MS] [-v]\n"
            "  --route LIST  the shards in layer order; together they must cover every layer\n"
            "  --spare LIST  replacement shards, used when a hop fails (same model, same layers)\n"
            "  -n N          tokens to generate (default 64; stops early at end-of-text)\n"
            "  --temp X      sampling temperature; 0 = greedy (default 0.8)\n"
            "  --top-k K     keep the K most likely tokens (default 40; 0 = off)\n"
            "  --top-p P     nucleus sampling threshold (default 0.95; 1 = off)\n"
            "  --seed S      sampler seed (default 42)\n"
            "  -m MODEL      read the tokenizer from this GGUF (default: from the head shard)\n"
            "  --json        print {\"prompt_tokens\":[..],\"generated\":[..],\"text\":\"..\"} only\n"
            "  --timeout MS  connect / reply deadline per request (default 30000)\n"
            "  -v            log re-routes and replays to stderr\n"
            "  -t THREADS    accepted and ignored (the shards compute)\n");
}

static void log_stderr(void *user, const char *line) {
    (void)user;
    fprintf(stderr, "kvshard generate: %s\n", line);
}

/* Appends the text of id to buf (as kvshard run does). */
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

static int load_local_vocab(const char *path, tok_vocab **out) {
    char msg[KVS_MSG_MAX] = "";
    gguf_ctx *g = NULL;
    int err = gguf_open(path, &g, msg, sizeof msg);
    if (err == KVS_OK) err = tok_from_gguf(g, out, msg, sizeof msg);
    gguf_close(g);
    if (err) fprintf(stderr, "kvshard generate: %s: %s\n", path, msg[0] ? msg : kvs_strerror(err));
    return err;
}

int cmd_generate(int argc, char **argv) {
    const char *route_spec = NULL, *spare_spec = NULL, *path = NULL, *prompt = NULL;
    long n_gen = 64, threads = 0, timeout_ms = 30000;
    double temp = 0.8, top_p = 0.95;
    long top_k = 40;
    uint64_t seed = 42;
    bool json = false, verbose = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool ok = true;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { generate_usage(stdout); return 0; }
        else if (!strcmp(a, "--route")) ok = args_str(argc, argv, &i, &route_spec);
        else if (!strcmp(a, "--spare")) ok = args_str(argc, argv, &i, &spare_spec);
        else if (!strcmp(a, "-m")) ok = args_str(argc, argv, &i, &path);
        else if (!strcmp(a, "-p")) ok = args_str(argc, argv, &i, &prompt);
        else if (!strcmp(a, "-n")) ok = args_int(argc, argv, &i, 0, 1 << 20, &n_gen);
        else if (!strcmp(a, "-t")) ok = args_int(argc, argv, &i, 1, 1024, &threads);
        else if (!strcmp(a, "--temp")) ok = args_float(argc, argv, &i, 0, 100, &temp);
        else if (!strcmp(a, "--top-k")) ok = args_int(argc, argv, &i, 0, 1 << 24, &top_k);
        else if (!strcmp(a, "--top-p")) ok = args_float(argc, argv, &i, 0, 1, &top_p);
        else if (!strcmp(a, "--seed")) ok = args_u64(argc, argv, &i, &seed);
        else if (!strcmp(a, "--timeout")) ok = args_int(argc, argv, &i, 1, 24L * 3600 * 1000, &timeout_ms);
        else if (!strcmp(a, "--json")) json = true;
        else if (!strcmp(a, "-v") || !strcmp(a, "--verbose")) verbose = true;
        else { fprintf(stderr, "kvshard generate: unknown option '%s'\n", a); generate_usage(stderr); return 2; }
        if (!ok) return 2;
    }
    if (!route_spec || !prompt) {
        fprintf(stderr, "kvshard generate: --route and -p PROMPT are required\n");
        generate_usage(stderr);
        return 2;
    }

    char msg[KVS_MSG_MAX] = "";
    route_params rp = route_default_params();
    rp.timeout_ms = timeout_ms;
    if (verbose) rp.log = log_stderr;
    route *r = NULL;
    int err = route_open(route_spec, spare_spec, &rp, &r, msg, sizeof msg);
    if (err) {
        fprintf(stderr, "kvshard generate: %s\n", msg[0] ? msg : kvs_strerror(err));
        return 1;
    }
    route_info ri;
    route_get_info(r, &ri);

    int rc = 1;
    tok_vocab *vocab = NULL;
    route_session *sess = NULL;
    sampler *smp = NULL;
    int32_t *ids = NULL, *gen = NULL;
    float *logits = NULL;
    char *text = NULL;
    size_t text_len = 0, text_cap = 0;
    size_t plen = strlen(prompt);

    if (path) {
        if (load_local_vocab(path, &vocab)) goto out;
    } else if ((err = route_fetch_vocab(r, &vocab, msg, sizeof msg)) != KVS_OK) {
        fprintf(stderr, "kvshard generate: %s\n", msg[0] ? msg : kvs_strerror(err));
        goto out;
    }
    if ((uint32_t)tok_n_vocab(vocab) != ri.n_vocab) {
        fprintf(stderr, "kvshard generate: the tokenizer has %d tokens but the route's model has %u\n",
                (int)tok_n_vocab(vocab), ri.n_vocab);
        goto out;
    }
    int n_ids = 0, cap_ids = (int)plen + 2;
    ids = malloc((size_t)cap_ids * sizeof(int32_t));
    gen = malloc(((size_t)n_gen + 1) * sizeof(int32_t));
    logits = malloc((size_t)ri.n_vocab * sizeof(float));
    if (!ids || !gen || !logits) { fprintf(stderr, "kvshard generate: out of memory\n"); goto out; }
    if (tok_encode(vocab, prompt, plen, true, ids, cap_ids, &n_ids) != KVS_OK) {
        fprintf(stderr, "kvshard generate: cannot tokenize the prompt\n");
        goto out;
    }
    if ((uint64_t)n_ids + (uint64_t)n_gen > ri.max_ctx) {
        fprintf(stderr,
                "kvshard generate: prompt (%d tokens) + %ld new tokens exceed the context length %u of the route\n",
                n_ids, n_gen, ri.max_ctx);
        goto out;
    }
    sampler_params sp = {.temp = (float)temp, .top_k = (int)top_k, .top_p = (float)top_p, .seed = seed};
    smp = sampler_create(sp);
    if (!smp) { fprintf(stderr, "kvshard generate: out of memory\n"); goto out; }
    if ((err = route_session_open(r, &sess, msg, sizeof msg)) != KVS_OK) {
        fprintf(stderr, "kvshard generate: %s\n", msg[0] ? msg : kvs_strerror(err));
        goto out;
    }
    if (!json) {
        fputs(prompt, stdout);
        fflush(stdout);
    }
    const int32_t *step = ids;
    uint32_t step_n = (uint32_t)n_ids;
    int n_out = 0;
    for (;;) {
        if ((err = route_forward(r, sess, step, step_n, logits, msg, sizeof msg)) != KVS_OK) {
            fprintf(stderr, "\nkvshard generate: forward failed: %s\n", msg[0] ? msg : kvs_strerror(err));
            goto out;
        }
        if (n_out >= n_gen) break;
        int32_t id = sampler_sample(smp, logits, (int32_t)ri.n_vocab);
        if (id == tok_eos(vocab)) break;
        gen[n_out++] = id;
        size_t before = text_len;
        piece_append(vocab, id, &text, &text_len, &text_cap);
        if (!json && text) {
            fwrite(text + before, 1, text_len - before, stdout);
            fflush(stdout);
        }
        if (n_out >= n_gen) break;
        step = &gen[n_out - 1];
        step_n = 1;
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
    if (verbose && route_session_epoch(sess) > 1)
        fprintf(stderr, "kvshard generate: finished at epoch %llu\n", (unsigned long long)route_session_epoch(sess));
    rc = 0;
out:
    route_release(r, sess);
    route_close(r);
    sampler_free(smp);
    tok_free(vocab);
    free(ids);
    free(gen);
    free(logits);
    free(text);
    return rc;
}
