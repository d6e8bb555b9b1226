/* kvshard drain: move every idle session of a shard to peers serving the same model and layers
 * (docs/hot-kv-state.md "Moving sessions"), printing the shard's progress. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "cluster_cli.h"
#include "digest.h"
#include "netio.h"
#include "tls.h"
#include "util.h"
#include "wire.h"

static void drain_usage(FILE *f) {
    fprintf(f, "usage: kvshard drain HOST:PORT (--to HOST:PORT[,...] | --cluster URL) [--keep-running]\n"
               "                     [--timeout MS]\n"
               "  the shard at HOST:PORT stops admitting, lets its work in flight finish, pushes every idle\n"
               "  session to the --to shards (same model and layers; each must list this shard's address\n"
               "  in its --peer-allow, as the drained shard must list this client's), then answers\n"
               "  requests for the moved sessions with MOVED (route clients follow it) and exits, or\n"
               "  stays up with --keep-running. Progress lines go to stdout; exit 0 when every session moved.\n"
               "  --cluster URL  instead of --to: every serving shard of the registry with the same model\n"
               "                 and layer range, most free KV first (the drained shard registers itself as\n"
               "                 draining meanwhile, so clients plan around it)\n"
               "  --timeout MS   connect deadline, and the longest wait for one progress line (default 60000)\n"
               ARGS_SECURITY_USAGE CLUSTER_CLI_USAGE);
}

/* Connects, TLS when asked, HELLO; fd on success. */
static int drain_connect(const char *addr, tls_ctx *tls, const char *token, long timeout_ms, int *fd,
                         struct wire_info *info, char *msg, size_t cap) {
    char host[NETIO_HOST_MAX];
    uint16_t port;
    if (netio_parse_hostport(addr, host, sizeof host, &port) != KVS_OK)
        return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "'%s' is not HOST:PORT", addr);
    int err = netio_connect(host, port, netio_deadline_ms(timeout_ms), fd, msg, cap);
    char peer_id[TLS_ID_MAX];
    if (!err && tls) err = tls_handshake(tls, *fd, netio_deadline_ms(timeout_ms), peer_id, sizeof peer_id, msg, cap);
    struct wire_hello h = {.min_version = 1, .max_version = WIRE_PROTO_VERSION};
    if (token) {
        h.auth_len = (uint16_t)strlen(token);
        memcpy(h.auth, token, h.auth_len + 1u);
    }
    uint8_t hb[WIRE_MAX_AUTH + 16];
    size_t len = 0;
    struct netio_buf b = {0};
    struct wire_header hd;
    if (!err) err = wire_encode_hello(&h, hb, sizeof hb, &len);
    if (!err) err = netio_send_frame(*fd, WIRE_OP_HELLO, 1, hb, len, netio_deadline_ms(timeout_ms));
    if (!err) err = netio_recv_frame(*fd, &hd, &b, netio_deadline_ms(timeout_ms), msg, cap);
    if (!err) err = wire_decode_info(b.data, b.len, info, msg, cap);
    if (!err && info->st.status) err = kvs_fail(msg, cap, info->st.status, "HELLO refused");
    netio_buf_free(&b);
    return err;
}

/* Sends DRAIN and prints each progress line until "done: ..."; returns the final status. */
static int drain_run(int fd, const char *to, bool keep, long timeout_ms, char *msg, size_t cap) {
    char text[1100];
    int n = snprintf(text, sizeof text, "%s%s", to, keep ? ";keep" : "");
    if (n <= 0 || (size_t)n >= sizeof text) return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "--to list too long");
    int err = netio_send_frame(fd, WIRE_OP_DRAIN, 2, (const uint8_t *)text, (size_t)n, netio_deadline_ms(timeout_ms));
    struct netio_buf b = {0};
    for (int lines = 0; !err && lines < 1000000; lines++) {
        struct wire_header hd;
        struct wire_status_reply sr;
        err = netio_recv_frame(fd, &hd, &b, netio_deadline_ms(timeout_ms), msg, cap);
        if (!err && hd.op != WIRE_OP_STATUS)
            err = kvs_fail(msg, cap, KVS_ERR_PROTOCOL, "unexpected reply %s", wire_op_name(hd.op));
        if (!err) err = wire_decode_status_reply(b.data, b.len, &sr, msg, cap);
        if (err) break;
        printf("%s\n", sr.msg[0] ? sr.msg : kvs_strerror(sr.st.status));
        fflush(stdout);
        if (strncmp(sr.msg, "progress: ", 10) != 0) {
            err = sr.st.status;
            if (err) snprintf(msg, cap, "%s", sr.msg[0] ? sr.msg : kvs_strerror(err));
            break;
        }
    }
    netio_buf_free(&b);
    return err;
}

static int by_free_kv(const void *a, const void *b) {
    const cl_entry *x = a, *y = b;
    uint64_t fx = x->kv_budget > x->kv_used ? x->kv_budget - x->kv_used : 0;
    uint64_t fy = y->kv_budget > y->kv_used ? y->kv_budget - y->kv_used : 0;
    return fx < fy ? 1 : fx > fy ? -1 : strcmp(x->addr, y->addr);
}

/* --cluster: the peers for the shard at addr (its INFO in `in`), as "h:p,h:p" into to; non-zero
 * after printing why when the registry has none. */
static int cluster_peers(const cluster_cli_opts *o, const char *addr, const struct wire_info *in, char *to,
                         size_t cap) {
    etcd *db = NULL;
    cl_entry *e = NULL;
    size_t n = 0, k = 0;
    int err = cluster_cli_open("drain", o, 10000, &db);
    if (!err) err = cluster_cli_load("drain", db, o, &e, &n);
    etcd_close(db);
    if (err) return err;
    char digest[65];
    digest_hex(in->model_digest, digest);
    for (size_t i = 0; i < n; i++) /* the usable ones to the front */
        if (e[i].state == CL_SERVING && !strcmp(e[i].digest, digest) && e[i].first == in->first &&
            e[i].last == in->last && strcmp(e[i].addr, addr))
            e[k++] = e[i];
    qsort(e, k, sizeof *e, by_free_kv);
    to[0] = 0;
    for (size_t i = 0; i < k && i < 16; i++)
        snprintf(to + strlen(to), cap - strlen(to), "%s%s", i ? "," : "", e[i].addr);
    free(e);
    if (!k) {
        fprintf(stderr, "kvshard drain: the registry has no serving shard of this model for layers [%u, %u) "
                        "besides %s\n", in->first, in->last, addr);
        return KVS_ERR_NOT_FOUND;
    }
    printf("peers from the registry: %s\n", to);
    return KVS_OK;
}

int cmd_drain(int argc, char **argv) {
    const char *addr = NULL, *to = NULL;
    long timeout_ms = 60000;
    bool keep = false;
    args_security sec = {0};
    cluster_cli_opts cl = {0};
    for (int i = 1; i < argc; i++) {
        int so = args_security_opt(argc, argv, &i, &sec);
        if (so == 0) so = cluster_cli_opt("drain", argc, argv, &i, &cl);
        if (so < 0) return 2;
        if (so > 0) continue;
        bool ok = true;
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) { drain_usage(stdout); return 0; }
        else if (!strcmp(argv[i], "--to")) ok = args_str(argc, argv, &i, &to);
        else if (!strcmp(argv[i], "--keep-running")) keep = true;
        else if (!strcmp(argv[i], "--timeout")) ok = args_int(argc, argv, &i, 1, 24L * 3600 * 1000, &timeout_ms);
        else if (!addr && argv[i][0] != '-') addr = argv[i];
        else { fprintf(stderr, "kvshard drain: unexpected argument '%s'\n", argv[i]); drain_usage(stderr); return 2; }
        if (!ok) return 2;
    }
    if (!addr || !to == !cl.url) {
        fprintf(stderr, "kvshard drain: HOST:PORT and one of --to HOST:PORT[,...] or --cluster URL are required\n");
        drain_usage(stderr);
        return 2;
    }
    if (!args_security_check("drain", &sec)) return 2;
    char msg[KVS_MSG_MAX] = "", *token = NULL;
    if (sec.auth_token_file && !(token = args_read_token("drain", sec.auth_token_file))) return 2;
    tls_ctx *tls = NULL;
    int err = KVS_OK, fd = -1;
    if (sec.tls_cert) {
        tls_params tp = {.cert_file = sec.tls_cert, .key_file = sec.tls_key, .ca_file = sec.tls_ca};
        err = tls_ctx_create(&tp, false, &tls, msg, sizeof msg);
    }
    struct wire_info info;
    char peers[16 * 64];
    if (!err) err = drain_connect(addr, tls, token, timeout_ms, &fd, &info, msg, sizeof msg);
    if (err) fprintf(stderr, "kvshard drain: %s: %s\n", addr, msg[0] ? msg : kvs_strerror(err));
    if (!err && cl.url && (err = cluster_peers(&cl, addr, &info, peers, sizeof peers)) == KVS_OK) to = peers;
    if (!err && (err = drain_run(fd, to, keep, timeout_ms, msg, sizeof msg)))
        fprintf(stderr, "kvshard drain: %s: %s\n", addr, msg[0] ? msg : kvs_strerror(err));
    netio_close(fd);
    tls_ctx_free(tls);
    free(token);
    return err ? 1 : 0;
}
