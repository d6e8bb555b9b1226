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

/* `kvshard api -m model` (one process) and `kvshard api --route` over two shards of model
 * split at layer `split` ("N:end" for the second), each on a free port. */
typedef struct {
    proc_server one, two;       /* api -m, api --route */
    proc_server shard[2];
} api_pair;

static void api_pair_start(api_pair *p, const char *dir, const char *model, const char *split, char *const *route_extra) {
    char head[16], tail[24];
    snprintf(head, sizeof head, "0:%s", split);
    snprintf(tail, sizeof tail, "%s:end", split);
    char *one_args[] = {"-m", (char *)model, "-t", "1", "--kv-budget", "64M", NULL};
    CHECK(api_start(&p->one, dir, one_args));
    CHECK(proc_start_server(&p->shard[0], dir, model, head, NULL));
    CHECK(proc_start_server(&p->shard[1], dir, model, tail, NULL));
    char route[128];
    snprintf(route, sizeof route, "127.0.0.1:%d,127.0.0.1:%d", p->shard[0].port, p->shard[1].port);
    char *two_args[8] = {"--route", route};
    for (int i = 0; route_extra && route_extra[i] && i < 5; i++) two_args[2 + i] = route_extra[i];
    CHECK(api_start(&p->two, dir, two_args));
}

/* Stops all four; the two api processes must exit 0. */
static void api_pair_stop(api_pair *p) {
    CHECK_EQ_INT(proc_stop_server(&p->one), 0);
    CHECK_EQ_INT(proc_stop_server(&p->two), 0);
    proc_stop_server(&p->shard[0]);
    proc_stop_server(&p->shard[1]);
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
        api_pair l3p = {0};
        api_pair_start(&l3p, build, l3, "1", NULL);
        if (l3p.one.port > 0 && l3p.two.port > 0) {
            snprintf(cmd, sizeof cmd,
                     "cd '%s' && KVS_BIN='%s' KVS_MODEL='%s' KVS_API_URLS='[{\"name\":\"llama3 api -m\",\"url\":\"http://127.0.0.1:%d\"},"
                     "{\"name\":\"llama3 api --route (2 shards)\",\"url\":\"http://127.0.0.1:%d\"}]' timeout 180 node openai_test.mjs",
                     js, bin, l3, l3p.one.port, l3p.two.port);
            CHECK_EQ_INT(shell(cmd), 0);
            run++;
        }
        api_pair_stop(&l3p);
    }
    api_pair sp = {0};
    char *name_args[] = {"--model-name", "stories260K", NULL};
    api_pair_start(&sp, build, model, "2", name_args);
    if (sp.one.port > 0 && sp.two.port > 0) {
        snprintf(cmd, sizeof cmd,
                 "cd '%s' && KVS_BIN='%s' KVS_MODEL='%s' KVS_API_URLS='[{\"name\":\"api -m\",\"url\":\"http://127.0.0.1:%d\"},"
                 "{\"name\":\"api --route (2 shards)\",\"url\":\"http://127.0.0.1:%d\"}]' timeout 120 node openai_test.mjs",
                 js, bin, model, sp.one.port, sp.two.port);
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
                     js, sp.one.port, chromium, shot);
            CHECK_EQ_INT(shell(cmd), 0);
            struct stat st;
            CHECK(stat(shot, &st) == 0 && st.st_size > 1000);
            if (stat(shot, &st) == 0) printf("screenshot: %s (%lld bytes)\n", shot, (long long)st.st_size);
            run++;
        }
    }
    api_pair_stop(&sp);
    return test_finish("test_http_js", run, skipped);
}
