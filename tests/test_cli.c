/*
 * The CLI as a user meets it: exit codes and messages for bad invocations,
 * `run --json` (one object, the reference continuation), `logits` (every
 * position's full logits, matching llama.cpp's), `inspect`, `--help`.
 */
#include <cjson/cJSON.h>
#include <math.h>

#include "proc.h"
#include "test.h"

static char g_dir[64];

static int cli(const char *const *args, char **out) {
    char errlog[128];
    snprintf(errlog, sizeof(errlog), "%s/err.log", g_dir);
    unlink(errlog);
    return proc_run_args(args, out, errlog, 120000);
}

static bool err_log_has(const char *text) {
    char path[128], line[1024];
    snprintf(path, sizeof(path), "%s/err.log", g_dir);
    FILE *f = fopen(path, "r");
    bool found = false;
    while (f && fgets(line, sizeof(line), f))
        if (strstr(line, text)) found = true;
    if (f) fclose(f);
    return found;
}

static void expect_exit(const char *const *args, int code, const char *text) {
    char *out = NULL;
    int st = cli(args, &out);
    CHECK_EQ_INT(st, code);
    if (text && !err_log_has(text)) {
        fprintf(stderr, "stderr of '%s %s' lacks '%s'\n", args[0], args[1] ? args[1] : "", text);
        test_failures_++;
    }
    free(out);
}

int main(void) {
    snprintf(g_dir, sizeof(g_dir), "/tmp/kvs-cli-XXXXXX");
    CHECK(mkdtemp(g_dir) != NULL);
    const char *none[] = {NULL};
    expect_exit(none, 2, "usage");
    const char *bad_cmd[] = {"frobnicate", NULL};
    expect_exit(bad_cmd, 2, "unknown command");
    const char *no_model[] = {"run", "-p", "hi", NULL};
    expect_exit(no_model, 2, "-m MODEL");
    const char *missing[] = {"run", "-m", "/nonexistent.gguf", "-p", "hi", NULL};
    expect_exit(missing, 1, "/nonexistent.gguf");
    const char *bad_n[] = {"run", "-m", "x.gguf", "-p", "hi", "-n", "lots", NULL};
    expect_exit(bad_n, 2, "-n");
    const char *bad_layers[] = {"serve", "-m", "x.gguf", "--layers", "3", NULL};
    expect_exit(bad_layers, 2, "--layers");
    const char *bad_budget[] = {"serve", "-m", "x.gguf", "--layers", "0:1", "--kv-budget", "12Q", NULL};
    expect_exit(bad_budget, 2, "--kv-budget");
    const char *bad_isa[] = {"bench", "-m", "x.gguf", "--isa", "sse9", NULL};
    expect_exit(bad_isa, 2, "--isa sse9");
    const char *no_isa[] = {"bench", "-m", "x.gguf", "--isa", NULL};
    expect_exit(no_isa, 2, "--isa");
    const char *no_shard[] = {"stats", "127.0.0.1:1", NULL};
    expect_exit(no_shard, 1, "127.0.0.1:1");
    const char *bad_shape[] = {"mkmodel", "-o", "/tmp/never.gguf", "--shape", "huge", "--type", "f32", NULL};
    char *out = NULL;
    CHECK(cli(bad_shape, &out) != 0);
    free(out);
    const char *cmds[] = {"run", "logits", "bench", "inspect", "mkmodel", "serve", "generate", "stats"};
    for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++) {
        const char *help[] = {cmds[i], "--help", NULL};
        CHECK_EQ_INT(cli(help, &out), 0);
        CHECK(strstr(out, "usage: kvshard") != NULL);
        free(out);
    }

    int skipped = 0;
    char mbuf[1024], rbuf[1024];
    const char *model = test_shared_path("models/stories260K.gguf", mbuf, sizeof(mbuf));
    const char *ref = test_shared_path("reference/stories260K-F32.jsonl", rbuf, sizeof(rbuf));
    if (!model || !ref) {
        skipped++;
    } else {
        /* The first reference line: tokens, logits. */
        FILE *f = fopen(ref, "r");
        char *line = NULL;
        size_t cap = 0;
        CHECK(f && getline(&line, &cap, f) > 0);
        if (f) fclose(f);
        cJSON *rj = cJSON_Parse(line);
        free(line);
        cJSON *rtok = cJSON_GetObjectItem(rj, "tokens"), *rlog = cJSON_GetObjectItem(rj, "logits");
        int n_prompt = (int)cJSON_GetNumberValue(cJSON_GetObjectItem(rj, "n_prompt"));

        /* run --json: exactly one object; the greedy continuation begins as llama.cpp's. */
        const char *run[] = {"run", "-m", model, "-p", "Once upon a time", "-n", "8", "--temp", "0", "--json", NULL};
        CHECK_EQ_INT(cli(run, &out), 0);
        cJSON *o = cJSON_Parse(out);
        CHECK(o != NULL);
        CHECK(out[strlen(out) - 1] == '\n' && strchr(out, '\n') == out + strlen(out) - 1);
        cJSON *pt = cJSON_GetObjectItem(o, "prompt_tokens"), *gen = cJSON_GetObjectItem(o, "generated");
        CHECK_EQ_INT(cJSON_GetArraySize(pt), n_prompt);
        for (int i = 0; i < n_prompt; i++)
            CHECK_EQ_INT(cJSON_GetNumberValue(cJSON_GetArrayItem(pt, i)), cJSON_GetNumberValue(cJSON_GetArrayItem(rtok, i)));
        CHECK_EQ_INT(cJSON_GetArraySize(gen), 8);
        for (int i = 0; i < 4; i++) /* well before the first near-tie of this line */
            CHECK_EQ_INT(cJSON_GetNumberValue(cJSON_GetArrayItem(gen, i)),
                         cJSON_GetNumberValue(cJSON_GetArrayItem(rtok, n_prompt + i)));
        CHECK(cJSON_IsString(cJSON_GetObjectItem(o, "text")));
        cJSON_Delete(o);
        free(out);

        /* bench --isa scalar: runs the scalar kernels and says so, whatever the CPU's best;
         * --paired 3: three more steps, each with its probe pass, and their medians. */
        const char *bs[] = {"bench", "-m", model, "-p", "4", "-n", "2", "-t", "1", "--isa", "scalar", "--paired", "3", NULL};
        CHECK_EQ_INT(cli(bs, &out), 0);
        o = cJSON_Parse(out);
        CHECK(o != NULL);
        CHECK(cJSON_IsString(cJSON_GetObjectItem(o, "isa")) && !strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(o, "isa")), "scalar"));
        CHECK(strstr(out, "\"f32\":\"scalar") != NULL);
        CHECK_EQ_INT(cJSON_GetNumberValue(cJSON_GetObjectItem(o, "paired")), 3);
        CHECK(cJSON_GetNumberValue(cJSON_GetObjectItem(o, "decode_roofline_paired")) > 0);
        CHECK(cJSON_GetNumberValue(cJSON_GetObjectItem(o, "paired_bw_gbs")) > 0);
        CHECK(cJSON_GetNumberValue(cJSON_GetObjectItem(o, "paired_step_ms")) > 0);
        /* the paired steps' KV is counted: held bytes stay under one block over the need */
        CHECK(cJSON_IsTrue(cJSON_GetObjectItem(o, "kv_waste_under_one_block_per_session")));
        cJSON_Delete(o);
        free(out);

        /* logits --tokens: every position, full vocab, within the F32 bound of llama.cpp's. */
        const char *lg[] = {"logits", "-m", model, "--tokens", "1,403,407,261,378", NULL};
        CHECK_EQ_INT(cli(lg, &out), 0);
        o = cJSON_Parse(out);
        CHECK(o != NULL);
        cJSON *rows = cJSON_GetObjectItem(o, "logits");
        CHECK_EQ_INT(cJSON_GetArraySize(cJSON_GetObjectItem(o, "tokens")), 5);
        CHECK_EQ_INT(cJSON_GetArraySize(rows), 5);
        double max_diff = 0;
        for (int i = 0; i < 5 && i < cJSON_GetArraySize(rows); i++) {
            cJSON *row = cJSON_GetArrayItem(rows, i), *rrow = cJSON_GetArrayItem(rlog, i);
            CHECK_EQ_INT(cJSON_GetArraySize(row), 512);
            for (int j = 0; j < 512; j++) {
                double d = fabs(cJSON_GetNumberValue(cJSON_GetArrayItem(row, j)) - cJSON_GetNumberValue(cJSON_GetArrayItem(rrow, j)));
                if (d > max_diff) max_diff = d;
            }
        }
        printf("logits CLI vs llama.cpp, 5 positions: max |diff| %.4f\n", max_diff);
        CHECK(max_diff <= 0.1);
        cJSON_Delete(o);
        free(out);
        /* logits -p tokenizes with BOS. */
        const char *lp[] = {"logits", "-m", model, "-p", "Once upon a time", NULL};
        CHECK_EQ_INT(cli(lp, &out), 0);
        CHECK(strncmp(out, "{\"tokens\":[1,403,407,261,378],\"logits\":[[", 41) == 0);
        free(out);
        const char *bad_tok[] = {"logits", "-m", model, "--tokens", "1,99999", NULL};
        expect_exit(bad_tok, 1, "outside the vocabulary");
        cJSON_Delete(rj);

        /* inspect: metadata lines and the tensor table. */
        const char *insp[] = {"inspect", model, NULL};
        CHECK_EQ_INT(cli(insp, &out), 0);
        CHECK(strstr(out, "general.architecture = \"llama\"") != NULL);
        CHECK(strstr(out, "llama.block_count = 5") != NULL);
        CHECK(strstr(out, "blk.4.ffn_down.weight") != NULL);
        free(out);
    }
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", g_dir);
    if (system(cmd) != 0) fprintf(stderr, "note: could not remove %s\n", g_dir);
    return test_finish("test_cli", 1, skipped);
}
