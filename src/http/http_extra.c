/*
 * http_extra — the endpoints people expect beside the OpenAI ones, and CORS:
 *   GET  /v1/models/{id}  one model (OpenAI's retrieve); another id is a 404 model_not_found
 *   POST /tokenize        llama-server's shape: {"content", "add_special", "parse_special",
 *                         "with_pieces"} -> {"tokens": [id, ...] or [{"id","piece"}, ...]}
 *   POST /detokenize      {"tokens": [id, ...]} -> {"content": "..."}
 *   GET  /version         {"version": ..., "model": ...}
 *   /favicon.ico          204: a browser's automatic request gets no 404
 * Unknown body fields are a 400 naming them, as on the generation endpoints.
 *
 * CORS (--cors): the allowed origins are a comma-separated list or "*". A request whose Origin
 * is allowed gets Access-Control-Allow-Origin (that origin, with Vary: Origin, or "*"); an
 * OPTIONS preflight of a known endpoint is answered 204 with the methods and headers allowed.
 * Without --cors no CORS header is sent, so browsers keep other sites' pages from the API.
 */
#include <cjson/cJSON.h>
#include <microhttpd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_impl.h"

enum http_endpoint http_extra_classify(const char *url) {
    if (!strncmp(url, "/v1/models/", 11) && url[11]) return EP_MODEL_ONE;
    if (!strcmp(url, "/tokenize")) return EP_TOKENIZE;
    if (!strcmp(url, "/detokenize")) return EP_DETOKENIZE;
    if (!strcmp(url, "/version")) return EP_VERSION;
    if (!strcmp(url, "/favicon.ico")) return EP_FAVICON;
    return EP_OTHER;
}

bool http_extra_is_post(enum http_endpoint ep) {
    return ep == EP_CHAT || ep == EP_COMPLETIONS || ep == EP_TOKENIZE || ep == EP_DETOKENIZE;
}

/* The body as a JSON object whose members are all in known[]; NULL with e filled otherwise. */
static cJSON *parse_object(const char *body, size_t len, const char *const *known, http_err *e) {
    cJSON *o = cJSON_ParseWithLength(body ? body : "", len);
    if (!cJSON_IsObject(o)) {
        cJSON_Delete(o);
        http_fail(e, 400, "invalid_request_error", "invalid_json", NULL, "the body is not a JSON object");
        return NULL;
    }
    for (const cJSON *f = o->child; f; f = f->next) {
        bool ok = false;
        for (size_t i = 0; known[i] && !ok; i++) ok = !strcmp(f->string, known[i]);
        if (!ok) {
            http_fail(e, 400, "invalid_request_error", "unsupported_parameter", f->string,
                      "unknown field '%.100s': not supported by this server", f->string);
            cJSON_Delete(o);
            return NULL;
        }
    }
    return o;
}

/* A boolean member (def when absent); false with e filled when it is not a boolean. */
static bool get_bool(const cJSON *o, const char *name, bool def, bool *out, http_err *e) {
    const cJSON *x = cJSON_GetObjectItem(o, name);
    *out = def;
    if (!x) return true;
    if (!cJSON_IsBool(x)) return http_fail(e, 400, "invalid_request_error", "invalid_value", name, "'%s' must be a boolean", name);
    *out = cJSON_IsTrue(x);
    return true;
}

/* One {"id","piece"} entry: the piece as a string when it is valid UTF-8, else its bytes (as
 * llama-server does). */
static void add_piece(cJSON *arr, const tok_vocab *v, int32_t id) {
    char buf[512];
    size_t n = 0;
    cJSON *t = cJSON_CreateObject();
    cJSON_AddNumberToObject(t, "id", id);
    if (tok_piece_ex(v, id, true, buf, sizeof buf - 1, &n) != KVS_OK) n = 0;
    if (n > sizeof buf - 1) n = sizeof buf - 1;
    size_t at = 0;
    uint32_t cp;
    for (int k; at < n && (k = tok_utf8_char(buf + at, n - at, &cp)) > 0 && cp != 0;) at += (size_t)k;
    if (at == n) {
        buf[n] = 0;
        cJSON_AddStringToObject(t, "piece", buf);
    } else {
        cJSON *bytes = cJSON_AddArrayToObject(t, "piece");
        for (size_t i = 0; i < n; i++) cJSON_AddItemToArray(bytes, cJSON_CreateNumber((unsigned char)buf[i]));
    }
    cJSON_AddItemToArray(arr, t);
}

static char *tokenize(const http_lanes *L, const char *body, size_t len, http_err *e) {
    static const char *const known[] = {"content", "add_special", "parse_special", "with_pieces", NULL};
    cJSON *o = parse_object(body, len, known, e);
    if (!o) return NULL;
    const cJSON *content = cJSON_GetObjectItem(o, "content");
    bool add_special, parse_special, with_pieces;
    char *out = NULL;
    if (!cJSON_IsString(content)) {
        http_fail(e, 400, "invalid_request_error", "invalid_value", "content", "'content' must be a string");
    } else if (get_bool(o, "add_special", false, &add_special, e) && get_bool(o, "parse_special", true, &parse_special, e) &&
               get_bool(o, "with_pieces", false, &with_pieces, e)) {
        int32_t *ids = NULL;
        int n = 0;
        if (gen_tokenize(L->vocab, content->valuestring, add_special && tok_add_bos(L->vocab), parse_special, &ids, &n) !=
            KVS_OK) {
            http_fail(e, 400, "invalid_request_error", "invalid_value", "content", "the content cannot be tokenized");
        } else {
            cJSON *r = cJSON_CreateObject(), *arr = cJSON_AddArrayToObject(r, "tokens");
            for (int i = 0; i < n; i++) {
                if (with_pieces) add_piece(arr, L->vocab, ids[i]);
                else cJSON_AddItemToArray(arr, cJSON_CreateNumber(ids[i]));
            }
            out = cJSON_PrintUnformatted(r);
            cJSON_Delete(r);
            if (!out) http_fail(e, 500, "server_error", NULL, NULL, "out of memory");
        }
        free(ids);
    }
    cJSON_Delete(o);
    return out;
}

static char *detokenize(const http_lanes *L, const char *body, size_t len, http_err *e) {
    static const char *const known[] = {"tokens", NULL};
    cJSON *o = parse_object(body, len, known, e);
    if (!o) return NULL;
    const cJSON *toks = cJSON_GetObjectItem(o, "tokens");
    int n = cJSON_GetArraySize(toks);
    int32_t *ids = malloc(sizeof *ids * (size_t)(n > 0 ? n : 1));
    char *out = NULL;
    bool ok = cJSON_IsArray(toks) && ids;
    if (!ok) http_fail(e, 400, "invalid_request_error", "invalid_value", "tokens", "'tokens' must be an array of token ids");
    for (int i = 0; ok && i < n; i++) {
        const cJSON *t = cJSON_GetArrayItem(toks, i);
        double d = cJSON_IsNumber(t) ? t->valuedouble : -1;
        ok = d >= 0 && d < tok_n_vocab(L->vocab) && d == (double)(int32_t)d;
        if (!ok)
            http_fail(e, 400, "invalid_request_error", "invalid_value", "tokens",
                      "tokens[%d] is not a token id (0..%d)", i, (int)tok_n_vocab(L->vocab) - 1);
        else ids[i] = (int32_t)d;
    }
    char *text = NULL, *valid = NULL;
    size_t tl = 0, vl = 0;
    if (ok && (tok_detokenize(L->vocab, ids, (size_t)n, false, &text, &tl) != KVS_OK ||
               tok_utf8_repair(text ? text : "", tl, &valid, &vl) != KVS_OK)) {
        ok = false;
        http_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    }
    if (ok) {
        cJSON *r = cJSON_CreateObject();
        cJSON_AddStringToObject(r, "content", valid ? valid : "");
        out = cJSON_PrintUnformatted(r);
        cJSON_Delete(r);
        if (!out) http_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    }
    free(text);
    free(valid);
    free(ids);
    cJSON_Delete(o);
    return out;
}

/* The model object of /v1/models/{id}; a 404 for another id. */
static char *model_one(const http_lanes *L, const char *model, const char *url, http_err *e) {
    const char *id = url + 11;
    if (strcmp(id, model)) {
        http_fail(e, 404, "invalid_request_error", "model_not_found", "model", "The model '%.200s' does not exist", id);
        return NULL;
    }
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "id", model);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", 0);
    cJSON_AddStringToObject(m, "owned_by", "kvshard");
    cJSON_AddNumberToObject(m, "context_length", L->info.max_ctx);
    cJSON_AddNumberToObject(m, "n_vocab", L->info.n_vocab);
    cJSON_AddNumberToObject(m, "n_layer", L->info.n_layer);
    cJSON_AddNumberToObject(m, "n_hops", L->info.n_hops);
    char *s = cJSON_PrintUnformatted(m);
    cJSON_Delete(m);
    if (!s) http_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    return s;
}

char *http_extra_answer(enum http_endpoint ep, const char *url, const char *body, size_t len, const http_lanes *L,
                        const char *model, const char *version, http_err *e) {
    if (ep == EP_TOKENIZE) return tokenize(L, body, len, e);
    if (ep == EP_DETOKENIZE) return detokenize(L, body, len, e);
    if (ep == EP_MODEL_ONE) return model_one(L, model, url, e);
    cJSON *v = cJSON_CreateObject();
    cJSON_AddStringToObject(v, "version", version && version[0] ? version : "unknown");
    cJSON_AddStringToObject(v, "model", model);
    char *s = cJSON_PrintUnformatted(v);
    cJSON_Delete(v);
    if (!s) http_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    return s;
}

/* ---- CORS ------------------------------------------------------------------------------------ */

/* Is origin one of the comma-separated allowed list (or is the list "*")? */
static bool origin_allowed(const char *allowed, const char *origin) {
    if (!allowed || !allowed[0] || !origin) return false;
    if (!strcmp(allowed, "*")) return true;
    size_t ol = strlen(origin);
    for (const char *p = allowed; *p;) {
        const char *end = strchr(p, ',');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        while (n && p[0] == ' ') p++, n--;
        while (n && p[n - 1] == ' ') n--;
        if (n == ol && !strncmp(p, origin, n)) return true;
        if (!end) break;
        p = end + 1;
    }
    return false;
}

void http_cors_headers(struct MHD_Response *r, struct MHD_Connection *c, const char *allowed) {
    if (!allowed || !allowed[0]) return;
    const char *origin = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Origin");
    if (!origin_allowed(allowed, origin)) return;
    bool any = !strcmp(allowed, "*");
    MHD_add_response_header(r, "Access-Control-Allow-Origin", any ? "*" : origin);
    if (!any) MHD_add_response_header(r, "Vary", "Origin");
}

bool http_cors_preflight(struct MHD_Connection *c, const char *allowed, enum http_endpoint ep, int *status,
                         struct MHD_Response **out) {
    *out = NULL;
    if (!allowed || !allowed[0] || ep == EP_OTHER) return false;
    struct MHD_Response *r = MHD_create_response_from_buffer(0, (void *)"", MHD_RESPMEM_PERSISTENT);
    if (!r) return false;
    http_cors_headers(r, c, allowed);
    const char *methods = http_extra_is_post(ep) ? "POST, OPTIONS" : "GET, HEAD, OPTIONS";
    MHD_add_response_header(r, "Access-Control-Allow-Methods", methods);
    MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, methods);
    const char *asked = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Access-Control-Request-Headers");
    MHD_add_response_header(r, "Access-Control-Allow-Headers", asked && strlen(asked) < 512 ? asked : "Authorization, Content-Type");
    MHD_add_response_header(r, "Access-Control-Max-Age", "600");
    *status = 204;
    *out = r;
    return true;
}
