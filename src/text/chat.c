/*
 * chat — built-in chat formatters and template recognition.
 *
 * Design notes
 *  1. Recognition follows llama.cpp's llm_chat_detect_template: a fixed order of
 *     substring tests over the Jinja text, first match wins. The order matters: ChatML
 *     ("<|im_start|>") is tested before everything else, the Mistral / Llama 2 family
 *     ("[INST]") before Phi-3 and Zephyr (their tags also appear in some Mistral
 *     templates), Llama 3 last.
 *  2. Each formatter writes exactly what llama.cpp's llm_chat_apply_template writes for
 *     that template (its trims included: Llama 3 and Gemma trim every content, Mistral
 *     v3 trims assistant contents), so a prompt formatted here tokenizes to the same ids.
 *  3. Output goes through one growing buffer (sb_*); its first failure (no memory, over
 *     CHAT_MAX_OUTPUT) sticks and is reported once at the end.
 */
#include "chat.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

#define CHAT_MAX_OUTPUT (1u << 30)

static const char *const template_names[CHAT_TEMPLATE_COUNT_] = {
    [CHAT_TEMPLATE_CHATML] = "chatml",
    [CHAT_TEMPLATE_LLAMA3] = "llama3",
    [CHAT_TEMPLATE_LLAMA2] = "llama2",
    [CHAT_TEMPLATE_LLAMA2_SYS] = "llama2-sys",
    [CHAT_TEMPLATE_MISTRAL_V1] = "mistral-v1",
    [CHAT_TEMPLATE_MISTRAL_V3] = "mistral-v3",
    [CHAT_TEMPLATE_MISTRAL_V3_TEKKEN] = "mistral-v3-tekken",
    [CHAT_TEMPLATE_MISTRAL_V7] = "mistral-v7",
    [CHAT_TEMPLATE_ZEPHYR] = "zephyr",
    [CHAT_TEMPLATE_PHI3] = "phi3",
    [CHAT_TEMPLATE_GEMMA] = "gemma",
};

const char *chat_template_name(chat_template t) {
    return (unsigned)t < CHAT_TEMPLATE_COUNT_ ? template_names[t] : "unknown";
}

const char *chat_template_names(void) {
    return "chatml, llama3, llama2, llama2-sys, mistral-v1, mistral-v3, mistral-v3-tekken, mistral-v7, zephyr, "
           "phi3, gemma";
}

int chat_template_by_name(const char *name, chat_template *out) {
    if (!name || !out) return KVS_ERR_NOT_FOUND;
    for (int i = 0; i < CHAT_TEMPLATE_COUNT_; i++)
        if (!strcmp(name, template_names[i])) {
            *out = (chat_template)i;
            return KVS_OK;
        }
    return KVS_ERR_NOT_FOUND;
}

static bool has(const char *s, const char *needle) { return strstr(s, needle) != NULL; }

int chat_template_detect(const char *t, chat_template *out) {
    if (!out) return KVS_ERR_INVALID_ARG;
    if (!t || !t[0]) {
        *out = CHAT_TEMPLATE_CHATML;
        return KVS_ERR_NOT_FOUND;
    }
    if (chat_template_by_name(t, out) == KVS_OK) return KVS_OK;
    chat_template r;
    if (has(t, "<|im_start|>")) {
        r = CHAT_TEMPLATE_CHATML;
    } else if (!strncmp(t, "mistral", 7) || has(t, "[INST]")) {
        if (has(t, "[SYSTEM_PROMPT]")) r = CHAT_TEMPLATE_MISTRAL_V7;
        else if (has(t, "' [INST] ' + system_message") || has(t, "[AVAILABLE_TOOLS]")) {
            if (has(t, " [INST]")) r = CHAT_TEMPLATE_MISTRAL_V1;
            else if (has(t, "\"[INST]\"")) r = CHAT_TEMPLATE_MISTRAL_V3_TEKKEN;
            else r = CHAT_TEMPLATE_MISTRAL_V3;
        } else {
            r = has(t, "<<SYS>>") ? CHAT_TEMPLATE_LLAMA2_SYS : CHAT_TEMPLATE_LLAMA2;
        }
    } else if (has(t, "<|assistant|>") && has(t, "<|end|>")) {
        r = CHAT_TEMPLATE_PHI3;
    } else if (has(t, "<|user|>") && has(t, "<|endoftext|>")) {
        r = CHAT_TEMPLATE_ZEPHYR;
    } else if (has(t, "<start_of_turn>")) {
        r = CHAT_TEMPLATE_GEMMA;
    } else if (has(t, "<|start_header_id|>") && has(t, "<|end_header_id|>")) {
        r = CHAT_TEMPLATE_LLAMA3;
    } else {
        return KVS_ERR_UNSUPPORTED;
    }
    *out = r;
    return KVS_OK;
}

/* ---- output buffer (design note 3) ---- */

typedef struct {
    char *p;
    size_t n, cap;
    int err; /* first failure, sticky */
} sb;

static void sb_put(sb *b, const char *s, size_t n) {
    if (b->err) return;
    if (n > CHAT_MAX_OUTPUT - b->n) {
        b->err = KVS_ERR_TOO_LARGE;
        return;
    }
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *q = realloc(b->p, cap);
        if (!q) {
            b->err = KVS_ERR_NOMEM;
            return;
        }
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void sb_str(sb *b, const char *s) { sb_put(b, s, strlen(s)); }

static bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

/* s without leading and trailing ASCII whitespace (C isspace in the "C" locale). */
static void sb_trimmed(sb *b, const char *s) {
    size_t n = strlen(s), i = 0;
    while (i < n && is_space(s[i])) i++;
    while (n > i && is_space(s[n - 1])) n--;
    sb_put(b, s + i, n - i);
}

static bool role_is(const chat_message *m, const char *r) { return !strcmp(m->role, r); }

/* ---- formatters (design note 2) ---- */

static void fmt_chatml(sb *b, const chat_message *m, size_t n, bool add_ass) {
    for (size_t i = 0; i < n; i++) {
        sb_str(b, "<|im_start|>");
        sb_str(b, m[i].role);
        sb_str(b, "\n");
        sb_str(b, m[i].content);
        sb_str(b, "<|im_end|>\n");
    }
    if (add_ass) sb_str(b, "<|im_start|>assistant\n");
}

static void fmt_llama3(sb *b, const chat_message *m, size_t n, bool add_ass) {
    for (size_t i = 0; i < n; i++) {
        sb_str(b, "<|start_header_id|>");
        sb_str(b, m[i].role);
        sb_str(b, "<|end_header_id|>\n\n");
        sb_trimmed(b, m[i].content);
        sb_str(b, "<|eot_id|>");
    }
    if (add_ass) sb_str(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

static void fmt_llama2(sb *b, const chat_message *m, size_t n, bool with_sys) {
    bool inside = true; /* the first [INST] is written up front (BOS comes from the tokenizer) */
    sb_str(b, "[INST] ");
    for (size_t i = 0; i < n; i++) {
        if (!inside) {
            inside = true;
            sb_str(b, "[INST] ");
        }
        if (role_is(&m[i], "system")) {
            if (with_sys) {
                sb_str(b, "<<SYS>>\n");
                sb_str(b, m[i].content);
                sb_str(b, "\n<</SYS>>\n\n");
            } else {
                sb_str(b, m[i].content);
                sb_str(b, "\n");
            }
        } else if (role_is(&m[i], "assistant")) {
            sb_str(b, m[i].content);
            sb_str(b, "</s>");
            inside = false;
        } else {
            sb_str(b, m[i].content);
            sb_str(b, " [/INST]");
        }
    }
}

static void fmt_mistral(sb *b, chat_template t, const chat_message *m, size_t n) {
    const char *lead = t == CHAT_TEMPLATE_MISTRAL_V1 ? " " : "";
    const char *trail = t == CHAT_TEMPLATE_MISTRAL_V3_TEKKEN ? "" : " ";
    bool trim_assistant = t == CHAT_TEMPLATE_MISTRAL_V3, inside = false;
    for (size_t i = 0; i < n; i++) {
        if (!inside) {
            sb_str(b, lead);
            sb_str(b, "[INST]");
            sb_str(b, trail);
            inside = true;
        }
        if (role_is(&m[i], "system")) {
            sb_str(b, m[i].content);
            sb_str(b, "\n\n");
        } else if (role_is(&m[i], "assistant")) {
            sb_str(b, trail);
            if (trim_assistant) sb_trimmed(b, m[i].content);
            else sb_str(b, m[i].content);
            sb_str(b, "</s>");
            inside = false;
        } else {
            sb_str(b, m[i].content);
            sb_str(b, lead);
            sb_str(b, "[/INST]");
        }
    }
}

static void fmt_mistral_v7(sb *b, const chat_message *m, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (role_is(&m[i], "system")) {
            sb_str(b, "[SYSTEM_PROMPT] ");
            sb_str(b, m[i].content);
            sb_str(b, "[/SYSTEM_PROMPT]");
        } else if (role_is(&m[i], "assistant")) {
            sb_str(b, " ");
            sb_str(b, m[i].content);
            sb_str(b, "</s>");
        } else {
            sb_str(b, "[INST] ");
            sb_str(b, m[i].content);
            sb_str(b, "[/INST]");
        }
    }
}

/* Zephyr and Phi-3: <|role|>\ncontent END\n, then <|assistant|>\n. */
static void fmt_tagged(sb *b, const chat_message *m, size_t n, bool add_ass, const char *end) {
    for (size_t i = 0; i < n; i++) {
        sb_str(b, "<|");
        sb_str(b, m[i].role);
        sb_str(b, "|>\n");
        sb_str(b, m[i].content);
        sb_str(b, end);
        sb_str(b, "\n");
    }
    if (add_ass) sb_str(b, "<|assistant|>\n");
}

static void fmt_gemma(sb *b, const chat_message *m, size_t n, bool add_ass) {
    /* Gemma has no system turn: the system text opens the next user turn. */
    sb sys = {0};
    for (size_t i = 0; i < n; i++) {
        if (role_is(&m[i], "system")) {
            sb_trimmed(&sys, m[i].content);
            if (sys.err) b->err = sys.err;
            continue;
        }
        bool model_turn = role_is(&m[i], "assistant");
        sb_str(b, "<start_of_turn>");
        sb_str(b, model_turn ? "model" : m[i].role);
        sb_str(b, "\n");
        if (sys.n > 0 && !model_turn) {
            sb_put(b, sys.p, sys.n);
            sb_str(b, "\n\n");
            sys.n = 0;
        }
        sb_trimmed(b, m[i].content);
        sb_str(b, "<end_of_turn>\n");
    }
    free(sys.p);
    if (add_ass) sb_str(b, "<start_of_turn>model\n");
}

int chat_format(chat_template t, const chat_message *msgs, size_t n, bool add_assistant, char **out, char *msg,
                size_t msg_cap) {
    if (!out) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "out is NULL");
    *out = NULL;
    if (!msgs && n > 0) return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "messages are NULL");
    if ((unsigned)t >= CHAT_TEMPLATE_COUNT_)
        return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "unknown chat template %d", (int)t);
    for (size_t i = 0; i < n; i++)
        if (!msgs[i].role || !msgs[i].content)
            return kvs_fail(msg, msg_cap, KVS_ERR_INVALID_ARG, "message %zu has no %s", i,
                            msgs[i].role ? "content" : "role");
    sb b = {0};
    switch (t) {
    case CHAT_TEMPLATE_CHATML: fmt_chatml(&b, msgs, n, add_assistant); break;
    case CHAT_TEMPLATE_LLAMA3: fmt_llama3(&b, msgs, n, add_assistant); break;
    case CHAT_TEMPLATE_LLAMA2: fmt_llama2(&b, msgs, n, false); break;
    case CHAT_TEMPLATE_LLAMA2_SYS: fmt_llama2(&b, msgs, n, true); break;
    case CHAT_TEMPLATE_MISTRAL_V1:
    case CHAT_TEMPLATE_MISTRAL_V3:
    case CHAT_TEMPLATE_MISTRAL_V3_TEKKEN: fmt_mistral(&b, t, msgs, n); break;
    case CHAT_TEMPLATE_MISTRAL_V7: fmt_mistral_v7(&b, msgs, n); break;
    case CHAT_TEMPLATE_ZEPHYR: fmt_tagged(&b, msgs, n, add_assistant, "<|endoftext|>"); break;
    case CHAT_TEMPLATE_PHI3: fmt_tagged(&b, msgs, n, add_assistant, "<|end|>"); break;
    case CHAT_TEMPLATE_GEMMA: fmt_gemma(&b, msgs, n, add_assistant); break;
    default: break;
    }
    if (!b.err && !b.p) sb_put(&b, "", 0); /* an empty conversation is "" */
    if (b.err) {
        free(b.p);
        return kvs_fail(msg, msg_cap, b.err, "formatting the chat: %s", kvs_strerror(b.err));
    }
    *out = b.p;
    return KVS_OK;
}
