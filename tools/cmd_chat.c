/* kvshard chat: a conversation with an instruct model in its own chat template, in one
 * process (-m) or over a route of shards (--route), streaming the reply as it comes.
 *
 * Each turn formats the whole conversation and feeds only what the session does not hold
 * yet: the formatted text minus the text already fed (prompt + replies + their
 * end-of-generation tokens), or, when the template rewrote an earlier reply (Llama 3 trims
 * contents), minus the conversation formatted up to the last reply — llama.cpp's rule. So
 * the session only grows, the same on one process and on a route. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "args.h"
#include "chat.h"
#include "cli.h"
#include "cluster_cli.h"
#include "engine.h"
#include "gen_loop.h"
#include "gguf.h"
#include "local_engine.h"
#include "quant.h"
#include "route.h"
#include "tokenizer.h"
#include "util.h"

static void chat_usage(FILE *f) {
    fprintf(f,
            "usage: kvshard chat (-m MODEL | --route HOST:PORT[,...] [-m MODEL]) [--chat-template NAME]\n"
            "                    [--system TEXT] [-p TEXT | --messages FILE.json [--format-only]] [-n N]\n"
            "                    [--temp X] [--top-k K] [--top-p P] [--seed S] [-c N] [-t THREADS]\n"
            "  interactive by default: each line on stdin is a user turn; the reply streams to stdout\n"
            "  -m MODEL          the GGUF model (with --route: only its tokenizer is read)\n"
            "  --route LIST      drive these shards instead (tokenizer from the head shard unless -m)\n"
            "  --spare LIST      replacement shards for --route\n"
            "  --cluster URL     instead of --route: plan the route from an etcd registry (--model NAME)\n"
            "  --chat-template NAME  override the file's template: %s\n"
            "  --system TEXT     a system message first\n"
            "  -p TEXT           one user turn, answered, then exit\n"
            "  --messages FILE   a JSON array [{\"role\":..,\"content\":..},...]: answer it, then exit\n"
            "  --format-only     print the formatted prompt of --messages (assistant turn opened), exit\n"
            "  -n N              reply tokens per turn at most (default 256)\n"
            "  --ctx N           older name of -c/--ctx-size\n"
            "  --timeout MS      --route: per-request deadline (default 30000)\n"
            "security (--route; docs/security.md):\n" ARGS_SECURITY_USAGE,
            chat_template_names());
}

typedef struct {
    chat_message *m;
    size_t n, cap;
} msg_list;

static bool msgs_add(msg_list *l, const char *role, const char *content) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 8;
        chat_message *m = realloc(l->m, cap * sizeof *m);
        if (!m) return false;
        l->m = m;
        l->cap = cap;
    }
    char *r = strdup(role), *c = strdup(content);
    if (!r || !c) {
        free(r);
        free(c);
        return false;
    }
    l->m[l->n++] = (chat_message){r, c};
    return true;
}

static void msgs_free(msg_list *l) {
    for (size_t i = 0; i < l->n; i++) {
        free((char *)l->m[i].role);
        free((char *)l->m[i].content);
    }
    free(l->m);
}

/* Reads [{"role":..,"content":..},...] from path into l. */
static int load_messages(const char *path, msg_list *l) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "kvshard chat: cannot open %s\n", path);
        return -1;
    }
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = sz >= 0 && sz < (64L << 20) ? malloc((size_t)sz + 1) : NULL;
    size_t got = buf ? fread(buf, 1, (size_t)sz, f) : 0;
    fclose(f);
    if (!buf || got != (size_t)sz) {
        free(buf);
        fprintf(stderr, "kvshard chat: cannot read %s\n", path);
        return -1;
    }
    buf[sz] = 0;
    cJSON *j = cJSON_Parse(buf);
    free(buf);
    int rc = 0;
    if (!cJSON_IsArray(j)) {
        fprintf(stderr, "kvshard chat: %s: not a JSON array of messages\n", path);
        rc = -1;
    }
    for (int i = 0; rc == 0 && i < cJSON_GetArraySize(j); i++) {
        const cJSON *m = cJSON_GetArrayItem(j, i);
        const char *role = cJSON_GetStringValue(cJSON_GetObjectItem(m, "role"));
        const char *content = cJSON_GetStringValue(cJSON_GetObjectItem(m, "content"));
        if (!role || !content) {
            fprintf(stderr, "kvshard chat: %s: message %d needs string \"role\" and \"content\"\n", path, i);
            rc = -1;
        } else if (!msgs_add(l, role, content)) {
            fprintf(stderr, "kvshard chat: out of memory\n");
            rc = -1;
        }
    }
    cJSON_Delete(j);
    return rc;
}

/* ---- the two session kinds ---- */

typedef struct {
    local_session local; /* -m: the engine's session (local_session_step's ctx) */
    route *r;            /* --route */
    route_session *s;
} chat_ctx;

static int route_step_fn(void *p, const int32_t *tokens, uint32_t n, float *logits, char *msg, size_t cap) {
    chat_ctx *c = p;
    return route_forward(c->r, c->s, tokens, n, logits, msg, cap);
}

static int open_vocab(const char *path, tok_vocab **out) {
    char msg[KVS_MSG_MAX] = "";
    gguf_ctx *g = NULL;
    int err = gguf_open(path, &g, msg, sizeof msg);
    if (err == KVS_OK) err = tok_from_gguf(g, out, msg, sizeof msg);
    gguf_close(g);
    if (err) fprintf(stderr, "kvshard chat: %s: %s\n", path, msg[0] ? msg : kvs_strerror(err));
    return err;
}

/* The template: --chat-template, else the file's, else ChatML (with a note). */
static int pick_template(const char *name, const tok_vocab *v, chat_template *t) {
    if (name) {
        if (chat_template_by_name(name, t) == KVS_OK) return 0;
        fprintf(stderr, "kvshard chat: unknown --chat-template '%s' (known: %s)\n", name, chat_template_names());
        return -1;
    }
    int err = chat_template_detect(tok_chat_template(v), t);
    if (err == KVS_ERR_NOT_FOUND) {
        fprintf(stderr, "kvshard chat: the file has no chat template; using chatml (--chat-template to choose)\n");
        return 0;
    }
    if (err) {
        fprintf(stderr, "kvshard chat: the file's chat template is not one this build knows; choose one with "
                        "--chat-template (%s)\n", chat_template_names());
        return -1;
    }
    return 0;
}

/* ---- Ctrl-C and the slash commands ---- */

/* SIGINTs since the prompt was last shown: one stops the reply (gen_opts.stop), one at the
 * prompt or a second during a reply ends the program (the session is released on the way out). */
static volatile sig_atomic_t g_interrupts;

static void on_sigint(int sig) {
    (void)sig;
    g_interrupts++;
}

/* SIGINT counts instead of killing; no SA_RESTART, so a read at the prompt returns. */
static void chat_on_interrupt(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;
    sigaction(SIGINT, &sa, NULL);
}

enum { CHAT_NOT_COMMAND = 0, CHAT_DONE, CHAT_EXIT };

/* Forgets the conversation: the messages but a system one, and the session's positions (the
 * next turn rewrites the session from position 0). */
static void chat_clear(msg_list *msgs, chat_ctx *c, char **fed, uint32_t *pos, int32_t *pending) {
    size_t keep = msgs->n > 0 && !strcmp(msgs->m[0].role, "system") ? 1 : 0;
    for (size_t i = keep; i < msgs->n; i++) {
        free((char *)msgs->m[i].role);
        free((char *)msgs->m[i].content);
    }
    msgs->n = keep;
    (*fed)[0] = 0;
    *pos = 0;
    *pending = -1;
    if (c->s) route_session_rewind(c->s, 0);
    c->local.req.start_pos = 0;
    c->local.req.n = 0;
}

/* A line starting with '/': /help, /clear, /system TEXT (a new conversation with that system
 * prompt), /exit. CHAT_DONE when handled, CHAT_EXIT for /exit. */
static int chat_command(const char *line, msg_list *msgs, chat_ctx *c, char **fed, uint32_t *pos, int32_t *pending) {
    if (!strcmp(line, "/exit") || !strcmp(line, "/quit")) return CHAT_EXIT;
    if (!strcmp(line, "/clear")) {
        chat_clear(msgs, c, fed, pos, pending);
        fputs("(conversation cleared)\n", stderr);
    } else if (!strncmp(line, "/system ", 8) && line[8]) {
        chat_clear(msgs, c, fed, pos, pending);
        if (msgs->n == 1) { /* replace the old system prompt */
            free((char *)msgs->m[0].content);
            msgs->m[0].content = strdup(line + 8);
            if (!msgs->m[0].content) msgs->n = 0;
        } else if (!msgs_add(msgs, "system", line + 8)) {
            fputs("kvshard chat: out of memory\n", stderr);
        }
        fputs("(new conversation with that system prompt)\n", stderr);
    } else {
        fputs("/help          this list\n"
              "/clear         forget the conversation (the system prompt stays)\n"
              "/system TEXT   start over with TEXT as the system prompt\n"
              "/exit          leave (also Ctrl-D, or Ctrl-C at the prompt)\n"
              "Ctrl-C during a reply stops it and returns to the prompt.\n",
              stderr);
    }
    return CHAT_DONE;
}

/* One assistant turn on msgs (design note at the top); appends the reply to msgs and
 * updates fed (the text the session holds). */
static int chat_turn(const gen_opts *o, const gen_target *t, chat_template tmpl, msg_list *msgs,
                     char **fed, uint32_t *pos, int32_t *pending, size_t n_before_user) {
    char msg[KVS_MSG_MAX] = "";
    char *full = NULL, *prev = NULL, *reply = NULL;
    int32_t *ids = NULL;
    int n = 0, rc = -1;
    if (chat_format(tmpl, msgs->m, msgs->n, true, &full, msg, sizeof msg) != KVS_OK) goto fail;
    const char *delta = full;
    size_t fl = strlen(*fed);
    if (fl > 0) {
        if (!strncmp(full, *fed, fl)) {
            delta = full + fl;
        } else {
            if (chat_format(tmpl, msgs->m, n_before_user, false, &prev, msg, sizeof msg) != KVS_OK) goto fail;
            size_t pl = strlen(prev);
            delta = !strncmp(full, prev, pl) ? full + pl : full;
        }
    }
    if (gen_tokenize(t->vocab, delta, *pos == 0 && tok_add_bos(t->vocab), true, &ids, &n) != KVS_OK) {
        snprintf(msg, sizeof msg, "cannot tokenize the conversation");
        goto fail;
    }
    if (gen_turn(o, t, ids, n, pos, pending, &reply, stdout, msg, sizeof msg) != KVS_OK) goto fail;
    putchar('\n');
    fflush(stdout);
    /* What the session now holds: the formatted text, the reply, and (fed next turn) its
     * end-of-generation token's text. */
    size_t need = strlen(full) + strlen(reply) + 4097; /* + a token text (<= 4096 bytes) */
    char *nf = malloc(need);
    if (!nf || !msgs_add(msgs, "assistant", reply)) {
        free(nf);
        snprintf(msg, sizeof msg, "out of memory");
        goto fail;
    }
    size_t at = (size_t)snprintf(nf, need, "%s%s", full, reply), pl = 0;
    if (*pending >= 0 && tok_is_eog(t->vocab, *pending)) {
        tok_piece_ex(t->vocab, *pending, true, nf + at, need - at - 1, &pl);
        at += pl < need - at - 1 ? pl : need - at - 1;
    }
    nf[at] = 0;
    free(*fed);
    *fed = nf;
    rc = 0;
fail:
    if (rc) fprintf(stderr, "kvshard chat: %s\n", msg[0] ? msg : "failed");
    free(full);
    free(prev);
    free(reply);
    free(ids);
    return rc;
}

int cmd_chat(int argc, char **argv) {
    const char *path = NULL, *route_spec = NULL, *spare_spec = NULL, *tmpl_name = NULL, *system = NULL;
    const char *messages = NULL;
    bool format_only = false;
    long threads = 0, timeout_ms = 30000;
    uint32_t kv_type = QUANT_F16;
    gen_opts o;
    gen_opts_default(&o);
    o.n_gen = 256;
    args_security sec = {0};
    cluster_cli_opts cl = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool ok = true;
        int so = args_security_opt(argc, argv, &i, &sec);
        if (so == 0) so = cluster_cli_opt("chat", argc, argv, &i, &cl);
        if (so < 0) return 2;
        if (so > 0) continue;
        int g = gen_parse_opt(&o, argc, argv, &i);
        if (g < 0) return 2;
        if (g > 0) continue;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { chat_usage(stdout); return 0; }
        else if (!strcmp(a, "-m")) ok = args_str(argc, argv, &i, &path);
        else if (!strcmp(a, "--route")) ok = args_str(argc, argv, &i, &route_spec);
        else if (!strcmp(a, "--spare")) ok = args_str(argc, argv, &i, &spare_spec);
        else if (!strcmp(a, "--chat-template")) ok = args_str(argc, argv, &i, &tmpl_name);
        else if (!strcmp(a, "--system")) ok = args_str(argc, argv, &i, &system);
        else if (!strcmp(a, "--messages")) ok = args_str(argc, argv, &i, &messages);
        else if (!strcmp(a, "--format-only")) format_only = true;
        else if (!strcmp(a, "-t")) ok = args_int(argc, argv, &i, 1, 1024, &threads);
        else if (!strcmp(a, "--ctx")) ok = args_int(argc, argv, &i, 16, 1 << 24, &o.n_ctx); /* older name */
        else if (!strcmp(a, "--timeout")) ok = args_int(argc, argv, &i, 1, 24L * 3600 * 1000, &timeout_ms);
        else if (!strcmp(a, "--kv-type")) ok = args_kv_type(argc, argv, &i, &kv_type);
        else { fprintf(stderr, "kvshard chat: unknown option '%s'\n", a); chat_usage(stderr); return 2; }
        if (!ok) return 2;
    }
    if (!path && !route_spec && !cl.url) {
        fprintf(stderr, "kvshard chat: -m MODEL or --route is required\n");
        chat_usage(stderr);
        return 2;
    }
    if (!args_security_check("chat", &sec)) return 2;
    if ((format_only && !messages) || (messages && o.prompt) || o.json) {
        fprintf(stderr, "kvshard chat: --format-only needs --messages; -p and --messages exclude each other; "
                        "--json is not a chat option\n");
        return 2;
    }
    msg_list msgs = {0};
    if (system && !msgs_add(&msgs, "system", system)) return 1;
    if (messages && load_messages(messages, &msgs)) {
        msgs_free(&msgs);
        return 1;
    }
    int rc = 1;
    char msg[KVS_MSG_MAX] = "";
    tok_vocab *own_vocab = NULL;
    const tok_vocab *vocab = NULL;
    chat_template tmpl = CHAT_TEMPLATE_CHATML;
    chat_ctx c = {.local.req = {.epoch = 1, .out_mode = FWD_OUT_LOGITS_LAST}};
    memcpy(c.local.req.sid.bytes, "kvshard-chat-ses", 16);
    gen_target t = {.cmd = "chat", .backend.ctx = &c};
    char *fed = calloc(1, 1);

    if (format_only) { /* the tokenizer alone */
        if (open_vocab(path, &own_vocab)) goto out;
        if (pick_template(tmpl_name, own_vocab, &tmpl)) goto out;
        char *s = NULL;
        if (chat_format(tmpl, msgs.m, msgs.n, true, &s, msg, sizeof msg) != KVS_OK) {
            fprintf(stderr, "kvshard chat: %s\n", msg);
            goto out;
        }
        gen_write_utf8(stdout, s, strlen(s));
        free(s);
        rc = 0;
        goto out;
    }
    if (route_spec || cl.url) {
        route_params rp = route_default_params();
        rp.timeout_ms = timeout_ms;
        char *token = NULL;
        if (!args_security_route("chat", &sec, &rp, &token)) goto out;
        int err = cl.url ? cluster_cli_route_open("chat", &cl, &rp, &c.r)
                         : route_open(route_spec, spare_spec, &rp, &c.r, msg, sizeof msg);
        free(token);
        if (!err) {
            if (path) err = open_vocab(path, &own_vocab) ? KVS_ERR_FORMAT : KVS_OK;
            else err = route_fetch_vocab(c.r, &own_vocab, msg, sizeof msg);
        }
        route_info ri = {0};
        if (!err) route_get_info(c.r, &ri);
        if (!err && (uint32_t)tok_n_vocab(own_vocab) != ri.n_vocab) {
            snprintf(msg, sizeof msg, "the tokenizer has %d tokens but the route's model has %u",
                     (int)tok_n_vocab(own_vocab), ri.n_vocab);
            err = KVS_ERR_FORMAT;
        }
        if (!err) err = route_session_open(c.r, &c.s, msg, sizeof msg);
        if (err) {
            if (msg[0]) fprintf(stderr, "kvshard chat: %s\n", msg);
            goto out;
        }
        vocab = own_vocab;
        t.backend.forward = route_step_fn;
        t.n_vocab = (int32_t)ri.n_vocab;
        t.max_ctx = o.n_ctx && (uint32_t)o.n_ctx < ri.max_ctx ? (uint32_t)o.n_ctx : ri.max_ctx;
        t.ctx_hint = "the shards' --ctx-size and --kv-budget set the route's context";
    } else {
        engine *e = NULL;
        if (local_engine_open("kvshard chat", path, (int)threads, kv_type, (uint32_t)o.n_ctx, &e)) goto out;
        c.local.e = e;
        if (!e->vocab) {
            local_engine_say_no_vocab("chat", path, e);
            goto out;
        }
        vocab = e->vocab;
        t.backend.forward = local_session_step;
        t.backend.ctx = &c.local;
        t.n_vocab = (int32_t)e->m->hp.n_vocab;
        t.max_ctx = local_engine_ctx(e);
        if (o.n_ctx && (uint32_t)o.n_ctx > t.max_ctx) {
            fprintf(stderr, "kvshard chat: -c/--ctx-size %ld is more than the model's context length %u\n", o.n_ctx,
                    t.max_ctx);
            goto out;
        }
    }
    t.vocab = vocab;
    if (pick_template(tmpl_name, vocab, &tmpl)) goto out;
    uint32_t pos = 0;
    int32_t pending = -1;
    if (messages || o.prompt) { /* one turn, then exit */
        if (o.prompt && !msgs_add(&msgs, "user", o.prompt)) goto out;
        rc = chat_turn(&o, &t, tmpl, &msgs, &fed, &pos, &pending, msgs.n ? msgs.n - 1 : 0) ? 1 : 0;
        goto out;
    }
    bool tty = isatty(STDIN_FILENO);
    char *line = NULL;
    size_t line_cap = 0;
    chat_on_interrupt();
    o.stop = &g_interrupts;
    if (tty) fputs("kvshard chat: /help for commands; Ctrl-C stops a reply, at the prompt it exits\n", stderr);
    for (;;) {
        g_interrupts = 0;
        if (tty) {
            fputs("> ", stderr);
            fflush(stderr);
        }
        clearerr(stdin); /* a Ctrl-C that cut a read during the reply left its error flag */
        ssize_t k = tty && !gen_wait_input(&g_interrupts) ? -1 : getline(&line, &line_cap, stdin);
        if (k < 0 && g_interrupts) fputc('\n', stderr); /* Ctrl-C at the prompt: exit */
        if (k < 0) break;
        while (k > 0 && (line[k - 1] == '\n' || line[k - 1] == '\r')) line[--k] = 0;
        if (k == 0) continue;
        int cmd = line[0] == '/' ? chat_command(line, &msgs, &c, &fed, &pos, &pending) : CHAT_NOT_COMMAND;
        if (cmd == CHAT_EXIT) break;
        if (cmd != CHAT_NOT_COMMAND) continue;
        size_t before = msgs.n;
        if (!msgs_add(&msgs, "user", line)) break;
        if (chat_turn(&o, &t, tmpl, &msgs, &fed, &pos, &pending, before)) {
            free(line);
            goto out;
        }
        if (g_interrupts > 1) break; /* a second Ctrl-C while the reply stopped: exit */
        if (g_interrupts) fputs("[stopped]\n", stderr);
    }
    free(line);
    rc = 0;
out:
    if (c.r) {
        route_release(c.r, c.s);
        route_close(c.r);
    }
    engine_close(c.local.e);
    tok_free(own_vocab);
    msgs_free(&msgs);
    free(fed);
    return rc;
}
