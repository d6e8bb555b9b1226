/*
 * test_http_js — `kvshard api` driven by real clients: the official `openai` npm package
 * (tests/js/openai_test.mjs) against `kvshard api -m` and `kvshard api --route` over two shards,
 * and the chat page in headless Chromium through playwright-core (tests/js/page_test.mjs),
 * which saves a screenshot as BUILD/http_page.png.
 *
 * The same openai checks run on the Llama 3 real-format file (downloads/llama3-synth-Q4_K_M)
 * when it is present: chat text equal to `kvshard chat --messages`, one process and a 2-shard route.
 *
 * The npm packages are installed at test time into BUILD/js (tests/js/package.json, pinned
 * versions; node_modules is never committed). Without node/npm, or when the registry cannot be
 * reached, the test says so and exits 77; without Chromium the page part is skipped with a note.
 * Sanitizer builds skip it (the release build runs it; test_http covers the server there).
 */
#include <libgen.h>
#include <sys/stat.h>

#include "proc.h"
#include "test.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KVS_SANITIZED 1
#else
#define KVS_SANITIZED 0
#endif

static bool have_cmd(const char *name) {
    char cmd[256];
    snprintf(cmd, sizeof cmd, "command -v %s >/dev/null 2>&1", name);
    return system(cmd) == 0;
}

static bool copy_file(const char *from, const char *to) {
    size_t n = 0;
    uint8_t *b = test_read_file(from, &n);
    if (!b) return false;
    FILE *f = fopen(to, "wb");
    bool ok = f && fwrite(b, 1, n, f) == n;
    if (f) fclose(f);
    free(b);
    return ok;
}

static bool same_file(const char *a, const char *b) {
    size_t na = 0, nb = 0;
    uint8_t *x = test_read_file(a, &na), *y = test_read_file(b, &nb);
    bool same = x && y && na == nb && !memcmp(x, y, na);
    free(x);
    free(y);
    return same;
}

/* Starts `kvshard api ARGS --listen 127.0.0.1:0` and waits (bounded) for its port. */
static bool api_start(proc_server *a, const char *dir, char *const *args) {
    char *argv[32];
    int n = 0;
    argv[n++] = "kvshard";
    argv[n++] = "api";
    for (int i = 0; args[i] && n < 28; i++) argv[n++] = args[i];
    argv[n++] = "--listen";
    argv[n++] = "127.0.0.1:0";
    argv[n] = NULL;
    return proc_start_listener(a, dir, "api", argv);
}

static int shell(const char *cmd) {
    int rc = system(cmd);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

int main(void) {
    if (KVS_SANITIZED) {
        printf("note: sanitizer build; the npm/Chromium clients run in the release build\n");
        return TEST_SKIP_CODE;
    }
    char mpath[512];
    const char *model = test_shared_path("models/stories260K.gguf", mpath, sizeof mpath);
    if (!model) return test_finish("test_http_js", 0, 1);
    if (!have_cmd("node") || !have_cmd("npm")) {
        printf("note: node or npm is not installed; the openai-client and browser checks are skipped\n");
        return TEST_SKIP_CODE;
    }
    char bin[512], build[512], src[512], js[600];
    snprintf(bin, sizeof bin, "%s", proc_bin());
    if (bin[0] != '/') {
        char cwd[400];
        if (!getcwd(cwd, sizeof cwd)) return 1;
        snprintf(bin, sizeof bin, "%s/%s", cwd, proc_bin());
    }
    char tmp[512];
    snprintf(tmp, sizeof tmp, "%s", bin);
    snprintf(build, sizeof build, "%s", dirname(tmp));
    snprintf(tmp, sizeof tmp, "%s", __FILE__);
    snprintf(src, sizeof src, "%s/js", dirname(tmp));
    snprintf(js, sizeof js, "%s/js", build);
    mkdir(js, 0755);
    static const char *const files[] = {"package.json", "openai_test.mjs", "page_test.mjs"};
    char from[800], to[800], cmd[2400];
    snprintf(from, sizeof from, "%s/package.json", src);
    snprintf(to, sizeof to, "%s/package.json", js);
    char probe[800];
    snprintf(probe, sizeof probe, "%s/node_modules/openai/package.json", js);
    bool installed = same_file(from, to) && access(probe, R_OK) == 0;
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        snprintf(from, sizeof from, "%s/%s", src, files[i]);
        snprintf(to, sizeof to, "%s/%s", js, files[i]);
        if (!copy_file(from, to)) {
            fprintf(stderr, "cannot copy %s to %s\n", from, to);
            return 1;
        }
    }
    if (!installed) {
        snprintf(cmd, sizeof cmd, "cd '%s' && timeout 300 npm install --no-audit --no-fund --loglevel=error >npm.log 2>&1", js);
        if (shell(cmd) != 0) {
            printf("note: npm install failed (no registry?), see %s/npm.log; the client checks are skipped\n", js);
            return TEST_SKIP_CODE;
        }
    }
    int run = 0, skipped = 0;
    /* The Llama 3 real-format file: chat template, BPE, special tokens; one process and a
     * 2-shard route (its tokenizer and template travel from the head shard). */
    char l3path[512];
    const char *l3 = test_shared_path("downloads/models/llama3-synth-Q4_K_M.gguf", l3path, sizeof l3path);
    if (!l3) {
        skipped++;
    } else {
        proc_server a0 = {0}, a1 = {0};
        proc_server l3one = {0}, l3two = {0};
        char *l3_args[] = {"-m", (char *)l3, "-t", "1", "--kv-budget", "64M", NULL};
        CHECK(api_start(&l3one, build, l3_args));
        CHECK(proc_start_server(&a0, build, l3, "0:1", NULL));
        CHECK(proc_start_server(&a1, build, l3, "1:end", NULL));
        char l3route[128];
        snprintf(l3route, sizeof l3route, "127.0.0.1:%d,127.0.0.1:%d", a0.port, a1.port);
        char *l3two_args[] = {"--route", l3route, NULL};
        CHECK(api_start(&l3two, build, l3two_args));
        if (l3one.port > 0 && l3two.port > 0) {
            snprintf(cmd, sizeof cmd,
                     "cd '%s' && KVS_BIN='%s' KVS_MODEL='%s' KVS_API_URLS='[{\"name\":\"llama3 api -m\",\"url\":\"http://127.0.0.1:%d\"},"
                     "{\"name\":\"llama3 api --route (2 shards)\",\"url\":\"http://127.0.0.1:%d\"}]' timeout 180 node openai_test.mjs",
                     js, bin, l3, l3one.port, l3two.port);
            CHECK_EQ_INT(shell(cmd), 0);
            run++;
        }
        CHECK_EQ_INT(proc_stop_server(&l3one), 0);
        CHECK_EQ_INT(proc_stop_server(&l3two), 0);
        proc_stop_server(&a0);
        proc_stop_server(&a1);
    }
    proc_server s0 = {0}, s1 = {0};
    proc_server one = {0}, two = {0};
    char *one_args[] = {"-m", (char *)model, "-t", "1", "--kv-budget", "64M", NULL};
    CHECK(api_start(&one, build, one_args));
    CHECK(proc_start_server(&s0, build, model, "0:2", NULL));
    CHECK(proc_start_server(&s1, build, model, "2:end", NULL));
    char route[128];
    snprintf(route, sizeof route, "127.0.0.1:%d,127.0.0.1:%d", s0.port, s1.port);
    char *two_args[] = {"--route", route, "--model-name", "stories260K", NULL};
    CHECK(api_start(&two, build, two_args));
    if (one.port > 0 && two.port > 0) {
        snprintf(cmd, sizeof cmd,
                 "cd '%s' && KVS_BIN='%s' KVS_MODEL='%s' KVS_API_URLS='[{\"name\":\"api -m\",\"url\":\"http://127.0.0.1:%d\"},"
                 "{\"name\":\"api --route (2 shards)\",\"url\":\"http://127.0.0.1:%d\"}]' timeout 120 node openai_test.mjs",
                 js, bin, model, one.port, two.port);
        CHECK_EQ_INT(shell(cmd), 0);
        run++;
        const char *chromium = access("/usr/bin/chromium", X_OK) == 0 ? "/usr/bin/chromium" : NULL;
        if (!chromium) {
            printf("note: /usr/bin/chromium is not installed (Debian package chromium); the page check is skipped\n");
            skipped++;
        } else {
            char shot[600];
            snprintf(shot, sizeof shot, "%s/http_page.png", build);
            unlink(shot);
            snprintf(cmd, sizeof cmd,
                     "cd '%s' && prof=$(mktemp -d) && KVS_API_URL='http://127.0.0.1:%d' KVS_CHROMIUM='%s' "
                     "KVS_SCREENSHOT='%s' KVS_PROFILE=\"$prof\" timeout 120 node page_test.mjs; rc=$?; rm -rf \"$prof\"; exit $rc",
                     js, one.port, chromium, shot);
            CHECK_EQ_INT(shell(cmd), 0);
            struct stat st;
            CHECK(stat(shot, &st) == 0 && st.st_size > 1000);
            if (stat(shot, &st) == 0) printf("screenshot: %s (%lld bytes)\n", shot, (long long)st.st_size);
            run++;
        }
    }
    CHECK_EQ_INT(proc_stop_server(&one), 0);
    CHECK_EQ_INT(proc_stop_server(&two), 0);
    proc_stop_server(&s0);
    proc_stop_server(&s1);
    return test_finish("test_http_js", run, skipped);
}
