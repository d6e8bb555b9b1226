/* The whole model in this process, one session, as `kvshard run`, `logits` and `chat` use it. */
#ifndef KVS_LOCAL_ENGINE_H
#define KVS_LOCAL_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "engine.h"

/* Opens path whole with threads compute threads, KV elements of kv_type and a KV pool for one
 * session of `positions` (0: the default budget). KVS_OK, or the engine's error after printing "WHO: path: reason"
 * (who: "kvshard" or "kvshard CMD"); *e is NULL then. The caller closes *e. */
int local_engine_open(const char *who, const char *path, int threads, uint32_t kv_type, uint32_t positions,
                      engine **e);

/* Positions one session may hold: the model's context length, as far as the KV pool holds it. */
uint32_t local_engine_ctx(const engine *e);

/* Prints why e has no tokenizer (the engine opens it quietly, so the tokenizer is asked again):
 * "kvshard CMD: path: no usable tokenizer: reason". */
void local_engine_say_no_vocab(const char *cmd, const char *path, const engine *e);

/* One session on an engine; req holds the session id, epoch and out mode, and start_pos + n is
 * the number of positions fed so far. */
typedef struct {
    engine *e;
    engine_req req;
} local_session;

/* gen_backend.forward on a local_session (ctx): appends tokens[0..n) and writes the last position's
 * logits. KVS_OK, or the request's status with its text in msg. */
int local_session_step(void *ctx, const int32_t *tokens, uint32_t n, float *logits, char *msg, size_t cap);

#endif /* KVS_LOCAL_ENGINE_H */
