/*
 * Multi-process over mutual TLS: `kvshard cert` makes the cluster, three TLS shards (plus a spare
 * for the last hop) serve stories260K, `kvshard generate` with a client certificate prints
 * exactly what `kvshard run` prints, also when the last shard is killed (-9) mid-generation and
 * the spare takes over; a client without a certificate, or with one from another CA, is refused.
 * The failover step's time is printed (TLS overhead notes in BENCHMARKS.md).
 */
#include "proc.h"
#include "test.h"

static char g_dir[64];

static char *run_cli(const char *const *args, int *status) {
    char *argv[48];
    int n = 0;
    argv[n++] = "kvshard";
    for (int i = 0; args[i] && n < 47; i++) argv[n++] = (char *)args[i];
    argv[n] = NULL;
    char errlog[256];
    snprintf(errlog, sizeof errlog, "%s/cli.log", g_dir);
    char *out = NULL;
    *status = proc_run(argv, &out, errlog, 120000);
    return out;
}

typedef struct {
    char cert[200], key[200], ca[200];
} creds;

static creds creds_of(const char *dir, const char *name) {
    creds c;
    snprintf(c.cert, sizeof c.cert, "%s/%s.pem", dir, name);
    snprintf(c.key, sizeof c.key, "%s/%s.key", dir, name);
    snprintf(c.ca, sizeof c.ca, "%s/ca.pem", dir);
    return c;
}

static bool start_tls(proc_server *s, const char *model, const char *layers, const char *name) {
    creds c = creds_of(g_dir, name);
    const char *extra[] = {"--tls-cert", c.cert, "--tls-key", c.key, "--tls-ca", c.ca, NULL};
    return proc_start_server(s, g_dir, model, layers, extra);
}

/* kill -9 of the last shard while generate is paused after 8 tokens; returns the output. */
static char *generate_with_kill(const char *route, const char *spare, const creds *c, proc_server *victim,
                                double *resume_ms) {
    char errlog[256];
    snprintf(errlog, sizeof errlog, "%s/failover.err", g_dir);
    int in[2], out[2];
    if (pipe(in) != 0 || pipe(out) != 0) return NULL;
    pid_t pid = fork();
    if (pid == 0) {
        dup2(in[0], 0);
        dup2(out[1], 1);
        int fd = open(errlog, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, 2);
        close(in[1]);
        close(out[0]);
        execl(proc_bin(), "kvshard", "generate", "--route", route, "--spare", spare, "-p", "Once upon a time", "-n",
              "40", "--temp", "0", "--seed", "5", "--json", "--stats", "--pause-after", "8", "--tls-cert", c->cert,
              "--tls-key", c->key, "--tls-ca", c->ca, (char *)NULL);
        _exit(127);
    }
    close(in[0]);
    close(out[1]);
    bool paused = false;
    for (int waited = 0; waited < 60000 && !paused; waited += 5) {
        FILE *f = fopen(errlog, "r");
        char line[512];
        while (f && fgets(line, sizeof line, f)) paused |= strstr(line, "paused after 8 tokens") != NULL;
        if (f) fclose(f);
        if (!paused) proc_sleep_ms(5);
    }
    CHECK(paused);
    kill(victim->pid, SIGKILL);
    proc_wait(victim->pid, 10000);
    victim->pid = 0;
    if (write(in[1], "\n", 1) != 1) CHECK(0);
    close(in[1]);
    size_t len = 0, cap = 1 << 16;
    char *got = malloc(cap);
    ssize_t n;
    while ((n = read(out[0], got + len, cap - len - 1)) > 0) len += (size_t)n;
    got[len] = 0;
    close(out[0]);
    CHECK_EQ_INT(proc_wait(pid, 60000), 0);
    FILE *f = fopen(errlog, "r");
    char line[1024];
    while (f && fgets(line, sizeof line, f)) {
        if (line[0] != '{') continue;
        CHECK(strstr(line, "\"reroutes\":1,") != NULL);
        const char *p = strstr(line, "\"resume_step_ms\":");
        if (p) *resume_ms = atof(p + strlen("\"resume_step_ms\":"));
    }
    if (f) fclose(f);
    return got;
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    char buf[1024];
    const char *model = test_shared_path("models/stories260K.gguf", buf, sizeof buf);
    if (!model) return test_finish("test_tls_route", 0, 1);
    snprintf(g_dir, sizeof g_dir, "/tmp/kvs-tlsroute-XXXXXX");
    CHECK(mkdtemp(g_dir) != NULL);
    char evil[128];
    snprintf(evil, sizeof evil, "%s/evil", g_dir);
    int st;
    const char *mk[] = {"cert", "--out", g_dir, "--days", "2", "s1", "s2", "s3", "spare", "client", NULL};
    free(run_cli(mk, &st));
    CHECK_EQ_INT(st, 0);
    const char *mk2[] = {"cert", "--out", evil, "client", NULL};
    free(run_cli(mk2, &st));
    CHECK_EQ_INT(st, 0);

    const char *ref_args[] = {"run", "-m", model, "-p", "Once upon a time", "-n", "40", "--temp", "0", "--seed", "5",
                              "-t", "1", "--json", NULL};
    char *ref = run_cli(ref_args, &st);
    CHECK_EQ_INT(st, 0);

    proc_server s1, s2, s3, sp;
    CHECK(start_tls(&s1, model, "0:2", "s1"));
    CHECK(start_tls(&s2, model, "2:4", "s2"));
    CHECK(start_tls(&s3, model, "4:5", "s3"));
    CHECK(start_tls(&sp, model, "4:5", "spare"));
    char route[128], spare[64];
    snprintf(route, sizeof route, "127.0.0.1:%d,127.0.0.1:%d,127.0.0.1:%d", s1.port, s2.port, s3.port);
    snprintf(spare, sizeof spare, "127.0.0.1:%d", sp.port);
    creds c = creds_of(g_dir, "client"), e;
    snprintf(e.cert, sizeof e.cert, "%s/client.pem", evil);
    snprintf(e.key, sizeof e.key, "%s/client.key", evil);
    snprintf(e.ca, sizeof e.ca, "%s/ca.pem", g_dir); /* it trusts our CA; its own certificate is foreign */

    /* uninterrupted over TLS: what run prints */
    const char *gen[] = {"generate", "--route", route, "-p", "Once upon a time", "-n", "40", "--temp", "0", "--seed",
                         "5", "--json", "--tls-cert", c.cert, "--tls-key", c.key, "--tls-ca", c.ca, NULL};
    char *got = run_cli(gen, &st);
    CHECK_EQ_INT(st, 0);
    CHECK(ref && got && strcmp(ref, got) == 0);
    free(got);
    /* chat over the TLS route prints what chat in one process prints */
    const char *chat_local[] = {"chat", "-m", model, "-p", "Once upon a time", "-n", "24", "--temp", "0", "-t", "1", NULL};
    char *chat_ref = run_cli(chat_local, &st);
    CHECK_EQ_INT(st, 0);
    const char *chat_tls[] = {"chat", "--route", route, "-p", "Once upon a time", "-n", "24", "--temp", "0",
                              "--tls-cert", c.cert, "--tls-key", c.key, "--tls-ca", c.ca, NULL};
    got = run_cli(chat_tls, &st);
    CHECK_EQ_INT(st, 0);
    CHECK(chat_ref && got && chat_ref[0] && strcmp(chat_ref, got) == 0);
    if (chat_ref && got && strcmp(chat_ref, got)) fprintf(stderr, "chat over TLS:\n  got %s\n  want %s\n", got, chat_ref);
    free(got);
    free(chat_ref);
    const char *chat_plain[] = {"chat", "--route", route, "-p", "Once", "-n", "2", "--timeout", "5000", NULL};
    free(run_cli(chat_plain, &st));
    CHECK(st != 0);
    printf("  chat --route over mutual TLS prints what chat -m prints; without a certificate it is refused\n");
    /* no certificate / a foreign certificate: refused */
    const char *plain[] = {"generate", "--route", route, "-p", "Once", "-n", "2", "--timeout", "5000", NULL};
    free(run_cli(plain, &st));
    CHECK(st != 0);
    const char *foreign[] = {"generate", "--route", route, "-p", "Once", "-n", "2", "--timeout", "5000",
                             "--tls-cert", e.cert, "--tls-key", e.key, "--tls-ca", e.ca, NULL};
    free(run_cli(foreign, &st));
    CHECK(st != 0);

    /* kill -9 of the last shard mid-generation: the spare takes over, output identical */
    double resume_ms = -1;
    got = generate_with_kill(route, spare, &c, &s3, &resume_ms);
    CHECK(ref && got && strcmp(ref, got) == 0);
    if (ref && got && strcmp(ref, got)) fprintf(stderr, "failover over TLS:\n  got %s  want %s", got, ref);
    printf("  TLS route of 3 shards + spare: kill -9 of the last shard, output identical; next token %.1f ms\n",
           resume_ms);
    free(got);
    free(ref);
    proc_stop_server(&s1);
    proc_stop_server(&s2);
    proc_stop_server(&sp);
    char cmd[200];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    if (system(cmd) != 0) fprintf(stderr, "note: could not remove %s\n", g_dir);
    return test_finish("test_tls_route", 1, 0);
}
