/*
 * test_daily — what a user meets in the first day of running kvshard (issue 41), on
 * stories260K: links the shard closes while idle are reopened by the route client (route and
 * `api --route`, shards with a short --idle-timeout); the context is the model's (past 2048) as
 * far as the budget holds it, -c/--ctx-size asks for less, and what cannot be met fails up front
 * naming the flag (shard, run, kvshard stats); a random seed per API request, the llama.cpp
 * fields, 400 on unknown ones; short prompts on an SPM vocab; a route at the wrong port or
 * without TLS says what it reached; --version on every command, --log-level, KVSHARD_*
 * variables, the messages of issue 41 item 13, and chat on a pty: Ctrl-C stops a reply, the
 * slash commands, Ctrl-C at the prompt exits and releases the session on every shard.
 * Ordering waits on the shard's own log lines (bounded), never on sleeps that hope.
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <poll.h>
#include <pty.h>
#include <pthread.h>
#include <stdatomic.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include "http.h"
#include "mkmodel.h"
#include "netio.h"
#include "proc.h"
#include "route.h"
#include "server.h"
#include "test.h"
#include "tls.h"
#include "util.h"
#include "wire.h"

/* ---- in-process shards that count the links they close for idleness ------------------------ */

typedef struct {
    srv *s;
    pthread_t th;
    atomic_int idle_closes; /* "idle for N ms, closing" lines of its log */
} shard;

static void shard_log(void *ctx, const char *line) {
    shard *sh = ctx;
    if (strstr(line, "idle for")) atomic_fetch_add(&sh->idle_closes, 1);
    if (getenv("KVS_TEST_VERBOSE")) fprintf(stderr, "serve: %s\n", line);
}

static void *shard_main(void *p) {
    srv_run(((shard *)p)->s);
    return NULL;
}

static bool shard_start(shard *sh, const char *model, uint32_t first, uint32_t last, int idle_ms) {
    srv_params p = srv_default_params();
    p.model_path = model;
    p.first = first;
    p.last = last;
    p.listen = "127.0.0.1:0";
    p.n_threads = 1;
    p.kv_budget_bytes = 16u << 20;
    p.idle_timeout_ms = idle_ms;
    p.log = shard_log;
    p.log_ctx = sh;
    atomic_init(&sh->idle_closes, 0);
    char msg[KVS_MSG_MAX] = "";
    if (srv_create(&p, &sh->s, msg, sizeof msg) != KVS_OK) {
        fprintf(stderr, "srv_create: %s\n", msg);
        return false;
    }
    pthread_create(&sh->th, NULL, shard_main, sh);
    return true;
}

static void shard_stop(shard *sh) {
    srv_stop(sh->s);
    pthread_join(sh->th, NULL);
    srv_free(sh->s);
}

/* Waits (bounded: 20 s) until each shard of sh[0..n) has closed at least `want` idle links. */
static bool wait_idle_closes(shard *sh, int n, int want) {
    for (int i = 0; i < 2000; i++) {
        int done = 0;
        for (int k = 0; k < n; k++) done += atomic_load(&sh[k].idle_closes) >= want;
        if (done == n) return true;
        proc_sleep_ms(10);
    }
    for (int k = 0; k < n; k++) fprintf(stderr, "shard %d: %d idle close(s), want %d\n", k, atomic_load(&sh[k].idle_closes), want);
    return false;
}

/* One counter of a shard's stats, or -1. */
static long shard_stat(shard *sh, const char *name) {
    struct wire_stats_reply m;
    srv_stats(sh->s, &m);
    for (uint32_t i = 0; i < m.n_stats; i++)
        if (!strcmp(m.stats[i].name, name)) return (long)m.stats[i].value;
    return -1;
}

/* Waits (bounded: 20 s) until no connection is open on sh: the shard logs "idle for" before it
 * closes the socket, and a request sent between the two would meet the close. */
static bool wait_no_conns(shard *sh) {
    for (int i = 0; i < 2000; i++) {
        if (shard_stat(sh, "srv.connections_open") == 0) return true;
        proc_sleep_ms(10);
    }
    fprintf(stderr, "shard: %ld connections still open\n", shard_stat(sh, "srv.connections_open"));
    return false;
}

/* ---- a tiny HTTP/1.0 client ------------------------------------------------------------------ */

typedef struct {
    int status;
    char *body;
    char head[2048]; /* the status line and headers */
} resp;

/* One request with extra header lines (each ending in \r\n; NULL: none); reads until EOF
 * (HTTP/1.0) within 60 s. false when nothing came back. */
static bool request_ex(uint16_t port, const char *method, const char *path, const char *headers, const char *body,
                       resp *r) {
    memset(r, 0, sizeof *r);
    int fd = -1;
    char msg[KVS_MSG_MAX];
    if (netio_connect("127.0.0.1", port, netio_deadline_ms(5000), &fd, msg, sizeof msg)) return false;
    char head[1024];
    size_t blen = body ? strlen(body) : 0;
    int n = snprintf(head, sizeof head, "%s %s HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     "%sContent-Length: %zu\r\n\r\n", method, path, headers ? headers : "", blen);
    uint64_t until = netio_deadline_ms(10000);
    bool ok = netio_write_full(fd, head, (size_t)n, until) == KVS_OK &&
              (!blen || netio_write_full(fd, body, blen, until) == KVS_OK);
    size_t len = 0, cap = 8192;
    char *buf = malloc(cap);
    while (ok) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 60000) <= 0) break;
        if (len + 4096 > cap) buf = realloc(buf, cap *= 2);
        ssize_t got = read(fd, buf + len, cap - len - 1);
        if (got <= 0) break;
        len += (size_t)got;
    }
    close(fd);
    buf[len] = 0;
    char *sep = strstr(buf, "\r\n\r\n");
    if (!sep || sscanf(buf, "HTTP/1.%*d %d", &r->status) != 1) {
        free(buf);
        return false;
    }
    r->body = strdup(sep + 4);
    snprintf(r->head, sizeof r->head, "%.*s", (int)(sep - buf), buf);
    free(buf);
    return true;
}

static bool request(uint16_t port, const char *method, const char *path, const char *body, resp *r) {
    return request_ex(port, method, path, NULL, body, r);
}

/* The text of a /v1/completions reply body (malloc'd), or NULL. */
static char *completion_text(const char *body) {
    cJSON *j = cJSON_Parse(body);
    cJSON *t = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0), "text");
    char *s = cJSON_IsString(t) ? strdup(t->valuestring) : NULL;
    cJSON_Delete(j);
    return s;
}

static void count_reconnects(void *ctx, const char *line) {
    if (strstr(line, "reconnected")) atomic_fetch_add((atomic_int *)ctx, 1);
}

/* ---- 1. idle links --------------------------------------------------------------------------- */

/* A route whose links both shards closed for idleness steps on: the client reconnects with HELLO
 * and the session, still on the shards, goes on where it was (same logits as a fresh run). */
static void check_idle_route(shard *sh, const char *spec) {
    route_params rp = route_default_params();
    rp.timeout_ms = 10000;
    atomic_int reconnects;
    atomic_init(&reconnects, 0);
    rp.log = count_reconnects;
    rp.log_user = &reconnects;
    route *r = NULL;
    route_session *s = NULL, *ref = NULL;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(route_open(spec, NULL, &rp, &r, msg, sizeof msg), KVS_OK);
    if (!r) return;
    route_info info;
    route_get_info(r, &info);
    float *a = malloc(sizeof(float) * info.n_vocab), *b = malloc(sizeof(float) * info.n_vocab);
    const int32_t toks[4] = {1, 20, 30, 40};
    int before0 = atomic_load(&sh[0].idle_closes), before1 = atomic_load(&sh[1].idle_closes);
    CHECK_EQ_INT(route_session_open(r, &s, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(route_forward(r, s, toks, 2, a, msg, sizeof msg), KVS_OK);
    /* Both links go idle and the shards close them. */
    bool closed = false;
    for (int i = 0; i < 2000 && !closed; i++) {
        closed = atomic_load(&sh[0].idle_closes) > before0 && atomic_load(&sh[1].idle_closes) > before1;
        if (!closed) proc_sleep_ms(10);
    }
    CHECK(closed);
    CHECK(wait_no_conns(&sh[0]) && wait_no_conns(&sh[1]));
    int rc = route_forward(r, s, toks + 2, 2, a, msg, sizeof msg);
    if (rc != KVS_OK) fprintf(stderr, "after idle: %s\n", msg);
    CHECK_EQ_INT(rc, KVS_OK);
    CHECK_EQ_INT((int)route_session_pos(s), 4);
    CHECK_EQ_INT(atomic_load(&reconnects), 2); /* both hops, each said HELLO again */
    /* The same four tokens in one go on a fresh session. */
    CHECK_EQ_INT(route_session_open(r, &ref, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(route_forward(r, ref, toks, 4, b, msg, sizeof msg), KVS_OK);
    double diff = 0;
    for (uint32_t i = 0; i < info.n_vocab; i++) diff = fmax(diff, fabs((double)a[i] - b[i]));
    CHECK_NEAR(diff, 0.0, 1e-4);
    route_release(r, s);
    route_release(r, ref);
    route_close(r);
    free(a);
    free(b);
}

/* `api --route` answers after the shards closed its idle links, with the same text as before. */
static void check_idle_api(shard *sh, const char *spec) {
    http_params p = http_default_params();
    p.listen = "127.0.0.1:0";
    p.route = spec;
    p.model_name = "stories260K";
    p.lanes = 1;
    http_server *h = NULL;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(http_start(&p, &h, msg, sizeof msg), KVS_OK);
    if (!h) return;
    const char *body = "{\"prompt\":\"Once upon a time\",\"max_tokens\":8,\"temperature\":0}";
    resp r1, r2;
    CHECK(request(http_port(h), "POST", "/v1/completions", body, &r1));
    CHECK_EQ_INT(r1.status, 200);
    int before = atomic_load(&sh[1].idle_closes);
    CHECK(wait_idle_closes(sh + 1, 1, before + 1));
    CHECK(wait_no_conns(&sh[1]));
    CHECK(request(http_port(h), "POST", "/v1/completions", body, &r2));
    CHECK_EQ_INT(r2.status, 200);
    char *t1 = completion_text(r1.body ? r1.body : ""), *t2 = completion_text(r2.body ? r2.body : "");
    CHECK(t1 && t2 && !strcmp(t1, t2));
    if (t1 && t2 && strcmp(t1, t2)) fprintf(stderr, "before idle '%s', after '%s'\n", t1, t2);
    free(t1);
    free(t2);
    free(r1.body);
    free(r2.body);
    http_stop(h);
}

/* A number member of a reply body; -1 when absent. */
static double body_number(const char *body, const char *path1, const char *path2) {
    cJSON *j = cJSON_Parse(body ? body : "");
    const cJSON *x = cJSON_GetObjectItem(j, path1);
    if (path2) x = cJSON_GetObjectItem(x, path2);
    double v = cJSON_IsNumber(x) ? x->valuedouble : -1;
    cJSON_Delete(j);
    return v;
}

/* The "param" of an error reply, or "". */
static void error_param(const char *body, char *out, size_t cap) {
    cJSON *j = cJSON_Parse(body ? body : "");
    const cJSON *p = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "error"), "param");
    snprintf(out, cap, "%s", cJSON_IsString(p) ? p->valuestring : "");
    cJSON_Delete(j);
}

static http_server *api_start(const char *spec, const char *tokenizer) {
    http_params p = http_default_params();
    p.listen = "127.0.0.1:0";
    p.route = spec;
    p.tokenizer_path = tokenizer;
    p.model_name = "stories260K";
    p.lanes = 1;
    http_server *h = NULL;
    char msg[KVS_MSG_MAX] = "";
    if (http_start(&p, &h, msg, sizeof msg) != KVS_OK) fprintf(stderr, "http_start: %s\n", msg);
    return h;
}

/* ---- 3, 4, 5: the API's seed, the llama.cpp fields, short prompts --------------------------- */

/* No seed: each reply names a fresh one; the same seed again gives the same text. */
static void check_api_seed(uint16_t port) {
    const char *body = "{\"prompt\":\"Once upon a time\",\"max_tokens\":12,\"temperature\":1}";
    resp a, b;
    CHECK(request(port, "POST", "/v1/completions", body, &a) && request(port, "POST", "/v1/completions", body, &b));
    double sa = body_number(a.body, "seed", NULL), sb = body_number(b.body, "seed", NULL);
    printf("seeds of two requests without one: %.0f, %.0f\n", sa, sb);
    CHECK(sa >= 0 && sb >= 0 && sa != sb);
    char again[160];
    snprintf(again, sizeof again, "{\"prompt\":\"Once upon a time\",\"max_tokens\":12,\"temperature\":1,\"seed\":%.0f}", sa);
    resp c;
    CHECK(request(port, "POST", "/v1/completions", again, &c));
    CHECK(body_number(c.body, "seed", NULL) == sa);
    char *ta = completion_text(a.body ? a.body : ""), *tc = completion_text(c.body ? c.body : "");
    CHECK(ta && tc && !strcmp(ta, tc));
    free(ta);
    free(tc);
    free(a.body);
    free(b.body);
    free(c.body);
}

/* llama.cpp's fields are used (n_predict bounds the reply), any other unknown field is a 400
 * naming it. */
static void check_api_fields(uint16_t port) {
    resp r;
    CHECK(request(port, "POST", "/v1/completions", "{\"prompt\":\"Once\",\"n_predict\":3,\"temperature\":0}", &r));
    CHECK_EQ_INT(r.status, 200);
    CHECK_EQ_INT((int)body_number(r.body, "usage", "completion_tokens"), 3);
    free(r.body);
    const char *all = "{\"prompt\":\"Once\",\"max_tokens\":4,\"min_p\":0.05,\"top_k\":20,\"repeat_penalty\":1.1,"
                      "\"repeat_last_n\":32,\"presence_penalty\":0.5,\"frequency_penalty\":0,\"seed\":1}";
    CHECK(request(port, "POST", "/v1/completions", all, &r));
    CHECK_EQ_INT(r.status, 200);
    free(r.body);
    CHECK(request(port, "POST", "/v1/chat/completions",
                  "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"n_predict\":2,\"min_p\":0.1}", &r));
    CHECK_EQ_INT(r.status, 200);
    CHECK_EQ_INT((int)body_number(r.body, "usage", "completion_tokens") <= 2, 1);
    free(r.body);
    static const struct { const char *body, *param; } bad[] = {
        {"{\"prompt\":\"Once\",\"mirostat\":2}", "mirostat"},
        {"{\"prompt\":\"Once\",\"typical_p\":0.5}", "typical_p"},
        {"{\"prompt\":\"Once\",\"min_p\":2}", "min_p"},
        {"{\"prompt\":\"Once\",\"messages\":[]}", "messages"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK(request(port, "POST", "/v1/completions", bad[i].body, &r));
        char param[64];
        error_param(r.body, param, sizeof param);
        if (r.status != 400 || strcmp(param, bad[i].param))
            fprintf(stderr, "%s: status %d, param '%s', want 400 '%s'\n", bad[i].body, r.status, param, bad[i].param);
        CHECK(r.status == 400 && !strcmp(param, bad[i].param));
        free(r.body);
    }
}

/* One-character and short prompts through --route with the tokenizer from the file (an SPM
 * vocab with byte fallback). */
static void check_short_prompts(const char *spec, const char *model) {
    http_server *h = api_start(spec, model);
    CHECK(h != NULL);
    if (!h) return;
    static const char *const prompts[] = {"1", "S", "Hi!", ".", " "};
    for (size_t i = 0; i < sizeof prompts / sizeof prompts[0]; i++) {
        char body[128];
        snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":2,\"temperature\":0}", prompts[i]);
        resp r;
        CHECK(request(http_port(h), "POST", "/v1/completions", body, &r));
        if (r.status != 200) fprintf(stderr, "prompt '%s': %d %s\n", prompts[i], r.status, r.body ? r.body : "");
        CHECK_EQ_INT(r.status, 200);
        free(r.body);
    }
    http_stop(h);
}

static bool log_has(const char *path, const char *needle);

/* ---- 11. the endpoints people expect, CORS ----------------------------------------------------- */

/* A string member of a reply body, or "" (out holds cap bytes). */
static void body_string(const char *body, const char *name, char *out, size_t cap) {
    cJSON *j = cJSON_Parse(body ? body : "");
    const cJSON *x = cJSON_GetObjectItem(j, name);
    snprintf(out, cap, "%s", cJSON_IsString(x) ? x->valuestring : "");
    cJSON_Delete(j);
}

/* The ids of a /tokenize reply ({"tokens":[...]}) into ids (at most cap); their count or -1. */
static int reply_ids(const char *body, int32_t *ids, int cap) {
    cJSON *j = cJSON_Parse(body ? body : "");
    const cJSON *t = cJSON_GetObjectItem(j, "tokens");
    int n = cJSON_IsArray(t) ? cJSON_GetArraySize(t) : -1;
    for (int i = 0; i < n && i < cap; i++) ids[i] = (int32_t)cJSON_GetArrayItem(t, i)->valuedouble;
    cJSON_Delete(j);
    return n;
}

/* One request; its status, and whether a header line (case-insensitive) holds want. */
static int status_of(uint16_t port, const char *method, const char *path, const char *headers, const char *body,
                     const char *want, bool *has, char *param, size_t pcap) {
    resp r;
    if (!request_ex(port, method, path, headers, body, &r)) return -1;
    if (has) *has = want && strcasestr(r.head, want) != NULL;
    if (param) error_param(r.body, param, pcap);
    free(r.body);
    return r.status;
}

/* /version, /v1/models/{id}, /tokenize and /detokenize (llama-server's shapes, a round trip),
 * 400/404/405 naming what is wrong, the favicon; CORS for the allowed origin only, preflight. */
static void check_api_extra(const char *spec, const char *model, uint16_t plain_port) {
    http_params p = http_default_params();
    p.listen = "127.0.0.1:0";
    p.route = spec;
    p.tokenizer_path = model;
    p.model_name = "stories260K";
    p.lanes = 1;
    p.cors = "http://app.example, http://other.example";
    p.version = "test-version";
    http_server *h = NULL;
    char msg[KVS_MSG_MAX] = "", s[256], param[64];
    CHECK_EQ_INT(http_start(&p, &h, msg, sizeof msg), KVS_OK);
    if (!h) return;
    uint16_t port = http_port(h);
    resp r;
    CHECK(request(port, "GET", "/version", NULL, &r) && r.status == 200);
    body_string(r.body, "version", s, sizeof s);
    CHECK(!strcmp(s, "test-version"));
    free(r.body);
    CHECK(request(port, "GET", "/v1/models/stories260K", NULL, &r) && r.status == 200);
    body_string(r.body, "id", s, sizeof s);
    CHECK(!strcmp(s, "stories260K"));
    CHECK(body_number(r.body, "context_length", NULL) > 0);
    free(r.body);
    CHECK_EQ_INT(status_of(port, "GET", "/v1/models/gpt-4", NULL, NULL, NULL, NULL, param, sizeof param), 404);
    CHECK(!strcmp(param, "model"));
    /* tokenize -> detokenize is the text again; add_special puts BOS first; pieces are strings. */
    int32_t ids[64], ids_bos[64];
    CHECK(request(port, "POST", "/tokenize", "{\"content\":\"Once upon a time\"}", &r) && r.status == 200);
    int n = reply_ids(r.body, ids, 64);
    free(r.body);
    CHECK(n > 1 && n < 64);
    CHECK(request(port, "POST", "/tokenize", "{\"content\":\"Once upon a time\",\"add_special\":true}", &r));
    CHECK_EQ_INT(reply_ids(r.body, ids_bos, 64), n + 1);
    CHECK_EQ_INT(ids_bos[0], 1);
    free(r.body);
    CHECK(request(port, "POST", "/tokenize", "{\"content\":\"Once\",\"with_pieces\":true}", &r) && r.status == 200);
    CHECK(strstr(r.body, "\"piece\":\"") != NULL);
    free(r.body);
    char body[512];
    int at = snprintf(body, sizeof body, "{\"tokens\":[");
    for (int i = 0; i < n && n < 64; i++) at += snprintf(body + at, sizeof body - (size_t)at, "%s%d", i ? "," : "", ids[i]);
    snprintf(body + at, sizeof body - (size_t)at, "]}");
    CHECK(request(port, "POST", "/detokenize", body, &r) && r.status == 200);
    body_string(r.body, "content", s, sizeof s);
    CHECK(!strcmp(s, "Once upon a time"));
    if (strcmp(s, "Once upon a time")) fprintf(stderr, "detokenize: '%s'\n", s);
    free(r.body);
    CHECK_EQ_INT(status_of(port, "POST", "/tokenize", NULL, "{\"content\":\"x\",\"foo\":1}", NULL, NULL, param, sizeof param), 400);
    CHECK(!strcmp(param, "foo"));
    CHECK_EQ_INT(status_of(port, "POST", "/detokenize", NULL, "{\"tokens\":[1,99999999]}", NULL, NULL, param, sizeof param), 400);
    CHECK(!strcmp(param, "tokens"));
    CHECK_EQ_INT(status_of(port, "GET", "/tokenize", NULL, NULL, "Allow: POST", &(bool){0}, NULL, 0), 405);
    CHECK_EQ_INT(status_of(port, "GET", "/favicon.ico", NULL, NULL, NULL, NULL, NULL, 0), 204);
    /* CORS: the allowed origin gets its header, another none; the preflight names the methods. */
    bool has = false;
    CHECK_EQ_INT(status_of(port, "GET", "/v1/models", "Origin: http://other.example\r\n", NULL,
                           "Access-Control-Allow-Origin: http://other.example", &has, NULL, 0), 200);
    CHECK(has);
    CHECK_EQ_INT(status_of(port, "GET", "/v1/models", "Origin: http://evil.example\r\n", NULL,
                           "Access-Control-Allow-Origin", &has, NULL, 0), 200);
    CHECK(!has);
    const char *pre = "Origin: http://app.example\r\nAccess-Control-Request-Method: POST\r\n"
                      "Access-Control-Request-Headers: authorization, content-type\r\n";
    CHECK_EQ_INT(status_of(port, "OPTIONS", "/v1/chat/completions", pre, NULL,
                           "Access-Control-Allow-Methods: POST", &has, NULL, 0), 204);
    CHECK(has);
    CHECK(request_ex(port, "OPTIONS", "/v1/chat/completions", pre, NULL, &r));
    CHECK(strcasestr(r.head, "Access-Control-Allow-Origin: http://app.example") &&
          strcasestr(r.head, "Access-Control-Allow-Headers: authorization, content-type"));
    free(r.body);
    /* A streamed reply carries the header too. */
    CHECK_EQ_INT(status_of(port, "POST", "/v1/completions", "Origin: http://app.example\r\n",
                           "{\"prompt\":\"Once\",\"max_tokens\":2,\"stream\":true}",
                           "Access-Control-Allow-Origin: http://app.example", &has, NULL, 0), 200);
    CHECK(has);
    http_stop(h);
    /* Without --cors: no header, and OPTIONS is not allowed. */
    CHECK_EQ_INT(status_of(plain_port, "GET", "/v1/models", "Origin: http://app.example\r\n", NULL,
                           "Access-Control-Allow-Origin", &has, NULL, 0), 200);
    CHECK(!has);
    CHECK_EQ_INT(status_of(plain_port, "OPTIONS", "/v1/models", pre, NULL, NULL, NULL, NULL, 0), 405);
}

/* ---- 11. graceful stop of the api ------------------------------------------------------------- */

/* The before-step hook: each request stops before its third step until go is set (bounded). */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int reached; /* requests waiting in the hook */
    bool go;
} step_gate;

static void gate_step(void *ctx, uint64_t request_no, uint32_t n_generated) {
    (void)request_no;
    step_gate *g = ctx;
    if (n_generated != 2) return;
    pthread_mutex_lock(&g->mu);
    g->reached++;
    pthread_cond_broadcast(&g->cv);
    uint64_t until = kvs_now_ns() + 30000000000ull;
    while (!g->go && kvs_now_ns() < until) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += 1;
        pthread_cond_timedwait(&g->cv, &g->mu, &ts);
    }
    pthread_mutex_unlock(&g->mu);
}

static bool gate_wait(step_gate *g, int n) {
    pthread_mutex_lock(&g->mu);
    for (int i = 0; i < 30 && g->reached < n; i++) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += 1;
        pthread_cond_timedwait(&g->cv, &g->mu, &ts);
    }
    bool ok = g->reached >= n;
    pthread_mutex_unlock(&g->mu);
    return ok;
}

static void gate_open(step_gate *g) {
    pthread_mutex_lock(&g->mu);
    g->go = true;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

typedef struct {
    uint16_t port;
    const char *body;
    resp r;
    bool ok;
    http_server *h; /* drainer: the server, its deadline and result */
    int64_t deadline_ms;
    int cut;
} bg_call;

static void *bg_request(void *p) {
    bg_call *b = p;
    b->ok = request(b->port, "POST", "/v1/completions", b->body, &b->r);
    return NULL;
}

static void *bg_drain(void *p) {
    bg_call *b = p;
    b->cut = http_drain(b->h, b->deadline_ms, NULL);
    return NULL;
}

/* Bounded: until a connect to port is refused (the drain closed the listener). */
static bool wait_refused(uint16_t port) {
    for (int i = 0; i < 2000; i++) {
        int fd = -1;
        char msg[KVS_MSG_MAX];
        if (netio_connect("127.0.0.1", port, netio_deadline_ms(2000), &fd, msg, sizeof msg) != KVS_OK) return true;
        close(fd);
        proc_sleep_ms(10);
    }
    return false;
}

/* The completion_tokens of a reply (the last usage object of a stream), or -1. */
static int completion_tokens(const char *body) {
    const char *at = NULL;
    for (const char *p = body; (p = strstr(p, "\"completion_tokens\":")); p++) at = p;
    return at ? atoi(at + strlen("\"completion_tokens\":")) : -1;
}

/* http_drain with requests running: the new connection is refused while they go on; with a
 * deadline they finish whole (12 tokens), with none they end at their next step, the stream
 * with its last chunk and [DONE], both finish_reason "length". */
static void check_api_drain(const char *spec) {
    for (int cut_now = 0; cut_now < 2; cut_now++) {
        step_gate g = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
        http_params p = http_default_params();
        p.listen = "127.0.0.1:0";
        p.route = spec;
        p.model_name = "stories260K";
        p.lanes = 2;
        p.before_step = gate_step;
        p.hook_ctx = &g;
        http_server *h = NULL;
        char msg[KVS_MSG_MAX] = "";
        CHECK_EQ_INT(http_start(&p, &h, msg, sizeof msg), KVS_OK);
        if (!h) return;
        bg_call req[2] = {
            {.port = http_port(h), .body = "{\"prompt\":\"Once upon a time\",\"max_tokens\":12,\"temperature\":0,"
                                          "\"stream\":true,\"stream_options\":{\"include_usage\":true}}"},
            {.port = http_port(h), .body = "{\"prompt\":\"Once upon a time\",\"max_tokens\":12,\"temperature\":0}"},
        };
        pthread_t th[2], dt;
        for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, bg_request, &req[i]);
        CHECK(gate_wait(&g, 2));
        bg_call drainer = {.h = h, .deadline_ms = cut_now ? 0 : 60000};
        pthread_create(&dt, NULL, bg_drain, &drainer);
        CHECK(wait_refused(http_port(h)));
        gate_open(&g);
        /* The drain returns once both are done: stopping the server then cuts nothing short. */
        pthread_join(dt, NULL);
        http_stop(h);
        for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
        CHECK_EQ_INT(drainer.cut, cut_now ? 2 : 0);
        for (int i = 0; i < 2; i++) {
            CHECK(req[i].ok && req[i].r.status == 200);
            const char *b = req[i].r.body ? req[i].r.body : "";
            int n = completion_tokens(b);
            printf("drain (%s): request %d: %d tokens\n", cut_now ? "cut" : "deadline", i, n);
            if (cut_now) CHECK(n >= 2 && n < 12);
            else CHECK_EQ_INT(n, 12);
            CHECK(strstr(b, "\"finish_reason\":\"length\"") != NULL);
            if (i == 0) CHECK(strstr(b, "data: [DONE]") != NULL);
            free(req[i].r.body);
        }
    }
}

/* `kvshard api --route ... --tokenizer FILE`: the model id is the file's name; SIGTERM stops
 * it with status 0 through the drain. */
static void check_api_sigterm(const char *spec, const char *model, const char *dir) {
    char *argv[] = {"kvshard", "api", "--route", (char *)spec, "--tokenizer", (char *)model, "--listen", "127.0.0.1:0",
                    "--lanes", "1", NULL};
    proc_server s;
    CHECK(proc_start_listener(&s, dir, "api", argv));
    if (s.pid <= 0 || s.port <= 0) return;
    resp r;
    CHECK(request((uint16_t)s.port, "GET", "/v1/models/stories260K", NULL, &r) && r.status == 200);
    free(r.body);
    CHECK(request((uint16_t)s.port, "POST", "/v1/completions", "{\"prompt\":\"Once\",\"max_tokens\":3}", &r));
    CHECK_EQ_INT(r.status, 200);
    free(r.body);
    CHECK(request((uint16_t)s.port, "POST", "/v1/completions", "{\"prompt\":\"Once\",\"mirostat\":2}", &r));
    CHECK_EQ_INT(r.status, 400);
    free(r.body);
    CHECK_EQ_INT(proc_stop_server(&s), 0);
    CHECK(log_has(s.log, "kvshard api: stopping: new requests refused") && log_has(s.log, "kvshard api: stopped"));
    /* One line per generation request at the default level, errors included. */
    CHECK(log_has(s.log, "/v1/completions 200: ") && log_has(s.log, "3 generated tokens in "));
    CHECK(log_has(s.log, "/v1/completions: 400 unknown field 'mirostat'"));
}

/* ---- graceful stop of a shard ------------------------------------------------------------------ */

typedef struct {
    step_gate g;
    atomic_bool armed; /* the next forward pass waits in the hook */
    atomic_int drained, refused; /* log lines seen */
} batch_gate;

static void batch_hook(void *ctx, int n_items) {
    (void)n_items;
    batch_gate *b = ctx;
    if (atomic_exchange(&b->armed, false)) gate_step(&b->g, 0, 2);
}

static void drain_log(void *ctx, const char *line) {
    batch_gate *b = ctx;
    if (strstr(line, "drained: every request in flight was answered")) atomic_fetch_add(&b->drained, 1);
    if (getenv("KVS_TEST_VERBOSE")) fprintf(stderr, "serve: %s\n", line);
}

typedef struct {
    route *r;
    route_session *s;
    int rc;
    char msg[KVS_MSG_MAX];
    float *logits;
} bg_forward;

static void *bg_fwd(void *p) {
    bg_forward *f = p;
    const int32_t toks[2] = {1, 20};
    f->rc = route_forward(f->r, f->s, toks, 2, f->logits, f->msg, sizeof f->msg);
    return NULL;
}

/* srv_stop with drain_ms while a forward pass is held in the hook: new connects are refused, a
 * FORWARD on another open link is refused naming the shutdown, and a route with a spare moves to
 * it (replaying its session) with the same logits; the held one is answered, and srv_run returns
 * saying so. */
static void check_shard_drain(const char *model) {
    batch_gate b = {.g = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER}};
    srv_params p = srv_default_params();
    p.model_path = model;
    p.listen = "127.0.0.1:0";
    p.n_threads = 1;
    p.kv_budget_bytes = 16u << 20;
    p.drain_ms = 30000;
    p.before_batch = batch_hook;
    p.hook_ctx = &b;
    p.log = drain_log;
    p.log_ctx = &b;
    shard sh = {0};
    char msg[KVS_MSG_MAX] = "", spec[64];
    CHECK_EQ_INT(srv_create(&p, &sh.s, msg, sizeof msg), KVS_OK);
    if (!sh.s) return;
    pthread_create(&sh.th, NULL, shard_main, &sh);
    uint16_t port = srv_port(sh.s);
    snprintf(spec, sizeof spec, "127.0.0.1:%u", port);
    route_params rp = route_default_params();
    rp.timeout_ms = 30000;
    shard spare = {0};
    CHECK(shard_start(&spare, model, 0, 0, 60000));
    char spare_spec[64];
    snprintf(spare_spec, sizeof spare_spec, "127.0.0.1:%u", srv_port(spare.s));
    bg_forward f = {0}, other = {0}, moved = {0};
    CHECK_EQ_INT(route_open(spec, NULL, &rp, &f.r, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(route_open(spec, NULL, &rp, &other.r, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(route_open(spec, spare_spec, &rp, &moved.r, msg, sizeof msg), KVS_OK);
    if (!f.r || !other.r || !moved.r) return;
    route_info info;
    route_get_info(f.r, &info);
    f.logits = malloc(sizeof(float) * info.n_vocab);
    other.logits = malloc(sizeof(float) * info.n_vocab);
    CHECK_EQ_INT(route_session_open(f.r, &f.s, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(route_session_open(other.r, &other.s, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(route_session_open(moved.r, &moved.s, msg, sizeof msg), KVS_OK);
    moved.logits = malloc(sizeof(float) * info.n_vocab);
    float *before = malloc(sizeof(float) * info.n_vocab);
    bg_fwd(&moved); /* [1, 20] on the shard that will drain */
    CHECK_EQ_INT(moved.rc, KVS_OK);
    const int32_t next[1] = {30};
    CHECK_EQ_INT(route_forward(moved.r, moved.s, next, 1, before, msg, sizeof msg), KVS_OK);
    route_session_rewind(moved.s, 2);
    atomic_store(&b.armed, true);
    pthread_t th;
    pthread_create(&th, NULL, bg_fwd, &f);
    CHECK(gate_wait(&b.g, 1)); /* the pass is held */
    srv_stop(sh.s);
    CHECK(wait_refused(port));
    bg_fwd(&other);
    printf("a FORWARD while the shard drains: %s\n", other.msg);
    CHECK(other.rc != KVS_OK && strstr(other.msg, "shutting down") != NULL);
    /* The route with a spare steps on there: token 30 again, from the replayed [1, 20]. */
    int rc = route_forward(moved.r, moved.s, next, 1, moved.logits, msg, sizeof msg);
    if (rc != KVS_OK) fprintf(stderr, "with a spare: %s\n", msg);
    CHECK_EQ_INT(rc, KVS_OK);
    route_info mi;
    route_get_info(moved.r, &mi);
    CHECK_EQ_INT((int)mi.reroutes, 1);
    double diff = 0;
    for (uint32_t i = 0; i < info.n_vocab; i++) diff = fmax(diff, fabs((double)moved.logits[i] - before[i]));
    CHECK_NEAR(diff, 0.0, 1e-4);
    gate_open(&b.g);
    pthread_join(th, NULL);
    if (f.rc != KVS_OK) fprintf(stderr, "held forward: %s\n", f.msg);
    CHECK_EQ_INT(f.rc, KVS_OK);
    pthread_join(sh.th, NULL); /* srv_run returns once drained */
    CHECK_EQ_INT(atomic_load(&b.drained), 1);
    route_release(f.r, f.s);
    route_release(other.r, other.s);
    route_close(f.r);
    route_close(other.r);
    route_release(moved.r, moved.s);
    route_close(moved.r);
    free(moved.logits);
    free(before);
    shard_stop(&spare);
    srv_free(sh.s);
    free(f.logits);
    free(other.logits);
}

/* ---- 6. the wrong port ------------------------------------------------------------------------ */

/* A route at an HTTP port fails at once saying so (it waited out its whole timeout with "no
 * reply to HELLO"); a plaintext route at a TLS shard is told the shard speaks TLS. */
static void check_wrong_port(uint16_t http_port_no, const char *model, const char *dir) {
    route_params rp = route_default_params();
    rp.timeout_ms = 60000;
    route *r = NULL;
    char spec[64], msg[KVS_MSG_MAX] = "";
    snprintf(spec, sizeof spec, "127.0.0.1:%u", http_port_no);
    uint64_t t0 = kvs_now_ns();
    CHECK(route_open(spec, NULL, &rp, &r, msg, sizeof msg) != KVS_OK);
    double s = (double)(kvs_now_ns() - t0) / 1e9;
    printf("route at the api port: %.1f s: %s\n", s, msg);
    CHECK(strstr(msg, "HTTP") != NULL);
    CHECK(s < 30.0); /* half the timeout it used to wait out */
    const char *names[] = {"shard"};
    CHECK_EQ_INT(tls_make_cluster(dir, names, 1, 2, msg, sizeof msg), KVS_OK);
    char cert[200], key[200], ca[200];
    snprintf(cert, sizeof cert, "%s/shard.pem", dir);
    snprintf(key, sizeof key, "%s/shard.key", dir);
    snprintf(ca, sizeof ca, "%s/ca.pem", dir);
    srv_params p = srv_default_params();
    p.model_path = model;
    p.listen = "127.0.0.1:0";
    p.n_threads = 1;
    p.kv_budget_bytes = 4u << 20;
    p.tls_cert = cert;
    p.tls_key = key;
    p.tls_ca = ca;
    shard sh = {0};
    p.log = shard_log;
    p.log_ctx = &sh;
    CHECK_EQ_INT(srv_create(&p, &sh.s, msg, sizeof msg), KVS_OK);
    if (!sh.s) return;
    pthread_create(&sh.th, NULL, shard_main, &sh);
    snprintf(spec, sizeof spec, "127.0.0.1:%u", srv_port(sh.s));
    CHECK(route_open(spec, NULL, &rp, &r, msg, sizeof msg) != KVS_OK);
    printf("plaintext route at a TLS shard: %s\n", msg);
    CHECK(strstr(msg, "TLS") && strstr(msg, "--tls-cert"));
    shard_stop(&sh);
}

/* ---- 2. context size ------------------------------------------------------------------------ */

/* The route's context (INFO max_ctx) of a one-shard route on a shard of p, or 0 when srv_create
 * failed (its message in msg). */
static uint32_t shard_ctx(const char *model, uint32_t max_ctx, uint64_t budget, char *msg, size_t cap) {
    srv_params p = srv_default_params();
    p.model_path = model;
    p.listen = "127.0.0.1:0";
    p.n_threads = 1;
    p.max_ctx = max_ctx;
    if (budget) p.kv_budget_bytes = budget;
    srv *s = NULL;
    msg[0] = 0;
    if (srv_create(&p, &s, msg, cap) != KVS_OK) return 0;
    pthread_t th;
    pthread_create(&th, NULL, shard_main, &(shard){.s = s});
    char spec[64];
    snprintf(spec, sizeof spec, "127.0.0.1:%u", srv_port(s));
    route_params rp = route_default_params();
    route *r = NULL;
    route_info info = {0};
    if (route_open(spec, NULL, &rp, &r, msg, cap) == KVS_OK) route_get_info(r, &info);
    route_close(r);
    srv_stop(s);
    pthread_join(th, NULL);
    srv_free(s);
    return info.max_ctx;
}

static char *cli(const char *dir, const char *const *args, int *st) {
    char err[256];
    snprintf(err, sizeof err, "%s/cli.err", dir);
    unlink(err);
    char *out = NULL;
    *st = proc_run_args(args, &out, err, 120000);
    size_t n = 0;
    uint8_t *e = test_read_file(err, &n);
    char *both = malloc(strlen(out ? out : "") + n + 2);
    sprintf(both, "%s\n%.*s", out ? out : "", (int)n, e ? (const char *)e : "");
    free(out);
    free(e);
    return both;
}

/* A model of context 8192: the shard gives it whole by default (it was capped at 2048), the budget
 * limits it, -c asks for less, and what cannot be met fails up front naming the flag. */
static void check_ctx_size(const char *dir) {
    char model[256], msg[KVS_MSG_MAX];
    snprintf(model, sizeof model, "%s/tiny-long.gguf", dir);
    mkmodel_params mp = mkmodel_default_params();
    mp.shape = "tiny-long";
    mp.n_threads = 1;
    CHECK_EQ_INT(mkmodel_write(model, mp, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT((int)shard_ctx(model, 0, 0, msg, sizeof msg), 8192);
    CHECK_EQ_INT((int)shard_ctx(model, 3000, 0, msg, sizeof msg), 3000);
    /* 64 KiB of f16 KV for 2 layers x 2 heads x 16 dims: 256 positions minus block rounding. */
    uint32_t small = shard_ctx(model, 0, 64u << 10, msg, sizeof msg);
    CHECK(small > 0 && small < 8192);
    CHECK_EQ_INT((int)shard_ctx(model, 8192, 64u << 10, msg, sizeof msg), 0);
    CHECK(strstr(msg, "--kv-budget") && strstr(msg, "--ctx-size"));
    printf("tiny budget: max_ctx %u; asking for 8192: %s\n", small, msg);
    CHECK_EQ_INT((int)shard_ctx(model, 9000, 0, msg, sizeof msg), 0);
    CHECK(strstr(msg, "--ctx-size 9000") && strstr(msg, "8192"));
    if (access(proc_bin(), X_OK) != 0) return;
    /* run past 2048 positions; -c too small is refused before any compute, naming -c. */
    int st;
    const char *run_long[] = {"run", "-m", model, "-p", "hi", "-n", "2100", "--temp", "0", "--json", "-t", "1", NULL};
    char *out = cli(dir, run_long, &st);
    CHECK_EQ_INT(st, 0);
    if (st) fprintf(stderr, "%s\n", out);
    free(out);
    const char *run_small[] = {"run", "-m", model, "-p", "hello there", "-n", "20", "-c", "16", "-t", "1", NULL};
    out = cli(dir, run_small, &st);
    CHECK_EQ_INT(st, 1);
    CHECK(strstr(out, "-c/--ctx-size") != NULL);
    free(out);
    /* kvshard stats shows it. */
    proc_server s;
    const char *extra[] = {"--ctx-size", "1000", NULL};
    CHECK(proc_start_server(&s, dir, model, "0:2", extra));
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", s.port);
    const char *stats[] = {"stats", addr, NULL};
    out = cli(dir, stats, &st);
    CHECK_EQ_INT(st, 0);
    CHECK(strstr(out, "\"max_ctx\":1000") != NULL);
    free(out);
    CHECK_EQ_INT(proc_stop_server(&s), 0); /* SIGTERM: drained, status 0 */
    CHECK(log_has(s.log, "drained: every request in flight was answered"));
}

/* ---- 7. what every command takes; messages ---------------------------------------------------- */

/* Does the serve log at path hold needle? */
static bool log_has(const char *path, const char *needle) {
    size_t n = 0;
    uint8_t *b = test_read_file(path, &n);
    bool has = b && memmem(b, n, needle, strlen(needle)) != NULL;
    free(b);
    return has;
}

/* Starts a shard at level (NULL: default), asks it for stats once, stops it; true when its log
 * then shows the connection's "peer" line. */
static bool serve_logs_connection(const char *dir, const char *model, const char *level) {
    proc_server s;
    const char *extra[] = {"--log-level", level, NULL};
    if (!proc_start_server(&s, dir, model, "0:2", level ? extra : NULL)) return false;
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", s.port);
    const char *stats[] = {"stats", addr, NULL};
    int st;
    free(cli(dir, stats, &st));
    CHECK_EQ_INT(st, 0);
    proc_stop_server(&s); /* the connection's lines are written before the shard stops */
    return log_has(s.log, "): peer ");
}

static void check_cli_common(const char *dir, const char *model) {
    static const char *const cmds[] = {"run", "logits", "bench", "inspect", "mkmodel", "serve", "generate", "stats",
                                       "split", "delay-proxy", "tokenize", "detokenize", "chat", "cert", "api"};
    int st;
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        const char *a[] = {cmds[i], "--version", NULL};
        char *out = cli(dir, a, &st);
        if (st != 0 || strncmp(out, "kvshard ", 8)) fprintf(stderr, "%s --version: %d '%s'\n", cmds[i], st, out);
        CHECK(st == 0 && !strncmp(out, "kvshard ", 8));
        free(out);
    }
    /* info does not log each connection; debug does. */
    CHECK(!serve_logs_connection(dir, model, NULL));
    CHECK(serve_logs_connection(dir, model, "debug"));
    /* KVSHARD_MODEL stands for -m; the missing file is named once. */
    setenv("KVSHARD_MODEL", "/nonexistent/nosuch.gguf", 1);
    const char *run[] = {"run", "-p", "hi", NULL};
    char *out = cli(dir, run, &st);
    unsetenv("KVSHARD_MODEL");
    CHECK_EQ_INT(st, 1);
    CHECK(strstr(out, "nosuch.gguf: No such file") && !strstr(out, "nosuch.gguf: /nonexistent"));
    if (strstr(out, "nosuch.gguf: /nonexistent") || !strstr(out, "nosuch.gguf")) fprintf(stderr, "%s\n", out);
    free(out);
    const char *empty[] = {"serve", "-m", model, "--layers", "1:1", NULL};
    out = cli(dir, empty, &st);
    CHECK(st != 0 && strstr(out, "[1, 1) is empty"));
    free(out);
    /* A port in use is said before the model is loaded (it came after load and hash). */
    int busy_fd = -1;
    uint16_t busy_port = 0;
    char bmsg[KVS_MSG_MAX], listen_at[64];
    CHECK_EQ_INT(netio_listen("127.0.0.1", 0, 4, &busy_fd, &busy_port, bmsg, sizeof bmsg), KVS_OK);
    snprintf(listen_at, sizeof listen_at, "127.0.0.1:%u", busy_port);
    const char *in_use[2][12] = {{"serve", "-m", model, "--layers", "0:2", "--listen", listen_at, "-t", "1", NULL},
                                 {"api", "-m", model, "--listen", listen_at, "-t", "1", NULL}};
    for (int i = 0; i < 2; i++) {
        out = cli(dir, in_use[i], &st);
        if (st != 1 || !strstr(out, "Address already in use") || strstr(out, "loaded")) fprintf(stderr, "%s\n", out);
        CHECK(st == 1 && strstr(out, "Address already in use") && !strstr(out, "loaded"));
        free(out);
    }
    close(busy_fd);
    const char *big[] = {"serve", "-m", model, "--layers", "0:1", "--idle-timeout", "1e9", NULL};
    out = cli(dir, big, &st);
    CHECK(st == 2 && strstr(out, "[0.001, 1000000]") != NULL);
    if (!strstr(out, "[0.001, 1000000]")) fprintf(stderr, "%s\n", out);
    free(out);
}

/* ---- 8. Ctrl-C in chat, on a pty ---------------------------------------------------------------- */

typedef struct {
    int fd;        /* the pty's controller side */
    pid_t pid;
    char buf[16384];
    size_t len;    /* bytes of output read so far (cut at the buffer's end) */
} pty_proc;

/* Reads the child's output until needle appears past *from (then *from moves past it) or 20 s
 * pass. */
static bool pty_expect(pty_proc *p, size_t *from, const char *needle) {
    for (int i = 0; i < 2000; i++) {
        p->buf[p->len] = 0;
        const char *at = strstr(p->buf + *from, needle);
        if (at) {
            *from = (size_t)(at - p->buf) + strlen(needle);
            return true;
        }
        struct pollfd pf = {.fd = p->fd, .events = POLLIN};
        if (poll(&pf, 1, 10) > 0) {
            ssize_t n = read(p->fd, p->buf + p->len, sizeof p->buf - 1 - p->len);
            if (n <= 0) break;
            p->len += (size_t)n;
        }
    }
    p->buf[p->len] = 0;
    fprintf(stderr, "pty: no '%s' in:\n%s\n", needle, p->buf + *from);
    return false;
}

static void pty_send(pty_proc *p, const char *s) {
    if (write(p->fd, s, strlen(s)) != (ssize_t)strlen(s)) fprintf(stderr, "pty: short write\n");
}

/* Live sessions on a shard (its kv.sessions counter). */
static int shard_sessions(shard *sh) { return (int)shard_stat(sh, "kv.sessions"); }

/* Sends Ctrl-C while chat is paused mid-reply (--pause-after: the reply has begun and the
 * program says so), then expects the reply to stop and the prompt to come back. */
static void chat_stop_reply(pty_proc *p, size_t *at, const char *line) {
    pty_send(p, line);
    CHECK(pty_expect(p, at, "paused after 3 tokens"));
    pty_send(p, "\x03"); /* the line discipline turns it into SIGINT */
    CHECK(pty_expect(p, at, "[stopped]"));
    CHECK(pty_expect(p, at, "> "));
}

/* chat --route on a terminal: Ctrl-C during a reply stops it and the prompt comes back (twice,
 * the second turn on the kept conversation); /help, /system and /clear answer; Ctrl-C at the
 * prompt exits 0 and the session is released on both shards at once (not left to the TTL).
 * Each Ctrl-C is sent once chat has shown the state it is meant for (the pause line, the
 * prompt); chat sees a Ctrl-C that lands before its read begins (gen_wait_input), so no order
 * of the two can hang it. */
static void check_chat_ctrl_c(shard *sh, const char *spec, const char *model) {
    pty_proc p = {0};
    p.pid = forkpty(&p.fd, NULL, NULL, NULL);
    if (p.pid == 0) {
        execl(proc_bin(), "kvshard", "chat", "--route", spec, "-m", model, "-n", "40", "--temp", "0",
              "--pause-after", "3", (char *)NULL);
        _exit(127);
    }
    CHECK(p.pid > 0);
    if (p.pid <= 0) return;
    size_t at = 0;
    CHECK(pty_expect(&p, &at, "> "));
    chat_stop_reply(&p, &at, "Tell me a story\r");
    CHECK_EQ_INT(shard_sessions(&sh[0]), 1);
    CHECK_EQ_INT(shard_sessions(&sh[1]), 1);
    chat_stop_reply(&p, &at, "Go on\r");
    pty_send(&p, "/help\r");
    CHECK(pty_expect(&p, &at, "/system TEXT"));
    CHECK(pty_expect(&p, &at, "> "));
    pty_send(&p, "/system You are terse.\r");
    CHECK(pty_expect(&p, &at, "(new conversation with that system prompt)"));
    CHECK(pty_expect(&p, &at, "> "));
    pty_send(&p, "/clear\r");
    CHECK(pty_expect(&p, &at, "(conversation cleared)"));
    CHECK(pty_expect(&p, &at, "> "));
    pty_send(&p, "\x03");
    int st = proc_wait(p.pid, 20000);
    CHECK_EQ_INT(st, 0); /* (proc_wait killed it past the bound) */
    close(p.fd);
    CHECK_EQ_INT(shard_sessions(&sh[0]), 0);
    CHECK_EQ_INT(shard_sessions(&sh[1]), 0);
}

/* ---- 7. the digest cache ------------------------------------------------------------------------ */

typedef struct {
    atomic_int computed, cached;
} digest_log;

static void digest_log_line(void *ctx, const char *line) {
    digest_log *d = ctx;
    if (strstr(line, "model digest computed")) atomic_fetch_add(&d->computed, 1);
    if (strstr(line, "model digest from the cache")) atomic_fetch_add(&d->cached, 1);
}

/* srv_create on model with the cache; its digest into out. */
static bool digest_start(const char *model, const char *cache, digest_log *d, uint8_t out[32]) {
    srv_params p = srv_default_params();
    p.model_path = model;
    p.listen = "127.0.0.1:0";
    p.n_threads = 1;
    p.kv_budget_bytes = 4u << 20;
    p.digest_cache_dir = cache;
    p.log = digest_log_line;
    p.log_ctx = d;
    srv *s = NULL;
    char msg[KVS_MSG_MAX] = "";
    if (srv_create(&p, &s, msg, sizeof msg) != KVS_OK) {
        fprintf(stderr, "srv_create: %s\n", msg);
        return false;
    }
    struct wire_info info;
    srv_get_info(s, &info);
    memcpy(out, info.model_digest, 32);
    srv_free(s);
    return true;
}

/* A second start takes the digest from the cache (the same one); a file touched, even with its
 * old mtime put back, is hashed again. */
static void check_digest_cache(const char *dir, const char *model) {
    char copy[256], cache[256], cmd[1200];
    snprintf(copy, sizeof copy, "%s/cached.gguf", dir);
    snprintf(cache, sizeof cache, "%s/digest-cache", dir);
    snprintf(cmd, sizeof cmd, "cp '%s' '%s'", model, copy);
    CHECK_EQ_INT(system(cmd), 0);
    digest_log d;
    atomic_init(&d.computed, 0);
    atomic_init(&d.cached, 0);
    uint8_t a[32], b[32], c[32];
    CHECK(digest_start(copy, cache, &d, a));
    CHECK(atomic_load(&d.computed) == 1 && atomic_load(&d.cached) == 0);
    CHECK(digest_start(copy, cache, &d, b));
    CHECK(atomic_load(&d.computed) == 1 && atomic_load(&d.cached) == 1);
    CHECK(!memcmp(a, b, 32));
    struct stat st;
    CHECK(stat(copy, &st) == 0);
    struct timespec keep[2] = {st.st_atim, st.st_mtim};
    CHECK(utimensat(AT_FDCWD, copy, keep, 0) == 0); /* the same mtime, a new ctime */
    CHECK(digest_start(copy, cache, &d, c));
    CHECK(atomic_load(&d.computed) == 2 && atomic_load(&d.cached) == 1);
    CHECK(!memcmp(a, c, 32));
}

/* ---- 10. running it as a service ------------------------------------------------------------ */

/* serve with $NOTIFY_SOCKET set tells it READY=1 once it listens and STOPPING=1 on SIGTERM, as
 * a systemd Type=notify unit expects. */
static void check_sd_notify(const char *dir, const char *model) {
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    char *path = sa.sun_path; /* dir is short (/tmp/kvs-daily-XXXXXX) */
    snprintf(path, sizeof sa.sun_path, "%.80s/notify.sock", dir);
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    CHECK(fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
    setenv("NOTIFY_SOCKET", path, 1);
    proc_server s;
    bool up = proc_start_server(&s, dir, model, "0:2", NULL);
    unsetenv("NOTIFY_SOCKET");
    CHECK(up);
    const char *want[2] = {"READY=1", "STOPPING=1"};
    for (int i = 0; i < 2 && up; i++) {
        if (i == 1) kill(s.pid, SIGTERM);
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        char buf[64] = "";
        if (poll(&pf, 1, 20000) == 1) {
            ssize_t n = recv(fd, buf, sizeof buf - 1, 0);
            buf[n > 0 ? n : 0] = 0;
        }
        if (strcmp(buf, want[i])) fprintf(stderr, "NOTIFY_SOCKET got '%s', want '%s'\n", buf, want[i]);
        CHECK(!strcmp(buf, want[i]));
    }
    if (up) CHECK_EQ_INT(proc_wait(s.pid, 20000), 0);
    close(fd);
    /* A start says what it does before each slow step: the load, then the hash or the cache. */
    CHECK(log_has(s.log, "serve: loading ") && log_has(s.log, "serve: loaded "));
    CHECK(log_has(s.log, "serve: hashing the model file") || log_has(s.log, "model digest from the cache"));
}

/* cmake --install to a prefix: the binary runs, the systemd units name it and pass
 * systemd-analyze verify (where installed), the guide and examples come along. */
static void check_install(const char *dir) {
    char bin[512], cmd[1536];
    snprintf(bin, sizeof bin, "%s", proc_bin());
    char *slash = strrchr(bin, '/');
    if (!slash || system("cmake --version >/dev/null 2>&1") != 0) {
        printf("note: cmake is not on PATH; the install check is skipped\n");
        return;
    }
    *slash = 0;
    snprintf(cmd, sizeof cmd, "cmake --install '%s' --prefix '%s/inst' >'%s/install.log' 2>&1", bin, dir, dir);
    CHECK_EQ_INT(system(cmd), 0);
    snprintf(cmd, sizeof cmd, "'%s/inst/bin/kvshard' --version | grep -q '^kvshard '", dir);
    CHECK_EQ_INT(system(cmd), 0);
    static const char *const files[] = {"share/doc/kvshard/deploy.md", "share/doc/kvshard/shard.env.example",
                                        "share/doc/kvshard/api.env.example"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        snprintf(cmd, sizeof cmd, "%s/inst/%s", dir, files[i]);
        CHECK(access(cmd, R_OK) == 0);
    }
    static const char *const units[] = {"serve", "api"};
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd, "grep -qx 'ExecStart=%s/inst/bin/kvshard %s $KVSHARD_ARGS' '%s/inst/lib/systemd/system/kvshard-%s@.service'",
                 dir, units[i], dir, units[i]);
        CHECK_EQ_INT(system(cmd), 0);
        if (system("systemd-analyze --version >/dev/null 2>&1") != 0) continue;
        snprintf(cmd, sizeof cmd, "mkdir -p '%s/units' && cp '%s/inst/lib/systemd/system/kvshard-%s@.service' "
                 "'%s/units/kvshard-%s@a.service' && systemd-analyze verify '%s/units/kvshard-%s@a.service'",
                 dir, dir, units[i], dir, units[i], dir, units[i]);
        CHECK_EQ_INT(system(cmd), 0);
    }
}

int main(void) {
    char path[512];
    int run = 0;
    const char *model = test_shared_path("models/stories260K.gguf", path, sizeof path);
    if (!model) return test_finish("test_daily", 0, 1);
    signal(SIGPIPE, SIG_IGN);
    char dir[64];
    snprintf(dir, sizeof dir, "/tmp/kvs-daily-XXXXXX");
    CHECK(mkdtemp(dir) != NULL);
    shard sh[2];
    CHECK(shard_start(&sh[0], model, 0, 2, 300));
    CHECK(shard_start(&sh[1], model, 2, 0, 300));
    char spec[128];
    snprintf(spec, sizeof spec, "127.0.0.1:%u,127.0.0.1:%u", srv_port(sh[0].s), srv_port(sh[1].s));
    check_idle_route(sh, spec);
    run++;
    check_idle_api(sh, spec);
    run++;
    http_server *h = api_start(spec, NULL);
    CHECK(h != NULL);
    if (h) {
        check_api_seed(http_port(h));
        run++;
        check_api_fields(http_port(h));
        run++;
        check_api_extra(spec, model, http_port(h));
        run++;
        check_api_drain(spec);
        run++;
        if (access(proc_bin(), X_OK) == 0) {
            check_api_sigterm(spec, model, dir);
            run++;
        }
        check_wrong_port(http_port(h), model, dir);
        run++;
    }
    http_stop(h);
    check_short_prompts(spec, model);
    run++;
    if (access(proc_bin(), X_OK) == 0) {
        check_chat_ctrl_c(sh, spec, model);
        run++;
    }
    shard_stop(&sh[0]);
    shard_stop(&sh[1]);
    check_shard_drain(model);
    run++;
    check_digest_cache(dir, model);
    run++;
    check_ctx_size(dir);
    run++;
    if (access(proc_bin(), X_OK) == 0) {
        check_cli_common(dir, model);
        run++;
        check_sd_notify(dir, model);
        run++;
        check_install(dir);
        run++;
    }
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) fprintf(stderr, "note: could not remove %s\n", dir);
    return test_finish("test_daily", run, 0);
}
