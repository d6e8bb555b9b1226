/* test_chat — chat templates: recognition of the Jinja templates real files carry (by
 * their distinctive substrings, as llama.cpp) and each built-in formatter's exact output
 * for one conversation (system, user, assistant, user; assistant turn opened). */
#include <stdbool.h>

#include "chat.h"
#include "test.h"

static const chat_message CONV[] = {
    {"system", "You are terse."},
    {"user", "Hi"},
    {"assistant", " Hello! "},
    {"user", "Bye"},
};

typedef struct {
    chat_template t;
    const char *name;
    const char *want; /* CONV formatted, assistant turn opened */
} case_t;

static const case_t CASES[] = {
    {CHAT_TEMPLATE_CHATML, "chatml",
     "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n Hello! "
     "<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"},
    {CHAT_TEMPLATE_LLAMA3, "llama3",
     "<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|><|start_header_id|>user<|end_header_id|>"
     "\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>user<|"
     "end_header_id|>\n\nBye<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"},
    {CHAT_TEMPLATE_LLAMA2, "llama2", "[INST] You are terse.\nHi [/INST] Hello! </s>[INST] Bye [/INST]"},
    {CHAT_TEMPLATE_LLAMA2_SYS, "llama2-sys",
     "[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHi [/INST] Hello! </s>[INST] Bye [/INST]"},
    {CHAT_TEMPLATE_MISTRAL_V1, "mistral-v1", " [INST] You are terse.\n\nHi [/INST]  Hello! </s> [INST] Bye [/INST]"},
    {CHAT_TEMPLATE_MISTRAL_V3, "mistral-v3", "[INST] You are terse.\n\nHi[/INST] Hello!</s>[INST] Bye[/INST]"},
    {CHAT_TEMPLATE_MISTRAL_V3_TEKKEN, "mistral-v3-tekken", "[INST]You are terse.\n\nHi[/INST] Hello! </s>[INST]Bye[/INST]"},
    {CHAT_TEMPLATE_MISTRAL_V7, "mistral-v7",
     "[SYSTEM_PROMPT] You are terse.[/SYSTEM_PROMPT][INST] Hi[/INST]  Hello! </s>[INST] Bye[/INST]"},
    {CHAT_TEMPLATE_ZEPHYR, "zephyr",
     "<|system|>\nYou are terse.<|endoftext|>\n<|user|>\nHi<|endoftext|>\n<|assistant|>\n Hello! <|endoftext|>\n<|user|>"
     "\nBye<|endoftext|>\n<|assistant|>\n"},
    {CHAT_TEMPLATE_PHI3, "phi3",
     "<|system|>\nYou are terse.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n Hello! <|end|>\n<|user|>\nBye<|end|>\n"
     "<|assistant|>\n"},
    {CHAT_TEMPLATE_GEMMA, "gemma",
     "<start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>"
     "user\nBye<end_of_turn>\n<start_of_turn>model\n"},
};

/* Fragments of real templates (the parts detection keys on) and what they must give. */
typedef struct {
    const char *jinja;
    chat_template want;
} detect_t;

static const detect_t DETECT[] = {
    {"{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
     "'\\n'}}{% endfor %}",
     CHAT_TEMPLATE_CHATML},
    {"{{- bos_token }}{%- set date_string = \"26 Jul 2024\" %}{{- '<|start_header_id|>' + message['role'] + "
     "'<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}",
     CHAT_TEMPLATE_LLAMA3},
    {"{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] "
     "+ ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% endif %}{% endfor %}",
     CHAT_TEMPLATE_LLAMA2},
    {"{% if messages[0]['role'] == 'system' %}<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n[INST]",
     CHAT_TEMPLATE_LLAMA2_SYS},
    {"{%- if system_message is defined %}{{- ' [INST] ' + system_message + '\\n\\n' }}[INST]", CHAT_TEMPLATE_MISTRAL_V1},
    {"{%- for message in loop_messages %}{{- '[AVAILABLE_TOOLS] [' }}{{- '[INST] ' + message['content'] + '[/INST]' }}",
     CHAT_TEMPLATE_MISTRAL_V3},
    {"{{- \"[AVAILABLE_TOOLS][\" }}{{- \"[INST]\" + message[\"content\"] + \"[/INST]\" }}", CHAT_TEMPLATE_MISTRAL_V3_TEKKEN},
    {"{{- '[SYSTEM_PROMPT] ' + system_message + '[/SYSTEM_PROMPT]' }}{{- '[INST] ' + message['content'] + '[/INST]' }}",
     CHAT_TEMPLATE_MISTRAL_V7},
    {"{% for message in messages %}{% if message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + "
     "'<|end|>\\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}",
     CHAT_TEMPLATE_PHI3},
    {"{% for message in messages %}{% if message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + eos_token "
     "}}{% endif %}{% endfor %}<|endoftext|>",
     CHAT_TEMPLATE_ZEPHYR},
    {"{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + "
     "'<end_of_turn>\\n' }}{% endfor %}",
     CHAT_TEMPLATE_GEMMA},
    {"mistral-v7", CHAT_TEMPLATE_MISTRAL_V7}, /* a name is accepted too */
};

int main(void) {
    char msg[KVS_MSG_MAX];
    CHECK_EQ_INT(sizeof CASES / sizeof CASES[0], CHAT_TEMPLATE_COUNT_);
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        const case_t *c = &CASES[i];
        CHECK(!strcmp(chat_template_name(c->t), c->name));
        chat_template t = CHAT_TEMPLATE_COUNT_;
        CHECK_EQ_INT(chat_template_by_name(c->name, &t), KVS_OK);
        CHECK_EQ_INT(t, c->t);
        char *out = NULL;
        CHECK_EQ_INT(chat_format(c->t, CONV, 4, true, &out, msg, sizeof msg), KVS_OK);
        if (!out || strcmp(out, c->want) != 0) {
            fprintf(stderr, "%s:\n  got  '%s'\n  want '%s'\n", c->name, out ? out : "(null)", c->want);
            test_failures_++;
        }
        free(out);
        /* no messages: "" or just the opened turn, never a failure */
        CHECK_EQ_INT(chat_format(c->t, NULL, 0, false, &out, msg, sizeof msg), KVS_OK);
        CHECK(out != NULL);
        free(out);
    }
    for (size_t i = 0; i < sizeof DETECT / sizeof DETECT[0]; i++) {
        chat_template t = CHAT_TEMPLATE_COUNT_;
        CHECK_EQ_INT(chat_template_detect(DETECT[i].jinja, &t), KVS_OK);
        if (t != DETECT[i].want) {
            fprintf(stderr, "detect %zu: got %s, want %s\n", i, chat_template_name(t), chat_template_name(DETECT[i].want));
            test_failures_++;
        }
    }
    /* no template: ChatML as the fallback, said by NOT_FOUND; an unknown one: UNSUPPORTED */
    chat_template t = CHAT_TEMPLATE_GEMMA;
    CHECK_EQ_INT(chat_template_detect(NULL, &t), KVS_ERR_NOT_FOUND);
    CHECK_EQ_INT(t, CHAT_TEMPLATE_CHATML);
    t = CHAT_TEMPLATE_GEMMA;
    CHECK_EQ_INT(chat_template_detect("{{ messages }}", &t), KVS_ERR_UNSUPPORTED);
    CHECK_EQ_INT(t, CHAT_TEMPLATE_GEMMA);
    CHECK_EQ_INT(chat_template_by_name("nope", &t), KVS_ERR_NOT_FOUND);
    CHECK(!strcmp(chat_template_name((chat_template)99), "unknown"));
    /* bad arguments */
    char *out = (char *)1;
    chat_message bad = {"user", NULL};
    CHECK_EQ_INT(chat_format(CHAT_TEMPLATE_CHATML, &bad, 1, true, &out, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    CHECK(out == NULL);
    CHECK_EQ_INT(chat_format((chat_template)99, CONV, 1, true, &out, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    CHECK_EQ_INT(chat_format(CHAT_TEMPLATE_CHATML, CONV, 1, true, NULL, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    return test_finish("test_chat", 1, 0);
}
