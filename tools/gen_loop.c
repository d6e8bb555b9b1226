#include "gen_loop.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "args.h"
#include "util.h"

/* A fresh seed for a run without --seed, so that two runs differ as a "regenerate" expects. 32
 * bits: the JSON that reports it holds it exactly and a user can type it back. */
static uint64_t random_seed(void) {
    uint32_t v = 0;
    if (getrandom(&v, sizeof v, 0) != (ssize_t)sizeof v) v = (uint32_t)(kvs_now_ns() ^ ((uint64_t)getpid() << 16));
    return v;
}

void gen_opts_default(gen_opts *o) {
    memset(o, 0, sizeof(*o));
    o->n_gen = 64;
    o->sp = sampler_default_params();
    o->sp.seed = random_seed();
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
    else if (!strcmp(a, "-c") || !strcmp(a, "--ctx-size")) ok = args_int(argc, argv, i, 16, 1 << 24, &o->n_ctx);
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
            "  --seed S          sampler seed (default: a random one, printed by --json and --stats);\n"
            "                    the draw for a position depends only on the seed and the position, so\n"
            "                    runs with one seed give the same ids\n"
            "  --min-p P         drop tokens below P x the best one's probability (default 0 = off)\n"
            "  --repeat-penalty X  penalise ids of the last --repeat-last-n tokens (default 1 = off)\n"
            "  --presence-penalty X  subtract X from those ids' logits (default 0 = off)\n"
            "  --repeat-last-n N penalty window, prompt included (default 64)\n"
            "  -c, --ctx-size N  context positions (default: the model's context length, as far as the KV\n"
            "                    budget holds it)\n"
            "  --json            print {\"prompt_tokens\":[..],\"generated\":[..],\"text\":\"..\"} only\n"
            "  --stats           print one JSON line of timings to stderr at the end\n"
            "  --pause-after N   testing aid: after N tokens, say so on stderr and wait for a line on stdin\n");
}

void gen_write_utf8(FILE *f, const char *s, size_t n) {
    char *r = NULL;
    size_t rl = 0;
    if (tok_utf8_repair(s, n, &r, &rl) == KVS_OK) fwrite(r, 1, rl, f);
    free(r);
}

/* Writes the text that may leave now (gen_ready) past *sent to out (NULL: nothing). */
static void stream_text(FILE *out, const gen_state *g, size_t *sent) {
    if (!out) return;
    size_t upto = gen_ready(g, *sent);
    if (upto > *sent) {
        gen_write_utf8(out, g->text + *sent, upto - *sent);
        fflush(out);
    }
    *sent = upto;
}

static void print_json(const int32_t *ids, int n_ids, const int32_t *gen, int n_out, const char *text, size_t len,
                       uint64_t seed) {
    cJSON *o = cJSON_CreateObject();
    cJSON *pt = cJSON_AddArrayToObject(o, "prompt_tokens");
    for (int i = 0; i < n_ids; i++) cJSON_AddItemToArray(pt, cJSON_CreateNumber(ids[i]));
    cJSON *g = cJSON_AddArrayToObject(o, "generated");
    for (int i = 0; i < n_out; i++) cJSON_AddItemToArray(g, cJSON_CreateNumber(gen[i]));
    char *valid = NULL;
    size_t vl = 0;
    tok_utf8_repair(text ? text : "", text ? len : 0, &valid, &vl);
    cJSON_AddStringToObject(o, "text", valid ? valid : "");
    cJSON_AddNumberToObject(o, "seed", (double)seed);
    free(valid);
    char *s = cJSON_PrintUnformatted(o);
    if (s) puts(s);
    free(s);
    cJSON_Delete(o);
}

/* The --pause-after line: the command, the count and what the target says of its session. */
static void pause_line(FILE *f, const gen_target *t, int n_out) {
    fprintf(f, "kvshard %s: paused after %d tokens", t->cmd, n_out);
    if (t->session) t->session(t->backend.ctx, f);
    fputc('\n', f);
}

bool gen_wait_input(volatile sig_atomic_t *stop) {
    if (!stop || !isatty(STDIN_FILENO)) return true;
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGINT);
    sigaddset(&block, SIGTERM);
    sigprocmask(SIG_BLOCK, &block, &old);
    bool ready = false;
    while (!ready && *stop <= 0) {
        struct pollfd pf = {.fd = STDIN_FILENO, .events = POLLIN};
        int r = ppoll(&pf, 1, NULL, &old); /* the signals are let in only while it waits */
        ready = r > 0 || (r < 0 && errno != EINTR); /* an error: the read reports it */
    }
    sigprocmask(SIG_SETMASK, &old, NULL);
    return ready;
}

/* --pause-after: says so on stderr, then waits for a line (or EOF) on stdin, or for *stop. */
static void pause_for_line(const gen_target *t, int n_out, volatile sig_atomic_t *stop) {
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
    if (gen_wait_input(stop) && !fgets(line, sizeof(line), stdin)) { /* EOF also resumes */ }
}

/* Step times of one gen_run, for --stats. */
typedef struct {
    uint64_t start_ns, prefill_ns, decode_ns, max_step_ns, resume_step_ns;
    int decode_steps;
} gen_times;

static void print_stats(const gen_target *t, const gen_times *tm, int n_ids, int n_out, uint64_t seed) {
    fprintf(stderr,
            "{\"seed\":%llu,\"prompt_tokens\":%d,\"generated\":%d,\"prefill_ms\":%.3f,\"decode_tok_s\":%.2f,\"max_step_ms\":%.3f,"
            "\"resume_step_ms\":%.3f,\"total_ms\":%.3f",
            (unsigned long long)seed, n_ids, n_out, (double)tm->prefill_ns / 1e6,
            tm->decode_ns ? (double)tm->decode_steps / ((double)tm->decode_ns / 1e9) : 0.0,
            (double)tm->max_step_ns / 1e6, (double)tm->resume_step_ns / 1e6,
            (double)(kvs_now_ns() - tm->start_ns) / 1e6);
    if (t->describe) t->describe(t->backend.ctx, stderr);
    fprintf(stderr, "}\n");
}

/* Tokenizes the prompt and checks it against the context; messages name the command. */
static bool prompt_ids(const gen_opts *o, const gen_target *t, int32_t **ids, int *n_ids) {
    if (gen_tokenize(t->vocab, o->prompt, tok_add_bos(t->vocab), !o->plain, ids, n_ids) != KVS_OK) {
        fprintf(stderr, "kvshard %s: cannot tokenize the prompt\n", t->cmd);
        return false;
    }
    if (*n_ids == 0) {
        fprintf(stderr, "kvshard %s: the prompt has no tokens\n", t->cmd);
        return false;
    }
    if ((uint64_t)*n_ids + (uint64_t)o->n_gen > t->max_ctx) {
        fprintf(stderr, "kvshard %s: prompt (%d tokens) + %ld new tokens exceed the context of %u positions (%s)\n",
                t->cmd, *n_ids, o->n_gen, t->max_ctx, t->ctx_hint ? t->ctx_hint : "raise -c/--ctx-size");
        return false;
    }
    return true;
}

static gen_params target_params(const gen_opts *o, const gen_target *t, uint32_t max_gen, uint32_t pos0) {
    return (gen_params){.vocab = t->vocab, .n_vocab = t->n_vocab, .sp = o->sp, .max_gen = max_gen,
                        .repeat_last_n = (uint32_t)o->repeat_last_n, .pos0 = pos0};
}

int gen_run(const gen_opts *o, const gen_target *t) {
    int rc = 1, n_ids = 0;
    int32_t *ids = NULL;
    char msg[KVS_MSG_MAX] = "";
    gen_state g = {0};
    if (!prompt_ids(o, t, &ids, &n_ids)) goto out;
    if (!o->json) {
        gen_write_utf8(stdout, o->prompt, strlen(o->prompt));
        fflush(stdout);
    }
    gen_params p = target_params(o, t, (uint32_t)o->n_gen, 0);
    if (gen_begin(&g, &t->backend, &p, ids, (uint32_t)n_ids, msg, sizeof msg) != KVS_OK) {
        fprintf(stderr, "kvshard %s: %s\n", t->cmd, msg);
        goto out;
    }
    FILE *out = o->json ? NULL : stdout;
    size_t sent = 0;
    gen_times tm = {.start_ns = kvs_now_ns()};
    bool resumed = false;
    for (bool first = true;; first = false) {
        uint32_t n_before = g.n_gen;
        uint64_t t0 = kvs_now_ns();
        int err = gen_step(&g, msg, sizeof msg);
        uint64_t dt = kvs_now_ns() - t0;
        if (err == KVS_ERR_NOMEM && g.n_gen > n_before) { /* the text, not the step */
            fprintf(stderr, "kvshard %s: out of memory\n", t->cmd);
            goto out;
        }
        if (err) {
            fprintf(stderr, "\nkvshard %s: forward failed: %s\n", t->cmd, msg[0] ? msg : kvs_strerror(err));
            goto out;
        }
        if (first) tm.prefill_ns = dt;
        else {
            tm.decode_steps++;
            tm.decode_ns += dt;
            if (dt > tm.max_step_ns) tm.max_step_ns = dt;
            if (resumed) {
                tm.resume_step_ns = dt;
                resumed = false;
            }
        }
        if (g.n_gen > n_before) stream_text(out, &g, &sent);
        if (g.finish != GEN_RUNNING) break;
        if (o->stop && *o->stop > 0) { /* Ctrl-C: end here; the caller releases the session */
            fprintf(stderr, "\nkvshard %s: interrupted\n", t->cmd);
            goto out;
        }
        if (o->pause_after && g.n_gen == (uint32_t)o->pause_after) {
            pause_for_line(t, (int)g.n_gen, o->stop);
            resumed = true;
        }
    }
    stream_text(out, &g, &sent);
    if (o->json) print_json(ids, n_ids, g.ids + g.n_prompt, (int)g.n_gen, g.text, g.text_len, o->sp.seed);
    else putchar('\n');
    fflush(stdout);
    if (o->stats) print_stats(t, &tm, n_ids, (int)g.n_gen, o->sp.seed);
    rc = 0;
out:
    gen_end(&g);
    free(ids);
    return rc;
}

int gen_turn(const gen_opts *o, const gen_target *t, const int32_t *ids, int n, uint32_t *pos, int32_t *pending,
             char **reply, FILE *out, char *msg, size_t msg_cap) {
    *reply = NULL;
    int32_t held = *pending;
    *pending = -1;
    size_t n_feed = (size_t)n + (held >= 0);
    if (n_feed == 0) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "nothing to feed");
    if ((uint64_t)*pos + n_feed + 1 > t->max_ctx)
        return kvs_fail(msg, msg_cap, KVS_ERR_CONTEXT_FULL,
                        "the conversation (%u + %zu tokens) fills the context of %u positions (%s)", *pos, n_feed,
                        t->max_ctx, t->ctx_hint ? t->ctx_hint : "raise -c/--ctx-size");
    int32_t *feed = malloc(n_feed * sizeof *feed);
    if (!feed) return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
    if (held >= 0) feed[0] = held;
    memcpy(feed + (held >= 0), ids, (size_t)n * sizeof *ids);
    /* The turn stops where the next one could no longer feed its pending id and draw. */
    uint32_t room = t->max_ctx - *pos - (uint32_t)n_feed;
    uint32_t max_gen = (uint64_t)o->n_gen < room ? (uint32_t)o->n_gen : room;
    gen_params p = target_params(o, t, max_gen, *pos);
    gen_state g;
    size_t sent = 0;
    int err = gen_begin(&g, &t->backend, &p, feed, (uint32_t)n_feed, msg, msg_cap);
    free(feed);
    uint32_t pos0 = *pos;
    while (err == KVS_OK && g.finish == GEN_RUNNING && !(o->stop && *o->stop > 0)) {
        uint32_t n_before = g.n_gen;
        err = gen_step(&g, msg, msg_cap);
        *pos = pos0 + g.n_fed;
        if (err == KVS_OK && g.n_gen > n_before) stream_text(out, &g, &sent);
        if (err == KVS_OK && o->pause_after && g.n_gen == (uint32_t)o->pause_after && g.n_gen > n_before &&
            g.finish == GEN_RUNNING)
            pause_for_line(t, (int)g.n_gen, o->stop); /* testing aid: a Ctrl-C can land mid-reply */
    }
    if (err == KVS_OK) {
        stream_text(out, &g, &sent);
        /* the last id drawn is not fed: the next turn feeds it first */
        if (g.finish == GEN_FINISH_EOG) *pending = g.last.id;
        else if (g.n_gen > 0) *pending = g.ids[g.n_ids - 1];
        *reply = g.text ? g.text : calloc(1, 1);
        g.text = NULL;
        if (!*reply) err = kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
    }
    gen_end(&g);
    return err;
}
