/*
 * gen — one generation, the loop that `kvshard run`, `generate`, `chat` and `api` share:
 * feed the prompt (the prefill), then draw one id per position, append its text, stop at an
 * end-of-generation id, a stop string or the length limit. Callers differ in where the
 * logits come from (the backend below) and in what they do with the text; the loop does not.
 *
 * States of one generation (gen_state.finish, gen_state.failed):
 *
 *            gen_begin                gen_step (ok)
 *   (zeroed) ---------> RUNNING ------------------------+---> RUNNING (one id appended)
 *                          |                            +---> FINISHED: EOG / STOP / LENGTH
 *                          |  gen_step (backend or sampler error)
 *                          +----------------------------------> FAILED
 *   RUNNING, FINISHED or FAILED --gen_end--> (zeroed)
 *
 * One gen_step, in this order:
 *   1. feed ids[n_fed..n_ids) to the backend: the whole prompt (less a prefix the session
 *      already holds, gen_skip_held) on the first step, the last appended id afterwards;
 *   2. draw the id for position pos0 + n_ids: sampler_pick over the logits with the last
 *      repeat_last_n ids as the penalty window, or the backend's forward_sample (the same
 *      pick done where the logits are); the draw depends only on its arguments (seed,
 *      position, window, logits), never on earlier draws;
 *   3. n_gen == max_gen: FINISHED (LENGTH), the drawn id dropped (only max_gen == 0 gets here);
 *   4. an end-of-generation id (tok_is_eog) or a negative one: FINISHED (EOG), not appended;
 *   5. append the id and its piece (tok_piece) to the text; a stop string now in the text:
 *      the text is cut where it begins, FINISHED (STOP); n_gen == max_gen: FINISHED (LENGTH).
 * The id drawn last is never fed (an end-of-generation id is not even appended): the session
 * ends holding pos0 + n_fed positions, and chat feeds that id first in its next turn.
 *
 * Text that may leave (gen_ready): up to the end, less a tail that could still grow into a
 * stop string (the longest stop string less one byte) and an incomplete UTF-8 character at
 * the very end; all of it once FINISHED or FAILED. Callers stream [what they sent, gen_ready).
 *
 * Ownership: the caller owns the backend and its session, the vocab and the stop strings,
 * borrowed for the generation's life; the generation owns its ids, logits, sampler and
 * text, freed by gen_end. One generation is driven by one thread at a time.
 */
#ifndef KVS_GEN_H
#define KVS_GEN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sampler.h"
#include "tokenizer.h"

/* What a draw done by the backend (forward_sample) must reproduce: sampler_pick with these
 * settings, for the position the new id takes, with the penalty window window[0..n_window). */
typedef struct {
    const sampler_params *sp;
    uint32_t pos;
    const int32_t *window;
    uint32_t n_window;
} gen_sample_req;

/* Where the logits come from: a local engine session, a route of shards. */
typedef struct {
    /* Appends tokens[0..n) (n >= 1) to the session and writes the logits of its last
     * position, (n_vocab) floats. KVS_OK, or an error with its text in msg. */
    int (*forward)(void *ctx, const int32_t *tokens, uint32_t n, float *logits, char *msg, size_t cap);
    /* NULL, or: appends tokens[0..n) and draws the next id where the logits are, with
     * exactly sampler_pick(rq); *res gets the id (log-probs need not be filled). Used instead
     * of forward when set. */
    int (*forward_sample)(void *ctx, const int32_t *tokens, uint32_t n, const gen_sample_req *rq,
                          sampler_result *res, char *msg, size_t cap);
    void *ctx;
} gen_backend;

typedef struct {
    const tok_vocab *vocab;   /* end-of-generation ids and the text of each id */
    int32_t n_vocab;          /* logits per forward */
    sampler_params sp;
    uint32_t max_gen;         /* ids to generate at most */
    uint32_t repeat_last_n;   /* penalty window: the last this many ids, prompt included */
    uint32_t top_logprobs;    /* best log-probs per draw in last.top, <= SAMPLER_MAX_TOP (forward only) */
    uint32_t pos0;            /* positions the session held before ids[0] (a conversation's earlier turns) */
    const char *const *stop;  /* (n_stop) NUL-terminated stop strings */
    int n_stop;
} gen_params;

typedef enum {
    GEN_RUNNING = 0,
    GEN_FINISH_EOG,    /* an end-of-generation id was drawn (last.id); not appended */
    GEN_FINISH_STOP,   /* a stop string completed; the text is cut where it begins */
    GEN_FINISH_LENGTH, /* max_gen ids generated */
} gen_finish;

typedef struct {
    gen_backend be;
    gen_params p;
    int32_t *ids;          /* (n_prompt + max_gen + 1) the prompt, then the generated ids */
    uint32_t n_prompt;     /* ids given to gen_begin */
    uint32_t n_ids;        /* n_prompt + n_gen */
    uint32_t n_gen;        /* ids generated (appended) so far */
    uint32_t n_fed;        /* ids[0..n_fed) are in the session */
    float *logits;         /* (n_vocab) of the last forward */
    sampler *smp;
    sampler_result last;   /* the last draw: its id (also an end-of-generation one) and log-probs */
    char *text;            /* (text_cap) the generated text, NUL-terminated; NULL before any */
    size_t text_len, text_cap;
    gen_finish finish;
    bool failed;
    int err;               /* the error that failed it */
} gen_state;

/* Starts a generation of p->max_gen ids after ids[0..n) (copied). On success g is RUNNING
 * (gen_end must follow); nothing is fed yet. An empty prompt (n == 0) is accepted and fails
 * its first step ("no tokens"). KVS_ERR_INVALID_ARG (NULL arguments, no forward),
 * KVS_ERR_NOMEM (msg says which); g is zeroed then. */
int gen_begin(gen_state *g, const gen_backend *be, const gen_params *p, const int32_t *ids, uint32_t n, char *msg,
              size_t msg_cap);

/* The session already holds ids[0..n) (a kept session's common prefix), so the first step
 * feeds from ids[n]. Only before the first gen_step, with n < n_prompt. */
void gen_skip_held(gen_state *g, uint32_t n);

/* One step (the design note above). KVS_OK when g is RUNNING or FINISHED after it (nothing
 * is done for a FINISHED g); otherwise g is FAILED and the backend's error (its text in msg),
 * KVS_ERR_NOMEM or the sampler's error ("cannot sample") is returned, again on later calls. */
int gen_step(gen_state *g, char *msg, size_t msg_cap);

/* Bytes of g->text that may leave now (the design note above), never less than sent. */
size_t gen_ready(const gen_state *g, size_t sent);

/* Frees what g owns and zeroes it. A zeroed g is fine. */
void gen_end(gen_state *g);

/* Tokenizes text[0..strlen) with BOS when add_bos and special-token text read as those
 * tokens when parse_special. *ids is malloc'd (the caller frees), *n ids. KVS_OK, or the
 * tokenizer's error (KVS_ERR_NOMEM among them) with *ids NULL. */
int gen_tokenize(const tok_vocab *v, const char *text, bool add_bos, bool parse_special, int32_t **ids, int *n);

#endif /* KVS_GEN_H */
