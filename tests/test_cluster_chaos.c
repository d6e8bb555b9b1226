/* Churn against a real etcd (docs/cluster.md): STAGES x g_replicas shards of stories260K register,
 * `api --cluster` serves g_clients concurrent streams of greedy completions, and every original shard
 * is killed (-9) in turn and replaced by a new `serve --layers auto` while the streams run; then
 * etcd itself is killed and restarted empty. Checks: no request fails, every completion equals
 * `kvshard run`, each replacement takes the range its victim left, the api (never restarted) ends
 * on replacements only, and the shards register again in the new etcd. Every step waits for a
 * handshake (completions counted, the registry listing the shards), never for a fixed time.
 * Skips (77) without the etcd binary or stories260K. */
#include <cjson/cJSON.h>
#include <pthread.h>
#include <stdatomic.h>

#include "cluster_harness.h"

#define STAGES 3
#define MAX_REPLICAS 8
#define MAX_CLIENTS 32
/* Replicas per stage and concurrent streams: the size, 4 and 16; under a sanitizer (every
 * process several times slower) 2 and 4, the same paths for the memory checks.
 * KVS_CHAOS_REPLICAS / KVS_CHAOS_CLIENTS override both. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
static int g_replicas = 2, g_clients = 4;
#else
static int g_replicas = 4, g_clients = 16;
#endif
#define N_PROMPTS 4
#define N_TOKENS 16

static const char *const k_layers[STAGES] = {"0:2", "2:4", "4:end"};
static const char *const k_taken[STAGES] = {"took 0:2 of 5", "took 2:4 of 5", "took 4:5 of 5"};
static const char *const k_prompts[N_PROMPTS] = {"Once upon a time", "The little dog", "Lily and Tom went",
                                                 "One day, a bird"};
static char *g_ref[N_PROMPTS]; /* what `kvshard run` appends to each prompt */
static int g_api_port;
static atomic_int g_done, g_failed;
static atomic_bool g_stop;
static pthread_mutex_t g_fail_mu = PTHREAD_MUTEX_INITIALIZER;
static char g_first_fail[2400];

static void note_failure(const char *what) {
    atomic_fetch_add(&g_failed, 1);
    pthread_mutex_lock(&g_fail_mu);
    if (!g_first_fail[0]) snprintf(g_first_fail, sizeof g_first_fail, "%s", what);
    pthread_mutex_unlock(&g_fail_mu);
}

/* The generated text of `kvshard run` (its output is the prompt, the text and a newline). */
static char *reference(const char *model, const char *prompt) {
    char n[16];
    snprintf(n, sizeof n, "%d", N_TOKENS);
    const char *ra[] = {"run", "-m", model, "-p", prompt, "-n", n, "--temp", "0", "-t", "1", NULL};
    int rc;
    char *out = run_cmd(ra, &rc);
    CHECK_EQ_INT(rc, 0);
    size_t pl = strlen(prompt), ol = out ? strlen(out) : 0;
    if (!out || ol < pl + 1 || strncmp(out, prompt, pl)) {
        free(out);
        return strdup("(run failed)");
    }
    char *t = strndup(out + pl, ol - pl - 1);
    free(out);
    return t;
}

static void *client_main(void *arg) {
    int id = (int)(intptr_t)arg;
    static _Thread_local http_reply r;
    for (int i = 0; !atomic_load(&g_stop); i++) {
        int k = (id + i) % N_PROMPTS;
        char body[256], what[2300];
        snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":%d,\"temperature\":0}", k_prompts[k], N_TOKENS);
        long st = post_completion(g_api_port, body, &r);
        cJSON *j = st == 200 ? cJSON_Parse(r.buf) : NULL;
        const cJSON *ch = j ? cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(j, "choices"), 0) : NULL;
        const cJSON *text = ch ? cJSON_GetObjectItemCaseSensitive(ch, "text") : NULL;
        if (!cJSON_IsString(text)) {
            snprintf(what, sizeof what, "client %d: HTTP %ld: %.2000s", id, st, r.buf);
            note_failure(what);
        } else if (strcmp(text->valuestring, g_ref[k])) {
            snprintf(what, sizeof what, "client %d: \"%s\" got \"%.900s\", run \"%.900s\"", id, k_prompts[k],
                     text->valuestring, g_ref[k]);
            note_failure(what);
        }
        cJSON_Delete(j);
        atomic_fetch_add(&g_done, 1);
    }
    return NULL;
}

/* Handshake: waits (bounded) until `more` further requests have completed. */
static bool wait_done(int more) {
    int target = atomic_load(&g_done) + more;
    for (int waited = 0; waited < 4 * WAIT_MS; waited += 10) {
        if (atomic_load(&g_done) >= target) return true;
        proc_sleep_ms(10);
    }
    fprintf(stderr, "only %d of %d requests completed in time\n", atomic_load(&g_done), target);
    test_failures_++;
    return false;
}

static bool log_has(const char *path, const char *needle) {
    char *log = read_text(path);
    bool has = log && strstr(log, needle);
    free(log);
    return has;
}

/* Kills every original shard in turn (stage by stage, round-robin) under traffic and starts a
 * replacement with --layers auto once the registry has dropped the victim. */
static void churn(const char *model, proc_server shard[STAGES][MAX_REPLICAS], proc_server fresh[STAGES][MAX_REPLICAS]) {
    const char *autoreg[] = {"--cluster", g_url, "--cluster-ttl", "2", "--max-layers", "2", NULL};
    int rc;
    for (int round = 0; round < STAGES * g_replicas; round++) {
        int st = round % STAGES, rep = round / STAGES;
        proc_kill_server(&shard[st][rep]);
        wait_done(2 * g_clients); /* streams go on over the stage's other replica */
        free(wait_shards(STAGES * g_replicas - 1, &rc));
        CHECK(proc_start_server(&fresh[st][rep], g_dir, model, "auto", autoreg));
        if (!log_has(fresh[st][rep].log, k_taken[st])) {
            fprintf(stderr, "round %d: the replacement did not take %s (log %s)\n", round, k_layers[st],
                    fresh[st][rep].log);
            test_failures_++;
        }
        free(wait_shards(STAGES * g_replicas, &rc));
        wait_done(2 * g_clients);
    }
}

/* etcd killed: the streams go on; etcd back with no data: every shard registers again. */
static pid_t etcd_outage(pid_t etcd_pid) {
    kill(etcd_pid, SIGKILL);
    proc_wait(etcd_pid, 10000);
    wait_done(2 * g_clients);
    pid_t pid = start_etcd();
    CHECK(pid > 0);
    int rc;
    char *out = wait_shards(STAGES * g_replicas, &rc);
    CHECK_EQ_INT(rc, 0);
    free(out);
    wait_done(2 * g_clients);
    return pid;
}

/* Lanes spread over replicas: with traffic going on, waits (bounded) until every replacement holds
 * connections besides the stats call, and no head carries more than 1.5x the mean lanes of a head
 * (a head's connections are its lanes: relay links only reach later stages). The watch re-plans
 * lanes as shards come and go, so the lanes settle there without a restart. */
static void check_spread(proc_server fresh[STAGES][MAX_REPLICAS]) {
    long conns[STAGES][MAX_REPLICAS];
    bool spread = false;
    for (int waited = 0; !spread && waited < 2 * WAIT_MS; waited += 100) {
        spread = true;
        for (int st = 0; st < STAGES; st++)
            for (int rep = 0; rep < g_replicas; rep++) {
                conns[st][rep] = open_conns(fresh[st][rep].port) - 1; /* less this stats call */
                spread = spread && conns[st][rep] >= 1;
                if (st == 0) spread = spread && 2 * conns[st][rep] * g_replicas <= 3 * g_clients;
            }
        if (!spread) proc_sleep_ms(100);
    }
    printf("chaos: connections per replica at the end (stage 0: lanes):");
    for (int st = 0; st < STAGES; st++)
        for (int rep = 0; rep < g_replicas; rep++) printf("%s%ld", rep ? "+" : st ? ", " : " ", conns[st][rep]);
    printf("\n");
    if (!spread) {
        fprintf(stderr, "the lanes did not spread over the replicas (at most 1.5x the mean per head)\n");
        test_failures_++;
    }
}

/* Rows the replacements of each stage computed: the api ended on them, so none may be 0. */
static void check_replacements_used(proc_server fresh[STAGES][MAX_REPLICAS]) {
    for (int st = 0; st < STAGES; st++) {
        long rows = 0;
        for (int rep = 0; rep < g_replicas; rep++) {
            long n = shard_stat(fresh[st][rep].port, "srv.forward_rows");
            rows += n > 0 ? n : 0;
        }
        if (rows <= 0) {
            fprintf(stderr, "stage %s: no replacement computed a row\n", k_layers[st]);
            test_failures_++;
        }
    }
}

/* The api's recovery events from its log: hops re-routed, positions replayed, lanes moved. */
static void print_recovery(const char *log_path) {
    char *log = read_text(log_path);
    int reroutes = 0, moves = count_of(log, "registry changed: a lane moves");
    long replayed = 0;
    for (const char *p = log; p && (p = strstr(p, "re-route: hop")) != NULL; p++) {
        const char *q = strstr(p, "; ");
        q = q ? strstr(q + 2, "; ") : NULL;
        if (q) replayed += strtol(q + 2, NULL, 10);
        reroutes++;
    }
    printf("chaos: %d re-routes, %ld positions replayed, %d lane moves after registry changes\n", reroutes, replayed,
           moves);
    free(log);
}

static void run_chaos(const char *model, pid_t *etcd_pid) {
    for (int k = 0; k < N_PROMPTS; k++) g_ref[k] = reference(model, k_prompts[k]);
    const char *reg[] = {"--cluster", g_url, "--cluster-ttl", "2", NULL};
    static proc_server shard[STAGES][MAX_REPLICAS], fresh[STAGES][MAX_REPLICAS];
    for (int st = 0; st < STAGES; st++)
        for (int rep = 0; rep < g_replicas; rep++) CHECK(proc_start_server(&shard[st][rep], g_dir, model, k_layers[st], reg));
    int rc;
    free(wait_shards(STAGES * g_replicas, &rc));
    char lanes[8];
    snprintf(lanes, sizeof lanes, "%d", g_clients);
    char *argv[] = {"kvshard", "api", "--cluster", g_url, "--lanes", lanes, "--listen", "127.0.0.1:0", NULL};
    proc_server api;
    bool up = proc_start_listener(&api, g_dir, "api", argv);
    CHECK(up);
    g_api_port = api.port;
    pthread_t t[MAX_CLIENTS];
    if (!up) atomic_store(&g_stop, true);
    for (int i = 0; i < g_clients; i++) pthread_create(&t[i], NULL, client_main, (void *)(intptr_t)i);
    if (up && wait_done(2 * g_clients)) {
        churn(model, shard, fresh);
        *etcd_pid = etcd_outage(*etcd_pid);
        check_spread(fresh);
    }
    atomic_store(&g_stop, true);
    for (int i = 0; i < g_clients; i++) pthread_join(t[i], NULL);
    check_replacements_used(fresh);
    int failed = atomic_load(&g_failed), done = atomic_load(&g_done);
    printf("chaos: %d requests, %d failed, %d shards killed\n", done, failed, STAGES * g_replicas);
    if (failed) {
        fprintf(stderr, "%d of %d requests failed; first: %s\n", failed, done, g_first_fail);
        test_failures_++;
    }
    proc_stop_server(&api);
    print_recovery(api.log);
    for (int st = 0; st < STAGES; st++)
        for (int rep = 0; rep < g_replicas; rep++) {
            proc_kill_server(&shard[st][rep]);
            proc_stop_server(&fresh[st][rep]);
        }
    for (int k = 0; k < N_PROMPTS; k++) free(g_ref[k]);
}

int main(void) {
    char mbuf[512];
    const char *model = test_shared_path("models/stories260K.gguf", mbuf, sizeof mbuf);
    if (!find_etcd()) {
        fprintf(stderr, "skip: no etcd binary (install etcd-server: scripts/deps.sh --test, or set KVS_ETCD)\n");
        return TEST_SKIP_CODE;
    }
    if (!model) return TEST_SKIP_CODE;
    const char *r = getenv("KVS_CHAOS_REPLICAS"), *c = getenv("KVS_CHAOS_CLIENTS");
    if (r) g_replicas = atoi(r) < 2 ? 2 : atoi(r) > MAX_REPLICAS ? MAX_REPLICAS : atoi(r);
    if (c) g_clients = atoi(c) < 1 ? 1 : atoi(c) > MAX_CLIENTS ? MAX_CLIENTS : atoi(c);
    snprintf(g_dir, sizeof g_dir, "/tmp/kvs-chaos-XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    pid_t etcd_pid = start_etcd();
    CHECK(etcd_pid > 0);
    if (etcd_pid > 0) run_chaos(model, &etcd_pid);
    stop_etcd(etcd_pid);
    if (test_failures_) fprintf(stderr, "%d failure(s); logs in %s\n", test_failures_, g_dir);
    else printf("ok\n");
    return test_failures_ ? 1 : 0;
}
