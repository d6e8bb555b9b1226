/*
 * fuzz_tls_frame — libFuzzer target: the input is the byte stream a peer sends inside a mutual
 * TLS 1.3 connection (a socketpair); the receiving side reads it frame by frame with the
 * server's limits (netio_recv_frame_opt: payload cap, admit hook, per-frame deadline) and runs
 * the payload decoder of each frame's op, until the stream ends or breaks. This is the frame
 * layer as it runs under TLS: netio's TLS read path, record boundaries that split headers and
 * payloads anywhere, buffer growth and trimming.
 *
 * The cluster certificates are made once per process (tls_make_cluster in a temporary
 * directory). One handshake per input: slow (~1 ms), but every input starts from a clean stream.
 *
 * Build: CC=clang cmake -S . -B build-fuzz -DKVS_FUZZ=ON && cmake --build build-fuzz --target fuzz_tls_frame
 */
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "netio.h"
#include "tls.h"
#include "wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static tls_ctx *g_server, *g_client;

static tls_ctx *make_ctx(const char *dir, const char *name, bool server) {
    char cert[300], key[300], ca[300], msg[256];
    snprintf(cert, sizeof cert, "%s/%s.pem", dir, name);
    snprintf(key, sizeof key, "%s/%s.key", dir, name);
    snprintf(ca, sizeof ca, "%s/ca.pem", dir);
    tls_params p = {.cert_file = cert, .key_file = key, .ca_file = ca};
    tls_ctx *c = NULL;
    if (tls_ctx_create(&p, server, &c, msg, sizeof msg) != KVS_OK) {
        fprintf(stderr, "fuzz_tls_frame: %s\n", msg);
        abort();
    }
    return c;
}

static void init_once(void) {
    if (g_server) return;
    signal(SIGPIPE, SIG_IGN);
    char dir[] = "/tmp/kvs-fuzz-tls-XXXXXX";
    if (!mkdtemp(dir)) abort();
    const char *names[] = {"shard", "client"};
    char msg[256];
    if (tls_make_cluster(dir, names, 2, 1, msg, sizeof msg) != KVS_OK) {
        fprintf(stderr, "fuzz_tls_frame: %s\n", msg);
        abort();
    }
    g_server = make_ctx(dir, "shard", true);
    g_client = make_ctx(dir, "client", false);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) fprintf(stderr, "fuzz_tls_frame: could not remove %s\n", dir);
}

typedef struct {
    int fd;
    const uint8_t *data;
    size_t size;
} sender;

/* The peer: handshake, send the input in pieces of varying size (so TLS records split frames at
 * input-chosen places), close with close_notify. */
static void *send_main(void *arg) {
    sender *s = arg;
    char id[TLS_ID_MAX], msg[256];
    if (tls_handshake(g_client, s->fd, netio_deadline_ms(5000), id, sizeof id, msg, sizeof msg) == KVS_OK) {
        size_t off = 0, step = s->size ? (size_t)(s->data[0] % 61) + 1 : 1;
        while (off < s->size) {
            size_t n = s->size - off < step ? s->size - off : step;
            if (netio_write_full(s->fd, s->data + off, n, netio_deadline_ms(2000)) != KVS_OK) break;
            off += n;
            step = step * 3 % 4093 + 1;
        }
    }
    netio_close(s->fd);
    return NULL;
}

static int admit_small(void *ctx, const struct wire_header *h) {
    (void)ctx;
    return h->payload_len > (1u << 20) ? KVS_ERR_BUSY : KVS_OK;
}

static void decode(const struct wire_header *h, const uint8_t *p, size_t n) {
    char msg[256];
    switch (h->op) {
    case WIRE_OP_HELLO: {
        struct wire_hello m;
        (void)wire_decode_hello(p, n, &m, msg, sizeof msg);
        break;
    }
    case WIRE_OP_FORWARD: {
        struct wire_forward m;
        if (wire_decode_forward(p, n, &m, msg, sizeof msg) == KVS_OK && m.in_kind != WIRE_IN_TOKENS &&
            (uint64_t)m.n_tokens * m.n_embd <= (1u << 20)) {
            float *f = malloc((size_t)m.n_tokens * m.n_embd * sizeof(float) + 1);
            if (f) (void)wire_forward_hidden_to_f32(&m, f);
            free(f);
        }
        break;
    }
    case WIRE_OP_TRUNCATE: {
        struct wire_truncate m;
        (void)wire_decode_truncate(p, n, &m, msg, sizeof msg);
        break;
    }
    case WIRE_OP_RELEASE: {
        struct wire_release m;
        (void)wire_decode_release(p, n, &m, msg, sizeof msg);
        break;
    }
    case WIRE_OP_CANCEL: {
        struct wire_cancel m;
        (void)wire_decode_cancel(p, n, &m, msg, sizeof msg);
        break;
    }
    case WIRE_OP_VOCAB: {
        struct wire_vocab m;
        (void)wire_decode_vocab(p, n, &m, msg, sizeof msg);
        break;
    }
    case WIRE_OP_VOCAB_REPLY: {
        struct wire_vocab_reply m;
        if (wire_decode_vocab_reply(p, n, &m, msg, sizeof msg) == KVS_OK) {
            size_t off = 0;
            struct wire_vocab_token t;
            while (wire_vocab_next(&m, &off, &t)) {
            }
        }
        break;
    }
    case WIRE_OP_INFO: {
        struct wire_info m;
        (void)wire_decode_info(p, n, &m, msg, sizeof msg);
        break;
    }
    case WIRE_OP_STATUS: {
        struct wire_status_reply m;
        (void)wire_decode_status_reply(p, n, &m, msg, sizeof msg);
        break;
    }
    default:
        (void)wire_decode_empty(p, n, msg, sizeof msg);
        break;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    init_once();
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return 0;
    sender s = {.fd = sv[1], .data = data, .size = size};
    pthread_t th;
    if (pthread_create(&th, NULL, send_main, &s) != 0) {
        close(sv[0]);
        close(sv[1]);
        return 0;
    }
    char id[TLS_ID_MAX], msg[256];
    if (tls_handshake(g_server, sv[0], netio_deadline_ms(5000), id, sizeof id, msg, sizeof msg) == KVS_OK) {
        struct netio_buf b = {0};
        for (;;) {
            struct wire_header h;
            netio_recv_opts o = {.idle_deadline_ns = netio_deadline_ms(2000), .frame_timeout_ms = 2000,
                                 .max_payload = 4u << 20, .admit = admit_small};
            if (netio_recv_frame_opt(sv[0], &h, &b, &o, msg, sizeof msg) != KVS_OK) break;
            /* an exact-size copy so ASan flags any read past the payload */
            uint8_t *p = malloc(b.len ? b.len : 1);
            if (!p) break;
            if (b.len) memcpy(p, b.data, b.len);
            decode(&h, b.len ? p : NULL, b.len);
            free(p);
        }
        netio_buf_free(&b);
    }
    netio_close(sv[0]); /* the sender sees EOF if it is still writing */
    pthread_join(th, NULL);
    return 0;
}
