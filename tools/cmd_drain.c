/* kvshard drain: move every idle session of a shard to peers serving the same model and layers
 * (docs/hot-kv-state.md "Moving sessions"), printing the shard's progress. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "netio.h"
#include "tls.h"
#include "util.h"
#include "wire.h"

static void drain_usage(FILE *f) {
    fprintf(f, "usage: kvshard drain HOST:PORT --to HOST:PORT[,...] [--keep-running] [--timeout MS]\n"
               "  the shard at HOST:PORT stops admitting, lets its work in flight finish, pushes every idle\n"
               "  session to the --to shards (same model and layers; each must list this shard's address\n"
               "  in its --peer-allow, as the drained shard must list this client's), then answers\n"
               "  requests for the moved sessions with MOVED (route clients follow it) and exits, or\n"
               "  stays up with --keep-running. Progress lines go to stdout; exit 0 when every session moved.\n"
               "  --timeout MS   connect deadline, and the longest wait for one progress line (default 60000)\n"
               ARGS_SECURITY_USAGE);
}

/* Connects, TLS when asked, HELLO; fd on success. */
static int drain_connect(const char *addr, tls_ctx *tls, const char *token, long timeout_ms, int *fd, char *msg,
                         size_t cap) {
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
    struct wire_info info;
    if (!err) err = wire_encode_hello(&h, hb, sizeof hb, &len);
    if (!err) err = netio_send_frame(*fd, WIRE_OP_HELLO, 1, hb, len, netio_deadline_ms(timeout_ms));
    if (!err) err = netio_recv_frame(*fd, &hd, &b, netio_deadline_ms(timeout_ms), msg, cap);
    if (!err) err = wire_decode_info(b.data, b.len, &info, msg, cap);
    if (!err && info.st.status) err = kvs_fail(msg, cap, info.st.status, "HELLO refused");
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

int cmd_drain(int argc, char **argv) {
    const char *addr = NULL, *to = NULL;
    long timeout_ms = 60000;
    bool keep = false;
    args_security sec = {0};
    for (int i = 1; i < argc; i++) {
        int so = args_security_opt(argc, argv, &i, &sec);
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
    if (!addr || !to) {
        fprintf(stderr, "kvshard drain: HOST:PORT and --to HOST:PORT[,...] are required\n");
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
    if (!err) err = drain_connect(addr, tls, token, timeout_ms, &fd, msg, sizeof msg);
    if (!err) err = drain_run(fd, to, keep, timeout_ms, msg, sizeof msg);
    if (err) fprintf(stderr, "kvshard drain: %s: %s\n", addr, msg[0] ? msg : kvs_strerror(err));
    netio_close(fd);
    tls_ctx_free(tls);
    free(token);
    return err ? 1 : 0;
}
