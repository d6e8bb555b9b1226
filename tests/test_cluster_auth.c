/* The registry behind a secured etcd (docs/cluster.md), with certificates from `kvshard cert`:
 * 1. etcd over TLS requiring client certificates: shards register and `generate --cluster` equals
 *    `kvshard run` with --etcd-ca/--etcd-cert/--etcd-key; without the client certificate, or
 *    without the CA, `cluster status` cannot read the registry.
 * 2. etcd over TLS with auth enabled (user root): the same with --etcd-user/--etcd-password-file,
 *    and an api --cluster whose registry watch authenticates too; no user or a wrong password is
 *    refused with etcd's message. (etcd 3.4's JSON gateway refuses auth together with
 *    --client-cert-auth, hence two etcds.)
 * Skips (77) without the etcd binary or stories260K. */
#include "cluster_harness.h"

static char g_ca[320], g_ccert[320], g_ckey[320], g_pwfile[320], g_badpw[320];

static bool make_certs(void) {
    char certs[280];
    snprintf(certs, sizeof certs, "%s/certs", g_dir);
    const char *args[] = {"cert", "--out", certs, "localhost", "client", NULL};
    int rc;
    free(run_cmd(args, &rc));
    snprintf(g_ca, sizeof g_ca, "%s/ca.pem", certs);
    snprintf(g_ccert, sizeof g_ccert, "%s/client.pem", certs);
    snprintf(g_ckey, sizeof g_ckey, "%s/client.key", certs);
    snprintf(g_etcd_server_cert, sizeof g_etcd_server_cert, "%s/localhost.pem", certs);
    snprintf(g_etcd_server_key, sizeof g_etcd_server_key, "%s/localhost.key", certs);
    return rc == 0;
}

/* POSTs body to the etcd gateway's path over TLS (the test's own setup calls); the HTTP status. */
static long etcd_admin(const char *path, const char *body) {
    char url[256];
    snprintf(url, sizeof url, "%s%s", g_url, path);
    static http_reply r;
    r.len = 0;
    CURL *c = curl_easy_init();
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_http);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &r);
    curl_easy_setopt(c, CURLOPT_CAINFO, g_ca);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 10000L);
    long status = 0;
    if (curl_easy_perform(c) == CURLE_OK) curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    curl_easy_cleanup(c);
    if (status != 200) fprintf(stderr, "etcd %s: HTTP %ld: %s\n", path, status, r.buf);
    return status;
}

static bool log_has(const char *path, const char *needle) {
    char *log = read_text(path);
    bool has = log && strstr(log, needle);
    free(log);
    return has;
}

/* Two registered shards; generate --cluster with the options in use equals run. */
static void check_route(const char *model, proc_server *head, proc_server *tail) {
    const char *reg[24];
    int n = 0;
    cluster_args(reg, &n);
    reg[n++] = "--cluster-ttl";
    reg[n++] = "2";
    reg[n] = NULL;
    CHECK(proc_start_server(head, g_dir, model, "0:2", reg));
    CHECK(proc_start_server(tail, g_dir, model, "2:end", reg));
    int rc;
    char *out = wait_shards(2, &rc);
    CHECK_EQ_INT(rc, 0);
    free(out);
    const char *ra[] = {"run", "-m", model, "-p", "Once upon a time", "-n", "16", "--temp", "0", "-t", "1", "--json", NULL};
    char *ref = run_cmd(ra, &rc);
    const char *ga[24] = {"generate", "-p", "Once upon a time", "-n", "16", "--temp", "0", "--json"};
    n = 8;
    cluster_args(ga, &n);
    char *got = run_cmd(ga, &rc);
    CHECK_EQ_INT(rc, 0);
    char *a = generated(ref), *b = generated(got);
    if (strcmp(a, b) || !strcmp(a, "(none)")) {
        fprintf(stderr, "generate --cluster %s\n          run %s\n", b, a);
        test_failures_++;
    }
    free(a);
    free(b);
    free(ref);
    free(got);
}

/* `cluster status` with only the given etcd options fails, logging want. */
static void check_refused(const char *const *opts, const char *want) {
    const char *args[16] = {"cluster", "status", "--cluster", g_url};
    int n = 4;
    for (int i = 0; opts[i]; i++) args[n++] = opts[i];
    args[n] = NULL;
    char errlog[300];
    snprintf(errlog, sizeof errlog, "%s/cli.log", g_dir);
    truncate(errlog, 0);
    int rc;
    free(run_cmd(args, &rc));
    CHECK(rc != 0);
    if (!log_has(errlog, want)) {
        fprintf(stderr, "status with %s...: no \"%s\" in %s\n", opts[0] ? opts[0] : "no options", want, errlog);
        test_failures_++;
    }
}

static void check_client_certs(const char *model) {
    g_etcd_ca = g_ca;
    g_etcd_cert = g_ccert;
    g_etcd_key = g_ckey;
    g_etcd_client_auth = true;
    pid_t pid = start_etcd_host("localhost");
    CHECK(pid > 0);
    if (pid <= 0) return;
    proc_server head, tail;
    check_route(model, &head, &tail);
    const char *ca_only[] = {"--etcd-ca", g_ca, NULL}, *none[] = {NULL};
    check_refused(ca_only, "kvshard cluster: etcd https://localhost");
    check_refused(none, "kvshard cluster: etcd https://localhost");
    proc_stop_server(&head);
    proc_stop_server(&tail);
    stop_etcd(pid);
}

static void check_auth(const char *model) {
    g_etcd_cert = g_etcd_key = NULL;
    g_etcd_client_auth = false;
    g_cport = 0; /* fresh ports */
    pid_t pid = start_etcd_host("localhost");
    CHECK(pid > 0);
    if (pid <= 0) return;
    CHECK_EQ_INT(etcd_admin("/v3/auth/user/add", "{\"name\":\"root\",\"password\":\"s3cret\"}"), 200);
    CHECK_EQ_INT(etcd_admin("/v3/auth/user/grant", "{\"user\":\"root\",\"role\":\"root\"}"), 200);
    CHECK_EQ_INT(etcd_admin("/v3/auth/enable", "{}"), 200);
    snprintf(g_pwfile, sizeof g_pwfile, "%s/etcd-password", g_dir);
    snprintf(g_badpw, sizeof g_badpw, "%s/etcd-bad-password", g_dir);
    FILE *f = fopen(g_pwfile, "w"), *g = fopen(g_badpw, "w");
    if (f) fputs("s3cret\n", f);
    if (g) fputs("guess\n", g);
    if (f) fclose(f);
    if (g) fclose(g);
    const char *no_user[] = {"--etcd-ca", g_ca, NULL};
    const char *bad_pw[] = {"--etcd-ca", g_ca, "--etcd-user", "root", "--etcd-password-file", g_badpw, NULL};
    check_refused(no_user, "user name is empty");
    check_refused(bad_pw, "authentication failed");
    g_etcd_user = "root";
    g_etcd_password_file = g_pwfile;
    proc_server head, tail, api;
    check_route(model, &head, &tail);
    const char *argv[24] = {"kvshard", "api", "--lanes", "1", "--listen", "127.0.0.1:0"};
    int n = 6;
    cluster_args(argv, &n);
    CHECK(proc_start_listener(&api, g_dir, "api", (char *const *)argv));
    static http_reply r;
    CHECK_EQ_INT(post_completion(api.port, "{\"prompt\":\"Once upon a time\",\"max_tokens\":8,\"temperature\":0}", &r), 200);
    proc_stop_server(&api);
    CHECK(!log_has(api.log, "registry watch:")); /* the watch authenticated and held */
    proc_stop_server(&head);
    proc_stop_server(&tail);
    stop_etcd(pid);
}

int main(void) {
    char mbuf[512];
    const char *model = test_shared_path("models/stories260K.gguf", mbuf, sizeof mbuf);
    if (!find_etcd()) {
        fprintf(stderr, "skip: no etcd binary (install etcd-server: scripts/deps.sh --test, or set KVS_ETCD)\n");
        return TEST_SKIP_CODE;
    }
    if (!model) return TEST_SKIP_CODE;
    snprintf(g_dir, sizeof g_dir, "/tmp/kvs-cluster-auth-XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    CHECK(make_certs());
    if (!test_failures_) check_client_certs(model);
    if (!test_failures_) check_auth(model);
    if (test_failures_) fprintf(stderr, "%d failure(s); logs in %s\n", test_failures_, g_dir);
    else printf("ok\n");
    return test_failures_ ? 1 : 0;
}
