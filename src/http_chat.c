/*
 * http_chat — messages to prompt text with the model's chat template (src/chat.h): the one
 * the vocab's tokenizer.chat_template names (chat_template_detect), or http_params.chat_template
 * when set. A model without a template (stories260K) gets a plain layout — "System: ...",
 * "User: ...", "Assistant: ..." blocks separated by a blank line, ending with "Assistant:" — so
 * a base model still answers. The text goes to tok_encode_ex with special-token parsing.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat.h"
#include "http_impl.h"
#include "util.h"

static const char *role_title(const char *role) {
    if (!strcmp(role, "system")) return "System";
    if (!strcmp(role, "assistant")) return "Assistant";
    return "User";
}

static int plain_format(const http_message *msgs, size_t n, char **out) {
    size_t len = sizeof "Assistant:";
    for (size_t i = 0; i < n; i++) len += strlen(msgs[i].content) + 16;
    char *s = malloc(len), *p = s;
    if (!s) return KVS_ERR_NOMEM;
    for (size_t i = 0; i < n; i++) p += sprintf(p, "%s: %s\n\n", role_title(msgs[i].role), msgs[i].content);
    strcpy(p, "Assistant:");
    *out = s;
    return KVS_OK;
}

int http_chat_pick(const tok_vocab *v, const char *name, int *tmpl, char *msg, size_t cap) {
    chat_template t;
    if (name && name[0]) {
        if (chat_template_by_name(name, &t) != KVS_OK)
            return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "unknown chat template '%.60s' (known: %s)", name,
                            chat_template_names());
        *tmpl = (int)t;
        return KVS_OK;
    }
    const char *jinja = v ? tok_chat_template(v) : NULL;
    int err = chat_template_detect(jinja, &t);
    if (err == KVS_ERR_NOT_FOUND) {
        *tmpl = HTTP_CHAT_PLAIN;
        return KVS_OK;
    }
    if (err) return kvs_fail(msg, cap, err, "the model's chat template is not one this build knows; pass a template name");
    *tmpl = (int)t;
    return KVS_OK;
}

int http_chat_format(int tmpl, const http_message *msgs, size_t n, char **out) {
    *out = NULL;
    if (tmpl == HTTP_CHAT_PLAIN) return plain_format(msgs, n, out);
    chat_message *cm = malloc((n ? n : 1) * sizeof *cm);
    if (!cm) return KVS_ERR_NOMEM;
    for (size_t i = 0; i < n; i++) cm[i] = (chat_message){.role = msgs[i].role, .content = msgs[i].content};
    int err = chat_format((chat_template)tmpl, cm, n, true, out, NULL, 0);
    free(cm);
    return err;
}
