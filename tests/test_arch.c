/*
 * arch: the table of supported architectures and what the model loader does
 * with each family's keys and tensors. Synthetic files are rewritten from a
 * mkmodel "tiny" llama through the GGUF writer:
 *  - refusals, each with its message: a Mixtral-shaped llama (expert_count 8
 *    and expert tensors), an unknown architecture, rope scaling yarn and
 *    longrope, key_length != value_length, a tensor no family uses, a qwen2
 *    file without its q/k/v biases;
 *  - the table: llama and qwen2 rows, keys read under `{arch}.` (a qwen2 copy
 *    of the llama file loads with qwen2.* keys and its own eps);
 *  - rope: neox rotation equals the adjacent-pair rotation of the same values
 *    laid out interleaved (bit for bit); rope_freqs.weight divides each
 *    inverse frequency; linear scaling multiplies them by 1/factor;
 *  - biases: zero q/k/v/output biases give bit-identical logits to no biases,
 *    non-zero ones change them; key_length 32 with n_embd / n_head 16 loads
 *    and runs (KV path == one batch).
 * The numbers of qwen2, biases, neox and rope_freqs against llama.cpp are in
 * test_downloads.
 */
#include <math.h>
#include <stdlib.h>

#include "engine.h"
#include "gguf.h"
#include "isa_check.h"
#include "mkmodel.h"
#include "model.h"
#include "ops.h"
#include "quant.h"
#include "test.h"

typedef struct {
    const char *key;
    enum gguf_vtype type; /* GGUF_VT_U32, GGUF_VT_F32 or GGUF_VT_STRING */
    uint32_t u32;
    float f32;
    const char *str;
} kv_set;

typedef struct {
    const char *name;
    uint64_t ne0, ne1; /* ne1 0: a vector */
    float value;       /* every element (f32) */
} tensor_add;

typedef struct {
    const char *rename_arch; /* rewrite general.architecture and every "llama." key to this family */
    const kv_set *kvs;
    int n_kvs;
    const tensor_add *adds;
    int n_adds;
    const char *drop_suffix; /* drop tensors whose name ends with this */
} rewrite;

/* Copies src to dst with the rewrite applied. */
static int write_rewrite(const char *src, const char *dst, const rewrite *r) {
    gguf_ctx *g = NULL;
    char msg[KVS_MSG_MAX];
    int err = gguf_open(src, &g, msg, sizeof(msg));
    if (err) return err;
    gguf_writer *w = gguf_writer_create();
    for (uint64_t i = 0; i < gguf_n_kv(g) && !err; i++) {
        const gguf_kv *kv = gguf_kv_at(g, i);
        if (r->rename_arch && kv->key.len > 6 && !memcmp(kv->key.ptr, "llama.", 6)) {
            gguf_kv copy = *kv;
            char key[256];
            snprintf(key, sizeof(key), "%s.%.*s", r->rename_arch, (int)kv->key.len - 6, kv->key.ptr + 6);
            copy.key.ptr = key;
            copy.key.len = strlen(key);
            err = gguf_writer_copy_kv(w, &copy);
        } else {
            err = gguf_writer_copy_kv(w, kv);
        }
    }
    if (r->rename_arch) err = err ? err : gguf_writer_set_str(w, "general.architecture", r->rename_arch);
    for (int i = 0; i < r->n_kvs && !err; i++) {
        const kv_set *k = &r->kvs[i];
        if (k->type == GGUF_VT_STRING) err = gguf_writer_set_str(w, k->key, k->str);
        else if (k->type == GGUF_VT_F32) err = gguf_writer_set_f32(w, k->key, k->f32);
        else err = gguf_writer_set_u32(w, k->key, k->u32);
    }
    for (uint64_t i = 0; i < gguf_n_tensors(g) && !err; i++) {
        const gguf_tensor *t = gguf_tensor_at(g, i);
        char name[256];
        snprintf(name, sizeof(name), "%.*s", (int)t->name.len, t->name.ptr);
        size_t ln = strlen(name), ls = r->drop_suffix ? strlen(r->drop_suffix) : 0;
        if (r->drop_suffix && ln >= ls && !strcmp(name + ln - ls, r->drop_suffix)) continue;
        err = gguf_writer_add_tensor(w, name, t->type, t->n_dims, t->ne, t->data, t->size);
    }
    for (int i = 0; i < r->n_adds && !err; i++) {
        const tensor_add *a = &r->adds[i];
        uint64_t n = a->ne0 * (a->ne1 ? a->ne1 : 1), ne[2] = {a->ne0, a->ne1};
        float *v = malloc(n * sizeof(float));
        for (uint64_t k = 0; k < n; k++) v[k] = a->value;
        err = gguf_writer_add_tensor(w, a->name, QUANT_F32, a->ne1 ? 2 : 1, ne, v, n * sizeof(float));
        free(v);
    }
    if (!err) err = gguf_writer_write(w, dst, msg, sizeof(msg));
    gguf_writer_free(w);
    gguf_close(g);
    return err;
}

static void expect_refused(const char *base, const char *path, const char *what, const rewrite *r, int want_err,
                           const char *want_text) {
    char msg[KVS_MSG_MAX] = "";
    CHECK_EQ_INT(write_rewrite(base, path, r), KVS_OK);
    model *m = NULL;
    int err = model_load(path, 0, 0, &m, msg, sizeof(msg));
    printf("  %-34s -> %s: %s\n", what, kvs_strerror(err), msg);
    CHECK_EQ_INT(err, want_err);
    CHECK(m == NULL);
    if (!strstr(msg, want_text)) {
        fprintf(stderr, "message '%s' does not contain '%s'\n", msg, want_text);
        test_failures_++;
    }
    model_free(m);
}

/* All logits of a fixed 6-token prompt, one batch; NULL on failure. */
static float *run_logits(const char *path, int *n_vocab) {
    engine_params ep = engine_default_params();
    ep.model_path = path;
    ep.n_threads = 2;
    ep.kv.budget_bytes = 4ull << 20;
    engine *e = NULL;
    char msg[KVS_MSG_MAX] = "";
    if (engine_open(&ep, &e, msg, sizeof(msg)) != KVS_OK) {
        fprintf(stderr, "engine_open(%s): %s\n", path, msg);
        return NULL;
    }
    static const int32_t toks[6] = {1, 70, 101, 33, 250, 7};
    int nv = (int)e->m->hp.n_vocab;
    float *out = malloc(6 * (size_t)nv * sizeof(float)), *kv = malloc(6 * (size_t)nv * sizeof(float));
    engine_req req = {.epoch = 1, .n = 6, .tokens = toks, .out_mode = FWD_OUT_LOGITS_ALL, .out = out};
    req.sid.bytes[0] = 1;
    CHECK_EQ_INT(engine_step(e, &req, 1), KVS_OK);
    /* The KV path gives the same bits whatever the architecture's options. */
    engine_req p = {.epoch = 1, .n = 3, .tokens = toks, .out_mode = FWD_OUT_LOGITS_ALL, .out = kv};
    p.sid.bytes[0] = 2;
    CHECK_EQ_INT(engine_step(e, &p, 1), KVS_OK);
    for (uint32_t i = 3; i < 6; i++) {
        engine_req d = {.epoch = 1, .start_pos = i, .n = 1, .tokens = &toks[i], .out_mode = FWD_OUT_LOGITS_LAST,
                        .out = kv + (size_t)i * (size_t)nv};
        d.sid.bytes[0] = 2;
        CHECK_EQ_INT(engine_step(e, &d, 1), KVS_OK);
    }
    CHECK(memcmp(out, kv, 6 * (size_t)nv * sizeof(float)) == 0);
    bool finite = true;
    for (size_t i = 0; i < 6 * (size_t)nv; i++) finite = finite && isfinite(out[i]);
    CHECK(finite);
    free(kv);
    engine_close(e);
    *n_vocab = nv;
    return out;
}

static void test_rope_ops(void) {
    /* neox on [a0..a7 | b0..b7] == adjacent-pair rope on (a0 b0 a1 b1 ...). */
    enum { HD = 16, NR = 16, NH = 3 };
    float inv[NR / 2], x[NH * HD], y[NH * HD];
    ops_rope_freqs(inv, NR, 10000.0f, 1.0f, NULL);
    for (int i = 0; i < NH * HD; i++) x[i] = (float)sin(0.37 * i + 0.1);
    for (int h = 0; h < NH; h++)
        for (int i = 0; i < NR / 2; i++) {
            y[h * HD + 2 * i] = x[h * HD + i];
            y[h * HD + 2 * i + 1] = x[h * HD + i + NR / 2];
        }
    float cs[NR];
    ops_rope_cs(cs, NR, 11, inv);
    CHECK(cs[2] == (float)cos(11.0 * (double)inv[1]) && cs[3] == (float)sin(11.0 * (double)inv[1]));
    ops_rope_neox(x, NH, HD, NR, cs);
    ops_rope(y, NH, HD, NR, cs);
    int same = 1;
    for (int h = 0; h < NH; h++)
        for (int i = 0; i < NR / 2; i++)
            same &= x[h * HD + i] == y[h * HD + 2 * i] && x[h * HD + i + NR / 2] == y[h * HD + 2 * i + 1];
    CHECK(same);
    /* Factors divide, linear scaling multiplies; both exactly for powers of two. */
    float plain[NR / 2], scaled[NR / 2], factors[NR / 2], divided[NR / 2];
    for (int i = 0; i < NR / 2; i++) factors[i] = (float)(1 << (i % 3));
    ops_rope_freqs(plain, NR, 500000.0f, 1.0f, NULL);
    ops_rope_freqs(scaled, NR, 500000.0f, 0.25f, NULL);
    ops_rope_freqs(divided, NR, 500000.0f, 1.0f, factors);
    for (int i = 0; i < NR / 2; i++) {
        CHECK(scaled[i] == plain[i] * 0.25f);
        CHECK(divided[i] == plain[i] / factors[i]);
    }
    /* Position 4p at scale 1/4 is position p unscaled. */
    float a[HD], b[HD];
    for (int i = 0; i < HD; i++) a[i] = b[i] = (float)cos(0.21 * i);
    float csa[NR], csb[NR];
    ops_rope_cs(csa, NR, 4 * 9, scaled);
    ops_rope_cs(csb, NR, 9, plain);
    ops_rope(a, 1, HD, NR, csa);
    ops_rope(b, 1, HD, NR, csb);
    CHECK(memcmp(a, b, sizeof(a)) == 0);
}

int main(void) {
    check_expected_isa("test_arch");
    char dir[] = "/tmp/kvs-arch-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char base[256], path[256], path2[256], msg[KVS_MSG_MAX];
    snprintf(base, sizeof(base), "%s/tiny.gguf", dir);
    snprintf(path, sizeof(path), "%s/variant.gguf", dir);
    snprintf(path2, sizeof(path2), "%s/variant2.gguf", dir);
    mkmodel_params mp = mkmodel_default_params();
    mp.n_threads = 1;
    CHECK_EQ_INT(mkmodel_write(base, mp, msg, sizeof(msg)), KVS_OK);

    /* The table. */
    CHECK(arch_find("llama") != NULL && arch_find("qwen2") != NULL && arch_find("gpt2") == NULL);
    CHECK(arch_find("llama")->rope_style == ARCH_ROPE_NORM);
    CHECK(arch_find("qwen2")->rope_style == ARCH_ROPE_NEOX && arch_find("qwen2")->qkv_bias == ARCH_TENSOR_REQUIRED);
    int n_archs = 0;
    while (arch_at(n_archs)) n_archs++;
    CHECK_EQ_INT(n_archs, 5);
    CHECK(arch_find("qwen3") && arch_find("qwen3")->qk_norm == ARCH_TENSOR_REQUIRED &&
          arch_find("qwen3")->qkv_bias == ARCH_TENSOR_ABSENT && arch_find("qwen3")->rope_style == ARCH_ROPE_NEOX);
    CHECK(arch_find("gemma3") && arch_find("gemma3")->swa_period == 6 && arch_find("gemma3")->post_norms &&
          arch_find("gemma3")->embd_scale && arch_find("gemma3")->ffn_act == ARCH_FFN_GELU_TANH);
    CHECK(arch_find("phi3") && arch_find("phi3")->fused_qkv && arch_find("phi3")->fused_gate_up &&
          arch_find("phi3")->longrope);
    CHECK(arch_find("qwen35") == NULL && arch_find("gemma3n") == NULL);
    test_rope_ops();

    printf("refusals:\n");
    /* tiny: n_embd 64, 2 layers, 4 heads (16 each), 2 kv heads, n_ff 128. */
    const kv_set moe_kv[] = {{"llama.expert_count", GGUF_VT_U32, 8, 0, NULL},
                             {"llama.expert_used_count", GGUF_VT_U32, 2, 0, NULL}};
    const tensor_add moe_t[] = {{"blk.0.ffn_gate_inp.weight", 64, 8, 0.0f}, {"blk.1.ffn_gate_inp.weight", 64, 8, 0.0f}};
    rewrite r = {.kvs = moe_kv, .n_kvs = 2, .adds = moe_t, .n_adds = 2};
    expect_refused(base, path, "Mixtral-shaped llama (8 experts)", &r, KVS_ERR_UNSUPPORTED,
                   "'llama.expert_count' is 8: mixture-of-experts models (e.g. Mixtral) are not supported");
    const kv_set arch_kv[] = {{"general.architecture", GGUF_VT_STRING, 0, 0, "mamba"}};
    r = (rewrite){.kvs = arch_kv, .n_kvs = 1};
    expect_refused(base, path, "unknown architecture", &r, KVS_ERR_UNSUPPORTED,
                   "architecture 'mamba' is not supported (kvshard runs: llama, qwen2, qwen3, gemma3, phi3)");
    /* Families llama.cpp runs that the one forward pass cannot: refused naming what is missing. */
    static const struct { const char *arch, *want; } out_of_reach[] = {
        {"qwen35", "architecture 'qwen35' is not supported: it needs hybrid recurrent layers (gated delta-net)"},
        {"gemma3n", "architecture 'gemma3n' is not supported: it needs per-layer embeddings"},
        {"qwen3moe", "architecture 'qwen3moe' is not supported: it needs a mixture of experts"},
    };
    for (size_t i = 0; i < sizeof(out_of_reach) / sizeof(out_of_reach[0]); i++) {
        r = (rewrite){.rename_arch = out_of_reach[i].arch};
        expect_refused(base, path, out_of_reach[i].arch, &r, KVS_ERR_UNSUPPORTED, out_of_reach[i].want);
    }
    const tensor_add exps_t[] = {{"blk.0.ffn_gate_exps.weight", 64, 128, 0.0f}};
    r = (rewrite){.adds = exps_t, .n_adds = 1};
    expect_refused(base, path, "expert tensors without expert_count", &r, KVS_ERR_UNSUPPORTED,
                   "tensor 'blk.0.ffn_gate_exps.weight' holds mixture-of-experts weights");
    const tensor_add ple_t[] = {{"per_layer_token_embd.weight", 64, 8, 0.0f}};
    r = (rewrite){.rename_arch = "gemma3", .adds = ple_t, .n_adds = 1};
    expect_refused(base, path, "gemma3 with per-layer embeddings", &r, KVS_ERR_UNSUPPORTED,
                   "tensor 'per_layer_token_embd.weight' belongs to per-layer embeddings");
    const kv_set yarn_kv[] = {{"llama.rope.scaling.type", GGUF_VT_STRING, 0, 0, "yarn"},
                              {"llama.rope.scaling.factor", GGUF_VT_F32, 0, 4.0f, NULL}};
    r = (rewrite){.kvs = yarn_kv, .n_kvs = 2};
    expect_refused(base, path, "rope scaling yarn", &r, KVS_ERR_UNSUPPORTED,
                   "rope scaling type 'yarn' (llama.rope.scaling.type) is not supported (kvshard implements none and "
                   "linear)");
    const kv_set longrope_kv[] = {{"llama.rope.scaling.type", GGUF_VT_STRING, 0, 0, "longrope"}};
    r = (rewrite){.kvs = longrope_kv, .n_kvs = 1};
    expect_refused(base, path, "rope scaling longrope", &r, KVS_ERR_UNSUPPORTED, "rope scaling type 'longrope'");
    const kv_set kvlen_kv[] = {{"llama.attention.key_length", GGUF_VT_U32, 16, 0, NULL},
                               {"llama.attention.value_length", GGUF_VT_U32, 8, 0, NULL}};
    r = (rewrite){.kvs = kvlen_kv, .n_kvs = 2};
    expect_refused(base, path, "key_length != value_length", &r, KVS_ERR_UNSUPPORTED,
                   "attention.key_length 16 differs from attention.value_length 8");
    const tensor_add extra_t[] = {{"blk.1.post_attention_norm.weight", 64, 0, 1.0f}};
    r = (rewrite){.adds = extra_t, .n_adds = 1};
    expect_refused(base, path, "a tensor no family uses", &r, KVS_ERR_UNSUPPORTED,
                   "tensor 'blk.1.post_attention_norm.weight' is not used by a dense 'llama' model");
    r = (rewrite){.rename_arch = "qwen2"};
    expect_refused(base, path, "qwen2 without q/k/v biases", &r, KVS_ERR_FORMAT, "tensor 'blk.0.attn_q.bias' is missing");
    const tensor_add qbias[] = {{"blk.0.attn_q.bias", 64, 0, 0.0f}, {"blk.0.attn_k.bias", 32, 0, 0.0f},
                                {"blk.0.attn_v.bias", 32, 0, 0.0f}, {"blk.1.attn_q.bias", 64, 0, 0.0f},
                                {"blk.1.attn_k.bias", 32, 0, 0.0f}, {"blk.1.attn_v.bias", 32, 0, 0.0f},
                                {"blk.0.attn_output.bias", 64, 0, 0.0f}};
    r = (rewrite){.rename_arch = "qwen2", .adds = qbias, .n_adds = 7};
    expect_refused(base, path, "qwen2 with an output bias", &r, KVS_ERR_UNSUPPORTED,
                   "tensor 'blk.0.attn_output.bias' is not used by a dense 'qwen2' model");
    const kv_set lin0_kv[] = {{"llama.rope.scaling.type", GGUF_VT_STRING, 0, 0, "linear"},
                              {"llama.rope.scaling.factor", GGUF_VT_F32, 0, -2.0f, NULL}};
    r = (rewrite){.kvs = lin0_kv, .n_kvs = 2};
    expect_refused(base, path, "negative linear factor", &r, KVS_ERR_FORMAT, "linear rope scaling factor -2");
    const tensor_add badf[] = {{"rope_freqs.weight", 8, 0, 0.0f}};
    r = (rewrite){.adds = badf, .n_adds = 1};
    expect_refused(base, path, "rope_freqs factor 0", &r, KVS_ERR_FORMAT, "rope_freqs.weight[0] = 0");

    /* qwen2: keys under qwen2.*, its default eps, neox rope; loads with biases. */
    r = (rewrite){.rename_arch = "qwen2", .adds = qbias, .n_adds = 6};
    CHECK_EQ_INT(write_rewrite(base, path, &r), KVS_OK);
    model *m = NULL;
    CHECK_EQ_INT(model_load(path, 0, 0, &m, msg, sizeof(msg)), KVS_OK);
    if (m) {
        CHECK(m->hp.arch == arch_find("qwen2"));
        CHECK_EQ_INT(m->hp.n_embd, 64);
        CHECK(m->layers[0].bq != NULL && m->layers[1].bv != NULL && m->layers[0].bo == NULL);
        model_free(m);
    }

    /* llama: zero biases change nothing (bit for bit); non-zero ones do. */
    int nv = 0, nv2 = 0;
    float *plain = run_logits(base, &nv);
    r = (rewrite){.adds = qbias, .n_adds = 7};
    CHECK_EQ_INT(write_rewrite(base, path, &r), KVS_OK);
    float *zero_bias = run_logits(path, &nv2);
    CHECK(plain && zero_bias && nv == nv2);
    if (plain && zero_bias) CHECK(memcmp(plain, zero_bias, 6 * (size_t)nv * sizeof(float)) == 0);
    const tensor_add vbias[] = {{"blk.0.attn_v.bias", 32, 0, 0.5f}};
    r = (rewrite){.adds = vbias, .n_adds = 1};
    CHECK_EQ_INT(write_rewrite(base, path, &r), KVS_OK);
    float *v_bias = run_logits(path, &nv2);
    CHECK(v_bias != NULL);
    if (plain && v_bias) CHECK(memcmp(plain, v_bias, 6 * (size_t)nv * sizeof(float)) != 0);
    free(zero_bias);
    free(v_bias);

    /* rope_freqs all 1 and linear factor 1 change nothing; factors 2 do. */
    const tensor_add ones[] = {{"rope_freqs.weight", 8, 0, 1.0f}};
    const kv_set lin1_kv[] = {{"llama.rope.scaling.type", GGUF_VT_STRING, 0, 0, "linear"},
                              {"llama.rope.scaling.factor", GGUF_VT_F32, 0, 1.0f, NULL}};
    r = (rewrite){.kvs = lin1_kv, .n_kvs = 2, .adds = ones, .n_adds = 1};
    CHECK_EQ_INT(write_rewrite(base, path, &r), KVS_OK);
    float *unit = run_logits(path, &nv2);
    CHECK(unit != NULL);
    if (plain && unit) CHECK(memcmp(plain, unit, 6 * (size_t)nv * sizeof(float)) == 0);
    free(unit);
    const tensor_add twos[] = {{"rope_freqs.weight", 8, 0, 2.0f}};
    r = (rewrite){.adds = twos, .n_adds = 1};
    CHECK_EQ_INT(write_rewrite(base, path, &r), KVS_OK);
    m = NULL;
    CHECK_EQ_INT(model_load(path, 0, 0, &m, msg, sizeof(msg)), KVS_OK);
    model *m0 = NULL;
    CHECK_EQ_INT(model_load(base, 0, 0, &m0, msg, sizeof(msg)), KVS_OK);
    if (m && m0)
        for (int i = 0; i < 8; i++) CHECK(m->rope_inv_freq[i] == m0->rope_inv_freq[i] / 2.0f);
    model_free(m);
    /* Linear factor 4: frequencies x 1/4. */
    const kv_set lin4_kv[] = {{"llama.rope.scaling.type", GGUF_VT_STRING, 0, 0, "linear"},
                              {"llama.rope.scaling.factor", GGUF_VT_F32, 0, 4.0f, NULL}};
    r = (rewrite){.kvs = lin4_kv, .n_kvs = 2};
    CHECK_EQ_INT(write_rewrite(base, path, &r), KVS_OK);
    m = NULL;
    CHECK_EQ_INT(model_load(path, 0, 0, &m, msg, sizeof(msg)), KVS_OK);
    if (m && m0) {
        CHECK(m->hp.rope_freq_scale == 0.25f);
        for (int i = 0; i < 8; i++) CHECK(m->rope_inv_freq[i] == m0->rope_inv_freq[i] * 0.25f);
    }
    model_free(m);
    model_free(m0);
    free(plain);

    /* key_length 32 (n_embd / n_head is 16): q/k/v/o shaped by 32-wide heads. */
    const kv_set klen_kv[] = {{"llama.attention.key_length", GGUF_VT_U32, 32, 0, NULL},
                              {"llama.attention.value_length", GGUF_VT_U32, 32, 0, NULL},
                              {"llama.rope.dimension_count", GGUF_VT_U32, 32, 0, NULL}};
    const tensor_add klen_t[] = {
        {"blk.0.attn_q.weight", 64, 128, 0.01f}, {"blk.0.attn_k.weight", 64, 64, 0.02f},
        {"blk.0.attn_v.weight", 64, 64, 0.03f},  {"blk.0.attn_output.weight", 128, 64, 0.01f},
        {"blk.1.attn_q.weight", 64, 128, 0.01f}, {"blk.1.attn_k.weight", 64, 64, -0.02f},
        {"blk.1.attn_v.weight", 64, 64, 0.03f},  {"blk.1.attn_output.weight", 128, 64, -0.01f}};
    /* Drop the old attention matrices by writing the model in two steps. */
    rewrite drop_q = {.drop_suffix = "attn_q.weight"}, drop_k = {.drop_suffix = "attn_k.weight"};
    rewrite drop_v = {.drop_suffix = "attn_v.weight"}, drop_o = {.drop_suffix = "attn_output.weight"};
    CHECK_EQ_INT(write_rewrite(base, path, &drop_q), KVS_OK);
    CHECK_EQ_INT(write_rewrite(path, path2, &drop_k), KVS_OK);
    CHECK_EQ_INT(write_rewrite(path2, path, &drop_v), KVS_OK);
    CHECK_EQ_INT(write_rewrite(path, path2, &drop_o), KVS_OK);
    r = (rewrite){.kvs = klen_kv, .n_kvs = 3, .adds = klen_t, .n_adds = 8};
    CHECK_EQ_INT(write_rewrite(path2, path, &r), KVS_OK);
    m = NULL;
    CHECK_EQ_INT(model_load(path, 0, 0, &m, msg, sizeof(msg)), KVS_OK);
    if (m) {
        CHECK_EQ_INT(m->hp.head_dim, 32);
        CHECK_EQ_INT(m->layers[0].wq.n_out, 128);
        CHECK_EQ_INT(m->layers[0].wo.n_in, 128);
    } else {
        fprintf(stderr, "key_length model: %s\n", msg);
    }
    model_free(m);
    float *wide = run_logits(path, &nv2);
    CHECK(wide != NULL);
    free(wide);

    unlink(path);
    unlink(path2);
    unlink(base);
    rmdir(dir);
    return test_finish("test_arch", 1, 0);
}
