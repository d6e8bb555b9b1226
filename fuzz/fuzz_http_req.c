/* fuzz_http_req — libFuzzer target for the OpenAI request parser of `kvshard api`
 * (http_req_parse), both endpoints' rules. The first byte picks chat or completions; the rest is
 * the body. Every accepted request is walked (messages, stop strings) so a field that escaped
 * validation shows up as an ASan report; a rejected one must carry an HTTP status and message.
 * Run: ./fuzz_http_req -max_total_time=60 corpus_dir (seeds in fuzz/seeds/fuzz_http_req). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "http_impl.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static volatile size_t sink;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    bool chat = data[0] & 1;
    http_gen_req r;
    http_err e;
    if (http_req_parse((const char *)data + 1, size - 1, chat, &r, &e)) {
        for (size_t i = 0; i < r.n_msgs; i++) sink += strlen(r.msgs[i].role) + strlen(r.msgs[i].content);
        for (int i = 0; i < r.n_stop; i++) sink += strlen(r.stop[i]);
        if (r.prompt) sink += strlen(r.prompt);
        if (r.n_stop > HTTP_MAX_STOP || r.top_logprobs < 0 || r.top_logprobs > HTTP_MAX_TOP_LOGPROBS) abort();
        if (chat ? !r.n_msgs : !r.prompt) abort();
        http_gen_req_free(&r);
    } else if (e.status != 400 && e.status != 500) {
        abort();
    } else {
        sink += strlen(e.message);
    }
    return 0;
}
