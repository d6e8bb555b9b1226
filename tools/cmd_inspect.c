/* kvshard inspect: print a GGUF file's version, metadata and tensor table. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "gguf.h"
#include "kvshard.h"
#include "model.h"
#include "quant.h"

#define SHOW_ELEMS 6    /* array elements shown */
#define SHOW_STR_MAX 60 /* bytes of a string shown */

static void inspect_usage(FILE *f) {
    fprintf(f, "usage: kvshard inspect [--all] MODEL.gguf\n"
               "  prints the GGUF version, every metadata key (arrays: element type, count and\n"
               "  the first %d elements; --all prints every element), the tensor table (name,\n"
               "  type, dims, offset, bytes), a count of tensors per type, and what kvshard\n"
               "  reads from it: the architecture's row and features, or why it is refused.\n",
            SHOW_ELEMS);
}

/* Prints a string quoted, escaping control bytes and quotes; at most max bytes (0: all). */
static void print_str(gguf_str s, uint64_t max) {
    uint64_t n = max && s.len > max ? max : s.len;
    putchar('"');
    for (uint64_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s.ptr[i];
        if (c == '"' || c == '\\') printf("\\%c", c);
        else if (c == '\n') fputs("\\n", stdout);
        else if (c < 0x20 || c == 0x7f) printf("\\x%02x", c);
        else putchar(c);
    }
    putchar('"');
    if (n < s.len) printf("...(%" PRIu64 " bytes)", s.len);
}

static void print_scalar(const gguf_kv *kv) {
    switch (kv->type) {
    case GGUF_VT_U8: case GGUF_VT_U16: case GGUF_VT_U32: case GGUF_VT_U64: printf("%" PRIu64, kv->val.u); break;
    case GGUF_VT_I8: case GGUF_VT_I16: case GGUF_VT_I32: case GGUF_VT_I64: printf("%" PRId64, kv->val.i); break;
    case GGUF_VT_F32: case GGUF_VT_F64: printf("%.9g", kv->val.f); break;
    case GGUF_VT_BOOL: fputs(kv->val.b ? "true" : "false", stdout); break;
    case GGUF_VT_STRING: print_str(kv->str, 0); break;
    case GGUF_VT_ARRAY: break;
    }
}

static void print_array(const gguf_kv *kv, bool all) {
    printf("[%s x %" PRIu64 "]", gguf_vtype_name(kv->arr_type), kv->arr_n);
    uint64_t n = all || kv->arr_n <= SHOW_ELEMS ? kv->arr_n : SHOW_ELEMS;
    for (uint64_t i = 0; i < n; i++) {
        fputs(i ? ", " : " ", stdout);
        switch (kv->arr_type) {
        case GGUF_VT_STRING: print_str(kv->arr_strs[i], SHOW_STR_MAX); break;
        case GGUF_VT_F32: case GGUF_VT_F64: printf("%.9g", gguf_arr_f32(kv, i)); break;
        case GGUF_VT_U64: printf("%" PRIu64, (uint64_t)gguf_arr_i64(kv, i)); break;
        case GGUF_VT_BOOL: fputs(gguf_arr_i64(kv, i) ? "true" : "false", stdout); break;
        default: printf("%" PRId64, gguf_arr_i64(kv, i)); break;
        }
    }
    if (n < kv->arr_n) fputs(", ...", stdout);
}

/* The architecture as the loader sees it: the family's features and the
 * hyper-parameters that select them, or the loader's reason for refusing it. */
static void print_arch(const char *path) {
    gguf_set *files = NULL;
    model_hparams hp;
    char msg[KVS_MSG_MAX] = "";
    printf("\narchitecture:\n");
    if (gguf_set_open(path, &files, msg, sizeof msg) != KVS_OK || model_read_hparams(files, &hp, msg, sizeof msg) != KVS_OK) {
        printf("  refused: %s\n", msg);
        gguf_set_close(files);
        return;
    }
    const arch_info *a = hp.arch;
    printf("  %s: %u layers, n_embd %u, %u heads / %u kv heads, head_dim %u, n_ff %u, n_vocab %u\n", a->name,
           hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ff, hp.n_vocab);
    printf("  rope %s, %u dims, base %g, linear scale %g%s\n", a->rope_style == ARCH_ROPE_NEOX ? "neox" : "normal",
           hp.n_rot, (double)hp.rope_base, (double)(1.0f / hp.rope_freq_scale),
           gguf_set_find_tensor(files, "rope_freqs.weight", NULL) ? ", rope_freqs divisors" : "");
    if (a->longrope)
        printf("  LongRoPE: original context %u of %u (%s factors), attn_factor %g\n", hp.n_ctx_orig, hp.n_ctx,
               hp.n_ctx > hp.n_ctx_orig ? "long" : "short", (double)hp.rope_attn_factor);
    if (hp.n_swa)
        printf("  sliding window %u on local layers, every %u%s layer global; local rope base %g, unscaled\n", hp.n_swa,
               hp.swa_period, hp.swa_period == 2 ? "nd" : hp.swa_period == 3 ? "rd" : "th", (double)hp.rope_base_swa);
    printf("  q/k/v biases %s, q/k norm %s, post norms %s, ffn %s, embeddings x sqrt(n_embd) %s, fused qkv %s, "
           "fused gate/up %s, output %s\n",
           a->qkv_bias == ARCH_TENSOR_ABSENT ? "no" : a->qkv_bias == ARCH_TENSOR_REQUIRED ? "yes" : "optional",
           a->qk_norm == ARCH_TENSOR_REQUIRED ? "yes" : "no", a->post_norms ? "yes" : "no",
           a->ffn_act == ARCH_FFN_GELU_TANH ? "GELU(tanh)-gated" : "SwiGLU", a->embd_scale ? "yes" : "no",
           a->fused_qkv ? "when attn_qkv" : "no", a->fused_gate_up ? "yes" : "no",
           gguf_set_find_tensor(files, "output.weight", NULL) ? "untied" : "tied to token_embd");
    gguf_set_close(files);
}

int cmd_inspect(int argc, char **argv) {
    const char *path = NULL;
    bool all = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            inspect_usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--all")) {
            all = true;
        } else if (argv[i][0] == '-' || path) {
            fprintf(stderr, "kvshard inspect: unexpected argument '%s'\n", argv[i]);
            inspect_usage(stderr);
            return 2;
        } else {
            path = argv[i];
        }
    }
    if (!path) {
        inspect_usage(stderr);
        return 2;
    }
    gguf_ctx *g = NULL;
    char msg[KVS_MSG_MAX] = "";
    int rc = gguf_open(path, &g, msg, sizeof msg);
    if (rc) {
        fprintf(stderr, "kvshard inspect: %s\n", msg[0] ? msg : kvs_strerror(rc));
        return 1;
    }
    printf("%s: GGUF v%u, %" PRIu64 " bytes, alignment %" PRIu64 ", data at offset %" PRIu64 "\n", path,
           gguf_version(g), gguf_file_size(g), gguf_alignment(g), gguf_data_offset(g));
    uint32_t split_no = 0, split_count = 0;
    if (gguf_get_u32(g, "split.count", &split_count) == KVS_OK && split_count > 1) {
        (void)gguf_get_u32(g, "split.no", &split_no);
        printf("part %u of %u of a split model (this table lists this part's tensors; -m takes the first part)\n",
               split_no + 1, split_count);
    }
    printf("\nmetadata (%" PRIu64 " keys):\n", gguf_n_kv(g));
    for (uint64_t i = 0; i < gguf_n_kv(g); i++) {
        const gguf_kv *kv = gguf_kv_at(g, i);
        printf("%.*s = ", (int)kv->key.len, kv->key.ptr);
        if (kv->type == GGUF_VT_ARRAY) print_array(kv, all);
        else print_scalar(kv);
        putchar('\n');
    }
    printf("\ntensors (%" PRIu64 "):\n", gguf_n_tensors(g));
    printf("%-5s %-32s %-6s %-24s %14s %14s\n", "#", "name", "type", "dims", "offset", "bytes");
    uint64_t per_type_n[QUANT_TYPE_LIMIT] = {0}, per_type_bytes[QUANT_TYPE_LIMIT] = {0}, total = 0;
    for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
        const gguf_tensor *t = gguf_tensor_at(g, i);
        char dims[96];
        int len = 0;
        for (uint32_t d = 0; d < t->n_dims; d++)
            len += snprintf(dims + len, sizeof dims - (size_t)len, "%s%" PRIu64, d ? ", " : "[", t->ne[d]);
        snprintf(dims + len, sizeof dims - (size_t)len, "]");
        const quant_traits *tr = quant_get_traits(t->type); /* non-NULL: the reader checked */
        printf("%-5" PRIu64 " %-32.*s %-6s %-24s %14" PRIu64 " %14" PRIu64 "\n", i, (int)t->name.len, t->name.ptr,
               tr ? tr->name : "?", dims, t->offset, t->size);
        if (t->type < QUANT_TYPE_LIMIT) {
            per_type_n[t->type]++;
            per_type_bytes[t->type] += t->size;
        }
        total += t->size;
    }
    printf("\ntensor types:\n");
    for (uint32_t ty = 0; ty < QUANT_TYPE_LIMIT; ty++)
        if (per_type_n[ty])
            printf("  %-6s %5" PRIu64 " tensors %14" PRIu64 " bytes\n", quant_get_traits(ty)->name, per_type_n[ty],
                   per_type_bytes[ty]);
    printf("  total  %5" PRIu64 " tensors %14" PRIu64 " bytes\n", gguf_n_tensors(g), total);
    gguf_close(g);
    print_arch(path);
    return 0;
}
