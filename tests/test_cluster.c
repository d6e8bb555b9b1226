/* The cluster registry end to end against a real etcd (docs/cluster.md): shards register and show in
 * `cluster status --json`, a clean stop deregisters at once, a kill -9 disappears within the lease
 * TTL, `generate --cluster` equals `kvshard run` greedy and skips an entry it cannot reach, and a
 * gap makes `cluster status` exit non-zero. Skips (77) without the etcd binary or stories260K. */
#include "cluster_harness.h"

static void check_generate(const char *model) {
    const char *prompt = "Once upon a time";
    int rc;
    const char *ra[] = {"run", "-m", model, "-p", prompt, "-n", "24", "--temp", "0", "-t", "1", "--json", NULL};
    char *ref_out = run_cmd(ra, &rc);
    CHECK_EQ_INT(rc, 0);
    const char *ga[] = {"generate", "--cluster", g_url, "-p", prompt, "-n", "24", "--temp", "0", "--json", "-v", NULL};
    char *got_out = run_cmd(ga, &rc);
    CHECK_EQ_INT(rc, 0);
    char *ref = generated(ref_out), *got = generated(got_out);
    if (strcmp(ref, got) || !strcmp(ref, "(none)")) {
        fprintf(stderr, "generate --cluster %s\n          run %s\n", got, ref);
        test_failures_++;
    }
    free(ref);
    free(got);
    free(ref_out);
    free(got_out);
}

/* Puts an entry for addr claiming [0, last) of the model whose digest status_out shows, first in
 * the planner's order (the most free KV); no lease: the test deletes it. */
static void put_entry(const char *status_out, const char *addr, uint32_t last, char *key, size_t cap) {
    const char *d = strstr(status_out, "\"digest\":\"");
    cl_entry e;
    memset(&e, 0, sizeof e);
    snprintf(e.addr, sizeof e.addr, "%s", addr);
    snprintf(e.name, sizeof e.name, "stories260K");
    if (d) snprintf(e.digest, sizeof e.digest, "%.64s", d + 10);
    e.n_layer = 5;
    e.first = 0;
    e.last = last;
    e.proto = 2;
    e.kv_budget = 1ull << 40; /* the most free KV: preferred on a tie */
    char *json = cl_entry_encode(&e);
    cl_entry_key(&e, CL_DEFAULT_PREFIX, key, cap);
    etcd *db = NULL;
    etcd_params ep = harness_etcd_params(2000);
    CHECK_EQ_INT(etcd_open(&ep, &db, NULL, 0), 0);
    CHECK_EQ_INT(db ? etcd_put(db, key, json, 0, NULL, 0) : -1, 0);
    etcd_close(db);
    free(json);
}

/* An entry for an address nobody serves: generate must get past it (route_open takes a spare for
 * it, logged with -v). */
static void put_dead_entry(const char *status_out, char *key, size_t cap) {
    put_entry(status_out, "127.0.0.1:1", 2, key, cap);
}

static void delete_key(const char *key) {
    etcd *db = NULL;
    etcd_params ep = harness_etcd_params(2000);
    CHECK_EQ_INT(etcd_open(&ep, &db, NULL, 0), 0);
    CHECK_EQ_INT(db ? etcd_delete(db, key, NULL, 0) : -1, 0);
    etcd_close(db);
}

static void run_checks(const char *model) {
    const char *reg[] = {"--cluster", g_url, "--cluster-ttl", "2", NULL};
    proc_server head, tail, spare;
    CHECK(proc_start_server(&head, g_dir, model, "0:2", reg));
    CHECK(proc_start_server(&tail, g_dir, model, "2:end", reg));
    CHECK(proc_start_server(&spare, g_dir, model, "2:end", reg));
    int rc;
    char *out = wait_shards(3, &rc);
    CHECK_EQ_INT(rc, 0);
    CHECK(strstr(out, "\"covered\":true") != NULL);
    CHECK(strstr(out, "\"n_layer\":5") != NULL);
    CHECK(strstr(out, "\"layers\":[0,2]") != NULL);
    CHECK_EQ_INT(count_of(out, "\"layers\":[2,5]"), 2);
    CHECK(strstr(out, "\"state\":\"serving\"") != NULL);
    char key[512];
    put_dead_entry(out, key, sizeof key);
    free(out);
    check_generate(model);
    char errlog[300];
    snprintf(errlog, sizeof errlog, "%s/cli.log", g_dir);
    char *log = read_text(errlog);
    CHECK(log && strstr(log, "hop 0 (127.0.0.1:1): cannot connect") != NULL);
    free(log);
    delete_key(key);
    /* kill -9: the entry stays until its lease (2 s) expires, then goes. */
    char addr[64];
    snprintf(addr, sizeof addr, "\"addr\":\"127.0.0.1:%d\"", spare.port);
    proc_kill_server(&spare);
    out = wait_shards(2, &rc);
    CHECK(strstr(out, addr) == NULL);
    CHECK_EQ_INT(rc, 0);
    free(out);
    /* A clean stop deregisters: the head's layers become a gap and status says so. */
    CHECK_EQ_INT(proc_stop_server(&head), 0);
    out = wait_shards(1, &rc);
    CHECK_EQ_INT(rc, 1);
    CHECK(strstr(out, "\"covered\":false") != NULL);
    CHECK(strstr(out, "\"gaps\":[[0,2]]") != NULL || (fprintf(stderr, "status: %s\n", out), 0));
    free(out);
    proc_stop_server(&tail);
}

/* A registry entry that lies about a live shard: X serves [0, 3) but its (unleased) entry says
 * [0, 2) and is preferred. Unchecked, the route X + T would fail on T ("previous hop ends at 3")
 * and T would be skipped; the per-hop check refuses X by name instead, and generate equals run. */
static void check_lying_entry(const char *model) {
    const char *reg[] = {"--cluster", g_url, NULL};
    proc_server head, tail, liar;
    CHECK(proc_start_server(&head, g_dir, model, "0:2", reg));
    CHECK(proc_start_server(&tail, g_dir, model, "2:end", reg));
    CHECK(proc_start_server(&liar, g_dir, model, "0:3", NULL));
    int rc;
    char *out = wait_shards(2, &rc);
    char key[512], addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", liar.port);
    put_entry(out, addr, 2, key, sizeof key);
    free(out);
    check_generate(model);
    char errlog[300], want[320];
    snprintf(errlog, sizeof errlog, "%s/cli.log", g_dir);
    snprintf(want, sizeof want, "skipping %s (registry entry layers [0, 2)): hop 0 (%s): registry entry advertises "
             "layers [0, 2) of 5", addr, addr);
    char *log = read_text(errlog);
    if (!log || !strstr(log, want)) {
        fprintf(stderr, "no line \"%s\" in %s\n", want, errlog);
        test_failures_++;
    }
    free(log);
    delete_key(key);
    proc_stop_server(&head);
    proc_stop_server(&tail);
    proc_stop_server(&liar);
}

/* api --cluster with 4 lanes over 2 replicas of each of 2 stages: 2 lanes on every shard (the
 * lanes open their routes at start, one after another, each seeing the lanes already placed). */
static void check_api_balance(const char *model) {
    const char *reg[] = {"--cluster", g_url, NULL};
    proc_server s[4];
    const char *layers[4] = {"0:2", "0:2", "2:end", "2:end"};
    for (int i = 0; i < 4; i++) CHECK(proc_start_server(&s[i], g_dir, model, layers[i], reg));
    int rc;
    free(wait_shards(4, &rc));
    char *argv[] = {"kvshard", "api", "--cluster", g_url, "--lanes", "4", "--listen", "127.0.0.1:0", NULL};
    proc_server api;
    CHECK(proc_start_listener(&api, g_dir, "api", argv));
    for (int i = 0; i < 4; i++) {
        long n = open_conns(s[i].port);
        if (n != 3) {
            fprintf(stderr, "shard %d (%s): %ld connections open, want 2 lanes + this stats call\n", i, layers[i], n);
            test_failures_++;
        }
    }
    proc_stop_server(&api);
    /* --layers auto: with one tail replica gone, a new shard takes the tail's range. */
    CHECK_EQ_INT(proc_stop_server(&s[3]), 0);
    free(wait_shards(3, &rc));
    const char *autoreg[] = {"--cluster", g_url, "--max-layers", "3", NULL};
    CHECK(proc_start_server(&s[3], g_dir, model, "auto", autoreg));
    char *log = read_text(s[3].log);
    CHECK(log && strstr(log, "--layers auto took 2:5 of 5") != NULL);
    free(log);
    char *out = wait_shards(4, &rc);
    CHECK_EQ_INT(count_of(out, "\"layers\":[2,5]"), 2);
    free(out);
    for (int i = 0; i < 4; i++) proc_stop_server(&s[i]);
}

/* etcd killed: shards keep serving (a direct route works); etcd back, empty: every shard has
 * registered again within a bounded wait (the TTL plus a renewal period). */
static pid_t check_etcd_restart(const char *model, pid_t etcd_pid) {
    const char *reg[] = {"--cluster", g_url, "--cluster-ttl", "2", NULL};
    proc_server head, tail;
    CHECK(proc_start_server(&head, g_dir, model, "0:2", reg));
    CHECK(proc_start_server(&tail, g_dir, model, "2:end", reg));
    int rc;
    free(wait_shards(2, &rc));
    kill(etcd_pid, SIGKILL);
    proc_wait(etcd_pid, 10000);
    char route[64];
    snprintf(route, sizeof route, "127.0.0.1:%d,127.0.0.1:%d", head.port, tail.port);
    const char *ga[] = {"generate", "--route", route, "-p", "Once upon a time", "-n", "8", "--temp", "0", NULL};
    char *out = run_cmd(ga, &rc);
    CHECK_EQ_INT(rc, 0);
    CHECK(strlen(out) > 16);
    free(out);
    const char *sa[] = {"cluster", "status", "--cluster", g_url, NULL};
    out = run_cmd(sa, &rc);
    CHECK_EQ_INT(rc, 3); /* the registry cannot be read */
    free(out);
    pid_t pid = start_etcd();
    CHECK(pid > 0);
    out = wait_shards(2, &rc);
    CHECK_EQ_INT(rc, 0);
    CHECK(strstr(out, "\"covered\":true") != NULL);
    free(out);
    proc_stop_server(&head);
    proc_stop_server(&tail);
    return pid;
}

/* A lane's open route loses its tail, which has no spare among those planned at start; a new tail
 * registered since is found in the live registry (route_params.more_spares) and the request
 * succeeds with the same text. */
static void check_live_replan(const char *model) {
    const char *reg[] = {"--cluster", g_url, NULL};
    proc_server head, tail;
    CHECK(proc_start_server(&head, g_dir, model, "0:2", reg));
    CHECK(proc_start_server(&tail, g_dir, model, "2:end", reg));
    int rc;
    free(wait_shards(2, &rc));
    char *argv[] = {"kvshard", "api", "--cluster", g_url, "--lanes", "1", "--listen", "127.0.0.1:0", NULL};
    proc_server api;
    CHECK(proc_start_listener(&api, g_dir, "api", argv));
    const char *body = "{\"prompt\":\"Once upon a time\",\"max_tokens\":12,\"temperature\":0}";
    static http_reply a, b;
    CHECK_EQ_INT(post_completion(api.port, body, &a), 200);
    CHECK_EQ_INT(proc_stop_server(&tail), 0);
    CHECK(proc_start_server(&tail, g_dir, model, "2:end", reg));
    free(wait_shards(2, &rc));
    CHECK_EQ_INT(post_completion(api.port, body, &b), 200);
    const char *ta = strstr(a.buf, "\"text\":"), *tb = strstr(b.buf, "\"text\":");
    CHECK(ta && tb);
    if (ta && tb && strncmp(ta, tb, 48)) {
        fprintf(stderr, "after the re-plan: %.60s\n       before: %.60s\n", tb, ta);
        test_failures_++;
    }
    char *log = read_text(api.log);
    /* The new tail came either from the watch (the lane re-planned before the request) or from
     * route_params.more_spares (the hop failed first), whichever came first. */
    CHECK(log && (strstr(log, "registry offers") || strstr(log, "registry changed")));
    free(log);
    proc_stop_server(&api);
    proc_stop_server(&head);
    proc_stop_server(&tail);
}

static long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* The registry watch: api --cluster with 2 lanes on the only head; a second head started after the
 * api is taken by one lane before a later request (the lane re-plans once the watch reports the new
 * entry), with the same text. Prints the time from starting that `serve --cluster` to its first
 * use by a request (BENCHMARKS.md). */
static void check_watch(const char *model) {
    const char *reg[] = {"--cluster", g_url, NULL};
    proc_server head, tail, head2;
    CHECK(proc_start_server(&head, g_dir, model, "0:2", reg));
    CHECK(proc_start_server(&tail, g_dir, model, "2:end", reg));
    int rc;
    free(wait_shards(2, &rc));
    char *argv[] = {"kvshard", "api", "--cluster", g_url, "--lanes", "2", "--listen", "127.0.0.1:0", NULL};
    proc_server api;
    CHECK(proc_start_listener(&api, g_dir, "api", argv));
    const char *body = "{\"prompt\":\"Once upon a time\",\"max_tokens\":12,\"temperature\":0}";
    static http_reply a, b;
    CHECK_EQ_INT(post_completion(api.port, body, &a), 200);
    long t0 = now_ms(), used_ms = -1;
    CHECK(proc_start_server(&head2, g_dir, model, "0:2", reg));
    for (long t = t0; t - t0 < WAIT_MS && used_ms < 0; t = now_ms()) {
        CHECK_EQ_INT(post_completion(api.port, body, &b), 200);
        char *ta = reply_text(a.buf), *tb = reply_text(b.buf);
        if (!ta || !tb || strcmp(ta, tb)) {
            fprintf(stderr, "after the new head: %s\n            before: %s\n", tb, ta);
            test_failures_++;
        }
        free(ta);
        free(tb);
        if (open_conns(head2.port) >= 2) used_ms = now_ms() - t0; /* a lane's connection + this stats call */
    }
    printf("register-to-use: %ld ms (serve --cluster start to a request using the new shard)\n", used_ms);
    CHECK(used_ms >= 0);
    char *log = read_text(api.log);
    CHECK(log && strstr(log, "registry changed: a lane moves") != NULL);
    free(log);
    proc_stop_server(&api);
    proc_stop_server(&head);
    proc_stop_server(&head2);
    proc_stop_server(&tail);
}

/* True when `cluster status --json` lists the shard at addr in state. */
static bool shard_state_is(const char *addr, const char *state) {
    int rc;
    char *out = status_json(&rc);
    cJSON *o = out ? cJSON_Parse(out) : NULL, *m, *sh;
    free(out);
    bool is = false;
    cJSON_ArrayForEach(m, cJSON_GetObjectItem(o, "models"))
        cJSON_ArrayForEach(sh, cJSON_GetObjectItem(m, "shards")) {
            const cJSON *a = cJSON_GetObjectItem(sh, "addr"), *st = cJSON_GetObjectItem(sh, "state");
            if (cJSON_IsString(a) && cJSON_IsString(st) && !strcmp(a->valuestring, addr))
                is = !strcmp(st->valuestring, state);
        }
    cJSON_Delete(o);
    return is;
}

/* `kvshard drain --cluster`: the drained tail's peers come from the registry (the other tail of
 * the same layers, not the head), its kept session moves there, the registry shows it "draining"
 * while it lingers, and a new `generate --cluster` plans around it with the same text. */
static void check_drain_cluster(const char *model) {
    const char *reg[] = {"--cluster", g_url, "--peer-allow", "127.0.0.1", "--drain-timeout", "60", NULL};
    proc_server head, a, b;
    CHECK(proc_start_server(&head, g_dir, model, "0:2", reg));
    CHECK(proc_start_server(&a, g_dir, model, "2:end", reg));
    int rc;
    free(wait_shards(2, &rc));
    char route[64], addr_a[32], addr_b[32];
    snprintf(route, sizeof route, "127.0.0.1:%d,127.0.0.1:%d", head.port, a.port);
    const char *ga[] = {"generate", "--route", route, "-p", "Once upon a time", "-n", "4", "--keep-session", NULL};
    free(run_cmd(ga, &rc));
    CHECK_EQ_INT(rc, 0);
    CHECK(proc_start_server(&b, g_dir, model, "2:end", reg));
    free(wait_shards(3, &rc));
    snprintf(addr_a, sizeof addr_a, "127.0.0.1:%d", a.port);
    snprintf(addr_b, sizeof addr_b, "127.0.0.1:%d", b.port);
    const char *da[16] = {"drain", addr_a};
    int n = 2;
    cluster_args(da, &n);
    char *out = run_cmd(da, &rc);
    CHECK_EQ_INT(rc, 0);
    char want[96];
    snprintf(want, sizeof want, "peers from the registry: %s\n", addr_b);
    CHECK(out && strstr(out, want) && strstr(out, "done: moved 1 of 1 sessions (0 failed)"));
    if (!out || !strstr(out, want)) fprintf(stderr, "drain --cluster said: %s\n", out ? out : "(nothing)");
    free(out);
    CHECK_EQ_INT(shard_stat(b.port, "move.sessions_in"), 1);
    bool marked = false; /* the registration thread rewrites the entry every few seconds */
    for (int waited = 0; waited <= WAIT_MS && !marked; waited += 100) {
        marked = shard_state_is(addr_a, "draining");
        if (!marked) proc_sleep_ms(100);
    }
    CHECK(marked);
    if (!marked) {
        char *st = status_json(&rc);
        fprintf(stderr, "status: %s\nsrv.draining of %s: %ld\n", st, addr_a, shard_stat(a.port, "srv.draining"));
        free(st);
    }
    const char *gc[] = {"generate", "--cluster", g_url, "-p", "Once upon a time", "-n", "4", "--temp", "0", NULL};
    long rows_a = shard_stat(a.port, "srv.forward_rows"), rows_b = shard_stat(b.port, "srv.forward_rows");
    free(run_cmd(gc, &rc));
    CHECK_EQ_INT(rc, 0);
    CHECK_EQ_INT(shard_stat(a.port, "srv.forward_rows"), rows_a); /* nothing reached the draining shard */
    CHECK(shard_stat(b.port, "srv.forward_rows") > rows_b);
    proc_stop_server(&a);
    proc_stop_server(&b);
    proc_stop_server(&head);
    free(wait_shards(0, &rc));
}

int main(void) {
    char mbuf[512];
    const char *model = test_shared_path("models/stories260K.gguf", mbuf, sizeof mbuf);
    if (!find_etcd()) {
        fprintf(stderr, "skip: no etcd binary (install etcd-server: scripts/deps.sh --test, or set KVS_ETCD)\n");
        return TEST_SKIP_CODE;
    }
    if (!model) return TEST_SKIP_CODE;
    snprintf(g_dir, sizeof g_dir, "/tmp/kvs-cluster-XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    pid_t etcd_pid = start_etcd();
    CHECK(etcd_pid > 0);
    if (etcd_pid > 0) run_checks(model);
    if (etcd_pid > 0) check_lying_entry(model);
    if (etcd_pid > 0) check_watch(model);
    if (etcd_pid > 0) check_api_balance(model);
    if (etcd_pid > 0) check_live_replan(model);
    if (etcd_pid > 0) check_drain_cluster(model);
    if (etcd_pid > 0) etcd_pid = check_etcd_restart(model, etcd_pid);
    stop_etcd(etcd_pid);
    if (test_failures_) fprintf(stderr, "%d failure(s); logs in %s\n", test_failures_, g_dir);
    else printf("ok\n");
    return test_failures_ ? 1 : 0;
}
