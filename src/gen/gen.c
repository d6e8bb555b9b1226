/* gen — one generation: see gen.h for its states and the order of one step. */
#include "gen.h"

#include <stdlib.h>
#include <string.h>

#include "util.h"

int gen_begin(gen_state *g, const gen_backend *be, const gen_params *p, const int32_t *ids, uint32_t n, char *msg,
              size_t msg_cap) {
    if (!g) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "no generation");
    memset(g, 0, sizeof *g);
    if (!be || !be->forward || !p || !p->vocab || p->n_vocab <= 0 || (!ids && n > 0) || (p->n_stop > 0 && !p->stop))
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "bad generation arguments");
    uint64_t cap = (uint64_t)n + p->max_gen + 1;
    if (cap > UINT32_MAX) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "too many ids for one generation");
    g->be = *be;
    g->p = *p;
    g->ids = malloc((size_t)cap * sizeof *g->ids);
    g->logits = malloc((size_t)p->n_vocab * sizeof *g->logits);
    g->smp = sampler_create(p->sp);
    if (!g->ids || !g->logits || !g->smp) {
        gen_end(g);
        return kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory");
    }
    if (n) memcpy(g->ids, ids, (size_t)n * sizeof *ids);
    g->n_prompt = g->n_ids = n;
    return KVS_OK;
}

void gen_skip_held(gen_state *g, uint32_t n) {
    if (g->n_gen == 0 && g->n_fed == 0 && n < g->n_prompt) g->n_fed = n;
}

/* Appends id's piece to the text (an id without a piece adds nothing). */
static int text_append(gen_state *g, int32_t id) {
    size_t n = 0;
    if (tok_piece(g->p.vocab, id, NULL, 0, &n) != KVS_OK) return KVS_OK;
    if (g->text_len + n + 1 > g->text_cap) {
        size_t nc = (g->text_cap ? g->text_cap * 2 : 256) + n;
        char *nb = realloc(g->text, nc);
        if (!nb) return KVS_ERR_NOMEM;
        g->text = nb;
        g->text_cap = nc;
    }
    size_t got = 0;
    tok_piece(g->p.vocab, id, g->text + g->text_len, n, &got);
    g->text_len += n;
    g->text[g->text_len] = 0;
    return KVS_OK;
}

/* The first stop string that now occurs in the text, searched only where the piece that
 * ended at old_len can have completed one: cuts the text there. */
static bool apply_stop(gen_state *g, size_t old_len) {
    size_t cut = SIZE_MAX;
    for (int i = 0; i < g->p.n_stop; i++) {
        size_t sl = strlen(g->p.stop[i]);
        size_t from = old_len + 1 > sl ? old_len + 1 - sl : 0;
        const char *hit = memmem(g->text + from, g->text_len - from, g->p.stop[i], sl);
        if (hit && (size_t)(hit - g->text) < cut) cut = (size_t)(hit - g->text);
    }
    if (cut == SIZE_MAX) return false;
    g->text_len = cut;
    g->text[cut] = 0;
    return true;
}

static int fail(gen_state *g, int err) {
    g->failed = true;
    g->err = err;
    return err;
}

/* Steps 1 and 2 of gen.h: feeds what the session lacks and draws the next id into g->last. */
static int feed_and_draw(gen_state *g, char *msg, size_t msg_cap) {
    const int32_t *feed = g->ids + g->n_fed;
    uint32_t n_feed = g->n_ids - g->n_fed;
    if (n_feed == 0) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "no tokens"); /* an empty prompt */
    uint32_t n_win = g->p.repeat_last_n < g->n_ids ? g->p.repeat_last_n : g->n_ids;
    gen_sample_req rq = {.sp = &g->p.sp, .pos = g->p.pos0 + g->n_ids, .window = g->ids + (g->n_ids - n_win),
                         .n_window = n_win};
    if (msg && msg_cap) msg[0] = 0;
    int err = g->be.forward_sample
                  ? g->be.forward_sample(g->be.ctx, feed, n_feed, &rq, &g->last, msg, msg_cap)
                  : g->be.forward(g->be.ctx, feed, n_feed, g->logits, msg, msg_cap);
    if (err) {
        if (msg && msg_cap && !msg[0]) kvs_fail(msg, msg_cap, err, "%s", kvs_strerror(err));
        return err;
    }
    g->n_fed = g->n_ids;
    if (g->be.forward_sample) return KVS_OK;
    err = sampler_pick(g->smp, g->logits, g->p.n_vocab, rq.pos, rq.window, rq.n_window, &g->last, g->p.top_logprobs);
    return err ? kvs_fail(msg, msg_cap, err, "cannot sample") : KVS_OK;
}

int gen_step(gen_state *g, char *msg, size_t msg_cap) {
    if (g->failed) return kvs_fail(msg, msg_cap, g->err, "the generation failed");
    if (g->finish != GEN_RUNNING) return KVS_OK;
    int err = feed_and_draw(g, msg, msg_cap);
    if (err) return fail(g, err);
    if (g->n_gen >= g->p.max_gen) {
        g->finish = GEN_FINISH_LENGTH;
        return KVS_OK;
    }
    int32_t id = g->last.id;
    if (id < 0 || tok_is_eog(g->p.vocab, id)) {
        g->finish = GEN_FINISH_EOG;
        return KVS_OK;
    }
    g->ids[g->n_ids++] = id;
    g->n_gen++;
    size_t old_len = g->text_len;
    if (text_append(g, id) != KVS_OK) return fail(g, kvs_fail(msg, msg_cap, KVS_ERR_NOMEM, "out of memory"));
    if (g->p.n_stop && apply_stop(g, old_len)) g->finish = GEN_FINISH_STOP;
    else if (g->n_gen >= g->p.max_gen) g->finish = GEN_FINISH_LENGTH;
    return KVS_OK;
}

size_t gen_ready(const gen_state *g, size_t sent) {
    size_t end = g->text_len;
    if (g->finish != GEN_RUNNING || g->failed) return end;
    size_t hold = 0;
    for (int i = 0; i < g->p.n_stop; i++) {
        size_t sl = strlen(g->p.stop[i]);
        if (sl - 1 > hold) hold = sl - 1;
    }
    end = end > hold ? end - hold : 0;
    end = tok_utf8_complete_len(g->text, end); /* not inside a UTF-8 character */
    return end < sent ? sent : end;
}

void gen_end(gen_state *g) {
    if (!g) return;
    sampler_free(g->smp);
    free(g->ids);
    free(g->logits);
    free(g->text);
    memset(g, 0, sizeof *g);
}

int gen_tokenize(const tok_vocab *v, const char *text, bool add_bos, bool parse_special, int32_t **ids, int *n) {
    *ids = NULL;
    *n = 0;
    size_t len = strlen(text);
    int need = 0;
    int err = tok_encode_ex(v, text, len, add_bos, parse_special, NULL, 0, &need);
    if (err != KVS_OK && err != KVS_ERR_TOO_LARGE) return err;
    int32_t *buf = malloc(((size_t)need + 1) * sizeof *buf);
    if (!buf) return KVS_ERR_NOMEM;
    if ((err = tok_encode_ex(v, text, len, add_bos, parse_special, buf, need + 1, n)) != KVS_OK) {
        free(buf);
        return err;
    }
    *ids = buf;
    return KVS_OK;
}
