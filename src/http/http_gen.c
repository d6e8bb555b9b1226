/*
 * http_gen — one generation of `kvshard api`: the same loop as `kvshard run` (tokenize with
 * BOS, prefill, then sample one token per step, stop at end-of-text or max_tokens), plus stop
 * strings, logprobs and the text that is safe to send so far. The session and lane come from
 * http_lanes (prefix reuse); the steps go through route_forward.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_impl.h"
#include "util.h"

static bool nomem(http_err *e) { return http_fail(e, 500, "server_error", NULL, NULL, "out of memory"); }

bool http_gen_begin(http_gen *g, http_lanes *L, http_metrics *m, const http_gen_req *req, const char *prompt,
                    uint64_t request_no, http_err *e) {
    memset(g, 0, sizeof *g);
    g->L = L;
    g->req = req;
    g->metrics = m;
    g->request_no = request_no;
    g->lane = -1;
    g->t_start_ns = kvs_now_ns();
    g->n_vocab = (int32_t)L->info.n_vocab;
    const uint32_t max_ctx = L->info.max_ctx;
    size_t plen = strlen(prompt);
    if (plen > (size_t)max_ctx * 64)
        return http_fail(e, 400, "invalid_request_error", "context_length_exceeded", req->chat ? "messages" : "prompt",
                         "the prompt is far longer than the model's context of %u tokens", max_ctx);
    int cap = (int)plen + 2, n = 0;
    g->toks = malloc((size_t)cap * sizeof *g->toks);
    if (!g->toks) return nomem(e);
    if (tok_encode_ex(L->vocab, prompt, plen, tok_add_bos(L->vocab), req->chat, g->toks, cap, &n) != KVS_OK) {
        free(g->toks);
        return http_fail(e, 400, "invalid_request_error", "invalid_value", req->chat ? "messages" : "prompt",
                         "the prompt cannot be tokenized");
    }
    uint64_t want = (uint64_t)n + (uint64_t)(req->max_tokens > 0 ? req->max_tokens : 1);
    if (want > max_ctx) {
        free(g->toks);
        return http_fail(e, 400, "invalid_request_error", "context_length_exceeded", req->chat ? "messages" : "prompt",
                         "this model's context is %u tokens; the prompt is %d tokens and max_tokens asks for %ld more",
                         max_ctx, n, req->max_tokens > 0 ? req->max_tokens : 1);
    }
    g->n_prompt = g->n_toks = (uint32_t)n;
    g->max_gen = req->max_tokens > 0 ? (uint32_t)req->max_tokens : max_ctx - (uint32_t)n;
    size_t need = (size_t)n + g->max_gen + 1;
    int32_t *t = realloc(g->toks, need * sizeof *t);
    g->logits = malloc((size_t)g->n_vocab * sizeof *g->logits);
    g->smp = sampler_create(req->sp);
    if (req->logprobs) g->lps = calloc(g->max_gen + 1, sizeof *g->lps);
    if (t) g->toks = t;
    if (!t || !g->logits || !g->smp || (req->logprobs && !g->lps)) goto fail_nomem;
    g->cap = (uint32_t)need;
    char msg[KVS_MSG_MAX] = "";
    int err = http_lanes_acquire(L, g->toks, g->n_toks, &g->lane, &g->s, &g->reuse, msg, sizeof msg);
    if (err == KVS_ERR_BUSY) {
        http_fail(e, 503, "server_error", "server_busy", NULL, "the server is at capacity: %s", msg);
        goto fail;
    }
    if (err) {
        http_fail(e, 502, "server_error", "route_unavailable", NULL, "the route cannot be reached: %s", msg);
        goto fail;
    }
    g->r = L->lanes[g->lane].r;
    g->n_fed = g->reuse;
    if (!g->s && (err = route_session_open(g->r, &g->s, msg, sizeof msg)) != KVS_OK) {
        http_lanes_finish(L, g->lane, NULL, NULL, 0, false, false);
        http_fail(e, 500, "server_error", NULL, NULL, "cannot open a session: %s", msg);
        goto fail;
    }
    return true;
fail_nomem:
    nomem(e);
fail:
    sampler_free(g->smp);
    free(g->toks);
    free(g->logits);
    free(g->lps);
    memset(g, 0, sizeof *g);
    return false;
}

static bool text_append(http_gen *g, const char *s, size_t n) {
    if (g->text_len + n + 1 > g->text_cap) {
        size_t nc = (g->text_cap ? g->text_cap * 2 : 256) + n;
        char *nb = realloc(g->text, nc);
        if (!nb) return false;
        g->text = nb;
        g->text_cap = nc;
    }
    memcpy(g->text + g->text_len, s, n);
    g->text_len += n;
    g->text[g->text_len] = 0;
    return true;
}

/* The first stop string that now occurs in the text (searching only where the last piece can
 * have completed one): truncates the text there. */
static bool apply_stop(http_gen *g, size_t old_len) {
    size_t cut = SIZE_MAX;
    for (int i = 0; i < g->req->n_stop; i++) {
        size_t sl = strlen(g->req->stop[i]);
        size_t from = old_len + 1 > sl ? old_len + 1 - sl : 0;
        const char *hit = memmem(g->text + from, g->text_len - from, g->req->stop[i], sl);
        if (hit && (size_t)(hit - g->text) < cut) cut = (size_t)(hit - g->text);
    }
    if (cut == SIZE_MAX) return false;
    g->text_len = cut;
    g->text[cut] = 0;
    if (g->emitted > cut) g->emitted = cut;
    return true;
}

bool http_gen_step(http_gen *g) {
    if (g->finish || g->failed) return !g->failed;
    const http_params *p = &g->L->p;
    if (p->before_step) p->before_step(p->hook_ctx, g->request_no, g->n_gen);
    uint32_t from = g->n_fed, n = g->n_toks - g->n_fed;
    int err = route_forward(g->r, g->s, g->toks + from, n, g->logits, g->err, sizeof g->err);
    if (err) {
        if (!g->err[0]) snprintf(g->err, sizeof g->err, "%s", kvs_strerror(err));
        g->failed = true;
        return false;
    }
    g->n_fed = g->n_toks;
    uint64_t now = kvs_now_ns();
    if (!g->t_first_ns) {
        g->t_first_ns = now;
        http_metrics_observe(g->metrics, HIST_TTFT, (double)(now - g->t_start_ns) / 1e9);
    } else {
        http_metrics_observe(g->metrics, HIST_TOKEN, (double)(now - g->t_last_ns) / 1e9);
    }
    g->t_last_ns = now;
    /* The draw for a position is a pure function of (seed, position), as in `kvshard run`
     * (sampler_pick), so a request's text does not depend on what ran before it. */
    uint32_t n_win = g->n_toks < HTTP_REPEAT_WINDOW ? g->n_toks : HTTP_REPEAT_WINDOW;
    sampler_result res;
    if (sampler_pick(g->smp, g->logits, g->n_vocab, g->n_toks, g->toks + g->n_toks - n_win, n_win, &res,
                     g->lps ? (uint32_t)g->req->top_logprobs : 0) != KVS_OK) {
        snprintf(g->err, sizeof g->err, "cannot sample");
        g->failed = true;
        return false;
    }
    int32_t id = res.id;
    if (id < 0 || tok_is_eog(g->L->vocab, id)) {
        g->finish = FINISH_STOP;
        return true;
    }
    if (g->lps) {
        http_tok_lp *lp = &g->lps[g->n_gen];
        lp->id = id;
        lp->logprob = res.logprob;
        lp->n_top = (int)res.n_top;
        for (uint32_t j = 0; j < res.n_top && j < HTTP_MAX_TOP_LOGPROBS; j++) {
            lp->top_id[j] = res.top[j].id;
            lp->top_lp[j] = res.top[j].logprob;
        }
    }
    g->toks[g->n_toks++] = id;
    g->n_gen++;
    char piece[256];
    size_t plen = 0;
    if (tok_piece(g->L->vocab, id, piece, sizeof piece, &plen) != KVS_OK) plen = 0;
    if (plen > sizeof piece) plen = sizeof piece;
    size_t old = g->text_len;
    if (!text_append(g, piece, plen)) {
        snprintf(g->err, sizeof g->err, "out of memory");
        g->failed = true;
        return false;
    }
    if (g->req->n_stop && apply_stop(g, old)) g->finish = FINISH_STOP;
    else if (g->n_gen >= g->max_gen) g->finish = FINISH_LENGTH;
    return true;
}

size_t http_gen_ready(const http_gen *g) {
    size_t end = g->text_len;
    if (g->finish || g->failed) return end;
    size_t hold = 0;
    for (int i = 0; i < g->req->n_stop; i++) {
        size_t sl = strlen(g->req->stop[i]);
        if (sl - 1 > hold) hold = sl - 1;
    }
    end = end > hold ? end - hold : 0;
    end = tok_utf8_complete_len(g->text, end); /* not inside a UTF-8 character */
    return end < g->emitted ? g->emitted : end;
}

void http_gen_end(http_gen *g, bool cancel) {
    if (g->lane >= 0) {
        bool keep = !cancel && !g->failed && g->finish != FINISH_NONE;
        uint32_t held = route_session_pos(g->s);
        if (held > g->n_fed) held = g->n_fed;
        http_lanes_finish(g->L, g->lane, g->s, g->toks, held, keep, g->failed);
        http_metrics_tokens(g->metrics, g->n_prompt, g->n_gen, g->reuse);
        if (cancel) http_metrics_cancelled(g->metrics);
    }
    sampler_free(g->smp);
    free(g->toks);
    free(g->logits);
    free(g->lps);
    free(g->text);
    memset(g, 0, sizeof *g);
    g->lane = -1;
}
