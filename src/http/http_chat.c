/*
 * http_chat — messages to prompt text with the model's chat template (src/chat.h): the one
 * the vocab's tokenizer.chat_template is recognised as (chat_template_detect), or
 * http_params.chat_template when set. A file without a template gets ChatML, as `kvshard chat`
 * does, so both give the same text for the same messages. The text goes to tok_encode_ex
 * with special-token parsing (http_gen.c).
 */
#include <stdlib.h>

#include "chat.h"
#include "http_impl.h"
#include "util.h"

int http_chat_pick(const tok_vocab *v, const char *name, int *tmpl, char *msg, size_t cap) {
    chat_template t;
    if (name && name[0]) {
        if (chat_template_by_name(name, &t) != KVS_OK)
            return kvs_fail(msg, cap, KVS_ERR_INVALID_ARG, "unknown chat template '%.60s' (known: %s)", name,
                            chat_template_names());
        *tmpl = (int)t;
        return KVS_OK;
    }
    int err = chat_template_detect(v ? tok_chat_template(v) : NULL, &t);
    if (err && err != KVS_ERR_NOT_FOUND) /* NOT_FOUND: no template in the file, t is ChatML */
        return kvs_fail(msg, cap, err, "the model's chat template is not one this build knows; pass --chat-template");
    *tmpl = (int)t;
    return KVS_OK;
}

int http_chat_format(int tmpl, const http_message *msgs, size_t n, char **out) {
    *out = NULL;
    chat_message *cm = malloc((n ? n : 1) * sizeof *cm);
    if (!cm) return KVS_ERR_NOMEM;
    for (size_t i = 0; i < n; i++) cm[i] = (chat_message){.role = msgs[i].role, .content = msgs[i].content};
    int err = chat_format((chat_template)tmpl, cm, n, true, out, NULL, 0);
    free(cm);
    return err;
}
