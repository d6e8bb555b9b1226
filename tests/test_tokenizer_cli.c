/* test_tokenizer_cli — the text tools of the kvshard binary on the download files:
 * tokenize (with and without --plain) and detokenize against llama.cpp's references,
 * chat --format-only against the chat references, an interactive chat whose first reply
 * equals the one-shot reply, run --json and logits --top giving valid UTF-8 JSON. */
#include <stdbool.h>

#include <cjson/cJSON.h>

#include "proc.h"
#include "tokenizer.h"
#include "test.h"

static const char *errlog = "test_tokenizer_cli.stderr";

/* A sanitizer build computes a 128k-vocab head tens of times slower: fewer generations then. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define SANITIZED 1
#else
#define SANITIZED 0
#endif

static int run(char *const argv[], char **out) { return proc_run(argv, out, errlog, 120000); }

/* Runs argv with stdin from the file at in_path. */
static int run_stdin(char *const argv[], const char *in_path, char **out) {
    return proc_run_in(argv, in_path, out, errlog, 120000);
}

static bool valid_utf8(const char *s) {
    size_t n = strlen(s);
    for (size_t i = 0; i < n;) {
        int k = tok_utf8_char(s + i, n - i, NULL);
        if (k <= 0) return false;
        i += (size_t)k;
    }
    return true;
}

/* {"ids":[...]} as the tool prints it. */
static char *ids_json(const cJSON *arr) {
    size_t cap = 64 + 12 * (size_t)cJSON_GetArraySize(arr), n = 0;
    char *s = malloc(cap);
    n += (size_t)snprintf(s, cap, "{\"ids\":[");
    for (int i = 0; i < cJSON_GetArraySize(arr); i++)
        n += (size_t)snprintf(s + n, cap - n, i ? ",%d" : "%d", (int)cJSON_GetArrayItem(arr, i)->valuedouble);
    snprintf(s + n, cap - n, "]}\n");
    return s;
}

/* The file as a NUL-terminated string (test_read_file's buffer is not). */
static char *read_text(const char *path) {
    size_t n;
    uint8_t *b = test_read_file(path, &n);
    char *s = b ? realloc(b, n + 1) : NULL;
    if (!s) {
        free(b);
        return NULL;
    }
    s[n] = 0;
    return s;
}

static int check_model(const char *name) {
    char model[1024], ref[1024], chat[1024], rel[256];
    snprintf(rel, sizeof rel, "downloads/models/%s.gguf", name);
    if (!test_shared_path(rel, model, sizeof model)) return 0;
    snprintf(rel, sizeof rel, "downloads/reference/%s-tokenizer.jsonl", name);
    if (!test_shared_path(rel, ref, sizeof ref)) return 0;
    snprintf(rel, sizeof rel, "downloads/reference/%s-chat.jsonl", name);
    if (!test_shared_path(rel, chat, sizeof chat)) return 0;

    /* tokenize / detokenize: a few reference lines (each call loads the vocab) */
    char *all = read_text(ref);
    CHECK(all != NULL);
    int line_no = 0, checked = 0;
    for (char *line = all ? strtok(all, "\n") : NULL; line; line = strtok(NULL, "\n"), line_no++) {
        if (line_no != 15 && line_no != 21) continue; /* emoji; special-token text */
        cJSON *j = cJSON_Parse(line);
        const char *text = cJSON_GetStringValue(cJSON_GetObjectItem(j, "text"));
        char *out = NULL;
        char *want = ids_json(cJSON_GetObjectItem(j, "ids"));
        char *a1[] = {"kvshard", "tokenize", "-m", model, "-p", (char *)text, NULL};
        CHECK_EQ_INT(run(a1, &out), 0);
        if (!out || strcmp(out, want)) {
            fprintf(stderr, "tokenize '%s':\n  got  %s  want %s", text, out ? out : "(null)\n", want);
            test_failures_++;
        }
        free(out);
        free(want);
        want = ids_json(cJSON_GetObjectItem(j, "ids_plain"));
        char *a2[] = {"kvshard", "tokenize", "-m", model, "-p", (char *)text, "--plain", NULL};
        CHECK_EQ_INT(run(a2, &out), 0);
        if (!out || strcmp(out, want)) {
            fprintf(stderr, "tokenize --plain '%s':\n  got  %s  want %s", text, out ? out : "(null)\n", want);
            test_failures_++;
        }
        free(out);
        free(want);
        /* detokenize the ids without BOS */
        const cJSON *ids = cJSON_GetObjectItem(j, "ids");
        char list[4096] = "";
        size_t at = 0;
        int first = cJSON_GetArraySize(ids) > 0 && cJSON_GetArrayItem(ids, 0)->valuedouble == 128000 ? 1 : 0;
        for (int i = first; i < cJSON_GetArraySize(ids) && at < sizeof list - 16; i++)
            at += (size_t)snprintf(list + at, sizeof list - at, "%s%d", i > first ? "," : "",
                                   (int)cJSON_GetArrayItem(ids, i)->valuedouble);
        char *a3[] = {"kvshard", "detokenize", "-m", model, "--tokens", list, NULL};
        CHECK_EQ_INT(run(a3, &out), 0);
        cJSON *d = out ? cJSON_Parse(out) : NULL;
        const char *got = cJSON_GetStringValue(cJSON_GetObjectItem(d, "text"));
        const char *wd = cJSON_GetStringValue(cJSON_GetObjectItem(j, "detok"));
        if (!got || !wd || strcmp(got, wd)) {
            fprintf(stderr, "detokenize %s: got '%s' want '%s'\n", list, got ? got : "(null)", wd ? wd : "(null)");
            test_failures_++;
        }
        cJSON_Delete(d);
        free(out);
        cJSON_Delete(j);
        checked++;
    }
    CHECK_EQ_INT(checked, 2);
    free(all);

    /* chat --format-only on each reference conversation */
    all = read_text(chat);
    CHECK(all != NULL);
    int convs = 0;
    for (char *line = all ? strtok(all, "\n") : NULL; line; line = strtok(NULL, "\n")) {
        cJSON *j = cJSON_Parse(line);
        char path[64];
        snprintf(path, sizeof path, "test_tokenizer_cli.%d.json", convs);
        char *m = cJSON_PrintUnformatted(cJSON_GetObjectItem(j, "messages"));
        FILE *f = fopen(path, "w");
        if (f && m) fputs(m, f);
        if (f) fclose(f);
        free(m);
        char *out = NULL;
        char *a[] = {"kvshard", "chat", "-m", model, "--messages", path, "--format-only", NULL};
        CHECK_EQ_INT(run(a, &out), 0);
        const char *want = cJSON_GetStringValue(cJSON_GetObjectItem(j, "formatted"));
        if (!out || !want || strcmp(out, want)) {
            fprintf(stderr, "chat --format-only %d:\n  got  '%s'\n  want '%s'\n", convs, out ? out : "(null)",
                    want ? want : "(null)");
            test_failures_++;
        }
        free(out);
        unlink(path);
        cJSON_Delete(j);
        convs++;
    }
    CHECK(convs >= 2);
    free(all);
    return 1;
}

/* Generation on a computable file: chat turns and JSON validity. */
static int check_generation(void) {
    char model[1024];
    if (!test_shared_path("downloads/models/llama3-synth-Q4_K_M.gguf", model, sizeof model)) return 0;
    char *one = NULL, *two = NULL;
    char *a1[] = {"kvshard", "chat", "-m", model, "-p", "Hello!", "-n", "6", "--temp", "0", "-t", "2", NULL};
    int st = run(a1, &one);
    if (st != 0) { /* this file's architecture may not be computable in this build */
        fprintf(stderr, "note: chat on %s exited %d; generation checks skipped\n", model, st);
        free(one);
        return 0;
    }
    const char *in = "test_tokenizer_cli.stdin";
    FILE *f = fopen(in, "w");
    if (f) {
        fputs("Hello!\nAnd again?\n", f);
        fclose(f);
    }
    char *a2[] = {"kvshard", "chat", "-m", model, "-n", "6", "--temp", "0", "-t", "2", NULL};
    CHECK_EQ_INT(run_stdin(a2, in, &two), 0);
    unlink(in);
    /* the interactive session's first reply line is the one-shot reply */
    CHECK(one && two && valid_utf8(one) && valid_utf8(two));
    if (one && two) {
        char *nl = strchr(one, '\n');
        size_t l = nl ? (size_t)(nl - one) + 1 : strlen(one);
        CHECK(strncmp(one, two, l) == 0);
        CHECK(strchr(two + l, '\n') != NULL); /* a second reply followed */
    }
    free(one);
    free(two);

    char *out = NULL;
    char *a3[] = {"kvshard", "run", "-m", model, "-p", "Hi<|eot_id|>", "-n", "8", "--json", "-t", "2", NULL};
    CHECK_EQ_INT(run(a3, &out), 0);
    CHECK(out && valid_utf8(out));
    cJSON *j = out ? cJSON_Parse(out) : NULL;
    CHECK(j != NULL);
    const cJSON *pt = cJSON_GetObjectItem(j, "prompt_tokens");
    CHECK_EQ_INT(cJSON_GetArraySize(pt), 3); /* BOS, Hi, <|eot_id|> parsed as the token */
    if (cJSON_GetArraySize(pt) == 3) CHECK_EQ_INT(cJSON_GetArrayItem(pt, 2)->valuedouble, 128009);
    cJSON_Delete(j);
    free(out);

    char *a4[] = {"kvshard", "logits", "-m", model, "--tokens", "128000,9906,1917", "--top", "5", "-t", "2", NULL};
    CHECK_EQ_INT(run(a4, &out), 0);
    j = out ? cJSON_Parse(out) : NULL;
    CHECK(j != NULL);
    const cJSON *lt = cJSON_GetObjectItem(j, "logits_top");
    CHECK_EQ_INT(cJSON_GetArraySize(lt), 3);
    for (int i = 0; i < cJSON_GetArraySize(lt); i++) {
        const cJSON *p = cJSON_GetArrayItem(lt, i), *top = cJSON_GetObjectItem(p, "top");
        double lse = cJSON_GetObjectItem(p, "lse")->valuedouble;
        CHECK_EQ_INT(cJSON_GetArraySize(top), 5);
        double prev = 1e300;
        for (int k = 0; k < cJSON_GetArraySize(top); k++) {
            double v = cJSON_GetArrayItem(cJSON_GetArrayItem(top, k), 1)->valuedouble;
            CHECK(v <= prev);
            CHECK(v <= lse);
            prev = v;
        }
    }
    cJSON_Delete(j);
    free(out);
    return 1;
}

/* A 2-shard route of a download file: an interactive chat over --route (its vocab, merges
 * and template fetched from the head shard) prints exactly what the local chat prints. */
static int check_route_chat(const char *rel) {
    char model[1024];
    if (!test_shared_path(rel, model, sizeof model)) return 0;
    const char *in = "test_tokenizer_cli.route.stdin";
    FILE *f = fopen(in, "w");
    if (f) {
        fputs("Hello!\nAnd again?\n", f);
        fclose(f);
    }
    char *local = NULL, *remote = NULL;
    char *a1[] = {"kvshard", "chat", "-m", model, "-n", "6", "--temp", "0", "-t", "2", "--system", "Be brief.", NULL};
    if (run_stdin(a1, in, &local) != 0) {
        fprintf(stderr, "note: chat on %s failed; the route chat check is skipped\n", model);
        free(local);
        unlink(in);
        return 0;
    }
    proc_server s[2] = {{0}};
    bool ok = proc_start_server(&s[0], ".", model, "0:1", NULL);
    ok = ok && proc_start_server(&s[1], ".", model, "1:2", NULL);
    CHECK(ok);
    if (ok) {
        char route[128];
        snprintf(route, sizeof route, "127.0.0.1:%d,127.0.0.1:%d", s[0].port, s[1].port);
        char *a2[] = {"kvshard", "chat", "--route", route, "-n", "6", "--temp", "0", "--system", "Be brief.", NULL};
        CHECK_EQ_INT(run_stdin(a2, in, &remote), 0);
        if (!local || !remote || strcmp(local, remote)) {
            fprintf(stderr, "route chat differs:\n  local  '%s'\n  remote '%s'\n", local ? local : "(null)",
                    remote ? remote : "(null)");
            test_failures_++;
        }
    }
    for (int i = 0; i < 2; i++) proc_stop_server(&s[i]);
    free(local);
    free(remote);
    unlink(in);
    return 1;
}

/* run --json on a stories-vocab file: its byte tokens cut characters; JSON must stay valid. */
static int check_stories_json(void) {
    char model[1024];
    if (!test_shared_path("downloads/models/synth-Q5_1.gguf", model, sizeof model)) return 0;
    char *out = NULL;
    char *a[] = {"kvshard", "run", "-m", model, "-p", "Once upon a time", "-n", "48", "--json", "-t", "2", NULL};
    int st = run(a, &out);
    if (st != 0) {
        fprintf(stderr, "note: run on %s exited %d; its JSON check is skipped\n", model, st);
        free(out);
        return 0;
    }
    CHECK(out && valid_utf8(out));
    cJSON *j = out ? cJSON_Parse(out) : NULL;
    CHECK(j && cJSON_GetStringValue(cJSON_GetObjectItem(j, "text")));
    cJSON_Delete(j);
    free(out);
    return 1;
}

int main(void) {
    int n_run = 0, n_skipped = 0;
    unlink(errlog);
    if (check_model("llama3-synth-Q4_K_M")) n_run++;
    else n_skipped++;
    if (check_model("qwen2-synth-Q8_0")) n_run++;
    else n_skipped++;
    if (check_generation()) n_run++;
    else n_skipped++;
    if (check_route_chat("downloads/models/llama3-synth-Q4_K_M.gguf")) n_run++;
    else n_skipped++;
    if (SANITIZED) printf("note: sanitizer build: the Qwen2 route chat check runs in the release build only\n");
    else if (check_route_chat("downloads/models/qwen2-synth-Q8_0.gguf")) n_run++;
    else n_skipped++;
    if (check_stories_json()) n_run++;
    else n_skipped++;
    return test_finish("test_tokenizer_cli", n_run, n_skipped);
}
