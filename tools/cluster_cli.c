/* Command-line glue for the cluster registry (cluster_cli.h). */
#include "cluster_cli.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "args.h"
#include "daemon.h"
#include "digest.h"
#include "gguf.h"
#include "util.h"
#include "wire.h"

#define CLUSTER_MAX_REPLANS 8 /* shards skipped before a client gives up */

int cluster_cli_opt(const char *cmd, int argc, char **argv, int *i, cluster_cli_opts *o) {
    const char *a = argv[*i];
    const char **slot = !strcmp(a, "--cluster")              ? &o->url
                        : !strcmp(a, "--model")              ? &o->model
                        : !strcmp(a, "--cluster-prefix")     ? &o->prefix
                        : !strcmp(a, "--etcd-ca")            ? &o->ca
                        : !strcmp(a, "--etcd-cert")          ? &o->cert
                        : !strcmp(a, "--etcd-key")           ? &o->key
                        : !strcmp(a, "--etcd-user")          ? &o->user
                        : !strcmp(a, "--etcd-password-file") ? &o->password_file
                        : !strcmp(a, "--advertise")          ? &o->advertise
                                                             : NULL;
    if (slot) return args_str(argc, argv, i, slot) ? 1 : -1;
    if (!strcmp(a, "--cluster-ttl")) return args_float(argc, argv, i, 1, 3600, &o->ttl_s) ? 1 : -1;
    if (!strcmp(a, "--max-layers")) return args_int(argc, argv, i, 1, CL_MAX_LAYERS, &o->max_layers) ? 1 : -1;
    (void)cmd;
    return 0;
}

int cluster_cli_open(const char *cmd, const cluster_cli_opts *o, int timeout_ms, etcd **db) {
    char msg[KVS_MSG_MAX] = "";
    char *password = o->password_file ? args_read_token(cmd, o->password_file) : NULL;
    if (o->password_file && !password) return KVS_ERR_IO;
    etcd_params ep = {.url = o->url, .ca = o->ca, .cert = o->cert, .key = o->key, .user = o->user,
                      .password = password, .timeout_ms = timeout_ms};
    int err = etcd_open(&ep, db, msg, sizeof msg);
    free(password);
    if (err) fprintf(stderr, "kvshard %s: %s\n", cmd, msg[0] ? msg : kvs_strerror(err));
    return err;
}

int cluster_cli_load(const char *cmd, etcd *db, const cluster_cli_opts *o, cl_entry **e, size_t *n) {
    char msg[KVS_MSG_MAX] = "", prefix[300];
    snprintf(prefix, sizeof prefix, "%sshards/", o->prefix ? o->prefix : CL_DEFAULT_PREFIX);
    etcd_kv *kvs = NULL;
    size_t nk = 0;
    *e = NULL;
    *n = 0;
    int err = etcd_range_prefix(db, prefix, &kvs, &nk, msg, sizeof msg);
    if (err) {
        fprintf(stderr, "kvshard %s: %s\n", cmd, msg[0] ? msg : kvs_strerror(err));
        return err;
    }
    *e = calloc(nk ? nk : 1, sizeof **e);
    if (!*e) {
        etcd_kvs_free(kvs, nk);
        return KVS_ERR_NOMEM;
    }
    for (size_t k = 0; k < nk; k++) {
        if (cl_entry_decode(kvs[k].value, kvs[k].value_len, &(*e)[*n], msg, sizeof msg) == KVS_OK)
            (*n)++;
        else
            fprintf(stderr, "kvshard %s: skipping %s: %s\n", cmd, kvs[k].key, msg);
    }
    etcd_kvs_free(kvs, nk);
    return KVS_OK;
}

/* n_layer of the model file: <general.architecture>.block_count. */
static int model_n_layer(const char *path, uint32_t *n_layer) {
    char msg[KVS_MSG_MAX] = "", key[160];
    gguf_ctx *g = NULL;
    gguf_str arch = {0};
    int err = gguf_open_header(path, &g, msg, sizeof msg);
    if (!err) err = gguf_get_str(g, "general.architecture", &arch);
    if (!err) {
        snprintf(key, sizeof key, "%.*s.block_count", (int)(arch.len < 100 ? arch.len : 100), arch.ptr);
        err = gguf_get_u32(g, key, n_layer);
    }
    if (err) fprintf(stderr, "kvshard serve: %s: no layer count: %s\n", path, msg[0] ? msg : kvs_strerror(err));
    gguf_close(g);
    return err;
}

int cluster_cli_auto_layers(const cluster_cli_opts *o, const char *model_path, uint32_t *first, uint32_t *last) {
    uint32_t n_layer = 0;
    uint8_t d[32];
    char hex[65];
    int err = model_n_layer(model_path, &n_layer);
    if (err) return err;
    if ((err = digest_model_sha256(model_path, d)) != KVS_OK) {
        fprintf(stderr, "kvshard serve: %s: cannot hash the model\n", model_path);
        return err;
    }
    digest_hex(d, hex);
    etcd *db = NULL;
    cl_entry *e = NULL;
    size_t n = 0;
    if ((err = cluster_cli_open("serve", o, 2000, &db)) || (err = cluster_cli_load("serve", db, o, &e, &n))) {
        etcd_close(db);
        return err;
    }
    cl_plan_auto(e, n, hex, n_layer, (uint32_t)o->max_layers, first, last);
    fprintf(stderr, "kvshard serve: --layers auto took %u:%u of %u (%zu shards registered)\n", *first, *last,
            n_layer, n);
    free(e);
    etcd_close(db);
    return KVS_OK;
}

typedef struct {
    srv *s;
    uint64_t last_rows, last_ns;
    double load;
} reg_fill_ctx;

static uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint64_t stat_of(const struct wire_stats_reply *m, const char *name) {
    for (uint32_t i = 0; i < m->n_stats; i++)
        if (!strcmp(m->stats[i].name, name)) return m->stats[i].value;
    return 0;
}

/* Live figures: sessions and KV from srv_stats; load = forward rows per second since the last
 * update, smoothed (a busy replica looks busy for a few updates). */
static void reg_fill(void *ctx, cl_entry *e) {
    reg_fill_ctx *c = ctx;
    struct wire_stats_reply m;
    srv_stats(c->s, &m);
    e->sessions = (uint32_t)stat_of(&m, "kv.sessions");
    e->kv_used = stat_of(&m, "kv.bytes_used");
    e->kv_budget = stat_of(&m, "kv.budget_bytes");
    uint64_t rows = stat_of(&m, "srv.forward_rows"), now = mono_ns();
    if (c->last_ns && now > c->last_ns) {
        double rate = (double)(rows - c->last_rows) * 1e9 / (double)(now - c->last_ns);
        c->load = 0.5 * c->load + 0.5 * rate;
    }
    c->last_rows = rows;
    c->last_ns = now;
    e->load = c->load;
    e->state = stat_of(&m, "srv.draining") ? CL_DRAINING : CL_SERVING; /* planners skip it */
}

static void model_name(const char *path, char *out, size_t cap) {
    const char *b = strrchr(path, '/');
    b = b ? b + 1 : path;
    size_t len = strlen(b);
    if (len > 5 && !strcmp(b + len - 5, ".gguf")) len -= 5;
    snprintf(out, cap, "%.*s", (int)(len < cap ? len : cap - 1), b);
}

int cluster_cli_register(const cluster_cli_opts *o, srv *s, const srv_params *p, cl_reg **out) {
    struct wire_info in;
    srv_get_info(s, &in);
    cl_entry e;
    memset(&e, 0, sizeof e);
    if (o->advertise) {
        snprintf(e.addr, sizeof e.addr, "%s", o->advertise);
    } else {
        const char *listen = p->listen ? p->listen : "127.0.0.1:7000";
        const char *colon = strrchr(listen, ':');
        int hl = colon ? (int)(colon - listen) : (int)strlen(listen);
        snprintf(e.addr, sizeof e.addr, "%.*s:%u", hl, listen, srv_port(s));
        if (!strncmp(listen, "0.0.0.0:", 8) || !strncmp(listen, "[::]:", 5)) {
            fprintf(stderr, "kvshard serve: listening on every address: --advertise HOST:PORT is needed\n");
            return KVS_ERR_INVALID_ARG;
        }
    }
    model_name(p->model_path, e.name, sizeof e.name);
    digest_hex(in.model_digest, e.digest);
    if (p->tls_cert) snprintf(e.tls_id, sizeof e.tls_id, "mtls");
    e.n_layer = in.n_layer;
    e.first = in.first;
    e.last = in.last;
    e.proto = in.version;
    e.kv_budget = in.kv_budget_bytes;
    /* One registration per process: the thread reads it until cl_reg_stop, so it is static. */
    static reg_fill_ctx fc_store;
    reg_fill_ctx *fc = &fc_store;
    memset(fc, 0, sizeof *fc);
    fc->s = s;
    char msg[KVS_MSG_MAX] = "", *password = NULL;
    if (o->password_file && !(password = args_read_token("serve", o->password_file))) return KVS_ERR_IO;
    cl_reg_params rp = {.etcd = {.url = o->url, .ca = o->ca, .cert = o->cert, .key = o->key, .user = o->user,
                                 .password = password},
                        .prefix = o->prefix, .ttl_s = o->ttl_s > 0 ? (int)(o->ttl_s + 0.5) : 10,
                        .fill = reg_fill, .fill_ctx = fc, .log = daemon_log_line, .log_ctx = "serve"};
    int err = cl_reg_start(&rp, &e, out, msg, sizeof msg);
    free(password);
    if (err) {
        fprintf(stderr, "kvshard serve: --cluster: %s\n", msg[0] ? msg : kvs_strerror(err));
    }
    return err;
}

static char *join_addrs(const cl_entry *e, const size_t *idx, size_t n) {
    size_t cap = 1;
    for (size_t k = 0; k < n; k++) cap += strlen(e[idx[k]].addr) + 1;
    char *s = malloc(cap);
    if (!s) return NULL;
    s[0] = 0;
    for (size_t k = 0; k < n; k++) {
        if (k) strcat(s, ",");
        strcat(s, e[idx[k]].addr);
    }
    return s;
}

/* Plans over e[0..n) minus the entries marked in skip; the specs are malloc'd. */
static int plan_specs(const char *cmd, const cluster_cli_opts *o, cl_entry *e, size_t n, char digest[65],
                      char **route_spec, char **spare_spec) {
    char msg[KVS_MSG_MAX] = "";
    int err = cl_pick_model(e, n, o->model, digest, msg, sizeof msg);
    cl_plan p;
    if (!err) err = cl_plan_route(e, n, digest, &p, msg, sizeof msg);
    if (err) {
        fprintf(stderr, "kvshard %s: %s\n", cmd, msg[0] ? msg : kvs_strerror(err));
        return err;
    }
    if (!p.covered) {
        fprintf(stderr, "kvshard %s: the registry has no route over the %u layers of %s", cmd, p.n_layer, digest);
        for (uint32_t g = 0; g < p.n_gaps; g++) fprintf(stderr, "%s[%u, %u)", g ? ", " : " (gaps ", p.gaps[g][0], p.gaps[g][1]);
        fprintf(stderr, "%s\n", p.n_gaps ? ")" : "");
        cl_plan_free(&p);
        return KVS_ERR_NOT_FOUND;
    }
    *route_spec = join_addrs(e, p.hops, p.n_hops);
    *spare_spec = join_addrs(e, p.spares, p.n_spares);
    cl_plan_free(&p);
    if (!*route_spec || !*spare_spec) {
        free(*route_spec);
        free(*spare_spec);
        return KVS_ERR_NOMEM;
    }
    return KVS_OK;
}

int cluster_cli_specs(const char *cmd, const cluster_cli_opts *o, char **route_spec, char **spare_spec) {
    etcd *db = NULL;
    cl_entry *e = NULL;
    size_t n = 0;
    char digest[65];
    int err = cluster_cli_open(cmd, o, 2000, &db);
    if (!err) err = cluster_cli_load(cmd, db, o, &e, &n);
    if (!err) err = plan_specs(cmd, o, e, n, digest, route_spec, spare_spec);
    free(e);
    etcd_close(db);
    return err;
}

/* The entry whose address the message of a failed route_open names, or n. */
static size_t named_entry(const cl_entry *e, size_t n, const char *route_spec, const char *msg) {
    for (size_t i = 0; i < n; i++) {
        char quoted[CL_ADDR_MAX + 2];
        snprintf(quoted, sizeof quoted, "(%s)", e[i].addr);
        if (strstr(route_spec, e[i].addr) && strstr(msg, quoted)) return i;
    }
    return n;
}

/* One open lane route and the shards (indices into cluster_bal.addr) it was counted on. */
typedef struct {
    const route *r;
    unsigned gen;      /* registry generation it was planned or last checked at */
    uint32_t n;
    size_t shard[ROUTE_MAX_HOPS];
} bal_route;

/* Lanes this process has put on each shard (api --cluster): added to the registry's load so that
 * lanes opened together spread over replicas instead of all taking the same best one. A watch on
 * the registry bumps gen when a shard joins or leaves; a lane's route planned at an older gen is
 * re-planned before its next request and replaced when the plan now puts it elsewhere. */
struct cluster_bal {
    pthread_mutex_t mu; /* guards addr, lanes, routes */
    pthread_mutex_t plan_mu; /* held while a lane plans, so that lanes plan one after another */
    const char *cmd;
    cluster_cli_opts o;
    size_t n;
    char (*addr)[CL_ADDR_MAX];
    unsigned *lanes;
    bal_route *routes;
    size_t n_routes;
    char *password;      /* --etcd-password-file, read once for the watch */
    atomic_uint gen;
    atomic_bool stop, watch_up;
    bool watching;
    pthread_t watch;
    pthread_mutex_t wmu;
    pthread_cond_t wcv;
};

#define CLUSTER_LANE_WEIGHT 1e9 /* one lane outweighs any measured load: lanes decide first */
#define CLUSTER_WATCH_RETRY_MS 500 /* a broken watch is opened again this often */

/* Adds the lanes on each shard to e[i].load, minus those of the route `own` (NULL: none). */
static void bal_bias(cluster_bal *b, cl_entry *e, size_t n, const bal_route *own) {
    if (!b) return;
    pthread_mutex_lock(&b->mu);
    for (size_t k = 0; k < b->n; k++) {
        unsigned lanes = b->lanes[k];
        for (uint32_t h = 0; own && h < own->n; h++) lanes -= own->shard[h] == k && lanes > 0;
        for (size_t i = 0; i < n; i++)
            if (!strcmp(b->addr[k], e[i].addr)) e[i].load += CLUSTER_LANE_WEIGHT * lanes;
    }
    pthread_mutex_unlock(&b->mu);
}

/* Counts one lane on each of addrs[0..n) into br (caller holds mu). */
static void bal_add(cluster_bal *b, const char *const *addrs, uint32_t n, bal_route *br) {
    for (uint32_t h = 0; h < n && h < ROUTE_MAX_HOPS; h++) {
        size_t k = 0;
        while (k < b->n && strcmp(b->addr[k], addrs[h])) k++;
        if (k == b->n) {
            void *na = realloc(b->addr, (b->n + 1) * sizeof *b->addr), *nl = na ? realloc(b->lanes, (b->n + 1) * sizeof *b->lanes) : NULL;
            if (na) b->addr = na;
            if (!na || !nl) break;
            b->lanes = nl;
            snprintf(b->addr[k], CL_ADDR_MAX, "%s", addrs[h]);
            b->lanes[k] = 0;
            b->n++;
        }
        b->lanes[k]++;
        if (br) br->shard[br->n++] = k;
    }
}

/* Takes the lane counted in br off the counts (caller holds mu). */
static void bal_sub(cluster_bal *b, const bal_route *br) {
    for (uint32_t h = 0; h < br->n; h++)
        if (b->lanes[br->shard[h]] > 0) b->lanes[br->shard[h]]--;
}

/* A lane's place taken when cluster_bal_stale decided to move it, until the same thread's next
 * cluster_bal_open counts the route it opened: lanes deciding meanwhile see it, so they do not
 * all move to the same emptiest shard at once. */
typedef struct {
    cluster_bal *b;
    bal_route br;
} bal_reservation;
static _Thread_local bal_reservation tl_res;

/* Counts route r's lane on its hops; res (NULL: none), the lane's reservation, is released. */
static void bal_note(cluster_bal *b, const route *r, bal_route *res) {
    if (!b) return;
    route_info ri;
    route_get_info(r, &ri);
    const char *addrs[ROUTE_MAX_HOPS];
    uint32_t n = ri.n_hops < ROUTE_MAX_HOPS ? ri.n_hops : ROUTE_MAX_HOPS;
    for (uint32_t h = 0; h < n; h++) addrs[h] = route_hop_addr(r, h);
    pthread_mutex_lock(&b->mu);
    if (res) bal_sub(b, res);
    bal_route *nr = realloc(b->routes, (b->n_routes + 1) * sizeof *nr);
    if (nr) b->routes = nr;
    bal_route *br = nr ? &b->routes[b->n_routes++] : NULL;
    if (br) *br = (bal_route){.r = r, .gen = atomic_load(&b->gen)};
    bal_add(b, addrs, n, br);
    pthread_mutex_unlock(&b->mu);
}

/* Takes route r off the counts (it is closing or moving). */
static void bal_forget(cluster_bal *b, const route *r) {
    pthread_mutex_lock(&b->mu);
    for (size_t i = 0; i < b->n_routes; i++) {
        if (b->routes[i].r != r) continue;
        bal_sub(b, &b->routes[i]);
        b->routes[i] = b->routes[--b->n_routes];
        break;
    }
    pthread_mutex_unlock(&b->mu);
}

/* What a route asks the registry for when a hop failed and its spares are used up. Lives as long as
 * the process (routes keep a pointer to it); read-only after creation, so lanes share it. */
typedef struct {
    const char *cmd;
    cluster_cli_opts o;
    char digest[CL_DIGEST_HEX + 1];
    pthread_mutex_t mu;  /* guards seen: lanes plan and check hops from several threads */
    cl_entry *seen;      /* the model's entries of the last registry read, for check_hop */
    size_t n_seen;
} live_spares_ctx;

/* Remembers the entries of the model read last (the planned hops and offered spares come from
 * them), so that check_hop can hold each shard's INFO against what its entry advertised. */
static void remember_entries(live_spares_ctx *c, const cl_entry *e, size_t n) {
    if (!c) return;
    cl_entry *copy = calloc(n ? n : 1, sizeof *copy);
    size_t m = 0;
    for (size_t i = 0; copy && i < n; i++)
        if (!strcmp(e[i].digest, c->digest)) copy[m++] = e[i];
    pthread_mutex_lock(&c->mu);
    if (copy) {
        free(c->seen);
        c->seen = copy;
        c->n_seen = m;
    }
    pthread_mutex_unlock(&c->mu);
}

/* route_params.check_hop: a shard whose INFO contradicts its registry entry (model digest, n_layer
 * or layer range) is refused: the entry lies or is stale, and the route must not trust it. A shard
 * without an entry (deregistered since) is judged by the route's own checks alone. */
static int check_entry(void *ctx, const char *addr, const struct wire_info *in, char *msg, size_t cap) {
    live_spares_ctx *c = ctx;
    char hex[65];
    digest_hex(in->model_digest, hex);
    int err = KVS_OK;
    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < c->n_seen && !err; i++) {
        const cl_entry *e = &c->seen[i];
        if (strcmp(e->addr, addr)) continue;
        if (strcmp(e->digest, hex) || e->n_layer != in->n_layer || e->first != in->first || e->last != in->last)
            err = kvs_fail(msg, cap, KVS_ERR_INVALID_ARG,
                           "registry entry advertises layers [%u, %u) of %u of model %.12s but the shard answers "
                           "[%u, %u) of %u of model %.12s in INFO: not used",
                           e->first, e->last, e->n_layer, e->digest, in->first, in->last, in->n_layer, hex);
    }
    pthread_mutex_unlock(&c->mu);
    return err;
}

/* route_params.more_spares: the serving shards of the model with exactly [first, last), lowest
 * load first, read from the registry now. */
static char *live_spares(void *ctx, uint32_t first, uint32_t last) {
    live_spares_ctx *c = ctx;
    etcd *db = NULL;
    cl_entry *e = NULL;
    size_t n = 0;
    if (cluster_cli_open(c->cmd, &c->o, 2000, &db) || cluster_cli_load(c->cmd, db, &c->o, &e, &n)) {
        etcd_close(db);
        return NULL;
    }
    etcd_close(db);
    remember_entries(c, e, n);
    cl_plan p;
    char *spec = NULL;
    if (cl_plan_route(e, n, c->digest, &p, NULL, 0) == KVS_OK) {
        size_t *idx = calloc(p.n_hops + p.n_spares + 1, sizeof *idx), m = 0;
        for (size_t k = 0; idx && k < p.n_hops + p.n_spares; k++) {
            size_t i = k < p.n_hops ? p.hops[k] : p.spares[k - p.n_hops];
            if (e[i].first == first && e[i].last == last) idx[m++] = i;
        }
        spec = idx && m ? join_addrs(e, idx, m) : NULL;
        free(idx);
        cl_plan_free(&p);
    }
    free(e);
    if (spec) fprintf(stderr, "kvshard %s: registry offers %s for layers [%u, %u)\n", c->cmd, spec, first, last);
    return spec;
}

static live_spares_ctx *live_ctx(const char *cmd, const cluster_cli_opts *o, const char *digest) {
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    static live_spares_ctx *ctx; /* one per process: every --cluster command plans one model */
    pthread_mutex_lock(&mu);
    if (!ctx && (ctx = calloc(1, sizeof *ctx)) != NULL) {
        pthread_mutex_init(&ctx->mu, NULL);
        ctx->cmd = cmd;
        ctx->o = *o;
        snprintf(ctx->digest, sizeof ctx->digest, "%s", digest);
    }
    pthread_mutex_unlock(&mu);
    return ctx;
}

static int open_planned(const char *cmd, const cluster_cli_opts *o, const route_params *rp_in, route **out,
                        cluster_bal *b, bal_route *res, char *emsg, size_t ecap) {
    route_params rp_own = *rp_in;
    const route_params *rp = &rp_own;
    etcd *db = NULL;
    cl_entry *e = NULL;
    size_t n = 0;
    int err = cluster_cli_open(cmd, o, 2000, &db);
    if (!err) err = cluster_cli_load(cmd, db, o, &e, &n);
    etcd_close(db);
    bal_bias(b, e, n, res);
    for (int attempt = 0; !err; attempt++) {
        char digest[65], *route_spec = NULL, *spare_spec = NULL, msg[KVS_MSG_MAX] = "";
        if ((err = plan_specs(cmd, o, e, n, digest, &route_spec, &spare_spec))) break;
        live_spares_ctx *lc = live_ctx(cmd, o, digest);
        remember_entries(lc, e, n);
        rp_own.more_spares = live_spares;
        rp_own.more_spares_ctx = lc;
        rp_own.check_hop = lc ? check_entry : NULL;
        rp_own.check_hop_ctx = lc;
        err = route_open(route_spec, spare_spec, rp, out, msg, sizeof msg);
        if (!err) {
            route_info ri;
            char hex[65];
            route_get_info(*out, &ri);
            digest_hex(ri.model_digest, hex);
            if (strcmp(hex, digest)) { /* the hops agree with each other but not with the registry */
                snprintf(msg, sizeof msg, "hop 0 (%s) serves model %s, the registry says %s", route_hop_addr(*out, 0),
                         hex, digest);
                route_close(*out);
                *out = NULL;
                err = KVS_ERR_INVALID_ARG;
            }
        }
        size_t bad = err ? named_entry(e, n, route_spec, msg) : n;
        free(route_spec);
        free(spare_spec);
        if (!err) {
            bal_note(b, *out, res);
            break;
        }
        if (bad == n || attempt >= CLUSTER_MAX_REPLANS) {
            if (emsg) snprintf(emsg, ecap, "%s", msg[0] ? msg : kvs_strerror(err));
            else fprintf(stderr, "kvshard %s: %s\n", cmd, msg[0] ? msg : kvs_strerror(err));
            break;
        }
        fprintf(stderr, "kvshard %s: skipping %s (registry entry layers [%u, %u)): %s\n", cmd, e[bad].addr,
                e[bad].first, e[bad].last, msg);
        e[bad] = e[--n];
        err = KVS_OK;
    }
    if (err && emsg && !emsg[0]) snprintf(emsg, ecap, "no route from the registry: %s", kvs_strerror(err));
    free(e);
    return err;
}

int cluster_cli_route_open(const char *cmd, const cluster_cli_opts *o, const route_params *rp, route **out) {
    return open_planned(cmd, o, rp, out, NULL, NULL, NULL, 0);
}

/* True when r's hops are no longer those its lane was counted on. */
static bool bal_moved(cluster_bal *b, const route *r) {
    route_info ri;
    route_get_info(r, &ri);
    bool moved = false;
    pthread_mutex_lock(&b->mu);
    for (size_t i = 0; i < b->n_routes; i++) {
        const bal_route *br = &b->routes[i];
        if (br->r != r) continue;
        moved = br->n != ri.n_hops;
        for (uint32_t h = 0; h < br->n && !moved; h++) moved = strcmp(b->addr[br->shard[h]], route_hop_addr(r, h)) != 0;
    }
    pthread_mutex_unlock(&b->mu);
    return moved;
}

/* The addresses of r's hops now, "a,b,..." (malloc'd). */
static char *hops_spec(const route *r) {
    route_info ri;
    route_get_info(r, &ri);
    size_t cap = 1;
    for (uint32_t h = 0; h < ri.n_hops; h++) cap += strlen(route_hop_addr(r, h)) + 1;
    char *s = malloc(cap);
    if (!s) return NULL;
    s[0] = 0;
    for (uint32_t h = 0; h < ri.n_hops; h++) {
        if (h) strcat(s, ",");
        strcat(s, route_hop_addr(r, h));
    }
    return s;
}

/* Counts this thread's lane on the shards of spec ("a,b,...") until its next cluster_bal_open. */
static void bal_reserve(cluster_bal *b, const char *spec) {
    char *copy = strdup(spec), *save = NULL;
    const char *addrs[ROUTE_MAX_HOPS];
    uint32_t n = 0;
    for (char *t = copy ? strtok_r(copy, ",", &save) : NULL; t && n < ROUTE_MAX_HOPS; t = strtok_r(NULL, ",", &save))
        addrs[n++] = t;
    pthread_mutex_lock(&b->mu);
    tl_res.b = b;
    tl_res.br = (bal_route){0};
    bal_add(b, addrs, n, &tl_res.br);
    pthread_mutex_unlock(&b->mu);
    free(copy);
}

/* True when the registry changed since r was planned and a plan made now (with r's own lanes left
 * out) puts its lane on other shards; r is then off the counts. */
bool cluster_bal_stale(void *ctx, const route *r, bool closing) {
    cluster_bal *b = ctx;
    if (closing) {
        bal_forget(b, r);
        return false;
    }
    unsigned gen = atomic_load(&b->gen);
    bal_route own = {0};
    bool found = false;
    if (bal_moved(b, r)) { /* the route replaced a hop from its spares: count its lane where it is now */
        bal_forget(b, r);
        bal_note(b, r, NULL);
        pthread_mutex_lock(&b->mu);
        for (size_t i = 0; i < b->n_routes; i++)
            if (b->routes[i].r == r) b->routes[i].gen = gen - 1; /* and re-plan it below */
        pthread_mutex_unlock(&b->mu);
    }
    pthread_mutex_lock(&b->mu);
    for (size_t i = 0; i < b->n_routes && !found; i++)
        if (b->routes[i].r == r && (found = b->routes[i].gen != gen)) {
            b->routes[i].gen = gen;
            own = b->routes[i];
        }
    pthread_mutex_unlock(&b->mu);
    if (!found) return false;
    etcd *db = NULL;
    cl_entry *e = NULL;
    size_t n = 0;
    char digest[65], *want = NULL, *spares = NULL, *have = NULL;
    bool stale = false;
    pthread_mutex_lock(&b->plan_mu); /* one lane plans at a time: each sees where the others went */
    if (!cluster_cli_open(b->cmd, &b->o, 2000, &db) && !cluster_cli_load(b->cmd, db, &b->o, &e, &n)) {
        bal_bias(b, e, n, &own);
        if (!plan_specs(b->cmd, &b->o, e, n, digest, &want, &spares) && (have = hops_spec(r)) != NULL)
            stale = strcmp(want, have) != 0;
    }
    etcd_close(db);
    if (stale) {
        fprintf(stderr, "kvshard %s: registry changed: a lane moves from %s to %s\n", b->cmd, have, want);
        bal_forget(b, r);
        bal_reserve(b, want);
    }
    pthread_mutex_unlock(&b->plan_mu);
    free(e);
    free(want);
    free(spares);
    free(have);
    return stale;
}

static void bal_on_event(void *ctx, int event, const char *key) {
    cluster_bal *b = ctx;
    (void)key;
    if (event == ETCD_WATCHING) atomic_store(&b->watch_up, true);
    if (event != ETCD_MODIFIED) atomic_fetch_add(&b->gen, 1); /* a shard joined or left (or changes were missed) */
}

static bool bal_stopping(void *ctx) { return atomic_load(&((cluster_bal *)ctx)->stop); }

/* The watch thread: one streaming watch on the shards' prefix, opened again after it breaks; the
 * first message of every new watch bumps gen, covering changes missed meanwhile. */
static void *bal_watch_main(void *arg) {
    cluster_bal *b = arg;
    char prefix[300];
    snprintf(prefix, sizeof prefix, "%sshards/", b->o.prefix ? b->o.prefix : CL_DEFAULT_PREFIX);
    etcd_watch_cb cb = {.on_event = bal_on_event, .stop = bal_stopping, .ctx = b};
    bool quiet = false;
    while (!atomic_load(&b->stop)) {
        char msg[KVS_MSG_MAX] = "";
        etcd *db = NULL;
        etcd_params ep = {.url = b->o.url, .ca = b->o.ca, .cert = b->o.cert, .key = b->o.key, .user = b->o.user,
                          .password = b->password, .timeout_ms = 2000};
        atomic_store(&b->watch_up, false);
        int err = etcd_open(&ep, &db, msg, sizeof msg);
        if (!err) err = etcd_watch_prefix(db, prefix, &cb, msg, sizeof msg);
        etcd_close(db);
        if (atomic_load(&b->watch_up)) quiet = false;
        if (err && !quiet) fprintf(stderr, "kvshard %s: registry watch: %s (retrying)\n", b->cmd, msg);
        quiet = quiet || err;
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += CLUSTER_WATCH_RETRY_MS * 1000000L;
        until.tv_sec += until.tv_nsec / 1000000000L;
        until.tv_nsec %= 1000000000L;
        pthread_mutex_lock(&b->wmu);
        while (!atomic_load(&b->stop) && pthread_cond_timedwait(&b->wcv, &b->wmu, &until) != ETIMEDOUT) {
        }
        pthread_mutex_unlock(&b->wmu);
    }
    return NULL;
}

cluster_bal *cluster_bal_new(const char *cmd, const cluster_cli_opts *o) {
    cluster_bal *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    pthread_mutex_init(&b->mu, NULL);
    pthread_mutex_init(&b->plan_mu, NULL);
    pthread_mutex_init(&b->wmu, NULL);
    pthread_cond_init(&b->wcv, NULL);
    b->cmd = cmd;
    b->o = *o;
    if (o->password_file && !(b->password = args_read_token(cmd, o->password_file))) {
        cluster_bal_free(b);
        return NULL;
    }
    b->watching = pthread_create(&b->watch, NULL, bal_watch_main, b) == 0;
    if (!b->watching) fprintf(stderr, "kvshard %s: no registry watch (cannot start a thread)\n", cmd);
    return b;
}


int cluster_bal_open(void *ctx, const route_params *rp, route **out, char *msg, size_t cap) {
    cluster_bal *b = ctx;
    if (msg && cap) msg[0] = 0;
    bal_route *res = tl_res.b == b ? &tl_res.br : NULL;
    pthread_mutex_lock(&b->plan_mu); /* one lane plans at a time: each sees where the others went */
    int err = open_planned(b->cmd, &b->o, rp, out, b, res, msg, cap);
    if (err && res) {
        pthread_mutex_lock(&b->mu);
        bal_sub(b, res);
        pthread_mutex_unlock(&b->mu);
    }
    pthread_mutex_unlock(&b->plan_mu);
    tl_res.b = NULL;
    return err;
}

void cluster_bal_free(cluster_bal *b) {
    if (!b) return;
    if (b->watching) {
        pthread_mutex_lock(&b->wmu);
        atomic_store(&b->stop, true);
        pthread_cond_signal(&b->wcv);
        pthread_mutex_unlock(&b->wmu);
        pthread_join(b->watch, NULL);
    }
    pthread_mutex_destroy(&b->mu);
    pthread_mutex_destroy(&b->plan_mu);
    pthread_mutex_destroy(&b->wmu);
    pthread_cond_destroy(&b->wcv);
    free(b->addr);
    free(b->lanes);
    free(b->routes);
    free(b->password);
    free(b);
}
