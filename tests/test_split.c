/*
 * gguf split files (NAME-00001-of-0000N.gguf). A mkmodel "small" model is
 * split by layers with our own writer (model_split_plan + gguf_split_write)
 * into 3 parts — part 1: token_embd + blk.0, part 2: blk.1, part 3: output
 * norm + output — and:
 *  - every part is a valid GGUF with split.no / split.count /
 *    split.tensors.count, the first holds the model's metadata;
 *  - the split model, opened by its first part, computes exactly the whole
 *    file's logits (memcmp), as a whole and as two ranges passing hidden
 *    states;
 *  - a shard of the second half maps the tensor data of parts 2 and 3 only:
 *    the gguf layer's mapped-bytes counter is 0 for part 1 and exactly the
 *    data sections of parts 2 and 3 for the others (deterministic); the
 *    process's RssFile growth is printed as a figure;
 *  - `kvshard split` (when KVS_BIN names the CLI) writes parts that compute
 *    the same logits;
 *  - refusals: the second part passed as the model, a missing part, a first
 *    part not named -00001-of-00003.gguf, parts that disagree;
 *  - the kvshard manifest (check_manifest): the whole file's digest, parts a
 *    range does not need may be absent, a flipped byte is refused by name.
 */
#include <stdlib.h>

#include "digest.h"
#include "engine_check.h"
#include "gguf.h"
#include "mkmodel.h"
#include "model.h"
#include "quant.h"
#include "gguf_flip.h"
#include "test.h"

/* RssFile of this process in kB (file-backed resident pages), -1 if unknown. */
static long rss_file_kb(void) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    long kb = -1;
    while (fgets(line, sizeof(line), f))
        if (sscanf(line, "RssFile: %ld kB", &kb) == 1) break;
    fclose(f);
    return kb;
}

#define KV_BUDGET (4ull << 20) /* per engine opened here */

static const int32_t PROMPT[7] = {1, 300, 44, 7, 123, 500, 2};

/* Logits of PROMPT through head (and tail, when given, via hidden states). */
static float *logits_of(engine *head, engine *tail, int sid) {
    if (!head) return NULL;
    uint32_t nv = (tail ? tail : head)->m->hp.n_vocab, d = head->m->hp.n_embd;
    float *out = malloc(7 * (size_t)nv * sizeof(float)), *hid = malloc(7 * (size_t)d * sizeof(float));
    engine_req r = {.epoch = 1, .n = 7, .tokens = PROMPT, .out_mode = tail ? FWD_OUT_HIDDEN : FWD_OUT_LOGITS_ALL,
                    .out = tail ? hid : out};
    r.sid.bytes[0] = (uint8_t)sid;
    CHECK_EQ_INT(engine_step(head, &r, 1), KVS_OK);
    if (tail) {
        engine_req t = {.epoch = 1, .n = 7, .hidden = hid, .out_mode = FWD_OUT_LOGITS_ALL, .out = out};
        t.sid.bytes[0] = (uint8_t)sid;
        CHECK_EQ_INT(engine_step(tail, &t, 1), KVS_OK);
    }
    free(hid);
    return out;
}

static void expect_open_fails(const char *path, int want_err, const char *want_text) {
    char msg[KVS_MSG_MAX] = "";
    model *m = NULL;
    int err = model_load(path, 0, 0, &m, msg, sizeof(msg));
    printf("  refused: %s: %s\n", kvs_strerror(err), msg);
    CHECK_EQ_INT(err, want_err);
    CHECK(m == NULL);
    if (!strstr(msg, want_text)) {
        fprintf(stderr, "message '%s' does not contain '%s'\n", msg, want_text);
        test_failures_++;
    }
    model_free(m);
}

/* The kvshard manifest (gguf_split_write_manifest), on the 2-layer model split in 3 parts
 * (part 1: token_embd + blk.0, part 2: blk.1, part 3: output norm + output):
 *  - the split's model digest is the whole file's SHA-256, read from part 1 alone;
 *  - with parts 2 and 3 gone, a shard of [0, 1) opens, maps part 1 only and computes the same
 *    hidden states (the whole file's tail gives the same logits); the whole range is refused
 *    naming a tensor of part 2 and that part;
 *  - with part 3 gone again and a byte of blk.1.ffn_up flipped in part 2, [1, 2) is refused
 *    naming the tensor and the part; restored, [1, 2) needs parts 1 to 3 and computes exactly. */
static void check_manifest(const gguf_ctx *src, const uint32_t *part_of, const char *dir, const char *whole_path,
                           const float *lw) {
    char prefix[256], part[3][300], moved[3][1024], msg[KVS_MSG_MAX];
    snprintf(prefix, sizeof(prefix), "%s/man", dir);
    uint8_t d_whole[32], d_split[32];
    CHECK_EQ_INT(digest_file_sha256(whole_path, d_whole), KVS_OK);
    CHECK_EQ_INT(gguf_split_write_manifest(src, part_of, 3, prefix, d_whole, msg, sizeof(msg)), KVS_OK);
    for (int i = 0; i < 3; i++) {
        CHECK(gguf_split_path(part[i], sizeof(part[i]), prefix, (uint32_t)i, 3));
        snprintf(moved[i], sizeof(moved[i]), "%s.away", part[i]);
    }
    CHECK(rename(part[1], moved[1]) == 0 && rename(part[2], moved[2]) == 0);
    CHECK_EQ_INT(digest_model_sha256(part[0], d_split), KVS_OK);
    CHECK(memcmp(d_split, d_whole, 32) == 0);
    uint8_t d_man[32];
    CHECK_EQ_INT(gguf_manifest_digest(part[0], d_man), KVS_OK);
    CHECK(memcmp(d_man, d_whole, 32) == 0);
    CHECK_EQ_INT(gguf_manifest_digest(whole_path, d_man), KVS_ERR_NOT_FOUND);
    printf("  manifest: the split's digest is the whole file's, from part 1 alone\n");

    engine *head = open_range(part[0], 0, 1, KV_BUDGET), *tail = open_range(whole_path, 1, 2, KV_BUDGET);
    CHECK(head && tail);
    if (head) {
        CHECK(gguf_set_part(head->m->files, 1) == NULL && gguf_set_part(head->m->files, 2) == NULL);
        CHECK_EQ_INT(model_mapped_data_bytes(head->m), gguf_mapped_data_bytes(gguf_set_part(head->m->files, 0)));
        CHECK(gguf_set_find_tensor(head->m->files, "output.weight", NULL) != NULL); /* a name from the manifest */
        CHECK_EQ_INT(gguf_set_n_tensors(head->m->files), gguf_n_tensors(src));
    }
    float *l = logits_of(head, tail, 9);
    uint32_t nv = tail ? tail->m->hp.n_vocab : 0;
    CHECK(l && lw && memcmp(l, lw, 7 * (size_t)nv * sizeof(float)) == 0);
    free(l);
    engine_close(head);
    engine_close(tail);
    printf("  manifest: a shard of [0, 1) runs from part 1 alone, bit-exact\n");
    expect_open_fails(part[0], KVS_ERR_IO, "tensor 'blk.1.attn_q.weight' is in part 2 (");

    CHECK(rename(moved[1], part[1]) == 0);
    flip_tensor_byte(part[1], "blk.1.ffn_up.weight");
    char mm[KVS_MSG_MAX] = "";
    model *m = NULL;
    CHECK_EQ_INT(model_load(part[0], 1, 2, &m, mm, sizeof(mm)), KVS_ERR_FORMAT);
    printf("  refused: %s\n", mm);
    CHECK(strstr(mm, "tensor 'blk.1.ffn_up.weight' in part 2 (") != NULL && strstr(mm, "does not match") != NULL);
    model_free(m);
    flip_tensor_byte(part[1], "blk.1.ffn_up.weight"); /* x ^ k ^ k: the original byte */
    CHECK(rename(moved[2], part[2]) == 0);
    head = open_range(whole_path, 0, 1, KV_BUDGET);
    tail = open_range(part[0], 1, 2, KV_BUDGET);
    l = logits_of(head, tail, 10);
    CHECK(l && lw && memcmp(l, lw, 7 * (size_t)nv * sizeof(float)) == 0);
    free(l);
    engine_close(head);
    engine_close(tail);
    printf("  manifest: a flipped byte is refused by name; restored, [1, 2) is bit-exact\n");
    for (int i = 0; i < 3; i++) unlink(part[i]);
}

int main(void) {
    char dir[] = "/tmp/kvs-split-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char whole_path[256], prefix[256], part[3][300], msg[KVS_MSG_MAX];
    snprintf(whole_path, sizeof(whole_path), "%s/small.gguf", dir);
    snprintf(prefix, sizeof(prefix), "%s/small", dir);
    mkmodel_params mp = mkmodel_default_params();
    mp.shape = "small";
    mp.type = QUANT_Q8_0;
    mp.n_threads = 1;
    CHECK_EQ_INT(mkmodel_write(whole_path, mp, msg, sizeof(msg)), KVS_OK);

    /* Split by layers into 3 parts. */
    gguf_ctx *src = NULL;
    CHECK_EQ_INT(gguf_open(whole_path, &src, msg, sizeof(msg)), KVS_OK);
    if (!src) return test_finish("test_split", 1, 0);
    uint64_t n_tensors = gguf_n_tensors(src);
    uint32_t *part_of = calloc(n_tensors, sizeof(uint32_t));
    CHECK_EQ_INT(model_split_plan(src, 4, part_of, msg, sizeof(msg)), KVS_ERR_INVALID_ARG); /* 2 layers: at most 3 */
    CHECK_EQ_INT(model_split_plan(src, 3, part_of, msg, sizeof(msg)), KVS_OK);
    CHECK_EQ_INT(gguf_split_write(src, part_of, 3, prefix, msg, sizeof(msg)), KVS_OK);
    for (int i = 0; i < 3; i++) CHECK(gguf_split_path(part[i], sizeof(part[i]), prefix, (uint32_t)i, 3));
    CHECK(strstr(part[0], "small-00001-of-00003.gguf") != NULL);

    /* The model digest of a split covers every part in order: it equals the SHA-256 of the
     * parts' concatenation, differs from the first part's own hash, and fails if a part is gone. */
    {
        char cat_path[300];
        snprintf(cat_path, sizeof(cat_path), "%s/concat.bin", dir);
        FILE *out = fopen(cat_path, "wb");
        CHECK(out != NULL);
        for (int i = 0; out && i < 3; i++) {
            FILE *in = fopen(part[i], "rb");
            CHECK(in != NULL);
            char buf[65536];
            size_t r;
            while (in && (r = fread(buf, 1, sizeof(buf), in)) > 0) CHECK(fwrite(buf, 1, r, out) == r);
            if (in) fclose(in);
        }
        if (out) fclose(out);
        uint8_t d_split[32], d_cat[32], d_first[32];
        CHECK_EQ_INT(digest_model_sha256(part[0], d_split), KVS_OK);
        CHECK_EQ_INT(digest_file_sha256(cat_path, d_cat), KVS_OK);
        CHECK_EQ_INT(digest_file_sha256(part[0], d_first), KVS_OK);
        CHECK(memcmp(d_split, d_cat, 32) == 0);
        CHECK(memcmp(d_split, d_first, 32) != 0);
        uint8_t d_whole[32], d_whole_model[32];
        CHECK_EQ_INT(digest_file_sha256(whole_path, d_whole), KVS_OK);
        CHECK_EQ_INT(digest_model_sha256(whole_path, d_whole_model), KVS_OK);
        CHECK(memcmp(d_whole, d_whole_model, 32) == 0); /* a single file: its own hash */
        char moved[320];
        snprintf(moved, sizeof(moved), "%s.moved", part[2]);
        CHECK(rename(part[2], moved) == 0);
        CHECK_EQ_INT(digest_model_sha256(part[0], d_split), KVS_ERR_IO);
        CHECK(rename(moved, part[2]) == 0);
        remove(cat_path);
        printf("  digest: a split's model digest is the SHA-256 of its parts in order\n");
    }

    /* Every part a valid GGUF with the split keys; the tensors add up. */
    uint64_t data_bytes[3] = {0}, sum = 0;
    for (int i = 0; i < 3; i++) {
        gguf_ctx *g = NULL;
        CHECK_EQ_INT(gguf_open(part[i], &g, msg, sizeof(msg)), KVS_OK);
        if (!g) continue;
        uint32_t no = 99, count = 0, tc = 0;
        CHECK_EQ_INT(gguf_get_u32(g, "split.no", &no), KVS_OK);
        CHECK_EQ_INT(gguf_get_u32(g, "split.count", &count), KVS_OK);
        CHECK_EQ_INT(gguf_get_u32(g, "split.tensors.count", &tc), KVS_OK);
        CHECK_EQ_INT(no, i);
        CHECK_EQ_INT(count, 3);
        CHECK_EQ_INT(tc, n_tensors);
        CHECK_EQ_INT(gguf_find_kv(g, "llama.block_count") != NULL, i == 0);
        data_bytes[i] = gguf_mapped_data_bytes(g);
        sum += gguf_n_tensors(g);
        printf("  part %d: %" PRIu64 " tensors, %" PRIu64 " data bytes\n", i + 1, gguf_n_tensors(g), data_bytes[i]);
        gguf_close(g);
    }
    CHECK_EQ_INT(sum, n_tensors);

    /* The first part carries the source's metadata entry for entry
     * (gguf_writer_copy_kv), then the three split keys. */
    gguf_ctx *p1 = NULL;
    CHECK_EQ_INT(gguf_open(part[0], &p1, msg, sizeof(msg)), KVS_OK);
    if (p1) {
        CHECK_EQ_INT(gguf_n_kv(p1), gguf_n_kv(src) + 3);
        int same = 1;
        for (uint64_t i = 0; i < gguf_n_kv(src); i++) {
            const gguf_kv *a = gguf_kv_at(src, i), *b = gguf_kv_at(p1, i);
            same &= a->key.len == b->key.len && !memcmp(a->key.ptr, b->key.ptr, a->key.len) && a->type == b->type;
            if (!same) break;
            if (a->type == GGUF_VT_STRING) same &= a->str.len == b->str.len && !memcmp(a->str.ptr, b->str.ptr, a->str.len);
            else if (a->type == GGUF_VT_ARRAY && a->arr_type == GGUF_VT_STRING)
                for (uint64_t k = 0; k < a->arr_n && same; k++)
                    same &= a->arr_strs[k].len == b->arr_strs[k].len &&
                            !memcmp(a->arr_strs[k].ptr, b->arr_strs[k].ptr, a->arr_strs[k].len);
            else if (a->type == GGUF_VT_ARRAY)
                same &= a->arr_type == b->arr_type && a->arr_n == b->arr_n &&
                        !memcmp(a->arr_data, b->arr_data, a->arr_n * gguf_vtype_size(a->arr_type));
            else same &= a->val.u == b->val.u || (a->type == GGUF_VT_F32 && a->val.f == b->val.f);
        }
        CHECK(same);
        gguf_close(p1);
    }

    /* Header-only open: same tables, no data until gguf_map_data, then the same bytes. */
    gguf_ctx *h = NULL;
    CHECK_EQ_INT(gguf_open_header(whole_path, &h, msg, sizeof(msg)), KVS_OK);
    if (h) {
        CHECK_EQ_INT(gguf_n_tensors(h), n_tensors);
        CHECK_EQ_INT(gguf_mapped_data_bytes(h), 0);
        CHECK(gguf_tensor_at(h, 0)->data == NULL);
        gguf_str an;
        CHECK_EQ_INT(gguf_get_str(h, "general.architecture", &an), KVS_OK);
        CHECK(gguf_str_eq(an, "llama"));
        CHECK_EQ_INT(gguf_map_data(h, msg, sizeof(msg)), KVS_OK);
        CHECK_EQ_INT(gguf_mapped_data_bytes(h), gguf_mapped_data_bytes(src));
        int same = 1;
        for (uint64_t i = 0; i < n_tensors; i++) {
            const gguf_tensor *a = gguf_tensor_at(src, i), *b = gguf_tensor_at(h, i);
            same &= a->size == b->size && b->data && !memcmp(a->data, b->data, a->size);
        }
        CHECK(same);
        CHECK_EQ_INT(gguf_map_data(h, msg, sizeof(msg)), KVS_OK); /* a second call changes nothing */
        gguf_close(h);
    }

    /* The split model computes exactly what the whole file computes. */
    engine *w = open_range(whole_path, 0, 0, KV_BUDGET), *s = open_range(part[0], 0, 0, KV_BUDGET);
    CHECK(w && s);
    float *lw = logits_of(w, NULL, 1), *ls = logits_of(s, NULL, 1);
    uint32_t nv = w ? w->m->hp.n_vocab : 0;
    CHECK(lw && ls && memcmp(lw, ls, 7 * (size_t)nv * sizeof(float)) == 0);
    if (s) CHECK_EQ_INT(model_mapped_data_bytes(s->m), data_bytes[0] + data_bytes[1] + data_bytes[2]);
    engine_close(s);

    /* A shard of the second half maps parts 2 and 3 only. The head runs
     * first, so the RssFile growth measured around the tail is the tail's. */
    engine *head = open_range(part[0], 0, 1, KV_BUDGET);
    uint32_t d = head ? head->m->hp.n_embd : 0;
    float *hid = malloc(7 * (size_t)(d ? d : 1) * sizeof(float)), *lht = malloc(7 * (size_t)(nv ? nv : 1) * sizeof(float));
    engine_req hr = {.epoch = 1, .n = 7, .tokens = PROMPT, .out_mode = FWD_OUT_HIDDEN, .out = hid};
    hr.sid.bytes[0] = 2;
    CHECK(head != NULL);
    if (head) {
        CHECK_EQ_INT(engine_step(head, &hr, 1), KVS_OK);
        CHECK_EQ_INT(model_mapped_data_bytes(head->m), data_bytes[0]); /* token_embd + blk.0: part 1 only */
    }
    long rss0 = rss_file_kb();
    engine *tail = open_range(part[0], 1, 2, KV_BUDGET);
    CHECK(tail != NULL);
    if (tail) {
        const gguf_set *files = tail->m->files;
        CHECK_EQ_INT(gguf_set_n_parts(files), 3);
        CHECK_EQ_INT(gguf_mapped_data_bytes(gguf_set_part(files, 0)), 0);
        CHECK_EQ_INT(gguf_mapped_data_bytes(gguf_set_part(files, 1)), data_bytes[1]);
        CHECK_EQ_INT(gguf_mapped_data_bytes(gguf_set_part(files, 2)), data_bytes[2]);
        CHECK_EQ_INT(model_mapped_data_bytes(tail->m), data_bytes[1] + data_bytes[2]);
        engine_req tr = {.epoch = 1, .n = 7, .hidden = hid, .out_mode = FWD_OUT_LOGITS_ALL, .out = lht};
        tr.sid.bytes[0] = 2;
        CHECK_EQ_INT(engine_step(tail, &tr, 1), KVS_OK);
        CHECK(lw && memcmp(lw, lht, 7 * (size_t)nv * sizeof(float)) == 0);
    }
    long rss1 = rss_file_kb();
    printf("shard [1, 2) of the split model: mapped tensor data %" PRIu64 " bytes (parts 2+3: %" PRIu64
           "; part 1, %" PRIu64 " bytes with token_embd, unmapped); RssFile growth opening and running it: %ld kB\n",
           tail ? model_mapped_data_bytes(tail->m) : 0, data_bytes[1] + data_bytes[2], data_bytes[0], rss1 - rss0);
    free(hid);
    engine_close(head);
    engine_close(tail);
    engine_close(w);
    CHECK_EQ_INT(model_split_plan(src, 3, part_of, msg, sizeof(msg)), KVS_OK);
    check_manifest(src, part_of, dir, whole_path, lw);
    free(ls);
    free(lht);

    /* The CLI writes the same layout: `kvshard split --parts 2`, then the
     * first part computes the whole file's logits. */
    const char *bin = getenv("KVS_BIN");
    if (bin && access(bin, X_OK) == 0) {
        char cmd[1200], cli_prefix[256], cli_first[300];
        snprintf(cli_prefix, sizeof(cli_prefix), "%s/cli", dir);
        snprintf(cmd, sizeof(cmd), "'%s' split -m '%s' --parts 2 -o '%s' > /dev/null", bin, whole_path, cli_prefix);
        CHECK_EQ_INT(system(cmd), 0);
        CHECK(gguf_split_path(cli_first, sizeof(cli_first), cli_prefix, 0, 2));
        engine *c = open_range(cli_first, 0, 0, KV_BUDGET);
        float *lc = logits_of(c, NULL, 3);
        CHECK(lw && lc && memcmp(lw, lc, 7 * (size_t)nv * sizeof(float)) == 0);
        free(lc);
        engine_close(c);
        unlink(cli_first);
        CHECK(gguf_split_path(cli_first, sizeof(cli_first), cli_prefix, 1, 2));
        unlink(cli_first);
    } else {
        printf("note: KVS_BIN is not set; the `kvshard split` check is skipped\n");
    }

    printf("refusals:\n");
    expect_open_fails(part[1], KVS_ERR_FORMAT, "is part 2 of 3 of a split model; pass the first part");
    char other[320];
    snprintf(other, sizeof(other), "%s/renamed.gguf", dir);
    CHECK_EQ_INT(link(part[0], other), 0);
    expect_open_fails(other, KVS_ERR_FORMAT, "does not end in -00001-of-00003.gguf");
    unlink(other);
    snprintf(other, sizeof(other), "%s.moved", part[2]);
    CHECK_EQ_INT(rename(part[2], other), 0);
    expect_open_fails(part[0], KVS_ERR_IO, "small-00003-of-00003.gguf: No such file or directory (a split without a kvshard manifest needs every part)");
    /* A part of another split (2 parts) in the third slot. */
    char prefix2[256], p2[300];
    snprintf(prefix2, sizeof(prefix2), "%s/two", dir);
    CHECK_EQ_INT(model_split_plan(src, 2, part_of, msg, sizeof(msg)), KVS_OK);
    CHECK_EQ_INT(gguf_split_write(src, part_of, 2, prefix2, msg, sizeof(msg)), KVS_OK);
    CHECK(gguf_split_path(p2, sizeof(p2), prefix2, 1, 2));
    CHECK_EQ_INT(rename(p2, part[2]), 0);
    expect_open_fails(part[0], KVS_ERR_FORMAT, "split.no 1 / split.count 2, expected 2 / 3");
    /* Writer refusals. */
    for (uint64_t i = 0; i < n_tensors; i++) part_of[i] = 0;
    CHECK_EQ_INT(gguf_split_write(src, part_of, 2, prefix2, msg, sizeof(msg)), KVS_ERR_INVALID_ARG); /* part 2 empty */
    CHECK(strstr(msg, "part 2 would hold no tensor") != NULL);
    CHECK_EQ_INT(gguf_split_write(src, part_of, 0, prefix2, msg, sizeof(msg)), KVS_ERR_INVALID_ARG);

    gguf_close(src);
    free(lw);
    free(part_of);
    unlink(other);
    for (int i = 0; i < 3; i++) unlink(part[i]);
    CHECK(gguf_split_path(p2, sizeof(p2), prefix2, 0, 2));
    unlink(p2);
    unlink(whole_path);
    CHECK_EQ_INT(rmdir(dir), 0);
    return test_finish("test_split", 1, 0);
}
