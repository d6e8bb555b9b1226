/* kvshard generate: drive a route of shards (no weights here). The generation loop is the one
 * `kvshard run` uses (gen.h, through gen_loop.c), so for the same prompt, model and sampling the ids and text
 * match. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "cluster_cli.h"
#include "gen_loop.h"
#include "gguf.h"
#include "route.h"
#include "tokenizer.h"
#include "util.h"

static void generate_usage(FILE *f) {
    fprintf(f,
            "usage: kvshard generate --route HOST:PORT[,HOST:PORT...] -p PROMPT [-n N] [--temp X]\n"
            "                        [--top-k K] [--top-p P] [--seed S] [--spare HOST:PORT[,...]]\n"
            "                        [-m MODEL] [--json] [--stats] [--timeout MS] [-v] [--keep-session]\n"
            "                        [--logits] [--no-relay] [--wire-dtype f32|f16|bf16]\n"
            "                        [--hidden f32|f16|bf16] [--replay-cap SIZE] [--reconnect-grace MS]\n"
            "  --route LIST      the shards in layer order; together they must cover every layer\n"
            "  --cluster URL     instead of --route/--spare: plan the route from an etcd registry\n"
            "  --model NAME|DIGEST  with --cluster: the model (default: the only one registered)\n"
            "  --spare LIST      replacement shards, used when a hop fails (same model, same layers)\n"
            "  -m MODEL          read the tokenizer from this GGUF (default: from the head shard)\n"
            "  --timeout MS      connect / reply deadline per request (default 30000)\n"
            "  --hidden T        dtype of hidden states between shards and in replay memory: f32\n"
            "                    (default, output equal to kvshard run), f16 or bf16 (half the bytes;\n"
            "                    bf16 needs protocol v2 shards)\n"
            "  --replay-cap SIZE replay memory per session, bytes with K/M/G (default 256M); the\n"
            "                    context is limited to what fits\n"
            "  --reconnect-grace MS  a lost hop is called again at its address for this long before\n"
            "                    a spare takes its place (default 3000; 0: fail over at once): a shard\n"
            "                    restarted with serve --state-dir goes on with its sessions, no replay\n"
            "  -v                log re-routes and replays to stderr\n"
            "  --logits          the tail shard answers full logits and this client samples (default:\n"
            "                    the tail samples and answers the token; the same ids either way)\n"
            "  --no-relay        drive every hop from this client (2n transfers per step) instead of\n"
            "                    shard-to-shard relay (n+1); the same ids either way\n"
            "  --wire-dtype T    hidden states on the wire, relayed or not: f32 (default, bit-exact), f16\n"
            "                    or bf16 (the same as --hidden)\n"
            "  --keep-session    testing aid: do not release the session on the shards at the end\n"
            "  -t THREADS        accepted and ignored (the shards compute)\n"
            ARGS_SECURITY_USAGE);
    gen_usage_common(f);
}

static void log_stderr(void *user, const char *line) {
    (void)user;
    fprintf(stderr, "kvshard generate: %s\n", line);
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

typedef struct {
    route *r;
    route_session *s;
    route_step_opts o;
} gen_route_ctx;

static int gen_route_step(void *p, const int32_t *tokens, uint32_t n, float *logits, char *msg, size_t cap) {
    gen_route_ctx *c = p;
    c->o.sample = false;
    return route_step(c->r, c->s, tokens, n, &c->o, logits, NULL, msg, cap);
}

static int gen_route_sample(void *p, const int32_t *tokens, uint32_t n, const gen_sample_req *rq,
                            sampler_result *res, char *msg, size_t cap) {
    gen_route_ctx *c = p;
    c->o.sample = true;
    c->o.sp = *rq->sp;
    c->o.window = rq->window;
    c->o.n_window = rq->n_window;
    int err = route_step(c->r, c->s, tokens, n, &c->o, NULL, res, msg, cap);
    if (err == KVS_OK && route_session_pos(c->s) != rq->pos)
        return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "the session is at %u, the sample was for %u",
                        route_session_pos(c->s), rq->pos);
    return err;
}

static void describe_session(void *p, FILE *f) {
    gen_route_ctx *c = p;
    uint8_t sid[WIRE_SID_SIZE];
    route_session_id(c->s, sid);
    fprintf(f, " (session ");
    for (int i = 0; i < (int)WIRE_SID_SIZE; i++) fprintf(f, "%02x", sid[i]);
    fprintf(f, " epoch %llu)", (unsigned long long)route_session_epoch(c->s));
}

static void describe_stats(void *p, FILE *f) {
    gen_route_ctx *c = p;
    route_info ri;
    route_get_info(c->r, &ri);
    uint32_t pos = route_session_pos(c->s);
    fprintf(f,
            ",\"hops\":%u,\"epoch\":%llu,\"reroutes\":%u,\"wire_bytes_sent\":%llu,\"wire_bytes_received\":%llu,"
            "\"positions\":%u,\"relay_steps\":%u,\"relay_fallbacks\":%u,\"replayed_positions\":%llu,"
            "\"reconnects\":%u,\"moved\":%u",
            ri.n_hops, (unsigned long long)route_session_epoch(c->s), ri.reroutes,
            (unsigned long long)ri.bytes_sent, (unsigned long long)ri.bytes_received, pos, ri.relay_steps,
            ri.relay_fallbacks, (unsigned long long)ri.replayed_positions, ri.reconnects, ri.moved);
    fprintf(f, ",\"route\":[");
    for (uint32_t k = 0; k < ri.n_hops; k++) fprintf(f, "%s\"%s\"", k ? "," : "", route_hop_addr(c->r, k));
    fprintf(f, "]");
}

/* Ctrl-C ends the generation after the current step, and the session is released on every shard
 * on the way out instead of staying until the shards' TTL. */
static volatile sig_atomic_t g_interrupted;

static void on_sigint(int sig) {
    (void)sig;
    g_interrupted = 1;
}

static void generate_on_interrupt(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

int cmd_generate(int argc, char **argv) {
    const char *route_spec = NULL, *spare_spec = NULL, *path = NULL;
    long threads = 0, timeout_ms = 30000, grace_ms = 3000;
    bool verbose = false, keep = false, logits_mode = false, no_relay = false;
    const char *wire_dtype = "f32";
    const char *hidden = "f32";
    uint64_t replay_cap = 0;
    gen_opts o;
    gen_opts_default(&o);
    args_security sec = {0};
    cluster_cli_opts cl = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool ok = true;
        int so = args_security_opt(argc, argv, &i, &sec);
        if (so == 0) so = cluster_cli_opt("generate", argc, argv, &i, &cl);
        if (so < 0) return 2;
        if (so > 0) continue;
        int g = gen_parse_opt(&o, argc, argv, &i);
        if (g < 0) return 2;
        if (g > 0) continue;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { generate_usage(stdout); return 0; }
        else if (!strcmp(a, "--route")) ok = args_str(argc, argv, &i, &route_spec);
        else if (!strcmp(a, "--spare")) ok = args_str(argc, argv, &i, &spare_spec);
        else if (!strcmp(a, "-m")) ok = args_str(argc, argv, &i, &path);
        else if (!strcmp(a, "-t")) ok = args_int(argc, argv, &i, 1, 1024, &threads);
        else if (!strcmp(a, "--timeout")) ok = args_int(argc, argv, &i, 1, 24L * 3600 * 1000, &timeout_ms);
        else if (!strcmp(a, "--reconnect-grace")) ok = args_int(argc, argv, &i, 0, 3600L * 1000, &grace_ms);
        else if (!strcmp(a, "-v") || !strcmp(a, "--verbose")) verbose = true;
        else if (!strcmp(a, "--keep-session")) keep = true;
        else if (!strcmp(a, "--logits")) logits_mode = true;
        else if (!strcmp(a, "--no-relay")) no_relay = true;
        else if (!strcmp(a, "--wire-dtype")) ok = args_str(argc, argv, &i, &wire_dtype);
        else if (!strcmp(a, "--hidden")) ok = args_str(argc, argv, &i, &hidden);
        else if (!strcmp(a, "--replay-cap") && i + 1 < argc) {
            ok = args_size(argv[++i], &replay_cap) && replay_cap > 0;
            if (!ok) fprintf(stderr, "kvshard generate: --replay-cap '%s' is not a size\n", argv[i]);
        }
        else { fprintf(stderr, "kvshard generate: unknown option '%s'\n", a); generate_usage(stderr); return 2; }
        if (!ok) return 2;
    }
    if ((!route_spec && !cl.url) || !o.prompt) {
        fprintf(stderr, "kvshard generate: --route (or --cluster) and -p PROMPT are required\n");
        generate_usage(stderr);
        return 2;
    }
    if (strcmp(wire_dtype, "f32") && strcmp(wire_dtype, "f16") && strcmp(wire_dtype, "bf16")) {
        fprintf(stderr, "kvshard generate: --wire-dtype wants f32, f16 or bf16, got '%s'\n", wire_dtype);
        return 2;
    }
    if (strcmp(hidden, "f32") && strcmp(hidden, "f16") && strcmp(hidden, "bf16")) {
        fprintf(stderr, "kvshard generate: --hidden wants f32, f16 or bf16, got '%s'\n", hidden);
        return 2;
    }
    if (strcmp(wire_dtype, "f32")) hidden = wire_dtype; /* the same thing as --hidden */
    if (!args_security_check("generate", &sec)) return 2;
    char msg[KVS_MSG_MAX] = "";
    route_params rp = route_default_params();
    rp.timeout_ms = timeout_ms;
    rp.reconnect_grace_ms = grace_ms;
    char *token = NULL;
    if (!args_security_route("generate", &sec, &rp, &token)) return 2;
    rp.hidden_f16 = !strcmp(hidden, "f16");
    rp.hidden_bf16 = !strcmp(hidden, "bf16");
    if (replay_cap) rp.max_replay_bytes = replay_cap;
    if (verbose) rp.log = log_stderr;
    route *r = NULL;
    int err = cl.url ? cluster_cli_route_open("generate", &cl, &rp, &r)
                     : route_open(route_spec, spare_spec, &rp, &r, msg, sizeof msg);
    free(token); /* route_open keeps its own copy */
    if (err && cl.url) return 1; /* cluster_cli_route_open has said why */
    if (err) {
        fprintf(stderr, "kvshard generate: %s\n", msg[0] ? msg : kvs_strerror(err));
        return 1;
    }
    route_info ri;
    route_get_info(r, &ri);
    int rc = 1;
    tok_vocab *vocab = NULL;
    route_session *sess = NULL;
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
    if ((err = route_session_open(r, &sess, msg, sizeof msg)) != KVS_OK) {
        fprintf(stderr, "kvshard generate: %s\n", msg[0] ? msg : kvs_strerror(err));
        goto out;
    }
    gen_route_ctx c = {.r = r, .s = sess, .o = route_default_step_opts()};
    c.o.relay = !no_relay;
    gen_target t = {.cmd = "generate", .vocab = vocab, .n_vocab = (int32_t)ri.n_vocab, .max_ctx = ri.max_ctx,
                    .backend = {.forward = gen_route_step, .forward_sample = logits_mode ? NULL : gen_route_sample,
                                .ctx = &c},
                    .describe = describe_stats, .session = describe_session,
                    .ctx_hint = "the shards' --ctx-size and --kv-budget set the route's context"};
    if (o.n_ctx && (uint32_t)o.n_ctx < t.max_ctx) t.max_ctx = (uint32_t)o.n_ctx;
    generate_on_interrupt();
    o.stop = &g_interrupted;
    rc = gen_run(&o, &t);
    if (verbose && route_session_epoch(sess) > 1)
        fprintf(stderr, "kvshard generate: finished at epoch %llu\n", (unsigned long long)route_session_epoch(sess));
out:
    if (keep) route_session_forget(sess); /* leave the shards' state in place (testing aid) */
    else route_release(r, sess);
    route_close(r);
    tok_free(vocab);
    return rc;
}
