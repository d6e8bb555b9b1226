#include "gen_loop.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "util.h"

void gen_opts_default(gen_opts *o) {
    memset(o, 0, sizeof(*o));
    o->n_gen = 64;
    o->sp = sampler_default_params();
    o->repeat_last_n = 64;
}

int gen_parse_opt(gen_opts *o, int argc, char **argv, int *i) {
    const char *a = argv[*i];
    double d;
    long l;
    bool ok;
    if (!strcmp(a, "-p")) ok = args_str(argc, argv, i, &o->prompt);
    else if (!strcmp(a, "-n")) ok = args_int(argc, argv, i, 0, 1 << 20, &o->n_gen);
    else if (!strcmp(a, "--temp")) { ok = args_float(argc, argv, i, 0, 100, &d); o->sp.temp = (float)d; }
    else if (!strcmp(a, "--top-k")) { ok = args_int(argc, argv, i, 0, 1 << 24, &l); o->sp.top_k = (int)l; }
    else if (!strcmp(a, "--top-p")) { ok = args_float(argc, argv, i, 0, 1, &d); o->sp.top_p = (float)d; }
    else if (!strcmp(a, "--seed")) ok = args_u64(argc, argv, i, &o->sp.seed);
    else if (!strcmp(a, "--min-p")) { ok = args_float(argc, argv, i, 0, 1, &d); o->sp.min_p = (float)d; }
    else if (!strcmp(a, "--repeat-penalty")) { ok = args_float(argc, argv, i, 0, 100, &d); o->sp.repeat_penalty = (float)d; }
    else if (!strcmp(a, "--presence-penalty")) { ok = args_float(argc, argv, i, -100, 100, &d); o->sp.presence_penalty = (float)d; }
    else if (!strcmp(a, "--repeat-last-n")) ok = args_int(argc, argv, i, 0, 1 << 16, &o->repeat_last_n);
    else if (!strcmp(a, "--pause-after")) ok = args_int(argc, argv, i, 1, 1 << 20, &o->pause_after);
    else if (!strcmp(a, "--json")) ok = (o->json = true);
    else if (!strcmp(a, "--stats")) ok = (o->stats = true);
    else return 0;
    return ok ? 1 : -1;
}

void gen_usage_common(FILE *f) {
    fprintf(f,
            "  -p PROMPT         the prompt (BOS is added)\n"
            "  -n N              tokens to generate (default 64; stops early at end-of-text)\n"
            "  --temp X          sampling temperature; 0 = greedy (default 0.8)\n"
            "  --top-k K         keep the K most likely tokens (default 40; 0 = off)\n"
            "  --top-p P         nucleus sampling threshold (default 0.95; 1 = off)\n"
            "  --seed S          sampler seed (default 42); the draw for a position depends only on\n"
            "                    the seed and the position, so runs with one seed give the same ids\n"
            "  --min-p P         drop tokens below P x the best one's probability (default 0 = off)\n"
            "  --repeat-penalty X  penalise ids of the last --repeat-last-n tokens (default 1 = off)\n"
            "  --presence-penalty X  subtract X from those ids' logits (default 0 = off)\n"
            "  --repeat-last-n N penalty window, prompt included (default 64)\n"
            "  --json            print {\"prompt_tokens\":[..],\"generated\":[..],\"text\":\"..\"} only\n"
            "  --stats           print one JSON line of timings to stderr at the end\n"
            "  --pause-after N   testing aid: after N tokens, say so on stderr and wait for a line on stdin\n");
}

/* Appends the text of id to a growing buffer. */
static bool piece_append(const tok_vocab *v, int32_t id, char **buf, size_t *len, size_t *cap) {
    char tmp[256];
    size_t n = 0;
    if (tok_piece(v, id, tmp, sizeof(tmp), &n) != KVS_OK) return true;
    if (n > sizeof(tmp)) n = sizeof(tmp);
    if (*len + n + 1 > *cap) {
        size_t nc = (*cap ? *cap * 2 : 256) + n;
        char *nb = realloc(*buf, nc);
        if (!nb) return false;
        *buf = nb;
        *cap = nc;
    }
    memcpy(*buf + *len, tmp, n);
    *len += n;
    (*buf)[*len] = 0;
    return true;
}

static void print_json(const int32_t *ids, int n_ids, const int32_t *gen, int n_out, const char *text) {
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
}

int gen_run(const gen_opts *o, const gen_target *t) {
    int rc = 1;
    size_t plen = strlen(o->prompt);
    int n_ids = 0, cap_ids = (int)plen + 2;
    int32_t *ids = malloc((size_t)cap_ids * sizeof(int32_t));
    int32_t *gen = malloc(((size_t)o->n_gen + 1) * sizeof(int32_t));
    int32_t *all = malloc(((size_t)cap_ids + (size_t)o->n_gen + 1) * sizeof(int32_t)); /* prompt + generated */
    float *logits = malloc((size_t)t->n_vocab * sizeof(float));
    char *text = NULL, msg[KVS_MSG_MAX] = "";
    size_t text_len = 0, text_cap = 0;
    sampler *smp = sampler_create(o->sp);
    if (!ids || !gen || !all || !logits || !smp) {
        fprintf(stderr, "kvshard %s: out of memory\n", t->cmd);
        goto out;
    }
    if (tok_encode(t->vocab, o->prompt, plen, true, ids, cap_ids, &n_ids) != KVS_OK) {
        fprintf(stderr, "kvshard %s: cannot tokenize the prompt\n", t->cmd);
        goto out;
    }
    if ((uint64_t)n_ids + (uint64_t)o->n_gen > t->max_ctx) {
        fprintf(stderr, "kvshard %s: prompt (%d tokens) + %ld new tokens exceed the context length %u\n", t->cmd,
                n_ids, o->n_gen, t->max_ctx);
        goto out;
    }
    if (!o->json) {
        fputs(o->prompt, stdout);
        fflush(stdout);
    }
    memcpy(all, ids, (size_t)n_ids * sizeof *all);
    const int32_t *step = ids;
    uint32_t step_n = (uint32_t)n_ids;
    int n_out = 0;
    uint64_t t_start = kvs_now_ns(), prefill_ns = 0, decode_ns = 0, max_step_ns = 0, resume_step_ns = 0;
    int decode_steps = 0;
    bool resumed = false;
    for (;;) {
        uint32_t n_all = (uint32_t)(n_ids + n_out), n_win = (uint32_t)o->repeat_last_n;
        if (n_win > n_all) n_win = n_all;
        gen_sample_req rq = {.sp = &o->sp, .pos = n_all, .window = all + (n_all - n_win), .n_window = n_win};
        sampler_result res;
        uint64_t t0 = kvs_now_ns();
        int err = t->sample ? t->sample(t->ctx, step, step_n, &rq, &res, msg, sizeof(msg))
                            : t->step(t->ctx, step, step_n, logits, msg, sizeof(msg));
        if (!err && !t->sample)
            err = kvs_fail(msg, sizeof(msg), sampler_pick(smp, logits, t->n_vocab, rq.pos, rq.window, rq.n_window, &res, 0),
                           "cannot sample");
        uint64_t dt = kvs_now_ns() - t0;
        if (err) {
            fprintf(stderr, "\nkvshard %s: forward failed: %s\n", t->cmd, msg[0] ? msg : kvs_strerror(err));
            goto out;
        }
        if (step == ids) prefill_ns = dt;
        else {
            decode_steps++;
            decode_ns += dt;
            if (dt > max_step_ns) max_step_ns = dt;
            if (resumed) {
                resume_step_ns = dt;
                resumed = false;
            }
        }
        if (n_out >= o->n_gen) break;
        int32_t id = res.id;
        if (id == tok_eos(t->vocab)) break;
        all[n_ids + n_out] = id;
        gen[n_out++] = id;
        size_t before = text_len;
        if (!piece_append(t->vocab, id, &text, &text_len, &text_cap)) {
            fprintf(stderr, "kvshard %s: out of memory\n", t->cmd);
            goto out;
        }
        if (!o->json && text) {
            fwrite(text + before, 1, text_len - before, stdout);
            fflush(stdout);
        }
        if (n_out >= o->n_gen) break;
        if (o->pause_after && n_out == o->pause_after) {
            fprintf(stderr, "kvshard %s: paused after %d tokens", t->cmd, n_out);
            if (t->session) t->session(t->ctx, stderr);
            fprintf(stderr, "\n");
            fflush(stderr);
            char line[16];
            if (!fgets(line, sizeof(line), stdin)) { /* EOF also resumes */ }
            resumed = true;
        }
        step = &gen[n_out - 1];
        step_n = 1;
    }
    if (o->json) print_json(ids, n_ids, gen, n_out, text);
    else putchar('\n');
    fflush(stdout);
    if (o->stats) {
        fprintf(stderr,
                "{\"prompt_tokens\":%d,\"generated\":%d,\"prefill_ms\":%.3f,\"decode_tok_s\":%.2f,\"max_step_ms\":%.3f,"
                "\"resume_step_ms\":%.3f,\"total_ms\":%.3f",
                n_ids, n_out, (double)prefill_ns / 1e6, decode_ns ? (double)decode_steps / ((double)decode_ns / 1e9) : 0.0,
                (double)max_step_ns / 1e6, (double)resume_step_ns / 1e6, (double)(kvs_now_ns() - t_start) / 1e6);
        if (t->describe) t->describe(t->ctx, stderr);
        fprintf(stderr, "}\n");
    }
    rc = 0;
out:
    sampler_free(smp);
    free(ids);
    free(gen);
    free(all);
    free(logits);
    free(text);
    return rc;
}
