/* test_mkmodel — synthetic models: every type at the tiny shape reopens with the
 * expected metadata, shapes and types; value statistics; determinism; the CLI
 * (mkmodel, inspect) when KVS_BIN points at the kvshard binary. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "gguf.h"
#include "mkmodel.h"
#include "model.h"
#include "quant.h"
#include "test.h"
#include "util.h"

static int n_run, n_skipped;
static char tmp_dir[256];


static int write_model(const char *path, const char *shape, uint32_t type, uint64_t seed, int threads) {
    mkmodel_params p = mkmodel_default_params();
    p.shape = shape;
    p.type = type;
    p.seed = seed;
    p.n_threads = threads;
    char msg[KVS_MSG_MAX] = "";
    int rc = mkmodel_write(path, p, msg, sizeof msg);
    if (rc) fprintf(stderr, "mkmodel_write %s %s: %s\n", shape, quant_get_traits(type)->name, msg);
    return rc;
}

static uint32_t get_u32(const gguf_ctx *g, const char *key) {
    uint32_t v = 0;
    int rc = gguf_get_u32(g, key, &v);
    if (rc) fprintf(stderr, "key %s: %s\n", key, kvs_strerror(rc));
    CHECK_EQ_INT(rc, KVS_OK);
    return v;
}

/* rms and mean of a whole tensor, dequantized. */
static void tensor_stats(const gguf_tensor *t, double *mean, double *rms) {
    uint64_t rows = t->ne[1] * t->ne[2] * t->ne[3], rb = 0;
    CHECK(quant_row_bytes(t->type, t->ne[0], &rb));
    float *x = malloc(t->ne[0] * sizeof *x);
    double s = 0, s2 = 0;
    for (uint64_t r = 0; r < rows; r++) {
        quant_dequant_row_ref(t->type, (const uint8_t *)t->data + r * rb, x, (int64_t)t->ne[0]);
        for (uint64_t j = 0; j < t->ne[0]; j++) {
            s += x[j];
            s2 += (double)x[j] * x[j];
        }
    }
    free(x);
    double n = (double)(rows * t->ne[0]);
    *mean = s / n;
    *rms = sqrt(s2 / n);
}

/* Checks a model of shape s whose matrices were requested as `type`. */
static void check_model(const char *path, const mkmodel_shape *s, uint32_t type) {
    gguf_ctx *g = NULL;
    char msg[KVS_MSG_MAX] = "";
    int rc = gguf_open(path, &g, msg, sizeof msg);
    if (rc) fprintf(stderr, "%s\n", msg);
    CHECK_EQ_INT(rc, KVS_OK);
    if (!g) return;
    gguf_str str;
    CHECK_EQ_INT(gguf_get_str(g, "general.architecture", &str), KVS_OK);
    CHECK(gguf_str_eq(str, "llama"));
    CHECK_EQ_INT(gguf_get_str(g, "tokenizer.ggml.model", &str), KVS_OK);
    CHECK(gguf_str_eq(str, "llama"));
    CHECK_EQ_INT(get_u32(g, "llama.embedding_length"), s->n_embd);
    CHECK_EQ_INT(get_u32(g, "llama.block_count"), s->n_layer);
    CHECK_EQ_INT(get_u32(g, "llama.feed_forward_length"), s->n_ff);
    CHECK_EQ_INT(get_u32(g, "llama.attention.head_count"), s->n_head);
    CHECK_EQ_INT(get_u32(g, "llama.attention.head_count_kv"), s->n_head_kv);
    CHECK_EQ_INT(get_u32(g, "llama.context_length"), s->n_ctx);
    CHECK_EQ_INT(get_u32(g, "llama.rope.dimension_count"), s->n_embd / s->n_head);
    CHECK_EQ_INT(get_u32(g, "tokenizer.ggml.bos_token_id"), 1);
    CHECK_EQ_INT(get_u32(g, "tokenizer.ggml.eos_token_id"), 2);
    CHECK_EQ_INT(get_u32(g, "tokenizer.ggml.unknown_token_id"), 0);
    get_u32(g, "general.file_type");
    float f = 0;
    CHECK_EQ_INT(gguf_get_f32(g, "llama.rope.freq_base", &f), KVS_OK);
    CHECK_NEAR(f, 10000, 0);
    CHECK_EQ_INT(gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", &f), KVS_OK);
    CHECK_NEAR(f, 1e-5, 1e-10);

    const gguf_kv *toks = gguf_find_kv(g, "tokenizer.ggml.tokens");
    const gguf_kv *scores = gguf_find_kv(g, "tokenizer.ggml.scores");
    const gguf_kv *types = gguf_find_kv(g, "tokenizer.ggml.token_type");
    CHECK(toks && scores && types);
    if (toks && scores && types) {
        CHECK_EQ_INT(toks->arr_n, s->n_vocab);
        CHECK_EQ_INT(scores->arr_n, s->n_vocab);
        CHECK_EQ_INT(types->arr_n, s->n_vocab);
        CHECK(gguf_str_eq(toks->arr_strs[0], "<unk>"));
        CHECK(gguf_str_eq(toks->arr_strs[1], "<s>"));
        CHECK(gguf_str_eq(toks->arr_strs[2], "</s>"));
        CHECK(gguf_str_eq(toks->arr_strs[3], "<0x00>"));
        CHECK(gguf_str_eq(toks->arr_strs[258], "<0xFF>"));
        CHECK(gguf_str_eq(toks->arr_strs[259], "\xe2\x96\x81" "a"));
        CHECK_EQ_INT(gguf_arr_i64(types, 0), 2);
        CHECK_EQ_INT(gguf_arr_i64(types, 1), 3);
        CHECK_EQ_INT(gguf_arr_i64(types, 2), 3);
        CHECK_EQ_INT(gguf_arr_i64(types, 100), 6);
        CHECK_EQ_INT(gguf_arr_i64(types, 300), 1);
        /* fillers: unique, scores descending */
        for (uint64_t i = 260; i < toks->arr_n; i++) {
            CHECK(gguf_arr_f32(scores, i) < gguf_arr_f32(scores, i - 1));
            for (uint64_t j = 259; j < i && i < 600; j++)
                if (toks->arr_strs[i].len == toks->arr_strs[j].len &&
                    memcmp(toks->arr_strs[i].ptr, toks->arr_strs[j].ptr, toks->arr_strs[i].len) == 0) {
                    fprintf(stderr, "duplicate token %" PRIu64 " / %" PRIu64 "\n", i, j);
                    CHECK(false);
                }
        }
    }

    CHECK_EQ_INT(gguf_n_tensors(g), 9 * s->n_layer + 3);
    const quant_traits *tr = quant_get_traits(type);
    uint64_t hd = s->n_embd / s->n_head;
    struct { const char *name; uint64_t ne0, ne1; } want[] = {
        {"token_embd.weight", s->n_embd, s->n_vocab},
        {"output_norm.weight", s->n_embd, 0},
        {"output.weight", s->n_embd, s->n_vocab},
        {"blk.0.attn_norm.weight", s->n_embd, 0},
        {"blk.0.attn_q.weight", s->n_embd, s->n_head * hd},
        {"blk.0.attn_k.weight", s->n_embd, s->n_head_kv * hd},
        {"blk.0.attn_v.weight", s->n_embd, s->n_head_kv * hd},
        {"blk.0.attn_output.weight", s->n_head * hd, s->n_embd},
        {"blk.1.ffn_norm.weight", s->n_embd, 0},
        {"blk.1.ffn_gate.weight", s->n_embd, s->n_ff},
        {"blk.1.ffn_up.weight", s->n_embd, s->n_ff},
        {"blk.1.ffn_down.weight", s->n_ff, s->n_embd},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const gguf_tensor *t = gguf_find_tensor(g, want[i].name);
        if (!t) fprintf(stderr, "missing tensor %s\n", want[i].name);
        CHECK(t != NULL);
        if (!t) continue;
        CHECK_EQ_INT(t->ne[0], want[i].ne0);
        if (want[i].ne1 == 0) {
            CHECK_EQ_INT(t->n_dims, 1);
            CHECK_EQ_INT(t->type, QUANT_F32);
        } else {
            CHECK_EQ_INT(t->n_dims, 2);
            CHECK_EQ_INT(t->ne[1], want[i].ne1);
            uint32_t expect = type;
            if (t->ne[0] % tr->block_elems != 0) expect = t->ne[0] % 32 == 0 ? QUANT_Q8_0 : QUANT_F16;
            CHECK_EQ_INT(t->type, expect);
        }
    }
    /* value statistics (dequantized) */
    const gguf_tensor *te = gguf_find_tensor(g, "token_embd.weight"), *tq = gguf_find_tensor(g, "blk.0.attn_q.weight"),
                      *tn = gguf_find_tensor(g, "blk.0.attn_norm.weight"), *to = gguf_find_tensor(g, "output.weight");
    if (te && tq && tn && to) {
        double mean, rms;
        tensor_stats(te, &mean, &rms);
        CHECK_NEAR(mean, 0.0, 0.05);
        CHECK_NEAR(rms, 1.0, 0.1);
        tensor_stats(tq, &mean, &rms);
        CHECK_NEAR(rms * sqrt((double)s->n_embd), 1.0, 0.15);
        tensor_stats(tn, &mean, &rms);
        CHECK_NEAR(mean, 1.0, 0.05);
        tensor_stats(to, &mean, &rms);
        CHECK_NEAR(rms * sqrt((double)s->n_embd), 3.0, 0.4);
    }
    gguf_close(g);
}

static bool same_file(const char *a, const char *b) {
    size_t na = 0, nb = 0;
    uint8_t *x = test_read_file(a, &na), *y = test_read_file(b, &nb);
    bool same = x && y && na == nb && memcmp(x, y, na) == 0;
    free(x);
    free(y);
    return same;
}

static void test_all_types(void) {
    static const char *types[] = {"f32",  "f16",  "bf16", "q8_0", "q4_0", "q4_1",   "q5_0",  "q5_1",
                                  "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"};
    const mkmodel_shape *tiny = mkmodel_find_shape("tiny");
    CHECK(tiny != NULL);
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        int t = quant_type_from_name(types[i]);
        CHECK(t >= 0);
        CHECK(mkmodel_type_supported((uint32_t)t));
        char path[512];
        snprintf(path, sizeof path, "%s/tiny-%s.gguf", tmp_dir, types[i]);
        CHECK_EQ_INT(write_model(path, "tiny", (uint32_t)t, 7, 2), KVS_OK);
        check_model(path, tiny, (uint32_t)t);
        if (t == QUANT_F32) {
            struct stat st;
            CHECK(stat(path, &st) == 0 && st.st_size < (1 << 20));
        }
        unlink(path);
    }
    /* small: k-quants apply to every matrix */
    const mkmodel_shape *small = mkmodel_find_shape("small");
    CHECK(small != NULL);
    char path[512];
    static const uint32_t k_types[] = {QUANT_Q4_K, QUANT_Q2_K, QUANT_Q3_K, QUANT_IQ4_XS};
    for (size_t i = 0; i < sizeof k_types / sizeof k_types[0]; i++) {
        snprintf(path, sizeof path, "%s/small-%s.gguf", tmp_dir, quant_get_traits(k_types[i])->name);
        CHECK_EQ_INT(write_model(path, "small", k_types[i], 7, 2), KVS_OK);
        check_model(path, small, k_types[i]);
        unlink(path);
    }
    n_run++;
}

static void test_determinism(void) {
    char a[512], b[512], c[512];
    snprintf(a, sizeof a, "%s/a.gguf", tmp_dir);
    snprintf(b, sizeof b, "%s/b.gguf", tmp_dir);
    snprintf(c, sizeof c, "%s/c.gguf", tmp_dir);
    CHECK_EQ_INT(write_model(a, "tiny", QUANT_Q4_0, 123, 1), KVS_OK);
    CHECK_EQ_INT(write_model(b, "tiny", QUANT_Q4_0, 123, 3), KVS_OK); /* thread count must not matter */
    CHECK_EQ_INT(write_model(c, "tiny", QUANT_Q4_0, 124, 2), KVS_OK);
    CHECK(same_file(a, b));
    CHECK(!same_file(a, c));
    CHECK_EQ_INT(write_model(a, "small", QUANT_F16, 5, 1), KVS_OK);
    CHECK_EQ_INT(write_model(b, "small", QUANT_F16, 5, 2), KVS_OK);
    CHECK(same_file(a, b));
    unlink(a);
    unlink(b);
    unlink(c);

    /* refusals leave no file */
    mkmodel_params p = mkmodel_default_params();
    char msg[KVS_MSG_MAX] = "";
    p.shape = "no-such-shape";
    CHECK_EQ_INT(mkmodel_write(a, p, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    CHECK(msg[0] != '\0');
    p = mkmodel_default_params();
    p.type = QUANT_Q8_K; /* known by size only */
    msg[0] = '\0';
    CHECK_EQ_INT(mkmodel_write(a, p, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    CHECK(msg[0] != '\0');
    p = mkmodel_default_params();
    CHECK_EQ_INT(mkmodel_write("/nonexistent/dir/x.gguf", p, msg, sizeof msg), KVS_ERR_IO);
    CHECK(access(a, F_OK) != 0);
    CHECK(mkmodel_find_shape("tinyllama-1.1b") && mkmodel_find_shape("llama-7b"));
    CHECK(mkmodel_find_shape("tinyllama-1.1b")->n_vocab == 32000);
    const mkmodel_shape *sm = mkmodel_find_shape("smollm2-360m"); /* SmolLM2-360M's config */
    CHECK(sm && sm->n_embd == 960 && sm->n_layer == 32 && sm->n_head == 15 && sm->n_head_kv == 5 && sm->n_ff == 2560 &&
          sm->n_vocab == 49152);
    n_run++;
}

static int run_cmd(const char *cmd) {
    int st = system(cmd);
    return st == -1 || !WIFEXITED(st) ? -1 : WEXITSTATUS(st);
}

static void test_cli(void) {
    const char *bin = getenv("KVS_BIN");
    if (!bin || access(bin, X_OK) != 0) {
        fprintf(stderr, "note: KVS_BIN unset or not executable; CLI checks skipped\n");
        n_skipped++;
        return;
    }
    char cmd[2048], path[512], out[512];
    snprintf(path, sizeof path, "%s/cli.gguf", tmp_dir);
    snprintf(out, sizeof out, "%s/inspect.txt", tmp_dir);
    snprintf(cmd, sizeof cmd, "%s mkmodel -o %s --shape tiny --type q6_k --seed 3 2>%s", bin, path, out);
    CHECK_EQ_INT(run_cmd(cmd), 0);
    size_t n = 0;
    char *log = (char *)test_read_file(out, &n);
    CHECK(log != NULL);
    if (log) {
        log = realloc(log, n + 1);
        log[n] = '\0';
        CHECK(strstr(log, "tensor 21/21 output.weight") != NULL);
        CHECK(strstr(log, "fallback") != NULL); /* q6_k rows of 64 fall back */
        free(log);
    }
    snprintf(cmd, sizeof cmd, "%s inspect %s >%s", bin, path, out);
    CHECK_EQ_INT(run_cmd(cmd), 0);
    log = (char *)test_read_file(out, &n);
    if (log) {
        log = realloc(log, n + 1);
        log[n] = '\0';
        CHECK(strstr(log, "GGUF v3") != NULL);
        CHECK(strstr(log, "llama.block_count = 2") != NULL);
        CHECK(strstr(log, "tokenizer.ggml.tokens = [string x 512] \"<unk>\", \"<s>\"") != NULL);
        CHECK(strstr(log, "blk.1.ffn_down.weight") != NULL);
        CHECK(strstr(log, "q8_0") != NULL);
        free(log);
    }
    /* a truncated file: exit 1 with a message on stderr */
    snprintf(cmd, sizeof cmd, "truncate -s 5000 %s && %s inspect %s >/dev/null 2>%s", path, bin, path, out);
    CHECK_EQ_INT(run_cmd(cmd), 1);
    log = (char *)test_read_file(out, &n);
    CHECK(log && n > 0);
    free(log);
    snprintf(cmd, sizeof cmd, "%s mkmodel -o %s --shape nope --type f32 2>/dev/null", bin, path);
    CHECK(run_cmd(cmd) != 0);
    snprintf(cmd, sizeof cmd, "%s inspect --help >/dev/null && %s mkmodel --help >/dev/null", bin, bin);
    CHECK_EQ_INT(run_cmd(cmd), 0);
    unlink(path);
    unlink(out);
    n_run++;
}

/* The q4_k_m mix: q6_k where llama.cpp's use_more_bits puts it, q4_k elsewhere,
 * file_type 15; and the mix is refused for other types. */
static void test_k_m(void) {
    char path[300];
    snprintf(path, sizeof path, "%s/k_m.gguf", tmp_dir);
    mkmodel_params p = mkmodel_default_params();
    p.shape = "small"; /* 2 layers: layer 1 is the last eighth */
    p.type = QUANT_Q4_K;
    p.k_m = true;
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(mkmodel_write(path, p, msg, sizeof msg), KVS_OK);
    gguf_ctx *g = NULL;
    CHECK_EQ_INT(gguf_open(path, &g, msg, sizeof msg), KVS_OK);
    if (g) {
        static const struct { const char *name; uint32_t type; } want[] = {
            {"output.weight", QUANT_Q6_K},          {"token_embd.weight", QUANT_Q4_K},
            {"blk.0.attn_v.weight", QUANT_Q4_K},    {"blk.0.ffn_down.weight", QUANT_Q4_K},
            {"blk.1.attn_v.weight", QUANT_Q6_K},    {"blk.1.ffn_down.weight", QUANT_Q6_K},
            {"blk.1.attn_q.weight", QUANT_Q4_K},    {"blk.1.ffn_up.weight", QUANT_Q4_K},
        };
        for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
            const gguf_tensor *t = gguf_find_tensor(g, want[i].name);
            CHECK(t != NULL);
            if (t) CHECK_EQ_INT(t->type, want[i].type);
        }
        CHECK_EQ_INT(get_u32(g, "general.file_type"), 15);
        gguf_close(g);
    }
    unlink(path);
    p.type = QUANT_Q8_0;
    CHECK_EQ_INT(mkmodel_write(path, p, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    n_run++;
}

/* --arch: each family's file loads as that family with its features bound (q/k norms, post norms,
 * sliding window, tied output, fused matrices, LongRoPE), and an unknown one is refused. */
static void test_arches(void) {
    static const char *const arches[] = {"qwen3", "gemma3", "phi3"};
    for (int i = 0; i < 3; i++) {
        char path[512], msg[KVS_MSG_MAX] = "";
        snprintf(path, sizeof path, "%s/arch-%s.gguf", tmp_dir, arches[i]);
        mkmodel_params p = mkmodel_default_params();
        p.shape = "small";
        p.type = QUANT_Q4_K;
        p.k_m = true;
        p.arch = arches[i];
        CHECK_EQ_INT(mkmodel_write(path, p, msg, sizeof msg), KVS_OK);
        model *m = NULL;
        CHECK_EQ_INT(model_load(path, 0, 0, &m, msg, sizeof msg), KVS_OK);
        if (m) {
            CHECK(strcmp(m->hp.arch->name, arches[i]) == 0);
            const model_layer *L = &m->layers[0];
            CHECK((L->q_norm != NULL) == (i < 2));
            CHECK((L->post_attn_norm != NULL && L->post_ffn_norm != NULL) == (i == 1));
            CHECK((m->hp.n_swa == 512) == (i == 1));
            CHECK((m->output.data == m->tok_embd.data) == (i == 1)); /* gemma3: tied */
            CHECK_EQ_INT(L->wq.n_out + L->wk.n_out + L->wv.n_out, 256 + 2 * 128);
            CHECK((m->hp.n_ctx_orig == 256) == (i == 2)); /* phi3: LongRoPE's original context */
            model_free(m);
        }
        /* phi3: llama.cpp refuses a phi3-named file without Phi-3's "<|endoftext|>" */
        gguf_ctx *g = NULL;
        CHECK_EQ_INT(gguf_open_header(path, &g, msg, sizeof msg), KVS_OK);
        const gguf_kv *toks = g ? gguf_find_kv(g, "tokenizer.ggml.tokens") : NULL;
        CHECK(toks != NULL);
        if (toks) CHECK(gguf_str_eq(toks->arr_strs[toks->arr_n - 1], "<|endoftext|>") == (i == 2));
        gguf_close(g);
        unlink(path);
        n_run++;
    }
    mkmodel_params p = mkmodel_default_params();
    p.arch = "mamba";
    char msg[KVS_MSG_MAX] = "", path[512];
    snprintf(path, sizeof path, "%s/arch-bad.gguf", tmp_dir);
    CHECK_EQ_INT(mkmodel_write(path, p, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    CHECK(strstr(msg, "mamba") != NULL);
}

int main(void) {
    snprintf(tmp_dir, sizeof tmp_dir, "/tmp/kvs_test_mkmodel_XXXXXX");
    if (!mkdtemp(tmp_dir)) {
        perror("mkdtemp");
        return 1;
    }
    test_all_types();
    test_determinism();
    test_k_m();
    test_arches();
    test_cli();
    rmdir(tmp_dir);
    return test_finish("test_mkmodel", n_run, n_skipped);
}
