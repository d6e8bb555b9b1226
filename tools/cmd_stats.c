/* kvshard stats: a running shard's identity and counters, as one JSON object. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "args.h"
#include "cli.h"
#include "digest.h"
#include "netio.h"
#include "tls.h"
#include "util.h"
#include "wire.h"

static void stats_usage(FILE *f) {
    fprintf(f, "usage: kvshard stats HOST:PORT [--timeout MS] [--tls-cert F --tls-key F --tls-ca F] [--auth-token-file F]\n"
               "  prints {\"shard\":..,\"layers\":[first,last],\"n_layer\":..,\"model_digest\":..,\"counters\":{...}}\n"
               ARGS_SECURITY_USAGE);
}

/* One request/reply exchange; the reply's payload lands in b. */
static int exchange(int fd, uint16_t op, const uint8_t *payload, size_t len, uint16_t want, struct netio_buf *b,
                    long timeout_ms, char *msg, size_t cap) {
    int err = netio_send_frame(fd, op, 1, payload, len, netio_deadline_ms(timeout_ms));
    struct wire_header hd;
    if (!err) err = netio_recv_frame(fd, &hd, b, netio_deadline_ms(timeout_ms), msg, cap);
    if (!err && hd.op != want) err = kvs_fail(msg, cap, KVS_ERR_PROTOCOL, "unexpected reply %s", wire_op_name(hd.op));
    return err;
}

int cmd_stats(int argc, char **argv) {
    const char *addr = NULL;
    long timeout_ms = 5000;
    args_security sec = {0};
    for (int i = 1; i < argc; i++) {
        int so = args_security_opt(argc, argv, &i, &sec);
        if (so < 0) return 2;
        if (so > 0) continue;
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) { stats_usage(stdout); return 0; }
        if (!strcmp(argv[i], "--timeout") && i + 1 < argc) timeout_ms = strtol(argv[++i], NULL, 10);
        else if (!addr && argv[i][0] != '-') addr = argv[i];
        else { fprintf(stderr, "kvshard stats: unexpected argument '%s'\n", argv[i]); stats_usage(stderr); return 2; }
    }
    char host[NETIO_HOST_MAX], msg[KVS_MSG_MAX] = "";
    uint16_t port;
    if (!addr || netio_parse_hostport(addr, host, sizeof(host), &port) != KVS_OK) {
        fprintf(stderr, "kvshard stats: want HOST:PORT\n");
        stats_usage(stderr);
        return 2;
    }
    if (!args_security_check("stats", &sec)) return 2;
    char *token = NULL;
    if (sec.auth_token_file && !(token = args_read_token("stats", sec.auth_token_file))) return 2;
    tls_ctx *tls = NULL;
    if (sec.tls_cert) {
        tls_params tp = {.cert_file = sec.tls_cert, .key_file = sec.tls_key, .ca_file = sec.tls_ca};
        if (tls_ctx_create(&tp, false, &tls, msg, sizeof msg) != KVS_OK) {
            fprintf(stderr, "kvshard stats: %s\n", msg);
            free(token);
            return 2;
        }
    }
    int fd = -1, rc = 1;
    struct netio_buf b = {0};
    struct wire_info info;
    struct wire_stats_reply *st = calloc(1, sizeof(*st));
    uint8_t hb[WIRE_MAX_AUTH + 16];
    size_t len = 0;
    struct wire_hello h = {.min_version = WIRE_VERSION, .max_version = WIRE_VERSION};
    if (token) {
        h.auth_len = (uint16_t)strlen(token);
        memcpy(h.auth, token, h.auth_len + 1u);
    }
    int err = st ? netio_connect(host, port, netio_deadline_ms(timeout_ms), &fd, msg, sizeof(msg)) : KVS_ERR_NOMEM;
    char peer_id[TLS_ID_MAX];
    if (!err && tls) err = tls_handshake(tls, fd, netio_deadline_ms(timeout_ms), peer_id, sizeof peer_id, msg, sizeof msg);
    if (!err) err = wire_encode_hello(&h, hb, sizeof(hb), &len);
    if (!err) err = exchange(fd, WIRE_OP_HELLO, hb, len, WIRE_OP_INFO, &b, timeout_ms, msg, sizeof(msg));
    if (!err) err = wire_decode_info(b.data, b.len, &info, msg, sizeof(msg));
    if (!err && info.st.status) err = info.st.status;
    if (!err) err = exchange(fd, WIRE_OP_STATS, NULL, 0, WIRE_OP_STATS_REPLY, &b, timeout_ms, msg, sizeof(msg));
    if (!err) err = wire_decode_stats_reply(b.data, b.len, st, msg, sizeof(msg));
    if (err) {
        fprintf(stderr, "kvshard stats: %s: %s\n", addr, msg[0] ? msg : kvs_strerror(err));
    } else {
        char hex[65];
        digest_hex(info.model_digest, hex);
        printf("{\"shard\":\"%s\",\"layers\":[%u,%u],\"n_layer\":%u,\"n_embd\":%u,\"n_vocab\":%u,\"max_ctx\":%u,\"model_digest\":\"%s\","
               "\"counters\":{",
               info.name, info.first, info.last, info.n_layer, info.n_embd, info.n_vocab, info.max_ctx, hex);
        for (uint32_t i = 0; i < st->n_stats; i++)
            printf("%s\"%s\":%llu", i ? "," : "", st->stats[i].name, (unsigned long long)st->stats[i].value);
        printf("}}\n");
        rc = 0;
    }
    netio_close(fd);
    tls_ctx_free(tls);
    free(token);
    netio_buf_free(&b);
    free(st);
    return rc;
}
