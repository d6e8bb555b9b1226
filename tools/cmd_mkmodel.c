/* kvshard mkmodel: write a llama GGUF with seeded random weights (see src/gguf/mkmodel.h). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "kvshard.h"
#include "mkmodel.h"
#include "quant.h"
#include "util.h"

static void mkmodel_usage(FILE *f) {
    fprintf(f, "usage: kvshard mkmodel -o FILE --shape NAME --type T [--arch A] [--seed S] [-t THREADS] [-q]\n"
               "  writes a valid llama GGUF with seeded random weights and a byte-level vocab;\n"
               "  the same seed gives a byte-identical file.\n"
               "  --arch A      llama (default), qwen3 (q/k norms), gemma3 (q/k norms, post norms,\n"
               "                sliding window 512 on 5 layers of 6, tied output) or phi3 (fused qkv\n"
               "                and gate+up, LongRoPE factors): the shape's sizes as that family\n"
               "  shapes:");
    for (int i = 0; mkmodel_shape_at(i); i++) {
        const mkmodel_shape *s = mkmodel_shape_at(i);
        fprintf(f, "\n    %-15s n_embd %u, %u layers, %u heads, %u kv heads, n_ff %u, vocab %u, ctx %u", s->name,
                s->n_embd, s->n_layer, s->n_head, s->n_head_kv, s->n_ff, s->n_vocab, s->n_ctx);
    }
    fprintf(f, "\n  types: f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 q2_k q3_k q4_k q5_k q6_k iq4_nl iq4_xs,\n"
               "    q4_k_m (llama.cpp's mix: q4_k, with q6_k for output and some attn_v / ffn_down)\n"
               "    (a matrix whose rows don't fit the type's block size falls back to q8_0/f16;\n"
               "    quantization is plain round-to-nearest, not llama.cpp's search)\n"
               "  --seed S      default 1\n"
               "  -t THREADS    default: all CPUs (at most 8)\n"
               "  -q            no progress output\n");
}

typedef struct {
    uint64_t t0;
} progress_state;

static void on_progress(void *user, const char *line) {
    progress_state *p = user;
    fprintf(stderr, "[%7.2fs] %s\n", (double)(kvs_now_ns() - p->t0) / 1e9, line);
}

int cmd_mkmodel(int argc, char **argv) {
    const char *out = NULL, *shape = NULL, *type = NULL;
    mkmodel_params p = mkmodel_default_params();
    bool quiet = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        long v;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            mkmodel_usage(stdout);
            return 0;
        } else if (!strcmp(a, "-o")) {
            if (!args_str(argc, argv, &i, &out)) return 2;
        } else if (!strcmp(a, "--shape")) {
            if (!args_str(argc, argv, &i, &shape)) return 2;
        } else if (!strcmp(a, "--type")) {
            if (!args_str(argc, argv, &i, &type)) return 2;
        } else if (!strcmp(a, "--arch")) {
            if (!args_str(argc, argv, &i, &p.arch)) return 2;
            if (!mkmodel_arch_supported(p.arch)) {
                fprintf(stderr, "kvshard mkmodel: unknown --arch '%s' (llama, qwen3, gemma3, phi3)\n", p.arch);
                return 2;
            }
        } else if (!strcmp(a, "--seed")) {
            if (!args_u64(argc, argv, &i, &p.seed)) return 2;
        } else if (!strcmp(a, "-t") || !strcmp(a, "--threads")) {
            if (!args_int(argc, argv, &i, 1, 64, &v)) return 2;
            p.n_threads = (int)v;
        } else if (!strcmp(a, "-q")) {
            quiet = true;
        } else {
            fprintf(stderr, "kvshard mkmodel: unknown option '%s'\n", a);
            mkmodel_usage(stderr);
            return 2;
        }
    }
    if (!out || !shape || !type) {
        fprintf(stderr, "kvshard mkmodel: -o, --shape and --type are required\n");
        mkmodel_usage(stderr);
        return 2;
    }
    if (!mkmodel_find_shape(shape)) {
        fprintf(stderr, "kvshard mkmodel: unknown shape '%s'\n", shape);
        mkmodel_usage(stderr);
        return 2;
    }
    const bool k_m = !strcmp(type, "q4_k_m");
    int t = k_m ? QUANT_Q4_K : quant_type_from_name(type);
    if (t < 0 || !mkmodel_type_supported((uint32_t)t)) {
        fprintf(stderr, "kvshard mkmodel: unsupported type '%s'\n", type);
        mkmodel_usage(stderr);
        return 2;
    }
    p.shape = shape;
    p.type = (uint32_t)t;
    p.k_m = k_m;
    progress_state ps = {kvs_now_ns()};
    if (!quiet) {
        p.progress = on_progress;
        p.progress_user = &ps;
    }
    char msg[KVS_MSG_MAX] = "";
    int rc = mkmodel_write(out, p, msg, sizeof msg);
    if (rc) {
        fprintf(stderr, "kvshard mkmodel: %s (%s)\n", msg[0] ? msg : kvs_strerror(rc), kvs_strerror(rc));
        return 1;
    }
    if (!quiet) fprintf(stderr, "wrote %s in %.2f s\n", out, (double)(kvs_now_ns() - ps.t0) / 1e9);
    return 0;
}
