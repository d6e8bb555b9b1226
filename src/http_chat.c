/*
 * http_chat — messages to prompt text.
 *
 * Temporary formatter: until the chat-template module (src/chat.h, the real-models issue) is
 * in, every model gets one plain layout — "System: ...", "User: ...", "Assistant: ..." blocks
 * separated by a blank line, ending with "Assistant:" — so the endpoint, streaming and tests
 * can be built and checked. This function is the one place that changes when chat.h lands.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_impl.h"

static const char *role_title(const char *role) {
    if (!strcmp(role, "system")) return "System";
    if (!strcmp(role, "assistant")) return "Assistant";
    return "User";
}

int http_chat_format(const tok_vocab *v, const http_message *msgs, size_t n, char **out) {
    (void)v;
    *out = NULL;
    size_t len = sizeof "Assistant:";
    for (size_t i = 0; i < n; i++) len += strlen(msgs[i].content) + 16;
    char *s = malloc(len), *p = s;
    if (!s) return KVS_ERR_NOMEM;
    for (size_t i = 0; i < n; i++)
        p += sprintf(p, "%s: %s\n\n", role_title(msgs[i].role), msgs[i].content);
    strcpy(p, "Assistant:");
    *out = s;
    return KVS_OK;
}
