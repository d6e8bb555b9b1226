/* test_tokenizer_bpe — byte-level BPE (Llama 3, Qwen2, Qwen3 vocabularies of ../shared/downloads)
 * and the SentencePiece vocabularies of the same folder (Gemma 3: no space prefix; Llama 2 +
 * Phi-3's added tokens) against llama.cpp's tokenizations (ids with and without special-token parsing) and
 * detokenizations; the chat references through chat_format + chat_template_detect; the
 * end-of-generation set; an unknown pre-tokenizer's message; the wire-free array round trip. */
#include <stdbool.h>

#include <cjson/cJSON.h>

#include "chat.h"
#include "gguf.h"
#include "kvshard.h"
#include "tokenizer.h"
#include "test.h"

#define MAX_IDS 4096

/* Compares ids[0..n) with the JSON array want; prints both on a mismatch. */
static bool ids_match(const char *what, const char *text, const int32_t *ids, int n, const cJSON *want) {
    int wn = cJSON_GetArraySize(want);
    bool ok = wn == n;
    for (int i = 0; ok && i < n; i++) ok = (int32_t)cJSON_GetArrayItem(want, i)->valuedouble == ids[i];
    if (!ok) {
        fprintf(stderr, "%s mismatch for %s:\n  got ", what, text);
        for (int i = 0; i < n; i++) fprintf(stderr, "%d ", ids[i]);
        fprintf(stderr, "\n  want ");
        for (int i = 0; i < wn; i++) fprintf(stderr, "%d ", (int)cJSON_GetArrayItem(want, i)->valuedouble);
        fprintf(stderr, "\n");
    }
    return ok;
}

static char *read_text(const char *path) {
    size_t n;
    uint8_t *b = test_read_file(path, &n);
    if (!b) return NULL;
    char *s = realloc(b, n + 1);
    if (!s) {
        free(b);
        return NULL;
    }
    s[n] = 0;
    return s;
}

/* Every line of NAME-tokenizer.jsonl: ids, ids_plain, detok. Returns lines checked. */
static int check_tokenizer_ref(const tok_vocab *v, const char *path) {
    char *all = read_text(path);
    CHECK(all != NULL);
    if (!all) return 0;
    int n_lines = 0;
    int32_t *ids = malloc(MAX_IDS * sizeof *ids);
    for (char *line = strtok(all, "\n"); line; line = strtok(NULL, "\n")) {
        cJSON *j = cJSON_Parse(line);
        CHECK(j != NULL);
        if (!j) continue;
        const cJSON *jt = cJSON_GetObjectItem(j, "text");
        const char *text = cJSON_GetStringValue(jt);
        CHECK(text != NULL);
        if (!text) {
            cJSON_Delete(j);
            continue;
        }
        int n = 0;
        bool bos = tok_add_bos(v);
        CHECK_EQ_INT(tok_encode_ex(v, text, strlen(text), bos, true, ids, MAX_IDS, &n), KVS_OK);
        if (!ids_match("ids", text, ids, n, cJSON_GetObjectItem(j, "ids"))) test_failures_++;
        CHECK_EQ_INT(tok_encode_ex(v, text, strlen(text), bos, false, ids, MAX_IDS, &n), KVS_OK);
        if (!ids_match("ids_plain", text, ids, n, cJSON_GetObjectItem(j, "ids_plain"))) test_failures_++;
        /* detok is of the ids without BOS, special tokens parsed and rendered */
        CHECK_EQ_INT(tok_encode_ex(v, text, strlen(text), false, true, ids, MAX_IDS, &n), KVS_OK);
        char *d = NULL;
        size_t dl = 0;
        CHECK_EQ_INT(tok_detokenize(v, ids, (size_t)n, true, &d, &dl), KVS_OK);
        const char *want = cJSON_GetStringValue(cJSON_GetObjectItem(j, "detok"));
        if (!d || !want || dl != strlen(want) || memcmp(d, want, dl) != 0) {
            fprintf(stderr, "detok mismatch for %s:\n  got  '%s'\n  want '%s'\n", text, d ? d : "(null)",
                    want ? want : "(null)");
            test_failures_++;
        }
        free(d);
        n_lines++;
        cJSON_Delete(j);
    }
    free(ids);
    free(all);
    return n_lines;
}

/* Every line of NAME-chat.jsonl: the file's template detected and applied. */
static int check_chat_ref(const tok_vocab *v, const char *path, chat_template expect) {
    char *all = read_text(path);
    CHECK(all != NULL);
    if (!all) return 0;
    chat_template t = CHAT_TEMPLATE_COUNT_;
    CHECK_EQ_INT(chat_template_detect(tok_chat_template(v), &t), KVS_OK);
    CHECK_EQ_INT(t, expect);
    int n_lines = 0;
    for (char *line = strtok(all, "\n"); line; line = strtok(NULL, "\n")) {
        cJSON *j = cJSON_Parse(line);
        CHECK(j != NULL);
        if (!j) continue;
        const cJSON *jm = cJSON_GetObjectItem(j, "messages");
        int nm = cJSON_GetArraySize(jm);
        chat_message msgs[16];
        CHECK(nm <= 16);
        for (int i = 0; i < nm && i < 16; i++) {
            const cJSON *m = cJSON_GetArrayItem(jm, i);
            msgs[i].role = cJSON_GetStringValue(cJSON_GetObjectItem(m, "role"));
            msgs[i].content = cJSON_GetStringValue(cJSON_GetObjectItem(m, "content"));
        }
        char *out = NULL, msg[KVS_MSG_MAX] = "";
        CHECK_EQ_INT(chat_format(t, msgs, (size_t)(nm < 16 ? nm : 16), true, &out, msg, sizeof msg), KVS_OK);
        const char *want = cJSON_GetStringValue(cJSON_GetObjectItem(j, "formatted"));
        if (!out || !want || strcmp(out, want) != 0) {
            fprintf(stderr, "chat mismatch:\n  got  '%s'\n  want '%s'\n", out ? out : "(null)", want ? want : "(null)");
            test_failures_++;
        }
        free(out);
        n_lines++;
        cJSON_Delete(j);
    }
    free(all);
    return n_lines;
}

static int32_t id_of(const tok_vocab *v, const char *text) {
    int32_t ids[8];
    int n = 0;
    if (tok_encode_ex(v, text, strlen(text), false, true, ids, 8, &n) != KVS_OK || n != 1) return -1;
    return ids[0];
}

/* One downloaded model: its vocab loads in bounded time and passes its references. */
static int check_model(const char *name, tok_kind kind, chat_template tmpl, int32_t eos, const char *const *eog,
                       int n_eog) {
    char path[1024], ref[1024], rel[256];
    snprintf(rel, sizeof rel, "downloads/models/%s.gguf", name);
    if (!test_shared_path(rel, path, sizeof path)) return 0;
    gguf_ctx *g = NULL;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(gguf_open(path, &g, msg, sizeof msg), KVS_OK);
    if (!g) return 0;
    tok_vocab *v = NULL;
    int rc = tok_from_gguf(g, &v, msg, sizeof msg);
    if (rc) fprintf(stderr, "%s: %s\n", name, msg);
    CHECK_EQ_INT(rc, KVS_OK);
    gguf_close(g);
    if (!v) return 0;
    CHECK_EQ_INT(tok_vocab_kind(v), kind);
    CHECK_EQ_INT(tok_eos(v), eos);
    CHECK(tok_chat_template(v) != NULL);
    for (int i = 0; i < n_eog; i++) {
        int32_t id = id_of(v, eog[i]);
        CHECK(id >= 0);
        if (!tok_is_eog(v, id)) {
            fprintf(stderr, "%s: %s (%d) is not end-of-generation\n", name, eog[i], (int)id);
            test_failures_++;
        }
    }
    CHECK(!tok_is_eog(v, id_of(v, "Hello")));
    CHECK(!tok_is_eog(v, -1));
    CHECK(!tok_is_eog(v, tok_n_vocab(v)));

    /* A long text (the partition's prefilter path): special tokens still split it, and the
     * parts between them tokenize on their own. */
    {
        size_t alen = 6000;
        char *text = malloc(alen + 64);
        for (size_t i = 0; i < alen; i++) text[i] = "for (int i = 0; i < n; i++) x += a[i]; // sum\n"[i % 47];
        int32_t *ids = malloc(8192 * sizeof *ids), *part = malloc(8192 * sizeof *part);
        int n_all = 0, n_a = 0, n_b = 0;
        CHECK_EQ_INT(tok_encode_ex(v, text, alen, false, false, part, 8192, &n_a), KVS_OK);
        int32_t s1 = id_of(v, eog[0]);
        memcpy(text + alen, eog[0], strlen(eog[0]));
        memcpy(text + alen + strlen(eog[0]), "user", 4);
        size_t tl = alen + strlen(eog[0]) + 4;
        CHECK_EQ_INT(tok_encode_ex(v, text, tl, false, true, ids, 8192, &n_all), KVS_OK);
        int32_t user[4];
        CHECK_EQ_INT(tok_encode_ex(v, "user", 4, false, true, user, 4, &n_b), KVS_OK);
        CHECK_EQ_INT(n_all, n_a + 1 + n_b);
        CHECK(n_all == n_a + 1 + n_b && !memcmp(ids, part, (size_t)n_a * sizeof *ids) && ids[n_a] == s1 &&
              !memcmp(ids + n_a + 1, user, (size_t)n_b * sizeof *ids));
        free(text);
        free(ids);
        free(part);
    }

    snprintf(rel, sizeof rel, "downloads/reference/%s-tokenizer.jsonl", name);
    int n_lines = 0;
    if (test_shared_path(rel, ref, sizeof ref)) {
        n_lines = check_tokenizer_ref(v, ref);
        CHECK(n_lines >= 37);
    }
    snprintf(rel, sizeof rel, "downloads/reference/%s-chat.jsonl", name);
    if (test_shared_path(rel, ref, sizeof ref)) CHECK(check_chat_ref(v, ref, tmpl) >= 2);
    printf("%s: %d tokenizer lines, %d merges kept, pre '%s'\n", name, n_lines, (int)tok_n_merges(v), tok_pre_name(v));
    tok_free(v);
    return 1;
}

/* A tiny hand-made BPE vocab: merges by rank, the pre-tokenizer name check, arrays. */
static void check_synthetic(void) {
    /* byte-level texts: 'a' 'b' 'c', "Ġ" (space) = U+0120 */
    const char *texts[] = {"a", "b", "c", "\xC4\xA0", "ab", "bc", "abc", "\xC4\240a", "<|eot_id|>", "<x>"};
    uint32_t lens[10];
    for (int i = 0; i < 10; i++) lens[i] = (uint32_t)strlen(texts[i]);
    int32_t types[10] = {1, 1, 1, 1, 1, 1, 1, 1, 3, 4};
    const char *merges[] = {"b c", "a bc", "a b", "\xC4\xA0 a"};
    uint32_t mlens[4];
    for (int i = 0; i < 4; i++) mlens[i] = (uint32_t)strlen(merges[i]);
    tok_arrays a = {.n_vocab = 10, .texts = texts, .text_lens = lens, .types = types, .bos = -1, .eos = -1,
                    .unk = -1, .kind = TOK_KIND_BPE, .pre = "gpt-2", .n_merges = 4, .merges = merges,
                    .merge_lens = mlens};
    tok_vocab *v = NULL;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(tok_from_arrays(&a, &v, msg, sizeof msg), KVS_OK);
    if (v) {
        int32_t ids[16];
        int n = 0;
        /* "abc": b+c (rank 0) first, then a+bc -> abc; " ab": Ġ+a (rank 3) loses to a+b (rank 2) */
        CHECK_EQ_INT(tok_encode(v, "abc", 3, false, ids, 16, &n), KVS_OK);
        CHECK_EQ_INT(n, 1);
        CHECK_EQ_INT(ids[0], 6);
        CHECK_EQ_INT(tok_encode(v, " ab", 3, false, ids, 16, &n), KVS_OK);
        CHECK_EQ_INT(n, 2);
        CHECK_EQ_INT(ids[0], 3);
        CHECK_EQ_INT(ids[1], 4);
        /* control text only with parse_special; user-defined always */
        CHECK_EQ_INT(tok_encode_ex(v, "<|eot_id|>", 10, false, true, ids, 16, &n), KVS_OK);
        CHECK_EQ_INT(n, 1);
        CHECK_EQ_INT(ids[0], 8);
        CHECK(tok_is_eog(v, 8));
        CHECK_EQ_INT(tok_encode_ex(v, "a<x>b", 5, false, false, ids, 16, &n), KVS_OK);
        CHECK_EQ_INT(n, 3);
        CHECK_EQ_INT(ids[1], 9);
        /* a sizing call and a short buffer */
        CHECK_EQ_INT(tok_encode(v, "abcabc", 6, false, NULL, 0, &n), KVS_ERR_TOO_LARGE);
        CHECK_EQ_INT(n, 2); /* one pre-token, merged to abc + abc (no merge joins them) */
        /* the merge table round-trips through tok_merge */
        CHECK_EQ_INT(tok_n_merges(v), 4);
        int32_t l = -1, r = -1;
        CHECK(tok_merge(v, 1, &l, &r));
        CHECK_EQ_INT(l, 0);
        CHECK_EQ_INT(r, 5);
        CHECK(!tok_merge(v, 4, &l, &r));
        /* invalid UTF-8 reads as U+FFFD, which has no token here: nothing, and no failure */
        CHECK_EQ_INT(tok_encode(v, "\xFF", 1, false, ids, 16, &n), KVS_OK);
        char *d = NULL;
        size_t dl = 0;
        int32_t back[] = {3, 4, 8};
        CHECK_EQ_INT(tok_detokenize(v, back, 3, true, &d, &dl), KVS_OK);
        CHECK(d && !strcmp(d, " ab<|eot_id|>"));
        free(d);
        CHECK_EQ_INT(tok_detokenize(v, back, 3, false, &d, &dl), KVS_OK);
        CHECK(d && !strcmp(d, " ab"));
        free(d);
        tok_free(v);
    }
    /* an unknown pre-tokenizer is refused by name */
    a.pre = "bogus-pre";
    v = NULL;
    msg[0] = 0;
    CHECK_EQ_INT(tok_from_arrays(&a, &v, msg, sizeof msg), KVS_ERR_UNSUPPORTED);
    CHECK(v == NULL);
    CHECK(strstr(msg, "bogus-pre") != NULL);
    printf("unknown pre-tokenizer: %s\n", msg);
}

/* A GGUF file naming an unknown pre-tokenizer: tok_from_gguf refuses it, naming the value;
 * the same file with a known one (and add_bos_token, a template) loads. */
static void check_gguf_pre(void) {
    static const char *const toks[] = {"a", "b", "ab", "<|im_end|>"};
    static const char *const merges[] = {"a b"};
    static const int32_t types[] = {1, 1, 1, 3};
    for (int known = 0; known < 2; known++) {
        gguf_writer *w = gguf_writer_create();
        CHECK(w != NULL);
        if (!w) return;
        gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2");
        gguf_writer_set_str(w, "tokenizer.ggml.pre", known ? "qwen2" : "made-up-pre");
        gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, 4);
        gguf_writer_set_arr_i32(w, "tokenizer.ggml.token_type", types, 4);
        gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", merges, 1);
        gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", false);
        gguf_writer_set_str(w, "tokenizer.chat_template", "{{ '<|im_start|>' }}");
        char path[] = "/tmp/kvs_test_bpe_XXXXXX";
        int fd = mkstemp(path);
        CHECK(fd >= 0);
        if (fd >= 0) close(fd);
        char msg[KVS_MSG_MAX] = "";
        CHECK_EQ_INT(gguf_writer_write(w, path, msg, sizeof msg), KVS_OK);
        gguf_writer_free(w);
        gguf_ctx *g = NULL;
        tok_vocab *v = NULL;
        CHECK_EQ_INT(gguf_open(path, &g, msg, sizeof msg), KVS_OK);
        msg[0] = 0;
        int rc = g ? tok_from_gguf(g, &v, msg, sizeof msg) : KVS_ERR_IO;
        if (!known) {
            CHECK_EQ_INT(rc, KVS_ERR_UNSUPPORTED);
            CHECK(v == NULL);
            CHECK(strstr(msg, "'made-up-pre'") != NULL);
            printf("unknown pre-tokenizer in a GGUF: %s\n", msg);
        } else {
            CHECK_EQ_INT(rc, KVS_OK);
            CHECK(!tok_add_bos(v));
            CHECK(tok_is_eog(v, 3));
            chat_template t;
            CHECK_EQ_INT(chat_template_detect(tok_chat_template(v), &t), KVS_OK);
            CHECK_EQ_INT(t, CHAT_TEMPLATE_CHATML);
            int32_t ids[4];
            int n = 0;
            CHECK_EQ_INT(tok_encode(v, "ab", 2, false, ids, 4, &n), KVS_OK);
            CHECK_EQ_INT(n, 1);
            CHECK_EQ_INT(ids[0], 2);
        }
        tok_free(v);
        gguf_close(g);
        unlink(path);
    }
}

int main(void) {
    int n_run = 0, n_skipped = 0;
    check_synthetic();
    check_gguf_pre();
    n_run++;
    /* this Llama 3 vocab (3.0's) has no <|eom_id|> */
    static const char *const l3_eog[] = {"<|eot_id|>"};
    static const char *const qw_eog[] = {"<|im_end|>", "<|endoftext|>"};
    static const char *const gemma_eog[] = {"<end_of_turn>"}; /* the file's EOS; <eos> (1) is not in llama.cpp's set */
    static const char *const phi3_eog[] = {"<|end|>", "<|endoftext|>"};
    if (check_model("llama3-synth-Q4_K_M", TOK_KIND_BPE, CHAT_TEMPLATE_LLAMA3, 128009, l3_eog, 1)) n_run++;
    else n_skipped++;
    if (check_model("qwen2-synth-Q8_0", TOK_KIND_BPE, CHAT_TEMPLATE_CHATML, 151645, qw_eog, 2)) n_run++;
    else n_skipped++;
    if (check_model("qwen3-synth-Q4_K_M", TOK_KIND_BPE, CHAT_TEMPLATE_CHATML, 151645, qw_eog, 2)) n_run++;
    else n_skipped++;
    if (check_model("gemma3-synth-Q4_K_M", TOK_KIND_SPM, CHAT_TEMPLATE_GEMMA, 106, gemma_eog, 1)) n_run++;
    else n_skipped++;
    if (check_model("phi3-synth-Q4_K_M", TOK_KIND_SPM, CHAT_TEMPLATE_PHI3, 32007, phi3_eog, 2)) n_run++;
    else n_skipped++;
    return test_finish("test_tokenizer_bpe", n_run, n_skipped);
}
