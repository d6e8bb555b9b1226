/* The whole model in this process for run, logits and chat: see local_engine.h. */
#include "local_engine.h"

#include <stdio.h>
#include <string.h>

#include "kvstate.h"
#include "tokenizer.h"
#include "util.h"

int local_engine_open(const char *who, const char *path, int threads, uint32_t kv_type, uint32_t positions,
                      engine **e) {
    char msg[KVS_MSG_MAX] = "";
    engine_params ep = engine_default_params();
    ep.model_path = path;
    ep.n_threads = threads;
    ep.kv.kv_type = kv_type;
    ep.kv_positions = positions; /* one session of this many positions */
    int err = engine_open(&ep, e, msg, sizeof(msg));
    /* The loader's message names the file when the file is the problem: not twice. */
    if (err && !strncmp(msg, path, strlen(path))) fprintf(stderr, "%s: %s\n", who, msg);
    else if (err) fprintf(stderr, "%s: %s: %s\n", who, path, msg[0] ? msg : kvs_strerror(err));
    return err;
}

uint32_t local_engine_ctx(const engine *e) { return kv_get_params(e->kv)->max_positions; }

void local_engine_say_no_vocab(const char *cmd, const char *path, const engine *e) {
    char msg[KVS_MSG_MAX] = "";
    tok_vocab *v = NULL;
    tok_from_gguf(e->m->gguf, &v, msg, sizeof msg);
    tok_free(v);
    fprintf(stderr, "kvshard %s: %s: no usable tokenizer: %s\n", cmd, path, msg[0] ? msg : "unknown reason");
}

int local_session_step(void *ctx, const int32_t *tokens, uint32_t n, float *logits, char *msg, size_t cap) {
    local_session *c = ctx;
    c->req.start_pos += c->req.n;
    c->req.n = n;
    c->req.tokens = tokens;
    c->req.out = logits;
    engine_step(c->e, &c->req, 1);
    if (c->req.status) return kvs_fail(msg, cap, c->req.status, "%s", kvs_strerror(c->req.status));
    return KVS_OK;
}
