/*
 * http_gen — one generation of `kvshard api` on a lane: the loop of gen.h (tokenize with BOS,
 * prefill, one draw per step, end-of-generation, stop strings, the text that is safe to send)
 * over the lane's route session, plus what only the API has: the lane and its kept session
 * (prefix reuse, http_lanes), log-probs, the before-step hook and the latency histograms.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_impl.h"
#include "util.h"

static bool nomem(http_err *e) { return http_fail(e, 500, "server_error", NULL, NULL, "out of memory"); }

/* gen_backend.forward on the lane's session: route_forward, then the time to the first token
 * or between tokens, measured as a client sees it (the forward, not the draw). */
static int lane_forward(void *ctx, const int32_t *tokens, uint32_t n, float *logits, char *msg, size_t cap) {
    http_gen *g = ctx;
    int err = route_forward(g->r, g->s, tokens, n, logits, msg, cap);
    if (err) return err;
    uint64_t now = kvs_now_ns();
    if (!g->t_first_ns) {
        g->t_first_ns = now;
        http_metrics_observe(g->metrics, HIST_TTFT, (double)(now - g->t_start_ns) / 1e9);
    } else {
        http_metrics_observe(g->metrics, HIST_TOKEN, (double)(now - g->t_last_ns) / 1e9);
    }
    g->t_last_ns = now;
    return KVS_OK;
}

/* Refreshes the views of g->gen that the reply writers read (http_impl.h). */
static void sync_views(http_gen *g) {
    g->n_gen = g->gen.n_gen;
    g->text = g->gen.text;
    g->text_len = g->gen.text_len;
    g->finish = g->gen.finish == GEN_RUNNING         ? FINISH_NONE
                : g->gen.finish == GEN_FINISH_LENGTH ? FINISH_LENGTH
                                                     : FINISH_STOP;
    if (g->emitted > g->text_len) g->emitted = g->text_len;
}

bool http_gen_begin(http_gen *g, http_lanes *L, http_metrics *m, const http_gen_req *req, const char *prompt,
                    uint64_t request_no, http_err *e) {
    memset(g, 0, sizeof *g);
    g->L = L;
    g->req = req;
    g->metrics = m;
    g->request_no = request_no;
    g->lane = -1;
    g->t_start_ns = kvs_now_ns();
    const uint32_t max_ctx = L->info.max_ctx;
    const char *param = req->chat ? "messages" : "prompt";
    if (strlen(prompt) > (size_t)max_ctx * 64)
        return http_fail(e, 400, "invalid_request_error", "context_length_exceeded", param,
                         "the prompt is far longer than the model's context of %u tokens", max_ctx);
    int32_t *ids = NULL;
    int n = 0;
    int err = gen_tokenize(L->vocab, prompt, tok_add_bos(L->vocab), req->chat, &ids, &n);
    if (err == KVS_ERR_NOMEM) return nomem(e);
    if (err)
        return http_fail(e, 400, "invalid_request_error", "invalid_value", param, "the prompt cannot be tokenized");
    uint64_t want = (uint64_t)n + (uint64_t)(req->max_tokens > 0 ? req->max_tokens : 1);
    if (want > max_ctx) {
        free(ids);
        return http_fail(e, 400, "invalid_request_error", "context_length_exceeded", param,
                         "this model's context is %u tokens; the prompt is %d tokens and max_tokens asks for %ld more",
                         max_ctx, n, req->max_tokens > 0 ? req->max_tokens : 1);
    }
    gen_params p = {.vocab = L->vocab,
                    .n_vocab = (int32_t)L->info.n_vocab,
                    .sp = req->sp,
                    .max_gen = req->max_tokens > 0 ? (uint32_t)req->max_tokens : max_ctx - (uint32_t)n,
                    .repeat_last_n = req->repeat_last_n,
                    .top_logprobs = req->logprobs ? (uint32_t)req->top_logprobs : 0,
                    .stop = (const char *const *)req->stop,
                    .n_stop = req->n_stop};
    gen_backend be = {.forward = lane_forward, .ctx = g};
    char msg[KVS_MSG_MAX] = "";
    err = gen_begin(&g->gen, &be, &p, ids, (uint32_t)n, msg, sizeof msg);
    free(ids);
    if (err) goto fail_nomem;
    g->n_prompt = (uint32_t)n;
    if (req->logprobs && !(g->lps = calloc(p.max_gen + 1, sizeof *g->lps))) goto fail_nomem;
    err = http_lanes_acquire(L, g->gen.ids, g->gen.n_prompt, req->owner, &g->lane, &g->s, &g->reuse, msg,
                             sizeof msg);
    if (err == KVS_ERR_BUSY) {
        http_fail(e, 503, "server_error", "server_busy", NULL, "the server is at capacity: %s", msg);
        goto fail;
    }
    if (err) {
        http_fail(e, 502, "server_error", "route_unavailable", NULL, "the route cannot be reached: %s", msg);
        goto fail;
    }
    g->r = L->lanes[g->lane].r;
    gen_skip_held(&g->gen, g->reuse);
    if (!g->s && (err = route_session_open(g->r, &g->s, msg, sizeof msg)) != KVS_OK) {
        http_lanes_finish(L, g->lane, NULL, NULL, 0, false, false);
        http_fail(e, 500, "server_error", NULL, NULL, "cannot open a session: %s", msg);
        goto fail;
    }
    /* The api reaches the shards as one identity: its clients' prefix blocks are kept apart by
     * salting each session's chain hashes with the client's identity. */
    if (!g->reuse) {
        route_session_prefix_salt(g->s, req->owner);
        /* the operator's public prefix: the whole blocks the prompt shares with it, for everyone */
        uint32_t same = 0;
        while ((int)same < L->n_pub && same < g->gen.n_prompt && g->gen.ids[same] == L->pub_ids[same]) same++;
        route_session_public_blocks(g->s, same / WIRE_PREFIX_TOKENS);
    }
    return true;
fail_nomem:
    nomem(e);
fail:
    gen_end(&g->gen);
    free(g->lps);
    memset(g, 0, sizeof *g);
    return false;
}

bool http_gen_step(http_gen *g) {
    if (g->finish || g->failed) return !g->failed;
    const http_params *p = &g->L->p;
    if (p->before_step) p->before_step(p->hook_ctx, g->request_no, g->n_gen);
    uint32_t n_before = g->gen.n_gen;
    if (gen_step(&g->gen, g->err, sizeof g->err) != KVS_OK) {
        g->failed = true;
        sync_views(g);
        return false;
    }
    if (g->lps && g->gen.n_gen > n_before) {
        const sampler_result *res = &g->gen.last;
        http_tok_lp *lp = &g->lps[n_before];
        lp->id = res->id;
        lp->logprob = res->logprob;
        lp->n_top = (int)res->n_top;
        for (uint32_t j = 0; j < res->n_top && j < HTTP_MAX_TOP_LOGPROBS; j++) {
            lp->top_id[j] = res->top[j].id;
            lp->top_lp[j] = res->top[j].logprob;
        }
    }
    sync_views(g);
    return true;
}

size_t http_gen_ready(const http_gen *g) { return gen_ready(&g->gen, g->emitted); }

void http_gen_end(http_gen *g, bool cancel) {
    if (g->lane >= 0) {
        bool keep = !cancel && !g->failed && g->finish != FINISH_NONE;
        uint32_t held = route_session_pos(g->s);
        if (held > g->gen.n_fed) held = g->gen.n_fed;
        const uint32_t cached = g->reuse ? 0 : route_session_cached(g->s); /* before finish frees it */
        http_lanes_finish(g->L, g->lane, g->s, g->gen.ids, held, keep, g->failed);
        http_metrics_tokens(g->metrics, g->n_prompt, g->n_gen, g->reuse, cached);
        if (cancel) http_metrics_cancelled(g->metrics);
    }
    gen_end(&g->gen);
    free(g->lps);
    memset(g, 0, sizeof *g);
    g->lane = -1;
}
