/* kvshard api: the OpenAI-compatible HTTP server, over a route of shards or one in-process model. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "args.h"
#include "chat.h"
#include "cli.h"
#include "cluster_cli.h"
#include "daemon.h"
#include "http.h"
#include "netio.h"
#include "kvs_commit.h" /* KVS_COMMIT, written at build time (cmake/commit.cmake) */
#include "quant.h"
#include "server.h"
#include "util.h"

static volatile sig_atomic_t g_stop, g_hurry;
static int g_wake[2] = {-1, -1}; /* the handler writes a byte: any thread may take the signal */

static void on_signal(int sig) {
    (void)sig;
    if (g_stop++) g_hurry = 1; /* a second signal: end the running replies now */
    char b = 1;
    ssize_t r = write(g_wake[1], &b, 1);
    (void)r;
}

static void api_usage(FILE *f) {
    fprintf(f,
            "usage: kvshard api (-m MODEL | --route HOST:PORT,... [--spare HOST:PORT,...]) [--listen HOST:PORT]\n"
            "                   [--lanes N] [--queue N] [--queue-timeout SECONDS] [--max-body SIZE]\n"
            "                   [--prefix-slots N] [--model-name NAME] [--tokenizer MODEL] [--chat-template NAME]\n"
            "                   [-t THREADS] [--kv-budget SIZE] [--kv-type f16|q8_0|q4_0|f32]\n"
            "                   [--api-key FILE] [--per-ip-conns N] [--request-timeout S] [--stream-stall S]\n"
            "  -m MODEL             run the whole model in this process (a shard on a loopback port)\n"
            "  --route SPEC         drive a route of running shards instead (as kvshard generate)\n"
            "  --spare SPEC         replacement shards for failed hops\n"
            "  --cluster URL        instead of --route: plan each lane's route from an etcd registry,\n"
            "                       spreading lanes over replicas (--model NAME|DIGEST picks the model)\n"
            "  --listen HOST:PORT   HTTP address (default 127.0.0.1:8080; port 0 picks one, printed); an\n"
            "                       address that is not loopback needs --api-key (or --insecure)\n"
            "  --api-key FILE       accepted API keys, one per line ('#' comments): every endpoint but the\n"
            "                       page wants 'Authorization: Bearer KEY' (401 otherwise); prefix reuse is\n"
            "                       per key (without keys: per client address). Plaintext HTTP: put a TLS\n"
            "                       proxy in front off loopback\n"
            "  --per-ip-conns N     open HTTP connections from one IP address (default 64)\n"
            "  --request-timeout S  a connection silent this long while sending a request or between\n"
            "                       requests is closed (default 10)\n"
            "  --stream-stall S     a streamed reply its client reads nothing of for S seconds is closed\n"
            "                       and its lane freed (default 30)\n"
            "  --lanes N            concurrent generations (default 4)\n"
            "  --queue N            requests that may wait for a lane before 503 (default 64)\n"
            "  --queue-timeout S    longest wait for a lane before 503 (default 30)\n"
            "  --max-body SIZE      request body limit, 413 past it (default 1M)\n"
            "  --prefix-slots N     finished sessions kept per lane for prefix reuse (default 4; 0 = off)\n");
    fprintf(f, /* two literals: C11 promises strings of 4095 bytes only */
            "  --public-prefix FILE text (as the model sees it, chat template applied, e.g. a system\n"
            "                       prompt) whose shard prefix blocks every client shares; other blocks\n"
            "                       stay per key / address (a client learns only that this text is cached)\n"
            "  --model-name NAME    model id in /v1/models (default: the file name of -m or --tokenizer,\n"
            "                       else 'kvshard')\n"
            "  --tokenizer MODEL    with --route: read the tokenizer and chat template from this GGUF (needed\n"
            "                       for BPE models; default: the head shard's SentencePiece vocab)\n"
            "  --chat-template NAME override the model's chat template (%s)\n"
            "  --cors ORIGINS       let browser pages of these origins call the API (comma-separated, or\n"
            "                       '*' for any); answers preflight OPTIONS. Default: no CORS headers\n"
            "  -t THREADS, --kv-budget SIZE   with -m: compute threads, hot KV pool (default 512M)\n"
            "  --kv-type T          with -m: KV element type f16 (default), q8_0, q4_0 or f32\n"
            "  --digest-cache DIR|off  with -m: the model digest's cache, as kvshard serve\n"
            "  -c, --ctx-size N     with -m: positions per conversation (default: the model's context\n"
            "                       length, as far as --kv-budget holds it); with --route the shards' own\n"
            "endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/ID], GET /health,\n"
            "GET /metrics, POST /tokenize, POST /detokenize, GET /version, GET / (chat page).\n"
            "  --drain-timeout S    on SIGTERM/SIGINT: stop listening, let running replies finish for up\n"
            "                       to S seconds (default 30), then end them (finish_reason \"length\",\n"
            "                       streams get [DONE]) and exit 0; a second signal ends them at once\n"
            "with --route, the security options of kvshard generate:\n" ARGS_SECURITY_USAGE,
            chat_template_names());
}

static void *serve_thread(void *p) {
    srv_run(p);
    return NULL;
}

/* Tries the HTTP address before the model is loaded and the routes opened, so that a port in
 * use is said at once (http_start binds it for good later). */
static bool listen_port_free(const char *listen) {
    char host[NETIO_HOST_MAX], msg[KVS_MSG_MAX] = "";
    uint16_t port = 0;
    int fd = -1;
    if (netio_parse_hostport(listen, host, sizeof host, &port) != KVS_OK || port == 0) return true; /* http_start says */
    if (netio_listen(host, port, 1, &fd, NULL, msg, sizeof msg) != KVS_OK) {
        fprintf(stderr, "kvshard api: --listen: %s\n", msg);
        return false;
    }
    close(fd);
    return true;
}

/* "dir/name.gguf" -> "name" */
static void model_id(const char *path, char *out, size_t cap) {
    const char *b = strrchr(path, '/');
    b = b ? b + 1 : path;
    snprintf(out, cap, "%s", b);
    size_t n = strlen(out);
    if (n > 5 && !strcmp(out + n - 5, ".gguf")) out[n - 5] = 0;
}

int cmd_api(int argc, char **argv) {
    http_params p = http_default_params();
    const char *model = NULL, *budget = "512M", *body = NULL, *digest_cache = NULL;
    char cache_buf[4096];
    uint32_t kv_type = QUANT_F16;
    long lanes = p.lanes, queue = p.queue_max, slots = p.prefix_slots, threads = 0, ctx_size = 0;
    double qt = 30, drain_s = 30;
    long per_ip = p.per_ip_connections, req_timeout = p.request_timeout_s, stall = p.stream_stall_s;
    args_security sec = {0};
    cluster_cli_opts cl = {0};
    char *cl_route = NULL, *cl_spares = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool ok = true;
        int so = args_security_opt(argc, argv, &i, &sec);
        if (so == 0) so = cluster_cli_opt("api", argc, argv, &i, &cl);
        if (so < 0) return 2;
        if (so > 0) continue;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { api_usage(stdout); return 0; }
        else if (!strcmp(a, "-m")) ok = args_str(argc, argv, &i, &model);
        else if (!strcmp(a, "--route")) ok = args_str(argc, argv, &i, &p.route);
        else if (!strcmp(a, "--spare")) ok = args_str(argc, argv, &i, &p.spares);
        else if (!strcmp(a, "--listen")) ok = args_str(argc, argv, &i, &p.listen);
        else if (!strcmp(a, "--lanes")) ok = args_int(argc, argv, &i, 1, 256, &lanes);
        else if (!strcmp(a, "--api-key")) ok = args_str(argc, argv, &i, &p.api_key_file);
        else if (!strcmp(a, "--per-ip-conns")) ok = args_int(argc, argv, &i, 1, 65536, &per_ip);
        else if (!strcmp(a, "--request-timeout")) ok = args_int(argc, argv, &i, 1, 86400, &req_timeout);
        else if (!strcmp(a, "--stream-stall")) ok = args_int(argc, argv, &i, 1, 86400, &stall);
        else if (!strcmp(a, "--queue")) ok = args_int(argc, argv, &i, 0, 4096, &queue);
        else if (!strcmp(a, "--queue-timeout")) ok = args_float(argc, argv, &i, 0, 86400, &qt);
        else if (!strcmp(a, "--max-body")) ok = args_str(argc, argv, &i, &body);
        else if (!strcmp(a, "--prefix-slots")) ok = args_int(argc, argv, &i, 0, 1024, &slots);
        else if (!strcmp(a, "--public-prefix")) ok = args_str(argc, argv, &i, &p.public_prefix);
        else if (!strcmp(a, "--model-name")) ok = args_str(argc, argv, &i, &p.model_name);
        else if (!strcmp(a, "--tokenizer")) ok = args_str(argc, argv, &i, &p.tokenizer_path);
        else if (!strcmp(a, "--chat-template")) ok = args_str(argc, argv, &i, &p.chat_template);
        else if (!strcmp(a, "--cors")) ok = args_str(argc, argv, &i, &p.cors);
        else if (!strcmp(a, "--drain-timeout")) ok = args_float(argc, argv, &i, 0, 86400, &drain_s);
        else if (!strcmp(a, "--digest-cache")) ok = args_str(argc, argv, &i, &digest_cache);
        else if (!strcmp(a, "-t")) ok = args_int(argc, argv, &i, 1, 1024, &threads);
        else if (!strcmp(a, "--kv-budget")) ok = args_str(argc, argv, &i, &budget);
        else if (!strcmp(a, "--kv-type")) ok = args_kv_type(argc, argv, &i, &kv_type);
        else if (!strcmp(a, "-c") || !strcmp(a, "--ctx-size")) ok = args_int(argc, argv, &i, 16, 1 << 24, &ctx_size);
        else { fprintf(stderr, "kvshard api: unknown option '%s'\n", a); api_usage(stderr); return 2; }
        if (!ok) return 2;
    }
    cluster_bal *bal = NULL;
    if (cl.url && !p.route && !model) {
        /* The first plan names the route for the checks at start; every lane then plans its own. */
        if (cluster_cli_specs("api", &cl, &cl_route, &cl_spares)) return 1;
        p.route = cl_route;
        p.spares = cl_spares;
        if (!(bal = cluster_bal_new("api", &cl))) return 1;
        p.open_route = cluster_bal_open;
        p.open_route_ctx = bal;
        p.route_stale = cluster_bal_stale;
    }
    if (!model == !p.route) {
        fprintf(stderr, "kvshard api: exactly one of -m MODEL or --route SPEC is required\n");
        api_usage(stderr);
        return 2;
    }
    if (!args_security_check("api", &sec)) return 2;
    p.tls_cert = sec.tls_cert;
    p.tls_key = sec.tls_key;
    p.tls_ca = sec.tls_ca;
    uint64_t max_body = p.max_body_bytes;
    if (body && !args_size(body, &max_body)) {
        fprintf(stderr, "kvshard api: --max-body wants a size like 1M, got '%s'\n", body);
        return 2;
    }
    p.max_body_bytes = (size_t)max_body;
    p.lanes = (int)lanes;
    p.queue_max = (int)queue;
    p.queue_timeout_ms = (int64_t)(qt * 1000.0);
    p.prefix_slots = (int)slots;
    p.per_ip_connections = (int)per_ip;
    p.request_timeout_s = (int)req_timeout;
    p.stream_stall_s = (int)stall;
    p.insecure = sec.insecure;
    p.log = daemon_log_line;
    p.log_ctx = "api";
    char msg[KVS_MSG_MAX] = "", spec[64], name[128];
    if (!listen_port_free(p.listen)) return 1;
    srv *shard = NULL;
    pthread_t shard_thread;
    if (model) {
        srv_params sp = srv_default_params();
        sp.model_path = model;
        sp.kv_type = (int)kv_type;
        sp.listen = "127.0.0.1:0";
        sp.n_threads = (int)threads;
        sp.kv_ttl_ms = 600000;
        sp.max_ctx = (uint32_t)ctx_size;
        sp.digest_cache_dir = daemon_cache_dir(digest_cache, cache_buf, sizeof cache_buf);
        sp.log = daemon_log_line;
        sp.log_ctx = "shard";
        if (!args_size(budget, &sp.kv_budget_bytes)) {
            fprintf(stderr, "kvshard api: --kv-budget wants a size like 512M, got '%s'\n", budget);
            return 2;
        }
        int err = srv_create(&sp, &shard, msg, sizeof msg);
        if (err) {
            if (!strncmp(msg, model, strlen(model))) fprintf(stderr, "kvshard api: %s\n", msg); /* names the file */
            else fprintf(stderr, "kvshard api: %s: %s\n", model, msg[0] ? msg : kvs_strerror(err));
            return 1;
        }
        if (pthread_create(&shard_thread, NULL, serve_thread, shard) != 0) {
            srv_free(shard);
            fprintf(stderr, "kvshard api: cannot start the shard thread\n");
            return 1;
        }
        snprintf(spec, sizeof spec, "127.0.0.1:%u", srv_port(shard));
        p.route = spec;
        p.tokenizer_path = model;
        if (!p.model_name) {
            model_id(model, name, sizeof name);
            p.model_name = name;
        }
    }
    if (!p.model_name && p.tokenizer_path) { /* --route: the tokenizer's file names the model */
        model_id(p.tokenizer_path, name, sizeof name);
        p.model_name = name;
    }
    p.version = KVS_COMMIT;
    signal(SIGPIPE, SIG_IGN);
    http_server *h = NULL;
    int rc = 0, err = KVS_OK;
    char *token = NULL;
    if (sec.auth_token_file && !(token = args_read_token("api", sec.auth_token_file))) err = KVS_ERR_INVALID_ARG;
    p.auth = token;
    if (!err) err = http_start(&p, &h, msg, sizeof msg);
    if (err) {
        fprintf(stderr, "kvshard api: %s\n", msg[0] ? msg : kvs_strerror(err));
        rc = 1;
    } else {
        if (pipe(g_wake) != 0) g_wake[0] = g_wake[1] = -1; /* then the signal only sets g_stop */
        daemon_on_stop_signals(on_signal);
        fprintf(stderr, "kvshard api: listening on port %u\n", http_port(h));
        fflush(stderr);
        daemon_notify("READY=1"); /* systemd Type=notify */
        while (!g_stop) {
            char b;
            if (g_wake[0] < 0) pause();
            else if (read(g_wake[0], &b, 1) < 0) continue; /* EINTR: look again */
        }
        daemon_notify("STOPPING=1");
        fprintf(stderr, "kvshard api: stopping: new requests refused, running ones get up to %g s\n", drain_s);
        int cut = http_drain(h, (int64_t)(drain_s * 1000.0), &g_hurry);
        if (cut > 0) fprintf(stderr, "kvshard api: ended %d running request(s) early (finish_reason \"length\")\n", cut);
        http_stop(h);
        fprintf(stderr, "kvshard api: stopped\n");
        if (g_wake[0] >= 0) {
            close(g_wake[0]);
            close(g_wake[1]);
        }
    }
    if (shard) {
        srv_stop(shard);
        pthread_join(shard_thread, NULL);
        srv_free(shard);
    }
    free(token);
    cluster_bal_free(bal);
    free(cl_route);
    free(cl_spares);
    return rc;
}
