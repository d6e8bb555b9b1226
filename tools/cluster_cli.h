/* Command-line glue between the subcommands and the cluster registry (src/cluster, docs/cluster.md):
 * the shared --cluster options, a shard's registration, and a client's route from the plan. */
#ifndef KVS_CLUSTER_CLI_H
#define KVS_CLUSTER_CLI_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "cluster_reg.h"
#include "etcd.h"
#include "plan.h"
#include "registry.h"
#include "route.h"
#include "server.h"

typedef struct {
    const char *url;                   /* --cluster URL (NULL: no cluster) */
    const char *model;                 /* --model NAME|DIGEST */
    const char *prefix;                /* --cluster-prefix (default CL_DEFAULT_PREFIX) */
    const char *ca, *cert, *key;       /* --etcd-ca / --etcd-cert / --etcd-key */
    const char *user, *password_file;  /* --etcd-user / --etcd-password-file */
    const char *advertise;             /* serve: --advertise HOST:PORT */
    double ttl_s;                      /* serve: --cluster-ttl S (default 10) */
    long max_layers;                   /* serve: --max-layers N with --layers auto */
} cluster_cli_opts;

#define CLUSTER_CLI_USAGE                                                                          \
    "  --cluster URL        the etcd registry, e.g. http://10.0.0.1:2379 (docs/cluster.md)\n"      \
    "  --cluster-prefix P   key prefix in etcd (default " CL_DEFAULT_PREFIX ")\n"                   \
    "  --etcd-ca F / --etcd-cert F / --etcd-key F   TLS to etcd (https:// URL)\n"                  \
    "  --etcd-user U / --etcd-password-file F        etcd authentication\n"

/* Consumes argv[*i] (and its value) when it is a cluster option: 1; 0 when not one; -1 after
 * printing when its value is missing or malformed. */
int cluster_cli_opt(const char *cmd, int argc, char **argv, int *i, cluster_cli_opts *o);
/* Opens the registry: *db on success, after printing "kvshard CMD: ..." otherwise. */
int cluster_cli_open(const char *cmd, const cluster_cli_opts *o, int timeout_ms, etcd **db);
/* Reads every entry under the prefix; entries that do not decode are skipped with a line on stderr. */
int cluster_cli_load(const char *cmd, etcd *db, const cluster_cli_opts *o, cl_entry **e, size_t *n);

/* serve --layers auto: the range to take, from the registry and the model file. */
int cluster_cli_auto_layers(const cluster_cli_opts *o, const char *model_path, uint32_t *first, uint32_t *last);
/* serve --cluster: starts the registration of the created shard s. */
int cluster_cli_register(const cluster_cli_opts *o, srv *s, const srv_params *p, cl_reg **out);

/* Clients: plans a route of the chosen model, opens it with the plan's spares (route_open), and
 * re-plans without a shard that fails to connect or whose INFO does not match its entry (logged
 * on stderr), a bounded number of times. */
int cluster_cli_route_open(const char *cmd, const cluster_cli_opts *o, const route_params *rp, route **out);
/* The route and spare specs ("h:p,h:p") of the current plan, malloc'd; for callers that open
 * routes themselves (the API's lanes). */
int cluster_cli_specs(const char *cmd, const cluster_cli_opts *o, char **route_spec, char **spare_spec);

/* api --cluster: each lane's route planned from the live registry (on every open, so a lane whose
 * route broke re-plans from the shards alive then), with the lanes this process already put on a
 * shard counted as load so that lanes spread evenly over replicas. cluster_bal_open has the shape
 * of http_params.open_route and may be called from several threads. */
typedef struct cluster_bal cluster_bal;
cluster_bal *cluster_bal_new(const char *cmd, const cluster_cli_opts *o);
int cluster_bal_open(void *ctx, const route_params *rp, route **out, char *msg, size_t cap);
/* http_params.route_stale: a lane's route is re-planned before its next request once the registry
 * watch saw a shard join or leave, and replaced when the plan now puts that lane elsewhere. */
bool cluster_bal_stale(void *ctx, const route *r, bool closing);
void cluster_bal_free(cluster_bal *b);

#endif /* KVS_CLUSTER_CLI_H */
