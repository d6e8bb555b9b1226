/*
 * chat — chat templates: recognise a GGUF file's tokenizer.chat_template (a Jinja
 * program) by distinctive substrings, as llama.cpp does, and format a conversation
 * with the matching built-in formatter. No Jinja is executed.
 *
 * The formatted text contains special-token text ("<|eot_id|>", "<|im_start|>"); encode
 * it with special-token parsing on (tok_encode_ex(..., parse_special = true, ...)), and
 * with the vocab's own BOS rule (tok_add_bos): no formatter writes BOS itself.
 */
#ifndef KVS_CHAT_H
#define KVS_CHAT_H

#include <stdbool.h>
#include <stddef.h>

typedef struct {
    const char *role;    /* "system", "user", "assistant" (others are passed through) */
    const char *content; /* NUL-terminated UTF-8 */
} chat_message;

typedef enum {
    CHAT_TEMPLATE_CHATML = 0,        /* Qwen, SmolLM, ...: <|im_start|>role\n...<|im_end|>\n */
    CHAT_TEMPLATE_LLAMA3,            /* <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|> */
    CHAT_TEMPLATE_LLAMA2,            /* [INST] ... [/INST], system folded into the first turn */
    CHAT_TEMPLATE_LLAMA2_SYS,        /* [INST] <<SYS>>\n...\n<</SYS>>\n\n... [/INST] */
    CHAT_TEMPLATE_MISTRAL_V1,        /*  [INST] ... [/INST] (leading spaces) */
    CHAT_TEMPLATE_MISTRAL_V3,        /* [INST] ... [/INST] (assistant text trimmed) */
    CHAT_TEMPLATE_MISTRAL_V3_TEKKEN, /* [INST]...[/INST] (no spaces) */
    CHAT_TEMPLATE_MISTRAL_V7,        /* [SYSTEM_PROMPT] ...[/SYSTEM_PROMPT][INST] ...[/INST] */
    CHAT_TEMPLATE_ZEPHYR,            /* <|role|>\n...<|endoftext|>\n */
    CHAT_TEMPLATE_PHI3,              /* <|role|>\n...<|end|>\n */
    CHAT_TEMPLATE_GEMMA,             /* <start_of_turn>user|model\n...<end_of_turn>\n */
    CHAT_TEMPLATE_COUNT_
} chat_template;

/* Template by its name ("llama3", "chatml", "mistral-v7", ... as chat_template_name
 * gives, llama.cpp's names). KVS_OK, or KVS_ERR_NOT_FOUND (*out untouched). */
int chat_template_by_name(const char *name, chat_template *out);

/* Recognises a Jinja chat template by its distinctive substrings (llama.cpp's rules,
 * first match wins: ChatML, Mistral/Llama 2 family, Phi-3, Zephyr, Gemma, Llama 3); a
 * template name is accepted too. NULL or "" (the file has none): *out = CHATML and
 * KVS_ERR_NOT_FOUND, so a caller may use the fallback or refuse. An unrecognised
 * template: KVS_ERR_UNSUPPORTED, *out untouched. */
int chat_template_detect(const char *jinja_or_null, chat_template *out);

/* Static name of a template ("llama3"); "unknown" for an out-of-range value. */
const char *chat_template_name(chat_template t);

/* Comma-separated list of every template name (static), for help texts. */
const char *chat_template_names(void);

/* Formats msgs[0..n) with template t; add_assistant opens the assistant turn at the end.
 * On success *out is a malloc'd NUL-terminated string the caller frees. Errors (then *out
 * is NULL): KVS_ERR_INVALID_ARG (NULL out, msgs NULL with n > 0, a message with a NULL
 * role or content, t out of range), KVS_ERR_TOO_LARGE (more than 1 GiB of output),
 * KVS_ERR_NOMEM; msg says which. Roles other than system/user/assistant are written as
 * given where the template has a role slot and treated as user turns elsewhere. */
int chat_format(chat_template t, const chat_message *msgs, size_t n, bool add_assistant, char **out, char *msg,
                size_t msg_cap);

#endif /* KVS_CHAT_H */
