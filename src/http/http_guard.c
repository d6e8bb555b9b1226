/*
 * http_guard — who may use `kvshard api` and how much of it one client can hold (http.h design
 * note 6): api keys (Bearer tokens, kept as hashes, compared in constant time), the client
 * identity that scopes prefix reuse, the listen-address rule, and the per-connection limits of
 * libmicrohttpd that bound slow or silent clients.
 */
#include <microhttpd.h>
#include <netinet/in.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>

#include "http_impl.h"
#include "netio.h"
#include "util.h"

#define GUARD_KEY_MAX 256 /* bytes of one api key */

/* Adds the key of one line (blanks around it and '#' comments dropped) to g; KVS_OK when the
 * line is empty, KVS_ERR_INVALID_ARG when the key is too long, KVS_ERR_NOMEM. */
static int add_key_line(http_guard *g, char *line) {
    char *hash = strchr(line, '#');
    if (hash) *hash = 0;
    char *b = line, *e = line + strlen(line);
    while (*b == ' ' || *b == '\t') b++;
    while (e > b && (e[-1] == ' ' || e[-1] == '\t' || e[-1] == '\r' || e[-1] == '\n')) e--;
    if (e == b) return KVS_OK;
    if (e - b > GUARD_KEY_MAX) return KVS_ERR_INVALID_ARG;
    uint8_t(*nk)[HTTP_KEY_HASH] = realloc(g->keys, (size_t)(g->n_keys + 1) * sizeof *nk);
    if (!nk) return KVS_ERR_NOMEM;
    g->keys = nk;
    crypto_generichash(g->keys[g->n_keys++], HTTP_KEY_HASH, (const uint8_t *)b, (size_t)(e - b), NULL, 0);
    return KVS_OK;
}

static int load_keys(http_guard *g, const char *path, char *msg, size_t cap) {
    FILE *f = fopen(path, "r");
    if (!f) return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "--api-key %.200s: cannot read it", path);
    char line[GUARD_KEY_MAX + 64];
    int err = KVS_OK;
    while (!err && fgets(line, sizeof line, f)) {
        if (!strchr(line, '\n') && !feof(f)) err = KVS_ERR_INVALID_ARG; /* a line past the buffer */
        else err = add_key_line(g, line);
    }
    fclose(f);
    sodium_memzero(line, sizeof line);
    if (err == KVS_ERR_NOMEM) return kvs_fail(msg, cap, err, "out of memory");
    if (err) return kvs_fail(msg, cap, err, "--api-key %.200s: a key is longer than %d bytes", path, GUARD_KEY_MAX);
    if (!g->n_keys) return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "--api-key %.200s holds no key", path);
    return KVS_OK;
}

int http_guard_open(http_guard *g, const http_params *p, const char *host, char *msg, size_t cap) {
    memset(g, 0, sizeof *g);
    if (sodium_init() < 0) return kvs_fail(msg, cap, KVS_ERR_INTERNAL, "libsodium failed to start");
    g->per_ip = p->per_ip_connections;
    g->max_ips = p->max_connections;
    if (!(g->ips = calloc((size_t)g->max_ips, sizeof *g->ips)))
        return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
    pthread_mutex_init(&g->ip_mu, NULL);
    randombytes_buf(g->id_key, sizeof g->id_key);
    if (p->api_key_file && p->api_key_file[0]) {
        int err = load_keys(g, p->api_key_file, msg, cap);
        if (err) {
            http_guard_close(g);
            return err;
        }
    }
    if (!g->n_keys && !p->insecure && !netio_host_is_loopback(host)) {
        http_guard_close(g);
        return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG,
                        "--listen %.100s is not loopback: give --api-key FILE (and put a TLS proxy in front), or "
                        "--insecure to serve anyone who can reach it",
                        host);
    }
    return KVS_OK;
}

void http_guard_close(http_guard *g) {
    if (g->keys) sodium_memzero(g->keys, (size_t)g->n_keys * sizeof *g->keys);
    free(g->keys);
    if (g->ips) pthread_mutex_destroy(&g->ip_mu);
    free(g->ips);
    memset(g, 0, sizeof *g);
}

/* The count of address tag a, or NULL; under ip_mu. */
static http_ip_count *ip_find(http_guard *g, uint64_t a) {
    for (int i = 0; i < g->n_ips; i++)
        if (g->ips[i].addr == a) return &g->ips[i];
    return NULL;
}

bool http_guard_admit(http_guard *g, const struct sockaddr *sa) {
    const uint64_t a = http_guard_owner_addr(g, sa);
    pthread_mutex_lock(&g->ip_mu);
    const http_ip_count *c = ip_find(g, a);
    const bool ok = !c || c->n < g->per_ip;
    pthread_mutex_unlock(&g->ip_mu);
    return ok;
}

void http_guard_conn(http_guard *g, uint64_t a, bool open) {
    pthread_mutex_lock(&g->ip_mu);
    http_ip_count *c = ip_find(g, a);
    if (open && !c && g->n_ips < g->max_ips) { /* max_ips: the connection limit, so never full */
        c = &g->ips[g->n_ips++];
        *c = (http_ip_count){.addr = a};
    }
    if (c && open) c->n++;
    else if (c && --c->n <= 0) *c = g->ips[--g->n_ips]; /* the last one fills the hole */
    pthread_mutex_unlock(&g->ip_mu);
}

/* A 64-bit identity tag: keyed, so tags of different clients do not collide by choice. */
static uint64_t tag_of(const http_guard *g, char kind, const void *data, size_t len) {
    uint8_t in[1 + 64], out[crypto_shorthash_BYTES];
    if (len > sizeof in - 1) len = sizeof in - 1;
    in[0] = (uint8_t)kind;
    memcpy(in + 1, data, len);
    crypto_shorthash(out, in, len + 1, g->id_key);
    uint64_t v;
    memcpy(&v, out, sizeof v);
    return v;
}

bool http_guard_check(const http_guard *g, const char *authorization, uint64_t *owner) {
    *owner = 0;
    if (!g->n_keys) return true;
    static const char scheme[] = "Bearer ";
    if (!authorization || strncasecmp(authorization, scheme, sizeof scheme - 1)) return false;
    const char *tok = authorization + sizeof scheme - 1;
    while (*tok == ' ') tok++;
    size_t n = strlen(tok);
    while (n && (tok[n - 1] == ' ' || tok[n - 1] == '\t')) n--;
    if (!n || n > GUARD_KEY_MAX) return false;
    uint8_t h[HTTP_KEY_HASH];
    crypto_generichash(h, sizeof h, (const uint8_t *)tok, n, NULL, 0);
    int found = -1;
    for (int i = 0; i < g->n_keys; i++) /* every key compared: the time says nothing of which matched */
        if (sodium_memcmp(h, g->keys[i], sizeof h) == 0) found = i;
    if (found < 0) return false;
    *owner = tag_of(g, 'k', g->keys[found], HTTP_KEY_HASH);
    return true;
}

uint64_t http_guard_owner_addr(const http_guard *g, const struct sockaddr *sa) {
    if (sa && sa->sa_family == AF_INET)
        return tag_of(g, '4', &((const struct sockaddr_in *)sa)->sin_addr, sizeof(struct in_addr));
    if (sa && sa->sa_family == AF_INET6)
        return tag_of(g, '6', &((const struct sockaddr_in6 *)sa)->sin6_addr, sizeof(struct in6_addr));
    return tag_of(g, '?', "", 0);
}

void http_guard_long_work(struct MHD_Connection *c, bool begin, unsigned resume_s) {
    /* 0 turns the timeout off while the server itself works (a generation, a queue wait, health
     * probes); setting it again afterwards restarts its clock (libmicrohttpd's rule). */
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, begin ? 0u : resume_s);
}

void http_guard_stream(struct MHD_Connection *c, const http_params *p) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (ci) {
        int sz = p->stream_sndbuf;
        (void)setsockopt(ci->connect_fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz); /* best effort */
    }
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, (unsigned)p->stream_stall_s);
}
