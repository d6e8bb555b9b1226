/*
 * model: a layer range of a llama GGUF. Variants of a synthetic model written
 * through the GGUF writer — another architecture, zero heads, a KV head count
 * that does not divide the heads, a layer count above (or below) the tensors
 * present, a missing tensor, a tensor of the wrong shape, bad rope / eps
 * settings — are each refused with the right code and a message naming the
 * problem; ranges load only their own tensors; output falls back to token_embd;
 * repacking shared out over a pool gives the bytes of one made on the calling
 * thread.
 */
#include <stdlib.h>

#include "gguf.h"
#include "isa_check.h"
#include "mkmodel.h"
#include "model.h"
#include "quant.h"
#include "test.h"

typedef struct {
    const char *key;       /* metadata key to override (NULL: none) */
    uint32_t u32;          /* its new u32 value, unless str is set */
    const char *str;       /* its new string value */
    bool as_f32;           /* write u32 as float instead */
    const char *drop;      /* tensor to leave out */
    const char *transpose; /* tensor whose two dims are swapped (same bytes) */
} variant;

/* A Q4_K_M mix (q4_k, q6_k) at the small shape, loaded once repacked on the
 * calling thread and once on a pool of three: every repacked matrix has the
 * same layout and bytes. The ffn matrices have 64 row groups, four of the
 * loader's chunks, so the pool's threads split them. */
static void test_pooled_repack(const char *dir) {
    char path[256], msg[KVS_MSG_MAX];
    snprintf(path, sizeof(path), "%s/small-q4_k_m.gguf", dir);
    mkmodel_params mp = mkmodel_default_params();
    mp.shape = "small";
    mp.type = QUANT_Q4_K;
    mp.k_m = true;
    mp.n_threads = 1;
    CHECK_EQ_INT(mkmodel_write(path, mp, msg, sizeof(msg)), KVS_OK);
    ops_pool *pool = ops_pool_create(3);
    CHECK(pool != NULL);
    model *one = NULL, *many = NULL;
    CHECK_EQ_INT(model_load(path, 0, 0, &one, msg, sizeof(msg)), KVS_OK);
    CHECK_EQ_INT(model_load_on(path, 0, 0, pool, &many, msg, sizeof(msg)), KVS_OK);
    if (one && many) {
        printf("pooled repack: %d matrices repacked (%d on the calling thread)\n", many->n_repacked, one->n_repacked);
        CHECK_EQ_INT(many->n_repacked, one->n_repacked);
        if (quant_r8_preferred(QUANT_Q4_K)) CHECK(one->n_repacked > 0);
        for (uint32_t l = 0; l <= one->last - one->first; l++)
            for (int k = 0; k < MODEL_LAYER_MATRICES; k++) {
                const bool out = l == one->last - one->first; /* past the layers: the output */
                if (out && k > 0) break;
                const ops_weight *a = out ? &one->output : model_layer_matrix(&one->layers[l], k);
                const ops_weight *b = out ? &many->output : model_layer_matrix(&many->layers[l], k);
                CHECK_EQ_INT(a->layout, b->layout);
                CHECK(memcmp(a->data, b->data, (size_t)a->n_out * a->row_bytes) == 0);
            }
    }
    model_free(one);
    model_free(many);
    ops_pool_free(pool);
    unlink(path);
}

/* A fused file (phi3: attn_qkv, gate+up in ffn_up): each part of a fused matrix
 * is repacked like a separate matrix wherever the CPU has an r8 kernel for its
 * type. Its parts were once bound from an uninitialised struct, so whether they
 * were repacked (and so the exact logits) depended on stack garbage. Returns 1
 * when it ran, 0 when the file is absent. */
static int test_fused_repack(void) {
    char path[1024], msg[KVS_MSG_MAX];
    if (!test_shared_path("downloads/models/phi3-synth-Q4_K_M.gguf", path, sizeof path)) return 0;
    model *m = NULL;
    CHECK_EQ_INT(model_load(path, 0, 0, &m, msg, sizeof(msg)), KVS_OK);
    if (!m) return 1;
    int want = 0;
    for (uint32_t l = 0; l < m->last - m->first; l++)
        for (int k = 0; k < MODEL_LAYER_MATRICES; k++) {
            const ops_weight *w = model_layer_matrix(&m->layers[l], k);
            const bool r8 = quant_r8_preferred(w->type) && w->n_out % 8 == 0;
            want += r8;
            CHECK_EQ_INT(w->layout, r8 ? OPS_R8 : OPS_ROWS);
        }
    want += quant_r8_preferred(m->output.type) && m->output.n_out % 8 == 0;
    printf("fused repack: %d of %d matrices repacked\n", m->n_repacked, want);
    CHECK_EQ_INT(m->n_repacked, want);
    model_free(m);
    return 1;
}

/* Copies src to dst with the variant applied. */
static int write_variant(const char *src, const char *dst, const variant *v) {
    gguf_ctx *g = NULL;
    char msg[KVS_MSG_MAX];
    int err = gguf_open(src, &g, msg, sizeof(msg));
    if (err) return err;
    gguf_writer *w = gguf_writer_create();
    char key[256];
    for (uint64_t i = 0; i < gguf_n_kv(g); i++) {
        const gguf_kv *kv = gguf_kv_at(g, i);
        snprintf(key, sizeof(key), "%.*s", (int)kv->key.len, kv->key.ptr);
        if (!strcmp(key, "general.alignment")) continue;
        if (v->key && !strcmp(key, v->key)) continue;
        if (kv->type == GGUF_VT_STRING) {
            gguf_writer_set_strn(w, key, kv->str.ptr, kv->str.len);
        } else if (kv->type == GGUF_VT_ARRAY && kv->arr_type == GGUF_VT_STRING) {
            const char **strs = calloc(kv->arr_n, sizeof(char *));
            for (uint64_t k = 0; k < kv->arr_n; k++) {
                char *c = calloc(kv->arr_strs[k].len + 1, 1);
                memcpy(c, kv->arr_strs[k].ptr, kv->arr_strs[k].len);
                strs[k] = c;
            }
            gguf_writer_set_arr(w, key, GGUF_VT_STRING, strs, kv->arr_n);
            for (uint64_t k = 0; k < kv->arr_n; k++) free((void *)strs[k]);
            free(strs);
        } else if (kv->type == GGUF_VT_ARRAY) {
            gguf_writer_set_arr(w, key, kv->arr_type, kv->arr_data, kv->arr_n); /* little-endian host */
        } else {
            uint8_t raw[8];
            switch (kv->type) {
            case GGUF_VT_F32: { float f = (float)kv->val.f; memcpy(raw, &f, 4); break; }
            case GGUF_VT_F64: memcpy(raw, &kv->val.f, 8); break;
            case GGUF_VT_BOOL: raw[0] = kv->val.b; break;
            default: memcpy(raw, &kv->val.u, 8); break; /* low bytes first on little-endian */
            }
            gguf_writer_set_scalar(w, key, kv->type, raw);
        }
    }
    if (v->key) {
        if (v->str) gguf_writer_set_str(w, v->key, v->str);
        else if (v->as_f32) gguf_writer_set_f32(w, v->key, (float)v->u32);
        else gguf_writer_set_u32(w, v->key, v->u32);
    }
    for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
        const gguf_tensor *t = gguf_tensor_at(g, i);
        char name[256];
        snprintf(name, sizeof(name), "%.*s", (int)t->name.len, t->name.ptr);
        if (v->drop && !strcmp(name, v->drop)) continue;
        uint64_t ne[4] = {t->ne[0], t->ne[1], t->ne[2], t->ne[3]};
        if (v->transpose && !strcmp(name, v->transpose)) {
            ne[0] = t->ne[1];
            ne[1] = t->ne[0];
        }
        gguf_writer_add_tensor(w, name, t->type, t->n_dims, ne, t->data, t->size);
    }
    err = gguf_writer_write(w, dst, msg, sizeof(msg));
    gguf_writer_free(w);
    gguf_close(g);
    return err;
}

static void expect_refused(const char *base, const char *dir, const char *what, const variant *v, int want_err,
                           const char *want_text) {
    char path[512], msg[KVS_MSG_MAX] = "";
    snprintf(path, sizeof(path), "%s/variant.gguf", dir);
    CHECK_EQ_INT(write_variant(base, path, v), KVS_OK);
    model *m = NULL;
    int err = model_load(path, 0, 0, &m, msg, sizeof(msg));
    printf("  %-40s -> %s: %s\n", what, kvs_strerror(err), msg);
    CHECK_EQ_INT(err, want_err);
    CHECK(m == NULL);
    CHECK(msg[0] != 0);
    if (want_text && !strstr(msg, want_text)) {
        fprintf(stderr, "message '%s' does not mention '%s'\n", msg, want_text);
        test_failures_++;
    }
    model_free(m);
    unlink(path);
}

int main(void) {
    check_expected_isa("test_model");
    char dir[] = "/tmp/kvs-model-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char base[256], msg[KVS_MSG_MAX];
    snprintf(base, sizeof(base), "%s/tiny.gguf", dir);
    mkmodel_params mp = mkmodel_default_params();
    mp.shape = "tiny";
    mp.type = QUANT_F32;
    mp.n_threads = 1;
    CHECK_EQ_INT(mkmodel_write(base, mp, msg, sizeof(msg)), KVS_OK);

    /* The unmodified copy loads; so do its ranges, each with only its own tensors. */
    variant none = {0};
    char copy[256];
    snprintf(copy, sizeof(copy), "%s/copy.gguf", dir);
    CHECK_EQ_INT(write_variant(base, copy, &none), KVS_OK);
    model *whole = NULL, *head = NULL, *tail = NULL;
    CHECK_EQ_INT(model_load(copy, 0, 0, &whole, msg, sizeof(msg)), KVS_OK);
    CHECK_EQ_INT(model_load(copy, 0, 1, &head, msg, sizeof(msg)), KVS_OK);
    CHECK_EQ_INT(model_load(copy, 1, 2, &tail, msg, sizeof(msg)), KVS_OK);
    if (whole && head && tail) {
        CHECK_EQ_INT(whole->hp.n_embd, 64);
        CHECK_EQ_INT(whole->hp.n_layer, 2);
        CHECK_EQ_INT(whole->hp.n_head_kv, 2);
        CHECK(head->has_embd && !head->has_head);
        CHECK(!tail->has_embd && tail->has_head);
        /* Each half maps its layers plus embd or head: the two add up to the whole. */
        CHECK_EQ_INT(head->weight_bytes + tail->weight_bytes, whole->weight_bytes);
        CHECK(head->weight_bytes < whole->weight_bytes && tail->weight_bytes < whole->weight_bytes);
    }
    model_free(whole);
    model_free(head);
    model_free(tail);
    model *m = NULL;
    CHECK_EQ_INT(model_load(copy, 1, 1, &m, msg, sizeof(msg)), KVS_ERR_INVALID_ARG);
    CHECK_EQ_INT(model_load(copy, 0, 3, &m, msg, sizeof(msg)), KVS_ERR_INVALID_ARG);
    CHECK_EQ_INT(model_load("/nonexistent/model.gguf", 0, 0, &m, msg, sizeof(msg)) != KVS_OK, 1);

    /* Output tied to token_embd when output.weight is absent. */
    variant tied = {.drop = "output.weight"};
    CHECK_EQ_INT(write_variant(base, copy, &tied), KVS_OK);
    CHECK_EQ_INT(model_load(copy, 0, 0, &m, msg, sizeof(msg)), KVS_OK);
    if (m) CHECK(m->output.data == m->tok_embd.data);
    model_free(m);

    printf("refusals:\n");
    variant v;
    v = (variant){.key = "general.architecture", .str = "gpt2"};
    expect_refused(base, dir, "architecture gpt2", &v, KVS_ERR_UNSUPPORTED, "gpt2");
    v = (variant){.key = "llama.attention.head_count", .u32 = 0};
    expect_refused(base, dir, "zero heads", &v, KVS_ERR_FORMAT, "head_count");
    v = (variant){.key = "llama.attention.head_count_kv", .u32 = 3};
    expect_refused(base, dir, "kv heads not dividing heads", &v, KVS_ERR_FORMAT, "head_count_kv");
    v = (variant){.key = "llama.block_count", .u32 = 3};
    expect_refused(base, dir, "layer count above tensors present", &v, KVS_ERR_FORMAT, "blk.2");
    v = (variant){.key = "llama.block_count", .u32 = 1};
    expect_refused(base, dir, "layer count below tensors present", &v, KVS_ERR_FORMAT, "blk.1");
    v = (variant){.key = "llama.embedding_length", .u32 = 68};
    expect_refused(base, dir, "n_embd not matching tensors", &v, KVS_ERR_FORMAT, "token_embd");
    v = (variant){.key = "llama.rope.dimension_count", .u32 = 7};
    expect_refused(base, dir, "odd rope dimension", &v, KVS_ERR_FORMAT, "rope");
    v = (variant){.key = "llama.attention.layer_norm_rms_epsilon", .u32 = 0, .as_f32 = true};
    expect_refused(base, dir, "zero rms epsilon", &v, KVS_ERR_FORMAT, "epsilon");
    v = (variant){.key = "llama.feed_forward_length", .u32 = 0};
    expect_refused(base, dir, "zero n_ff", &v, KVS_ERR_FORMAT, "feed_forward_length");
    v = (variant){.drop = "blk.1.ffn_up.weight"};
    expect_refused(base, dir, "missing tensor", &v, KVS_ERR_FORMAT, "blk.1.ffn_up.weight");
    v = (variant){.drop = "token_embd.weight"};
    expect_refused(base, dir, "missing token_embd", &v, KVS_ERR_FORMAT, "token_embd");
    v = (variant){.transpose = "blk.0.attn_k.weight"};
    expect_refused(base, dir, "tensor of the wrong shape", &v, KVS_ERR_FORMAT, "blk.0.attn_k.weight");
    test_pooled_repack(dir);
    unlink(copy);
    unlink(base);
    rmdir(dir);
    const int fused = test_fused_repack();
    return test_finish("test_model", 1 + fused, 1 - fused);
}
