/*
 * Multi-process: shards (`kvshard serve`) on free loopback ports driven by
 * `kvshard generate`, compared with one-process `kvshard run`:
 * 1-, 2- and 3-shard routes (synthetic model, and stories260K when present)
 * give the same ids and text; four clients at once through one 2-shard route
 * each get their solo output; shards with a tiny KV budget under 8 clients
 * evict, the clients recover by replay, outputs stay identical and the
 * shard's KV memory stays within its budget; a bad route is refused.
 */
#include <pthread.h>

#include "netio.h"
#include "proc.h"
#include "route_harness.h"
#include "test.h"
#include "wire.h"

static char g_dir[64];

static char *run_cli(const char *const *args, int *status) { return proc_cli(g_dir, args, status); }

static char *reference(const char *model, const char *prompt, const char *n, const char *temp) {
    int st;
    const char *args[] = {"run", "-m", model, "-p", prompt, "-n", n, "--temp", temp, "--seed", "5", "-t", "1", "--json", NULL};
    char *out = run_cli(args, &st);
    CHECK_EQ_INT(st, 0);
    CHECK(strstr(out, "\"generated\":[") != NULL);
    return out;
}

static char *generate(const char *route, const char *spare, const char *prompt, const char *n, const char *temp, int *st) {
    const char *args[] = {"generate", "--route", route, "-p", prompt, "-n", n, "--temp", temp, "--seed", "5", "--json",
                          spare ? "--spare" : NULL, spare, NULL};
    return run_cli(args, st);
}

/* A chat turn over the route equals the same turn in one process: the route client learns the
 * chat template, add_bos and the special-token whitespace rule from the head shard. */
static void check_chat_route(const char *model, const char *route) {
    int st;
    const char *local[] = {"chat", "-m", model, "-p", "Hello there", "-n", "8", "--temp", "0", "-t", "1", NULL};
    char *want = run_cli(local, &st);
    CHECK_EQ_INT(st, 0);
    const char *remote[] = {"chat", "--route", route, "-p", "Hello there", "-n", "8", "--temp", "0", NULL};
    char *got = run_cli(remote, &st);
    CHECK_EQ_INT(st, 0);
    if (strcmp(got, want) != 0) fprintf(stderr, "chat over %s:\n  got  %s\n  want %s\n", route, got, want);
    CHECK(strcmp(got, want) == 0);
    printf("  chat over the route: the same reply as chat -m\n");
    free(want);
    free(got);
}

/* Under TSan (ten times slower) the families take only their 2-shard route: the 1- and 3-shard
 * ones run the same threads on other layers, and the release and ASan builds run all three. */
#if defined(__SANITIZE_THREAD__)
enum { FAMILY_MIN_SHARDS = 2, FAMILY_MAX_SHARDS = 2 };
#else
enum { FAMILY_MIN_SHARDS = 1, FAMILY_MAX_SHARDS = 3 };
#endif

/* Routes of 1, 2 and 3 shards (chat: the families, FAMILY_*_SHARDS) equal kvshard run. */
static void check_routes(const char *model, int n_layer, bool chat) {
    printf("model %s (%d layers)\n", model, n_layer);
    const int lo = chat ? FAMILY_MIN_SHARDS : 1, hi = chat ? FAMILY_MAX_SHARDS : 3;
    if (hi - lo < 2) printf("  (TSan build: the %d-shard route only)\n", lo);
    const char *prompt = "Once upon a time";
    char *ref = reference(model, prompt, "24", "0");
    char *ref_t = reference(model, prompt, "24", "0.8");
    char l1[32], l2[32], l3[32];
    for (int shards = lo; shards <= hi && shards <= n_layer; shards++) {
        proc_server s[3];
        bool ok = true;
        for (int i = 0; i < shards; i++) {
            int a = n_layer * i / shards, b = n_layer * (i + 1) / shards;
            snprintf(i == 0 ? l1 : i == 1 ? l2 : l3, 32, "%d:%d", a, b);
            ok = ok && proc_start_server(&s[i], g_dir, model, i == 0 ? l1 : i == 1 ? l2 : l3, NULL);
        }
        CHECK(ok);
        char route[256];
        route_of(route, sizeof(route), s, shards);
        int st;
        char *out = generate(route, NULL, prompt, "24", "0", &st);
        CHECK_EQ_INT(st, 0);
        if (strcmp(out, ref) != 0) fprintf(stderr, "%d shards greedy:\n  got %s  want %s", shards, out, ref);
        CHECK(strcmp(out, ref) == 0);
        free(out);
        out = generate(route, NULL, prompt, "24", "0.8", &st);
        CHECK_EQ_INT(st, 0);
        CHECK(strcmp(out, ref_t) == 0);
        free(out);
        printf("  %d-shard route: same ids and text as kvshard run (greedy and sampled)\n", shards);
        if (chat && shards == 2) check_chat_route(model, route);
        for (int i = 0; i < shards; i++) CHECK_EQ_INT(proc_stop_server(&s[i]), 0);
    }
    free(ref);
    free(ref_t);
}

typedef struct {
    const char *route;
    const char *prompt;
    char *out;
    int status;
} client_job;

static void *client_main(void *p) {
    client_job *j = p;
    j->out = generate(j->route, NULL, j->prompt, "20", "0", &j->status);
    return NULL;
}

static const char *PROMPTS[8] = {"Once upon a time", "The little dog", "Lily and Ben", "Tom had a toy car",
                                 "One day, a bird", "The sun was hot", "Mom said no", "A big red ball"};

/* Connects to a shard on loopback and says HELLO (the INFO reply lands in b). */
static int probe_connect(int port, int *fd, struct netio_buf *b) {
    char msg[KVS_MSG_MAX];
    if (netio_connect("127.0.0.1", (uint16_t)port, netio_deadline_ms(30000), fd, msg, sizeof(msg))) return KVS_ERR_IO;
    uint8_t buf[64];
    size_t len;
    struct wire_hello h = {.min_version = 1, .max_version = 1};
    wire_encode_hello(&h, buf, sizeof(buf), &len);
    struct wire_header hd;
    int err = netio_send_frame(*fd, WIRE_OP_HELLO, 1, buf, len, netio_deadline_ms(30000));
    if (!err) err = netio_recv_frame(*fd, &hd, b, netio_deadline_ms(30000), msg, sizeof(msg));
    return err;
}

/* STATS from a shard: KV bytes used, budget, LRU evictions. */
static int probe_stats(int port, uint64_t *used, uint64_t *budget, uint64_t *lru) {
    int fd = -1;
    char msg[KVS_MSG_MAX];
    struct netio_buf b = {0};
    struct wire_header hd;
    int err = probe_connect(port, &fd, &b);
    if (!err) err = netio_send_frame(fd, WIRE_OP_STATS, 2, NULL, 0, netio_deadline_ms(30000));
    if (!err) err = netio_recv_frame(fd, &hd, &b, netio_deadline_ms(30000), msg, sizeof(msg));
    struct wire_stats_reply *st = calloc(1, sizeof(*st));
    if (!err) err = wire_decode_stats_reply(b.data, b.len, st, msg, sizeof(msg));
    for (uint32_t i = 0; !err && i < st->n_stats; i++) {
        if (!strcmp(st->stats[i].name, "kv.bytes_used")) *used = st->stats[i].value;
        if (!strcmp(st->stats[i].name, "kv.budget_bytes")) *budget = st->stats[i].value;
        if (!strcmp(st->stats[i].name, "kv.evict_lru")) *lru = st->stats[i].value;
    }
    free(st);
    netio_buf_free(&b);
    close(fd);
    return err;
}

/* n clients at once through a 2-shard route: each equals its solo run. */
static void check_concurrent(const char *model, int n_layer, int n_clients, const char *budget) {
    char layers_a[16], layers_b[16];
    snprintf(layers_a, sizeof(layers_a), "0:%d", n_layer / 2);
    snprintf(layers_b, sizeof(layers_b), "%d:%d", n_layer / 2, n_layer);
    const char *extra[] = {"--kv-budget", budget, NULL};
    proc_server s[2];
    CHECK(proc_start_server(&s[0], g_dir, model, layers_a, budget ? extra : NULL));
    CHECK(proc_start_server(&s[1], g_dir, model, layers_b, budget ? extra : NULL));
    char route[256];
    route_of(route, sizeof(route), s, 2);
    client_job jobs[8];
    pthread_t th[8];
    for (int i = 0; i < n_clients; i++) {
        jobs[i] = (client_job){.route = route, .prompt = PROMPTS[i]};
        pthread_create(&th[i], NULL, client_main, &jobs[i]);
    }
    for (int i = 0; i < n_clients; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < n_clients; i++) {
        char *ref = reference(model, PROMPTS[i], "20", "0");
        CHECK_EQ_INT(jobs[i].status, 0);
        if (strcmp(jobs[i].out, ref)) fprintf(stderr, "client %d:\n  got %s  want %s", i, jobs[i].out, ref);
        CHECK(strcmp(jobs[i].out, ref) == 0);
        free(ref);
        free(jobs[i].out);
    }
    printf("  %d concurrent clients through a 2-shard route%s%s: each equals its solo run\n", n_clients,
           budget ? ", kv budget " : "", budget ? budget : "");
    if (budget) {
        /* Bounded memory: each shard's resident set stays small (the model is 1 MB, the KV
         * budget tiny; 8 clients' sessions came and went through it). */
        uint64_t lru_total = 0;
        for (int i = 0; i < 2; i++) {
            char path[64], line[256];
            snprintf(path, sizeof(path), "/proc/%d/status", (int)s[i].pid);
            FILE *f = fopen(path, "r");
            long kb = -1;
            while (f && fgets(line, sizeof(line), f))
                if (!strncmp(line, "VmRSS:", 6)) kb = atol(line + 6);
            if (f) fclose(f);
            uint64_t used = 0, budget_b = 0, lru = 0;
            CHECK_EQ_INT(probe_stats(s[i].port, &used, &budget_b, &lru), KVS_OK);
            printf("  shard %d after 8 clients: kv %llu of %llu bytes, %llu LRU evictions, resident %ld KiB\n", i,
                   (unsigned long long)used, (unsigned long long)budget_b, (unsigned long long)lru, kb);
            /* Every client released its session at the end: the pool is empty again, to the
             * byte, after 8 sessions came and went through it (and some were evicted). */
            CHECK_EQ_INT(used, 0);
            CHECK(budget_b > 0);
            lru_total += lru;
            CHECK(kb > 0 && kb < 128 * 1024); /* 1 MB model, 24 KiB of KV: tens of MB even under ASan */
            char addr[64];
            snprintf(addr, sizeof(addr), "127.0.0.1:%d", s[i].port);
            const char *stats_args[] = {"stats", addr, NULL};
            int st;
            char *js = run_cli(stats_args, &st);
            CHECK_EQ_INT(st, 0);
            CHECK(strstr(js, "\"kv.evict_lru\":") != NULL && strstr(js, "\"model_digest\":\"") != NULL);
            free(js);
        }
        /* The budget was exercised, as counted by STATS. Which shard evicts depends on how the
         * clients' sessions overlap in time: the shard holding more layers fills first, and
         * under a CPU hog the other one may never fill (seen in CI: 0 and 3). */
        CHECK(lru_total > 0);
    }
    for (int i = 0; i < 2; i++) CHECK_EQ_INT(proc_stop_server(&s[i]), 0);
    if (budget) {
        /* The shards evicted sessions and never went over budget: their final log line
         * counts evictions; the pool's exact accounting is checked by kv_check in the kvstate
         * tests. */
        long evicted = 0;
        for (int i = 0; i < 2; i++) {
            FILE *f = fopen(s[i].log, "r");
            char line[512];
            while (f && fgets(line, sizeof(line), f)) {
                const char *p = strstr(line, "sessions live, ");
                if (p) evicted += atol(p + strlen("sessions live, "));
            }
            if (f) fclose(f);
        }
        printf("  tiny budget: %ld sessions evicted across the two shards\n", evicted);
        CHECK(evicted > 0);
    }
}

static void check_bad_route(const char *model, int n_layer) {
    char a[16], b[16];
    snprintf(a, sizeof(a), "0:%d", n_layer / 2);
    snprintf(b, sizeof(b), "0:%d", n_layer / 2); /* overlaps the first hop: no contiguous cover */
    proc_server s[2];
    CHECK(proc_start_server(&s[0], g_dir, model, a, NULL));
    CHECK(proc_start_server(&s[1], g_dir, model, b, NULL));
    char route[256];
    route_of(route, sizeof(route), s, 2);
    int st;
    char *out = generate(route, NULL, "Hello", "4", "0", &st);
    CHECK(st != 0);
    CHECK_EQ_INT(strlen(out), 0);
    free(out);
    for (int i = 0; i < 2; i++) proc_stop_server(&s[i]);
    printf("  a route with a gap in its layers is refused\n");
}

/* Sends FORWARD(sid, epoch, start 0, one token) to a shard and returns its status. */
static int probe_epoch(int port, const uint8_t sid[16], uint64_t epoch, uint64_t *live) {
    int fd = -1;
    char msg[KVS_MSG_MAX];
    uint8_t buf[256];
    size_t len;
    struct netio_buf b = {0};
    struct wire_header hd;
    int err = probe_connect(port, &fd, &b);
    int32_t tok = 1;
    struct wire_forward f = {.epoch = epoch, .n_tokens = 1, .out_mode = WIRE_OUT_HIDDEN, .in_kind = WIRE_IN_TOKENS, .data = &tok};
    memcpy(f.session_id, sid, 16);
    wire_encode_forward(&f, buf, sizeof(buf), &len);
    if (!err) err = netio_send_frame(fd, WIRE_OP_FORWARD, 2, buf, len, netio_deadline_ms(30000));
    if (!err) err = netio_recv_frame(fd, &hd, &b, netio_deadline_ms(30000), msg, sizeof(msg));
    struct wire_forward_reply r;
    if (!err) err = wire_decode_forward_reply(b.data, b.len, &r, msg, sizeof(msg));
    if (!err) {
        err = r.st.status;
        *live = r.st.live_epoch;
    }
    netio_buf_free(&b);
    close(fd);
    return err;
}

/* kill -9 of the last shard while the client is paused mid-generation (a handshake, not a
 * sleep), with a spare running: the generation completes with output identical to an
 * uninterrupted run, only the spare replays, and the survivor rejects the old epoch. */
static void check_failover(const char *model, int n_layer, bool stop_instead) {
    char la[16], lb[16];
    snprintf(la, sizeof(la), "0:%d", n_layer / 2);
    snprintf(lb, sizeof(lb), "%d:%d", n_layer / 2, n_layer);
    proc_server a, b, spare;
    CHECK(proc_start_server(&a, g_dir, model, la, NULL));
    CHECK(proc_start_server(&b, g_dir, model, lb, NULL));
    CHECK(proc_start_server(&spare, g_dir, model, lb, NULL));
    const char *prompt = "Once upon a time";
    char *ref = reference(model, prompt, "40", "0");
    char route[128], spare_s[64], errlog[256];
    snprintf(route, sizeof(route), "127.0.0.1:%d,127.0.0.1:%d", a.port, b.port);
    snprintf(spare_s, sizeof(spare_s), "127.0.0.1:%d", spare.port);
    static int run_no;
    snprintf(errlog, sizeof(errlog), "%s/failover-%d.err", g_dir, run_no++);
    char *argv[] = {"kvshard", "generate", "--route", route, "--spare", spare_s, "-p", (char *)prompt, "-n", "40",
                    "--temp", "0", "--seed", "5", "--json", "--stats", "-v", "--pause-after", "8", "--keep-session",
                    "--timeout", stop_instead ? "5000" : "30000", NULL};
    paused_gen g;
    CHECK(paused_gen_start(&g, argv, errlog));
    /* Wait (bounded) for the pause line, and read the session id from it. */
    uint8_t sid[16] = {0};
    char rest[64] = "";
    CHECK(paused_gen_wait(&g, "paused after 8 tokens (session ", rest, sizeof(rest)));
    for (int i = 0; i < 16; i++) {
        unsigned v = 0;
        sscanf(rest + 2 * i, "%2x", &v);
        sid[i] = (uint8_t)v;
    }
    if (stop_instead) kill(b.pid, SIGSTOP); /* alive but silent: only the client's timeout can tell */
    else proc_kill_server(&b);
    char *got = NULL;
    CHECK_EQ_INT(paused_gen_finish(&g, &got), 0);
    if (strcmp(got, ref)) fprintf(stderr, "failover:\n  got %s  want %s", got, ref);
    CHECK(strcmp(got, ref) == 0);
    /* The client's stats: one re-route, epoch 2; the recovery step's time. */
    CHECK_EQ_INT(stat_of(errlog, "reroutes"), 1);
    CHECK_EQ_INT(stat_of(errlog, "epoch"), 2);
    double resume_ms = stat_of(errlog, "resume_step_ms");
    if (resume_ms >= 0)
        printf("  failover: shard %s while paused; the next token took %.1f ms (detect, re-route, replay)\n",
               stop_instead ? "stopped" : "killed", resume_ms);
    /* The survivor moved the session to epoch 2 and now rejects epoch 1. */
    uint64_t live = 0;
    CHECK_EQ_INT(probe_epoch(a.port, sid, 1, &live), KVS_ERR_STALE_EPOCH);
    CHECK_EQ_INT(live, 2);
    printf("  %s of a shard mid-generation: output identical, survivor rejects the old epoch\n",
           stop_instead ? "SIGSTOP (reply timeout)" : "kill -9");
    if (stop_instead) {
        kill(b.pid, SIGCONT);
        proc_stop_server(&b);
    }
    free(got);
    free(ref);
    proc_stop_server(&a);
    proc_stop_server(&spare);
}

/* Issue 7: failover of the head, the middle or the tail of a 3-shard stories260K route whose
 * shards each hold a KV budget of exactly 2 blocks (one session of the run: 5 + 20 positions):
 * the survivors' inherit and the retried step need no free block, and the output equals an
 * uninterrupted run. While the client is paused after 8 tokens (past the first block), the head
 * is killed; the middle or the tail is SIGSTOPped, so the next step has already run on the hops
 * before it when the reply timeout tells the client: the redo of that step from hop 0 is a
 * rewind of the survivors' last position in a full pool. */
static void check_failover_full(const char *model, int victim) {
    static const char *layers[3] = {"0:2", "2:4", "4:5"};
    static const char *budgets[3] = {"8192", "8192", "4096"}; /* 2 blocks of 16 positions each */
    proc_server s[3], spare;
    for (int i = 0; i < 3; i++) {
        const char *extra[] = {"--kv-budget", budgets[i], NULL};
        CHECK(proc_start_server(&s[i], g_dir, model, layers[i], extra));
    }
    const char *sextra[] = {"--kv-budget", budgets[victim], NULL};
    CHECK(proc_start_server(&spare, g_dir, model, layers[victim], sextra));
    const char *prompt = "Once upon a time";
    char *ref = reference(model, prompt, "20", "0");
    char route[256], spare_s[64], errlog[256];
    route_of(route, sizeof(route), s, 3);
    snprintf(spare_s, sizeof(spare_s), "127.0.0.1:%d", spare.port);
    snprintf(errlog, sizeof(errlog), "%s/failover-full-%d.err", g_dir, victim);
    char *argv[] = {"kvshard", "generate", "--route", route, "--spare", spare_s, "-p", (char *)prompt, "-n", "20",
                    "--temp", "0", "--seed", "5", "--json", "-v", "--pause-after", "12", "--timeout",
                    victim ? "5000" : "30000", NULL};
    paused_gen g;
    CHECK(paused_gen_start(&g, argv, errlog));
    CHECK(paused_gen_wait(&g, "paused after 12 tokens", NULL, 0));
    if (victim) kill(s[victim].pid, SIGSTOP);
    else proc_kill_server(&s[victim]);
    char *got = NULL;
    int st = paused_gen_finish(&g, &got);
    CHECK_EQ_INT(st, 0);
    if (st != 0 || strcmp(got, ref)) {
        fprintf(stderr, "failover of hop %d with full budgets:\n  got %s  want %s", victim, got, ref);
        FILE *f = fopen(errlog, "r");
        char line[512];
        while (f && fgets(line, sizeof(line), f)) fprintf(stderr, "  | %s", line);
        if (f) fclose(f);
    }
    CHECK(strcmp(got, ref) == 0);
    if (st == 0 && strcmp(got, ref) == 0)
        printf("  %s of hop %d (%s) with every pool at its budget: output identical\n", victim ? "SIGSTOP" : "kill -9",
               victim, victim == 0 ? "head" : victim == 1 ? "middle" : "tail");
    free(got);
    free(ref);
    if (victim) kill(s[victim].pid, SIGCONT);
    for (int i = 0; i < 3; i++)
        if (i != victim || victim) proc_stop_server(&s[i]);
    proc_stop_server(&spare);
}

int main(void) {
    snprintf(g_dir, sizeof(g_dir), "/tmp/kvs-route-XXXXXX");
    CHECK(mkdtemp(g_dir) != NULL);
    signal(SIGPIPE, SIG_IGN);
    char synth[256];
    snprintf(synth, sizeof(synth), "%s/small-q8_0.gguf", g_dir);
    int st;
    const char *mk[] = {"mkmodel", "-o", synth, "--shape", "small", "--type", "q8_0", "--seed", "3", "-q", NULL};
    free(run_cli(mk, &st));
    CHECK_EQ_INT(st, 0);
    check_routes(synth, 2, false);
    check_bad_route(synth, 2);
    check_failover(synth, 2, false);
    int skipped = 0;
    char buf[1024];
    const char *stories = test_shared_path("models/stories260K.gguf", buf, sizeof(buf));
    if (stories) {
        check_routes(stories, 5, false);
        check_failover(stories, 5, false);
        check_failover(stories, 5, true);
        for (int victim = 0; victim < 3; victim++) check_failover_full(stories, victim);
        check_concurrent(stories, 5, 4, NULL);
        /* Budget for about two sessions of 5+20 positions per shard (block = 16 positions). */
        check_concurrent(stories, 5, 8, "24K");
    } else {
        skipped++;
        check_concurrent(synth, 2, 4, NULL);
    }
    /* The families of the arch table beyond llama: a route of 2 and 3 shards equals one process. */
    static const struct { const char *rel; int n_layer; } families[] = {
        {"downloads/models/qwen3-synth-Q4_K_M.gguf", 3},
        {"downloads/models/gemma3-synth-Q4_K_M.gguf", 6},
        {"downloads/models/phi3-synth-Q4_K_M.gguf", 3},
    };
    for (size_t i = 0; i < sizeof(families) / sizeof(families[0]); i++) {
        const char *fam = test_shared_path(families[i].rel, buf, sizeof(buf));
        if (fam) check_routes(fam, families[i].n_layer, true);
        else skipped++;
    }
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", g_dir);
    if (system(cmd) != 0) fprintf(stderr, "note: could not remove %s\n", g_dir);
    return test_finish("test_route", 1, skipped);
}
