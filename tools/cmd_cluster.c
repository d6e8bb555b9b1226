/* kvshard cluster status: what the etcd registry holds, per model (docs/cluster.md). */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cluster_cli.h"
#include "util.h"

static void cluster_usage(FILE *f) {
    fprintf(f,
            "usage: kvshard cluster status --cluster URL [--json] [--model NAME|DIGEST]\n"
            "  per model: n_layer, whether [0, n_layer) has a route, the gaps, and every shard with its\n"
            "  address, layers, state, sessions, KV used/budget and load. Exit status 1 when a model\n"
            "  has no route (a gap), 2 on bad usage, 3 when the registry cannot be read.\n"
            CLUSTER_CLI_USAGE);
}

static cJSON *model_json(const cl_entry *e, size_t n, const cl_plan *p) {
    cJSON *m = cJSON_CreateObject();
    for (size_t i = 0; i < n; i++)
        if (!strcmp(e[i].digest, p->digest)) {
            cJSON_AddStringToObject(m, "name", e[i].name);
            break;
        }
    cJSON_AddStringToObject(m, "digest", p->digest);
    cJSON_AddNumberToObject(m, "n_layer", p->n_layer);
    cJSON_AddBoolToObject(m, "covered", p->covered);
    cJSON *gaps = cJSON_AddArrayToObject(m, "gaps");
    for (uint32_t g = 0; g < p->n_gaps; g++) {
        cJSON *pair = cJSON_CreateArray();
        cJSON_AddItemToArray(pair, cJSON_CreateNumber(p->gaps[g][0]));
        cJSON_AddItemToArray(pair, cJSON_CreateNumber(p->gaps[g][1]));
        cJSON_AddItemToArray(gaps, pair);
    }
    cJSON *shards = cJSON_AddArrayToObject(m, "shards");
    for (size_t i = 0; i < n; i++) {
        if (strcmp(e[i].digest, p->digest)) continue;
        cJSON *s = cJSON_CreateObject();
        cJSON_AddStringToObject(s, "addr", e[i].addr);
        cJSON *l = cJSON_AddArrayToObject(s, "layers");
        cJSON_AddItemToArray(l, cJSON_CreateNumber(e[i].first));
        cJSON_AddItemToArray(l, cJSON_CreateNumber(e[i].last));
        cJSON_AddStringToObject(s, "state", cl_state_name(e[i].state));
        cJSON_AddNumberToObject(s, "sessions", e[i].sessions);
        cJSON_AddNumberToObject(s, "kv_used", (double)e[i].kv_used);
        cJSON_AddNumberToObject(s, "kv_budget", (double)e[i].kv_budget);
        cJSON_AddNumberToObject(s, "load", e[i].load);
        cJSON_AddItemToArray(shards, s);
    }
    return m;
}

static void print_text(const cJSON *models) {
    const cJSON *m;
    cJSON_ArrayForEach(m, models) {
        const cJSON *gaps = cJSON_GetObjectItem(m, "gaps"), *g, *s;
        printf("model %s (%s): %d layers, %s", cJSON_GetObjectItem(m, "name")->valuestring,
               cJSON_GetObjectItem(m, "digest")->valuestring, cJSON_GetObjectItem(m, "n_layer")->valueint,
               cJSON_IsTrue(cJSON_GetObjectItem(m, "covered")) ? "covered" : "NOT covered");
        cJSON_ArrayForEach(g, gaps) printf(" gap [%d, %d)", cJSON_GetArrayItem(g, 0)->valueint, cJSON_GetArrayItem(g, 1)->valueint);
        printf("\n");
        cJSON_ArrayForEach(s, cJSON_GetObjectItem(m, "shards")) {
            const cJSON *l = cJSON_GetObjectItem(s, "layers");
            printf("  %-24s [%d, %d) %-8s sessions %d kv %.0f/%.0f load %.2f\n", cJSON_GetObjectItem(s, "addr")->valuestring,
                   cJSON_GetArrayItem(l, 0)->valueint, cJSON_GetArrayItem(l, 1)->valueint,
                   cJSON_GetObjectItem(s, "state")->valuestring, cJSON_GetObjectItem(s, "sessions")->valueint,
                   cJSON_GetObjectItem(s, "kv_used")->valuedouble, cJSON_GetObjectItem(s, "kv_budget")->valuedouble,
                   cJSON_GetObjectItem(s, "load")->valuedouble);
        }
    }
}

/* One cl_plan per distinct digest (filtered by --model), added to models; false on a gap. */
static int add_models(const cluster_cli_opts *o, const cl_entry *e, size_t n, cJSON *models, bool *all_covered) {
    for (size_t i = 0; i < n; i++) {
        bool seen = false;
        for (size_t j = 0; j < i && !seen; j++) seen = !strcmp(e[j].digest, e[i].digest);
        if (seen) continue;
        if (o->model && o->model[0] && strcmp(o->model, e[i].digest) && strcmp(o->model, e[i].name)) continue;
        cl_plan p;
        char msg[KVS_MSG_MAX] = "";
        int err = cl_plan_route(e, n, e[i].digest, &p, msg, sizeof msg);
        if (err) {
            fprintf(stderr, "kvshard cluster: %s\n", msg[0] ? msg : kvs_strerror(err));
            return err;
        }
        *all_covered &= p.covered;
        cJSON_AddItemToArray(models, model_json(e, n, &p));
        cl_plan_free(&p);
    }
    return KVS_OK;
}

int cmd_cluster(int argc, char **argv) {
    cluster_cli_opts o = {0};
    bool json = false;
    if (argc < 2 || strcmp(argv[1], "status")) {
        if (argc >= 2 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))) {
            cluster_usage(stdout);
            return 0;
        }
        cluster_usage(stderr);
        return 2;
    }
    for (int i = 2; i < argc; i++) {
        int so = cluster_cli_opt("cluster", argc, argv, &i, &o);
        if (so < 0) return 2;
        if (so > 0) continue;
        if (!strcmp(argv[i], "--json")) json = true;
        else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) { cluster_usage(stdout); return 0; }
        else { fprintf(stderr, "kvshard cluster: unknown option '%s'\n", argv[i]); cluster_usage(stderr); return 2; }
    }
    if (!o.url) {
        fprintf(stderr, "kvshard cluster: --cluster URL is required\n");
        return 2;
    }
    etcd *db = NULL;
    cl_entry *e = NULL;
    size_t n = 0;
    if (cluster_cli_open("cluster", &o, 5000, &db) || cluster_cli_load("cluster", db, &o, &e, &n)) {
        etcd_close(db);
        return 3;
    }
    etcd_close(db);
    cJSON *root = cJSON_CreateObject();
    cJSON *models = cJSON_AddArrayToObject(root, "models");
    bool covered = true;
    int err = add_models(&o, e, n, models, &covered);
    if (!err && json) {
        char *s = cJSON_PrintUnformatted(root);
        printf("%s\n", s ? s : "{}");
        free(s);
    } else if (!err) {
        if (n == 0) printf("no shard is registered\n");
        print_text(models);
    }
    cJSON_Delete(root);
    free(e);
    if (err) return 3;
    return covered ? 0 : 1;
}
