/* The route planner and the registry codec (src/cluster/plan.h, registry.h): pure functions. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plan.h"
#include "registry.h"
#include "test.h"
#include "util.h"

#define DA "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
#define DB "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"

static cl_entry ent(const char *addr, const char *digest, uint32_t n_layer, uint32_t first, uint32_t last, double load) {
    cl_entry e;
    memset(&e, 0, sizeof e);
    snprintf(e.addr, sizeof e.addr, "%s", addr);
    snprintf(e.name, sizeof e.name, "%s", digest[0] == 'a' ? "model-a" : "model-b");
    snprintf(e.digest, sizeof e.digest, "%s", digest);
    e.n_layer = n_layer;
    e.first = first;
    e.last = last;
    e.proto = 2;
    e.kv_budget = 1000;
    e.load = load;
    return e;
}

/* The route's addresses joined by ",", for comparisons that print both sides. */
static const char *route_text(const cl_entry *e, const cl_plan *p, char *buf, size_t cap) {
    buf[0] = 0;
    for (size_t h = 0; h < p->n_hops; h++)
        snprintf(buf + strlen(buf), cap - strlen(buf), "%s%s", h ? "," : "", e[p->hops[h]].addr);
    return buf;
}

#define CHECK_ROUTE(e, p, want)                                                             \
    do {                                                                                    \
        char got_[1024];                                                                    \
        route_text(e, p, got_, sizeof got_);                                                \
        if (strcmp(got_, want)) {                                                           \
            fprintf(stderr, "%s:%d: route '%s', want '%s'\n", __FILE__, __LINE__, got_, want); \
            test_failures_++;                                                               \
        }                                                                                   \
    } while (0)

static void test_coverage_and_fewest_hops(void) {
    cl_entry e[] = {
        ent("h:1", DA, 6, 0, 2, 0), ent("h:2", DA, 6, 2, 4, 0), ent("h:3", DA, 6, 4, 6, 0),
        ent("h:4", DA, 6, 0, 4, 5), /* fewer hops wins over a lower load */
        ent("h:9", DB, 6, 0, 6, 0), /* another model: never in the plan */
    };
    cl_plan p;
    CHECK_EQ_INT(cl_plan_route(e, 5, DA, &p, NULL, 0), KVS_OK);
    CHECK(p.covered);
    CHECK_EQ_INT(p.n_layer, 6);
    CHECK_EQ_INT(p.n_gaps, 0);
    CHECK_ROUTE(e, &p, "h:4,h:3");
    CHECK_EQ_INT(p.n_spares, 2);
    cl_plan_free(&p);
}

static void test_gaps(void) {
    cl_entry e[] = {ent("h:1", DA, 8, 0, 2, 0), ent("h:2", DA, 8, 3, 5, 0), ent("h:3", DA, 8, 5, 7, 0)};
    cl_plan p;
    CHECK_EQ_INT(cl_plan_route(e, 3, DA, &p, NULL, 0), KVS_OK);
    CHECK(!p.covered);
    CHECK_EQ_INT(p.n_hops, 0);
    CHECK_EQ_INT(p.n_gaps, 2);
    CHECK_EQ_INT(p.gaps[0][0], 2);
    CHECK_EQ_INT(p.gaps[0][1], 3);
    CHECK_EQ_INT(p.gaps[1][0], 7);
    CHECK_EQ_INT(p.gaps[1][1], 8);
    cl_plan_free(&p);
    /* Overlapping ranges cover every layer but meet at no boundary: no gap, and no route. */
    cl_entry o[] = {ent("h:1", DA, 4, 0, 3, 0), ent("h:2", DA, 4, 2, 4, 0)};
    CHECK_EQ_INT(cl_plan_route(o, 2, DA, &p, NULL, 0), KVS_OK);
    CHECK(!p.covered);
    CHECK_EQ_INT(p.n_gaps, 0);
    cl_plan_free(&p);
    /* A draining shard covers nothing. */
    cl_entry d[] = {ent("h:1", DA, 4, 0, 4, 0)};
    d[0].state = CL_DRAINING;
    CHECK_EQ_INT(cl_plan_route(d, 1, DA, &p, NULL, 0), KVS_OK);
    CHECK(!p.covered);
    CHECK_EQ_INT(p.n_gaps, 1);
    cl_plan_free(&p);
    CHECK_EQ_INT(cl_plan_route(d, 1, DB, &p, NULL, 0), KVS_ERR_NOT_FOUND);
}

/* Without the [2, 6) shard, the route is re-planned from shards that split its range differently. */
static void test_split_replacement(void) {
    cl_entry e[] = {ent("h:1", DA, 6, 0, 2, 0), ent("h:2", DA, 6, 2, 6, 0), ent("h:3", DA, 6, 2, 3, 0),
                    ent("h:4", DA, 6, 3, 6, 0)};
    cl_plan p;
    CHECK_EQ_INT(cl_plan_route(e, 4, DA, &p, NULL, 0), KVS_OK);
    CHECK_ROUTE(e, &p, "h:1,h:2");
    cl_plan_free(&p);
    e[1].state = CL_DRAINING;
    CHECK_EQ_INT(cl_plan_route(e, 4, DA, &p, NULL, 0), KVS_OK);
    CHECK(p.covered);
    CHECK_ROUTE(e, &p, "h:1,h:3,h:4");
    cl_plan_free(&p);
}

static void test_ties(void) {
    /* Equal hops: the lower load wins; equal load: more free KV; then the lower address. */
    cl_entry e[] = {ent("h:5", DA, 4, 0, 4, 2.0), ent("h:6", DA, 4, 0, 4, 1.0), ent("h:7", DA, 4, 0, 4, 1.0)};
    e[1].kv_used = 900;
    cl_plan p;
    CHECK_EQ_INT(cl_plan_route(e, 3, DA, &p, NULL, 0), KVS_OK);
    CHECK_ROUTE(e, &p, "h:7");
    CHECK_EQ_INT(p.n_spares, 2);
    CHECK(!strcmp(e[p.spares[0]].addr, "h:6")); /* spares: lowest load first */
    cl_plan_free(&p);
    cl_entry f[] = {ent("h:9", DA, 4, 0, 4, 1.0), ent("h:8", DA, 4, 0, 4, 1.0)};
    CHECK_EQ_INT(cl_plan_route(f, 2, DA, &p, NULL, 0), KVS_OK);
    CHECK_ROUTE(f, &p, "h:8");
    cl_plan_free(&p);
}

static void test_pick_model(void) {
    cl_entry e[] = {ent("h:1", DA, 4, 0, 4, 0), ent("h:2", DB, 4, 0, 4, 0)};
    char d[CL_DIGEST_HEX + 1];
    char msg[256] = "";
    CHECK_EQ_INT(cl_pick_model(e, 2, NULL, d, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    CHECK(strstr(msg, "--model") != NULL);
    CHECK_EQ_INT(cl_pick_model(e, 2, "model-b", d, NULL, 0), KVS_OK);
    CHECK(!strcmp(d, DB));
    CHECK_EQ_INT(cl_pick_model(e, 2, DA, d, NULL, 0), KVS_OK);
    CHECK(!strcmp(d, DA));
    CHECK_EQ_INT(cl_pick_model(e, 1, NULL, d, NULL, 0), KVS_OK);
    CHECK_EQ_INT(cl_pick_model(e, 2, "nope", d, NULL, 0), KVS_ERR_NOT_FOUND);
}

static void test_auto(void) {
    uint32_t a = 0, b = 0;
    cl_plan_auto(NULL, 0, DA, 5, 2, &a, &b); /* empty registry: no boundary pair fits */
    CHECK_EQ_INT(a, 0);
    CHECK_EQ_INT(b, 2);
    cl_entry e[] = {ent("h:1", DA, 5, 0, 2, 0), ent("h:2", DA, 5, 2, 4, 0), ent("h:3", DA, 5, 4, 5, 0),
                    ent("h:4", DA, 5, 0, 2, 0), ent("h:5", DA, 5, 2, 4, 0)};
    cl_plan_auto(e, 5, DA, 5, 2, &a, &b); /* [4, 5) has one replica, the others two */
    CHECK_EQ_INT(a, 4);
    CHECK_EQ_INT(b, 5);
    cl_plan_auto(e, 3, DA, 5, 2, &a, &b); /* all one replica: the longest, then the lowest first */
    CHECK_EQ_INT(a, 0);
    CHECK_EQ_INT(b, 2);
    cl_plan_auto(e, 3, DA, 5, 0, &a, &b); /* no limit: the whole model */
    CHECK_EQ_INT(a, 0);
    CHECK_EQ_INT(b, 5);
}

static void test_codec(void) {
    cl_entry e = ent("10.0.0.7:7001", DA, 22, 11, 22, 0.25);
    e.kv_used = 123456789012ull;
    e.sessions = 7;
    e.state = CL_DRAINING;
    snprintf(e.tls_id, sizeof e.tls_id, "CN=node1");
    char *json = cl_entry_encode(&e);
    CHECK(json != NULL);
    cl_entry d;
    char msg[256] = "";
    CHECK_EQ_INT(cl_entry_decode(json, strlen(json), &d, msg, sizeof msg), KVS_OK);
    CHECK(!memcmp(&d, &e, sizeof d) || (fprintf(stderr, "round trip differs: %s\n", json), 0));
    char key[512];
    cl_entry_key(&e, CL_DEFAULT_PREFIX, key, sizeof key);
    CHECK(!strcmp(key, "/kvshard/v1/shards/" DA "/10.0.0.7:7001") || (fprintf(stderr, "key %s\n", key), 0));
    free(json);
    static const char *bad[] = {
        "", "[]", "{}", "not json",
        "{\"addr\":\"h:1\",\"name\":\"m\",\"digest\":\"" DA "\",\"tls_id\":\"\",\"n_layer\":4,\"layers\":[3,2],"
        "\"proto\":2,\"kv_budget\":1,\"kv_used\":0,\"sessions\":0,\"load\":0,\"state\":\"serving\"}",
        "{\"addr\":\"h:1\",\"name\":\"m\",\"digest\":\"" DA "\",\"tls_id\":\"\",\"n_layer\":4,\"layers\":[0,5],"
        "\"proto\":2,\"kv_budget\":1,\"kv_used\":0,\"sessions\":0,\"load\":0,\"state\":\"serving\"}",
        "{\"addr\":\"h\",\"name\":\"m\",\"digest\":\"" DA "\",\"tls_id\":\"\",\"n_layer\":4,\"layers\":[0,4],"
        "\"proto\":2,\"kv_budget\":1,\"kv_used\":0,\"sessions\":0,\"load\":0,\"state\":\"serving\"}",
        "{\"addr\":\"h:1\",\"name\":\"m\",\"digest\":\"XYZ\",\"tls_id\":\"\",\"n_layer\":4,\"layers\":[0,4],"
        "\"proto\":2,\"kv_budget\":1,\"kv_used\":0,\"sessions\":0,\"load\":0,\"state\":\"serving\"}",
        "{\"addr\":\"h:1\",\"name\":\"m\",\"digest\":\"" DA "\",\"tls_id\":\"\",\"n_layer\":4,\"layers\":[0,4],"
        "\"proto\":2,\"kv_budget\":1,\"kv_used\":0,\"sessions\":0,\"load\":-1,\"state\":\"serving\"}",
        "{\"addr\":\"h:1\",\"name\":\"m\",\"digest\":\"" DA "\",\"tls_id\":\"\",\"n_layer\":4,\"layers\":[0,4],"
        "\"proto\":2,\"kv_budget\":1,\"kv_used\":0,\"sessions\":0,\"load\":0,\"state\":\"gone\"}",
        "{\"addr\":\"h:1\",\"name\":\"m\",\"digest\":\"" DA "\",\"tls_id\":\"\",\"n_layer\":4,\"layers\":[0,4],"
        "\"proto\":2,\"kv_budget\":\"1\",\"kv_used\":0,\"sessions\":0,\"load\":0,\"state\":\"serving\"}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        msg[0] = 0;
        int err = cl_entry_decode(bad[i], strlen(bad[i]), &d, msg, sizeof msg);
        if (err != KVS_ERR_FORMAT || !msg[0]) {
            fprintf(stderr, "bad entry %zu accepted (err %d, msg '%s'): %s\n", i, err, msg, bad[i]);
            test_failures_++;
        }
    }
}

int main(void) {
    test_coverage_and_fewest_hops();
    test_gaps();
    test_split_replacement();
    test_ties();
    test_pick_model();
    test_auto();
    test_codec();
    if (test_failures_) fprintf(stderr, "%d failure(s)\n", test_failures_);
    else printf("ok\n");
    return test_failures_ ? 1 : 0;
}
