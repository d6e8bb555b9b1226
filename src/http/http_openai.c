/*
 * http_openai — the OpenAI reply shapes: chat.completion, text_completion, their streamed
 * chunks (server-sent events "data: {...}\n\n", ending with "data: [DONE]\n\n") and errors.
 * Text that is not valid UTF-8 (a token may be part of a character) goes out with U+FFFD in
 * place of each maximal bad subsequence (tok_utf8_repair); logprob token strings use OpenAI's "bytes:\xNN" form then.
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_impl.h"

/* s[0..n) as valid UTF-8 (each maximal invalid subsequence becomes U+FFFD, tok_utf8_repair, the
 * same repair the CLI applies); *was_valid says whether it already was. malloc'd, NULL on NOMEM. */
static char *utf8_clean(const char *s, size_t n, bool *was_valid) {
    char *out = NULL;
    size_t len = 0;
    if (tok_utf8_repair(s, n, &out, &len) != KVS_OK) return NULL;
    if (was_valid) *was_valid = len == n && !memcmp(out, s, n);
    return out;
}

static cJSON *add_clean_string(cJSON *obj, const char *name, const char *s, size_t n) {
    char *c = utf8_clean(s, n, NULL);
    cJSON *x = cJSON_AddStringToObject(obj, name, c ? c : "");
    free(c);
    return x;
}

/* The token's text for logprobs: itself when valid UTF-8, else "bytes:\xNN..." (OpenAI's form). */
static void token_string(const tok_vocab *v, int32_t id, char *out, size_t cap, unsigned char *bytes, size_t *nb) {
    char piece[256];
    size_t n = 0;
    if (tok_piece(v, id, piece, sizeof piece, &n) != KVS_OK) n = 0;
    if (n > sizeof piece) n = sizeof piece;
    memcpy(bytes, piece, n);
    *nb = n;
    bool valid = true;
    char *c = utf8_clean(piece, n, &valid);
    if (valid && c && strlen(c) < cap) {
        snprintf(out, cap, "%s", c);
    } else {
        size_t w = (size_t)snprintf(out, cap, "bytes:");
        for (size_t i = 0; i < n && w + 5 < cap; i++) w += (size_t)snprintf(out + w, cap - w, "\\x%02x", (unsigned char)piece[i]);
    }
    free(c);
}

static cJSON *chat_lp_entry(const tok_vocab *v, int32_t id, float lp) {
    char s[1100];
    unsigned char b[256];
    size_t nb = 0;
    token_string(v, id, s, sizeof s, b, &nb);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "token", s);
    cJSON_AddNumberToObject(o, "logprob", (double)lp);
    cJSON *arr = cJSON_AddArrayToObject(o, "bytes");
    for (size_t i = 0; i < nb; i++) cJSON_AddItemToArray(arr, cJSON_CreateNumber(b[i]));
    return o;
}

/* logprobs of entries [from, to): chat {"content":[...]} or completions {tokens, ...}. */
static cJSON *logprobs_json(const http_gen *g, size_t from, size_t to, size_t text_offset) {
    const tok_vocab *v = g->L->vocab;
    cJSON *o = cJSON_CreateObject();
    if (g->req->chat) {
        cJSON *content = cJSON_AddArrayToObject(o, "content");
        for (size_t i = from; i < to; i++) {
            const http_tok_lp *t = &g->lps[i];
            cJSON *e = chat_lp_entry(v, t->id, t->logprob);
            cJSON *top = cJSON_AddArrayToObject(e, "top_logprobs");
            for (int j = 0; j < t->n_top; j++) cJSON_AddItemToArray(top, chat_lp_entry(v, t->top_id[j], t->top_lp[j]));
            cJSON_AddItemToArray(content, e);
        }
        return o;
    }
    cJSON *toks = cJSON_AddArrayToObject(o, "tokens"), *lps = cJSON_AddArrayToObject(o, "token_logprobs");
    cJSON *tops = cJSON_AddArrayToObject(o, "top_logprobs"), *offs = cJSON_AddArrayToObject(o, "text_offset");
    for (size_t i = from; i < to; i++) {
        const http_tok_lp *t = &g->lps[i];
        char s[1100];
        unsigned char b[256];
        size_t nb = 0;
        token_string(v, t->id, s, sizeof s, b, &nb);
        cJSON_AddItemToArray(toks, cJSON_CreateString(s));
        cJSON_AddItemToArray(lps, cJSON_CreateNumber((double)t->logprob));
        cJSON *top = cJSON_CreateObject();
        for (int j = 0; j < t->n_top; j++) {
            char ts[1100];
            token_string(v, t->top_id[j], ts, sizeof ts, b, &nb);
            if (!cJSON_GetObjectItemCaseSensitive(top, ts)) cJSON_AddNumberToObject(top, ts, (double)t->top_lp[j]);
        }
        cJSON_AddItemToArray(tops, top);
        cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)text_offset));
        text_offset += nb;
    }
    return o;
}

static const char *finish_name(http_finish f) { return f == FINISH_LENGTH ? "length" : "stop"; }

static cJSON *reply_head(const http_gen *g, const http_reply_meta *meta, bool chunk) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", meta->id);
    cJSON_AddStringToObject(o, "object", g->req->chat ? (chunk ? "chat.completion.chunk" : "chat.completion")
                                                      : "text_completion");
    cJSON_AddNumberToObject(o, "created", (double)meta->created);
    cJSON_AddStringToObject(o, "model", meta->model);
    cJSON_AddNumberToObject(o, "seed", (double)g->req->sp.seed); /* the one drawn when the request had none */
    return o;
}

static cJSON *usage_json(const http_gen *g) {
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "prompt_tokens", g->n_prompt);
    cJSON_AddNumberToObject(u, "completion_tokens", g->n_gen);
    cJSON_AddNumberToObject(u, "total_tokens", g->n_prompt + g->n_gen);
    cJSON *d = cJSON_AddObjectToObject(u, "prompt_tokens_details");
    /* Kept by this lane, or taken from the shards' prefix blocks of the same client. */
    cJSON_AddNumberToObject(d, "cached_tokens", g->reuse ? g->reuse : route_session_cached(g->s));
    return u;
}

char *http_reply_full(const http_gen *g, const http_reply_meta *meta) {
    cJSON *o = reply_head(g, meta, false);
    cJSON *choices = cJSON_AddArrayToObject(o, "choices");
    cJSON *c = cJSON_CreateObject();
    cJSON_AddItemToArray(choices, c);
    cJSON_AddNumberToObject(c, "index", 0);
    if (g->req->chat) {
        cJSON *m = cJSON_AddObjectToObject(c, "message");
        cJSON_AddStringToObject(m, "role", "assistant");
        add_clean_string(m, "content", g->text ? g->text : "", g->text_len);
    } else {
        add_clean_string(c, "text", g->text ? g->text : "", g->text_len);
    }
    if (g->lps) cJSON_AddItemToObject(c, "logprobs", logprobs_json(g, 0, g->n_gen, 0));
    else cJSON_AddNullToObject(c, "logprobs");
    cJSON_AddStringToObject(c, "finish_reason", finish_name(g->finish));
    cJSON_AddItemToObject(o, "usage", usage_json(g));
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

/* Appends "data: <json>\n\n" for o (consumed) to the growing buffer. */
static bool sse_add(char **buf, size_t *len, cJSON *o, const char *raw) {
    char *js = o ? cJSON_PrintUnformatted(o) : NULL;
    cJSON_Delete(o);
    const char *body = o ? js : raw;
    if (!body) return false;
    size_t n = strlen(body);
    char *nb = realloc(*buf, *len + n + 9);
    if (!nb) {
        free(js);
        return false;
    }
    memcpy(nb + *len, "data: ", 6);
    memcpy(nb + *len + 6, body, n);
    memcpy(nb + *len + 6 + n, "\n\n", 3);
    *buf = nb;
    *len += n + 8;
    free(js);
    return true;
}

static cJSON *chunk_choice(cJSON *o, const http_gen *g) {
    cJSON *choices = cJSON_AddArrayToObject(o, "choices");
    cJSON *c = cJSON_CreateObject();
    cJSON_AddItemToArray(choices, c);
    cJSON_AddNumberToObject(c, "index", 0);
    (void)g;
    return c;
}

char *http_reply_chunk(http_gen *g, const http_reply_meta *meta, size_t end, bool first, size_t *len) {
    char *buf = NULL;
    *len = 0;
    bool ok = true;
    size_t lp_to = g->lps ? g->n_gen : 0;
    if (end > g->emitted || first || lp_to > g->lp_emitted) {
        cJSON *o = reply_head(g, meta, true);
        cJSON *c = chunk_choice(o, g);
        if (g->req->chat) {
            cJSON *d = cJSON_AddObjectToObject(c, "delta");
            if (first) cJSON_AddStringToObject(d, "role", "assistant");
            add_clean_string(d, "content", g->text ? g->text + g->emitted : "", end - g->emitted);
        } else {
            add_clean_string(c, "text", g->text ? g->text + g->emitted : "", end - g->emitted);
        }
        if (g->lps && lp_to > g->lp_emitted) cJSON_AddItemToObject(c, "logprobs", logprobs_json(g, g->lp_emitted, lp_to, g->emitted));
        else cJSON_AddNullToObject(c, "logprobs");
        cJSON_AddNullToObject(c, "finish_reason");
        ok = sse_add(&buf, len, o, NULL);
        g->emitted = end;
        g->lp_emitted = lp_to;
    }
    if (ok && g->finish && g->emitted == g->text_len) {
        cJSON *o = reply_head(g, meta, true);
        cJSON *c = chunk_choice(o, g);
        if (g->req->chat) cJSON_AddObjectToObject(c, "delta");
        else cJSON_AddStringToObject(c, "text", "");
        cJSON_AddNullToObject(c, "logprobs");
        cJSON_AddStringToObject(c, "finish_reason", finish_name(g->finish));
        ok = sse_add(&buf, len, o, NULL);
        if (ok && g->req->include_usage) {
            o = reply_head(g, meta, true);
            cJSON_AddArrayToObject(o, "choices");
            cJSON_AddItemToObject(o, "usage", usage_json(g));
            ok = sse_add(&buf, len, o, NULL);
        }
        if (ok) ok = sse_add(&buf, len, NULL, "[DONE]");
    }
    if (!ok) {
        free(buf);
        *len = 0;
        return NULL;
    }
    return buf;
}

char *http_err_body(const http_err *e) {
    cJSON *o = cJSON_CreateObject();
    cJSON *x = cJSON_AddObjectToObject(o, "error");
    cJSON_AddStringToObject(x, "message", e->message);
    cJSON_AddStringToObject(x, "type", e->type ? e->type : "server_error");
    if (e->param[0]) cJSON_AddStringToObject(x, "param", e->param);
    else cJSON_AddNullToObject(x, "param");
    if (e->code) cJSON_AddStringToObject(x, "code", e->code);
    else cJSON_AddNullToObject(x, "code");
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}
