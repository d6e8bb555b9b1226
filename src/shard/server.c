/* server.c — the shard's lifecycle: create, accept, stop, free (server_impl.h has the design). */
#include "server.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "digest.h"
#include "log.h"
#include "netio.h"
#include "quant.h"
#include "server_impl.h"
#include "util.h"

/* The context the shard can give one session against what --ctx-size asked: a request it cannot
 * meet fails at startup, naming the flag that changes it. */
static int srv_check_ctx(const srv *s, const srv_params *p, char *msg, size_t cap) {
    uint32_t got = kv_get_params(s->e->kv)->max_positions, n_ctx = s->e->m->hp.n_ctx;
    if (p->max_ctx > n_ctx)
        return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "--ctx-size %u is more than the model's context length %u",
                        p->max_ctx, n_ctx);
    if (p->max_ctx > got)
        return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG,
                        "--ctx-size %u does not fit: --kv-budget %llu KiB holds %u positions of these layers "
                        "(raise --kv-budget or lower --ctx-size)",
                        p->max_ctx, (unsigned long long)(p->kv_budget_bytes >> 10), got);
    kvs_logf(s->p.log, s->p.log_ctx, "context: %u positions per session (model: %u; --ctx-size, --kv-budget)", got,
             n_ctx);
    return KVS_OK;
}

srv_params srv_default_params(void) {
    srv_params p = {0};
    p.listen = "127.0.0.1:7000";
    p.kv_budget_bytes = 256ull << 20;
    p.max_tokens = 512;
    p.prefill_chunk = 64;
    p.max_batch = 32;
    p.max_conns = 64;
    p.hello_timeout_ms = 10000;
    p.idle_timeout_ms = 600000;
    p.kv_type = QUANT_F16;
    p.max_queued_bytes = 256ull << 20;
    p.frame_timeout_ms = 10000;
    p.max_conns_per_addr = 16;
    p.max_inflight = 32;
    p.max_buffered_bytes = 512ull << 20;
    p.tenant_kv_share = 1.0;
    return p;
}


void srv_stats(srv *s, struct wire_stats_reply *m) {
    kv_stats k;
    kv_get_stats(s->e->kv, &k);
    relay_stats rs;
    relay_get_stats(s->relay, &rs);
    pthread_mutex_lock(&s->mu);
    struct { const char *name; uint64_t v; } list[] = {
        {"kv.sessions", k.sessions},           {"kv.bytes_used", k.bytes_used},
        {"kv.budget_bytes", k.budget_bytes},   {"kv.block_bytes", k.block_bytes},
        {"kv.type", kv_get_params(s->e->kv)->kv_type}, /* GGUF type id: 1 f16, 8 q8_0, 2 q4_0, 0 f32 */
        {"kv.blocks_total", k.blocks_total},   {"kv.blocks_free", k.blocks_free},
        {"kv.hits", k.hits},                   {"kv.misses", k.misses},
        {"kv.stale", k.stale},                 {"kv.evict_ttl", k.evict_ttl},
        {"kv.evict_lru", k.evict_lru},         {"kv.releases", k.releases},
        {"kv.rewinds", k.rewinds},             {"kv.cancellations", k.cancellations},
        {"kv.appends", k.appends},             {"kv.truncates", k.truncates},
        {"kv.inherits", k.inherits},           {"kv.busy", k.busy},
        {"kv.in_place", k.in_place},           {"kv.tombstones", k.tombstones},
        {"srv.connections_total", s->c_conns_total}, {"srv.connections_open", (uint64_t)s->n_conns},
        {"srv.connections_rejected", s->c_rejected_conns}, {"srv.requests", s->c_requests},
        {"srv.forward_rows", s->c_forward_rows}, {"srv.batches", s->c_batches},
        {"srv.batch_items", s->c_batch_items}, {"srv.protocol_errors", s->c_protocol_errors},
        {"relay.pushed", rs.pushed},           {"relay.failed", rs.failed},
        {"relay.connects", rs.connects},
        {"srv.auth_failures", s->c_auth_failures}, {"srv.busy_inflight", s->c_busy_inflight},
        {"srv.refused_per_addr", s->c_refused_addr}, {"srv.frame_timeouts", s->c_frame_timeouts},
        {"srv.refused_buffers", s->c_refused_buffers},
        {"srv.buffered_bytes", (uint64_t)atomic_load(&s->buffered)},
        {"srv.rx_buffer_bytes", (uint64_t)atomic_load(&s->rx_capacity)},
        {"kv.tenants", k.tenants},             {"kv.evict_quota", k.evict_quota},
        {"kv.quota_refusals", k.quota_refusals},
        {"kv.prefix_hits", k.prefix_hits},     {"kv.prefix_positions", k.prefix_positions},
        {"kv.prefix_short", k.prefix_short},   {"kv.prefix_dedups", k.prefix_dedups},
        {"kv.prefix_evictions", k.prefix_evictions}, {"kv.prefix_blocks", k.prefix_blocks},
        {"kv.cached_blocks", k.cached_blocks}, {"kv.cached_bytes", k.cached_bytes},
        {"state.snapshot_sessions_written", s->c_snap_written_sessions},
        {"state.snapshot_bytes_written", s->c_snap_written_bytes},
        {"state.snapshot_sessions_loaded", s->c_snap_loaded_sessions},
        {"state.snapshot_bytes_loaded", s->c_snap_loaded_bytes},
        {"state.snapshot_refused", s->c_snap_refused},
        {"move.sessions_in", s->c_moved_in_sessions}, {"move.bytes_in", s->c_moved_in_bytes},
        {"move.sessions_out", s->c_moved_out_sessions}, {"move.bytes_out", s->c_moved_out_bytes},
        {"move.refused", s->c_push_refused},
        {"srv.draining", (uint64_t)srv_draining(s)}, /* the registry's "draining" state */
    };
    pthread_mutex_unlock(&s->mu);
    size_t n = sizeof(list) / sizeof(list[0]);
    for (size_t i = 0; i < n; i++) {
        snprintf(m->stats[i].name, sizeof(m->stats[i].name), "%s", list[i].name);
        m->stats[i].value = list[i].v;
    }
    m->n_stats = (uint32_t)n;
}

/* True for a host that only this machine can reach: 127.0.0.0/8, ::1, "localhost". */
static bool host_is_loopback(const char *host) {
    struct in_addr a4;
    struct in6_addr a6;
    if (!strcmp(host, "localhost")) return true;
    if (inet_pton(AF_INET, host, &a4) == 1) return (ntohl(a4.s_addr) >> 24) == 127;
    if (inet_pton(AF_INET6, host, &a6) == 1) return IN6_IS_ADDR_LOOPBACK(&a6);
    return false;
}

/* Reads the accepted HELLO tokens (one per line, surrounding blanks ignored, '#' comments) into
 * s->tokens as hashes. INVALID_ARG for an unreadable file, an empty list or a token too long. */
static int load_tokens(srv *s, const char *path, char *msg, size_t cap) {
    FILE *f = fopen(path, "r");
    if (!f) return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "--auth-token-file %s: %s", path, strerror(errno));
    char line[WIRE_MAX_AUTH + 4];
    int rc = KVS_OK, n_line = 0;
    while (fgets(line, sizeof line, f)) {
        n_line++;
        size_t l = strlen(line);
        if (l == sizeof line - 1 && line[l - 1] != '\n') {
            rc = kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "%s:%d: token longer than %u bytes", path, n_line, WIRE_MAX_AUTH);
            break;
        }
        char *b = line;
        while (*b == ' ' || *b == '\t') b++;
        while (l > 0 && (line[l - 1] == '\n' || line[l - 1] == '\r' || line[l - 1] == ' ' || line[l - 1] == '\t')) line[--l] = 0;
        if (!*b || *b == '#') continue;
        void *grown = realloc(s->tokens, (size_t)(s->n_tokens + 1) * sizeof *s->tokens);
        if (!grown) {
            rc = kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
            break;
        }
        s->tokens = grown;
        crypto_generichash(s->tokens[s->n_tokens], sizeof s->tokens[0], (const uint8_t *)b, strlen(b), NULL, 0);
        s->n_tokens++;
    }
    fclose(f);
    if (rc == KVS_OK && s->n_tokens == 0) rc = kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "--auth-token-file %s holds no token", path);
    sodium_memzero(line, sizeof line);
    return rc;
}

/* RAM of this machine in bytes, 0 when unknown. A KV budget above it is refused rather than
 * clamped: the operator asked for something that cannot hold, and a silent clamp would
 * advertise a different budget than the one configured. */
static uint64_t physical_memory_bytes(void) {
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    if (pages <= 0 || page <= 0) return 0;
    uint64_t b;
    return kvs_mul_u64((uint64_t)pages, (uint64_t)page, &b) ? b : 0;
}

/* The model file's digest into s->digest: a split's kvshard manifest (its owned tensors were
 * checked against it as they were mapped), else the digest cache, else hashed (and kept there). */
static int srv_model_digest(srv *s, const srv_params *p, char *msg, size_t cap) {
    uint64_t t_hash = kvs_now_ns();
    char prefix[4096];
    if (gguf_set_manifest_digest(s->e->m->files, s->digest)) {
        kvs_logf(s->p.log, s->p.log_ctx, "model digest from the kvshard manifest of %s (only the parts of layers [%u, %u) "
                 "are read)", p->model_path, s->e->m->first, s->e->m->last);
        return KVS_OK;
    }
    if (gguf_split_first_part(p->model_path, prefix, sizeof prefix) >= 2)
        kvs_logf(s->p.log, s->p.log_ctx, "no kvshard manifest: every part is read for the digest");
    bool hit = digest_cache_get(p->model_path, p->digest_cache_dir, s->digest);
    if (!hit) {
        const char *dir = p->digest_cache_dir;
        kvs_logf(s->p.log, s->p.log_ctx, "hashing the model file for its digest%s%s%s", dir ? " (kept in " : "",
                 dir ? dir : "", dir ? " for later starts)" : "");
        int err = digest_model_cached(p->model_path, p->digest_cache_dir, s->digest, &hit);
        if (err) return kvs_fail(msg, cap, err, "cannot read %s to hash it", p->model_path);
    }
    if (p->digest_cache_dir)
        kvs_logf(s->p.log, s->p.log_ctx, "model digest %s in %.2f s (cache %s)", hit ? "from the cache" : "computed",
                 (double)(kvs_now_ns() - t_hash) / 1e9, p->digest_cache_dir);
    return KVS_OK;
}

int srv_create(const srv_params *p, srv **out, char *msg, size_t cap) {
    *out = NULL;
    srv *s = calloc(1, sizeof(*s));
    if (!s) return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
    s->p = *p;
    s->listen_fd = -1;
    s->stop_pipe[0] = s->stop_pipe[1] = -1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    atomic_init(&s->stopping, false);
    atomic_init(&s->stop_requested, false);
    atomic_init(&s->draining, false);
    char host[NETIO_HOST_MAX];
    uint16_t port = 0;
    int err = netio_parse_hostport(p->listen, host, sizeof(host), &port);
    if (err) {
        err = kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "--listen '%s' is not HOST:PORT", p->listen);
        goto fail;
    }
    bool want_tls = p->tls_cert || p->tls_key || p->tls_ca;
    if (want_tls && !(p->tls_cert && p->tls_key && p->tls_ca)) {
        err = kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "TLS needs --tls-cert, --tls-key and --tls-ca together");
        goto fail;
    }
    if (!want_tls && !p->insecure && !host_is_loopback(host)) {
        err = kvs_fail(msg, cap, KVS_ERR_INVALID_ARG,
                       "--listen %s is not a loopback address: give --tls-cert/--tls-key/--tls-ca, or --insecure "
                       "to serve plaintext anyway", p->listen);
        goto fail;
    }
    /* Bound before the model is loaded and hashed, so that a port in use is said at once; a
     * client that connects meanwhile waits in the backlog for its HELLO to be answered. */
    if ((err = netio_listen(host, port, 64, &s->listen_fd, &s->port, msg, cap))) goto fail;
    if (sodium_init() < 0) {
        err = kvs_fail(msg, cap, KVS_ERR_INTERNAL, "libsodium failed to start");
        goto fail;
    }
    randombytes_buf(s->sid_key, sizeof s->sid_key);
    if (p->state_dir && (err = srv_state_open(s, msg, cap))) goto fail;
    if ((err = srv_move_create(s))) goto fail;
    atomic_init(&s->buffered, 0);
    atomic_init(&s->rx_capacity, 0);
    if (want_tls && (err = tls_ctx_create(&(tls_params){.cert_file = p->tls_cert, .key_file = p->tls_key,
                                                         .ca_file = p->tls_ca}, true, &s->tls, msg, cap)))
        goto fail;
    /* The same certificate, as a client, for the relay's connections to next hops. */
    if (want_tls && (err = tls_ctx_create(&(tls_params){.cert_file = p->tls_cert, .key_file = p->tls_key,
                                                         .ca_file = p->tls_ca}, false, &s->relay_tls, msg, cap)))
        goto fail;
    if (p->auth_token_file && (err = load_tokens(s, p->auth_token_file, msg, cap))) goto fail;
    uint64_t phys = physical_memory_bytes();
    if (phys && p->kv_budget_bytes > phys) {
        err = kvs_fail(msg, cap, KVS_ERR_INVALID_ARG,
                       "--kv-budget %.1f GiB is more than this machine's physical memory (%.1f GiB)",
                       (double)p->kv_budget_bytes / (1u << 30), (double)phys / (1u << 30));
        goto fail;
    }
    engine_params ep = engine_default_params();
    ep.model_path = p->model_path;
    ep.first = p->first;
    ep.last = p->last;
    ep.n_threads = p->n_threads;
    ep.kv.budget_bytes = p->kv_budget_bytes;
    ep.kv.ttl_ns = p->kv_ttl_ms * 1000000ull;
    ep.kv.max_sessions = p->max_sessions;
    ep.kv.tenant_max_sessions = p->tenant_max_sessions;
    ep.kv.tenant_max_bytes = p->tenant_kv_bytes;
    if (!p->tenant_kv_bytes && p->tenant_kv_share > 0 && p->tenant_kv_share < 1)
        ep.kv.tenant_max_bytes = (uint64_t)((double)p->kv_budget_bytes * p->tenant_kv_share);
    ep.kv.kv_type = (uint32_t)p->kv_type;
    ep.kv.prefault = p->kv_prefault;
    ep.kv.clock = p->kv_clock;
    ep.kv.clock_ctx = p->kv_clock_ctx;
    ep.kv.max_positions = p->max_ctx;
    kvs_logf(s->p.log, s->p.log_ctx, "loading %s (port %u bound; requests wait until ready)", p->model_path, s->port);
    if ((err = engine_open(&ep, &s->e, msg, cap)) || (err = srv_check_ctx(s, p, msg, cap))) goto fail;
    relay_params rp = relay_default_params();
    rp.done = srv_relay_done;
    rp.log = p->log;
    rp.ctx = p->log_ctx; /* srv_relay_done ignores it */
    rp.timeout_ms = p->hello_timeout_ms;
    rp.tls = s->relay_tls;
    rp.allow = p->relay_allow;
    rp.allow_loopback = host_is_loopback(host);
    rp.max_queued_bytes = p->max_buffered_bytes;
    if ((err = relay_create(&rp, &s->relay))) {
        if (err == KVS_ERR_INVALID_ARG)
            err = kvs_fail(msg, cap, err, "--relay-allow '%s' is not a list of numeric HOST:PORT", p->relay_allow);
        else
            err = kvs_fail(msg, cap, err, "cannot create the relay");
        goto fail;
    }
    kvs_logf(s->p.log, s->p.log_ctx, "loaded %s layers [%u, %u) of %u: %.1f MiB of weights (%d matrices repacked) in %.2f s", p->model_path,
             s->e->m->first, s->e->m->last, s->e->m->hp.n_layer, (double)s->e->m->weight_bytes / (1 << 20),
             s->e->m->n_repacked, s->e->open_s);
    if ((err = srv_model_digest(s, p, msg, cap))) goto fail;
    if (p->state_dir) srv_state_load(s);
    if (pipe2(s->stop_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
        err = kvs_fail(msg, cap, KVS_ERR_IO, "pipe: %s", strerror(errno));
        goto fail;
    }
    if (p->name && p->name[0]) snprintf(s->name, sizeof(s->name), "%s", p->name);
    else snprintf(s->name, sizeof(s->name), "%.100s:%u", host, s->port);
    *out = s;
    return KVS_OK;
fail:
    srv_free(s);
    return err;
}

uint16_t srv_port(const srv *s) { return s->port; }

void srv_stop(srv *s) {
    /* The accept loop ends. With a drain time or a state dir, srv_run then finishes the work in
     * flight (and writes the snapshot) before stopping; a second call stops at once. */
    atomic_store(&s->stop_requested, true);
    const bool graceful = s->p.drain_ms > 0 || s->p.state_dir;
    if (!graceful || atomic_exchange(&s->draining, true)) atomic_store(&s->stopping, true);
    char b = 1;
    ssize_t r = write(s->stop_pipe[1], &b, 1);
    (void)r;
}

/* The peer's IP address (addr) and "addr:port" (peer) of an accepted socket; "?" when unknown. */
static void peer_address(int fd, char addr[INET6_ADDRSTRLEN], char peer[64]) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    if (getpeername(fd, (struct sockaddr *)&ss, &sl) != 0) return;
    unsigned port = 0;
    if (ss.ss_family == AF_INET) {
        inet_ntop(AF_INET, &((struct sockaddr_in *)&ss)->sin_addr, addr, INET6_ADDRSTRLEN);
        port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
    } else if (ss.ss_family == AF_INET6) {
        inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&ss)->sin6_addr, addr, INET6_ADDRSTRLEN);
        port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    } else {
        return;
    }
    snprintf(peer, 64, "%s:%u", addr, port);
}

/* Closes a connection refused for capacity. A plaintext peer first gets STATUS BUSY with the
 * reason (one non-blocking send into the empty socket buffer, request id 0); a TLS peer only sees
 * the close — the shard does not spend a handshake on a connection it will not serve. */
static void refuse_conn(srv *s, int fd, const char *why) {
    if (!s->tls) {
        struct wire_status_reply m;
        memset(&m, 0, sizeof m);
        m.st.status = KVS_ERR_BUSY;
        m.msg_len = (uint16_t)strlen(why);
        memcpy(m.msg, why, m.msg_len);
        uint8_t buf[512];
        size_t len = 0;
        if (wire_encode_status_reply(&m, buf, sizeof buf, &len) == KVS_OK)
            (void)netio_send_frame(fd, WIRE_OP_STATUS, 0, buf, len, netio_deadline_ms(0));
    }
    netio_close(fd);
}

/* Whether a connection from addr gets a slot (server_impl.h, "Slots"): the per-address limit,
 * then the unauthenticated share and the table, evicting the oldest unauthenticated connection
 * when one of those is reached. Counts refusals. */
static bool admit_slot(srv *s, const char *addr, bool *addr_full) {
    int reserve = s->p.max_conns / 4, open = 0, unauthed = 0, same = 0;
    srv_conn *oldest = NULL;
    pthread_mutex_lock(&s->mu);
    for (srv_conn *o = s->conns; o; o = o->next) { /* newest first */
        if (atomic_load(&o->closed)) continue;
        open++;
        same += !strcmp(o->addr, addr);
        if (!atomic_load(&o->authed)) {
            unauthed++;
            oldest = o;
        }
    }
    *addr_full = s->p.max_conns_per_addr > 0 && same >= s->p.max_conns_per_addr;
    /* Connections being closed still hold memory: a bounded number of them beyond max_conns. */
    bool ok = !*addr_full && s->n_conns < s->p.max_conns + (reserve > 0 ? reserve : 1);
    if (ok && (open >= s->p.max_conns || unauthed >= s->p.max_conns - reserve)) {
        ok = oldest != NULL;
        if (ok) {
            kvs_logf(s->p.log, s->p.log_ctx, "conn %u (%s): no HELLO yet and the slots are taken: closed for a newcomer",
                     oldest->id, oldest->peer);
            atomic_store(&oldest->closed, true);
            shutdown(oldest->fd, SHUT_RDWR);
        }
    }
    if (!ok) s->c_rejected_conns++;
    if (*addr_full) s->c_refused_addr++;
    pthread_mutex_unlock(&s->mu);
    return ok;
}

/* FORWARDs queued or running, and connections with replies not yet written. */
static int drain_pending(srv *s) {
    int n = 0;
    pthread_mutex_lock(&s->mu);
    for (srv_conn *c = s->conns; c; c = c->next) {
        n += atomic_load(&c->inflight);
        pthread_mutex_lock(&c->write_lock);
        n += c->out_head != NULL && !c->writer_gone;
        pthread_mutex_unlock(&c->write_lock);
    }
    pthread_mutex_unlock(&s->mu);
    return n;
}

/* The drain of srv_stop: stops listening (Linux refuses new connects once the listener is shut
 * down), lets the FORWARDs in flight finish and their replies go out, for up to drain_ms or
 * until a second srv_stop; srv_handle_forward refuses new ones meanwhile. */
static void srv_drain(srv *s) {
    shutdown(s->listen_fd, SHUT_RDWR);
    int pending = drain_pending(s);
    kvs_logf(s->p.log, s->p.log_ctx, "draining: new connections and requests refused; %d request(s) in flight get up to %d ms",
             pending, s->p.drain_ms);
    uint64_t until = kvs_now_ns() + (uint64_t)s->p.drain_ms * 1000000ull;
    while (pending > 0 && !atomic_load(&s->stopping) && kvs_now_ns() < until) {
        struct pollfd pf = {.fd = s->stop_pipe[0], .events = POLLIN};
        if (poll(&pf, 1, 10) > 0) {
            char b;
            if (read(s->stop_pipe[0], &b, 1) < 0) { /* a second srv_stop sets stopping */ }
        }
        pending = drain_pending(s);
    }
    if (pending > 0) kvs_logf(s->p.log, s->p.log_ctx, "drain ended with %d request(s) in flight", pending);
    else kvs_logf(s->p.log, s->p.log_ctx, "drained: every request in flight was answered");
}

int srv_run(srv *s) {
    kv_stats ks;
    kv_get_stats(s->e->kv, &ks);
    kvs_logf(s->p.log, s->p.log_ctx, "listening on port %u (kv budget %llu KiB = %llu blocks of %llu B, %s)", s->port,
             (unsigned long long)(ks.budget_bytes >> 10), (unsigned long long)ks.blocks_total,
             (unsigned long long)ks.block_bytes, quant_get_traits(kv_get_params(s->e->kv)->kv_type)->name);
    if (pthread_create(&s->sched_thread, NULL, srv_sched_main, s) != 0) return KVS_ERR_INTERNAL;
    while (!atomic_load(&s->stop_requested)) {
        struct pollfd pf[2] = {{.fd = s->listen_fd, .events = POLLIN}, {.fd = s->stop_pipe[0], .events = POLLIN}};
        int r = poll(pf, 2, 1000);
        if (r < 0 && errno != EINTR) break;
        if (r <= 0 || !(pf[0].revents & POLLIN)) continue;
        int fd = -1;
        char msg[KVS_MSG_MAX];
        if (netio_accept(s->listen_fd, netio_deadline_ms(0), &fd, msg, sizeof(msg)) != KVS_OK) continue;
        char addr[INET6_ADDRSTRLEN] = "?", peer[64] = "?";
        peer_address(fd, addr, peer);
        bool addr_full = false, full = !admit_slot(s, addr, &addr_full);
        if (full || addr_full) {
            kvs_logf(s->p.log, s->p.log_ctx, "connection from %s refused: %s", peer,
                     full ? "all --max-conns slots open" : "--max-conns-per-addr reached for its address");
            refuse_conn(s, fd, full ? "the shard has no free connection slot" : "too many connections from this address");
            continue;
        }
        srv_conn *c = calloc(1, sizeof(*c));
        if (!c) {
            close(fd);
            continue;
        }
        c->s = s;
        c->fd = fd;
        pthread_mutex_init(&c->write_lock, NULL);
        pthread_cond_init(&c->write_cv, NULL);
        atomic_init(&c->refs, 1);
        atomic_init(&c->closed, false);
        atomic_init(&c->inflight, 0);
        atomic_init(&c->authed, false);
        snprintf(c->addr, sizeof c->addr, "%s", addr);
        snprintf(c->peer, sizeof c->peer, "%s", peer);
        pthread_mutex_lock(&s->mu);
        c->id = ++s->next_conn_id;
        c->next = s->conns;
        s->conns = c;
        s->n_conns++;
        s->c_conns_total++;
        pthread_mutex_unlock(&s->mu);
        kvs_logf(s->p.log, s->p.log_ctx, "conn %u (%s): open", c->id, c->peer);
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&c->writer, NULL, srv_conn_writer, c) != 0) {
            atomic_store(&c->closed, true);
            c->writer_gone = true;
            srv_conn_unref(c);
        } else if (pthread_create(&c->thread, &attr, srv_conn_main, c) != 0) {
            atomic_store(&c->closed, true);
            pthread_mutex_lock(&c->write_lock);
            c->writer_stop = true;
            pthread_cond_signal(&c->write_cv);
            pthread_mutex_unlock(&c->write_lock);
            pthread_join(c->writer, NULL);
            srv_conn_unref(c);
        }
        pthread_attr_destroy(&attr);
    }
    if (!atomic_load(&s->stopping) && s->p.drain_ms > 0) srv_drain(s);
    kvs_logf(s->p.log, s->p.log_ctx, "shutting down");
    if (s->p.state_dir) srv_state_quiesce(s);
    atomic_store(&s->stopping, true);
    /* Wake every reader; each cancels its work and drops its reference. */
    pthread_mutex_lock(&s->mu);
    for (srv_conn *c = s->conns; c; c = c->next) {
        atomic_store(&c->closed, true);
        shutdown(c->fd, SHUT_RDWR);
    }
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->sched_thread, NULL);
    relay_stop(s->relay); /* fails pushes still queued, so their connection refs go */
    /* Bounded wait for the detached readers to let go of their connections. */
    for (int i = 0; i < 500; i++) {
        pthread_mutex_lock(&s->mu);
        int n = s->n_conns;
        pthread_mutex_unlock(&s->mu);
        if (n == 0) break;
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (s->p.state_dir) srv_state_save(s);
    kv_get_stats(s->e->kv, &ks);
    kvs_logf(s->p.log, s->p.log_ctx, "stopped: %llu requests in %llu forward passes (%.2f per pass), %llu sessions live, %llu evicted (lru %llu, ttl %llu)",
             (unsigned long long)s->c_requests, (unsigned long long)s->c_batches,
             s->c_batches ? (double)s->c_batch_items / (double)s->c_batches : 0.0, (unsigned long long)ks.sessions,
             (unsigned long long)(ks.evict_lru + ks.evict_ttl), (unsigned long long)ks.evict_lru,
             (unsigned long long)ks.evict_ttl);
    return KVS_OK;
}

void srv_free(srv *s) {
    if (!s) return;
    if (s->listen_fd >= 0) close(s->listen_fd);
    if (s->stop_pipe[0] >= 0) close(s->stop_pipe[0]);
    if (s->stop_pipe[1] >= 0) close(s->stop_pipe[1]);
    relay_destroy(s->relay);
    srv_move_free(s);
    engine_close(s->e);
    tls_ctx_free(s->tls);
    tls_ctx_free(s->relay_tls); /* after relay_destroy: its links were detached */
    if (s->tokens) sodium_memzero(s->tokens, (size_t)s->n_tokens * sizeof *s->tokens);
    free(s->tokens);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}
