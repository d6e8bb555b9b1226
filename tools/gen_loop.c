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
    else if (!strcmp(a, "--plain")) ok = (o->plain = true);
    else return 0;
    return ok ? 1 : -1;
}

void gen_usage_common(FILE *f) {
    fprintf(f,
            "  -p PROMPT         the prompt (BOS added as the file says; special-token text such as\n"
            "                    <|eot_id|> is read as that token)\n"
            "  --plain           read special-token text in the prompt as plain text\n"
            "  -n N              tokens to generate (default 64; stops early at end-of-generation)\n"
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

/* The text of a generation: pieces appended raw; printed up to the last complete
 * character (design of gen_loop.h). */
typedef struct {
    char *buf;
    size_t len, cap, printed;
    FILE *out; /* NULL: not streamed */
} gen_text;

static bool text_append(gen_text *t, const tok_vocab *v, int32_t id) {
    size_t n = 0;
    if (tok_piece(v, id, NULL, 0, &n) != KVS_OK) return true;
    if (t->len + n + 1 > t->cap) {
        size_t nc = (t->cap ? t->cap * 2 : 256) + n;
        char *nb = realloc(t->buf, nc);
        if (!nb) return false;
        t->buf = nb;
        t->cap = nc;
    }
    size_t got = 0;
    tok_piece(v, id, t->buf + t->len, n, &got);
    t->len += n;
    t->buf[t->len] = 0;
    return true;
}

void gen_write_utf8(FILE *f, const char *s, size_t n) {
    char *r = NULL;
    size_t rl = 0;
    if (tok_utf8_repair(s, n, &r, &rl) == KVS_OK) fwrite(r, 1, rl, f);
    free(r);
}

/* Streams what is complete (final: everything, a cut character as U+FFFD). */
static void text_flush(gen_text *t, bool final) {
    if (!t->out) return;
    size_t upto = final ? t->len : t->printed + tok_utf8_complete_len(t->buf + t->printed, t->len - t->printed);
    if (upto > t->printed) {
        gen_write_utf8(t->out, t->buf + t->printed, upto - t->printed);
        fflush(t->out);
    }
    t->printed = upto;
}

int gen_tokenize(const tok_vocab *v, const char *text, bool add_bos, bool plain, int32_t **ids, int *n) {
    *ids = NULL;
    *n = 0;
    size_t len = strlen(text);
    int need = 0;
    int err = tok_encode_ex(v, text, len, add_bos, !plain, NULL, 0, &need);
    if (err != KVS_OK && err != KVS_ERR_TOO_LARGE) return err;
    int32_t *buf = malloc(((size_t)need + 1) * sizeof *buf);
    if (!buf) return KVS_ERR_NOMEM;
    if ((err = tok_encode_ex(v, text, len, add_bos, !plain, buf, need + 1, n)) != KVS_OK) {
        free(buf);
        return err;
    }
    *ids = buf;
    return KVS_OK;
}

static void print_json(const int32_t *ids, int n_ids, const int32_t *gen, int n_out, const char *text, size_t len) {
    cJSON *o = cJSON_CreateObject();
    cJSON *pt = cJSON_AddArrayToObject(o, "prompt_tokens");
    for (int i = 0; i < n_ids; i++) cJSON_AddItemToArray(pt, cJSON_CreateNumber(ids[i]));
    cJSON *g = cJSON_AddArrayToObject(o, "generated");
    for (int i = 0; i < n_out; i++) cJSON_AddItemToArray(g, cJSON_CreateNumber(gen[i]));
    char *valid = NULL;
    size_t vl = 0;
    tok_utf8_repair(text ? text : "", text ? len : 0, &valid, &vl);
    cJSON_AddStringToObject(o, "text", valid ? valid : "");
    free(valid);
    char *s = cJSON_PrintUnformatted(o);
    if (s) puts(s);
    free(s);
    cJSON_Delete(o);
}

/* The --pause-after line: the command, the count and what the target says of its session. */
static void pause_line(FILE *f, const gen_target *t, int n_out) {
    fprintf(f, "kvshard %s: paused after %d tokens", t->cmd, n_out);
    if (t->session) t->session(t->ctx, f);
    fputc('\n', f);
}

int gen_run(const gen_opts *o, const gen_target *t) {
    int rc = 1;
    int n_ids = 0;
    int32_t *ids = NULL;
    int32_t *gen = malloc(((size_t)o->n_gen + 1) * sizeof(int32_t));
    int32_t *all = NULL; /* (n_ids + n_gen) prompt + generated: the penalty window's source */
    float *logits = malloc((size_t)t->n_vocab * sizeof(float));
    char msg[KVS_MSG_MAX] = "";
    gen_text text = {.out = o->json ? NULL : stdout};
    sampler *smp = sampler_create(o->sp);
    if (!gen || !logits || !smp) {
        fprintf(stderr, "kvshard %s: out of memory\n", t->cmd);
        goto out;
    }
    if (gen_tokenize(t->vocab, o->prompt, tok_add_bos(t->vocab), o->plain, &ids, &n_ids) != KVS_OK) {
        fprintf(stderr, "kvshard %s: cannot tokenize the prompt\n", t->cmd);
        goto out;
    }
    if (n_ids == 0) {
        fprintf(stderr, "kvshard %s: the prompt has no tokens\n", t->cmd);
        goto out;
    }
    if ((uint64_t)n_ids + (uint64_t)o->n_gen > t->max_ctx) {
        fprintf(stderr, "kvshard %s: prompt (%d tokens) + %ld new tokens exceed the context length %u\n", t->cmd,
                n_ids, o->n_gen, t->max_ctx);
        goto out;
    }
    if (!o->json) {
        gen_write_utf8(stdout, o->prompt, strlen(o->prompt));
        fflush(stdout);
    }
    all = malloc(((size_t)n_ids + (size_t)o->n_gen + 1) * sizeof *all);
    if (!all) {
        fprintf(stderr, "kvshard %s: out of memory\n", t->cmd);
        goto out;
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
        if (tok_is_eog(t->vocab, id)) break;
        all[n_ids + n_out] = id;
        gen[n_out++] = id;
        if (!text_append(&text, t->vocab, id)) {
            fprintf(stderr, "kvshard %s: out of memory\n", t->cmd);
            goto out;
        }
        text_flush(&text, false);
        if (n_out >= o->n_gen) break;
        if (o->pause_after && n_out == o->pause_after) {
            /* The line is made whole first and written at once: a reader of the log never sees
             * it without its session id. */
            char *line_buf = NULL;
            size_t line_len = 0;
            FILE *ls = open_memstream(&line_buf, &line_len);
            if (ls) pause_line(ls, t, n_out);
            if (ls && fclose(ls) == 0) fwrite(line_buf, 1, line_len, stderr);
            else pause_line(stderr, t, n_out); /* no memory for the stream: written piece by piece */
            free(line_buf);
            fflush(stderr);
            char line[16];
            if (!fgets(line, sizeof(line), stdin)) { /* EOF also resumes */ }
            resumed = true;
        }
        step = &gen[n_out - 1];
        step_n = 1;
    }
    text_flush(&text, true);
    if (o->json) print_json(ids, n_ids, gen, n_out, text.buf, text.len);
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
    free(text.buf);
    return rc;
}

int gen_turn(const gen_opts *o, const gen_target *t, sampler *smp, const int32_t *ids, int n, uint32_t *pos,
             int32_t *pending, char **reply, FILE *out, char *msg, size_t msg_cap) {
    *reply = NULL;
    int32_t held = *pending;
    *pending = -1;
    size_t n_feed = (size_t)n + (held >= 0);
    if (n_feed == 0) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "nothing to feed");
    if ((uint64_t)*pos + n_feed + 1 > t->max_ctx)
        return kvs_fail(msg, msg_cap, KVS_ERR_CONTEXT_FULL, "the conversation (%u + %zu tokens) fills the context of %u",
                        *pos, n_feed, t->max_ctx);
    /* feed, then this turn's generated ids: the penalty window's source */
    int32_t *feed = malloc((n_feed + (size_t)o->n_gen + 1) * sizeof *feed);
    float *logits = malloc((size_t)t->n_vocab * sizeof(float));
    gen_text text = {.out = out};
    int err = KVS_OK;
    size_t n_hist = n_feed;
    if (!feed || !logits) {
        err = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
        goto done;
    }
    if (held >= 0) feed[0] = held;
    memcpy(feed + (held >= 0), ids, (size_t)n * sizeof *ids);
    if ((err = t->step(t->ctx, feed, (uint32_t)n_feed, logits, msg, msg_cap)) != KVS_OK) goto done;
    *pos += (uint32_t)n_feed;
    for (long k = 0; k < o->n_gen; k++) {
        /* the draw for a position is a pure function of seed and position, as in gen_run */
        uint32_t n_win = (uint32_t)o->repeat_last_n < n_hist ? (uint32_t)o->repeat_last_n : (uint32_t)n_hist;
        sampler_result res;
        if ((err = sampler_pick(smp, logits, t->n_vocab, *pos, feed + (n_hist - n_win), n_win, &res, 0)) != KVS_OK) {
            err = kvs_fail(msg, msg_cap, err, "cannot sample");
            goto done;
        }
        int32_t id = res.id;
        feed[n_hist++] = id;
        if (tok_is_eog(t->vocab, id)) {
            *pending = id;
            break;
        }
        if (!text_append(&text, t->vocab, id)) {
            err = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
            goto done;
        }
        text_flush(&text, false);
        if (k + 1 == o->n_gen || *pos + 2 > t->max_ctx) { /* keep it for the next turn */
            *pending = id;
            break;
        }
        if ((err = t->step(t->ctx, &id, 1, logits, msg, msg_cap)) != KVS_OK) goto done;
        *pos += 1;
    }
    text_flush(&text, true);
    *reply = text.buf ? text.buf : calloc(1, 1);
    text.buf = NULL;
    if (!*reply) err = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
done:
    free(text.buf);
    free(feed);
    free(logits);
    return err;
}
