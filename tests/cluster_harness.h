/* Helpers of the cluster tests (tests/test_cluster*.c): a real etcd on free loopback ports (plain
 * or TLS), `cluster status` polling, and the HTTP client of `api`. Every wait is bounded. */
#ifndef KVS_TEST_CLUSTER_HARNESS_H
#define KVS_TEST_CLUSTER_HARNESS_H

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "etcd.h"
#include "proc.h"
#include "registry.h"
#include "test.h"

#define WAIT_MS 20000 /* every wait below is bounded by this */

static char g_dir[256];
static char g_url[128];
static char g_etcd[256];
/* TLS to etcd (g_etcd_ca NULL: plain http): the CA, the server's certificate (CN localhost, the
 * URL's host), and the client certificate and key the tests and the kvshard commands present;
 * g_etcd_client_auth starts etcd with --client-cert-auth. g_etcd_user and g_etcd_password_file:
 * etcd auth for the kvshard commands (NULL: none). */
static const char *g_etcd_ca, *g_etcd_cert, *g_etcd_key, *g_etcd_user, *g_etcd_password_file;
static bool g_etcd_client_auth;
static char g_etcd_server_cert[340], g_etcd_server_key[340];
static int g_cport, g_pport, g_generation;

static inline int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    int port = -1;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0) close(fd);
    return port;
}

static inline bool find_etcd(void) {
    const char *env = getenv("KVS_ETCD");
    const char *cands[] = {env ? env : "", "/usr/bin/etcd", "/usr/local/bin/etcd"};
    for (size_t i = 0; i < 3; i++)
        if (cands[i][0] && access(cands[i], X_OK) == 0) {
            snprintf(g_etcd, sizeof g_etcd, "%s", cands[i]);
            return true;
        }
    return false;
}

static inline etcd_params harness_etcd_params(int timeout_ms) {
    return (etcd_params){.url = g_url, .ca = g_etcd_ca, .cert = g_etcd_cert, .key = g_etcd_key,
                         .timeout_ms = timeout_ms};
}

static inline void exec_etcd(const char *data, const char *listen, const char *client, const char *peer,
                             const char *cluster) {
    const char *argv[24] = {"etcd", "--data-dir", data, "--listen-client-urls", listen, "--advertise-client-urls",
                            client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                            "--initial-cluster", cluster};
    int n = 13;
    if (g_etcd_ca) {
        argv[n++] = "--cert-file";
        argv[n++] = g_etcd_server_cert;
        argv[n++] = "--key-file";
        argv[n++] = g_etcd_server_key;
    }
    if (g_etcd_client_auth) {
        argv[n++] = "--trusted-ca-file";
        argv[n++] = g_etcd_ca;
        argv[n++] = "--client-cert-auth";
    }
    argv[n] = NULL;
    execv(g_etcd, (char *const *)argv);
}

/* Starts etcd on two free loopback ports (the same ones on a restart) with a fresh data dir under
 * g_dir; waits (bounded) until a range request answers. host names the client URL's host. */
static inline pid_t start_etcd_host(const char *host) {
    if (!g_cport) {
        g_cport = free_port();
        g_pport = free_port();
    }
    char data[300], client[96], listen[96], peer[64], cluster[96], logp[300];
    snprintf(data, sizeof data, "%s/etcd-data-%d", g_dir, g_generation++); /* a restart starts empty */
    snprintf(client, sizeof client, "%s://%s:%d", g_etcd_ca ? "https" : "http", host, g_cport);
    snprintf(listen, sizeof listen, "%s://127.0.0.1:%d", g_etcd_ca ? "https" : "http", g_cport);
    snprintf(peer, sizeof peer, "http://127.0.0.1:%d", g_pport);
    snprintf(cluster, sizeof cluster, "default=%s", peer);
    snprintf(logp, sizeof logp, "%s/etcd.log", g_dir);
    snprintf(g_url, sizeof g_url, "%s", client);
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(logp, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        proc_close_inherited();
        exec_etcd(data, listen, client, peer, cluster);
        _exit(127);
    }
    etcd *db = NULL;
    etcd_params ep = harness_etcd_params(500);
    CHECK_EQ_INT(etcd_open(&ep, &db, NULL, 0), 0);
    for (int waited = 0; db && waited < WAIT_MS; waited += 100) {
        etcd_kv *kvs = NULL;
        size_t n = 0;
        if (etcd_range_prefix(db, "/", &kvs, &n, NULL, 0) == 0) {
            etcd_kvs_free(kvs, n);
            etcd_close(db);
            return pid;
        }
        proc_sleep_ms(100);
    }
    etcd_close(db);
    fprintf(stderr, "etcd did not answer within %d ms (log: %s)\n", WAIT_MS, logp);
    kill(pid, SIGKILL);
    proc_wait(pid, 10000);
    return -1;
}

static inline pid_t start_etcd(void) { return start_etcd_host("127.0.0.1"); }

static inline void stop_etcd(pid_t pid) {
    if (pid <= 0) return;
    kill(pid, SIGTERM);
    proc_wait(pid, 10000);
}

static inline char *run_cmd(const char *const *args, int *rc) {
    char errlog[300];
    snprintf(errlog, sizeof errlog, "%s/cli.log", g_dir);
    char *out = NULL;
    *rc = proc_run_args(args, &out, errlog, 120000);
    return out;
}

/* Appends "--cluster URL" and the etcd TLS and auth options in use to args[*n...]. */
static inline void cluster_args(const char **args, int *n) {
    args[(*n)++] = "--cluster";
    args[(*n)++] = g_url;
    const char *opt[5][2] = {{"--etcd-ca", g_etcd_ca}, {"--etcd-cert", g_etcd_cert}, {"--etcd-key", g_etcd_key},
                             {"--etcd-user", g_etcd_user}, {"--etcd-password-file", g_etcd_password_file}};
    for (int i = 0; i < 5; i++)
        if (opt[i][1]) {
            args[(*n)++] = opt[i][0];
            args[(*n)++] = opt[i][1];
        }
    args[*n] = NULL;
}

/* `cluster status --json` (with the etcd options in use); *rc its exit status. */
static inline char *status_json(int *rc) {
    const char *args[24] = {"cluster", "status", "--json"};
    int n = 3;
    cluster_args(args, &n);
    return run_cmd(args, rc);
}

static inline int count_of(const char *s, const char *needle) {
    int n = 0;
    for (const char *p = s; p && (p = strstr(p, needle)) != NULL; p++) n++;
    return n;
}

/* Polls status until it lists want shards (bounded); returns the last output (malloc'd). */
static inline char *wait_shards(int want, int *rc) {
    char *out = NULL;
    for (int waited = 0; waited <= WAIT_MS; waited += 100) {
        free(out);
        out = status_json(rc);
        if (count_of(out, "\"addr\":") == want) return out;
        proc_sleep_ms(100);
    }
    fprintf(stderr, "status never listed %d shards: %s\n", want, out);
    return out;
}

static inline char *generated(const char *out) {
    const char *p = strstr(out, "\"generated\":[");
    const char *q = p ? strchr(p, ']') : NULL;
    return p && q ? strndup(p, (size_t)(q - p + 1)) : strdup("(none)");
}

/* The value of counter name in `kvshard stats` of the shard at port; -1 when unreadable. */
static inline long shard_stat(int port, const char *name) {
    char addr[32], key[96];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    snprintf(key, sizeof key, "\"%s\":", name);
    const char *args[] = {"stats", addr, NULL};
    int rc;
    char *out = run_cmd(args, &rc);
    const char *p = out ? strstr(out, key) : NULL;
    long n = rc == 0 && p ? strtol(p + strlen(key), NULL, 10) : -1;
    free(out);
    return n;
}

/* srv.connections_open of the shard at port (a `kvshard stats` call, itself one connection). */
static inline long open_conns(int port) { return shard_stat(port, "srv.connections_open"); }

typedef struct {
    char buf[65536];
    size_t len;
} http_reply;

static inline size_t on_http(char *p, size_t sz, size_t nm, void *user) {
    http_reply *r = user;
    size_t n = sz * nm, room = sizeof r->buf - 1 - r->len;
    memcpy(r->buf + r->len, p, n < room ? n : room);
    r->len += n < room ? n : room;
    r->buf[r->len] = 0;
    return n;
}

/* POST body to http://127.0.0.1:port/v1/completions; returns the HTTP status, the body in *r. */
static inline long post_completion(int port, const char *body, http_reply *r) {
    char url[96];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/v1/completions", port);
    r->len = 0;
    r->buf[0] = 0;
    CURL *c = curl_easy_init();
    struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_http);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, r);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 60000L);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    long status = 0;
    char err[CURL_ERROR_SIZE] = "";
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, err);
    if (curl_easy_perform(c) == CURLE_OK) curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    else if (!r->len) snprintf(r->buf, 256, "(curl: %s)", err); /* what the failure says names the cause */
    curl_slist_free_all(h);
    curl_easy_cleanup(c);
    return status;
}

/* A whole file as a NUL-terminated string (malloc'd), or NULL. */
static inline char *read_text(const char *path) {
    size_t n = 0;
    uint8_t *b = test_read_file(path, &n);
    char *t = b ? realloc(b, n + 1) : NULL;
    if (!t) {
        free(b);
        return NULL;
    }
    t[n] = 0;
    return t;
}

/* choices[0].text of a completion reply (malloc'd), or NULL. */
static inline char *reply_text(const char *buf) {
    cJSON *j = cJSON_Parse(buf);
    const cJSON *ch = j ? cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(j, "choices"), 0) : NULL;
    const cJSON *t = ch ? cJSON_GetObjectItemCaseSensitive(ch, "text") : NULL;
    char *s = cJSON_IsString(t) ? strdup(t->valuestring) : NULL;
    cJSON_Delete(j);
    return s;
}

#endif /* KVS_TEST_CLUSTER_HARNESS_H */
