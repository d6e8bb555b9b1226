/* test_gguf — reader on the shared models, writer round trips, and refusal of
 * corrupted files (targeted patches, truncation at every header byte, random
 * byte flips). */
#include <dirent.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/stat.h>

#include "gguf.h"
#include "quant.h"
#include "test.h"
#include "util.h"

static int n_run, n_skipped;
static char tmp_dir[256];

/* ---------------------------------------------------------------- helpers */


/* Opens an exact-size heap copy of buf[0..n) (so ASan sees any overread);
 * returns the rc and leaves the message in msg. */
static int open_copy(const uint8_t *buf, size_t n, char *msg, size_t cap) {
    uint8_t *c = malloc(n ? n : 1);
    if (n) memcpy(c, buf, n);
    gguf_ctx *g = NULL;
    msg[0] = '\0';
    int rc = gguf_open_buffer(c, n, &g, msg, cap);
    if (rc == KVS_OK) CHECK(g != NULL);
    else CHECK(g == NULL);
    gguf_close(g);
    free(c);
    return rc;
}

static bool verbose(void) { return getenv("KVS_TEST_VERBOSE") != NULL; }

/* Expects buf to be refused with want (or any error when want == 1). */
static void expect_refused(const uint8_t *buf, size_t n, int want, const char *what) {
    char msg[KVS_MSG_MAX];
    int rc = open_copy(buf, n, msg, sizeof msg);
    if (want == 1) {
        if (rc == KVS_OK) fprintf(stderr, "accepted: %s\n", what);
        CHECK(rc != KVS_OK);
    } else {
        if (rc != want) fprintf(stderr, "case: %s (msg: %s)\n", what, msg);
        CHECK_EQ_INT(rc, want);
    }
    if (rc != KVS_OK) {
        if (msg[0] == '\0') fprintf(stderr, "empty message: %s\n", what);
        CHECK(msg[0] != '\0');
    }
    if (verbose()) printf("  %-40s -> %d %s\n", what, rc, msg);
}

static uint64_t pos_of(const gguf_ctx *g, const void *p) {
    return (uint64_t)((const uint8_t *)p - (const uint8_t *)gguf_base(g));
}

/* File offsets of one tensor info's fields. */
typedef struct {
    uint64_t name_len, n_dims, ne, type, offset;
} tinfo_pos;

static tinfo_pos tensor_pos(const gguf_ctx *g, const gguf_tensor *t) {
    tinfo_pos p;
    p.name_len = pos_of(g, t->name.ptr) - 8;
    p.n_dims = pos_of(g, t->name.ptr) + t->name.len;
    p.ne = p.n_dims + 4;
    p.type = p.ne + 8 * t->n_dims;
    p.offset = p.type + 4;
    return p;
}

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* -------------------------------------------------------- shared models */

static bool ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

static void check_common(const char *path, gguf_ctx *g) {
    CHECK(gguf_version(g) == 2 || gguf_version(g) == 3);
    CHECK(gguf_n_tensors(g) > 0);
    gguf_str arch;
    CHECK_EQ_INT(gguf_get_str(g, "general.architecture", &arch), KVS_OK);
    CHECK(gguf_str_eq(arch, "llama"));
    uint32_t n_layer = 0, n_embd = 0;
    CHECK_EQ_INT(gguf_get_u32(g, "llama.block_count", &n_layer), KVS_OK);
    CHECK_EQ_INT(gguf_get_u32(g, "llama.embedding_length", &n_embd), KVS_OK);
    const gguf_tensor *te = gguf_find_tensor(g, "token_embd.weight");
    CHECK(te != NULL);
    if (te) CHECK_EQ_INT(te->ne[0], n_embd);
    for (uint32_t l = 0; l < n_layer; l++) {
        char name[64];
        snprintf(name, sizeof name, "blk.%u.attn_q.weight", l);
        CHECK(gguf_find_tensor(g, name) != NULL);
    }
    for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
        const gguf_tensor *t = gguf_tensor_at(g, i);
        CHECK(gguf_find_tensor(g, "no.such.tensor") == NULL);
        CHECK(quant_get_traits(t->type) != NULL);
        CHECK(pos_of(g, t->data) == gguf_data_offset(g) + t->offset);
        CHECK(t->offset % gguf_alignment(g) == 0);
        CHECK(gguf_data_offset(g) + t->offset + t->size <= gguf_file_size(g));
        const gguf_tensor *f = gguf_find_tensor(g, "x");
        (void)f;
    }
    const gguf_kv *toks = gguf_find_kv(g, "tokenizer.ggml.tokens");
    CHECK(toks && toks->type == GGUF_VT_ARRAY && toks->arr_type == GGUF_VT_STRING);
    if (verbose()) printf("  %s: v%u, %" PRIu64 " kv, %" PRIu64 " tensors\n", path, gguf_version(g),
                          gguf_n_kv(g), gguf_n_tensors(g));
}

static void check_stories(const char *base, gguf_ctx *g) {
    CHECK_EQ_INT(gguf_version(g), 3);
    uint32_t v = 0;
    CHECK_EQ_INT(gguf_get_u32(g, "llama.block_count", &v), KVS_OK);
    CHECK_EQ_INT(v, 5);
    CHECK_EQ_INT(gguf_get_u32(g, "llama.attention.head_count", &v), KVS_OK);
    CHECK_EQ_INT(v, 8);
    CHECK_EQ_INT(gguf_get_u32(g, "llama.attention.head_count_kv", &v), KVS_OK);
    CHECK_EQ_INT(v, 4);
    CHECK_EQ_INT(gguf_get_u32(g, "llama.feed_forward_length", &v), KVS_OK);
    CHECK_EQ_INT(v, 172);
    float eps = 0;
    CHECK_EQ_INT(gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", &eps), KVS_OK);
    CHECK_NEAR(eps, 1e-5, 1e-9);
    const gguf_kv *toks = gguf_find_kv(g, "tokenizer.ggml.tokens");
    CHECK(toks != NULL);
    if (toks) {
        CHECK_EQ_INT(toks->arr_n, 512);
        CHECK(gguf_str_eq(toks->arr_strs[0], "<unk>"));
        CHECK(gguf_str_eq(toks->arr_strs[1], "<s>"));
        CHECK(gguf_str_eq(toks->arr_strs[3], "<0x00>"));
    }
    const gguf_kv *scores = gguf_find_kv(g, "tokenizer.ggml.scores");
    CHECK(scores && scores->arr_type == GGUF_VT_F32 && scores->arr_n == 512);
    /* the F32 model: 5 layers x 9 tensors + token_embd + output_norm + output */
    const gguf_tensor *q = gguf_find_tensor(g, "blk.0.attn_q.weight");
    const gguf_tensor *k = gguf_find_tensor(g, "blk.4.attn_k.weight");
    const gguf_tensor *dn = gguf_find_tensor(g, "blk.2.ffn_down.weight");
    const gguf_tensor *nrm = gguf_find_tensor(g, "blk.1.attn_norm.weight");
    CHECK(q && k && dn && nrm);
    if (!(q && k && dn && nrm)) return;
    CHECK_EQ_INT(q->ne[0], 64);
    CHECK_EQ_INT(q->ne[1], 64);
    CHECK_EQ_INT(k->ne[1], 32);
    CHECK_EQ_INT(dn->ne[0], 172);
    CHECK_EQ_INT(dn->ne[1], 64);
    CHECK_EQ_INT(nrm->n_dims, 1);
    CHECK_EQ_INT(nrm->type, QUANT_F32);
    if (strcmp(base, "stories260K.gguf") == 0) {
        for (uint64_t i = 0; i < gguf_n_tensors(g); i++) CHECK_EQ_INT(gguf_tensor_at(g, i)->type, QUANT_F32);
        CHECK(gguf_n_tensors(g) == 48 || gguf_n_tensors(g) == 47);
    } else if (strcmp(base, "stories260K-Q8_0.gguf") == 0) {
        CHECK_EQ_INT(q->type, QUANT_Q8_0);
        CHECK_EQ_INT(dn->type, QUANT_F16);
    } else if (strcmp(base, "stories260K-F16.gguf") == 0) {
        CHECK_EQ_INT(q->type, QUANT_F16);
    } else if (strcmp(base, "stories260K-Q4_0.gguf") == 0) {
        CHECK_EQ_INT(q->type, QUANT_Q4_0);
        CHECK_EQ_INT(dn->type, QUANT_F16);
    }
}

static void test_shared_models(void) {
    char buf[512];
    const char *dir = test_shared_path("models", buf, sizeof buf);
    DIR *d = dir ? opendir(dir) : NULL;
    if (!d) {
        n_skipped++;
        return;
    }
    int n_files = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (!ends_with(e->d_name, ".gguf")) continue;
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        char msg[KVS_MSG_MAX] = "";
        gguf_ctx *g = NULL;
        int rc = gguf_open(path, &g, msg, sizeof msg);
        if (rc) fprintf(stderr, "%s: %s\n", path, msg);
        CHECK_EQ_INT(rc, KVS_OK);
        if (!g) continue;
        n_files++;
        check_common(path, g);
        if (strncmp(e->d_name, "stories260K", 11) == 0) check_stories(e->d_name, g);
        if (strncmp(e->d_name, "synth-", 6) == 0) {
            uint32_t v = 0;
            CHECK_EQ_INT(gguf_get_u32(g, "llama.embedding_length", &v), KVS_OK);
            CHECK_EQ_INT(v, 256);
            CHECK_EQ_INT(gguf_get_u32(g, "llama.feed_forward_length", &v), KVS_OK);
            CHECK_EQ_INT(v, 768);
        }
        gguf_close(g);
    }
    closedir(d);
    if (n_files == 0) n_skipped++;
    else n_run++;
}

/* ------------------------------------------------------------ open errors */

static void test_open_errors(void) {
    char msg[KVS_MSG_MAX] = "";
    gguf_ctx *g = (gguf_ctx *)1;
    CHECK_EQ_INT(gguf_open("/nonexistent/dir/model.gguf", &g, msg, sizeof msg), KVS_ERR_IO);
    CHECK(g == NULL);
    CHECK(strstr(msg, "model.gguf") != NULL);
    CHECK_EQ_INT(gguf_open(tmp_dir, &g, msg, sizeof msg), KVS_ERR_IO);
    char path[512];
    snprintf(path, sizeof path, "%s/empty.gguf", tmp_dir);
    FILE *f = fopen(path, "wb");
    fclose(f);
    msg[0] = '\0';
    CHECK_EQ_INT(gguf_open(path, &g, msg, sizeof msg), KVS_ERR_FORMAT);
    CHECK(msg[0] != '\0');
    unlink(path);
    gguf_close(NULL);
    n_run++;
}

/* ------------------------------------------------------------- round trip */

/* A writer with one key of every value type and one array of every element type. */
static gguf_writer *make_all_types_writer(void) {
    gguf_writer *w = gguf_writer_create();
    CHECK(w != NULL);
    uint8_t u8 = 250;
    int8_t i8 = -120;
    uint16_t u16 = 65000;
    int16_t i16 = -32000;
    int64_t i64 = INT64_MIN / 2;
    double f64 = -1.0 / 3.0;
    CHECK_EQ_INT(gguf_writer_set_scalar(w, "t.u8", GGUF_VT_U8, &u8), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_scalar(w, "t.i8", GGUF_VT_I8, &i8), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_scalar(w, "t.u16", GGUF_VT_U16, &u16), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_scalar(w, "t.i16", GGUF_VT_I16, &i16), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_u32(w, "t.u32", 4000000000u), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_i32(w, "t.i32", -2000000000), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_f32(w, "t.f32", 1.5e-5f), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_bool(w, "t.bool", true), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_str(w, "t.str", "h\xc3\xa9llo"), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_strn(w, "t.strnul", "a\0b", 3), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_str(w, "t.empty", ""), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_u64(w, "t.u64", UINT64_MAX - 1), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_scalar(w, "t.i64", GGUF_VT_I64, &i64), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_scalar(w, "t.f64", GGUF_VT_F64, &f64), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_scalar(w, "t.bad", GGUF_VT_STRING, &u8), KVS_ERR_INVALID_ARG);
    CHECK_EQ_INT(gguf_writer_set_u32(w, "t.replaced", 1), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_str(w, "t.replaced", "second"), KVS_OK);

    const uint8_t a_u8[] = {0, 1, 255};
    const int8_t a_i8[] = {-128, 0, 127};
    const uint16_t a_u16[] = {0, 65535};
    const int16_t a_i16[] = {-32768, 32767};
    const uint32_t a_u32[] = {0, 0xffffffffu, 7};
    const int32_t a_i32[] = {-5, 5};
    const float a_f32[] = {0.0f, -1.25f, 3.0e38f};
    const bool a_bool[] = {true, false, true};
    const char *a_str[] = {"<unk>", "", "\xe2\x96\x81the"};
    const uint64_t a_u64[] = {UINT64_MAX};
    const int64_t a_i64[] = {INT64_MIN, 3};
    const double a_f64[] = {1e300, -2.5};
    CHECK_EQ_INT(gguf_writer_set_arr(w, "a.u8", GGUF_VT_U8, a_u8, 3), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_arr(w, "a.i8", GGUF_VT_I8, a_i8, 3), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_arr(w, "a.u16", GGUF_VT_U16, a_u16, 2), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_arr(w, "a.i16", GGUF_VT_I16, a_i16, 2), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_arr(w, "a.u32", GGUF_VT_U32, a_u32, 3), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_arr_i32(w, "a.i32", a_i32, 2), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_arr_f32(w, "a.f32", a_f32, 3), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_arr(w, "a.bool", GGUF_VT_BOOL, a_bool, 3), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_arr_str(w, "a.str", a_str, 3), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_arr(w, "a.u64", GGUF_VT_U64, a_u64, 1), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_arr(w, "a.i64", GGUF_VT_I64, a_i64, 2), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_arr(w, "a.f64", GGUF_VT_F64, a_f64, 2), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_arr(w, "a.empty", GGUF_VT_F32, NULL, 0), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_arr(w, "a.empty_str", GGUF_VT_STRING, NULL, 0), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_arr(w, "a.nested", GGUF_VT_ARRAY, a_u8, 1), KVS_ERR_INVALID_ARG);
    return w;
}

static const gguf_kv *find_checked(const gguf_ctx *g, const char *key) {
    const gguf_kv *kv = gguf_find_kv(g, key);
    if (!kv) fprintf(stderr, "key %s missing\n", key);
    CHECK(kv != NULL);
    return kv;
}

static void check_all_types(const gguf_ctx *g) {
    const gguf_kv *kv;
    uint32_t u32 = 0;
    uint64_t u64 = 0;
    float f = 0;
    bool b = false;
    gguf_str s;
#define KV(name) (kv = find_checked(g, name))
    if (KV("t.u8")) { CHECK_EQ_INT(kv->type, GGUF_VT_U8); CHECK_EQ_INT(kv->val.u, 250); }
    if (KV("t.i8")) { CHECK_EQ_INT(kv->type, GGUF_VT_I8); CHECK_EQ_INT(kv->val.i, -120); }
    if (KV("t.u16")) { CHECK_EQ_INT(kv->type, GGUF_VT_U16); CHECK_EQ_INT(kv->val.u, 65000); }
    if (KV("t.i16")) { CHECK_EQ_INT(kv->type, GGUF_VT_I16); CHECK_EQ_INT(kv->val.i, -32000); }
    CHECK_EQ_INT(gguf_get_u32(g, "t.u32", &u32), KVS_OK);
    CHECK(u32 == 4000000000u);
    if (KV("t.i32")) { CHECK_EQ_INT(kv->type, GGUF_VT_I32); CHECK_EQ_INT(kv->val.i, -2000000000); }
    CHECK_EQ_INT(gguf_get_u32(g, "t.i32", &u32), KVS_ERR_FORMAT); /* negative */
    CHECK_EQ_INT(gguf_get_f32(g, "t.f32", &f), KVS_OK);
    CHECK(f == 1.5e-5f);
    CHECK_EQ_INT(gguf_get_bool(g, "t.bool", &b), KVS_OK);
    CHECK(b);
    CHECK_EQ_INT(gguf_get_str(g, "t.str", &s), KVS_OK);
    CHECK(gguf_str_eq(s, "h\xc3\xa9llo"));
    CHECK_EQ_INT(gguf_get_str(g, "t.strnul", &s), KVS_OK);
    CHECK(s.len == 3 && memcmp(s.ptr, "a\0b", 3) == 0);
    CHECK_EQ_INT(gguf_get_str(g, "t.empty", &s), KVS_OK);
    CHECK_EQ_INT(s.len, 0);
    CHECK_EQ_INT(gguf_get_u64(g, "t.u64", &u64), KVS_OK);
    CHECK(u64 == UINT64_MAX - 1);
    CHECK_EQ_INT(gguf_get_u32(g, "t.u64", &u32), KVS_ERR_FORMAT); /* out of range */
    if (KV("t.i64")) CHECK(kv->val.i == INT64_MIN / 2);
    CHECK_EQ_INT(gguf_get_f32(g, "t.f64", &f), KVS_OK);
    CHECK_NEAR(f, -1.0 / 3.0, 1e-7);
    if (KV("t.f64")) CHECK(kv->val.f == -1.0 / 3.0);
    CHECK_EQ_INT(gguf_get_str(g, "t.replaced", &s), KVS_OK);
    CHECK(gguf_str_eq(s, "second"));
    CHECK_EQ_INT(gguf_get_u32(g, "missing", &u32), KVS_ERR_NOT_FOUND);
    CHECK_EQ_INT(gguf_get_str(g, "t.u32", &s), KVS_ERR_FORMAT);
    CHECK_EQ_INT(gguf_get_bool(g, "t.u32", &b), KVS_ERR_FORMAT);
    CHECK_EQ_INT(gguf_get_f32(g, "t.u32", &f), KVS_ERR_FORMAT);

    if (KV("a.u8")) { CHECK_EQ_INT(kv->arr_type, GGUF_VT_U8); CHECK_EQ_INT(kv->arr_n, 3); CHECK_EQ_INT(gguf_arr_i64(kv, 2), 255); }
    if (KV("a.i8")) { CHECK_EQ_INT(gguf_arr_i64(kv, 0), -128); CHECK_EQ_INT(gguf_arr_i64(kv, 2), 127); }
    if (KV("a.u16")) CHECK_EQ_INT(gguf_arr_i64(kv, 1), 65535);
    if (KV("a.i16")) { CHECK_EQ_INT(gguf_arr_i64(kv, 0), -32768); CHECK_NEAR(gguf_arr_f32(kv, 1), 32767, 0); }
    if (KV("a.u32")) CHECK_EQ_INT(gguf_arr_i64(kv, 1), 0xffffffffll);
    if (KV("a.i32")) { CHECK_EQ_INT(kv->arr_type, GGUF_VT_I32); CHECK_EQ_INT(gguf_arr_i64(kv, 0), -5); }
    if (KV("a.f32")) {
        CHECK_EQ_INT(kv->arr_type, GGUF_VT_F32);
        CHECK(gguf_arr_f32(kv, 1) == -1.25f);
        CHECK(gguf_arr_f32(kv, 2) == 3.0e38f);
        CHECK(gguf_arr_f32(kv, 3) == 0.0f); /* out of range reads as 0 */
        CHECK(gguf_arr_i64(kv, 0) == 0);    /* not an integer array */
    }
    if (KV("a.bool")) { CHECK_EQ_INT(kv->arr_type, GGUF_VT_BOOL); CHECK_EQ_INT(gguf_arr_i64(kv, 0), 1); CHECK_EQ_INT(gguf_arr_i64(kv, 1), 0); }
    if (KV("a.str")) {
        CHECK_EQ_INT(kv->arr_type, GGUF_VT_STRING);
        CHECK_EQ_INT(kv->arr_n, 3);
        CHECK(gguf_str_eq(kv->arr_strs[0], "<unk>"));
        CHECK_EQ_INT(kv->arr_strs[1].len, 0);
        CHECK(gguf_str_eq(kv->arr_strs[2], "\xe2\x96\x81the"));
        CHECK(gguf_arr_f32(kv, 0) == 0.0f);
    }
    if (KV("a.u64")) CHECK(gguf_arr_i64(kv, 0) == -1);
    if (KV("a.i64")) CHECK(gguf_arr_i64(kv, 0) == INT64_MIN);
    if (KV("a.f64")) { CHECK(gguf_arr_f32(kv, 1) == -2.5f); CHECK(isinf(gguf_arr_f32(kv, 0))); }
    if (KV("a.empty")) CHECK_EQ_INT(kv->arr_n, 0);
    if (KV("a.empty_str")) { CHECK_EQ_INT(kv->arr_n, 0); CHECK_EQ_INT(kv->arr_type, GGUF_VT_STRING); }
    CHECK(gguf_find_kv(g, "a.nested") == NULL);
    CHECK(gguf_find_kv(g, "t.bad") == NULL);
#undef KV
}

static void fill_bytes(uint8_t *p, size_t n, uint64_t seed) {
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)splitmix(&seed);
}

static void test_round_trip(void) {
    char path[512], path2[512], msg[KVS_MSG_MAX] = "";
    snprintf(path, sizeof path, "%s/rt.gguf", tmp_dir);
    snprintf(path2, sizeof path2, "%s/rt_stream.gguf", tmp_dir);

    /* tensors: f32 [3] (odd size, exercises padding), q8_0 [64, 3], f16 [2,3,4,5] */
    uint64_t ne_a[1] = {3}, ne_b[2] = {64, 3}, ne_c[4] = {2, 3, 4, 5};
    uint8_t a[12], b[2 * 34 * 3], c[2 * 120];
    fill_bytes(a, sizeof a, 1);
    fill_bytes(b, sizeof b, 2);
    fill_bytes(c, sizeof c, 3);

    gguf_writer *w = make_all_types_writer();
    CHECK_EQ_INT(gguf_writer_add_tensor(w, "a", QUANT_F32, 1, ne_a, a, sizeof a), KVS_OK);
    CHECK_EQ_INT(gguf_writer_add_tensor(w, "b.weight", QUANT_Q8_0, 2, ne_b, b, sizeof b), KVS_OK);
    CHECK_EQ_INT(gguf_writer_add_tensor(w, "c", QUANT_F16, 4, ne_c, c, sizeof c), KVS_OK);
    /* refusals */
    CHECK_EQ_INT(gguf_writer_add_tensor(w, "a", QUANT_F32, 1, ne_a, a, sizeof a), KVS_ERR_INVALID_ARG);
    CHECK_EQ_INT(gguf_writer_add_tensor(w, "d", QUANT_F32, 1, ne_a, a, 8), KVS_ERR_INVALID_ARG);
    CHECK_EQ_INT(gguf_writer_add_tensor(w, "d", 77, 1, ne_a, a, sizeof a), KVS_ERR_INVALID_ARG);
    CHECK_EQ_INT(gguf_writer_add_tensor(w, "d", QUANT_Q8_0, 1, ne_a, a, sizeof a), KVS_ERR_INVALID_ARG);
    CHECK_EQ_INT(gguf_writer_add_tensor(w, "d", QUANT_F32, 0, ne_a, a, sizeof a), KVS_ERR_INVALID_ARG);
    CHECK_EQ_INT(gguf_writer_add_tensor(w, "d", QUANT_F32, 5, ne_c, a, sizeof a), KVS_ERR_INVALID_ARG);
    CHECK_EQ_INT(gguf_writer_write(w, path, msg, sizeof msg), KVS_OK);
    gguf_writer_free(w);

    gguf_ctx *g = NULL;
    int rc = gguf_open(path, &g, msg, sizeof msg);
    if (rc) fprintf(stderr, "%s\n", msg);
    CHECK_EQ_INT(rc, KVS_OK);
    if (g) {
        CHECK_EQ_INT(gguf_version(g), 3);
        CHECK_EQ_INT(gguf_alignment(g), 32);
        CHECK_EQ_INT(gguf_data_offset(g) % 32, 0);
        check_all_types(g);
        CHECK_EQ_INT(gguf_n_tensors(g), 3);
        const gguf_tensor *ta = gguf_find_tensor(g, "a"), *tb = gguf_find_tensor(g, "b.weight"),
                          *tc = gguf_find_tensor(g, "c");
        CHECK(ta && tb && tc);
        if (ta && tb && tc) {
            CHECK_EQ_INT(ta->size, sizeof a);
            CHECK(memcmp(ta->data, a, sizeof a) == 0);
            CHECK_EQ_INT(tb->type, QUANT_Q8_0);
            CHECK_EQ_INT(tb->n_dims, 2);
            CHECK_EQ_INT(tb->ne[1], 3);
            CHECK_EQ_INT(tb->ne[2], 1);
            CHECK(memcmp(tb->data, b, sizeof b) == 0);
            CHECK_EQ_INT(tc->n_dims, 4);
            CHECK_EQ_INT(tc->ne[3], 5);
            CHECK(memcmp(tc->data, c, sizeof c) == 0);
            CHECK_EQ_INT(tb->offset, 32);
            CHECK_EQ_INT(tc->offset % 32, 0);
        }
        gguf_close(g);
    }

    /* streaming, in odd chunks, must give the identical file */
    w = make_all_types_writer();
    uint64_t sz = 0;
    CHECK_EQ_INT(gguf_writer_declare_tensor(w, "a", QUANT_F32, 1, ne_a, &sz), KVS_OK);
    CHECK_EQ_INT(sz, sizeof a);
    CHECK_EQ_INT(gguf_writer_declare_tensor(w, "b.weight", QUANT_Q8_0, 2, ne_b, NULL), KVS_OK);
    CHECK_EQ_INT(gguf_writer_declare_tensor(w, "c", QUANT_F16, 4, ne_c, NULL), KVS_OK);
    CHECK_EQ_INT(gguf_writer_write(w, path2, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    CHECK_EQ_INT(gguf_writer_write_data(w, a, 1, msg, sizeof msg), KVS_ERR_INVALID_ARG); /* not begun */
    CHECK_EQ_INT(gguf_writer_begin(w, path2, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_u32(w, "late", 1), KVS_ERR_INVALID_ARG);
    uint8_t all[sizeof a + sizeof b + sizeof c];
    memcpy(all, a, sizeof a);
    memcpy(all + sizeof a, b, sizeof b);
    memcpy(all + sizeof a + sizeof b, c, sizeof c);
    size_t done = 0, step = 1;
    while (done < sizeof all) {
        size_t k = sizeof all - done < step ? sizeof all - done : step;
        CHECK_EQ_INT(gguf_writer_write_data(w, all + done, k, msg, sizeof msg), KVS_OK);
        done += k;
        step = step * 3 + 1;
    }
    CHECK_EQ_INT(gguf_writer_finish(w, msg, sizeof msg), KVS_OK);
    gguf_writer_free(w);
    size_t n1 = 0, n2 = 0;
    uint8_t *f1 = test_read_file(path, &n1), *f2 = test_read_file(path2, &n2);
    CHECK(f1 && f2 && n1 == n2 && memcmp(f1, f2, n1) == 0);
    free(f1);
    free(f2);

    /* streaming failures leave nothing behind */
    char path3[512], tmp3[520];
    snprintf(path3, sizeof path3, "%s/rt_fail.gguf", tmp_dir);
    snprintf(tmp3, sizeof tmp3, "%s.tmp", path3);
    w = gguf_writer_create();
    CHECK_EQ_INT(gguf_writer_declare_tensor(w, "a", QUANT_F32, 1, ne_a, NULL), KVS_OK);
    CHECK_EQ_INT(gguf_writer_begin(w, path3, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(gguf_writer_write_data(w, a, 4, msg, sizeof msg), KVS_OK);
    msg[0] = '\0';
    CHECK_EQ_INT(gguf_writer_finish(w, msg, sizeof msg), KVS_ERR_INVALID_ARG); /* incomplete */
    CHECK(msg[0] != '\0');
    CHECK(access(tmp3, F_OK) != 0 && access(path3, F_OK) != 0);
    gguf_writer_free(w);
    w = gguf_writer_create();
    CHECK_EQ_INT(gguf_writer_declare_tensor(w, "a", QUANT_F32, 1, ne_a, NULL), KVS_OK);
    CHECK_EQ_INT(gguf_writer_begin(w, path3, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(gguf_writer_write_data(w, all, 13, msg, sizeof msg), KVS_ERR_INVALID_ARG); /* too much */
    gguf_writer_free(w);
    CHECK(access(tmp3, F_OK) != 0 && access(path3, F_OK) != 0);
    w = gguf_writer_create(); /* abandoned mid-way */
    CHECK_EQ_INT(gguf_writer_declare_tensor(w, "a", QUANT_F32, 1, ne_a, NULL), KVS_OK);
    CHECK_EQ_INT(gguf_writer_begin(w, path3, msg, sizeof msg), KVS_OK);
    gguf_writer_free(w);
    CHECK(access(tmp3, F_OK) != 0 && access(path3, F_OK) != 0);

    /* custom alignment; bad alignment refused by the writer */
    w = gguf_writer_create();
    CHECK_EQ_INT(gguf_writer_set_u32(w, "general.alignment", 64), KVS_OK);
    CHECK_EQ_INT(gguf_writer_add_tensor(w, "a", QUANT_F32, 1, ne_a, a, sizeof a), KVS_OK);
    CHECK_EQ_INT(gguf_writer_add_tensor(w, "b", QUANT_Q8_0, 2, ne_b, b, sizeof b), KVS_OK);
    CHECK_EQ_INT(gguf_writer_write(w, path, msg, sizeof msg), KVS_OK);
    CHECK_EQ_INT(gguf_writer_set_u32(w, "general.alignment", 48), KVS_OK);
    CHECK_EQ_INT(gguf_writer_write(w, path2, msg, sizeof msg), KVS_ERR_INVALID_ARG);
    gguf_writer_free(w);
    g = NULL;
    CHECK_EQ_INT(gguf_open(path, &g, msg, sizeof msg), KVS_OK);
    if (g) {
        CHECK_EQ_INT(gguf_alignment(g), 64);
        CHECK_EQ_INT(gguf_data_offset(g) % 64, 0);
        CHECK_EQ_INT(gguf_find_tensor(g, "b")->offset, 64);
        gguf_close(g);
    }

    /* empty file (no kv, no tensors) */
    w = gguf_writer_create();
    CHECK_EQ_INT(gguf_writer_write(w, path, msg, sizeof msg), KVS_OK);
    gguf_writer_free(w);
    g = NULL;
    CHECK_EQ_INT(gguf_open(path, &g, msg, sizeof msg), KVS_OK);
    if (g) {
        CHECK_EQ_INT(gguf_n_kv(g), 0);
        CHECK_EQ_INT(gguf_n_tensors(g), 0);
        CHECK(gguf_find_kv(g, "x") == NULL && gguf_find_tensor(g, "x") == NULL);
        gguf_close(g);
    }
    unlink(path);
    unlink(path2);
    n_run++;
}

/* --------------------------------------------------------------- corruption */

/* A small synthetic model-like file, so the corruption tests run even without shared data. */
static uint8_t *make_synthetic(size_t *n) {
    char path[512], msg[KVS_MSG_MAX];
    snprintf(path, sizeof path, "%s/synthetic.gguf", tmp_dir);
    gguf_writer *w = gguf_writer_create();
    gguf_writer_set_str(w, "general.architecture", "llama");
    gguf_writer_set_u32(w, "general.alignment", 32);
    gguf_writer_set_u32(w, "llama.block_count", 1);
    gguf_writer_set_u32(w, "llama.context_length", 64); /* same key length as block_count */
    const char *toks[] = {"<unk>", "<s>", "</s>", "a", "b"};
    const float scores[] = {0, 0, 0, -1, -2};
    gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, 5);
    gguf_writer_set_arr_f32(w, "tokenizer.ggml.scores", scores, 5);
    uint8_t data[64 * 4 * 2];
    fill_bytes(data, sizeof data, 9);
    uint64_t ne1[1] = {64}, ne2[2] = {64, 2};
    gguf_writer_add_tensor(w, "blk.0.attn_norm.weight", QUANT_F32, 1, ne1, data, 256);
    gguf_writer_add_tensor(w, "blk.0.ffn_norm.weight", QUANT_F32, 1, ne1, data, 256);
    gguf_writer_add_tensor(w, "blk.0.attn_q.weight", QUANT_Q8_0, 2, ne2, data, 136);
    gguf_writer_add_tensor(w, "blk.0.attn_k.weight", QUANT_Q8_0, 2, ne2, data, 136);
    gguf_writer_add_tensor(w, "token_embd.weight", QUANT_F32, 2, ne2, data, 512);
    CHECK_EQ_INT(gguf_writer_write(w, path, msg, sizeof msg), KVS_OK);
    gguf_writer_free(w);
    uint8_t *b = test_read_file(path, n);
    unlink(path);
    return b;
}

static void put_u32(uint8_t *b, uint64_t at, uint32_t v) { kvs_wr_u32(b + at, v); }
static void put_u64(uint8_t *b, uint64_t at, uint64_t v) { kvs_wr_u64(b + at, v); }

static void corrupt_all(const char *label, const uint8_t *orig, size_t n) {
    char msg[KVS_MSG_MAX] = "";
    gguf_ctx *g = NULL;
    int rc = gguf_open_buffer(orig, n, &g, msg, sizeof msg);
    CHECK_EQ_INT(rc, KVS_OK);
    if (rc) {
        fprintf(stderr, "%s: %s\n", label, msg);
        return;
    }
    if (verbose()) printf("corruption cases on %s\n", label);
    uint8_t *b = malloc(n);
    char what[128];
#define RESET() memcpy(b, orig, n)
#define REFUSE(want, ...) (snprintf(what, sizeof what, __VA_ARGS__), expect_refused(b, n, want, what))

    /* header */
    RESET(); b[0] = 'X'; REFUSE(KVS_ERR_FORMAT, "bad magic");
    RESET(); put_u32(b, 4, 1); REFUSE(KVS_ERR_UNSUPPORTED, "version 1");
    RESET(); put_u32(b, 4, 4); REFUSE(KVS_ERR_UNSUPPORTED, "version 4");
    RESET(); put_u32(b, 4, 0xffffffffu); REFUSE(KVS_ERR_UNSUPPORTED, "version 0xffffffff");
    RESET(); put_u32(b, 4, 0x03000000u); REFUSE(KVS_ERR_UNSUPPORTED, "big-endian version");
    RESET(); put_u32(b, 4, 2);
    CHECK_EQ_INT(open_copy(b, n, msg, sizeof msg), KVS_OK); /* v2 has the same layout */
    RESET(); put_u64(b, 8, UINT64_MAX); REFUSE(KVS_ERR_FORMAT, "n_tensors 2^64-1");
    RESET(); put_u64(b, 8, 1ull << 40); REFUSE(KVS_ERR_FORMAT, "n_tensors 2^40");
    RESET(); put_u64(b, 8, GGUF_MAX_TENSORS + 1ull); REFUSE(KVS_ERR_FORMAT, "n_tensors over the cap");
    RESET(); put_u64(b, 16, UINT64_MAX); REFUSE(KVS_ERR_FORMAT, "n_kv 2^64-1");
    RESET(); put_u64(b, 16, 1ull << 33); REFUSE(KVS_ERR_FORMAT, "n_kv 2^33");
    RESET(); put_u64(b, 16, gguf_n_kv(g) + 1); REFUSE(1, "n_kv + 1");
    RESET(); put_u64(b, 8, gguf_n_tensors(g) + 1); REFUSE(1, "n_tensors + 1");

    /* metadata */
    const gguf_kv *kv0 = gguf_kv_at(g, 0);
    uint64_t k0 = pos_of(g, kv0->key.ptr) - 8;
    RESET(); put_u64(b, k0, UINT64_MAX); REFUSE(KVS_ERR_FORMAT, "key length 2^64-1");
    RESET(); put_u64(b, k0, n); REFUSE(KVS_ERR_FORMAT, "key length = file size");
    RESET(); put_u64(b, k0, 0); REFUSE(KVS_ERR_FORMAT, "key length 0");
    RESET(); put_u32(b, k0 + 8 + kv0->key.len, 13); REFUSE(KVS_ERR_FORMAT, "value type 13");
    RESET(); put_u32(b, k0 + 8 + kv0->key.len, 0x80000000u); REFUSE(KVS_ERR_FORMAT, "value type 2^31");
    const gguf_kv *skv = NULL, *akv = NULL, *nkv = NULL, *bkv = NULL;
    for (uint64_t i = 0; i < gguf_n_kv(g); i++) {
        const gguf_kv *kv = gguf_kv_at(g, i);
        if (kv->type == GGUF_VT_STRING && !skv) skv = kv;
        if (kv->type == GGUF_VT_ARRAY && kv->arr_type == GGUF_VT_STRING && kv->arr_n > 0 && !akv) akv = kv;
        if (kv->type == GGUF_VT_ARRAY && kv->arr_type == GGUF_VT_F32 && kv->arr_n > 0 && !nkv) nkv = kv;
        if (kv->type == GGUF_VT_BOOL && !bkv) bkv = kv;
    }
    if (skv) {
        uint64_t at = pos_of(g, skv->str.ptr) - 8;
        RESET(); put_u64(b, at, UINT64_MAX); REFUSE(KVS_ERR_FORMAT, "string length 2^64-1");
        RESET(); put_u64(b, at, 1ull << 62); REFUSE(KVS_ERR_FORMAT, "string length 2^62");
        RESET(); put_u64(b, at, n - at - 8 + 1); REFUSE(KVS_ERR_FORMAT, "string length one past end");
    }
    if (akv) {
        uint64_t cnt = pos_of(g, akv->arr_data) - 8;
        RESET(); put_u64(b, cnt, UINT64_MAX); REFUSE(KVS_ERR_FORMAT, "string array count 2^64-1");
        RESET(); put_u64(b, cnt, 1ull << 59); REFUSE(KVS_ERR_FORMAT, "string array count 2^59");
        RESET(); put_u64(b, cnt, n / 8); REFUSE(KVS_ERR_FORMAT, "string array count n/8");
        RESET(); put_u32(b, cnt - 4, GGUF_VT_ARRAY); REFUSE(KVS_ERR_UNSUPPORTED, "array of arrays");
        RESET(); put_u32(b, cnt - 4, 99); REFUSE(KVS_ERR_FORMAT, "array element type 99");
        RESET(); put_u64(b, pos_of(g, akv->arr_strs[0].ptr) - 8, UINT64_MAX - 3);
        REFUSE(KVS_ERR_FORMAT, "array string length huge");
    }
    if (nkv) {
        uint64_t cnt = pos_of(g, nkv->arr_data) - 8;
        RESET(); put_u64(b, cnt, UINT64_MAX / 2); REFUSE(KVS_ERR_FORMAT, "f32 array count: bytes overflow");
        RESET(); put_u64(b, cnt, 1ull << 62); REFUSE(KVS_ERR_FORMAT, "f32 array count: bytes = 2^64");
        RESET(); put_u64(b, cnt, (n - pos_of(g, nkv->arr_data)) / 4 + 1);
        REFUSE(KVS_ERR_FORMAT, "f32 array count one past end");
    }
    if (bkv) {
        RESET(); b[pos_of(g, bkv->key.ptr) + bkv->key.len + 4] = 2; REFUSE(KVS_ERR_FORMAT, "bool value 2");
    }
    /* duplicate key: copy a key over another key of the same length */
    bool dup_done = false;
    for (uint64_t i = 0; i < gguf_n_kv(g) && !dup_done; i++)
        for (uint64_t j = i + 1; j < gguf_n_kv(g) && !dup_done; j++) {
            const gguf_kv *a = gguf_kv_at(g, i), *c = gguf_kv_at(g, j);
            if (a->key.len != c->key.len) continue;
            RESET(); memcpy(b + pos_of(g, c->key.ptr), a->key.ptr, a->key.len);
            REFUSE(KVS_ERR_FORMAT, "duplicate key '%.*s'", (int)a->key.len, a->key.ptr);
            dup_done = true;
        }
    CHECK(dup_done);
    /* alignment */
    const gguf_kv *al = gguf_find_kv(g, "general.alignment");
    if (al) {
        uint64_t type_at = pos_of(g, al->key.ptr) + al->key.len, val_at = type_at + 4;
        RESET(); put_u32(b, val_at, 0); REFUSE(KVS_ERR_FORMAT, "alignment 0");
        RESET(); put_u32(b, val_at, 48); REFUSE(KVS_ERR_FORMAT, "alignment 48");
        RESET(); put_u32(b, val_at, 0x80000001u); REFUSE(KVS_ERR_FORMAT, "alignment 2^31+1");
        RESET(); put_u32(b, type_at, GGUF_VT_I32); REFUSE(KVS_ERR_FORMAT, "alignment of type i32");
        RESET(); put_u32(b, val_at, 64); REFUSE(KVS_ERR_FORMAT, "alignment 64: data offsets misaligned");
    }

    /* tensor table */
    const gguf_tensor *t0 = gguf_tensor_at(g, 0), *t2 = NULL, *tlast = t0;
    for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
        const gguf_tensor *t = gguf_tensor_at(g, i);
        if (t->n_dims >= 2 && !t2) t2 = t;
        if (t->offset > tlast->offset) tlast = t;
    }
    tinfo_pos p0 = tensor_pos(g, t0);
    RESET(); put_u64(b, p0.name_len, UINT64_MAX); REFUSE(KVS_ERR_FORMAT, "tensor name length 2^64-1");
    RESET(); put_u64(b, p0.name_len, 0); REFUSE(KVS_ERR_FORMAT, "tensor name length 0");
    RESET(); put_u64(b, p0.name_len, GGUF_MAX_NAME_LEN + 1); REFUSE(KVS_ERR_FORMAT, "tensor name too long");
    RESET(); put_u32(b, p0.n_dims, 0); REFUSE(KVS_ERR_FORMAT, "n_dims 0");
    RESET(); put_u32(b, p0.n_dims, 5); REFUSE(KVS_ERR_FORMAT, "n_dims 5");
    RESET(); put_u32(b, p0.n_dims, 0xffffffffu); REFUSE(KVS_ERR_FORMAT, "n_dims 2^32-1");
    RESET(); put_u64(b, p0.ne, 0); REFUSE(KVS_ERR_FORMAT, "ne[0] 0");
    RESET(); put_u64(b, p0.ne, UINT64_MAX); REFUSE(KVS_ERR_FORMAT, "ne[0] 2^64-1");
    RESET(); put_u32(b, p0.type, 99); REFUSE(KVS_ERR_UNSUPPORTED, "tensor type 99");
    RESET(); put_u32(b, p0.type, 0xffffffffu); REFUSE(KVS_ERR_UNSUPPORTED, "tensor type 2^32-1");
    RESET(); put_u32(b, p0.type, QUANT_TYPE_LIMIT); REFUSE(KVS_ERR_UNSUPPORTED, "tensor type QUANT_TYPE_LIMIT");
    RESET(); put_u64(b, p0.offset, t0->offset + 1); REFUSE(KVS_ERR_FORMAT, "tensor offset misaligned");
    RESET(); put_u64(b, p0.offset, UINT64_MAX - 31); REFUSE(KVS_ERR_FORMAT, "tensor offset 2^64-32 (overflow)");
    RESET(); put_u64(b, p0.offset, (uint64_t)n / 32 * 32 + 32); REFUSE(KVS_ERR_FORMAT, "tensor offset past end");
    tinfo_pos pl = tensor_pos(g, tlast);
    RESET(); put_u64(b, pl.offset, tlast->offset + 32 * ((n - (gguf_data_offset(g) + tlast->offset + tlast->size)) / 32 + 1));
    REFUSE(KVS_ERR_FORMAT, "last tensor moved past end");
    if (t2) {
        tinfo_pos p2 = tensor_pos(g, t2);
        RESET(); put_u64(b, p2.ne, 1ull << 40); put_u64(b, p2.ne + 8, 1ull << 40);
        REFUSE(KVS_ERR_FORMAT, "ne product overflow");
        RESET(); put_u64(b, p2.ne, 1ull << 62); put_u64(b, p2.ne + 8, 2);
        REFUSE(KVS_ERR_FORMAT, "ne product 2^63");
        RESET(); put_u64(b, p2.ne + 8, 1ull << 50); REFUSE(KVS_ERR_FORMAT, "ne[1] 2^50 (size past end)");
        RESET(); put_u64(b, p2.ne + 8, (1ull << 62) / t2->ne[0] * 4);
        REFUSE(KVS_ERR_FORMAT, "byte size overflow");
        if (quant_get_traits(t2->type)->block_elems > 1) {
            RESET(); put_u64(b, p2.ne, t2->ne[0] + 1); REFUSE(KVS_ERR_FORMAT, "row not a multiple of the block");
        }
    }
    /* two tensors pointing at the same data */
    if (gguf_n_tensors(g) >= 2) {
        const gguf_tensor *t1 = gguf_tensor_at(g, 1);
        RESET(); put_u64(b, tensor_pos(g, t1).offset, t0->offset); REFUSE(KVS_ERR_FORMAT, "overlapping tensors");
    }
    /* duplicate tensor name */
    dup_done = false;
    for (uint64_t i = 0; i < gguf_n_tensors(g) && !dup_done; i++)
        for (uint64_t j = i + 1; j < gguf_n_tensors(g) && !dup_done; j++) {
            const gguf_tensor *a = gguf_tensor_at(g, i), *c = gguf_tensor_at(g, j);
            if (a->name.len != c->name.len) continue;
            RESET(); memcpy(b + pos_of(g, c->name.ptr), a->name.ptr, a->name.len);
            REFUSE(KVS_ERR_FORMAT, "duplicate tensor '%.*s'", (int)a->name.len, a->name.ptr);
            dup_done = true;
        }
    CHECK(dup_done);

    /* truncation: every length up to the data section, a sample inside the data */
    uint64_t data_end = 0;
    for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
        const gguf_tensor *t = gguf_tensor_at(g, i);
        if (gguf_data_offset(g) + t->offset + t->size > data_end) data_end = gguf_data_offset(g) + t->offset + t->size;
    }
    int trunc_bad = 0, trunc_n = 0;
    for (uint64_t len = 0; len <= gguf_data_offset(g); len++) {
        char m[KVS_MSG_MAX];
        int r = open_copy(orig, (size_t)len, m, sizeof m);
        trunc_n++;
        if (r == KVS_OK || m[0] == '\0') {
            if (trunc_bad++ < 5) fprintf(stderr, "%s: truncation at %" PRIu64 " not refused (rc %d)\n", label, len, r);
        }
    }
    uint64_t seed = 42;
    for (int i = 0; i < 200; i++) {
        uint64_t len = gguf_data_offset(g) + splitmix(&seed) % (data_end - gguf_data_offset(g));
        char m[KVS_MSG_MAX];
        int r = open_copy(orig, (size_t)len, m, sizeof m);
        trunc_n++;
        if (r == KVS_OK || m[0] == '\0') {
            if (trunc_bad++ < 5) fprintf(stderr, "%s: truncation at %" PRIu64 " not refused (rc %d)\n", label, len, r);
        }
    }
    CHECK_EQ_INT(trunc_bad, 0);
    if (verbose()) printf("  %d truncations refused\n", trunc_n);

    /* random byte flips in the header region: any result, never a crash */
    uint64_t head = gguf_data_offset(g) + 64 < n ? gguf_data_offset(g) + 64 : n;
    int accepted = 0;
    RESET();
    for (int it = 0; it < 3000; it++) {
        int nflip = 1 + (int)(splitmix(&seed) % 4);
        uint64_t at[4];
        uint8_t old[4];
        for (int k = 0; k < nflip; k++) {
            at[k] = splitmix(&seed) % head;
            old[k] = b[at[k]];
            uint64_t r = splitmix(&seed);
            b[at[k]] = (r & 1) ? (uint8_t)(b[at[k]] ^ (1u << ((r >> 1) % 8))) : (uint8_t)(r >> 8);
        }
        gguf_ctx *h = NULL;
        char m[KVS_MSG_MAX] = "";
        int r = gguf_open_buffer(b, n, &h, m, sizeof m);
        if (r == KVS_OK) {
            accepted++;
            /* whatever was accepted must be self-consistent */
            for (uint64_t i = 0; i < gguf_n_tensors(h); i++) {
                const gguf_tensor *t = gguf_tensor_at(h, i);
                CHECK(gguf_data_offset(h) + t->offset + t->size <= n);
            }
            gguf_close(h);
        } else {
            CHECK(m[0] != '\0');
        }
        for (int k = nflip - 1; k >= 0; k--) b[at[k]] = old[k];
    }
    if (verbose()) printf("  flips: %d of 3000 accepted\n", accepted);
    free(b);
    gguf_close(g);
#undef RESET
#undef REFUSE
}

static void test_corruption(void) {
    size_t n = 0;
    uint8_t *syn = make_synthetic(&n);
    CHECK(syn != NULL);
    if (syn) corrupt_all("synthetic", syn, n);
    free(syn);
    n_run++;
    char buf[512];
    const char *names[] = {"models/stories260K.gguf", "models/stories260K-Q4_0.gguf"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        const char *path = test_shared_path(names[i], buf, sizeof buf);
        if (!path) {
            n_skipped++;
            continue;
        }
        uint8_t *real = test_read_file(path, &n);
        CHECK(real != NULL);
        if (real) corrupt_all(names[i], real, n);
        free(real);
        n_run++;
    }
}

int main(void) {
    snprintf(tmp_dir, sizeof tmp_dir, "/tmp/kvs_test_gguf_XXXXXX");
    if (!mkdtemp(tmp_dir)) {
        perror("mkdtemp");
        return 1;
    }
    test_open_errors();
    test_shared_models();
    test_round_trip();
    test_corruption();
    rmdir(tmp_dir);
    return test_finish("test_gguf", n_run, n_skipped);
}
