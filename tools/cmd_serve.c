/* kvshard serve: one layer range of a model as a shard over TCP. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "cluster_cli.h"
#include "daemon.h"
#include "quant.h"
#include "server.h"
#include "shard_metrics.h"
#include "util.h"

static srv *g_srv;

static void on_signal(int sig) {
    (void)sig;
    if (g_srv) srv_stop(g_srv);
}

static void serve_usage(FILE *f) {
    fprintf(f,
            "usage: kvshard serve -m MODEL --layers FIRST:LAST [--listen HOST:PORT] [--kv-budget SIZE]\n"
            "                     [--kv-ttl SECONDS] [-t THREADS] [--max-sessions N] [--max-conns N]\n"
            "                     [--max-tokens N] [--prefill-chunk N] [--kv-type f16|q8_0|q4_0|f32] [--kv-prefault]\n"
            "                     [--name NAME] [--metrics-listen HOST:PORT]\n"
            "  --layers FIRST:LAST  layers this shard owns, [FIRST, LAST); LAST may be 'end'\n"
            "  --listen HOST:PORT   default 127.0.0.1:7000; port 0 picks a free port (printed)\n"
            "  --kv-budget SIZE     hot KV pool, bytes with K/M/G suffix (default 256M)\n"
            "  --kv-prefault        touch the whole pool at start (takes memory and start time up front;\n"
            "                       then no prefill or moved-in session waits for fresh pages)\n"
            "  -c, --ctx-size N     positions per session (default: the model's context length, as far as\n"
            "                       --kv-budget holds it)\n"
            "  --kv-ttl SECONDS     evict sessions idle this long (default 600; 0 = never)\n"
            "  -t THREADS           compute threads (default: all CPUs)\n"
            "  --max-sessions N     live sessions (default: limited by the budget)\n"
            "  --max-conns N        open connections (default 64)\n"
            "  --max-tokens N       rows per request (default 512)\n"
            "  --prefill-chunk N    prefill rows per batch step (default 64)\n"
            ARGS_SECURITY_USAGE
            "  --insecure           serve plaintext on an address that is not loopback\n"
            "  --relay-allow LIST   HOST:PORT,... (numeric) next hops relayed steps may be pushed to\n"
            "                       (default: loopback hops on a loopback --listen, else none)\n"
            "  --max-conns-per-addr N   open connections from one IP address (default 16)\n"
            "  --max-inflight N     FORWARD requests queued per connection before BUSY (default 32)\n"
            "  --frame-timeout S    seconds a frame may take once its first byte arrived (default 10)\n"
            "  --hello-timeout S    seconds for the TLS handshake and HELLO together (default 10)\n"
            "  --idle-timeout S     seconds a connection may stay silent before it is closed (default 600)\n"
            "  --max-buffered SIZE  receive buffers and queued replies over all connections (default 512M)\n"
            "  --tenant-max-sessions N  live sessions per identity (default: no own cap)\n"
            "  --tenant-kv-share F|SIZE KV budget per identity: a fraction in (0, 1] or a size (default 1)\n"
            "                       always: another identity's sessions are evicted only while it holds\n"
            "                       more than budget / identities (and max-sessions / identities)\n"
            "  --metrics-listen HOST:PORT  serve Prometheus metrics at http://HOST:PORT/metrics (plaintext,\n"
            "                       no auth: a loopback address unless --insecure)\n");
    fprintf(f, /* in two parts: one literal would pass what C99 compilers must support */
            "  --state-dir DIR      keep the hot KV state across restarts: on SIGTERM stop admitting, finish\n"
            "                       the work in flight (--drain-timeout) and write every session to DIR; on\n"
            "                       start load it back (same model, layers and KV type; a bad snapshot is\n"
            "                       refused and logged)\n"
            "  --peer-allow LIST    ID-or-IP,... shards that may push sessions here (SESSION_PUSH) and\n"
            "                       operators that may drain this shard (kvshard drain): TLS identities with\n"
            "                       TLS, IP addresses without (default: none)\n"
            "  --layers auto        with --cluster: the range the registry covers least (docs/cluster.md)\n"
            "  --max-layers N       with --layers auto: at most N layers (default: the whole model)\n"
            "  --advertise HOST:PORT  the address registered in --cluster (default: the listen address)\n"
            "  --cluster-ttl S      lease TTL of the registration, seconds (default 10)\n"
            CLUSTER_CLI_USAGE
            "  --digest-cache DIR|off  where the model's digest is kept between starts, keyed by the\n"
            "                       file's path, inode, size, mtime and ctime (default $KVSHARD_CACHE_DIR,\n"
            "                       systemd's CacheDirectory, else ~/.cache/kvshard): a restart skips hashing\n"
            "  --drain-timeout S    on SIGTERM/SIGINT: stop listening, refuse new requests (clients move to\n"
            "                       their spares), answer those in flight for up to S seconds (default\n"
            "                       10; 0: stop at once), exit 0; a second signal stops at once\n");
}

int cmd_serve(int argc, char **argv) {
    srv_params p = srv_default_params();
    p.kv_ttl_ms = 600000;
    const char *layers = NULL, *budget = NULL, *metrics_listen = NULL;
    uint32_t kv_type = QUANT_F16;
    long threads = 0, max_sessions = 0, max_conns = p.max_conns, max_tokens = p.max_tokens, chunk = p.prefill_chunk;
    double ttl = 600, frame_s = p.frame_timeout_ms / 1000.0, hello_s = p.hello_timeout_ms / 1000.0;
    double idle_s = p.idle_timeout_ms / 1000.0, drain_s = 10;
    long per_addr = p.max_conns_per_addr, inflight = p.max_inflight;
    const char *buffered = NULL, *tenant_share = NULL, *digest_cache = NULL;
    char cache_buf[4096];
    long tenant_sessions = 0, ctx_size = 0;
    args_security sec = {0};
    cluster_cli_opts cl = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool ok = true;
        int so = args_security_opt(argc, argv, &i, &sec);
        if (so == 0) so = cluster_cli_opt("serve", argc, argv, &i, &cl);
        if (so < 0) return 2;
        if (so > 0) continue;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { serve_usage(stdout); return 0; }
        else if (!strcmp(a, "-m")) ok = args_str(argc, argv, &i, &p.model_path);
        else if (!strcmp(a, "--layers")) ok = args_str(argc, argv, &i, &layers);
        else if (!strcmp(a, "--listen")) ok = args_str(argc, argv, &i, &p.listen);
        else if (!strcmp(a, "--kv-budget")) ok = args_str(argc, argv, &i, &budget);
        else if (!strcmp(a, "-c") || !strcmp(a, "--ctx-size")) ok = args_int(argc, argv, &i, 16, 1 << 24, &ctx_size);
        else if (!strcmp(a, "--kv-ttl")) ok = args_float(argc, argv, &i, 0, 1e7, &ttl);
        else if (!strcmp(a, "-t")) ok = args_int(argc, argv, &i, 1, 1024, &threads);
        else if (!strcmp(a, "--max-sessions")) ok = args_int(argc, argv, &i, 0, 1 << 24, &max_sessions);
        else if (!strcmp(a, "--max-conns")) ok = args_int(argc, argv, &i, 1, 1 << 16, &max_conns);
        else if (!strcmp(a, "--max-tokens")) ok = args_int(argc, argv, &i, 1, 8192, &max_tokens);
        else if (!strcmp(a, "--prefill-chunk")) ok = args_int(argc, argv, &i, 1, 8192, &chunk);
        else if (!strcmp(a, "--kv-type")) ok = args_kv_type(argc, argv, &i, &kv_type);
        else if (!strcmp(a, "--kv-prefault")) p.kv_prefault = true;
        else if (!strcmp(a, "--name")) ok = args_str(argc, argv, &i, &p.name);
        else if (!strcmp(a, "--max-conns-per-addr")) ok = args_int(argc, argv, &i, 1, 1 << 16, &per_addr);
        else if (!strcmp(a, "--max-inflight")) ok = args_int(argc, argv, &i, 1, 1 << 16, &inflight);
        else if (!strcmp(a, "--frame-timeout")) ok = args_float(argc, argv, &i, 0.001, 3600, &frame_s);
        else if (!strcmp(a, "--hello-timeout")) ok = args_float(argc, argv, &i, 0.001, 3600, &hello_s);
        else if (!strcmp(a, "--idle-timeout")) ok = args_float(argc, argv, &i, 0.001, 1e6, &idle_s);
        else if (!strcmp(a, "--drain-timeout")) ok = args_float(argc, argv, &i, 0, 86400, &drain_s);
        else if (!strcmp(a, "--max-buffered")) ok = args_str(argc, argv, &i, &buffered);
        else if (!strcmp(a, "--tenant-max-sessions")) ok = args_int(argc, argv, &i, 0, 1 << 24, &tenant_sessions);
        else if (!strcmp(a, "--tenant-kv-share")) ok = args_str(argc, argv, &i, &tenant_share);
        else if (!strcmp(a, "--metrics-listen")) ok = args_str(argc, argv, &i, &metrics_listen);
        else if (!strcmp(a, "--digest-cache")) ok = args_str(argc, argv, &i, &digest_cache);
        else if (!strcmp(a, "--relay-allow")) ok = args_str(argc, argv, &i, &p.relay_allow);
        else if (!strcmp(a, "--state-dir")) ok = args_str(argc, argv, &i, &p.state_dir);
        else if (!strcmp(a, "--peer-allow")) ok = args_str(argc, argv, &i, &p.peer_allow);
        else { fprintf(stderr, "kvshard serve: unknown option '%s'\n", a); serve_usage(stderr); return 2; }
        if (!ok) return 2;
    }
    if (!p.model_path || !layers) {
        fprintf(stderr, "kvshard serve: -m MODEL and --layers FIRST:LAST are required\n");
        serve_usage(stderr);
        return 2;
    }
    unsigned first = 0, last = 0;
    char tail[8] = "";
    if (!strcmp(layers, "auto")) {
        if (!cl.url) { fprintf(stderr, "kvshard serve: --layers auto needs --cluster URL\n"); return 2; }
        if (cluster_cli_auto_layers(&cl, p.model_path, &first, &last)) return 1;
    } else if (sscanf(layers, "%u:%u", &first, &last) == 2) {
        if (last == 0) { fprintf(stderr, "kvshard serve: --layers LAST must be > FIRST\n"); return 2; }
    } else if (sscanf(layers, "%u:%7s", &first, tail) == 2 && !strcmp(tail, "end")) {
        last = 0;
    } else {
        fprintf(stderr, "kvshard serve: --layers wants FIRST:LAST (e.g. 0:11), got '%s'\n", layers);
        return 2;
    }
    p.first = first;
    p.last = last;
    if (budget && !args_size(budget, &p.kv_budget_bytes)) {
        fprintf(stderr, "kvshard serve: --kv-budget wants a size like 512M or 2G, got '%s'\n", budget);
        return 2;
    }
    if (buffered && !args_size(buffered, &(uint64_t){0})) {
        fprintf(stderr, "kvshard serve: --max-buffered wants a size like 512M, got '%s'\n", buffered);
        return 2;
    }
    if (buffered) {
        uint64_t v = 0;
        args_size(buffered, &v);
        p.max_buffered_bytes = (size_t)v;
    }
    if (tenant_share) {
        char *end = NULL;
        double f = strtod(tenant_share, &end);
        if (end != tenant_share && *end == '\0') {
            if (!(f > 0 && f <= 1)) {
                fprintf(stderr, "kvshard serve: --tenant-kv-share fraction must be in (0, 1], got '%s'\n", tenant_share);
                return 2;
            }
            p.tenant_kv_share = f;
        } else if (!args_size(tenant_share, &p.tenant_kv_bytes) || p.tenant_kv_bytes == 0) {
            fprintf(stderr, "kvshard serve: --tenant-kv-share wants a fraction like 0.5 or a size like 64M, got '%s'\n",
                    tenant_share);
            return 2;
        }
    }
    p.tenant_max_sessions = (uint32_t)tenant_sessions;
    if (!args_security_check("serve", &sec)) return 2;
    p.tls_cert = sec.tls_cert;
    p.tls_key = sec.tls_key;
    p.tls_ca = sec.tls_ca;
    p.auth_token_file = sec.auth_token_file;
    p.insecure = sec.insecure;
    p.max_conns_per_addr = (int)per_addr;
    p.max_inflight = (int)inflight;
    p.frame_timeout_ms = (int)(frame_s * 1000.0);
    p.hello_timeout_ms = (int)(hello_s * 1000.0);
    p.idle_timeout_ms = (int)(idle_s * 1000.0);
    p.drain_ms = (int)(drain_s * 1000.0);
    p.drain_timeout_ms = p.drain_ms; /* one flag: the drain and the snapshot's wait for work in flight */
    p.digest_cache_dir = daemon_cache_dir(digest_cache, cache_buf, sizeof cache_buf);
    p.kv_type = (int)kv_type;
    p.kv_ttl_ms = (uint64_t)(ttl * 1000.0);
    p.n_threads = (int)threads;
    p.max_sessions = (uint32_t)max_sessions;
    p.max_conns = (int)max_conns;
    p.max_tokens = (uint32_t)max_tokens;
    p.max_ctx = (uint32_t)ctx_size;
    p.prefill_chunk = (uint32_t)chunk;
    p.log = daemon_log_line;
    p.log_ctx = "serve";
    char msg[KVS_MSG_MAX] = "";
    shard_metrics *metrics = NULL;
    if (metrics_listen && shard_metrics_create(&metrics) != KVS_OK) return 1;
    if (metrics) {
        shard_metrics_allow_remote(metrics, sec.insecure);
        p.batch_done = shard_metrics_on_batch;
        p.batch_ctx = metrics;
    }
    int err = srv_create(&p, &g_srv, msg, sizeof(msg));
    if (!err && metrics) err = shard_metrics_listen(metrics, metrics_listen, g_srv, msg, sizeof msg);
    if (err) {
        fprintf(stderr, "kvshard serve: %s\n", msg[0] ? msg : kvs_strerror(err));
        srv_free(g_srv);
        shard_metrics_free(metrics);
        return 1;
    }
    if (metrics) fprintf(stderr, "kvshard serve: metrics on port %u\n", shard_metrics_port(metrics));
    daemon_on_stop_signals(on_signal);
    signal(SIGPIPE, SIG_IGN);
    cl_reg *reg = NULL;
    if (cl.url && cluster_cli_register(&cl, g_srv, &p, &reg)) {
        srv_free(g_srv);
        shard_metrics_free(metrics);
        return 1;
    }
    fprintf(stderr, "kvshard serve: listening on port %u\n", srv_port(g_srv));
    fflush(stderr);
    daemon_notify("READY=1"); /* systemd Type=notify: loaded, hashed and listening */
    err = srv_run(g_srv);
    daemon_notify("STOPPING=1");
    cl_reg_stop(reg); /* deregisters before the port closes for good */
    shard_metrics_free(metrics);
    srv_free(g_srv);
    g_srv = NULL;
    return err ? 1 : 0;
}
