/*
 * http — libmicrohttpd plumbing of `kvshard api` and its endpoint table (see http.h).
 *
 * A request's life: the access handler is called first with no body (the endpoint is
 * classified and a Content-Length over the limit answered 413 at once), then once per body
 * piece (accumulated up to max_body_bytes; past it 413), then with no more data: the endpoint
 * runs and queues exactly one response. A generation endpoint either runs the whole generation
 * there (non-streamed) or hands a stream_state to the content reader (streamed, note 1 of
 * http.h); the reader's free callback ends the generation, cancelling it when the client did
 * not get to the end (note 4).
 */
#include "http.h"

#include <cjson/cJSON.h>
#include <microhttpd.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "http_impl.h"
#include "log.h"
#include "netio.h"
#include "util.h"

struct http_server {
    http_params p;
    http_lanes L;
    http_metrics m;
    http_guard g;
    struct MHD_Daemon *d;
    uint16_t port;
    char model[128];
    atomic_uint_fast64_t next_request; /* request numbers for the test hook and reply ids */
    http_drain_state drain;            /* http_drain (http_drain.c) */
    int quiesced_fd;                   /* the listening socket after http_drain, closed by http_stop */
};

typedef struct {
    enum http_endpoint ep;
    char *body;        /* (len) bytes received so far, NUL-terminated */
    size_t len, cap;
    uint64_t seen;     /* body bytes received, kept or not */
    bool too_large;    /* the body passed max_body_bytes: discarded, answered 413 at its end */
    bool answered;     /* a response was queued before the body ended (413, 401) */
    bool generating;   /* counted by http_drain_enter; on_completed leaves */
    uint64_t owner;    /* the client identity (http_guard) */
} conn_req;

typedef struct {
    http_server *h;
    struct MHD_Connection *c; /* the connection the stream is on (its timeout, http_guard) */
    http_gen_req req;
    http_gen g;
    http_reply_meta meta;
    char *pending;     /* (plen) bytes of SSE not yet handed to MHD, from poff */
    size_t plen, poff;
    bool first;        /* the next chunk carries the role */
    bool done;         /* the last event is in pending */
    bool reached_end;  /* the reader reported end of stream */
    bool cut;          /* ended by http_drain: the held-back text goes out too */
} stream_state;

http_params http_default_params(void) {
    return (http_params){.listen = "127.0.0.1:8080",
                         .lanes = 4,
                         .queue_max = 64,
                         .queue_timeout_ms = 30000,
                         .max_body_bytes = 1u << 20,
                         .prefix_slots = 4,
                         .route_timeout_ms = 30000,
                         .max_connections = 256,
                         .per_ip_connections = 64,
                         .request_timeout_s = 10,
                         .stream_stall_s = 30,
                         .stream_sndbuf = 64 * 1024};
}

/* ---- responses ------------------------------------------------------------------------------ */

/* Queues body (copied) with status and content type; records the request in the metrics. */
static enum MHD_Result respond(http_server *h, struct MHD_Connection *c, enum http_endpoint ep, int status,
                               const char *type, const char *body, size_t len, const char *retry_after) {
    struct MHD_Response *r = MHD_create_response_from_buffer(len, (void *)body, MHD_RESPMEM_MUST_COPY);
    if (!r) return MHD_NO;
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    if (retry_after) MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, retry_after);
    if (status == 405) MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, http_extra_is_post(ep) ? "POST" : "GET");
    http_cors_headers(r, c, h->p.cors);
    if (http_drain_draining(&h->drain)) MHD_add_response_header(r, MHD_HTTP_HEADER_CONNECTION, "close");
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)status, r);
    MHD_destroy_response(r);
    http_metrics_request(&h->m, ep, status);
    return ret;
}

static enum MHD_Result respond_json(http_server *h, struct MHD_Connection *c, enum http_endpoint ep, int status,
                                    char *json /* consumed */) {
    if (!json) return respond(h, c, ep, 500, "text/plain", "out of memory\n", 14, NULL);
    enum MHD_Result r = respond(h, c, ep, status, "application/json", json, strlen(json), NULL);
    free(json);
    return r;
}

static enum MHD_Result respond_err(http_server *h, struct MHD_Connection *c, enum http_endpoint ep, const http_err *e) {
    if (ep == EP_CHAT || ep == EP_COMPLETIONS) /* the one line per generation request (info) */
        kvs_logf(h->p.log, h->p.log_ctx, "%s: %d %s", ep == EP_CHAT ? "/v1/chat/completions" : "/v1/completions",
                 e->status, e->message);
    char *body = http_err_body(e);
    if (!body) return respond(h, c, ep, 500, "text/plain", "out of memory\n", 14, NULL);
    enum MHD_Result r = respond(h, c, ep, e->status, "application/json", body, strlen(body),
                                e->status == 503 ? "1" : NULL);
    free(body);
    return r;
}

/* A new request while the server drains: 503 (and the connection closes). */
static enum MHD_Result refuse_draining(http_server *h, struct MHD_Connection *c, conn_req *cr) {
    http_err e;
    http_fail(&e, 503, "server_error", "server_shutting_down", NULL, "the server is shutting down");
    cr->answered = true;
    return respond_err(h, c, cr->ep, &e);
}

/* ---- simple endpoints ------------------------------------------------------------------------- */

static enum MHD_Result serve_models(http_server *h, struct MHD_Connection *c) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(o, "data");
    cJSON *m = cJSON_CreateObject();
    cJSON_AddItemToArray(data, m);
    cJSON_AddStringToObject(m, "id", h->model);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", 0);
    cJSON_AddStringToObject(m, "owned_by", "kvshard");
    cJSON_AddNumberToObject(m, "context_length", h->L.info.max_ctx);
    cJSON_AddNumberToObject(m, "n_hops", h->L.info.n_hops);
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return respond_json(h, c, EP_MODELS, 200, s);
}

static enum MHD_Result serve_health(http_server *h, struct MHD_Connection *c) {
    char report[4096];
    bool ok = http_lanes_health(&h->L, 2000, report, sizeof report);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "status", ok ? "ok" : "unavailable");
    cJSON_AddStringToObject(o, "hops", report);
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return respond_json(h, c, EP_HEALTH, ok ? 200 : 503, s);
}

static enum MHD_Result serve_metrics(http_server *h, struct MHD_Connection *c) {
    char *s = http_metrics_render(&h->m, &h->L);
    if (!s) return respond(h, c, EP_METRICS, 500, "text/plain", "out of memory\n", 14, NULL);
    enum MHD_Result r = respond(h, c, EP_METRICS, 200, "text/plain; version=0.0.4; charset=utf-8", s, strlen(s), NULL);
    free(s);
    return r;
}

static enum MHD_Result serve_extra(http_server *h, struct MHD_Connection *c, conn_req *cr, const char *url) {
    http_err e;
    char *s = http_extra_answer(cr->ep, url, cr->body, cr->len, &h->L, h->model, h->p.version, &e);
    return s ? respond_json(h, c, cr->ep, 200, s) : respond_err(h, c, cr->ep, &e);
}

/* OPTIONS: a CORS preflight (http_extra.c), else 405. */
static enum MHD_Result serve_options(http_server *h, struct MHD_Connection *c, enum http_endpoint ep) {
    struct MHD_Response *r = NULL;
    int status = 0;
    if (!http_cors_preflight(c, h->p.cors, ep, &status, &r)) {
        http_err e;
        http_fail(&e, ep == EP_OTHER ? 404 : 405, "invalid_request_error", ep == EP_OTHER ? "unknown_url" : "method_not_allowed",
                  NULL, "OPTIONS is answered only with --cors, on a known endpoint");
        return respond_err(h, c, ep, &e);
    }
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)status, r);
    MHD_destroy_response(r);
    http_metrics_request(&h->m, ep, status);
    return ret;
}

/* ---- generation endpoints -------------------------------------------------------------------- */

static void meta_init(http_server *h, http_reply_meta *meta, bool chat, uint64_t no) {
    meta->model = h->model;
    meta->created = (long long)time(NULL);
    uint8_t rnd[6] = {0};
    if (getentropy(rnd, sizeof rnd) != 0) memset(rnd, 0, sizeof rnd);
    snprintf(meta->id, sizeof meta->id, "%s-%llx%02x%02x%02x%02x%02x%02x", chat ? "chatcmpl" : "cmpl",
             (unsigned long long)no, rnd[0], rnd[1], rnd[2], rnd[3], rnd[4], rnd[5]);
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    stream_state *st = cls;
    for (;;) {
        if (st->poff < st->plen) {
            size_t n = st->plen - st->poff < max ? st->plen - st->poff : max;
            memcpy(buf, st->pending + st->poff, n);
            st->poff += n;
            return (ssize_t)n;
        }
        free(st->pending);
        st->pending = NULL;
        st->plen = st->poff = 0;
        if (st->done) {
            st->reached_end = true;
            return MHD_CONTENT_READER_END_OF_STREAM;
        }
        http_gen *g = &st->g;
        if (!g->finish && !g->failed && http_drain_cutting(&st->h->drain)) {
            g->finish = FINISH_LENGTH; /* the server is stopping: end the stream cleanly */
            st->cut = true;
        }
        if (!g->finish && !g->failed) {
            http_guard_long_work(st->c, true, 0); /* a slow step never counts as a stalled reader */
            http_gen_step(g);
            http_guard_long_work(st->c, false, (unsigned)st->h->p.stream_stall_s);
        }
        if (g->failed) {
            http_err e;
            http_fail(&e, 502, "server_error", "route_failed", NULL, "generation failed: %s", g->err);
            char *body = http_err_body(&e);
            size_t n = body ? strlen(body) : 0;
            st->pending = malloc(n + 32);
            if (!st->pending) {
                free(body);
                return MHD_CONTENT_READER_END_WITH_ERROR;
            }
            st->plen = (size_t)sprintf(st->pending, "data: %s\n\ndata: [DONE]\n\n", body ? body : "{}");
            free(body);
            st->done = true;
            kvs_logf(st->h->p.log, st->h->p.log_ctx, "request %llu: %s", (unsigned long long)g->request_no, g->err);
            continue;
        }
        size_t end = st->cut ? g->text_len : http_gen_ready(g);
        st->pending = http_reply_chunk(g, &st->meta, end, st->first, &st->plen);
        if (st->plen) st->first = false;
        if (g->finish && g->emitted == g->text_len) {
            if (!st->pending) return MHD_CONTENT_READER_END_WITH_ERROR;
            st->done = true;
        }
    }
}

/* The one line of a generation request at its end (info). */
static void log_done(http_server *h, const http_gen *g, bool stream) {
    kvs_logf(h->p.log, h->p.log_ctx, "request %llu: %s 200%s: %u prompt + %u generated tokens in %.3f s",
             (unsigned long long)g->request_no, g->req->chat ? "/v1/chat/completions" : "/v1/completions",
             stream ? " (stream)" : "", g->n_prompt, g->n_gen, (double)(kvs_now_ns() - g->t_start_ns) / 1e9);
}

static void stream_free(void *cls) {
    stream_state *st = cls;
    bool cancel = !st->reached_end;
    if (!cancel) log_done(st->h, &st->g, true);
    if (cancel)
        kvs_logf(st->h->p.log, st->h->p.log_ctx, "request %llu: client went away after %u tokens; session released",
                 (unsigned long long)st->g.request_no, st->g.n_gen);
    http_gen_end(&st->g, cancel);
    http_gen_req_free(&st->req);
    free(st->pending);
    free(st);
}

static enum MHD_Result generate(http_server *h, struct MHD_Connection *c, conn_req *cr, bool *streamed) {
    const bool chat = cr->ep == EP_CHAT;
    http_err e;
    if (!http_drain_enter(&h->drain)) return refuse_draining(h, c, cr);
    cr->generating = true; /* counted until on_completed: the reply's bytes are out by then */
    stream_state *st = calloc(1, sizeof *st);
    if (!st) return respond(h, c, cr->ep, 500, "text/plain", "out of memory\n", 14, NULL);
    st->h = h;
    st->c = c;
    st->first = true;
    if (!http_req_parse(cr->body ? cr->body : "", cr->len, chat, &st->req, &e)) {
        free(st);
        return respond_err(h, c, cr->ep, &e);
    }
    st->req.owner = cr->owner;
    char *prompt = NULL;
    if (chat) {
        if (http_chat_format(h->L.chat_tmpl, st->req.msgs, st->req.n_msgs, &prompt) != KVS_OK) {
            http_gen_req_free(&st->req);
            free(st);
                return respond(h, c, cr->ep, 500, "text/plain", "out of memory\n", 14, NULL);
        }
    }
    uint64_t no = atomic_fetch_add(&h->next_request, 1) + 1;
    bool ok = http_gen_begin(&st->g, &h->L, &h->m, &st->req, chat ? prompt : st->req.prompt, no, &e);
    free(prompt);
    if (!ok) {
        http_gen_req_free(&st->req);
        free(st);
        return respond_err(h, c, cr->ep, &e);
    }
    meta_init(h, &st->meta, chat, no);
    if (!st->req.stream) {
        while (!st->g.finish && http_gen_step(&st->g))
            if (http_drain_cutting(&h->drain)) st->g.finish = FINISH_LENGTH; /* stopping: reply with what there is */
        enum MHD_Result r;
        if (st->g.failed) {
            http_fail(&e, 502, "server_error", "route_failed", NULL, "generation failed: %s", st->g.err);
            kvs_logf(h->p.log, h->p.log_ctx, "request %llu: %s", (unsigned long long)no, st->g.err);
            r = respond_err(h, c, cr->ep, &e);
        } else {
            r = respond_json(h, c, cr->ep, 200, http_reply_full(&st->g, &st->meta));
            log_done(h, &st->g, false);
        }
        http_gen_end(&st->g, false);
        http_gen_req_free(&st->req);
        free(st);
        return r;
    }
    struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, stream_read, st, stream_free);
    if (!r) {
        stream_free(st);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    http_cors_headers(r, c, h->p.cors);
    http_guard_stream(c, &h->p);
    *streamed = true;
    enum MHD_Result ret = MHD_queue_response(c, 200, r);
    MHD_destroy_response(r); /* stream_free runs when the connection is done with it */
    http_metrics_request(&h->m, cr->ep, 200);
    return ret;
}

/* A generation: no timeout while the server works for the request (its queue wait included);
 * the request timeout again for sending a whole reply, the stall timeout for a stream. */
static enum MHD_Result serve_generate(http_server *h, struct MHD_Connection *c, conn_req *cr) {
    http_guard_long_work(c, true, 0);
    bool streamed = false;
    enum MHD_Result r = generate(h, c, cr, &streamed);
    if (!streamed) http_guard_long_work(c, false, (unsigned)h->p.request_timeout_s);
    return r;
}

/* ---- guard (http.h design note 6) -------------------------------------------------------------- */

/* Authenticates the request (every endpoint but the page when api keys are set) and sets its
 * client identity. false: answered 401. */
static bool admit(http_server *h, struct MHD_Connection *c, conn_req *cr) {
    const char *authz = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (http_guard_check(&h->g, authz, &cr->owner)) {
        if (!h->g.n_keys) {
            const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
            cr->owner = http_guard_owner_addr(&h->g, ci ? ci->client_addr : NULL);
        }
        return true;
    }
    if (cr->ep == EP_PAGE) return true; /* static, no data: the page asks for the key itself */
    http_err e;
    http_fail(&e, 401, "invalid_request_error", "invalid_api_key", NULL,
              authz ? "the API key is not valid" : "an API key is required: send Authorization: Bearer KEY");
    char *body = http_err_body(&e);
    struct MHD_Response *r = body ? MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE) : NULL;
    cr->answered = true;
    if (!r) {
        free(body);
        return false;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    MHD_add_response_header(r, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    MHD_queue_response(c, 401, r);
    MHD_destroy_response(r);
    http_metrics_request(&h->m, cr->ep, 401);
    return false;
}

/* ---- dispatch ---------------------------------------------------------------------------------- */

static enum http_endpoint classify(const char *url) {
    static const struct { const char *path; enum http_endpoint ep; } table[] = {
        {"/v1/chat/completions", EP_CHAT}, {"/v1/completions", EP_COMPLETIONS}, {"/v1/models", EP_MODELS},
        {"/health", EP_HEALTH},           {"/metrics", EP_METRICS},            {"/", EP_PAGE},
        {"/index.html", EP_PAGE},
    };
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (!strcmp(url, table[i].path)) return table[i].ep;
    return http_extra_classify(url);
}

static enum MHD_Result too_large(http_server *h, struct MHD_Connection *c, conn_req *cr) {
    http_err e;
    http_fail(&e, 413, "invalid_request_error", "request_too_large", NULL, "the request body is over %zu bytes",
              h->p.max_body_bytes);
    cr->answered = true;
    return respond_err(h, c, cr->ep, &e);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    (void)version;
    http_server *h = cls;
    conn_req *cr = *con_cls;
    if (!cr) {
        if (!(cr = calloc(1, sizeof *cr))) return MHD_NO;
        cr->ep = classify(url);
        *con_cls = cr;
        if (http_drain_draining(&h->drain)) return refuse_draining(h, c, cr);
        if (!admit(h, c, cr)) return MHD_YES;
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl && strtoull(cl, NULL, 10) > h->p.max_body_bytes) return too_large(h, c, cr);
        return MHD_YES;
    }
    if (*upload_size) {
        size_t n = *upload_size;
        *upload_size = 0;
        if (cr->answered) return MHD_YES;
        cr->seen += n;
        /* Past the limit the rest is read and dropped, so the client reads the 413 instead of a
         * reset; a body far past it is cut short (the connection closes after the 413). */
        if (cr->seen > h->p.max_body_bytes) cr->too_large = true;
        if (cr->seen > (uint64_t)h->p.max_body_bytes * 8) return too_large(h, c, cr);
        if (cr->too_large) return MHD_YES;
        if (cr->len + n + 1 > cr->cap) {
            size_t nc = cr->cap ? cr->cap * 2 : 4096;
            while (nc < cr->len + n + 1) nc *= 2;
            char *nb = realloc(cr->body, nc);
            if (!nb) return MHD_NO;
            cr->body = nb;
            cr->cap = nc;
        }
        memcpy(cr->body + cr->len, upload, n);
        cr->len += n;
        cr->body[cr->len] = 0;
        return MHD_YES;
    }
    if (cr->answered) return MHD_YES;
    if (cr->too_large) return too_large(h, c, cr);
    const bool post = !strcmp(method, "POST"), get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    http_err e;
    if (!strcmp(method, "OPTIONS")) return serve_options(h, c, cr->ep);
    switch (cr->ep) {
        case EP_CHAT:
        case EP_COMPLETIONS:
            if (post) return serve_generate(h, c, cr);
            break;
        case EP_MODELS:
            if (get) return serve_models(h, c);
            break;
        case EP_HEALTH:
            if (get) {
                http_guard_long_work(c, true, 0); /* probes take up to 2 s a hop */
                enum MHD_Result r = serve_health(h, c);
                http_guard_long_work(c, false, (unsigned)h->p.request_timeout_s);
                return r;
            }
            break;
        case EP_METRICS:
            if (get) return serve_metrics(h, c);
            break;
        case EP_PAGE:
            if (get) {
                size_t len = 0;
                const char *html = http_page(&len);
                return respond(h, c, EP_PAGE, len ? 200 : 500, "text/html; charset=utf-8", html, len, NULL);
            }
            break;
        case EP_FAVICON:
            if (get) return respond(h, c, EP_FAVICON, 204, "image/x-icon", "", 0, NULL);
            break;
        case EP_MODEL_ONE:
        case EP_TOKENIZE:
        case EP_DETOKENIZE:
        case EP_VERSION:
            if (http_extra_is_post(cr->ep) ? post : get) return serve_extra(h, c, cr, url);
            break;
        default:
            http_fail(&e, 404, "invalid_request_error", "unknown_url", NULL, "no such endpoint: %s %.200s", method, url);
            return respond_err(h, c, EP_OTHER, &e);
    }
    http_fail(&e, 405, "invalid_request_error", "method_not_allowed", NULL, "%s is not allowed on %.200s", method, url);
    return respond_err(h, c, cr->ep, &e);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    (void)c;
    (void)toe;
    conn_req *cr = *con_cls;
    if (!cr) return;
    if (cr->generating) http_drain_leave(&((http_server *)cls)->drain);
    free(cr->body);
    free(cr);
    *con_cls = NULL;
}

/* The per-IP limit (http_guard_admit), counted from a connection's start to its close. */
static enum MHD_Result accept_policy(void *cls, const struct sockaddr *addr, socklen_t addrlen) {
    (void)addrlen;
    return http_guard_admit(&((http_server *)cls)->g, addr) ? MHD_YES : MHD_NO;
}

static void notify_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                              enum MHD_ConnectionNotificationCode toe) {
    http_server *h = cls;
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
        const uint64_t a = http_guard_owner_addr(&h->g, ci ? ci->client_addr : NULL);
        *socket_context = (void *)(uintptr_t)a; /* the tag its close gives back */
        http_guard_conn(&h->g, a, true);
    } else if (toe == MHD_CONNECTION_NOTIFY_CLOSED) {
        http_guard_conn(&h->g, (uint64_t)(uintptr_t)*socket_context, false);
    }
}

static void mhd_log(void *cls, const char *fmt, va_list ap) {
    http_server *h = cls;
    kvs_vlogf(h->p.log, h->p.log_ctx, fmt, ap);
}

int http_start(const http_params *p, http_server **out, char *msg, size_t cap) {
    if (!out) return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "out is NULL");
    *out = NULL;
    if (!p || !p->route || !p->listen) return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "route and listen are required");
    if (p->lanes < 1 || p->lanes > 256) return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "lanes must be 1..256");
    if (p->queue_max < 0 || p->queue_max > 4096) return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "queue must be 0..4096");
    if (p->prefix_slots < 0 || p->prefix_slots > 1024)
        return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "prefix slots must be 0..1024");
    if (p->max_body_bytes < 1024) return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "body limit must be >= 1 KiB");
    if (p->max_connections < 1) return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "max_connections must be >= 1");
    if (p->per_ip_connections < 1 || p->request_timeout_s < 1 || p->stream_stall_s < 1 || p->stream_sndbuf < 4096)
        return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG,
                        "per-IP connections, request timeout and stream stall must be >= 1, stream buffer >= 4096");
    char host[NETIO_HOST_MAX];
    uint16_t port = 0;
    if (netio_parse_hostport(p->listen, host, sizeof host, &port) != KVS_OK)
        return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "listen address '%.100s' is not HOST:PORT", p->listen);
    http_server *h = calloc(1, sizeof *h);
    if (!h) return kvs_fail(msg, cap, KVS_ERR_NOMEM, "out of memory");
    int err = http_guard_open(&h->g, p, host, msg, cap);
    if (err) {
        free(h);
        return err;
    }
    h->p = *p;
    h->quiesced_fd = -1;
    http_drain_init(&h->drain);
    snprintf(h->model, sizeof h->model, "%s", p->model_name && p->model_name[0] ? p->model_name : "kvshard");
    http_metrics_init(&h->m);
    if ((err = http_lanes_open(&h->L, p, msg, cap)) != KVS_OK) {
        http_metrics_destroy(&h->m);
        http_drain_destroy(&h->drain);
        http_guard_close(&h->g);
        free(h);
        return err;
    }
    int fd = -1;
    if ((err = netio_listen(host, port, 128, &fd, &h->port, msg, cap)) != KVS_OK) goto fail;
    h->d = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG | MHD_USE_ITC, 0,
                            accept_policy, h, on_request, h, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, h, MHD_OPTION_LISTEN_SOCKET,
                            fd, MHD_OPTION_NOTIFY_COMPLETED, on_completed, h, MHD_OPTION_NOTIFY_CONNECTION,
                            notify_connection, h, MHD_OPTION_CONNECTION_LIMIT, (unsigned)p->max_connections,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)p->request_timeout_s, MHD_OPTION_END);
    if (!h->d) {
        close(fd);
        err = kvs_fail(msg, cap, KVS_ERR_IO, "libmicrohttpd could not start on %.100s", p->listen);
        goto fail;
    }
    *out = h;
    return KVS_OK;
fail:
    http_lanes_close(&h->L);
    http_metrics_destroy(&h->m);
    http_drain_destroy(&h->drain);
    http_guard_close(&h->g);
    free(h);
    return err;
}

uint16_t http_port(const http_server *h) { return h ? h->port : 0; }

int http_drain(http_server *h, int64_t deadline_ms, volatile sig_atomic_t *hurry) {
    if (!h) return 0;
    http_drain_begin(&h->drain, deadline_ms <= 0);
    MHD_socket fd = MHD_quiesce_daemon(h->d);
    if (fd != MHD_INVALID_SOCKET) {
        shutdown(fd, SHUT_RDWR); /* Linux: stops listening, so a new connect is refused at once */
        h->quiesced_fd = fd;
    }
    int64_t grace = h->p.route_timeout_ms + 1000; /* a cut generation ends after its current step */
    return http_drain_wait(&h->drain, deadline_ms, grace, hurry);
}

void http_stop(http_server *h) {
    if (!h) return;
    if (h->d) MHD_stop_daemon(h->d);
    if (h->quiesced_fd >= 0) close(h->quiesced_fd); /* after the stop, as libmicrohttpd asks */
    http_lanes_close(&h->L);
    http_metrics_destroy(&h->m);
    http_drain_destroy(&h->drain);
    http_guard_close(&h->g);
    free(h);
}
