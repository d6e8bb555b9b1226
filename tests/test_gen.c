/* test_gen — the generation loop of gen.h on a scripted backend: what each step feeds, the
 * position and window of each draw, the three ways a generation finishes, the text that may
 * leave (stop-string and UTF-8 hold-back), a kept prefix, and failures. Greedy sampling
 * (temp 0) over logits that put one scripted id on top makes every draw known. */
#include <stdbool.h>

#include "gen.h"
#include "test.h"
#include "util.h"

/* The vocab: SPM, no space prefix; id 2 is EOS. */
enum { UNK, BOS, EOS, TOK_A, TOK_B, TOK_EURO1, TOK_EURO2, TOK_STOP, TOK_X, N_VOCAB };
static const char *const TEXTS[N_VOCAB] = {"<unk>", "<s>", "</s>", "a", "b", "\xE2\x82", "\xAC", "STOP", "x"};
static const int32_t TYPES[N_VOCAB] = {2, 3, 3, 1, 1, 1, 1, 1, 1};

static tok_vocab *make_vocab(void) {
    uint32_t lens[N_VOCAB];
    for (int i = 0; i < N_VOCAB; i++) lens[i] = (uint32_t)strlen(TEXTS[i]);
    tok_arrays a = {.n_vocab = N_VOCAB, .texts = TEXTS, .text_lens = lens, .types = TYPES, .bos = BOS, .eos = EOS,
                    .unk = UNK, .add_bos = 1};
    tok_vocab *v = NULL;
    char msg[KVS_MSG_MAX] = "";
    int err = tok_from_arrays(&a, &v, msg, sizeof msg);
    if (err) fprintf(stderr, "tok_from_arrays: %s\n", msg);
    return v;
}

/* A backend that answers its script: forward k puts script[k] on top. It records what each
 * forward was fed, and what each draw was asked (forward_sample). */
#define MAX_CALLS 16
typedef struct {
    const int32_t *script;
    int n_script;
    int calls;
    uint32_t fed_n[MAX_CALLS];
    int32_t fed_first[MAX_CALLS];
    uint32_t pos[MAX_CALLS], n_window[MAX_CALLS];
    int fail_at; /* this forward fails (-1: none) */
} script_backend;

static int script_forward(void *ctx, const int32_t *tokens, uint32_t n, float *logits, char *msg, size_t cap) {
    script_backend *b = ctx;
    int k = b->calls++;
    if (k == b->fail_at || k >= b->n_script || k >= MAX_CALLS)
        return kvs_fail(msg, cap, KVS_ERR_IO, "forward %d refused", k);
    b->fed_n[k] = n;
    b->fed_first[k] = n ? tokens[0] : -1;
    for (int i = 0; i < N_VOCAB; i++) logits[i] = 0.0f;
    logits[b->script[k]] = 10.0f;
    return KVS_OK;
}

static int script_sample(void *ctx, const int32_t *tokens, uint32_t n, const gen_sample_req *rq, sampler_result *res,
                         char *msg, size_t cap) {
    script_backend *b = ctx;
    int k = b->calls;
    float logits[N_VOCAB];
    int err = script_forward(ctx, tokens, n, logits, msg, cap);
    if (err) return err;
    b->pos[k] = rq->pos;
    b->n_window[k] = rq->n_window;
    memset(res, 0, sizeof *res);
    res->id = b->script[k];
    return KVS_OK;
}

static gen_params greedy(const tok_vocab *v, uint32_t max_gen) {
    gen_params p = {.vocab = v, .n_vocab = N_VOCAB, .sp = sampler_default_params(), .max_gen = max_gen,
                    .repeat_last_n = 64};
    p.sp.temp = 0.0f;
    return p;
}

/* Runs g to the end (at most MAX_CALLS steps); the number of steps taken. */
static int run_all(gen_state *g) {
    char msg[KVS_MSG_MAX] = "";
    int steps = 0;
    while (g->finish == GEN_RUNNING && !g->failed && steps < MAX_CALLS) {
        int err = gen_step(g, msg, sizeof msg);
        steps++;
        if (err) fprintf(stderr, "gen_step: %s\n", msg);
    }
    return steps;
}

/* Prefill, then one id per step; an end-of-generation id ends it and is not appended. */
static void test_eog(const tok_vocab *v) {
    static const int32_t script[] = {TOK_A, TOK_B, TOK_A, EOS};
    script_backend b = {.script = script, .n_script = 4, .fail_at = -1};
    gen_backend be = {.forward = script_forward, .ctx = &b};
    gen_params p = greedy(v, 10);
    const int32_t prompt[] = {BOS, TOK_X};
    gen_state g;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(gen_begin(&g, &be, &p, prompt, 2, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(run_all(&g), 4);
    CHECK_EQ_INT(g.finish, GEN_FINISH_EOG);
    CHECK_EQ_INT(g.last.id, EOS);
    CHECK_EQ_INT(g.n_gen, 3);
    CHECK_EQ_INT(g.n_ids, 5);
    CHECK_EQ_INT(g.n_fed, 5); /* the third id was fed to draw EOS; EOS itself never is */
    CHECK(g.text && !strcmp(g.text, "aba"));
    CHECK_EQ_INT(b.fed_n[0], 2); /* the prefill */
    CHECK_EQ_INT(b.fed_first[0], BOS);
    for (int k = 1; k < 4; k++) {
        CHECK_EQ_INT(b.fed_n[k], 1);
        CHECK_EQ_INT(b.fed_first[k], script[k - 1]);
    }
    CHECK_EQ_INT(gen_ready(&g, 0), 3); /* finished: everything */
    CHECK_EQ_INT(gen_step(&g, msg, sizeof msg), KVS_OK); /* a finished generation does nothing */
    CHECK_EQ_INT(b.calls, 4);
    gen_end(&g);
    CHECK(g.ids == NULL && g.text == NULL);
}

/* max_gen ends it after that many ids, the last of them not fed; max_gen 0 still prefills
 * and draws once. */
static void test_length(const tok_vocab *v) {
    static const int32_t script[] = {TOK_A, TOK_B, TOK_A, TOK_B};
    const int32_t prompt[] = {BOS};
    char msg[KVS_MSG_MAX] = "";
    for (uint32_t max_gen = 0; max_gen <= 2; max_gen++) {
        script_backend b = {.script = script, .n_script = 4, .fail_at = -1};
        gen_backend be = {.forward = script_forward, .ctx = &b};
        gen_params p = greedy(v, max_gen);
        gen_state g;
        CHECK_EQ_INT(gen_begin(&g, &be, &p, prompt, 1, msg, sizeof msg), KVS_OK);
        CHECK_EQ_INT(run_all(&g), max_gen ? (int)max_gen : 1);
        CHECK_EQ_INT(g.finish, GEN_FINISH_LENGTH);
        CHECK_EQ_INT(g.n_gen, max_gen);
        CHECK_EQ_INT(g.n_fed, max_gen ? g.n_ids - 1 : 1);
        CHECK_EQ_INT(g.text_len, max_gen);
        gen_end(&g);
    }
}

/* A stop string cuts the text where it begins; while running, its length less one byte is
 * held back. */
static void test_stop(const tok_vocab *v) {
    static const int32_t script[] = {TOK_A, TOK_STOP, TOK_A};
    static const char *const stops[] = {"zz", "TO"};
    script_backend b = {.script = script, .n_script = 3, .fail_at = -1};
    gen_backend be = {.forward = script_forward, .ctx = &b};
    gen_params p = greedy(v, 10);
    p.stop = stops;
    p.n_stop = 2;
    const int32_t prompt[] = {BOS};
    gen_state g;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(gen_begin(&g, &be, &p, prompt, 1, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(gen_step(&g, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(g.text_len, 1);
    CHECK_EQ_INT(gen_ready(&g, 0), 0); /* held: the longest stop string less one byte */
    CHECK_EQ_INT(gen_step(&g, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(g.finish, GEN_FINISH_STOP);
    CHECK(g.text && !strcmp(g.text, "aS"));
    CHECK_EQ_INT(g.text_len, 2);
    CHECK_EQ_INT(g.n_gen, 2);
    CHECK_EQ_INT(gen_ready(&g, 0), 2);
    gen_end(&g);
}

/* An incomplete UTF-8 character at the end is held back until it completes; gen_ready never
 * goes below what was sent. */
static void test_utf8_hold(const tok_vocab *v) {
    static const int32_t script[] = {TOK_A, TOK_EURO1, TOK_EURO2, TOK_A};
    script_backend b = {.script = script, .n_script = 4, .fail_at = -1};
    gen_backend be = {.forward = script_forward, .ctx = &b};
    gen_params p = greedy(v, 4);
    const int32_t prompt[] = {BOS};
    gen_state g;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(gen_begin(&g, &be, &p, prompt, 1, msg, sizeof msg), KVS_OK);
    size_t want[] = {1, 1, 4, 5};
    for (int k = 0; k < 4; k++) {
        CHECK_EQ_INT(gen_step(&g, msg, sizeof msg), KVS_OK);
        CHECK_EQ_INT(gen_ready(&g, 0), want[k]);
    }
    CHECK_EQ_INT(g.finish, GEN_FINISH_LENGTH);
    gen_end(&g);
    /* sent past the hold-back point (a caller that flushed at the end) stays */
    b = (script_backend){.script = script, .n_script = 4, .fail_at = -1};
    CHECK_EQ_INT(gen_begin(&g, &be, &p, prompt, 1, msg, sizeof msg), KVS_OK);
    gen_step(&g, msg, sizeof msg);
    gen_step(&g, msg, sizeof msg);
    CHECK_EQ_INT(gen_ready(&g, 3), 3);
    gen_end(&g);
}

/* A kept prefix is not fed again; a backend that draws gets the position and window. */
static void test_held_and_sample(const tok_vocab *v) {
    static const int32_t script[] = {TOK_B, TOK_A, EOS};
    script_backend b = {.script = script, .n_script = 3, .fail_at = -1};
    gen_backend be = {.forward = script_forward, .forward_sample = script_sample, .ctx = &b};
    gen_params p = greedy(v, 10);
    p.pos0 = 100;
    p.repeat_last_n = 3;
    const int32_t prompt[] = {BOS, TOK_X, TOK_A, TOK_B};
    gen_state g;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(gen_begin(&g, &be, &p, prompt, 4, msg, sizeof msg), KVS_OK);
    gen_skip_held(&g, 3);
    CHECK_EQ_INT(run_all(&g), 3);
    CHECK_EQ_INT(g.finish, GEN_FINISH_EOG);
    CHECK_EQ_INT(b.fed_n[0], 1);
    CHECK_EQ_INT(b.fed_first[0], TOK_B);
    for (int k = 0; k < 3; k++) {
        CHECK_EQ_INT(b.pos[k], 100 + 4 + k);
        CHECK_EQ_INT(b.n_window[k], 3);
    }
    CHECK(g.text && !strcmp(g.text, "ba"));
    gen_end(&g);
}

/* A failed forward fails the generation, with the backend's text, on this and later steps. */
static void test_failure(const tok_vocab *v) {
    static const int32_t script[] = {TOK_A, TOK_B, TOK_A};
    script_backend b = {.script = script, .n_script = 3, .fail_at = 1};
    gen_backend be = {.forward = script_forward, .ctx = &b};
    gen_params p = greedy(v, 10);
    const int32_t prompt[] = {BOS};
    gen_state g;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(gen_begin(&g, &be, &p, prompt, 1, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(gen_step(&g, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(gen_step(&g, msg, sizeof msg), KVS_ERR_IO);
    CHECK(!strcmp(msg, "forward 1 refused"));
    CHECK(g.failed);
    CHECK_EQ_INT(g.n_fed, 1); /* the failed forward's id is not counted as fed */
    CHECK_EQ_INT(gen_step(&g, msg, sizeof msg), KVS_ERR_IO);
    CHECK_EQ_INT(b.calls, 2);
    CHECK_EQ_INT(gen_ready(&g, 0), 1); /* a failed generation lets its text go */
    gen_end(&g);
    /* an empty prompt fails its first step without calling the backend */
    b = (script_backend){.script = script, .n_script = 3, .fail_at = -1};
    CHECK_EQ_INT(gen_begin(&g, &be, &p, NULL, 0, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(gen_step(&g, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    CHECK(!strcmp(msg, "no tokens"));
    CHECK_EQ_INT(b.calls, 0);
    gen_end(&g);
    /* bad arguments leave g zeroed */
    gen_backend none = {0};
    CHECK_EQ_INT(gen_begin(&g, &none, &p, prompt, 1, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    CHECK(g.ids == NULL);
    gen_end(&g);
}

static void test_tokenize(const tok_vocab *v) {
    int32_t *ids = NULL;
    int n = 0;
    CHECK_EQ_INT(gen_tokenize(v, "ab</s>", true, true, &ids, &n), KVS_OK);
    CHECK_EQ_INT(n, 4);
    if (ids && n == 4) {
        CHECK_EQ_INT(ids[0], BOS);
        CHECK_EQ_INT(ids[1], TOK_A);
        CHECK_EQ_INT(ids[2], TOK_B);
        CHECK_EQ_INT(ids[3], EOS); /* special-token text read as the token */
    }
    free(ids);
    CHECK_EQ_INT(gen_tokenize(v, "ab</s>", false, false, &ids, &n), KVS_OK);
    CHECK(n > 3); /* as plain text */
    if (ids && n > 0) CHECK_EQ_INT(ids[0], TOK_A);
    free(ids);
}

int main(void) {
    tok_vocab *v = make_vocab();
    CHECK(v != NULL);
    if (!v) return test_finish("test_gen", 1, 0);
    test_eog(v);
    test_length(v);
    test_stop(v);
    test_utf8_hold(v);
    test_held_and_sample(v);
    test_failure(v);
    test_tokenize(v);
    tok_free(v);
    return test_finish("test_gen", 1, 0);
}
