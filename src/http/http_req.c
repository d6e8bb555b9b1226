/*
 * http_req — OpenAI request bodies to http_gen_req.
 *
 * Fields that would change the result and are not supported (n > 1, tools, logit_bias,
 * penalties, response_format other than text, echo, suffix, best_of > 1, several prompts,
 * non-text message parts) are a 400 naming the field, never silently ignored. Fields that do
 * not change the result (user, metadata, store, ...) and unknown ones are ignored, as OpenAI
 * clients send extras.
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/types.h>

#include "http_impl.h"
#include "util.h"

bool http_fail(http_err *e, int status, const char *type, const char *code, const char *param, const char *fmt, ...) {
    e->status = status;
    e->type = type;
    e->code = code;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return false;
}

#define BAD(e, param, ...) http_fail(e, 400, "invalid_request_error", "invalid_value", param, __VA_ARGS__)
#define UNSUPPORTED(e, param, ...) http_fail(e, 400, "invalid_request_error", "unsupported_parameter", param, __VA_ARGS__)

void http_gen_req_free(http_gen_req *r) {
    if (!r) return;
    free(r->prompt);
    for (size_t i = 0; i < r->n_msgs; i++) {
        free(r->msgs[i].role);
        free(r->msgs[i].content);
    }
    free(r->msgs);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    memset(r, 0, sizeof *r);
}

static bool is_set(const cJSON *x) { return x && !cJSON_IsNull(x); }

/* A number field in [lo, hi]; absent or null leaves *v. */
static bool get_number(const cJSON *o, const char *name, double lo, double hi, double *v, http_err *e) {
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!is_set(x)) return true;
    if (!cJSON_IsNumber(x) || !isfinite(x->valuedouble)) return BAD(e, name, "'%s' must be a number", name);
    if (x->valuedouble < lo || x->valuedouble > hi)
        return BAD(e, name, "'%s' is %.15g; it must be between %.15g and %.15g", name, x->valuedouble, lo, hi);
    *v = x->valuedouble;
    return true;
}

static bool get_int(const cJSON *o, const char *name, double lo, double hi, long *v, http_err *e) {
    double d = (double)*v;
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!get_number(o, name, lo, hi, &d, e)) return false;
    if (is_set(x) && d != floor(d)) return BAD(e, name, "'%s' must be an integer", name);
    *v = (long)d;
    return true;
}

static bool get_bool(const cJSON *o, const char *name, bool *v, http_err *e) {
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!is_set(x)) return true;
    if (!cJSON_IsBool(x)) return BAD(e, name, "'%s' must be a boolean", name);
    *v = cJSON_IsTrue(x);
    return true;
}

static char *dup_str(const char *s) {
    size_t n = strlen(s);
    char *d = malloc(n + 1);
    if (d) memcpy(d, s, n + 1);
    return d;
}

/* The seed of a request that names none: random, so that asking again gives another answer (a
 * front-end's "regenerate"); 32 bits, so the reply's "seed" holds it exactly. */
static uint32_t request_seed(void) {
    uint32_t v = 0;
    if (getrandom(&v, sizeof v, 0) != (ssize_t)sizeof v) v = (uint32_t)kvs_now_ns();
    return v;
}

/* Every field a request may carry; any other is a 400 that names it, so that a setting is never
 * silently ignored. Some are refused later by value (reject_unsupported); "user", "metadata",
 * "store", "service_tier" and "cache_prompt" do not change the result. */
static bool reject_unknown(const cJSON *o, bool chat, http_err *e) {
    static const char *const known[] = {
        "model", "max_tokens", "n_predict", "temperature", "top_p", "top_k", "min_p", "seed", "stream",
        "stream_options", "stop", "logprobs", "n", "presence_penalty", "frequency_penalty", "repeat_penalty",
        "repeat_last_n", "logit_bias", "user", "metadata", "store", "service_tier", "cache_prompt",
        "response_format", "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
        "audio", "modalities", "prediction", "web_search_options", "suffix"};
    static const char *const chat_only[] = {"messages", "max_completion_tokens", "top_logprobs"};
    static const char *const completion_only[] = {"prompt", "echo", "best_of"};
    for (const cJSON *f = o->child; f; f = f->next) {
        bool ok = false;
        for (size_t i = 0; !ok && i < sizeof known / sizeof known[0]; i++) ok = !strcmp(f->string, known[i]);
        for (size_t i = 0; !ok && i < 3; i++) ok = !strcmp(f->string, chat ? chat_only[i] : completion_only[i]);
        if (!ok) return UNSUPPORTED(e, f->string, "unknown field '%.100s': not supported by this server", f->string);
    }
    return true;
}

/* Fields that change the result and are not supported here. */
static bool reject_unsupported(const cJSON *o, bool chat, http_err *e) {
    long n = 1;
    if (!get_int(o, "n", 1, 128, &n, e)) return false;
    if (n != 1) return UNSUPPORTED(e, "n", "'n' = %ld is not supported: one choice per request", n);
    static const char *const never[] = {"tools", "functions", "logit_bias", "suffix", "audio", "modalities",
                                        "prediction", "web_search_options"};
    for (size_t i = 0; i < sizeof never / sizeof never[0]; i++) {
        const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, never[i]);
        if (!is_set(x)) continue;
        bool empty = (cJSON_IsArray(x) || cJSON_IsObject(x)) && cJSON_GetArraySize(x) == 0;
        if (!empty) return UNSUPPORTED(e, never[i], "'%s' is not supported by this server", never[i]);
    }
    const cJSON *tc = cJSON_GetObjectItemCaseSensitive(o, chat ? "tool_choice" : "function_call");
    if (is_set(tc) && !(cJSON_IsString(tc) && !strcmp(tc->valuestring, "none")))
        return UNSUPPORTED(e, tc->string, "'%s' is not supported by this server", tc->string);
    const cJSON *fc = cJSON_GetObjectItemCaseSensitive(o, "function_call");
    if (chat && is_set(fc) && !(cJSON_IsString(fc) && !strcmp(fc->valuestring, "none")))
        return UNSUPPORTED(e, "function_call", "'function_call' is not supported by this server");
    double fp = 0;
    if (!get_number(o, "frequency_penalty", -2, 2, &fp, e)) return false;
    if (fp != 0) return UNSUPPORTED(e, "frequency_penalty", "'frequency_penalty' other than 0 is not supported "
                                                            "(presence_penalty and repeat_penalty are)");
    const cJSON *rf = cJSON_GetObjectItemCaseSensitive(o, "response_format");
    if (is_set(rf)) {
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(rf, "type");
        if (!cJSON_IsString(t) || strcmp(t->valuestring, "text"))
            return UNSUPPORTED(e, "response_format", "only response_format {\"type\":\"text\"} is supported");
    }
    if (!chat) {
        bool echo = false;
        long best_of = 1;
        if (!get_bool(o, "echo", &echo, e) || !get_int(o, "best_of", 1, 128, &best_of, e)) return false;
        if (echo) return UNSUPPORTED(e, "echo", "'echo' is not supported");
        if (best_of != 1) return UNSUPPORTED(e, "best_of", "'best_of' other than 1 is not supported");
    }
    return true;
}

/* A message's content: a string, or an array of {"type":"text","text":...} parts. */
static char *message_text(const cJSON *c, size_t i, http_err *e) {
    char param[64];
    snprintf(param, sizeof param, "messages[%zu].content", i);
    if (!is_set(c)) return dup_str("");
    if (cJSON_IsString(c)) return dup_str(c->valuestring);
    if (!cJSON_IsArray(c)) {
        BAD(e, param, "'%s' must be a string or an array of text parts", param);
        return NULL;
    }
    size_t len = 0;
    const cJSON *part;
    cJSON_ArrayForEach(part, c) {
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(part, "type");
        const cJSON *tx = cJSON_GetObjectItemCaseSensitive(part, "text");
        if (!cJSON_IsString(t) || strcmp(t->valuestring, "text") || !cJSON_IsString(tx)) {
            UNSUPPORTED(e, param, "only text content parts are supported in '%s'", param);
            return NULL;
        }
        len += strlen(tx->valuestring);
    }
    char *s = malloc(len + 1);
    if (!s) return NULL;
    s[0] = 0;
    cJSON_ArrayForEach(part, c) strcat(s, cJSON_GetObjectItemCaseSensitive(part, "text")->valuestring);
    return s;
}

static bool parse_messages(const cJSON *o, http_gen_req *r, http_err *e) {
    const cJSON *ms = cJSON_GetObjectItemCaseSensitive(o, "messages");
    if (!cJSON_IsArray(ms)) return BAD(e, "messages", "'messages' is required and must be an array");
    int n = cJSON_GetArraySize(ms);
    if (n < 1) return BAD(e, "messages", "'messages' must not be empty");
    if (n > HTTP_MAX_MESSAGES) return BAD(e, "messages", "at most %d messages", HTTP_MAX_MESSAGES);
    r->msgs = calloc((size_t)n, sizeof *r->msgs);
    if (!r->msgs) return http_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    size_t i = 0;
    const cJSON *m;
    cJSON_ArrayForEach(m, ms) {
        char param[64];
        snprintf(param, sizeof param, "messages[%zu].role", i);
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        if (!cJSON_IsObject(m) || !cJSON_IsString(role)) return BAD(e, param, "'%s' must be a string", param);
        const char *rs = role->valuestring;
        if (strcmp(rs, "system") && strcmp(rs, "developer") && strcmp(rs, "user") && strcmp(rs, "assistant"))
            return UNSUPPORTED(e, param, "role '%.40s' is not supported (system, developer, user, assistant)", rs);
        if (is_set(cJSON_GetObjectItemCaseSensitive(m, "tool_calls")))
            return UNSUPPORTED(e, "tool_calls", "'tool_calls' in messages is not supported");
        r->msgs[i].role = dup_str(strcmp(rs, "developer") ? rs : "system");
        r->msgs[i].content = message_text(cJSON_GetObjectItemCaseSensitive(m, "content"), i, e);
        r->n_msgs = ++i;
        if (!r->msgs[i - 1].role || !r->msgs[i - 1].content) {
            if (e->status) return false;
            return http_fail(e, 500, "server_error", NULL, NULL, "out of memory");
        }
    }
    return true;
}

static bool parse_prompt(const cJSON *o, http_gen_req *r, http_err *e) {
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(o, "prompt");
    if (cJSON_IsArray(p)) {
        if (cJSON_GetArraySize(p) != 1 || !cJSON_IsString(cJSON_GetArrayItem(p, 0)))
            return UNSUPPORTED(e, "prompt", "'prompt' must be one string (several prompts or token ids are not supported)");
        p = cJSON_GetArrayItem(p, 0);
    }
    if (!cJSON_IsString(p)) return BAD(e, "prompt", "'prompt' is required and must be a string");
    r->prompt = dup_str(p->valuestring);
    return r->prompt ? true : http_fail(e, 500, "server_error", NULL, NULL, "out of memory");
}

static bool parse_stop(const cJSON *o, http_gen_req *r, http_err *e) {
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(o, "stop");
    if (!is_set(s)) return true;
    if (cJSON_IsString(s)) {
        if (!s->valuestring[0]) return true;
        if (strlen(s->valuestring) > HTTP_MAX_STOP_LEN) return BAD(e, "stop", "a stop string is over %d bytes", HTTP_MAX_STOP_LEN);
        r->stop[r->n_stop++] = dup_str(s->valuestring);
        return r->stop[0] ? true : http_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    }
    if (!cJSON_IsArray(s) || cJSON_GetArraySize(s) > HTTP_MAX_STOP)
        return BAD(e, "stop", "'stop' must be a string or an array of up to %d strings", HTTP_MAX_STOP);
    const cJSON *x;
    cJSON_ArrayForEach(x, s) {
        if (!cJSON_IsString(x)) return BAD(e, "stop", "'stop' entries must be strings");
        if (strlen(x->valuestring) > HTTP_MAX_STOP_LEN) return BAD(e, "stop", "a stop string is over %d bytes", HTTP_MAX_STOP_LEN);
        if (!x->valuestring[0]) continue;
        r->stop[r->n_stop] = dup_str(x->valuestring);
        if (!r->stop[r->n_stop++]) return http_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    }
    return true;
}

static bool parse_logprobs(const cJSON *o, http_gen_req *r, http_err *e) {
    const cJSON *lp = cJSON_GetObjectItemCaseSensitive(o, "logprobs");
    long top = 0;
    if (r->chat) {
        if (!get_bool(o, "logprobs", &r->logprobs, e)) return false;
        if (!get_int(o, "top_logprobs", 0, HTTP_MAX_TOP_LOGPROBS, &top, e)) return false;
        if (top > 0 && !r->logprobs) return BAD(e, "top_logprobs", "'top_logprobs' needs 'logprobs': true");
    } else if (is_set(lp)) {
        if (cJSON_IsBool(lp)) return BAD(e, "logprobs", "'logprobs' of /v1/completions is an integer 0..5");
        if (!get_int(o, "logprobs", 0, 5, &top, e)) return false;
        r->logprobs = true;
    }
    r->top_logprobs = (int)top;
    return true;
}

/* The llama.cpp server's sampling fields: n_predict (max_tokens when that is absent; <= 0: up to
 * the context), min_p, repeat_penalty, repeat_last_n, presence_penalty. */
static bool parse_llama_fields(const cJSON *o, http_gen_req *out, http_err *e) {
    long n_predict = 0, last_n = HTTP_REPEAT_WINDOW;
    double min_p = 0, rep = 1, pres = 0;
    if (!get_int(o, "n_predict", -1, 1 << 20, &n_predict, e) || !get_number(o, "min_p", 0, 1, &min_p, e) ||
        !get_number(o, "repeat_penalty", 0, 100, &rep, e) || !get_int(o, "repeat_last_n", 0, 8192, &last_n, e) ||
        !get_number(o, "presence_penalty", -2, 2, &pres, e))
        return false;
    if (out->max_tokens < 0 && n_predict > 0) out->max_tokens = n_predict;
    out->sp.min_p = (float)min_p;
    out->sp.repeat_penalty = (float)rep;
    out->sp.presence_penalty = (float)pres;
    out->repeat_last_n = (uint32_t)last_n;
    return true;
}

/* Does a JSON string in body[0..len) hold U+0000 (a raw NUL byte or a \u0000 escape)? cJSON's
 * strings end at the first NUL, so such a prompt would be cut there without a word. */
static bool has_nul_char(const char *body, size_t len) {
    bool in_str = false;
    for (size_t i = 0; i < len; i++) {
        char ch = body[i];
        if (!ch) return true;
        if (!in_str) {
            in_str = ch == '"';
        } else if (ch == '"') {
            in_str = false;
        } else if (ch == '\\' && i + 1 < len) {
            if (body[i + 1] == 'u' && i + 5 < len && !memcmp(body + i + 2, "0000", 4)) return true;
            i++; /* the escaped character: a \\ or \" does not end or start anything */
        }
    }
    return false;
}

bool http_req_parse(const char *body, size_t len, bool chat, http_gen_req *out, http_err *e) {
    memset(out, 0, sizeof *out);
    memset(e, 0, sizeof *e);
    if (has_nul_char(body, len))
        return BAD(e, chat ? "messages" : "prompt", "the request holds U+0000 (NUL), which prompts cannot carry");
    cJSON *o = cJSON_ParseWithLength(body, len);
    if (!o) return BAD(e, NULL, "the request body is not valid JSON");
    bool ok = false;
    if (!cJSON_IsObject(o)) {
        BAD(e, NULL, "the request body must be a JSON object");
        goto out;
    }
    out->chat = chat;
    out->max_tokens = -1;
    out->sp = (sampler_params){.temp = 1.0f, .top_k = 0, .top_p = 1.0f};
    double temp = 1.0, top_p = 1.0, seed = (double)request_seed();
    long top_k = 0;
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(o, "model");
    if (is_set(model) && !cJSON_IsString(model)) {
        BAD(e, "model", "'model' must be a string");
        goto out;
    }
    if (!reject_unknown(o, chat, e) || !reject_unsupported(o, chat, e)) goto out;
    if (!(chat ? parse_messages(o, out, e) : parse_prompt(o, out, e))) goto out;
    const char *mt = chat && is_set(cJSON_GetObjectItemCaseSensitive(o, "max_completion_tokens")) ? "max_completion_tokens"
                                                                                                  : "max_tokens";
    if (!get_int(o, mt, 1, 1 << 20, &out->max_tokens, e) || !parse_llama_fields(o, out, e)) goto out;
    if (!get_number(o, "temperature", 0, 2, &temp, e) || !get_number(o, "top_p", 0, 1, &top_p, e) ||
        !get_int(o, "top_k", 0, 1 << 20, &top_k, e) || !get_number(o, "seed", -9.2e18, 1.8e19, &seed, e) ||
        !get_bool(o, "stream", &out->stream, e) || !parse_stop(o, out, e) || !parse_logprobs(o, out, e))
        goto out;
    const cJSON *so = cJSON_GetObjectItemCaseSensitive(o, "stream_options");
    if (is_set(so) && !cJSON_IsObject(so)) {
        BAD(e, "stream_options", "'stream_options' must be an object");
        goto out;
    }
    if (is_set(so) && !get_bool(so, "include_usage", &out->include_usage, e)) goto out;
    out->sp.temp = (float)temp;
    out->sp.top_p = (float)top_p;
    out->sp.top_k = (int)top_k;
    out->sp.seed = seed < 0 ? (uint64_t)(int64_t)seed : (uint64_t)seed;
    ok = true;
out:
    cJSON_Delete(o);
    if (!ok) http_gen_req_free(out);
    return ok;
}
