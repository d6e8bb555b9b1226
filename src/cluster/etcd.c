/* etcd v3 JSON gateway client (etcd.h). */
#include "etcd.h"

#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <inttypes.h>
#include <pthread.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

#define ETCD_MAX_REPLY (64u << 20) /* a range over a large registry stays well under this */
#define ETCD_AUTH_TIMEOUT_MS 10000 /* the deadline of /v3/auth/authenticate at least */

struct etcd {
    CURL *curl;
    char *url;
    char *ca, *cert, *key;
    char *user, *password;
    char token[512]; /* etcd auth token, "" when auth is off */
    int timeout_ms;
};

typedef struct {
    char *data;
    size_t len, cap;
    int overflow;
} etcd_buf;

static pthread_once_t g_curl_once = PTHREAD_ONCE_INIT;
static void curl_init_once(void) { curl_global_init(CURL_GLOBAL_DEFAULT); }

static size_t on_body(char *p, size_t sz, size_t nm, void *user) {
    etcd_buf *b = user;
    size_t n = sz * nm;
    if (b->len + n + 1 > ETCD_MAX_REPLY) {
        b->overflow = 1;
        return 0;
    }
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n + 1) cap *= 2;
        char *d = realloc(b->data, cap);
        if (!d) return 0;
        b->data = d;
        b->cap = cap;
    }
    memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = 0;
    return n;
}

static char *dup_or_null(const char *s) { return s ? strdup(s) : NULL; }

/* Sets up e's handle for a POST of body to url (headers in *hdr, curl_slist_free_all after). */
static CURL *post_setup(etcd *e, const char *url, const char *body, struct curl_slist **hdr) {
    *hdr = curl_slist_append(NULL, "Content-Type: application/json");
    if (e->token[0]) {
        char h[600];
        snprintf(h, sizeof h, "Authorization: %s", e->token);
        *hdr = curl_slist_append(*hdr, h);
    }
    CURL *c = e->curl;
    curl_easy_reset(c);
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, *hdr);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, (long)e->timeout_ms);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L); /* no SIGALRM in a threaded process */
    if (e->ca) curl_easy_setopt(c, CURLOPT_CAINFO, e->ca);
    if (e->cert) curl_easy_setopt(c, CURLOPT_SSLCERT, e->cert);
    if (e->key) curl_easy_setopt(c, CURLOPT_SSLKEY, e->key);
    return c;
}

/* POSTs body to url/path; on success *reply is the parsed JSON (cJSON_Delete). */
static int post(etcd *e, const char *path, const char *body, cJSON **reply, char *msg, size_t cap) {
    *reply = NULL;
    char url[1024];
    snprintf(url, sizeof url, "%s%s", e->url, path);
    etcd_buf b = {0};
    struct curl_slist *hdr = NULL;
    CURL *c = post_setup(e, url, body, &hdr);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &b);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)e->timeout_ms);
    CURLcode rc = curl_easy_perform(c);
    long status = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    curl_slist_free_all(hdr);
    int err = KVS_OK;
    if (rc != CURLE_OK) {
        err = kvs_fail(msg, cap, KVS_ERR_IO, "etcd %s: %s", url, b.overflow ? "reply too large" : curl_easy_strerror(rc));
    } else {
        cJSON *j = b.data ? cJSON_ParseWithLength(b.data, b.len) : NULL;
        if (status != 200) {
            const cJSON *m = j ? cJSON_GetObjectItemCaseSensitive(j, "message") : NULL;
            if (!m) m = j ? cJSON_GetObjectItemCaseSensitive(j, "error") : NULL;
            err = kvs_fail(msg, cap, KVS_ERR_IO, "etcd %s: HTTP %ld: %s", path, status,
                           cJSON_IsString(m) ? m->valuestring : "no message");
            cJSON_Delete(j);
        } else if (!j) {
            err = kvs_fail(msg, cap, KVS_ERR_PROTOCOL, "etcd %s: the reply is not JSON", path);
        } else {
            *reply = j;
        }
    }
    free(b.data);
    return err;
}

/* A 64-bit integer the gateway writes as a string (or a number); 0 when absent. */
static int64_t json_i64(const cJSON *o, const char *name) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    if (cJSON_IsString(v)) return strtoll(v->valuestring, NULL, 10);
    if (cJSON_IsNumber(v)) return (int64_t)v->valuedouble;
    return 0;
}

static char *b64_encode(const void *p, size_t n) {
    size_t cap = sodium_base64_ENCODED_LEN(n, sodium_base64_VARIANT_ORIGINAL);
    char *s = malloc(cap);
    if (s) sodium_bin2base64(s, cap, p, n, sodium_base64_VARIANT_ORIGINAL);
    return s;
}

/* Decodes base64 text into a malloc'd NUL-terminated string; NULL when malformed. */
static char *b64_decode(const char *s, size_t *len) {
    size_t n = strlen(s), out_len = 0;
    char *d = malloc(n + 1);
    if (!d) return NULL;
    if (sodium_base642bin((unsigned char *)d, n, s, n, NULL, &out_len, NULL, sodium_base64_VARIANT_ORIGINAL) != 0) {
        free(d);
        return NULL;
    }
    d[out_len] = 0;
    if (len) *len = out_len;
    return d;
}

static int authenticate(etcd *e, char *msg, size_t cap) {
    e->token[0] = 0;
    cJSON *rq = cJSON_CreateObject();
    cJSON_AddStringToObject(rq, "name", e->user);
    cJSON_AddStringToObject(rq, "password", e->password ? e->password : "");
    char *body = cJSON_PrintUnformatted(rq);
    cJSON_Delete(rq);
    cJSON *r = NULL;
    /* etcd checks the password with bcrypt, slow by design (0.6 s seen on a busy machine): a
     * short request deadline would fail every attempt. */
    int timeout_ms = e->timeout_ms;
    if (e->timeout_ms < ETCD_AUTH_TIMEOUT_MS) e->timeout_ms = ETCD_AUTH_TIMEOUT_MS;
    int err = body ? post(e, "/v3/auth/authenticate", body, &r, msg, cap) : KVS_ERR_NOMEM;
    e->timeout_ms = timeout_ms;
    free(body);
    if (err) return err;
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(r, "token");
    if (cJSON_IsString(t) && strlen(t->valuestring) < sizeof e->token)
        snprintf(e->token, sizeof e->token, "%s", t->valuestring);
    else
        err = kvs_fail(msg, cap, KVS_ERR_PROTOCOL, "etcd: authenticate answered no token");
    cJSON_Delete(r);
    return err;
}

int etcd_open(const etcd_params *p, etcd **out, char *msg, size_t cap) {
    *out = NULL;
    if (!p->url || strncmp(p->url, "http", 4))
        return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "etcd: the URL must start with http:// or https://");
    pthread_once(&g_curl_once, curl_init_once);
    etcd *e = calloc(1, sizeof *e);
    if (!e) return KVS_ERR_NOMEM;
    e->curl = curl_easy_init();
    e->url = strdup(p->url);
    size_t ul = e->url ? strlen(e->url) : 0;
    while (ul > 0 && e->url[ul - 1] == '/') e->url[--ul] = 0;
    e->ca = dup_or_null(p->ca);
    e->cert = dup_or_null(p->cert);
    e->key = dup_or_null(p->key);
    e->user = dup_or_null(p->user);
    e->password = dup_or_null(p->password);
    e->timeout_ms = p->timeout_ms > 0 ? p->timeout_ms : 2000;
    if (!e->curl || !e->url) {
        etcd_close(e);
        return KVS_ERR_NOMEM;
    }
    *out = e; /* auth, if any, at the first request: an etcd down now is retried like any request */
    return KVS_OK;
}

void etcd_close(etcd *e) {
    if (!e) return;
    if (e->curl) curl_easy_cleanup(e->curl);
    free(e->url);
    free(e->ca);
    free(e->cert);
    free(e->key);
    free(e->user);
    free(e->password);
    free(e);
}

/* Posts the JSON object rq (consumed) and drops the reply. */
static int post_obj(etcd *e, const char *path, cJSON *rq, cJSON **reply, char *msg, size_t cap) {
    char *body = cJSON_PrintUnformatted(rq);
    cJSON_Delete(rq);
    if (!body) return KVS_ERR_NOMEM;
    cJSON *r = NULL;
    int err = e->user && !e->token[0] ? authenticate(e, msg, cap) : KVS_OK;
    if (!err) err = post(e, path, body, &r, msg, cap);
    /* An expired auth token is renewed once. */
    if (err && e->user && msg && strstr(msg, "token")) {
        err = authenticate(e, msg, cap);
        if (!err) err = post(e, path, body, &r, msg, cap);
    }
    free(body);
    if (reply) *reply = r;
    else cJSON_Delete(r);
    return err;
}

static void add_i64(cJSON *o, const char *name, int64_t v) {
    char s[32];
    snprintf(s, sizeof s, "%" PRId64, v);
    cJSON_AddStringToObject(o, name, s);
}

int etcd_put(etcd *e, const char *key, const char *value, int64_t lease, char *msg, size_t cap) {
    char *k = b64_encode(key, strlen(key)), *v = b64_encode(value, strlen(value));
    cJSON *rq = cJSON_CreateObject();
    if (!k || !v || !rq) {
        free(k);
        free(v);
        cJSON_Delete(rq);
        return KVS_ERR_NOMEM;
    }
    cJSON_AddStringToObject(rq, "key", k);
    cJSON_AddStringToObject(rq, "value", v);
    if (lease) add_i64(rq, "lease", lease);
    free(k);
    free(v);
    return post_obj(e, "/v3/kv/put", rq, NULL, msg, cap);
}

int etcd_delete(etcd *e, const char *key, char *msg, size_t cap) {
    char *k = b64_encode(key, strlen(key));
    cJSON *rq = cJSON_CreateObject();
    if (!k || !rq) {
        free(k);
        cJSON_Delete(rq);
        return KVS_ERR_NOMEM;
    }
    cJSON_AddStringToObject(rq, "key", k);
    free(k);
    return post_obj(e, "/v3/kv/deleterange", rq, NULL, msg, cap);
}

static int decode_kvs(const cJSON *arr, etcd_kv **kvs, size_t *n, char *msg, size_t cap) {
    int count = cJSON_GetArraySize(arr);
    etcd_kv *v = calloc((size_t)(count > 0 ? count : 1), sizeof *v);
    if (!v) return KVS_ERR_NOMEM;
    size_t k = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, arr) {
        const cJSON *key = cJSON_GetObjectItemCaseSensitive(it, "key");
        const cJSON *val = cJSON_GetObjectItemCaseSensitive(it, "value");
        v[k].key = cJSON_IsString(key) ? b64_decode(key->valuestring, NULL) : NULL;
        /* An empty value is left out of the gateway's JSON. */
        v[k].value = cJSON_IsString(val) ? b64_decode(val->valuestring, &v[k].value_len) : strdup("");
        v[k].lease = json_i64(it, "lease");
        if (!v[k].key || !v[k].value) {
            etcd_kvs_free(v, k + 1);
            return kvs_fail(msg, cap, KVS_ERR_PROTOCOL, "etcd range: an entry is not base64");
        }
        k++;
    }
    *kvs = v;
    *n = k;
    return KVS_OK;
}

/* {"key": prefix, "range_end": the prefix's end}, base64; NULL for a bad prefix or no memory. */
static cJSON *prefix_range(const char *prefix) {
    size_t pl = strlen(prefix);
    if (pl == 0 || (unsigned char)prefix[pl - 1] == 0xff) return NULL;
    char *end = strdup(prefix);
    if (!end) return NULL;
    end[pl - 1] = (char)(end[pl - 1] + 1); /* the range [prefix, prefix+1) is the prefix */
    char *k = b64_encode(prefix, pl), *re = b64_encode(end, pl);
    free(end);
    cJSON *rq = cJSON_CreateObject();
    if (!k || !re || !rq) {
        free(k);
        free(re);
        cJSON_Delete(rq);
        return NULL;
    }
    cJSON_AddStringToObject(rq, "key", k);
    cJSON_AddStringToObject(rq, "range_end", re);
    free(k);
    free(re);
    return rq;
}

int etcd_range_prefix(etcd *e, const char *prefix, etcd_kv **kvs, size_t *n, char *msg, size_t cap) {
    *kvs = NULL;
    *n = 0;
    cJSON *rq = prefix_range(prefix);
    if (!rq) return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "etcd range: bad prefix or no memory");
    cJSON *r = NULL;
    int err = post_obj(e, "/v3/kv/range", rq, &r, msg, cap);
    if (err) return err;
    const cJSON *arr = cJSON_GetObjectItemCaseSensitive(r, "kvs");
    if (cJSON_IsArray(arr)) err = decode_kvs(arr, kvs, n, msg, cap);
    cJSON_Delete(r);
    return err;
}

void etcd_kvs_free(etcd_kv *kvs, size_t n) {
    if (!kvs) return;
    for (size_t i = 0; i < n; i++) {
        free(kvs[i].key);
        free(kvs[i].value);
    }
    free(kvs);
}

int etcd_lease_grant(etcd *e, int64_t ttl_s, int64_t *id, char *msg, size_t cap) {
    *id = 0;
    cJSON *rq = cJSON_CreateObject();
    if (!rq) return KVS_ERR_NOMEM;
    add_i64(rq, "TTL", ttl_s);
    cJSON *r = NULL;
    int err = post_obj(e, "/v3/lease/grant", rq, &r, msg, cap);
    if (err) return err;
    *id = json_i64(r, "ID");
    cJSON_Delete(r);
    if (*id == 0) return kvs_fail(msg, cap, KVS_ERR_PROTOCOL, "etcd lease grant: no ID in the reply");
    return KVS_OK;
}

int etcd_lease_keepalive(etcd *e, int64_t id, int64_t *ttl_left, char *msg, size_t cap) {
    *ttl_left = 0;
    cJSON *rq = cJSON_CreateObject();
    if (!rq) return KVS_ERR_NOMEM;
    add_i64(rq, "ID", id);
    cJSON *r = NULL;
    int err = post_obj(e, "/v3/lease/keepalive", rq, &r, msg, cap);
    if (err) return err;
    /* The gateway streams {"result": {...}}; a zero TTL is left out: the lease is gone. */
    const cJSON *res = cJSON_GetObjectItemCaseSensitive(r, "result");
    *ttl_left = json_i64(res ? res : r, "TTL");
    cJSON_Delete(r);
    return KVS_OK;
}

int etcd_lease_revoke(etcd *e, int64_t id, char *msg, size_t cap) {
    cJSON *rq = cJSON_CreateObject();
    if (!rq) return KVS_ERR_NOMEM;
    add_i64(rq, "ID", id);
    return post_obj(e, "/v3/lease/revoke", rq, NULL, msg, cap);
}

/* The stream of a watch: newline-delimited JSON messages, split here and reported. */
typedef struct {
    const etcd_watch_cb *cb;
    etcd_buf line;
    bool error; /* etcd answered an error message instead of a result */
    char why[256];
} watch_stream;

static void watch_report(watch_stream *w, const cJSON *m) {
    const cJSON *res = cJSON_GetObjectItemCaseSensitive(m, "result");
    if (!res) {
        const cJSON *err = cJSON_GetObjectItemCaseSensitive(m, "error");
        const cJSON *em = err ? cJSON_GetObjectItemCaseSensitive(err, "message") : NULL;
        w->error = true;
        snprintf(w->why, sizeof w->why, "%s", cJSON_IsString(em) ? em->valuestring : "an error message");
        return;
    }
    if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(res, "created"))) w->cb->on_event(w->cb->ctx, ETCD_WATCHING, NULL);
    if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(res, "canceled"))) {
        w->error = true;
        snprintf(w->why, sizeof w->why, "the watch was canceled");
    }
    const cJSON *ev;
    cJSON_ArrayForEach(ev, cJSON_GetObjectItemCaseSensitive(res, "events")) {
        const cJSON *kv = cJSON_GetObjectItemCaseSensitive(ev, "kv"), *type = cJSON_GetObjectItemCaseSensitive(ev, "type");
        const cJSON *key = kv ? cJSON_GetObjectItemCaseSensitive(kv, "key") : NULL;
        char *k = cJSON_IsString(key) ? b64_decode(key->valuestring, NULL) : NULL;
        int what = cJSON_IsString(type) && !strcmp(type->valuestring, "DELETE") ? ETCD_DELETED
                   : json_i64(kv, "version") == 1                                ? ETCD_CREATED
                                                                                 : ETCD_MODIFIED;
        if (k) w->cb->on_event(w->cb->ctx, what, k);
        free(k);
    }
}

static size_t on_watch(char *p, size_t sz, size_t nm, void *user) {
    watch_stream *w = user;
    size_t n = sz * nm;
    if (on_body(p, 1, n, &w->line) != n) return 0;
    char *nl;
    while ((nl = memchr(w->line.data, '\n', w->line.len)) != NULL) {
        size_t len = (size_t)(nl - w->line.data);
        cJSON *m = cJSON_ParseWithLength(w->line.data, len);
        if (m) watch_report(w, m);
        cJSON_Delete(m);
        memmove(w->line.data, nl + 1, w->line.len - len - 1);
        w->line.len -= len + 1;
        w->line.data[w->line.len] = 0;
    }
    return w->cb->stop(w->cb->ctx) || w->error ? 0 : n;
}

static int on_watch_progress(void *user, curl_off_t a, curl_off_t b, curl_off_t c, curl_off_t d) {
    (void)a, (void)b, (void)c, (void)d;
    const watch_stream *w = user;
    return w->cb->stop(w->cb->ctx) ? 1 : 0;
}

int etcd_watch_prefix(etcd *e, const char *prefix, const etcd_watch_cb *cb, char *msg, size_t cap) {
    cJSON *range = prefix_range(prefix), *rq = cJSON_CreateObject();
    if (!range || !rq) {
        cJSON_Delete(range);
        cJSON_Delete(rq);
        return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "etcd watch: bad prefix or no memory");
    }
    cJSON_AddItemToObject(rq, "create_request", range);
    char *body = cJSON_PrintUnformatted(rq);
    cJSON_Delete(rq);
    if (!body) return KVS_ERR_NOMEM;
    int err = e->user && !e->token[0] ? authenticate(e, msg, cap) : KVS_OK;
    if (err) {
        free(body);
        return err;
    }
    char url[1024];
    snprintf(url, sizeof url, "%s/v3/watch", e->url);
    watch_stream w = {.cb = cb};
    struct curl_slist *hdr = NULL;
    CURL *c = post_setup(e, url, body, &hdr);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_watch);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &w);
    curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, on_watch_progress);
    curl_easy_setopt(c, CURLOPT_XFERINFODATA, &w);
    curl_easy_setopt(c, CURLOPT_TCP_KEEPALIVE, 1L); /* a vanished etcd host ends the stream */
    CURLcode rc = curl_easy_perform(c);
    long status = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    curl_slist_free_all(hdr);
    free(body);
    free(w.line.data);
    if (cb->stop(cb->ctx)) return KVS_OK;
    if (w.error) return kvs_fail(msg, cap, KVS_ERR_IO, "etcd watch: %s", w.why);
    if (rc != CURLE_OK) return kvs_fail(msg, cap, KVS_ERR_IO, "etcd watch %s: %s", url, curl_easy_strerror(rc));
    return kvs_fail(msg, cap, KVS_ERR_IO, "etcd watch %s: the stream ended (HTTP %ld)", url, status);
}
