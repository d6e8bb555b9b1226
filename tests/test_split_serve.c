/*
 * Split files across machines (issue 41 item 8), with real shards over loopback: stories260K
 * (5 layers) split by `kvshard split --parts 3` (part 1: token_embd, blk.0-1; part 2: blk.2-3;
 * part 3: blk.4, output) and each split shard given a directory holding only what it needs:
 *  - a route [whole file 0:2, parts 1+2 only 2:4, parts 1+3 only 4:5] is accepted (the route
 *    refuses shards whose model digests differ, so the split shards report the whole file's
 *    digest) and generates the same ids and text as `kvshard run` on the whole file, greedy and
 *    sampled; the split shards log that the digest came from the manifest;
 *  - `kvshard run` on parts 1+2 alone is refused naming a tensor of the absent part 3;
 *  - a flipped byte in blk.2.attn_q.weight of part 2: the shard exits, naming the tensor and part;
 *  - a split without a manifest (our writer without it, as another tool writes) still serves
 *    with every part, logs "no kvshard manifest: every part is read for the digest" once, and
 *    generates the same text.
 */
#include <sys/stat.h>

#include "gguf.h"
#include "proc.h"
#include "route_harness.h"
#include "gguf_flip.h"
#include "test.h"

static char g_dir[64];

static char *run_cli(const char *const *args, int *status) { return proc_cli(g_dir, args, status); }

/* Copies the file at from to to; false when it cannot. */
static bool copy_file(const char *from, const char *to) {
    size_t n = 0;
    uint8_t *b = test_read_file(from, &n);
    FILE *f = b ? fopen(to, "wb") : NULL;
    bool ok = f && fwrite(b, 1, n, f) == n;
    if (f && fclose(f) != 0) ok = false;
    free(b);
    return ok;
}

/* dir/sub/st-0000K-of-00003.gguf for part k (0-based) into buf. */
static void part_in(char *buf, size_t cap, const char *sub, uint32_t k) {
    char prefix[200];
    snprintf(prefix, sizeof(prefix), "%s/%s/st", g_dir, sub);
    CHECK(gguf_split_path(buf, cap, prefix, k, 3));
}

/* Makes dir/sub holding copies of the listed parts (0-based) of dir/full. */
static void make_subset(const char *sub, const int *parts, int n) {
    char d[200], from[300], to[300];
    snprintf(d, sizeof(d), "%s/%s", g_dir, sub);
    CHECK(mkdir(d, 0700) == 0);
    for (int i = 0; i < n; i++) {
        part_in(from, sizeof(from), "full", (uint32_t)parts[i]);
        part_in(to, sizeof(to), sub, (uint32_t)parts[i]);
        CHECK(copy_file(from, to));
    }
}

/* True when the file at path contains text (n times exactly when n > 0). */
static bool log_has(const char *path, const char *text, int n) {
    size_t len = 0;
    uint8_t *b = test_read_file(path, &len);
    int seen = 0;
    for (const char *p = b ? (const char *)b : NULL; p && (p = memmem(p, len - (size_t)(p - (const char *)b), text,
                                                                    strlen(text))); p++)
        seen++;
    free(b);
    return n > 0 ? seen == n : seen > 0;
}

static char *generate(const char *route, const char *temp, int *st) {
    const char *args[] = {"generate", "--route", route, "-p", "Once upon a time", "-n", "24", "--temp", temp,
                          "--seed", "5", "--json", NULL};
    return run_cli(args, st);
}

static char *reference(const char *path, const char *temp) {
    int st;
    const char *args[] = {"run", "-m", path, "-p", "Once upon a time", "-n", "24", "--temp", temp, "--seed", "5",
                          "-t", "1", "--json", NULL};
    char *out = run_cli(args, &st);
    CHECK_EQ_INT(st, 0);
    CHECK(out && strstr(out, "\"generated\":[") != NULL);
    return out;
}

static void check_mixed_route(const char *stories, const char *ref, const char *ref_t) {
    char mid[300], tail[300];
    part_in(mid, sizeof(mid), "mid", 0);
    part_in(tail, sizeof(tail), "tail", 0);
    proc_server s[3];
    CHECK(proc_start_server(&s[0], g_dir, stories, "0:2", NULL));
    CHECK(proc_start_server(&s[1], g_dir, mid, "2:4", NULL));
    CHECK(proc_start_server(&s[2], g_dir, tail, "4:5", NULL));
    char route[256];
    route_of(route, sizeof(route), s, 3);
    int st;
    char *out = generate(route, "0", &st);
    CHECK_EQ_INT(st, 0);
    if (!out || strcmp(out, ref) != 0) fprintf(stderr, "mixed route greedy:\n  got  %s  want %s", out ? out : "-", ref);
    CHECK(out && strcmp(out, ref) == 0);
    free(out);
    out = generate(route, "0.8", &st);
    CHECK_EQ_INT(st, 0);
    CHECK(out && strcmp(out, ref_t) == 0);
    free(out);
    for (int i = 1; i < 3; i++) CHECK(log_has(s[i].log, "model digest from the kvshard manifest", 1));
    CHECK(!log_has(s[1].log, "hashing the model file", 0));
    for (int i = 0; i < 3; i++) CHECK_EQ_INT(proc_stop_server(&s[i]), 0);
    printf("  route [whole 0:2, parts 1+2 2:4, parts 1+3 4:5]: same digest, same ids and text as kvshard run\n");
}

static void check_refusals(void) {
    char first[300], part2[300], log[300];
    part_in(first, sizeof(first), "mid", 0);
    snprintf(log, sizeof(log), "%s/refused.log", g_dir);
    const char *run[] = {"run", "-m", first, "-p", "Once", "-n", "2", "-t", "1", NULL};
    char *out = NULL;
    CHECK(proc_run_args(run, &out, log, 60000) != 0);
    free(out);
    CHECK(log_has(log, "is in part 3 (", 0) && log_has(log, "which is not on this machine", 0));

    const int need[] = {0, 1};
    make_subset("bad", need, 2);
    part_in(first, sizeof(first), "bad", 0);
    part_in(part2, sizeof(part2), "bad", 1);
    flip_tensor_byte(part2, "blk.2.attn_q.weight");
    const char *serve[] = {"serve", "-m", first, "--layers", "2:4", "--listen", "127.0.0.1:0", "-t", "1", NULL};
    out = NULL;
    CHECK(proc_run_args(serve, &out, log, 60000) != 0);
    free(out);
    CHECK(log_has(log, "tensor 'blk.2.attn_q.weight' in part 2 (", 0) && log_has(log, "does not match", 0));
    printf("  refused: run without part 3, and a shard whose part 2 has a flipped byte, by tensor and part\n");
}

/* A split without a manifest, as other tools write it: every part, the fallback said once. */
static void check_no_manifest(const char *stories, const char *ref) {
    char msg[KVS_MSG_MAX], d[200], prefix[220], first[300];
    snprintf(d, sizeof(d), "%s/old", g_dir);
    CHECK(mkdir(d, 0700) == 0);
    snprintf(prefix, sizeof(prefix), "%s/st", d);
    gguf_ctx *g = NULL;
    CHECK_EQ_INT(gguf_open(stories, &g, msg, sizeof(msg)), KVS_OK);
    uint32_t *part_of = calloc(g ? gguf_n_tensors(g) : 1, sizeof(uint32_t));
    for (uint64_t i = 0; g && part_of && i < gguf_n_tensors(g); i++) { /* kvshard split's plan for 5 layers */
        const gguf_tensor *t = gguf_tensor_at(g, i);
        char name[GGUF_MAX_NAME_LEN + 1];
        snprintf(name, sizeof(name), "%.*s", (int)t->name.len, t->name.ptr);
        unsigned blk;
        if (sscanf(name, "blk.%u.", &blk) == 1) part_of[i] = blk * 3 / 5;
        else part_of[i] = !strncmp(name, "output", 6) ? 2 : 0;
    }
    CHECK(g && part_of && gguf_split_write(g, part_of, 3, prefix, msg, sizeof(msg)) == KVS_OK);
    free(part_of);
    gguf_close(g);
    part_in(first, sizeof(first), "old", 0);
    proc_server s;
    CHECK(proc_start_server(&s, g_dir, first, "0:5", NULL));
    char route[64];
    route_of(route, sizeof(route), &s, 1);
    int st;
    char *out = generate(route, "0", &st);
    CHECK_EQ_INT(st, 0);
    CHECK(out && strcmp(out, ref) == 0);
    free(out);
    CHECK(log_has(s.log, "no kvshard manifest: every part is read for the digest", 1));
    CHECK_EQ_INT(proc_stop_server(&s), 0);
    printf("  a split without a manifest serves with every part and says so once\n");
}

int main(void) {
    snprintf(g_dir, sizeof(g_dir), "/tmp/kvs-splitsrv-XXXXXX");
    CHECK(mkdtemp(g_dir) != NULL);
    signal(SIGPIPE, SIG_IGN);
    char buf[1024], full[200], prefix[220];
    const char *stories = test_shared_path("models/stories260K.gguf", buf, sizeof(buf));
    if (!stories) return test_finish("test_split_serve", 0, 1);
    snprintf(full, sizeof(full), "%s/full", g_dir);
    CHECK(mkdir(full, 0700) == 0);
    snprintf(prefix, sizeof(prefix), "%s/st", full);
    int st;
    const char *split[] = {"split", "-m", stories, "--parts", "3", "-o", prefix, NULL};
    free(run_cli(split, &st));
    CHECK_EQ_INT(st, 0);
    const int mid[] = {0, 1}, tail[] = {0, 2};
    make_subset("mid", mid, 2);
    make_subset("tail", tail, 2);
    char *ref = reference(stories, "0"), *ref_t = reference(stories, "0.8");
    check_mixed_route(stories, ref, ref_t);
    check_refusals();
    check_no_manifest(stories, ref);
    free(ref);
    free(ref_t);
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", g_dir);
    if (!test_failures_) CHECK_EQ_INT(system(cmd), 0);
    return test_finish("test_split_serve", 1, 0);
}
