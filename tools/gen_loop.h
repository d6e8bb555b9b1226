/*
 * The command-line side of the generation loop (src/gen/gen.h), shared by `kvshard run`
 * (one process), `kvshard generate` (a route of shards) and `kvshard chat` (either): the
 * options, tokenizing the prompt (BOS as the file says, special-token text parsed unless
 * --plain), checking it against the context, then driving gen_step and streaming the text
 * (gen_ready holds back an incomplete UTF-8 character) or printing one JSON object (valid
 * UTF-8: bad bytes become U+FFFD). Only the backend differs, so the commands produce the
 * same ids and text for the same model and sampling.
 */
#ifndef KVS_GEN_LOOP_H
#define KVS_GEN_LOOP_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "gen.h"
#include "sampler.h"
#include "tokenizer.h"

typedef struct {
    const char *prompt;
    long n_gen;          /* tokens to generate (default 64) */
    sampler_params sp;   /* default temp 0.8, top_k 40, top_p 0.95, a random 32-bit seed */
    bool json;           /* one {"prompt_tokens","generated","text"} object on stdout */
    bool stats;          /* one JSON line of timings on stderr at the end */
    long pause_after;    /* testing aid: after this many tokens, wait for a line on stdin (0 = off) */
    long repeat_last_n;  /* penalty window: the last this many ids (prompt included); default 64 */
    bool plain;          /* --plain: special-token text in the prompt is plain text */
    volatile sig_atomic_t *stop; /* gen_turn ends the turn after a step when this is > 0 (Ctrl-C) */
    long n_ctx;          /* -c/--ctx-size: positions of the context; 0 = the model's, as the KV budget allows */
} gen_opts;

void gen_opts_default(gen_opts *o);
/* Consumes one of the shared options at argv[*i] (-p -n -c --temp --top-k --top-p --seed --json
 * --stats --pause-after --plain). Returns 1 when consumed, 0 when not one of them, -1 on a bad value
 * (already reported). */
int gen_parse_opt(gen_opts *o, int argc, char **argv, int *i);
/* The shared part of the --help text. */
void gen_usage_common(FILE *f);

/* Appends extra ",\"key\":value" members to the --stats object / the pause line (may be NULL). */
typedef void (*gen_describe_fn)(void *ctx, FILE *f);

typedef struct {
    const char *cmd;          /* "run" / "generate", for messages */
    const tok_vocab *vocab;
    int32_t n_vocab;
    uint32_t max_ctx;
    const char *ctx_hint;     /* which flag raises max_ctx, for messages; NULL: -c/--ctx-size */
    gen_backend backend;      /* the logits (or the draw) for each step; its ctx is the describers' too */
    gen_describe_fn describe; /* stats extras */
    gen_describe_fn session;  /* pause line: session id and epoch */
} gen_target;

/* Runs the whole generation; returns the process exit status (0 ok, 1 failure). */
int gen_run(const gen_opts *o, const gen_target *t);

/* One turn of a conversation on a session whose position is *pos: feeds *pending (when
 * >= 0) and ids[0..n) (the new prompt tokens), then samples up to o->n_gen tokens,
 * stopping after an end-of-generation token, streaming the text to out (NULL:
 * silent). The last sampled token (the end-of-generation one included) is not fed: it
 * comes back in *pending for the next turn to feed first, as llama.cpp's chat feeds it.
 * *reply gets the turn's text without the end-of-generation token (malloc'd,
 * NUL-terminated, raw bytes; caller frees). Returns KVS_OK, KVS_ERR_CONTEXT_FULL (nothing
 * fed), or the step's error (msg). */
int gen_turn(const gen_opts *o, const gen_target *t, const int32_t *ids, int n, uint32_t *pos,
             int32_t *pending, char **reply, FILE *out, char *msg, size_t msg_cap);

/* Waits until stdin, a terminal, has input (true) or *stop > 0 (false). SIGINT and SIGTERM are
 * blocked but while it waits, so a Ctrl-C that lands before the wait is seen, where a read
 * begun after it would block on. Not a terminal, or stop NULL: true at once. */
bool gen_wait_input(volatile sig_atomic_t *stop);

/* Writes s[0..n) to f as valid UTF-8 (bad bytes as U+FFFD). */
void gen_write_utf8(FILE *f, const char *s, size_t n);

#endif /* KVS_GEN_LOOP_H */
